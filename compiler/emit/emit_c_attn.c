// emit_c_attn.c: the C emitter's attention, forward and backward, row by row or on the GEMM library.
// See emit_c.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_c_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// Declares `var` as the sum of `expr` (in terms of j) over the keys in [lo, hi), added in 8 lanes by
// the key's place in the range and the lanes then in a fixed tree: an order that depends only on the
// row, and 8 independent chains of additions instead of one.
static void emit_attn_sum(Emit *e, const char *var, const char *expr) {
  ec_line(&e->core, "float %s;", var);
  ec_enter(&e->core, "%s", "");
  ec_line(&e->core, "float part[8] = {0};");
  ec_line(&e->core, "int64_t j0 = lo;");
  ec_enter(&e->core, "for (; j0 + 8 <= hi; j0 += 8)");
  ec_enter(&e->core, "for (int64_t u = 0; u < 8; u++)");
  ec_line(&e->core, "const int64_t j = j0 + u;");
  ec_line(&e->core, "part[u] += %s;", expr);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_enter(&e->core, "for (int64_t j = j0; j < hi; j++)");
  ec_line(&e->core, "part[j - j0] += %s;", expr);
  ec_leave(&e->core);
  ec_line(&e->core, "%s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));",
          var);
  ec_leave(&e->core);
}

// Updates row i's key range [lo, hi) (variables named so, declared [0, S) before row 0, rows visited
// in order): with doc ids, lo is the first key of the row's id and hi - 1 its last, rescanned when the
// id changes from the row before; when causal, hi is i + 1, and with a window lo is at least
// i - window + 1 (a bound that only grows with i, so it may raise lo in place). Declares di, the row's
// id.
static void emit_attn_range(Emit *e, int64_t nt, bool causal, int64_t window, int doc, const char *lo,
                            const char *hi) {
  if (doc >= 0) {
    ec_line(&e->core, "const int32_t di = dc[i];");
    ec_enter(&e->core, "if (i == 0 || dc[i - 1] != di)");
    ec_line(&e->core, "%s = 0;", lo);
    ec_line(&e->core, "while (dc[%s] != di)", lo);
    ec_line(&e->core, "  %s++;", lo);
    if (!causal) {
      ec_line(&e->core, "%s = %lld;", hi, (long long)nt);
      ec_line(&e->core, "while (dc[%s - 1] != di)", hi);
      ec_line(&e->core, "  %s--;", hi);
    }
    ec_leave(&e->core);
  }
  if (causal)
    ec_line(&e->core, "%s = i + 1;", hi);
  if (window)
    ec_line(&e->core, "%s = %s > i - %lld ? %s : i - %lld;", lo, lo, (long long)(window - 1), lo,
            (long long)(window - 1));
}

// What a kernel's note adds for kv heads, keys of another length and a window ("" for none of them).
static const char *attn_shape_note(Emit *e, const IrNode *nd) {
  int64_t ns = ec_node(&e->core, nd->in[1])->shape.d[1], kvh = att_kv_heads(nd);
  const char *k = kvh != nd->ia[0] ? c_str(e, ", %lld kv heads", (long long)kvh) : "";
  const char *s = ns != ec_node(&e->core, nd->in[0])->shape.d[1] ? c_str(e, ", %lld keys", (long long)ns) : "";
  const char *w = nd->ia[6] ? c_str(e, ", window %lld", (long long)nd->ia[6]) : "";
  return c_str(e, "%s%s%s", k, s, w);
}

// The keys S of attention node nd (k's rows), and the query heads per kv head.
static int64_t attn_keys(Emit *e, const IrNode *nd) { return ec_node(&e->core, nd->in[1])->shape.d[1]; }
static int64_t attn_group(const IrNode *nd) { return nd->ia[0] / att_kv_heads(nd); }

// The variable that holds the kv head of a task's keys and values: the head itself when every head
// has its own (the default, whose code reads as it did before kv heads), else kh.
static const char *attn_kv(const IrNode *nd) { return attn_group(nd) > 1 ? "kh" : "hd"; }

// Opens the loop over the query rows i of a task's head. The allowed keys of row i lie in [lo, hi):
// with doc ids, lo is the first key of the row's id and hi - 1 its last (row i itself when causal),
// found by scanning the ids when the id changes from the row before (so a key outside the range is
// masked whatever the ids' order; inside, the mask is applied key by key).
static void emit_attn_rows_open(Emit *e, const IrNode *nd, int doc) {
  int64_t nt = ec_node(&e->core, nd->in[0])->shape.d[1];
  ec_line(&e->core, "int64_t lo = 0, hi = %lld;", (long long)attn_keys(e, nd));
  if (doc >= 0)
    ec_line(&e->core, "const int32_t *restrict dc = b%d + b * %lld;", c_ptr(e, doc), (long long)nt);
  ec_enter(&e->core, "for (int64_t i = 0; i < %lld; i++)", (long long)nt);
  emit_attn_range(e, nt, nd->ia[1], nd->ia[6], doc, "lo", "hi");
}

// Keys per block of the score loops, and the padded row length of a transposed [D][T] block (and of
// the per-row buffers): a block that starts at lo < T may run up to lo + ATT_BLK - 1.
enum { ATT_BLK = 32 };
static int64_t attn_padded(int64_t nt) { return (nt + ATT_BLK + 7) / 8 * 8; }

static bool attn_stored16(Emit *e, Rows r) { return ec_node(&e->core, r.buf)->dtype == DT_BF16; }

// Element x of rows r as the products read it: a bf16 value stored (a CAST, precision.c) widened, an
// f32 one rounded when they read bf16 (mdl.h), else as it is.
static const char *attn_read(Emit *e, Rows r, const char *x, bool round) {
  if (attn_stored16(e, r))
    return ec_str(&e->core, "mdl_bf16_to_f32(%s)", x);
  return round ? ec_str(&e->core, "mdl_bf16_to_f32(mdl_f32_to_bf16(%s))", x) : x;
}

// Channel c of row i of the head's part of rows r as the products read it (attn_read).
static const char *attn_elem(Emit *e, Rows r, int64_t nt, int64_t d, bool bf16) {
  return attn_read(e, r, ec_str(&e->core, "%s[(b * %lld + i) * %lld + hd * %lld + c]", r.base, (long long)nt,
                                (long long)r.stride, (long long)d), bf16);
}

