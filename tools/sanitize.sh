#!/usr/bin/env bash
# Runs the whole test suite (`make test`) on a build under AddressSanitizer and UndefinedBehaviorSanitizer
# (`make sanitize`): mdlc, the runtime and every test binary, in a copy of the working tree under
# $TMPDIR, so that build/ and bin/ here are left as they are. A memory error, a leak (reported at
# exit) or undefined behaviour makes the program that made it fail, which the suite counts as a
# failure. About 18 minutes on 2 cores, against 7 or 8 for
# `make test`: too long for every CI run, so run it before a change to the runtime's memory handling.
# The copy is not a git checkout, so gpu_check.sh skips its one check that needs one.
set -eu
cd "$(dirname "$0")/.."
dir=$(mktemp -d "${TMPDIR:-/tmp}/mdl-sanitize.XXXXXX")
trap 'rm -rf "$dir"' EXIT
# The tracked files and the untracked ones git does not ignore, as they are now.
# (A file deleted but not yet committed is listed and skipped.)
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  if [ -e "$f" ]; then
    mkdir -p "$dir/$(dirname "$f")" && cp -p "$f" "$dir/$f"
  fi
done
cd "$dir"
export CFLAGS="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
export ASAN_OPTIONS="detect_leaks=1:${ASAN_OPTIONS:-}" UBSAN_OPTIONS="print_stacktrace=1:${UBSAN_OPTIONS:-}"
make test
