// emit_c_lmhead.c: the C emitter's cross-entropy and LM head (the logits GEMMs and the loss in chunks
// of rows). See emit_c.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_c_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// One row of cross-entropy: the loss into `loss` (an lvalue, or NULL) and dloss * (softmax - onehot)
// into the row `dx` (or NULL), for logits row x (bf16 values when x16, widened as they are read) and
// target t; an ignored target (< 0) gives zeros, one >= V an error. With bf16, dx holds the gradient
// rounded to bf16 values (the CAST that the LM head's backward GEMMs read). Each pass is one vector
// loop: the maximum, the exponentials with their sum, then dx = exp * (dloss / sum), the target's
// element less dloss.
static void ce_row(Emit *e, const char *what, int64_t v, bool x16, const char *loss, const char *dx,
                   const char *dloss, bool bf16, bool round_x, const char *dx16) {
  const char *xj = x16 ? "mdl_bf16_to_f32(x[j])" : "x[j]";
  e->uses_h = true;
  ec_enter(&e->core, "if (t < 0 || t >= %lld)", (long long)v);
  ec_line(&e->core, "if (t >= %lld)", (long long)v);
  ec_line(&e->core, "  h->error(h->ctx, \"%s: target\", t, %lld);", what, (long long)v);
  if (loss)
    ec_line(&e->core, "%s = 0.0f;", loss);
  if (dx16)
    ec_line(&e->core, "memset(%s, 0, %lld * sizeof(uint16_t));", dx16, (long long)v);
  else if (dx)
    ec_line(&e->core, "memset(%s, 0, %lld * sizeof(float));", dx, (long long)v);
  ec_line(&e->core, "continue;");
  ec_leave(&e->core);
  if (loss && !round_x)
    ec_line(&e->core, "const float xt = %s; // before dx, which may be x itself, is written",
            x16 ? "mdl_bf16_to_f32(x[t])" : "x[t]");
  ec_line(&e->core, "float m = -INFINITY;");
  ec_line(&e->core, "#pragma omp simd reduction(max : m)");
  ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
  if (round_x) { // the logits rounded to bf16 in place (their CAST) as the maximum is taken
    ec_line(&e->core, "x[j] = mdl_bf16_to_f32(mdl_f32_to_bf16(x[j]));");
    ec_line(&e->core, "m = x[j] > m ? x[j] : m;");
  } else {
    ec_line(&e->core, "const float xv = %s;", xj);
    ec_line(&e->core, "m = xv > m ? xv : m;");
  }
  ec_leave(&e->core);
  if (loss && round_x)
    ec_line(&e->core, "const float xt = x[t]; // before dx, which may be x itself, is written");
  c_exp_sum(e, v, c_str(e, "mdl_exp_shifted(%s - m)", xj), dx);
  if (loss)
    ec_line(&e->core, "%s = (float)(m + log(sum) - xt);", loss);
  if (dx) {
    ec_line(&e->core, "const float g = %s, sc = (float)(g / sum), et = %s[t];", dloss, dx);
    if (dx16) { // the gradient rounded to bf16, as the bits the backward GEMMs read (dx is not read again)
      ec_line(&e->core, "#pragma omp simd");
      ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
      ec_line(&e->core, "  %s[j] = mdl_f32_to_bf16(%s[j] * sc);", dx16, dx);
      ec_line(&e->core, "%s[t] = mdl_f32_to_bf16(et * sc - g);", dx16);
    } else {
      ec_line(&e->core, "#pragma omp simd");
      ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
      if (bf16) {
        ec_line(&e->core, "  %s[j] = mdl_bf16_to_f32(mdl_f32_to_bf16(%s[j] * sc));", dx, dx);
        ec_line(&e->core, "%s[t] = mdl_bf16_to_f32(mdl_f32_to_bf16(et * sc - g));", dx);
      } else {
        ec_line(&e->core, "  %s[j] *= sc;", dx);
        ec_line(&e->core, "%s[t] = et * sc - g;", dx);
      }
    }
  }
}

