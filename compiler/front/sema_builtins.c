// sema_builtins.c: the built-in ops (gelu ... conv1d, the table at the bottom): each gets its
// arguments already evaluated (sema_eval.c evaluates them as the table says) and appends the graph
// nodes that compute it. Also the node building the evaluator shares (sema_add_op, sema_reshape, a scalar
// operand as a CONST) and the matching of a call's arguments to a builtin's parameters.
#include "sema_impl.h"

#include <math.h>
#include <string.h>

// Appends an op; ir.c's shape and dtype errors are reported at the op the user wrote.
Val sema_add_op(Sema *s, Op op, const int *in, int nin, const int64_t ia[IR_NIA], const double fa[IR_NFA],
                SrcLoc at) {
  int id = ir_add(s->g, op, in, nin, ia, fa, at);
  if (id < 0) {
    sema_error(s, at, "%s", s->g->err);
    return ERR;
  }
  return tensor_val(id);
}

Val sema_reshape(Sema *s, int x, Shape sh, SrcLoc at) {
  int id = ir_reshape(s->g, x, sh, at);
  if (id < 0) {
    sema_error(s, at, "%s", s->g->err);
    return ERR;
  }
  return tensor_val(id);
}

// A scalar operand of a tensor op becomes a CONST node.
static int as_node(Sema *s, Val v, SrcLoc at) {
  if (v.kind == V_TENSOR)
    return v.node;
  int id = ir_const(s->g, v.kind == V_INT ? (double)v.i : v.f, at);
  if (id < 0)
    sema_error(s, at, "%s", s->g->err);
  return id;
}

// The nodes of the operands v[0 .. n) of an elementwise op (`what` names it in messages, `at` its
// place, vat[k] each operand's): numbers become CONSTs, of i32 where a tensor operand is i32
// (integer arithmetic), else of f32. i32 and f32 tensors together, or a float number beside an i32
// tensor, is an error naming both.
bool sema_operand_nodes(Sema *s, const char *what, SrcLoc at, const Val *v, const SrcLoc *vat, int n, int *out) {
  const IrNode *i32 = NULL, *other = NULL;
  for (int k = 0; k < n; k++)
    if (v[k].kind == V_TENSOR) {
      if (node(s, v[k].node)->dtype == DT_I32)
        i32 = node(s, v[k].node);
      else
        other = node(s, v[k].node);
    }
  if (i32 && other) {
    sema_error(s, at, "%s mixes i32 and %s tensors; convert one with float(x) or int(x)", what,
               dtype_name(other->dtype));
    return false;
  }
  for (int k = 0; k < n; k++) {
    if (v[k].kind == V_TENSOR) {
      out[k] = v[k].node;
    } else if (!i32) {
      if ((out[k] = as_node(s, v[k], vat[k])) < 0)
        return false;
    } else if (v[k].kind == V_FLOAT) {
      sema_error(s, vat[k], "%s mixes an i32 tensor and the float number %g; convert the tensor with float(x)", what,
                 v[k].f);
      return false;
    } else if (v[k].i < INT32_MIN || v[k].i > INT32_MAX) {
      sema_error(s, vat[k], "%s: %lld does not fit in i32, the tensor's dtype", what, (long long)v[k].i);
      return false;
    } else if ((out[k] = ir_const_i32(s->g, (int32_t)v[k].i, vat[k])) < 0) {
      sema_error(s, vat[k], "%s", s->g->err);
      return false;
    }
  }
  return true;
}

//
// Built-in ops
//

static int nparams(const Builtin *b) {
  int n = 0;
  while (n < BUILTIN_PARAMS && b->params[n])
    n++;
  return n;
}

// Matches a call's arguments to b's parameters: arg[k] is the expression given for params[k],
// or NULL. Reports wrong counts, unknown and repeated keywords.
bool sema_bind_args(Sema *s, const Builtin *b, const Expr *call, const Expr **arg) {
  int np = nparams(b), npos = 0, got = 0;
  bool ok = true, keywords = false;
  for (int k = 0; k < BUILTIN_PARAMS; k++)
    arg[k] = NULL;
  for (int i = 0; i < call->nargs; i++) {
    if (!call->kw[i]) {
      if (keywords) {
        sema_error(s, call->args[i]->at, "%s: positional argument after keyword arguments", b->name);
        ok = false;
      } else if (npos < b->max) {
        arg[npos] = call->args[i];
      }
      npos++;
      continue;
    }
    keywords = true;
    int k = 0;
    while (k < np && strcmp(b->params[k], call->kw[i]))
      k++;
    if (k == np) {
      char known[160] = "";
      for (int j = 0; j < np; j++)
        snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", j ? ", " : "", b->params[j]);
      sema_error(s, call->kw_at[i], "%s: unknown keyword argument '%s' (%s takes %s)", b->name, call->kw[i], b->name,
                 np ? known : "none");
      ok = false;
    } else if (arg[k]) {
      sema_error(s, call->kw_at[i], "%s: argument '%s' given twice", b->name, call->kw[i]);
      ok = false;
    } else {
      arg[k] = call->args[i];
    }
  }
  bool missing = false;
  for (int k = 0; k < b->max; k++) {
    got += arg[k] != NULL;
    missing |= k < b->min && !arg[k];
  }
  if (npos > b->max)
    got += npos - b->max;
  if (ok && (missing || npos > b->max)) {
    char hint[128] = "";
    if (npos > b->max && b->max < np)
      snprintf(hint, sizeof hint, " (%s is a keyword argument: %s=...)", b->params[b->max], b->params[b->max]);
    if (b->min == b->max)
      sema_error(s, call->at, "%s takes %d argument%s, got %d%s", b->name, b->min, b->min == 1 ? "" : "s", got, hint);
    else
      sema_error(s, call->at, "%s takes %d to %d arguments, got %d%s", b->name, b->min, b->max, got, hint);
    ok = false;
  }
  return ok;
}

