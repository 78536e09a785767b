// emit_common.h: what the C and CUDA emitters share (emit_common.c), names prefixed ec_. See
// emit_common.c for the design.
//
// The emitters, file by file, each calling only the files above it in this list:
//   emit_common.c       what does not depend on the target: where values are, groups and their order,
//                       lines and scopes, the index maps of the inline evaluator
//   emit_walk.c         the walker, written once: steps and their passes, groups handed to the target's
//                       kernels, the inline evaluator's walk, elementwise loops' grouping, and what the
//                       kernel families of every target share (reductions, GEMM shapes, the
//                       optimizer's tables); it calls a target only through its hooks (emit_walk.h:
//                       EmitTarget)
//   emit_c_kit.c        the C target's toolkit: pointers, its evaluator hooks, elementwise and row loops
//   emit_c_rows.c       its row and reduction loops: sums, norms, softmax, embed, rope, masks
//   emit_c_lmhead.c     its cross-entropy and LM head
//   emit_c_attn.c       its attention, forward and backward
//   emit_c_opt.c        its optimizer
//   emit_c.c            the C emitter (C11 + OpenMP), emit_c.h: its EmitTarget, GEMMs, the module and its
//                       steps
//   emit_c_impl.h       what the emit_c*.c files share (names prefixed c_)
//   emit_cuda_kit.c     the CUDA target's toolkit: kernels and their buffers, its evaluator hooks,
//                       elementwise kernels, row shapes
//   emit_cuda_rows.c    its row and reduction kernels: sums, norms, softmax, embed, rope, masks
//   emit_cuda_lmhead.c  its cross-entropy and LM head (the rows: cuda_ce.cuh's mdl_ce_row)
//   emit_cuda_attn.c    its attention, forward and backward (on tensor cores: cuda_attention.cuh's mdl_att_fwd,
//                       mdl_att_dq, mdl_att_dkv)
//   emit_cuda_opt.c     its optimizer (cuda_opt.cuh's mdl_opt_sumsq, mdl_opt_norm, mdl_opt_update)
//   emit_cuda.c         the CUDA emitter, emit_cuda.h: its EmitTarget, GEMMs and epilogues, the module,
//                       its steps and their launch plan (CudaPlan)
//   emit_cuda_impl.h    what the emit_cuda*.c files share (names prefixed cu_)
// and the preludes every emitted module starts with, in runtime/kernels/: prelude.h and prelude_bf16.h
// (C), the cuda_*.cuh pieces (CUDA). The kernel families that are fixed code with parameters are
// templates there (cuda_attention.cuh, cuda_ce.cuh, cuda_opt.cuh), which the emitters
// instantiate with the shapes they choose: the emitter says what to launch, the prelude holds how.
#ifndef EMIT_COMMON_H
#define EMIT_COMMON_H

#include "mdl.h"

#include <stdarg.h>

//
// Text buffers and memory.
//

typedef struct {
  char *s;
  size_t len, cap;
} Buf;

