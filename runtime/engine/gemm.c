// gemm.c: the GEMM library behind the CPU back end's sgemm and bgemm hooks, chosen once per process.
//
// Measured at the models' GEMM shapes on a 2-core Xeon with AVX-512 and AMX (bench/RESULTS.md,
// "GEMM libraries"): oneDNN's sgemm 290-390 GFLOP/s, OpenBLAS 0.3.21 on its SkylakeX kernels 230-290,
// BLIS 0.9 80-180; oneDNN's bf16 matmul on AMX 900-1450. So oneDNN comes first; OpenBLAS is the
// fallback where oneDNN is not installed. Both are loaded with dlopen, so one binary runs with
// whichever is there. OpenBLAS picks its kernels by CPU model, and a CPU newer than the library
// falls back to its oldest (Prescott, SSE3: a quarter of the speed); before loading it we name the
// kernel family the CPU's instruction set can run (OPENBLAS_CORETYPE), unless the user did.
//
// Calls come from the module's OpenMP threads, one block of rows or columns each, and must run on
// the calling thread alone: a library that split a call over threads of its own would make the
// result depend on the thread count. oneDNN threads through the same OpenMP runtime as the module,
// so each call sets that thread's OpenMP thread count to 1 for its duration; OpenBLAS is set to one
// thread once.
//
// bgemm (bf16 operands, f32 accumulation and result) is offered only where the library has bf16
// kernels of the CPU's own: oneDNN whose effective ISA includes AVX-512 BF16 (vdpbf16ps; AMX CPUs
// have it too). Measured (bench/RESULTS.md, "bf16 without AMX"): on a Zen 4 oneDNN 2.6.3's bf16
// matmul runs at 1.6-2.0x its sgemm at the models' shapes, on AMX 3-4.5x. On AVX-512 without BF16
// and on AVX2 oneDNN 2.6 has no bf16 GEMM kernel of its own, so the module widens bf16 operands and
// calls sgemm there.
//
// Signals. oneDNN's f32 GEMM kernels before 3.11.2 (jit_avx512_common_gemm_f32, jit_avx_gemm_f32)
// point the stack pointer into a workspace they allocate on the heap while they run, so a signal
// handled on that thread has its frame written over the heap below that workspace (glibc then
// aborts in a later free: "corrupted size vs. prev_size"; a SIGTERM to a run did it 3 times in 230).
// Every thread that calls into a library therefore gets an alternate signal stack first
// (rt_signal_stack), and every handler the runtime installs runs on it (SA_ONSTACK).
//
// Address space. Under a limit (ulimit -v), oneDNN 2.6's first GEMM crashes where too little is left
// for it: SIGSEGV inside its initialisation, or libgomp's abort when it cannot create the threads'
// stacks. Measured on 2 cores of a Zen 4: loaded, oneDNN grew the process by 14 MB at its first GEMM;
// it crashed with 15 MB left and ran with 25 MB. So a library is taken only where the limit leaves
// GEMM_START_BYTES plus a default thread stack per core, else the run stops with an out-of-memory
// error before anything is trained or written.
#include "backend.h"
#include "runtime.h"

#include <dlfcn.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

typedef void (*SetThreads)(int);
typedef int (*GetThreads)(void);

static struct {
  bool loaded, ok;
  GemmLib lib;
  char err[512]; // (room for both libraries' reasons, 160 bytes each, and the advice)
  SetThreads omp_set;        // the OpenMP runtime's omp_set_num_threads / omp_get_max_threads
  GetThreads omp_get;
  // oneDNN
  __typeof__(dnnl_sgemm) *sgemm;
  __typeof__(dnnl_engine_create) *engine_create;
  __typeof__(dnnl_stream_create) *stream_create;
  __typeof__(dnnl_stream_destroy) *stream_destroy;
  __typeof__(dnnl_memory_desc_init_by_strides) *md_init;
  __typeof__(dnnl_memory_desc_get_size) *md_size;
  __typeof__(dnnl_matmul_desc_init) *matmul_init;
  __typeof__(dnnl_primitive_attr_create) *attr_create;
  __typeof__(dnnl_primitive_attr_destroy) *attr_destroy;
  __typeof__(dnnl_primitive_attr_set_scratchpad_mode) *attr_scratchpad;
  __typeof__(dnnl_primitive_attr_set_post_ops) *attr_post_ops;
  __typeof__(dnnl_post_ops_create) *po_create;
  __typeof__(dnnl_post_ops_destroy) *po_destroy;
  __typeof__(dnnl_post_ops_append_sum) *po_sum;
  __typeof__(dnnl_primitive_desc_create) *pd_create;
  __typeof__(dnnl_primitive_desc_destroy) *pd_destroy;
  __typeof__(dnnl_primitive_desc_query_md) *pd_query_md;
  __typeof__(dnnl_primitive_create) *prim_create;
  __typeof__(dnnl_primitive_execute) *prim_execute;
  __typeof__(dnnl_memory_create) *mem_create;
  __typeof__(dnnl_memory_destroy) *mem_destroy;
  __typeof__(dnnl_memory_set_data_handle) *mem_set;
  dnnl_engine_t engine;
  // OpenBLAS
  void (*cblas_sgemm)(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                      const float *b, int ldb, float beta, float *c, int ldc);
} L;

