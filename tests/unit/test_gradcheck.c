// test_gradcheck.c: autodiff against finite differences, and the AdamW step against the formula.
//
// Each op gets a tiny graph built directly with ir_leaf/ir_add: a few params feed the op, and the
// loss is sum(out * R) for a fixed random R (an input), so every output element matters and each
// gets a different weight. The gradients autodiff builds are run through the reference interpreter
// in fp64 and compared, element by element, with fourth-order central differences of the loss; the
// error of a tensor is max |fd - grad| / max(max |grad|, floor) and must stay below 1e-6. The tiny
// GPT from models/gpt2-tiny.mdl and the tiny LLaMA are checked the same way on a sample of each
// parameter's elements (with some targets ignored: the loss the mean over the counted ones), and the
// optimizer step is compared with AdamW computed here by hand.
#include "mdl.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SH(...) shape_of((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__})
#define IA(...) ((const int64_t[8]){__VA_ARGS__})
#define FA(...) ((const double[6]){__VA_ARGS__})
#define IN(...) ((const int[]){__VA_ARGS__}), (int)(sizeof((int[]){__VA_ARGS__}) / sizeof(int))

static const SrcLoc noloc = {0};

static const double tolerance = 1e-6; // max relative error of a gradient tensor
static const double grad_floor = 1e-6; // absolute floor of the denominator

// A uniform value in [-1, 1), reproducible from (stream, i).
static double uniform(uint64_t stream, int64_t i) { return 2 * mdl_rng_uniform(7, stream, (uint64_t)i) - 1; }

// Where a test parameter's values lie: anywhere, strictly positive (log, sqrt, divisors), away from
// zero (relu's kink), or pairwise well apart (max without near ties).
typedef enum { DOM_ANY, DOM_POSITIVE, DOM_AWAY_FROM_ZERO, DOM_DISTINCT } Domain;

typedef struct {
  const char *name;
  int32_t *ids;
  float *f;
  int64_t n;
} Feed;

typedef struct {
  Arena *arena;
  Graph *g;
  Domain dom[16]; // by param index
  Feed feed[8];
  int nfeed;
  bool broken; // an ir_add failed while building the case
  char why[600];
} Case;

static Case *case_new(void) {
  Case *c = calloc(1, sizeof *c);
  c->arena = arena_new();
  c->g = ir_new(c->arena);
  return c;
}

static void case_free(Case *c) {
  arena_free(c->arena);
  free(c);
}

static int built(Case *c, int id) {
  if (id < 0 && !c->broken) {
    c->broken = true;
    snprintf(c->why, sizeof c->why, "building the graph: %s", c->g->err);
  }
  return id;
}

static int param(Case *c, const char *name, Shape s, Domain dom) {
  c->dom[c->g->nparams] = dom;
  return built(c, ir_leaf(c->g, OP_PARAM, name, DT_F32, s, noloc));
}

// An i32 input with the given values.
static int ids_input(Case *c, const char *name, Shape s, const int32_t *v) {
  Feed *f = &c->feed[c->nfeed++];
  f->name = name;
  f->n = shape_numel(s);
  f->ids = arena_alloc(c->arena, sizeof(int32_t) * (size_t)f->n);
  memcpy(f->ids, v, sizeof(int32_t) * (size_t)f->n);
  return built(c, ir_leaf(c->g, OP_INPUT, name, DT_I32, s, noloc));
}

// An f32 input with random values from `stream`.
static int f32_input(Case *c, const char *name, Shape s, uint64_t stream) {
  Feed *f = &c->feed[c->nfeed++];
  f->name = name;
  f->n = shape_numel(s);
  f->f = arena_alloc(c->arena, sizeof(float) * (size_t)f->n);
  for (int64_t i = 0; i < f->n; i++)
    f->f[i] = (float)uniform(stream, i);
  return built(c, ir_leaf(c->g, OP_INPUT, name, DT_F32, s, noloc));
}

static int node(Case *c, Op op, const int *in, int nin, const int64_t *ia, const double *fa) {
  for (int i = 0; i < nin; i++)
    if (in[i] < 0)
      return -1;
  return built(c, ir_add(c->g, op, in, nin, ia, fa, noloc));
}

static int cst(Case *c, double v) { return built(c, ir_const(c->g, v, noloc)); }

// loss = sum(out * R): a scalar in which every element of out has its own random weight.
static int projected_loss(Case *c, int out) {
  if (out < 0)
    return -1;
  Shape s = c->g->nodes[out]->shape;
  int r = f32_input(c, "projection", s, 99);
  int prod = node(c, OP_MUL, IN(out, r), NULL, NULL);
  int flat = prod < 0 ? -1 : built(c, ir_reshape(c->g, prod, SH(shape_numel(s)), noloc));
  return node(c, OP_SUM, IN(flat), IA(0, 0), NULL);
}

static double param_value(Domain dom, int p, int64_t i, int64_t n) {
  double u = uniform((uint64_t)p + 1, i);
  switch (dom) {
  case DOM_ANY: return u;
  case DOM_POSITIVE: return 1.25 + 0.75 * u;
  case DOM_AWAY_FROM_ZERO: return u < 0 ? u - 0.2 : u + 0.2;
  case DOM_DISTINCT: return -1 + (2.0 * (double)((i * 7919) % n) + 0.5 * (u + 1)) / (double)n;
  }
  return u;
}

static bool feed_inputs(Interp *it, const Feed *feed, int nfeed) {
  for (int i = 0; i < nfeed; i++)
    if (!interp_set_input(it, feed[i].name, feed[i].ids, feed[i].f, feed[i].n))
      return false;
  return true;
}

static bool run_loss(Interp *it, const Graph *g, int end, double *loss, char *err, size_t n) {
  if (!interp_run(it, end, err, n))
    return false;
  *loss = interp_value(it, g->loss)[0];
  return true;
}

// d loss / d v[k] by the fourth-order central difference (8 (f(h) - f(-h)) - (f(2h) - f(-2h))) / 12h.
// Its truncation error is O(h^4), so h can be large enough (1e-3) that rounding in the loss,
// O(ulp / h), stays far below the tolerance even for parameters whose gradient is small.
static bool central_difference(Interp *it, const Graph *g, double *v, int64_t k, double *fd, char *err, size_t n) {
  static const double at[4] = {-2, -1, 1, 2};
  double v0 = v[k], h = 1e-3 * fmax(1, fabs(v0)), f[4] = {0};
  bool ok = true;
  for (int j = 0; j < 4 && ok; j++) {
    v[k] = v0 + at[j] * h;
    ok = run_loss(it, g, g->fwd_end, &f[j], err, n);
  }
  v[k] = v0;
  *fd = (8 * (f[2] - f[1]) - (f[3] - f[0])) / (12 * h);
  return ok;
}

// Compares the gradient of each parameter with central differences over `samples` of its elements
// (all of them when samples is 0), one CHECK per parameter named "LABEL: PARAM".
static void compare_with_fd(const char *label, const Graph *g, Interp *it, int samples) {
  char err[512];
  if (!interp_run(it, g->n, err, sizeof err)) {
    CHECK(false, label, "interpreter: %s", err);
    return;
  }
  for (int pi = 0; pi < g->nparams; pi++) {
    int p = g->params[pi];
    char name[256];
    snprintf(name, sizeof name, "%s: d %s", label, g->nodes[p]->name);
    int64_t n = shape_numel(g->nodes[p]->shape);
    const double *an = interp_value(it, g->grads[pi]);
    double scale = grad_floor;
    for (int64_t k = 0; k < n; k++)
      scale = fmax(scale, fabs(an[k]));
    double *v = interp_param(it, p);
    int count = samples && samples < n ? samples : (int)n;
    double worst = 0, worst_fd = 0, worst_an = 0;
    int64_t worst_k = 0;
    bool ok = true;
    for (int s = 0; s < count && ok; s++) {
      int64_t k = count == n ? s : (int64_t)(mdl_rng_u64(11, (uint64_t)p, (uint64_t)s) % (uint64_t)n);
      double fd = 0;
      ok = central_difference(it, g, v, k, &fd, err, sizeof err);
      double e = fabs(fd - an[k]) / scale;
      if (e >= worst) {
        worst = e;
        worst_k = k;
        worst_fd = fd;
        worst_an = an[k];
      }
    }
    if (!ok)
      CHECK(false, name, "interpreter: %s", err);
    else
      CHECK(worst < tolerance, name, "relative error %.3g at element %lld: autodiff %.12g, finite difference %.12g",
            worst, (long long)worst_k, worst_an, worst_fd);
  }
}

