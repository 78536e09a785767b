// emit_c_rows.c: the C emitter's row and reduction loops (sums, norms forward and backward, softmax,
// embed and its backward, rope, masks). See emit_c.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_c_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// The accumulation of one value v into acc: a sum, or a max where a NaN wins (as in interp.c).
static void accumulate(Emit *e, bool max) {
  if (max) {
    ec_line(&e->core, "if (v > acc || isnan(v))");
    ec_line(&e->core, "  acc = isnan(acc) ? acc : v;");
  } else {
    ec_line(&e->core, "acc += v;");
  }
}

// SUM / MEAN / MAX over one axis, the input computed inline; TARGET_COUNT as a sum over all its
// targets of 1 for each counted one. Many outputs: one task per output. Few outputs over many
// elements: partial results per fixed block of the reduced axis (of rows, for column sums), combined
// in block order.
void c_emit_reduce(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  EwReduce rd;
  ew_reduce_open(&e->core, gi, &rd);
  const char *init = rd.max ? "-INFINITY" : "0.0";
  if ((rd.inner == 1 && (rd.outer >= 16 || rd.len < 4096)) || (rd.inner > 1 && rd.outer > 1)) {
    c_note(e, "%s %%%d: %lld outputs, each over %lld elements", op_name(rd.nd->op), rd.a, (long long)rd.on,
           (long long)rd.len);
    c_par_for(e, rd.on * rd.len, "static");
    ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rd.on);
    if (rd.inner == 1)
      ec_line(&e->core, "const int64_t base = r * %lld;", (long long)rd.len);
    else
      ec_line(&e->core, "const int64_t base = r / %lld * %lld + r %% %lld;", (long long)rd.inner,
              (long long)(rd.len * rd.inner), (long long)rd.inner);
    ec_line(&e->core, "%s acc = %s;", rd.acc_t, init);
    ec_enter(&e->core, "for (int64_t l = 0; l < %lld; l++)", (long long)rd.len);
    if (rd.inner == 1)
      ec_line(&e->core, "const int64_t ix = base + l;");
    else
      ec_line(&e->core, "const int64_t ix = base + l * %lld;", (long long)rd.inner);
    e->core.loop_ix = "ix";
    e->core.loop_n = ec_numel(&e->core, rd.x);
    ec_reduce_input(&e->core, rd.a, rd.side, rd.nside);
    accumulate(e, rd.max);
    ec_leave(&e->core);
    ew_reduce_finish(&e->core, &rd);
    ec_leave(&e->core);
  } else {
    bool col = rd.inner > 1;
    int64_t bl = (rd.len + 63) / 64, least = col ? 16 : 1024;
    if (bl < least)
      bl = least;
    int64_t nb = (rd.len + bl - 1) / bl;
    c_note(e, "%s %%%d: %lld outputs over %lld elements, in %lld blocks of %lld", op_name(rd.nd->op), rd.a,
           (long long)rd.on, (long long)rd.len, (long long)nb, (long long)bl);
    ec_enter(&e->core, "%s", ""); // (a scope of its own: a kernel may hold several such reductions)
    ec_line(&e->core, "%s *part = mdl_scratch(%lld * sizeof(%s));", rd.acc_t, (long long)(nb * rd.on), rd.acc_t);
    e->core.loop_ix = "ix";
    e->core.loop_n = ec_numel(&e->core, rd.x);
    if (col) {
      c_par_for(e, rd.len * rd.inner, "static");
      ec_enter(&e->core, "for (int64_t k = 0; k < %lld; k++)", (long long)nb);
      ec_line(&e->core, "%s *p = part + k * %lld;", rd.acc_t, (long long)rd.inner);
      ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)rd.inner);
      ec_line(&e->core, "  p[c] = %s;", init);
      ec_line(&e->core, "const int64_t end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", (long long)bl,
              (long long)bl, (long long)rd.len, (long long)bl, (long long)bl, (long long)rd.len);
      ec_enter(&e->core, "for (int64_t l = k * %lld; l < end; l++)", (long long)bl);
      ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)rd.inner);
      ec_line(&e->core, "const int64_t ix = l * %lld + c;", (long long)rd.inner);
      e->core.row_ix = "ix";
      e->core.row_r = "l";
      e->core.row_w = rd.inner;
      ec_reduce_input(&e->core, rd.a, rd.side, rd.nside);
      e->core.row_ix = NULL;
      if (rd.max) {
        ec_line(&e->core, "float acc = p[c];");
        accumulate(e, rd.max);
        ec_line(&e->core, "p[c] = acc;");
      } else {
        ec_line(&e->core, "p[c] += v;");
      }
      ec_leave(&e->core);
      ec_leave(&e->core);
      ec_leave(&e->core);
    } else {
      c_par_for(e, rd.on * rd.len, "static");
      ec_enter(&e->core, "for (int64_t t = 0; t < %lld; t++)", (long long)(rd.on * nb));
      ec_line(&e->core, "const int64_t r = t / %lld, l0 = t %% %lld * %lld;", (long long)nb, (long long)nb,
              (long long)bl);
      ec_line(&e->core, "const int64_t end = l0 + %lld < %lld ? l0 + %lld : %lld;", (long long)bl, (long long)rd.len,
              (long long)bl, (long long)rd.len);
      ec_line(&e->core, "%s acc = %s;", rd.acc_t, init);
      ec_enter(&e->core, "for (int64_t l = l0; l < end; l++)");
      ec_line(&e->core, "const int64_t ix = r * %lld + l;", (long long)rd.len);
      ec_reduce_input(&e->core, rd.a, rd.side, rd.nside);
      accumulate(e, rd.max);
      ec_leave(&e->core);
      ec_line(&e->core, "part[t] = acc;");
      ec_leave(&e->core);
    }
    c_par_for(e, rd.on * nb * (rd.nq + 1), "static");
    ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rd.on);
    ec_line(&e->core, "%s acc = %s;", rd.acc_t, init);
    ec_enter(&e->core, "for (int64_t k = 0; k < %lld; k++)", (long long)nb);
    if (col)
      ec_line(&e->core, "const %s v = part[k * %lld + r];", rd.acc_t, (long long)rd.inner);
    else
      ec_line(&e->core, "const %s v = part[r * %lld + k];", rd.acc_t, (long long)nb);
    accumulate(e, rd.max);
    ec_leave(&e->core);
    ew_reduce_finish(&e->core, &rd);
    ec_leave(&e->core);
    ec_line(&e->core, "mdl_free(part);");
    ec_leave(&e->core);
  }
  e->core.loop_ix = NULL;
  if (rd.buf)
    ec_phase_done(&e->core, rd.a);
  ec_phase_end(&e->core);
  ew_reduce_close(&rd);
}

