#!/usr/bin/env bash
# Checkpoints: a run stopped and resumed gives the same losses as an uninterrupted one (same
# parameters, moments, data position and dropout seeds); a kill -9 at any moment leaves the last
# checkpoint readable and resumable; SIGTERM and Ctrl-C (SIGINT) write the checkpoint of the step
# under way and stop; bad checkpoints are refused with the file named.
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'kill -9 $pid 2>/dev/null; rm -rf "$tmp"' EXIT
pid=
ok() { echo "[ok] resume: $1"; }
fail() { echo "[fail] resume: $1"; }

mkdir -p "$tmp/corpus"
for i in $(seq 1 12); do head -c $((2500 * i)) /usr/share/common-licenses/GPL-3 | tail -c 2500 >"$tmp/corpus/d$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null || fail "prep"
common=(-D B=2 -D T=32 --data "$tmp/data" --val-every 0 --shuffle)
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([0-9.]*\).*/\1 \2/p' "$1/log.jsonl"; }

for backend in cpu interp; do
  $m run models/gpt2-tiny.mdl "${common[@]}" --backend $backend --steps 10 --out "$tmp/a-$backend" >/dev/null 2>&1
  $m run models/gpt2-tiny.mdl "${common[@]}" --backend $backend --steps 4 --out "$tmp/b-$backend" >/dev/null 2>&1
  $m run models/gpt2-tiny.mdl "${common[@]}" --backend $backend --steps 10 --out "$tmp/b-$backend" --resume \
    >"$tmp/resumed" 2>&1
  grep -q "resumed from" "$tmp/resumed" && ok "$backend: the run says it resumed" || fail "$backend: no resume line"
  if [ "$(losses "$tmp/a-$backend" | wc -l)" -eq 10 ] && diff <(losses "$tmp/a-$backend") <(losses "$tmp/b-$backend") >"$tmp/d"; then
    ok "$backend: 4 steps + resume to 10 give the losses of 10 uninterrupted steps"
  else
    fail "$backend: resumed losses differ: $(head -c 400 "$tmp/d")"
  fi
done

# The order of the batches is the checkpoint's: a run trained with --no-shuffle --no-pack --seed 7
# and resumed with none of them goes on with its batches (the losses of an uninterrupted run); one of
# them given with another value is refused before anything is compiled, the option and both values
# named, the checkpoint untouched; a checkpoint written before they were recorded resumes with
# today's defaults, saying so.
ord=(-D B=2 -D T=32 --data "$tmp/data" --val-every 0 --backend cpu)
$m run models/gpt2-tiny.mdl "${ord[@]}" --no-shuffle --no-pack --seed 7 --steps 6 --out "$tmp/o-straight" >/dev/null 2>&1
$m run models/gpt2-tiny.mdl "${ord[@]}" --no-shuffle --no-pack --seed 7 --steps 3 --out "$tmp/o-resumed" >/dev/null 2>&1
cp "$tmp/o-resumed/checkpoint.safetensors" "$tmp/o-three"
$m run models/gpt2-tiny.mdl "${ord[@]}" --steps 6 --out "$tmp/o-resumed" --resume >"$tmp/o.out" 2>&1
if [ "$(losses "$tmp/o-straight" | wc -l)" -eq 6 ] && diff <(losses "$tmp/o-straight") <(losses "$tmp/o-resumed") >"$tmp/d" &&
  grep -q "resuming with the checkpoint's --seed 7 --no-shuffle --no-pack" "$tmp/o.out"; then
  ok "a resume without --no-shuffle --no-pack --seed 7 goes on in the checkpoint's order (the losses of an uninterrupted run)"
else
  fail "resumed without the data-order options: $(head -c 300 "$tmp/d") $(tail -c 300 "$tmp/o.out")"
