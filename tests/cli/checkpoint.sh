#!/usr/bin/env bash
# The checkpoint policy from the command line and the train section: what -d C, build and run say,
# the errors of a budget that cannot be met or cannot be read, and GPT-2 124M trained under a budget
# below what keeping every activation plans, within it.
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "[ok] checkpoint cli: $1"; }
fail() { echo "[fail] checkpoint cli: $1"; }
check() { if eval "$2"; then ok "$1"; else fail "$1: $(tail -c 500 "$tmp/err" 2>/dev/null)"; fi; }
# the planned peak (MB) of a "checkpoint ..." line
planned() { grep -o 'planned peak [0-9.]* MB' "$1" | head -1 | grep -o '[0-9.]*'; }

# -d C: every saved value with its line and bytes, kept or recomputed
$m check -d C models/gpt2-tiny.mdl --checkpoint all --backend cpu >"$tmp/all" 2>"$tmp/err"
check "-d C under all lists the values it recomputes and keeps, each with its .mdl line and bytes" \
  "grep -qE '^checkpoint all: [0-9]+ of [0-9]+ saved values recomputed' '$tmp/all' &&
   grep -qE '^  recomputed +%[0-9]+ +[a-z_]+ .* [0-9]+ bytes  line 4[0-9]' '$tmp/all' &&
   grep -qE '^  kept +%[0-9]+ +add .* bytes  line 40  # h\\.1\\.x' '$tmp/all'"
$m check -d C models/gpt2-tiny.mdl --checkpoint none --backend cpu >"$tmp/none" 2>"$tmp/err"
check "none keeps every saved value, and all plans less" \
  "grep -q '^checkpoint none: every saved value kept' '$tmp/none' && ! grep -q '^  recomputed' '$tmp/none' &&
   awk -v a=\"\$(planned '$tmp/all')\" -v n=\"\$(planned '$tmp/none')\" 'BEGIN {exit !(a > 0 && a < n)}'"

# a budget between all's peak and none's: auto recomputes some values, and plans within it
a=$(planned "$tmp/all"); n=$(planned "$tmp/none")
mid=$(awk -v a="$a" -v n="$n" 'BEGIN {printf "%.0f", (a + n) / 2 * 1e6}')
$m check -d C models/gpt2-tiny.mdl --checkpoint "auto=$mid" --backend cpu >"$tmp/mid" 2>"$tmp/err"
check "auto=$mid (between all's $a MB and none's $n MB) recomputes some values and plans within the budget" \
  "grep -qE '^checkpoint auto: [0-9]+ of [0-9]+ saved values recomputed' '$tmp/mid' &&
   awk -v p=\"\$(planned '$tmp/mid')\" -v b=$mid 'BEGIN {exit !(p > 0 && p * 1e6 <= b)}'"

# build: the checkpoint line in the output and in the fusion report
$m build models/gpt2-tiny.mdl --checkpoint all -o "$tmp/b" >"$tmp/build" 2>"$tmp/err"
check "build says what all recomputes, in its output and its fusion report" \
  "grep -q '^checkpoint all: .* recomputed' '$tmp/build' && grep -q '^checkpoint all: .* recomputed' '$tmp/b/fusion.txt'"

# errors: a budget all cannot meet, on the command line and in the train section; an unreadable one
$m build models/gpt2-tiny.mdl --checkpoint auto=1MB -o "$tmp/b1" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a budget below all's peak is refused with status 1, naming the smallest budget and what takes the memory" \
  "[ $rc -eq 1 ] && grep -q 'models/gpt2-tiny.mdl: error: --checkpoint auto=1MB: a budget of 1.00 MB cannot be met' '$tmp/err' &&
   grep -q 'the step still plans $a MB (none: $n MB), the smallest budget there is' '$tmp/err' &&
   grep -q 'parameters [0-9.]* MB, gradients' '$tmp/err' && grep -q 'the largest activation' '$tmp/err'"
sed 's/checkpoint = auto/checkpoint = auto(1MiB)/' models/gpt2-tiny.mdl >"$tmp/small.mdl"
line=$(grep -n 'checkpoint = auto' "$tmp/small.mdl" | cut -d: -f1)
$m check -d C "$tmp/small.mdl" --backend cpu >"$tmp/out" 2>"$tmp/err"
rc=$?
check "... and in the train section, at its line and column" \
  "[ $rc -eq 1 ] && grep -q '$tmp/small.mdl:$line:[0-9]*: error: checkpoint = auto=1MiB: a budget of 1.05 MB cannot be met' '$tmp/err'"
$m check models/gpt2-tiny.mdl --checkpoint auto=lots >"$tmp/out" 2>"$tmp/err"
rc=$?
check "an unreadable budget is a usage error (status 2)" \
  "[ $rc -eq 2 ] && grep -q -- \"--checkpoint wants none, all, auto or auto=BUDGET\" '$tmp/err'"
