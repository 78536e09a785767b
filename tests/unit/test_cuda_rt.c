// test_cuda_rt.c: the CUDA runtime (runtime/engine/cuda.c) on a machine with or without a GPU.
//   - Without a driver: cuda_probe, cuda_available and engine_cuda all fail with "no CUDA driver
//     (libcuda.so.1 not found)" (checked only when dlopen itself cannot find libcuda.so.1).
//   - Fake drivers, small shared objects compiled here and named by $MDL_LIBCUDA: they test the
//     loader without a GPU. Entry points resolved through cuGetProcAddress (the four- and the
//     five-argument forms; the fakes refuse any ABI version but 12.0) or, when a driver has none,
//     through dlsym of the versioned names; "no CUDA device" from a count of 0 or from cuInit; the
//     compute capability becomes "sm_XY"; a stub driver, a file that is not a library and a driver
//     lacking the engine's entry points each give their one-line message.
//   - An emulated GPU (when g++ is there): the first half of this file, compiled as C++ with an
//     emitted module and tests/unit/cuda_emu.h into one shared object that is both the driver and
//     cuBLASLt. It keeps "device" memory on the host, runs the emitted kernels on CPU fibers, records
//     stream captures and replays them as graphs, and computes GEMMs by cuBLASLt's documented
//     column-major rules (transposes, leading dimensions, strided batches, bias and GELU epilogues
//     with their aux output, f32 or bf16 A and B, f32 or bf16 D; fp8 A and B by the FP8 rules of
//     Hopper: E4M3 or E5M2, not both E5M2, "TN" only, leading dimensions multiples of 16, no epilogue,
//     the codes decoded by runtime/kernels/fp8_bits.h and the f32 sums times the A and B scales read
//     through their pointers when the GEMM runs; any other fp8 GEMM the heuristic refuses with
//     CUBLAS_STATUS_NOT_SUPPORTED, as the library does) independently of how cuda.c maps our
//     row-major GEMMs onto them, and counts the element types each GEMM is described with. Its
//     heuristic offers three candidates per GEMM, the first made slower than the others: the engine,
//     which times them when it is built for one GEMM of each kind (gpt2-tiny's two layers repeat
//     theirs), must replay none of its GEMMs on that one. Its events read a
//     device clock that each operation advances (a slow one more), so timings do not depend on the
//     host's load. Like the emulated modules of test_cuda_emit, it is compiled with UBSan's alignment
//     and bounds checks, fatal: a vector access off its alignment stops the step as a GPU would fault.
//     Kernel variants (attention's two block sizes, gpt2-tiny bf16): with the plan's
//     kernels made slow the engine replays the variants, with the variants slow the plan's own; with
//     kernel tuning off, or a variant that fails to launch, the plan's own.
//     The module is compiled as three programs ($MDL_NVRTC_THREADS), a cubin each, and the fake's
//     module of a cubin holds only the kernels its symbol table defines (cubin_syms.h): every kernel
//     must be looked up in its own. engine_cuda then trains on the CPU: it starts from exactly the
//     interpreter's parameters;
//     after one step the loss and every gradient agree with the interpreter within 1e-5
//     (max |cuda - interp| / max |interp| per tensor), and the parameters after 4 steps within 5e-4
//     in L2 per tensor (AdamW's first steps, as in test_cpu.c); the graph is captured once and
//     replayed once per step, every launch of the plan running in it; cuBLASLt is told each GEMM's
//     element types as the plan has them; a target out of range ends the step with the kernels'
//     message and the next good step runs; a parameter written through the Engine reads back; the
//     initial parameters are drawn when first needed, never over ones written or taken before
//     (draw_checks.h), and an engine given all of another's by take_params sends none of its own up;
//     a snapshot of the parameters and moments (Engine.snapshot: three device copies, its memory
//     counted), read on another thread while two more steps run and after them, holds their values
//     at the snapshot bit for bit, a node that is neither is refused, and with the device too full
//     for it snapshot declines, allocating nothing; train_run (4 steps, a checkpoint every 2) takes
//     each checkpoint by a snapshot and its last holds the engine's parameters and moments;
//     freeing the engine frees every allocation and the module; an allocation that fails is
//     reported as "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY" and leaks nothing; with --profile a fresh
//     engine runs the plan launch by launch (no replay) to the graph's loss and gradients bit for
//     bit, every plan step that launches gets a time from the events, and the events are freed. Both
//     engines are given each step's seed (Engine.set_seed). Models: gpt2-tiny (B=2, T=16), a small
//     model with dropout (its masks must follow the seed of each step through the one captured
//     graph), and a small model of batched matmuls, one broadcasting its batch, the last and
//     gpt2-tiny also with bf16
//     GEMM operands (the precision pass): every GEMM is then described with CUDA_R_16BF A and B, the
//     batched model's a @ a^T also with a bf16 D; the gradients agree within 4e-3 in L2 per tensor,
//     the parameters after 4 steps within 4e-3, and the bf16 CASTs of the parameters read back
//     through the Engine as the interpreter's, bit for bit. Precision fp8 (fp8_checks): gpt2-tiny
//     (B=2, T=16) on the graphs' engine, a --profile engine and the interpreter, 3 steps from the same
//     parameters and batches: the scales (Engine.fp8) are the interpreter's bit for bit after the first
//     step (its calibration included) and after each of the others, the losses within 1e-5 relative,
//     the gradients after the first step within 1e-4 in L2, the profiled engine the graphs' bit for
//     bit; every fp8 GEMM of the plan is described with fp8 A and B (so TN) and none refused; a weight
//     made infinite through Engine.write skips the step (every parameter unchanged, the histories not
//     rolled, the tensor named); train_run's checkpoints (snapshots) hold the fp8 state of their step,
//     and a run resumed at step 4 reaches step 6 with the scales and histories of a run of 6. The
//     hooks that share the scales (Engine.set_fp8_amax, set_fp8_lead), as test_fp8_cpu's test_share
//     checks the CPU engines': the amax hook runs after the first step's calibration and after each
//     step's first part, an amax it raises is the one rolled and scaled by, a NaN one skips the step
//     (parameters and histories as they were); a led gradients-only engine casts with the given
//     scales, neither calibrates nor rolls a history, and its amaxes are within 1e-4 of the
//     interpreter's led engine's, its loss within 1e-5; train_run with accumulate 2 at B=1 (the step
//     and micro-batches' engines, two plans, in one emulated GPU: the fake takes the second plan's
//     kernels from an object built from this file with MDL_FAKE_KERNELS_ONLY, named by
//     $FAKE_SECOND_MODULE while that engine loads its cubins) scales as a run at B=2: the E4M3 scales
//     equal, the E5M2 ones exactly 2 times smaller, the histories within 1e-5 of those amaxes (the
//     calibration's within 5%). Several ranks (NCCL) are not emulated: no test fakes NCCL.
//   - With a real driver and device: the no-driver checks are skipped, and gpt2-tiny (B=2, T=16) runs
//     one step on the GPU and on the interpreter from the same parameters and batch: the loss and
//     every gradient agree within 1e-4 relative; with bf16 GEMM operands, within 4e-3 in L2; on sm_89
//     or later in fp8 (cuBLASLt's FP8 GEMMs), within 4e-3 in L2 too.
#include <stdbool.h>
#include <string.h>

// (both halves) Is `name` one of the comma-separated names of `list`?
static bool in_list(const char *list, const char *name) {
  size_t n = strlen(name);
  for (const char *p = list; *p;) {
    size_t len = strcspn(p, ",");
    if (len == n && !strncmp(p, name, n))
      return true;
    p += len + (p[len] == ',');
  }
  return false;
}

#ifdef MDL_FAKE_GPU
// The emulated GPU: this half of the file is C++, compiled by the test (g++ -DMDL_FAKE_GPU -include
// tests/unit/cuda_emu.h) with an emitted module (MDL_MODULE) and the list of its kernels (MDL_KERNELS,
// lines "K(name)") into a shared object that is both libcuda.so.1 and libcublasLt.so for engine_cuda.
// Device memory is host memory; every call runs at once except on a capturing stream, where kernel
// launches, memsets and GEMMs are recorded into the graph that cuGraphLaunch replays. It exports no
// cuGetProcAddress, so the runtime finds its entry points under their versioned names.
#include <dlfcn.h>
#include <utility>
#include <vector>

#include "cubin_syms.h"

#include MDL_MODULE

// The host's fp8 conversions, bit for bit NVIDIA's (apart from the module's device ones of the same names).
namespace host {
#include "../../runtime/kernels/fp8_bits.h"
}

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

// cuBLASLt's descriptors (column-major matrices).
struct Layout {
  int type;
  uint64_t rows, cols;
  int64_t ld, stride;
  int32_t batch;
};
struct Desc {
  int32_t transa, transb;
  uint32_t epilogue;
  void *bias, *aux;
  int64_t aux_ld, aux_stride;
  const float *a_scale, *b_scale; // fp8: read when the GEMM runs (NULL: 1)
};
struct Gemm {
  Desc d;
  Layout a, b, c;
  int algo; // the candidate of the heuristic's list it runs with (0: the first)
  float alpha, beta;
  const void *pa, *pb, *pcin; // pcin: C, read for the beta term (D itself when in place)
  void *pc;                    // D
};

// A recorded operation: a kernel launch, a memset or a GEMM.
struct Rec {
  int kind; // 0 kernel, 1 memset, 2 GEMM
  int kernel;
  dim3 grid, block;
  alignas(16) unsigned char args[5][512];
  void *dst;
  size_t bytes;
  Gemm gemm;
};

// A kernel's parameters, copied into the record at launch (cuLaunchKernel's params: one pointer a
// parameter) and passed back when it runs: the plan's kernels (arena, status, seed, chunk, args) and
// the prelude's mdl_accumulate (y, x, n) alike.
template <class... P> void store(void (*)(P...), void **p, Rec *r) {
  static_assert(sizeof...(P) <= sizeof r->args / sizeof *r->args, "too many kernel parameters");
  static_assert(((sizeof(P) <= sizeof *r->args) && ...), "a kernel argument too large");
  size_t i = 0;
  ((memcpy(r->args[i], p[i], sizeof(P)), i++), ...);
}

template <class T> T arg(const unsigned char *at) {
  T v;
  memcpy(&v, at, sizeof v);
  return v;
}

template <class... P, size_t... I> void call(void (*f)(P...), const Rec *r, std::index_sequence<I...>) {
  f(arg<P>(r->args[I])...);
}

template <class... P> void call(void (*f)(P...), const Rec *r) { call(f, r, std::index_sequence_for<P...>{}); }

struct Kernel {
  const char *name;
  void (*store)(void **, Rec *);
  void (*call)(const Rec *);
};

static const Kernel kernels[] = {
#define K(name) {#name, [](void **p, Rec *r) { store(name, p, r); }, [](const Rec *r) { call(name, r); }},
#include MDL_KERNELS
#undef K
};

#ifdef MDL_FAKE_KERNELS_ONLY
// A second plan's kernels alone (fake_second below): their names, their arguments' store, and a launch
// run by this object's own emulator, whose thread-locals they read.
extern "C" {
size_t fake_kernel_count(void) { return sizeof kernels / sizeof *kernels; }
const char *fake_kernel_name(size_t k) { return kernels[k].name; }
void fake_kernel_store(size_t k, void **p, Rec *r) { kernels[k].store(p, r); }
void fake_kernel_run(size_t k, const Rec *r) {
  struct At {
    size_t k;
    const Rec *r;
  } at = {k, r};
  mdl_emu::run(r->grid, r->block, [](void *ctx) { const At *a = (const At *)ctx; kernels[a->k].call(a->r); },
               (void *)&at);
}
}
#else
// A second plan's kernels beside this one's, for two engines of different plans at once (gradient
// accumulation's micro-batches' engine beside the step's): another shared object built from this
// file with MDL_FAKE_KERNELS_ONLY and that plan's module, opened when a cubin is loaded while
// $FAKE_SECOND_MODULE names it; that cubin's kernels are then its kernels, numbered after this
// object's (the two modules' kernels share names, not bodies: their plans place memory apart).
struct Second {
  void *so;
  size_t n;
  const char *(*name)(size_t);
  void (*store)(size_t, void **, Rec *);
  void (*run)(size_t, const Rec *);
};
static Second second;
static const size_t nfirst = sizeof kernels / sizeof *kernels;

static bool open_second(const char *path) {
  if (second.so)
    return true;
  void *so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  size_t (*count)(void) = so ? (size_t (*)(void))dlsym(so, "fake_kernel_count") : NULL;
  if (!count)
    return false;
  second = {so, count(), (const char *(*)(size_t))dlsym(so, "fake_kernel_name"),
            (void (*)(size_t, void **, Rec *))dlsym(so, "fake_kernel_store"),
            (void (*)(size_t, const Rec *))dlsym(so, "fake_kernel_run")};
  return true;
}

static size_t kernel_count(void) { return nfirst + second.n; }
static const char *kernel_name(size_t k) { return k < nfirst ? kernels[k].name : second.name(k - nfirst); }
static void kernel_store(size_t k, void **p, Rec *r) {
  if (k < nfirst)
    kernels[k].store(p, r);
  else
    second.store(k - nfirst, p, r);
}

struct Stream {
  bool capturing;
  std::vector<Rec> *graph;
};

// What the test reads back (fake_counters); `described`: GEMMs the heuristic accepted, of which
// ab16 with bf16 A and B, d16 with a bf16 D, f8 with fp8 A and B (and TN: the only fp8 it accepts),
// e5m2 of those with an E5M2 operand; f8_refused: fp8 GEMMs the heuristic refused; direct_gemms:
// GEMMs run at once (not replayed), of gemms in all; slow_replayed: replayed GEMMs on the heuristic's
// first candidate, which the fake makes slower than the others; slow_kernels_replayed: replayed
// launches of the kernels named in $FAKE_SLOW_KERNELS, which the fake makes slower when they run at
// once (those in $FAKE_FAILING_KERNELS fail to launch then, as for want of registers).
struct Counters {
  long captures, replays, kernels, gemms, live_allocations, modules;
  long described, ab16, d16;
  long events; // live
  long direct_gemms, slow_replayed;
  long device_copies; // cuMemcpyDtoDAsync calls
  long slow_kernels_replayed;
  long direct_kernels; // kernel launches run at once (not replayed), of `kernels` in all
  long uploads;        // cuMemcpyHtoDAsync calls
  long f8, e5m2, f8_refused;
};
static Counters counters;
static size_t used;

static void run_kernel(const Rec *r) {
  if ((size_t)r->kernel >= nfirst)
    second.run((size_t)r->kernel - nfirst, r);
  else
    mdl_emu::run(r->grid, r->block, [](void *ctx) { const Rec *q = (const Rec *)ctx; kernels[q->kernel].call(q); },
                 (void *)r);
  counters.kernels++;
}

static void run_gemm(const Gemm *q);

// The device's clock, which events read: every operation takes a microsecond of it, and the slow
// ones (a GEMM's first candidate, the kernels of $FAKE_SLOW_KERNELS, when run at once) more. Timings
// are then the same on a busy machine as on an idle one, and cost no real time.
static double device_seconds;

static void run(const Rec *r) {
  device_seconds += 1e-6;
  if (r->kind == 0)
    run_kernel(r);
  else if (r->kind == 1)
    memset(r->dst, 0, r->bytes);
  else
    run_gemm(&r->gemm);
}

