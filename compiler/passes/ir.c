// ir.c: the graph IR. Nodes are appended in topological order; ir_add infers each node's shape
// and dtype from its inputs and attributes and rejects ill-typed nodes with a message in g->err,
// so every pass can trust node->shape. ir_validate re-checks a whole graph between passes.
#include "mdl.h"

#include <stdarg.h>
#include <string.h>

Graph *ir_new(Arena *a) {
  Graph *g = arena_alloc(a, sizeof *g);
  g->arena = a;
  g->loss = -1;
  g->train = (TrainConfig){.lr = 3e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .accumulate = 1,
                           .precision = "auto", .amax_history = 16, .checkpoint = "auto"};
  return g;
}

static bool fail(Graph *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(Graph *g, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->err, sizeof g->err, fmt, ap);
  va_end(ap);
  return false;
}

#define SHAPE(s) shape_str((s), (char[128]){0}, 128)

// numpy broadcasting of two shapes into *out.
static bool broadcast_shapes(Shape a, Shape b, Shape *out) {
  int r = a.rank > b.rank ? a.rank : b.rank;
  out->rank = r;
  for (int i = 0; i < r; i++) {
    int64_t x = i - (r - a.rank) >= 0 ? a.d[i - (r - a.rank)] : 1;
    int64_t y = i - (r - b.rank) >= 0 ? b.d[i - (r - b.rank)] : 1;
    if (x != y && x != 1 && y != 1)
      return false;
    out->d[i] = x == 1 ? y : x;
  }
  return true;
}

// Whether q [B,T,H*D], k and v [B,S,KH*D] (and doc ids, when given) fit attention with H = heads query
// heads and KH = kv_heads key and value heads, causal and window as given; else fail's message.
static bool attention_shapes(Graph *g, Shape q, Shape k, Shape v, const Shape *doc, int64_t heads, int64_t kv_heads,
                             bool causal, int64_t window) {
  if (q.rank != 3)
    return fail(g, "attention: q must be [B,T,C], got %s", SHAPE(q));
  if (heads <= 0 || q.d[2] % heads)
    return fail(g, "attention: %lld heads do not divide width %lld", (long long)heads, (long long)q.d[2]);
  if (kv_heads <= 0 || heads % kv_heads)
    return fail(g, "attention: kv_heads=%lld does not divide heads=%lld", (long long)kv_heads, (long long)heads);
  int64_t ckv = q.d[2] / heads * kv_heads;
  if (!shape_eq(k, v))
    return fail(g, "attention: k %s and v %s must have one shape", SHAPE(k), SHAPE(v));
  if (k.rank != 3 || k.d[0] != q.d[0] || k.d[2] != ckv)
    return fail(g, "attention: k and v %s must be [%lld,S,%lld] for q %s (%lld kv heads of %lld channels)", SHAPE(k),
                (long long)q.d[0], (long long)ckv, SHAPE(q), (long long)kv_heads, (long long)(q.d[2] / heads));
  if (k.d[1] != q.d[1] && (causal || doc))
    return fail(g, "attention: k and v have %lld rows and q %lld: keys of another length need causal=false and no "
                "doc=", (long long)k.d[1], (long long)q.d[1]);
  if (window < 0 || (window > 0 && !causal))
    return fail(g, "attention: window=%lld needs causal=true and a window of at least 1", (long long)window);
  if (doc && (doc->rank != 2 || doc->d[0] != q.d[0] || doc->d[1] != q.d[1]))
    return fail(g, "attention: doc ids %s must be [%lld,%lld]", SHAPE(*doc), (long long)q.d[0], (long long)q.d[1]);
  return true;
}

bool ir_attention_fits(Graph *g, int q, int k, int v, int doc, int64_t heads, int64_t kv_heads, bool causal,
                       int64_t window) {
  IrNode **n = g->nodes;
  return attention_shapes(g, n[q]->shape, n[k]->shape, n[v]->shape, doc >= 0 ? &n[doc]->shape : NULL, heads,
                          kv_heads, causal, window);
}

static bool is_fp8(DType dt) { return dt == DT_F8E4M3 || dt == DT_F8E5M2; }
static bool is_float(DType dt) { return dt == DT_F32 || dt == DT_BF16 || dt == DT_F64 || is_fp8(dt); }

// TOPK, GATHER, GATHER_BWD and SCATTER_ADD (mdl.h): the axis, and idx against the positions it lists.
static bool routing_shape(Graph *g, IrNode *n, IrNode **in) {
  const char *name = op_name(n->op);
  Shape x = n->op == OP_GATHER_BWD ? in[1]->shape : in[0]->shape;
  int64_t ax = n->ia[0];
  if (ax < 0 || ax >= x.rank)
    return fail(g, "%s: axis %lld out of range for %s", name, (long long)ax, SHAPE(x));
  if (n->op == OP_TOPK) {
    if (n->ia[1] < 1 || n->ia[1] > x.d[ax])
      return fail(g, "topk: k = %lld is not in [1, %lld], the size of axis %lld of %s", (long long)n->ia[1],
                  (long long)x.d[ax], (long long)ax, SHAPE(x));
    n->shape = x;
    n->shape.d[ax] = n->ia[1];
    return true;
  }
  // pos: the shape idx lists positions of; full: the shape indexed along the axis.
  Shape idx = in[n->op == OP_GATHER_BWD ? 0 : 1]->shape, pos = x, full = x;
  if (n->op == OP_GATHER) {
    pos.d[ax] = idx.rank == x.rank ? idx.d[ax] : 0;
  } else if (n->op == OP_GATHER_BWD) {
    if (n->ia[1] < 1)
      return fail(g, "gather_bwd: axis length %lld", (long long)n->ia[1]);
    full.d[ax] = n->ia[1];
  } else {
    pos = in[2]->shape;
    Shape a = full, b = pos;
    if (a.rank == b.rank)
      a.d[ax] = b.d[ax] = 0;
    if (!shape_eq(a, b))
      return fail(g, "scatter_add: src %s does not match base %s outside axis %lld", SHAPE(pos), SHAPE(full),
                  (long long)ax);
  }
  bool fits = idx.rank == pos.rank;
  for (int d = 0; d < idx.rank && fits; d++)
    fits = idx.d[d] == pos.d[d] || (idx.d[d] == 1 && d != ax);
  if (!fits || (n->op == OP_GATHER && idx.d[ax] < 1)) {
    if (n->op == OP_GATHER)
      return fail(g, "gather: indices %s do not fit x %s (the same rank; on every axis but %lld the same size or 1)",
                  SHAPE(idx), SHAPE(x), (long long)ax);
    return fail(g, "%s: indices %s do not fit %s %s (the same rank; on axis %lld the same size, on every other the "
                "same size or 1)", name, SHAPE(idx), n->op == OP_SCATTER_ADD ? "src" : "dy", SHAPE(pos), (long long)ax);
  }
  n->shape = n->op == OP_GATHER ? pos : full;
  return true;
}