sed 's/checkpoint = auto/checkpoint = auto(0)/' models/gpt2-tiny.mdl >"$tmp/zero.mdl"
$m check "$tmp/zero.mdl" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a budget of 0 in the train section is an error at its place" \
  "[ $rc -eq 1 ] && grep -q 'zero.mdl:$line:[0-9]*: error: checkpoint budget must be a positive size' '$tmp/err'"

# a fraction of the memory there is, from the command line and from the train section: the budget is
# that share of the memory the run names, and a share too small to meet is refused
$m check -d C models/gpt2-tiny.mdl --checkpoint auto=0.5 --backend cpu >"$tmp/half" 2>"$tmp/err"
check "--checkpoint auto=0.5 budgets half the memory available" \
  "grep -qE '^checkpoint auto: every saved value kept .* budget [0-9.]+ MB \\(0\\.5 of the [0-9.]+ GB available' '$tmp/half' &&
   awk -v b=\"\$(grep -o 'budget [0-9.]* MB' '$tmp/half' | grep -o '[0-9.]*')\" -v g=\"\$(grep -o 'of the [0-9.]* GB' '$tmp/half' | grep -o '[0-9.]*')\" 'BEGIN {exit !(b > 0 && b / (g * 1000) > 0.49 && b / (g * 1000) < 0.51)}'"
sed 's/checkpoint = auto/checkpoint = auto(0.0000001)/' models/gpt2-tiny.mdl >"$tmp/tiny.mdl"
$m check -d C "$tmp/tiny.mdl" --backend cpu >"$tmp/out" 2>"$tmp/err"
rc=$?
check "checkpoint = auto(0.0000001) in the train section: a share too small to meet, refused at its place" \
  "[ $rc -eq 1 ] && grep -q 'tiny.mdl:$line:[0-9]*: error: checkpoint = auto=0.0000001: a budget of [0-9.]* MB cannot be met' '$tmp/err'"
# One rule for every share, however small: auto=1e-300 (less than a byte of any memory) is a budget
# too small to meet, refused as auto=0.0000001 is; it is not read as no budget at all.
for share in 0.0000001 1e-300; do
  $m check -d C models/gpt2-tiny.mdl --checkpoint "auto=$share" --backend cpu >"$tmp/out" 2>"$tmp/err"
  rc=$?
  check "--checkpoint auto=$share: a share too small to meet, refused with status 1" \
    "[ $rc -eq 1 ] && grep -q 'error: --checkpoint auto=$share: a budget of 0.00 MB cannot be met' '$tmp/err'"
done

# GPT-2 124M (fp32, B=8, T=64) under a budget below what none plans: it trains, within the budget
# (the arena the pass planned; the process adds the runtime's own memory: libraries, kernel scratch,
# the data, about 100 MB here) and below what none would have taken.
mkdir -p "$tmp/corpus"
head -c 60000 /usr/share/common-licenses/GPL-3 >"$tmp/corpus/a.txt"
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null 2>&1 || fail "prep"
big=(-D B=8 -D T=64 --precision fp32 --backend cpu)
$m check -d C models/gpt2.mdl "${big[@]}" --checkpoint none >"$tmp/g_none" 2>"$tmp/err"
gn=$(planned "$tmp/g_none")
budget=$(awk -v n="$gn" 'BEGIN {printf "%.0f", (n - 200) * 1e6}')
$m run models/gpt2.mdl "${big[@]}" --checkpoint "auto=$budget" --data "$tmp/data" --steps 2 --val-every 0 \
  --ckpt-every 0 --out "$tmp/g" >"$tmp/g.out" 2>"$tmp/err"
rc=$?
gp=$(planned "$tmp/g.out")
rss=$(grep -o '| peak [0-9]* MB' "$tmp/g.out" | grep -o '[0-9]*' | sort -n | tail -1)
check "GPT-2 124M trains under auto=$budget (none plans $gn MB): the run's line names the budget and what it recomputes" \
  "[ $rc -eq 0 ] && grep -qE '^checkpoint auto: [0-9]+ of [0-9]+ saved values recomputed .* budget [0-9.]+ MB' '$tmp/g.out' &&
   grep -q '^step     2/2' '$tmp/g.out'"
check "... its planned arena ($gp MB) within the budget, its peak memory ($rss MB) within the budget and the runtime's 128 MB, and below none's plan" \
  "awk -v p=\"$gp\" -v b=$budget -v r=\"$rss\" -v n=\"$gn\" 'BEGIN {exit !(p > 0 && p * 1e6 <= b && r > 0 && r * 1e6 <= b + 128e6 && r < n)}'"
