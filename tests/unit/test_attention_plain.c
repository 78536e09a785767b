// test_attention_plain.c: attention as an unfused framework runs it (LowerOptions.plain_attention,
// `mdlc --attention plain`) against the fused ATTENTION op (flash, the default), and --no-doc-mask.
//  1. ATTENTION_MASK alone, causal within documents, within documents only, and causal without doc ids,
//     and causal in a window with and without doc ids, on the interpreter, the C back end and the
//     emulated CUDA kernels: bit for bit the mask written here from the rule (key j visible from query
//     i when j <= i, i - j < window and their doc ids are equal: 0, else -inf), on ids whose
//     documents come back after others.
//  2. The plan of gpt2-tiny (B=2, T=24): with plain attention the graph has no ATTENTION op, one
//     ATTENTION_MASK shared by the layers, [B,H,T,T] values in the memory plan (the scores and their
//     softmax, 4 per layer with the backward's), more steps than flash; the model FLOPs of MFU
//     (rt_step_flops) are flash's to the last flop, though the GEMMs compute twice the causal half.
//     With --no-doc-mask neither lowering reads the doc ids.
//  3. gpt2-tiny and llama-tiny (B=2, T=16; three documents in the first row, two in the second, one of
//     them coming back after the other), fp32 and bf16: one training step from the same parameters
//     and batch, plain against flash on the interpreter, on the C back end and on the emulated CUDA
//     kernels (cuda_emu_host.h). The loss, the logits (as the loss reads them) and every gradient
//     agree: in fp32 within 5e-6 relative per tensor (max |plain - flash| / max |flash|; seen: 6e-7 at
//     most): the same sums in other orders; in bf16 the loss within 1e-4 relative (seen: 2e-5), the
//     logits within 1e-2 and each gradient within 1.5e-2 in L2 per tensor (||plain - flash|| /
//     ||flash||; seen: 3.3e-3 and 5.8e-3): both round the products' operands to bf16, but the fused op
//     rounds the unnormalised exp(s - max) for P V and plain attention the probabilities, and each
//     backward rounds values computed in another order (bf16's 2^-8 relative). The documents matter
//     in this batch: without the doc mask flash's logits move by more than 10 times that tolerance,
//     and there plain attention without the doc mask agrees with flash without it as closely.
//  4. The checkpoint pass on plain attention (gpt2-tiny, bf16): `all` recomputes each layer's
//     probabilities [B,H,T,T] (their softmax, from the scores' GEMM) in the backward, and the step on
//     the C back end gives the loss and every gradient of `none` bit for bit.
//  5. NVRTC compiles plain attention's modules (gpt2-tiny, fp32 and bf16) for sm_80 and sm_90.
//  6. Grouped heads (kv_heads=KH) are repeated heads: attention with KH kv heads gives the loss, dq,
//     dk and dv (the group's sum) of attention whose k and v repeat each kv head for the query heads
//     of its group, to 1e-12 in fp64 on the interpreter: causal within documents in a window,
//     multi-query, and keys of another length; the fusion pass and MFU count the FLOPs of the (query,
//     key) pairs the kernels compute (a window's, or T x S).
#include "mdl.h"
#include "backend.h"
#include "cuda.h"
#include "emit_c.h"
#include "emit_cuda.h"
#include "runtime.h"
#include "test.h"
#include "harness.h"
#include "cuda_emu_host.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { B = 2, T = 16 };

// The doc ids of the batch: row 0 three documents, [0,5) [5,11) [11,16); row 1 document 4, then 6,
// then 4 again (the same id after another document).
static int32_t doc_of(int b, int t) {
  if (b == 0)
    return t < 5 ? 0 : t < 11 ? 1 : 2;
  return t < 7 ? 4 : t < 12 ? 6 : 4;
}

// The batch of input node nd: positions restart at each document; a target is the next token of the
// same document, else ignored (-1).
static void batch(const IrNode *nd, int32_t *ids) {
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      int i = b * T + t;
      int start = t;
      while (start > 0 && doc_of(b, start - 1) == doc_of(b, t))
        start--;
      int32_t token = (int32_t)((i * 37 + 11) % 256), next = (int32_t)(((i + 1) * 37 + 11) % 256);
      if (!strcmp(nd->name, "tokens"))
        ids[i] = token;
      else if (!strcmp(nd->name, "targets"))
        ids[i] = t + 1 < T && doc_of(b, t + 1) == doc_of(b, t) ? next : -1;
      else if (!strcmp(nd->name, "pos"))
        ids[i] = t - start;
      else
        ids[i] = doc_of(b, t);
    }
}

