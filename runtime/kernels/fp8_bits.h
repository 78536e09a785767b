
// fp8 <-> f32 in the two OCP formats of Hopper's tensor cores, one text for the three back ends: the
// C modules that hold fp8 values carry it after their prelude, the CUDA prelude carries it, and the
// reference interpreter includes it. E4M3 (bias 7, no infinity, S.1111.111 is NaN, largest 448) and
// E5M2 (bias 15, IEEE-like, largest 57344). To fp8: round to nearest, ties to even, subnormals exact,
// -0 kept; beyond the largest finite value (infinity too) saturate to it with the sign (PTX's
// cvt.rn.satfinite, cuBLASLt's and __NV_SATFINITE's rule); every NaN becomes 0x7f. The widenings are
// exact. MDL_FP8_FN makes the functions the device's under CUDA.
#if defined(__CUDACC__)
#define MDL_FP8_FN __device__ __forceinline__
#else
#define MDL_FP8_FN static inline
#endif

// A float's bits, and the float of some bits.
MDL_FP8_FN uint32_t mdl_fp8_bits(float x) {
#if defined(__CUDACC__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
#endif
}

MDL_FP8_FN float mdl_fp8_float(uint32_t u) {
#if defined(__CUDACC__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// The reference, in integer arithmetic: |x| is clamped to the largest value (bits max), then rounded
// on the bits (normal) or as an integer multiple of the smallest subnormal.
MDL_FP8_FN uint8_t mdl_f32_to_fp8(float x, uint32_t man, uint32_t bias, uint32_t max) {
  const uint32_t u = mdl_fp8_bits(x), s = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u)
    return 0x7f;
  a = a < max ? a : max;
  const uint32_t e = a >> 23;
  if (e >= 128u - bias) {
    const uint32_t sh = 23u - man, r = a + (1u << (sh - 1u)) - 1u + ((a >> sh) & 1u);
    return (uint8_t)(s | ((r >> sh) - ((127u - bias) << man)));
  }
  const uint32_t m = (a & 0x7fffffu) | (e ? 0x800000u : 0u), sh = 151u - bias - man - (e ? e : 1u);
  if (sh > 31u)
    return (uint8_t)s;
  return (uint8_t)(s | ((m + (1u << (sh - 1u)) - 1u + ((m >> sh) & 1u)) >> sh));
}

// From sm_89 on the encoders use cvt.rn.satfinite, which PTX defines as the reference for every
// input but NaN (any NaN of the format): NaN inputs still give 0x7f.
MDL_FP8_FN uint8_t mdl_f32_to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short h;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.0f), "f"(x));
  return (mdl_fp8_bits(x) & 0x7fffffffu) > 0x7f800000u ? (uint8_t)0x7f : (uint8_t)h;
#else
  return mdl_f32_to_fp8(x, 3u, 7u, 0x43e00000u);
#endif
}

MDL_FP8_FN uint8_t mdl_f32_to_e5m2(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short h;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.0f), "f"(x));
  return (mdl_fp8_bits(x) & 0x7fffffffu) > 0x7f800000u ? (uint8_t)0x7f : (uint8_t)h;
#else
  return mdl_f32_to_fp8(x, 2u, 15u, 0x47600000u);
#endif
}

// A finite fp8 code widened: normal values by their bits, subnormals as m times the smallest one.
MDL_FP8_FN float mdl_fp8_to_f32(uint8_t c, uint32_t man, uint32_t bias) {
  const uint32_t e = (c & 0x7fu) >> man, m = c & ((1u << man) - 1u);
  const float v = e ? mdl_fp8_float((e + 127u - bias) << 23 | m << (23u - man))
                    : (float)m * mdl_fp8_float((128u - bias - man) << 23);
  return mdl_fp8_float(mdl_fp8_bits(v) | (uint32_t)(c & 0x80u) << 24);
}

MDL_FP8_FN float mdl_e4m3_to_f32(uint8_t c) {
  return (c & 0x7fu) == 0x7fu ? mdl_fp8_float(0x7fffffffu) : mdl_fp8_to_f32(c, 3u, 7u);
}

MDL_FP8_FN float mdl_e5m2_to_f32(uint8_t c) {
  if ((c & 0x7fu) >= 0x7cu)
    return (c & 0x7fu) > 0x7cu ? mdl_fp8_float(0x7fffffffu) : mdl_fp8_float(0x7f800000u | (uint32_t)(c & 0x80u) << 24);
  return mdl_fp8_to_f32(c, 2u, 15u);
}