// Integer arithmetic: *dt = DT_I32 when node n computes on i32 values (NEG ABS ADD SUB MUL MINIMUM
// MAXIMUM FLOORDIV MOD COMPARE of i32 operands; WHERE of i32 branches, its condition any dtype; a CAST
// from i32), else DT_F32. False with g->err when its operands mix i32 and another dtype, or when an
// op that computes on i32 only (FLOORDIV, MOD) reads something else.
static bool int_dtype(Graph *g, const IrNode *n, DType *dt) {
  *dt = DT_F32;
  int first = 0, nops = n->nin;
  switch (n->op) {
  case OP_NEG: case OP_ABS: case OP_ADD: case OP_SUB: case OP_MUL: case OP_MINIMUM: case OP_MAXIMUM:
  case OP_FLOORDIV: case OP_MOD: case OP_COMPARE: break;
  case OP_WHERE: first = 1; break;
  case OP_CAST:
    if (n->nin == 1 && g->nodes[n->in[0]]->dtype == DT_I32)
      *dt = DT_I32;
    return true;
  default: return true;
  }
  int ints = 0;
  for (int i = first; i < nops; i++)
    ints += g->nodes[n->in[i]]->dtype == DT_I32;
  if (ints > 0 && ints < nops - first)
    return fail(g, "%s: operands %s and %s do not mix; convert one with float(x) or int(x)", op_name(n->op),
                dtype_name(g->nodes[n->in[first]]->dtype), dtype_name(g->nodes[n->in[nops - 1]]->dtype));
  if ((n->op == OP_FLOORDIV || n->op == OP_MOD) && ints == 0)
    return fail(g, "%s: needs i32 operands, got %s", op_name(n->op), dtype_name(g->nodes[n->in[first]]->dtype));
  if (ints)
    *dt = DT_I32;
  return true;
}

