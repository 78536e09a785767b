// test_cuda_emu.c: the CUDA emulator (tests/unit/cuda_emu.h) and the helpers of the emitted prelude,
// run on the CPU. A C++ file made of the emulator, the prelude and the small kernels below is compiled
// with g++ and loaded; each check compares what the kernels wrote with values computed here:
//   - __syncthreads orders the threads of a block (each reads what another wrote before the barrier);
//     without one, a read sees another thread's write in one of the two orders the emulator runs the
//     threads of a block in, and the old value in the other;
//     warp shuffles exchange floats and doubles (xor and broadcast), blockIdx / threadIdx cover the
//     grid, atomicAdd adds from every thread of several blocks, the first mdl_report of a step wins;
//   - threads that wait at barriers that can never fill end the run with a deadlock message;
//   - warp and block reductions (sum, max ignoring NaN, max where NaN wins) against sums done here;
//   - the counter-based RNG and dropout agree bit for bit with mdl.h's; GELU, its derivative and SiLU's
//     derivative against the double formulas of interp.c (within fp32 rounding);
//   - bf16 conversion rounds to nearest even on hand-picked bit patterns (ties, carries into the
//     exponent, overflow to infinity, NaNs kept quiet, signed zero) and widens exactly;
//   - four bf16 values stored as one ushort4 (the emitted elementwise kernels' four-lane store) land
//     at consecutive 16-bit slots, x first, and ushort4 is 8 bytes aligned to 8, as in CUDA.
//   - tensor cores: mdl_bf16x2 packs two roundings, the first in the low half; mdl_mma_bf16_16816 on
//     random matrices (each lane building its fragments by the layout the prelude documents, two
//     warps of a block and several blocks each with matrices of their own) against D = C + A B in
//     double on the bf16 roundings, within 1e-6 of the sum of the magnitudes; an mma in a warp whose
//     other lanes have returned aborts the run; mdl_ldsm_x4_t and mdl_ldsm_x4 (ldmatrix .x4, with
//     .trans and without) hand each lane the elements PTX's fragment layout names, and their shared-
//     memory bank conflicts are counted (none for rows 48 bytes apart, 7 extra passes a tile for rows
//     128 bytes apart); the warp votes;
//   - cp.async: a double-buffered staging loop gets every tile whether copies land when issued or at
//     the wait (the emulator's two ends of the GPU's window, by block), zero fills, and a read before
//     the wait that sees the old value where copies land late;
//   - the tensor-core and cp.async kernels also compile with NVRTC for sm_80 and sm_90 (the GPU's
//     inline PTX), where NVRTC is installed.
#include "mdl.h"
#include "emit_cuda.h"
#include "test.h"
#include "harness.h"

#include <dlfcn.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