static void set_inputs(const Graph *g, Interp *it, const MemPlan *m, char *arena) {
  int32_t ids[B * T];
  for (int i = 0; i < g->n; i++) {
    const IrNode *nd = g->nodes[i];
    if (nd->op != OP_INPUT || shape_numel(nd->shape) != B * T)
      continue;
    batch(nd, ids);
    if (it)
      interp_set_input(it, nd->name, ids, NULL, B * T);
    else
      cpu_set_input(g, m, arena, nd->name, ids, NULL, B * T);
  }
}

//
// 1. The mask alone.
//

// Runs a forward graph whose one output is an ATTENTION_MASK on `backend` (0 interpreter, 1 C, 2 the
// emulated CUDA kernels) into y; false with the reason.
// (tag: a name of the module's own; a loaded module stays loaded, and is found again by its path).
static bool run_forward(Graph *g, int out, int backend, const char *dir, const char *tag, float *y, char *why,
                        size_t n) {
  int64_t numel = shape_numel(g->nodes[out]->shape);
  if (backend == 0) {
    Interp *it = interp_new(g, INTERP_F32);
    set_inputs(g, it, NULL, NULL);
    bool ok = interp_run(it, g->n, why, n);
    for (int64_t i = 0; ok && i < numel; i++)
      y[i] = (float)interp_value(it, out)[i];
    interp_free(it);
    return ok;
  }
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
  MemPlan *m = memplan(f);
  if (backend == 1) {
    CpuModule *cm = cpu_module(f, m, "mask.mdl", why, n);
    char *arena = cm ? cpu_arena_new(m) : NULL;
    if (arena) {
      set_inputs(g, NULL, m, arena);
      cpu_step(cm, arena);
      memcpy(y, cpu_value(m, arena, out), sizeof(float) * (size_t)numel);
      cpu_arena_free(m, arena);
    }
    if (cm)
      cpu_unload(cm);
    return arena != NULL;
  }
  CudaPlan *p = emit_cuda_plan(f, m, "mask.mdl");
  Emu emu = {0};
  snprintf(why, n, "emit_cuda_plan failed");
  bool ok = p && emu_load(p, dir, tag, &emu, why, n);
  if (ok) {
    size_t bytes = (size_t)(p->arena_bytes + 255) / 256 * 256;
    char *arena = aligned_alloc(256, bytes);
    memset(arena, 0, bytes);
    set_inputs(g, NULL, m, arena);
    MdlStatus st = {0};
    for (int i = 0; i < p->nlaunches; i++)
      emu.launch(emu.fn[i], p->launches[i].grid, p->launches[i].block, arena, &st, 7, p->launches[i].chunk,
                 p->launches[i].args, p->launches[i].nargs);
    memcpy(y, cpu_value(m, arena, out), sizeof(float) * (size_t)numel);
    free(arena);
  }
  emu_free(&emu);
  return ok;
}

static void test_mask(const char *dir) {
  static const struct {
    bool causal, doc;
    int window;
    const char *what;
  } cases[] = {{true, true, 0, "causal within documents"},
               {false, true, 0, "within documents"},
               {true, false, 0, "causal"},
               {true, true, 4, "causal within documents, window 4"},
               {true, false, 3, "causal, window 3"}};
  static const char *const backends[] = {"interp", "cpu", "cuda emu"};
  for (int c = 0; c < (int)(sizeof cases / sizeof *cases); c++) {
    Arena *a = arena_new();
    Graph *g = ir_new(a);
    int doc = ir_leaf(g, OP_INPUT, "doc", DT_I32, shape_of(2, (int64_t[]){B, T}), (SrcLoc){0});
    int out = ir_attention_mask(g, cases[c].doc ? doc : -1, T, cases[c].causal, cases[c].window, (SrcLoc){0});
    g->outputs = &out;
    g->noutputs = 1;
    g->fwd_end = g->n;
    int64_t nb = cases[c].doc ? B : 1;
    float *want = malloc(sizeof(float) * (size_t)(nb * T * T)), *got = malloc(sizeof(float) * (size_t)(nb * T * T));
    for (int b = 0; b < nb; b++)
      for (int i = 0; i < T; i++)
        for (int j = 0; j < T; j++) {
          bool seen = (!cases[c].causal || j <= i) && (!cases[c].window || i - j < cases[c].window) &&
                      (!cases[c].doc || doc_of(b, j) == doc_of(b, i));
          want[(b * T + i) * T + j] = seen ? 0.0f : -INFINITY;
        }
    char name[200], why[2048] = "";
    snprintf(name, sizeof name, "attention_mask %s: [%lld,1,%d,%d]", cases[c].what, (long long)nb, T, T);
    CHECK(out >= 0 && shape_eq(g->nodes[out]->shape, shape_of(4, (int64_t[]){nb, 1, T, T})), name, "%s", g->err);
    for (int k = 0; k < 3 && out >= 0; k++) {
      if (k == 2 && !dir)
        continue;
      memset(got, 0x7f, sizeof(float) * (size_t)(nb * T * T));
      bool ok = run_forward(g, out, k, dir, arena_printf(a, "mask%d", c), got, why, sizeof why);
      int64_t bad = -1;
      for (int64_t i = 0; ok && i < nb * T * T && bad < 0; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)))
          bad = i;
      snprintf(name, sizeof name, "attention_mask %s on %s: the rule's 0 and -inf, bit for bit", cases[c].what,
               backends[k]);
      CHECK(ok && bad < 0, name, "%s", ok ? arena_printf(a, "element %lld is %g, not %g", (long long)bad,
                                                         (double)got[bad], (double)want[bad]) : why);
    }
    free(want);
    free(got);
    arena_free(a);
  }
}

