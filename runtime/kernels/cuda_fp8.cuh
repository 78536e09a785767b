// fp8 <-> f32 in the two OCP formats of Hopper's tensor cores: E4M3 (bias 7, no infinity, S.1111.111
// is NaN, largest 448) and E5M2 (bias 15, IEEE-like, largest 57344). To fp8: round to nearest, ties
// to even, subnormals exact, -0 kept; beyond the largest finite value (infinity too) saturate to it
// with the sign (satfinite, as cuBLASLt and __NV_SATFINITE); every NaN becomes 0x7f. The widenings
// are exact. mdl_f32_to_fp8 is the reference, in integer arithmetic: |x| is clamped to the largest
// value (bits max), then rounded on the bits (normal) or as an integer multiple of the smallest
// subnormal. From sm_89 on the encoders use cvt.rn.satfinite, which PTX defines the same way for
// every input but NaN (any NaN of the format): NaN inputs still give 0x7f.
typedef unsigned char uint8_t;

__device__ __forceinline__ uint8_t mdl_f32_to_fp8(float x, uint32_t man, uint32_t bias, uint32_t max) {
  const uint32_t u = __float_as_uint(x), s = (u >> 24) & 0x80u;
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

__device__ __forceinline__ uint8_t mdl_f32_to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short h;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.0f), "f"(x));
  return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u ? (uint8_t)0x7f : (uint8_t)h;
#else
  return mdl_f32_to_fp8(x, 3u, 7u, 0x43e00000u);
#endif
}

__device__ __forceinline__ uint8_t mdl_f32_to_e5m2(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short h;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.0f), "f"(x));
  return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u ? (uint8_t)0x7f : (uint8_t)h;
#else
  return mdl_f32_to_fp8(x, 2u, 15u, 0x47600000u);
#endif
}

// A finite fp8 code widened: normal values by their bits, subnormals as m times the smallest one.
__device__ __forceinline__ float mdl_fp8_to_f32(uint8_t c, uint32_t man, uint32_t bias) {
  const uint32_t e = (c & 0x7fu) >> man, m = c & ((1u << man) - 1u);
  const float v = e ? __uint_as_float((e + 127u - bias) << 23 | m << (23u - man))
                    : (float)m * __uint_as_float((128u - bias - man) << 23);
  return __uint_as_float(__float_as_uint(v) | (uint32_t)(c & 0x80u) << 24);
}

__device__ __forceinline__ float mdl_e4m3_to_f32(uint8_t c) {
  return (c & 0x7fu) == 0x7fu ? MDL_NAN : mdl_fp8_to_f32(c, 3u, 7u);
}

__device__ __forceinline__ float mdl_e5m2_to_f32(uint8_t c) {
  if ((c & 0x7fu) >= 0x7cu)
    return (c & 0x7fu) > 0x7cu ? MDL_NAN : __uint_as_float(0x7f800000u | (uint32_t)(c & 0x80u) << 24);
  return mdl_fp8_to_f32(c, 2u, 15u);
}

// Precision fp8 (mdl.h, CAST): x times its tensor's scale, rounded; |x| joins the tensor's amax, kept
// in the arena as the bits of a non-negative float (their order is the floats' order, and a NaN's lie
// above infinity's, so atomicMax keeps a NaN). The plain read first spares the atomic where the amax
// already covers x.
__device__ __forceinline__ float mdl_fp8_note(float x, const float *scale, unsigned *amax) {
  const unsigned bits = __float_as_uint(fabsf(x));
  if (bits > *(volatile unsigned *)amax)
    atomicMax(amax, bits);
  return x * *scale;
}

__device__ __forceinline__ float mdl_cast_e4m3(float x, const float *scale, unsigned *amax) {
  return mdl_e4m3_to_f32(mdl_f32_to_e4m3(mdl_fp8_note(x, scale, amax)));
}

__device__ __forceinline__ float mdl_cast_e5m2(float x, const float *scale, unsigned *amax) {
  return mdl_e5m2_to_f32(mdl_f32_to_e5m2(mdl_fp8_note(x, scale, amax)));
}

