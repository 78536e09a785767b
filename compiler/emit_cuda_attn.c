// emit_cuda_attn.c: the CUDA emitter's attention, forward and backward, on CUDA cores and on tensor
// cores. See emit_cuda.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_cuda.h"
#include "emit_cuda_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

//
// Attention. Heads of q, k, v [B,T,C] (rows possibly strided: slices of one qkv buffer), D = C / H.
//

typedef struct {
  int64_t nb, nt, nc, heads, d;
  bool causal, has_doc;
  bool bf16; // the products read q, k, v rounded to bf16, and P V reads e rounded (ia[4], mdl.h)
  double scale;
  Rows q, k, v, dout, o; // o: the forward's output, as the backward's D reads it
  int doc, dpl; // doc: node or -1; dpl: channels per lane
  int lse;      // the ATTENTION_LSE node (the rows' log-sum-exp, [B, heads, T]), or -1
} Att;

typedef enum { ATT_FWD, ATT_STATS, ATT_DQ } AttMode;

// The block's batch b, head hd and tile (its first row, `first`, of tiles of `rows`, nt of them) with
// the tile slowest across blocks: blocks start in index order, so the tiles of most work start first
// and the last to start are the lightest. Under causality that is the last query tiles (from_end:
// their rows see the most keys) or the first key tiles (seen by the most queries). Tiles had been
// fastest, so every (batch, head) began with its heaviest tile: on GPT-2's 1024 rows the last heavy
// tiles started late: a greedy schedule of the causal forward's blocks on an H200's 264 slots (a
// block's cost its key tiles plus one) ends 38% after the mean load of a slot, heaviest-first 7%.
static void att_block(Emit *e, const Att *A, int64_t nt, int64_t rows, const char *first, bool from_end) {
  int64_t nbh = A->nb * A->heads;
  ec_line(&e->core, "const %s bh = blockIdx.x %% %lld, b = bh / %lld, hd = bh %% %lld;", e->core.ixt, (long long)nbh,
          (long long)A->heads, (long long)A->heads);
  if (from_end && A->causal && nt > 1)
    ec_line(&e->core, "const %s %s = (%lld - blockIdx.x / %lld) * %lld; // (the last tiles, seeing the most keys, "
            "first)", e->core.ixt, first,
            (long long)(nt - 1), (long long)nbh, (long long)rows);
  else
    ec_line(&e->core, "const %s %s = blockIdx.x / %lld * %lld;%s", e->core.ixt, first, (long long)nbh, (long long)rows,
            !from_end && A->causal && nt > 1 ? " // (the first tiles, seen by the most queries, first)" : "");
}

static Att att_of(Emit *e, const IrNode *nd) {
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  Att A = {.nb = s.d[0], .nt = s.d[1], .nc = s.d[2], .heads = nd->ia[0], .causal = nd->ia[1], .has_doc = nd->ia[2],
           .bf16 = nd->ia[4] == DT_BF16, .scale = nd->fa[0], .doc = -1, .lse = -1};
  A.d = A.nc / A.heads;
  A.dpl = (int)((A.d + 31) / 32);
  return A;
}

// Element (t, c) of head hd, batch b of rows r, as an expression.
static const char *at_row(Emit *e, Rows r, const Att *A, const char *t, const char *c) {
  return ec_str(&e->core, "%s[(b * %lld + %s) * %lld + hd * %lld + %s]", cu_rows_base(e, r), (long long)A->nt, t,
                (long long)r.stride, (long long)A->d, c);
}

// An element of q, k or v as the products read it: rounded to bf16 when the node says so.
static const char *att_in(Emit *e, const Att *A, const char *x) {
  return A->bf16 ? ec_str(&e->core, "mdl_bf16_to_f32(mdl_f32_to_bf16(%s))", x) : x;
}

static bool att_stored16(Emit *e, Rows r) { return ec_node(&e->core, r.node)->dtype == DT_BF16; }

// Element (row t, channel c) of q, k, v or dout as the products read it: att_in of an f32 value, or
// a value stored as bf16 (the backward's dout, precision.c) widened.
static const char *att_elem(Emit *e, const Att *A, Rows r, const char *t, const char *c) {
  const char *x = at_row(e, r, A, t, c);
  return att_stored16(e, r) ? ec_str(&e->core, "mdl_bf16_to_f32(%s)", x) : att_in(e, A, x);
}

// Channels c0 and c1 of row t as one register of two bf16 values (c0 in the low half): rounded from
// f32, or the two stored halves.
static const char *att_pair(Emit *e, const Att *A, Rows r, const char *t, const char *c0, const char *c1) {
  if (att_stored16(e, r))
    return ec_str(&e->core, "((uint32_t)%s | (uint32_t)%s << 16)", at_row(e, r, A, t, c0), at_row(e, r, A, t, c1));
  return ec_str(&e->core, "mdl_bf16x2(%s, %s)", at_row(e, r, A, t, c0), at_row(e, r, A, t, c1));
}

// The mask of key j for query row i (i's document in `di`, j's in `dj`).
static const char *att_allowed(Emit *e, const Att *A, const char *di, const char *dj) {
  return ec_str(&e->core, "j < %lld%s%s", (long long)A->nt, A->causal ? " && j <= i" : "",
                A->has_doc ? ec_str(&e->core, " && %s == %s", dj, di) : "");
}

// A statement for each channel c = lane + 32 t of the lane (t < dpl), skipping c >= D.
static void lanes_stmt(Emit *e, const Att *A, const char *stmt) {
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int t = 0; t < %d; t++)", A->dpl);
  if (A->d % 32) {
    ec_line(&e->core, "  if (lane + 32 * t < %lld)", (long long)A->d);
    ec_line(&e->core, "    %s", stmt);
  } else {
    ec_line(&e->core, "  %s", stmt);
  }
}

// Queries per block (a multiple of 4, at most 16) such that the shared tiles fit in 48 KB.
static int att_bq(Emit *e, const Att *A, int per_query) {
  int64_t kv = 2 * ATT_BK * (A->d + 1) * 4 + ATT_BK * 4;
  for (int bq = 16; bq >= 4; bq /= 2)
    if (kv + (int64_t)bq * per_query <= 48 << 10)
      return bq;
  ec_fail(&e->core, "step %s: attention heads of %lld do not fit in shared memory", e->core.f->steps[e->core.si].name,
          (long long)A->d);
  return 4;
}

