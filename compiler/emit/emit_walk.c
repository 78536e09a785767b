// emit_walk.c: the emitters' walker: a step plan's steps, their passes and groups, the inline
// evaluator's walk, elementwise loops' grouping and the parts of reductions every target shares,
// calling the target through its EmitTarget. See emit_walk.h, and emit_c.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"

#include <stdlib.h>
#include <string.h>

//
// The emission.
//

void ew_open(EmitCore *e, const EmitTarget *t, const Fusion *f, const MemPlan *m) {
  size_t n = (size_t)f->g->n;
  *e = (EmitCore){.target = t, .f = f, .m = m, .g = f->g, .a = arena_new(), .val = ew_val, .seed = t->seed,
                  .base = t->base, .fp8_cast = t->fp8_cast, .concat_values = t->concat_values,
                  .ixt = "int64_t"};
  e->in_step = ec_xcalloc(n, sizeof *e->in_step);
  e->grp = ec_xcalloc(n, sizeof *e->grp);
  e->spill = ec_xcalloc(n, sizeof *e->spill);
  e->post_bad = ec_xcalloc(n, sizeof *e->post_bad);
  e->written = ec_xcalloc(n, sizeof *e->written);
  e->scratch = ec_xcalloc(n, sizeof *e->scratch);
  e->stored = ec_xcalloc(n, sizeof *e->stored);
  e->host = ec_xcalloc(n, sizeof *e->host);
  e->phase_nodes = ec_xcalloc(n, sizeof *e->phase_nodes);
  e->pending = ec_xcalloc(n, sizeof *e->pending);
  for (size_t i = 0; i < n; i++)
    e->grp[i] = -1;
}

void ew_close(EmitCore *e) {
  free(e->body.s);
  free(e->memo);
  free(e->ixm);
  free(e->in_step);
  free(e->grp);
  free(e->spill);
  free(e->post_bad);
  free(e->written);
  free(e->scratch);
  free(e->stored);
  free(e->host);
  free(e->phase_nodes);
  free(e->pending);
  arena_free(e->a);
}

