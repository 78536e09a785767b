// step.c: one optimizer step: its batch (and its micro-batches, their gradients summed) through the
// engine, the engine's hooks between its parts (data parallel's all-reduce, fp8's amaxes, --zero 1's
// gather), and the step's figures (the loss, the metrics, over the ranks; what made it non-finite).
#include "fp8_state.h"
#include "runtime.h"
#include "train_impl.h"

#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

// The per-step seed of dropout masks: a function of the run's seed and the step, so a resumed run
// draws the same masks as an uninterrupted one; rank 0's as one process's, the other ranks' each their
// own (their slices of the batch get masks of their own, not rank 0's again).
static uint64_t step_seed(uint64_t seed, int64_t step) {
  uint64_t s = mdl_rng_u64(seed, 0x5eed, (uint64_t)step);
  return dist_rank() ? mdl_rng_u64(s, 0x7a4b, (uint64_t)dist_rank()) : s;
}

// A batch's inputs: an array dataset's, else the tokens and targets, and pos and doc where the model
// reads them; n a row's values times the rows (B*T). With several ranks (dist.c) the loaders give the
// global batch, dist_size() times the rows, and each rank takes its own slice: rows [r*B, (r+1)*B)
// on rank r.
bool feed_batch(Engine *e, const Batch *b, int64_t n) {
  int rank = dist_on() ? dist_rank() : 0, world = dist_on() ? dist_size() : 1;
  int64_t at = (int64_t)rank * n;
  for (int i = 0; i < b->ninputs; i++) {
    int64_t each = b->inputs[i].numel / world, from = each * rank;
    if (!e->set_input(e, b->inputs[i].name, b->inputs[i].ids ? b->inputs[i].ids + from : NULL,
                      b->inputs[i].f ? b->inputs[i].f + from : NULL, each))
      return false;
  }
  return b->ninputs > 0 ||
         (e->set_input(e, "tokens", b->tokens + at, NULL, n) && e->set_input(e, "targets", b->targets + at, NULL, n) &&
          (rt_input_node(e->g, "pos") < 0 || e->set_input(e, "pos", b->pos + at, NULL, n)) &&
          (rt_input_node(e->g, "doc") < 0 || e->set_input(e, "doc", b->doc + at, NULL, n)));
}

// Whether g can train on token shards: dims B, T and V, the inputs tokens and targets, pos and doc
// where it reads them, and no other; false after naming what is missing or extra.
bool shards_fit(const Graph *g, const char *data_dir) {
  const char *missing = ir_dim(g, "B") <= 0 ? "dim B" : ir_dim(g, "T") <= 0 ? "dim T" : ir_dim(g, "V") <= 0 ? "dim V"
                        : rt_input_node(g, "tokens") < 0 ? "input tokens" : rt_input_node(g, "targets") < 0 ?
                        "input targets" : NULL;
  if (missing) {
    diag_file_error(data_dir, "token shards train a model with dims B, T and V and the inputs tokens and targets "
                    "(pos and doc where it reads them): the model has no %s; a model of other inputs trains on an "
                    "array dataset (.npy, .npz or .safetensors files, docs/options.md)", missing);
    return false;
  }
  for (int i = 0; i < g->fwd_end; i++) {
    const char *name = g->nodes[i]->op == OP_INPUT ? g->nodes[i]->name : NULL;
    if (name && strcmp(name, "tokens") && strcmp(name, "targets") && strcmp(name, "pos") && strcmp(name, "doc")) {
      diag_file_error(data_dir, "token shards give the inputs tokens, targets, pos and doc, not the model's input "
                      "'%s': train it on an array dataset (.npy, .npz or .safetensors files, docs/options.md)", name);
      return false;
    }
  }
  return true;
}

