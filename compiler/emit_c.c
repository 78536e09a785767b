// emit_c.c: the C emitter. It turns the step plan (a Fusion and its MemPlan) into one translation unit
// of C11 + OpenMP for the whole training step: a prelude of helpers (runtime/prelude.h), one function
// per step, mdl_step calling them in order, and a table of kernels the runtime can time one by one.
//
// Kernels that run the same loops on other buffers (one per layer: GPT-2 124M's 238 kernels are 30
// distinct ones) share one function that takes their buffers' arena offsets, and each kernel calls
// it with its own (write_kernels); so the C compiler compiles each distinct kernel once and a model's
// compile time hardly grows with its layers (GPT-2 124M 13.5 s -> 2.1 s; with 48 layers, 922 kernels,
// still 30 distinct: 55 s -> 4 s).
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
// statistics, column sums, reductions, the gradient norm) accumulate in double, in fixed blocks
// combined in a fixed order; softmax and cross-entropy denominators in 16 f32 lanes flushed to double
// lanes every 256 elements (exp_sum), and short dot products use `omp simd` reductions (an
// order fixed by the compiled code), so results do not depend on the thread count. Attention keeps
// one task per (batch, head) and sums its short rows of probabilities in fp32, in 8 lanes combined in
// a fixed tree, with a vectorizable exp (mdl_exp_shifted) for the softmax; the softmax and
// cross-entropy rows, gelu and silu use it too (mdl_exp_fast), and elementwise loops run over rows
// of the last axis, so that a bias read along rows does not keep them from vectorizing. AdamW runs in f32
// per element, as a fused optimizer on a GPU does (in double it measured 20% slower than f32, its
// square root and division at half the vector width; the interpreter keeps double). GEMMs go through mdl_gemm, which splits the rows of
// C over the OpenMP threads and calls the runtime's single-threaded sgemm in each block, so one
// pool of threads runs the whole step.
//
// bf16. After the precision pass, GEMM operands are CASTs to bf16: stored in 16 bits (uint16_t
// buffers, half the bytes), read and written through mdl_bf16_to_f32 / mdl_f32_to_bf16 (round to
// nearest even, as the interpreter's CAST), while every computation stays f32. A GEMM of bf16
// operands runs as the f32 GEMM of its operands widened exactly into scratch (mdl_widen_bf16, once
// per buffer and group): products of bf16 values are exact in f32 and sums accumulate in f32, as on
// a GPU's bf16 tensor cores. Its f32 result never goes into a bf16 buffer. The LM head widens x and W
// once for all its chunks and rounds dlogits to bf16 values before its backward GEMMs. The prelude's
// bf16 helpers (runtime/prelude_bf16.h) are emitted only for graphs that hold bf16 values, so fp32 code is unchanged.
//
// What does not depend on the target (where values are, groups and their order, lines and scopes,
// the index maps of the evaluator) is in emit_common.c, whose state EmitCore this emitter embeds as
// e->core.
#include "mdl.h"
#include "emit_common.h"
#include "backend.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

enum { PAR_MIN = 32768 }; // elements of work below which a loop stays on one thread

//
// The emitter's state.
//

// One kernel as emitted: on its own (code), and, where its pointers are into the arena, as the body of
// a function that takes their offsets in o[] (shared), which kernels of the same loops share.
typedef struct {
  const char *name;
  char *head;      // the comment above it: its ops and loops
  char *code;      // the function, offsets built in
  char *shared;    // from the function's opening brace, offsets from o[]; NULL without arena pointers
  char *key;       // shared, comments dropped and node-numbered names numbered by first appearance
  int64_t *off;
  int noff;
} Kernel;

typedef struct {
  EmitCore core;   // the step, its groups, where values are (scratch: a malloc'd buffer in this kernel)
  Buf out;         // the translation unit

  // one pass
  bool *declared;  // its pointer is declared
  int *decls;      // nodes whose pointer the kernel uses
  int ndecls;
  Buf notes;
  const char *loop_ix; // the current loop's own flat index (stores happen there)
  int64_t loop_n;      // and the number of elements it visits
  int post_anchor;     // inside the loop that follows (or is) this anchor's, else -1
  const char *post_ix;
  bool post_inloop;    // that loop is the anchor's own loop (its value is a local)
  int cur_q;           // the output being evaluated there
  bool uses_h;
} Emit;

//
// Lines and scopes.
//

static void note(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(Emit *e, const char *fmt, ...) {
  ec_bput(&e->notes, "//   ");
  va_list ap;
  va_start(ap, fmt);
  ec_bvput(&e->notes, fmt, ap);
  va_end(ap);
  ec_bput(&e->notes, "\n");
}

static void par_for(Emit *e, int64_t work, const char *schedule) {
  if (work >= PAR_MIN) {
    ec_line(&e->core, "#pragma omp parallel for num_threads(h->nthreads) schedule(%s)", schedule);
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
  return arena_strdup(e->core.a, buf);
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

//
// Buffers: every node read or written through memory gets one pointer, declared at the top of its
// kernel: its arena slot, a scratch buffer, or (a GEMM root) the buffer of its epilogue's output.
//

static const char *shape_txt(Emit *e, int n) {
  char buf[128];
  return str(e, "%s%s", dtype_name(ec_node(&e->core, n)->dtype),
             shape_str(ec_node(&e->core, n)->shape, buf, sizeof buf));
}

static const char *node_label(Emit *e, int n) {
  const IrNode *nd = ec_node(&e->core, n);
  return str(e, "%%%d %s%s%s", n, op_name(nd->op), nd->name ? " " : "", nd->name ? nd->name : "");
}

// Marks c's pointer as used; the declarations are written, in node order, when the kernel is done.
static int ptr(Emit *e, int c) {
  if (e->declared[c])
    return c;
  if (ec_offset(&e->core, c) < 0 && e->core.host[c] < 0 && !e->core.scratch[c])
    ec_fail(&e->core, "node %d (%s) has no buffer in step %s", c, op_name(ec_node(&e->core, c)->op),
            e->core.f->steps[e->core.si].name);
  if (e->core.host[c] >= 0)
    ptr(e, e->core.host[c]);
  e->declared[c] = true;
  e->decls[e->ndecls++] = c;
  return c;
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

// The pointer declarations of the kernel (arena slots and scratch buffers, then the GEMMs that write
// into their epilogue's output) and the frees of its scratch buffers.
// The kernel's pointers: into decl at their arena offsets, and into shared the same lines reading the
// offsets from o[] (their values appended to k->off), for a kernel whose code others share.
static void write_decls(Emit *e, Buf *decl, Buf *shared, Kernel *k, Buf *frees) {
  qsort(e->decls, (size_t)e->ndecls, sizeof *e->decls, cmp_int);
  // With its offsets out of sight the C compiler must assume that any two of the pointers may
  // overlap, and keeps loops it vectorized with constant offsets scalar (attention's backward ran
  // 25% slower): where the kernel's buffers are disjoint, its shared code says so (restrict, which
  // is then part of what kernels must have alike to share it).
  bool disjoint = true;
  for (int i = 0; i < e->ndecls && disjoint; i++)
    for (int j = 0; j < i && disjoint; j++) {
      int a = e->decls[i], b = e->decls[j];
      int64_t oa = ec_offset(&e->core, a), ob = ec_offset(&e->core, b);
      if (oa >= 0 && ob >= 0)
        disjoint = oa >= ob + ec_numel(&e->core, b) * dtype_size(ec_node(&e->core, b)->dtype) ||
                   ob >= oa + ec_numel(&e->core, a) * dtype_size(ec_node(&e->core, a)->dtype);
    }
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < e->ndecls; i++) {
      int c = e->decls[i];
      const char *t = ec_mtype(&e->core, c);
      Buf line = {0};
      if (pass == 0 && ec_offset(&e->core, c) >= 0) {
        ec_bput(decl, "  %s *const b%d = (%s *)(arena + %lld); // %s %s\n", t, c, t, (long long)ec_offset(&e->core, c),
                node_label(e, c), shape_txt(e, c));
        ec_bput(shared, "  %s *const%s b%d = (%s *)(arena + o[%d]); // %s %s\n", t, disjoint ? " restrict" : "", c, t,
                k->noff, node_label(e, c), shape_txt(e, c));
        k->off = realloc(k->off, sizeof *k->off * (size_t)(k->noff + 1));
        if (!k->off)
          abort();
        k->off[k->noff++] = ec_offset(&e->core, c);
      } else if (pass == 0 && e->core.host[c] < 0) {
        ec_bput(&line, "  %s *const b%d = mdl_scratch(%lld); // %s %s, kept in this kernel\n", t, c,
                (long long)ec_numel(&e->core, c) * dtype_size(ec_node(&e->core, c)->dtype), node_label(e, c),
                shape_txt(e, c));
        ec_bput(frees, "  mdl_free(b%d);\n", c);
      } else if (pass == 1 && ec_offset(&e->core, c) < 0 && e->core.host[c] >= 0) {
        ec_bput(&line, "  float *const b%d = b%d; // %s %s: the GEMM writes into its epilogue's output\n", c,
                e->core.host[c], node_label(e, c), shape_txt(e, c));
      }
      if (line.len) {
        ec_bappend(decl, &line);
        ec_bappend(shared, &line);
      }
      free(line.s);
    }
}

//
// The inline evaluator.
//

static const char *val(Emit *e, int n, const char *ix);

// Reading node c at ix from memory: records reads that the chosen layout must allow.
static void note_read(Emit *e, int c, const char *ix) {
  bool at_post = e->post_anchor == c && strcmp(ix, e->post_ix) == 0;
  if (e->core.in_step[c] && e->core.grp[c] >= 0 && !at_post && ec_offset(&e->core, c) < 0)
    ec_flag(&e->core, e->core.spill, c);
}

// The value of node n at flat index ix, as a C expression; emits what computes it. A step output
// met at the current loop's own index is stored on the way.
static const char *val(Emit *e, int n, const char *ix) {
  int c = ec_canon(&e->core, n);
  const IrNode *nd = ec_node(&e->core, c);
  if (nd->op == OP_CONST)
    return flit(e, nd->fa[0]);
  if (ec_numel(&e->core, c) == 1)
    ix = "0";
  const char *hit = ec_memo_get(&e->core, c, ix);
  if (hit)
    return hit;
  const char *name = str(e, "v%d_%s", c, ix);
  if (ec_in_memory(&e->core, c)) {
    note_read(e, c, ix);
    ec_line(&e->core, "const %s %s = %s;", ec_ctype(&e->core, c), name,
            ec_load(&e->core, c, str(e, "b%d[%s]", ptr(e, c), ix)));
  } else if (e->core.in_step[c] && ec_is_pointwise(nd->op)) {
    const char *expr = ec_pointwise_expr(&e->core, c, ix);
    ec_line(&e->core, "const %s %s = %s;", ec_ctype(&e->core, c), name, expr);
    bool own = e->loop_ix && ec_numel(&e->core, c) == e->loop_n && (strcmp(ix, e->loop_ix) == 0 || e->loop_n == 1);
    if (ec_has_target(&e->core, c) && !e->core.stored[c] && own) {
      ec_line(&e->core, "b%d[%s] = %s;", ptr(e, c), ix, ec_store(&e->core, c, name));
      e->core.stored[c] = true;
      e->core.phase_nodes[e->core.nphase++] = c;
    }
  } else if (e->core.in_step[c] && e->core.grp[c] >= 0) {
    // An anchor of this step that is not in memory (yet): read inside its own loop at another index,
    // or after it while only a local or a row of it existed. Flag it; the next pass lays it out.
    if (e->post_inloop && e->post_anchor == c && e->cur_q >= 0)
      ec_flag(&e->core, e->core.post_bad, e->cur_q);
    else
      ec_flag(&e->core, e->core.spill, c);
    return "0.0f";
  } else {
    ec_fail(&e->core, "step %s reads node %d (%s), which no earlier step wrote", e->core.f->steps[e->core.si].name, c,
            op_name(nd->op));
    return "0";
  }
  ec_memo_put(&e->core, c, ix, name);
  return name;
}

// The evaluator hooks of EmitCore (core is the first member of Emit).
static const char *core_val(EmitCore *core, int n, const char *ix) { return val((Emit *)core, n, ix); }
static const char *core_base(EmitCore *core, int n) { return str((Emit *)core, "b%d", ptr((Emit *)core, n)); }

static const char *core_seed(EmitCore *core) {
  ((Emit *)core)->uses_h = true;
  return "h->seed";
}

//
// Elementwise loops, each a phase: its stores count as written after it.
//

// One elementwise loop over `numel` elements writing nodes[0..k) (all of that size). post_anchor
// names the GEMM whose epilogue this is, or -1. Over rows of the nodes' last axis when there are
// enough of them (ROW_MIN): a value broadcast along rows (a bias) is then read at the column c, so
// the loop over a row vectorizes (as i % width, it would be a gather, and GCC leaves it scalar).
// Not for rows of exactly 16 that store a bf16 value: GCC 12.2 at -O2 and -O3 (x86-64, AVX2 or
// AVX-512) vectorizes that loop nest into one that stores nothing (plain attention's scores
// gradient, [B,H,16,16], came out all zeros); the flat loop compiles right.
enum { ROW_MIN = 16 };

static bool row_loop_ok(Emit *e, const int *nodes, int k, int64_t w) {
  for (int t = 0; t < k && w == 16; t++)
    if (ec_node(&e->core, nodes[t])->dtype == DT_BF16)
      return false;
  return true;
}

static void pw_loop(Emit *e, const int *nodes, int k, int64_t numel, int post_anchor) {
  ec_phase_begin(&e->core);
  Buf b = {0};
  for (int t = 0; t < k; t++)
    ec_bput(&b, "%s%%%d", t ? " " : "", nodes[t]);
  note(e, "elementwise over %lld: %s", (long long)numel, b.s ? b.s : "");
  free(b.s);
  par_for(e, numel, "static");
  int64_t w = ec_last_dim(&e->core, nodes[0]);
  if (w >= ROW_MIN && numel / w >= ROW_MIN && numel % w == 0 && row_loop_ok(e, nodes, k, w)) {
    ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)(numel / w));
    ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)w);
    ec_line(&e->core, "const int64_t i = r * %lld + c;", (long long)w);
    e->core.row_ix = "i";
    e->core.row_r = "r";
    e->core.row_w = w;
  } else {
    ec_enter(&e->core, "for (int64_t i = 0; i < %lld; i++)", (long long)numel);
  }
  e->loop_ix = "i";
  e->loop_n = numel;
  e->post_anchor = post_anchor;
  e->post_ix = "i";
  e->post_inloop = false;
  for (int t = 0; t < k; t++) {
    e->cur_q = nodes[t];
    const char *v = val(e, nodes[t], "i");
    if (!e->core.stored[nodes[t]]) {
      ec_line(&e->core, "b%d[i] = %s;", ptr(e, nodes[t]), ec_store(&e->core, nodes[t], v));
      e->core.stored[nodes[t]] = true;
      e->core.phase_nodes[e->core.nphase++] = nodes[t];
    }
  }
  ec_leave(&e->core);
  if (e->core.row_ix)
    ec_leave(&e->core);
  e->core.row_ix = NULL;
  e->loop_ix = NULL;
  e->post_anchor = -1;
  e->cur_q = -1;
  ec_phase_end(&e->core);
}

// Elementwise loops for a list of nodes, one per distinct size, in order of first appearance.
static void pw_loops(Emit *e, const int *nodes, int k, int post_anchor) {
  bool *done = ec_xcalloc((size_t)k, sizeof *done);
  int *same = ec_xcalloc((size_t)k, sizeof *same);
  for (int t = 0; t < k; t++) {
    if (done[t])
      continue;
    int ns = 0;
    for (int u = t; u < k; u++)
      if (!done[u] && ec_numel(&e->core, nodes[u]) == ec_numel(&e->core, nodes[t])) {
        same[ns++] = nodes[u];
        done[u] = true;
      }
    pw_loop(e, same, ns, ec_numel(&e->core, nodes[t]), post_anchor);
  }
  free(done);
  free(same);
}

static void flush(Emit *e) {
  if (e->core.npending)
    pw_loops(e, e->core.pending, e->core.npending, -1);
  e->core.npending = 0;
}

// Rows of a matrix in memory: row r starts at base + r * stride, base being element `off` of node
// buf's buffer.
typedef struct {
  const char *base;
  int64_t stride;
  int buf;
  int64_t off;
} Rows;

static Rows rows_at(Emit *e, int buf, int64_t off, int64_t stride) {
  return (Rows){off ? str(e, "b%d + %lld", ptr(e, buf), (long long)off) : str(e, "b%d", ptr(e, buf)), stride, buf, off};
}

// n's rows (last axis) in memory: n itself, or a SLICE of the last axis of a tensor in memory (q, k,
// v out of one qkv buffer), read in place with that tensor's stride.
static Rows rows_of(Emit *e, int n) {
  int src;
  int64_t start;
  if (ec_row_slice(&e->core, n, &src, &start))
    return rows_at(e, src, start, ec_last_dim(&e->core, src));
  return rows_at(e, ec_need(&e->core, n), 0, ec_last_dim(&e->core, n));
}

// The rows r of a GEMM's operand as f32: a bf16 operand reads them from its buffer widened into
// w<buf> (emitted here, once per group however many operands read that buffer; wide[] lists the
// buffers to free after the group).
static Rows widened(Emit *e, Rows r, int *wide, int *nwide) {
  if (ec_node(&e->core, r.buf)->dtype != DT_BF16)
    return r;
  bool have = false;
  for (int i = 0; i < *nwide; i++)
    have |= wide[i] == r.buf;
  if (!have) {
    e->uses_h = true;
    ec_line(&e->core, "float *const w%d = mdl_widen_bf16(b%d, %lld, h->nthreads);", r.buf, ptr(e, r.buf),
            (long long)ec_numel(&e->core, r.buf));
    wide[(*nwide)++] = r.buf;
  }
  r.base = r.off ? str(e, "w%d + %lld", r.buf, (long long)r.off) : str(e, "w%d", r.buf);
  return r;
}

