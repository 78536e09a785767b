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

int main(void) {
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
