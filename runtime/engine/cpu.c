// cpu.c: the compiled CPU back end. It compiles the C that emit_c generates into a shared object,
// caches it on disk, loads it, and runs it on one arena; it also moves data between that arena and
// the rest of the program (initial parameters, the interpreter's values, batches, lr and step).
//
// Cache: the key is a 128-bit FNV-1a hash of (source, compiler flags, MDL_VERSION); the module lives
// in $MDL_CACHE (else ~/.cache/mdl) as <key>.so next to its source <key>.c and the compiler's output
// <key>.log. A compile writes a temporary file and renames it into place, so a concurrent run never
// loads half a module. GEMMs go to the library gemm.c chose through the sgemm and bgemm hooks; errors
// that kernels meet (an id or a target out of range) come back through the error hook and end the
// step with a message.
// One pool of threads runs everything: the module's OpenMP loops, and its GEMMs split by rows over
// the same threads with the library single-threaded inside (two pools, each spinning while the other
// works, made steps several times slower on two cores).
#include "backend.h"
#include "runtime.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

// Not -mprefer-vector-width=512, though it measured 5% (fp32) to 12% (bf16) off a step at L4 C256
// B8 T128: GCC 12.2 then miscompiles a plain f32 -> bf16 rounding loop nest (48 rows of 32, offsets
// read at run time; 1317 of 1536 results wrong, caught by test_cpu's kernel-by-kernel check).
//
// The target is the host's own instruction set (-march=native), or the x86-64 level that MDL_MARCH
// names (x86-64, x86-64-v2, x86-64-v3, x86-64-v4, native): a module built for a machine older than
// this one, and how the tests compile every module for each level the host can run.
static char cc_flags[160];

const char *cpu_cc_flags(void) {
  if (!cc_flags[0]) {
    const char *m = getenv("MDL_MARCH");
    snprintf(cc_flags, sizeof cc_flags, "cc -O3 -march=%s -fno-math-errno -fopenmp -shared -fPIC",
             m && *m ? m : "native");
  }
  return cc_flags;
}

// Whether MDL_MARCH names a target this program knows and this CPU runs, else why not in err.
bool cpu_march_ok(char *err, size_t n) {
  const char *m = getenv("MDL_MARCH");
  if (!m || !*m || !strcmp(m, "native"))
    return true;
  __builtin_cpu_init();
  if (!strcmp(m, "x86-64"))
    return true;
  int runs = !strcmp(m, "x86-64-v2")    ? __builtin_cpu_supports("x86-64-v2")
              : !strcmp(m, "x86-64-v3") ? __builtin_cpu_supports("x86-64-v3")
              : !strcmp(m, "x86-64-v4") ? __builtin_cpu_supports("x86-64-v4")
                                        : -1;
  if (runs < 0)
    return rt_fail(err, n, "MDL_MARCH=%s: want x86-64, x86-64-v2, x86-64-v3, x86-64-v4 or native", m);
  if (!runs)
    return rt_fail(err, n, "MDL_MARCH=%s: this CPU cannot run %s code", m, m);
  return true;
}

// FNV-1a, 128 bits, over several strings (each with its terminating NUL, so ("ab","c") != ("a","bc")).
static void fnv128(const char *const *parts, int n, char hex[33]) {
  const unsigned __int128 prime = ((unsigned __int128)1 << 88) + 0x13B;
  unsigned __int128 h = ((unsigned __int128)0x6c62272e07bb0142ull << 64) | 0x62b821756295c58dull;
  for (int i = 0; i < n; i++)
    for (const unsigned char *p = (const unsigned char *)parts[i];; p++) {
      h = (h ^ *p) * prime;
      if (!*p)
        break;
    }
  snprintf(hex, 33, "%016llx%016llx", (unsigned long long)(h >> 64), (unsigned long long)h);
}

// A compile's stop signals: SIGINT, SIGTERM and SIGHUP are blocked while the compilers run, and one
// that arrives meanwhile (Ctrl-C, or a kill of mdlc alone, which leaves the compilers running) stops
// every compiler started (each leads a process group of its own: the driver and what it runs), then,
// once the temporary files are gone, takes effect as it would have, after a line that says so.
typedef struct {
  sigset_t set;
  int sig;         // the stop signal that arrived, 0 while none has
  pid_t pids[17];  // the compilers under way
  int npids;
} Stops;

static bool compile_blocked(int parts, const char *src, const char *so, const char *log, const sigset_t *mask,
                            Stops *st, char *err, size_t n);