static void free_widened(Emit *e, const int *wide, int nwide) {
  for (int i = 0; i < nwide; i++)
    ec_line(&e->core, "mdl_free(w%d);", wide[i]);
}

// Evaluates the post outputs inside the anchor's own loop, where the anchor's value at index ix is
// the expression y.
static void post_inloop(Emit *e, int anchor, const int *q, int nq, const char *ix, int64_t n, const char *y) {
  e->loop_ix = ix;
  e->loop_n = n;
  e->post_anchor = anchor;
  e->post_ix = ix;
  e->post_inloop = true;
  ec_memo_put(&e->core, anchor, ec_numel(&e->core, anchor) == 1 ? "0" : ix, y);
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
      ec_line(&e->core, "#pragma omp parallel num_threads(h->nthreads)");
      e->uses_h = true;
    }
    ec_enter(&e->core, "%s", "");
    for (int i = 0; i < ntmp; i++)
      ec_line(&e->core, "float *%s = mdl_scratch(%lld * sizeof(float));", tmp[i].name, (long long)tmp[i].n);
    if (par)
      ec_line(&e->core, "#pragma omp for schedule(static)");
  } else {
    par_for(e, work, "static");
  }
  ec_enter(&e->core, "for (int64_t %s = 0; %s < %lld; %s++)", var, var, (long long)rows, var);
}

static void rows_close(Emit *e, const Tmp *tmp, int ntmp) {
  ec_leave(&e->core);
  if (ntmp) {
    for (int i = 0; i < ntmp; i++)
      ec_line(&e->core, "mdl_free(%s);", tmp[i].name);
    ec_leave(&e->core);
  }
}

// Inside a row loop over r: a pointer named `name` to row r of x (cols wide), computed inline into
// the per-thread row `tmp` when x is not in memory.
static void row_ptr(Emit *e, int x, const char *name, const char *tmp, int64_t cols) {
  int a = ec_mem_alias(&e->core, x);
  if (a >= 0) {
    ec_line(&e->core, "const %s *%s = b%d + r * %lld;", ec_ctype(&e->core, a), name, ptr(e, a), (long long)cols);
    return;
  }
  ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
  ec_line(&e->core, "const int64_t ix = r * %lld + j;", (long long)cols);
  const char *save = e->loop_ix;
  int64_t save_n = e->loop_n;
  e->loop_ix = "ix";
  e->loop_n = ec_numel(&e->core, x);
  ec_line(&e->core, "%s[j] = %s;", tmp, val(e, x, "ix"));
  e->loop_ix = save;
  e->loop_n = save_n;
  ec_leave(&e->core);
  ec_line(&e->core, "const float *%s = %s;", name, tmp);
}

// Is x read inline (not in memory)? Then the row loop needs a scratch row for it.
static bool row_inline(Emit *e, int x) {
  if (ec_mem_alias(&e->core, x) >= 0)
    return false;
  int c = ec_canon(&e->core, x);
  if (e->core.in_step[c] && ec_is_pointwise(ec_node(&e->core, c)->op))
    return true;
  ec_need(&e->core, x); // a constant or an anchor kept as a local: in memory first
  return false;
}

// The output buffer of a row-wise or reducing anchor: whole (arena slot or scratch) when it is an
// output or read at other indices; otherwise only a per-thread row (or a local) exists.
static bool whole(Emit *e, int a) {
  if (ec_offset(&e->core, a) >= 0)
    return true;
  if (e->core.spill[a]) {
    e->core.scratch[a] = true;
    return true;
  }
  return false;
}

//
// Anchors.
//

// One GEMM (or one per batch) through fn (mdl_gemm or mdl_bgemm) into buffer c.
static void gemm_call(Emit *e, const char *fn, bool ta, bool tb, int64_t m, int64_t n, int64_t k, Rows a, Rows b,
                      int c, Shape so, Shape sa, Shape sb, int64_t batches) {
  if (batches == 1) {
    ec_line(&e->core, "%s(h, %d, %d, %lld, %lld, %lld, %s, %lld, %s, %lld, 0.0f, b%d, %lld);", fn, ta, tb,
            (long long)m, (long long)n, (long long)k, a.base, (long long)a.stride, b.base, (long long)b.stride, c,
            (long long)n);
    return;
  }
  Shape ob = so, ab = sa, bb = sb;
  ob.rank -= 2, ab.rank -= 2, bb.rank -= 2;
  ec_enter(&e->core, "for (int64_t t = 0; t < %lld; t++)", (long long)batches);
  const char *ia = ec_ix_bcast(&e->core, ob, ab, "t"), *ib = ec_ix_bcast(&e->core, ob, bb, "t");
  ec_line(&e->core,
          "%s(h, %d, %d, %lld, %lld, %lld, %s + %s * %lld, %lld, %s + %s * %lld, %lld, 0.0f, b%d + t * %lld, %lld);",
          fn, ta, tb, (long long)m, (long long)n, (long long)k, a.base, ia, (long long)(m * k), (long long)a.stride,
          b.base, ib, (long long)(k * n), (long long)b.stride, c, (long long)(m * n), (long long)n);
  ec_leave(&e->core);
}

static void emit_gemm(Emit *e, int gi, const bool *emitted) {
  int mm = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, mm);
  Shape sa = ec_node(&e->core, nd->in[0])->shape, sb = ec_node(&e->core, nd->in[1])->shape, so = nd->shape;
  bool ta = nd->ia[0], tb = nd->ia[1];
  int64_t m = so.d[so.rank - 2], n = so.d[so.rank - 1], k = ta ? sa.d[sa.rank - 2] : sa.d[sa.rank - 1];
  Rows a, b;
  if (so.rank == 2) {
    a = rows_of(e, nd->in[0]);
    b = rows_of(e, nd->in[1]);
  } else {
    a = rows_at(e, ec_need(&e->core, nd->in[0]), 0, sa.d[sa.rank - 1]);
    b = rows_at(e, ec_need(&e->core, nd->in[1]), 0, sb.d[sb.rank - 1]);
  }
  flush(e);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, mm), emitted, q);
  // The product is f32: it may be written into an f32 output of the epilogue only.
  if (ec_offset(&e->core, mm) < 0) {
    for (int t = 0; t < nq && !e->core.spill[mm] && e->core.host[mm] < 0; t++)
      if (ec_offset(&e->core, q[t]) >= 0 && ec_node(&e->core, q[t])->dtype == DT_F32)
        e->core.host[mm] = q[t];
    if (e->core.host[mm] < 0)
      e->core.scratch[mm] = true;
  }
  int c = ptr(e, mm);
  int64_t batches = ec_span(so, 0, so.rank - 2);
  e->uses_h = true;
  ec_phase_begin(&e->core);
  // bf16 operands: the library's bf16 GEMM where the runtime has one (h->bgemm), else an f32 GEMM of
  // the operands widened, in a scope of its own.
  bool a16 = ec_node(&e->core, nd->in[0])->dtype == DT_BF16, b16 = ec_node(&e->core, nd->in[1])->dtype == DT_BF16;
  bool bf16 = a16 && b16, mixed = a16 != b16;
  int wide[2], nwide = 0;
  note(e, "gemm %%%d: [%lld x %lld] = %s[%lld x %lld] %s[%lld x %lld]%s%s%s", mm, (long long)m, (long long)n,
       ta ? "T" : "", (long long)m, (long long)k, tb ? "T" : "", (long long)k, (long long)n,
       bf16 ? ", bf16 operands (widened to f32 where the library has no bf16 GEMM)"
            : mixed ? ", a bf16 operand widened to f32" : "",
       batches > 1 ? str(e, ", %lld batches", (long long)batches) : "", nq ? ", epilogue after" : "");
  if (bf16) {
    ec_enter(&e->core, "if (h->bgemm)");
    gemm_call(e, "mdl_bgemm", ta, tb, m, n, k, a, b, c, so, sa, sb, batches);
    ec_leave(&e->core);
    ec_enter(&e->core, "else");
  } else if (mixed)
    ec_enter(&e->core, "%s", "");
  if (bf16 || mixed) {
    a = widened(e, a, wide, &nwide);
    b = widened(e, b, wide, &nwide);
  }
  gemm_call(e, "mdl_gemm", ta, tb, m, n, k, a, b, c, so, sa, sb, batches);
  if (bf16 || mixed) {
    free_widened(e, wide, nwide);
    ec_leave(&e->core);
  }
  ec_phase_done(&e->core, mm);
  ec_phase_end(&e->core);
  if (nq && !ec_reduction_after(&e->core, gi, emitted, ec_numel(&e->core, mm)))
    pw_loop(e, q, nq, ec_numel(&e->core, mm), mm);
  free(q);
}

// The accumulation of one value v into acc: a sum, or a max where a NaN wins (as in interp.c).
static void accumulate(Emit *e, bool max) {
  if (max) {
    ec_line(&e->core, "if (v > acc || isnan(v))");
    ec_line(&e->core, "  acc = isnan(acc) ? acc : v;");
  } else {
    ec_line(&e->core, "acc += v;");
  }
}

// Output r of a reduction from its accumulator: stored, then the outputs computed after it.
static void reduce_finish(Emit *e, int a, bool buf, const int *q, int nq) {
  const IrNode *nd = ec_node(&e->core, a);
  int64_t len = ec_node(&e->core, nd->in[0])->shape.d[nd->ia[0]];
  if (nd->op == OP_MEAN)
    ec_line(&e->core, "const float y = (float)(acc / %lld);", (long long)len);
  else if (nd->op == OP_TARGET_COUNT)
    ec_line(&e->core, "const float y = (float)(acc > 1.0 ? acc : 1.0);");
  else
    ec_line(&e->core, "const float y = (float)acc;");
  if (buf)
    ec_line(&e->core, "b%d[r] = y;", ptr(e, a));
  post_inloop(e, a, q, nq, "r", ec_numel(&e->core, a), "y");
}

// SUM / MEAN / MAX over one axis, the input computed inline; TARGET_COUNT as a sum over all its
// targets of 1 for each counted one. Many outputs: one task per output. Few outputs over many
// elements: partial results per fixed block of the reduced axis (of rows, for column sums), combined
// in block order.
static void emit_reduce(Emit *e, int gi, const bool *emitted) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int x = nd->in[0];
  Shape s = ec_node(&e->core, x)->shape;
  if (nd->op == OP_TARGET_COUNT) // (over every target)
    s = (Shape){.rank = 1, .d = {ec_numel(&e->core, x)}};
  int ax = (int)nd->ia[0];
  int64_t outer = ec_span(s, 0, ax), len = s.d[ax], inner = ec_span(s, ax + 1, s.rank), on = outer * inner;
  bool max = nd->op == OP_MAX, buf = whole(e, a);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, on, emitted, q);
  int *side = ec_xcalloc((size_t)e->core.g->n, sizeof *side);
  int nside = ec_side_set(&e->core, gi, ec_numel(&e->core, x), emitted, side);
  const char *acc_t = max ? "float" : "double", *init = max ? "-INFINITY" : "0.0";
  ec_phase_begin(&e->core);
  if ((inner == 1 && (outer >= 16 || len < 4096)) || (inner > 1 && outer > 1)) {
    note(e, "%s %%%d: %lld outputs, each over %lld elements", op_name(nd->op), a, (long long)on, (long long)len);
    par_for(e, on * len, "static");
    ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)on);
    if (inner == 1)
      ec_line(&e->core, "const int64_t base = r * %lld;", (long long)len);
    else
      ec_line(&e->core, "const int64_t base = r / %lld * %lld + r %% %lld;", (long long)inner, (long long)(len * inner),
              (long long)inner);
    ec_line(&e->core, "%s acc = %s;", acc_t, init);
    ec_enter(&e->core, "for (int64_t l = 0; l < %lld; l++)", (long long)len);
    if (inner == 1)
      ec_line(&e->core, "const int64_t ix = base + l;");
    else
      ec_line(&e->core, "const int64_t ix = base + l * %lld;", (long long)inner);
    e->loop_ix = "ix";
    e->loop_n = ec_numel(&e->core, x);
    ec_reduce_input(&e->core, a, side, nside);
    accumulate(e, max);
    ec_leave(&e->core);
    reduce_finish(e, a, buf, q, nq);
    ec_leave(&e->core);
  } else {
    bool col = inner > 1;
    int64_t bl = (len + 63) / 64, least = col ? 16 : 1024;
    if (bl < least)
      bl = least;
    int64_t nb = (len + bl - 1) / bl;
    note(e, "%s %%%d: %lld outputs over %lld elements, in %lld blocks of %lld", op_name(nd->op), a, (long long)on,
         (long long)len, (long long)nb, (long long)bl);
    ec_line(&e->core, "%s *part = mdl_scratch(%lld * sizeof(%s));", acc_t, (long long)(nb * on), acc_t);
    e->loop_ix = "ix";
    e->loop_n = ec_numel(&e->core, x);
    if (col) {
      par_for(e, len * inner, "static");
      ec_enter(&e->core, "for (int64_t k = 0; k < %lld; k++)", (long long)nb);
      ec_line(&e->core, "%s *p = part + k * %lld;", acc_t, (long long)inner);
      ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)inner);
      ec_line(&e->core, "  p[c] = %s;", init);
      ec_line(&e->core, "const int64_t end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", (long long)bl,
              (long long)bl, (long long)len, (long long)bl, (long long)bl, (long long)len);
      ec_enter(&e->core, "for (int64_t l = k * %lld; l < end; l++)", (long long)bl);
      ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)inner);
      ec_line(&e->core, "const int64_t ix = l * %lld + c;", (long long)inner);
      e->core.row_ix = "ix";
      e->core.row_r = "l";
      e->core.row_w = inner;
      ec_reduce_input(&e->core, a, side, nside);
      e->core.row_ix = NULL;
      if (max) {
        ec_line(&e->core, "float acc = p[c];");
        accumulate(e, max);
        ec_line(&e->core, "p[c] = acc;");
      } else {
        ec_line(&e->core, "p[c] += v;");
      }
      ec_leave(&e->core);
      ec_leave(&e->core);
      ec_leave(&e->core);
    } else {
      par_for(e, on * len, "static");
      ec_enter(&e->core, "for (int64_t t = 0; t < %lld; t++)", (long long)(on * nb));
      ec_line(&e->core, "const int64_t r = t / %lld, l0 = t %% %lld * %lld;", (long long)nb, (long long)nb,
              (long long)bl);
      ec_line(&e->core, "const int64_t end = l0 + %lld < %lld ? l0 + %lld : %lld;", (long long)bl, (long long)len,
              (long long)bl, (long long)len);
      ec_line(&e->core, "%s acc = %s;", acc_t, init);
      ec_enter(&e->core, "for (int64_t l = l0; l < end; l++)");
      ec_line(&e->core, "const int64_t ix = r * %lld + l;", (long long)len);
      ec_reduce_input(&e->core, a, side, nside);
      accumulate(e, max);
      ec_leave(&e->core);
      ec_line(&e->core, "part[t] = acc;");
      ec_leave(&e->core);
    }
    par_for(e, on * nb * (nq + 1), "static");
    ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)on);
    ec_line(&e->core, "%s acc = %s;", acc_t, init);
    ec_enter(&e->core, "for (int64_t k = 0; k < %lld; k++)", (long long)nb);
    if (col)
      ec_line(&e->core, "const %s v = part[k * %lld + r];", acc_t, (long long)inner);
    else
      ec_line(&e->core, "const %s v = part[r * %lld + k];", acc_t, (long long)nb);
    accumulate(e, max);
    ec_leave(&e->core);
    reduce_finish(e, a, buf, q, nq);
    ec_leave(&e->core);
    ec_line(&e->core, "mdl_free(part);");
  }
  e->loop_ix = NULL;
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
  free(side);
}

// LAYERNORM / RMSNORM forward, one row per iteration; x (the residual sum) computed inline.
static void emit_norm_fwd(Emit *e, int gi, const bool *emitted) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool ln = nd->op == OP_LAYERNORM;
  int64_t cols = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / cols;
  bool xin = row_inline(e, nd->in[0]);
  int w = ec_need(&e->core, nd->in[1]), bias = ln ? ec_need(&e->core, nd->in[2]) : -1;
  flush(e);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), emitted, q);
  bool buf = whole(e, a);
  Tmp tmp[2];
  int ntmp = 0;
  if (xin)
    tmp[ntmp++] = (Tmp){"xrow", cols};
  if (!buf)
    tmp[ntmp++] = (Tmp){"yrow", cols};
  ec_phase_begin(&e->core);
  note(e, "%s %%%d: %lld rows of %lld", op_name(nd->op), a, (long long)rows, (long long)cols);
  rows_open(e, "r", rows, rows * cols, tmp, ntmp);
  row_ptr(e, nd->in[0], "x", "xrow", cols);
  if (ln) {
    ec_line(&e->core, "double mean = 0, var = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : mean)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  mean += x[j];");
    ec_line(&e->core, "mean /= %lld;", (long long)cols);
    ec_line(&e->core, "#pragma omp simd reduction(+ : var)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  var += (x[j] - mean) * (x[j] - mean);");
    ec_line(&e->core, "const double rstd = 1.0 / sqrt(var / %lld + %s);", (long long)cols,
            ec_dlit(&e->core, nd->fa[0]));
  } else {
    ec_line(&e->core, "double ms = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : ms)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  ms += (double)x[j] * x[j];");
    ec_line(&e->core, "const double s = 1.0 / sqrt(ms / %lld + %s);", (long long)cols, ec_dlit(&e->core, nd->fa[0]));
  }
  if (buf)
    ec_line(&e->core, "float *y = b%d + r * %lld;", ptr(e, a), (long long)cols);
  else
    ec_line(&e->core, "float *y = yrow;");
  ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
  if (ln)
    ec_line(&e->core, "  y[j] = (float)((x[j] - mean) * rstd * b%d[j] + b%d[j]);", ptr(e, w), ptr(e, bias));
  else
    ec_line(&e->core, "  y[j] = (float)(x[j] * s * b%d[j]);", ptr(e, w));
  if (nq) {
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "const int64_t ix = r * %lld + j;", (long long)cols);
    post_inloop(e, a, q, nq, "ix", ec_numel(&e->core, a), "y[j]");
    ec_leave(&e->core);
  }
  rows_close(e, tmp, ntmp);
  e->loop_ix = NULL;
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
}

