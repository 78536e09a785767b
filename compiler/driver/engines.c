// engines.c: the engine choice. What depends on the machine is decided here before the pipeline runs
// (the back end, what `auto` precision is, the memory a checkpoint budget is measured against, the
// GPU's compute capability: pipeline_options), and what the pipeline compiled is handed to its
// engine: the reference interpreter, the C module (cc + dlopen) or the CUDA plan.
#include "backend.h"
#include "cuda.h"
#include "driver.h"
#include "emit_cuda.h"
#include "runtime.h"

#include <string.h>

// What `auto` precision is: bf16 (a GPU's tensor cores, and the numerics every back end reproduces),
// except for training or gradients on the CPU back end where the GEMM library has no bf16 GEMM of the
// CPU's own (AVX-512 BF16 or AMX; see runtime/engine/gemm.c), which run fp32. `why` says which.
const char *auto_precision(const Options *o, const char **why) {
  static const char *chosen, *reason;
  if (!chosen) {
    bool executes = !strcmp(o->verb, "run") || !strcmp(o->verb, "grad") || !strcmp(o->verb, "eval");
    const char *backend = executes ? backend_of(o) : "none";
    char err[256];
    const GemmLib *lib = strcmp(backend, "cuda") && strcmp(backend, "none") ? rt_gemm(err, sizeof err) : NULL;
    static char buf[200];
    chosen = lib && !lib->bgemm ? "fp32" : "bf16";
    if (lib)
      snprintf(buf, sizeof buf, lib->bgemm ? "bf16: %s has bf16 GEMM kernels for this CPU (%s), faster than its fp32 ones"
                                           : "fp32: %s has no bf16 GEMM kernels for this CPU (its %s ones widen bf16)",
               lib->name, lib->kernels);
    reason = !executes ? "bf16 where nothing runs" : !strcmp(backend, "cuda") ? "bf16 on a GPU"
             : !lib ? "bf16 (no GEMM library to ask)" : buf;
  }
  if (why)
    *why = reason;
  return chosen;
}

// The memory a checkpoint budget is measured against: the device's free memory on a GPU, else the
// host's available memory; -1 when unknown. `what` says which.
int64_t memory_there(const Options *o, const char **what) {
  static int64_t bytes = -2;
  static const char *said;
  if (bytes == -2) {
    CudaDevice d;
    char why[256];
    if (!strcmp(backend_of(o), "cuda") && cuda_device(&d, why, sizeof why)) {
      bytes = cuda_free_memory(&d);
      said = "free on the GPU";
      if (bytes > 0) // (the engine's own: cuBLASLt's workspace, the modules, the graph)
        bytes -= bytes / 20;
    } else {
      static char buf[128];
      bytes = rt_host_memory_available(&said);
      snprintf(buf, sizeof buf, "available (%s)", said);
      said = buf;
    }
  }
  *what = said;
  return bytes;
}

// The pipeline's options for o: the model, the passes asked for, and what depends on the machine,
// decided here before the pipeline runs: what `auto` precision is, the memory auto's checkpoint
// budget is measured against (where the command line leaves the policy open), and the GPU a step runs
// on with its compute capability.
PipelineOptions pipeline_options(const Options *o, GraphKind kind, Target target) {
  PipelineOptions po = {.file = o->file, .text = o->text, .dims = o->dims, .ndims = o->ndims, .lower = &o->lower,
                        .accumulate = o->accumulate, .kind = kind, .precision = o->precision,
                        .checkpoint = o->checkpoint, .memory = -1, .fuse = o->fuse, .reuse = o->reuse,
                        .dump = o->dump, .target = target};
  // The C module and build's files name the .mdl file; the CUDA engine's module its model (as the
  // cubins in the cache were compiled).
  po.module_name = target == TARGET_CUDA ? NULL : o->file;
  if (!o->precision || !strcmp(o->precision, "auto"))
    po.auto_precision = auto_precision(o, NULL);
  bool emits = strcmp(o->verb, "check") && strcmp(o->verb, "sample");
  bool executes = !strcmp(o->verb, "run") || !strcmp(o->verb, "grad") || !strcmp(o->verb, "eval");
  bool cuda = executes && !strcmp(backend_of(o), "cuda");
  static CudaDevice d;
  static int found; // 0: not asked, 1: there, -1: not
  char why[256];
  if (cuda && !found)
    found = cuda_device(&d, why, sizeof why) ? 1 : -1;
  if (cuda && found > 0) {
    po.gpu = d.name;
    po.compute_capability = cuda_compute_capability(&d);
  }
  po.fp8_emulated_note = emits && !o->quiet && !cuda;
  if ((kind == GRAPH_GRADS || kind == GRAPH_TRAIN) && (!o->checkpoint || !strncmp(o->checkpoint, "auto", 4)))
    po.memory = memory_there(o, &po.memory_what);
  return po;
}

// The pipeline's target for the back end o runs on.
Target target_of(const Options *o) {
  const char *backend = backend_of(o);
  return !strcmp(backend, "interp") ? TARGET_GRAPH : !strcmp(backend, "cuda") ? TARGET_CUDA : TARGET_C;
}

