// cuda_emu_driver.cpp: turns an emitted CUDA module into a shared object the tests can drive on the
// CPU. Compiled by the tests with the module's path in MDL_EMU_SOURCE:
//   g++ -std=c++17 -O1 -fopenmp -shared -fPIC -Itests/unit -Iruntime/kernels -DMDL_EMU_SOURCE='"model.cu"' cuda_emu_driver.cpp
// The module's kernels are extern "C" functions of the object (found with dlsym by name);
// mdl_emu_launch runs one of them over a grid with tests/unit/cuda_emu.h, with the kernel arguments of a
// CudaLaunch (compiler/emit/emit_cuda.h).
#include "cuda_emu.h"

#include MDL_EMU_SOURCE

typedef void (*mdl_kernel_fn)(char *, MdlStatus *, const uint64_t *, int64_t, MdlArgs);

struct MdlCall {
  mdl_kernel_fn fn;
  char *arena;
  MdlStatus *status;
  uint64_t seed;
  int64_t chunk;
  MdlArgs args;
};

static void mdl_call(void *p) {
  MdlCall *c = (MdlCall *)p;
  c->fn(c->arena, c->status, &c->seed, c->chunk, c->args);
}

// ldmatrix's 8 x 8 tiles read so far and the extra passes their bank conflicts took (cuda_emu.h).
extern "C" void mdl_emu_ldsm_stats(unsigned long long *tiles, unsigned long long *extra_passes) {
  *tiles = mdl_emu::ldsm_tiles;
  *extra_passes = mdl_emu::ldsm_extra_passes;
}

extern "C" void mdl_emu_launch(void *fn, const unsigned *grid, const unsigned *block, char *arena, void *status,
                               uint64_t seed, int64_t chunk, const int64_t *args, int nargs) {
  MdlCall c;
  c.fn = (mdl_kernel_fn)fn;
  c.arena = arena;
  c.status = (MdlStatus *)status;
  c.seed = seed;
  c.chunk = chunk;
  memset(&c.args, 0, sizeof c.args);
  for (int i = 0; i < nargs; i++)
    c.args.b[i] = args[i];
  mdl_emu::run(dim3{grid[0], grid[1], grid[2]}, dim3{block[0], block[1], block[2]}, mdl_call, &c);
}