extern "C" {
const Counters *fake_counters(void) { return &counters; }

CUresult cuInit(unsigned) { return 0; }
CUresult cuDriverGetVersion(int *v) {
  *v = 12080;
  return 0;
}
CUresult cuGetErrorName(CUresult r, const char **s) {
  *s = r == 2     ? "CUDA_ERROR_OUT_OF_MEMORY"
       : r == 200 ? "CUDA_ERROR_INVALID_IMAGE"
       : r == 500 ? "CUDA_ERROR_NOT_FOUND"
                  : "CUDA_ERROR_INVALID_VALUE";
  return 0;
}
CUresult cuDeviceGetCount(int *n) {
  *n = 1;
  return 0;
}
CUresult cuDeviceGet(int *d, int i) {
  *d = i;
  return 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int) {
  *v = attr == 75 ? 9 : attr == 76 ? 0 : attr == 16 ? 1 : 0;
  return 0;
}
CUresult cuDeviceGetName(char *s, int n, int) {
  snprintf(s, (size_t)n, "Emulated GPU");
  return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *b, int) {
  *b = (size_t)1 << 32;
  return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int) {
  *ctx = &counters;
  return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int) { return 0; }
CUresult cuCtxSetCurrent(void *) { return 0; }

// A module is accepted when it is an ELF image (a cubin); its kernels are those compiled in here (or,
// with $FAKE_SECOND_MODULE, in the second plan's object) that the cubin defines (a module compiled as
// several programs has some of them in each cubin).
struct Module {
  std::vector<bool> has; // per kernel, this object's then the second's
};
CUresult cuModuleLoadData(void **mod, const void *image) {
  const char *path = getenv("FAKE_SECOND_MODULE");
  if (memcmp(image, "\177ELF", 4) || (path && !open_second(path)))
    return 200;
  Module *m = new Module;
  for (size_t i = 0; i < kernel_count(); i++)
    m->has.push_back((i >= nfirst) == (path != NULL) && cubin_has_function(image, kernel_name(i)));
  counters.modules++;
  *mod = m;
  return 0;
}
CUresult cuModuleUnload(void *mod) {
  delete (Module *)mod;
  counters.modules--;
  return 0;
}
CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) {
  for (size_t i = 0; i < ((Module *)mod)->has.size(); i++)
    if (((Module *)mod)->has[i] && !strcmp(kernel_name(i), name)) {
      *fn = (void *)(i + 1);
      return 0;
    }
  return 500;
}
// The module's globals: the prelude's mdl_own (--zero 1's share), one for every module compiled in here.
CUresult cuModuleGetGlobal_v2(CUdeviceptr *p, size_t *bytes, void *mod, const char *name) {
  (void)mod;
  if (strcmp(name, "mdl_own"))
    return 500;
  *p = (CUdeviceptr)(uintptr_t)mdl_own;
  if (bytes)
    *bytes = sizeof mdl_own;
  return 0;
}

// Allocations above $FAKE_GPU_MEMORY bytes in all fail as out of memory.
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
  const char *cap = getenv("FAKE_GPU_MEMORY");
  if (cap && used + bytes > strtoull(cap, NULL, 10))
    return 2;
  size_t *b = (size_t *)aligned_alloc(256, 256 + (bytes + 255) / 256 * 256);
  if (!b)
    return 2;
  *b = bytes;
  used += bytes;
  counters.live_allocations++;
  *p = (CUdeviceptr)(uintptr_t)((char *)b + 256);
  return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  size_t *b = (size_t *)((char *)(uintptr_t)p - 256);
  used -= *b;
  counters.live_allocations--;
  free(b);
  return 0;
}
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
  *total = (size_t)1 << 32;
  *free_bytes = *total - used;
  return 0;
}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, Stream *s) {
  if (v)
    return 1;
  Rec r = {};
  r.kind = 1;
  r.dst = (void *)(uintptr_t)p;
  r.bytes = n;
  if (s->capturing)
    s->graph->push_back(r);
  else
    run(&r);
  return 0;
}
// Copies are not recorded: on a capturing stream they are an error here.
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, Stream *s) {
  if (s->capturing)
    return 1;
  memcpy((void *)(uintptr_t)dst, src, n);
  counters.uploads++;
  return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, Stream *s) {
  if (s->capturing)
    return 1;
  memcpy(dst, (const void *)(uintptr_t)src, n);
  return 0;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, Stream *s) {
  if (s->capturing)
    return 1;
  memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  counters.device_copies++;
  return 0;
}
CUresult cuStreamCreate(Stream **s, unsigned) {
  *s = new Stream{false, NULL};
  return 0;
}
CUresult cuStreamDestroy_v2(Stream *s) {
  delete s;
  return 0;
}
CUresult cuStreamSynchronize(Stream *s) { return s->capturing ? 1 : 0; }
// Is kernel `name` in the list of environment variable `var` (names separated by commas)?
static bool listed(const char *var, const char *name) { return getenv(var) && in_list(getenv(var), name); }
CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, Stream *s, void **params, void **extra) {
  size_t k = (size_t)fn - 1;
  if (k >= kernel_count() || !gx || !gy || !gz || !bx || !by || !bz || bx * by * bz > 1024 ||
      shared || extra)
    return 1;
  Rec r = {};
  r.kind = 0;
  r.kernel = (int)k;
  r.grid = dim3{gx, gy, gz};
  r.block = dim3{bx, by, bz};
  if (!s->capturing && listed("FAKE_FAILING_KERNELS", kernel_name(k)))
    return 701; // CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
  kernel_store(k, params, &r);
  if (s->capturing) {
    s->graph->push_back(r);
  } else {
    if (listed("FAKE_SLOW_KERNELS", kernel_name(k)))
      device_seconds += 1e-3;
    run(&r);
    counters.direct_kernels++;
  }
  return 0;
}
CUresult cuStreamBeginCapture_v2(Stream *s, int) {
  if (s->capturing)
    return 1;
  s->capturing = true;
  s->graph = new std::vector<Rec>;
  counters.captures++;
  return 0;
}
CUresult cuStreamEndCapture(Stream *s, std::vector<Rec> **graph) {
  if (!s->capturing)
    return 1;
  s->capturing = false;
  *graph = s->graph;
  return 0;
}
CUresult cuGraphInstantiateWithFlags(std::vector<Rec> **exec, std::vector<Rec> *graph, unsigned long long) {
  *exec = new std::vector<Rec>(*graph);
  return 0;
}
CUresult cuGraphLaunch(std::vector<Rec> *exec, Stream *s) {
  if (s->capturing)
    return 1;
  for (const Rec &r : *exec) {
    run(&r);
    counters.slow_replayed += r.kind == 2 && r.gemm.algo == 0;
    counters.slow_kernels_replayed += r.kind == 0 && listed("FAKE_SLOW_KERNELS", kernel_name((size_t)r.kernel));
  }
  counters.replays++;
  return 0;
}
CUresult cuGraphExecDestroy(std::vector<Rec> *exec) {
  delete exec;
  return 0;
}
CUresult cuGraphDestroy(std::vector<Rec> *graph) {
  delete graph;
  return 0;
}
// Events hold the device's clock when they were recorded (everything before them has run by then).
struct Event {
  double seconds;
};
CUresult cuEventCreate(Event **ev, unsigned) {
  *ev = new Event{-1};
  counters.events++;
  return 0;
}
CUresult cuEventRecord(Event *ev, Stream *s) {
  if (s->capturing)
    return 1;
  ev->seconds = device_seconds;
  return 0;
}
CUresult cuEventSynchronize(Event *ev) { return ev->seconds < 0; }
CUresult cuEventElapsedTime(float *ms, Event *a, Event *b) {
  if (a->seconds < 0 || b->seconds < 0)
    return 1;
  *ms = (float)(1e3 * (b->seconds - a->seconds));
  return 0;
}
CUresult cuEventDestroy_v2(Event *ev) {
  delete ev;
  counters.events--;
  return 0;
}
} // extern "C"

//
// cuBLASLt, by its documented rules: column-major matrices, D = act(alpha op(A) op(B) + beta C + bias)
// with the bias along D's rows and act's input kept in aux when asked; strided batches (the bias and
// aux batch strides default to 0). Elements are CUDA_R_32F (0) or CUDA_R_16BF (14): A and B of one
// type, products summed in f32, D stored as its type (bf16: to nearest, ties to even). The bias and
// aux take D's type unless set otherwise, and this fake knows them in f32 only: with a bf16 D there
// is neither. FP8 (CUDA_R_8F_E4M3 = 28, CUDA_R_8F_E5M2 = 29), as cuBLASLt documents it for Hopper: A
// and B both fp8, not both E5M2, A transposed and B not ("TN"), their leading dimensions multiples of
// 16 elements, no epilogue (this fake's bias would be f32, which FP8 GEMMs do not take); D f32 or
// bf16; D = (the f32 sum of the products of the decoded codes) * A's scale * B's scale, the scales
// read through their pointers when the GEMM runs. Anything else fp8 the heuristic refuses
// (CUBLAS_STATUS_NOT_SUPPORTED, no algorithm), as the library does.
//

enum { OK = 0, INVALID_VALUE = 7, NOT_SUPPORTED = 15, R_32F = 0, R_16BF = 14, R_8F_E4M3 = 28, R_8F_E5M2 = 29 };

static bool is_f8(int type) { return type == R_8F_E4M3 || type == R_8F_E5M2; }

static float gelu(float x) { return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x))); }

static float get_elem(const void *p, int type, int64_t i) {
  if (is_f8(type)) {
    uint8_t c = ((const uint8_t *)p)[i];
    return type == R_8F_E4M3 ? host::mdl_e4m3_to_f32(c) : host::mdl_e5m2_to_f32(c);
  }
  if (type == R_16BF) {
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    return __uint_as_float((unsigned)h << 16);
  }
  float f;
  memcpy(&f, (const char *)p + 4 * i, 4);
  return f;
}

static void put_elem(void *p, int type, int64_t i, float v) {
  if (type == R_16BF) {
    unsigned u = __float_as_uint(v);
    uint16_t h = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    memcpy((char *)p + 2 * i, &h, 2);
  } else {
    memcpy((char *)p + 4 * i, &v, 4);
  }
}

static void run_gemm(const Gemm *q) {
  uint64_t m = q->c.rows, n = q->c.cols, k = q->d.transa ? q->a.rows : q->a.cols;
  bool bias = q->d.epilogue & 4, act = q->d.epilogue & 32;
  for (int32_t t = 0; t < q->c.batch; t++) {
    int64_t oa = t * q->a.stride, ob = t * q->b.stride, oc = t * q->c.stride;
    for (uint64_t j = 0; j < n; j++)
      for (uint64_t i = 0; i < m; i++) {
        float acc = 0;
        for (uint64_t l = 0; l < k; l++)
          acc += get_elem(q->pa, q->a.type, oa + (int64_t)(q->d.transa ? l + i * q->a.ld : i + l * q->a.ld)) *
                 get_elem(q->pb, q->b.type, ob + (int64_t)(q->d.transb ? j + l * q->b.ld : l + j * q->b.ld));
        int64_t at = oc + (int64_t)(i + j * q->c.ld);
        if (is_f8(q->a.type))
          acc = acc * (q->d.a_scale ? *q->d.a_scale : 1.0f) * (q->d.b_scale ? *q->d.b_scale : 1.0f);
        float v = q->alpha * acc + (q->beta != 0 ? q->beta * get_elem(q->pcin, q->c.type, at) : 0.0f);
        if (bias)
          v += ((const float *)q->d.bias)[i];
        if (q->d.aux)
          ((float *)q->d.aux)[i + j * q->d.aux_ld + t * q->d.aux_stride] = v;
        put_elem(q->pc, q->c.type, at, act ? gelu(v) : v);
      }
  }
  counters.gemms++;
}

// The shapes agree, the types are ones this fake knows, the epilogue too.
static bool consistent(const Desc *d, const Layout *a, const Layout *b, const Layout *c) {
  uint64_t am = d->transa ? a->cols : a->rows, ak = d->transa ? a->rows : a->cols;
  uint64_t bk = d->transb ? b->cols : b->rows, bn = d->transb ? b->rows : b->cols;
  bool epi = d->epilogue == 1 || d->epilogue == 4 || d->epilogue == 32 || d->epilogue == 36 ||
             d->epilogue == 160 || d->epilogue == 164;
  bool types = (a->type == R_32F || a->type == R_16BF) && b->type == a->type &&
               (c->type == R_32F || (c->type == R_16BF && !d->bias && !d->aux));
  if (is_f8(a->type) || is_f8(b->type))
    types = is_f8(a->type) && is_f8(b->type) && !(a->type == R_8F_E5M2 && b->type == R_8F_E5M2) && d->transa == 1 &&
            d->transb == 0 && a->ld % 16 == 0 && b->ld % 16 == 0 && d->epilogue == 1 &&
            (c->type == R_32F || c->type == R_16BF);
  return am == c->rows && bn == c->cols && ak == bk && types && epi && a->ld >= (int64_t)a->rows &&
         b->ld >= (int64_t)b->rows && c->ld >= (int64_t)c->rows && a->batch == c->batch && b->batch == c->batch &&
         (d->bias != NULL) == ((d->epilogue & 4) != 0) && (d->aux != NULL) == ((d->epilogue & 128) != 0);
}

extern "C" {
int cublasLtCreate(void **h) {
  *h = &counters;
  return OK;
}
int cublasLtDestroy(void *) { return OK; }
const char *cublasLtGetStatusName(int s) {
  return s == INVALID_VALUE ? "CUBLAS_STATUS_INVALID_VALUE" : s == NOT_SUPPORTED ? "CUBLAS_STATUS_NOT_SUPPORTED" : "?";
}
size_t cublasLtGetVersion(void) { return 130000; }
int cublasLtMatmulDescCreate(Desc **d, int compute, int scale) {
  if (compute != 68 || scale != 0)
    return NOT_SUPPORTED;
  *d = new Desc{0, 0, 1, NULL, NULL, 0, 0, NULL, NULL};
  return OK;
}
int cublasLtMatmulDescSetAttribute(Desc *d, int attr, const void *v, size_t n) {
  switch (attr) {
  case 3: return n == 4 ? (memcpy(&d->transa, v, 4), OK) : INVALID_VALUE;
  case 4: return n == 4 ? (memcpy(&d->transb, v, 4), OK) : INVALID_VALUE;
  case 7: return n == 4 ? (memcpy(&d->epilogue, v, 4), OK) : INVALID_VALUE;
  case 8: return n == sizeof(void *) ? (memcpy(&d->bias, v, n), OK) : INVALID_VALUE;
  case 11: return n == sizeof(void *) ? (memcpy(&d->aux, v, n), OK) : INVALID_VALUE;
  case 12: return n == 8 ? (memcpy(&d->aux_ld, v, 8), OK) : INVALID_VALUE;
  case 13: return n == 8 ? (memcpy(&d->aux_stride, v, 8), OK) : INVALID_VALUE;
  case 17: return n == sizeof(void *) ? (memcpy(&d->a_scale, v, n), OK) : INVALID_VALUE;
  case 18: return n == sizeof(void *) ? (memcpy(&d->b_scale, v, n), OK) : INVALID_VALUE;
  case 26: return n == 4 && *(const int32_t *)v == 0 ? OK : INVALID_VALUE;
  default: return NOT_SUPPORTED;
  }
}
int cublasLtMatmulDescDestroy(Desc *d) {
  delete d;
  return OK;
}
int cublasLtMatrixLayoutCreate(Layout **l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
  *l = new Layout{type, rows, cols, ld, 0, 1};
  return OK;
}
int cublasLtMatrixLayoutSetAttribute(Layout *l, int attr, const void *v, size_t n) {
  if (attr == 5 && n == 4)
    memcpy(&l->batch, v, 4);
  else if (attr == 6 && n == 8)
    memcpy(&l->stride, v, 8);
  else
    return INVALID_VALUE;
  return OK;
}
int cublasLtMatrixLayoutDestroy(Layout *l) {
  delete l;
  return OK;
}
int cublasLtMatmulPreferenceCreate(uint64_t **p) {
  *p = new uint64_t(0);
  return OK;
}
int cublasLtMatmulPreferenceSetAttribute(uint64_t *p, int attr, const void *v, size_t n) {
  if (attr != 1 || n != 8)
    return INVALID_VALUE;
  memcpy(p, v, 8);
  return OK;
}
int cublasLtMatmulPreferenceDestroy(uint64_t *p) {
  delete p;
  return OK;
}
int cublasLtMatmulAlgoGetHeuristic(void *, Desc *d, Layout *a, Layout *b, Layout *c, Layout *dl, uint64_t *pref,
                                   int want, unsigned char *res, int *got) {
  *got = 0;
  if (want < 1 || !*pref || c != dl)
    return INVALID_VALUE;
  // Up to three candidates (cublasLtMatmulHeuristicResult_t: the algorithm's 64 bytes, then the
  // workspace size, the state and the waves, 96 bytes in all), their first byte their index.
  if (consistent(d, a, b, c)) {
    for (int i = 0; i < want && i < 3; i++) {
      memset(res + 96 * i, 0, 96);
      res[96 * i] = (unsigned char)i;
      *got = i + 1;
    }
    counters.described++;
    counters.ab16 += a->type == R_16BF;
    counters.d16 += c->type == R_16BF;
    counters.f8 += is_f8(a->type);
    counters.e5m2 += is_f8(a->type) && (a->type == R_8F_E5M2 || b->type == R_8F_E5M2);
  } else if (is_f8(a->type) || is_f8(b->type)) {
    counters.f8_refused++;
    return NOT_SUPPORTED;
  }
  return OK;
}
int cublasLtMatmul(void *, Desc *d, const float *alpha, const void *A, Layout *a, const void *B, Layout *b,
                   const float *beta, const void *C, Layout *c, void *D, Layout *dl, const void *algo, void *ws,
                   size_t wsn, Stream *s) {
  // C and D: one matrix (in place), or two of one layout (out of place; the documented rule is the
  // same type, rows, columns, batch and order; the engine passes one layout for both).
  if (!algo || !ws || !wsn || c != dl || !consistent(d, a, b, c))
    return INVALID_VALUE;
  Rec r = {};
  r.kind = 2;
  r.gemm = Gemm{*d, *a, *b, *c, *(const unsigned char *)algo, *alpha, *beta, A, B, C, D};
  if (s->capturing) {
    s->graph->push_back(r);
  } else {
    if (r.gemm.algo == 0) // the heuristic's first candidate is the slow one here
      device_seconds += 5e-6;
    run(&r);
    counters.direct_gemms++;
  }
  return OK;
}
} // extern "C"
#endif // MDL_FAKE_KERNELS_ONLY