// Copies every parameter of `from` into `to` (engines of two graphs of one model): memory to memory
// where both engines can (Engine.take_params: on a GPU, GPT-2's 500 MB no longer go down to the host
// and back up for each validation), else through host memory.
void copy_params(Engine *from, Engine *to) {
  if (to->take_params && to->take_params(to, from))
    return;
  float *buf = NULL;
  for (int i = 0; i < from->g->nparams; i++) {
    buf = rt_xrealloc(buf, sizeof(float) * (size_t)shape_numel(from->g->nodes[from->g->params[i]]->shape));
    from->read(from, from->g->params[i], buf);
    to->write(to, to->g->params[i], buf);
  }
  free(buf);
}

// The output of g named `name`, or -1.
static int output_named(const Graph *g, const char *name) {
  for (int i = 0; i < g->noutputs; i++)
    if (g->nodes[g->outputs[i]]->name && !strcmp(g->nodes[g->outputs[i]]->name, name))
      return i;
  return -1;
}

Metrics metrics_of(const Graph *g, const Graph *eval) {
  Metrics m = {0};
  size_t n = (size_t)g->noutputs + 1;
  m.name = rt_xrealloc(NULL, n * sizeof *m.name);
  m.node = rt_xrealloc(NULL, n * sizeof *m.node);
  m.val = rt_xrealloc(NULL, n * sizeof *m.val);
  m.now = xcalloc(n, sizeof *m.now, "the run's metrics");
  m.sum = xcalloc(n, sizeof *m.sum, "the run's metrics");
  for (int i = 0; i < g->noutputs; i++) {
    const IrNode *x = g->nodes[g->outputs[i]];
    if (g->outputs[i] == g->loss || x->shape.rank != 0 || !x->name)
      continue;
    m.name[m.n] = x->name;
    m.node[m.n] = g->outputs[i];
    m.val[m.n++] = eval ? output_named(eval, x->name) : -1;
  }
  return m;
}

void metrics_free(Metrics *m) {
  free(m->name);
  free(m->node);
  free(m->val);
  free(m->now);
  free(m->sum);
}

// Gradient accumulation: the first k - 1 micro-batches run on the gradients-only engine, their
// gradients summed into the step engine's inputs "acc.<param>": engine to engine where the two
// engines can (Engine.inputs_from; the first micro-batch's gradients copied, the others' added in
// order), else here, in the same order, and sent with the step's other inputs. Each micro-batch's loss
// is a mean of its own (over its counted targets, docs/language.md); the step's gradient is the mean of
// the k micro-batches' (autodiff.c's optimizer step) and the loss it reports the mean of their losses.
//
// Precision fp8 over several micro-batches and several ranks. Every rank, and every micro-batch of a
// step, casts with the step engine's scales, and the step's amaxes are the max over its k
// micro-batches and over the ranks, checked and rolled into the histories by every rank alike
// (Engine.set_fp8_amax, set_fp8_lead): the scales and histories one process would have over the
// global batch (ranks x k micro-batches). The first step calibrates over all of them: every
// micro-batch runs once beforehand on the micro-batches' engine with every scale 1, to record its
// amaxes (the data rewound after), and the scales are set from their max over the ranks; then the step
// runs with them. Up to a power of two: a micro-batch's loss is the mean over its own targets (and a
// rank's over its own slice), so the gradients flowing back through the backward are k (or ranks x k)
// times those of one process over the global batch, exactly where each micro-batch counts as many
// targets (packed batches: B x T each): the amaxes of the backward's scaled tensors (E5M2) are k times
// theirs and their scales 1/k times, the same fp8 values after scaling; the forward's are the same.
// Elsewhere (padded batches of unequal counts) that factor is not a power of two, and the two runs
// scale alike only where it stays inside a scale's margin (FP8_MARGIN).
// a raised to b where b is larger, NaN once either is NaN (as the casts record their amaxes).
static float amax_join(float a, float b) { return a != a || b != b ? NAN : b > a ? b : a; }

// An amax as the bits of a non-negative float, NaN above +inf: the unsigned max over the ranks is the
// float max, with a NaN on any rank winning (dist_max_u32).
static uint32_t amax_bits(float a) {
  uint32_t u;
  memcpy(&u, &a, sizeof u);
  return a != a ? UINT32_MAX : u;
}