// LAYERNORM_BWD / RMSNORM_BWD siblings: dx per row; dw (and db) as column sums in double over fixed
// blocks of rows, added in block order.
static void emit_norm_bwd(Emit *e, int gi, const bool *emitted) {
  const Group *gr = &e->core.groups[gi];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  bool ln = nd->op == OP_LAYERNORM_BWD;
  int dx, dw, db, sums[EC_MAX_COLSUMS], nsum = ec_norm_members(&e->core, gi, &dx, &dw, &db, sums);
  int x = nd->in[0], dy = nd->in[2];
  int64_t cols = ec_last_dim(&e->core, x), rows = ec_numel(&e->core, x) / cols;
  bool xin = row_inline(e, x), dyin = row_inline(e, dy);
  int w = ec_need(&e->core, nd->in[1]);
  flush(e);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = dx >= 0 ? ec_post_set(&e->core, gi, ec_numel(&e->core, dx), emitted, q) : 0;
  bool dxbuf = dx >= 0 && whole(e, dx);
  bool cols_sum = dw >= 0 || db >= 0 || nsum > 0;
  Tmp tmp[3];
  int ntmp = 0;
  if (xin)
    tmp[ntmp++] = (Tmp){"xrow", cols};
  if (dyin)
    tmp[ntmp++] = (Tmp){"dyrow", cols};
  if (dx >= 0 && !dxbuf)
    tmp[ntmp++] = (Tmp){"dxrow", cols};
  int64_t bl = (rows + 63) / 64 < 16 ? 16 : (rows + 63) / 64, nb = (rows + bl - 1) / bl;
  ec_phase_begin(&e->core);
  note(e, "%s: %lld rows of %lld%s", op_name(nd->op), (long long)rows, (long long)cols,
       cols_sum ? str(e, ", column sums over %lld blocks of %lld rows", (long long)nb, (long long)bl) : "");
  if (cols_sum) {
    if (dw >= 0)
      ec_line(&e->core, "double *pdw = mdl_scratch(%lld * sizeof(double));", (long long)(nb * cols));
    if (db >= 0)
      ec_line(&e->core, "double *pdb = mdl_scratch(%lld * sizeof(double));", (long long)(nb * cols));
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "double *ps%d = mdl_scratch(%lld * sizeof(double)); // partials of the column sum %%%d", i,
              (long long)(nb * cols), sums[i]);
    rows_open(e, "k", nb, rows * cols, tmp, ntmp);
    if (dw >= 0)
      ec_line(&e->core, "double *sw = pdw + k * %lld;", (long long)cols);
    if (db >= 0)
      ec_line(&e->core, "double *sb = pdb + k * %lld;", (long long)cols);
    Buf zero = {0};
    for (int i = 0; i < nsum; i++) {
      ec_line(&e->core, "double *sa%d = ps%d + k * %lld;", i, i, (long long)cols);
      ec_bput(&zero, "sa%d[j] = ", i);
    }
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  %s%s%s0;", dw >= 0 ? "sw[j] = " : "", db >= 0 ? "sb[j] = " : "", zero.s ? zero.s : "");
    free(zero.s);
    ec_line(&e->core, "const int64_t end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", (long long)bl,
            (long long)bl, (long long)rows, (long long)bl, (long long)bl, (long long)rows);
    ec_enter(&e->core, "for (int64_t r = k * %lld; r < end; r++)", (long long)bl);
  } else {
    rows_open(e, "r", rows, rows * cols, tmp, ntmp);
  }
  row_ptr(e, x, "x", "xrow", cols);
  row_ptr(e, dy, "dy", "dyrow", cols);
  if (ln) {
    ec_line(&e->core, "double mean = 0, var = 0, mg = 0, mgx = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : mean)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  mean += x[j];");
    ec_line(&e->core, "mean /= %lld;", (long long)cols);
    ec_line(&e->core, "#pragma omp simd reduction(+ : var)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  var += (x[j] - mean) * (x[j] - mean);");
    ec_line(&e->core, "const double rstd = 1.0 / sqrt(var / %lld + %s);", (long long)cols,
            ec_dlit(&e->core, nd->fa[0]));
    ec_line(&e->core, "#pragma omp simd reduction(+ : mg, mgx)");
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "const double xhat = (x[j] - mean) * rstd, g = (double)dy[j] * b%d[j];", ptr(e, w));
    ec_line(&e->core, "mg += g;");
    ec_line(&e->core, "mgx += g * xhat;");
    if (dw >= 0)
      ec_line(&e->core, "sw[j] += dy[j] * xhat;");
    if (db >= 0)
      ec_line(&e->core, "sb[j] += dy[j];");
    ec_leave(&e->core);
  } else {
    ec_line(&e->core, "double ms = 0, mgx = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : ms)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  ms += (double)x[j] * x[j];");
    ec_line(&e->core, "const double s = 1.0 / sqrt(ms / %lld + %s);", (long long)cols, ec_dlit(&e->core, nd->fa[0]));
    ec_line(&e->core, "#pragma omp simd reduction(+ : mgx)");
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "mgx += (double)dy[j] * b%d[j] * x[j];", ptr(e, w));
    if (dw >= 0)
      ec_line(&e->core, "sw[j] += (double)dy[j] * x[j] * s;");
    ec_leave(&e->core);
  }
  if (dx >= 0) {
    if (dxbuf)
      ec_line(&e->core, "float *dx = b%d + r * %lld;", ptr(e, dx), (long long)cols);
    else
      ec_line(&e->core, "float *dx = dxrow;");
    if (ln) {
      ec_line(&e->core, "mg /= %lld;", (long long)cols);
      ec_line(&e->core, "mgx /= %lld;", (long long)cols);
      ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
      ec_line(&e->core, "  dx[j] = (float)(rstd * ((double)dy[j] * b%d[j] - mg - (x[j] - mean) * rstd * mgx));",
              ptr(e, w));
    } else {
      ec_line(&e->core, "mgx /= %lld;", (long long)cols);
      ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
      ec_line(&e->core, "  dx[j] = (float)(s * dy[j] * b%d[j] - s * s * s * x[j] * mgx);", ptr(e, w));
    }
    if (nq || nsum) {
      ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
      ec_line(&e->core, "const int64_t ix = r * %lld + j;", (long long)cols);
      post_inloop(e, dx, q, nq, "ix", ec_numel(&e->core, dx), "dx[j]");
      for (int i = 0; i < nsum; i++)
        ec_line(&e->core, "sa%d[j] += %s;", i, e->core.val(&e->core, ec_node(&e->core, sums[i])->in[0], "ix"));
      ec_leave(&e->core);
    }
  }
  if (cols_sum)
    ec_leave(&e->core);
  rows_close(e, tmp, ntmp);
  if (cols_sum) {
    par_for(e, cols * nb, "static");
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    Buf acc = {0};
    if (dw >= 0)
      ec_bput(&acc, "w = 0");
    if (db >= 0)
      ec_bput(&acc, "%sb = 0", acc.len ? ", " : "");
    for (int i = 0; i < nsum; i++)
      ec_bput(&acc, "%sa%d = 0", acc.len ? ", " : "", i);
    ec_line(&e->core, "double %s;", acc.s);
    free(acc.s);
    ec_enter(&e->core, "for (int64_t k = 0; k < %lld; k++)", (long long)nb);
    if (dw >= 0)
      ec_line(&e->core, "w += pdw[k * %lld + j];", (long long)cols);
    if (db >= 0)
      ec_line(&e->core, "b += pdb[k * %lld + j];", (long long)cols);
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "a%d += ps%d[k * %lld + j];", i, i, (long long)cols);
    ec_leave(&e->core);
    if (dw >= 0)
      ec_line(&e->core, "b%d[j] = (float)w;", ptr(e, dw));
    if (db >= 0)
      ec_line(&e->core, "b%d[j] = (float)b;", ptr(e, db));
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "b%d[j] = (float)a%d;", ptr(e, sums[i]), i);
    ec_leave(&e->core);
    if (dw >= 0)
      ec_line(&e->core, "mdl_free(pdw);");
    if (db >= 0)
      ec_line(&e->core, "mdl_free(pdb);");
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "mdl_free(ps%d);", i);
  }
  e->loop_ix = NULL;
  if (dxbuf)
    ec_phase_done(&e->core, dx);
  if (dw >= 0)
    ec_phase_done(&e->core, dw);
  if (db >= 0)
    ec_phase_done(&e->core, db);
  for (int i = 0; i < nsum; i++)
    ec_phase_done(&e->core, sums[i]);
  ec_phase_end(&e->core);
  free(q);
}

// Declares `double sum`, the sum over j in [0, n) of ej = `expr` (stored in dst[j] too unless dst is
// NULL): 16 f32 lanes by the element's place in a block of 256, each block's lanes added into 16
// double lanes, then a fixed tree. The order depends on n alone (not on the alignment that a vector
// loop peels for), the f32 part of each lane sums 16 terms, and the loop vectorizes: a sum in double
// lanes halves the vector width and measured 5-6x slower on the LM head's rows, GCC keeping each
// element's exp in scalar code.
static void exp_sum(Emit *e, int64_t n, const char *expr, const char *dst) {
  ec_line(&e->core, "double sum;");
  ec_enter(&e->core, "%s", "");
  ec_line(&e->core, "double lane[16] = {0};");
  ec_enter(&e->core, "for (int64_t j0 = 0; j0 < %lld; j0 += 256)", (long long)n);
  ec_line(&e->core, "const int64_t j1 = j0 + 256 < %lld ? j0 + 256 : %lld;", (long long)n, (long long)n);
  ec_line(&e->core, "float part[16] = {0};");
  ec_line(&e->core, "int64_t k = j0;");
  ec_enter(&e->core, "for (; k + 16 <= j1; k += 16)");
  ec_enter(&e->core, "for (int64_t u = 0; u < 16; u++)");
  ec_line(&e->core, "const int64_t j = k + u;");
  ec_line(&e->core, "const float ej = %s;", expr);
  if (dst)
    ec_line(&e->core, "%s[j] = ej;", dst);
  ec_line(&e->core, "part[u] += ej;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  if (n % 16) { // the last block's tail (emitted only where there is one: GCC warns of part[] overrun)
    ec_enter(&e->core, "for (int64_t j = k; j < j1; j++)");
    ec_line(&e->core, "const float ej = %s;", expr);
    if (dst)
      ec_line(&e->core, "%s[j] = ej;", dst);
    ec_line(&e->core, "part[j - k] += ej;");
    ec_leave(&e->core);
  }
  ec_line(&e->core, "for (int u = 0; u < 16; u++)");
  ec_line(&e->core, "  lane[u] += part[u];");
  ec_leave(&e->core);
  ec_line(&e->core, "for (int w = 8; w > 0; w /= 2)");
  ec_line(&e->core, "  for (int u = 0; u < w; u++)");
  ec_line(&e->core, "    lane[u] += lane[u + w];");
  ec_line(&e->core, "sum = lane[0];");
  ec_leave(&e->core);
}

// SOFTMAX (x) or SOFTMAX_BWD (y, dy) over the last axis, one row per iteration.
static void emit_softmax(Emit *e, int gi, const bool *emitted) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool bwd = nd->op == OP_SOFTMAX_BWD;
  int64_t cols = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / cols;
  bool in0 = row_inline(e, nd->in[0]), in1 = bwd && row_inline(e, nd->in[1]);
  flush(e);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), emitted, q);
  bool buf = whole(e, a);
  Tmp tmp[3] = {{0}};
  int ntmp = 0;
  if (in0)
    tmp[ntmp++] = (Tmp){"row0", cols};
  if (in1)
    tmp[ntmp++] = (Tmp){"row1", cols};
  if (!buf)
    tmp[ntmp++] = (Tmp){"yrow", cols};
  ec_phase_begin(&e->core);
  note(e, "%s %%%d: %lld rows of %lld", op_name(nd->op), a, (long long)rows, (long long)cols);
  rows_open(e, "r", rows, rows * cols, tmp, ntmp);
  row_ptr(e, nd->in[0], bwd ? "y" : "x", "row0", cols);
  if (bwd)
    row_ptr(e, nd->in[1], "dy", "row1", cols);
  if (buf)
    ec_line(&e->core, "float *out = b%d + r * %lld;", ptr(e, a), (long long)cols);
  else
    ec_line(&e->core, "float *out = yrow;");
  if (bwd) {
    ec_line(&e->core, "double dot = 0;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : dot)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  dot += (double)y[j] * dy[j];");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  out[j] = (float)(y[j] * (dy[j] - dot));");
  } else {
    ec_line(&e->core, "float m = -INFINITY;");
    ec_line(&e->core, "#pragma omp simd reduction(max : m)");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  m = x[j] > m ? x[j] : m;");
    exp_sum(e, cols, "mdl_exp_shifted(x[j] - m)", "out");
    ec_line(&e->core, "const float inv = (float)(1.0 / sum);");
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "  out[j] *= inv;");
  }
  if (nq) {
    ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
    ec_line(&e->core, "const int64_t ix = r * %lld + j;", (long long)cols);
    post_inloop(e, a, q, nq, "ix", ec_numel(&e->core, a), "out[j]");
    ec_leave(&e->core);
  }
  rows_close(e, tmp, ntmp);
  e->loop_ix = NULL;
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
}

// One row of cross-entropy: the loss into `loss` (an lvalue, or NULL) and dloss * (softmax - onehot)
// into the row `dx` (or NULL), for logits row x (bf16 values when x16, widened as they are read) and
// target t; an ignored target (< 0) gives zeros, one >= V an error. With bf16, dx holds the gradient
// rounded to bf16 values (the CAST that the LM head's backward GEMMs read). Each pass is one vector
// loop: the maximum, the exponentials with their sum, then dx = exp * (dloss / sum), the target's
// element less dloss.
static void ce_row(Emit *e, const char *what, int64_t v, bool x16, const char *loss, const char *dx,
                   const char *dloss, bool bf16, bool round_x, const char *dx16) {
  const char *xj = x16 ? "mdl_bf16_to_f32(x[j])" : "x[j]";
  e->uses_h = true;
  ec_enter(&e->core, "if (t < 0 || t >= %lld)", (long long)v);
  ec_line(&e->core, "if (t >= %lld)", (long long)v);
  ec_line(&e->core, "  h->error(h->ctx, \"%s: target\", t, %lld);", what, (long long)v);
  if (loss)
    ec_line(&e->core, "%s = 0.0f;", loss);
  if (dx16)
    ec_line(&e->core, "memset(%s, 0, %lld * sizeof(uint16_t));", dx16, (long long)v);
  else if (dx)
    ec_line(&e->core, "memset(%s, 0, %lld * sizeof(float));", dx, (long long)v);
  ec_line(&e->core, "continue;");
  ec_leave(&e->core);
  if (loss && !round_x)
    ec_line(&e->core, "const float xt = %s; // before dx, which may be x itself, is written",
            x16 ? "mdl_bf16_to_f32(x[t])" : "x[t]");
  ec_line(&e->core, "float m = -INFINITY;");
  ec_line(&e->core, "#pragma omp simd reduction(max : m)");
  ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
  if (round_x) { // the logits rounded to bf16 in place (their CAST) as the maximum is taken
    ec_line(&e->core, "x[j] = mdl_bf16_to_f32(mdl_f32_to_bf16(x[j]));");
    ec_line(&e->core, "m = x[j] > m ? x[j] : m;");
  } else {
    ec_line(&e->core, "const float xv = %s;", xj);
    ec_line(&e->core, "m = xv > m ? xv : m;");
  }
  ec_leave(&e->core);
  if (loss && round_x)
    ec_line(&e->core, "const float xt = x[t]; // before dx, which may be x itself, is written");
  exp_sum(e, v, str(e, "mdl_exp_shifted(%s - m)", xj), dx);
  if (loss)
    ec_line(&e->core, "%s = (float)(m + log(sum) - xt);", loss);
  if (dx) {
    ec_line(&e->core, "const float g = %s, sc = (float)(g / sum), et = %s[t];", dloss, dx);
    if (dx16) { // the gradient rounded to bf16, as the bits the backward GEMMs read (dx is not read again)
      ec_line(&e->core, "#pragma omp simd");
      ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
      ec_line(&e->core, "  %s[j] = mdl_f32_to_bf16(%s[j] * sc);", dx16, dx);
      ec_line(&e->core, "%s[t] = mdl_f32_to_bf16(et * sc - g);", dx16);
    } else {
      ec_line(&e->core, "#pragma omp simd");
      ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)v);
      if (bf16) {
        ec_line(&e->core, "  %s[j] = mdl_bf16_to_f32(mdl_f32_to_bf16(%s[j] * sc));", dx, dx);
        ec_line(&e->core, "%s[t] = mdl_bf16_to_f32(mdl_f32_to_bf16(et * sc - g));", dx);
      } else {
        ec_line(&e->core, "  %s[j] *= sc;", dx);
        ec_line(&e->core, "%s[t] = et * sc - g;", dx);
      }
    }
  }
}

