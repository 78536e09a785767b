#!/usr/bin/env bash
# Data-parallel training under mpirun (runtime/engine/dist.c): 2 ranks at B=2 train what 1 process trains at
# B=4 (the same losses and parameters, up to the order of the all-reduce's sums), with gradient
# accumulation too; the gradients reduced in buckets, in one all-reduce, or in buckets beside the
# backward give the same checkpoint; so does the optimizer's state sharded (--zero 1: its memory
# saved, its checkpoint resumed at any N); a run of 2 ranks resumes exactly, and its checkpoint
# resumes in 1 process at the doubled batch; a rank that hangs (SIGSTOP) is named by the others, which stop within the timeout; a
# rank killed mid-run stops the run (Open MPI's launcher names it); the checkpoint on disk is whole;
# in fp8 too (the amaxes' all-reduce is watched; tests/cli/fp8.sh checks what fp8 trains over ranks).
# Skips where Open MPI's mpirun is not installed (tools/deps.sh installs it).
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
if ! command -v mpirun >/dev/null || ! mpirun --version 2>/dev/null | grep -q "Open MPI"; then
  echo "[skip] dist: Open MPI's mpirun is not installed (tools/deps.sh installs openmpi-bin)"
  exit 0
fi
tmp=$(mktemp -d)
pid=
trap 'kill -9 $pid 2>/dev/null; rm -rf "$tmp"' EXIT
ok() { echo "[ok] dist: $1"; }
fail() { echo "[fail] dist: $1"; }
# (root in a container: Open MPI refuses root unless told; two ranks on two cores, or fewer)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
mp() { mpirun -np 2 "$m" "$@"; }

mkdir -p "$tmp/corpus"
for i in $(seq 1 12); do head -c $((2500 * i)) /usr/share/common-licenses/GPL-3 | tail -c 2500 >"$tmp/corpus/d$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null || fail "prep"
common=(models/gpt2-tiny.mdl -D T=32 --data "$tmp/data" --backend cpu --precision fp32 --val-every 10 --val-batches 2)