// Runs the compiler on src into so (through a temporary name), its messages into log; a stop signal
// meanwhile ends it (Stops) and the process with that signal.
static bool compile(int parts, const char *src, const char *so, const char *log, char *err, size_t n) {
  Stops st = {.sig = 0};
  sigset_t old;
  sigemptyset(&st.set);
  sigaddset(&st.set, SIGINT);
  sigaddset(&st.set, SIGTERM);
  sigaddset(&st.set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &st.set, &old);
  bool ok = compile_blocked(parts, src, so, log, &old, &st, err, n);
  if (st.sig) {
    fprintf(stderr, "mdlc: %s while the C compiler ran: stopped it, nothing of it kept\n",
            st.sig == SIGINT ? "interrupted (SIGINT)" : st.sig == SIGTERM ? "terminated (SIGTERM)" : "hung up (SIGHUP)");
    ok = rt_fail(err, n, "the compile was stopped by a signal");
    raise(st.sig); // (pending until the mask is restored)
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return ok;
}

// Starts the compiler: cpu_cc_flags (without -shared when `object`), then extra (NULL-ended), its
// messages into log, in a process group of its own; the child runs with the signal mask `mask`.
// Returns its pid (also into st), -1 if fork failed.
static pid_t run_cc(bool object, const char *const *extra, const char *log, const sigset_t *mask, Stops *st) {
  char flags[256];
  snprintf(flags, sizeof flags, "%s", cpu_cc_flags());
  char *argv[40];
  int argc = 0;
  for (char *tok = strtok(flags, " "); tok && argc < 24; tok = strtok(NULL, " "))
    if (!object || strcmp(tok, "-shared"))
      argv[argc++] = tok;
  for (int i = 0; extra[i] && argc < 38; i++)
    argv[argc++] = (char *)extra[i];
  argv[argc] = NULL;
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    pthread_sigmask(SIG_SETMASK, mask, NULL);
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execvp(argv[0], argv);
    _exit(127);
  }
  if (pid > 0) {
    setpgid(pid, pid); // (as the child does: whichever runs first)
    st->pids[st->npids++] = pid;
  }
  return pid;
}

// Waits for the compiler pid, its status into *status. A stop signal first (polled every 50 ms: it is
// blocked) ends every compiler under way, whose groups get SIGTERM, and is kept in st->sig.
static void wait_or_stop(pid_t pid, int *status, Stops *st) {
  const struct timespec poll = {0, 50000000};
  for (;;) {
    pid_t got = waitpid(pid, status, st->sig ? 0 : WNOHANG);
    if (got == pid || (got < 0 && errno != EINTR))
      break;
    int sig = st->sig ? 0 : sigtimedwait(&st->set, NULL, &poll);
    if (sig > 0) {
      st->sig = sig;
      for (int i = 0; i < st->npids; i++)
        kill(-st->pids[i], SIGTERM);
    }
  }
  for (int i = 0; i < st->npids; i++) // (done with: its pid may be reused)
    if (st->pids[i] == pid)
      st->pids[i] = st->pids[--st->npids];
}

// Waits for the compiler started as pid; whether it succeeded, else the reason in err: the start of
// its messages from log, and where to read them all (shown).
static bool wait_cc(pid_t pid, const char *src, const char *log, const char *shown, Stops *st, char *err, size_t n) {
  int status = 0;
  wait_or_stop(pid, &status, st);
  if (st->sig)
    return false;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
    return true;
  char msg[200] = "";
  FILE *f = fopen(log, "r");
  if (f) {
    size_t k = fread(msg, 1, sizeof msg - 1, f);
    msg[k] = 0;
    fclose(f);
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 127)
    return rt_fail(err, n, "cannot run the C compiler '%.*s'", (int)strcspn(cpu_cc_flags(), " "), cpu_cc_flags());
  return rt_fail(err, n, "the C compiler failed on %s (see %s): %s", src, shown, msg);
}

// Moves the messages in file from into file to (after what it holds with append), from removed.
static void move_log(const char *from, const char *to, bool append) {
  FILE *f = fopen(from, "r"), *t = fopen(to, append ? "a" : "w");
  char buf[4096];
  size_t k;
  while (f && t && (k = fread(buf, 1, sizeof buf, f)) > 0)
    fwrite(buf, 1, k, t);
  if (f)
    fclose(f);
  if (t)
    fclose(t);
  unlink(from);
}

// The module's parts (prelude.h: MDL_PART), from its `#define MDL_NPARTS N`; 1 without one.
static int module_parts(const char *source) {
  const char *d = strstr(source, "\n#define MDL_NPARTS ");
  int k = d ? atoi(d + strlen("\n#define MDL_NPARTS ")) : 1;
  return k >= 1 && k <= 16 ? k : 1;
}