// Kernels on tensor cores, compiled by g++ with the emulator and by NVRTC. k_mma: warp w of the grid
// multiplies its own A (16 x 16, row-major), B (16 x 8, row-major: b[k * 8 + n]) and C, building the
// fragments element by element from the layout of the prelude's comment, and stores D the same way.
// k_mma_partial: half the warp returns before the other half's mma. k_ldsm: each warp of the block
// puts a 16 x 16 tile of bf16 (element (r, c) = 16 r + c, negated in warp 1: exact) in shared memory, lane l
// gives the address of row l % 16 at column 8 (l / 16) to mdl_ldsm_x4_t and mdl_ldsm_x4 and stores
// their four registers each. k_cp_async: 4 tiles of 128 floats per block through two shared buffers
// by cp.async (16 bytes a thread), the next tile's copies started before the wait for this one's,
// as the attention kernels stage theirs; each thread stores what it reads of each tile, and lanes
// 32-63 also fill 4 bytes each with zeros (in false). k_cp_early: thread 0 reads its copy's
// destination before waiting.
static const char mma_kernels[] =
    "extern \"C\" __global__ void k_ldsm(uint32_t *out) {\n"
    "  __shared__ __align__(16) uint16_t tile[2][16][24];\n"
    "  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;\n"
    "  for (int i = lane; i < 256; i += 32)\n"
    "    tile[w][i / 16][i % 16] = mdl_f32_to_bf16((float)(w ? -i : i));\n"
    "  __syncthreads();\n"
    "  uint32_t r[4];\n"
    "  mdl_ldsm_x4_t(r, &tile[w][lane & 15][(lane >> 4) * 8]);\n"
    "  for (int i = 0; i < 4; i++)\n"
    "    out[8 * threadIdx.x + i] = r[i];\n"
    "  mdl_ldsm_x4(r, &tile[w][lane & 15][(lane >> 4) * 8]);\n"
    "  for (int i = 0; i < 4; i++)\n"
    "    out[8 * threadIdx.x + 4 + i] = r[i];\n"
    "}\n"
    "extern \"C\" __global__ void k_ldsm_wide(uint32_t *out) {\n"
    "  __shared__ __align__(16) uint16_t tile[16][64];\n"
    "  const int lane = threadIdx.x & 31;\n"
    "  for (int i = lane; i < 1024; i += 32)\n"
    "    tile[i / 64][i % 64] = (uint16_t)i;\n"
    "  __syncthreads();\n"
    "  uint32_t r[4];\n"
    "  mdl_ldsm_x4(r, &tile[lane & 15][(lane >> 4) * 8]);\n"
    "  out[lane] = r[0] ^ r[1] ^ r[2] ^ r[3];\n"
    "}\n"
    "extern \"C\" __global__ void k_cp_async(const float *src, float *out) {\n"
    "  __shared__ __align__(16) float buf[2][128];\n"
    "  __shared__ float z[32];\n"
    "  const int t = threadIdx.x;\n"
    "  const float *s = src + 512 * blockIdx.x;\n"
    "  if (t >= 32 && t < 64)\n"
    "    z[t - 32] = 7.0f;\n"
    "  __syncthreads();\n"
    "  if (t < 32)\n"
    "    mdl_cp_async16(&buf[0][4 * t], &s[4 * t], true);\n"
    "  else if (t < 64)\n"
    "    mdl_cp_async4(&z[t - 32], s, false);\n"
    "  mdl_cp_async_commit();\n"
    "  for (int it = 0, cur = 0; it < 4; it++, cur ^= 1) {\n"
    "    __syncthreads();\n"
    "    if (it + 1 < 4 && t < 32)\n"
    "      mdl_cp_async16(&buf[cur ^ 1][4 * t], &s[128 * (it + 1) + 4 * t], true);\n"
    "    mdl_cp_async_commit();\n"
    "    mdl_cp_async_wait<1>();\n"
    "    __syncthreads();\n"
    "    out[512 * blockIdx.x + 128 * it + t] = buf[cur][127 - t];\n"
    "  }\n"
    "  if (t < 32)\n"
    "    out[1024 + 32 * blockIdx.x + t] = z[t];\n"
    "}\n"
    "extern \"C\" __global__ void k_cp_early(const float *src, float *out) {\n"
    "  __shared__ __align__(16) float x[4];\n"
    "  if (threadIdx.x)\n"
    "    return;\n"
    "  x[0] = -1.0f;\n"
    "  mdl_cp_async16(x, src, true);\n"
    "  out[blockIdx.x] = x[0];\n"
    "  mdl_cp_async_commit();\n"
    "  mdl_cp_async_wait<0>();\n"
    "  out[2 + blockIdx.x] = x[0];\n"
    "}\n"
    "extern \"C\" __global__ void k_vote(float *out) {\n"
    "  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;\n"
    "  out[threadIdx.x] = __all_sync(MDL_FULL, w == 0 || lane != 17) ? 1.0f : 0.0f;\n"
    "  out[64 + threadIdx.x] = __any_sync(MDL_FULL, w == 1 && lane == 17) ? 1.0f : 0.0f;\n"
    "}\n"
    "extern \"C\" __global__ void k_mma(const float *a, const float *b, const float *c, float *d) {\n"
    "  const int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;\n"
    "  const int g = lane >> 2, t = lane & 3;\n"
    "  const float *A = a + 256 * w, *B = b + 128 * w, *C = c + 128 * w;\n"
    "  const uint32_t fa[4] = {mdl_bf16x2(A[g * 16 + 2 * t], A[g * 16 + 2 * t + 1]),\n"
    "                          mdl_bf16x2(A[(g + 8) * 16 + 2 * t], A[(g + 8) * 16 + 2 * t + 1]),\n"
    "                          mdl_bf16x2(A[g * 16 + 2 * t + 8], A[g * 16 + 2 * t + 9]),\n"
    "                          mdl_bf16x2(A[(g + 8) * 16 + 2 * t + 8], A[(g + 8) * 16 + 2 * t + 9])};\n"
    "  const uint32_t fb[2] = {mdl_bf16x2(B[2 * t * 8 + g], B[(2 * t + 1) * 8 + g]),\n"
    "                          mdl_bf16x2(B[(2 * t + 8) * 8 + g], B[(2 * t + 9) * 8 + g])};\n"
    "  float acc[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};\n"
    "  mdl_mma_bf16_16816(acc, fa, fb);\n"
    "  float *D = d + 128 * w;\n"
    "  D[g * 8 + 2 * t] = acc[0];\n"
    "  D[g * 8 + 2 * t + 1] = acc[1];\n"
    "  D[(g + 8) * 8 + 2 * t] = acc[2];\n"
    "  D[(g + 8) * 8 + 2 * t + 1] = acc[3];\n"
    "}\n"
    "extern \"C\" __global__ void k_mma_partial(float *d) {\n"
    "  if (threadIdx.x >= 16)\n"
    "    return;\n"
    "  const uint32_t fa[4] = {0u, 0u, 0u, 0u}, fb[2] = {0u, 0u};\n"
    "  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};\n"
    "  mdl_mma_bf16_16816(acc, fa, fb);\n"
    "  d[threadIdx.x] = acc[0];\n"
    "}\n";

