// engine.c: one training step on any back end, behind one struct of hooks (Engine). The training
// loop, `mdlc grad` and the tests talk to an Engine and never ask which back end is behind it.
//   interp: the reference interpreter (fp32 or fp64), op by op;
//   cpu:    the plan fused, emitted as C, compiled with cc, cached and dlopen'd.
#include "backend.h"
#include "fp8_state.h"
#include "runtime.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

//
// Initial parameters, drawn when first needed.
//
void param_draw_init(ParamDraw *d, const Graph *g, uint64_t seed) {
  *d = (ParamDraw){.seed = seed, .pending = xmalloc((size_t)g->nparams, "the parameters' draw"),
                   .left = g->nparams};
  memset(d->pending, 1, (size_t)g->nparams);
}

void param_draw_written(ParamDraw *d, const Graph *g, int node) {
  for (int k = 0; d->left && k < g->nparams; k++)
    if (g->params[k] == node && d->pending[k]) {
      d->pending[k] = false;
      d->left--;
    }
}

void param_draw_all_written(ParamDraw *d) { d->left = 0; } // (pending is read only while left > 0)

bool param_draw_now(ParamDraw *d, bool (*draw)(void *ctx, int k), void *ctx) {
  for (int k = 0; d->left; k++)
    if (d->pending[k]) {
      if (!draw(ctx, k))
        return false;
      d->pending[k] = false;
      d->left--;
    }
  return true;
}

void param_draw_free(ParamDraw *d) { free(d->pending); }

//
// Precision fp8's step (delayed scaling, fp8_state.h's Fp8State), the same for every CPU engine.
//
// Engine.set_fp8_amax's and set_fp8_lead's settings.
typedef struct {
  bool (*fn)(void *ctx, float *amax, int n, char *err, size_t en);
  void *ctx;
  const float *lead; // a micro-batch's pass: the step engine's scales
} Fp8Share;

// One engine's step in precision fp8: run(ctx, from, to, comm, ...) runs its kernels (or nodes)
// [from, to), whose casts raise st->amax, and with comm the gradients' all-reduce among them;
// split is where the optimizer starts (the gradients are final before it), end the step's end;
// poison makes a gradient the optimizer reads NaN (NULL: the step's own gradient norm does).
typedef struct {
  const Graph *g;
  Fp8State *st;
  int split, end;
  bool (*run)(void *ctx, int from, int to, bool comm, char *err, size_t n);
  void (*poison)(void *ctx);
  void *ctx;
} Fp8Step;

// The step's amaxes recorded from zero by the part before the optimizer, raised by Fp8Share.fn to the
// step's (over the ranks, over its micro-batches), then checked: a non-finite one poisons the
// gradients, so that the optimizer skips the step as it skips any non-finite gradient (the runtime
// then names the tensor), and the histories do not roll; else they roll and the scales follow. With
// no history yet (the first step) that part runs once more beforehand with every scale 1, to record
// the amaxes and set the scales from them (calibration); the ranks' are reduced there too, so that
// every rank calibrates alike. A micro-batch's pass (Fp8Share.lead) casts with the step engine's
// scales and only records.
static bool fp8_step(const Fp8Step *s, const Fp8Share *sh, char *err, size_t n) {
  Fp8State *st = s->st;
  char why[8];
  memset(st->amax, 0, sizeof(float) * (size_t)st->n);
  if (sh->lead) {
    memcpy(st->scale, sh->lead, sizeof(float) * (size_t)st->n);
    return s->run(s->ctx, 0, s->end, true, err, n);
  }
  if (!st->recorded) {
    if (!s->run(s->ctx, 0, s->split, false, err, n) || (sh->fn && !sh->fn(sh->ctx, st->amax, st->n, err, n)))
      return false;
    if (fp8_state_update(st, s->g, why, sizeof why)) // (else the amaxes stay, and the step is skipped)
      memset(st->amax, 0, sizeof(float) * (size_t)st->n);
  }
  if (!s->run(s->ctx, 0, s->split, true, err, n) || (sh->fn && !sh->fn(sh->ctx, st->amax, st->n, err, n)))
    return false;
  bool bad = fp8_state_check(st, s->g, why, sizeof why);
  if (bad && s->poison)
    s->poison(s->ctx);
  if (!s->run(s->ctx, s->split, s->end, true, err, n))
    return false;
  if (!bad)
    fp8_state_update(st, s->g, why, sizeof why);
  return true;
}

//
// The reference interpreter.
//
typedef struct {
  Engine e;
  Interp *it;
  ParamDraw draw;
  // Engine.set_reduce (one call per gradient, before the gradient norm: the interpreter has no
  // buckets), and where the step is cut for it and for fp8's amaxes: the gradient norm's node
  int split;
  bool (*reduce)(void *ctx, float *x, int64_t n, char *err, size_t en);
  void *reduce_ctx;
  int *reduced, nreduced; // the nodes made the mean over the ranks: the norm's inputs and what they view
  float *buf;
  Fp8Share share;
} InterpEngine;

static bool ie_draw(void *ctx, int k) {
  InterpEngine *ie = ctx;
  interp_init_param(ie->it, ie->draw.seed, k);
  return true;
}

static bool ie_draw_params(Engine *e, char *err, size_t n) {
  (void)err, (void)n; // (the draw cannot fail)
  return param_draw_now(&((InterpEngine *)e)->draw, ie_draw, e);
}

static bool ie_set_input(Engine *e, const char *name, const int32_t *ids, const float *f, int64_t n) {
  return interp_set_input(((InterpEngine *)e)->it, name, ids, f, n);
}

static void ie_set_scalar(Engine *e, const char *name, double v) { interp_set_scalar(((InterpEngine *)e)->it, name, v); }

static void ie_set_seed(Engine *e, uint64_t seed) { interp_set_seed(((InterpEngine *)e)->it, seed); }

