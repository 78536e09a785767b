// test_fuse.c: the fusion pass and the memory planner.
//  - invariants on every model in models/ with fusion on (LM head chunked and not) and off: each
//    computed node in exactly one step, steps in dependency order, outs and ins complete, a reason
//    for every unfused pair, flat buffers in parameter order, no two buffers alive at the same time
//    overlapping (all pairs over the step timeline);
//  - the fusion rules on gpt2-tiny (layernorm + residual add, layernorm backward siblings,
//    cross-entropy forward + backward, GEMM epilogue with bias and gelu, one optimizer step, the
//    chunked LM head) and on small hand-built graphs with hand-derived groups and arena sizes;
//  - the buffer cap: gpt2-tiny with 16 attention lines in its body, whose sums of gradients would
//    read 48 buffers in one kernel, fits every kernel in FUSE_MAX_BUFFERS;
//  - kernel-count and peak-memory ceilings per model that also fail when the real figure falls more
//    than 20% below them, so they stay tight.
#include "mdl.h"
#include "test.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>

static bool is_leaf(Op op) {
  return op == OP_INPUT || op == OP_PARAM || op == OP_STATE || op == OP_SCALAR || op == OP_CONST;
}

// A parameter's bf16 copy (rule 11): a CAST of a PARAM in no step, written by the optimizer.
static bool is_copy(const Fusion *f, int id) {
  const IrNode *nd = f->g->nodes[id];
  return nd->op == OP_CAST && f->copy_of[nd->in[0]] == id;
}

static bool is_view(const Fusion *f, int id) {
  return f->materialised[id] && f->step_of[id] < 0 && !is_leaf(f->g->nodes[id]->op) && !is_copy(f, id);
}

// The step of the ADAMW that updates PARAM p, or -1.
static int update_step(const Fusion *f, int p) {
  for (int i = 0; f->g->updates && i < f->g->nparams; i++)
    if (f->g->params[i] == p)
      return f->step_of[f->g->updates[i]];
  return -1;
}

static int base_of(const Fusion *f, int id) {
  while (is_view(f, id))
    id = f->g->nodes[id]->in[0];
  return id;
}

static bool contains(const int *list, int n, int v) {
  for (int i = 0; i < n; i++)
    if (list[i] == v)
      return true;
  return false;
}

static Graph *training_graph(Arena *a, const char *path) {
  Graph *g = mdl_compile_file(a, path, NULL, 0);
  if (!g || !autodiff(g, true))
    return NULL;
  return g;
}

// Every non-leaf, non-view node is in exactly one step; leaves and views in none; step_of agrees.
static const char *check_cover(const Fusion *f, char *why, size_t n) {
  const Graph *g = f->g;
  int *count = calloc((size_t)g->n, sizeof(int));
  for (int s = 0; s < f->nsteps; s++)
    for (int i = 0; i < f->steps[s].nnodes; i++) {
      int id = f->steps[s].nodes[i];
      count[id]++;
      if (f->step_of[id] != s)
        snprintf(why, n, "%%%d is in step %d but step_of says %d", id, s, f->step_of[id]);
    }
  for (int i = 0; i < g->n && !*why; i++) {
    const IrNode *nd = g->nodes[i];
    bool view = is_view(f, i);
    // A SLICE view: of the last axis, read only by attention as q, k or v (in place, strided).
    bool attn_slice = nd->op == OP_SLICE && nd->ia[0] == nd->shape.rank - 1;
    for (int u = 0; u < g->n && attn_slice; u++) {
      const IrNode *r = g->nodes[u];
      for (int k = 0; k < r->nin; k++)
        if (r->in[k] == i &&
            !((r->op == OP_ATTENTION || r->op == OP_ATTENTION_LSE || r->op == OP_ATTENTION_BWD) && k < 3))
          attn_slice = false;
    }
    int up = is_copy(f, i) ? update_step(f, nd->in[0]) : -1;
    if (is_copy(f, i) && (nd->dtype != DT_BF16 || g->nodes[nd->in[0]]->op != OP_PARAM || f->step_of[i] >= 0 ||
                          !f->materialised[i] || up < 0 || f->steps[up].kind != STEP_OPTIMIZER))
      snprintf(why, n, "copy %%%d: not a bf16 CAST of a PARAM in no step, materialised, beside its optimizer step", i);
    else if (is_copy(f, i) && count[i])
      snprintf(why, n, "copy %%%d is in a step", i);
    else if (is_copy(f, i))
      continue;
    else if (view && ((nd->op != OP_RESHAPE && !attn_slice) || !f->materialised[nd->in[0]]))
      snprintf(why, n, "%%%d (%s) is a view but not a RESHAPE, nor a SLICE only attention reads, of a materialised node",
               i, op_name(nd->op));
    else if ((is_leaf(nd->op) || view) && count[i])
      snprintf(why, n, "%%%d (%s) is a leaf or a view but in a step", i, op_name(nd->op));
    else if (!is_leaf(nd->op) && !view && count[i] != 1)
      snprintf(why, n, "%%%d (%s) is in %d steps", i, op_name(nd->op), count[i]);
    else if (nd->op == OP_CONST && f->materialised[i])
      snprintf(why, n, "const %%%d is materialised", i);
  }
  free(count);
  return why;
}

// Every input of every step member is a leaf, an earlier member of the same step, materialised by
// an earlier step, or a view of one of those (a view of an out of the same step is allowed: the
// GEMM writes its result before its epilogue reads it). Members read by another step are outs; ins
// list exactly the non-member, non-const inputs. No parameter is read after its in-place update.
static const char *check_order(const Fusion *f, char *why, size_t n) {
  const Graph *g = f->g;
  for (int s = 0; s < f->nsteps && !*why; s++) {
    const Step *st = &f->steps[s];
    for (int i = 0; i < st->nnodes && !*why; i++) {
      int id = st->nodes[i];
      if (i && st->nodes[i - 1] >= id)
        snprintf(why, n, "step %s: nodes not in topological order", st->name);
      const IrNode *nd = g->nodes[id];
      for (int k = 0; k < nd->nin && !*why; k++) {
        int x = nd->in[k], b = base_of(f, x), sb = f->step_of[b];
        bool member = f->step_of[x] == s;
        if (member && !contains(st->nodes, i, x))
          snprintf(why, n, "step %s: %%%d reads member %%%d that comes later", st->name, id, x);
        if (!member && !is_leaf(g->nodes[b]->op) && (sb > s || (sb == s && !contains(st->outs, st->nouts, b))))
          snprintf(why, n, "step %s: %%%d reads %%%d, not materialised before it", st->name, id, x);
        if (!member && sb >= 0 && !f->materialised[b])
          snprintf(why, n, "step %s: %%%d reads %%%d from another step, but it is not materialised", st->name, id, x);
        if (!member && g->nodes[x]->op != OP_CONST && !contains(st->ins, st->nins, x))
          snprintf(why, n, "step %s: input %%%d of %%%d missing from ins", st->name, x, id);
      }
    }
    for (int i = 0; i < st->nouts && !*why; i++)
      if (f->step_of[st->outs[i]] != s || !f->materialised[st->outs[i]])
        snprintf(why, n, "step %s: out %%%d is not a materialised member", st->name, st->outs[i]);
    if (!*why && (st->root < 0 || f->step_of[st->root] != s))
      snprintf(why, n, "step %s: root %%%d is not a member", st->name, st->root);
  }
  for (int c = 0; c < g->n && !*why; c++) {
    const IrNode *nd = g->nodes[c];
    for (int k = 0; k < nd->nin && !*why; k++) {
      int p = base_of(f, nd->in[k]);
      for (int i = 0; g->updates && i < g->nparams && !*why; i++)
        if (p == g->params[i] && f->step_of[c] > f->step_of[g->updates[i]])
          snprintf(why, n, "%%%d reads %s after the optimizer updated it", c, g->nodes[p]->name);
      if (!*why && is_copy(f, p) && f->step_of[c] >= update_step(f, g->nodes[p]->in[0]))
        snprintf(why, n, "%%%d reads the copy %%%d after the optimizer rewrote it", c, p);
      if (f->step_of[p] >= 0 && f->step_of[c] >= 0 && f->step_of[p] != f->step_of[c] &&
          !contains(f->steps[f->step_of[p]].outs, f->steps[f->step_of[p]].nouts, p))
        snprintf(why, n, "%%%d is read by step %d but is not an out of its step", p, f->step_of[c]);
    }
  }
  return why;
}

