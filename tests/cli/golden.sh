#!/usr/bin/env bash
# generated/ is what the compiler emits for models/ (`make regen` rewrites it), and every emitted
# C module compiles (with --checkpoint none, as tools/regen.sh builds it); so does gpt2-tiny's with
# its attention line repeated seven times, which puts several reductions in one kernel.
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

line='    x = x + attention(q, k, v, heads=H, causal=true, doc=doc) @ proj_w + proj_b'
grep -qxF "$line" models/gpt2-tiny.mdl || echo "[fail] golden: models/gpt2-tiny.mdl has no line '$line'"
awk -v l="$line" '{ print; if ($0 == l) for (i = 1; i < 7; i++) print }' models/gpt2-tiny.mdl >"$tmp/attn7.mdl"
if ! bin/mdlc build "$tmp/attn7.mdl" -o "$tmp/attn7" >/dev/null 2>"$tmp/err"; then
  echo "[fail] golden: build gpt2-tiny with 7 attention lines: $(head -c 300 "$tmp/err")"
elif cc -std=c11 -O0 -fopenmp -fPIC -Wall -Werror -c "$tmp/attn7/model.c" -o "$tmp/attn7.o" 2>"$tmp/cc"; then
  echo "[ok] golden: gpt2-tiny with 7 attention lines in its body builds, and its C compiles cleanly"
else
  echo "[fail] golden: gpt2-tiny with 7 attention lines: the C does not compile: $(head -c 600 "$tmp/cc")"
fi

# The C of precision fp8 and of Muon (casts and amax notes, widened fp8 operands; batched
# Newton-Schulz products), which no model in generated/ has, compiles cleanly too.
for v in "fp8|--precision fp8" "muon|--set optimizer=muon"; do
  what=${v%%|*}
  if ! bin/mdlc build models/gpt2-tiny.mdl ${v#*|} -o "$tmp/$what" >/dev/null 2>"$tmp/err"; then
    echo "[fail] golden: build gpt2-tiny ${v#*|}: $(head -c 300 "$tmp/err")"
  elif cc -std=c11 -O0 -fopenmp -fPIC -Wall -Werror -c "$tmp/$what/model.c" -o "$tmp/$what.o" 2>"$tmp/cc"; then
    echo "[ok] golden: gpt2-tiny ${v#*|} builds, and its C compiles cleanly"
  else
    echo "[fail] golden: gpt2-tiny ${v#*|}: the C does not compile cleanly: $(head -c 600 "$tmp/cc")"
  fi
done
