// emit_common.c: what the C emitter (emit_c.c) and the CUDA emitter (emit_cuda.c) share: the part
// of code generation that does not depend on the target.
//
// Design. Both emitters split a step's nodes into anchors (ops that need a loop nest or a kernel of
// their own) and pointwise nodes computed inline, and both settle the same questions the same way:
// where a node's value is (in memory, a view of another node, or still to compute), which values
// must be in memory before the next group (queued for an elementwise loop), which anchors form one
// group and in what order the groups run, and which step outputs can be computed in a group's own
// loop. Both also write the code of a loop body the same way: lines in nested scopes, values and
// index variables memoised per scope, and the index maps of the inline evaluator (broadcast,
// permute, slice, concat) as index expressions. EmitCore holds the state all this needs; each
// emitter embeds it as `core` in its own state, next to what is target-specific (buffers or kernel
// slots, launch shapes, the arithmetic of each op), and keeps everything that decides the text of a
// target. Nothing here writes text of its own choosing: what it emits is the emitter's (index
// variables are declared with the emitter's index type, EmitCore.ixt).
#include "emit_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

//
// Text buffers and memory.
//

void ec_bvput(Buf *b, const char *fmt, va_list ap) {
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
    b->s = xrealloc(b->s, cap, "the emitted source text");
    b->cap = cap;
  }
}

void ec_bput(Buf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  ec_bvput(b, fmt, ap);
  va_end(ap);
}

void ec_bappend(Buf *b, const Buf *x) {
  if (x->len)
    ec_bput(b, "%.*s", (int)x->len, x->s);
}

void *ec_xcalloc(size_t n, size_t size) {
  return xcalloc(n, size, "the emitter's tables");
}

// Grows *p (of *cap elements of `size` bytes) to hold n + 1.
void ec_grow(void *p, int n, int *cap, size_t size) {
  void **pp = p;
  if (n < *cap)
    return;
  *cap = *cap ? 2 * *cap : 16;
  *pp = xrealloc(*pp, size * (size_t)*cap, "the emitter's tables");
}

//
// Failure, nodes and where their values are.
//

bool ec_fail(EmitCore *e, const char *fmt, ...) {
  if (!e->failed) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->err, sizeof e->err, fmt, ap);
    va_end(ap);
  }
  e->failed = true;
  return false;
}

const IrNode *ec_node(const EmitCore *e, int n) { return e->g->nodes[n]; }
int64_t ec_numel(const EmitCore *e, int n) { return shape_numel(ec_node(e, n)->shape); }
int64_t ec_last_dim(const EmitCore *e, int n) {
  Shape s = ec_node(e, n)->shape;
  return s.rank ? s.d[s.rank - 1] : 1;
}

const char *ec_ctype(const EmitCore *e, int n) { return ec_node(e, n)->dtype == DT_I32 ? "int32_t" : "float"; }

const char *ec_mtype(const EmitCore *e, int n) {
  DType dt = ec_node(e, n)->dtype;
  return dt == DT_I32 ? "int32_t" : dt == DT_BF16 ? "uint16_t" : dt == DT_F8E4M3 || dt == DT_F8E5M2 ? "uint8_t" : "float";
}

// fp8 values are stored as their codes and loaded as the codes' values (the scaled values: mdl.h)
const char *ec_load(EmitCore *e, int n, const char *elem) {
  DType dt = ec_node(e, n)->dtype;
  return dt == DT_BF16      ? ec_str(e, "mdl_bf16_to_f32(%s)", elem)
         : dt == DT_F8E4M3 ? ec_str(e, "mdl_e4m3_to_f32(%s)", elem)
         : dt == DT_F8E5M2 ? ec_str(e, "mdl_e5m2_to_f32(%s)", elem)
                           : elem;
}

const char *ec_store(EmitCore *e, int n, const char *v) {
  DType dt = ec_node(e, n)->dtype;
  return dt == DT_BF16      ? ec_str(e, "mdl_f32_to_bf16(%s)", v)
         : dt == DT_F8E4M3 ? ec_str(e, "mdl_f32_to_e4m3(%s)", v)
         : dt == DT_F8E5M2 ? ec_str(e, "mdl_f32_to_e5m2(%s)", v)
                           : v;
}

bool ec_is_leaf(Op op) {
  return op == OP_INPUT || op == OP_PARAM || op == OP_STATE || op == OP_SCALAR || op == OP_CONST;
}

// Ops computed inline at any flat index.
bool ec_is_pointwise(Op op) {
  switch (op) {
  case OP_NEG: case OP_EXP: case OP_LOG: case OP_TANH: case OP_SQRT: case OP_RSQRT: case OP_RELU:
  case OP_GELU: case OP_SILU: case OP_SIGMOID: case OP_ABS: case OP_CLAMP: case OP_STOP_GRADIENT: case OP_DROPOUT:
  case OP_CAST: case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_RELU_BWD: case OP_GELU_BWD:
  case OP_SILU_BWD: case OP_ABS_BWD: case OP_CLAMP_BWD: case OP_COMPARE: case OP_WHERE: case OP_RESHAPE:
  case OP_PERMUTE: case OP_MINIMUM: case OP_MAXIMUM: case OP_FLOORDIV: case OP_MOD:
  case OP_BROADCAST: case OP_SLICE: case OP_SLICE_BWD: case OP_CONCAT:
    return true;
  default:
    return false;
  }
}

// A RESHAPE outside every step is a view: it lives where its input lives.
int ec_canon(const EmitCore *e, int n) {
  while (ec_node(e, n)->op == OP_RESHAPE && !e->in_step[n] && e->f->step_of[n] < 0)
    n = ec_node(e, n)->in[0];
  return n;
}

int64_t ec_offset(const EmitCore *e, int n) { return e->m->offset[n]; }

// Is node c's value readable from memory right now?
bool ec_in_memory(const EmitCore *e, int c) {
  Op op = ec_node(e, c)->op;
  if (e->written[c])
    return true;
  if (op == OP_CONST)
    return false;
  if (ec_is_leaf(op))
    return true;
  return !e->in_step[c] && ec_offset(e, c) >= 0;
}

bool ec_has_target(const EmitCore *e, int c) { return ec_offset(e, c) >= 0 || e->scratch[c] || e->host[c] >= 0; }

void ec_flag(EmitCore *e, bool *set, int n) {
  if (!set[n]) {
    set[n] = true;
    e->flagged = true;
  }
}

//
// Strings of the emission, lines and scopes of the code being built.
//

// printf into a string of the emission's arena.
const char *ec_str(EmitCore *e, const char *fmt, ...) {
  va_list ap, cp;
  va_start(ap, fmt);
  va_copy(cp, ap);
  int n = vsnprintf(NULL, 0, fmt, cp);
  va_end(cp);
  char *s = arena_alloc(e->a, (size_t)(n > 0 ? n : 0) + 1);
  vsnprintf(s, (size_t)(n > 0 ? n : 0) + 1, fmt, ap);
  va_end(ap);
  return s;
}

// A double literal that reads back as the same double, in as few digits as that takes.
const char *ec_dlit(EmitCore *e, double v) {
  char buf[64];
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (strtod(buf, NULL) == v)
      break;
  }
  if (!strpbrk(buf, ".en"))
    strcat(buf, ".0");
  return ec_str(e, "%s", buf);
}

