#!/usr/bin/env bash
# The check to run on a machine with a GPU (`make gpu-check`; under 8 minutes with the build):
#   1. build mdlc; list the GPUs;
#   2. gpt2-tiny on the GPU and on the CPU back end from the same weights and batch (`mdlc grad
#      --backend cuda` vs `--backend cpu`, two shapes, --precision fp32 and bf16, and T=128 in bf16,
#      where every attention kernel stages two tiles of 64 through its two buffers), then llama-tiny
#      (rmsnorm, rotary embeddings, SwiGLU, an untied head; fp32 and bf16): the loss and every
#      gradient, compared per tensor as ||gpu - cpu|| / ||cpu|| (L2; max |gpu - cpu| / max |cpu| is
#      printed too). Both back ends run the same graph, so in bf16 they differ where an f32 value near
#      a bf16 rounding midpoint rounds the other way after a different summation order: one such flip
#      moves a few gradient elements by ~2^-9 of their size, which a max-norm would count in full
#      (emulated runs reach 3.6e-3 there) while L2 weighs it by how much of the tensor it touches.
#      Tolerance 1e-4 in fp32 and 5e-3 in bf16 (GPU_CHECK_TOL and GPU_CHECK_TOL_BF16 override them):
#      with q, k, v, the softmax numerators and the logits rounded too, the compiled C and the
#      interpreter differ by up to 2.0e-3 per tensor at B=2 T=16, 1.4e-3 at B=8 T=64 and 2.5e-3 at
#      B=4 T=128 in bf16 (6e-7 in fp32), and the GPU's attention also rounds against a running
#      maximum tile by tile; an error of layout or indexing in a kernel shows at order 1. Last, the
#      same for GPT-2 124M itself at B=1, T=1024 (the paths only its shapes take: 50257 classes over
#      padded chunks, a last bucket of the embedding backward past the table, 16 tiles of keys),
#      fp32 at 1e-4 (the compiled C against the interpreter: worst 1.4e-6 of 148 gradients), and
#      bf16 at 2e-2 (GPU_CHECK_TOL_GPT2_BF16): twelve layers deep, the bf16 roundings
#      the two sides take at other places decorrelate every gradient by about 0.5% (the compiled C
#      against the interpreter on this batch: median 4.7e-3, worst 6.2e-3 of the same 148), which an
#      indexing error still exceeds many times; the CPU side compiles GPT-2's C (20 s on 2 cores);
#   3. gradient accumulation: gpt2-tiny, 6 steps of 2 micro-batches of B=2 against 6 of B=4 (fp32,
#      validating every 3 steps): the same losses within 1e-4 (on the GPU the gradients are summed
#      and the parameters reach the validation engine by device copies);
#   4. GPT-2 124M trained for 30 steps with `mdlc run --backend cuda` (bf16, the model's precision;
#      B=8, T=1024; B=4 if that does not fit) on this repository's sources as byte tokens (`mdlc
#      prep`): tokens/s (mean over steps 6-29: the last one also validates and writes a checkpoint),
#      MFU and peak device memory; its "cuda:" line gives the module's cold NVRTC compile time, one
#      program per CPU at once (the issue's target: under 2 s), and one step more compiles it cold as
#      a single program (MDL_NVRTC_THREADS=1, a fresh cache) for comparison;
#   5. three more steps of it with --profile (launch by launch, timed by events from the second step
#      on: the first loads each kernel as it first launches; its "cuda:" line gives the time to read
#      the cubins from the cache, the warm compile: under 0.2 s): the whole
#      kernel table goes to $OUT/gpu-check-profile.txt, its 25 slowest lines, the time by kind of
#      kernel (GEMMs, attention, LM head, optimizer, embedding backward, norm backward with its add
#      and column sums, norm forward, sums with their producers, lone casts, lone sums, other
#      elementwise and row kernels), each beside what it took in the profile committed at the top of
#      the repository (the last GPU run's: "was"), and the launches inside the kernels that make several (the LM
#      head's GEMMs and cross-entropy, the attention backward's passes, the optimizer's) to the results;
#   6. twelve steps of it with --no-fuse, then twelve with --no-gemm-tuning, then twelve with
#      --no-kernel-tuning: tokens/s without fusion, without the timing of cuBLASLt's candidates, and
#      without the timing of the attention kernels' variants (their other block size), and what each
#      is worth (the fused, tuned run's tokens/s over these); the "cuda:" lines say how many kernels
#      run their variant;
#   7. twelve steps of it at B=16, 32 and 64 (llm.c's batch for this model): tokens/s, MFU and peak
#      memory at each, where the GEMMs are larger and the optimizer's fixed cost is spread over more
#      tokens.
#   8. the largest batch at T=1024 whose step fits the GPU's free memory with --checkpoint none and
#      with --checkpoint auto (from the plans), and twelve steps at each: tokens/s and MFU.
#   9. --precision fp8 against bf16: twelve steps of it at B=8 each, tokens/s, MFU, peak memory and the
#      last step's loss, then fp8's speed-up (cuBLASLt's FP8 GEMMs: sm_89 or later; on an older GPU
#      mdlc's refusal is recorded);
#  10. data parallel over every GPU of the machine, where it has two or more (mpirun, NCCL): gpt2-tiny's
#      losses on G ranks of B=2 against one process of B=2G (1e-4), then twelve steps of the model at
#      B=8 a rank with --zero 0 and 1: tokens/s, the all-reduce's share, rank 0's peak memory;
#  11. `mdlc lab` on it (B=8, T=1024, 8 steps a row; GPU_CHECK_LAB=0 leaves it out): the ladder from
#      every technique off (fp32, unfused, plain attention, AdamW per parameter, no checkpointing,
#      padded rows, tokenised on the fly) to all on, each technique alone, the largest batches with
#      and without checkpointing; its tables go to the results and $OUT/lab/ (the target: the full
#      ladder at least 3x the baseline).
# A failing stage is reported and the next one still runs, so one run gives every figure it can.
# MFU here = tokens/s x (model flops per step / tokens per step) / 989e12, where the model flops are the
# count mdlc prints (3x the forward GEMM + attention flops: llm.c's 6N + 6LCT per token) and 989
# TFLOP/s is the bf16 dense peak of an H100/H200 SXM; mdlc's own MFU column is also shown. Peak
# memory is the largest memory.used nvidia-smi reported while training. Every figure goes to
# $OUT/gpu-check-results.txt (or ./gpu-check-results.txt) and is printed. Exit status 0 when
# everything ran and agreed.
#
# Where nothing can be installed (no flex, bison or OpenBLAS, as on a bare GPU machine), the build
# fails there and the script uses gpu-bundle/ instead: `make gpu-bundle` (`tools/gpu-check.sh --bundle
# [DIR]`) on a machine that has them writes mdlc with OpenBLAS linked in (found by gemm.c in the
# program itself, where oneDNN is not installed; it needs only glibc 2.34 or
# later; CUDA's libraries are opened at run time, as always) and the comparison helper, with the
# SHA-256 of the sources they were built from; bring the folder along. A bundle of other sources is
# refused.
#
# A rehearsal without a GPU (tests/cli/gpu_check.sh runs one, so that the script and the output it
# reads stay in step): GPU_CHECK_BACKEND=cpu puts the CPU back end where the GPU's was, with
# GPU_CHECK_REFERENCE=interp the reference interpreter where the CPU's was in stage 2, GPU_CHECK_DIMS
# adds -D options to stage 4's model (a smaller GPT) and GPU_CHECK_T sets its T (1024).
set -u
cd "$(dirname "$0")/.."
# (in the C locale: the order of the files must not depend on the machine's collation)
sources_hash() {
  (LC_ALL=C; cat Makefile grammar/* compiler/*.[ch] runtime/*.[ch] runtime/*.cuh tools/embed.c tools/gpucmp.c) | sha256sum | cut -d' ' -f1
}

if [ "${1:-}" = "--bundle" ]; then
  dir="${2:-gpu-bundle}"
  make -j"$(nproc)" bin/mdlc build/libmdl.a >/dev/null || { echo "gpu-check --bundle: make failed"; exit 1; }
  blas=""
  for f in /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.a /usr/lib/x86_64-linux-gnu/libopenblas.a \
    /usr/lib64/libopenblas.a /usr/lib/libopenblas.a; do
    [ -f "$f" ] && { blas=$f; break; }
  done
  [ -n "$blas" ] || { echo "gpu-check --bundle: no static OpenBLAS (libopenblas.a: Debian's libopenblas-dev)"; exit 1; }
  mkdir -p "$dir" || exit 1
  keep="-rdynamic -Wl,-u,cblas_sgemm -Wl,-u,openblas_get_corename -Wl,-u,openblas_set_num_threads"
  if ! { cc -O2 ${CFLAGS:-} $keep -o "$dir/mdlc" build/compiler/driver/main.o build/libmdl.a "$blas" -lm -ldl -lpthread &&
    cc -std=c11 -D_GNU_SOURCE -O2 ${CFLAGS:-} -Wall -Wextra -Werror $(for d in compiler compiler/*/ runtime runtime/*/; do printf -- "-I%s " "${d%/}"; done) $keep -o "$dir/gpucmp" \
      tools/gpucmp.c build/libmdl.a "$blas" -lm -ldl -lpthread && strip "$dir/mdlc" "$dir/gpucmp"; }; then
    echo "gpu-check --bundle: linking failed"
    exit 1
  fi
  sources_hash >"$dir/SOURCES"
  echo "gpu-check --bundle: $dir/mdlc and $dir/gpucmp ($(du -sh "$dir" | cut -f1)," \
    "sources $(cut -c1-12 "$dir/SOURCES")"
  exit 0
fi

res="${OUT:-.}/gpu-check-results.txt"
prof="${OUT:-.}/gpu-check-profile.txt"
tol_fp32="${GPU_CHECK_TOL:-1e-4}"
tol_bf16="${GPU_CHECK_TOL_BF16:-5e-3}"
tol_deep="${GPU_CHECK_TOL_GPT2_BF16:-2e-2}"
backend="${GPU_CHECK_BACKEND:-cuda}"
reference="${GPU_CHECK_REFERENCE:-cpu}"
dims="${GPU_CHECK_DIMS:-}"
T="${GPU_CHECK_T:-1024}"
model="gpt2 124M"
[ -n "$dims" ] && model="gpt2 $dims"
tmp=$(mktemp -d)
smi_pid=""
before=/dev/null # the profile of the last run, committed at the top of the repository
[ -f gpu-check-profile.txt ] && cp gpu-check-profile.txt "$tmp/before-profile.txt" && before="$tmp/before-profile.txt"
trap '[ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null; rm -rf "$tmp"' EXIT
: >"$res" || { echo "gpu-check: cannot write $res"; exit 1; }
status=0

say() { printf '%s\n' "$*" | tee -a "$res"; }
die() { say "gpu-check FAILED: $*"; exit 1; }
needed="awk timeout tee nproc sha256sum"
[ "$backend" = cuda ] && needed="$needed nvidia-smi"
for c in $needed; do
  command -v "$c" >/dev/null 2>&1 || die "'$c' is not installed"
done

say "== gpu-check $(date -u '+%Y-%m-%d %H:%M UTC')"
t0=$(date +%s)
mdlc=bin/mdlc
gpucmp="$tmp/gpucmp"
if make -j"$(nproc)" bin/mdlc build/libmdl.a >"$tmp/build.log" 2>&1 &&
  cc -std=c11 -D_GNU_SOURCE -O2 ${CFLAGS:-} $(for d in compiler compiler/*/ runtime runtime/*/; do printf -- "-I%s " "${d%/}"; done) -o "$gpucmp" tools/gpucmp.c build/libmdl.a \
    -lm -ldl -lpthread >>"$tmp/build.log" 2>&1; then
  say "built in $(($(date +%s) - t0)) s"
elif [ -x gpu-bundle/mdlc ] && [ -x gpu-bundle/gpucmp ]; then
  [ "$(cat gpu-bundle/SOURCES 2>/dev/null)" = "$(sources_hash)" ] ||
    die "the build failed here and gpu-bundle/ was made from other sources: make gpu-bundle again"
  say "the build failed here ($(grep -m1 -iE 'error|not found' "$tmp/build.log")); using gpu-bundle/ (same sources)"
  mdlc=gpu-bundle/mdlc
  gpucmp=gpu-bundle/gpucmp
else
  tail -30 "$tmp/build.log"
  die "the build failed (where flex, bison or OpenBLAS cannot be installed:" \
    "make gpu-bundle elsewhere and bring gpu-bundle/)"
fi
"$mdlc" --version >/dev/null 2>&1 || die "$mdlc does not run on this machine"
[ "$backend" = cuda ] && nvidia-smi -L 2>&1 | tee -a "$res"


# GPU vs CPU gradients on gpt2-tiny, then on llama-tiny (rmsnorm, rotary embeddings, SwiGLU, no biases),
# then on the model stage 4 trains, at B=1 (its own shapes: 50257 classes, T=1024).
gpt2_v=$(printf '%s\n' "$dims" | sed -n 's/.*-D V=\([0-9]*\).*/\1/p')
for net in gpt2-tiny llama-tiny gpt2; do
  "$mdlc" init "models/$net.mdl" $([ $net = gpt2 ] && echo "$dims -D T=$T") -o "$tmp/$net.safetensors" --seed 1 \
    >/dev/null || die "mdlc init $net failed"
done
for shape in "gpt2-tiny 2 16 fp32" "gpt2-tiny 8 64 fp32" "gpt2-tiny 2 16 bf16" "gpt2-tiny 8 64 bf16" \
  "gpt2-tiny 4 128 bf16" "llama-tiny 4 64 fp32" "llama-tiny 4 64 bf16" "gpt2 1 $T fp32" "gpt2 1 $T bf16"; do
  set -- $shape
  net=$1 b=$2 t=$3 prec=$4 vocab=256 extra="" name=$1 limit=120
  tol=$([ "$prec" = bf16 ] && echo "$tol_bf16" || echo "$tol_fp32")
  if [ $net = gpt2 ]; then
    vocab=${gpt2_v:-50257} extra=$dims name=$model limit=300
    [ "$prec" = bf16 ] && tol=$tol_deep
  fi
  say "== $name B=$b T=$t $prec: loss and gradients, $backend vs $reference"
  "$gpucmp" batch "$tmp/batch.safetensors" "$b" "$t" "$vocab" 7 || die "cannot write the batch"
  for side in "$reference:reference" "$backend:tested"; do
    be=${side%%:*}
    if ! timeout $limit "$mdlc" grad "models/$net.mdl" $extra -D B="$b" -D T="$t" --weights "$tmp/$net.safetensors" \
      --batch "$tmp/batch.safetensors" -o "$tmp/${side#*:}.safetensors" --backend "$be" --precision "$prec" \
      >"$tmp/grad.log" 2>&1; then
      tail -12 "$tmp/grad.log" | tee -a "$res"
      say "mdlc grad --backend $be failed"
      status=1
      continue 2
    fi
    grep -E '^(cuda:|loss)' "$tmp/grad.log" | sed "s/^/  $be: /" | tee -a "$res"
  done
  "$gpucmp" compare "$tmp/tested.safetensors" "$tmp/reference.safetensors" "$tol" | tee -a "$res"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

# GPT-2 124M: 30 training steps on the GPU, on this repository's sources as byte tokens.
cat compiler/*.c runtime/*.c >"$tmp/text.txt"
"$mdlc" prep "$tmp/text.txt" -o "$tmp/shards" >"$tmp/prep.log" 2>&1 || { cat "$tmp/prep.log"; die "mdlc prep failed"; }

# Gradient accumulation: on the GPU the micro-batches' gradients are summed on the device and the
# parameters reach the validation engine by device copies. gpt2-tiny in fp32, 6 steps of 2
# micro-batches of B=2 against 6 steps of B=4 (validating every 3 steps): the same losses, within 1e-4.
say "== gpt2-tiny: 6 steps of 2 micro-batches of B=2 vs 6 of B=4, fp32, T=32, mdlc run --backend $backend"
acc_ok=1
for run in "acc2 2 --accumulate 2" "acc1 4"; do
  set -- $run
  name=$1 b=$2
  shift 2
  if ! timeout 120 "$mdlc" run models/gpt2-tiny.mdl --backend "$backend" --precision fp32 -D B="$b" -D T=32 --steps 6 \
    --val-every 3 --ckpt-every 0 --log-every 1 "$@" --data "$tmp/shards" --out "$tmp/$name" >"$tmp/$name.log" 2>&1; then
    tail -12 "$tmp/$name.log" | tee -a "$res"
    acc_ok=0
  fi
done
if [ $acc_ok -eq 1 ]; then
  losses() { sed -n 's/^step *\([0-9]*\)\/6 | loss \([0-9.]*\) .*/\1 \2/p' "$1"; }
  awk 'NR == FNR { want[$1] = $2; next }
       $1 in want {
         n++; d = $2 - want[$1]; if (d < 0) d = -d
         if (d > worst) worst = d
         if (d > 1e-4 * want[$1]) bad++
       }
       END {
         printf "  %d steps compared, worst difference %.2g, tolerance 1e-4 relative: %s\n", n, worst,
           n == 6 && !bad ? "ok" : "FAIL"
         exit !(n == 6 && !bad)
       }' <(losses "$tmp/acc1.log") <(losses "$tmp/acc2.log") | tee -a "$res"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  say "mdlc run with --accumulate failed"
  status=1
fi
: >"$tmp/mem.log"
if [ "$backend" = cuda ]; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 >"$tmp/mem.log" 2>/dev/null &
  smi_pid=$!
fi
steps=30
for B in 8 4; do
  say "== $model: $steps steps, B=$B T=$T, mdlc run --backend $backend"
  rm -rf "$tmp/run"
  timeout 360 "$mdlc" run models/gpt2.mdl --backend "$backend" --steps "$steps" $dims -D B="$B" -D T="$T" \
    --log-every 1 --data "$tmp/shards" --out "$tmp/run" >"$tmp/run.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] && break
  tail -12 "$tmp/run.log" | tee -a "$res"
  grep -q OUT_OF_MEMORY "$tmp/run.log" || break
done
[ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null
smi_pid=""
grep -E '^(training|compiled|MFU =|cuda:|trained)' "$tmp/run.log" | tee -a "$res"
grep -E '^step .*tok/s' "$tmp/run.log" | sed -n '1,3p;$p' | tee -a "$res"
if [ $rc -ne 0 ]; then
  say "mdlc run failed (status $rc)"
  status=1
else
  awk -v B="$B" -v T="$T" -v mem="$(sort -n "$tmp/mem.log" | tail -1)" '
    /^MFU = model flops/ && match($0, /[0-9.]+e[+-][0-9]+ per step/) { flops = substr($0, RSTART, RLENGTH) + 0 }
    /^step .*tok\/s/ {
      n = split($0, f, "|")
      split(f[1], a, /[ \/]+/); step = a[2] + 0; total = a[3] + 0
      for (i = 1; i <= n; i++) {
        if (f[i] ~ /tok\/s/) { v = f[i]; gsub(/[^0-9.]/, "", v); tps = v + 0 }
        if (f[i] ~ /MFU/) { v = f[i]; gsub(/[^0-9.]/, "", v); own = v + 0 }
        if (f[i] ~ /loss/) { v = f[i]; sub(/ *loss */, "", v); loss = v + 0 }
        if (f[i] ~ /peak/) { v = f[i]; sub(/^ *peak */, "", v); sub(/ *$/, "", v); peak = v }
      }
      if (step == 1) first = loss
      last = loss
      if (step > 5 && step < total) { sum += tps; sown += own; k++ }
    }
    END {
      if (k == 0 || flops == 0) { print "no timed steps in the log"; exit 1 }
      tps = sum / k
      printf "tokens/s %.0f (mean of steps 6 to %d, B=%d T=%d)\n", tps, 5 + k, B, T
      printf "MFU %.2f%% of 989 TFLOP/s (%.3g model flops per step, %.3g per token); mdlc printed %.2f%%\n", \
        100 * tps * flops / (B * T) / 989e12, flops, flops / (B * T), sown / k
      printf "loss %.4f at step 1, %.4f at the last step\n", first, last
      printf "peak device memory %s MiB (nvidia-smi memory.used); mdlc printed peak %s\n", mem == "" ? "?" : mem, peak
    }' "$tmp/run.log" | tee -a "$res"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# The module compiled cold as one program, beside the run above's one program per CPU.
if [ $rc -eq 0 ] && [ "$backend" = cuda ]; then
  say "== $model: one step, the module compiled cold as one program (MDL_NVRTC_THREADS=1), B=$B T=$T"
  if MDL_CACHE="$tmp/cache-one" MDL_NVRTC_THREADS=1 timeout 120 "$mdlc" run models/gpt2.mdl --backend cuda --steps 1 \
    $dims -D B="$B" -D T="$T" --val-every 0 --ckpt-every 0 --data "$tmp/shards" --out "$tmp/one" >"$tmp/one.log" 2>&1
  then
    grep -m1 -E '^cuda:' "$tmp/one.log" | tee -a "$res"
  else
    tail -12 "$tmp/one.log" | tee -a "$res"
    say "mdlc run with MDL_NVRTC_THREADS=1 failed"
    status=1
  fi
fi
# Where the step's time goes: GPT-2 124M kernel by kernel, at the B that trained.
if [ $rc -eq 0 ]; then
  say "== $model: 3 steps with --profile, B=$B T=$T"
  if timeout 240 "$mdlc" run models/gpt2.mdl --backend "$backend" --steps 3 $dims -D B="$B" -D T="$T" --val-every 0 \
    --ckpt-every 0 --data "$tmp/shards" --out "$tmp/prof" --profile >"$tmp/prof.log" 2>&1; then
    grep -E '^cuda:' "$tmp/prof.log" | tee -a "$res"
    sed -n '/^profile:/,$p' "$tmp/prof.log" >"$prof"
    grep -q '^profile:' "$prof" || { say "mdlc run --profile printed no profile"; status=1; }
    head -27 "$prof" | tee -a "$res"
    awk -v before="$before" '
         FNR == 1 { table = 1 }
         /^launches inside/ { table = 0 }
         table && FNR > 2 && NF >= 5 {
           k = $1; sub(/^k[0-9]+_/, "", k)
           kind = "elementwise and row kernels"
           if (k ~ /^gemm/) kind = "GEMMs"
           else if (k ~ /^attention/) kind = "attention"
           else if (k ~ /adamw/) kind = "optimizer"
           else if (k ~ /^lmhead/) kind = "LM head"
           else if (k ~ /^embed_bwd/) kind = "embedding backward"
           else if (k ~ /^(layernorm|rmsnorm)_bwd/) kind = "norm backward (with the residual add and column sums)"
           else if (k ~ /^(layernorm|rmsnorm)_fwd/) kind = "norm forward"
           else if (k ~ /^sum__/) kind = "sums with the kernel that produces their input"
           else if (k ~ /^sum$/) kind = "lone sums (bias gradients)"
           else if (k ~ /^cast$/) kind = "lone casts to bf16"
           if (FILENAME == before) { was[kind] += $2; next }
           ms[kind] += $2; n[kind]++; total += $2
         }
         END {
           for (x in ms)
             printf "  %9.3f ms/step %5.1f%% (was %s) %4d kernels: %s\n", ms[x], 100 * ms[x] / total,
               x in was ? sprintf("%7.3f", was[x]) : "      -", n[x], x
         }' "$before" "$prof" | sort -nr | tee -a "$res"
    sed -n '/^launches inside/,$p' "$prof" | tee -a "$res"
    say "whole table: $prof"
  else
    tail -12 "$tmp/prof.log" | tee -a "$res"
    say "mdlc run --profile failed"
    status=1
  fi
fi
# Twelve steps of the model at batch B, with FLAG if one is given, into LOG (no validation, no checkpoint).
twelve() { # twelve B LOG [FLAG]
  local b=$1 log=$2
  shift 2
  rm -rf "$tmp/twelve" # (its checkpoint: a run would take a folder that has one for another's to resume)
  timeout 240 "$mdlc" run models/gpt2.mdl --backend "$backend" --steps 12 $dims -D B="$b" -D T="$T" \
    --val-every 0 --ckpt-every 0 --log-every 1 "$@" --data "$tmp/shards" --out "$tmp/twelve" >"$log" 2>&1
}
# From a run's LOG, tab-separated: the mean tokens/s of steps 4 to 11, how many steps that is, the model
# flops of a step and mdlc's peak memory; a failure when no step was timed.
steps_mean() {
  awk '
    /^MFU = model flops/ && match($0, /[0-9.]+e[+-][0-9]+ per step/) { flops = substr($0, RSTART, RLENGTH) + 0 }
    /^step .*tok\/s/ {
      n = split($0, f, "|")
      split(f[1], a, /[ \/]+/)
      for (i = 1; i <= n; i++) {
        if (f[i] ~ /tok\/s/) { v = f[i]; gsub(/[^0-9.]/, "", v); tps = v + 0 }
        if (f[i] ~ /peak/) { v = f[i]; sub(/^ *peak */, "", v); sub(/ *$/, "", v); peak = v }
      }
      if (a[2] + 0 > 3 && a[2] + 0 < a[3] + 0) { sum += tps; k++ }
    }
    END {
      if (k == 0) exit 1
      printf "%.0f\t%d\t%g\t%s\n", sum / k, k, flops, peak
    }' "$1"
}

# What an optimisation is worth here: 12 steps of the same model with it switched off (FLAG), their
# tokens/s beside the fused, tuned run's: --no-fuse (a kernel per IR node, the LM head not chunked),
# then --no-gemm-tuning (each GEMM on cuBLASLt's first choice, untimed), then --no-kernel-tuning (each
# attention kernel at its first block size, untimed).
fused=$(sed -n 's/^tokens\/s \([0-9][0-9]*\) (mean of steps.*/\1/p' "$res" | head -1)
worth() { # worth FLAG WHAT
  local flag=$1 what=$2 log="$tmp/off.log" tps k flops peak
  say "== $model: 12 steps with $flag, B=$B T=$T"
  if ! twelve "$B" "$log" "$flag"; then
    tail -12 "$log" | tee -a "$res"
    say "mdlc run $flag failed"
    status=1
    return
  fi
  grep -E '^cuda:' "$log" | tee -a "$res"
  if IFS=$'\t' read -r tps k flops peak < <(steps_mean "$log"); then
    say "$(awk -v t="$tps" -v k="$k" -v fused="$fused" -v flag="$flag" -v what="$what" 'BEGIN {
      printf "tokens/s %.0f with %s (mean of steps 4 to %d); %s is worth %.2fx here", t, flag, 3 + k, what,
        fused / t }')"
  else
    say "no timed steps in the log"
    status=1
  fi
}
if [ $rc -eq 0 ] && [ -n "$fused" ]; then
  worth --no-fuse fusion
  worth --no-gemm-tuning "GEMM tuning"
  worth --no-kernel-tuning "kernel tuning"
fi
# Larger batches (llm.c trains GPT-2 124M at B=64): 12 steps at each, tokens/s and MFU as in stage 4
# (the mean of steps 4 to 11), and the peak device memory mdlc printed. One that does not fit in
# device memory is reported as such and is not a failure.
if [ $rc -eq 0 ]; then
  for big in 16 32 64; do
    say "== $model: 12 steps at B=$big T=$T"
    log="$tmp/big.log"
    if twelve "$big" "$log"; then
      if IFS=$'\t' read -r tps k flops peak < <(steps_mean "$log") && [ "$flops" != 0 ]; then
        say "$(awk -v t="$tps" -v k="$k" -v f="$flops" -v B="$big" -v T="$T" -v peak="$peak" 'BEGIN {
          printf "tokens/s %.0f at B=%d T=%d (mean of steps 4 to %d), MFU %.2f%% of 989 TFLOP/s; peak %s", t, B, T,
            3 + k, 100 * t * f / (B * T) / 989e12, peak }')"
      else
        say "no timed steps in the log"
        status=1
      fi
    elif grep -q OUT_OF_MEMORY "$log"; then
      say "B=$big does not fit in device memory"
      break
    else
      tail -12 "$log" | tee -a "$res"
      say "mdlc run at B=$big failed"
      status=1
    fi
  done
fi
# The largest batch whose step fits the GPU's free memory keeping every activation (--checkpoint
# none: its planned arena within the free memory less 5%, the budget auto takes) and with
# --checkpoint auto (recomputing as little as makes it fit), found from the plans alone (mdlc check
# -d C), then 12 steps at each: tokens/s and MFU as above. On the GPU only (the rehearsal skips it).
if [ $rc -eq 0 ] && [ "$backend" = cuda ]; then
  plans() { "$mdlc" check -d C models/gpt2.mdl --backend cuda $dims -D B="$1" -D T="$T" --checkpoint "$2" 2>&1; }
  fits_auto() { plans "$1" auto | grep -q '^checkpoint auto'; }
  fits_none() { # none's plan within auto's budget (the free memory): auto keeps everything there
    plans "$1" auto | grep -q '^checkpoint auto: every saved value kept'
  }
  for pol in none auto; do
    lo=0 hi=8
    while [ $hi -le 1024 ] && fits_$pol $hi; do lo=$hi; hi=$((hi * 2)); done
    while [ $((hi - lo)) -gt 1 ]; do mid=$(((lo + hi) / 2)); if fits_$pol $mid; then lo=$mid; else hi=$mid; fi; done
    say "== $model: the largest batch at T=$T with --checkpoint $pol: B=$lo ($(plans "$lo" auto | grep -m1 '^checkpoint' |
      sed 's/.*planned peak/planned peak/'))"
    [ $lo -gt 0 ] || continue
    log="$tmp/ckpt-$pol.log"
    if twelve "$lo" "$log" --checkpoint "$pol" &&
      IFS=$'\t' read -r tps k flops peak < <(steps_mean "$log") && [ "$flops" != 0 ]; then
      say "$(awk -v t="$tps" -v k="$k" -v f="$flops" -v B="$lo" -v T="$T" -v peak="$peak" -v p="$pol" 'BEGIN {
        printf "--checkpoint %s: tokens/s %.0f at B=%d T=%d, MFU %.2f%% of 989 TFLOP/s (model flops); peak %s", p, t, B,
          T, 100 * t * f / (B * T) / 989e12, peak }')"
    else
      tail -12 "$log" | tee -a "$res"
      say "mdlc run at B=$lo with --checkpoint $pol failed"
      status=1
    fi
  done
