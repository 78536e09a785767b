#!/usr/bin/env bash
# The house rules (docs/internals.md, "Layers"), checked by tools/layers.py over the sources and the
# objects of this build: calls and includes run only down the layers (base and kernels <- compiler,
# runtime <- driver; the runtime reads the compiler's types, calls none of its functions), no circle of
# calls between source files or of includes, no file over 1,500 lines, no function over 200.
# First the checker itself, on small trees built here, each breaking one rule: it must see each breach.
set -u
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=$(command -v python3)
fails=0
ok() { echo "[ok] layers: $1"; }
fail() { echo "[fail] layers: $1"; fails=$((fails + 1)); }

# a tree of DIR/{compiler,runtime}/... from "path:text" arguments, its objects under DIR/build
tree() {
  local dir=$1; shift
  local spec path inc=
  for spec in "$@"; do
    path=${spec%%:*}
    mkdir -p "$dir/$(dirname "$path")" "$dir/build/$(dirname "$path")"
    printf '%b\n' "${spec#*:}" >"$dir/$path"
    inc="$inc -I$dir/$(dirname "$path")"
  done
  for spec in "$@"; do
    path=${spec%%:*}
    case $path in
      *.c) ${CC:-cc} $inc -c -o "$dir/build/${path%.c}.o" "$dir/$path" || return 1 ;;
    esac
  done
}

# expects the checker to fail on tree DIR with a line matching PATTERN
must_catch() {
  local name=$1 dir=$2 pattern=$3 out
  out=$("$py" tools/layers.py --root "$dir" --build build 2>&1)
  if [ $? -ne 0 ] && printf '%s\n' "$out" | grep -qE "$pattern"; then
    ok "the checker catches $name"
  else
    fail "the checker misses $name: $(printf '%s' "$out" | head -c 400)"
  fi
}

# a clean tree passes
tree "$tmp/clean" 'compiler/base/a.c:int base_f(void) { return 1; }' \
  'compiler/passes/p.c:int base_f(void);\nint pass_f(void) { return base_f(); }' \
  'runtime/engine/e.c:int base_f(void);\nint run_f(void) { return base_f(); }' \
  'compiler/driver/m.c:int pass_f(void); int run_f(void);\nint main(void) { return pass_f() + run_f(); }' || exit 1
if "$py" tools/layers.py --root "$tmp/clean" --build build >"$tmp/clean.out" 2>&1; then
  ok "a tree that keeps the rules passes"
else
  fail "a tree that keeps the rules fails: $(head -c 400 "$tmp/clean.out")"
fi

tree "$tmp/up" 'compiler/passes/p.c:int pass_f(void) { return 1; }' \
  'runtime/engine/e.c:int pass_f(void);\nint run_f(void) { return pass_f(); }' || exit 1
must_catch "the runtime calling a compiler pass" "$tmp/up" 'runtime/engine/e.c \(runtime\) calls compiler/passes/p.c \(compiler\): pass_f'

tree "$tmp/inc" 'runtime/engine/eng.h:int run_f(void);' \
  'compiler/emit/x.c:#include "eng.h"\nint emit_f(void) { return 2; }' || exit 1
must_catch "the compiler including a runtime header" "$tmp/inc" 'compiler/emit/x.c \(compiler\) includes runtime/engine/eng.h'

tree "$tmp/circle" 'compiler/emit/a.c:int b_f(int);\nint a_f(int n) { return n ? b_f(n - 1) : 0; }' \
  'compiler/emit/b.c:int a_f(int);\nint b_f(int n) { return n ? a_f(n - 1) : 1; }' || exit 1
must_catch "a circle of calls" "$tmp/circle" 'compiler/emit/a.c <-> compiler/emit/b.c'

body=$(for i in $(seq 1 201); do printf '  n += %d;\\n' "$i"; done)
tree "$tmp/long" "compiler/passes/l.c:int long_f(int n) {\\n${body}  return n;\\n}" || exit 1
must_catch "a function over 200 lines" "$tmp/long" 'l.c: long_f\(\) has 204 lines'

# and this tree
out=$("$py" tools/layers.py 2>&1)
rc=$?
printf '%s\n' "$out"
[ $rc -eq 0 ] || printf '%s\n' "$out" | grep -q '^\[fail\]' || fail "tools/layers.py exited with $rc"
[ $rc -eq 0 ] && [ $fails -eq 0 ]