// LAYERNORM / RMSNORM forward, one row per iteration; x (the residual sum) computed inline.
void c_emit_norm_fwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool ln = nd->op == OP_LAYERNORM;
  int64_t cols = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / cols;
  bool xin = c_row_inline(e, nd->in[0]);
  int w = ec_need(&e->core, nd->in[1]), bias = ln ? ec_need(&e->core, nd->in[2]) : -1;
  ew_flush(&e->core);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), e->core.emitted, q);
  bool buf = ew_whole(&e->core, a);
  Tmp tmp[2];
  int ntmp = 0;
  if (xin)
    tmp[ntmp++] = (Tmp){"xrow", cols};
  if (!buf)
    tmp[ntmp++] = (Tmp){"yrow", cols};
  ec_phase_begin(&e->core);
  c_note(e, "%s %%%d: %lld rows of %lld", op_name(nd->op), a, (long long)rows, (long long)cols);
  c_rows_open(e, "r", rows, rows * cols, tmp, ntmp);
  c_row_ptr(e, nd->in[0], "x", "xrow", cols);
  if (ln) {
    ec_line(&e->core, "double mean = 0, var = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : mean)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  mean += x[j];");
    ec_line(&e->core, "mean /= %lld;", (long long)cols);
    ec_line(&e->core, "#pragma omp simd reduction(+ : var)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  var += (x[j] - mean) * (x[j] - mean);");
    ec_line(&e->core, "const double rstd = 1.0 / sqrt(var / %lld + %s);", (long long)cols,
            ec_dlit(&e->core, nd->fa[0]));
  } else {
    ec_line(&e->core, "double ms = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : ms)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  ms += (double)x[j] * x[j];");
    ec_line(&e->core, "const double s = 1.0 / sqrt(ms / %lld + %s);", (long long)cols, ec_dlit(&e->core, nd->fa[0]));
  }
  if (buf)
    ec_line(&e->core, "float *y = b%d + r * %lld;", c_ptr(e, a), (long long)cols);
  else
    ec_line(&e->core, "float *y = yrow;");
  ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
  if (ln)
    ec_line(&e->core, "  y[j] = (float)((x[j] - mean) * rstd * b%d[j] + b%d[j]);", c_ptr(e, w), c_ptr(e, bias));
  else
    ec_line(&e->core, "  y[j] = (float)(x[j] * s * b%d[j]);", c_ptr(e, w));
  if (nq) {
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "const int64_t ix = r * %lld + j;", (long long)cols);
    ew_post_inloop(&e->core, a, q, nq, "ix", ec_numel(&e->core, a), "y[j]");
    ec_leave(&e->core);
  }
  c_rows_close(e, tmp, ntmp);
  e->core.loop_ix = NULL;
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
}

