// interp.c: the reference interpreter. It executes the graph IR node by node, unfused, with plain
// loops over doubles, and is the oracle every compiled back end is tested against, so it favours
// being obviously right over being fast.
//
// Design: every node owns one malloc'd array of numel doubles (i32 tensors are stored as doubles
// too; every i32 value is exact in a double). Strides come from the node's shape; broadcasting is
// index arithmetic (right-aligned axes, size-1 axes read at coordinate 0). In INTERP_F32 each op's
// result is rounded to float as it is stored, which models an fp32 back end that keeps every
// intermediate tensor in fp32; INTERP_F64 keeps doubles (finite-difference gradient checks).
// PARAM and STATE arrays persist across runs; ADAMW writes its parameter and both moments in place.
//
// Decode mode (text generation) runs a graph compiled for one token (B = T = 1) once per position.
// Every other op of a language model is position-wise, so only ATTENTION needs the past: each
// ATTENTION node keeps a cache of the k and v rows of every position fed so far and attends the
// new q over it. Row p of that computation is done in the same order as row p of a full sequence
// (masked positions add exact zeros there), so decode mode reproduces the full forward's values.
// Decoding evaluates the model: its dropouts keep everything, as in a graph put in eval mode.
//
// Parameter initialisation is deterministic and shared with every back end: element i of the
// parameter with index k in Graph.params, INIT_NORMAL(std), is
//   std * sqrt(-2 ln(1 - u1)) * cos(2 pi u2),  u1 = mdl_rng_uniform(seed, k + 1000, 2i),
//                                              u2 = mdl_rng_uniform(seed, k + 1000, 2i + 1).
//
// fp8 (precision fp8): a CAST to fp8 multiplies by its tensor's scale, rounds with the prelude's
// conversions (runtime/kernels/fp8_bits.h, the device's bit for bit) and keeps the code's value; it records
// max |x| as it goes. A MATMUL of fp8 operands sums their products and multiplies by 1 / (scale_a
// scale_b). A whole step (interp_run to the end) first calibrates when no step was recorded yet (the
// graph up to its first optimizer node with every scale 1: amaxes only, nothing written), and ends
// with fp8_state_update; a non-finite amax makes the gradient norm NaN, so that the optimizer skips the
// step as it skips a non-finite loss, and the runtime names the tensor (interp_fp8). The training
// engine (runtime/engine/engine.c) runs the same step in parts with interp_run_nodes instead, so that the
// ranks' and the micro-batches' amaxes join the step's before the gradient norm checks them.
#include "fp8_state.h"
#include "mdl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_bits.h"

struct Interp {
  const Graph *g;
  InterpPrecision prec;
  double **val;   // per node: numel values
  int64_t *numel; // per node
  bool *given;    // INPUT / SCALAR: a value was set
  uint64_t seed;  // dropout masks
  int64_t decode_len; // decode mode: rows of each attention cache; 0 when off
  int64_t decode_pos; // decode mode: the position of this run's token
  double **cache;     // decode mode, per ATTENTION node: its k rows then its v rows, decode_len x C each
  Fp8State fp8;       // precision fp8: the scales and amax histories (fp8_state.h)
};

static void *icalloc(size_t n, size_t size) {
  return xcalloc(n, size, "the interpreter's values");
}

Interp *interp_new(const Graph *g, InterpPrecision prec) {
  Interp *it = icalloc(1, sizeof *it);
  it->g = g;
  it->prec = prec;
  it->val = icalloc((size_t)g->n, sizeof *it->val);
  it->numel = icalloc((size_t)g->n, sizeof *it->numel);
  it->given = icalloc((size_t)g->n, sizeof *it->given);
  for (int i = 0; i < g->n; i++) {
    it->numel[i] = shape_numel(g->nodes[i]->shape);
    it->val[i] = icalloc((size_t)it->numel[i], sizeof(double));
  }
  fp8_state_init(&it->fp8, g);
  return it;
}

void interp_free(Interp *it) {
  if (!it)
    return;
  interp_set_decode(it, 0);
  for (int i = 0; i < it->g->n; i++)
    free(it->val[i]);
  free(it->val);
  free(it->numel);
  free(it->given);
  fp8_state_free(&it->fp8);
  free(it);
}

// The value as the interpreter stores it: rounded to float in INTERP_F32.
static double rnd(const Interp *it, double v) { return it->prec == INTERP_F32 ? (double)(float)v : v; }

double *interp_param(Interp *it, int param_node) { return it->val[param_node]; }

void interp_init_param(Interp *it, uint64_t seed, int k) {
  int id = it->g->params[k];
  const ParamInit *pi = &it->g->nodes[id]->init;
  double *p = it->val[id];
  for (int64_t i = 0; i < it->numel[id]; i++)
    p[i] = rnd(it, mdl_param_init(pi, seed, k, i));
}

void interp_init_params(Interp *it, uint64_t seed) {
  for (int k = 0; k < it->g->nparams; k++)
    interp_init_param(it, seed, k);
}

bool interp_set_input(Interp *it, const char *name, const int32_t *ids, const float *f, int64_t n) {
  bool found = false;
  for (int i = 0; i < it->g->n; i++) {
    const IrNode *nd = it->g->nodes[i];
    if (nd->op != OP_INPUT || !nd->name || strcmp(nd->name, name) != 0)
      continue;
    if (n != it->numel[i] || (nd->dtype == DT_I32 ? !ids : !f))
      return false;
    for (int64_t j = 0; j < n; j++)
      it->val[i][j] = nd->dtype == DT_I32 ? (double)ids[j] : (double)f[j];
    it->given[i] = found = true;
  }
  return found;
}

void interp_set_scalar(Interp *it, const char *name, double v) {
  for (int i = 0; i < it->g->n; i++) {
    const IrNode *nd = it->g->nodes[i];
    if (nd->op == OP_SCALAR && nd->name && strcmp(nd->name, name) == 0) {
      for (int64_t j = 0; j < it->numel[i]; j++)
        it->val[i][j] = rnd(it, v);
      it->given[i] = true;
    }
  }
}

void interp_set_seed(Interp *it, uint64_t seed) { it->seed = seed; }

void interp_set_decode(Interp *it, int64_t max_len) {
  for (int i = 0; it->cache && i < it->g->n; i++)
    free(it->cache[i]);
  free(it->cache);
  it->cache = max_len > 0 ? icalloc((size_t)it->g->n, sizeof *it->cache) : NULL;
  it->decode_len = max_len > 0 ? max_len : 0;
  it->decode_pos = 0;
}

void interp_set_decode_pos(Interp *it, int64_t pos) { it->decode_pos = pos; }

