// rt_util.h: the small pieces every part of the runtime shares (util.c): error messages into a
// caller's buffer, a monotonic clock, a parallel loop, the module cache's folder, files written
// atomically, base64. The data code needs these and nothing of the training header (runtime.h).
#ifndef MDL_RT_UTIL_H
#define MDL_RT_UTIL_H
#include "mdl.h"

// Formats a message into err (when err is not NULL) and returns false.
bool rt_fail(char *err, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
double rt_now(void); // seconds, monotonic
// fn(ctx, lo, hi) over [0, n) in contiguous ranges, on up to one thread per online CPU (a range at
// least `grain` long; the calling thread takes the first); returns when all are done. For work whose
// every element is independent of the others: the result is the same on any number of threads.
void rt_parallel_for(int64_t n, int64_t grain, void (*fn)(void *ctx, int64_t lo, int64_t hi), void *ctx);
int rt_input_node(const Graph *g, const char *name); // the INPUT node of that name, or -1
// The compiled-module cache, $MDL_CACHE or ~/.cache/mdl, with `sub` appended ("" for none), created.
// Where that cannot be made or written into, one warning, and a folder of this process's own under
// $TMPDIR (or /tmp), removed at exit: a read-only home still trains, compiling every time.
bool rt_cache_dir(const char *sub, char *dir, size_t n, char *err, size_t errn);
// xrealloc(p, n, "the run's tables"): for the runtime's own small tables, where nothing sensible is
// left to do without them.
void *rt_xrealloc(void *p, size_t n);
// The index of the first NaN or infinity among x[0..n), or -1 when all are finite.
int64_t rt_first_nonfinite(const float *x, int64_t n);
// Host memory a run can still take, in bytes: /proc/meminfo's MemAvailable, less where a cgroup limit
// (memory.max) leaves less; *what says which; -1 where neither can be read.
int64_t rt_host_memory_available(const char **what);
// Writes path through a temporary file, fsync and rename; a failure leaves path as it was.
bool rt_write_atomic(const char *path, const void *data, size_t size, char *err, size_t n);
// Base64 (RFC 4648, with padding), malloc'd; rt_unbase64 gives NULL for text that is not base64.
char *rt_base64(const void *data, size_t n);
unsigned char *rt_unbase64(const char *text, size_t *n);
#endif