//
// 2. The plan.
//

static Graph *graph(Arena *a, const char *model, int64_t t, bool plain, bool no_doc, bool grads) {
  DimOverride ov[] = {{"B", B}, {"T", t}};
  LowerOptions lo = {.plain_attention = plain, .no_doc_mask = no_doc};
  Graph *g = mdl_compile_file_with(a, arena_printf(a, "models/%s.mdl", model), ov, 2, &lo);
  return g && (!grads || autodiff(g, true)) ? g : NULL;
}

// Whether some forward node reads the doc ids input.
static bool reads_doc(const Graph *g) {
  for (int i = 0; i < g->fwd_end; i++)
    for (int k = 0; k < g->nodes[i]->nin; k++) {
      const IrNode *x = g->nodes[g->nodes[i]->in[k]];
      if (x->op == OP_INPUT && !strcmp(x->name, "doc"))
        return true;
    }
  return false;
}

static void test_plan(void) {
  Arena *a = arena_new();
  // (T = 24: the scores [B,H,T,T] are not [B,H,T,D], which gpt2-tiny has too)
  Graph *flash = graph(a, "gpt2-tiny", 24, false, false, true), *plain = graph(a, "gpt2-tiny", 24, true, false, true);
  CHECK(flash && plain, "plain attention: gpt2-tiny compiles both ways", "front end or autodiff failed");
  if (!flash || !plain) {
    arena_free(a);
    return;
  }
  int64_t H = ir_dim(plain, "H"), L = ir_dim(plain, "L");
  char name[300];
  snprintf(name, sizeof name, "plain attention: no attention op, one attention_mask for %lld layers (flash: %lld "
           "attention ops, no mask)", (long long)L, (long long)L);
  CHECK(count_op(plain, OP_ATTENTION) + count_op(plain, OP_ATTENTION_LSE) + count_op(plain, OP_ATTENTION_BWD) == 0 &&
            count_op(plain, OP_ATTENTION_MASK) == 1 && count_op(flash, OP_ATTENTION) == L &&
            count_op(flash, OP_ATTENTION_MASK) == 0,
        name, "plain: %d attention, %d masks; flash: %d attention, %d masks", count_op(plain, OP_ATTENTION),
        count_op(plain, OP_ATTENTION_MASK), count_op(flash, OP_ATTENTION), count_op(flash, OP_ATTENTION_MASK));
  FuseOptions fo = {.fuse = true, .chunk_lmhead = true};
  Fusion *ff = fuse(flash, fo), *fp = fuse(plain, fo);
  MemPlan *mf = memplan(ff), *mp = memplan(fp);
  Shape scores = shape_of(4, (int64_t[]){B, H, 24, 24});
  int square[2] = {0, 0};
  for (int k = 0; k < 2; k++) {
    const Graph *g = k ? plain : flash;
    const MemPlan *m = k ? mp : mf;
    for (int i = 0; i < g->n; i++)
      square[k] += m->offset[i] >= 0 && shape_eq(g->nodes[i]->shape, scores);
  }
  snprintf(name, sizeof name, "plain attention: the memory plan holds %d values of [%d,%lld,24,24] (flash: %d), "
           "%d steps against flash's %d", square[1], B, (long long)H, square[0], fp->nsteps, ff->nsteps);
  CHECK(square[0] == 0 && square[1] >= 4 * L && fp->nsteps > ff->nsteps && mp->activation_bytes > mf->activation_bytes,
        name, "activations %lld vs %lld bytes", (long long)mp->activation_bytes, (long long)mf->activation_bytes);
  int kinds[2] = {0, 0};
  for (int s = 0; s < fp->nsteps; s++) {
    kinds[0] += fp->steps[s].kind == STEP_ATTENTION;
    kinds[1] += fp->steps[s].kind == STEP_GEMM;
  }
  int flash_gemms = 0;
  for (int s = 0; s < ff->nsteps; s++)
    flash_gemms += ff->steps[s].kind == STEP_GEMM;
  snprintf(name, sizeof name, "plain attention: no attention step; its products are %d more GEMM steps (6 a layer)",
           kinds[1] - flash_gemms);
  CHECK(kinds[0] == 0 && kinds[1] == flash_gemms + 6 * L, name, "%d attention steps, %d GEMMs (flash %d)", kinds[0],
        kinds[1], flash_gemms);
  double f_flash = rt_step_flops(flash), f_plain = rt_step_flops(plain);
  double full = 0; // the GEMMs' own count, the masked half included
  for (int i = 0; i < plain->fwd_end; i++)
    if (plain->nodes[i]->op == OP_MATMUL)
      full += 3 * fuse_node_flops(plain, i);
  snprintf(name, sizeof name, "plain attention: model flops %.6g a step, flash's %.6g (the GEMMs compute %.6g)",
           f_plain, f_flash, full);
  CHECK(f_plain == f_flash && full > f_flash, name, "differ by %.6g", f_plain - f_flash);
  Graph *nd_flash = graph(a, "gpt2-tiny", T, false, true, false), *nd_plain = graph(a, "gpt2-tiny", T, true, true, false);
  Graph *d_flash = graph(a, "gpt2-tiny", T, false, false, false);
  CHECK(nd_flash && nd_plain && d_flash && !reads_doc(nd_flash) && !reads_doc(nd_plain) && reads_doc(d_flash),
        "--no-doc-mask: neither lowering reads the doc ids (the default does)", "compiled %d %d %d", nd_flash != NULL,
        nd_plain != NULL, d_flash != NULL);
  arena_free(a);
}

