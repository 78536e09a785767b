// stream.c: this machine's memory bandwidth, STREAM-like, for the kernels that should run at it
// (AdamW, the embedding backward): copy (a = b), scale-add (a = b + s c) and the AdamW update's own
// pattern (read p, g, m, v; write p, m, v), over arrays far larger than the caches, on every core
// (OpenMP), best of 5. Prints GB/s counting the bytes each loop must move.
//   cc -O3 -march=native -fopenmp bench/stream.c -o stream && ./stream [MB per array, default 256]
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

static double best_of(double *t, int n) {
  double b = t[0];
  for (int i = 1; i < n; i++)
    b = t[i] < b ? t[i] : b;
  return b;
}

int main(int argc, char **argv) {
  long n = (argc > 1 ? atol(argv[1]) : 256) * (1L << 20) / 4;
  float *a = malloc(4 * n), *b = malloc(4 * n), *c = malloc(4 * n), *d = malloc(4 * n);
  if (!a || !b || !c || !d)
    return 1;
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; i++)
    a[i] = 1, b[i] = 2, c[i] = 3, d[i] = 4;
  double t[3][5];
  for (int r = 0; r < 5; r++) {
    double t0 = omp_get_wtime();
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i++)
      a[i] = b[i];
    double t1 = omp_get_wtime();
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i++)
      a[i] = b[i] + 0.5f * c[i];
    double t2 = omp_get_wtime();
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i++) { // p -= lr (m / (sqrt(v) + eps)), the moments updated from g
      const float g = d[i];
      b[i] = 0.9f * b[i] + 0.1f * g;
      c[i] = 0.95f * c[i] + 0.05f * g * g;
      a[i] -= 1e-3f * (b[i] / (sqrtf(c[i]) + 1e-8f));
    }
    double t3 = omp_get_wtime();
    t[0][r] = t1 - t0, t[1][r] = t2 - t1, t[2][r] = t3 - t2;
  }
  printf("%d threads, %ld MB arrays: copy %.1f GB/s, scale-add %.1f GB/s, AdamW pattern %.1f GB/s (checksum %g)\n",
         omp_get_max_threads(), n * 4 >> 20, 8.0 * n / best_of(t[0], 5) / 1e9, 12.0 * n / best_of(t[1], 5) / 1e9,
         28.0 * n / best_of(t[2], 5) / 1e9, (double)a[n / 2]);
  free(a), free(b), free(c), free(d);
  return 0;
}
