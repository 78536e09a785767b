// cuda_driver.c: the CUDA driver API, loaded with dlopen (never linked, so one mdlc binary runs on
// machines with and without a GPU): finding the GPU, its properties, its free memory and its bf16 peak.
//
// Driver. libcuda.so.1 (or $MDL_LIBCUDA) is opened once per path (and never closed: the driver and
// the CUDA runtime inside cuBLASLt do not support being unloaded); every entry point is resolved
// through cuGetProcAddress (cuGetProcAddress_v2, else the older four-argument form) at the ABI of
// CUDA 12.0, whose signatures the declarations in cuda_impl.h follow; a driver without cuGetProcAddress is
// searched with dlsym under the versioned names of that ABI ("cuMemAlloc_v2"). Entry points that are
// missing stay NULL: probing needs only cuInit and the device queries, the engine needs them all.
// The engine uses the device's primary context, the one the CUDA runtime inside cuBLASLt also uses.
// Every failing call is reported as "function: CUDA_ERROR_NAME" in one line.
#include "cuda_impl.h"
#include "runtime.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

Driver cuda_drv;

static const char *cu_error_name(CUresult r) {
  const char *name = NULL;
  if (cuda_drv.cuGetErrorName && cuda_drv.cuGetErrorName(r, &name) == CUDA_SUCCESS && name)
    return name;
  static char buf[32];
  snprintf(buf, sizeof buf, "CUresult %d", r);
  return buf;
}

// "function: CUDA_ERROR_NAME" into err when r is not CUDA_SUCCESS.
bool cu_ok(CUresult r, const char *fn, char *err, size_t n) {
  return r == CUDA_SUCCESS || rt_fail(err, n, "%s: %s", fn, cu_error_name(r));
}

typedef CUresult (*GetProcAddress2)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*GetProcAddress1)(const char *, void **, int, unsigned long long);

// Opens the driver at `path` (once per path) and resolves every entry point it has.
static bool driver_open(const char *path, char *why, size_t n) {
  if (cuda_drv.so && !strcmp(cuda_drv.path, path))
    return true;
  void *so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!so) {
    if (!strcmp(path, "libcuda.so.1"))
      return rt_fail(why, n, "no CUDA driver (libcuda.so.1 not found)");
    return rt_fail(why, n, "no CUDA driver (%s)", dlerror());
  }
  cuda_drv = (Driver){.so = so};
  snprintf(cuda_drv.path, sizeof cuda_drv.path, "%s", path);
  GetProcAddress2 gpa2 = (GetProcAddress2)dlsym(so, "cuGetProcAddress_v2");
  GetProcAddress1 gpa1 = (GetProcAddress1)dlsym(so, "cuGetProcAddress");
  struct {
    const char *name, *versioned;
    void **slot;
  } fns[] = {
#define X(name, versioned, params) {#name, versioned, (void **)&cuda_drv.name},
      CU_FUNCTIONS(X)
#undef X
  };
  for (size_t i = 0; i < sizeof fns / sizeof *fns; i++) {
    void *p = NULL;
    int status = 0;
    if (gpa2) {
      if (gpa2(fns[i].name, &p, CUDA_ABI_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS || status)
        p = NULL;
    } else if (gpa1) {
      if (gpa1(fns[i].name, &p, CUDA_ABI_VERSION, CU_GET_PROC_ADDRESS_DEFAULT) != CUDA_SUCCESS)
        p = NULL;
    } else {
      p = dlsym(so, fns[i].versioned);
    }
    *fns[i].slot = p;
  }
  return true;
}

// The driver initialised, with at least one device: device 0's properties; under a launcher that
// started several ranks (dist.c), the device of the rank's place on its machine (its local rank, modulo
// the devices).
bool cu_driver_device(CudaDevice *d, char *why, size_t n) {
  const char *env = getenv("MDL_LIBCUDA");
  if (!driver_open(env && *env ? env : "libcuda.so.1", why, n))
    return false;
  if (!cuda_drv.cuInit || !cuda_drv.cuDeviceGetCount)
    return rt_fail(why, n, "no usable CUDA driver (%s lacks cuInit or cuDeviceGetCount)", cuda_drv.path);
  CUresult r = cuda_drv.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char *name = cu_error_name(r);
    if (!strcmp(name, "CUDA_ERROR_NO_DEVICE"))
      return rt_fail(why, n, "no CUDA device (cuInit: %s)", name);
    return rt_fail(why, n, "no usable CUDA driver (cuInit: %s)", name);
  }
  int count = 0;
  if (!CU(why, n, cuDeviceGetCount, &count))
    return false;
  if (count < 1)
    return rt_fail(why, n, "no CUDA device");
  if (!cuda_drv.cuDeviceGet || !cuda_drv.cuDeviceGetAttribute)
    return rt_fail(why, n, "no usable CUDA driver (%s lacks cuDeviceGet or cuDeviceGetAttribute)", cuda_drv.path);
  *d = (CudaDevice){0};
  int major = 0, minor = 0;
  int which = dist_launched() ? dist_local_rank() % count : 0;
  if (!CU(why, n, cuDeviceGet, &d->ordinal, which) ||
      !CU(why, n, cuDeviceGetAttribute, &major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d->ordinal) ||
      !CU(why, n, cuDeviceGetAttribute, &minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d->ordinal))
    return false;
  snprintf(d->arch, sizeof d->arch, "sm_%d%d", major, minor);
  snprintf(d->name, sizeof d->name, "CUDA device %d", which);
  if (cuda_drv.cuDeviceGetName)
    cuda_drv.cuDeviceGetName(d->name, (int)sizeof d->name, d->ordinal);
  if (cuda_drv.cuDeviceGetAttribute(&d->sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d->ordinal) != CUDA_SUCCESS)
    d->sm_count = 0;
  if (!cuda_drv.cuDeviceTotalMem || cuda_drv.cuDeviceTotalMem(&d->total_bytes, d->ordinal) != CUDA_SUCCESS)
    d->total_bytes = 0;
  if (!cuda_drv.cuDriverGetVersion || cuda_drv.cuDriverGetVersion(&d->driver_version) != CUDA_SUCCESS)
    d->driver_version = 0;
  return true;
}