// The query-tile kernels: the forward (out, and the rows' log-sum-exp A->lse when it is >= 0), the
// statistics alone (ATT_STATS: an ATTENTION_LSE without its forward) and the backward's dq (out = dq,
// from A->lse and dsum = D per row). One block of 4 warps per (batch, head, tile of queries), each
// warp owning every 4th query row of the tile; keys and values in shared tiles of 32, a key per lane;
// online softmax (forward, statistics) or probabilities from the statistics (dq). bf16: q, k, v and
// dout rounded as they are staged; the forward sums e rounded in P V and unrounded in l; dq reads dS
// rounded.
static void att_query_kernel(Emit *e, const Att *A, AttMode mode, int out, int64_t dsum) {
  const char *ixt = e->core.ixt;
  int64_t d = A->d, t = A->nt;
  int bq = att_bq(e, A, (int)(d * 4 * (mode == ATT_DQ ? 2 : 1) + 4)), rw = bq / 4;
  bool values = mode != ATT_STATS; // the statistics alone need the keys only
  int64_t nqt = (t + bq - 1) / bq;
  bool guard = d % 32 != 0;
  cu_kbegin(e, mode == ATT_FWD ? "" : mode == ATT_STATS ? "stats" : "dq");
  cu_note(e, "attention%s: B %lld, T %lld, %lld heads of %lld%s%s; a block per (batch, head, %d queries), "
             "keys in tiles of %d",
          mode == ATT_FWD ? (A->lse >= 0 ? " and its log-sum-exp per row" : "")
          : mode == ATT_STATS ? " statistics (log-sum-exp per row)" : " backward, dq",
          (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
          A->has_doc ? ", within documents" : "", bq, ATT_BK);
  e->shared = (int)(bq * d * 4 * (mode == ATT_DQ ? 2 : 1) + (values ? 2 : 1) * ATT_BK * (d + 1) * 4 +
                    (A->has_doc ? ATT_BK * 4 : 0));
  ec_line(&e->core, "__shared__ float Qs[%d][%lld];", bq, (long long)d);
  if (mode == ATT_DQ)
    ec_line(&e->core, "__shared__ float Os[%d][%lld];", bq, (long long)d);
  if (values)
    ec_line(&e->core, "__shared__ float Ks[%d][%lld], Vs[%d][%lld];", ATT_BK, (long long)d + 1, ATT_BK,
            (long long)d + 1);
  else
    ec_line(&e->core, "__shared__ float Ks[%d][%lld];", ATT_BK, (long long)d + 1);
  if (A->has_doc)
    ec_line(&e->core, "__shared__ int32_t Dk[%d];", ATT_BK);
  ec_line(&e->core, "const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;");
  att_block(e, A, nqt, bq, "q0", true);
  const char *lp = A->lse >= 0 ? cu_ptr(e, A->lse) : NULL;
  const char *sp = dsum >= 0 ? cu_raw_ptr(e, dsum, "float", "dout . out per row") : NULL;
  ec_enter(&e->core, "for (int u = threadIdx.x; u < %lld; u += %d)", (long long)(bq * d), 128);
  ec_line(&e->core, "const int i = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = q0 + i < %lld;", (long long)t);
  ec_line(&e->core, "Qs[i][c] = in ? %s : 0.0f;", att_elem(e, A, A->q, "q0 + i", "c"));
  if (mode == ATT_DQ)
    ec_line(&e->core, "Os[i][c] = in ? %s : 0.0f;", att_elem(e, A, A->dout, "q0 + i", "c"));
  ec_leave(&e->core);
  if (mode == ATT_DQ)
    ec_line(&e->core, "float acc[%d][%d], lr[%d], sr[%d];", rw, A->dpl, rw, rw);
  else if (values)
    ec_line(&e->core, "float m[%d], l[%d], acc[%d][%d];", rw, rw, rw, A->dpl);
  else
    ec_line(&e->core, "float m[%d], l[%d];", rw, rw);
  if (A->has_doc)
    ec_line(&e->core, "int32_t di[%d];", rw);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int rr = 0; rr < %d; rr++)", rw);
  if (mode == ATT_DQ || A->has_doc)
    ec_line(&e->core, "const %s i = q0 + w + 4 * rr;", ixt);
  if (mode == ATT_DQ) {
    ec_line(&e->core, "lr[rr] = i < %lld ? %s[(b * %lld + hd) * %lld + i] : 0.0f;", (long long)t, lp,
            (long long)A->heads, (long long)t);
    ec_line(&e->core, "sr[rr] = i < %lld ? %s[(b * %lld + hd) * %lld + i] : 0.0f;", (long long)t, sp,
            (long long)A->heads, (long long)t);
  } else {
    ec_line(&e->core, "m[rr] = -MDL_INF;");
    ec_line(&e->core, "l[rr] = 0.0f;");
  }
  if (A->has_doc)
    ec_line(&e->core, "di[rr] = i < %lld ? %s[b * %lld + i] : 0;", (long long)t, cu_ptr(e, A->doc), (long long)t);
  if (values) {
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", A->dpl);
    ec_line(&e->core, "  acc[rr][t] = 0.0f;");
  }
  ec_leave(&e->core);
  if (A->causal)
    ec_line(&e->core, "const %s kend = q0 + %d < %lld ? q0 + %d : %lld;", ixt, bq, (long long)t, bq, (long long)t);
  else
    ec_line(&e->core, "const %s kend = %lld;", ixt, (long long)t);
  ec_enter(&e->core, "for (%s k0 = 0; k0 < kend; k0 += %d)", ixt, ATT_BK);
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "for (int u = threadIdx.x; u < %lld; u += %d)", (long long)(ATT_BK * d), 128);
  ec_line(&e->core, "const int jj = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = k0 + jj < %lld;", (long long)t);
  ec_line(&e->core, "Ks[jj][c] = in ? %s : 0.0f;", att_elem(e, A, A->k, "k0 + jj", "c"));
  if (values)
    ec_line(&e->core, "Vs[jj][c] = in ? %s : 0.0f;", att_elem(e, A, A->v, "k0 + jj", "c"));
  ec_leave(&e->core);
  if (A->has_doc) {
    ec_line(&e->core, "if (threadIdx.x < %d)", ATT_BK);
    ec_line(&e->core, "  Dk[threadIdx.x] = k0 + threadIdx.x < %lld ? %s[b * %lld + k0 + threadIdx.x] : 0;",
            (long long)t, cu_ptr(e, A->doc), (long long)t);
  }
  ec_line(&e->core, "__syncthreads();");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int rr = 0; rr < %d; rr++)", rw);
  ec_line(&e->core, "const int ii = w + 4 * rr;");
  ec_line(&e->core, "const %s i = q0 + ii, j = k0 + lane;", ixt);
  ec_line(&e->core, "if (i >= %lld)", (long long)t);
  ec_line(&e->core, "  continue;");
  ec_line(&e->core, "const bool ok = %s;", att_allowed(e, A, "di[rr]", "Dk[lane]"));
  ec_line(&e->core, "float s = -MDL_INF;");
  ec_enter(&e->core, "if (ok)");
  ec_line(&e->core, "float dot = 0.0f;");
  ec_line(&e->core, "#pragma unroll 8");
  ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  dot += Qs[ii][c] * Ks[lane][c];");
  ec_line(&e->core, "s = dot * %s;", cu_flit(e, A->scale));
  ec_leave(&e->core);
  if (mode == ATT_DQ) {
    ec_line(&e->core, "float ds = 0.0f;");
    ec_enter(&e->core, "if (ok)");
    ec_line(&e->core, "const float p = expf(s - lr[rr]);");
    ec_line(&e->core, "float dp = 0.0f;");
    ec_line(&e->core, "#pragma unroll 8");
    ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dp += Os[ii][c] * Vs[lane][c];");
    ec_line(&e->core, "ds = p * (dp - sr[rr]);");
    if (A->bf16)
      ec_line(&e->core, "ds = mdl_bf16_to_f32(mdl_f32_to_bf16(ds)); // dq reads dS rounded");
    ec_leave(&e->core);
    ec_line(&e->core, "#pragma unroll 4");
    ec_enter(&e->core, "for (int jj = 0; jj < %d; jj++)", ATT_BK);
    ec_line(&e->core, "const float dj = __shfl_sync(MDL_FULL, ds, jj);");
    lanes_stmt(e, A, "acc[rr][t] += dj * Ks[jj][lane + 32 * t];");
    ec_leave(&e->core);
  } else {
    ec_line(&e->core, "const float bm = mdl_warp_fmax(s);");
    ec_line(&e->core, "if (bm == -MDL_INF)");
    ec_line(&e->core, "  continue;");
    ec_line(&e->core, "const float mn = fmaxf(m[rr], bm), corr = expf(m[rr] - mn);");
    ec_line(&e->core, "const float p = ok ? expf(s - mn) : 0.0f;");
    ec_line(&e->core, "l[rr] = l[rr] * corr + mdl_warp_sumf(p);");
    ec_line(&e->core, "m[rr] = mn;");
    if (values) {
      ec_line(&e->core, "#pragma unroll");
      ec_line(&e->core, "for (int t = 0; t < %d; t++)", A->dpl);
      ec_line(&e->core, "  acc[rr][t] *= corr;");
      // P V reads e rounded (l does not; mdl.h)
      if (A->bf16)
        ec_line(&e->core, "const float pr = mdl_bf16_to_f32(mdl_f32_to_bf16(p)); // P V reads e rounded, l does not");
      ec_line(&e->core, "#pragma unroll 4");
      ec_enter(&e->core, "for (int jj = 0; jj < %d; jj++)", ATT_BK);
      ec_line(&e->core, "const float pj = __shfl_sync(MDL_FULL, %s, jj);", A->bf16 ? "pr" : "p");
      lanes_stmt(e, A, "acc[rr][t] += pj * Vs[jj][lane + 32 * t];");
      ec_leave(&e->core);
    }
  }
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int rr = 0; rr < %d; rr++)", rw);
  ec_line(&e->core, "const %s i = q0 + w + 4 * rr;", ixt);
  ec_line(&e->core, "if (i >= %lld)", (long long)t);
  ec_line(&e->core, "  continue;");
  const char *o = out >= 0 && (mode != ATT_FWD || e->out_f32) ? cu_ptr(e, out) : NULL;
  if (mode != ATT_DQ && lp) {
    ec_line(&e->core, "if (lane == 0)");
    ec_line(&e->core, "  %s[(b * %lld + hd) * %lld + i] = m[rr] + logf(l[rr]);", lp, (long long)A->heads, (long long)t);
  }
  if (values) {
    ec_line(&e->core, "#pragma unroll");
    ec_enter(&e->core, "for (int t = 0; t < %d; t++)", A->dpl);
    ec_line(&e->core, "const int c = lane + 32 * t;");
    if (guard && mode == ATT_DQ)
      ec_line(&e->core, "if (c < %lld)", (long long)d);
    const char *ix = ec_str(&e->core, "(b * %lld + i) * %lld + hd * %lld + c", (long long)t, (long long)A->nc,
                            (long long)d);
    if (mode == ATT_FWD) {
      if (guard)
        ec_enter(&e->core, "if (c < %lld)", (long long)d);
      ec_line(&e->core, "const float y = acc[rr][t] / l[rr];");
      if (e->out_f32)
        ec_line(&e->core, "%s[%s] = y;", o, ix);
      for (int k = 0; k < e->nout_cast; k++)
        ec_line(&e->core, "%s[%s] = mdl_f32_to_bf16(y);", cu_ptr(e, e->out_cast[k]), ix);
      if (guard)
        ec_leave(&e->core);
    } else {
      ec_line(&e->core, "%s%s[%s] = %s * acc[rr][t];", guard ? "  " : "", o, ix, cu_flit(e, A->scale));
    }
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  cu_kend(e, A->nb * A->heads * nqt, 128);
}

// Causal, where a block holds more rows than a staged tile (the forward's and dk, dv's 128 in 8 warps,
// tiles of 64), a tile can be wholly masked for some of the warps (`before`), and within documents
// for any warp (`none` of att_mma_docs): those skip its products (its terms would be exact zeros: the
// sums are the same) and wait at the next tile's barrier. (One test for both: a second `continue`
// cost the forward a 20-byte spill on sm_90.)
static void att_mma_skip(Emit *e, const Att *A, int rows, const char *before, const char *why) {
  bool causal = A->causal && rows > ATT_MMA_TILE;
  if (!causal && !A->has_doc)
    return;
  ec_line(&e->core, "if (%s%s%s)", causal ? before : "", causal && A->has_doc ? " || " : "", A->has_doc ? "none" : "");
  ec_line(&e->core, "  continue; // %s", why);
}

// Shared memory of the tensor-core forward: the tile's keys and values as bf16, rows padded by 8
// (no bank conflicts in the fragment loads), and the keys' documents.
static int64_t att_mma_shared(const Att *A) {
  return 2 * ATT_MMA_TILE * (A->d + 8) * 2 + (A->has_doc ? ATT_MMA_TILE * 4 : 0);
}

// Whether rows of r can be read four channels at a time (a float4 of f32 values, a ushort4 of bf16
// ones) at channels that are multiples of 4: its stride and start in elements are (buffers start
// 64-byte aligned).
static bool att_rows16(Rows r) { return r.stride % 4 == 0 && r.at % 4 == 0; }

// Does the forward run on tensor cores: bf16 products, heads of a multiple of 16 channels (the k16
// steps of Q K^T, the n8 tiles of P V), tiles that fit in 48 KB of shared memory, keys and values
// staged by float4 loads (always so for such heads: q, k, v are whole or equal parts of one tensor).
static bool att_mma(const Att *A) {
  return A->bf16 && A->d % 16 == 0 && att_mma_shared(A) <= 48 << 10 && att_rows16(A->k) && att_rows16(A->v);
}