// CROSS_ENTROPY and / or CROSS_ENTROPY_BWD over the same logits: one pass per row.
static void emit_ce(Emit *e, int gi) {
  const Group *gr = &e->core.groups[gi];
  int ce = -1, ceb = -1;
  for (int i = 0; i < gr->nmem; i++)
    *(ec_node(&e->core, gr->mem[i])->op == OP_CROSS_ENTROPY ? &ce : &ceb) = gr->mem[i];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  int64_t v = ec_last_dim(&e->core, nd->in[0]), rows = ec_numel(&e->core, nd->in[1]);
  int lg = ec_need(&e->core, nd->in[0]), tg = ec_need(&e->core, nd->in[1]),
      dl = ceb >= 0 ? ec_need(&e->core, ec_node(&e->core, ceb)->in[2]) : -1;
  flush(e);
  for (int i = 0; i < gr->nmem; i++)
    if (ec_offset(&e->core, gr->mem[i]) < 0)
      e->core.scratch[gr->mem[i]] = true;
  ec_phase_begin(&e->core);
  note(e, "cross-entropy%s: %lld rows of %lld", ceb >= 0 ? (ce >= 0 ? " and its gradient" : " gradient") : "",
       (long long)rows, (long long)v);
  par_for(e, rows * v, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  bool x16 = ec_node(&e->core, lg)->dtype == DT_BF16;
  ec_line(&e->core, "const %s *x = b%d + r * %lld;", x16 ? "uint16_t" : "float", ptr(e, lg), (long long)v);
  ec_line(&e->core, "const int32_t t = b%d[r];", ptr(e, tg));
  if (ceb >= 0)
    ec_line(&e->core, "float *dx = b%d + r * %lld;", ptr(e, ceb), (long long)v);
  ce_row(e, "cross_entropy", v, x16, ce >= 0 ? str(e, "b%d[r]", ptr(e, ce)) : NULL, ceb >= 0 ? "dx" : NULL,
         dl >= 0 ? str(e, "b%d[r]", ptr(e, dl)) : NULL, false, false, NULL);
  ec_leave(&e->core);
  for (int i = 0; i < gr->nmem; i++)
    ec_phase_done(&e->core, gr->mem[i]);
  ec_phase_end(&e->core);
}

// One pass of the LM head's chunks (see emit_lmhead), its GEMMs through gemm: mdl_gemm on f32 x and W
// (xs, ws), or mdl_bgemm on the bf16 ones, dlogits then rounded into the bf16 chunk dl16 for the
// backward GEMMs.
static void lmhead_chunks(Emit *e, const Group *gr, int64_t n, int64_t c, int64_t v, int64_t rc, const char *xs,
                          const char *ws, bool b16) {
  int64_t ldw = gr->tb ? c : v;
  bool bwd = gr->ceb >= 0; // (a graph without a backward: the logits and the loss alone)
  int tg = ec_need(&e->core, gr->tgt), dl = bwd ? ec_need(&e->core, gr->dloss) : -1;
  const char *gemm = b16 ? "mdl_bgemm" : "mdl_gemm", *dlog = b16 ? "dl16" : "logits";
  ec_line(&e->core, "float *logits = mdl_scratch(%lld * sizeof(float));", (long long)(rc * v));
  if (b16 && bwd)
    ec_line(&e->core, "uint16_t *dl16 = mdl_scratch(%lld * sizeof(uint16_t));", (long long)(rc * v));
  ec_enter(&e->core, "for (int64_t r0 = 0; r0 < %lld; r0 += %lld)", (long long)n, (long long)rc);
  ec_line(&e->core, "const int64_t rn = %lld - r0 < %lld ? %lld - r0 : %lld;", (long long)n, (long long)rc,
          (long long)n, (long long)rc);
  ec_line(&e->core, "%s(h, 0, %d, rn, %lld, %lld, %s + r0 * %lld, %lld, %s, %lld, 0.0f, logits, %lld);", gemm, gr->tb,
          (long long)v, (long long)c, xs, (long long)c, (long long)c, ws, (long long)ldw, (long long)v);
  par_for(e, rc * v, "static");
  ec_enter(&e->core, "for (int64_t i = 0; i < rn; i++)");
  ec_line(&e->core, "const int64_t r = r0 + i;");
  ec_line(&e->core, "%sfloat *x = logits + i * %lld;", gr->lc >= 0 ? "" : "const ", (long long)v);
  if (bwd)
    ec_line(&e->core, "float *dx = logits + i * %lld;", (long long)v);
  ec_line(&e->core, "const int32_t t = b%d[r];", ptr(e, tg));
  if (b16 && bwd)
    ec_line(&e->core, "uint16_t *d16 = dl16 + i * %lld;", (long long)v);
  // (the loss reads the logits rounded to bf16, their CAST lc, in place)
  ce_row(e, "cross_entropy", v, false, str(e, "b%d[r]", ptr(e, gr->ce)), bwd ? "dx" : NULL,
         bwd ? str(e, "b%d[r]", ptr(e, dl)) : NULL, gr->dlc >= 0, gr->lc >= 0, b16 && bwd ? "d16" : NULL);
  ec_leave(&e->core);
  if (!bwd) {
    ec_leave(&e->core);
    ec_line(&e->core, "mdl_free(logits);");
    return;
  }
  ec_line(&e->core, "%s(h, 0, %d, rn, %lld, %lld, %s, %lld, %s, %lld, 0.0f, b%d + r0 * %lld, %lld);", gemm, !gr->tb,
          (long long)c, (long long)v, dlog, (long long)v, ws, (long long)ldw, ptr(e, gr->dx), (long long)c,
          (long long)c);
  if (gr->tb)
    ec_line(&e->core, "%s(h, 1, 0, %lld, %lld, rn, %s, %lld, %s + r0 * %lld, %lld, r0 ? 1.0f : 0.0f, b%d, %lld);",
            gemm, (long long)v, (long long)c, dlog, (long long)v, xs, (long long)c, (long long)c, ptr(e, gr->dw),
            (long long)c);
  else
    ec_line(&e->core, "%s(h, 1, 0, %lld, %lld, rn, %s + r0 * %lld, %lld, %s, %lld, r0 ? 1.0f : 0.0f, b%d, %lld);",
            gemm, (long long)c, (long long)v, xs, (long long)c, (long long)c, dlog, (long long)v, ptr(e, gr->dw),
            (long long)v);
  ec_leave(&e->core);
  ec_line(&e->core, "mdl_free(logits);");
  if (b16)
    ec_line(&e->core, "mdl_free(dl16);");
}

// The LM head chunk by chunk: logits rows = x W^T (or x W) into a chunk buffer, cross-entropy and its
// gradient in place, then dx rows = dlogits W (W^T) and dW += dlogits^T x (x^T dlogits). With bf16
// operands, the logits are rounded to bf16 values before the loss reads them (their CAST, lc), and
// dlogits rounded to bf16 values; the GEMMs run on the library's bf16 GEMM where the runtime has one,
// else on x and W widened to f32 once for all the chunks.
static void emit_lmhead(Emit *e, int gi) {
  const Group *gr = &e->core.groups[gi];
  const IrNode *xm = ec_node(&e->core, gr->x);
  int64_t n = xm->shape.d[0], c = xm->shape.d[1], v = ec_last_dim(&e->core, gr->mm);
  int x = ec_need(&e->core, gr->x), w = ec_need(&e->core, gr->w);
  flush(e);
  int outs[3] = {gr->ce, gr->dx, gr->dw}, nout = gr->ceb >= 0 ? 3 : 1;
  for (int i = 0; i < nout; i++)
    if (ec_offset(&e->core, outs[i]) < 0)
      e->core.scratch[outs[i]] = true;
  // Chunks of a multiple of 64 rows: at most 16M logits (64 MB), at most a quarter of the rows but
  // 256 at least. Each chunk's rows are the inner dimension of dW's GEMM, which runs far below the
  // library's rate on a few dozen (GPT-2 124M at B4 T64 in quarters of 64 rows: the LM head at 133
  // GFLOP/s in fp32, 225 in one chunk of 256); and chunks larger than a quarter measured slower at
  // L4 C256 V8192 (1024 rows, 32 MB of logits: 56 ms against 39 in quarters).
  int64_t rc = (16 << 20) / v / 64 * 64, quarter = (n / 4 + 63) / 64 * 64;
  if (rc > quarter)
    rc = quarter > 256 ? quarter : 256;
  if (rc < 64)
    rc = 64;
  if (rc > n)
    rc = n;
  int64_t ldw = gr->tb ? c : v;
  e->uses_h = true;
  ec_phase_begin(&e->core);
  note(e, "LM head: %lld rows x %lld classes from width %lld, in chunks of %lld rows", (long long)n, (long long)v,
       (long long)c, (long long)rc);
  bool b16 = ec_node(&e->core, x)->dtype == DT_BF16 && ec_node(&e->core, w)->dtype == DT_BF16 &&
             (gr->dlc >= 0 || gr->ceb < 0);
  if (b16) {
    ec_enter(&e->core, "if (h->bgemm)");
    lmhead_chunks(e, gr, n, c, v, rc, rows_at(e, x, 0, c).base, rows_at(e, w, 0, ldw).base, true);
    ec_leave(&e->core);
    ec_enter(&e->core, "else");
  }
  int wide[2], nwide = 0;
  const char *xs = widened(e, rows_at(e, x, 0, c), wide, &nwide).base;
  const char *ws = widened(e, rows_at(e, w, 0, ldw), wide, &nwide).base;
  lmhead_chunks(e, gr, n, c, v, rc, xs, ws, false);
  free_widened(e, wide, nwide);
  if (b16)
    ec_leave(&e->core);
  for (int i = 0; i < nout; i++)
    ec_phase_done(&e->core, outs[i]);
  ec_phase_end(&e->core);
}

// Declares `var` as the sum of `expr` (in terms of j) over the keys in [lo, hi), added in 8 lanes by
// the key's place in the range and the lanes then in a fixed tree: an order that depends only on the
// row, and 8 independent chains of additions instead of one.
static void emit_attn_sum(Emit *e, const char *var, const char *expr) {
  ec_line(&e->core, "float %s;", var);
  ec_enter(&e->core, "%s", "");
  ec_line(&e->core, "float part[8] = {0};");
  ec_line(&e->core, "int64_t j0 = lo;");
  ec_enter(&e->core, "for (; j0 + 8 <= hi; j0 += 8)");
  ec_enter(&e->core, "for (int64_t u = 0; u < 8; u++)");
  ec_line(&e->core, "const int64_t j = j0 + u;");
  ec_line(&e->core, "part[u] += %s;", expr);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_enter(&e->core, "for (int64_t j = j0; j < hi; j++)");
  ec_line(&e->core, "part[j - j0] += %s;", expr);
  ec_leave(&e->core);
  ec_line(&e->core, "%s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));",
          var);
  ec_leave(&e->core);
}

// Updates row i's key range [lo, hi) (variables named so, declared [0, T) before row 0, rows visited
// in order): with doc ids, lo is the first key of the row's id and hi - 1 its last, rescanned when the
// id changes from the row before; when causal, hi is i + 1. Declares di, the row's id.
static void emit_attn_range(Emit *e, int64_t nt, bool causal, int doc, const char *lo, const char *hi) {
  if (doc >= 0) {
    ec_line(&e->core, "const int32_t di = dc[i];");
    ec_enter(&e->core, "if (i == 0 || dc[i - 1] != di)");
    ec_line(&e->core, "%s = 0;", lo);
    ec_line(&e->core, "while (dc[%s] != di)", lo);
    ec_line(&e->core, "  %s++;", lo);
    if (!causal) {
      ec_line(&e->core, "%s = %lld;", hi, (long long)nt);
      ec_line(&e->core, "while (dc[%s - 1] != di)", hi);
      ec_line(&e->core, "  %s--;", hi);
    }
    ec_leave(&e->core);
  }
  if (causal)
    ec_line(&e->core, "%s = i + 1;", hi);
}

// Opens the loop over the query rows i of a task's head. The allowed keys of row i lie in [lo, hi):
// with doc ids, lo is the first key of the row's id and hi - 1 its last (row i itself when causal),
// found by scanning the ids when the id changes from the row before (so a key outside the range is
// masked whatever the ids' order; inside, the mask is applied key by key).
static void emit_attn_rows_open(Emit *e, const IrNode *nd, int doc) {
  int64_t nt = ec_node(&e->core, nd->in[0])->shape.d[1];
  ec_line(&e->core, "int64_t lo = 0, hi = %lld;", (long long)nt);
  if (doc >= 0)
    ec_line(&e->core, "const int32_t *restrict dc = b%d + b * %lld;", ptr(e, doc), (long long)nt);
  ec_enter(&e->core, "for (int64_t i = 0; i < %lld; i++)", (long long)nt);
  emit_attn_range(e, nt, nd->ia[1], doc, "lo", "hi");
}

// Keys per block of the score loops, and the padded row length of a transposed [D][T] block (and of
// the per-row buffers): a block that starts at lo < T may run up to lo + ATT_BLK - 1.
enum { ATT_BLK = 32 };
static int64_t attn_padded(int64_t nt) { return (nt + ATT_BLK + 7) / 8 * 8; }

static bool attn_stored16(Emit *e, Rows r) { return ec_node(&e->core, r.buf)->dtype == DT_BF16; }

// Element x of rows r as the products read it: a bf16 value stored (a CAST, precision.c) widened, an
// f32 one rounded when they read bf16 (mdl.h), else as it is.
static const char *attn_read(Emit *e, Rows r, const char *x, bool round) {
  if (attn_stored16(e, r))
    return ec_str(&e->core, "mdl_bf16_to_f32(%s)", x);
  return round ? ec_str(&e->core, "mdl_bf16_to_f32(mdl_f32_to_bf16(%s))", x) : x;
}

// Channel c of row i of the head's part of rows r as the products read it (attn_read).
static const char *attn_elem(Emit *e, Rows r, int64_t nt, int64_t d, bool bf16) {
  return attn_read(e, r, ec_str(&e->core, "%s[(b * %lld + i) * %lld + hd * %lld + c]", r.base, (long long)nt,
                                (long long)r.stride, (long long)d), bf16);
}

// out[j] = sum over c of vec[c] mat[c][j] (mat a transposed [D][padded T] block), in order over c, for
// j in [lo, hi), a block of ATT_BLK keys at a time held in registers (ATT_BLK / 8 independent chains);
// the block's tail past hi computes harmless values from the zeroed padding or later keys.
static void emit_attn_dots(Emit *e, const char *out, const char *vec, const char *mat, int64_t nt, int64_t d) {
  ec_enter(&e->core, "for (int64_t j0 = lo; j0 < hi; j0 += %d)", ATT_BLK);
  ec_line(&e->core, "float acc[%d] = {0};", ATT_BLK);
  ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "const float vc = %s[c], *restrict mc = %s + c * %lld + j0;", vec, mat, (long long)attn_padded(nt));
  ec_line(&e->core, "#pragma omp simd");
  ec_line(&e->core, "for (int64_t u = 0; u < %d; u++)", ATT_BLK);
  ec_line(&e->core, "  acc[u] += vc * mc[u];");
  ec_leave(&e->core);
  ec_line(&e->core, "memcpy(%s + j0, acc, sizeof acc);", out);
  ec_leave(&e->core);
}

// Row i of a task that owns (b, hd), with the keys of the head transposed into kt [D][T] (so score
// loops run over keys, contiguous, each score summed over the head's columns in order): s[j] becomes
// exp(scale q_i . k_j - max) for the allowed keys in [lo, hi) and 0 for the others, and l their sum;
// given the row's log-sum-exp `lse` (the backward), s[j] becomes the probability exp(S - lse).
static void emit_attn_row(Emit *e, const IrNode *nd, Rows q, int doc, const char *lse) {
  Shape qs = ec_node(&e->core, nd->in[0])->shape;
  int64_t nt = qs.d[1], d = qs.d[2] / nd->ia[0];
  if (nd->ia[4] == DT_BF16) { // q_i rounded to bf16, or stored so (the keys were rounded when transposed)
    ec_line(&e->core, "float qr[%lld];", (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  qr[c] = %s;", attn_elem(e, q, nt, d, true));
    ec_line(&e->core, "const float *restrict qi = qr;");
  } else {
    ec_line(&e->core, "const float *restrict qi = %s + (b * %lld + i) * %lld + hd * %lld;", q.base, (long long)nt,
            (long long)q.stride, (long long)d);
  }
  emit_attn_dots(e, "s", "qi", "kt", nt, d);
  if (lse) {
    ec_line(&e->core, "const float lse = %s;", lse);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = lo; j < hi; j++)");
    if (doc >= 0)
      ec_line(&e->core, "  s[j] = dc[j] == di ? mdl_exp_shifted(s[j] * %s - lse) : 0.0f;", flit(e, nd->fa[0]));
    else
      ec_line(&e->core, "  s[j] = mdl_exp_shifted(s[j] * %s - lse);", flit(e, nd->fa[0]));
    return;
  }
  ec_line(&e->core, "float m = -INFINITY;");
  ec_line(&e->core, "#pragma omp simd reduction(max : m)");
  ec_enter(&e->core, "for (int64_t j = lo; j < hi; j++)");
  if (doc >= 0)
    ec_line(&e->core, "s[j] = dc[j] == di ? s[j] * %s : -INFINITY;", flit(e, nd->fa[0]));
  else
    ec_line(&e->core, "s[j] *= %s;", flit(e, nd->fa[0]));
  ec_line(&e->core, "m = s[j] > m ? s[j] : m;");
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma omp simd");
  ec_line(&e->core, "for (int64_t j = lo; j < hi; j++)");
  ec_line(&e->core, "  s[j] = mdl_exp_shifted(s[j] - m);");
  emit_attn_sum(e, "l", "s[j]");
}

// Copies the head's rows of a [B,T,C] matrix into a [D][T] block (rounded to bf16 with `round`;
// widened when stored as bf16, precision.c).
static void emit_attn_transpose(Emit *e, const char *dst, Rows x, int64_t nt, int64_t d, bool round) {
  bool x16 = attn_stored16(e, x);
  ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)nt);
  ec_line(&e->core, "const %s *xj = %s + (b * %lld + j) * %lld + hd * %lld;", x16 ? "uint16_t" : "float", x.base,
          (long long)nt, (long long)x.stride, (long long)d);
  ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  %s[c * %lld + j] = %s;", dst, (long long)attn_padded(nt), attn_read(e, x, "xj[c]", round));
  ec_leave(&e->core);
}

