// train.c: the training loop of `mdlc run`. Batches come from pre-tokenised shards (loader.c,
// packed by default) while the step runs, or with --tokenize-on-the-fly from the text they were
// made from, tokenised in the step's time (the same batches); every step appends a metrics line to
// OUT/log.jsonl, and prints it every log_every steps (on a terminal a progress line, rewritten in
// place, stands for the steps between); validation loss every val_every steps on a forward-only
// engine (and `mdlc eval`'s on a checkpoint: train_eval); a checkpoint every ckpt_every steps and
// at the end, written atomically in the background while the next steps run, so a kill -9 loses
// at most the steps since the last one written; --resume continues exactly (same
// parameters, moments, data position and dropout seeds, so the losses equal those of an
// uninterrupted run); OUT/loss.svg is drawn at the end. Ctrl-C (SIGINT) or SIGTERM lets the step
// under way finish, writes its checkpoint and stops (exit status 128 + the signal); a second one
// stops at once, as kill -9 would.
#include "data.h"
#include "runtime.h"
#include "train_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

bool train_check_inputs(const Graph *g, const char *model_path, const char *data_dir, const char *out_dir, bool resume,
                        bool from_text, const char *weights) {
  bool arrays = arrays_found(data_dir), ok = arrays || shards_fit(g, data_dir); // (arrays: main.c's arrays_check)
  for (int split = from_text; ok && !arrays && split < 2; split++) { // (batches from the text need no train shards)
    const char *name = split ? "val" : "train";
    char **paths;
    int n = shard_list(data_dir, name, &paths);
    if (n == 0)
      diag_file_error(data_dir, "no %s shards (%s_*.bin): make them with `mdlc prep TEXT -o %s`", name, name, data_dir);
    ok = n > 0;
    for (int i = 0; ok && i < n; i++) {
      Shard s;
      ok = shard_open(&s, paths[i], ir_dim(g, "V"));
      if (ok)
        shard_close(&s);
    }
    if (n >= 0)
      shard_list_free(paths, n);
  }
  Arena *a = arena_new();
  StFile f;
  if (ok && resume) {
    char ckpt[PATH_MAX + 32];
    snprintf(ckpt, sizeof ckpt, "%s/checkpoint.safetensors", out_dir);
    ok = st_read(a, ckpt, &f) && checkpoint_fits(a, &f, ckpt, g, model_path, false);
  }
  if (ok && weights)
    ok = st_read(a, weights, &f);
  for (int i = 0; ok && weights && i < g->nparams; i++)
    ok = st_expect(&f, weights, "", g->nodes[g->params[i]]) != NULL;
  arena_free(a);
  return ok;
}

// The first SIGINT or SIGTERM while training: the loop stops after the step under way, once its
// checkpoint is written. SA_RESETHAND: a second stops the process, as the signal always did. A
// signal ignored when the run began (a background job of a script, nohup) stays ignored. The handler
// runs on the thread's alternate signal stack (SA_ONSTACK): a GEMM kernel may have pointed the stack
// into the heap (gemm.c, "Signals").
static volatile sig_atomic_t stop_signal;
static void on_stop(int sig) { stop_signal = sig; }

typedef struct {
  struct sigaction old[2];
  bool set[2];
} StopSignals;
static const int stop_signals[2] = {SIGINT, SIGTERM};

static void catch_stop(StopSignals *s) {
  stop_signal = 0;
  rt_signal_stack();
  struct sigaction sa = {.sa_handler = on_stop, .sa_flags = SA_RESETHAND | SA_RESTART | SA_ONSTACK};
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < 2; i++)
    s->set[i] = sigaction(stop_signals[i], NULL, &s->old[i]) == 0 && s->old[i].sa_handler != SIG_IGN &&
                sigaction(stop_signals[i], &sa, NULL) == 0;
}

static void release_stop(StopSignals *s) {
  for (int i = 0; i < 2; i++)
    if (s->set[i])
      sigaction(stop_signals[i], &s->old[i], NULL);
}

