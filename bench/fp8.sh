#!/usr/bin/env bash
# FP8 against bf16 on this CPU: gpt2-tiny (models/gpt2-tiny.mdl) trained STEPS (300) steps on the
# fortunes (bin/mdlc prep /usr/share/games/fortunes --doc-sep %) at each precision, the same seed and
# batches: the training loss averaged over windows of 25 steps, the largest gap between the two
# curves, and tokens/s (median of the steps after the first two, over ROUNDS interleaved rounds, with
# the range of the rounds' medians). fp8 is emulated on a CPU (each cast rounds in software and the
# fp8 operands are widened for the f32 GEMM), so this measures what it costs here and whether it
# trains like bf16, not FP8's speed. Prints markdown; bench/RESULTS.md keeps the recorded figures.
set -u
cd "$(dirname "$0")/.."
steps=${STEPS:-300}
rounds=${ROUNDS:-2}
[ -d /usr/share/games/fortunes ] || { echo "bench/fp8.sh: needs /usr/share/games/fortunes (fortunes-min)"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bin/mdlc prep /usr/share/games/fortunes --doc-sep % -o "$tmp/data" >"$tmp/prep.log" 2>&1 ||
  { cat "$tmp/prep.log"; echo "bench: mdlc prep failed"; exit 1; }
common=(models/gpt2-tiny.mdl --data "$tmp/data" --backend cpu --val-every 0 --ckpt-every 0 --log-every 1 --seed 1)
field() { sed -n "s/.*\"$2\":\\([-0-9.e]*\\).*/\\1/p" "$1"; }
median() { sort -n | awk '{v[NR] = $1} END {if (NR == 0) print "n/a"; else print v[int((NR + 1) / 2)]}'; }
# The curves: one run of each.
for p in bf16 fp8; do
  bin/mdlc run "${common[@]}" --precision $p --steps "$steps" --out "$tmp/curve-$p" >"$tmp/curve-$p.out" 2>&1 </dev/null ||
    { echo "bench: the $p run failed: $(tail -3 "$tmp/curve-$p.out")"; exit 1; }
  field "$tmp/curve-$p/log.jsonl" loss >"$tmp/loss-$p"
done
echo "| steps | bf16 loss | fp8 loss | fp8 - bf16 |"
echo "|---|---|---|---|"
paste "$tmp/loss-bf16" "$tmp/loss-fp8" | awk -v w=25 '{a += $1; b += $2; n++; d = $2 - $1; if (d < 0) d = -d; if (d > m) m = d}
  n == w {printf "| %d-%d | %.4f | %.4f | %+.4f |\n", NR - w + 1, NR, a / w, b / w, (b - a) / w; a = b = n = 0}
  END {printf "\nThe largest gap at one step: %.4f.\n\n", m}'
# The speed: interleaved rounds of a shorter run.
for r in $(seq "$rounds"); do
  for p in bf16 fp8; do
    rm -rf "$tmp/speed"
    bin/mdlc run "${common[@]}" --precision $p --steps "${SPEED_STEPS:-20}" --out "$tmp/speed" >/dev/null 2>&1 </dev/null
    tail -n +3 "$tmp/speed/log.jsonl" >"$tmp/speed-$p.$r"
  done
done
cell() {
  local all meds
  all=$(cat "$tmp/speed-$1".* | field /dev/stdin tok_s | median)
  meds=$(for r in $(seq "$rounds"); do field "$tmp/speed-$1.$r" tok_s | median; done | sort -n)
  printf "%.0f (%.0f-%.0f)" "$all" "$(echo "$meds" | head -1)" "$(echo "$meds" | tail -1)"
}
echo "| gpt2-tiny on this CPU | tokens/s (median, range of rounds) |"
echo "|---|---|"
echo "| bf16 | $(cell bf16) |"
echo "| fp8 (emulated) | $(cell fp8) |"