const double *interp_value(Interp *it, int node) { return it->val[node]; }

Fp8State *interp_fp8(Interp *it) { return &it->fp8; }

int64_t interp_numel(Interp *it, int node) { return it->numel[node]; }

//
// Index arithmetic.
//

// Product of the dims in [from, to).
static int64_t span(Shape s, int from, int to) {
  int64_t n = 1;
  for (int i = from; i < to; i++)
    n *= s.d[i];
  return n;
}

// The shape of the leading (batch) axes of a matmul operand: all but the last two.
static Shape batch_shape(Shape s) {
  Shape b = s;
  b.rank = s.rank - 2;
  return b;
}

//
// The ops. Each reads its node, input arrays and output array (already sized) from a Ctx.
//

typedef struct {
  Interp *it;
  const IrNode *nd;
  const double **x; // input values
  const IrNode **xn;
  double *y;
  int64_t n; // numel of y
  char *err;
  size_t errn;
} Ctx;

static bool fail(Ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(Ctx *c, const char *fmt, ...) {
  if (c->err && c->errn) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->errn, fmt, ap);
    va_end(ap);
  }
  return false;
}

static double gelu_grad(double x) {
  double k = sqrt(2 / M_PI), t = tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
}

static double binary(Op op, double a, double b) {
  switch (op) {
  case OP_ABS_BWD: return a > 0 ? b : a < 0 ? -b : 0;
  case OP_ADD: return a + b;
  case OP_SUB: return a - b;
  case OP_MUL: return a * b;
  case OP_DIV: return a / b;
  case OP_MINIMUM: return a != a || b != b ? NAN : a < b ? a : b; // (exact on i32 values too)
  case OP_MAXIMUM: return a != a || b != b ? NAN : a > b ? a : b;
  case OP_RELU_BWD: return a > 0 ? b : 0;
  case OP_GELU_BWD: return gelu_grad(a) * b;
  default: { // OP_SILU_BWD
    double s = interp_unary(OP_SIGMOID, a);
    return b * s * (1 + a * (1 - s));
  }
  }
}

// Integer arithmetic on i32 values (exact in doubles), broadcast as the float ops.
static void run_i32(Ctx *c) {
  Shape out = c->nd->shape;
  for (int64_t i = 0; i < c->n; i++) {
    int32_t a = (int32_t)c->x[0][shape_bcast_offset(out, c->xn[0]->shape, i)];
    int32_t b = c->nd->nin > 1 ? (int32_t)c->x[1][shape_bcast_offset(out, c->xn[1]->shape, i)] : 0;
    c->y[i] = interp_i32(c->nd->op, a, b);
  }
}

static void run_compare_where(Ctx *c) {
  Shape out = c->nd->shape;
  for (int64_t i = 0; i < c->n; i++) {
    double v[3];
    for (int k = 0; k < c->nd->nin; k++)
      v[k] = c->x[k][shape_bcast_offset(out, c->xn[k]->shape, i)];
    c->y[i] = c->nd->op == OP_COMPARE ? interp_compare(c->nd->ia[0], v[0], v[1]) : v[0] != 0 ? v[1] : v[2];
  }
}

static void run_binary(Ctx *c) {
  Shape out = c->nd->shape, sa = c->xn[0]->shape, sb = c->xn[1]->shape;
  for (int64_t i = 0; i < c->n; i++)
    c->y[i] = binary(c->nd->op, c->x[0][shape_bcast_offset(out, sa, i)], c->x[1][shape_bcast_offset(out, sb, i)]);
}

static void run_dropout(Ctx *c) {
  double p = c->it->decode_len ? 0 : c->nd->fa[0];
  uint64_t stream = (uint64_t)c->nd->ia[0];
  for (int64_t i = 0; i < c->n; i++)
    c->y[i] = mdl_rng_uniform(c->it->seed, stream, (uint64_t)i) >= p ? c->x[0][i] / (1 - p) : 0;
}

// SUM / MEAN / MAX over axis ia[0]: the input viewed as [outer, len, inner].
static void run_reduce(Ctx *c) {
  Shape s = c->xn[0]->shape;
  int ax = (int)c->nd->ia[0];
  int64_t outer = span(s, 0, ax), len = s.d[ax], inner = span(s, ax + 1, s.rank);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < inner; i++) {
      const double *x = c->x[0] + o * len * inner + i;
      double acc = c->nd->op == OP_MAX ? -INFINITY : 0;
      for (int64_t j = 0; j < len; j++) {
        double v = x[j * inner];
        if (c->nd->op != OP_MAX)
          acc += v;
        else if (v > acc || isnan(v)) // a NaN wins, as it does in every other reduction
          acc = isnan(acc) ? acc : v;
      }
      c->y[o * inner + i] = c->nd->op == OP_MEAN ? acc / (double)len : acc;
    }
}

// MAX_BWD (x, y, dy): the gradient goes to the maxima; tied maxima share it evenly.
static void run_max_bwd(Ctx *c) {
  Shape s = c->xn[0]->shape;
  int ax = (int)c->nd->ia[0];
  int64_t outer = span(s, 0, ax), len = s.d[ax], inner = span(s, ax + 1, s.rank);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < inner; i++) {
      int64_t base = o * len * inner + i, r = o * inner + i;
      double m = c->x[1][r];
      int64_t ties = 0;
      for (int64_t j = 0; j < len; j++)
        ties += c->x[0][base + j * inner] == m;
      for (int64_t j = 0; j < len; j++)
        c->y[base + j * inner] = c->x[0][base + j * inner] == m ? c->x[2][r] / (double)ties : 0;
    }
}

static void run_permute(Ctx *c) {
  Shape out = c->nd->shape, in = c->xn[0]->shape;
  int64_t in_stride[IR_MAX_RANK];
  for (int k = in.rank - 1; k >= 0; k--)
    in_stride[k] = k == in.rank - 1 ? 1 : in_stride[k + 1] * in.d[k + 1];
  for (int64_t i = 0; i < c->n; i++) {
    int64_t idx = i, off = 0;
    for (int k = out.rank - 1; k >= 0; k--) {
      off += (idx % out.d[k]) * in_stride[c->nd->ia[k]];
      idx /= out.d[k];
    }
    c->y[i] = c->x[0][off];
  }
}

