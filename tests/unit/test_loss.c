// test_loss.c: the mean of a cross-entropy is the mean over the targets it counts, as PyTorch's
// cross_entropy(..., ignore_index=-1) takes it (sema.c lowers mean(cross_entropy(logits, targets)) to
// sum / target_count(targets)), on every back end, against a computation of its own here.
//
// The model is an LM head: logits = (x * s) @ w over [B, T] positions, x an input, s and w parameters
// set to chosen values. The test computes in double, from x, s and w, each position's logits, its
// cross-entropy (log-sum-exp minus the target's logit), their sum over the counted targets (>= 0)
// divided by how many there are, and the gradients of that mean: G = (softmax - onehot) / count on a
// counted row and 0 on an ignored one, dw = (x * s)^T G and ds = sum over rows of x * (G w^T). Then:
//  1. the reference interpreter in fp64 agrees within 1e-12 relative per tensor, and in fp32 within
//     1e-5; the compiled C back end (fused: the LM head chunked, which the test checks; and unfused) and
//     the emitted CUDA kernels run on the CPU emulator (fused and unfused) within 1e-5, on a batch
//     whose ignored targets are a document's last position, a row's padding and a few more;
//  2. a batch with every target ignored has loss 0 and gradients exactly 0 (PyTorch's would be NaN):
//     the count is at least 1, on every back end;
//  3. over 32800 positions (B = 2, T = 16400) the count and the sum take the back ends' blocked
//     reductions (partial results per block), fused, on the C back end and the emulator, within 1e-5;
//  4. the validation engine's graph (forward only, no named output kept) chunks its LM head and its
//     loss is the counted mean, on the C back end and the emulator;
//  5. every module emitted here compiles with NVRTC for sm_90 where NVRTC is available.
#include "mdl.h"
#include "backend.h"
#include "cuda.h"
#include "emit_c.h"
#include "emit_cuda.h"
#include "test.h"
#include "harness.h"
#include "cuda_emu_host.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { C = 8, V = 40 };

static const char model[] = "model counted\n"
                            "dim B in 1..8\n"
                            "dim T in 1..20000\n"
                            "dim C = 8\n"
                            "dim V = 40\n"
                            "input x: f32[B, T, C]\n"
                            "input targets: i32[B, T]\n"
                            "param s: [C] = ones\n"
                            "param w: [C, V] = normal(0.5)\n"
                            "output loss = mean(cross_entropy((x * s) @ w, targets))\n";

typedef enum { SOME_IGNORED, ALL_IGNORED } Pattern;

// A batch of B x T positions, the parameters, and what the test computes from them.
typedef struct {
  int64_t B, T, n;
  float *x;         // [n, C]
  int32_t *targets; // [n]
  float s[C], w[C * V];
  double loss, ds[C], dw[C * V];
  int64_t counted;
} Batch;

static Batch *batch_new(int64_t B, int64_t T, Pattern p) {
  Batch *b = calloc(1, sizeof *b);
  b->B = B, b->T = T, b->n = B * T;
  b->x = malloc(sizeof(float) * (size_t)(b->n * C));
  b->targets = malloc(sizeof(int32_t) * (size_t)b->n);
  for (int64_t i = 0; i < b->n * C; i++)
    b->x[i] = (float)sin(0.7 * (double)i + 0.3);
  for (int c = 0; c < C; c++)
    b->s[c] = (float)(0.75 + 0.5 * sin(1.3 * c));
  for (int i = 0; i < C * V; i++)
    b->w[i] = (float)(0.6 * sin(0.37 * i + 0.1));
  // Ignored: each row's last position (a document's end), the last quarter of row 1 (padding), and
  // every 7th position besides.
  for (int64_t j = 0; j < b->n; j++) {
    int64_t row = j / T, t = j % T;
    bool ignored = p == ALL_IGNORED || t == T - 1 || (row == 1 && t >= T - T / 4) || j % 7 == 3;
    b->targets[j] = ignored ? -1 : (int32_t)((j * 13 + 5) % V);
  }
  // The reference, in double.
  double h[C], lg[V], sum = 0, *gs = calloc((size_t)b->n * V, sizeof(double));
  for (int64_t j = 0; j < b->n; j++)
    b->counted += b->targets[j] >= 0;
  double count = b->counted > 1 ? (double)b->counted : 1;
  for (int64_t j = 0; j < b->n; j++) {
    int32_t t = b->targets[j];
    if (t < 0)
      continue;
    double m = -INFINITY, z = 0;
    for (int c = 0; c < C; c++)
      h[c] = (double)b->x[j * C + c] * b->s[c];
    for (int v = 0; v < V; v++) {
      lg[v] = 0;
      for (int c = 0; c < C; c++)
        lg[v] += h[c] * b->w[c * V + v];
      m = fmax(m, lg[v]);
    }
    for (int v = 0; v < V; v++)
      z += exp(lg[v] - m);
    sum += m + log(z) - lg[t];
    for (int v = 0; v < V; v++)
      gs[j * V + v] = (exp(lg[v] - m) / z - (v == t)) / count;
  }
  b->loss = sum / count;
  for (int64_t j = 0; j < b->n; j++)
    for (int c = 0; c < C; c++) {
      double gw = 0; // (G w^T)[j][c]
      for (int v = 0; v < V; v++) {
        b->dw[c * V + v] += (double)b->x[j * C + c] * b->s[c] * gs[j * V + v];
        gw += gs[j * V + v] * b->w[c * V + v];
      }
      b->ds[c] += (double)b->x[j * C + c] * gw;
    }
  free(gs);
  return b;
}