// Opens the parallel region of an attention kernel, with per-thread scratch, and its loop over the
// (batch, head) tasks; a task owns every output row of its head, so tasks never race and each output
// is computed by one sequence of operations whatever the thread count.
static void emit_attn_open(Emit *e, int64_t nb, int64_t heads, bool par, const Tmp *tmp, int ntmp) {
  if (par) {
    ec_line(&e->core, "#pragma omp parallel num_threads(h->nthreads)");
    e->uses_h = true;
  }
  ec_enter(&e->core, "%s", "");
  for (int i = 0; i < ntmp; i++)
    ec_line(&e->core, "float *restrict %s = memset(mdl_scratch(%lld * sizeof(float)), 0, %lld * sizeof(float));",
            tmp[i].name, (long long)tmp[i].n, (long long)tmp[i].n);
  if (par)
    ec_line(&e->core, "#pragma omp for schedule(dynamic, 1)");
  ec_enter(&e->core, "for (int64_t task = 0; task < %lld; task++)", (long long)(nb * heads));
  ec_line(&e->core, "const int64_t b = task / %lld, hd = task %% %lld;", (long long)heads, (long long)heads);
}

static void emit_attn_close(Emit *e, const Tmp *tmp, int ntmp) {
  ec_leave(&e->core);
  for (int i = 0; i < ntmp; i++)
    ec_line(&e->core, "mdl_free(%s);", tmp[i].name);
  ec_leave(&e->core);
}

// Declares acc0[D] and acc1[D] (for acc = "acc") whose sum is that over the keys j in [lo, hi) of
// w[j] x_j (x_j the head's part of row j of x): keys taken in pairs, the even and odd keys of the
// range in two accumulators, two chains of FMAs held in registers; the caller adds them.
// With round_w / round_x (bf16 attention, mdl.h) the weights / the rows are read rounded to bf16
// (rows stored as bf16, precision.c, are widened).
static void emit_attn_pairs(Emit *e, const char *acc, const char *w, Rows x, int64_t nt, int64_t d, bool round_w,
                            bool round_x) {
  const char *row = str(e, "%s + (b * %lld + j) * %lld + hd * %lld", x.base, (long long)nt, (long long)x.stride,
                        (long long)d);
  const char *w0 = str(e, "%s[j]", w), *w1 = str(e, "%s[j + 1]", w);
  if (round_w)
    w0 = str(e, "mdl_bf16_to_f32(mdl_f32_to_bf16(%s))", w0), w1 = str(e, "mdl_bf16_to_f32(mdl_f32_to_bf16(%s))", w1);
  const char *x0 = attn_read(e, x, "x0[c]", round_x), *x1 = attn_read(e, x, "x1[c]", round_x);
  const char *xt = attn_stored16(e, x) ? "uint16_t" : "float";
  ec_line(&e->core, "float %s0[%lld] = {0}, %s1[%lld] = {0};", acc, (long long)d, acc, (long long)d);
  ec_line(&e->core, "int64_t j = lo;");
  ec_enter(&e->core, "for (; j + 1 < hi; j += 2)");
  ec_line(&e->core, "const float w0 = %s, w1 = %s;", w0, w1);
  ec_line(&e->core, "const %s *restrict x0 = %s, *restrict x1 = x0 + %lld;", xt, row, (long long)x.stride);
  ec_line(&e->core, "#pragma omp simd");
  ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "%s0[c] += w0 * %s;", acc, x0);
  ec_line(&e->core, "%s1[c] += w1 * %s;", acc, x1);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_enter(&e->core, "if (j < hi)");
  ec_line(&e->core, "const float w0 = %s;", w0);
  ec_line(&e->core, "const %s *restrict x0 = %s;", xt, row);
  ec_line(&e->core, "#pragma omp simd");
  ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  %s0[c] += w0 * %s;", acc, x0);
  ec_leave(&e->core);
}

// Attention through the GEMM library. A task owns a (batch, head) and walks its query rows in blocks
// of ATT_ROWS; each block's scores against the keys it may attend ([klo, khi): up to the block's last
// row when causal, from the first key of any of its rows' documents rounded down to a multiple of
// ATT_ROWS, so that a step meets few GEMM shapes whatever the documents) are one GEMM, the softmax
// runs over the block's rows in f32 (over each row's own keys only: the others are zeroed), and the
// weighted sum of values is a second GEMM; the backward recomputes the block's probabilities from the
// forward's log-sum-exp and takes dP, dQ, dK and dV as four GEMMs, dK and dV summed over the blocks
// in the task's own [T][D] buffers. The blocks and the products' shapes follow T alone, so the values
// do not depend on the thread count. Products of bf16 attention (mdl.h) run on the library's bf16
// GEMM (h->bgemm) on operands staged as bf16 bits, else on f32 operands staged as bf16 values; an f32
// attention reads its rows in place, except the keys and values, which the scores and dP GEMMs read
// transposed: those are packed [T][D] per task. Measured with oneDNN's sgemm on one core, 64-row
// blocks, D 64: Q K^T 123 -> 168 GFLOP/s with K packed (NN with V packed 155 -> 163, TN with dout
// packed 144 -> 155, which repays its copy less, so dout and q stay in place).
enum { ATT_ROWS = 64 };

// Whether attention over T keys of heads of D channels runs through the GEMM library, else through
// the row loops below. Measured (`--profile`, the attention kernels of a step, loops -> GEMMs):
// L4 C256 (D 64) B2 T512 55.6 -> 23.4 ms in bf16, 50.6 -> 28.1 in fp32; B8 T128 16.1 -> 10.6 and
// 15.1 -> 11.9; GPT-2 124M B4 T64 19.1 -> 19.9 (even); gpt2-tiny (D 16, T 64) 0.7 -> 1.0.
static bool attn_by_gemm(int64_t nt, int64_t d) { return nt >= 128 && d >= 32; }

// A GEMM operand: the head's rows at p (elements of the GEMM's type), row r at p + r * ld.
typedef struct {
  const char *p;
  int64_t ld;
} Opnd;

// The head's part of rows r (rows [0, T) of batch b, columns hd * D ...) as an operand of GEMMs of
// bf16 bits (g16) or of f32: in place where stored that way (and, with pack, contiguous), else copied
// into buf ([T][D]), rounded to bf16 where bf16 attention reads it rounded.
static Opnd attn_operand(Emit *e, Rows r, int64_t nt, int64_t d, bool bf16, bool g16, bool pack, const char *buf) {
  bool x16 = attn_stored16(e, r);
  const char *head = str(e, "%s + b * %lld + hd * %lld", r.base, (long long)(nt * r.stride), (long long)d);
  if (((g16 && x16) || (!g16 && !bf16 && !x16)) && (!pack || r.stride == d))
    return (Opnd){head, r.stride};
  const char *ot = g16 ? "uint16_t" : "float", *val;
  if (g16)
    val = x16 ? "x[c]" : "mdl_f32_to_bf16(x[c])";
  else
    val = attn_read(e, r, "x[c]", bf16);
  ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)nt);
  ec_line(&e->core, "const %s *restrict x = %s + j * %lld;", x16 ? "uint16_t" : "float", head, (long long)r.stride);
  ec_line(&e->core, "%s *restrict y = (%s *)%s + j * %lld;", ot, ot, buf, (long long)d);
  ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  y[c] = %s;", val);
  ec_leave(&e->core);
  return (Opnd){str(e, "(const %s *)%s", ot, buf), d};
}

// One single-threaded GEMM of the task: C = op(A) op(B) + beta C, row-major; leading dimensions as
// code (a block's scores are packed nk to a row).
static void attn_gemm(Emit *e, bool g16, int ta, int tb, const char *m, const char *n, const char *k, const char *a,
                      const char *lda, const char *b, const char *ldb, const char *beta, const char *c,
                      const char *ldc) {
  ec_line(&e->core, "h->%s(%d, %d, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s);", g16 ? "bgemm" : "sgemm", ta, tb, m, n, k,
          a, lda, b, ldb, beta, c, ldc);
}

// An operand's rows from row r0 (code) on, and its leading dimension, as code.
static const char *op_at(Emit *e, Opnd o, const char *r0) { return str(e, "%s + %s * %lld", o.p, r0, (long long)o.ld); }
static const char *op_ld(Emit *e, Opnd o) { return str(e, "%lld", (long long)o.ld); }

// Opens the loop over the task's query blocks [i0, i1) and declares its keys [klo, khi), nk of them.
static void attn_blocks_open(Emit *e, int64_t nt, bool causal, int doc) {
  ec_line(&e->core, "int64_t rlo = 0, rhi = %lld;", (long long)nt);
  ec_enter(&e->core, "for (int64_t i0 = 0; i0 < %lld; i0 += %d)", (long long)nt, ATT_ROWS);
  ec_line(&e->core, "const int64_t i1 = i0 + %d < %lld ? i0 + %d : %lld, nr = i1 - i0;", ATT_ROWS, (long long)nt,
          ATT_ROWS, (long long)nt);
  ec_line(&e->core, "int64_t klo = %s;", doc >= 0 && causal ? "i0" : "0");
  if (doc >= 0 && causal) { // the first key of each row's document: its id's first place
    ec_line(&e->core, "for (int64_t i = i0; i < i1; i++)");
    ec_enter(&e->core, "  if (i == i0 || dc[i] != dc[i - 1])");
    ec_line(&e->core, "int64_t l = 0;");
    ec_line(&e->core, "while (dc[l] != dc[i])");
    ec_line(&e->core, "  l++;");
    ec_line(&e->core, "klo = l < klo ? l : klo;");
    ec_leave(&e->core);
    ec_line(&e->core, "klo -= klo %% %d;", ATT_ROWS);
  }
  ec_line(&e->core, "const int64_t khi = %s, nk = khi - klo;", causal ? "i1" : str(e, "%lld", (long long)nt));
}

// Row i's probabilities (or, in the forward, their numerators exp(s - max) with their sum l in f32
// lanes) in place over the row's scores s[0, nk). The row's keys lie in [rlo, rhi) (declared by
// attn_blocks_open): with doc ids, rlo is the first key of the row's id and rhi - 1 its last (row i
// itself when causal), found by scanning the ids when the id changes from the row before, as the row
// loops do (emit_attn_rows_open); keys outside the range are 0 without being computed, inside it the
// id is compared key by key, so the mask holds whatever the ids' order.
static void attn_softmax_row(Emit *e, const IrNode *nd, int doc, const char *lse) {
  bool causal = nd->ia[1];
  int64_t nt = ec_node(&e->core, nd->in[0])->shape.d[1];
  const char *sc = flit(e, nd->fa[0]);
  emit_attn_range(e, nt, causal, doc, "rlo", "rhi");
  ec_line(&e->core, "const int64_t lo = rlo - klo, hi = rhi - klo;");
  ec_line(&e->core, "memset(s, 0, lo * sizeof(float));");
  ec_line(&e->core, "memset(s + hi, 0, (nk - hi) * sizeof(float));");
  if (lse) {
    ec_line(&e->core, "const float lse = %s;", lse);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = lo; j < hi; j++)");
    if (doc >= 0)
      ec_line(&e->core, "  s[j] = dc[klo + j] == di ? mdl_exp_shifted(s[j] * %s - lse) : 0.0f;", sc);
    else
      ec_line(&e->core, "  s[j] = mdl_exp_shifted(s[j] * %s - lse);", sc);
    return;
  }
  ec_line(&e->core, "float m = -INFINITY;");
  ec_line(&e->core, "#pragma omp simd reduction(max : m)");
  ec_enter(&e->core, "for (int64_t j = lo; j < hi; j++)");
  if (doc >= 0)
    ec_line(&e->core, "s[j] = dc[klo + j] == di ? s[j] * %s : -INFINITY;", sc);
  else
    ec_line(&e->core, "s[j] *= %s;", sc);
  ec_line(&e->core, "m = s[j] > m ? s[j] : m;");
  ec_leave(&e->core);
  ec_line(&e->core, "float l = 0.0f;");
  ec_line(&e->core, "#pragma omp simd reduction(+ : l)");
  ec_enter(&e->core, "for (int64_t j = lo; j < hi; j++)");
  ec_line(&e->core, "s[j] = mdl_exp_shifted(s[j] - m);");
  ec_line(&e->core, "l += s[j];");
  ec_leave(&e->core);
}

// Row i's weights w[0, nk) (f32) as the second operand form: bf16 bits into dst16's row (g16), or
// rounded to bf16 values in place (bf16 attention), or as they are.
static void attn_stage_row(Emit *e, const char *w, bool bf16, bool g16, const char *dst16) {
  if (g16) {
    ec_line(&e->core, "uint16_t *restrict %s_i = (uint16_t *)%s + (i - i0) * nk;", dst16, dst16);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = 0; j < nk; j++)");
    ec_line(&e->core, "  %s_i[j] = mdl_f32_to_bf16(%s[j]);", dst16, w);
  } else if (bf16) {
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = 0; j < nk; j++)");
    ec_line(&e->core, "  %s[j] = mdl_bf16_to_f32(mdl_f32_to_bf16(%s[j]));", w, w);
  }
}

// What an attention kernel on the GEMM library reads and writes (attn_gemm_kernel).
typedef struct {
  const IrNode *nd;
  int a, lse, doc;         // the forward's output and log-sum-exp (the backward's lse), doc ids; -1 where absent
  const int *casts;        // forward: the output's bf16 roundings stored here (ncast), and f32 when the
  int ncast;               // f32 output is written too
  bool f32;
  const int *out;          // backward: its dq, dk, dv (-1 where not wanted); NULL for the forward
  Rows q, k, v, dout, o;   // dout and o: the backward's
} AttnGemm;

// The forward's task body (attn_gemm_kernel): GEMMs of bf16 bits when g16, else of f32.
static void attn_fwd_body(Emit *e, const AttnGemm *x, bool g16) {
  const IrNode *nd = x->nd;
  int a = x->a, lse = x->lse, doc = x->doc, ncast = x->ncast;
  const int *casts = x->casts;
  bool f32 = x->f32;
  Rows q = x->q, k = x->k, v = x->v;
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  int64_t nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads;
  bool bf16 = nd->ia[4] == DT_BF16;
  Opnd Q = attn_operand(e, q, nt, d, bf16, g16, false, "qs"), K = attn_operand(e, k, nt, d, bf16, g16, true, "ks");
  Opnd V = {0};
  if (a >= 0)
    V = attn_operand(e, v, nt, d, bf16, g16, true, "vs");
  attn_blocks_open(e, nt, nd->ia[1], doc);
  // the scores are nr rows of nk: packed at stride nk, so that a row's weights staged in place or as
  // bf16 bits are the PV GEMM's operand
  const char *dd = str(e, "%lld", (long long)d);
  attn_gemm(e, g16, 0, 1, "nr", "nk", dd, op_at(e, Q, "i0"), op_ld(e, Q), op_at(e, K, "klo"), op_ld(e, K), "0.0f", "sc",
            "nk");
  ec_enter(&e->core, "for (int64_t i = i0; i < i1; i++)");
  ec_line(&e->core, "float *restrict s = sc + (i - i0) * nk;");
  attn_softmax_row(e, nd, doc, NULL);
  ec_line(&e->core, "lrow[i - i0] = l;");
  if (lse >= 0)
    ec_line(&e->core, "b%d[(b * %lld + hd) * %lld + i] = m + logf(l);", ptr(e, lse), (long long)heads, (long long)nt);
  if (a >= 0)
    attn_stage_row(e, "s", bf16, g16, "ps");
  ec_leave(&e->core);
  if (a >= 0) {
    attn_gemm(e, g16, 0, 0, "nr", dd, "nk", g16 ? "(const uint16_t *)ps" : "sc", "nk", op_at(e, V, "klo"), op_ld(e, V),
              "0.0f", "ot", dd);
    ec_enter(&e->core, "for (int64_t i = i0; i < i1; i++)");
    const char *row = str(e, "(b * %lld + i) * %lld + hd * %lld", (long long)nt, (long long)nc, (long long)d);
    if (f32)
      ec_line(&e->core, "float *restrict oi = b%d + %s;", ptr(e, a), row);
    for (int t = 0; t < ncast; t++)
      ec_line(&e->core, "uint16_t *restrict o%d = b%d + %s;", t, ptr(e, casts[t]), row);
    ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "const float y = ot[(i - i0) * %lld + c] / lrow[i - i0];", (long long)d);
    if (f32)
      ec_line(&e->core, "oi[c] = y;");
    for (int t = 0; t < ncast; t++)
      ec_line(&e->core, "o%d[c] = mdl_f32_to_bf16(y);", t);
    ec_leave(&e->core);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
}

