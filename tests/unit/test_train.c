// test_train.c: the tiny GPT in the reference interpreter: the loss at initialisation is near
// ln(vocab), and AdamW steps on one fixed batch drive it down (memorisation), as a real trainer must.
#include "mdl.h"
#include "runtime.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double loss_after(Interp *it, const Graph *g, int64_t step) {
  char err[256];
  interp_set_scalar(it, "lr", rt_lr_at(&g->train, step));
  interp_set_scalar(it, "step", (double)step);
  if (!interp_run(it, g->n, err, sizeof err)) {
    printf("[fail] interp_run: %s\n", err);
    return NAN;
  }
  return interp_value(it, g->loss)[0];
}

// Evaluation graphs switch dropout off: their loss does not depend on the seed; training's does.
static void test_eval_mode(void) {
  static const char src[] = "model drop\n"
                            "dim B = 4\n"
                            "input x: f32[B, 8]\n"
                            "input targets: i32[B]\n"
                            "param w: [8, 3] = normal(0.5)\n"
                            "output loss = mean(cross_entropy(dropout(x, p=0.5) @ w, targets))\n";
  float x[32];
  int32_t t[4] = {0, 1, 2, 1};
  for (int i = 0; i < 32; i++)
    x[i] = (float)((i * 7) % 5) - 2;
  double loss[2][2];
  for (int eval = 0; eval < 2; eval++)
    for (int seed = 0; seed < 2; seed++) {
      Arena *a = arena_new();
      Graph *g = mdl_compile_text(a, "drop.mdl", src, NULL, 0);
      if (!g) {
        printf("[fail] eval mode: the model does not compile\n");
        return;
      }
      if (eval)
        ir_eval_mode(g);
      Interp *it = interp_new(g, INTERP_F64);
      interp_init_params(it, 3);
      interp_set_seed(it, (uint64_t)seed + 1);
      interp_set_input(it, "x", NULL, x, 32);
      interp_set_input(it, "targets", t, NULL, 4);
      char err[128];
      loss[eval][seed] = interp_run(it, g->n, err, sizeof err) ? interp_value(it, g->loss)[0] : NAN;
      interp_free(it);
      arena_free(a);
    }
  CHECK(loss[0][0] != loss[0][1], "eval mode: training draws a dropout mask per seed", "%g == %g", loss[0][0], loss[0][1]);
  CHECK(loss[1][0] == loss[1][1] && isfinite(loss[1][0]), "eval mode: evaluation switches dropout off",
        "%g vs %g", loss[1][0], loss[1][1]);
}

// The learning-rate schedule of a train section, against values worked out by hand from the formula
// of docs/language.md: lr * step / warmup while step <= warmup, then min_lr + (lr - min_lr) / 2 *
// (1 + cos(pi * (step - warmup) / (steps - warmup))) down to min_lr at step `steps`, min_lr after;
// without `steps`, lr after the warmup. Steps count from 1, so a one-step shift of the warmup moves
// its first value by a whole lr / warmup.
static void test_schedule(void) {
  static const char src[] = "model sched\n"
                            "input x: f32[2, 3]\n"
                            "param w: [3, 1] = normal(0.5)\n"
                            "output loss = mean(x @ w)\n"
                            "train {\n"
                            "    optimizer = adamw(lr=1e-3)\n"
                            "    schedule = cosine(warmup=10, min_lr=1e-4, steps=100)\n"
                            "}\n";
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "sched.mdl", src, NULL, 0);
  CHECK(g != NULL, "schedule: the model with a cosine schedule compiles", "front end failed");
  if (!g) {
    arena_free(a);
    return;
  }
  const TrainConfig *tc = &g->train;
  static const struct {
    int64_t step;
    double lr;
    const char *what;
  } want[] = {
      {1, 1e-4, "the first warmup step is lr / warmup"},
      {5, 5e-4, "warmup step 5 of 10 is half of lr"},
      {10, 1e-3, "the end of the warmup is lr"},
      // 1e-4 + 0.5 * 9e-4 * (1 + cos(pi / 90)), cos(pi / 90) = 0.99939082701909576
      {11, 9.99725872158593e-4, "the first step after the warmup starts the cosine"},
      {55, 5.5e-4, "half way through the decay is (lr + min_lr) / 2"},
      // 1e-4 + 0.5 * 9e-4 * (1 - cos(pi / 90))
      {99, 1.0027412784140692e-4, "the step before the last is just above min_lr"},
      {100, 1e-4, "the last step is min_lr"},
      {250, 1e-4, "steps past the schedule stay at min_lr"},
  };
  for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
    double got = rt_lr_at(tc, want[i].step);
    char name[160];
    snprintf(name, sizeof name, "schedule: %s (step %lld: %g)", want[i].what, (long long)want[i].step, want[i].lr);
    CHECK(fabs(got - want[i].lr) <= 1e-12 * want[i].lr, name, "got %.17g", got);
  }
  // Without `steps` the rate stays at lr once the warmup is over.
  TrainConfig flat = *tc;
  flat.warmup = 4;
  flat.steps = 0;
  double w1 = rt_lr_at(&flat, 1), w4 = rt_lr_at(&flat, 4), later = rt_lr_at(&flat, 1000);
  CHECK(fabs(w1 - 2.5e-4) <= 1e-12 * 2.5e-4 && fabs(w4 - 1e-3) <= 1e-15 && fabs(later - 1e-3) <= 1e-15,
        "schedule: without steps, warmup 4 gives lr / 4 at step 1, lr at step 4 and at step 1000",
        "%.17g, %.17g, %.17g", w1, w4, later);
  arena_free(a);
}

