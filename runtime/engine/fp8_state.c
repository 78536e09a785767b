// fp8_state.c: delayed scaling (precision fp8), the state a training run keeps and updates beside
// its parameters: per scaled tensor its scale and amax history. The scales of one step come from the
// amaxes of the steps before.
// A power of two makes the scaling exact (x * scale and the GEMM's 1 / (scale_a scale_b) round
// nothing), so every back end computes the same codes from the same inputs; FP8_MARGIN = 1 leaves
// the largest amax of the history at most half the format's largest value, so an amax that doubles
// from one step to the next still does not saturate.
#include "fp8_state.h"

#include <stdlib.h>
#include <string.h>

void fp8_state_init(Fp8State *st, const Graph *g) {
  int64_t H = g->train.amax_history > 0 ? g->train.amax_history : 16;
  *st = (Fp8State){.n = g->nfp8, .H = (int)H};
  size_t n = (size_t)(g->nfp8 ? g->nfp8 : 1);
  st->scale = xmalloc(n * sizeof(float), "the fp8 scaling state");
  st->hist = xcalloc(n * (size_t)H, sizeof(float), "the fp8 scaling state");
  st->amax = xcalloc(n, sizeof(float), "the fp8 scaling state");
  for (int i = 0; i < g->nfp8; i++)
    st->scale[i] = 1;
}

void fp8_state_free(Fp8State *st) {
  free(st->scale);
  free(st->hist);
  free(st->amax);
  *st = (Fp8State){0};
}

double fp8_max(DType fmt) { return fmt == DT_F8E5M2 ? 57344 : 448; }

float fp8_scale(DType fmt, double amax, bool *low) {
  double max = fp8_max(fmt);
  *low = false;
  if (!(amax > 0))
    return ldexpf(1, FP8_MAX_EXP);
  // the largest e with amax 2^e <= max, found exactly on powers of two
  int e = ilogb(max) - ilogb(amax);
  while (ldexp(amax, e) > max)
    e--;
  while (ldexp(amax, e + 1) <= max)
    e++;
  e -= FP8_MARGIN;
  if (e < -FP8_MAX_EXP)
    *low = true, e = -FP8_MAX_EXP;
  return ldexpf(1, e > FP8_MAX_EXP ? FP8_MAX_EXP : e);
}

bool fp8_state_check(const Fp8State *st, const Graph *g, char *why, size_t n) {
  for (int i = 0; i < st->n; i++) {
    const Fp8Tensor *t = &g->fp8[i];
    bool low = false;
    if (isfinite(st->amax[i]))
      fp8_scale(t->fmt, st->amax[i], &low);
    if (!isfinite(st->amax[i]) || low) {
      snprintf(why, n, "the fp8 amax of %s (line %d, %s) is %g%s", t->name, t->loc.line, dtype_name(t->fmt),
               (double)st->amax[i], low ? ", beyond what a scale of 2^-63 brings into range" : "");
      return true;
    }
  }
  return false;
}

bool fp8_state_update(Fp8State *st, const Graph *g, char *why, size_t n) {
  if (fp8_state_check(st, g, why, n))
    return false;
  for (int i = 0; i < st->n; i++) {
    float *h = st->hist + (size_t)i * (size_t)st->H, peak = st->amax[i];
    memmove(h + 1, h, sizeof(float) * (size_t)(st->H - 1));
    h[0] = st->amax[i];
    for (int j = 1; j < st->H; j++)
      peak = h[j] > peak ? h[j] : peak;
    bool low;
    st->scale[i] = fp8_scale(g->fp8[i].fmt, peak, &low);
  }
  st->recorded += st->recorded < st->H;
  return true;
}