// Differentiates the case's graph with `out` projected to the loss and checks every gradient.
// gradcheck, and with concats >= 0 a count of the backward's CONCAT and SLICE_BWD nodes.
static void gradcheck_ops(const char *label, Case *c, int out, int concats, int slice_bwds);

static void gradcheck(const char *label, Case *c, int out) { gradcheck_ops(label, c, out, -1, -1); }

static void gradcheck_ops(const char *label, Case *c, int out, int concats, int slice_bwds) {
  Graph *g = c->g;
  g->loss = projected_loss(c, out);
  if (c->broken) {
    CHECK(false, label, "%s", c->why);
    case_free(c);
    return;
  }
  g->fwd_end = g->n;
  char why[512];
  if (!autodiff(g, false)) {
    CHECK(false, label, "autodiff: %s", g->err);
  } else if (!ir_validate(g, why, sizeof why)) {
    CHECK(false, label, "invalid graph after autodiff: %s", why);
  } else {
    if (concats >= 0) {
      int nc = 0, ns = 0;
      for (int i = g->fwd_end; i < g->n; i++) {
        nc += g->nodes[i]->op == OP_CONCAT;
        ns += g->nodes[i]->op == OP_SLICE_BWD;
      }
      char name[200];
      snprintf(name, sizeof name, "%s: the backward has %d CONCAT and %d SLICE_BWD nodes", label, concats, slice_bwds);
      CHECK(nc == concats && ns == slice_bwds, name, "%d CONCAT, %d SLICE_BWD", nc, ns);
    }
    Interp *it = interp_new(g, INTERP_F64);
    for (int pi = 0; pi < g->nparams; pi++) {
      int64_t n = shape_numel(g->nodes[g->params[pi]]->shape);
      double *v = interp_param(it, g->params[pi]);
      for (int64_t k = 0; k < n; k++)
        v[k] = param_value(c->dom[pi], pi, k, n);
    }
    interp_set_seed(it, 1234);
    if (!feed_inputs(it, c->feed, c->nfeed))
      CHECK(false, label, "could not set the inputs");
    else
      compare_with_fd(label, g, it, 0);
    interp_free(it);
  }
  case_free(c);
}

//
// One case per op (and per broadcasting or attribute variant).
//
static void unary_cases(void) {
  static const struct {
    Op op;
    Domain dom;
    const char *label;
  } ops[] = {
      {OP_NEG, DOM_ANY, "grad neg"},         {OP_EXP, DOM_ANY, "grad exp"},
      {OP_LOG, DOM_POSITIVE, "grad log"},    {OP_TANH, DOM_ANY, "grad tanh"},
      {OP_SQRT, DOM_POSITIVE, "grad sqrt"},  {OP_RSQRT, DOM_POSITIVE, "grad rsqrt"},
      {OP_RELU, DOM_AWAY_FROM_ZERO, "grad relu"}, {OP_GELU, DOM_ANY, "grad gelu"},
      {OP_SILU, DOM_ANY, "grad silu"},       {OP_SIGMOID, DOM_ANY, "grad sigmoid"},
      {OP_ABS, DOM_AWAY_FROM_ZERO, "grad abs"},
  };
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
    Case *c = case_new();
    int x = param(c, "x", SH(3, 4), ops[i].dom);
    gradcheck(ops[i].label, c, node(c, ops[i].op, IN(x), NULL, NULL));
  }
  Case *c = case_new();
  int x = param(c, "x", SH(4, 5), DOM_ANY);
  gradcheck("grad dropout p=0.3", c, node(c, OP_DROPOUT, IN(x), IA(3), FA(0.3)));
  // clamp: 12 values of DOM_DISTINCT lie in [-1 + 2k/12, -1 + (2k+1)/12), so bounds in the gaps
  // between (-0.375, 0.45) have values on both sides and none within a difference step of them.
  c = case_new();
  x = param(c, "x", SH(3, 4), DOM_DISTINCT);
  gradcheck("grad clamp [-0.375, 0.45]", c, node(c, OP_CLAMP, IN(x), NULL, FA(-0.375, 0.45)));
  c = case_new();
  x = param(c, "x", SH(3, 4), DOM_DISTINCT);
  gradcheck("grad clamp max 0.45 only", c, node(c, OP_CLAMP, IN(x), NULL, FA(-INFINITY, 0.45)));
}

// where and the comparisons: a condition from an input (so no parameter sits on a step of it), a and
// b broadcast against it, a number for a branch; the finite differences see each branch's share.
static void where_case(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "where.mdl",
                              "model where\ninput x: f32[3, 4]\nparam p: [3, 4] = normal(1)\n"
                              "param q: [4] = normal(1)\n"
                              "y = where(x > 0.1, p * p, q) + where(x <= -0.3, 2.0, p) * (x != 0.5)\n"
                              "output loss = sum(y * y) + sum((p >= q) * p)\n", NULL, 0);
  bool ok = g && autodiff(g, false);
  CHECK(ok, "grad where: compiles and differentiates", "%s", g ? g->err : "front end failed");
  if (!ok) {
    arena_free(a);
    return;
  }
  Interp *it = interp_new(g, INTERP_F64);
  for (int pi = 0; pi < g->nparams; pi++) {
    int64_t n = shape_numel(g->nodes[g->params[pi]]->shape);
    double *v = interp_param(it, g->params[pi]);
    for (int64_t k = 0; k < n; k++) // p in [0.2, 1.2), q in [-1.2, -0.2]: p >= q everywhere, by a margin
      v[k] = pi == 0 ? 0.7 + 0.5 * uniform(61, k) : -0.7 + 0.5 * uniform(62, k);
  }
  float xs[12];
  for (int k = 0; k < 12; k++) // a spread of values, none near 0.1, -0.3 or 0.5
    xs[k] = (float)(-0.89 + 0.15 * k + (k % 3 == 0 ? 0.02 : 0));
  if (!interp_set_input(it, "x", NULL, xs, 12))
    CHECK(false, "grad where", "could not set x");
  else
    compare_with_fd("grad where", g, it, 0);
  interp_free(it);
  arena_free(a);
}

// log_softmax over the last and a middle axis, softmax over the first: fp64 finite differences.
static void softmax_axes_case(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "lsm.mdl",
                              "model lsm\nparam p: [3, 4, 5] = normal(1)\nparam q: [3, 4, 5] = normal(1)\n"
                              "output loss = sum(log_softmax(p) * q) + sum(softmax(p, axis=0) * q)"
                              " + sum(log_softmax(p * q, axis=1) * p)\n", NULL, 0);
  bool ok = g && autodiff(g, false);
  CHECK(ok, "grad softmax axes: compiles and differentiates", "%s", g ? g->err : "front end failed");
  if (!ok) {
    arena_free(a);
    return;
  }
  Interp *it = interp_new(g, INTERP_F64);
  for (int pi = 0; pi < g->nparams; pi++) {
    int64_t n = shape_numel(g->nodes[g->params[pi]]->shape);
    double *v = interp_param(it, g->params[pi]);
    for (int64_t k = 0; k < n; k++)
      v[k] = 2 * uniform(71 + (uint64_t)pi, k);
  }
  compare_with_fd("grad softmax axes (log_softmax last and middle, softmax first)", g, it, 0);
  interp_free(it);
  arena_free(a);
}

