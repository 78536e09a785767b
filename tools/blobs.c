// blobs.c: a synthetic classification set for models/mlp.mdl, as numpy arrays: K = 4 classes, each
// a Gaussian blob (standard deviation 1.2) around a centre drawn from N(0, 1) in N = 16 dims, the
// same centres for every split (from the seed). Writes DIR/x.npy (f32 [n, 16]) and
// DIR/targets.npy (i32 [n]) for training, DIR/val/x.npy and DIR/val/targets.npy (n / 5 examples)
// held out. A model that only guesses scores 25%; the classes' overlap caps accuracy near 92%.
//   usage: blobs DIR [EXAMPLES [SEED]]   (default 4000 examples, seed 1)
#include "data.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { N = 16, K = 4 };

static double gauss(uint64_t seed, uint64_t stream, uint64_t i) { // Box-Muller
  double u = (double)(mdl_rng_u64(seed, stream, 2 * i) >> 11) * 0x1.0p-53,
         v = (double)(mdl_rng_u64(seed, stream, 2 * i + 1) >> 11) * 0x1.0p-53;
  return sqrt(-2 * log(1 - u)) * cos(2 * M_PI * v);
}

static bool write_split(const char *dir, int64_t n, uint64_t seed, uint64_t stream, const float *centre) {
  if (mkdir(dir, 0777) && errno != EEXIST) {
    fprintf(stderr, "%s: error: cannot create the directory: %s\n", dir, strerror(errno));
    return false;
  }
  float *x = malloc(sizeof(float) * (size_t)(n * N));
  int32_t *y = malloc(sizeof(int32_t) * (size_t)n);
  for (int64_t i = 0; i < n; i++) {
    y[i] = (int32_t)(mdl_rng_u64(seed, stream, (uint64_t)i) % K);
    for (int d = 0; d < N; d++)
      x[i * N + d] = centre[y[i] * N + d] + 1.2f * (float)gauss(seed, stream + 1, (uint64_t)(i * N + d));
  }
  char px[4096], py[4096];
  snprintf(px, sizeof px, "%s/x.npy", dir);
  snprintf(py, sizeof py, "%s/targets.npy", dir);
  bool ok = npy_write(px, AT_F32, (Shape){2, {n, N}}, x) && npy_write(py, AT_I32, (Shape){1, {n}}, y);
  free(x);
  free(y);
  return ok;
}

int main(int argc, char **argv) {
  if (argc < 2 || argc > 4) {
    fprintf(stderr, "usage: blobs DIR [EXAMPLES [SEED]]\n");
    return 2;
  }
  int64_t n = argc > 2 ? strtoll(argv[2], NULL, 10) : 4000;
  uint64_t seed = argc > 3 ? strtoull(argv[3], NULL, 10) : 1;
  if (n < 5) {
    fprintf(stderr, "blobs: want at least 5 examples\n");
    return 2;
  }
  float centre[K * N];
  for (int i = 0; i < K * N; i++)
    centre[i] = (float)gauss(seed, 1, (uint64_t)i);
  char val[4096];
  snprintf(val, sizeof val, "%s/val", argv[1]);
  if (!write_split(argv[1], n, seed, 10, centre) || !write_split(val, n / 5, seed, 20, centre))
    return 1;
  printf("wrote %lld training and %lld validation examples of %d features, %d classes, to %s\n", (long long)n,
         (long long)(n / 5), N, K, argv[1]);
  return 0;
}
