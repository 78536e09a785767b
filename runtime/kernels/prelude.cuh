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

// A segment of the optimizer's flat buffers: byte offsets of p, g, m, v (0 where the rule keeps
// fewer moments) and of p's bf16 copy (-1: none), its length, where it starts in the concatenation of
// the segments, its weight decay and its multiplier of lr (lr_scale).
typedef struct {
  int64_t p, g, m, v, c, n, start;
  double wd, ls;
} MdlSeg;

// ZeRO stage 1 (--zero 1): the optimizer updates only the parameters at arena bytes [mdl_own[0],
// mdl_own[1]), every one while mdl_own[1] is 0; the runtime sets it (cuModuleGetGlobal).
extern "C" {
__device__ int64_t mdl_own[2];
}

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

// One parameter element's update in double, as the interpreter does it (compiler/interp.c has the
// rules), by RULE (OptRule: 0 AdamW, 1 SGD, 2 Lion, 3 Muon) keeping NST moments: gradient g scaled by
// the clip factor sc, the moments updated in place (rounded to f32), the new parameter returned; lr
// is h.lr times the segment's lr_scale. SGD reads beta1 as its momentum and beta2 != 0 as Nesterov's;
// Muon beta1 as its momentum, and v is its orthogonalised update (read, not written).
struct MdlAdamW {
  double sc, lr, beta1, beta2, eps, k1, k2;
};
template <int RULE, int NST>
__device__ __forceinline__ float mdl_opt_rule(const MdlAdamW &h, double wd, double lr, float g, float &m, float &v,
                                              float p) {
  const double gi = h.sc * g;
  if constexpr (RULE == 1) { // SGD (torch.optim.SGD, dampening 0): the decay joins the gradient
    double d = gi + wd * p;
    if constexpr (NST > 0) {
      m = (float)(h.beta1 * m + d);
      d = h.beta2 != 0 ? d + h.beta1 * m : (double)m;
    }
    return (float)(p - lr * d);
  } else if constexpr (RULE == 3) { // Muon: the momentum; the update v was orthogonalised before
    m = (float)(h.beta1 * m + (1 - h.beta1) * gi);
    return (float)(p - lr * ((double)v + wd * p));
  } else if constexpr (RULE == 2) { // Lion: the sign of an interpolation, then the momentum's update
    const double u = h.beta1 * m + (1 - h.beta1) * gi;
    m = (float)(h.beta2 * m + (1 - h.beta2) * gi);
    return (float)(p - lr * ((double)((u > 0) - (u < 0)) + wd * p));
  } else {
    m = (float)(h.beta1 * m + (1 - h.beta1) * gi);
    v = (float)(h.beta2 * v + (1 - h.beta2) * gi * gi);
    return (float)(p - lr * (m * h.k1 / (sqrt(v * h.k2) + h.eps) + wd * p));
  }
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

//
// Tensor-core attention, FlashAttention-2 style: the forward, and the backward's dq and dk, dv, as
// templates that compiler/emit_cuda_attn.c instantiates with the shapes it chose (its kernels are
// wrappers that pass their buffers). Every row's sums are taken in the same order over the same tiles
// at either block size, so the two variants of a kernel give the same values to the bit.
//

#define MDL_ATT_TILE 64 // rows of the tiles a block stages in turn (keys and values, or queries and dout)
#define MDL_LOG2E 1.442695f // log2(e): these kernels exponentiate in base 2
#define MDL_LN2 0.6931472f  // 1 / log2(e)

// A kernel's shape: NB batches of T query rows, H heads of D channels (a multiple of 16) in rows of C
// elements of the outputs; a block of WARPS warps per (batch, head, tile of 16 WARPS rows); CAUSAL;
// DOC: within documents; STAGES: buffers of the staged tiles (2: the next tile's copies run while
// the warps compute on this one); I: the index type (int where every index fits). KH: the heads of
// k and v (each shared by G = H / KH query heads: query head h reads kv head h / G; dk and dv are
// rows of KH D), TK: their rows (keys), W: the window (0: none; causal: row i sees keys i - W < j).
template <typename I_, int NB_, long T_, int H_, int D_, long C_, int WARPS_, bool CAUSAL_, bool DOC_, int STAGES_,
          int KH_ = H_, long TK_ = T_, long W_ = 0>
struct mdl_att_shape {
  typedef I_ I;
  static constexpr int NB = NB_, H = H_, D = D_, WARPS = WARPS_, ROWS = 16 * WARPS_, STAGES = STAGES_;
  static constexpr int KH = KH_, G = H_ / KH_;
  static constexpr I T = T_, C = C_, TK = TK_, W = W_;
  static constexpr bool CAUSAL = CAUSAL_, DOC = DOC_;
  static constexpr int PAIRS = D_ / 2 + 4; // a staged row: bf16 pairs, padded by 8 (no bank conflicts)
  static constexpr int NTILES = D_ / 8;     // n8 tiles of the channels
  static constexpr int TILES = (int)((T_ + 16 * WARPS_ - 1) / (16 * WARPS_));
  static constexpr int KTILES = (int)((TK_ + 16 * WARPS_ - 1) / (16 * WARPS_)); // of the keys
};

// Rows of q, k, v or dout: channel c of row t of head hd of batch b is p[(b LEN + t) STRIDE + hd D + c]
// (LEN 0: the shape's T; k and v of another length give theirs); E is float or uint16_t (bf16 as
// stored); ASYNC: copied to shared memory as they are by cp.async (bf16, rows 16-byte aligned), else 4
// channels at a time (float4 or ushort4 loads).
template <typename E, long STRIDE, bool ASYNC, long LEN = 0> struct mdl_att_rows {
  typedef E elem;
  static constexpr long stride = STRIDE, len = LEN;
  static constexpr bool async = ASYNC;
  const E *p;
};

// The rows per batch of rows X in a kernel of shape S.
template <class S, class X> __device__ __forceinline__ constexpr typename S::I mdl_att_len() {
  return X::len ? (typename S::I)X::len : S::T;
}

// Where the forward's output goes: f32 rows (F32) and NCAST copies rounded to bf16, rows of C.
template <bool F32, int NCAST> struct mdl_att_out {
  static constexpr bool f32_rows = F32;
  static constexpr int ncast = NCAST;
  float *f32;
  uint16_t *bf16[NCAST ? NCAST : 1];
};

template <class S, class X>
__device__ __forceinline__ typename S::I mdl_att_ix(typename S::I b, typename S::I t, typename S::I hd, int c) {
  return (b * mdl_att_len<S, X>() + t) * (typename S::I)X::stride + hd * S::D + c;
}

// Channels c and c + 1 of row t as one register of two bf16 values (c in the low half): the two
// stored halves, or rounded from f32.
template <class S, class X>
__device__ __forceinline__ uint32_t mdl_att_pair(const X &x, typename S::I b, typename S::I t, typename S::I hd,
                                                 int c) {
  if constexpr (sizeof(typename X::elem) == 2)
    return (uint32_t)x.p[mdl_att_ix<S, X>(b, t, hd, c)] | (uint32_t)x.p[mdl_att_ix<S, X>(b, t, hd, c + 1)] << 16;
  else
    return mdl_bf16x2(x.p[mdl_att_ix<S, X>(b, t, hd, c)], x.p[mdl_att_ix<S, X>(b, t, hd, c + 1)]);
}

// The block's batch b, head hd and first row (of tiles of ROWS, S::TILES of them; with KV, a kv head
// and S::KTILES tiles of keys), with the tile slowest across blocks: blocks start in index order, so
// the tiles of most work start first and the last to start are the lightest. Under causality that is
// the last query tiles (from_end: their rows see the most keys) or the first key tiles (seen by the
// most queries). (On GPT-2's 1024 rows, a greedy schedule of the causal forward's blocks on an H200's
// 264 slots ends 38% after the mean load of a slot with the tiles fastest, 7% with them slowest and
// the heaviest first.)
template <class S, bool FROM_END, bool KV = false>
__device__ __forceinline__ void mdl_att_block(typename S::I &b, typename S::I &hd, typename S::I &first) {
  typedef typename S::I I;
  constexpr int NH = KV ? S::KH : S::H, TILES = KV ? S::KTILES : S::TILES;
  const I bh = blockIdx.x % (S::NB * NH);
  b = bh / NH;
  hd = bh % NH;
  if constexpr (FROM_END && S::CAUSAL && TILES > 1)
    first = (TILES - 1 - blockIdx.x / (S::NB * NH)) * S::ROWS;
  else
    first = blockIdx.x / (S::NB * NH) * S::ROWS;
}

// The A fragments of the k16 steps over the channels of rows r0 and r1 = r0 + 8 of x, as bf16 (rounded
// once); 0 beyond x's rows.
template <class S, class X>
__device__ __forceinline__ void mdl_att_frags(uint32_t (&a)[S::D / 16][4], const X &x, typename S::I b,
                                              typename S::I hd, typename S::I r0, typename S::I r1, int tq) {
#pragma unroll
  for (int k = 0; k < S::D / 16; k++) {
    const int c = 16 * k + 2 * tq;
    a[k][0] = r0 < mdl_att_len<S, X>() ? mdl_att_pair<S>(x, b, r0, hd, c) : 0u;
    a[k][1] = r1 < mdl_att_len<S, X>() ? mdl_att_pair<S>(x, b, r1, hd, c) : 0u;
    a[k][2] = r0 < mdl_att_len<S, X>() ? mdl_att_pair<S>(x, b, r0, hd, c + 8) : 0u;
    a[k][3] = r1 < mdl_att_len<S, X>() ? mdl_att_pair<S>(x, b, r1, hd, c + 8) : 0u;
  }
}

// One row's share of mdl_att_stage for the thread's (jj, c): the 8 channels from c by cp.async
// (beyond T the copy reads nothing, from row x0, and fills zeros), or 4 by a load and a store.
template <class S, class X>
__device__ __forceinline__ void mdl_att_stage_row(const X &x, uint32_t (*sh)[MDL_ATT_TILE][S::PAIRS],
                                                  typename S::I buf, typename S::I b, typename S::I hd,
                                                  typename S::I x0, int jj, int c, bool in) {
  if constexpr (X::async) {
    mdl_cp_async16(&sh[buf][jj][c / 2], &x.p[mdl_att_ix<S, X>(b, in ? x0 + jj : x0, hd, c)], in);
  } else if constexpr (sizeof(typename X::elem) == 2) { // four bf16 values: the two pairs as they are
    const ushort4 v = in ? *(const ushort4 *)&x.p[mdl_att_ix<S, X>(b, x0 + jj, hd, c)] : make_ushort4(0, 0, 0, 0);
    sh[buf][jj][c / 2] = (uint32_t)v.x | (uint32_t)v.y << 16;
    sh[buf][jj][c / 2 + 1] = (uint32_t)v.z | (uint32_t)v.w << 16;
  } else {
    const float4 v = in ? *(const float4 *)&x.p[mdl_att_ix<S, X>(b, x0 + jj, hd, c)]
                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    sh[buf][jj][c / 2] = mdl_bf16x2(v.x, v.y);
    sh[buf][jj][c / 2 + 1] = mdl_bf16x2(v.z, v.w);
  }
}

// Starts staging rows x0 + jj (jj < 64) of x and y, as bf16 channel pairs, into the shared tiles xs
// and ys, by the block's threads; 0 beyond their rows (x's and y's alike). Rows that go by cp.async
// need the caller's commit and wait; the others (f32 rows, rounded here, or bf16 rows not 16-byte
// aligned) are done on return.
template <class S, class X, class Y>
__device__ __forceinline__ void mdl_att_stage(const X &x, uint32_t (*xs)[MDL_ATT_TILE][S::PAIRS], const Y &y,
                                              uint32_t (*ys)[MDL_ATT_TILE][S::PAIRS], typename S::I buf,
                                              typename S::I b, typename S::I hd, typename S::I x0) {
  constexpr int PX = X::async ? 8 : 4, PY = Y::async ? 8 : 4; // channels at a time
  for (int u = threadIdx.x; u < MDL_ATT_TILE * S::D / PX; u += 32 * S::WARPS) {
    const int jj = u / (S::D / PX), c = u % (S::D / PX) * PX;
    const bool in = x0 + jj < mdl_att_len<S, X>();
    mdl_att_stage_row<S>(x, xs, buf, b, hd, x0, jj, c, in);
    if constexpr (PX == PY) // one loop for both
      mdl_att_stage_row<S>(y, ys, buf, b, hd, x0, jj, c, in);
  }
  if constexpr (PX != PY)
    for (int u = threadIdx.x; u < MDL_ATT_TILE * S::D / PY; u += 32 * S::WARPS) {
      const int jj = u / (S::D / PY), c = u % (S::D / PY) * PY;
      const bool in = x0 + jj < mdl_att_len<S, X>();
      mdl_att_stage_row<S>(y, ys, buf, b, hd, x0, jj, c, in);
    }
}

// Starts staging a per-row value of the tile's rows x0 + jj into dst[jj] (by thread jj < 64) from
// src[base + the row] by cp.async of 4 bytes: 0 beyond T (where the copy reads nothing, from row x0).
template <class S, class E>
__device__ __forceinline__ void mdl_att_stage_val(E (*dst)[MDL_ATT_TILE], typename S::I buf, const E *src,
                                                  typename S::I base, typename S::I x0) {
  typedef typename S::I I;
  const I i = x0 + threadIdx.x, at = i < S::T ? i : x0;
  mdl_cp_async4(&dst[buf][threadIdx.x], &src[base + at], i < S::T);
}

// Within documents, the warp's 16 rows (documents d0, d1 of each lane) against the staged tile's 64
// (documents td[]): when the rows are all of one document, a tile with none of its rows in it has
// nothing for them (none) and one with all of them in it needs no document mask (one), by three votes
// of the warp in place of a comparison per score. Any documents are allowed, in any order; packed
// sequences make most tiles one or the other. Without documents, none is false and one true.
#define MDL_ATT_DOCS(S, td, d0, d1, lane)                                                                      \
  static_assert(MDL_ATT_TILE == 64, "a tile's documents are read two a lane");                                \
  const int32_t dw = S::DOC ? __shfl_sync(MDL_FULL, d0, 0) : 0, dt0 = S::DOC ? (td)[lane] : 0,               \
                dt1 = S::DOC ? (td)[lane + 32] : 0;                                                           \
  const bool rows1 = S::DOC && __all_sync(MDL_FULL, d0 == dw && d1 == dw);                                    \
  const bool none = rows1 && __all_sync(MDL_FULL, dt0 != dw && dt1 != dw);                                    \
  const bool one = !S::DOC || (rows1 && __all_sync(MDL_FULL, dt0 == dw && dt1 == dw))

// The two products of a tile with the warp's rows by mma: s = X Y^T and, with DP, dp = Z W^T over the
// channels; X, Z as A fragments xa, za; Y, W the shared tiles ys, ws; tile n of s, dp: columns 8 n ..
// 8 n + 7 of the tile. s is unscaled: the kernels take exp2f of s times scale log2(e) less a maximum
// or log-sum-exp in base 2 (mdl_att_exp), one FMA, cheaper than expf of a scaled s less the maximum.
// The B fragments of step k of tiles n and n + 1 come by one ldmatrix: lanes 0-7 give rows 8 n ..
// 8 n + 7 at channel 16 k, lanes 8-15 the same rows at 16 k + 8, lanes 16-31 rows 8 n + 8 ...
template <class S, bool DP>
__device__ __forceinline__ void mdl_att_scores(float (&s)[MDL_ATT_TILE / 8][4], float (&dp)[MDL_ATT_TILE / 8][4],
                                               const uint32_t (&xa)[S::D / 16][4], const uint32_t (*ys)[S::PAIRS],
                                               const uint32_t (&za)[S::D / 16][4], const uint32_t (*ws)[S::PAIRS],
                                               int lane) {
#pragma unroll
  for (int n = 0; n < MDL_ATT_TILE / 8; n++) {
    s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    if constexpr (DP)
      dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
  }
#pragma unroll
  for (int n = 0; n < MDL_ATT_TILE / 8; n += 2) {
#pragma unroll
    for (int k = 0; k < S::D / 16; k++) {
      uint32_t yb[4];
      mdl_ldsm_x4(yb, (const uint16_t *)ys[8 * n + (lane & 7) + (lane >> 4) * 8] + 16 * k + (lane >> 3 & 1) * 8);
      mdl_mma_bf16_16816(s[n], xa[k], yb);
      mdl_mma_bf16_16816(s[n + 1], xa[k], yb + 2);
      if constexpr (DP) {
        uint32_t wb[4];
        mdl_ldsm_x4(wb, (const uint16_t *)ws[8 * n + (lane & 7) + (lane >> 4) * 8] + 16 * k + (lane >> 3 & 1) * 8);
        mdl_mma_bf16_16816(dp[n], za[k], wb);
        mdl_mma_bf16_16816(dp[n + 1], za[k], wb + 2);
      }
    }
  }
}

// The B fragments of step k of a product over the rows of the shared tile xs (keys or queries) for
// output tiles n and n + 1 (channels 8 n .. 8 n + 15), by one transposing ldmatrix: r[0], r[1] of tile
// n (rows 16 k + 2 tq, + 1 and 8 further of channel 8 n + g), r[2], r[3] of tile n + 1.
template <class S>
__device__ __forceinline__ void mdl_att_ldsm_t(uint32_t r[4], const uint32_t (*xs)[S::PAIRS], int k, int n, int lane) {
  mdl_ldsm_x4_t(r, (const uint16_t *)xs[16 * k + (lane & 15)] + 8 * n + (lane >> 4) * 8);
}

// exp2(s scale log2(e) - z) for an unscaled score s and z (a maximum or log-sum-exp) in base 2:
// e^(scale s) over e^z', the product and the difference in one FMA (sl2e: scale log2(e)).
__device__ __forceinline__ float mdl_att_exp(float s, float sl2e, float z) { return exp2f(fmaf(s, sl2e, -z)); }

// Whether a query i may see key j (documents di, dj): j below TK, not later than i (causal), within
// the window (W), in the same document (DOC). (Terms of an `&&` to write in the condition of an `if`,
// not a function returning bool: the compiler branches on the terms as they are.)
#define MDL_ATT_ALLOWED(S, i, j, dj, di)                                                                       \
  (j) < S::TK && (!S::CAUSAL || (j) <= (i)) && (!S::W || (i) - (j) < S::W) && (!S::DOC || (dj) == (di))

// The start of each pass of the loop over the staged tiles x0 = start, start + 64, .. < end: the tile
// staged (by issue(x0, buffer)) into buffer `cur` of S::STAGES and in shared memory for every warp when
// this returns. With two, tile 0's copies start before the loop (mdl_att_tiles_begin) and each tile
// starts the next one's into the other buffer before it waits for its own: the copies run while the
// warps compute. With one, cur stays 0.
template <class S, class F> __device__ __forceinline__ void mdl_att_tiles_begin(const F &issue, typename S::I start) {
  if constexpr (S::STAGES == 2) {
    issue(start, 0);
    mdl_cp_async_commit();
  }
}
template <class S, class F>
__device__ __forceinline__ void mdl_att_tile(const F &issue, typename S::I x0, typename S::I end, typename S::I cur) {
  if constexpr (S::STAGES == 2) {
    __syncthreads(); // (every warp is done with the other buffer: the tile before)
    if (x0 + MDL_ATT_TILE < end)
      issue(x0 + MDL_ATT_TILE, cur ^ 1);
    mdl_cp_async_commit();
    mdl_cp_async_wait<1>(); // this tile's copies have landed; the next tile's may be in flight
  } else {
    __syncthreads();
    issue(x0, cur);
    mdl_cp_async_commit();
    mdl_cp_async_wait<0>();
  }
  __syncthreads();
}

// The documents d0, d1 of the lane's rows r0 and r1 (0 beyond T, and without documents).
template <class S>
__device__ __forceinline__ void mdl_att_row_docs(const int32_t *doc, typename S::I b, typename S::I r0,
                                                 typename S::I r1, int32_t &d0, int32_t &d1) {
  if constexpr (S::DOC) {
    d0 = r0 < S::T ? doc[b * S::T + r0] : 0;
    d1 = r1 < S::T ? doc[b * S::T + r1] : 0;
  }
}

// The tiles of keys (and values) a block by query tile stages: the issue of mdl_att_tile.
template <class S, class K, class V> struct mdl_att_kv_issue {
  typedef typename S::I I;
  const K &k;
  const V &v;
  const int32_t *doc;
  uint32_t (*ks)[MDL_ATT_TILE][S::PAIRS];
  uint32_t (*vs)[MDL_ATT_TILE][S::PAIRS];
  int32_t (*dk)[MDL_ATT_TILE];
  I b, hd;
  __device__ __forceinline__ void operator()(I x0, I buf) const {
    mdl_att_stage<S>(k, ks, v, vs, buf, b, hd, x0);
    if constexpr (S::DOC)
      if (threadIdx.x < MDL_ATT_TILE)
        mdl_att_stage_val<S>(dk, buf, doc, b * S::T, x0);
  }
};

// Keys the query rows r0, r1 may not see get -inf in the scores s of the tile from k0: past TK, past
// the row (causal), before its window, in other documents (dk: the tile's).
template <class S>
__device__ __forceinline__ void mdl_att_mask_keys(float (&s)[MDL_ATT_TILE / 8][4], typename S::I k0, typename S::I r0,
                                                  typename S::I r1, const int32_t *dk, int32_t d0, int32_t d1, int tq) {
  typedef typename S::I I;
#pragma unroll
  for (int n = 0; n < MDL_ATT_TILE / 8; n++) {
#pragma unroll
    for (int x = 0; x < 4; x++) {
      const I i = x < 2 ? r0 : r1, j = k0 + 8 * n + 2 * tq + (x & 1);
      if (!(MDL_ATT_ALLOWED(S, i, j, dk[j - k0], x < 2 ? d0 : d1)))
        s[n][x] = -MDL_INF;
    }
  }
}

// Causal, where a block holds more rows than a staged tile, a tile can be wholly masked for some of
// the warps, and within documents for any warp: those skip its products (its terms would be exact
// zeros: the sums are the same) and wait at the next tile's barrier. (One test for both: a second
// `continue` cost the forward a 20-byte spill on sm_90.) The kernels by query tile test this with
// MDL_ATT_SKIP_KEYS and mask the keys where MDL_ATT_EDGE_KEYS says some rows may not see some.
// With a window a tile also is wholly masked for a warp whose first row's window starts after it, and
// needs the mask where its first key may lie before the window of the warp's last row.
#define MDL_ATT_SKIP_KEYS(S, k0, q0, w)                                                                        \
  ((S::CAUSAL && S::ROWS > MDL_ATT_TILE && (k0) > (q0) + 16 * (w) + 15) ||                                     \
   (S::W && (k0) + MDL_ATT_TILE - 1 + S::W <= (q0) + 16 * (w)) || none)
#define MDL_ATT_EDGE_KEYS(S, k0, q0, w)                                                                        \
  (!one || (k0) + MDL_ATT_TILE > S::TK || (S::CAUSAL && (k0) + MDL_ATT_TILE - 1 > (q0) + 16 * (w)) ||          \
   (S::W && (k0) + S::W <= (q0) + 16 * (w) + 15))

// The first and the end of the keys a block by query tile from q0 stages: causal, none after its last
// row; with a window, none before the window of its first row (from a tile boundary, as without).
template <class S> __device__ __forceinline__ typename S::I mdl_att_kstart(typename S::I q0) {
  if constexpr (S::W > 0)
    return q0 + 1 > S::W ? (q0 + 1 - S::W) / MDL_ATT_TILE * MDL_ATT_TILE : 0;
  else
    return 0;
}
template <class S> __device__ __forceinline__ typename S::I mdl_att_kend(typename S::I q0) {
  return S::CAUSAL ? (q0 + S::ROWS < S::T ? q0 + S::ROWS : S::T) : S::TK; // later keys: masked for all
}

// The forward: a block of WARPS warps per (batch, head, 16 WARPS queries), 16 query rows per warp with
// their Q in registers as mma A fragments (rounded to bf16 once); keys and values staged in shared tiles
// of 64, rounded to bf16, each read by every warp; S = Q K^T by mma, scaled and masked; the online
// softmax of each row over the quad of lanes that holds it; e = exp(S - m) summed unrounded into l
// and, rounded, reused as the A fragments of O += P V (the accumulators of two adjacent n8 tiles of S
// are one k16 step); out = O / l in f32, and with LSE the rows' log-sum-exp. sl2e: scale log2(e).
template <class S, bool LSE, class Q, class K, class V, class O>
__device__ __forceinline__ void mdl_att_fwd(const Q &q, const K &k, const V &v, const int32_t *doc, float *lse,
                                            const O &out, float sl2e) {
  typedef typename S::I I;
  __shared__ __align__(16) uint32_t Ks[S::STAGES][MDL_ATT_TILE][S::PAIRS], Vs[S::STAGES][MDL_ATT_TILE][S::PAIRS];
  __shared__ int32_t Dk[S::STAGES][MDL_ATT_TILE];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  I b, hd, q0;
  mdl_att_block<S, true>(b, hd, q0);
  // The lane's query rows: r0 (accumulators 0 and 1 of a tile) and r1 (2 and 3).
  const I r0 = q0 + 16 * w + g, r1 = r0 + 8;
  uint32_t qa[S::D / 16][4];
  mdl_att_frags<S>(qa, q, b, hd, r0, r1, tq);
  int32_t d0 = 0, d1 = 0;
  mdl_att_row_docs<S>(doc, b, r0, r1, d0, d1);
  // Per row: the running maximum m and this lane's part of the sum l; acc[n]: the output's channels
  // 8 n .. 8 n + 7 (accumulators).
  float m0 = -MDL_INF, m1 = -MDL_INF, l0 = 0.0f, l1 = 0.0f, acc[S::NTILES][4];
#pragma unroll
  for (int n = 0; n < S::NTILES; n++)
    acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const I kstart = mdl_att_kstart<S>(q0), kend = mdl_att_kend<S>(q0);
  const mdl_att_kv_issue<S, K, V> issue = {k, v, doc, Ks, Vs, Dk, b, hd / S::G};
  mdl_att_tiles_begin<S>(issue, kstart);
  for (I k0 = kstart, cur = 0; k0 < kend; k0 += MDL_ATT_TILE, cur ^= S::STAGES - 1) {
    mdl_att_tile<S>(issue, k0, kend, cur);
    MDL_ATT_DOCS(S, Dk[cur], d0, d1, lane);
    if (MDL_ATT_SKIP_KEYS(S, k0, q0, w))
      continue; // the warp's rows see none of the tile's keys
    // S = Q K^T (unscaled): tile n holds keys k0 + 8 n .. k0 + 8 n + 7; -inf where the row may not see
    // the key.
    float s[MDL_ATT_TILE / 8][4], dp[MDL_ATT_TILE / 8][4];
    mdl_att_scores<S, false>(s, dp, qa, Ks[cur], qa, Vs[cur], lane);
    if (MDL_ATT_EDGE_KEYS(S, k0, q0, w))
      mdl_att_mask_keys<S>(s, k0, r0, r1, Dk[cur], d0, d1, tq);
    // The rows' maxima over the tile: the lane's, then its quad's (lanes 4 g .. 4 g + 3 share r0).
    float x0 = -MDL_INF, x1 = -MDL_INF;
#pragma unroll
    for (int n = 0; n < MDL_ATT_TILE / 8; n++) {
      x0 = fmaxf(x0, fmaxf(s[n][0], s[n][1]));
      x1 = fmaxf(x1, fmaxf(s[n][2], s[n][3]));
    }
    x0 = fmaxf(x0, __shfl_xor_sync(MDL_FULL, x0, 1));
    x0 = fmaxf(x0, __shfl_xor_sync(MDL_FULL, x0, 2));
    x1 = fmaxf(x1, __shfl_xor_sync(MDL_FULL, x1, 1));
    x1 = fmaxf(x1, __shfl_xor_sync(MDL_FULL, x1, 2));
    // The new maxima (scaled: see s); a row that has seen no key yet subtracts 0, not -inf (its e are
    // 0). What earlier tiles summed is rescaled by exp(m - m_new).
    const float mn0 = fmaxf(m0, x0 * sl2e), mn1 = fmaxf(m1, x1 * sl2e);
    const float z0 = mn0 == -MDL_INF ? 0.0f : mn0, z1 = mn1 == -MDL_INF ? 0.0f : mn1;
    const float c0 = exp2f(m0 - z0), c1 = exp2f(m1 - z1);
    m0 = mn0;
    m1 = mn1;
    l0 *= c0;
    l1 *= c1;
    // (where no row of the warp has a new maximum every factor is exactly 1)
    if (__any_sync(MDL_FULL, c0 != 1.0f || c1 != 1.0f)) {
#pragma unroll
      for (int n = 0; n < S::NTILES; n++) {
        acc[n][0] *= c0;
        acc[n][1] *= c0;
        acc[n][2] *= c1;
        acc[n][3] *= c1;
      }
    }
    // e = exp(S - m) goes into l as it is; rounded to bf16, tiles 2 k and 2 k + 1 of S are the A
    // fragment of step k of O += P V, whose B fragment is keys 16 k + 2 tq, + 1 and 8 further of
    // channel 8 n + g.
#pragma unroll
    for (int k = 0; k < MDL_ATT_TILE / 16; k++) {
      uint32_t pa[4];
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const float(&sv)[4] = s[2 * k + h];
        const float e0 = mdl_att_exp(sv[0], sl2e, z0), e1 = mdl_att_exp(sv[1], sl2e, z0);
        const float e2 = mdl_att_exp(sv[2], sl2e, z1), e3 = mdl_att_exp(sv[3], sl2e, z1);
        l0 += e0 + e1;
        l1 += e2 + e3;
        pa[2 * h] = mdl_bf16x2(e0, e1);
        pa[2 * h + 1] = mdl_bf16x2(e2, e3);
      }
#pragma unroll
      for (int n = 0; n < S::NTILES; n += 2) {
        uint32_t vb[4];
        mdl_att_ldsm_t<S>(vb, Vs[cur], k, n, lane);
        mdl_mma_bf16_16816(acc[n], pa, vb);
        mdl_mma_bf16_16816(acc[n + 1], pa, vb + 2);
      }
    }
  }
  // l: the sum of the quad's four parts; out = O / l (O: acc).
  l0 += __shfl_xor_sync(MDL_FULL, l0, 1);
  l0 += __shfl_xor_sync(MDL_FULL, l0, 2);
  l1 += __shfl_xor_sync(MDL_FULL, l1, 1);
  l1 += __shfl_xor_sync(MDL_FULL, l1, 2);
  if constexpr (LSE) { // the rows' log-sum-exp, which the backward reads (lane tq = 0 writes its rows'), in base e
    if (tq == 0 && r0 < S::T)
      lse[(b * S::H + hd) * S::T + r0] = (m0 + log2f(l0)) * MDL_LN2;
    if (tq == 0 && r1 < S::T)
      lse[(b * S::H + hd) * S::T + r1] = (m1 + log2f(l1)) * MDL_LN2;
  }
#pragma unroll
  for (int n = 0; n < S::NTILES; n++) {
    const int c = 8 * n + 2 * tq;
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const I row = r ? r1 : r0;
      if (row < S::T) {
        const float y0 = acc[n][2 * r] / (r ? l1 : l0), y1 = acc[n][2 * r + 1] / (r ? l1 : l0);
        const I ix = (b * S::T + row) * S::C + hd * S::D + c;
        if constexpr (O::f32_rows)
          *(float2 *)&out.f32[ix] = make_float2(y0, y1);
#pragma unroll
        for (int x = 0; x < O::ncast; x++)
          *(ushort2 *)&out.bf16[x][ix] = make_ushort2(mdl_f32_to_bf16(y0), mdl_f32_to_bf16(y1));
      }
    }
  }
}