// An evaluated argument, or dflt where it was left out.
static int64_t int_or(const Arg *a, int64_t dflt) { return a->v.kind == V_INT ? a->v.i : dflt; }
static double float_or(const Arg *a, double dflt) { return a->v.kind == V_FLOAT ? a->v.f : dflt; }
static bool bool_or(const Arg *a, bool dflt) { return a->v.kind == V_BOOL ? a->v.i != 0 : dflt; }

// An axis of a tensor of the given rank (e: the argument, a: its value, dflt where it is left out);
// negative axes count from the end.
static bool axis_arg(Sema *s, const Builtin *b, const Expr *e, const Arg *v, int64_t dflt, int rank, SrcLoc at,
                     int64_t *out) {
  int64_t a = int_or(v, dflt);
  int64_t k = a < 0 ? a + rank : a;
  if (k < 0 || k >= rank) {
    sema_error(s, e ? e->at : at, "%s: axis %lld is out of range for a tensor of rank %d", b->name, (long long)a, rank);
    return false;
  }
  *out = k;
  return true;
}

static bool need_i32(Sema *s, const Builtin *b, int x, const char *what, SrcLoc at) {
  if (node(s, x)->dtype == DT_I32)
    return true;
  sema_error(s, at, "%s: %s must be i32, got %s", b->name, what, dtype_name(node(s, x)->dtype));
  return false;
}

// gelu relu silu exp log tanh sqrt rsqrt neg: elementwise on tensors, folded on scalars.
static Val builtin_unary(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)arg;
  Val v = val[0].v;
  if (v.kind == V_TENSOR)
    return sema_add_op(s, b->op, &v.node, 1, NULL, NULL, call->at);
  if (v.kind == V_INT && (b->op == OP_ABS || b->op == OP_NEG) && v.i != INT64_MIN) // an integer stays one
    return int_val(b->op == OP_NEG || v.i < 0 ? -v.i : v.i);
  double x = v.kind == V_INT ? (double)v.i : v.f;
  if (((b->op == OP_SQRT || b->op == OP_RSQRT) && x < 0) || (b->op == OP_LOG && x <= 0) ||
      (b->op == OP_RSQRT && x == 0)) {
    sema_error(s, call->at, "%s(%g) is not a real number", b->name, x);
    return ERR;
  }
  return float_val(interp_unary(b->op, x));
}

// float(x) and int(x): an f32 tensor of an i32 one and back (CAST), int toward zero, saturating at
// the i32 range, NaN to 0 (interp_to_i32); on numbers at compile time, int toward zero (a 64-bit
// integer); a tensor of the wanted dtype is itself. No gradient flows through an integer.
static Val builtin_cast(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)arg;
  bool to_int = !strcmp(b->name, "int");
  Val v = val[0].v;
  switch (v.kind) {
  case V_INT: return to_int ? v : float_val((double)v.i);
  case V_FLOAT:
    if (!to_int)
      return v;
    if (!(fabs(v.f) < 9.2e18)) {
      sema_error(s, call->at, "int(%g) is not a 64-bit integer", v.f);
      return ERR;
    }
    return int_val((int64_t)v.f);
  default: {
    DType from = node(s, v.node)->dtype, to = to_int ? DT_I32 : DT_F32;
    if (from == to)
      return v;
    return sema_add_op(s, OP_CAST, &v.node, 1, (int64_t[8]){to}, NULL, call->at);
  }
  }
}

// where(cond, a, b): a where cond is not 0 (a comparison's 1), else b; a and b may be numbers.
static Val builtin_where(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b;
  Val v[3];
  for (int i = 0; i < 3; i++)
    v[i] = val[i].v;
  if (v[0].kind != V_TENSOR) {
    sema_error(s, arg[0]->at, "where: cond must be a tensor (a comparison such as x > 0); a constant condition picks "
               "a or b by itself");
    return ERR;
  }
  int in[3] = {v[0].node};
  if (!sema_operand_nodes(s, "where", call->at, v + 1, (SrcLoc[]){arg[1]->at, arg[2]->at}, 2, in + 1))
    return ERR;
  return sema_add_op(s, OP_WHERE, in, 3, NULL, NULL, call->at);
}

// clamp(x, min=, max=): x within [min, max], a bound left out being none (at least one given).
static Val builtin_clamp(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b;
  int x = val[0].v.node;
  double lo = float_or(&val[1], -INFINITY), hi = float_or(&val[2], INFINITY);
  if (!arg[1] && !arg[2]) {
    sema_error(s, call->at, "clamp: give min=, max= or both");
    return ERR;
  }
  if (!(lo <= hi)) {
    sema_error(s, call->at, "clamp: min %g is above max %g", lo, hi);
    return ERR;
  }
  return sema_add_op(s, OP_CLAMP, &x, 1, NULL, (double[6]){lo, hi}, call->at);
}

// sum / mean / max over one axis, or over everything: reshape to [numel], reduce axis 0 -> [].
// The mean over everything of a cross-entropy is the mean over the targets it counts, as PyTorch's
// cross_entropy(..., ignore_index=-1) takes it: sum / target_count(targets), an ignored (negative)
// target counting in neither; with every target ignored the loss is 0 and so are its gradients.
// Over one axis a mean divides by the axis' length, whatever the values.
static Val reduce_tensor(Sema *s, const Builtin *b, Op op, const Expr *call, int x, const Expr *axis_e,
                         const Arg *axis_v, const Arg *keep_v) {
  bool keep = bool_or(keep_v, false);
  Shape sh = node(s, x)->shape;
  if (axis_e) {
    int64_t axis;
    if (!axis_arg(s, b, axis_e, axis_v, 0, sh.rank, call->at, &axis))
      return ERR;
    return sema_add_op(s, op, &x, 1, (int64_t[8]){axis, keep}, NULL, call->at);
  }
  int targets = node(s, x)->op == OP_CROSS_ENTROPY && op == OP_MEAN ? node(s, x)->in[1] : -1;
  if (sh.rank != 1) {
    Val flat = sema_reshape(s, x, (Shape){.rank = 1, .d = {shape_numel(sh)}}, call->at);
    if (flat.kind == V_ERR)
      return ERR;
    x = flat.node;
  }
  Val r;
  if (targets >= 0) {
    Val sum = sema_add_op(s, OP_SUM, &x, 1, (int64_t[8]){0, 0}, NULL, call->at);
    Val count = sema_add_op(s, OP_TARGET_COUNT, &targets, 1, NULL, NULL, call->at);
    if (sum.kind == V_ERR || count.kind == V_ERR)
      return ERR;
    r = sema_add_op(s, OP_DIV, (int[]){sum.node, count.node}, 2, NULL, NULL, call->at);
  } else {
    r = sema_add_op(s, op, &x, 1, (int64_t[8]){0, 0}, NULL, call->at);
  }
  if (r.kind == V_ERR || !keep || sh.rank == 0)
    return r;
  Shape ones = {.rank = sh.rank};
  for (int i = 0; i < sh.rank; i++)
    ones.d[i] = 1;
  return sema_reshape(s, r.node, ones, call->at);
}

