// autodiff.c: reverse-mode differentiation of the forward graph, then the optimizer step.
//
// The forward graph is nodes [0, fwd_end), already in topological order, so the backward pass is
// one sweep over those ids from the loss downwards. Every node on a path from a PARAM to the loss
// gets one gradient node, appended to the same graph with the IR's own ops: simple derivatives are
// spelled with elementwise ops on nodes that already exist (d tanh = dy * (1 - y * y)), the others
// use the dedicated *_BWD ops, and a node used several times sums its contributions with ADD.
// Contributions are kept per node until its gradient is complete (its id is reached in the sweep,
// so every consumer has been visited); then they are added in the order they came, and the sum is
// named "d.NAME" after the forward value it differentiates. A SLICE contributes its output's
// gradient zero-padded back to the input's shape (SLICE_BWD); when SLICEs of one axis that tile it
// are all a node's contributions (GPT-2's q, k, v = split(qkv)), its gradient is the CONCAT of
// theirs, read once per element instead of a sum of mostly zeros.
//
// Broadcasting in the forward graph (ADD/SUB/MUL/DIV operands, BROADCAST, MATMUL batch axes) is
// undone on the way back by summing the gradient over the broadcast axes with keepdim and then
// reshaping it to the operand's shape.
//
// With the optimizer requested, the gradients feed one GRAD_NORM node (global clipping) and one
// ADAMW node (the update, whichever its rule) per parameter, each with its STATE moments and the
// "lr"/"step" SCALAR leaves. A frozen parameter (train section's freeze) is no gradient's source:
// nothing is differentiated for it alone, it has no gradient node (g->grads[i] -1), no update and
// no moments, and stays out of the gradient norm.
#include "mdl.h"

#include <string.h>

// A contribution to a node's gradient: node, or with axis >= 0 the gradient `node` of a SLICE of
// [start, end) on axis.
typedef struct {
  int node, axis;
  int64_t start, end;
} Part;

typedef struct {
  Graph *g;
  int *grad;        // grad[i]: gradient node of forward node i once complete (grad_of), or -1
  Part **parts;     // parts[i][0 .. nparts[i]): its contributions until then, in order
  int *nparts, *capparts;
  bool *active;     // forward node depends on a PARAM and leads to the loss
  SrcLoc loc;       // loc of the forward node being differentiated
  const char *what; // its op name, for error messages
  bool failed;      // an ir_add failed; g->err says why
} Ad;

// Node constructors. Each propagates a failed input (-1) and records the first failure, so a rule
// can chain them and check once at the end.
static int add_node(Ad *ad, Op op, const int *in, int nin, const int64_t ia[IR_NIA], const double fa[IR_NFA]) {
  for (int i = 0; i < nin; i++)
    if (in[i] < 0)
      return -1;
  int id = ir_add(ad->g, op, in, nin, ia, fa, ad->loc);
  if (id < 0)
    ad->failed = true;
  return id;
}

static int unary(Ad *ad, Op op, int x) { return add_node(ad, op, &x, 1, NULL, NULL); }
static int binary(Ad *ad, Op op, int a, int b) { return add_node(ad, op, (int[]){a, b}, 2, NULL, NULL); }

static int constant(Ad *ad, double v) {
  int id = ir_const(ad->g, v, ad->loc);
  if (id < 0)
    ad->failed = true;
  return id;
}

// A reshape, or the same reshape of x the backward graph already has (a gradient is often
// flattened both for a bias and for a matmul).
static int reshape(Ad *ad, int x, Shape s) {
  if (x < 0)
    return -1;
  if (shape_eq(ad->g->nodes[x]->shape, s))
    return x;
  for (int i = ad->g->n - 1; i >= ad->g->fwd_end; i--) {
    IrNode *n = ad->g->nodes[i];
    if (n->op == OP_RESHAPE && n->in[0] == x && shape_eq(n->shape, s))
      return i;
  }
  int id = ir_reshape(ad->g, x, s, ad->loc);
  if (id < 0)
    ad->failed = true;
  return id;
}

static int broadcast(Ad *ad, int x, Shape s) {
  if (x < 0)
    return -1;
  if (shape_eq(ad->g->nodes[x]->shape, s))
    return x;
  int id = ir_broadcast(ad->g, x, s, ad->loc);
  if (id < 0)
    ad->failed = true;
  return id;
}

static int reduce(Ad *ad, Op op, int x, int axis, bool keepdim) {
  return add_node(ad, op, &x, 1, (int64_t[8]){axis, keepdim}, NULL);
}

static int matmul(Ad *ad, int a, int b, bool ta, bool tb) {
  return add_node(ad, OP_MATMUL, (int[]){a, b}, 2, (int64_t[8]){ta, tb}, NULL);
}

static Shape shape(Ad *ad, int id) { return ad->g->nodes[id]->shape; }