// The gradients (in the interpreter's doubles, f32 values in INTERP_F32) made the mean over the ranks.
static bool ie_reduce(InterpEngine *ie, char *err, size_t n) {
  double t0 = rt_now();
  for (int k = 0; k < ie->nreduced; k++) {
    int node = ie->reduced[k];
    double *v = interp_param(ie->it, node); // (any node's values, writable)
    int64_t count = interp_numel(ie->it, node);
    for (int64_t i = 0; i < count; i++)
      ie->buf[i] = (float)v[i];
    if (!ie->reduce(ie->reduce_ctx, ie->buf, count, err, n))
      return false;
    for (int64_t i = 0; i < count; i++)
      v[i] = ie->buf[i];
  }
  ie->e.reduce_seconds = rt_now() - t0;
  return true;
}

// Fp8Step.run: nodes [from, to), the gradients reduced first where they start at the cut.
static bool ie_run(void *ctx, int from, int to, bool comm, char *err, size_t n) {
  InterpEngine *ie = ctx;
  if (comm && ie->reduce && from == ie->split && from < to && !ie_reduce(ie, err, n))
    return false;
  return interp_run_nodes(ie->it, from, to, err, n);
}

static bool ie_step(Engine *e, char *err, size_t n) {
  InterpEngine *ie = (InterpEngine *)e;
  ie_draw_params(e, err, n);
  if (e->g->nfp8) {
    Fp8Step s = {e->g, interp_fp8(ie->it), ie->split, e->g->n, ie_run, NULL, ie};
    return fp8_step(&s, &ie->share, err, n);
  }
  if (!ie->reduce)
    return interp_run(ie->it, e->g->n, err, n);
  return ie_run(ie, 0, ie->split, true, err, n) && ie_run(ie, ie->split, e->g->n, true, err, n);
}

// Engine.set_reduce: the gradient norm's inputs, and the nodes they are views of (each holds its own
// copy here), each its own all-reduce; bucket and overlap do not apply.
static bool ie_set_reduce(Engine *e, bool (*fn)(void *ctx, float *x, int64_t n, char *err, size_t en), void *ctx,
                          int64_t bucket, bool overlap) {
  (void)bucket, (void)overlap;
  InterpEngine *ie = (InterpEngine *)e;
  const Graph *g = e->g;
  free(ie->reduced);
  free(ie->buf);
  ie->reduced = NULL, ie->buf = NULL, ie->nreduced = 0, ie->reduce = NULL;
  if (!fn)
    return true;
  if (ie->split >= g->n || g->nodes[ie->split]->op != OP_GRAD_NORM)
    return false;
  const IrNode *norm = g->nodes[ie->split];
  int64_t most = 1;
  ie->reduced = rt_xrealloc(NULL, sizeof(int) * (size_t)g->n);
  for (int i = 0; i < norm->nin; i++)
    for (int x = norm->in[i];; x = g->nodes[x]->in[0]) {
      bool seen = false;
      for (int k = 0; k < ie->nreduced && !seen; k++)
        seen = ie->reduced[k] == x;
      if (!seen) {
        ie->reduced[ie->nreduced++] = x;
        most = interp_numel(ie->it, x) > most ? interp_numel(ie->it, x) : most;
      }
      if (g->nodes[x]->op != OP_RESHAPE)
        break;
    }
  ie->buf = rt_xrealloc(NULL, sizeof(float) * (size_t)most);
  ie->reduce = fn;
  ie->reduce_ctx = ctx;
  return true;
}

// PARAM and STATE nodes live in the interpreter's persistent storage; others are step values.
static const double *ie_values(InterpEngine *ie, int node) {
  Op op = ie->e.g->nodes[node]->op;
  return op == OP_PARAM || op == OP_STATE ? interp_param(ie->it, node) : interp_value(ie->it, node);
}

static void ie_read(Engine *e, int node, float *dst) {
  ie_draw_params(e, NULL, 0);
  const double *v = ie_values((InterpEngine *)e, node);
  int64_t n = shape_numel(e->g->nodes[node]->shape);
  for (int64_t i = 0; i < n; i++)
    dst[i] = (float)v[i];
}

static void ie_write(Engine *e, int node, const float *src) {
  double *v = interp_param(((InterpEngine *)e)->it, node);
  int64_t n = shape_numel(e->g->nodes[node]->shape);
  for (int64_t i = 0; i < n; i++)
    v[i] = src[i];
  param_draw_written(&((InterpEngine *)e)->draw, e->g, node);
}

static Fp8State *ie_fp8(Engine *e) { return interp_fp8(((InterpEngine *)e)->it); }

static void ie_set_fp8_amax(Engine *e, bool (*fn)(void *ctx, float *amax, int n, char *err, size_t en), void *ctx) {
  ((InterpEngine *)e)->share.fn = fn, ((InterpEngine *)e)->share.ctx = ctx;
}

static void ie_set_fp8_lead(Engine *e, const float *scale) { ((InterpEngine *)e)->share.lead = scale; }

static void ie_free(Engine *e) {
  InterpEngine *ie = (InterpEngine *)e;
  free(ie->reduced);
  free(ie->buf);
  interp_free(((InterpEngine *)e)->it);
  param_draw_free(&((InterpEngine *)e)->draw);
  free(e);
}

Engine *engine_interp(const Graph *g, InterpPrecision prec, uint64_t seed) {
  InterpEngine *ie = xcalloc(1, sizeof *ie, "the interpreter");
  ie->it = interp_new(g, prec);
  interp_set_seed(ie->it, seed);
  param_draw_init(&ie->draw, g, seed);
  ie->split = g->n; // (the gradient norm's node, which the optimizer's nodes follow, else the first of these)
  for (int i = g->n - 1; i >= 0; i--)
    ie->split = g->nodes[i]->op == OP_GRAD_NORM || g->nodes[i]->op == OP_ADAMW ? i : ie->split;
  ie->e = (Engine){.name = prec == INTERP_F64 ? "interp (fp64)" : "interp (fp32)", .g = g,
                   .set_input = ie_set_input, .set_scalar = ie_set_scalar, .set_seed = ie_set_seed, .step = ie_step,
                   .read = ie_read, .write = ie_write, .draw_params = ie_draw_params, .free = ie_free,
                   .set_reduce = ie_set_reduce, .fp8 = g->nfp8 ? ie_fp8 : NULL,
                   .set_fp8_amax = g->nfp8 ? ie_set_fp8_amax : NULL, .set_fp8_lead = g->nfp8 ? ie_set_fp8_lead : NULL};
  return &ie->e;
}

