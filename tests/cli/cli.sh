#!/usr/bin/env bash
# The command line: exit statuses, --help/--version, check output, init/grad round trip, run.
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

expect() { # expect NAME STATUS CMD...: the command exits with STATUS
  local name=$1 want=$2; shift 2
  "$@" >"$tmp/out" 2>"$tmp/err"; local rc=$?
  if [ "$rc" -eq "$want" ]; then echo "[ok] cli: $name"; else
    echo "[fail] cli: $name: status $rc, wanted $want: $(head -c 300 "$tmp/err")"; fi
}
contains() { # contains NAME FILE TEXT
  if grep -qF -- "$3" "$2"; then echo "[ok] cli: $1"; else
    echo "[fail] cli: $1: '$3' not in: $(head -c 300 "$2")"; fi
}

expect "--version exits 0" 0 $m --version
contains "--version prints the version" "$tmp/out" "mdlc 0."
expect "--help exits 0" 0 $m --help
contains "--help lists the verbs" "$tmp/out" "check FILE.mdl"
expect "no verb is a usage error" 2 $m
expect "unknown verb is a usage error" 2 $m frobnicate models/mlp.mdl
contains "unknown verb is named" "$tmp/err" "unknown verb 'frobnicate'"
expect "unknown option is a usage error" 2 $m check --frob models/mlp.mdl
expect "bad -D is a usage error" 2 $m check -D B models/mlp.mdl
# a value beyond 64 bits is refused as one (strtoll would saturate it to 2^63 - 1, which a dim's
# bounds then blame on the user as 9223372036854775807)
expect "-D B=2^64 is a usage error" 2 $m check -D B=18446744073709551616 models/gpt2-tiny.mdl
contains "... naming the overflow" "$tmp/err" "-D B=18446744073709551616: the value overflows a 64-bit integer"
expect "missing file is a user error" 1 $m check "$tmp/nope.mdl"
contains "missing file is named" "$tmp/err" "$tmp/nope.mdl"