// Sums dy (shaped like a broadcast result) back to `to`: over the leading axes `to` lacks and over
// the axes where `to` has size 1, then reshapes to `to`. When those axes are all leading ones (a
// bias added to [B,T,C] activations), they are flattened into one and reduced by a single SUM.
static int unbroadcast(Ad *ad, int dy, Shape to) {
  if (dy < 0)
    return -1;
  Shape s = shape(ad, dy);
  int lead = s.rank - to.rank, prefix = 0;
  bool summed[IR_MAX_RANK], inner = false;
  for (int k = 0; k < s.rank; k++)
    summed[k] = k < lead || to.d[k - lead] == 1;
  while (prefix < s.rank && summed[prefix])
    prefix++;
  for (int k = prefix; k < s.rank; k++)
    inner |= summed[k] && s.d[k] != 1;
  if (!inner) {
    Shape flat = {.rank = s.rank - prefix + 1, .d = {1}};
    for (int k = 0; k < prefix; k++)
      flat.d[0] *= s.d[k];
    for (int k = prefix; k < s.rank; k++)
      flat.d[k - prefix + 1] = s.d[k];
    if (flat.d[0] != 1)
      dy = reduce(ad, OP_SUM, reshape(ad, dy, flat), 0, false);
    return reshape(ad, dy, to);
  }
  for (int k = 0; k < s.rank && dy >= 0; k++)
    if (summed[k] && s.d[k] != 1)
      dy = reduce(ad, OP_SUM, dy, k, true);
  return reshape(ad, dy, to);
}

// The inverse of a reduction over `axis` of x: dy brought back to x's shape (dy may have been
// reduced with or without keepdim).
static int unreduce(Ad *ad, int dy, int x, int axis) {
  Shape keep = shape(ad, x);
  keep.d[axis] = 1;
  return broadcast(ad, reshape(ad, dy, keep), shape(ad, x));
}

static void add_part(Ad *ad, int x, Part p) {
  if (ad->nparts[x] == ad->capparts[x]) {
    int cap = ad->capparts[x] ? 2 * ad->capparts[x] : 4;
    Part *grown = arena_alloc(ad->g->arena, sizeof *grown * (size_t)cap);
    if (ad->nparts[x])
      memcpy(grown, ad->parts[x], sizeof *grown * (size_t)ad->nparts[x]);
    ad->parts[x] = grown;
    ad->capparts[x] = cap;
  }
  ad->parts[x][ad->nparts[x]++] = p;
}

// Adds contribution c to the gradient of forward node x.
static void accumulate(Ad *ad, int x, int c) {
  if (c < 0) {
    ad->failed = true;
    return;
  }
  add_part(ad, x, (Part){c, -1, 0, 0});
}

// Do the contributions to x tile an axis of x with SLICE gradients, in order of start? Then
// order[] lists them so.
static bool tiled(Ad *ad, int x, int *order) {
  int n = ad->nparts[x];
  const Part *p = ad->parts[x];
  if (n < 2 || n > 64 || p[0].axis < 0)
    return false;
  int64_t at = 0, len = ad->g->nodes[x]->shape.d[p[0].axis];
  for (int k = 0; k < n; k++) { // the part starting at `at`, each in turn
    int found = -1;
    for (int j = 0; j < n; j++)
      if (p[j].axis == p[0].axis && p[j].start == at)
        found = j;
    if (found < 0)
      return false;
    order[k] = found;
    at = p[found].end;
  }
  return at == len;
}

// The gradient of forward node x, complete: its contributions added in the order they came (a
// SLICE's as SLICE_BWD), or the CONCAT of SLICE gradients that tile an axis; -1 when it has none.
static int grad_of(Ad *ad, int x) {
  if (ad->grad[x] >= 0 || ad->nparts[x] == 0)
    return ad->grad[x];
  const Part *p = ad->parts[x];
  int order[64];
  if (tiled(ad, x, order)) {
    int in[64];
    for (int k = 0; k < ad->nparts[x]; k++)
      in[k] = p[order[k]].node;
    ad->grad[x] = add_node(ad, OP_CONCAT, in, ad->nparts[x], (int64_t[8]){p[0].axis}, NULL);
  } else {
    int sum = -1;
    for (int k = 0; k < ad->nparts[x]; k++) {
      int c = p[k].axis < 0 ? p[k].node
                            : ir_slice_bwd(ad->g, p[k].node, shape(ad, x), p[k].axis, p[k].start, p[k].end, ad->loc);
      sum = c < 0 || sum < 0 ? c : binary(ad, OP_ADD, sum, c);
      if (c < 0)
        break;
    }
    ad->grad[x] = sum;
  }
  if (ad->grad[x] < 0)
    ad->failed = true;
  ad->nparts[x] = 0;
  return ad->grad[x];
}

// Does forward node x take a gradient?
static bool wants(Ad *ad, int x) { return ad->active[x]; }

// MATMUL: C = op_a(A) @ op_b(B), op = transpose when the flag is set. With A' = op_a(A) and
// B' = op_b(B): dA' = dC @ B'^T and dB' = A'^T @ dC; a transposed operand takes the transpose of
// that, written as one more matmul with swapped operands. Batch axes that were broadcast are summed.
static void matmul_rule(Ad *ad, IrNode *n, int dy) {
  int a = n->in[0], b = n->in[1];
  bool ta = n->ia[0], tb = n->ia[1];
  if (wants(ad, a)) {
    int da = ta ? matmul(ad, b, dy, tb, true) : matmul(ad, dy, b, false, !tb);
    accumulate(ad, a, unbroadcast(ad, da, shape(ad, a)));
  }
  if (wants(ad, b)) {
    int db = tb ? matmul(ad, dy, a, true, ta) : matmul(ad, a, dy, !ta, false);
    accumulate(ad, b, unbroadcast(ad, db, shape(ad, b)));
  }
}