// Every step of linear, cosine and wsd (warmup 4, min_lr 1e-4, steps 40; wsd's decay 10 steps, and 0.25
// of the 36 after the warmup) against docs/language.md's words, written out here: a straight line from
// lr / warmup at step 1 to lr at step warmup; then linear and cosine go from lr at the warmup's end
// down to min_lr at `steps`, in a straight line or along half a cosine; wsd keeps lr until `decay`
// steps before `steps`, then a straight line down to min_lr there; min_lr after `steps`.
static void test_schedule_steps(void) {
  static const char *const sched[] = {"linear(warmup=4, min_lr=1e-4, steps=40)", "cosine(warmup=4, min_lr=1e-4, steps=40)",
                                      "wsd(warmup=4, decay=10, min_lr=1e-4, steps=40)",
                                      "wsd(warmup=4, decay=0.25, min_lr=1e-4, steps=40)"};
  const double lr = 1e-3, lo = 1e-4, pi = 3.14159265358979323846;
  for (int k = 0; k < 4; k++) {
    char src[512];
    snprintf(src, sizeof src, "model m\ninput x: f32[2, 3]\nparam w: [3, 1] = normal(0.5)\noutput loss = mean(x @ w)\n"
             "train {\n    optimizer = adamw(lr=1e-3)\n    schedule = %s\n}\n", sched[k]);
    Arena *a = arena_new();
    Graph *g = mdl_compile_text(a, "sched.mdl", src, NULL, 0);
    int bad = 0;
    double got = 0, want = 0;
    int64_t at = 0;
    for (int64_t step = 1; g && step <= 50; step++) {
      double x = (double)(step - 4) / 36, e; // x: the share of the decay's steps done
      double decay = k == 2 ? 10 : 0.25 * 36, from = 40 - decay; // wsd: lr up to step `from`
      if (step <= 4)
        e = lr * (double)step / 4;
      else if (step >= 40)
        e = lo;
      else if (k == 0)
        e = lr - (lr - lo) * x;
      else if (k == 1)
        e = lo + (lr - lo) * (1 + cos(pi * x)) / 2;
      else
        e = step <= from ? lr : lr - (lr - lo) * (double)(step - from) / decay;
      double r = rt_lr_at(&g->train, step);
      if (fabs(r - e) > 1e-12 * e && !bad++)
        got = r, want = e, at = step;
    }
    char name[160];
    snprintf(name, sizeof name, "schedule: %s, steps 1 to 50 as docs/language.md says", sched[k]);
    CHECK(g && !bad, name, "%d steps differ; the first, step %lld: %.17g, the formula %.17g", bad, (long long)at,
          got, want);
    arena_free(a);
  }
}