// out[j] = sum over c of vec[c] mat[c][j] (mat a transposed [D][padded T] block), in order over c, for
// j in [lo, hi), a block of ATT_BLK keys at a time held in registers (ATT_BLK / 8 independent chains);
// the block's tail past hi computes harmless values from the zeroed padding or later keys.
static void emit_attn_dots(Emit *e, const char *out, const char *vec, const char *mat, int64_t nt, int64_t d) {
  ec_enter(&e->core, "for (int64_t j0 = lo; j0 < hi; j0 += %d)", ATT_BLK);
  ec_line(&e->core, "float acc[%d] = {0};", ATT_BLK);
  ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "const float vc = %s[c], *restrict mc = %s + c * %lld + j0;", vec, mat, (long long)attn_padded(nt));
  ec_line(&e->core, "#pragma omp simd");
  ec_line(&e->core, "for (int64_t u = 0; u < %d; u++)", ATT_BLK);
  ec_line(&e->core, "  acc[u] += vc * mc[u];");
  ec_leave(&e->core);
  ec_line(&e->core, "memcpy(%s + j0, acc, sizeof acc);", out);
  ec_leave(&e->core);
}

// Row i of a task that owns (b, hd), with the keys of the head transposed into kt [D][T] (so score
// loops run over keys, contiguous, each score summed over the head's columns in order): s[j] becomes
// exp(scale q_i . k_j - max) for the allowed keys in [lo, hi) and 0 for the others, and l their sum;
// given the row's log-sum-exp `lse` (the backward), s[j] becomes the probability exp(S - lse).
static void emit_attn_row(Emit *e, const IrNode *nd, Rows q, int doc, const char *lse) {
  Shape qs = ec_node(&e->core, nd->in[0])->shape;
  int64_t nt = qs.d[1], d = qs.d[2] / nd->ia[0];
  if (nd->ia[4] == DT_BF16) { // q_i rounded to bf16, or stored so (the keys were rounded when transposed)
    ec_line(&e->core, "float qr[%lld];", (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  qr[c] = %s;", attn_elem(e, q, nt, d, true));
    ec_line(&e->core, "const float *restrict qi = qr;");
  } else {
    ec_line(&e->core, "const float *restrict qi = %s + (b * %lld + i) * %lld + hd * %lld;", q.base, (long long)nt,
            (long long)q.stride, (long long)d);
  }
  emit_attn_dots(e, "s", "qi", "kt", attn_keys(e, nd), d);
  if (lse) {
    ec_line(&e->core, "const float lse = %s;", lse);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = lo; j < hi; j++)");
    if (doc >= 0)
      ec_line(&e->core, "  s[j] = dc[j] == di ? mdl_exp_shifted(s[j] * %s - lse) : 0.0f;", c_flit(e, nd->fa[0]));
    else
      ec_line(&e->core, "  s[j] = mdl_exp_shifted(s[j] * %s - lse);", c_flit(e, nd->fa[0]));
    return;
  }
  ec_line(&e->core, "float m = -INFINITY;");
  ec_line(&e->core, "#pragma omp simd reduction(max : m)");
  ec_enter(&e->core, "for (int64_t j = lo; j < hi; j++)");
  if (doc >= 0)
    ec_line(&e->core, "s[j] = dc[j] == di ? s[j] * %s : -INFINITY;", c_flit(e, nd->fa[0]));
  else
    ec_line(&e->core, "s[j] *= %s;", c_flit(e, nd->fa[0]));
  ec_line(&e->core, "m = s[j] > m ? s[j] : m;");
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma omp simd");
  ec_line(&e->core, "for (int64_t j = lo; j < hi; j++)");
  ec_line(&e->core, "  s[j] = mdl_exp_shifted(s[j] - m);");
  emit_attn_sum(e, "l", "s[j]");
}

// Copies the rows of kv head `hv` of a [B,S,KH*D] matrix (k or v) into a [D][S] block (rounded to bf16
// with `round`; widened when stored as bf16, precision.c).
static void emit_attn_transpose(Emit *e, const char *dst, Rows x, int64_t nt, int64_t d, bool round, const char *hv) {
  bool x16 = attn_stored16(e, x);
  ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)nt);
  ec_line(&e->core, "const %s *xj = %s + (b * %lld + j) * %lld + %s * %lld;", x16 ? "uint16_t" : "float", x.base,
          (long long)nt, (long long)x.stride, hv, (long long)d);
  ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  %s[c * %lld + j] = %s;", dst, (long long)attn_padded(nt), attn_read(e, x, "xj[c]", round));
  ec_leave(&e->core);
}

// Opens the parallel region of an attention kernel, with per-thread scratch (zeroed with `zero`: the
// row loops read the padding of their transposed blocks; the GEMM path writes each value before it
// reads it, and zeroing its 1.3-1.5 MB a thread every call cost 3-8% of a T 512 kernel), and its loop
// over the (batch, head) tasks; a task owns every output row of its head, so tasks never race and each
// output is computed by one sequence of operations whatever the thread count. The head is named hv:
// hd for a query head, kh for a kv head (the backward of grouped heads: dk and dv of a kv head sum
// over its query heads, so one task owns them all); with a forward's group of grp > 1 query heads per
// kv head, kh is the kv head of hd.
static void emit_attn_open(Emit *e, int64_t nb, int64_t heads, bool par, const Tmp *tmp, int ntmp, bool zero,
                           const char *hv, int64_t grp) {
  if (par) {
    ec_line(&e->core, "#pragma omp parallel num_threads(h->nthreads)");
    e->uses_h = true;
  }
  ec_enter(&e->core, "%s", "");
  for (int i = 0; i < ntmp; i++)
    if (zero)
      ec_line(&e->core, "float *restrict %s = memset(mdl_scratch(%lld * sizeof(float)), 0, %lld * sizeof(float));",
              tmp[i].name, (long long)tmp[i].n, (long long)tmp[i].n);
    else
      ec_line(&e->core, "float *restrict %s = mdl_scratch(%lld * sizeof(float));", tmp[i].name, (long long)tmp[i].n);
  if (par)
    ec_line(&e->core, "#pragma omp for schedule(dynamic, 1)");
  ec_enter(&e->core, "for (int64_t task = 0; task < %lld; task++)", (long long)(nb * heads));
  ec_line(&e->core, "const int64_t b = task / %lld, %s = task %% %lld;", (long long)heads, hv, (long long)heads);
  if (grp > 1 && !strcmp(hv, "hd"))
    ec_line(&e->core, "const int64_t kh = hd / %lld;", (long long)grp);
}