// Gradients of the inputs of forward node i, whose own gradient is dy.
static bool backward_rule(Ad *ad, int i, int dy) {
  Graph *g = ad->g;
  IrNode *n = g->nodes[i];
  int x = n->nin > 0 ? n->in[0] : -1;
  int x1 = n->nin > 1 ? n->in[1] : -1;
  switch (n->op) {
  case OP_INPUT: case OP_PARAM: case OP_STATE: case OP_SCALAR: case OP_CONST:
  case OP_TARGET_COUNT: // a count of integers: constant for the parameters (never active)
  case OP_ATTENTION_MASK: // (of doc ids, or of nothing: never on a parameter's path)
    return true;
  case OP_NEG:
    accumulate(ad, x, unary(ad, OP_NEG, dy));
    return true;
  case OP_EXP:
    accumulate(ad, x, binary(ad, OP_MUL, dy, i));
    return true;
  case OP_LOG:
    accumulate(ad, x, binary(ad, OP_DIV, dy, x));
    return true;
  case OP_TANH: // dy * (1 - y * y)
    accumulate(ad, x, binary(ad, OP_MUL, dy, binary(ad, OP_SUB, constant(ad, 1), binary(ad, OP_MUL, i, i))));
    return true;
  case OP_SQRT: // dy * 0.5 / y
    accumulate(ad, x, binary(ad, OP_DIV, binary(ad, OP_MUL, dy, constant(ad, 0.5)), i));
    return true;
  case OP_RSQRT: { // y = x^(-1/2): dy * (-0.5 y^3)
    int cube = binary(ad, OP_MUL, i, binary(ad, OP_MUL, i, i));
    accumulate(ad, x, binary(ad, OP_MUL, dy, binary(ad, OP_MUL, constant(ad, -0.5), cube)));
    return true;
  }
  case OP_SIGMOID: // dy * y (1 - y)
    accumulate(ad, x, binary(ad, OP_MUL, dy, binary(ad, OP_MUL, i, binary(ad, OP_SUB, constant(ad, 1), i))));
    return true;
  case OP_ABS:
    accumulate(ad, x, binary(ad, OP_ABS_BWD, x, dy));
    return true;
  case OP_CLAMP: // the gradient where x is within the bounds (inclusive, as PyTorch's clamp)
    accumulate(ad, x, add_node(ad, OP_CLAMP_BWD, (int[]){x, dy}, 2, n->ia, n->fa));
    return true;
  case OP_STOP_GRADIENT: // nothing flows back
  case OP_FLOORDIV: case OP_MOD: // integers (i32 values never take a gradient: mark_active)
  case OP_COMPARE:       // a step function of its inputs: 0 wherever it has a gradient
    return true;
  case OP_WHERE: { // a gets dy where cond holds, b where it does not; cond none
    int zero = constant(ad, 0), a = n->in[1], b = n->in[2];
    if (wants(ad, a))
      accumulate(ad, a, unbroadcast(ad, add_node(ad, OP_WHERE, (int[]){x, dy, zero}, 3, NULL, NULL), shape(ad, a)));
    if (wants(ad, b))
      accumulate(ad, b, unbroadcast(ad, add_node(ad, OP_WHERE, (int[]){x, zero, dy}, 3, NULL, NULL), shape(ad, b)));
    return true;
  }
  case OP_MINIMUM: case OP_MAXIMUM: { // dy to the operand taken, half of it to each at a tie
    int eq = add_node(ad, OP_COMPARE, (int[]){x, x1}, 2, (int64_t[8]){CMP_EQ}, NULL);
    int half = binary(ad, OP_MUL, eq, constant(ad, 0.5));
    for (int k = 0; k < 2; k++) {
      int operand = n->in[k];
      if (!wants(ad, operand))
        continue;
      int64_t wins_if = (k == 0) == (n->op == OP_MAXIMUM) ? CMP_GT : CMP_LT; // operand k taken: x REL x1
      int wins = add_node(ad, OP_COMPARE, (int[]){x, x1}, 2, (int64_t[8]){wins_if}, NULL);
      int share = binary(ad, OP_ADD, wins, half);
      accumulate(ad, operand, unbroadcast(ad, binary(ad, OP_MUL, dy, share), shape(ad, operand)));
    }
    return true;
  }
  case OP_RELU: case OP_GELU: case OP_SILU: {
    Op bwd = n->op == OP_RELU ? OP_RELU_BWD : n->op == OP_GELU ? OP_GELU_BWD : OP_SILU_BWD;
    accumulate(ad, x, binary(ad, bwd, x, dy));
    return true;
  }
  case OP_CAST: // rounding passes the gradient straight through (the precision pass runs after autodiff)
    accumulate(ad, x, dy);
    return true;
  case OP_DROPOUT: // the same mask and scale applied to the gradient
    accumulate(ad, x, add_node(ad, OP_DROPOUT, &dy, 1, n->ia, n->fa));
    return true;
  case OP_ADD: case OP_SUB:
    if (wants(ad, x))
      accumulate(ad, x, unbroadcast(ad, dy, shape(ad, x)));
    if (wants(ad, x1)) {
      int d = unbroadcast(ad, dy, shape(ad, x1));
      accumulate(ad, x1, n->op == OP_SUB ? unary(ad, OP_NEG, d) : d);
    }
    return true;
  case OP_MUL:
    if (wants(ad, x))
      accumulate(ad, x, unbroadcast(ad, binary(ad, OP_MUL, dy, x1), shape(ad, x)));
    if (wants(ad, x1))
      accumulate(ad, x1, unbroadcast(ad, binary(ad, OP_MUL, dy, x), shape(ad, x1)));
    return true;
  case OP_DIV: // y = a / b: da = dy / b, db = -dy * y / b
    if (wants(ad, x))
      accumulate(ad, x, unbroadcast(ad, binary(ad, OP_DIV, dy, x1), shape(ad, x)));
    if (wants(ad, x1)) {
      int d = binary(ad, OP_DIV, binary(ad, OP_MUL, dy, i), x1);
      accumulate(ad, x1, unary(ad, OP_NEG, unbroadcast(ad, d, shape(ad, x1))));
    }
    return true;
  case OP_SUM:
    accumulate(ad, x, unreduce(ad, dy, x, (int)n->ia[0]));
    return true;
  case OP_MEAN: {
    double count = (double)shape(ad, x).d[n->ia[0]];
    accumulate(ad, x, unreduce(ad, binary(ad, OP_MUL, dy, constant(ad, 1.0 / count)), x, (int)n->ia[0]));
    return true;
  }
  case OP_MAX:
    accumulate(ad, x, add_node(ad, OP_MAX_BWD, (int[]){x, i, dy}, 3, n->ia, NULL));
    return true;
  case OP_RESHAPE:
    accumulate(ad, x, reshape(ad, dy, shape(ad, x)));
    return true;
  case OP_PERMUTE: {
    int64_t inv[8] = {0};
    for (int k = 0; k < n->shape.rank; k++)
      inv[n->ia[k]] = k;
    accumulate(ad, x, add_node(ad, OP_PERMUTE, &dy, 1, inv, NULL));
    return true;
  }
  case OP_BROADCAST:
    accumulate(ad, x, unbroadcast(ad, dy, shape(ad, x)));
    return true;
  case OP_SLICE:
    add_part(ad, x, (Part){dy, (int)n->ia[0], n->ia[1], n->ia[2]});
    return true;
  case OP_CONCAT: {
    int64_t axis = n->ia[0], start = 0;
    for (int k = 0; k < n->nin; k++) {
      int xk = n->in[k];
      int64_t len = shape(ad, xk).d[axis];
      if (wants(ad, xk))
        accumulate(ad, xk, add_node(ad, OP_SLICE, &dy, 1, (int64_t[8]){axis, start, start + len}, NULL));
      start += len;
    }
    return true;
  }
  case OP_MATMUL:
    matmul_rule(ad, n, dy);
    return true;
  case OP_EMBED:
    if (wants(ad, x)) {
      int id = ir_embed_bwd(g, x1, dy, shape(ad, x).d[0], ad->loc);
      if (id < 0)
        ad->failed = true;
      accumulate(ad, x, id);
    }
    return true;
  case OP_TOPK: // integer indices (never active)
    return true;
  case OP_GATHER: // dy scatter-added back to the positions read (none for an index out of range)
    if (wants(ad, x))
      accumulate(ad, x, add_node(ad, OP_GATHER_BWD, (int[]){x1, dy}, 2,
                                 (int64_t[8]){n->ia[0], shape(ad, x).d[n->ia[0]]}, NULL));
    return true;
  case OP_SCATTER_ADD: // base gets dy; src what dy holds where it was added (0 out of range)
    if (wants(ad, x))
      accumulate(ad, x, dy);
    if (wants(ad, n->in[2]))
      accumulate(ad, n->in[2], add_node(ad, OP_GATHER, (int[]){dy, x1}, 2, n->ia, NULL));
    return true;
  case OP_LAYERNORM: case OP_RMSNORM: {
    Op bwd = n->op == OP_LAYERNORM ? OP_LAYERNORM_BWD : OP_RMSNORM_BWD;
    for (int k = 0; k < n->nin; k++)
      if (wants(ad, n->in[k]))
        accumulate(ad, n->in[k], add_node(ad, bwd, (int[]){x, x1, dy}, 3, (int64_t[8]){k}, n->fa));
    return true;
  }
  case OP_SOFTMAX:
    accumulate(ad, x, binary(ad, OP_SOFTMAX_BWD, i, dy));
    return true;
  case OP_CROSS_ENTROPY:
    accumulate(ad, x, add_node(ad, OP_CROSS_ENTROPY_BWD, (int[]){x, x1, dy}, 3, NULL, NULL));
    return true;
  case OP_ATTENTION: { // from the softmax statistics (lse) and the output, as FlashAttention does
    if (!wants(ad, n->in[0]) && !wants(ad, n->in[1]) && !wants(ad, n->in[2]))
      return true;
    int in[7];
    memcpy(in, n->in, sizeof(int) * (size_t)n->nin);
    in[n->nin] = i;
    in[n->nin + 1] = add_node(ad, OP_ATTENTION_LSE, n->in, n->nin, n->ia, n->fa);
    in[n->nin + 2] = dy;
    for (int k = 0; k < 3; k++) {
      if (!wants(ad, n->in[k]))
        continue;
      int64_t ia[8];
      memcpy(ia, n->ia, sizeof ia);
      ia[3] = k;
      accumulate(ad, n->in[k], add_node(ad, OP_ATTENTION_BWD, in, n->nin + 3, ia, n->fa));
    }
    return true;
  }
  case OP_ROPE: { // a rotation: its transpose rotates by the opposite angle
    int64_t ia[8];
    memcpy(ia, n->ia, sizeof ia);
    ia[1] = !ia[1];
    accumulate(ad, x, add_node(ad, OP_ROPE, (int[]){dy, x1}, 2, ia, n->fa));
    return true;
  }
  case OP_RELU_BWD: case OP_GELU_BWD: case OP_SILU_BWD: case OP_ABS_BWD: case OP_CLAMP_BWD: case OP_MAX_BWD:
  case OP_SLICE_BWD:
  case OP_EMBED_BWD: case OP_GATHER_BWD: case OP_LAYERNORM_BWD: case OP_RMSNORM_BWD: case OP_SOFTMAX_BWD:
  case OP_CROSS_ENTROPY_BWD: case OP_ATTENTION_LSE: case OP_ATTENTION_BWD: case OP_GRAD_NORM: case OP_ADAMW:
  case OP_COUNT:
    break;
  }
  snprintf(g->err, sizeof g->err, "autodiff: no gradient for %s: it is not a forward op", op_name(n->op));
  return false;
}