// lr at `step` of the schedule a train section states ("" for none), with steps = run when the
// section does not set them (as the driver does).
static double lr_of(const char *schedule, int64_t run, int64_t step) {
  char src[512];
  snprintf(src, sizeof src,
           "model m\ninput x: f32[2, 3]\nparam w: [3, 1] = normal(0.5)\noutput loss = mean(x @ w)\n"
           "train {\n    optimizer = adamw(lr=1e-3)\n%s%s%s}\n",
           *schedule ? "    schedule = " : "", schedule, *schedule ? "\n" : "");
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "sched.mdl", src, NULL, 0);
  double lr = -1;
  if (g) {
    TrainConfig tc = g->train;
    if (tc.steps <= 0)
      tc.steps = run;
    lr = rt_lr_at(&tc, step);
  }
  arena_free(a);
  return lr;
}

// The other schedules, each against values worked out by hand, and none at all.
static void test_schedules(void) {
  static const struct {
    const char *schedule;
    int64_t run, step;
    double lr;
    const char *what;
  } want[] = {
      {"", 100, 1, 1e-3, "no schedule: lr from the first step"},
      {"", 100, 100, 1e-3, "no schedule: lr at the last step too (no decay to 0)"},
      {"constant(warmup=4)", 100, 2, 5e-4, "constant: warmup step 2 of 4 is lr / 2"},
      {"constant(warmup=4)", 100, 90, 1e-3, "constant: lr after the warmup"},
      {"linear(warmup=10, min_lr=1e-4, steps=100)", 1000, 10, 1e-3, "linear: lr at the end of the warmup"},
      // 1e-3 + (1e-4 - 1e-3) * 45 / 90
      {"linear(warmup=10, min_lr=1e-4, steps=100)", 1000, 55, 5.5e-4, "linear: half way down"},
      {"linear(warmup=10, min_lr=1e-4, steps=100)", 1000, 100, 1e-4, "linear: min_lr at steps"},
      {"linear(warmup=10, min_lr=1e-4, steps=100)", 1000, 500, 1e-4, "linear: min_lr after steps"},
      {"linear", 200, 100, 5e-4, "linear without steps: the run's (half way at step 100 of 200, to 0)"},
      {"wsd(warmup=10, decay=20, min_lr=1e-4, steps=100)", 1000, 80, 1e-3, "wsd: lr until the decay"},
      // 1e-4 + 9e-4 * 10 / 20
      {"wsd(warmup=10, decay=20, min_lr=1e-4, steps=100)", 1000, 90, 5.5e-4, "wsd: half way down the decay"},
      {"wsd(warmup=10, decay=20, min_lr=1e-4, steps=100)", 1000, 100, 1e-4, "wsd: min_lr at steps"},
      // decay 0.25 of the 90 steps after the warmup: 22.5 steps; 1e-3 * 10 / 22.5
      {"wsd(warmup=10, decay=0.25, steps=100)", 1000, 90, 4.444444444444444e-4, "wsd: decay as a fraction"},
      // the default decay, 0.2 of the run's 50 steps: 10 steps; 1e-3 * 5 / 10
      {"wsd", 50, 45, 5e-4, "wsd: the default decay, 0.2 of the run's steps"},
      {"wsd", 50, 40, 1e-3, "wsd: ... lr until it starts"},
  };
  for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
    double got = lr_of(want[i].schedule, want[i].run, want[i].step);
    char name[200];
    snprintf(name, sizeof name, "schedule: %s (%s, step %lld: %g)", want[i].what,
             *want[i].schedule ? want[i].schedule : "none", (long long)want[i].step, want[i].lr);
    CHECK(fabs(got - want[i].lr) <= 1e-12 * want[i].lr, name, "got %.17g", got);
  }
}

