// emit_cuda.h: the CUDA back end's compiler side. emit_cuda (compiler/emit/emit_cuda.c) turns a step plan
// into one CUDA C++ translation unit plus a launch schedule; nvrtc.c compiles that text into cubins,
// several programs at once each holding a share of its kernels (NVRTC loaded at run time, never
// linked), and caches them on disk. runtime/engine/cuda.c reads a CudaPlan and runs it: it needs no parsing
// of the generated text.
//
// The device arena is MemPlan's arena followed by step-local scratch (reduction partials, attention
// row statistics, the LM head's logits chunk, values a step keeps to itself): CudaPlan.arena_bytes
// in all. Every kernel has the same parameters:
//   extern "C" __global__ void NAME(char *arena, MdlStatus *status, const uint64_t *seed, int64_t chunk, MdlArgs o)
//   - arena:  the device arena (256-byte aligned, as cuMemAlloc returns it);
//   - status: a zeroed MdlStatus in device memory, set by the first kernel that meets a bad id or
//             target (code CUDA_ERR_*, the value and the limit): read it back after the step;
//   - seed:   the step's seed (dropout masks), in device memory: the host writes it before each
//             step, so a graph captured once replays with each step's seed;
//   - chunk:  CudaLaunch.chunk (the LM head's first row of the chunk, else 0);
//   - o:      MdlArgs by value, o.b[i] = CudaLaunch.args[i]: byte offsets in the arena of the buffers
//             the kernel reads and writes. Kernels with the same code (the layers of a model) are
//             emitted once and launched with different offsets.
// Kernels size their shared memory statically and are launched with 0 bytes of dynamic shared memory.
#ifndef MDL_EMIT_CUDA_H
#define MDL_EMIT_CUDA_H
#include "mdl.h"

// The kernels' status and offsets arguments (MdlStatus: set is 0 until a kernel reports; MdlArgs),
// the text the CUDA prelude carries.
#include "cuda_args.h"

enum { CUDA_MAX_ARGS = sizeof(MdlArgs) / sizeof(int64_t) }; // MdlArgs.b: the most buffers one kernel addresses

enum { CUDA_ERR_NONE, CUDA_ERR_EMBED_ID, CUDA_ERR_TARGET };

// Epilogues cuBLASLt applies to a GEMM: D = A B (+ bias along the rows) (then GELU, tanh form).
typedef enum { CUDA_EPI_NONE, CUDA_EPI_BIAS, CUDA_EPI_GELU, CUDA_EPI_BIAS_GELU } CudaEpilogue;

// One GEMM, row-major: C = op(A) op(B) + beta C, op = transpose when ta / tb, m x n output, inner
// dimension k; the same for `batch` matrices at the given strides (elements; 0 = the same matrix for
// every batch). The epilogue then adds bias[j] to every row (BIAS kinds), writes that value to aux
// (GELU kinds, when aux >= 0; leading dimension ldc) and applies GELU to C (GELU kinds).
// Element types: A and B are both f32 or both bf16 (ab); products are summed in f32 whatever they
// are. Or both fp8 (precision fp8: A's type ab, B's b_fp8, each E4M3 or E5M2): the sums are then
// multiplied by A's and B's dequantisation factors (1 / scale, f32 at byte offsets a_scale and
// b_scale), cuBLASLt's A and B scale pointers. An fp8 GEMM is always in cuBLASLt's FP8 layout, ta
// false and tb true (the precision pass's fp8_tn_layout), m, n and k multiples of 16, with no
// epilogue, beta 0. C is f32, or bf16 (c_type) when the GEMM's value is only read rounded to bf16 (a CAST): the
// f32 sum is then rounded to nearest even as it is stored. A bf16 C has no epilogue and beta 0; bias
// and aux are always f32. With c_apart the beta term reads another f32 matrix of C's shape and
// leading dimension at byte offset cin (cuBLASLt's out-of-place C; a residual added as the GEMM stores
// its result): C_out = op(A) op(B) + beta C_in (+ bias).
typedef struct {
  int step;                  // index in Fusion.steps
  DType ab, c_type;          // DT_F32 or DT_BF16
  bool ta, tb;
  int64_t m, n, k;
  int64_t lda, ldb, ldc;     // leading dimensions, row-major (elements)
  int64_t batch;             // >= 1
  int64_t stride_a, stride_b, stride_c;
  int64_t a, b, c;           // byte offsets in the device arena
  float beta;                // 0 or 1
  CudaEpilogue epilogue;
  int64_t bias;              // byte offset of bias[n] (BIAS kinds), else -1
  int64_t aux;               // byte offset of the pre-GELU output (GELU kinds), or -1 when not kept
  bool c_apart;              // beta C reads the matrix at cin, not C itself
  int64_t cin;               // c_apart: its byte offset
  DType b_fp8;               // an fp8 GEMM: B's type
  int64_t a_scale, b_scale;  // an fp8 GEMM: the byte offsets of A's and B's 1 / scale
} CudaGemm;