//
// 3. One step, plain against flash.
//

// What a step produced: the loss, the logits and every gradient, as doubles.
typedef struct {
  double loss;
  double *logits;
  double **grad;
  int64_t nlogits;
} Run;

// The logits as the loss reads them: the cross-entropy's input (in bf16 their rounding, which the LM
// head's GEMM writes, and not the f32 values).
static int logits_node(const Graph *g) {
  for (int i = 0; i < g->fwd_end; i++)
    if (g->nodes[i]->op == OP_CROSS_ENTROPY)
      return g->nodes[i]->in[0];
  return -1;
}

static double *doubles_of(const void *p, DType dt, int64_t n) {
  double *d = malloc(sizeof *d * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++)
    d[i] = dt == DT_BF16 ? (double)elem(p, DT_BF16, i) : (double)((const float *)p)[i];
  return d;
}

static void run_free(const Graph *g, Run *r) {
  for (int k = 0; r->grad && k < g->nparams; k++)
    free(r->grad[k]);
  free(r->grad);
  free(r->logits);
}

// The step's values from memory laid out by m (the C back end's arena, or the emulator's).
static void keep(const Graph *g, const MemPlan *m, char *arena, Run *r) {
  int lg = logits_node(g);
  r->loss = *(float *)cpu_value(m, arena, g->loss);
  r->nlogits = shape_numel(g->nodes[lg]->shape);
  r->logits = doubles_of(cpu_value(m, arena, lg), g->nodes[lg]->dtype, r->nlogits);
  r->grad = calloc((size_t)g->nparams, sizeof *r->grad);
  for (int k = 0; k < g->nparams; k++) {
    const IrNode *d = g->nodes[g->grads[k]];
    r->grad[k] = doubles_of(cpu_value(m, arena, d->id), d->dtype, shape_numel(d->shape));
  }
}

static void set_scalars(const Graph *g, const MemPlan *m, char *arena) {
  cpu_set_scalar(g, m, arena, "lr", 1e-3);
  cpu_set_scalar(g, m, arena, "step", 1);
}