fi
# FP8 against bf16: twelve steps of it at B=8 with --precision fp8 and with bf16, the same batches:
# tokens/s and MFU as above (both against the bf16 peak, so fp8's MFU says how much nearer that peak
# its GEMMs bring the step), the last step's loss of each, then fp8's speed-up and the losses'
# difference. FP8's GEMMs (cuBLASLt's E4M3 and E5M2) need sm_89 or later: on an older GPU mdlc
# refuses fp8, naming the device, and the stage says so. The rehearsal runs it on the compiled C,
# where fp8 is emulated (slower than bf16 there).
if [ $rc -eq 0 ]; then
  say "== $model: --precision fp8 against bf16, 12 steps at B=8 T=$T"
  prec_tps="" prec_loss=""
  for p in bf16 fp8; do
    log="$tmp/prec-$p.log"
    if twelve 8 "$log" --precision $p && IFS=$'\t' read -r tps k flops peak < <(steps_mean "$log") &&
      [ "$flops" != 0 ]; then
      loss=$(grep -E '^step +12/12' "$log" | sed -n 's/.*| loss \([0-9.]*\).*/\1/p')
      say "$(awk -v t="$tps" -v f="$flops" -v T="$T" -v peak="$peak" -v p="$p" -v l="$loss" 'BEGIN {
        printf "%s: tokens/s %.0f at B=8 T=%d, MFU %.2f%% of 989 TFLOP/s (model flops); peak %s; loss at step 12 %s",
          p, t, T, 100 * t * f / (8 * T) / 989e12, peak, l }')"
      prec_tps="$prec_tps $tps" prec_loss="$prec_loss $loss"
    elif [ $p = fp8 ] && grep -qE "compute capability" "$log"; then
      say "fp8: not run: $(grep -m1 -E 'compute capability' "$log")"
    else
      tail -12 "$log" | tee -a "$res"
      say "mdlc run with --precision $p failed"
      status=1
    fi
  done
  read -r tps_bf16 tps_fp8 <<<"$prec_tps"
  read -r loss_bf16 loss_fp8 <<<"$prec_loss"
  if [ -n "${tps_fp8:-}" ] && [ -n "${loss_fp8:-}" ]; then
    say "$(awk -v a="$tps_bf16" -v b="$tps_fp8" -v la="$loss_bf16" -v lb="$loss_fp8" 'BEGIN {
      d = lb - la; if (d < 0) d = -d
      printf "fp8 against bf16: %.2fx the tokens/s; the losses at step 12 differ by %.4f", b / a, d }')"
  fi
