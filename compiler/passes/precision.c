// precision.c: the precision pass (mixed precision). With bf16, every MATMUL reads its operands
// through CAST nodes that round them to bf16, so the GEMMs run with bf16 inputs and f32
// accumulation (the product of two bf16 values is exact in f32); the GEMM's result stays f32.
// Attention's two products (Q K^T and P V) read bf16 operands as well: the pass marks the ATTENTION
// and ATTENTION_BWD nodes (ia[4] = DT_BF16; the rounding points are written in mdl.h), so the GPU
// runs them on tensor cores and every back end rounds at the same places. Attention reads q, k, v
// (and the backward its out and dout) only rounded, so it reads them through CASTs too: the values
// are the same, stored in half the bytes, which every attention kernel (the forward, and the
// backward's dq and dk, dv, each of which stages every key or query tile from memory) moves instead
// of f32. q, k, v split from one qkv GEMM are SLICEs of its output read only rounded: each becomes the
// SLICE of one CAST of the whole output, which the GEMM's epilogue stores (GPT-2 124M's step moves
// 0.9 GB less and its arena shrinks from 6.26 to 5.81 GB; gpt2-tiny on the CPU trains 6-10% faster,
// to the same losses). The cross-entropy (forward and backward) reads the logits rounded, as
// PyTorch's autocast leaves a matmul's result and llm.c keeps them, and computes in f32: the LM
// head's GEMM stores them in bf16, and 4096 rows of GPT-2's chunked LM head take 412 MB of logits
// where they took 824 MB (plus 412 MB of bf16 dlogits apart: the kernel now overwrites the logits
// with them), its step 1.65 GB less by the fusion report's count. Nothing else
// narrows: parameters are f32 master weights updated by AdamW in f32, the moments and gradients
// are f32, and so are the residual stream, the norms, softmax and the loss itself.
//
// Design. The pass rebuilds the node array once, in order: before the first MATMUL that reads a
// value it inserts that value's CAST, and every later MATMUL reading the same value (the backward
// GEMMs read the forward's activations and weights again) shares it, so each value is rounded once
// per step. The ids after the rebuild stay topological; the graph's lists (params, grads, updates,
// outputs, loss, fwd_end) and the nodes' grad_of / param_of are renumbered. The fusion pass then
// treats a CAST as an elementwise op: it joins the kernel that produces its input when it can (a
// GEMM epilogue, a layernorm's output loop), and the back ends store a bf16 value in 16 bits.
// Because the CAST is in the graph, the reference interpreter rounds at exactly the same places as
// the compiled back ends, so the oracle keeps its meaning under bf16.
//
// fp8 (precision = fp8). The GEMMs of the linear layers read fp8 operands: the forward's E4M3
// (weights and activations), the backward's E5M2 gradients (the dout: its wider range) and the same
// E4M3 casts of the forward's operands, shared. Each fp8 CAST is a scaled tensor (Graph.fp8): it
// multiplies by its tensor's scale before rounding, and the GEMM divides its f32 sum by the two
// scales (mdl.h, MATMUL); the scales come from the tensors' amax histories (delayed scaling,
// runtime/engine/fp8_state.c). Everything else is today's bf16, and so are the GEMMs the pass keeps
// there, each with its reason in the IR (IrNode.why, printed by `mdlc -d R`):
//   "LM head":           the GEMM whose result is the cross-entropy's logits (through views and a
//                        bias), and its backward GEMMs: the logits' error is the loss's;
//   "no weight operand": a forward GEMM with no parameter operand (attention lowered into
//                        matmuls: two activations, no scale that history tracks well), and its
//                        backward GEMMs;
//   "first layer":       a forward GEMM whose activation no earlier GEMM computed (it reads the
//                        embeddings or the input through norms only), and its backward GEMMs;
//   "dimensions not multiples of 16": a forward GEMM one of whose m, n, k is not (cuBLASLt's FP8
//                        alignment rule; each leads one of the layer's three GEMMs), and its
//                        backward GEMMs;
//   "Muon's Newton-Schulz", "no forward operand": a GEMM of the backward section that is no linear
//                        layer's backward (the optimizer's orthogonalisation, anything unknown).
// A backward GEMM belongs to the forward GEMM one of whose operands it reads (autodiff builds dA =
// dY B^T and dB = A^T dY from the operands themselves); its other operand is the gradient dY. Where
// an operand feeds several forward GEMMs, the backward GEMM is fp8 only when all of them are.
#include "mdl.h"

#include <string.h>