static Val builtin_reduce(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  return reduce_tensor(s, b, b->op, call, val[0].v.node, arg[1], &val[1], &val[2]);
}

// max(a, b) / min(a, b): elementwise with broadcasting (either may be a number; two numbers fold);
// max(x, axis=, keepdim=) / min(...): a reduction, told apart by the second positional argument.
// The min reduction is -max(-x): the same values, and the same gradient rule at ties.
static bool minmax_form(Sema *s, const Builtin *b, const Expr **arg) {
  if (arg[1] && (arg[2] || arg[3])) {
    sema_error(s, arg[2] ? arg[2]->at : arg[3]->at, "%s(a, b) is elementwise and takes no axis= or keepdim=; the "
               "reduction is %s(x, axis=...)", b->name, b->name);
    return false;
  }
  return true;
}

static Val builtin_minmax(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  bool is_max = b->op == OP_MAXIMUM;
  if (!arg[1]) {
    if (val[0].v.kind != V_TENSOR) {
      sema_error(s, arg[0]->at, "%s: x must be a tensor, got %s", b->name, sema_describe(val[0].v));
      return ERR;
    }
    int x = val[0].v.node;
    if (!is_max) {
      Val neg = sema_add_op(s, OP_NEG, &x, 1, NULL, NULL, call->at);
      if (neg.kind == V_ERR)
        return ERR;
      x = neg.node;
    }
    Val r = reduce_tensor(s, b, OP_MAX, call, x, arg[2], &val[2], &val[3]);
    return is_max || r.kind == V_ERR ? r : sema_add_op(s, OP_NEG, &r.node, 1, NULL, NULL, call->at);
  }
  Val v[2];
  for (int i = 0; i < 2; i++) {
    v[i] = val[i].v;
    if (v[i].kind != V_TENSOR && v[i].kind != V_INT && v[i].kind != V_FLOAT) {
      sema_error(s, arg[i]->at, "%s: %s must be a tensor or a number, got %s", b->name, b->params[i],
                 sema_describe(v[i]));
      return ERR;
    }
  }
  if (v[0].kind == V_INT && v[1].kind == V_INT)
    return int_val(is_max == (v[0].i > v[1].i) ? v[0].i : v[1].i);
  if (v[0].kind != V_TENSOR && v[1].kind != V_TENSOR) {
    double x = v[0].kind == V_INT ? (double)v[0].i : v[0].f, y = v[1].kind == V_INT ? (double)v[1].i : v[1].f;
    return float_val(is_max ? fmax(x, y) : fmin(x, y));
  }
  int in[2];
  if (!sema_operand_nodes(s, b->name, call->at, v, (SrcLoc[]){arg[0]->at, arg[1]->at}, 2, in))
    return ERR;
  return sema_add_op(s, b->op, in, 2, NULL, NULL, call->at);
}

static Val builtin_reshape(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b;
  int x = val[0].v.node, n = val[1].n;
  const int64_t *d = val[1].ints;
  Shape sh = {.rank = n};
  int64_t known = 1;
  int infer = -1;
  for (int i = 0; i < n; i++) {
    if (d[i] == -1 && infer < 0) {
      infer = i;
      continue;
    }
    if (d[i] <= 0) {
      sema_error(s, arg[1]->args[i]->at, d[i] == -1 ? "reshape: only one size may be -1"
                                                  : "reshape: sizes must be positive (or one -1), got %lld",
               (long long)d[i]);
      return ERR;
    }
    if (__builtin_mul_overflow(known, d[i], &known)) {
      sema_error(s, arg[1]->at, "integer overflow in dimension arithmetic");
      return ERR;
    }
    sh.d[i] = d[i];
  }
  int64_t numel = shape_numel(node(s, x)->shape);
  if (infer >= 0) {
    if (numel % known) {
      sema_error(s, call->at, "reshape: cannot reshape %s (%lld elements) to %s", sema_shape_text(s, node(s, x)->shape),
                 (long long)numel, sema_shape_text(s, shape_of(n, d)));
      return ERR;
    }
    sh.d[infer] = numel / known;
  }
  return sema_reshape(s, x, sh, call->at);
}

static Val builtin_permute(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b;
  int x = val[0].v.node, n = val[1].n;
  int64_t perm[8] = {0};
  memcpy(perm, val[1].ints, sizeof(int64_t) * (size_t)n);
  int r = node(s, x)->shape.rank;
  if (n != r) {
    sema_error(s, arg[1]->at, "permute: %d axes given for a tensor of rank %d", n, r);
    return ERR;
  }
  for (int i = 0; i < n; i++)
    if (perm[i] < 0)
      perm[i] += r;
  return sema_add_op(s, OP_PERMUTE, &x, 1, perm, NULL, call->at);
}

static Val builtin_transpose(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int r = node(s, x)->shape.rank;
  int64_t i, j, perm[8];
  if (!axis_arg(s, b, arg[1], &val[1], 0, r, call->at, &i) || !axis_arg(s, b, arg[2], &val[2], 0, r, call->at, &j))
    return ERR;
  if (i == j)
    return tensor_val(x);
  for (int k = 0; k < r; k++)
    perm[k] = k;
  perm[i] = j;
  perm[j] = i;
  return sema_add_op(s, OP_PERMUTE, &x, 1, perm, NULL, call->at);
}