// The back end --backend names; "auto" is CUDA when a driver, a device and NVRTC are there, else
// the CPU (saying why in one line, once, unless --quiet).
const char *backend_of(const Options *o) {
  static const char *chosen;
  if (strcmp(o->backend, "auto"))
    return o->backend;
  if (!chosen) {
    char why[256];
    chosen = cuda_available(why, sizeof why) ? "cuda" : "cpu";
    if (!strcmp(chosen, "cpu") && !o->quiet)
      fprintf(stderr, "mdlc: %s; using the CPU back end\n", why);
  }
  return chosen;
}

// The dense bf16 peak of the GPU MFU is measured against (cuda_bf16_peak).
static void gpu_peak(const CudaDevice *d, Engine *e) {
  char how[160];
  e->peak_flops = cuda_bf16_peak(d, how, sizeof how);
  e->peak_how = arena_strdup(e->g->arena, how);
}

// The GEMM library the CPU back end runs, its kernels and what a short probe measured; a warning
// when its kernels are a fallback older than the CPU (--quiet: the warning alone).
static void gemm_report(const GemmLib *lib, bool quiet) {
  rt_gemm_probe();
  if (!quiet) {
    printf("GEMM: %s, %s kernels%s: %.0f GFLOP/s fp32", lib->name, lib->kernels, lib->how, lib->sgemm_gflops);
    if (lib->bgemm)
      printf(", %.0f GFLOP/s bf16", lib->bgemm_gflops);
    printf(" (a 256x768x768 product split over the cores)\n");
  }
  if (lib->generic)
    fprintf(stderr, "mdlc: warning: %s runs its generic %s kernels on a CPU with AVX2 or later: GEMMs at a fraction "
            "of their speed (install oneDNN, Debian's libdnnl2, or name the CPU's family in OPENBLAS_CORETYPE)\n",
            lib->name, lib->kernels);
}

// The CPU back end's arenas must fit in the memory the machine has left, checked before anything is
// compiled or allocated: an arena is mapped without being touched, so one larger than the memory
// would be granted and the run killed once its steps reached its pages. `planned` adds up the arenas
// of the engines one run opens (training, validation, micro-batches).
static bool host_memory_fits(const Options *o, const Graph *g, int64_t arena_bytes) {
  static int64_t planned;
  const char *what;
  int64_t avail = rt_host_memory_available(&what);
  planned += arena_bytes;
  if (avail < 0 || planned <= avail)
    return true;
  diag_file_error(o->file, "%s does not fit in memory: its arenas need %.2f GB (this one %.2f GB for %lld parameters), "
                  "this machine has %.2f GB available (%s)", g->model ? g->model : "the model", (double)planned / 1e9,
                  (double)arena_bytes / 1e9, (long long)ir_param_count(g), (double)avail / 1e9, what);
  return false;
}

// The engine for what the pipeline compiled for o's back end (target_of): the interpreter, the C
// module or the CUDA plan. With `report`, one line on what was compiled.
Engine *open_engine(const Options *o, const Compilation *c, bool report) {
  const char *backend = backend_of(o);
  Graph *g = c->g;
  if (!strcmp(backend, "interp"))
    return engine_interp(g, o->fp64 ? INTERP_F64 : INTERP_F32, o->seed);
  char err[512];
  if (!strcmp(backend, "cuda")) {
    Engine *e = engine_cuda(c->f, c->m, c->cuda, o->seed, o->gemm_tuning, o->kernel_tuning, err, sizeof err);
    CudaDevice d;
    if (!e)
      diag_file_error(o->file, "%s", err);
    else if (cuda_device(&d, err, sizeof err))
      gpu_peak(&d, e);
    return e;
  }
  if (!host_memory_fits(o, g, c->m->arena_bytes))
    return NULL;
  Engine *e = engine_cpu(c->f, c->m, c->c_source, o->seed, err, sizeof err);
  if (!e)
    diag_file_error(o->file, "%s", err);
  if (e && report) { // and MFU against the peak of what the GEMMs run on: AMX's where they are bf16 there
    const GemmLib *lib = rt_gemm(err, sizeof err);
    gemm_report(lib, o->quiet);
    const char *how;
    e->peak_flops = rt_cpu_peak_flops(lib->bgemm && !strcmp(g->train.precision, "bf16") ? lib->kernels : NULL, &how);
    e->peak_how = arena_strdup(g->arena, how);
  }
  if (e && report && !o->quiet)
    printf("compiled %s for the CPU: %d kernels (fusion %s), arena %.1f MB (activations %.1f MB), %s\n", g->model,
           c->f->nsteps, o->fuse.fuse ? "on" : "off", (double)c->m->arena_bytes / 1e6,
           (double)c->m->activation_bytes / 1e6,
           e->cache_hit ? "module from the cache" : arena_printf(g->arena, "cc took %.2f s", e->compile_seconds));
  return e;
}

// The forward graph alone (validation loss, dropout off), or forward + backward without the
// optimizer (the micro-batches of gradient accumulation), on the same back end.
Engine *open_side_engine(const Options *o, Arena *a, bool grads) {
  Options quiet = *o;
  quiet.dump = NULL;
  PipelineOptions po = pipeline_options(&quiet, grads ? GRAPH_GRADS : GRAPH_EVAL, target_of(o));
  po.accumulate = 0; // (the step's own setting: the side graphs run one batch each)
  Compilation c;
  return pipeline(a, &po, &c) ? open_engine(&quiet, &c, false) : NULL;
}