const char *ew_kernel_name(EmitCore *e, const char *name, int si, const char **names) {
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

void ew_step_head(EmitCore *e, Buf *b, const char *name) {
  const Step *st = &e->f->steps[e->si];
  ec_bput(b, "\n// %s: %s, %d op%s\n", name, ec_kind_name(st->kind), st->nnodes, st->nnodes == 1 ? "" : "s");
  for (int j = 0; j < st->nnodes; j++) {
    const IrNode *nd = ec_node(e, st->nodes[j]);
    char buf[128];
    ec_bput(b, "//   %%%-5d %-18s %-20s %-10s %s%s\n", nd->id, op_name(nd->op), nd->name ? nd->name : "",
            nd->loc.line ? ec_str(e, "line %d", nd->loc.line) : "", dtype_name(nd->dtype),
            shape_str(nd->shape, buf, sizeof buf));
  }
}

//
// Steps: passes over the groups.
//

EmitKernel ew_kernel_of(EmitCore *e, int gi) {
  const Group *gr = &e->groups[gi];
  switch (gr->kind) {
  case G_NORM_BWD: return EK_NORM_BWD;
  case G_ATTN: return EK_ATTENTION;
  case G_ATTN_BWD: return EK_ATTENTION_BWD;
  case G_CE: return EK_CE;
  case G_LMHEAD: return EK_LMHEAD;
  case G_OPT: return EK_OPTIMIZER;
  case G_SINGLE: break;
  }
  switch (ec_node(e, gr->mem[0])->op) {
  case OP_MATMUL: return EK_GEMM;
  case OP_SUM: case OP_MEAN: case OP_MAX: case OP_TARGET_COUNT: return EK_REDUCE;
  case OP_LAYERNORM: case OP_RMSNORM: return EK_NORM_FWD;
  case OP_SOFTMAX: case OP_SOFTMAX_BWD: return EK_SOFTMAX;
  case OP_EMBED: return EK_EMBED;
  case OP_EMBED_BWD: return EK_EMBED_BWD;
  case OP_ROPE: return EK_ROPE;
  case OP_MAX_BWD: return EK_MAX_BWD;
  case OP_TOPK: return EK_TOPK;
  case OP_GATHER: return EK_GATHER;
  case OP_GATHER_BWD: case OP_SCATTER_ADD: return EK_SCATTER;
  case OP_ATTENTION_MASK: return EK_ATTN_MASK;
  default: return EK_COUNT;
  }
}

static void pass_reset(EmitCore *e) {
  size_t n = (size_t)e->g->n;
  memset(e->written, 0, n * sizeof *e->written);
  memset(e->scratch, 0, n * sizeof *e->scratch);
  memset(e->stored, 0, n * sizeof *e->stored);
  for (size_t i = 0; i < n; i++)
    e->host[i] = -1;
  e->body.len = 0;
  e->nmemo = e->nixm = e->npending = e->nphase = 0;
  e->indent = 1;
  e->depth = 0;
  e->fresh = 0;
  e->loop_ix = NULL;
  e->post_anchor = e->cur_q = -1;
  e->post_inloop = false;
  e->flagged = false;
  e->target->pass_reset(e);
}

static void step_body(EmitCore *e) {
  const Step *st = &e->f->steps[e->si];
  bool *emitted = ec_xcalloc((size_t)e->ngroups + 1, sizeof *emitted);
  e->emitted = emitted;
  for (int k = 0; k < e->ngroups && !e->failed; k++) {
    int gi = e->order[k];
    EmitKernel kind = ew_kernel_of(e, gi);
    if (kind == EK_COUNT)
      ec_fail(e, "no kernel for %s", op_name(ec_node(e, e->groups[gi].mem[0])->op));
    else
      e->target->kernel[kind](e, gi);
    emitted[gi] = true;
  }
  e->emitted = NULL;
  free(emitted);
  int *rest = ec_xcalloc((size_t)st->nnodes + 1, sizeof *rest), nrest = ec_unwritten(e, rest);
  if (nrest)
    ew_pw_loops(e, rest, nrest, -1, e->ngroups ? "rest" : "");
  free(rest);
  ec_check_written(e);
}

bool ew_step(EmitCore *e, int si) {
  const Step *st = &e->f->steps[si];
  e->si = si;
  int64_t most = 0;
  for (int k = 0; k < st->nnodes; k++) {
    const IrNode *nd = ec_node(e, st->nodes[k]);
    e->in_step[st->nodes[k]] = !ec_is_leaf(nd->op);
    most = ec_numel(e, nd->id) > most ? ec_numel(e, nd->id) : most;
    for (int j = 0; j < nd->nin; j++)
      most = ec_numel(e, nd->in[j]) > most ? ec_numel(e, nd->in[j]) : most;
  }
  if (e->target->narrow_ix)
    e->ixt = most < (int64_t)1 << 30 ? "int" : "int64_t";
  memset(e->spill, 0, sizeof *e->spill * (size_t)e->g->n);
  memset(e->post_bad, 0, sizeof *e->post_bad * (size_t)e->g->n);
  bool ok = ec_groups_order(e);
  for (int pass = 0; ok && pass < 32; pass++) {
    pass_reset(e);
    step_body(e);
    if (e->failed || !e->flagged)
      break;
  }
  if (!e->failed && e->flagged)
    ec_fail(e, "step %s: the layout of its values did not settle", st->name);
  for (int k = 0; k < st->nnodes; k++) {
    e->in_step[st->nodes[k]] = false;
    e->grp[st->nodes[k]] = -1;
  }
  return !e->failed;
}

//
// The inline evaluator.
//

// Reading node c at ix from memory: records reads that the chosen layout must allow.
static void note_read(EmitCore *e, int c, const char *ix) {
  bool at_post = e->post_anchor == c && strcmp(ix, e->post_ix) == 0;
  if (e->in_step[c] && e->grp[c] >= 0 && !at_post && ec_offset(e, c) < 0)
    ec_flag(e, e->spill, c);
}

// Stores c's value v at ix, once in the current phase.
static void store_once(EmitCore *e, int c, const char *ix, const char *v) {
  e->target->store(e, c, ix, v);
  e->stored[c] = true;
  e->phase_nodes[e->nphase++] = c;
}

const char *ew_val(EmitCore *e, int n, const char *ix) {
  const EmitTarget *t = e->target;
  int c = ec_canon(e, n);
  const IrNode *nd = ec_node(e, c);
  if (nd->op == OP_CONST)
    return nd->dtype == DT_I32 ? ec_ilit(e, nd->fa[0]) : ec_flit(e, nd->fa[0]);
  if (ec_numel(e, c) == 1)
    ix = "0";
  const char *hit = ec_memo_get(e, c, ix);
  if (hit)
    return hit;
  const char *name = t->local(e, c, ix), *lane = NULL;
  if (ec_in_memory(e, c)) {
    note_read(e, c, ix);
    if (t->lanes && (lane = t->lanes(e, c, ix)))
      name = lane;
    else
      ec_line(e, "const %s %s = %s;", ec_ctype(e, c), name, ec_load(e, c, ec_str(e, "%s[%s]", t->base(e, c), ix)));
  } else if (e->in_step[c] && t->lanes && (lane = t->lanes(e, c, ix))) {
    name = lane;
  } else if (e->in_step[c] && ec_is_pointwise(nd->op)) {
    const char *expr = ec_pointwise_expr(e, c, ix);
    ec_line(e, "const %s %s = %s;", ec_ctype(e, c), name, expr);
    bool own = e->loop_ix && ec_numel(e, c) == e->loop_n && (strcmp(ix, e->loop_ix) == 0 || e->loop_n == 1);
    if (ec_has_target(e, c) && !e->stored[c] && own)
      store_once(e, c, ix, name);
  } else if (e->in_step[c] && e->grp[c] >= 0) {
    // An anchor of this step that is not in memory (yet): read inside its own loop at another index,
    // or after it while only a local or a row of it existed. Flag it; the next pass lays it out.
    if (e->post_inloop && e->post_anchor == c && e->cur_q >= 0)
      ec_flag(e, e->post_bad, e->cur_q);
    else
      ec_flag(e, e->spill, c);
    return "0.0f";
  } else {
    ec_fail(e, "step %s reads node %d (%s), which no earlier step wrote", e->f->steps[e->si].name, c, op_name(nd->op));
    return "0";
  }
  ec_memo_put(e, c, ix, name);
  return name;
}

void ew_pw_values(EmitCore *e, const int *nodes, int k, const char *ix) {
  for (int t = 0; t < k; t++) {
    e->cur_q = nodes[t];
    const char *v = ew_val(e, nodes[t], ix);
    if (!e->stored[nodes[t]])
      store_once(e, nodes[t], ix, v);
  }
}

void ew_pw_loops(EmitCore *e, const int *nodes, int k, int post_anchor, const char *role) {
  bool *done = ec_xcalloc((size_t)k, sizeof *done);
  int *same = ec_xcalloc((size_t)k, sizeof *same);
  for (int t = 0; t < k; t++) {
    if (done[t])
      continue;
    int ns = 0;
    for (int u = t; u < k; u++)
      if (!done[u] && ec_numel(e, nodes[u]) == ec_numel(e, nodes[t])) {
        same[ns++] = nodes[u];
        done[u] = true;
      }
    e->target->pw_loop(e, same, ns, ec_numel(e, nodes[t]), post_anchor, role);
  }
  free(done);
  free(same);
}

void ew_flush(EmitCore *e) {
  if (e->npending)
    ew_pw_loops(e, e->pending, e->npending, -1, "prep");
  e->npending = 0;
}

void ew_post_inloop(EmitCore *e, int anchor, const int *q, int nq, const char *ix, int64_t n, const char *y) {
  e->loop_ix = ix;
  e->loop_n = n;
  e->post_anchor = anchor;
  e->post_ix = ix;
  e->post_inloop = true;
  ec_memo_put(e, anchor, ec_numel(e, anchor) == 1 ? "0" : ix, y);
  for (int t = 0; t < nq; t++) {
    e->cur_q = q[t];
    ew_val(e, q[t], ix);
  }
  e->post_anchor = -1;
  e->post_inloop = false;
  e->cur_q = -1;
}

bool ew_whole(EmitCore *e, int a) {
  if (ec_offset(e, a) >= 0)
    return true;
  if (e->spill[a]) {
    e->scratch[a] = true;
    return true;
  }
  return false;
}

//
// What the kernel families of every target share.
//

void ew_outputs_open(EmitCore *e, const int *outs, int n) {
  ew_flush(e);
  for (int i = 0; i < n; i++)
    if (outs[i] >= 0 && ec_offset(e, outs[i]) < 0)
      e->scratch[outs[i]] = true;
  ec_phase_begin(e);
}

void ew_outputs_done(EmitCore *e, const int *outs, int n) {
  for (int i = 0; i < n; i++)
    if (outs[i] >= 0)
      ec_phase_done(e, outs[i]);
  ec_phase_end(e);
}

void ew_anchor_open(EmitCore *e, int a) { ew_outputs_open(e, &a, 1); }

void ew_gemm_shape(EmitCore *e, int gi, EwGemm *g) {
  const IrNode *nd = ec_node(e, e->groups[gi].mem[0]);
  Shape sa = ec_node(e, nd->in[0])->shape, so = nd->shape;
  *g = (EwGemm){.mm = nd->id, .nd = nd, .sa = sa, .sb = ec_node(e, nd->in[1])->shape, .so = so, .ta = nd->ia[0],
                .tb = nd->ia[1], .m = so.d[so.rank - 2], .n = so.d[so.rank - 1],
                .k = nd->ia[0] ? sa.d[sa.rank - 2] : sa.d[sa.rank - 1], .batches = ec_span(so, 0, so.rank - 2)};
}

void ew_gemm_place(EmitCore *e, int mm, const int *q, int nq) {
  if (ec_offset(e, mm) >= 0)
    return;
  for (int t = 0; t < nq && !e->spill[mm] && e->host[mm] < 0; t++)
    if (ec_offset(e, q[t]) >= 0 && ec_node(e, q[t])->dtype == DT_F32)
      e->host[mm] = q[t];
  if (e->host[mm] < 0)
    e->scratch[mm] = true;
}

void ew_opt_open(EmitCore *e, int gi) {
  const Group *gr = &e->groups[gi];
  for (int i = 0; i < gr->nmem; i++)
    if (ec_node(e, gr->mem[i])->op == OP_GRAD_NORM) {
      const IrNode *nd = ec_node(e, gr->mem[i]);
      for (int k = 0; k < nd->nin; k++)
        ec_need(e, nd->in[k]);
    }
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = ec_node(e, gr->mem[i]);
    if (nd->op != OP_ADAMW)
      continue;
    for (int k = 1; k < nd->nin; k++)
      if (nd->in[k] != opt_gnorm(nd) || e->grp[ec_canon(e, opt_gnorm(nd))] != gi)
        ec_need(e, nd->in[k]);
  }
  ew_flush(e);
  ec_phase_begin(e);
}