// Kernels and the entry points the checks call: each fills out[] with what it observed.
static const char kernels[] =
    "#define N_MATH 200\n"
    "extern \"C\" __global__ void k_sync(double *out) {\n"
    "  __shared__ int sh[256];\n"
    "  const int t = threadIdx.x;\n"
    "  sh[t] = t * 3 + (int)blockIdx.x;\n"
    "  __syncthreads();\n"
    "  out[blockIdx.x * 256 + t] = sh[255 - t];\n"
    "}\n"
    "extern \"C\" __global__ void k_race(double *out) {\n"
    "  double *const slot = out + blockIdx.x * 64, *const seen = out + 256 + blockIdx.x * 64;\n"
    "  const int t = threadIdx.x;\n"
    "  slot[t] = t;\n"
    "  seen[t] = slot[t ^ 1];\n"
    "}\n"
    "extern \"C\" __global__ void k_syncwarp(double *out) {\n"
    "  double *const slot = out + blockIdx.x * 64, *const seen = out + 256 + blockIdx.x * 64;\n"
    "  const int t = threadIdx.x;\n"
    "  slot[t] = t;\n"
    "  __syncwarp();\n"
    "  seen[t] = slot[t ^ 1];\n"
    "}\n"
    "extern \"C\" __global__ void k_shfl(double *out) {\n"
    "  const int lane = threadIdx.x & 31;\n"
    "  const float f = __shfl_xor_sync(MDL_FULL, (float)threadIdx.x, 5);\n"
    "  const double d = __shfl_sync(MDL_FULL, 0.5 + threadIdx.x, 7);\n"
    "  out[threadIdx.x] = f;\n"
    "  out[64 + threadIdx.x] = d;\n"
    "  (void)lane;\n"
    "}\n"
    "extern \"C\" __global__ void k_atomic(double *out) {\n"
    "  __shared__ float acc;\n"
    "  if (threadIdx.x == 0)\n"
    "    acc = 0.0f;\n"
    "  __syncthreads();\n"
    "  atomicAdd(&acc, 1.0f);\n"
    "  atomicAdd((float *)out, 0.5f);\n"
    "  __syncthreads();\n"
    "  if (threadIdx.x == 0)\n"
    "    out[1 + blockIdx.x] = acc;\n"
    "}\n"
    "extern \"C\" __global__ void k_report(MdlStatus *s) {\n"
    "  if (threadIdx.x == 5)\n"
    "    mdl_report(s, 1, 5, 10);\n"
    "  if (threadIdx.x == 9)\n"
    "    mdl_report(s, 2, 9, 10);\n"
    "}\n"
    "extern \"C\" __global__ void k_deadlock(double *out) {\n"
    "  if (threadIdx.x < 16)\n"
    "    __syncthreads();\n"
    "  else\n"
    "    out[threadIdx.x] = __shfl_xor_sync(MDL_FULL, 1.0, 1);\n"
    "}\n"
    "extern \"C\" __global__ void k_reduce(double *out) {\n"
    "  __shared__ double shd[32];\n"
    "  __shared__ float shf[32];\n"
    "  const int t = threadIdx.x;\n"
    "  const float x = (float)((t * 37) % 101) - 50.0f;\n"
    "  const float xn = t == 77 ? MDL_NAN : x;\n"
    "  out[0] = mdl_block_sum(x, shd);\n"
    "  out[1] = mdl_block_fmax(xn, shf);\n"
    "  out[2] = mdl_block_max_nan(xn, shf);\n"
    "  out[3] = mdl_block_max_nan(x, shf);\n"
    "  if (t < 32) {\n"
    "    out[4] = mdl_warp_sum(x);\n"
    "    out[5] = mdl_warp_sumf(x * 0.25f);\n"
    "    out[6] = mdl_warp_fmax(t == 3 ? MDL_NAN : x);\n"
    "    out[7] = mdl_warp_max_nan(t == 3 ? MDL_NAN : x);\n"
    "  }\n"
    "}\n"
    "extern \"C\" __global__ void k_math(double *out, const float *in, int n) {\n"
    "  const int t = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "  if (t >= n)\n"
    "    return;\n"
    "  out[6 * t] = mdl_gelu(in[t]);\n"
    "  out[6 * t + 1] = mdl_gelu_grad(in[t]);\n"
    "  out[6 * t + 2] = mdl_silu(in[t]);\n"
    "  out[6 * t + 3] = mdl_silu_grad(in[t], 1.5f);\n"
    "  out[6 * t + 4] = mdl_rng_uniform(7, 3, (uint64_t)t * 1000003u);\n"
    "  out[6 * t + 5] = mdl_dropout(7, 3, (int64_t)t * 1000003, 0.3, in[t]);\n"
    "  out[6 * N_MATH + t] = __expf(in[t]);\n"
    "}\n"
    "extern \"C\" __global__ void k_ushort4(const uint32_t *in, uint16_t *out) {\n"
    "  const int q = threadIdx.x;\n"
    "  reinterpret_cast<ushort4 *>(out)[q] = make_ushort4(mdl_f32_to_bf16(__uint_as_float(in[4 * q])),\n"
    "      mdl_f32_to_bf16(__uint_as_float(in[4 * q + 1])), mdl_f32_to_bf16(__uint_as_float(in[4 * q + 2])),\n"
    "      mdl_f32_to_bf16(__uint_as_float(in[4 * q + 3])));\n"
    "}\n"
    "static_assert(sizeof(ushort4) == 8 && alignof(ushort4) == 8, \"ushort4 as in CUDA\");\n"
    "extern \"C\" __global__ void k_bf16(const uint32_t *in, uint32_t *out, int n) {\n"
    "  const int t = threadIdx.x;\n"
    "  if (t < n) {\n"
    "    const uint16_t h = mdl_f32_to_bf16(__uint_as_float(in[t]));\n"
    "    out[2 * t] = h;\n"
    "    out[2 * t + 1] = __float_as_uint(mdl_bf16_to_f32(h));\n"
    "  }\n"
    "}\n"
    "extern \"C\" __global__ void k_bf16x2(const uint32_t *in, uint32_t *out, int n) {\n"
    "  const int t = threadIdx.x;\n"
    "  if (2 * t + 1 < n)\n"
    "    out[t] = mdl_bf16x2(__uint_as_float(in[2 * t]), __uint_as_float(in[2 * t + 1]));\n"
    "}\n"
    "\n"
    "struct Args { double *out; const float *in; const uint32_t *bits; uint32_t *bout; MdlStatus *st; int n;\n"
    "              const float *ma, *mb, *mc; float *md; };\n"
    "static Args A;\n"
    "static void b_sync(void *) { k_sync(A.out); }\n"
    "static void b_shfl(void *) { k_shfl(A.out); }\n"
    "static void b_race(void *) { k_race(A.out); }\n"
    "static void b_syncwarp(void *) { k_syncwarp(A.out); }\n"
    "static void b_atomic(void *) { k_atomic(A.out); }\n"
    "static void b_report(void *) { k_report(A.st); }\n"
    "static void b_deadlock(void *) { k_deadlock(A.out); }\n"
    "static void b_reduce(void *) { k_reduce(A.out); }\n"
    "static void b_math(void *) { k_math(A.out, A.in, A.n); }\n"
    "static void b_bf16(void *) { k_bf16(A.bits, A.bout, A.n); }\n"
    "static void b_ushort4(void *) { k_ushort4(A.bits, (uint16_t *)A.bout); }\n"
    "static void b_bf16x2(void *) { k_bf16x2(A.bits, A.bout, A.n); }\n"
    "static void b_mma(void *) { k_mma(A.ma, A.mb, A.mc, A.md); }\n"
    "static void b_mma_partial(void *) { k_mma_partial(A.md); }\n"
    "static void b_ldsm(void *) { k_ldsm(A.bout); }\n"
    "static void b_ldsm_wide(void *) { k_ldsm_wide(A.bout); }\n"
    "static void b_cp_async(void *) { k_cp_async(A.ma, A.md); }\n"
    "static void b_cp_early(void *) { k_cp_early(A.ma, A.md + 1100); }\n"
    "static void b_vote(void *) { k_vote(A.md + 1200); }\n"
    "extern \"C\" void run_sync(double *out) {\n"
    "  A.out = out;\n"
    "  mdl_emu::run(dim3{3, 1, 1}, dim3{256, 1, 1}, b_sync, 0);\n"
    "}\n"
    "extern \"C\" void run_race(double *out) {\n"
    "  A.out = out;\n"
    "  mdl_emu::run(dim3{4, 1, 1}, dim3{64, 1, 1}, b_race, 0);\n"
    "}\n"
    "extern \"C\" void run_syncwarp(double *out) {\n"
    "  A.out = out;\n"
    "  mdl_emu::run(dim3{4, 1, 1}, dim3{64, 1, 1}, b_syncwarp, 0);\n"
    "}\n"
    "extern \"C\" void run_shfl(double *out) {\n"
    "  A.out = out;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{64, 1, 1}, b_shfl, 0);\n"
    "}\n"
    "extern \"C\" void run_atomic(double *out) {\n"
    "  A.out = out;\n"
    "  mdl_emu::run(dim3{4, 1, 1}, dim3{128, 1, 1}, b_atomic, 0);\n"
    "}\n"
    "extern \"C\" void run_report(MdlStatus *st) {\n"
    "  A.st = st;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{32, 1, 1}, b_report, 0);\n"
    "}\n"
    "extern \"C\" void run_deadlock(double *out) {\n"
    "  A.out = out;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{32, 1, 1}, b_deadlock, 0);\n"
    "}\n"
    "extern \"C\" void run_reduce(double *out) {\n"
    "  A.out = out;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{256, 1, 1}, b_reduce, 0);\n"
    "}\n"
    "extern \"C\" void run_math(double *out, const float *in, int n) {\n"
    "  A.out = out; A.in = in; A.n = n;\n"
    "  mdl_emu::run(dim3{(unsigned)(n + 63) / 64, 1, 1}, dim3{64, 1, 1}, b_math, 0);\n"
    "}\n"
    "extern \"C\" void run_ushort4(const uint32_t *bits, uint16_t *out, int n) {\n"
    "  A.bits = bits; A.bout = (uint32_t *)out;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{(unsigned)n / 4, 1, 1}, b_ushort4, 0);\n"
    "}\n"
    "extern \"C\" void run_bf16(const uint32_t *bits, uint32_t *out, int n) {\n"
    "  A.bits = bits; A.bout = out; A.n = n;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{64, 1, 1}, b_bf16, 0);\n"
    "}\n"
    "extern \"C\" void run_bf16x2(const uint32_t *bits, uint32_t *out, int n) {\n"
    "  A.bits = bits; A.bout = out; A.n = n;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{32, 1, 1}, b_bf16x2, 0);\n"
    "}\n"
    "extern \"C\" void run_mma(const float *a, const float *b, const float *c, float *d, int blocks) {\n"
    "  A.ma = a; A.mb = b; A.mc = c; A.md = d;\n"
    "  mdl_emu::run(dim3{(unsigned)blocks, 1, 1}, dim3{64, 1, 1}, b_mma, 0);\n"
    "}\n"
    "extern \"C\" void run_ldsm_wide(uint32_t *out) {\n"
    "  A.bout = out;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{32, 1, 1}, b_ldsm_wide, 0);\n"
    "}\n"
    "extern \"C\" void ldsm_stats(unsigned long long *tiles, unsigned long long *extra) {\n"
    "  *tiles = mdl_emu::ldsm_tiles;\n"
    "  *extra = mdl_emu::ldsm_extra_passes;\n"
    "}\n"
    "extern \"C\" void run_ldsm(uint32_t *out) {\n"
    "  A.bout = out;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{64, 1, 1}, b_ldsm, 0);\n"
    "}\n"
    "extern \"C\" void run_cp_async(const float *src, float *out) {\n"
    "  A.ma = src; A.md = out;\n"
    "  mdl_emu::run(dim3{2, 1, 1}, dim3{128, 1, 1}, b_cp_async, 0);\n"
    "  mdl_emu::run(dim3{2, 1, 1}, dim3{32, 1, 1}, b_cp_early, 0);\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{64, 1, 1}, b_vote, 0);\n"
    "}\n"
    "extern \"C\" void run_mma_partial(float *d) {\n"
    "  A.md = d;\n"
    "  mdl_emu::run(dim3{1, 1, 1}, dim3{32, 1, 1}, b_mma_partial, 0);\n"
    "}\n";

