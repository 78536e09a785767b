
// The C back end's fp8 (precision fp8; after fp8_bits.h's conversions). A CAST to fp8 multiplies
// by its tensor's scale, rounds, and notes |x| in its thread's amax (a NaN stays); the GEMMs widen
// their fp8 operands to f32 times 1 / scale (exact: a power of two, so the f32 GEMM's sums are the
// scaled sums of the codes' products, descaled).
#include <omp.h>

static inline float mdl_fp8_note(const MdlHooks *h, int t, float x) {
  float *a = h->fp8_amax + (size_t)(omp_get_thread_num() % h->fp8_threads) * (size_t)h->nfp8 + (size_t)t, ax = fabsf(x);
  if (*a == *a && !(ax <= *a))
    *a = ax;
  return x * h->fp8_scale[t];
}

static inline float mdl_cast_e4m3(const MdlHooks *h, int t, float x) {
  return mdl_e4m3_to_f32(mdl_f32_to_e4m3(mdl_fp8_note(h, t, x)));
}

static inline float mdl_cast_e5m2(const MdlHooks *h, int t, float x) {
  return mdl_e5m2_to_f32(mdl_f32_to_e5m2(mdl_fp8_note(h, t, x)));
}

// n fp8 codes (E5M2 when e5, else E4M3) widened into a new buffer of bf16 bits, times the tensor's
// 1 / scale: exact, as in f32 (a code has 3 significant bits at most, and a power of two keeps them),
// unless the product falls below bf16's least normal number (2^-126), which f32's subnormals reach
// further than bf16's. What the library's bf16 GEMM reads where the runtime has one. mdl_free() it.
static inline uint16_t *mdl_widen_fp8_bf16(const uint8_t *x, int64_t n, int e5, float descale, int nthreads) {
  uint16_t *y = mdl_scratch((size_t)n * sizeof(uint16_t));
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 65536)
  for (int64_t i = 0; i < n; i++)
    y[i] = mdl_f32_to_bf16((e5 ? mdl_e5m2_to_f32(x[i]) : mdl_e4m3_to_f32(x[i])) * descale);
  return y;
}

// n fp8 codes (E5M2 when e5, else E4M3) widened into a new f32 buffer, times the tensor's 1 / scale.
// mdl_free() it.
static inline float *mdl_widen_fp8(const uint8_t *x, int64_t n, int e5, float descale, int nthreads) {
  float *y = mdl_scratch((size_t)n * sizeof(float));
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 65536)
  for (int64_t i = 0; i < n; i++)
    y[i] = (e5 ? mdl_e5m2_to_f32(x[i]) : mdl_e4m3_to_f32(x[i])) * descale;
  return y;
}