// topk, gather and scatter_add: the values of topk carry the gradient to the positions chosen, along
// the last axis and the first; gather with an index broadcast over the other axis and indices out of
// range (-1 and 4 read 0 and take no gradient); scatter_add with two sources on one position and
// sources out of range (they add nothing, so their gradient is 0). The parameters' values are
// distinct by 0.1 or more, so no difference step changes what topk picks.
static void routing_case(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "route.mdl",
                              "model route\ninput idx: i32[3, 1]\ninput sidx: i32[4, 5]\n"
                              "param x: [4, 5] = normal(1)\nparam b: [3, 5] = normal(1)\n"
                              "vals, top = topk(x, 2)\nv0, t0 = topk(x * x, 3, axis=0)\n"
                              "gx = gather(x, idx, axis=0)\ns = scatter_add(b, sidx, x * x, axis=0)\n"
                              "output loss = sum(vals * vals * x[:, 0:2]) + sum(v0 * gx) + sum(s * s * b)"
                              " + sum(gather(b, top[0:3, :], axis=1))\n", NULL, 0);
  bool ok = g && autodiff(g, false);
  CHECK(ok, "grad routing: compiles and differentiates", "%s", g ? g->err : "front end failed");
  if (!ok) {
    arena_free(a);
    return;
  }
  Interp *it = interp_new(g, INTERP_F64);
  for (int pi = 0; pi < g->nparams; pi++) {
    int64_t n = shape_numel(g->nodes[g->params[pi]]->shape);
    double *v = interp_param(it, g->params[pi]);
    for (int64_t k = 0; k < n; k++) // a permutation of 20 steps of 0.1 (x: none near 0, so x * x keeps them apart)
      v[k] = pi == 0 ? (k % 2 ? -1 : 1) * (0.15 + 0.1 * (double)((k * 7) % 20)) : 0.5 * uniform(81, k);
  }
  int32_t idx[3] = {2, -1, 4}, sidx[20];
  for (int k = 0; k < 20; k++) // rows 0 and 1 of x both into row 1 of s in places; -1 and 3 drop
    sidx[k] = (int32_t)((k * 3) % 5) - 1;
  if (!interp_set_input(it, "idx", idx, NULL, 3) || !interp_set_input(it, "sidx", sidx, NULL, 20))
    CHECK(false, "grad routing", "could not set the indices");
  else
    compare_with_fd("grad routing (topk, gather, scatter_add)", g, it, 0);
  interp_free(it);
  arena_free(a);
}

// topk's order: largest first, ties by the lower index, NaN before every number; gather then reads the
// values, and an index out of range reads 0.
static void topk_order_case(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "topk.mdl",
                              "model topk\ninput x: f32[2, 6]\ninput far: i32[2, 2]\n"
                              "v, i = topk(x, 4)\noutput loss = sum(v)\noutput far_v = gather(x, far)\n",
                              NULL, 0);
  CHECK(g != NULL, "topk order: compiles", "front end failed");
  if (!g) {
    arena_free(a);
    return;
  }
  Interp *it = interp_new(g, INTERP_F32);
  float xs[12] = {1, 3, 3, -2, 0.5f, 3, -1, NAN, -1, 2, NAN, -5};
  int32_t far[4] = {6, -1, 5, 0};
  char err[256] = "";
  bool ran = interp_set_input(it, "x", NULL, xs, 12) && interp_set_input(it, "far", far, NULL, 4) &&
             interp_run(it, g->n, err, sizeof err);
  int iv = -1, fv = -1;
  for (int k = 0; k < g->n; k++) {
    if (g->nodes[k]->op == OP_TOPK)
      iv = k;
    if (g->nodes[k]->name && !strcmp(g->nodes[k]->name, "far_v"))
      fv = k;
  }
  const double want[8] = {1, 2, 5, 0, 1, 4, 3, 0};
  bool same = ran && iv >= 0 && fv >= 0;
  for (int k = 0; same && k < 8; k++)
    same = interp_value(it, iv)[k] == want[k];
  const double *f = same ? interp_value(it, fv) : NULL;
  same = same && f[0] == 0 && f[1] == 0 && f[2] == -5 && f[3] == -1;
  CHECK(same, "topk order: ties by the lower index, NaN first; gather out of range reads 0", "%s", err);
  interp_free(it);
  arena_free(a);
}

// Elementwise max(a, b) and min(a, b), broadcast, with a number, and the min reduction. p and q tie at
// every third element (p[k] == q[k]), where they enter the loss linearly (`tie`): there the gradient
// is shared evenly, as the central difference sees it (a kink whose two slopes are 0 and 1 has the
// mean slope 1/2); elsewhere the operands differ by far more than the difference step.
static void minmax_case(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "minmax.mdl",
                              "model minmax\nparam p: [3, 4] = normal(1)\nparam q: [3, 4] = normal(1)\n"
                              "param r: [4] = normal(1)\n"
                              "y = min(p * 3.0, q) + max(p, r) * min(r, 0.25) + min(0.5, q)\n"
                              "tie = max(p, q) * 2.0 - min(q, p)\n"
                              "output loss = sum(y * y) + sum(tie) + sum(min(p * q, axis=1)) + "
                              "sum(min(r, axis=0, keepdim=true))\n",
                              NULL, 0);
  bool ok = g && autodiff(g, false);
  CHECK(ok, "grad min/max: compiles and differentiates", "%s", g ? g->err : "front end failed");
  if (!ok) {
    arena_free(a);
    return;
  }
  Interp *it = interp_new(g, INTERP_F64);
  double *p = interp_param(it, g->params[0]), *q = interp_param(it, g->params[1]), *r = interp_param(it, g->params[2]);
  for (int k = 0; k < 12; k++) { // p in [-0.95, 1) apart by 1/6; q = p, or p +- 0.3
    p[k] = -0.95 + (double)((k * 5) % 12) / 6;
    q[k] = k % 3 == 0 ? p[k] : p[k] + (k % 2 ? 0.3 : -0.3);
  }
  for (int k = 0; k < 4; k++)
    r[k] = -0.83 + 0.41 * k;
  compare_with_fd("grad min/max", g, it, 0);
  interp_free(it);
  arena_free(a);
}

// Integers carry no gradient: int(p * 3) is a step function, flat where the difference steps land
// (p * 3 is 0.1 or more from every integer), so the central difference agrees with autodiff taking
// float(int(p * 3)) as a constant; integer arithmetic on an input scales p too.
static void integer_case(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "ints.mdl",
                              "model ints\ninput pos: i32[6]\nparam p: [6] = normal(1)\n"
                              "k = int(p * 3.0)\n"
                              "y = p * float(k * 2 - k // 2) + float((pos - 2) % 3 - pos) * p * p + (k > 0) * p\n"
                              "output loss = sum(y * y)\n", NULL, 0);
  bool ok = g && autodiff(g, false);
  CHECK(ok, "grad integers: compiles and differentiates", "%s", g ? g->err : "front end failed");
  if (!ok) {
    arena_free(a);
    return;
  }
  Interp *it = interp_new(g, INTERP_F64);
  double *p = interp_param(it, g->params[0]);
  for (int k = 0; k < 6; k++)
    p[k] = -0.95 + 0.37 * k;
  const int32_t pos[6] = {0, 1, 2, 3, 4, 5};
  if (!interp_set_input(it, "pos", pos, NULL, 6))
    CHECK(false, "grad integers", "could not set pos");
  else
    compare_with_fd("grad integers", g, it, 0);
  interp_free(it);
  arena_free(a);
}

