// Types (LP64, as on the Linux hosts NVRTC runs on: long is 64 bits).
typedef long int64_t;
typedef unsigned long uint64_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;

#define MDL_INF __int_as_float(0x7f800000)
#define MDL_NAN __int_as_float(0x7fffffff)
#define MDL_FULL 0xffffffffu
// Threads an SM holds (a kernel that asks for all of them in __launch_bounds__): 2048 on sm_80, sm_90,
// sm_100 and sm_103; 1536 on the others since sm_80 (sm_86, sm_87, sm_89, sm_110, sm_120, ...), as
// ptxas says when asked for more.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000 || \
    __CUDA_ARCH__ == 1030
#define MDL_SM_THREADS 2048
#else
#define MDL_SM_THREADS 1536
#endif
#define MDL_ERR_EMBED_ID 1 // MdlStatus.code: an id outside the embedding table
#define MDL_ERR_TARGET 2   // a cross-entropy target >= the number of classes

// The kernels' arguments (runtime/emit_cuda.h holds the same layouts): the status a bad id or
// target is reported in, and the byte offsets of the buffers a kernel uses.
typedef struct {
  unsigned long long set;
  long long code, value, limit;
} MdlStatus;

typedef struct {
  int64_t b[48];
} MdlArgs;

// A segment of the optimizer's flat buffers: byte offsets of p, g, m, v and of p's bf16 copy (-1:
// none), its length, where it starts in the concatenation of the segments, its weight decay.
typedef struct {
  int64_t p, g, m, v, c, n, start;
  double wd;
} MdlSeg;

// The first report of a step wins; the runtime reads the status after the step.
__device__ void mdl_report(MdlStatus *s, long long code, long long value, long long limit) {
  if (atomicCAS(&s->set, 0ull, 1ull) == 0ull) {
    s->code = code;
    s->value = value;
    s->limit = limit;
  }
}