// split(x, n, axis=-1): n equal SLICEs, returned together for `a, b, c = split(...)`.
static Val builtin_split(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int64_t n = val[1].v.i, axis;
  Shape sh = node(s, x)->shape;
  if (!axis_arg(s, b, arg[2], &val[2], -1, sh.rank, call->at, &axis))
    return ERR;
  if (n <= 0 || n > 64) {
    sema_error(s, arg[1]->at, "split: n must be between 1 and 64, got %lld", (long long)n);
    return ERR;
  }
  if (sh.d[axis] % n) {
    sema_error(s, call->at, "split: size %lld of axis %lld is not divisible by %lld", (long long)sh.d[axis],
               (long long)axis, (long long)n);
    return ERR;
  }
  int64_t len = sh.d[axis] / n;
  Val t = {.kind = V_TUPLE, .ntuple = (int)n, .tuple = arena_alloc(s->a, sizeof(int) * (size_t)n)};
  for (int64_t i = 0; i < n; i++) {
    Val part = sema_add_op(s, OP_SLICE, &x, 1, (int64_t[8]){axis, i * len, (i + 1) * len}, NULL, call->at);
    if (part.kind == V_ERR)
      return ERR;
    t.tuple[i] = part.node;
  }
  return t;
}

static Val builtin_concat(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  const int *in = val[0].nodes;
  int64_t axis;
  if (!axis_arg(s, b, arg[1], &val[1], -1, node(s, in[0])->shape.rank, call->at, &axis))
    return ERR;
  return sema_add_op(s, OP_CONCAT, in, val[0].n, (int64_t[8]){axis}, NULL, call->at);
}

// topk(x, k, axis=-1): (values, indices i32), the k largest along the axis, largest first, ties by
// the lower index: TOPK gives the indices, a GATHER of x at them the values (the gradient's path).
static Val builtin_topk(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int64_t k = val[1].v.i, axis;
  Shape sh = node(s, x)->shape;
  if (!axis_arg(s, b, arg[2], &val[2], -1, sh.rank, call->at, &axis))
    return ERR;
  if (k < 1 || k > sh.d[axis]) {
    sema_error(s, arg[1]->at, "topk: k must be between 1 and %lld (the size of axis %lld), got %lld",
               (long long)sh.d[axis], (long long)axis, (long long)k);
    return ERR;
  }
  Val idx = sema_add_op(s, OP_TOPK, &x, 1, (int64_t[8]){axis, k}, NULL, call->at);
  if (idx.kind == V_ERR)
    return ERR;
  Val vals = sema_add_op(s, OP_GATHER, (int[]){x, idx.node}, 2, (int64_t[8]){axis}, NULL, call->at);
  if (vals.kind == V_ERR)
    return ERR;
  Val t = {.kind = V_TUPLE, .ntuple = 2, .tuple = arena_alloc(s->a, sizeof(int) * 2), .topk = true};
  t.tuple[0] = vals.node;
  t.tuple[1] = idx.node;
  return t;
}

// gather(x, idx, axis=-1) and scatter_add(base, idx, src, axis=-1); the shapes are checked by the IR.
static Val builtin_gather(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  bool scatter = b->op == OP_SCATTER_ADD;
  int x = val[0].v.node, idx = val[1].v.node;
  int src = scatter ? val[2].v.node : 0;
  int64_t axis;
  if (!need_i32(s, b, idx, "idx", arg[1]->at))
    return ERR;
  int bad = node(s, x)->dtype != DT_F32 ? 0 : scatter && node(s, src)->dtype != DT_F32 ? 2 : -1;
  if (bad >= 0) {
    sema_error(s, arg[bad]->at, "%s: %s must be f32, got i32", b->name, b->params[bad]);
    return ERR;
  }
  if (!axis_arg(s, b, arg[scatter ? 3 : 2], &val[scatter ? 3 : 2], -1, node(s, x)->shape.rank, call->at, &axis))
    return ERR;
  if (scatter)
    return sema_add_op(s, OP_SCATTER_ADD, (int[]){x, idx, src}, 3, (int64_t[8]){axis}, NULL, call->at);
  return sema_add_op(s, OP_GATHER, (int[]){x, idx}, 2, (int64_t[8]){axis}, NULL, call->at);
}

static Val builtin_embed(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int t = val[0].v.node, ids = val[1].v.node;
  if (!need_i32(s, b, ids, "ids", arg[1]->at))
    return ERR;
  return sema_add_op(s, OP_EMBED, (int[]){t, ids}, 2, NULL, NULL, call->at);
}

// layernorm(x, w, b, eps=1e-5) and rmsnorm(x, w, eps=1e-5). A layernorm without b gets a zero bias.
static Val builtin_norm(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int layer = b->op == OP_LAYERNORM, eps_at = layer ? 3 : 2;
  int x = val[0].v.node, w = val[1].v.node;
  double eps = float_or(&val[eps_at], 1e-5);
  if (!(eps >= 0 && isfinite(eps))) {
    sema_error(s, arg[eps_at]->at, "%s: eps must be finite and not negative, got %g", b->name, eps);
    return ERR;
  }
  int in[3] = {x, w, -1};
  if (layer && arg[2]) {
    in[2] = val[2].v.node;
  } else if (layer) {
    int zero = ir_const(s->g, 0, call->at);
    in[2] = zero < 0 ? -1 : ir_broadcast(s->g, zero, node(s, w)->shape, call->at);
    if (in[2] < 0)
      sema_error(s, call->at, "%s", s->g->err);
  }
  if (layer && in[2] < 0)
    return ERR;
  return sema_add_op(s, b->op, in, layer ? 3 : 2, NULL, (double[6]){eps}, call->at);
}

// x with axes `axis` and the last swapped (a PERMUTE; x itself when they are the same axis).
static int swap_last(Sema *s, int x, int64_t axis, SrcLoc at) {
  int r = node(s, x)->shape.rank;
  if (r == 0 || axis == r - 1)
    return x;
  int64_t perm[IR_NIA] = {0};
  for (int i = 0; i < r; i++)
    perm[i] = i;
  perm[axis] = r - 1;
  perm[r - 1] = axis;
  Val v = sema_add_op(s, OP_PERMUTE, &x, 1, perm, NULL, at);
  return v.kind == V_ERR ? -1 : v.node;
}

