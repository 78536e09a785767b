#!/usr/bin/env bash
# The PyTorch cross-check: `mdlc grad` on models/gpt2-tiny.mdl against the same model written in
# PyTorch (tests/torch/gpt2_tiny.py), for the loss and every parameter gradient, on a packed batch
# (two documents per row): in fp32 (relative error < 1e-4 per tensor) and with bf16 GEMM operands
# (PyTorch rounding the same operands, gradients and logits; < 2.5e-3, the room an f32 value within an
# ulp of a bf16 rounding midpoint needs: in the PyTorch model alone, moving each f32 logit by one ulp
# or none at random before it is rounded moved the first layer's attn_w gradient by up to 1.9e-3 in 20
# draws, where bf16 and fp32 differ by 7.4e-3). Skips when /usr/bin/python3 cannot import torch.
set -u
cd "$(dirname "$0")/../.."
py=/usr/bin/python3
if ! why=$("$py" -c 'import torch, numpy' 2>&1); then
  echo "[skip] torch cross-check: $py cannot import torch: $(printf '%s\n' "$why" | tail -1)"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
B=2 T=16

step() { # step NAME COMMAND...: runs the command; on failure prints a [fail] line and stops
  local name=$1; shift
  if ! "$@" >"$tmp/log" 2>&1; then
    echo "[fail] torch cross-check: $name failed: $(tail -3 "$tmp/log" | tr '\n' ' ')"
    exit 1
  fi
}

step "mdlc init" bin/mdlc init models/gpt2-tiny.mdl -o "$tmp/W.safetensors" --seed 1
step "making the batch" "$py" tests/torch/gpt2_tiny.py batch "$tmp/batch.safetensors" --B $B --T $T --seed 1
rc=0
for p in fp32 bf16; do
  step "mdlc grad --precision $p" bin/mdlc grad models/gpt2-tiny.mdl --weights "$tmp/W.safetensors" \
    --batch "$tmp/batch.safetensors" -D B=$B -D T=$T --precision $p -o "$tmp/grads-$p.safetensors"
done
"$py" tests/torch/gpt2_tiny.py check "$tmp/W.safetensors" "$tmp/batch.safetensors" "$tmp/grads-fp32.safetensors" || rc=1
"$py" tests/torch/gpt2_tiny.py check "$tmp/W.safetensors" "$tmp/batch.safetensors" "$tmp/grads-bf16.safetensors" \
  --bf16 --tol 2.5e-3 || rc=1
exit $rc
