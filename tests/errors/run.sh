#!/usr/bin/env bash
# The front end's error cases. For each NAME.expected: `mdlc check tests/errors/NAME.mdl` (plus the
# options in NAME.args, if any) must exit with status 1 and print exactly NAME.expected on stderr.
# missing-file.expected has no .mdl on purpose: it is the message for a file that does not exist.
# With --update, rewrites every NAME.expected from the current compiler instead of checking.
set -u
cd "$(dirname "$0")/../.."
mdlc=bin/mdlc
dir=tests/errors
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ -x "$mdlc" ] || { echo "[fail] errors: $mdlc is not built"; exit 1; }

if [ "${1:-}" = "--update" ]; then
  for src in "$dir"/*.mdl "$dir/missing-file.mdl"; do
    name=$(basename "$src" .mdl)
    args=()
    [ -f "$dir/$name.args" ] && read -r -a args <"$dir/$name.args"
    "$mdlc" check "${args[@]}" "$src" >/dev/null 2>"$dir/$name.expected"
  done
  exit 0
fi

for expected in "$dir"/*.expected; do
  name=$(basename "$expected" .expected)
  args=()
  [ -f "$dir/$name.args" ] && read -r -a args <"$dir/$name.args"
  "$mdlc" check "${args[@]}" "$dir/$name.mdl" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  if [ $rc -ne 1 ]; then
    echo "[fail] errors: $name: exit status $rc, wanted 1"
  elif [ -s "$tmp/out" ]; then
    echo "[fail] errors: $name: unexpected output on stdout: $(head -c 200 "$tmp/out")"
  elif ! cmp -s "$expected" "$tmp/err"; then
    echo "[fail] errors: $name: stderr differs from $expected:"
    diff "$expected" "$tmp/err" | head -40
  else
    echo "[ok] errors: $name"
  fi
done
for src in "$dir"/*.mdl; do
  [ -f "${src%.mdl}.expected" ] || echo "[fail] errors: $(basename "$src"): no .expected file"
done