// One entry of the schedule: a kernel launch or a GEMM, in the order they must run.
typedef struct {
  int step;                  // index in Fusion.steps
  const char *kernel;        // the kernel's name, or NULL for a GEMM
  int gemm;                  // index in CudaPlan.gemms, or -1
  unsigned grid[3], block[3];
  int shared;                // static shared memory of the kernel, bytes (for reports)
  int64_t chunk;             // the kernel's chunk argument
  int nargs;
  int64_t args[CUDA_MAX_ARGS]; // MdlArgs.b[0..nargs)
  // A variant of the kernel (another block size: emit_cuda.c's att_mma_variants), or NULL: the same
  // arguments, the same results to the bit; the runtime times both on the device and runs the faster.
  const char *alt;
  unsigned alt_grid[3], alt_block[3];
  int alt_shared;
} CudaLaunch;

// A part of the module that NVRTC can compile apart from the others: a kernel with its comment and its
// tables, source[at, the next unit's at) (the last to the end), which needs only the module's head,
// source[0, the first unit's at) (types and helpers). NVRTC's time on a unit is about proportional
// to the length of its code.
typedef struct {
  size_t at;
  size_t cost;               // the length of the kernel's code (its comment and tables apart), bytes
} CudaUnit;

typedef struct CudaPlan {
  const char *source;        // the translation unit (also what emit_cuda returns)
  CudaUnit *units;           // in the order of source, one per kernel (the first at the head's end)
  int nunits;
  CudaGemm *gemms;
  int ngemms;
  CudaLaunch *launches;
  int nlaunches;
  int nkernels;              // distinct kernels in source
  int64_t scratch;           // where step-local scratch starts (MemPlan's arena size, aligned, and the fp8 region)
  int64_t arena_bytes;       // the whole device arena: scratch + the largest step's scratch
  // Precision fp8: at byte offset fp8 (MemPlan's arena size, aligned), per scaled tensor (Graph.fp8)
  // its scale (f32 [nfp8]), then its 1 / scale (f32 [nfp8]), then its amax this step (u32 [nfp8], the
  // bits of a non-negative float, NaN above infinity; zeroed by the host before a step); nfp8 0: none.
  int64_t fp8;
  int nfp8;
} CudaPlan;

//
// emit_cuda.c: the CUDA emitter.
//
// The whole training step of f's graph as CUDA C++ (for NVRTC, no #include) with its launch schedule.
// Everything is allocated in f->g's arena; NULL (after a message on stderr) when a step cannot be
// emitted. source_path only appears in the file's first comment.
CudaPlan *emit_cuda_plan(const Fusion *f, const MemPlan *m, const char *source_path);
// The source of emit_cuda_plan alone.
char *emit_cuda(const Fusion *f, const MemPlan *m, const char *source_path);
// The prelude every emitted module starts with (types, reductions, gelu, rng, bf16 and fp8 conversions).
const char *emit_cuda_prelude(void);

//
// nvrtc.c: NVRTC, loaded with dlopen, with a cubin cache on disk.
//
typedef struct {
  void *cubin;       // malloc'd; free() it
  size_t size;
  bool cache_hit;
  double seconds;    // spent in NVRTC (0 on a cache hit)
  char *log;         // NVRTC's messages (warnings) of a compile, malloc'd, or NULL (none, or a cache hit)
} NvrtcResult;

// Compiles `src` for arch ("sm_80", "sm_90", ...) to a cubin, cached as
// ($MDL_CACHE or ~/.cache/mdl)/cuda/<sha256 of (source, arch, NVRTC version, MDL_VERSION, options)>.cubin
// (written atomically). False with NVRTC's log (or why it could not run) in err.
bool nvrtc_compile(const char *src, const char *arch, NvrtcResult *out, char *err, size_t n);

// A module compiled as several NVRTC programs at once, one cubin each.
typedef struct {
  int n;                 // programs
  NvrtcResult *parts;    // their cubins (seconds: each program's own time in NVRTC)
  bool cache_hit;        // every cubin came from the cache
  double seconds;        // wall time of the compiles (0 when every cubin came from the cache)
} NvrtcModule;

// Compiles plan's source as up to `threads` programs on as many threads, each the module's head and a
// share of its units (CudaUnit) of about equal cost; each program is cached as nvrtc_compile caches
// one (NVRTC optimising it on its one thread). With threads <= 1, or one unit, a single program of the
// whole source (nvrtc_compile). A kernel is in exactly one of the cubins. False with the first failing
// program's log in err.
bool nvrtc_compile_units(const CudaPlan *plan, const char *arch, int threads, NvrtcModule *out, char *err, size_t n);
void nvrtc_module_free(NvrtcModule *m);
// ptxas's report on src compiled for arch (--ptxas-options=-v, no cache): per kernel the registers,
// the stack and spill bytes and the shared memory, as lines of text (malloc'd) in *report; false with
// NVRTC's log in err.
bool nvrtc_resource_report(const char *src, const char *arch, char **report, char *err, size_t n);
// NVRTC can be loaded; else false with the reason.
bool nvrtc_available(char *why, size_t n);
// The NVRTC version, e.g. 13.0, or false when NVRTC cannot be loaded.
bool nvrtc_version(int *major, int *minor);
// SHA-256 of n bytes as 64 lowercase hex digits (and a NUL).
void nvrtc_sha256_hex(const void *data, size_t n, char hex[65]);
#endif