// Every producer/consumer pair split across two steps has a reason, unless the consumer is the
// optimizer (which reads the gradient buffer by design).
static const char *check_reasons(const Fusion *f, char *why, size_t n) {
  const Graph *g = f->g;
  for (int c = 0; c < g->n && !*why; c++) {
    int sc = f->step_of[c];
    if (sc < 0 || f->steps[sc].kind == STEP_OPTIMIZER)
      continue;
    for (int k = 0; k < g->nodes[c]->nin && !*why; k++) {
      int p = base_of(f, g->nodes[c]->in[k]);
      if (f->step_of[p] < 0 || f->step_of[p] == sc)
        continue;
      bool found = false;
      for (int r = 0; r < f->nrejected && !found; r++)
        found = base_of(f, f->rejected[r].a) == p && f->step_of[f->rejected[r].b] == sc &&
                f->rejected[r].reason && *f->rejected[r].reason;
      if (!found)
        snprintf(why, n, "no reason why %%%d (%s) and %%%d (%s) are not fused", p, op_name(g->nodes[p]->op), c,
                 op_name(g->nodes[c]->op));
    }
  }
  return why;
}

// A step rooted in the forward pass holds forward nodes only; the LM head and cross-entropy with
// its backward span both by design.
static const char *check_forward(const Fusion *f, char *why, size_t n) {
  for (int s = 0; s < f->nsteps && !*why; s++) {
    const Step *st = &f->steps[s];
    if (st->kind == STEP_LMHEAD || f->g->nodes[st->root]->op == OP_CROSS_ENTROPY || st->root >= f->g->fwd_end)
      continue;
    // (but for the softmax statistics of its attention, rule 3 of fuse.c)
    for (int i = 0; i < st->nnodes; i++)
      if (st->nodes[i] >= f->g->fwd_end && !(f->g->nodes[st->nodes[i]]->op == OP_ATTENTION_LSE &&
                                              f->g->nodes[st->root]->op == OP_ATTENTION)) {
        snprintf(why, n, "forward step %s holds backward node %%%d", st->name, st->nodes[i]);
        break;
      }
  }
  return why;
}

static int64_t nbytes(const Graph *g, int id) {
  return dtype_size(g->nodes[id]->dtype) * shape_numel(g->nodes[id]->shape);
}

static const char *state_of(const Graph *g, int p, const char *suffix, int *id) {
  *id = -1;
  for (int i = 0; i < g->n; i++) {
    const IrNode *nd = g->nodes[i];
    size_t len = nd->name ? strlen(nd->name) : 0;
    if (nd->op == OP_STATE && nd->param_of == p && len >= 2 && !strcmp(nd->name + len - 2, suffix))
      *id = i;
  }
  return *id < 0 ? "missing" : NULL;
}

// The four flat buffers hold the parameters in declaration order at the same relative offsets;
// gradients, moments and updates sit where they should.
static const char *check_flat(const Fusion *f, const MemPlan *m, char *why, size_t n) {
  const Graph *g = f->g;
  int64_t end = 0;
  for (int i = 0; i < g->nparams && !*why; i++) {
    int p = g->params[i], mid, vid;
    int64_t rel = m->offset[p] - m->params;
    if (rel < end || rel % 64)
      snprintf(why, n, "param %d (%s) at %lld, before the end of the previous one (%lld) or unaligned", i,
               g->nodes[p]->name, (long long)rel, (long long)end);
    end = rel + nbytes(g, p);
    if (g->grads && m->offset[g->grads[i]] != m->grads + rel)
      snprintf(why, n, "gradient of %s at %lld, want %lld", g->nodes[p]->name, (long long)m->offset[g->grads[i]],
               (long long)(m->grads + rel));
    if (!g->updates)
      continue;
    if (state_of(g, p, ".m", &mid) || state_of(g, p, ".v", &vid))
      snprintf(why, n, "moments of %s not found", g->nodes[p]->name);
    else if (m->offset[mid] != m->m + rel || m->offset[vid] != m->v + rel)
      snprintf(why, n, "moments of %s misplaced", g->nodes[p]->name);
    if (g->updates && m->offset[g->updates[i]] != m->offset[p])
      snprintf(why, n, "the AdamW update of %s does not write its parameter in place", g->nodes[p]->name);
  }
  if (!*why && (end > m->param_bytes || m->grads != m->params + m->param_bytes || m->m != m->grads + m->param_bytes ||
                m->v != m->m + (m->moments > 0 ? m->param_bytes : 0) || m->moments != (g->updates ? 2 : 0)))
    snprintf(why, n, "flat buffers do not follow each other (param_bytes %lld)", (long long)m->param_bytes);
  return why;
}

// Offsets: every materialised node has one (aligned, inside the arena), views share their input's,
// and no two buffers that are alive at the same time overlap. Activation lifetimes are recomputed
// here from the steps' ins.
static const char *check_overlap(const Fusion *f, const MemPlan *m, int64_t *live_peak, char *why, size_t n) {
  const Graph *g = f->g;
  int *first = malloc(sizeof(int) * (size_t)g->n), *last = malloc(sizeof(int) * (size_t)g->n);
  int64_t act = m->arena_bytes - m->activation_bytes;
  for (int i = 0; i < g->n; i++) {
    first[i] = last[i] = f->step_of[i];
    bool mat = f->materialised[i];
    if (mat != (m->offset[i] >= 0))
      snprintf(why, n, "%%%d: materialised %d but offset %lld", i, mat, (long long)m->offset[i]);
    else if (mat && (m->offset[i] % 64 || m->offset[i] + nbytes(g, i) > m->arena_bytes))
      snprintf(why, n, "%%%d: offset %lld unaligned or outside the arena", i, (long long)m->offset[i]);
    else if (is_view(f, i) && m->offset[i] != m->offset[g->nodes[i]->in[0]])
      snprintf(why, n, "view %%%d does not share its input's offset", i);
  }
  for (int s = 0; s < f->nsteps; s++)
    for (int k = 0; k < f->steps[s].nins; k++) {
      int b = base_of(f, f->steps[s].ins[k]);
      if (last[b] < s)
        last[b] = s;
    }
  if (g->loss >= 0)
    last[base_of(f, g->loss)] = f->nsteps;
  // Fixed buffers (leaves and the gradient slots) live throughout; activations in [first, last].
  int *buf = malloc(sizeof(int) * (size_t)g->n), nb = 0;
  for (int i = 0; i < g->n; i++)
    if (f->materialised[i] && !is_view(f, i) && g->nodes[i]->op != OP_ADAMW)
      buf[nb++] = i;
  // Computed nodes below the activation region: gradients (or what a gradient views) and updates.
  bool *grad_slot = calloc((size_t)g->n, sizeof(bool));
  for (int i = 0; g->grads && i < g->nparams; i++)
    grad_slot[base_of(f, g->grads[i])] = true;
  for (int i = 0; i < g->n && !*why; i++)
    if (f->step_of[i] >= 0 && f->materialised[i] && m->offset[i] < act && !grad_slot[i] &&
        g->nodes[i]->op != OP_ADAMW)
      snprintf(why, n, "activation %%%d (%s) outside the activation region", i, op_name(g->nodes[i]->op));
  free(grad_slot);
  for (int x = 0; x < nb && !*why; x++)
    for (int y = x + 1; y < nb && !*why; y++) {
      int i = buf[x], j = buf[y];
      bool fixed = m->offset[i] < act || m->offset[j] < act;
      bool together = fixed || (first[i] <= last[j] && first[j] <= last[i]);
      bool apart = m->offset[i] + nbytes(g, i) <= m->offset[j] || m->offset[j] + nbytes(g, j) <= m->offset[i];
      if (together && !apart)
        snprintf(why, n, "%%%d [%lld,+%lld) and %%%d [%lld,+%lld) overlap while both alive", i,
                 (long long)m->offset[i], (long long)nbytes(g, i), j, (long long)m->offset[j], (long long)nbytes(g, j));
    }
  // The sum of the activations alive at one step bounds the peak from below.
  *live_peak = 0;
  for (int s = 0; s <= f->nsteps; s++) {
    int64_t sum = 0;
    for (int x = 0; x < nb; x++)
      if (m->offset[buf[x]] >= act && first[buf[x]] <= s && s <= last[buf[x]])
        sum += nbytes(g, buf[x]);
    if (sum > *live_peak)
      *live_peak = sum;
  }
  if (!*why && *live_peak > m->activation_bytes)
    snprintf(why, n, "activation_bytes %lld below the live sum %lld", (long long)m->activation_bytes,
             (long long)*live_peak);
  free(first);
  free(last);
  free(buf);
  return why;
}

