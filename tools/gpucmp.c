// gpucmp: the helper of tools/gpu-check.sh, against libmdl. `gpucmp batch FILE B T V SEED` writes a
// batch of random tokens (two documents per row, one target ignored); `gpucmp compare GPU CPU TOL`
// compares two `mdlc grad` outputs tensor by tensor: ||gpu - cpu|| / ||cpu|| (L2) per tensor against TOL,
// with max |gpu - cpu| / max |cpu| printed beside it; exit status 0 when every tensor is within TOL.
#include "mdl.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static int batch(const char *path, int B, int T, int V, unsigned seed) {
  int32_t *d = malloc(sizeof(int32_t) * 4 * (size_t)(B * T));
  int32_t *tok = d, *tgt = d + B * T, *pos = d + 2 * B * T, *doc = d + 3 * B * T;
  for (int i = 0; i < B * T; i++) {
    int t = i % T, half = T / 2;
    tok[i] = (int)(mdl_rng_u64(seed, 1, (uint64_t)i) % (uint64_t)V);
    tgt[i] = i == T - 1 ? -1 : (int)(mdl_rng_u64(seed, 2, (uint64_t)i) % (uint64_t)V);
    doc[i] = t >= half;
    pos[i] = t >= half ? t - half : t;
  }
  Shape s = shape_of(2, (int64_t[]){B, T});
  StTensor ts[] = {{"tokens", DT_I32, s, tok}, {"targets", DT_I32, s, tgt}, {"pos", DT_I32, s, pos},
                   {"doc", DT_I32, s, doc}};
  int ok = st_write(path, ts, 4);
  free(d);
  return ok ? 0 : 1;
}

static int compare(const char *gpu, const char *cpu, double tol) {
  Arena *a = arena_new();
  StFile g, c;
  if (!st_read(a, gpu, &g) || !st_read(a, cpu, &c)) {
    arena_free(a);
    return 1;
  }
  int bad = 0;
  double worst = 0;
  for (int i = 0; i < c.n; i++) {
    const StTensor *r = &c.t[i], *x = st_find(&g, r->name);
    int64_t n = shape_numel(r->shape);
    if (!x || shape_numel(x->shape) != n) {
      printf("  %-28s missing or of another shape on the GPU\n", r->name);
      bad++;
      continue;
    }
    double diff = 0, ref = 0, d2 = 0, r2 = 0;
    for (int64_t j = 0; j < n; j++) {
      double u = ((const float *)x->data)[j], v = ((const float *)r->data)[j];
      diff = fmax(diff, isnan(u) || isnan(v) ? INFINITY : fabs(u - v));
      ref = fmax(ref, fabs(v));
      d2 += isnan(u) || isnan(v) ? INFINITY : (u - v) * (u - v);
      r2 += v * v;
    }
    double rel = sqrt(d2) / (r2 > 0 ? sqrt(r2) : 1), mrel = diff / (ref > 0 ? ref : 1);
    worst = fmax(worst, rel);
    bad += !(rel <= tol);
    printf("  %-28s L2 rel %.2e  max rel %.2e%s\n", r->name, rel, mrel, rel <= tol ? "" : "  > tolerance");
  }
  printf("  %d tensors, worst L2 rel %.2e, tolerance %.2g: %s\n", c.n, worst, tol, bad ? "FAIL" : "ok");
  arena_free(a);
  return bad ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc == 7 && !strcmp(argv[1], "batch"))
    return batch(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), (unsigned)atoi(argv[6]));
  if (argc == 5 && !strcmp(argv[1], "compare"))
    return compare(argv[2], argv[3], atof(argv[4]));
  fprintf(stderr, "usage: gpucmp batch FILE B T V SEED | compare GPU CPU TOL\n");
  return 2;
}
