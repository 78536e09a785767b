#!/usr/bin/env bash
# tools/gpu-check.sh without a GPU, so that the script, and the output of mdlc that it reads, stay in
# step until a GPU runs it: a rehearsal with the compiled C where the GPU's back end would be and the
# interpreter as its reference (stage 2 compares two back ends that really differ, on the tiny models
# and on the GPT of stage 4, stage 3 trains with
# gradient accumulation and without, stage 4 trains a small GPT and reads tokens/s and MFU from the
# run's lines, stage 5 sorts a profile into kinds, stage 6 compares the run unfused and untuned, stage 7
# trains it at larger batches, stage 9 in fp8 and bf16, stage 10 on 2 ranks); the
# same with tolerances no back end meets fails; `--bundle` makes an mdlc that needs no OpenBLAS
# library, and the helper; in a copy of the sources where the
# build fails (no bison), the script takes the bundle, and refuses a bundle of other sources.
set -u
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "[ok] gpu-check: $1"; }
fail() { echo "[fail] gpu-check: $1"; }
check() { # check NAME COMMAND...: ok when the command succeeds
  local name=$1; shift
  if "$@"; then ok "$name"; else fail "$name"; fi
}
export GPU_CHECK_DIMS="-D L=1 -D C=64 -D H=2 -D V=512 -D maxT=64" GPU_CHECK_T=64
# The script's `timeout N` limits guard a lent GPU's minutes against a hang; in this rehearsal, on a
# CPU that may be loaded, they would fail it by the clock. A timeout(1) that only runs the command.
mkdir -p "$tmp/bin"
printf '#!/bin/sh\nshift\nexec "$@"\n' >"$tmp/bin/timeout"
chmod +x "$tmp/bin/timeout"
export PATH="$tmp/bin:$PATH"

mkdir -p "$tmp/a"
GPU_CHECK_BACKEND=cpu GPU_CHECK_REFERENCE=interp OUT="$tmp/a" tools/gpu-check.sh >"$tmp/a.log" 2>&1
rc=$?
r="$tmp/a/gpu-check-results.txt"
check "a rehearsal (interpreter vs compiled C) passes" [ $rc -eq 0 ]
[ $rc -eq 0 ] || tail -20 "$tmp/a.log"
check "stage 2 compares gpt2-tiny in 5 shapes and precisions, all within tolerance" \
  [ "$(grep -cE '^  29 tensors, worst L2 rel [0-9.e+-]+, tolerance [0-9.e-]+: ok$' "$r")" -eq 5 ]
check "stage 2 compares llama-tiny in fp32 and bf16, within tolerance" \
  eval '[ "$(grep -cE "^  22 tensors, worst L2 rel [0-9.e+-]+, tolerance [0-9.e-]+: ok$" "$r")" -eq 2 ] &&
    grep -q "^== llama-tiny B=4 T=64 bf16: loss and gradients" "$r"'
check "stage 2 compares the GPT that stage 4 trains, at B=1 in fp32 and bf16, within tolerance" \
  eval 'grep -q "^== gpt2 $GPU_CHECK_DIMS B=1 T=64 fp32: loss and gradients, cpu vs interp$" "$r" &&
    grep -q "^== gpt2 $GPU_CHECK_DIMS B=1 T=64 bf16: loss and gradients, cpu vs interp$" "$r" &&
    grep -qE "^  17 tensors, worst L2 rel [0-9.e+-]+, tolerance 0.0001: ok$" "$r" &&
    grep -qE "^  17 tensors, worst L2 rel [0-9.e+-]+, tolerance 0.02: ok$" "$r"'
# fp32 agrees to rounding; bf16 shows the rounding the two back ends do in other orders.
worst() { grep 'worst L2 rel' "$r" | sed -n "${1}p" | sed 's/.*worst L2 rel \([^,]*\),.*/\1/'; }
# (bf16's lower bound tells a bf16 comparison from an fp32 one: on a CPU with AMX, oneDNN's bf16 GEMM
# sums in an order that agrees with the interpreter's to 1.2e-5 on one shape, against 5e-7 in fp32.)
check "fp32 differs by under 1e-5, bf16 by 5e-6 to 5e-3 ($(worst 1) $(worst 3) $(worst 5) $(worst 6) $(worst 7))" \
  awk -v a="$(worst 1)" -v b="$(worst 2)" -v c="$(worst 3)" -v d="$(worst 4)" -v e="$(worst 5)" \
  -v f="$(worst 6)" -v g="$(worst 7)" 'BEGIN { exit !(a < 1e-5 && b < 1e-5 && c > 5e-6 && c < 5e-3 && d > 5e-6 &&
    d < 5e-3 && e > 5e-6 && e < 5e-3 && f < 1e-5 && g > 5e-6 && g < 5e-3) }'
