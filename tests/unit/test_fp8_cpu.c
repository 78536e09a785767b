// test_fp8_cpu.c: precision = fp8 on the compiled CPU back end against the reference interpreter.
//  1. gpt2-tiny (B=2, T=16; fused, the LM head chunked; no memory reuse, so that every cast's codes
//     stay readable after the step), from the same parameters and batch, 3 AdamW steps:
//     - the scales are bit for bit the interpreter's after every step, and so are the histories of
//       the weights' tensors after the first (their inputs, the initial weights, are equal); every
//       other amax within 1e-5 relative (an activation's largest value moves with the GEMMs' f32
//       sums, which the interpreter takes in double);
//     - in the first step, every fp8 code the C back end stores is the interpreter's where the value
//       cast is bit for bit the same (its f32 input in memory), and at least 99% of all codes are;
//     - the losses within 1e-4 relative at every step, the parameters after the third within 3e-3
//       (L2 relative, over all of them: the bf16 comparison's bound in test_cpu.c).
//  2. A model whose activation overflows (x 1e30 x 1e30) into an fp8 GEMM, on the interpreter and the C
//     back end: the step's gradient norm is NaN, the weights keep their values, the histories do not
//     roll, and fp8_state_check names the tensor and its line.
//  3. The compute capability read from a device's arch, which decides whether a GPU has FP8 GEMMs.
//  4. The engines' fp8 sharing (Engine.set_fp8_amax, set_fp8_lead; train.c's ranks and micro-batches),
//     on the interpreter and the C back end, on a small MLP: the amax hook is called after the
//     calibration pass and after the step's pass (twice in the first step, once after), an amax it
//     raises is the one rolled into the history and the scale follows it, and a NaN it sets skips the
//     step (the gradient norm NaN, the weights and histories as they were); a gradients-only engine
//     led by given scales casts with them (its scales become theirs), records its amaxes (the two
//     engines' within 1e-5 relative), and neither calibrates nor rolls a history.
#include "mdl.h"
#include "backend.h"
#include "emit_c.h"
#include "cuda.h"
#include "fp8_state.h"
#include "runtime.h"
#include "test.h"
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_bits.h"

static Graph *fp8_graph(Arena *a, const char *path, const char *text) {
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  Graph *g = text ? mdl_compile_text(a, path, text, NULL, 0) : mdl_compile_file(a, path, ov, 2);
  char why[512];
  if (!g || !autodiff(g, true) || !precision_assign(g, DT_F8E4M3, why, sizeof why)) {
    printf("[fail] %s: front end, autodiff or the fp8 pass failed\n", path);
    exit(1);
  }
  return g;
}

static void feed(Engine *e, const Graph *g) {
  for (int i = 0; i < g->fwd_end; i++) {
    const IrNode *nd = g->nodes[i];
    if (nd->op != OP_INPUT)
      continue;
    int64_t n = shape_numel(nd->shape);
    int32_t *ids = malloc(sizeof *ids * (size_t)n);
    float *f = malloc(sizeof *f * (size_t)n);
    packed_batch(nd, ids, f);
    e->set_input(e, nd->name, nd->dtype == DT_I32 ? ids : NULL, nd->dtype == DT_I32 ? NULL : f, n);
    free(ids);
    free(f);
  }
}

static Engine *cpu_engine(Graph *g, const char *path) {
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
  MemPlan *m = memplan_with(f, false);
  char *src = emit_c(f, m, path), err[512] = "emit_c failed";
  Engine *e = src ? engine_cpu(f, m, src, 7, err, sizeof err) : NULL;
  CHECK(e != NULL, "fp8 cpu: the module compiles and loads", "%s", err);
  return e;
}

static bool step(Engine *e, int s) {
  char err[256] = "";
  e->set_scalar(e, "lr", 2e-3);
  e->set_scalar(e, "step", s);
  bool ok = e->step(e, err, sizeof err);
  if (!ok)
    printf("[fail] fp8 cpu: %s step %d: %s\n", e->name, s, err);
  return ok;
}

static float *read_all(Engine *e, int node) {
  int64_t n = shape_numel(e->g->nodes[node]->shape);
  float *x = malloc(sizeof(float) * (size_t)n);
  e->read(e, node, x);
  return x;
}

