// cuda.h: the CUDA back end's runtime: finding a GPU through the driver (loaded with dlopen, never
// linked: cuda_driver.c), and the Engine that runs a training step on it as one CUDA Graph of
// NVRTC-compiled kernels and cuBLASLt GEMMs (cuda.c, cuda_gemm.c).
#ifndef MDL_CUDA_H
#define MDL_CUDA_H
#include "mdl.h"
#include "runtime.h"

typedef struct {
  int ordinal;          // the driver's device number
  char name[128];       // "NVIDIA H200"
  char arch[16];        // "sm_90": what NVRTC compiles for
  int sm_count;
  size_t total_bytes;
  int driver_version;   // 12080 = 12.8
} CudaDevice;

// The driver (libcuda.so.1, or $MDL_LIBCUDA) initialised and device 0 present. On success `why`
// describes the device ("NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB, driver 12.8)"); otherwise it says
// why not in one line: "no CUDA driver (libcuda.so.1 not found)", "no CUDA device", ...
bool cuda_probe(char *why, size_t n);
// The same, with the device's properties.
bool cuda_device(CudaDevice *d, char *why, size_t n);
// The bytes free on device d (cuMemGetInfo in its primary context, which stays retained for the
// engine), or -1 when the driver does not say.
int64_t cuda_free_memory(const CudaDevice *d);
// Device d's compute capability as its arch number: 89 for sm_89 (8.9), 90, 100, ...; 0 when unknown.
// FP8 GEMMs (cuBLASLt's E4M3 and E5M2 operands) need 89 or more.
int cuda_compute_capability(const CudaDevice *d);
// cuda_probe and NVRTC both there: the CUDA back end can run. `why` as for cuda_probe.
bool cuda_available(char *why, size_t n);
// The bf16 dense tensor-core peak (flop/s) MFU is measured against on device d: NVIDIA's figure for the
// devices it knows by name (H100, H200, A100, B200, L40S, ...), else an estimate from the arch and the
// SMs; what it is in `how`.
double cuda_bf16_peak(const CudaDevice *d, char *how, size_t n);

// "embed: id", "cross_entropy: target": what a kernel reported with a CUDA_ERR_* code in its status
// (emit_cuda.h's MdlStatus).
const char *cuda_error_what(long long code);

// The CUDA back end for a step plan and the CUDA plan the pipeline emitted for it (emit_cuda_plan):
// parameters initialised from the seed as the interpreter does; with tune_gemms, each GEMM on the
// fastest of cuBLASLt's candidates (timed when it is built), else on the heuristic's first; with
// tune_kernels, each kernel that has a variant (CudaLaunch.alt) timed against it and the faster run,
// else the plan's own. Precision fp8 (the graph has scaled tensors) runs its GEMMs on cuBLASLt's FP8
// kernels and keeps the scales on the host (Engine.fp8), on a GPU of sm_89 or later, in one process,
// without gradient accumulation. NULL with a one-line message in err when there is no GPU, no plan
// (NULL), the module does not compile or load, or fp8 cannot run here.
Engine *engine_cuda(const Fusion *f, const MemPlan *m, const CudaPlan *plan, uint64_t seed, bool tune_gemms,
                    bool tune_kernels, char *err, size_t n);
#endif
