// The CUDA modules' common helpers: the optimizer's segments and update rule, error reports, random
// numbers, activations, softmax and cross-entropy terms, bf16, loads and stores of 4 or 8 values.

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

// One parameter element's update in double, as the interpreter does it (runtime/engine/interp.c has
// the rules), by RULE (OptRule: 0 AdamW, 1 SGD, 2 Lion, 3 Muon) keeping NST moments: gradient g scaled by
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

