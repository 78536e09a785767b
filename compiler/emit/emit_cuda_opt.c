// emit_cuda_opt.c: the CUDA emitter's optimizer (gradient norm, clipping and the update, AdamW, SGD or
// Lion, over every parameter in one launch). See emit_cuda.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_cuda.h"
#include "emit_cuda_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// The optimizer's segments: a table at file scope named `name`, or, for one segment, a local array
// from the kernel's arguments (so that the kernels of equal segments are the same text). Entries are
// {p, g, m, v, c, n, start, wd, ls}; nodes -1 stand for fields left 0 (p, g, m, v) or -1 (c: no copy).
static void seg_table(Emit *e, const char *name, int nseg, const int (*nodes)[5], const int64_t *n,
                      const double *wd, const double *ls) {
  if (nseg == 1) {
    const char *f[5];
    for (int k = 0; k < 5; k++)
      f[k] = nodes[0][k] >= 0 ? cu_offset_arg(e, nodes[0][k]) : k == 4 ? "-1" : "0";
    ec_line(&e->core, "const MdlSeg seg[1] = {{%s, %s, %s, %s, %s, %lld, 0, %s, %s}};", f[0], f[1], f[2], f[3], f[4],
            (long long)n[0], ec_dlit(&e->core, wd[0]), ec_dlit(&e->core, ls[0]));
    return;
  }
  Buf b = {0};
  ec_bput(&b, "static __device__ const MdlSeg %s[%d] = {\n", name, nseg);
  int64_t start = 0;
  for (int s = 0; s < nseg; s++) {
    ec_bput(&b, "    {");
    for (int k = 0; k < 5; k++)
      ec_bput(&b, "%lld, ", nodes[s][k] >= 0 ? (long long)cu_buf_off(e, nodes[s][k]) : k == 4 ? -1LL : 0LL);
    const char *pname = ec_node(&e->core, nodes[s][0])->name;
    ec_bput(&b, "%lld, %lld, %s, %s}, // %s\n", (long long)n[s], (long long)start, ec_dlit(&e->core, wd[s]),
            ec_dlit(&e->core, ls[s]), pname ? pname : "");
    start += n[s];
  }
  ec_bput(&b, "};\n\n");
  e->table = ec_buf_str(&e->core, &b);
  ec_line(&e->core, "const MdlSeg *const seg = %s;", name);
}

