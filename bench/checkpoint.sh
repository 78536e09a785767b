#!/usr/bin/env bash
# make bench, the checkpoint part: what recomputation costs and what it buys on this CPU.
#  1. tokens/s, planned arena, measured peak RSS and the FLOPs recomputation adds under
#     --checkpoint none, auto=SIZE (SIZE halfway between all's plan and none's, so auto has work to do;
#     auto alone is none wherever none fits) and all, side by side in interleaved rounds.
#  2. The largest batch whose step plans within a fixed budget (BUDGET, default 4GiB) without
#     checkpointing and with auto=BUDGET, and tokens/s at each.
# Prints markdown; bench/RESULTS.md keeps the recorded figures.
set -u
cd "$(dirname "$0")/.."
steps=${STEPS:-8}
rounds=${ROUNDS:-3}
budget=${BUDGET:-4GiB}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/corpus"
cp /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/GPL-2 "$tmp/corpus/"
bin/mdlc prep "$tmp/corpus" -o "$tmp/data" >/dev/null || { echo "bench: mdlc prep failed"; exit 1; }
export MDL_CACHE="$tmp/cache"

planned() { grep -o 'planned peak [0-9.]* MB' "$1" | head -1 | grep -o '[0-9.]*'; }
extra() { grep -o '[0-9.]*% of the step' "$1" | head -1 | grep -o '^[0-9.]*' || echo 0; }
median_tok_s() {
  grep -o '[0-9.]* tok/s' "$1" | awk 'NR > 2 {print $1}' | sort -n |
    awk '{v[NR] = $1} END {if (NR == 0) print "n/a"; else print v[int((NR + 1) / 2)]}'
}
run() { # NAME ROUND STEPS MODELARGS...: tok/s and peak RSS (MB) of one run
  local name=$1 r=$2 n=$3; shift 3
  rm -rf "$tmp/out"
  /usr/bin/time -f 'maxrss %M' -o "$tmp/$name.time.$r" bin/mdlc run "$@" --steps "$n" --data "$tmp/data" \
    --backend cpu --val-every 0 --ckpt-every 0 --log-every 1 --out "$tmp/out" >"$tmp/$name.$r" 2>&1 </dev/null
  median_tok_s "$tmp/$name.$r" >"$tmp/$name.tok.$r"
  awk '/^maxrss/ {printf "%.0f\n", $2 * 1.024 / 1000}' "$tmp/$name.time.$r" >"$tmp/$name.rss.$r"
}
cell() {
  cat "$tmp/$1".[0-9]* 2>/dev/null | grep -v n/a | sort -n |
    awk '{v[NR] = $1} END {if (NR == 0) print "n/a"; else if (NR == 1) printf "%.0f", v[1];
         else printf "%.0f (%.0f-%.0f)", v[int((NR + 1) / 2)], v[1], v[NR]}'
}

# label | .mdl and its -D options
configs() {
  cat <<'CONFIGS'
small|L4 C256 H4 V8192 B8 T128|models/gpt2.mdl -D L=4 -D C=256 -D H=4 -D V=8192 -D maxT=128 -D B=8 -D T=128
124m|GPT-2 124M B8 T64|models/gpt2.mdl -D B=8 -D T=64
CONFIGS
}

echo "| geometry | precision | policy | planned arena MB | peak RSS MB | FLOPs added | tok/s |"
echo "|---|---|---|---|---|---|---|"
while IFS='|' read -r key label model; do
  for prec in fp32 bf16; do
    bin/mdlc check -d C $model --precision $prec --backend cpu --checkpoint none >"$tmp/$key-$prec.none.plan" 2>&1
    bin/mdlc check -d C $model --precision $prec --backend cpu --checkpoint all >"$tmp/$key-$prec.all.plan" 2>&1
    mid=$(awk -v a="$(planned "$tmp/$key-$prec.all.plan")" -v n="$(planned "$tmp/$key-$prec.none.plan")" \
      'BEGIN {printf "%.0f", (a + n) / 2 * 1e6}')
    bin/mdlc check -d C $model --precision $prec --backend cpu --checkpoint "auto=$mid" >"$tmp/$key-$prec.auto.plan" 2>&1
    for r in $(seq 1 "$rounds"); do
      for pol in none "auto=$mid" all; do
        run "$key-$prec-${pol%%=*}" "$r" "$steps" $model --precision $prec --checkpoint "$pol"
      done
    done
    for pol in none auto all; do
      p="$tmp/$key-$prec.$pol.plan"
      echo "| $label | $prec | $pol$( [ $pol = auto ] && echo "=$mid") | $(planned "$p") | $(cell "$key-$prec-$pol.rss") |" \
        "$(extra "$p")% | $(cell "$key-$prec-$pol.tok") |"
    done
  done
done < <(configs)
echo
echo "tok/s and peak RSS (MB, from ru_maxrss): median (range) over $rounds interleaved rounds of $steps steps;"
echo "FLOPs added: the step's FLOPs by the fusion pass's count beyond none's."
echo

# 2. the largest batch within the budget (GPT-2 124M, T=128, default precision), by halving then stepping
fits() { bin/mdlc check -d C models/gpt2.mdl -D B="$1" -D T=128 --backend cpu --checkpoint "$2" >"$tmp/fit" 2>&1; }
largest() { # POLICY -> the largest B (up to 512) whose plan fits
  local lo=0 hi=1
  while [ $hi -le 512 ] && fits $hi "$1"; do lo=$hi; hi=$((hi * 2)); done
  while [ $((hi - lo)) -gt 1 ]; do
    local m=$(((lo + hi) / 2))
    if fits $m "$1"; then lo=$m; else hi=$m; fi
  done
  echo $lo
}
bytes=$(awk -v b="$budget" 'BEGIN {n = b + 0; u = substr(b, length(n "") + 1);
  f = u == "GiB" ? 2^30 : u == "MiB" ? 2^20 : u == "GB" ? 1e9 : u == "MB" ? 1e6 : 1; printf "%.0f", n * f}')
# none fits where its own plan is within the budget
bnone=0
for b in $(seq 1 512); do
  bin/mdlc check -d C models/gpt2.mdl -D B=$b -D T=128 --backend cpu --checkpoint none >"$tmp/fit" 2>&1
  awk -v p="$(planned "$tmp/fit")" -v x="$bytes" 'BEGIN {exit !(p * 1e6 <= x)}' || break
  bnone=$b
done
bauto=$(largest "auto=$budget")
echo "| GPT-2 124M, T=128, budget $budget | largest batch | planned arena MB | FLOPs added | tok/s | peak RSS MB |"
echo "|---|---|---|---|---|---|"
for pair in "none $bnone" "auto=$budget $bauto"; do
  set -- $pair
  [ "$2" -gt 0 ] || { echo "| $1 | 0 | | | | |"; continue; }
  bin/mdlc check -d C models/gpt2.mdl -D B=$2 -D T=128 --backend cpu --checkpoint "$1" >"$tmp/p" 2>&1
  run "batch-${1%%=*}" 1 3 models/gpt2.mdl -D B=$2 -D T=128 --checkpoint "$1"
  echo "| $1 | $2 | $(planned "$tmp/p") | $(extra "$tmp/p")% | $(cat "$tmp/batch-${1%%=*}.tok.1") | $(cat "$tmp/batch-${1%%=*}.rss.1") |"
done
echo
echo "(tok/s of 3 steps: the third; default precision: $(grep -m1 '^training' "$tmp/batch-none.1" | sed 's/.*precision //'))"