// Marks the nodes that need a gradient: those that depend on a PARAM and lead to the loss.
static void mark_active(Graph *g, bool *active) {
  bool *depends = arena_alloc(g->arena, sizeof(bool) * (size_t)g->fwd_end);
  for (int i = 0; i < g->fwd_end; i++) {
    IrNode *n = g->nodes[i];
    depends[i] = n->op == OP_PARAM && !n->init.frozen;
    for (int k = 0; k < n->nin; k++)
      depends[i] |= depends[n->in[k]];
    depends[i] &= n->dtype == DT_F32;
  }
  active[g->loss] = depends[g->loss];
  for (int i = g->loss; i >= 0; i--) {
    if (!active[i])
      continue;
    IrNode *n = g->nodes[i];
    for (int k = 0; k < n->nin; k++)
      active[n->in[k]] |= depends[n->in[k]];
  }
}

// The gradient node of params[i]: its own node (a zeros broadcast when the param does not reach
// the loss; a copy when the node is already another parameter's gradient), tagged and named.
static int param_grad(Ad *ad, int p) {
  Graph *g = ad->g;
  IrNode *pn = g->nodes[p];
  ad->loc = pn->loc;
  int d = grad_of(ad, p);
  if (d < 0) {
    d = constant(ad, 0);
    d = d >= 0 ? ir_broadcast(g, d, pn->shape, ad->loc) : -1;
  } else if (g->nodes[d]->grad_of >= 0 || g->nodes[d]->op == OP_CONST) {
    d = ir_reshape(g, d, pn->shape, ad->loc);
  }
  if (d < 0)
    return -1;
  g->nodes[d]->grad_of = p;
  g->nodes[d]->name = arena_printf(g->arena, "d.%s", pn->name ? pn->name : "?");
  return d;
}