static void batch_free(Batch *b) {
  free(b->x);
  free(b->targets);
  free(b);
}

// What a back end computed: the loss and the gradients of s and w.
typedef struct {
  double loss, ds[C], dw[C * V];
} Result;

// max |got - want| / max |want| (the difference itself when want is all zeros); a NaN is infinite.
static double rel_or_abs_err(const double *got, const double *want, int n) {
  double d = 0, m = 0;
  for (int i = 0; i < n; i++) {
    double e = fabs(got[i] - want[i]);
    d = fmax(d, isnan(e) ? INFINITY : e);
    m = fmax(m, fabs(want[i]));
  }
  return m > 0 ? d / m : d;
}

// Compares r with the reference: within tol (loss and gradients), or with every target ignored
// exactly 0 everywhere.
static void compare(const char *label, const Batch *b, const Result *r, bool grads, double loss_tol, double tol) {
  char name[300];
  if (b->counted == 0) {
    bool zero = r->loss == 0;
    for (int i = 0; i < C * V && grads; i++)
      zero &= r->dw[i] == 0 && (i >= C || r->ds[i] == 0);
    snprintf(name, sizeof name, "%s: every target ignored: loss 0%s", label, grads ? " and gradients exactly 0" : "");
    CHECK(zero, name, "loss %g, ds[0] %g, dw[0] %g", r->loss, r->ds[0], r->dw[0]);
    return;
  }
  double el = fabs(r->loss - b->loss) / fabs(b->loss);
  snprintf(name, sizeof name, "%s: the loss is the mean over the %lld counted targets of %lld (%.6f, within %g)", label,
           (long long)b->counted, (long long)b->n, b->loss, loss_tol);
  CHECK(el < loss_tol, name, "loss %.9g, reference %.9g (relative error %.3g; the mean over every position would be "
        "%.9g)", r->loss, b->loss, el, b->loss * (double)b->counted / (double)b->n);
  if (!grads)
    return;
  double es = rel_or_abs_err(r->ds, b->ds, C), ew = rel_or_abs_err(r->dw, b->dw, C * V);
  snprintf(name, sizeof name, "%s: the gradients of s and w within %g (%.1e, %.1e)", label, tol, es, ew);
  CHECK(es < tol && ew < tol, name, "ds %.3g, dw %.3g", es, ew);
}

// The training graph (gradients, no optimizer) or, with eval, the validation engine's: forward only,
// dropout off, no named output kept.
static Graph *graph(Arena *a, const Batch *b, bool eval) {
  DimOverride ov[2] = {{"B", b->B}, {"T", b->T}};
  Graph *g = mdl_compile_text(a, "counted.mdl", model, ov, 2);
  if (g && eval) {
    ir_eval_mode(g);
    g->noutputs = 0;
  } else if (g && !autodiff(g, false)) {
    g = NULL;
  }
  return g;
}

static int param_node(const Graph *g, const char *name) {
  for (int k = 0; k < g->nparams; k++)
    if (!strcmp(g->nodes[g->params[k]]->name, name))
      return k;
  return -1;
}