// A run under way: what the parts of train_loop share from one step to the next.
typedef struct {
  Engine *e, *eval, *micro; // the step's engine, validation's (or NULL), the micro-batches' (or NULL)
  const TrainOptions *o;
  const Graph *g; // e's
  const char *ckpt, *log_path, *svg;
  int64_t B, T, V; // (arrays: T is 1, B examples a batch)
  int64_t k;       // micro-batches a step
  int world;       // the ranks (dist.c), 1 alone
  bool lead;       // writes the log, the checkpoints and the loss curve
  Loader *train, *val;
  LoaderState val_first;
  FILE *log;
  int64_t start, last; // the step it begins after (a resumed run's) and the step it stops after
  uint64_t seed;
  TrainConfig tc; // the train section, its steps those the schedule spans
  int gnorm;      // the gradient norm's node, or -1
  double peak, flops, unigram;
  int64_t val_batches, log_every;
  const char *unit; // of the rate: tok/s, or ex/s on arrays
  Metrics met;
  double *val_mean; // a validation's means (validate)
  Accum ac;
  Curve c;
  char err[512];
  int rc, stopped; // stopped: the signal that stopped the run
  CkptWriter writer;
  double t_start, last_val, step_secs;
  int64_t real_total, skipped, ckpt_step; // ckpt_step: the last checkpoint's step
  bool log_failed;
  Progress pg;
  Reduce red;
  double comm_total, busy_total, *shared;
  bool nccl, overlapped; // the gradients reduced by NCCL; in buckets beside the backward
  Fp8Amax fa;
  bool fp8_shared; // precision fp8 over several ranks or micro-batches: the step's amaxes are theirs
  ZeroShard *zero; // --zero 1 over several ranks, else NULL
} Run;

// One step of a run, as its parts see it.
typedef struct {
  int64_t step;
  double t0, loss_sum; // its start; the losses of its first k - 1 micro-batches
  int64_t real;        // the tokens (examples) it counted
  LoaderState before;  // the data position at its start (a checkpoint of the step before resumes from it)
  double lr, loss, norm, dt;
  bool micro_finite, run; // its micro-batches' losses were finite; the step engine ran
  int stop;               // the SIGINT or SIGTERM it stops the run at, or 0
  bool nonfinite, do_val;
} RunStep;
enum { STEP_RAN, STEP_FAILED, STEP_NO_BATCH };

static int train_loop(Engine *e, Engine *eval, Engine *micro, const TrainOptions *o, const char *ckpt,
                      const char *log_path, const char *svg);

int train_run(Engine *e, Engine *eval, Engine *micro, const TrainOptions *o) {
  const Graph *g = e->g;
  if (o->arrays ? ir_dim(g, "B") <= 0 : !shards_fit(g, o->data_dir)) {
    if (o->arrays)
      diag_file_error(o->model_path, "training on arrays needs a dim B: the examples a batch");
    return 1;
  }
  char ckpt[PATH_MAX + 32], log_path[PATH_MAX + 16], svg[PATH_MAX + 16];
  snprintf(ckpt, sizeof ckpt, "%s/checkpoint.safetensors", o->out_dir);
  snprintf(log_path, sizeof log_path, "%s/log.jsonl", o->out_dir);
  snprintf(svg, sizeof svg, "%s/loss.svg", o->out_dir);
  bool created;
  int lock = o->out_claimed ? -1 : train_claim_out(o->out_dir, o->resume, &created);
  if (!o->out_claimed && lock < 0)
    return 1;
  int rc = train_loop(e, eval, micro, o, ckpt, log_path, svg);
  train_release_out(lock, o->out_dir, false);
  return rc;
}
// A write cut short (kill -9) leaves its temporary file; the checkpoint itself is whole.
static void remove_partial_writes(const char *ckpt) {
  char pattern[PATH_MAX + 48];
  snprintf(pattern, sizeof pattern, "%s.tmp.*", ckpt);
  glob_t gl;
  if (glob(pattern, 0, NULL, &gl) == 0)
    for (size_t i = 0; i < gl.gl_pathc; i++)
      unlink(gl.gl_pathv[i]);
  globfree(&gl);
}