static void *load(const char *dir, char *why, size_t n) {
  char src[300], so[300], log[300], cmd[1200];
  snprintf(src, sizeof src, "%s/emu.cpp", dir);
  snprintf(so, sizeof so, "%s/emu.so", dir);
  snprintf(log, sizeof log, "%s/emu.log", dir);
  FILE *f = fopen(src, "w");
  if (!f)
    return NULL;
  fprintf(f, "#include \"cuda_emu.h\"\n%s\n%s%s", emit_cuda_prelude(), mma_kernels, kernels);
  fclose(f);
  snprintf(cmd, sizeof cmd, "g++ -std=c++17 -O1 -fopenmp -shared -fPIC -Wall -Itests/unit -Iruntime/kernels %s -o %s >%s 2>&1", src, so,
           log);
  if (system(cmd) != 0) {
    f = fopen(log, "r");
    size_t k = f ? fread(why, 1, n - 1, f) : 0;
    why[k] = 0;
    if (f)
      fclose(f);
    return NULL;
  }
  void *h = dlopen(so, RTLD_NOW | RTLD_LOCAL);
  if (!h)
    snprintf(why, n, "%s", dlerror());
  return h;
}

static double gelu(double x) { return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }

static double gelu_grad(double x) {
  double k = sqrt(2 / M_PI), t = tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
}

