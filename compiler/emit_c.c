// emit_c.c: the C emitter. It turns the step plan (a Fusion and its MemPlan) into one translation unit
// of C11 + OpenMP for the whole training step: a prelude of helpers, one function per step, mdl_step
// calling them in order, and a table of kernels the runtime can time one by one.
//
// Design. The nodes of a step split into anchors, ops that need a loop nest of their own (GEMM,
// reductions, row-wise ops, attention, gathers, the optimizer), and pointwise nodes (elementwise and
// index-mapped ops), which never get a loop of their own: the inline evaluator `val` computes a
// pointwise node as a local at whatever flat index a loop asks for, reading its inputs through their
// index maps (broadcast, permute, slice, concat), recursively, down to values in memory; a node used
// twice at one index is computed once. Anchors of one kind over the same inputs form one group
// (layernorm dx/dw/db, attention dq/dk/dv, cross-entropy with its backward, the LM-head pattern, the
// optimizer) and groups run in dependency order. Around each group:
//   - inputs it reads from memory that are pointwise nodes of the step are first written by an
//     elementwise loop (to their arena slot, or to a scratch buffer when the step keeps them);
//   - inputs a reduction or a row-wise op reads element by element are computed inline in its loop,
//     and a step output met there at the loop's own index is stored on the way (the residual add that
//     feeds a layernorm);
//   - step outputs that depend on the group and have its shape are computed in the group's own loop
//     (reductions, row-wise ops) or in a loop right after it (the GEMM epilogue; the GEMM then writes
//     straight into the epilogue's output when the matmul itself stays inside the step);
// and the outputs still unwritten get elementwise loops at the end. Whether a value may share a
// loop depends on how it is read (a consumer reading a reduction at another index cannot run in
// the reduction's loop), so a step is emitted in passes: a pass that meets such a read flags it, the
// next pass avoids it, and the text of the last pass is kept.
//
// Numerics follow interp.c op by op. Elementwise math is fp32; sums over many elements (norm
// statistics, column sums, reductions, softmax denominators, the gradient norm) accumulate in double,
// in fixed blocks combined in a fixed order, and short dot products use `omp simd` reductions (an
// order fixed by the compiled code), so results do not depend on the thread count. AdamW runs in
// double per element, as the interpreter does. GEMMs go through mdl_gemm, which splits the rows of
// C over the OpenMP threads and calls the runtime's single-threaded sgemm in each block, so one
// pool of threads runs the whole step.
#include "mdl.h"
#include "backend.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

enum { PAR_MIN = 32768 }; // elements of work below which a loop stays on one thread

static const char prelude[] =
    "#include <math.h>\n"
    "#include <stdbool.h>\n"
    "#include <stdint.h>\n"
    "#include <stdio.h>\n"
    "#include <stdlib.h>\n"
    "#include <string.h>\n"
    "\n"
    "// The runtime's hooks and the kernel table (runtime/backend.h holds the same typedefs).\n"
    "typedef struct {\n"
    "  // row-major C = op(A) op(B) + beta C, op = transpose when ta / tb\n"
    "  void (*sgemm)(int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,\n"
    "                const float *b, int64_t ldb, float beta, float *c, int64_t ldc);\n"
    "  int nthreads;  // OpenMP threads per parallel loop\n"
    "  uint64_t seed; // the run's seed: dropout masks\n"
    "  void *ctx;     // passed back to error\n"
    "  void (*error)(void *ctx, const char *what, int64_t value, int64_t limit); // an id or target out of range\n"
    "} MdlHooks;\n"
    "\n"
    "typedef struct {\n"
    "  const char *name;\n"
    "  void (*fn)(char *arena, const MdlHooks *h);\n"
    "} MdlKernel;\n"
    "\n"
    "// Counter-based random numbers, as in mdl.h: splitmix64 of (seed, stream, index).\n"
    "static inline uint64_t mdl_rng_u64(uint64_t seed, uint64_t stream, uint64_t i) {\n"
    "  uint64_t z = seed * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull + i * 0xBF58476D1CE4E5B9ull;\n"
    "  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;\n"
    "  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;\n"
    "  return z ^ (z >> 31);\n"
    "}\n"
    "\n"
    "static inline double mdl_rng_uniform(uint64_t seed, uint64_t stream, uint64_t i) {\n"
    "  return (double)(mdl_rng_u64(seed, stream, i) >> 40) / 16777216.0;\n"
    "}\n"
    "\n"
    "// Dropout keeps element i when its uniform number is >= p and scales it by 1 / (1 - p).\n"
    "static inline float mdl_dropout(uint64_t seed, uint64_t stream, int64_t i, double p, float x) {\n"
    "  return mdl_rng_uniform(seed, stream, (uint64_t)i) >= p ? (float)(x / (1.0 - p)) : 0.0f;\n"
    "}\n"
    "\n"
    "// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), and its\n"
    "// derivative 0.5 (1 + t) + 0.5 x (1 - t^2) u'. With s = sigmoid(2u) = 0.5 (1 + tanh(u)) and\n"
    "// 1 - t^2 = 4 s (1 - s) both take one expf, much cheaper than tanhf.\n"
    "static inline float mdl_gelu(float x) {\n"
    "  const float u = 0.797884561f * (x + 0.044715f * x * x * x);\n"
    "  return x / (1.0f + expf(-2.0f * u));\n"
    "}\n"
    "\n"
    "static inline float mdl_gelu_grad(float x) {\n"
    "  const float u = 0.797884561f * (x + 0.044715f * x * x * x), s = 1.0f / (1.0f + expf(-2.0f * u));\n"
    "  return s + 2.0f * x * s * (1.0f - s) * 0.797884561f * (1.0f + 3.0f * 0.044715f * x * x);\n"
    "}\n"
    "\n"
    "static inline float mdl_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }\n"
    "static inline float mdl_silu(float x) { return x * mdl_sigmoid(x); }\n"
    "\n"
    "static inline float mdl_silu_grad(float x, float dy) {\n"
    "  const float s = mdl_sigmoid(x);\n"
    "  return dy * s * (1.0f + x * (1.0f - s));\n"
    "}\n"
    "\n"
    "static inline void *mdl_scratch(size_t bytes) {\n"
    "  void *p = malloc(bytes ? bytes : 1);\n"
    "  if (!p) {\n"
    "    fprintf(stderr, \"mdl: out of memory (%zu bytes)\\n\", bytes);\n"
    "    abort();\n"
    "  }\n"
    "  return p;\n"
    "}\n"
    "\n"
    "// C = op(A) op(B) + beta C through the runtime's sgemm, split into blocks of output rows over the\n"
    "// threads (the BLAS runs single-threaded in each): one pool of threads for the whole step, and\n"
    "// every element summed over k in the same order whatever the split.\n"
    "static inline void mdl_gemm(const MdlHooks *h, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,\n"
    "                            int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {\n"
    "  int64_t nb = m * n * k >= (1 << 18) ? h->nthreads : 1;\n"
    "  if (nb > (m + 15) / 16)\n"
    "    nb = (m + 15) / 16;\n"
    "  if (nb <= 1) {\n"
    "    h->sgemm(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);\n"
    "    return;\n"
    "  }\n"
    "#pragma omp parallel for num_threads(h->nthreads) schedule(static)\n"
    "  for (int64_t t = 0; t < nb; t++) {\n"
    "    const int64_t r0 = m * t / nb, r1 = m * (t + 1) / nb;\n"
    "    h->sgemm(ta, tb, r1 - r0, n, k, ta ? a + r0 : a + r0 * lda, lda, b, ldb, beta, c + r0 * ldc, ldc);\n"
    "  }\n"
    "}\n"
    "\n"
    "// Sum of squares in double over fixed blocks of 4096, the blocks added in order: the result does\n"
    "// not depend on the number of threads.\n"
    "static inline double mdl_sumsq(const float *x, int64_t n, int nthreads) {\n"
    "  const int64_t nb = (n + 4095) / 4096;\n"
    "  double *part = mdl_scratch((size_t)nb * sizeof(double)), s = 0;\n"
    "#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 65536)\n"
    "  for (int64_t b = 0; b < nb; b++) {\n"
    "    const int64_t end = b * 4096 + 4096 < n ? b * 4096 + 4096 : n;\n"
    "    double acc = 0;\n"
    "    for (int64_t i = b * 4096; i < end; i++)\n"
    "      acc += (double)x[i] * x[i];\n"
    "    part[b] = acc;\n"
    "  }\n"
    "  for (int64_t b = 0; b < nb; b++)\n"
    "    s += part[b];\n"
    "  free(part);\n"
    "  return s;\n"
    "}\n";

//
// Text buffers.
//

typedef struct {
  char *s;
  size_t len, cap;
} Buf;

static void bput(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bvput(Buf *b, const char *fmt, va_list ap) {
  for (;;) {
    va_list cp;
    va_copy(cp, ap);
    size_t room = b->cap - b->len;
    int n = vsnprintf(b->s ? b->s + b->len : NULL, room, fmt, cp);
    va_end(cp);
    if (n < 0)
      return;
    if ((size_t)n < room) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap - b->len <= (size_t)n)
      cap *= 2;
    char *s = realloc(b->s, cap);
    if (!s) {
      fprintf(stderr, "mdlc: out of memory (%zu bytes)\n", cap);
      exit(1);
    }
    b->s = s;
    b->cap = cap;
  }
}

static void bput(Buf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  bvput(b, fmt, ap);
  va_end(ap);
}

static void bappend(Buf *b, const Buf *x) {
  if (x->len)
    bput(b, "%.*s", (int)x->len, x->s);
}

//
// The emitter's state.
//

typedef enum { G_SINGLE, G_NORM_BWD, G_ATTN_BWD, G_CE, G_LMHEAD, G_OPT } GroupKind;

typedef struct {
  GroupKind kind;
  int *mem;     // member anchors
  int nmem;
  int *ext;     // external inputs (what the group reads)
  int n_ext;
  // G_LMHEAD: the pattern's nodes
  int mm, ce, ceb, dx, dw, x, w, tgt, dloss;
  bool tb;
} Group;

typedef struct {
  int node;
  const char *ix;   // flat index expression the value is taken at
  const char *name; // the C expression holding it
  int depth;
} Memo;

typedef struct {
  const char *expr, *name;
  int depth;
} IxMemo;

typedef struct {
  const Fusion *f;
  const MemPlan *m;
  const Graph *g;
  Arena *a;        // strings of one emission
  Buf out;         // the translation unit
  char err[512];
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
  bool *scratch;   // gets a malloc'd buffer in this kernel
  bool *declared;  // its pointer is declared
  bool *stored;    // stored by the current phase
  int *host;       // a GEMM root -> the epilogue output it writes into, or -1
  int *phase_nodes;
  int nphase;
  int *pending;    // nodes to write before the next group
  int npending;
  int *decls;      // nodes whose pointer the kernel uses
  int ndecls;
  Buf body, notes;
  int indent, depth, fresh;
  Memo *memo;
  int nmemo, capmemo;
  IxMemo *ixm;
  int nixm, capixm;
  const char *loop_ix; // the current loop's own flat index (stores happen there)
  int64_t loop_n;      // and the number of elements it visits
  int post_anchor;     // inside the loop that follows (or is) this anchor's, else -1
  const char *post_ix;
  bool post_inloop;    // that loop is the anchor's own loop (its value is a local)
  int cur_q;           // the output being evaluated there
  bool uses_h;
} Emit;

static bool fail(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(Emit *e, const char *fmt, ...) {
  if (!e->failed) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->err, sizeof e->err, fmt, ap);
    va_end(ap);
  }
  e->failed = true;
  return false;
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) {
    fprintf(stderr, "mdlc: out of memory (%zu bytes)\n", n * size);
    exit(1);
  }
  return p;
}

static const IrNode *node(const Emit *e, int n) { return e->g->nodes[n]; }
static int64_t numel(const Emit *e, int n) { return shape_numel(node(e, n)->shape); }
static int64_t last_dim(const Emit *e, int n) {
  Shape s = node(e, n)->shape;
  return s.rank ? s.d[s.rank - 1] : 1;
}
static const char *ctype(const Emit *e, int n) { return node(e, n)->dtype == DT_I32 ? "int32_t" : "float"; }

static bool is_leaf(Op op) {
  return op == OP_INPUT || op == OP_PARAM || op == OP_STATE || op == OP_SCALAR || op == OP_CONST;
}

// Ops computed inline at any flat index.
static bool is_pointwise(Op op) {
  switch (op) {
  case OP_NEG: case OP_EXP: case OP_LOG: case OP_TANH: case OP_SQRT: case OP_RSQRT: case OP_RELU:
  case OP_GELU: case OP_SILU: case OP_DROPOUT: case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV:
  case OP_RELU_BWD: case OP_GELU_BWD: case OP_SILU_BWD: case OP_RESHAPE: case OP_PERMUTE:
  case OP_BROADCAST: case OP_SLICE: case OP_SLICE_BWD: case OP_CONCAT:
    return true;
  default:
    return false;
  }
}

// A RESHAPE outside every step is a view: it lives where its input lives.
static int canon(const Emit *e, int n) {
  while (node(e, n)->op == OP_RESHAPE && !e->in_step[n] && e->f->step_of[n] < 0)
    n = node(e, n)->in[0];
  return n;
}

static int64_t offset(const Emit *e, int n) { return e->m->offset[n]; }

// Is node c's value readable from memory right now?
static bool in_memory(const Emit *e, int c) {
  Op op = node(e, c)->op;
  if (e->written[c])
    return true;
  if (op == OP_CONST)
    return false;
  if (is_leaf(op))
    return true;
  return !e->in_step[c] && offset(e, c) >= 0;
}

static bool has_target(const Emit *e, int c) { return offset(e, c) >= 0 || e->scratch[c] || e->host[c] >= 0; }

static void flag(Emit *e, bool *set, int n) {
  if (!set[n]) {
    set[n] = true;
    e->flagged = true;
  }
}

//
// Lines and scopes.
//