static void check_invariants(const char *label, const Fusion *f) {
  char name[256], why[512];
#define INVARIANT(what, call)                                                                      \
  do {                                                                                             \
    why[0] = 0;                                                                                    \
    call;                                                                                          \
    snprintf(name, sizeof name, "%s: %s", label, what);                                            \
    CHECK(!why[0], name, "%s", why);                                                               \
  } while (0)
  INVARIANT("every computed node in exactly one step", check_cover(f, why, sizeof why));
  INVARIANT("steps in dependency order, outs and ins complete", check_order(f, why, sizeof why));
  INVARIANT("a reason for every unfused pair", check_reasons(f, why, sizeof why));
  INVARIANT("forward steps hold forward nodes only", check_forward(f, why, sizeof why));
  MemPlan *m = memplan(f);
  INVARIANT("flat buffers in parameter order", check_flat(f, m, why, sizeof why));
  int64_t live;
  INVARIANT("live buffers never overlap", check_overlap(f, m, &live, why, sizeof why));
#undef INVARIANT
}

static const Step *step_with(const Fusion *f, int node) {
  return f->step_of[node] >= 0 ? &f->steps[f->step_of[node]] : NULL;
}

static bool has_reason(const Fusion *f, int a, int b, const char *text) {
  for (int i = 0; i < f->nrejected; i++)
    if (f->rejected[i].a == a && f->rejected[i].b == b && strstr(f->rejected[i].reason, text))
      return true;
  return false;
}

// The fusion rules on the tiny GPT.
// The LM head's traffic: what its step reads and writes, plus the logits written and read back and
// dlogits written once and read by both backward GEMMs (size bytes each: 2 with bf16, where the loss
// reads the logits' CAST and the GEMMs dlogits' CAST).
static void lmhead_traffic(const char *label, const Fusion *f, int size) {
  const Graph *g = f->g;
  int lm = -1, ceb = -1;
  for (int s = 0; s < f->nsteps; s++)
    if (f->steps[s].kind == STEP_LMHEAD)
      lm = s;
  for (int k = 0; lm >= 0 && k < f->steps[lm].nnodes; k++)
    if (g->nodes[f->steps[lm].nodes[k]]->op == OP_CROSS_ENTROPY_BWD)
      ceb = f->steps[lm].nodes[k];
  char name[160];
  snprintf(name, sizeof name, "rules: %s: the LM head counts its logits and dlogits chunks as read and written", label);
  if (ceb < 0) {
    CHECK(false, name, "no LM head step");
    return;
  }
  const Step *st = &f->steps[lm];
  double rd = 0, wr = 0, nv = (double)shape_numel(g->nodes[ceb]->shape);
  for (int i = 0; i < st->nins; i++)
    rd += dtype_size(g->nodes[st->ins[i]]->dtype) * (double)shape_numel(g->nodes[st->ins[i]]->shape);
  for (int i = 0; i < st->nouts; i++)
    wr += dtype_size(g->nodes[st->outs[i]]->dtype) * (double)shape_numel(g->nodes[st->outs[i]]->shape);
  rd += size * nv + 2 * size * nv;
  wr += size * nv + size * nv;
  CHECK(st->bytes_read == rd && st->bytes_written == wr, name, "read %.0f, want %.0f; written %.0f, want %.0f",
        st->bytes_read, rd, st->bytes_written, wr);
}