// Muon's update of matrix p (r x c) from its gradient g, as Keller Jordan's muon_update: the
// gradient scaled by the clip factor (1 without clipping), the momentum mn = beta m + (1 - beta) g, with Nesterov u = (1 -
// beta) g + beta mn, else u = mn; X = u / (||u||_F + 1e-7); then 5 quintic Newton-Schulz iterations
// (a, b, c) = (3.4445, -4.7750, 2.0315): A = X X^T, B = b A + c A A, X = a X + B X, each on the
// shorter side (a tall matrix iterates on X^T: A = X^T X, X = a X + X B), and X times max(1, r /
// c)^0.5. All of it IR ops (the products are MATMULs, run by the GEMM library), before the optimizer
// step; the OP_ADAMW of rule OPT_MUON then writes m's update and p -= lr (X + wd p). In three parts:
// muon_u, muon_newton_schulz, and muon_ortho, which batches the matrices of one shape.
#define K(v) ir_const(g, (v), at)
#define OP2(op, x, y) ir_add(g, op, (int[]){(x), (y)}, 2, NULL, NULL, at)

// Muon's u of matrix p from its gradient and moment m (above), or -1.
static int muon_u(Graph *g, const IrNode *p, int grad, int m, int gnorm) {
  const TrainConfig *t = &g->train;
  SrcLoc at = p->loc;
  // Without clipping the factor is gnorm * 0 + 1 (1, or NaN with a norm that is not finite, a step
  // skipped anyway): either way Muon reads its gradient only after the gradient norm, as every other
  // update does, so nothing reads a gradient before the norm's step (a data-parallel run reduces
  // every gradient over the ranks there, runtime/engine/engine.c's engine_grad_ranges).
  int q = OP2(OP_ADD, OP2(OP_MUL, gnorm, K(0)), K(1));
  if (t->clip > 0) {
    double inf[IR_NFA] = {-INFINITY, 1};
    q = OP2(OP_DIV, K(t->clip), OP2(OP_ADD, gnorm, K(1e-6)));
    q = ir_add(g, OP_CLAMP, (int[]){q}, 1, NULL, inf, at);
  }
  int gs = OP2(OP_MUL, grad, q);
  double beta = t->momentum;
  int mn = OP2(OP_ADD, OP2(OP_MUL, m, K(beta)), OP2(OP_MUL, gs, K(1 - beta)));
  return t->nesterov ? OP2(OP_ADD, OP2(OP_MUL, gs, K(1 - beta)), OP2(OP_MUL, mn, K(beta))) : mn;
}