fi
mkdir -p "$tmp/o-conflict"
refused() { # refused DIR WANT OPTION...: a resume from DIR's checkpoint with OPTION... fails, saying WANT
  local dir=$1 want=$2
  shift 2
  cp "$dir/checkpoint.safetensors" "$tmp/o-conflict/"
  if $m run models/gpt2-tiny.mdl "${ord[@]}" "$@" --steps 6 --out "$tmp/o-conflict" --resume >/dev/null 2>"$tmp/e"; then
    fail "a resume with $* was accepted"
  elif grep -qF "checkpoint.safetensors: error: $want" "$tmp/e" &&
    cmp -s "$dir/checkpoint.safetensors" "$tmp/o-conflict/checkpoint.safetensors"; then
    ok "a resume with $* is refused, the option and both values named"
  else
    fail "the refusal of $*: $(head -c 400 "$tmp/e")"
  fi
}
refused "$tmp/o-resumed" "--shuffle: this checkpoint was trained with batches in order (mdl.shuffle = false), this run asks for shuffled batches" --shuffle
refused "$tmp/o-resumed" "--seed 1337: this checkpoint was trained with --seed 7 (mdl.seed = 7), this run asks for --seed 1337" --seed 1337
refused "$tmp/o-resumed" "--accumulate 2: this checkpoint was trained with 1 micro-batches a step (mdl.accumulate = 1)" --accumulate 2
refused "$tmp/b-cpu" "--no-pack: this checkpoint was trained with packed rows (mdl.pack = true), this run asks for padded rows" --no-pack
refused "$tmp/b-cpu" "--no-shuffle: this checkpoint was trained with shuffled batches (mdl.shuffle = true)" --no-shuffle
# (a checkpoint of before: its metadata without the three)
mkdir -p "$tmp/o-old"
python3 - "$tmp/o-three" "$tmp/o-old/checkpoint.safetensors" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
for k in ("mdl.shuffle", "mdl.pack", "mdl.accumulate"):
    del h["__metadata__"][k]
hb = json.dumps(h).encode()
hb += b" " * (-len(hb) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(hb)) + hb + b[8 + n:])
PY
if $m run models/gpt2-tiny.mdl "${ord[@]}" --no-shuffle --no-pack --steps 6 --out "$tmp/o-old" --resume >/dev/null 2>"$tmp/e" &&
  grep -q "warning: the checkpoint does not record its order of batches .*: resuming with batches in order, padded rows" "$tmp/e" &&
  diff <(losses "$tmp/o-straight" | tail -3) <(losses "$tmp/o-old") >"$tmp/d"; then
  ok "a checkpoint that does not record its order of batches resumes as the command line says, with a warning"
else
  fail "an old checkpoint: $(head -c 300 "$tmp/e") $(head -c 300 "$tmp/d")"
fi

# kill -9 while training: the checkpoint on disk is always a whole one.
$m run models/gpt2-tiny.mdl "${common[@]}" --steps 100000 --ckpt-every 3 --out "$tmp/k" >"$tmp/k.out" 2>&1 &
pid=$!
while [ ! -f "$tmp/k/checkpoint.safetensors" ] && kill -0 $pid 2>/dev/null; do sleep 0.1; done
sleep 1
kill -9 $pid 2>/dev/null
wait $pid 2>/dev/null
step=$(grep -ao '"mdl.step":"[0-9]*"' "$tmp/k/checkpoint.safetensors" | grep -o '[0-9]*')
if [ -n "$step" ] && [ "$step" -gt 0 ]; then ok "kill -9 leaves a checkpoint (step $step)"; else fail "no checkpoint after kill -9"; fi
if $m run models/gpt2-tiny.mdl "${common[@]}" --steps $((step + 2)) --out "$tmp/k" --resume >"$tmp/k2" 2>&1 &&
  grep -q "resumed from .* at step $step" "$tmp/k2"; then
  ok "the run killed with -9 resumes from its last checkpoint"
  ls "$tmp/k" | grep -q '\.tmp' && fail "a temporary file of the killed write is still there" ||
    ok "the resumed run removed what the killed write left"
else
  fail "resume after kill -9: $(tail -c 300 "$tmp/k2")"
fi