static void gpt2_rules(void) {
  Arena *a = arena_new();
  Graph *g = training_graph(a, "models/gpt2-tiny.mdl");
  CHECK(g != NULL, "rules: gpt2-tiny compiles", "front end or autodiff failed");
  if (!g)
    return;
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
  CHECK(f != NULL, "rules: gpt2-tiny fuses", "%s", g->err);
  if (!f)
    return;
  int ln_add = 0, ln = 0, ln_bwd_ok = 0, ln_bwd = 0, gelu_epilogue = 0, att_bwd = 0, att_bwd_ok = 0;
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    const Step *s = step_with(f, i);
    if (n->op == OP_LAYERNORM) {
      ln++;
      int x = n->in[0];
      if (g->nodes[x]->op == OP_ADD && f->step_of[x] == f->step_of[i] && contains(s->outs, s->nouts, x) &&
          contains(s->outs, s->nouts, i) && s->nnodes == 2 && !strncmp(strchr(s->name, '_'), "_layernorm_fwd__add", 20))
        ln_add++;
    }
    if (n->op == OP_LAYERNORM_BWD && n->ia[0] == 0) {
      ln_bwd++;
      // The three siblings, and what rules 7, 9 and 10 add: the chain on dx (the residual gradient's
      // ADD), its rounding, the column sum of a bias gradient.
      bool ok = s->root == i && s->kind == STEP_KERNEL;
      int siblings = 0;
      for (int k = 0; k < s->nnodes && ok; k++) {
        const IrNode *m = g->nodes[s->nodes[k]];
        if (m->op == OP_LAYERNORM_BWD)
          siblings += m->ia[0] == siblings && !memcmp(m->in, n->in, sizeof(int) * 3);
        else
          ok = m->op == OP_ADD || m->op == OP_RESHAPE || m->op == OP_SUM || m->op == OP_CAST;
      }
      ln_bwd_ok += ok && siblings == 3;
    }
    if (n->op == OP_ATTENTION_BWD && n->ia[3] == 0) {
      att_bwd++;
      att_bwd_ok += s->kind == STEP_ATTENTION && s->nnodes == 3 && s->nouts == 3;
    }
    if (n->op == OP_GELU && s->kind == STEP_GEMM) {
      // gelu(add(reshape(matmul), bias)) with the bias a [C] parameter and the add written out
      int add = n->in[0];
      const IrNode *an = g->nodes[add];
      int mm = s->root;
      bool ok = an->op == OP_ADD && f->step_of[add] == f->step_of[i] && g->nodes[an->in[1]]->op == OP_PARAM &&
                g->nodes[an->in[1]]->shape.rank == 1 && contains(s->outs, s->nouts, add) &&
                contains(s->outs, s->nouts, i) && g->nodes[mm]->op == OP_MATMUL &&
                strstr(s->name, "_gemm__add__gelu") != NULL;
      gelu_epilogue += ok;
    }
  }
  CHECK(ln_add >= 1, "rules: layernorm fwd and the add producing x in one kernel",
        "%d of %d layernorms have it", ln_add, ln);
  CHECK(ln_bwd == 5 && ln_bwd_ok == ln_bwd, "rules: layernorm bwd dx/dw/db in one step",
        "%d of %d layernorm backward steps hold their three siblings", ln_bwd_ok, ln_bwd);
  CHECK(att_bwd == 2 && att_bwd_ok == att_bwd, "rules: attention bwd dq/dk/dv in one step", "%d of %d", att_bwd_ok,
        att_bwd);
  // The backward's softmax statistics are stored by the forward's step (rule 3), which writes them out.
  int lse = 0, lse_ok = 0;
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op != OP_ATTENTION_LSE)
      continue;
    lse++;
    const Step *s = &f->steps[f->step_of[i]];
    const IrNode *r = g->nodes[s->root];
    lse_ok += s->kind == STEP_ATTENTION && r->op == OP_ATTENTION && !memcmp(r->in, n->in, sizeof(int) * 4) &&
              contains(s->outs, s->nouts, i) && strstr(s->name, "_attention_fwd__") && strstr(s->name, "__lse");
  }
  CHECK(lse == 2 && lse_ok == lse, "rules: the attention forward stores its log-sum-exp (attention_lse joins it)",
        "%d of %d", lse_ok, lse);
  CHECK(gelu_epilogue == 2, "rules: GEMM epilogue has bias add + gelu (pre-activation written)",
        "%d GEMM steps with it, want 2 (one per layer)", gelu_epilogue);
  // q, k and v are column slices of one qkv GEMM output: attention (forward and backward) reads them
  // in place, so no step copies them out; the backward reads them (its ins keep qkv alive).
  int slices = 0, in_place = 0, qkv_live = 0;
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op != OP_SLICE || i >= g->fwd_end)
      continue;
    slices++;
    in_place += f->step_of[i] < 0 && f->materialised[i];
    for (int s = 0; s < f->nsteps; s++)
      if (f->steps[s].kind == STEP_ATTENTION && g->nodes[f->steps[s].root]->op == OP_ATTENTION_BWD)
        for (int k = 0; k < f->steps[s].nins; k++)
          qkv_live += f->steps[s].ins[k] == i;
  }
  CHECK(slices == 6 && in_place == 6 && qkv_live == 6, "rules: attention reads q, k, v in place (no slice kernels)",
        "%d slices, %d views, %d read by the backward", slices, in_place, qkv_live);

  int nopt = 0, gn = -1;
  for (int s = 0; s < f->nsteps; s++)
    nopt += f->steps[s].kind == STEP_OPTIMIZER;
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_GRAD_NORM)
      gn = i;
  bool all_in = gn >= 0;
  for (int i = 0; i < g->nparams && all_in; i++)
    all_in = f->step_of[g->updates[i]] == f->step_of[gn];
  CHECK(nopt == 1 && all_in && f->steps[f->step_of[gn]].nnodes == g->nparams + 1,
        "rules: grad norm and every AdamW in one optimizer step", "%d optimizer steps", nopt);

  // The LM head: logits GEMM, cross-entropy fwd/bwd and both backward GEMMs in one step; the
  // logits output is never materialised.
  int logits = -1;
  for (int i = 0; i < g->noutputs; i++)
    if (g->nodes[g->outputs[i]]->name && !strcmp(g->nodes[g->outputs[i]]->name, "logits"))
      logits = g->outputs[i];
  int nlm = 0, lm = -1;
  for (int s = 0; s < f->nsteps; s++)
    if (f->steps[s].kind == STEP_LMHEAD)
      nlm++, lm = s;
  bool lm_ok = nlm == 1 && logits >= 0 && f->step_of[logits] == lm && !f->materialised[logits];
  int mm = 0, ce = -1, ceb = -1;
  for (int k = 0; lm_ok && k < f->steps[lm].nnodes; k++) {
    int id = f->steps[lm].nodes[k];
    mm += g->nodes[id]->op == OP_MATMUL;
    if (g->nodes[id]->op == OP_CROSS_ENTROPY)
      ce = id;
    if (g->nodes[id]->op == OP_CROSS_ENTROPY_BWD)
      ceb = id;
  }
  lm_ok = lm_ok && mm == 3 && ce >= 0 && ceb >= 0 && !f->materialised[ceb] && f->steps[lm].nouts == 3 &&
          contains(f->steps[lm].outs, f->steps[lm].nouts, ce);
  CHECK(lm_ok, "rules: LM head chunked (3 GEMMs + CE fwd/bwd in one step, logits never materialised)",
        "%d LM-head steps, %d GEMMs", nlm, mm);
  if (lm_ok)
    lmhead_traffic("gpt2-tiny", f, 4);

  // An embedding step reads the table's rows its ids pick (at most one per output row), not the whole
  // table: at B=1 T=16, 16 of wte's 256 rows and 16 of wpe's 128; at the default shape (512 rows)
  // all of both.
  for (int small = 0; small < 2; small++) {
    DimOverride ov[] = {{"B", 1}, {"T", 16}};
    Graph *e = mdl_compile_file(a, "models/gpt2-tiny.mdl", small ? ov : NULL, small ? 2 : 0);
    Fusion *ef = e && autodiff(e, true) ? fuse(e, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
    int embeds = 0, right = 0;
    for (int s = 0; ef && s < ef->nsteps; s++) {
      const Step *st = &ef->steps[s];
      const IrNode *n = e->nodes[st->root];
      if (n->op != OP_EMBED || st->nnodes != 1)
        continue;
      embeds++;
      double table = 4.0 * (double)shape_numel(e->nodes[n->in[0]]->shape), out = 4.0 * (double)shape_numel(n->shape);
      double ids = 4.0 * (double)shape_numel(e->nodes[n->in[1]]->shape);
      right += st->bytes_read == (small ? out : table) + ids && (small ? out < table : table <= out);
    }
    CHECK(embeds == 2 && right == 2,
          small ? "traffic: gpt2-tiny B=1 T=16: an embedding reads the rows it gathers, not its table"
                : "traffic: gpt2-tiny: an embedding of more rows than its table reads the table once",
          "%d embedding steps, %d counted right", embeds, right);
  }

  // Without chunking: cross-entropy forward and backward share one row-wise kernel.
  Fusion *u = fuse(g, (FuseOptions){.fuse = true});
  bool ce_ok = u && ce >= 0 && ceb >= 0 && u->step_of[ce] == u->step_of[ceb] &&
               u->steps[u->step_of[ce]].kind == STEP_KERNEL && u->steps[u->step_of[ce]].nnodes == 2;
  CHECK(ce_ok, "rules: cross-entropy fwd + bwd in one kernel (LM head not chunked)", "they are apart");
  if (u)
    check_invariants("gpt2-tiny (LM head not chunked)", u);

  // Names: "k<index>_...", unique; a GEMM never takes a prologue and says so.
  bool names = true;
  for (int s = 0; s < f->nsteps && names; s++) {
    char want[32];
    snprintf(want, sizeof want, "k%d_", s);
    names = !strncmp(f->steps[s].name, want, strlen(want));
    for (int t = 0; t < s && names; t++)
      names = strcmp(f->steps[s].name, f->steps[t].name) != 0;
  }
  CHECK(names, "rules: step names are k<index>_... and unique", "bad name");
  int ln0 = -1, mm0 = -1;
  for (int i = 0; i < g->n && (ln0 < 0 || mm0 < 0); i++) {
    if (g->nodes[i]->op == OP_LAYERNORM && ln0 < 0)
      ln0 = i;
    if (g->nodes[i]->op == OP_MATMUL && mm0 < 0)
      mm0 = i;
  }
  CHECK(has_reason(f, ln0, mm0, "no prologue fusion"), "rules: why-not-fused log names the GEMM prologue",
        "no reason for %%%d -> %%%d", ln0, mm0);

  // The dump: a header, one line per step, one per rejection.
  char *text = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&text, &len);
  fuse_dump(f, mem);
  fclose(mem);
  int lines = 0;
  for (size_t i = 0; i < len; i++)
    lines += text[i] == '\n';
  CHECK(lines == 1 + f->nsteps + f->nrejected && strstr(text, "k2_layernorm_fwd__add") &&
            strstr(text, "not fused: layernorm@38 with matmul@38: consumer is a GEMM (no prologue fusion)"),
        "rules: fuse_dump lists steps and reasons", "%d lines for %d steps and %d reasons", lines, f->nsteps,
        f->nrejected);
  free(text);

  // A cap of 2 nodes per group binds GEMM epilogues and elementwise groups, and the plan stays sound.
  Fusion *c = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true, .max_group = 2});
  bool capped = c != NULL, cap_reason = false;
  for (int s = 0; c && s < c->nsteps; s++) {
    Op r = g->nodes[c->steps[s].root]->op;
    if (c->steps[s].kind == STEP_GEMM || r == OP_ADD || r == OP_SUM || r == OP_MEAN)
      capped &= c->steps[s].nnodes <= 2;
  }
  for (int i = 0; c && i < c->nrejected; i++)
    cap_reason |= strstr(c->rejected[i].reason, "group size cap (2 nodes)") != NULL;
  CHECK(capped && cap_reason && c->nsteps > f->nsteps, "rules: max_group caps groups and says so",
        "steps %d (uncapped %d)", c ? c->nsteps : -1, f->nsteps);
  if (c)
    check_invariants("gpt2-tiny (max_group 2)", c);
  arena_free(a);
}