static void emit_attn_close(Emit *e, const Tmp *tmp, int ntmp) {
  ec_leave(&e->core);
  for (int i = 0; i < ntmp; i++)
    ec_line(&e->core, "mdl_free(%s);", tmp[i].name);
  ec_leave(&e->core);
}

// Declares acc0[D] and acc1[D] (for acc = "acc") whose sum is that over the keys j in [lo, hi) of
// w[j] x_j (x_j the part of head hv of row j of x, nt rows a batch): keys taken in pairs, the even and odd keys of the
// range in two accumulators, two chains of FMAs held in registers; the caller adds them.
// With round_w / round_x (bf16 attention, mdl.h) the weights / the rows are read rounded to bf16
// (rows stored as bf16, precision.c, are widened).
static void emit_attn_pairs(Emit *e, const char *acc, const char *w, Rows x, int64_t nt, int64_t d, bool round_w,
                            bool round_x, const char *hv) {
  const char *row = c_str(e, "%s + (b * %lld + j) * %lld + %s * %lld", x.base, (long long)nt, (long long)x.stride, hv,
                          (long long)d);
  const char *w0 = c_str(e, "%s[j]", w), *w1 = c_str(e, "%s[j + 1]", w);
  if (round_w) {
    w0 = c_str(e, "mdl_bf16_to_f32(mdl_f32_to_bf16(%s))", w0);
    w1 = c_str(e, "mdl_bf16_to_f32(mdl_f32_to_bf16(%s))", w1);
  }
  const char *x0 = attn_read(e, x, "x0[c]", round_x), *x1 = attn_read(e, x, "x1[c]", round_x);
  const char *xt = attn_stored16(e, x) ? "uint16_t" : "float";
  ec_line(&e->core, "float %s0[%lld] = {0}, %s1[%lld] = {0};", acc, (long long)d, acc, (long long)d);
  ec_line(&e->core, "int64_t j = lo;");
  ec_enter(&e->core, "for (; j + 1 < hi; j += 2)");
  ec_line(&e->core, "const float w0 = %s, w1 = %s;", w0, w1);
  ec_line(&e->core, "const %s *restrict x0 = %s, *restrict x1 = x0 + %lld;", xt, row, (long long)x.stride);
  ec_line(&e->core, "#pragma omp simd");
  ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "%s0[c] += w0 * %s;", acc, x0);
  ec_line(&e->core, "%s1[c] += w1 * %s;", acc, x1);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_enter(&e->core, "if (j < hi)");
  ec_line(&e->core, "const float w0 = %s;", w0);
  ec_line(&e->core, "const %s *restrict x0 = %s;", xt, row);
  ec_line(&e->core, "#pragma omp simd");
  ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  %s0[c] += w0 * %s;", acc, x0);
  ec_leave(&e->core);
}

// Attention through the GEMM library. A task owns a (batch, head) and walks its query rows in blocks
// of ATT_ROWS; each block's scores against the keys it may attend ([klo, khi): up to the block's last
// row when causal, from the first key of any of its rows' documents rounded down to a multiple of
// ATT_ROWS, so that a step meets few GEMM shapes whatever the documents) are one GEMM, the softmax
// runs over the block's rows in f32 (over each row's own keys only: the others are zeroed), and the
// weighted sum of values is a second GEMM; the backward recomputes the block's probabilities from the
// forward's log-sum-exp and takes dP, dQ, dK and dV as four GEMMs, dK and dV summed over the blocks
// in the task's own [T][D] buffers. The blocks and the products' shapes follow T alone, so the values
// do not depend on the thread count. Products of bf16 attention (mdl.h) run on the library's bf16
// GEMM (h->bgemm) on operands staged as bf16 bits, else on f32 operands staged as bf16 values; an f32
// attention reads its rows in place, except the keys and values, which the scores and dP GEMMs read
// transposed: those are packed [T][D] per task. Measured with oneDNN's sgemm on one core, 64-row
// blocks, D 64: Q K^T 123 -> 168 GFLOP/s with K packed (NN with V packed 155 -> 163, TN with dout
// packed 144 -> 155, which repays its copy less, so dout and q stay in place).
enum { ATT_ROWS = 64 };

// Whether attention over T keys of heads of D channels runs through the GEMM library, else through
// the row loops below. Measured (`--profile`, the attention kernels of a step, loops -> GEMMs):
// L4 C256 (D 64) B2 T512 55.6 -> 23.4 ms in bf16, 50.6 -> 28.1 in fp32; B8 T128 16.1 -> 10.6 and
// 15.1 -> 11.9; GPT-2 124M B4 T64 19.1 -> 19.9 (even); gpt2-tiny (D 16, T 64) 0.7 -> 1.0.
static bool attn_by_gemm(int64_t nt, int64_t d) { return nt >= 128 && d >= 32; }

// A GEMM operand: the head's rows at p (elements of the GEMM's type), row r at p + r * ld.
typedef struct {
  const char *p;
  int64_t ld;
} Opnd;

// The head's part of rows r (rows [0, nt) of batch b, columns hv * D ...) as an operand of GEMMs of
// bf16 bits (g16) or of f32: in place where stored that way (and, with pack, contiguous), else copied
// into buf ([T][D]), rounded to bf16 where bf16 attention reads it rounded.
static Opnd attn_operand(Emit *e, Rows r, int64_t nt, int64_t d, bool bf16, bool g16, bool pack, const char *buf,
                         const char *hv) {
  bool x16 = attn_stored16(e, r);
  const char *head = c_str(e, "%s + b * %lld + %s * %lld", r.base, (long long)(nt * r.stride), hv, (long long)d);
  if (((g16 && x16) || (!g16 && !bf16 && !x16)) && (!pack || r.stride == d))
    return (Opnd){head, r.stride};
  const char *ot = g16 ? "uint16_t" : "float", *c_val;
  if (g16)
    c_val = x16 ? "x[c]" : "mdl_f32_to_bf16(x[c])";
  else
    c_val = attn_read(e, r, "x[c]", bf16);
  ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)nt);
  ec_line(&e->core, "const %s *restrict x = %s + j * %lld;", x16 ? "uint16_t" : "float", head, (long long)r.stride);
  ec_line(&e->core, "%s *restrict y = (%s *)%s + j * %lld;", ot, ot, buf, (long long)d);
  ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  y[c] = %s;", c_val);
  ec_leave(&e->core);
  return (Opnd){c_str(e, "(const %s *)%s", ot, buf), d};
}

