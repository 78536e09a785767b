// checkpoint.c: the checkpoint pass. It decides which of the forward's values the backward reads
// from memory and which it recomputes, so that the planned arena (memplan: activations, parameters,
// gradients, moments, copies) fits a memory budget at the smallest extra cost.
//
// Vocabulary. A *saved* value is a forward node computed from the data (not a leaf, not a view such as
// a RESHAPE or SLICE, not a value of the parameters alone such as a weight's bf16 copy) that a
// backward node reads, directly or through views: with none of it recomputed it lives from the
// forward step that writes it to the backward step that last reads it, and the saved values together
// are what makes the backward's start the step's peak. A saved value is *kept* (read as it is) or
// *recomputed*: every backward reader then reads a clone, a copy of the node appended just before its
// first backward reader and shared by the later ones, whose inputs are in turn kept values, leaves,
// or clones of what is neither (recursively: a value nobody saved is rebuilt from the kept values it
// comes from). The forward is left as it is, so its values die after their last forward reader.
// Clones are backward nodes to the fusion pass: a recomputed layernorm and its bf16 rounding form one
// kernel, a recomputed GEMM takes its bias and gelu as an epilogue, and each is scheduled where the
// backward needs it, so its buffer lives only as long as the backward of its layer. A DROPOUT clone
// keeps its seed id, and masks are counter-based random numbers of (seed, id, index), so the
// recomputed masks are the masks the forward drew; every clone computes what its original computed,
// with the same kernels, so values and gradients are bit-identical to none's. One exception needed a
// rule: an op none's plan computes in a GEMM's epilogue (a bias and GELU after the fc GEMM) is, on a
// GPU, cuBLASLt's own bias and GELU, and a clone of it alone would be the module's kernel, with other
// bits (the emulated CUDA kernels showed it). So a clone of an epilogue value recomputes the values
// before it in the same GEMM step, the product included, and fuses into the same epilogue again.
//
// Policies (train section `checkpoint = ...`, or `--checkpoint`):
//   none       every saved value is kept.
//   all        per repeat body (IrNode.body: one repetition, a transformer layer), only what the
//              body hands on is kept (the values a later body or the top level reads: the residual
//              stream); everything else a body saved is recomputed from them. Values outside every
//              repeat body are kept.
//   auto(SIZE) the saved values all would recompute are the candidates, each with a price: the
//              FLOPs of the clones it needs with every other saved value kept (fusion's count), per
//              byte it frees. Cheap ones come first: elementwise, norm and cast outputs cost a pass
//              over memory; a GEMM output costs its GEMM; attention's output and log-sum-exp cost
//              the attention forward, the most per byte, so they go last. The pass takes the shortest
//              prefix of that order whose plan fits (a binary search over prefixes, each one fused
//              and planned: memplan's peak, not an estimate), and reports what it costs.
//   auto       the budget is the memory there is: the host's available memory on the CPU, the
//              device's free memory on a GPU (the driver decides, mdl.h's caller passes it). While
//              none fits, auto is none: no recomputation here is free (a recomputed value is a
//              kernel or a GEMM of its own: the fusion rules put no forward op into a backward
//              kernel that already reads its inputs), so recomputing without a need only costs time.
// A budget all cannot meet is an error that names all's peak and what takes the memory.
//
// Where it runs: after autodiff and the precision pass (the bf16 roundings are values like any
// other: a recomputed norm output is rounded again rather than its rounding kept), before fusion,
// which it runs itself to measure each choice; the graph it leaves is what every back end plans.
#include "mdl.h"

#include <stdlib.h>
#include <string.h>

static bool is_leaf(Op op) {
  return op == OP_INPUT || op == OP_PARAM || op == OP_STATE || op == OP_SCALAR || op == OP_CONST;
}

static bool is_view_op(Op op) { return op == OP_RESHAPE || op == OP_SLICE; }

static int64_t bytes_of(const IrNode *n) { return (int64_t)dtype_size(n->dtype) * shape_numel(n->shape); }