//
// The compiled CPU back end.
//
typedef struct {
  Engine e;
  const MemPlan *m;
  CpuModule *cm;
  char *arena;
  ParamDraw draw;
  // Engine.set_reduce: the function, its context, and the first kernel of the optimizer (the
  // gradients are final before it)
  bool (*reduce)(void *ctx, float *x, int64_t n, char *err, size_t en);
  void *reduce_ctx;
  GradRange *ranges; // the gradients the optimizer reads, each reduced before its step
  int nranges;
  // Engine.set_shard: the ranks' shares of the parameters, their copies and the moments (floats),
  // and the all-gather of the first two after each step
  bool (*gather)(void *ctx, float *x, const int64_t *at, char *err, size_t en);
  void *gather_ctx;
  int rank, nranks;
  int64_t *at; // params, copies, m, v: nranks + 1 each
  // Engine.gather_moments: where the other ranks' m and v lie until the next step (the gradients'
  // buffer, the activations' or moved_v, laid out as m and v), or NULL
  char *moved_m, *moved_v;
  float *own_v; // moved_v when it is a buffer of its own
  // With overlap (set_reduce's), a thread of its own reduces each bucket once the kernel
  // that makes it final has run, while the next kernels run; a kernel that reads one waits for it.
  struct {
    bool started, quit, failed;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int *queue;     // the buckets (indices into ranges) in the order they became final this step
    int queued, taken;
    bool *done;     // per bucket: reduced this step
    char err[512];  // the first failure's message
  } comm;
  // precision fp8: the scaling state, the threads' amaxes the module records (MdlHooks), the
  // optimizer's first kernel and the arena offset of a gradient it reads (ce_step_fp8)
  Fp8State fp8;
  float *amax;
  int opt_kernel;
  int64_t poison;
  Fp8Share share;
} CpuEngine;

static bool cpe_draw(void *ctx, int k) {
  CpuEngine *ce = ctx;
  cpu_init_param(ce->e.g, ce->m, ce->arena, ce->draw.seed, k);
  return true;
}

static bool cpe_draw_params(Engine *e, char *err, size_t n) {
  (void)err, (void)n; // (the draw cannot fail)
  return param_draw_now(&((CpuEngine *)e)->draw, cpe_draw, e);
}

static bool ce_set_input(Engine *e, const char *name, const int32_t *ids, const float *f, int64_t n) {
  CpuEngine *ce = (CpuEngine *)e;
  return cpu_set_input(e->g, ce->m, ce->arena, name, ids, f, n);
}

static void ce_set_scalar(Engine *e, const char *name, double v) {
  CpuEngine *ce = (CpuEngine *)e;
  cpu_set_scalar(e->g, ce->m, ce->arena, name, v);
}

static void ce_set_seed(Engine *e, uint64_t seed) { ((CpuEngine *)e)->cm->hooks.seed = seed; }

// Engine.set_reduce's call before kernel i: the gradients reduced there made the mean over the ranks.
static bool ce_reduce(CpuEngine *ce, int i, char *err, size_t n) {
  for (int k = 0; k < ce->nranges; k++)
    if (ce->ranges[k].at == i &&
        !ce->reduce(ce->reduce_ctx, (float *)(ce->arena + ce->ranges[k].from),
                    (ce->ranges[k].to - ce->ranges[k].from) / 4, err, n))
      return false;
  return true;
}

static int by_step(const void *a, const void *b) {
  const GradRange *x = a, *y = b;
  return x->at != y->at ? (x->at > y->at) - (x->at < y->at) : (x->from > y->from) - (x->from < y->from);
}

// Buckets: by the step that makes them final, then by place (the order the backward finishes them in).
static int by_ready(const void *a, const void *b) {
  const GradRange *x = a, *y = b;
  return x->ready != y->ready ? (x->ready > y->ready) - (x->ready < y->ready) : (x->from > y->from) - (x->from < y->from);
}

// The node a view (a RESHAPE in no step) shows, else id itself.
static int viewed(const Fusion *f, int id) {
  while (f->step_of[id] < 0 && f->g->nodes[id]->op == OP_RESHAPE)
    id = f->g->nodes[id]->in[0];
  return id;
}

// Whether bytes [lo, hi) hold none of the n gradients g (padding between two of them, or nothing).
static bool no_gradient_in(const GradRange *g, int n, int64_t lo, int64_t hi) {
  for (int i = 0; i < n; i++)
    if (g[i].from < hi && lo < g[i].to)
      return false;
  return true;
}