// Checks the inputs of node n and sets its shape and dtype.
static bool infer(Graph *g, IrNode *n) {
  IrNode *in[8] = {0};
  for (int i = 0; i < n->nin && i < 8; i++)
    in[i] = g->nodes[n->in[i]];
  const char *name = op_name(n->op);
  int want = -1; // exact input count, when fixed
  switch (n->op) {
  case OP_INPUT: case OP_PARAM: case OP_STATE: case OP_SCALAR: case OP_CONST: want = 0; break;
  case OP_NEG: case OP_EXP: case OP_LOG: case OP_TANH: case OP_SQRT: case OP_RSQRT: case OP_RELU:
  case OP_GELU: case OP_SILU: case OP_SIGMOID: case OP_ABS: case OP_CLAMP: case OP_STOP_GRADIENT:
  case OP_DROPOUT: case OP_CAST: case OP_SUM: case OP_MEAN: case OP_MAX:
  case OP_RESHAPE: case OP_PERMUTE: case OP_BROADCAST: case OP_SLICE: case OP_SLICE_BWD:
  case OP_SOFTMAX: case OP_TARGET_COUNT: case OP_TOPK: want = 1; break;
  case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_RELU_BWD: case OP_GELU_BWD:
  case OP_SILU_BWD: case OP_ABS_BWD: case OP_CLAMP_BWD: case OP_MATMUL: case OP_EMBED: case OP_EMBED_BWD:
  case OP_RMSNORM: case OP_COMPARE: case OP_MINIMUM: case OP_MAXIMUM: case OP_FLOORDIV: case OP_MOD:
  case OP_SOFTMAX_BWD: case OP_CROSS_ENTROPY: case OP_ROPE: case OP_GATHER: case OP_GATHER_BWD: want = 2; break;
  case OP_MAX_BWD: case OP_LAYERNORM: case OP_LAYERNORM_BWD: case OP_RMSNORM_BWD: case OP_WHERE:
  case OP_CROSS_ENTROPY_BWD: case OP_SCATTER_ADD: want = 3; break;
  case OP_ATTENTION: case OP_ATTENTION_LSE: want = 3 + (n->ia[2] != 0); break;
  case OP_ATTENTION_BWD: want = 6 + (n->ia[2] != 0); break;
  case OP_ATTENTION_MASK: want = n->ia[1] != 0; break;
  case OP_ADAMW:
    if (n->ia[0] < OPT_ADAMW || n->ia[0] > OPT_MUON)
      return fail(g, "adamw: bad rule %lld", (long long)n->ia[0]);
    if (n->nin < 5 || n->nin > 7 || ((n->ia[0] == OPT_ADAMW || n->ia[0] == OPT_MUON) && n->nin != 7) ||
        (n->ia[0] == OPT_LION && n->nin != 6))
      return fail(g, "%s takes (p, g, moments, gnorm, lr, step): %d inputs is wrong", opt_rule_name(n->ia[0]), n->nin);
    break;
  case OP_CONCAT: case OP_GRAD_NORM:
    if (n->nin < 1)
      return fail(g, "%s needs at least one input", name);
    break;
  case OP_COUNT: return fail(g, "bad op");
  }
  if (want >= 0 && n->nin != want)
    return fail(g, "%s takes %d inputs, got %d", name, want, n->nin);
  // Layout ops carry any dtype; elsewhere inputs are float except the id operands named here, and
  // the integer arithmetic of int_dtype.
  bool layout = n->op == OP_RESHAPE || n->op == OP_PERMUTE || n->op == OP_SLICE || n->op == OP_SLICE_BWD ||
                n->op == OP_CONCAT || n->op == OP_BROADCAST;
  DType idt;
  if (!int_dtype(g, n, &idt))
    return false;
  for (int i = 0; i < n->nin && !layout && idt != DT_I32; i++) {
    bool ids = (n->op == OP_EMBED && i == 1) || (n->op == OP_EMBED_BWD && i == 0) ||
               ((n->op == OP_CROSS_ENTROPY || n->op == OP_CROSS_ENTROPY_BWD) && i == 1) || n->op == OP_TARGET_COUNT ||
               (n->op == OP_ROPE && i == 1) || (n->op == OP_GATHER && i == 1) ||
               (n->op == OP_GATHER_BWD && i == 0) || (n->op == OP_SCATTER_ADD && i == 1) ||
               ((n->op == OP_ATTENTION || n->op == OP_ATTENTION_LSE || n->op == OP_ATTENTION_BWD) && n->ia[2] &&
                i == 3) ||
               n->op == OP_ATTENTION_MASK;
    DType dt = g->nodes[n->in[i]]->dtype;
    if (n->op == OP_WHERE && i == 0 && dt == DT_I32) // a condition may be an integer
      continue;
    if (ids && dt != DT_I32)
      return fail(g, "%s: ids must be i32, got %s", name, dtype_name(dt));
    if (!ids && !is_float(dt))
      return fail(g, "%s: expected a float tensor, got %s%s", name, dtype_name(dt),
                  dt == DT_I32 ? " (float(x) converts it)" : "");
    // Rounded values feed GEMMs only, the products of bf16 attention (its q, k, v, and the
    // backward's out and dout) and the logits of a cross-entropy: every other op computes on f32
    // (and the back ends load f32).
    bool ce16 = (n->op == OP_CROSS_ENTROPY || n->op == OP_CROSS_ENTROPY_BWD) && i == 0 && dt == DT_BF16;
    bool attn = n->op == OP_ATTENTION || n->op == OP_ATTENTION_LSE || n->op == OP_ATTENTION_BWD;
    bool att16 = attn && n->ia[4] == DT_BF16 && dt == DT_BF16 &&
                 (i < 3 || (n->op == OP_ATTENTION_BWD && (i == n->nin - 1 || i == n->nin - 3)));
    if (dt != DT_F32 && dt != DT_I32 && n->op != OP_MATMUL && n->op != OP_CAST && !att16 && !ce16)
      return fail(g, "%s: reads a %s value; only matmul, cast, a cross-entropy's logits and the products of a bf16 "
                  "attention (q, k, v, and the backward's out and dout) read values narrower than f32", name,
                  dtype_name(dt));
  }
  if (layout)
    n->dtype = in[0]->dtype;
  else if (n->op == OP_CAST)
    n->dtype = (DType)n->ia[0];
  else if (n->op == OP_TOPK)
    n->dtype = DT_I32;
  else if (idt == DT_I32)
    n->dtype = n->op == OP_COMPARE ? DT_F32 : DT_I32;
  else if (n->op != OP_INPUT && n->op != OP_CONST) // (a CONST is f32 or i32: ir_const, ir_const_i32)
    n->dtype = DT_F32;

  switch (n->op) {
  case OP_INPUT: case OP_PARAM: case OP_STATE: case OP_SCALAR: case OP_CONST:
    return true; // set by the constructor
  case OP_NEG: case OP_EXP: case OP_LOG: case OP_TANH: case OP_SQRT: case OP_RSQRT: case OP_RELU:
  case OP_GELU: case OP_SILU: case OP_SIGMOID: case OP_ABS: case OP_CLAMP: case OP_STOP_GRADIENT:
  case OP_DROPOUT: case OP_SOFTMAX:
    if (n->op == OP_CLAMP && !(n->fa[0] <= n->fa[1]))
      return fail(g, "clamp: min %g is above max %g", n->fa[0], n->fa[1]);
    if (n->op == OP_DROPOUT && (n->fa[0] < 0 || n->fa[0] >= 1))
      return fail(g, "dropout probability %g is not in [0, 1)", n->fa[0]);
    if (n->op == OP_SOFTMAX && in[0]->shape.rank < 1)
      return fail(g, "softmax of a scalar");
    n->shape = in[0]->shape;
    return true;
  case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_COMPARE: case OP_MINIMUM: case OP_MAXIMUM:
  case OP_FLOORDIV: case OP_MOD:
    if (n->op == OP_COMPARE && (n->ia[0] < CMP_LT || n->ia[0] > CMP_NE))
      return fail(g, "compare: bad relation %lld", (long long)n->ia[0]);
    if (!broadcast_shapes(in[0]->shape, in[1]->shape, &n->shape))
      return fail(g, "cannot broadcast %s with %s", SHAPE(in[0]->shape), SHAPE(in[1]->shape));
    return true;
  case OP_WHERE: {
    Shape ab;
    if (!broadcast_shapes(in[1]->shape, in[2]->shape, &ab) || !broadcast_shapes(in[0]->shape, ab, &n->shape))
      return fail(g, "where: cannot broadcast %s, %s and %s", SHAPE(in[0]->shape), SHAPE(in[1]->shape),
                  SHAPE(in[2]->shape));
    return true;
  }
  case OP_RELU_BWD: case OP_GELU_BWD: case OP_SILU_BWD: case OP_ABS_BWD: case OP_CLAMP_BWD:
  case OP_SOFTMAX_BWD:
    if (!shape_eq(in[0]->shape, in[1]->shape))
      return fail(g, "%s: shapes %s and %s differ", name, SHAPE(in[0]->shape), SHAPE(in[1]->shape));
    n->shape = in[0]->shape;
    return true;
  case OP_SUM: case OP_MEAN: case OP_MAX: case OP_MAX_BWD: {
    Shape x = in[0]->shape;
    if (n->ia[0] < 0 || n->ia[0] >= x.rank)
      return fail(g, "%s: axis %lld out of range for %s", name, (long long)n->ia[0], SHAPE(x));
    if (n->op == OP_MAX_BWD) {
      n->shape = x;
      return true;
    }
    n->shape = x;
    if (n->ia[1])
      n->shape.d[n->ia[0]] = 1;
    else {
      for (int i = (int)n->ia[0]; i + 1 < x.rank; i++)
        n->shape.d[i] = x.d[i + 1];
      n->shape.rank--;
    }
    return true;
  }
  case OP_RESHAPE:
    if (shape_numel(n->shape) != shape_numel(in[0]->shape))
      return fail(g, "cannot reshape %s (%lld elements) to %s (%lld elements)", SHAPE(in[0]->shape),
                  (long long)shape_numel(in[0]->shape), SHAPE(n->shape), (long long)shape_numel(n->shape));
    return true;
  case OP_PERMUTE: {
    Shape x = in[0]->shape;
    bool seen[IR_MAX_RANK] = {0};
    n->shape.rank = x.rank;
    for (int i = 0; i < x.rank; i++) {
      int64_t p = n->ia[i];
      if (p < 0 || p >= x.rank || seen[p])
        return fail(g, "permute: not a permutation of %d axes", x.rank);
      seen[p] = true;
      n->shape.d[i] = x.d[p];
    }
    return true;
  }
  case OP_BROADCAST: {
    Shape out;
    if (!broadcast_shapes(in[0]->shape, n->shape, &out) || !shape_eq(out, n->shape))
      return fail(g, "cannot broadcast %s to %s", SHAPE(in[0]->shape), SHAPE(n->shape));
    return true;
  }
  case OP_SLICE: {
    Shape x = in[0]->shape;
    int64_t ax = n->ia[0], s = n->ia[1], e = n->ia[2];
    if (ax < 0 || ax >= x.rank)
      return fail(g, "slice: axis %lld out of range for %s", (long long)ax, SHAPE(x));
    if (s < 0 || e > x.d[ax] || s >= e)
      return fail(g, "slice %lld:%lld is empty or out of range for axis %lld of size %lld", (long long)s,
                  (long long)e, (long long)ax, (long long)x.d[ax]);
    n->shape = x;
    n->shape.d[ax] = e - s;
    return true;
  }
  case OP_SLICE_BWD: {
    Shape x = in[0]->shape;
    int64_t ax = n->ia[0];
    if (ax < 0 || ax >= n->shape.rank || x.rank != n->shape.rank || n->ia[2] - n->ia[1] != x.d[ax])
      return fail(g, "slice_bwd: %s does not fit %s", SHAPE(x), SHAPE(n->shape));
    return true;
  }
  case OP_CONCAT: {
    Shape x = in[0]->shape;
    int64_t ax = n->ia[0];
    if (ax < 0 || ax >= x.rank)
      return fail(g, "concat: axis %lld out of range for %s", (long long)ax, SHAPE(x));
    n->shape = x;
    n->shape.d[ax] = 0;
    for (int i = 0; i < n->nin; i++) {
      Shape y = g->nodes[n->in[i]]->shape;
      Shape a = x, b = y;
      if (a.rank == b.rank)
        a.d[ax] = b.d[ax] = 0;
      if (!shape_eq(a, b))
        return fail(g, "concat: shapes %s and %s differ outside axis %lld", SHAPE(x), SHAPE(y), (long long)ax);
      n->shape.d[ax] += y.d[ax];
    }
    return true;
  }
  case OP_CAST:
    if (n->ia[0] != DT_F32 && n->ia[0] != DT_BF16 && n->ia[0] != DT_I32 && !is_fp8((DType)n->ia[0]))
      return fail(g, "cast to %s: only f32, bf16, fp8 and i32 are supported", dtype_name((DType)n->ia[0]));
    if (is_fp8((DType)n->ia[0]) && (in[0]->dtype != DT_F32 || n->ia[1] < 0 || n->ia[1] >= g->nfp8 ||
                                    g->fp8[n->ia[1]].fmt != n->ia[0]))
      return fail(g, "cast to %s: needs an f32 value and a scaled tensor of that format (ia[1] = %lld of %d)",
                  dtype_name((DType)n->ia[0]), (long long)n->ia[1], g->nfp8);
    if ((in[0]->dtype == DT_I32 && n->ia[0] != DT_F32) || (n->ia[0] == DT_I32 && in[0]->dtype != DT_F32))
      return fail(g, "cast from %s to %s: i32 converts to and from f32 only", dtype_name(in[0]->dtype),
                  dtype_name((DType)n->ia[0]));
    n->shape = in[0]->shape;
    return true;
  case OP_MATMUL: {
    Shape a = in[0]->shape, b = in[1]->shape;
    if (in[0]->dtype != in[1]->dtype && !(is_fp8(in[0]->dtype) && is_fp8(in[1]->dtype)))
      return fail(g, "matmul operands are %s and %s; both must have one dtype (or both an fp8 one)",
                  dtype_name(in[0]->dtype), dtype_name(in[1]->dtype));
    for (int k = 0; k < 2; k++)
      if (is_fp8(in[k]->dtype) && (n->ia[2 + k] < 0 || n->ia[2 + k] >= g->nfp8 ||
                                   g->fp8[n->ia[2 + k]].fmt != in[k]->dtype))
        return fail(g, "matmul: fp8 operand %d names scaled tensor %lld of %d, not one of its format", k,
                    (long long)n->ia[2 + k], g->nfp8);
    if (a.rank < 2 || b.rank < 2)
      return fail(g, "matmul needs operands of rank 2 or more, got %s and %s", SHAPE(a), SHAPE(b));
    int64_t m = n->ia[0] ? a.d[a.rank - 1] : a.d[a.rank - 2];
    int64_t ka = n->ia[0] ? a.d[a.rank - 2] : a.d[a.rank - 1];
    int64_t kb = n->ia[1] ? b.d[b.rank - 1] : b.d[b.rank - 2];
    int64_t nn = n->ia[1] ? b.d[b.rank - 2] : b.d[b.rank - 1];
    if (ka != kb)
      return fail(g, "matmul shapes %s%s and %s%s do not match (inner dimensions %lld and %lld)", SHAPE(a),
                  n->ia[0] ? ".T" : "", SHAPE(b), n->ia[1] ? ".T" : "", (long long)ka, (long long)kb);
    Shape ba = {.rank = a.rank - 2}, bb = {.rank = b.rank - 2};
    memcpy(ba.d, a.d, sizeof(int64_t) * (size_t)ba.rank);
    memcpy(bb.d, b.d, sizeof(int64_t) * (size_t)bb.rank);
    if (!broadcast_shapes(ba, bb, &n->shape))
      return fail(g, "matmul batch axes %s and %s do not broadcast", SHAPE(a), SHAPE(b));
    n->shape.d[n->shape.rank++] = m;
    n->shape.d[n->shape.rank++] = nn;
    return true;
  }
  case OP_EMBED: {
    Shape t = in[0]->shape, ids = in[1]->shape;
    if (t.rank != 2)
      return fail(g, "embed: table must be 2-D, got %s", SHAPE(t));
    if (ids.rank + 1 > IR_MAX_RANK)
      return fail(g, "embed: ids of rank %d are too many axes", ids.rank);
    n->shape = ids;
    n->shape.d[n->shape.rank++] = t.d[1];
    return true;
  }
  case OP_EMBED_BWD: {
    Shape ids = in[0]->shape, dy = in[1]->shape;
    Shape want = ids;
    want.d[want.rank++] = n->shape.d[1];
    if (n->shape.rank != 2 || !shape_eq(want, dy))
      return fail(g, "embed_bwd: gradient %s does not match ids %s", SHAPE(dy), SHAPE(ids));
    return true;
  }
  case OP_TOPK: case OP_GATHER: case OP_GATHER_BWD: case OP_SCATTER_ADD:
    return routing_shape(g, n, in);
  case OP_LAYERNORM: case OP_RMSNORM: case OP_LAYERNORM_BWD: case OP_RMSNORM_BWD: {
    Shape x = in[0]->shape;
    if (x.rank < 1)
      return fail(g, "%s of a scalar", name);
    int64_t c = x.d[x.rank - 1];
    Shape w = in[1]->shape;
    if (w.rank != 1 || w.d[0] != c)
      return fail(g, "%s: weight %s does not match the last axis of %s", name, SHAPE(w), SHAPE(x));
    if (n->op == OP_LAYERNORM && !shape_eq(in[2]->shape, w))
      return fail(g, "%s: bias %s does not match the last axis of %s", name, SHAPE(in[2]->shape), SHAPE(x));
    if ((n->op == OP_LAYERNORM_BWD || n->op == OP_RMSNORM_BWD) && !shape_eq(in[2]->shape, x))
      return fail(g, "%s: gradient %s does not match %s", name, SHAPE(in[2]->shape), SHAPE(x));
    n->shape = (n->op == OP_LAYERNORM_BWD || n->op == OP_RMSNORM_BWD) && n->ia[0] ? w : x;
    return true;
  }
  case OP_CROSS_ENTROPY: case OP_CROSS_ENTROPY_BWD: {
    Shape l = in[0]->shape, t = in[1]->shape;
    Shape want = l;
    want.rank--;
    if (l.rank < 1 || !shape_eq(want, t))
      return fail(g, "cross_entropy: targets %s do not match logits %s", SHAPE(t), SHAPE(l));
    if (n->op == OP_CROSS_ENTROPY_BWD && !shape_eq(in[2]->shape, t))
      return fail(g, "cross_entropy_bwd: gradient %s does not match %s", SHAPE(in[2]->shape), SHAPE(t));
    n->shape = n->op == OP_CROSS_ENTROPY ? t : l;
    return true;
  }
  case OP_TARGET_COUNT:
    n->shape = (Shape){0};
    return true;
  case OP_ATTENTION: case OP_ATTENTION_LSE: case OP_ATTENTION_BWD: {
    Shape q = in[0]->shape;
    if (!attention_shapes(g, q, in[1]->shape, in[2]->shape, n->ia[2] ? &in[3]->shape : NULL, n->ia[0],
                          att_kv_heads(n), n->ia[1], n->ia[6]))
      return false;
    Shape lse = shape_of(3, (int64_t[]){q.d[0], n->ia[0], q.d[1]});
    if (n->op == OP_ATTENTION_BWD) {
      if (!shape_eq(in[n->nin - 1]->shape, q))
        return fail(g, "attention_bwd: gradient %s does not match %s", SHAPE(in[n->nin - 1]->shape), SHAPE(q));
      if (!shape_eq(in[n->nin - 3]->shape, q))
        return fail(g, "attention_bwd: output %s does not match %s", SHAPE(in[n->nin - 3]->shape), SHAPE(q));
      if (!shape_eq(in[n->nin - 2]->shape, lse))
        return fail(g, "attention_bwd: lse %s, not %s", SHAPE(in[n->nin - 2]->shape), SHAPE(lse));
    }
    n->shape = n->op == OP_ATTENTION_LSE ? lse : n->op == OP_ATTENTION_BWD && n->ia[3] ? in[1]->shape : q;
    return true;
  }
  case OP_ATTENTION_MASK: {
    Shape m = n->shape;
    if (n->ia[1]) {
      Shape d = in[0]->shape;
      if (d.rank != 2)
        return fail(g, "attention_mask: doc ids must be [B,T], got %s", SHAPE(d));
      n->shape = shape_of(4, (int64_t[]){d.d[0], 1, d.d[1], d.d[1]});
    } else if (m.rank != 4 || m.d[0] != 1 || m.d[1] != 1 || m.d[2] != m.d[3]) {
      return fail(g, "attention_mask: without doc ids the mask is [1,1,T,T], not %s", SHAPE(m));
    }
    return true;
  }
  case OP_ROPE: {
    Shape x = in[0]->shape, p = in[1]->shape;
    if (x.rank != 3 || p.rank != 2 || p.d[0] != x.d[0] || p.d[1] != x.d[1])
      return fail(g, "rope: x must be [B,T,C] and pos [B,T], got %s and %s", SHAPE(x), SHAPE(p));
    if (n->ia[0] <= 0 || x.d[2] % n->ia[0] || (x.d[2] / n->ia[0]) % 2)
      return fail(g, "rope: %lld heads must split width %lld into even head sizes", (long long)n->ia[0],
                  (long long)x.d[2]);
    n->shape = x;
    return true;
  }
  case OP_GRAD_NORM:
    n->shape = (Shape){0};
    return true;
  case OP_ADAMW: {
    Shape p = in[0]->shape;
    for (int i = 1; i < n->nin - 3; i++)
      if (!shape_eq(in[i]->shape, p))
        return fail(g, "adamw: %s input %d does not match parameter %s", SHAPE(in[i]->shape), i, SHAPE(p));
    for (int i = n->nin - 3; i < n->nin; i++)
      if (in[i]->shape.rank != 0)
        return fail(g, "adamw: input %d must be a scalar", i);
    n->shape = p;
    return true;
  }
  case OP_COUNT: break;
  }
  return fail(g, "bad op");
}