// A module in one part compiles straight into the shared object; in several, each part into an
// object of its own, all at once, then the objects are linked (GPT-2 124M on two cores: 2.1 s whole,
// 1.3 s in four parts). The compiler's messages go to log, each part's after the other.
static bool compile_blocked(int parts, const char *src, const char *so, const char *log, const sigset_t *mask,
                            Stops *st, char *err, size_t n) {
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", so, (long)getpid());
  bool ok = true;
  if (parts == 1) {
    pid_t pid = run_cc(false, (const char *const[]){"-o", tmp, src, "-lm", NULL}, log, mask, st);
    ok = pid >= 0 ? wait_cc(pid, src, log, log, st, err, n) : rt_fail(err, n, "fork: %s", strerror(errno));
  } else {
    char obj[16][1200], plog[16][1200], def[16][32];
    pid_t pid[16];
    for (int p = 0; p < parts; p++) {
      snprintf(obj[p], sizeof obj[p], "%s.%d.o", tmp, p);
      snprintf(plog[p], sizeof plog[p], "%s.%d.log", tmp, p);
      snprintf(def[p], sizeof def[p], "-DMDL_PART=%d", p);
      pid[p] = run_cc(true, (const char *const[]){"-c", def[p], "-o", obj[p], src, NULL}, plog[p], mask, st);
    }
    char later[200]; // the failures after the first
    for (int p = 0; p < parts; p++) // every child waited for, the first failure kept
      if (pid[p] < 0 ? !rt_fail(ok ? err : later, ok ? n : sizeof later, "fork: %s", strerror(errno))
                     : !wait_cc(pid[p], src, plog[p], log, st, ok ? err : later, ok ? n : sizeof later))
        ok = false;
    for (int p = 0; p < parts; p++)
      move_log(plog[p], log, p > 0);
    if (ok) {
      const char *args[24];
      int a = 0;
      args[a++] = "-o";
      args[a++] = tmp;
      for (int p = 0; p < parts; p++)
        args[a++] = obj[p];
      args[a++] = "-lm";
      args[a] = NULL;
      char llog[1120];
      snprintf(llog, sizeof llog, "%s.link.log", tmp);
      pid_t lp = run_cc(false, args, llog, mask, st);
      ok = lp >= 0 ? wait_cc(lp, src, llog, log, st, err, n) : rt_fail(err, n, "fork: %s", strerror(errno));
      move_log(llog, log, true);
    }
    for (int p = 0; p < parts; p++)
      unlink(obj[p]);
  }
  if (ok && rename(tmp, so) == 0)
    return true;
  unlink(tmp);
  return ok ? rt_fail(err, n, "cannot rename %s to %s: %s", tmp, so, strerror(errno)) : false;
}

static pthread_mutex_t error_lock = PTHREAD_MUTEX_INITIALIZER;

// Kernels call this from any thread; the first error of a step is kept.
static void error_hook(void *ctx, const char *what, int64_t value, int64_t limit) {
  CpuModule *cm = ctx;
  pthread_mutex_lock(&error_lock);
  if (!cm->error[0])
    snprintf(cm->error, sizeof cm->error, "%s %lld out of range [0, %lld)", what, (long long)value,
             (long long)limit);
  pthread_mutex_unlock(&error_lock);
}

