// arena.c: memory. A bump allocator (a compilation allocates from one arena and frees it whole), and
// the checked allocations everything else uses: where memory is gone, one "out of memory" error
// naming what was being allocated, and an exit that needs no more of it.
#include "mdl.h"

#include <execinfo.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct Chunk {
  struct Chunk *next;
  size_t used, size;
  max_align_t data[];
} Chunk;

struct Arena {
  Chunk *head;
};

// The streams are flushed (what was printed or logged stays whole), then _exit: exit's handlers
// would run the libraries' destructors (libstdc++'s, loaded with oneDNN), which allocate
// thread-local storage and end the process with the loader's own "cannot allocate" message.
void oom_exit(const char *what, size_t bytes) {
  fprintf(stderr, "mdlc: error: out of memory allocating %s (%zu bytes)\n", what, bytes);
  fflush(NULL);
  _exit(1);
}

// glibc loads libgcc_s (its unwinder) the first time a thread ends with pthread_exit or is
// cancelled, as OpenMP's pool does with its threads; with memory gone that load fails and glibc
// aborts with "libgcc_s.so.1 must be installed for pthread_exit to work". One backtrace at start
// loads it for the whole process, while memory is there.
__attribute__((constructor)) static void load_unwinder(void) {
  void *frame[1];
  backtrace(frame, 1);
}

void *xmalloc(size_t n, const char *what) {
  void *p = malloc(n ? n : 1);
  if (!p)
    oom_exit(what, n);
  return p;
}

void *xcalloc(size_t n, size_t size, const char *what) {
  void *p = calloc(n ? n : 1, size ? size : 1);
  if (!p)
    oom_exit(what, n * size);
  return p;
}

void *xrealloc(void *p, size_t n, const char *what) {
  void *q = realloc(p, n ? n : 1);
  if (!q)
    oom_exit(what, n);
  return q;
}

char *xstrdup(const char *s, const char *what) {
  return xstrndup(s, strlen(s), what);
}

char *xstrndup(const char *s, size_t n, const char *what) {
  n = strnlen(s, n);
  char *d = xmalloc(n + 1, what);
  memcpy(d, s, n);
  d[n] = 0;
  return d;
}

Arena *arena_new(void) {
  Arena *a = xmalloc(sizeof *a, "a compilation's arena");
  a->head = NULL;
  return a;
}

void arena_free(Arena *a) {
  if (!a)
    return;
  for (Chunk *c = a->head, *next; c; c = next) {
    next = c->next;
    free(c);
  }
  free(a);
}

void *arena_alloc(Arena *a, size_t size) {
  size = (size + 15) & ~(size_t)15;
  Chunk *c = a->head;
  if (!c || c->size - c->used < size) {
    size_t cap = size > (1u << 20) ? size : (1u << 20);
    c = xmalloc(sizeof(Chunk) + cap, "a compilation's arena");
    c->size = cap;
    c->used = 0;
    c->next = a->head;
    a->head = c;
  }
  void *p = (char *)c->data + c->used;
  c->used += size;
  memset(p, 0, size);
  return p;
}

char *arena_strdup(Arena *a, const char *s) {
  size_t n = strlen(s) + 1;
  return memcpy(arena_alloc(a, n), s, n);
}

char *arena_printf(Arena *a, const char *fmt, ...) {
  va_list ap, ap2;
  va_start(ap, fmt);
  va_copy(ap2, ap);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  char *s = arena_alloc(a, (size_t)n + 1);
  vsnprintf(s, (size_t)n + 1, fmt, ap2);
  va_end(ap2);
  return s;
}