GradRange *engine_grad_ranges(const Fusion *f, const MemPlan *m, int64_t bucket, int *nranges) {
  const Graph *g = f->g;
  const IrNode *norm = NULL;
  for (int i = 0; i < g->n && !norm; i++)
    norm = g->nodes[i]->op == OP_GRAD_NORM ? g->nodes[i] : NULL;
  GradRange *r = norm ? xmalloc(sizeof *r * (size_t)(2 * norm->nin + 1), "the gradients' ranges") : NULL;
  if (!r)
    return NULL;
  GradRange *one = r + norm->nin; // (each gradient alone, for the buckets' gaps)
  bool ok = true;
  for (int i = 0; ok && i < norm->nin; i++) {
    const IrNode *x = g->nodes[norm->in[i]];
    int base = viewed(f, x->id), w = f->step_of[base], at = f->nsteps;
    ok = m->offset[x->id] >= 0 && x->dtype == DT_F32 && w >= 0;
    const Step *ws = ok ? &f->steps[w] : NULL; // (a node of the writer's own step that reads it: no
    for (int k = 0; ok && k < ws->nnodes; k++)     // place to reduce it between)
      for (int j = 0; ok && j < g->nodes[ws->nodes[k]]->nin; j++)
        ok = viewed(f, g->nodes[ws->nodes[k]]->in[j]) != base;
    for (int s = f->nsteps - 1; ok && s > w; s--) // (the first reader after the writer)
      for (int k = 0; k < f->steps[s].nins; k++)
        if (viewed(f, f->steps[s].ins[k]) == base)
          at = s;
    r[i] = one[i] = (GradRange){m->offset[x->id], m->offset[x->id] + 4 * shape_numel(x->shape), at, w};
  }
  if (ok)
    qsort(r, (size_t)norm->nin, sizeof *r, bucket > 0 ? by_ready : by_step);
  int64_t lo = m->grads, hi = m->grads + m->param_bytes;
  int n = 0;
  for (int i = 0; ok && i < norm->nin; i++) {
    GradRange *prev = n ? &r[n - 1] : NULL;
    if (bucket > 0) { // (neighbours in memory with nothing else between, up to `bucket` bytes)
      bool merge = prev && prev->at == r[i].at && prev->to - prev->from + r[i].to - r[i].from <= bucket &&
                   prev->from >= lo && prev->to <= hi && r[i].from >= lo && r[i].to <= hi &&
                   (r[i].from >= prev->to ? no_gradient_in(one, norm->nin, prev->to, r[i].from)
                                          : r[i].to <= prev->from && no_gradient_in(one, norm->nin, r[i].to, prev->from));
      if (merge) {
        prev->from = prev->from < r[i].from ? prev->from : r[i].from;
        prev->to = prev->to > r[i].to ? prev->to : r[i].to;
        prev->ready = prev->ready > r[i].ready ? prev->ready : r[i].ready;
      } else {
        r[n++] = r[i];
      }
      continue;
    }
    ok = !prev || prev->at != r[i].at || r[i].from >= prev->to; // (two gradients in one place: not reducible)
    if (ok && prev && prev->at == r[i].at && prev->from >= lo && r[i].to <= hi) {
      prev->to = r[i].to;
      prev->ready = prev->ready > r[i].ready ? prev->ready : r[i].ready;
    } else if (ok) {
      r[n++] = r[i];
    }
  }
  for (int i = 0; ok && bucket > 0 && i < n; i++) // (two gradients in one place: not reducible)
    for (int j = i + 1; ok && j < n; j++)
      ok = r[i].to <= r[j].from || r[j].to <= r[i].from;
  if (!ok) {
    free(r);
    return NULL;
  }
  *nranges = n;
  return r;
}

ZeroShard *engine_shard(const Graph *g, int rank, int n) {
  ZeroShard *s = xmalloc(sizeof *s, "the optimizer's shards");
  int64_t *size = xmalloc(sizeof(int64_t) * (size_t)g->nparams, "the optimizer's shards");
  int *first = xmalloc(sizeof(int) * (size_t)(n + 1), "the optimizer's shards");
  for (int i = 0; i < g->nparams; i++) // (a frozen parameter has no update and no moments)
    size[i] = g->updates && g->updates[i] >= 0 ? shape_numel(g->nodes[g->params[i]]->shape) : 0;
  dist_partition(size, g->nparams, n, first);
  free(size);
  *s = (ZeroShard){rank, n, first};
  return s;
}

void engine_shard_free(ZeroShard *s) {
  if (s)
    free(s->first);
  free(s);
}

int engine_shard_owner(const ZeroShard *s, const Graph *g, int node) {
  int p = g->nodes[node]->op == OP_STATE ? g->nodes[node]->param_of : node;
  for (int r = 0; r < s->n; r++)
    for (int i = s->first[r]; i < s->first[r + 1]; i++)
      if (g->params[i] == p)
        return r;
  return 0;
}

void engine_shard_at(const ZeroShard *s, const Graph *g, const MemPlan *m, int64_t *params, int64_t *copies,
                     int64_t *mom_m, int64_t *mom_v) {
  for (int r = 0; r <= s->n; r++) {
    int i = s->first[r];
    int64_t rel = i < g->nparams ? m->offset[g->params[i]] - m->params : m->param_bytes;
    int64_t c = m->copies + m->copy_bytes; // (the first copy of a parameter from i on)
    for (int k = i; k < g->nparams; k++)
      if (m->copy_of[g->params[k]] >= 0) {
        c = m->offset[m->copy_of[g->params[k]]];
        break;
      }
    params[r] = (m->params + rel) / 4;
    copies[r] = c / 4;
    mom_m[r] = (m->m + rel) / 4;
    mom_v[r] = (m->v + rel) / 4;
  }
}

// Where node's values lie: in the arena, or for another rank's moment after Engine.gather_moments,
// where that put it.
static void *ce_place(CpuEngine *ce, int node) {
  const MemPlan *m = ce->m;
  int64_t off = m->offset[node];
  if (!ce->moved_m || ce->e.g->nodes[node]->op != OP_STATE || off < m->m || off >= m->m + m->moments * m->param_bytes)
    return cpu_value(m, ce->arena, node);
  bool v = off >= m->v; // (m's region, or v's: each rank's share is contiguous in both)
  const int64_t *at = ce->at + (v ? 3 : 2) * (ce->nranks + 1);
  if (off >= 4 * at[ce->rank] && off < 4 * at[ce->rank + 1])
    return cpu_value(m, ce->arena, node);
  return v ? ce->moved_v + (off - m->v) : ce->moved_m + (off - m->m);
}

// The other ranks' moments are gone from where gather_moments put them (a step, or idle, reuses it).
static void ce_unmove(CpuEngine *ce) {
  free(ce->own_v);
  ce->own_v = NULL;
  ce->moved_m = ce->moved_v = NULL;
}

