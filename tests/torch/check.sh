#!/usr/bin/env bash
# The PyTorch cross-check: `mdlc grad` on models/gpt2-tiny.mdl against the same model written in
# PyTorch (tests/torch/gpt2_tiny.py), for the loss and every parameter gradient, on a packed batch
# (two documents per row). Skips when /usr/bin/python3 cannot import torch.
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
step "mdlc grad" bin/mdlc grad models/gpt2-tiny.mdl --weights "$tmp/W.safetensors" \
  --batch "$tmp/batch.safetensors" -D B=$B -D T=$T -o "$tmp/grads.safetensors"
"$py" tests/torch/gpt2_tiny.py check "$tmp/W.safetensors" "$tmp/batch.safetensors" "$tmp/grads.safetensors"
