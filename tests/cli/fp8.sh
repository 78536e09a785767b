#!/usr/bin/env bash
# precision = fp8 through `mdlc run` on the CPU (the compiled back end, and the interpreter):
#   - gpt2-tiny on the fortunes follows the bf16 loss curve: over 50 steps (B=8, T=64) every step's
#     loss within 1% of bf16's, and not equal to it everywhere (fp8 rounds);
#   - a run stopped and resumed gives the losses of an uninterrupted one (the checkpoint holds the
#     fp8 scales and amax histories): 4 steps + resume to 10 on the C back end, 2 + 2 on the
#     interpreter;
#   - a bf16 checkpoint is refused for an fp8 resume, and an fp8 one for a bf16 resume, the path and
#     the reason named, and one for another amax_history; an fp8 checkpoint samples and evaluates (its scaling state is training state);
#   - an activation that overflows into an fp8 GEMM is reported at its step with the tensor's name,
#     and the step is skipped.
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "[ok] fp8: $1"; }
fail() { echo "[fail] fp8: $1"; }
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([0-9.]*\).*/\1 \2/p' "$1/log.jsonl"; }

if [ ! -d /usr/share/games/fortunes ]; then
  echo "[skip] fp8: no /usr/share/games/fortunes"
  exit 0
fi
$m prep /usr/share/games/fortunes --doc-sep % -o "$tmp/data" >/dev/null 2>&1 || fail "prep"

for p in bf16 fp8; do
  $m run models/gpt2-tiny.mdl --backend cpu --precision $p --data "$tmp/data" --steps 50 --val-every 0 \
    --out "$tmp/c-$p" >"$tmp/c-$p.out" 2>&1 || fail "run --precision $p: $(tail -c 300 "$tmp/c-$p.out")"
done
if [ "$(losses "$tmp/c-fp8" | wc -l)" -eq 50 ] &&
  paste <(losses "$tmp/c-bf16") <(losses "$tmp/c-fp8") |
  awk '{d = $2 - $4; if (d < 0) d = -d; if (d > 0.01 * $2) bad = 1; if (d > 0) moved = 1} END {exit bad || !moved}'; then
  ok "50 steps of gpt2-tiny in fp8 follow bf16's losses within 1% ($(losses "$tmp/c-bf16" | tail -1 | cut -d' ' -f2) vs $(losses "$tmp/c-fp8" | tail -1 | cut -d' ' -f2) at step 50)"
else
  fail "fp8 vs bf16 losses: $(paste <(losses "$tmp/c-bf16") <(losses "$tmp/c-fp8") | tail -5 | tr '\n' ' ')"
fi

common=(-D B=2 -D T=32 --data "$tmp/data" --val-every 0 --precision fp8)
for b in cpu:4:10 interp:2:4; do
  IFS=: read -r backend part all <<<"$b"
  $m run models/gpt2-tiny.mdl "${common[@]}" --backend $backend --steps $all --out "$tmp/a-$backend" >/dev/null 2>&1
  $m run models/gpt2-tiny.mdl "${common[@]}" --backend $backend --steps $part --out "$tmp/b-$backend" >/dev/null 2>&1
  $m run models/gpt2-tiny.mdl "${common[@]}" --backend $backend --steps $all --out "$tmp/b-$backend" --resume \
    >"$tmp/resumed" 2>&1
  if grep -q "resumed from" "$tmp/resumed" && [ "$(losses "$tmp/a-$backend" | wc -l)" -eq "$all" ] &&
    diff <(losses "$tmp/a-$backend") <(losses "$tmp/b-$backend") >"$tmp/d"; then
    ok "$backend: $part steps + resume to $all give the losses of $all uninterrupted steps"
  else
    fail "$backend: resumed losses differ: $(head -c 400 "$tmp/d") $(tail -c 300 "$tmp/resumed")"
  fi
done

$m run models/gpt2-tiny.mdl -D B=2 -D T=32 --data "$tmp/data" --val-every 0 --backend cpu --precision bf16 \
  --steps 2 --out "$tmp/r16" >/dev/null 2>&1
if $m run models/gpt2-tiny.mdl "${common[@]}" --backend cpu --steps 4 --out "$tmp/r16" --resume >/dev/null 2>"$tmp/e"; then
  fail "a bf16 checkpoint resumed in fp8"
elif grep -qF "$tmp/r16/checkpoint.safetensors: error: checkpoint of a run in precision bf16, this run is fp8: it holds no fp8 scales" "$tmp/e"; then
  ok "a bf16 checkpoint is refused for an fp8 resume, path and reason named"
else
  fail "bf16 checkpoint into fp8: $(head -c 300 "$tmp/e")"
fi
if $m run models/gpt2-tiny.mdl -D B=2 -D T=32 --data "$tmp/data" --val-every 0 --backend cpu --precision bf16 \
  --steps 12 --out "$tmp/a-cpu" --resume >/dev/null 2>"$tmp/e"; then
  fail "an fp8 checkpoint resumed in bf16"
elif grep -qF "checkpoint of a run in precision fp8, this run is bf16: its fp8 scales and amax histories would be dropped" "$tmp/e"; then
  ok "an fp8 checkpoint is refused for a bf16 resume"
else
  fail "fp8 checkpoint into bf16: $(head -c 300 "$tmp/e")"
fi

if $m run models/gpt2-tiny.mdl "${common[@]}" --backend cpu --steps 12 --set amax_history=8 --out "$tmp/a-cpu" \
  --resume >/dev/null 2>"$tmp/e"; then
  fail "an fp8 checkpoint resumed with another amax_history"
elif grep -qF "its fp8 state is for 21 scaled tensors with 16 steps of amax history, this run has 21 with 8" "$tmp/e"; then
  ok "an fp8 checkpoint is refused for a resume with another amax_history"
else
  fail "amax_history changed: $(head -c 300 "$tmp/e")"
fi
if $m sample "$tmp/a-cpu/checkpoint.safetensors" --prompt "The" >"$tmp/s.out" 2>&1 &&
  $m eval "$tmp/a-cpu/checkpoint.safetensors" --data "$tmp/data" --val-batches 2 >"$tmp/ev.out" 2>&1 &&
  grep -q "val loss" "$tmp/ev.out"; then
  ok "an fp8 checkpoint samples and evaluates"
else
  fail "sample / eval of an fp8 checkpoint: $(tail -c 300 "$tmp/s.out") $(tail -c 300 "$tmp/ev.out")"
fi

sed 's/gelu(layernorm(x, ln2_w, ln2_b) @ fc_w + fc_b)/(gelu(layernorm(x, ln2_w, ln2_b) @ fc_w + fc_b) * 1e30 * 1e30)/' \
  models/gpt2-tiny.mdl >"$tmp/overflow.mdl"
$m run "$tmp/overflow.mdl" "${common[@]}" --backend cpu --steps 2 --skip-nonfinite 1 --out "$tmp/o" >/dev/null 2>"$tmp/e"
if grep -qF "warning: step 1: the fp8 amax of h.0.fcproj_w's input (line 40, f8e4m3) is inf: the step is skipped" "$tmp/e"; then
  ok "an overflowing activation is reported at its step with its tensor's name, and the step skipped"
else
  fail "overflow report: $(head -c 400 "$tmp/e")"
fi