// The loaders, the checkpoint of a resumed run, the initial parameters and the log; false after
// saying why, with nothing left open.
static bool run_open(Run *r) {
  const TrainOptions *o = r->o;
  const Graph *g = r->g;
  Engine *e = r->e;
  r->B = ir_dim(g, "B"), r->T = o->arrays ? 1 : ir_dim(g, "T"), r->V = ir_dim(g, "V"); // (arrays: B examples)
  remove_partial_writes(r->ckpt);
  // With several ranks the loaders give the global batch, N*B rows, and each rank takes its slice (feed).
  r->world = dist_on() ? dist_size() : 1;
  r->lead = dist_rank() == 0; // writes the log, the checkpoints and the loss curve
  LoaderOptions lo = {.B = r->B * r->world, .T = r->T, .vocab = r->V, .pack = o->pack, .shuffle = o->shuffle,
                      .seed = o->seed, .model = o->arrays ? g : NULL, .val_fraction = o->val_fraction},
                lt = lo;
  lt.from_text = o->tokenize_on_the_fly; // (validation batches come from the shards either way)
  lo.shuffle &= !o->arrays;              // (arrays: validation in the split's order, each example once)
  r->train = loader_open(o->data_dir, "train", lt);
  if (!r->train)
    return false;
  r->val = r->eval ? loader_open(o->data_dir, "val", lo) : NULL;
  if (r->eval && !r->val) {
    loader_close(r->train);
    return false;
  }
  r->val_first = r->val ? loader_state(r->val) : (LoaderState){0, 0};
  r->start = 0;
  r->seed = o->seed;
  bool ok = true;
  if (o->resume) {
    LoaderState ls;
    ok = read_checkpoint(r->ckpt, e, o->model_path, o->zero ? r->world : 1, &r->start, &ls, &r->seed) &&
         loader_seek(r->train, ls) && (!r->lead || truncate_log(r->log_path, r->start));
    if (ok && !o->quiet)
      printf("resumed from %s at step %lld\n", r->ckpt, (long long)r->start);
  }
  // The initial parameters a checkpoint or --weights did not write (all of them, or none), drawn
  // before the first step so that its time leaves the draw out.
  char draw_err[256];
  if (ok && e->draw_params && !e->draw_params(e, draw_err, sizeof draw_err)) {
    diag_file_error(o->model_path, "the initial parameters: %s", draw_err);
    ok = false;
  }
  if (ok) {
    r->log = r->lead ? fopen(r->log_path, o->resume ? "a" : "w") : fopen("/dev/null", "w");
    if (!r->log)
      diag_file_error(r->log_path, "cannot write: %s", strerror(errno));
    ok = r->log != NULL;
  }
  if (!ok) {
    loader_close(r->train);
    if (r->val)
      loader_close(r->val);
  }
  return ok;
}

