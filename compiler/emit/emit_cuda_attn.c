// emit_cuda_attn.c: the CUDA emitter's attention, forward and backward, on CUDA cores (kernels emitted
// here) and on tensor cores (kernels that instantiate the templates of runtime/kernels/cuda_attention.cuh with the
// shapes chosen here). See emit_cuda.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
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
  int64_t ns, kvh, grp, window; // keys (k's rows), kv heads, query heads per kv head, window (0: none)
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
// With kv, the block's head is a kv head, kh (the key kernel of grouped heads).
static void att_block(Emit *e, const Att *A, int64_t nt, int64_t rows, const char *first, bool from_end, bool kv) {
  int64_t nh = kv ? A->kvh : A->heads, nbh = A->nb * nh;
  ec_line(&e->core, "const %s bh = blockIdx.x %% %lld, b = bh / %lld, %s = bh %% %lld;", e->core.ixt, (long long)nbh,
          (long long)nh, kv ? "kh" : "hd", (long long)nh);
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
  A.ns = ec_node(&e->core, nd->in[1])->shape.d[1];
  A.kvh = att_kv_heads(nd);
  A.grp = A.heads / A.kvh;
  A.window = nd->ia[6];
  A.dpl = (int)((A.d + 31) / 32);
  return A;
}

// Whether rows r are k or v ([B,S,KH*D]: kv heads), not q, dout or out.
static bool att_is_kv(const Att *A, Rows r) { return r.node == A->k.node || r.node == A->v.node; }

// The variable of the kv head of k and v: the head itself when every head has its own, else kh.
static const char *att_kvh(const Att *A) { return A->grp > 1 ? "kh" : "hd"; }

// Element (t, c) of head hd (of its kv head for k and v), batch b of rows r, as an expression.
static const char *at_row(Emit *e, Rows r, const Att *A, const char *t, const char *c) {
  bool kv = att_is_kv(A, r);
  return ec_str(&e->core, "%s[(b * %lld + %s) * %lld + %s * %lld + %s]", cu_rows_base(e, r),
                (long long)(kv ? A->ns : A->nt), t, (long long)r.stride, kv ? att_kvh(A) : "hd", (long long)A->d, c);
}