//
// The alternate signal stacks.
//

enum { SIGNAL_STACK_BYTES = 64 << 10 }; // (a frame with AVX-512 and AMX state takes about 12 KB)
static pthread_once_t signal_stack_once = PTHREAD_ONCE_INIT;
static pthread_key_t signal_stack_key; // its stack, released when the thread ends
static _Thread_local bool tl_signal_stack;

static void signal_stack_release(void *stack) {
  stack_t off = {.ss_flags = SS_DISABLE};
  sigaltstack(&off, NULL);
  munmap(stack, SIGNAL_STACK_BYTES);
}

static void signal_stack_key_make(void) { pthread_key_create(&signal_stack_key, signal_stack_release); }

void rt_signal_stack(void) {
  if (tl_signal_stack)
    return;
  tl_signal_stack = true;
  stack_t ss;
  if (sigaltstack(NULL, &ss) == 0 && !(ss.ss_flags & SS_DISABLE)) // (one already: a sanitizer's)
    return;
  void *stack = mmap(NULL, SIGNAL_STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (stack == MAP_FAILED)
    return;
  ss = (stack_t){.ss_sp = stack, .ss_size = SIGNAL_STACK_BYTES};
  if (sigaltstack(&ss, NULL) != 0) {
    munmap(stack, SIGNAL_STACK_BYTES);
    return;
  }
  pthread_once(&signal_stack_once, signal_stack_key_make);
  pthread_setspecific(signal_stack_key, stack);
}

//
// oneDNN.
//

// The calling thread runs the call alone (see the top of the file).
static int one_thread(void) {
  int t = L.omp_get ? L.omp_get() : 1;
  if (L.omp_set && t != 1)
    L.omp_set(1);
  return t;
}

static void threads_back(int t) {
  if (L.omp_set && t != 1)
    L.omp_set(t);
}

static void onednn_sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                         const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  rt_signal_stack();
  int t = one_thread();
  L.sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  threads_back(t);
}

// A bf16 matmul primitive for one (transposes, sizes, leading dimensions, beta): the module's GEMMs
// have fixed shapes, so a step meets a few dozen of them, each made once.
typedef struct {
  int id;                    // its place in mm_cache (and in each thread's memory objects)
  int ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  float beta;
  dnnl_primitive_t prim;
  dnnl_memory_desc_t a, b, c;
  size_t scratch;            // bytes of the scratchpad it asks for
  dnnl_memory_desc_t s;      // the scratchpad, as bytes
} Matmul;

static pthread_mutex_t mm_lock = PTHREAD_MUTEX_INITIALIZER;
static Matmul **mm_cache; // (each entry allocated once: a thread keeps using it while another adds one)
static int mm_n, mm_cap;