// Muon under a schedule: 9 steps of muon(lr=0.02, weight_decay=0.1, adam_lr=A) with cosine(warmup=2,
// min_lr=0.002, steps=7) on loss = sum(w * gw) + sum(v * gv) + sum(b * gb), so each gradient is an
// input (g_t[i] = sin(1.3 t + 0.37 i^2) (1 + 0.1 i), f32, as test_interp.c's test_muon): w (3 x 5) and
// v (5 x 3) take Muon, b AdamW. The rates come from rt_lr_at, as runtime/train/train.c sets them each step
// and writes them to log.jsonl. The 15 values of w, of v and the 4 of b after the last step into out.
static bool muon_schedule_run(double adam_lr, double out[3][15], double lr_at[10]) {
  char src[512];
  snprintf(src, sizeof src,
           "model mus\ninput gw: f32[3, 5]\ninput gv: f32[5, 3]\ninput gb: f32[4]\nparam w: [3, 5] = zeros\n"
           "param v: [5, 3] = zeros\nparam b: [4] = zeros\noutput loss = sum(w * gw) + sum(v * gv) + sum(b * gb)\n"
           "train {\n optimizer = muon(lr=0.02, weight_decay=0.1, adam_lr=%.17g)\n"
           " schedule = cosine(warmup=2, min_lr=0.002, steps=7)\n}\n",
           adam_lr);
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "mus.mdl", src, NULL, 0);
  bool ok = g && autodiff(g, true) && g->nodes[g->params[0]]->init.muon && g->nodes[g->params[1]]->init.muon &&
            !g->nodes[g->params[2]]->init.muon;
  if (!ok) {
    printf("[fail] muon schedule: the model compiles, w and v Muon, b AdamW: %s  (%s:%d)\n", g ? g->err : "front end",
           __FILE__, __LINE__);
    test_failures++;
    arena_free(a);
    return false;
  }
  Interp *it = interp_new(g, INTERP_F64);
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < (k < 2 ? 15 : 4); i++)
      interp_param(it, g->params[k])[i] = 0.1 * cos(0.9 * i);
  char err[256] = "";
  for (int t = 1; t <= 9 && ok; t++) {
    float gt[15];
    for (int i = 0; i < 15; i++)
      gt[i] = (float)(sin(1.3 * t + 0.37 * i * i) * (1 + 0.1 * i));
    interp_set_input(it, "gw", NULL, gt, 15);
    interp_set_input(it, "gv", NULL, gt, 15);
    interp_set_input(it, "gb", NULL, gt, 4);
    lr_at[t] = rt_lr_at(&g->train, t);
    interp_set_scalar(it, "lr", lr_at[t]);
    interp_set_scalar(it, "step", t);
    ok = interp_run(it, g->n, err, sizeof err);
  }
  CHECK(ok, "muon schedule: 9 steps run", "%s", err);
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < (k < 2 ? 15 : 4); i++)
      out[k][i] = interp_param(it, g->params[k])[i];
  interp_free(it);
  arena_free(a);
  return ok;
}

