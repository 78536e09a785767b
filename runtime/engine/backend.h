// backend.h: the compiled CPU back end. emit_c (compiler/emit/emit_c.c) turns a step plan into one C
// translation unit; cpu.c compiles it into a cached shared object, loads it, and moves data between
// the arena it runs on and the rest of the program (the interpreter, inputs, the lr/step scalars).
//
// The ABI between the runtime and a generated module is runtime/kernels/abi.h (MdlHooks, MdlKernel):
// the C prelude of every module carries its text (the module includes nothing of ours), so the
// runtime and the modules read one copy. The module exports:
//   void mdl_step(char *arena, const MdlHooks *h);   // one whole training step
//   const MdlKernel mdl_kernels[]; const int mdl_nkernels; // the same step, kernel by kernel
//   const int64_t mdl_arena_bytes;                    // the arena size it was planned for
#ifndef MDL_BACKEND_H
#define MDL_BACKEND_H
#include "mdl.h"

#include "abi.h"

//
// gemm.c: the GEMM library behind the hooks (oneDNN, else OpenBLAS on the kernels the CPU runs).
//
typedef struct {
  char name[64];        // "oneDNN 2.6.3", "OpenBLAS 0.3.21"
  char kernels[64];     // the kernel family it runs here: "avx512_core_amx", "SkylakeX", ...
  char how[64];         // how that family was chosen, when not by the library: ", named by the CPU's flags"
  bool generic;         // a family older than this CPU's instruction set: a slow fallback
  void (*sgemm)(int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
                int64_t ldb, float beta, float *c, int64_t ldc);
  void (*bgemm)(int ta, int tb, int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda,
                const uint16_t *b, int64_t ldb, float beta, float *c, int64_t ldc); // NULL: none faster
  double sgemm_gflops, bgemm_gflops; // measured by rt_gemm_probe, 0 before
} GemmLib;

// The library, loaded on first use: oneDNN, else OpenBLAS; MDL_GEMM=onednn or openblas insists on
// one, MDL_GEMM=loops takes plain loops (a reference for tests). NULL with the reason in err when none loads.
const GemmLib *rt_gemm(char *err, size_t n);
// Times a 256 x 768 x 768 product on every core, split as the module splits it (~20 ms, once), into
// the library's sgemm_gflops and bgemm_gflops.
void rt_gemm_probe(void);

//
// cpu.c: compile, cache, load and run a generated module.
//
typedef struct {
  void *so;                  // dlopen handle
  void (*step)(char *arena, const MdlHooks *h);
  const MdlKernel *kernels;
  int nkernels;
  int64_t arena_bytes;       // what the module was planned for
  MdlHooks hooks;            // sgemm, bgemm = rt_gemm's; nthreads (cpu_set_threads); seed 0: set it to the run's
  bool cache_hit;            // the shared object was already in the cache
  double compile_seconds;    // time spent in the C compiler (0 on a cache hit)
  char path[1024];           // the cached shared object
  char error[256];           // the first run-time error of the last cpu_step, or ""
} CpuModule;

// The compiler command (without input and output paths), part of the cache key: -march=native, or
// the x86-64 level in $MDL_MARCH.
const char *cpu_cc_flags(void);
// Whether $MDL_MARCH names a level this program knows and this CPU runs (or is unset), else why not.
bool cpu_march_ok(char *err, size_t n);
// Compiles `source` unless the cache ($MDL_CACHE, else ~/.cache/mdl) holds it already, then loads
// it. NULL with a message in err on failure.
CpuModule *cpu_load(const char *source, char *err, size_t n);
void cpu_unload(CpuModule *cm);
// Threads for the kernels' parallel loops and GEMMs (n >= 1; the default is OMP_NUM_THREADS, else
// the machine's cores). The GEMM library runs single-threaded in each of them.
void cpu_set_threads(CpuModule *cm, int n);
int cpu_default_threads(void); // OMP_NUM_THREADS, else the machine's cores
// Runs one training step on `arena` (cpu_arena_new). False with cm->error set when a kernel met a
// bad id or target.
bool cpu_step(CpuModule *cm, char *arena);
// Runs kernel i alone (for timing); same error contract as cpu_step.
bool cpu_run_kernel(CpuModule *cm, int i, char *arena);

// A zeroed, page-aligned arena of m->arena_bytes (NULL when the memory cannot be had); its pages
// take memory when first written. cpu_arena_free() it.
char *cpu_arena_new(const MemPlan *m);
void cpu_arena_free(const MemPlan *m, char *arena);
// The whole pages of arena bytes [off, off + bytes) back to the system: zeros when next read.
void cpu_arena_drop(char *arena, int64_t off, int64_t bytes);
// Where node `node` lives in the arena (f32 or i32 elements), or NULL when it is not materialised.
void *cpu_value(const MemPlan *m, char *arena, int node);
// y[i] = x[i] rounded to bf16 (nearest, ties to even), as the kernels' casts round.
void cpu_bf16_from_f32(const float *x, uint16_t *y, int64_t n);
// The bf16 copy of PARAM node `param` (MemPlan.copy_of) rounded from its f32 values in the arena; nothing
// when it has none. Whoever writes a parameter calls it (the functions below do).
void cpu_round_copy(const Graph *g, const MemPlan *m, char *arena, int param);
// Parameters initialised exactly as interp_init_params does, with their copies.
void cpu_init_params(const Graph *g, const MemPlan *m, char *arena, uint64_t seed);
void cpu_init_param(const Graph *g, const MemPlan *m, char *arena, uint64_t seed, int k); // g->params[k] alone
void cpu_draw_param(const Graph *g, uint64_t seed, int k, float *x); // its values into x, no copy
// Parameters and AdamW moments between the interpreter and the arena (rounded to float on the way in;
// the copies follow).
void cpu_params_from_interp(const Graph *g, const MemPlan *m, char *arena, Interp *it);
void cpu_params_to_interp(const Graph *g, const MemPlan *m, const char *arena, Interp *it);
// Sets every INPUT named `name` (ids for i32 inputs, f for f32 ones); false when none matches or the
// count or kind is wrong.
bool cpu_set_input(const Graph *g, const MemPlan *m, char *arena, const char *name, const int32_t *ids,
                   const float *f, int64_t n);
// Sets every SCALAR named `name` ("lr", "step").
void cpu_set_scalar(const Graph *g, const MemPlan *m, char *arena, const char *name, double v);
#endif