static bool matmul_make(Matmul *mm) {
  dnnl_dims_t ad = {mm->m, mm->k}, bd = {mm->k, mm->n}, cd = {mm->m, mm->n};
  dnnl_dims_t as = {mm->ta ? 1 : mm->lda, mm->ta ? mm->lda : 1}, bs = {mm->tb ? 1 : mm->ldb, mm->tb ? mm->ldb : 1},
              cs = {mm->ldc, 1};
  dnnl_matmul_desc_t desc;
  dnnl_primitive_attr_t attr = NULL;
  dnnl_post_ops_t po = NULL;
  dnnl_primitive_desc_t pd = NULL;
  bool ok = L.md_init(&mm->a, 2, ad, dnnl_bf16, as) == dnnl_success &&
            L.md_init(&mm->b, 2, bd, dnnl_bf16, bs) == dnnl_success &&
            L.md_init(&mm->c, 2, cd, dnnl_f32, cs) == dnnl_success &&
            L.matmul_init(&desc, &mm->a, &mm->b, NULL, &mm->c) == dnnl_success &&
            L.attr_create(&attr) == dnnl_success &&
            L.attr_scratchpad(attr, dnnl_scratchpad_mode_user) == dnnl_success;
  if (ok && mm->beta != 0.0f)
    ok = L.po_create(&po) == dnnl_success && L.po_sum(po, mm->beta) == dnnl_success &&
         L.attr_post_ops(attr, po) == dnnl_success;
  ok = ok && L.pd_create(&pd, &desc, attr, L.engine, NULL) == dnnl_success;
  if (ok) {
    const dnnl_memory_desc_t *s = L.pd_query_md(pd, dnnl_query_scratchpad_md, 0);
    mm->scratch = s ? L.md_size(s) : 0;
    ok = L.md_init(&mm->s, 1, (dnnl_dims_t){(dnnl_dim_t)mm->scratch}, dnnl_u8, (dnnl_dims_t){1}) == dnnl_success &&
         L.prim_create(&mm->prim, pd) == dnnl_success;
  }
  if (pd)
    L.pd_destroy(pd);
  if (po)
    L.po_destroy(po);
  if (attr)
    L.attr_destroy(attr);
  return ok;
}

// The primitive for this call, made on first use; NULL when oneDNN refuses the shape.
static const Matmul *matmul_for(int ta, int tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                                int64_t ldc, float beta) {
  pthread_mutex_lock(&mm_lock);
  const Matmul *found = NULL;
  for (int i = 0; i < mm_n && !found; i++) {
    const Matmul *c = mm_cache[i];
    if (c->ta == ta && c->tb == tb && c->m == m && c->n == n && c->k == k && c->lda == lda && c->ldb == ldb &&
        c->ldc == ldc && c->beta == beta)
      found = c;
  }
  if (!found) {
    if (mm_n == mm_cap) {
      int cap = mm_cap ? 2 * mm_cap : 64;
      Matmul **grown = realloc(mm_cache, (size_t)cap * sizeof *grown);
      if (grown)
        mm_cache = grown, mm_cap = cap;
    }
    Matmul *mm = malloc(sizeof *mm);
    if (mm)
      *mm = (Matmul){.id = mm_n, .ta = ta, .tb = tb, .m = m, .n = n, .k = k, .lda = lda, .ldb = ldb, .ldc = ldc,
                     .beta = beta};
    if (mm && mm_n < mm_cap && matmul_make(mm))
      found = mm_cache[mm_n++] = mm;
    else
      free(mm);
  }
  pthread_mutex_unlock(&mm_lock);
  return found;
}

// Each thread's stream and scratchpad (OpenMP's threads live as long as the process), and its memory
// objects for each primitive (tl_mem[id]: a, b, c, scratchpad), made once and pointed at each call's
// operands: made and destroyed around every call they took 4 of the 5-8 us an attention block's
// product takes on AMX.
static _Thread_local dnnl_stream_t tl_stream;
static _Thread_local void *tl_scratch;
static _Thread_local size_t tl_scratch_bytes;
static _Thread_local dnnl_memory_t (*tl_mem)[4];
static _Thread_local int tl_nmem;

static void bf16_widened_sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda,
                               const uint16_t *b, int64_t ldb, float beta, float *c, int64_t ldc);

// This state is released when its thread ends (a key's destructor, run while the thread's own
// variables are still there): the runtime's own threads (rt_parallel_for, the start-up probe among
// their callers) end before the process does.
static pthread_once_t tl_once = PTHREAD_ONCE_INIT;
static pthread_key_t tl_key;

static void tl_release(void *unused) {
  (void)unused;
  for (int i = 0; i < tl_nmem; i++)
    for (int j = 0; j < 4; j++)
      if (tl_mem[i][j])
        L.mem_destroy(tl_mem[i][j]);
  free(tl_mem);
  free(tl_scratch);
  if (tl_stream)
    L.stream_destroy(tl_stream);
  tl_mem = NULL, tl_nmem = 0, tl_scratch = NULL, tl_scratch_bytes = 0, tl_stream = NULL;
}

static void tl_key_make(void) { pthread_key_create(&tl_key, tl_release); }