expect "check gpt2" 0 $m check models/gpt2.mdl
contains "gpt2 has the published 124M parameter count" "$tmp/out" "124439808 parameters"
for f in models/*.mdl; do expect "check $f" 0 $m check "$f"; done
expect "-D overrides a dim" 0 $m check -D B=3 models/gpt2-tiny.mdl
contains "-D B=3 reaches the inputs" "$tmp/out" "i32[3,64]"
expect "dump after parse and autodiff" 0 $m -d PA check models/mlp.mdl
contains "dump shows the backward graph" "$tmp/out" "# backward"
contains "dump shows adamw" "$tmp/out" "adamw("

expect "init writes weights" 0 $m init models/gpt2-tiny.mdl -o "$tmp/w.safetensors" --seed 3
expect "init needs -o" 2 $m init models/gpt2-tiny.mdl
expect "grad with a missing batch file fails" 1 $m grad models/gpt2-tiny.mdl --weights "$tmp/w.safetensors" \
  --batch "$tmp/none.safetensors" -o "$tmp/g.safetensors"
contains "the missing batch is named" "$tmp/err" "none.safetensors"
expect "weights of another model are refused" 1 $m grad models/llama-tiny.mdl --weights "$tmp/w.safetensors" \
  --batch "$tmp/none.safetensors" -o "$tmp/g.safetensors"
printf 'not a safetensors file' >"$tmp/bad.safetensors"
expect "grad with corrupt weights is refused" 1 $m grad models/gpt2-tiny.mdl --weights "$tmp/bad.safetensors" \
  --batch "$tmp/none.safetensors" -o "$tmp/g.safetensors"
contains "the corrupt file is named" "$tmp/err" "bad.safetensors"

# A param that no output uses: a warning at its place, not an error; a model without one, none.
printf 'model m\ninput x: f32[8, 16]\nparam w: [16, 4] = normal(0.1)\nparam extra: [4] = zeros\noutput y = x @ w\n' \
  >"$tmp/unused.mdl"
expect "a param no output uses is no error" 0 $m check "$tmp/unused.mdl"
contains "a param no output uses gets a warning at its place" "$tmp/err" \
  "$tmp/unused.mdl:4:7: warning: param 'extra' is not used by any output"
expect "a model that uses every param" 0 $m check models/gpt2-tiny.mdl
[ -s "$tmp/err" ] && echo "[fail] cli: a model that uses every param warns: $(head -c 300 "$tmp/err")" ||
  echo "[ok] cli: a model that uses every param gets no warning"

mkdir -p "$tmp/corpus"
for i in 1 2 3 4 5 6; do head -c $((3000 * i)) /usr/share/common-licenses/GPL-3 | tail -c 3000 >"$tmp/corpus/doc$i.txt"; done
expect "prep a small corpus" 0 $m prep "$tmp/corpus" -o "$tmp/shards"
expect "run needs --data" 1 $m run models/gpt2-tiny.mdl --steps 1
contains "run says where data comes from" "$tmp/err" "mdlc prep"
expect "run trains a few steps" 0 $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 3 --data "$tmp/shards" \
  --out "$tmp/run"
contains "run prints tok/s" "$tmp/out" "tok/s"
contains "run prints MFU" "$tmp/out" "MFU"
contains "run prints the validation loss" "$tmp/out" "val loss"
# The summary's rate over the steps alone is at least the whole run's (which also validates and
# writes checkpoints).
awk '/^trained / { whole = $0; sub(/.*\(/, "", whole); whole += 0; steps = $0; sub(/.*alone [0-9.]+ s, /, "", steps);
     steps += 0; ok = whole > 0 && steps >= whole }
     END { printf "[%s] cli: the summary gives the tokens/s of the whole run and of its steps\n", ok ? "ok" : "fail" }' \
  "$tmp/out"
for f in checkpoint.safetensors log.jsonl loss.svg; do
  [ -s "$tmp/run/$f" ] && echo "[ok] cli: run writes $f" || echo "[fail] cli: run writes $f: missing or empty"
done
expect "run refuses to overwrite a checkpoint" 1 $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 3 \
  --data "$tmp/shards" --out "$tmp/run"
contains "the kept checkpoint is named" "$tmp/err" "checkpoint.safetensors"
expect "a checkpoint of another configuration is refused" 1 $m run models/gpt2-tiny.mdl -D B=4 -D T=16 \
  --steps 5 --data "$tmp/shards" --out "$tmp/run" --resume
contains "the configuration mismatch is explained" "$tmp/err" "another model configuration"
expect "weights of another model are refused by run" 1 $m run models/llama-tiny.mdl -D B=2 -D T=16 --steps 1 \
  --data "$tmp/shards" --out "$tmp/run3" --weights "$tmp/w.safetensors"
: >"$tmp/empty.txt"
expect "an empty corpus is refused" 1 $m prep "$tmp/empty.txt" -o "$tmp/nothing"
contains "the empty corpus is named" "$tmp/err" "empty.txt"

expect "prep with a BPE vocabulary" 0 $m prep "$tmp/corpus" -o "$tmp/bpe" --vocab 300
expect "a tokenizer larger than the model's V is refused" 1 $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 1 \
  --data "$tmp/bpe" --out "$tmp/run4"
contains "the tokenizer file is named with both sizes" "$tmp/err" "tokenizer.bin: error: the data's tokenizer has 300 tokens, more than the model's V = 256"
[ -e "$tmp/run4" ] && echo "[fail] cli: the refused run created its output folder" || echo "[ok] cli: the refused run wrote nothing"
expect "the same data with -D V=300 trains" 0 $m run models/gpt2-tiny.mdl -D B=2 -D T=16 -D V=300 --steps 2 \
  --data "$tmp/bpe" --out "$tmp/run5"
cp -r "$tmp/shards" "$tmp/bad-shards"
head -c 2000 "$tmp/shards/train_000000.bin" >"$tmp/bad-shards/train_000000.bin"
expect "a truncated shard is refused" 1 $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 1 --data "$tmp/bad-shards" \
  --out "$tmp/run6"
contains "the truncated shard is named" "$tmp/err" "bad-shards/train_000000.bin: error: truncated"

$m init models/llama-tiny.mdl -o "$tmp/wl.safetensors" >/dev/null

# Batches are shuffled by default, a permutation from --seed; --no-shuffle keeps the data's order,
# whatever the seed. The weights come from one file, so that only the batches differ between runs.
$m init models/gpt2-tiny.mdl -o "$tmp/wsh.safetensors" --seed 5 >/dev/null
for s in 1 2 "1 --no-shuffle" "2 --no-shuffle" "1 --shuffle"; do
  # shellcheck disable=SC2086
  $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 3 --data "$tmp/shards" --out "$tmp/sh${s// /}" --val-every 0 \
    --ckpt-every 0 --backend cpu --weights "$tmp/wsh.safetensors" --seed $s >/dev/null 2>&1
  sed -n 's/.*"loss":\([0-9.]*\).*/\1/p' "$tmp/sh${s// /}/log.jsonl" >"$tmp/sh${s// /}.losses"