static IrNode *new_node(Graph *g, Op op, const int *in, int nin, SrcLoc loc) {
  if (g->n == g->cap) {
    int cap = g->cap ? 2 * g->cap : 256;
    IrNode **nodes = arena_alloc(g->arena, sizeof(IrNode *) * (size_t)cap);
    if (g->n)
      memcpy(nodes, g->nodes, sizeof(IrNode *) * (size_t)g->n);
    g->nodes = nodes;
    g->cap = cap;
  }
  IrNode *n = arena_alloc(g->arena, sizeof *n);
  n->id = g->n;
  n->op = op;
  n->loc = loc;
  n->grad_of = n->param_of = -1;
  n->body = g->cur_body;
  n->nin = nin;
  n->in = arena_alloc(g->arena, sizeof(int) * (size_t)(nin ? nin : 1));
  if (nin)
    memcpy(n->in, in, sizeof(int) * (size_t)nin);
  return n;
}

// Whether a shape has at most IR_MAX_NUMEL elements; else its count, or "more than 2^63" where the
// product overflows.
static bool shape_fits(Shape s, char *count, size_t len) {
  int64_t n = 1;
  bool overflow = false;
  for (int i = 0; i < s.rank; i++)
    overflow = overflow || s.d[i] < 0 || __builtin_mul_overflow(n, s.d[i], &n);
  if (!overflow && n <= IR_MAX_NUMEL)
    return true;
  if (overflow)
    snprintf(count, len, "more than 2^63");
  else
    snprintf(count, len, "%lld", (long long)n);
  return false;
}