const char *ec_flit(EmitCore *e, double v) {
  float f = (float)v; // (a finite double beyond the float range is an infinite float)
  if (isnan(f))
    return "MDL_NAN";
  if (isinf(f))
    return f > 0 ? "MDL_INF" : "(-MDL_INF)";
  char buf[64];
  for (int prec = 1; prec <= 9; prec++) {
    snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
    if (strtof(buf, NULL) == f)
      break;
  }
  bool frac = strpbrk(buf, ".e") != NULL;
  return ec_str(e, "%s%s%sf%s", v < 0 ? "(" : "", buf, frac ? "" : ".0", v < 0 ? ")" : "");
}

void ec_line(EmitCore *e, const char *fmt, ...) {
  ec_bput(&e->body, "%*s", 2 * e->indent, "");
  va_list ap;
  va_start(ap, fmt);
  ec_bvput(&e->body, fmt, ap);
  va_end(ap);
  ec_bput(&e->body, "\n");
}

// A line ending in "{" (or a bare "{"), and a new scope for memoised values.
void ec_enter(EmitCore *e, const char *fmt, ...) {
  ec_bput(&e->body, "%*s", 2 * e->indent, "");
  va_list ap;
  va_start(ap, fmt);
  ec_bvput(&e->body, fmt, ap);
  va_end(ap);
  ec_bput(&e->body, "%s{\n", e->body.s[e->body.len - 1] == ' ' ? "" : " ");
  e->indent++;
  e->depth++;
}

void ec_leave(EmitCore *e) {
  while (e->nmemo && e->memo[e->nmemo - 1].depth >= e->depth)
    e->nmemo--;
  while (e->nixm && e->ixm[e->nixm - 1].depth >= e->depth)
    e->nixm--;
  e->depth--;
  e->indent--;
  ec_line(e, "}");
}

const char *ec_memo_get(EmitCore *e, int n, const char *ix) {
  for (int i = e->nmemo - 1; i >= 0; i--)
    if (e->memo[i].node == n && strcmp(e->memo[i].ix, ix) == 0)
      return e->memo[i].name;
  return NULL;
}

void ec_memo_put(EmitCore *e, int n, const char *ix, const char *name) {
  ec_grow(&e->memo, e->nmemo, &e->capmemo, sizeof *e->memo);
  e->memo[e->nmemo++] = (Memo){n, arena_strdup(e->a, ix), name, e->depth};
}