done
[ -s "$tmp/sh1.losses" ] && ! cmp -s "$tmp/sh1.losses" "$tmp/sh2.losses" && ! cmp -s "$tmp/sh1.losses" "$tmp/sh1--no-shuffle.losses" &&
  echo "[ok] cli: batches are shuffled by default: two seeds draw different batches, neither the data's order" ||
  echo "[fail] cli: default batches: seed 1 $(tr '\n' ' ' <"$tmp/sh1.losses"), seed 2 $(tr '\n' ' ' <"$tmp/sh2.losses")"
[ -s "$tmp/sh1--no-shuffle.losses" ] && cmp -s "$tmp/sh1--no-shuffle.losses" "$tmp/sh2--no-shuffle.losses" &&
  cmp -s "$tmp/sh1.losses" "$tmp/sh1--shuffle.losses" &&
  echo "[ok] cli: --no-shuffle keeps the data's order whatever the seed; --shuffle is the default, said" ||
  echo "[fail] cli: --no-shuffle: seed 1 $(tr '\n' ' ' <"$tmp/sh1--no-shuffle.losses"), seed 2 $(tr '\n' ' ' <"$tmp/sh2--no-shuffle.losses")"

# Errors before work: a checkpoint of another configuration, weights of another model, a missing
# checkpoint to resume, a data folder without shards: each reported before the model is compiled
# (the module cache stays empty) and with nothing written to --out.
mkdir -p "$tmp/early-cache" "$tmp/noshards"
cp "$tmp/shards/tokenizer.bin" "$tmp/noshards/"
early() { # early NAME TEXT ARGS...: mdlc run ARGS fails with TEXT, before any compile
  local name=$1 text=$2; shift 2
  expect "$name" 1 env MDL_CACHE="$tmp/early-cache" $m run models/gpt2-tiny.mdl -D T=16 --steps 1 --backend cpu "$@"
  contains "$name: says why" "$tmp/err" "$text"
  [ -z "$(ls -A "$tmp/early-cache")" ] && echo "[ok] cli: $name: before anything is compiled" ||
    echo "[fail] cli: $name: a module was compiled first: $(ls "$tmp/early-cache")"
}
early "resume, a checkpoint of another configuration" "another model configuration" -D B=4 --data "$tmp/shards" \
  --out "$tmp/run" --resume
early "resume, no checkpoint" "checkpoint.safetensors: error: cannot open" -D B=2 --data "$tmp/shards" \
  --out "$tmp/early-none" --resume
early "weights of another model" "wl.safetensors: error: no tensor 'wte'" -D B=2 --data "$tmp/shards" --out "$tmp/early-w" \
  --weights "$tmp/wl.safetensors"
early "a data folder without shards" "noshards: error: no train shards" -D B=2 --data "$tmp/noshards" \
  --out "$tmp/early-d"
early "a truncated shard" "train_000000.bin: error: truncated" -D B=2 --data "$tmp/bad-shards" --out "$tmp/early-t"
for d in early-none early-w early-d early-t; do
  [ -e "$tmp/$d" ] && echo "[fail] cli: the early error left $d" || echo "[ok] cli: the early error ($d) wrote nothing"
done

# Each pass can be switched off, and switching one off changes the plan but not the numbers.
for off in "" --no-fuse --no-reuse --no-chunk-lmhead; do
  rm -rf "$tmp/p$off"
  $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 3 --data "$tmp/shards" --out "$tmp/p$off" --val-every 0 $off \
    >"$tmp/p$off.out" 2>&1 || echo "[fail] cli: run ${off:-(all passes)}: $(tail -c 300 "$tmp/p$off.out")"
  sed -n 's/.*"loss":\([0-9.]*\).*/\1/p' "$tmp/p$off/log.jsonl" >"$tmp/p$off.losses"
done
for off in --no-fuse --no-reuse --no-chunk-lmhead; do
  if [ -s "$tmp/p.losses" ] && paste "$tmp/p.losses" "$tmp/p$off.losses" |
    awk '{d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * $1) bad = 1} END {exit bad}'; then
    echo "[ok] cli: $off trains to the same losses (within 1e-5)"
  else
    echo "[fail] cli: $off changes the losses: $(paste "$tmp/p.losses" "$tmp/p$off.losses" | tr '\n' ' ')"
  fi