int ew_opt_segments(EmitCore *e, int gi, int i, bool *done, int *seg, int64_t *total) {
  const Group *gr = &e->groups[gi];
  const IrNode *a = ec_node(e, gr->mem[i]);
  int ns = 0;
  *total = 0;
  for (int j = i; j < gr->nmem; j++) {
    const IrNode *b = ec_node(e, gr->mem[j]);
    if (done[j] || b->op != OP_ADAMW || b->ia[0] != a->ia[0] || b->nin != a->nin ||
        memcmp(a->fa, b->fa, sizeof(double) * 3) || a->fa[4] != b->fa[4])
      continue;
    bool same = true;
    for (int k = a->nin - 3; k < a->nin; k++)
      same &= ec_canon(e, a->in[k]) == ec_canon(e, b->in[k]);
    if (!same)
      continue;
    done[j] = true;
    seg[ns++] = gr->mem[j];
    *total += ec_numel(e, gr->mem[j]);
  }
  return ns;
}

const char *ew_opt_hyper(EmitCore *e, const IrNode *a) {
  switch ((OptRule)a->ia[0]) {
  case OPT_SGD: return ec_str(e, "momentum %g%s", a->fa[0], a->fa[1] != 0 ? ", Nesterov" : "");
  case OPT_LION: return ec_str(e, "beta1 %g, beta2 %g", a->fa[0], a->fa[1]);
  case OPT_MUON: return ec_str(e, "momentum %g", a->fa[0]);
  default: return ec_str(e, "beta1 %g, beta2 %g, eps %g", a->fa[0], a->fa[1], a->fa[2]);
  }
}

