#!/usr/bin/env bash
# Checkpoints: a run stopped and resumed gives the same losses as an uninterrupted one (same
# parameters, moments, data position and dropout seeds); a kill -9 at any moment leaves the last
# checkpoint readable and resumable; bad checkpoints are refused with the file named.
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

# kill -9 while training: the checkpoint on disk is always a whole one.
$m run models/gpt2-tiny.mdl "${common[@]}" --steps 100000 --ckpt-every 3 --out "$tmp/k" >"$tmp/k.out" 2>&1 &
pid=$!
for _ in $(seq 1 100); do [ -f "$tmp/k/checkpoint.safetensors" ] && break; sleep 0.1; done
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
# Engine.take_params).
acc=(--data "$tmp/data" --val-every 3 --steps 6 --backend cpu)
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