# SIGTERM, then SIGINT (a background job of a script starts with SIGINT ignored, which mdlc leaves
# so; python restores its default for the run): each stops the run after the step under way, with
# that step's checkpoint, exit status 128 + the signal, a line that says so and the run's summary
# ("no validation": none ran); the run resumed from each reaches the losses of an uninterrupted run.
ckpt_step() { grep -ao '"mdl.step":"[0-9]*"' "$1/checkpoint.safetensors" | grep -o '[0-9]*'; }
logged() { cat "$tmp/s/log.jsonl" 2>/dev/null | wc -l; }
with_sigint='import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])'
sig_run() { # sig_run SIGNAL [--resume]: a run stopped by SIGNAL once 3 more steps are logged
  local before rc
  before=$(logged)
  python3 -c "$with_sigint" $m run models/gpt2-tiny.mdl "${common[@]}" --backend cpu --steps 100000 \
    --ckpt-every 100000 --out "$tmp/s" "${@:2}" >"$tmp/s.out" 2>&1 &
  pid=$!
  while [ "$(logged)" -lt $((before + 3)) ] && kill -0 $pid 2>/dev/null; do sleep 0.1; done
  kill -"$1" $pid
  wait $pid
  rc=$?
  local step logged
  step=$(ckpt_step "$tmp/s")
  logged=$(losses "$tmp/s" | tail -1 | cut -d' ' -f1)
  if [ "$rc" -eq $((128 + $(kill -l "$1"))) ] && [ -n "$step" ] && [ "$step" = "$logged" ] &&
    grep -q "(SIG$1) at step $step: wrote .*checkpoint.safetensors; continue with --resume" "$tmp/s.out" &&
    grep -q "final loss [0-9.]*, no validation," "$tmp/s.out"; then
    ok "SIG$1 stops the run with the checkpoint of its last step ($step), exit status $rc, and its summary"
  else
    fail "SIG$1: exit status $rc, checkpoint at step '$step', last step logged '$logged': $(tail -c 300 "$tmp/s.out")"
  fi
}
sig_run TERM
sig_run INT --resume
step=$(ckpt_step "$tmp/s")
$m run models/gpt2-tiny.mdl "${common[@]}" --backend cpu --steps $((step + 2)) --out "$tmp/s" --resume >/dev/null 2>&1
$m run models/gpt2-tiny.mdl "${common[@]}" --backend cpu --steps $((step + 2)) --out "$tmp/u" >/dev/null 2>&1
if [ "$(losses "$tmp/s" | wc -l)" -eq $((step + 2)) ] && diff <(losses "$tmp/s") <(losses "$tmp/u") >"$tmp/d"; then
  ok "stopped by SIGTERM and SIGINT and resumed, $((step + 2)) steps give the losses of an uninterrupted run"
else
  fail "the losses after stops and resumes differ: $(head -c 400 "$tmp/d")"
fi

# A checkpoint that cannot be written (its path taken by a folder once the first is there; each is
# written in the background while the next steps run): the run stops by itself, saying why, at the
# step that finds the write failed, not 300 steps later at the next checkpoint.
$m run models/gpt2-tiny.mdl "${common[@]}" --backend cpu --steps 100000 --ckpt-every 300 --out "$tmp/f" \
  >"$tmp/f.out" 2>&1 &
pid=$!
# Waits by the run's own progress, not by the clock: a run that goes on past step 900 (the checkpoint
# after the one that failed) did not stop at the failed write, however fast or slow the machine.
while [ ! -f "$tmp/f/checkpoint.safetensors" ] && kill -0 $pid 2>/dev/null; do sleep 0.1; done
until mkdir "$tmp/f/checkpoint.safetensors" 2>/dev/null || ! kill -0 $pid 2>/dev/null; do
  rm -f "$tmp/f/checkpoint.safetensors"
done
while kill -0 $pid 2>/dev/null && [ "$(losses "$tmp/f" 2>/dev/null | tail -1 | cut -d' ' -f1)" -lt 900 ] 2>/dev/null; do
  sleep 0.1
done
if kill -0 $pid 2>/dev/null; then
  kill -9 $pid
  fail "a run whose checkpoint cannot be written goes on"
else
  wait $pid
  rc=$?
  last=$(losses "$tmp/f" | tail -1 | cut -d' ' -f1)
  [ $rc -eq 1 ] && grep -q "checkpoint.safetensors: error: cannot write" "$tmp/f.out" && [ $((last % 300)) -ne 0 ] &&
    ok "a checkpoint that cannot be written stops the run at step $last, saying why" ||
    fail "unwritable checkpoint: status $rc, last step $last, $(tail -c 300 "$tmp/f.out")"
fi

# bad checkpoints: truncated, or from another model; nothing is overwritten.
cp "$tmp/a-cpu/checkpoint.safetensors" "$tmp/good"
head -c 5000 "$tmp/good" >"$tmp/a-cpu/checkpoint.safetensors"
if ! $m run models/gpt2-tiny.mdl "${common[@]}" --steps 12 --out "$tmp/a-cpu" --resume >/dev/null 2>"$tmp/e"; then
  grep -q "checkpoint.safetensors: error" "$tmp/e" && ok "a truncated checkpoint is refused, the file named" ||
    fail "truncated checkpoint message: $(head -c 300 "$tmp/e")"
else fail "a truncated checkpoint was accepted"; fi
[ "$(stat -c %s "$tmp/a-cpu/checkpoint.safetensors")" -eq 5000 ] && ok "the refused checkpoint is left as it was" ||
  fail "the refused checkpoint was changed"
cp "$tmp/good" "$tmp/a-cpu/checkpoint.safetensors"
if ! $m run models/llama-tiny.mdl "${common[@]}" --steps 12 --out "$tmp/a-cpu" --resume >/dev/null 2>"$tmp/e"; then
  grep -q "another model configuration\|does not match" "$tmp/e" && ok "a checkpoint of another model is refused" ||
    fail "other-model message: $(head -c 300 "$tmp/e")"