// The B fragments of step k of a product over the rows of the shared tile xs (keys or queries,
// bf16 values, rows 16-byte aligned) for output tiles n and n + 1 (channels 8 n .. 8 n + 15), by one
// transposing ldmatrix: name[0], name[1] of tile n (rows 16 k + 2 tq, + 1 and 8 further of channel
// 8 n + g), name[2], name[3] of tile n + 1.
static void att_mma_ldsm(Emit *e, const char *xs, const char *name) {
  ec_line(&e->core, "uint32_t %s[4];", name);
  ec_line(&e->core, "mdl_ldsm_x4_t(%s, (const uint16_t *)%s[16 * k + (lane & 15)] + 8 * n + (lane >> 4) * 8);", name,
          xs);
}

// One tile of the online softmax on tensor cores, rows r0 and r1 of the lane (s: the tile's scores
// by n8 tile): the rows' maxima over the tile, then the new running maxima m0, m1; z0, z1 what e =
// exp(s - z) subtracts, c0, c1 the factors exp(m - m_new) by which l0, l1 are rescaled here (and
// whatever else the caller summed over earlier tiles, by the caller).
static void att_mma_online_max(Emit *e, const Att *A) {
  ec_line(&e->core, "// The rows' maxima over the tile: the lane's, then its quad's (lanes 4 g .. 4 g + 3 share r0).");
  ec_line(&e->core, "float x0 = -MDL_INF, x1 = -MDL_INF;");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ATT_MMA_TILE / 8);
  ec_line(&e->core, "x0 = fmaxf(x0, fmaxf(s[n][0], s[n][1]));");
  ec_line(&e->core, "x1 = fmaxf(x1, fmaxf(s[n][2], s[n][3]));");
  ec_leave(&e->core);
  ec_line(&e->core, "x0 = fmaxf(x0, __shfl_xor_sync(MDL_FULL, x0, 1));");
  ec_line(&e->core, "x0 = fmaxf(x0, __shfl_xor_sync(MDL_FULL, x0, 2));");
  ec_line(&e->core, "x1 = fmaxf(x1, __shfl_xor_sync(MDL_FULL, x1, 1));");
  ec_line(&e->core, "x1 = fmaxf(x1, __shfl_xor_sync(MDL_FULL, x1, 2));");
  ec_line(&e->core, "// The new maxima; a row that has seen no key yet subtracts 0, not -inf (its e are 0).");
  ec_line(&e->core, "// What earlier tiles summed is rescaled by exp(m - m_new).");
  ec_line(&e->core, "const float mn0 = fmaxf(m0, x0 * %s), mn1 = fmaxf(m1, x1 * %s); // (scaled: see s)",
          cu_flit(e, A->scale * LOG2E), cu_flit(e, A->scale * LOG2E));
  ec_line(&e->core, "const float z0 = mn0 == -MDL_INF ? 0.0f : mn0, z1 = mn1 == -MDL_INF ? 0.0f : mn1;");
  ec_line(&e->core, "const float c0 = exp2f(m0 - z0), c1 = exp2f(m1 - z1);");
  ec_line(&e->core, "m0 = mn0;");
  ec_line(&e->core, "m1 = mn1;");
  ec_line(&e->core, "l0 *= c0;");
  ec_line(&e->core, "l1 *= c1;");
}

static void att_mma_query_rows(Emit *e, const Att *A, int rows, bool dout);
static const char *att_mma_exp(Emit *e, const Att *A, const char *s, const char *z);
static void att_mma_query_tiles(Emit *e, const Att *A, int rows, bool dp);

// Kernel variants. How many warps a tensor-core attention block should have (8 warps staging a tile
// for 128 rows, or 4 for 64: more blocks, finer causal balance, half the rows to amortize each staged
// tile over, other register limits) is a question of the device, and of the kernel: each of the
// three kernels is emitted at its first size (ATT_MMA_WARPS, ATT_MMA_DQ_WARPS) and at the other, as a
// variant of the same launch on the same arguments, and the runtime times the two on the device
// before it captures the step (--no-kernel-tuning: the first). Both compute every row's sums in the
// same order over the same tiles, so they give the same values to the bit. On GPT-2 (sm_90) the
// forward takes 128 registers at either size, dk, dv 240 and dq 168 at 4 warps, 225 at 8; the
// forward at 4 warps spills 12 bytes on sm_80. NVRTC's cold compile of GPT-2's module grows from
// about 1.5 to 2.0 s here.
static int att_other_warps(int warps) { return warps == 8 ? 4 : 8; }

// Begins an attention kernel of `warps` warps: the kernel of role `role`, or, where variant_of >= 0,
// its variant (role + "_w4", "_w8") for launch variant_of.
static void att_kbegin(Emit *e, const char *role, int warps, int variant_of) {
  cu_kbegin(e, variant_of < 0 ? role : ec_str(&e->core, "%s%sw%d", role, *role ? "_" : "", warps));
  e->variant_of = variant_of;
}

// The forward on tensor cores (att_mma), FlashAttention-2 style: a block of 8 warps per (batch, head,
// 128 queries), 16 query rows per warp with their Q in registers as mma A fragments (rounded to bf16
// once); keys and values staged in shared tiles of 64, rounded to bf16, each read by the 8 warps (with
// 4 warps per 64 queries, the staging took as long as the products: GPT-2's forward and dq, staging
// the same bytes, ran in 0.26 and 0.25 ms a layer though dq does 1.5 times the products); S = Q K^T by
// mma, scaled and masked; the online softmax of each row over the quad of lanes that holds it; e =
// exp(S - m) summed unrounded into l and, rounded, reused as the A fragments of O += P V (the
// accumulators of two adjacent n8 tiles of S are one k16 step); out = O / l in f32.
static void att_mma_kernel(Emit *e, const Att *A, int out, int warps, int variant_of) {
  int rows = 16 * warps;
  int64_t d = A->d, t = A->nt, nqt = (t + rows - 1) / rows;
  int ntiles = (int)(d / 8);
  att_kbegin(e, "", warps, variant_of);
  cu_note(e, "attention on tensor cores: B %lld, T %lld, %lld heads of %lld%s%s; a block of %d warps per (batch, head, "
             "%d queries), 16 query rows per warp, keys in tiles of %d; bf16 products (mma m16n8k16), f32 softmax",
          (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
          A->has_doc ? ", within documents" : "", warps, rows, ATT_MMA_TILE);
  // Two blocks of 8 warps an SM (four of 4), so at most 128 registers a thread: ptxas (sm_90) took 133
  // for GPT-2's forward on bf16 q, k, v, which would leave one block, and fits 128 without spilling.
  // Heads of 128 hold twice the accumulators and Q: at 128 registers they spilled 344 bytes; left
  // free, 211.
  e->min_blocks = d <= 64 ? 16 / warps : 0;
  att_mma_query_rows(e, A, rows, false);
  ec_line(&e->core, "// Per row: the running maximum m and this lane's part of the sum l; acc[n]: the output's");
  ec_line(&e->core, "// channels 8 n .. 8 n + 7 (accumulators).");
  ec_line(&e->core, "float m0 = -MDL_INF, m1 = -MDL_INF, l0 = 0.0f, l1 = 0.0f, acc[%d][4];", ntiles);
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "  acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;");
  att_mma_query_tiles(e, A, rows, false);
  att_mma_online_max(e, A);
  ec_line(&e->core, "// (where no row of the warp has a new maximum every factor is exactly 1)");
  ec_enter(&e->core, "if (__any_sync(MDL_FULL, c0 != 1.0f || c1 != 1.0f))");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "acc[n][0] *= c0;");
  ec_line(&e->core, "acc[n][1] *= c0;");
  ec_line(&e->core, "acc[n][2] *= c1;");
  ec_line(&e->core, "acc[n][3] *= c1;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_line(&e->core, "// e = exp(S - m) goes into l as it is; rounded to bf16, tiles 2 k and 2 k + 1 of S are the A");
  ec_line(&e->core, "// fragment of step k of O += P V, whose B fragment is keys 16 k + 2 tq, + 1 and 8 further of");
  ec_line(&e->core, "// channel 8 n + g.");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %d; k++)", ATT_MMA_TILE / 16);
  ec_line(&e->core, "uint32_t pa[4];");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int h = 0; h < 2; h++)");
  ec_line(&e->core, "const float (&sv)[4] = s[2 * k + h];");
  for (int r = 0; r < 2; r++)
    ec_line(&e->core, "const float e%d = %s, e%d = %s;", 2 * r,
            att_mma_exp(e, A, r ? "sv[2]" : "sv[0]", r ? "z1" : "z0"), 2 * r + 1,
            att_mma_exp(e, A, r ? "sv[3]" : "sv[1]", r ? "z1" : "z0"));
  ec_line(&e->core, "l0 += e0 + e1;");
  ec_line(&e->core, "l1 += e2 + e3;");
  ec_line(&e->core, "pa[2 * h] = mdl_bf16x2(e0, e1);");
  ec_line(&e->core, "pa[2 * h + 1] = mdl_bf16x2(e2, e3);");
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n += 2)", ntiles);
  att_mma_ldsm(e, "Vs[cur]", "vb");
  ec_line(&e->core, "mdl_mma_bf16_16816(acc[n], pa, vb);");
  ec_line(&e->core, "mdl_mma_bf16_16816(acc[n + 1], pa, vb + 2);");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_line(&e->core, "// l: the sum of the quad's four parts; out = O / l (O: acc).");
  ec_line(&e->core, "l0 += __shfl_xor_sync(MDL_FULL, l0, 1);");
  ec_line(&e->core, "l0 += __shfl_xor_sync(MDL_FULL, l0, 2);");
  ec_line(&e->core, "l1 += __shfl_xor_sync(MDL_FULL, l1, 1);");
  ec_line(&e->core, "l1 += __shfl_xor_sync(MDL_FULL, l1, 2);");
  if (A->lse >= 0) {
    ec_line(&e->core, "// The rows' log-sum-exp, which the backward reads (lane tq = 0 writes its rows'), from base 2");
    ec_line(&e->core, "// to e.");
    for (int r = 0; r < 2; r++) {
      ec_line(&e->core, "if (tq == 0 && r%d < %lld)", r, (long long)t);
      ec_line(&e->core, "  %s[(b * %lld + hd) * %lld + r%d] = (m%d + log2f(l%d)) * %s;", cu_ptr(e, A->lse),
              (long long)A->heads, (long long)t, r, r, r, cu_flit(e, 1 / LOG2E));
    }
  }
  const char *o = e->out_f32 ? cu_ptr(e, out) : NULL;
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "const int c = 8 * n + 2 * tq;");
  for (int r = 0; r < 2; r++) {
    const char *ix = ec_str(&e->core, "(b * %lld + r%d) * %lld + hd * %lld + c", (long long)t, r, (long long)A->nc,
                            (long long)d);
    ec_enter(&e->core, "if (r%d < %lld)", r, (long long)t);
    ec_line(&e->core, "const float y0 = acc[n][%d] / l%d, y1 = acc[n][%d] / l%d;", 2 * r, r, 2 * r + 1, r);
    if (e->out_f32)
      ec_line(&e->core, "*(float2 *)&%s[%s] = make_float2(y0, y1);", o, ix);
    for (int k = 0; k < e->nout_cast; k++)
      ec_line(&e->core, "*(ushort2 *)&%s[%s] = make_ushort2(mdl_f32_to_bf16(y0), mdl_f32_to_bf16(y1));",
              cu_ptr(e, e->out_cast[k]), ix);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  cu_kend(e, A->nb * A->heads * nqt, 32 * warps);
}

