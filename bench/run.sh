#!/usr/bin/env bash
# make bench: training tokens/s of mdlc on the CPU against the peer a user would otherwise run: PyTorch
# from PyPI (MKL and oneDNN inside; eager and torch.compile), installed into a virtual environment
# ($MDL_BENCH_VENV, else ~/.cache/mdl/bench-venv) when missing, its columns n/a when it cannot be.
# Same GPT, batch shape, thread count, AdamW with clipping. mdlc runs fp32 (as PyTorch does by
# default) and at its default precision (auto: bf16 where the CPU's GEMM library has bf16 kernels of
# the CPU's own, else fp32); PyTorch eager and torch.compile also run under bf16 autocast, their own
# way to the same kernels. The last column is mdlc's default against the best of PyTorch's four.
#
# Then Muon against AdamW (MUON_GEOMS, default tiny,124m): the step time with `optimizer = muon` over
# the step time with AdamW, mdlc at its default precision and PyTorch eager (torch.optim.Muon for the
# blocks' matrices) under bf16 autocast, interleaved as above.
#
# Rounds are interleaved (each configuration once a round, ROUNDS rounds, default 3), so that a load
# on the machine falls on all columns alike; each cell is the median over the rounds of each run's
# median tok/s (its steps after the warm-up ones), with the range over the rounds. Then compile times
# (mdlc's C compile cold, and its start from the module cache; torch.compile's first step with an
# empty and with a filled cache) and every run's peak RSS. GEOMS=tiny,small,t512,124m picks rows.
# Prints markdown; bench/RESULTS.md keeps the recorded figures.
set -u
cd "$(dirname "$0")/.."
steps=${STEPS:-12}
rounds=${ROUNDS:-3}
geoms=${GEOMS:-tiny,small,t512,124m}
muon_geoms=${MUON_GEOMS:-tiny,124m}
threads=$(nproc)
venv=${MDL_BENCH_VENV:-$HOME/.cache/mdl/bench-venv}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

py=""
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "installing PyTorch from PyPI into $venv (once; about 5 GB) ..." >&2
  { python3 -m venv "$venv" && "$venv/bin/pip" install -q torch numpy; } >"$tmp/pip.log" 2>&1 ||
    echo "PyTorch from PyPI could not be installed ($(tail -1 "$tmp/pip.log")): its columns are n/a" >&2
fi
"$venv/bin/python" -c "import torch" 2>/dev/null && py="$venv/bin/python"

mkdir -p "$tmp/corpus"
cp /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/GPL-2 "$tmp/corpus/"
bin/mdlc prep "$tmp/corpus" -o "$tmp/data" >/dev/null || { echo "bench: mdlc prep failed"; exit 1; }
export MDL_CACHE="$tmp/cache"

# label | .mdl and its -D options | the same geometry for torch_gpt.py
configs() {
  cat <<'CONFIGS'
tiny|gpt2-tiny (L2 C64 H4 V256 B8 T64)|models/gpt2-tiny.mdl|--V 256 --maxT 128 --C 64 --H 4 --L 2 --B 8 --T 64
small|L4 C256 H4 V8192 B8 T128|models/gpt2.mdl -D L=4 -D C=256 -D H=4 -D V=8192 -D maxT=128 -D B=8 -D T=128|--V 8192 --maxT 128 --C 256 --H 4 --L 4 --B 8 --T 128
t512|L4 C256 H4 V8192 B2 T512|models/gpt2.mdl -D L=4 -D C=256 -D H=4 -D V=8192 -D maxT=512 -D B=2 -D T=512|--V 8192 --maxT 512 --C 256 --H 4 --L 4 --B 2 --T 512
124m|GPT-2 124M B4 T64|models/gpt2.mdl -D B=4 -D T=64|--V 50257 --maxT 1024 --C 768 --H 12 --L 12 --B 4 --T 64
CONFIGS
}

median_tok_s() { # the median tok/s of mdlc's step lines after the first two (warm-up)
  grep -o '[0-9.]* tok/s' "$1" | awk 'NR > 2 {print $1}' | sort -n |
    awk '{v[NR] = $1} END {if (NR == 0) print "n/a"; else print v[int((NR + 1) / 2)]}'
}

# mdl NAME ROUND MODELARGS... : one mdlc run; tok/s, peak RSS (KB) and the compile figure kept by name
mdl() {
  local name=$1 r=$2; shift 2
  rm -rf "$tmp/out"
  /usr/bin/time -f 'maxrss %M' -o "$tmp/$name.time.$r" bin/mdlc run "$@" --steps "$steps" --data "$tmp/data" \
    --backend cpu --val-every 0 --ckpt-every 0 --log-every 1 --out "$tmp/out" >"$tmp/$name.$r" 2>&1 </dev/null
  median_tok_s "$tmp/$name.$r" >"$tmp/$name.tok.$r"
  awk '/^maxrss/ {printf "%.0f\n", $2 / 1024}' "$tmp/$name.time.$r" >"$tmp/$name.rss.$r"
}