fi
# Data parallel over every GPU of the machine (mpirun, NCCL; it needs one GPU a rank, so a machine of
# one GPU skips it): gpt2-tiny fp32 on G ranks of B=2 against one process at B=2G, 10 steps, the same
# losses within 1e-4; then twelve steps of the model at B=8 a rank on G ranks, with and without
# --zero 1: tokens/s over all ranks and a rank, the communication's share, and rank 0's peak memory.
# The rehearsal runs 2 ranks of the CPU back end. Open MPI's mpirun must be installed.
ngpu=2
[ "$backend" = cuda ] && ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ $rc -eq 0 ] && [ "$ngpu" -ge 2 ] && command -v mpirun >/dev/null 2>&1; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  say "== data parallel: gpt2-tiny fp32, $ngpu ranks of B=2 against 1 process of B=$((2 * ngpu)), 10 steps"
  dp() { # dp OUT LOG RANKS B [FLAG...]: gpt2-tiny, 10 steps
    local out=$1 log=$2 n=$3 b=$4
    shift 4
    rm -rf "$out"
    if [ "$n" -gt 1 ]; then set -- mpirun -np "$n" "$mdlc" "$@"; else set -- "$mdlc" "$@"; fi
    timeout 300 "$@" run models/gpt2-tiny.mdl --backend "$backend" --precision fp32 -D B="$b" -D T=64 --steps 10 \
      --val-every 0 --ckpt-every 0 --log-every 1 --data "$tmp/shards" --out "$out" >"$log" 2>&1
  }
  if dp "$tmp/dp1" "$tmp/dp1.log" 1 $((2 * ngpu)) && dp "$tmp/dpn" "$tmp/dpn.log" "$ngpu" 2; then
    worst=$(paste <(sed -n 's/.*"loss":\([-0-9.e]*\).*/\1/p' "$tmp/dp1/log.jsonl") \
      <(sed -n 's/.*"loss":\([-0-9.e]*\).*/\1/p' "$tmp/dpn/log.jsonl") |
      awk '{d = $1 - $2; if (d < 0) d = -d; if (d > m) m = d; n++} END {printf "%d %.3g", n, m}')
    if [ "${worst%% *}" -eq 10 ] && awk -v w="${worst#* }" 'BEGIN {exit !(w <= 1e-4)}'; then
      say "  10 losses, largest difference ${worst#* }: ok"
    else
      say "  losses of $ngpu ranks against 1 process: ${worst%% *} steps, largest difference ${worst#* } (tolerance 1e-4)"
      status=1
    fi
  else
    tail -12 "$tmp/dp1.log" "$tmp/dpn.log" | tee -a "$res"
    say "data parallel gpt2-tiny failed"
    status=1
  fi
  for z in 0 1; do
    log="$tmp/dp-zero$z.log"
    rm -rf "$tmp/dpz"
    if timeout 300 mpirun -np "$ngpu" "$mdlc" run models/gpt2.mdl --backend "$backend" --steps 12 $dims -D B=8 \
      -D T="$T" --val-every 0 --ckpt-every 0 --log-every 1 --zero $z --data "$tmp/shards" --out "$tmp/dpz" \
      >"$log" 2>&1 && IFS=$'\t' read -r tps k flops peak < <(steps_mean "$log"); then
      say "$model on $ngpu ranks of B=8 T=$T, --zero $z: tokens/s $tps over the ranks (mean of steps 4 to 11);" \
        "$(grep -m1 '^data parallel over' "$log" | sed 's/^data parallel over //'); rank 0's peak $peak"
    else
      tail -12 "$log" | tee -a "$res"
      say "$model on $ngpu ranks with --zero $z failed"
      status=1
    fi
  done
elif [ $rc -eq 0 ]; then
  say "== data parallel: not run ($ngpu GPU; NCCL needs a GPU a rank$(command -v mpirun >/dev/null 2>&1 || echo ', and Open MPI'\''s mpirun is not installed'))"
fi
# The lab: what each technique is worth for GPT-2 124M on this GPU (its rows are runs of their own).
if [ $rc -eq 0 ] && [ "$backend" = cuda ] && [ "${GPU_CHECK_LAB:-1}" != 0 ]; then
  say "== $model: mdlc lab (B=8, T=$T, 8 steps a row)"
  if "$mdlc" lab models/gpt2.mdl --backend cuda $dims -D B=8 -D T="$T" --steps 8 --data "$tmp/shards" \
    --out "${OUT:-.}/lab" >"$tmp/lab.log" 2>&1; then
    sed -n '/^## /,$p' "${OUT:-.}/lab/lab.md" | tee -a "$res"
  else
    tail -30 "$tmp/lab.log" | tee -a "$res"
    say "mdlc lab failed"
    status=1
  fi
fi
say "== gpu-check $([ $status -eq 0 ] && echo passed || echo FAILED) in $(($(date +%s) - t0)) s; results in $res"
exit $status