// ATTENTION forward: on tensor cores where att_mma allows, else on CUDA cores (att_query_kernel); with
// its ATTENTION_LSE (rule 3 of fuse.c) it stores the rows' log-sum-exp as well. An ATTENTION_LSE alone
// (no fusion) computes the scores and their statistics only.
void cu_emit_attention(Emit *e, int gi) {
  int a, lse;
  ec_attention_members(&e->core, gi, &a, &lse);
  const IrNode *nd = ec_node(&e->core, a >= 0 ? a : lse);
  Att A = att_of(e, nd);
  A.q = cu_rows_of(e, nd->in[0]);
  A.k = cu_rows_of(e, nd->in[1]);
  A.v = cu_rows_of(e, nd->in[2]);
  A.doc = A.has_doc ? ec_need(&e->core, nd->in[3]) : -1;
  A.lse = lse;
  cu_flush(e);
  e->nout_cast = a >= 0 ? ec_output_casts(&e->core, a, e->out_cast, 4, &e->out_f32) : 0;
  if (a >= 0 && e->out_f32 && ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  if (lse >= 0 && ec_offset(&e->core, lse) < 0)
    e->core.scratch[lse] = true;
  ec_phase_begin(&e->core);
  if (a < 0)
    att_query_kernel(e, &A, ATT_STATS, -1, -1);
  else if (att_mma(&A)) {
    int l = e->nsl;
    att_mma_kernel(e, &A, a, ATT_MMA_WARPS, -1);
    att_mma_kernel(e, &A, a, att_other_warps(ATT_MMA_WARPS), l);
  } else
    att_query_kernel(e, &A, ATT_FWD, a, -1);
  if (a >= 0 && e->out_f32)
    ec_phase_done(&e->core, a);
  for (int k = 0; k < e->nout_cast; k++)
    ec_phase_done(&e->core, e->out_cast[k]);
  if (lse >= 0)
    ec_phase_done(&e->core, lse);
  ec_phase_end(&e->core);
  e->nout_cast = 0;
  e->out_f32 = false;
}

// dk and dv: one warp per (batch, head, tile of 32 keys), a key per lane, the query rows that may
// see the tile taken in order through shared tiles; each key's sums are its lane's alone. bf16: q, k,
// v and dout rounded as they are staged, dk reads dS rounded and dv reads P rounded.
static void att_key_kernel(Emit *e, const Att *A, int dk, int dv, int64_t dsum) {
  const char *ixt = e->core.ixt;
  int64_t d = A->d, t = A->nt, nkt = (t + ATT_BK - 1) / ATT_BK;
  int64_t kv = 2 * ATT_BK * (d + 1) * 4 + ATT_BK * 4;
  int bq = 32;
  while (bq > 4 && kv + bq * (2 * d * 4 + 12) > 48 << 10)
    bq /= 2;
  if (kv + bq * (2 * d * 4 + 12) > 48 << 10)
    ec_fail(&e->core, "step %s: attention heads of %lld do not fit in shared memory", e->core.f->steps[e->core.si].name,
            (long long)d);
  cu_kbegin(e, "dkv");
  cu_note(e, "attention backward, %s: B %lld, T %lld, %lld heads of %lld%s%s; a warp per (batch, head, %d keys), "
             "a key per lane, queries in tiles of %d", dk >= 0 && dv >= 0 ? "dk and dv" : dk >= 0 ? "dk" : "dv",
          (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
          A->has_doc ? ", within documents" : "", ATT_BK, bq);
  e->shared = (int)(kv + bq * (2 * d * 4 + 12));
  ec_line(&e->core, "__shared__ float Ks[%d][%lld], Qs[%d][%lld], Os[%d][%lld], Ls[%d];", ATT_BK, (long long)d + 1, bq,
          (long long)d, bq, (long long)d, bq);
  if (dk >= 0)
    ec_line(&e->core, "__shared__ float Vs[%d][%lld], Ss[%d];", ATT_BK, (long long)d + 1, bq);
  if (A->has_doc)
    ec_line(&e->core, "__shared__ int32_t Dk[%d], Dq[%d];", ATT_BK, bq);
  const char *lp = cu_ptr(e, A->lse);
  const char *sp = dk >= 0 ? cu_raw_ptr(e, dsum, "float", "dout . out per row") : NULL;
  ec_line(&e->core, "const int lane = threadIdx.x;");
  att_block(e, A, nkt, ATT_BK, "k0", false);
  ec_line(&e->core, "const %s j = k0 + lane;", ixt);
  ec_enter(&e->core, "for (int u = lane; u < %lld; u += 32)", (long long)(ATT_BK * d));
  ec_line(&e->core, "const int jj = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = k0 + jj < %lld;", (long long)t);
  ec_line(&e->core, "Ks[jj][c] = in ? %s : 0.0f;", att_elem(e, A, A->k, "k0 + jj", "c"));
  if (dk >= 0)
    ec_line(&e->core, "Vs[jj][c] = in ? %s : 0.0f;", att_elem(e, A, A->v, "k0 + jj", "c"));
  ec_leave(&e->core);
  if (A->has_doc)
    ec_line(&e->core, "Dk[lane] = j < %lld ? %s[b * %lld + j] : 0;", (long long)t, cu_ptr(e, A->doc), (long long)t);
  if (dk >= 0)
    ec_line(&e->core, "float dka[%lld];", (long long)d);
  if (dv >= 0)
    ec_line(&e->core, "float dva[%lld];", (long long)d);
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  %s%s0.0f;", dk >= 0 ? "dka[c] = " : "", dv >= 0 ? "dva[c] = " : "");
  ec_enter(&e->core, "for (%s i0 = %s; i0 < %lld; i0 += %d)", ixt, A->causal ? "k0" : "0", (long long)t, bq);
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "for (int u = lane; u < %lld; u += 32)", (long long)(bq * d));
  ec_line(&e->core, "const int ii = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = i0 + ii < %lld;", (long long)t);
  ec_line(&e->core, "Qs[ii][c] = in ? %s : 0.0f;", att_elem(e, A, A->q, "i0 + ii", "c"));
  ec_line(&e->core, "Os[ii][c] = in ? %s : 0.0f;", att_elem(e, A, A->dout, "i0 + ii", "c"));
  ec_leave(&e->core);
  ec_enter(&e->core, "for (int u = lane; u < %d; u += 32)", bq);
  ec_line(&e->core, "const bool in = i0 + u < %lld;", (long long)t);
  ec_line(&e->core, "Ls[u] = in ? %s[(b * %lld + hd) * %lld + i0 + u] : 0.0f;", lp, (long long)A->heads, (long long)t);
  if (dk >= 0)
    ec_line(&e->core, "Ss[u] = in ? %s[(b * %lld + hd) * %lld + i0 + u] : 0.0f;", sp, (long long)A->heads,
            (long long)t);
  if (A->has_doc)
    ec_line(&e->core, "Dq[u] = in ? %s[b * %lld + i0 + u] : 0;", cu_ptr(e, A->doc), (long long)t);
  ec_leave(&e->core);
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "for (int ii = 0; ii < %d; ii++)", bq);
  ec_line(&e->core, "const %s i = i0 + ii;", ixt);
  ec_line(&e->core, "if (i >= %lld)", (long long)t);
  ec_line(&e->core, "  break;");
  ec_line(&e->core, "if (!(%s))", att_allowed(e, A, "Dq[ii]", "Dk[lane]"));
  ec_line(&e->core, "  continue;");
  ec_line(&e->core, "float dot = 0.0f;");
  ec_line(&e->core, "#pragma unroll 8");
  ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  dot += Qs[ii][c] * Ks[lane][c];");
  ec_line(&e->core, "const float p = expf(dot * %s - Ls[ii]);", cu_flit(e, A->scale));
  if (dv >= 0) {
    if (A->bf16)
      ec_line(&e->core, "const float pr = mdl_bf16_to_f32(mdl_f32_to_bf16(p)); // dv reads P rounded");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dva[c] += %s * Os[ii][c];", A->bf16 ? "pr" : "p");
  }
  if (dk >= 0) {
    ec_line(&e->core, "float dp = 0.0f;");
    ec_line(&e->core, "#pragma unroll 8");
    ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dp += Os[ii][c] * Vs[lane][c];");
    ec_line(&e->core, "const float ds = %s;%s",
            A->bf16 ? "mdl_bf16_to_f32(mdl_f32_to_bf16(p * (dp - Ss[ii])))" : "p * (dp - Ss[ii])",
            A->bf16 ? " // dk reads dS rounded" : "");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dka[c] += ds * Qs[ii][c];");
  }
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_enter(&e->core, "if (j < %lld)", (long long)t);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
  if (dk >= 0)
    ec_line(&e->core, "%s[(b * %lld + j) * %lld + hd * %lld + c] = %s * dka[c];", cu_ptr(e, dk), (long long)t,
            (long long)A->nc, (long long)d, cu_flit(e, A->scale));
  if (dv >= 0)
    ec_line(&e->core, "%s[(b * %lld + j) * %lld + hd * %lld + c] = dva[c];", cu_ptr(e, dv), (long long)t,
            (long long)A->nc, (long long)d);
  ec_leave(&e->core);
  ec_leave(&e->core);
  cu_kend(e, A->nb * A->heads * nkt, 32);
}