// Appends n unless infer() rejects it or its shape is too large for the sizes computed from it.
static int commit(Graph *g, IrNode *n) {
  for (int i = 0; i < n->nin; i++)
    if (n->in[i] < 0 || n->in[i] >= g->n) {
      fail(g, "%s: input %d refers to no node", op_name(n->op), i);
      return -1;
    }
  if (!infer(g, n))
    return -1;
  char count[32];
  if (!shape_fits(n->shape, count, sizeof count)) {
    fail(g, "%s: the result %s has %s elements; a tensor may have at most 2^36 (%lld)", op_name(n->op),
         SHAPE(n->shape), count, (long long)IR_MAX_NUMEL);
    return -1;
  }
  g->nodes[g->n++] = n;
  return n->id;
}

int ir_add(Graph *g, Op op, const int *in, int nin, const int64_t ia[IR_NIA], const double fa[IR_NFA], SrcLoc loc) {
  IrNode *n = new_node(g, op, in, nin, loc);
  if (ia)
    memcpy(n->ia, ia, sizeof n->ia);
  if (fa)
    memcpy(n->fa, fa, sizeof n->fa);
  return commit(g, n);
}

int ir_leaf(Graph *g, Op op, const char *name, DType dt, Shape s, SrcLoc loc) {
  IrNode *n = new_node(g, op, NULL, 0, loc);
  n->name = name;
  n->dtype = dt;
  n->shape = s;
  int id = commit(g, n);
  int k = g->nparams;
  if (id >= 0 && op == OP_PARAM) {
    if (k == 0 || (k >= 8 && (k & (k - 1)) == 0)) { // the array is full: capacity 8, then doubled
      int *p = arena_alloc(g->arena, sizeof(int) * (size_t)(k ? 2 * k : 8));
      if (k)
        memcpy(p, g->params, sizeof(int) * (size_t)k);
      g->params = p;
    }
    g->params[g->nparams++] = id;
  }
  return id;
}

