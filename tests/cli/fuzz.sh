#!/usr/bin/env bash
# The front end under libFuzzer. First, with or without clang, every input in tests/fuzz/corpus/
# (inputs that once crashed or hung the front end) must make `mdlc check` exit with 0 or 1. Then
# tests/fuzz/fuzz_front.c is built with clang (-fsanitize=fuzzer,address,undefined) and run for
# FUZZ_SECONDS (60) seconds, seeded with models/*.mdl, tests/errors/*.mdl and tests/fuzz/corpus/.
# A crash, a sanitizer report, a leak, an input running past 60 s or 2 GiB fails, and the input is
# kept in build/fuzz/findings/: fix the bug, then add the input to tests/fuzz/corpus/ (or as a case
# in tests/errors/). Without clang or libFuzzer the fuzzing is skipped, saying why.
# Last, models that check go through `mdlc build` (--checkpoint none, as tools/regen.sh builds) and
# their C through the C compiler with runtime/engine/cpu.c's flags (at -O0: the same errors, sooner): every
# model in tests/fuzz/builds/ (ones that once checked but did not build or compile), then, in name
# order (libFuzzer names an input by the hash of its bytes), the first FUZZ_BUILDS (12) of the
# fuzzer's new inputs and the corpus that `mdlc check` accepts, out of at most 300 tried. A model
# that checks builds and compiles, or its build ends in a file:line:col error (or one of the two
# errors about a whole model: no loss to train, too large for the memory); any other error, an
# internal one, or a C compile failure fails, the input kept in build/fuzz/findings/. A build or
# compile running past 60 s is reported as skipped.
set -u
cd "$(dirname "$0")/../.."
seconds=${FUZZ_SECONDS:-60}
builds=${FUZZ_BUILDS:-12}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ -x bin/mdlc ] || { echo "[fail] fuzz: bin/mdlc is not built"; exit 1; }
export MDL_CACHE=${MDL_CACHE:-$tmp/cache}
mkdir -p build/fuzz/findings "$tmp/new"

# build_one FILE: builds a model that checks, compiles its C; false (the reason printed) on a failure.
cc_flags=$(sed -n 's/^ *snprintf(cc_flags, sizeof cc_flags, "\(cc [^"]*\)",$/\1/p' runtime/engine/cpu.c | sed 's/%s/native/')
build_one() {
  local f=$1 d name
  name=$(basename "$f")
  d="$tmp/build/$name"
  rm -rf "$d" && mkdir -p "$d"
  cp "$f" "$d/in.mdl"
  timeout 60 bin/mdlc build "$d/in.mdl" --checkpoint none -o "$d/out" >/dev/null 2>"$d/err"
  local rc=$?
  if [ $rc -eq 124 ]; then
    echo "[skip] fuzz: build $f: ran past 60 s"
    return 0
  elif [ $rc -ne 0 ]; then
    grep -q "^$d/in.mdl:[0-9]*:[0-9]*: error: " "$d/err" && return 0
    grep -qE "^$d/in.mdl: error: (no 'output loss = \.\.\.'|.* does not fit in memory)" "$d/err" && return 0
    cp "$f" "build/fuzz/findings/build-$name"
    echo "[fail] fuzz: build $f (kept as build/fuzz/findings/build-$name): status $rc, no file:line:col error: $(grep -v '^mdlc: no CUDA' "$d/err" | head -c 300)"
    return 1
  fi
  # (the runtime's flags, then -O0: the last -O counts)
  timeout 60 $cc_flags -O0 -o "$d/model.so" "$d/out/model.c" >"$d/cc" 2>&1
  rc=$?
  if [ $rc -eq 124 ]; then
    echo "[skip] fuzz: compile the C of $f: ran past 60 s"
    return 0
  elif [ $rc -ne 0 ]; then
    cp "$f" "build/fuzz/findings/build-$name"
    echo "[fail] fuzz: the C of $f does not compile (kept as build/fuzz/findings/build-$name): $(grep -m3 'error' "$d/cc" | head -c 400)"
    return 1
  fi
}