check "stage 3 trains with gradient accumulation as with the whole batch" \
  grep -qE '^  6 steps compared, worst difference [0-9.e+-]+, tolerance 1e-4 relative: ok$' "$r"
check "stage 4 reads tokens/s and MFU from the run" \
  grep -qE '^tokens/s [1-9][0-9]* \(mean of steps 6 to 29, B=8 T=64\)$' "$r"
check "stage 4 reads the model's flops and mdlc's MFU" \
  grep -qE '^MFU [0-9.]+% of 989 TFLOP/s \([0-9.]+e\+[0-9]+ model flops per step.*mdlc printed [0-9.]+%$' "$r"
check "stage 4 reads the first and the last loss" grep -qE '^loss [0-9]\.[0-9]{4} at step 1, [0-9]\.[0-9]{4} at' "$r"
check "stage 5 writes the profile and sorts its kernels into kinds" \
  eval 'grep -q "^profile: " "$tmp/a/gpu-check-profile.txt" && grep -qE "ms/step .* kernels: GEMMs$" "$r" &&
    grep -qE "kernels: attention$" "$r" && grep -qE "kernels: optimizer$" "$r" && grep -qE "kernels: LM head$" "$r"'

check "stage 6 runs the model unfused and says what fusion is worth" \
  grep -qE '^tokens/s [1-9][0-9]* with --no-fuse \(mean of steps 4 to 11\); fusion is worth '\
'[0-9]+\.[0-9]{2}x here$' "$r"
check "stage 6 runs the model with --no-gemm-tuning and says what GEMM tuning is worth" \
  grep -qE '^tokens/s [1-9][0-9]* with --no-gemm-tuning \(mean of steps 4 to 11\); GEMM tuning is worth '\
'[0-9]+\.[0-9]{2}x here$' "$r"
check "stage 6 runs the model with --no-kernel-tuning and says what kernel tuning is worth" \
  grep -qE '^tokens/s [1-9][0-9]* with --no-kernel-tuning \(mean of steps 4 to 11\); kernel tuning is worth '\
'[0-9]+\.[0-9]{2}x here$' "$r"
check "stage 7 trains at B=16, 32 and 64 and reads tokens/s, MFU and the peak from each" \
  [ "$(grep -cE '^tokens/s [1-9][0-9]* at B=(16|32|64) T=64 \(mean of steps 4 to 11\), MFU [0-9.]+% of 989 '\
'TFLOP/s; peak [0-9]+ MB' "$r")" -eq 3 ]
check "stage 9 trains the model in fp8 and bf16 and reads tokens/s, MFU, the peak and the last loss of each" \
  [ "$(grep -cE '^(fp8|bf16): tokens/s [1-9][0-9]* at B=8 T=64, MFU [0-9.]+% of 989 TFLOP/s \(model flops\); peak '\
'[0-9]+ MB; loss at step 12 [0-9]+\.[0-9]{4}$' "$r")" -eq 2 ]
check "stage 9 says what fp8 is worth against bf16" \
  grep -qE '^fp8 against bf16: [0-9]+\.[0-9]{2}x the tokens/s; the losses at step 12 differ by [0-9]+\.[0-9]{4}$' "$r"
if command -v mpirun >/dev/null 2>&1; then
  check "stage 10 trains gpt2-tiny on 2 ranks as in one process, and the model on 2 ranks with --zero 0 and 1" \
    eval 'grep -qE "^  10 losses, largest difference [0-9.e+-]+: ok$" "$r" &&
      [ "$(grep -cE "on 2 ranks of B=8 T=64, --zero [01]: tokens/s [1-9][0-9]* over the ranks .*; 2 ranks: [0-9]+ tok/s a rank; waiting on the all-reduces .*; rank 0.s peak [0-9]+ MB$" "$r")" -eq 2 ]'
