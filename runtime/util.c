// util.c: the small pieces the runtime's files share: error messages into a caller's buffer, a
// monotonic clock, a parallel loop, the module cache's folder, and files written atomically.
#include "runtime.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

bool rt_fail(char *err, size_t n, const char *fmt, ...) {
  if (err && n) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
  }
  return false;
}

double rt_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

enum { RT_MAX_THREADS = 64 };

typedef struct {
  void (*fn)(void *, int64_t, int64_t);
  void *ctx;
  int64_t lo, hi;
} Range;

static void *run_range(void *p) {
  Range *r = p;
  r->fn(r->ctx, r->lo, r->hi);
  return NULL;
}

void rt_parallel_for(int64_t n, int64_t grain, void (*fn)(void *ctx, int64_t lo, int64_t hi), void *ctx) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int64_t k = grain > 0 ? n / grain : n;
  k = k < cpus ? k : cpus;
  k = k < RT_MAX_THREADS ? k : RT_MAX_THREADS;
  if (k <= 1) {
    if (n > 0)
      fn(ctx, 0, n);
    return;
  }
  Range r[RT_MAX_THREADS];
  pthread_t th[RT_MAX_THREADS];
  bool started[RT_MAX_THREADS] = {false};
  for (int64_t i = 0; i < k; i++)
    r[i] = (Range){fn, ctx, n * i / k, n * (i + 1) / k};
  for (int64_t i = 1; i < k; i++)
    started[i] = pthread_create(&th[i], NULL, run_range, &r[i]) == 0;
  run_range(&r[0]);
  for (int64_t i = 1; i < k; i++) {
    if (started[i])
      pthread_join(th[i], NULL);
    else
      run_range(&r[i]); // (no thread to be had: this one takes the range)
  }
}

// mkdir -p.
static bool mkdirs(const char *path) {
  char buf[1024];
  snprintf(buf, sizeof buf, "%s", path);
  for (char *p = buf + 1; *p; p++)
    if (*p == '/') {
      *p = 0;
      if (mkdir(buf, 0755) && errno != EEXIST)
        return false;
      *p = '/';
    }
  return !mkdir(buf, 0755) || errno == EEXIST;
}

bool rt_cache_dir(const char *sub, char *dir, size_t n, char *err, size_t errn) {
  const char *env = getenv("MDL_CACHE"), *home = getenv("HOME");
  if (env && *env)
    snprintf(dir, n, "%s%s%s", env, *sub ? "/" : "", sub);
  else if (home && *home)
    snprintf(dir, n, "%s/.cache/mdl%s%s", home, *sub ? "/" : "", sub);
  else
    return rt_fail(err, errn, "no cache directory: set MDL_CACHE or HOME");
  if (!mkdirs(dir))
    return rt_fail(err, errn, "%s: %s", dir, strerror(errno));
  return true;
}

bool rt_write_atomic(const char *path, const void *data, size_t size, char *err, size_t n) {
  // (a name of this process and call, so that threads writing one path never share a temporary)
  static unsigned calls;
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%u", path, (long)getpid(), __atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED));
  FILE *f = fopen(tmp, "wb");
  if (!f)
    return rt_fail(err, n, "%s: %s", tmp, strerror(errno));
  bool ok = fwrite(data, 1, size, f) == size;
  ok &= fflush(f) == 0 && fsync(fileno(f)) == 0;
  ok &= fclose(f) == 0;
  if (!ok || rename(tmp, path)) {
    unlink(tmp);
    return rt_fail(err, n, "%s: %s", path, strerror(errno));
  }
  return true;
}

int rt_input_node(const Graph *g, const char *name) {
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_INPUT && g->nodes[i]->name && !strcmp(g->nodes[i]->name, name))
      return i;
  return -1;
}
