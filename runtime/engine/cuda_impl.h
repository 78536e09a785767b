// cuda_impl.h: what the CUDA engine's files share (cuda_driver.c, cuda_gemm.c, cuda.c): the driver API's
// and cuBLASLt's types and entry points as loaded with dlopen, one GEMM ready to run, and the engine.
#ifndef MDL_CUDA_IMPL_H
#define MDL_CUDA_IMPL_H
#include "cuda.h"
#include "fp8_state.h"
#include "emit_cuda.h"

//
// The driver API: the few types and functions we use (from cuda.h, CUDA 12.0 ABI).
//
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUevent_st *CUevent;

enum {
  CUDA_SUCCESS = 0,
  CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  CU_STREAM_NON_BLOCKING = 1,
  CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
  CU_GET_PROC_ADDRESS_DEFAULT = 0,
  CUDA_ABI_VERSION = 12000, // the driver ABI the declarations below follow
};

// name, versioned name (dlsym fallback), parameters
#define CU_FUNCTIONS(X)                                                                                     \
  X(cuInit, "cuInit", (unsigned int flags))                                                                 \
  X(cuDriverGetVersion, "cuDriverGetVersion", (int *version))                                               \
  X(cuGetErrorName, "cuGetErrorName", (CUresult error, const char **name))                                  \
  X(cuDeviceGetCount, "cuDeviceGetCount", (int *count))                                                     \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice * dev, int ordinal))                                              \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute", (int *value, int attribute, CUdevice dev))                \
  X(cuDeviceGetName, "cuDeviceGetName", (char *name, int len, CUdevice dev))                                \
  X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", (size_t * bytes, CUdevice dev))                                \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext * ctx, CUdevice dev))                  \
  X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", (CUdevice dev))                              \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext ctx))                                                    \
  X(cuModuleLoadData, "cuModuleLoadData", (CUmodule * mod, const void *image))                              \
  X(cuModuleUnload, "cuModuleUnload", (CUmodule mod))                                                       \
  X(cuModuleGetFunction, "cuModuleGetFunction", (CUfunction * fn, CUmodule mod, const char *name))          \
  X(cuModuleGetGlobal, "cuModuleGetGlobal_v2", (CUdeviceptr * ptr, size_t *bytes, CUmodule mod, const char *name)) \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr * ptr, size_t bytes))                                         \
  X(cuMemFree, "cuMemFree_v2", (CUdeviceptr ptr))                                                           \
  X(cuMemGetInfo, "cuMemGetInfo_v2", (size_t * free_bytes, size_t *total_bytes))                            \
  X(cuMemsetD8Async, "cuMemsetD8Async", (CUdeviceptr dst, unsigned char value, size_t n, CUstream s))       \
  X(cuMemsetD32Async, "cuMemsetD32Async", (CUdeviceptr dst, unsigned int value, size_t n, CUstream s))      \
  X(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", (void *dst, CUdeviceptr src, size_t bytes, CUstream s))   \
  X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", (CUdeviceptr dst, const void *src, size_t bytes, CUstream s)) \
  X(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s)) \
  X(cuStreamCreate, "cuStreamCreate", (CUstream * s, unsigned int flags))                                   \
  X(cuStreamDestroy, "cuStreamDestroy_v2", (CUstream s))                                                    \
  X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream s))                                               \
  X(cuLaunchKernel, "cuLaunchKernel",                                                                       \
    (CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,           \
     unsigned shared, CUstream s, void **params, void **extra))                                             \
  X(cuStreamBeginCapture, "cuStreamBeginCapture_v2", (CUstream s, int mode))                                \
  X(cuStreamEndCapture, "cuStreamEndCapture", (CUstream s, CUgraph * graph))                                \
  X(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags",                                             \
    (CUgraphExec * exec, CUgraph graph, unsigned long long flags))                                          \
  X(cuGraphLaunch, "cuGraphLaunch", (CUgraphExec exec, CUstream s))                                         \
  X(cuGraphExecDestroy, "cuGraphExecDestroy", (CUgraphExec exec))                                           \
  X(cuGraphDestroy, "cuGraphDestroy", (CUgraph graph))                                                     \
  X(cuEventCreate, "cuEventCreate", (CUevent * ev, unsigned int flags))                                     \
  X(cuEventRecord, "cuEventRecord", (CUevent ev, CUstream s))                                               \
  X(cuEventSynchronize, "cuEventSynchronize", (CUevent ev))                                                 \
  X(cuEventElapsedTime, "cuEventElapsedTime", (float *ms, CUevent start, CUevent end))                      \
  X(cuEventDestroy, "cuEventDestroy_v2", (CUevent ev))

typedef struct {
  void *so;
  char path[512];
#define X(name, versioned, params) CUresult(*name) params;
  CU_FUNCTIONS(X)
#undef X
} Driver;

extern Driver cuda_drv; // (cuda_driver.c)

