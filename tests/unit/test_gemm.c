// test_gemm.c: the GEMM library behind the CPU back end (runtime/engine/gemm.c) against a naive loop in
// double, for the transposes, leading dimensions, betas and sizes the emitter uses (odd ones too):
// sgemm, and bgemm where the library has one (its operands bf16 values, so every product is exact
// and only the order of the f32 sums differs). The test runs for the library chosen by default,
// then again in a child process for each library that MDL_GEMM can insist on and this machine has
// (and the plain loops, MDL_GEMM=loops). In each library's child, signals handled while its sgemm
// runs leave the heap whole (check_signals).
#include "backend.h"
#include "test.h"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

// Random values in [-1, 1) rounded to bf16 (cpu_bf16_from_f32, as the kernels round): x holds them
// widened back to f32, x16 as bf16.
static void bf16_values(float *x, uint16_t *x16, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    x[i] = (float)rand() / RAND_MAX * 2.0f - 1.0f;
  cpu_bf16_from_f32(x, x16, n);
  for (int64_t i = 0; i < n; i++) {
    uint32_t u = (uint32_t)x16[i] << 16;
    memcpy(&x[i], &u, 4);
  }
}

// One case: C (m x n, leading dimension ldc, prefilled) = op(A) op(B) + beta C, by the library and by
// the loop; the largest error relative to the sum of |products| of its element.
static double one_case(const GemmLib *lib, bool bf16, int ta, int tb, int64_t m, int64_t n, int64_t k, int64_t pad,
                       float beta) {
  int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
  int64_t lda = ac + pad, ldb = bc + pad, ldc = n + pad;
  float *a = malloc(sizeof(float) * (size_t)(ar * lda)), *b = malloc(sizeof(float) * (size_t)(br * ldb));
  float *c = malloc(sizeof(float) * (size_t)(m * ldc));
  uint16_t *a16 = malloc(2 * (size_t)(ar * lda)), *b16 = malloc(2 * (size_t)(br * ldb));
  double *want = malloc(sizeof(double) * (size_t)(m * n)), *mag = malloc(sizeof(double) * (size_t)(m * n));
  srand(7);
  bf16_values(a, a16, ar * lda);
  bf16_values(b, b16, br * ldb);
  for (int64_t i = 0; i < m * ldc; i++)
    c[i] = (float)(i % 7) - 3.0f;
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = beta * (double)c[i * ldc + j], g = fabs(s);
      for (int64_t p = 0; p < k; p++) {
        double x = (ta ? a[p * lda + i] : a[i * lda + p]) * (double)(tb ? b[j * ldb + p] : b[p * ldb + j]);
        s += x;
        g += fabs(x);
      }
      want[i * n + j] = s;
      mag[i * n + j] = g;
    }
  if (bf16)
    lib->bgemm(ta, tb, m, n, k, a16, lda, b16, ldb, beta, c, ldc);
  else
    lib->sgemm(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
  double worst = 0;
  for (int64_t i = 0; i < m; i++) {
    for (int64_t j = 0; j < n; j++) {
      double e = fabs(c[i * ldc + j] - want[i * n + j]) / (mag[i * n + j] + 1e-30);
      worst = e > worst || isnan(e) ? e : worst;
    }
    for (int64_t j = n; j < ldc; j++) // the padding past n is left alone
      if (c[i * ldc + j] != (float)((i * ldc + j) % 7) - 3.0f)
        worst = INFINITY;
  }
  free(a), free(b), free(c), free(a16), free(b16), free(want), free(mag);
  return worst;
}

static void check_library(const GemmLib *lib) {
  static const int64_t sizes[][3] = {{1, 1, 1}, {17, 33, 5}, {64, 200, 129}, {300, 70, 513}, {128, 768, 64},
                                     {5, 1000, 3}, {513, 17, 256}};
  for (int bf16 = 0; bf16 < 2; bf16++) {
    if (bf16 && !lib->bgemm)
      continue;
    double worst = 0;
    char where[160] = "";
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
      for (int t = 0; t < 4; t++)
        for (int pad = 0; pad < 2; pad++)
          for (int be = 0; be < 2; be++) {
            double e = one_case(lib, bf16, t & 1, t >> 1, sizes[s][0], sizes[s][1], sizes[s][2], pad * 3, (float)be);
            if (e > worst || isnan(e)) {
              worst = e;
              snprintf(where, sizeof where, "ta %d tb %d m %lld n %lld k %lld pad %d beta %d", t & 1, t >> 1,
                       (long long)sizes[s][0], (long long)sizes[s][1], (long long)sizes[s][2], pad * 3, be);
            }
          }
    char name[400];
    snprintf(name, sizeof name, "gemm %s (%s): %s equals a loop in double for 7 sizes, both transposes, padded rows "
             "and beta 0 and 1", lib->name, lib->kernels, bf16 ? "bgemm" : "sgemm");
    CHECK(worst < 1e-6, name, "worst relative error %.3g at %s", worst, where);
  }
}

