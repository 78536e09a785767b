#!/usr/bin/env bash
# The check to run on a machine with a GPU (`make gpu-check`; under 8 minutes with the build):
#   1. build mdlc; list the GPUs;
#   2. gpt2-tiny on the GPU and on the CPU back end from the same weights and batch (`mdlc grad
#      --backend cuda` vs `--backend cpu`, two shapes, --precision fp32 and bf16): the loss and every
#      gradient, compared per tensor as ||gpu - cpu|| / ||cpu|| (L2; max |gpu - cpu| / max |cpu| is
#      printed too). Both back ends run the same graph, so in bf16 they differ where an f32 value near
#      a bf16 rounding midpoint rounds the other way after a different summation order: one such flip
#      moves a few gradient elements by ~2^-9 of their size, which a max-norm would count in full
#      (emulated runs reach 3.6e-3 there) while L2 weighs it by how much of the tensor it touches.
#      Tolerance 1e-4 in fp32 and 5e-3 in bf16 (GPU_CHECK_TOL and GPU_CHECK_TOL_BF16 override them):
#      with q, k, v and the softmax numerators rounded too, the compiled C and the interpreter differ
#      by up to 2.1e-3 per tensor at B=2 T=16 and 1.3e-3 at B=8 T=64 in bf16 (4e-7 in fp32), and the
#      GPU's attention also rounds against a running maximum tile by tile; an error of layout or
#      indexing in a kernel shows at order 1;
#   3. GPT-2 124M trained for 30 steps with `mdlc run --backend cuda` (bf16, the model's precision;
#      B=8, T=1024; B=4 if that does
#      not fit) on this repository's sources as byte tokens (`mdlc prep`): tokens/s (mean over steps
#      6-29: the last one also validates and writes a checkpoint), MFU and peak device memory;
#   4. three more steps of it with --profile (launch by launch, timed by events): the whole kernel
#      table goes to $OUT/gpu-check-profile.txt, its 25 slowest lines and the time by kind of kernel
#      (GEMMs, attention, LM head, optimizer, embedding backward, norm backward with its add and
#      column sums, norm forward, sums with their producers, lone casts, lone sums, other
#      elementwise and row kernels) to the results.
# A failing stage is reported and the next one still runs, so one run gives every figure it can.
# MFU here = tokens/s x (model flops per step / tokens per step) / 989e12, where the model flops are the
# count mdlc prints (3x the forward GEMM + attention flops: llm.c's 6N + 6LCT per token) and 989
# TFLOP/s is the bf16 dense peak of an H100/H200 SXM; mdlc's own MFU column is also shown. Peak
# memory is the largest memory.used nvidia-smi reported while training. Every figure goes to
# $OUT/gpu-check-results.txt (or ./gpu-check-results.txt) and is printed. Exit status 0 when
# everything ran and agreed.
set -u
cd "$(dirname "$0")/.."
res="${OUT:-.}/gpu-check-results.txt"
prof="${OUT:-.}/gpu-check-profile.txt"
tol_fp32="${GPU_CHECK_TOL:-1e-4}"
tol_bf16="${GPU_CHECK_TOL_BF16:-5e-3}"
tmp=$(mktemp -d)
smi_pid=""
trap '[ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null; rm -rf "$tmp"' EXIT
: >"$res" || { echo "gpu-check: cannot write $res"; exit 1; }
status=0

say() { printf '%s\n' "$*" | tee -a "$res"; }
die() { say "gpu-check FAILED: $*"; exit 1; }
for c in make cc nvidia-smi awk timeout tee nproc; do
  command -v "$c" >/dev/null 2>&1 || die "'$c' is not installed"
done

say "== gpu-check $(date -u '+%Y-%m-%d %H:%M UTC')"
t0=$(date +%s)
make -j"$(nproc)" bin/mdlc build/libmdl.a >"$tmp/build.log" 2>&1 || { tail -30 "$tmp/build.log"; die "make failed"; }
say "built in $(($(date +%s) - t0)) s"
nvidia-smi -L 2>&1 | tee -a "$res"