// A hand-built graph: exp(s) read through a broadcast is not recomputed per element; neg(s) is.
//   e = exp(s[8]); y = x[4,8] * e; z = -y; w = z + neg(s)
static void recompute_rule(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  SrcLoc no = {0};
  int x = ir_leaf(g, OP_INPUT, "x", DT_F32, shape_of(2, (int64_t[]){4, 8}), no);
  int s = ir_leaf(g, OP_INPUT, "s", DT_F32, shape_of(1, (int64_t[]){8}), no);
  int e = ir_add(g, OP_EXP, &s, 1, NULL, NULL, no);
  int y = ir_add(g, OP_MUL, (int[]){x, e}, 2, NULL, NULL, no);
  int z = ir_add(g, OP_NEG, &y, 1, NULL, NULL, no);
  int ns = ir_add(g, OP_NEG, &s, 1, NULL, NULL, no);
  int w = ir_add(g, OP_ADD, (int[]){z, ns}, 2, NULL, NULL, no);
  g->fwd_end = g->n;
  Fusion *f = fuse(g, (FuseOptions){.fuse = true});
  bool ok = f && f->nsteps == 2 && f->steps[0].nnodes == 1 && f->steps[0].root == e && f->steps[1].root == w &&
            f->steps[1].nnodes == 4 && f->step_of[ns] == 1 && f->step_of[y] == 1 && f->steps[1].nouts == 1 &&
            f->materialised[e] && !f->materialised[z];
  CHECK(ok, "hand graph: exp stays out of the broadcasting group, neg is recomputed inside",
        "%d steps", f ? f->nsteps : -1);
  CHECK(f && has_reason(f, e, y, "recomputed"), "hand graph: the exp rejection says why", "no reason");
  CHECK(f && !strcmp(f->steps[1].name, "k1_add__mul__neg"), "hand graph: elementwise step name",
        "got %s", f ? f->steps[1].name : "?");
  if (f)
    check_invariants("hand graph (recompute)", f);
  arena_free(a);
}

// A hand-built graph where extending a GEMM epilogue would make a cycle:
//   t = tanh(x @ w + b); u = t * broadcast(sum(t, axis 1)): u must wait for the reduction of t.
static void cycle_rule(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  SrcLoc no = {0};
  int x = ir_leaf(g, OP_INPUT, "x", DT_F32, shape_of(2, (int64_t[]){4, 8}), no);
  int w = ir_leaf(g, OP_PARAM, "w", DT_F32, shape_of(2, (int64_t[]){8, 8}), no);
  int b = ir_leaf(g, OP_PARAM, "b", DT_F32, shape_of(1, (int64_t[]){8}), no);
  int h = ir_add(g, OP_MATMUL, (int[]){x, w}, 2, NULL, NULL, no);
  int ad = ir_add(g, OP_ADD, (int[]){h, b}, 2, NULL, NULL, no);
  int t = ir_add(g, OP_TANH, &ad, 1, NULL, NULL, no);
  int s = ir_add(g, OP_SUM, &t, 1, (int64_t[8]){1, 0}, NULL, no);
  int r = ir_reshape(g, s, shape_of(2, (int64_t[]){4, 1}), no);
  int bc = ir_broadcast(g, r, shape_of(2, (int64_t[]){4, 8}), no);
  int u = ir_add(g, OP_MUL, (int[]){t, bc}, 2, NULL, NULL, no);
  g->fwd_end = g->n;
  Fusion *f = fuse(g, (FuseOptions){.fuse = true});
  // The row sum of t joins the GEMM's step (rule 10): its loop computes the epilogue.
  bool ok = f && f->nsteps == 2 && f->steps[0].kind == STEP_GEMM && f->steps[0].nnodes == 4 &&
            f->step_of[ad] == 0 && f->step_of[t] == 0 && f->step_of[s] == 0 && f->steps[0].nouts == 2 &&
            contains(f->steps[0].outs, 2, t) && contains(f->steps[0].outs, 2, s) && f->step_of[r] < 0 &&
            f->materialised[r] && f->step_of[bc] == 1 && f->step_of[u] == 1 &&
            !strcmp(f->steps[0].name, "k0_gemm__add__tanh__sum");
  CHECK(ok, "hand graph: GEMM epilogue stops before a cycle; the reduction's reshape is a view",
        "%d steps", f ? f->nsteps : -1);
  CHECK(f && has_reason(f, t, u, "cyclic"), "hand graph: the cycle rejection says why", "no reason");
  if (f)
    check_invariants("hand graph (cycle)", f);
  arena_free(a);
}

// Rule 10 on hand graphs. p = exp(x) is read by a column sum and by another kernel: the sum's step
// computes p, writes it and sums it, so p is never read back. Not across the forward/backward line,
// and not when the sum's step would wait on a step that waits on it.
static Graph *sum_graph(Arena *a, bool cycle, int *x_, int *p_, int *s_, int *u_) {
  Graph *g = ir_new(a);
  SrcLoc no = {0};
  int x = ir_leaf(g, OP_INPUT, "x", DT_F32, shape_of(2, (int64_t[]){64, 8}), no);
  int p = ir_add(g, OP_EXP, &x, 1, NULL, NULL, no);
  int s = ir_add(g, OP_SUM, &p, 1, (int64_t[8]){0, 0}, NULL, no);
  int u = ir_add(g, OP_MUL, (int[]){p, p}, 2, NULL, NULL, no);
  if (cycle) { // s + sum(u, axis 0): the sum's step would read what a step reading p computes
    int w = ir_add(g, OP_SUM, &u, 1, (int64_t[8]){0, 0}, NULL, no);
    ir_add(g, OP_ADD, (int[]){s, w}, 2, NULL, NULL, no);
  }
  g->fwd_end = g->n;
  *x_ = x, *p_ = p, *s_ = s, *u_ = u;
  return g;
}