bool precision_parse(const char *name, DType *out) {
  if (!strcmp(name, "fp32"))
    *out = DT_F32;
  else if (!strcmp(name, "bf16"))
    *out = DT_BF16;
  else if (!strcmp(name, "fp8"))
    *out = DT_F8E4M3;
  else
    return false;
  return true;
}

//
// The fp8 policy: per MATMUL, the format of each operand and, for one kept in bf16, why.
//
typedef struct {
  DType fmt[2];    // per operand: DT_BF16, DT_F8E4M3 or DT_F8E5M2
  const char *why; // bf16: the reason; fp8: NULL
  int fwd;         // a backward GEMM: the forward GEMM it belongs to (the first), else -1
  const char *weight; // the parameter the (forward) GEMM reads, for the names of its scaled tensors
} GemmChoice;

static bool is_view(Op op) { return op == OP_RESHAPE || op == OP_PERMUTE || op == OP_SLICE || op == OP_BROADCAST; }

static int strip_views(const Graph *g, int id) {
  while (is_view(g->nodes[id]->op))
    id = g->nodes[id]->in[0];
  return id;
}

// The GEMM whose result is the logits of cross-entropy ce (through views and a bias add), or -1.
static int logits_gemm(const Graph *g, const IrNode *ce) {
  int x = strip_views(g, ce->in[0]);
  if (g->nodes[x]->op == OP_ADD)
    for (int k = 0; k < 2; k++)
      if (g->nodes[strip_views(g, g->nodes[x]->in[k])]->op == OP_MATMUL)
        return strip_views(g, g->nodes[x]->in[k]);
  return g->nodes[x]->op == OP_MATMUL ? x : -1;
}

static const char *forward_reason(const Graph *g, const IrNode *n, const bool *lm_head, const bool *after_gemm) {
  if (lm_head[n->id])
    return "LM head";
  int w = -1;
  for (int k = 0; k < 2; k++)
    if (g->nodes[strip_views(g, n->in[k])]->op == OP_PARAM)
      w = k;
  if (w < 0)
    return "no weight operand";
  if (!after_gemm[n->in[1 - w]])
    return "first layer";
  // cuBLASLt's FP8 GEMMs want leading dimensions of multiples of 16 bytes; the layer's three GEMMs
  // (fp8_tn_layout) lead with each of m, n and k, so all three must be
  Shape a = g->nodes[n->in[0]]->shape, o = n->shape;
  int64_t k = n->ia[0] ? a.d[a.rank - 2] : a.d[a.rank - 1];
  if (o.d[o.rank - 2] % 16 || o.d[o.rank - 1] % 16 || k % 16)
    return "dimensions not multiples of 16";
  return NULL;
}

static GemmChoice *fp8_choices(const Graph *g) {
  GemmChoice *c = arena_alloc(g->arena, sizeof *c * (size_t)g->n);
  bool *lm_head = arena_alloc(g->arena, (size_t)g->n), *after_gemm = arena_alloc(g->arena, (size_t)g->n);
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    for (int k = 0; k < n->nin && i < g->fwd_end; k++)
      after_gemm[i] |= after_gemm[n->in[k]] || g->nodes[n->in[k]]->op == OP_MATMUL;
    if (n->op == OP_CROSS_ENTROPY && logits_gemm(g, n) >= 0)
      lm_head[logits_gemm(g, n)] = true;
  }
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    c[i] = (GemmChoice){{DT_BF16, DT_BF16}, NULL, -1, NULL};
    if (n->op != OP_MATMUL)
      continue;
    for (int k = 0; k < 2 && i < g->fwd_end; k++)
      if (g->nodes[strip_views(g, n->in[k])]->op == OP_PARAM)
        c[i].weight = g->nodes[strip_views(g, n->in[k])]->name;
    if (i < g->fwd_end) {
      c[i].why = forward_reason(g, n, lm_head, after_gemm);
      if (!c[i].why)
        c[i].fmt[0] = c[i].fmt[1] = DT_F8E4M3;
      continue;
    }
    // A backward GEMM: operand x read by forward GEMMs, the other the gradient.
    int x = -1;
    for (int k = 0; k < 2; k++)
      if (n->in[k] < g->fwd_end && n->in[1 - k] >= g->fwd_end)
        x = k;
    const char *why = NULL;
    for (int f = 0; x >= 0 && f < g->fwd_end; f++) {
      const IrNode *F = g->nodes[f];
      if (F->op != OP_MATMUL || (F->in[0] != n->in[x] && F->in[1] != n->in[x]))
        continue;
      if (c[i].fwd < 0)
        c[i].fwd = f, c[i].weight = c[f].weight;
      if (!why)
        why = c[f].why;
    }
    if (c[i].fwd < 0) {
      c[i].why = g->train.optimizer == OPT_MUON ? "Muon's Newton-Schulz" : "no forward operand";
    } else if (why) {
      c[i].why = why;
    } else {
      c[i].fmt[x] = DT_F8E4M3;
      c[i].fmt[1 - x] = DT_F8E5M2;
    }
  }
  return c;
}

