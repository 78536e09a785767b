#!/usr/bin/env bash
# The optimizers other than AdamW, lr_scale and freeze in `mdlc run` (models/mlp.mdl on
# build/tools/blobs's data, CPU): SGD with momentum, Lion and Muon train the loss down; a run stopped
# and resumed gives the losses of an uninterrupted one (the moments are in the checkpoint: SGD with
# momentum and Lion keep m, plain SGD nothing, Muon m for its matrices and AdamW's m and v for the
# rest); a muon run and `mdlc check` say which params take Muon; under a schedule Muon's lr is what
# log.jsonl records and adam_lr leaves an all-Muon model's run as it was (interpreter and C back
# end); resuming with another optimizer is refused with both named; a frozen param leaves the run
# bit for bit as it came in (the checkpoint of step 1 and of step 20 hold the same bytes); `mdlc
# check` marks the frozen and scaled params.
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
check() { # check NAME CONDITION (a shell expression)
  if eval "$2"; then echo "[ok] optim: $1"; else echo "[fail] optim: $1: $(head -c 400 "$tmp/err" 2>/dev/null)"; fi
}
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([0-9.]*\).*/\1 \2/p' "$1/log.jsonl"; }
# tensors CKPT: "name sha256-of-its-bytes" per tensor, sorted (safetensors: u64 header size, JSON header)
tensors() {
  python3 - "$1" 2>/dev/null <<'PY'
import hashlib, json, struct, sys
f = open(sys.argv[1], "rb")
n = struct.unpack("<Q", f.read(8))[0]
h = json.loads(f.read(n))
data = f.read()
for k in sorted(h):
    if k != "__metadata__":
        a, b = h[k]["data_offsets"]
        print(k, hashlib.sha256(data[a:b]).hexdigest())
PY
}
variant() { # variant NAME TRAIN-LINES: models/mlp.mdl with its optimizer line replaced
  awk -v t="$2" '/optimizer = / { print t; next } { print }' models/mlp.mdl >"$tmp/$1.mdl"
}

build/tools/blobs "$tmp/blobs" 2000 >/dev/null || echo "[fail] optim: build/tools/blobs failed"
common=(--data "$tmp/blobs" --val-every 0 --backend cpu)
variant sgd '    optimizer = sgd(lr=0.05, momentum=0.9, nesterov=true, weight_decay=0.01)'
variant plain '    optimizer = sgd(lr=0.05)'
variant lion '    optimizer = lion(lr=1e-3, weight_decay=0.1)
    lr_scale = {"b*": 0.5}'
variant muon '    optimizer = muon(lr=0.02, adam_lr=1e-2)'
variant frozen '    optimizer = sgd(lr=0.05, momentum=0.9)
    freeze = ["w1", "b1"]
    lr_scale = {"w3": 2}'

for v in sgd lion muon; do
  $m run "$tmp/$v.mdl" "${common[@]}" --steps 60 --out "$tmp/$v-a" >/dev/null 2>"$tmp/err"
  first=$(losses "$tmp/$v-a" | head -5 | awk '{ s += $2 } END { print s / NR }')
  last=$(losses "$tmp/$v-a" | tail -5 | awk '{ s += $2 } END { print s / NR }')
  check "$v: 60 steps bring the loss down by half (from ${first:-?} to ${last:-?}, means of 5 steps)" \
    "[ -n '$last' ] && awk 'BEGIN { exit !($last < 0.5 * $first) }'"
  $m run "$tmp/$v.mdl" "${common[@]}" --steps 25 --out "$tmp/$v-b" >/dev/null 2>"$tmp/err"
  $m run "$tmp/$v.mdl" "${common[@]}" --steps 60 --out "$tmp/$v-b" --resume >/dev/null 2>"$tmp/err"
  check "$v: 25 steps + resume to 60 give the losses of 60 uninterrupted steps" \
    "[ \$(losses '$tmp/$v-a' | wc -l) -eq 60 ] && diff <(losses '$tmp/$v-a') <(losses '$tmp/$v-b') >/dev/null"
done
$m run "$tmp/plain.mdl" "${common[@]}" --steps 3 --out "$tmp/plain" >/dev/null 2>"$tmp/err"
check "the checkpoints hold the moments their optimizer keeps (sgd with momentum and lion m, plain sgd none)" \
  "tensors '$tmp/sgd-a/checkpoint.safetensors' | grep -q '^w1.m ' && ! tensors '$tmp/sgd-a/checkpoint.safetensors' | grep -q '\.v ' &&
   tensors '$tmp/lion-a/checkpoint.safetensors' | grep -q '^b3.m ' && ! tensors '$tmp/lion-a/checkpoint.safetensors' | grep -q '\.v ' &&
   [ \$(tensors '$tmp/plain/checkpoint.safetensors' | wc -l) -eq 6 ]"

check "muon's checkpoint: m for the hidden matrices (w1, w2), m and v for the AdamW params (w3 the head, biases)" \
  "tensors '$tmp/muon-a/checkpoint.safetensors' | grep -q '^w1.m ' && tensors '$tmp/muon-a/checkpoint.safetensors' | grep -q '^w2.m ' &&
   ! tensors '$tmp/muon-a/checkpoint.safetensors' | grep -q '^w[12].v ' && tensors '$tmp/muon-a/checkpoint.safetensors' | grep -q '^w3.v ' &&
   tensors '$tmp/muon-a/checkpoint.safetensors' | grep -q '^b1.v '"
$m run "$tmp/muon.mdl" "${common[@]}" --steps 1 --out "$tmp/muon-c" >"$tmp/out" 2>"$tmp/err"
check "a muon run says which params take Muon and which AdamW" \
  "grep -q '^optimizer muon: Muon for 2 hidden matrices: w1 w2; AdamW for the other 4 params$' '$tmp/out'"
