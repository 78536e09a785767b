// emit_walk.h: the emitters' walker (emit_walk.c), written once for every target, and the table of
// hooks (EmitTarget) through which it calls the target it emits for. Names are prefixed ew_.
//
// The walker takes a step plan's steps one by one: the passes that settle where a step's values live,
// its groups in order, each handed to the target's kernel for its kind (EmitTarget.kernel), the
// elementwise loops for what is left, and the inline evaluator's walk over pointwise nodes (ew_val),
// which asks the target only how to name, load and store a value. A target fills one EmitTarget
// (emit_c.c, emit_cuda.c), as QBE's Target or tinygrad's renderers do: no code here asks which
// target it serves.
#ifndef EMIT_WALK_H
#define EMIT_WALK_H

#include "emit_common.h"

// The kernels a target provides: one per kind of group (ew_kernel_of says which a group is).
typedef enum {
  EK_GEMM, EK_REDUCE, EK_NORM_FWD, EK_NORM_BWD, EK_SOFTMAX, EK_EMBED, EK_EMBED_BWD, EK_ROPE, EK_MAX_BWD,
  EK_TOPK, EK_GATHER, EK_SCATTER, EK_ATTN_MASK, EK_ATTENTION, EK_ATTENTION_BWD, EK_CE, EK_LMHEAD,
  EK_OPTIMIZER, EK_COUNT // EK_COUNT: no kernel
} EmitKernel;

// Every hook gets the target's state as its EmitCore (its first member, core).
struct EmitTarget {
  bool narrow_ix; // index variables are int where a step's tensors allow it (e->ixt), else int64_t
  // A CONCAT of parts in memory read element by element selects among its parts' values (a load from
  // each, which a CPU's compiler turns into masked vector loads), not among pointers to them (one
  // load through the selected pointer: what a GPU thread wants, and a scalar load on a CPU).
  bool concat_values;

  // The evaluator's (EmitCore.seed, base, fp8_cast).
  const char *(*seed)(EmitCore *e);
  const char *(*base)(EmitCore *e, int n);
  const char *(*fp8_cast)(EmitCore *e, const IrNode *cast, const char *x);
  // The name of a new local holding node c's value at ix.
  const char *(*local)(EmitCore *e, int c, const char *ix);
  // c's value at ix as one lane of a vector that the lanes of a loop body load together, or NULL
  // (then ew_val loads or computes it on its own); NULL where the target has no such bodies.
  const char *(*lanes)(EmitCore *e, int c, const char *ix);
  // Stores value v of node c at ix.
  void (*store)(EmitCore *e, int c, const char *ix, const char *v);

  // One elementwise loop over n elements writing nodes[0..k), all of that size; post_anchor names the
  // GEMM whose epilogue it is, or -1; role says what it is for ("prep", "rest", "epilogue", or "").
  void (*pw_loop)(EmitCore *e, const int *nodes, int k, int64_t n, int post_anchor, const char *role);
  // Resets the target's own state at the start of a pass over a step.
  void (*pass_reset)(EmitCore *e);
  // The kernels, by kind (e->emitted: the groups emitted before this one).
  void (*kernel[EK_COUNT])(EmitCore *e, int gi);
};

//
// emit_walk.c
//

// The emission's state: f and m, t's hooks, the per-node arrays (freed by ew_close), an arena.
void ew_open(EmitCore *e, const EmitTarget *t, const Fusion *f, const MemPlan *m);
void ew_close(EmitCore *e);
// A C identifier from a step name, unique among names[0..si).
const char *ew_kernel_name(EmitCore *e, const char *name, int si, const char **names);
// Emits step si into the target's state: passes until the layout of its values settles, the last
// pass's text kept. False when a step cannot be emitted (e->err says why).
bool ew_step(EmitCore *e, int si);
// The comment above the current step's code (e->si, named name): its ops, one a line.
void ew_step_head(EmitCore *e, Buf *b, const char *name);
EmitKernel ew_kernel_of(EmitCore *e, int gi);