// "function: CUDA_ERROR_NAME" into err when r is not CUDA_SUCCESS.
bool cu_ok(CUresult r, const char *fn, char *err, size_t n);
#define CU(err, n, fn, ...) cu_ok(cuda_drv.fn(__VA_ARGS__), #fn, err, n)
// The driver initialised (cuda_device) and its device 0's properties in d.
bool cu_driver_device(CudaDevice *d, char *why, size_t n);
// The driver has every entry point the engine calls.
bool cu_driver_complete(char *err, size_t n);

//
// cuBLASLt: the few types and functions we use (from cublasLt.h).
//
typedef int cublasStatus_t;
typedef struct cublasLtContext *cublasLtHandle_t;
typedef struct cublasLtMatmulDescOpaque *cublasLtMatmulDesc_t;
typedef struct cublasLtMatrixLayoutOpaque *cublasLtMatrixLayout_t;
typedef struct cublasLtMatmulPreferenceOpaque *cublasLtMatmulPreference_t;
typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;
typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;

enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_COMPUTE_32F = 68,
  CUDA_R_32F = 0,
  CUDA_R_16BF = 14,
  CUDA_R_8F_E4M3 = 28,
  CUDA_R_8F_E5M2 = 29,
  CUBLAS_OP_N = 0,
  CUBLAS_OP_T = 1,
  CUBLASLT_MATMUL_DESC_TRANSA = 3,
  CUBLASLT_MATMUL_DESC_TRANSB = 4,
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE = 13,
  CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17,
  CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18,
  CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26,
  CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,
  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6,
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
  CUBLASLT_EPILOGUE_DEFAULT = 1,
  CUBLASLT_EPILOGUE_BIAS = 4,
  CUBLASLT_EPILOGUE_GELU = 32,
  CUBLASLT_EPILOGUE_GELU_AUX = 32 | 128,
  CUBLASLT_EPILOGUE_GELU_BIAS = 32 | 4,
  CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4,
  LT_WORKSPACE_BYTES = 32 << 20, // what cuBLASLt asks for on Hopper
  LT_CANDIDATES = 8,             // algorithms the heuristic is asked for, timed when the engine is built
  LT_TUNE_RUNS = 3,              // timed runs of each candidate (after one untimed)
};

#define LT_FUNCTIONS(X)                                                                                        \
  X(cublasStatus_t, cublasLtCreate, (cublasLtHandle_t * h))                                                   \
  X(cublasStatus_t, cublasLtDestroy, (cublasLtHandle_t h))                                                    \
  X(const char *, cublasLtGetStatusName, (cublasStatus_t s))                                                  \
  X(size_t, cublasLtGetVersion, (void))                                                                       \
  X(cublasStatus_t, cublasLtMatmulDescCreate, (cublasLtMatmulDesc_t * d, int compute, int scale))            \
  X(cublasStatus_t, cublasLtMatmulDescSetAttribute, (cublasLtMatmulDesc_t d, int attr, const void *v, size_t n)) \
  X(cublasStatus_t, cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t d))                                      \
  X(cublasStatus_t, cublasLtMatrixLayoutCreate,                                                               \
    (cublasLtMatrixLayout_t * l, int type, uint64_t rows, uint64_t cols, int64_t ld))                         \
  X(cublasStatus_t, cublasLtMatrixLayoutSetAttribute,                                                         \
    (cublasLtMatrixLayout_t l, int attr, const void *v, size_t n))                                            \
  X(cublasStatus_t, cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t l))                                  \
  X(cublasStatus_t, cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * p))                         \
  X(cublasStatus_t, cublasLtMatmulPreferenceSetAttribute,                                                     \
    (cublasLtMatmulPreference_t p, int attr, const void *v, size_t n))                                        \
  X(cublasStatus_t, cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t p))                          \
  X(cublasStatus_t, cublasLtMatmulAlgoGetHeuristic,                                                           \
    (cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,          \
     cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dl, cublasLtMatmulPreference_t p, int want,             \
     cublasLtMatmulHeuristicResult_t *res, int *got))                                                         \
  X(cublasStatus_t, cublasLtMatmul,                                                                           \
    (cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, const void *a, cublasLtMatrixLayout_t al, \
     const void *b, cublasLtMatrixLayout_t bl, const void *beta, const void *c, cublasLtMatrixLayout_t cl,    \
     void *dd, cublasLtMatrixLayout_t dl, const cublasLtMatmulAlgo_t *algo, void *ws, size_t wsn, CUstream s))

typedef struct {
  void *so;
  char path[512]; // what $MDL_LIBCUBLASLT named when it was opened ("" for the default places)
#define X(ret, name, params) ret(*name) params;
  LT_FUNCTIONS(X)
#undef X
} Lt;

extern Lt cuda_lt; // (cuda_gemm.c)

// "function: CUBLAS_STATUS_NAME" into err when s is not CUBLAS_STATUS_SUCCESS.
bool lt_ok(cublasStatus_t s, const char *fn, char *err, size_t n);
#define LT(err, n, fn, ...) lt_ok(cuda_lt.fn(__VA_ARGS__), #fn, err, n)
// Opens cuBLASLt (once per $MDL_LIBCUBLASLT) and resolves every function we use.
bool lt_open(char *err, size_t n);