$m check "$tmp/muon.mdl" >"$tmp/out" 2>"$tmp/err"
check "mdlc check marks each param muon or adamw (the LM head w3 adamw)" \
  "grep -q '^param  w1 .*(muon)' '$tmp/out' && grep -q '^param  w3 .*(adamw)' '$tmp/out' && grep -q '^optimizer muon: ' '$tmp/out'"

# Muon under a schedule, on the interpreter and the C back end: the matrices (the head w3 too) all
# take Muon and nothing else trains, so log.jsonl's lr is Muon's schedule, from lr = 0.02 down to
# min_lr, and adam_lr leaves the run bit for bit as it was.
awk '/^param b/ || /optimizer = / || /schedule = / || /no_decay/ { next } { sub(/ \+ b[123]/, ""); print }
     /^train/ { print "    optimizer = muon(lr=0.02, weight_decay=0.01, adam_lr=ADAM)"
                print "    muon_params = [\"w*\"]"; print "    schedule = cosine(warmup=2, min_lr=0.002, steps=6)" }' \
  models/mlp.mdl >"$tmp/allmuon.in"
for a in 1e-3 1e-2; do sed "s/ADAM/$a/" "$tmp/allmuon.in" >"$tmp/allmuon-$a.mdl"; done
rates() { sed -n 's/.*"step":\([0-9]*\),.*"lr":\([0-9.e+-]*\),.*/\1 \2/p' "$1/log.jsonl"; }
for b in interp cpu; do
  for a in 1e-3 1e-2; do
    $m run "$tmp/allmuon-$a.mdl" --data "$tmp/blobs" --val-every 0 --backend $b --steps 8 \
      --out "$tmp/allmuon-$b-$a" >/dev/null 2>"$tmp/err"
  done
  check "muon on $b: log.jsonl's lr is Muon's cosine from lr 0.02 (warmup 2) to min_lr 0.002, for adam_lr 1e-3 and 1e-2" \
    "[ \$(rates '$tmp/allmuon-$b-1e-3' | wc -l) -eq 8 ] && diff <(rates '$tmp/allmuon-$b-1e-3') <(rates '$tmp/allmuon-$b-1e-2') >/dev/null &&
     rates '$tmp/allmuon-$b-1e-3' | awk '{ t = \$1; pi = atan2(0, -1)
       w = t <= 2 ? 0.02 * t / 2 : t >= 6 ? 0.002 : 0.002 + 0.009 * (1 + cos(pi * (t - 2) / 4))
       if (\$2 < w * (1 - 1e-5) || \$2 > w * (1 + 1e-5)) exit 1 }'"
  check "muon on $b: a model all of whose params take Muon trains bit for bit alike with adam_lr 1e-3 and 1e-2" \
    "[ -s '$tmp/allmuon-$b-1e-3/checkpoint.safetensors' ] &&
     [ \"\$(tensors '$tmp/allmuon-$b-1e-3/checkpoint.safetensors' | grep '^w')\" = \"\$(tensors '$tmp/allmuon-$b-1e-2/checkpoint.safetensors' | grep '^w')\" ]"
done

# Another optimizer cannot continue a checkpoint: refused, both named, nothing written.
before=$(tensors "$tmp/sgd-a/checkpoint.safetensors" | sha256sum)
$m run "$tmp/lion.mdl" "${common[@]}" --steps 80 --out "$tmp/sgd-a" --resume >"$tmp/out" 2>"$tmp/err"
rc=$?
check "resuming an sgd checkpoint with lion is refused (status 1), both named" \
  "[ $rc -eq 1 ] && grep -q 'checkpoint of a run with optimizer sgd, this run uses lion' '$tmp/err' &&
   [ \"\$(tensors '$tmp/sgd-a/checkpoint.safetensors' | sha256sum)\" = '$before' ]"

# freeze: the frozen params' bytes after 1 step and after 20 are the initial ones; the others train.
$m run "$tmp/frozen.mdl" "${common[@]}" --steps 1 --out "$tmp/f1" >/dev/null 2>"$tmp/err"
$m run "$tmp/frozen.mdl" "${common[@]}" --steps 20 --out "$tmp/f20" >/dev/null 2>"$tmp/err"
tensors "$tmp/f1/checkpoint.safetensors" >"$tmp/f1.sums"
tensors "$tmp/f20/checkpoint.safetensors" >"$tmp/f20.sums"
check "frozen w1 and b1 are bit for bit the same after 1 and 20 steps, w2 is not; they have no moments" \
  "[ \"\$(grep '^w1 ' '$tmp/f1.sums')\" = \"\$(grep '^w1 ' '$tmp/f20.sums')\" ] &&
   [ \"\$(grep '^b1 ' '$tmp/f1.sums')\" = \"\$(grep '^b1 ' '$tmp/f20.sums')\" ] &&
   [ \"\$(grep '^w2 ' '$tmp/f1.sums')\" != \"\$(grep '^w2 ' '$tmp/f20.sums')\" ] && ! grep -q '^w1.m\|^b1.m' '$tmp/f20.sums'"
$m check "$tmp/frozen.mdl" >"$tmp/out" 2>"$tmp/err"
check "mdlc check marks the frozen params and the scaled one" \
  "grep -q '^param  w1 .*(frozen)' '$tmp/out' && grep -q '^param  b1 .*(frozen)' '$tmp/out' &&
   grep -q '^param  w3 .*(lr x 2)' '$tmp/out' && ! grep -q '^param  w2 .*(frozen)' '$tmp/out'"