# A helper against libmdl: `batch FILE B T V SEED` writes a batch (two documents per row, one ignored
# target); `compare GPU CPU TOL` compares two `mdlc grad` outputs tensor by tensor.
cat >"$tmp/gpucmp.c" <<'EOF'
#include "mdl.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static int batch(const char *path, int B, int T, int V, unsigned seed) {
  int32_t *d = malloc(sizeof(int32_t) * 4 * (size_t)(B * T));
  int32_t *tok = d, *tgt = d + B * T, *pos = d + 2 * B * T, *doc = d + 3 * B * T;
  for (int i = 0; i < B * T; i++) {
    int t = i % T, half = T / 2;
    tok[i] = (int)(mdl_rng_u64(seed, 1, (uint64_t)i) % (uint64_t)V);
    tgt[i] = i == T - 1 ? -1 : (int)(mdl_rng_u64(seed, 2, (uint64_t)i) % (uint64_t)V);
    doc[i] = t >= half;
    pos[i] = t >= half ? t - half : t;
  }
  Shape s = shape_of(2, (int64_t[]){B, T});
  StTensor ts[] = {{"tokens", DT_I32, s, tok}, {"targets", DT_I32, s, tgt}, {"pos", DT_I32, s, pos},
                   {"doc", DT_I32, s, doc}};
  int ok = st_write(path, ts, 4);
  free(d);
  return ok ? 0 : 1;
}

static int compare(const char *gpu, const char *cpu, double tol) {
  Arena *a = arena_new();
  StFile g, c;
  if (!st_read(a, gpu, &g) || !st_read(a, cpu, &c))
    return 1;
  int bad = 0;
  double worst = 0;
  for (int i = 0; i < c.n; i++) {
    const StTensor *r = &c.t[i], *x = st_find(&g, r->name);
    int64_t n = shape_numel(r->shape);
    if (!x || shape_numel(x->shape) != n) {
      printf("  %-28s missing or of another shape on the GPU\n", r->name);
      bad++;
      continue;
    }
    double diff = 0, ref = 0, d2 = 0, r2 = 0;
    for (int64_t j = 0; j < n; j++) {
      double u = ((const float *)x->data)[j], v = ((const float *)r->data)[j];
      diff = fmax(diff, isnan(u) || isnan(v) ? INFINITY : fabs(u - v));
      ref = fmax(ref, fabs(v));
      d2 += isnan(u) || isnan(v) ? INFINITY : (u - v) * (u - v);
      r2 += v * v;
    }
    double rel = sqrt(d2) / (r2 > 0 ? sqrt(r2) : 1), mrel = diff / (ref > 0 ? ref : 1);
    worst = fmax(worst, rel);
    bad += !(rel <= tol);
    printf("  %-28s L2 rel %.2e  max rel %.2e%s\n", r->name, rel, mrel, rel <= tol ? "" : "  > tolerance");
  }
  printf("  %d tensors, worst L2 rel %.2e, tolerance %.2g: %s\n", c.n, worst, tol, bad ? "FAIL" : "ok");
  return bad ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc == 7 && !strcmp(argv[1], "batch"))
    return batch(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), (unsigned)atoi(argv[6]));
  if (argc == 5 && !strcmp(argv[1], "compare"))
    return compare(argv[2], argv[3], atof(argv[4]));
  fprintf(stderr, "usage: gpucmp batch FILE B T V SEED | compare GPU CPU TOL\n");
  return 2;
}
EOF
cc -std=c11 -D_GNU_SOURCE -O2 -Icompiler -Iruntime -o "$tmp/gpucmp" "$tmp/gpucmp.c" build/libmdl.a \
  -lopenblas -lm -ldl -lpthread >"$tmp/cc.log" 2>&1 ||
  { cat "$tmp/cc.log"; die "the comparison helper does not build"; }