// LAYERNORM_BWD / RMSNORM_BWD siblings: dx per row; dw (and db) as column sums in double over fixed
// blocks of rows, added in block order.
void c_emit_norm_bwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  const Group *gr = &e->core.groups[gi];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  bool ln = nd->op == OP_LAYERNORM_BWD;
  int dx, dw, db, sums[EC_MAX_COLSUMS], nsum = ec_norm_members(&e->core, gi, &dx, &dw, &db, sums);
  int x = nd->in[0], dy = nd->in[2];
  int64_t cols = ec_last_dim(&e->core, x), rows = ec_numel(&e->core, x) / cols;
  bool xin = c_row_inline(e, x), dyin = c_row_inline(e, dy);
  int w = ec_need(&e->core, nd->in[1]);
  ew_flush(&e->core);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = dx >= 0 ? ec_post_set(&e->core, gi, ec_numel(&e->core, dx), e->core.emitted, q) : 0;
  bool dxbuf = dx >= 0 && ew_whole(&e->core, dx);
  bool cols_sum = dw >= 0 || db >= 0 || nsum > 0;
  Tmp tmp[3];
  int ntmp = 0;
  if (xin)
    tmp[ntmp++] = (Tmp){"xrow", cols};
  if (dyin)
    tmp[ntmp++] = (Tmp){"dyrow", cols};
  if (dx >= 0 && !dxbuf)
    tmp[ntmp++] = (Tmp){"dxrow", cols};
  int64_t bl = (rows + 63) / 64 < 16 ? 16 : (rows + 63) / 64, nb = (rows + bl - 1) / bl;
  ec_phase_begin(&e->core);
  c_note(e, "%s: %lld rows of %lld%s", op_name(nd->op), (long long)rows, (long long)cols,
         cols_sum ? c_str(e, ", column sums over %lld blocks of %lld rows", (long long)nb, (long long)bl) : "");
  if (cols_sum) {
    if (dw >= 0)
      ec_line(&e->core, "double *pdw = mdl_scratch(%lld * sizeof(double));", (long long)(nb * cols));
    if (db >= 0)
      ec_line(&e->core, "double *pdb = mdl_scratch(%lld * sizeof(double));", (long long)(nb * cols));
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "double *ps%d = mdl_scratch(%lld * sizeof(double)); // partials of the column sum %%%d", i,
              (long long)(nb * cols), sums[i]);
    c_rows_open(e, "k", nb, rows * cols, tmp, ntmp);
    if (dw >= 0)
      ec_line(&e->core, "double *sw = pdw + k * %lld;", (long long)cols);
    if (db >= 0)
      ec_line(&e->core, "double *sb = pdb + k * %lld;", (long long)cols);
    Buf zero = {0};
    for (int i = 0; i < nsum; i++) {
      ec_line(&e->core, "double *sa%d = ps%d + k * %lld;", i, i, (long long)cols);
      ec_bput(&zero, "sa%d[j] = ", i);
    }
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  %s%s%s0;", dw >= 0 ? "sw[j] = " : "", db >= 0 ? "sb[j] = " : "", zero.s ? zero.s : "");
    free(zero.s);
    ec_line(&e->core, "const int64_t end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", (long long)bl,
            (long long)bl, (long long)rows, (long long)bl, (long long)bl, (long long)rows);
    ec_enter(&e->core, "for (int64_t r = k * %lld; r < end; r++)", (long long)bl);
  } else {
    c_rows_open(e, "r", rows, rows * cols, tmp, ntmp);
  }
  c_row_ptr(e, x, "x", "xrow", cols);
  c_row_ptr(e, dy, "dy", "dyrow", cols);
  if (ln) {
    ec_line(&e->core, "double mean = 0, var = 0, mg = 0, mgx = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : mean)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  mean += x[j];");
    ec_line(&e->core, "mean /= %lld;", (long long)cols);
    ec_line(&e->core, "#pragma omp simd reduction(+ : var)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  var += (x[j] - mean) * (x[j] - mean);");
    ec_line(&e->core, "const double rstd = 1.0 / sqrt(var / %lld + %s);", (long long)cols,
            ec_dlit(&e->core, nd->fa[0]));
    ec_line(&e->core, "#pragma omp simd reduction(+ : mg, mgx)");
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "const double xhat = (x[j] - mean) * rstd, g = (double)dy[j] * b%d[j];", c_ptr(e, w));
    ec_line(&e->core, "mg += g;");
    ec_line(&e->core, "mgx += g * xhat;");
    if (dw >= 0)
      ec_line(&e->core, "sw[j] += dy[j] * xhat;");
    if (db >= 0)
      ec_line(&e->core, "sb[j] += dy[j];");
    ec_leave(&e->core);
  } else {
    ec_line(&e->core, "double ms = 0, mgx = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : ms)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  ms += (double)x[j] * x[j];");
    ec_line(&e->core, "const double s = 1.0 / sqrt(ms / %lld + %s);", (long long)cols, ec_dlit(&e->core, nd->fa[0]));
    ec_line(&e->core, "#pragma omp simd reduction(+ : mgx)");
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "mgx += (double)dy[j] * b%d[j] * x[j];", c_ptr(e, w));
    if (dw >= 0)
      ec_line(&e->core, "sw[j] += (double)dy[j] * x[j] * s;");
    ec_leave(&e->core);
  }
  if (dx >= 0) {
    if (dxbuf)
      ec_line(&e->core, "float *dx = b%d + r * %lld;", c_ptr(e, dx), (long long)cols);
    else
      ec_line(&e->core, "float *dx = dxrow;");
    if (ln) {
      ec_line(&e->core, "mg /= %lld;", (long long)cols);
      ec_line(&e->core, "mgx /= %lld;", (long long)cols);
      ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
      ec_line(&e->core, "  dx[j] = (float)(rstd * ((double)dy[j] * b%d[j] - mg - (x[j] - mean) * rstd * mgx));",
              c_ptr(e, w));
    } else {
      ec_line(&e->core, "mgx /= %lld;", (long long)cols);
      ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
      ec_line(&e->core, "  dx[j] = (float)(s * dy[j] * b%d[j] - s * s * s * x[j] * mgx);", c_ptr(e, w));
    }
    if (nq || nsum) {
      ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
      ec_line(&e->core, "const int64_t ix = r * %lld + j;", (long long)cols);
      ew_post_inloop(&e->core, dx, q, nq, "ix", ec_numel(&e->core, dx), "dx[j]");
      for (int i = 0; i < nsum; i++)
        ec_line(&e->core, "sa%d[j] += %s;", i, e->core.val(&e->core, ec_node(&e->core, sums[i])->in[0], "ix"));
      ec_leave(&e->core);
    }
  }
  if (cols_sum)
    ec_leave(&e->core);
  c_rows_close(e, tmp, ntmp);
  if (cols_sum) {
    c_par_for(e, cols * nb, "static");
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    Buf acc = {0};
    if (dw >= 0)
      ec_bput(&acc, "w = 0");
    if (db >= 0)
      ec_bput(&acc, "%sb = 0", acc.len ? ", " : "");
    for (int i = 0; i < nsum; i++)
      ec_bput(&acc, "%sa%d = 0", acc.len ? ", " : "", i);
    ec_line(&e->core, "double %s;", acc.s);
    free(acc.s);
    ec_enter(&e->core, "for (int64_t k = 0; k < %lld; k++)", (long long)nb);
    if (dw >= 0)
      ec_line(&e->core, "w += pdw[k * %lld + j];", (long long)cols);
    if (db >= 0)
      ec_line(&e->core, "b += pdb[k * %lld + j];", (long long)cols);
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "a%d += ps%d[k * %lld + j];", i, i, (long long)cols);
    ec_leave(&e->core);
    if (dw >= 0)
      ec_line(&e->core, "b%d[j] = (float)w;", c_ptr(e, dw));
    if (db >= 0)
      ec_line(&e->core, "b%d[j] = (float)b;", c_ptr(e, db));
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "b%d[j] = (float)a%d;", c_ptr(e, sums[i]), i);
    ec_leave(&e->core);
    if (dw >= 0)
      ec_line(&e->core, "mdl_free(pdw);");
    if (db >= 0)
      ec_line(&e->core, "mdl_free(pdb);");
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "mdl_free(ps%d);", i);
  }
  e->core.loop_ix = NULL;
  if (dxbuf)
    ec_phase_done(&e->core, dx);
  if (dw >= 0)
    ec_phase_done(&e->core, dw);
  if (db >= 0)
    ec_phase_done(&e->core, db);
  for (int i = 0; i < nsum; i++)
    ec_phase_done(&e->core, sums[i]);
  ec_phase_end(&e->core);
  free(q);
}