# peer NAME ROUND ARGS... : one torch_gpt.py run
peer() {
  local name=$1 r=$2; shift 2
  if [ -z "$py" ]; then
    echo n/a >"$tmp/$name.tok.$r"; echo n/a >"$tmp/$name.rss.$r"; echo n/a >"$tmp/$name.first.$r"
    return
  fi
  "$py" bench/torch_gpt.py "$@" --steps "$steps" --threads "$threads" >"$tmp/$name.$r" 2>&1 </dev/null
  sed -n 's/.*: \([0-9.]*\) tok\/s.*/\1/p' "$tmp/$name.$r" | grep . >"$tmp/$name.tok.$r" || echo n/a >"$tmp/$name.tok.$r"
  sed -n 's/.*peak RSS \([0-9]*\) MB.*/\1/p' "$tmp/$name.$r" | grep . >"$tmp/$name.rss.$r" || echo n/a >"$tmp/$name.rss.$r"
  sed -n 's/.*first step \([0-9.]*\) s.*/\1/p' "$tmp/$name.$r" | grep . >"$tmp/$name.first.$r" || echo n/a >"$tmp/$name.first.$r"
}

cell() { # median (min-max) over the rounds of files $1.*
  cat "$tmp/$1".[0-9]* 2>/dev/null | grep -v n/a | sort -n |
    awk '{v[NR] = $1} END {if (NR == 0) print "n/a"; else if (NR == 1) printf "%.0f", v[1];
         else printf "%.0f (%.0f-%.0f)", v[int((NR + 1) / 2)], v[1], v[NR]}'
}
med() { # the median alone
  cat "$tmp/$1".[0-9]* 2>/dev/null | grep -v n/a | sort -n |
    awk '{v[NR] = $1} END {if (NR == 0) print "n/a"; else print v[int((NR + 1) / 2)]}'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", a / b; else print "n/a"}'; }
best() { printf '%s\n' "$@" | grep -v n/a | sort -g | tail -1; }

rows=""
while IFS='|' read -r key label model tdims; do
  case ",$geoms," in *",$key,"*) ;; *) continue ;; esac
  rows="$rows $key"
  echo "$label" >"$tmp/$key.label"
  # compile: cold (an empty module cache) and a warm start, each a one-step run
  rm -rf "$MDL_CACHE" "$tmp/out"
  bin/mdlc run $model --steps 1 --data "$tmp/data" --backend cpu --val-every 0 --ckpt-every 0 --out "$tmp/out" \
    >"$tmp/$key.cold" 2>&1 </dev/null
  sed -n 's/.*cc took \([0-9.]*\) s.*/\1/p' "$tmp/$key.cold" >"$tmp/$key.cc"
  rm -rf "$tmp/out"
  t0=$(date +%s.%N)
  bin/mdlc run $model --steps 1 --data "$tmp/data" --backend cpu --val-every 0 --ckpt-every 0 --out "$tmp/out" \
    >"$tmp/$key.warm" 2>&1 </dev/null
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.2f\n", b - a}' >"$tmp/$key.warmstart"
  grep -m1 '^GEMM:' "$tmp/$key.cold" >"$tmp/gemm.line" 2>/dev/null
  grep -m1 '^training' "$tmp/$key.cold" | sed 's/.*precision //' >"$tmp/$key.prec"
  export TORCHINDUCTOR_CACHE_DIR="$tmp/inductor-$key"
  for r in $(seq 1 "$rounds"); do
    mdl "$key-mdl32" "$r" $model --precision fp32
    peer "$key-eager" "$r" $tdims
    mdl "$key-mdlauto" "$r" $model
    peer "$key-compile" "$r" $tdims --compile
    peer "$key-eager16" "$r" $tdims --bf16
    peer "$key-compile16" "$r" $tdims --compile --bf16
  done
done < <(configs)

# the Muon rows
muon_rows=""
while IFS='|' read -r key label model tdims; do
  case ",$muon_geoms," in *",$key,"*) ;; *) continue ;; esac
  muon_rows="$muon_rows $key"
  echo "$label" >"$tmp/$key.label"
  for r in $(seq 1 "$rounds"); do
    mdl "$key-mdladam" "$r" $model --set optimizer=adamw
    peer "$key-torchadam" "$r" $tdims --bf16
    mdl "$key-mdlmuon" "$r" $model --set optimizer=muon
    peer "$key-torchmuon" "$r" $tdims --bf16 --muon
  done