// Counter-based random numbers, as in mdl.h: splitmix64 of (seed, stream, index).
__device__ __forceinline__ uint64_t mdl_rng_u64(uint64_t seed, uint64_t stream, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull + i * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ double mdl_rng_uniform(uint64_t seed, uint64_t stream, uint64_t i) {
  return (double)(mdl_rng_u64(seed, stream, i) >> 40) / 16777216.0;
}

// Dropout keeps element i when its uniform number is >= p and scales it by 1 / (1 - p).
__device__ __forceinline__ float mdl_dropout(uint64_t seed, uint64_t stream, int64_t i, double p, float x) {
  return mdl_rng_uniform(seed, stream, (uint64_t)i) >= p ? (float)(x / (1.0 - p)) : 0.0f;
}

// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), and its
// derivative, both through s = sigmoid(2u) = 0.5 (1 + tanh(u)) and 1 - tanh(u)^2 = 4 s (1 - s).
__device__ __forceinline__ float mdl_gelu(float x) {
  const float u = 0.797884561f * (x + 0.044715f * x * x * x);
  return x / (1.0f + expf(-2.0f * u));
}

__device__ __forceinline__ float mdl_gelu_grad(float x) {
  const float u = 0.797884561f * (x + 0.044715f * x * x * x), s = 1.0f / (1.0f + expf(-2.0f * u));
  return s + 2.0f * x * s * (1.0f - s) * 0.797884561f * (1.0f + 3.0f * 0.044715f * x * x);
}

// A logit into a thread's part of an online softmax: its largest logit so far m and its sum of
// exp(x - m), rescaled when m grows (a logit of -inf adds 0, and no inf - inf while m is -inf).
__device__ __forceinline__ void mdl_softmax_add(float x, float &m, double &part) {
  if (x > m) {
    part = part * (double)expf(m - x) + 1.0;
    m = x;
  } else if (x != -MDL_INF) {
    part += expf(x - m);
  }
}

// The cross-entropy gradient of a logit x: dloss g times its softmax (inv: 1 / the row's sum of
// exp(x - mx)) less 1 at the target.
__device__ __forceinline__ float mdl_ce_grad(float x, float mx, double g, double inv, bool target) {
  return (float)(g * (expf(x - mx) * inv - (target ? 1.0 : 0.0)));
}

__device__ __forceinline__ float mdl_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float mdl_silu(float x) { return x * mdl_sigmoid(x); }
__device__ __forceinline__ float mdl_clamp(float x, float lo, float hi) { return x < lo ? lo : x > hi ? hi : x; }

__device__ __forceinline__ float mdl_silu_grad(float x, float dy) {
  const float s = mdl_sigmoid(x);
  return dy * s * (1.0f + x * (1.0f - s));
}

// bf16 <-> f32. To bf16: round to nearest, ties to even, on the bits; a NaN stays a quiet NaN.
__device__ __forceinline__ uint16_t mdl_f32_to_bf16(float x) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float mdl_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

// Four or eight consecutive values as f32 in one load (16 bytes; four bf16 values: 8), and their
// stores (to bf16: each rounded). p is aligned to the load's bytes.
__device__ __forceinline__ void mdl_load4(const float *p, float f[4]) {
  const float4 u = *(const float4 *)p;
  f[0] = u.x, f[1] = u.y, f[2] = u.z, f[3] = u.w;
}
__device__ __forceinline__ void mdl_load4(const uint16_t *p, float f[4]) {
  const ushort4 u = *(const ushort4 *)p;
  f[0] = mdl_bf16_to_f32(u.x), f[1] = mdl_bf16_to_f32(u.y);
  f[2] = mdl_bf16_to_f32(u.z), f[3] = mdl_bf16_to_f32(u.w);
}
__device__ __forceinline__ void mdl_load8(const uint16_t *p, float f[8]) {
  const uint4 u = *(const uint4 *)p;
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  for (int k = 0; k < 4; k++)
    f[2 * k] = __uint_as_float(w[k] << 16), f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
}
__device__ __forceinline__ void mdl_store4(float *p, const float f[4]) {
  *(float4 *)p = make_float4(f[0], f[1], f[2], f[3]);
}
__device__ __forceinline__ void mdl_store4(uint16_t *p, const float f[4]) {
  *(ushort4 *)p = make_ushort4(mdl_f32_to_bf16(f[0]), mdl_f32_to_bf16(f[1]), mdl_f32_to_bf16(f[2]),
                               mdl_f32_to_bf16(f[3]));
}
__device__ __forceinline__ void mdl_store8(uint16_t *p, const float f[8]) {
  uint32_t w[4];
  for (int k = 0; k < 4; k++)
    w[k] = (uint32_t)mdl_f32_to_bf16(f[2 * k]) | (uint32_t)mdl_f32_to_bf16(f[2 * k + 1]) << 16;
  *(uint4 *)p = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void mdl_store8(float *p, const float f[8]) {
  mdl_store4(p, f);
  mdl_store4(p + 4, f + 4);
}

// One AdamW update in double, as the interpreter does it: gradient g scaled by the clip factor sc,
// the moments m and v updated in place (rounded to f32), the new parameter returned.
struct MdlAdamW {
  double sc, lr, beta1, beta2, eps, k1, k2;
};
__device__ __forceinline__ float mdl_adamw(const MdlAdamW &h, double wd, float g, float &m, float &v, float p) {
  const double gi = h.sc * g;
  m = (float)(h.beta1 * m + (1 - h.beta1) * gi);
  v = (float)(h.beta2 * v + (1 - h.beta2) * gi * gi);
  return (float)(p - h.lr * (m * h.k1 / (sqrt(v * h.k2) + h.eps) + wd * p));
}

// Two floats rounded to bf16 and packed into one register, lo in the low half (the order of the
// elements of an mma fragment). On the GPU one cvt.rn.bf16x2.f32 (its second source is the low
// half), which rounds as mdl_f32_to_bf16 does but may give a NaN other bits.
__device__ __forceinline__ uint32_t mdl_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (uint32_t)mdl_f32_to_bf16(lo) | (uint32_t)mdl_f32_to_bf16(hi) << 16;
#endif
}

// Tensor cores (sm_80 and later): d += A B for one 16 x 8 tile, A 16 x 16 bf16 (row-major), B 16 x 8
// bf16 (column-major), d f32, computed by the warp together: every lane passes its fragments of A
// and B and gets its four elements of d. With g = lane >> 2 and t = lane & 3, a lane holds (PTX ISA,
// "Matrix Fragments for mma.m16n8k16 with floating point type"; a register holds two bf16, the
// lower column or row in its low half):
//   a[0] = A[g][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]    a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]    b[1] = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t], D[g][2t+1]    d[2], d[3] = D[g+8][2t], D[g+8][2t+1]
// So the accumulators of two adjacent tiles (columns 0-7, then 8-15), rounded and packed in pairs, are
// the A fragment of one k16 step: a[0], a[1] from the first's (d[0], d[1]), (d[2], d[3]); a[2], a[3]
// from the second's. The CUDA emulator (runtime/cuda_emu.h) has its own definition.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void mdl_mma_bf16_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// The 32-bit shared-memory address of a generic pointer into shared memory (ldmatrix, cp.async).
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ uint32_t mdl_smem(const void *p) {
  uint32_t a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
#endif

// Four 8 x 8 tiles of bf16 from shared memory, transposed, by the warp together (ldmatrix .trans):
// lanes 8 i .. 8 i + 7 each give the address of a row of tile i (8 values, 16-byte aligned), and
// r[i] of lane l holds that tile's rows 2 (l & 3) and 2 (l & 3) + 1 of column l >> 2 (the lower
// row in the low half). Of a tile whose rows are keys and columns channels, that is an mma B
// fragment register (b[0] or b[1] above) of the product over keys: one instruction for four
// registers that took four 16-bit loads and three shifts or ors each. mdl_ldsm_x4, the same without
// .trans: r[i] of lane l holds columns 2 (l & 3) and 2 (l & 3) + 1 of row l >> 2 of tile i; of the
// same tile, a B fragment register of the product over channels (Q K^T): b[0] or b[1] of key g.
// The emulator has its own.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void mdl_ldsm_x4_t(uint32_t r[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mdl_smem(p)) : "memory");
}
__device__ __forceinline__ void mdl_ldsm_x4(uint32_t r[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mdl_smem(p)) : "memory");
}
#endif

// Copies from global to shared memory that do not wait (cp.async, sm_80): 16 or 4 bytes from src to
// dst (both aligned to their size), or zeros unless in (src must still be a valid address). The
// thread's copies since the last mdl_cp_async_commit form a group; mdl_cp_async_wait<n> waits until
// at most the n latest groups are in flight. Other threads see the bytes after a barrier that
// follows the wait. The emulator has its own.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void mdl_cp_async16(void *dst, const void *src, bool in) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(mdl_smem(dst)), "l"(src), "r"(in ? 16 : 0) : "memory");
}
__device__ __forceinline__ void mdl_cp_async4(void *dst, const void *src, bool in) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
               :: "r"(mdl_smem(dst)), "l"(src), "r"(in ? 4 : 0) : "memory");
}
__device__ __forceinline__ void mdl_cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void mdl_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
#endif

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