// A variable holding the index expression `expr` (or expr itself when it is a name or number).
static const char *ix_var(EmitCore *e, const char *expr) {
  bool simple = true;
  for (const char *p = expr; *p; p++)
    simple &= (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_';
  if (simple)
    return arena_strdup(e->a, expr);
  for (int i = e->nixm - 1; i >= 0; i--)
    if (strcmp(e->ixm[i].expr, expr) == 0)
      return e->ixm[i].name;
  const char *name = ec_str(e, "j%d", ++e->fresh);
  ec_line(e, "const %s %s = %s;", e->ixt, name, expr);
  ec_grow(&e->ixm, e->nixm, &e->capixm, sizeof *e->ixm);
  e->ixm[e->nixm++] = (IxMemo){arena_strdup(e->a, expr), name, e->depth};
  return name;
}

//
// Phases (a loop nest or a kernel: its stores count as written after it), and what must be in
// memory before the next group.
//

void ec_phase_begin(EmitCore *e) { e->nphase = 0; }

void ec_phase_done(EmitCore *e, int n) {
  e->written[n] = true;
  e->stored[n] = true;
}

void ec_phase_end(EmitCore *e) {
  for (int i = 0; i < e->nphase; i++)
    e->written[e->phase_nodes[i]] = true;
  e->nphase = 0;
}

// The node whose memory holds n's elements in n's flat order (n itself, its view's source, or the
// source of unwritten reshapes of this step), or -1.
int ec_mem_alias(EmitCore *e, int n) {
  for (;;) {
    int c = ec_canon(e, n);
    if (ec_in_memory(e, c))
      return c;
    if (!(e->in_step[c] && ec_node(e, c)->op == OP_RESHAPE))
      return -1;
    n = ec_node(e, c)->in[0];
  }
}

// n read in place as rows of a wider tensor: a SLICE of the last axis that is an unwritten member of
// this step, or a strided view (a SLICE the fusion left in no step because only attention reads it).
// Sets *src, the node whose buffer holds the whole rows, and *start, the slice's first column.
bool ec_row_slice(EmitCore *e, int n, int *src, int64_t *start) {
  int c = ec_canon(e, n);
  const IrNode *nd = ec_node(e, c);
  if (nd->op != OP_SLICE || nd->ia[0] != nd->shape.rank - 1)
    return false;
  bool view = !e->in_step[c] && e->f->step_of[c] < 0;
  bool member = e->in_step[c] && ec_offset(e, c) < 0 && ec_mem_alias(e, n) < 0;
  int s = view || member ? ec_mem_alias(e, nd->in[0]) : -1;
  if (s < 0)
    return false;
  *src = s;
  *start = nd->ia[1];
  return true;
}

// Node n must be in memory before the next group: returns the node whose buffer to read, queueing
// an elementwise loop when n is a pointwise node of this step or a constant.
int ec_need(EmitCore *e, int n) {
  int a = ec_mem_alias(e, n);
  if (a >= 0)
    return a;
  int c = ec_canon(e, n);
  Op op = ec_node(e, c)->op;
  if (!(op == OP_CONST || (e->in_step[c] && ec_is_pointwise(op)))) {
    if (e->in_step[c] && e->grp[c] >= 0) {
      ec_flag(e, e->spill, c); // an anchor of this step kept as a local: whole in the next pass
      e->scratch[c] = true;
      return c;
    }
    ec_fail(e, "step %s needs node %d (%s) in memory", e->f->steps[e->si].name, c, op_name(op));
    return c;
  }
  for (int i = 0; i < e->npending; i++)
    if (e->pending[i] == c)
      return c;
  if (ec_offset(e, c) < 0)
    e->scratch[c] = true;
  e->pending[e->npending++] = c;
  return c;
}

//
// Groups: which anchors emit together, and in what order.
//

// Follows RESHAPEs (views and reshapes of this step) up from n.
int ec_through_reshapes(EmitCore *e, int n) {
  while (ec_node(e, n)->op == OP_RESHAPE && (e->in_step[n] || e->f->step_of[n] < 0))
    n = ec_node(e, n)->in[0];
  return n;
}

static bool same_inputs(const EmitCore *e, const IrNode *a, const IrNode *b) {
  if (a->nin != b->nin)
    return false;
  for (int k = 0; k < a->nin; k++)
    if (ec_canon(e, a->in[k]) != ec_canon(e, b->in[k]))
      return false;
  return true;
}

static void group_add(Group *gr, int n) { gr->mem[gr->nmem++] = n; }

// The value n reads through in-step RESHAPEs and CASTs (with bf16, the LM head's loss reads the
// logits through one, and its backward GEMMs the gradient).
static int through_cast(EmitCore *e, int n) {
  n = ec_through_reshapes(e, n);
  while (ec_node(e, n)->op == OP_CAST && e->in_step[n])
    n = ec_through_reshapes(e, ec_node(e, n)->in[0]);
  return n;
}

// The LM-head pattern around cross_entropy_bwd node ceb: logits = x @ W (or W^T), the loss and
// its gradient of the same logits, and dx = dlogits @ W^T (W), dW = dlogits^T x (x^T dlogits). Only
// when the logits and dlogits live nowhere else.

static bool match_lmhead(EmitCore *e, int ceb, Group *gr) {
  const IrNode *b = ec_node(e, ceb);
  int mm = through_cast(e, b->in[0]), lc = ec_through_reshapes(e, b->in[0]);
  if (lc == mm)
    lc = -1;
  if (!e->in_step[mm] || ec_node(e, mm)->op != OP_MATMUL)
    return false;
  const IrNode *m = ec_node(e, mm);
  if (m->ia[0] || ec_node(e, m->in[0])->shape.rank != 2 || ec_node(e, m->in[1])->shape.rank != 2)
    return false;
  int x = ec_canon(e, m->in[0]), w = ec_canon(e, m->in[1]);
  bool tb = m->ia[1];
  int ce = -1, dx = -1, dw = -1;
  for (int k = 0; k < e->f->steps[e->si].nnodes; k++) {
    int n = e->f->steps[e->si].nodes[k];
    const IrNode *nd = ec_node(e, n);
    if (nd->op == OP_CROSS_ENTROPY && ec_through_reshapes(e, nd->in[0]) == (lc >= 0 ? lc : mm) &&
        ec_canon(e, nd->in[1]) == ec_canon(e, b->in[1]))
      ce = n;
    if (nd->op != OP_MATMUL || n == mm)
      continue;
    int a0 = through_cast(e, nd->in[0]), a1 = through_cast(e, nd->in[1]);
    if (a0 == ceb && !nd->ia[0] && nd->ia[1] == !tb && ec_canon(e, nd->in[1]) == w)
      dx = n;
    if (tb && a0 == ceb && nd->ia[0] && !nd->ia[1] && ec_canon(e, nd->in[1]) == x)
      dw = n;
    if (!tb && a1 == ceb && nd->ia[0] && !nd->ia[1] && ec_canon(e, nd->in[0]) == x)
      dw = n;
  }
  if (ce < 0 || dx < 0 || dw < 0)
    return false;
  int dlc = ec_through_reshapes(e, ec_node(e, dx)->in[0]);
  if (ec_node(e, dlc)->op != OP_CAST)
    dlc = -1;
  // Every consumer of the logits and of dlogits (through reshapes) must be one of the pattern.
  for (int n = mm; n < e->g->n; n++) {
    const IrNode *nd = ec_node(e, n);
    for (int k = 0; k < nd->nin; k++) {
      int src = ec_through_reshapes(e, nd->in[k]);
      if ((src != mm && src != lc && src != ceb && src != dlc) || n == lc || n == ce || n == ceb || n == dx ||
          n == dw || n == dlc)
        continue;
      if (nd->op == OP_RESHAPE && (e->in_step[n] || e->f->step_of[n] < 0) && ec_offset(e, n) < 0 &&
          (e->in_step[n] || ec_canon(e, n) != n))
        continue;
      return false;
    }
  }
  if (ec_offset(e, mm) >= 0 || ec_offset(e, ceb) >= 0 || (dlc >= 0 && ec_offset(e, dlc) >= 0) ||
      (lc >= 0 && (ec_offset(e, lc) >= 0 || ec_node(e, lc)->dtype != DT_BF16)))
    return false;
  *gr = (Group){.kind = G_LMHEAD, .mm = mm, .ce = ce, .ceb = ceb, .dx = dx, .dw = dw, .x = m->in[0], .w = m->in[1],
                .tgt = b->in[1], .dloss = b->in[2], .tb = tb, .dlc = dlc, .lc = lc};
  return true;
}

// Is m a SUM over the rows of a value of norm backward nd's element count and row length (rule 10 of
// fuse.c)? The norm's row loop adds it up in column partials, as it does dw and db.
static bool column_sum(const EmitCore *e, const IrNode *nd, const IrNode *m) {
  const IrNode *in = ec_node(e, m->in[0]);
  return m->op == OP_SUM && m->ia[0] == 0 && in->shape.rank == 2 && ec_numel(e, m->in[0]) == ec_numel(e, nd->in[0]) &&
         in->shape.d[1] == ec_last_dim(e, nd->in[0]);
}

// The LM head of a graph without a backward (the validation engine's; rule 2 of fuse.c): the logits
// GEMM and the loss of cross_entropy node ce, the logits living nowhere else; dx, dw, ceb, dloss and
// dlc are -1.
static bool match_lmhead_fwd(EmitCore *e, int ce, Group *gr) {
  const IrNode *c = ec_node(e, ce);
  int mm = through_cast(e, c->in[0]), lc = ec_through_reshapes(e, c->in[0]);
  if (lc == mm)
    lc = -1;
  if (e->f->steps[e->si].kind != STEP_LMHEAD || !e->in_step[mm] || ec_node(e, mm)->op != OP_MATMUL)
    return false;
  const IrNode *m = ec_node(e, mm);
  if (m->ia[0] || ec_node(e, m->in[0])->shape.rank != 2 || ec_node(e, m->in[1])->shape.rank != 2)
    return false;
  for (int n = mm + 1; n < e->g->n; n++) { // every reader of the logits is the pattern's
    const IrNode *nd = ec_node(e, n);
    for (int k = 0; k < nd->nin; k++) {
      int src = ec_through_reshapes(e, nd->in[k]);
      if ((src != mm && src != lc) || n == lc || n == ce)
        continue;
      if (nd->op == OP_RESHAPE && (e->in_step[n] || e->f->step_of[n] < 0) && ec_offset(e, n) < 0 &&
          (e->in_step[n] || ec_canon(e, n) != n))
        continue;
      return false;
    }
  }
  if (ec_offset(e, mm) >= 0 || (lc >= 0 && (ec_offset(e, lc) >= 0 || ec_node(e, lc)->dtype != DT_BF16)))
    return false;
  *gr = (Group){.kind = G_LMHEAD, .mm = mm, .ce = ce, .ceb = -1, .dx = -1, .dw = -1, .x = m->in[0], .w = m->in[1],
                .tgt = c->in[1], .dloss = -1, .tb = m->ia[1], .dlc = -1, .lc = lc};
  return true;
}

static bool groups_build(EmitCore *e, bool split_all) {
  const Step *st = &e->f->steps[e->si];
  e->ngroups = 0;
  e->groups = arena_alloc(e->a, sizeof(Group) * (size_t)(st->nnodes + 1));
  for (int k = 0; k < st->nnodes; k++)
    e->grp[st->nodes[k]] = -1;
  for (int k = 0; k < st->nnodes && !split_all; k++) {
    int n = st->nodes[k];
    Group lm;
    Op op = ec_node(e, n)->op;
    if (e->in_step[n] && e->grp[n] < 0 &&
        ((op == OP_CROSS_ENTROPY_BWD && match_lmhead(e, n, &lm)) ||
         (op == OP_CROSS_ENTROPY && !e->g->grads && match_lmhead_fwd(e, n, &lm)))) {
      lm.mem = arena_alloc(e->a, sizeof(int) * 7);
      int mem[7] = {lm.mm, lm.ce, lm.ceb, lm.dx, lm.dw, lm.dlc, lm.lc};
      for (int i = 0; i < 7; i++) {
        if (mem[i] < 0)
          continue;
        group_add(&lm, mem[i]);
        e->grp[mem[i]] = e->ngroups;
      }
      lm.ext = arena_alloc(e->a, sizeof(int) * 4);
      lm.ext[0] = lm.x, lm.ext[1] = lm.w, lm.ext[2] = lm.tgt, lm.ext[3] = lm.dloss;
      lm.n_ext = lm.dloss >= 0 ? 4 : 3;
      e->groups[e->ngroups++] = lm;
    }
  }
  for (int k = 0; k < st->nnodes; k++) {
    int n = st->nodes[k];
    const IrNode *nd = ec_node(e, n);
    if (!e->in_step[n] || e->grp[n] >= 0 || ec_is_pointwise(nd->op))
      continue;
    GroupKind kind = G_SINGLE;
    switch (nd->op) {
    case OP_LAYERNORM_BWD: case OP_RMSNORM_BWD: kind = G_NORM_BWD; break;
    case OP_ATTENTION: case OP_ATTENTION_LSE: kind = G_ATTN; break;
    case OP_ATTENTION_BWD: kind = G_ATTN_BWD; break;
    case OP_CROSS_ENTROPY: case OP_CROSS_ENTROPY_BWD: kind = G_CE; break;
    case OP_GRAD_NORM: case OP_ADAMW: kind = G_OPT; break;
    default: break;
    }
    Group *gr = &e->groups[e->ngroups];
    *gr = (Group){.kind = kind, .mem = arena_alloc(e->a, sizeof(int) * (size_t)st->nnodes)};
    int nsums = 0; // G_NORM_BWD: its column sums
    group_add(gr, n);
    e->grp[n] = e->ngroups;
    for (int j = k + 1; j < st->nnodes && kind != G_SINGLE && !split_all; j++) {
      int n2 = st->nodes[j];
      const IrNode *m = ec_node(e, n2);
      if (!e->in_step[n2] || e->grp[n2] >= 0)
        continue;
      bool join = false;
      if (kind == G_NORM_BWD)
        join = (m->op == nd->op && same_inputs(e, nd, m) && m->fa[0] == nd->fa[0]) ||
               (column_sum(e, nd, m) && nsums < EC_MAX_COLSUMS);
      else if (kind == G_ATTN)
        join = m->op != nd->op && (m->op == OP_ATTENTION || m->op == OP_ATTENTION_LSE) && gr->nmem == 1 &&
               same_inputs(e, nd, m) && m->fa[0] == nd->fa[0] && m->ia[0] == nd->ia[0] && m->ia[1] == nd->ia[1] &&
               m->ia[5] == nd->ia[5] && m->ia[6] == nd->ia[6];
      else if (kind == G_ATTN_BWD)
        join = m->op == nd->op && same_inputs(e, nd, m) && m->fa[0] == nd->fa[0] && m->ia[0] == nd->ia[0] &&
               m->ia[1] == nd->ia[1] && m->ia[5] == nd->ia[5] && m->ia[6] == nd->ia[6];
      else if (kind == G_CE)
        join = (m->op == OP_CROSS_ENTROPY || m->op == OP_CROSS_ENTROPY_BWD) && m->op != nd->op && gr->nmem == 1 &&
               ec_canon(e, m->in[0]) == ec_canon(e, nd->in[0]) && ec_canon(e, m->in[1]) == ec_canon(e, nd->in[1]);
      else if (kind == G_OPT)
        join = m->op == OP_GRAD_NORM || m->op == OP_ADAMW;
      if (join) {
        group_add(gr, n2);
        e->grp[n2] = e->ngroups;
        nsums += kind == G_NORM_BWD && m->op == OP_SUM;
      }
    }
    int nin = 0;
    for (int i = 0; i < gr->nmem; i++)
      nin += ec_node(e, gr->mem[i])->nin;
    gr->ext = arena_alloc(e->a, sizeof(int) * (size_t)(nin + 1));
    for (int i = 0; i < gr->nmem; i++) {
      const IrNode *m = ec_node(e, gr->mem[i]);
      for (int j = 0; j < m->nin; j++)
        if (e->grp[ec_canon(e, m->in[j])] != e->ngroups || !e->in_step[ec_canon(e, m->in[j])])
          gr->ext[gr->n_ext++] = m->in[j];
    }
    e->ngroups++;
  }
  return true;
}

// The groups node n depends on directly (through pointwise nodes and views of this step).
static void direct_deps(EmitCore *e, int n, bool *deps, int *stamp, int mark) {
  int c = ec_canon(e, n);
  if (!e->in_step[c] || stamp[c] == mark)
    return;
  stamp[c] = mark;
  if (e->grp[c] >= 0) {
    deps[e->grp[c]] = true;
    return;
  }
  for (int k = 0; k < ec_node(e, c)->nin; k++)
    direct_deps(e, ec_node(e, c)->in[k], deps, stamp, mark);
}

// Orders the groups (dependencies first, then the lowest member id). A group whose members depend
// on one another through the step is split into single anchors.
bool ec_groups_order(EmitCore *e) {
  int *stamp = ec_xcalloc((size_t)e->g->n, sizeof *stamp);
  for (int attempt = 0; attempt < 2; attempt++) {
    groups_build(e, attempt == 1);
    int ng = e->ngroups, mark = 0;
    e->gdep = arena_alloc(e->a, sizeof(bool *) * (size_t)(ng + 1));
    for (int a = 0; a < ng; a++) {
      e->gdep[a] = arena_alloc(e->a, sizeof(bool) * (size_t)(ng + 1));
      for (int k = 0; k < e->groups[a].n_ext; k++)
        direct_deps(e, e->groups[a].ext[k], e->gdep[a], stamp, ++mark);
      // A norm backward's column sums add up values its own row loop computes.
      if (e->groups[a].kind == G_NORM_BWD)
        e->gdep[a][a] = false;
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
    bool *done = ec_xcalloc((size_t)ng + 1, sizeof *done);
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
  return ec_fail(e, "step %s: its anchors depend on one another in a cycle", e->f->steps[e->si].name);
}

// The members of G_NORM_BWD group gi: its siblings dx, dw, db (-1 when absent) and its column sums
// (returns how many). The column outputs get a buffer of the step's own when they have no slot.
int ec_norm_members(EmitCore *e, int gi, int *dx, int *dw, int *db, int *sums) {
  const Group *gr = &e->groups[gi];
  int nsum = 0;
  *dx = *dw = *db = -1;
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *m = ec_node(e, gr->mem[i]);
    if (m->op == OP_SUM)
      sums[nsum++] = gr->mem[i];
    else
      *(m->ia[0] == 0 ? dx : m->ia[0] == 1 ? dw : db) = gr->mem[i];
  }
  int cols[2 + EC_MAX_COLSUMS] = {*dw, *db};
  memcpy(cols + 2, sums, sizeof *sums * (size_t)nsum);
  for (int i = 0; i < 2 + nsum; i++)
    if (cols[i] >= 0 && ec_offset(e, cols[i]) < 0)
      e->scratch[cols[i]] = true;
  return nsum;
}

// Outputs of the step that are pointwise, unwritten, of `n` f32 or bf16 elements, depending on no
// group not yet emitted, and on group gi (`after`) or not.
static int out_set(EmitCore *e, int gi, int64_t n, const bool *emitted, int *q, bool after) {
  const Step *st = &e->f->steps[e->si];
  int nq = 0, *stamp = ec_xcalloc((size_t)e->g->n, sizeof *stamp);
  bool *deps = ec_xcalloc((size_t)e->ngroups + 1, sizeof *deps);
  for (int k = 0; k < st->nnodes; k++) {
    int c = st->nodes[k];
    if (!e->in_step[c] || e->grp[c] >= 0 || !ec_is_pointwise(ec_node(e, c)->op) || ec_offset(e, c) < 0 ||
        e->written[c] || e->post_bad[c] || ec_numel(e, c) != n ||
        ec_node(e, c)->dtype == DT_I32 || ec_node(e, c)->dtype == DT_F64)
      continue;
    memset(deps, 0, sizeof *deps * (size_t)e->ngroups);
    direct_deps(e, c, deps, stamp, k + 1);
    bool ok = deps[gi] == after;
    for (int b = 0; b < e->ngroups && ok; b++)
      ok = !deps[b] || b == gi || emitted[b];
    if (ok)
      q[nq++] = c;
  }
  free(stamp);
  free(deps);
  return nq;
}

// Outputs of the step that can be computed in (or right after) group gi's loop over its `n` outputs.
int ec_post_set(EmitCore *e, int gi, int64_t n, const bool *emitted, int *q) {
  return out_set(e, gi, n, emitted, q, true);
}

// The step outputs a reduction's loop over its input computes on the way (rule 10 of fuse.c): of the
// input's `n` f32 or bf16 elements, not depending on group gi nor on a group not yet emitted.
int ec_side_set(EmitCore *e, int gi, int64_t n, const bool *emitted, int *q) {
  return out_set(e, gi, n, emitted, q, false);
}

// One element of reduction a's input, at ix, into v (a TARGET_COUNT's: 1 for a counted target, else
// 0); the step's outputs of the input's size that the reduction does not read (`side`: a bf16
// rounding of the input, say) are computed and stored on the way, as the elementwise kernel they came
// from would have.
void ec_reduce_input(EmitCore *e, int a, const int *side, int nside) {
  const IrNode *nd = ec_node(e, a);
  const char *x = e->val(e, nd->in[0], "ix");
  if (nd->op == OP_TARGET_COUNT)
    ec_line(e, "const float v = %s >= 0 ? 1.0f : 0.0f;", x);
  else
    ec_line(e, "const float v = %s;", x);
  for (int t = 0; t < nside; t++)
    if (!e->stored[side[t]])
      e->val(e, side[t], "ix");
}

// Is a reduction over `n` elements that depends on group gi still to be emitted in this step (rule 10
// of fuse.c)? Then gi's epilogue is left to it: its loop computes and stores those values while
// reducing them, and they are not read back.
bool ec_reduction_after(EmitCore *e, int gi, const bool *emitted, int64_t n) {
  for (int r = 0; r < e->ngroups; r++) {
    const Group *gr = &e->groups[r];
    if (r == gi || emitted[r] || gr->kind != G_SINGLE || !e->gdep[r][gi])
      continue;
    const IrNode *nd = ec_node(e, gr->mem[0]);
    if ((nd->op == OP_SUM || nd->op == OP_MEAN || nd->op == OP_MAX) && ec_numel(e, nd->in[0]) == n)
      return true;
  }
  return false;
}

void ec_attention_members(const EmitCore *e, int gi, int *a, int *lse) {
  const Group *gr = &e->groups[gi];
  *a = *lse = -1;
  for (int i = 0; i < gr->nmem; i++)
    *(ec_node(e, gr->mem[i])->op == OP_ATTENTION ? a : lse) = gr->mem[i];
}

// The bf16 CASTs of this step that round anchor a's output at its own flat index (rule 9 of fuse.c:
// the attention forward's), at most `max`, into casts; the anchor's kernel stores them itself. *f32
// says whether a's own value must still be stored: it has a slot, or something else of the step
// reads it.
int ec_output_casts(EmitCore *e, int a, int *casts, int max, bool *f32) {
  const Step *st = &e->f->steps[e->si];
  int n = 0;
  *f32 = ec_offset(e, a) >= 0 || e->spill[a];
  for (int k = 0; k < st->nnodes; k++) {
    int c = st->nodes[k];
    const IrNode *nd = ec_node(e, c);
    if (!e->in_step[c] || c == a || (nd->op == OP_RESHAPE && ec_through_reshapes(e, c) == a))
      continue;
    bool reads = false;
    for (int i = 0; i < nd->nin; i++)
      reads |= ec_through_reshapes(e, nd->in[i]) == a;
    if (!reads)
      continue;
    if (nd->op == OP_CAST && nd->dtype == DT_BF16 && ec_offset(e, c) >= 0 && !e->written[c] &&
        ec_numel(e, c) == ec_numel(e, a) && n < max)
      casts[n++] = c;
    else
      *f32 = true;
  }
  return n;
}

// Step outputs still unwritten when every group is done (pointwise nodes with an arena slot), into
// rest; returns how many.
int ec_unwritten(EmitCore *e, int *rest) {
  const Step *st = &e->f->steps[e->si];
  int nrest = 0;
  for (int k = 0; k < st->nnodes; k++) {
    int c = st->nodes[k];
    if (e->in_step[c] && ec_offset(e, c) >= 0 && !e->written[c] && ec_is_pointwise(ec_node(e, c)->op))
      rest[nrest++] = c;
  }
  return nrest;
}

// Fails when a value of the step that has an arena slot was never written (unless a flag set in
// this pass asks for another).
void ec_check_written(EmitCore *e) {
  const Step *st = &e->f->steps[e->si];
  for (int k = 0; k < st->nnodes && !e->failed; k++) {
    int c = st->nodes[k];
    if (e->in_step[c] && ec_offset(e, c) >= 0 && !e->written[c] && !e->flagged)
      ec_fail(e, "step %s never writes node %d (%s)", st->name, c, op_name(ec_node(e, c)->op));
  }
}

const char *ec_kind_name(StepKind k) {
  switch (k) {
  case STEP_KERNEL: return "kernel";
  case STEP_GEMM: return "GEMM";
  case STEP_ATTENTION: return "attention";
  case STEP_LMHEAD: return "LM head";
  case STEP_OPTIMIZER: return "optimizer";
  }
  return "?";
}

//
// Declarations nobody reads.
//

static bool ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// How many times the identifier `name` (not a member: x.name) occurs in [from, to).
static int occurrences(const char *from, const char *to, const char *name) {
  size_t n = strlen(name);
  int count = 0;
  for (const char *p = from; (p = memmem(p, (size_t)(to - p), name, n)); p++)
    if ((p == from || (!ident_char(p[-1]) && p[-1] != '.')) && !ident_char(p[n]))
      count++;
  return count;
}

// The end of the block that holds the line at ln (its closing brace, or the end of the text).
static const char *scope_end(const char *ln) {
  int depth = 0;
  for (const char *p = ln; *p; p++)
    if (*p == '{')
      depth++;
    else if (*p == '}' && --depth < 0)
      return p;
  return ln + strlen(ln);
}

// Is `name` one of the evaluator's values or indices (v12, v12_i, v12_j3, f3, j7, i0..i3, ix)?
static bool temp_name(const char *s, size_t n) {
  if (n == 2 && !strncmp(s, "ix", 2))
    return true;
  if (n < 2 || !strchr("vfji", s[0]))
    return false;
  size_t k = 1;
  while (k < n && s[k] >= '0' && s[k] <= '9')
    k++;
  if (k == 1)
    return false;
  if (k < n && (s[0] != 'v' || s[k] != '_')) // the C back end's values: v<node>_<index>
    return false;
  return s[0] != 'i' || n == 2;
}

// Removes the declarations of evaluator values and indices their scope never reads (an index computed
// for a value that turned out to be a constant, a lane index only float4 loads needed), repeatedly,
// since a removed line may have been the last reader of another. Their initialisers have no effects.
void ec_drop_unused(EmitCore *e) {
  for (bool changed = true; changed && e->body.len;) {
    changed = false;
    e->body.s[e->body.len] = 0;
    for (char *ln = e->body.s; *ln;) {
      char *end = strchr(ln, '\n'), *p = ln;
      end = end ? end + 1 : ln + strlen(ln);
      while (*p == ' ')
        p++;
      char *eq = strstr(p, " = ");
      if (!strncmp(p, "const ", 6) && eq && eq < end && end[-2] == ';') {
        char *name = eq;
        while (name > p && ident_char(name[-1]))
          name--;
        char buf[32];
        size_t n = (size_t)(eq - name);
        if (n < sizeof buf && temp_name(name, n)) {
          memcpy(buf, name, n);
          buf[n] = 0;
          if (occurrences(ln, scope_end(ln), buf) == 1) {
            memmove(ln, end, e->body.len - (size_t)(end - e->body.s) + 1);
            e->body.len -= (size_t)(end - ln);
            changed = true;
            continue;
          }
        }
      }
      ln = end;
    }
  }
}

//
// Index maps: the flat index into a node's input that an element of the node reads, as an
// expression (held in a variable when it is not a name or a number).
//

const char *ec_buf_str(EmitCore *e, Buf *b) {
  const char *s = arena_strdup(e->a, b->s ? b->s : "0");
  free(b->s);
  return s;
}

// "(ix / div % size)", leaving out what is 1 or redundant: the coordinate of one block of axes; in a
// loop over rows (e->row_ix), c or r where that is what it comes to.
static void coord(EmitCore *e, Buf *b, const char *ix, int64_t div, int64_t size, bool leftmost) {
  bool rows = e->row_ix && !strcmp(ix, e->row_ix);
  if (rows && div == 1 && size == e->row_w)
    ec_bput(b, "c");
  else if (rows && div == e->row_w && leftmost)
    ec_bput(b, "%s", e->row_r);
  else if (rows && div == e->row_w)
    ec_bput(b, "%s %% %lld", e->row_r, (long long)size);
  else if (div == 1 && leftmost)
    ec_bput(b, "%s", ix);
  else if (div == 1)
    ec_bput(b, "%s %% %lld", ix, (long long)size);
  else if (leftmost)
    ec_bput(b, "%s / %lld", ix, (long long)div);
  else
    ec_bput(b, "%s / %lld %% %lld", ix, (long long)div, (long long)size);
}

int64_t ec_span(Shape s, int from, int to) {
  int64_t n = 1;
  for (int i = from; i < to; i++)
    n *= s.d[i];
  return n;
}

// The flat index into a tensor of shape `in` of element `ix` of a tensor of shape `out` under numpy
// broadcasting. Adjacent axes that are all kept or all broadcast are merged, so a bias read from
// [N,C] becomes "i % C" and a per-row value read from [N,C] becomes "i / C".
const char *ec_ix_bcast(EmitCore *e, Shape out, Shape in, const char *ix) {
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
        ec_bput(&b, " + ");
      bool paren = in_inner != 1 && (out_inner != 1 || t != 0);
      ec_bput(&b, "%s", paren ? "(" : "");
      coord(e, &b, ix, out_inner, blk[t].size, t == 0);
      ec_bput(&b, "%s", paren ? ")" : "");
      if (in_inner != 1)
        ec_bput(&b, " * %lld", (long long)in_inner);
      in_inner *= blk[t].size;
    }
    out_inner *= blk[t].size;
  }
  return ix_var(e, ec_buf_str(e, &b));
}