// softmax(x, axis=-1): the SOFTMAX op works on the last axis; another axis is swapped there and back.
static Val builtin_softmax(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int r = node(s, x)->shape.rank;
  int64_t axis = r - 1;
  if (r > 0 && !axis_arg(s, b, arg[1], &val[1], -1, r, call->at, &axis))
    return ERR;
  int t = swap_last(s, x, axis, call->at);
  Val y = t < 0 ? ERR : sema_add_op(s, OP_SOFTMAX, &t, 1, NULL, NULL, call->at);
  if (y.kind == V_ERR || t == x)
    return y;
  int back = swap_last(s, y.node, axis, call->at);
  return back < 0 ? ERR : tensor_val(back);
}

// log_softmax(x, axis=-1) = (x - m) - log(sum(exp(x - m))) over the axis, m its maximum taken as a
// constant (stop_gradient: the value does not depend on m, so neither does the gradient), so that
// exp never overflows and a large negative score keeps its value where log(softmax) would be -inf.
static Val builtin_log_softmax(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int r = node(s, x)->shape.rank;
  int64_t axis = 0;
  if (r == 0) {
    sema_error(s, call->at, "log_softmax of a scalar");
    return ERR;
  }
  if (!axis_arg(s, b, arg[1], &val[1], -1, r, call->at, &axis))
    return ERR;
  SrcLoc at = call->at;
  Val m = sema_add_op(s, OP_MAX, &x, 1, (int64_t[8]){axis, 1}, NULL, at);
  Val mc = m.kind == V_ERR ? ERR : sema_add_op(s, OP_STOP_GRADIENT, &m.node, 1, NULL, NULL, at);
  Val y = mc.kind == V_ERR ? ERR : sema_add_op(s, OP_SUB, (int[]){x, mc.node}, 2, NULL, NULL, at);
  Val e = y.kind == V_ERR ? ERR : sema_add_op(s, OP_EXP, &y.node, 1, NULL, NULL, at);
  Val sum = e.kind == V_ERR ? ERR : sema_add_op(s, OP_SUM, &e.node, 1, (int64_t[8]){axis, 1}, NULL, at);
  Val l = sum.kind == V_ERR ? ERR : sema_add_op(s, OP_LOG, &sum.node, 1, NULL, NULL, at);
  return l.kind == V_ERR ? ERR : sema_add_op(s, OP_SUB, (int[]){y.node, l.node}, 2, NULL, NULL, at);
}

// An ATTENTION_MASK node and what it was built for.
typedef struct {
  int doc; // the doc ids node, or -1
  int64_t t;
  bool causal;
  int64_t window;
  int node;
} Mask;

// The mask of plain attention over t positions (doc: the doc ids node, or -1): built once, outside
// every repeat body, and shared by every attention that needs the same one (a model's layers).
static int attention_mask(Sema *s, int doc, int64_t t, bool causal, int64_t window, SrcLoc at) {
  for (int i = 0; i < s->masks.n; i++) {
    const Mask *m = s->masks.v[i];
    if (m->doc == doc && m->t == t && m->causal == causal && m->window == window)
      return m->node;
  }
  int body = s->g->cur_body;
  s->g->cur_body = 0;
  int id = ir_attention_mask(s->g, doc, t, causal, window, at);
  s->g->cur_body = body;
  if (id < 0) {
    sema_error(s, at, "%s", s->g->err);
    return -1;
  }
  Mask *m = arena_alloc(s->a, sizeof *m);
  *m = (Mask){doc, t, causal, window, id};
  vec_push(s->a, &s->masks, m);
  return id;
}

// Attention's attributes (mdl.h: ATTENTION's ia[0], ia[1], ia[5], ia[6] and fa[0]).
typedef struct {
  int64_t heads, kv_heads, window;
  bool causal;
  double scale;
} AttnArgs;

// Attention lowered as an unfused framework runs it (LowerOptions.plain_attention): q [B,T,H*D] viewed
// as heads [B,T,H,D] and permuted to [B,H,T,D], k and v [B,S,KH*D] likewise to [B,KH,S,D]; with KH < H
// kv heads each is repeated for its H/KH query heads ([B,KH,1,S,D] broadcast to [B,KH,H/KH,S,D], a
// copy, as frameworks do); scores = q k^T * scale + mask, [B,H,T,S] in memory; P = softmax(scores);
// P v permuted back to [B,T,H*D]. in[3] is the doc ids node or -1.
static Val plain_attention(Sema *s, const int *in, AttnArgs a, SrcLoc at) {
  Graph *g = s->g;
  if (!ir_attention_fits(g, in[0], in[1], in[2], in[3], a.heads, a.kv_heads, a.causal, a.window)) {
    sema_error(s, at, "%s", g->err);
    return ERR;
  }
  Shape x = node(s, in[0])->shape;
  int64_t nb = x.d[0], nt = x.d[1], ns = node(s, in[1])->shape.d[1], d = x.d[2] / a.heads;
  int64_t grp = a.heads / a.kv_heads;
  const int64_t to_heads[8] = {0, 2, 1, 3}; // [B,T,H,D] <-> [B,H,T,D] (its own inverse)
  int h[3];
  for (int i = 0; i < 3; i++) {
    int64_t rows = i ? ns : nt, nh = i ? a.kv_heads : a.heads;
    Val r = sema_reshape(s, in[i], shape_of(4, (int64_t[]){nb, rows, nh, d}), at);
    if (r.kind == V_ERR)
      return ERR;
    Val p = sema_add_op(s, OP_PERMUTE, &r.node, 1, to_heads, NULL, at);
    if (p.kind == V_ERR)
      return ERR;
    if (i && grp > 1) { // each kv head repeated for the query heads of its group
      p = sema_reshape(s, p.node, shape_of(5, (int64_t[]){nb, a.kv_heads, 1, ns, d}), at);
      int bc = p.kind == V_ERR ? -1 : ir_broadcast(g, p.node, shape_of(5, (int64_t[]){nb, a.kv_heads, grp, ns, d}), at);
      if (bc < 0) {
        sema_error(s, at, "%s", g->err);
        return ERR;
      }
      p = sema_reshape(s, bc, shape_of(4, (int64_t[]){nb, a.heads, ns, d}), at);
      if (p.kind == V_ERR)
        return ERR;
    }
    h[i] = p.node;
  }
  Val sc = sema_add_op(s, OP_MATMUL, (int[]){h[0], h[1]}, 2, (int64_t[8]){0, 1}, NULL, at);
  int c = sc.kind == V_ERR ? -1 : ir_const(g, a.scale, at);
  if (c < 0)
    return ERR;
  sc = sema_add_op(s, OP_MUL, (int[]){sc.node, c}, 2, NULL, NULL, at);
  if (sc.kind != V_ERR && (a.causal || in[3] >= 0)) {
    int m = attention_mask(s, in[3], nt, a.causal, a.window, at);
    sc = m < 0 ? ERR : sema_add_op(s, OP_ADD, (int[]){sc.node, m}, 2, NULL, NULL, at);
  }
  Val p = sc.kind == V_ERR ? ERR : sema_add_op(s, OP_SOFTMAX, &sc.node, 1, NULL, NULL, at);
  Val o = p.kind == V_ERR ? ERR : sema_add_op(s, OP_MATMUL, (int[]){p.node, h[2]}, 2, NULL, NULL, at);
  o = o.kind == V_ERR ? ERR : sema_add_op(s, OP_PERMUTE, &o.node, 1, to_heads, NULL, at);
  return o.kind == V_ERR ? ERR : sema_reshape(s, o.node, x, at);
}

