#!/usr/bin/env bash
# mdlc under AddressSanitizer and UndefinedBehaviorSanitizer, every verb once: a build of mdlc with
# -fsanitize=address,undefined in build/asan/ (a copy of the sources; build/ and bin/ stay as they
# are, and a second run rebuilds only what changed), then `check` and `build` of every model in
# models/, `prep` of a small text, a few steps of training (a token model, the interpreter, the
# arrays model models/mlp.mdl on build/tools/blobs's data, fp8, --accumulate 2, a run resumed),
# `sample`, `eval` and `init`. Any sanitizer report (a memory error, undefined behaviour, a leak at
# exit), a crash or a failed command is a [fail] naming the command, with the report's first lines.
# Leaks are checked (detect_leaks=1) on every command but one (below, why). The modules
# mdlc emits are compiled by the system cc without sanitizers and loaded as usual: what is checked is
# mdlc and its runtime. `make sanitize` runs the whole suite so; this is the part `make test` runs.
set -u
cd "$(dirname "$0")/../.."
top=$PWD
dir=build/asan
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
if ! echo 'int main(void) { return 0; }' | ${CC:-cc} $flags -x c -o "$tmp/probe" - 2>/dev/null || ! "$tmp/probe"; then
  echo "[skip] sanitize: ${CC:-cc} cannot build and run a program with -fsanitize=address,undefined"
  exit 0
fi

# The sources into build/asan/, each file copied only when it differs (so it is newer than what was
# built from it), so that make there rebuilds what changed since the last run; a file gone from here
# goes from there too.
mkdir -p "$dir"
for f in Makefile $(find compiler runtime grammar tools -type f); do
  if ! cmp -s "$f" "$dir/$f"; then
    mkdir -p "$dir/$(dirname "$f")" && cp "$f" "$dir/$f"
  fi
done
(cd "$dir" && find compiler runtime grammar tools -type f) | while read -r f; do
  [ -e "$f" ] || rm -f "$dir/$f"
done
if ! CFLAGS="$flags" make -C "$dir" -j2 bin/mdlc build/tools/blobs >"$tmp/make.log" 2>&1; then
  echo "[fail] sanitize: make with $flags: $(grep -m3 -E 'error|Error' "$tmp/make.log" | tr '\n' ' ')"
  exit 1
fi
echo "[ok] sanitize: mdlc builds with $flags"

m=$top/$dir/bin/mdlc
export MDL_CACHE=$top/$dir/cache # (its own: compiled modules are reused from one run of this to the next)
export ASAN_OPTIONS="detect_leaks=1" UBSAN_OPTIONS="print_stacktrace=1"
report='ERROR: (Address|Leak)Sanitizer|runtime error:|SUMMARY: UndefinedBehaviorSanitizer'
failed=0 # failures since the last group line
# san ARGS...: the sanitized mdlc with ARGS; a report, a crash or a non-zero status is a [fail]
# naming the command, with the report's first lines (else the output's last lines) on it.
san() {
  "$m" "$@" >"$tmp/out" 2>&1
  local rc=$?
  if [ $rc -ne 0 ] || grep -qE "$report" "$tmp/out"; then
    local first
    if grep -qE "$report" "$tmp/out"; then
      first=$(grep -m1 -A7 -E "$report" "$tmp/out" | grep -vE '^\s*$' | head -8)
    else
      first=$(tail -4 "$tmp/out")
    fi
    echo "[fail] sanitize: mdlc $* (status $rc): $(printf '%s' "$first" | tr '\n' '|' | head -c 1500)"
    failed=$((failed + 1))
    return 1
  fi
}
group() { # group TEXT: an [ok] line for the commands since the last one, when none of them failed
  [ $failed -eq 0 ] && echo "[ok] sanitize: $1"
  failed=0
}

for f in models/*.mdl; do
  san check "$f"
  san build "$f" -o "$tmp/build-$(basename "$f" .mdl)"
done
group "check and build of every model in models/"

mkdir -p "$tmp/corpus"
for i in 1 2 3 4 5 6; do head -c $((2500 * i)) /usr/share/common-licenses/GPL-3 | tail -c 2500 >"$tmp/corpus/d$i.txt"; done
san prep "$tmp/corpus" -o "$tmp/data"
group "prep of a folder of text"

small=(-D B=2 -D T=16 --data "$tmp/data" --val-every 2 --val-batches 1)
san run models/gpt2-tiny.mdl "${small[@]}" --backend cpu --steps 2 --out "$tmp/gpt"
san run models/llama-tiny.mdl "${small[@]}" --backend cpu --steps 2 --out "$tmp/llama"
san run models/moe-tiny.mdl "${small[@]}" --backend cpu --steps 2 --out "$tmp/moe"
group "run: gpt2-tiny, llama-tiny and moe-tiny, 2 steps on the C back end"
san run models/gpt2-tiny.mdl "${small[@]}" --backend interp --steps 2 --out "$tmp/interp"
group "run: gpt2-tiny, 2 steps on the interpreter"
san run models/gpt2-tiny.mdl "${small[@]}" --backend cpu --precision fp8 --steps 2 --out "$tmp/fp8"
group "run: gpt2-tiny, 2 steps in fp8"
san run models/gpt2-tiny.mdl "${small[@]}" --backend cpu --accumulate 2 --steps 2 --out "$tmp/acc"
group "run: gpt2-tiny, 2 steps of 2 accumulated micro-batches"
san run models/gpt2-tiny.mdl "${small[@]}" --backend cpu --steps 4 --out "$tmp/gpt" --resume
group "run --resume: 2 more steps from a checkpoint"

san sample "$tmp/gpt/checkpoint.safetensors" --prompt "The " --tokens 8
# (without the leak check: at its exit an OpenMP thread of the GEMMs is alive with a block of dynamic
# TLS that GCC 12's leak checker misreads, and it crashes, "Tracer caught signal 11", 2 runs in 3)
ASAN_OPTIONS="detect_leaks=0" san eval "$tmp/gpt/checkpoint.safetensors" --data "$tmp/data" --val-batches 1 --backend cpu
san init models/gpt2-tiny.mdl -o "$tmp/init.safetensors"
group "sample, eval and init from gpt2-tiny"

if "$top/$dir/build/tools/blobs" "$tmp/blobs" 200 >/dev/null 2>"$tmp/out"; then
  san run models/mlp.mdl --data "$tmp/blobs" --backend cpu --steps 3 --val-every 3 --val-batches 1 --out "$tmp/mlp"
  san eval "$tmp/mlp/checkpoint.safetensors" --data "$tmp/blobs" --val-batches 1 --backend cpu
  group "run and eval: models/mlp.mdl on arrays from build/tools/blobs"
else
  echo "[fail] sanitize: blobs (sanitized): $(head -c 400 "$tmp/out")"
fi
