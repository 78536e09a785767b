
// bf16 <-> f32 (a bf16 value is the top half of an f32). To bf16: round to nearest, ties to even,
// on the bits; a NaN stays a quiet NaN.
static inline uint16_t mdl_f32_to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The bits of x when x is already a bf16 value (a CAST's, rounded by mdl_f32_to_bf16 and widened):
// the upper half of its f32 bits, what mdl_f32_to_bf16 would give again, without its rounding.
static inline uint16_t mdl_bf16_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (uint16_t)(u >> 16);
}

static inline float mdl_bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

// C = op(A) op(B) + beta C of bf16 operands through the runtime's bgemm (h->bgemm set), split into
// h->gemm_blocks blocks over the threads: blocks of columns of C (of 64 at least), since a block
// of rows has each thread repack all of B into the library's layout (oneDNN's bf16 GEMM ran at
// half its rate so), else blocks of rows.
// The blocks mdl_bgemm splits an m x n x k product into (1: one call), by columns (*cols) or rows.
static inline int64_t mdl_bgemm_nb(const MdlHooks *h, int64_t m, int64_t n, int64_t k, int *cols) {
  const int64_t nb = m * n * k >= (1 << 18) ? h->gemm_blocks : 1;
  *cols = nb > 1 && n / 64 >= nb;
  return *cols || (nb > 1 && m / 16 >= nb) ? nb : 1;
}

// Block t of the nb (mdl_bgemm_nb) of the product, on the calling thread.
static inline void mdl_bgemm_block(const MdlHooks *h, int64_t t, int64_t nb, int cols, int ta, int tb, int64_t m,
                                   int64_t n, int64_t k, const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb,
                                   float beta, float *c, int64_t ldc) {
  if (nb == 1) {
    h->bgemm(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
  } else if (cols) {
    const int64_t c0 = n * t / nb / 16 * 16, c1 = t == nb - 1 ? n : n * (t + 1) / nb / 16 * 16;
    h->bgemm(ta, tb, m, c1 - c0, k, a, lda, tb ? b + c0 * ldb : b + c0, ldb, beta, c + c0, ldc);
  } else {
    const int64_t r0 = m * t / nb, r1 = m * (t + 1) / nb;
    h->bgemm(ta, tb, r1 - r0, n, k, ta ? a + r0 : a + r0 * lda, lda, b, ldb, beta, c + r0 * ldc, ldc);
  }
}

static inline void mdl_bgemm(const MdlHooks *h, int ta, int tb, int64_t m, int64_t n, int64_t k, const uint16_t *a,
                             int64_t lda, const uint16_t *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  int cols;
  const int64_t nb = mdl_bgemm_nb(h, m, n, k, &cols);
  if (nb == 1) {
    h->bgemm(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
    return;
  }
#pragma omp parallel for num_threads(h->nthreads) schedule(static)
  for (int64_t t = 0; t < nb; t++)
    mdl_bgemm_block(h, t, nb, cols, ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
}

// n bf16 values widened into a new f32 buffer (exact), for the f32 GEMM that computes a GEMM of
// bf16 operands: every product of two bf16 values is exact in f32, and the sums accumulate in f32
// as on a GPU's bf16 tensor cores. mdl_free() it.
static inline float *mdl_widen_bf16(const uint16_t *x, int64_t n, int nthreads) {
  float *y = mdl_scratch((size_t)n * sizeof(float));
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 65536)
  for (int64_t i = 0; i < n; i++)
    y[i] = mdl_bf16_to_f32(x[i]);
  return y;
}