// The buckets' thread: reduces them in the order they are queued until told to quit.
static void *comm_thread(void *arg) {
  CpuEngine *ce = arg;
  pthread_mutex_lock(&ce->comm.lock);
  for (;;) {
    while (!ce->comm.quit && ce->comm.taken == ce->comm.queued)
      pthread_cond_wait(&ce->comm.cond, &ce->comm.lock);
    if (ce->comm.quit)
      break;
    int k = ce->comm.queue[ce->comm.taken++];
    bool skip = ce->comm.failed;
    pthread_mutex_unlock(&ce->comm.lock);
    char err[512] = "";
    const GradRange *b = &ce->ranges[k];
    bool ok = skip || ce->reduce(ce->reduce_ctx, (float *)(ce->arena + b->from), (b->to - b->from) / 4, err, sizeof err);
    pthread_mutex_lock(&ce->comm.lock);
    if (!ok && !ce->comm.failed) {
      ce->comm.failed = true;
      snprintf(ce->comm.err, sizeof ce->comm.err, "%s", err);
    }
    ce->comm.done[k] = true;
    pthread_cond_broadcast(&ce->comm.cond);
  }
  pthread_mutex_unlock(&ce->comm.lock);
  return NULL;
}

// Before kernel i (nkernels: the step's end): waits until every bucket read by it is reduced; the
// time waited is the step's exposed communication (Engine.reduce_seconds).
static bool comm_wait(CpuEngine *ce, int i, char *err, size_t n) {
  double t0 = rt_now();
  pthread_mutex_lock(&ce->comm.lock);
  for (int k = 0; k < ce->nranges; k++)
    while (ce->ranges[k].at <= i && !ce->comm.done[k])
      pthread_cond_wait(&ce->comm.cond, &ce->comm.lock);
  bool ok = !ce->comm.failed;
  if (!ok)
    snprintf(err, n, "%s", ce->comm.err);
  pthread_mutex_unlock(&ce->comm.lock);
  ce->e.reduce_seconds += rt_now() - t0;
  return ok;
}

// Waits until the thread has reduced every bucket queued (a step that stops early leaves none behind).
static void comm_drain(CpuEngine *ce) {
  pthread_mutex_lock(&ce->comm.lock);
  for (int q = 0; q < ce->comm.queued; q++)
    while (!ce->comm.done[ce->comm.queue[q]])
      pthread_cond_wait(&ce->comm.cond, &ce->comm.lock);
  pthread_mutex_unlock(&ce->comm.lock);
}

// After kernel i: the buckets it made final go to the thread.
static void comm_queue(CpuEngine *ce, int i) {
  bool any = false;
  pthread_mutex_lock(&ce->comm.lock);
  for (int k = 0; k < ce->nranges; k++)
    if (ce->ranges[k].ready == i) {
      ce->comm.queue[ce->comm.queued++] = k;
      any = true;
    }
  if (any)
    pthread_cond_broadcast(&ce->comm.cond);
  pthread_mutex_unlock(&ce->comm.lock);
}

// Kernels [from, to) of the module, each timed when profiling; with comm and a reduce set, each
// gradient range reduced before its first reader's kernel (buckets: on the engine's thread, each
// queued once the kernel that makes it final has run, waited for before its first reader).
static bool ce_run(CpuEngine *ce, int from, int to, bool comm, char *err, size_t n) {
  Engine *e = &ce->e;
  bool reduce = comm && ce->reduce, buckets = reduce && ce->comm.started;
  for (int i = from; i < to; i++) {
    if (reduce && (buckets ? !comm_wait(ce, i, err, n) : !ce_reduce(ce, i, err, n)))
      return false;
    double t0 = rt_now();
    if (!cpu_run_kernel(ce->cm, i, ce->arena)) {
      snprintf(err, n, "%s", ce->cm->error);
      return false;
    }
    if (e->profile && e->profile_warm)
      e->kernel_seconds[i] += rt_now() - t0;
    if (buckets)
      comm_queue(ce, i);
  }
  return true;
}

// The threads' amaxes into the state's (NaN once any is NaN), and cleared.
static void ce_fp8_gather(CpuEngine *ce) {
  Fp8State *st = &ce->fp8;
  for (int t = 0; t < st->n; t++) {
    float a = st->amax[t];
    for (int th = 0; th < ce->cm->hooks.fp8_threads; th++) {
      float *v = &ce->amax[(size_t)th * (size_t)st->n + (size_t)t];
      if (a == a && !(*v <= a))
        a = *v;
      *v = 0;
    }
    st->amax[t] = a;
  }
}

// Fp8Step.run (interp.c's interpreter does the same step node by node): the kernels, then their
// threads' amaxes gathered. The buckets queued to the engine's thread are reduced before it returns:
// the amaxes' all-reduce that follows is the main thread's, and MPI serves one thread at a time, the
// ranks' collectives in one order.
static bool ce_fp8_run(void *ctx, int from, int to, bool comm, char *err, size_t n) {
  CpuEngine *ce = ctx;
  bool ok = ce_run(ce, from, to, comm, err, n);
  if (comm && ce->reduce && ce->comm.started)
    comm_drain(ce);
  ce_fp8_gather(ce);
  return ok;
}

// Fp8Step.poison: the gradient norm's first input NaN.
static void ce_fp8_poison(void *ctx) {
  CpuEngine *ce = ctx;
  if (ce->poison >= 0)
    *(float *)(ce->arena + ce->poison) = NAN;
}

static Fp8State *ce_fp8(Engine *e) { return &((CpuEngine *)e)->fp8; }

static void ce_set_fp8_amax(Engine *e, bool (*fn)(void *ctx, float *amax, int n, char *err, size_t en), void *ctx) {
  ((CpuEngine *)e)->share.fn = fn, ((CpuEngine *)e)->share.ctx = ctx;
}

static void ce_set_fp8_lead(Engine *e, const float *scale) { ((CpuEngine *)e)->share.lead = scale; }