// SLICE copies [start, end) of axis ia[0] out of the input; SLICE_BWD puts dy there in zeros.
static void run_slice(Ctx *c, bool bwd) {
  Shape full = bwd ? c->nd->shape : c->xn[0]->shape;
  int ax = (int)c->nd->ia[0];
  int64_t start = c->nd->ia[1], len = c->nd->ia[2] - start;
  int64_t outer = span(full, 0, ax), flen = full.d[ax], inner = span(full, ax + 1, full.rank);
  if (bwd)
    memset(c->y, 0, (size_t)c->n * sizeof(double));
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < len * inner; j++) {
      int64_t f = (o * flen + start) * inner + j, s = o * len * inner + j;
      if (bwd)
        c->y[f] = c->x[0][s];
      else
        c->y[s] = c->x[0][f];
    }
}

static void run_concat(Ctx *c) {
  Shape out = c->nd->shape;
  int ax = (int)c->nd->ia[0];
  int64_t outer = span(out, 0, ax), olen = out.d[ax], inner = span(out, ax + 1, out.rank), at = 0;
  for (int k = 0; k < c->nd->nin; k++) {
    int64_t len = c->xn[k]->shape.d[ax];
    for (int64_t o = 0; o < outer; o++)
      memcpy(c->y + (o * olen + at) * inner, c->x[k] + o * len * inner,
             (size_t)(len * inner) * sizeof(double));
    at += len;
  }
}

static void run_matmul(Ctx *c) {
  Shape sa = c->xn[0]->shape, sb = c->xn[1]->shape, so = c->nd->shape;
  bool ta = c->nd->ia[0], tb = c->nd->ia[1];
  int64_t m = so.d[so.rank - 2], n = so.d[so.rank - 1];
  int64_t k = ta ? sa.d[sa.rank - 2] : sa.d[sa.rank - 1];
  int64_t batches = span(so, 0, so.rank - 2);
  for (int64_t bi = 0; bi < batches; bi++) {
    const double *a = c->x[0] + shape_bcast_offset(batch_shape(so), batch_shape(sa), bi) * m * k;
    const double *b = c->x[1] + shape_bcast_offset(batch_shape(so), batch_shape(sb), bi) * k * n;
    double *y = c->y + bi * m * n;
    // Row i of y accumulates a[i,l] * b[l,:] for l = 0, 1, ...: each y[i,j] sums over l in order.
    memset(y, 0, (size_t)(m * n) * sizeof(double));
    for (int64_t i = 0; i < m; i++)
      for (int64_t l = 0; l < k; l++) {
        double ail = ta ? a[l * m + i] : a[i * k + l];
        for (int64_t j = 0; j < n; j++)
          y[i * n + j] += ail * (tb ? b[j * k + l] : b[l * n + j]);
      }
  }
  DType da = c->xn[0]->dtype;
  if (da == DT_F8E4M3 || da == DT_F8E5M2) { // the f32 sums, descaled (exact: a power of two)
    const Fp8State *st = &c->it->fp8;
    float inv = (float)(1 / ((double)st->scale[c->nd->ia[2]] * st->scale[c->nd->ia[3]]));
    for (int64_t i = 0; i < c->n; i++)
      c->y[i] = (double)((float)c->y[i] * inv);
  }
}

// CAST to fp8: q = fp8(x * scale), kept as the code's value; max |x| joins the tensor's amax (NaN
// stays NaN).
static void run_cast_fp8(Ctx *c) {
  Fp8State *st = &c->it->fp8;
  int t = (int)c->nd->ia[1];
  float scale = st->scale[t], amax = st->amax[t];
  bool e5 = c->nd->ia[0] == DT_F8E5M2;
  for (int64_t i = 0; i < c->n; i++) {
    float x = (float)c->x[0][i], ax = fabsf(x);
    amax = isnan(ax) || isnan(amax) ? NAN : ax > amax ? ax : amax;
    float sx = x * scale;
    c->y[i] = e5 ? mdl_e5m2_to_f32(mdl_f32_to_e5m2(sx)) : mdl_e4m3_to_f32(mdl_f32_to_e4m3(sx));
  }
  st->amax[t] = amax;
}

static bool check_id(Ctx *c, double id, int64_t v) {
  if (id < 0 || id >= (double)v)
    return fail(c, "embed: id %.0f out of range [0, %lld)", id, (long long)v);
  return true;
}

// EMBED (table [V,C], ids) -> rows of the table; EMBED_BWD (ids, dy) -> scatter-add into [V,C].
static bool run_embed(Ctx *c, bool bwd) {
  Shape tab = bwd ? c->nd->shape : c->xn[0]->shape;
  int64_t v = tab.d[0], dim = tab.d[1];
  const IrNode *ids = c->xn[bwd ? 0 : 1];
  const double *id = c->x[bwd ? 0 : 1];
  int64_t rows = shape_numel(ids->shape);
  if (bwd)
    memset(c->y, 0, (size_t)c->n * sizeof(double));
  for (int64_t r = 0; r < rows; r++) {
    if (!check_id(c, id[r], v))
      return false;
    int64_t t = (int64_t)id[r];
    for (int64_t j = 0; j < dim; j++) {
      if (bwd)
        c->y[t * dim + j] += c->x[1][r * dim + j];
      else
        c->y[r * dim + j] = c->x[0][t * dim + j];
    }
  }
  return true;
}

// TOPK's order: a before b when a is larger, NaN before every number, ties by the lower index.
static bool topk_before(double a, int64_t ia, double b, int64_t ib) {
  if (isnan(a) || isnan(b))
    return isnan(a) && (!isnan(b) || ia < ib);
  return a > b || (a == b && ia < ib);
}

// TOPK: per line along the axis, the k first positions in topk_before's order, found one by one (the
// next is the first of those after the last one found), as the kernels do.
static void run_topk(Ctx *c) {
  Shape xs = c->xn[0]->shape;
  int ax = (int)c->nd->ia[0];
  int64_t k = c->nd->ia[1], len = xs.d[ax], outer = span(xs, 0, ax), inner = span(xs, ax + 1, xs.rank);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < inner; i++) {
      const double *x = c->x[0] + o * len * inner + i;
      int64_t last = -1;
      for (int64_t p = 0; p < k; p++) {
        int64_t best = -1;
        for (int64_t l = 0; l < len; l++)
          if ((last < 0 || topk_before(x[last * inner], last, x[l * inner], l)) &&
              (best < 0 || topk_before(x[l * inner], l, x[best * inner], best)))
            best = l;
        c->y[(o * k + p) * inner + i] = (double)best;
        last = best;
      }
    }
}