int ir_const_i32(Graph *g, int32_t v, SrcLoc loc) {
  IrNode *n = new_node(g, OP_CONST, NULL, 0, loc);
  n->dtype = DT_I32;
  n->fa[0] = v;
  return commit(g, n);
}

int ir_const(Graph *g, double v, SrcLoc loc) {
  IrNode *n = new_node(g, OP_CONST, NULL, 0, loc);
  n->dtype = DT_F32;
  n->fa[0] = v;
  return commit(g, n);
}

static int shaped(Graph *g, Op op, int x, Shape s, const int64_t ia[IR_NIA], SrcLoc loc) {
  IrNode *n = new_node(g, op, &x, 1, loc);
  n->shape = s;
  if (ia)
    memcpy(n->ia, ia, sizeof n->ia);
  return commit(g, n);
}

int ir_reshape(Graph *g, int x, Shape s, SrcLoc loc) { return shaped(g, OP_RESHAPE, x, s, NULL, loc); }
int ir_broadcast(Graph *g, int x, Shape s, SrcLoc loc) { return shaped(g, OP_BROADCAST, x, s, NULL, loc); }

int ir_slice_bwd(Graph *g, int dy, Shape full, int axis, int64_t start, int64_t end, SrcLoc loc) {
  return shaped(g, OP_SLICE_BWD, dy, full, (int64_t[8]){axis, start, end}, loc);
}

