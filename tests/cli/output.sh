#!/usr/bin/env bash
# How much a run prints: on a terminal, a progress line rewritten in place ("\r") between full step
# lines; piped, the full lines alone, at the first step, every --log-every steps, each validation and
# the last step; --quiet, errors and the final summary only; log.jsonl has every step either way.
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "[ok] output: $1"; }
fail() { echo "[fail] output: $1"; }
check() { # check NAME CONDITION (a shell expression)
  if eval "$2"; then ok "$1"; else fail "$1"; fi
}

mkdir -p "$tmp/corpus"
for i in 1 2 3 4 5 6; do head -c $((3000 * i)) /usr/share/common-licenses/GPL-3 | tail -c 3000 >"$tmp/corpus/doc$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null 2>&1 || fail "prep"
run=(models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 12 --log-every 5 --data "$tmp/data" --backend cpu)
full() { # the steps of FILE's full step lines (val: the validation lines'), one a line
  tr '\r' '\n' <"$1" | sed -n "s/.*step *\([0-9]*\)\/12 | ${2:-loss [0-9.]* | lr}.*/\1/p" | tr '\n' ' '
}
logged() { wc -l <"$1/log.jsonl"; }

# Piped: full lines at steps 1, 5, 10 (--log-every 5), 4 and 8 (validations) and 12 (the last).
$m run "${run[@]}" --val-every 4 --out "$tmp/piped" >"$tmp/piped.out" 2>&1
check "piped: step lines at the first step, every --log-every, each validation and the last" \
  "[ \"$(full "$tmp/piped.out")\" = '1 4 5 8 10 12 ' ]"
check "piped: a validation line at each validation" "[ \"$(full "$tmp/piped.out" val)\" = '4 8 12 ' ]"
check "piped: no progress line, no carriage return" "! grep -q \$'\\r' '$tmp/piped.out' && ! grep -q smoothed '$tmp/piped.out'"
check "piped: log.jsonl has every step" "[ $(logged "$tmp/piped") -eq 12 ]"

# --quiet: the summary alone.
$m run "${run[@]}" --quiet --out "$tmp/quiet" >"$tmp/quiet.out" 2>"$tmp/quiet.err"
check "--quiet: no step line, no header" "! grep -q '^step\\|^training\\|^MFU\\|^compiled' '$tmp/quiet.out'"
check "--quiet: the final summary" "grep -q '^trained 12 steps in .*val loss' '$tmp/quiet.out'"
check "--quiet: log.jsonl has every step" "[ $(logged "$tmp/quiet") -eq 12 ]"

# A terminal (script(1) from util-linux gives the run one).
if ! command -v script >/dev/null; then
  echo "[skip] output: a run on a terminal: script(1) (util-linux) is not installed"
else
  script -qec "$m run ${run[*]} --val-every 0 --out $tmp/tty" /dev/null >"$tmp/tty.out" 2>&1 </dev/null
  progress=$(tr '\r' '\n' <"$tmp/tty.out" | sed 's/\x1b\[K//g' | grep -c '^step [0-9]*/12 | loss [0-9.]* (smoothed) | [0-9]* tok/s | MFU [0-9.]*% | ETA ')
  check "terminal: a progress line rewritten in place for each step between full lines (8 of 12)" "[ $progress -eq 8 ]"
  check "terminal: full step lines at the first step, every --log-every and the last" \
    "[ \"$(full "$tmp/tty.out")\" = '1 5 10 12 ' ]"
  check "terminal: the summary on a line of its own" "tr '\\r' '\\n' <'$tmp/tty.out' | grep -q '^trained 12 steps'"
  check "terminal: log.jsonl has every step" "[ $(logged "$tmp/tty") -eq 12 ]"
fi

$m run "${run[@]}" --log-every 0 --out "$tmp/zero" >/dev/null 2>"$tmp/err"
rc=$?
check "--log-every 0 is a usage error" "[ $rc -eq 2 ] && grep -q 'log-every wants a positive count' '$tmp/err'"