done
a1=$($m build models/gpt2-tiny.mdl -o "$tmp/b1" | grep -o 'activations [0-9.]*' | cut -d' ' -f2)
a2=$($m build models/gpt2-tiny.mdl -o "$tmp/b2" --no-reuse | grep -o 'activations [0-9.]*' | cut -d' ' -f2)
awk -v a="$a1" -v b="$a2" 'BEGIN {exit !(a > 0 && b > 1.5 * a)}' &&
  echo "[ok] cli: --no-reuse shows what memory reuse saves ($a1 MB vs $a2 MB of activations)" ||
  echo "[fail] cli: --no-reuse activations $a2 MB vs $a1 MB"

# Memory: with validation and checkpoints, the process stays within 1.1x the step's arena plus 128 MB,
# the runtime's own (the program, oneDNN and OpenMP, the module, the LM head's chunk of logits, 33:
# 113 MB in all here; both figures in MB of 10^6 bytes). It was 2.57x (1136 MB against 442) while the validation
# engine's arena was zeroed up front and a checkpoint copied the parameters and moments, and 640 MB
# while the validation engine's parameters and the training step's gradients and activations were all
# resident at once.
rm -rf "$tmp/mem"
$m run models/gpt2.mdl -D V=32768 -D C=512 -D H=8 -D L=1 -D B=4 -D T=64 --steps 4 --val-every 2 --ckpt-every 2 \
  --data "$tmp/shards" --out "$tmp/mem" --backend cpu >"$tmp/mem.out" 2>&1
arena=$(grep -o 'arena [0-9.]* MB' "$tmp/mem.out" | head -1 | cut -d' ' -f2)
peak=$(grep -o 'peak [0-9]* MB' "$tmp/mem.out" | cut -d' ' -f2 | sort -n | tail -1)
awk -v a="$arena" -v p="$peak" 'BEGIN {exit !(a > 0 && p > 0 && p <= 1.1 * a + 128)}' &&
  echo "[ok] cli: validation and checkpoints keep the process within 1.1x its arena + 128 MB ($peak MB, arena $arena MB)" ||
  echo "[fail] cli: peak $peak MB against an arena of $arena MB: $(tail -c 300 "$tmp/mem.out")"

# Validation between steps changes no training step (the training engine gives back its gradients'
# and activations' memory while validation runs: they come back as zeros, and no step reads them first).
for v in 0 2; do
  rm -rf "$tmp/v$v"
  $m run models/gpt2-tiny.mdl -D B=4 -D T=32 --steps 6 --val-every $v --ckpt-every 0 --log-every 1 \
    --data "$tmp/shards" --out "$tmp/v$v" --backend cpu 2>&1 | grep '^step' | grep -v 'val loss' | cut -d'|' -f1-4 >"$tmp/v$v.steps"
done
[ "$(wc -l <"$tmp/v0.steps")" -eq 6 ] && cmp -s "$tmp/v0.steps" "$tmp/v2.steps" &&
  echo "[ok] cli: validation every 2 steps leaves the training steps' losses and norms as they are" ||
  echo "[fail] cli: training steps differ with validation: $(diff "$tmp/v0.steps" "$tmp/v2.steps" | head -4)"

# --profile: the step runs kernel by kernel, to the same losses, and a table of every kernel follows.
rm -rf "$tmp/prof"
$m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 3 --data "$tmp/shards" --out "$tmp/prof" --val-every 0 --profile \
  >"$tmp/prof.out" 2>&1
nk=$($m build models/gpt2-tiny.mdl -D B=2 -D T=16 -o "$tmp/prof-build" | grep -o '[0-9]* kernels' | head -1)
contains "--profile prints the kernel table (every kernel of the plan)" "$tmp/prof.out" "profile: $nk"
contains "--profile names the fused kernels" "$tmp/prof.out" "k2_layernorm_fwd__add"
contains "--profile times the steps after the first, a warm-up" "$tmp/prof.out" "over 2 steps after the first"
rm -rf "$tmp/prof1"
$m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 1 --data "$tmp/shards" --out "$tmp/prof1" --val-every 0 --profile \
  >"$tmp/prof1.out" 2>&1
contains "--profile of one step says that nothing was timed" "$tmp/prof1.out" "profile: no step was timed"
grep -q "^profile:" "$tmp/p.out" && echo "[fail] cli: a run without --profile prints a profile line" ||
  echo "[ok] cli: a run without --profile prints no profile"
rm -rf "$tmp/profi"
$m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 1 --data "$tmp/shards" --out "$tmp/profi" --val-every 0 --profile \
  --backend interp >"$tmp/profi.out" 2>&1
