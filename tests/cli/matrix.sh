#!/usr/bin/env bash
# The C back end against the reference interpreter on every path the host can run, not only the one
# it would choose: `test_cpu matrix` (fp32 and bf16, kernel by kernel and whole steps, fused and
# unfused) and `test_fp8_cpu matrix` (fp8 steps) under
#   - each GEMM path: oneDNN capped at each ISA level (ONEDNN_MAX_CPU_ISA: AVX2, AVX512_CORE,
#     AVX512_CORE_BF16, AVX512_CORE_AMX), OpenBLAS (MDL_GEMM=openblas) and plain loops
#     (MDL_GEMM=loops), with modules built for this CPU (-march=native);
#   - each x86-64 level the modules can be built for (MDL_MARCH: x86-64-v2, v3, v4), with the GEMM
#     library the host would choose.
# A path this CPU cannot run (an ISA level above its own, a library not installed) is a [skip] that
# names it. Every check line says which path it ran on. GCC 12.2 miscompiled kernels on some of
# these paths and not on others (runtime/kernels/prelude.h, MDL_NOIPA): this is what catches that whatever
# the host.
set -u
cd "$(dirname "$0")/../.."
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
failed=0

# one path: NAME, then the environment it runs under
path() {
  local name=$1 out rc
  shift
  for t in test_cpu test_fp8_cpu; do
    out=$(env "$@" MDL_CACHE="$cache" build/tests/$t matrix 2>&1)
    rc=$?
    printf '%s\n' "$out" | grep -E '^\[(ok|fail|skip)\]' | sed -E "s/^\[(ok|fail|skip)\] /[\1] matrix $name: /"
    if [ $rc -ne 0 ] && ! printf '%s\n' "$out" | grep -q '^\[fail\]'; then
      printf '%s\n' "$out" | tail -5
      echo "[fail] matrix $name: $t exited with status $rc"
    fi
    [ $rc -ne 0 ] && failed=1
    printf '%s\n' "$out" | grep -q '^\[skip\]' && break # (the path is not here: fp8 is not run on it)
  done
}

for isa in AVX2 AVX512_CORE AVX512_CORE_BF16 AVX512_CORE_AMX; do
  path "oneDNN $isa" MDL_GEMM=onednn ONEDNN_MAX_CPU_ISA=$isa
done
path "OpenBLAS" MDL_GEMM=openblas
path "plain loops" MDL_GEMM=loops
for level in x86-64-v2 x86-64-v3 x86-64-v4; do
  path "-march=$level" MDL_MARCH=$level
done
exit $failed