static Val builtin_attention(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int in[4] = {val[0].v.node, val[1].v.node, val[2].v.node, val[5].v.node};
  AttnArgs a = {.heads = val[3].v.i, .causal = bool_or(&val[4], false)};
  a.kv_heads = int_or(&val[7], a.heads);
  a.window = int_or(&val[8], 0);
  if (arg[5] && !need_i32(s, b, in[3], "doc", arg[5]->at))
    return ERR;
  if (arg[7] && a.kv_heads <= 0) {
    sema_error(s, arg[7]->at, "attention: kv_heads must be at least 1, got %lld", (long long)a.kv_heads);
    return ERR;
  }
  if (arg[8] && a.window <= 0) {
    sema_error(s, arg[8]->at, "attention: window must be at least 1, got %lld", (long long)a.window);
    return ERR;
  }
  if (arg[8] && !a.causal) {
    sema_error(s, arg[8]->at, "attention: window=%lld needs causal=true", (long long)a.window);
    return ERR;
  }
  Shape q = node(s, in[0])->shape;
  int64_t c = q.rank == 3 ? q.d[2] : 0;
  a.scale = float_or(&val[6], a.heads > 0 && c % a.heads == 0 ? 1 / sqrt((double)(c / a.heads)) : 1);
  bool doc = arg[5] && !s->lower.no_doc_mask; // (--no-doc-mask: the ids are checked, then ignored)
  // (the window stays as written even where it holds all T rows: a graph of one token decodes with a
  // cache of earlier positions, interp.c)
  if (!ir_attention_fits(s->g, in[0], in[1], in[2], arg[5] ? in[3] : -1, a.heads, a.kv_heads, a.causal, a.window)) {
    sema_error(s, call->at, "%s", s->g->err);
    return ERR;
  }
  if (s->lower.plain_attention) {
    in[3] = doc ? in[3] : -1;
    return plain_attention(s, in, a, call->at);
  }
  int64_t kvh = a.kv_heads == a.heads ? 0 : a.kv_heads; // (0: one kv head per head, mdl.h)
  return sema_add_op(s, OP_ATTENTION, in, doc ? 4 : 3, (int64_t[8]){a.heads, a.causal, doc, 0, 0, kvh, a.window},
                     (double[6]){a.scale}, call->at);
}

static Val builtin_rope(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node, pos = val[1].v.node;
  if (!need_i32(s, b, pos, "pos", arg[1]->at))
    return ERR;
  int64_t heads = val[2].v.i;
  double base = float_or(&val[3], 10000);
  if (!(base > 0 && isfinite(base))) {
    sema_error(s, arg[3]->at, "rope: base must be positive and finite, got %g", base);
    return ERR;
  }
  return sema_add_op(s, OP_ROPE, (int[]){x, pos}, 2, (int64_t[8]){heads, 0}, (double[6]){base}, call->at);
}

static Val builtin_cross_entropy(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int l = val[0].v.node, t = val[1].v.node;
  if (!need_i32(s, b, t, "targets", arg[1]->at))
    return ERR;
  return sema_add_op(s, OP_CROSS_ENTROPY, (int[]){l, t}, 2, NULL, NULL, call->at);
}

// x shifted by s positions along axis 1 of [B, T, C], zeros coming in: element t of the result is
// x[t + s] where 0 <= t + s < T, else 0 (|s| < T). A SLICE and a CONCAT with a zero BROADCAST.
static int shifted(Sema *s, int x, int64_t by, SrcLoc at) {
  if (by == 0)
    return x;
  Shape sh = node(s, x)->shape, pad = sh;
  int64_t t = sh.d[1], n = by < 0 ? -by : by;
  pad.d[1] = n;
  int zero = ir_const(s->g, 0, at);
  int zeros = zero < 0 ? -1 : ir_broadcast(s->g, zero, pad, at);
  if (zeros < 0) {
    sema_error(s, at, "%s", s->g->err);
    return -1;
  }
  Val part = sema_add_op(s, OP_SLICE, &x, 1, (int64_t[8]){1, by < 0 ? 0 : n, by < 0 ? t - n : t}, NULL, at);
  if (part.kind == V_ERR)
    return -1;
  Val r = sema_add_op(s, OP_CONCAT, by < 0 ? (int[]){zeros, part.node} : (int[]){part.node, zeros}, 2, (int64_t[8]){1},
                      NULL, at);
  return r.kind == V_ERR ? -1 : r.node;
}