// One single-threaded GEMM of the task: C = op(A) op(B) + beta C, row-major; leading dimensions as
// code (a block's scores are packed nk to a row).
static void attn_gemm(Emit *e, bool g16, int ta, int tb, const char *m, const char *n, const char *k, const char *a,
                      const char *lda, const char *b, const char *ldb, const char *beta, const char *c,
                      const char *ldc) {
  ec_line(&e->core, "h->%s(%d, %d, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s);", g16 ? "bgemm" : "sgemm", ta, tb, m, n, k,
          a, lda, b, ldb, beta, c, ldc);
}

// An operand's rows from row r0 (code) on, and its leading dimension, as code.
static const char *op_at(Emit *e, Opnd o, const char *r0) {
  return c_str(e, "%s + %s * %lld", o.p, r0, (long long)o.ld);
}
static const char *op_ld(Emit *e, Opnd o) { return c_str(e, "%lld", (long long)o.ld); }

// Opens the loop over the task's query blocks [i0, i1) and declares its keys [klo, khi), nk of them
// (ns keys; with a window, none before the window of the block's first row).
static void attn_blocks_open(Emit *e, int64_t nt, int64_t ns, bool causal, int64_t window, int doc) {
  ec_line(&e->core, "int64_t rlo = 0, rhi = %lld;", (long long)ns);
  ec_enter(&e->core, "for (int64_t i0 = 0; i0 < %lld; i0 += %d)", (long long)nt, ATT_ROWS);
  ec_line(&e->core, "const int64_t i1 = i0 + %d < %lld ? i0 + %d : %lld, nr = i1 - i0;", ATT_ROWS, (long long)nt,
          ATT_ROWS, (long long)nt);
  ec_line(&e->core, "int64_t klo = %s;", doc >= 0 && causal ? "i0" : "0");
  if (doc >= 0 && causal) { // the first key of each row's document: its id's first place
    ec_line(&e->core, "for (int64_t i = i0; i < i1; i++)");
    ec_enter(&e->core, "  if (i == i0 || dc[i] != dc[i - 1])");
    ec_line(&e->core, "int64_t l = 0;");
    ec_line(&e->core, "while (dc[l] != dc[i])");
    ec_line(&e->core, "  l++;");
    ec_line(&e->core, "klo = l < klo ? l : klo;");
    ec_leave(&e->core);
  }
  if (window)
    ec_line(&e->core, "klo = klo > i0 - %lld ? klo : i0 - %lld;", (long long)(window - 1), (long long)(window - 1));
  if ((doc >= 0 && causal) || window)
    ec_line(&e->core, "klo -= klo %% %d;", ATT_ROWS);
  ec_line(&e->core, "const int64_t khi = %s, nk = khi - klo;", causal ? "i1" : c_str(e, "%lld", (long long)ns));
}

// Row i's probabilities (or, in the forward, their numerators exp(s - max) with their sum l in f32
// lanes) in place over the row's scores s[0, nk). The row's keys lie in [rlo, rhi) (declared by
// attn_blocks_open): with doc ids, rlo is the first key of the row's id and rhi - 1 its last (row i
// itself when causal), found by scanning the ids when the id changes from the row before, as the row
// loops do (emit_attn_rows_open); keys outside the range are 0 without being computed, inside it the
// id is compared key by key, so the mask holds whatever the ids' order.
static void attn_softmax_row(Emit *e, const IrNode *nd, int doc, const char *lse) {
  bool causal = nd->ia[1];
  int64_t nt = ec_node(&e->core, nd->in[0])->shape.d[1];
  const char *sc = c_flit(e, nd->fa[0]);
  emit_attn_range(e, nt, causal, nd->ia[6], doc, "rlo", "rhi");
  ec_line(&e->core, "const int64_t lo = rlo - klo, hi = rhi - klo;");
  ec_line(&e->core, "memset(s, 0, lo * sizeof(float));");
  ec_line(&e->core, "memset(s + hi, 0, (nk - hi) * sizeof(float));");
  if (lse) {
    ec_line(&e->core, "const float lse = %s;", lse);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = lo; j < hi; j++)");
    if (doc >= 0)
      ec_line(&e->core, "  s[j] = dc[klo + j] == di ? mdl_exp_shifted(s[j] * %s - lse) : 0.0f;", sc);
    else
      ec_line(&e->core, "  s[j] = mdl_exp_shifted(s[j] * %s - lse);", sc);
    return;
  }
  ec_line(&e->core, "float m = -INFINITY;");
  ec_line(&e->core, "#pragma omp simd reduction(max : m)");
  ec_enter(&e->core, "for (int64_t j = lo; j < hi; j++)");
  if (doc >= 0)
    ec_line(&e->core, "s[j] = dc[klo + j] == di ? s[j] * %s : -INFINITY;", sc);
  else
    ec_line(&e->core, "s[j] *= %s;", sc);
  ec_line(&e->core, "m = s[j] > m ? s[j] : m;");
  ec_leave(&e->core);
  ec_line(&e->core, "float l = 0.0f;");
  ec_line(&e->core, "#pragma omp simd reduction(+ : l)");
  ec_enter(&e->core, "for (int64_t j = lo; j < hi; j++)");
  ec_line(&e->core, "s[j] = mdl_exp_shifted(s[j] - m);");
  ec_line(&e->core, "l += s[j];");
  ec_leave(&e->core);
}

// Row i's weights w[0, nk) (f32) as the second operand form: bf16 bits into dst16's row (g16), or
// rounded to bf16 values in place (bf16 attention), or as they are.
static void attn_stage_row(Emit *e, const char *w, bool bf16, bool g16, const char *dst16) {
  if (g16) {
    ec_line(&e->core, "uint16_t *restrict %s_i = (uint16_t *)%s + (i - i0) * nk;", dst16, dst16);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = 0; j < nk; j++)");
    ec_line(&e->core, "  %s_i[j] = mdl_f32_to_bf16(%s[j]);", dst16, w);
  } else if (bf16) {
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = 0; j < nk; j++)");
    ec_line(&e->core, "  %s[j] = mdl_bf16_to_f32(mdl_f32_to_bf16(%s[j]));", w, w);
  }
}

