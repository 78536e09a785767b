#!/usr/bin/env bash
# Runs the whole suite: unit binaries, the front end's error cases, CLI scripts and the PyTorch
# cross-check. Every check prints "[ok] ..." or "[fail] ..."; the last line is "N passed, N failed, N skipped".
# After each program, a "[time] NAME SECONDS s" line (wall time, counted neither way) shows the slow parts.
set -u
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT

run() { # run a test program; a crash or a non-zero exit without a [fail] line counts as a failure
  local name=$1; shift
  local out rc start=$SECONDS
  out=$("$@" 2>&1); rc=$?
  printf '%s\n' "$out" | tee -a "$log" | grep -E '^\[(ok|fail|skip)\]' || true
  if [ $rc -ne 0 ] && ! printf '%s\n' "$out" | grep -q '^\[fail\]'; then
    printf '%s\n' "$out" | tail -20
    echo "[fail] $name: exited with status $rc" | tee -a "$log"
  fi
  echo "[time] $name $((SECONDS - start)) s"
}

for t in build/tests/test_*; do
  [ -x "$t" ] && run "$(basename "$t")" "$t"
done
for t in tests/errors/run.sh tests/cli/*.sh; do
  [ -x "$t" ] && run "$t" "$t"
done
for t in tests/torch/*.sh; do
  [ -x "$t" ] && run "$t" "$t"
done

passed=$(grep -c '^\[ok\]' "$log")
failed=$(grep -c '^\[fail\]' "$log")
skipped=$(grep -c '^\[skip\]' "$log")
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
