#!/usr/bin/env bash
# Memory that runs out: with build/tests/failalloc.so (tests/alloc/failalloc.c) preloaded, every
# allocation fails from mdlc's N-th on. For a spread of N over all of the allocations of `mdlc run
# --resume` (two steps of gpt2-tiny trained, one more: compile, load, train, validate, checkpoint) and
# of `mdlc eval`, each must end with status 1 and one "out of memory allocating WHAT" error: no
# signal, no hang, no other message; and the checkpoint it started from stays as it was, or is the
# next step's whole (the one a run that had the memory writes).
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
lib=$PWD/build/tests/failalloc.so
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export MDL_CACHE=$tmp/cache
ok() { echo "[ok] alloc: $1"; }
fail() { echo "[fail] alloc: $1"; }
[ -f "$lib" ] || { fail "build/tests/failalloc.so is missing (make test builds it)"; exit 1; }

mkdir -p "$tmp/corpus"
for i in 1 2 3; do head -c $((3000 * i)) /usr/share/common-licenses/GPL-3 | tail -c 3000 >"$tmp/corpus/d$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null 2>&1 || fail "prep"
opts=(models/gpt2-tiny.mdl -D B=2 -D T=16 --val-every 1 --ckpt-every 1 --val-batches 1 --backend cpu --data "$tmp/data")
$m run "${opts[@]}" --steps 2 --out "$tmp/base" >/dev/null 2>"$tmp/err" || fail "the first two steps: $(tail -3 "$tmp/err")"
# the counts, from runs where nothing fails (the step-3 run gives the checkpoint a whole resume writes)
cp -r "$tmp/base" "$tmp/next"
LD_PRELOAD=$lib FAILALLOC_COUNT=$tmp/nrun $m run "${opts[@]}" --steps 3 --out "$tmp/next" --resume >/dev/null 2>&1
LD_PRELOAD=$lib FAILALLOC_COUNT=$tmp/neval $m eval "$tmp/base/checkpoint.safetensors" --data "$tmp/data" \
  --val-batches 1 --backend cpu >/dev/null 2>&1
nrun=$(cat "$tmp/nrun" 2>/dev/null || echo 0) neval=$(cat "$tmp/neval" 2>/dev/null || echo 0)
if [ "$nrun" -gt 100 ] && [ "$neval" -gt 100 ]; then
  ok "the preloaded allocator counts $nrun allocations of run --resume, $neval of eval"
else
  fail "the preloaded allocator counted $nrun allocations of run, $neval of eval"
fi
cp "$tmp/base/checkpoint.safetensors" "$tmp/base.safetensors"

# One failure point: KIND (run or eval) and N; prints "N: what went wrong" or nothing.
point() {
  local kind=$1 n=$2 d=$tmp/p$1$2 rc
  mkdir -p "$d"
  if [ "$kind" = run ]; then
    cp -r "$tmp/base" "$d/out"
    timeout 60 env LD_PRELOAD="$lib" FAILALLOC_AT=$n "$m" run "${opts[@]}" --steps 3 --out "$d/out" --resume \
      >/dev/null 2>"$d/err"
  else
    timeout 60 env LD_PRELOAD="$lib" FAILALLOC_AT=$n "$m" eval "$tmp/base/checkpoint.safetensors" --data "$tmp/data" \
      --val-batches 1 --backend cpu >/dev/null 2>"$d/err"
  fi
  rc=$?
  local why=
  if [ $rc -eq 124 ]; then why="hung"
  elif [ $rc -ge 128 ]; then why="killed by signal $((rc - 128))"
  elif [ $rc -ne 1 ]; then why="status $rc"
  elif [ "$(grep -c 'out of memory allocating [a-zA-Z]' "$d/err")" -ne 1 ]; then why="no one out-of-memory error"
  elif [ "$kind" = run ] && ! cmp -s "$d/out/checkpoint.safetensors" "$tmp/base.safetensors" &&
       ! cmp -s "$d/out/checkpoint.safetensors" "$tmp/next/checkpoint.safetensors"; then
    why="the checkpoint is neither the one it resumed from nor the next step's"
  fi
  [ -n "$why" ] && echo "$kind N=$n: $why: $(grep -v '^warning' "$d/err" | tail -2 | tr '\n' ' ' | cut -c1-200)"
  rm -rf "$d"
}
export -f point
export tmp m lib
export opts_str="${opts[*]}"

# N spread evenly over each count (every allocation would take minutes), and the run's last eight: its
# checkpoint written (deterministic: the same points every time)
points() {
  local kind=$1 total=$2 k=$3
  for i in $(seq 0 $((k - 1))); do echo "$kind $((1 + i * (total - 1) / (k - 1)))"; done
  [ "$kind" = run ] && for i in $(seq 1 8); do echo "$kind $((total - i))"; done
}
start=$SECONDS
{ points run "$nrun" 60; points eval "$neval" 24; } | sort -u -k1,1 -k2n >"$tmp/points"
# (opts is an array: each point rebuilds it in its own shell)
bad=$(xargs -P 2 -L 1 bash -c 'opts=($opts_str); point "$@"' _ <"$tmp/points" 2>/dev/null)
count=$(wc -l <"$tmp/points")
if [ -z "$bad" ]; then
  ok "$count failure points ($((SECONDS - start)) s): each ends in one \"out of memory allocating ...\" error, status 1, checkpoint whole"
else
  fail "$(echo "$bad" | wc -l) of $count failure points: $(echo "$bad" | head -5)"
fi
cmp -s "$tmp/base/checkpoint.safetensors" "$tmp/base.safetensors" && ok "eval left the checkpoint as it was" ||
  fail "eval changed the checkpoint"

# Under address-space limits below what the run needs: the same, no abort, at each of several limits
# (without gemm.c's check, "Address space", oneDNN's first GEMM crashed at 56320, 61440 and 66560)
for lim in 51200 56320 61440 66560 71680; do
  rm -rf "$tmp/lim"
  cp -r "$tmp/base" "$tmp/lim"
  (ulimit -v $lim; $m run "${opts[@]}" --steps 3 --out "$tmp/lim" --resume >/dev/null 2>"$tmp/err")
  rc=$?
  if [ $rc -eq 1 ] && grep -q 'out of memory' "$tmp/err" && cmp -s "$tmp/lim/checkpoint.safetensors" "$tmp/base.safetensors"; then
    ok "under ulimit -v $lim a run ends with status 1 and an out-of-memory error, its checkpoint as it was"
  else
    fail "under ulimit -v $lim: status $rc: $(tail -2 "$tmp/err")"
  fi
done