// GRAD_NORM (a sum of squares per fixed chunk of the concatenated gradients, then one block adding the
// chunks in order) and the updates (AdamW, SGD or Lion) over tables of parameter segments, in double
// per element like the interpreter; p and its moments in place.
void cu_emit_optimizer(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  const Group *gr = &e->core.groups[gi];
  ew_opt_open(&e->core, gi);
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = ec_node(&e->core, gr->mem[i]);
    if (nd->op != OP_GRAD_NORM)
      continue;
    int gn = gr->mem[i];
    if (ec_offset(&e->core, gn) < 0)
      e->core.scratch[gn] = true;
    int (*nodes)[5] = ec_xcalloc((size_t)nd->nin, sizeof *nodes);
    int64_t *n = ec_xcalloc((size_t)nd->nin, sizeof *n), total = 0;
    double *wd = ec_xcalloc((size_t)nd->nin, sizeof *wd);
    for (int k = 0; k < nd->nin; k++) {
      nodes[k][0] = ec_need(&e->core, nd->in[k]);
      nodes[k][1] = nodes[k][2] = nodes[k][3] = nodes[k][4] = -1;
      n[k] = ec_numel(&e->core, nd->in[k]);
      total += n[k];
    }
    int64_t nb = (total + OPT_CHUNK - 1) / OPT_CHUNK, part = cu_scratch_alloc(e, nb * 8);
    cu_kbegin(e, "sumsq");
    cu_note(e, "gradient norm: sums of squares of %d tensors, %lld values, in %lld chunks of %d", nd->nin,
            (long long)total, (long long)nb, OPT_CHUNK);
    seg_table(e, ec_str(&e->core, "%s_grads", e->sname), nd->nin, (const int(*)[5])nodes, n, wd, wd);
    const char *pp = cu_raw_ptr(e, part, "double", "sums of squares per chunk");
    ec_line(&e->core, "mdl_opt_sumsq<%d, %lld, %d, %d>(arena, seg, %s, %s); // (segments, values, chunk, loads)",
            nd->nin, (long long)total, OPT_CHUNK, OPT_SUMSQ_LOADS, pp, cu_sh_double(e));
    cu_kend(e, nb, BLOCK);
    cu_kbegin(e, "norm");
    cu_note(e, "gradient norm: the %lld chunks added in order by one block", (long long)nb);
    pp = cu_raw_ptr(e, part, "double", "sums of squares per chunk");
    ec_line(&e->core, "mdl_opt_norm<%lld>(%s, %s, %s);", (long long)nb, pp, cu_ptr(e, gn), cu_sh_double(e));
    cu_kend(e, 1, BLOCK);
    ec_phase_done(&e->core, gn);
    free(nodes);
    free(n);
    free(wd);
  }
  // Updates that share their rule, hyperparameters and scalars run over one table.
  bool *done = ec_xcalloc((size_t)gr->nmem, sizeof *done);
  for (int i = 0, table = 0; i < gr->nmem; i++) {
    const IrNode *a = ec_node(&e->core, gr->mem[i]);
    if (done[i] || a->op != OP_ADAMW)
      continue;
    int *seg = ec_xcalloc((size_t)gr->nmem, sizeof *seg);
    int64_t total;
    int ns = ew_opt_segments(&e->core, gi, i, done, seg, &total);
    int (*nodes)[5] = ec_xcalloc((size_t)ns, sizeof *nodes);
    int ncopies = 0;
    int64_t *n = ec_xcalloc((size_t)ns, sizeof *n);
    double *wd = ec_xcalloc((size_t)ns, sizeof *wd), *ls = ec_xcalloc((size_t)ns, sizeof *ls);
    const int nst = opt_nstate(a), ncol = a->nin - 3; // (Muon: m and the orthogonalised update as v)
    for (int j = 0; j < ns; j++) {
      const IrNode *u = ec_node(&e->core, seg[j]);
      for (int k = 0; k < 4; k++) {
        nodes[j][k] = k < ncol ? ec_canon(&e->core, u->in[k]) : -1;
        if (k < ncol && ec_offset(&e->core, nodes[j][k]) < 0)
          ec_fail(&e->core, "update %d: parameter, gradient or moments not in memory", seg[j]);
      }
      if (ec_offset(&e->core, seg[j]) >= 0 && ec_offset(&e->core, seg[j]) != ec_offset(&e->core, nodes[j][0]))
        ec_fail(&e->core, "adamw %d: the new parameter is not written in place", seg[j]);
      nodes[j][4] = e->core.f->copy_of[nodes[j][0]];
      ncopies += nodes[j][4] >= 0;
      n[j] = ec_numel(&e->core, seg[j]);
      wd[j] = u->fa[3];
      ls[j] = opt_lr_scale(u);
    }
    const OptRule rule = (OptRule)a->ia[0];
    int gnorm = ec_need(&e->core, opt_gnorm(a)), lr = ec_need(&e->core, opt_lr(a)), step = ec_need(&e->core, opt_step(a));
    cu_kbegin(e, table ? ec_str(&e->core, "%d", table + 1) : "");
    const char *hyper = ew_opt_hyper(&e->core, a);
    cu_note(e, "%s over %d parameters, %lld values (%s, clip %g), chunks of %d%s",
            rule == OPT_SGD ? "SGD" : rule == OPT_LION ? "Lion" : rule == OPT_MUON ? "Muon" : "AdamW", ns,
            (long long)total, hyper, a->fa[4], OPT_CHUNK, ncopies ? ec_str(&e->core, "; %d bf16 copies", ncopies) : "");
    seg_table(e, ec_str(&e->core, "%s_seg%s", e->sname, table ? ec_str(&e->core, "%d", table + 1) : ""), ns,
              (const int(*)[5])nodes, n, wd, ls);
    ec_line(&e->core, "const double clip = %s, gnorm = %s[0];", ec_dlit(&e->core, a->fa[4]), cu_ptr(e, gnorm));
    // A non-finite loss or gradient norm leaves p, m and v as they were, as the C back end does: the
    // runtime reads the same two values after the step and stops or skips it (train.c).
    int loss = e->core.f->g->loss >= 0 ? ec_need(&e->core, e->core.f->g->loss) : -1;
    ec_line(&e->core, "if (!isfinite(gnorm)%s)",
            loss >= 0 ? ec_str(&e->core, " || !isfinite(%s[0])", cu_ptr(e, loss)) : "");
    ec_line(&e->core, "  return;");
    ec_line(&e->core, "const double sc = clip > 0 ? fmin(1.0, clip / (gnorm + 1e-6)) : 1.0;");
    ec_line(&e->core, "const double beta1 = %s, beta2 = %s, eps = %s;", ec_dlit(&e->core, a->fa[0]),
            ec_dlit(&e->core, a->fa[1]), ec_dlit(&e->core, a->fa[2]));
    if (rule == OPT_ADAMW) {
      ec_line(&e->core, "const double lr = %s[0], step = %s[0];", cu_ptr(e, lr), cu_ptr(e, step));
      ec_line(&e->core, "const MdlAdamW h = {sc, lr, beta1, beta2, eps, 1.0 / (1.0 - pow(beta1, step)), "
              "1.0 / (1.0 - pow(beta2, step))};");
    } else { // (no bias corrections: the step is not read)
      ec_line(&e->core, "const double lr = %s[0];", cu_ptr(e, lr));
      ec_line(&e->core, "const MdlAdamW h = {sc, lr, beta1, beta2, eps, 1.0, 1.0};");
    }
    ec_line(&e->core, "mdl_opt_update<%d, %d, %d, %lld, %d, %d, %s>(arena, seg, h); // (rule, moments, segments, "
            "values, chunk, unrolled, bf16 copies)", (int)rule, nst, ns, (long long)total, OPT_CHUNK, OPT_UNROLL,
            ncopies ? "true" : "false");
    cu_kend(e, (total + OPT_CHUNK - 1) / OPT_CHUNK, BLOCK);
    for (int j = 0; j < ns; j++)
      ec_phase_done(&e->core, seg[j]);
    free(seg);
    free(nodes);
    free(n);
    free(wd);
    free(ls);
    table++;
  }
  free(done);
  ec_phase_end(&e->core);
}
