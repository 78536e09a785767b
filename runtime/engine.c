// engine.c: one training step on any back end, behind one struct of hooks (Engine). The training
// loop, `mdlc grad` and the tests talk to an Engine and never ask which back end is behind it.
//   interp: the reference interpreter (fp32 or fp64), op by op;
//   cpu:    the plan fused, emitted as C, compiled with cc, cached and dlopen'd.
#include "backend.h"
#include "runtime.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

//
// Initial parameters, drawn when first needed.
//
void param_draw_init(ParamDraw *d, const Graph *g, uint64_t seed) {
  *d = (ParamDraw){.seed = seed, .pending = malloc((size_t)(g->nparams ? g->nparams : 1)), .left = g->nparams};
  if (!d->pending) {
    fprintf(stderr, "mdlc: out of host memory\n");
    exit(1);
  }
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
// The reference interpreter.
//
typedef struct {
  Engine e;
  Interp *it;
  ParamDraw draw;
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

static bool ie_step(Engine *e, char *err, size_t n) {
  ie_draw_params(e, err, n);
  return interp_run(((InterpEngine *)e)->it, e->g->n, err, n);
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

static void ie_free(Engine *e) {
  interp_free(((InterpEngine *)e)->it);
  param_draw_free(&((InterpEngine *)e)->draw);
  free(e);
}

Engine *engine_interp(const Graph *g, InterpPrecision prec, uint64_t seed) {
  InterpEngine *ie = calloc(1, sizeof *ie);
  if (!ie) {
    fprintf(stderr, "mdlc: out of host memory\n");
    exit(1);
  }
  ie->it = interp_new(g, prec);
  interp_set_seed(ie->it, seed);
  param_draw_init(&ie->draw, g, seed);
  ie->e = (Engine){.name = prec == INTERP_F64 ? "interp (fp64)" : "interp (fp32)", .g = g,
                   .set_input = ie_set_input, .set_scalar = ie_set_scalar, .set_seed = ie_set_seed, .step = ie_step,
                   .read = ie_read, .write = ie_write, .draw_params = ie_draw_params, .free = ie_free,
                   .fp8 = g->nfp8 ? ie_fp8 : NULL};
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
  // precision fp8: the scaling state, the threads' amaxes the module records (MdlHooks), the
  // optimizer's first kernel and the arena offset of a gradient it reads (ce_step_fp8)
  Fp8State fp8;
  float *amax;
  int opt_kernel;
  int64_t poison;
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

// The node a view (a RESHAPE in no step) shows, else id itself.
static int viewed(const Fusion *f, int id) {
  while (f->step_of[id] < 0 && f->g->nodes[id]->op == OP_RESHAPE)
    id = f->g->nodes[id]->in[0];
  return id;
}

GradRange *engine_grad_ranges(const Fusion *f, const MemPlan *m, int *nranges) {
  const Graph *g = f->g;
  const IrNode *norm = NULL;
  for (int i = 0; i < g->n && !norm; i++)
    norm = g->nodes[i]->op == OP_GRAD_NORM ? g->nodes[i] : NULL;
  GradRange *r = norm ? malloc(sizeof *r * (size_t)(norm->nin ? norm->nin : 1)) : NULL;
  if (!r)
    return NULL;
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
    r[i] = (GradRange){m->offset[x->id], m->offset[x->id] + 4 * shape_numel(x->shape), at};
  }
  if (ok)
    qsort(r, (size_t)norm->nin, sizeof *r, by_step);
  int64_t lo = m->grads, hi = m->grads + m->param_bytes;
  int n = 0;
  for (int i = 0; ok && i < norm->nin; i++) {
    GradRange *prev = n ? &r[n - 1] : NULL;
    ok = !prev || prev->at != r[i].at || r[i].from >= prev->to; // (two gradients in one place: not reducible)
    if (ok && prev && prev->at == r[i].at && prev->from >= lo && r[i].to <= hi)
      prev->to = r[i].to;
    else if (ok)
      r[n++] = r[i];
  }
  if (!ok) {
    free(r);
    return NULL;
  }
  *nranges = n;
  return r;
}

// Kernels [from, to) of the module, each timed when profiling.
static bool ce_kernels(CpuEngine *ce, int from, int to, char *err, size_t n) {
  Engine *e = &ce->e;
  for (int i = from; i < to; i++) {
    double t0 = rt_now();
    if (!cpu_run_kernel(ce->cm, i, ce->arena)) {
      snprintf(err, n, "%s", ce->cm->error);
      return false;
    }
    if (e->profile && e->profile_warm)
      e->kernel_seconds[i] += rt_now() - t0;
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

// A step in precision fp8 (interp.c does the same): kernel by kernel, the threads' amaxes gathered
// before the optimizer's first kernel. A non-finite one makes a gradient the optimizer reads NaN, so
// that it skips the step as it skips any non-finite gradient (the runtime then names the tensor), and
// the histories do not roll. With no history yet (the first step) the kernels before the optimizer
// run once more beforehand with every scale 1, to record the amaxes (calibration).
static bool ce_step_fp8(CpuEngine *ce, char *err, size_t n) {
  Fp8State *st = &ce->fp8;
  const Graph *g = ce->e.g;
  char why[8];
  memset(st->amax, 0, sizeof(float) * (size_t)st->n);
  if (!st->recorded) {
    if (!ce_kernels(ce, 0, ce->opt_kernel, err, n))
      return false;
    ce_fp8_gather(ce);
    if (fp8_state_update(st, g, why, sizeof why))
      memset(st->amax, 0, sizeof(float) * (size_t)st->n);
  }
  if (!ce_kernels(ce, 0, ce->opt_kernel, err, n))
    return false;
  ce_fp8_gather(ce);
  bool bad = fp8_state_check(st, g, why, sizeof why);
  if (bad && ce->poison >= 0)
    *(float *)(ce->arena + ce->poison) = NAN;
  if (!ce_kernels(ce, ce->opt_kernel, ce->cm->nkernels, err, n))
    return false;
  if (!bad)
    fp8_state_update(st, g, why, sizeof why);
  ce->e.profiled_steps += ce->e.profile && ce->e.profile_warm;
  ce->e.profile_warm |= ce->e.profile;
  return true;
}

static Fp8State *ce_fp8(Engine *e) { return &((CpuEngine *)e)->fp8; }

static bool ce_step(Engine *e, char *err, size_t n) {
  CpuEngine *ce = (CpuEngine *)e;
  cpe_draw_params(e, err, n);
  if (ce->fp8.n)
    return ce_step_fp8(ce, err, n);
  bool ok = true;
  if (!e->profile && !ce->reduce)
    ok = cpu_step(ce->cm, ce->arena);
  for (int i = 0; (e->profile || ce->reduce) && ok && i < ce->cm->nkernels; i++) {
    if (ce->reduce && !ce_reduce(ce, i, err, n))
      return false;
    double t0 = rt_now();
    ok = cpu_run_kernel(ce->cm, i, ce->arena);
    if (e->profile && e->profile_warm)
      e->kernel_seconds[i] += rt_now() - t0;
  }
  e->profiled_steps += e->profile && e->profile_warm && ok;
  e->profile_warm |= e->profile && ok;
  if (!ok)
    snprintf(err, n, "%s", ce->cm->error);
  return ok;
}

// A value the plan keeps inside a kernel (never written to memory) reads as NaN.
static void ce_read(Engine *e, int node, float *dst) {
  CpuEngine *ce = (CpuEngine *)e;
  cpe_draw_params(e, NULL, 0);
  const void *src = cpu_value(ce->m, ce->arena, node);
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
  return cpu_value(ce->m, ce->arena, node);
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
  float **y = malloc(sizeof *y * (size_t)(n ? n : 1));
  bool ok = y != NULL;
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
  if (e->g->grads)
    cpu_arena_drop(ce->arena, m->grads, m->param_bytes);
  cpu_arena_drop(ce->arena, m->arena_bytes - m->activation_bytes, m->activation_bytes);
  if (params_too) {
    cpu_arena_drop(ce->arena, m->params, m->param_bytes);
    cpu_arena_drop(ce->arena, m->copies, m->copy_bytes);
  }
}

// Engine.set_reduce: the gradients of engine_grad_ranges, each before its first reader's kernel.
static bool ce_set_reduce(Engine *e, bool (*fn)(void *ctx, float *x, int64_t n, char *err, size_t en), void *ctx) {
  CpuEngine *ce = (CpuEngine *)e;
  free(ce->ranges);
  ce->ranges = NULL;
  ce->nranges = 0;
  ce->reduce = NULL;
  if (!fn)
    return true;
  if (!e->fusion || !(ce->ranges = engine_grad_ranges(e->fusion, ce->m, &ce->nranges)))
    return false;
  ce->reduce = fn;
  ce->reduce_ctx = ctx;
  return true;
}

static void ce_free(Engine *e) {
  CpuEngine *ce = (CpuEngine *)e;
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
  CpuEngine *ce = calloc(1, sizeof *ce);
  char *arena = ce ? cpu_arena_new(m) : NULL;
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
                   .kernel_seconds = calloc((size_t)cm->nkernels, sizeof(double)),
                   .step = ce_step, .read = ce_read, .write = ce_write, .values = ce_values, .idle = ce_idle,
                   .free = ce_free,
                   .take_params = ce_take_params, .draw_params = cpe_draw_params, .inputs_from = ce_inputs_from,
                   .set_reduce = ce_set_reduce,
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
  int *order = malloc(sizeof(int) * (size_t)f->nsteps);
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