// One training step of g on `backend` (0 interpreter, 1 C, 2 emulated CUDA) from the parameters of
// seed 7; the LM head unchunked and no memory shared between values, so that the logits are in memory
// after the step; false with the reason.
static bool step(Graph *g, int backend, const char *dir, const char *tag, Run *r, char *why, size_t n) {
  *r = (Run){0};
  snprintf(why, n, "no cross-entropy");
  if (logits_node(g) < 0)
    return false;
  if (backend == 0) {
    Interp *it = interp_new(g, INTERP_F32);
    interp_init_params(it, 7);
    set_inputs(g, it, NULL, NULL);
    interp_set_scalar(it, "lr", 1e-3);
    interp_set_scalar(it, "step", 1);
    bool ok = interp_run(it, g->n, why, n);
    if (ok) {
      int lg = logits_node(g);
      r->loss = interp_value(it, g->loss)[0];
      r->nlogits = interp_numel(it, lg);
      r->logits = malloc(sizeof(double) * (size_t)r->nlogits);
      memcpy(r->logits, interp_value(it, lg), sizeof(double) * (size_t)r->nlogits);
      r->grad = calloc((size_t)g->nparams, sizeof *r->grad);
      for (int k = 0; k < g->nparams; k++) {
        int64_t ne = interp_numel(it, g->grads[k]);
        r->grad[k] = malloc(sizeof(double) * (size_t)ne);
        memcpy(r->grad[k], interp_value(it, g->grads[k]), sizeof(double) * (size_t)ne);
      }
    }
    interp_free(it);
    return ok;
  }
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = false});
  MemPlan *m = memplan_with(f, false);
  snprintf(why, n, "the logits are not in memory");
  if (m->offset[logits_node(g)] < 0)
    return false;
  if (backend == 1) {
    CpuModule *cm = cpu_module(f, m, tag, why, n);
    char *arena = cm ? cpu_arena_new(m) : NULL;
    bool ok = arena != NULL;
    if (ok) {
      cpu_set_threads(cm, 2);
      cpu_init_params(g, m, arena, 7);
      set_inputs(g, NULL, m, arena);
      set_scalars(g, m, arena);
      ok = cpu_step(cm, arena);
      if (ok)
        keep(g, m, arena, r);
      else
        snprintf(why, n, "%s", cm->error);
      cpu_arena_free(m, arena);
    }
    if (cm)
      cpu_unload(cm);
    return ok;
  }
  CudaPlan *p = emit_cuda_plan(f, m, tag);
  Emu emu = {0};
  snprintf(why, n, "emit_cuda_plan failed");
  bool ok = p && emu_load(p, dir, tag, &emu, why, n);
  if (ok) { // (scratch all NaN: a kernel reading scratch it did not write shows)
    size_t bytes = (size_t)(p->arena_bytes + 255) / 256 * 256;
    char *arena = aligned_alloc(256, bytes);
    memset(arena, 0, bytes);
    memset(arena + p->scratch, 0xff, (size_t)(p->arena_bytes - p->scratch));
    cpu_init_params(g, m, arena, 7);
    set_inputs(g, NULL, m, arena);
    set_scalars(g, m, arena);
    MdlStatus st = {0};
    for (int i = 0; i < p->nlaunches; i++) {
      const CudaLaunch *l = &p->launches[i];
      if (l->kernel)
        emu.launch(emu.fn[i], l->grid, l->block, arena, &st, 7, l->chunk, l->args, l->nargs);
      else
        ref_gemm(arena, &p->gemms[l->gemm]);
    }
    ok = !st.set;
    if (ok)
      keep(g, m, arena, r);
    else
      snprintf(why, n, "the step reports %s", cuda_error_what(st.code));
    free(arena);
  }
  emu_free(&emu);
  return ok;
}

// max |a - b| / max |b|, or with l2 ||a - b|| / ||b||; a NaN is an infinite error.
static double err_of(const double *a, const double *b, int64_t n, bool l2) {
  double d = 0, r = 1e-30;
  for (int64_t i = 0; i < n; i++) {
    double x = fabs(a[i] - b[i]);
    if (isnan(x))
      return INFINITY;
    d = l2 ? d + x * x : fmax(d, x);
    r = l2 ? r + b[i] * b[i] : fmax(r, fabs(b[i]));
  }
  return l2 ? sqrt(d / r) : d / r;
}

// Checks plain's step against flash's (same back end, same model and precision) and names the worst.
static const double tol_logits[2] = {5e-6, 1e-2}; // fp32, bf16

static void compare(const char *label, const Graph *g, const Run *plain, const Run *flash, bool bf16) {
  double tol_loss = bf16 ? 1e-4 : 5e-6, tol_lg = tol_logits[bf16], tol = bf16 ? 1.5e-2 : 5e-6;
  double el = fabs(plain->loss - flash->loss) / fabs(flash->loss);
  double eg = err_of(plain->logits, flash->logits, flash->nlogits, bf16), worst = 0;
  int at = 0;
  for (int k = 0; k < g->nparams; k++) {
    double e = err_of(plain->grad[k], flash->grad[k], shape_numel(g->nodes[g->params[k]]->shape), bf16);
    if (!(e <= worst)) {
      worst = e;
      at = k;
    }
  }
  char name[400];
  snprintf(name, sizeof name, "%s: plain = flash: loss %.3g, logits %.3g, gradients %.3g (%s) %s", label, el, eg, worst,
           g->nodes[g->params[at]]->name, bf16 ? "in L2" : "relative");
  CHECK(el <= tol_loss && eg <= tol_lg && worst <= tol, name, "loss %.9g vs %.9g; tolerances %g, %g, %g",
        plain->loss, flash->loss, tol_loss, tol_lg, tol);
}