contains "--profile on the interpreter says it has no profile" "$tmp/profi.out" "--profile: the interp back end runs op by op"
sed -n 's/.*"loss":\([0-9.]*\).*/\1/p' "$tmp/prof/log.jsonl" >"$tmp/prof.losses"
cmp -s "$tmp/prof.losses" "$tmp/p.losses" && echo "[ok] cli: --profile trains to the same losses" ||
  echo "[fail] cli: --profile changes the losses"

# Precision: the models say auto, which is bf16 where the CPU's GEMM library has bf16 GEMM kernels of
# the CPU's own (its GEMM line then gives a bf16 rate), else fp32, and the run says which and why; fp32
# and bf16 on request both train, to close but different losses.
if grep -q '^GEMM: .* GFLOP/s bf16' "$tmp/p.out"; then want="precision auto, bf16: "; else want="precision auto, fp32: "; fi
contains "run says which precision auto chose, and why" "$tmp/p.out" "$want"
contains "run names the GEMM library, its kernels and their measured rate" "$tmp/p.out" "GEMM: "
grep -qE '^GEMM: (oneDNN|OpenBLAS) [0-9.]+, [^ ]+ kernels[^:]*: [0-9]+ GFLOP/s fp32' "$tmp/p.out" &&
  echo "[ok] cli: the GEMM line has the library, its version and a rate" ||
  echo "[fail] cli: the GEMM line: $(grep '^GEMM' "$tmp/p.out")"
# A GEMM library on kernels older than the CPU says so (OpenBLAS made to run its Prescott kernels).
if grep -qw avx2 /proc/cpuinfo && [ -e /usr/lib/x86_64-linux-gnu/libopenblas.so.0 ]; then
  rm -rf "$tmp/pres"
  MDL_GEMM=openblas OPENBLAS_CORETYPE=PRESCOTT $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 1 \
    --data "$tmp/shards" --out "$tmp/pres" --val-every 0 >"$tmp/pres.out" 2>&1
  contains "a generic fallback of the GEMM library is a warning" "$tmp/pres.out" \
    "runs its generic Prescott kernels on a CPU with AVX2 or later"
  contains "... and the GEMM line names its kernels" "$tmp/pres.out" "Prescott kernels, as OPENBLAS_CORETYPE says"
  contains "precision auto is fp32 with a GEMM library that has no faster bf16 GEMM" "$tmp/pres.out" \
    "precision auto, fp32: OpenBLAS"
else
  echo "[skip] cli: the generic-kernels warning (no AVX2 or no OpenBLAS here)"
fi
# ... and on each side of that line whatever the host: oneDNN capped at AVX2 has no bf16 GEMM kernels
# (fp32); at AVX-512 BF16 it has (bf16), where the CPU can run them.
if [ -e /usr/lib/x86_64-linux-gnu/libdnnl.so.2 ] && grep -qw avx2 /proc/cpuinfo; then
  for cap in AVX2 AVX512_CORE_BF16; do
    [ $cap = AVX512_CORE_BF16 ] && ! grep -qw avx512_bf16 /proc/cpuinfo &&
      { echo "[skip] cli: precision auto with oneDNN's AVX-512 BF16 kernels (this CPU has no avx512_bf16)"; continue; }
    rm -rf "$tmp/cap"
    MDL_GEMM=onednn ONEDNN_MAX_CPU_ISA=$cap $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 1 \
      --data "$tmp/shards" --out "$tmp/cap" --val-every 0 >"$tmp/cap.out" 2>&1
    if [ $cap = AVX2 ]; then
      contains "precision auto is fp32 where oneDNN has no bf16 GEMM kernels (capped at AVX2)" "$tmp/cap.out" \
        "precision auto, fp32: oneDNN"
    else
      contains "precision auto is bf16 on oneDNN's AVX-512 BF16 kernels" "$tmp/cap.out" \
        "has bf16 GEMM kernels for this CPU (avx512_core_bf16), faster than its fp32 ones"
      grep -qE '^GEMM: oneDNN .*avx512_core_bf16 kernels.* GFLOP/s bf16' "$tmp/cap.out" &&
        echo "[ok] cli: ... and its GEMM line gives the bf16 rate" ||
        echo "[fail] cli: the GEMM line at AVX512_CORE_BF16: $(grep '^GEMM' "$tmp/cap.out")"
      contains "... and MFU is against the peak of AVX-512 BF16 (not AMX's)" "$tmp/cap.out" \
        "GFLOP/s bf16 on AVX-512 BF16 assumed"
    fi
  done