// Marks this thread's state for release at its end, once.
static void tl_hold(void) {
  static _Thread_local bool held;
  if (held)
    return;
  held = true;
  pthread_once(&tl_once, tl_key_make);
  pthread_setspecific(tl_key, &held);
}

// This thread's memory objects for mm, pointed at a, b, c and the scratchpad; NULL when oneDNN fails.
static dnnl_memory_t *memories(const Matmul *mm, const void *a, const void *b, void *c) {
  if (mm->id >= tl_nmem) {
    int n = mm->id + 64;
    dnnl_memory_t(*grown)[4] = realloc(tl_mem, (size_t)n * sizeof *grown);
    if (!grown)
      return NULL;
    memset(grown + tl_nmem, 0, (size_t)(n - tl_nmem) * sizeof *grown);
    tl_mem = grown, tl_nmem = n;
  }
  dnnl_memory_t *m = tl_mem[mm->id];
  const dnnl_memory_desc_t *md[4] = {&mm->a, &mm->b, &mm->c, &mm->s};
  void *at[4] = {(void *)a, (void *)b, c, tl_scratch};
  for (int i = 0; i < 4; i++) {
    if (!m[i] && L.mem_create(&m[i], md[i], L.engine, at[i]) != dnnl_success) {
      m[i] = NULL;
      return NULL;
    }
    if (L.mem_set(m[i], at[i]) != dnnl_success)
      return NULL;
  }
  return m;
}

static void onednn_bgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda,
                         const uint16_t *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  rt_signal_stack();
  const Matmul *mm = matmul_for(ta, tb, m, n, k, lda, ldb, ldc, beta);
  tl_hold();
  if (!tl_stream && L.stream_create(&tl_stream, L.engine, dnnl_stream_default_flags) != dnnl_success)
    tl_stream = NULL;
  if (mm && mm->scratch > tl_scratch_bytes) {
    free(tl_scratch);
    tl_scratch = aligned_alloc(64, (mm->scratch + 63) / 64 * 64);
    tl_scratch_bytes = tl_scratch ? mm->scratch : 0;
  }
  dnnl_memory_t *mem = mm && tl_stream && tl_scratch_bytes >= mm->scratch ? memories(mm, a, b, c) : NULL;
  bool ok = mem != NULL;
  if (ok) {
    dnnl_exec_arg_t args[] = {
        {DNNL_ARG_SRC, mem[0]}, {DNNL_ARG_WEIGHTS, mem[1]}, {DNNL_ARG_DST, mem[2]}, {DNNL_ARG_SCRATCHPAD, mem[3]}};
    int t = one_thread();
    ok = L.prim_execute(mm->prim, tl_stream, 4, args) == dnnl_success;
    threads_back(t);
  }
  if (!ok) // (never seen: oneDNN takes every strided 2-D bf16 matmul) the same product on sgemm
    bf16_widened_sgemm(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
}

static bool onednn_load(char *why, size_t n) {
  void *so = dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!so)
    return rt_fail(why, n, "oneDNN (libdnnl.so.2) is not installed");
  // libstdc++, which oneDNN brings, allocates its per-thread state on first use, and its exit
  // handler uses it: taken now for this thread, so that an exit once memory has run out needs none
  // (else the loader ends the process with "cannot allocate memory for thread-local data").
  void *(*cxa_globals)(void) = (void *(*)(void))dlsym(so, "__cxa_get_globals");
  if (cxa_globals)
    cxa_globals();
#define SYM(field, name) (*(void **)&L.field = dlsym(so, #name)) != NULL
  bool ok = SYM(sgemm, dnnl_sgemm) && SYM(engine_create, dnnl_engine_create) &&
            SYM(stream_create, dnnl_stream_create) && SYM(stream_destroy, dnnl_stream_destroy) &&
            SYM(md_init, dnnl_memory_desc_init_by_strides) &&
            SYM(md_size, dnnl_memory_desc_get_size) && SYM(matmul_init, dnnl_matmul_desc_init) &&
            SYM(attr_create, dnnl_primitive_attr_create) && SYM(attr_destroy, dnnl_primitive_attr_destroy) &&
            SYM(attr_scratchpad, dnnl_primitive_attr_set_scratchpad_mode) &&
            SYM(attr_post_ops, dnnl_primitive_attr_set_post_ops) && SYM(po_create, dnnl_post_ops_create) &&
            SYM(po_destroy, dnnl_post_ops_destroy) && SYM(po_sum, dnnl_post_ops_append_sum) &&
            SYM(pd_create, dnnl_primitive_desc_create) && SYM(pd_destroy, dnnl_primitive_desc_destroy) &&
            SYM(pd_query_md, dnnl_primitive_desc_query_md) && SYM(prim_create, dnnl_primitive_create) &&
            SYM(prim_execute, dnnl_primitive_execute) && SYM(mem_create, dnnl_memory_create) &&
            SYM(mem_destroy, dnnl_memory_destroy) && SYM(mem_set, dnnl_memory_set_data_handle);
