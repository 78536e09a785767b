// failalloc.c: an LD_PRELOAD allocator that fails, for tests/cli/alloc.sh. It counts the allocations
// mdlc's own code asks for (malloc, calloc, realloc, aligned allocations, strdup, asprintf,
// open_memstream, getline, realpath: those whose caller lies in the main program) and, from the
// FAILALLOC_AT-th on, fails every allocation of the process, whoever asks: the memory is gone.
// FAILALLOC_AT unset or 0 fails nothing; FAILALLOC_COUNT names a file that receives the number of
// counted calls at exit. The variables and LD_PRELOAD are removed from the environment at start, so
// the programs mdlc runs (the C compiler) allocate normally. (Built with -D_GNU_SOURCE.)
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

static uintptr_t text_lo, text_hi; // the main program's loaded range
static long fail_at;
static atomic_long calls;
static atomic_bool failing;
static char count_path[4096];

static int find_main(struct dl_phdr_info *info, size_t size, void *data) {
  (void)size, (void)data;
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    if (ph->p_type != PT_LOAD)
      continue;
    uintptr_t a = info->dlpi_addr + ph->p_vaddr;
    if (a < lo)
      lo = a;
    if (a + ph->p_memsz > hi)
      hi = a + ph->p_memsz;
  }
  text_lo = lo, text_hi = hi;
  return 1; // the first object is the main program
}

static void write_count(void) {
  if (!count_path[0])
    return;
  int fd = open(count_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    return;
  char buf[32];
  int n = snprintf(buf, sizeof buf, "%ld\n", atomic_load(&calls));
  if (write(fd, buf, (size_t)n) < 0)
    n = 0;
  close(fd);
}

__attribute__((constructor)) static void init(void) {
  dl_iterate_phdr(find_main, NULL);
  const char *at = getenv("FAILALLOC_AT"), *count = getenv("FAILALLOC_COUNT");
  fail_at = at ? atol(at) : 0;
  if (count && strlen(count) < sizeof count_path) {
    strcpy(count_path, count);
    atexit(write_count);
  }
  unsetenv("FAILALLOC_AT");
  unsetenv("FAILALLOC_COUNT");
  unsetenv("LD_PRELOAD");
}

// Whether this allocation fails: counts it when the caller is the main program.
static int fails(void *caller) {
  if (atomic_load(&failing))
    return 1;
  uintptr_t a = (uintptr_t)caller;
  if (a < text_lo || a >= text_hi)
    return 0;
  long n = atomic_fetch_add(&calls, 1) + 1;
  if (fail_at > 0 && n >= fail_at) {
    atomic_store(&failing, 1);
    return 1;
  }
  return 0;
}

#define FAIL_IF(ret)                                                                               \
  do {                                                                                             \
    if (fails(__builtin_return_address(0))) {                                                      \
      errno = ENOMEM;                                                                              \
      return ret;                                                                                  \
    }                                                                                              \
  } while (0)

void *malloc(size_t n) {
  FAIL_IF(NULL);
  return __libc_malloc(n);
}

void *calloc(size_t n, size_t size) {
  FAIL_IF(NULL);
  return __libc_calloc(n, size);
}

void *realloc(void *p, size_t n) {
  if (p && n == 0)
    return __libc_realloc(p, n);
  FAIL_IF(NULL);
  return __libc_realloc(p, n);
}

void *memalign(size_t align, size_t n) {
  FAIL_IF(NULL);
  return __libc_memalign(align, n);
}

void *aligned_alloc(size_t align, size_t n) {
  FAIL_IF(NULL);
  return __libc_memalign(align, n);
}

int posix_memalign(void **p, size_t align, size_t n) {
  if (fails(__builtin_return_address(0)))
    return ENOMEM;
  void *q = __libc_memalign(align, n);
  if (!q)
    return ENOMEM;
  *p = q;
  return 0;
}

// The functions that allocate inside the C library: counted here, where their caller is known.
#define REAL(name) ((__typeof__(name) *)dlsym(RTLD_NEXT, #name))

char *strdup(const char *s) {
  FAIL_IF(NULL);
  size_t n = strlen(s) + 1;
  char *d = __libc_malloc(n);
  return d ? memcpy(d, s, n) : NULL;
}

char *strndup(const char *s, size_t max) {
  FAIL_IF(NULL);
  size_t n = strnlen(s, max);
  char *d = __libc_malloc(n + 1);
  if (!d)
    return NULL;
  memcpy(d, s, n);
  d[n] = 0;
  return d;
}

int vasprintf(char **out, const char *fmt, va_list ap) {
  FAIL_IF(-1);
  return REAL(vasprintf)(out, fmt, ap);
}

int asprintf(char **out, const char *fmt, ...) {
  FAIL_IF(-1);
  va_list ap;
  va_start(ap, fmt);
  int n = REAL(vasprintf)(out, fmt, ap);
  va_end(ap);
  return n;
}

FILE *open_memstream(char **p, size_t *n) {
  FAIL_IF(NULL);
  return REAL(open_memstream)(p, n);
}

// (getline allocates for sure only when it is given no buffer)
ssize_t getdelim(char **line, size_t *n, int delim, FILE *f) {
  if (!*line)
    FAIL_IF(-1);
  return REAL(getdelim)(line, n, delim, f);
}

ssize_t getline(char **line, size_t *n, FILE *f) {
  if (!*line)
    FAIL_IF(-1);
  return REAL(getdelim)(line, n, '\n', f);
}

char *realpath(const char *path, char *resolved) {
  if (!resolved)
    FAIL_IF(NULL);
  return REAL(realpath)(path, resolved);
}