// muon_schedule_run's run replayed in float64 by docs/language.md's rule, written out here: the
// schedule runs from lr (Muon's rate) to min_lr; the AdamW params train at its value times
// adam_lr / lr. Muon as Keller Jordan's muon_update, AdamW as torch.optim.AdamW (betas 0.9, 0.95, eps
// 1e-10, the muon optimizer's); both decay p by lr wd p.
static void muon_schedule_replay(double adam_lr, double out[3][15], double lr_at[10]) {
  const double lr = 0.02, min_lr = 0.002, mu = 0.95, wd = 0.1, pi = 3.14159265358979323846;
  double p[3][15], m[3][15] = {{0}}, v[15] = {0};
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < 15; i++)
      p[k][i] = 0.1 * cos(0.9 * i);
  for (int t = 1; t <= 9; t++) {
    double rate = t <= 2 ? lr * t / 2 : t >= 7 ? min_lr : min_lr + 0.5 * (lr - min_lr) * (1 + cos(pi * (t - 2) / 5));
    lr_at[t] = rate;
    double g[15];
    for (int i = 0; i < 15; i++)
      g[i] = (double)(float)(sin(1.3 * t + 0.37 * i * i) * (1 + 0.1 * i));
    for (int k = 0; k < 2; k++) { // w (3 x 5), then v (5 x 3), both iterated on the wide 3 x 5 side
      double u[15], x[15], ss = 0;
      for (int i = 0; i < 15; i++) {
        m[k][i] = mu * m[k][i] + (1 - mu) * g[i];
        u[i] = (1 - mu) * g[i] + mu * m[k][i];
        ss += u[i] * u[i];
      }
      for (int r = 0; r < 3; r++) // x[r][c] (3 x 5): u itself, or v's transpose
        for (int c = 0; c < 5; c++)
          x[r * 5 + c] = (k ? u[c * 3 + r] : u[r * 5 + c]) / (sqrt(ss) + 1e-7);
      for (int it = 0; it < 5; it++) {
        double A[9], B[9], y[15];
        for (int r = 0; r < 3; r++)
          for (int s = 0; s < 3; s++) {
            A[r * 3 + s] = 0;
            for (int c = 0; c < 5; c++)
              A[r * 3 + s] += x[r * 5 + c] * x[s * 5 + c];
          }
        for (int r = 0; r < 3; r++)
          for (int s = 0; s < 3; s++) {
            double aa = 0;
            for (int q = 0; q < 3; q++)
              aa += A[r * 3 + q] * A[q * 3 + s];
            B[r * 3 + s] = -4.7750 * A[r * 3 + s] + 2.0315 * aa;
          }
        for (int r = 0; r < 3; r++)
          for (int c = 0; c < 5; c++) {
            double bx = 0;
            for (int q = 0; q < 3; q++)
              bx += B[r * 3 + q] * x[q * 5 + c];
            y[r * 5 + c] = 3.4445 * x[r * 5 + c] + bx;
          }
        memcpy(x, y, sizeof x);
      }
      double scale = k ? sqrt(5.0 / 3.0) : 1; // max(1, rows / cols)^0.5
      for (int r = 0; r < 3; r++)
        for (int c = 0; c < 5; c++) {
          double *dst = &p[k][k ? c * 3 + r : r * 5 + c];
          *dst = *dst * (1 - rate * wd) - rate * scale * x[r * 5 + c];
        }
    }
    double arate = rate * adam_lr / lr, bc1 = 1 - pow(0.9, t), bc2 = 1 - pow(0.95, t);
    for (int i = 0; i < 4; i++) {
      m[2][i] = 0.9 * m[2][i] + 0.1 * g[i];
      v[i] = 0.95 * v[i] + 0.05 * g[i] * g[i];
      p[2][i] = p[2][i] * (1 - arate * wd) - arate / bc1 * m[2][i] / (sqrt(v[i]) / sqrt(bc2) + 1e-10);
    }
  }
  memcpy(out, p, sizeof p);
}

// The schedule sets Muon's rate (lr, down to min_lr) and scales the AdamW params' adam_lr alike: the
// rates and parameters of 9 steps against the replay; and adam_lr alone leaves the Muon matrices'
// trajectory bit for bit as it was.
static void test_muon_schedule(void) {
  static const double adam[2] = {1e-3, 5e-3};
  double got[2][3][15], want[3][15], lr_got[2][10], lr_want[10];
  for (int c = 0; c < 2; c++) {
    if (!muon_schedule_run(adam[c], got[c], lr_got[c]))
      return;
    muon_schedule_replay(adam[c], want, lr_want);
    double worst_lr = 0;
    int at = 1;
    for (int t = 1; t <= 9; t++)
      if (fabs(lr_got[c][t] - lr_want[t]) / lr_want[t] > worst_lr)
        worst_lr = fabs(lr_got[c][t] - lr_want[t]) / lr_want[t], at = t;
    char name[200];
    snprintf(name, sizeof name, "muon schedule (adam_lr %g): the logged rate of each step is Muon's, from lr to min_lr",
             adam[c]);
    CHECK(worst_lr < 1e-12, name, "step %d: %.17g, wanted %.17g", at, lr_got[c][at], lr_want[at]);
    for (int k = 0; k < 3; k++) {
      double worst = 0;
      for (int i = 0; i < (k < 2 ? 15 : 4); i++)
        worst = fmax(worst, fabs(got[c][k][i] - want[k][i]));
      snprintf(name, sizeof name, "muon schedule (adam_lr %g): %s after 9 steps as the float64 replay within 1e-12 "
               "(worst %.1e)", adam[c], k == 0 ? "w (Muon, 3 x 5)" : k == 1 ? "v (Muon, 5 x 3)" : "b (AdamW)", worst);
      CHECK(worst < 1e-12, name, "differs");
    }
  }
  CHECK(!memcmp(got[0][0], got[1][0], sizeof got[0][0]) && !memcmp(got[0][1], got[1][1], sizeof got[0][1]),
        "muon schedule: adam_lr 1e-3 or 5e-3 leave the Muon matrices' trajectory bit for bit the same",
        "w[0] %.17g against %.17g", got[0][0][0], got[1][0][0]);
  CHECK(got[0][2][0] != got[1][2][0], "muon schedule: ... and move the AdamW param b differently", "b[0] %.17g both",
        got[0][2][0]);
}

