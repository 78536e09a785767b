// The helpers of the C back end's modules: how a module compiles in parts, random numbers, exp and
// the activations, scratch memory, GEMMs through the runtime's hooks, sums of squares.
//
// A module compiles whole, or in parts: each part with -DMDL_PART=p (0 <= p < MDL_NPARTS) into an
// object of its own, the objects then linked into one shared object (runtime/engine/cpu.c compiles
// the parts side by side). MDL_IN(p) says whether this compile holds part p's code; a kernel is
// static in a whole compile and, in parts, visible to the other parts but not outside the module.
//
// Every kernel is noipa: its caller assumes nothing of its body. GCC 12.2 (x86-64, -O2 and -O3,
// AVX2 or AVX-512BW) otherwise drops calls to kernels that write: where IVOPTs rewrites a loop's
// load as an integer base plus an index (an f32 read and a bf16 store in rows as long as one vector
// of 16-bit lanes, 16 with AVX2 and 32 with AVX-512BW), its pure-const analysis takes that load for
// a NULL dereference, ignores the rest of the block with the store, finds the function pure, and
// the caller deletes the call: the kernel's output is never written (bf16 casts of rows of 32 on
// AVX-512 gave a loss of ln V, logits all zero). A kernel runs once a step, so nothing is lost.
#if defined(__GNUC__) && !defined(__clang__)
#define MDL_NOIPA __attribute__((noipa))
#else
#define MDL_NOIPA __attribute__((noinline))
#endif
#ifdef MDL_PART
#define MDL_IN(p) (MDL_PART == (p))
#define MDL_FN MDL_NOIPA __attribute__((visibility("hidden")))
#else
#define MDL_IN(p) 1
#define MDL_FN MDL_NOIPA static
#endif
typedef void MdlKernelFn(char *arena, const MdlHooks *h);

// Counter-based random numbers, as in mdl.h: splitmix64 of (seed, stream, index).
static inline uint64_t mdl_rng_u64(uint64_t seed, uint64_t stream, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull + i * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline double mdl_rng_uniform(uint64_t seed, uint64_t stream, uint64_t i) {
  return (double)(mdl_rng_u64(seed, stream, i) >> 40) / 16777216.0;
}

// Dropout keeps element i when its uniform number is >= p and scales it by 1 / (1 - p).
static inline float mdl_dropout(uint64_t seed, uint64_t stream, int64_t i, double p, float x) {
  return mdl_rng_uniform(seed, stream, (uint64_t)i) >= p ? (float)(x / (1.0 - p)) : 0.0f;
}

// exp(x) for x in [lo, 88], x clamped to that range first (a NaN stays NaN): x = n ln 2 + r with n
// rounded to nearest by adding 1.5 * 2^23 (n then sits in the low bits of `big`), Cephes' expf
// polynomial in r, and 2^n made from n's bits; within 2 ulp, and branch-free so that loops of it
// vectorize (libm's expf does not: a scalar call per element).
static inline float mdl_exp_clamped(float x, float lo) {
  const float xc = x < lo ? lo : x > 88.0f ? 88.0f : x;
  const float big = xc * 1.44269504f + 12582912.0f, n = big - 12582912.0f;
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  uint32_t bits;
  memcpy(&bits, &big, sizeof bits);
  bits = (bits - 0x4B400000u + 127u) << 23;
  float two_n;
  memcpy(&two_n, &bits, sizeof two_n);
  return (p * r * r + r + 1.0f) * two_n;
}

// exp(x), saturating outside [-87, 88] (at e^-87 and e^88).
static inline float mdl_exp_fast(float x) { return mdl_exp_clamped(x, -87.0f); }

// exp(x) for x <= 0 (a score less its row's maximum): 0 below about -87.7 and for -INFINITY, where
// n is -127 and 2^n's bits are those of 0, so a masked score needs no select (the select had GCC
// mask every operation of the polynomial: the softmax rows of attention 12-15% faster without).
static inline float mdl_exp_shifted(float x) { return mdl_exp_clamped(x, -88.0f); }

// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), and its
// derivative 0.5 (1 + t) + 0.5 x (1 - t^2) u'. With s = sigmoid(2u) = 0.5 (1 + tanh(u)) and
// 1 - t^2 = 4 s (1 - s) both take one exp, much cheaper than tanhf.
static inline float mdl_gelu(float x) {
  const float u = 0.797884561f * (x + 0.044715f * x * x * x);
  return x / (1.0f + mdl_exp_fast(-2.0f * u));
}

static inline float mdl_gelu_grad(float x) {
  const float u = 0.797884561f * (x + 0.044715f * x * x * x), s = 1.0f / (1.0f + mdl_exp_fast(-2.0f * u));
  return s + 2.0f * x * s * (1.0f - s) * 0.797884561f * (1.0f + 3.0f * 0.044715f * x * x);
}

static inline float mdl_sigmoid(float x) { return 1.0f / (1.0f + mdl_exp_fast(-x)); }

// x within [lo, hi] (a NaN stays NaN); MDL_INF and MDL_NAN, as cuda_base.cuh's, for literals that are
// not finite (emit_common.c: ec_flit).
#define MDL_INF INFINITY
#define MDL_NAN NAN
static inline float mdl_clamp(float x, float lo, float hi) { return x < lo ? lo : x > hi ? hi : x; }
static inline float mdl_silu(float x) { return x * mdl_sigmoid(x); }

static inline float mdl_silu_grad(float x, float dy) {
  const float s = mdl_sigmoid(x);
  return dy * s * (1.0f + x * (1.0f - s));
}

// Scratch for one kernel, freed by mdl_free before it returns. A large buffer is mapped in huge
// pages where the kernel has them, and kept when freed for the next step's kernel of its size (a
// few are kept): mapped afresh each step, GPT-2 124M's LM head chunk of 51 MB was faulted in and
// zeroed by the kernel every step (glibc's malloc maps anything over 32 MB afresh). A header before
// the buffer keeps its size.
enum { MDL_SCRATCH_HEAD = 64, MDL_SCRATCH_MAPPED = 4 << 20, MDL_SCRATCH_KEPT = 8 };
#ifdef MDL_PART // one list for the whole module, in part 0
__attribute__((visibility("hidden"))) extern char *mdl_scratch_kept[MDL_SCRATCH_KEPT];
#if MDL_PART == 0
char *mdl_scratch_kept[MDL_SCRATCH_KEPT];
#endif
#else
static char *mdl_scratch_kept[MDL_SCRATCH_KEPT];
#endif

static inline void *mdl_scratch(size_t bytes) {
  const size_t n = bytes + MDL_SCRATCH_HEAD;
  char *p = NULL;
  if (n >= MDL_SCRATCH_MAPPED) {
#pragma omp critical(mdl_scratch)
    for (int i = 0; i < MDL_SCRATCH_KEPT && !p; i++) {
      size_t m = 0;
      if (mdl_scratch_kept[i])
        memcpy(&m, mdl_scratch_kept[i], sizeof m);
      if (m == n)
        p = mdl_scratch_kept[i], mdl_scratch_kept[i] = NULL;
    }
    if (!p) {
      p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED)
        p = NULL;
      else
        madvise(p, n, MADV_HUGEPAGE);
    }
  } else {
    p = aligned_alloc(MDL_SCRATCH_HEAD, (n + MDL_SCRATCH_HEAD - 1) / MDL_SCRATCH_HEAD * MDL_SCRATCH_HEAD);
  }
  if (!p) {
    fprintf(stderr, "mdl: out of memory (%zu bytes)\n", bytes);
    abort();
  }
  memcpy(p, &n, sizeof n);
  return p + MDL_SCRATCH_HEAD;
}