static bool ce_step(Engine *e, char *err, size_t n) {
  CpuEngine *ce = (CpuEngine *)e;
  ce_unmove(ce);
  cpe_draw_params(e, err, n);
  bool ok = true, buckets = ce->reduce && ce->comm.started;
  if (!e->profile && !ce->reduce && !ce->fp8.n) {
    ok = cpu_step(ce->cm, ce->arena);
    if (!ok)
      snprintf(err, n, "%s", ce->cm->error);
  } else {
    if (buckets) {
      pthread_mutex_lock(&ce->comm.lock);
      ce->comm.queued = ce->comm.taken = 0;
      memset(ce->comm.done, 0, sizeof *ce->comm.done * (size_t)ce->nranges);
      pthread_mutex_unlock(&ce->comm.lock);
      e->reduce_seconds = 0;
    }
    Fp8Step s = {e->g, &ce->fp8, ce->opt_kernel, ce->cm->nkernels, ce_fp8_run, ce_fp8_poison, ce};
    ok = ce->fp8.n ? fp8_step(&s, &ce->share, err, n) : ce_run(ce, 0, ce->cm->nkernels, true, err, n);
    if (buckets) { // (a step that stops early leaves no bucket behind)
      comm_drain(ce);
      ok = ok && comm_wait(ce, ce->cm->nkernels, err, n);
    }
  }
  e->profiled_steps += e->profile && e->profile_warm && ok;
  e->profile_warm |= e->profile && ok;
  if (!ok)
    return false;
  const int64_t *params = ce->at, *copies = ce->at + ce->nranks + 1; // (ZeRO: the others' updates)
  return !ce->gather || (ce->gather(ce->gather_ctx, (float *)ce->arena, params, err, n) &&
                         (ce->m->copy_bytes == 0 || ce->gather(ce->gather_ctx, (float *)ce->arena, copies, err, n)));
}

// A value the plan keeps inside a kernel (never written to memory) reads as NaN.
static void ce_read(Engine *e, int node, float *dst) {
  CpuEngine *ce = (CpuEngine *)e;
  cpe_draw_params(e, NULL, 0);
  const void *src = ce_place(ce, node);
  int64_t n = shape_numel(e->g->nodes[node]->shape);
  if (src)
    memcpy(dst, src, sizeof(float) * (size_t)n);
  else
    for (int64_t i = 0; i < n; i++)
      dst[i] = NAN;
}

static const float *ce_values(Engine *e, int node) {
  CpuEngine *ce = (CpuEngine *)e;
  cpe_draw_params(e, NULL, 0);
  return ce_place(ce, node);
}

static void ce_write(Engine *e, int node, const float *src) {
  CpuEngine *ce = (CpuEngine *)e;
  memcpy(cpu_value(ce->m, ce->arena, node), src, sizeof(float) * (size_t)shape_numel(e->g->nodes[node]->shape));
  cpu_round_copy(e->g, ce->m, ce->arena, node);
  param_draw_written(&ce->draw, e->g, node);
}

static void ce_free(Engine *e);

// Engine.take_params between two compiled CPU engines: arena to arena, each bf16 copy rounded as
// ce_write rounds it.
static bool ce_take_params(Engine *e, Engine *from) {
  CpuEngine *ce = (CpuEngine *)e, *cf = (CpuEngine *)from;
  if (from->free != ce_free || from->g->nparams != e->g->nparams)
    return false;
  for (int i = 0; i < e->g->nparams; i++) {
    int p = e->g->params[i], q = from->g->params[i];
    if (!cpu_value(ce->m, ce->arena, p) || !cpu_value(cf->m, cf->arena, q) ||
        shape_numel(e->g->nodes[p]->shape) != shape_numel(from->g->nodes[q]->shape))
      return false;
  }
  cpe_draw_params(from, NULL, 0);
  param_draw_all_written(&ce->draw);
  for (int i = 0; i < e->g->nparams; i++) {
    int p = e->g->params[i], q = from->g->params[i];
    memcpy(cpu_value(ce->m, ce->arena, p), cpu_value(cf->m, cf->arena, q),
           sizeof(float) * (size_t)shape_numel(e->g->nodes[p]->shape));
    cpu_round_copy(e->g, ce->m, ce->arena, p);
  }
  return true;
}

// Engine.inputs_from between two compiled CPU engines: into the inputs' slots of e's arena.
static bool ce_inputs_from(Engine *e, int n, const char *const *names, Engine *from, const int *nodes, bool first) {
  CpuEngine *ce = (CpuEngine *)e, *cf = (CpuEngine *)from;
  if (from->free != ce_free)
    return false;
  float **y = xmalloc(sizeof *y * (size_t)n, "the inputs' values");
  bool ok = true;
  for (int i = 0; ok && i < n; i++) {
    int in = rt_input_node(e->g, names[i]);
    y[i] = in >= 0 && e->g->nodes[in]->dtype == DT_F32 ? cpu_value(ce->m, ce->arena, in) : NULL;
    ok = y[i] && from->g->nodes[nodes[i]]->dtype == DT_F32 && cpu_value(cf->m, cf->arena, nodes[i]) &&
         shape_numel(e->g->nodes[in]->shape) == shape_numel(from->g->nodes[nodes[i]]->shape);
  }
  for (int i = 0; ok && i < n; i++) {
    const float *x = cpu_value(cf->m, cf->arena, nodes[i]);
    for (int64_t k = 0, count = shape_numel(from->g->nodes[nodes[i]]->shape); k < count; k++)
      y[i][k] = first ? x[k] : y[i][k] + x[k];
  }
  free(y);
  return ok;
}

// Engine.idle: the whole pages inside the gradients, the activations and, with params_too, the
// parameters and their copies, back to the system (MADV_DONTNEED: they come back as zero pages on
// their next write). Between training steps and around validation this keeps the process at one
// arena's worth: GPT-2 124M's validation engine held 497 MB of parameters and the training engine
// 805 MB of gradients and activations that no one read while the other ran.
static void ce_idle(Engine *e, bool params_too) {
  CpuEngine *ce = (CpuEngine *)e;
  const MemPlan *m = ce->m;
  ce_unmove(ce);
  if (e->g->grads)
    cpu_arena_drop(ce->arena, m->grads, m->param_bytes);
  cpu_arena_drop(ce->arena, m->arena_bytes - m->activation_bytes, m->activation_bytes);
  if (params_too) {
    cpu_arena_drop(ce->arena, m->params, m->param_bytes);
    cpu_arena_drop(ce->arena, m->copies, m->copy_bytes);
  }
  for (int k = 2; ce->gather && k < 2 + m->moments; k++) { // (ZeRO: the moments of the others' shards)
    const int64_t *at = ce->at + k * (ce->nranks + 1), lo = 4 * at[ce->rank], hi = 4 * at[ce->rank + 1];
    const int64_t base = k == 2 ? m->m : m->v;
    cpu_arena_drop(ce->arena, base, lo - base);
    cpu_arena_drop(ce->arena, hi, base + m->param_bytes - hi);
  }
}