// What a scaled tensor is called in messages: the .mdl name of the value cast (s) where it has one,
// else by the weight w of its GEMM: "h.0.fc_w's input", and for the gradient "d h.0.fc_w's output".
static const char *fp8_label(Arena *a, const IrNode *s, DType fmt, const char *w) {
  if (s->name && s->grad_of < 0 && fmt == DT_F8E4M3)
    return s->name;
  if (!w)
    return arena_printf(a, "the %s of line %d", op_name(s->op), s->loc.line);
  return arena_printf(a, fmt == DT_F8E5M2 ? "d %s's output" : "%s's input", w);
}

// The scaled tensor an fp8 value (a CAST to fp8, or a view of one) belongs to.
static int fp8_slot(IrNode **nodes, int id) {
  while (nodes[id]->op != OP_CAST)
    id = nodes[id]->in[0];
  return (int)nodes[id]->ia[1];
}

static IrNode *copy_node(Graph *g, const IrNode *o, int id, const int *map) {
  IrNode *c = arena_alloc(g->arena, sizeof *c);
  *c = *o;
  c->id = id;
  c->in = arena_alloc(g->arena, sizeof(int) * (size_t)(o->nin ? o->nin : 1));
  for (int k = 0; k < o->nin; k++)
    c->in[k] = map[o->in[k]];
  c->grad_of = o->grad_of >= 0 ? map[o->grad_of] : -1;
  c->param_of = o->param_of >= 0 ? map[o->param_of] : -1;
  return c;
}

// The inputs a node reads only rounded to bf16, and so through a CAST: both of a MATMUL's, the
// logits of a cross-entropy and its backward, and the out and dout of a bf16 attention backward
// (mdl.h: its products read bf(dout), D = bf(dout) . bf(out)). The GEMM that computes dout then
// stores it rounded, in half the bytes, for the kernels that read it; out shares the CAST the output
// projection's GEMM reads.
static int rounded_inputs(const IrNode *o, int which[5]) {
  if (o->op == OP_MATMUL && o->nin == 2) {
    which[0] = 0, which[1] = 1;
    return 2;
  }
  int n = 0;
  if (o->op == OP_CROSS_ENTROPY || o->op == OP_CROSS_ENTROPY_BWD)
    which[n++] = 0; // the logits, as autocast leaves a GEMM's result (the loss itself is f32)
  if (o->op == OP_ATTENTION || o->op == OP_ATTENTION_LSE || o->op == OP_ATTENTION_BWD)
    for (int i = 0; i < 3; i++)
      which[n++] = i;
  if (o->op == OP_ATTENTION_BWD) {
    which[n++] = o->nin - 3;
    which[n++] = o->nin - 1;
  }
  return n;
}

// The attention backward's out is the ATTENTION node, while the output projection's GEMM rounds a
// RESHAPE of it ([B*T, C]): the same values in the same order. Rather than round them a second time,
// nodes[nn] becomes a RESHAPE of that CAST back to src's shape (a view), which the readers of src's
// rounding share; false when no such CAST exists yet.
static bool shared_view_cast(Graph *g, IrNode **nodes, int nn, int *cast, int src, SrcLoc loc) {
  for (int r = src + 1; r < nn; r++) {
    const IrNode *v = nodes[r];
    if (v->op != OP_RESHAPE || v->in[0] != src || cast[r] < 0)
      continue;
    IrNode *c = arena_alloc(g->arena, sizeof *c);
    *c = (IrNode){.id = nn, .op = OP_RESHAPE, .dtype = nodes[cast[r]]->dtype, .shape = nodes[src]->shape, .nin = 1,
                  .loc = loc, .grad_of = -1, .param_of = -1, .body = nodes[src]->body};
    c->in = arena_alloc(g->arena, sizeof(int));
    c->in[0] = cast[r];
    nodes[nn] = c;
    cast[src] = nn;
    return true;
  }
  return false;
}