static double sigmoid(double x) { return 1 / (1 + exp(-x)); }

// Runs the entry point `entry` (taking one buffer) in a child process; its wait status.
static int run_in_child(void *h, const char *entry, void *buf) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    alarm(20); // a hang would end as SIGALRM, not as an abort
    if (!freopen("/dev/null", "w", stderr))
      _exit(2);
    void (*run)(void *) = (void (*)(void *))dlsym(h, entry);
    run(buf);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

static void test_primitives(void *h) {
  double *out = calloc(1024, sizeof *out);
  // First, before any OpenMP thread exists to be lost by the forks.
  int status = run_in_child(h, "run_deadlock", out);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
        "cuda emu: threads waiting at barriers that cannot fill abort the run", "status %d", status);
  status = run_in_child(h, "run_mma_partial", out);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
        "cuda emu: an mma in a warp whose other lanes have returned aborts the run", "status %d", status);
  void (*run)(double *) = (void (*)(double *))dlsym(h, "run_sync");
  run(out);
  bool ok = true;
  for (int b = 0; b < 3; b++)
    for (int t = 0; t < 256; t++)
      ok &= out[b * 256 + t] == (255 - t) * 3 + b;
  CHECK(ok, "cuda emu: __syncthreads orders the writes and reads of a block (3 blocks of 256)", "wrong value");

  // Each thread writes its slot and reads its neighbour's with no barrier between: the threads run
  // in increasing order in blocks 0 and 1, where the odd threads see their even neighbour's write and
  // the even ones the old value, and in decreasing order in blocks 2 and 3, where it is the other way.
  for (int i = 0; i < 512; i++)
    out[i] = -1;
  run = (void (*)(double *))dlsym(h, "run_race");
  run(out);
  int wrong = 0;
  for (int b = 0; b < 4; b++)
    for (int t = 0; t < 64; t++)
      wrong += out[256 + b * 64 + t] != (((t % 2) != (b / 2)) ? (double)(t ^ 1) : -1.0);
  CHECK(wrong == 0, "cuda emu: a read of another thread's write with no barrier between sees the old value in one "
        "order of the threads and the new in the other (blocks 0, 1 increasing, 2, 3 decreasing)", "%d of 256 "
        "reads differ", wrong);

  // The same with __syncwarp between the write and the read: every read sees the neighbour's write,
  // in both orders of the threads.
  for (int i = 0; i < 512; i++)
    out[i] = -1;
  run = (void (*)(double *))dlsym(h, "run_syncwarp");
  run(out);
  wrong = 0;
  for (int b = 0; b < 4; b++)
    for (int t = 0; t < 64; t++)
      wrong += out[256 + b * 64 + t] != (double)(t ^ 1);
  CHECK(wrong == 0, "cuda emu: __syncwarp orders the writes and reads of a warp, in both orders of the threads",
        "%d of 256 reads differ", wrong);

  memset(out, 0, 1024 * sizeof *out);
  run = (void (*)(double *))dlsym(h, "run_shfl");
  run(out);
  ok = true;
  for (int t = 0; t < 64; t++)
    ok &= out[t] == (double)(t ^ 5) && out[64 + t] == 0.5 + (t / 32 * 32 + 7);
  CHECK(ok, "cuda emu: warp shuffles exchange floats (xor) and doubles (broadcast) within each warp", "wrong value");

  memset(out, 0, 1024 * sizeof *out);
  run = (void (*)(double *))dlsym(h, "run_atomic");
  run(out);
  CHECK(((float *)out)[0] == 256.0f && out[1] == 128 && out[2] == 128 && out[3] == 128 && out[4] == 128,
        "cuda emu: atomicAdd from every thread of 4 blocks", "%g, %g %g %g %g", ((float *)out)[0], out[1], out[2],
        out[3], out[4]);

  MdlStatus st = {0};
  void (*report)(MdlStatus *) = (void (*)(MdlStatus *))dlsym(h, "run_report");
  report(&st);
  CHECK(st.set == 1 && st.code == 1 && st.value == 5 && st.limit == 10, "cuda emu: the first mdl_report wins",
        "set %llu code %lld value %lld", st.set, st.code, st.value);

  free(out);
}