else
  echo "[skip] cli: precision auto on each oneDNN ISA level (no oneDNN or no AVX2 here)"
fi
for prec in fp32 bf16; do
  rm -rf "$tmp/p$prec"
  $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 3 --data "$tmp/shards" --out "$tmp/p$prec" --val-every 0 \
    --precision $prec >"$tmp/p$prec.out" 2>&1 || echo "[fail] cli: run --precision $prec: $(tail -c 300 "$tmp/p$prec.out")"
  contains "--precision $prec reaches the run" "$tmp/p$prec.out" "precision $prec"
  sed -n 's/.*"loss":\([0-9.]*\).*/\1/p' "$tmp/p$prec/log.jsonl" >"$tmp/p$prec.losses"
done
if [ -s "$tmp/pfp32.losses" ] && paste "$tmp/pbf16.losses" "$tmp/pfp32.losses" |
  awk '{d = $1 - $2; if (d < 0) d = -d; if (d > 1e-2 * $2) bad = 1; if (d > 1e-6 * $2) moved = 1}
       END {exit bad || !moved}'; then
  echo "[ok] cli: bf16 and fp32 losses agree within 1% and differ"
else
  echo "[fail] cli: bf16 vs fp32 losses: $(paste "$tmp/pbf16.losses" "$tmp/pfp32.losses" | tr '\n' ' ')"
fi
expect "--precision fp16 is a usage error" 2 $m build models/mlp.mdl -o "$tmp/b8" --precision fp16
contains "the usage error names the choices" "$tmp/err" "auto, fp32, bf16 or fp8"
expect "dump after the precision pass" 0 $m -d R check models/mlp.mdl --precision bf16
contains "the dump shows the casts" "$tmp/out" "to=bf16"
expect "dump after the fp8 precision pass" 0 $m -d R check models/mlp.mdl --precision fp8
contains "the dump says which GEMMs read fp8" "$tmp/out" "a=f8e4m3#0 b=f8e4m3#1"
contains "the dump says why a GEMM stays bf16" "$tmp/out" "bf16 (LM head)"
contains "the dump lists the scaled tensors" "$tmp/out" "fp8 #2 f8e5m2 d w2's output"
expect "--set amax_history reaches the fp8 pass" 0 $m -d R check models/mlp.mdl --precision fp8 --set amax_history=4
contains "the dump says the history's length" "$tmp/out" "fp8: 3 scaled tensors, scales from 4 steps of amax history"
sed 's/precision = fp32/precision = fp8/' models/mlp.mdl >"$tmp/fp8.mdl"
line=$(grep -n 'precision = fp8' "$tmp/fp8.mdl" | cut -d: -f1)
expect "an fp8 model builds" 0 $m build "$tmp/fp8.mdl" -o "$tmp/b8"
contains "the fp8 build's CUDA casts record their amaxes" "$tmp/b8/model.cu" "mdl_cast_e4m3("
# A GPU without FP8 tensor cores (compute capability 8.6, from a driver that only answers the probe):
# fp8 is refused at the setting, naming the device; the CUDA back end runs it from 8.9 on.
cat >"$tmp/sm86.c" <<'C'
#include <string.h>
typedef int CUresult;
CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *d, int i) { *d = i; return i < 1 ? 0 : 101; }
CUresult cuDeviceGetAttribute(int *v, int attr, int d) { (void)d; *v = attr == 75 ? 8 : attr == 76 ? 6 : attr == 16 ? 84 : 0; return 0; }
CUresult cuDeviceGetName(char *s, int n, int d) { (void)d; strncpy(s, "Fake A10", (size_t)n); return 0; }
CUresult cuDeviceTotalMem_v2(unsigned long *b, int d) { (void)d; *b = 24ul << 30; return 0; }
CUresult cuGetErrorName(CUresult r, const char **s) { (void)r; *s = "CUDA_ERROR_UNKNOWN"; return 0; }
C
if cc -shared -fPIC -o "$tmp/libcuda-sm86.so" "$tmp/sm86.c" 2>"$tmp/cc.err"; then
  expect "fp8 on a GPU of compute capability 8.6 is refused" 1 env MDL_LIBCUDA="$tmp/libcuda-sm86.so" \
    $m grad "$tmp/fp8.mdl" --backend cuda
  contains "the fp8 setting is located and the GPU named" "$tmp/err" \
    "fp8.mdl:$line:17: error: precision = fp8: the GPU Fake A10 has compute capability 8.6, and FP8 GEMMs need 8.9"