static float amax_of_bits(uint32_t u) {
  float a;
  memcpy(&a, &u, sizeof a);
  return u > 0x7f800000u ? NAN : a;
}

// The amaxes made the max over the ranks (alone: as they are).
static bool fp8_amax_ranks(Fp8Amax *fa, float *amax, char *err, size_t en) {
  if (!dist_on())
    return true;
  for (int i = 0; i < fa->n; i++)
    fa->bits[i] = amax_bits(amax[i]);
  if (!dist_max_u32(fa->bits, fa->n, "the fp8 amaxes' all-reduce", fa->step, err, en))
    return false;
  for (int i = 0; i < fa->n; i++)
    amax[i] = amax_of_bits(fa->bits[i]);
  return true;
}

// Engine.set_fp8_amax's: the step engine's amaxes raised to the step's micro-batches', then to the ranks'.
static bool fp8_amax_step(void *ctx, float *amax, int n, char *err, size_t en) {
  Fp8Amax *fa = ctx;
  for (int i = 0; fa->merge && i < n; i++)
    amax[i] = amax_join(amax[i], fa->micro[i]);
  return fp8_amax_ranks(fa, amax, err, en);
}

// A micro-batch's amaxes (its engine's, after its pass) into the step's.
static void fp8_amax_micro(Fp8Amax *fa, Engine *micro) {
  const float *a = micro->fp8(micro)->amax;
  for (int i = 0; i < fa->n; i++)
    fa->micro[i] = amax_join(fa->micro[i], a[i]);
}

static bool host_sums(Accum *ac, char *err, size_t n) {
  const Graph *mg = ac->micro->g;
  int64_t most = 1;
  for (int i = 0; !ac->tmp && i < ac->n; i++) {
    int64_t numel = shape_numel(mg->nodes[mg->params[ac->param[i]]]->shape);
    if (!(ac->sum[i] = malloc(sizeof(float) * (size_t)numel)))
      return rt_fail(err, n, "out of host memory for the gradient sums");
    most = numel > most ? numel : most;
  }
  if (!ac->tmp && !(ac->tmp = malloc(sizeof(float) * (size_t)most)))
    return rt_fail(err, n, "out of host memory for the gradient sums");
  return true;
}

// Precision fp8's first step under gradient accumulation: its k micro-batches (the last one the step
// engine's) each run once on the micro-batches' engine with every scale 1, their amaxes' max over them
// and over the ranks sets the step engine's scales, and the data is rewound for the step itself. Where
// an amax is not finite the scales stay, the step calibrates again by itself and, meeting it again, is
// skipped and the tensor named.
static bool fp8_calibrate(Accum *ac, Engine *e, Loader *train, int64_t k, int64_t BT, uint64_t seed, int64_t step,
                          char *err, size_t n) {
  Fp8Amax *fa = ac->fp8;
  Fp8State *st = e->fp8(e);
  LoaderState at = loader_state(train);
  ac->micro->set_fp8_lead(ac->micro, fa->ones);
  for (int i = 0; i < fa->n; i++)
    fa->micro[i] = 0;
  for (int64_t j = 0; j < k; j++) {
    Batch batch;
    if (!loader_next(train, &batch))
      return rt_fail(err, n, "no batch for micro-batch %lld (the training data failed)", (long long)j + 1);
    ac->micro->set_seed(ac->micro, step_seed(seed, step * k + j));
    if (!feed_batch(ac->micro, &batch, BT) || !ac->micro->step(ac->micro, err, n))
      return false;
    fp8_amax_micro(fa, ac->micro);
  }
  if (!loader_seek(train, at))
    return rt_fail(err, n, "the training data cannot be read again after the fp8 calibration");
  memcpy(st->amax, fa->micro, sizeof(float) * (size_t)fa->n);
  char why[8];
  if (!fp8_amax_ranks(fa, st->amax, err, n))
    return false;
  fp8_state_update(st, e->g, why, sizeof why);
  return true;
}