static void test_prelude(void *h) {
  double out[8] = {0};
  void (*run)(double *) = (void (*)(double *))dlsym(h, "run_reduce");
  run(out);
  double sum = 0, sum32 = 0, sumq = 0, mx = -INFINITY, mx_nan = -INFINITY, mx32 = -INFINITY;
  for (int t = 0; t < 256; t++) {
    double x = (t * 37) % 101 - 50.0;
    sum += x;
    mx = fmax(mx, x);
    if (t != 77)
      mx_nan = fmax(mx_nan, x);
    if (t < 32) {
      sum32 += x;
      sumq += x * 0.25;
      if (t != 3)
        mx32 = fmax(mx32, x);
    }
  }
  CHECK(out[0] == sum && out[4] == sum32 && out[5] == sumq, "cuda prelude: block and warp sums",
        "%g vs %g, %g vs %g, %g vs %g", out[0], sum, out[4], sum32, out[5], sumq);
  CHECK(out[1] == mx_nan && out[6] == mx32, "cuda prelude: block and warp max ignoring NaN (softmax, cross-entropy)",
        "%g vs %g, %g vs %g", out[1], mx_nan, out[6], mx32);
  CHECK(isnan(out[2]) && out[3] == mx && isnan(out[7]), "cuda prelude: block and warp max where a NaN wins (max)",
        "%g, %g vs %g, %g", out[2], out[3], mx, out[7]);

  enum { N = 200 }; // N_MATH in the kernels
  float in[N];
  double *res = calloc(7 * N, sizeof *res);
  for (int i = 0; i < N; i++)
    in[i] = (float)(-8.0 + 16.0 * i / (N - 1));
  void (*math)(double *, const float *, int) = (void (*)(double *, const float *, int))dlsym(h, "run_math");
  math(res, in, N);
  double eg = 0, egg = 0, es = 0, esg = 0;
  bool rng = true, drop = true;
  for (int i = 0; i < N; i++) {
    double x = in[i], s = sigmoid(x);
    eg = fmax(eg, fabs(res[6 * i] - gelu(x)) / fmax(1, fabs(gelu(x))));
    egg = fmax(egg, fabs(res[6 * i + 1] - gelu_grad(x)) / fmax(1, fabs(gelu_grad(x))));
    es = fmax(es, fabs(res[6 * i + 2] - x * s) / fmax(1, fabs(x * s)));
    esg = fmax(esg, fabs(res[6 * i + 3] - 1.5 * s * (1 + x * (1 - s))));
    double u = mdl_rng_uniform(7, 3, (uint64_t)i * 1000003u);
    rng &= res[6 * i + 4] == u;
    drop &= res[6 * i + 5] == (u >= 0.3 ? (double)(float)(in[i] / 0.7) : 0.0);
  }
  CHECK(eg < 1e-6 && egg < 1e-5, "cuda prelude: gelu (within 1e-6) and its derivative (1e-5: 1 - s loses bits "
        "when s nears 1 in fp32) match the tanh formula",
        "gelu %.2g, gelu' %.2g", eg, egg);
  CHECK(es < 1e-6 && esg < 1e-6, "cuda prelude: silu and its derivative", "silu %.2g, silu' %.2g", es, esg);
  CHECK(rng && drop, "cuda prelude: the RNG and dropout agree bit for bit with mdl.h", "rng %d, dropout %d", rng, drop);
  bool ex = true;
  for (int i = 0; i < N; i++)
    ex &= res[6 * N + i] == (double)expf(in[i]);
  CHECK(ex, "cuda emu: __expf", "differs from expf");
  free(res);

  static const struct {
    uint32_t f;
    uint16_t bf;
  } cases[] = {
      {0x3f800000, 0x3f80}, // 1.0
      {0x3f808000, 0x3f80}, // 1 + 2^-8: a tie, to even (down)
      {0x3f818000, 0x3f82}, // 1 + 3 * 2^-8: a tie, to even (up)
      {0x3f808001, 0x3f81}, // just above a tie: up
      {0x3f7fffff, 0x3f80}, // the carry reaches the exponent
      {0x7f7fffff, 0x7f80}, // the largest float rounds to infinity
      {0xff800000, 0xff80}, // -infinity
      {0x80000000, 0x8000}, // -0
      {0x7fc00000, 0x7fc0}, // a quiet NaN
      {0x7f800001, 0x7fc0}, // a signalling NaN stays a NaN, made quiet
      {0xc0490fdb, 0xc049}, // -pi
      {0x00000001, 0x0000}, // the smallest subnormal rounds to zero
  };
  enum { NC = sizeof cases / sizeof *cases };
  uint32_t bits[NC], got[2 * NC];
  for (int i = 0; i < NC; i++)
    bits[i] = cases[i].f;
  void (*bf)(const uint32_t *, uint32_t *, int) = (void (*)(const uint32_t *, uint32_t *, int))dlsym(h, "run_bf16");
  bf(bits, got, NC);
  for (int i = 0; i < NC; i++) {
    char name[120];
    snprintf(name, sizeof name, "cuda prelude: bf16 of 0x%08x is 0x%04x and widens back exactly", cases[i].f,
             cases[i].bf);
    CHECK(got[2 * i] == cases[i].bf && got[2 * i + 1] == (uint32_t)cases[i].bf << 16, name, "got 0x%04x, 0x%08x",
          got[2 * i], got[2 * i + 1]);
  }
  _Static_assert(NC % 4 == 0, "the cases fill whole ushort4s");
  uint16_t four[NC + 1];
  four[NC] = 0xbeef; // past the last store: must stay
  void (*u4)(const uint32_t *, uint16_t *, int) = (void (*)(const uint32_t *, uint16_t *, int))dlsym(h, "run_ushort4");
  u4(bits, four, NC);
  bool in_order = four[NC] == 0xbeef;
  for (int i = 0; i < NC; i++)
    in_order &= four[i] == cases[i].bf;
  CHECK(in_order, "cuda emu: four bf16 values stored as one ushort4 land in order", "0x%04x 0x%04x 0x%04x 0x%04x ...",
        four[0], four[1], four[2], four[3]);
}

// xorshift64*: the test's random numbers, the same on every run.
static double uniform(uint64_t *st) {
  *st ^= *st >> 12;
  *st ^= *st << 25;
  *st ^= *st >> 27;
  return (double)((*st * 0x2545F4914F6CDD1Dull) >> 11) / 9007199254740992.0;
}