// SOFTMAX (x) or SOFTMAX_BWD (y, dy) over the last axis, one row per iteration.
void c_emit_softmax(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool bwd = nd->op == OP_SOFTMAX_BWD;
  int64_t cols = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / cols;
  bool in0 = c_row_inline(e, nd->in[0]), in1 = bwd && c_row_inline(e, nd->in[1]);
  ew_flush(&e->core);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), e->core.emitted, q);
  bool buf = ew_whole(&e->core, a);
  Tmp tmp[3] = {{0}};
  int ntmp = 0;
  if (in0)
    tmp[ntmp++] = (Tmp){"row0", cols};
  if (in1)
    tmp[ntmp++] = (Tmp){"row1", cols};
  if (!buf)
    tmp[ntmp++] = (Tmp){"yrow", cols};
  ec_phase_begin(&e->core);
  c_note(e, "%s %%%d: %lld rows of %lld", op_name(nd->op), a, (long long)rows, (long long)cols);
  c_rows_open(e, "r", rows, rows * cols, tmp, ntmp);
  c_row_ptr(e, nd->in[0], bwd ? "y" : "x", "row0", cols);
  if (bwd)
    c_row_ptr(e, nd->in[1], "dy", "row1", cols);
  if (buf)
    ec_line(&e->core, "float *out = b%d + r * %lld;", c_ptr(e, a), (long long)cols);
  else
    ec_line(&e->core, "float *out = yrow;");
  if (bwd) {
    ec_line(&e->core, "double dot = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : dot)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  dot += (double)y[j] * dy[j];");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  out[j] = (float)(y[j] * (dy[j] - dot));");
  } else {
    ec_line(&e->core, "float m = -INFINITY;");
    ec_line(&e->core, "#pragma omp simd reduction(max : m)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  m = x[j] > m ? x[j] : m;");
    c_exp_sum(e, cols, "mdl_exp_shifted(x[j] - m)", "out");
    ec_line(&e->core, "const float inv = (float)(1.0 / sum);");
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  out[j] *= inv;");
  }
  if (nq) {
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "const int64_t ix = r * %lld + j;", (long long)cols);
    ew_post_inloop(&e->core, a, q, nq, "ix", ec_numel(&e->core, a), "out[j]");
    ec_leave(&e->core);
  }
  c_rows_close(e, tmp, ntmp);
  e->core.loop_ix = NULL;
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
}