const char *ec_ix_permute(EmitCore *e, const IrNode *nd, Shape in, const char *ix) {
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
      ec_bput(&b, " + ");
    int64_t s = stride[nd->ia[k]];
    ec_bput(&b, "%s", s != 1 ? "(" : "");
    coord(e, &b, ix, div, out.d[k], k == first);
    ec_bput(&b, "%s", s != 1 ? ")" : "");
    if (s != 1)
      ec_bput(&b, " * %lld", (long long)s);
    div *= out.d[k];
  }
  return ix_var(e, ec_buf_str(e, &b));
}

// SLICE: element ix of the slice -> its index in the full input.
const char *ec_ix_slice(EmitCore *e, const IrNode *nd, Shape full, const char *ix) {
  int ax = (int)nd->ia[0];
  int64_t start = nd->ia[1], len = nd->ia[2] - start, flen = full.d[ax];
  int64_t outer = ec_span(full, 0, ax), inner = ec_span(full, ax + 1, full.rank);
  if (outer == 1)
    return start ? ix_var(e, ec_str(e, "%s + %lld", ix, (long long)(start * inner))) : ix;
  return ix_var(e, ec_str(e, "%s / %lld * %lld + %lld + %s %% %lld", ix, (long long)(len * inner),
                          (long long)(flen * inner), (long long)(start * inner), ix, (long long)(len * inner)));
}