#else
#include "mdl.h"
#include "backend.h"
#include "cuda.h"
#include "emit_cuda.h"
#include "fp8_state.h"
#include "runtime.h"
#include "test.h"
#include "draw_checks.h"
#include "data.h"

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char tmp[] = "/tmp/mdl_cuda_rt_XXXXXX";

static bool contains(const char *s, const char *what) { return strstr(s, what) != NULL; }

// The CUDA plan of a step plan, as mdlc's pipeline emits it for the engine.
static const CudaPlan *plan_for(const Fusion *f, const MemPlan *m) {
  return emit_cuda_plan(f, m, f->g->model ? f->g->model : "model");
}

static bool write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (!f)
    return false;
  bool ok = fputs(text, f) >= 0;
  return fclose(f) == 0 && ok;
}

// Compiles `src` into the shared object tmp/name.so with `cmd` (a compiler and its flags).
static bool build_so(const char *cmd, const char *src_name, const char *src, const char *name, char *so, size_t n) {
  char path[512], line[4096];
  snprintf(path, sizeof path, "%s/%s", tmp, src_name);
  snprintf(so, n, "%s/%s.so", tmp, name);
  if (!write_file(path, src))
    return false;
  snprintf(line, sizeof line, "%s -shared -fPIC -o %s %s 2>%s/%s.log", cmd, so, path, tmp, name);
  return system(line) == 0;
}

//
// The models the checks compile.
//
typedef struct {
  const char *label;
  const char *path, *text; // a model file, or its text
  DimOverride ov[2];
  int nov;
  DType prec;              // the GEMMs' operands: DT_F32, or DT_BF16 (the precision pass)
} Model;

static const char batched_src[] =
    "model batched\n"
    "dim B = 2\n"
    "dim T = 4\n"
    "dim C = 8\n"
    "input x: f32[B, T, C]\n"
    "input targets: i32[B, T]\n"
    "param w: [C, C] = normal(0.3)\n"
    "param b: [C] = zeros\n"
    "param head: [C, C] = normal(0.3)\n"
    "a = gelu(x @ w + b)\n"
    "s = a @ transpose(a, 1, 2)\n"
    "u = s @ a\n"
    "wa = w @ transpose(a, 1, 2)\n"
    "output loss = mean(cross_entropy(u @ head, targets)) + mean(wa * wa)\n";

// Dropout: its masks come from each step's seed (Engine.set_seed), which a graph captured once must
// still see change from step to step.
static const char dropout_src[] =
    "model dropped\n"
    "dim B = 2\n"
    "dim T = 4\n"
    "dim C = 16\n"
    "input x: f32[B, T, C]\n"
    "input targets: i32[B, T]\n"
    "param w: [C, C] = normal(0.3)\n"
    "param head: [C, C] = normal(0.3)\n"
    "h = dropout(gelu(x @ w), p=0.5)\n"
    "output loss = mean(cross_entropy(h @ head, targets))\n";

typedef struct {
  Arena *a;
  Graph *g;
  Fusion *f;
  MemPlan *m;
} Compiled;

static bool compile_model(const Model *md, Compiled *c) {
  c->a = arena_new();
  c->g = md->path ? mdl_compile_file(c->a, md->path, md->ov, md->nov)
                  : mdl_compile_text(c->a, md->label, md->text, md->ov, md->nov);
  char why[256];
  if (!c->g || !autodiff(c->g, true) || !precision_assign(c->g, md->prec, why, sizeof why))
    return false;
  c->f = fuse(c->g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
  c->m = memplan(c->f);
  return true;
}

//
// Fake drivers for the loader. Each variant is the same source compiled with other -D flags:
//   GPA      0: no cuGetProcAddress; 1: the four-argument cuGetProcAddress; 2: cuGetProcAddress_v2
//   COUNT    devices; INIT the result of cuInit; MAJOR, MINOR the compute capability
//
static const char fake_probe_src[] =
    "#include <string.h>\n"
    "typedef int CUresult;\n"
    "CUresult cuInit(unsigned flags) { (void)flags; return INIT; }\n"
    "CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }\n"
    "CUresult cuDeviceGetCount(int *n) { *n = COUNT; return 0; }\n"
    "CUresult cuDeviceGet(int *d, int i) { *d = i; return i < COUNT ? 0 : 101; }\n"
    "CUresult cuDeviceGetAttribute(int *v, int attr, int d) {\n"
    "  (void)d;\n"
    "  *v = attr == 75 ? MAJOR : attr == 76 ? MINOR : attr == 16 ? 7 : 0;\n"
    "  return 0;\n"
    "}\n"
    "CUresult cuDeviceGetName(char *s, int n, int d) { (void)d; strncpy(s, \"Fake GPU\", (size_t)n); return 0; }\n"
    "CUresult cuDeviceTotalMem_v2(unsigned long *b, int d) { (void)d; *b = 80ul << 30; return 0; }\n"
    "CUresult cuGetErrorName(CUresult r, const char **s) {\n"
    "  *s = r == 100 ? \"CUDA_ERROR_NO_DEVICE\" : r == 34 ? \"CUDA_ERROR_STUB_LIBRARY\" : \"CUDA_ERROR_UNKNOWN\";\n"
    "  return 0;\n"
    "}\n"
    "static void *lookup(const char *s, int version, unsigned long long flags) {\n"
    "  static const struct { const char *name; void *fn; } t[] = {\n"
    "    {\"cuInit\", (void *)cuInit}, {\"cuDriverGetVersion\", (void *)cuDriverGetVersion},\n"
    "    {\"cuDeviceGetCount\", (void *)cuDeviceGetCount}, {\"cuDeviceGet\", (void *)cuDeviceGet},\n"
    "    {\"cuDeviceGetAttribute\", (void *)cuDeviceGetAttribute}, {\"cuDeviceGetName\", (void *)cuDeviceGetName},\n"
    "    {\"cuDeviceTotalMem\", (void *)cuDeviceTotalMem_v2}, {\"cuGetErrorName\", (void *)cuGetErrorName}};\n"
    "  if (version != 12000 || flags != 0)\n"
    "    return 0;\n"
    "  for (unsigned i = 0; i < sizeof t / sizeof *t; i++)\n"
    "    if (!strcmp(s, t[i].name))\n"
    "      return t[i].fn;\n"
    "  return 0;\n"
    "}\n"
    "#if GPA == 1\n"
    "CUresult cuGetProcAddress(const char *s, void **p, int v, unsigned long long f) {\n"
    "  *p = lookup(s, v, f);\n"
    "  return *p ? 0 : 500;\n"
    "}\n"
    "#elif GPA == 2\n"
    "CUresult cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, int *status) {\n"
    "  *p = lookup(s, v, f);\n"
    "  *status = *p ? 0 : 1;\n"
    "  return *p ? 0 : 500;\n"
    "}\n"
    "#endif\n";

typedef struct {
  const char *name, *flags;
} Variant;

static bool fake_probe(const Variant *v, char *so, size_t n) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "cc -std=c11 %s", v->flags);
  return build_so(cmd, "fake_probe.c", fake_probe_src, v->name, so, n);
}

static void probe_checks(void) {
  static const Variant nodev = {"nodev", "-DGPA=1 -DCOUNT=0 -DINIT=0 -DMAJOR=9 -DMINOR=0"},
                       initfail = {"initfail", "-DGPA=2 -DCOUNT=1 -DINIT=100 -DMAJOR=9 -DMINOR=0"},
                       stub = {"stub", "-DGPA=1 -DCOUNT=1 -DINIT=34 -DMAJOR=9 -DMINOR=0"},
                       plain = {"plain", "-DGPA=0 -DCOUNT=1 -DINIT=0 -DMAJOR=9 -DMINOR=0"},
                       gpa2 = {"gpa2", "-DGPA=2 -DCOUNT=2 -DINIT=0 -DMAJOR=8 -DMINOR=6"};
  char so[512], why[512];
  bool built = fake_probe(&nodev, so, sizeof so);
  CHECK(built, "cuda: a fake driver builds", "cc failed: see %s/nodev.log", tmp);
  if (!built)
    return;
  setenv("MDL_LIBCUDA", so, 1);
  bool ok = cuda_probe(why, sizeof why);
  CHECK(!ok && !strcmp(why, "no CUDA device"), "cuda: a driver with no device says 'no CUDA device'",
        "probe %d: '%s'", ok, why);
  ok = cuda_available(why, sizeof why);
  CHECK(!ok && !strcmp(why, "no CUDA device"), "cuda: not available without a device", "%d: '%s'", ok, why);

  fake_probe(&initfail, so, sizeof so);
  setenv("MDL_LIBCUDA", so, 1);
  ok = cuda_probe(why, sizeof why);
  CHECK(!ok && !strcmp(why, "no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)"),
        "cuda: cuInit's CUDA_ERROR_NO_DEVICE is 'no CUDA device' (cuGetProcAddress_v2)", "probe %d: '%s'", ok, why);

  fake_probe(&stub, so, sizeof so);
  setenv("MDL_LIBCUDA", so, 1);
  ok = cuda_probe(why, sizeof why);
  CHECK(!ok && !strcmp(why, "no usable CUDA driver (cuInit: CUDA_ERROR_STUB_LIBRARY)"),
        "cuda: a stub driver is named with its error", "probe %d: '%s'", ok, why);

  fake_probe(&plain, so, sizeof so);
  setenv("MDL_LIBCUDA", so, 1);
  CudaDevice d = {0};
  ok = cuda_device(&d, why, sizeof why);
  CHECK(ok && !strcmp(d.arch, "sm_90") && !strcmp(d.name, "Fake GPU") && d.sm_count == 7 &&
            d.total_bytes == 80ul << 30 && d.driver_version == 12080,
        "cuda: without cuGetProcAddress the versioned names are found (sm_90)", "%d '%s': %s %s %d SMs %zu bytes",
        ok, why, d.arch, d.name, d.sm_count, d.total_bytes);
  ok = cuda_probe(why, sizeof why);
  CHECK(ok && !strcmp(why, "Fake GPU (sm_90, 7 SMs, 80.0 GiB, driver 12.8)"), "cuda: probe describes the device",
        "%d: '%s'", ok, why);
  Model md = {"mlp", "models/mlp.mdl", NULL, {{0}}, 0, DT_F32};
  Compiled c;
  if (compile_model(&md, &c)) {
    Engine *e = engine_cuda(c.f, c.m, plan_for(c.f, c.m), 1, true, true, why, sizeof why);
    CHECK(!e && contains(why, "lacks cuDevicePrimaryCtxRetain"),
          "cuda: the engine names the entry point a driver lacks", "%p: '%s'", (void *)e, why);
    fake_probe(&nodev, so, sizeof so);
    setenv("MDL_LIBCUDA", so, 1);
    e = engine_cuda(c.f, c.m, plan_for(c.f, c.m), 1, true, true, why, sizeof why);
    CHECK(!e && !strcmp(why, "no CUDA device"), "cuda: the engine says 'no CUDA device'", "'%s'", why);
  } else {
    CHECK(false, "cuda: models/mlp.mdl compiles", "front end or autodiff failed");
  }
  arena_free(c.a);

  fake_probe(&gpa2, so, sizeof so);
  setenv("MDL_LIBCUDA", so, 1);
  ok = cuda_device(&d, why, sizeof why);
  CHECK(ok && !strcmp(d.arch, "sm_86"), "cuda: cuGetProcAddress_v2 at ABI 12.0 (sm_86)", "%d '%s': %s", ok, why,
        d.arch);

  snprintf(so, sizeof so, "%s/fake_probe.c", tmp);
  setenv("MDL_LIBCUDA", so, 1);
  ok = cuda_probe(why, sizeof why);
  CHECK(!ok && contains(why, "no CUDA driver (") && contains(why, "fake_probe.c"),
        "cuda: a file that is not a library is 'no CUDA driver'", "probe %d: '%s'", ok, why);
  unsetenv("MDL_LIBCUDA");
}


//
// Training steps on a CUDA engine against the interpreter.
//

// Every input of g, the same on both engines: ids below the vocabulary (the last axis of the
// embedding table or of the logits), two documents per row, one ignored target; f32 inputs uniform.
static void set_batch(const Graph *g, Engine **es, int ne, int64_t bad_target) {
  int64_t vocab = 2;
  for (int i = 0; i < g->n; i++) {
    const IrNode *nd = g->nodes[i];
    if (nd->op == OP_EMBED || nd->op == OP_CROSS_ENTROPY) {
      const Shape s = g->nodes[nd->in[0]]->shape;
      vocab = nd->op == OP_EMBED ? s.d[0] : s.d[s.rank - 1];
    }
  }
  for (int i = 0; i < g->fwd_end; i++) {
    const IrNode *nd = g->nodes[i];
    if (nd->op != OP_INPUT)
      continue;
    int64_t n = shape_numel(nd->shape), T = nd->shape.d[nd->shape.rank - 1];
    int32_t *ids = calloc((size_t)n, sizeof *ids);
    float *x = calloc((size_t)n, sizeof *x);
    for (int64_t j = 0; j < n; j++) {
      int64_t t = j % T, half = T / 2;
      double u = mdl_rng_uniform(11, (uint64_t)i, (uint64_t)j);
      x[j] = (float)(2 * u - 1);
      if (!strcmp(nd->name, "pos"))
        ids[j] = (int32_t)(t >= half ? t - half : t);
      else if (!strcmp(nd->name, "doc"))
        ids[j] = t >= half;
      else
        ids[j] = (int32_t)(u * (double)vocab);
    }
    if (!strcmp(nd->name, "targets")) {
      ids[n - 1] = -1;
      if (bad_target)
        ids[0] = (int32_t)bad_target;
    }
    for (int k = 0; k < ne; k++)
      es[k]->set_input(es[k], nd->name, nd->dtype == DT_I32 ? ids : NULL, nd->dtype == DT_F32 ? x : NULL, n);
    free(ids);
    free(x);
  }
}

static bool step_both(Engine **es, int64_t step, char *err, size_t n) {
  for (int k = 0; k < 2; k++) {
    es[k]->set_seed(es[k], 1000 + (uint64_t)step);
    es[k]->set_scalar(es[k], "lr", 2e-3);
    es[k]->set_scalar(es[k], "step", (double)step);
    if (!es[k]->step(es[k], err, n))
      return false;
  }
  return true;
}

// max |x - r| / max |r| over one node's values, or its L2 form.
static double rel_error(Engine *x, Engine *r, int node, bool l2) {
  int64_t n = shape_numel(x->g->nodes[node]->shape);
  float *a = calloc((size_t)n, sizeof *a), *b = calloc((size_t)n, sizeof *b);
  x->read(x, node, a);
  r->read(r, node, b);
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - b[i]);
    if (isnan(d))
      d = INFINITY;
    diff = l2 ? diff + d * d : fmax(diff, d);
    ref = l2 ? ref + (double)b[i] * b[i] : fmax(ref, fabs((double)b[i]));
  }
  free(a);
  free(b);
  return l2 ? sqrt(diff) / (ref > 0 ? sqrt(ref) : 1) : diff / (ref > 0 ? ref : 1);
}

