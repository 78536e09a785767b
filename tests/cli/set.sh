#!/usr/bin/env bash
# `--set KEY=VALUE` end to end: a run takes the settings over the train section's (the learning rate
# and schedule in log.jsonl, the batch in the data line), the same run given the same settings in the
# train section gives the same losses bit for bit, and a bad --set is refused with status 1 before
# compiling (a malformed one with status 2, as a usage error).
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
check() { # check NAME CONDITION (a shell expression)
  if eval "$2"; then echo "[ok] set: $1"; else echo "[fail] set: $1: $(head -c 400 "$tmp/err" 2>/dev/null)"; fi
}
field() { sed -n "s/.*\"$2\":\\([-0-9.e]*\\).*/\\1/p" "$1"; } # field LOG KEY: its values, line by line

build/tools/blobs "$tmp/blobs" 400 >/dev/null || echo "[fail] set: build/tools/blobs failed"
$m run models/mlp.mdl --data "$tmp/blobs" --steps 5 --val-every 5 --backend cpu --out "$tmp/a" \
  --set lr=0.004 --set schedule=constant --set B=8 --set clip=0.25 >"$tmp/a.out" 2>"$tmp/err"
rc=$?
check "a run with --set lr, schedule, B and clip trains (status $rc)" "[ $rc -eq 0 ]"
check "log.jsonl has the --set learning rate, constant, at every step" \
  "[ \"\$(field '$tmp/a/log.jsonl' lr | sort -u)\" = 0.004 ] && [ \$(field '$tmp/a/log.jsonl' lr | wc -l) -eq 5 ]"
check "the data line has the --set batch" "grep -q 'shuffled batches of 8 examples' '$tmp/a.out'"

# The same settings written in the train section: the same losses, bit for bit.
sed -e 's/^\( *\)B = .*/\1B = 8/' -e 's/optimizer = adamw(lr=[^,)]*/optimizer = adamw(lr=0.004/' \
  -e 's/^\( *\)schedule = .*/\1schedule = constant\n\1clip = 0.25/' models/mlp.mdl >"$tmp/mlp.mdl"
grep -q '^ *clip = 0.25$' "$tmp/mlp.mdl" || echo "[fail] set: the train section was not rewritten"
$m run "$tmp/mlp.mdl" --data "$tmp/blobs" --steps 5 --val-every 5 --backend cpu --out "$tmp/b" >"$tmp/b.out" 2>"$tmp/err"
check "the settings written in the train section give the same losses" \
  "[ -s '$tmp/b/log.jsonl' ] && [ \"\$(field '$tmp/a/log.jsonl' loss)\" = \"\$(field '$tmp/b/log.jsonl' loss)\" ]"
$m run models/mlp.mdl --data "$tmp/blobs" --steps 5 --val-every 5 --backend cpu --out "$tmp/c" \
  --set lr=0.004 --set schedule=constant --set B=8 >"$tmp/c.out" 2>"$tmp/err"
check "--set clip changes the run (the norm is above 0.25 from the first step)" \
  "[ -s '$tmp/c/log.jsonl' ] && [ \"\$(field '$tmp/a/log.jsonl' loss)\" != \"\$(field '$tmp/c/log.jsonl' loss)\" ]"

$m run models/mlp.mdl --data "$tmp/blobs" --steps 5 --backend cpu --out "$tmp/d" --set lr=-1 >"$tmp/d.out" 2>"$tmp/err"
rc=$?
check "a bad value is refused at --set, quoted (status $rc)" \
  "[ $rc -eq 1 ] && grep -q '^--set:1:4: error: lr must be positive, got -1' '$tmp/err' && grep -q '1 | lr=-1' '$tmp/err' && [ ! -e '$tmp/d' ]"
$m check models/mlp.mdl --set lr >/dev/null 2>"$tmp/err"
rc=$?
check "--set without = is a usage error (status $rc)" "[ $rc -eq 2 ] && grep -q -- \"--set wants KEY=VALUE (e.g. --set lr=1e-3), got 'lr'\" '$tmp/err'"
