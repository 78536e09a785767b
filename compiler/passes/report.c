// report.c: the fusion report of `mdlc build`: per kernel its name, the .mdl ops fused into it,
// bytes read and written and flops; then the totals with fusion on and with fusion off, so the
// memory traffic that fusion saves can be read off directly.
#include "mdl.h"

static void totals(const Fusion *f, double *flops, double *rd, double *wr) {
  *flops = *rd = *wr = 0;
  for (int s = 0; s < f->nsteps; s++) {
    *flops += f->steps[s].flops;
    *rd += f->steps[s].bytes_read;
    *wr += f->steps[s].bytes_written;
  }
}

void fusion_report(const Fusion *on, const Fusion *off, const MemPlan *mon, const MemPlan *moff, FILE *out) {
  const Graph *g = on->g;
  fprintf(out, "# fusion report: %s\n", g->model ? g->model : "?");
  fprintf(out, "%-4s %-44s %-9s %12s %12s %14s  ops (.mdl line)\n", "#", "kernel", "kind", "read MB", "written MB",
          "MFLOP");
  for (int s = 0; s < on->nsteps; s++) {
    const Step *st = &on->steps[s];
    fprintf(out, "%-4d %-44s %-9s %12.3f %12.3f %14.3f ", s, st->name, step_kind_name(st->kind), st->bytes_read / 1e6,
            st->bytes_written / 1e6, st->flops / 1e6);
    int shown = 0;
    for (int i = 0; i < st->nnodes; i++) {
      const IrNode *n = g->nodes[st->nodes[i]];
      if (n->op == OP_RESHAPE)
        continue;
      if (shown++ == 12) {
        fprintf(out, " ...");
        break;
      }
      fprintf(out, " %s", op_name(n->op));
      if (n->loc.line > 0)
        fprintf(out, "@%d", n->loc.line);
    }
    fprintf(out, "\n");
  }
  double f1, r1, w1, f0, r0, w0;
  totals(on, &f1, &r1, &w1);
  totals(off, &f0, &r0, &w0);
  fprintf(out, "\n%-12s %8s %12s %12s %12s %16s\n", "", "kernels", "read MB", "written MB", "GFLOP", "activations MB");
  fprintf(out, "%-12s %8d %12.2f %12.2f %12.3f %16.2f\n", "fusion on", on->nsteps, r1 / 1e6, w1 / 1e6, f1 / 1e9,
          (double)mon->activation_bytes / 1e6);
  fprintf(out, "%-12s %8d %12.2f %12.2f %12.3f %16.2f\n", "fusion off", off->nsteps, r0 / 1e6, w0 / 1e6, f0 / 1e9,
          (double)moff->activation_bytes / 1e6);
  if (r1 + w1 > 0)
    fprintf(out, "fusion moves %.2fx less memory in %.2fx fewer kernels\n", (r0 + w0) / (r1 + w1),
            (double)off->nsteps / on->nsteps);
  if (g->ckpt.policy) { // (what the checkpoint pass chose, without a budget that is this machine's memory)
    char line[1024];
    checkpoint_summary(&g->ckpt, true, false, line, sizeof line);
    fprintf(out, "%s\n", line);
  }
}