// One step on both engines: the loss and every gradient within tol (in L2 when l2: bf16 GEMM
// operands, where an f32 value summed in another order may round to the other bf16 neighbour and
// that difference spreads; see test_cuda_emit.c); then, when steps > 1, the parameters after that
// many steps within ptol (L2). After the first step the bf16 CASTs of the parameters whose slot in m
// no other value reuses read back from both engines alike, bit for bit, and the parameters' bf16
// copies (written by the optimizer) as the CUDA engine's new parameters rounded, bit for bit.
static void compare_engines(const char *label, Engine *cuda, Engine *ref, int steps, double tol, bool l2,
                            const MemPlan *m, double ptol) {
  const Graph *g = cuda->g;
  Engine *es[] = {cuda, ref};
  char err[512], name[256];
  set_batch(g, es, 2, 0);
  bool ok = step_both(es, 1, err, sizeof err);
  snprintf(name, sizeof name, "cuda: %s: one step runs", label);
  CHECK(ok, name, "%s", err);
  if (!ok)
    return;
  double worst = rel_error(cuda, ref, g->loss, false);
  const char *at = "loss";
  for (int i = 0; i < g->nparams; i++) {
    double r = rel_error(cuda, ref, g->grads[i], l2);
    if (!(r <= worst))
      worst = r, at = g->nodes[g->params[i]]->name;
  }
  snprintf(name, sizeof name, "cuda: %s: loss and %d gradients match the interpreter (%.0e%s)", label, g->nparams, tol,
           l2 ? " in L2" : "");
  CHECK(worst <= tol, name, "worst %.3g at %s (loss %.6f vs %.6f)", worst, at, engine_scalar(cuda, g->loss),
        engine_scalar(ref, g->loss));
  int casts = 0, same = 0, copies = 0;
  for (int c = 0; c < g->n; c++) {
    const IrNode *nd = g->nodes[c];
    if (nd->op != OP_CAST || nd->dtype != DT_BF16 || g->nodes[nd->in[0]]->op != OP_PARAM || m->offset[c] < 0)
      continue;
    int64_t n = shape_numel(nd->shape), lo = m->offset[c], hi = lo + 2 * n;
    bool alone = true;
    for (int i = 0; i < g->n && alone; i++) {
      int64_t o = m->offset[i], end = o + dtype_size(g->nodes[i]->dtype) * shape_numel(g->nodes[i]->shape);
      alone = i == c || o < 0 || g->nodes[i]->op == OP_RESHAPE || end <= lo || o >= hi;
    }
    if (!alone)
      continue;
    // A copy (fuse.c, rule 11) holds the updated parameter rounded; a CAST kernel's value is the
    // rounding of the parameter the step read, as the interpreter's.
    bool copy = m->copy_of[nd->in[0]] == c;
    float *a = calloc((size_t)n, sizeof *a), *b = calloc((size_t)n, sizeof *b);
    cuda->read(cuda, c, a);
    (copy ? cuda : ref)->read(copy ? cuda : ref, copy ? nd->in[0] : c, b);
    for (int64_t i = 0; copy && i < n; i++)
      b[i] = (float)round_bf16(b[i]);
    casts++;
    copies += copy;
    same += !memcmp(a, b, sizeof *a * (size_t)n);
    free(a);
    free(b);
  }
  if (casts) {
    snprintf(name, sizeof name,
             "cuda: %s: %d bf16 CASTs of the parameters read back as the interpreter's, %d copies as the new "
             "parameters rounded",
             label, casts - copies, copies);
    CHECK(same == casts && copies > 0, name, "%d of %d differ", casts - same, casts);
  }
  if (steps <= 1)
    return;
  for (int s = 2; ok && s <= steps; s++)
    ok = step_both(es, s, err, sizeof err);
  // All parameters together within ptol (L2); in fp32 also every tensor within 100 ptol. A gradient
  // element near 0 (the key bias gets only rounding noise: its exact gradient is 0) may change sign
  // between engines, and AdamW moves it by lr either way: the attention biases, which hold the key
  // bias, differ by up to 5e-4 in fp32 where every other tensor is within 3e-5 (3e-6 over all). In
  // bf16 one small tensor can differ by far more than the model does, so only the whole counts.
  worst = 0;
  at = "";
  double d2 = 0, r2 = 0;
  for (int i = 0; ok && i < g->nparams; i++) {
    int64_t n = shape_numel(g->nodes[g->params[i]]->shape);
    float *a = calloc((size_t)n, sizeof *a), *b = calloc((size_t)n, sizeof *b);
    cuda->read(cuda, g->params[i], a);
    ref->read(ref, g->params[i], b);
    for (int64_t j = 0; j < n; j++) {
      d2 += ((double)a[j] - b[j]) * ((double)a[j] - b[j]);
      r2 += (double)b[j] * b[j];
    }
    free(a);
    free(b);
    double r = l2 ? 0 : rel_error(cuda, ref, g->params[i], true);
    if (!(r <= worst))
      worst = r, at = g->nodes[g->params[i]]->name;
  }
  double all = isnan(d2) ? INFINITY : sqrt(d2) / (r2 > 0 ? sqrt(r2) : 1);
  snprintf(name, sizeof name, "cuda: %s: parameters after %d steps match the interpreter (%.0e over all%s)", label,
           steps, ptol, l2 ? "" : ", 100x that per tensor");
  CHECK(ok && all <= ptol && worst <= 100 * ptol, name, "%s; over all %.3g, worst tensor %.3g at %s", ok ? "ran" : err,
        all, worst, at);
}

static void no_driver_checks(void) {
  static const char no_driver[] = "no CUDA driver (libcuda.so.1 not found)";
  char why[512];
  bool ok = cuda_probe(why, sizeof why);
  CHECK(!ok && !strcmp(why, no_driver), "cuda: without libcuda.so.1 the probe says 'no CUDA driver'",
        "probe %d: '%s'", ok, why);
  ok = cuda_available(why, sizeof why);
  CHECK(!ok && !strcmp(why, no_driver), "cuda: not available without a driver", "%d: '%s'", ok, why);
  Model md = {"mlp", "models/mlp.mdl", NULL, {{0}}, 0, DT_F32};
  Compiled c;
  if (compile_model(&md, &c)) {
    Engine *e = engine_cuda(c.f, c.m, plan_for(c.f, c.m), 1, true, true, why, sizeof why);
    CHECK(!e && !strcmp(why, no_driver), "cuda: the engine says 'no CUDA driver'", "%p: '%s'", (void *)e, why);
  } else {
    CHECK(false, "cuda: models/mlp.mdl compiles", "front end or autodiff failed");
  }
  arena_free(c.a);
}

//
// The emulated GPU.
//
typedef struct {
  long captures, replays, kernels, gemms, live_allocations, modules;
  long described, ab16, d16;
  long events;
  long direct_gemms, slow_replayed;
  long device_copies;
  long slow_kernels_replayed;
  long direct_kernels;
  long uploads;
  long f8, e5m2, f8_refused;
} Counters;

// The emulated GPU for one plan: this file as C++ with the plan's module and kernel list; or, with
// kernels_only, a second plan's kernels for it ($FAKE_SECOND_MODULE).
static bool build_fake_gpu_of(const CudaPlan *p, const char *name, bool kernels_only, char *so, size_t n, char *why,
                              size_t wn) {
  char cu[512], list[512], cmd[4096];
  snprintf(cu, sizeof cu, "%s/%s.cu", tmp, name);
  snprintf(list, sizeof list, "%s/%s_kernels.inc", tmp, name);
  snprintf(so, n, "%s/%s_gpu.so", tmp, name);
  FILE *f = fopen(list, "w");
  if (!write_file(cu, p->source) || !f) {
    snprintf(why, wn, "cannot write %s", cu);
    if (f)
      fclose(f);
    return false;
  }
  for (int i = 0; i < 2 * p->nlaunches; i++) { // the kernels, then their variants
    const char *k = i < p->nlaunches ? p->launches[i].kernel : p->launches[i - p->nlaunches].alt;
    bool seen = false;
    for (int j = 0; k && j < i && !seen; j++) {
      const char *o = j < p->nlaunches ? p->launches[j].kernel : p->launches[j - p->nlaunches].alt;
      seen = o && !strcmp(o, k);
    }
    if (k && !seen)
      fprintf(f, "K(%s)\n", k);
  }
  fprintf(f, "K(mdl_accumulate)\n");
  fclose(f);
  snprintf(cmd, sizeof cmd,
           "g++ -std=c++17 -O1 -shared -fPIC -fsanitize=alignment,bounds -fno-sanitize-recover=all -DMDL_FAKE_GPU %s"
           "'-DMDL_MODULE=\"%s\"' '-DMDL_KERNELS=\"%s\"' "
           "-include tests/unit/cuda_emu.h -x c++ %s -o %s >%s/%s.log 2>&1",
           kernels_only ? "-DMDL_FAKE_KERNELS_ONLY " : "", cu, list, __FILE__, so, tmp, name);
  if (system(cmd) != 0) {
    snprintf(why, wn, "g++ failed: see %s/%s.log", tmp, name);
    return false;
  }
  return true;
}

static bool build_fake_gpu(const CudaPlan *p, const char *name, char *so, size_t n, char *why, size_t wn) {
  return build_fake_gpu_of(p, name, false, so, n, why, wn);
}

// The emulated GPU of compiled model c (its plan in *p) built as `name` and made the driver and
// cuBLASLt of the engines that follow (the module in three programs); its handle in *h (dlclose it
// after them) and its counters in *counters (NULL where it has none). False after a [fail] line for
// `label`, c freed.
static bool use_fake_gpu(Compiled *c, const char *name, const char *label, const CudaPlan **p, char *so, size_t n,
                         void **h, const Counters *(**counters)(void)) {
  char why[1024] = "", check[300];
  *p = emit_cuda_plan(c->f, c->m, c->g->model);
  bool built = *p && build_fake_gpu(*p, name, so, n, why, sizeof why);
  snprintf(check, sizeof check, "cuda: %s: the emulated GPU builds", label);
  CHECK(built, check, "%s", *p ? why : "emit_cuda_plan failed");
  if (!built) {
    arena_free(c->a);
    return false;
  }
  setenv("MDL_LIBCUDA", so, 1);
  setenv("MDL_LIBCUBLASLT", so, 1);
  setenv("MDL_NVRTC_THREADS", "3", 1);
  *h = dlopen(so, RTLD_NOW | RTLD_LOCAL);
  *counters = *h ? (const Counters *(*)(void))dlsym(*h, "fake_counters") : NULL;
  return true;
}

// A reader of an engine's snapshot on a thread of its own (as the checkpoint writer reads it).
typedef struct {
  Engine *e;
  const int *nodes;
  int n;
  float **dst;
  bool ok;
  char why[256];
} SnapReader;

static void *read_snapshot_job(void *arg) {
  SnapReader *r = arg;
  r->ok = true;
  for (int i = 0; r->ok && i < r->n; i++)
    r->ok = r->e->read_snapshot(r->e, r->nodes[i], r->dst[i], r->why, sizeof r->why);
  return NULL;
}

// Engine.snapshot on the emulated GPU (the checkpoints' copy of the parameters and moments on the
// device): read back on another thread while two more steps run on this one, it holds every
// parameter and moment as they were at the snapshot, bit for bit, though the steps changed them;
// a node that is neither is refused; the copy is three device copies (params, m, v), its memory
// counted in the engine's device bytes. With the device too full for it, snapshot declines.
static void snapshot_checks(const char *label, const Compiled *c, Engine *cuda, const Counters *k, void *fake) {
  const Graph *g = c->g;
  char name[300], why[256];
  int *nodes = calloc((size_t)g->n, sizeof *nodes), n = 0;
  for (int i = 0; i < g->nparams; i++)
    nodes[n++] = g->params[i];
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_STATE)
      nodes[n++] = i;
  float **before = calloc((size_t)n, sizeof *before), **snap = calloc((size_t)n, sizeof *snap),
        **after = calloc((size_t)n, sizeof *after);
  for (int i = 0; i < n; i++) {
    size_t count = (size_t)shape_numel(g->nodes[nodes[i]]->shape);
    before[i] = calloc(count, sizeof(float));
    snap[i] = calloc(count, sizeof(float));
    after[i] = calloc(count, sizeof(float));
    cuda->read(cuda, nodes[i], before[i]);
  }
  long copies = k->device_copies;
  int64_t bytes = cuda->device_bytes;
  bool ok = cuda->snapshot && cuda->snapshot(cuda);
  snprintf(name, sizeof name, "cuda: %s: a snapshot of the parameters and moments is three device copies, its "
           "memory counted", label);
  CHECK(ok && k->device_copies == copies + 3 && cuda->device_bytes == bytes + 3 * c->m->param_bytes, name,
        "snapshot %d, %ld copies, %lld more device bytes", ok, k->device_copies - copies,
        (long long)(cuda->device_bytes - bytes));
  SnapReader r = {cuda, nodes, n, snap, false, ""};
  pthread_t th;
  bool threaded = ok && pthread_create(&th, NULL, read_snapshot_job, &r) == 0;
  Engine *es[] = {cuda};
  for (int s = 0; ok && s < 2; s++) {
    set_batch(g, es, 1, 0);
    ok = cuda->step(cuda, why, sizeof why);
  }
  if (threaded)
    pthread_join(th, NULL);
  int64_t differ = 0, moved = 0;
  for (int i = 0; ok && r.ok && i < n; i++) {
    int64_t count = shape_numel(g->nodes[nodes[i]]->shape);
    differ += memcmp(snap[i], before[i], sizeof(float) * (size_t)count) != 0;
    // (and once more after the steps, on this thread)
    r.ok = cuda->read_snapshot(cuda, nodes[i], snap[i], r.why, sizeof r.why);
    differ += r.ok && memcmp(snap[i], before[i], sizeof(float) * (size_t)count) != 0;
    cuda->read(cuda, nodes[i], after[i]);
    moved += memcmp(after[i], before[i], sizeof(float) * (size_t)count) != 0;
  }
  snprintf(name, sizeof name, "cuda: %s: read on another thread while two steps run, and after them, the snapshot "
           "holds the %d parameters and moments as they were", label, n);
  CHECK(threaded && ok && r.ok && differ == 0 && moved > 0, name, "%s; %lld differ, %lld moved by the steps",
        !threaded ? "no thread" : !ok ? why : !r.ok ? r.why : "", (long long)differ, (long long)moved);
  ok = cuda->read_snapshot && !cuda->read_snapshot(cuda, g->loss, snap[0], why, sizeof why);
  snprintf(name, sizeof name, "cuda: %s: the snapshot has no loss", label);
  CHECK(ok && contains(why, "not in the snapshot"), name, "'%s'", ok ? why : "read");
  for (int i = 0; i < n; i++) {
    free(before[i]);
    free(snap[i]);
    free(after[i]);
  }
  free(before);
  free(snap);
  free(after);
  free(nodes);

  // (a fresh engine on a device with room for less than the snapshot)
  int (*meminfo)(size_t *, size_t *) = (int (*)(size_t *, size_t *))dlsym(fake, "cuMemGetInfo_v2");
  Engine *full = engine_cuda(c->f, c->m, plan_for(c->f, c->m), 5, true, true, why, sizeof why);
  size_t free_bytes = 0, total = 0;
  if (full && meminfo && meminfo(&free_bytes, &total) == 0) {
    char cap[32];
    snprintf(cap, sizeof cap, "%zu", total - free_bytes + (size_t)c->m->param_bytes);
    setenv("FAKE_GPU_MEMORY", cap, 1);
    long live = k->live_allocations;
    ok = full->snapshot(full);
    unsetenv("FAKE_GPU_MEMORY");
    snprintf(name, sizeof name, "cuda: %s: without the device memory for it, snapshot declines and allocates "
             "nothing", label);
    CHECK(!ok && k->live_allocations == live, name, "snapshot %d, %ld allocations more", ok,
          k->live_allocations - live);
  } else {
    CHECK(false, "cuda: a fresh engine for the snapshot's memory check", "%s", full ? "no cuMemGetInfo" : why);
  }
  if (full)
    full->free(full);
}

// The training loop on the emulated GPU (train_run, no validation): 4 steps with a checkpoint every 2,
// each a snapshot, read from it by the checkpoint writer's thread while the next steps run;
// the checkpoint left at the end holds every parameter and moment as the engine has them, bit for bit.
// A small corpus prepared into shards at `data` (once: later calls find them there).
static bool train_data(char *data, size_t n) {
  char text[1200];
  snprintf(text, sizeof text, "%s/corpus.txt", tmp);
  snprintf(data, n, "%s/corpus-data", tmp);
  if (access(text, F_OK) == 0)
    return true;
  FILE *f = fopen(text, "w");
  for (int i = 0; f && i < 400; i++)
    fprintf(f, "Line %d of a small corpus: the %s fox jumps over %d lazy dogs.\n", i, i % 3 ? "quick" : "brown",
            i % 7);
  bool ok = f && fclose(f) == 0;
  PrepOptions po;
  prep_defaults(&po);
  po.input = text;
  po.out_dir = data;
  return ok && prep_run(&po) == 0;
}