// The buckets' thread stopped and its memory freed.
static void comm_stop(CpuEngine *ce) {
  if (ce->comm.started) {
    pthread_mutex_lock(&ce->comm.lock);
    ce->comm.quit = true;
    pthread_cond_broadcast(&ce->comm.cond);
    pthread_mutex_unlock(&ce->comm.lock);
    pthread_join(ce->comm.thread, NULL);
    pthread_mutex_destroy(&ce->comm.lock);
    pthread_cond_destroy(&ce->comm.cond);
  }
  free(ce->comm.queue);
  free(ce->comm.done);
  memset(&ce->comm, 0, sizeof ce->comm);
}

// Engine.set_reduce: the gradients of engine_grad_ranges, each before its first reader's kernel (with
// bucket > 0 in buckets); with overlap, on a thread of their own, each started once final.
static bool ce_set_reduce(Engine *e, bool (*fn)(void *ctx, float *x, int64_t n, char *err, size_t en), void *ctx,
                          int64_t bucket, bool overlap) {
  CpuEngine *ce = (CpuEngine *)e;
  comm_stop(ce);
  free(ce->ranges);
  ce->ranges = NULL;
  ce->nranges = 0;
  ce->reduce = NULL;
  if (!fn)
    return true;
  if (!e->fusion || !(ce->ranges = engine_grad_ranges(e->fusion, ce->m, bucket, &ce->nranges)))
    return false;
  ce->reduce = fn;
  ce->reduce_ctx = ctx;
  if (bucket > 0 && overlap) {
    ce->comm.queue = xmalloc(sizeof *ce->comm.queue * (size_t)ce->nranges, "the all-reduce's queue");
    ce->comm.done = xmalloc(sizeof *ce->comm.done * (size_t)ce->nranges, "the all-reduce's queue");
    pthread_mutex_init(&ce->comm.lock, NULL);
    pthread_cond_init(&ce->comm.cond, NULL);
    ce->comm.started = pthread_create(&ce->comm.thread, NULL, comm_thread, ce) == 0;
    if (!ce->comm.started) {
      pthread_mutex_destroy(&ce->comm.lock);
      pthread_cond_destroy(&ce->comm.cond);
      return comm_stop(ce), false;
    }
  }
  return true;
}

// Engine.set_shard: the optimizer's own parameters by the module's hooks (own_lo, own_end), and the
// shares each step all-gathers.
static bool ce_set_shard(Engine *e, const ZeroShard *s, bool (*gather)(void *ctx, float *x, const int64_t *at, char *err,
                                                                    size_t en), void *ctx) {
  CpuEngine *ce = (CpuEngine *)e;
  free(ce->at);
  ce->at = NULL;
  ce->gather = NULL;
  ce->cm->hooks.own_lo = ce->cm->hooks.own_end = 0;
  if (!s)
    return true;
  if (!gather)
    return false;
  int64_t k = s->n + 1, *at = xmalloc(sizeof(int64_t) * 4 * (size_t)k, "the optimizer's shards");
  engine_shard_at(s, e->g, ce->m, at, at + k, at + 2 * k, at + 3 * k);
  ce->at = at;
  ce->rank = s->rank;
  ce->nranks = s->n;
  ce->gather = gather;
  ce->gather_ctx = ctx;
  int64_t lo = 4 * at[s->rank], hi = 4 * at[s->rank + 1];
  ce->cm->hooks.own_lo = hi > lo ? lo : INT64_MAX; // (an empty shard: no parameter is at or after INT64_MAX)
  ce->cm->hooks.own_end = hi > lo ? hi : INT64_MAX;
  return true;
}

// Engine.gather_moments: each rank's shares of m and v (contiguous in each, as its parameters are in
// the parameters' buffer) to rank 0, whose own share comes first: the others' shares of m go to the
// start of the gradients' buffer, those of v after them where that has room (two ranks of equal
// shares), else to the start of the activations' where that has, else into a buffer of their own;
// each share as it lies in m or v.
static bool ce_gather_moments(Engine *e, int64_t step, char *err, size_t n) {
  CpuEngine *ce = (CpuEngine *)e;
  const MemPlan *m = ce->m;
  ce_unmove(ce);
  if (!ce->gather || m->moments == 0)
    return true;
  int64_t k = ce->nranks + 1, *rel = xmalloc(sizeof(int64_t) * (size_t)k, "the optimizer's shards");
  const int64_t *m_at = ce->at + 2 * k, skip = 4 * (m_at[1] - m_at[0]), others = 4 * (m_at[k - 1] - m_at[1]);
  char *to_m = ce->arena + m->grads - skip, *to_v = to_m + others; // (v's shares lie as m's do)
  if (m->moments > 1 && 2 * others > m->param_bytes)
    to_v = ce->arena + (m->arena_bytes - m->activation_bytes) - skip;
  if (ce->rank == 0 && m->moments > 1 && 2 * others > m->param_bytes && m->activation_bytes < others) {
    if (!(ce->own_v = calloc((size_t)m->param_bytes / 4, sizeof(float)))) {
      free(rel);
      return rt_fail(err, n, "out of host memory gathering the moments (%.0f MB)", (double)others / 1e6);
    }
    to_v = (char *)ce->own_v;
  }
  bool ok = true;
  for (int b = 0; ok && b < m->moments; b++) { // (the shares relative to the start of m, then of v)
    const int64_t *at = ce->at + (2 + b) * k;
    for (int r = 0; r < k; r++)
      rel[r] = at[r] - at[0];
    ok = dist_gather_f32((float *)(ce->arena + (b ? m->v : m->m)), (float *)(b ? to_v : to_m), rel, 0,
                         b ? "the second moments' gather for the checkpoint" : "the moments' gather for the checkpoint",
                         step, err, n);
  }
  free(rel);
  if (ok && ce->rank == 0)
    ce->moved_m = to_m, ce->moved_v = to_v;
  else
    ce_unmove(ce);
  return ok;
}