else
  check "stage 10 says why it did not run" grep -q "^== data parallel: not run" "$r"
fi

mkdir -p "$tmp/b"
GPU_CHECK_BACKEND=cpu GPU_CHECK_REFERENCE=interp GPU_CHECK_TOL=1e-9 GPU_CHECK_TOL_BF16=1e-9 \
  GPU_CHECK_TOL_GPT2_BF16=1e-9 OUT="$tmp/b" tools/gpu-check.sh >"$tmp/b.log" 2>&1
rc=$?
check "tolerances no back end meets fail the check" \
  eval '[ $rc -ne 0 ] && [ "$(grep -c ": FAIL$" "$tmp/b/gpu-check-results.txt")" -eq 9 ] &&
    grep -q "> tolerance" "$tmp/b/gpu-check-results.txt" && grep -q "^== gpu-check FAILED" "$tmp/b.log"'

tools/gpu-check.sh --bundle "$tmp/bundle" >"$tmp/bundle.log" 2>&1
check "--bundle builds mdlc and the helper" eval '[ -x "$tmp/bundle/mdlc" ] && [ -x "$tmp/bundle/gpucmp" ]'
check "the bundle's mdlc runs and needs no OpenBLAS library" \
  eval '"$tmp/bundle/mdlc" --version >/dev/null && ! ldd "$tmp/bundle/mdlc" | grep -q openblas'
mkdir -p "$tmp/bd/corpus" && printf 'to be or not to be, that is the question\n%.0s' $(seq 40) >"$tmp/bd/corpus/a.txt"
MDL_GEMM=openblas "$tmp/bundle/mdlc" prep "$tmp/bd/corpus" -o "$tmp/bd/data" >/dev/null 2>&1
MDL_GEMM=openblas "$tmp/bundle/mdlc" run models/gpt2-tiny.mdl -D B=2 -D T=16 --steps 1 --data "$tmp/bd/data" \
  --out "$tmp/bd/out" --val-every 0 --backend cpu >"$tmp/bd/log" 2>&1
check "the bundle's mdlc runs its GEMMs in the OpenBLAS linked into it" \
  grep -qE '^GEMM: OpenBLAS [0-9.]+, [^ ]+ kernels, linked into the program: [0-9]+ GFLOP/s' "$tmp/bd/log"

# A copy of the sources whose build fails, as where flex and bison cannot be installed.
if files=$(git ls-files 2>/dev/null) && [ -n "$files" ]; then
  mkdir -p "$tmp/repo" "$tmp/nobison" "$tmp/c"
  printf '%s\n' "$files" | while IFS= read -r f; do
    [ -e "$f" ] && mkdir -p "$tmp/repo/$(dirname "$f")" && cp -p "$f" "$tmp/repo/$f"
  done
  # the script and its helper as they are here, committed or not
  cp -p tools/gpu-check.sh tools/gpucmp.c "$tmp/repo/tools/"
  cp -r "$tmp/bundle" "$tmp/repo/gpu-bundle"
  printf '#!/bin/sh\necho "bison: not installed" >&2\nexit 127\n' >"$tmp/nobison/bison"
  chmod +x "$tmp/nobison/bison"
  PATH="$tmp/nobison:$PATH" GPU_CHECK_BACKEND=cpu OUT="$tmp/c" "$tmp/repo/tools/gpu-check.sh" >"$tmp/c.log" 2>&1
  rc=$?
  check "where the build fails, the script runs the bundle" \
    eval '[ $rc -eq 0 ] && grep -q "using gpu-bundle/ (same sources)" "$tmp/c.log" && grep -q "^tokens/s " "$tmp/c.log"'
  [ $rc -eq 0 ] || tail -20 "$tmp/c.log"
  echo "$(printf '0%.0s' $(seq 64))" >"$tmp/repo/gpu-bundle/SOURCES"
  PATH="$tmp/nobison:$PATH" GPU_CHECK_BACKEND=cpu OUT="$tmp/c" "$tmp/repo/tools/gpu-check.sh" >"$tmp/c.log" 2>&1
  rc=$?
  check "a bundle of other sources is refused" \
    eval '[ $rc -ne 0 ] && grep -q "gpu-bundle/ was made from other sources" "$tmp/c.log"'
else
  echo "[skip] gpu-check: the bundle in a failing build (not a git checkout)"
fi