// What one rewrite needs: the saved values and, per node, whether it depends on an input (a value
// computed from parameters alone, a weight's rounding, is not an activation: always kept).
typedef struct {
  const Graph *g;
  bool *saved;     // per forward node
  bool *data;      // per forward node: depends on an INPUT
  bool *outward;   // per forward node in a body: read outside its body (or a graph output, the loss)
  int *gemm;       // per forward node: the GEMM step of none's plan it is computed in (the product or
                   // its epilogue), else -1
  int *cand;       // the candidates, in the order auto takes them
  int ncand;
} Analysis;

static void mark_saved(Analysis *an, int id) {
  const Graph *g = an->g;
  const IrNode *n = g->nodes[id];
  if (is_leaf(n->op) || !an->data[id]) // (a weight's rounding: a parameter's copy, not an activation)
    return;
  if (is_view_op(n->op)) { // a view's memory is its input's
    mark_saved(an, n->in[0]);
    return;
  }
  an->saved[id] = true;
}

static void analyse(Analysis *an, const Graph *g) {
  an->g = g;
  int fe = g->fwd_end;
  an->saved = xcalloc((size_t)fe + 1, sizeof(bool), "checkpointing's tables");
  an->data = xcalloc((size_t)fe + 1, sizeof(bool), "checkpointing's tables");
  an->outward = xcalloc((size_t)fe + 1, sizeof(bool), "checkpointing's tables");
  an->cand = xcalloc((size_t)fe + 1, sizeof(int), "checkpointing's tables");
  an->gemm = xmalloc(sizeof(int) * ((size_t)fe + 1), "checkpointing's tables");
  memset(an->gemm, -1, sizeof(int) * ((size_t)fe + 1));
  for (int i = 0; i < fe; i++) {
    const IrNode *n = g->nodes[i];
    an->data[i] = n->op == OP_INPUT;
    for (int k = 0; k < n->nin; k++) {
      an->data[i] |= an->data[n->in[k]];
      const IrNode *x = g->nodes[n->in[k]];
      if (x->body != 0 && x->body != n->body)
        an->outward[x->id] = true;
    }
  }
  for (int i = 0; i < g->noutputs; i++)
    if (g->outputs[i] < fe)
      an->outward[g->outputs[i]] = true;
  if (g->loss >= 0 && g->loss < fe)
    an->outward[g->loss] = true;
  for (int i = fe; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    for (int k = 0; k < n->nin; k++)
      if (n->in[k] < fe)
        mark_saved(an, n->in[k]);
  }
}

// Whether all recomputes saved value v: a value of a body that the body does not hand on.
static bool all_recomputes(const Analysis *an, int v) {
  const IrNode *n = an->g->nodes[v];
  return an->saved[v] && n->body != 0 && !an->outward[v];
}

// The rewrite: the backward reads a clone of every forward value that is neither a leaf nor kept.
typedef struct {
  const Graph *g;
  const bool *keep; // per forward node
  const int *gemm;  // Analysis.gemm
  IrNode **nodes;
  int nn, cap;
  int *map;         // old id -> new id of the node itself
  int *clone;       // forward id -> its clone's new id, -1 before it is needed
  int nclones;
} Rewrite;

static IrNode *copy_of(Rewrite *r, const IrNode *o, int id) {
  IrNode *c = arena_alloc(r->g->arena, sizeof *c);
  *c = *o;
  c->id = id;
  c->in = arena_alloc(r->g->arena, sizeof(int) * (size_t)(o->nin ? o->nin : 1));
  memcpy(c->in, o->in, sizeof(int) * (size_t)o->nin);
  c->grad_of = o->grad_of >= 0 ? r->map[o->grad_of] : -1;
  c->param_of = o->param_of >= 0 ? r->map[o->param_of] : -1;
  return c;
}

// Whether clone `from` must recompute x rather than read it kept: both are in one GEMM step of none's
// plan (x the product or an earlier epilogue link). A GPU computes an epilogue inside the GEMM
// (cuBLASLt's bias and GELU), its own kernel computes the same op apart: other bits. So an epilogue
// value is recomputed with its product, which fuses again into the same epilogue.
static bool same_gemm(const int *gemm, int from, int x) { return from >= 0 && gemm[x] >= 0 && gemm[x] == gemm[from]; }