int cpu_default_threads(void) {
  const char *env = getenv("OMP_NUM_THREADS");
  long n = env && atoi(env) > 0 ? atoi(env) : sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

// Writes the module's source to src and compiles it into so, the time it took into cm.
static bool build(CpuModule *cm, const char *source, const char *src, const char *so, const char *log, char *err,
                  size_t n) {
  double t0 = rt_now();
  if (!rt_write_atomic(src, source, strlen(source), err, n) || !compile(module_parts(source), src, so, log, err, n))
    return false;
  cm->compile_seconds = rt_now() - t0;
  return true;
}

CpuModule *cpu_load(const char *source, char *err, size_t n) {
  char dir[900], key[33], src[1024], so[1024], log[1024];
  const GemmLib *gemm = rt_gemm(err, n);
  if (!gemm || !cpu_march_ok(err, n) || !rt_cache_dir("", dir, sizeof dir, err, n))
    return NULL;
  const char *parts[] = {source, cpu_cc_flags(), MDL_VERSION};
  fnv128(parts, 3, key);
  snprintf(src, sizeof src, "%s/%s.c", dir, key);
  snprintf(so, sizeof so, "%s/%s.so", dir, key);
  snprintf(log, sizeof log, "%s/%s.log", dir, key);
  CpuModule *cm = xcalloc(1, sizeof *cm, "the compiled module");
  snprintf(cm->path, sizeof cm->path, "%s", so);
  cm->cache_hit = access(so, R_OK) == 0;
  if (!cm->cache_hit && !build(cm, source, src, so, log, err, n)) {
    free(cm);
    return NULL;
  }
  cm->so = dlopen(so, RTLD_NOW | RTLD_LOCAL);
  if (!cm->so && cm->cache_hit) { // (damaged, or built against another C library): built again
    fprintf(stderr, "mdlc: warning: the cached module %s does not load (%s); compiling again\n", so, dlerror());
    cm->cache_hit = false;
    if (!build(cm, source, src, so, log, err, n)) {
      free(cm);
      return NULL;
    }
    cm->so = dlopen(so, RTLD_NOW | RTLD_LOCAL);
  }
  if (!cm->so) {
    rt_fail(err, n, "%s", dlerror());
    free(cm);
    return NULL;
  }
  // Unloading the OpenMP runtime under its idle worker threads would crash them: keep it resident.
  dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
  *(void **)&cm->step = dlsym(cm->so, "mdl_step");
  cm->kernels = dlsym(cm->so, "mdl_kernels");
  const int *nk = dlsym(cm->so, "mdl_nkernels");
  const int64_t *bytes = dlsym(cm->so, "mdl_arena_bytes");
  if (!cm->step || !cm->kernels || !nk || !bytes) {
    rt_fail(err, n, "%s: not an mdl module (mdl_step, mdl_kernels, mdl_nkernels or mdl_arena_bytes missing)", so);
    dlclose(cm->so);
    free(cm);
    return NULL;
  }
  cm->nkernels = *nk;
  cm->arena_bytes = *bytes;
  cm->hooks = (MdlHooks){.sgemm = gemm->sgemm, .bgemm = gemm->bgemm, .gemm_blocks = cpu_default_threads(),
                         .ctx = cm, .error = error_hook};
  cpu_set_threads(cm, cpu_default_threads());
  return cm;
}

void cpu_unload(CpuModule *cm) {
  if (!cm)
    return;
  dlclose(cm->so);
  free(cm);
}

// The kernels' OpenMP loops use n threads; so do their GEMMs, which split C into hooks.gemm_blocks
// blocks (fixed at load, so results do not depend on n) and call the library in each, single-threaded,
// so that one pool of threads owns the cores.
void cpu_set_threads(CpuModule *cm, int n) { cm->hooks.nthreads = n > 0 ? n : 1; }

bool cpu_step(CpuModule *cm, char *arena) {
  cm->error[0] = 0;
  cm->step(arena, &cm->hooks);
  return !cm->error[0];
}

bool cpu_run_kernel(CpuModule *cm, int i, char *arena) {
  cm->error[0] = 0;
  if (i < 0 || i >= cm->nkernels) {
    snprintf(cm->error, sizeof cm->error, "no kernel %d (the module has %d)", i, cm->nkernels);
    return false;
  }
  cm->kernels[i].fn(arena, &cm->hooks);
  return !cm->error[0];
}

// Fresh pages from the kernel: zero, page-aligned, and backed by memory only where a step writes
// (an engine that never runs, as the validation engine of a run without validation, costs none);
// in huge pages where the kernel has them (transparent huge pages on madvise): GPT-2 124M's step
// over its 2.5 GB arena in 4 KB pages measured 227-276 tok/s, in 2 MB pages 322-347 (fp32, B4 T64),
// its GEMMs and scatters no longer missing the TLB on every page.
static size_t arena_size(const MemPlan *m) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = (size_t)m->arena_bytes;
  return bytes ? (bytes + page - 1) / page * page : page;
}

char *cpu_arena_new(const MemPlan *m) {
  void *a = mmap(NULL, arena_size(m), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (a == MAP_FAILED)
    return NULL;
  madvise(a, arena_size(m), MADV_HUGEPAGE);
  return a;
}

void cpu_arena_drop(char *arena, int64_t off, int64_t bytes) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  uintptr_t lo = (uintptr_t)arena + (uintptr_t)off, hi = lo + (uintptr_t)(bytes > 0 ? bytes : 0);
  lo = (lo + page - 1) / page * page;
  hi = hi / page * page;
  if (hi > lo)
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void cpu_arena_free(const MemPlan *m, char *arena) {
  if (arena)
    munmap(arena, arena_size(m));
}

void *cpu_value(const MemPlan *m, char *arena, int node) {
  return m->offset[node] >= 0 ? arena + m->offset[node] : NULL;
}

void cpu_bf16_from_f32(const float *x, uint16_t *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float r = (float)round_bf16(x[i]);
    uint32_t u;
    memcpy(&u, &r, 4);
    y[i] = (uint16_t)(u >> 16);
  }
}

