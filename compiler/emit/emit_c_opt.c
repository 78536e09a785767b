// emit_c_opt.c: the C emitter's optimizer (gradient norm, clipping and the update of every parameter
// segment: AdamW, SGD or Lion). See emit_c.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_c_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// GRAD_NORM (sum of squares per tensor in double, fixed blocks) and the updates (AdamW, SGD or Lion:
// interp.c's rules) over a table of parameter segments, in f32 per element; p and its moments in
// place, and the parameter's bf16 copy (fuse.c, rule 11) rounded from the new p. Each segment has
// its weight decay and its multiplier of lr (lr_scale). With ZeRO stage 1 (--zero 1) the runtime's
// hooks name the parameters this rank updates (own_lo, own_end: arena bytes); the others are skipped.
void c_emit_optimizer(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  const Group *gr = &e->core.groups[gi];
  int gn = -1;
  ew_opt_open(&e->core, gi);
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = ec_node(&e->core, gr->mem[i]);
    if (nd->op != OP_GRAD_NORM)
      continue;
    e->uses_h = true;
    gn = gr->mem[i];
    int64_t total = 0;
    for (int k = 0; k < nd->nin; k++)
      total += ec_numel(&e->core, nd->in[k]);
    c_note(e, "gradient norm %%%d over %d tensors, %lld values", gn, nd->nin, (long long)total);
    ec_enter(&e->core, "%s", "");
    ec_line(&e->core, "double ss = 0;");
    for (int k = 0; k < nd->nin; k++) {
      const char *label = ec_node(&e->core, ec_canon(&e->core, nd->in[k]))->name;
      ec_line(&e->core, "ss += mdl_sumsq(b%d, %lld, h->nthreads); // %s", c_ptr(e, ec_need(&e->core, nd->in[k])),
              (long long)ec_numel(&e->core, nd->in[k]), label ? label : "");
    }
    if (ec_offset(&e->core, gn) < 0)
      e->core.scratch[gn] = true;
    ec_line(&e->core, "b%d[0] = (float)sqrt(ss);", c_ptr(e, gn));
    ec_leave(&e->core);
    ec_phase_done(&e->core, gn);
  }
  // Updates that share their rule, hyperparameters and scalars run over one table.
  bool *done = ec_xcalloc((size_t)gr->nmem, sizeof *done);
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *a = ec_node(&e->core, gr->mem[i]);
    if (done[i] || a->op != OP_ADAMW)
      continue;
    int *seg = ec_xcalloc((size_t)gr->nmem, sizeof *seg);
    int64_t total;
    int ns = ew_opt_segments(&e->core, gi, i, done, seg, &total);
    OptRule rule = (OptRule)a->ia[0];
    int ncol = a->nin - 3; // p, g and the moments (Muon: m and the orthogonalised update as v)
    int gnorm = ec_need(&e->core, opt_gnorm(a)), lr = ec_need(&e->core, opt_lr(a)), step = ec_need(&e->core, opt_step(a));
    int ncopies = 0;
    for (int j = 0; j < ns; j++)
      ncopies += e->core.f->copy_of[ec_canon(&e->core, ec_node(&e->core, seg[j])->in[0])] >= 0;
    const char *hyper = ew_opt_hyper(&e->core, a);
    c_note(e, "%s over %d parameters, %lld values (%s, clip %g)%s",
           rule == OPT_SGD ? "SGD" : rule == OPT_LION ? "Lion" : rule == OPT_MUON ? "Muon" : "AdamW", ns,
           (long long)total, hyper, a->fa[4], ncopies ? ec_str(&e->core, "; %d bf16 copies", ncopies) : "");
    ec_enter(&e->core, "%s", "");
    ec_line(&e->core, "static const struct {");
    ec_line(&e->core, "  int64_t p, g, %s%sn;%s", ncol > 2 ? "m, " : "", ncol > 3 ? "v, " : "",
            ncopies ? ec_str(&e->core, "\n    int64_t c; // the bf16 copy, or -1") : "");
    ec_line(&e->core, rule == OPT_MUON ? "  double wd, ls; // weight decay, lr_scale (v: the orthogonalised update)"
                                       : "  double wd, ls; // weight decay, lr_scale");
    ec_line(&e->core, "} seg[%d] = {", ns);
    for (int j = 0; j < ns; j++) {
      const IrNode *u = ec_node(&e->core, seg[j]);
      int p = ec_canon(&e->core, u->in[0]), c = e->core.f->copy_of[p];
      Buf row = {0};
      for (int k = 0; k < ncol; k++) {
        int x = ec_canon(&e->core, u->in[k]);
        if (ec_offset(&e->core, x) < 0)
          ec_fail(&e->core, "update %d: parameter, gradient or moments not in memory", seg[j]);
        ec_bput(&row, "%lld, ", (long long)ec_offset(&e->core, x));
      }
      ec_line(&e->core, "    {%s%lld, %s%s, %s}, // %s", ec_buf_str(&e->core, &row), (long long)ec_numel(&e->core, p),
              ncopies ? ec_str(&e->core, "%lld, ", c >= 0 ? (long long)ec_offset(&e->core, c) : -1LL) : "",
              ec_dlit(&e->core, u->fa[3]), ec_dlit(&e->core, opt_lr_scale(u)),
              ec_node(&e->core, p)->name ? ec_node(&e->core, p)->name : "");
    }
    ec_line(&e->core, "};");
    ec_line(&e->core, "const double clip = %s, gnorm = b%d[0];", ec_dlit(&e->core, a->fa[4]), c_ptr(e, gnorm));
    ec_line(&e->core, "const double step = b%d[0];", c_ptr(e, step));
    // A non-finite loss or gradient norm leaves p and its moments as they were: the runtime reads the
    // same two values after the step, and stops or skips the step (train.c) with the last finite weights.
    int loss = e->core.f->g->loss >= 0 ? ec_need(&e->core, e->core.f->g->loss) : -1;
    ec_line(&e->core, "const int nseg = isfinite(gnorm)%s ? %d : 0;",
            loss >= 0 ? ec_str(&e->core, " && isfinite(b%d[0])", c_ptr(e, loss)) : "", ns);
    ec_line(&e->core, "const float s = (float)(clip > 0 ? fmin(1.0, clip / (gnorm + 1e-6)) : 1.0);");
    ec_line(&e->core, "const float lr0 = b%d[0], b1 = %s, b2 = %s, eps = %s;", c_ptr(e, lr), c_flit(e, a->fa[0]),
            c_flit(e, a->fa[1]), c_flit(e, a->fa[2]));
    if (rule == OPT_ADAMW)
      ec_line(&e->core, "const float c1 = (float)(1.0 / (1.0 - pow(b1, step))), c2 = (float)(1.0 / (1.0 - pow(b2, step)));");
    else
      ec_line(&e->core, "(void)step, (void)b1, (void)b2, (void)eps;");
    if (total >= PAR_MIN) {
      ec_line(&e->core, "#pragma omp parallel num_threads(h->nthreads)");
      e->uses_h = true;
    }
    ec_enter(&e->core, "for (int k = 0; k < nseg; k++)");
    ec_line(&e->core, "if (h->own_end && (seg[k].p < h->own_lo || seg[k].p >= h->own_end))");
    ec_line(&e->core, "  continue; // (--zero 1: another rank updates it)");
    e->uses_h = true;
    ec_line(&e->core, "float *restrict p = (float *)(arena + seg[k].p);");
    if (ncol > 2)
      ec_line(&e->core, "float *restrict m = (float *)(arena + seg[k].m);");
    if (ncol > 3)
      ec_line(&e->core, rule == OPT_MUON ? "const float *restrict v = (const float *)(arena + seg[k].v);"
                                         : "float *restrict v = (float *)(arena + seg[k].v);");
    ec_line(&e->core, "const float *restrict g = (const float *)(arena + seg[k].g);");
    if (ncopies)
      ec_line(&e->core, "uint16_t *restrict c = seg[k].c >= 0 ? (uint16_t *)(arena + seg[k].c) : NULL;");
    ec_line(&e->core, "const float wd = (float)seg[k].wd, lr = lr0 * (float)seg[k].ls;");
    if (total >= PAR_MIN)
      ec_line(&e->core, "#pragma omp for simd schedule(static) nowait");
    else
      ec_line(&e->core, "#pragma omp simd");
    ec_enter(&e->core, "for (int64_t i = 0; i < seg[k].n; i++)");
    if (rule == OPT_SGD) { // torch.optim.SGD, dampening 0: the decay joins the gradient
      ec_line(&e->core, "const float gi = s * g[i] + wd * p[i];");
      if (ncol > 2) {
        ec_line(&e->core, "const float mi = b1 * m[i] + gi;");
        ec_line(&e->core, "m[i] = mi;");
        ec_line(&e->core, a->fa[1] != 0 ? "p[i] = p[i] - lr * (gi + b1 * mi);" : "p[i] = p[i] - lr * mi;");
      } else {
        ec_line(&e->core, "p[i] = p[i] - lr * gi;");
      }
    } else if (rule == OPT_MUON) { // the momentum (u, its orthogonalisation, was computed before)
      ec_line(&e->core, "const float gi = s * g[i];");
      ec_line(&e->core, "m[i] = b1 * m[i] + (1.0f - b1) * gi;");
      ec_line(&e->core, "p[i] = p[i] - lr * (v[i] + wd * p[i]);");
    } else if (rule == OPT_LION) { // the sign of an interpolation, then the momentum's update
      ec_line(&e->core, "const float gi = s * g[i], u = b1 * m[i] + (1.0f - b1) * gi;");
      ec_line(&e->core, "p[i] = p[i] - lr * ((float)((u > 0.0f) - (u < 0.0f)) + wd * p[i]);");
      ec_line(&e->core, "m[i] = b2 * m[i] + (1.0f - b2) * gi;");
    } else {
      ec_line(&e->core, "const float gi = s * g[i];");
      ec_line(&e->core, "const float mi = b1 * m[i] + (1.0f - b1) * gi, vi = b2 * v[i] + (1.0f - b2) * gi * gi;");
      ec_line(&e->core, "m[i] = mi;");
      ec_line(&e->core, "v[i] = vi;");
      ec_line(&e->core, "p[i] = p[i] - lr * (mi * c1 / (sqrtf(vi * c2) + eps) + wd * p[i]);");
    }
    if (ncopies) {
      ec_line(&e->core, "if (c)");
      ec_line(&e->core, "  c[i] = mdl_f32_to_bf16(p[i]);");
    }
    ec_leave(&e->core);
    ec_leave(&e->core);
    for (int j = 0; j < ns; j++) {
      int p = ec_canon(&e->core, ec_node(&e->core, seg[j])->in[0]);
      if (ec_offset(&e->core, seg[j]) >= 0 && ec_offset(&e->core, seg[j]) != ec_offset(&e->core, p))
        ec_line(&e->core, "memcpy(b%d, b%d, %lld * sizeof(float));", c_ptr(e, seg[j]), c_ptr(e, p),
                (long long)ec_numel(&e->core, p));
      ec_phase_done(&e->core, seg[j]);
    }
    ec_leave(&e->core);
    free(seg);
  }
  free(done);
  ec_phase_end(&e->core);
}
