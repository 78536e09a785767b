// test_train.c: the tiny GPT in the reference interpreter: the loss at initialisation is near
// ln(vocab), and AdamW steps on one fixed batch drive it down (memorisation), as a real trainer must.
#include "mdl.h"
#include "runtime.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>

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