// GATHER (x, idx): y at idx along the axis, 0 where idx is outside the axis. idx broadcasts to y.
static void run_gather(Ctx *c) {
  Shape ys = c->nd->shape, xs = c->xn[0]->shape;
  int ax = (int)c->nd->ia[0];
  int64_t ylen = ys.d[ax], xlen = xs.d[ax], inner = span(ys, ax + 1, ys.rank);
  for (int64_t r = 0; r < c->n; r++) {
    double l = c->x[1][shape_bcast_offset(ys, c->xn[1]->shape, r)];
    int64_t o = r / (ylen * inner), i = r % inner;
    c->y[r] = l >= 0 && l < (double)xlen ? c->x[0][(o * xlen + (int64_t)l) * inner + i] : 0;
  }
}

// SCATTER_ADD (base, idx, src) and GATHER_BWD (idx, src) over zeros: src added at idx along the axis,
// nothing where idx is outside it; each sum in increasing order along src's axis, rounded as it goes
// (the kernels' float sums in the same order).
static void run_scatter_add(Ctx *c) {
  bool base = c->nd->op == OP_SCATTER_ADD;
  const IrNode *in = c->xn[base], *src = c->xn[base + 1];
  const double *id = c->x[base], *sv = c->x[base + 1];
  Shape ys = c->nd->shape, ss = src->shape;
  int ax = (int)c->nd->ia[0];
  int64_t ylen = ys.d[ax], slen = ss.d[ax], inner = span(ss, ax + 1, ss.rank);
  if (base)
    memcpy(c->y, c->x[0], (size_t)c->n * sizeof(double));
  else
    memset(c->y, 0, (size_t)c->n * sizeof(double));
  for (int64_t r = 0; r < shape_numel(ss); r++) {
    double l = id[shape_bcast_offset(ss, in->shape, r)];
    int64_t o = r / (slen * inner), i = r % inner;
    if (l >= 0 && l < (double)ylen) {
      double *y = c->y + (o * ylen + (int64_t)l) * inner + i;
      *y = rnd(c->it, *y + sv[r]);
    }
  }
}

// Mean and 1/sqrt(var + eps) of one row (biased variance).
static void row_stats(const double *x, int64_t n, double eps, double *mean, double *rstd) {
  double m = 0, v = 0;
  for (int64_t j = 0; j < n; j++)
    m += x[j];
  m /= (double)n;
  for (int64_t j = 0; j < n; j++)
    v += (x[j] - m) * (x[j] - m);
  *mean = m;
  *rstd = 1 / sqrt(v / (double)n + eps);
}

// The input's last axis as rows: [rows, cols].
static int64_t last_dim(const IrNode *n) { return n->shape.rank ? n->shape.d[n->shape.rank - 1] : 1; }

static void run_layernorm(Ctx *c) {
  int64_t cols = last_dim(c->xn[0]), rows = c->n / cols;
  for (int64_t r = 0; r < rows; r++) {
    const double *x = c->x[0] + r * cols;
    double mean, rstd;
    row_stats(x, cols, c->nd->fa[0], &mean, &rstd);
    for (int64_t j = 0; j < cols; j++)
      c->y[r * cols + j] = (x[j] - mean) * rstd * c->x[1][j] + c->x[2][j];
  }
}

// LAYERNORM_BWD (x, w, dy): which 0 dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w;
// 1 dw = sum over rows of dy xhat; 2 db = sum over rows of dy.
static void run_layernorm_bwd(Ctx *c) {
  int64_t cols = last_dim(c->xn[0]), rows = shape_numel(c->xn[0]->shape) / cols;
  int which = (int)c->nd->ia[0];
  const double *w = c->x[1];
  if (which != 0)
    memset(c->y, 0, (size_t)c->n * sizeof(double));
  for (int64_t r = 0; r < rows; r++) {
    const double *x = c->x[0] + r * cols, *dy = c->x[2] + r * cols;
    double mean, rstd, mg = 0, mgx = 0;
    row_stats(x, cols, c->nd->fa[0], &mean, &rstd);
    for (int64_t j = 0; j < cols; j++) {
      double xhat = (x[j] - mean) * rstd;
      if (which == 1)
        c->y[j] += dy[j] * xhat;
      else if (which == 2)
        c->y[j] += dy[j];
      mg += dy[j] * w[j];
      mgx += dy[j] * w[j] * xhat;
    }
    if (which != 0)
      continue;
    mg /= (double)cols;
    mgx /= (double)cols;
    for (int64_t j = 0; j < cols; j++)
      c->y[r * cols + j] = rstd * (dy[j] * w[j] - mg - (x[j] - mean) * rstd * mgx);
  }
}

static double rms_scale(const double *x, int64_t n, double eps) {
  double ms = 0;
  for (int64_t j = 0; j < n; j++)
    ms += x[j] * x[j];
  return 1 / sqrt(ms / (double)n + eps);
}

static void run_rmsnorm(Ctx *c) {
  int64_t cols = last_dim(c->xn[0]), rows = c->n / cols;
  for (int64_t r = 0; r < rows; r++) {
    const double *x = c->x[0] + r * cols;
    double s = rms_scale(x, cols, c->nd->fa[0]);
    for (int64_t j = 0; j < cols; j++)
      c->y[r * cols + j] = x[j] * s * c->x[1][j];
  }
}

// RMSNORM_BWD (x, w, dy): which 0 dx = s g - s^3 x mean(g x) with g = dy w, s = 1/rms;
// 1 dw = sum over rows of dy x s.
static void run_rmsnorm_bwd(Ctx *c) {
  int64_t cols = last_dim(c->xn[0]), rows = shape_numel(c->xn[0]->shape) / cols;
  bool dw = c->nd->ia[0] == 1;
  const double *w = c->x[1];
  if (dw)
    memset(c->y, 0, (size_t)c->n * sizeof(double));
  for (int64_t r = 0; r < rows; r++) {
    const double *x = c->x[0] + r * cols, *dy = c->x[2] + r * cols;
    double s = rms_scale(x, cols, c->nd->fa[0]), mgx = 0;
    for (int64_t j = 0; j < cols; j++) {
      mgx += dy[j] * w[j] * x[j];
      if (dw)
        c->y[j] += dy[j] * x[j] * s;
    }
    mgx /= (double)cols;
    for (int64_t j = 0; j < cols && !dw; j++)
      c->y[r * cols + j] = s * dy[j] * w[j] - s * s * s * x[j] * mgx;
  }
}

// Softmax of one row of n values into p.
static void softmax_row(const double *x, int64_t n, double *p) {
  double m = -INFINITY, sum = 0;
  for (int64_t j = 0; j < n; j++)
    m = fmax(m, x[j]);
  for (int64_t j = 0; j < n; j++)
    sum += p[j] = exp(x[j] - m);
  for (int64_t j = 0; j < n; j++)
    p[j] /= sum;
}