// The value of node n at flat index ix, as an expression; emits what computes it. A step output met
// at the current loop's own index is stored on the way.
const char *ew_val(EmitCore *e, int n, const char *ix);
// The body of an elementwise loop at index ix: nodes[0..k) computed and stored.
void ew_pw_values(EmitCore *e, const int *nodes, int k, const char *ix);
// Elementwise loops for a list of nodes, one per distinct size, in order of first appearance.
void ew_pw_loops(EmitCore *e, const int *nodes, int k, int post_anchor, const char *role);
// The loops of the values a group needs in memory first (e->pending).
void ew_flush(EmitCore *e);
// Evaluates the post outputs q[0..nq) inside the anchor's own loop, where the anchor's value at
// index ix (of n) is the expression y.
void ew_post_inloop(EmitCore *e, int anchor, const int *q, int nq, const char *ix, int64_t n, const char *y);
// The output buffer of a row-wise or reducing anchor: whole (arena slot or scratch) when it is an
// output or read at other indices; otherwise only a local (or a row) exists.
bool ew_whole(EmitCore *e, int a);

// Opens the phase of a group whose outputs outs[0..n) (-1: none) are written whole (each its arena
// slot, or scratch of the step), after the values the group reads from memory (ew_flush); closes it,
// the outputs written.
void ew_outputs_open(EmitCore *e, const int *outs, int n);
void ew_outputs_done(EmitCore *e, const int *outs, int n);
// ew_outputs_open of one anchor.
void ew_anchor_open(EmitCore *e, int a);

// A MATMUL (group gi's anchor mm) as [batches] of [m x k] x [k x n] (ta, tb: the operands transposed).
typedef struct {
  int mm;
  const IrNode *nd;
  Shape sa, sb, so; // the operands', the output's
  bool ta, tb;
  int64_t m, n, k, batches;
} EwGemm;

void ew_gemm_shape(EmitCore *e, int gi, EwGemm *g);
// Where GEMM mm writes when it has no arena slot: into the first f32 output of its epilogue q[0..nq)
// that has one (e->host; the product is f32), else into scratch.
void ew_gemm_place(EmitCore *e, int mm, const int *q, int nq);

// The optimizer (G_OPT): opens group gi's phase, its inputs in memory first (the gradients of its
// norm, and what each update reads but a norm this group computes).
void ew_opt_open(EmitCore *e, int gi);
// The updates of group gi from member i on (not done[]) that share member i's rule, hyperparameters
// and scalars, which run over one table: into seg[] and marked done; their values in *total.
int ew_opt_segments(EmitCore *e, int gi, int i, bool *done, int *seg, int64_t *total);
// Update a's hyperparameters, for a comment ("beta1 0.9, beta2 0.95, eps 1e-08").
const char *ew_opt_hyper(EmitCore *e, const IrNode *a);

// A SUM / MEAN / MAX over one axis, or a TARGET_COUNT (over every target), as [outer, len, inner].
typedef struct {
  int a, x;              // the anchor, its input
  const IrNode *nd;
  int64_t outer, len, inner, on; // on = outer * inner outputs
  bool max, buf;         // a MAX; the output is whole in memory (ew_whole)
  int *q, nq;            // the outputs computed after it in its loop (ec_post_set)
  int *side, nside;      // and in its input's loop (ec_side_set)
  const char *acc_t;     // the accumulator's type
} EwReduce;

// The reduction of group gi; opens its phase. ew_reduce_close frees it.
void ew_reduce_open(EmitCore *e, int gi, EwReduce *r);
// Output r of the reduction from its accumulator acc: stored, then the outputs computed after it.
void ew_reduce_finish(EmitCore *e, const EwReduce *r);
void ew_reduce_close(EwReduce *r);

#endif
