#!/usr/bin/env bash
# Long models build: gpt2-tiny with its attention line written many times in the repeat body. With
# 16 or more, the sum of the q, k and v gradients over the lines is cut into kernels that fit the
# CUDA back end's table of buffers; with 1000, the build's passes stay near-linear in the graph (a
# bound two orders of magnitude above the time the build takes, which only a quadratic pass misses).
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

copies() { # copies N: models/gpt2-tiny.mdl with the attention line N times
  awk -v n="$1" '/attention\(/ { for (i = 0; i < n; i++) print; next } { print }' models/gpt2-tiny.mdl
}

copies 16 >"$tmp/g16.mdl"
if [ "$(grep -c 'attention(' "$tmp/g16.mdl")" -ne 16 ]; then
  echo "[fail] scale: the 16-line model has $(grep -c 'attention(' "$tmp/g16.mdl") attention lines"
elif $m build "$tmp/g16.mdl" -o "$tmp/b16" >/dev/null 2>"$tmp/err" && [ -s "$tmp/b16/model.cu" ] &&
     [ -s "$tmp/b16/model.c" ]; then
  echo "[ok] scale: gpt2-tiny with 16 attention lines builds (model.c and model.cu)"
  if cc -O0 -fopenmp -c -o "$tmp/b16/model.o" "$tmp/b16/model.c" 2>"$tmp/cc"; then
    echo "[ok] scale: its emitted C compiles"
  else
    echo "[fail] scale: its emitted C does not compile: $(head -c 300 "$tmp/cc")"
  fi
  if grep -q "buffer cap (40 buffers a kernel)" "$tmp/b16/plan.txt"; then
    echo "[ok] scale: the report says where the sums were cut to fit a kernel's buffers"
  else
    echo "[fail] scale: no 'buffer cap' reason in plan.txt"
  fi
else
  echo "[fail] scale: gpt2-tiny with 16 attention lines does not build: $(head -c 300 "$tmp/err")"
fi

copies 1000 >"$tmp/g1000.mdl"
timeout 120 $m build "$tmp/g1000.mdl" -o "$tmp/b1000" >/dev/null 2>"$tmp/err"; rc=$?
if [ "$rc" -eq 0 ]; then
  echo "[ok] scale: gpt2-tiny with 1000 attention lines builds within 120 s"
elif [ "$rc" -eq 124 ]; then
  echo "[fail] scale: gpt2-tiny with 1000 attention lines takes over 120 s to build"
else
  echo "[fail] scale: gpt2-tiny with 1000 attention lines does not build (status $rc): $(head -c 300 "$tmp/err")"
fi
