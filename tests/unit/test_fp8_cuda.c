// test_fp8_cuda.c: precision = fp8 in the CUDA emitter, on a machine without a GPU (gpt2-tiny, B=2,
// T=16, fused; apart from test_cuda_emit.c, whose time is long enough).
//  1. NVRTC compiles the fp8 module for sm_89, sm_90, sm_100 and sm_120 without an error or a warning.
//  2. The plan: its fp8 GEMMs read one-byte operands with their 1 / scale in the fp8 region, and the
//     casts' kernels address that region.
//  3. In the emulator (tests/unit/cuda_emu.h, the GEMMs by tests/unit/cuda_emu_host.h's reference),
//     one step as the runtime would run it: the launches before the optimizer with every scale 1
//     (calibration), their amaxes rolled by fp8_state_update, the scales and 1 / scales written into
//     the region, the amaxes cleared, the step to its optimizer. Against the interpreter's step: the
//     scales bit for bit, every amax within 1e-5 relative, the loss within 1e-5 relative and every
//     gradient within 1e-4 in L2 per tensor (measured: 0 and 8e-8; the emulated GEMMs and kernels sum
//     in other orders, and an fp8 rounding flips where a value lies at a midpoint).
#include "mdl.h"
#include "backend.h"
#include "emit_cuda.h"
#include "fp8_state.h"
#include "test.h"
#include "harness.h"
#include "cuda_emu_host.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// Launches of steps [first, last] (last -1: to the end).
static void run(const CudaPlan *p, const Emu *emu, char *arena, MdlStatus *st, int first, int last) {
  for (int i = 0; i < p->nlaunches; i++) {
    const CudaLaunch *l = &p->launches[i];
    if (l->step < first)
      continue;
    if (last >= 0 && l->step > last)
      break;
    if (l->kernel)
      emu->launch(emu->fn[i], l->grid, l->block, arena, st, 7, l->chunk, l->args, l->nargs);
    else
      ref_gemm(arena, &p->gemms[l->gemm]);
  }
}

// The region's amaxes into st's (and cleared), then, with roll, st updated and its scales and 1 / scales
// written back.
static void region_gather(const CudaPlan *p, char *arena, Fp8State *st, const Graph *g, bool roll) {
  float *scale = (float *)(arena + p->fp8), *descale = scale + p->nfp8;
  unsigned *amax = (unsigned *)(descale + p->nfp8);
  for (int t = 0; t < p->nfp8; t++) {
    memcpy(&st->amax[t], &amax[t], 4);
    amax[t] = 0;
  }
  char why[256];
  if (roll && fp8_state_update(st, g, why, sizeof why))
    for (int t = 0; t < p->nfp8; t++)
      scale[t] = st->scale[t], descale[t] = 1.0f / st->scale[t];
}

static double l2(const float *a, const double *b, int64_t n) {
  double d = 0, r = 1e-60;
  for (int64_t i = 0; i < n; i++)
    d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), r += b[i] * b[i];
  return isnan(d) ? INFINITY : sqrt(d / r);
}

