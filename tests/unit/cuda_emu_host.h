// cuda_emu_host.h: the host side of running an emitted CUDA module on the CPU (the kernels through
// tests/unit/cuda_emu_driver.cpp and tests/unit/cuda_emu.h, the GEMMs through a reference in double), as
// test_cuda_emit.c and test_checkpoint.c run them.
#ifndef MDL_CUDA_EMU_HOST_H
#define MDL_CUDA_EMU_HOST_H
#include "emit_cuda.h"
#include "mdl.h"

#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_bits.h"

typedef void (*launch_fn)(void *fn, const unsigned *grid, const unsigned *block, char *arena, void *status,
                          uint64_t seed, int64_t chunk, const int64_t *args, int nargs);

static double gelu(double x) { return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }

// Element i of a matrix of type t (f32, bf16 or an fp8 code) at p, as a value; v stored there as type t
// (a bf16 the nearest, ties to even, as round_bf16 rounds).
static float elem(const char *p, DType t, int64_t i) {
  float f;
  if (t == DT_F8E4M3 || t == DT_F8E5M2) {
    uint8_t c = (uint8_t)p[i];
    f = t == DT_F8E4M3 ? mdl_e4m3_to_f32(c) : mdl_e5m2_to_f32(c);
  } else if (t == DT_BF16) {
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    uint32_t u = (uint32_t)h << 16;
    memcpy(&f, &u, 4);
  } else {
    memcpy(&f, p + 4 * i, 4);
  }
  return f;
}

static void put(char *p, DType t, int64_t i, float v) {
  if (t == DT_BF16) {
    float r = (float)round_bf16(v);
    uint32_t u;
    memcpy(&u, &r, 4);
    uint16_t h = (uint16_t)(u >> 16);
    memcpy(p + 2 * i, &h, 2);
  } else {
    memcpy(p + 4 * i, &v, 4);
  }
}

// The reference GEMM: operands of the GEMM's types, sums in double (fp8: times A's and B's 1 / scale,
// exact), the result rounded to float, then the epilogue, stored as C's type.
static void ref_gemm(char *arena, const CudaGemm *gm) {
  int64_t sab = dtype_size(gm->ab), sc = dtype_size(gm->c_type);
  bool fp8 = gm->ab == DT_F8E4M3 || gm->ab == DT_F8E5M2;
  DType bt = fp8 ? gm->b_fp8 : gm->ab;
  double descale = fp8 ? (double)*(const float *)(arena + gm->a_scale) * *(const float *)(arena + gm->b_scale) : 1;
  for (int64_t t = 0; t < gm->batch; t++) {
    const char *a = arena + gm->a + sab * t * gm->stride_a, *b = arena + gm->b + sab * t * gm->stride_b;
    char *c = arena + gm->c + sc * t * gm->stride_c;
    const char *cin = gm->c_apart ? arena + gm->cin + sc * t * gm->stride_c : c; // the beta term's C
    const float *bias = gm->bias >= 0 ? (const float *)(arena + gm->bias) : NULL;
    float *aux = gm->aux >= 0 ? (float *)(arena + gm->aux) + t * gm->stride_c : NULL;
    for (int64_t i = 0; i < gm->m; i++)
      for (int64_t j = 0; j < gm->n; j++) {
        double s = 0;
        for (int64_t l = 0; l < gm->k; l++)
          s += (double)elem(a, gm->ab, gm->ta ? l * gm->lda + i : i * gm->lda + l) *
               elem(b, bt, gm->tb ? j * gm->ldb + l : l * gm->ldb + j);
        s *= descale;
        int64_t at = i * gm->ldc + j;
        float v = (float)(s + (gm->beta != 0 ? (double)gm->beta * elem(cin, gm->c_type, at) : 0.0));
        if (bias)
          v += bias[j];
        if (aux)
          aux[at] = v;
        if (gm->epilogue == CUDA_EPI_GELU || gm->epilogue == CUDA_EPI_BIAS_GELU)
          v = (float)gelu(v);
        put(c, gm->c_type, at, v);
      }
  }
}

typedef struct {
  void *so;
  launch_fn launch;
  void **fn;  // per launch: its kernel
  void **alt; // per launch: its kernel's variant (CudaLaunch.alt), or NULL
} Emu;

// What every emulated module is compiled with besides: UBSan's alignment and bounds checks, each
// fatal. A GPU faults ("misaligned address") on a float4, ushort4 or uint4 access that is not aligned
// to its width, which x86 performs silently; with -fsanitize=alignment the emulator stops there as
// the GPU would (the emulator's vector types carry the GPU's alignments). Bounds catches an index past
// a fixed-size array, the shared-memory tiles above all, which on a GPU would read or overwrite
// another tile or fault. See test_emu_checks.
#define EMU_CHECKS "-fsanitize=alignment,bounds -fno-sanitize-recover=all"

// Compiles the module with the emulator into dir/<tag>.so and loads it; false with the reason.
static bool emu_load(const CudaPlan *p, const char *dir, const char *tag, Emu *emu, char *why, size_t n) {
  char cu[600], so[600], log[600], cmd[2400];
  snprintf(cu, sizeof cu, "%s/%s.cu", dir, tag);
  snprintf(so, sizeof so, "%s/%s.so", dir, tag);
  snprintf(log, sizeof log, "%s/%s.log", dir, tag);
  FILE *f = fopen(cu, "w");
  if (!f || fputs(p->source, f) < 0 || fclose(f)) {
    snprintf(why, n, "cannot write %s", cu);
    return false;
  }
  snprintf(cmd, sizeof cmd,
           "g++ -std=c++17 -O1 -fopenmp -shared -fPIC " EMU_CHECKS " -Wall -Wextra -Werror -Wno-unknown-pragmas "
           "-Wno-unused-parameter -Itests/unit -Iruntime/kernels "
           "-DMDL_EMU_SOURCE='\"%s\"' tests/unit/cuda_emu_driver.cpp -o %s >%s 2>&1",
           cu, so, log);
  if (system(cmd) != 0) {
    FILE *l = fopen(log, "r");
    size_t k = l ? fread(why, 1, n - 1, l) : 0;
    why[k] = 0;
    if (l)
      fclose(l);
    return false;
  }
  emu->so = dlopen(so, RTLD_NOW | RTLD_LOCAL);
  if (!emu->so) {
    snprintf(why, n, "%s", dlerror());
    return false;
  }
  *(void **)&emu->launch = dlsym(emu->so, "mdl_emu_launch");
  emu->fn = calloc((size_t)p->nlaunches + 1, sizeof *emu->fn);
  emu->alt = calloc((size_t)p->nlaunches + 1, sizeof *emu->alt);
  for (int i = 0; i < p->nlaunches; i++) {
    const CudaLaunch *l = &p->launches[i];
    const char *missing = l->kernel && !(emu->fn[i] = dlsym(emu->so, l->kernel))  ? l->kernel
                          : l->alt && !(emu->alt[i] = dlsym(emu->so, l->alt)) ? l->alt
                                                                                : NULL;
    if (missing) {
      snprintf(why, n, "no kernel %s in the module", missing);
      return false;
    }
  }
  return emu->launch != NULL;
}

static void emu_free(Emu *emu) {
  if (emu->so)
    dlclose(emu->so);
  free(emu->fn);
  free(emu->alt);
}

#endif