// The step lines' interval when --log-every does not say: 1, 2, 5, 10, ... and 20 to 50 lines a run.
static void test_log_every(void) {
  static const int64_t want[][2] = {{1, 1}, {30, 1}, {40, 2}, {60, 2}, {100, 5}, {1000, 50}, {4000, 200}};
  for (size_t i = 0; i < sizeof want / sizeof *want; i++)
    CHECK(train_log_every(want[i][0]) == want[i][1], "log every: the interval of a run of a given length",
          "%lld steps: every %lld, wanted %lld", (long long)want[i][0], (long long)train_log_every(want[i][0]),
          (long long)want[i][1]);
  int64_t bad = 0;
  for (int64_t n = 20; n <= 1000000 && !bad; n++) {
    int64_t every = train_log_every(n);
    bad = n / every < 20 || n / every > 50 ? n : 0;
  }
  CHECK(!bad, "log every: 20 to 50 step lines for every run of 20 to 10^6 steps", "%lld steps: every %lld",
        (long long)bad, (long long)train_log_every(bad));
}

int main(void) {
  test_log_every();
  test_schedule();
  test_schedules();
  test_schedule_steps();
  test_muon_schedule();
  test_eval_mode();
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 4}, {"T", 32}};
  Graph *g = mdl_compile_file(a, "models/gpt2-tiny.mdl", ov, 2);
  CHECK(g != NULL, "train: gpt2-tiny compiles", "front end failed");
  if (!g)
    TEST_EXIT();
  CHECK(autodiff(g, true), "train: autodiff with optimizer", "%s", g->err);
  char why[256];
  CHECK(ir_validate(g, why, sizeof why), "train: training graph validates", "%s", why);

  int64_t B = 4, T = 32, V = 256;
  int32_t tokens[128], targets[128], pos[128], doc[128];
  for (int i = 0; i < B * T; i++) {
    tokens[i] = (int32_t)((i * 37 + 11) % V);
    targets[i] = (int32_t)((i * 53 + 7) % V);
    pos[i] = (int32_t)(i % T);
    doc[i] = 0;
  }
  Interp *it = interp_new(g, INTERP_F32);
  interp_set_seed(it, 7);
  interp_init_params(it, 7);
  interp_set_input(it, "tokens", tokens, NULL, B * T);
  interp_set_input(it, "targets", targets, NULL, B * T);
  interp_set_input(it, "pos", pos, NULL, B * T);
  interp_set_input(it, "doc", doc, NULL, B * T);

  // A constant learning rate high enough to memorise one batch in 50 steps.
  g->train.lr = 1e-2;
  g->train.warmup = 0;
  g->train.steps = 0;
  double first = loss_after(it, g, 1), last = first;
  CHECK(fabs(first - log((double)V)) < 0.05 * log((double)V), "train: initial loss within 5% of ln(V)",
        "loss %.4f, ln(V) %.4f", first, log((double)V));
  for (int64_t step = 2; step <= 51; step++)
    last = loss_after(it, g, step);
  CHECK(last < 0.1 * first, "train: 50 AdamW steps on one batch bring the loss below 10% of its start",
        "start %.4f, after 50 steps %.4f", first, last);
  interp_free(it);
  arena_free(a);
  TEST_EXIT();
}