// The codes of every fp8 CAST: the C back end's (in its arena) against the interpreter's values.
static void compare_codes(const Graph *g, Engine *ec, Engine *ei) {
  int64_t same_in = 0, same_in_bad = 0, total = 0, differ = 0;
  for (int i = 0; i < g->n; i++) {
    const IrNode *c = g->nodes[i];
    if (c->op != OP_CAST || !is_fp8(c->dtype))
      continue;
    const uint8_t *code = (const uint8_t *)ec->values(ec, i);
    const float *xin = ec->values(ec, c->in[0]);
    if (!code)
      continue;
    int64_t n = shape_numel(c->shape);
    float *want = read_all(ei, i), *win = read_all(ei, c->in[0]);
    for (int64_t j = 0; j < n; j++) {
      float got = c->dtype == DT_F8E5M2 ? mdl_e5m2_to_f32(code[j]) : mdl_e4m3_to_f32(code[j]);
      bool eq = got == want[j] || (isnan(got) && isnan(want[j]));
      total++;
      differ += !eq;
      if (xin && memcmp(&xin[j], &win[j], sizeof(float)) == 0)
        same_in++, same_in_bad += !eq;
    }
    free(want);
    free(win);
  }
  char name[200];
  snprintf(name, sizeof name, "fp8 cpu: every code is the interpreter's where the value cast is (%lld codes)",
           (long long)same_in);
  CHECK(same_in > 0 && same_in_bad == 0, name, "%lld of %lld differ", (long long)same_in_bad, (long long)same_in);
  snprintf(name, sizeof name, "fp8 cpu: at least 99%% of all codes are the interpreter's (%lld of %lld differ)",
           (long long)differ, (long long)total);
  CHECK(total > 0 && differ * 100 <= total, name, "%lld of %lld differ", (long long)differ, (long long)total);
}

static void test_gpt2(void) {
  Arena *a = arena_new();
  Graph *g = fp8_graph(a, "models/gpt2-tiny.mdl", NULL);
  Engine *ei = engine_interp(g, INTERP_F32, 7), *ec = cpu_engine(g, "models/gpt2-tiny.mdl");
  if (!ec)
    return;
  feed(ei, g);
  feed(ec, g);
  const Fp8State *si = ei->fp8(ei), *sc = ec->fp8(ec);
  bool scales = true, weights = true, losses = true;
  double amax_err = 0, loss_err = 0;
  for (int s = 1; s <= 3; s++) {
    if (!step(ei, s) || !step(ec, s))
      return;
    if (s == 1)
      compare_codes(g, ec, ei);
    double li = engine_scalar(ei, g->loss), lc = engine_scalar(ec, g->loss);
    loss_err = fmax(loss_err, fabs(li - lc) / fabs(li));
    losses &= fabs(li - lc) <= 1e-4 * fabs(li);
    scales &= sc->recorded == si->recorded && !memcmp(sc->scale, si->scale, sizeof(float) * (size_t)si->n);
    for (int t = 0; t < si->n; t++)
      for (int j = 0; j < si->H; j++) {
        float x = si->hist[t * si->H + j], y = sc->hist[t * si->H + j];
        amax_err = fmax(amax_err, x > 0 ? fabs(x - y) / x : fabs(y));
        // the weights' tensors (their casts read a PARAM) at the first step: calibration and step 1
        bool weight = false;
        for (int i = 0; i < g->n && s == 1; i++)
          weight |= g->nodes[i]->op == OP_CAST && is_fp8(g->nodes[i]->dtype) && g->nodes[i]->ia[1] == t &&
                    g->nodes[g->nodes[i]->in[0]]->op == OP_PARAM;
        weights &= !weight || x == y;
      }
  }
  CHECK(scales, "fp8 cpu: the scales are the interpreter's bit for bit after each of 3 steps", "they differ");
  CHECK(weights, "fp8 cpu: the weights' amax histories are the interpreter's bit for bit", "they differ");
  char name[200];
  snprintf(name, sizeof name, "fp8 cpu: every amax within 1e-5 relative of the interpreter's (worst %.1e)", amax_err);
  CHECK(amax_err < 1e-5, name, "%.3g", amax_err);
  snprintf(name, sizeof name, "fp8 cpu: the losses of 3 steps within 1e-4 relative (worst %.1e)", loss_err);
  CHECK(losses, name, "worst %.3g", loss_err);
  double d2 = 0, n2 = 0;
  for (int k = 0; k < g->nparams; k++) {
    float *x = read_all(ei, g->params[k]), *y = read_all(ec, g->params[k]);
    for (int64_t j = 0; j < shape_numel(g->nodes[g->params[k]]->shape); j++)
      d2 += ((double)x[j] - y[j]) * ((double)x[j] - y[j]), n2 += (double)x[j] * x[j];
    free(x);
    free(y);
  }
  snprintf(name, sizeof name, "fp8 cpu: the parameters after 3 steps within 3e-3 (L2 relative: %.1e)", sqrt(d2 / n2));
  CHECK(sqrt(d2 / n2) < 3e-3, name, "%.3g", sqrt(d2 / n2));
  ei->free(ei);
  ec->free(ec);
  arena_free(a);
}

