// The module ABI: the runtime's hooks and the kernel table, one text for both sides (the runtime
// includes runtime/kernels/abi.h: runtime/engine/backend.h).
typedef struct {
  // row-major C = op(A) op(B) + beta C, op = transpose when ta / tb
  // (single-threaded: the module splits a GEMM's rows over its own threads)
  void (*sgemm)(int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
  // the same with bf16 operands (f32 products and sums, f32 C); NULL where the library has no bf16
  // GEMM faster than sgemm, and the module widens bf16 operands for sgemm instead
  void (*bgemm)(int ta, int tb, int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda,
                const uint16_t *b, int64_t ldb, float beta, float *c, int64_t ldc);
  int nthreads;  // OpenMP threads per parallel loop and per GEMM
  // Row blocks of a large GEMM: the default thread count when the module was loaded, kept when
  // nthreads changes, so that no result depends on the thread count (mdl_gemm in prelude.h).
  int gemm_blocks;
  uint64_t seed; // the run's seed: dropout masks
  void *ctx;     // passed back to error
  void (*error)(void *ctx, const char *what, int64_t value, int64_t limit); // an id or target out of range
  // ZeRO stage 1: the optimizer updates only the parameters at arena bytes [own_lo, own_end); every
  // one where own_end is 0
  int64_t own_lo, own_end;
  // precision fp8 (else NULL, 0): per scaled tensor its scale this step; per thread (omp_get_thread_num,
  // fewer than fp8_threads) and tensor the largest |x| its casts saw (fp8_amax[thread * nfp8 + tensor],
  // NaN once one was NaN), which the runtime gathers and clears
  const float *fp8_scale;
  float *fp8_amax;
  int nfp8, fp8_threads;
} MdlHooks;

typedef struct {
  const char *name;
  void (*fn)(char *arena, const MdlHooks *h);
} MdlKernel;