static void reduction_rule(void) {
  Arena *a = arena_new();
  int x, p, s, u;
  Graph *g = sum_graph(a, false, &x, &p, &s, &u);
  Fusion *f = fuse(g, (FuseOptions){.fuse = true});
  bool ok = f && f->nsteps == 2 && f->step_of[p] == f->step_of[s] && f->step_of[u] != f->step_of[s];
  const Step *st = ok ? &f->steps[f->step_of[s]] : NULL;
  ok = ok && st->root == s && st->nouts == 2 && contains(st->outs, st->nouts, p) && st->nins == 1 && st->ins[0] == x &&
       !strcmp(st->name, "k0_sum__exp") && st->bytes_read == 64 * 8 * 4;
  CHECK(ok, "rule 10: a column sum computes, writes and sums the elementwise value it reads",
        "%d steps; the sum's step: %s", f ? f->nsteps : -1, st ? st->name : "?");
  if (f)
    check_invariants("hand graph (rule 10)", f);

  g = sum_graph(a, false, &x, &p, &s, &u);
  g->fwd_end = s; // p forward, the sum backward
  f = fuse(g, (FuseOptions){.fuse = true});
  CHECK(f && f->step_of[p] != f->step_of[s] && has_reason(f, p, s, "forward step"),
        "rule 10: not across the forward/backward line, and says so", "p and its sum share a step");

  g = sum_graph(a, true, &x, &p, &s, &u);
  f = fuse(g, (FuseOptions){.fuse = true});
  CHECK(f && f->step_of[p] != f->step_of[s] && has_reason(f, p, s, "cyclic"),
        "rule 10: not when the steps would wait on each other, and says so", "p and its sum share a step");
  if (f)
    check_invariants("hand graph (rule 10, cycle)", f);

  g = sum_graph(a, false, &x, &p, &s, &u);
  f = fuse(g, (FuseOptions){.fuse = true, .max_group = 1});
  CHECK(f && f->step_of[p] != f->step_of[s] && has_reason(f, p, s, "group size cap"),
        "rule 10: bound by the group size cap", "p and its sum share a step");

  // The tiny GPT (2 layers): every bias gradient is summed by the kernel that computes the gradient
  // it sums. The qkv GEMM's by an elementwise kernel; the attention projection's and the MLP
  // projection's by a layernorm backward, whose row loop adds the residual gradient and sums it by
  // columns (the last layer's MLP projection's is the final layernorm's dx itself); the MLP's first
  // bias, whose gradient a GEMM epilogue computes (gelu_bwd), in that GEMM's step. In bf16 the step
  // also writes the gradient's rounding for the GEMMs, and the f32 gradients read only by the sum and
  // the rounding (qkv's, gelu_bwd's) are never written.
  for (int bf = 0; bf < 2; bf++) {
    Graph *t = training_graph(a, "models/gpt2-tiny.mdl");
    char why[256] = "";
    if (!t || (bf && !precision_assign(t, DT_BF16, why, sizeof why))) {
      CHECK(false, "rule 10: gpt2-tiny", "no training graph %s", why);
      continue;
    }
    Fusion *h = fuse(t, (FuseOptions){.fuse = true, .chunk_lmhead = true});
    if (!h) {
      CHECK(false, "rule 10: gpt2-tiny fuses", "%s", t->err);
      continue;
    }
    int bias = 0, fused = 0, in_gemm = 0, in_norm = 0, casts = 0, unwritten = 0;
    for (int k = 0; k < t->nparams; k++) {
      int gr = t->grads[k];
      const IrNode *pn = t->nodes[t->params[k]];
      if (t->nodes[gr]->op != OP_SUM || pn->shape.rank != 1 || !strstr(pn->name, "_b"))
        continue;
      bias++;
      int in = t->nodes[gr]->in[0];
      while (t->nodes[in]->op == OP_RESHAPE)
        in = t->nodes[in]->in[0];
      const Step *bs = &h->steps[h->step_of[gr]];
      if (h->step_of[in] != h->step_of[gr] || t->nodes[in]->op == OP_MATMUL)
        continue;
      fused++;
      in_gemm += bs->kind == STEP_GEMM && t->nodes[bs->root]->op == OP_MATMUL;
      in_norm += bs->kind == STEP_KERNEL && t->nodes[bs->root]->op == OP_LAYERNORM_BWD;
      for (int i = 0; i < t->n; i++)
        if (t->nodes[i]->op == OP_CAST && t->nodes[t->nodes[i]->in[0]]->in[0] == in && h->step_of[i] == h->step_of[gr] &&
            contains(bs->outs, bs->nouts, i))
          casts++;
      unwritten += !h->materialised[in];
    }
    CHECK(bias == 8 && fused == 8 && in_gemm == 2 && in_norm == 4 && casts == (bf ? 8 : 0) &&
              unwritten == (bf ? 4 : 0),
          bf ? "rule 10: gpt2-tiny bf16: bias gradients summed by the kernels computing them, with the roundings"
             : "rule 10: gpt2-tiny: bias gradients summed by the kernels computing them",
          "%d bias gradients, %d fused (%d in GEMM steps, %d in layernorm backward steps), %d roundings, %d gradients "
          "not written", bias, fused, in_gemm, in_norm, casts, unwritten);
    check_invariants(bf ? "gpt2-tiny bf16 (rule 10)" : "gpt2-tiny (rule 10)", h);
    if (bf)
      lmhead_traffic("gpt2-tiny bf16", h, 2);
    // Rule 9: in bf16 the attention forward writes its output's rounding (the projection's operand)
    // itself, and the f32 output, read by nothing else, is never written.
    int att = 0, att_cast = 0;
    for (int i = 0; i < t->n; i++) {
      if (t->nodes[i]->op != OP_ATTENTION)
        continue;
      att++;
      for (int c = 0; c < t->n; c++)
        att_cast += t->nodes[c]->op == OP_CAST && h->step_of[c] == h->step_of[i] && !h->materialised[i] &&
                    h->steps[h->step_of[i]].kind == STEP_ATTENTION;
    }
    // The tied table's gradient: the embedding backward's step adds the LM head's part as it stores
    // each element, so the embedding's own part is never written.
    int tied = 0;
    for (int i = 0; i < t->n; i++)
      if (t->nodes[i]->op == OP_EMBED_BWD && t->nodes[i]->shape.d[0] == 256) {
        const Step *es = &h->steps[h->step_of[i]];
        tied += es->nnodes == 2 && t->nodes[es->nodes[1]]->op == OP_ADD && !h->materialised[i] &&
                t->nodes[es->nodes[1]]->grad_of >= 0 && !strcmp(es->name + strcspn(es->name, "_"), "_embed_bwd__add");
      }
    CHECK(tied == 1, "rule 7: gpt2-tiny: the tied table's gradient adds the LM head's part in the embedding backward",
          "%d such steps", tied);
    CHECK(att == 2 && att_cast == (bf ? 2 : 0),
          bf ? "rule 9: gpt2-tiny bf16: attention writes its output rounded to bf16, not in f32"
             : "rule 9: gpt2-tiny: attention writes its f32 output",
          "%d attention steps, %d with the rounding", att, att_cast);
  }
  arena_free(a);
}

// Rule 11 on the tiny GPT in bf16: each matmul weight's rounding (the two layers' four weights and the
// tied table) is a copy the optimizer writes, in no step, placed after the AdamW moments; the
// optimizer step counts the bytes it writes. No copies in fp32, unfused, or without an optimizer.
static void copies_rule(void) {
  Arena *a = arena_new();
  for (int mode = 0; mode < 4; mode++) { // bf16 fused, fp32, bf16 unfused, bf16 without optimizer
    Graph *g = mdl_compile_file(a, "models/gpt2-tiny.mdl", NULL, 0);
    char why[256] = "";
    if (!g || !autodiff(g, mode != 3) || (mode != 1 && !precision_assign(g, DT_BF16, why, sizeof why))) {
      CHECK(false, "rule 11: gpt2-tiny compiles", "%s", why);
      continue;
    }
    Fusion *f = fuse(g, (FuseOptions){.fuse = mode != 2, .chunk_lmhead = true});
    if (!f) {
      CHECK(false, "rule 11: gpt2-tiny fuses", "%s", g->err);
      continue;
    }
    if (mode) {
      CHECK(f->ncopies == 0, mode == 1 ? "rule 11: no copies in fp32" : mode == 2 ? "rule 11: no copies unfused"
                                                                                  : "rule 11: no copies without an optimizer",
            "%d copies", f->ncopies);
      continue;
    }
    MemPlan *m = memplan(f);
    int copies = 0, weights = 0, bad = -1, opt = -1;
    double want = 0;
    for (int s = 0; s < f->nsteps; s++)
      if (f->steps[s].kind == STEP_OPTIMIZER)
        opt = s;
    for (int k = 0; k < g->nparams; k++) {
      const IrNode *pn = g->nodes[g->params[k]];
      int c = f->copy_of[pn->id];
      bool weight = pn->shape.rank == 2 && strcmp(pn->name, "wpe");
      weights += weight;
      want += 12.0 * (double)shape_numel(pn->shape);
      if (c < 0) {
        if (weight)
          bad = pn->id;
        continue;
      }
      copies++;
      want += 2.0 * (double)shape_numel(pn->shape);
      int64_t o = m->offset[c];
      if (!weight || g->nodes[c]->op != OP_CAST || g->nodes[c]->in[0] != pn->id || f->step_of[c] >= 0 ||
          !f->materialised[c] || o < m->copies || o + 2 * shape_numel(pn->shape) > m->copies + m->copy_bytes ||
          m->copies < m->v + m->param_bytes)
        bad = c;
      for (int s = 0; s < f->nsteps; s++)
        for (int i = 0; i < f->steps[s].nins; i++)
          if (f->steps[s].ins[i] == c && f->steps[s].kind != STEP_GEMM && f->steps[s].kind != STEP_LMHEAD)
            bad = c;
    }
    for (int s = 0; s < f->nsteps; s++)
      for (int i = 0; i < f->steps[s].nnodes; i++) {
        const IrNode *nd = g->nodes[f->steps[s].nodes[i]];
        if (nd->op == OP_CAST && g->nodes[nd->in[0]]->op == OP_PARAM)
          bad = nd->id;
      }
    want += 4; // the gradient norm
    CHECK(copies == 9 && weights == 9 && f->ncopies == 9 && bad < 0 && opt == f->nsteps - 1 &&
              f->steps[opt].bytes_written == want,
          "rule 11: gpt2-tiny bf16: every weight's rounding is a copy the optimizer writes",
          "%d copies of %d weights (ncopies %d), node %%%d wrong, optimizer step %d of %d writes %.0f bytes, want %.0f",
          copies, weights, f->ncopies, bad, opt, f->nsteps, opt >= 0 ? f->steps[opt].bytes_written : 0, want);
    check_invariants("gpt2-tiny bf16 (rule 11)", f);
  }
  arena_free(a);
}