#undef SYM
  const dnnl_version_t *(*version)(void) = (const dnnl_version_t *(*)(void))dlsym(so, "dnnl_version");
  dnnl_cpu_isa_t (*isa)(void) = (dnnl_cpu_isa_t(*)(void))dlsym(so, "dnnl_get_effective_cpu_isa");
  if (!ok || !version || !isa || L.engine_create(&L.engine, dnnl_cpu, 0) != dnnl_success) {
    dlclose(so);
    return rt_fail(why, n, "libdnnl.so.2 lacks the functions of oneDNN 2.x");
  }
  void *omp = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (omp) {
    *(void **)&L.omp_set = dlsym(omp, "omp_set_num_threads");
    *(void **)&L.omp_get = dlsym(omp, "omp_get_max_threads");
  }
  static const struct {
    dnnl_cpu_isa_t isa;
    const char *name;
  } isas[] = {{dnnl_cpu_isa_avx512_core_amx, "avx512_core_amx"}, {dnnl_cpu_isa_avx512_core_bf16, "avx512_core_bf16"},
              {dnnl_cpu_isa_avx512_core_vnni, "avx512_core_vnni"}, {dnnl_cpu_isa_avx512_core, "avx512_core"},
              {dnnl_cpu_isa_avx2, "avx2"}, {dnnl_cpu_isa_avx, "avx"}, {dnnl_cpu_isa_sse41, "sse41"}};
  dnnl_cpu_isa_t have = isa();
  const char *isa_name = "generic";
  for (size_t i = 0; i < sizeof isas / sizeof *isas && !strcmp(isa_name, "generic"); i++)
    if ((have & isas[i].isa) == isas[i].isa)
      isa_name = isas[i].name;
  const dnnl_version_t *v = version();
  GemmLib *g = &L.lib;
  snprintf(g->name, sizeof g->name, "oneDNN %d.%d.%d", v->major, v->minor, v->patch);
  snprintf(g->kernels, sizeof g->kernels, "%s", isa_name);
  g->sgemm = onednn_sgemm;
  g->generic = (have & dnnl_cpu_isa_avx2) != dnnl_cpu_isa_avx2 && __builtin_cpu_supports("avx2");
  if ((have & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16)
    g->bgemm = onednn_bgemm;
  return true;
}

//
// OpenBLAS.
//

static void openblas_sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                           const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  rt_signal_stack();
  L.cblas_sgemm(101 /* row major */, ta ? 112 : 111, tb ? 112 : 111, (int)m, (int)n, (int)k, 1.0f, a, (int)lda, b,
                (int)ldb, beta, c, (int)ldc);
}

// The OpenBLAS kernel family this CPU's instruction set runs (OpenBLAS 0.3.21's names), or NULL.
static const char *openblas_coretype(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512bf16") ? "COOPERLAKE" : "SKYLAKEX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return "HASWELL";
  return NULL;
}