// Tensor cores in the emulator: the packing of two roundings, then random matrices of mixed
// magnitudes (not bf16 values: the fragments round them) through mdl_mma_bf16_16816 against
// D = C + bf(A) bf(B) in double.
static void test_mma(void *h) {
  static const uint32_t pairs[] = {0x3f808000, 0x3f818000, // ties: to even (down, then up)
                                   0xc0490fdb, 0x3f7fffff, // -pi; a carry into the exponent
                                   0x7f7fffff, 0x80000000, // to infinity; -0
                                   0x00000001, 0x3f808001}; // to zero; just above a tie
  enum { NP = sizeof pairs / sizeof *pairs };
  uint32_t packed[NP / 2] = {0};
  void (*bx2)(const uint32_t *, uint32_t *, int) = (void (*)(const uint32_t *, uint32_t *, int))dlsym(h, "run_bf16x2");
  bx2(pairs, packed, NP);
  bool ok = true;
  for (int i = 0; i < NP / 2; i++) {
    float lo, hi;
    memcpy(&lo, &pairs[2 * i], 4);
    memcpy(&hi, &pairs[2 * i + 1], 4);
    float rl = (float)round_bf16(lo), rh = (float)round_bf16(hi);
    uint32_t ul, uh;
    memcpy(&ul, &rl, 4);
    memcpy(&uh, &rh, 4);
    ok &= packed[i] == ((ul >> 16) | (uh & 0xffff0000u));
  }
  CHECK(ok, "cuda prelude: mdl_bf16x2 rounds two floats to nearest even, the first in the low half",
        "0x%08x 0x%08x 0x%08x 0x%08x", packed[0], packed[1], packed[2], packed[3]);

  enum { BLOCKS = 3, WARPS = 2 * BLOCKS };
  float *a = malloc(sizeof *a * 256 * WARPS), *b = malloc(sizeof *b * 128 * WARPS);
  float *c = malloc(sizeof *c * 128 * WARPS), *d = calloc(128 * WARPS, sizeof *d);
  uint64_t st = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 256 * WARPS; i++)
    a[i] = (float)((2 * uniform(&st) - 1) * ldexp(1, (int)(uniform(&st) * 7) - 3));
  for (int i = 0; i < 128 * WARPS; i++) {
    b[i] = (float)((2 * uniform(&st) - 1) * ldexp(1, (int)(uniform(&st) * 7) - 3));
    c[i] = (float)(2 * uniform(&st) - 1);
  }
  void (*mma)(const float *, const float *, const float *, float *, int) =
      (void (*)(const float *, const float *, const float *, float *, int))dlsym(h, "run_mma");
  mma(a, b, c, d, BLOCKS);
  double worst = 0;
  int at = -1;
  for (int w = 0; w < WARPS; w++)
    for (int r = 0; r < 16; r++)
      for (int n = 0; n < 8; n++) {
        double sum = c[128 * w + 8 * r + n], mag = fabs(sum);
        for (int k = 0; k < 16; k++) {
          double p = round_bf16(a[256 * w + 16 * r + k]) * round_bf16(b[128 * w + 8 * k + n]);
          sum += p;
          mag += fabs(p);
        }
        double e = fabs(d[128 * w + 8 * r + n] - sum) / mag;
        if (!(e <= worst))
          worst = e, at = 128 * w + 8 * r + n;
      }
  char name[200];
  snprintf(name, sizeof name, "cuda emu: mma m16n8k16 (bf16 fragments by the documented layout, f32 accumulators) "
           "in %d warps of %d blocks against D = C + A B in double (worst %.1e of the magnitudes)", WARPS, BLOCKS,
           worst);
  CHECK(worst <= 1e-6, name, "element %d of warp %d: %.9g", at % 128, at / 128, at >= 0 ? d[at] : 0.0);
  free(a);
  free(b);
  free(c);
  free(d);
}

// The prelude and the tensor-core kernels compile with NVRTC: the inline PTX of mma.sync and cvt.
// ldmatrix .x4 .trans as PTX defines it ("Warp-level matrix load instruction: ldmatrix"): lanes
// 8 i .. 8 i + 7 address the rows of matrix i; with .trans lane l's register i holds rows 2 (l % 4)
// and 2 (l % 4) + 1 of column l / 4 of matrix i, the lower row in the low half. With rows
// l % 16 and columns 8 (l / 16) addressed, matrix i is rows 8 (i % 2) .. and columns 8 (i / 2) ..
// of the tile.
// Two bf16 values (exact: small integers) packed as a register holds them, lo in the low half.
static uint32_t bf16_pair(int lo, int hi) {
  float fl = (float)lo, fh = (float)hi;
  uint32_t ul, uh;
  memcpy(&ul, &fl, 4);
  memcpy(&uh, &fh, 4);
  return (ul >> 16) | (uh & 0xffff0000u);
}