else
  echo "[fail] cli: a fake CUDA driver compiles: $(head -c 300 "$tmp/cc.err")"
fi

# The module cache: where it cannot be made, a run warns once and compiles into a folder of its own
# under $TMPDIR, removed at exit, with the same losses; with no folder to be had at all it stops.
touch "$tmp/afile"
mkdir -p "$tmp/tmpdir"
rm -rf "$tmp/pc"
expect "a run with an unusable cache folder still trains" 0 env MDL_CACHE="$tmp/afile/cache" TMPDIR="$tmp/tmpdir" \
  $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 3 --data "$tmp/shards" --out "$tmp/pc" --val-every 0
contains "the unusable cache folder is named, with why" "$tmp/err" \
  "warning: the module cache $tmp/afile/cache cannot be used (Not a directory); compiling into $tmp/tmpdir/mdl-cache."
[ "$(grep -c 'warning: the module cache' "$tmp/err")" = 1 ] && echo "[ok] cli: the cache warning is printed once" ||
  echo "[fail] cli: the cache warning: $(grep -c 'warning: the module cache' "$tmp/err") lines"
[ -z "$(ls -A "$tmp/tmpdir")" ] && echo "[ok] cli: the temporary module folder is removed at exit" ||
  echo "[fail] cli: left in \$TMPDIR: $(ls -A "$tmp/tmpdir")"
sed -n 's/.*"loss":\([0-9.]*\).*/\1/p' "$tmp/pc/log.jsonl" >"$tmp/pc.losses"
[ -s "$tmp/pc.losses" ] && cmp -s "$tmp/pc.losses" "$tmp/p.losses" &&
  echo "[ok] cli: compiled into the temporary folder, the same losses" || echo "[fail] cli: losses differ or missing"
rm -rf "$tmp/pc"
expect "no folder for compiled modules at all is an error" 1 env MDL_CACHE="$tmp/afile/cache" TMPDIR="$tmp/afile" \
  $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 3 --data "$tmp/shards" --out "$tmp/pc" --val-every 0
contains "both folders are named" "$tmp/err" \
  "no folder for compiled modules: $tmp/afile/cache: Not a directory; $tmp/afile/mdl-cache."
# A cached CPU module that does not load (cut short) is compiled again, with a warning.
mkdir -p "$tmp/cc"
MDL_CACHE="$tmp/cc" $m run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 1 --data "$tmp/shards" --out "$tmp/pcc1" \
  --val-every 0 >/dev/null 2>&1
for so in "$tmp"/cc/*.so; do truncate -s 100 "$so"; done
expect "a damaged cached module is compiled again" 0 env MDL_CACHE="$tmp/cc" $m run models/gpt2-tiny.mdl -D B=2 \
  -D T=16 --steps 1 --data "$tmp/shards" --out "$tmp/pcc2" --val-every 0
contains "the damaged module is named" "$tmp/err" "does not load"
contains "the damaged module is compiled" "$tmp/out" "cc took"

# --steps 0 is a usage error that points at eval; the defaults --help states are the ones that run.
expect "--steps 0 is a usage error" 2 $m run models/gpt2-tiny.mdl --steps 0 --data "$tmp/shards" --out "$tmp/s0"
contains "--steps 0 says what to use to evaluate" "$tmp/err" "use \`mdlc eval\` to evaluate without training"
$m --help >"$tmp/help"
first_step() { # the step count of a run's first line: NAME MODEL (piped: the run stops at its next line)
  $m run "$1" -D B=2 -D T=16 --data "$tmp/shards" --out "$tmp/$2" --val-every 0 --log-every 1 --backend cpu \
    2>/dev/null | grep -m1 -o '^step *1/[0-9]*' | sed 's/.*\///'
}
sed 's/, steps=4000//' models/gpt2-tiny.mdl >"$tmp/nosteps.mdl"
said=$(sed -n "s/.*--steps N .*the train section's, else \([0-9]*\)).*/\1/p" "$tmp/help")
ran=$(first_step "$tmp/nosteps.mdl" d1) section=$(first_step models/gpt2-tiny.mdl d2)
[ -n "$said" ] && [ "$ran" = "$said" ] && [ "$section" = 4000 ] &&
  echo "[ok] cli: --steps defaults to the train section's (4000), else $said, as --help says" ||
  echo "[fail] cli: --help says the steps default to the train section's, else '$said'; ran $ran and $section"