// The new id a clone of forward node `from` (-1: a backward node) reads for old node x.
static int use(Rewrite *r, int x, int from) {
  const Graph *g = r->g;
  const IrNode *n = g->nodes[x];
  if (x >= g->fwd_end || is_leaf(n->op) || (r->keep[x] && !same_gemm(r->gemm, from, x)))
    return r->map[x];
  if (r->clone[x] >= 0)
    return r->clone[x];
  int ins[16], *in = n->nin <= 16 ? ins : xmalloc(sizeof(int) * (size_t)n->nin, "checkpointing's tables");
  bool same = true;
  for (int k = 0; k < n->nin; k++) {
    in[k] = use(r, n->in[k], x);
    same &= in[k] == r->map[n->in[k]];
  }
  if (same && is_view_op(n->op)) { // a view of a kept value: read the original view
    if (in != ins)
      free(in);
    return r->map[x];
  }
  IrNode *c = copy_of(r, n, r->nn);
  memcpy(c->in, in, sizeof(int) * (size_t)n->nin);
  if (in != ins)
    free(in);
  c->grad_of = c->param_of = -1;
  r->nodes[r->nn] = c;
  r->clone[x] = r->nn++;
  r->nclones++;
  return r->clone[x];
}

static void remap(int *list, int n, const int *map) {
  for (int i = 0; i < n; i++)
    if (list[i] >= 0)
      list[i] = map[list[i]];
}

// g with every saved value not in keep recomputed in the backward: a new Graph sharing g's arena
// (g is left as it is).
static Graph *rewrite(const Graph *g, const bool *keep, const int *gemm, int *nclones) {
  Rewrite r = {.g = g, .keep = keep, .gemm = gemm, .cap = g->n + g->fwd_end + 1};
  r.nodes = arena_alloc(g->arena, sizeof(IrNode *) * (size_t)r.cap);
  r.map = xmalloc(sizeof(int) * (size_t)g->n, "checkpointing's tables");
  r.clone = xmalloc(sizeof(int) * (size_t)(g->fwd_end + 1), "checkpointing's tables");
  memset(r.clone, -1, sizeof(int) * (size_t)(g->fwd_end + 1));
  for (int i = 0; i < g->n; i++) {
    const IrNode *o = g->nodes[i];
    int in[16], *ins = o->nin <= 16 ? in : xmalloc(sizeof(int) * (size_t)o->nin, "checkpointing's tables");
    for (int k = 0; k < o->nin; k++)
      ins[k] = i >= g->fwd_end ? use(&r, o->in[k], -1) : r.map[o->in[k]];
    r.map[i] = r.nn;
    IrNode *c = copy_of(&r, o, r.nn);
    memcpy(c->in, ins, sizeof(int) * (size_t)o->nin);
    if (ins != in)
      free(ins);
    r.nodes[r.nn++] = c;
  }
  Graph *h = arena_alloc(g->arena, sizeof *h);
  *h = *g;
  h->nodes = r.nodes;
  h->n = r.nn;
  h->cap = r.cap;
  h->outputs = arena_alloc(g->arena, sizeof(int) * (size_t)(g->noutputs + 1));
  memcpy(h->outputs, g->outputs, sizeof(int) * (size_t)g->noutputs);
  h->params = arena_alloc(g->arena, sizeof(int) * (size_t)(g->nparams + 1));
  memcpy(h->params, g->params, sizeof(int) * (size_t)g->nparams);
  remap(h->outputs, h->noutputs, r.map);
  remap(h->params, h->nparams, r.map);
  for (int w = 0; w < 2; w++) {
    int *src = w ? g->updates : g->grads;
    if (!src)
      continue;
    int *dst = arena_alloc(g->arena, sizeof(int) * (size_t)(g->nparams + 1));
    memcpy(dst, src, sizeof(int) * (size_t)g->nparams);
    remap(dst, g->nparams, r.map);
    if (w)
      h->updates = dst;
    else
      h->grads = dst;
  }
  if (g->loss >= 0)
    h->loss = r.map[g->loss];
  *nclones = r.nclones;
  free(r.map);
  free(r.clone);
  return h;
}

// One choice, fused and planned.
typedef struct {
  Graph *g;
  Fusion *f;
  int64_t peak;
  double flops;
  int nclones;
} Trial;