static bool accumulate_micro(Accum *ac, Engine *e, Loader *train, int64_t k, int64_t BT, uint64_t seed,
                             int64_t step, double *loss_sum, int64_t *real, char *err, size_t n) {
  const Graph *mg = ac->micro->g;
  copy_params(e, ac->micro);
  if (ac->fp8) {
    ac->fp8->step = step;
    if (!e->fp8(e)->recorded && !fp8_calibrate(ac, e, train, k, BT, seed, step, err, n))
      return false;
    ac->micro->set_fp8_lead(ac->micro, e->fp8(e)->scale);
    for (int i = 0; i < ac->fp8->n; i++)
      ac->fp8->micro[i] = 0;
    ac->fp8->merge = true;
  }
  bool direct = e->inputs_from != NULL;
  for (int64_t j = 0; j + 1 < k; j++) {
    Batch batch;
    if (!loader_next(train, &batch))
      return rt_fail(err, n, "no batch for micro-batch %lld (the training data failed)", (long long)j + 1);
    ac->micro->set_seed(ac->micro, step_seed(seed, step * k + j));
    if (!feed_batch(ac->micro, &batch, BT) || !ac->micro->step(ac->micro, err, n))
      return false;
    *loss_sum += engine_scalar(ac->micro, mg->loss);
    if (ac->fp8)
      fp8_amax_micro(ac->fp8, ac->micro);
    for (int m = 0; m < ac->metrics->n; m++) {
      int out = output_named(mg, ac->metrics->name[m]);
      ac->metrics->sum[m] += out >= 0 ? engine_scalar(ac->micro, mg->outputs[out]) : NAN;
    }
    *real += batch.real_tokens;
    // Engines that decline the first micro-batch's gradients (all or none) leave the sums to the
    // host; a failure after that is an error of the device.
    if (direct && !e->inputs_from(e, ac->n, ac->names, ac->micro, ac->grads, j == 0)) {
      if (j > 0)
        return rt_fail(err, n, "gradient accumulation failed adding micro-batch %lld's gradients", (long long)j + 1);
      direct = false;
    }
    if (!direct && !host_sums(ac, err, n))
      return false;
    for (int i = 0; !direct && i < ac->n; i++) {
      int64_t numel = shape_numel(mg->nodes[mg->params[ac->param[i]]]->shape);
      ac->micro->read(ac->micro, ac->grads[i], ac->tmp);
      for (int64_t x = 0; x < numel; x++)
        ac->sum[i][x] = j == 0 ? ac->tmp[x] : ac->sum[i][x] + ac->tmp[x];
    }
  }
  for (int i = 0; !direct && i < ac->n; i++) {
    const IrNode *p = mg->nodes[mg->params[ac->param[i]]];
    if (!e->set_input(e, ac->names[i], NULL, ac->sum[i], shape_numel(p->shape))) {
      snprintf(err, n, "the step graph has no input for gradient accumulation of %s", p->name);
      return false;
    }
  }
  return true;
}

// The name of what made step `step` non-finite: the loss, else the first gradient with a NaN or an
// infinity (read from the engine: gradients are in memory after the step, for the optimizer).
const char *nonfinite_culprit(Engine *e, double loss, char *buf, size_t n) {
  const Graph *g = e->g;
  if (!isfinite(loss)) {
    snprintf(buf, n, "the loss (%s) is %g", g->nodes[g->loss]->name ? g->nodes[g->loss]->name : "loss", loss);
    return buf;
  }
  if (e->fp8 && fp8_state_check(e->fp8(e), g, buf, n)) // (a scaled tensor overflowed: the step was skipped)
    return buf;
  snprintf(buf, n, "the gradient norm is not finite");
  float *x = NULL;
  for (int i = 0; i < g->nparams; i++) {
    if (g->grads[i] < 0) // (frozen)
      continue;
    int64_t numel = shape_numel(g->nodes[g->params[i]]->shape);
    float *grown = realloc(x, sizeof(float) * (size_t)(numel ? numel : 1));
    if (!grown)
      break;
    x = grown;
    e->read(e, g->grads[i], x);
    int64_t bad = rt_first_nonfinite(x, numel);
    if (bad >= 0) {
      snprintf(buf, n, "the gradient of %s is not finite (element %lld is %g)", g->nodes[g->params[i]]->name,
               (long long)bad, (double)x[bad]);
      break;
    }
  }
  free(x);
  return buf;
}


