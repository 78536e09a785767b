// mdl.h: the one shared header of the mdl compiler. Each section lists the public types and
// functions of one file; read it as the table of contents of compiler/.
#ifndef MDL_H
#define MDL_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define MDL_VERSION "0.1.0"

//
// arena.c: one arena per compilation; allocate and never free.
//
typedef struct Arena Arena;
Arena *arena_new(void);
void arena_free(Arena *a);
void *arena_alloc(Arena *a, size_t size); // zeroed
char *arena_strdup(Arena *a, const char *s);
char *arena_printf(Arena *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Checked allocations for the whole program. Where memory is gone: "mdlc: error: out of memory
// allocating WHAT (N bytes)", stdio flushed, and status 1 without exit's handlers (oom_exit).
_Noreturn void oom_exit(const char *what, size_t bytes);
void *xmalloc(size_t n, const char *what);
void *xcalloc(size_t n, size_t size, const char *what); // zeroed
void *xrealloc(void *p, size_t n, const char *what);
char *xstrdup(const char *s, const char *what);
char *xstrndup(const char *s, size_t n, const char *what); // at most n bytes of s

//
// diag.c: error reporting with file:line:col, the source line and a caret.
//
typedef struct {
  const char *file;  // path as the user gave it
  const char *text;  // whole source text (NUL terminated)
  int line, col;     // 1-based; line 0 means "no location"
} SrcLoc;

extern int diag_errors; // errors reported so far
// A compilation prints at most DIAG_MAX_ERRORS errors; the next one prints "too many errors" at its
// place instead, and from then on diag_stopped() is true so the front end can stop early.
enum { DIAG_MAX_ERRORS = 20 };
void diag_error(SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void diag_note(SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 2, 3))); // after a printed error only
void diag_warning(SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 2, 3))); // counts as no error
void diag_begin(void);   // a new compilation: its errors count toward the limit from zero
bool diag_stopped(void); // more than DIAG_MAX_ERRORS errors since diag_begin()
// An error about a file or a path rather than a place in the .mdl text: "path: reason".
void diag_file_error(const char *path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

//
// readfile.c: files opened to be read: regular files only, their size known before a byte is read.
//
// Opens path with flags (O_RDONLY, O_RDWR) without blocking; fails, with the reason in why, where
// it cannot, or where path is not a regular file (a FIFO, a device such as /dev/zero, a folder, a
// socket: "not a regular file (a FIFO)"). Returns the descriptor, and in *size the file's size,
// all a reader may take of it; else -1, with errno open's (EINVAL for a file that is not regular).
int file_open(const char *path, int flags, int64_t *size, char *why, size_t n);
// The same opened as a stdio stream in mode ("r", "r+"); NULL with the reason in why.
FILE *file_fopen(const char *path, const char *mode, int64_t *size, char *why, size_t n);
// The whole of a regular file, malloc'd with a NUL after its *n bytes; NULL with the reason in why,
// also where limit is not 0 and the file is larger.
char *file_read(const char *path, size_t *n, size_t limit, char *why, size_t wn);

//
// Counter-based random numbers shared by every back end, so that dropout masks and
// initialisation agree bit for bit: splitmix64 of (seed, stream, index).
static inline uint64_t mdl_rng_u64(uint64_t seed, uint64_t stream, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull + i * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// Uniform in [0, 1) with 24 random bits.
static inline double mdl_rng_uniform(uint64_t seed, uint64_t stream, uint64_t i) {
  return (double)(mdl_rng_u64(seed, stream, i) >> 40) / 16777216.0;
}

//
// ir.c: the graph IR. A DAG of typed tensor ops; node ids index Graph.nodes and every input id
// is smaller than the node's own id, so the node array is already in topological order.
//
#define IR_MAX_RANK 6
// A node's integer and float attribute slots (IrNode.ia, .fa). ir_add copies whole arrays of these
// sizes, so a caller passes arrays of this length with the slots its op does not read zeroed.
#define IR_NIA 8
#define IR_NFA 6
// The most elements one tensor may have: 2^36 (256 GiB in f32, more than any one device holds).
// ir_add and ir_leaf refuse a larger shape, and the front end bounds the forward graph's nodes
// (MDL_MAX_NODES, 2^18), so every later sum or product of sizes stays far inside int64_t: bytes
// (2^39 a tensor at 8 bytes an element), arena offsets (a few times 2^18 nodes after autodiff, of
// 2^39 bytes each: under 2^62); FLOPs are counted in double.
#define IR_MAX_NUMEL ((int64_t)1 << 36)

// DT_F8E4M3 and DT_F8E5M2 are the two OCP fp8 formats (largest 448 and 57344); an fp8 value is a
// scaled one (a CAST to fp8 multiplies by its tensor's scale first) and is read only by a MATMUL.
typedef enum { DT_F32, DT_I32, DT_BF16, DT_F8E4M3, DT_F64, DT_F8E5M2 } DType;

typedef struct {
  int rank;
  int64_t d[IR_MAX_RANK];
} Shape;

// Every op, its inputs and the attributes it reads (ia = integer attrs, fa = float attrs).
// "which" selects one output of a multi-output backward computation: each IR node has exactly one
// output, and the fusion pass later merges the siblings back into one kernel.
#define IR_OPS(X)                                                                                  \
  /* leaves */                                                                                     \
  X(INPUT, "input")         /* name; data from the batch */                                       \
  X(PARAM, "param")         /* name; trainable, fp32 master weights */                            \
  X(STATE, "state")         /* name; optimizer state (AdamW moments), same shape as its param */  \
  X(SCALAR, "scalar")       /* name; a per-step fp32 scalar from the runtime: "lr", "step" */     \
  X(CONST, "const")         /* fa[0] = value; shape [] (broadcasts) */                            \
  /* elementwise unary */                                                                          \
  X(NEG, "neg")                                                                                    \
  X(EXP, "exp")                                                                                    \
  X(LOG, "log")                                                                                    \
  X(TANH, "tanh")                                                                                  \
  X(SQRT, "sqrt")                                                                                  \
  X(RSQRT, "rsqrt")                                                                                \
  X(RELU, "relu")                                                                                  \
  X(GELU, "gelu")           /* tanh approximation, as GPT-2 */                                    \
  X(SILU, "silu")                                                                                  \
  X(SIGMOID, "sigmoid")                                                                            \
  X(ABS, "abs")                                                                                    \
  X(CLAMP, "clamp")         /* fa[0] = lo, fa[1] = hi (either may be infinite) */                 \
  X(STOP_GRADIENT, "stop_gradient") /* x itself; no gradient flows back through it */             \
  X(DROPOUT, "dropout")     /* fa[0] = p; ia[0] = seed id (same id, same mask) */                 \
  X(CAST, "cast")           /* ia[0] = the DType to round to (bf16: nearest, ties to even);       \
                               f32 <-> i32: to i32 toward zero, saturating, NaN -> 0 (interp_to_i32); \
                               f32 -> fp8 (E4M3, E5M2): a scaled tensor, ia[1] its index in          \
                               Graph.fp8: q = fp8(x * scale) (nearest even, saturating, NaN -> NaN),  \
                               scale the tensor's power of two for this step (fp8_scale); the kernel  \
                               that computes it also records max |x| over the step (the amax; NaN    \
                               when an x is NaN) for the tensor's history. A tensor read by several   \
                               GEMMs is cast once, and a recomputed CAST records the same amax */     \
  /* elementwise binary, numpy broadcasting */                                                     \
  X(ADD, "add")                                                                                    \
  X(SUB, "sub")                                                                                    \
  X(MUL, "mul")                                                                                    \
  X(DIV, "div")                                                                                    \
  X(COMPARE, "compare")     /* 1 where a OP b holds, else 0; ia[0]: CMP_LT, LE, GT, GE, EQ, NE */ \
  X(WHERE, "where")         /* (cond, a, b): a where cond != 0, else b; numpy broadcasting */     \
  /* the smaller / larger of a and b, NaN where either is NaN; at a tie the gradient is shared      \
     evenly (autodiff.c), as the MAX reduction's and PyTorch's minimum / maximum */                \
  X(MINIMUM, "minimum")                                                                            \
  X(MAXIMUM, "maximum")                                                                            \
  /* i32 only: a // b rounded down and a % b with the sign of b (a == b * (a // b) + a % b), as     \
     Python and numpy; 0 where b == 0 (numpy's result) */                                          \
  X(FLOORDIV, "floordiv")                                                                          \
  X(MOD, "mod")                                                                                    \
  /* elementwise backward helpers: (x, dy) -> dx */                                                \
  X(RELU_BWD, "relu_bwd")                                                                          \
  X(GELU_BWD, "gelu_bwd")                                                                          \
  X(SILU_BWD, "silu_bwd")                                                                          \
  X(ABS_BWD, "abs_bwd")     /* sign(x) dy, 0 at x = 0 */                                          \
  X(CLAMP_BWD, "clamp_bwd") /* dy where lo <= x <= hi, else 0; fa as CLAMP's */                   \
  /* reductions: ia[0] = axis (>= 0), ia[1] = keepdim */                                           \
  X(SUM, "sum")                                                                                    \
  X(MEAN, "mean")                                                                                  \
  X(MAX, "max")                                                                                    \
  X(MAX_BWD, "max_bwd")     /* (x, y, dy) -> dx; ia as MAX; ties share the gradient evenly */     \
  /* layout */                                                                                     \
  X(RESHAPE, "reshape")     /* shape is the node's shape */                                       \
  X(PERMUTE, "permute")     /* ia[0..rank) = source axis of each output axis */                   \
  X(BROADCAST, "broadcast") /* expand size-1 / missing leading axes to the node's shape */        \
  X(SLICE, "slice")         /* ia[0] = axis, ia[1] = start, ia[2] = end */                        \
  X(SLICE_BWD, "slice_bwd") /* (dy) -> zeros of node shape with dy at [start,end) on axis */      \
  X(CONCAT, "concat")       /* ia[0] = axis; any number of inputs */                              \
  /* linear algebra: (a, b) -> a @ b over the last two axes, leading axes broadcast */             \
  X(MATMUL, "matmul")       /* ia[0] = transpose a, ia[1] = transpose b; operands f32, or both   \
                               bf16 (a product of bf16 values is exact in f32): the result is f32;   \
                               or both fp8 (E4M3 or E5M2 each, CASTs to fp8 or views of them): the   \
                               products of the codes' values (exact in f32) summed in f32, times     \
                               1 / (scale_a scale_b) (exact: powers of two), so the result is the    \
                               GEMM of the dequantised operands; ia[2], ia[3] = the fp8 tensors      \
                               (Graph.fp8) of a and b (read only then) */                            \
  /* embedding: (table [V,C], ids i32[...]) -> [..., C] */                                         \
  X(EMBED, "embed")                                                                                \
  X(EMBED_BWD, "embed_bwd") /* (ids, dy) -> d table [V,C] (scatter-add); shape gives V */         \
  /* routing (mixture of experts); ia[0] = axis (>= 0). An index outside [0, len) of its axis       \
     reads 0 (GATHER) and adds nothing (SCATTER_ADD, GATHER_BWD): kernels cannot raise mid-step.     \
     idx has the rank of the positions it lists (GATHER's output, GATHER_BWD's dy, SCATTER_ADD's    \
     src) and broadcasts to their shape (an axis of size 1: one index for the whole axis). */      \
  /* (x) -> i32: the indices of the ia[1] largest along the axis, largest first; ties (and NaNs,      \
     which count as larger than every number) by the lower index; no gradient */                   \
  X(TOPK, "topk")                                                                                  \
  /* (x, idx i32) -> y[.., j, ..] = x[.., idx[.., j, ..], ..]: idx's size on the axis, x's elsewhere */ \
  X(GATHER, "gather")                                                                              \
  /* (idx, dy) -> zeros of dy's shape with ia[1] on the axis, dy scatter-added at idx (GATHER's      \
     backward); every sum in increasing order of the position along the axis */                    \
  X(GATHER_BWD, "gather_bwd")                                                                      \
  /* (base, idx, src) -> base with src scatter-added at idx along the axis; order as GATHER_BWD */  \
  X(SCATTER_ADD, "scatter_add")                                                                    \
  /* row-wise (over the last axis) */                                                              \
  X(LAYERNORM, "layernorm") /* (x, w, b); fa[0] = eps */                                          \
  X(LAYERNORM_BWD, "layernorm_bwd") /* (x, w, dy); fa[0] = eps; ia[0] which: 0 dx, 1 dw, 2 db */  \
  X(RMSNORM, "rmsnorm")     /* (x, w); fa[0] = eps */                                             \
  X(RMSNORM_BWD, "rmsnorm_bwd") /* (x, w, dy); fa[0] = eps; ia[0] which: 0 dx, 1 dw */            \
  X(SOFTMAX, "softmax")     /* over the last axis */                                              \
  X(SOFTMAX_BWD, "softmax_bwd") /* (y, dy) -> dx */                                               \
  X(CROSS_ENTROPY, "cross_entropy") /* (logits [...,V], targets i32[...]) -> f32[...] */          \
  X(CROSS_ENTROPY_BWD, "cross_entropy_bwd") /* (logits, targets, dloss) -> dlogits */             \
  /* (targets i32[...]) -> f32 []: how many targets are counted (>= 0), at least 1; the divisor of  \
     mean(cross_entropy(...)), so that the mean is over the counted targets (sema_builtins.c) */   \
  X(TARGET_COUNT, "target_count")                                                                  \
  /* attention: q [B,T,H*D], k, v [B,S,KH*D]; optional doc i32[B,T]; ia[0] = heads H, ia[1] =    \
     causal, ia[2] = has doc input; fa[0] = scale; ia[5] = kv_heads KH (0: H; H % KH == 0, query   \
     head h reads kv head h / (H/KH)); ia[6] = window W (0: none; causal only: key j is seen by    \
     row i when i - W < j <= i). S != T only without causal and doc (att_kv_heads, att_keys).      \
     Attention within a document only when doc is given.                                           \
     ia[4] = DT_BF16 (set by the precision pass): S = scale * bf(q) bf(k)^T summed in f32,         \
     e = exp(S - rowmax), out = sum_j bf(e_j) bf(v_j) / sum_j e_j (bf = round to bf16); the        \
     backward is softmax's with its products on bf16 operands: dP = bf(dout) bf(v)^T,             \
     P = exp(S - lse) (exact; lse from ATTENTION_LSE), D = bf(dout) . bf(out) per row (the        \
     forward's output: sum_j P dP up to the rounding of out), dS = P (dP - D), dq = scale bf(dS)   \
     bf(k), dk = scale bf(dS)^T bf(q), dv = bf(P)^T bf(dout). ia[4] = DT_F32: no rounding. */      \
  X(ATTENTION, "attention")                                                                        \
  /* (q, k, v, [doc]) -> f32 [B, heads, T]: lse_i = log sum_j exp(S_ij) over the keys row i may   \
     see, S as in the forward; attributes as ATTENTION's. The backward's softmax statistics: the  \
     fusion pass gives it to the forward's step, which has them at hand. */                        \
  X(ATTENTION_LSE, "attention_lse")                                                                \
  /* (q, k, v, [doc,] out, lse, dout); ia[3] which: 0 dq, 1 dk, 2 dv; a bf16 one may read q, k, v, \
     out and dout as bf16 values (the precision pass's CASTs of them), as a bf16 forward and its   \
     ATTENTION_LSE may read q, k and v */                                                          \
  X(ATTENTION_BWD, "attention_bwd")                                                                \
  /* ([doc i32[B,T]]) -> f32 [B,1,T,T] (with doc) or [1,1,T,T] (the constructor's shape): 0 where   \
     query i may see key j, -inf where not; ia[0] = causal (j <= i), ia[1] = has doc (the same doc  \
     id), ia[2] = window (0: none; else also i - j < window), ATTENTION's rule. The mask of attention lowered into MATMUL, SOFTMAX and layout ops        \
     (LowerOptions.plain_attention), added to the scores; it takes no gradient. */                  \
  X(ATTENTION_MASK, "attention_mask")                                                              \
  /* rotary embedding, half-split pairs (i, i + D/2) per head: (x [B,T,C], pos i32[B,T]);         \
     ia[0] = heads, ia[1] = inverse (rotate by -angle: the backward); fa[0] = base */              \
  X(ROPE, "rope")                                                                                  \
  /* optimizer */                                                                                  \
  X(GRAD_NORM, "grad_norm") /* (g0, g1, ...) -> [] global L2 norm */                              \
  /* One parameter's optimizer update, named after its first rule: ia[0] = the rule (OptRule);     \
     (p, g, [m, [v,]] gnorm, lr, step) -> new p, written in place with its moments (opt_nstate of   \
     them: AdamW m and v, SGD with momentum and Lion m, plain SGD none; Muon (p, g, m, u, ...): m   \
     and the orthogonalised update u). fa: 0 beta1 (SGD, Muon: the momentum), 1 beta2 (SGD: 1 for \
     Nesterov), 2 eps, 3 weight decay, 4 clip max norm (0 = no clipping), 5 the                    \
     parameter's multiplier of lr (lr_scale; 0 for 1) */                                           \
  X(ADAMW, "adamw")

// OP_ADAMW's update rule (ia[0]); the formulas are in docs/language.md, the reference in interp.c.
// OPT_MUON updates a hidden matrix from its orthogonalised momentum u, which autodiff.c builds in the
// graph (Newton-Schulz iterations of MATMULs); the optimizer "muon" is AdamW for the other params.
typedef enum { OPT_ADAMW, OPT_SGD, OPT_LION, OPT_MUON } OptRule;

// OP_COMPARE's relation (ia[0]).
typedef enum { CMP_LT, CMP_LE, CMP_GT, CMP_GE, CMP_EQ, CMP_NE } Compare;

typedef enum {
#define X(op, name) OP_##op,
  IR_OPS(X)
#undef X
      OP_COUNT
} Op;

typedef enum { INIT_ZEROS, INIT_ONES, INIT_NORMAL } InitKind;

typedef struct {
  InitKind kind;
  double std;  // INIT_NORMAL
  bool decay;  // weight decay applies (train section's no_decay patterns)
  bool frozen; // never updated, no gradient (train section's freeze patterns)
  bool muon;   // a hidden matrix, updated by Muon when the optimizer is muon (sema_train.c says which)
  double lr_scale; // its multiplier of the schedule's lr (train section's lr_scale); 0 stands for 1
} ParamInit;

// Element i of parameter k (the k-th of Graph.params) initialised from the seed: every back end's
// initial values (the normal draws by Box-Muller from two uniforms of the parameter's stream).
static inline double mdl_param_init(const ParamInit *pi, uint64_t seed, int k, int64_t i) {
  if (pi->kind == INIT_ONES)
    return 1;
  if (pi->kind != INIT_NORMAL)
    return 0;
  double u1 = mdl_rng_uniform(seed, (uint64_t)k + 1000, 2 * (uint64_t)i);
  double u2 = mdl_rng_uniform(seed, (uint64_t)k + 1000, 2 * (uint64_t)i + 1);
  return pi->std * sqrt(-2 * log(1 - u1)) * cos(2 * M_PI * u2);
}

typedef struct {
  int id;
  Op op;
  DType dtype;
  Shape shape;
  int nin;
  int *in;          // input node ids, all < id
  int64_t ia[IR_NIA];
  double fa[IR_NFA];
  const char *name; // INPUT/PARAM/STATE/SCALAR: the name; others: the .mdl variable, or NULL
  SrcLoc loc;       // where in the .mdl it came from (the op the user wrote)
  ParamInit init;   // PARAM only
  int grad_of;      // the PARAM/INPUT id whose gradient this node is, or -1
  int param_of;     // STATE: its PARAM id; ADAMW: the PARAM it updates; else -1
  int body;         // the repetition of a repeat body that built it (1, 2, ... over the whole
                    // model, innermost body), 0 outside every repeat (and in the backward graph)
  const char *why;  // MATMUL under precision fp8: why it reads bf16 operands ("LM head", ...), else NULL
} IrNode;

// A tensor that a CAST to fp8 scales (precision fp8): its format, and the .mdl name and place of
// the value it rounds (for messages and the dumps). Its scale and amax history are state (Fp8State).
typedef struct {
  DType fmt;        // DT_F8E4M3 (weights, activations) or DT_F8E5M2 (gradients)
  const char *name; // the .mdl variable of the value cast, or a description ("d h.0.fc_w's output")
  SrcLoc loc;
} Fp8Tensor;

// The learning-rate schedule after its linear warmup (runtime/train/schedule.c): lr throughout, a
// straight line or a cosine from lr to min_lr at step `steps`, or warmup-stable-decay (lr, then a
// straight line to min_lr over the last `decay` steps). Without a schedule setting: constant.
typedef enum { SCHED_CONSTANT, SCHED_LINEAR, SCHED_COSINE, SCHED_WSD } Schedule;

typedef struct {
  OptRule optimizer;
  double lr, beta1, beta2, eps, weight_decay;
  double momentum;     // sgd, muon
  bool nesterov;       // sgd, muon
  double adam_lr;      // muon: the AdamW params' rate (lr, which the schedule runs from, is Muon's)
  Schedule schedule;
  double min_lr;       // the decay's floor
  int64_t warmup;      // warmup steps
  int64_t steps;       // schedule length (0 = unspecified: the run's steps)
  double decay;        // wsd: the decay's steps (>= 1), or its fraction of `steps` (< 1)
  double clip;         // max global grad norm, 0 = off
  int64_t accumulate;  // micro-batches per step
  const char *precision;  // "auto" | "fp32" | "bf16" | "fp8" ("auto" until the driver resolves it)
  bool precision_auto;    // it was "auto" (the driver says why it chose)
  SrcLoc precision_at;    // where the train section set it (line 0: the default)
  int64_t amax_history;   // fp8: the steps of amax each scaled tensor's scale is computed from (16)
  const char *checkpoint; // "none" | "all" | "auto" | "auto=BUDGET"
  SrcLoc checkpoint_at;   // where the train section set it (line 0: the default)
} TrainConfig;

// The checkpoint pass's choice for a training graph (checkpoint.c).
typedef struct {
  const char *policy;        // "none", "all" or "auto"
  int64_t budget;            // bytes the planned arena may take; 0: no budget
  const char *budget_how;    // where the budget came from: "2GiB", "0.5 of 24.1 GB available", ...
  bool budget_is_memory;     // the budget is the memory there is (auto without a size)
  int64_t peak, peak_none;   // the planned arena (memplan) with this choice, and with none
  int nsaved;                // forward values the backward reads (activations, not leaves)
  int nrecomputed;           // of those, recomputed in the backward
  int64_t saved_bytes;       // bytes of the saved values kept
  int64_t recomputed_bytes;  // bytes of the saved values recomputed instead
  int nclones;               // nodes the backward recomputes (the recomputed values and what they need)
  double recompute_flops;    // the step's FLOPs (fusion's count) beyond none's
  double step_flops;         // the step's FLOPs with this choice
} CheckpointPlan;

typedef struct {
  const char *name;
  int64_t value;
  int64_t text_value; // a fixed dim set by -D: the value its own expression gives (else value)
} DimBinding;

typedef struct Graph {
  Arena *arena;
  const char *model;    // model name
  const char *source;   // the .mdl text it was compiled from
  IrNode **nodes;
  int n, cap;
  int loss;             // the scalar node training minimises, or -1
  int *outputs;         // named outputs ("output NAME = ...")
  int noutputs;
  int *params;          // PARAM ids in declaration order
  int nparams;
  int *grads;           // after autodiff: grads[i] is the gradient node of params[i] (-1: frozen)
  int *updates;         // after autodiff: ADAMW node of params[i] (-1: frozen)
  int fwd_end;          // nodes [0, fwd_end) are the forward graph
  DimBinding *dims;     // every dim with its bound value, in declaration order
  int ndims;
  TrainConfig train;
  int cur_body;         // the body new nodes belong to (IrNode.body); the front end sets it
  int nbodies;          // repetitions of repeat bodies so far
  CheckpointPlan ckpt;  // what the checkpoint pass chose (checkpoint.c); policy NULL before it runs
  Fp8Tensor *fp8;       // precision fp8: the scaled tensors (a CAST's ia[1] indexes them)
  int nfp8;
  char err[512];        // message of the last failed ir_add (shape/dtype error)
} Graph;

Graph *ir_new(Arena *a);
// Append a node; infers and checks its shape and dtype. Returns its id, or -1 with g->err set
// (e.g. "matmul shapes [2,3] and [4,5] do not match"). `ia`, `fa` may be NULL.
int ir_add(Graph *g, Op op, const int *in, int nin, const int64_t ia[IR_NIA], const double fa[IR_NFA], SrcLoc loc);
int ir_leaf(Graph *g, Op op, const char *name, DType dt, Shape s, SrcLoc loc);
int ir_const(Graph *g, double v, SrcLoc loc);
int ir_const_i32(Graph *g, int32_t v, SrcLoc loc); // an i32 CONST (integer arithmetic on i32 tensors)
int ir_reshape(Graph *g, int x, Shape s, SrcLoc loc);    // -1 with g->err when counts differ
int ir_broadcast(Graph *g, int x, Shape s, SrcLoc loc);
int ir_slice_bwd(Graph *g, int dy, Shape full, int axis, int64_t start, int64_t end, SrcLoc loc);
int ir_embed_bwd(Graph *g, int ids, int dy, int64_t vocab, SrcLoc loc);
// ATTENTION_MASK over T positions: from doc ids i32[B,T] ([B,1,T,T]), or without (doc -1, [1,1,T,T]);
// window 0 for none.
int ir_attention_mask(Graph *g, int doc, int64_t t, bool causal, int64_t window, SrcLoc loc);
// Whether q, k, v (and doc ids when doc >= 0) fit attention with `heads` query heads, `kv_heads` key
// and value heads, causal and a window (0: none) as given; g->err says why not.
bool ir_attention_fits(Graph *g, int q, int k, int v, int doc, int64_t heads, int64_t kv_heads, bool causal,
                       int64_t window);
bool ir_validate(const Graph *g, char *why, size_t n); // false with a reason when broken
void ir_dump(const Graph *g, FILE *f);
// The kv heads of an ATTENTION, ATTENTION_LSE or ATTENTION_BWD node (ia[5], 0 meaning one per head).
static inline int64_t att_kv_heads(const IrNode *n) { return n->ia[5] ? n->ia[5] : n->ia[0]; }
// The (query, key) pairs attention over t queries and s keys computes per head, as the FLOP counts
// (fuse.c, runtime/engine/flops.c) take them: t s; causal, t^2 / 2; with a window w < t, w t - w^2 / 2 (rows
// see up to w keys; the first w rows fewer).
static inline double att_pairs(int64_t t, int64_t s, bool causal, int64_t window) {
  if (!causal)
    return (double)t * (double)s;
  if (window > 0 && window < t)
    return (double)window * (double)t - (double)window * (double)window / 2;
  return (double)t * (double)t / 2;
}
// The inputs of an ATTENTION_BWD after q, k, v and the doc ids: the forward's output, its lse, dout.
static inline int att_bwd_out(const IrNode *n) { return n->in[n->nin - 3]; }
static inline int att_bwd_lse(const IrNode *n) { return n->in[n->nin - 2]; }
static inline int att_bwd_dout(const IrNode *n) { return n->in[n->nin - 1]; }
// An ADAMW's moments (-1 where its rule keeps fewer: opt_nstate of them) and its scalar inputs.
static inline int opt_nstate(const IrNode *n) { return n->ia[0] == OPT_MUON ? 1 : n->nin - 5; }
static inline int opt_m(const IrNode *n) { return n->nin > 5 ? n->in[2] : -1; }
static inline int opt_v(const IrNode *n) { return n->nin > 6 && n->ia[0] != OPT_MUON ? n->in[3] : -1; }
static inline int opt_gnorm(const IrNode *n) { return n->in[n->nin - 3]; }
static inline int opt_lr(const IrNode *n) { return n->in[n->nin - 2]; }
static inline int opt_step(const IrNode *n) { return n->in[n->nin - 1]; }
static inline double opt_lr_scale(const IrNode *n) { return n->fa[5] > 0 ? n->fa[5] : 1; } // (0 stands for 1)
int64_t ir_param_count(const Graph *g);
// A forward graph for evaluation and sampling: every dropout keeps everything (p = 0).
void ir_eval_mode(Graph *g);

//
// types.c: what the IR's types say of themselves; the runtime reads the IR through these.
//
const char *op_name(Op op);
const char *opt_rule_name(OptRule r); // "adamw", "sgd", "lion", "muon"
int opt_rule_moments(OptRule r, double momentum); // the moments a parameter keeps: 2, 1 or 0
const char *dtype_name(DType dt);
int dtype_size(DType dt); // bytes per element in memory: 4 for f32 and i32, 2 for bf16, ...
// x rounded to the nearest bf16 value, ties to even (NaN stays NaN, overflow goes to inf).
double round_bf16(double x);
int64_t shape_numel(Shape s);
bool shape_eq(Shape a, Shape b);
char *shape_str(Shape s, char *buf, size_t n); // "[2,3,4]"
Shape shape_of(int rank, const int64_t *d);
// Offset into a tensor of shape `in` of the element that broadcasting maps to flat index idx of a
// tensor of shape `out` (numpy rules: axes aligned on the right, size-1 and missing axes repeat).
int64_t shape_bcast_offset(Shape out, Shape in, int64_t idx);
int64_t ir_dim(const Graph *g, const char *name); // a dim's bound value, -1 when there is none

//
// scalar.c: the IR's elementwise ops at one number, shared by the interpreter and constant evaluation.
//
// An elementwise unary op (NEG ... SILU) at one number: also the front end's constant folding.
double interp_unary(Op op, double x);
double interp_compare(int64_t rel, double a, double b); // 1 where a REL b holds (Compare), else 0
// Arithmetic on i32 values: op (NEG, ABS, ADD, SUB, MUL, FLOORDIV, MOD) at a and b (b unused by the
// unary ones), wrapping around modulo 2^32 as the compiled code's does.
int32_t interp_i32(Op op, int32_t a, int32_t b);
// x as int(x) converts it: toward zero, saturating at the i32 range, NaN to 0.
int32_t interp_to_i32(double x);

//
// front end (grammar/mdl.l, grammar/mdl.y, compiler/front/sema*.c): .mdl text to the forward graph.
//
typedef struct {
  const char *name;
  int64_t value;
} DimOverride; // -D NAME=VALUE from the command line

// What one .mdl may build (repeat bodies are unrolled): graph nodes of the forward graph,
// parameter tensors, bytes of parameters (f32), and statements run (every repetition of every
// body). A repeat that would pass one is refused after its first repetition, before the rest.
enum { MDL_MAX_NODES = 1 << 18, MDL_MAX_PARAMS = 1 << 16, MDL_MAX_STMTS = 1 << 18 };
#define MDL_MAX_PARAM_BYTES ((int64_t)1 << 42)

// The front end's options beyond -D: how it lowers a construct that has more than one lowering (the
// switches `mdlc lab` turns off one by one to measure what each technique is worth), and the train
// settings the command line sets ({0}: the defaults).
typedef struct {
  // attention(...) as an unfused framework runs it (--attention plain) instead of the fused ATTENTION
  // op: per head, the scores q k^T times scale plus an ATTENTION_MASK, materialised as [B,H,T,T];
  // SOFTMAX; then their product with v (MATMULs of [B,H,T,D] views made by RESHAPE and PERMUTE).
  bool plain_attention;
  // attention ignores its doc= argument (--no-doc-mask): causal over the whole packed row, documents
  // attend to each other. For the lab and the tests that show the leak; never for training.
  bool no_doc_mask;
  // Train-section settings from the command line (--set KEY=VALUE), applied over the train section
  // in their order: KEY is a setting (clip, precision, optimizer, ...), a free dim, or one argument
  // of the optimizer or the schedule (lr, weight_decay, warmup, ...). Errors name "--set" and quote it.
  const char *const *settings;
  int nsettings;
} LowerOptions;

// Parse and check a .mdl file and build its forward graph (params, inputs, loss, outputs, the
// train section). Returns NULL after printing every error (file:line:col + caret), at most
// DIAG_MAX_ERRORS of them. The _with forms lower as lo says (NULL: the defaults).
Graph *mdl_compile_file(Arena *a, const char *path, const DimOverride *ov, int nov);
Graph *mdl_compile_file_with(Arena *a, const char *path, const DimOverride *ov, int nov, const LowerOptions *lo);
Graph *mdl_compile_text(Arena *a, const char *path, const char *text, const DimOverride *ov, int nov);
Graph *mdl_compile_text_with(Arena *a, const char *path, const char *text, const DimOverride *ov, int nov,
                             const LowerOptions *lo);
// The same over n bytes that may hold anything (a NUL or invalid UTF-8 is an error at its line).
Graph *mdl_compile_bytes(Arena *a, const char *path, const char *bytes, size_t n, const DimOverride *ov, int nov);

//
// autodiff.c: reverse mode over the forward graph, then one optimizer update (OP_ADAMW, its rule
// the train section's optimizer) per parameter that is not frozen.
//
// Appends the backward graph for g->loss and the optimizer step; fills g->grads and g->updates.
// With `optimizer` false only the gradients are built (gradient checks).
bool autodiff(Graph *g, bool optimizer);

//
// interp.c: the reference interpreter; op by op, unfused. The oracle of every back end.
//
typedef enum { INTERP_F32, INTERP_F64 } InterpPrecision;

typedef struct Interp Interp;
Interp *interp_new(const Graph *g, InterpPrecision prec);
void interp_free(Interp *it);
// Values live as doubles; in INTERP_F32 each op's result is rounded to float.
double *interp_param(Interp *it, int param_node);   // the parameter's values (read/write)
void interp_init_params(Interp *it, uint64_t seed); // from each ParamInit
void interp_init_param(Interp *it, uint64_t seed, int k); // parameter k (g->params[k]) alone
bool interp_set_input(Interp *it, const char *name, const int32_t *ids, const float *f, int64_t n);
void interp_set_scalar(Interp *it, const char *name, double v); // "lr", "step"
void interp_set_seed(Interp *it, uint64_t seed);                 // dropout masks
// Decode mode, for text generation with a KV cache. With max_len > 0, each ATTENTION node of a
// graph compiled for one token (B = T = 1) appends its k and v rows to a cache of its own (max_len
// rows, allocated on first use) at the position set by interp_set_decode_pos before each run, and
// attends its q over cache rows [0, pos]: causal, one document (doc ids are not read); every
// DROPOUT keeps everything (p = 0, as ir_eval_mode sets it). max_len 0 turns decode mode off.
// interp_set_decode drops the caches and sets the position to 0.
void interp_set_decode(Interp *it, int64_t max_len);
void interp_set_decode_pos(Interp *it, int64_t pos);
// Runs nodes [0, end) (end = g->n runs the whole step). Returns false with a message on error.
bool interp_run(Interp *it, int end, char *err, size_t n);
const double *interp_value(Interp *it, int node); // after interp_run
// Precision fp8: the scales and amax histories (read and written by checkpoints and tests); after a
// step, amax holds that step's amaxes (fp8_state_check names a non-finite one).
typedef struct Fp8State Fp8State;
Fp8State *interp_fp8(Interp *it);
int64_t interp_numel(Interp *it, int node);

//
// precision.c: the precision pass. Rewrites a training graph so that every MATMUL reads its
// operands, every attention its q, k, v (and the backward its out and dout) and every cross-entropy
// its logits through CAST nodes to `gemm` (DT_BF16), one CAST per source value shared by all the
// nodes that read it (forward and backward); everything else stays f32: the parameters (master
// weights), optimizer state, gradients, reductions and the residual stream. DT_F32 leaves g as it is.
// DT_F8E4M3 is the fp8 policy (precision.c's top comment): the linear layers' GEMMs read scaled fp8
// CASTs (Graph.fp8 lists them), the rest as bf16, each GEMM kept in bf16 with its reason (IrNode.why).
// False with a reason when the graph cannot be rebuilt.
bool precision_assign(Graph *g, DType gemm, char *why, size_t n);
// "fp32" -> DT_F32, "bf16" -> DT_BF16, "fp8" -> DT_F8E4M3 (the fp8 policy: precision_assign says
// which GEMMs read fp8 operands); false for any other name.
bool precision_parse(const char *name, DType *out);

// Delayed scaling (precision fp8; its state and rule: runtime/engine/fp8_state.h): each scale leaves a
// factor 2^FP8_MARGIN of room for growth between steps (the dumps print it with the policy).
enum { FP8_MARGIN = 1 };

//
// safetensors.c: read and write safetensors files (parameters, gradients, batches).
//
typedef struct {
  const char *name;
  DType dtype;      // DT_F32, DT_I32, DT_BF16, DT_F64
  Shape shape;
  void *data;       // numel * element size bytes
} StTensor;

typedef struct {
  const char *key, *value;
} StMeta; // a string of the header's __metadata__

typedef struct {
  StTensor *t;
  int n;
  StMeta *meta;
  int nmeta;
} StFile;

// Reads a whole file; on failure prints "path: reason" and returns false.
bool st_read(Arena *a, const char *path, StFile *out);
// The same, less the tensors' data (every data pointer NULL): names, dtypes, shapes, metadata.
bool st_read_header(Arena *a, const char *path, StFile *out);
const StTensor *st_find(const StFile *f, const char *name);
// The tensor named like node n with n's dtype and shape; NULL after "path: error: <prefix>no tensor
// 'x' (the model's parameter [64])" or "<prefix>tensor 'x' is [32], the model wants [64]".
const StTensor *st_expect(const StFile *f, const char *path, const char *prefix, const IrNode *n);
// Writes atomically (temp file, fsync, rename); on failure prints "path: reason".
bool st_write(const char *path, const StTensor *t, int n);
bool st_write_meta(const char *path, const StTensor *t, int n, const StMeta *meta, int nmeta);
const char *st_meta(const StFile *f, const char *key); // NULL when absent

//
// fuse.c: the fusion pass. Groups the training graph's nodes into steps (the rules are written
// at the top of fuse.c); every rejected pair gets a reason ("not fused: A with B: reason").
// (fuse_groups.c: what may fuse, step_kind_name; fuse_plan.c: the step plan, fuse_is_copy,
// fuse_node_flops, fuse_dump.)
//
typedef enum {
  STEP_KERNEL,    // one fused loop nest: elementwise chains, reductions, row-wise ops, gathers
  STEP_GEMM,      // one matmul through the BLAS, with an elementwise epilogue (bias, gelu, residual)
  STEP_ATTENTION, // attention forward, or its backward (dq, dk, dv in one step)
  STEP_LMHEAD,    // LM-head matmul + cross-entropy fwd/bwd + the head's backward GEMMs, row chunk by chunk
  STEP_OPTIMIZER, // global grad norm + AdamW over the flat parameter buffer, one kernel
} StepKind;

typedef struct {
  StepKind kind;
  const char *name;  // stable, says what it fuses: "k12_layernorm_fwd__add"
  int *nodes;        // IR nodes computed inside, in topological order
  int nnodes;
  int root;          // the anchor node (the matmul, the reduction, the row-wise op), or -1
  int *outs;         // nodes this step writes to memory (read by a later step, or a model output)
  int nouts;
  int *ins;          // materialised nodes (and leaves) this step reads
  int nins;
  double flops, bytes_read, bytes_written;
} Step;

typedef struct {
  int a, b;           // node ids: a producer and its consumer
  const char *reason;
} FuseRejection;

// The most buffers (values read from memory and values written) the fusion pass lets a step's
// kernel address; the CUDA back end passes a kernel its buffers' offsets in a table of
// CUDA_MAX_ARGS, the rest for the scratch of a step (partial sums, row statistics).
enum { FUSE_MAX_BUFFERS = 40 };

typedef struct {
  bool fuse;          // false (--no-fuse): one step per node, the optimizer per parameter
  bool chunk_lmhead;  // the LM head + cross-entropy run chunk by chunk (never the whole logits)
  // (--optimizer-per-param) AdamW as one step per parameter after the gradient norm's, as an unfused
  // framework launches it (torch.optim.AdamW with foreach=False), instead of one step over them all
  bool optimizer_per_param;
  int max_group;      // cap on nodes per kernel
} FuseOptions;

typedef struct {
  Graph *g;
  FuseOptions opt;
  Step *steps;        // in execution order
  int nsteps;
  int *step_of;       // per node: index of the step that computes it; -1 for leaves and views
  bool *materialised; // per node: its value lives in memory (leaves, step outputs, views of them)
  // Per node: for a PARAM, the bf16 CAST of it that is a *copy* (rule 11), else -1. A copy is in no
  // step (step_of -1) and materialised beside the parameter: the optimizer step rewrites it as it
  // updates the parameter, and whoever sets a parameter from outside (initialisation, a checkpoint,
  // another engine's weights) writes its copy as well.
  int *copy_of;
  int ncopies;
  FuseRejection *rejected;
  int nrejected;
} Fusion;

Fusion *fuse(Graph *g, FuseOptions opt);
bool fuse_is_copy(const Fusion *f, int node); // node is a parameter's bf16 copy (rule 11)
// The FLOPs of node id as the fusion pass counts them (the costs at the top of fuse.c), alone in a step.
double fuse_node_flops(const Graph *g, int id);
void fuse_dump(const Fusion *f, FILE *out); // steps with their ops and .mdl lines, then "not fused" lines
const char *step_kind_name(StepKind k);     // "kernel", "gemm", "attention", "lmhead", "optimizer"

//
// checkpoint.c: the checkpoint pass (placement of recomputation under a memory budget; the policies
// are written at the top of checkpoint.c). It runs after autodiff and precision and before fusion,
// which it runs (with fo and reuse) to measure each choice.
//
// Rewrites training graph g for `policy` ("none", "all", "auto") and, for auto, `budget` bytes of
// planned arena (0: no budget; budget_how says where it came from, for messages; budget_is_memory: it
// is the memory there is), and fills g->ckpt.
// With dump_to, prints every saved value, kept or recomputed. False when the budget cannot be met even
// by `all`: then g->ckpt holds all's peak (the smallest budget there is) and none's, and `why` what
// takes the memory; or false with an internal error in `why` (g->ckpt.policy NULL).
bool checkpoint_place(Graph *g, const char *policy, int64_t budget, const char *budget_how, bool budget_is_memory,
                      FuseOptions fo, bool reuse, FILE *dump_to, char *why, size_t n);
// One line on what the pass chose (policy, saved values kept and recomputed, extra FLOPs, planned
// peak), with the budget and where it came from when `budget` (a budget that is the memory there is
// only when `memory` too: the build's reports stay the same from machine to machine).
void checkpoint_summary(const CheckpointPlan *cp, bool budget, bool memory, char *buf, size_t n);
// A budget's bytes: "1000000", "512MiB", "2GiB", "1GB", or a fraction in (0, 1] of `memory` (then
// *fraction is set); -1 when the text is none of these (or a fraction with memory unknown).
int64_t checkpoint_budget(const char *text, int64_t memory, bool *fraction);

//
// memplan.c: one arena, liveness-based reuse. Parameters, their gradients and the optimizer's moments
// live in up to four flat buffers in parameter order (so the optimizer is one loop); the parameters' bf16
// copies (Fusion.copy_of) follow them, persistent too; inputs and scalars have fixed slots; every
// other materialised node gets an offset reused after its last reader. A RESHAPE of a materialised
// node is a view: it shares its input's offset.
//
typedef struct {
  int64_t *offset;          // per node: byte offset in the arena, -1 when not materialised
  int64_t params, grads, m, v; // offsets of the four flat buffers (m and v: of the first moments kept)
  int64_t param_bytes;      // size of each flat buffer
  int moments;              // the moment buffers the optimizer keeps (0, 1: m, 2: m and v); the rest are empty
  int64_t copies, copy_bytes; // the bf16 copies: offset and size of their region
  const int *copy_of;       // Fusion.copy_of: per PARAM node its copy, else -1
  int64_t arena_bytes;      // the whole arena (peak)
  int64_t activation_bytes; // peak of everything but the flat buffers, the copies, inputs and scalars
} MemPlan;

MemPlan *memplan(const Fusion *f);
// A parameter's bf16 copy (Fusion.copy_of) that is a matrix has room for MEMPLAN_ROWS-aligned rows,
// zero past its own: memplan_copy_rows of them, memplan_copy_bytes in all (any copy).
enum { MEMPLAN_ROWS = 64 };
int64_t memplan_copy_rows(const IrNode *copy);
int64_t memplan_copy_bytes(const IrNode *copy);
// With reuse off every activation gets memory of its own (--no-reuse: what liveness saves).
MemPlan *memplan_with(const Fusion *f, bool reuse);
void memplan_dump(const Fusion *f, const MemPlan *m, FILE *out);

//
// lab.c: `mdlc lab`: the techniques' worth, each measured by a `mdlc run` of its own (lab_measure.c fills
// in what needs the compiler: the plans' peaks, the leak check, the GEMM library's rates).
//
typedef struct {
  Arena *arena;
  const char *model, *data, *out; // the .mdl, the data folder, the lab's folder
  const char *model_name, *machine, *setup; // as the tables' title says them
  int64_t steps;                  // per run
  const char *const *pass;        // options every run gets (-D, --backend, --seed, ...)
  int npass;
  const char *skip[8];            // per technique (lab.c's order): why it cannot run here, else NULL
  const char *apart[8];           // per technique: why it runs here only as a row apart, outside the ladder
                                  // and the full system (fp8 emulated on a CPU), else NULL
  int64_t T;                      // the context the runs train at
  double scores_mb;               // one attention's [B, H, T, T] scores, fp32
  int nparams;                    // parameter tensors
  const char *bf16_why;           // what the GEMM library does in bf16 here
  int64_t budget;                 // checkpointing's memory budget (bytes)
  const char *budget_how;         // where it comes from
  int64_t batch_none, batch_auto; // the largest batches within it without / with checkpointing (0: none)
  const char *batch_how;          // why there are none
  bool has_doc;                   // the model's attention has document ids
  const char *leak_on, *leak_off; // the leak check with the document mask and without, in words
} LabOptions;
// Makes OUT and OUT/rows for lab_run, removing an earlier lab's rows (only those); false after saying
// why, as for a rows folder the lab did not make.
bool lab_claim_out(const char *out);
// Runs the ladder (into the folders lab_claim_out made), writes OUT/lab.md, lab.csv, lab.svg; the exit
// status (1 when a run failed). A SIGINT, SIGTERM or SIGHUP stops the row's run and the lab.
int lab_run(const LabOptions *o);

//
// report.c: the fusion report (per kernel: ops, bytes, flops; totals with fusion on and off).
//
void fusion_report(const Fusion *on, const Fusion *off, const MemPlan *mon, const MemPlan *moff, FILE *out);


//
// pipeline.c: every pass in order, from .mdl text to the module a back end runs; it runs nothing,
// opens no device and reads no data (the driver decides what depends on the machine before).
//
typedef enum {
  GRAPH_FORWARD, // the forward graph, its precision checked but not applied (check, init)
  GRAPH_INFER,   // the forward graph after the precision pass, dropout off (the lab's leak check)
  GRAPH_EVAL,    // the same with bf16 for fp8 and only the loss and the scalar outputs (validation)
  GRAPH_GRADS,   // forward and backward, no optimizer (grad; gradient accumulation's micro-batches)
  GRAPH_TRAIN,   // forward, backward and the optimizer's update: the training step
} GraphKind;

typedef enum {
  TARGET_GRAPH,  // stop at the graph (the interpreter runs it)
  TARGET_PLAN,   // fuse and plan memory, emit nothing (check's -d F, M)
  TARGET_C,      // and emit the C module (the CPU back end)
  TARGET_CUDA,   // and emit the CUDA plan (the CUDA back end)
  TARGET_C_CUDA, // and both (build)
} Target;

typedef struct {
  const char *file;            // the model: its path (messages; the front end reads it)
  const char *text;            // its text where not read from file, else NULL
  const DimOverride *dims;     // -D
  int ndims;
  const LowerOptions *lower;
  int64_t accumulate;          // > 0: overrides the train section's gradient accumulation
  GraphKind kind;
  const char *precision;       // --precision, else NULL: the train section's
  const char *auto_precision;  // what `auto` precision is here: "bf16" or "fp32"
  const char *gpu;             // the GPU the step runs on (its name), else NULL
  int compute_capability;      // its compute capability (89 for 8.9): fp8 needs 89 or more
  bool fp8_emulated_note;      // say (once) that fp8 is emulated on the CPU
  const char *checkpoint;      // --checkpoint, else NULL: the train section's, else auto
  int64_t memory;              // bytes auto's budget is measured against (-1: unknown)
  const char *memory_what;     // what that memory is: "free on the GPU", "available (...)"
  FuseOptions fuse;
  bool reuse;                  // the memory plan shares memory between values whose lives do not overlap
  const char *dump;            // -d letters: P A R C F M
  Target target;
  const char *module_name;     // the emitted files' first comment names it (NULL: the model's name)
} PipelineOptions;

typedef struct CudaPlan CudaPlan; // (emit_cuda.h)
typedef struct {
  Graph *g;
  Fusion *f;                   // TARGET_PLAN and after
  MemPlan *m;
  char *c_source;              // TARGET_C, TARGET_C_CUDA
  CudaPlan *cuda;              // TARGET_CUDA, TARGET_C_CUDA
} Compilation;

// Front end, the precision named, autodiff and the optimizer, precision, specialisation, checkpoints,
// fusion, memory plan, emit: as far as o->kind and o->target ask, each pass validated and dumped as
// o->dump says. False after saying why; c->g is the graph as far as it was built.
bool pipeline(Arena *a, const PipelineOptions *o, Compilation *c);

#endif