// Appends the rounding of nodes[src] at nodes[nn] and returns the new count: a CAST to dt, or, for a
// SLICE of a value whose rounding exists, that SLICE of the rounding (a view: nothing to compute).
static int add_cast(Graph *g, IrNode **nodes, int nn, int *cast, int src, DType dt, SrcLoc loc) {
  const IrNode *s = nodes[src];
  IrNode *c = arena_alloc(g->arena, sizeof *c);
  c->in = arena_alloc(g->arena, sizeof(int));
  if (s->op == OP_SLICE && cast[s->in[0]] >= 0) {
    int *in = c->in;
    *c = *s;
    c->id = nn, c->dtype = dt, c->in = in, c->loc = loc, c->grad_of = -1, c->param_of = -1;
    c->in[0] = cast[s->in[0]];
  } else {
    *c = (IrNode){.id = nn, .op = OP_CAST, .dtype = dt, .shape = s->shape, .nin = 1, .loc = loc, .grad_of = -1,
                  .param_of = -1, .in = c->in, .body = s->body}; // the body of what it rounds
    c->in[0] = src;
    c->ia[0] = dt;
  }
  nodes[nn] = c;
  cast[src] = nn;
  return nn + 1;
}

// Whether every reader of node s of g reads it rounded to bf16 (rounded_inputs; under fp8, no GEMM
// reads it in fp8), and there is one; the graph's outputs and loss are read as they are.
static bool read_rounded_only(const Graph *g, int s, const GemmChoice *choice) {
  int readers = 0;
  for (int i = s + 1; i < g->n; i++) {
    const IrNode *o = g->nodes[i];
    int which[5], nr = rounded_inputs(o, which);
    for (int k = 0; k < o->nin; k++) {
      if (o->in[k] != s)
        continue;
      bool rounded = false;
      for (int r = 0; r < nr; r++)
        rounded |= which[r] == k && (!choice || o->op != OP_MATMUL || choice[i].fmt[k] == DT_BF16);
      if (!rounded)
        return false;
      readers++;
    }
  }
  for (int i = 0; i < g->noutputs; i++)
    if (g->outputs[i] == s)
      return false;
  return readers > 0 && g->loss != s;
}

static void remap_list(int *list, int n, const int *map) {
  for (int i = 0; i < n; i++)
    if (list[i] >= 0)
      list[i] = map[list[i]];
}

// g's node array becomes nodes[0, nn) (room for cap), its forward ending at fwd_end; its lists are
// renumbered by map (old id -> new id).
static void install_nodes(Graph *g, IrNode **nodes, int nn, int cap, int fwd_end, const int *map) {
  g->nodes = nodes;
  g->n = nn;
  g->cap = cap;
  g->fwd_end = fwd_end;
  if (g->loss >= 0)
    g->loss = map[g->loss];
  remap_list(g->outputs, g->noutputs, map);
  remap_list(g->params, g->nparams, map);
  if (g->grads)
    remap_list(g->grads, g->nparams, map);
  if (g->updates)
    remap_list(g->updates, g->nparams, map);
}

//
// cuBLASLt's layout rule for FP8 (Ada and Hopper): A transposed and B not, "TN", both operands with
// the inner dimension contiguous. In our row-major terms a GEMM C = op(A) op(B) runs as fp8 only as
// A [m,k] (not transposed) times B stored [n,k] (transposed): C = A B^T, the nn.Linear form. Of a
// linear layer y = x w (w [k,n]) only dX = dY w^T has it; the forward needs w stored [n,k], and
// dW = x^T dY needs x stored [k,m] and dY stored [n,m]. So after the fp8 casts are placed, every fp8
// operand read in the other layout gets a second cast of the same tensor, transposed: the CAST of a
// PERMUTE of what the first one rounds, right after it (the forward's x^T beside x, saved for the
// backward in one byte an element; the weight's w^T beside w), with the same scaled tensor (ia[1]):
// the same values, so the same amax and the same codes, only placed transposed. The GEMM then reads
// it with the transpose flag that the rule asks for. Every back end runs this same graph, so the
// interpreter and the C back end check the layout the GPU runs; their GEMMs take any layout, and the
// transposed copies cost them one more cast each (the fusion pass joins it to the kernel that
// produces the value where it can).
//
static bool is_fp8(DType t) { return t == DT_F8E4M3 || t == DT_F8E5M2; }