# close A B TOL: every loss and val_loss of two logs within TOL of each other, the same number of each
close() {
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
tol = float(sys.argv[3])
pairs = [(x.get(k), y.get(k)) for x, y in zip(a, b) for k in ("loss", "val_loss")]
bad = [(x, y) for x, y in pairs if (x is None) != (y is None) or (x is not None and abs(x - y) > tol)]
sys.exit(1 if len(a) != len(b) or not a or bad else 0)
PY
}
# params A B TOL: every parameter and moment of two checkpoints within TOL of each other (absolute: the
# keys' bias, whose exact gradient is 0, moves by rounding noise that AdamW scales up to its step size)
params() {
  python3 - "$1" "$2" "$3" <<'PY'
import array, json, struct, sys
def load(p):
    b = open(p, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    return {k: array.array("f", b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in h.items() if k != "__metadata__" and v["dtype"] == "F32"}
a, b = load(sys.argv[1]), load(sys.argv[2])
worst, name = max((max(abs(x - y) for x, y in zip(a[k], b[k])), k) for k in a) if a else (1, "none")
print("%.3g (%s)" % (worst, name))
sys.exit(0 if a.keys() == b.keys() and worst <= float(sys.argv[3]) else 1)
PY
}

# One process at B=4 against two ranks at B=2, 20 steps: the same global batches.
$m run "${common[@]}" -D B=4 --steps 20 --out "$tmp/one" >"$tmp/one.out" 2>&1 || fail "one process: $(tail -3 "$tmp/one.out")"
mp run "${common[@]}" -D B=2 --steps 20 --out "$tmp/two" >"$tmp/two.out" 2>&1 || fail "two ranks: $(tail -3 "$tmp/two.out")"
if close "$tmp/one/log.jsonl" "$tmp/two/log.jsonl" 2e-5; then
  ok "2 ranks at B=2 give the losses of 1 process at B=4 over 20 steps (within 2e-5)"
else
  fail "2 ranks at B=2 against 1 process at B=4: losses differ: $(paste -d'|' "$tmp/one/log.jsonl" "$tmp/two/log.jsonl" | head -c 600)"
fi
worst=$(params "$tmp/one/checkpoint.safetensors" "$tmp/two/checkpoint.safetensors" 1e-5)
[ $? -eq 0 ] && ok "and the parameters and moments after them, within 1e-5 (largest difference $worst)" ||
  fail "the parameters after 20 steps differ: $worst"
if grep -q "^data parallel: 2 ranks (MPI)" "$tmp/two.out" && grep -q "| comm [0-9.]* ms |" "$tmp/two.out" &&
  grep -q "^data parallel over 2 ranks: [0-9]* tok/s a rank; waiting on the all-reduces" "$tmp/two.out" &&
  grep -q '"comm_ms":' "$tmp/two/log.jsonl" && [ "$(grep -c '^step .* | loss' "$tmp/two.out")" -eq "$(grep -c '^step .* | loss' "$tmp/one.out")" ]; then
  ok "rank 0 alone reports: the ranks, the communication time per step and its share, no line twice"
else
  fail "the report of 2 ranks: $(head -c 600 "$tmp/two.out")"
fi

# Buckets: the run above reduced gpt2-tiny's gradients in 25 MiB buckets (the default) after the
# backward; one all-reduce, and 64 KiB buckets reduced beside the backward (--overlap: several, started
# at several points of it, on the engine's thread), give the same checkpoint bit for bit (a sum of two
# ranks' values is one addition, however the buffer is cut and whenever it is reduced).
mp run "${common[@]}" -D B=2 --steps 20 --bucket-mb 0 --out "$tmp/nob" >"$tmp/nob.out" 2>&1
mp run "${common[@]}" -D B=2 --steps 20 --bucket-mb 0.0625 --overlap --out "$tmp/small" >"$tmp/small.out" 2>&1
if cmp -s "$tmp/two/checkpoint.safetensors" "$tmp/nob/checkpoint.safetensors" &&
  cmp -s "$tmp/two/checkpoint.safetensors" "$tmp/small/checkpoint.safetensors" &&
  grep -q '"allreduce_ms":' "$tmp/small/log.jsonl" && grep -q "the rest beside the backward" "$tmp/small.out" &&
  ! grep -q "the rest beside the backward" "$tmp/nob.out"; then
  ok "buckets of 25 MiB, one all-reduce, and 64 KiB buckets reduced beside the backward: the same checkpoint, bit for bit"
else
  fail "buckets: $(tail -2 "$tmp/nob.out") / $(tail -2 "$tmp/small.out")"
fi
$m run "${common[@]}" -D B=2 --steps 1 --bucket-mb lots --out "$tmp/bad" >"$tmp/bad.out" 2>&1
[ $? -eq 2 ] && grep -q -- "--bucket-mb wants megabytes" "$tmp/bad.out" && ok "--bucket-mb that is not a size: a usage error" ||
  fail "--bucket-mb lots: $(cat "$tmp/bad.out")"
# (one of two ranks by its launcher's environment: refused before MPI starts, so no mpirun is needed)
OMPI_COMM_WORLD_SIZE=2 $m run "${common[@]}" -D B=2 --steps 1 --backend cuda --overlap --out "$tmp/bad" >"$tmp/bad.out" 2>&1
[ $? -eq 2 ] && grep -q -- "--overlap shapes the CPU back end's MPI all-reduce; on the CUDA back end NCCL" "$tmp/bad.out" &&
  ok "--overlap (and --bucket-mb) on the CUDA back end: refused, not ignored" || fail "--overlap on CUDA: $(cat "$tmp/bad.out")"

# Gradient accumulation over ranks: the micro-batches' sums are reduced with the step's gradients.
$m run "${common[@]}" -D B=4 --accumulate 2 --steps 6 --out "$tmp/acc1" >"$tmp/acc1.out" 2>&1
mp run "${common[@]}" -D B=2 --accumulate 2 --steps 6 --out "$tmp/acc2" >"$tmp/acc2.out" 2>&1
close "$tmp/acc1/log.jsonl" "$tmp/acc2/log.jsonl" 2e-5 && ok "with --accumulate 2 as well" ||
  fail "--accumulate 2 over 2 ranks: $(tail -3 "$tmp/acc2.out")"
mp run "${common[@]}" -D B=2 --accumulate 2 --steps 6 --zero 1 --bucket-mb 0.01 --overlap --out "$tmp/accz" \
  >"$tmp/accz.out" 2>&1
close "$tmp/acc1/log.jsonl" "$tmp/accz/log.jsonl" 2e-5 &&
  ok "with --accumulate 2, --zero 1 and small buckets beside the backward as well" ||
  fail "--accumulate 2 over 2 ranks with --zero 1: $(tail -3 "$tmp/accz.out")"

# Muon, whose Newton-Schulz products read the gradients: on the MLP's arrays, each rank its slice of
# the examples, 2 ranks at B=16 against 1 process at B=32.
build/tools/blobs "$tmp/blobs" 800 >/dev/null
mlp=(models/mlp.mdl --data "$tmp/blobs" --backend cpu --precision fp32 --steps 6 --set "optimizer=muon(lr=0.02)")
$m run "${mlp[@]}" -D B=32 --out "$tmp/muon1" >"$tmp/muon1.out" 2>&1
mp run "${mlp[@]}" -D B=16 --out "$tmp/muon2" >"$tmp/muon2.out" 2>&1
close "$tmp/muon1/log.jsonl" "$tmp/muon2/log.jsonl" 1e-5 && ok "Muon over 2 ranks: the losses of 1 process at the doubled batch" ||
  fail "Muon over 2 ranks: $(tail -3 "$tmp/muon2.out")"

# Resume: 2 ranks stopped at step 10 and resumed give the straight run's losses; the checkpoint of 2
# ranks resumes in 1 process at B=4.
mp run "${common[@]}" -D B=2 --steps 10 --out "$tmp/half" >/dev/null 2>&1
cp -r "$tmp/half" "$tmp/half1"
mp run "${common[@]}" -D B=2 --steps 20 --out "$tmp/half" --resume >"$tmp/half.out" 2>&1
if cmp -s <(cut -d, -f1-2 "$tmp/two/log.jsonl") <(cut -d, -f1-2 "$tmp/half/log.jsonl"); then
  ok "2 ranks resumed at step 10 continue exactly (the same losses as the straight run, bit for bit)"
else
  fail "2 ranks resumed: $(tail -3 "$tmp/half.out")"
fi
$m run "${common[@]}" -D B=4 --steps 20 --out "$tmp/half1" --resume >"$tmp/half1.out" 2>&1
close "$tmp/two/log.jsonl" "$tmp/half1/log.jsonl" 2e-5 && ok "the checkpoint of 2 ranks resumes in 1 process at B=4" ||
  fail "2 ranks' checkpoint in 1 process: $(tail -3 "$tmp/half1.out")"

# ZeRO stage 1 (--zero 1): each rank updates its share of the parameters and keeps their moments; the
# same losses, parameters and moments as 1 process at the doubled batch, a checkpoint of the same
# format at any number of ranks, and the memory of the other ranks' moments saved.
mp run "${common[@]}" -D B=2 --steps 20 --zero 1 --out "$tmp/z2" >"$tmp/z2.out" 2>&1 || fail "--zero 1: $(tail -3 "$tmp/z2.out")"
close "$tmp/one/log.jsonl" "$tmp/z2/log.jsonl" 2e-5 && ok "--zero 1: 2 ranks at B=2 give the losses of 1 process at B=4 (within 2e-5)" ||
  fail "--zero 1 against 1 process: $(paste -d'|' "$tmp/one/log.jsonl" "$tmp/z2/log.jsonl" | head -c 600)"
worst=$(params "$tmp/one/checkpoint.safetensors" "$tmp/z2/checkpoint.safetensors" 1e-5)
[ $? -eq 0 ] && ok "--zero 1: and the parameters and every moment in its checkpoint, within 1e-5 (largest difference $worst)" ||
  fail "--zero 1: the checkpoint after 20 steps differs: $worst"
grep -q "^ZeRO stage 1: rank 0 updates parameters 0 to [0-9]* of [0-9]* and keeps their moments" "$tmp/z2.out" &&
  grep -q "| comm [0-9.]* ms |" "$tmp/z2.out" && ok "--zero 1: rank 0 names its share; the all-gather is in comm" ||
  fail "--zero 1's report: $(head -c 600 "$tmp/z2.out")"
$m run "${common[@]}" -D B=4 --steps 20 --zero 1 --out "$tmp/z1" >"$tmp/z1.out" 2>&1
cmp -s <(cut -d, -f1-2 "$tmp/one/log.jsonl") <(cut -d, -f1-2 "$tmp/z1/log.jsonl") &&
  ok "--zero 1 in one process: one shard, the losses of the run without it bit for bit" ||
  fail "--zero 1 in one process: $(tail -3 "$tmp/z1.out")"
mp run "${mlp[@]}" -D B=16 --zero 1 --out "$tmp/muonz" >"$tmp/muonz.out" 2>&1
close "$tmp/muon1/log.jsonl" "$tmp/muonz/log.jsonl" 1e-5 && ok "--zero 1 with Muon: the losses of 1 process at the doubled batch" ||
  fail "--zero 1 with Muon: $(tail -3 "$tmp/muonz.out")"
# bf16: the optimizer writes each parameter's bf16 copy, which the next forward reads; they are
# all-gathered with the parameters, so the sharded run is the unsharded one bit for bit.
bf=(models/gpt2-tiny.mdl -D T=32 -D B=2 --data "$tmp/data" --backend cpu --precision bf16 --val-every 5 --val-batches 2
    --steps 10)
mp run "${bf[@]}" --out "$tmp/bf0" >"$tmp/bf0.out" 2>&1
mp run "${bf[@]}" --zero 1 --out "$tmp/bf1" >"$tmp/bf1.out" 2>&1
if [ -s "$tmp/bf0/log.jsonl" ] && cmp -s <(cut -d, -f1-2 "$tmp/bf0/log.jsonl") <(cut -d, -f1-2 "$tmp/bf1/log.jsonl") &&
  params "$tmp/bf0/checkpoint.safetensors" "$tmp/bf1/checkpoint.safetensors" 0 >/dev/null; then
  ok "--zero 1 in bf16 (the bf16 copies gathered too): the losses and checkpoint of 2 ranks without it, bit for bit"
else
  fail "--zero 1 in bf16: $(tail -3 "$tmp/bf1.out")"
fi
# Resume: 2 ranks with --zero 1 stopped at step 10 continue exactly (checkpoints at steps 3, 6 and 9
# on the way change nothing); their checkpoint resumes in 1 process at B=4, and 1 process's
# checkpoint resumes on 2 ranks with --zero 1.
mp run "${common[@]}" -D B=2 --steps 10 --zero 1 --ckpt-every 3 --out "$tmp/zh" >/dev/null 2>&1
cp -r "$tmp/zh" "$tmp/zh1"
mp run "${common[@]}" -D B=2 --steps 20 --zero 1 --out "$tmp/zh" --resume >"$tmp/zh.out" 2>&1
cmp -s <(cut -d, -f1-2 "$tmp/z2/log.jsonl") <(cut -d, -f1-2 "$tmp/zh/log.jsonl") &&
  ok "--zero 1: 2 ranks resumed at step 10 continue exactly (bit for bit)" || fail "--zero 1 resumed: $(tail -3 "$tmp/zh.out")"
$m run "${common[@]}" -D B=4 --steps 20 --out "$tmp/zh1" --resume >"$tmp/zh1.out" 2>&1
close "$tmp/one/log.jsonl" "$tmp/zh1/log.jsonl" 2e-5 && ok "--zero 1: the checkpoint of 2 ranks resumes in 1 process at B=4" ||
  fail "--zero 1's checkpoint in 1 process: $(tail -3 "$tmp/zh1.out")"
$m run "${common[@]}" -D B=4 --steps 10 --out "$tmp/oh" >/dev/null 2>&1
mp run "${common[@]}" -D B=2 --steps 20 --zero 1 --out "$tmp/oh" --resume >"$tmp/oh.out" 2>&1
close "$tmp/one/log.jsonl" "$tmp/oh/log.jsonl" 2e-5 && ok "--zero 1: 1 process's checkpoint resumes on 2 ranks sharded" ||
  fail "1 process's checkpoint on 2 ranks with --zero 1: $(tail -3 "$tmp/oh.out")"
# Memory: a wider model (116 MB of AdamW moments), 2 ranks with and without --zero 1: rank 0's peak
# (the step lines') is smaller by about the other rank's moments, after two checkpoints too (the other
# rank's moments come to rank 0 in memory the steps do not keep), and the checkpoints are the same.
# (Rank 0's peak varies by up to 15 MB from run to run here, more after a checkpoint: transparent
# huge pages, MPI's buffers.)
wide=(models/gpt2-tiny.mdl -D T=128 -D C=768 -D B=2 --data "$tmp/data" --backend cpu --precision fp32 --val-every 0
      --steps 3 --ckpt-every 1)
mp run "${wide[@]}" --out "$tmp/w0" >"$tmp/w0.out" 2>&1
mp run "${wide[@]}" --zero 1 --out "$tmp/w1" >"$tmp/w1.out" 2>&1
# (peak FILE first|last: rank 0's peak on the first step line, before any checkpoint, or the last)
peak() { grep "^step .* | loss" "$1" | { [ "$2" = first ] && head -1 || tail -1; } | sed 's/.*| peak \([0-9]*\) MB.*/\1/'; }
f0=$(peak "$tmp/w0.out" first) f1=$(peak "$tmp/w1.out" first) l0=$(peak "$tmp/w0.out" last) l1=$(peak "$tmp/w1.out" last)
read -r own all < <(sed -n 's/^ZeRO stage 1: rank 0 .*, \([0-9.]*\) MB of \([0-9.]*\) MB$/\1 \2/p' "$tmp/w1.out")
other=$(python3 -c "import sys; print('%.1f' % (float(sys.argv[2]) - float(sys.argv[1])))" "${own:-0}" "${all:-0}")
# (the first step's saving near the other rank's moments; after the checkpoints, still a good part of
# it: gathering them through a buffer of their own would take it all back)
if [ -n "$f0" ] && [ -n "$f1" ] && [ -n "$l0" ] && [ -n "$l1" ] && [ -n "$own" ] &&
  python3 -c "import sys; f0, f1, l0, l1, o = map(float, sys.argv[1:]); sys.exit(0 if 0.6 * o <= f0 - f1 <= 1.5 * o + 2 and l0 - l1 >= 0.3 * o else 1)" \
    "$f0" "$f1" "$l0" "$l1" "$other"; then
  ok "--zero 1: rank 0's peak $f1 MB against $f0 MB without it at step 1, $l1 against $l0 after 2 checkpoints (the other rank's moments: $other MB)"
else
  fail "--zero 1's memory: rank 0's peak $f1 against $f0 MB at step 1, $l1 against $l0 MB after 2 checkpoints; moments ${own:-?} of ${all:-?} MB kept"
fi
worst=$(params "$tmp/w0/checkpoint.safetensors" "$tmp/w1/checkpoint.safetensors" 0)
[ $? -eq 0 ] && ok "--zero 1: and its checkpoint is the one without it, bit for bit" ||
  fail "--zero 1's checkpoint against the run without it: $worst"
# Bad values.
for bad in 2 x -1; do
  out=$($m run "${common[@]}" -D B=4 --steps 1 --zero $bad --out "$tmp/bad" 2>&1)
  [ $? -eq 2 ] && grep -q "zero wants the ZeRO stage, 0 (off) or 1" <<<"$out" || { fail "--zero $bad: $out"; continue; }
done
ok "--zero 2, x, -1: usage errors that say what --zero takes"

# The ranks' pids, by rank, of the run writing to $1 (mpirun starts them as its children).
rank_pid() {
  for p in $(pgrep -f -- "--out $1"); do
    if tr '\0' '\n' </proc/$p/environ 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then echo $p; return; fi
  done
}
# run_until_step DIR [OPTION...]: starts a long run of 2 ranks in the background and waits for its step 3.
run_until_step() {
  local dir=$1
  shift
  mpirun -np 2 "$m" run "${common[@]}" -D B=2 --steps 100000 --val-every 0 --ckpt-every 2 --dist-timeout 5 \
    --out "$dir" "$@" >"$dir.out" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q '"step":3,' "$dir/log.jsonl" 2>/dev/null && break; sleep 0.1; done
}
# A rank that hangs: the other names it and every rank stops within the timeout; with --zero 1 too
# (the all-gather of the updated parameters is one more collective a rank can stop before or in).
for zero in 0 1; do
  run_until_step "$tmp/hang$zero" --zero $zero
  victim=$(rank_pid "$tmp/hang$zero" 1)
  [ -n "$victim" ] && kill -STOP "$victim"
  start=$SECONDS
  for _ in $(seq 600); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  kill -0 $pid 2>/dev/null && { kill -9 $pid; fail "a hung rank: the run did not stop within 60 s"; }
  wait $pid
  rc=$?
  [ -n "$victim" ] && kill -9 "$victim" 2>/dev/null
  # (stopped before a collective, rank 0 names it; stopped inside one, the watchdog ends rank 0)
  if [ -n "$victim" ] && [ $rc -ne 0 ] &&
    grep -Eq "mdlc: rank 0: (rank 1 did not reach .* of step [0-9]* within 5 s \(dead or hung\)|.* did not complete within 5 s of every rank reaching it)" "$tmp/hang$zero.out"; then
    ok "--zero $zero: a hung rank is named by rank 0 and every rank stops (status $rc, after $((SECONDS - start)) s)"
  else
    fail "--zero $zero: a hung rank (pid ${victim:-none}, status $rc): $(tail -5 "$tmp/hang$zero.out")"
  fi
done
python3 -c "import sys; b=open(sys.argv[1],'rb').read(); sys.exit(0 if len(b) > 8 else 1)" "$tmp/hang0/checkpoint.safetensors" &&
  $m eval "$tmp/hang0/checkpoint.safetensors" --data "$tmp/data" --backend cpu --val-batches 1 >/dev/null 2>&1 &&
  ok "the checkpoint a hung run leaves is whole (eval reads it)" || fail "the hung run's checkpoint"

# The same where the gradients are reduced on the engine's thread beside the backward (--overlap): the
# thread names the rank and stops every rank.
run_until_step "$tmp/hang2" --overlap --bucket-mb 0.0625
victim=$(rank_pid "$tmp/hang2" 1)
[ -n "$victim" ] && kill -STOP "$victim"
start=$SECONDS
for _ in $(seq 600); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
kill -0 $pid 2>/dev/null && { kill -9 $pid; fail "a hung rank with --overlap: the run did not stop within 60 s"; }
wait $pid
rc=$?
[ -n "$victim" ] && kill -9 "$victim" 2>/dev/null
if [ -n "$victim" ] && [ $rc -ne 0 ] &&
  grep -Eq "mdlc: rank 0: (rank 1 did not reach .* of step [0-9]* within 5 s \(dead or hung\)|.* did not complete within 5 s of every rank reaching it)" "$tmp/hang2.out"; then
  ok "with --overlap too (status $rc, after $((SECONDS - start)) s)"
else
  fail "a hung rank with --overlap (pid ${victim:-none}, status $rc): $(tail -5 "$tmp/hang2.out")"
fi

# Precision fp8: each step adds the all-reduce of the fp8 amaxes (its first collective, after the
# backward), checked in and watched as the others are.
run_until_step "$tmp/hang8" --precision fp8
victim=$(rank_pid "$tmp/hang8" 1)
[ -n "$victim" ] && kill -STOP "$victim"
start=$SECONDS
for _ in $(seq 600); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
kill -0 $pid 2>/dev/null && { kill -9 $pid; fail "a hung rank in fp8: the run did not stop within 60 s"; }
wait $pid
rc=$?
[ -n "$victim" ] && kill -9 "$victim" 2>/dev/null
if [ -n "$victim" ] && [ $rc -ne 0 ] &&
  grep -Eq "mdlc: rank 0: (rank 1 did not reach .* of step [0-9]* within 5 s \(dead or hung\)|.* did not complete within 5 s of every rank reaching it)" "$tmp/hang8.out"; then
  ok "in fp8 too (status $rc, after $((SECONDS - start)) s, \"$(grep -Eo 'mdlc: rank 0: [^;(]*' "$tmp/hang8.out" | head -1 | cut -c15-)\")"
else
  fail "a hung rank in fp8 (pid ${victim:-none}, status $rc): $(tail -5 "$tmp/hang8.out")"
fi

# A rank killed mid-run: the run stops with a non-zero status, the launcher naming the rank.
run_until_step "$tmp/kill"
victim=$(rank_pid "$tmp/kill" 1)
[ -n "$victim" ] && kill -9 "$victim"
for _ in $(seq 600); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
kill -0 $pid 2>/dev/null && { kill -9 $pid; fail "a killed rank: the run did not stop within 60 s"; }
wait $pid
rc=$?
if [ -n "$victim" ] && [ $rc -ne 0 ] && grep -qi "rank 1" "$tmp/kill.out"; then
  ok "a killed rank stops the run (status $rc), named"
else
  fail "a killed rank (pid ${victim:-none}, status $rc): $(tail -5 "$tmp/kill.out")"
fi
pid=

