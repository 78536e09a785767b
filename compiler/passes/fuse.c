// fuse.c: the fusion pass. It groups the nodes of a training graph (forward, backward, GRAD_NORM,
// ADAMW) into steps, the unit the emitters turn into one kernel or one library call each.
// This file holds the rules (the decisions: which nodes go together) and the pass itself (fuse);
// fuse_groups.c what may fuse (the ops' classes, the checks a node passes to join a group, the
// reasons for a refusal), fuse_plan.c the step plan built from the groups.
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
#include "fuse_impl.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

enum { DEFAULT_MAX_GROUP = 64 };

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