// The backward's task body (attn_gemm_kernel): dq, dk, dv (out[0..2], -1 where not wanted) of the
// head, dk and dv summed over the query blocks in dkh and dvh ([T][D], f32).
static void attn_bwd_body(Emit *e, const AttnGemm *x, bool g16) {
  const IrNode *nd = x->nd;
  const int *out = x->out;
  int lse = x->lse, doc = x->doc;
  Rows q = x->q, k = x->k, v = x->v, dout = x->dout, o = x->o;
  Shape s = nd->shape;
  int64_t nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads;
  bool bf16 = nd->ia[4] == DT_BF16, ds = out[0] >= 0 || out[1] >= 0;
  const char *dd = str(e, "%lld", (long long)d), *sc = flit(e, nd->fa[0]);
  Opnd Q = attn_operand(e, q, nt, d, bf16, g16, false, "qs"), K = attn_operand(e, k, nt, d, bf16, g16, true, "ks");
  Opnd DO = attn_operand(e, dout, nt, d, bf16, g16, false, "dos"), V = {0}, O = {0};
  if (ds) {
    V = attn_operand(e, v, nt, d, bf16, g16, true, "vs");
    O = attn_operand(e, o, nt, d, bf16, g16, false, "os");
  }
  for (int i = 1; i < 3; i++)
    if (out[i] >= 0)
      ec_line(&e->core, "memset(%s, 0, %lld * sizeof(float));", i == 1 ? "dkh" : "dvh", (long long)(nt * d));
  attn_blocks_open(e, nt, nd->ia[1], doc);
  attn_gemm(e, g16, 0, 1, "nr", "nk", dd, op_at(e, Q, "i0"), op_ld(e, Q), op_at(e, K, "klo"), op_ld(e, K), "0.0f", "sc",
            "nk");
  if (ds)
    attn_gemm(e, g16, 0, 1, "nr", "nk", dd, op_at(e, DO, "i0"), op_ld(e, DO), op_at(e, V, "klo"), op_ld(e, V), "0.0f",
              "dp", "nk");
  ec_enter(&e->core, "for (int64_t i = i0; i < i1; i++)");
  ec_line(&e->core, "float *restrict s = sc + (i - i0) * nk;");
  attn_softmax_row(e, nd, doc, str(e, "b%d[(b * %lld + hd) * %lld + i]", ptr(e, lse), (long long)heads, (long long)nt));
  if (ds) { // dS = P (dP - D), D = dout_i . out_i (both as the products read them), before P is rounded
    const char *ty = g16 ? "uint16_t" : "float", *rd = g16 ? "mdl_bf16_to_f32(%s[c])" : "%s[c]";
    ec_line(&e->core, "const %s *restrict doi = %s, *restrict oi = %s;", ty, op_at(e, DO, "i"), op_at(e, O, "i"));
    ec_line(&e->core, "float dsum = 0.0f;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : dsum)");
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dsum += %s * %s;", str(e, rd, "doi"), str(e, rd, "oi"));
    ec_line(&e->core, "float *restrict dpi = dp + (i - i0) * nk;");
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = 0; j < nk; j++)");
    ec_line(&e->core, "  dpi[j] = s[j] * (dpi[j] - dsum);");
    attn_stage_row(e, "dpi", bf16, g16, "dss");
  }
  if (out[2] >= 0)
    attn_stage_row(e, "s", bf16, g16, "ps");
  ec_leave(&e->core);
  const char *pm = g16 ? "(const uint16_t *)ps" : "sc", *dsm = g16 ? "(const uint16_t *)dss" : "dp";
  if (out[2] >= 0) // dV[klo, khi) += P^T dout
    attn_gemm(e, g16, 1, 0, "nk", dd, "nr", pm, "nk", op_at(e, DO, "i0"), op_ld(e, DO), "1.0f",
              str(e, "dvh + klo * %lld", (long long)d), dd);
  if (out[1] >= 0) // dK[klo, khi) += dS^T q (scaled when stored)
    attn_gemm(e, g16, 1, 0, "nk", dd, "nr", dsm, "nk", op_at(e, Q, "i0"), op_ld(e, Q), "1.0f",
              str(e, "dkh + klo * %lld", (long long)d), dd);
  if (out[0] >= 0) { // dq = scale dS k
    attn_gemm(e, g16, 0, 0, "nr", dd, "nk", dsm, "nk", op_at(e, K, "klo"), op_ld(e, K), "0.0f", "ot", dd);
    ec_enter(&e->core, "for (int64_t i = i0; i < i1; i++)");
    ec_line(&e->core, "float *restrict dq = b%d + (b * %lld + i) * %lld + hd * %lld;", ptr(e, out[0]), (long long)nt,
            (long long)nc, (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dq[c] = %s * ot[(i - i0) * %lld + c];", sc, (long long)d);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  for (int i = 1; i < 3; i++)
    if (out[i] >= 0) {
      ec_enter(&e->core, "for (int64_t t = 0; t < %lld; t++)", (long long)nt);
      ec_line(&e->core, "float *restrict y = b%d + (b * %lld + t) * %lld + hd * %lld;", ptr(e, out[i]), (long long)nt,
              (long long)nc, (long long)d);
      ec_line(&e->core, "const float *restrict x = %s + t * %lld;", i == 1 ? "dkh" : "dvh", (long long)d);
      ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
      ec_line(&e->core, "  y[c] = %sx[c];", i == 1 ? str(e, "%s * ", sc) : "");
      ec_leave(&e->core);
    }
}

// An attention kernel on the GEMM library: per-thread scratch, a task per (batch, head), and with bf16
// attention its body twice, on the library's bf16 GEMM where it has one (h->bgemm) and else on f32.
static void attn_gemm_kernel(Emit *e, const AttnGemm *x) {
  Shape s = ec_node(&e->core, x->nd->in[0])->shape;
  int64_t nb = s.d[0], nt = s.d[1], nc = s.d[2], heads = x->nd->ia[0], d = nc / heads;
  bool bf16 = x->nd->ia[4] == DT_BF16;
  Tmp fwd[7] = {{"qs", nt * d},         {"ks", nt * d},       {"vs", nt * d}, {"sc", ATT_ROWS * nt},
                {"ps", ATT_ROWS * nt}, {"ot", ATT_ROWS * d}, {"lrow", ATT_ROWS}};
  Tmp bwd[12] = {{"qs", nt * d},          {"ks", nt * d},          {"vs", nt * d},          {"dos", nt * d},
                 {"os", nt * d},          {"sc", ATT_ROWS * nt},  {"dp", ATT_ROWS * nt},  {"ps", ATT_ROWS * nt},
                 {"dss", ATT_ROWS * nt}, {"ot", ATT_ROWS * d},   {"dkh", nt * d},        {"dvh", nt * d}};
  const Tmp *tmp = x->out ? bwd : fwd;
  int ntmp = x->out ? 12 : 7;
  void (*body)(Emit *, const AttnGemm *, bool) = x->out ? attn_bwd_body : attn_fwd_body;
  e->uses_h = true;
  if (bf16)
    ec_line(&e->core, "const int g16 = h->bgemm != NULL;");
  emit_attn_open(e, nb, heads, nb * nt * nt * nc >= PAR_MIN, tmp, ntmp);
  if (x->doc >= 0)
    ec_line(&e->core, "const int32_t *restrict dc = b%d + b * %lld;", ptr(e, x->doc), (long long)nt);
  if (bf16) {
    ec_enter(&e->core, "if (g16)");
    body(e, x, true);
    ec_leave(&e->core);
    ec_enter(&e->core, "else");
  }
  body(e, x, false);
  if (bf16)
    ec_leave(&e->core);
  emit_attn_close(e, tmp, ntmp);
}

// The forward attention kernel's outputs are written: its f32 output (when stored), its bf16
// roundings and its log-sum-exp.
static void attn_outputs_done(Emit *e, int a, bool f32, const int *casts, int ncast, int lse) {
  if (f32)
    ec_phase_done(&e->core, a);
  for (int t = 0; t < ncast; t++)
    ec_phase_done(&e->core, casts[t]);
  if (lse >= 0)
    ec_phase_done(&e->core, lse);
  ec_phase_end(&e->core);
}

// ATTENTION forward: one task per (batch, head), which transposes the head's keys once and then, per
// query row, computes the scores of the allowed keys, their softmax and the weighted sum of values;
// never a T x T matrix. With its ATTENTION_LSE (rule 3 of fuse.c) each row's log-sum-exp is stored as
// well; alone (no fusion), the ATTENTION_LSE computes the scores and their statistics only.
static void emit_attention(Emit *e, int gi) {
  int a, lse;
  ec_attention_members(&e->core, gi, &a, &lse);
  const IrNode *nd = ec_node(&e->core, a >= 0 ? a : lse);
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  int64_t nb = s.d[0], nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads;
  bool causal = nd->ia[1], has_doc = nd->ia[2];
  Rows q = rows_of(e, nd->in[0]), k = rows_of(e, nd->in[1]), v = a >= 0 ? rows_of(e, nd->in[2]) : (Rows){0};
  int doc = has_doc ? ec_need(&e->core, nd->in[3]) : -1;
  flush(e);
  // The bf16 roundings of the output that this step holds (rule 9) are stored here too; the f32
  // output only when something reads it.
  int casts[4], ncast = 0;
  bool f32 = false;
  if (a >= 0)
    ncast = ec_output_casts(&e->core, a, casts, 4, &f32);
  if (f32 && ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  if (lse >= 0 && ec_offset(&e->core, lse) < 0)
    e->core.scratch[lse] = true;
  ec_phase_begin(&e->core);
  note(e, "attention%s: B %lld, T %lld, %lld heads of %lld%s%s; one task per (batch, head)",
       a < 0 ? " statistics (log-sum-exp per row)" : lse >= 0 ? " and its log-sum-exp per row" : "", (long long)nb,
       (long long)nt, (long long)heads, (long long)d, causal ? ", causal" : "", has_doc ? ", within documents" : "");
  if (attn_by_gemm(nt, d)) {
    attn_gemm_kernel(e, &(AttnGemm){.nd = nd, .a = a, .lse = lse, .doc = doc, .casts = casts, .ncast = ncast,
                                    .f32 = f32, .q = q, .k = k, .v = v});
    attn_outputs_done(e, a, f32, casts, ncast, lse);
    return;
  }
  Tmp tmp[2] = {{"kt", d * attn_padded(nt)}, {"s", attn_padded(nt)}};
  emit_attn_open(e, nb, heads, nb * nt * nt * nc >= PAR_MIN, tmp, 2);
  bool bf16 = nd->ia[4] == DT_BF16; // q, k, v and e = exp(s - max) read rounded (mdl.h)
  emit_attn_transpose(e, "kt", k, nt, d, bf16);
  emit_attn_rows_open(e, nd, doc);
  emit_attn_row(e, nd, q, doc, NULL);
  if (lse >= 0)
    ec_line(&e->core, "b%d[(b * %lld + hd) * %lld + i] = m + logf(l);", ptr(e, lse), (long long)heads, (long long)nt);
  if (a >= 0) {
    emit_attn_pairs(e, "acc", "s", v, nt, d, bf16, bf16);
    const char *row = str(e, "(b * %lld + i) * %lld + hd * %lld", (long long)nt, (long long)nc, (long long)d);
    if (f32)
      ec_line(&e->core, "float *restrict oi = b%d + %s;", ptr(e, a), row);
    for (int t = 0; t < ncast; t++)
      ec_line(&e->core, "uint16_t *restrict o%d = b%d + %s;", t, ptr(e, casts[t]), row);
    ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "const float y = (acc0[c] + acc1[c]) / l;");
    if (f32)
      ec_line(&e->core, "oi[c] = y;");
    for (int t = 0; t < ncast; t++)
      ec_line(&e->core, "o%d[c] = mdl_f32_to_bf16(y);", t);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  emit_attn_close(e, tmp, 2);
  attn_outputs_done(e, a, f32, casts, ncast, lse);
}

// ATTENTION_BWD siblings: one task per (batch, head), so its dq, dk and dv rows are written by that
// task alone; dk and dv build up in per-thread [T][D] blocks copied out at the end of the task. The
// probabilities of each query row are recomputed from its scores and the forward's log-sum-exp.
static void emit_attention_bwd(Emit *e, int gi) {
  const Group *gr = &e->core.groups[gi];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  Shape s = nd->shape;
  int64_t nb = s.d[0], nt = s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads;
  bool causal = nd->ia[1], has_doc = nd->ia[2];
  int out[3] = {-1, -1, -1};
  for (int i = 0; i < gr->nmem; i++)
    out[ec_node(&e->core, gr->mem[i])->ia[3]] = gr->mem[i];
  bool ds = out[0] >= 0 || out[1] >= 0; // dq and dk need dS = P (dP - dout . out); dv only P
  Rows q = rows_of(e, nd->in[0]), k = rows_of(e, nd->in[1]), v = ds ? rows_of(e, nd->in[2]) : (Rows){0};
  int doc = has_doc ? ec_need(&e->core, nd->in[3]) : -1;
  Rows dout = rows_of(e, att_bwd_dout(nd)), o = ds ? rows_of(e, att_bwd_out(nd)) : (Rows){0};
  int lse = ec_need(&e->core, att_bwd_lse(nd));
  flush(e);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0 && ec_offset(&e->core, out[i]) < 0)
      e->core.scratch[out[i]] = true;
  const char *sc = flit(e, nd->fa[0]);
  ec_phase_begin(&e->core);
  note(e, "attention backward (%s%s%s): B %lld, T %lld, %lld heads of %lld%s%s; one task per (batch, head)",
       out[0] >= 0 ? "dq " : "", out[1] >= 0 ? "dk " : "", out[2] >= 0 ? "dv" : "", (long long)nb, (long long)nt,
       (long long)heads, (long long)d, causal ? ", causal" : "", has_doc ? ", within documents" : "");
  if (attn_by_gemm(nt, d)) {
    attn_gemm_kernel(e, &(AttnGemm){.nd = nd, .lse = lse, .doc = doc, .out = out, .q = q, .k = k, .v = v,
                                    .dout = dout, .o = o});
    for (int i = 0; i < 3; i++)
      if (out[i] >= 0)
        ec_phase_done(&e->core, out[i]);
    ec_phase_end(&e->core);
    return;
  }
  Tmp tmp[6];
  int ntmp = 0;
  tmp[ntmp++] = (Tmp){"kt", d * attn_padded(nt)};
  tmp[ntmp++] = (Tmp){"s", attn_padded(nt)};
  if (ds) {
    tmp[ntmp++] = (Tmp){"vt", d * attn_padded(nt)};
    tmp[ntmp++] = (Tmp){"dp", attn_padded(nt)};
  }
  if (out[1] >= 0)
    tmp[ntmp++] = (Tmp){"dkh", nt * d};
  if (out[2] >= 0)
    tmp[ntmp++] = (Tmp){"dvh", nt * d};
  emit_attn_open(e, nb, heads, nb * nt * nt * nc >= PAR_MIN, tmp, ntmp);
  bool bf16 = nd->ia[4] == DT_BF16; // the products read q, k, v, dout, P and dS rounded (mdl.h)
  emit_attn_transpose(e, "kt", k, nt, d, bf16);
  if (ds)
    emit_attn_transpose(e, "vt", v, nt, d, bf16);
  for (int i = 1; i < 3; i++)
    if (out[i] >= 0)
      ec_line(&e->core, "memset(%s, 0, %lld * sizeof(float));", i == 1 ? "dkh" : "dvh", (long long)(nt * d));
  emit_attn_rows_open(e, nd, doc);
  emit_attn_row(e, nd, q, doc,
                str(e, "b%d[(b * %lld + hd) * %lld + i]", ptr(e, lse), (long long)heads, (long long)nt));
  if (bf16) { // dout_i rounded (mdl.h), or already a bf16 value (its CAST, precision.c)
    ec_line(&e->core, "float dor[%lld];", (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dor[c] = %s;", attn_elem(e, dout, nt, d, bf16));
    ec_line(&e->core, "const float *restrict doi = dor;");
  } else {
    ec_line(&e->core, "const float *restrict doi = %s + (b * %lld + i) * %lld + hd * %lld;", dout.base,
            (long long)nt, (long long)dout.stride, (long long)d);
  }
  if (ds) {
    // D = dout_i . out_i (out_i as dout_i is read: its CAST, precision.c)
    ec_line(&e->core, "float dsum = 0.0f;");
    ec_line(&e->core, "#pragma omp simd reduction(+ : dsum)");
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dsum += doi[c] * %s;", attn_elem(e, o, nt, d, bf16));
    emit_attn_dots(e, "dp", "doi", "vt", nt, d);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t j = lo; j < hi; j++)");
    ec_line(&e->core, "  dp[j] = s[j] * (dp[j] - dsum);");
  }
  if (out[0] >= 0)
    emit_attn_pairs(e, "dqi", "dp", k, nt, d, bf16, bf16);
  if (out[1] >= 0) {
    ec_line(&e->core, "float sqi[%lld];", (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  sqi[c] = %s * qi[c];", sc);
  }
  ec_enter(&e->core, "for (int64_t j = lo; j < hi; j++)");
  if (out[1] >= 0) {
    ec_line(&e->core, "float *restrict dkj = dkh + j * %lld;", (long long)d);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dkj[c] += %s * sqi[c];", bf16 ? "mdl_bf16_to_f32(mdl_f32_to_bf16(dp[j]))" : "dp[j]");
  }
  if (out[2] >= 0) {
    ec_line(&e->core, "float *restrict dvj = dvh + j * %lld;", (long long)d);
    ec_line(&e->core, "#pragma omp simd");
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dvj[c] += %s * doi[c];", bf16 ? "mdl_bf16_to_f32(mdl_f32_to_bf16(s[j]))" : "s[j]");
  }
  ec_leave(&e->core);
  if (out[0] >= 0) {
    ec_line(&e->core, "float *restrict dq = b%d + (b * %lld + i) * %lld + hd * %lld;", ptr(e, out[0]), (long long)nt,
            (long long)nc, (long long)d);
    ec_line(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dq[c] = %s * (dqi0[c] + dqi1[c]);", sc);
  }
  ec_leave(&e->core);
  for (int i = 1; i < 3; i++)
    if (out[i] >= 0) {
      ec_line(&e->core, "for (int64_t t = 0; t < %lld; t++)", (long long)nt);
      ec_line(&e->core, "  memcpy(b%d + (b * %lld + t) * %lld + hd * %lld, %s + t * %lld, %lld * sizeof(float));",
              ptr(e, out[i]), (long long)nt, (long long)nc, (long long)d, i == 1 ? "dkh" : "dvh", (long long)d,
              (long long)d);
    }
  emit_attn_close(e, tmp, ntmp);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0)
      ec_phase_done(&e->core, out[i]);
  ec_phase_end(&e->core);
}

static void emit_embed(Emit *e, int gi) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t v = ec_node(&e->core, nd->in[0])->shape.d[0], c = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / c;
  int tab = ec_need(&e->core, nd->in[0]), ids = ec_need(&e->core, nd->in[1]);
  flush(e);
  if (ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  e->uses_h = true;
  ec_phase_begin(&e->core);
  note(e, "embed: %lld rows of %lld from a table of %lld", (long long)rows, (long long)c, (long long)v);
  par_for(e, rows * c, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const int32_t id = b%d[r];", ptr(e, ids));
  ec_enter(&e->core, "if (id < 0 || id >= %lld)", (long long)v);
  ec_line(&e->core, "h->error(h->ctx, \"embed: id\", id, %lld);", (long long)v);
  ec_line(&e->core, "memset(b%d + r * %lld, 0, %lld * sizeof(float));", ptr(e, a), (long long)c, (long long)c);
  ec_line(&e->core, "continue;");
  ec_leave(&e->core);
  ec_line(&e->core, "memcpy(b%d + r * %lld, b%d + (int64_t)id * %lld, %lld * sizeof(float));", ptr(e, a), (long long)c,
          ptr(e, tab), (long long)c, (long long)c);
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// The ADD of the step that is the only reader of EMBED_BWD a, when it adds a to a table x of the same
// shape and type in memory, into a buffer of its own (a tied embedding's gradient: the LM head's dW
// plus the embedding's); -1 otherwise. *x is set to the other operand.
static int embed_bwd_add(Emit *e, int a, int *x) {
  const Step *st = &e->core.f->steps[e->core.si];
  int add = -1;
  for (int k = 0; k < st->nnodes; k++) {
    const IrNode *u = ec_node(&e->core, st->nodes[k]);
    for (int i = 0; i < u->nin; i++)
      if (ec_canon(&e->core, u->in[i]) == a) {
        if (add >= 0 || u->op != OP_ADD)
          return -1;
        add = st->nodes[k];
      }
  }
  if (add < 0 || ec_offset(&e->core, a) >= 0 || ec_offset(&e->core, add) < 0)
    return -1;
  const IrNode *ad = ec_node(&e->core, add), *an = ec_node(&e->core, a);
  int other = ec_canon(&e->core, ad->in[0]) == a ? ad->in[1] : ad->in[0];
  const IrNode *xn = ec_node(&e->core, other);
  if (ec_canon(&e->core, other) == a || xn->dtype != DT_F32 || ad->dtype != DT_F32 || !shape_eq(xn->shape, an->shape) ||
      !shape_eq(ad->shape, an->shape))
    return -1;
  int xm = ec_mem_alias(&e->core, other);
  if (xm < 0 || ec_offset(&e->core, xm) == ec_offset(&e->core, add))
    return -1;
  *x = xm;
  return add;
}

// EMBED_BWD a, a scatter-add parallel over blocks of columns, so that each row of the table is summed
// by one thread in row order: deterministic and race-free. Each id's first row (first[id], found in
// one pass over the ids) stores its dy row and later rows add theirs, so no row of the table is
// zeroed before it is summed into; the rows no id names are then zeros. With
// the ADD y = x + a that alone reads a (embed_bwd_add: a tied embedding's gradient, the LM head's dW
// plus the embedding's), the sums go straight into y, which becomes x + y on those rows and x on the
// others, and a has no table of its own: GPT-2 124M's zeroed scratch of 154 MB, its pass and the add's
// read of it took 110-225 ms a step, now 12.
static void emit_embed_bwd(Emit *e, int gi) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t v = nd->shape.d[0], c = nd->shape.d[1], rows = ec_numel(&e->core, nd->in[0]);
  int ids = ec_need(&e->core, nd->in[0]), dy = ec_need(&e->core, nd->in[1]);
  int x = -1, add = embed_bwd_add(e, a, &x);
  flush(e);
  int out = add >= 0 ? add : a;
  if (ec_offset(&e->core, out) < 0)
    e->core.scratch[out] = true;
  int64_t cb = c < 16 ? c : 16, ncb = (c + cb - 1) / cb;
  e->uses_h = true;
  ec_phase_begin(&e->core);
  if (add >= 0)
    note(e, "embed backward added to %%%d: %lld rows of %lld into the rows of a table of %lld they name, %lld "
         "column blocks", x, (long long)rows, (long long)c, (long long)v, (long long)ncb);
  else
    note(e, "embed backward: %lld rows of %lld into a table of %lld, %lld column blocks", (long long)rows,
         (long long)c, (long long)v, (long long)ncb);
  int y = ptr(e, out);
  ec_line(&e->core, "int32_t *first = mdl_scratch(%lld * sizeof(int32_t));", (long long)v);
  ec_line(&e->core, "memset(first, 0xff, %lld * sizeof(int32_t));", (long long)v);
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const int32_t id = b%d[r];", ptr(e, ids));
  ec_line(&e->core, "if (id < 0 || id >= %lld)", (long long)v);
  ec_line(&e->core, "  h->error(h->ctx, \"embed: id\", id, %lld);", (long long)v);
  ec_line(&e->core, "else if (first[id] < 0)");
  ec_line(&e->core, "  first[id] = (int32_t)r;");
  ec_leave(&e->core);
  par_for(e, rows * c, "static");
  ec_enter(&e->core, "for (int64_t k = 0; k < %lld; k++)", (long long)ncb);
  ec_line(&e->core, "const int64_t c0 = k * %lld, c1 = c0 + %lld < %lld ? c0 + %lld : %lld;", (long long)cb,
          (long long)cb, (long long)c, (long long)cb, (long long)c);
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const int32_t id = b%d[r];", ptr(e, ids));
  ec_line(&e->core, "if (id < 0 || id >= %lld)", (long long)v);
  ec_line(&e->core, "  continue;");
  ec_line(&e->core, "float *restrict yr = b%d + (int64_t)id * %lld;", y, (long long)c);
  ec_line(&e->core, "const float *restrict dr = b%d + r * %lld;", ptr(e, dy), (long long)c);
  ec_line(&e->core, "if (first[id] == r)");
  ec_line(&e->core, "  for (int64_t j = c0; j < c1; j++)");
  ec_line(&e->core, "    yr[j] = dr[j];");
  ec_line(&e->core, "else");
  ec_line(&e->core, "  for (int64_t j = c0; j < c1; j++)");
  ec_line(&e->core, "    yr[j] += dr[j];");
  ec_leave(&e->core);
  ec_leave(&e->core);
  par_for(e, v * c, "static");
  ec_enter(&e->core, "for (int64_t t = 0; t < %lld; t++)", (long long)v);
  ec_line(&e->core, "float *restrict yr = b%d + t * %lld;", y, (long long)c);
  if (add >= 0) {
    ec_line(&e->core, "const float *restrict xr = b%d + t * %lld;", ptr(e, x), (long long)c);
    ec_line(&e->core, "if (first[t] < 0)");
    ec_line(&e->core, "  memcpy(yr, xr, %lld * sizeof(float));", (long long)c);
    ec_line(&e->core, "else");
    ec_line(&e->core, "  for (int64_t j = 0; j < %lld; j++)", (long long)c);
    ec_line(&e->core, "    yr[j] = xr[j] + yr[j];");
  } else {
    ec_line(&e->core, "if (first[t] < 0)");
    ec_line(&e->core, "  memset(yr, 0, %lld * sizeof(float));", (long long)c);
  }
  ec_leave(&e->core);
  ec_line(&e->core, "mdl_free(first);");
  ec_phase_done(&e->core, out);
  ec_phase_end(&e->core);
}

// ROPE: per row, the angles of the D/2 pairs once, applied to every head.
static void emit_rope(Emit *e, int gi) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int64_t rows = s.d[0] * s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads;
  Rows x = rows_of(e, nd->in[0]);
  int pos = ec_need(&e->core, nd->in[1]);
  flush(e);
  if (ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  ec_phase_begin(&e->core);
  note(e, "rope%s: %lld rows, %lld heads of %lld", nd->ia[1] ? " (inverse)" : "", (long long)rows,
       (long long)heads, (long long)d);
  par_for(e, rows * nc * 4, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const double p = %sb%d[r];", nd->ia[1] ? "-1.0 * " : "", ptr(e, pos));
  ec_line(&e->core, "const float *x = %s + r * %lld;", x.base, (long long)x.stride);
  ec_line(&e->core, "float *y = b%d + r * %lld;", ptr(e, a), (long long)nc);
  ec_enter(&e->core, "for (int64_t i = 0; i < %lld; i++)", (long long)(d / 2));
  ec_line(&e->core, "const double th = p * pow(%s, -2.0 * (double)i / %lld);", ec_dlit(&e->core, nd->fa[0]),
          (long long)d);
  ec_line(&e->core, "const float cs = (float)cos(th), sn = (float)sin(th);");
  ec_enter(&e->core, "for (int64_t hd = 0; hd < %lld; hd++)", (long long)heads);
  ec_line(&e->core, "const int64_t a = hd * %lld + i, b = a + %lld;", (long long)d, (long long)(d / 2));
  ec_line(&e->core, "const float x1 = x[a], x2 = x[b];");
  ec_line(&e->core, "y[a] = x1 * cs - x2 * sn;");
  ec_line(&e->core, "y[b] = x1 * sn + x2 * cs;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// The condition under which query i may see key j in an attention mask (interp.c's rule), with di the
// query's doc id and dc the row's ids where the mask has them.
static const char *attn_mask_cond(const IrNode *nd) {
  bool causal = nd->ia[0], doc = nd->ia[1];
  return causal && doc ? "j <= i && dc[j] == di" : causal ? "j <= i" : doc ? "dc[j] == di" : "true";
}

// ATTENTION_MASK ([doc]) -> [B or 1, 1, T, T]: 0 where query i may see key j, -inf where not; a row of
// keys per (batch, query).
static void emit_attn_mask(Emit *e, int gi) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t rows = nd->shape.d[0] * nd->shape.d[2], nt = nd->shape.d[3];
  int doc = nd->ia[1] ? ec_need(&e->core, nd->in[0]) : -1;
  flush(e);
  if (ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  ec_phase_begin(&e->core);
  note(e, "attention mask: %lld rows of %lld keys%s%s", (long long)rows, (long long)nt, nd->ia[0] ? ", causal" : "",
       doc >= 0 ? ", within documents" : "");
  par_for(e, rows * nt, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)rows);
  ec_line(&e->core, "const int64_t i = r %% %lld;", (long long)nt);
  if (doc >= 0) {
    ec_line(&e->core, "const int32_t *dc = b%d + (r - i);", ptr(e, doc));
    ec_line(&e->core, "const int32_t di = dc[i];");
  }
  ec_line(&e->core, "float *y = b%d + r * %lld;", ptr(e, a), (long long)nt);
  ec_line(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)nt);
  ec_line(&e->core, "  y[j] = %s ? 0.0f : -INFINITY;", attn_mask_cond(nd));
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// MAX_BWD (x, y, dy): the gradient goes to the maxima, shared evenly between ties.
static void emit_max_bwd(Emit *e, int gi) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int ax = (int)nd->ia[0];
  int64_t outer = ec_span(s, 0, ax), len = s.d[ax], inner = ec_span(s, ax + 1, s.rank);
  int x = ec_need(&e->core, nd->in[0]), y = ec_need(&e->core, nd->in[1]), dy = ec_need(&e->core, nd->in[2]);
  flush(e);
  if (ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  ec_phase_begin(&e->core);
  note(e, "max backward: %lld outputs over %lld elements", (long long)(outer * inner), (long long)len);
  par_for(e, outer * len * inner, "static");
  ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)(outer * inner));
  ec_line(&e->core, "const int64_t base = r / %lld * %lld + r %% %lld;", (long long)inner, (long long)(len * inner),
          (long long)inner);
  ec_line(&e->core, "const float m = b%d[r];", ptr(e, y));
  ec_line(&e->core, "int64_t ties = 0;");
  ec_line(&e->core, "for (int64_t l = 0; l < %lld; l++)", (long long)len);
  ec_line(&e->core, "  ties += b%d[base + l * %lld] == m;", ptr(e, x), (long long)inner);
  ec_line(&e->core, "const float g = (float)((double)b%d[r] / (double)ties);", ptr(e, dy));
  ec_line(&e->core, "for (int64_t l = 0; l < %lld; l++)", (long long)len);
  ec_line(&e->core, "  b%d[base + l * %lld] = b%d[base + l * %lld] == m ? g : 0.0f;", ptr(e, a), (long long)inner,
          ptr(e, x), (long long)inner);
  ec_leave(&e->core);
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// GRAD_NORM (sum of squares per tensor in double, fixed blocks) and AdamW over a table of
// parameter segments, in f32 per element (the CUDA kernel does the same); p, m and v in place, and the
// parameter's bf16 copy (fuse.c, rule 11) rounded from the new p.
static void emit_optimizer(Emit *e, int gi) {
  const Group *gr = &e->core.groups[gi];
  int gn = -1;
  for (int i = 0; i < gr->nmem; i++)
    if (ec_node(&e->core, gr->mem[i])->op == OP_GRAD_NORM) {
      const IrNode *nd = ec_node(&e->core, gr->mem[i]);
      for (int k = 0; k < nd->nin; k++)
        ec_need(&e->core, nd->in[k]);
    }
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = ec_node(&e->core, gr->mem[i]);
    if (nd->op != OP_ADAMW)
      continue;
    for (int k = 1; k < 7; k++)
      if (k != 4 || e->core.grp[ec_canon(&e->core, nd->in[4])] != gi)
        ec_need(&e->core, nd->in[k]);
  }
  flush(e);
  ec_phase_begin(&e->core);
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = ec_node(&e->core, gr->mem[i]);
    if (nd->op != OP_GRAD_NORM)
      continue;
    e->uses_h = true;
    gn = gr->mem[i];
    int64_t total = 0;
    for (int k = 0; k < nd->nin; k++)
      total += ec_numel(&e->core, nd->in[k]);
    note(e, "gradient norm %%%d over %d tensors, %lld values", gn, nd->nin, (long long)total);
    ec_enter(&e->core, "%s", "");
    ec_line(&e->core, "double ss = 0;");
    for (int k = 0; k < nd->nin; k++) {
      const char *label = ec_node(&e->core, ec_canon(&e->core, nd->in[k]))->name;
      ec_line(&e->core, "ss += mdl_sumsq(b%d, %lld, h->nthreads); // %s", ptr(e, ec_need(&e->core, nd->in[k])),
              (long long)ec_numel(&e->core, nd->in[k]), label ? label : "");
    }
    if (ec_offset(&e->core, gn) < 0)
      e->core.scratch[gn] = true;
    ec_line(&e->core, "b%d[0] = (float)sqrt(ss);", ptr(e, gn));
    ec_leave(&e->core);
    ec_phase_done(&e->core, gn);
  }
  // ADAMWs that share hyperparameters and scalars run over one table.
  bool *done = ec_xcalloc((size_t)gr->nmem, sizeof *done);
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *a = ec_node(&e->core, gr->mem[i]);
    if (done[i] || a->op != OP_ADAMW)
      continue;
    int *seg = ec_xcalloc((size_t)gr->nmem, sizeof *seg), ns = 0;
    int64_t total = 0;
    for (int j = i; j < gr->nmem; j++) {
      const IrNode *b = ec_node(&e->core, gr->mem[j]);
      if (done[j] || b->op != OP_ADAMW || memcmp(a->fa, b->fa, sizeof(double) * 3) || a->fa[4] != b->fa[4])
        continue;
      bool same = true;
      for (int k = 4; k < 7; k++)
        same &= ec_canon(&e->core, a->in[k]) == ec_canon(&e->core, b->in[k]);
      if (!same)
        continue;
      done[j] = true;
      seg[ns++] = gr->mem[j];
      total += ec_numel(&e->core, gr->mem[j]);
    }
    int gnorm = ec_need(&e->core, a->in[4]), lr = ec_need(&e->core, a->in[5]), step = ec_need(&e->core, a->in[6]);
    int ncopies = 0;
    for (int j = 0; j < ns; j++)
      ncopies += e->core.f->copy_of[ec_canon(&e->core, ec_node(&e->core, seg[j])->in[0])] >= 0;
    note(e, "AdamW over %d parameters, %lld values (beta1 %g, beta2 %g, eps %g, clip %g)%s", ns, (long long)total,
         a->fa[0], a->fa[1], a->fa[2], a->fa[4], ncopies ? ec_str(&e->core, "; %d bf16 copies", ncopies) : "");
    ec_enter(&e->core, "%s", "");
    ec_line(&e->core, "static const struct {");
    ec_line(&e->core, ncopies ? "  int64_t p, g, m, v, c, n; // c: the bf16 copy, or -1" : "  int64_t p, g, m, v, n;");
    ec_line(&e->core, "  double wd;");
    ec_line(&e->core, "} seg[%d] = {", ns);
    for (int j = 0; j < ns; j++) {
      const IrNode *u = ec_node(&e->core, seg[j]);
      int p = ec_canon(&e->core, u->in[0]), g = ec_canon(&e->core, u->in[1]), m = ec_canon(&e->core, u->in[2]),
          v = ec_canon(&e->core, u->in[3]);
      if (ec_offset(&e->core, p) < 0 || ec_offset(&e->core, g) < 0 || ec_offset(&e->core, m) < 0 ||
          ec_offset(&e->core, v) < 0)
        ec_fail(&e->core, "adamw %d: parameter, gradient or moments not in memory", seg[j]);
      int c = e->core.f->copy_of[p];
      ec_line(&e->core, "    {%lld, %lld, %lld, %lld, %s%lld, %s}, // %s", (long long)ec_offset(&e->core, p),
              (long long)ec_offset(&e->core, g), (long long)ec_offset(&e->core, m), (long long)ec_offset(&e->core, v),
              ncopies ? ec_str(&e->core, "%lld, ", c >= 0 ? (long long)ec_offset(&e->core, c) : -1LL) : "",
              (long long)ec_numel(&e->core, p), ec_dlit(&e->core, u->fa[3]),
              ec_node(&e->core, p)->name ? ec_node(&e->core, p)->name : "");
    }
    ec_line(&e->core, "};");
    ec_line(&e->core, "const double clip = %s, gnorm = b%d[0];", ec_dlit(&e->core, a->fa[4]), ptr(e, gnorm));
    ec_line(&e->core, "const double step = b%d[0];", ptr(e, step));
    // A non-finite loss or gradient norm leaves p, m and v as they were: the runtime reads the same
    // two values after the step, and stops or skips the step (train.c) with the last finite weights.
    int loss = e->core.f->g->loss >= 0 ? ec_need(&e->core, e->core.f->g->loss) : -1;
    ec_line(&e->core, "const int nseg = isfinite(gnorm)%s ? %d : 0;",
            loss >= 0 ? ec_str(&e->core, " && isfinite(b%d[0])", ptr(e, loss)) : "", ns);
    ec_line(&e->core, "const float s = (float)(clip > 0 ? fmin(1.0, clip / (gnorm + 1e-6)) : 1.0);");
    ec_line(&e->core, "const float lr = b%d[0], b1 = %s, b2 = %s, eps = %s;", ptr(e, lr), flit(e, a->fa[0]),
            flit(e, a->fa[1]), flit(e, a->fa[2]));
    ec_line(&e->core, "const float c1 = (float)(1.0 / (1.0 - pow(b1, step))), c2 = (float)(1.0 / (1.0 - pow(b2, step)));");
    if (total >= PAR_MIN) {
      ec_line(&e->core, "#pragma omp parallel num_threads(h->nthreads)");
      e->uses_h = true;
    }
    ec_enter(&e->core, "for (int k = 0; k < nseg; k++)");
    ec_line(&e->core, "float *restrict p = (float *)(arena + seg[k].p), *restrict m = (float *)(arena + seg[k].m);");
    ec_line(&e->core, "float *restrict v = (float *)(arena + seg[k].v);");
    ec_line(&e->core, "const float *restrict g = (const float *)(arena + seg[k].g);");
    if (ncopies)
      ec_line(&e->core, "uint16_t *restrict c = seg[k].c >= 0 ? (uint16_t *)(arena + seg[k].c) : NULL;");
    ec_line(&e->core, "const float wd = (float)seg[k].wd;");
    if (total >= PAR_MIN)
      ec_line(&e->core, "#pragma omp for simd schedule(static) nowait");
    else
      ec_line(&e->core, "#pragma omp simd");
    ec_enter(&e->core, "for (int64_t i = 0; i < seg[k].n; i++)");
    ec_line(&e->core, "const float gi = s * g[i];");
    ec_line(&e->core, "const float mi = b1 * m[i] + (1.0f - b1) * gi, vi = b2 * v[i] + (1.0f - b2) * gi * gi;");
    ec_line(&e->core, "m[i] = mi;");
    ec_line(&e->core, "v[i] = vi;");
    ec_line(&e->core, "p[i] = p[i] - lr * (mi * c1 / (sqrtf(vi * c2) + eps) + wd * p[i]);");
    if (ncopies) {
      ec_line(&e->core, "if (c)");
      ec_line(&e->core, "  c[i] = mdl_f32_to_bf16(p[i]);");
    }
    ec_leave(&e->core);
    ec_leave(&e->core);
    for (int j = 0; j < ns; j++) {
      int p = ec_canon(&e->core, ec_node(&e->core, seg[j])->in[0]);
      if (ec_offset(&e->core, seg[j]) >= 0 && ec_offset(&e->core, seg[j]) != ec_offset(&e->core, p))
        ec_line(&e->core, "memcpy(b%d, b%d, %lld * sizeof(float));", ptr(e, seg[j]), ptr(e, p),
                (long long)ec_numel(&e->core, p));
      ec_phase_done(&e->core, seg[j]);
    }
    ec_leave(&e->core);
    free(seg);
  }
  free(done);
  ec_phase_end(&e->core);
}

static void emit_group(Emit *e, int gi, const bool *emitted) {
  const Group *gr = &e->core.groups[gi];
  switch (gr->kind) {
  case G_NORM_BWD: emit_norm_bwd(e, gi, emitted); return;
  case G_ATTN: emit_attention(e, gi); return;
  case G_ATTN_BWD: emit_attention_bwd(e, gi); return;
  case G_CE: emit_ce(e, gi); return;
  case G_LMHEAD: emit_lmhead(e, gi); return;
  case G_OPT: emit_optimizer(e, gi); return;
  case G_SINGLE: break;
  }
  Op op = ec_node(&e->core, gr->mem[0])->op;
  switch (op) {
  case OP_MATMUL: emit_gemm(e, gi, emitted); return;
  case OP_SUM: case OP_MEAN: case OP_MAX: case OP_TARGET_COUNT: emit_reduce(e, gi, emitted); return;
  case OP_LAYERNORM: case OP_RMSNORM: emit_norm_fwd(e, gi, emitted); return;
  case OP_SOFTMAX: case OP_SOFTMAX_BWD: emit_softmax(e, gi, emitted); return;
  case OP_EMBED: emit_embed(e, gi); return;
  case OP_EMBED_BWD: emit_embed_bwd(e, gi); return;
  case OP_ROPE: emit_rope(e, gi); return;
  case OP_MAX_BWD: emit_max_bwd(e, gi); return;
  case OP_ATTENTION_MASK: emit_attn_mask(e, gi); return;
  default: ec_fail(&e->core, "no kernel for %s", op_name(op));
  }
}

//
// Steps.
//

static void pass_reset(Emit *e) {
  size_t n = (size_t)e->core.g->n;
  memset(e->core.written, 0, n * sizeof *e->core.written);
  memset(e->core.scratch, 0, n * sizeof *e->core.scratch);
  memset(e->declared, 0, n * sizeof *e->declared);
  memset(e->core.stored, 0, n * sizeof *e->core.stored);
  for (size_t i = 0; i < n; i++)
    e->core.host[i] = -1;
  e->core.body.len = e->notes.len = 0;
  e->core.nmemo = e->core.nixm = e->core.npending = e->core.nphase = e->ndecls = 0;
  e->core.indent = 1;
  e->core.depth = 0;
  e->core.fresh = 0;
  e->loop_ix = NULL;
  e->post_anchor = e->cur_q = -1;
  e->post_inloop = false;
  e->uses_h = false;
  e->core.flagged = false;
}

static void emit_step_body(Emit *e) {
  const Step *st = &e->core.f->steps[e->core.si];
  bool *emitted = ec_xcalloc((size_t)e->core.ngroups + 1, sizeof *emitted);
  for (int k = 0; k < e->core.ngroups && !e->core.failed; k++) {
    emit_group(e, e->core.order[k], emitted);
    emitted[e->core.order[k]] = true;
  }
  free(emitted);
  int *rest = ec_xcalloc((size_t)st->nnodes + 1, sizeof *rest), nrest = ec_unwritten(&e->core, rest);
  if (nrest)
    pw_loops(e, rest, nrest, -1);
  free(rest);
  ec_check_written(&e->core);
}

// The text two kernels share exactly when one's code computes the other's on other buffers: comments
// dropped, and the names that carry a node's number (buffers b12, widened w12, values v12_i) numbered
// by first appearance.
static char *kernel_key(const char *s) {
  Buf k = {0};
  const char **names = NULL; // (each compared on its first lens[i] characters)
  size_t *lens = NULL, nnames = 0;
  while (*s) {
    if (s[0] == '/' && s[1] == '/') {
      s += strcspn(s, "\n");
      continue;
    }
    bool ident = (*s == '_' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z'));
    if (!ident) {
      ec_bput(&k, "%c", *s++);
      continue;
    }
    size_t n = strspn(s, "_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789");
    size_t digits = strspn(s + 1, "0123456789"), stem = 1 + digits;
    bool numbered = digits && strchr("bwv", s[0]) && (stem == n || (s[0] == 'v' && s[stem] == '_'));
    if (!numbered) {
      ec_bput(&k, "%.*s", (int)n, s);
    } else { // (a value's local v12_i: its stem v12 numbered, its index suffix kept)
      size_t i = 0;
      while (i < nnames && !(lens[i] == stem && !strncmp(names[i], s, stem)))
        i++;
      if (i == nnames) {
        names = realloc(names, sizeof *names * (nnames + 1));
        lens = realloc(lens, sizeof *lens * (nnames + 1));
        if (!names || !lens)
          abort();
        names[nnames] = s;
        lens[nnames++] = stem;
      }
      ec_bput(&k, "%c#%zu%.*s", s[0], i, (int)(n - stem), s + stem);
    }
    s += n;
  }
  free(names);
  free(lens);
  return k.s ? k.s : strdup("");
}

// Emits step si as the function `name`, into k.
static bool emit_kernel(Emit *e, int si, const char *name, Kernel *k) {
  const Step *st = &e->core.f->steps[si];
  e->core.si = si;
  for (int k = 0; k < st->nnodes; k++)
    e->core.in_step[st->nodes[k]] = !ec_is_leaf(ec_node(&e->core, st->nodes[k])->op);
  memset(e->core.spill, 0, sizeof *e->core.spill * (size_t)e->core.g->n);
  memset(e->core.post_bad, 0, sizeof *e->core.post_bad * (size_t)e->core.g->n);
  bool ok = ec_groups_order(&e->core);
  for (int pass = 0; ok && pass < 32; pass++) {
    pass_reset(e);
    emit_step_body(e);
    if (e->core.failed || !e->core.flagged)
      break;
  }
  if (!e->core.failed && e->core.flagged)
    ec_fail(&e->core, "step %s: the layout of its values did not settle", st->name);
  for (int k = 0; k < st->nnodes; k++) {
    e->core.in_step[st->nodes[k]] = false;
    e->core.grp[st->nodes[k]] = -1;
  }
  if (e->core.failed)
    return false;
  ec_drop_unused(&e->core);

  Buf head = {0}, code = {0}, shared = {0};
  ec_bput(&head, "\n// %s: %s, %d op%s\n", name, ec_kind_name(st->kind), st->nnodes, st->nnodes == 1 ? "" : "s");
  for (int j = 0; j < st->nnodes; j++) {
    const IrNode *nd = ec_node(&e->core, st->nodes[j]);
    char buf[128];
    ec_bput(&head, "//   %%%-5d %-18s %-20s %-10s %s%s\n", nd->id, op_name(nd->op), nd->name ? nd->name : "",
            nd->loc.line ? str(e, "line %d", nd->loc.line) : "", dtype_name(nd->dtype),
            shape_str(nd->shape, buf, sizeof buf));
  }
  ec_bput(&head, "// loops:\n");
  ec_bappend(&head, &e->notes);
  ec_bput(&code, "static void %s(char *arena, const MdlHooks *h) {\n", name);
  Buf decl = {0}, frees = {0}, sdecl = {0};
  write_decls(e, &decl, &sdecl, k, &frees);
  Buf *both[2] = {&code, &shared};
  for (int i = 0; i < 2; i++) {
    if (!e->uses_h)
      ec_bput(both[i], "  (void)h;\n");
    if (i == 0 && !decl.len && !strstr(e->core.body.s ? e->core.body.s : "", "arena"))
      ec_bput(both[i], "  (void)arena;\n");
    ec_bappend(both[i], i ? &sdecl : &decl);
    ec_bappend(both[i], &e->core.body);
    ec_bappend(both[i], &frees);
    ec_bput(both[i], "}\n");
  }
  free(decl.s);
  free(sdecl.s);
  free(frees.s);
  *k = (Kernel){.name = name, .head = head.s, .code = code.s, .shared = k->noff ? shared.s : NULL, .off = k->off,
                .noff = k->noff};
  if (k->noff)
    k->key = kernel_key(shared.s);
  else
    free(shared.s);
  return true;
}

// The kernels into out, in order. Kernels of the same loops on other buffers (one per layer, most of
// them) share one function, NAME__code(arena, h, o), emitted once before the first of them, and each
// is a call of it with its buffers' arena offsets in o[]: the C compiler then compiles each distinct
// kernel once, however many layers the model has. A kernel alone in its loops is emitted whole.
static void write_kernels(Buf *out, const Kernel *ks, int n) {
  int *first = ec_xcalloc((size_t)n + 1, sizeof *first), *count = ec_xcalloc((size_t)n + 1, sizeof *count);
  for (int i = 0; i < n; i++) {
    first[i] = i;
    for (int j = 0; j < i && ks[i].key; j++)
      if (ks[j].key && first[j] == j && !strcmp(ks[i].key, ks[j].key)) {
        first[i] = j;
        break;
      }
    count[first[i]]++;
  }
  for (int i = 0; i < n; i++) {
    const Kernel *k = &ks[i], *f = &ks[first[i]];
    if (count[first[i]] < 2) {
      ec_bput(out, "%s%s", k->head, k->code);
      continue;
    }
    if (first[i] == i) {
      ec_bput(out, "\n// The loops of %d kernels, each on its own buffers (o[]: their offsets in the arena; the names\n"
              "// are those of %s's):\n//", count[i], k->name);
      for (int j = i, col = 2; j < n; j++)
        if (first[j] == i) {
          col += (int)strlen(ks[j].name) + 1;
          if (col > 110)
            ec_bput(out, "\n//"), col = 2 + (int)strlen(ks[j].name) + 1;
          ec_bput(out, " %s", ks[j].name);
        }
      ec_bput(out, "\n__attribute__((noinline)) static void %s__code(char *arena, const MdlHooks *h, const int64_t *o) "
              "{\n%s", k->name, k->shared);
    }
    ec_bput(out, "%sstatic void %s(char *arena, const MdlHooks *h) {\n  static const int64_t o[] = {", k->head,
            k->name);
    for (int j = 0; j < k->noff; j++)
      ec_bput(out, "%s%lld", j ? ", " : "", (long long)k->off[j]);
    ec_bput(out, "};\n  %s__code(arena, h, o);\n}\n", f->name);
  }
  free(first);
  free(count);
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
  return arena_strdup(e->core.a, buf);
}

char *emit_c(const Fusion *f, const MemPlan *m, const char *source_path) {
  const Graph *g = f->g;
  size_t n = (size_t)g->n;
  Emit e = {.core = {.f = f, .m = m, .g = g, .a = arena_new(), .val = core_val, .seed = core_seed, .base = core_base,
                     .ixt = "int64_t"}};
  e.core.in_step = ec_xcalloc(n, sizeof *e.core.in_step);
  e.core.grp = ec_xcalloc(n, sizeof *e.core.grp);
  e.core.spill = ec_xcalloc(n, sizeof *e.core.spill);
  e.core.post_bad = ec_xcalloc(n, sizeof *e.core.post_bad);
  e.core.written = ec_xcalloc(n, sizeof *e.core.written);
  e.core.scratch = ec_xcalloc(n, sizeof *e.core.scratch);
  e.declared = ec_xcalloc(n, sizeof *e.declared);
  e.core.stored = ec_xcalloc(n, sizeof *e.core.stored);
  e.core.host = ec_xcalloc(n, sizeof *e.core.host);
  e.core.phase_nodes = ec_xcalloc(n, sizeof *e.core.phase_nodes);
  e.core.pending = ec_xcalloc(n, sizeof *e.core.pending);
  e.decls = ec_xcalloc(n, sizeof *e.decls);
  for (size_t i = 0; i < n; i++)
    e.core.grp[i] = -1;

  ec_bput(&e.out, "// Generated by mdlc %s from %s: do not edit.\n", MDL_VERSION, source_path ? source_path : "?");
  ec_bput(&e.out,
          "// Model %s: one training step (forward, backward, AdamW) as %d kernels over one arena of %lld bytes\n",
          g->model ? g->model : "?", f->nsteps, (long long)m->arena_bytes);
  ec_bput(&e.out, "// (parameters, gradients and AdamW moments at %lld, %lld, %lld and %lld, %lld bytes each).\n",
          (long long)m->params, (long long)m->grads, (long long)m->m, (long long)m->v, (long long)m->param_bytes);
  ec_bput(&e.out, "// Build: cc -O3 -march=native -fno-math-errno -fopenmp -shared -fPIC; runtime/cpu.c loads it.\n");
  ec_bput(&e.out, "%s", ec_prelude_c);
  bool bf16 = false;
  for (int i = 0; i < g->n; i++)
    bf16 |= g->nodes[i]->dtype == DT_BF16 ||
            ((g->nodes[i]->op == OP_ATTENTION || g->nodes[i]->op == OP_ATTENTION_LSE ||
              g->nodes[i]->op == OP_ATTENTION_BWD) && g->nodes[i]->ia[4] == DT_BF16);
  if (bf16) // only in the code of graphs that hold bf16 values (so an fp32 graph's code is what it was)
    ec_bput(&e.out, "%s", ec_prelude_c_bf16);

  const char **names = ec_xcalloc((size_t)f->nsteps + 1, sizeof *names);
  Kernel *ks = ec_xcalloc((size_t)f->nsteps + 1, sizeof *ks);
  for (int si = 0; si < f->nsteps; si++) {
    names[si] = kernel_name(&e, f->steps[si].name, si, names);
    if (!emit_kernel(&e, si, names[si], &ks[si]))
      break;
  }
  char *text = NULL;
  if (e.core.failed) {
    fprintf(stderr, "mdlc: emit_c: %s\n", e.core.err);
  } else {
    write_kernels(&e.out, ks, f->nsteps);
    ec_bput(&e.out, "\n// The whole step, kernel after kernel.\n");
    ec_bput(&e.out, "void mdl_step(char *arena, const MdlHooks *h) {\n");
    for (int si = 0; si < f->nsteps; si++)
      ec_bput(&e.out, "  %s(arena, h);\n", names[si]);
    ec_bput(&e.out, "}\n\nconst MdlKernel mdl_kernels[] = {\n");
    for (int si = 0; si < f->nsteps; si++)
      ec_bput(&e.out, "    {\"%s\", %s},\n", names[si], names[si]);
    ec_bput(&e.out, "};\nconst int mdl_nkernels = %d;\n", f->nsteps);
    ec_bput(&e.out, "const int64_t mdl_arena_bytes = %lld;\n", (long long)m->arena_bytes);
    text = arena_alloc(g->arena, e.out.len + 1);
    memcpy(text, e.out.s, e.out.len);
  }
  for (int si = 0; si < f->nsteps; si++) {
    free(ks[si].head);
    free(ks[si].code);
    free(ks[si].shared);
    free(ks[si].key);
    free(ks[si].off);
  }
  free(ks);
  free(names);
  free(e.out.s);
  free(e.core.body.s);
  free(e.notes.s);
  free(e.core.memo);
  free(e.core.ixm);
  free(e.core.in_step);
  free(e.core.grp);
  free(e.core.spill);
  free(e.core.post_bad);
  free(e.core.written);
  free(e.core.scratch);
  free(e.declared);
  free(e.core.stored);
  free(e.core.host);
  free(e.core.phase_nodes);
  free(e.core.pending);
  free(e.decls);
  arena_free(e.core.a);
  return text;
}
