#!/usr/bin/env bash
# `mdlc eval CHECKPOINT --data DIR`: the validation loss of a checkpoint without training, on the
# batches the run that wrote it validated on, so the figure equals the one the run printed last.
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
check() { # check NAME CONDITION (a shell expression)
  if eval "$2"; then echo "[ok] eval: $1"; else echo "[fail] eval: $1: $(head -c 300 "$tmp/err" 2>/dev/null)"; fi
}

mkdir -p "$tmp/corpus"
for i in 1 2 3 4 5 6; do head -c $((3000 * i)) /usr/share/common-licenses/GPL-3 | tail -c 3000 >"$tmp/corpus/doc$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null 2>&1
val_of() { sed -n 's/.*val loss \([0-9.]*\).*/\1/p' "$1" | tail -1; }

# (eval: the seed, the shuffling and the packing are the run's, as its checkpoint records them)
for opts in "" "--shuffle --seed 7" "--no-shuffle" "--no-pack --val-batches 2"; do
  # shellcheck disable=SC2086
  $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 4 --val-every 0 --backend cpu --data "$tmp/data" $opts \
    --out "$tmp/run" >"$tmp/run.out" 2>"$tmp/err"
  # shellcheck disable=SC2086
  $m eval "$tmp/run/checkpoint.safetensors" --data "$tmp/data" --backend cpu $(sed 's/--no-[a-z]*//g' <<<"$opts") \
    >"$tmp/eval.out" 2>"$tmp/err"
  rc=$?
  ran=$(val_of "$tmp/run.out") got=$(val_of "$tmp/eval.out")
  check "the run's last validation loss ($ran) from its checkpoint${opts:+ with $opts}: $got" \
    "[ $rc -eq 0 ] && [ -n '$ran' ] && [ '$ran' = '$got' ]"
  rm -rf "$tmp/run"
done
check "eval names the checkpoint's step and model" "grep -q '^evaluating .*checkpoint.safetensors (step 4 of .*gpt2-tiny.mdl)' '$tmp/eval.out'"
check "eval reads the batches it was asked for" "grep -q 'over 2 validation batches of 2x16' '$tmp/eval.out'"

$m eval "$tmp/nope.safetensors" --data "$tmp/data" >/dev/null 2>"$tmp/err"
rc=$?
check "a missing checkpoint is a user error, named" "[ $rc -eq 1 ] && grep -q 'nope.safetensors' '$tmp/err'"
$m init models/gpt2-tiny.mdl -o "$tmp/w.safetensors" >/dev/null 2>&1
$m eval "$tmp/w.safetensors" --data "$tmp/data" >/dev/null 2>"$tmp/err"
rc=$?
check "weights without a run's metadata are refused" "[ $rc -eq 1 ] && grep -q 'not an mdl checkpoint' '$tmp/err'"
$m eval "$tmp/w.safetensors" >/dev/null 2>"$tmp/err"
rc=$?
check "eval needs --data" "[ $rc -eq 1 ] && grep -q 'eval needs --data DIR' '$tmp/err'"

# The model eval compiles is the checkpoint's stored text, as sample's: a file at the recorded path
# edited since (gelu to relu) gets one warning and the run's own validation loss; gone, it is not needed.
cp models/gpt2-tiny.mdl "$tmp/model.mdl"
$m run "$tmp/model.mdl" -D B=2 -D T=16 --steps 4 --val-every 0 --backend interp --data "$tmp/data" --out "$tmp/run" \
  >"$tmp/run.out" 2>"$tmp/err"
sed -i 's/gelu(/relu(/' "$tmp/model.mdl"
$m eval "$tmp/run/checkpoint.safetensors" --data "$tmp/data" --backend interp >"$tmp/eval.out" 2>"$tmp/err"
rc=$? ran=$(val_of "$tmp/run.out") got=$(val_of "$tmp/eval.out")
check "a model file edited since: the stored text's loss ($ran): $got, with one warning" \
  "[ $rc -eq 0 ] && [ -n '$ran' ] && [ '$ran' = '$got' ] && [ \$(wc -l <'$tmp/err') -eq 1 ] && grep -q 'warning: $tmp/model.mdl differs from the model this checkpoint was trained with; evaluating with the copy of that model stored in the checkpoint' '$tmp/err'"
rm "$tmp/model.mdl"
$m eval "$tmp/run/checkpoint.safetensors" --data "$tmp/data" --backend interp >"$tmp/eval.out" 2>"$tmp/err"
rc=$? got=$(val_of "$tmp/eval.out")
check "the model file gone: the stored text's loss ($ran): $got" "[ $rc -eq 0 ] && [ '$ran' = '$got' ] && [ ! -s '$tmp/err' ]"
