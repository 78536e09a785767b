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
//
// This file is the loop, stringing together the parts of the other files of runtime/train/ over one
// state (Run, train_impl.h): step.c's step, validate.c's validation, trainlog.c's lines, ckpt.c's
// checkpoints and outdir.c's output folder.
#include "data.h"
#include "runtime.h"
#include "train_impl.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

bool train_check_inputs(const Graph *g, const char *model_path, const char *data_dir, const char *out_dir, bool resume,
                        bool from_text, const char *weights) {
  bool arrays = arrays_found(data_dir), ok = arrays || shards_fit(g, data_dir); // (arrays: the driver's arrays_check)
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
    OutFiles out;
    out_files(out_dir, &out);
    ok = st_read(a, out.ckpt, &f) && checkpoint_fits(a, &f, out.ckpt, g, model_path, false);
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

static int train_loop(Engine *e, Engine *eval, Engine *micro, const TrainOptions *o, const char *ckpt,
                      const char *log_path, const char *svg);

int train_run(Engine *e, Engine *eval, Engine *micro, const TrainOptions *o) {
  const Graph *g = e->g;
  if (o->arrays ? ir_dim(g, "B") <= 0 : !shards_fit(g, o->data_dir)) {
    if (o->arrays)
      diag_file_error(o->model_path, "training on arrays needs a dim B: the examples a batch");
    return 1;
  }
  OutFiles out;
  out_files(o->out_dir, &out);
  bool created;
  int lock = o->out_claimed ? -1 : train_claim_out(o->out_dir, o->resume, &created);
  if (!o->out_claimed && lock < 0)
    return 1;
  int rc = train_loop(e, eval, micro, o, out.ckpt, out.log, out.svg);
  train_release_out(lock, o->out_dir, false);
  return rc;
}

// The loaders, the checkpoint of a resumed run, the initial parameters and the log; false after
// saying why, with nothing left open.
static bool run_open(Run *r) {
  const TrainOptions *o = r->o;
  const Graph *g = r->g;
  Engine *e = r->e;
  r->B = ir_dim(g, "B"), r->T = o->arrays ? 1 : ir_dim(g, "T"), r->V = ir_dim(g, "V"); // (arrays: B examples)
  remove_partial_writes(r->ckpt);
  // With several ranks the loaders give the global batch, N*B rows, and each rank takes its slice (feed_batch).
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
  r->peak = e->peak_flops > 0 ? e->peak_flops : rt_cpu_peak_flops(NULL, &peak_how), r->flops = rt_step_flops(g);
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
  // (every rank is here: the loss is shared)
  if (r->zero && !gather_moments(r->e, r->zero, step, r->err, sizeof r->err))
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
