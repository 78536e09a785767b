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
#include "mdl.h"

#include <string.h>

bool precision_parse(const char *name, DType *out) {
  if (!strcmp(name, "fp32"))
    *out = DT_F32;
  else if (!strcmp(name, "bf16"))
    *out = DT_BF16;
  else
    return false;
  return true;
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

// Whether every reader of node s of g reads it rounded (rounded_inputs), and there is one; the
// graph's outputs and loss are read as they are.
static bool read_rounded_only(const Graph *g, int s) {
  int readers = 0;
  for (int i = s + 1; i < g->n; i++) {
    const IrNode *o = g->nodes[i];
    int which[5], nr = rounded_inputs(o, which);
    for (int k = 0; k < o->nin; k++) {
      if (o->in[k] != s)
        continue;
      bool rounded = false;
      for (int r = 0; r < nr; r++)
        rounded |= which[r] == k;
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

bool precision_assign(Graph *g, DType gemm, char *why, size_t n) {
  if (gemm == DT_F32)
    return true;
  if (gemm != DT_BF16) {
    snprintf(why, n, "GEMM operands in %s are not supported", dtype_name(gemm));
    return false;
  }
  int old_n = g->n, cap = 2 * old_n + 1;
  IrNode **nodes = arena_alloc(g->arena, sizeof(IrNode *) * (size_t)cap);
  int *map = arena_alloc(g->arena, sizeof(int) * (size_t)old_n);
  int *cast = arena_alloc(g->arena, sizeof(int) * (size_t)cap); // new id -> its CAST's new id, or -1
  memset(cast, -1, sizeof(int) * (size_t)cap);
  int nn = 0, fwd_end = 0;
  for (int i = 0; i < old_n; i++) {
    const IrNode *o = g->nodes[i];
    int which[5], nr = rounded_inputs(o, which);
    for (int r = 0; r < nr; r++) {
      int src = map[o->in[which[r]]];
      if (cast[src] >= 0)
        continue;
      if (shared_view_cast(g, nodes, nn, cast, src, o->loc)) {
        nn++;
        continue;
      }
      if (nodes[src]->dtype != DT_F32) {
        snprintf(why, n, "node %d (%s) reads a %s operand", i, op_name(o->op), dtype_name(nodes[src]->dtype));
        return false;
      }
      nn = add_cast(g, nodes, nn, cast, src, gemm, o->loc);
    }
    if (o->op == OP_SLICE && nodes[map[o->in[0]]]->dtype == DT_F32 && read_rounded_only(g, i)) {
      // A SLICE read only rounded (attention's q, k and v split from one qkv GEMM) becomes that
      // SLICE of its source's rounding: one CAST of the whole source, which its producer stores (a
      // GEMM's epilogue, four bf16 values a store), serves every slice of it.
      int src = map[o->in[0]];
      if (cast[src] < 0)
        nn = add_cast(g, nodes, nn, cast, src, gemm, o->loc);
      map[i] = nn;
      nodes[nn] = copy_node(g, o, nn, map);
      nodes[nn]->in[0] = cast[src];
      nodes[nn]->dtype = gemm;
      cast[nn] = nn; // its own rounding
      nn++;
      if (i + 1 == g->fwd_end)
        fwd_end = nn;
      continue;
    }
    map[i] = nn;
    nodes[nn] = copy_node(g, o, nn, map);
    if (o->op == OP_ATTENTION || o->op == OP_ATTENTION_LSE || o->op == OP_ATTENTION_BWD)
      nodes[nn]->ia[4] = gemm; // its two products read bf16 operands too (mdl.h)
    for (int r = 0; r < nr; r++)
      nodes[nn]->in[which[r]] = cast[map[o->in[which[r]]]];
    nn++;
    if (i + 1 == g->fwd_end)
      fwd_end = nn;
  }
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
  return ir_validate(g, why, n);
}