// conv1d's values against the definition, written out as loops: y[b, t, o] = sum over k, c of
// w[k, c, o] x[b, t + k - left, c] (0 outside), left = K - 1 causal, else (K - 1) / 2; a depthwise
// w[k, c] for c == o only. Each of causal and not, depthwise and full, K odd and even.
static void conv1d_values(void) {
  static const struct {
    const char *w;
    int k, cout;
    bool causal, depthwise;
  } cases[] = {{"[4, 3]", 4, 3, true, true},   {"[3, 3]", 3, 3, false, true}, {"[2, 3, 5]", 2, 5, false, false},
               {"[3, 3, 2]", 3, 2, true, false}, {"[4, 3, 2]", 4, 2, false, false}};
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    Arena *a = arena_new();
    char text[512], label[128];
    snprintf(text, sizeof text, "model conv\ninput x: f32[2, 5, 3]\nparam w: %s = normal(1)\n"
             "output y = conv1d(x, w, causal=%s)\n", cases[ci].w, cases[ci].causal ? "true" : "false");
    snprintf(label, sizeof label, "conv1d w %s causal=%d: the definition's values", cases[ci].w, cases[ci].causal);
    Graph *g = mdl_compile_text(a, "conv.mdl", text, NULL, 0);
    if (!g) {
      CHECK(false, label, "front end failed");
      arena_free(a);
      continue;
    }
    Interp *it = interp_new(g, INTERP_F64);
    int K = cases[ci].k, O = cases[ci].cout, left = cases[ci].causal ? K - 1 : (K - 1) / 2;
    double *w = interp_param(it, g->params[0]);
    int64_t nw = shape_numel(g->nodes[g->params[0]]->shape);
    for (int64_t k = 0; k < nw; k++)
      w[k] = uniform(80, k);
    float x[30];
    for (int k = 0; k < 30; k++)
      x[k] = (float)sin(0.7 * k + 0.1);
    char err[256] = "";
    bool ran = interp_set_input(it, "x", NULL, x, 30) && interp_run(it, g->n, err, sizeof err);
    const double *y = ran ? interp_value(it, g->outputs[0]) : NULL;
    double worst = ran ? 0 : INFINITY;
    for (int b = 0; ran && b < 2; b++)
      for (int t = 0; t < 5; t++)
        for (int o = 0; o < O; o++) {
          double want = 0;
          for (int k = 0; k < K; k++)
            for (int c = 0; c < 3; c++) {
              int at = t + k - left;
              if (at < 0 || at >= 5 || (cases[ci].depthwise && c != o))
                continue;
              want += (cases[ci].depthwise ? w[k * 3 + c] : w[(k * 3 + c) * O + o]) * x[(b * 5 + at) * 3 + c];
            }
          worst = fmax(worst, fabs(y[(b * 5 + t) * O + o] - want));
        }
    CHECK(worst < 1e-14, label, "%s max difference %g", err, worst);
    interp_free(it);
    arena_free(a);
  }
}

// conv1d: causal depthwise (K 4 over T 6), 'same' full with a bias (K 3), 'same' full of an even K
// (2) and a causal full one whose first taps reach past the start of a short sequence (K 4, T 2).
static void conv1d_case(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "conv.mdl",
                              "model conv\ninput x: f32[2, 6, 3]\ninput s: f32[2, 2, 3]\n"
                              "param wd: [4, 3] = normal(0.5)\nparam wf: [3, 3, 5] = normal(0.5)\n"
                              "param bf: [5] = normal(0.5)\nparam we: [2, 5, 2] = normal(0.5)\n"
                              "param ws: [4, 3, 2] = normal(0.5)\n"
                              "c = conv1d(tanh(conv1d(x, wd, causal=true)), wf, bf)\n"
                              "e = conv1d(c, we, causal=false)\n"
                              "output loss = sum(c * c) + sum(e * e) + "
                              "sum(conv1d(s, ws, causal=true) * s[:, :, 0:2])\n",
                              NULL, 0);
  bool ok = g && autodiff(g, false);
  CHECK(ok, "grad conv1d: compiles and differentiates", "%s", g ? g->err : "front end failed");
  if (!ok) {
    arena_free(a);
    return;
  }
  Interp *it = interp_new(g, INTERP_F64);
  for (int pi = 0; pi < g->nparams; pi++) {
    int64_t n = shape_numel(g->nodes[g->params[pi]]->shape);
    double *v = interp_param(it, g->params[pi]);
    for (int64_t k = 0; k < n; k++)
      v[k] = 0.5 * uniform(70 + (uint64_t)pi, k);
  }
  float xs[36], ss[12];
  for (int k = 0; k < 36; k++)
    xs[k] = (float)sin(0.9 * k + 0.2);
  for (int k = 0; k < 12; k++)
    ss[k] = (float)cos(1.3 * k);
  if (!interp_set_input(it, "x", NULL, xs, 36) || !interp_set_input(it, "s", NULL, ss, 12))
    CHECK(false, "grad conv1d", "could not set the inputs");
  else
    compare_with_fd("grad conv1d", g, it, 0);
  interp_free(it);
  arena_free(a);
}

// stop_gradient: loss = sum(x * stop_gradient(x) + stop_gradient(x)) has d loss / dx = x, not 2x + 1
// (a finite difference sees the whole function, so this is checked against the formula).
static void stop_gradient_case(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "stop.mdl",
                              "model stop\nparam x: [5] = normal(1)\n"
                              "output loss = sum(x * stop_gradient(x) + stop_gradient(x))\n", NULL, 0);
  bool ok = g && autodiff(g, false);
  CHECK(ok, "stop_gradient: compiles and differentiates", "%s", g ? g->err : "front end failed");
  if (!ok) {
    arena_free(a);
    return;
  }
  Interp *it = interp_new(g, INTERP_F64);
  double *v = interp_param(it, g->params[0]);
  for (int i = 0; i < 5; i++)
    v[i] = uniform(51, i);
  char err[256] = "";
  bool ran = interp_run(it, g->n, err, sizeof err);
  double e = ran ? 0 : 1;
  const double *d = ran ? interp_value(it, g->grads[0]) : NULL;
  for (int i = 0; ran && i < 5; i++)
    e = fmax(e, fabs(d[i] - v[i]));
  CHECK(ran && e < 1e-15, "stop_gradient: d sum(x * stop_gradient(x) + stop_gradient(x)) / dx = x", "%s error %g", err,
        e);
  interp_free(it);
  arena_free(a);
}