bool cuda_device(CudaDevice *d, char *why, size_t n) { return cu_driver_device(d, why, n); }

int64_t cuda_free_memory(const CudaDevice *d) {
  CUcontext ctx;
  size_t free_bytes = 0, total = 0;
  if (!cuda_drv.cuDevicePrimaryCtxRetain || !cuda_drv.cuCtxSetCurrent || !cuda_drv.cuMemGetInfo ||
      cuda_drv.cuDevicePrimaryCtxRetain(&ctx, d->ordinal) != CUDA_SUCCESS)
    return -1;
  bool ok = cuda_drv.cuCtxSetCurrent(ctx) == CUDA_SUCCESS && cuda_drv.cuMemGetInfo(&free_bytes, &total) == CUDA_SUCCESS;
  return ok ? (int64_t)free_bytes : -1;
}

bool cuda_probe(char *why, size_t n) {
  CudaDevice d;
  if (!cu_driver_device(&d, why, n))
    return false;
  snprintf(why, n, "%s (%s, %d SMs, %.1f GiB, driver %d.%d)", d.name, d.arch, d.sm_count,
           (double)d.total_bytes / (1 << 30), d.driver_version / 1000, d.driver_version % 1000 / 10);
  return true;
}

bool cuda_available(char *why, size_t n) {
  if (!cuda_probe(why, n))
    return false;
  char line[256];
  snprintf(line, sizeof line, "%s", why);
  if (!nvrtc_available(why, n))
    return false;
  snprintf(why, n, "%s", line);
  return true;
}

// The bf16 dense tensor-core peaks of devices by name (NVIDIA's figures, without sparsity), most
// specific names first: a name matches where it ends at the end of the device's or before a space.
static const struct {
  const char *name;
  double tflops;
  const char *what;
} device_peaks[] = {
    {"H100 PCIe", 756, "H100 PCIe"}, {"H100 NVL", 835, "H100 NVL"},   {"GH200", 989, "GH200"},
    {"H200", 989, "H200"},           {"H100", 989, "H100 SXM"},       {"H800", 989, "H800"},
    {"H20", 148, "H20"},             {"B200", 2250, "B200"},          {"B100", 1750, "B100"},
    {"A100", 312, "A100"},           {"A800", 312, "A800"},           {"A10", 125, "A10"},
    {"L40S", 362, "L40S"},           {"L40", 181, "L40"},             {"L4", 121, "L4"},
    {"RTX 4090", 165, "RTX 4090"},
};

// Does `name` appear in `device` as a whole word ("H20" not in "H200")?
static bool device_is(const char *device, const char *name) {
  size_t n = strlen(name);
  for (const char *p = strstr(device, name); p; p = strstr(p + 1, name))
    if ((p == device || p[-1] == ' ') && (p[n] == 0 || p[n] == ' ' || p[n] == '-'))
      return true;
  return false;
}

double cuda_bf16_peak(const CudaDevice *d, char *how, size_t n) {
  for (size_t i = 0; i < sizeof device_peaks / sizeof *device_peaks; i++)
    if (device_is(d->name, device_peaks[i].name)) {
      snprintf(how, n, "%.0f TFLOP/s: %s bf16 dense peak", device_peaks[i].tflops, device_peaks[i].what);
      return device_peaks[i].tflops * 1e12;
    }
  // Otherwise the arch's bf16 tensor-core flops per SM and clock (with f32 accumulation: the consumer
  // parts of sm_86, sm_89 and sm_120 at half their datacenter siblings' rate), at 1.7 GHz.
  int cc = atoi(d->arch + 3), major = cc / 10, minor = cc % 10; // ("sm_90": 9.0, "sm_120": 12.0)
  int per_sm = major >= 10 && major < 11 ? 8192 : major == 9 ? 4096 : major == 8 && minor == 0 ? 2048 : 512;
  snprintf(how, n, "%.0f TFLOP/s: bf16 dense peak estimated as %d SMs x %d flops a clock x 1.7 GHz (%s)",
           d->sm_count * per_sm * 1.7e9 / 1e12, d->sm_count, per_sm, d->arch);
  return d->sm_count * per_sm * 1.7e9;
}

int cuda_compute_capability(const CudaDevice *d) {
  int cc = 0;
  return sscanf(d->arch, "sm_%d", &cc) == 1 ? cc : 0;
}

// The driver has every entry point the engine calls.
bool cu_driver_complete(char *err, size_t n) {
  struct {
    const char *name;
    void *fn;
  } fns[] = {
#define X(name, versioned, params) {#name, (void *)cuda_drv.name},
      CU_FUNCTIONS(X)
#undef X
  };
  for (size_t i = 0; i < sizeof fns / sizeof *fns; i++) // (cuMemsetD32Async: only data parallel's NaN
    if (!fns[i].fn && strcmp(fns[i].name, "cuMemsetD32Async")) // guard, which a driver without it skips)
      return rt_fail(err, n, "the CUDA driver %s lacks %s", cuda_drv.path, fns[i].name);
  return true;
}