static void test_model(const char *model, bool bf16, const char *dir) {
  static const char *const backends[] = {"interp", "cpu", "cuda emu"};
  Arena *a = arena_new();
  // [no doc mask][plain]
  Graph *g[2][2];
  char why[4096];
  for (int nd = 0; nd < 2; nd++)
    for (int pl = 0; pl < 2; pl++) {
      g[nd][pl] = graph(a, model, T, pl, nd, true);
      if (g[nd][pl] && bf16 && !precision_assign(g[nd][pl], DT_BF16, why, sizeof why))
        g[nd][pl] = NULL;
    }
  const char *prec = bf16 ? "bf16" : "fp32";
  char name[300];
  snprintf(name, sizeof name, "plain attention %s %s: compiles with and without the doc mask", model, prec);
  CHECK(g[0][0] && g[0][1] && g[1][0] && g[1][1], name, "front end, autodiff or precision failed");
  for (int k = 0; k < 3 && g[0][0] && g[0][1] && g[1][0] && g[1][1]; k++) {
    if (k == 2 && !dir)
      continue;
    Run r[2][2];
    bool ok = true;
    for (int nd = 0; nd < 2 && ok; nd++)
      for (int pl = 0; pl < 2 && ok; pl++) {
        const char *tag = arena_printf(a, "%s_%s_%s%s", model, prec, pl ? "plain" : "flash", nd ? "_nodoc" : "");
        ok = step(g[nd][pl], k, dir, tag, &r[nd][pl], why, sizeof why);
        snprintf(name, sizeof name, "plain attention %s %s %s: %s runs", model, prec, backends[k], tag);
        if (!ok)
          CHECK(false, name, "%.600s", why);
      }
    if (!ok)
      continue;
    snprintf(name, sizeof name, "plain attention %s %s %s", model, prec, backends[k]);
    compare(name, g[0][1], &r[0][1], &r[0][0], bf16);
    snprintf(name, sizeof name, "plain attention %s %s %s, no doc mask", model, prec, backends[k]);
    compare(name, g[1][1], &r[1][1], &r[1][0], bf16);
    double moved = err_of(r[1][0].logits, r[0][0].logits, r[0][0].nlogits, bf16);
    snprintf(name, sizeof name, "plain attention %s %s %s: the doc mask moves flash's logits by %.3g %s", model, prec,
             backends[k], moved, bf16 ? "in L2" : "relative");
    CHECK(moved > 10 * tol_logits[bf16], name, "not 10 times the tolerance of the agreement, %g", tol_logits[bf16]);
    for (int nd = 0; nd < 2; nd++)
      for (int pl = 0; pl < 2; pl++)
        run_free(g[nd][pl], &r[nd][pl]);
  }
  arena_free(a);
}

//
// 4. Checkpoints.
//

static void test_checkpoint(void) {
  Arena *a = arena_new();
  FuseOptions fo = {.fuse = true, .chunk_lmhead = true, .max_group = 64};
  Graph *g[2];
  Run r[2];
  char why[600] = "", name[300];
  bool ok = true;
  for (int k = 0; k < 2 && ok; k++) {
    g[k] = graph(a, "gpt2-tiny", T, true, false, true);
    ok = g[k] && precision_assign(g[k], DT_BF16, why, sizeof why) &&
         checkpoint_place(g[k], k ? "all" : "none", 0, NULL, false, fo, true, NULL, why, sizeof why) &&
         step(g[k], 1, NULL, k ? "ckpt_all" : "ckpt_none", &r[k], why, sizeof why);
  }
  CHECK(ok, "plain attention: checkpoint none and all run a step", "%s", why);
  if (ok) {
    int softmax = 0;
    for (int i = g[1]->fwd_end; i < g[1]->n; i++)
      softmax += g[1]->nodes[i]->op == OP_SOFTMAX;
    int64_t L = ir_dim(g[1], "L"), bad = -1;
    for (int k = 0; k < g[0]->nparams && bad < 0; k++)
      if (memcmp(r[0].grad[k], r[1].grad[k], sizeof(double) * (size_t)shape_numel(g[0]->nodes[g[0]->params[k]]->shape)))
        bad = k;
    snprintf(name, sizeof name, "plain attention: checkpoint all recomputes %d softmaxes (%lld layers), %d of %d "
             "saved values; loss and gradients are none's bit for bit", softmax, (long long)L, g[1]->ckpt.nrecomputed,
             g[1]->ckpt.nsaved);
    CHECK(softmax == L && r[0].loss == r[1].loss && bad < 0, name, "loss %.9g vs %.9g; gradient %s differs",
          r[1].loss, r[0].loss, bad >= 0 ? g[0]->nodes[g[0]->params[bad]]->name : "none");
    run_free(g[0], &r[0]);
    run_free(g[1], &r[1]);
  }
  arena_free(a);
}

