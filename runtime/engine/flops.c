// flops.c: model flops per step (for MFU) counted from the forward graph, and the CPU's assumed peak.
#include "runtime.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// The node x is computed from, past CASTs and the MUL by a constant (the scale) that plain attention
// puts between its scores' GEMM and the mask.
static int through_scale(const Graph *g, int x) {
  for (;;) {
    const IrNode *n = g->nodes[x];
    if (n->op == OP_CAST)
      x = n->in[0];
    else if (n->op == OP_MUL && g->nodes[n->in[1]]->op == OP_CONST)
      x = n->in[0];
    else if (n->op == OP_MUL && g->nodes[n->in[0]]->op == OP_CONST)
      x = n->in[1];
    else
      return x;
  }
}

// Attention lowered into GEMMs (LowerOptions.plain_attention) counts as the fused ATTENTION does: a
// MATMUL whose product gets a causal ATTENTION_MASK added (the scores q k^T), and one that reads the
// SOFTMAX of such scores (P v), count half their flops, the half the mask throws away; so MFU means
// the same with either lowering.
double rt_step_flops(const Graph *g) {
  int end = g->fwd_end ? g->fwd_end : g->n;
  // per node: a MATMUL half counted (1), causal scores or P (2)
  char *causal = xcalloc((size_t)end + 1, 1, "the model's flop count");
  for (int i = 0; i < end; i++) {
    const IrNode *n = g->nodes[i];
    for (int k = 0; n->op == OP_ADD && k < 2; k++) {
      const IrNode *m = g->nodes[n->in[k]];
      int s = through_scale(g, n->in[1 - k]);
      if (m->op == OP_ATTENTION_MASK && m->ia[0] && g->nodes[s]->op == OP_MATMUL) {
        causal[s] = 1;
        causal[i] = 2;
      }
    }
    if (n->op == OP_SOFTMAX && causal[n->in[0]] == 2)
      causal[i] = 2;
    if (n->op == OP_MATMUL && causal[through_scale(g, n->in[0])] == 2)
      causal[i] = 1;
  }
  double fwd = 0;
  for (int i = 0; i < end; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op == OP_MATMUL) {
      const IrNode *a = g->nodes[n->in[0]];
      int64_t k = n->ia[0] ? a->shape.d[a->shape.rank - 2] : a->shape.d[a->shape.rank - 1];
      double f = 2.0 * (double)shape_numel(n->shape) * (double)k;
      fwd += causal[i] == 1 ? f / 2 : f;
    } else if (n->op == OP_ATTENTION) {
      // q.k and p.v: 2 x (B x C) multiply-adds per (query, key) pair: T x S, half of it masked when
      // causal, fewer with a window (att_pairs)
      Shape q = n->shape;
      fwd += 4.0 * (double)q.d[0] * (double)q.d[2] *
             att_pairs(q.d[1], g->nodes[n->in[1]]->shape.d[1], n->ia[1], n->ia[6]);
    }
  }
  free(causal);
  return 3.0 * fwd;
}

double rt_cpu_peak_flops(const char *bf16_kernels, const char **how) {
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
  const char *what = "fp32";
  if (bf16_kernels && strstr(bf16_kernels, "amx")) // AMX: a 16x32 by 32x16 bf16 tile product (512 multiply-adds) a cycle
    flops = 1024, what = "bf16 on AMX";
  else if (bf16_kernels && strstr(bf16_kernels, "bf16")) // vdpbf16ps: 16 lanes of 2 bf16 products summed, two a cycle
    flops = 128, what = "bf16 on AVX-512 BF16";
  snprintf(buf, sizeof buf, "CPU peak %.0f GFLOP/s %s assumed (%ld cores x %.2f GHz x %d flops/cycle)",
           cores * ghz * flops, what, cores, ghz, flops);
  *how = buf;
  return (double)cores * ghz * 1e9 * flops;
}