void cpu_round_copy(const Graph *g, const MemPlan *m, char *arena, int param) {
  int c = g->nodes[param]->op == OP_PARAM && m->copy_of ? m->copy_of[param] : -1;
  if (c < 0 || m->offset[c] < 0)
    return;
  cpu_bf16_from_f32((const float *)(arena + m->offset[param]), (uint16_t *)(arena + m->offset[c]),
                    shape_numel(g->nodes[param]->shape));
}

// Parameter k's initial values x[lo, hi): each element a function of (seed, k, its index) alone.
typedef struct {
  const IrNode *p;
  int k;
  uint64_t seed;
  float *x;
} InitRange;

static void init_range(void *ctx, int64_t lo, int64_t hi) {
  const InitRange *r = ctx;
  for (int64_t i = lo; i < hi; i++)
    r->x[i] = (float)mdl_param_init(&r->p->init, r->seed, r->k, i);
}

// (on every CPU: GPT-2 124M's 124M normal draws took 3.75 s on one thread)
void cpu_draw_param(const Graph *g, uint64_t seed, int k, float *x) {
  const IrNode *p = g->nodes[g->params[k]];
  InitRange r = {p, k, seed, x};
  rt_parallel_for(shape_numel(p->shape), 1 << 16, init_range, &r);
}

void cpu_init_param(const Graph *g, const MemPlan *m, char *arena, uint64_t seed, int k) {
  cpu_draw_param(g, seed, k, cpu_value(m, arena, g->params[k]));
  cpu_round_copy(g, m, arena, g->params[k]);
}

void cpu_init_params(const Graph *g, const MemPlan *m, char *arena, uint64_t seed) {
  for (int k = 0; k < g->nparams; k++)
    cpu_init_param(g, m, arena, seed, k);
}

// The nodes whose values persist across steps: parameters and AdamW moments.
static bool persistent(const IrNode *n) { return n->op == OP_PARAM || n->op == OP_STATE; }

void cpu_params_from_interp(const Graph *g, const MemPlan *m, char *arena, Interp *it) {
  for (int i = 0; i < g->n; i++)
    if (persistent(g->nodes[i]) && m->offset[i] >= 0) {
      float *x = cpu_value(m, arena, i);
      const double *v = interp_param(it, i);
      for (int64_t j = 0; j < shape_numel(g->nodes[i]->shape); j++)
        x[j] = (float)v[j];
      cpu_round_copy(g, m, arena, i);
    }
}

void cpu_params_to_interp(const Graph *g, const MemPlan *m, const char *arena, Interp *it) {
  for (int i = 0; i < g->n; i++)
    if (persistent(g->nodes[i]) && m->offset[i] >= 0) {
      const float *x = (const float *)(arena + m->offset[i]);
      double *v = interp_param(it, i);
      for (int64_t j = 0; j < shape_numel(g->nodes[i]->shape); j++)
        v[j] = x[j];
    }
}

bool cpu_set_input(const Graph *g, const MemPlan *m, char *arena, const char *name, const int32_t *ids,
                   const float *f, int64_t n) {
  bool found = false;
  for (int i = 0; i < g->n; i++) {
    const IrNode *nd = g->nodes[i];
    if (nd->op != OP_INPUT || !nd->name || strcmp(nd->name, name) != 0 || m->offset[i] < 0)
      continue;
    bool i32 = nd->dtype == DT_I32;
    if (n != shape_numel(nd->shape) || (i32 ? !ids : !f))
      return false;
    memcpy(arena + m->offset[i], i32 ? (const void *)ids : (const void *)f, (size_t)n * 4);
    found = true;
  }
  return found;
}

void cpu_set_scalar(const Graph *g, const MemPlan *m, char *arena, const char *name, double v) {
  for (int i = 0; i < g->n; i++) {
    const IrNode *nd = g->nodes[i];
    if (nd->op == OP_SCALAR && nd->name && !strcmp(nd->name, name) && m->offset[i] >= 0)
      for (int64_t j = 0; j < shape_numel(nd->shape); j++)
        ((float *)(arena + m->offset[i]))[j] = (float)v;
  }
}
