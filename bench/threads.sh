#!/usr/bin/env bash
# OpenMP's wait policy, measured: gpt2-tiny's median ms/step (B8 T64, 40 steps after 5 warm-up ones)
# under libgomp's default (spin about 300k iterations, then sleep) and other GOMP_SPINCOUNT values,
# on an idle machine and with 1 and 2 busy processes beside it. The emitted loops and oneDNN's GEMMs
# share libgomp's one pool of threads, so this one setting governs both. Figures: bench/RESULTS.md.
set -u
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
pids=""
trap '[ -n "$pids" ] && kill $pids 2>/dev/null; rm -rf "$tmp"' EXIT
mkdir -p "$tmp/corpus"
cp /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 "$tmp/corpus/"
bin/mdlc prep "$tmp/corpus" -o "$tmp/data" >/dev/null || exit 1
run() { # median ms/step with the given environment
  rm -rf "$tmp/out"
  env "$@" bin/mdlc run models/gpt2-tiny.mdl --data "$tmp/data" --out "$tmp/out" --steps 45 --val-every 0 \
    --ckpt-every 0 --log-every 1 --backend cpu >"$tmp/log" 2>&1 </dev/null
  grep -o '[0-9.]* ms |' "$tmp/log" | awk 'NR > 5 {print $1}' | sort -n |
    awk '{v[NR] = $1} END {if (NR) printf "%s", v[int((NR + 1) / 2)]; else printf "n/a"}'
}
echo "| busy processes beside | default | GOMP_SPINCOUNT=30000000000 | 300000 | 10000 | 1000 | 0 (passive) |"
echo "|---|---|---|---|---|---|---|"
for load in 0 1 2; do
  pids=""
  for _ in $(seq 1 "$load"); do (while :; do :; done) & pids="$pids $!"; done
  sleep 0.5
  row="| $load | $(run MDL_BENCH=1) ms"
  for sc in 30000000000 300000 10000 1000 0; do row="$row | $(run GOMP_SPINCOUNT=$sc) ms"; done
  echo "$row |"
  [ -n "$pids" ] && kill $pids 2>/dev/null
  wait 2>/dev/null
  pids=""
done