static void train_checks(const char *label, const Compiled *c, const Counters *k) {
  char name[300], data[1200], out[1200], ckpt[1300];
  snprintf(out, sizeof out, "%s/train-out", tmp);
  snprintf(ckpt, sizeof ckpt, "%s/checkpoint.safetensors", out);
  bool ok = train_data(data, sizeof data);
  char why[256];
  Engine *e = ok ? engine_cuda(c->f, c->m, plan_for(c->f, c->m), 7, true, true, why, sizeof why) : NULL;
  TrainOptions to = {.model_path = "models/gpt2-tiny.mdl", .data_dir = data, .tokenizer_path = "tokenizer.bin",
                     .out_dir = out, .steps = 4, .seed = 7, .val_every = 0, .val_batches = 1, .ckpt_every = 2};
  long copies = k->device_copies;
  int rc = e ? train_run(e, NULL, NULL, &to) : -1;
  snprintf(name, sizeof name, "cuda: %s: trains 4 steps with a checkpoint every 2, each taken by a snapshot (3 "
           "device copies)", label);
  CHECK(rc == 0 && k->device_copies - copies == 6, name, "%s; %ld device copies",
        !ok ? "no data" : !e ? why : rc ? "train_run failed" : "", k->device_copies - copies);
  Arena *a = arena_new();
  StFile st;
  ok = rc == 0 && st_read(a, ckpt, &st);
  int checked = 0, differ = 0;
  const Graph *g = c->g;
  for (int i = 0; ok && i < g->n; i++) {
    const IrNode *x = g->nodes[i];
    if (x->op != OP_PARAM && x->op != OP_STATE)
      continue;
    const StTensor *t = st_find(&st, x->name);
    int64_t count = shape_numel(x->shape);
    float *v = calloc((size_t)count, sizeof *v);
    e->read(e, i, v);
    differ += !t || t->dtype != DT_F32 || memcmp(t->data, v, sizeof(float) * (size_t)count) != 0;
    checked++;
    free(v);
  }
  snprintf(name, sizeof name, "cuda: %s: the last checkpoint holds the engine's %d parameters and moments", label,
           checked);
  CHECK(ok && checked > 0 && differ == 0, name, "%s; %d of %d differ", ok ? "" : "no checkpoint", differ, checked);
  arena_free(a);
  if (e)
    e->free(e);
}

// --profile on two fresh engines from one seed and batch, two steps: the profiled one runs the plan
// launch by launch outside the graph (no replay) and reaches the graph's loss and gradients bit for
// bit; the first step is a warm-up, left out; every plan step with a launch gets a time from the
// second; its events are freed with the engine.
static void profile_checks(const char *label, const Compiled *c, const Counters *k) {
  char why[1024], name[256];
  Engine *es[2] = {engine_cuda(c->f, c->m, plan_for(c->f, c->m), 5, true, true, why, sizeof why), NULL};
  es[1] = es[0] ? engine_cuda(c->f, c->m, plan_for(c->f, c->m), 5, true, true, why, sizeof why) : NULL;
  snprintf(name, sizeof name, "cuda: %s: --profile runs the step launch by launch, to the graph's results", label);
  if (!es[0] || !es[1]) {
    CHECK(false, name, "%s", why);
    if (es[0])
      es[0]->free(es[0]);
    return;
  }
  es[0]->profile = true;
  set_batch(c->g, es, 2, 0);
  long replays = k->replays;
  bool ok = step_both(es, 1, why, sizeof why);
  bool untimed = ok && es[0]->profiled_steps == 0;
  for (int s = 0; untimed && s < c->f->nsteps; s++)
    untimed = es[0]->kernel_seconds[s] == 0;
  ok = ok && step_both(es, 2, why, sizeof why);
  double worst = ok ? rel_error(es[0], es[1], c->g->loss, false) : INFINITY;
  for (int i = 0; ok && i < c->g->nparams; i++)
    worst = fmax(worst, rel_error(es[0], es[1], c->g->grads[i], false));
  CHECK(ok && worst == 0 && k->replays == replays + 2 && es[0]->profiled_steps == 1, name,
        "%s; loss and gradients differ by up to %.3g; %ld replays for 4 steps (2 expected); %lld profiled",
        ok ? "ran" : why, worst, k->replays - replays, (long long)es[0]->profiled_steps);
  snprintf(name, sizeof name, "cuda: %s: --profile leaves the first step, a warm-up, untimed", label);
  CHECK(untimed, name, "%lld steps counted, or a kernel timed, after one step", (long long)es[0]->profiled_steps);
  const CudaPlan *p = emit_cuda_plan(c->f, c->m, c->g->model);
  int timed = 0, steps = 0;
  for (int s = 0; p && s < c->f->nsteps; s++) {
    bool launched = false;
    for (int i = 0; i < p->nlaunches && !launched; i++)
      launched = p->launches[i].step == s;
    steps += launched;
    timed += launched && es[0]->kernel_seconds[s] > 0;
  }
  snprintf(name, sizeof name, "cuda: %s: --profile times every plan step that launches (%d)", label, steps);
  CHECK(p && steps > 0 && timed == steps, name, "%d of %d timed", timed, steps);
  // The report's last part: a line for each plan step of several launches and at least 1% of the
  // time, its launches' times adding up to the step's (each printed to 1 us).
  double total = 0;
  for (int s = 0; s < c->f->nsteps; s++)
    total += es[0]->kernel_seconds[s];
  int want = 0, lines = 0, sums = 0;
  for (int s = 0; p && s < c->f->nsteps; s++) {
    int nl = 0;
    for (int i = 0; i < p->nlaunches; i++)
      nl += p->launches[i].step == s;
    want += nl > 1 && es[0]->kernel_seconds[s] >= 0.01 * total;
  }
  char *text = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&text, &len);
  if (mem) {
    engine_profile_report(es[0], mem);
    fclose(mem);
  }
  const char *part = text ? strstr(text, "launches inside the kernels above") : NULL;
  for (const char *ln = part ? strchr(part, '\n') : NULL; ln && ln[1] == ' '; ln = strchr(ln + 1, '\n')) {
    lines++;
    char step[128] = "";
    if (sscanf(ln + 1, " %127[^:]:", step) != 1)
      continue;
    int s = 0;
    while (s < c->f->nsteps && strcmp(c->f->steps[s].name, step))
      s++;
    double sum = 0, ms = 0;
    int nl = 0;
    const char *end = strchr(ln + 1, '\n');
    for (const char *q = strchr(ln + 1, ':'); q && q < end; q = strchr(q + 1, ',')) {
      const char *comma = strchr(q + 1, ',');
      const char *stop = comma && comma < end ? comma : end;
      const char *num = stop;
      while (num > q && num[-1] != ' ')
        num--;
      if (sscanf(num, "%lf", &ms) == 1)
        sum += ms, nl++;
    }
    sums += s < c->f->nsteps && nl > 1 &&
            fabs(sum - 1e3 * es[0]->kernel_seconds[s] / (double)es[0]->profiled_steps) <= 1e-3 * nl;
  }
  snprintf(name, sizeof name, "cuda: %s: --profile lists the launches of the kernels that make several (%d), "
           "adding up to their times", label, want);
  CHECK(want > 0 && lines == want && sums == want, name, "%d lines, %d add up", lines, sums);
  free(text);
  es[0]->free(es[0]);
  es[1]->free(es[1]);
  snprintf(name, sizeof name, "cuda: %s: freeing a profiled engine frees its events and memory", label);
  CHECK(k->events == 0 && k->live_allocations == 0, name, "%ld events, %ld allocations", k->events,
        k->live_allocations);
}

// Engine.take_params and Engine.inputs_from between two engines of one plan (the emulated GPU knows one
// module's kernels), from seeds 5 and 6. take_params: after a step of the first, the second's
// parameters and bf16 copies are the first's bit for bit, by device copies; from the interpreter it
// declines. inputs_from, where the graph has an f32 input and a gradient of its size: the first
// engine's gradient after one batch, then added after another, is the host's sum of the two bit for
// bit; a step of the second keeps it (its staged inputs no longer cover it); set_input replaces it.
// One step of a fresh engine (tune_kernels as given) with the kernels named in `slow` made slower
// by the fake when they run at once; the replayed launches of those kernels in *replayed.
static bool slow_step(const Compiled *c, const Counters *k, const char *slow, bool tune, long *replayed, char *why,
                      size_t n) {
  setenv("FAKE_SLOW_KERNELS", slow, 1);
  long before = k->slow_kernels_replayed;
  Engine *e = engine_cuda(c->f, c->m, plan_for(c->f, c->m), 5, true, tune, why, n);
  bool ok = e != NULL;
  if (e) {
    Engine *one[] = {e};
    set_batch(c->g, one, 1, 0);
    ok = e->step(e, why, n);
    e->free(e);
  }
  unsetenv("FAKE_SLOW_KERNELS");
  *replayed = k->slow_kernels_replayed - before;
  return ok;
}

// Kernel variants (attention's other block sizes): the engine times each kernel that has one against
// it and replays the faster, whichever that is here: the fake makes the plan's own kernels slower,
// then the variants; with kernel tuning off, the plan's own kernels replay, untimed.
static void variant_checks(const char *label, const Compiled *c, const Counters *k) {
  const CudaPlan *p = emit_cuda_plan(c->f, c->m, "variants");
  char own[2048] = "", alt[2048] = "", why[512], name[256];
  int with = 0;
  for (int i = 0; p && i < p->nlaunches; i++) {
    const CudaLaunch *l = &p->launches[i];
    if (!l->alt)
      continue;
    with++;
    if (!in_list(own, l->kernel)) { // (the layers launch one kernel each: listed once)
      snprintf(own + strlen(own), sizeof own - strlen(own), "%s%s", *own ? "," : "", l->kernel);
      snprintf(alt + strlen(alt), sizeof alt - strlen(alt), "%s%s", *alt ? "," : "", l->alt);
    }
  }
  snprintf(name, sizeof name, "cuda: %s: attention's kernels have variants (%d launches: %.150s)", label, with, alt);
  CHECK(with > 0, name, "none");
  if (!with)
    return;
  long replayed = -1;
  bool ok = slow_step(c, k, own, true, &replayed, why, sizeof why);
  snprintf(name, sizeof name, "cuda: %s: each kernel slower than its variant here replays as the variant", label);
  CHECK(ok && replayed == 0, name, "%s; %ld slow launches replayed", ok ? "ran" : why, replayed);
  ok = slow_step(c, k, alt, true, &replayed, why, sizeof why);
  snprintf(name, sizeof name, "cuda: %s: each variant slower than its kernel here is left out", label);
  CHECK(ok && replayed == 0, name, "%s; %ld slow launches replayed", ok ? "ran" : why, replayed);
  ok = slow_step(c, k, own, false, &replayed, why, sizeof why);
  snprintf(name, sizeof name, "cuda: %s: with kernel tuning off the plan's own kernels replay, untimed", label);
  CHECK(ok && replayed == with, name, "%s; %ld of %d launches with a variant replayed as the plan's own",
        ok ? "ran" : why, replayed, with);
  setenv("FAKE_FAILING_KERNELS", alt, 1);
  ok = slow_step(c, k, own, true, &replayed, why, sizeof why);
  unsetenv("FAKE_FAILING_KERNELS");
  snprintf(name, sizeof name, "cuda: %s: a variant that fails to launch is passed over, however slow its kernel",
           label);
  CHECK(ok && replayed == with, name, "%s; %ld of %d launches with a variant replayed as the plan's own",
        ok ? "ran" : why, replayed, with);
}

// An arena offset's alignment in bytes, 256 at most (-1: none).
static int64_t align_of(int64_t off) {
  int64_t a = 1;
  while (off > 0 && a < 256 && off % (2 * a) == 0)
    a *= 2;
  return off < 0 ? -1 : off == 0 ? 256 : a;
}

// GEMMs that differ in more than their addresses (shape, types, transposes, layout, epilogue, beta, the
// addresses' alignments).
static int gemm_kinds(const CudaPlan *p) {
  int kinds = 0;
  for (int i = 0; i < p->ngemms; i++) {
    const CudaGemm *x = &p->gemms[i];
    bool seen = false;
    for (int j = 0; j < i && !seen; j++) {
      const CudaGemm *y = &p->gemms[j];
      seen = x->ab == y->ab && x->b_fp8 == y->b_fp8 && x->c_type == y->c_type && x->ta == y->ta && x->tb == y->tb &&
             x->m == y->m && x->n == y->n && x->k == y->k && x->lda == y->lda && x->ldb == y->ldb && x->ldc == y->ldc &&
             x->batch == y->batch && x->stride_a == y->stride_a && x->stride_b == y->stride_b &&
             x->stride_c == y->stride_c && x->beta == y->beta && x->epilogue == y->epilogue &&
             x->c_apart == y->c_apart && align_of(x->a) == align_of(y->a) && align_of(x->b) == align_of(y->b) &&
             align_of(x->c) == align_of(y->c) && align_of(x->bias) == align_of(y->bias) &&
             align_of(x->aux) == align_of(y->aux) && align_of(x->c_apart ? x->cin : -1) ==
             align_of(y->c_apart ? y->cin : -1);
    }
    kinds += !seen;
  }
  return kinds;
}

static Engine *make_cuda(const void *ctx, uint64_t seed) {
  const Compiled *c = ctx;
  char why[512];
  return engine_cuda(c->f, c->m, plan_for(c->f, c->m), seed, true, true, why, sizeof why);
}

// The initial parameters on the device (draw_checks.h), and an engine given all of another's by
// take_params (the validation engine) sends none of its own up; the other draws and sends each
// parameter and each bf16 copy once, when take_params first needs them.
static void device_draw_checks(const char *label, const Compiled *c, const Counters *k) {
  char name[256], why[512] = "", on[128];
  snprintf(on, sizeof on, "cuda: %s", label);
  draw_checks(on, c->g, make_cuda, c);
  Engine *a = make_cuda(c, 5), *b = make_cuda(c, 6);
  long copies = 0;
  for (int i = 0; i < c->g->nparams; i++)
    copies += c->m->copy_of[c->g->params[i]] >= 0;
  long up = k->uploads;
  bool took = a && b && b->take_params(b, a);
  long by_take = k->uploads - up;
  up = k->uploads;
  bool drew = took && b->draw_params(b, why, sizeof why);
  snprintf(name, sizeof name, "cuda: %s: an engine whose parameters all come by take_params sends none up; the "
           "source sends its own when first needed (%d parameters, %ld bf16 copies)", label, c->g->nparams, copies);
  CHECK(took && drew && by_take == c->g->nparams + copies && k->uploads == up, name,
        "%s; %ld uploads in take_params, %ld in the draw after it", took ? (drew ? "drawn" : why) : "not taken",
        by_take, k->uploads - up);
  if (a)
    a->free(a);
  if (b)
    b->free(b);
}