int main(void) {
  char dir[] = "/tmp/mdl-fp8cuda-XXXXXX";
  if (!cache_dir_make(dir, "fp8 cuda: a temporary directory"))
    TEST_EXIT();
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  Graph *g = mdl_compile_file(a, "models/gpt2-tiny.mdl", ov, 2);
  char why[4096] = "";
  if (!g || !autodiff(g, true) || !precision_assign(g, DT_F8E4M3, why, sizeof why)) {
    CHECK(false, "fp8 cuda: gpt2-tiny compiles in fp8", "%s", why);
    TEST_EXIT();
  }
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
  MemPlan *m = memplan(f);
  CudaPlan *p = emit_cuda_plan(f, m, "models/gpt2-tiny.mdl");
  CHECK(p && p->nfp8 == g->nfp8 && p->fp8 >= m->arena_bytes && p->scratch >= p->fp8 + 12 * p->nfp8,
        "fp8 cuda: the plan has the fp8 region between the memory plan's arena and the scratch", "emit failed");
  if (!p)
    TEST_EXIT();

  if (nvrtc_available(why, sizeof why)) {
    // (the archs with FP8 tensor cores: Ada, Hopper, Blackwell's data-centre and consumer parts)
    static const char *const archs[] = {"sm_89", "sm_90", "sm_100", "sm_120"};
    for (int i = 0; i < 4; i++) {
      NvrtcResult r = {0};
      char name[120];
      bool ok = nvrtc_compile(p->source, archs[i], &r, why, sizeof why);
      snprintf(name, sizeof name, "fp8 cuda: NVRTC compiles the fp8 module for %s without a warning", archs[i]);
      CHECK(ok && r.size > 0 && !r.log, name, "%.1500s", ok ? r.log : why);
      free(r.cubin);
      free(r.log);
    }
  } else {
    printf("[skip] fp8 cuda nvrtc: %s\n", why);
  }

  int fp8_gemms = 0, bad_gemms = 0;
  for (int i = 0; i < p->ngemms; i++) {
    const CudaGemm *gm = &p->gemms[i];
    if (gm->ab != DT_F8E4M3 && gm->ab != DT_F8E5M2)
      continue;
    fp8_gemms++;
    bad_gemms += (gm->b_fp8 != DT_F8E4M3 && gm->b_fp8 != DT_F8E5M2) || gm->c_type == DT_F8E4M3 ||
                 gm->a_scale < p->fp8 + 4 * p->nfp8 || gm->b_scale >= p->fp8 + 8 * p->nfp8;
  }
  CHECK(fp8_gemms == 21 && bad_gemms == 0, "fp8 cuda: 21 fp8 GEMMs (7 forward, 14 backward), each with its 1 / scales "
        "(C f32, or bf16 where only its rounding is read)",
        "%d, %d bad", fp8_gemms, bad_gemms);

  if (system("g++ --version >/dev/null 2>&1") != 0) {
    printf("[skip] fp8 cuda emu: no g++\n");
    TEST_EXIT();
  }
  Emu emu = {0};
  bool ok = emu_load(p, dir, "fp8", &emu, why, sizeof why);
  CHECK(ok, "fp8 cuda: the module compiles with the emulator", "%.1500s", why);
  if (!ok)
    TEST_EXIT();

  Interp *it = interp_new(g, INTERP_F32);
  interp_init_params(it, 7);
  interp_set_seed(it, 7);
  set_inputs_by(g, packed_batch, it, NULL, NULL);
  interp_set_scalar(it, "lr", 2e-3);
  interp_set_scalar(it, "step", 1);
  char err[256];
  bool iok = interp_run(it, g->n, err, sizeof err);
  CHECK(iok, "fp8 cuda: the interpreter's step", "%s", err);

  size_t bytes = (size_t)(p->arena_bytes + 255) / 256 * 256;
  char *arena = aligned_alloc(256, bytes);
  memset(arena, 0, bytes);
  cpu_init_params(g, m, arena, 7);
  set_inputs_by(g, packed_batch, NULL, m, arena);
  cpu_set_scalar(g, m, arena, "lr", 2e-3);
  cpu_set_scalar(g, m, arena, "step", 1);
  float *scale = (float *)(arena + p->fp8);
  for (int t = 0; t < 2 * p->nfp8; t++)
    scale[t] = 1;
  int opt = f->nsteps;
  for (int s = f->nsteps - 1; s >= 0; s--)
    opt = f->steps[s].kind == STEP_OPTIMIZER ? s : opt;
  Fp8State st;
  fp8_state_init(&st, g);
  MdlStatus ms = {0};
  run(p, &emu, arena, &ms, 0, opt - 1); // calibration
  region_gather(p, arena, &st, g, true);
  // the gradients as the step leaves them before its optimizer, as the interpreter's
  run(p, &emu, arena, &ms, 0, opt - 1);
  region_gather(p, arena, &st, g, true);
  CHECK(!ms.set, "fp8 cuda: the emulated step runs", "status %lld", ms.code);
  const Fp8State *si = interp_fp8(it);

  double amax_err = 0;
  for (int t = 0; t < si->n * si->H; t++)
    amax_err = fmax(amax_err, si->hist[t] > 0 ? fabs(si->hist[t] - st.hist[t]) / si->hist[t] : fabs(st.hist[t]));
  char name[200];
  CHECK(!memcmp(si->scale, st.scale, sizeof(float) * (size_t)st.n) && si->recorded == st.recorded,
        "fp8 cuda: the scales are the interpreter's bit for bit", "they differ");
  snprintf(name, sizeof name, "fp8 cuda: every amax within 1e-5 relative of the interpreter's (worst %.1e)", amax_err);
  CHECK(amax_err < 1e-5, name, "%.3g", amax_err);
  float loss = *(const float *)cpu_value(m, arena, g->loss);
  double want = interp_value(it, g->loss)[0];
  snprintf(name, sizeof name, "fp8 cuda: the loss within 1e-5 relative of the interpreter's (%.6f vs %.6f)", loss, want);
  CHECK(fabs(loss - want) <= 1e-5 * fabs(want), name, "%.8f vs %.8f", loss, want);
  double worst = 0;
  const char *which = "?";
  for (int k = 0; k < g->nparams; k++) {
    int gr = g->grads[k];
    const float *got = gr >= 0 ? cpu_value(m, arena, gr) : NULL;
    if (!got)
      continue;
    double e = l2(got, interp_value(it, gr), shape_numel(g->nodes[gr]->shape));
    if (e > worst)
      worst = e, which = g->nodes[g->params[k]]->name;
  }
  snprintf(name, sizeof name, "fp8 cuda: every gradient within 1e-4 in L2 of the interpreter's (worst %.1e, %s)",
           worst, which);
  CHECK(worst < 1e-4, name, "%.3g", worst);
  fp8_state_free(&st);
  free(arena);
  interp_free(it);
  emu_free(&emu);
  arena_free(a);
  char rm[200];
  snprintf(rm, sizeof rm, "rm -rf %s", dir);
  if (system(rm) != 0)
    printf("(could not remove %s)\n", dir);
  TEST_EXIT();
}
