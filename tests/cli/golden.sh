#!/usr/bin/env bash
# generated/ is what the compiler emits for models/ (`make regen` rewrites it), and every emitted
# C module compiles (with --checkpoint none, as tools/regen.sh builds it).
set -u
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for m in models/*.mdl; do
  name=$(basename "$m" .mdl)
  if ! bin/mdlc build "$m" --checkpoint none -o "$tmp/$name" >/dev/null 2>"$tmp/err"; then
    echo "[fail] golden: build $m: $(head -c 300 "$tmp/err")"
    continue
  fi
  if diff -r "generated/$name" "$tmp/$name" >"$tmp/diff" 2>&1; then
    echo "[ok] golden: generated/$name matches what mdlc emits"
  else
    echo "[fail] golden: generated/$name is stale (make regen): $(head -c 600 "$tmp/diff")"
  fi
  if cc -std=c11 -O0 -fopenmp -fPIC -Wall -Werror -c "$tmp/$name/model.c" -o "$tmp/$name.o" 2>"$tmp/cc"; then
    echo "[ok] golden: generated/$name/model.c compiles cleanly"
  else
    echo "[fail] golden: generated/$name/model.c does not compile: $(head -c 600 "$tmp/cc")"
  fi
done
