// Reductions over a warp and over a block.

// The larger of a and b where a NaN wins (max reductions, as interp.c).
__device__ __forceinline__ float mdl_max_nan(float a, float b) {
  return (b > a || isnan(b)) ? (isnan(a) ? a : b) : a;
}

// Reductions over the 32 lanes of a warp (butterfly: every lane gets the result) and over a block
// (blockDim.x a multiple of 32; sh is 32 elements of shared memory). Fixed trees: deterministic.
__device__ __forceinline__ double mdl_warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(MDL_FULL, v, o);
  return v;
}

__device__ __forceinline__ float mdl_warp_sumf(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(MDL_FULL, v, o);
  return v;
}

// Max ignoring NaNs (fmaxf), as softmax and cross-entropy take it.
__device__ __forceinline__ float mdl_warp_fmax(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(MDL_FULL, v, o));
  return v;
}

__device__ __forceinline__ float mdl_warp_max_nan(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v = mdl_max_nan(v, __shfl_xor_sync(MDL_FULL, v, o));
  return v;
}

__device__ __forceinline__ double mdl_block_sum(double v, double *sh) {
  v = mdl_warp_sum(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0)
    sh[w] = v;
  __syncthreads();
  return mdl_warp_sum(lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.0);
}

// Two or three block sums at once (sh: 48 doubles, blocks of up to 16 warps), each added by
// mdl_block_sum's tree, so each total is the one it gives alone, for one pair of barriers.
__device__ __forceinline__ void mdl_block_sum3(double &a, double &b, double &c, double *sh, bool three = true) {
  a = mdl_warp_sum(a);
  b = mdl_warp_sum(b);
  if (three)
    c = mdl_warp_sum(c);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sh[w] = a;
    sh[16 + w] = b;
    if (three)
      sh[32 + w] = c;
  }
  __syncthreads();
  const bool in = lane < (int)(blockDim.x >> 5);
  a = mdl_warp_sum(in ? sh[lane] : 0.0);
  b = mdl_warp_sum(in ? sh[16 + lane] : 0.0);
  if (three)
    c = mdl_warp_sum(in ? sh[32 + lane] : 0.0);
}

__device__ __forceinline__ void mdl_block_sum2(double &a, double &b, double *sh) {
  double c = 0;
  mdl_block_sum3(a, b, c, sh, false);
}

__device__ __forceinline__ float mdl_block_fmax(float v, float *sh) {
  v = mdl_warp_fmax(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0)
    sh[w] = v;
  __syncthreads();
  return mdl_warp_fmax(lane < (int)(blockDim.x >> 5) ? sh[lane] : -MDL_INF);
}

__device__ __forceinline__ float mdl_block_max_nan(float v, float *sh) {
  v = mdl_warp_max_nan(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0)
    sh[w] = v;
  __syncthreads();
  return mdl_warp_max_nan(lane < (int)(blockDim.x >> 5) ? sh[lane] : -MDL_INF);
}