static void run_softmax(Ctx *c) {
  int64_t cols = last_dim(c->xn[0]);
  for (int64_t r = 0; r < c->n / cols; r++)
    softmax_row(c->x[0] + r * cols, cols, c->y + r * cols);
}

static void run_softmax_bwd(Ctx *c) {
  int64_t cols = last_dim(c->xn[0]);
  for (int64_t r = 0; r < c->n / cols; r++) {
    const double *y = c->x[0] + r * cols, *dy = c->x[1] + r * cols;
    double dot = 0;
    for (int64_t j = 0; j < cols; j++)
      dot += y[j] * dy[j];
    for (int64_t j = 0; j < cols; j++)
      c->y[r * cols + j] = y[j] * (dy[j] - dot);
  }
}

// CROSS_ENTROPY (logits, targets) -> -log softmax[target] per row; CROSS_ENTROPY_BWD (logits,
// targets, dloss) -> dloss (softmax - onehot). A negative target is ignored (loss 0, gradient 0).
static bool run_cross_entropy(Ctx *c, bool bwd) {
  int64_t v = last_dim(c->xn[0]), rows = shape_numel(c->xn[1]->shape);
  double *p = icalloc((size_t)v, sizeof(double));
  bool ok = true;
  for (int64_t r = 0; r < rows && ok; r++) {
    const double *x = c->x[0] + r * v;
    double t = c->x[1][r];
    if (t >= (double)v) {
      ok = fail(c, "cross_entropy: target %.0f out of range [0, %lld)", t, (long long)v);
      break;
    }
    if (!bwd) {
      c->y[r] = 0;
      if (t >= 0) {
        double m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < v; j++)
          m = fmax(m, x[j]);
        for (int64_t j = 0; j < v; j++)
          sum += exp(x[j] - m);
        c->y[r] = m + log(sum) - x[(int64_t)t];
      }
      continue;
    }
    softmax_row(x, v, p);
    for (int64_t j = 0; j < v; j++)
      c->y[r * v + j] = t < 0 ? 0 : c->x[2][r] * (p[j] - (j == (int64_t)t));
  }
  free(p);
  return ok;
}

// TARGET_COUNT (targets) -> how many targets are >= 0, at least 1.
static void run_target_count(Ctx *c) {
  int64_t n = shape_numel(c->xn[0]->shape), count = 0;
  for (int64_t i = 0; i < n; i++)
    count += c->x[0][i] >= 0;
  c->y[0] = count > 1 ? (double)count : 1;
}

// ATTENTION, ATTENTION_LSE and ATTENTION_BWD. For each (batch b, head h) the scores s_ij = scale
// q_i . k_j over the allowed j are turned into probabilities P by a softmax per row i; out_i = sum_j
// P_ij v_j and lse_i = log sum_j exp(s_ij). The backward takes P = exp(s - lse) from the forward's
// lse: dv_j = sum_i P_ij dout_i; dP_ij = dout_i . v_j; dS_ij = P_ij (dP_ij - D_i) with D_i = dout_i .
// out_i (the forward's output, = sum_j P_ij dP_ij); dq_i = scale sum_j dS_ij k_j; dk_j = scale
// sum_i dS_ij q_i. Head h reads kv head h / (H/KH) of k and v ([B,S,KH*D]), so dk and dv of a kv
// head sum over the query heads of its group.
typedef enum { ATT_OUT, ATT_LSE, ATT_BWD } AttWhat;

static void run_attention(Ctx *c, AttWhat what) {
  Shape s = c->xn[0]->shape;
  int64_t nb = s.d[0], nt = s.d[1], nc = s.d[2], heads = c->nd->ia[0], d = nc / heads;
  int64_t ns = c->xn[1]->shape.d[1], kvh = att_kv_heads(c->nd), nckv = kvh * d, grp = heads / kvh;
  int64_t window = c->nd->ia[6];
  bool causal = c->nd->ia[1], has_doc = c->nd->ia[2], bwd = what == ATT_BWD;
  int which = (int)c->nd->ia[3], nin = c->nd->nin;
  double scale = c->nd->fa[0];
  const double *q = c->x[0], *k = c->x[1], *v = c->x[2];
  const double *doc = has_doc ? c->x[3] : NULL, *out = bwd ? c->x[nin - 3] : NULL, *lse = bwd ? c->x[nin - 2] : NULL,
               *dout = bwd ? c->x[nin - 1] : NULL;
  // bf16 (mdl.h): the products read q, k, v rounded; the forward's P V reads e rounded too, and
  // the backward's read dout, P and dS rounded, and D reads dout and out rounded.
  bool bf16 = c->nd->ia[4] == DT_BF16;
  double *rounded = NULL, *rounded_bwd = NULL, *l = icalloc((size_t)nt, sizeof(double));
  if (bf16) {
    size_t n = (size_t)(nb * nt * nc), m = (size_t)(nb * ns * nckv);
    rounded = icalloc(n + 2 * m, sizeof(double));
    for (size_t i = 0; i < n; i++)
      rounded[i] = round_bf16(q[i]);
    for (size_t i = 0; i < m; i++) {
      rounded[n + i] = round_bf16(k[i]);
      rounded[n + m + i] = round_bf16(v[i]);
    }
    q = rounded, k = rounded + n, v = rounded + n + m;
  }
  if (bf16 && bwd) {
    size_t n = (size_t)(nb * nt * nc);
    double *r = icalloc(2 * n, sizeof(double));
    for (size_t i = 0; i < n; i++) {
      r[i] = round_bf16(dout[i]);
      r[n + i] = round_bf16(out[i]);
    }
    dout = rounded_bwd = r, out = r + n;
  }
  double *p = icalloc((size_t)(nt * ns), sizeof(double));
  double *ds = icalloc((size_t)(nt * ns), sizeof(double));
  memset(c->y, 0, (size_t)c->n * sizeof(double));
  for (int64_t b = 0; b < nb; b++)
    for (int64_t h = 0; h < heads; h++) {
      // Element (t, e) of head h in batch b of q, out or dout [B,T,C], of its kv head in k or v
      // [B,S,KH*D]; row t of the [B,H,T] statistics.
#define AT(t, e) (((b)*nt + (t)) * nc + h * d + (e))
#define KV(t, e) (((b)*ns + (t)) * nckv + h / grp * d + (e))
#define ROW(t) ((b * heads + h) * nt + (t))
      for (int64_t i = 0; i < nt; i++) {
        double m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < ns; j++) {
          bool allowed = (!causal || j <= i) && (!window || i - j < window) &&
                         (!doc || doc[b * nt + j] == doc[b * nt + i]);
          double sc = -INFINITY;
          if (allowed) {
            sc = 0;
            for (int64_t e = 0; e < d; e++)
              sc += q[AT(i, e)] * k[KV(j, e)];
            sc *= scale;
          }
          p[i * ns + j] = sc;
          m = fmax(m, sc);
        }
        if (bwd) { // P from the forward's statistics
          for (int64_t j = 0; j < ns; j++)
            p[i * ns + j] = p[i * ns + j] == -INFINITY ? 0 : exp(p[i * ns + j] - lse[ROW(i)]);
          continue;
        }
        for (int64_t j = 0; j < ns; j++)
          sum += p[i * ns + j] = p[i * ns + j] == -INFINITY ? 0 : exp(p[i * ns + j] - m);
        l[i] = sum;
        if (what == ATT_LSE)
          c->y[ROW(i)] = m + log(sum);
        else if (!bf16)
          for (int64_t j = 0; j < ns; j++)
            p[i * ns + j] /= sum;
      }
      if (what == ATT_LSE)
        continue;
      if (!bwd) { // bf16: p holds e = exp(S - max), rounded here, divided by l at the end
        for (int64_t i = 0; i < nt; i++) {
          for (int64_t j = 0; j < ns; j++) {
            double pij = bf16 ? round_bf16(p[i * ns + j]) : p[i * ns + j];
            for (int64_t e = 0; e < d; e++)
              c->y[AT(i, e)] += pij * v[KV(j, e)];
          }
          for (int64_t e = 0; bf16 && e < d; e++)
            c->y[AT(i, e)] /= l[i];
        }
        continue;
      }
      for (int64_t i = 0; i < nt; i++) {
        double dot = 0;
        for (int64_t e = 0; e < d; e++)
          dot += dout[AT(i, e)] * out[AT(i, e)];
        for (int64_t j = 0; j < ns; j++) {
          double dp = 0;
          for (int64_t e = 0; e < d; e++)
            dp += dout[AT(i, e)] * v[KV(j, e)];
          ds[i * ns + j] = p[i * ns + j] * (dp - dot);
        }
      }
      for (int64_t i = 0; i < nt; i++)
        for (int64_t j = 0; j < ns; j++) {
          double dsij = bf16 ? round_bf16(ds[i * ns + j]) : ds[i * ns + j];
          double pij = bf16 ? round_bf16(p[i * ns + j]) : p[i * ns + j];
          for (int64_t e = 0; e < d; e++) {
            if (which == 0)
              c->y[AT(i, e)] += scale * dsij * k[KV(j, e)];
            else if (which == 1)
              c->y[KV(j, e)] += scale * dsij * q[AT(i, e)];
            else
              c->y[KV(j, e)] += pij * dout[AT(i, e)];
          }
        }
#undef AT
#undef KV
#undef ROW
    }
  free(p);
  free(ds);
  free(l);
  free(rounded);
  free(rounded_bwd);
}