static void ce_free(Engine *e) {
  CpuEngine *ce = (CpuEngine *)e;
  comm_stop(ce);
  ce_unmove(ce);
  free(ce->at);
  free(ce->ranges);
  fp8_state_free(&ce->fp8);
  free(ce->amax);
  cpu_unload(ce->cm);
  param_draw_free(&ce->draw);
  free(e->kernel_seconds);
  cpu_arena_free(ce->m, ce->arena);
  free(ce);
}

Engine *engine_cpu(const Fusion *f, const MemPlan *m, const char *source, uint64_t seed, char *err, size_t n) {
  CpuModule *cm = cpu_load(source, err, n);
  if (!cm)
    return NULL;
  CpuEngine *ce = xcalloc(1, sizeof *ce, "the CPU engine");
  char *arena = cpu_arena_new(m);
  if (!arena) {
    snprintf(err, n, "out of memory: the step's arena takes %.1f MB", (double)m->arena_bytes / 1e6);
    free(ce);
    cpu_unload(cm);
    return NULL;
  }
  ce->m = m;
  ce->cm = cm;
  ce->arena = arena;
  cm->hooks.seed = seed;
  param_draw_init(&ce->draw, f->g, seed);
  ce->e = (Engine){.name = "cpu", .g = f->g, .set_input = ce_set_input, .set_scalar = ce_set_scalar,
                   .set_seed = ce_set_seed, .arena_bytes = m->arena_bytes, .fusion = f,
                   .kernel_seconds = xcalloc((size_t)cm->nkernels, sizeof(double), "the kernels' timings"),
                   .step = ce_step, .read = ce_read, .write = ce_write, .values = ce_values, .idle = ce_idle,
                   .free = ce_free,
                   .take_params = ce_take_params, .draw_params = cpe_draw_params, .inputs_from = ce_inputs_from,
                   .set_reduce = ce_set_reduce, .set_shard = ce_set_shard,
                   .gather_moments = ce_gather_moments,
                   .cache_hit = cm->cache_hit, .compile_seconds = cm->compile_seconds};
  if (f->g->nfp8) {
    fp8_state_init(&ce->fp8, f->g);
    int threads = 1024; // (more than any loop of the module uses: cpu.c's threads are the cores)
    ce->amax = rt_xrealloc(NULL, sizeof(float) * (size_t)threads * (size_t)f->g->nfp8);
    memset(ce->amax, 0, sizeof(float) * (size_t)threads * (size_t)f->g->nfp8);
    cm->hooks.fp8_scale = ce->fp8.scale, cm->hooks.fp8_amax = ce->amax;
    cm->hooks.nfp8 = f->g->nfp8, cm->hooks.fp8_threads = threads;
    ce->opt_kernel = f->nsteps;
    for (int i = f->nsteps - 1; i >= 0; i--)
      ce->opt_kernel = f->steps[i].kind == STEP_OPTIMIZER ? i : ce->opt_kernel;
    ce->poison = -1;
    for (int i = 0; i < f->g->n && ce->poison < 0; i++)
      if (f->g->nodes[i]->op == OP_GRAD_NORM)
        ce->poison = m->offset[f->g->nodes[i]->in[0]];
    ce->e.fp8 = ce_fp8;
    ce->e.set_fp8_amax = ce_set_fp8_amax;
    ce->e.set_fp8_lead = ce_set_fp8_lead;
  }
  return &ce->e;
}

static const double *by_time_of;
static int slowest_first(const void *a, const void *b) {
  double x = by_time_of[*(const int *)a], y = by_time_of[*(const int *)b];
  return x < y ? 1 : x > y ? -1 : *(const int *)a - *(const int *)b;
}

void engine_profile_report(const Engine *e, FILE *out) {
  const Fusion *f = e->fusion;
  if (!e->profile || !f || !e->kernel_seconds)
    return;
  if (e->profiled_steps == 0) {
    fprintf(out, "profile: no step was timed (the first one warms up; run two or more)\n");
    return;
  }
  double total = 0;
  int *order = xmalloc(sizeof(int) * (size_t)f->nsteps, "the kernels' order");
  for (int i = 0; i < f->nsteps; i++) {
    order[i] = i;
    total += e->kernel_seconds[i];
  }
  by_time_of = e->kernel_seconds;
  qsort(order, (size_t)f->nsteps, sizeof *order, slowest_first);
  double steps = (double)e->profiled_steps;
  fprintf(out, "profile: %d kernels, %.3f ms per step over %lld steps after the first, run one by one\n",
          f->nsteps, 1e3 * total / steps, (long long)e->profiled_steps);
  fprintf(out, "%-48s %9s %6s %9s %8s  ops (.mdl line)\n", "kernel", "ms/step", "share", "GFLOP/s", "GB/s");
  for (int k = 0; k < f->nsteps; k++) {
    const Step *st = &f->steps[order[k]];
    double sec = e->kernel_seconds[order[k]] / steps;
    fprintf(out, "%-48s %9.3f %5.1f%% %9.2f %8.2f ", st->name, 1e3 * sec, 100 * sec * steps / total,
            sec > 0 ? st->flops / sec / 1e9 : 0, sec > 0 ? (st->bytes_read + st->bytes_written) / sec / 1e9 : 0);
    for (int i = 0, shown = 0; i < st->nnodes && shown < 8; i++) {
      const IrNode *n = f->g->nodes[st->nodes[i]];
      if (n->op == OP_RESHAPE)
        continue;
      fprintf(out, " %s@%d", op_name(n->op), n->loc.line);
      shown++;
    }
    fprintf(out, "\n");
  }
  free(order);
  if (e->profile_launches)
    e->profile_launches(e, total, out);
}

double engine_scalar(Engine *e, int node) {
  float v;
  e->read(e, node, &v);
  return v;
}
