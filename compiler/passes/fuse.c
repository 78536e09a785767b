// fuse.c: the fusion pass. It groups the nodes of a training graph (forward, backward, GRAD_NORM,
// ADAMW) into steps, the unit the emitters turn into one kernel or one library call each.
//
// Vocabulary. A *member* of a step is a node computed inside it. A node is *materialised* when its
// value lives in memory: leaves other than CONST, the step *outs*, and views. An out is a member read
// by another step, the loss, an ADAMW (its new parameter), or a member nobody reads (a dead value or
// a named output, kept so it can be inspected). CONST leaves are never materialised and never in a
// step's `ins`: emitters write their value inline. A RESHAPE whose input is materialised is a *view*:
// it is in no step (step_of = -1) and shares its input's memory. So is a SLICE of the last axis that
// only attention reads as q, k or v (a *strided view*: attention reads its rows in place, with the
// stride of the sliced tensor, so q, k and v are never copied out of the qkv GEMM's output). Inside
// a step a RESHAPE member is index-transparent: it reads its input at the same flat index.
//
// How a step evaluates its members. Every member is a function of a flat index into its own shape.
// A member reads an input at an index given by its own op: the same flat index for unary ops,
// RESHAPE and same-shape operands of binary ops ("identity"); numpy broadcasting for a smaller
// operand of ADD/SUB/MUL/DIV and for BROADCAST; the permutation for PERMUTE; start + i on the axis
// for SLICE; for SLICE_BWD the index minus start on the axis when it is inside [start, end), else
// the value is 0 and the input is not read; for CONCAT the input whose range holds the axis index.
// An input that is a member is evaluated at that index (a member read by several members at one
// index is computed once); a CONST input is its value; any other input is loaded from memory at
// that index. The root of a reduction, row-wise, GEMM, attention or optimizer step computes its own
// op over its inputs as the interpreter does.
//
// The kinds of step, and the rules that build them (applied in this order; a node taken by an
// earlier rule is not available to a later one):
//  1. STEP_OPTIMIZER: GRAD_NORM (the root) and every ADAMW that reads it, one step (one kernel over
//     the flat buffers). Outs: the ADAMW nodes (written in place over their PARAM, with m and v) and
//     the gradient norm (4 bytes, so the metrics line can print it). Muon's updates (OPT_MUON) read
//     the norm through the Newton-Schulz steps that orthogonalise them too: they make a second
//     optimizer step of their own, after those. With opt.optimizer_per_param, GRAD_NORM alone and
//     then each ADAMW alone, one step each (what the fused one is worth).
//  2. STEP_LMHEAD (opt.chunk_lmhead): logits = MATMUL(x2 [N,C], W) (either orientation of W), any
//     RESHAPEs, CROSS_ENTROPY and CROSS_ENTROPY_BWD of those logits and targets, RESHAPEs of the
//     logits' gradient dl, then dx2 = MATMUL(dl, W, tb = !tb) and dW = MATMUL(dl, x2, ta) (W as
//     [V,C]) or MATMUL(x2, dl, ta) (W as [C,V]), where dl is the CAST of the gradient when the
//     GEMMs read bf16 operands; either backward GEMM may be missing. In a graph without a backward
//     (the validation engine's) the pattern ends at the CROSS_ENTROPY, unless the logits are a model
//     output: the logits are never whole there either (GPT-2 124M at B=205, T=128 held 5.3 GB).
//     Only when every reader of the logits and of dl is in the pattern, so neither is ever materialised: the
//     emitter runs it chunk by chunk of rows. Root: the logits MATMUL. Outs: the per-row losses,
//     dx2, dW.
//  3. Siblings. LAYERNORM_BWD (which 0/1/2), RMSNORM_BWD (0/1) and ATTENTION_BWD (dq/dk/dv) nodes
//     with the same inputs and attributes form one step (row-wise STEP_KERNEL; STEP_ATTENTION),
//     rooted at "which 0" when present. CROSS_ENTROPY and the CROSS_ENTROPY_BWD nodes on the same
//     logits and targets form one row-wise STEP_KERNEL rooted at the forward op: the logits'
//     gradient is produced by the kernel that computes the loss. An ATTENTION_LSE joins the
//     ATTENTION with the same inputs and attributes: the forward has the softmax statistics the
//     backward reads at hand, and stores them as it finishes a row (the one backward node a forward
//     step holds; the forward-only graph for evaluation has no ATTENTION_LSE).
//  4. STEP_GEMM: every other MATMUL, with an epilogue: a chain of consumers applied at the GEMM
//     output's flat index, each reading the previous link at identity. A link may be RESHAPE, a
//     unary elementwise op or a binary one (ADD SUB MUL DIV *_BWD) whose other operand comes from
//     memory with any broadcast (bias along rows, residual, gelu_bwd's x); so bias ADD, GELU and
//     residual ADD, and in the backward the activation gradient. The first qualifying reader
//     (lowest id) continues the chain; a link with other readers is also written (an out: GELU's
//     input, which its backward reads; the MATMUL itself when its raw result is read elsewhere,
//     in which case the RESHAPE after it is a view of it and the next link reads that view, after
//     the GEMM has written it). No prologue: GEMM operands always come from memory. The
//     bias-gradient SUM is not folded into the dW GEMM; rule 10 may fold it into the GEMM whose
//     epilogue computes the gradient it sums. A
//     chain that starts in the forward pass stays there (this holds for rule 7's chains too).
//  5. Row-wise STEP_KERNEL: LAYERNORM / RMSNORM forward together with the ADD that produces its x
//     (same shape), when that ADD is not already in a GEMM epilogue (the GEMM writes the residual
//     stream more cheaply); the ADD is an out (the residual stream). SOFTMAX and SOFTMAX_BWD alone.
//     (The CASTs of its output, the next GEMM's bf16 operand, join it by rule 9.)
//  6. Single-node steps: EMBED, EMBED_BWD, MAX_BWD, ROPE, ATTENTION (STEP_ATTENTION), TARGET_COUNT
//     (a count over the targets, in memory as the batch gave them; the loss and its gradient each
//     divide by it), ATTENTION_MASK (a kernel: plain attention's mask, which its scores' GEMM
//     epilogue adds), and any anchor op left over by the rules above (a lone CROSS_ENTROPY_BWD, a
//     lone ADAMW). TOPK, GATHER, GATHER_BWD and SCATTER_ADD too: each reads an operand at offsets it
//     computes from indices it loads, so that operand must be whole in memory before the step (no
//     producer is evaluated inline at an index known only at run time), and a scatter's sums need
//     every source before any output is final (no consumer reads them at its own index).
//  7. Reduction STEP_KERNEL: root SUM/MEAN/MAX over one axis. Producers of its input are fused as
//     in an elementwise step (rule 8, so they are evaluated at the input's index while reducing);
//     then a chain of elementwise consumers of the result with the result's element count, each
//     reading the previous link at identity and being its only reader; the chain's end is the out.
//     An EMBED_BWD step of rule 6 grows the same chain: a tied table's gradient (the LM head's part
//     plus the embedding's) is added as the embedding backward stores each element. So does the dx
//     of a norm backward step (rule 3), before any reduction is formed: the residual gradient that
//     dx is added to is summed as each row's dx is computed.
//  8. Elementwise STEP_KERNEL: the ops NEG EXP LOG TANH SQRT RSQRT RELU GELU SILU DROPOUT ADD SUB
//     MUL DIV RELU_BWD GELU_BWD SILU_BWD BROADCAST PERMUTE SLICE SLICE_BWD CONCAT RESHAPE over one
//     iteration space, the root's shape (the root is the last member and the only out). Groups
//     grow from the last node backwards; a producer joins its consumer's group when (a) it is one of
//     those ops, (b) every reader of it is in the group, (c) it is not read through a broadcast
//     (many reads of one element) unless it is cheap (layout ops, NEG, RELU, ADD, SUB, MUL, DIV,
//     RELU_BWD): exp, log, tanh, sqrt, rsqrt, gelu, silu, dropout and their backward are never
//     recomputed, and (d) the group has fewer than opt.max_group members (0: 64). The cap binds
//     rules 4, 7, 8, 9 and 10; the fixed patterns of rules 1-3 and 5 are never split. So does a cap
//     on the buffers a kernel addresses (FUSE_MAX_BUFFERS: the distinct values it reads from memory
//     and those it writes): a node that would take a step past it starts a step of its own (the
//     sum of a gradient over many readers of one value, read from as many buffers, is cut into
//     several kernels).
//  9. A CAST still alone (a bf16 GEMM operand: a norm's output, or a gradient that is also summed
//     into a bias gradient) joins the row-wise or elementwise STEP_KERNEL that
//     computes its input when the element counts match: that kernel writes the value and its
//     rounding in one pass. So does the bf16 CAST of an attention forward's output (the projection
//     GEMM's operand), which the attention kernel then writes itself: the f32 output is written only
//     when something else reads it. Not into a forward step from the backward, and within the cap.
// 10. A reduction step whose input (through RESHAPEs) is written by an elementwise STEP_KERNEL whose
//     every out has the input's element count takes that kernel in: the reduction's loop visits
//     each element of its input once, so it computes and writes the kernel's outs on the way (the
//     gradient, its bf16 rounding) and reduces without reading them back. A bias gradient is summed
//     by the kernel that produces the activation gradient. When the input comes from a STEP_GEMM
//     (an epilogue link, gelu_bwd say) whose outs all have the GEMM's element count, the reduction
//     joins the GEMM's step instead, which stays a GEMM step: the emitters then compute the
//     epilogue inside the reduction's loop, reading the product once. Not when another member of
//     the reduction step reads the kernel's values, across the forward/backward line, or past the
//     cap. A SUM over the rows of a value of a norm backward step (axis 0 of [rows, C] with the
//     norm's row length C and element count), alone in its step but for RESHAPEs, joins that step:
//     the norm's row loop adds it up in column partials as it does dw and db (a bias gradient).
// 11. A bf16 CAST of a PARAM still alone in its step (a weight's GEMM operand), when the parameter's
//     ADAMW is in the optimizer step, leaves the plan: it becomes the parameter's *copy*
//     (Fusion.copy_of), in no step and materialised, which the optimizer step rewrites as it updates
//     the parameter. The next step's GEMMs read it as they read a leaf, and no kernel reads the
//     f32 weights only to round them. One copy per parameter (a second CAST of it stays a kernel).
//     The runtime writes the copies itself whenever it sets parameters (initialisation, checkpoints).
// With opt.fuse = false every node is its own step (GRAD_NORM alone, one step per ADAMW; the LM
// head is not chunked); views are views all the same.
//
// A RESHAPE member read outside its step (the last member of a chain, typically) is dropped from
// the step and becomes a view of its input, which becomes an out; members that read it then read
// the view. A parameter's gradient is stored in the flat gradient buffer; when it is a RESHAPE, it
// is a view only if its input can be placed there (an intermediate value no other gradient
// claims), else it is a copy kernel (a one-node elementwise step).
//
// Every merge is checked against cycles between steps (a group may not depend on itself through
// nodes outside it), and steps are ordered topologically, preferring the step whose last node
// comes first (so a step reading a parameter runs before the optimizer updates it in place). Every
// producer/consumer pair that crosses two steps gets a reason in Fusion.rejected, from the rule
// that turned it down or from the kinds of the two steps (pairs feeding the optimizer excepted: it
// reads the gradient buffer by design).
//
// Names: "k<index>_<root op>[_fwd]__<other ops, reshapes left out, deduplicated, in order>", with
// "gemm" for MATMUL, "lmhead" for the LM-head root and _fwd on the forward row-wise and attention
// roots: "k12_layernorm_fwd__add", "k7_gemm__add__gelu", "k30_attention_bwd".
//
// Costs: flops are counted per member (elementwise 1 per element, gelu 8, gelu_bwd 12, silu 4,
// silu_bwd 6, layout ops 0, GEMM 2MNK, layernorm 8 and its backward 10/2/1 per element for dx/dw/db,
// attention 4BTTC (half when causal) and its three backward siblings twice that together, AdamW 12,
// ...); bytes count the materialised ins and outs only (ADAMW also writes m and v; the optimizer step
// writes the copies of rule 11, one flop per element), and the product of a GEMM whose epilogue a
// reduction computes (rule 10), written and read back.
#include "mdl.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

