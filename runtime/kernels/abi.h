// The runtime's hooks and the kernel table (runtime/backend.h holds the same typedefs).
typedef struct {
  // row-major C = op(A) op(B) + beta C, op = transpose when ta / tb
  void (*sgemm)(int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
  // the same with bf16 operands; NULL where the library has none faster than sgemm
  void (*bgemm)(int ta, int tb, int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda,
                const uint16_t *b, int64_t ldb, float beta, float *c, int64_t ldc);
  int nthreads;  // OpenMP threads per parallel loop
  int gemm_blocks; // row blocks of a large GEMM, whatever nthreads is
  uint64_t seed; // the run's seed: dropout masks
  void *ctx;     // passed back to error
  void (*error)(void *ctx, const char *what, int64_t value, int64_t limit); // an id or target out of range
  // ZeRO stage 1: the optimizer updates only the parameters at arena bytes [own_lo, own_end); every
  // one where own_end is 0
  int64_t own_lo, own_end;
  const float *fp8_scale; // precision fp8: per scaled tensor its scale this step
  float *fp8_amax;        // and per thread and tensor the largest |x| its casts saw
  int nfp8, fp8_threads;
} MdlHooks;

typedef struct {
  const char *name;
  void (*fn)(char *arena, const MdlHooks *h);
} MdlKernel;