# Without a schedule (docs/language.md): lr at every step, the last one included (over 4 steps at lr
# 2e-3: steps 2 and 4 at 2e-3).
sed '/schedule/d' models/gpt2-tiny.mdl >"$tmp/nosched.mdl"
$m run "$tmp/nosched.mdl" -D B=2 -D T=16 --steps 4 --data "$tmp/shards" --out "$tmp/nosched" --val-every 0 \
  --backend cpu >/dev/null 2>&1
lrs=$(sed -n 's/.*"lr":\([^,]*\),.*/\1/p' "$tmp/nosched/log.jsonl" 2>/dev/null | tr '\n' ' ')
[ "$(cut -d' ' -f2,4 <<<"$lrs")" = "0.002 0.002" ] &&
  echo "[ok] cli: without a schedule the rate is lr at every step, as docs/language.md says" ||
  echo "[fail] cli: the default schedule: learning rates $lrs"
said=$(sed -n 's/.*--val-batches N .*(default \([0-9]*\)).*/\1/p' "$tmp/help")
$m eval "$tmp/run/checkpoint.safetensors" --data "$tmp/shards" >"$tmp/eval" 2>&1
contains "eval reads the --val-batches --help states ($said)" "$tmp/eval" "over $said validation batches"

# make install: bin/mdlc into PREFIX/bin, a binary that trains from another folder.
make -s install PREFIX="$tmp/prefix" >/dev/null 2>"$tmp/err"
cp models/gpt2-tiny.mdl "$tmp/tiny.mdl"
(cd "$tmp" && MDL_CACHE="$tmp/icache" "$tmp/prefix/bin/mdlc" run tiny.mdl -D B=2 -D T=16 --steps 1 --data shards \
  --out inst --quiet >inst.out 2>&1) &&
  grep -q '^trained 1 steps' "$tmp/inst.out" &&
  echo "[ok] cli: make install PREFIX=DIR installs DIR/bin/mdlc, which trains" ||
  echo "[fail] cli: make install: $(head -c 300 "$tmp/err" "$tmp/inst.out" 2>&1)"

# MDL_MARCH: the module is built for the x86-64 level named: for x86-64-v2 with no AVX instruction (no
# ymm or zmm register), where the native one (on a CPU with AVX2) has them; a name it does not know is
# refused, naming the choices.
build/tools/blobs "$tmp/mblobs" 200 >/dev/null
for lv in native x86-64-v2; do
  MDL_MARCH=$lv MDL_CACHE="$tmp/mcache-$lv" $m run models/mlp.mdl --data "$tmp/mblobs" --steps 1 --val-every 0 \
    --backend cpu --out "$tmp/march-$lv" >/dev/null 2>"$tmp/err" || echo "[fail] cli: MDL_MARCH=$lv run: $(head -c 300 "$tmp/err")"
done
avx() { for so in "$tmp/mcache-$1"/*.so; do objdump -d "$so"; done | grep -cE '%[yz]mm'; }
if [ "$(avx x86-64-v2)" -eq 0 ] && { ! grep -q avx2 /proc/cpuinfo || [ "$(avx native)" -gt 0 ]; }; then
  echo "[ok] cli: MDL_MARCH=x86-64-v2 builds a module with no AVX instruction (the native one: $(avx native))"
else
  echo "[fail] cli: MDL_MARCH=x86-64-v2: $(avx x86-64-v2) AVX instructions in its module, $(avx native) in the native one"
fi
expect "MDL_MARCH=bogus is refused" 1 env MDL_MARCH=bogus MDL_CACHE="$tmp/mcache-native" $m run models/mlp.mdl \
  --data "$tmp/mblobs" --steps 1 --backend cpu --out "$tmp/march-bogus"
grep -q "MDL_MARCH=bogus: want x86-64, x86-64-v2, x86-64-v3, x86-64-v4 or native" "$tmp/err" &&
  echo "[ok] cli: MDL_MARCH=bogus names the choices" || echo "[fail] cli: MDL_MARCH=bogus: $(head -c 300 "$tmp/err")"

# A model without params has nothing to train: build says so at the loss, file:line:col, and fails.
printf 'model m\ninput x: f32[4]\noutput loss = sum(x)\n' >"$tmp/noparams.mdl"
if $m build "$tmp/noparams.mdl" -o "$tmp/noparams" >"$tmp/noparams.out" 2>&1; then
  echo "[fail] cli: a model without params builds"
else
  contains "a model without params is an error at its loss" "$tmp/noparams.out" \
    "noparams.mdl:3:15: error: the model has no 'param': the loss has nothing to train"
fi