// The coordinate along `ax` of element ix of a tensor of shape s.
const char *ec_ix_axis(EmitCore *e, Shape s, int ax, const char *ix) {
  Buf b = {0};
  coord(e, &b, ix, ec_span(s, ax + 1, s.rank), s.d[ax], ec_span(s, 0, ax) == 1);
  return ix_var(e, ec_buf_str(e, &b));
}

// The index into a part of length len at `at` on axis ax of a tensor of shape s, at flat index ix
// whose coordinate on the axis (c) lies in the part.
static void part_index(EmitCore *e, Buf *b, Shape s, int ax, const char *ix, const char *c, int64_t at, int64_t len) {
  int64_t inner = ec_span(s, ax + 1, s.rank), outer = ec_span(s, 0, ax), flen = s.d[ax];
  if (outer > 1) {
    coord(e, b, ix, flen * inner, outer, true);
    ec_bput(b, " * %lld + ", (long long)(len * inner));
  }
  if (at)
    ec_bput(b, "(%s - %lld)", c, (long long)at);
  else
    ec_bput(b, "%s", c);
  if (inner > 1) {
    ec_bput(b, " * %lld + ", (long long)inner);
    coord(e, b, ix, 1, inner, false);
  }
}

// Element (outer o, axis coordinate c - at, inner) of a part of length len along ax, for element ix
// of the whole (shape s): the index into the part, or 0 when c is outside [at, at + len).
const char *ec_ix_part(EmitCore *e, Shape s, int ax, const char *ix, const char *c, int64_t at, int64_t len) {
  Buf b = {0};
  ec_bput(&b, "%s >= %lld && %s < %lld ? ", c, (long long)at, c, (long long)(at + len));
  part_index(e, &b, s, ax, ix, c, at, len);
  ec_bput(&b, " : 0");
  return ix_var(e, ec_buf_str(e, &b));
}