static void test_overflow(void) {
  static const char text[] =
      "model m\n"
      "dim B = 16\n" // (fp8 GEMMs want dimensions of multiples of 16)
      "input x: f32[B, 16]\n"
      "input targets: i32[B]\n"
      "param w1: [16, 16] = normal(0.3)\n"
      "param w2: [16, 16] = normal(0.3)\n"
      "param w3: [16, 16] = normal(0.3)\n"
      "param w4: [16, 4] = normal(0.3)\n"
      "h = relu(x @ w1)\n"
      "h = relu(h @ w2)\n"
      "big = h * 1e30 * 1e30\n"
      "h = relu(big @ w3)\n"
      "output loss = mean(cross_entropy(h @ w4, targets))\n";
  Arena *a = arena_new();
  Graph *g = fp8_graph(a, "overflow.mdl", text);
  Engine *engines[2] = {engine_interp(g, INTERP_F32, 7), cpu_engine(g, "overflow.mdl")};
  for (int k = 0; k < 2 && engines[k]; k++) {
    Engine *e = engines[k];
    feed(e, g);
    float *before = read_all(e, g->params[1]);
    int gnorm = -1;
    for (int i = 0; i < g->n; i++)
      gnorm = g->nodes[i]->op == OP_GRAD_NORM ? i : gnorm;
    bool ran = step(e, 1);
    float *after = read_all(e, g->params[1]);
    char why[256] = "", name[200];
    const Fp8State *st = e->fp8 ? e->fp8(e) : NULL;
    if (!st) {
      CHECK(false, "fp8: the overflow model has scaled tensors", "%s has none", e->name);
      e->free(e);
      continue;
    }
    bool named = fp8_state_check(st, g, why, sizeof why);
    snprintf(name, sizeof name, "fp8 %s: an infinite amax makes the gradient norm NaN, the step is skipped, the "
             "histories do not roll", e->name);
    CHECK(ran && isnan(engine_scalar(e, gnorm)) && !memcmp(before, after, sizeof(float) * 256) && st->recorded == 0,
          name, "norm %g, recorded %lld", engine_scalar(e, gnorm), (long long)st->recorded);
    snprintf(name, sizeof name, "fp8 %s: the report names the tensor", e->name);
    CHECK(named && strstr(why, "big (line 11") && strstr(why, "is inf"), name, "got '%s'", why);
    free(before);
    free(after);
    e->free(e);
  }
  arena_free(a);
}

static void test_capability(void) {
  CudaDevice a = {.arch = "sm_86"}, b = {.arch = "sm_89"}, c = {.arch = "sm_100"}, d = {.arch = ""};
  CHECK(cuda_compute_capability(&a) == 86 && cuda_compute_capability(&b) == 89 && cuda_compute_capability(&c) == 100 &&
        cuda_compute_capability(&d) == 0, "fp8 cpu: compute capabilities from the arch (sm_86, sm_89, sm_100, none)",
        "%d %d %d %d", cuda_compute_capability(&a), cuda_compute_capability(&b), cuda_compute_capability(&c),
        cuda_compute_capability(&d));
}

static const char mlp[] =
    "model m\n"
    "dim B = 16\n" // (fp8 GEMMs want dimensions of multiples of 16)
    "input x: f32[B, 16]\n"
    "input targets: i32[B]\n"
    "param w1: [16, 16] = normal(0.3)\n"
    "param w2: [16, 16] = normal(0.3)\n"
    "param w3: [16, 16] = normal(0.3)\n"
    "param w4: [16, 4] = normal(0.3)\n"
    "h = relu(x @ w1)\n"
    "h = relu(h @ w2)\n"
    "h = relu(h @ w3)\n"
    "output loss = mean(cross_entropy(h @ w4, targets))\n";

// The amax hook of test_share: counts its calls, and at step `raise_at` sets tensor 0's amax to `to`.
typedef struct {
  int calls, step, raise_at;
  float to;
} Hook;

static bool hook(void *ctx, float *amax, int n, char *err, size_t en) {
  (void)err, (void)en;
  Hook *h = ctx;
  h->calls++;
  if (h->step == h->raise_at && n > 0)
    amax[0] = h->to;
  return true;
}