// One GEMM ready to run: its element types, descriptors and algorithm, all in cuBLASLt's
// column-major view (operands swapped, see the top of cuda_gemm.c); cand: the heuristic's candidates,
// best first, of which lt_gemm_tune keeps the fastest in algo.
typedef struct {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo, cand[LT_CANDIDATES];
  int ncand;
  CUdeviceptr a, b, c; // cuBLASLt's A (our B), B (our A), D
  CUdeviceptr cin;     // C: D itself, or the out-of-place C (CudaGemm.c_apart) of D's layout
  float beta;
} LtGemm;
void lt_gemm_free(LtGemm *q);
bool lt_gemm_run(const LtGemm *q, cublasLtHandle_t h, CUdeviceptr ws, CUstream s, char *err, size_t n);

//
// The engine.
//
typedef struct {
  Engine e;
  const MemPlan *m;
  const CudaPlan *plan;
  CudaDevice dev;
  CUcontext ctx;
  CUmodule *mods;     // one per cubin of the module (nvrtc_compile_units); each kernel is in one of them
  int nmods;
  CUstream stream;
  CUdeviceptr arena, status, workspace;
  CUdeviceptr seed_dev; // the kernels' seed argument points here; written before each step
  cublasLtHandle_t lt;
  LtGemm *gemms;      // per CudaPlan.gemms
  bool tune;          // time the heuristic's candidates of each GEMM (engine_cuda's tune_gemms)
  int retuned;        // GEMMs whose fastest candidate was not the heuristic's first
  int kinds;          // GEMMs timed: one of each kind (same_kind)
  bool tune_kernels;  // time the kernels that have a variant against it (engine_cuda's tune_kernels)
  bool *alt;          // per CudaPlan.launches: runs the kernel's variant (CudaLaunch.alt)
  int variants, on_alt; // distinct kernels with a variant, and how many of them run it
  char timed[1024];     // each such kernel's time and its variant's, when timed ("kN_x 0.262, _w4 0.231 ms")
  CUfunction *fns;    // per CudaPlan.launches (NULL for a GEMM)
  CUgraph graph;
  CUgraphExec exec;
  char *staging;      // host copy of the inputs and scalars, arena bytes [lo, hi)
  int64_t lo, hi;
  bool *on_device;    // per node: an input set on the device (Engine.inputs_from), not from staging
  int ndevice;        // how many
  CUfunction accumulate; // the prelude's mdl_accumulate (y += x), for inputs_from
  uint64_t seed;      // the next step's seed (Engine.set_seed), copied to seed_dev before the step
  ParamDraw draw;     // the initial parameters still to be drawn (on the host) and sent up
  CUdeviceptr snap;     // Engine.snapshot: the flat buffers params, m and v, one after the other
  CUstream snap_stream; // Engine.read_snapshot's copies (from the checkpoint writer's thread)
  bool snap_refused;    // the snapshot's allocation failed once: checkpoints read between steps
  CUevent *marks;         // --profile: an event before each launch, and one at the end
  int nmarks;
  double *launch_seconds; //   each launch's time, summed over the steps after the first
  void *nccl;             // Engine.set_nccl: the ranks' communicator, or NULL
  const bool *poison;     //   NaN gradients this step
  GradRange *ranges;      //   the gradients the optimizer reads (engine_grad_ranges)
  int nranges;
  CUevent *red;           //   before and after each range's all-reduce
  int nred;               //   (pairs created)
  int64_t *zero_at;       // Engine.set_shard: the ranks' shares of the params and copies (floats), or NULL
  int zero_ranks;
  CUevent gathered[2];    //   before and after their all-gather
  // Precision fp8 (fp8_step): the scaling state (Engine.fp8), the scales and 1 / scales as sent up,
  // the step cut at the optimizer's first launch (a graph each side: graph and exec above are the
  // first part), and a gradient the optimizer reads, made NaN when an amax is not finite.
  Fp8State fp8;
  float *fp8_up;          //   scale [n], then 1 / scale [n]: the region's first 8n bytes
  int opt_launch;         //   the optimizer's first launch (nlaunches: none)
  CUgraph graph_opt;      //   launches [opt_launch, nlaunches)
  CUgraphExec exec_opt;
  int64_t fp8_poison;     //   its arena offset, or -1
  bool fp8_bad;           //   this step's amaxes: one is not finite (the state is not rolled)
  bool (*fp8_fn)(void *ctx, float *amax, int n, char *err, size_t en); // Engine.set_fp8_amax's, or NULL
  void *fp8_ctx;
  const float *fp8_lead;  //   Engine.set_fp8_lead's scales: a micro-batch's pass of another engine's step
  int next_range;         //   Engine.set_nccl: the first of `ranges` not yet reduced this step
} CudaEngine;

// Descriptors and algorithms for every GEMM of ce's plan (cuda_gemm.c), each run once eagerly.
bool lt_init_gemms(CudaEngine *ce, const Fusion *f, char *err, size_t n);
#endif
