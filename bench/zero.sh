#!/usr/bin/env bash
# ZeRO stage 1 on this CPU: GPT-2 small (models/gpt2.mdl, 124M) trained by 2 ranks of 1 thread each
# (mpirun, B per rank) without and with the optimizer's state sharded (--zero 1), against 1 process of
# 2 threads at the doubled batch, the same global batch, in interleaved rounds (A B C A B C):
# tokens/s (median of the steps after the first two, over all rounds, with the range of the rounds'
# medians), the share of the step the ranks waited on the collectives (the all-reduce, and with
# --zero 1 the all-gather of the updated parameters), and rank 0's peak memory (its last step line's,
# the range over the rounds). Extra options for every run in MDL_OPTS (e.g. --bucket-mb 0). Prints
# markdown; bench/RESULTS.md keeps the recorded figures. Needs Open MPI's mpirun.
set -u
cd "$(dirname "$0")/.."
steps=${STEPS:-8}
rounds=${ROUNDS:-2}
B=${B:-2}
T=${T:-64}
command -v mpirun >/dev/null || { echo "bench/zero.sh: needs Open MPI's mpirun (tools/deps.sh)"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/corpus"
cp /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/GPL-2 "$tmp/corpus/"
bin/mdlc prep "$tmp/corpus" -o "$tmp/data" >/dev/null || { echo "bench: mdlc prep failed"; exit 1; }
common=(models/gpt2.mdl -D T=$T --data "$tmp/data" --backend cpu --precision fp32 --val-every 0 --ckpt-every 0
        --log-every 1 --steps $steps ${MDL_OPTS:-})
field() { sed -n "s/.*\"$2\":\\([-0-9.e]*\\).*/\\1/p" "$1"; }
median() { sort -n | awk '{v[NR] = $1} END {if (NR == 0) print "n/a"; else print v[int((NR + 1) / 2)]}'; }
for r in $(seq $rounds); do
  rm -rf "$tmp/one" "$tmp/two" "$tmp/zero"
  OMP_NUM_THREADS=2 bin/mdlc run "${common[@]}" -D B=$((2 * B)) --out "$tmp/one" >"$tmp/one.$r.out" 2>&1 </dev/null
  tail -n +3 "$tmp/one/log.jsonl" >"$tmp/one.$r.log"
  OMP_NUM_THREADS=1 mpirun -np 2 -x OMP_NUM_THREADS bin/mdlc run "${common[@]}" -D B=$B --out "$tmp/two" \
    >"$tmp/two.$r.out" 2>&1 </dev/null
  tail -n +3 "$tmp/two/log.jsonl" >"$tmp/two.$r.log"
  OMP_NUM_THREADS=1 mpirun -np 2 -x OMP_NUM_THREADS bin/mdlc run "${common[@]}" -D B=$B --zero 1 --out "$tmp/zero" \
    >"$tmp/zero.$r.out" 2>&1 </dev/null
  tail -n +3 "$tmp/zero/log.jsonl" >"$tmp/zero.$r.log"
done
cell() { # tokens/s over every round's steps, and the rounds' medians' range
  local all r meds
  all=$(cat "$tmp/$1".*.log | field /dev/stdin tok_s | median)
  meds=$(for r in $(seq $rounds); do field "$tmp/$1.$r.log" tok_s | median; done | sort -n)
  printf "%.0f (%.0f-%.0f)" "$all" "$(echo "$meds" | head -1)" "$(echo "$meds" | tail -1)"
}
share() { # the collectives' share of the steps' time, over every round's steps
  cat "$tmp/$1".*.log | awk -F'[,:]' '{for (i = 1; i < NF; i++) {if ($i == "\"ms\"") ms += $(i + 1);
    if ($i == "\"comm_ms\"") c += $(i + 1)}} END {printf "%.0f%% (%.0f of %.0f ms a step)", 100 * c / ms, c / NR, ms / NR}'
}
peak() { # rank 0's peak MB at its last step line, lowest-highest over the rounds
  local p
  p=$(for r in $(seq $rounds); do grep "^step .* | loss" "$tmp/$1.$r.out" | tail -1 | sed 's/.*| peak \([0-9]*\) MB.*/\1/'; done | sort -n)
  printf "%s-%s" "$(echo "$p" | head -1)" "$(echo "$p" | tail -1)"
}
echo "| GPT-2 124M, fp32, global batch $((2 * B))x$T | tokens/s (median, range of rounds) | collectives' share of the step | peak MB (rank 0) |"
echo "|---|---|---|---|"
echo "| 1 process, 2 threads, B=$((2 * B)) | $(cell one) | - | $(peak one) |"
echo "| 2 ranks (mpirun), 1 thread each, B=$B | $(cell two) | $(share two) | $(peak two) |"
echo "| 2 ranks, --zero 1 | $(cell zero) | $(share zero) | $(peak zero) |"