static void test_share(void) {
  Arena *a = arena_new();
  Graph *g = fp8_graph(a, "mlp.mdl", mlp);
  Graph *mg = mdl_compile_text(a, "mlp.mdl", mlp, NULL, 0);
  char why[512];
  if (!mg || !autodiff(mg, false) || !precision_assign(mg, DT_F8E4M3, why, sizeof why) || mg->nfp8 != g->nfp8 ||
      g->nfp8 == 0) {
    printf("[fail] fp8 share: the gradients-only graph (%d scaled tensors, the step's %d)\n", mg ? mg->nfp8 : -1,
           g->nfp8);
    exit(1);
  }
  Engine *engines[2] = {engine_interp(g, INTERP_F32, 7), cpu_engine(g, "mlp.mdl")};
  Engine *micros[2] = {engine_interp(mg, INTERP_F32, 7), cpu_engine(mg, "mlp-grads.mdl")};
  float *lead = malloc(sizeof(float) * (size_t)g->nfp8), *amax[2] = {NULL, NULL};
  for (int t = 0; t < g->nfp8; t++)
    lead[t] = ldexpf(1, 3 * t - 4);
  for (int k = 0; k < 2 && engines[k] && micros[k]; k++) {
    Engine *e = engines[k], *mi = micros[k];
    char name[200];
    feed(e, g);
    Hook h = {.raise_at = 2, .to = 1000};
    e->set_fp8_amax(e, hook, &h);
    const Fp8State *st = e->fp8(e);
    h.step = 1;
    bool ok = step(e, 1);
    int first = h.calls;
    h.step = 2;
    ok = ok && step(e, 2);
    bool low;
    snprintf(name, sizeof name, "fp8 share %s: the amax hook runs after the calibration and the step (2 calls), "
             "then once a step; the amax it raises is rolled and scales", e->name);
    CHECK(ok && first == 2 && h.calls == 3 && st->recorded == 3 && st->hist[0] == 1000 &&
              st->scale[0] == fp8_scale(g->fp8[0].fmt, 1000, &low),
          name, "calls %d then %d, recorded %lld, history %g, scale %g", first, h.calls, (long long)st->recorded,
          (double)st->hist[0], (double)st->scale[0]);
    float *before = read_all(e, g->params[1]), *hist = malloc(sizeof(float) * (size_t)(st->n * st->H));
    memcpy(hist, st->hist, sizeof(float) * (size_t)(st->n * st->H));
    h.step = h.raise_at = 3, h.to = NAN;
    ok = step(e, 3);
    float *after = read_all(e, g->params[1]);
    int gnorm = -1;
    for (int i = 0; i < g->n; i++)
      gnorm = g->nodes[i]->op == OP_GRAD_NORM ? i : gnorm;
    snprintf(name, sizeof name, "fp8 share %s: a NaN amax from the hook skips the step (the weights and "
             "histories as they were)", e->name);
    CHECK(ok && isnan(engine_scalar(e, gnorm)) && !memcmp(before, after, sizeof(float) * 256) && st->recorded == 3 &&
              !memcmp(hist, st->hist, sizeof(float) * (size_t)(st->n * st->H)),
          name, "norm %g, recorded %lld", engine_scalar(e, gnorm), (long long)st->recorded);
    free(before);
    free(after);
    free(hist);
    e->set_fp8_amax(e, NULL, NULL);

    feed(mi, mg);
    mi->set_fp8_lead(mi, lead);
    const Fp8State *ms = mi->fp8(mi);
    bool zero = true, some = false;
    ok = step(mi, 1) && step(mi, 2);
    for (int t = 0; t < ms->n; t++) {
      some |= ms->amax[t] > 0 && isfinite(ms->amax[t]);
      for (int j = 0; j < ms->H; j++)
        zero &= ms->hist[t * ms->H + j] == 0;
    }
    snprintf(name, sizeof name, "fp8 share %s: a led gradients-only engine casts with the lead's scales, records "
             "its amaxes, neither calibrates nor rolls a history", mi->name);
    CHECK(ok && !memcmp(ms->scale, lead, sizeof(float) * (size_t)ms->n) && ms->recorded == 0 && zero && some, name,
          "recorded %lld, histories %s, amaxes %s", (long long)ms->recorded, zero ? "empty" : "rolled",
          some ? "recorded" : "none");
    amax[k] = malloc(sizeof(float) * (size_t)ms->n);
    memcpy(amax[k], ms->amax, sizeof(float) * (size_t)ms->n);
  }
  if (amax[0] && amax[1]) {
    double worst = 0;
    for (int t = 0; t < g->nfp8; t++)
      worst = fmax(worst, fabs((double)amax[0][t] - amax[1][t]) / fmax(amax[0][t], 1e-30));
    char name[200];
    snprintf(name, sizeof name, "fp8 share: the led engines' amaxes, interpreter and C back end, within 1e-5 "
             "(worst %.1e)", worst);
    CHECK(worst < 1e-5, name, "%.3g", worst);
  }
  for (int k = 0; k < 2; k++) {
    if (engines[k])
      engines[k]->free(engines[k]);
    if (micros[k])
      micros[k]->free(micros[k]);
    free(amax[k]);
  }
  free(lead);
  arena_free(a);
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "matrix")) { // one GEMM path and target of tests/cli/matrix.sh: 1 alone
    test_gpt2();
    TEST_EXIT();
  }
  test_capability();
  test_gpt2();
  test_overflow();
  test_share();
  TEST_EXIT();
}