// OpenBLAS linked into the program (gpu-check's bundle links it statically, for a machine where
// nothing is installed; its kernels were chosen before main), else libopenblas.so.0.
static bool openblas_load(char *why, size_t n) {
  const char *forced = getenv("OPENBLAS_CORETYPE"), *type = openblas_coretype();
  bool linked = dlsym(RTLD_DEFAULT, "openblas_get_corename") != NULL;
  void *so = RTLD_DEFAULT;
  if (!linked) {
    if (!forced && type)
      setenv("OPENBLAS_CORETYPE", type, 0);
    if (!(so = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL)))
      return rt_fail(why, n, "OpenBLAS (libopenblas.so.0) is not installed");
  }
  *(void **)&L.cblas_sgemm = dlsym(so, "cblas_sgemm");
  char *(*corename)(void) = (char *(*)(void))dlsym(so, "openblas_get_corename");
  char *(*config)(void) = (char *(*)(void))dlsym(so, "openblas_get_config");
  void (*set_threads)(int) = (void (*)(int))dlsym(so, "openblas_set_num_threads");
  if (!L.cblas_sgemm || !corename || !set_threads) {
    if (!linked)
      dlclose(so);
    return rt_fail(why, n, "libopenblas.so.0 lacks cblas_sgemm, openblas_get_corename or openblas_set_num_threads");
  }
  set_threads(1);
  GemmLib *g = &L.lib;
  const char *cfg = config ? config() : "OpenBLAS";
  snprintf(g->name, sizeof g->name, "OpenBLAS %.*s", (int)strcspn(cfg + (strncmp(cfg, "OpenBLAS ", 9) ? 0 : 9), " "),
           cfg + (strncmp(cfg, "OpenBLAS ", 9) ? 0 : 9));
  snprintf(g->kernels, sizeof g->kernels, "%s", corename());
  snprintf(g->how, sizeof g->how, "%s", linked ? ", linked into the program" : forced ? ", as OPENBLAS_CORETYPE says"
                                                 : type ? ", named by the CPU's flags" : "");
  static const char *const old[] = {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Katmai", "Coppermine",
                                    "Northwood", "Banias", "Atom", "Generic", "unknown"};
  for (size_t i = 0; i < sizeof old / sizeof *old; i++)
    g->generic |= !strncasecmp(corename(), old[i], strlen(old[i])) && __builtin_cpu_supports("avx2");
  g->sgemm = openblas_sgemm;
  return true;
}

//
// Plain loops (MDL_GEMM=loops): no library at all. A reference that shares nothing with the libraries,
// so that the tests run every module on a GEMM path of three (tests/cli/matrix.sh); several times
// slower than either library, and never chosen unless asked for.
//

static void loops_sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                        const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  for (int64_t i = 0; i < m; i++) {
    float *ci = c + i * ldc;
    for (int64_t j = 0; j < n; j++)
      ci[j] = beta == 0 ? 0 : beta * ci[j];
    if (tb) { // B^T: row j of b is column j of the product's B, a dot product each
      for (int64_t j = 0; j < n; j++) {
        float s = 0;
        for (int64_t p = 0; p < k; p++)
          s += (ta ? a[p * lda + i] : a[i * lda + p]) * b[j * ldb + p];
        ci[j] += s;
      }
      continue;
    }
    for (int64_t p = 0; p < k; p++) {
      const float aip = ta ? a[p * lda + i] : a[i * lda + p], *bp = b + p * ldb;
      for (int64_t j = 0; j < n; j++)
        ci[j] += aip * bp[j];
    }
  }
}

static bool loops_load(void) {
  GemmLib *g = &L.lib;
  snprintf(g->name, sizeof g->name, "plain loops");
  snprintf(g->kernels, sizeof g->kernels, "no library");
  snprintf(g->how, sizeof g->how, ", as MDL_GEMM says");
  g->sgemm = loops_sgemm;
  return true;
}

//
// All.
//

static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

// bf16 operands widened into f32 scratch, then sgemm: what a library without a fast bf16 GEMM runs.
static void bf16_widened_sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda,
                               const uint16_t *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
  float *wa = xmalloc((size_t)(ar * ac + br * bc) * sizeof *wa, "a GEMM's widened operands"), *wb = wa + ar * ac;
  for (int64_t i = 0; i < ar; i++)
    for (int64_t j = 0; j < ac; j++)
      wa[i * ac + j] = bf16_to_f32(a[i * lda + j]);
  for (int64_t i = 0; i < br; i++)
    for (int64_t j = 0; j < bc; j++)
      wb[i * bc + j] = bf16_to_f32(b[i * ldb + j]);
  L.lib.sgemm(ta, tb, m, n, k, wa, ac, wb, bc, beta, c, ldc);
  free(wa);
}

// The probe: one block of a 256 x 768 x 768 product a thread, split as the module splits it (sgemm
// by rows, bgemm by columns), run a few times; each block's best time goes into secs[lo].
typedef struct {
  bool bf16;
  float *a, *b, *c;
  double secs[8];
  int64_t nb;
} Probe;

enum { PM = 256, PN = 768, PK = 768 };