//
// The pointwise ops of the inline evaluator: each emitter's `val` (EmitCore.val) holds a node's
// value in a local or reads it from memory, and computes a pointwise node through this.
//

// Is node n a CONCAT whose parts are all in memory, of one type (the gradient of a split: dq, dk,
// dv), with an emitter that can name their pointers (`base`)?
bool ec_concat_direct(EmitCore *e, int n) {
  const IrNode *nd = ec_node(e, n);
  int first = ec_canon(e, nd->in[0]);
  bool direct = e->base != NULL && nd->op == OP_CONCAT && nd->nin <= 64;
  for (int k = 0; k < nd->nin && direct; k++) {
    int ck = ec_canon(e, nd->in[k]);
    direct = ec_in_memory(e, ck) && ec_node(e, ck)->op != OP_CONST &&
             ec_node(e, ck)->dtype == ec_node(e, first)->dtype;
  }
  return direct;
}

// Of such a CONCAT (ec_concat_direct), its element at ix from the part the index falls in: a pointer
// to it (values false), so that one load reads it instead of one from each part, or its value, a
// select among loads that each part guards (values true; see EmitCore.concat_values); NULL for any
// other node.
static const char *concat_select(EmitCore *e, int n, const char *ix, bool values) {
  if (!ec_concat_direct(e, n))
    return NULL;
  const IrNode *nd = ec_node(e, n);
  int ax = (int)nd->ia[0];
  const char *c = ec_ix_axis(e, nd->shape, ax, ix);
  Buf b = {0};
  ec_bput(&b, "(");
  int64_t at = 0;
  for (int k = 0; k < nd->nin; k++) {
    int part = ec_canon(e, nd->in[k]);
    int64_t len = ec_node(e, nd->in[k])->shape.d[ax]; // (the part's length as the CONCAT reads it, not its view's)
    if (k + 1 < nd->nin)
      ec_bput(&b, "%s < %lld ? ", c, (long long)(at + len));
    Buf i = {0};
    part_index(e, &i, nd->shape, ax, ix, c, at, len);
    const char *at_ix = ec_buf_str(e, &i);
    if (values)
      ec_bput(&b, "%s", ec_load(e, part, ec_str(e, "%s[%s]", e->base(e, part), at_ix)));
    else
      ec_bput(&b, "%s + (%s)", e->base(e, part), at_ix);
    ec_bput(&b, "%s", k + 1 < nd->nin ? " : " : "");
    at += len;
  }
  ec_bput(&b, ")");
  return ec_buf_str(e, &b);
}