enum { DEFAULT_MAX_GROUP = 64 };

typedef struct {
  StepKind kind;
  int root;
  int *m; // members, in the order they joined
  int n, cap;
  int lo, last; // the smallest id that has been a member; the largest id its members have read
} Group;

typedef struct {
  Graph *g;
  Arena *a;
  FuseOptions opt;
  int max_group;
  int *grp;       // per node: its group, or -1
  Group *groups;
  int ngroups, gcap;
  int **users;    // per node: the distinct nodes that read it, ascending
  int *nusers;
  bool *view;
  bool *pinned;   // the input of a gradient view: lives in the gradient buffer
  FuseRejection *rej;
  int nrej, rcap;
  int *rej_at, rej_mask; // an open-addressed index of rej by (a, b): indices, -1 where free
  // For fuse_creates_cycle: per node, the largest input id of the members of any group that has held a
  // member at that node or after it, as a tree of prefix maxima (reach_tree; reach_bound says why).
  int *reach;
  // scratch
  int *seen, *gseen, epoch;
  int *queue;
  bool *extra, *cand, *bcast;
  int *copy_of;   // rule 11: per PARAM its copy, else -1
} Fuser;

static IrNode *node(const Fuser *F, int id) { return F->g->nodes[id]; }
static Op op_of(const Fuser *F, int id) { return F->g->nodes[id]->op; }
static int64_t numel(const Fuser *F, int id) { return shape_numel(F->g->nodes[id]->shape); }

static bool fuse_is_leaf(Op op) {
  return op == OP_INPUT || op == OP_PARAM || op == OP_STATE || op == OP_SCALAR || op == OP_CONST;
}

static bool fuse_is_unary(Op op) {
  switch (op) {
  case OP_NEG: case OP_EXP: case OP_LOG: case OP_TANH: case OP_SQRT: case OP_RSQRT: case OP_RELU:
  case OP_GELU: case OP_SILU: case OP_SIGMOID: case OP_ABS: case OP_CLAMP: case OP_STOP_GRADIENT: case OP_DROPOUT:
  case OP_CAST: return true;
  default: return false;
  }
}

static bool fuse_is_binary(Op op) {
  switch (op) {
  case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_RELU_BWD: case OP_GELU_BWD:
  case OP_SILU_BWD: case OP_ABS_BWD: case OP_CLAMP_BWD: case OP_COMPARE: case OP_MINIMUM: case OP_MAXIMUM:
  case OP_FLOORDIV: case OP_MOD: return true;
  default: return false;
  }
}

static bool fuse_is_elementwise(Op op) {
  switch (op) {
  case OP_BROADCAST: case OP_PERMUTE: case OP_SLICE: case OP_SLICE_BWD: case OP_CONCAT:
  case OP_RESHAPE: case OP_WHERE: return true;
  default: return fuse_is_unary(op) || fuse_is_binary(op);
  }
}

static bool fuse_is_reduction(Op op) { return op == OP_SUM || op == OP_MEAN || op == OP_MAX; }

// Cheap enough to evaluate again for every element that reads it through a broadcast.
static bool fuse_is_cheap(Op op) {
  switch (op) {
  case OP_NEG: case OP_RELU: case OP_ABS: case OP_CLAMP: case OP_STOP_GRADIENT: case OP_ADD: case OP_SUB: case OP_MUL:
  case OP_DIV: case OP_RELU_BWD: case OP_ABS_BWD: case OP_CLAMP_BWD: case OP_COMPARE: case OP_WHERE:
  case OP_MINIMUM: case OP_MAXIMUM: case OP_FLOORDIV: case OP_MOD:
  case OP_BROADCAST: case OP_PERMUTE: case OP_SLICE: case OP_SLICE_BWD: case OP_CONCAT:
  case OP_RESHAPE: return true;
  default: return false;
  }
}

// The kind of a step made of this op alone.
static StepKind fuse_kind_of(Op op) {
  switch (op) {
  case OP_MATMUL: return STEP_GEMM;
  case OP_ATTENTION: case OP_ATTENTION_LSE: case OP_ATTENTION_BWD: return STEP_ATTENTION;
  case OP_GRAD_NORM: case OP_ADAMW: return STEP_OPTIMIZER;
  default: return STEP_KERNEL;
  }
}

const char *step_kind_name(StepKind k) {
  switch (k) {
  case STEP_KERNEL: return "kernel";
  case STEP_GEMM: return "gemm";
  case STEP_ATTENTION: return "attention";
  case STEP_LMHEAD: return "lmhead";
  case STEP_OPTIMIZER: return "optimizer";
  }
  return "?";
}

static const char *fuse_shape_text(const Fuser *F, int id) {
  char buf[128];
  return arena_strdup(F->a, shape_str(node(F, id)->shape, buf, sizeof buf));
}

// Does consumer c read its input p at c's own flat index (every operand slot that holds p)?
static bool fuse_reads_identity(const Fuser *F, int c, int p) {
  IrNode *n = node(F, c);
  if (n->op == OP_RESHAPE || fuse_is_unary(n->op))
    return true;
  if (!fuse_is_binary(n->op))
    return false;
  for (int k = 0; k < n->nin; k++)
    if (n->in[k] == p && !shape_eq(node(F, p)->shape, n->shape))
      return false;
  return true;
}

// Does consumer c read some element of p more than once (a broadcast)?
static bool fuse_reads_many_to_one(const Fuser *F, int c, int p) {
  IrNode *n = node(F, c);
  if (n->op == OP_BROADCAST || fuse_is_binary(n->op))
    return numel(F, p) < numel(F, c);
  return false;
}

// A slot of an open-addressed table of `mask + 1` ints for the key (a, b): the slot holding an index
// i with same(i), or the free slot (-1) where such an index would go.
static int fuse_pair_slot(const int *table, int mask, int a, int b, bool (*same)(const void *, int, int, int),
                          const void *ctx) {
  uint64_t h = ((uint64_t)(uint32_t)a * 0x9E3779B97F4A7C15u) ^ ((uint64_t)(uint32_t)b * 0xC2B2AE3D27D4EB4Fu);
  int at = (int)((h ^ (h >> 29)) & (uint64_t)mask);
  while (table[at] >= 0 && !same(ctx, table[at], a, b))
    at = (at + 1) & mask;
  return at;
}

static bool same_rejection(const void *ctx, int i, int a, int b) {
  const Fuser *F = ctx;
  return F->rej[i].a == a && F->rej[i].b == b;
}

// The index of the reason recorded for the pair (a, b), or -1.
static int rejection_of(const Fuser *F, int a, int b) {
  if (!F->rej_at)
    return -1;
  return F->rej_at[fuse_pair_slot(F->rej_at, F->rej_mask, a, b, same_rejection, F)];
}