static void interp_case(const char *label, const Batch *b, InterpPrecision prec, double tol) {
  Arena *a = arena_new();
  Graph *g = graph(a, b, false);
  char err[256] = "the model does not compile", name[200];
  Interp *it = g ? interp_new(g, prec) : NULL;
  bool ok = it && interp_set_input(it, "x", NULL, b->x, b->n * C) &&
            interp_set_input(it, "targets", b->targets, NULL, b->n);
  int ks = g ? param_node(g, "s") : -1, kw = g ? param_node(g, "w") : -1;
  if (ok) {
    double *s = interp_param(it, g->params[ks]), *w = interp_param(it, g->params[kw]);
    for (int i = 0; i < C * V; i++)
      w[i] = b->w[i], s[i % C] = b->s[i % C];
    ok = interp_run(it, g->n, err, sizeof err);
  }
  snprintf(name, sizeof name, "%s: runs", label);
  CHECK(ok, name, "%s", err);
  if (ok) {
    Result r = {.loss = interp_value(it, g->loss)[0]};
    memcpy(r.ds, interp_value(it, g->grads[ks]), sizeof r.ds);
    memcpy(r.dw, interp_value(it, g->grads[kw]), sizeof r.dw);
    compare(label, b, &r, true, tol, tol);
  }
  if (it)
    interp_free(it);
  arena_free(a);
}

// Inputs and parameters into an arena planned by m.
static void fill(const Graph *g, const MemPlan *m, char *arena, const Batch *b) {
  cpu_set_input(g, m, arena, "x", NULL, b->x, b->n * C);
  cpu_set_input(g, m, arena, "targets", b->targets, NULL, b->n);
  memcpy(cpu_value(m, arena, g->params[param_node(g, "s")]), b->s, sizeof b->s);
  memcpy(cpu_value(m, arena, g->params[param_node(g, "w")]), b->w, sizeof b->w);
}

static void keep(const Graph *g, const MemPlan *m, char *arena, Result *r) {
  r->loss = *(float *)cpu_value(m, arena, g->loss);
  if (!g->grads)
    return;
  const float *ds = cpu_value(m, arena, g->grads[param_node(g, "s")]);
  const float *dw = cpu_value(m, arena, g->grads[param_node(g, "w")]);
  for (int i = 0; i < C * V; i++)
    r->dw[i] = dw[i], r->ds[i % C] = ds[i % C];
}

static bool run_cpu(const Graph *g, const Fusion *f, const MemPlan *m, const Batch *b, Result *r, char *why,
                    size_t n) {
  CpuModule *cm = cpu_module(f, m, "counted.mdl", why, n);
  if (!cm)
    return false;
  char *arena = cpu_arena_new(m);
  fill(g, m, arena, b);
  cpu_set_threads(cm, 2);
  bool ok = cpu_step(cm, arena);
  if (ok)
    keep(g, m, arena, r);
  else
    snprintf(why, n, "%s", cm->error);
  cpu_arena_free(m, arena);
  cpu_unload(cm);
  return ok;
}

// The emitted CUDA module's launches run on the CPU emulator, the GEMMs by the reference GEMM; also
// compiled with NVRTC for sm_90 where there is one.
static bool run_emu(const Graph *g, const Fusion *f, const MemPlan *m, const Batch *b, const char *dir, const char *tag,
                    const char *label, Result *r, char *why, size_t n) {
  CudaPlan *p = emit_cuda_plan(f, m, "counted.mdl");
  Emu emu = {0};
  snprintf(why, n, "emit_cuda_plan failed");
  if (!p || !emu_load(p, dir, tag, &emu, why, n)) {
    emu_free(&emu);
    return false;
  }
  char nv[200], name[400];
  if (nvrtc_available(nv, sizeof nv)) {
    NvrtcResult nr = {0};
    char err[2000];
    bool ok = nvrtc_compile(p->source, "sm_90", &nr, err, sizeof err);
    snprintf(name, sizeof name, "%s: the module compiles with NVRTC for sm_90", label);
    CHECK(ok && !nr.log, name, "%.1000s", ok ? nr.log : err);
    free(nr.cubin);
    free(nr.log);
  } else {
    printf("[skip] %s: NVRTC: %s\n", label, nv);
  }
  // (zeroed, but for the kernels' scratch: all NaN, so a kernel reading scratch it did not write shows)
  size_t bytes = (size_t)(p->arena_bytes + 255) / 256 * 256;
  char *arena = aligned_alloc(256, bytes ? bytes : 256);
  memset(arena, 0, bytes);
  memset(arena + p->scratch, 0xff, (size_t)(p->arena_bytes - p->scratch));
  fill(g, m, arena, b);
  MdlStatus st = {0};
  for (int i = 0; i < p->nlaunches; i++) {
    const CudaLaunch *l = &p->launches[i];
    if (l->kernel)
      emu.launch(emu.fn[i], l->grid, l->block, arena, &st, 7, l->chunk, l->args, l->nargs);
    else
      ref_gemm(arena, &p->gemms[l->gemm]);
  }
  if (st.set)
    snprintf(why, n, "the step reports %s", cuda_error_what(st.code));
  else
    keep(g, m, arena, r);
  free(arena);
  emu_free(&emu);
  return !st.set;
}