// Shared memory of the tensor-core backward kernels: two tiles of 64 rows as bf16 channel pairs, rows
// padded by 8 channels (keys and values for dq; queries and dout, with their log-sum-exp and D, for dk
// and dv), and the tile's documents.
static int64_t att_mma_bwd_shared(const Att *A, bool keys) {
  return att_mma_shared(A) + (keys ? 2 * ATT_MMA_TILE * 4 : 0);
}

// Does the backward run its dq and dk, dv kernels on tensor cores: as the forward (att_mma), and
// q and dout also read by float4 loads.
static bool att_mma_bwd(const Att *A) {
  return att_mma(A) && att_mma_bwd_shared(A, true) <= 48 << 10 && att_rows16(A->q) && att_rows16(A->dout);
}

// Whether rows of r can be copied to shared memory as they are, 16 bytes (8 channels) at a time by
// cp.async: bf16, with stride and start multiples of 8 elements.
static bool att_rows_async(Emit *e, Rows r) { return att_stored16(e, r) && r.stride % 8 == 0 && r.at % 8 == 0; }

// One row's share of att_mma_stage for the thread's (jj, c): the 8 channels from c by cp.async, or 4
// by a load and a store (x: the local for them).
static void att_mma_stage_row(Emit *e, const Att *A, const char *x0, Rows r, const char *sh, const char *buf,
                              const char *x) {
  const char *jj = strcmp(x0, "0") ? ec_str(&e->core, "%s + jj", x0) : "jj";
  if (att_rows_async(e, r)) { // (beyond T the copy reads nothing, from row x0, and fills zeros)
    ec_line(&e->core, "mdl_cp_async16(&%s[%s][jj][c / 2], &%s, in);", sh, buf,
            at_row(e, r, A, ec_str(&e->core, "(in ? %s : %s)", jj, x0), "c"));
  } else if (att_stored16(e, r)) { // four bf16 values: the two pairs as they are
    ec_line(&e->core, "const ushort4 %s = in ? *(const ushort4 *)&%s : make_ushort4(0, 0, 0, 0);", x,
            at_row(e, r, A, jj, "c"));
    ec_line(&e->core, "%s[%s][jj][c / 2] = (uint32_t)%s.x | (uint32_t)%s.y << 16;", sh, buf, x, x);
    ec_line(&e->core, "%s[%s][jj][c / 2 + 1] = (uint32_t)%s.z | (uint32_t)%s.w << 16;", sh, buf, x, x);
  } else {
    ec_line(&e->core, "const float4 %s = in ? *(const float4 *)&%s : make_float4(0.0f, 0.0f, 0.0f, 0.0f);", x,
            at_row(e, r, A, jj, "c"));
    ec_line(&e->core, "%s[%s][jj][c / 2] = mdl_bf16x2(%s.x, %s.y);", sh, buf, x, x);
    ec_line(&e->core, "%s[%s][jj][c / 2 + 1] = mdl_bf16x2(%s.z, %s.w);", sh, buf, x, x);
  }
}

// Starts staging rows x0 + jj (jj < 64) of a and b (unless bs is NULL), as bf16, into buffer buf of
// the shared tiles as and bs (channel pairs), by the block's threads; 0 beyond T. Rows that
// att_rows_async allows go by cp.async (the caller commits and waits); others (f32 rows, which are
// rounded here, or rows not 16-byte aligned) by loads and stores that are done when this returns.
static void att_mma_stage(Emit *e, const Att *A, int threads, const char *x0, Rows a, const char *as, Rows b,
                          const char *bs, const char *buf) {
  int64_t d = A->d;
  int per_a = att_rows_async(e, a) ? 8 : 4, per_b = bs && att_rows_async(e, b) ? 8 : 4; // channels at a time
  for (int i = 0; i < (bs ? 2 : 1); i++) {
    int per = i ? per_b : per_a;
    if (i && per_b == per_a) { // one loop for both
      att_mma_stage_row(e, A, x0, b, bs, buf, "bx");
      break;
    }
    if (i)
      ec_leave(&e->core);
    ec_enter(&e->core, "for (int u = threadIdx.x; u < %lld; u += %d)", (long long)(ATT_MMA_TILE * d / per), threads);
    ec_line(&e->core, "const int jj = u / %lld, c = u %% %lld * %d;", (long long)(d / per), (long long)(d / per), per);
    ec_line(&e->core, "const bool in = %s%s < %lld;", strcmp(x0, "0") ? ec_str(&e->core, "%s + ", x0) : "", "jj",
            (long long)A->nt);
    att_mma_stage_row(e, A, x0, i ? b : a, i ? bs : as, buf, i ? "bx" : "ax");
  }
  ec_leave(&e->core);
}

// Starts staging per-row values of the tile's rows x0 + jj by threads jj < 64 into buffer buf: what
// names the destinations (shared arrays), from the element expressions src (each row jj of the
// tile, by cp.async of 4 bytes, 0 beyond T).
static void att_mma_stage_rows(Emit *e, const Att *A, const char *x0, const char *buf, int n, const char *const *dst,
                               const char *const *src) {
  ec_enter(&e->core, "if (threadIdx.x < %d)", ATT_MMA_TILE);
  ec_line(&e->core, "const %s i = %sthreadIdx.x, at = i < %lld ? i : %s; // (beyond T: read nothing, from %s)",
          e->core.ixt, strcmp(x0, "0") ? ec_str(&e->core, "%s + ", x0) : "", (long long)A->nt, x0, x0);
  for (int k = 0; k < n; k++)
    ec_line(&e->core, "mdl_cp_async4(&%s[%s][threadIdx.x], &%s, i < %lld);", dst[k], buf, src[k], (long long)A->nt);
  ec_leave(&e->core);
}

// How many buffers of `bytes` a block's tiles take: two where they fit in 48 KB (the next tile's
// copies then run while the warps compute on this one), else one.
static int att_mma_stages(int64_t bytes) { return 2 * bytes <= 48 << 10 ? 2 : 1; }

// What a block stages per tile: rows of a and b (unless bs is NULL) into the shared tiles as and bs,
// and nrow per-row values (att_mma_stage_rows), by its `threads`.
typedef struct {
  int threads;
  Rows a, b;
  const char *as, *bs;
  int nrow;
  const char *rdst[3], *rsrc[3];
} AttStage;

static void att_mma_issue(Emit *e, const Att *A, const AttStage *st, const char *x0, const char *buf) {
  att_mma_stage(e, A, st->threads, x0, st->a, st->as, st->b, st->bs, buf);
  if (st->nrow)
    att_mma_stage_rows(e, A, x0, buf, st->nrow, st->rdst, st->rsrc);
}

// Opens the loop over the tiles var = start, start + 64, .. < end, each staged into buffer `cur` of
// `stages` (att_mma_stages) and in shared memory for every warp where the loop's body begins. With
// two, tile 0's copies start before the loop and each tile starts the next one's into the other
// buffer before it waits for its own: the copies run while the warps compute.
static void att_mma_tile_loop(Emit *e, const Att *A, const AttStage *st, int stages, const char *var,
                              const char *start, const char *end) {
  const char *ixt = e->core.ixt;
  if (stages == 2) {
    att_mma_issue(e, A, st, start, "0");
    ec_line(&e->core, "mdl_cp_async_commit();");
    ec_enter(&e->core, "for (%s %s = %s, cur = 0; %s < %s; %s += %d, cur ^= 1)", ixt, var, start, var, end, var,
             ATT_MMA_TILE);
    ec_line(&e->core, "__syncthreads(); // (every warp is done with the other buffer: the tile before)");
    ec_enter(&e->core, "if (%s + %d < %s)", var, ATT_MMA_TILE, end);
    att_mma_issue(e, A, st, ec_str(&e->core, "%s + %d", var, ATT_MMA_TILE), "cur ^ 1");
    ec_leave(&e->core);
    ec_line(&e->core, "mdl_cp_async_commit();");
    ec_line(&e->core, "mdl_cp_async_wait<1>(); // this tile's copies have landed; the next tile's may be in flight");
  } else {
    ec_line(&e->core, "// (one buffer: cur stays 0)");
    ec_enter(&e->core, "for (%s %s = %s, cur = 0; %s < %s; %s += %d)", ixt, var, start, var, end, var, ATT_MMA_TILE);
    ec_line(&e->core, "__syncthreads();");
    att_mma_issue(e, A, st, var, "cur");
    ec_line(&e->core, "mdl_cp_async_commit();");
    ec_line(&e->core, "mdl_cp_async_wait<0>();");
  }
  ec_line(&e->core, "__syncthreads();");
}

// The A fragments of the k16 steps over the channels of rows r0 and r1 = r0 + 8 of x, as bf16; 0
// beyond T.
static void att_mma_frags(Emit *e, const Att *A, Rows x, const char *name) {
  ec_line(&e->core, "uint32_t %s[%lld][4];", name, (long long)(A->d / 16));
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %lld; k++)", (long long)(A->d / 16));
  ec_line(&e->core, "const int c = 16 * k + 2 * tq;");
  for (int r = 0; r < 4; r++) {
    const char *row = r & 1 ? "r1" : "r0", *c0 = r & 2 ? "c + 8" : "c", *c1 = r & 2 ? "c + 9" : "c + 1";
    ec_line(&e->core, "%s[k][%d] = %s < %lld ? %s : 0u;", name, r, row, (long long)A->nt,
            att_pair(e, A, x, row, c0, c1));
  }
  ec_leave(&e->core);
}

