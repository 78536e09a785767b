//
// Cross-entropy, a row at a time, as the CUDA emitter instantiates it (compiler/emit/emit_cuda_lmhead.c:
// the cross-entropy kernels and the LM head's, which take their rows from the logits GEMM's chunk).
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