static bool try_keep(const Graph *g, const bool *keep, const int *gemm, FuseOptions fo, bool reuse, Trial *t) {
  Graph *h = rewrite(g, keep, gemm, &t->nclones);
  char why[256];
  if (!ir_validate(h, why, sizeof why)) {
    snprintf(((Graph *)g)->err, sizeof g->err, "the checkpoint pass built a broken graph: %s", why);
    return false;
  }
  Fusion *f = fuse(h, fo);
  MemPlan *m = memplan_with(f, reuse);
  t->g = h;
  t->f = f;
  t->peak = m->arena_bytes;
  t->flops = 0;
  for (int s = 0; s < f->nsteps; s++)
    t->flops += f->steps[s].flops;
  return true;
}

// The FLOPs of the clones saved value v needs when every other saved value is kept (fusion's count,
// without fusing): its price in auto's order; and their class: 2 when they run an attention, else 1
// when they run a GEMM, else 0.
static double clone_cost(const Analysis *an, int v, bool *seen, int *cls) {
  const Graph *g = an->g;
  const IrNode *n = g->nodes[v];
  if (seen[v] || is_leaf(n->op))
    return 0;
  seen[v] = true;
  double c = fuse_node_flops(g, v);
  if (n->op == OP_ATTENTION || n->op == OP_ATTENTION_LSE)
    *cls = 2;
  else if (n->op == OP_MATMUL && *cls < 1)
    *cls = 1;
  for (int k = 0; k < n->nin; k++) {
    int x = n->in[k];
    if (!an->saved[x] || is_view_op(g->nodes[x]->op) || same_gemm(an->gemm, v, x))
      c += clone_cost(an, x, seen, cls);
  }
  return c;
}

typedef struct {
  int id, cls;
  double price; // FLOPs per byte freed
} Priced;

// Cheap values first (a pass over memory each), then those that cost a GEMM, then attention's (its
// output and log-sum-exp stay unless the budget forces them out); within a class by price.
static int by_price(const void *pa, const void *pb) {
  const Priced *a = pa, *b = pb;
  if (a->cls != b->cls)
    return a->cls - b->cls;
  if (a->price != b->price)
    return a->price < b->price ? -1 : 1;
  return a->id - b->id;
}

static void order_candidates(Analysis *an) {
  const Graph *g = an->g;
  Priced *p = xmalloc(sizeof *p * (size_t)(g->fwd_end + 1), "checkpointing's tables");
  bool *seen = xcalloc((size_t)g->fwd_end + 1, sizeof(bool), "checkpointing's tables");
  int n = 0;
  for (int v = 0; v < g->fwd_end; v++) {
    if (!all_recomputes(an, v))
      continue;
    memset(seen, 0, (size_t)g->fwd_end + 1);
    int cls = 0;
    double cost = clone_cost(an, v, seen, &cls);
    p[n++] = (Priced){v, cls, cost / (double)(bytes_of(g->nodes[v]) + 1)};
  }
  qsort(p, (size_t)n, sizeof *p, by_price);
  for (int i = 0; i < n; i++)
    an->cand[i] = p[i].id;
  an->ncand = n;
  free(p);
  free(seen);
}

// keep[] for the first k candidates recomputed (k = ncand: everything all recomputes). (An attention
// output and its log-sum-exp, both recomputed, are clones of the same q, k, v, which the fusion pass
// puts in one step again.)
static void keep_prefix(const Analysis *an, bool *keep, int k) {
  for (int v = 0; v < an->g->fwd_end; v++)
    keep[v] = an->saved[v] || !an->data[v]; // (values of the parameters alone are read as they are)
  for (int i = 0; i < k; i++)
    keep[an->cand[i]] = false;
}