// ATTENTION in decode mode: q is the row [1,1,H*D] of the token at position p, k and v its rows
// [1,1,KH*D]. Its k and v rows go to row p of the node's cache (KH heads; allocated on first use),
// then per head its q attends over cache rows [0, p] (the last `window` of them with a window) of its
// kv head as row p of run_attention does: the same sums in the same order. Causal only; doc ids are
// not read (the sequence is one document).
static bool run_attention_decode(Ctx *c) {
  Interp *it = c->it;
  Shape s = c->xn[0]->shape;
  int64_t p = it->decode_pos, nc = s.d[2], heads = c->nd->ia[0], d = nc / heads, len = it->decode_len;
  int64_t nckv = att_kv_heads(c->nd) * d, grp = heads / att_kv_heads(c->nd), window = c->nd->ia[6];
  double scale = c->nd->fa[0];
  if (s.d[0] != 1 || s.d[1] != 1)
    return fail(c, "attention: decode mode wants one token (B = T = 1), got [%lld,%lld,%lld]", (long long)s.d[0],
                (long long)s.d[1], (long long)nc);
  if (!c->nd->ia[1])
    return fail(c, "attention: decode mode needs causal attention");
  if (p < 0 || p >= len)
    return fail(c, "attention: decode position %lld is outside the cache's %lld rows", (long long)p, (long long)len);
  if (!it->cache[c->nd->id])
    it->cache[c->nd->id] = icalloc((size_t)(2 * len * nckv), sizeof(double));
  double *kc = it->cache[c->nd->id], *vc = kc + len * nckv;
  memcpy(kc + p * nckv, c->x[1], (size_t)nckv * sizeof(double));
  memcpy(vc + p * nckv, c->x[2], (size_t)nckv * sizeof(double));
  const double *q = c->x[0];
  int64_t j0 = window && p - window + 1 > 0 ? p - window + 1 : 0; // the first key the window holds
  double *w = icalloc((size_t)(p + 1), sizeof(double));
  memset(c->y, 0, (size_t)nc * sizeof(double));
  for (int64_t h = 0; h < heads; h++) {
    double m = -INFINITY, sum = 0;
    int64_t kh = h / grp * d;
    for (int64_t j = j0; j <= p; j++) {
      double sc = 0;
      for (int64_t e = 0; e < d; e++)
        sc += q[h * d + e] * kc[j * nckv + kh + e];
      w[j] = sc * scale;
      m = fmax(m, w[j]);
    }
    for (int64_t j = j0; j <= p; j++)
      sum += w[j] = exp(w[j] - m);
    for (int64_t j = j0; j <= p; j++)
      w[j] /= sum;
    for (int64_t j = j0; j <= p; j++)
      for (int64_t e = 0; e < d; e++)
        c->y[h * d + e] += w[j] * vc[j * nckv + kh + e];
  }
  free(w);
  return true;
}

// ATTENTION_MASK ([doc]) -> [B or 1, 1, T, T]: 0 where row i may see key j, as run_attention allows it
// (j <= i when causal, i - j < window with a window, the same doc id when there are ids), -inf
// elsewhere.
static void run_attention_mask(Ctx *c) {
  Shape s = c->nd->shape;
  int64_t nb = s.d[0], nt = s.d[2];
  bool causal = c->nd->ia[0];
  int64_t window = c->nd->ia[2];
  const double *doc = c->nd->ia[1] ? c->x[0] : NULL;
  for (int64_t b = 0; b < nb; b++)
    for (int64_t i = 0; i < nt; i++)
      for (int64_t j = 0; j < nt; j++) {
        bool allowed = (!causal || j <= i) && (!window || i - j < window) &&
                       (!doc || doc[b * nt + j] == doc[b * nt + i]);
        c->y[(b * nt + i) * nt + j] = allowed ? 0 : -INFINITY;
      }
}