// exp2(s scale log2(e) - z) for an unscaled score s of att_mma_scores and z (a maximum or log-sum-exp)
// in base 2: e^(scale s) over e^z', the product and the difference in one FMA.
static const char *att_mma_exp(Emit *e, const Att *A, const char *s, const char *z) {
  return ec_str(&e->core, "exp2f(fmaf(%s, %s, -%s))", s, cu_flit(e, A->scale * LOG2E), z);
}

// The two products of a tile with the warp's rows by mma: s = X Y^T (unscaled: the kernels take exp2f
// of s times scale log2(e) less a maximum or log-sum-exp in base 2, one FMA, cheaper than expf of a
// scaled s less the maximum; att_mma_exp) and dp = Z W^T (unless za is NULL) over the channels, X, Z
// as A fragments xa, za; Y, W the shared tiles ys, ws; tile n of s, dp: columns 8 n .. 8 n + 7 of the
// tile (B fragment: row 8 n + g of ys, channels 16 k + 2 tq, + 1 and 8 further).
static void att_mma_scores(Emit *e, const Att *A, const char *xa, const char *ys, const char *za, const char *ws) {
  int stiles = ATT_MMA_TILE / 8;
  if (za)
    ec_line(&e->core, "float s[%d][4], dp[%d][4];", stiles, stiles);
  else
    ec_line(&e->core, "float s[%d][4];", stiles);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", stiles);
  ec_line(&e->core, "s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;");
  if (za)
    ec_line(&e->core, "dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;");
  ec_leave(&e->core);
  ec_line(&e->core, "// (the B fragments of step k of tiles n and n + 1 by one ldmatrix: lanes 0-7 give rows 8 n ..");
  ec_line(&e->core, "// 8 n + 7 at channel 16 k, lanes 8-15 the same rows at 16 k + 8, lanes 16-31 rows 8 n + 8 ..)");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n += 2)", stiles);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %lld; k++)", (long long)(A->d / 16));
  for (int i = 0; i < (za ? 2 : 1); i++) {
    const char *b = i ? "wb" : "yb", *x = i ? za : xa, *acc = i ? "dp" : "s";
    ec_line(&e->core, "uint32_t %s[4];", b);
    ec_line(&e->core, "mdl_ldsm_x4(%s, (const uint16_t *)%s[8 * n + (lane & 7) + (lane >> 4) * 8] + 16 * k + "
            "(lane >> 3 & 1) * 8);", b, i ? ws : ys);
    ec_line(&e->core, "mdl_mma_bf16_16816(%s[n], %s[k], %s);", acc, x, b);
    ec_line(&e->core, "mdl_mma_bf16_16816(%s[n + 1], %s[k], %s + 2);", acc, x, b);
  }
  ec_leave(&e->core);
  ec_leave(&e->core);
}

// Within documents, the warp's 16 rows (documents d0, d1 of each lane) against the staged tile's 64
// (documents tile_docs[]): when the rows are all of one document, a tile with none of its rows in it has
// nothing for them (`none`: att_mma_skip) and one with all of them in it needs no document mask
// (`one`), by three votes of the warp in place of a comparison per score. Any documents are allowed,
// in any order; packed sequences make most tiles one or the other.
static void att_mma_docs(Emit *e, const char *tile_docs) {
  _Static_assert(ATT_MMA_TILE == 64, "a tile's documents are read two a lane");
  ec_line(&e->core, "// Documents: the warp's rows all in dw's (rows1); the tile's rows none or all in it.");
  ec_line(&e->core, "const int32_t dw = __shfl_sync(MDL_FULL, d0, 0), dt0 = %s[lane], dt1 = %s[lane + 32];",
          tile_docs, tile_docs);
  ec_line(&e->core, "const bool rows1 = __all_sync(MDL_FULL, d0 == dw && d1 == dw);");
  ec_line(&e->core, "const bool none = rows1 && __all_sync(MDL_FULL, dt0 != dw && dt1 != dw);");
  ec_line(&e->core, "const bool one = rows1 && __all_sync(MDL_FULL, dt0 == dw && dt1 == dw);");
}

// Masks s (-inf where the query may not see the key) when `edge` holds: ij
// declares i and j of accumulator x of tile n, di and dj are their documents; row_bound: the query
// (a column) must be below T too.
static void att_mma_mask(Emit *e, const Att *A, const char *edge, const char *ij, const char *dj, const char *di,
                         bool row_bound) {
  ec_enter(&e->core, "if (%s)", edge);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ATT_MMA_TILE / 8);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int x = 0; x < 4; x++)");
  ec_line(&e->core, "const %s %s;", e->core.ixt, ij);
  ec_line(&e->core, "if (!(%s%s))", row_bound ? ec_str(&e->core, "i < %lld && ", (long long)A->nt) : "",
          att_allowed(e, A, di, dj));
  ec_line(&e->core, "  s[n][x] = -MDL_INF;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
}

// The set-up of a block by query tile on tensor cores (the forward's and dq's): `rows` queries of a
// (batch, head), 16 query rows per warp, with Q (and dout for dq) as mma A fragments in registers,
// and the shared tiles of keys and values (bf16 pairs, rows 16-byte aligned for ldmatrix).
static void att_mma_query_rows(Emit *e, const Att *A, int rows, bool dout) {
  const char *ixt = e->core.ixt;
  int64_t t = A->nt, nqt = (t + rows - 1) / rows;
  int stages = att_mma_stages(att_mma_shared(A));
  e->shared = (int)(stages * att_mma_shared(A));
  long long pairs = A->d / 2 + 4;
  ec_line(&e->core, "// The tiles' keys and values as bf16 pairs%s.", stages == 2 ? ", in two buffers" : "");
  ec_line(&e->core, "__shared__ __align__(16) uint32_t Ks[%d][%d][%lld], Vs[%d][%d][%lld];", stages, ATT_MMA_TILE,
          pairs, stages, ATT_MMA_TILE, pairs);
  if (A->has_doc)
    ec_line(&e->core, "__shared__ int32_t Dk[%d][%d];", stages, ATT_MMA_TILE);
  ec_line(&e->core, "const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;");
  att_block(e, A, nqt, rows, "q0", true);
  ec_line(&e->core, "// The lane's query rows: r0 (accumulators 0 and 1 of a tile) and r1 (2 and 3).");
  ec_line(&e->core, "const %s r0 = q0 + 16 * w + g, r1 = r0 + 8;", ixt);
  ec_line(&e->core, "// Q%s as the A fragments of the k16 steps over the channels, rounded once; 0 beyond T.",
          dout ? " and dout" : "");
  att_mma_frags(e, A, A->q, "qa");
  if (dout)
    att_mma_frags(e, A, A->dout, "oa");
  if (A->has_doc)
    ec_line(&e->core, "const int32_t d0 = r0 < %lld ? %s[b * %lld + r0] : 0, d1 = r1 < %lld ? %s[b * %lld + r1] : 0;",
            (long long)t, cu_ptr(e, A->doc), (long long)t, (long long)t, cu_ptr(e, A->doc), (long long)t);
}

// Opens the loop over the key tiles of the block's `rows` queries (att_mma_query_rows): stages the
// tile, and leaves S = Q K^T (scaled, -inf where the row may not see the key) in s and, with dp,
// dP = dout V^T in dp.
static void att_mma_query_tiles(Emit *e, const Att *A, int rows, bool dp) {
  const char *ixt = e->core.ixt;
  int64_t t = A->nt;
  if (A->causal)
    ec_line(&e->core, "const %s kend = q0 + %d < %lld ? q0 + %d : %lld; // later keys are masked for every row", ixt,
            rows, (long long)t, rows, (long long)t);
  else
    ec_line(&e->core, "const %s kend = %lld;", ixt, (long long)t);
  AttStage st = {.threads = rows / 16 * 32, .a = A->k, .b = A->v, .as = "Ks", .bs = "Vs"}; // (a warp per 16 rows)
  if (A->has_doc) {
    st.rdst[st.nrow] = "Dk";
    st.rsrc[st.nrow++] = ec_str(&e->core, "%s[b * %lld + at]", cu_ptr(e, A->doc), (long long)t);
  }
  att_mma_tile_loop(e, A, &st, att_mma_stages(att_mma_shared(A)), "k0", "0", "kend");
  if (A->has_doc)
    att_mma_docs(e, "Dk[cur]");
  att_mma_skip(e, A, rows, "k0 > q0 + 16 * w + 15", "the warp's rows see none of the tile's keys");
  ec_line(&e->core, "// S = Q K^T (unscaled)%s: tile n holds keys k0 + 8 n .. k0 + 8 n + 7.",
          dp ? " and dP = dout V^T" : "");
  att_mma_scores(e, A, "qa", "Ks[cur]", dp ? "oa" : NULL, "Vs[cur]");
  const char *edge = ec_str(&e->core, "%sk0 + %d > %lld%s", A->has_doc ? "!one || " : "", ATT_MMA_TILE, (long long)t,
                            A->causal ? ec_str(&e->core, " || k0 + %d > q0 + 16 * w", ATT_MMA_TILE - 1) : "");
  ec_line(&e->core, "// Keys the row may not see get -inf (in tiles past T%s%s).",
          A->causal ? ", past a row of the warp" : "", A->has_doc ? ", in other documents" : "");
  const char *ij = A->causal ? "i = x < 2 ? r0 : r1, j = k0 + 8 * n + 2 * tq + (x & 1)"
                             : "j = k0 + 8 * n + 2 * tq + (x & 1)";
  att_mma_mask(e, A, edge, ij, "Dk[cur][j - k0]", "(x < 2 ? d0 : d1)", false);
}