int ir_embed_bwd(Graph *g, int ids, int dy, int64_t vocab, SrcLoc loc) {
  IrNode *n = new_node(g, OP_EMBED_BWD, (int[]){ids, dy}, 2, loc);
  n->shape = (Shape){.rank = 2, .d = {vocab, g->nodes[dy]->shape.d[g->nodes[dy]->shape.rank - 1]}};
  return commit(g, n);
}

int ir_attention_mask(Graph *g, int doc, int64_t t, bool causal, int64_t window, SrcLoc loc) {
  IrNode *n = new_node(g, OP_ATTENTION_MASK, &doc, doc >= 0, loc);
  n->shape = shape_of(4, (int64_t[]){1, 1, t, t});
  n->ia[0] = causal;
  n->ia[1] = doc >= 0;
  n->ia[2] = window;
  return commit(g, n);
}

void ir_eval_mode(Graph *g) {
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_DROPOUT)
      g->nodes[i]->fa[0] = 0;
}

int64_t ir_param_count(const Graph *g) {
  int64_t n = 0;
  for (int i = 0; i < g->nparams; i++)
    n += shape_numel(g->nodes[g->params[i]]->shape);
  return n;
}

// Re-infers every node from scratch (on a copy) and checks that the graph is a DAG in order.
bool ir_validate(const Graph *g, char *why, size_t len) {
  Graph tmp = *g;
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->id != i) {
      snprintf(why, len, "node %d carries id %d", i, n->id);
      return false;
    }
    for (int k = 0; k < n->nin; k++)
      if (n->in[k] < 0 || n->in[k] >= i) {
        snprintf(why, len, "node %d (%s): input %d is %d, not an earlier node", i, op_name(n->op), k, n->in[k]);
        return false;
      }
    IrNode copy = *n;
    tmp.n = i;
    if (!infer(&tmp, &copy)) {
      snprintf(why, len, "node %d (%s): %s", i, op_name(n->op), tmp.err);
      return false;
    }
    if (!shape_eq(copy.shape, n->shape) || copy.dtype != n->dtype) {
      char a[128], b[128];
      snprintf(why, len, "node %d (%s): recorded %s %s, inferred %s %s", i, op_name(n->op), dtype_name(n->dtype),
               shape_str(n->shape, a, sizeof a), dtype_name(copy.dtype), shape_str(copy.shape, b, sizeof b));
      return false;
    }
  }
  for (int i = 0; i < g->nparams; i++)
    if (g->params[i] < 0 || g->params[i] >= g->n || g->nodes[g->params[i]]->op != OP_PARAM) {
      snprintf(why, len, "params[%d] is not a param node", i);
      return false;
    }
  if (g->loss >= g->n || (g->loss >= 0 && g->nodes[g->loss]->shape.rank != 0)) {
    snprintf(why, len, "the loss is not a scalar node");
    return false;
  }
  return true;
}