// What an attention kernel on the GEMM library reads and writes (attn_gemm_kernel).
typedef struct {
  const IrNode *nd;
  int a, lse, doc;         // the forward's output and log-sum-exp (the backward's lse), doc ids; -1 where absent
  const int *casts;        // forward: the output's bf16 roundings stored here (ncast), and f32 when the
  int ncast;               // f32 output is written too
  bool f32;
  const int *out;          // backward: its dq, dk, dv (-1 where not wanted); NULL for the forward
  Rows q, k, v, dout, o;   // dout and o: the backward's
} AttnGemm;

// The forward's task body (attn_gemm_kernel): GEMMs of bf16 bits when g16, else of f32.
static void attn_fwd_body(Emit *e, const AttnGemm *x, bool g16) {
  const IrNode *nd = x->nd;
  int a = x->a, lse = x->lse, doc = x->doc, ncast = x->ncast;
  const int *casts = x->casts;
  bool f32 = x->f32;
  Rows q = x->q, k = x->k, v = x->v;
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  int64_t nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads, ns = attn_keys(e, nd);
  bool bf16 = nd->ia[4] == DT_BF16;
  const char *kv = attn_kv(nd);
  Opnd Q = attn_operand(e, q, nt, d, bf16, g16, false, "qs", "hd");
  Opnd K = attn_operand(e, k, ns, d, bf16, g16, true, "ks", kv);
  Opnd V = {0};
  if (a >= 0)
    V = attn_operand(e, v, ns, d, bf16, g16, true, "vs", kv);
  attn_blocks_open(e, nt, ns, nd->ia[1], nd->ia[6], doc);
  // the scores are nr rows of nk: packed at stride nk, so that a row's weights staged in place or as
  // bf16 bits are the PV GEMM's operand
  const char *dd = c_str(e, "%lld", (long long)d);
  attn_gemm(e, g16, 0, 1, "nr", "nk", dd, op_at(e, Q, "i0"), op_ld(e, Q), op_at(e, K, "klo"), op_ld(e, K), "0.0f", "sc",
            "nk");
  ec_enter(&e->core, "for (int64_t i = i0; i < i1; i++)");
  ec_line(&e->core, "float *restrict s = sc + (i - i0) * nk;");
  attn_softmax_row(e, nd, doc, NULL);
  ec_line(&e->core, "lrow[i - i0] = l;");
  if (lse >= 0)
    ec_line(&e->core, "b%d[(b * %lld + hd) * %lld + i] = m + logf(l);", c_ptr(e, lse), (long long)heads, (long long)nt);
  if (a >= 0)
    attn_stage_row(e, "s", bf16, g16, "ps");
  ec_leave(&e->core);
  if (a >= 0) {
    attn_gemm(e, g16, 0, 0, "nr", dd, "nk", g16 ? "(const uint16_t *)ps" : "sc", "nk", op_at(e, V, "klo"), op_ld(e, V),
              "0.0f", "ot", dd);
    ec_enter(&e->core, "for (int64_t i = i0; i < i1; i++)");
    const char *row = c_str(e, "(b * %lld + i) * %lld + hd * %lld", (long long)nt, (long long)nc, (long long)d);
    if (f32)
      ec_line(&e->core, "float *restrict oi = b%d + %s;", c_ptr(e, a), row);
    for (int t = 0; t < ncast; t++)
      ec_line(&e->core, "uint16_t *restrict o%d = b%d + %s;", t, c_ptr(e, casts[t]), row);
    ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "const float y = ot[(i - i0) * %lld + c] / lrow[i - i0];", (long long)d);
    if (f32)
      ec_line(&e->core, "oi[c] = y;");
    for (int t = 0; t < ncast; t++)
      ec_line(&e->core, "o%d[c] = mdl_f32_to_bf16(y);", t);
    ec_leave(&e->core);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
}