else fail "a checkpoint of another model was accepted"; fi
cmp -s "$tmp/good" "$tmp/a-cpu/checkpoint.safetensors" && ok "the other model's run left the checkpoint untouched" ||
  fail "the checkpoint changed"

# Gradient accumulation: k micro-batches of 2 rows train exactly like one batch of 2k rows (the
# first k - 1 micro-batches' gradients summed engine to engine, Engine.inputs_from: with k = 3 one
# copied and one added), validating every 3 steps (parameters to the validation engine by
# Engine.take_params). In fp32: with bf16 the two sum their gradients in different orders, and a
# value an f32 ulp from a bf16 rounding midpoint rounds either way (the losses of such runs drift
# apart by up to about 1e-5, relative, in 6 steps).
acc=(--data "$tmp/data" --val-every 3 --steps 6 --backend cpu --precision fp32)
for k in 2 3; do
  $m run models/gpt2-tiny.mdl -D B=2 -D T=32 --accumulate $k "${acc[@]}" --out "$tmp/acc$k" >/dev/null 2>"$tmp/e" ||
    fail "accumulate run: $(head -c 300 "$tmp/e")"
  $m run models/gpt2-tiny.mdl -D B=$((2 * k)) -D T=32 "${acc[@]}" --out "$tmp/whole$k" >/dev/null 2>&1
  if paste <(losses "$tmp/acc$k") <(losses "$tmp/whole$k") |
    awk 'NF == 4 {n++; d = $2 - $4; if (d < 0) d = -d; if (d > 1e-5 * $4) bad++} END {exit !(n == 6 && !bad)}'; then
    ok "6 steps accumulating $k micro-batches of 2 rows = 6 steps of $((2 * k)) rows (losses within 1e-5)"
  else
    fail "accumulated losses differ ($k):" \
      "$(paste <(losses "$tmp/acc$k") <(losses "$tmp/whole$k") | head -3 | tr '\n' ';')"
  fi
done

# Validation runs on the same batches every time: a run resumed in the middle reports the validation
# losses of an uninterrupted one (the validation data's position is no part of a checkpoint).
val=(-D B=2 -D T=32 --data "$tmp/data" --backend cpu --val-every 2 --val-batches 2)
# (every second step's: the run of 3 steps also validates at its end)
vlosses() { sed -n 's/.*"step":\([0-9]*[02468]\),.*"val_loss":\([0-9.]*\).*/\1 \2/p' "$1/log.jsonl"; }
$m run models/gpt2-tiny.mdl "${val[@]}" --steps 6 --out "$tmp/v-straight" >/dev/null 2>&1
$m run models/gpt2-tiny.mdl "${val[@]}" --steps 3 --out "$tmp/v-resumed" >/dev/null 2>&1
$m run models/gpt2-tiny.mdl "${val[@]}" --steps 6 --out "$tmp/v-resumed" --resume >/dev/null 2>&1
if [ "$(vlosses "$tmp/v-straight" | wc -l)" -eq 3 ] && diff <(vlosses "$tmp/v-straight") <(vlosses "$tmp/v-resumed") >"$tmp/d"; then
  ok "validation losses after a resume equal those of an uninterrupted run"
else
  fail "validation losses differ after a resume: $(head -c 300 "$tmp/d")"
fi
# A run killed after logging steps its last checkpoint does not hold (here: a log of 6 steps with
# the checkpoint of step 3): the resumed run cuts the log back to step 3 before going on.
cp "$tmp/v-straight/log.jsonl" "$tmp/v-cut.log"
mkdir -p "$tmp/v-cut"
$m run models/gpt2-tiny.mdl "${val[@]}" --steps 3 --out "$tmp/v-three" >/dev/null 2>&1
cp "$tmp/v-three/checkpoint.safetensors" "$tmp/v-cut/"
cp "$tmp/v-straight/log.jsonl" "$tmp/v-cut/log.jsonl"
printf '{"step":7,"lo' >>"$tmp/v-cut/log.jsonl" # (a line cut short by the kill)
$m run models/gpt2-tiny.mdl "${val[@]}" --steps 6 --out "$tmp/v-cut" --resume >/dev/null 2>&1
if cmp -s <(cut -d, -f1-2 "$tmp/v-cut/log.jsonl") <(cut -d, -f1-2 "$tmp/v-straight/log.jsonl"); then
  ok "a resumed run cuts log.jsonl back to its checkpoint's step: no step logged twice"
else
  fail "log after resume: $(cut -d, -f1 "$tmp/v-cut/log.jsonl" | tr '\n' ' ')"
fi