static inline void mdl_free(void *q) {
  char *p = (char *)q - MDL_SCRATCH_HEAD;
  size_t n;
  memcpy(&n, p, sizeof n);
  if (n < MDL_SCRATCH_MAPPED) {
    free(p);
    return;
  }
#pragma omp critical(mdl_scratch)
  for (int i = 0; i < MDL_SCRATCH_KEPT && p; i++)
    if (!mdl_scratch_kept[i])
      mdl_scratch_kept[i] = p, p = NULL;
  if (p)
    munmap(p, n);
}

// C = op(A) op(B) + beta C through the runtime's sgemm, split into blocks of output rows over the
// threads (the BLAS runs single-threaded in each): one pool of threads for the whole step. The
// blocks (h->gemm_blocks, 16 rows at least) do not follow the thread count: OpenBLAS sums a row in
// another order when it is part of a smaller product (its small-matrix kernels: 48 rows of an
// A B^T product with n 32, k 256 differ from the same rows as two calls of 24), so a split by
// threads made results depend on them.
// The blocks of rows mdl_gemm splits an m x n x k product into (1: one call).
static inline int64_t mdl_gemm_nb(const MdlHooks *h, int64_t m, int64_t n, int64_t k) {
  int64_t nb = m * n * k >= (1 << 18) ? h->gemm_blocks : 1;
  if (nb > (m + 15) / 16)
    nb = (m + 15) / 16;
  return nb > 1 ? nb : 1;
}

// Block t of the nb (mdl_gemm_nb) of the product, on the calling thread.
static inline void mdl_gemm_block(const MdlHooks *h, int64_t t, int64_t nb, int ta, int tb, int64_t m, int64_t n,
                                  int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                                  float *c, int64_t ldc) {
  const int64_t r0 = m * t / nb, r1 = m * (t + 1) / nb;
  h->sgemm(ta, tb, r1 - r0, n, k, ta ? a + r0 : a + r0 * lda, lda, b, ldb, beta, c + r0 * ldc, ldc);
}

static inline void mdl_gemm(const MdlHooks *h, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,
                            int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  const int64_t nb = mdl_gemm_nb(h, m, n, k);
  if (nb == 1) {
    h->sgemm(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
    return;
  }
#pragma omp parallel for num_threads(h->nthreads) schedule(static)
  for (int64_t t = 0; t < nb; t++)
    mdl_gemm_block(h, t, nb, ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
}

// Sum of squares in double over fixed blocks of 4096, each block in vector lanes, the blocks added
// in order: the result does not depend on the number of threads.
static inline double mdl_sumsq(const float *x, int64_t n, int nthreads) {
  const int64_t nb = (n + 4095) / 4096;
  double *part = mdl_scratch((size_t)nb * sizeof(double)), s = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 65536)
  for (int64_t b = 0; b < nb; b++) {
    const int64_t end = b * 4096 + 4096 < n ? b * 4096 + 4096 : n;
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = b * 4096; i < end; i++)
      acc += (double)x[i] * x[i];
    part[b] = acc;
  }
  for (int64_t b = 0; b < nb; b++)
    s += part[b];
  mdl_free(part);
  return s;
}