// A hand-built chain with hand-computed lifetimes: x[16] -> exp -> exp -> exp -> sum. Unfused, the
// four results live over steps [0,1], [1,2], [2,3], [3,end]: two 64-byte buffers suffice (a and c
// share one), 128 bytes of activations. Fused, the chain is one reduction step and only the sum
// (4 bytes, aligned to 64) is materialised.
static void memplan_by_hand(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  SrcLoc no = {0};
  int x = ir_leaf(g, OP_INPUT, "x", DT_F32, shape_of(1, (int64_t[]){16}), no);
  int e1 = ir_add(g, OP_EXP, &x, 1, NULL, NULL, no);
  int e2 = ir_add(g, OP_EXP, &e1, 1, NULL, NULL, no);
  int e3 = ir_add(g, OP_EXP, &e2, 1, NULL, NULL, no);
  g->loss = ir_add(g, OP_SUM, &e3, 1, (int64_t[8]){0, 0}, NULL, no);
  g->fwd_end = g->n;
  Fusion *f = fuse(g, (FuseOptions){.fuse = false});
  MemPlan *m = f ? memplan(f) : NULL;
  CHECK(m && f->nsteps == 4 && m->activation_bytes == 128 && m->arena_bytes == 64 + 128 && m->offset[x] == 0 &&
            m->offset[e1] == m->offset[e3] && m->offset[e2] != m->offset[e1] && m->offset[g->loss] != m->offset[e3],
        "hand graph: unfused chain reuses memory (128 activation bytes)", "activations %lld, arena %lld",
        m ? (long long)m->activation_bytes : -1, m ? (long long)m->arena_bytes : -1);
  Fusion *fu = fuse(g, (FuseOptions){.fuse = true});
  MemPlan *mu = fu ? memplan(fu) : NULL;
  CHECK(mu && fu->nsteps == 1 && fu->steps[0].root == g->loss && mu->activation_bytes == 64 &&
            !strcmp(fu->steps[0].name, "k0_sum__exp"),
        "hand graph: fused chain is one reduction step (64 activation bytes)", "%d steps, activations %lld",
        fu ? fu->nsteps : -1, mu ? (long long)mu->activation_bytes : -1);
  arena_free(a);
}

// A [1,C] bias: its gradient is sum-over-rows then a RESHAPE; the reshape is a view, and the sum
// it views is computed straight into the gradient buffer.
static void gradient_view(void) {
  static const char text[] = "model gv\n"
                             "dim B in 1..64\n"
                             "input x: f32[B, 8]\n"
                             "input targets: i32[B]\n"
                             "param w: [8, 4] = normal(0.1)\n"
                             "param b: [1, 4] = zeros\n"
                             "output loss = mean(cross_entropy(x @ w + b, targets))\n"
                             "train {\n    B = 4\n}\n";
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "gv.mdl", text, NULL, 0);
  CHECK(g && autodiff(g, true), "gradient view: model compiles", "%s", g ? g->err : "front end failed");
  if (!g || !g->grads)
    return;
  int gb = g->grads[1];
  Fusion *f = fuse(g, (FuseOptions){.fuse = true});
  MemPlan *m = f ? memplan(f) : NULL;
  bool ok = m && g->nodes[gb]->op == OP_RESHAPE && is_view(f, gb);
  int base = ok ? base_of(f, gb) : -1;
  CHECK(ok && g->nodes[base]->op == OP_SUM &&
            m->offset[base] == m->grads + (m->offset[g->params[1]] - m->params),
        "gradient view: the bias gradient's sum lands in the gradient buffer", "grad %%%d (%s)", gb,
        op_name(g->nodes[gb]->op));
  if (f)
    check_invariants("gradient view", f);
  arena_free(a);
}

// A model that uses most ops (softmax, max, permute, concat, slices, dropout, rope, non-causal
// attention, unary math, a parameter that never reaches the loss, a broadcast [1,C] bias, a
// layernorm without bias): the invariants hold fused, unfused and with a small cap.
static void every_op(void) {
  static const char text[] = "model ops\n"
                             "dim B in 1..64\n"
                             "dim T = 8\n"
                             "dim C = 16\n"
                             "input x: f32[B, T, C]\n"
                             "input pos: i32[B, T]\n"
                             "input targets: i32[B, T]\n"
                             "param w: [C, C] = normal(0.1)\n"
                             "param g: [C] = ones\n"
                             "param u: [C] = zeros\n"
                             "param s: [1, C] = zeros\n"
                             "h = rmsnorm(x, g) @ w + s\n"
                             "a = softmax(h)\n"
                             "m = max(h, axis=-1, keepdim=true)\n"
                             "e = exp(h - m) / sum(exp(h - m), axis=-1, keepdim=true)\n"
                             "q = transpose(permute(e, [0, 2, 1]), 1, 2)\n"
                             "c = concat([q[:, :, 0:8], silu(a[:, :, 8:16])], axis=-1)\n"
                             "r = rope(dropout(c, p=0.1), pos, heads=2)\n"
                             "t = attention(r, r, tanh(r), heads=2)\n"
                             "z = log(sqrt(relu(t) + 1.0)) + rsqrt(h * h + 1.0) - neg(t)\n"
                             "z = z + mean(t, axis=1, keepdim=true)\n"
                             "output loss = mean(cross_entropy(layernorm(z, g), targets))\n"
                             "train {\n    B = 2\n}\n";
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "ops.mdl", text, NULL, 0);
  CHECK(g && autodiff(g, true), "every op: model compiles", "%s", g ? g->err : "front end failed");
  if (!g || !g->updates)
    return;
  const char *labels[] = {"every op (fused)", "every op (unfused)", "every op (max_group 3)"};
  FuseOptions opts[] = {{.fuse = true, .chunk_lmhead = true}, {.fuse = false}, {.fuse = true, .max_group = 3}};
  int steps[3] = {0};
  for (int k = 0; k < 3; k++) {
    Fusion *f = fuse(g, opts[k]);
    char name[64];
    snprintf(name, sizeof name, "%s: fuse succeeds", labels[k]);
    CHECK(f != NULL, name, "%s", g->err);
    if (f)
      check_invariants(labels[k], f);
    steps[k] = f ? f->nsteps : 0;
  }
  CHECK(steps[0] < steps[2] && steps[2] < steps[1], "every op: fused < capped < unfused step counts",
        "%d, %d, %d", steps[0], steps[2], steps[1]);
  arena_free(a);
}

// Elementwise min and max, integer arithmetic and casts fuse like the other elementwise ops: the
// integer chain over [B, T] (// % abs - * max, then float) is one kernel, and so is the chain over
// [B, T, C] that reads it (max, min, a comparison, where, int and float) when fused; unfused, each
// is a step of its own.
static void new_elementwise_ops(void) {
  static const char text[] = "model ew\ndim B = 2\ndim T = 8\ndim C = 16\n"
                             "input x: f32[B, T, C]\ninput pos: i32[B, T]\ninput targets: i32[B, T]\n"
                             "param w: [C, C] = normal(0.1)\n"
                             "k = reshape(float(max(pos // 3 % 2 - abs(pos - 2) * 2, -3)), [B, T, 1])\n"
                             "m = min(max(x, 0.5 * x), k) + where(x > 0.2, x, float(int(x * 4.0)))\n"
                             "output loss = mean(cross_entropy(x @ w + m, targets))\n";
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "ew.mdl", text, NULL, 0);
  CHECK(g && autodiff(g, true), "new elementwise ops: model compiles", "%s", g ? g->err : "front end failed");
  if (!g || !g->updates) {
    arena_free(a);
    return;
  }
  for (int fz = 1; fz >= 0; fz--) {
    Fusion *f = fuse(g, (FuseOptions){.fuse = fz, .chunk_lmhead = fz});
    const char *label = fz ? "new elementwise ops (fused)" : "new elementwise ops (unfused)";
    if (!f) {
      CHECK(false, label, "fuse failed: %s", g->err);
      continue;
    }
    check_invariants(label, f);
    int step[2] = {-1, -1}, members = 0, apart = 0, distinct = 0; // step[0]: the [B, T] chain's, [1]: [B, T, C]'s
    bool seen[4096] = {0};
    for (int i = 0; i < g->fwd_end && f->nsteps <= 4096; i++) {
      Op op = g->nodes[i]->op;
      if (op != OP_MAXIMUM && op != OP_MINIMUM && op != OP_FLOORDIV && op != OP_MOD && op != OP_CAST && op != OP_ABS &&
          op != OP_WHERE && op != OP_COMPARE)
        continue;
      int wide = shape_numel(g->nodes[i]->shape) > 16, si = f->step_of[i];
      step[wide] = step[wide] < 0 ? si : step[wide];
      apart += si != step[wide];
      distinct += si >= 0 && !seen[si];
      if (si >= 0)
        seen[si] = true;
      members++;
    }
    char name[160];
    snprintf(name, sizeof name, "%s: the %d min/max, integer, cast and where nodes are in %s", label, members,
             fz ? "one step per iteration space" : "steps of their own");
    CHECK(members == 11 && (fz ? apart == 0 && distinct == 2 && step[0] != step[1] : distinct == members), name,
          "%d members, %d apart from their chain's step, %d steps", members, apart, distinct);
  }
  arena_free(a);
}

