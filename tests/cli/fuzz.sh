#!/usr/bin/env bash
# The front end under libFuzzer. First, with or without clang, every input in tests/fuzz/corpus/
# (inputs that once crashed or hung the front end) must make `mdlc check` exit with 0 or 1. Then
# tests/fuzz/fuzz_front.c is built with clang (-fsanitize=fuzzer,address,undefined) and run for
# FUZZ_SECONDS (60) seconds, seeded with models/*.mdl, tests/errors/*.mdl and tests/fuzz/corpus/.
# A crash, a sanitizer report, a leak, an input running past 60 s or 2 GiB fails, and the input is
# kept in build/fuzz/findings/: fix the bug, then add the input to tests/fuzz/corpus/ (or as a case
# in tests/errors/). Without clang or libFuzzer the fuzzing is skipped, saying why.
set -u
cd "$(dirname "$0")/../.."
seconds=${FUZZ_SECONDS:-60}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ -x bin/mdlc ] || { echo "[fail] fuzz: bin/mdlc is not built"; exit 1; }

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
  exit 0
fi
printf '#include <stdint.h>\n#include <stddef.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' >"$tmp/probe.c"
if ! clang -fsanitize=fuzzer,address,undefined -o "$tmp/probe" "$tmp/probe.c" >"$tmp/probe.log" 2>&1; then
  echo "[skip] fuzz: clang cannot build with -fsanitize=fuzzer: $(head -c 200 "$tmp/probe.log")"
  exit 0
fi
for f in build/mdl.tab.c build/lex.yy.c; do
  [ -f "$f" ] || { echo "[fail] fuzz: $f is missing: run make first"; exit 1; }
done

mkdir -p build/fuzz/findings
bin=build/fuzz/fuzz_front
srcs=(tests/fuzz/fuzz_front.c compiler/arena.c compiler/ast.c compiler/diag.c compiler/ir.c compiler/sema.c
  compiler/interp.c compiler/precision.c build/mdl.tab.c build/lex.yy.c)
# Built again only when a source, a header or this script (its flags) is newer than the target: the
# sanitized build costs more than a minute of a loaded machine's time.
stale=$([ -x "$bin" ] || echo yes)
for f in "${srcs[@]}" compiler/*.h runtime/prelude_fp8.h build/*.h "$0"; do
  [ "$f" -nt "$bin" ] && stale=yes
done
if [ -n "$stale" ] && ! clang -g -O1 -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=undefined -Icompiler -Iruntime -Ibuild -Igrammar -o "$bin" "${srcs[@]}" -lm >"$tmp/build.log" 2>&1; then
  rm -f "$bin"
  cat "$tmp/build.log" | head -30
  echo "[fail] fuzz: the fuzz target does not build"
  exit 1
fi

mkdir -p "$tmp/new" "$tmp/seeds"
cp models/*.mdl tests/errors/*.mdl "$tmp/seeds/"
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
