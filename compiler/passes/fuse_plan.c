// fuse_plan.c: the step plan from the fusion pass's groups (fuse.c): views and the parameters' bf16
// copies resolved, the steps put in an order that runs, and each step assembled with its name, ins,
// outs, flops, bytes and reasons into the Fusion the emitters read; also fuse_node_flops and
// fuse_dump.
#include "fuse_impl.h"

#include <stdlib.h>
#include <string.h>

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
void fuse_resolve_views(Fuser *F) {
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

Fusion *fuse_assemble(Fuser *F) {
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