static void fuse_reject(Fuser *F, int a, int b, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void fuse_reject(Fuser *F, int a, int b, const char *fmt, ...) {
  if (rejection_of(F, a, b) >= 0)
    return;
  if (F->nrej == F->rcap) {
    F->rcap = F->rcap ? 2 * F->rcap : 64;
    FuseRejection *r = arena_alloc(F->a, sizeof *r * (size_t)F->rcap);
    if (F->nrej)
      memcpy(r, F->rej, sizeof *r * (size_t)F->nrej);
    F->rej = r;
    F->rej_mask = 2 * F->rcap - 1; // (at most half full)
    F->rej_at = arena_alloc(F->a, sizeof(int) * (size_t)(F->rej_mask + 1));
    memset(F->rej_at, -1, sizeof(int) * (size_t)(F->rej_mask + 1));
    for (int i = 0; i < F->nrej; i++)
      F->rej_at[fuse_pair_slot(F->rej_at, F->rej_mask, F->rej[i].a, F->rej[i].b, same_rejection, F)] = i;
  }
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  F->rej[F->nrej] = (FuseRejection){a, b, arena_strdup(F->a, buf)};
  F->rej_at[fuse_pair_slot(F->rej_at, F->rej_mask, a, b, same_rejection, F)] = F->nrej++;
}

// A later rule's reason for a pair replaces an earlier one: it is the reason the pair stays apart.
static void fuse_reject_again(Fuser *F, int a, int b, const char *why) {
  int i = rejection_of(F, a, b);
  if (i >= 0)
    F->rej[i].reason = arena_strdup(F->a, why);
  else
    fuse_reject(F, a, b, "%s", why);
}

// fuse_creates_cycle's bound. reach_note records that a group holds node id, which reads inputs up to
// `last`; reach_bound(x) is the least b >= x such that every group with a member at or before b
// reads nothing after b (at least: the records only grow, so stale ones only make b larger). From a
// node after b that is in no such group, every path goes on through nodes after b (ids are a
// topological order, and a group reached there has all its members after b), so none leads back to
// a node at or before b.
static void reach_note(Fuser *F, int id, int last) {
  for (int i = id + 1; i <= F->g->n; i += i & -i)
    if (F->reach[i - 1] < last)
      F->reach[i - 1] = last;
}

static int reach_prefix(const Fuser *F, int x) {
  int m = -1;
  for (int i = x + 1; i > 0; i -= i & -i)
    if (F->reach[i - 1] > m)
      m = F->reach[i - 1];
  return m;
}

static int reach_bound(const Fuser *F, int x) {
  for (int b; (b = reach_prefix(F, x)) > x;)
    x = b;
  return x;
}

static void fuse_add_member(Fuser *F, int gi, int id) {
  Group *G = &F->groups[gi];
  if (G->n == G->cap) {
    G->cap = G->cap ? 2 * G->cap : 8;
    int *m = arena_alloc(F->a, sizeof(int) * (size_t)G->cap);
    if (G->n)
      memcpy(m, G->m, sizeof(int) * (size_t)G->n);
    G->m = m;
  }
  G->m[G->n++] = id;
  F->grp[id] = gi;
  if (G->n == 1 || id < G->lo)
    G->lo = id;
  for (int k = 0; k < node(F, id)->nin; k++)
    if (node(F, id)->in[k] > G->last)
      G->last = node(F, id)->in[k];
  reach_note(F, G->lo, G->last);
}

static void fuse_remove_member(Fuser *F, int gi, int id) {
  Group *G = &F->groups[gi];
  for (int i = 0; i < G->n; i++)
    if (G->m[i] == id) {
      memmove(G->m + i, G->m + i + 1, sizeof(int) * (size_t)(G->n - i - 1));
      G->n--;
      break;
    }
  F->grp[id] = -1;
}

static int fuse_new_group(Fuser *F, StepKind kind, int root) {
  if (F->ngroups == F->gcap) {
    F->gcap = F->gcap ? 2 * F->gcap : 64;
    Group *g = arena_alloc(F->a, sizeof *g * (size_t)F->gcap);
    if (F->ngroups)
      memcpy(g, F->groups, sizeof *g * (size_t)F->ngroups);
    F->groups = g;
  }
  int gi = F->ngroups++;
  F->groups[gi] = (Group){.kind = kind, .root = root, .last = -1};
  fuse_add_member(F, gi, root);
  return gi;
}

// Is node v a named model output of a graph without a backward (evaluation, sampling: their readers
// read it), or a scalar output of any graph (a metric, which the runtime reads after every step, even
// where a member of its step reads it too: an auxiliary loss added to the loss)? In a training graph
// nothing reads the other outputs: rule 2 keeps the logits out of memory there.
static bool read_as_output(const Fuser *F, int v) {
  for (int o = 0; o < F->g->noutputs; o++)
    if (F->g->outputs[o] == v && (!F->g->grads || node(F, v)->shape.rank == 0))
      return true;
  return false;
}

// Is member v of group gi one of its outs (written to memory): read by another step, the loss, an
// ADAMW or GRAD_NORM, read as a model output (read_as_output), or read by nobody?
static bool fuse_is_out(const Fuser *F, int gi, int v) {
  Op op = op_of(F, v);
  bool out = F->nusers[v] == 0 || v == F->g->loss || op == OP_ADAMW || op == OP_GRAD_NORM || read_as_output(F, v);
  for (int k = 0; k < F->nusers[v] && !out; k++)
    out = F->grp[F->users[v][k]] != gi;
  return out;
}

static bool in_set(const Fuser *F, int gi, int v) { return (gi >= 0 && F->grp[v] == gi) || F->extra[v]; }

// May a path from node u lead back to a node at or before `bound` (a reach_bound)?
static bool may_lead_back(const Fuser *F, int u, int bound) {
  return (F->grp[u] >= 0 ? F->groups[F->grp[u]].lo : u) <= bound;
}

// Would group gi, grown by the nodes xs, depend on itself through nodes outside it? Walks the
// readers of the grown group; a node that belongs to another group stands for the whole group.
static bool fuse_creates_cycle(Fuser *F, int gi, const int *xs, int nx) {
  int nm = gi >= 0 ? F->groups[gi].n : 0, top = 0;
  for (int i = 0; i < nx; i++) {
    F->extra[xs[i]] = true;
    top = xs[i] > top ? xs[i] : top;
  }
  for (int i = 0; i < nm; i++)
    top = F->groups[gi].m[i] > top ? F->groups[gi].m[i] : top;
  // Only nodes at or before `bound`, and groups with a member there, can lead back (reach_bound).
  int bound = reach_bound(F, top);
  F->epoch++;
  int head = 0, tail = 0;
  bool cycle = false;
  // Seeds: readers of the grown group that are outside it.
  for (int i = 0; i < nm + nx; i++) {
    int v = i < nm ? F->groups[gi].m[i] : xs[i - nm];
    for (int k = 0; k < F->nusers[v]; k++) {
      int u = F->users[v][k];
      if (!in_set(F, gi, u) && F->seen[u] != F->epoch && may_lead_back(F, u, bound)) {
        F->seen[u] = F->epoch;
        F->queue[tail++] = u;
      }
    }
  }
  while (head < tail && !cycle) {
    int v = F->queue[head++];
    const int *from = &v;
    int nfrom = 1;
    int h = F->grp[v];
    if (h >= 0) {
      if (F->gseen[h] == F->epoch)
        continue;
      F->gseen[h] = F->epoch;
      from = F->groups[h].m;
      nfrom = F->groups[h].n;
    }
    for (int i = 0; i < nfrom && !cycle; i++) {
      int w = from[i];
      F->seen[w] = F->epoch;
      for (int k = 0; k < F->nusers[w]; k++) {
        int u = F->users[w][k];
        if (in_set(F, gi, u)) {
          cycle = true;
          break;
        }
        if (F->seen[u] != F->epoch && may_lead_back(F, u, bound)) {
          F->seen[u] = F->epoch;
          F->queue[tail++] = u;
        }
      }
    }
  }
  for (int i = 0; i < nx; i++)
    F->extra[xs[i]] = false;
  return cycle;
}

// How many buffers group gi, grown by the nodes xs, would address: the distinct values its members
// read from outside it (CONSTs apart: emitters write them inline) and the members read outside it or
// kept (its outs, as fuse_is_out says, with the group grown).
static int buffers_with(Fuser *F, int gi, const int *xs, int nx) {
  for (int i = 0; i < nx; i++)
    F->extra[xs[i]] = true;
  F->epoch++;
  int count = 0, nm = gi >= 0 ? F->groups[gi].n : 0;
  for (int i = 0; i < nm + nx; i++) {
    int v = i < nm ? F->groups[gi].m[i] : xs[i - nm];
    const IrNode *n = node(F, v);
    for (int k = 0; k < n->nin; k++) {
      int x = n->in[k];
      if (!in_set(F, gi, x) && op_of(F, x) != OP_CONST && F->seen[x] != F->epoch) {
        F->seen[x] = F->epoch;
        count++;
      }
    }
    bool out = F->nusers[v] == 0 || v == F->g->loss || n->op == OP_ADAMW || n->op == OP_GRAD_NORM ||
               read_as_output(F, v);
    for (int k = 0; k < F->nusers[v] && !out; k++)
      out = !in_set(F, gi, F->users[v][k]);
    count += out;
  }
  for (int i = 0; i < nx; i++)
    F->extra[xs[i]] = false;
  return count;
}

// Would group gi grown by xs address more buffers than a kernel may (FUSE_MAX_BUFFERS)?
static bool fuse_too_many_buffers(Fuser *F, int gi, const int *xs, int nx) {
  return buffers_with(F, gi, xs, nx) > FUSE_MAX_BUFFERS;
}

static const char *fuse_buffer_cap(const Fuser *F) {
  return arena_printf(F->a, "buffer cap (%d buffers a kernel)", FUSE_MAX_BUFFERS);
}

// Adds id to group gi unless that would make the steps cyclic.
static bool fuse_try_add(Fuser *F, int gi, int id) {
  if (fuse_creates_cycle(F, gi, &id, 1))
    return false;
  fuse_add_member(F, gi, id);
  return true;
}

static const char *where(const Fuser *F, int id) {
  return arena_printf(F->a, "%s@%d", op_name(op_of(F, id)), node(F, id)->loc.line);
}

//
// Rule 1: the optimizer.
//
static void rule_optimizer(Fuser *F) {
  Graph *g = F->g;
  for (int i = 0; i < g->n; i++) {
    if (op_of(F, i) != OP_GRAD_NORM || F->grp[i] >= 0)
      continue;
    int gi = fuse_new_group(F, STEP_OPTIMIZER, i), later = -1;
    for (int k = 0; k < F->nusers[i]; k++) {
      int u = F->users[i][k];
      if (op_of(F, u) != OP_ADAMW || F->grp[u] >= 0)
        continue;
      if (F->opt.optimizer_per_param)
        fuse_new_group(F, STEP_OPTIMIZER, u);
      else if (node(F, u)->ia[0] == OPT_MUON && later < 0) // (it reads the norm through Newton-Schulz)
        later = fuse_new_group(F, STEP_OPTIMIZER, u);
      else if (!fuse_try_add(F, node(F, u)->ia[0] == OPT_MUON ? later : gi, u))
        fuse_reject(F, i, u, "would make the steps cyclic");
    }
  }
}

//
// Rule 2: the LM head.
//
static int only_user(const Fuser *F, int id) { return F->nusers[id] == 1 ? F->users[id][0] : -1; }

// Follows single-reader RESHAPEs from id, appending them to list; returns the last node.
static int follow_reshapes(const Fuser *F, int id, int *list, int *n) {
  for (int u; (u = only_user(F, id)) >= 0 && op_of(F, u) == OP_RESHAPE;) {
    list[(*n)++] = u;
    id = u;
  }
  return id;
}

// Why the pattern's nodes list[0, n) cannot form a step, or NULL: one is already in another step.
static const char *taken_elsewhere(const Fuser *F, const int *list, int n) {
  for (int i = 0; i < n; i++)
    if (F->grp[list[i]] >= 0)
      return arena_printf(F->a, "%s is already in another step", where(F, list[i]));
  return NULL;
}

// Matches the LM-head pattern at MATMUL mm into list; returns NULL or why it does not match.
static const char *match_lmhead(Fuser *F, int mm, int *list, int *n, int *ce_out) {
  IrNode *m = node(F, mm);
  int x2 = m->in[0], w = m->in[1];
  *n = 0;
  *ce_out = -1;
  list[(*n)++] = mm;
  int lg = follow_reshapes(F, mm, list, n);
  // With bf16 the loss reads the logits rounded, through their CAST (precision.c).
  if (only_user(F, lg) >= 0 && op_of(F, only_user(F, lg)) == OP_CAST) {
    lg = only_user(F, lg);
    list[(*n)++] = lg;
    lg = follow_reshapes(F, lg, list, n);
  }
  int ce = -1, cb = -1;
  for (int k = 0; k < F->nusers[lg]; k++) {
    IrNode *u = node(F, F->users[lg][k]);
    if (u->op == OP_CROSS_ENTROPY && u->in[0] == lg && ce < 0)
      ce = u->id;
  }
  if (ce < 0)
    return NULL; // not an LM head: nothing to say
  *ce_out = ce;
  if (m->ia[0] || node(F, x2)->shape.rank != 2 || node(F, w)->shape.rank != 2)
    return "the logits GEMM is not x2[N,C] @ W with 2-D operands";
  for (int k = 0; k < F->nusers[lg]; k++) {
    IrNode *u = node(F, F->users[lg][k]);
    if (u->op == OP_CROSS_ENTROPY_BWD && u->in[0] == lg && u->in[1] == node(F, ce)->in[1] && cb < 0)
      cb = u->id;
    else if (u->id != ce)
      return arena_printf(F->a, "the logits are also read by %s", where(F, u->id));
  }
  list[(*n)++] = ce;
  if (cb < 0) { // a forward-only graph (validation): the logits GEMM and the loss, chunk by chunk
    if (F->g->grads)
      return "the cross-entropy has no backward";
    for (int i = 0; i < *n; i++)
      for (int o = 0; o < F->g->noutputs; o++)
        if (F->g->outputs[o] == list[i]) // (sampling and the packing check read them)
          return "the logits are a model output";
    return taken_elsewhere(F, list, *n);
  }
  list[(*n)++] = cb;
  int dl = follow_reshapes(F, cb, list, n);
  if (!shape_eq(node(F, dl)->shape, m->shape))
    return "the logits' gradient does not come back to the GEMM's shape";
  // With GEMM operands in bf16, the gradient reaches the backward GEMMs through its CAST.
  if (node(F, x2)->op == OP_CAST && F->nusers[dl] == 1 && op_of(F, F->users[dl][0]) == OP_CAST) {
    dl = F->users[dl][0];
    list[(*n)++] = dl;
  }
  bool tb = m->ia[1] != 0, have_dx = false, have_dw = false;
  for (int k = 0; k < F->nusers[dl]; k++) {
    IrNode *u = node(F, F->users[dl][k]);
    bool dx = u->op == OP_MATMUL && u->in[0] == dl && u->in[1] == w && !u->ia[0] && u->ia[1] == !tb;
    bool dw = u->op == OP_MATMUL && u->ia[0] && !u->ia[1] &&
              (tb ? u->in[0] == dl && u->in[1] == x2 : u->in[0] == x2 && u->in[1] == dl);
    if (dx && !have_dx)
      have_dx = true;
    else if (dw && !have_dw)
      have_dw = true;
    else
      return arena_printf(F->a, "the logits' gradient is also read by %s", where(F, u->id));
    list[(*n)++] = u->id;
  }
  return taken_elsewhere(F, list, *n);
}

static void rule_lmhead(Fuser *F) {
  Graph *g = F->g;
  int *list = arena_alloc(F->a, sizeof(int) * (size_t)g->n);
  for (int i = 0; i < g->n; i++) {
    if (op_of(F, i) != OP_MATMUL || F->grp[i] >= 0)
      continue;
    int n, ce;
    const char *why = match_lmhead(F, i, list, &n, &ce);
    if (ce < 0)
      continue;
    if (!why && fuse_creates_cycle(F, -1, list, n))
      why = "the loss' gradient depends on the loss itself";
    if (why) {
      fuse_reject(F, i, ce, "LM head not chunked: %s", why);
      continue;
    }
    int gi = fuse_new_group(F, STEP_LMHEAD, i);
    for (int k = 1; k < n; k++)
      fuse_add_member(F, gi, list[k]);
  }
}

//
// Rule 3: siblings (multi-output backward ops) and cross-entropy forward + backward.
//
static bool same_inputs(const IrNode *a, const IrNode *b) {
  if (a->op != b->op || a->nin != b->nin || a->fa[0] != b->fa[0])
    return false;
  for (int k = 0; k < a->nin; k++)
    if (a->in[k] != b->in[k])
      return false;
  if (a->op == OP_ATTENTION_BWD)
    return a->ia[0] == b->ia[0] && a->ia[1] == b->ia[1] && a->ia[2] == b->ia[2] && a->ia[5] == b->ia[5] &&
           a->ia[6] == b->ia[6];
  return true;
}

static int which_of(const IrNode *n) { return (int)(n->op == OP_ATTENTION_BWD ? n->ia[3] : n->ia[0]); }

// Is u the ATTENTION_LSE of attention node n (same inputs and attributes)?
static bool lse_of(const IrNode *n, const IrNode *u) {
  if (u->op != OP_ATTENTION_LSE || u->nin != n->nin || u->fa[0] != n->fa[0])
    return false;
  for (int k = 0; k < n->nin; k++)
    if (u->in[k] != n->in[k])
      return false;
  return u->ia[0] == n->ia[0] && u->ia[1] == n->ia[1] && u->ia[2] == n->ia[2] && u->ia[4] == n->ia[4] &&
         u->ia[5] == n->ia[5] && u->ia[6] == n->ia[6];
}

static void rule_siblings(Fuser *F) {
  Graph *g = F->g;
  for (int i = 0; i < g->n; i++) {
    IrNode *n = node(F, i);
    if (F->grp[i] >= 0)
      continue;
    if (n->op == OP_LAYERNORM_BWD || n->op == OP_RMSNORM_BWD || n->op == OP_ATTENTION_BWD) {
      int dy = n->in[n->nin - 1], sib[3] = {-1, -1, -1}, ns = 0;
      for (int k = 0; k < F->nusers[dy] && ns < 3; k++) {
        IrNode *u = node(F, F->users[dy][k]);
        if (F->grp[u->id] < 0 && same_inputs(n, u))
          sib[ns++] = u->id;
      }
      int root = sib[0];
      for (int k = 0; k < ns; k++)
        if (which_of(node(F, sib[k])) == 0)
          root = sib[k];
      int gi = fuse_new_group(F, fuse_kind_of(n->op), root);
      for (int k = 0; k < ns; k++)
        if (sib[k] != root && !fuse_try_add(F, gi, sib[k]))
          fuse_reject(F, root, sib[k], "would make the steps cyclic");
    } else if (n->op == OP_ATTENTION) {
      int gi = fuse_new_group(F, STEP_ATTENTION, i), q = n->in[0];
      for (int k = 0; k < F->nusers[q]; k++) {
        IrNode *u = node(F, F->users[q][k]);
        if (F->grp[u->id] < 0 && lse_of(n, u) && !fuse_try_add(F, gi, u->id))
          fuse_reject(F, i, u->id, "would make the steps cyclic");
      }
    } else if (n->op == OP_CROSS_ENTROPY) {
      int gi = fuse_new_group(F, STEP_KERNEL, i), lg = n->in[0];
      for (int k = 0; k < F->nusers[lg]; k++) {
        IrNode *u = node(F, F->users[lg][k]);
        if (u->op != OP_CROSS_ENTROPY_BWD || u->in[0] != lg || u->in[1] != n->in[1] || F->grp[u->id] >= 0)
          continue;
        if (!fuse_try_add(F, gi, u->id))
          fuse_reject(F, i, u->id, "the loss' gradient depends on the loss itself");
      }
    }
  }
}

//
// Rule 4: GEMMs and their epilogues.
//
// Would consumer u, a backward node, join the step of root, a forward node? (Forward steps hold
// forward nodes only, so the backward pass can later be scheduled or recomputed on its own.)
static bool crosses_into_backward(const Fuser *F, int root, int u) {
  return root < F->g->fwd_end && u >= F->g->fwd_end;
}

// Why u cannot extend the epilogue of group gi whose chain ends at t, or NULL when it can.
static const char *epilogue_refusal(Fuser *F, int gi, int t, int u) {
  IrNode *n = node(F, u);
  if (!fuse_is_elementwise(n->op))
    return NULL; // not a candidate; the kinds of the two steps say why
  if (n->op != OP_RESHAPE && !fuse_is_unary(n->op) && !fuse_is_binary(n->op))
    return arena_printf(F->a, "%s remaps the GEMM's output index", op_name(n->op));
  if (!fuse_reads_identity(F, u, t))
    return arena_printf(F->a, "iteration spaces differ: %s vs %s", fuse_shape_text(F, t), fuse_shape_text(F, u));
  if (crosses_into_backward(F, F->groups[gi].root, u))
    return "the forward step does not compute backward values";
  for (int k = 0; k < n->nin; k++)
    if (F->grp[n->in[k]] == gi && !fuse_reads_identity(F, u, n->in[k]))
      return "reads another epilogue value through a broadcast";
  if (F->groups[gi].n >= F->max_group)
    return arena_printf(F->a, "group size cap (%d nodes)", F->max_group);
  if (fuse_too_many_buffers(F, gi, &u, 1))
    return fuse_buffer_cap(F);
  if (fuse_creates_cycle(F, gi, &u, 1))
    return "would make the steps cyclic (its other operand depends on this GEMM)";
  return NULL;
}

static void rule_gemm(Fuser *F) {
  Graph *g = F->g;
  for (int i = 0; i < g->n; i++) {
    if (op_of(F, i) != OP_MATMUL || F->grp[i] >= 0)
      continue;
    int gi = fuse_new_group(F, STEP_GEMM, i);
    for (int t = i;;) {
      int next = -1;
      for (int k = 0; k < F->nusers[t] && next < 0; k++) {
        int u = F->users[t][k];
        if (F->grp[u] >= 0 || !fuse_is_elementwise(op_of(F, u)))
          continue;
        const char *why = epilogue_refusal(F, gi, t, u);
        if (why)
          fuse_reject(F, t, u, "%s", why);
        else
          next = u;
      }
      if (next < 0)
        break;
      fuse_add_member(F, gi, next);
      t = next;
    }
  }
}

//
// Rule 5: LAYERNORM / RMSNORM forward with the ADD producing x; softmax and its backward alone.
//
static void rule_rowwise(Fuser *F) {
  Graph *g = F->g;
  for (int i = 0; i < g->n; i++) {
    IrNode *n = node(F, i);
    if (F->grp[i] >= 0)
      continue;
    if (n->op == OP_SOFTMAX || n->op == OP_SOFTMAX_BWD) {
      fuse_new_group(F, STEP_KERNEL, i);
      continue;
    }
    if (n->op != OP_LAYERNORM && n->op != OP_RMSNORM)
      continue;
    int gi = fuse_new_group(F, STEP_KERNEL, i), x = n->in[0];
    if (op_of(F, x) != OP_ADD || !shape_eq(node(F, x)->shape, n->shape))
      continue;
    int h = F->grp[x];
    if (h >= 0)
      fuse_reject(F, x, i, "the ADD is already in the epilogue of %s", where(F, F->groups[h].root));
    else if (!fuse_try_add(F, gi, x))
      fuse_reject(F, x, i, "would make the steps cyclic");
  }
}

//
// Rule 6: ops that run alone.
//
static void rule_singles(Fuser *F) {
  for (int i = 0; i < F->g->n; i++) {
    Op op = op_of(F, i);
    if (F->grp[i] < 0 && !fuse_is_leaf(op) && !fuse_is_elementwise(op) && !fuse_is_reduction(op))
      fuse_new_group(F, fuse_kind_of(op), i);
  }
}

//
// Rules 7 and 8: producers pulled into elementwise and reduction steps.
//
// Grows group gi with the producers of its members, scanning ids downwards from `from` (exclusive)
// so that every reader of a candidate has been decided before the candidate is.
static void pull_producers(Fuser *F, int gi, int from) {
  Group *G = &F->groups[gi];
  for (int i = 0; i < G->n; i++) {
    IrNode *m = node(F, G->m[i]);
    for (int k = 0; k < m->nin; k++)
      F->cand[m->in[k]] = true;
  }
  for (int p = from - 1; p >= 0; p--) {
    if (!F->cand[p])
      continue;
    F->cand[p] = false;
    Op op = op_of(F, p);
    if (fuse_is_leaf(op) || F->grp[p] >= 0 || !fuse_is_elementwise(op))
      continue;
    int reader = -1, outside = -1;
    bool many = false;
    for (int k = 0; k < F->nusers[p]; k++) {
      int u = F->users[p][k];
      if (F->grp[u] != gi) {
        if (outside < 0)
          outside = u;
        continue;
      }
      if (reader < 0)
        reader = u;
      many |= F->bcast[u] || fuse_reads_many_to_one(F, u, p);
    }
    if (outside >= 0) {
      fuse_reject(F, p, reader, "producer has readers outside the group (%s)", where(F, outside));
      continue;
    }
    if (many && !fuse_is_cheap(op)) {
      fuse_reject(F, p, reader, "iteration spaces differ: %s vs %s (%s would be recomputed per element)",
                  fuse_shape_text(F, p), fuse_shape_text(F, reader), op_name(op));
      continue;
    }
    if (G->n >= F->max_group) {
      fuse_reject(F, p, reader, "group size cap (%d nodes)", F->max_group);
      continue;
    }
    if (fuse_too_many_buffers(F, gi, &p, 1)) {
      fuse_reject(F, p, reader, "%s", fuse_buffer_cap(F));
      continue;
    }
    fuse_add_member(F, gi, p);
    F->bcast[p] = many;
    IrNode *n = node(F, p);
    for (int k = 0; k < n->nin; k++)
      F->cand[n->in[k]] = true;
  }
  for (int i = 0; i < G->n; i++)
    F->bcast[G->m[i]] = false;
}

// Grows group gi (rooted at r) with the chain of elementwise consumers of r's result: each of the
// result's element count, reading the previous link at identity and being its only reader.
static void grow_chain(Fuser *F, int gi, int r) {
  for (int t = r;;) {
    int u = only_user(F, t);
    if (u < 0 || F->grp[u] >= 0 || !fuse_is_elementwise(op_of(F, u)))
      break;
    IrNode *n = node(F, u);
    const char *why = NULL;
    if (!(n->op == OP_RESHAPE || fuse_is_unary(n->op) || fuse_is_binary(n->op)) || !fuse_reads_identity(F, u, t) ||
        numel(F, u) != numel(F, r))
      why = arena_printf(F->a, "iteration spaces differ: %s vs %s", fuse_shape_text(F, t), fuse_shape_text(F, u));
    for (int k = 0; k < n->nin && !why; k++) {
      int x = n->in[k];
      if (F->grp[x] == gi && x != t && (x < r || !shape_eq(node(F, x)->shape, n->shape)))
        why = "reads a value the reduction consumes";
    }
    if (!why && crosses_into_backward(F, r, u))
      why = "the forward step does not compute backward values";
    if (!why && F->groups[gi].n >= F->max_group)
      why = arena_printf(F->a, "group size cap (%d nodes)", F->max_group);
    if (!why && fuse_too_many_buffers(F, gi, &u, 1))
      why = fuse_buffer_cap(F);
    if (!why && fuse_creates_cycle(F, gi, &u, 1))
      why = "would make the steps cyclic";
    if (why) {
      fuse_reject(F, t, u, "%s", why);
      break;
    }
    fuse_add_member(F, gi, u);
    t = u;
  }
}

static bool is_norm_bwd(Op op) { return op == OP_LAYERNORM_BWD || op == OP_RMSNORM_BWD; }

static void rule_reductions(Fuser *F) {
  Graph *g = F->g;
  for (int r = 0; r < g->n; r++) { // a norm backward's dx first: its chain is the residual gradient
    const IrNode *n = node(F, r);
    if (is_norm_bwd(n->op) && n->ia[0] == 0 && F->grp[r] >= 0 && F->groups[F->grp[r]].root == r)
      grow_chain(F, F->grp[r], r);
  }
  for (int r = 0; r < g->n; r++) {
    if (op_of(F, r) == OP_EMBED_BWD && F->grp[r] >= 0 && F->groups[F->grp[r]].n == 1) {
      grow_chain(F, F->grp[r], r); // the tied table's gradient: lm head's + the embedding's
      continue;
    }
    if (!fuse_is_reduction(op_of(F, r)) || F->grp[r] >= 0)
      continue;
    int gi = fuse_new_group(F, STEP_KERNEL, r);
    pull_producers(F, gi, r);
    grow_chain(F, gi, r);
  }
}

static void rule_elementwise(Fuser *F) {
  for (int c = F->g->n - 1; c >= 0; c--) {
    if (F->grp[c] >= 0 || !fuse_is_elementwise(op_of(F, c)))
      continue;
    int gi = fuse_new_group(F, STEP_KERNEL, c);
    pull_producers(F, gi, c);
  }
}

//
// Rule 9: a CAST left alone joins the kernel that computes its input.
//
static void rule_casts(Fuser *F) {
  for (int c = 0; c < F->g->n; c++) {
    int lone = F->grp[c];
    if (op_of(F, c) != OP_CAST || lone < 0)
      continue;
    // The input, through RESHAPEs in the CAST's step or alone in theirs (views to be): they move along
    // with the CAST, which must leave nothing else behind.
    int moved[8], nmoved = 0, x = node(F, c)->in[0], left = F->groups[lone].n - 1;
    while (op_of(F, x) == OP_RESHAPE && F->grp[x] >= 0 && (F->grp[x] == lone || F->groups[F->grp[x]].n == 1) &&
           nmoved < 7) {
      left -= F->grp[x] == lone;
      moved[nmoved++] = x;
      x = node(F, x)->in[0];
    }
    moved[nmoved++] = c;
    if (left != 0)
      continue;
    int gi = F->grp[x];
    bool attention = gi >= 0 && F->groups[gi].kind == STEP_ATTENTION && op_of(F, F->groups[gi].root) == OP_ATTENTION &&
                     x == F->groups[gi].root && node(F, c)->dtype == DT_BF16;
    if (gi < 0 || (F->groups[gi].kind != STEP_KERNEL && !attention) ||
        fuse_is_reduction(op_of(F, F->groups[gi].root)) || numel(F, x) != numel(F, c))
      continue;
    const char *why = NULL;
    if (crosses_into_backward(F, F->groups[gi].root, c))
      why = "the forward step does not compute backward values";
    else if (F->groups[gi].n + nmoved > F->max_group)
      why = arena_printf(F->a, "group size cap (%d nodes)", F->max_group);
    else if (fuse_too_many_buffers(F, gi, moved, nmoved))
      why = fuse_buffer_cap(F);
    else if (fuse_creates_cycle(F, gi, moved, nmoved))
      why = "would make the steps cyclic";
    if (why) {
      fuse_reject(F, x, c, "%s", why);
      continue;
    }
    for (int k = 0; k < nmoved; k++) {
      fuse_remove_member(F, F->grp[moved[k]], moved[k]);
      fuse_add_member(F, gi, moved[k]);
    }
  }
}

//
// Rule 10: a reduction over the value an elementwise kernel writes takes that kernel in.
//
// Whether group gi is an elementwise kernel, or a GEMM with its epilogue, whose every out has n
// elements (so a loop over the reduction's input visits each of its outs once per element).
static bool elementwise_over(const Fuser *F, int gi, int64_t n) {
  const Group *G = &F->groups[gi];
  bool gemm = G->kind == STEP_GEMM && op_of(F, G->root) == OP_MATMUL && numel(F, G->root) == n;
  bool kernel = G->kind == STEP_KERNEL && fuse_is_elementwise(op_of(F, G->root)) && numel(F, G->root) == n;
  if (G->n == 0 || (!gemm && !kernel))
    return false;
  for (int i = 0; i < G->n; i++)
    if (fuse_is_out(F, gi, G->m[i]) && numel(F, G->m[i]) != n)
      return false;
  return true;
}

// Is reduction r (alone in group gi, with RESHAPEs) a SUM over the rows of x, a value of norm
// backward step ei with the norm's element count and row length: a column sum its row loop can add up?
static bool column_sum_of_norm(const Fuser *F, int r, int gi, int x, int ei) {
  const Group *E = &F->groups[ei];
  const IrNode *n = node(F, r), *in = node(F, n->in[0]), *root = node(F, E->root);
  if (E->kind != STEP_KERNEL || !is_norm_bwd(root->op) || n->op != OP_SUM || n->ia[0] != 0 || in->shape.rank != 2 ||
      numel(F, x) != numel(F, E->root) || in->shape.d[1] != root->shape.d[root->shape.rank - 1])
    return false;
  for (int i = 0; i < F->groups[gi].n; i++)
    if (F->groups[gi].m[i] != r && op_of(F, F->groups[gi].m[i]) != OP_RESHAPE)
      return false;
  return true;
}

// Moves the members of group `from`, and the RESHAPEs of the chain between x and reduction r that
// are in neither group, into group `into`; unless `why` (a refusal already found) or a cycle says no,
// which the pair from x to the chain's end (or r) is told.
static void merge_reduction(Fuser *F, int into, int from, const int *chain, int nchain, int x, int r,
                            const char *why) {
  int nmoved = 0, *moved = arena_alloc(F->a, sizeof(int) * (size_t)(F->groups[from].n + nchain + 1));
  for (int k = 0; k < F->groups[from].n; k++)
    moved[nmoved++] = F->groups[from].m[k];
  for (int c = 0; c < nchain; c++)
    if (F->grp[chain[c]] != into && F->grp[chain[c]] != from)
      moved[nmoved++] = chain[c];
  if (!why && fuse_too_many_buffers(F, into, moved, nmoved))
    why = fuse_buffer_cap(F);
  if (!why && fuse_creates_cycle(F, into, moved, nmoved))
    why = "would make the steps cyclic";
  if (why) {
    fuse_reject_again(F, x, nchain ? chain[nchain - 1] : r, why);
    return;
  }
  for (int k = 0; k < nmoved; k++) {
    if (F->grp[moved[k]] >= 0)
      fuse_remove_member(F, F->grp[moved[k]], moved[k]);
    fuse_add_member(F, into, moved[k]);
  }
}

static void rule_reduction_producers(Fuser *F) {
  for (int r = 0; r < F->g->n; r++) {
    int gi = F->grp[r];
    if (!fuse_is_reduction(op_of(F, r)) || gi < 0 || F->groups[gi].root != r)
      continue;
    // The reduction's input through the RESHAPEs between (its own members, or alone in their steps:
    // views to be).
    int chain[8], nchain = 0, x = node(F, r)->in[0];
    while (op_of(F, x) == OP_RESHAPE && (F->grp[x] < 0 || F->grp[x] == gi || F->groups[F->grp[x]].n == 1) &&
           nchain < 8) {
      chain[nchain++] = x;
      x = node(F, x)->in[0];
    }
    int ei = F->grp[x];
    if (ei >= 0 && ei != gi && column_sum_of_norm(F, r, gi, x, ei)) { // into the norm's step
      bool cap = F->groups[ei].n + F->groups[gi].n > F->max_group;
      merge_reduction(F, ei, gi, chain, nchain, x, r,
                      cap ? arena_printf(F->a, "group size cap (%d nodes)", F->max_group) : NULL);
      continue;
    }
    if (ei < 0 || ei == gi || !elementwise_over(F, ei, numel(F, x)))
      continue;
    // Nothing else of the reduction's step may read the kernel's values (they would be evaluated at
    // the reduction's output index), and the forward and backward halves stay apart.
    const Group *R = &F->groups[gi], *E = &F->groups[ei];
    const char *why = NULL;
    for (int i = 0; i < R->n && !why; i++) {
      int u = R->m[i];
      bool on_chain = u == r;
      for (int c = 0; c < nchain; c++)
        on_chain |= u == chain[c];
      for (int k = 0; k < node(F, u)->nin && !on_chain && !why; k++)
        if (F->grp[node(F, u)->in[k]] == ei)
          why = "another member of the reduction reads the kernel's values at other indices";
    }
    if (!why && (E->root < F->g->fwd_end) != (r < F->g->fwd_end))
      why = "the forward step does not compute backward values";
    if (!why && R->n + E->n > F->max_group)
      why = arena_printf(F->a, "group size cap (%d nodes)", F->max_group);
    // What moves: the kernel's members and the RESHAPEs not yet in the reduction's step; into a GEMM's
    // step (which stays a GEMM step, its epilogue now computed by the reduction's loop), the
    // reduction's members and the RESHAPEs.
    bool gemm = E->kind == STEP_GEMM;
    merge_reduction(F, gemm ? ei : gi, gemm ? gi : ei, chain, nchain, x, r, why);
  }
}

//
// Rule 11: a parameter's bf16 rounding becomes a copy the optimizer keeps.
//
static void rule_copies(Fuser *F) {
  for (int c = 0; c < F->g->n; c++) {
    const IrNode *n = node(F, c);
    int p = n->nin == 1 ? n->in[0] : -1, gi = F->grp[c];
    if (n->op != OP_CAST || n->dtype != DT_BF16 || op_of(F, p) != OP_PARAM || gi < 0 || F->groups[gi].n != 1)
      continue;
    bool updated = false;
    for (int k = 0; k < F->nusers[p]; k++)
      updated |= op_of(F, F->users[p][k]) == OP_ADAMW && F->grp[F->users[p][k]] >= 0 &&
                 F->groups[F->grp[F->users[p][k]]].kind == STEP_OPTIMIZER;
    if (!updated || F->copy_of[p] >= 0)
      continue;
    fuse_remove_member(F, gi, c);
    F->copy_of[p] = c;
  }
}

//
// Views.
//
// Is node id the copy of rule 11 in the table copy_of (per PARAM its copy, else -1)?
static bool copy_in(const Graph *g, const int *copy_of, int id) {
  const IrNode *n = g->nodes[id];
  return n->op == OP_CAST && copy_of[n->in[0]] == id;
}

static bool is_copy(const Fuser *F, int id) { return copy_in(F->g, F->copy_of, id); }

static int view_base(const Fuser *F, int id) {
  while (F->view[id])
    id = node(F, id)->in[0];
  return id;
}

// May RESHAPE r (whose input is materialised, or about to be) be a view? A parameter's gradient
// must sit in the gradient buffer, so its input must be free to move there.
static bool view_allowed(Fuser *F, int r) {
  Graph *g = F->g;
  if (node(F, r)->grad_of < 0)
    return true;
  int b = view_base(F, node(F, r)->in[0]);
  IrNode *n = node(F, b);
  return !fuse_is_leaf(n->op) && n->grad_of < 0 && n->op != OP_ADAMW && n->op != OP_GRAD_NORM && !F->pinned[b] &&
         b != g->loss;
}

// Is r a SLICE of the last axis that only attention reads, as q, k or v? Attention reads its rows in
// place, with the stride of the sliced tensor, so r need not be copied out (a strided view).
static bool attention_slice(const Fuser *F, int r) {
  const IrNode *n = node(F, r);
  if (n->op != OP_SLICE || n->ia[0] != n->shape.rank - 1 || F->nusers[r] == 0 || r == F->g->loss ||
      n->grad_of >= 0)
    return false;
  for (int k = 0; k < F->nusers[r]; k++) {
    const IrNode *u = node(F, F->users[r][k]);
    if (u->op != OP_ATTENTION && u->op != OP_ATTENTION_LSE && u->op != OP_ATTENTION_BWD)
      return false;
    for (int i = 3; i < u->nin; i++)
      if (u->in[i] == r)
        return false;
  }
  for (int i = 0; i < F->g->noutputs; i++)
    if (F->g->outputs[i] == r)
      return false;
  return true;
}

// Turns RESHAPEs into views: those whose input is materialised, and those read outside their step
// (whose input then becomes an out); and the SLICEs only attention reads (attention_slice).
static void fuse_resolve_views(Fuser *F) {
  Graph *g = F->g;
  for (bool changed = true; changed;) {
    changed = false;
    for (int r = 0; r < g->n; r++) {
      int gi = F->grp[r];
      bool slice = gi >= 0 && attention_slice(F, r);
      if ((op_of(F, r) != OP_RESHAPE && !slice) || gi < 0)
        continue;
      int x = node(F, r)->in[0];
      bool mat = F->view[x] || (fuse_is_leaf(op_of(F, x)) && op_of(F, x) != OP_CONST) ||
                 (F->grp[x] >= 0 && F->grp[x] != gi) || is_copy(F, x);
      bool read_outside = F->nusers[r] == 0 || r == g->loss;
      for (int k = 0; k < F->nusers[r]; k++)
        read_outside |= F->grp[F->users[r][k]] != gi;
      if ((!mat && !(F->grp[x] == gi && read_outside)) || !view_allowed(F, r))
        continue;
      fuse_remove_member(F, gi, r);
      F->view[r] = true;
      if (node(F, r)->grad_of >= 0)
        F->pinned[view_base(F, r)] = true;
      Group *G = &F->groups[gi];
      if (G->root == r && G->n > 0) { // the last member, a CAST joined by rule 9 only if all are
        G->root = G->m[0];
        for (int i = 1; i < G->n; i++) {
          bool cast = op_of(F, G->m[i]) == OP_CAST, root_cast = op_of(F, G->root) == OP_CAST;
          if ((cast == root_cast && G->m[i] > G->root) || (!cast && root_cast))
            G->root = G->m[i];
        }
      }
      changed = true;
    }
  }
}

//
// Assembly: order, outs and ins, costs, names, and a reason for every pair left unfused.
//
double fuse_node_flops(const Graph *g, int id) {
  const IrNode *n = g->nodes[id];
  double e = (double)shape_numel(n->shape), x = n->nin ? (double)shape_numel(g->nodes[n->in[0]]->shape) : 0;
  switch (n->op) {
  case OP_GELU: return 8 * e;
  case OP_GELU_BWD: return 12 * e;
  case OP_SILU: return 4 * e;
  case OP_SILU_BWD: return 6 * e;
  case OP_SIGMOID: return 4 * e;
  case OP_MAX_BWD: return 2 * e;
  case OP_SUM: case OP_MEAN: case OP_MAX: case OP_TARGET_COUNT: return x;
  case OP_MATMUL: {
    Shape a = g->nodes[n->in[0]]->shape;
    return 2 * e * (double)(n->ia[0] ? a.d[a.rank - 2] : a.d[a.rank - 1]);
  }
  case OP_EMBED_BWD: case OP_GATHER_BWD: return (double)shape_numel(g->nodes[n->in[1]]->shape);
  case OP_SCATTER_ADD: return (double)shape_numel(g->nodes[n->in[2]]->shape);
  case OP_TOPK: return x * (double)n->ia[1]; // (a pass over the line per index found)
  case OP_LAYERNORM: return 8 * e;
  case OP_LAYERNORM_BWD: return (n->ia[0] == 0 ? 10 : n->ia[0] == 1 ? 2 : 1) * x;
  case OP_RMSNORM: return 5 * e;
  case OP_RMSNORM_BWD: return (n->ia[0] == 0 ? 8 : 2) * x;
  case OP_SOFTMAX: return 4 * e;
  case OP_SOFTMAX_BWD: case OP_CROSS_ENTROPY: case OP_CROSS_ENTROPY_BWD: return 3 * x;
  case OP_ATTENTION: case OP_ATTENTION_LSE: case OP_ATTENTION_BWD: {
    // 2 products of 2 flops a channel per (query, key) pair the kernels compute: T x S, halved when
    // causal, fewer with a window (att_pairs); over B x H heads of D = C / H channels
    Shape q = g->nodes[n->in[0]]->shape;
    double f = 4.0 * (double)q.d[0] * (double)q.d[2] *
               att_pairs(q.d[1], g->nodes[n->in[1]]->shape.d[1], n->ia[1], n->ia[6]);
    if (n->op == OP_ATTENTION_LSE) // Q K^T alone (nothing more in its forward's step: node_flops)
      return f / 2;
    return n->op == OP_ATTENTION ? f : 2 * f / 3;
  }
  case OP_ROPE: return 3 * e;
  case OP_ATTENTION_MASK: return e; // (a comparison or two per element)
  case OP_GRAD_NORM: {
    double s = 0;
    for (int k = 0; k < n->nin; k++)
      s += 2 * (double)shape_numel(g->nodes[n->in[k]]->shape);
    return s;
  }
  case OP_ADAMW: return 12 * e;
  case OP_INPUT: case OP_PARAM: case OP_STATE: case OP_SCALAR: case OP_CONST: case OP_RESHAPE:
  case OP_PERMUTE: case OP_BROADCAST: case OP_SLICE: case OP_SLICE_BWD: case OP_CONCAT: case OP_EMBED:
  case OP_GATHER: case OP_COUNT: return 0;
  default: return e; // the remaining elementwise ops: one operation per element
  }
}

// A node's FLOPs within its step: an ATTENTION_LSE in its forward's step costs nothing more.
static double node_flops(const Fuser *F, int id) {
  if (op_of(F, id) == OP_ATTENTION_LSE && F->grp[id] >= 0 && op_of(F, F->groups[F->grp[id]].root) == OP_ATTENTION)
    return 0;
  return fuse_node_flops(F->g, id);
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

static void push_unique(Arena *a, int **list, int *n, int v) {
  for (int i = 0; i < *n; i++)
    if ((*list)[i] == v)
      return;
  if ((*n & (*n - 1)) == 0) { // grow at powers of two
    int *l = arena_alloc(a, sizeof(int) * (size_t)(*n ? 2 * *n : 1));
    if (*n)
      memcpy(l, *list, sizeof(int) * (size_t)*n);
    *list = l;
  }
  (*list)[(*n)++] = v;
}

// A binary heap of indices, the least key[i] on top.
static void heap_push(int *heap, int *n, const int *key, int v) {
  int at = (*n)++;
  for (; at > 0 && key[heap[(at - 1) / 2]] > key[v]; at = (at - 1) / 2)
    heap[at] = heap[(at - 1) / 2];
  heap[at] = v;
}

static int heap_pop(int *heap, int *n, const int *key) {
  int top = heap[0], v = heap[--*n], at = 0;
  for (int c; (c = 2 * at + 1) < *n; at = c) {
    if (c + 1 < *n && key[heap[c + 1]] < key[heap[c]])
      c++;
    if (key[heap[c]] >= key[v])
      break;
    heap[at] = heap[c];
  }
  heap[at] = v;
  return top;
}

// Topological order of the live groups, preferring the one whose last node comes first (an
// ATTENTION_LSE in its forward's step, rule 3, does not count: the step is the forward's). The
// optimizer's nodes come last in the graph, so every step that reads a parameter runs before the
// step that updates it in place.
static int *order_groups(Fuser *F, int *live, int nlive) {
  int *pos = arena_alloc(F->a, sizeof(int) * (size_t)F->ngroups);
  int **succ = arena_alloc(F->a, sizeof(int *) * (size_t)nlive);
  int *nsucc = arena_alloc(F->a, sizeof(int) * (size_t)nlive);
  int *indeg = arena_alloc(F->a, sizeof(int) * (size_t)nlive);
  int *key = arena_alloc(F->a, sizeof(int) * (size_t)nlive);
  for (int i = 0; i < nlive; i++)
    pos[live[i]] = i;
  for (int i = 0; i < nlive; i++) {
    Group *G = &F->groups[live[i]];
    key[i] = -1;
    for (int j = 0; j < G->n; j++) {
      IrNode *n = node(F, G->m[j]);
      if (n->id > key[i] && (n->op != OP_ATTENTION_LSE || G->root == n->id))
        key[i] = n->id;
      for (int k = 0; k < n->nin; k++) {
        int b = view_base(F, n->in[k]);
        int from = F->grp[b] >= 0 ? pos[F->grp[b]] : -1;
        // (i's arcs are added together: a repeated one is the last in the list)
        if (from >= 0 && from != i && (nsucc[from] == 0 || succ[from][nsucc[from] - 1] != i))
          push_unique(F->a, &succ[from], &nsucc[from], i);
      }
    }
  }
  for (int i = 0; i < nlive; i++)
    for (int k = 0; k < nsucc[i]; k++)
      indeg[succ[i][k]]++;
  // The groups ready to run, a heap by key (keys differ: each is a member of its own group).
  int *order = arena_alloc(F->a, sizeof(int) * (size_t)nlive);
  int *heap = arena_alloc(F->a, sizeof(int) * (size_t)nlive), nheap = 0;
  for (int i = 0; i < nlive; i++)
    if (indeg[i] == 0)
      heap_push(heap, &nheap, key, i);
  for (int s = 0; s < nlive; s++) {
    if (nheap == 0)
      return NULL;
    int best = heap_pop(heap, &nheap, key);
    order[s] = live[best];
    for (int k = 0; k < nsucc[best]; k++)
      if (--indeg[succ[best][k]] == 0)
        heap_push(heap, &nheap, key, succ[best][k]);
  }
  return order;
}

// The label of an op in a step name.
static const char *label(const Fuser *F, int id, bool root, StepKind kind) {
  Op op = op_of(F, id);
  if (root && kind == STEP_LMHEAD)
    return "lmhead";
  if (op == OP_MATMUL)
    return "gemm";
  if (op == OP_ATTENTION_LSE && !root)
    return "lse";
  if (root && (op == OP_LAYERNORM || op == OP_RMSNORM || op == OP_SOFTMAX || op == OP_CROSS_ENTROPY ||
               op == OP_ATTENTION))
    return arena_printf(F->a, "%s_fwd", op_name(op));
  return op_name(op);
}

static const char *step_name(const Fuser *F, int index, const Step *s) {
  const char *seen[64];
  int nseen = 0;
  seen[nseen++] = op_name(op_of(F, s->root));
  seen[nseen++] = label(F, s->root, true, s->kind);
  char buf[512];
  int len = snprintf(buf, sizeof buf, "k%d_%s", index, seen[1]);
  for (int i = 0; i < s->nnodes; i++) {
    int id = s->nodes[i];
    if (id == s->root || op_of(F, id) == OP_RESHAPE)
      continue;
    const char *l = label(F, id, false, s->kind);
    bool dup = false;
    for (int k = 0; k < nseen && !dup; k++)
      dup = !strcmp(seen[k], l);
    if (dup || nseen == 64)
      continue;
    seen[nseen++] = l;
    if (len < (int)sizeof buf)
      len += snprintf(buf + len, sizeof buf - (size_t)len, "__%s", l);
  }
  return arena_strdup(F->a, buf);
}

// The reason a producer and a consumer in different steps were not fused, from the steps' kinds,
// when no rule recorded one.
static const char *generic_reason(const Fuser *F, const Fusion *f, int p, int c) {
  const Step *sp = &f->steps[f->step_of[p]], *sc = &f->steps[f->step_of[c]];
  Op cop = op_of(F, c), pop = op_of(F, p), croot = op_of(F, sc->root);
  if (cop == OP_MATMUL)
    return "consumer is a GEMM (no prologue fusion)";
  if (cop == OP_ATTENTION || cop == OP_ATTENTION_LSE || cop == OP_ATTENTION_BWD)
    return "consumer is attention (its operands come from memory)";
  if (sc->kind == STEP_LMHEAD)
    return "consumer is in the LM-head step (its inputs come from memory)";
  if (sc->kind == STEP_KERNEL && (croot == OP_LAYERNORM || croot == OP_RMSNORM))
    return arena_printf(F->a, "consumer is a %s kernel (only an ADD producing its x is fused)", op_name(croot));
  if (cop == OP_TOPK)
    return "consumer is a topk kernel (it compares whole lines along its axis: its input comes from memory)";
  if (cop == OP_GATHER || cop == OP_GATHER_BWD || cop == OP_SCATTER_ADD)
    return arena_printf(F->a, "consumer is a %s kernel (it reads at offsets computed from indices: its inputs come "
                        "from memory)", op_name(cop));
  if (sc->kind == STEP_KERNEL && !fuse_is_elementwise(croot) && !fuse_is_reduction(croot))
    return arena_printf(F->a, "consumer is a %s kernel (its inputs come from memory)", op_name(croot));
  if (sc->kind == STEP_GEMM)
    return "consumer is in a GEMM epilogue (its other operands come from memory)";
  if (sp->kind == STEP_GEMM)
    return F->nusers[p] > 1 ? arena_printf(F->a, "the GEMM epilogue ends here: %d readers", F->nusers[p])
                            : "consumer is not an elementwise epilogue op";
  if (sp->kind != STEP_KERNEL)
    return arena_printf(F->a, "producer is written by the %s step (no epilogue fusion)", step_kind_name(sp->kind));
  if (pop == OP_GATHER_BWD || pop == OP_SCATTER_ADD)
    return arena_printf(F->a, "producer is a %s kernel (an element is final only after every source is added)",
                        op_name(pop));
  if (!fuse_is_elementwise(pop) && !fuse_is_reduction(pop))
    return arena_printf(F->a, "producer is a %s kernel (no epilogue fusion)", op_name(op_of(F, sp->root)));
  if (numel(F, p) != numel(F, c))
    return arena_printf(F->a, "iteration spaces differ: %s vs %s", fuse_shape_text(F, p), fuse_shape_text(F, c));
  return "producer has readers outside the group";
}

// The optimizer step writes the copies (rule 11): count what it writes, and check that every step
// reading a copy runs before it.
static bool copies_written(Fuser *F, Fusion *f) {
  int opt = -1;
  for (int s = 0; s < f->nsteps; s++)
    if (f->steps[s].kind == STEP_OPTIMIZER)
      opt = s;
  for (int s = 0; s < f->nsteps; s++)
    for (int k = 0; k < f->steps[s].nins; k++)
      if (is_copy(F, view_base(F, f->steps[s].ins[k])) && s > opt) {
        snprintf(F->g->err, sizeof F->g->err, "fuse: internal error: %s reads a parameter copy after the optimizer",
                 f->steps[s].name);
        return false;
      }
  for (int i = 0; i < F->g->n; i++)
    if (is_copy(F, i)) {
      f->ncopies++;
      f->steps[opt].bytes_written += dtype_size(DT_BF16) * (double)numel(F, i);
      f->steps[opt].flops += (double)numel(F, i);
    }
  return true;
}

// Traffic of values a step never materialises but moves all the same, added to st.
static void unmaterialised_traffic(const Fuser *F, int gi, Step *st) {
  const Group *G = &F->groups[gi];
  double root = dtype_size(node(F, G->root)->dtype) * (double)numel(F, G->root);
  // A GEMM whose epilogue a reduction computes (rule 10) leaves its product in memory for the
  // reduction's loop to read: the emitters cannot sum inside the library's GEMM.
  bool reduces = false;
  for (int j = 0; j < G->n; j++)
    reduces |= fuse_is_reduction(op_of(F, G->m[j]));
  if (G->kind == STEP_GEMM && reduces) {
    st->bytes_read += root;
    if (!fuse_is_out(F, gi, G->root))
      st->bytes_written += root;
  }
  // The LM head's logits (its root, or the root's CAST that the loss reads with bf16) and their
  // gradient cross memory chunk by chunk: the logits GEMM writes a chunk and the cross-entropy kernel
  // reads it back; the kernel writes dlogits (their CAST when the GEMMs read bf16) and each backward
  // GEMM reads them. (W and dW, read and updated once per chunk, are counted once: the chunk count is
  // the target's.)
  if (G->kind == STEP_LMHEAD) {
    double dl = 0, lg = root;
    int readers = 0;
    for (int j = 0; j < G->n; j++) {
      const IrNode *n = node(F, G->m[j]);
      double bytes = dtype_size(n->dtype) * (double)numel(F, n->id);
      int src = n->op == OP_CAST ? n->in[0] : -1;
      while (src >= 0 && op_of(F, src) == OP_RESHAPE)
        src = node(F, src)->in[0];
      if (n->op == OP_CAST && src == G->root)
        lg = bytes;
      else if (n->op == OP_CAST || (n->op == OP_CROSS_ENTROPY_BWD && dl == 0))
        dl = bytes;
      readers += n->op == OP_MATMUL && n->id != G->root;
    }
    st->bytes_written += lg + dl;
    st->bytes_read += lg + readers * dl;
  }
}

// A set of pairs (producer, step), as fuse_pair_slot's table of indices into p and s.
typedef struct {
  int *p, *s, n;
} Told;

static bool same_told(const void *ctx, int i, int p, int s) {
  const Told *t = ctx;
  return t->p[i] == p && t->s[i] == s;
}

// Adds (p, s) to the set; false when it was there.
static bool tell(Told *t, int *table, int mask, int p, int s) {
  int at = fuse_pair_slot(table, mask, p, s, same_told, t);
  if (table[at] >= 0)
    return false;
  t->p[t->n] = p;
  t->s[t->n] = s;
  table[at] = t->n++;
  return true;
}

static Fusion *fuse_assemble(Fuser *F) {
  Graph *g = F->g;
  Arena *a = F->a;
  int *live = arena_alloc(a, sizeof(int) * (size_t)(F->ngroups ? F->ngroups : 1)), nlive = 0;
  for (int i = 0; i < F->ngroups; i++)
    if (F->groups[i].n > 0)
      live[nlive++] = i;
  int *order = order_groups(F, live, nlive);
  if (!order) {
    snprintf(g->err, sizeof g->err, "fuse: internal error: the steps depend on each other in a cycle");
    return NULL;
  }
  Fusion *f = arena_alloc(a, sizeof *f);
  f->g = g;
  f->opt = F->opt;
  f->nsteps = nlive;
  f->steps = arena_alloc(a, sizeof(Step) * (size_t)(nlive ? nlive : 1));
  f->step_of = arena_alloc(a, sizeof(int) * (size_t)g->n);
  f->materialised = arena_alloc(a, sizeof(bool) * (size_t)g->n);
  for (int i = 0; i < g->n; i++) {
    f->step_of[i] = -1;
    f->materialised[i] = F->view[i] || (fuse_is_leaf(op_of(F, i)) && op_of(F, i) != OP_CONST) || is_copy(F, i);
  }
  f->copy_of = F->copy_of;
  for (int s = 0; s < nlive; s++) {
    int gi = order[s];
    Group *G = &F->groups[gi];
    Step *st = &f->steps[s];
    st->kind = G->kind;
    st->root = G->root;
    st->nnodes = G->n;
    st->nodes = arena_alloc(a, sizeof(int) * (size_t)G->n);
    memcpy(st->nodes, G->m, sizeof(int) * (size_t)G->n);
    qsort(st->nodes, (size_t)G->n, sizeof(int), cmp_int);
    for (int j = 0; j < G->n; j++) {
      int id = st->nodes[j];
      IrNode *n = node(F, id);
      f->step_of[id] = s;
      if (fuse_is_out(F, gi, id)) {
        push_unique(a, &st->outs, &st->nouts, id);
        f->materialised[id] = true;
        st->bytes_written += dtype_size(n->dtype) * (double)numel(F, id) * (n->op == OP_ADAMW ? 1 + opt_nstate(n) : 1);
      }
      for (int k = 0; k < n->nin; k++) {
        int x = n->in[k];
        if (F->grp[x] == gi || op_of(F, x) == OP_CONST)
          continue;
        int before = st->nins;
        push_unique(a, &st->ins, &st->nins, x);
        // A view of a member is the member's value, which the kernel computes: a CAST of rule 9
        // rounds it, a reduction of rule 10 sums it; neither reads it back from memory.
        bool own = F->grp[view_base(F, x)] == gi &&
                   (n->op == OP_CAST || G->kind == STEP_KERNEL || fuse_is_reduction(n->op));
        // An embedding reads the rows its ids pick, at most one per output row, not the whole table.
        double count = (double)numel(F, x);
        if ((n->op == OP_EMBED || n->op == OP_GATHER) && k == 0 && (double)numel(F, id) < count)
          count = (double)numel(F, id);
        if (st->nins > before && !own)
          st->bytes_read += dtype_size(node(F, x)->dtype) * count;
      }
      st->flops += node_flops(F, id);
    }
    unmaterialised_traffic(F, gi, st);
    st->name = step_name(F, s, st);
  }
  if (!copies_written(F, f))
    return NULL;
  // One reason per producer and consuming step; the optimizer reads the gradient buffer by design.
  // (`told` holds the pairs of a producer and a step that have one, as fuse_pair_slot's table.)
  int64_t pairs = F->nrej;
  for (int c = 0; c < g->n; c++)
    pairs += node(F, c)->nin;
  int mask = 1;
  while (mask < 2 * pairs)
    mask *= 2;
  int *told = arena_alloc(a, sizeof(int) * (size_t)mask--), *told_p = arena_alloc(a, sizeof(int) * (size_t)(mask + 1));
  memset(told, -1, sizeof(int) * (size_t)(mask + 1));
  Told ctx = {told_p, arena_alloc(a, sizeof(int) * (size_t)(mask + 1)), 0};
  for (int i = 0; i < F->nrej; i++)
    tell(&ctx, told, mask, view_base(F, F->rej[i].a), f->step_of[F->rej[i].b]);
  for (int c = 0; c < g->n; c++) {
    int sc = f->step_of[c];
    if (sc < 0 || f->steps[sc].kind == STEP_OPTIMIZER)
      continue;
    IrNode *n = node(F, c);
    for (int k = 0; k < n->nin; k++) {
      int p = view_base(F, n->in[k]);
      if (f->step_of[p] < 0 || f->step_of[p] == sc)
        continue;
      if (tell(&ctx, told, mask, p, sc))
        fuse_reject(F, p, c, "%s", generic_reason(F, f, p, c));
    }
  }
  // A pair turned down by one rule may share a step after a later one (rule 9).
  int kept = 0;
  for (int i = 0; i < F->nrej; i++) {
    int sa = f->step_of[F->rej[i].a], sb = f->step_of[F->rej[i].b];
    if (sa < 0 || sa != sb)
      F->rej[kept++] = F->rej[i];
  }
  F->nrej = kept;
  f->rejected = F->rej;
  f->nrejected = F->nrej;
  return f;
}

static void build_users(Fuser *F) {
  Graph *g = F->g;
  F->users = arena_alloc(F->a, sizeof(int *) * (size_t)g->n);
  F->nusers = arena_alloc(F->a, sizeof(int) * (size_t)g->n);
  int *cap = arena_alloc(F->a, sizeof(int) * (size_t)g->n);
  for (int i = 0; i < g->n; i++) {
    IrNode *n = node(F, i);
    for (int k = 0; k < n->nin; k++) {
      bool dup = false;
      for (int j = 0; j < k; j++)
        dup |= n->in[j] == n->in[k];
      if (!dup)
        cap[n->in[k]]++;
    }
  }
  for (int i = 0; i < g->n; i++)
    F->users[i] = arena_alloc(F->a, sizeof(int) * (size_t)(cap[i] ? cap[i] : 1));
  for (int i = 0; i < g->n; i++) {
    IrNode *n = node(F, i);
    for (int k = 0; k < n->nin; k++) {
      int x = n->in[k];
      if (!F->nusers[x] || F->users[x][F->nusers[x] - 1] != i)
        F->users[x][F->nusers[x]++] = i;
    }
  }
}

Fusion *fuse(Graph *g, FuseOptions opt) {
  Arena *a = g->arena;
  Fuser *F = arena_alloc(a, sizeof *F);
  F->g = g;
  F->a = a;
  F->opt = opt;
  F->max_group = opt.max_group > 0 ? opt.max_group : DEFAULT_MAX_GROUP;
  size_t n = (size_t)(g->n ? g->n : 1);
  F->grp = arena_alloc(a, sizeof(int) * n);
  for (int i = 0; i < g->n; i++)
    F->grp[i] = -1;
  F->view = arena_alloc(a, sizeof(bool) * n);
  F->pinned = arena_alloc(a, sizeof(bool) * n);
  F->seen = arena_alloc(a, sizeof(int) * n);
  F->gseen = arena_alloc(a, sizeof(int) * n);
  F->queue = arena_alloc(a, sizeof(int) * n);
  F->extra = arena_alloc(a, sizeof(bool) * n);
  F->cand = arena_alloc(a, sizeof(bool) * n);
  F->bcast = arena_alloc(a, sizeof(bool) * n);
  F->reach = arena_alloc(a, sizeof(int) * n);
  memset(F->reach, -1, sizeof(int) * n);
  F->copy_of = arena_alloc(a, sizeof(int) * n);
  for (int i = 0; i < g->n; i++)
    F->copy_of[i] = -1;
  build_users(F);
  if (opt.fuse) {
    rule_optimizer(F);
    if (opt.chunk_lmhead)
      rule_lmhead(F);
    rule_siblings(F);
    rule_gemm(F);
    rule_rowwise(F);
    rule_singles(F);
    rule_reductions(F);
    rule_elementwise(F);
    rule_casts(F);
    rule_reduction_producers(F);
    rule_copies(F);
  } else {
    for (int i = 0; i < g->n; i++)
      if (!fuse_is_leaf(op_of(F, i)))
        fuse_new_group(F, fuse_kind_of(op_of(F, i)), i);
  }
  fuse_resolve_views(F);
  return fuse_assemble(F);
}

bool fuse_is_copy(const Fusion *f, int node) { return copy_in(f->g, f->copy_of, node); }

void fuse_dump(const Fusion *f, FILE *out) {
  const Graph *g = f->g;
  double flops = 0, rd = 0, wr = 0;
  for (int s = 0; s < f->nsteps; s++) {
    flops += f->steps[s].flops;
    rd += f->steps[s].bytes_read;
    wr += f->steps[s].bytes_written;
  }
  fprintf(out, "fusion of %s (%s): %d steps, %.3f GFLOP, %.2f MB read, %.2f MB written\n",
          g->model ? g->model : "?", f->opt.fuse ? "fused" : "unfused", f->nsteps, flops / 1e9, rd / 1e6,
          wr / 1e6);
  for (int s = 0; s < f->nsteps; s++) {
    const Step *st = &f->steps[s];
    char buf[128];
    fprintf(out, "%-44s %-9s %-14s", st->name, step_kind_name(st->kind),
            shape_str(g->nodes[st->root]->shape, buf, sizeof buf));
    for (int i = 0; i < st->nnodes; i++) {
      const IrNode *n = g->nodes[st->nodes[i]];
      fprintf(out, " %%%d %s@%d", n->id, op_name(n->op), n->loc.line);
    }
    fprintf(out, "  -> out");
    for (int i = 0; i < st->nouts; i++)
      fprintf(out, " %%%d", st->outs[i]);
    fprintf(out, "\n");
  }
  if (f->ncopies) {
    fprintf(out, "copies (bf16, written by the optimizer):");
    for (int i = 0; i < g->n; i++)
      if (g->nodes[i]->op == OP_PARAM && f->copy_of[i] >= 0)
        fprintf(out, " %%%d %s", f->copy_of[i], g->nodes[i]->name);
    fprintf(out, "\n");
  }
  for (int i = 0; i < f->nrejected; i++) {
    const IrNode *a = g->nodes[f->rejected[i].a], *b = g->nodes[f->rejected[i].b];
    fprintf(out, "not fused: %s@%d with %s@%d: %s (%%%d -> %%%d)\n", op_name(a->op), a->loc.line, op_name(b->op),
            b->loc.line, f->rejected[i].reason, a->id, b->id);
  }
}