// The transposed copy (swapping the last two axes) of fp8 operand v (a CAST to fp8, or a view of
// one) appended at nodes[nn]; the new count. A view is rebuilt on the f32 value the CAST rounds, so
// that the copy is again one CAST of an f32 value.
static int add_transposed(Graph *g, IrNode **nodes, int nn, int v, int *out) {
  int chain[16], nc = 0, c = v;
  while (nodes[c]->op != OP_CAST && nc < 16)
    chain[nc++] = c, c = nodes[c]->in[0];
  int src = nodes[c]->in[0];
  for (int k = nc - 1; k >= 0; k--) { // the views again, on the f32 value
    IrNode *w = arena_alloc(g->arena, sizeof *w);
    *w = *nodes[chain[k]];
    w->id = nn, w->dtype = DT_F32, w->grad_of = -1, w->param_of = -1;
    w->in = arena_alloc(g->arena, sizeof(int));
    w->in[0] = src;
    nodes[nn] = w;
    src = nn++;
  }
  const IrNode *x = nodes[src];
  IrNode *p = arena_alloc(g->arena, sizeof *p), *t = arena_alloc(g->arena, sizeof *t);
  *p = (IrNode){.id = nn, .op = OP_PERMUTE, .dtype = DT_F32, .shape = x->shape, .nin = 1, .loc = nodes[c]->loc,
                .grad_of = -1, .param_of = -1, .body = x->body};
  p->in = arena_alloc(g->arena, sizeof(int));
  p->in[0] = src;
  int r = x->shape.rank;
  for (int k = 0; k < r; k++)
    p->ia[k] = k;
  p->ia[r - 2] = r - 1, p->ia[r - 1] = r - 2;
  p->shape.d[r - 2] = x->shape.d[r - 1], p->shape.d[r - 1] = x->shape.d[r - 2];
  nodes[nn] = p;
  *t = *nodes[c];
  t->id = nn + 1, t->shape = p->shape, t->grad_of = -1, t->param_of = -1;
  t->in = arena_alloc(g->arena, sizeof(int));
  t->in[0] = nn;
  nodes[nn + 1] = t;
  *out = nn + 1;
  return nn + 2;
}

static void fp8_tn_layout(Graph *g) {
  int old_n = g->n;
  // which fp8 values some GEMM reads transposed the other way (needs the copy)
  bool *want = arena_alloc(g->arena, (size_t)old_n);
  for (int i = 0; i < old_n; i++) {
    const IrNode *o = g->nodes[i];
    if (o->op == OP_MATMUL && is_fp8(g->nodes[o->in[0]]->dtype)) {
      want[o->in[0]] |= o->ia[0] != 0;
      want[o->in[1]] |= o->ia[1] == 0;
    }
  }
  int nwant = 0;
  for (int i = 0; i < old_n; i++)
    nwant += want[i];
  if (!nwant)
    return;
  int cap = old_n + 18 * nwant + 1;
  IrNode **nodes = arena_alloc(g->arena, sizeof(IrNode *) * (size_t)cap);
  int *map = arena_alloc(g->arena, sizeof(int) * (size_t)old_n), *tr = arena_alloc(g->arena, sizeof(int) * (size_t)old_n);
  int nn = 0, fwd_end = 0;
  for (int i = 0; i < old_n; i++) {
    const IrNode *o = g->nodes[i];
    map[i] = nn;
    nodes[nn] = copy_node(g, o, nn, map);
    if (o->op == OP_MATMUL && is_fp8(g->nodes[o->in[0]]->dtype)) {
      if (o->ia[0])
        nodes[nn]->in[0] = tr[o->in[0]], nodes[nn]->ia[0] = 0;
      if (!o->ia[1])
        nodes[nn]->in[1] = tr[o->in[1]], nodes[nn]->ia[1] = 1;
    }
    nn++;
    if (want[i])
      nn = add_transposed(g, nodes, nn, map[i], &tr[i]);
    if (i + 1 == g->fwd_end)
      fwd_end = nn;
  }
  install_nodes(g, nodes, nn, cap, fwd_end, map);
}

