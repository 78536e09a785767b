//
// Tensor-core attention, FlashAttention-2 style: the forward, and the backward's dq and dk, dv, as
// templates that compiler/emit/emit_cuda_attn.c instantiates with the shapes it chose (its kernels
// are wrappers that pass their buffers). Every row's sums are taken in the same order over the same
// tiles at either block size, so the two variants of a kernel give the same values to the bit.
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