static bool reduce_grads(void *ctx, float *x, int64_t n, char *err, size_t en) {
  Reduce *r = ctx;
  double t0 = rt_now();
  bool poison = r->poison || !isfinite(engine_scalar(r->e, r->e->g->loss));
  for (int64_t i = 0; poison && i < n; i++)
    x[i] = NAN;
  bool ok = dist_mean_f32(x, n, "the gradients' all-reduce", r->step, err, en);
  r->busy += rt_now() - t0;
  return ok;
}

// ZeRO stage 1 (--zero 1): the updated parameters' all-gather after each step (Engine.set_shard), in
// the step's communication time.
static bool gather_params(void *ctx, float *x, const int64_t *at, char *err, size_t en) {
  Reduce *r = ctx;
  double t0 = rt_now();
  bool ok = dist_allgather_f32(x, at, "the updated parameters' all-gather", r->step, err, en);
  r->gather += rt_now() - t0;
  return ok;
}
// The engine's hooks for data parallel (the gradients' reduce: by the engine, or by NCCL), for
// precision fp8 over several ranks or micro-batches, and for --zero 1; an engine that lacks one the
// run needs ends it before its first step (rc 1, last = start), after saying so.
void run_hooks(Run *r) {
  const TrainOptions *o = r->o;
  const Graph *g = r->g;
  Engine *e = r->e, *micro = r->micro;
  int world = r->world;
  // Several ranks: the gradients are reduced in host memory by MPI (the CPU back end), or on the GPUs
  // by NCCL (the CUDA back end).
  r->nccl = false, r->overlapped = world > 1 && dist_bucket() > 0 && dist_overlap() && e->set_reduce;
  // Precision fp8 over several ranks or micro-batches: the step's amaxes are theirs (Fp8Amax).
  r->fa = (Fp8Amax){0};
  r->fp8_shared = e->fp8 && (world > 1 || r->k > 1);
  if (r->fp8_shared) {
    r->fa.n = e->fp8(e)->n;
    r->fa.micro = rt_xrealloc(NULL, sizeof(float) * (size_t)r->fa.n);
    r->fa.ones = rt_xrealloc(NULL, sizeof(float) * (size_t)r->fa.n);
    r->fa.bits = rt_xrealloc(NULL, sizeof(uint32_t) * (size_t)r->fa.n);
    for (int i = 0; i < r->fa.n; i++)
      r->fa.ones[i] = 1;
    r->ac.fp8 = r->k > 1 ? &r->fa : NULL;
  }
  bool led = r->k <= 1 || (micro->fp8 && micro->set_fp8_lead && micro->fp8(micro)->n == r->fa.n);
  if (r->fp8_shared && (!e->set_fp8_amax || !led)) {
    diag_file_error(o->model_path, "precision fp8 %s on the %s back end: its engines do not share the fp8 scales "
                    "and amaxes%s; use bf16 there, or --backend cpu", world > 1 ? "over several ranks" :
                    "with gradient accumulation (accumulate > 1)", e->name,
                    world > 1 ? " over the ranks" : " over the micro-batches");
    r->rc = 1;
    r->last = r->start;
    r->overlapped = false;
  } else if (world > 1 &&
             !(e->set_reduce && e->set_reduce(e, reduce_grads, &r->red, dist_bucket(), dist_overlap()))) {
    r->overlapped = false;
    void *comm = e->set_nccl ? dist_nccl_comm(r->err, sizeof r->err) : NULL;
    if (comm && e->set_nccl(e, comm, &r->red.poison)) {
      r->nccl = true;
    } else {
      diag_file_error(o->model_path, "the %s back end cannot reduce gradients over ranks%s%s", e->name,
                      r->err[0] ? ": " : " (data-parallel training runs on the interpreter and the compiled CPU and "
                                         "CUDA back ends)", r->err);
      r->rc = 1;
      r->last = r->start;
    }
  }
  if (r->fp8_shared && r->rc == 0)
    e->set_fp8_amax(e, fp8_amax_step, &r->fa);
  // (one process: no shards)
  ZeroShard *zero = r->zero = o->zero && world > 1 ? engine_shard(g, dist_rank(), world) : NULL;
  if (zero && r->rc == 0 && !(e->set_shard && e->set_shard(e, zero, gather_params, &r->red))) {
    diag_file_error(o->model_path, "the %s back end cannot shard the optimizer's state (--zero 1)", e->name);
    r->rc = 1;
    r->last = r->start;
  }
  if (zero && e->idle) // (a resumed run read every moment; a rank keeps its shard's)
    e->idle(e, false);
  if (zero && r->rc == 0 && !o->quiet) {
    int64_t own = 0, all = 0;
    for (int i = 0; i < g->n; i++)
      if (g->nodes[i]->op == OP_STATE) {
        all += 4 * shape_numel(g->nodes[i]->shape);
        own += engine_shard_owner(zero, g, i) == zero->rank ? 4 * shape_numel(g->nodes[i]->shape) : 0;
      }
    printf("ZeRO stage 1: rank %d updates parameters %d to %d of %d and keeps their moments, %.2f MB of %.2f MB\n",
           zero->rank, zero->first[zero->rank], zero->first[zero->rank + 1] - 1, g->nparams, (double)own / 1e6,
           (double)all / 1e6);
  }
}