// Signals while the library runs: a thread computes 3000 products of 64 x 64 x 512 (a k over 84 is
// where oneDNN's f32 kernels point the stack into a heap workspace, gemm.c's "Signals"), allocating
// between them, while another signals it every 20 us; the handler is installed as the runtime
// installs its own (SA_ONSTACK, train.c's stop handler). Each frame written where the stack pointer
// was would land in the heap, which glibc's checks then abort on ("corrupted size vs. prev_size"):
// the thread must finish, in a child process so that an abort is a failed check.
static volatile sig_atomic_t handled;
static void on_signal(int sig) { (void)sig, handled++; }

typedef struct {
  const GemmLib *lib;
  volatile bool done;
} Storm;

static void *products(void *arg) {
  Storm *st = arg;
  enum { M = 64, N = 64, K = 512 };
  float *a = calloc(M * K + K * N + M * N, sizeof *a);
  for (int i = 0; a && i < M * K + K * N; i++)
    a[i] = (float)(i % 5) - 2.0f;
  for (int it = 0; a && it < 3000; it++) {
    st->lib->sgemm(0, 0, M, N, K, a, K, a + M * K, N, 0.0f, a + M * K + K * N, N);
    free(malloc(64 + (size_t)(it % 97) * 16));
  }
  free(a);
  st->done = true;
  return NULL;
}

static void check_signals(const GemmLib *lib) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    struct sigaction sa = {.sa_handler = on_signal, .sa_flags = SA_RESTART | SA_ONSTACK};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
    Storm st = {.lib = lib};
    pthread_t th;
    if (pthread_create(&th, NULL, products, &st))
      _exit(2);
    while (!st.done) {
      pthread_kill(th, SIGUSR1);
      usleep(20);
    }
    pthread_join(th, NULL);
    _exit(handled > 0 ? 0 : 3);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  char name[400];
  snprintf(name, sizeof name, "gemm %s (%s): signals handled while sgemm runs (3000 products, k = 512) leave the "
           "heap whole", lib->name, lib->kernels);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, name, "%s %d%s", WIFEXITED(status) ? "exit status" : "signal",
        WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
        WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT ? " (glibc found the heap damaged)" : "");
}

int main(int argc, char **argv) {
  char err[256];
  const GemmLib *lib = rt_gemm(err, sizeof err);
  if (argc > 1 && !strcmp(argv[1], "mkl")) { // a child with MDL_GEMM=mkl
    CHECK(!lib && strstr(err, "MDL_GEMM=mkl: want onednn, openblas or loops"), "gemm: MDL_GEMM=mkl is refused, naming the choices",
          "%s", lib ? lib->name : err);
    TEST_EXIT();
  }
  if (argc > 1 && !lib && strstr(err, "is not installed")) {
    printf("[skip] gemm: MDL_GEMM=%s: %s\n", argv[1], err);
    TEST_EXIT();
  }
  CHECK(lib != NULL, "gemm: a GEMM library loads", "%s", err);
  if (!lib)
    TEST_EXIT();
  check_library(lib);
  if (argc > 1 && !strcmp(argv[1], "loops"))
    printf("[skip] gemm %s: signals while a library runs: no library\n", lib->name);
  else if (argc > 1)
    check_signals(lib);
  if (argc > 1) // a child for one library
    TEST_EXIT();
  CHECK(!lib->generic, "gemm: the library runs kernels for this CPU, not a generic fallback", "%s runs %s", lib->name,
        lib->kernels);
  // each library MDL_GEMM names, in a process of its own (the choice is made once per process)
  const char *libs[] = {"onednn", "openblas", "loops", "mkl"};
  for (int i = 0; i < 4; i++) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      setenv("MDL_GEMM", libs[i], 1);
      execl("/proc/self/exe", argv[0], libs[i], (char *)NULL);
      _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    char name[120];
    snprintf(name, sizeof name, "gemm: the child with MDL_GEMM=%s ran its checks", libs[i]);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, name, "exit status %d", WEXITSTATUS(status));
  }
  TEST_EXIT();
}