// What the run will do (the steps, the schedule's span, the figures it reports against) and its
// metrics and gradient accumulation, saying so unless --quiet.
static void run_plan(Run *r) {
  const TrainOptions *o = r->o;
  const Graph *g = r->g;
  Engine *e = r->e;
  // The run stops after step `last`; the schedule spans the train section's steps (so a run stopped
  // early and resumed follows the same learning rates), or this run when the section sets none.
  r->tc = g->train;
  r->last = o->steps > 0 ? o->steps : r->tc.steps > 0 ? r->tc.steps : 100;
  if (r->tc.steps <= 0)
    r->tc.steps = r->last;
  r->gnorm = -1;
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_GRAD_NORM)
      r->gnorm = i;
  const char *peak_how = e->peak_how;
  r->peak = e->peak_flops > 0 ? e->peak_flops : rt_cpu_peak_flops(false, &peak_how), r->flops = rt_step_flops(g);
  r->unigram = o->arrays ? NAN : unigram_entropy(o->data_dir, r->V);
  r->val_batches = o->arrays && r->val ? array_val_batches(r->val, r->B * r->world, o->val_batches) : o->val_batches;
  r->unit = o->arrays ? "ex/s" : "tok/s";
  if (!o->quiet)
    printf("MFU = model flops (3x forward GEMM + attention flops counted in the graph: %.3g per step) / %s\n",
           r->flops, peak_how);
  if (!o->quiet && o->arrays)
    printf("data %s: %lld train examples, %lld held out for validation (%lld batches); %s batches of %lld "
           "examples\n", o->data_dir, (long long)loader_rows(r->train), r->val ? (long long)loader_rows(r->val) : 0LL,
           (long long)r->val_batches, o->shuffle ? "shuffled" : "ordered", (long long)r->B);
  else if (!o->quiet) {
    printf("data %s: %lld train tokens, unigram entropy %.3f nats/token; %s batches of %lldx%lld%s\n", o->data_dir,
           (long long)loader_tokens(r->train), r->unigram, o->pack ? "packed" : "padded", (long long)r->B,
           (long long)r->T, o->tokenize_on_the_fly ? ", tokenised from the text as each is drawn, in the step's time "
                                                    "(validation batches from the shards)" : "");
  }
  r->k = g->train.accumulate > 1 ? g->train.accumulate : 1;
  r->met = metrics_of(g, r->eval ? r->eval->g : NULL);
  r->val_mean = rt_xrealloc(NULL, sizeof(double) * (size_t)((r->eval ? r->eval->g->noutputs : 0) + 1));
  r->ac = (Accum){.micro = r->micro, .metrics = &r->met};
  if (r->k > 1) {
    Accum *ac = &r->ac;
    ac->sum = rt_xrealloc(NULL, (size_t)g->nparams * sizeof *ac->sum);
    memset(ac->sum, 0, (size_t)g->nparams * sizeof *ac->sum);
    ac->names = arena_alloc(g->arena, sizeof *ac->names * (size_t)g->nparams);
    ac->param = arena_alloc(g->arena, sizeof *ac->param * (size_t)g->nparams);
    ac->grads = arena_alloc(g->arena, sizeof *ac->grads * (size_t)g->nparams);
    for (int i = 0; i < g->nparams; i++)
      if (r->micro->g->grads[i] >= 0) {
        ac->param[ac->n] = i;
        ac->grads[ac->n] = r->micro->g->grads[i];
        ac->names[ac->n++] = arena_printf(g->arena, "acc.%s", g->nodes[g->params[i]]->name);
      }
    if (!o->quiet && o->arrays)
      printf("gradient accumulation: %lld micro-batches of %lld examples per step\n", (long long)r->k,
             (long long)r->B);
    else if (!o->quiet)
      printf("gradient accumulation: %lld micro-batches of %lldx%lld per step\n", (long long)r->k, (long long)r->B,
             (long long)r->T);
  }
}