# The build step (above); then exits with status $1.
build_check() {
  [ -n "$cc_flags" ] || { echo "[fail] fuzz: no cpu_cc_flags in runtime/engine/cpu.c"; exit 1; }
  local f n=0 bad=0 tried=0 built=0
  for f in tests/fuzz/builds/*.mdl; do
    [ -f "$f" ] || continue
    n=$((n + 1))
    build_one "$f" || bad=1
  done
  [ $bad -eq 0 ] && echo "[ok] fuzz: the $n models of tests/fuzz/builds/ build and their C compiles"
  bad=0
  while IFS= read -r f; do
    [ $built -lt "$builds" ] && [ $tried -lt 300 ] || break
    tried=$((tried + 1))
    timeout 10 bin/mdlc check "$f" >/dev/null 2>&1 || continue
    built=$((built + 1))
    build_one "$f" || bad=1
  done < <(for f in "$tmp"/new/* tests/fuzz/corpus/*; do [ -f "$f" ] && printf '%s\t%s\n' "$(basename "$f")" "$f"; done |
           sort | cut -f2)
  if [ $built -eq 0 ]; then
    echo "[skip] fuzz: none of the $tried fuzzer inputs tried passes mdlc check: nothing to build"
  elif [ $bad -eq 0 ]; then
    echo "[ok] fuzz: $built of the fuzzer's inputs that check (of $tried tried) build, or stop at a file:line:col error, and their C compiles"
  fi
  exit "$1"
}

n=0 bad=0
for f in tests/fuzz/corpus/*; do
  [ -f "$f" ] || continue
  n=$((n + 1))
  timeout 60 bin/mdlc check "$f" >/dev/null 2>&1
  rc=$?
  if [ $rc -gt 1 ]; then
    echo "[fail] fuzz: replaying $f: mdlc check exited with status $rc$([ $rc -eq 124 ] && echo ' (ran past 60 s)')"
    bad=1
  fi
done
[ $bad -eq 0 ] && echo "[ok] fuzz: the $n inputs of tests/fuzz/corpus/ replayed, each an exit status 0 or 1"

if ! command -v clang >/dev/null 2>&1; then
  echo "[skip] fuzz: clang is not installed (libFuzzer comes with it)"
  build_check 0
fi
printf '#include <stdint.h>\n#include <stddef.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' >"$tmp/probe.c"
if ! clang -fsanitize=fuzzer,address,undefined -o "$tmp/probe" "$tmp/probe.c" >"$tmp/probe.log" 2>&1; then
  echo "[skip] fuzz: clang cannot build with -fsanitize=fuzzer: $(head -c 200 "$tmp/probe.log")"
  build_check 0
fi
for f in build/mdl.tab.c build/lex.yy.c; do
  [ -f "$f" ] || { echo "[fail] fuzz: $f is missing: run make first"; exit 1; }
done

bin=build/fuzz/fuzz_front
srcs=(tests/fuzz/fuzz_front.c compiler/base/arena.c compiler/front/ast.c compiler/base/diag.c compiler/passes/ir.c compiler/base/types.c
  compiler/front/sema*.c compiler/base/readfile.c compiler/base/scalar.c build/mdl.tab.c build/lex.yy.c)
# Built again only when a source, a header or this script (its flags) is newer than the target: the
# sanitized build costs more than a minute of a loaded machine's time.
stale=$([ -x "$bin" ] || echo yes)
for f in "${srcs[@]}" compiler/*.h compiler/*/*.h runtime/*.h runtime/*/*.h build/*.h "$0"; do
  [ "$f" -nt "$bin" ] && stale=yes
done
if [ -n "$stale" ] && ! clang -g -O1 -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=undefined $(for d in compiler compiler/*/ runtime runtime/*/; do printf -- "-I%s " "${d%/}"; done) -Ibuild -Igrammar -o "$bin" "${srcs[@]}" -lm >"$tmp/build.log" 2>&1; then
  rm -f "$bin"
  cat "$tmp/build.log" | head -30
  echo "[fail] fuzz: the fuzz target does not build"
  build_check 1
fi

mkdir -p "$tmp/seeds"
cp models/*.mdl tests/errors/*.mdl tests/fuzz/builds/*.mdl "$tmp/seeds/"
cp tests/fuzz/corpus/* "$tmp/seeds/" 2>/dev/null
"$bin" "$tmp/new" "$tmp/seeds" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=2048 -max_len=8192 \
  -close_fd_mask=3 -print_final_stats=1 -artifact_prefix=build/fuzz/findings/ >"$tmp/log" 2>&1
rc=$?
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$tmp/log")
if [ $rc -eq 0 ] && [ -n "$runs" ]; then
  echo "[ok] fuzz: $runs inputs in $seconds s, no crash or hang"
else
  grep -E 'ERROR|SUMMARY|Test unit written|deadly signal|timeout|out-of-memory' "$tmp/log" | head -20
  saved=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$tmp/log" | tail -1)
  echo "[fail] fuzz: the front end failed on an input after ${runs:-?} runs (status $rc); input saved as ${saved:-?}; replay: $bin ${saved:-FILE}"
fi
build_check 0
