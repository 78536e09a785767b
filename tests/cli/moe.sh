#!/usr/bin/env bash
# models/moe-tiny.mdl, a sparse mixture of experts: its experts compute on their capacity of tokens
# (the GEMMs' shapes in the step plan), and it trains: the loss falls over 200 steps on the CPU,
# and the load-balancing loss is logged at every step as a metric, its share in the loss as written;
# recomputing its saved values (--checkpoint all) changes no number; its checkpoint samples text.
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "[ok] moe: $1"; }
fail() { echo "[fail] moe: $1"; }
check() { # check NAME CONDITION (a shell expression)
  if eval "$2"; then ok "$1"; else fail "$1"; fi
}

# B=2, T=16: N=32 tokens, E=4 experts, top-2, capacity 32 * 2 * 1.25 / 4 = 20 tokens an expert.
dims=(-D B=2 -D T=16)
$m build models/moe-tiny.mdl "${dims[@]}" -o "$tmp/build" >/dev/null 2>"$tmp/build.err"
check "builds" "[ $? -eq 0 ]"
check "each expert's GEMMs run on its 20 tokens of 32: [4,20,128] in, [4,20,64] out (forward, both layers)" \
  "[ \$(grep -c 'gemm  *\\[4,20,128\\]' '$tmp/build/plan.txt') -ge 2 ] && [ \$(grep -c 'gemm  *\\[4,20,64\\]' '$tmp/build/plan.txt') -ge 2 ]"
check "topk, gather and scatter_add are kernels of their own, with a reason" \
  "grep -q 'k[0-9]*_topk ' '$tmp/build/plan.txt' && grep -q 'consumer is a gather kernel (it reads at offsets computed from indices' '$tmp/build/plan.txt'"

mkdir -p "$tmp/corpus"
for i in 1 2 3 4 5 6; do head -c $((3000 * i)) /usr/share/common-licenses/GPL-3 | tail -c 3000 >"$tmp/corpus/doc$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null 2>&1 || fail "prep"
$m run models/moe-tiny.mdl "${dims[@]}" --steps 200 --val-every 0 --data "$tmp/data" --backend cpu --seed 1 \
  --out "$tmp/run" >"$tmp/run.out" 2>&1
check "200 steps run" "[ $? -eq 0 ] && [ \$(wc -l <'$tmp/run/log.jsonl') -eq 200 ]"
field() { sed -n "s/.*\"$1\":\\([-0-9.e+naif]*\\).*/\\1/p" "$tmp/run/log.jsonl"; }
field loss >"$tmp/loss"
field balance >"$tmp/balance"
field ce >"$tmp/ce"
first=$(head -20 "$tmp/loss" | awk '{ s += $1 } END { printf "%.4f", s / NR }')
last=$(tail -20 "$tmp/loss" | awk '{ s += $1 } END { printf "%.4f", s / NR }')
check "the loss falls over 200 steps: mean of the first 20 $first, of the last 20 $last (at least 1.0 lower)" \
  "awk -v a=$first -v b=$last 'BEGIN { exit !(b < a - 1.0) }'"
check "the load-balancing loss is logged at every step, finite, in (0, E=4]" \
  "[ \$(awk '\$1 > 0 && \$1 <= 4' '$tmp/balance' | wc -l) -eq 200 ]"
check "the loss is the cross-entropy plus 0.01 times the balance loss" \
  "paste '$tmp/loss' '$tmp/ce' '$tmp/balance' | awk '{ d = \$1 - \$2 - 0.01 * \$3; if (d < -2e-5 || d > 2e-5) bad++ } END { exit bad > 0 }'"
check "the step line shows the metric" "grep -q '^step *200/200 | loss [0-9.]* | ce [0-9.]* | balance [0-9.]*' '$tmp/run.out'"
check "mdlc sample generates from the checkpoint (one token at a time: capacity 1 an expert)" \
  "$m sample '$tmp/run/checkpoint.safetensors' --prompt 'The ' --tokens 20 >'$tmp/sample.out' 2>&1"

for c in none all; do
  $m run models/moe-tiny.mdl "${dims[@]}" --steps 4 --val-every 0 --data "$tmp/data" --backend cpu --seed 1 \
    --checkpoint $c --out "$tmp/ck-$c" >/dev/null 2>&1 || fail "4 steps with --checkpoint $c"
done
same() { sed 's/"ms":.*//' "$tmp/ck-$1/log.jsonl"; }
check "--checkpoint all gives the losses and gradient norms of --checkpoint none, to the digit" \
  "[ \"\$(same none)\" = \"\$(same all)\" ] && [ -n \"\$(same all)\" ]"