static void binary_cases(void) {
  static const struct {
    Op op;
    Shape a, b;
    const char *label;
  } cases[] = {
      {OP_ADD, {2, {3, 4}}, {2, {3, 4}}, "grad add"},
      {OP_ADD, {3, {2, 3, 4}}, {1, {4}}, "grad add [2,3,4]+[4]"},
      {OP_ADD, {2, {3, 1}}, {3, {2, 1, 4}}, "grad add [3,1]+[2,1,4]"},
      {OP_SUB, {2, {3, 4}}, {2, {3, 4}}, "grad sub"},
      {OP_SUB, {3, {2, 3, 4}}, {2, {3, 1}}, "grad sub [2,3,4]-[3,1]"},
      {OP_MUL, {2, {3, 4}}, {2, {3, 4}}, "grad mul"},
      {OP_MUL, {3, {2, 1, 4}}, {2, {3, 1}}, "grad mul [2,1,4]*[3,1]"},
      {OP_MUL, {1, {4}}, {3, {2, 3, 4}}, "grad mul [4]*[2,3,4]"},
      {OP_DIV, {2, {3, 4}}, {2, {3, 4}}, "grad div"},
      {OP_DIV, {3, {2, 3, 4}}, {3, {1, 3, 1}}, "grad div [2,3,4]/[1,3,1]"},
      {OP_DIV, {1, {4}}, {2, {3, 4}}, "grad div [4]/[3,4]"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    Case *c = case_new();
    int a = param(c, "a", cases[i].a, DOM_ANY);
    int b = param(c, "b", cases[i].b, cases[i].op == OP_DIV ? DOM_POSITIVE : DOM_ANY);
    gradcheck(cases[i].label, c, node(c, cases[i].op, IN(a, b), NULL, NULL));
  }
  // One value feeding several consumers: the contributions must add up.
  Case *c = case_new();
  int x = param(c, "x", SH(3, 4), DOM_POSITIVE);
  int sq = node(c, OP_MUL, IN(x, x), NULL, NULL);
  int q = node(c, OP_DIV, IN(sq, x), NULL, NULL);
  int t = node(c, OP_TANH, IN(x), NULL, NULL);
  int sum = node(c, OP_ADD, IN(q, t), NULL, NULL);
  int s = node(c, OP_SUB, IN(sum, node(c, OP_LOG, IN(x), NULL, NULL)), NULL, NULL);
  gradcheck("grad reused value (x*x/x + tanh x - log x)", c, s);
  c = case_new();
  x = param(c, "x", SH(2, 3), DOM_ANY);
  int shifted = node(c, OP_ADD, IN(x, cst(c, 2.5)), NULL, NULL);
  gradcheck("grad add of a constant", c, node(c, OP_MUL, IN(shifted, cst(c, -3)), NULL, NULL));
}

static void reduction_cases(void) {
  static const struct {
    Op op;
    int axis, keepdim;
    const char *label;
  } cases[] = {
      {OP_SUM, 1, 0, "grad sum axis=1"},      {OP_SUM, 2, 1, "grad sum axis=2 keepdim"},
      {OP_SUM, 0, 1, "grad sum axis=0 keepdim"}, {OP_MEAN, 0, 0, "grad mean axis=0"},
      {OP_MEAN, 2, 1, "grad mean axis=2 keepdim"}, {OP_MEAN, 1, 0, "grad mean axis=1"},
      {OP_MAX, 1, 0, "grad max axis=1"},      {OP_MAX, 2, 1, "grad max axis=2 keepdim"},
      {OP_MAX, 0, 0, "grad max axis=0"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    Case *c = case_new();
    int x = param(c, "x", SH(2, 3, 4), cases[i].op == OP_MAX ? DOM_DISTINCT : DOM_ANY);
    gradcheck(cases[i].label, c, node(c, cases[i].op, IN(x), IA(cases[i].axis, cases[i].keepdim), NULL));
  }
  // Reduce-all as the front end lowers it: reshape to [n], then a reduction over axis 0.
  Case *c = case_new();
  int x = param(c, "x", SH(3, 4), DOM_ANY);
  int flat = built(c, ir_reshape(c->g, x, SH(12), noloc));
  gradcheck("grad mean of all", c, node(c, OP_MEAN, IN(flat), IA(0, 0), NULL));
}

static void layout_cases(void) {
  Case *c = case_new();
  int x = param(c, "x", SH(2, 6), DOM_ANY);
  gradcheck("grad reshape", c, built(c, ir_reshape(c->g, node(c, OP_TANH, IN(x), NULL, NULL), SH(3, 2, 2), noloc)));

  c = case_new();
  x = param(c, "x", SH(2, 3, 4), DOM_ANY);
  gradcheck("grad permute [2,0,1]", c, node(c, OP_PERMUTE, IN(x), IA(2, 0, 1), NULL));

  c = case_new();
  x = param(c, "x", SH(2, 3, 4, 5), DOM_ANY);
  gradcheck("grad permute [1,3,0,2]", c, node(c, OP_PERMUTE, IN(x), IA(1, 3, 0, 2), NULL));

  c = case_new();
  x = param(c, "x", SH(3, 1), DOM_ANY);
  gradcheck("grad broadcast [3,1] to [2,3,4]", c, built(c, ir_broadcast(c->g, x, SH(2, 3, 4), noloc)));

  c = case_new();
  x = param(c, "x", SH(3, 5), DOM_ANY);
  gradcheck("grad slice axis=1 1:4", c, node(c, OP_SLICE, IN(x), IA(1, 1, 4), NULL));

  c = case_new();
  x = param(c, "x", SH(4, 2, 3), DOM_ANY);
  int lo = node(c, OP_SLICE, IN(x), IA(0, 0, 3), NULL);
  int hi = node(c, OP_SLICE, IN(x), IA(0, 1, 4), NULL);
  gradcheck_ops("grad overlapping slices", c, node(c, OP_MUL, IN(lo, hi), NULL, NULL), 0, 2);

  // Slices that tile an axis (a split, as GPT-2's q, k, v): the gradient is the CONCAT of theirs; with
  // x also read otherwise (through tanh), their zero-padded gradients are added to that one.
  for (int whole = 0; whole < 2; whole++) {
    c = case_new();
    x = param(c, "x", SH(2, 6, 3), DOM_ANY);
    int s0 = node(c, OP_SLICE, IN(x), IA(1, 0, 2), NULL);
    int s1 = node(c, OP_SLICE, IN(x), IA(1, 2, 4), NULL);
    int s2 = node(c, OP_SLICE, IN(x), IA(1, 4, 6), NULL);
    int y = node(c, OP_ADD, IN(node(c, OP_MUL, IN(s0, s1), NULL, NULL), node(c, OP_TANH, IN(s2), NULL, NULL)), NULL,
                 NULL);
    if (whole)
      y = node(c, OP_MUL, IN(y, node(c, OP_SLICE, IN(node(c, OP_TANH, IN(x), NULL, NULL)), IA(1, 1, 3), NULL)), NULL,
               NULL);
    gradcheck_ops(whole ? "grad split, x also read whole" : "grad split into three slices", c, y, whole ? 0 : 1,
                  whole ? 4 : 0); // (whole: x's three and that of the slice of tanh x)
  }

  c = case_new();
  int a = param(c, "a", SH(2, 1, 3), DOM_ANY);
  int b = param(c, "b", SH(2, 4, 3), DOM_ANY);
  int k = f32_input(c, "k", SH(2, 2, 3), 5);
  gradcheck("grad concat axis=1", c, node(c, OP_CONCAT, IN(a, k, b, a), IA(1), NULL));
}

static void matmul_case(const char *label, Shape a, Shape b, int ta, int tb) {
  Case *c = case_new();
  int x = param(c, "a", a, DOM_ANY);
  int y = param(c, "b", b, DOM_ANY);
  gradcheck(label, c, node(c, OP_MATMUL, IN(x, y), IA(ta, tb), NULL));
}

static void matmul_cases(void) {
  matmul_case("grad matmul", SH(3, 4), SH(4, 5), 0, 0);
  matmul_case("grad matmul a.T", SH(4, 3), SH(4, 5), 1, 0);
  matmul_case("grad matmul b.T", SH(3, 4), SH(5, 4), 0, 1);
  matmul_case("grad matmul a.T b.T", SH(4, 3), SH(5, 4), 1, 1);
  matmul_case("grad matmul batched", SH(2, 3, 4), SH(2, 4, 5), 0, 0);
  matmul_case("grad matmul [2,3,4]@[4,5]", SH(2, 3, 4), SH(4, 5), 0, 0);
  matmul_case("grad matmul [3,4]@[2,4,5] b.T", SH(3, 4), SH(2, 5, 4), 0, 1);
  matmul_case("grad matmul [2,1,4,3]@[3,5,4] a.T b.T", SH(2, 1, 4, 3), SH(3, 5, 4), 1, 1);
  matmul_case("grad matmul [1,3,4]@[2,4,5] a.T", SH(1, 4, 3), SH(2, 4, 5), 1, 0);
  Case *c = case_new();
  int x = param(c, "x", SH(3, 3), DOM_ANY);
  gradcheck("grad matmul x@x.T", c, node(c, OP_MATMUL, IN(x, x), IA(0, 1), NULL));
}

static void row_cases(void) {
  Case *c = case_new();
  int t = param(c, "table", SH(5, 3), DOM_ANY);
  int ids = ids_input(c, "ids", SH(2, 3), (const int32_t[]){1, 4, 1, 0, 1, 4});
  gradcheck("grad embed (repeated ids)", c, node(c, OP_EMBED, IN(t, ids), NULL, NULL));

  c = case_new();
  int x = param(c, "x", SH(2, 3, 6), DOM_ANY);
  int w = param(c, "w", SH(6), DOM_ANY);
  int b = param(c, "b", SH(6), DOM_ANY);
  gradcheck("grad layernorm", c, node(c, OP_LAYERNORM, IN(x, w, b), NULL, FA(1e-5)));

  c = case_new();
  x = param(c, "x", SH(4, 5), DOM_ANY);
  w = param(c, "w", SH(5), DOM_ANY);
  gradcheck("grad rmsnorm", c, node(c, OP_RMSNORM, IN(x, w), NULL, FA(1e-5)));

  c = case_new();
  x = param(c, "x", SH(3, 5), DOM_ANY);
  gradcheck("grad softmax", c, node(c, OP_SOFTMAX, IN(x), NULL, NULL));

  c = case_new();
  x = param(c, "logits", SH(2, 3, 5), DOM_ANY);
  int tg = ids_input(c, "targets", SH(2, 3), (const int32_t[]){0, 4, -1, 2, 2, 1});
  gradcheck("grad cross_entropy (one ignored target)", c, node(c, OP_CROSS_ENTROPY, IN(x, tg), NULL, NULL));

  // The losses over the count of their targets (5 of 6): the count is no parameter's function.
  c = case_new();
  x = param(c, "logits", SH(2, 3, 5), DOM_ANY);
  tg = ids_input(c, "targets", SH(2, 3), (const int32_t[]){0, 4, -1, 2, 2, 1});
  int ce = node(c, OP_CROSS_ENTROPY, IN(x, tg), NULL, NULL);
  int count = node(c, OP_TARGET_COUNT, IN(tg), NULL, NULL);
  gradcheck("grad cross_entropy / target_count", c, node(c, OP_DIV, IN(ce, count), NULL, NULL));
}

static void attention_case(const char *label, bool causal, bool doc, bool shared) {
  enum { B = 2, T = 4, C = 6, H = 2 };
  Case *c = case_new();
  int q = param(c, "q", SH(B, T, C), DOM_ANY);
  int k = shared ? q : param(c, "k", SH(B, T, C), DOM_ANY);
  int v = shared ? q : param(c, "v", SH(B, T, C), DOM_ANY);
  int64_t ia[8] = {H, causal, doc};
  double fa[6] = {1 / sqrt(C / H)};
  int out;
  if (doc) {
    int d = ids_input(c, "doc", SH(B, T), (const int32_t[]){0, 0, 1, 1, 3, 5, 5, 5});
    out = node(c, OP_ATTENTION, IN(q, k, v, d), ia, fa);
  } else {
    out = node(c, OP_ATTENTION, IN(q, k, v), ia, fa);
  }
  gradcheck(label, c, out);
}

// Attention with kv_heads (ia[5]) kv heads and a window (ia[6]), keys of s rows (s != T without
// causal and doc ids): q [B,T,H*D], k and v [B,S,KH*D]; dk and dv of a kv head sum over its group.
static void attention_kv_case(const char *label, int64_t kv_heads, int64_t window, int64_t s, bool causal, bool doc) {
  enum { B = 2, T = 5, H = 4, D = 2 };
  Case *c = case_new();
  int q = param(c, "q", SH(B, T, H * D), DOM_ANY);
  int k = param(c, "k", SH(B, s, kv_heads * D), DOM_ANY);
  int v = param(c, "v", SH(B, s, kv_heads * D), DOM_ANY);
  int64_t ia[8] = {H, causal, doc, 0, 0, kv_heads, window};
  double fa[6] = {0.8};
  int out;
  if (doc) {
    int d = ids_input(c, "doc", SH(B, T), (const int32_t[]){0, 0, 0, 1, 1, 3, 5, 5, 5, 5});
    out = node(c, OP_ATTENTION, IN(q, k, v, d), ia, fa);
  } else {
    out = node(c, OP_ATTENTION, IN(q, k, v), ia, fa);
  }
  gradcheck(label, c, out);
}

static void sequence_cases(void) {
  attention_kv_case("grad attention kv_heads=2 of 4, causal", 2, 0, 5, true, false);
  attention_kv_case("grad attention kv_heads=1 of 4 (multi-query), causal doc", 1, 0, 5, true, true);
  attention_kv_case("grad attention window=2, causal", 4, 2, 5, true, false);
  attention_kv_case("grad attention window=3 kv_heads=2, causal doc", 2, 3, 5, true, true);
  attention_kv_case("grad attention 3 keys for 5 queries, kv_heads=2", 2, 0, 3, false, false);
  attention_kv_case("grad attention 7 keys for 5 queries", 4, 0, 7, false, false);
  attention_case("grad attention causal", true, false, false);
  attention_case("grad attention causal doc", true, true, false);
  attention_case("grad attention doc (not causal)", false, true, false);
  attention_case("grad attention (not causal)", false, false, false);
  attention_case("grad attention q=k=v causal", true, false, true);
  for (int inverse = 0; inverse < 2; inverse++) {
    Case *c = case_new();
    int x = param(c, "x", SH(2, 3, 8), DOM_ANY);
    int pos = ids_input(c, "pos", SH(2, 3), (const int32_t[]){0, 1, 2, 5, 17, 300});
    gradcheck(inverse ? "grad rope inverse" : "grad rope", c,
              node(c, OP_ROPE, IN(x, pos), IA(2, inverse), FA(10000)));
  }
}

//
// Properties of the backward graph beyond its values.
//
static void structure_cases(void) {
  Case *c = case_new();
  Graph *g = c->g;
  int a = param(c, "a", SH(2, 3), DOM_ANY);
  int b = param(c, "b", SH(2, 3), DOM_ANY);
  int pc = param(c, "c", SH(2, 3), DOM_ANY);
  int pe = param(c, "e", SH(2, 3), DOM_ANY);
  int unused = param(c, "unused", SH(4), DOM_ANY);
  int x = f32_input(c, "x", SH(2, 3), 3);
  int lx = node(c, OP_LOG, IN(x), NULL, NULL);    // depends on no param: no gradient
  int dead = node(c, OP_TANH, IN(a), NULL, NULL); // does not lead to the loss
  // loss = sum(((a * b + c) + e) * log x), each op on its own source line
  int h = built(c, ir_add(g, OP_MUL, IN(a, b), NULL, NULL, (SrcLoc){.line = 7}));
  int s1 = built(c, ir_add(g, OP_ADD, IN(h, pc), NULL, NULL, (SrcLoc){.line = 8}));
  int s = built(c, ir_add(g, OP_ADD, IN(s1, pe), NULL, NULL, (SrcLoc){.line = 8}));
  int y = built(c, ir_add(g, OP_MUL, IN(s, lx), NULL, NULL, (SrcLoc){.line = 9}));
  int flat = built(c, ir_reshape(g, y, SH(6), (SrcLoc){.line = 10}));
  g->loss = built(c, ir_add(g, OP_SUM, IN(flat), IA(0, 0), NULL, (SrcLoc){.line = 11}));
  if (!c->broken)
    g->nodes[y]->name = "y";
  g->fwd_end = g->n;
  bool ok = !c->broken && autodiff(g, false);
  CHECK(ok, "autodiff structure: builds", "%s", c->broken ? c->why : g->err);
  if (!ok) {
    case_free(c);
    return;
  }
  bool tags = true, named = true;
  for (int i = 0; i < g->nparams; i++) {
    IrNode *d = g->nodes[g->grads[i]];
    tags &= d->grad_of == g->params[i] && shape_eq(d->shape, g->nodes[g->params[i]]->shape);
    named &= d->name && !strncmp(d->name, "d.", 2) && !strcmp(d->name + 2, g->nodes[g->params[i]]->name);
  }
  CHECK(tags, "autodiff structure: grads[i] is tagged grad_of params[i] with its shape", "wrong tag or shape");
  CHECK(named, "autodiff structure: gradients named d.PARAM", "wrong name");
  CHECK(g->grads[2] != g->grads[3], "autodiff structure: two params with one gradient get a node each",
        "grads %d and %d", g->grads[2], g->grads[3]);
  bool touches_dead = false, log_grad = false, dy_ok = false, loc_ok = true;
  int lines[12] = {0};
  for (int i = g->fwd_end; i < g->n; i++) {
    IrNode *n = g->nodes[i];
    for (int k = 0; k < n->nin; k++)
      touches_dead |= n->in[k] == dead;
    log_grad |= n->op == OP_DIV;
    if (n->name && !strcmp(n->name, "d.y"))
      dy_ok = shape_eq(n->shape, g->nodes[y]->shape);
    // a param's own gradient node (a copy, zeros) is placed at the param
    bool at_param = n->loc.line == 0 && (n->grad_of == pe || n->grad_of == unused || n->op == OP_CONST);
    loc_ok &= at_param || n->loc.line == 7 || n->loc.line == 9 || n->loc.line == 10 || n->loc.line == 11;
    if (n->loc.line >= 0 && n->loc.line < 12)
      lines[n->loc.line]++;
  }
  CHECK(!touches_dead && !log_grad, "autodiff structure: no gradient for dead or param-free branches",
        "dead branch used: %d, log(x) differentiated: %d", touches_dead, log_grad);
  CHECK(dy_ok, "autodiff structure: d.y names the gradient of the named value y", "no node d.y of y's shape");
  CHECK(loc_ok && lines[7] && lines[9] && lines[10] && lines[11],
        "autodiff structure: backward nodes carry the forward node's location", "lines 7/9/10/11: %d %d %d %d",
        lines[7], lines[9], lines[10], lines[11]);

  Interp *it = interp_new(g, INTERP_F64);
  char err[512] = "";
  float xs[6] = {1, 2, 3, 4, 5, 6};
  double *va = interp_param(it, a), *vb = interp_param(it, b);
  for (int i = 0; i < 6; i++) {
    va[i] = uniform(40, i);
    vb[i] = uniform(41, i);
  }
  bool ran = interp_set_input(it, "x", NULL, xs, 6) && interp_run(it, g->n, err, sizeof err);
  CHECK(ran, "autodiff structure: runs", "%s", err);
  if (ran) {
    const double *d[5];
    for (int i = 0; i < 5; i++)
      d[i] = interp_value(it, g->grads[i]);
    double e = 0;
    for (int i = 0; i < 6; i++) {
      double l = log(xs[i]);
      e = fmax(e, fabs(d[0][i] - l * vb[i]) + fabs(d[1][i] - l * va[i]) + fabs(d[2][i] - l) + fabs(d[3][i] - l));
    }
    for (int i = 0; i < 4; i++)
      e = fmax(e, fabs(d[4][i]));
    CHECK(e < 1e-12, "autodiff structure: gradients by hand, zeros for an unused param", "error %g", e);
  }
  interp_free(it);
  case_free(c);

  c = case_new();
  param(c, "p", SH(2), DOM_ANY);
  ok = autodiff(c->g, false);
  CHECK(!ok && strstr(c->g->err, "loss"), "autodiff error: a graph without a loss", "got %d '%s'", ok, c->g->err);
  case_free(c);

  c = case_new();
  int p = param(c, "p", SH(2), DOM_ANY);
  c->g->loss = p;
  ok = autodiff(c->g, false);
  CHECK(!ok && strstr(c->g->err, "scalar"), "autodiff error: a loss that is not a scalar", "got %d '%s'", ok,
        c->g->err);
  case_free(c);
}

//
// The optimizer step against AdamW computed by hand.
//
typedef struct {
  const char *label;
  double clip;
  bool decay_a, decay_b;
} AdamCase;

static void adamw_case(const AdamCase *ac) {
  enum { NA = 3, NB = 2, STEPS = 2 };
  Case *c = case_new();
  Graph *g = c->g;
  g->train.beta1 = 0.8;
  g->train.beta2 = 0.9;
  g->train.eps = 1e-3;
  g->train.weight_decay = 0.25;
  g->train.clip = ac->clip;
  int a = param(c, "a", SH(NA), DOM_ANY);
  int b = param(c, "b", SH(NB), DOM_ANY);
  g->nodes[a]->init.decay = ac->decay_a;
  g->nodes[b]->init.decay = ac->decay_b;
  // loss = sum(a * ra) + sum(b * b * rb): gradients ra and 2 b rb.
  int ra = f32_input(c, "ra", SH(NA), 21);
  int rb = f32_input(c, "rb", SH(NB), 22);
  int la = node(c, OP_SUM, IN(node(c, OP_MUL, IN(a, ra), NULL, NULL)), IA(0, 0), NULL);
  int bb = node(c, OP_MUL, IN(b, b), NULL, NULL);
  int lb = node(c, OP_SUM, IN(node(c, OP_MUL, IN(bb, rb), NULL, NULL)), IA(0, 0), NULL);
  g->loss = node(c, OP_ADD, IN(la, lb), NULL, NULL);
  char label[200];
  bool ok = !c->broken && autodiff(g, true);
  snprintf(label, sizeof label, "adamw %s: builds", ac->label);
  CHECK(ok, label, "%s", c->broken ? c->why : g->err);
  if (!ok) {
    case_free(c);
    return;
  }
  // Structure: two moments per param, one grad norm, one ADAMW per param with the train config.
  bool shape_ok = true;
  for (int i = 0; i < 2; i++) {
    IrNode *u = g->nodes[g->updates[i]], *p = g->nodes[g->params[i]];
    IrNode *m = g->nodes[u->in[2]], *v = g->nodes[u->in[3]], *gn = g->nodes[u->in[4]];
    IrNode *lr = g->nodes[u->in[5]], *st = g->nodes[u->in[6]];
    char mname[64], vname[64];
    snprintf(mname, sizeof mname, "%s.m", p->name);
    snprintf(vname, sizeof vname, "%s.v", p->name);
    double wd = p->init.decay ? 0.25 : 0;
    shape_ok &= u->op == OP_ADAMW && u->param_of == p->id && u->in[0] == p->id && u->in[1] == g->grads[i];
    shape_ok &= m->op == OP_STATE && !strcmp(m->name, mname) && m->param_of == p->id;
    shape_ok &= v->op == OP_STATE && !strcmp(v->name, vname) && v->param_of == p->id;
    shape_ok &= gn->op == OP_GRAD_NORM && gn->nin == 2;
    shape_ok &= lr->op == OP_SCALAR && !strcmp(lr->name, "lr") && st->op == OP_SCALAR && !strcmp(st->name, "step");
    shape_ok &= u->fa[0] == 0.8 && u->fa[1] == 0.9 && u->fa[2] == 1e-3 && u->fa[3] == wd && u->fa[4] == ac->clip;
  }
  snprintf(label, sizeof label, "adamw %s: graph structure", ac->label);
  CHECK(shape_ok, label, "unexpected ADAMW/STATE/SCALAR nodes");

  // Hand computation, two steps (the second uses the moments and bias corrections of step 2).
  const double lrs[STEPS] = {0.05, 0.02};
  double pv[NA + NB], m[NA + NB] = {0}, v[NA + NB] = {0};
  Interp *it = interp_new(g, INTERP_F64);
  double *pa = interp_param(it, a), *pb = interp_param(it, b);
  for (int i = 0; i < NA + NB; i++) {
    pv[i] = 0.5 + uniform(30, i);
    if (i < NA)
      pa[i] = pv[i];
    else
      pb[i - NA] = pv[i];
  }
  feed_inputs(it, c->feed, c->nfeed);
  double err_max = 0;
  char err[512] = "";
  bool ran = true, clipped = false;
  for (int s = 1; s <= STEPS && ran; s++) {
    double gr[NA + NB], norm2 = 0;
    for (int i = 0; i < NA + NB; i++) {
      gr[i] = i < NA ? c->feed[0].f[i] : 2 * pv[i] * c->feed[1].f[i - NA];
      norm2 += gr[i] * gr[i];
    }
    double gnorm = sqrt(norm2);
    double scale = ac->clip > 0 ? fmin(1, ac->clip / (gnorm + 1e-6)) : 1;
    clipped |= scale < 1;
    for (int i = 0; i < NA + NB; i++) {
      double gi = scale * gr[i];
      double wd = (i < NA ? ac->decay_a : ac->decay_b) ? 0.25 : 0;
      m[i] = 0.8 * m[i] + 0.2 * gi;
      v[i] = 0.9 * v[i] + 0.1 * gi * gi;
      double mhat = m[i] / (1 - pow(0.8, s)), vhat = v[i] / (1 - pow(0.9, s));
      pv[i] -= lrs[s - 1] * (mhat / (sqrt(vhat) + 1e-3) + wd * pv[i]);
    }
    interp_set_scalar(it, "lr", lrs[s - 1]);
    interp_set_scalar(it, "step", s);
    ran = interp_run(it, g->n, err, sizeof err);
    for (int i = 0; i < NA + NB && ran; i++) {
      double got = i < NA ? interp_param(it, a)[i] : interp_param(it, b)[i - NA];
      double node_value = interp_value(it, g->updates[i < NA ? 0 : 1])[i < NA ? i : i - NA];
      err_max = fmax(err_max, fmax(fabs(got - pv[i]), fabs(node_value - pv[i])));
    }
  }
  snprintf(label, sizeof label, "adamw %s: two steps match the formula", ac->label);
  CHECK(ran && err_max < 1e-12, label, "%s max error %g", err, err_max);
  bool active = ac->clip > 0 && ac->clip < 1;
  snprintf(label, sizeof label, "adamw %s: clipping %s", ac->label, active ? "active" : "inactive");
  CHECK(clipped == active, label, "the hand computation %s clip", clipped ? "did" : "did not");
  interp_free(it);
  case_free(c);
}

static void adamw_cases(void) {
  // The gradient norm of these losses is between 1 and 3: clip 0.5 is active, clip 100 is not.
  static const AdamCase cases[] = {
      {"no clip, decay on a", 0, true, false},
      {"clip 0.5, decay on b", 0.5, false, true},
      {"clip 100, decay on both", 100, true, true},
      {"clip 0.5, no decay", 0.5, false, false},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    adamw_case(&cases[i]);
}

//
// Whole models with B=2 and T=8: the tiny GPT (one document per row, then two), and the tiny
// LLaMA (rope, rmsnorm, SwiGLU, untied head) with two documents per row; both with two documents per
// row and attention lowered into GEMMs, a mask and a softmax (--attention plain). With two documents
// the last position of each has its target ignored, so the loss is the mean over 12 of the 16 positions.
//
static void model_case(const char *model, bool two_docs, bool plain) {
  char path[128], label[160];
  snprintf(path, sizeof path, "models/%s.mdl", model);
  snprintf(label, sizeof label, "grad %s%s%s", model, two_docs ? " (two documents per row, ignored targets)" : "",
           plain ? " (plain attention)" : "");
  if (access(path, R_OK) != 0) {
    printf("[skip] %s: %s is not there\n", label, path);
    return;
  }
  enum { B = 2, T = 8 };
  DimOverride ov[] = {{"B", B}, {"T", T}};
  Arena *arena = arena_new();
  Graph *g = mdl_compile_file_with(arena, path, ov, 2, &(LowerOptions){.plain_attention = plain});
  if (!g) {
    CHECK(false, label, "%s does not compile", path);
    arena_free(arena);
    return;
  }
  char name[200];
  snprintf(name, sizeof name, "%s: autodiff", label);
  char why[512] = "";
  bool ok = autodiff(g, false) && ir_validate(g, why, sizeof why);
  CHECK(ok, name, "%s%s", g->err, why);
  if (!ok) {
    arena_free(arena);
    return;
  }
  int64_t vocab = g->nodes[g->params[0]]->shape.d[0];
  int32_t tokens[B * T], targets[B * T], pos[B * T], doc[B * T];
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      int i = b * T + t, second = two_docs && t >= T / 2;
      tokens[i] = (int32_t)((7 * i + 3 * b + 1) % vocab);
      // With two documents, each one's last position has no target (-1, ignored): the loss is the
      // mean over the others.
      bool last = two_docs && (t == T / 2 - 1 || t == T - 1);
      targets[i] = last ? -1 : (int32_t)((5 * i + 11) % vocab);
      pos[i] = second ? t - T / 2 : t;
      doc[i] = second;
    }
  Interp *it = interp_new(g, INTERP_F64);
  interp_init_params(it, 1);
  bool fed = true;
  for (int i = 0; i < g->fwd_end; i++) {
    IrNode *n = g->nodes[i];
    if (n->op != OP_INPUT)
      continue;
    const int32_t *v = !strcmp(n->name, "tokens") ? tokens : !strcmp(n->name, "targets") ? targets
                     : !strcmp(n->name, "pos")    ? pos
                     : !strcmp(n->name, "doc")    ? doc
                                                  : NULL;
    fed &= v && interp_set_input(it, n->name, v, NULL, B * T);
  }
  snprintf(name, sizeof name, "%s: inputs", label);
  CHECK(fed, name, "the model's inputs are not tokens/targets/pos/doc");
  if (fed)
    compare_with_fd(label, g, it, 8);
  interp_free(it);
  arena_free(arena);
}

// The training graph of the tiny GPT: valid, one ADAMW per parameter with its decay setting.
static void gpt_optimizer_case(void) {
  const char *path = "models/gpt2-tiny.mdl", *label = "adamw gpt2-tiny: training graph";
  if (access(path, R_OK) != 0) {
    printf("[skip] %s: %s is not there\n", label, path);
    return;
  }
  Arena *arena = arena_new();
  Graph *g = mdl_compile_file(arena, path, NULL, 0);
  char why[512] = "";
  bool ok = g && autodiff(g, true) && ir_validate(g, why, sizeof why);
  CHECK(ok, label, "%s%s", g ? g->err : "does not compile", why);
  if (ok) {
    int bad = -1, norms = 0;
    for (int i = 0; i < g->n; i++)
      norms += g->nodes[i]->op == OP_GRAD_NORM;
    for (int i = 0; i < g->nparams && bad < 0; i++) {
      IrNode *u = g->nodes[g->updates[i]], *p = g->nodes[g->params[i]];
      double wd = p->init.decay ? g->train.weight_decay : 0;
      if (u->op != OP_ADAMW || u->param_of != p->id || u->in[1] != g->grads[i] || u->fa[3] != wd ||
          u->fa[4] != g->train.clip)
        bad = i;
    }
    CHECK(bad < 0 && norms == 1, "adamw gpt2-tiny: one update per parameter, one gradient norm",
          "param %d wrong, %d grad norms", bad, norms);
    // ia[0] is the update's rule and nothing else is read: every other slot must be 0, not what
    // lay on the stack beside a shorter array (the emitted module and its cache key would differ)
    int stray = -1, slot = 0;
    for (int i = 0; i < g->nparams && stray < 0; i++)
      for (int k = 1; k < IR_NIA && stray < 0; k++)
        if (g->nodes[g->updates[i]]->ia[k] != 0)
          stray = i, slot = k;
    CHECK(stray < 0, "adamw gpt2-tiny: attribute slots past the rule are 0", "param %d: ia[%d] = %lld", stray,
          slot, stray < 0 ? 0LL : (long long)g->nodes[g->updates[stray]]->ia[slot]);
  }
  arena_free(arena);
}

int main(void) {
  unary_cases();
  stop_gradient_case();
  where_case();
  minmax_case();
  integer_case();
  conv1d_case();
  conv1d_values();
  softmax_axes_case();
  routing_case();
  topk_order_case();
  binary_cases();
  reduction_cases();
  layout_cases();
  matmul_cases();
  row_cases();
  sequence_cases();
  structure_cases();
  adamw_cases();
  model_case("gpt2-tiny", false, false);
  model_case("gpt2-tiny", true, false);
  model_case("llama-tiny", true, false);
  model_case("gpt2-tiny", true, true);
  model_case("llama-tiny", true, true);
  gpt_optimizer_case();
  TEST_EXIT();
}