// X of Muon from u (above): one matrix [r, c], or a batch [n, r, c] of matrices of one shape, each
// divided by its own norm, the Newton-Schulz products then batched GEMMs (one GEMM call sequence for
// the batch where there were n); each matrix's values as alone. -1 on failure.
static int muon_newton_schulz(Graph *g, int u, SrcLoc at) {
  Shape s = g->nodes[u]->shape;
  int64_t n = s.rank == 3 ? s.d[0] : 1, r = s.d[s.rank - 2], c = s.d[s.rank - 1];
  bool tall = r > c;
  int sq = OP2(OP_MUL, u, u); // (a failed ir_add gives -1, which the next one refuses)
  int ss;
  if (s.rank == 2) {
    int flat = sq < 0 ? -1 : ir_reshape(g, sq, (Shape){1, {r * c}}, at);
    ss = flat < 0 ? -1 : ir_add(g, OP_SUM, (int[]){flat}, 1, (int64_t[8]){0, 0}, NULL, at);
  } else {
    int flat = sq < 0 ? -1 : ir_reshape(g, sq, (Shape){2, {n, r * c}}, at);
    int sum = flat < 0 ? -1 : ir_add(g, OP_SUM, (int[]){flat}, 1, (int64_t[8]){1, 0}, NULL, at);
    ss = sum < 0 ? -1 : ir_reshape(g, sum, (Shape){3, {n, 1, 1}}, at);
  }
  int x = OP2(OP_DIV, u, OP2(OP_ADD, ir_add(g, OP_SQRT, (int[]){ss}, 1, NULL, NULL, at), K(1e-7)));
  for (int k = 0; k < 5 && x >= 0; k++) {
    int a = ir_add(g, OP_MATMUL, (int[]){x, x}, 2, (int64_t[8]){tall, !tall}, NULL, at);
    int aa = ir_add(g, OP_MATMUL, (int[]){a, a}, 2, NULL, NULL, at);
    int b = OP2(OP_ADD, OP2(OP_MUL, a, K(-4.7750)), OP2(OP_MUL, aa, K(2.0315)));
    int bx = tall ? OP2(OP_MATMUL, x, b) : OP2(OP_MATMUL, b, x);
    x = OP2(OP_ADD, OP2(OP_MUL, x, K(3.4445)), bx);
  }
  double scale = sqrt(fmax(1, (double)r / (double)c)); // (Keller Jordan's max(1, rows/cols)^0.5)
  if (scale != 1 && x >= 0)
    x = OP2(OP_MUL, x, K(scale));
  return x;
}

// X of Muon for the hidden matrices params[list[0..n)] (one shape), with their gradients and moments
// m (indexed by param), into out[0..n): one matrix alone as muon_ortho always did; several stacked
// into one batch [n, r, c] (a CONCAT), orthogonalised together, and sliced apart. Batching turns a
// model's 15 GEMM calls per matrix a step into 15 per shape: the calls of small matrices (gpt2-tiny's
// 64 x 64 to 64 x 256) cost more in threads woken and libraries entered than in flops.
static bool muon_ortho(Graph *g, const int *list, int n, const int *grads, const int *m, int gnorm, int *out) {
  const IrNode *p0 = g->nodes[g->params[list[0]]];
  SrcLoc at = p0->loc;
  int64_t r = p0->shape.d[0], c = p0->shape.d[1];
  int *us = arena_alloc(g->arena, sizeof(int) * (size_t)n);
  for (int k = 0; k < n; k++) {
    const IrNode *p = g->nodes[g->params[list[k]]];
    int u = muon_u(g, p, grads[list[k]], m[list[k]], gnorm);
    us[k] = n == 1 || u < 0 ? u : ir_reshape(g, u, (Shape){3, {1, r, c}}, p->loc);
    if (us[k] < 0)
      return false;
  }
  int stack = n == 1 ? us[0] : ir_add(g, OP_CONCAT, us, n, (int64_t[8]){0}, NULL, at);
  int x = stack < 0 ? -1 : muon_newton_schulz(g, stack, at);
  for (int k = 0; k < n && x >= 0; k++) {
    const IrNode *p = g->nodes[g->params[list[k]]];
    int one = x;
    if (n > 1) {
      int sl = ir_add(g, OP_SLICE, &x, 1, (int64_t[8]){0, k, k + 1}, NULL, p->loc);
      one = sl < 0 ? -1 : ir_reshape(g, sl, p->shape, p->loc);
    }
    if ((out[k] = one) < 0)
      return false;
    g->nodes[one]->name = arena_printf(g->arena, "%s.ortho", p->name ? p->name : "?");
  }
  return x >= 0;
}
#undef K
#undef OP2