// The backward's task body (attn_gemm_kernel): dq, dk, dv (out[0..2], -1 where not wanted) of the
// head, dk and dv summed over the query blocks in dkh and dvh ([S][D], f32). With grouped heads the
// task owns a kv head kh and runs the blocks of each of its query heads hd in turn, so dk and dv sum
// over the group as well.
static void attn_bwd_body(Emit *e, const AttnGemm *x, bool g16) {
  const IrNode *nd = x->nd;
  const int *out = x->out;
  int lse = x->lse, doc = x->doc;
  Rows q = x->q, k = x->k, v = x->v, dout = x->dout, o = x->o;
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  int64_t nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads, ns = attn_keys(e, nd), grp = attn_group(nd);
  int64_t nckv = d * att_kv_heads(nd);
  bool bf16 = nd->ia[4] == DT_BF16, ds = out[0] >= 0 || out[1] >= 0;
  const char *dd = c_str(e, "%lld", (long long)d), *sc = c_flit(e, nd->fa[0]), *kv = attn_kv(nd);
  Opnd Q = {0}, K, DO = {0}, V = {0}, O = {0};
  if (grp == 1)
    Q = attn_operand(e, q, nt, d, bf16, g16, false, "qs", "hd");
  K = attn_operand(e, k, ns, d, bf16, g16, true, "ks", kv);
  if (grp == 1)
    DO = attn_operand(e, dout, nt, d, bf16, g16, false, "dos", "hd");
  if (ds)
    V = attn_operand(e, v, ns, d, bf16, g16, true, "vs", kv);
  if (ds && grp == 1)
    O = attn_operand(e, o, nt, d, bf16, g16, false, "os", "hd");
  for (int i = 1; i < 3; i++)
    if (out[i] >= 0)
      ec_line(&e->core, "memset(%s, 0, %lld * sizeof(float));", i == 1 ? "dkh" : "dvh", (long long)(ns * d));
  if (grp > 1) {
    ec_enter(&e->core, "for (int64_t hd = kh * %lld; hd < kh * %lld + %lld; hd++)", (long long)grp, (long long)grp,
             (long long)grp);
    Q = attn_operand(e, q, nt, d, bf16, g16, false, "qs", "hd");
    DO = attn_operand(e, dout, nt, d, bf16, g16, false, "dos", "hd");
    if (ds)
      O = attn_operand(e, o, nt, d, bf16, g16, false, "os", "hd");
  }
  attn_blocks_open(e, nt, ns, nd->ia[1], nd->ia[6], doc);
  attn_gemm(e, g16, 0, 1, "nr", "nk", dd, op_at(e, Q, "i0"), op_ld(e, Q), op_at(e, K, "klo"), op_ld(e, K), "0.0f", "sc",
            "nk");
  if (ds)
    attn_gemm(e, g16, 0, 1, "nr", "nk", dd, op_at(e, DO, "i0"), op_ld(e, DO), op_at(e, V, "klo"), op_ld(e, V), "0.0f",
              "dp", "nk");
  ec_enter(&e->core, "for (int64_t i = i0; i < i1; i++)");
  ec_line(&e->core, "float *restrict s = sc + (i - i0) * nk;");
  attn_softmax_row(e, nd, doc,
                   c_str(e, "b%d[(b * %lld + hd) * %lld + i]", c_ptr(e, lse), (long long)heads, (long long)nt));
  if (ds) { // dS = P (dP - D), D = dout_i . out_i (both as the products read them), before P is rounded
    const char *ty = g16 ? "uint16_t" : "float", *rd = g16 ? "mdl_bf16_to_f32(%s[c])" : "%s[c]";
    ec_line(&e->core, "const %s *restrict doi = %s, *restrict oi = %s;", ty, op_at(e, DO, "i"), op_at(e, O, "i"));
    ec_line(&e->core, "float dsum = 0.0f;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : dsum)");
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dsum += %s * %s;", c_str(e, rd, "doi"), c_str(e, rd, "oi"));
    ec_line(&e->core, "float *restrict dpi = dp + (i - i0) * nk;");
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = 0; j < nk; j++)");
    ec_line(&e->core, "  dpi[j] = s[j] * (dpi[j] - dsum);");
    attn_stage_row(e, "dpi", bf16, g16, "dss");
  }
  if (out[2] >= 0)
    attn_stage_row(e, "s", bf16, g16, "ps");
  ec_leave(&e->core);
  const char *pm = g16 ? "(const uint16_t *)ps" : "sc", *dsm = g16 ? "(const uint16_t *)dss" : "dp";
  if (out[2] >= 0) // dV[klo, khi) += P^T dout
    attn_gemm(e, g16, 1, 0, "nk", dd, "nr", pm, "nk", op_at(e, DO, "i0"), op_ld(e, DO), "1.0f",
              c_str(e, "dvh + klo * %lld", (long long)d), dd);
  if (out[1] >= 0) // dK[klo, khi) += dS^T q (scaled when stored)
    attn_gemm(e, g16, 1, 0, "nk", dd, "nr", dsm, "nk", op_at(e, Q, "i0"), op_ld(e, Q), "1.0f",
              c_str(e, "dkh + klo * %lld", (long long)d), dd);
  if (out[0] >= 0) { // dq = scale dS k
    attn_gemm(e, g16, 0, 0, "nr", dd, "nk", dsm, "nk", op_at(e, K, "klo"), op_ld(e, K), "0.0f", "ot", dd);
    ec_enter(&e->core, "for (int64_t i = i0; i < i1; i++)");
    ec_line(&e->core, "float *restrict dq = b%d + (b * %lld + i) * %lld + hd * %lld;", c_ptr(e, out[0]), (long long)nt,
            (long long)nc, (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dq[c] = %s * ot[(i - i0) * %lld + c];", sc, (long long)d);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  if (grp > 1)
    ec_leave(&e->core);
  for (int i = 1; i < 3; i++)
    if (out[i] >= 0) {
      ec_enter(&e->core, "for (int64_t t = 0; t < %lld; t++)", (long long)ns);
      ec_line(&e->core, "float *restrict y = b%d + (b * %lld + t) * %lld + %s * %lld;", c_ptr(e, out[i]), (long long)ns,
              (long long)nckv, kv, (long long)d);
      ec_line(&e->core, "const float *restrict x = %s + t * %lld;", i == 1 ? "dkh" : "dvh", (long long)d);
      ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
      ec_line(&e->core, "  y[c] = %sx[c];", i == 1 ? c_str(e, "%s * ", sc) : "");
      ec_leave(&e->core);
    }
}

// An attention kernel on the GEMM library: per-thread scratch, a task per (batch, head), and with bf16
// attention its body twice, on the library's bf16 GEMM where it has one (h->bgemm) and else on f32.
static void attn_gemm_kernel(Emit *e, const AttnGemm *x) {
  Shape s = ec_node(&e->core, x->nd->in[0])->shape;
  int64_t nb = s.d[0], nt = s.d[1], nc = s.d[2], heads = x->nd->ia[0], d = nc / heads, ns = attn_keys(e, x->nd);
  int64_t grp = attn_group(x->nd);
  bool bf16 = x->nd->ia[4] == DT_BF16;
  Tmp fwd[7] = {{"qs", nt * d},         {"ks", ns * d},       {"vs", ns * d}, {"sc", ATT_ROWS * ns},
                {"ps", ATT_ROWS * ns}, {"ot", ATT_ROWS * d}, {"lrow", ATT_ROWS}};
  Tmp bwd[12] = {{"qs", nt * d},          {"ks", ns * d},          {"vs", ns * d},          {"dos", nt * d},
                 {"os", nt * d},          {"sc", ATT_ROWS * ns},  {"dp", ATT_ROWS * ns},  {"ps", ATT_ROWS * ns},
                 {"dss", ATT_ROWS * ns}, {"ot", ATT_ROWS * d},   {"dkh", ns * d},        {"dvh", ns * d}};
  const Tmp *tmp = x->out ? bwd : fwd;
  int ntmp = x->out ? 12 : 7;
  void (*body)(Emit *, const AttnGemm *, bool) = x->out ? attn_bwd_body : attn_fwd_body;
  e->uses_h = true;
  if (bf16)
    ec_line(&e->core, "const int g16 = h->bgemm != NULL;");
  bool by_kv = x->out && grp > 1; // (the backward's task: a kv head and its group)
  emit_attn_open(e, nb, by_kv ? heads / grp : heads, nb * nt * ns * nc >= PAR_MIN, tmp, ntmp, false,
                 by_kv ? "kh" : "hd", grp);
  if (x->doc >= 0)
    ec_line(&e->core, "const int32_t *restrict dc = b%d + b * %lld;", c_ptr(e, x->doc), (long long)nt);
  if (bf16) {
    ec_enter(&e->core, "if (g16)");
    body(e, x, true);
    ec_leave(&e->core);
    ec_enter(&e->core, "else");
  }
  body(e, x, false);
  if (bf16)
    ec_leave(&e->core);
  emit_attn_close(e, tmp, ntmp);
}

// The forward attention kernel's outputs are written: its f32 output (when stored), its bf16
// roundings and its log-sum-exp.
static void attn_outputs_done(Emit *e, int a, bool f32, const int *casts, int ncast, int lse) {
  if (f32)
    ec_phase_done(&e->core, a);
  for (int t = 0; t < ncast; t++)
    ec_phase_done(&e->core, casts[t]);
  if (lse >= 0)
    ec_phase_done(&e->core, lse);
  ec_phase_end(&e->core);
}

// ATTENTION forward: one task per (batch, head), which transposes the head's keys once and then, per
// query row, computes the scores of the allowed keys, their softmax and the weighted sum of values;
// never a T x T matrix. With its ATTENTION_LSE (rule 3 of fuse.c) each row's log-sum-exp is stored as
// well; alone (no fusion), the ATTENTION_LSE computes the scores and their statistics only.
void c_emit_attention(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a, lse;
  ec_attention_members(&e->core, gi, &a, &lse);
  const IrNode *nd = ec_node(&e->core, a >= 0 ? a : lse);
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  int64_t nb = s.d[0], nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads, ns = attn_keys(e, nd);
  bool causal = nd->ia[1], has_doc = nd->ia[2];
  Rows q = c_rows_of(e, nd->in[0]), k = c_rows_of(e, nd->in[1]), v = a >= 0 ? c_rows_of(e, nd->in[2]) : (Rows){0};
  int doc = has_doc ? ec_need(&e->core, nd->in[3]) : -1;
  ew_flush(&e->core);
  // The bf16 roundings of the output that this step holds (rule 9) are stored here too; the f32
  // output only when something reads it.
  int casts[4], ncast = 0;
  bool f32 = false;
  if (a >= 0)
    ncast = ec_output_casts(&e->core, a, casts, 4, &f32);
  if (f32 && ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  if (lse >= 0 && ec_offset(&e->core, lse) < 0)
    e->core.scratch[lse] = true;
  ec_phase_begin(&e->core);
  c_note(e, "attention%s: B %lld, T %lld, %lld heads of %lld%s%s%s; one task per (batch, head)",
         a < 0 ? " statistics (log-sum-exp per row)" : lse >= 0 ? " and its log-sum-exp per row" : "", (long long)nb,
         (long long)nt, (long long)heads, (long long)d, causal ? ", causal" : "", has_doc ? ", within documents" : "",
         attn_shape_note(e, nd));
  if (attn_by_gemm(nt, d)) {
    attn_gemm_kernel(e, &(AttnGemm){.nd = nd, .a = a, .lse = lse, .doc = doc, .casts = casts, .ncast = ncast,
                                    .f32 = f32, .q = q, .k = k, .v = v});
    attn_outputs_done(e, a, f32, casts, ncast, lse);
    return;
  }
  Tmp tmp[2] = {{"kt", d * attn_padded(ns)}, {"s", attn_padded(ns)}};
  emit_attn_open(e, nb, heads, nb * nt * ns * nc >= PAR_MIN, tmp, 2, true, "hd", attn_group(nd));
  bool bf16 = nd->ia[4] == DT_BF16; // q, k, v and e = exp(s - max) read rounded (mdl.h)
  emit_attn_transpose(e, "kt", k, ns, d, bf16, attn_kv(nd));
  emit_attn_rows_open(e, nd, doc);
  emit_attn_row(e, nd, q, doc, NULL);
  if (lse >= 0)
    ec_line(&e->core, "b%d[(b * %lld + hd) * %lld + i] = m + logf(l);", c_ptr(e, lse), (long long)heads, (long long)nt);
  if (a >= 0) {
    emit_attn_pairs(e, "acc", "s", v, ns, d, bf16, bf16, attn_kv(nd));
    const char *row = c_str(e, "(b * %lld + i) * %lld + hd * %lld", (long long)nt, (long long)nc, (long long)d);
    if (f32)
      ec_line(&e->core, "float *restrict oi = b%d + %s;", c_ptr(e, a), row);
    for (int t = 0; t < ncast; t++)
      ec_line(&e->core, "uint16_t *restrict o%d = b%d + %s;", t, c_ptr(e, casts[t]), row);
    ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "const float y = (acc0[c] + acc1[c]) / l;");
    if (f32)
      ec_line(&e->core, "oi[c] = y;");
    for (int t = 0; t < ncast; t++)
      ec_line(&e->core, "o%d[c] = mdl_f32_to_bf16(y);", t);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  emit_attn_close(e, tmp, 2);
  attn_outputs_done(e, a, f32, casts, ncast, lse);
}

// ATTENTION_BWD siblings: one task per (batch, head), so its dq, dk and dv rows are written by that
// task alone; dk and dv build up in per-thread [T][D] blocks copied out at the end of the task. The
// probabilities of each query row are recomputed from its scores and the forward's log-sum-exp.
void c_emit_attention_bwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  const Group *gr = &e->core.groups[gi];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  int64_t nb = s.d[0], nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads, ns = attn_keys(e, nd);
  int64_t grp = attn_group(nd), nckv = d * att_kv_heads(nd);
  bool causal = nd->ia[1], has_doc = nd->ia[2];
  const char *kv = attn_kv(nd);
  int out[3] = {-1, -1, -1};
  for (int i = 0; i < gr->nmem; i++)
    out[ec_node(&e->core, gr->mem[i])->ia[3]] = gr->mem[i];
  bool ds = out[0] >= 0 || out[1] >= 0; // dq and dk need dS = P (dP - dout . out); dv only P
  Rows q = c_rows_of(e, nd->in[0]), k = c_rows_of(e, nd->in[1]), v = ds ? c_rows_of(e, nd->in[2]) : (Rows){0};
  int doc = has_doc ? ec_need(&e->core, nd->in[3]) : -1;
  Rows dout = c_rows_of(e, att_bwd_dout(nd)), o = ds ? c_rows_of(e, att_bwd_out(nd)) : (Rows){0};
  int lse = ec_need(&e->core, att_bwd_lse(nd));
  ew_outputs_open(&e->core, out, 3);
  const char *sc = c_flit(e, nd->fa[0]);
  c_note(e, "attention backward (%s%s%s): B %lld, T %lld, %lld heads of %lld%s%s%s; one task per (batch, %s)",
         out[0] >= 0 ? "dq " : "", out[1] >= 0 ? "dk " : "", out[2] >= 0 ? "dv" : "", (long long)nb, (long long)nt,
         (long long)heads, (long long)d, causal ? ", causal" : "", has_doc ? ", within documents" : "",
         attn_shape_note(e, nd), grp > 1 ? "kv head, its query heads in turn" : "head");
  if (attn_by_gemm(nt, d)) {
    attn_gemm_kernel(e, &(AttnGemm){.nd = nd, .lse = lse, .doc = doc, .out = out, .q = q, .k = k, .v = v,
                                    .dout = dout, .o = o});
    ew_outputs_done(&e->core, out, 3);
    return;
  }
  Tmp tmp[6];
  int ntmp = 0;
  tmp[ntmp++] = (Tmp){"kt", d * attn_padded(ns)};
  tmp[ntmp++] = (Tmp){"s", attn_padded(ns)};
  if (ds) {
    tmp[ntmp++] = (Tmp){"vt", d * attn_padded(ns)};
    tmp[ntmp++] = (Tmp){"dp", attn_padded(ns)};
  }
  if (out[1] >= 0)
    tmp[ntmp++] = (Tmp){"dkh", ns * d};
  if (out[2] >= 0)
    tmp[ntmp++] = (Tmp){"dvh", ns * d};
  emit_attn_open(e, nb, heads / grp, nb * nt * ns * nc >= PAR_MIN, tmp, ntmp, true, kv, grp);
  bool bf16 = nd->ia[4] == DT_BF16; // the products read q, k, v, dout, P and dS rounded (mdl.h)
  emit_attn_transpose(e, "kt", k, ns, d, bf16, kv);
  if (ds)
    emit_attn_transpose(e, "vt", v, ns, d, bf16, kv);
  for (int i = 1; i < 3; i++)
    if (out[i] >= 0)
      ec_line(&e->core, "memset(%s, 0, %lld * sizeof(float));", i == 1 ? "dkh" : "dvh", (long long)(ns * d));
  if (grp > 1) // dk and dv of the kv head: sums over its query heads
    ec_enter(&e->core, "for (int64_t hd = kh * %lld; hd < kh * %lld + %lld; hd++)", (long long)grp, (long long)grp,
             (long long)grp);
  emit_attn_rows_open(e, nd, doc);
  emit_attn_row(e, nd, q, doc,
                c_str(e, "b%d[(b * %lld + hd) * %lld + i]", c_ptr(e, lse), (long long)heads, (long long)nt));
  if (bf16) { // dout_i rounded (mdl.h), or already a bf16 value (its CAST, precision.c)
    ec_line(&e->core, "float dor[%lld];", (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dor[c] = %s;", attn_elem(e, dout, nt, d, bf16));
    ec_line(&e->core, "const float *restrict doi = dor;");
  } else {
    ec_line(&e->core, "const float *restrict doi = %s + (b * %lld + i) * %lld + hd * %lld;", dout.base,
            (long long)nt, (long long)dout.stride, (long long)d);
  }
  if (ds) {
    // D = dout_i . out_i (out_i as dout_i is read: its CAST, precision.c)
    ec_line(&e->core, "float dsum = 0.0f;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : dsum)");
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dsum += doi[c] * %s;", attn_elem(e, o, nt, d, bf16));
    emit_attn_dots(e, "dp", "doi", "vt", ns, d);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = lo; j < hi; j++)");
    ec_line(&e->core, "  dp[j] = s[j] * (dp[j] - dsum);");
  }
  if (out[0] >= 0)
    emit_attn_pairs(e, "dqi", "dp", k, ns, d, bf16, bf16, kv);
  if (out[1] >= 0) {
    ec_line(&e->core, "float sqi[%lld];", (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  sqi[c] = %s * qi[c];", sc);
  }
  ec_enter(&e->core, "for (int64_t j = lo; j < hi; j++)");
  if (out[1] >= 0) {
    ec_line(&e->core, "float *restrict dkj = dkh + j * %lld;", (long long)d);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dkj[c] += %s * sqi[c];", bf16 ? "mdl_bf16_to_f32(mdl_f32_to_bf16(dp[j]))" : "dp[j]");
  }
  if (out[2] >= 0) {
    ec_line(&e->core, "float *restrict dvj = dvh + j * %lld;", (long long)d);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dvj[c] += %s * doi[c];", bf16 ? "mdl_bf16_to_f32(mdl_f32_to_bf16(s[j]))" : "s[j]");
  }
  ec_leave(&e->core);
  if (out[0] >= 0) {
    ec_line(&e->core, "float *restrict dq = b%d + (b * %lld + i) * %lld + hd * %lld;", c_ptr(e, out[0]), (long long)nt,
            (long long)nc, (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dq[c] = %s * (dqi0[c] + dqi1[c]);", sc);
  }
  ec_leave(&e->core);
  if (grp > 1)
    ec_leave(&e->core);
  for (int i = 1; i < 3; i++)
    if (out[i] >= 0) {
      ec_line(&e->core, "for (int64_t t = 0; t < %lld; t++)", (long long)ns);
      ec_line(&e->core, "  memcpy(b%d + (b * %lld + t) * %lld + %s * %lld, %s + t * %lld, %lld * sizeof(float));",
              c_ptr(e, out[i]), (long long)ns, (long long)nckv, kv, (long long)d, i == 1 ? "dkh" : "dvh", (long long)d,
              (long long)d);
    }
  emit_attn_close(e, tmp, ntmp);
  ew_outputs_done(&e->core, out, 3);
}