done < <(configs)

# rratio A B: the ratio of the medians, and its range over the rounds (round r's A over round r's B)
rratio() {
  local m r lo="" hi=""
  m=$(ratio "$(med "$1")" "$(med "$2")")
  for r in $(seq 1 "$rounds"); do
    local q
    q=$(awk -v a="$(cat "$tmp/$1.$r" 2>/dev/null)" -v b="$(cat "$tmp/$2.$r" 2>/dev/null)" \
      'BEGIN {if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b}')
    [ -z "$q" ] && continue
    lo=$(printf '%s\n' "$q" ${lo:+"$lo"} | sort -g | head -1)
    hi=$(printf '%s\n' "$q" ${hi:+"$hi"} | sort -g | tail -1)
  done
  if [ "$m" != n/a ] && [ -n "$lo" ] && [ "$rounds" -gt 1 ]; then echo "$m ($lo-$hi)"; else echo "$m"; fi
}

echo "| geometry | mdlc fp32 | mdlc default | PyTorch eager fp32 | torch.compile fp32 | PyTorch eager bf16 | torch.compile bf16 | best PyTorch | mdlc fp32 / compile fp32 | mdlc default / best PyTorch |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for key in $rows; do
  bk=n/a bv=0
  for c in eager compile eager16 compile16; do
    v=$(med "$key-$c.tok")
    [ "$v" != n/a ] && awk -v a="$v" -v b="$bv" 'BEGIN {exit !(a + 0 > b + 0)}' && bk=$c bv=$v
  done
  case $bk in eager) bn="eager fp32" ;; compile) bn="compile fp32" ;; eager16) bn="eager bf16" ;;
    compile16) bn="compile bf16" ;; *) bn=n/a ;; esac
  echo "| $(cat "$tmp/$key.label") | $(cell "$key-mdl32.tok") | $(cell "$key-mdlauto.tok") | $(cell "$key-eager.tok") |" \
    "$(cell "$key-compile.tok") | $(cell "$key-eager16.tok") | $(cell "$key-compile16.tok") | $bn |" \
    "$(rratio "$key-mdl32.tok" "$key-compile.tok") | $( [ "$bk" = n/a ] && echo n/a || rratio "$key-mdlauto.tok" "$key-$bk.tok") |"
done
echo
echo "tokens/s: median (range) over $rounds interleaved rounds, each run the median of its $steps steps after warm-up;"
echo "mdlc default = $(cat "$tmp/$(echo $rows | cut -d' ' -f1).prec" 2>/dev/null); ratios: of the medians (range of the"
echo "rounds' own ratios, round by round)"
if [ -n "$muon_rows" ]; then
  echo
  echo "| geometry | mdlc AdamW tok/s | mdlc Muon tok/s | mdlc Muon step / AdamW step | PyTorch eager bf16 AdamW | Muon | PyTorch Muon step / AdamW step |"
  echo "|---|---|---|---|---|---|---|"
  for key in $muon_rows; do
    echo "| $(cat "$tmp/$key.label") | $(cell "$key-mdladam.tok") | $(cell "$key-mdlmuon.tok") | $(rratio "$key-mdladam.tok" "$key-mdlmuon.tok") |" \
      "$(cell "$key-torchadam.tok") | $(cell "$key-torchmuon.tok") | $(rratio "$key-torchadam.tok" "$key-torchmuon.tok") |"
  done
fi
echo
echo "| geometry | mdlc cc, cold (s) | mdlc start, warm (s) | torch.compile 1st step, cold (s) | warm (s) | peak RSS MB: mdlc fp32 | mdlc default | eager fp32 | compile fp32 | eager bf16 | compile bf16 |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for key in $rows; do
  echo "| $(cat "$tmp/$key.label") | $(cat "$tmp/$key.cc") | $(cat "$tmp/$key.warmstart") | $(cat "$tmp/$key-compile.first.1") |" \
    "$( [ "$rounds" -gt 1 ] && cat "$tmp/$key-compile.first.2" || echo n/a) | $(med "$key-mdl32.rss") | $(med "$key-mdlauto.rss") |" \
    "$(med "$key-eager.rss") | $(med "$key-compile.rss") | $(med "$key-eager16.rss") | $(med "$key-compile16.rss") |"
done
echo
echo "$threads threads; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //');" \
  "$(cat "$tmp/gemm.line" 2>/dev/null); PyTorch ${py:+$("$py" -c 'import torch; print(torch.__version__)')}"