static void device_copy_checks(const char *label, const Compiled *c, const Counters *k) {
  char why[1024], name[256];
  Engine *a = engine_cuda(c->f, c->m, plan_for(c->f, c->m), 5, true, true, why, sizeof why);
  Engine *b = engine_cuda(c->f, c->m, plan_for(c->f, c->m), 6, true, true, why, sizeof why);
  snprintf(name, sizeof name, "cuda: %s: two engines of one plan start", label);
  CHECK(a && b, name, "%s", why);
  if (!a || !b) {
    if (a)
      a->free(a);
    if (b)
      b->free(b);
    return;
  }
  Engine *both[] = {a, b};
  set_batch(c->g, both, 2, 0);
  bool ok = step_both(both, 1, why, sizeof why);
  const Graph *g = c->g;
  long copies = k->device_copies;
  bool took = ok && b->take_params(b, a);
  int64_t differ = 0, nc = 0;
  for (int i = 0; took && i < g->nparams; i++) {
    int nodes[2] = {g->params[i], c->m->copy_of[g->params[i]]};
    for (int j = 0; j < 2 && nodes[j] >= 0; j++) {
      int64_t n = shape_numel(g->nodes[nodes[j]]->shape);
      float *x = calloc((size_t)n, sizeof *x), *y = calloc((size_t)n, sizeof *y);
      a->read(a, nodes[j], x);
      b->read(b, nodes[j], y);
      differ += memcmp(x, y, sizeof *x * (size_t)n) != 0;
      nc += j;
      free(x);
      free(y);
    }
  }
  snprintf(name, sizeof name, "cuda: %s: take_params copies every parameter and its bf16 copy on the device (%lld "
           "copies)", label, (long long)nc);
  CHECK(took && differ == 0 && k->device_copies - copies == g->nparams + nc, name,
        "%s; %lld differ; %ld device copies", ok ? (took ? "taken" : "declined") : why, (long long)differ,
        k->device_copies - copies);
  Engine *ref = engine_interp(g, INTERP_F32, 5);
  snprintf(name, sizeof name, "cuda: %s: take_params from the interpreter declines", label);
  CHECK(!b->take_params(b, ref), name, "it took them");
  ref->free(ref);
  int x = -1, d = -1;
  for (int i = 0; i < g->fwd_end && x < 0; i++)
    if (g->nodes[i]->op == OP_INPUT && g->nodes[i]->dtype == DT_F32 && c->m->offset[i] >= 0)
      x = i;
  for (int i = 0; x >= 0 && i < g->nparams && d < 0; i++)
    if (g->grads[i] >= 0 && c->m->offset[g->grads[i]] >= 0 && g->nodes[g->grads[i]]->dtype == DT_F32 &&
        shape_numel(g->nodes[g->grads[i]]->shape) == shape_numel(g->nodes[x]->shape))
      d = g->grads[i];
  if (d >= 0) {
    int64_t n = shape_numel(g->nodes[x]->shape);
    float *g1 = calloc((size_t)n, sizeof *g1), *g2 = calloc((size_t)n, sizeof *g2), *got = calloc((size_t)n, 4);
    a->read(a, d, g1);
    const char *xn = g->nodes[x]->name;
    bool in = b->inputs_from(b, 1, &xn, a, &d, true);
    float *other = calloc((size_t)n, sizeof *other);
    for (int64_t j = 0; j < n; j++)
      other[j] = 0.25f * (float)(j % 7) - 0.5f;
    Engine *one[] = {a};
    set_batch(g, one, 1, 0);
    a->set_input(a, g->nodes[x]->name, NULL, other, n); // another batch
    ok = a->step(a, why, sizeof why);
    a->read(a, d, g2);
    in = in && ok && b->inputs_from(b, 1, &xn, a, &d, false);
    b->read(b, x, got);
    int64_t bad = 0;
    for (int64_t j = 0; j < n; j++)
      bad += got[j] != g1[j] + g2[j];
    snprintf(name, sizeof name, "cuda: %s: inputs_from copies a gradient into an input, then adds another, as the "
             "host adds (%s)", label, g->nodes[x]->name);
    CHECK(in && bad == 0 && memcmp(g1, g2, sizeof *g1 * (size_t)n), name, "%s; %lld of %lld differ",
          in ? "set" : why, (long long)bad, (long long)n);
    ok = b->step(b, why, sizeof why);
    b->read(b, x, g2);
    snprintf(name, sizeof name, "cuda: %s: a step keeps the input set on the device", label);
    CHECK(ok && !memcmp(got, g2, sizeof *got * (size_t)n), name, "%s", ok ? "it changed" : why);
    b->set_input(b, g->nodes[x]->name, NULL, other, n);
    ok = b->step(b, why, sizeof why);
    b->read(b, x, got);
    snprintf(name, sizeof name, "cuda: %s: set_input then replaces it", label);
    CHECK(ok && !memcmp(got, other, sizeof *got * (size_t)n), name, "%s", ok ? "it did not" : why);
    free(g1);
    free(g2);
    free(got);
    free(other);
  }
  a->free(a);
  b->free(b);
}

static void emulated_checks(const Model *md) {
  char name[256], why[1024], so[512];
  Compiled c;
  snprintf(name, sizeof name, "cuda: %s compiles", md->label);
  if (!compile_model(md, &c)) {
    CHECK(false, name, "front end or autodiff failed");
    arena_free(c.a);
    return;
  }
  const CudaPlan *p = emit_cuda_plan(c.f, c.m, c.g->model);
  bool bf16 = md->prec == DT_BF16;
  snprintf(name, sizeof name, "cuda: %s: the emulated GPU builds", md->label);
  bool built = p && build_fake_gpu(p, bf16 ? arena_printf(c.a, "%s_bf16", c.g->model) : c.g->model, so, sizeof so,
                                   why, sizeof why);
  CHECK(built, name, "%s", p ? why : "emit_cuda_plan failed");
  if (!built) {
    arena_free(c.a);
    return;
  }
  setenv("MDL_LIBCUDA", so, 1);
  setenv("MDL_LIBCUBLASLT", so, 1);
  void *h = dlopen(so, RTLD_NOW | RTLD_LOCAL);
  const Counters *(*counters)(void) = h ? (const Counters *(*)(void))dlsym(h, "fake_counters") : NULL;
  setenv("MDL_NVRTC_THREADS", "0", 1);
  Engine *bad = engine_cuda(c.f, c.m, plan_for(c.f, c.m), 5, true, true, why, sizeof why);
  snprintf(name, sizeof name, "cuda: %s: MDL_NVRTC_THREADS=0 is refused, named", md->label);
  CHECK(!bad && strstr(why, "MDL_NVRTC_THREADS=0: not a number of threads"), name, "%s",
        bad ? "an engine started" : why);
  if (bad)
    bad->free(bad);
  // The module as three programs, whatever the machine's cores, for every engine of this model: the
  // first compiles them, the others take them from the cache (with the machine's own count they
  // would compile the module again, split another way).
  setenv("MDL_NVRTC_THREADS", "3", 1);
  Engine *cuda = engine_cuda(c.f, c.m, plan_for(c.f, c.m), 5, true, true, why, sizeof why);
  snprintf(name, sizeof name, "cuda: %s: the engine starts on the emulated GPU", md->label);
  CHECK(cuda && counters, name, "%s", cuda ? "no fake_counters" : why);
  if (cuda && counters) {
    // (each kernel is found in the one cubin that defines it: the fake's modules hold only those)
    snprintf(name, sizeof name, "cuda: %s: the module is compiled as three programs, a cubin each, and every "
             "kernel is found in its own", md->label);
    CHECK(counters()->modules == 3 && p->nunits >= 3, name, "%ld modules loaded, %d units", counters()->modules,
          p->nunits);
    Engine *ref = engine_interp(c.g, INTERP_F32, 5);
    double init = 0;
    for (int i = 0; i < c.g->nparams; i++)
      init = fmax(init, rel_error(cuda, ref, c.g->params[i], false));
    snprintf(name, sizeof name, "cuda: %s: the initial parameters are the interpreter's", md->label);
    CHECK(init == 0, name, "max relative difference %.3g", init);
    enum { STEPS = 4 };
    // (AdamW's first steps move a parameter by about lr whatever the size of its gradient: where a
    // gradient is rounding noise, as a key bias's, bf16's larger noise shows more in the parameters.
    // bf16 gradients: 4e-3, the room a rounding flip of q, k, v, the softmax numerators or a GEMM
    // operand needs on so small a batch. The worst tensor of this comparison over five batches (this
    // one and those of rng streams 12 to 15 instead of 11) was 1.1e-3 to 3.4e-3 when the loss was the
    // mean over all 32 positions, and 0 to 3.2e-3 (this batch: 3.2e-3 at h.0.ln1_b) with the mean
    // over the 31 counted targets, whose 1/31 no longer scales dlogits exactly; the compiled C and
    // the interpreter differ by up to 2.1e-3 per tensor at B=2 T=16, while bf16 and fp32 differ by
    // 2e-3 to 6e-3; the parameters after 4 steps, over all: 2.4e-3 with the backward's products on
    // bf16 operands.)
    compare_engines(md->label, cuda, ref, STEPS, bf16 ? 4e-3 : 1e-5, bf16, c.m, bf16 ? 4e-3 : 1e-5);
    int kernels = 0, gemms = 0, ab16 = 0, d16 = 0;
    for (int i = 0; i < p->nlaunches; i++)
      p->launches[i].kernel ? kernels++ : gemms++;
    for (int i = 0; i < p->ngemms; i++) {
      ab16 += p->gemms[i].ab == DT_BF16;
      d16 += p->gemms[i].c_type == DT_BF16;
    }
    const Counters *k = counters();
    snprintf(name, sizeof name, "cuda: %s: one capture, one replay per step, every launch in it", md->label);
    CHECK(k->captures == 1 && k->replays == STEPS && k->kernels - k->direct_kernels == (long)STEPS * kernels &&
              k->gemms - k->direct_gemms == (long)STEPS * gemms,
          name, "%ld captures, %ld replays, %ld kernels, %ld GEMMs (plan: %d kernels, %d GEMM launches, %d GEMMs)",
          k->captures, k->replays, k->kernels - k->direct_kernels, k->gemms, kernels, gemms, p->ngemms);
    snprintf(name, sizeof name, "cuda: %s: cuBLASLt is told each GEMM's types (%d of %d with bf16 A and B, %d with "
             "a bf16 D)", md->label, ab16, p->ngemms, d16);
    CHECK(k->described == p->ngemms && k->ab16 == ab16 && k->d16 == d16 && (!bf16 || ab16 == p->ngemms),
          name, "the fake accepted %ld, %ld with bf16 A and B, %ld with a bf16 D", k->described, k->ab16, k->d16);
    // The three candidates of one GEMM of each kind (shape, types, layout and epilogue; the layers
    // repeat kinds) were run when the engine was built, once untimed and three times timed, then every
    // GEMM once more on the one kept; the slow first is in no replay.
    int kinds = gemm_kinds(p);
    snprintf(name, sizeof name, "cuda: %s: each GEMM runs on the fastest of the heuristic's candidates, timed when "
             "the engine is built once for each kind of GEMM (%d of %d)", md->label, kinds, p->ngemms);
    bool layers = md->path && strstr(md->path, "gpt2"); // (two layers: their GEMMs are of the same kinds)
    CHECK(k->direct_gemms == 3L * 4 * kinds + p->ngemms && k->slow_replayed == 0 && (!layers || kinds < p->ngemms),
          name,
          "%ld GEMMs run before the steps (%d GEMMs of %d kinds, 3 candidates each), %ld replayed on the slow "
          "candidate", k->direct_gemms, p->ngemms, kinds, k->slow_replayed);
    Engine *es[] = {cuda};
    int64_t bad = 0;
    for (int i = 0; i < c.g->n; i++)
      if (c.g->nodes[i]->op == OP_CROSS_ENTROPY)
        bad = c.g->nodes[c.g->nodes[i]->in[0]]->shape.d[c.g->nodes[c.g->nodes[i]->in[0]]->shape.rank - 1] + 44;
    set_batch(c.g, es, 1, bad);
    bool ok = cuda->step(cuda, why, sizeof why);
    char want[64];
    snprintf(want, sizeof want, "%lld out of range", (long long)bad);
    snprintf(name, sizeof name, "cuda: %s: a target out of range ends the step", md->label);
    CHECK(!ok && contains(why, "target") && contains(why, want), name, "%s", ok ? "the step ran" : why);
    set_batch(c.g, es, 1, 0);
    ok = cuda->step(cuda, why, sizeof why);
    snprintf(name, sizeof name, "cuda: %s: the next good step runs", md->label);
    CHECK(ok, name, "%s", why);
    int w = c.g->params[0];
    int64_t count = shape_numel(c.g->nodes[w]->shape);
    float *vals = calloc((size_t)count, sizeof *vals), *back = calloc((size_t)count, sizeof *back);
    for (int64_t i = 0; i < count; i++)
      vals[i] = (float)i - 0.5f;
    cuda->write(cuda, w, vals);
    cuda->read(cuda, w, back);
    snprintf(name, sizeof name, "cuda: %s: a parameter written reads back", md->label);
    CHECK(!memcmp(vals, back, sizeof(float) * (size_t)count), name, "%s differs", c.g->nodes[w]->name);
    if (c.m->copy_of[w] >= 0) {
      cuda->read(cuda, c.m->copy_of[w], back);
      int64_t differ = 0;
      for (int64_t i = 0; i < count; i++)
        differ += back[i] != (float)round_bf16(vals[i]);
      snprintf(name, sizeof name, "cuda: %s: ... and its bf16 copy holds the values rounded", md->label);
      CHECK(differ == 0, name, "%lld of %lld differ", (long long)differ, (long long)count);
    }
    free(vals);
    free(back);
    snapshot_checks(md->label, &c, cuda, k, h);
    if (!bf16 && md->path && !strcmp(md->path, "models/gpt2-tiny.mdl"))
      train_checks(md->label, &c, k);
    ref->free(ref);
    cuda->free(cuda);
    snprintf(name, sizeof name, "cuda: %s: freeing the engine frees the device memory and the module", md->label);
    CHECK(k->live_allocations == 0 && k->modules == 0, name, "%ld allocations, %ld modules", k->live_allocations,
          k->modules);
    profile_checks(md->label, &c, k);
    setenv("FAKE_GPU_MEMORY", "100000", 1);
    cuda = engine_cuda(c.f, c.m, plan_for(c.f, c.m), 5, true, true, why, sizeof why);
    unsetenv("FAKE_GPU_MEMORY");
    char takes[64];
    snprintf(takes, sizeof takes, "(the step's arena %.2f GB)", (double)p->arena_bytes / 1e9);
    snprintf(name, sizeof name, "cuda: %s: an allocation that fails is named, with what the arena takes and what is "
             "free, and leaks nothing", md->label);
    CHECK(!cuda && !strncmp(why, "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY: ", 38) && contains(why, takes) &&
              contains(why, "GB of the device's 4.29 were free") && contains(why, "--accumulate") &&
              k->live_allocations == 0,
          name, "%s; %ld allocations", cuda ? "the engine started" : why, k->live_allocations);
    if (cuda)
      cuda->free(cuda);
    // Without tuning (--no-gemm-tuning) every GEMM runs on the heuristic's first candidate, untimed:
    // one run each before the steps (the eager check), and every replayed GEMM on the slow one.
    long direct = k->direct_gemms, slow = k->slow_replayed;
    cuda = engine_cuda(c.f, c.m, plan_for(c.f, c.m), 5, false, true, why, sizeof why);
    ok = cuda != NULL;
    if (cuda) {
      Engine *one[] = {cuda};
      set_batch(c.g, one, 1, 0);
      ok = cuda->step(cuda, why, sizeof why);
      cuda->free(cuda);
    }
    snprintf(name, sizeof name, "cuda: %s: with GEMM tuning off each GEMM replays on the heuristic's first "
             "candidate, untimed", md->label);
    CHECK(ok && k->direct_gemms - direct == p->ngemms && k->slow_replayed - slow == gemms, name,
          "%s; %ld GEMMs run before the step (%d GEMMs), %ld of %d replayed on the first candidate", ok ? "ran" : why,
          k->direct_gemms - direct, p->ngemms, k->slow_replayed - slow, gemms);
    device_copy_checks(md->label, &c, k);
    device_draw_checks(md->label, &c, k);
    if (bf16 && md->path && strstr(md->path, "gpt2")) // (attention on tensor cores)
      variant_checks(md->label, &c, k);
  }
  if (h)
    dlclose(h);
  unsetenv("MDL_LIBCUDA");
  unsetenv("MDL_LIBCUBLASLT");
  unsetenv("MDL_NVRTC_THREADS");
  arena_free(c.a);
}

static float *read_all(Engine *e, int node) {
  int64_t n = shape_numel(e->g->nodes[node]->shape);
  float *x = calloc((size_t)(n ? n : 1), sizeof *x);
  e->read(e, node, x);
  return x;
}

// Two fp8 states alike: the same steps recorded, the scales and histories bit for bit (hist: those too).
static bool same_fp8(const Fp8State *x, const Fp8State *y, bool hist) {
  return x && y && x->n == y->n && x->H == y->H && x->recorded == y->recorded &&
         !memcmp(x->scale, y->scale, sizeof(float) * (size_t)x->n) &&
         (!hist || !memcmp(x->hist, y->hist, sizeof(float) * (size_t)x->n * (size_t)x->H));
}

// train_run of a fresh fp8 engine on the corpus into `out`: `steps` steps, a checkpoint every 2,
// resuming the checkpoint there when `resume`. The engine, or NULL after a failed run (why says so).
static Engine *fp8_train(const Compiled *c, const char *data, const char *out, int64_t steps, bool resume, char *why,
                         size_t n) {
  Engine *e = engine_cuda(c->f, c->m, plan_for(c->f, c->m), 7, true, true, why, n);
  TrainOptions to = {.model_path = "models/gpt2-tiny.mdl", .data_dir = data, .tokenizer_path = "tokenizer.bin",
                     .out_dir = out, .steps = steps, .seed = 7, .val_every = 0, .val_batches = 1, .ckpt_every = 2,
                     .resume = resume, .quiet = true};
  if (e && train_run(e, NULL, NULL, &to) != 0) {
    snprintf(why, n, "train_run failed");
    e->free(e);
    e = NULL;
  }
  return e;
}