//
// 5. NVRTC.
//

static void test_nvrtc(void) {
  for (int pr = 0; pr < 2; pr++) {
    Arena *a = arena_new();
    Graph *g = graph(a, "gpt2-tiny", T, true, false, true);
    char why[4096] = "", name[200];
    if (g && pr && !precision_assign(g, DT_BF16, why, sizeof why))
      g = NULL;
    Fusion *f = g ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
    CudaPlan *p = f ? emit_cuda_plan(f, memplan(f), "gpt2-tiny") : NULL;
    for (int k = 0; k < 2; k++) {
      const char *arch = k ? "sm_90" : "sm_80";
      NvrtcResult r = {0};
      bool ok = p && nvrtc_compile(p->source, arch, &r, why, sizeof why);
      snprintf(name, sizeof name, "plain attention: NVRTC compiles gpt2-tiny %s for %s", pr ? "bf16" : "fp32", arch);
      CHECK(ok && r.size > 0 && !r.log, name, "%.600s", !p ? "no module" : ok ? r.log : why);
      free(r.cubin);
      free(r.log);
    }
    arena_free(a);
  }
}

//
// 6. Grouped heads are repeated heads.
//

// Attention with kv_heads=KH against attention with KH*G heads whose k and v repeat each kv head for
// the G query heads of its group (a copy, [B,S,KH,1,D] broadcast to [B,S,KH,G,D]); `a` says which of
// the two the loss reads. Causal within documents in a window (WIN), or (CROSS) over S keys.
static const char repeated[] =
    "model rep\n"
    "dim B = 2\n"
    "dim T = 12\n"
    "dim S = T\n"
    "dim KH = 2\n"
    "dim G = 3\n"
    "dim D = 4\n"
    "input doc: i32[B, T]\n"
    "param q: [B, T, KH*G*D] = normal(1)\n"
    "param k: [B, S, KH*D] = normal(1)\n"
    "param v: [B, S, KH*D] = normal(1)\n"
    "param w: [B, T, KH*G*D] = normal(1)\n"
    "param rep: [G, 1] = zeros\n"
    "kr = reshape(reshape(k, [B, S, KH, 1, D]) + rep, [B, S, KH*G*D])\n"
    "vr = reshape(reshape(v, [B, S, KH, 1, D]) + rep, [B, S, KH*G*D])\n"
    "a = attention(q, %s, heads=KH*G%s)\n"
    "output loss = mean(a * w) + 0.0 * mean(rep)\n";

// The loss and the gradients of q, k and v (fp64 interpreter, one step from seed 3) of `repeated` with
// the grouped or the repeated attention.
static bool grouped_run(bool grouped, const char *opts, const DimOverride *ov, int nov, double *loss,
                        double **grad, int64_t *numel, double *flops, double *node_flops) {
  Arena *a = arena_new();
  char *text = arena_printf(a, repeated, grouped ? "k, v" : "kr, vr",
                            arena_printf(a, "%s%s", grouped ? ", kv_heads=KH" : "", opts));
  Graph *g = mdl_compile_text(a, "rep.mdl", text, ov, nov);
  for (int i = 0; g && grouped && i < g->fwd_end; i++) // the FLOPs of what the kernels compute
    if (g->nodes[i]->op == OP_ATTENTION)
      *flops = rt_step_flops(g), *node_flops = fuse_node_flops(g, i);
  bool ok = g && autodiff(g, false);
  Interp *it = ok ? interp_new(g, INTERP_F64) : NULL;
  char err[256] = "";
  if (it) {
    interp_init_params(it, 3);
    int64_t nb = ir_dim(g, "B"), nt = ir_dim(g, "T");
    int32_t *ids = malloc(sizeof *ids * (size_t)(nb * nt));
    for (int64_t i = 0; i < nb * nt; i++)
      ids[i] = (int32_t)(i % nt < nt / 3 ? 0 : i % nt < 2 * nt / 3 + i / nt ? 1 : 2);
    interp_set_input(it, "doc", ids, NULL, nb * nt);
    free(ids);
    ok = interp_run(it, g->n, err, sizeof err);
  }
  for (int k = 0; ok && k < 3; k++) {
    int p = g->params[k], gr = g->grads[k];
    int64_t n = numel[k] = shape_numel(g->nodes[p]->shape);
    grad[k] = malloc(sizeof(double) * (size_t)n);
    memcpy(grad[k], interp_value(it, gr), sizeof(double) * (size_t)n);
  }
  if (ok)
    *loss = interp_value(it, g->loss)[0];
  if (it)
    interp_free(it);
  arena_free(a);
  return ok;
}