const char *ec_concat_ptr(EmitCore *e, int n, const char *ix) { return concat_select(e, n, ix, false); }

// An i32 CONST as a literal of its value (INT32_MIN spelled so that it is an int).
const char *ec_ilit(EmitCore *e, double v) {
  return v == -2147483648.0 ? "(-2147483647 - 1)" : ec_str(e, "%lld", (long long)v);
}

// Integer arithmetic on i32 values (interp_i32's rules): + - * and negation wrap modulo 2^32 (through
// uint32_t, where int32_t would overflow); // rounds down and % takes the divisor's sign (through
// int64_t, where INT32_MIN // -1 fits), both 0 where the divisor is 0.
static const char *int_expr(EmitCore *e, const IrNode *nd, const char *a, const char *b) {
  switch (nd->op) {
  case OP_NEG: return ec_str(e, "(int32_t)(0u - (uint32_t)%s)", a);
  case OP_ABS: return ec_str(e, "(%s < 0 ? (int32_t)(0u - (uint32_t)%s) : %s)", a, a, a);
  case OP_ADD: return ec_str(e, "(int32_t)((uint32_t)%s + (uint32_t)%s)", a, b);
  case OP_SUB: return ec_str(e, "(int32_t)((uint32_t)%s - (uint32_t)%s)", a, b);
  case OP_MUL: return ec_str(e, "(int32_t)((uint32_t)%s * (uint32_t)%s)", a, b);
  case OP_FLOORDIV:
    return ec_str(e,
                  "(%s == 0 ? 0 : (int32_t)(uint32_t)((int64_t)%s / %s - "
                  "((int64_t)%s %% %s != 0 && (%s < 0) != (%s < 0))))",
                  b, a, b, a, b, a, b);
  default: // OP_MOD
    return ec_str(e,
                  "(%s == 0 ? 0 : (int32_t)((int64_t)%s %% %s + "
                  "((int64_t)%s %% %s != 0 && (%s < 0) != (%s < 0) ? %s : 0)))",
                  b, a, b, a, b, a, b, b);
  }
}

