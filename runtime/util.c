// util.c: the small pieces the runtime's files share: error messages into a caller's buffer, a
// monotonic clock, a parallel loop, the module cache's folder, and files written atomically.
#include "rt_util.h"

#include <errno.h>
#include <math.h>
#include <ftw.h>
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

// Where the cache goes when its own folder cannot be used: a folder made once per process under
// $TMPDIR (or /tmp), removed with what it holds when the process exits.
static char fallback[900];
static pthread_mutex_t fallback_lock = PTHREAD_MUTEX_INITIALIZER;

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  remove(path);
  return 0;
}

static void remove_fallback(void) { nftw(fallback, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

// dir made (with its parents), a directory, and one this process may write into; else why not.
static bool usable_dir(const char *dir, char *why, size_t n) {
  struct stat st;
  if (!mkdirs(dir))
    return rt_fail(why, n, "%s", strerror(errno));
  if (stat(dir, &st) || !S_ISDIR(st.st_mode))
    return rt_fail(why, n, "not a directory");
  if (access(dir, W_OK | X_OK))
    return rt_fail(why, n, "%s", strerror(errno));
  return true;
}

bool rt_cache_dir(const char *sub, char *dir, size_t n, char *err, size_t errn) {
  const char *env = getenv("MDL_CACHE"), *home = getenv("HOME");
  char root[900] = "", why[300] = "neither MDL_CACHE nor HOME is set";
  if (env && *env)
    snprintf(root, sizeof root, "%s", env);
  else if (home && *home)
    snprintf(root, sizeof root, "%s/.cache/mdl", home);
  snprintf(dir, n, "%s%s%s", root, *sub ? "/" : "", sub);
  if (*root && usable_dir(dir, why, sizeof why))
    return true;
  pthread_mutex_lock(&fallback_lock);
  bool ok = true;
  if (!*fallback) {
    const char *tmp = getenv("TMPDIR");
    snprintf(fallback, sizeof fallback, "%s/mdl-cache.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(fallback)) {
      atexit(remove_fallback);
      fprintf(stderr, "mdlc: warning: the module cache %s cannot be used (%s); compiling into %s until exit\n",
              *root ? dir : "folder", why, fallback);
    } else {
      ok = rt_fail(err, errn, "no folder for compiled modules: %s: %s; %s: %s", *root ? dir : "the cache", why,
                   fallback, strerror(errno));
      *fallback = 0;
    }
  }
  if (ok) {
    snprintf(dir, n, "%s%s%s", fallback, *sub ? "/" : "", sub);
    ok = usable_dir(dir, why, sizeof why) || rt_fail(err, errn, "%s: %s", dir, why);
  }
  pthread_mutex_unlock(&fallback_lock);
  return ok;
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

int64_t rt_first_nonfinite(const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (!isfinite(x[i]))
      return i;
  return -1;
}

// The first number after `key` in the file at path (a line "key: N kB" of /proc/meminfo, or the
// whole file "N" of a cgroup's memory.max), times `unit`; -1 when there is none ("max": no limit).
static int64_t read_number(const char *path, const char *key, int64_t unit) {
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  char line[256];
  long long v = -1;
  while (v < 0 && fgets(line, sizeof line, f))
    if (!strncmp(line, key, strlen(key)) && sscanf(line + strlen(key), " %lld", &v) != 1)
      v = -1;
  fclose(f);
  return v < 0 ? -1 : (int64_t)v * unit;
}

int64_t rt_host_memory_available(const char **what) {
  int64_t avail = read_number("/proc/meminfo", "MemAvailable:", 1024);
  *what = "MemAvailable in /proc/meminfo";
  // (cgroup v2: the limit of the process's group, where it has one, less what the group uses)
  int64_t max = read_number("/sys/fs/cgroup/memory.max", "", 1), used = read_number("/sys/fs/cgroup/memory.current", "", 1);
  if (max > 0 && used >= 0 && (avail < 0 || max - used < avail)) {
    avail = max > used ? max - used : 0;
    *what = "the cgroup's memory.max less its memory.current";
  }
  return avail;
}

void *rt_xrealloc(void *p, size_t n) {
  return xrealloc(p, n, "the run's tables");
}

static const char b64_digits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *rt_base64(const void *data, size_t n) {
  const unsigned char *p = data;
  char *out = xrealloc(NULL, 4 * ((n + 2) / 3) + 1, "a base64 text"), *o = out;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
    *o++ = b64_digits[v >> 18];
    *o++ = b64_digits[(v >> 12) & 63];
    *o++ = i + 1 < n ? b64_digits[(v >> 6) & 63] : '=';
    *o++ = i + 2 < n ? b64_digits[v & 63] : '=';
  }
  *o = 0;
  return out;
}

unsigned char *rt_unbase64(const char *text, size_t *n) {
  size_t len = strlen(text);
  if (len % 4)
    return NULL;
  unsigned char *out = xrealloc(NULL, len / 4 * 3 + 1, "a base64 text");
  *n = 0;
  for (size_t i = 0; i < len; i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (int k = 0; k < 4; k++) {
      const char *d = text[i + k] ? strchr(b64_digits, text[i + k]) : NULL;
      if (text[i + k] == '=' && i + 4 == len && k >= 2 && (k == 3 || text[i + 3] == '='))
        pad++;
      else if (!d || pad) {
        free(out);
        return NULL;
      }
      v = v << 6 | (d ? (uint32_t)(d - b64_digits) : 0);
    }
    out[(*n)++] = (unsigned char)(v >> 16);
    if (pad < 2)
      out[(*n)++] = (unsigned char)(v >> 8);
    if (pad < 1)
      out[(*n)++] = (unsigned char)v;
  }
  return out;
}