static void probe_blocks(void *ctx, int64_t lo, int64_t hi) {
  Probe *p = ctx;
  for (int64_t t = lo; t < hi; t++) {
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
      double t0 = rt_now();
      if (p->bf16) {
        int64_t c0 = PN * t / p->nb, c1 = PN * (t + 1) / p->nb;
        L.lib.bgemm(0, 0, PM, c1 - c0, PK, (const uint16_t *)p->a, PK, (const uint16_t *)p->b + c0, PN, 0.0f,
                    p->c + c0, PN);
      } else {
        int64_t r0 = PM * t / p->nb, r1 = PM * (t + 1) / p->nb;
        L.lib.sgemm(0, 0, r1 - r0, PN, PK, p->a + r0 * PK, PK, p->b, PN, 0.0f, p->c + r0 * PN, PN);
      }
      double dt = rt_now() - t0;
      best = dt < best ? dt : best;
    }
    p->secs[t] = best;
  }
}

// GFLOP/s: the product's flops over its slowest block.
static double probe(bool bf16) {
  float *a = xcalloc((size_t)PM * PK + PK * PN + PM * PN, sizeof *a, "the GEMM probe's operands");
  for (int i = 0; i < PM * PK + PK * PN; i++)
    a[i] = (float)(i % 13) * 0.125f; // (as bf16 pairs: small normal numbers)
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  Probe p = {.bf16 = bf16, .a = a, .b = a + PM * PK, .c = a + PM * PK + PK * PN,
             .nb = cpus < 1 ? 1 : cpus < 8 ? cpus : 8};
  rt_parallel_for(p.nb, 1, probe_blocks, &p);
  double slowest = 0;
  for (int64_t t = 0; t < p.nb; t++)
    slowest = p.secs[t] > slowest ? p.secs[t] : slowest;
  free(a);
  return slowest > 0 ? 2.0 * PM * PN * PK / slowest / 1e9 : 0;
}

enum { GEMM_START_BYTES = 24 << 20 };

// Whether the address-space limit, if there is one, leaves the library room to start its threads
// (see the top of this file); else why not, in L.err.
static bool address_space_left(void) {
  struct rlimit lim;
  if (getrlimit(RLIMIT_AS, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY)
    return true;
  long pages = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  bool read = f && fscanf(f, "%ld", &pages) == 1;
  if (f)
    fclose(f);
  if (!read)
    return true; // (no /proc: the library is tried)
  size_t stack = 8 << 20;
  pthread_attr_t attr;
  if (pthread_getattr_default_np(&attr) == 0) {
    pthread_attr_getstacksize(&attr, &stack);
    pthread_attr_destroy(&attr);
  }
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  double used = (double)pages * (double)sysconf(_SC_PAGESIZE), limit = (double)lim.rlim_cur;
  double need = GEMM_START_BYTES + (double)(cores > 0 ? cores : 1) * (double)stack;
  if (limit - used >= need)
    return true;
  snprintf(L.err, sizeof L.err, "out of memory: the GEMM library and its %ld threads need about %.0f MB of address "
           "space, the limit (ulimit -v) leaves %.0f MB", cores, need / 1e6, (limit - used) / 1e6);
  return false;
}

const GemmLib *rt_gemm(char *err, size_t n) {
  if (!L.loaded) {
    L.loaded = true;
    const char *want = getenv("MDL_GEMM");
    char why1[160] = "", why2[160] = "";
    if (want && strcmp(want, "onednn") && strcmp(want, "openblas") && strcmp(want, "loops"))
      snprintf(L.err, sizeof L.err, "MDL_GEMM=%s: want onednn, openblas or loops", want);
    else if (want && !strcmp(want, "loops"))
      L.ok = loops_load();
    else if (want && !strcmp(want, "openblas"))
      L.ok = openblas_load(why2, sizeof why2);
    else
      L.ok = onednn_load(why1, sizeof why1) || (!want && openblas_load(why2, sizeof why2));
    if (!L.ok && !L.err[0])
      snprintf(L.err, sizeof L.err, "no GEMM library: %s%s%s (install libdnnl2 or libopenblas0)", why1,
               why1[0] && why2[0] ? "; " : "", why2);
    if (L.ok && !address_space_left())
      L.ok = false;
  }
  if (!L.ok) {
    rt_fail(err, n, "%s", L.err);
    return NULL;
  }
  return &L.lib;
}

void rt_gemm_probe(void) {
  GemmLib *g = &L.lib;
  if (!L.ok)
    return;
  if (g->sgemm_gflops == 0)
    g->sgemm_gflops = probe(false);
  if (g->bgemm && g->bgemm_gflops == 0)
    g->bgemm_gflops = probe(true);
}