// What a kernel's note adds for kv heads, keys of another length and a window ("" for none).
static const char *att_shape_note(Emit *e, const Att *A) {
  return ec_str(&e->core, "%s%s%s", A->kvh != A->heads ? ec_str(&e->core, ", %lld kv heads", (long long)A->kvh) : "",
                A->ns != A->nt ? ec_str(&e->core, ", %lld keys", (long long)A->ns) : "",
                A->window ? ec_str(&e->core, ", window %lld", (long long)A->window) : "");
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

// The mask of key j for query row i (i's document in `di`, j's in `dj`).
static const char *att_allowed(Emit *e, const Att *A, const char *di, const char *dj) {
  return ec_str(&e->core, "j < %lld%s%s%s", (long long)A->ns, A->causal ? " && j <= i" : "",
                A->window ? ec_str(&e->core, " && i - j < %lld", (long long)A->window) : "",
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
  cu_note(e, "attention%s: B %lld, T %lld, %lld heads of %lld%s%s%s; a block per (batch, head, %d queries), "
             "keys in tiles of %d",
          mode == ATT_FWD ? (A->lse >= 0 ? " and its log-sum-exp per row" : "")
          : mode == ATT_STATS ? " statistics (log-sum-exp per row)" : " backward, dq",
          (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
          A->has_doc ? ", within documents" : "", att_shape_note(e, A), bq, ATT_BK);
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
  att_block(e, A, nqt, bq, "q0", true, false);
  if (A->grp > 1)
    ec_line(&e->core, "const %s kh = hd / %lld;", ixt, (long long)A->grp);
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
    ec_line(&e->core, "const %s kend = %lld;", ixt, (long long)A->ns);
  if (A->window) // (the tiles before the window of the block's first row: masked for all)
    ec_line(&e->core, "const %s kstart = q0 + 1 > %lld ? (q0 + 1 - %lld) / %d * %d : 0;", ixt, (long long)A->window,
            (long long)A->window, ATT_BK, ATT_BK);
  ec_enter(&e->core, "for (%s k0 = %s; k0 < kend; k0 += %d)", ixt, A->window ? "kstart" : "0", ATT_BK);
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "for (int u = threadIdx.x; u < %lld; u += %d)", (long long)(ATT_BK * d), 128);
  ec_line(&e->core, "const int jj = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = k0 + jj < %lld;", (long long)A->ns);
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

//
// Attention on tensor cores: the kernels are the templates mdl_att_fwd, mdl_att_dq and mdl_att_dkv of
// runtime/kernels/cuda_attention.cuh; these say which shapes they run at and on which buffers.
//

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

// How many buffers of `bytes` a block's tiles take: two where they fit in 48 KB (the next tile's
// copies then run while the warps compute on this one), else one.
static int att_mma_stages(int64_t bytes) { return 2 * bytes <= 48 << 10 ? 2 : 1; }

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

// The shape of a tensor-core kernel of `warps` warps whose staged tiles take `stages` buffers
// (att_mma_stages), as the prelude's mdl_att_shape (runtime/kernels/cuda_attention.cuh) takes it.
static const char *att_mma_shape(Emit *e, const Att *A, int warps, int stages) {
  bool more = A->kvh != A->heads || A->ns != A->nt || A->window; // (the defaults are left out)
  const char *kv = more ? ec_str(&e->core, ", %lld, %lld, %lld", (long long)A->kvh, (long long)A->ns,
                                 (long long)A->window) : "";
  return ec_str(&e->core, "mdl_att_shape<%s, %lld, %lld, %lld, %lld, %lld, %d, %s, %s, %d%s>", e->core.ixt,
                (long long)A->nb, (long long)A->nt, (long long)A->heads, (long long)A->d, (long long)A->nc, warps,
                A->causal ? "true" : "false", A->has_doc ? "true" : "false", stages, kv);
}

// Declares rows r (q, k, v or dout) as the prelude's mdl_att_rows, named `name`: bf16 as stored or f32,
// their stride, whether cp.async copies them (att_rows_async), and k's and v's rows where they are
// not q's.
static void att_mma_rows(Emit *e, const Att *A, Rows r, const char *name) {
  const char *len = att_is_kv(A, r) && A->ns != A->nt ? ec_str(&e->core, ", %lld", (long long)A->ns) : "";
  ec_line(&e->core, "const mdl_att_rows<%s, %lld, %s%s> %s = {%s};", att_stored16(e, r) ? "uint16_t" : "float",
          (long long)r.stride, att_rows_async(e, r) ? "true" : "false", len, name, cu_rows_base(e, r));
}

// The shape's line in the kernel, and a comment that reads its parameters.
static void att_mma_typedef(Emit *e, const Att *A, int warps, int stages) {
  ec_line(&e->core, "// (index type, B, T, heads, D, row length, warps, causal, within documents, tile buffers%s)",
          A->kvh != A->heads || A->ns != A->nt || A->window ? ", kv heads, keys, window" : "");
  ec_line(&e->core, "typedef %s S;", att_mma_shape(e, A, warps, stages));
}

// The forward on tensor cores (att_mma): mdl_att_fwd, FlashAttention-2 style, at `warps` warps a block,
// 16 query rows each (first 8: each staged tile of 64 keys and values is read by 8 warps; with 4 warps
// per 64 queries, the staging took as long as the products: GPT-2's forward and dq, staging the same
// bytes, ran in 0.26 and 0.25 ms a layer though dq does 1.5 times the products); out stored as f32
// and / or as its bf16 CASTs, and the rows' log-sum-exp with an ATTENTION_LSE.
static void att_mma_kernel(Emit *e, const Att *A, int out, int warps, int variant_of) {
  int rows = 16 * warps;
  int64_t d = A->d, t = A->nt, nqt = (t + rows - 1) / rows;
  att_kbegin(e, "", warps, variant_of);
  cu_note(e, "attention on tensor cores: B %lld, T %lld, %lld heads of %lld%s%s%s; a block of %d warps per "
             "(batch, head, %d queries), 16 query rows per warp, keys in tiles of %d; bf16 products (mma m16n8k16), "
             "f32 softmax",
          (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
          A->has_doc ? ", within documents" : "", att_shape_note(e, A), warps, rows, ATT_MMA_TILE);
  // Two blocks of 8 warps an SM (four of 4), so at most 128 registers a thread: ptxas (sm_90) took 133
  // for GPT-2's forward on bf16 q, k, v, which would leave one block, and fits 128 without spilling.
  // Heads of 128 hold twice the accumulators and Q: at 128 registers they spilled 344 bytes; left
  // free, 211.
  e->min_blocks = d <= 64 ? 16 / warps : 0;
  int stages = att_mma_stages(att_mma_shared(A));
  e->shared = (int)(stages * att_mma_shared(A));
  att_mma_typedef(e, A, warps, stages);
  att_mma_rows(e, A, A->q, "q");
  const char *doc = A->has_doc ? cu_ptr(e, A->doc) : "nullptr";
  att_mma_rows(e, A, A->k, "k");
  att_mma_rows(e, A, A->v, "v");
  const char *lse = A->lse >= 0 ? cu_ptr(e, A->lse) : "nullptr";
  const char *f32 = e->out_f32 ? cu_ptr(e, out) : "nullptr";
  Buf casts = {0};
  for (int k = 0; k < e->nout_cast; k++)
    ec_bput(&casts, "%s%s", k ? ", " : "", cu_ptr(e, e->out_cast[k]));
  ec_line(&e->core, "const mdl_att_out<%s, %d> out = {%s, {%s}}; // (f32 rows, bf16 copies)",
          e->out_f32 ? "true" : "false", e->nout_cast, f32, e->nout_cast ? ec_buf_str(&e->core, &casts) : "nullptr");
  ec_line(&e->core, "mdl_att_fwd<S, %s>(q, k, v, %s, %s, out, %s); // (documents, log-sum-exp, scale log2(e))",
          A->lse >= 0 ? "true" : "false", doc, lse, cu_flit(e, A->scale * LOG2E));
  cu_kend(e, A->nb * A->heads * nqt, 32 * warps);
}

// ATTENTION forward: on tensor cores where att_mma allows, else on CUDA cores (att_query_kernel); with
// its ATTENTION_LSE (rule 3 of fuse.c) it stores the rows' log-sum-exp as well. An ATTENTION_LSE alone
// (no fusion) computes the scores and their statistics only.
void cu_emit_attention(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a, lse;
  ec_attention_members(&e->core, gi, &a, &lse);
  const IrNode *nd = ec_node(&e->core, a >= 0 ? a : lse);
  Att A = att_of(e, nd);
  A.q = cu_rows_of(e, nd->in[0]);
  A.k = cu_rows_of(e, nd->in[1]);
  A.v = cu_rows_of(e, nd->in[2]);
  A.doc = A.has_doc ? ec_need(&e->core, nd->in[3]) : -1;
  A.lse = lse;
  ew_flush(&e->core);
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
  int64_t d = A->d, t = A->nt, ns = A->ns, nkt = (ns + ATT_BK - 1) / ATT_BK;
  int64_t kv = 2 * ATT_BK * (d + 1) * 4 + ATT_BK * 4;
  int bq = 32;
  while (bq > 4 && kv + bq * (2 * d * 4 + 12) > 48 << 10)
    bq /= 2;
  if (kv + bq * (2 * d * 4 + 12) > 48 << 10)
    ec_fail(&e->core, "step %s: attention heads of %lld do not fit in shared memory", e->core.f->steps[e->core.si].name,
            (long long)d);
  cu_kbegin(e, "dkv");
  cu_note(e, "attention backward, %s: B %lld, T %lld, %lld heads of %lld%s%s%s; a warp per (batch, %s, %d keys), "
             "a key per lane, queries in tiles of %d", dk >= 0 && dv >= 0 ? "dk and dv" : dk >= 0 ? "dk" : "dv",
          (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
          A->has_doc ? ", within documents" : "", att_shape_note(e, A),
          A->grp > 1 ? "kv head (its query heads in turn)" : "head", ATT_BK, bq);
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
  att_block(e, A, nkt, ATT_BK, "k0", false, A->grp > 1);
  ec_line(&e->core, "const %s j = k0 + lane;", ixt);
  ec_enter(&e->core, "for (int u = lane; u < %lld; u += 32)", (long long)(ATT_BK * d));
  ec_line(&e->core, "const int jj = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = k0 + jj < %lld;", (long long)ns);
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
  if (A->grp > 1) // dk and dv of the kv head: sums over its query heads
    ec_enter(&e->core, "for (%s hd = kh * %lld; hd < kh * %lld + %lld; hd++)", ixt, (long long)A->grp,
             (long long)A->grp, (long long)A->grp);
  if (A->window) // (queries past the windows of the tile's keys see none of them)
    ec_line(&e->core, "const %s qend = k0 + %lld < %lld ? k0 + %lld : %lld;", ixt, (long long)(ATT_BK - 1 + A->window),
            (long long)t, (long long)(ATT_BK - 1 + A->window), (long long)t);
  ec_enter(&e->core, "for (%s i0 = %s; i0 < %s; i0 += %d)", ixt, A->causal ? "k0" : "0",
           A->window ? "qend" : ec_str(&e->core, "%lld", (long long)t), bq);
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
  if (A->grp > 1)
    ec_leave(&e->core);
  int64_t nckv = A->kvh * d;
  ec_enter(&e->core, "if (j < %lld)", (long long)ns);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
  if (dk >= 0)
    ec_line(&e->core, "%s[(b * %lld + j) * %lld + %s * %lld + c] = %s * dka[c];", cu_ptr(e, dk), (long long)ns,
            (long long)nckv, att_kvh(A), (long long)d, cu_flit(e, A->scale));
  if (dv >= 0)
    ec_line(&e->core, "%s[(b * %lld + j) * %lld + %s * %lld + c] = dva[c];", cu_ptr(e, dv), (long long)ns,
            (long long)nckv, att_kvh(A), (long long)d);
  ec_leave(&e->core);
  ec_leave(&e->core);
  cu_kend(e, A->nb * A->kvh * nkt, 32);
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

// dq on tensor cores (att_mma_bwd): mdl_att_dq, FlashAttention-2's backward by query tile, at `warps`
// warps a block (first 4: see ATT_MMA_DQ_WARPS), 16 query rows each, from the rows' log-sum-exp and
// D (dsum).
static void att_mma_dq_kernel(Emit *e, const Att *A, int out, int64_t dsum, int warps, int variant_of) {
  int rows = 16 * warps;
  int64_t d = A->d, t = A->nt, nqt = (t + rows - 1) / rows;
  att_kbegin(e, "dq", warps, variant_of);
  cu_note(e, "attention backward, dq on tensor cores: B %lld, T %lld, %lld heads of %lld%s%s%s; a block of %d warps "
             "per (batch, head, %d queries), 16 query rows per warp, keys in tiles of %d; bf16 products (mma m16n8k16)",
          (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
          A->has_doc ? ", within documents" : "", att_shape_note(e, A), warps, rows, ATT_MMA_TILE);
  int stages = att_mma_stages(att_mma_shared(A));
  e->shared = (int)(stages * att_mma_shared(A));
  att_mma_typedef(e, A, warps, stages);
  att_mma_rows(e, A, A->q, "q");
  att_mma_rows(e, A, A->dout, "dout");
  const char *doc = A->has_doc ? cu_ptr(e, A->doc) : "nullptr";
  const char *lse = cu_ptr(e, A->lse);
  const char *sp = cu_raw_ptr(e, dsum, "float", "dout . out per row");
  att_mma_rows(e, A, A->k, "k");
  att_mma_rows(e, A, A->v, "v");
  ec_line(&e->core, "mdl_att_dq<S>(q, k, v, dout, %s, %s, %s, %s, %s, %s); // (documents, log-sum-exp, D, dq, scale "
          "log2(e), scale)", doc, lse, sp, cu_ptr(e, out), cu_flit(e, A->scale * LOG2E), cu_flit(e, A->scale));
  cu_kend(e, A->nb * A->heads * nqt, 32 * warps);
}

// dk and dv (either, or both) on tensor cores (att_mma_bwd): mdl_att_dkv, FlashAttention-2's backward
// by key tile, at `warps` warps a block (first 8), 16 keys each, from the rows' log-sum-exp and (for
// dk) D (dsum).
static void att_mma_dkv_kernel(Emit *e, const Att *A, int dk, int dv, int64_t dsum, int warps, int variant_of) {
  int rows = 16 * warps;
  int64_t d = A->d, t = A->nt, nkt = (A->ns + rows - 1) / rows;
  att_kbegin(e, "dkv", warps, variant_of);
  cu_note(e, "attention backward, %s on tensor cores: B %lld, T %lld, %lld heads of %lld%s%s%s; a block of %d warps "
             "per (batch, %s, %d keys), 16 keys per warp, queries in tiles of %d; bf16 products (mma m16n8k16)",
          dk >= 0 && dv >= 0 ? "dk and dv" : dk >= 0 ? "dk" : "dv", (long long)A->nb, (long long)t, (long long)A->heads,
          (long long)d, A->causal ? ", causal" : "", A->has_doc ? ", within documents" : "", att_shape_note(e, A),
          warps, A->grp > 1 ? "kv head (its query heads in turn)" : "head", rows, ATT_MMA_TILE);
  int stages = att_mma_stages(att_mma_bwd_shared(A, true));
  e->shared = (int)(stages * att_mma_bwd_shared(A, true));
  att_mma_typedef(e, A, warps, stages);
  att_mma_rows(e, A, A->k, "k");
  if (dk >= 0) // (dv needs P alone: no V)
    att_mma_rows(e, A, A->v, "v");
  const char *doc = A->has_doc ? cu_ptr(e, A->doc) : "nullptr";
  const char *lse = cu_ptr(e, A->lse);
  const char *sp = dk >= 0 ? cu_raw_ptr(e, dsum, "float", "dout . out per row") : "nullptr";
  att_mma_rows(e, A, A->q, "q");
  att_mma_rows(e, A, A->dout, "dout");
  const char *dks = dk >= 0 ? cu_ptr(e, dk) : "nullptr", *dvs = dv >= 0 ? cu_ptr(e, dv) : "nullptr";
  ec_line(&e->core, "mdl_att_dkv<S, %s, %s>(q, k, %s, dout, %s, %s, %s, %s, %s, %s, %s); // (documents, log-sum-exp, "
          "D, dk, dv, scale log2(e), scale)", dk >= 0 ? "true" : "false", dv >= 0 ? "true" : "false",
          dk >= 0 ? "v" : "k", doc, lse, sp, dks, dvs, cu_flit(e, A->scale * LOG2E), cu_flit(e, A->scale));
  cu_kend(e, A->nb * A->kvh * nkt, 32 * warps);
}


// ATTENTION_BWD siblings, from the forward's log-sum-exp per row (ATTENTION_LSE): D = dout . out per
// row, then dq per query tile and dk, dv per key tile (on tensor cores where att_mma_bwd allows), each
// recomputing the probabilities P = exp(S - lse). bf16: every kernel reads q, k, v and dout rounded,
// dq and dk read dS rounded, dv reads P rounded, D reads dout and out rounded (mdl.h).
void cu_emit_attention_bwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
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
  ew_outputs_open(&e->core, out, 3);
  int64_t dsum = ds ? cu_scratch_alloc(e, A.nb * A.heads * A.nt * 4) : -1;
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
  ew_outputs_done(&e->core, out, 3);
}