# GPU vs CPU gradients on gpt2-tiny.
bin/mdlc init models/gpt2-tiny.mdl -o "$tmp/W.safetensors" --seed 1 >/dev/null || die "mdlc init failed"
for shape in "2 16 fp32" "8 64 fp32" "2 16 bf16" "8 64 bf16"; do
  set -- $shape
  B=$1 T=$2 prec=$3
  tol=$([ "$prec" = bf16 ] && echo "$tol_bf16" || echo "$tol_fp32")
  say "== gpt2-tiny B=$B T=$T $prec: loss and gradients, cuda vs cpu"
  "$tmp/gpucmp" batch "$tmp/batch.safetensors" "$B" "$T" 256 7 || die "cannot write the batch"
  for be in cpu cuda; do
    if ! timeout 120 bin/mdlc grad models/gpt2-tiny.mdl -D B="$B" -D T="$T" --weights "$tmp/W.safetensors" \
      --batch "$tmp/batch.safetensors" -o "$tmp/g_$be.safetensors" --backend "$be" --precision "$prec" \
      >"$tmp/grad_$be.log" 2>&1; then
      tail -5 "$tmp/grad_$be.log" | tee -a "$res"
      say "mdlc grad --backend $be failed"
      status=1
      continue 2
    fi
    grep -E '^(cuda:|loss)' "$tmp/grad_$be.log" | sed "s/^/  $be: /" | tee -a "$res"
  done
  "$tmp/gpucmp" compare "$tmp/g_cuda.safetensors" "$tmp/g_cpu.safetensors" "$tol" | tee -a "$res"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

# GPT-2 124M: 30 training steps on the GPU, on this repository's sources as byte tokens.
cat compiler/*.c runtime/*.c >"$tmp/text.txt"
bin/mdlc prep "$tmp/text.txt" -o "$tmp/shards" >"$tmp/prep.log" 2>&1 || { cat "$tmp/prep.log"; die "mdlc prep failed"; }
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 >"$tmp/mem.log" 2>/dev/null &
smi_pid=$!
steps=30
for B in 8 4; do
  T=1024
  say "== gpt2 124M: $steps steps, B=$B T=$T, mdlc run --backend cuda"
  rm -rf "$tmp/run"
  timeout 360 bin/mdlc run models/gpt2.mdl --backend cuda --steps "$steps" -D B="$B" -D T="$T" \
    --data "$tmp/shards" --out "$tmp/run" >"$tmp/run.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] && break
  tail -5 "$tmp/run.log" | tee -a "$res"
  grep -q OUT_OF_MEMORY "$tmp/run.log" || break
done
kill "$smi_pid" 2>/dev/null
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
# Where the step's time goes: GPT-2 124M kernel by kernel, at the B that trained.
if [ $rc -eq 0 ]; then
  say "== gpt2 124M: 3 steps with --profile, B=$B T=$T"
  if timeout 240 bin/mdlc run models/gpt2.mdl --backend cuda --steps 3 -D B="$B" -D T="$T" --val-every 0 \
    --ckpt-every 0 --data "$tmp/shards" --out "$tmp/prof" --profile >"$tmp/prof.log" 2>&1; then
    sed -n '/^profile:/,$p' "$tmp/prof.log" >"$prof"
    head -27 "$prof" | tee -a "$res"
    awk 'NR > 2 && NF >= 5 {
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
           ms[kind] += $2; n[kind]++; total += $2
         }
         END { for (x in ms) printf "  %9.3f ms/step %5.1f%% %4d kernels: %s\n", ms[x], 100 * ms[x] / total, n[x], x }' \
      "$prof" | sort -nr | tee -a "$res"
    say "whole table: $prof"
  else
    tail -5 "$tmp/prof.log" | tee -a "$res"
    say "mdlc run --profile failed"
    status=1
  fi
fi
say "== gpu-check $([ $status -eq 0 ] && echo passed || echo FAILED) in $(($(date +%s) - t0)) s; results in $res"
exit $status