static void test_grouped(void) {
  // pairs: the (query, key) pairs of a head that the kernels compute, T = 12: a window of 5 sees 5 keys
  // but in its first rows (5 * 12 - 5^2 / 2, att_pairs' count), causal half of 12 x 12, 12 x 7 keys
  static const struct {
    const char *what, *opts;
    DimOverride ov[2];
    int nov;
    double pairs, width; // (width: q's channels, KH G D)
  } cases[] = {
      {"kv_heads=2 of 6, causal within documents, window 5", ", causal=true, doc=doc, window=5", {{NULL, 0}}, 0, 47.5,
       24},
      {"kv_heads=1 of 4 (multi-query), causal", ", causal=true", {{"KH", 1}, {"G", 4}}, 2, 72, 16},
      {"kv_heads=2 of 6, 7 keys for 12 queries", "", {{"S", 7}}, 1, 84, 24},
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    double lg = 0, lr = 0, *gg[3] = {0}, *gr[3] = {0}, flops = 0, node_flops = 0, unused;
    int64_t ng[3] = {0}, nr[3] = {0};
    bool ok = grouped_run(true, cases[c].opts, cases[c].ov, cases[c].nov, &lg, gg, ng, &flops, &node_flops) &&
              grouped_run(false, cases[c].opts, cases[c].ov, cases[c].nov, &lr, gr, nr, &unused, &unused);
    char name[256];
    // 2 products of 2 flops a channel per pair, over B = 2 batches of q's channels; the step: 3 times
    // the forward (the model FLOPs of MFU), the attention its only product
    double want = 4.0 * 2 * cases[c].width * cases[c].pairs;
    snprintf(name, sizeof name, "grouped heads, %s: the attention's FLOPs count the pairs the kernels compute "
             "(%.0f, step %.0f)", cases[c].what, node_flops, flops);
    CHECK(ok && node_flops == want && flops == 3 * want, name, "wanted %.0f and %.0f", want, 3 * want);
    snprintf(name, sizeof name, "grouped heads, %s: the loss equals that of k and v repeated per query head (%.9f)",
             cases[c].what, lg);
    CHECK(ok && fabs(lg - lr) <= 1e-12 * fabs(lr) && lg != 0, name, ok ? "%.17g vs %.17g" : "a run failed", lg, lr);
    static const char *const names[3] = {"q", "k", "v"};
    for (int k = 0; ok && k < 3; k++) {
      double worst = ng[k] == nr[k] ? 0 : INFINITY, scale = 0;
      for (int64_t i = 0; i < ng[k] && ng[k] == nr[k]; i++) {
        worst = fmax(worst, fabs(gg[k][i] - gr[k][i]));
        scale = fmax(scale, fabs(gr[k][i]));
      }
      snprintf(name, sizeof name, "grouped heads, %s: d%s equals the repeated heads' (the group's sum for k and v)",
               cases[c].what, names[k]);
      CHECK(scale > 0 && worst <= 1e-12 * scale, name, "worst %.3g of %.3g", worst, scale);
    }
    for (int k = 0; k < 3; k++) {
      free(gg[k]);
      free(gr[k]);
    }
  }
}

int main(void) {
  char dir[] = "/tmp/mdl-plain-XXXXXX";
  if (!cache_dir_make(dir, "plain attention: a temporary directory"))
    TEST_EXIT();
  bool emu = system("g++ --version >/dev/null 2>&1") == 0;
  if (!emu)
    printf("[skip] plain attention: cuda emu: no g++\n");
  test_mask(emu ? dir : NULL);
  test_plan();
  for (int pr = 0; pr < 2; pr++) {
    test_model("gpt2-tiny", pr, emu ? dir : NULL);
    test_model("llama-tiny", pr, emu ? dir : NULL);
  }
  test_checkpoint();
  test_grouped();
  char why[256];
  if (nvrtc_available(why, sizeof why))
    test_nvrtc();
  else
    printf("[skip] plain attention: nvrtc: %s\n", why);
  remove_dir(dir);
  TEST_EXIT();
}