// The amax hook of fp8_hook_checks (Engine.set_fp8_amax): counts its calls, and at step `raise_at`
// sets tensor 0's amax to `to`.
typedef struct {
  int calls, step, raise_at;
  float to;
} Fp8Hook;

static bool fp8_hook(void *ctx, float *amax, int n, char *err, size_t en) {
  (void)err, (void)en;
  Fp8Hook *h = ctx;
  h->calls++;
  if (h->step == h->raise_at && n > 0)
    amax[0] = h->to;
  return true;
}

static bool fp8_step_one(Engine *e, int s, char *why, size_t n) {
  e->set_seed(e, 1000 + (uint64_t)s);
  e->set_scalar(e, "lr", 2e-3);
  e->set_scalar(e, "step", (double)s);
  return e->step(e, why, n);
}

// The amax hook on the graphs' engine (as tests/unit/test_fp8_cpu.c's test_share checks the CPU
// engines'): it runs after the first step's calibration pass and after its first part (2 calls), then
// once a step; an amax it raises is the one rolled into the history and scaled by; a NaN one skips
// the step (every parameter and history as it was), as one all-reduced over ranks would on each.
static void fp8_hook_checks(const Compiled *c) {
  const Graph *g = c->g;
  char why[1024] = "", name[300];
  Engine *e = engine_cuda(c->f, c->m, plan_for(c->f, c->m), 5, true, true, why, sizeof why);
  CHECK(e && e->set_fp8_amax && e->set_fp8_lead, "cuda: gpt2-tiny fp8: the engine has the amax and lead hooks",
        "%s", e ? "missing" : why);
  if (!e || !e->set_fp8_amax) {
    if (e)
      e->free(e);
    return;
  }
  set_batch(g, &e, 1, 0);
  Fp8Hook h = {.raise_at = 2, .to = 1000};
  e->set_fp8_amax(e, fp8_hook, &h);
  const Fp8State *st = e->fp8(e);
  h.step = 1;
  bool ok = fp8_step_one(e, 1, why, sizeof why);
  int first = h.calls;
  h.step = 2;
  ok = ok && fp8_step_one(e, 2, why, sizeof why);
  bool low, rolled = false;
  for (int j = 0; j < st->H; j++)
    rolled |= st->hist[j] == 1000;
  CHECK(ok && first == 2 && h.calls == 3 && st->recorded == 3 && rolled &&
            st->scale[0] == fp8_scale(g->fp8[0].fmt, 1000, &low),
        "cuda: gpt2-tiny fp8: the amax hook runs after the calibration and the step (2 calls), then once a step; "
        "the amax it raises is rolled and scales",
        "%s; calls %d then %d, recorded %lld, %s, scale %g", ok ? "ran" : why, first, h.calls,
        (long long)st->recorded, rolled ? "rolled" : "not in the history", (double)st->scale[0]);
  float **params = calloc((size_t)g->nparams, sizeof *params);
  for (int i = 0; i < g->nparams; i++)
    params[i] = read_all(e, g->params[i]);
  float *hist = malloc(sizeof(float) * (size_t)(st->n * st->H));
  memcpy(hist, st->hist, sizeof(float) * (size_t)(st->n * st->H));
  int64_t recorded = st->recorded;
  h.step = h.raise_at = 3, h.to = NAN;
  ok = fp8_step_one(e, 3, why, sizeof why);
  int moved = 0;
  for (int i = 0; i < g->nparams; i++) {
    float *x = read_all(e, g->params[i]);
    moved += memcmp(x, params[i], sizeof(float) * (size_t)shape_numel(g->nodes[g->params[i]]->shape)) != 0;
    free(x);
    free(params[i]);
  }
  free(params);
  snprintf(name, sizeof name, "cuda: gpt2-tiny fp8: a NaN amax from the hook skips the step (the weights and "
           "histories as they were)");
  CHECK(ok && h.calls == 4 && moved == 0 && st->recorded == recorded &&
            !memcmp(hist, st->hist, sizeof(float) * (size_t)(st->n * st->H)),
        name, "%s; %d calls, %d parameters moved, recorded %lld", ok ? "ran" : why, h.calls, moved,
        (long long)st->recorded);
  free(hist);
  e->set_fp8_amax(e, NULL, NULL);
  e->free(e);
}