// Moment k of param p ("<p>.m", then "<p>.v"), a STATE leaf; -1 on failure.
static int moment_leaf(Graph *g, const IrNode *p, int k) {
  int st = ir_leaf(g, OP_STATE, arena_printf(g->arena, "%s.%s", p->name ? p->name : "?", k ? "v" : "m"), DT_F32,
                   p->shape, p->loc);
  if (st >= 0)
    g->nodes[st]->param_of = p->id;
  return st;
}

// The optimizer step after the backward graph: lr and step scalars, the global gradient norm,
// then one ADAMW per parameter with the moments its rule keeps (opt_rule_moments: "<p>.m", then
// "<p>.v"); a frozen parameter has neither gradient nor update. With gradient accumulation over k
// micro-batches (train.accumulate), the runtime runs the first k - 1 micro-batches on the
// gradients-only graph and passes their summed gradients in as the inputs "acc.<param>"; this
// step's update uses (gradient + acc) / k, the mean gradient over the k micro-batches.
static bool optimizer_step(Graph *g) {
  SrcLoc none = {0};
  Shape scalar = {0};
  int lr = ir_leaf(g, OP_SCALAR, "lr", DT_F32, scalar, none);
  int step = ir_leaf(g, OP_SCALAR, "step", DT_F32, scalar, none);
  int *grads = g->grads;
  int64_t k = g->train.accumulate;
  if (k > 1) {
    grads = arena_alloc(g->arena, sizeof(int) * (size_t)g->nparams);
    int inv_k = ir_const(g, 1.0 / (double)k, none);
    for (int i = 0; i < g->nparams; i++) {
      IrNode *p = g->nodes[g->params[i]];
      grads[i] = -1;
      if (p->init.frozen)
        continue;
      int acc = ir_leaf(g, OP_INPUT, arena_printf(g->arena, "acc.%s", p->name), DT_F32, p->shape, p->loc);
      int sum = acc < 0 ? -1 : ir_add(g, OP_ADD, (int[]){g->grads[i], acc}, 2, NULL, NULL, p->loc);
      grads[i] = sum < 0 ? -1 : ir_add(g, OP_MUL, (int[]){sum, inv_k}, 2, NULL, NULL, p->loc);
      if (grads[i] < 0)
        return false;
    }
  }
  int *live = arena_alloc(g->arena, sizeof(int) * (size_t)g->nparams), nlive = 0;
  for (int i = 0; i < g->nparams; i++)
    if (grads[i] >= 0)
      live[nlive++] = grads[i];
  if (nlive == 0) {
    snprintf(g->err, sizeof g->err, "autodiff: every parameter is frozen: there is nothing to train");
    return false;
  }
  int gnorm = ir_add(g, OP_GRAD_NORM, live, nlive, NULL, NULL, none);
  if (lr < 0 || step < 0 || gnorm < 0)
    return false;
  g->updates = arena_alloc(g->arena, sizeof(int) * (size_t)g->nparams);
  const TrainConfig *t = &g->train;
  // Muon's matrices of one shape are orthogonalised together (muon_ortho), at the first of them: the
  // moments of the others are made then, and their X kept for their turn.
  int *mom = arena_alloc(g->arena, sizeof(int) * (size_t)g->nparams), *xs = arena_alloc(g->arena, sizeof(int) * (size_t)g->nparams);
  int *list = arena_alloc(g->arena, sizeof(int) * (size_t)g->nparams), *outs = arena_alloc(g->arena, sizeof(int) * (size_t)g->nparams);
  for (int i = 0; i < g->nparams; i++)
    mom[i] = xs[i] = -1;
  for (int i = 0; i < g->nparams; i++) {
    IrNode *p = g->nodes[g->params[i]];
    g->updates[i] = -1;
    if (grads[i] < 0)
      continue;
    // (optimizer muon: Muon for the hidden matrices, AdamW for the rest)
    bool muon = t->optimizer == OPT_MUON && p->init.muon;
    OptRule rule = t->optimizer == OPT_MUON && !muon ? OPT_ADAMW : t->optimizer;
    int nstate = opt_rule_moments(rule, t->momentum);
    const char *name = p->name ? p->name : "?";
    int in[7] = {p->id, grads[i]}, nin = 2;
    for (int k = 0; k < nstate; k++) {
      int st = k == 0 && mom[i] >= 0 ? mom[i] : moment_leaf(g, p, k);
      if (st < 0)
        return false;
      in[nin++] = st;
    }
    if (muon && xs[i] < 0) { // (the first of its shape: its group's X)
      int n = 0;
      for (int j = i; j < g->nparams; j++) {
        const IrNode *q = g->nodes[g->params[j]];
        if (grads[j] >= 0 && q->init.muon && shape_eq(q->shape, p->shape)) {
          if (j > i && (mom[j] = moment_leaf(g, q, 0)) < 0)
            return false;
          list[n++] = j;
        }
      }
      mom[i] = in[2];
      if (!muon_ortho(g, list, n, grads, mom, gnorm, outs))
        return false;
      for (int k = 0; k < n; k++)
        xs[list[k]] = outs[k];
    }
    if (muon)
      in[nin++] = xs[i];
    in[nin++] = gnorm;
    in[nin++] = lr;
    in[nin++] = step;
    double wd = p->init.decay ? t->weight_decay : 0, ls = p->init.lr_scale > 0 ? p->init.lr_scale : 1;
    double fa[IR_NFA] = {t->beta1, t->beta2, t->eps, wd, t->clip, ls};
    if (rule == OPT_SGD)
      fa[0] = t->momentum, fa[1] = t->nesterov, fa[2] = 0;
    else if (rule == OPT_LION)
      fa[2] = 0;
    else if (rule == OPT_MUON)
      fa[0] = t->momentum, fa[1] = t->nesterov, fa[2] = 0;
    else if (t->optimizer == OPT_MUON) // (the schedule's rate is Muon's lr; AdamW's is adam_lr / lr of it)
      fa[5] = ls * t->adam_lr / t->lr;
    int64_t ia[IR_NIA] = {rule};
    int u = ir_add(g, OP_ADAMW, in, nin, ia, fa, p->loc);
    if (u < 0)
      return false;
    g->nodes[u]->param_of = p->id;
    g->nodes[u]->name = arena_printf(g->arena, "%s.new", name);
    g->updates[i] = u;
  }
  return true;
}