bool precision_assign(Graph *g, DType gemm, char *why, size_t n) {
  if (gemm == DT_F32)
    return true;
  if (gemm != DT_BF16 && gemm != DT_F8E4M3) {
    snprintf(why, n, "GEMM operands in %s are not supported", dtype_name(gemm));
    return false;
  }
  bool fp8 = gemm == DT_F8E4M3;
  GemmChoice *choice = fp8 ? fp8_choices(g) : NULL;
  int old_n = g->n, cap = (fp8 ? 4 : 2) * old_n + 1; // (fp8: up to three roundings of a value)
  IrNode **nodes = arena_alloc(g->arena, sizeof(IrNode *) * (size_t)cap);
  int *map = arena_alloc(g->arena, sizeof(int) * (size_t)old_n);
  // per format (bf16, E4M3, E5M2): new id -> its CAST's new id, or -1
  int *casts[3];
  for (int f = 0; f < 3; f++) {
    casts[f] = arena_alloc(g->arena, sizeof(int) * (size_t)cap);
    memset(casts[f], -1, sizeof(int) * (size_t)cap);
  }
  int *cast = casts[0];
  g->fp8 = fp8 ? arena_alloc(g->arena, sizeof *g->fp8 * (size_t)cap) : NULL;
  g->nfp8 = 0;
  int nn = 0, fwd_end = 0;
  for (int i = 0; i < old_n; i++) {
    const IrNode *o = g->nodes[i];
    int which[5], nr = rounded_inputs(o, which);
    DType fmt[5];
    for (int r = 0; r < nr; r++)
      fmt[r] = choice && o->op == OP_MATMUL ? choice[i].fmt[which[r]] : DT_BF16;
    for (int r = 0; r < nr; r++) {
      int src = map[o->in[which[r]]], *to = casts[fmt[r] == DT_BF16 ? 0 : fmt[r] == DT_F8E4M3 ? 1 : 2];
      if (to[src] >= 0)
        continue;
      if (fmt[r] == DT_BF16 && shared_view_cast(g, nodes, nn, cast, src, o->loc)) {
        nn++;
        continue;
      }
      if (nodes[src]->dtype != DT_F32) {
        snprintf(why, n, "node %d (%s) reads a %s operand", i, op_name(o->op), dtype_name(nodes[src]->dtype));
        return false;
      }
      bool view = nodes[src]->op == OP_SLICE && to[nodes[src]->in[0]] >= 0;
      if (fmt[r] != DT_BF16 && !view) {
        g->fp8[g->nfp8] = (Fp8Tensor){fmt[r], fp8_label(g->arena, nodes[src], fmt[r], choice[i].weight),
                                      nodes[src]->loc};
        if (!g->fp8[g->nfp8].loc.line)
          g->fp8[g->nfp8].loc = o->loc;
      }
      nn = add_cast(g, nodes, nn, to, src, fmt[r], o->loc);
      if (fmt[r] != DT_BF16 && !view)
        nodes[nn - 1]->ia[1] = g->nfp8++;
    }
    if (o->op == OP_SLICE && nodes[map[o->in[0]]]->dtype == DT_F32 && read_rounded_only(g, i, choice)) {
      // A SLICE read only rounded (attention's q, k and v split from one qkv GEMM) becomes that
      // SLICE of its source's rounding: one CAST of the whole source, which its producer stores (a
      // GEMM's epilogue, four bf16 values a store), serves every slice of it.
      int src = map[o->in[0]];
      if (cast[src] < 0)
        nn = add_cast(g, nodes, nn, cast, src, DT_BF16, o->loc);
      map[i] = nn;
      nodes[nn] = copy_node(g, o, nn, map);
      nodes[nn]->in[0] = cast[src];
      nodes[nn]->dtype = DT_BF16;
      cast[nn] = nn; // its own rounding
      nn++;
      if (i + 1 == g->fwd_end)
        fwd_end = nn;
      continue;
    }
    map[i] = nn;
    nodes[nn] = copy_node(g, o, nn, map);
    if (o->op == OP_ATTENTION || o->op == OP_ATTENTION_LSE || o->op == OP_ATTENTION_BWD)
      nodes[nn]->ia[4] = DT_BF16; // its two products read bf16 operands too (mdl.h)
    for (int r = 0; r < nr; r++) {
      int *from = casts[fmt[r] == DT_BF16 ? 0 : fmt[r] == DT_F8E4M3 ? 1 : 2];
      nodes[nn]->in[which[r]] = from[map[o->in[which[r]]]];
    }
    if (o->op == OP_MATMUL && choice) {
      nodes[nn]->why = choice[i].why;
      for (int k = 0; k < 2; k++)
        nodes[nn]->ia[2 + k] = choice[i].fmt[k] == DT_BF16 ? 0 : fp8_slot(nodes, nodes[nn]->in[k]);
    }
    nn++;
    if (i + 1 == g->fwd_end)
      fwd_end = nn;
  }
  install_nodes(g, nodes, nn, cap, fwd_end, map);
  if (fp8)
    fp8_tn_layout(g);
  return ir_validate(g, why, n);
}