// D = dout . out for each row of each head (mdl.h: both as the backward reads them, a bf16 CAST
// widened or an f32 value rounded when the products are bf16), which dS = P (dP - D) subtracts in the
// dq and dk kernels: a warp per (batch, row, head), a channel per lane.
static void att_dsum_kernel(Emit *e, const Att *A, int64_t dsum) {
  const char *ixt = e->core.ixt;
  int64_t rows = A->nb * A->nt * A->heads;
  cu_kbegin(e, "dsum");
  cu_note(e, "attention backward, D = dout . out: B %lld, T %lld, %lld heads of %lld; a warp per row of a head",
          (long long)A->nb, (long long)A->nt, (long long)A->heads, (long long)A->d);
  const char *sp = cu_raw_ptr(e, dsum, "float", "dout . out per row");
  ec_line(&e->core, "const %s u = (%s)blockIdx.x * 8 + (threadIdx.x >> 5);", ixt, ixt);
  ec_line(&e->core, "const int lane = threadIdx.x & 31;");
  ec_line(&e->core, "if (u >= %lld)", (long long)rows);
  ec_line(&e->core, "  return; // the whole warp");
  ec_line(&e->core, "const %s b = u / %lld, i = u / %lld %% %lld, hd = u %% %lld;", ixt, (long long)(A->nt * A->heads),
          (long long)A->heads, (long long)A->nt, (long long)A->heads);
  ec_line(&e->core, "float dd = 0.0f;");
  char stmt[512];
  snprintf(stmt, sizeof stmt, "dd += %s * %s;", att_elem(e, A, A->dout, "i", "lane + 32 * t"),
           att_elem(e, A, A->o, "i", "lane + 32 * t"));
  lanes_stmt(e, A, stmt);
  ec_line(&e->core, "dd = mdl_warp_sumf(dd);");
  ec_line(&e->core, "if (lane == 0)");
  ec_line(&e->core, "  %s[(b * %lld + hd) * %lld + i] = dd;", sp, (long long)A->heads, (long long)A->nt);
  cu_kend(e, (rows + 7) / 8, 256);
}

// dq on tensor cores (att_mma_bwd), FlashAttention-2's backward by query tile: a block of 4 warps per
// (batch, head, 64 queries), 16 query rows per warp with Q and dout as mma A fragments (bf16);
// keys and values staged in shared tiles of 64 as bf16; S = Q K^T and dP = dout V^T by mma, P =
// exp(S - lse), dS = P (dP - D) in f32; rounded, the dS accumulators of two adjacent n8 tiles are the
// A fragment of one k16 step of dq += dS K; dq = scale dq.
static void att_mma_dq_kernel(Emit *e, const Att *A, int out, int64_t dsum, int warps, int variant_of) {
  int rows = 16 * warps;
  int64_t d = A->d, t = A->nt, nqt = (t + rows - 1) / rows;
  int ntiles = (int)(d / 8);
  att_kbegin(e, "dq", warps, variant_of);
  cu_note(e, "attention backward, dq on tensor cores: B %lld, T %lld, %lld heads of %lld%s%s; a block of %d warps per "
             "(batch, head, %d queries), 16 query rows per warp, keys in tiles of %d; bf16 products (mma m16n8k16)",
          (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
          A->has_doc ? ", within documents" : "", warps, rows, ATT_MMA_TILE);
  att_mma_query_rows(e, A, rows, true);
  const char *lp = cu_ptr(e, A->lse);
  const char *sp = cu_raw_ptr(e, dsum, "float", "dout . out per row");
  ec_line(&e->core, "// The rows' log-sum-exp in base 2 (as s), and D.");
  for (int r = 0; r < 2; r++)
    ec_line(&e->core, "const float l%d = r%d < %lld ? %s[(b * %lld + hd) * %lld + r%d] * %s : 0.0f, "
            "s%d = r%d < %lld ? %s[(b * %lld + hd) * %lld + r%d] : 0.0f;", r, r, (long long)t, lp,
            (long long)A->heads, (long long)t, r, cu_flit(e, LOG2E), r, r, (long long)t, sp, (long long)A->heads,
            (long long)t, r);
  ec_line(&e->core, "float acc[%d][4]; // dq's channels 8 n .. 8 n + 7", ntiles);
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "  acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;");
  att_mma_query_tiles(e, A, rows, true);
  ec_line(&e->core, "// P = exp(S - lse), dS = P (dP - D); rounded, tiles 2 k and 2 k + 1 of dS are the A fragment");
  ec_line(&e->core, "// of step k of dq += dS K, whose B fragment is keys 16 k + 2 tq, + 1 and 8 further of");
  ec_line(&e->core, "// channel 8 n + g.");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %d; k++)", ATT_MMA_TILE / 16);
  ec_line(&e->core, "uint32_t da[4];");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int h = 0; h < 2; h++)");
  ec_line(&e->core, "const float (&sv)[4] = s[2 * k + h], (&pv)[4] = dp[2 * k + h];");
  for (int r = 0; r < 2; r++)
    ec_line(&e->core, "da[2 * h%s] = mdl_bf16x2(%s * (pv[%d] - s%d), %s * (pv[%d] - s%d));", r ? " + 1" : "",
            att_mma_exp(e, A, r ? "sv[2]" : "sv[0]", r ? "l1" : "l0"), 2 * r, r,
            att_mma_exp(e, A, r ? "sv[3]" : "sv[1]", r ? "l1" : "l0"), 2 * r + 1, r);
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n += 2)", ntiles);
  att_mma_ldsm(e, "Ks[cur]", "kb");
  ec_line(&e->core, "mdl_mma_bf16_16816(acc[n], da, kb);");
  ec_line(&e->core, "mdl_mma_bf16_16816(acc[n + 1], da, kb + 2);");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
  const char *o = cu_ptr(e, out);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "const int c = 8 * n + 2 * tq;");
  for (int r = 0; r < 2; r++) {
    ec_line(&e->core, "if (r%d < %lld)", r, (long long)t);
    ec_line(&e->core, "  *(float2 *)&%s[(b * %lld + r%d) * %lld + hd * %lld + c] = make_float2(%s * acc[n][%d], "
            "%s * acc[n][%d]);", o, (long long)t, r, (long long)A->nc, (long long)d, cu_flit(e, A->scale), 2 * r,
            cu_flit(e, A->scale), 2 * r + 1);
  }
  ec_leave(&e->core);
  cu_kend(e, A->nb * A->heads * nqt, 32 * warps);
}