// ROPE: per head, the pair (i, i + D/2) rotated by theta = pos * base^(-2i/D) (by -theta when
// inverse).
static void run_rope(Ctx *c) {
  Shape s = c->xn[0]->shape;
  int64_t rows = s.d[0] * s.d[1], nc = s.d[2], heads = c->nd->ia[0], d = nc / heads;
  double sign = c->nd->ia[1] ? -1 : 1, base = c->nd->fa[0];
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < heads; h++)
      for (int64_t i = 0; i < d / 2; i++) {
        double th = sign * c->x[1][r] * pow(base, -2.0 * (double)i / (double)d);
        int64_t a = r * nc + h * d + i, b = a + d / 2;
        double x1 = c->x[0][a], x2 = c->x[0][b];
        c->y[a] = x1 * cos(th) - x2 * sin(th);
        c->y[b] = x1 * sin(th) + x2 * cos(th);
      }
}

static void run_grad_norm(Ctx *c) {
  double ss = 0;
  for (int k = 0; k < c->nd->nin; k++)
    for (int64_t i = 0; i < shape_numel(c->xn[k]->shape); i++)
      ss += c->x[k][i] * c->x[k][i];
  c->y[0] = sqrt(ss);
}

// ADAMW (p, g, [m, [v,]] gnorm, lr, step): one parameter's update by its rule (ia[0]), with optional
// global-norm clipping (g scaled by s) and its lr multiplied by fa[5] (lr_scale). Writes the
// parameter and its moments in place; the node's own value is the new parameter.
//   adamw: PyTorch's AdamW: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2,
//          p -= lr (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd p)
//   sgd:   PyTorch's SGD (dampening 0): d = g + wd p (weight decay as an L2 term of the gradient);
//          with momentum mu: m = mu m + d, then d = m, or with Nesterov d + mu m; p -= lr d
//   lion:  Chen et al. 2023: u = sign(b1 m + (1-b1) g), p -= lr (u + wd p), m = b2 m + (1-b2) g
//   muon:  (p, g, m, u, ...) u the orthogonalised momentum, scaled (autodiff.c's muon_ortho):
//          m = b1 m + (1-b1) g, p -= lr (u + wd p)
static void run_adamw(Ctx *c) {
  Interp *it = c->it;
  const IrNode *nd = c->nd;
  const double *fa = nd->fa;
  double b1 = fa[0], b2 = fa[1], eps = fa[2], wd = fa[3], clip = fa[4];
  double gnorm = it->val[opt_gnorm(nd)][0], step = it->val[opt_step(nd)][0];
  double lr = it->val[opt_lr(nd)][0] * opt_lr_scale(nd);
  double s = clip > 0 ? fmin(1, clip / (gnorm + 1e-6)) : 1;
  double *p = it->val[nd->in[0]];
  double *m = opt_m(nd) >= 0 ? it->val[opt_m(nd)] : NULL, *v = opt_v(nd) >= 0 ? it->val[opt_v(nd)] : NULL;
  const double *g = c->x[1];
  // A loss or gradient norm that is not finite (as f32, as the runtime reads them) leaves p and its
  // moments as they were, as the compiled optimizers do (emit_c.c, emit_cuda.c): the runtime then
  // stops or skips the step with the last finite weights.
  double loss = it->g->loss >= 0 && it->val[it->g->loss] ? it->val[it->g->loss][0] : 0;
  if (!isfinite((float)gnorm) || !isfinite((float)loss)) {
    memcpy(c->y, p, sizeof(double) * (size_t)c->n);
    return;
  }
  for (int64_t i = 0; i < c->n; i++) {
    double gi = s * g[i];
    if (nd->ia[0] == OPT_SGD) {
      double d = gi + wd * p[i];
      if (m) {
        m[i] = rnd(it, b1 * m[i] + d);
        d = b2 != 0 ? d + b1 * m[i] : m[i];
      }
      p[i] = rnd(it, p[i] - lr * d);
    } else if (nd->ia[0] == OPT_MUON) {
      m[i] = rnd(it, b1 * m[i] + (1 - b1) * gi);
      p[i] = rnd(it, p[i] - lr * (c->x[3][i] + wd * p[i]));
    } else if (nd->ia[0] == OPT_LION) {
      double u = b1 * m[i] + (1 - b1) * gi;
      p[i] = rnd(it, p[i] - lr * ((u > 0) - (u < 0) + wd * p[i]));
      m[i] = rnd(it, b2 * m[i] + (1 - b2) * gi);
    } else {
      m[i] = rnd(it, b1 * m[i] + (1 - b1) * gi);
      v[i] = rnd(it, b2 * v[i] + (1 - b2) * gi * gi);
      double mhat = m[i] / (1 - pow(b1, step)), vhat = v[i] / (1 - pow(b2, step));
      p[i] = rnd(it, p[i] - lr * (mhat / (sqrt(vhat) + eps) + wd * p[i]));
    }
    c->y[i] = p[i];
  }
}

