// draw_checks.h: checks every back end shares on its initial parameters, drawn from the seed when
// first needed (ParamDraw in runtime.h). Included by the test of each back end, after test.h.
#ifndef MDL_DRAW_CHECKS_H
#define MDL_DRAW_CHECKS_H
#include "mdl.h"
#include "runtime.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

// A fresh engine of the back end under test, with the parameters of `seed`, or NULL.
typedef Engine *(*MakeEngine)(const void *ctx, uint64_t seed);

// Parameters of `e` that differ from the interpreter's draw from `seed` (bit for bit, as f32).
static inline int draw_differ(Engine *e, const Graph *g, uint64_t seed) {
  Engine *ref = engine_interp(g, INTERP_F32, seed);
  int differ = 0;
  for (int k = 0; k < g->nparams; k++) {
    int64_t n = shape_numel(g->nodes[g->params[k]]->shape);
    float *x = calloc((size_t)n + 1, sizeof *x), *y = calloc((size_t)n + 1, sizeof *y);
    e->read(e, g->params[k], x);
    ref->read(ref, g->params[k], y);
    differ += memcmp(x, y, sizeof *x * (size_t)n) != 0;
    free(x);
    free(y);
  }
  ref->free(ref);
  return differ;
}

static inline bool count_draw(void *ctx, int k) {
  int *drawn = ctx;
  drawn[1 + drawn[0]++] = k;
  return true;
}

// ParamDraw alone: every parameter pending at first, those written never drawn, each drawn once.
static inline void param_draw_unit_checks(const Graph *g) {
  int drawn[1 + 64] = {0}, n = g->nparams < 64 ? g->nparams : 64;
  ParamDraw d;
  param_draw_init(&d, g, 3);
  param_draw_written(&d, g, g->params[1]);
  bool ok = g->nparams >= 3 && g->nparams <= 64 && param_draw_now(&d, count_draw, drawn);
  for (int i = 0, k = 0; ok && k < n; k++)
    if (k != 1)
      ok = drawn[1 + i++] == k;
  CHECK(ok && drawn[0] == n - 1 && d.left == 0, "param draw: every parameter but the one written, in order",
        "%d drawn of %d parameters", drawn[0], g->nparams);
  drawn[0] = 0;
  param_draw_now(&d, count_draw, drawn);
  param_draw_written(&d, g, g->params[0]);
  CHECK(drawn[0] == 0, "param draw: a second draw draws none", "%d drawn", drawn[0]);
  param_draw_free(&d);
  param_draw_init(&d, g, 3);
  param_draw_all_written(&d);
  param_draw_now(&d, count_draw, drawn);
  CHECK(drawn[0] == 0 && d.left == 0, "param draw: after all are written, none", "%d drawn", drawn[0]);
  param_draw_free(&d);
}

// On one back end: an engine that takes every parameter from another (take_params, else read and
// write, as the training loop gives the validation engine its parameters) before it draws holds the
// other's seed's values after draw_params, not its own's; a parameter written before the draw keeps
// its values through it, and the others are the interpreter's draw from the engine's seed.
static inline void draw_checks(const char *label, const Graph *g, MakeEngine make, const void *ctx) {
  char name[512], why[256] = "";
  Engine *a = make(ctx, 5), *b = make(ctx, 6), *w = make(ctx, 6);
  snprintf(name, sizeof name, "%s: three engines start", label);
  CHECK(a && b && w, name, "one did not");
  if (a && b && w) {
    bool took = b->take_params && b->take_params(b, a);
    float *buf = NULL;
    for (int k = 0; !took && k < g->nparams; k++) {
      buf = realloc(buf, sizeof *buf * (size_t)shape_numel(g->nodes[g->params[k]]->shape));
      a->read(a, g->params[k], buf);
      b->write(b, g->params[k], buf);
    }
    free(buf);
    bool drew = b->draw_params(b, why, sizeof why);
    int differ = draw_differ(b, g, 5), own = draw_differ(a, g, 5);
    snprintf(name, sizeof name, "%s: parameters taken before the draw are kept (%s), the draw of the other seed",
             label, took ? "take_params" : "read and write");
    CHECK(drew && differ == 0 && own == 0, name, "%s; %d of %d differ from seed 5's (the source: %d)",
          drew ? "drawn" : why, differ, g->nparams, own);
    const IrNode *p0 = g->nodes[g->params[0]];
    int64_t n0 = shape_numel(p0->shape);
    float *x = malloc(sizeof *x * (size_t)n0), *y = malloc(sizeof *y * (size_t)n0);
    for (int64_t i = 0; i < n0; i++)
      x[i] = 0.25f;
    w->write(w, g->params[0], x);
    drew = w->draw_params(w, why, sizeof why);
    w->read(w, g->params[0], y);
    differ = draw_differ(w, g, 6);
    snprintf(name, sizeof name, "%s: a parameter written before the draw keeps its values, the others are drawn",
             label);
    CHECK(drew && !memcmp(x, y, sizeof *x * (size_t)n0) && differ == 1, name,
          "%s; %s %s; %d of %d differ from seed 6's (1: the one written)", drew ? "drawn" : why, p0->name,
          memcmp(x, y, sizeof *x * (size_t)n0) ? "changed" : "kept", differ, g->nparams);
    free(x);
    free(y);
  }
  Engine *all[] = {a, b, w};
  for (int i = 0; i < 3; i++)
    if (all[i])
      all[i]->free(all[i]);
}
#endif