const char *ec_pointwise_expr(EmitCore *e, int c, const char *ix) {
  const IrNode *nd = ec_node(e, c);
  const IrNode *x0 = nd->nin > 0 ? ec_node(e, nd->in[0]) : NULL,
               *x1 = nd->nin > 1 ? ec_node(e, nd->in[1]) : NULL;
  bool i32 = nd->dtype == DT_I32;
  if (i32 && (nd->op == OP_NEG || nd->op == OP_ABS))
    return int_expr(e, nd, e->val(e, nd->in[0], ix), NULL);
  if (i32 && (nd->op == OP_ADD || nd->op == OP_SUB || nd->op == OP_MUL || nd->op == OP_FLOORDIV || nd->op == OP_MOD))
    return int_expr(e, nd, e->val(e, nd->in[0], ec_ix_bcast(e, nd->shape, x0->shape, ix)),
                    e->val(e, nd->in[1], ec_ix_bcast(e, nd->shape, x1->shape, ix)));
  switch (nd->op) {
  case OP_NEG: return ec_str(e, "-%s", e->val(e, nd->in[0], ix));
  case OP_EXP: return ec_str(e, "expf(%s)", e->val(e, nd->in[0], ix));
  case OP_LOG: return ec_str(e, "logf(%s)", e->val(e, nd->in[0], ix));
  case OP_TANH: return ec_str(e, "tanhf(%s)", e->val(e, nd->in[0], ix));
  case OP_SQRT: return ec_str(e, "sqrtf(%s)", e->val(e, nd->in[0], ix));
  case OP_RSQRT: return ec_str(e, "1.0f / sqrtf(%s)", e->val(e, nd->in[0], ix));
  case OP_RELU: {
    const char *a = e->val(e, nd->in[0], ix);
    return ec_str(e, "%s > 0.0f ? %s : 0.0f", a, a);
  }
  case OP_GELU: return ec_str(e, "mdl_gelu(%s)", e->val(e, nd->in[0], ix));
  case OP_SILU: return ec_str(e, "mdl_silu(%s)", e->val(e, nd->in[0], ix));
  case OP_SIGMOID: return ec_str(e, "mdl_sigmoid(%s)", e->val(e, nd->in[0], ix));
  case OP_ABS: return ec_str(e, "fabsf(%s)", e->val(e, nd->in[0], ix));
  case OP_CLAMP: // fminf / fmaxf with an infinite bound are the value itself; a NaN stays NaN
    return ec_str(e, "mdl_clamp(%s, %s, %s)", e->val(e, nd->in[0], ix), ec_flit(e, nd->fa[0]), ec_flit(e, nd->fa[1]));
  case OP_STOP_GRADIENT: return e->val(e, nd->in[0], ix);
  case OP_CAST: { // the value rounded as it will be stored (ec_store then converts it exactly)
    const char *x = e->val(e, nd->in[0], ix);
    if (nd->ia[0] == DT_I32) // toward zero, saturating, NaN to 0 (interp_to_i32)
      return ec_str(e, "(%s != %s ? 0 : %s >= 2147483647.0f ? 2147483647 : %s <= -2147483648.0f ? (-2147483647 - 1) : "
                    "(int32_t)%s)", x, x, x, x, x);
    if (x0->dtype == DT_I32)
      return ec_str(e, "(float)%s", x);
    if (nd->ia[0] == DT_F8E4M3 || nd->ia[0] == DT_F8E5M2) {
      if (e->fp8_cast)
        return e->fp8_cast(e, nd, x);
      ec_fail(e, "node %d: this target has no fp8", nd->id);
      return "0";
    }
    return nd->ia[0] == DT_BF16 ? ec_str(e, "mdl_bf16_to_f32(mdl_f32_to_bf16(%s))", x) : x;
  }
  case OP_DROPOUT:
    return ec_str(e, "mdl_dropout(%s, %lld, %s, %s, %s)", e->seed(e), (long long)nd->ia[0], ix, ec_dlit(e, nd->fa[0]),
                  e->val(e, nd->in[0], ix));
  case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_RELU_BWD: case OP_GELU_BWD: case OP_SILU_BWD:
  case OP_ABS_BWD: case OP_CLAMP_BWD: case OP_MINIMUM: case OP_MAXIMUM: {
    const char *a = e->val(e, nd->in[0], ec_ix_bcast(e, nd->shape, x0->shape, ix));
    const char *b = e->val(e, nd->in[1], ec_ix_bcast(e, nd->shape, x1->shape, ix));
    switch (nd->op) {
    case OP_ADD: return ec_str(e, "%s + %s", a, b);
    case OP_SUB: return ec_str(e, "%s - %s", a, b);
    case OP_MUL: return ec_str(e, "%s * %s", a, b);
    case OP_DIV: return ec_str(e, "%s / %s", a, b);
    case OP_MINIMUM: // a NaN operand gives NaN (the interpreter's rule; fminf would drop it); i32 has none
      return i32 ? ec_str(e, "(%s < %s ? %s : %s)", a, b, a, b)
                 : ec_str(e, "(%s < %s || %s != %s ? %s : %s)", a, b, a, a, a, b);
    case OP_MAXIMUM:
      return i32 ? ec_str(e, "(%s > %s ? %s : %s)", a, b, a, b)
                 : ec_str(e, "(%s > %s || %s != %s ? %s : %s)", a, b, a, a, a, b);
    case OP_RELU_BWD: return ec_str(e, "%s > 0.0f ? %s : 0.0f", a, b);
    case OP_GELU_BWD: return ec_str(e, "mdl_gelu_grad(%s) * %s", a, b);
    case OP_ABS_BWD: return ec_str(e, "%s > 0.0f ? %s : %s < 0.0f ? -%s : 0.0f", a, b, a, b);
    case OP_CLAMP_BWD:
      return ec_str(e, "%s >= %s && %s <= %s ? %s : 0.0f", a, ec_flit(e, nd->fa[0]), a, ec_flit(e, nd->fa[1]), b);
    default: return ec_str(e, "mdl_silu_grad(%s, %s)", a, b);
    }
  }
  case OP_COMPARE: {
    static const char *const rel[] = {"<", "<=", ">", ">=", "==", "!="};
    const char *a = e->val(e, nd->in[0], ec_ix_bcast(e, nd->shape, x0->shape, ix));
    const char *b = e->val(e, nd->in[1], ec_ix_bcast(e, nd->shape, x1->shape, ix));
    return ec_str(e, "(%s %s %s ? 1.0f : 0.0f)", a, rel[nd->ia[0]], b);
  }
  case OP_WHERE: {
    const IrNode *x2 = ec_node(e, nd->in[2]);
    const char *c0 = e->val(e, nd->in[0], ec_ix_bcast(e, nd->shape, x0->shape, ix));
    const char *a = e->val(e, nd->in[1], ec_ix_bcast(e, nd->shape, x1->shape, ix));
    const char *b = e->val(e, nd->in[2], ec_ix_bcast(e, nd->shape, x2->shape, ix));
    return ec_str(e, "(%s != %s ? %s : %s)", c0, x0->dtype == DT_I32 ? "0" : "0.0f", a, b);
  }
  case OP_RESHAPE: return e->val(e, nd->in[0], ix);
  case OP_BROADCAST: return e->val(e, nd->in[0], ec_ix_bcast(e, nd->shape, x0->shape, ix));
  case OP_PERMUTE: return e->val(e, nd->in[0], ec_ix_permute(e, nd, x0->shape, ix));
  case OP_SLICE: return e->val(e, nd->in[0], ec_ix_slice(e, nd, x0->shape, ix));
  case OP_SLICE_BWD: {
    int ax = (int)nd->ia[0];
    const char *c = ec_ix_axis(e, nd->shape, ax, ix);
    const char *j = ec_ix_part(e, nd->shape, ax, ix, c, nd->ia[1], nd->ia[2] - nd->ia[1]);
    return ec_str(e, "%s >= %lld && %s < %lld ? %s : %s", c, (long long)nd->ia[1], c, (long long)nd->ia[2],
                  e->val(e, nd->in[0], j), nd->dtype == DT_I32 ? "0" : "0.0f");
  }
  case OP_CONCAT: {
    const char *p = concat_select(e, c, ix, e->concat_values);
    if (p && e->concat_values) // (a select among the parts' loads, each guarded)
      return p;
    if (p) // (one load, through the pointer of the part the index falls in)
      return ec_load(e, ec_canon(e, nd->in[0]), ec_str(e, "%s[0]", p));
    int ax = (int)nd->ia[0];
    const char *c = ec_ix_axis(e, nd->shape, ax, ix);
    const char *v[64];
    int64_t at = 0, ends[64];
    if (nd->nin > 64) {
      ec_fail(e, "concat of %d inputs", nd->nin);
      return "0";
    }
    for (int k = 0; k < nd->nin; k++) {
      int64_t len = ec_node(e, nd->in[k])->shape.d[ax];
      v[k] = e->val(e, nd->in[k], ec_ix_part(e, nd->shape, ax, ix, c, at, len));
      at += len;
      ends[k] = at;
    }
    Buf b = {0};
    for (int k = 0; k + 1 < nd->nin; k++)
      ec_bput(&b, "%s < %lld ? %s : ", c, (long long)ends[k], v[k]);
    ec_bput(&b, "%s", v[nd->nin - 1]);
    return ec_buf_str(e, &b);
  }
  default:
    ec_fail(e, "%s is not pointwise", op_name(nd->op));
    return "0";
  }
}

const char *ec_topk_before(EmitCore *e, const char *a, const char *ia, const char *b, const char *ib) {
  return ec_str(e, "%s != %s ? (%s == %s || %s < %s) : (%s > %s || (%s == %s && %s < %s))", a, a, b, b, ia, ib, a, b, a,
                b, ia, ib);
}
