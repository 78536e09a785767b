#!/usr/bin/env bash
# Data parallel on this CPU: GPT-2 small (models/gpt2.mdl, 124M) trained by 2 ranks of 1 thread each
# (mpirun, B per rank) against 1 process of 2 threads at the doubled batch, the same global batch, in
# interleaved rounds (A B C D A B C D): the 2 ranks with one all-reduce after the backward
# (--bucket-mb 0), with the gradients in 25 MiB buckets after it (the default) and beside it
# (--overlap). Tokens/s (median of the steps after the first two, over all rounds, with the range of
# the rounds' medians), the share of the step the ranks waited on the all-reduces, and the time in
# them (with --overlap on the engine's thread, beside the backward). Run it under `chrt -r`, not
# `chrt -f`: with --overlap a rank's two threads must take turns on its core, which FIFO scheduling
# at one priority never makes them do. Then, on paper, what the all-reduce of GPT-2 124M's gradients
# costs on 8 GPUs. Prints markdown; bench/RESULTS.md keeps the recorded figures. Needs Open MPI's mpirun.
set -u
cd "$(dirname "$0")/.."
steps=${STEPS:-8}
rounds=${ROUNDS:-2}
B=${B:-2}
T=${T:-64}
command -v mpirun >/dev/null || { echo "bench/dist.sh: needs Open MPI's mpirun (tools/deps.sh)"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/corpus"
cp /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/GPL-2 "$tmp/corpus/"
bin/mdlc prep "$tmp/corpus" -o "$tmp/data" >/dev/null || { echo "bench: mdlc prep failed"; exit 1; }
common=(models/gpt2.mdl -D T=$T --data "$tmp/data" --backend cpu --precision fp32 --val-every 0 --ckpt-every 0
        --log-every 1 --steps $steps)
field() { sed -n "s/.*\"$2\":\\([-0-9.e]*\\).*/\\1/p" "$1"; }
median() { sort -n | awk '{v[NR] = $1} END {if (NR == 0) print "n/a"; else print v[int((NR + 1) / 2)]}'; }
for r in $(seq $rounds); do
  rm -rf "$tmp/one" "$tmp/two"
  OMP_NUM_THREADS=2 bin/mdlc run "${common[@]}" -D B=$((2 * B)) --out "$tmp/one" >"$tmp/one.$r.out" 2>&1 </dev/null
  tail -n +3 "$tmp/one/log.jsonl" >"$tmp/one.$r.log"
  OMP_NUM_THREADS=1 mpirun -np 2 -x OMP_NUM_THREADS bin/mdlc run "${common[@]}" -D B=$B --out "$tmp/two" \
    --bucket-mb 0 >"$tmp/two.$r.out" 2>&1 </dev/null
  tail -n +3 "$tmp/two/log.jsonl" >"$tmp/two.$r.log"
  rm -rf "$tmp/two"
  OMP_NUM_THREADS=1 mpirun -np 2 -x OMP_NUM_THREADS bin/mdlc run "${common[@]}" -D B=$B --out "$tmp/two" \
    --bucket-mb 25 >"$tmp/buckets.$r.out" 2>&1 </dev/null
  tail -n +3 "$tmp/two/log.jsonl" >"$tmp/buckets.$r.log"
  rm -rf "$tmp/two"
  OMP_NUM_THREADS=1 mpirun -np 2 -x OMP_NUM_THREADS bin/mdlc run "${common[@]}" -D B=$B --out "$tmp/two" \
    --bucket-mb 25 --overlap >"$tmp/overlap.$r.out" 2>&1 </dev/null
  tail -n +3 "$tmp/two/log.jsonl" >"$tmp/overlap.$r.log"
done
cell() { # tokens/s over every round's steps, and the rounds' medians' range
  local all r meds
  all=$(cat "$tmp/$1".*.log | field /dev/stdin tok_s | median)
  meds=$(for r in $(seq $rounds); do field "$tmp/$1.$r.log" tok_s | median; done | sort -n)
  printf "%.0f (%.0f-%.0f)" "$all" "$(echo "$meds" | head -1)" "$(echo "$meds" | tail -1)"
}
share() { # the time waited on the all-reduces (and the time in them), over every round's steps
  cat "$tmp/$1".*.log | awk -F'[,:]' '{for (i = 1; i < NF; i++) {if ($i == "\"ms\"") ms += $(i + 1);
    if ($i == "\"comm_ms\"") c += $(i + 1); if ($i == "\"allreduce_ms\"") b += $(i + 1)}}
    END {printf "%.0f%% (%.0f of %.0f ms a step) | %.0f ms", 100 * c / ms, c / NR, ms / NR, b / NR}'
}
echo "| GPT-2 124M, fp32, global batch $((2 * B))x$T | tokens/s (median, range of rounds) | waiting on the all-reduce, share of the step | in the all-reduces a step |"
echo "|---|---|---|---|"
echo "| 1 process, 2 threads, B=$((2 * B)) | $(cell one) | - | - |"
echo "| 2 ranks (mpirun), 1 thread each, B=$B, one all-reduce after the backward (--bucket-mb 0) | $(cell two) | $(share two) |"
echo "| 2 ranks, 1 thread each, B=$B, 25 MiB buckets after the backward (--bucket-mb 25, the default) | $(cell buckets) | $(share buckets) |"
echo "| 2 ranks, 1 thread each, B=$B, 25 MiB buckets beside the backward (--overlap) | $(cell overlap) | $(share overlap) |"
echo
# On paper: a ring all-reduce moves 2 (N-1)/N of the buffer in and out of each rank.
awk 'BEGIN {
  p = 124439808; bytes = 4 * p; n = 8; moved = 2 * (n - 1) / n * bytes;
  printf "GPT-2 124M on 8 GPUs: the fp32 gradients are %.0f MB; a ring all-reduce moves %.0f MB in and out of each GPU a step:\n\n", bytes / 1e6, moved / 1e6;
  print "| link | bandwidth a GPU (one direction) | all-reduce a step |";
  print "|---|---|---|";
  split("NVLink 4 (H100 SXM, NVSwitch)|InfiniBand NDR 400 Gb/s|100 Gb/s Ethernet", name, "|");
  split("450 50 12.5", gbs, " ");
  for (i = 1; i <= 3; i++) printf "| %s | %s GB/s | %.1f ms |\n", name[i], gbs[i], 1e3 * moved / (gbs[i] * 1e9);
}'
