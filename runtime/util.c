// util.c: the small pieces the runtime's files share: error messages into a caller's buffer, a
// monotonic clock, the module cache's folder, and files written atomically.
#include "runtime.h"

#include <errno.h>
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
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
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