// conv1d(x, w, b, causal=false): a 1-D convolution over the T axis of x [B, T, Cin], of the same
// length T (zeros beyond either end), as PyTorch's conv1d computes it (cross-correlation):
//   y[t] = sum_k w[k] . x[t + k - left] (+ b),  left = K - 1 when causal (y[t] sees x[t - K + 1 .. t]),
//   else (K - 1) / 2 rounded down ('same' padding, the extra tap of an even K on the right).
// w [K, Cin, Cout] is a full convolution (y [B, T, Cout]); w [K, C] a depthwise one, each channel its
// own filter (y [B, T, C]). b [Cout] is optional. Lowered to ops the back ends have (so autodiff
// and fusion come for free): per tap, x shifted (a SLICE and a CONCAT with zeros); a depthwise
// convolution sums the taps times their rows of w; a full one concatenates the K shifted copies
// along the channels and multiplies them by w viewed as [K * Cin, Cout], one GEMM.
static Val builtin_conv1d(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node, w = val[1].v.node;
  int bias = arg[2] ? val[2].v.node : -1;
  bool causal = bool_or(&val[3], false);
  Shape xs = node(s, x)->shape, ws = node(s, w)->shape;
  if (xs.rank != 3) {
    sema_error(s, arg[0]->at, "conv1d: x must be [B, T, C], got %s", sema_shape_text(s, xs));
    return ERR;
  }
  int64_t t = xs.d[1], cin = xs.d[2], k = ws.d[0];
  if (ws.rank != 2 && ws.rank != 3) {
    sema_error(s, arg[1]->at, "conv1d: w must be [K, Cin, Cout] (a full convolution) or [K, C] (depthwise), got %s",
               sema_shape_text(s, ws));
    return ERR;
  }
  if (ws.d[1] != cin) {
    sema_error(s, arg[1]->at, "conv1d: w %s has %lld input channels, x %s has %lld", sema_shape_text(s, ws),
               (long long)ws.d[1], sema_shape_text(s, xs), (long long)cin);
    return ERR;
  }
  if (k > 64) { // (a full convolution concatenates K parts; the emitters read at most 64 at once)
    sema_error(s, arg[1]->at, "conv1d: %lld taps; at most 64 (this lowering is for short convolutions)", (long long)k);
    return ERR;
  }
  int64_t cout = ws.rank == 3 ? ws.d[2] : cin;
  if (bias >= 0 && (node(s, bias)->shape.rank != 1 || node(s, bias)->shape.d[0] != cout)) {
    sema_error(s, arg[2]->at, "conv1d: b must be [%lld] (the output channels), got %s", (long long)cout,
               sema_shape_text(s, node(s, bias)->shape));
    return ERR;
  }
  for (int i = 0; i < 3; i++) {
    int v = i == 0 ? x : i == 1 ? w : bias;
    if (v >= 0 && node(s, v)->dtype != DT_F32) {
      sema_error(s, arg[i]->at, "conv1d: %s must be f32, got %s", b->params[i], dtype_name(node(s, v)->dtype));
      return ERR;
    }
  }
  int64_t left = causal ? k - 1 : (k - 1) / 2;
  int *taps = arena_alloc(s->a, sizeof(int) * (size_t)k);
  int y = -1;
  for (int64_t j = 0; j < k; j++) {
    int64_t by = j - left; // tap j reads x[t + by]; one that only ever reads zeros is left out (-1)
    bool outside = by <= -t || by >= t;
    taps[j] = -1;
    if (!outside && (taps[j] = shifted(s, x, by, call->at)) < 0)
      return ERR;
    if (ws.rank == 3 || taps[j] < 0)
      continue;
    Val row = sema_add_op(s, OP_SLICE, &w, 1, (int64_t[8]){0, j, j + 1}, NULL, call->at);
    Val term = row.kind == V_ERR ? ERR : sema_add_op(s, OP_MUL, (int[]){taps[j], row.node}, 2, NULL, NULL, call->at);
    if (term.kind == V_ERR)
      return ERR;
    Val sum = y < 0 ? term : sema_add_op(s, OP_ADD, (int[]){y, term.node}, 2, NULL, NULL, call->at);
    if (sum.kind == V_ERR)
      return ERR;
    y = sum.node;
  }
  if (ws.rank == 3) { // [B, T, K * Cin] (the taps that read nothing but zeros as zeros) @ [K * Cin, Cout]
    int zeros = -1;
    for (int64_t j = 0; j < k; j++) {
      if (taps[j] >= 0)
        continue;
      int zero = zeros >= 0 ? zeros : ir_const(s->g, 0, call->at);
      zeros = zero < 0 || zeros >= 0 ? zeros : ir_broadcast(s->g, zero, xs, call->at);
      if (zeros < 0) {
        sema_error(s, call->at, "%s", s->g->err);
        return ERR;
      }
      taps[j] = zeros;
    }
    Val cols = k == 1 ? tensor_val(taps[0]) : sema_add_op(s, OP_CONCAT, taps, (int)k, (int64_t[8]){2}, NULL, call->at);
    Val flat = cols.kind == V_ERR
                   ? ERR
                   : sema_reshape(s, cols.node, (Shape){.rank = 2, .d = {xs.d[0] * t, k * cin}}, call->at);
    Val wf = sema_reshape(s, w, (Shape){.rank = 2, .d = {k * cin, cout}}, call->at);
    Val prod = flat.kind == V_ERR || wf.kind == V_ERR
                   ? ERR
                   : sema_add_op(s, OP_MATMUL, (int[]){flat.node, wf.node}, 2, (int64_t[8]){0, 0}, NULL, call->at);
    Val out = prod.kind == V_ERR ? ERR
                                 : sema_reshape(s, prod.node, (Shape){.rank = 3, .d = {xs.d[0], t, cout}}, call->at);
    if (out.kind == V_ERR)
      return ERR;
    y = out.node;
  } // (the tap at x[t] itself is always there: y >= 0)
  if (bias < 0)
    return tensor_val(y);
  return sema_add_op(s, OP_ADD, (int[]){y, bias}, 2, NULL, NULL, call->at);
}