static void test_ldsm(void *h) {
  uint32_t out[64 * 8], wide[32];
  void (*ldsm)(uint32_t *) = (void (*)(uint32_t *))dlsym(h, "run_ldsm");
  void (*stats)(unsigned long long *, unsigned long long *) =
      (void (*)(unsigned long long *, unsigned long long *))dlsym(h, "ldsm_stats");
  unsigned long long tiles0 = 0, extra0 = 0, tiles = 0, extra = 0, tiles2 = 0, extra2 = 0;
  stats(&tiles0, &extra0);
  ldsm(out);
  stats(&tiles, &extra);
  // (rows of 48 bytes fall in 8 different 16-byte groups of banks; rows of 128 bytes all in one)
  ((void (*)(uint32_t *))dlsym(h, "run_ldsm_wide"))(wide);
  stats(&tiles2, &extra2);
  CHECK(tiles - tiles0 == 16 && extra == extra0 && tiles2 - tiles == 4 && extra2 - extra == 4 * 7,
        "cuda emu: ldmatrix's bank conflicts are counted: none for tiles of 48-byte rows, 7 extra passes a tile "
        "of 128-byte rows", "%llu tiles with %llu extra passes, then %llu with %llu", tiles - tiles0, extra - extra0,
        tiles2 - tiles, extra2 - extra);
  int bad = 0, at = -1, bad_n = 0, at_n = -1;
  for (int t = 0; t < 64; t++) {
    int w = t / 32, l = t % 32;
    for (int i = 0; i < 4; i++) {
      int r = 8 * (i % 2) + 2 * (l % 4), c = 8 * (i / 2) + l / 4;
      int vl = 16 * r + c, vh = 16 * (r + 1) + c;
      if (out[8 * t + i] != bf16_pair(w ? -vl : vl, w ? -vh : vh) && !bad++)
        at = 8 * t + i;
      r = 8 * (i % 2) + l / 4, c = 8 * (i / 2) + 2 * (l % 4);
      vl = 16 * r + c, vh = vl + 1;
      if (out[8 * t + 4 + i] != bf16_pair(w ? -vl : vl, w ? -vh : vh) && !bad_n++)
        at_n = 8 * t + 4 + i;
    }
  }
  CHECK(bad == 0, "cuda emu: mdl_ldsm_x4_t gives each lane the transposed ldmatrix fragments PTX defines",
        "%d of 256 registers differ, the first lane %d register %d", bad, at / 8, at % 8);
  CHECK(bad_n == 0, "cuda emu: mdl_ldsm_x4 gives each lane the ldmatrix fragments PTX defines",
        "%d of 256 registers differ, the first lane %d register %d", bad_n, at_n / 8, at_n % 8 - 4);
}

// The double-buffered cp.async loop of k_cp_async in a block where copies land when issued and in
// one where they land at the wait: each tile as the source has it, in both; the zero-fill copies
// write zeros; a read of a copy's destination before the wait sees the old value where copies land
// at the wait (block 0) and the new one where they land at once (block 1), the new one in both after
// it; __all_sync is false in the warp with one false lane only, __any_sync true in the one with one
// true lane only.
static void test_cp_async(void *h) {
  float src[1024], out[1328];
  for (int i = 0; i < 1024; i++)
    src[i] = (float)i * 0.5f + 1.0f;
  void (*run)(const float *, float *) = (void (*)(const float *, float *))dlsym(h, "run_cp_async");
  run(src, out);
  int bad = 0, zeros = 0;
  for (int b = 0; b < 2; b++)
    for (int it = 0; it < 4; it++)
      for (int t = 0; t < 128; t++)
        bad += out[512 * b + 128 * it + t] != src[512 * b + 128 * it + 127 - t];
  for (int i = 0; i < 64; i++)
    zeros += out[1024 + i] == 0.0f;
  CHECK(bad == 0 && zeros == 64, "cuda emu: cp.async in two buffers, landing at once and at the wait, stages every "
        "tile; zero fills write zeros", "%d of 1024 values differ, %d of 64 zero fills", bad, zeros);
  CHECK(out[1100] == -1.0f && out[1101] == src[0] && out[1102] == src[0] && out[1103] == src[0],
        "cuda emu: a read before cp.async's wait sees the old value where copies land at the wait, the new where "
        "they land at once", "before the wait %g and %g, after %g and %g", out[1100], out[1101], out[1102], out[1103]);
  int ones = 0, anys = 0;
  for (int t = 0; t < 64; t++) {
    ones += out[1200 + t] == 1.0f;
    anys += out[1264 + t] == 1.0f;
  }
  CHECK(ones == 32 && out[1200] == 1.0f && out[1232] == 0.0f, "cuda emu: __all_sync is false in a warp with one "
        "false lane, true in one without", "%d of 64 lanes got true", ones);
  CHECK(anys == 32 && out[1264] == 0.0f && out[1296] == 1.0f, "cuda emu: __any_sync is true in a warp with one "
        "true lane, false in one without", "%d of 64 lanes got true", anys);
}

static void test_mma_nvrtc(void) {
  char why[256];
  if (!nvrtc_available(why, sizeof why)) {
    printf("[skip] cuda prelude nvrtc: %s\n", why);
    return;
  }
  size_t np = strlen(emit_cuda_prelude()), nk = strlen(mma_kernels);
  char *src = malloc(np + nk + 2);
  memcpy(src, emit_cuda_prelude(), np);
  src[np] = '\n';
  memcpy(src + np + 1, mma_kernels, nk + 1);
  static const char *const archs[] = {"sm_80", "sm_90"};
  for (int i = 0; i < 2; i++) {
    NvrtcResult r = {0};
    char err[4096] = "", name[160];
    bool ok = nvrtc_compile(src, archs[i], &r, err, sizeof err);
    snprintf(name, sizeof name, "cuda prelude nvrtc %s: kernels on mdl_mma_bf16_16816, mdl_ldsm_x4(_t), cp.async and "
             "mdl_bf16x2 compile without a warning", archs[i]);
    CHECK(ok && r.size > 0 && !r.log, name, "%.1500s", ok ? r.log : err);
    free(r.cubin);
    free(r.log);
  }
  free(src);
}

int main(void) {
  if (system("g++ --version >/dev/null 2>&1") != 0) {
    printf("[skip] cuda emu: no g++\n");
    TEST_EXIT();
  }
  char dir[] = "/tmp/mdl-emu-XXXXXX", why[4096] = "";
  if (!cache_dir_make(dir, "cuda emu: a temporary directory"))
    TEST_EXIT();
  void *h = load(dir, why, sizeof why);
  CHECK(h != NULL, "cuda emu: the emulator, the prelude and the test kernels compile with g++ -Wall", "%.1500s", why);
  if (h) {
    test_primitives(h);
    test_prelude(h);
    test_mma(h);
    test_ldsm(h);
    test_cp_async(h);
    dlclose(h);
  }
  test_mma_nvrtc();
  char cmd[200];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0)
    printf("[fail] cuda emu: cannot remove %s\n", dir);
  TEST_EXIT();
}