// The engine's hooks of run_hooks taken back, and what they held freed.
void run_unhook(Run *r) {
  Engine *e = r->e, *micro = r->micro;
  if (r->world > 1 && e->set_reduce)
    e->set_reduce(e, NULL, NULL, 0, false);
  if (r->fp8_shared && e->set_fp8_amax)
    e->set_fp8_amax(e, NULL, NULL);
  if (r->fp8_shared && r->k > 1 && micro->set_fp8_lead)
    micro->set_fp8_lead(micro, NULL);
  free(r->fa.micro);
  free(r->fa.ones);
  free(r->fa.bits);
  if (r->nccl)
    e->set_nccl(e, NULL, NULL);
  if (r->zero && e->set_shard)
    e->set_shard(e, NULL, NULL, NULL);
  engine_shard_free(r->zero);
}

// One optimizer step: its micro-batches (gradient accumulation), its batch into the engine and the
// engine's step, and the step's loss, gradient norm and metrics on this rank. STEP_FAILED after saying
// why; STEP_NO_BATCH where the training data gave none (the caller says so).
int train_step(Run *r, RunStep *s) {
  const TrainOptions *o = r->o;
  const Graph *g = r->g;
  Engine *e = r->e;
  int64_t step = s->step, k = r->k;
  s->t0 = rt_now(), s->loss_sum = 0;
  s->real = 0;
  s->before = loader_state(r->train); // (a checkpoint of the step before this one resumes from it)
  if (k > 1 && !accumulate_micro(&r->ac, e, r->train, k, r->B * r->T, r->seed, step, &s->loss_sum, &s->real, r->err,
                                 sizeof r->err)) {
    progress_clear(&r->pg);
    diag_file_error(o->model_path, "step %lld: %s", (long long)step, r->err[0] ? r->err : "bad batch");
    r->rc = 1;
    return STEP_FAILED;
  }
  Batch batch;
  if (!loader_next(r->train, &batch)) // (the text it reads changed: the loader said how)
    return STEP_NO_BATCH;
  s->lr = rt_lr_at(&r->tc, step);
  e->set_scalar(e, "lr", s->lr);
  e->set_scalar(e, "step", (double)step);
  e->set_seed(e, step_seed(r->seed, k > 1 ? step * k + k - 1 : step));
  // A micro-batch whose loss is not finite: the step is not run (its optimizer would apply the
  // others' gradients regardless). With several ranks every rank runs it, that one sending NaN
  // gradients (reduce_grads), so that no rank's optimizer updates.
  s->micro_finite = isfinite(s->loss_sum), s->run = s->micro_finite || r->world > 1;
  Reduce *red = &r->red;
  red->step = step, red->poison = !s->micro_finite, red->seconds = red->busy = red->gather = 0;
  r->fa.step = step;
  if (!feed_batch(e, &batch, r->B * r->T) || (s->run && !e->step(e, r->err, sizeof r->err))) {
    progress_clear(&r->pg);
    diag_file_error(o->model_path, "step %lld: %s", (long long)step, r->err[0] ? r->err : "bad batch");
    r->rc = 1;
    return STEP_FAILED;
  }
  s->real += batch.real_tokens; // (with several ranks: the global batch's)
  // (NCCL: the device time of its all-reduce, and with --zero 1 its all-gather; buckets beside the
  // backward: the time the step waited for them; else the all-reduces' own, on the main thread
  // between the backward and the optimizer; and --zero 1's all-gather on the CPU after it)
  red->seconds = (r->nccl || r->overlapped ? e->reduce_seconds : red->busy) + red->gather;
  if (r->nccl)
    red->busy = e->reduce_seconds;
  s->loss = (s->loss_sum + (s->micro_finite ? engine_scalar(e, g->loss) : NAN)) / (double)k;
  s->norm = r->gnorm >= 0 && s->run ? engine_scalar(e, r->gnorm) : NAN;
  Metrics *met = &r->met;
  for (int j = 0; j < met->n; j++) {
    met->now[j] = (met->sum[j] + (s->micro_finite ? engine_scalar(e, met->node[j]) : NAN)) / (double)k;
    met->sum[j] = 0;
  }
  return STEP_RAN;
}