typedef struct {
  const char *model;
  int fused, unfused;  // step-count ceilings
  int64_t activation;  // peak activation bytes ceiling (fused, LM head chunked)
} Ceiling;

// Ceilings at the train section's dims. A figure above its ceiling is a regression; more than 20%
// below means the ceiling is stale and should be lowered.
static const Ceiling ceilings[] = {
    {"gpt2-tiny", 60, 145, 4900000},
    {"llama-tiny", 80, 135, 5800000},
    {"mlp", 18, 47, 18500},
    {"moe-tiny", 115, 240, 7000000},
};

static void models(void) {
  DIR *d = opendir("models");
  CHECK(d != NULL, "models: directory opens", "no models/ (run from the repository root)");
  if (!d)
    return;
  struct dirent *de;
  int nmodels = 0, ceilings_seen = 0;
  while ((de = readdir(d))) {
    size_t len = strlen(de->d_name);
    if (len < 5 || strcmp(de->d_name + len - 4, ".mdl"))
      continue;
    char path[512], model[256], label[640];
    snprintf(path, sizeof path, "models/%s", de->d_name);
    snprintf(model, sizeof model, "%.*s", (int)(len - 4), de->d_name);
    Arena *a = arena_new();
    Graph *g = training_graph(a, path);
    snprintf(label, sizeof label, "%s: training graph builds", model);
    CHECK(g != NULL, label, "front end or autodiff failed");
    if (!g) {
      arena_free(a);
      continue;
    }
    nmodels++;
    FuseOptions opts[] = {{.fuse = true, .chunk_lmhead = true}, {.fuse = false}};
    Fusion *fs[2];
    for (int k = 0; k < 2; k++) {
      fs[k] = fuse(g, opts[k]);
      snprintf(label, sizeof label, "%s (%s)", model, k ? "unfused" : "fused");
      char name[700];
      snprintf(name, sizeof name, "%s: fuse succeeds", label);
      CHECK(fs[k] != NULL, name, "%s", g->err);
      if (fs[k])
        check_invariants(label, fs[k]);
    }
    if (!fs[0] || !fs[1]) {
      arena_free(a);
      continue;
    }
    bool singles = true;
    for (int s = 0; s < fs[1]->nsteps; s++)
      singles &= fs[1]->steps[s].nnodes == 1;
    snprintf(label, sizeof label, "%s: unfused is one node per step", model);
    CHECK(singles, label, "a multi-node step");
    MemPlan *m = memplan(fs[0]);
    snprintf(label, sizeof label, "%s: fusion on gives fewer steps (%d fused, %d unfused; %lld activation bytes)",
             model, fs[0]->nsteps, fs[1]->nsteps, (long long)m->activation_bytes);
    CHECK(fs[0]->nsteps < fs[1]->nsteps, label, "no fewer steps");
    for (size_t i = 0; i < sizeof ceilings / sizeof *ceilings; i++) {
      const Ceiling *c = &ceilings[i];
      if (strcmp(c->model, model))
        continue;
      ceilings_seen++;
      struct {
        const char *what;
        double got, ceiling;
      } fig[] = {{"fused steps", fs[0]->nsteps, c->fused},
                 {"unfused steps", fs[1]->nsteps, c->unfused},
                 {"activation bytes", (double)m->activation_bytes, (double)c->activation}};
      for (int k = 0; k < 3; k++) {
        snprintf(label, sizeof label, "%s: %s %.0f within [80%%, 100%%] of ceiling %.0f", model, fig[k].what,
                 fig[k].got, fig[k].ceiling);
        CHECK(fig[k].got <= fig[k].ceiling && fig[k].got >= 0.8 * fig[k].ceiling, label,
              fig[k].got > fig[k].ceiling ? "above the ceiling" : "more than 20%% below: lower the ceiling");
      }
    }
    arena_free(a);
  }
  closedir(d);
  CHECK(nmodels >= 4 && ceilings_seen == 4, "models: every model checked, every ceiling used",
        "%d models, %d ceilings", nmodels, ceilings_seen);
}

// models/gpt2-tiny.mdl with its attention line written `copies` times in the repeat body, as the
// training graph, its GEMMs' operands in bf16 when bf16.
static Graph *many_attentions(Arena *a, int copies, bool bf16) {
  FILE *in = fopen("models/gpt2-tiny.mdl", "r");
  char *text = NULL, line[512];
  size_t len = 0;
  FILE *out = open_memstream(&text, &len);
  while (in && fgets(line, sizeof line, in))
    for (int i = 0; i < (strstr(line, "attention(") ? copies : 1); i++)
      fputs(line, out);
  fclose(out);
  if (in)
    fclose(in);
  Graph *g = mdl_compile_text(a, "many.mdl", text, NULL, 0);
  free(text);
  char why[256];
  return g && autodiff(g, true) && precision_assign(g, bf16 ? DT_BF16 : DT_F32, why, sizeof why) ? g : NULL;
}

// The gradient of q, k and v in a body with 16 attention lines is a sum of 16 values each, which
// one kernel would read from 48 buffers (the CUDA back end passes a kernel 48): no step but the
// optimizer's addresses more than FUSE_MAX_BUFFERS, the sums are cut with a reason, and the plan is
// sound.
static void buffer_cap(void) {
  for (int bf16 = 0; bf16 < 2; bf16++) {
    Arena *a = arena_new();
    Graph *g = many_attentions(a, 16, bf16);
    Fusion *f = g ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true, .max_group = 64}) : NULL;
    int most = 0, cut = 0;
    const char *widest = "";
    for (int s = 0; f && s < f->nsteps; s++) {
      const Step *st = &f->steps[s];
      int n = st->nouts;
      for (int k = 0; k < st->nins; k++)
        n += !contains(st->outs, st->nouts, st->ins[k]);
      if (st->kind != STEP_OPTIMIZER && n > most)
        most = n, widest = st->name;
    }
    for (int i = 0; f && i < f->nrejected; i++)
      cut += strstr(f->rejected[i].reason, "buffer cap") != NULL;
    char name[128];
    snprintf(name, sizeof name, "buffer cap: 16 attention lines (%s): every kernel within %d buffers, the sums cut",
             bf16 ? "bf16" : "fp32", FUSE_MAX_BUFFERS);
    CHECK(f && most <= FUSE_MAX_BUFFERS && most > 20 && cut >= 3, name, "%d buffers in %s, %d cut", most, widest, cut);
    if (f)
      check_invariants(bf16 ? "16 attention lines (bf16)" : "16 attention lines", f);
    arena_free(a);
  }
}

int main(void) {
  buffer_cap();
  recompute_rule();
  cycle_rule();
  reduction_rule();
  copies_rule();
  memplan_by_hand();
  gradient_view();
  every_op();
  new_elementwise_ops();
  gpt2_rules();
  models();
  TEST_EXIT();
}