// The engine's hooks for data parallel (the gradients' reduce: by the engine, or by NCCL), for
// precision fp8 over several ranks or micro-batches, and for --zero 1; an engine that lacks one the
// run needs ends it before its first step (rc 1, last = start), after saying so.
static void run_hooks(Run *r) {
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
  ZeroShard *zero = r->zero = o->zero && world > 1 ? engine_shard(g, dist_rank(), world) : NULL; // (one process: no shards)
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
static void run_unhook(Run *r) {
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
static int train_step(Run *r, RunStep *s) {
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
  if (!feed(e, &batch, r->B * r->T) || (s->run && !e->step(e, r->err, sizeof r->err))) {
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
static bool finish_step(Run *r, RunStep *s) {
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
  push(&r->c.loss, &r->c.n, &r->c.cap, s->loss);
  for (int j = 0; j < met->n; j++)
    push(&r->c.met, &r->c.nmet, &r->c.capmet, met->now[j]);
  return true;
}

// Validation at the steps it is due (every val_every and the last, unless the step is not finite),
// its figures into the curves; false after saying why it failed.
static bool validate_step(Run *r, RunStep *s) {
  // A loss or gradient norm that is not finite: the optimizer left the weights and moments as they
  // were (emit_c.c, emit_cuda.c, engine.c's interpreter test the same two values), so they are the
  // last finite ones.
  const TrainOptions *o = r->o;
  int64_t step = s->step;
  Curve *c = &r->c;
  s->nonfinite = !isfinite(s->loss) || (r->gnorm >= 0 && !isfinite(s->norm));
  s->do_val = r->eval && !s->nonfinite && ((o->val_every > 0 && step % o->val_every == 0) || step == r->last);
  if (!s->do_val)
    return true;
  r->last_val = validate(r->e, r->eval, r->val, r->val_first, r->val_batches, r->B * r->T, r->val_mean, r->err,
                         sizeof r->err);
  if (isnan(r->last_val)) {
    progress_clear(&r->pg);
    diag_file_error(o->model_path, "validation at step %lld: %s", (long long)step, r->err);
    r->rc = 1;
    return false;
  }
  if (c->nval == c->capval) {
    c->capval = c->capval ? 2 * c->capval : 64;
    c->val = rt_xrealloc(c->val, sizeof(double) * (size_t)c->capval);
    c->val_step = rt_xrealloc(c->val_step, sizeof(int64_t) * (size_t)c->capval);
  }
  c->val[c->nval] = r->last_val;
  c->val_step[c->nval++] = step - r->start;
  for (int j = 0; j < r->met.n; j++)
    push(&c->val_met, &c->nvalmet, &c->capvalmet, r->met.val[j] >= 0 ? r->val_mean[1 + r->met.val[j]] : NAN);
  return true;
}

// The step's line (a full one, else on a terminal the progress line) and its line of log.jsonl; a
// log that cannot be written is said once, and ends the run (log_failed, rc 1).
static void log_step(Run *r, const RunStep *s) {
  const TrainOptions *o = r->o;
  Engine *e = r->e, *eval = r->eval, *micro = r->micro;
  const Metrics *met = &r->met;
  const Curve *c = &r->c;
  int64_t step = s->step, start = r->start, last = r->last;
  double loss = s->loss, dt = s->dt;
  // Peak memory: the process's on the host, and what the engines hold on a device (allocated when
  // each is built, and a checkpoint's snapshot at the first checkpoint: never freed before the end,
  // so also their peak there).
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  int64_t device =
      e->device_bytes + (eval ? eval->device_bytes : 0) + (micro && micro != e ? micro->device_bytes : 0);
  char device_s[48] = "";
  if (device > 0)
    snprintf(device_s, sizeof device_s, ", device %.0f MB", (double)device / 1e6);
  double elapsed = rt_now() - r->t_start, left = elapsed / (double)(step - start) * (double)(last - step);
  char eta_s[32];
  eta(left, eta_s, sizeof eta_s);
  double tok_s = (double)s->real / dt, mfu = 100.0 * (double)r->k * r->flops / dt / r->peak;
  if (isfinite(loss)) {
    r->pg.ema = 0.9 * r->pg.ema + 0.1 * loss;
    r->pg.weight = 0.9 * r->pg.weight + 0.1;
  }
  char met_s[512], comm_s[48] = "";
  if (r->world > 1)
    snprintf(comm_s, sizeof comm_s, " | comm %.1f ms", 1e3 * r->red.seconds);
  if (!o->quiet && (step == start + 1 || step == last || step % r->log_every == 0 || s->do_val)) {
    progress_clear(&r->pg);
    printf("step %5lld/%lld | loss %.4f%s | lr %.2e | norm %6.3f | %7.1f ms%s | %8.0f %s | MFU %5.2f%% | "
           "peak %.0f MB%s | ETA %s\n",
           (long long)step, (long long)last, loss, metrics_line(met, met->now, " | ", "", met_s, sizeof met_s), s->lr,
           s->norm, 1e3 * dt, comm_s, tok_s, r->unit, mfu, (double)ru.ru_maxrss * 1024.0 / 1e6, device_s,
           eta_s); // (ru_maxrss: KiB; MB as the arena's)
    if (s->do_val && o->arrays)
      printf("step %5lld/%lld | val loss %.4f%s\n", (long long)step, (long long)last, r->last_val,
             metrics_line(met, c->val_met + c->nvalmet - met->n, " | ", "val ", met_s, sizeof met_s));
    else if (s->do_val)
      printf("step %5lld/%lld | val loss %.4f (unigram entropy %.4f)%s\n", (long long)step, (long long)last,
             r->last_val, r->unigram,
             metrics_line(met, c->val_met + c->nvalmet - met->n, " | ", "val ", met_s, sizeof met_s));
  } else if (r->pg.on) {
    progress_show(&r->pg, step, last, (double)r->real_total / r->step_secs,
                  100.0 * (double)r->k * r->flops * (double)(step - start) / r->step_secs / r->peak, eta_s);
  }
  fflush(stdout);
  // (a full disk: the log's write fails as the checkpoint's will; each is reported, once)
  FILE *log = r->log;
  bool logged = fprintf(log, "{\"step\":%lld,\"loss\":%.6f,\"lr\":%.6g,\"grad_norm\":%.6g,\"ms\":%.3f,\"%s\":%.1f,"
                        "\"mfu\":%.4f", (long long)step, loss, s->lr, s->norm, 1e3 * dt, o->arrays ? "ex_s" : "tok_s",
                        tok_s, mfu) > 0;
  if (r->world > 1)
    logged &= fprintf(log, ",\"comm_ms\":%.3f,\"allreduce_ms\":%.3f", 1e3 * r->red.seconds, 1e3 * r->red.busy) > 0;
  for (int j = 0; j < met->n; j++)
    logged &= fprintf(log, ",\"%s\":%.6g", met->name[j], met->now[j]) > 0;
  if (s->do_val)
    logged &= fprintf(log, ",\"val_loss\":%.6f", r->last_val) > 0;
  for (int j = 0; s->do_val && j < met->n; j++)
    logged &= fprintf(log, ",\"val_%s\":%.6g", met->name[j], c->val_met[c->nvalmet - met->n + j]) > 0;
  logged &= fprintf(log, "}\n") > 0;
  logged &= fflush(log) == 0;
  if (!logged && !r->log_failed) {
    progress_clear(&r->pg);
    diag_file_error(r->log_path, "cannot write the log at step %lld: %s; stopping", (long long)step, strerror(errno));
    r->log_failed = true;
    r->rc = 1;
  }
}

// A step with no batch (the text it reads changed: the loader said how): the run stops with the
// weights of the step before.
static void stop_without_batch(Run *r, const RunStep *s) {
  char kept[PATH_MAX + 96];
  r->rc = 1;
  progress_clear(&r->pg);
  snprintf(kept, sizeof kept, "rank 0 keeps them");
  if (r->lead)
    keep_step_before(&r->writer, r->ckpt, r->e, r->o, s->step, r->ckpt_step, s->before, kept, sizeof kept);
  diag_file_error(r->o->model_path, "step %lld: no batch; stopping with the weights of step %lld: %s",
                  (long long)s->step, (long long)s->step - 1, kept);
}

// A step that is not finite: skipped, with a warning, while --skip-nonfinite allows; else the run
// stops with the weights of the step before (false).
static bool skip_nonfinite(Run *r, const RunStep *s) {
  const TrainOptions *o = r->o;
  int64_t step = s->step;
  char why[400];
  progress_clear(&r->pg);
  nonfinite_culprit(r->e, s->loss, why, sizeof why);
  if (r->skipped < o->skip_nonfinite) {
    r->skipped++;
    fprintf(stderr, "mdlc: warning: step %lld: %s: the step is skipped, the weights are not updated (%lld of "
            "--skip-nonfinite %lld)\n", (long long)step, why, (long long)r->skipped, (long long)o->skip_nonfinite);
    return true;
  }
  char kept[PATH_MAX + 96] = "rank 0 keeps them";
  r->rc = 1;
  if (r->zero && !gather_moments(r->e, r->zero, step, r->err, sizeof r->err)) // (every rank is here: the loss is shared)
    snprintf(kept, sizeof kept, "%s", r->err);
  else if (r->lead)
    keep_step_before(&r->writer, r->ckpt, r->e, o, step, r->ckpt_step, s->before, kept, sizeof kept);
  diag_file_error(o->model_path, "step %lld: %s; stopping with the weights of step %lld, which it did not "
                  "change: %s (--skip-nonfinite N skips up to N such steps)", (long long)step, why,
                  (long long)step - 1, kept);
  return false;
}

// The step's checkpoint where one is due (every ckpt_every, the last, a stop, or a log that failed),
// and the end of the run after a log that failed or a stop; false when the run ends here.
static bool checkpoint_step(Run *r, const RunStep *s) {
  const TrainOptions *o = r->o;
  int64_t step = s->step;
  if (!ckpt_poll(&r->writer)) {
    progress_clear(&r->pg);
    r->rc = 1;
    return false;
  }
  // (--zero 1: every rank sends rank 0 its moments first, at the steps every rank checkpoints; a
  // log that rank 0 alone failed to write stops it without a checkpoint, the last one standing)
  bool every = (o->ckpt_every > 0 && step % o->ckpt_every == 0) || step == r->last || s->stop;
  if (every || (r->log_failed && !r->zero)) {
    if (r->zero && !gather_moments(r->e, r->zero, step, r->err, sizeof r->err)) {
      diag_file_error(o->model_path, "step %lld: %s", (long long)step, r->err);
      r->rc = 1;
      return false;
    }
    if (r->lead && !ckpt_start(&r->writer, r->ckpt, r->e, o, step, loader_state(r->train))) {
      progress_clear(&r->pg);
      r->rc = 1;
      return false;
    }
    r->ckpt_step = step;
  }
  if (r->log_failed) {
    progress_clear(&r->pg);
    if (ckpt_wait(&r->writer) && r->ckpt_step == step)
      fprintf(stderr, "mdlc: wrote the checkpoint of step %lld to %s; continue with --resume\n", (long long)step,
              r->ckpt);
    return false;
  }
  if (s->stop) {
    progress_clear(&r->pg);
    if (!ckpt_wait(&r->writer)) {
      r->rc = 1;
      return false;
    }
    if (r->lead)
      printf("%s at step %lld: wrote %s; continue with --resume\n",
             s->stop == SIGINT ? "interrupted (SIGINT)" : "terminated (SIGTERM)", (long long)step, r->ckpt);
    r->stopped = s->stop;
    return false;
  }
  return true;
}

// The end of a run that trained: its rates, final figures and loss curve.
static void log_summary(Run *r) {
  const TrainOptions *o = r->o;
  const Metrics *met = &r->met;
  const Curve *c = &r->c;
  const char *unit = r->unit;
  // The whole run's rate, and the steps' alone: on a GPU a 30-step run spends most of its time
  // validating and writing checkpoints (GPT-2 124M on an H200: 0.9 s of steps in 4.2 s).
  double secs = rt_now() - r->t_start;
  char val_s[48] = "no validation", met_s[512], val_met_s[512] = "", unigram_s[48] = "";
  if (!isnan(r->last_val)) // (a run stopped before its last step, with --val-every 0, has none)
    snprintf(val_s, sizeof val_s, "val loss %.4f", r->last_val);
  if (!isnan(r->last_val) && met->n)
    metrics_line(met, c->val_met + c->nvalmet - met->n, ", ", "val ", val_met_s, sizeof val_met_s);
  if (!o->arrays)
    snprintf(unigram_s, sizeof unigram_s, ", unigram entropy %.4f", r->unigram);
  printf("trained %lld steps in %.1f s (%.0f %s; in the steps alone %.1f s, %.0f %s, the rest validation "
         "and checkpoints); final loss %.4f%s, %s%s%s\n",
         (long long)c->n, secs, (double)r->real_total / secs, unit, r->step_secs, (double)r->real_total / r->step_secs,
         unit, c->loss[c->n - 1], metrics_line(met, c->met + c->nmet - met->n, ", ", "", met_s, sizeof met_s), val_s,
         val_met_s, unigram_s);
  if (r->world > 1)
    printf("data parallel over %d ranks: %.0f %s a rank; waiting on the all-reduces %.1f s, %.1f%% of the steps' "
           "time (in them %.1f s%s)\n", r->world, (double)r->real_total / r->step_secs / r->world, unit,
           r->comm_total, 100.0 * r->comm_total / r->step_secs, r->busy_total,
           r->overlapped ? ", the rest beside the backward" : "");
  if (!write_svg(r->svg, c, met->name, met->n, r->unigram, o->arrays))
    diag_file_error(r->svg, "cannot write the loss curve: %s", strerror(errno));
  printf("wrote %s, %s and %s\n", r->ckpt, r->log_path, r->svg);
}

// The run's end, after its last checkpoint: the log closed, the summary, and everything it held let
// go. The exit status.
static int run_close(Run *r) {
  if (fclose(r->log) != 0 && !r->log_failed) {
    diag_file_error(r->log_path, "cannot write the log: %s", strerror(errno));
    r->rc = 1;
  }
  if (r->rc == 0 && r->c.n > 0 && r->lead)
    log_summary(r);
  for (int i = 0; r->k > 1 && i < r->ac.n; i++)
    free(r->ac.sum[i]);
  free(r->ac.sum);
  free(r->ac.tmp);
  free(r->c.loss);
  free(r->c.val);
  free(r->c.val_step);
  free(r->c.met);
  free(r->c.val_met);
  free(r->val_mean);
  free(r->shared);
  run_unhook(r);
  metrics_free(&r->met);
  loader_close(r->train);
  if (r->val)
    loader_close(r->val);
  return r->rc ? r->rc : r->stopped ? 128 + r->stopped : 0;
}

// The loop: each step runs (train_step), its figures are made the run's (finish_step), validated
// where due, logged, and checkpointed where due, until the last step, an error or a stop.
static int train_loop(Engine *e, Engine *eval, Engine *micro, const TrainOptions *o, const char *ckpt,
                      const char *log_path, const char *svg) {
  Run r = {.e = e, .eval = eval, .micro = micro, .o = o, .g = e->g, .ckpt = ckpt, .log_path = log_path, .svg = svg};
  if (!run_open(&r))
    return 1;
  run_plan(&r);
  StopSignals stops;
  catch_stop(&stops);
  r.writer = (CkptWriter){.ok = true};
  r.t_start = rt_now(), r.last_val = NAN;
  r.ckpt_step = o->resume ? r.start : -1;
  // A full line for the first step, the last, every log_every-th and each validation; on a terminal,
  // the progress line between them; with --quiet, neither.
  r.log_every = o->log_every > 0 ? o->log_every : train_log_every(r.last);
  r.pg = (Progress){.on = !o->quiet && isatty(STDOUT_FILENO) && r.world == 1}; // (mpirun's ranks write to a pty)
  r.red = (Reduce){.e = e};
  r.shared = rt_xrealloc(NULL, sizeof(double) * (size_t)(r.met.n + 2));
  run_hooks(&r);
  for (int64_t step = r.start + 1; step <= r.last; step++) {
    RunStep s = {.step = step};
    int ran = train_step(&r, &s);
    if (ran == STEP_NO_BATCH)
      stop_without_batch(&r, &s);
    if (ran != STEP_RAN)
      break;
    s.stop = stop_signal; // (read once the step has run: a signal during it stops the run at this step)
    if (!finish_step(&r, &s) || !validate_step(&r, &s))
      break;
    log_step(&r, &s);
    if ((s.nonfinite && !skip_nonfinite(&r, &s)) || !checkpoint_step(&r, &s))
      break;
  }
  progress_clear(&r.pg);
  if (!ckpt_free(&r.writer))
    r.rc = 1;
  release_stop(&stops);
  return run_close(&r);
}