static void line(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line(Emit *e, const char *fmt, ...) {
  bput(&e->body, "%*s", 2 * e->indent, "");
  va_list ap;
  va_start(ap, fmt);
  bvput(&e->body, fmt, ap);
  va_end(ap);
  bput(&e->body, "\n");
}

static void note(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(Emit *e, const char *fmt, ...) {
  bput(&e->notes, "//   ");
  va_list ap;
  va_start(ap, fmt);
  bvput(&e->notes, fmt, ap);
  va_end(ap);
  bput(&e->notes, "\n");
}

// A line ending in "{" (or a bare "{"), and a new scope for memoised values.
static void enter(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void enter(Emit *e, const char *fmt, ...) {
  bput(&e->body, "%*s", 2 * e->indent, "");
  va_list ap;
  va_start(ap, fmt);
  bvput(&e->body, fmt, ap);
  va_end(ap);
  bput(&e->body, "%s{\n", e->body.s[e->body.len - 1] == ' ' ? "" : " ");
  e->indent++;
  e->depth++;
}

static void leave(Emit *e) {
  while (e->nmemo && e->memo[e->nmemo - 1].depth >= e->depth)
    e->nmemo--;
  while (e->nixm && e->ixm[e->nixm - 1].depth >= e->depth)
    e->nixm--;
  e->depth--;
  e->indent--;
  line(e, "}");
}

static void par_for(Emit *e, int64_t work, const char *schedule) {
  if (work >= PAR_MIN) {
    line(e, "#pragma omp parallel for num_threads(h->nthreads) schedule(%s)", schedule);
    e->uses_h = true;
  }
}

static const char *str(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static const char *str(Emit *e, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return arena_strdup(e->a, buf);
}

// A float literal that reads back as the same float, in as few digits as that takes.
static const char *flit(Emit *e, double v) {
  if (isnan(v))
    return "NAN";
  if (isinf(v))
    return v > 0 ? "INFINITY" : "(-INFINITY)";
  char buf[64];
  for (int prec = 1; prec <= 9; prec++) {
    snprintf(buf, sizeof buf, "%.*g", prec, (double)(float)v);
    if (strtof(buf, NULL) == (float)v)
      break;
  }
  bool frac = strpbrk(buf, ".e") != NULL;
  return str(e, "%s%s%sf%s", v < 0 ? "(" : "", buf, frac ? "" : ".0", v < 0 ? ")" : "");
}

// A double literal that reads back as the same double, in as few digits as that takes.
static const char *dlit(Emit *e, double v) {
  char buf[64];
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (strtod(buf, NULL) == v)
      break;
  }
  if (!strpbrk(buf, ".en"))
    strcat(buf, ".0");
  return str(e, "%s", buf);
}

//
// Buffers: every node read or written through memory gets one pointer, declared at the top of its
// kernel: its arena slot, a scratch buffer, or (a GEMM root) the buffer of its epilogue's output.
//

static const char *shape_txt(Emit *e, int n) {
  char buf[128];
  return str(e, "%s%s", dtype_name(node(e, n)->dtype), shape_str(node(e, n)->shape, buf, sizeof buf));
}

static const char *node_label(Emit *e, int n) {
  const IrNode *nd = node(e, n);
  return str(e, "%%%d %s%s%s", n, op_name(nd->op), nd->name ? " " : "", nd->name ? nd->name : "");
}

// Marks c's pointer as used; the declarations are written, in node order, when the kernel is done.
static int ptr(Emit *e, int c) {
  if (e->declared[c])
    return c;
  if (offset(e, c) < 0 && e->host[c] < 0 && !e->scratch[c])
    fail(e, "node %d (%s) has no buffer in step %s", c, op_name(node(e, c)->op), e->f->steps[e->si].name);
  if (e->host[c] >= 0)
    ptr(e, e->host[c]);
  e->declared[c] = true;
  e->decls[e->ndecls++] = c;
  return c;
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

// The pointer declarations of the kernel (arena slots and scratch buffers, then the GEMMs that write
// into their epilogue's output) and the frees of its scratch buffers.
static void write_decls(Emit *e, Buf *decl, Buf *frees) {
  qsort(e->decls, (size_t)e->ndecls, sizeof *e->decls, cmp_int);
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < e->ndecls; i++) {
      int c = e->decls[i];
      const char *t = ctype(e, c);
      if (pass == 0 && offset(e, c) >= 0) {
        bput(decl, "  %s *const b%d = (%s *)(arena + %lld); // %s %s\n", t, c, t, (long long)offset(e, c),
             node_label(e, c), shape_txt(e, c));
      } else if (pass == 0 && e->host[c] < 0) {
        bput(decl, "  %s *const b%d = mdl_scratch(%lld); // %s %s, kept in this kernel\n", t, c,
             (long long)numel(e, c) * 4, node_label(e, c), shape_txt(e, c));
        bput(frees, "  free(b%d);\n", c);
      } else if (pass == 1 && offset(e, c) < 0 && e->host[c] >= 0) {
        bput(decl, "  float *const b%d = b%d; // %s %s: the GEMM writes into its epilogue's output\n", c,
             e->host[c], node_label(e, c), shape_txt(e, c));
      }
    }
}

//
// Memoised values and index variables of the current scopes.
//

static const char *memo_get(Emit *e, int n, const char *ix) {
  for (int i = e->nmemo - 1; i >= 0; i--)
    if (e->memo[i].node == n && strcmp(e->memo[i].ix, ix) == 0)
      return e->memo[i].name;
  return NULL;
}

static void memo_put(Emit *e, int n, const char *ix, const char *name) {
  if (e->nmemo == e->capmemo) {
    e->capmemo = e->capmemo ? 2 * e->capmemo : 64;
    e->memo = realloc(e->memo, sizeof *e->memo * (size_t)e->capmemo);
    if (!e->memo)
      exit(1);
  }
  e->memo[e->nmemo++] = (Memo){n, arena_strdup(e->a, ix), name, e->depth};
}

// A variable holding the int64 index expression `expr` (or expr itself when it is a name or number).
static const char *ix_var(Emit *e, const char *expr) {
  bool simple = true;
  for (const char *p = expr; *p; p++)
    simple &= (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_';
  if (simple)
    return arena_strdup(e->a, expr);
  for (int i = e->nixm - 1; i >= 0; i--)
    if (strcmp(e->ixm[i].expr, expr) == 0)
      return e->ixm[i].name;
  const char *name = str(e, "j%d", ++e->fresh);
  line(e, "const int64_t %s = %s;", name, expr);
  if (e->nixm == e->capixm) {
    e->capixm = e->capixm ? 2 * e->capixm : 64;
    e->ixm = realloc(e->ixm, sizeof *e->ixm * (size_t)e->capixm);
    if (!e->ixm)
      exit(1);
  }
  e->ixm[e->nixm++] = (IxMemo){arena_strdup(e->a, expr), name, e->depth};
  return name;
}

// "(ix / div % size)", leaving out what is 1 or redundant: the coordinate of one block of axes.
static void coord(Buf *b, const char *ix, int64_t div, int64_t size, bool leftmost) {
  if (div == 1 && leftmost)
    bput(b, "%s", ix);
  else if (div == 1)
    bput(b, "%s %% %lld", ix, (long long)size);
  else if (leftmost)
    bput(b, "%s / %lld", ix, (long long)div);
  else
    bput(b, "%s / %lld %% %lld", ix, (long long)div, (long long)size);
}

static const char *buf_str(Emit *e, Buf *b) {
  const char *s = arena_strdup(e->a, b->s ? b->s : "0");
  free(b->s);
  return s;
}

// The flat index into a tensor of shape `in` of element `ix` of a tensor of shape `out` under numpy
// broadcasting. Adjacent axes that are all kept or all broadcast are merged, so a bias read from
// [N,C] becomes "i % C" and a per-row value read from [N,C] becomes "i / C".
static const char *ix_bcast(Emit *e, Shape out, Shape in, const char *ix) {
  if (shape_numel(in) == 1)
    return "0";
  if (shape_numel(in) == shape_numel(out))
    return ix;
  struct {
    bool kept;
    int64_t size;
  } blk[IR_MAX_RANK];
  int nb = 0;
  for (int k = 0; k < out.rank; k++) {
    if (out.d[k] == 1)
      continue;
    int j = k - (out.rank - in.rank);
    bool kept = j >= 0 && in.d[j] != 1;
    if (nb && blk[nb - 1].kept == kept)
      blk[nb - 1].size *= out.d[k];
    else
      blk[nb].kept = kept, blk[nb++].size = out.d[k];
  }
  Buf b = {0};
  int64_t out_inner = 1, in_inner = 1;
  for (int t = nb - 1; t >= 0; t--) {
    if (blk[t].kept) {
      if (b.len)
        bput(&b, " + ");
      bool paren = in_inner != 1 && (out_inner != 1 || t != 0);
      bput(&b, "%s", paren ? "(" : "");
      coord(&b, ix, out_inner, blk[t].size, t == 0);
      bput(&b, "%s", paren ? ")" : "");
      if (in_inner != 1)
        bput(&b, " * %lld", (long long)in_inner);
      in_inner *= blk[t].size;
    }
    out_inner *= blk[t].size;
  }
  return ix_var(e, buf_str(e, &b));
}

static const char *ix_permute(Emit *e, const IrNode *nd, Shape in, const char *ix) {
  Shape out = nd->shape;
  int64_t stride[IR_MAX_RANK];
  for (int k = in.rank - 1; k >= 0; k--)
    stride[k] = k == in.rank - 1 ? 1 : stride[k + 1] * in.d[k + 1];
  int first = 0;
  while (first < out.rank && out.d[first] == 1)
    first++;
  Buf b = {0};
  int64_t div = 1;
  for (int k = out.rank - 1; k >= 0; k--) {
    if (out.d[k] == 1)
      continue;
    if (b.len)
      bput(&b, " + ");
    int64_t s = stride[nd->ia[k]];
    bput(&b, "%s", s != 1 ? "(" : "");
    coord(&b, ix, div, out.d[k], k == first);
    bput(&b, "%s", s != 1 ? ")" : "");
    if (s != 1)
      bput(&b, " * %lld", (long long)s);
    div *= out.d[k];
  }
  return ix_var(e, buf_str(e, &b));
}

static int64_t span(Shape s, int from, int to) {
  int64_t n = 1;
  for (int i = from; i < to; i++)
    n *= s.d[i];
  return n;
}

// SLICE: element ix of the slice -> its index in the full input.
static const char *ix_slice(Emit *e, const IrNode *nd, Shape full, const char *ix) {
  int ax = (int)nd->ia[0];
  int64_t start = nd->ia[1], len = nd->ia[2] - start, flen = full.d[ax];
  int64_t outer = span(full, 0, ax), inner = span(full, ax + 1, full.rank);
  if (outer == 1)
    return start ? ix_var(e, str(e, "%s + %lld", ix, (long long)(start * inner))) : ix;
  return ix_var(e, str(e, "%s / %lld * %lld + %lld + %s %% %lld", ix, (long long)(len * inner),
                       (long long)(flen * inner), (long long)(start * inner), ix, (long long)(len * inner)));
}

// The coordinate along `ax` of element ix of a tensor of shape s.
static const char *ix_axis(Emit *e, Shape s, int ax, const char *ix) {
  Buf b = {0};
  coord(&b, ix, span(s, ax + 1, s.rank), s.d[ax], span(s, 0, ax) == 1);
  return ix_var(e, buf_str(e, &b));
}

// Element (outer o, axis coordinate c - at, inner) of a part of length len along ax, for element ix
// of the whole (shape s): the index into the part, or 0 when c is outside [at, at + len).
static const char *ix_part(Emit *e, Shape s, int ax, const char *ix, const char *c, int64_t at, int64_t len) {
  int64_t inner = span(s, ax + 1, s.rank), outer = span(s, 0, ax), flen = s.d[ax];
  Buf b = {0};
  bput(&b, "%s >= %lld && %s < %lld ? ", c, (long long)at, c, (long long)(at + len));
  if (outer > 1)
    bput(&b, "%s / %lld * %lld + ", ix, (long long)(flen * inner), (long long)(len * inner));
  bput(&b, "(%s - %lld)", c, (long long)at);
  if (inner > 1)
    bput(&b, " * %lld + %s %% %lld", (long long)inner, ix, (long long)inner);
  bput(&b, " : 0");
  return ix_var(e, buf_str(e, &b));
}

//
// The inline evaluator.
//

static const char *val(Emit *e, int n, const char *ix);

// Reading node c at ix from memory: records reads that the chosen layout must allow.
static void note_read(Emit *e, int c, const char *ix) {
  bool at_post = e->post_anchor == c && strcmp(ix, e->post_ix) == 0;
  if (e->in_step[c] && e->grp[c] >= 0 && !at_post && offset(e, c) < 0)
    flag(e, e->spill, c);
}

static const char *pointwise_expr(Emit *e, int c, const char *ix) {
  const IrNode *nd = node(e, c);
  const IrNode *x0 = nd->nin > 0 ? node(e, nd->in[0]) : NULL, *x1 = nd->nin > 1 ? node(e, nd->in[1]) : NULL;
  switch (nd->op) {
  case OP_NEG: return str(e, "-%s", val(e, nd->in[0], ix));
  case OP_EXP: return str(e, "expf(%s)", val(e, nd->in[0], ix));
  case OP_LOG: return str(e, "logf(%s)", val(e, nd->in[0], ix));
  case OP_TANH: return str(e, "tanhf(%s)", val(e, nd->in[0], ix));
  case OP_SQRT: return str(e, "sqrtf(%s)", val(e, nd->in[0], ix));
  case OP_RSQRT: return str(e, "1.0f / sqrtf(%s)", val(e, nd->in[0], ix));
  case OP_RELU: {
    const char *a = val(e, nd->in[0], ix);
    return str(e, "%s > 0.0f ? %s : 0.0f", a, a);
  }
  case OP_GELU: return str(e, "mdl_gelu(%s)", val(e, nd->in[0], ix));
  case OP_SILU: return str(e, "mdl_silu(%s)", val(e, nd->in[0], ix));
  case OP_DROPOUT:
    e->uses_h = true;
    return str(e, "mdl_dropout(h->seed, %lld, %s, %s, %s)", (long long)nd->ia[0], ix, dlit(e, nd->fa[0]),
               val(e, nd->in[0], ix));
  case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_RELU_BWD: case OP_GELU_BWD: case OP_SILU_BWD: {
    const char *a = val(e, nd->in[0], ix_bcast(e, nd->shape, x0->shape, ix));
    const char *b = val(e, nd->in[1], ix_bcast(e, nd->shape, x1->shape, ix));
    switch (nd->op) {
    case OP_ADD: return str(e, "%s + %s", a, b);
    case OP_SUB: return str(e, "%s - %s", a, b);
    case OP_MUL: return str(e, "%s * %s", a, b);
    case OP_DIV: return str(e, "%s / %s", a, b);
    case OP_RELU_BWD: return str(e, "%s > 0.0f ? %s : 0.0f", a, b);
    case OP_GELU_BWD: return str(e, "mdl_gelu_grad(%s) * %s", a, b);
    default: return str(e, "mdl_silu_grad(%s, %s)", a, b);
    }
  }
  case OP_RESHAPE: return val(e, nd->in[0], ix);
  case OP_BROADCAST: return val(e, nd->in[0], ix_bcast(e, nd->shape, x0->shape, ix));
  case OP_PERMUTE: return val(e, nd->in[0], ix_permute(e, nd, x0->shape, ix));
  case OP_SLICE: return val(e, nd->in[0], ix_slice(e, nd, x0->shape, ix));
  case OP_SLICE_BWD: {
    int ax = (int)nd->ia[0];
    const char *c = ix_axis(e, nd->shape, ax, ix);
    const char *j = ix_part(e, nd->shape, ax, ix, c, nd->ia[1], nd->ia[2] - nd->ia[1]);
    return str(e, "%s >= %lld && %s < %lld ? %s : %s", c, (long long)nd->ia[1], c, (long long)nd->ia[2],
               val(e, nd->in[0], j), nd->dtype == DT_I32 ? "0" : "0.0f");
  }
  case OP_CONCAT: {
    int ax = (int)nd->ia[0];
    const char *c = ix_axis(e, nd->shape, ax, ix);
    const char *v[64];
    int64_t at = 0, ends[64];
    if (nd->nin > 64) {
      fail(e, "concat of %d inputs", nd->nin);
      return "0";
    }
    for (int k = 0; k < nd->nin; k++) {
      int64_t len = node(e, nd->in[k])->shape.d[ax];
      v[k] = val(e, nd->in[k], ix_part(e, nd->shape, ax, ix, c, at, len));
      at += len;
      ends[k] = at;
    }
    Buf b = {0};
    for (int k = 0; k + 1 < nd->nin; k++)
      bput(&b, "%s < %lld ? %s : ", c, (long long)ends[k], v[k]);
    bput(&b, "%s", v[nd->nin - 1]);
    return buf_str(e, &b);
  }
  default:
    fail(e, "%s is not pointwise", op_name(nd->op));
    return "0";
  }
}

// The value of node n at flat index ix, as a C expression; emits what computes it. A step output
// met at the current loop's own index is stored on the way.
static const char *val(Emit *e, int n, const char *ix) {
  int c = canon(e, n);
  const IrNode *nd = node(e, c);
  if (nd->op == OP_CONST)
    return flit(e, nd->fa[0]);
  if (numel(e, c) == 1)
    ix = "0";
  const char *hit = memo_get(e, c, ix);
  if (hit)
    return hit;
  const char *name = str(e, "v%d_%s", c, ix);
  if (in_memory(e, c)) {
    note_read(e, c, ix);
    line(e, "const %s %s = b%d[%s];", ctype(e, c), name, ptr(e, c), ix);
  } else if (e->in_step[c] && is_pointwise(nd->op)) {
    const char *expr = pointwise_expr(e, c, ix);
    line(e, "const %s %s = %s;", ctype(e, c), name, expr);
    bool own = e->loop_ix && numel(e, c) == e->loop_n && (strcmp(ix, e->loop_ix) == 0 || e->loop_n == 1);
    if (has_target(e, c) && !e->stored[c] && own) {
      line(e, "b%d[%s] = %s;", ptr(e, c), ix, name);
      e->stored[c] = true;
      e->phase_nodes[e->nphase++] = c;
    }
  } else if (e->in_step[c] && e->grp[c] >= 0) {
    // An anchor of this step that is not in memory (yet): read inside its own loop at another index,
    // or after it while only a local or a row of it existed. Flag it; the next pass lays it out.
    if (e->post_inloop && e->post_anchor == c && e->cur_q >= 0)
      flag(e, e->post_bad, e->cur_q);
    else
      flag(e, e->spill, c);
    return "0.0f";
  } else {
    fail(e, "step %s reads node %d (%s), which no earlier step wrote", e->f->steps[e->si].name, c,
         op_name(nd->op));
    return "0";
  }
  memo_put(e, c, ix, name);
  return name;
}

//
// Phases: a loop nest after which its stores count as written.
//

static void phase_begin(Emit *e) { e->nphase = 0; }

static void phase_done(Emit *e, int n) {
  e->written[n] = true;
  e->stored[n] = true;
}

static void phase_end(Emit *e) {
  for (int i = 0; i < e->nphase; i++)
    e->written[e->phase_nodes[i]] = true;
  e->nphase = 0;
}

// One elementwise loop over `numel` elements writing nodes[0..k) (all of that size). post_anchor
// names the GEMM whose epilogue this is, or -1.
static void pw_loop(Emit *e, const int *nodes, int k, int64_t numel, int post_anchor) {
  phase_begin(e);
  Buf b = {0};
  for (int t = 0; t < k; t++)
    bput(&b, "%s%%%d", t ? " " : "", nodes[t]);
  note(e, "elementwise over %lld: %s", (long long)numel, b.s ? b.s : "");
  free(b.s);
  par_for(e, numel, "static");
  enter(e, "for (int64_t i = 0; i < %lld; i++)", (long long)numel);
  e->loop_ix = "i";
  e->loop_n = numel;
  e->post_anchor = post_anchor;
  e->post_ix = "i";
  e->post_inloop = false;
  for (int t = 0; t < k; t++) {
    e->cur_q = nodes[t];
    const char *v = val(e, nodes[t], "i");
    if (!e->stored[nodes[t]]) {
      line(e, "b%d[i] = %s;", ptr(e, nodes[t]), v);
      e->stored[nodes[t]] = true;
      e->phase_nodes[e->nphase++] = nodes[t];
    }
  }
  leave(e);
  e->loop_ix = NULL;
  e->post_anchor = -1;
  e->cur_q = -1;
  phase_end(e);
}

// Elementwise loops for a list of nodes, one per distinct size, in order of first appearance.
static void pw_loops(Emit *e, const int *nodes, int k, int post_anchor) {
  bool *done = xcalloc((size_t)k, sizeof *done);
  int *same = xcalloc((size_t)k, sizeof *same);
  for (int t = 0; t < k; t++) {
    if (done[t])
      continue;
    int ns = 0;
    for (int u = t; u < k; u++)
      if (!done[u] && numel(e, nodes[u]) == numel(e, nodes[t])) {
        same[ns++] = nodes[u];
        done[u] = true;
      }
    pw_loop(e, same, ns, numel(e, nodes[t]), post_anchor);
  }
  free(done);
  free(same);
}

// The node whose memory holds n's elements in n's flat order (n itself, its view's source, or the
// source of unwritten reshapes of this step), or -1.
static int mem_alias(Emit *e, int n) {
  for (;;) {
    int c = canon(e, n);
    if (in_memory(e, c))
      return c;
    if (!(e->in_step[c] && node(e, c)->op == OP_RESHAPE))
      return -1;
    n = node(e, c)->in[0];
  }
}

// Node n must be in memory before the next group: returns the node whose buffer to read, queueing
// an elementwise loop when n is a pointwise node of this step or a constant.
static int need(Emit *e, int n) {
  int a = mem_alias(e, n);
  if (a >= 0)
    return a;
  int c = canon(e, n);
  Op op = node(e, c)->op;
  if (!(op == OP_CONST || (e->in_step[c] && is_pointwise(op)))) {
    if (e->in_step[c] && e->grp[c] >= 0) {
      flag(e, e->spill, c); // an anchor of this step kept as a local: whole in the next pass
      e->scratch[c] = true;
      return c;
    }
    fail(e, "step %s needs node %d (%s) in memory", e->f->steps[e->si].name, c, op_name(op));
    return c;
  }
  for (int i = 0; i < e->npending; i++)
    if (e->pending[i] == c)
      return c;
  if (offset(e, c) < 0)
    e->scratch[c] = true;
  e->pending[e->npending++] = c;
  return c;
}

static void flush(Emit *e) {
  if (e->npending)
    pw_loops(e, e->pending, e->npending, -1);
  e->npending = 0;
}

// Rows of a matrix in memory: row r starts at base + r * stride.
typedef struct {
  const char *base;
  int64_t stride;
} Rows;

// n's rows (last axis) in memory: n itself, or an unwritten SLICE of the last axis of a tensor in
// memory (q, k, v out of one qkv buffer), read with that tensor's stride.
static Rows rows_of(Emit *e, int n) {
  int a = mem_alias(e, n);
  int c = canon(e, n);
  const IrNode *nd = node(e, c);
  if (a < 0 && e->in_step[c] && nd->op == OP_SLICE && offset(e, c) < 0 && nd->ia[0] == nd->shape.rank - 1) {
    int src = mem_alias(e, nd->in[0]);
    if (src >= 0) {
      int64_t s = last_dim(e, src);
      return (Rows){nd->ia[1] ? str(e, "b%d + %lld", ptr(e, src), (long long)nd->ia[1]) : str(e, "b%d", ptr(e, src)),
                    s};
    }
  }
  return (Rows){str(e, "b%d", ptr(e, need(e, n))), last_dim(e, n)};
}

//
// Groups: which anchors emit together, and in what order.
//

// Follows RESHAPEs (views and reshapes of this step) up from n.
static int through_reshapes(Emit *e, int n) {
  while (node(e, n)->op == OP_RESHAPE && (e->in_step[n] || e->f->step_of[n] < 0))
    n = node(e, n)->in[0];
  return n;
}

static bool same_inputs(const Emit *e, const IrNode *a, const IrNode *b) {
  if (a->nin != b->nin)
    return false;
  for (int k = 0; k < a->nin; k++)
    if (canon(e, a->in[k]) != canon(e, b->in[k]))
      return false;
  return true;
}

static void group_add(Group *gr, int n) { gr->mem[gr->nmem++] = n; }

// The LM-head pattern around cross_entropy_bwd node ceb: logits = x @ W (or W^T), the loss and
// its gradient of the same logits, and dx = dlogits @ W^T (W), dW = dlogits^T x (x^T dlogits). Only
// when the logits and dlogits live nowhere else.
static bool match_lmhead(Emit *e, int ceb, Group *gr) {
  const IrNode *b = node(e, ceb);
  int mm = through_reshapes(e, b->in[0]);
  if (!e->in_step[mm] || node(e, mm)->op != OP_MATMUL)
    return false;
  const IrNode *m = node(e, mm);
  if (m->ia[0] || node(e, m->in[0])->shape.rank != 2 || node(e, m->in[1])->shape.rank != 2)
    return false;
  int x = canon(e, m->in[0]), w = canon(e, m->in[1]);
  bool tb = m->ia[1];
  int ce = -1, dx = -1, dw = -1;
  for (int k = 0; k < e->f->steps[e->si].nnodes; k++) {
    int n = e->f->steps[e->si].nodes[k];
    const IrNode *nd = node(e, n);
    if (nd->op == OP_CROSS_ENTROPY && through_reshapes(e, nd->in[0]) == mm &&
        canon(e, nd->in[1]) == canon(e, b->in[1]))
      ce = n;
    if (nd->op != OP_MATMUL || n == mm)
      continue;
    int a0 = through_reshapes(e, nd->in[0]), a1 = through_reshapes(e, nd->in[1]);
    if (a0 == ceb && !nd->ia[0] && nd->ia[1] == !tb && canon(e, nd->in[1]) == w)
      dx = n;
    if (tb && a0 == ceb && nd->ia[0] && !nd->ia[1] && canon(e, nd->in[1]) == x)
      dw = n;
    if (!tb && a1 == ceb && nd->ia[0] && !nd->ia[1] && canon(e, nd->in[0]) == x)
      dw = n;
  }
  if (ce < 0 || dx < 0 || dw < 0)
    return false;
  // Every consumer of the logits and of dlogits (through reshapes) must be one of the pattern.
  for (int n = mm; n < e->g->n; n++) {
    const IrNode *nd = node(e, n);
    for (int k = 0; k < nd->nin; k++) {
      int src = through_reshapes(e, nd->in[k]);
      if ((src != mm && src != ceb) || n == ce || n == ceb || n == dx || n == dw)
        continue;
      if (nd->op == OP_RESHAPE && (e->in_step[n] || e->f->step_of[n] < 0) && offset(e, n) < 0 &&
          (e->in_step[n] || canon(e, n) != n))
        continue;
      return false;
    }
  }
  if (offset(e, mm) >= 0 || offset(e, ceb) >= 0)
    return false;
  *gr = (Group){.kind = G_LMHEAD, .mm = mm, .ce = ce, .ceb = ceb, .dx = dx, .dw = dw, .x = m->in[0], .w = m->in[1],
                .tgt = b->in[1], .dloss = b->in[2], .tb = tb};
  return true;
}

static bool groups_build(Emit *e, bool split_all) {
  const Step *st = &e->f->steps[e->si];
  e->ngroups = 0;
  e->groups = arena_alloc(e->a, sizeof(Group) * (size_t)(st->nnodes + 1));
  for (int k = 0; k < st->nnodes; k++)
    e->grp[st->nodes[k]] = -1;
  for (int k = 0; k < st->nnodes && !split_all; k++) {
    int n = st->nodes[k];
    Group lm;
    if (e->in_step[n] && e->grp[n] < 0 && node(e, n)->op == OP_CROSS_ENTROPY_BWD && match_lmhead(e, n, &lm)) {
      lm.mem = arena_alloc(e->a, sizeof(int) * 5);
      int mem[5] = {lm.mm, lm.ce, lm.ceb, lm.dx, lm.dw};
      for (int i = 0; i < 5; i++) {
        group_add(&lm, mem[i]);
        e->grp[mem[i]] = e->ngroups;
      }
      lm.ext = arena_alloc(e->a, sizeof(int) * 4);
      lm.ext[0] = lm.x, lm.ext[1] = lm.w, lm.ext[2] = lm.tgt, lm.ext[3] = lm.dloss;
      lm.n_ext = 4;
      e->groups[e->ngroups++] = lm;
    }
  }
  for (int k = 0; k < st->nnodes; k++) {
    int n = st->nodes[k];
    const IrNode *nd = node(e, n);
    if (!e->in_step[n] || e->grp[n] >= 0 || is_pointwise(nd->op))
      continue;
    GroupKind kind = G_SINGLE;
    switch (nd->op) {
    case OP_LAYERNORM_BWD: case OP_RMSNORM_BWD: kind = G_NORM_BWD; break;
    case OP_ATTENTION_BWD: kind = G_ATTN_BWD; break;
    case OP_CROSS_ENTROPY: case OP_CROSS_ENTROPY_BWD: kind = G_CE; break;
    case OP_GRAD_NORM: case OP_ADAMW: kind = G_OPT; break;
    default: break;
    }
    Group *gr = &e->groups[e->ngroups];
    *gr = (Group){.kind = kind, .mem = arena_alloc(e->a, sizeof(int) * (size_t)st->nnodes)};
    group_add(gr, n);
    e->grp[n] = e->ngroups;
    for (int j = k + 1; j < st->nnodes && kind != G_SINGLE && !split_all; j++) {
      int n2 = st->nodes[j];
      const IrNode *m = node(e, n2);
      if (!e->in_step[n2] || e->grp[n2] >= 0)
        continue;
      bool join = false;
      if (kind == G_NORM_BWD)
        join = m->op == nd->op && same_inputs(e, nd, m) && m->fa[0] == nd->fa[0];
      else if (kind == G_ATTN_BWD)
        join = m->op == nd->op && same_inputs(e, nd, m) && m->fa[0] == nd->fa[0] && m->ia[0] == nd->ia[0] &&
               m->ia[1] == nd->ia[1];
      else if (kind == G_CE)
        join = (m->op == OP_CROSS_ENTROPY || m->op == OP_CROSS_ENTROPY_BWD) && m->op != nd->op &&
               gr->nmem == 1 && canon(e, m->in[0]) == canon(e, nd->in[0]) && canon(e, m->in[1]) == canon(e, nd->in[1]);
      else if (kind == G_OPT)
        join = m->op == OP_GRAD_NORM || m->op == OP_ADAMW;
      if (join) {
        group_add(gr, n2);
        e->grp[n2] = e->ngroups;
      }
    }
    int nin = 0;
    for (int i = 0; i < gr->nmem; i++)
      nin += node(e, gr->mem[i])->nin;
    gr->ext = arena_alloc(e->a, sizeof(int) * (size_t)(nin + 1));
    for (int i = 0; i < gr->nmem; i++) {
      const IrNode *m = node(e, gr->mem[i]);
      for (int j = 0; j < m->nin; j++)
        if (e->grp[canon(e, m->in[j])] != e->ngroups || !e->in_step[canon(e, m->in[j])])
          gr->ext[gr->n_ext++] = m->in[j];
    }
    e->ngroups++;
  }
  return true;
}

// The groups node n depends on directly (through pointwise nodes and views of this step).
static void direct_deps(Emit *e, int n, bool *deps, int *stamp, int mark) {
  int c = canon(e, n);
  if (!e->in_step[c] || stamp[c] == mark)
    return;
  stamp[c] = mark;
  if (e->grp[c] >= 0) {
    deps[e->grp[c]] = true;
    return;
  }
  for (int k = 0; k < node(e, c)->nin; k++)
    direct_deps(e, node(e, c)->in[k], deps, stamp, mark);
}

// Orders the groups (dependencies first, then the lowest member id). A group whose members depend
// on one another through the step is split into single anchors.
static bool groups_order(Emit *e) {
  int *stamp = xcalloc((size_t)e->g->n, sizeof *stamp);
  for (int attempt = 0; attempt < 2; attempt++) {
    groups_build(e, attempt == 1);
    int ng = e->ngroups, mark = 0;
    e->gdep = arena_alloc(e->a, sizeof(bool *) * (size_t)(ng + 1));
    for (int a = 0; a < ng; a++) {
      e->gdep[a] = arena_alloc(e->a, sizeof(bool) * (size_t)(ng + 1));
      for (int k = 0; k < e->groups[a].n_ext; k++)
        direct_deps(e, e->groups[a].ext[k], e->gdep[a], stamp, ++mark);
    }
    for (int k = 0; k < ng; k++) // transitive closure
      for (int a = 0; a < ng; a++)
        if (e->gdep[a][k])
          for (int c = 0; c < ng; c++)
            e->gdep[a][c] |= e->gdep[k][c];
    bool cyclic = false;
    for (int a = 0; a < ng; a++)
      cyclic |= e->gdep[a][a];
    if (cyclic)
      continue;
    e->order = arena_alloc(e->a, sizeof(int) * (size_t)(ng + 1));
    bool *done = xcalloc((size_t)ng + 1, sizeof *done);
    for (int k = 0; k < ng; k++) {
      int best = -1;
      for (int a = 0; a < ng && best < 0; a++) {
        bool ready = !done[a];
        for (int b = 0; b < ng && ready; b++)
          ready = !e->gdep[a][b] || done[b];
        if (ready)
          best = a;
      }
      done[best] = true;
      e->order[k] = best;
    }
    free(done);
    free(stamp);
    return true;
  }
  free(stamp);
  return fail(e, "step %s: its anchors depend on one another in a cycle", e->f->steps[e->si].name);
}

// Outputs of the step that can be computed in (or right after) group gi's loop: pointwise, unwritten,
// of `n` float elements, depending on gi and on no group not yet emitted.
static int post_set(Emit *e, int gi, int64_t n, const bool *emitted, int *q) {
  const Step *st = &e->f->steps[e->si];
  int nq = 0, *stamp = xcalloc((size_t)e->g->n, sizeof *stamp);
  bool *deps = xcalloc((size_t)e->ngroups + 1, sizeof *deps);
  for (int k = 0; k < st->nnodes; k++) {
    int c = st->nodes[k];
    if (!e->in_step[c] || e->grp[c] >= 0 || !is_pointwise(node(e, c)->op) || offset(e, c) < 0 || e->written[c] ||
        e->post_bad[c] || numel(e, c) != n || node(e, c)->dtype != DT_F32)
      continue;
    memset(deps, 0, sizeof *deps * (size_t)e->ngroups);
    direct_deps(e, c, deps, stamp, k + 1);
    bool ok = deps[gi];
    for (int b = 0; b < e->ngroups && ok; b++)
      ok = !deps[b] || b == gi || emitted[b];
    if (ok)
      q[nq++] = c;
  }
  free(stamp);
  free(deps);
  return nq;
}

// Evaluates the post outputs inside the anchor's own loop, where the anchor's value at index ix is
// the expression y.
static void post_inloop(Emit *e, int anchor, const int *q, int nq, const char *ix, int64_t n, const char *y) {
  e->loop_ix = ix;
  e->loop_n = n;
  e->post_anchor = anchor;
  e->post_ix = ix;
  e->post_inloop = true;
  memo_put(e, anchor, numel(e, anchor) == 1 ? "0" : ix, y);
  for (int t = 0; t < nq; t++) {
    e->cur_q = q[t];
    val(e, q[t], ix);
  }
  e->post_anchor = -1;
  e->post_inloop = false;
  e->cur_q = -1;
}

//
// Loops over rows with per-thread scratch rows.
//

typedef struct {
  const char *name;
  int64_t n; // floats
} Tmp;

static void rows_open(Emit *e, const char *var, int64_t rows, int64_t work, const Tmp *tmp, int ntmp) {
  bool par = work >= PAR_MIN;
  if (ntmp) {
    if (par) {
      line(e, "#pragma omp parallel num_threads(h->nthreads)");
      e->uses_h = true;
    }
    enter(e, "%s", "");
    for (int i = 0; i < ntmp; i++)
      line(e, "float *%s = mdl_scratch(%lld * sizeof(float));", tmp[i].name, (long long)tmp[i].n);
    if (par)
      line(e, "#pragma omp for schedule(static)");
  } else {
    par_for(e, work, "static");
  }
  enter(e, "for (int64_t %s = 0; %s < %lld; %s++)", var, var, (long long)rows, var);
}

static void rows_close(Emit *e, const Tmp *tmp, int ntmp) {
  leave(e);
  if (ntmp) {
    for (int i = 0; i < ntmp; i++)
      line(e, "free(%s);", tmp[i].name);
    leave(e);
  }
}

// Inside a row loop over r: a pointer named `name` to row r of x (cols wide), computed inline into
// the per-thread row `tmp` when x is not in memory.
static void row_ptr(Emit *e, int x, const char *name, const char *tmp, int64_t cols) {
  int a = mem_alias(e, x);
  if (a >= 0) {
    line(e, "const %s *%s = b%d + r * %lld;", ctype(e, a), name, ptr(e, a), (long long)cols);
    return;
  }
  enter(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
  line(e, "const int64_t ix = r * %lld + j;", (long long)cols);
  const char *save = e->loop_ix;
  int64_t save_n = e->loop_n;
  e->loop_ix = "ix";
  e->loop_n = numel(e, x);
  line(e, "%s[j] = %s;", tmp, val(e, x, "ix"));
  e->loop_ix = save;
  e->loop_n = save_n;
  leave(e);
  line(e, "const float *%s = %s;", name, tmp);
}

// Is x read inline (not in memory)? Then the row loop needs a scratch row for it.
static bool row_inline(Emit *e, int x) {
  if (mem_alias(e, x) >= 0)
    return false;
  int c = canon(e, x);
  if (e->in_step[c] && is_pointwise(node(e, c)->op))
    return true;
  need(e, x); // a constant or an anchor kept as a local: in memory first
  return false;
}

// The output buffer of a row-wise or reducing anchor: whole (arena slot or scratch) when it is an
// output or read at other indices; otherwise only a per-thread row (or a local) exists.
static bool whole(Emit *e, int a) {
  if (offset(e, a) >= 0)
    return true;
  if (e->spill[a]) {
    e->scratch[a] = true;
    return true;
  }
  return false;
}

//
// Anchors.
//

static void emit_gemm(Emit *e, int gi, const bool *emitted) {
  int mm = e->groups[gi].mem[0];
  const IrNode *nd = node(e, mm);
  Shape sa = node(e, nd->in[0])->shape, sb = node(e, nd->in[1])->shape, so = nd->shape;
  bool ta = nd->ia[0], tb = nd->ia[1];
  int64_t m = so.d[so.rank - 2], n = so.d[so.rank - 1], k = ta ? sa.d[sa.rank - 2] : sa.d[sa.rank - 1];
  Rows a, b;
  if (so.rank == 2) {
    a = rows_of(e, nd->in[0]);
    b = rows_of(e, nd->in[1]);
  } else {
    a = (Rows){str(e, "b%d", ptr(e, need(e, nd->in[0]))), sa.d[sa.rank - 1]};
    b = (Rows){str(e, "b%d", ptr(e, need(e, nd->in[1]))), sb.d[sb.rank - 1]};
  }
  flush(e);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = post_set(e, gi, numel(e, mm), emitted, q);
  if (offset(e, mm) < 0) {
    for (int t = 0; t < nq && !e->spill[mm] && e->host[mm] < 0; t++)
      if (offset(e, q[t]) >= 0)
        e->host[mm] = q[t];
    if (e->host[mm] < 0)
      e->scratch[mm] = true;
  }
  int c = ptr(e, mm);
  int64_t batches = span(so, 0, so.rank - 2);
  e->uses_h = true;
  phase_begin(e);
  note(e, "gemm %%%d: [%lld x %lld] = %s[%lld x %lld] %s[%lld x %lld]%s%s", mm, (long long)m, (long long)n,
       ta ? "T" : "", (long long)m, (long long)k, tb ? "T" : "", (long long)k, (long long)n,
       batches > 1 ? str(e, ", %lld batches", (long long)batches) : "", nq ? ", epilogue after" : "");
  if (batches == 1) {
    line(e, "mdl_gemm(h, %d, %d, %lld, %lld, %lld, %s, %lld, %s, %lld, 0.0f, b%d, %lld);", ta, tb, (long long)m,
         (long long)n, (long long)k, a.base, (long long)a.stride, b.base, (long long)b.stride, c, (long long)n);
  } else {
    Shape ob = so, ab = sa, bb = sb;
    ob.rank -= 2, ab.rank -= 2, bb.rank -= 2;
    enter(e, "for (int64_t t = 0; t < %lld; t++)", (long long)batches);
    const char *ia = ix_bcast(e, ob, ab, "t"), *ib = ix_bcast(e, ob, bb, "t");
    line(e, "mdl_gemm(h, %d, %d, %lld, %lld, %lld, %s + %s * %lld, %lld, %s + %s * %lld, %lld, 0.0f, "
            "b%d + t * %lld, %lld);",
         ta, tb, (long long)m, (long long)n, (long long)k, a.base, ia, (long long)(m * k), (long long)a.stride,
         b.base, ib, (long long)(k * n), (long long)b.stride, c, (long long)(m * n), (long long)n);
    leave(e);
  }
  phase_done(e, mm);
  phase_end(e);
  if (nq)
    pw_loop(e, q, nq, numel(e, mm), mm);
  free(q);
}

// The accumulation of one value v into acc: a sum, or a max where a NaN wins (as in interp.c).
static void accumulate(Emit *e, bool max) {
  if (max) {
    line(e, "if (v > acc || isnan(v))");
    line(e, "  acc = isnan(acc) ? acc : v;");
  } else {
    line(e, "acc += v;");
  }
}

// Output r of a reduction from its accumulator: stored, then the outputs computed after it.
static void reduce_finish(Emit *e, int a, bool buf, const int *q, int nq) {
  const IrNode *nd = node(e, a);
  int64_t len = node(e, nd->in[0])->shape.d[nd->ia[0]];
  if (nd->op == OP_MEAN)
    line(e, "const float y = (float)(acc / %lld);", (long long)len);
  else
    line(e, "const float y = (float)acc;");
  if (buf)
    line(e, "b%d[r] = y;", ptr(e, a));
  post_inloop(e, a, q, nq, "r", numel(e, a), "y");
}

// SUM / MEAN / MAX over one axis, the input computed inline. Many outputs: one task per output.
// Few outputs over many elements: partial results per fixed block of the reduced axis (of rows, for
// column sums), combined in block order.
static void emit_reduce(Emit *e, int gi, const bool *emitted) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  int x = nd->in[0];
  Shape s = node(e, x)->shape;
  int ax = (int)nd->ia[0];
  int64_t outer = span(s, 0, ax), len = s.d[ax], inner = span(s, ax + 1, s.rank), on = outer * inner;
  bool max = nd->op == OP_MAX, buf = whole(e, a);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = post_set(e, gi, on, emitted, q);
  const char *acc_t = max ? "float" : "double", *init = max ? "-INFINITY" : "0.0";
  phase_begin(e);
  if ((inner == 1 && (outer >= 16 || len < 4096)) || (inner > 1 && outer > 1)) {
    note(e, "%s %%%d: %lld outputs, each over %lld elements", op_name(nd->op), a, (long long)on, (long long)len);
    par_for(e, on * len, "static");
    enter(e, "for (int64_t r = 0; r < %lld; r++)", (long long)on);
    if (inner == 1)
      line(e, "const int64_t base = r * %lld;", (long long)len);
    else
      line(e, "const int64_t base = r / %lld * %lld + r %% %lld;", (long long)inner, (long long)(len * inner),
           (long long)inner);
    line(e, "%s acc = %s;", acc_t, init);
    enter(e, "for (int64_t l = 0; l < %lld; l++)", (long long)len);
    if (inner == 1)
      line(e, "const int64_t ix = base + l;");
    else
      line(e, "const int64_t ix = base + l * %lld;", (long long)inner);
    e->loop_ix = "ix";
    e->loop_n = numel(e, x);
    line(e, "const float v = %s;", val(e, x, "ix"));
    accumulate(e, max);
    leave(e);
    reduce_finish(e, a, buf, q, nq);
    leave(e);
  } else {
    bool col = inner > 1;
    int64_t bl = (len + 63) / 64, least = col ? 16 : 1024;
    if (bl < least)
      bl = least;
    int64_t nb = (len + bl - 1) / bl;
    note(e, "%s %%%d: %lld outputs over %lld elements, in %lld blocks of %lld", op_name(nd->op), a, (long long)on,
         (long long)len, (long long)nb, (long long)bl);
    line(e, "%s *part = mdl_scratch(%lld * sizeof(%s));", acc_t, (long long)(nb * on), acc_t);
    e->loop_ix = "ix";
    e->loop_n = numel(e, x);
    if (col) {
      par_for(e, len * inner, "static");
      enter(e, "for (int64_t k = 0; k < %lld; k++)", (long long)nb);
      line(e, "%s *p = part + k * %lld;", acc_t, (long long)inner);
      line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)inner);
      line(e, "  p[c] = %s;", init);
      line(e, "const int64_t end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", (long long)bl, (long long)bl,
           (long long)len, (long long)bl, (long long)bl, (long long)len);
      enter(e, "for (int64_t l = k * %lld; l < end; l++)", (long long)bl);
      enter(e, "for (int64_t c = 0; c < %lld; c++)", (long long)inner);
      line(e, "const int64_t ix = l * %lld + c;", (long long)inner);
      line(e, "const float v = %s;", val(e, x, "ix"));
      if (max) {
        line(e, "float acc = p[c];");
        accumulate(e, max);
        line(e, "p[c] = acc;");
      } else {
        line(e, "p[c] += v;");
      }
      leave(e);
      leave(e);
      leave(e);
    } else {
      par_for(e, on * len, "static");
      enter(e, "for (int64_t t = 0; t < %lld; t++)", (long long)(on * nb));
      line(e, "const int64_t r = t / %lld, l0 = t %% %lld * %lld;", (long long)nb, (long long)nb, (long long)bl);
      line(e, "const int64_t end = l0 + %lld < %lld ? l0 + %lld : %lld;", (long long)bl, (long long)len,
           (long long)bl, (long long)len);
      line(e, "%s acc = %s;", acc_t, init);
      enter(e, "for (int64_t l = l0; l < end; l++)");
      line(e, "const int64_t ix = r * %lld + l;", (long long)len);
      line(e, "const float v = %s;", val(e, x, "ix"));
      accumulate(e, max);
      leave(e);
      line(e, "part[t] = acc;");
      leave(e);
    }
    par_for(e, on * nb * (nq + 1), "static");
    enter(e, "for (int64_t r = 0; r < %lld; r++)", (long long)on);
    line(e, "%s acc = %s;", acc_t, init);
    enter(e, "for (int64_t k = 0; k < %lld; k++)", (long long)nb);
    if (col)
      line(e, "const %s v = part[k * %lld + r];", acc_t, (long long)inner);
    else
      line(e, "const %s v = part[r * %lld + k];", acc_t, (long long)nb);
    accumulate(e, max);
    leave(e);
    reduce_finish(e, a, buf, q, nq);
    leave(e);
    line(e, "free(part);");
  }
  e->loop_ix = NULL;
  if (buf)
    phase_done(e, a);
  phase_end(e);
  free(q);
}

// LAYERNORM / RMSNORM forward, one row per iteration; x (the residual sum) computed inline.
static void emit_norm_fwd(Emit *e, int gi, const bool *emitted) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  bool ln = nd->op == OP_LAYERNORM;
  int64_t cols = last_dim(e, a), rows = numel(e, a) / cols;
  bool xin = row_inline(e, nd->in[0]);
  int w = need(e, nd->in[1]), bias = ln ? need(e, nd->in[2]) : -1;
  flush(e);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = post_set(e, gi, numel(e, a), emitted, q);
  bool buf = whole(e, a);
  Tmp tmp[2];
  int ntmp = 0;
  if (xin)
    tmp[ntmp++] = (Tmp){"xrow", cols};
  if (!buf)
    tmp[ntmp++] = (Tmp){"yrow", cols};
  phase_begin(e);
  note(e, "%s %%%d: %lld rows of %lld", op_name(nd->op), a, (long long)rows, (long long)cols);
  rows_open(e, "r", rows, rows * cols, tmp, ntmp);
  row_ptr(e, nd->in[0], "x", "xrow", cols);
  if (ln) {
    line(e, "double mean = 0, var = 0;");
    line(e, "#pragma omp simd reduction(+ : mean)");
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  mean += x[j];");
    line(e, "mean /= %lld;", (long long)cols);
    line(e, "#pragma omp simd reduction(+ : var)");
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  var += (x[j] - mean) * (x[j] - mean);");
    line(e, "const double rstd = 1.0 / sqrt(var / %lld + %s);", (long long)cols, dlit(e, nd->fa[0]));
  } else {
    line(e, "double ms = 0;");
    line(e, "#pragma omp simd reduction(+ : ms)");
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  ms += (double)x[j] * x[j];");
    line(e, "const double s = 1.0 / sqrt(ms / %lld + %s);", (long long)cols, dlit(e, nd->fa[0]));
  }
  if (buf)
    line(e, "float *y = b%d + r * %lld;", ptr(e, a), (long long)cols);
  else
    line(e, "float *y = yrow;");
  line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
  if (ln)
    line(e, "  y[j] = (float)((x[j] - mean) * rstd * b%d[j] + b%d[j]);", ptr(e, w), ptr(e, bias));
  else
    line(e, "  y[j] = (float)(x[j] * s * b%d[j]);", ptr(e, w));
  if (nq) {
    enter(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "const int64_t ix = r * %lld + j;", (long long)cols);
    post_inloop(e, a, q, nq, "ix", numel(e, a), "y[j]");
    leave(e);
  }
  rows_close(e, tmp, ntmp);
  e->loop_ix = NULL;
  if (buf)
    phase_done(e, a);
  phase_end(e);
  free(q);
}

// LAYERNORM_BWD / RMSNORM_BWD siblings: dx per row; dw (and db) as column sums in double over fixed
// blocks of rows, added in block order.
static void emit_norm_bwd(Emit *e, int gi, const bool *emitted) {
  const Group *gr = &e->groups[gi];
  const IrNode *nd = node(e, gr->mem[0]);
  bool ln = nd->op == OP_LAYERNORM_BWD;
  int dx = -1, dw = -1, db = -1;
  for (int i = 0; i < gr->nmem; i++) {
    int which = (int)node(e, gr->mem[i])->ia[0];
    *(which == 0 ? &dx : which == 1 ? &dw : &db) = gr->mem[i];
  }
  int x = nd->in[0], dy = nd->in[2];
  int64_t cols = last_dim(e, x), rows = numel(e, x) / cols;
  bool xin = row_inline(e, x), dyin = row_inline(e, dy);
  int w = need(e, nd->in[1]);
  flush(e);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = dx >= 0 ? post_set(e, gi, numel(e, dx), emitted, q) : 0;
  bool dxbuf = dx >= 0 && whole(e, dx);
  bool cols_sum = dw >= 0 || db >= 0;
  if (dw >= 0 && offset(e, dw) < 0)
    e->scratch[dw] = true;
  if (db >= 0 && offset(e, db) < 0)
    e->scratch[db] = true;
  Tmp tmp[3];
  int ntmp = 0;
  if (xin)
    tmp[ntmp++] = (Tmp){"xrow", cols};
  if (dyin)
    tmp[ntmp++] = (Tmp){"dyrow", cols};
  if (dx >= 0 && !dxbuf)
    tmp[ntmp++] = (Tmp){"dxrow", cols};
  int64_t bl = (rows + 63) / 64 < 16 ? 16 : (rows + 63) / 64, nb = (rows + bl - 1) / bl;
  phase_begin(e);
  note(e, "%s: %lld rows of %lld%s", op_name(nd->op), (long long)rows, (long long)cols,
       cols_sum ? str(e, ", column sums over %lld blocks of %lld rows", (long long)nb, (long long)bl) : "");
  if (cols_sum) {
    if (dw >= 0)
      line(e, "double *pdw = mdl_scratch(%lld * sizeof(double));", (long long)(nb * cols));
    if (db >= 0)
      line(e, "double *pdb = mdl_scratch(%lld * sizeof(double));", (long long)(nb * cols));
    rows_open(e, "k", nb, rows * cols, tmp, ntmp);
    if (dw >= 0)
      line(e, "double *sw = pdw + k * %lld;", (long long)cols);
    if (db >= 0)
      line(e, "double *sb = pdb + k * %lld;", (long long)cols);
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  %s%s%s", dw >= 0 ? "sw[j] = " : "", db >= 0 ? "sb[j] = " : "", "0;");
    line(e, "const int64_t end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", (long long)bl, (long long)bl,
         (long long)rows, (long long)bl, (long long)bl, (long long)rows);
    enter(e, "for (int64_t r = k * %lld; r < end; r++)", (long long)bl);
  } else {
    rows_open(e, "r", rows, rows * cols, tmp, ntmp);
  }
  row_ptr(e, x, "x", "xrow", cols);
  row_ptr(e, dy, "dy", "dyrow", cols);
  if (ln) {
    line(e, "double mean = 0, var = 0, mg = 0, mgx = 0;");
    line(e, "#pragma omp simd reduction(+ : mean)");
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  mean += x[j];");
    line(e, "mean /= %lld;", (long long)cols);
    line(e, "#pragma omp simd reduction(+ : var)");
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  var += (x[j] - mean) * (x[j] - mean);");
    line(e, "const double rstd = 1.0 / sqrt(var / %lld + %s);", (long long)cols, dlit(e, nd->fa[0]));
    line(e, "#pragma omp simd reduction(+ : mg, mgx)");
    enter(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "const double xhat = (x[j] - mean) * rstd, g = (double)dy[j] * b%d[j];", ptr(e, w));
    line(e, "mg += g;");
    line(e, "mgx += g * xhat;");
    if (dw >= 0)
      line(e, "sw[j] += dy[j] * xhat;");
    if (db >= 0)
      line(e, "sb[j] += dy[j];");
    leave(e);
  } else {
    line(e, "double ms = 0, mgx = 0;");
    line(e, "#pragma omp simd reduction(+ : ms)");
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  ms += (double)x[j] * x[j];");
    line(e, "const double s = 1.0 / sqrt(ms / %lld + %s);", (long long)cols, dlit(e, nd->fa[0]));
    line(e, "#pragma omp simd reduction(+ : mgx)");
    enter(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "mgx += (double)dy[j] * b%d[j] * x[j];", ptr(e, w));
    if (dw >= 0)
      line(e, "sw[j] += (double)dy[j] * x[j] * s;");
    leave(e);
  }
  if (dx >= 0) {
    if (dxbuf)
      line(e, "float *dx = b%d + r * %lld;", ptr(e, dx), (long long)cols);
    else
      line(e, "float *dx = dxrow;");
    if (ln) {
      line(e, "mg /= %lld;", (long long)cols);
      line(e, "mgx /= %lld;", (long long)cols);
      line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
      line(e, "  dx[j] = (float)(rstd * ((double)dy[j] * b%d[j] - mg - (x[j] - mean) * rstd * mgx));", ptr(e, w));
    } else {
      line(e, "mgx /= %lld;", (long long)cols);
      line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
      line(e, "  dx[j] = (float)(s * dy[j] * b%d[j] - s * s * s * x[j] * mgx);", ptr(e, w));
    }
    if (nq) {
      enter(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
      line(e, "const int64_t ix = r * %lld + j;", (long long)cols);
      post_inloop(e, dx, q, nq, "ix", numel(e, dx), "dx[j]");
      leave(e);
    }
  }
  if (cols_sum)
    leave(e);
  rows_close(e, tmp, ntmp);
  if (cols_sum) {
    par_for(e, cols * nb, "static");
    enter(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "%s%s0;", dw >= 0 ? "double w = " : "", db >= 0 ? (dw >= 0 ? "0, b = " : "double b = ") : "");
    enter(e, "for (int64_t k = 0; k < %lld; k++)", (long long)nb);
    if (dw >= 0)
      line(e, "w += pdw[k * %lld + j];", (long long)cols);
    if (db >= 0)
      line(e, "b += pdb[k * %lld + j];", (long long)cols);
    leave(e);
    if (dw >= 0)
      line(e, "b%d[j] = (float)w;", ptr(e, dw));
    if (db >= 0)
      line(e, "b%d[j] = (float)b;", ptr(e, db));
    leave(e);
    if (dw >= 0)
      line(e, "free(pdw);");
    if (db >= 0)
      line(e, "free(pdb);");
  }
  e->loop_ix = NULL;
  if (dxbuf)
    phase_done(e, dx);
  if (dw >= 0)
    phase_done(e, dw);
  if (db >= 0)
    phase_done(e, db);
  phase_end(e);
  free(q);
}

// SOFTMAX (x) or SOFTMAX_BWD (y, dy) over the last axis, one row per iteration.
static void emit_softmax(Emit *e, int gi, const bool *emitted) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  bool bwd = nd->op == OP_SOFTMAX_BWD;
  int64_t cols = last_dim(e, a), rows = numel(e, a) / cols;
  bool in0 = row_inline(e, nd->in[0]), in1 = bwd && row_inline(e, nd->in[1]);
  flush(e);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = post_set(e, gi, numel(e, a), emitted, q);
  bool buf = whole(e, a);
  Tmp tmp[3];
  int ntmp = 0;
  if (in0)
    tmp[ntmp++] = (Tmp){"row0", cols};
  if (in1)
    tmp[ntmp++] = (Tmp){"row1", cols};
  if (!buf)
    tmp[ntmp++] = (Tmp){"yrow", cols};
  phase_begin(e);
  note(e, "%s %%%d: %lld rows of %lld", op_name(nd->op), a, (long long)rows, (long long)cols);
  rows_open(e, "r", rows, rows * cols, tmp, ntmp);
  row_ptr(e, nd->in[0], bwd ? "y" : "x", "row0", cols);
  if (bwd)
    row_ptr(e, nd->in[1], "dy", "row1", cols);
  if (buf)
    line(e, "float *out = b%d + r * %lld;", ptr(e, a), (long long)cols);
  else
    line(e, "float *out = yrow;");
  if (bwd) {
    line(e, "double dot = 0;");
    line(e, "#pragma omp simd reduction(+ : dot)");
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  dot += (double)y[j] * dy[j];");
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  out[j] = (float)(y[j] * (dy[j] - dot));");
  } else {
    line(e, "float m = -INFINITY;");
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  m = fmaxf(m, x[j]);");
    line(e, "double sum = 0;");
    enter(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "out[j] = expf(x[j] - m);");
    line(e, "sum += out[j];");
    leave(e);
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "  out[j] = (float)(out[j] / sum);");
  }
  if (nq) {
    enter(e, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    line(e, "const int64_t ix = r * %lld + j;", (long long)cols);
    post_inloop(e, a, q, nq, "ix", numel(e, a), "out[j]");
    leave(e);
  }
  rows_close(e, tmp, ntmp);
  e->loop_ix = NULL;
  if (buf)
    phase_done(e, a);
  phase_end(e);
  free(q);
}

// One row of cross-entropy: the loss into `loss` (an lvalue, or NULL) and dloss * (softmax - onehot)
// into the row `dx` (or NULL), for logits row x and target t; an ignored target (< 0) gives zeros,
// one >= V an error.
static void ce_row(Emit *e, const char *what, int64_t v, const char *loss, const char *dx, const char *dloss) {
  e->uses_h = true;
  enter(e, "if (t < 0 || t >= %lld)", (long long)v);
  line(e, "if (t >= %lld)", (long long)v);
  line(e, "  h->error(h->ctx, \"%s: target\", t, %lld);", what, (long long)v);
  if (loss)
    line(e, "%s = 0.0f;", loss);
  if (dx)
    line(e, "memset(%s, 0, %lld * sizeof(float));", dx, (long long)v);
  line(e, "continue;");
  leave(e);
  if (loss)
    line(e, "const float xt = x[t]; // before dx, which may be x itself, is written");
  line(e, "float m = -INFINITY;");
  line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
  line(e, "  m = fmaxf(m, x[j]);");
  line(e, "double sum = 0;");
  if (dx) {
    enter(e, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
    line(e, "%s[j] = expf(x[j] - m);", dx);
    line(e, "sum += %s[j];", dx);
    leave(e);
  } else {
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
    line(e, "  sum += expf(x[j] - m);");
  }
  if (loss)
    line(e, "%s = (float)(m + log(sum) - xt);", loss);
  if (dx) {
    line(e, "const double g = %s, inv = 1.0 / sum;", dloss);
    line(e, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
    line(e, "  %s[j] = (float)(g * (%s[j] * inv - (j == t)));", dx, dx);
  }
}

// CROSS_ENTROPY and / or CROSS_ENTROPY_BWD over the same logits: one pass per row.
static void emit_ce(Emit *e, int gi) {
  const Group *gr = &e->groups[gi];
  int ce = -1, ceb = -1;
  for (int i = 0; i < gr->nmem; i++)
    *(node(e, gr->mem[i])->op == OP_CROSS_ENTROPY ? &ce : &ceb) = gr->mem[i];
  const IrNode *nd = node(e, gr->mem[0]);
  int64_t v = last_dim(e, nd->in[0]), rows = numel(e, nd->in[1]);
  int lg = need(e, nd->in[0]), tg = need(e, nd->in[1]), dl = ceb >= 0 ? need(e, node(e, ceb)->in[2]) : -1;
  flush(e);
  for (int i = 0; i < gr->nmem; i++)
    if (offset(e, gr->mem[i]) < 0)
      e->scratch[gr->mem[i]] = true;
  phase_begin(e);
  note(e, "cross-entropy%s: %lld rows of %lld", ceb >= 0 ? (ce >= 0 ? " and its gradient" : " gradient") : "",
       (long long)rows, (long long)v);
  par_for(e, rows * v, "static");
  enter(e, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  line(e, "const float *x = b%d + r * %lld;", ptr(e, lg), (long long)v);
  line(e, "const int32_t t = b%d[r];", ptr(e, tg));
  if (ceb >= 0)
    line(e, "float *dx = b%d + r * %lld;", ptr(e, ceb), (long long)v);
  ce_row(e, "cross_entropy", v, ce >= 0 ? str(e, "b%d[r]", ptr(e, ce)) : NULL, ceb >= 0 ? "dx" : NULL,
         dl >= 0 ? str(e, "b%d[r]", ptr(e, dl)) : NULL);
  leave(e);
  for (int i = 0; i < gr->nmem; i++)
    phase_done(e, gr->mem[i]);
  phase_end(e);
}

// The LM head chunk by chunk: logits rows = x W^T (or x W) into a chunk buffer, cross-entropy and its
// gradient in place, then dx rows = dlogits W (W^T) and dW += dlogits^T x (x^T dlogits).
static void emit_lmhead(Emit *e, int gi) {
  const Group *gr = &e->groups[gi];
  const IrNode *xm = node(e, gr->x);
  int64_t n = xm->shape.d[0], c = xm->shape.d[1], v = last_dim(e, gr->mm);
  int x = need(e, gr->x), w = need(e, gr->w), tg = need(e, gr->tgt), dl = need(e, gr->dloss);
  flush(e);
  int outs[3] = {gr->ce, gr->dx, gr->dw};
  for (int i = 0; i < 3; i++)
    if (offset(e, outs[i]) < 0)
      e->scratch[outs[i]] = true;
  // Chunks of a multiple of 64 rows: at most 16M logits (64 MB), at most a quarter of the rows.
  int64_t rc = (16 << 20) / v / 64 * 64, quarter = (n / 4 + 63) / 64 * 64;
  if (rc > quarter)
    rc = quarter;
  if (rc < 64)
    rc = 64;
  if (rc > n)
    rc = n;
  int64_t ldw = gr->tb ? c : v;
  e->uses_h = true;
  phase_begin(e);
  note(e, "LM head: %lld rows x %lld classes from width %lld, in chunks of %lld rows", (long long)n, (long long)v,
       (long long)c, (long long)rc);
  line(e, "float *logits = mdl_scratch(%lld * sizeof(float));", (long long)(rc * v));
  enter(e, "for (int64_t r0 = 0; r0 < %lld; r0 += %lld)", (long long)n, (long long)rc);
  line(e, "const int64_t rn = %lld - r0 < %lld ? %lld - r0 : %lld;", (long long)n, (long long)rc, (long long)n,
       (long long)rc);
  line(e, "mdl_gemm(h, 0, %d, rn, %lld, %lld, b%d + r0 * %lld, %lld, b%d, %lld, 0.0f, logits, %lld);", gr->tb,
       (long long)v, (long long)c, ptr(e, x), (long long)c, (long long)c, ptr(e, w), (long long)ldw, (long long)v);
  par_for(e, rc * v, "static");
  enter(e, "for (int64_t i = 0; i < rn; i++)");
  line(e, "const int64_t r = r0 + i;");
  line(e, "const float *x = logits + i * %lld;", (long long)v);
  line(e, "float *dx = logits + i * %lld;", (long long)v);
  line(e, "const int32_t t = b%d[r];", ptr(e, tg));
  ce_row(e, "cross_entropy", v, str(e, "b%d[r]", ptr(e, gr->ce)), "dx", str(e, "b%d[r]", ptr(e, dl)));
  leave(e);
  line(e, "mdl_gemm(h, 0, %d, rn, %lld, %lld, logits, %lld, b%d, %lld, 0.0f, b%d + r0 * %lld, %lld);", !gr->tb,
       (long long)c, (long long)v, (long long)v, ptr(e, w), (long long)ldw, ptr(e, gr->dx), (long long)c,
       (long long)c);
  if (gr->tb)
    line(e, "mdl_gemm(h, 1, 0, %lld, %lld, rn, logits, %lld, b%d + r0 * %lld, %lld, r0 ? 1.0f : 0.0f, b%d, %lld);",
         (long long)v, (long long)c, (long long)v, ptr(e, x), (long long)c, (long long)c, ptr(e, gr->dw),
         (long long)c);
  else
    line(e, "mdl_gemm(h, 1, 0, %lld, %lld, rn, b%d + r0 * %lld, %lld, logits, %lld, r0 ? 1.0f : 0.0f, b%d, %lld);",
         (long long)c, (long long)v, ptr(e, x), (long long)c, (long long)c, (long long)v, ptr(e, gr->dw),
         (long long)v);
  leave(e);
  line(e, "free(logits);");
  for (int i = 0; i < 3; i++)
    phase_done(e, outs[i]);
  phase_end(e);
}

// ATTENTION forward: one task per (batch, head, query row); online softmax over the allowed keys in
// blocks of 64, never a T x T matrix.
static void emit_attention(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  Shape s = nd->shape;
  int64_t nb = s.d[0], nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads;
  bool causal = nd->ia[1], has_doc = nd->ia[2];
  Rows q = rows_of(e, nd->in[0]), k = rows_of(e, nd->in[1]), v = rows_of(e, nd->in[2]);
  int doc = has_doc ? need(e, nd->in[3]) : -1;
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  phase_begin(e);
  note(e, "attention: B %lld, T %lld, %lld heads of %lld%s%s; one task per query row", (long long)nb,
       (long long)nt, (long long)heads, (long long)d, causal ? ", causal" : "", has_doc ? ", within documents" : "");
  par_for(e, nb * nt * nt * nc / (causal ? 2 : 1), "dynamic, 16");
  enter(e, "for (int64_t task = 0; task < %lld; task++)", (long long)(nb * heads * nt));
  line(e, "const int64_t b = task / %lld, hd = task / %lld %% %lld, i = task %% %lld;", (long long)(heads * nt),
       (long long)nt, (long long)heads, (long long)nt);
  line(e, "const float *qi = %s + (b * %lld + i) * %lld + hd * %lld;", q.base, (long long)nt, (long long)q.stride,
       (long long)d);
  if (has_doc)
    line(e, "const int32_t di = b%d[b * %lld + i];", ptr(e, doc), (long long)nt);
  line(e, "float acc[%lld] = {0}, s[64], m = -INFINITY, l = 0.0f;", (long long)d);
  line(e, "const int64_t nj = %s;", causal ? "i + 1" : str(e, "%lld", (long long)nt));
  enter(e, "for (int64_t j0 = 0; j0 < nj; j0 += 64)");
  line(e, "const int64_t n = nj - j0 < 64 ? nj - j0 : 64;");
  line(e, "float bm = -INFINITY;");
  enter(e, "for (int64_t jj = 0; jj < n; jj++)");
  line(e, "const int64_t j = j0 + jj;");
  if (has_doc) {
    enter(e, "if (b%d[b * %lld + j] != di)", ptr(e, doc), (long long)nt);
    line(e, "s[jj] = -INFINITY;");
    line(e, "continue;");
    leave(e);
  }
  line(e, "const float *kj = %s + (b * %lld + j) * %lld + hd * %lld;", k.base, (long long)nt, (long long)k.stride,
       (long long)d);
  line(e, "float dot = 0.0f;");
  line(e, "#pragma omp simd reduction(+ : dot)");
  line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  line(e, "  dot += qi[c] * kj[c];");
  line(e, "s[jj] = dot * %s;", flit(e, nd->fa[0]));
  line(e, "bm = fmaxf(bm, s[jj]);");
  leave(e);
  line(e, "if (bm == -INFINITY)");
  line(e, "  continue;");
  enter(e, "if (bm > m)");
  line(e, "const float corr = expf(m - bm);");
  line(e, "l *= corr;");
  line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  line(e, "  acc[c] *= corr;");
  line(e, "m = bm;");
  leave(e);
  enter(e, "for (int64_t jj = 0; jj < n; jj++)");
  line(e, "if (s[jj] == -INFINITY)");
  line(e, "  continue;");
  line(e, "const float p = expf(s[jj] - m);");
  line(e, "const float *vj = %s + (b * %lld + j0 + jj) * %lld + hd * %lld;", v.base, (long long)nt,
       (long long)v.stride, (long long)d);
  line(e, "l += p;");
  line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  line(e, "  acc[c] += p * vj[c];");
  leave(e);
  leave(e);
  line(e, "float *oi = b%d + (b * %lld + i) * %lld + hd * %lld;", ptr(e, a), (long long)nt, (long long)nc,
       (long long)d);
  line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  line(e, "  oi[c] = acc[c] / l;");
  leave(e);
  phase_done(e, a);
  phase_end(e);
}

// ATTENTION_BWD siblings: one task per (batch, head), so its dk and dv rows are written by that task
// alone; the probabilities of each query row are recomputed.
static void emit_attention_bwd(Emit *e, int gi) {
  const Group *gr = &e->groups[gi];
  const IrNode *nd = node(e, gr->mem[0]);
  Shape s = nd->shape;
  int64_t nb = s.d[0], nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads;
  bool causal = nd->ia[1], has_doc = nd->ia[2];
  int out[3] = {-1, -1, -1};
  for (int i = 0; i < gr->nmem; i++)
    out[node(e, gr->mem[i])->ia[3]] = gr->mem[i];
  bool ds = out[0] >= 0 || out[1] >= 0; // dq and dk need dS = P (dP - rowsum(P dP)); dv only P
  Rows q = rows_of(e, nd->in[0]), k = rows_of(e, nd->in[1]), v = ds ? rows_of(e, nd->in[2]) : (Rows){0};
  int doc = has_doc ? need(e, nd->in[3]) : -1;
  Rows dout = rows_of(e, nd->in[has_doc ? 4 : 3]);
  flush(e);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0 && offset(e, out[i]) < 0)
      e->scratch[out[i]] = true;
  const char *sc = flit(e, nd->fa[0]);
  Tmp tmp[2] = {{"p", nt}, {"dp", nt}};
  phase_begin(e);
  note(e, "attention backward (%s%s%s): B %lld, T %lld, %lld heads of %lld%s%s; one task per (batch, head)",
       out[0] >= 0 ? "dq " : "", out[1] >= 0 ? "dk " : "", out[2] >= 0 ? "dv" : "", (long long)nb, (long long)nt,
       (long long)heads, (long long)d, causal ? ", causal" : "", has_doc ? ", within documents" : "");
  bool par = nb * nt * nt * nc >= PAR_MIN;
  if (par) {
    line(e, "#pragma omp parallel num_threads(h->nthreads)");
    e->uses_h = true;
  }
  enter(e, "%s", "");
  int ntmp = ds ? 2 : 1;
  for (int i = 0; i < ntmp; i++)
    line(e, "float *%s = mdl_scratch(%lld * sizeof(float));", tmp[i].name, (long long)tmp[i].n);
  if (par)
    line(e, "#pragma omp for schedule(dynamic, 1)");
  enter(e, "for (int64_t task = 0; task < %lld; task++)", (long long)(nb * heads));
  line(e, "const int64_t b = task / %lld, hd = task %% %lld;", (long long)heads, (long long)heads);
  for (int i = 1; i < 3; i++)
    if (out[i] >= 0) {
      line(e, "for (int64_t t = 0; t < %lld; t++)", (long long)nt);
      line(e, "  memset(b%d + (b * %lld + t) * %lld + hd * %lld, 0, %lld * sizeof(float));", ptr(e, out[i]),
           (long long)nt, (long long)nc, (long long)d, (long long)d);
    }
  enter(e, "for (int64_t i = 0; i < %lld; i++)", (long long)nt);
  line(e, "const float *qi = %s + (b * %lld + i) * %lld + hd * %lld;", q.base, (long long)nt, (long long)q.stride,
       (long long)d);
  line(e, "const float *doi = %s + (b * %lld + i) * %lld + hd * %lld;", dout.base, (long long)nt,
       (long long)dout.stride, (long long)d);
  if (has_doc)
    line(e, "const int32_t di = b%d[b * %lld + i];", ptr(e, doc), (long long)nt);
  line(e, "const int64_t nj = %s;", causal ? "i + 1" : str(e, "%lld", (long long)nt));
  const char *allowed = has_doc ? str(e, "b%d[b * %lld + j] == di", ptr(e, doc), (long long)nt) : NULL;
  line(e, "float m = -INFINITY;");
  enter(e, "for (int64_t j = 0; j < nj; j++)");
  if (allowed) {
    enter(e, "if (!(%s))", allowed);
    line(e, "p[j] = -INFINITY;");
    line(e, "continue;");
    leave(e);
  }
  line(e, "const float *kj = %s + (b * %lld + j) * %lld + hd * %lld;", k.base, (long long)nt, (long long)k.stride,
       (long long)d);
  line(e, "float dot = 0.0f;");
  line(e, "#pragma omp simd reduction(+ : dot)");
  line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  line(e, "  dot += qi[c] * kj[c];");
  line(e, "p[j] = dot * %s;", sc);
  line(e, "m = fmaxf(m, p[j]);");
  leave(e);
  line(e, "double sum = 0%s;", ds ? ", dsum = 0" : "");
  enter(e, "for (int64_t j = 0; j < nj; j++)");
  line(e, "p[j] = p[j] == -INFINITY ? 0.0f : expf(p[j] - m);");
  line(e, "sum += p[j];");
  leave(e);
  enter(e, "for (int64_t j = 0; j < nj; j++)");
  line(e, "p[j] = (float)(p[j] / sum);");
  if (ds) {
    line(e, "const float *vj = %s + (b * %lld + j) * %lld + hd * %lld;", v.base, (long long)nt, (long long)v.stride,
         (long long)d);
    line(e, "float dot = 0.0f;");
    line(e, "#pragma omp simd reduction(+ : dot)");
    line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    line(e, "  dot += doi[c] * vj[c];");
    line(e, "dp[j] = dot;");
    line(e, "dsum += (double)p[j] * dot;");
  }
  leave(e);
  if (out[0] >= 0)
    line(e, "float dqi[%lld] = {0};", (long long)d);
  enter(e, "for (int64_t j = 0; j < nj; j++)");
  line(e, "if (p[j] == 0.0f)");
  line(e, "  continue;");
  if (ds)
    line(e, "const float ds = p[j] * (dp[j] - (float)dsum);");
  if (out[0] >= 0) {
    line(e, "const float *kj = %s + (b * %lld + j) * %lld + hd * %lld;", k.base, (long long)nt, (long long)k.stride,
         (long long)d);
    line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    line(e, "  dqi[c] += ds * kj[c];");
  }
  if (out[1] >= 0) {
    line(e, "float *dkj = b%d + (b * %lld + j) * %lld + hd * %lld;", ptr(e, out[1]), (long long)nt, (long long)nc,
         (long long)d);
    line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    line(e, "  dkj[c] += %s * ds * qi[c];", sc);
  }
  if (out[2] >= 0) {
    line(e, "float *dvj = b%d + (b * %lld + j) * %lld + hd * %lld;", ptr(e, out[2]), (long long)nt, (long long)nc,
         (long long)d);
    line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    line(e, "  dvj[c] += p[j] * doi[c];");
  }
  leave(e);
  if (out[0] >= 0) {
    line(e, "float *dq = b%d + (b * %lld + i) * %lld + hd * %lld;", ptr(e, out[0]), (long long)nt, (long long)nc,
         (long long)d);
    line(e, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    line(e, "  dq[c] = %s * dqi[c];", sc);
  }
  leave(e);
  leave(e);
  for (int i = 0; i < ntmp; i++)
    line(e, "free(%s);", tmp[i].name);
  leave(e);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0)
      phase_done(e, out[i]);
  phase_end(e);
}

static void emit_embed(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  int64_t v = node(e, nd->in[0])->shape.d[0], c = last_dim(e, a), rows = numel(e, a) / c;
  int tab = need(e, nd->in[0]), ids = need(e, nd->in[1]);
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  e->uses_h = true;
  phase_begin(e);
  note(e, "embed: %lld rows of %lld from a table of %lld", (long long)rows, (long long)c, (long long)v);
  par_for(e, rows * c, "static");
  enter(e, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  line(e, "const int32_t id = b%d[r];", ptr(e, ids));
  enter(e, "if (id < 0 || id >= %lld)", (long long)v);
  line(e, "h->error(h->ctx, \"embed: id\", id, %lld);", (long long)v);
  line(e, "memset(b%d + r * %lld, 0, %lld * sizeof(float));", ptr(e, a), (long long)c, (long long)c);
  line(e, "continue;");
  leave(e);
  line(e, "memcpy(b%d + r * %lld, b%d + (int64_t)id * %lld, %lld * sizeof(float));", ptr(e, a), (long long)c,
       ptr(e, tab), (long long)c, (long long)c);
  leave(e);
  phase_done(e, a);
  phase_end(e);
}

// EMBED_BWD: a scatter-add, parallel over blocks of columns so that every row of the table is summed
// in id order by one thread: deterministic and race-free.
static void emit_embed_bwd(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  int64_t v = nd->shape.d[0], c = nd->shape.d[1], rows = numel(e, nd->in[0]);
  int ids = need(e, nd->in[0]), dy = need(e, nd->in[1]);
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  int64_t cb = c < 16 ? c : 16, ncb = (c + cb - 1) / cb;
  e->uses_h = true;
  phase_begin(e);
  note(e, "embed backward: %lld rows of %lld into a table of %lld, %lld column blocks", (long long)rows,
       (long long)c, (long long)v, (long long)ncb);
  par_for(e, (rows + v) * c, "static");
  enter(e, "for (int64_t k = 0; k < %lld; k++)", (long long)ncb);
  line(e, "const int64_t c0 = k * %lld, c1 = c0 + %lld < %lld ? c0 + %lld : %lld;", (long long)cb, (long long)cb,
       (long long)c, (long long)cb, (long long)c);
  line(e, "for (int64_t t = 0; t < %lld; t++)", (long long)v);
  line(e, "  memset(b%d + t * %lld + c0, 0, (size_t)(c1 - c0) * sizeof(float));", ptr(e, a), (long long)c);
  enter(e, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  line(e, "const int32_t id = b%d[r];", ptr(e, ids));
  enter(e, "if (id < 0 || id >= %lld)", (long long)v);
  line(e, "if (k == 0)");
  line(e, "  h->error(h->ctx, \"embed: id\", id, %lld);", (long long)v);
  line(e, "continue;");
  leave(e);
  line(e, "for (int64_t j = c0; j < c1; j++)");
  line(e, "  b%d[(int64_t)id * %lld + j] += b%d[r * %lld + j];", ptr(e, a), (long long)c, ptr(e, dy), (long long)c);
  leave(e);
  leave(e);
  phase_done(e, a);
  phase_end(e);
}

// ROPE: per row, the angles of the D/2 pairs once, applied to every head.
static void emit_rope(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  Shape s = nd->shape;
  int64_t rows = s.d[0] * s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads;
  Rows x = rows_of(e, nd->in[0]);
  int pos = need(e, nd->in[1]);
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  phase_begin(e);
  note(e, "rope%s: %lld rows, %lld heads of %lld", nd->ia[1] ? " (inverse)" : "", (long long)rows,
       (long long)heads, (long long)d);
  par_for(e, rows * nc * 4, "static");
  enter(e, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  line(e, "const double p = %sb%d[r];", nd->ia[1] ? "-1.0 * " : "", ptr(e, pos));
  line(e, "const float *x = %s + r * %lld;", x.base, (long long)x.stride);
  line(e, "float *y = b%d + r * %lld;", ptr(e, a), (long long)nc);
  enter(e, "for (int64_t i = 0; i < %lld; i++)", (long long)(d / 2));
  line(e, "const double th = p * pow(%s, -2.0 * (double)i / %lld);", dlit(e, nd->fa[0]), (long long)d);
  line(e, "const float cs = (float)cos(th), sn = (float)sin(th);");
  enter(e, "for (int64_t hd = 0; hd < %lld; hd++)", (long long)heads);
  line(e, "const int64_t a = hd * %lld + i, b = a + %lld;", (long long)d, (long long)(d / 2));
  line(e, "const float x1 = x[a], x2 = x[b];");
  line(e, "y[a] = x1 * cs - x2 * sn;");
  line(e, "y[b] = x1 * sn + x2 * cs;");
  leave(e);
  leave(e);
  leave(e);
  phase_done(e, a);
  phase_end(e);
}

// MAX_BWD (x, y, dy): the gradient goes to the maxima, shared evenly between ties.
static void emit_max_bwd(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  Shape s = nd->shape;
  int ax = (int)nd->ia[0];
  int64_t outer = span(s, 0, ax), len = s.d[ax], inner = span(s, ax + 1, s.rank);
  int x = need(e, nd->in[0]), y = need(e, nd->in[1]), dy = need(e, nd->in[2]);
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  phase_begin(e);
  note(e, "max backward: %lld outputs over %lld elements", (long long)(outer * inner), (long long)len);
  par_for(e, outer * len * inner, "static");
  enter(e, "for (int64_t r = 0; r < %lld; r++)", (long long)(outer * inner));
  line(e, "const int64_t base = r / %lld * %lld + r %% %lld;", (long long)inner, (long long)(len * inner),
       (long long)inner);
  line(e, "const float m = b%d[r];", ptr(e, y));
  line(e, "int64_t ties = 0;");
  line(e, "for (int64_t l = 0; l < %lld; l++)", (long long)len);
  line(e, "  ties += b%d[base + l * %lld] == m;", ptr(e, x), (long long)inner);
  line(e, "const float g = (float)((double)b%d[r] / (double)ties);", ptr(e, dy));
  line(e, "for (int64_t l = 0; l < %lld; l++)", (long long)len);
  line(e, "  b%d[base + l * %lld] = b%d[base + l * %lld] == m ? g : 0.0f;", ptr(e, a), (long long)inner, ptr(e, x),
       (long long)inner);
  leave(e);
  phase_done(e, a);
  phase_end(e);
}

// GRAD_NORM (sum of squares per tensor in double, fixed blocks) and AdamW over a table of
// parameter segments, in double per element like the interpreter; p, m and v in place.
static void emit_optimizer(Emit *e, int gi) {
  const Group *gr = &e->groups[gi];
  int gn = -1;
  for (int i = 0; i < gr->nmem; i++)
    if (node(e, gr->mem[i])->op == OP_GRAD_NORM) {
      const IrNode *nd = node(e, gr->mem[i]);
      for (int k = 0; k < nd->nin; k++)
        need(e, nd->in[k]);
    }
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = node(e, gr->mem[i]);
    if (nd->op != OP_ADAMW)
      continue;
    for (int k = 1; k < 7; k++)
      if (k != 4 || e->grp[canon(e, nd->in[4])] != gi)
        need(e, nd->in[k]);
  }
  flush(e);
  phase_begin(e);
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = node(e, gr->mem[i]);
    if (nd->op != OP_GRAD_NORM)
      continue;
    e->uses_h = true;
    gn = gr->mem[i];
    int64_t total = 0;
    for (int k = 0; k < nd->nin; k++)
      total += numel(e, nd->in[k]);
    note(e, "gradient norm %%%d over %d tensors, %lld values", gn, nd->nin, (long long)total);
    enter(e, "%s", "");
    line(e, "double ss = 0;");
    for (int k = 0; k < nd->nin; k++) {
      const char *label = node(e, canon(e, nd->in[k]))->name;
      line(e, "ss += mdl_sumsq(b%d, %lld, h->nthreads); // %s", ptr(e, need(e, nd->in[k])),
           (long long)numel(e, nd->in[k]), label ? label : "");
    }
    if (offset(e, gn) < 0)
      e->scratch[gn] = true;
    line(e, "b%d[0] = (float)sqrt(ss);", ptr(e, gn));
    leave(e);
    phase_done(e, gn);
  }
  // ADAMWs that share hyperparameters and scalars run over one table.
  bool *done = xcalloc((size_t)gr->nmem, sizeof *done);
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *a = node(e, gr->mem[i]);
    if (done[i] || a->op != OP_ADAMW)
      continue;
    int *seg = xcalloc((size_t)gr->nmem, sizeof *seg), ns = 0;
    int64_t total = 0;
    for (int j = i; j < gr->nmem; j++) {
      const IrNode *b = node(e, gr->mem[j]);
      if (done[j] || b->op != OP_ADAMW || memcmp(a->fa, b->fa, sizeof(double) * 3) || a->fa[4] != b->fa[4])
        continue;
      bool same = true;
      for (int k = 4; k < 7; k++)
        same &= canon(e, a->in[k]) == canon(e, b->in[k]);
      if (!same)
        continue;
      done[j] = true;
      seg[ns++] = gr->mem[j];
      total += numel(e, gr->mem[j]);
    }
    int gnorm = need(e, a->in[4]), lr = need(e, a->in[5]), step = need(e, a->in[6]);
    note(e, "AdamW over %d parameters, %lld values (beta1 %g, beta2 %g, eps %g, clip %g)", ns, (long long)total,
         a->fa[0], a->fa[1], a->fa[2], a->fa[4]);
    enter(e, "%s", "");
    line(e, "static const struct {");
    line(e, "  int64_t p, g, m, v, n;");
    line(e, "  double wd;");
    line(e, "} seg[%d] = {", ns);
    for (int j = 0; j < ns; j++) {
      const IrNode *u = node(e, seg[j]);
      int p = canon(e, u->in[0]), g = canon(e, u->in[1]), m = canon(e, u->in[2]), v = canon(e, u->in[3]);
      if (offset(e, p) < 0 || offset(e, g) < 0 || offset(e, m) < 0 || offset(e, v) < 0)
        fail(e, "adamw %d: parameter, gradient or moments not in memory", seg[j]);
      line(e, "    {%lld, %lld, %lld, %lld, %lld, %s}, // %s", (long long)offset(e, p), (long long)offset(e, g),
           (long long)offset(e, m), (long long)offset(e, v), (long long)numel(e, p), dlit(e, u->fa[3]),
           node(e, p)->name ? node(e, p)->name : "");
    }
    line(e, "};");
    line(e, "const double clip = %s, gnorm = b%d[0];", dlit(e, a->fa[4]), ptr(e, gnorm));
    line(e, "const double s = clip > 0 ? fmin(1.0, clip / (gnorm + 1e-6)) : 1.0;");
    line(e, "const double lr = b%d[0], step = b%d[0];", ptr(e, lr), ptr(e, step));
    line(e, "const double b1 = %s, b2 = %s, eps = %s;", dlit(e, a->fa[0]), dlit(e, a->fa[1]), dlit(e, a->fa[2]));
    line(e, "const double c1 = 1.0 / (1.0 - pow(b1, step)), c2 = 1.0 / (1.0 - pow(b2, step));");
    if (total >= PAR_MIN) {
      line(e, "#pragma omp parallel num_threads(h->nthreads)");
      e->uses_h = true;
    }
    enter(e, "for (int k = 0; k < %d; k++)", ns);
    line(e, "float *restrict p = (float *)(arena + seg[k].p), *restrict m = (float *)(arena + seg[k].m);");
    line(e, "float *restrict v = (float *)(arena + seg[k].v);");
    line(e, "const float *restrict g = (const float *)(arena + seg[k].g);");
    line(e, "const double wd = seg[k].wd;");
    if (total >= PAR_MIN)
      line(e, "#pragma omp for schedule(static) nowait");
    enter(e, "for (int64_t i = 0; i < seg[k].n; i++)");
    line(e, "const double gi = s * g[i];");
    line(e, "m[i] = (float)(b1 * m[i] + (1 - b1) * gi);");
    line(e, "v[i] = (float)(b2 * v[i] + (1 - b2) * gi * gi);");
    line(e, "p[i] = (float)(p[i] - lr * (m[i] * c1 / (sqrt(v[i] * c2) + eps) + wd * p[i]));");
    leave(e);
    leave(e);
    for (int j = 0; j < ns; j++) {
      int p = canon(e, node(e, seg[j])->in[0]);
      if (offset(e, seg[j]) >= 0 && offset(e, seg[j]) != offset(e, p))
        line(e, "memcpy(b%d, b%d, %lld * sizeof(float));", ptr(e, seg[j]), ptr(e, p), (long long)numel(e, p));
      phase_done(e, seg[j]);
    }
    leave(e);
    free(seg);
  }
  free(done);
  phase_end(e);
}

static void emit_group(Emit *e, int gi, const bool *emitted) {
  const Group *gr = &e->groups[gi];
  switch (gr->kind) {
  case G_NORM_BWD: emit_norm_bwd(e, gi, emitted); return;
  case G_ATTN_BWD: emit_attention_bwd(e, gi); return;
  case G_CE: emit_ce(e, gi); return;
  case G_LMHEAD: emit_lmhead(e, gi); return;
  case G_OPT: emit_optimizer(e, gi); return;
  case G_SINGLE: break;
  }
  Op op = node(e, gr->mem[0])->op;
  switch (op) {
  case OP_MATMUL: emit_gemm(e, gi, emitted); return;
  case OP_SUM: case OP_MEAN: case OP_MAX: emit_reduce(e, gi, emitted); return;
  case OP_LAYERNORM: case OP_RMSNORM: emit_norm_fwd(e, gi, emitted); return;
  case OP_SOFTMAX: case OP_SOFTMAX_BWD: emit_softmax(e, gi, emitted); return;
  case OP_ATTENTION: emit_attention(e, gi); return;
  case OP_EMBED: emit_embed(e, gi); return;
  case OP_EMBED_BWD: emit_embed_bwd(e, gi); return;
  case OP_ROPE: emit_rope(e, gi); return;
  case OP_MAX_BWD: emit_max_bwd(e, gi); return;
  default: fail(e, "no kernel for %s", op_name(op));
  }
}

//
// Steps.
//

static void pass_reset(Emit *e) {
  size_t n = (size_t)e->g->n;
  memset(e->written, 0, n * sizeof *e->written);
  memset(e->scratch, 0, n * sizeof *e->scratch);
  memset(e->declared, 0, n * sizeof *e->declared);
  memset(e->stored, 0, n * sizeof *e->stored);
  for (size_t i = 0; i < n; i++)
    e->host[i] = -1;
  e->body.len = e->notes.len = 0;
  e->nmemo = e->nixm = e->npending = e->nphase = e->ndecls = 0;
  e->indent = 1;
  e->depth = 0;
  e->fresh = 0;
  e->loop_ix = NULL;
  e->post_anchor = e->cur_q = -1;
  e->post_inloop = false;
  e->uses_h = false;
  e->flagged = false;
}

static void emit_step_body(Emit *e) {
  const Step *st = &e->f->steps[e->si];
  bool *emitted = xcalloc((size_t)e->ngroups + 1, sizeof *emitted);
  for (int k = 0; k < e->ngroups && !e->failed; k++) {
    emit_group(e, e->order[k], emitted);
    emitted[e->order[k]] = true;
  }
  free(emitted);
  int *rest = xcalloc((size_t)st->nnodes + 1, sizeof *rest), nrest = 0;
  for (int k = 0; k < st->nnodes; k++) {
    int c = st->nodes[k];
    if (e->in_step[c] && offset(e, c) >= 0 && !e->written[c] && is_pointwise(node(e, c)->op))
      rest[nrest++] = c;
  }
  if (nrest)
    pw_loops(e, rest, nrest, -1);
  free(rest);
  for (int k = 0; k < st->nnodes && !e->failed; k++) {
    int c = st->nodes[k];
    if (e->in_step[c] && offset(e, c) >= 0 && !e->written[c] && !e->flagged)
      fail(e, "step %s never writes node %d (%s)", st->name, c, op_name(node(e, c)->op));
  }
}

static const char *kind_name(StepKind k) {
  switch (k) {
  case STEP_KERNEL: return "kernel";
  case STEP_GEMM: return "GEMM";
  case STEP_ATTENTION: return "attention";
  case STEP_LMHEAD: return "LM head";
  case STEP_OPTIMIZER: return "optimizer";
  }
  return "?";
}

// Emits step si as the function `name`.
static bool emit_kernel(Emit *e, int si, const char *name) {
  const Step *st = &e->f->steps[si];
  e->si = si;
  for (int k = 0; k < st->nnodes; k++)
    e->in_step[st->nodes[k]] = !is_leaf(node(e, st->nodes[k])->op);
  memset(e->spill, 0, sizeof *e->spill * (size_t)e->g->n);
  memset(e->post_bad, 0, sizeof *e->post_bad * (size_t)e->g->n);
  bool ok = groups_order(e);
  for (int pass = 0; ok && pass < 32; pass++) {
    pass_reset(e);
    emit_step_body(e);
    if (e->failed || !e->flagged)
      break;
  }
  if (!e->failed && e->flagged)
    fail(e, "step %s: the layout of its values did not settle", st->name);
  for (int k = 0; k < st->nnodes; k++) {
    e->in_step[st->nodes[k]] = false;
    e->grp[st->nodes[k]] = -1;
  }
  if (e->failed)
    return false;

  bput(&e->out, "\n// %s: %s, %d op%s\n", name, kind_name(st->kind), st->nnodes, st->nnodes == 1 ? "" : "s");
  for (int k = 0; k < st->nnodes; k++) {
    const IrNode *nd = node(e, st->nodes[k]);
    char buf[128];
    bput(&e->out, "//   %%%-5d %-18s %-20s %-10s %s%s\n", nd->id, op_name(nd->op), nd->name ? nd->name : "",
         nd->loc.line ? str(e, "line %d", nd->loc.line) : "", dtype_name(nd->dtype),
         shape_str(nd->shape, buf, sizeof buf));
  }
  bput(&e->out, "// loops:\n");
  bappend(&e->out, &e->notes);
  bput(&e->out, "static void %s(char *arena, const MdlHooks *h) {\n", name);
  if (!e->uses_h)
    bput(&e->out, "  (void)h;\n");
  Buf decl = {0}, frees = {0};
  write_decls(e, &decl, &frees);
  if (!decl.len && !strstr(e->body.s ? e->body.s : "", "arena"))
    bput(&e->out, "  (void)arena;\n");
  bappend(&e->out, &decl);
  bappend(&e->out, &e->body);
  bappend(&e->out, &frees);
  free(decl.s);
  free(frees.s);
  bput(&e->out, "}\n");
  return true;
}

// A C identifier from a step name; unique among the kernels.
static const char *kernel_name(Emit *e, const char *name, int si, const char **names) {
  char buf[160];
  size_t k = 0;
  for (const char *p = name ? name : ""; *p && k + 1 < sizeof buf - 16; p++)
    buf[k++] = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ? *p : '_';
  buf[k] = 0;
  if (!k || (buf[0] >= '0' && buf[0] <= '9'))
    snprintf(buf, sizeof buf, "k%d_%s", si + 1, name && *name ? name : "step");
  for (int i = 0; i < si; i++)
    if (!strcmp(names[i], buf)) {
      snprintf(buf + strlen(buf), 16, "_%d", si + 1);
      break;
    }
  return arena_strdup(e->a, buf);
}

char *emit_c(const Fusion *f, const MemPlan *m, const char *source_path) {
  const Graph *g = f->g;
  size_t n = (size_t)g->n;
  Emit e = {.f = f, .m = m, .g = g, .a = arena_new()};
  e.in_step = xcalloc(n, sizeof *e.in_step);
  e.grp = xcalloc(n, sizeof *e.grp);
  e.spill = xcalloc(n, sizeof *e.spill);
  e.post_bad = xcalloc(n, sizeof *e.post_bad);
  e.written = xcalloc(n, sizeof *e.written);
  e.scratch = xcalloc(n, sizeof *e.scratch);
  e.declared = xcalloc(n, sizeof *e.declared);
  e.stored = xcalloc(n, sizeof *e.stored);
  e.host = xcalloc(n, sizeof *e.host);
  e.phase_nodes = xcalloc(n, sizeof *e.phase_nodes);
  e.pending = xcalloc(n, sizeof *e.pending);
  e.decls = xcalloc(n, sizeof *e.decls);
  for (size_t i = 0; i < n; i++)
    e.grp[i] = -1;

  bput(&e.out, "// Generated by mdlc %s from %s: do not edit.\n", MDL_VERSION, source_path ? source_path : "?");
  bput(&e.out, "// Model %s: one training step (forward, backward, AdamW) as %d kernels over one arena of %lld bytes\n",
       g->model ? g->model : "?", f->nsteps, (long long)m->arena_bytes);
  bput(&e.out, "// (parameters, gradients and AdamW moments at %lld, %lld, %lld and %lld, %lld bytes each).\n",
       (long long)m->params, (long long)m->grads, (long long)m->m, (long long)m->v, (long long)m->param_bytes);
  bput(&e.out, "// Build: cc -O3 -march=native -fno-math-errno -fopenmp -shared -fPIC; runtime/cpu.c loads it.\n");
  bput(&e.out, "%s", prelude);

  const char **names = xcalloc((size_t)f->nsteps + 1, sizeof *names);
  for (int si = 0; si < f->nsteps; si++) {
    names[si] = kernel_name(&e, f->steps[si].name, si, names);
    if (!emit_kernel(&e, si, names[si]))
      break;
  }
  char *text = NULL;
  if (e.failed) {
    fprintf(stderr, "mdlc: emit_c: %s\n", e.err);
  } else {
    bput(&e.out, "\n// The whole step, kernel after kernel.\n");
    bput(&e.out, "void mdl_step(char *arena, const MdlHooks *h) {\n");
    for (int si = 0; si < f->nsteps; si++)
      bput(&e.out, "  %s(arena, h);\n", names[si]);
    bput(&e.out, "}\n\nconst MdlKernel mdl_kernels[] = {\n");
    for (int si = 0; si < f->nsteps; si++)
      bput(&e.out, "    {\"%s\", %s},\n", names[si], names[si]);
    bput(&e.out, "};\nconst int mdl_nkernels = %d;\n", f->nsteps);
    bput(&e.out, "const int64_t mdl_arena_bytes = %lld;\n", (long long)m->arena_bytes);
    text = arena_alloc(g->arena, e.out.len + 1);
    memcpy(text, e.out.s, e.out.len);
  }
  free(names);
  free(e.out.s);
  free(e.body.s);
  free(e.notes.s);
  free(e.memo);
  free(e.ixm);
  free(e.in_step);
  free(e.grp);
  free(e.spill);
  free(e.post_bad);
  free(e.written);
  free(e.scratch);
  free(e.declared);
  free(e.stored);
  free(e.host);
  free(e.phase_nodes);
  free(e.pending);
  free(e.decls);
  arena_free(e.a);
  return text;
}