// CROSS_ENTROPY and / or CROSS_ENTROPY_BWD over the same logits: one pass per row.
void c_emit_ce(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  const Group *gr = &e->core.groups[gi];
  int ce = -1, ceb = -1;
  for (int i = 0; i < gr->nmem; i++)
    *(ec_node(&e->core, gr->mem[i])->op == OP_CROSS_ENTROPY ? &ce : &ceb) = gr->mem[i];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  int64_t v = ec_last_dim(&e->core, nd->in[0]), rows = ec_numel(&e->core, nd->in[1]);
  int lg = ec_need(&e->core, nd->in[0]), tg = ec_need(&e->core, nd->in[1]),
      dl = ceb >= 0 ? ec_need(&e->core, ec_node(&e->core, ceb)->in[2]) : -1;
  ew_outputs_open(&e->core, gr->mem, gr->nmem);
  c_note(e, "cross-entropy%s: %lld rows of %lld", ceb >= 0 ? (ce >= 0 ? " and its gradient" : " gradient") : "",
         (long long)rows, (long long)v);
  c_par_for(e, rows * v, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  bool x16 = ec_node(&e->core, lg)->dtype == DT_BF16;
  ec_line(&e->core, "const %s *x = b%d + r * %lld;", x16 ? "uint16_t" : "float", c_ptr(e, lg), (long long)v);
  ec_line(&e->core, "const int32_t t = b%d[r];", c_ptr(e, tg));
  if (ceb >= 0)
    ec_line(&e->core, "float *dx = b%d + r * %lld;", c_ptr(e, ceb), (long long)v);
  ce_row(e, "cross_entropy", v, x16, ce >= 0 ? c_str(e, "b%d[r]", c_ptr(e, ce)) : NULL, ceb >= 0 ? "dx" : NULL,
         dl >= 0 ? c_str(e, "b%d[r]", c_ptr(e, dl)) : NULL, false, false, NULL);
  ec_leave(&e->core);
  ew_outputs_done(&e->core, gr->mem, gr->nmem);
}

// One pass of the LM head's chunks (see c_emit_lmhead), its GEMMs through gemm: mdl_gemm on f32 x and W
// (xs, ws), or mdl_bgemm on the bf16 ones, dlogits then rounded into the bf16 chunk dl16 for the
// backward GEMMs.
static void lmhead_chunks(Emit *e, const Group *gr, int64_t n, int64_t c, int64_t v, int64_t rc, const char *xs,
                          const char *ws, bool b16) {
  int64_t ldw = gr->tb ? c : v;
  bool bwd = gr->ceb >= 0; // (a graph without a backward: the logits and the loss alone)
  int tg = ec_need(&e->core, gr->tgt), dl = bwd ? ec_need(&e->core, gr->dloss) : -1;
  const char *gemm = b16 ? "mdl_bgemm" : "mdl_gemm", *dlog = b16 ? "dl16" : "logits";
  ec_line(&e->core, "float *logits = mdl_scratch(%lld * sizeof(float));", (long long)(rc * v));
  if (b16 && bwd)
    ec_line(&e->core, "uint16_t *dl16 = mdl_scratch(%lld * sizeof(uint16_t));", (long long)(rc * v));
  ec_enter(&e->core, "for (int64_t r0 = 0; r0 < %lld; r0 += %lld)", (long long)n, (long long)rc);
  ec_line(&e->core, "const int64_t rn = %lld - r0 < %lld ? %lld - r0 : %lld;", (long long)n, (long long)rc,
          (long long)n, (long long)rc);
  ec_line(&e->core, "%s(h, 0, %d, rn, %lld, %lld, %s + r0 * %lld, %lld, %s, %lld, 0.0f, logits, %lld);", gemm, gr->tb,
          (long long)v, (long long)c, xs, (long long)c, (long long)c, ws, (long long)ldw, (long long)v);
  c_par_for(e, rc * v, "static");
  ec_enter(&e->core, "for (int64_t i = 0; i < rn; i++)");
  ec_line(&e->core, "const int64_t r = r0 + i;");
  ec_line(&e->core, "%sfloat *x = logits + i * %lld;", gr->lc >= 0 ? "" : "const ", (long long)v);
  if (bwd)
    ec_line(&e->core, "float *dx = logits + i * %lld;", (long long)v);
  ec_line(&e->core, "const int32_t t = b%d[r];", c_ptr(e, tg));
  if (b16 && bwd)
    ec_line(&e->core, "uint16_t *d16 = dl16 + i * %lld;", (long long)v);
  // (the loss reads the logits rounded to bf16, their CAST lc, in place)
  ce_row(e, "cross_entropy", v, false, c_str(e, "b%d[r]", c_ptr(e, gr->ce)), bwd ? "dx" : NULL,
         bwd ? c_str(e, "b%d[r]", c_ptr(e, dl)) : NULL, gr->dlc >= 0, gr->lc >= 0, b16 && bwd ? "d16" : NULL);
  ec_leave(&e->core);
  if (!bwd) {
    ec_leave(&e->core);
    ec_line(&e->core, "mdl_free(logits);");
    return;
  }
  ec_line(&e->core, "%s(h, 0, %d, rn, %lld, %lld, %s, %lld, %s, %lld, 0.0f, b%d + r0 * %lld, %lld);", gemm, !gr->tb,
          (long long)c, (long long)v, dlog, (long long)v, ws, (long long)ldw, c_ptr(e, gr->dx), (long long)c,
          (long long)c);
  if (gr->tb)
    ec_line(&e->core, "%s(h, 1, 0, %lld, %lld, rn, %s, %lld, %s + r0 * %lld, %lld, r0 ? 1.0f : 0.0f, b%d, %lld);",
            gemm, (long long)v, (long long)c, dlog, (long long)v, xs, (long long)c, (long long)c, c_ptr(e, gr->dw),
            (long long)c);
  else
    ec_line(&e->core, "%s(h, 1, 0, %lld, %lld, rn, %s + r0 * %lld, %lld, %s, %lld, r0 ? 1.0f : 0.0f, b%d, %lld);",
            gemm, (long long)c, (long long)v, xs, (long long)c, (long long)c, dlog, (long long)v, c_ptr(e, gr->dw),
            (long long)v);
  ec_leave(&e->core);
  ec_line(&e->core, "mdl_free(logits);");
  if (b16)
    ec_line(&e->core, "mdl_free(dl16);");
}

// The LM head chunk by chunk: logits rows = x W^T (or x W) into a chunk buffer, cross-entropy and its
// gradient in place, then dx rows = dlogits W (W^T) and dW += dlogits^T x (x^T dlogits). With bf16
// operands, the logits are rounded to bf16 values before the loss reads them (their CAST, lc), and
// dlogits rounded to bf16 values; the GEMMs run on the library's bf16 GEMM where the runtime has one,
// else on x and W widened to f32 once for all the chunks.
void c_emit_lmhead(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  const Group *gr = &e->core.groups[gi];
  const IrNode *xm = ec_node(&e->core, gr->x);
  int64_t n = xm->shape.d[0], c = xm->shape.d[1], v = ec_last_dim(&e->core, gr->mm);
  int x = ec_need(&e->core, gr->x), w = ec_need(&e->core, gr->w);
  ew_flush(&e->core);
  int outs[3] = {gr->ce, gr->dx, gr->dw}, nout = gr->ceb >= 0 ? 3 : 1;
  for (int i = 0; i < nout; i++)
    if (ec_offset(&e->core, outs[i]) < 0)
      e->core.scratch[outs[i]] = true;
  // Chunks of a multiple of 64 rows: at most 16M logits (64 MB), at most a quarter of the rows but
  // 256 at least. Each chunk's rows are the inner dimension of dW's GEMM, which runs far below the
  // library's rate on a few dozen (GPT-2 124M at B4 T64 in quarters of 64 rows: the LM head at 133
  // GFLOP/s in fp32, 225 in one chunk of 256); and chunks larger than a quarter measured slower at
  // L4 C256 V8192 (1024 rows, 32 MB of logits: 56 ms against 39 in quarters).
  int64_t rc = (16 << 20) / v / 64 * 64, quarter = (n / 4 + 63) / 64 * 64;
  if (rc > quarter)
    rc = quarter > 256 ? quarter : 256;
  if (rc < 64)
    rc = 64;
  if (rc > n)
    rc = n;
  int64_t ldw = gr->tb ? c : v;
  e->uses_h = true;
  ec_phase_begin(&e->core);
  c_note(e, "LM head: %lld rows x %lld classes from width %lld, in chunks of %lld rows", (long long)n, (long long)v,
         (long long)c, (long long)rc);
  bool b16 = ec_node(&e->core, x)->dtype == DT_BF16 && ec_node(&e->core, w)->dtype == DT_BF16 &&
             (gr->dlc >= 0 || gr->ceb < 0);
  if (b16) {
    ec_enter(&e->core, "if (h->bgemm)");
    lmhead_chunks(e, gr, n, c, v, rc, c_rows_at(e, x, 0, c).base, c_rows_at(e, w, 0, ldw).base, true);
    ec_leave(&e->core);
    ec_enter(&e->core, "else");
  }
  int wide[2], nwide = 0;
  const char *xs = c_widened(e, c_rows_at(e, x, 0, c), wide, &nwide).base;
  const char *ws = c_widened(e, c_rows_at(e, w, 0, ldw), wide, &nwide).base;
  lmhead_chunks(e, gr, n, c, v, rc, xs, ws, false);
  c_free_widened(e, wide, nwide);
  if (b16)
    ec_leave(&e->core);
  ew_outputs_done(&e->core, outs, nout);
}