//
// Reductions.
//

void ew_reduce_open(EmitCore *e, int gi, EwReduce *r) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = ec_node(e, a);
  Shape s = ec_node(e, nd->in[0])->shape;
  if (nd->op == OP_TARGET_COUNT) // (over every target)
    s = (Shape){.rank = 1, .d = {ec_numel(e, nd->in[0])}};
  int ax = (int)nd->ia[0];
  *r = (EwReduce){.a = a, .x = nd->in[0], .nd = nd, .outer = ec_span(s, 0, ax), .len = s.d[ax],
                  .inner = ec_span(s, ax + 1, s.rank), .max = nd->op == OP_MAX, .buf = ew_whole(e, a)};
  r->on = r->outer * r->inner;
  r->q = ec_xcalloc((size_t)e->g->n, sizeof *r->q);
  r->nq = ec_post_set(e, gi, r->on, e->emitted, r->q);
  r->side = ec_xcalloc((size_t)e->g->n, sizeof *r->side);
  r->nside = ec_side_set(e, gi, ec_numel(e, r->x), e->emitted, r->side);
  r->acc_t = r->max ? "float" : "double";
  ec_phase_begin(e);
}

void ew_reduce_finish(EmitCore *e, const EwReduce *r) {
  if (r->nd->op == OP_MEAN)
    ec_line(e, "const float y = (float)(acc / %lld);", (long long)r->len);
  else if (r->nd->op == OP_TARGET_COUNT)
    ec_line(e, "const float y = (float)(acc > 1.0 ? acc : 1.0);");
  else
    ec_line(e, "const float y = (float)acc;");
  if (r->buf)
    ec_line(e, "%s[r] = y;", e->target->base(e, r->a));
  ew_post_inloop(e, r->a, r->q, r->nq, "r", ec_numel(e, r->a), "y");
}

void ew_reduce_close(EwReduce *r) {
  free(r->q);
  free(r->side);
}
