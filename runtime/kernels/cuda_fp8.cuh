
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