// dk and dv on tensor cores (att_mma_bwd), FlashAttention-2's backward by key tile: a block of 8 warps
// per (batch, head, 128 keys), 16 keys per warp with K and V as mma A fragments (bf16); the queries that
// may see the tile, and their dout, staged in shared tiles of 64 as bf16 with their log-sum-exp and D;
// S^T = K Q^T and dP^T = V dout^T by mma, P^T = exp(S^T - lse), dS^T = P^T (dP^T - D) in f32; rounded,
// the accumulators of two adjacent n8 tiles are the A fragments of one k16 step of dv += P^T dout and
// dk += dS^T Q; dk = scale dk.
static void att_mma_dkv_kernel(Emit *e, const Att *A, int dk, int dv, int64_t dsum, int warps, int variant_of) {
  const char *ixt = e->core.ixt;
  int rows = 16 * warps;
  int64_t d = A->d, t = A->nt, nkt = (t + rows - 1) / rows;
  int ntiles = (int)(d / 8);
  att_kbegin(e, "dkv", warps, variant_of);
  cu_note(e, "attention backward, %s on tensor cores: B %lld, T %lld, %lld heads of %lld%s%s; a block of %d warps per "
             "(batch, head, %d keys), 16 keys per warp, queries in tiles of %d; bf16 products (mma m16n8k16)",
          dk >= 0 && dv >= 0 ? "dk and dv" : dk >= 0 ? "dk" : "dv", (long long)A->nb, (long long)t, (long long)A->heads,
          (long long)d, A->causal ? ", causal" : "", A->has_doc ? ", within documents" : "",
          warps, rows, ATT_MMA_TILE);
  int stages = att_mma_stages(att_mma_bwd_shared(A, true));
  e->shared = (int)(stages * att_mma_bwd_shared(A, true));
  ec_line(&e->core, "// The tiles' queries and dout as bf16 pairs, their log-sum-exp%s%s.", dk >= 0 ? " and D" : "",
          stages == 2 ? ", in two buffers" : "");
  ec_line(&e->core, "__shared__ __align__(16) uint32_t Qs[%d][%d][%lld], Os[%d][%d][%lld];", stages, ATT_MMA_TILE,
          (long long)(d / 2 + 4), stages, ATT_MMA_TILE, (long long)(d / 2 + 4));
  if (dk >= 0)
    ec_line(&e->core, "__shared__ float Ls[%d][%d], Ss[%d][%d];", stages, ATT_MMA_TILE, stages, ATT_MMA_TILE);
  else
    ec_line(&e->core, "__shared__ float Ls[%d][%d];", stages, ATT_MMA_TILE);
  if (A->has_doc)
    ec_line(&e->core, "__shared__ int32_t Dq[%d][%d];", stages, ATT_MMA_TILE);
  ec_line(&e->core, "const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;");
  att_block(e, A, nkt, rows, "k0", false);
  ec_line(&e->core, "// The lane's keys: r0 (accumulators 0 and 1 of a tile) and r1 (2 and 3).");
  ec_line(&e->core, "const %s r0 = k0 + 16 * w + g, r1 = r0 + 8;", ixt);
  ec_line(&e->core, "// K and V as the A fragments of the k16 steps over the channels, rounded once; 0 beyond T.");
  att_mma_frags(e, A, A->k, "ka");
  if (dk >= 0)
    att_mma_frags(e, A, A->v, "va");
  if (A->has_doc)
    ec_line(&e->core, "const int32_t d0 = r0 < %lld ? %s[b * %lld + r0] : 0, d1 = r1 < %lld ? %s[b * %lld + r1] : 0;",
            (long long)t, cu_ptr(e, A->doc), (long long)t, (long long)t, cu_ptr(e, A->doc), (long long)t);
  const char *lp = cu_ptr(e, A->lse);
  const char *sp = dk >= 0 ? cu_raw_ptr(e, dsum, "float", "dout . out per row") : NULL;
  ec_line(&e->core, "float %s; // channels 8 n .. 8 n + 7",
          dk >= 0 && dv >= 0 ? ec_str(&e->core, "dka[%d][4], dva[%d][4]", ntiles, ntiles)
                             : ec_str(&e->core, "%s[%d][4]", dk >= 0 ? "dka" : "dva", ntiles));
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  if (dk >= 0)
    ec_line(&e->core, "dka[n][0] = dka[n][1] = dka[n][2] = dka[n][3] = 0.0f;");
  if (dv >= 0)
    ec_line(&e->core, "dva[n][0] = dva[n][1] = dva[n][2] = dva[n][3] = 0.0f;");
  ec_leave(&e->core);
  if (A->causal)
    ec_line(&e->core, "// (queries before k0 see none of the keys)");
  AttStage st = {.threads = 32 * warps, .a = A->q, .b = A->dout, .as = "Qs", .bs = "Os", .nrow = 1,
                 .rdst = {"Ls"}, .rsrc = {ec_str(&e->core, "%s[(b * %lld + hd) * %lld + at]", lp, (long long)A->heads,
                                                  (long long)t)}};
  if (sp) {
    st.rdst[st.nrow] = "Ss";
    st.rsrc[st.nrow++] = ec_str(&e->core, "%s[(b * %lld + hd) * %lld + at]", sp, (long long)A->heads, (long long)t);
  }
  if (A->has_doc) {
    st.rdst[st.nrow] = "Dq";
    st.rsrc[st.nrow++] = ec_str(&e->core, "%s[b * %lld + at]", cu_ptr(e, A->doc), (long long)t);
  }
  att_mma_tile_loop(e, A, &st, stages, "i0", A->causal ? "k0" : "0", ec_str(&e->core, "%lld", (long long)t));
  if (A->has_doc)
    att_mma_docs(e, "Dq[cur]");
  att_mma_skip(e, A, rows, ec_str(&e->core, "i0 + %d < k0 + 16 * w", ATT_MMA_TILE - 1),
               "none of the tile's queries sees the warp's keys");
  ec_line(&e->core, "// S^T = K Q^T (unscaled)%s: tile n holds queries i0 + 8 n .. i0 + 8 n + 7.",
          dk >= 0 ? " and dP^T = V dout^T" : "");
  att_mma_scores(e, A, "ka", "Qs[cur]", dk >= 0 ? "va" : NULL, "Os[cur]");
  const char *edge = ec_str(&e->core, "%si0 + %d > %lld%s", A->has_doc ? "!one || " : "", ATT_MMA_TILE, (long long)t,
                            A->causal ? " || i0 < k0 + 16 * w + 15" : "");
  ec_line(&e->core, "// Queries that may not see the key get -inf (in tiles past T%s%s).",
          A->causal ? ", before a key of the warp" : "", A->has_doc ? ", in other documents" : "");
  att_mma_mask(e, A, edge, "i = i0 + 8 * n + 2 * tq + (x & 1), j = x < 2 ? r0 : r1", "(x < 2 ? d0 : d1)",
               "Dq[cur][i - i0]", true);
  ec_line(&e->core, "// P^T = exp(S^T - lse), dS^T = P^T (dP^T - D); rounded, tiles 2 k and 2 k + 1 are the A");
  ec_line(&e->core, "// fragments of step k of dv += P^T dout and dk += dS^T Q, whose B fragments are queries");
  ec_line(&e->core, "// 16 k + 2 tq, + 1 and 8 further of channel 8 n + g.");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %d; k++)", ATT_MMA_TILE / 16);
  ec_line(&e->core, "uint32_t %s;", dk >= 0 && dv >= 0 ? "pa[4], da[4]" : dk >= 0 ? "da[4]" : "pa[4]");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int h = 0; h < 2; h++)");
  ec_line(&e->core, "const int i = 16 * k + 8 * h + 2 * tq;");
  ec_line(&e->core, "const float (&sv)[4] = s[2 * k + h]%s;", dk >= 0 ? ", (&pv)[4] = dp[2 * k + h]" : "");
  ec_line(&e->core, "const float L0 = Ls[cur][i] * %s, L1 = Ls[cur][i + 1] * %s; // (in base 2, as s)",
          cu_flit(e, LOG2E), cu_flit(e, LOG2E));
  for (int r = 0; r < 2; r++)
    ec_line(&e->core, "const float p%d = %s, p%d = %s;", 2 * r, att_mma_exp(e, A, r ? "sv[2]" : "sv[0]", "L0"),
            2 * r + 1, att_mma_exp(e, A, r ? "sv[3]" : "sv[1]", "L1"));
  if (dv >= 0) {
    ec_line(&e->core, "pa[2 * h] = mdl_bf16x2(p0, p1);");
    ec_line(&e->core, "pa[2 * h + 1] = mdl_bf16x2(p2, p3);");
  }
  if (dk >= 0) {
    ec_line(&e->core, "const float S0 = Ss[cur][i], S1 = Ss[cur][i + 1];");
    ec_line(&e->core, "da[2 * h] = mdl_bf16x2(p0 * (pv[0] - S0), p1 * (pv[1] - S1));");
    ec_line(&e->core, "da[2 * h + 1] = mdl_bf16x2(p2 * (pv[2] - S0), p3 * (pv[3] - S1));");
  }
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n += 2)", ntiles);
  if (dv >= 0) {
    att_mma_ldsm(e, "Os[cur]", "ob");
    ec_line(&e->core, "mdl_mma_bf16_16816(dva[n], pa, ob);");
    ec_line(&e->core, "mdl_mma_bf16_16816(dva[n + 1], pa, ob + 2);");
  }
  if (dk >= 0) {
    att_mma_ldsm(e, "Qs[cur]", "qb");
    ec_line(&e->core, "mdl_mma_bf16_16816(dka[n], da, qb);");
    ec_line(&e->core, "mdl_mma_bf16_16816(dka[n + 1], da, qb + 2);");
  }
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "const int c = 8 * n + 2 * tq;");
  for (int r = 0; r < 2; r++) {
    ec_enter(&e->core, "if (r%d < %lld)", r, (long long)t);
    if (dk >= 0)
      ec_line(&e->core, "*(float2 *)&%s[(b * %lld + r%d) * %lld + hd * %lld + c] = make_float2(%s * dka[n][%d], "
              "%s * dka[n][%d]);", cu_ptr(e, dk), (long long)t, r, (long long)A->nc, (long long)d, cu_flit(e, A->scale),
              2 * r, cu_flit(e, A->scale), 2 * r + 1);
    if (dv >= 0)
      ec_line(&e->core, "*(float2 *)&%s[(b * %lld + r%d) * %lld + hd * %lld + c] = make_float2(dva[n][%d], "
              "dva[n][%d]);", cu_ptr(e, dv), (long long)t, r, (long long)A->nc, (long long)d, 2 * r, 2 * r + 1);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  cu_kend(e, A->nb * A->heads * nkt, 32 * warps);
}

// ATTENTION_BWD siblings, from the forward's log-sum-exp per row (ATTENTION_LSE): D = dout . out per
// row, then dq per query tile and dk, dv per key tile (on tensor cores where att_mma_bwd allows), each
// recomputing the probabilities P = exp(S - lse). bf16: every kernel reads q, k, v and dout rounded,
// dq and dk read dS rounded, dv reads P rounded, D reads dout and out rounded (mdl.h).
void cu_emit_attention_bwd(Emit *e, int gi) {
  const Group *gr = &e->core.groups[gi];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  int out[3] = {-1, -1, -1};
  for (int i = 0; i < gr->nmem; i++)
    out[ec_node(&e->core, gr->mem[i])->ia[3]] = gr->mem[i];
  Att A = att_of(e, nd);
  A.q = cu_rows_of(e, nd->in[0]);
  A.k = cu_rows_of(e, nd->in[1]);
  A.v = cu_rows_of(e, nd->in[2]);
  A.doc = A.has_doc ? ec_need(&e->core, nd->in[3]) : -1;
  A.dout = cu_rows_of(e, att_bwd_dout(nd));
  A.lse = ec_need(&e->core, att_bwd_lse(nd));
  bool ds = out[0] >= 0 || out[1] >= 0; // dq and dk need dS = P (dP - D); dv only P
  if (ds)
    A.o = cu_rows_of(e, att_bwd_out(nd));
  cu_flush(e);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0 && ec_offset(&e->core, out[i]) < 0)
      e->core.scratch[out[i]] = true;
  int64_t dsum = ds ? cu_scratch_alloc(e, A.nb * A.heads * A.nt * 4) : -1;
  ec_phase_begin(&e->core);
  bool mma = att_mma_bwd(&A);
  if (ds)
    att_dsum_kernel(e, &A, dsum);
  if (out[0] >= 0 && mma) {
    int l = e->nsl;
    att_mma_dq_kernel(e, &A, out[0], dsum, ATT_MMA_DQ_WARPS, -1);
    att_mma_dq_kernel(e, &A, out[0], dsum, att_other_warps(ATT_MMA_DQ_WARPS), l);
  } else if (out[0] >= 0)
    att_query_kernel(e, &A, ATT_DQ, out[0], dsum);
  if ((out[1] >= 0 || out[2] >= 0) && mma) {
    int l = e->nsl;
    att_mma_dkv_kernel(e, &A, out[1], out[2], dsum, ATT_MMA_WARPS, -1);
    att_mma_dkv_kernel(e, &A, out[1], out[2], dsum, att_other_warps(ATT_MMA_WARPS), l);
  } else if (out[1] >= 0 || out[2] >= 0)
    att_key_kernel(e, &A, out[1], out[2], dsum);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0)
      ec_phase_done(&e->core, out[i]);
  ec_phase_end(&e->core);
}