// Runs one node. Leaves hold their values already (or fail when never given one).
static bool run_node(Ctx *c) {
  const IrNode *nd = c->nd;
  if (nd->dtype == DT_I32 && (nd->op == OP_NEG || nd->op == OP_ABS || nd->op == OP_ADD || nd->op == OP_SUB ||
                              nd->op == OP_MUL)) {
    run_i32(c);
    return true;
  }
  switch (nd->op) {
  case OP_INPUT:
  case OP_SCALAR:
    if (!c->it->given[nd->id])
      return fail(c, "%s '%s' was never set", op_name(nd->op), nd->name ? nd->name : "?");
    return true;
  case OP_PARAM:
  case OP_STATE:
    return true;
  case OP_CONST:
    for (int64_t i = 0; i < c->n; i++)
      c->y[i] = nd->fa[0];
    return true;
  case OP_NEG: case OP_EXP: case OP_LOG: case OP_TANH: case OP_SQRT: case OP_RSQRT:
  case OP_RELU: case OP_GELU: case OP_SILU: case OP_SIGMOID: case OP_ABS: case OP_STOP_GRADIENT:
    for (int64_t i = 0; i < c->n; i++)
      c->y[i] = interp_unary(nd->op, c->x[0][i]);
    return true;
  case OP_CLAMP: // (the bounds as the compiled code holds them: f32)
    for (int64_t i = 0; i < c->n; i++) {
      double x = c->x[0][i], lo = (float)nd->fa[0], hi = (float)nd->fa[1];
      c->y[i] = x < lo ? lo : x > hi ? hi : x;
    }
    return true;
  case OP_CLAMP_BWD:
    for (int64_t i = 0; i < c->n; i++) {
      double x = c->x[0][i];
      c->y[i] = x >= (float)nd->fa[0] && x <= (float)nd->fa[1] ? c->x[1][i] : 0;
    }
    return true;
  case OP_DROPOUT: run_dropout(c); return true;
  case OP_CAST:
    if (nd->ia[0] == DT_F8E4M3 || nd->ia[0] == DT_F8E5M2) {
      run_cast_fp8(c);
      return true;
    }
    for (int64_t i = 0; i < c->n; i++)
      c->y[i] = nd->ia[0] == DT_BF16 ? round_bf16(c->x[0][i])
                : nd->ia[0] == DT_I32 ? interp_to_i32(c->x[0][i])
                                      : (double)(float)c->x[0][i];
    return true;
  case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_MINIMUM: case OP_MAXIMUM:
  case OP_RELU_BWD: case OP_GELU_BWD: case OP_SILU_BWD: case OP_ABS_BWD:
    run_binary(c);
    return true;
  case OP_COMPARE: case OP_WHERE: run_compare_where(c); return true;
  case OP_FLOORDIV: case OP_MOD: run_i32(c); return true;
  case OP_SUM: case OP_MEAN: case OP_MAX: run_reduce(c); return true;
  case OP_MAX_BWD: run_max_bwd(c); return true;
  case OP_RESHAPE:
    memcpy(c->y, c->x[0], (size_t)c->n * sizeof(double));
    return true;
  case OP_PERMUTE: run_permute(c); return true;
  case OP_BROADCAST:
    for (int64_t i = 0; i < c->n; i++)
      c->y[i] = c->x[0][shape_bcast_offset(nd->shape, c->xn[0]->shape, i)];
    return true;
  case OP_SLICE: run_slice(c, false); return true;
  case OP_SLICE_BWD: run_slice(c, true); return true;
  case OP_CONCAT: run_concat(c); return true;
  case OP_MATMUL: run_matmul(c); return true;
  case OP_EMBED: return run_embed(c, false);
  case OP_EMBED_BWD: return run_embed(c, true);
  case OP_TOPK: run_topk(c); return true;
  case OP_GATHER: run_gather(c); return true;
  case OP_GATHER_BWD: case OP_SCATTER_ADD: run_scatter_add(c); return true;
  case OP_LAYERNORM: run_layernorm(c); return true;
  case OP_LAYERNORM_BWD: run_layernorm_bwd(c); return true;
  case OP_RMSNORM: run_rmsnorm(c); return true;
  case OP_RMSNORM_BWD: run_rmsnorm_bwd(c); return true;
  case OP_SOFTMAX: run_softmax(c); return true;
  case OP_SOFTMAX_BWD: run_softmax_bwd(c); return true;
  case OP_CROSS_ENTROPY: return run_cross_entropy(c, false);
  case OP_CROSS_ENTROPY_BWD: return run_cross_entropy(c, true);
  case OP_TARGET_COUNT: run_target_count(c); return true;
  case OP_ATTENTION:
    if (c->it->decode_len)
      return run_attention_decode(c);
    run_attention(c, ATT_OUT);
    return true;
  case OP_ATTENTION_LSE: case OP_ATTENTION_BWD:
    if (c->it->decode_len)
      return fail(c, "%s: there is no backward in decode mode", op_name(nd->op));
    run_attention(c, nd->op == OP_ATTENTION_LSE ? ATT_LSE : ATT_BWD);
    return true;
  case OP_ATTENTION_MASK: run_attention_mask(c); return true;
  case OP_ROPE: run_rope(c); return true;
  case OP_GRAD_NORM: // (NaN after a non-finite fp8 amax: the optimizer skips the step)
    run_grad_norm(c);
    if (c->it->fp8.n && fp8_state_check(&c->it->fp8, c->it->g, (char[8]){0}, 8))
      c->y[0] = NAN;
    return true;
  case OP_ADAMW: run_adamw(c); return true;
  case OP_COUNT: break;
  }
  return fail(c, "node %d: unknown op %d", nd->id, (int)nd->op);
}

static bool run_nodes(Interp *it, int from, int end, char *err, size_t n);

bool interp_run(Interp *it, int end, char *err, size_t n) {
  const Graph *g = it->g;
  if (end < 0 || end > g->n) {
    if (err && n)
      snprintf(err, n, "interp_run: end %d is outside [0, %d]", end, g->n);
    return false;
  }
  Fp8State *st = &it->fp8;
  if (!st->n || end < g->n)
    return run_nodes(it, 0, end, err, n);
  memset(st->amax, 0, sizeof(float) * (size_t)st->n);
  if (!st->recorded) { // calibration: the amaxes of this step, with every scale 1, and no update
    int upto = 0;
    while (upto < g->n && g->nodes[upto]->op != OP_ADAMW)
      upto++;
    char why[8];
    if (!run_nodes(it, 0, upto, err, n) || !fp8_state_update(st, g, why, sizeof why))
      return run_nodes(it, 0, end, err, n); // (a non-finite amax: the step is skipped, and reported)
    memset(st->amax, 0, sizeof(float) * (size_t)st->n);
  }
  if (!run_nodes(it, 0, end, err, n))
    return false;
  char why[8];
  fp8_state_update(st, g, why, sizeof why); // (false: the optimizer skipped the step; the amaxes say why)
  return true;
}

bool interp_run_nodes(Interp *it, int from, int end, char *err, size_t n) {
  if (from < 0 || from > end || end > it->g->n) {
    if (err && n)
      snprintf(err, n, "interp_run_nodes: [%d, %d) is not inside [0, %d]", from, end, it->g->n);
    return false;
  }
  return run_nodes(it, from, end, err, n);
}

static bool run_nodes(Interp *it, int from, int end, char *err, size_t n) {
  const Graph *g = it->g;
  for (int id = from; id < end; id++) {
    const IrNode *nd = g->nodes[id];
    const double *x[nd->nin > 0 ? nd->nin : 1];
    const IrNode *xn[nd->nin > 0 ? nd->nin : 1];
    for (int k = 0; k < nd->nin; k++) {
      x[k] = it->val[nd->in[k]];
      xn[k] = g->nodes[nd->in[k]];
    }
    Ctx c = {it, nd, x, xn, it->val[id], it->numel[id], err, n};
    if (!run_node(&c))
      return false;
    bool leaf = nd->op == OP_INPUT || nd->op == OP_PARAM || nd->op == OP_STATE || nd->op == OP_SCALAR;
    if (it->prec == INTERP_F32 && !leaf && nd->dtype != DT_I32)
      for (int64_t i = 0; i < c.n; i++)
        c.y[i] = (double)(float)c.y[i];
  }
  return true;
}