// What takes the memory of a plan, for the error when a budget cannot be met.
static void what_takes(const Graph *h, FuseOptions fo, bool reuse, char *buf, size_t n) {
  Fusion *f = fuse((Graph *)h, fo);
  MemPlan *m = memplan_with(f, reuse);
  int big = -1;
  for (int i = 0; i < h->n; i++)
    if (m->offset[i] >= 0 && !is_leaf(h->nodes[i]->op) && f->step_of[i] >= 0 &&
        (big < 0 || bytes_of(h->nodes[i]) > bytes_of(h->nodes[big])))
      big = i;
  int len = snprintf(buf, n, "parameters %.2f MB, gradients %.2f MB, optimizer moments %.2f MB, bf16 copies %.2f MB, "
                     "activations at the peak %.2f MB", (double)m->param_bytes / 1e6, (double)m->param_bytes / 1e6,
                     m->moments * (double)m->param_bytes / 1e6, (double)m->copy_bytes / 1e6, (double)m->activation_bytes / 1e6);
  if (big >= 0 && len > 0 && (size_t)len < n) {
    const IrNode *b = h->nodes[big];
    char sh[64];
    snprintf(buf + len, n - (size_t)len, "; the largest activation: %s%s %s (%.2f MB, line %d)", op_name(b->op),
             b->name ? arena_printf(h->arena, " '%s'", b->name) : "", shape_str(b->shape, sh, sizeof sh),
             (double)bytes_of(b) / 1e6, b->loc.line);
  }
}

void checkpoint_summary(const CheckpointPlan *cp, bool budget, bool memory, char *buf, size_t n) {
  int len;
  if (cp->nrecomputed == 0)
    len = snprintf(buf, n, "checkpoint %s: every saved value kept (%d, %.2f MB); planned peak %.2f MB", cp->policy,
                   cp->nsaved, (double)cp->saved_bytes / 1e6, (double)cp->peak / 1e6);
  else
    len = snprintf(buf, n, "checkpoint %s: %d of %d saved values recomputed (%.2f MB) by %d nodes in the backward, "
                   "%.3f GFLOP more (%.1f%% of the step), %.2f MB kept; planned peak %.2f MB (none: %.2f MB)",
                   cp->policy, cp->nrecomputed, cp->nsaved, (double)cp->recomputed_bytes / 1e6, cp->nclones,
                   cp->recompute_flops / 1e9, cp->step_flops > 0 ? 100 * cp->recompute_flops / cp->step_flops : 0,
                   (double)cp->saved_bytes / 1e6, (double)cp->peak / 1e6, (double)cp->peak_none / 1e6);
  if (budget && cp->budget > 0 && (memory || !cp->budget_is_memory) && len > 0 && (size_t)len < n)
    snprintf(buf + len, n - (size_t)len, ", budget %.2f MB (%s)", (double)cp->budget / 1e6, cp->budget_how);
}

static void dump(const Graph *g, const Analysis *an, const bool *keep, const CheckpointPlan *cp, FILE *out) {
  char line[1024];
  checkpoint_summary(cp, true, true, line, sizeof line);
  fprintf(out, "%s\n", line);
  for (int v = 0; v < g->fwd_end; v++) {
    if (!an->saved[v])
      continue;
    const IrNode *n = g->nodes[v];
    char sh[64];
    fprintf(out, "  %-10s %%%-5d %-14s %-6s%-18s %12lld bytes  line %d%s%s\n", keep[v] ? "kept" : "recomputed", v,
            op_name(n->op), dtype_name(n->dtype), shape_str(n->shape, sh, sizeof sh), (long long)bytes_of(n),
            n->loc.line, n->name ? "  # " : "", n->name ? n->name : "");
  }
}

static void fill(CheckpointPlan *cp, const Analysis *an, const bool *keep, const Trial *t, int64_t peak_none,
                 double flops_none) {
  const Graph *g = an->g;
  cp->peak = t->peak;
  cp->peak_none = peak_none;
  cp->nclones = t->nclones;
  cp->step_flops = t->flops;
  cp->recompute_flops = t->flops - flops_none;
  cp->nsaved = cp->nrecomputed = 0;
  cp->saved_bytes = cp->recomputed_bytes = 0;
  for (int v = 0; v < g->fwd_end; v++) {
    if (!an->saved[v])
      continue;
    cp->nsaved++;
    if (keep[v]) {
      cp->saved_bytes += bytes_of(g->nodes[v]);
    } else {
      cp->nrecomputed++;
      cp->recomputed_bytes += bytes_of(g->nodes[v]);
    }
  }
}

