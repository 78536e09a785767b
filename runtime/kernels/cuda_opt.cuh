//
// The optimizer over the concatenation of its parameters' segments (MdlSeg tables), in chunks of CHUNK
// values a block, as compiler/emit/emit_cuda_opt.c instantiates it: the gradient norm's sums of squares
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