void ec_bput(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ec_bvput(Buf *b, const char *fmt, va_list ap);
void ec_bappend(Buf *b, const Buf *x);
void *ec_xcalloc(size_t n, size_t size); // exits when out of memory
void ec_grow(void *p, int n, int *cap, size_t size); // grows *p (*cap elements of size bytes) to hold n + 1

//
// The preludes every emitted module starts with, as the text of their files (NUL-terminated),
// embedded by tools/embed.c into build/preludes.c, each the concatenation of its pieces in
// runtime/kernels/ (the Makefile's PRELUDES): ec_prelude_c the C module's libc headers, the module
// ABI (abi.h, which the runtime includes too) and prelude.h; ec_prelude_c_bf16 prelude_bf16.h (after
// it in graphs that hold bf16 values); ec_prelude_fp8 and ec_prelude_c_fp8 fp8_bits.h (the
// conversions, also the CUDA prelude's and the interpreter's) and prelude_c_fp8.h (in graphs that
// hold fp8 values); ec_prelude_cuda the CUDA one, cuda_*.cuh by kernel family, cuda_args.h (the
// kernels' arguments, which emit_cuda.h includes too) and fp8_bits.h.
//

extern const char ec_prelude_c[], ec_prelude_c_bf16[], ec_prelude_fp8[], ec_prelude_c_fp8[], ec_prelude_cuda[];

//
// The state both emitters keep about the step being emitted.
//

// G_NORM_BWD: the LAYERNORM_BWD / RMSNORM_BWD siblings and up to EC_MAX_COLSUMS SUMs over the rows of
// values their row loop computes (rule 10 of fuse.c). G_ATTN: an ATTENTION, its ATTENTION_LSE, or both
// (rule 3).
typedef enum { G_SINGLE, G_NORM_BWD, G_ATTN, G_ATTN_BWD, G_CE, G_LMHEAD, G_OPT } GroupKind;
enum { EC_MAX_COLSUMS = 4 };

typedef struct {
  GroupKind kind;
  int *mem;     // member anchors
  int nmem;
  int *ext;     // external inputs (what the group reads)
  int n_ext;
  // G_LMHEAD: the pattern's nodes (ceb, dx, dw, dloss -1 in a graph without a backward)
  int mm, ce, ceb, dx, dw, x, w, tgt, dloss;
  int dlc; // the CAST of dlogits the backward GEMMs read (bf16 operands), or -1 (x and w are CASTs then too)
  int lc;  // the CAST of the logits the loss reads (bf16: rounded, precision.c), or -1
  bool tb;
} Group;

// A value of the inline evaluator: node `node` at flat index `ix` is held in `name`, for the scopes
// up to `depth`.
typedef struct {
  int node;
  const char *ix;   // flat index expression the value is taken at
  const char *name; // the expression holding it
  int depth;
} Memo;

// An index expression held in a variable.
typedef struct {
  const char *expr, *name;
  int depth;
} IxMemo;

// Each emitter embeds EmitCore as the first member (`core`) of its own state, so that its hooks may
// convert the EmitCore pointer they get back to the emitter's state.
typedef struct EmitCore EmitCore;
typedef struct EmitTarget EmitTarget; // the target's hooks (emit_walk.h)
struct EmitCore {
  const EmitTarget *target;
  // the target's part of the inline evaluator
  const char *(*val)(EmitCore *e, int n, const char *ix); // node n's value at flat index ix (emits what computes it)
  const char *(*seed)(EmitCore *e);                       // the run's seed, for a dropout mask
  const char *(*base)(EmitCore *e, int n);                // the pointer to node n's memory (ec_in_memory)
  // a CAST to fp8 of the value x (mdl.h): the rounded scaled value, its amax recorded; NULL where the
  // target has no fp8
  const char *(*fp8_cast)(EmitCore *e, const IrNode *cast, const char *x);
  bool concat_values; // a CONCAT read selects among its parts' values (EmitTarget.concat_values)

  const Fusion *f;
  const MemPlan *m;
  const Graph *g;
  Arena *a;        // strings of one emission
  char err[512];   // the first failure
  bool failed;

  // the step being emitted
  int si;
  bool *in_step;   // computed by this step (leaves excluded)
  int *grp;        // anchor -> its group, else -1
  Group *groups;
  int ngroups;
  bool **gdep;     // gdep[a][b]: group a depends on group b
  int *order;      // groups in emission order
  bool *spill;     // an internal anchor that must be kept whole in memory (sticky across passes)
  bool *post_bad;  // an output that cannot share its anchor's loop (sticky across passes)
  bool flagged;    // this pass set a new sticky flag

  // one pass
  bool *written;   // value in memory (inputs of the step, or written by an earlier phase)
  bool *scratch;   // gets a buffer of the step's own
  bool *stored;    // stored by the current phase
  int *host;       // a GEMM root -> the epilogue output it writes into, or -1
  int *phase_nodes;
  int nphase;
  int *pending;    // nodes to write before the next group
  int npending;
  const bool *emitted; // the groups emitted before the one being emitted

  // the loop being emitted
  const char *loop_ix; // its own flat index (stores happen there)
  int64_t loop_n;      // and the number of elements it visits
  int post_anchor;     // inside the loop that follows (or is) this anchor's, else -1
  const char *post_ix;
  bool post_inloop;    // that loop is the anchor's own loop (its value is a local)
  int cur_q;           // the output being evaluated there

  // the code being built (a function or a kernel)
  Buf body;
  int indent, depth, fresh; // indent, scope depth, the last fresh name's number
  Memo *memo;
  int nmemo, capmemo;
  IxMemo *ixm;
  int nixm, capixm;
  const char *ixt;  // the type of index variables: "int64_t" (or "int" in a small CUDA kernel)
  // A loop over rows of row_w elements whose flat index row_ix is row_r * row_w + c: an index of
  // row_ix modulo row_w is c and its quotient row_r (so a bias read along rows is a contiguous load),
  // or NULL.
  const char *row_ix, *row_r;
  int64_t row_w;
};

bool ec_fail(EmitCore *e, const char *fmt, ...) __attribute__((format(printf, 2, 3))); // returns false

//
// Strings of the emission, lines and scopes of the code being built.
//

const char *ec_str(EmitCore *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ec_line(EmitCore *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ec_enter(EmitCore *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ec_leave(EmitCore *e);
const char *ec_memo_get(EmitCore *e, int n, const char *ix);
void ec_memo_put(EmitCore *e, int n, const char *ix, const char *name);
const char *ec_dlit(EmitCore *e, double v); // a double literal that reads back as v
const char *ec_ilit(EmitCore *e, double v); // an i32 CONST's value as an int literal
const char *ec_flit(EmitCore *e, double v); // a float literal that reads back as (float)v; MDL_INF, MDL_NAN (both preludes) where not finite
// Removes the declarations of evaluator values and indices (v12, v12_i, j3, ...) their scope never reads.
void ec_drop_unused(EmitCore *e);

//
// Nodes and where their values are.
//

const IrNode *ec_node(const EmitCore *e, int n);
int64_t ec_numel(const EmitCore *e, int n);
int64_t ec_last_dim(const EmitCore *e, int n);
const char *ec_ctype(const EmitCore *e, int n); // a value's type in code: "int32_t" or "float" (also for bf16)
const char *ec_mtype(const EmitCore *e, int n); // its element type in memory: "int32_t", "float" or "uint16_t" (bf16)
// An element of n read from memory (`elem`, e.g. "b7[i]") as a value, and a value v as n stores it:
// bf16 goes through mdl_bf16_to_f32 / mdl_f32_to_bf16 (round to nearest even), which both preludes define.
const char *ec_load(EmitCore *e, int n, const char *elem);
const char *ec_store(EmitCore *e, int n, const char *v);
bool ec_is_leaf(Op op);
bool ec_is_pointwise(Op op);
int ec_canon(const EmitCore *e, int n);
int64_t ec_offset(const EmitCore *e, int n);
bool ec_in_memory(const EmitCore *e, int c);
bool ec_has_target(const EmitCore *e, int c);
void ec_flag(EmitCore *e, bool *set, int n); // sets a sticky flag, noting that this pass set one
int ec_mem_alias(EmitCore *e, int n);
// n read in place as rows of a wider tensor (a SLICE of the last axis, a member not written or a
// strided view): the node whose buffer holds the rows, and the slice's first column.
bool ec_row_slice(EmitCore *e, int n, int *src, int64_t *start);
int ec_need(EmitCore *e, int n);

//
// Index maps.
//

const char *ec_buf_str(EmitCore *e, Buf *b); // b's text in the arena (frees b), "0" when empty
int64_t ec_span(Shape s, int from, int to); // product of s.d[from..to)
const char *ec_ix_bcast(EmitCore *e, Shape out, Shape in, const char *ix);
const char *ec_ix_permute(EmitCore *e, const IrNode *nd, Shape in, const char *ix);
const char *ec_ix_slice(EmitCore *e, const IrNode *nd, Shape full, const char *ix);
const char *ec_ix_axis(EmitCore *e, Shape s, int ax, const char *ix);
const char *ec_ix_part(EmitCore *e, Shape s, int ax, const char *ix, const char *c, int64_t at, int64_t len);

// The expression of pointwise node c at flat index ix, its inputs read through e->val.
const char *ec_pointwise_expr(EmitCore *e, int c, const char *ix);
// TOPK's order: a (at index ia) before b (at ib) when it is larger, NaN before every number, ties by
// the lower index (interp.c's topk_before); the operands are evaluated more than once.
const char *ec_topk_before(EmitCore *e, const char *a, const char *ia, const char *b, const char *ib);
bool ec_concat_direct(EmitCore *e, int n);
const char *ec_concat_ptr(EmitCore *e, int n, const char *ix);

//
// Phases, groups, the outputs computed in a group's loop, and the check that a step is complete.
//

void ec_phase_begin(EmitCore *e);
void ec_phase_done(EmitCore *e, int n);
void ec_phase_end(EmitCore *e);
int ec_through_reshapes(EmitCore *e, int n); // follows RESHAPEs (views and reshapes of this step) up
bool ec_groups_order(EmitCore *e);
int ec_norm_members(EmitCore *e, int gi, int *dx, int *dw, int *db, int *sums); // sums: EC_MAX_COLSUMS
int ec_post_set(EmitCore *e, int gi, int64_t n, const bool *emitted, int *q);
int ec_side_set(EmitCore *e, int gi, int64_t n, const bool *emitted, int *q);
void ec_reduce_input(EmitCore *e, int a, const int *side, int nside);
bool ec_reduction_after(EmitCore *e, int gi, const bool *emitted, int64_t n);
// The members of a G_ATTN group: its ATTENTION (*a) and its ATTENTION_LSE (*lse), -1 where absent.
void ec_attention_members(const EmitCore *e, int gi, int *a, int *lse);
int ec_output_casts(EmitCore *e, int a, int *casts, int max, bool *f32);
int ec_unwritten(EmitCore *e, int *rest);
void ec_check_written(EmitCore *e);
const char *ec_kind_name(StepKind k); // "kernel", "GEMM", ...

#endif
