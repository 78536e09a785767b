// flops.c: model flops per step (for MFU) counted from the forward graph, and the CPU's assumed peak.
#include "runtime.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

double rt_step_flops(const Graph *g) {
  int end = g->fwd_end ? g->fwd_end : g->n;
  double fwd = 0;
  for (int i = 0; i < end; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op == OP_MATMUL) {
      const IrNode *a = g->nodes[n->in[0]];
      int64_t k = n->ia[0] ? a->shape.d[a->shape.rank - 2] : a->shape.d[a->shape.rank - 1];
      fwd += 2.0 * (double)shape_numel(n->shape) * (double)k;
    } else if (n->op == OP_ATTENTION) {
      // q.k and p.v: 2 x (B x T x T x C) multiply-adds, half of it masked when causal
      Shape q = n->shape;
      double f = 4.0 * (double)q.d[0] * (double)q.d[1] * (double)q.d[1] * (double)q.d[2];
      fwd += n->ia[1] ? f / 2 : f;
    }
  }
  return 3.0 * fwd;
}

double rt_cpu_peak_flops(bool amx_bf16, const char **how) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  double ghz = 0;
  int flops = 32; // AVX2 fp32: two 8-lane FMAs a cycle
  FILE *f = fopen("/proc/cpuinfo", "r");
  char line[4096];
  while (f && fgets(line, sizeof line, f)) {
    if (!ghz && !strncmp(line, "cpu MHz", 7) && strchr(line, ':'))
      ghz = atof(strchr(line, ':') + 1) / 1000.0;
    if (!strncmp(line, "flags", 5) && strstr(line, " avx512f"))
      flops = 64;
  }
  if (f)
    fclose(f);
  if (ghz <= 0)
    ghz = 2.5;
  static char buf[200];
  if (amx_bf16) // AMX: a 16x32 by 32x16 bf16 tile product (512 multiply-adds) a cycle
    flops = 1024;
  snprintf(buf, sizeof buf, "CPU peak %.0f GFLOP/s %s assumed (%ld cores x %.2f GHz x %d flops/cycle)",
           cores * ghz * flops, amx_bf16 ? "bf16 on AMX" : "fp32", cores, ghz, flops);
  *how = buf;
  return (double)cores * ghz * 1e9 * flops;
}