// A model in its precision with `accumulate` micro-batches a step, its whole step (optimizer) or its
// gradients only (train.c's micro-batches' engine: no optimizer, no gradient norm, compiled as
// main.c's open_side_engine compiles it).
static bool compile_step(const Model *md, int64_t accumulate, bool optimizer, Compiled *c) {
  c->a = arena_new();
  c->g = mdl_compile_file(c->a, md->path, md->ov, md->nov);
  char why[256];
  if (c->g)
    c->g->train.accumulate = accumulate;
  if (!c->g || !autodiff(c->g, optimizer) || !precision_assign(c->g, md->prec, why, sizeof why))
    return false;
  c->f = fuse(c->g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
  c->m = memplan(c->f);
  return true;
}

// A led gradients-only engine (Engine.set_fp8_lead), on the emulated GPU and on the interpreter, from
// the same parameters and batch, two passes: with every scale 1 (a calibration's), then with scales of
// 1/4 to 4 by tensor. Each casts with the lead's scales as given (its state's scales are a copy of
// them), neither calibrates nor rolls a history, and leaves its amaxes, within 1e-4 relative of the
// interpreter's, and its loss within 1e-5.
static void fp8_lead_checks(const Model *md) {
  char why[1024] = "", so[512], name[300];
  Compiled c;
  if (!compile_step(md, 1, false, &c)) {
    CHECK(false, "cuda: gpt2-tiny fp8 gradients-only compiles", "front end, autodiff or the fp8 pass failed");
    arena_free(c.a);
    return;
  }
  const Graph *g = c.g;
  const CudaPlan *p;
  const Counters *(*counters)(void);
  void *h;
  if (!use_fake_gpu(&c, "gpt2_tiny_fp8_grads", "gpt2-tiny fp8 gradients-only", &p, so, sizeof so, &h, &counters))
    return;
  Engine *es[2] = {engine_cuda(c.f, c.m, plan_for(c.f, c.m), 5, true, true, why, sizeof why), engine_interp(g, INTERP_F32, 5)};
  CHECK(es[0] && es[0]->set_fp8_lead && g->nfp8 > 0,
        "cuda: gpt2-tiny fp8 gradients-only: the engine starts, with the lead hook", "%s",
        es[0] ? "no hook or no scaled tensor" : why);
  if (!es[0] || !es[0]->set_fp8_lead || g->nfp8 == 0)
    goto done;
  float *lead = malloc(sizeof(float) * (size_t)g->nfp8);
  set_batch(g, es, 2, 0);
  bool ok = true, led = true;
  double amax_err = 0, loss_err = 0;
  int some = 0;
  for (int s = 1; ok && s <= 2; s++) {
    for (int t = 0; t < g->nfp8; t++)
      lead[t] = s == 1 ? 1.0f : ldexpf(1, t % 5 - 2);
    for (int i = 0; ok && i < 2; i++) {
      es[i]->set_fp8_lead(es[i], lead);
      ok = fp8_step_one(es[i], s, why, sizeof why);
    }
    if (!ok)
      break;
    const Fp8State *x = es[0]->fp8(es[0]), *r = es[1]->fp8(es[1]);
    led &= !memcmp(x->scale, lead, sizeof(float) * (size_t)x->n) && x->recorded == 0;
    for (int j = 0; j < x->n * x->H; j++)
      led &= x->hist[j] == 0;
    for (int t = 0; t < x->n; t++) {
      some += x->amax[t] > 0 && isfinite(x->amax[t]);
      amax_err = fmax(amax_err, fabs((double)x->amax[t] - r->amax[t]) / fmax(r->amax[t], 1e-30));
    }
    double lc = engine_scalar(es[0], g->loss), li = engine_scalar(es[1], g->loss);
    loss_err = fmax(loss_err, fabs(lc - li) / fabs(li));
  }
  free(lead);
  snprintf(name, sizeof name, "cuda: gpt2-tiny fp8 gradients-only: a led engine casts with the lead's scales, "
           "neither calibrates nor rolls a history; its amaxes within 1e-4 of the interpreter's led engine's (worst "
           "%.1e), its loss within 1e-5 (%.1e)", amax_err, loss_err);
  CHECK(ok && led && some > 0 && amax_err <= 1e-4 && loss_err <= 1e-5, name, "%s; %s, %d amaxes recorded",
        ok ? "ran" : why, led ? "led" : "scales or histories its own", some);
  const Counters *k = counters ? counters() : NULL;
  es[0]->free(es[0]);
  es[0] = NULL;
  CHECK(k && k->live_allocations == 0 && k->modules == 0,
        "cuda: gpt2-tiny fp8 gradients-only: the engine frees its device memory", "%ld allocations, %ld modules",
        k ? k->live_allocations : -1, k ? k->modules : -1);
done:
  for (int i = 0; i < 2; i++)
    if (es[i])
      es[i]->free(es[i]);
  if (h)
    dlclose(h);
  unsetenv("MDL_LIBCUDA");
  unsetenv("MDL_LIBCUBLASLT");
  unsetenv("MDL_NVRTC_THREADS");
  arena_free(c.a);
}

// Gradient accumulation in fp8 through train_run (train.c drives the hooks): 3 steps of 2 micro-batches
// at B=1, the step engine and the micro-batches' (gradients-only, led) engine each on its own plan in
// one emulated GPU ($FAKE_SECOND_MODULE), against 3 steps at B=2 of the engine of c (its emulated GPU
// `so`, current on entry and again on return). As tests/cli/fp8.sh checks the CPU engines: the same
// steps recorded, the forward's (E4M3) scales equal and the backward's (E5M2) exactly 2 times smaller
// (a micro-batch's loss is the mean over its own targets: its gradients are 2 times those of one pass
// over both rows), the histories within 1e-5 of those amaxes except the first step's calibration
// (every scale 1: a gradient 2 times larger rounds otherwise), within 5%.
static void fp8_accumulate_checks(const Compiled *c, const char *so) {
  char why[1024] = "", name[400], data[1200], out[1200], so1[512], so2[512];
  Model md = {"gpt2-tiny fp8", "models/gpt2-tiny.mdl", NULL, {{"B", 1}, {"T", 16}}, 2, DT_F8E4M3};
  if (!train_data(data, sizeof data)) {
    CHECK(false, "cuda: gpt2-tiny fp8 accumulate 2: the corpus", "prep failed");
    return;
  }
  TrainOptions to = {.model_path = "models/gpt2-tiny.mdl", .data_dir = data, .tokenizer_path = "tokenizer.bin",
                     .out_dir = out, .steps = 3, .seed = 7, .val_every = 0, .val_batches = 1, .quiet = true};
  snprintf(out, sizeof out, "%s/fp8-b2", tmp);
  Engine *ref = engine_cuda(c->f, c->m, plan_for(c->f, c->m), 7, true, true, why, sizeof why);
  bool ok = ref && train_run(ref, NULL, NULL, &to) == 0;
  Fp8State one = {0};
  if (ok) {
    const Fp8State *st = ref->fp8(ref);
    one = *st;
    one.scale = malloc(sizeof(float) * (size_t)st->n);
    one.hist = malloc(sizeof(float) * (size_t)(st->n * st->H));
    memcpy(one.scale, st->scale, sizeof(float) * (size_t)st->n);
    memcpy(one.hist, st->hist, sizeof(float) * (size_t)(st->n * st->H));
  }
  if (ref)
    ref->free(ref);
  Compiled sc = {0}, mc = {0};
  bool compiled = ok && compile_step(&md, 2, true, &sc) && compile_step(&md, 2, false, &mc);
  const CudaPlan *sp = compiled ? emit_cuda_plan(sc.f, sc.m, sc.g->model) : NULL;
  const CudaPlan *mp = compiled ? emit_cuda_plan(mc.f, mc.m, mc.g->model) : NULL;
  bool built = sp && mp && build_fake_gpu(sp, "gpt2_tiny_fp8_acc", so1, sizeof so1, why, sizeof why) &&
               build_fake_gpu_of(mp, "gpt2_tiny_fp8_micro", true, so2, sizeof so2, why, sizeof why);
  CHECK(ok && built, "cuda: gpt2-tiny fp8 accumulate 2: the run at B=2 trains, and the emulated GPU of the step's "
        "and the micro-batches' plans builds", "%s", !ok ? why : !compiled ? "compile failed" : why);
  Engine *e = NULL, *micro = NULL;
  if (ok && built) {
    setenv("MDL_LIBCUDA", so1, 1);
    setenv("MDL_LIBCUBLASLT", so1, 1);
    e = engine_cuda(sc.f, sc.m, plan_for(sc.f, sc.m), 7, true, true, why, sizeof why);
    setenv("FAKE_SECOND_MODULE", so2, 1);
    micro = e ? engine_cuda(mc.f, mc.m, plan_for(mc.f, mc.m), 7, true, true, why, sizeof why) : NULL;
    unsetenv("FAKE_SECOND_MODULE");
    snprintf(out, sizeof out, "%s/fp8-acc", tmp);
    ok = e && micro && train_run(e, NULL, micro, &to) == 0;
    if (e && micro && !ok)
      snprintf(why, sizeof why, "train_run failed");
  }
  const Fp8State *st = ok && built ? e->fp8(e) : NULL;
  double worst = 0, calib = 0;
  int ratios = 0;
  for (int t = 0; st && t < st->n && st->n == one.n; t++) {
    float q = sc.g->fp8[t].fmt == DT_F8E5M2 ? 2.0f : 1.0f;
    ratios += one.scale[t] / st->scale[t] == q;
    for (int j = 0; j < (st->recorded < st->H ? st->recorded : st->H); j++) {
      double x = one.hist[t * one.H + j], y = st->hist[t * st->H + j] / q, d = fabs(x - y) / fmax(x, 1e-30);
      if (j == st->recorded - 1)
        calib = fmax(calib, d);
      else
        worst = fmax(worst, d);
    }
  }
  snprintf(name, sizeof name, "cuda: gpt2-tiny fp8: train_run with accumulate 2 at B=1 (a led micro-batches' "
           "engine) scales as at B=2: E4M3 scales equal, E5M2 exactly 2 times smaller, amaxes within %.1e "
           "(calibration's %.1e)", worst, calib);
  CHECK(st && st->n == one.n && st->recorded == one.recorded && st->recorded == 4 && ratios == st->n &&
            worst <= 1e-5 && calib <= 0.05,
        name, "%s; %d of %d scales as expected, recorded %lld and %lld", st ? "differ" : why, ratios,
        st ? st->n : 0, st ? (long long)st->recorded : -1, (long long)one.recorded);
  if (micro)
    micro->free(micro);
  if (e)
    e->free(e);
  free(one.scale);
  free(one.hist);
  if (sc.a)
    arena_free(sc.a);
  if (mc.a)
    arena_free(mc.a);
  setenv("MDL_LIBCUDA", so, 1);
  setenv("MDL_LIBCUBLASLT", so, 1);
}

// Precision fp8 on the emulated GPU (the fake cuBLASLt's FP8 rules: both operands fp8, TN, leading
// dimensions of 16): gpt2-tiny (B=2, T=16: B*T a multiple of 16, as the FP8 GEMMs' m, n and k must
// be) on the graphs' engine, on a --profile one (launch by launch) and on the interpreter, from the
// same parameters and batches, 3 steps. The scales are the interpreter's bit for bit after the first
// step (its calibration included) and after each of the others, the losses within 1e-5 relative,
// the gradients after the first step within 1e-4 in L2 (bf16's tolerance is 4e-3; the emulated GEMMs
// sum the same decoded codes in another order), the profiled engine's state and loss the graphs' bit
// for bit; cuBLASLt is told fp8 A and B for every fp8 GEMM of the plan (TN: it accepts no other) and
// refuses none. A weight made infinite through Engine.write gives a non-finite amax: the step runs,
// every parameter is unchanged, the histories do not roll and the state names the tensor. train_run
// with a checkpoint every 2 steps records the fp8 state of the step its snapshot holds, and an engine
// resumed from the checkpoint of step 4 reaches step 6 with the scales and histories of a run of 6.
static void fp8_checks(void) {
  Model md = {"gpt2-tiny fp8", "models/gpt2-tiny.mdl", NULL, {{"B", 2}, {"T", 16}}, 2, DT_F8E4M3};
  char name[400], why[1024], so[512];
  Compiled c;
  if (!compile_model(&md, &c)) {
    CHECK(false, "cuda: gpt2-tiny fp8 compiles", "front end, autodiff or the fp8 pass failed");
    arena_free(c.a);
    return;
  }
  const Graph *g = c.g;
  const CudaPlan *p;
  const Counters *(*counters)(void);
  void *h;
  if (!use_fake_gpu(&c, "gpt2_tiny_fp8", "gpt2-tiny fp8", &p, so, sizeof so, &h, &counters))
    return;
  int f8 = 0, e5 = 0;
  for (int i = 0; i < p->ngemms; i++) {
    const CudaGemm *gm = &p->gemms[i];
    bool fp8 = gm->ab == DT_F8E4M3 || gm->ab == DT_F8E5M2;
    f8 += fp8;
    e5 += fp8 && (gm->ab == DT_F8E5M2 || gm->b_fp8 == DT_F8E5M2);
  }
  Engine *es[3] = {engine_cuda(c.f, c.m, plan_for(c.f, c.m), 5, true, true, why, sizeof why), NULL, NULL};
  const Counters *k = counters ? counters() : NULL;
  snprintf(name, sizeof name, "cuda: gpt2-tiny fp8: the engine starts; cuBLASLt is told fp8 A and B for each of the "
           "plan's %d fp8 GEMMs (%d with an E5M2 operand) and refuses none", f8, e5);
  CHECK(es[0] && k && f8 > 0 && k->f8 == f8 && k->e5m2 == e5 && k->f8_refused == 0, name, "%s",
        !es[0] ? why : !k ? "no fake_counters" : "counts differ");
  if (es[0] && k)
    printf("  (fp8 GEMMs described: %ld, with E5M2: %ld, refused: %ld)\n", k->f8, k->e5m2, k->f8_refused);
  es[1] = es[0] ? engine_cuda(c.f, c.m, plan_for(c.f, c.m), 5, true, true, why, sizeof why) : NULL;
  if (!es[0] || !es[1] || !k) {
    for (int i = 0; i < 2; i++)
      if (es[i])
        es[i]->free(es[i]);
    goto done;
  }
  es[1]->profile = true;
  es[2] = engine_interp(g, INTERP_F32, 5);
  set_batch(g, es, 3, 0);
  bool ok = true, scales = true, profiled = true;
  double loss_err = 0, grad_err = 0;
  const char *worst_at = "";
  for (int s = 1; ok && s <= 3; s++) {
    for (int i = 0; ok && i < 3; i++) {
      es[i]->set_seed(es[i], 1000 + (uint64_t)s);
      es[i]->set_scalar(es[i], "lr", 2e-3);
      es[i]->set_scalar(es[i], "step", (double)s);
      ok = es[i]->step(es[i], why, sizeof why);
    }
    if (!ok)
      break;
    scales &= same_fp8(es[0]->fp8(es[0]), es[2]->fp8(es[2]), false);
    double lc = engine_scalar(es[0], g->loss), li = engine_scalar(es[2], g->loss);
    loss_err = fmax(loss_err, fabs(lc - li) / fabs(li));
    profiled &= same_fp8(es[0]->fp8(es[0]), es[1]->fp8(es[1]), true) && lc == engine_scalar(es[1], g->loss);
    for (int i = 0; s == 1 && i < g->nparams; i++) {
      double r = rel_error(es[0], es[2], g->grads[i], true);
      if (!(r <= grad_err))
        grad_err = r, worst_at = g->nodes[g->params[i]]->name;
    }
  }
  CHECK(ok, "cuda: gpt2-tiny fp8: 3 steps run on the graphs, on --profile and on the interpreter", "%s", why);
  // (4 steps of amaxes in the histories after 3: the calibration's count, as on the CPU)
  CHECK(ok && scales && es[0]->fp8(es[0])->recorded == 4,
        "cuda: gpt2-tiny fp8: the scales are the interpreter's bit for bit after the first step (calibration) and "
        "each of 3", "they differ, or %lld steps recorded", (long long)es[0]->fp8(es[0])->recorded);
  snprintf(name, sizeof name, "cuda: gpt2-tiny fp8: the losses of 3 steps within 1e-5 relative of the interpreter's "
           "(worst %.1e)", loss_err);
  CHECK(ok && loss_err <= 1e-5, name, "%.3g", loss_err);
  snprintf(name, sizeof name, "cuda: gpt2-tiny fp8: every gradient after the first step within 1e-4 in L2 of the "
           "interpreter's (worst %.1e, %s)", grad_err, worst_at);
  CHECK(ok && grad_err <= 1e-4, name, "%.3g at %s", grad_err, worst_at);
  CHECK(ok && profiled && k->captures == 4,
        "cuda: gpt2-tiny fp8: two graphs an engine, cut at the optimizer; --profile reaches their scales, "
        "histories and losses bit for bit", "%s; %ld captures", profiled ? "" : "they differ", k->captures);

  // A weight read by an fp8 GEMM made infinite: its cast's amax is not finite.
  int w = -1, t = -1;
  for (int i = 0; i < g->n && w < 0; i++) {
    const IrNode *x = g->nodes[i];
    if (x->op == OP_CAST && (x->dtype == DT_F8E4M3 || x->dtype == DT_F8E5M2) && g->nodes[x->in[0]]->op == OP_PARAM)
      w = x->in[0], t = (int)x->ia[1];
  }
  if (w >= 0) {
    float *v = read_all(es[0], w);
    v[0] = INFINITY;
    es[0]->write(es[0], w, v);
    free(v);
    Fp8State before = *es[0]->fp8(es[0]);
    float *scale = malloc(sizeof(float) * (size_t)before.n);
    memcpy(scale, before.scale, sizeof(float) * (size_t)before.n);
    float **params = calloc((size_t)g->nparams, sizeof *params);
    for (int i = 0; i < g->nparams; i++)
      params[i] = read_all(es[0], g->params[i]);
    es[0]->set_scalar(es[0], "step", 4);
    ok = es[0]->step(es[0], why, sizeof why);
    int moved = 0;
    for (int i = 0; i < g->nparams; i++) {
      float *x = read_all(es[0], g->params[i]);
      moved += memcmp(x, params[i], sizeof(float) * (size_t)shape_numel(g->nodes[g->params[i]]->shape)) != 0;
      free(x);
      free(params[i]);
    }
    free(params);
    const Fp8State *st = es[0]->fp8(es[0]);
    char what[256] = "";
    bool named = fp8_state_check(st, g, what, sizeof what);
    snprintf(name, sizeof name, "cuda: gpt2-tiny fp8: an infinite weight (%s) skips the step: every parameter "
             "unchanged, the histories not rolled, the tensor named", g->nodes[w]->name);
    CHECK(ok && moved == 0 && st->recorded == before.recorded &&
              !memcmp(st->scale, scale, sizeof(float) * (size_t)st->n) && named && strstr(what, g->fp8[t].name) &&
              strstr(what, "inf"),
          name, "%s; %d parameters moved; %lld recorded; '%s'", ok ? "ran" : why, moved, (long long)st->recorded, what);
    free(scale);
  } else {
    CHECK(false, "cuda: gpt2-tiny fp8: a weight cast to fp8", "none found");
  }
  for (int i = 0; i < 3; i++)
    es[i]->free(es[i]);

  // Checkpoints: a run of 4 steps (checkpoints at 2 and 4, each a snapshot), resumed to 6, against a
  // run of 6.
  char data[1200], out4[1200], out6[1200], ckpt[1300];
  snprintf(out4, sizeof out4, "%s/fp8-out4", tmp);
  snprintf(out6, sizeof out6, "%s/fp8-out6", tmp);
  snprintf(ckpt, sizeof ckpt, "%s/checkpoint.safetensors", out4);
  long copies = k->device_copies;
  Engine *e = train_data(data, sizeof data) ? fp8_train(&c, data, out4, 4, false, why, sizeof why) : NULL;
  Arena *a = arena_new();
  StFile sf;
  ok = e && st_read(a, ckpt, &sf);
  const StTensor *sc = ok ? st_find(&sf, "fp8.scale") : NULL, *hi = ok ? st_find(&sf, "fp8.amax_history") : NULL;
  const char *rec = ok ? st_meta(&sf, "mdl.fp8_recorded") : NULL;
  const Fp8State *st = e ? e->fp8(e) : NULL;
  // (5 steps of amaxes after 4: the first step's calibration counts)
  CHECK(ok && k->device_copies - copies == 6 && sc && hi && rec && st && atoll(rec) == st->recorded &&
            st->recorded == 5 && !memcmp(sc->data, st->scale, sizeof(float) * (size_t)st->n) &&
            !memcmp(hi->data, st->hist, sizeof(float) * (size_t)st->n * (size_t)st->H),
        "cuda: gpt2-tiny fp8: train_run's checkpoints, each a snapshot, record the fp8 state of the step they hold",
        "%s; %ld device copies; recorded %s", !e ? why : !ok ? "no checkpoint" : "the state differs",
        k->device_copies - copies, rec ? rec : "none");
  if (e)
    e->free(e);
  arena_free(a);
  Engine *resumed = ok ? fp8_train(&c, data, out4, 6, true, why, sizeof why) : NULL;
  Engine *straight = resumed ? fp8_train(&c, data, out6, 6, false, why, sizeof why) : NULL;
  CHECK(resumed && straight && same_fp8(resumed->fp8(resumed), straight->fp8(straight), true) &&
            straight->fp8(straight)->recorded == 7,
        "cuda: gpt2-tiny fp8: resumed at step 4, an engine reaches step 6 with the scales and histories of a run of 6 "
        "steps, bit for bit", "%s", resumed && straight ? "they differ" : why);
  if (resumed)
    resumed->free(resumed);
  if (straight)
    straight->free(straight);
  fp8_hook_checks(&c);
  fp8_accumulate_checks(&c, so);
  CHECK(k->live_allocations == 0 && k->modules == 0, "cuda: gpt2-tiny fp8: the engines free their device memory",
        "%ld allocations, %ld modules", k->live_allocations, k->modules);
done:
  if (h)
    dlclose(h);
  unsetenv("MDL_LIBCUDA");
  unsetenv("MDL_LIBCUBLASLT");
  unsetenv("MDL_NVRTC_THREADS");
  arena_free(c.a);
  fp8_lead_checks(&md);
}

// A real GPU: gpt2-tiny on it and on the interpreter, fp32 (within 1e-4) and with bf16 GEMM operands
// (within 4e-3 in L2, as the emulated GPU: cuBLASLt sums in yet another order, so more values round
// to the other bf16 neighbour than in the emulation); on sm_89 or later in fp8 too, within bf16's
// 4e-3 in L2 (cuBLASLt's FP8 kernels sum the same codes in their own order).
static void gpu_checks(void) {
  static const Model models[] = {
      {"gpt2-tiny on the GPU", "models/gpt2-tiny.mdl", NULL, {{"B", 2}, {"T", 16}}, 2, DT_F32},
      {"gpt2-tiny bf16 on the GPU", "models/gpt2-tiny.mdl", NULL, {{"B", 2}, {"T", 16}}, 2, DT_BF16},
      {"gpt2-tiny fp8 on the GPU", "models/gpt2-tiny.mdl", NULL, {{"B", 2}, {"T", 16}}, 2, DT_F8E4M3},
  };
  CudaDevice dev;
  char devwhy[256];
  int cc = cuda_device(&dev, devwhy, sizeof devwhy) ? cuda_compute_capability(&dev) : 0;
  for (size_t i = 0; i < sizeof models / sizeof *models; i++) {
    const Model *md = &models[i];
    bool bf16 = md->prec != DT_F32;
    char name[256], why[1024];
    if (md->prec == DT_F8E4M3 && cc < 89) {
      printf("[skip] cuda: %s: the GPU (sm_%d) has no FP8 tensor cores\n", md->label, cc);
      continue;
    }
    Compiled c;
    if (!compile_model(md, &c)) {
      snprintf(name, sizeof name, "cuda: %s compiles", md->label);
      CHECK(false, name, "front end, autodiff or precision failed");
      arena_free(c.a);
      continue;
    }
    Engine *cuda = engine_cuda(c.f, c.m, plan_for(c.f, c.m), 5, true, true, why, sizeof why);
    snprintf(name, sizeof name, "cuda: %s: the engine starts", md->label);
    CHECK(cuda, name, "%s", why);
    if (cuda) {
      Engine *ref = engine_interp(c.g, INTERP_F32, 5);
      compare_engines(md->label, cuda, ref, 1, bf16 ? 4e-3 : 1e-4, bf16, c.m, 0);
      ref->free(ref);
      cuda->free(cuda);
    }
    arena_free(c.a);
  }
}

// MFU's peak by device: NVIDIA's bf16 dense figure for the names it knows, as whole words (an H20 is
// no H200, an A10 no A100), else an estimate from the arch and the SMs that says it is one.
static void peak_checks(void) {
  static const struct {
    const char *name, *arch;
    int sms;
    double tflops;
    const char *says;
  } cases[] = {
      {"NVIDIA H100 80GB HBM3", "sm_90", 132, 989, "H100 SXM"}, {"NVIDIA H100 PCIe", "sm_90", 114, 756, "H100 PCIe"},
      {"NVIDIA H200", "sm_90", 132, 989, "H200"},               {"NVIDIA H20", "sm_90", 78, 148, "H20 bf16"},
      {"NVIDIA A100-SXM4-80GB", "sm_80", 108, 312, "A100"},     {"NVIDIA A10", "sm_86", 72, 125, "A10 bf16"},
      {"NVIDIA L4", "sm_89", 58, 121, "L4 bf16"},               {"NVIDIA L40S", "sm_89", 142, 362, "L40S"},
      {"NVIDIA B200", "sm_100", 148, 2250, "B200"},
      {"NVIDIA RTX PRO 6000 Blackwell", "sm_120", 188, 188 * 512 * 1.7e-3, "estimated as 188 SMs x 512 flops"},
      {"Some Future GPU", "sm_100", 100, 100 * 8192 * 1.7e-3, "estimated as 100 SMs x 8192 flops"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    CudaDevice d = {.sm_count = cases[i].sms};
    snprintf(d.name, sizeof d.name, "%s", cases[i].name);
    snprintf(d.arch, sizeof d.arch, "%s", cases[i].arch);
    char how[160], name[256];
    double peak = cuda_bf16_peak(&d, how, sizeof how);
    snprintf(name, sizeof name, "cuda: MFU's peak on %s (%s): %.0f TFLOP/s", cases[i].name,
             cases[i].arch, cases[i].tflops);
    CHECK(fabs(peak - cases[i].tflops * 1e12) < 1e9 && contains(how, cases[i].says), name, "%.0f TFLOP/s, \"%s\"",
          peak / 1e12, how);
  }
}

int main(void) {
  unsetenv("MDL_LIBCUDA");
  unsetenv("MDL_LIBCUBLASLT");
  if (!mkdtemp(tmp)) {
    CHECK(false, "cuda: a temporary directory", "mkdtemp failed");
    TEST_EXIT();
  }
  char cache[600];
  snprintf(cache, sizeof cache, "%s/cache", tmp);
  setenv("MDL_CACHE", cache, 1);
  char why[512];
  void *real = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (real) {
    printf("[skip] cuda: the no-driver checks: this machine has libcuda.so.1\n");
    dlclose(real);
    if (cuda_probe(why, sizeof why))
      gpu_checks();
    else
      printf("[skip] cuda: the GPU checks: %s\n", why);
  } else {
    no_driver_checks();
  }
  probe_checks();
  peak_checks();
  if (!nvrtc_available(why, sizeof why)) {
    printf("[skip] cuda: the emulated GPU: %s\n", why);
  } else if (system("g++ --version >/dev/null 2>&1") != 0) {
    printf("[skip] cuda: the emulated GPU: no g++\n");
  } else {
    // In bf16 the batched model's s = a @ a^T is only read rounded: a batched GEMM with a bf16 D.
    static const Model models[] = {
        {"gpt2-tiny", "models/gpt2-tiny.mdl", NULL, {{"B", 2}, {"T", 16}}, 2, DT_F32},
        {"batched matmuls", NULL, batched_src, {{0}}, 0, DT_F32},
        {"dropout", NULL, dropout_src, {{0}}, 0, DT_F32},
        {"gpt2-tiny bf16", "models/gpt2-tiny.mdl", NULL, {{"B", 2}, {"T", 16}}, 2, DT_BF16},
        {"batched matmuls bf16", NULL, batched_src, {{0}}, 0, DT_BF16},
    };
    for (size_t i = 0; i < sizeof models / sizeof *models; i++)
      emulated_checks(&models[i]);
    fp8_checks();
  }
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
  if (system(cmd) != 0)
    printf("could not remove %s\n", tmp);
  TEST_EXIT();
}
#endif