// The step's figures made the run's: with several ranks, the loss and metrics their means over the
// ranks, and a stop (s->stop) on any rank every rank's; its time, and its loss and metrics into the
// curves. False after saying why.
bool finish_step(Run *r, RunStep *s) {
  int world = r->world;
  Metrics *met = &r->met;
  Reduce *red = &r->red;
  double *shared = r->shared;
  if (world > 1) {
    shared[0] = s->loss, shared[met->n + 1] = s->stop ? 1 : 0;
    for (int j = 0; j < met->n; j++)
      shared[1 + j] = met->now[j];
    double t1 = rt_now();
    if (!dist_sum_f64(shared, met->n + 2, "the step's loss", s->step, r->err, sizeof r->err)) {
      diag_file_error(r->o->model_path, "step %lld: %s", (long long)s->step, r->err);
      r->rc = 1;
      return false;
    }
    red->seconds += rt_now() - t1;
    red->busy += rt_now() - t1;
    s->loss = shared[0] / world;
    for (int j = 0; j < met->n; j++)
      met->now[j] = shared[1 + j] / world;
    s->stop = shared[met->n + 1] > 0 ? (s->stop ? s->stop : SIGTERM) : 0;
  }
  s->dt = rt_now() - s->t0;
  r->step_secs += s->dt;
  r->comm_total += red->seconds;
  r->busy_total += red->busy;
  r->real_total += s->real;
  curve_push(&r->c.loss, &r->c.n, &r->c.cap, s->loss);
  for (int j = 0; j < met->n; j++)
    curve_push(&r->c.met, &r->c.nmet, &r->c.capmet, met->now[j]);
  return true;
}