// The backward's dq, by query tile: a block of WARPS warps per (batch, head, 16 WARPS queries), 16
// query rows per warp with Q and dout as mma A fragments (bf16); keys and values staged in shared tiles
// of 64 as bf16; S = Q K^T and dP = dout V^T by mma, P = exp(S - lse), dS = P (dP - D) in f32 (lse:
// the rows' log-sum-exp, dsum: D = dout . out per row); rounded, the dS accumulators of two adjacent
// n8 tiles are the A fragment of one k16 step of dq += dS K; dq = scale dq.
template <class S, class Q, class K, class V, class DO>
__device__ __forceinline__ void mdl_att_dq(const Q &q, const K &k, const V &v, const DO &dout, const int32_t *doc,
                                           const float *lse, const float *dsum, float *dq, float sl2e, float scale) {
  typedef typename S::I I;
  __shared__ __align__(16) uint32_t Ks[S::STAGES][MDL_ATT_TILE][S::PAIRS], Vs[S::STAGES][MDL_ATT_TILE][S::PAIRS];
  __shared__ int32_t Dk[S::STAGES][MDL_ATT_TILE];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  I b, hd, q0;
  mdl_att_block<S, true>(b, hd, q0);
  // The lane's query rows: r0 (accumulators 0 and 1 of a tile) and r1 (2 and 3).
  const I r0 = q0 + 16 * w + g, r1 = r0 + 8;
  uint32_t qa[S::D / 16][4], oa[S::D / 16][4];
  mdl_att_frags<S>(qa, q, b, hd, r0, r1, tq);
  mdl_att_frags<S>(oa, dout, b, hd, r0, r1, tq);
  int32_t d0 = 0, d1 = 0;
  mdl_att_row_docs<S>(doc, b, r0, r1, d0, d1);
  // The rows' log-sum-exp in base 2 (as s), and D.
  const float l0 = r0 < S::T ? lse[(b * S::H + hd) * S::T + r0] * MDL_LOG2E : 0.0f,
              s0 = r0 < S::T ? dsum[(b * S::H + hd) * S::T + r0] : 0.0f;
  const float l1 = r1 < S::T ? lse[(b * S::H + hd) * S::T + r1] * MDL_LOG2E : 0.0f,
              s1 = r1 < S::T ? dsum[(b * S::H + hd) * S::T + r1] : 0.0f;
  float acc[S::NTILES][4]; // dq's channels 8 n .. 8 n + 7
#pragma unroll
  for (int n = 0; n < S::NTILES; n++)
    acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const I kstart = mdl_att_kstart<S>(q0), kend = mdl_att_kend<S>(q0);
  const mdl_att_kv_issue<S, K, V> issue = {k, v, doc, Ks, Vs, Dk, b, hd / S::G};
  mdl_att_tiles_begin<S>(issue, kstart);
  for (I k0 = kstart, cur = 0; k0 < kend; k0 += MDL_ATT_TILE, cur ^= S::STAGES - 1) {
    mdl_att_tile<S>(issue, k0, kend, cur);
    MDL_ATT_DOCS(S, Dk[cur], d0, d1, lane);
    if (MDL_ATT_SKIP_KEYS(S, k0, q0, w))
      continue; // the warp's rows see none of the tile's keys
    // S = Q K^T (unscaled) and dP = dout V^T: tile n holds keys k0 + 8 n .. k0 + 8 n + 7; S is -inf
    // where the row may not see the key.
    float s[MDL_ATT_TILE / 8][4], dp[MDL_ATT_TILE / 8][4];
    mdl_att_scores<S, true>(s, dp, qa, Ks[cur], oa, Vs[cur], lane);
    if (MDL_ATT_EDGE_KEYS(S, k0, q0, w))
      mdl_att_mask_keys<S>(s, k0, r0, r1, Dk[cur], d0, d1, tq);
    // P = exp(S - lse), dS = P (dP - D); rounded, tiles 2 k and 2 k + 1 of dS are the A fragment of
    // step k of dq += dS K, whose B fragment is keys 16 k + 2 tq, + 1 and 8 further of channel 8 n + g.
#pragma unroll
    for (int k = 0; k < MDL_ATT_TILE / 16; k++) {
      uint32_t da[4];
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const float(&sv)[4] = s[2 * k + h], (&pv)[4] = dp[2 * k + h];
        da[2 * h] =
            mdl_bf16x2(mdl_att_exp(sv[0], sl2e, l0) * (pv[0] - s0), mdl_att_exp(sv[1], sl2e, l0) * (pv[1] - s0));
        da[2 * h + 1] =
            mdl_bf16x2(mdl_att_exp(sv[2], sl2e, l1) * (pv[2] - s1), mdl_att_exp(sv[3], sl2e, l1) * (pv[3] - s1));
      }
#pragma unroll
      for (int n = 0; n < S::NTILES; n += 2) {
        uint32_t kb[4];
        mdl_att_ldsm_t<S>(kb, Ks[cur], k, n, lane);
        mdl_mma_bf16_16816(acc[n], da, kb);
        mdl_mma_bf16_16816(acc[n + 1], da, kb + 2);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < S::NTILES; n++) {
    const int c = 8 * n + 2 * tq;
    if (r0 < S::T)
      *(float2 *)&dq[(b * S::T + r0) * S::C + hd * S::D + c] = make_float2(scale * acc[n][0], scale * acc[n][1]);
    if (r1 < S::T)
      *(float2 *)&dq[(b * S::T + r1) * S::C + hd * S::D + c] = make_float2(scale * acc[n][2], scale * acc[n][3]);
  }
}

// The tiles of queries and dout a block by key tile stages, with their log-sum-exp, D (DK) and
// documents: the issue of mdl_att_tile.
template <class S, bool DK, class Q, class DO> struct mdl_att_qo_issue {
  typedef typename S::I I;
  const Q &q;
  const DO &dout;
  const int32_t *doc;
  const float *lse, *dsum;
  uint32_t (*qs)[MDL_ATT_TILE][S::PAIRS];
  uint32_t (*os)[MDL_ATT_TILE][S::PAIRS];
  float (*ls)[MDL_ATT_TILE];
  float (*ss)[MDL_ATT_TILE];
  int32_t (*dq)[MDL_ATT_TILE];
  I b, hd;
  __device__ __forceinline__ void operator()(I x0, I buf) const {
    mdl_att_stage<S>(q, qs, dout, os, buf, b, hd, x0);
    if (threadIdx.x < MDL_ATT_TILE) {
      mdl_att_stage_val<S>(ls, buf, lse, (b * S::H + hd) * S::T, x0);
      if constexpr (DK)
        mdl_att_stage_val<S>(ss, buf, dsum, (b * S::H + hd) * S::T, x0);
      if constexpr (S::DOC)
        mdl_att_stage_val<S>(dq, buf, doc, b * S::T, x0);
    }
  }
};

// The backward's dk and dv (DK, DV: which of them), by key tile: a block of WARPS warps per (batch,
// kv head, 16 WARPS keys), 16 keys per warp with K and V as mma A fragments (bf16); the queries that may
// see the tile, and their dout, staged in shared tiles of 64 as bf16 with their log-sum-exp and D;
// S^T = K Q^T and dP^T = V dout^T by mma, P^T = exp(S^T - lse), dS^T = P^T (dP^T - D) in f32; rounded,
// the accumulators of two adjacent n8 tiles are the A fragments of one k16 step of dv += P^T dout and
// dk += dS^T Q; dk = scale dk. The query heads of the kv head's group (S::G) take their turns through
// the staged tiles, their terms summed in the same accumulators.
template <class S, bool DK, bool DV, class Q, class K, class V, class DO>
__device__ __forceinline__ void mdl_att_dkv(const Q &q, const K &k, const V &v, const DO &dout, const int32_t *doc,
                                            const float *lse, const float *dsum, float *dk, float *dv, float sl2e,
                                            float scale) {
  typedef typename S::I I;
  __shared__ __align__(16) uint32_t Qs[S::STAGES][MDL_ATT_TILE][S::PAIRS], Os[S::STAGES][MDL_ATT_TILE][S::PAIRS];
  __shared__ float Ls[S::STAGES][MDL_ATT_TILE], Ss[S::STAGES][MDL_ATT_TILE];
  __shared__ int32_t Dq[S::STAGES][MDL_ATT_TILE];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  I b, kh, k0;
  mdl_att_block<S, false, true>(b, kh, k0);
  // The lane's keys: r0 (accumulators 0 and 1 of a tile) and r1 (2 and 3).
  const I r0 = k0 + 16 * w + g, r1 = r0 + 8;
  uint32_t ka[S::D / 16][4], va[S::D / 16][4];
  mdl_att_frags<S>(ka, k, b, kh, r0, r1, tq);
  if constexpr (DK)
    mdl_att_frags<S>(va, v, b, kh, r0, r1, tq);
  int32_t d0 = 0, d1 = 0;
  mdl_att_row_docs<S>(doc, b, r0, r1, d0, d1);
  float dka[S::NTILES][4], dva[S::NTILES][4]; // channels 8 n .. 8 n + 7
#pragma unroll
  for (int n = 0; n < S::NTILES; n++) {
    if constexpr (DK)
      dka[n][0] = dka[n][1] = dka[n][2] = dka[n][3] = 0.0f;
    if constexpr (DV)
      dva[n][0] = dva[n][1] = dva[n][2] = dva[n][3] = 0.0f;
  }
  const I start = S::CAUSAL ? k0 : 0; // (queries before k0 see none of the keys)
  // (with a window, queries past the last key's window see none either)
  const I qend = S::W && k0 + S::ROWS - 1 + S::W < S::T ? k0 + S::ROWS - 1 + S::W : S::T;
  for (I hd = kh * S::G; hd < kh * S::G + S::G; hd++) {
    if (hd > kh * S::G)
      __syncthreads(); // (every warp is done with the head before's tiles)
    const mdl_att_qo_issue<S, DK, Q, DO> issue = {q, dout, doc, lse, dsum, Qs, Os, Ls, Ss, Dq, b, hd};
    mdl_att_tiles_begin<S>(issue, start);
    for (I i0 = start, cur = 0; i0 < qend; i0 += MDL_ATT_TILE, cur ^= S::STAGES - 1) {
      mdl_att_tile<S>(issue, i0, qend, cur);
      MDL_ATT_DOCS(S, Dq[cur], d0, d1, lane);
      if ((S::CAUSAL && S::ROWS > MDL_ATT_TILE && i0 + MDL_ATT_TILE - 1 < k0 + 16 * w) ||
          (S::W && i0 >= k0 + 16 * w + 15 + S::W) || none)
        continue; // none of the tile's queries sees the warp's keys
      // S^T = K Q^T (unscaled) and dP^T = V dout^T: tile n holds queries i0 + 8 n .. i0 + 8 n + 7.
      float s[MDL_ATT_TILE / 8][4], dp[MDL_ATT_TILE / 8][4];
      mdl_att_scores<S, DK>(s, dp, ka, Qs[cur], va, Os[cur], lane);
      // Queries that may not see the key get -inf (in tiles past T, before a key of the warp (causal),
      // past its window, in other documents).
      if (!one || i0 + MDL_ATT_TILE > S::T || (S::CAUSAL && i0 < k0 + 16 * w + 15) ||
          (S::W && i0 + MDL_ATT_TILE - 1 >= k0 + 16 * w + S::W)) {
#pragma unroll
        for (int n = 0; n < MDL_ATT_TILE / 8; n++) {
#pragma unroll
          for (int x = 0; x < 4; x++) {
            const I i = i0 + 8 * n + 2 * tq + (x & 1), j = x < 2 ? r0 : r1;
            if (!(i < S::T && MDL_ATT_ALLOWED(S, i, j, Dq[cur][i - i0], x < 2 ? d0 : d1)))
              s[n][x] = -MDL_INF;
          }
        }
      }
      // P^T = exp(S^T - lse), dS^T = P^T (dP^T - D); rounded, tiles 2 k and 2 k + 1 are the A fragments
      // of step k of dv += P^T dout and dk += dS^T Q, whose B fragments are queries 16 k + 2 tq, + 1 and
      // 8 further of channel 8 n + g.
#pragma unroll
      for (int k = 0; k < MDL_ATT_TILE / 16; k++) {
        uint32_t pa[4], da[4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const int i = 16 * k + 8 * h + 2 * tq;
          const float(&sv)[4] = s[2 * k + h], (&pv)[4] = dp[2 * k + h];
          const float L0 = Ls[cur][i] * MDL_LOG2E, L1 = Ls[cur][i + 1] * MDL_LOG2E; // (in base 2, as s)
          const float p0 = mdl_att_exp(sv[0], sl2e, L0), p1 = mdl_att_exp(sv[1], sl2e, L1);
          const float p2 = mdl_att_exp(sv[2], sl2e, L0), p3 = mdl_att_exp(sv[3], sl2e, L1);
          if constexpr (DV) {
            pa[2 * h] = mdl_bf16x2(p0, p1);
            pa[2 * h + 1] = mdl_bf16x2(p2, p3);
          }
          if constexpr (DK) {
            const float S0 = Ss[cur][i], S1 = Ss[cur][i + 1];
            da[2 * h] = mdl_bf16x2(p0 * (pv[0] - S0), p1 * (pv[1] - S1));
            da[2 * h + 1] = mdl_bf16x2(p2 * (pv[2] - S0), p3 * (pv[3] - S1));
          }
        }
#pragma unroll
        for (int n = 0; n < S::NTILES; n += 2) {
          if constexpr (DV) {
            uint32_t ob[4];
            mdl_att_ldsm_t<S>(ob, Os[cur], k, n, lane);
            mdl_mma_bf16_16816(dva[n], pa, ob);
            mdl_mma_bf16_16816(dva[n + 1], pa, ob + 2);
          }
          if constexpr (DK) {
            uint32_t qb[4];
            mdl_att_ldsm_t<S>(qb, Qs[cur], k, n, lane);
            mdl_mma_bf16_16816(dka[n], da, qb);
            mdl_mma_bf16_16816(dka[n + 1], da, qb + 2);
          }
        }
      }
    }
  }
#pragma unroll
  for (int n = 0; n < S::NTILES; n++) {
    const int c = 8 * n + 2 * tq;
    constexpr I CK = S::KH * S::D; // (dk and dv: rows of k and v)
    if (r0 < S::TK) {
      if constexpr (DK)
        *(float2 *)&dk[(b * S::TK + r0) * CK + kh * S::D + c] = make_float2(scale * dka[n][0], scale * dka[n][1]);
      if constexpr (DV)
        *(float2 *)&dv[(b * S::TK + r0) * CK + kh * S::D + c] = make_float2(dva[n][0], dva[n][1]);
    }
    if (r1 < S::TK) {
      if constexpr (DK)
        *(float2 *)&dk[(b * S::TK + r1) * CK + kh * S::D + c] = make_float2(scale * dka[n][2], scale * dka[n][3]);
      if constexpr (DV)
        *(float2 *)&dv[(b * S::TK + r1) * CK + kh * S::D + c] = make_float2(dva[n][2], dva[n][3]);
    }
  }
}

//
// Cross-entropy, a row at a time, as the CUDA emitter instantiates it (compiler/emit_cuda_lmhead.c: the
// cross-entropy kernels and the LM head's, which take their rows from the logits GEMM's chunk).
//

// Four or eight values as f32 from p (aligned to the load), and their store (to bf16: rounded).
template <int VW, typename E> __device__ __forceinline__ void mdl_loadv(const E *p, float *f) {
  if constexpr (VW == 8)
    mdl_load8(p, f);
  else
    mdl_load4(p, f);
}
template <int VW, typename E> __device__ __forceinline__ void mdl_storev(E *p, const float *f) {
  if constexpr (VW == 8)
    mdl_store8(p, f);
  else
    mdl_store4(p, f);
}

// A value in memory as f32: itself, or a bf16 value widened.
__device__ __forceinline__ float mdl_as_f32(float x) { return x; }
__device__ __forceinline__ float mdl_as_f32(uint16_t x) { return mdl_bf16_to_f32(x); }

// The type of an integer literal of value V in C (int where it fits, else long): a constant of the
// template in an expression as the literal the emitter printed was.
template <bool FITS> struct mdl_lit_of { typedef long type; };
template <> struct mdl_lit_of<true> { typedef int type; };
template <long V> struct mdl_lit : mdl_lit_of<(V <= 2147483647L)> {};

// One row of cross-entropy over V classes, by the TPR threads of the row (a warp, or a block: tr is
// the thread's place in the row; the block's reductions use sh_f and sh_d, 32 floats and 48
// doubles of shared memory), the logits row at x (float, or bf16 values widened as they are loaded),
// the row's target tg: with LOSS the loss into *loss, with GRAD *dloss times (softmax - onehot) into the
// row at dx (may be x itself; bf16 values when DX is uint16_t, each the f32 value rounded); an ignored
// target (< 0) gives zeros, one >= V a report in status. With VW (4 or 8) both passes take VW logits a
// load, 16 bytes (four f32 or eight bf16; four bf16, 8 bytes, where rows are only 8-byte aligned), then
// the last V % VW one by one: the rows of x and dx start aligned to VW elements of theirs. I is the
// index type. (The LM head's cross-entropy, a block of 1024 threads a row reading one float each, moved
// GPT-2's logits at 2.2 TB/s on an H200: a load in flight per thread is too few bytes to cover the
// memory's latency. The float4 loops were not unrolled either, one load of 16 bytes in a pass's loop in
// the PTX: they take two loads a thread at once.)
template <typename I, long V, int TPR, int VW, bool LOSS, bool GRAD, typename X, typename DX>
__device__ __forceinline__ void mdl_ce_row(const X *x, DX *dx, int32_t tg, float *loss, const float *dloss,
                                           MdlStatus *status, int tr, float *sh_f, double *sh_d) {
  constexpr typename mdl_lit<V>::type VC = V; // (as the literal it was in the emitted code: int where it fits)
  constexpr I NV = VW ? V / VW : 0; // the vector loads of a row
  if (tg < 0 || tg >= VC) {
    if (tg >= VC && tr == 0)
      mdl_report(status, MDL_ERR_TARGET, tg, VC);
    if constexpr (LOSS)
      if (tr == 0)
        *loss = 0.0f;
    if constexpr (GRAD)
      for (I j = tr; j < VC; j += TPR)
        dx[j] = 0;
  } else {
    float xt = 0.0f;
    if constexpr (LOSS)
      xt = mdl_as_f32(x[tg]);
    // (dx may be x: the lane that writes dx[tg] must not do so before every lane has read x[tg]; a
    // block's reductions below order them by __syncthreads, a warp's shuffles do not order memory)
    if constexpr (LOSS && GRAD && TPR == 32)
      __syncwarp();
    // One pass for the maximum and the sum (online softmax): each thread keeps the largest logit it
    // has seen and its sum of exp(x - that), rescaled when the maximum grows; the threads' sums are
    // then rescaled to the row's maximum and added. The gradient's pass reads the row a second time.
    // (Two loads of a thread in flight at once, the second's logits taken after the first's as a loop
    // of one would: the order of the sums is the same.)
    float m = -MDL_INF;
    double part = 0;
    if constexpr (NV > 0)
      for (I jv = tr; jv < NV; jv += 2 * TPR) {
        float xa[VW], ya[VW];
        mdl_loadv<VW>(&x[VW * jv], xa);
        if (jv + TPR < NV)
          mdl_loadv<VW>(&x[VW * (jv + TPR)], ya);
        else
          for (int c = 0; c < VW; c++) ya[c] = -MDL_INF;
#pragma unroll
        for (int c = 0; c < VW; c++)
          mdl_softmax_add(xa[c], m, part);
#pragma unroll
        for (int c = 0; c < VW; c++)
          mdl_softmax_add(ya[c], m, part);
      }
    if constexpr (VW * NV < VC)
      for (I j = VW * NV + tr; j < VC; j += TPR)
        mdl_softmax_add(mdl_as_f32(x[j]), m, part);
    float mx;
    if constexpr (TPR == 32)
      mx = mdl_warp_fmax(m);
    else
      mx = mdl_block_fmax(m, sh_f);
    double sum = m == -MDL_INF ? 0.0 : part * (double)expf(m - mx);
    if constexpr (TPR == 32)
      sum = mdl_warp_sum(sum);
    else
      sum = mdl_block_sum(sum, sh_d);
    if constexpr (LOSS)
      if (tr == 0)
        *loss = (float)(mx + log(sum) - xt);
    if constexpr (GRAD) {
      const double g = *dloss, inv = 1.0 / sum;
      if constexpr (NV > 0)
        for (I jv = tr; jv < NV; jv += 2 * TPR) { // (both loads before either store: dx may be x itself)
          const bool two = jv + TPR < NV;
          float xa[VW], ya[VW];
          mdl_loadv<VW>(&x[VW * jv], xa);
          if (two)
            mdl_loadv<VW>(&x[VW * (jv + TPR)], ya);
          const I j = VW * (jv);
#pragma unroll
          for (int c = 0; c < VW; c++)
            xa[c] = mdl_ce_grad(xa[c], mx, g, inv, j + c == tg);
          mdl_storev<VW>(&dx[j], xa);
          if (two) {
            const I jy = VW * (jv + TPR);
#pragma unroll
            for (int c = 0; c < VW; c++)
              ya[c] = mdl_ce_grad(ya[c], mx, g, inv, jy + c == tg);
            mdl_storev<VW>(&dx[jy], ya);
          }
        }
      if constexpr (VW * NV < VC)
        for (I j = VW * NV + tr; j < VC; j += TPR) {
          const float d = mdl_ce_grad(mdl_as_f32(x[j]), mx, g, inv, j == tg);
          if constexpr (sizeof(DX) == 2)
            dx[j] = mdl_f32_to_bf16(d);
          else
            dx[j] = d;
        }
    }
  }
}

//
// The optimizer over the concatenation of its parameters' segments (MdlSeg tables), in chunks of CHUNK
// values a block, as compiler/emit_cuda_opt.c instantiates it: the gradient norm's sums of squares
// and their total, and the update (AdamW, SGD or Lion).
//

// The first of the NSEG segments that meet a block's chunk [c0, c1) of the concatenated values: the
// last segment starting at or before c0, by bisection over their starts; the loops over the segments
// end at the first that starts past the chunk, [lo, hi) the chunk's elements of segment s, as indices
// into it. (A loop over every segment, in every thread, read GPT-2's 148-entry table a thousand times
// per thread, for 32 elements: the optimizer took 3.6 ms a step on an H200.)
template <int NSEG> __device__ __forceinline__ int mdl_seg_first(const MdlSeg *seg, int64_t c0) {
  int s0 = 0;
  for (int s1 = NSEG - 1; s0 < s1;) {
    const int mid = (s0 + s1 + 1) / 2;
    if (seg[mid].start <= c0) s0 = mid; else s1 = mid - 1;
  }
  return s0;
}

// The gradient norm's first kernel: the sum of squares of the block's chunk (of CHUNK of the TOTAL
// values) of the concatenated gradients (the segments' p), in double, into part[blockIdx.x]; LOADS
// loads a thread in flight, the values added in the order of a loop of one load (which the compiler
// had left as it was). sh: 48 doubles of shared memory.
template <int NSEG, long TOTAL, int CHUNK, int LOADS>
__device__ __forceinline__ void mdl_opt_sumsq(const char *arena, const MdlSeg *seg, double *part, double *sh) {
  double acc = 0;
  const int64_t c0 = (int64_t)blockIdx.x * CHUNK, c1 = c0 + CHUNK < TOTAL ? c0 + CHUNK : TOTAL;
  const int s0 = mdl_seg_first<NSEG>(seg, c0);
  for (int s = s0; s < NSEG && seg[s].start < c1; s++) {
    const int64_t lo = (c0 > seg[s].start ? c0 : seg[s].start) - seg[s].start;
    const int64_t hi = (c1 < seg[s].start + seg[s].n ? c1 : seg[s].start + seg[s].n) - seg[s].start;
    for (int64_t k = lo + threadIdx.x; k < hi; k += LOADS * blockDim.x) {
      const float *const gs = (const float *)(arena + seg[s].p);
      float x[LOADS];
#pragma unroll
      for (int u = 0; u < LOADS; u++)
        x[u] = k + u * blockDim.x < hi ? gs[k + u * blockDim.x] : 0.0f;
#pragma unroll
      for (int u = 0; u < LOADS; u++)
        acc += (double)x[u] * x[u];
    }
  }
  acc = mdl_block_sum(acc, sh);
  if (threadIdx.x == 0)
    part[blockIdx.x] = acc;
}

// Its second, by one block: the NB chunks' sums added in order, the norm their square root.
template <long NB> __device__ __forceinline__ void mdl_opt_norm(const double *part, float *norm, double *sh) {
  double acc = 0;
  for (int64_t k = threadIdx.x; k < NB; k += blockDim.x)
    acc += part[k];
  acc = mdl_block_sum(acc, sh);
  if (threadIdx.x == 0)
    norm[0] = (float)sqrt(acc);
}

// The update (mdl_opt_rule of RULE with NST moments, hyperparameters h) over the block's chunk of the
// segments: p and its moments in place, with COPIES p's bf16 copy (c, where a segment has one) too
// (Muon: v, its update, is read only).
// Four elements a float4, UNROLL float4s of g, the moments and p loaded before any is updated: the
// stores of one element may alias the loads of the next as far as the compiler knows, so one at a
// time a thread would keep a single element's loads in flight and the kernel would wait on memory.
// Buffers start 64-byte aligned; where a chunk or segment does not start or end at a multiple of 4,
// up to 3 elements at each end go one a thread.
template <int RULE, int NST, int NSEG, long TOTAL, int CHUNK, int UNROLL, bool COPIES>
__device__ __forceinline__ void mdl_opt_update(char *arena, const MdlSeg *seg, const MdlAdamW &h) {
  const int64_t c0 = (int64_t)blockIdx.x * CHUNK, c1 = c0 + CHUNK < TOTAL ? c0 + CHUNK : TOTAL;
  const int s0 = mdl_seg_first<NSEG>(seg, c0);
  for (int s = s0; s < NSEG && seg[s].start < c1; s++) {
    if (mdl_own[1] && (seg[s].p < mdl_own[0] || seg[s].p >= mdl_own[1]))
      continue; // (--zero 1: another rank updates it)
    const int64_t lo = (c0 > seg[s].start ? c0 : seg[s].start) - seg[s].start;
    const int64_t hi = (c1 < seg[s].start + seg[s].n ? c1 : seg[s].start + seg[s].n) - seg[s].start;
    float *p = (float *)(arena + seg[s].p), *m = (float *)(arena + seg[s].m);
    float *v = (float *)(arena + seg[s].v);
    const float *g = (const float *)(arena + seg[s].g);
    const double wd = seg[s].wd, lr = h.lr * seg[s].ls;
    uint16_t *const cp = COPIES && seg[s].c >= 0 ? (uint16_t *)(arena + seg[s].c) : NULL;
    const int64_t lo4 = (lo + 3) / 4 * 4, hi4 = hi / 4 * 4 > lo4 ? hi / 4 * 4 : lo4;
    if (threadIdx.x < 8) {
      const int64_t k = threadIdx.x < 4 ? lo + threadIdx.x : hi4 + threadIdx.x - 4;
      if (k < hi && (threadIdx.x >= 4 || k < lo4)) {
        float mk = NST > 0 ? m[k] : 0.0f, vk = NST > 1 || RULE == 3 ? v[k] : 0.0f;
        const float pk = mdl_opt_rule<RULE, NST>(h, wd, lr, g[k], mk, vk, p[k]);
        if constexpr (NST > 0)
          m[k] = mk;
        if constexpr (NST > 1)
          v[k] = vk;
        p[k] = pk;
        if (COPIES && cp)
          cp[k] = mdl_f32_to_bf16(pk);
      }
    }
    for (int64_t k0 = lo4 / 4 + threadIdx.x; k0 < hi4 / 4; k0 += UNROLL * blockDim.x) {
      float4 gv[UNROLL], mv[UNROLL], vv[UNROLL], pv[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int64_t q = k0 + u * blockDim.x;
        gv[u] = mv[u] = vv[u] = pv[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (q < hi4 / 4) {
          gv[u] = ((const float4 *)g)[q], pv[u] = ((float4 *)p)[q];
          if constexpr (NST > 0)
            mv[u] = ((float4 *)m)[q];
          if constexpr (NST > 1 || RULE == 3)
            vv[u] = ((float4 *)v)[q];
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int64_t q = k0 + u * blockDim.x;
        if (q >= hi4 / 4)
          break;
        float4 &mq = mv[u], &vq = vv[u], &pq = pv[u];
        pq.x = mdl_opt_rule<RULE, NST>(h, wd, lr, gv[u].x, mq.x, vq.x, pq.x);
        pq.y = mdl_opt_rule<RULE, NST>(h, wd, lr, gv[u].y, mq.y, vq.y, pq.y);
        pq.z = mdl_opt_rule<RULE, NST>(h, wd, lr, gv[u].z, mq.z, vq.z, pq.z);
        pq.w = mdl_opt_rule<RULE, NST>(h, wd, lr, gv[u].w, mq.w, vq.w, pq.w);
        if constexpr (NST > 0)
          ((float4 *)m)[q] = mq;
        if constexpr (NST > 1)
          ((float4 *)v)[q] = vq;
        ((float4 *)p)[q] = pq;
        if (COPIES && cp)
          ((ushort4 *)cp)[q] = make_ushort4(mdl_f32_to_bf16(pq.x), mdl_f32_to_bf16(pq.y), mdl_f32_to_bf16(pq.z),
                                            mdl_f32_to_bf16(pq.w));
      }
    }
  }
}