// Each dropout gets its own random stream: its index among the graph's dropouts, from 1.
static Val builtin_dropout(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b, (void)arg;
  int x = val[0].v.node;
  double p = float_or(&val[1], 0.1);
  return sema_add_op(s, OP_DROPOUT, &x, 1, (int64_t[8]){++s->dropouts}, (double[6]){p}, call->at);
}

static const Builtin builtins[] = {
    {"gelu", 1, 1, {"x"}, builtin_unary, OP_GELU, "n", NULL},
    {"relu", 1, 1, {"x"}, builtin_unary, OP_RELU, "n", NULL},
    {"silu", 1, 1, {"x"}, builtin_unary, OP_SILU, "n", NULL},
    {"sigmoid", 1, 1, {"x"}, builtin_unary, OP_SIGMOID, "n", NULL},
    {"abs", 1, 1, {"x"}, builtin_unary, OP_ABS, "n", NULL},
    {"clamp", 1, 1, {"x", "min", "max"}, builtin_clamp, OP_CLAMP, "t f f", NULL},
    {"stop_gradient", 1, 1, {"x"}, builtin_unary, OP_STOP_GRADIENT, "n", NULL},
    {"where", 3, 3, {"cond", "a", "b"}, builtin_where, OP_WHERE, "n n n", NULL},
    {"float", 1, 1, {"x"}, builtin_cast, OP_CAST, "n", NULL},
    {"int", 1, 1, {"x"}, builtin_cast, OP_CAST, "n", NULL},
    {"exp", 1, 1, {"x"}, builtin_unary, OP_EXP, "n", NULL},
    {"log", 1, 1, {"x"}, builtin_unary, OP_LOG, "n", NULL},
    {"tanh", 1, 1, {"x"}, builtin_unary, OP_TANH, "n", NULL},
    {"sqrt", 1, 1, {"x"}, builtin_unary, OP_SQRT, "n", NULL},
    {"rsqrt", 1, 1, {"x"}, builtin_unary, OP_RSQRT, "n", NULL},
    {"neg", 1, 1, {"x"}, builtin_unary, OP_NEG, "n", NULL},
    {"sum", 1, 1, {"x", "axis", "keepdim"}, builtin_reduce, OP_SUM, "t i b", NULL},
    {"mean", 1, 1, {"x", "axis", "keepdim"}, builtin_reduce, OP_MEAN, "t i b", NULL},
    {"max", 1, 2, {"x", "y", "axis", "keepdim"}, builtin_minmax, OP_MAXIMUM, "v v i b", minmax_form},
    {"min", 1, 2, {"x", "y", "axis", "keepdim"}, builtin_minmax, OP_MINIMUM, "v v i b", minmax_form},
    {"reshape", 2, 2, {"x", "shape"}, builtin_reshape, OP_RESHAPE, "t I", NULL},
    {"permute", 2, 2, {"x", "axes"}, builtin_permute, OP_PERMUTE, "t I", NULL},
    {"transpose", 3, 3, {"x", "a", "b"}, builtin_transpose, OP_PERMUTE, "t i i", NULL},
    {"split", 2, 2, {"x", "n", "axis"}, builtin_split, OP_SLICE, "t i i", NULL},
    {"concat", 1, 1, {"xs", "axis"}, builtin_concat, OP_CONCAT, "T i", NULL},
    {"embed", 2, 2, {"table", "ids"}, builtin_embed, OP_EMBED, "tt", NULL},
    {"topk", 2, 2, {"x", "k", "axis"}, builtin_topk, OP_TOPK, "t i i", NULL},
    {"gather", 2, 2, {"x", "idx", "axis"}, builtin_gather, OP_GATHER, "tt i", NULL},
    {"scatter_add", 3, 3, {"base", "idx", "src", "axis"}, builtin_gather, OP_SCATTER_ADD, "ttt i", NULL},
    {"layernorm", 2, 3, {"x", "w", "b", "eps"}, builtin_norm, OP_LAYERNORM, "tt t f", NULL},
    {"rmsnorm", 2, 2, {"x", "w", "eps"}, builtin_norm, OP_RMSNORM, "tt f", NULL},
    {"softmax", 1, 1, {"x", "axis"}, builtin_softmax, OP_SOFTMAX, "t i", NULL},
    {"log_softmax", 1, 1, {"x", "axis"}, builtin_log_softmax, OP_SOFTMAX, "t i", NULL},
    {"attention", 3, 3, {"q", "k", "v", "heads", "causal", "doc", "scale", "kv_heads", "window"}, builtin_attention,
     OP_ATTENTION, "t t t r b t f i i", NULL},
    {"rope", 2, 2, {"x", "pos", "heads", "base"}, builtin_rope, OP_ROPE, "tt r f", NULL},
    {"cross_entropy", 2, 2, {"logits", "targets"}, builtin_cross_entropy, OP_CROSS_ENTROPY, "tt", NULL},
    {"dropout", 1, 1, {"x", "p"}, builtin_dropout, OP_DROPOUT, "t f", NULL},
    {"conv1d", 2, 3, {"x", "w", "b", "causal"}, builtin_conv1d, OP_MATMUL, "ttt b", NULL},
};

// The builtin a call names; NULL when there is none (reported).
const Builtin *sema_find_builtin(Sema *s, const Expr *e) {
  for (size_t i = 0; i < sizeof builtins / sizeof *builtins; i++)
    if (!strcmp(builtins[i].name, e->s))
      return &builtins[i];
  if (!strcmp(e->s, "normal"))
    sema_error(s, e->at, "normal(std) initialises a param: param NAME: [shape] = normal(std)");
  else {
    Nearest near = {e->s, NULL, 3};
    for (size_t i = 0; i < sizeof builtins / sizeof *builtins; i++)
      sema_consider(&near, builtins[i].name);
    sema_error(s, e->at, "unknown op '%s'%s", e->s, sema_did_you_mean(s, &near));
  }
  return NULL;
}
