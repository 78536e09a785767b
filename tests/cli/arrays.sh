#!/usr/bin/env bash
# `mdlc run` on a dataset of named arrays (.npy, .npz): models/mlp.mdl learns build/tools/blobs's
# classes well above chance on held-out data; its accuracy output is a metric in the step lines,
# log.jsonl and loss.svg, and `mdlc eval` reproduces the run's last validation; a run stopped and
# resumed gives the losses of an uninterrupted one; bad datasets are refused before compiling with
# the file, the array or the missing input named. Token shards: pos and doc only where the model reads
# them.
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
check() { # check NAME CONDITION (a shell expression)
  if eval "$2"; then echo "[ok] arrays: $1"; else echo "[fail] arrays: $1: $(head -c 400 "$tmp/err" 2>/dev/null)"; fi
}
field() { sed -n "s/.*\"$2\":\\([-0-9.e]*\\).*/\\1/p" "$1"; } # field LOG KEY: its values, line by line

build/tools/blobs "$tmp/blobs" 2000 >/dev/null || echo "[fail] arrays: build/tools/blobs failed"

# Training to an accuracy on held-out data (chance: 0.25; the classes' overlap allows about 0.9).
$m run models/mlp.mdl --data "$tmp/blobs" --steps 300 --val-every 100 --val-batches 12 --backend cpu \
  --out "$tmp/run" >"$tmp/run.out" 2>"$tmp/err"
rc=$?
acc=$(field "$tmp/run/log.jsonl" val_acc | tail -1)
check "mlp trains on blobs to a held-out accuracy above 0.8 (got ${acc:-none})" \
  "[ $rc -eq 0 ] && [ -n '$acc' ] && awk 'BEGIN { exit !($acc > 0.8) }'"
check "the data line counts examples: 2000 train, 400 held out (val/), 12 validation batches" \
  "grep -q 'data .*: 2000 train examples, 400 held out for validation (12 batches); shuffled batches of 32' '$tmp/run.out'"
check "every step of log.jsonl has the metric acc, each validation val_acc and val_loss" \
  "[ \$(field '$tmp/run/log.jsonl' acc | wc -l) -eq 300 ] && [ \$(grep -c '\"val_loss\":.*\"val_acc\"' '$tmp/run/log.jsonl') -eq 3 ]"
check "the step lines show acc and ex/s, the validation lines val acc" \
  "grep -q '| loss [0-9.]* | acc [0-9.]* | lr .* ex/s | MFU' '$tmp/run.out' && grep -q 'val loss [0-9.]* | val acc [0-9.]*$' '$tmp/run.out'"
check "loss.svg draws the metric" "grep -q 'acc (seagreen)' '$tmp/run/loss.svg' && grep -q 'stroke=\"seagreen\"' '$tmp/run/loss.svg'"
$m eval "$tmp/run/checkpoint.safetensors" --data "$tmp/blobs" --val-batches 12 --backend cpu >"$tmp/eval.out" 2>"$tmp/err"
ran=$(field "$tmp/run/log.jsonl" val_loss | tail -1) got=$(sed -n 's/^val loss \([0-9.]*\) over 12 validation batches of 32 examples$/\1/p' "$tmp/eval.out")
ran_acc=$(awk -v a="$acc" 'BEGIN { printf "%.4f", a }') got_acc=$(awk '$1 == "acc" { printf "%.4f", $2 }' "$tmp/eval.out")
$m sample "$tmp/run/checkpoint.safetensors" >/dev/null 2>"$tmp/sample.err"
rc=$?
check "sample on a classifier's checkpoint says sampling is for language models (status 1)" \
  "[ $rc -eq 1 ] && grep -q 'cannot sample: its model has no sequence dim' '$tmp/sample.err'"
check "eval of the checkpoint gives the run's last val loss ($ran: $got) and acc ($ran_acc: $got_acc)" \
  "[ -n '$got' ] && awk 'BEGIN { exit !($ran - $got < 1e-4 && $got - $ran < 1e-4) }' && [ '$ran_acc' = '$got_acc' ]"

# Resume: 12 steps at once, or 5 then resumed to 12: the same losses (shuffled: the position in the
# epoch's permutation is in the checkpoint). 2000 / 32 is not whole: the batches cross an epoch's end.
common=(--data "$tmp/blobs" --val-every 0 --backend cpu -D B=300)
$m run models/mlp.mdl "${common[@]}" --steps 12 --out "$tmp/a" >/dev/null 2>"$tmp/err"
$m run models/mlp.mdl "${common[@]}" --steps 5 --out "$tmp/b" >/dev/null 2>>"$tmp/err"
$m run models/mlp.mdl "${common[@]}" --steps 12 --out "$tmp/b" --resume >"$tmp/resumed" 2>>"$tmp/err"
check "5 steps + resume to 12 give the losses and accuracies of 12 uninterrupted steps" \
  "grep -q 'resumed from' '$tmp/resumed' && [ \$(field '$tmp/a/log.jsonl' loss | wc -l) -eq 12 ] &&
   diff <(field '$tmp/a/log.jsonl' loss; field '$tmp/a/log.jsonl' acc) <(field '$tmp/b/log.jsonl' loss; field '$tmp/b/log.jsonl' acc) >/dev/null"