bool checkpoint_place(Graph *g, const char *policy, int64_t budget, const char *budget_how, bool budget_is_memory,
                      FuseOptions fo, bool reuse, FILE *dump_to, char *why, size_t n) {
  Analysis an = {0};
  analyse(&an, g);
  bool ok = true, *keep = xcalloc((size_t)g->fwd_end + 1, sizeof(bool), "checkpointing's tables");
  Trial none = {0}, best = {0};
  keep_prefix(&an, keep, 0); // (no candidates yet: none)
  if (!try_keep(g, keep, an.gemm, fo, reuse, &none)) {
    snprintf(why, n, "%s", g->err);
    ok = false;
    goto out;
  }
  for (int s = 0; s < none.f->nsteps; s++) // (none's graph has g's ids: nothing is cloned)
    if (none.f->steps[s].kind == STEP_GEMM)
      for (int i = 0; i < none.f->steps[s].nnodes; i++)
        if (none.f->steps[s].nodes[i] < g->fwd_end)
          an.gemm[none.f->steps[s].nodes[i]] = s;
  order_candidates(&an);
  best = none;
  int k = 0;
  if (!strcmp(policy, "all")) {
    k = an.ncand;
  } else if (!strcmp(policy, "auto") && budget > 0 && none.peak > budget) {
    // the shortest prefix of the candidates whose plan fits; all's (every candidate) first
    Trial all;
    keep_prefix(&an, keep, an.ncand);
    if (!try_keep(g, keep, an.gemm, fo, reuse, &all)) {
      snprintf(why, n, "%s", g->err);
      ok = false;
      goto out;
    }
    if (all.peak > budget) {
      what_takes(all.g, fo, reuse, why, n);
      g->ckpt = (CheckpointPlan){.policy = policy, .budget = budget, .budget_how = budget_how, .peak = all.peak,
                                 .peak_none = none.peak};
      ok = false;
      goto out;
    }
    int lo = 0, hi = an.ncand; // none (lo) does not fit, hi does
    best = all;
    while (hi - lo > 1) {
      int mid = lo + (hi - lo) / 2;
      Trial t;
      keep_prefix(&an, keep, mid);
      if (!try_keep(g, keep, an.gemm, fo, reuse, &t)) {
        snprintf(why, n, "%s", g->err);
        ok = false;
        goto out;
      }
      if (t.peak <= budget)
        hi = mid, best = t;
      else
        lo = mid;
    }
    k = hi;
  }
  keep_prefix(&an, keep, k);
  if (k > 0 && best.g == none.g && !try_keep(g, keep, an.gemm, fo, reuse, &best)) {
    snprintf(why, n, "%s", g->err);
    ok = false;
    goto out;
  }
  CheckpointPlan cp = {.policy = policy, .budget = budget, .budget_how = budget_how,
                       .budget_is_memory = budget_is_memory};
  fill(&cp, &an, keep, &best, none.peak, none.flops);
  if (dump_to)
    dump(g, &an, keep, &cp, dump_to);
  Graph *h = best.g;
  g->nodes = h->nodes;
  g->n = h->n;
  g->cap = h->cap;
  g->outputs = h->outputs;
  g->params = h->params;
  g->grads = h->grads;
  g->updates = h->updates;
  g->loss = h->loss;
  g->ckpt = cp;
out:
  free(an.saved);
  free(an.data);
  free(an.outward);
  free(an.cand);
  free(an.gemm);
  free(keep);
  return ok;
}

// A budget: bytes ("1000000"), a size ("512MiB", "2GiB", "1GB", "64KB"), or a fraction of `memory`
// ("0.5", in (0, 1]). Returns the bytes, or -1 when the text is none of these. A budget is at least one
// byte: a fraction too small for one is one byte (a budget no plan meets, refused as such), never 0,
// which would mean none.
int64_t checkpoint_budget(const char *text, int64_t memory, bool *fraction) {
  char *end;
  *fraction = false;
  double x = strtod(text, &end);
  if (end == text || !(x > 0))
    return -1;
  static const struct {
    const char *unit;
    double bytes;
  } units[] = {{"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"KiB", 1024.0},
               {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (size_t i = 0; i < sizeof units / sizeof *units; i++)
    if (!strcmp(end, units[i].unit)) {
      if (i == 0 && x <= 1) { // a fraction of the memory there is
        *fraction = true;
        return memory <= 0 ? -1 : x * (double)memory < 1 ? 1 : (int64_t)(x * (double)memory);
      }
      double b = x * units[i].bytes;
      return b >= 1 && b < 9e18 ? (int64_t)b : -1;
    }
  return -1;
}
