#!/usr/bin/env bash
# make bench: training tokens/s of the tiny and a small GPT on the compiled CPU back end with fusion on
# and off, side by side in one run, and PyTorch eager (same model, batch, fp32, AdamW, thread count)
# when it is installed; mdlc runs in fp32 there, as PyTorch does, and once more with the models' bf16
# GEMM operands (what the rounding costs or saves on this CPU). Prints a markdown table;
# bench/RESULTS.md keeps the recorded figures.
set -u
cd "$(dirname "$0")/.."
steps=${STEPS:-12}
threads=$(nproc)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/corpus"
cp /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/GPL-2 "$tmp/corpus/"
bin/mdlc prep "$tmp/corpus" -o "$tmp/data" >/dev/null

median_tok_s() { # the median tok/s of the metrics lines after the first two (warm-up)
  grep -o '[0-9.]* tok/s' "$1" | awk 'NR > 2 {print $1}' | sort -n |
    awk '{v[NR] = $1} END {if (NR == 0) print "n/a"; else print v[int((NR + 1) / 2)]}'
}

echo "| model | mdlc fused tok/s | mdlc unfused tok/s | fused/unfused | PyTorch eager tok/s | fused/PyTorch | mdlc fused bf16 tok/s | bf16/fp32 |"
echo "|---|---|---|---|---|---|---|---|"
while IFS='|' read -r label model dims tdims; do
  run=(bin/mdlc run "$model" $dims --steps "$steps" --data "$tmp/data" --backend cpu --val-every 0 --ckpt-every 0)
  rm -rf "$tmp/out"; "${run[@]}" --out "$tmp/out" --precision fp32 >"$tmp/fused" 2>&1
  rm -rf "$tmp/out"; "${run[@]}" --out "$tmp/out" --precision fp32 --no-fuse >"$tmp/unfused" 2>&1
  rm -rf "$tmp/out"; "${run[@]}" --out "$tmp/out" --precision bf16 >"$tmp/bf16" 2>&1
  f=$(median_tok_s "$tmp/fused"); u=$(median_tok_s "$tmp/unfused"); h=$(median_tok_s "$tmp/bf16")
  t="n/a"
  if /usr/bin/python3 -c "import torch" 2>/dev/null; then
    t=$(/usr/bin/python3 bench/torch_gpt.py $tdims --steps "$steps" --threads "$threads" | grep -o '[0-9.]* tok/s' | cut -d' ' -f1)
  fi
  ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", a / b; else print "n/a"}'; }
  echo "| $label | $f | $u | $(ratio "$f" "$u") | $t | $(ratio "$f" "$t") | $h | $(ratio "$h" "$f") |"
done <<'CONFIGS'
gpt2-tiny (L2 C64 H4 V256 B8 T64)|models/gpt2-tiny.mdl||--V 256 --maxT 128 --C 64 --H 4 --L 2 --B 8 --T 64
gpt2-small (L4 C256 H4 V8192 B8 T128)|models/gpt2.mdl|-D L=4 -D C=256 -D H=4 -D V=8192 -D maxT=128 -D B=8 -D T=128|--V 8192 --maxT 128 --C 256 --H 4 --L 4 --B 8 --T 128
CONFIGS
echo
echo "$threads threads; median of $steps steps after 2 warm-up steps; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
