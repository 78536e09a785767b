
// fp8 <-> f32 on the host, bit for bit the device's (cuda_fp8.cuh): the two OCP formats of Hopper's
// tensor cores, E4M3 (bias 7, no infinity, S.1111.111 is NaN, largest 448) and E5M2 (bias 15,
// IEEE-like, largest 57344). To fp8: round to nearest, ties to even, subnormals exact, -0 kept;
// beyond the largest finite value (infinity too) saturate to it with the sign (PTX's
// cvt.rn.satfinite, cuBLASLt's and __NV_SATFINITE's rule); every NaN becomes 0x7f. The widenings are
// exact. The C back end's modules that hold fp8 values start with it, and the reference interpreter
// includes it, so the three back ends round alike.
static inline uint32_t mdl_fp8_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

static inline float mdl_fp8_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

// |x| is clamped to the largest value (bits max), then rounded on the bits (normal) or as an integer
// multiple of the smallest subnormal.
static inline uint8_t mdl_f32_to_fp8(float x, uint32_t man, uint32_t bias, uint32_t max) {
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

static inline uint8_t mdl_f32_to_e4m3(float x) { return mdl_f32_to_fp8(x, 3u, 7u, 0x43e00000u); }
static inline uint8_t mdl_f32_to_e5m2(float x) { return mdl_f32_to_fp8(x, 2u, 15u, 0x47600000u); }

// A finite fp8 code widened: normal values by their bits, subnormals as m times the smallest one.
static inline float mdl_fp8_to_f32(uint8_t c, uint32_t man, uint32_t bias) {
  const uint32_t e = (c & 0x7fu) >> man, m = c & ((1u << man) - 1u);
  const float v = e ? mdl_fp8_float((e + 127u - bias) << 23 | m << (23u - man))
                    : (float)m * mdl_fp8_float((128u - bias - man) << 23);
  return mdl_fp8_float(mdl_fp8_bits(v) | (uint32_t)(c & 0x80u) << 24);
}

static inline float mdl_e4m3_to_f32(uint8_t c) {
  return (c & 0x7fu) == 0x7fu ? mdl_fp8_float(0x7fffffffu) : mdl_fp8_to_f32(c, 3u, 7u);
}

static inline float mdl_e5m2_to_f32(uint8_t c) {
  if ((c & 0x7fu) >= 0x7cu)
    return (c & 0x7fu) > 0x7cu ? mdl_fp8_float(0x7fffffffu) : mdl_fp8_float(0x7f800000u | (uint32_t)(c & 0x80u) << 24);
  return mdl_fp8_to_f32(c, 2u, 15u);
}