// The compiled back ends on batch b: the C back end and, with dir, the emulated CUDA kernels; fused
// and unfused unless fused_only.
static void compiled_case(const char *label, const Batch *b, const char *dir, bool eval, bool fused_only,
                          double loss_tol, double tol) {
  for (int fz = 1; fz >= (fused_only ? 1 : 0); fz--) {
    Arena *a = arena_new();
    Graph *g = graph(a, b, eval);
    char name[300], why[4000] = "the model does not compile";
    const char *mode = fz ? "fused" : "unfused";
    Fusion *f = g ? fuse(g, (FuseOptions){.fuse = fz, .chunk_lmhead = fz}) : NULL;
    MemPlan *m = f ? memplan(f) : NULL;
    if (f && fz) {
      int lm = -1;
      for (int s = 0; s < f->nsteps; s++)
        lm = f->steps[s].kind == STEP_LMHEAD ? s : lm;
      snprintf(name, sizeof name, "%s %s: the LM head is chunked", label, mode);
      CHECK(lm >= 0 && m->offset[f->steps[lm].root] < 0, name, "%s",
            lm < 0 ? "no LM-head step" : "the logits are in the arena");
    }
    Result r = {0};
    bool ok = m && run_cpu(g, f, m, b, &r, why, sizeof why);
    snprintf(name, sizeof name, "%s C %s: runs", label, mode);
    CHECK(ok, name, "%.1000s", why);
    snprintf(name, sizeof name, "%s C %s", label, mode);
    if (ok)
      compare(name, b, &r, !eval, loss_tol, tol);
    if (dir && m) {
      char tag[100];
      snprintf(tag, sizeof tag, "loss_%lld_%s%s", (long long)b->n, mode, eval ? "_eval" : "");
      snprintf(name, sizeof name, "%s CUDA (emulated) %s", label, mode);
      memset(&r, 0, sizeof r);
      ok = run_emu(g, f, m, b, dir, tag, name, &r, why, sizeof why);
      char ran[340];
      snprintf(ran, sizeof ran, "%s: runs", name);
      CHECK(ok, ran, "%.1000s", why);
      if (ok)
        compare(name, b, &r, !eval, loss_tol, tol);
    }
    arena_free(a);
  }
}

int main(void) {
  char dir[] = "/tmp/mdl-loss-XXXXXX";
  if (!cache_dir_make(dir, "loss: a temporary directory"))
    TEST_EXIT();
  const char *emu = dir;
  if (system("g++ --version >/dev/null 2>&1") != 0) {
    printf("[skip] loss CUDA (emulated): no g++\n");
    emu = NULL;
  }
  Batch *some = batch_new(3, 16, SOME_IGNORED), *none = batch_new(3, 16, ALL_IGNORED);
  CHECK(some->counted > 0 && some->counted < some->n - 8, "loss: the batch ignores some targets",
        "%lld of %lld counted", (long long)some->counted, (long long)some->n);
  for (int p = 0; p < 2; p++) {
    Batch *b = p ? none : some;
    interp_case("loss interp fp64", b, INTERP_F64, 1e-12);
    interp_case("loss interp fp32", b, INTERP_F32, 1e-5);
    compiled_case("loss", b, emu, false, false, 1e-5, 1e-5);
    compiled_case("loss validation", b, emu, true, true, 1e-5, 1e-5);
  }
  batch_free(some);
  batch_free(none);
  Batch *long_batch = batch_new(2, 16400, SOME_IGNORED);
  compiled_case("loss 32800 positions", long_batch, emu, false, true, 1e-5, 1e-5);
  batch_free(long_batch);
  remove_dir(dir);
  TEST_EXIT();
}