$m run models/mlp.mdl "${common[@]}" --steps 1 --no-shuffle --out "$tmp/c" >/dev/null 2>"$tmp/err"
check "--no-shuffle draws another first batch than the shuffled run of the same seed" \
  "[ -n \"\$(field '$tmp/c/log.jsonl' loss)\" ] && [ \"\$(field '$tmp/c/log.jsonl' loss)\" != \"\$(field '$tmp/a/log.jsonl' loss | head -1)\" ]"

# One .npz file (np.savez's layout, written by Python's zipfile): the val split held out of it.
if command -v python3 >/dev/null; then
  zipit() { python3 -c 'import sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w", getattr(zipfile, sys.argv[2])) as z:
    [z.write(f, f.rsplit("/", 1)[-1]) for f in sys.argv[3:]]' "$@"; }
  zipit "$tmp/set.npz" ZIP_STORED "$tmp/blobs/x.npy" "$tmp/blobs/targets.npy"
  $m run models/mlp.mdl --data "$tmp/set.npz" --steps 3 --val-fraction 0.1 --backend cpu --out "$tmp/z" >"$tmp/z.out" 2>"$tmp/err"
  rc=$?
  check "a single .npz trains, --val-fraction 0.1 of its examples held out" \
    "[ $rc -eq 0 ] && grep -q '1800 train examples, 200 held out' '$tmp/z.out'"
  zipit "$tmp/small.npz" ZIP_DEFLATED "$tmp/blobs/x.npy" "$tmp/blobs/targets.npy"
  $m run models/mlp.mdl --data "$tmp/small.npz" --steps 3 --backend cpu --out "$tmp/y" >/dev/null 2>"$tmp/err"
  rc=$?
  check "a compressed .npz is refused, saying to save with np.savez" \
    "[ $rc -eq 1 ] && grep -q 'small.npz: error: x.npy: compressed (np.savez_compressed): save the arrays with np.savez' '$tmp/err'"
else
  echo "[skip] arrays: .npz from Python's zipfile: no python3"
fi

# Refusals before anything is compiled: no "compiled" line, exit status 1, the culprit named.
sed 's/^dim N = 16 /dim N = 15 /' models/mlp.mdl >"$tmp/n15.mdl"
$m run "$tmp/n15.mdl" --data "$tmp/blobs" --steps 1 --backend cpu --out "$tmp/f" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "an example of another shape is refused before compiling, naming the file and the array" \
  "[ $rc -eq 1 ] && ! grep -q compiled '$tmp/out' && grep -q 'blobs/x.npy: error: array .x. is \[2000,16\], the model.s input .x. is f32\[32,15\]' '$tmp/err'"
mkdir -p "$tmp/nolabels/val"
cp "$tmp/blobs/x.npy" "$tmp/nolabels/"
cp "$tmp/blobs/val/x.npy" "$tmp/nolabels/val/"
$m run models/mlp.mdl --data "$tmp/nolabels" --steps 1 --backend cpu --out "$tmp/g" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a missing input is named before compiling" \
  "[ $rc -eq 1 ] && ! grep -q compiled '$tmp/out' && grep -q \"no array 'targets' in the train split for the model's input targets: i32\[32\]\" '$tmp/err'"

# Token shards: a model without doc trains (pos and doc are fed where the model reads them); a model
# reading an input that shards do not give is refused, naming it.
mkdir -p "$tmp/corpus"
head -c 6000 /usr/share/common-licenses/GPL-3 >"$tmp/corpus/a.txt"
$m prep "$tmp/corpus" -o "$tmp/shards" >/dev/null 2>&1
sed -e '/^input doc/d' -e 's/, doc=doc)/)/' models/gpt2-tiny.mdl >"$tmp/nodoc.mdl"
printf 'output zmean = mean(logits)\n' >>"$tmp/nodoc.mdl"
$m run "$tmp/nodoc.mdl" --data "$tmp/shards" -D B=2 -D T=16 --steps 2 --val-every 2 --val-batches 1 --backend cpu \
  --out "$tmp/h" >"$tmp/h.out" 2>"$tmp/err"
rc=$?
check "a language model without a doc input trains on shards" "[ $rc -eq 0 ] && [ \$(wc -l <'$tmp/h/log.jsonl') -eq 2 ]"
check "a language model's scalar output is a metric: each step's line and log, and the validation's" \
  "[ \$(field '$tmp/h/log.jsonl' zmean | wc -l) -eq 2 ] && grep -q '\"val_zmean\":' '$tmp/h/log.jsonl' &&
   grep -q '| loss [0-9.]* | zmean [-0-9.]* | lr' '$tmp/h.out' && grep -q 'unigram entropy [0-9.]*) | val zmean' '$tmp/h.out'"
$m run models/mlp.mdl --data "$tmp/shards" --steps 1 --backend cpu --out "$tmp/i" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a model without token inputs is refused on shards, naming what is missing, before compiling" \
  "[ $rc -eq 1 ] && ! grep -q compiled '$tmp/out' && grep -q 'the model has no dim T; a model of other inputs trains on an array dataset' '$tmp/err'"
$m lab models/mlp.mdl --data "$tmp/blobs" --steps 1 --backend cpu --out "$tmp/lab" >/dev/null 2>"$tmp/err"
rc=$?
check "lab refuses arrays (its rows measure token pipelines), saying so" \
  "[ $rc -eq 1 ] && grep -q 'lab measures language models on token shards' '$tmp/err' && [ ! -e '$tmp/lab' ]"

# Held-out inputs, finite but near float32's largest, that make the outputs overflow while training
# stays finite: the run stops at the validation, saying why (its reason was once empty). (Inputs that
# are not finite are refused when the arrays are opened: below.)
mkdir -p "$tmp/infval/val"
cp "$tmp/blobs/x.npy" "$tmp/blobs/targets.npy" "$tmp/infval/"
cp "$tmp/blobs/val/targets.npy" "$tmp/infval/val/"
python3 - "$tmp/blobs/val/x.npy" "$tmp/infval/val/x.npy" <<'PY'
import struct, sys
raw = open(sys.argv[1], 'rb').read()
start = 10 + struct.unpack('<H', raw[8:10])[0]  # .npy 1.0: magic, version, header length, header
open(sys.argv[2], 'wb').write(raw[:start] + struct.pack('<f', 3e38) * ((len(raw) - start) // 4))
PY
cat >"$tmp/lin.mdl" <<'M'
model lin
dim B in 1..4096
input x: f32[B, 16]
input targets: i32[B]
param w: [16, 4] = normal(0.25)
output loss = mean(cross_entropy((x * 10) @ w, targets))
train {
    B = 32
    optimizer = adamw(lr=1e-2)
}
M
$m run "$tmp/lin.mdl" --data "$tmp/infval" --steps 2 --val-every 2 --backend cpu --out "$tmp/iv" >/dev/null 2>"$tmp/err"
rc=$?
check "a validation loss that is NaN stops the run with the reason (status $rc)" \
  "[ $rc -eq 1 ] && grep -q 'validation at step 2: the validation loss is NaN' '$tmp/err'"

# Bad values are found when the arrays are opened, before anything is compiled, naming the file, the
# array and the example (they were once found when the row was drawn, blaming the model's gradient,
# or in the kernel, naming neither file nor row): a NaN feature of train example 11, a target of 4
# in a model of 4 classes at example 7. python3 -c writes them from the .npy's own layout.
poke() { # poke SRC DST INDEX FORMAT VALUE: a copy of the .npy SRC with element INDEX set to VALUE
  python3 - "$@" <<'PY'
import struct, sys
raw = bytearray(open(sys.argv[1], 'rb').read())
start = 10 + struct.unpack('<H', raw[8:10])[0]
size = struct.calcsize('<' + sys.argv[4])
raw[start + int(sys.argv[3]) * size:start + (int(sys.argv[3]) + 1) * size] = struct.pack('<' + sys.argv[4], eval(sys.argv[5]))
open(sys.argv[2], 'wb').write(raw)
PY
}
mkdir -p "$tmp/nanx/val" "$tmp/bigy/val"
cp -r "$tmp/blobs/val" "$tmp/nanx/" && cp -r "$tmp/blobs/val" "$tmp/bigy/"
cp "$tmp/blobs/targets.npy" "$tmp/nanx/" && cp "$tmp/blobs/x.npy" "$tmp/bigy/"
poke "$tmp/blobs/x.npy" "$tmp/nanx/x.npy" $((11 * 16 + 5)) f 'float("nan")'
poke "$tmp/blobs/targets.npy" "$tmp/bigy/targets.npy" 7 i 4
$m run models/mlp.mdl --data "$tmp/nanx" --steps 20 --backend cpu --out "$tmp/nx" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a NaN feature is refused when the arrays are opened, naming the file, the array and the example" \
  "[ $rc -eq 1 ] && grep -q 'nanx/x.npy: error: array .x., example 11, element 5 is nan' '$tmp/err' &&
   ! grep -q compiled '$tmp/out' && [ ! -e '$tmp/nx' ]"
$m run models/mlp.mdl --data "$tmp/bigy" --steps 20 --backend cpu --out "$tmp/by" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a target beyond the class count is refused when opened, naming the file, the example and the loss" \
  "[ $rc -eq 1 ] && grep -q \"bigy/targets.npy: error: array 'targets', example 7 is 4, not below 4: the model's input 'targets' is the targets of a cross_entropy (models/mlp.mdl:[0-9]*:[0-9]*) over 4 classes\" '$tmp/err' &&
   ! grep -q compiled '$tmp/out'"