bool autodiff(Graph *g, bool optimizer) {
  if (g->fwd_end == 0)
    g->fwd_end = g->n;
  if (g->loss < 0 || g->loss >= g->fwd_end) {
    snprintf(g->err, sizeof g->err, "autodiff: the graph has no loss");
    return false;
  }
  IrNode *loss = g->nodes[g->loss];
  if (loss->shape.rank != 0 || loss->dtype != DT_F32) {
    char buf[128];
    snprintf(g->err, sizeof g->err, "autodiff: the loss must be a scalar f32, got %s%s", dtype_name(loss->dtype),
             shape_str(loss->shape, buf, sizeof buf));
    return false;
  }
  if (g->nparams == 0) {
    snprintf(g->err, sizeof g->err, "autodiff: the model has no parameters");
    return false;
  }
  Ad ad = {.g = g};
  ad.grad = arena_alloc(g->arena, sizeof(int) * (size_t)g->fwd_end);
  ad.parts = arena_alloc(g->arena, sizeof(Part *) * (size_t)g->fwd_end);
  ad.nparts = arena_alloc(g->arena, sizeof(int) * (size_t)g->fwd_end);
  ad.capparts = arena_alloc(g->arena, sizeof(int) * (size_t)g->fwd_end);
  ad.active = arena_alloc(g->arena, sizeof(bool) * (size_t)g->fwd_end);
  for (int i = 0; i < g->fwd_end; i++) {
    ad.grad[i] = -1;
    ad.parts[i] = NULL;
    ad.nparts[i] = ad.capparts[i] = 0;
  }
  mark_active(g, ad.active);

  if (ad.active[g->loss]) {
    ad.loc = loss->loc;
    ad.grad[g->loss] = constant(&ad, 1);
  }
  for (int i = g->loss; i >= 0 && !ad.failed; i--) {
    if (!ad.active[i])
      continue;
    ad.loc = g->nodes[i]->loc; // (of the SLICE_BWDs and ADDs that complete the gradient)
    int dy = grad_of(&ad, i);
    if (dy < 0)
      continue;
    IrNode *n = g->nodes[i];
    if (dy >= g->fwd_end && !g->nodes[dy]->name && n->name && n->op != OP_PARAM)
      g->nodes[dy]->name = arena_printf(g->arena, "d.%s", n->name);
    ad.loc = n->loc;
    ad.what = op_name(n->op);
    if (!backward_rule(&ad, i, dy))
      return false;
  }
  if (ad.failed) {
    char why[sizeof g->err];
    memcpy(why, g->err, sizeof why);
    snprintf(g->err, sizeof g->err, "autodiff of %s: %.400s", ad.what, why);
    return false;
  }

  g->grads = arena_alloc(g->arena, sizeof(int) * (size_t)g->nparams);
  for (int i = 0; i < g->nparams; i++)
    if (g->nodes[g->params[i]]->init.frozen)
      g->grads[i] = -1;
    else if ((g->grads[i] = param_grad(&ad, g->params[i])) < 0)
      return false;
  return !optimizer || optimizer_step(g);
}