// One line per node: "%12 = matmul(%10, %11) [T=1] f32[512,192]  # x (gpt2.mdl:30)"
void ir_dump(const Graph *g, FILE *f) {
  fprintf(f, "graph %s: %d nodes (%d forward), %d params, %lld parameters\n", g->model ? g->model : "?", g->n,
          g->fwd_end, g->nparams, (long long)ir_param_count(g));
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    char buf[128];
    if (i == g->fwd_end && g->fwd_end < g->n)
      fprintf(f, "# backward\n");
    fprintf(f, "%%%d = %s", i, op_name(n->op));
    if (n->nin) {
      fprintf(f, "(");
      for (int k = 0; k < n->nin; k++)
        fprintf(f, "%s%%%d", k ? ", " : "", n->in[k]);
      fprintf(f, ")");
    }
    switch (n->op) {
    case OP_INPUT: case OP_PARAM: case OP_STATE: case OP_SCALAR: fprintf(f, " '%s'", n->name); break;
    case OP_CONST: fprintf(f, " %.9g", n->fa[0]); break;
    case OP_SUM: case OP_MEAN: case OP_MAX: case OP_MAX_BWD:
      fprintf(f, " axis=%lld%s", (long long)n->ia[0], n->ia[1] ? " keepdim" : "");
      break;
    case OP_PERMUTE:
      fprintf(f, " [");
      for (int k = 0; k < n->shape.rank; k++)
        fprintf(f, "%s%lld", k ? "," : "", (long long)n->ia[k]);
      fprintf(f, "]");
      break;
    case OP_SLICE: case OP_SLICE_BWD:
      fprintf(f, " axis=%lld %lld:%lld", (long long)n->ia[0], (long long)n->ia[1], (long long)n->ia[2]);
      break;
    case OP_CONCAT: fprintf(f, " axis=%lld", (long long)n->ia[0]); break;
    case OP_MATMUL:
      fprintf(f, "%s%s", n->ia[0] ? " a.T" : "", n->ia[1] ? " b.T" : "");
      for (int k = 0; k < 2; k++) {
        DType dt = g->nodes[n->in[k]]->dtype;
        if (is_fp8(dt))
          fprintf(f, " %c=%s#%lld", "ab"[k], dtype_name(dt), (long long)n->ia[2 + k]);
        else if (g->nfp8 && k == 0)
          fprintf(f, " %s (%s)", dtype_name(dt), n->why ? n->why : "?");
      }
      break;
    case OP_DROPOUT: fprintf(f, " p=%g stream=%lld", n->fa[0], (long long)n->ia[0]); break;
    case OP_CAST:
      fprintf(f, " to=%s", dtype_name((DType)n->ia[0]));
      if (is_fp8((DType)n->ia[0]))
        fprintf(f, " scaled#%lld", (long long)n->ia[1]);
      break;
    case OP_LAYERNORM: case OP_RMSNORM: fprintf(f, " eps=%g", n->fa[0]); break;
    case OP_LAYERNORM_BWD: case OP_RMSNORM_BWD:
      fprintf(f, " eps=%g which=%lld", n->fa[0], (long long)n->ia[0]);
      break;
    case OP_ATTENTION: case OP_ATTENTION_LSE: case OP_ATTENTION_BWD:
      fprintf(f, " heads=%lld%s%s scale=%g", (long long)n->ia[0], n->ia[1] ? " causal" : "",
              n->ia[2] ? " doc" : "", n->fa[0]);
      if (att_kv_heads(n) != n->ia[0])
        fprintf(f, " kv_heads=%lld", (long long)att_kv_heads(n));
      if (n->ia[6])
        fprintf(f, " window=%lld", (long long)n->ia[6]);
      if (n->op == OP_ATTENTION_BWD)
        fprintf(f, " which=%lld", (long long)n->ia[3]);
      if (n->ia[4] == DT_BF16)
        fprintf(f, " bf16");
      break;
    case OP_ATTENTION_MASK:
      fprintf(f, "%s%s", n->ia[0] ? " causal" : "", n->ia[1] ? " doc" : "");
      if (n->ia[2])
        fprintf(f, " window=%lld", (long long)n->ia[2]);
      break;
    case OP_ROPE:
      fprintf(f, " heads=%lld base=%g%s", (long long)n->ia[0], n->fa[0], n->ia[1] ? " inverse" : "");
      break;
    case OP_ADAMW:
      if (n->ia[0] == OPT_SGD)
        fprintf(f, " sgd momentum=%g%s wd=%g clip=%g", n->fa[0], n->fa[1] != 0 ? " nesterov" : "", n->fa[3], n->fa[4]);
      else if (n->ia[0] == OPT_LION)
        fprintf(f, " lion b1=%g b2=%g wd=%g clip=%g", n->fa[0], n->fa[1], n->fa[3], n->fa[4]);
      else if (n->ia[0] == OPT_MUON)
        fprintf(f, " muon momentum=%g scale=%g wd=%g clip=%g", n->fa[0], n->fa[2], n->fa[3], n->fa[4]);
      else
        fprintf(f, " b1=%g b2=%g eps=%g wd=%g clip=%g", n->fa[0], n->fa[1], n->fa[2], n->fa[3], n->fa[4]);
      if (opt_lr_scale(n) != 1)
        fprintf(f, " lr_scale=%g", opt_lr_scale(n));
      break;
    default: break;
    }
    fprintf(f, " %s%s", dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf));
    if (n->op == OP_PARAM)
      fprintf(f, " init=%s", n->init.kind == INIT_NORMAL ? "normal" : n->init.kind == INIT_ONES ? "ones" : "zeros");
    if (n->op == OP_PARAM && n->init.kind == INIT_NORMAL)
      fprintf(f, "(%g)", n->init.std);
    if (n->op == OP_PARAM && !n->init.decay)
      fprintf(f, " no_decay");
    if (n->grad_of >= 0)
      fprintf(f, "  # d %s", g->nodes[n->grad_of]->name ? g->nodes[n->grad_of]->name : "?");
    else if (n->name && n->op != OP_INPUT && n->op != OP_PARAM && n->op != OP_STATE && n->op != OP_SCALAR)
      fprintf(f, "  # %s", n->name);
    if (n->loc.line > 0)
      fprintf(f, "  (line %d)", n->loc.line);
    fprintf(f, "\n");
  }
  if (g->loss >= 0)
    fprintf(f, "loss = %%%d\n", g->loss);
  if (g->nfp8)
    fprintf(f, "fp8: %d scaled tensors, scales from %lld steps of amax history, margin 2^%d\n", g->nfp8,
            (long long)g->train.amax_history, FP8_MARGIN);
  for (int i = 0; i < g->nfp8; i++)
    fprintf(f, "fp8 #%d %s %s  (line %d)\n", i, dtype_name(g->fp8[i].fmt), g->fp8[i].name, g->fp8[i].loc.line);
}