void c_emit_embed(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t v = ec_node(&e->core, nd->in[0])->shape.d[0], c = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / c;
  int tab = ec_need(&e->core, nd->in[0]), ids = ec_need(&e->core, nd->in[1]);
  ew_anchor_open(&e->core, a);
  e->uses_h = true;
  c_note(e, "embed: %lld rows of %lld from a table of %lld", (long long)rows, (long long)c, (long long)v);
  c_par_for(e, rows * c, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const int32_t id = b%d[r];", c_ptr(e, ids));
  ec_enter(&e->core, "if (id < 0 || id >= %lld)", (long long)v);
  ec_line(&e->core, "h->error(h->ctx, \"embed: id\", id, %lld);", (long long)v);
  ec_line(&e->core, "memset(b%d + r * %lld, 0, %lld * sizeof(float));", c_ptr(e, a), (long long)c, (long long)c);
  ec_line(&e->core, "continue;");
  ec_leave(&e->core);
  ec_line(&e->core, "memcpy(b%d + r * %lld, b%d + (int64_t)id * %lld, %lld * sizeof(float));", c_ptr(e, a),
          (long long)c, c_ptr(e, tab), (long long)c, (long long)c);
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// The ADD of the step that is the only reader of EMBED_BWD a, when it adds a to a table x of the same
// shape and type in memory, into a buffer of its own (a tied embedding's gradient: the LM head's dW
// plus the embedding's); -1 otherwise. *x is set to the other operand.
static int embed_bwd_add(Emit *e, int a, int *x) {
  const Step *st = &e->core.f->steps[e->core.si];
  int add = -1;
  for (int k = 0; k < st->nnodes; k++) {
    const IrNode *u = ec_node(&e->core, st->nodes[k]);
    for (int i = 0; i < u->nin; i++)
      if (ec_canon(&e->core, u->in[i]) == a) {
        if (add >= 0 || u->op != OP_ADD)
          return -1;
        add = st->nodes[k];
      }
  }
  if (add < 0 || ec_offset(&e->core, a) >= 0 || ec_offset(&e->core, add) < 0)
    return -1;
  const IrNode *ad = ec_node(&e->core, add), *an = ec_node(&e->core, a);
  int other = ec_canon(&e->core, ad->in[0]) == a ? ad->in[1] : ad->in[0];
  const IrNode *xn = ec_node(&e->core, other);
  if (ec_canon(&e->core, other) == a || xn->dtype != DT_F32 || ad->dtype != DT_F32 || !shape_eq(xn->shape, an->shape) ||
      !shape_eq(ad->shape, an->shape))
    return -1;
  int xm = ec_mem_alias(&e->core, other);
  if (xm < 0 || ec_offset(&e->core, xm) == ec_offset(&e->core, add))
    return -1;
  *x = xm;
  return add;
}

// EMBED_BWD a, a scatter-add parallel over blocks of columns, so that each row of the table is summed
// by one thread in row order: deterministic and race-free. Each id's first row (first[id], found in
// one pass over the ids) stores its dy row and later rows add theirs, so no row of the table is
// zeroed before it is summed into; the rows no id names are then zeros. With
// the ADD y = x + a that alone reads a (embed_bwd_add: a tied embedding's gradient, the LM head's dW
// plus the embedding's), the sums go straight into y, which becomes x + y on those rows and x on the
// others, and a has no table of its own: GPT-2 124M's zeroed scratch of 154 MB, its pass and the add's
// read of it took 110-225 ms a step, now 12.
void c_emit_embed_bwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t v = nd->shape.d[0], c = nd->shape.d[1], rows = ec_numel(&e->core, nd->in[0]);
  int ids = ec_need(&e->core, nd->in[0]), dy = ec_need(&e->core, nd->in[1]);
  int x = -1, add = embed_bwd_add(e, a, &x);
  ew_flush(&e->core);
  int out = add >= 0 ? add : a;
  if (ec_offset(&e->core, out) < 0)
    e->core.scratch[out] = true;
  int64_t cb = c < 16 ? c : 16, ncb = (c + cb - 1) / cb;
  e->uses_h = true;
  ec_phase_begin(&e->core);
  if (add >= 0)
    c_note(e, "embed backward added to %%%d: %lld rows of %lld into the rows of a table of %lld they name, %lld "
           "column blocks", x, (long long)rows, (long long)c, (long long)v, (long long)ncb);
  else
    c_note(e, "embed backward: %lld rows of %lld into a table of %lld, %lld column blocks", (long long)rows,
           (long long)c, (long long)v, (long long)ncb);
  int y = c_ptr(e, out);
  ec_line(&e->core, "int32_t *first = mdl_scratch(%lld * sizeof(int32_t));", (long long)v);
  ec_line(&e->core, "memset(first, 0xff, %lld * sizeof(int32_t));", (long long)v);
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const int32_t id = b%d[r];", c_ptr(e, ids));
  ec_line(&e->core, "if (id < 0 || id >= %lld)", (long long)v);
  ec_line(&e->core, "  h->error(h->ctx, \"embed: id\", id, %lld);", (long long)v);
  ec_line(&e->core, "else if (first[id] < 0)");
  ec_line(&e->core, "  first[id] = (int32_t)r;");
  ec_leave(&e->core);
  c_par_for(e, rows * c, "static");
  ec_enter(&e->core, "for (int64_t k = 0; k < %lld; k++)", (long long)ncb);
  ec_line(&e->core, "const int64_t c0 = k * %lld, c1 = c0 + %lld < %lld ? c0 + %lld : %lld;", (long long)cb,
          (long long)cb, (long long)c, (long long)cb, (long long)c);
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const int32_t id = b%d[r];", c_ptr(e, ids));
  ec_line(&e->core, "if (id < 0 || id >= %lld)", (long long)v);
  ec_line(&e->core, "  continue;");
  ec_line(&e->core, "float *restrict yr = b%d + (int64_t)id * %lld;", y, (long long)c);
  ec_line(&e->core, "const float *restrict dr = b%d + r * %lld;", c_ptr(e, dy), (long long)c);
  ec_line(&e->core, "if (first[id] == r)");
  ec_line(&e->core, "  for (int64_t j = c0; j < c1; j++)");
  ec_line(&e->core, "    yr[j] = dr[j];");
  ec_line(&e->core, "else");
  ec_line(&e->core, "  for (int64_t j = c0; j < c1; j++)");
  ec_line(&e->core, "    yr[j] += dr[j];");
  ec_leave(&e->core);
  ec_leave(&e->core);
  c_par_for(e, v * c, "static");
  ec_enter(&e->core, "for (int64_t t = 0; t < %lld; t++)", (long long)v);
  ec_line(&e->core, "float *restrict yr = b%d + t * %lld;", y, (long long)c);
  if (add >= 0) {
    ec_line(&e->core, "const float *restrict xr = b%d + t * %lld;", c_ptr(e, x), (long long)c);
    ec_line(&e->core, "if (first[t] < 0)");
    ec_line(&e->core, "  memcpy(yr, xr, %lld * sizeof(float));", (long long)c);
    ec_line(&e->core, "else");
    ec_line(&e->core, "  for (int64_t j = 0; j < %lld; j++)", (long long)c);
    ec_line(&e->core, "    yr[j] = xr[j] + yr[j];");
  } else {
    ec_line(&e->core, "if (first[t] < 0)");
    ec_line(&e->core, "  memset(yr, 0, %lld * sizeof(float));", (long long)c);
  }
  ec_leave(&e->core);
  ec_line(&e->core, "mdl_free(first);");
  ec_phase_done(&e->core, out);
  ec_phase_end(&e->core);
}

// ROPE: per row, the angles of the D/2 pairs once, applied to every head.
void c_emit_rope(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int64_t rows = s.d[0] * s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads;
  Rows x = c_rows_of(e, nd->in[0]);
  int pos = ec_need(&e->core, nd->in[1]);
  ew_anchor_open(&e->core, a);
  c_note(e, "rope%s: %lld rows, %lld heads of %lld", nd->ia[1] ? " (inverse)" : "", (long long)rows,
         (long long)heads, (long long)d);
  c_par_for(e, rows * nc * 4, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const double p = %sb%d[r];", nd->ia[1] ? "-1.0 * " : "", c_ptr(e, pos));
  ec_line(&e->core, "const float *x = %s + r * %lld;", x.base, (long long)x.stride);
  ec_line(&e->core, "float *y = b%d + r * %lld;", c_ptr(e, a), (long long)nc);
  ec_enter(&e->core, "for (int64_t i = 0; i < %lld; i++)", (long long)(d / 2));
  ec_line(&e->core, "const double th = p * pow(%s, -2.0 * (double)i / %lld);", ec_dlit(&e->core, nd->fa[0]),
          (long long)d);
  ec_line(&e->core, "const float cs = (float)cos(th), sn = (float)sin(th);");
  ec_enter(&e->core, "for (int64_t hd = 0; hd < %lld; hd++)", (long long)heads);
  ec_line(&e->core, "const int64_t a = hd * %lld + i, b = a + %lld;", (long long)d, (long long)(d / 2));
  ec_line(&e->core, "const float x1 = x[a], x2 = x[b];");
  ec_line(&e->core, "y[a] = x1 * cs - x2 * sn;");
  ec_line(&e->core, "y[b] = x1 * sn + x2 * cs;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// The condition under which query i may see key j in an attention mask (interp.c's rule), with di the
// query's doc id and dc the row's ids where the mask has them.
static const char *attn_mask_cond(Emit *e, const IrNode *nd) {
  bool causal = nd->ia[0], doc = nd->ia[1];
  const char *c = causal && doc ? "j <= i && dc[j] == di" : causal ? "j <= i" : doc ? "dc[j] == di" : "true";
  return nd->ia[2] ? c_str(e, "%s && i - j < %lld", c, (long long)nd->ia[2]) : c;
}

// ATTENTION_MASK ([doc]) -> [B or 1, 1, T, T]: 0 where query i may see key j, -inf where not; a row of
// keys per (batch, query).
void c_emit_attn_mask(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t rows = nd->shape.d[0] * nd->shape.d[2], nt = nd->shape.d[3];
  int doc = nd->ia[1] ? ec_need(&e->core, nd->in[0]) : -1;
  ew_anchor_open(&e->core, a);
  c_note(e, "attention mask: %lld rows of %lld keys%s%s", (long long)rows, (long long)nt, nd->ia[0] ? ", causal" : "",
         doc >= 0 ? ", within documents" : "");
  c_par_for(e, rows * nt, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const int64_t i = r %% %lld;", (long long)nt);
  if (doc >= 0) {
    ec_line(&e->core, "const int32_t *dc = b%d + (r - i);", c_ptr(e, doc));
    ec_line(&e->core, "const int32_t di = dc[i];");
  }
  ec_line(&e->core, "float *y = b%d + r * %lld;", c_ptr(e, a), (long long)nt);
  ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)nt);
  ec_line(&e->core, "  y[j] = %s ? 0.0f : -INFINITY;", attn_mask_cond(e, nd));
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// MAX_BWD (x, y, dy): the gradient goes to the maxima, shared evenly between ties.
void c_emit_max_bwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int ax = (int)nd->ia[0];
  int64_t outer = ec_span(s, 0, ax), len = s.d[ax], inner = ec_span(s, ax + 1, s.rank);
  int x = ec_need(&e->core, nd->in[0]), y = ec_need(&e->core, nd->in[1]), dy = ec_need(&e->core, nd->in[2]);
  ew_anchor_open(&e->core, a);
  c_note(e, "max backward: %lld outputs over %lld elements", (long long)(outer * inner), (long long)len);
  c_par_for(e, outer * len * inner, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)(outer * inner));
  ec_line(&e->core, "const int64_t base = r / %lld * %lld + r %% %lld;", (long long)inner, (long long)(len * inner),
          (long long)inner);
  ec_line(&e->core, "const float m = b%d[r];", c_ptr(e, y));
  ec_line(&e->core, "int64_t ties = 0;");
  ec_line(&e->core, "for (int64_t l = 0; l < %lld; l++)", (long long)len);
  ec_line(&e->core, "  ties += b%d[base + l * %lld] == m;", c_ptr(e, x), (long long)inner);
  ec_line(&e->core, "const float g = (float)((double)b%d[r] / (double)ties);", c_ptr(e, dy));
  ec_line(&e->core, "for (int64_t l = 0; l < %lld; l++)", (long long)len);
  ec_line(&e->core, "  b%d[base + l * %lld] = b%d[base + l * %lld] == m ? g : 0.0f;", c_ptr(e, a), (long long)inner,
          c_ptr(e, x), (long long)inner);
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// TOPK: per line along the axis, the k first positions in TOPK's order, found one by one (the next is
// the first of those after the last one found), as the interpreter does; parallel over the lines.
void c_emit_topk(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  int ax = (int)nd->ia[0];
  int64_t k = nd->ia[1], outer = ec_span(s, 0, ax), len = s.d[ax], inner = ec_span(s, ax + 1, s.rank);
  int x = ec_need(&e->core, nd->in[0]);
  ew_anchor_open(&e->core, a);
  c_note(e, "topk: the %lld largest of %lld lines of %lld", (long long)k, (long long)(outer * inner), (long long)len);
  c_par_for(e, outer * len * inner * k, "static");
  ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)(outer * inner));
  ec_line(&e->core, "const float *x = b%d + c / %lld * %lld + c %% %lld;", c_ptr(e, x), (long long)inner,
          (long long)(len * inner), (long long)inner);
  ec_line(&e->core, "int32_t *y = b%d + c / %lld * %lld + c %% %lld;", c_ptr(e, a), (long long)inner,
          (long long)(k * inner), (long long)inner);
  ec_line(&e->core, "int64_t last = -1;");
  ec_enter(&e->core, "for (int64_t p = 0; p < %lld; p++)", (long long)k);
  ec_line(&e->core, "int64_t best = -1;");
  ec_enter(&e->core, "for (int64_t l = 0; l < %lld; l++)", (long long)len);
  ec_line(&e->core, "const float v = x[l * %lld];", (long long)inner);
  ec_line(&e->core, "if (last >= 0 && !(%s))",
          ec_topk_before(&e->core, c_str(e, "x[last * %lld]", (long long)inner), "last", "v", "l"));
  ec_line(&e->core, "  continue;");
  ec_line(&e->core, "if (best < 0 || %s)",
          ec_topk_before(&e->core, "v", "l", c_str(e, "x[best * %lld]", (long long)inner), "best"));
  ec_line(&e->core, "  best = l;");
  ec_leave(&e->core);
  ec_line(&e->core, "y[p * %lld] = (int32_t)best;", (long long)inner);
  ec_line(&e->core, "last = best;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// GATHER: one output element per iteration; an index outside the axis reads 0.
void c_emit_gather(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int ax = (int)nd->ia[0];
  int64_t n = ec_numel(&e->core, a), ylen = s.d[ax], inner = ec_span(s, ax + 1, s.rank);
  int64_t xlen = ec_node(&e->core, nd->in[0])->shape.d[ax];
  int x = ec_need(&e->core, nd->in[0]), idx = ec_need(&e->core, nd->in[1]);
  ew_anchor_open(&e->core, a);
  c_note(e, "gather: %lld values along an axis of %lld", (long long)n, (long long)xlen);
  c_par_for(e, n, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)n);
  ec_line(&e->core, "const int32_t l = b%d[%s];", c_ptr(e, idx),
          ec_ix_bcast(&e->core, s, ec_node(&e->core, nd->in[1])->shape, "r"));
  ec_line(&e->core, "b%d[r] = l >= 0 && l < %lld ? b%d[(r / %lld * %lld + l) * %lld + r %% %lld] : 0.0f;", c_ptr(e, a),
          (long long)xlen, c_ptr(e, x), (long long)(ylen * inner), (long long)xlen, (long long)inner, (long long)inner);
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// SCATTER_ADD (base, idx, src) and GATHER_BWD (idx, src) over zeros: parallel over the lines along the
// axis, each line's sources added in order (no two threads add into one element).
void c_emit_scatter(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool has_base = nd->op == OP_SCATTER_ADD;
  Shape ys = nd->shape, ss = ec_node(&e->core, nd->in[has_base + 1])->shape;
  int ax = (int)nd->ia[0];
  int64_t ylen = ys.d[ax], slen = ss.d[ax], inner = ec_span(ys, ax + 1, ys.rank), lines = ec_span(ys, 0, ax) * inner;
  int base = has_base ? ec_need(&e->core, nd->in[0]) : -1;
  int idx = ec_need(&e->core, nd->in[has_base]), src = ec_need(&e->core, nd->in[has_base + 1]);
  ew_anchor_open(&e->core, a);
  c_note(e, "scatter-add: %lld lines, %lld sources into %lld places each", (long long)lines, (long long)slen,
         (long long)ylen);
  c_par_for(e, lines * (ylen + slen), "static");
  ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)lines);
  ec_line(&e->core, "const int64_t o = c / %lld, i = c %% %lld;", (long long)inner, (long long)inner);
  ec_line(&e->core, "float *y = b%d + o * %lld + i;", c_ptr(e, a), (long long)(ylen * inner));
  if (has_base)
    ec_line(&e->core, "const float *x = b%d + o * %lld + i;", c_ptr(e, base), (long long)(ylen * inner));
  ec_line(&e->core, "for (int64_t l = 0; l < %lld; l++)", (long long)ylen);
  ec_line(&e->core, "  y[l * %lld] = %s;", (long long)inner, has_base ? c_str(e, "x[l * %lld]", (long long)inner) : "0.0f");
  ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)slen);
  ec_line(&e->core, "const int64_t r = (o * %lld + j) * %lld + i;", (long long)slen, (long long)inner);
  ec_line(&e->core, "const int32_t l = b%d[%s];", c_ptr(e, idx),
          ec_ix_bcast(&e->core, ss, ec_node(&e->core, nd->in[has_base])->shape, "r"));
  ec_line(&e->core, "if (l >= 0 && l < %lld)", (long long)ylen);
  ec_line(&e->core, "  y[(int64_t)l * %lld] += b%d[r];", (long long)inner, c_ptr(e, src));
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}
