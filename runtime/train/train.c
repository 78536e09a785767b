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

static int train_loop(Engine *e, Engine *eval, Engine *micro, const TrainOptions *o, const char *ckpt,
                      const char *log_path, const char *svg) {
  const Graph *g = e->g;
  int64_t B = ir_dim(g, "B"), T = o->arrays ? 1 : ir_dim(g, "T"), V = ir_dim(g, "V"); // (arrays: B examples)
  // A write cut short (kill -9) leaves its temporary file; the checkpoint itself is whole.
  char pattern[PATH_MAX + 48];
  snprintf(pattern, sizeof pattern, "%s.tmp.*", ckpt);
  glob_t gl;
  if (glob(pattern, 0, NULL, &gl) == 0)
    for (size_t i = 0; i < gl.gl_pathc; i++)
      unlink(gl.gl_pathv[i]);
  globfree(&gl);
  // With several ranks the loaders give the global batch, N*B rows, and each rank takes its slice (feed).
  int world = dist_on() ? dist_size() : 1;
  bool lead = dist_rank() == 0; // writes the log, the checkpoints and the loss curve
  LoaderOptions lo = {.B = B * world, .T = T, .vocab = V, .pack = o->pack, .shuffle = o->shuffle, .seed = o->seed,
                      .model = o->arrays ? g : NULL, .val_fraction = o->val_fraction},
                lt = lo;
  lt.from_text = o->tokenize_on_the_fly; // (validation batches come from the shards either way)
  lo.shuffle &= !o->arrays;              // (arrays: validation in the split's order, each example once)
  Loader *train = loader_open(o->data_dir, "train", lt);
  if (!train)
    return 1;
  Loader *val = eval ? loader_open(o->data_dir, "val", lo) : NULL;
  if (eval && !val) {
    loader_close(train);
    return 1;
  }
  LoaderState val_first = val ? loader_state(val) : (LoaderState){0, 0};
  int64_t start = 0;
  uint64_t seed = o->seed;
  if (o->resume) {
    LoaderState ls;
    if (!read_checkpoint(ckpt, e, o->model_path, o->zero ? world : 1, &start, &ls, &seed) || !loader_seek(train, ls) ||
        (lead && !truncate_log(log_path, start))) {
      loader_close(train);
      if (val)
        loader_close(val);
      return 1;
    }
    if (!o->quiet)
      printf("resumed from %s at step %lld\n", ckpt, (long long)start);
  }
  // The initial parameters a checkpoint or --weights did not write (all of them, or none), drawn
  // before the first step so that its time leaves the draw out.
  char draw_err[256];
  if (e->draw_params && !e->draw_params(e, draw_err, sizeof draw_err)) {
    diag_file_error(o->model_path, "the initial parameters: %s", draw_err);
    loader_close(train);
    if (val)
      loader_close(val);
    return 1;
  }
  FILE *log = lead ? fopen(log_path, o->resume ? "a" : "w") : fopen("/dev/null", "w");
  if (!log) {
    diag_file_error(log_path, "cannot write: %s", strerror(errno));
    loader_close(train);
    if (val)
      loader_close(val);
    return 1;
  }
  // The run stops after step `last`; the schedule spans the train section's steps (so a run stopped
  // early and resumed follows the same learning rates), or this run when the section sets none.
  TrainConfig tc = g->train;
  int64_t last = o->steps > 0 ? o->steps : tc.steps > 0 ? tc.steps : 100;
  if (tc.steps <= 0)
    tc.steps = last;
  int gnorm = -1;
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_GRAD_NORM)
      gnorm = i;
  const char *peak_how = e->peak_how;
  double peak = e->peak_flops > 0 ? e->peak_flops : rt_cpu_peak_flops(false, &peak_how), flops = rt_step_flops(g);
  double unigram = o->arrays ? NAN : unigram_entropy(o->data_dir, V);
  int64_t val_batches = o->arrays && val ? array_val_batches(val, B * world, o->val_batches) : o->val_batches;
  const char *unit = o->arrays ? "ex/s" : "tok/s";
  if (!o->quiet)
    printf("MFU = model flops (3x forward GEMM + attention flops counted in the graph: %.3g per step) / %s\n", flops,
           peak_how);
  if (!o->quiet && o->arrays)
    printf("data %s: %lld train examples, %lld held out for validation (%lld batches); %s batches of %lld "
           "examples\n", o->data_dir, (long long)loader_rows(train), val ? (long long)loader_rows(val) : 0LL,
           (long long)val_batches, o->shuffle ? "shuffled" : "ordered", (long long)B);
  else if (!o->quiet) {
    printf("data %s: %lld train tokens, unigram entropy %.3f nats/token; %s batches of %lldx%lld%s\n", o->data_dir,
           (long long)loader_tokens(train), unigram, o->pack ? "packed" : "padded", (long long)B, (long long)T,
           o->tokenize_on_the_fly ? ", tokenised from the text as each is drawn, in the step's time (validation "
                                    "batches from the shards)" : "");
  }
  int64_t k = g->train.accumulate > 1 ? g->train.accumulate : 1;
  Metrics met = metrics_of(g, eval ? eval->g : NULL);
  double *val_mean = rt_xrealloc(NULL, sizeof(double) * (size_t)((eval ? eval->g->noutputs : 0) + 1));
  Accum ac = {.micro = micro, .metrics = &met};
  if (k > 1) {
    ac.sum = rt_xrealloc(NULL, (size_t)g->nparams * sizeof *ac.sum);
    memset(ac.sum, 0, (size_t)g->nparams * sizeof *ac.sum);
    ac.names = arena_alloc(g->arena, sizeof *ac.names * (size_t)g->nparams);
    ac.param = arena_alloc(g->arena, sizeof *ac.param * (size_t)g->nparams);
    ac.grads = arena_alloc(g->arena, sizeof *ac.grads * (size_t)g->nparams);
    for (int i = 0; i < g->nparams; i++)
      if (micro->g->grads[i] >= 0) {
        ac.param[ac.n] = i;
        ac.grads[ac.n] = micro->g->grads[i];
        ac.names[ac.n++] = arena_printf(g->arena, "acc.%s", g->nodes[g->params[i]]->name);
      }
    if (!o->quiet && o->arrays)
      printf("gradient accumulation: %lld micro-batches of %lld examples per step\n", (long long)k, (long long)B);
    else if (!o->quiet)
      printf("gradient accumulation: %lld micro-batches of %lldx%lld per step\n", (long long)k, (long long)B,
             (long long)T);
  }
  Curve c = {0};
  char err[512] = "";
  int rc = 0, stopped = 0; // stopped: the signal that stopped the run
  StopSignals stops;
  catch_stop(&stops);
  CkptWriter writer = {.ok = true};
  double t_start = rt_now(), last_val = NAN, step_secs = 0;
  int64_t real_total = 0, skipped = 0, ckpt_step = o->resume ? start : -1; // the last checkpoint's step
  bool log_failed = false;
  // A full line for the first step, the last, every log_every-th and each validation; on a terminal,
  // the progress line between them; with --quiet, neither.
  int64_t log_every = o->log_every > 0 ? o->log_every : train_log_every(last);
  Progress pg = {.on = !o->quiet && isatty(STDOUT_FILENO) && world == 1}; // (mpirun's ranks write to a pty)
  Reduce red = {.e = e};
  double comm_total = 0, busy_total = 0, *shared = rt_xrealloc(NULL, sizeof(double) * (size_t)(met.n + 2));
  // Several ranks: the gradients are reduced in host memory by MPI (the CPU back end), or on the GPUs
  // by NCCL (the CUDA back end).
  bool nccl = false, overlapped = world > 1 && dist_bucket() > 0 && dist_overlap() && e->set_reduce;
  // Precision fp8 over several ranks or micro-batches: the step's amaxes are theirs (Fp8Amax).
  Fp8Amax fa = {0};
  bool fp8_shared = e->fp8 && (world > 1 || k > 1);
  if (fp8_shared) {
    fa.n = e->fp8(e)->n;
    fa.micro = rt_xrealloc(NULL, sizeof(float) * (size_t)fa.n);
    fa.ones = rt_xrealloc(NULL, sizeof(float) * (size_t)fa.n);
    fa.bits = rt_xrealloc(NULL, sizeof(uint32_t) * (size_t)fa.n);
    for (int i = 0; i < fa.n; i++)
      fa.ones[i] = 1;
    ac.fp8 = k > 1 ? &fa : NULL;
  }
  bool led = k <= 1 || (micro->fp8 && micro->set_fp8_lead && micro->fp8(micro)->n == fa.n);
  if (fp8_shared && (!e->set_fp8_amax || !led)) {
    diag_file_error(o->model_path, "precision fp8 %s on the %s back end: its engines do not share the fp8 scales "
                    "and amaxes%s; use bf16 there, or --backend cpu", world > 1 ? "over several ranks" :
                    "with gradient accumulation (accumulate > 1)", e->name,
                    world > 1 ? " over the ranks" : " over the micro-batches");
    rc = 1;
    last = start;
    overlapped = false;
  } else if (world > 1 && !(e->set_reduce && e->set_reduce(e, reduce_grads, &red, dist_bucket(), dist_overlap()))) {
    overlapped = false;
    void *comm = e->set_nccl ? dist_nccl_comm(err, sizeof err) : NULL;
    if (comm && e->set_nccl(e, comm, &red.poison)) {
      nccl = true;
    } else {
      diag_file_error(o->model_path, "the %s back end cannot reduce gradients over ranks%s%s", e->name,
                      err[0] ? ": " : " (data-parallel training runs on the interpreter and the compiled CPU and "
                                      "CUDA back ends)", err);
      rc = 1;
      last = start;
    }
  }
  if (fp8_shared && rc == 0)
    e->set_fp8_amax(e, fp8_amax_step, &fa);
  ZeroShard *zero = o->zero && world > 1 ? engine_shard(g, dist_rank(), world) : NULL; // (one process: no shards)
  if (zero && rc == 0 && !(e->set_shard && e->set_shard(e, zero, gather_params, &red))) {
    diag_file_error(o->model_path, "the %s back end cannot shard the optimizer's state (--zero 1)", e->name);
    rc = 1;
    last = start;
  }
  if (zero && e->idle) // (a resumed run read every moment; a rank keeps its shard's)
    e->idle(e, false);
  if (zero && rc == 0 && !o->quiet) {
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
  for (int64_t step = start + 1; step <= last; step++) {
    double t0 = rt_now(), loss_sum = 0;
    int64_t real = 0;
    LoaderState before = loader_state(train); // (a checkpoint of the step before this one resumes from it)
    if (k > 1 && !accumulate_micro(&ac, e, train, k, B * T, seed, step, &loss_sum, &real, err, sizeof err)) {
      progress_clear(&pg);
      diag_file_error(o->model_path, "step %lld: %s", (long long)step, err[0] ? err : "bad batch");
      rc = 1;
      break;
    }
    Batch batch;
    if (!loader_next(train, &batch)) { // (the text it reads changed: the loader said how)
      char kept[PATH_MAX + 96];
      rc = 1;
      progress_clear(&pg);
      snprintf(kept, sizeof kept, "rank 0 keeps them");
      if (lead)
        keep_step_before(&writer, ckpt, e, o, step, ckpt_step, before, kept, sizeof kept);
      diag_file_error(o->model_path, "step %lld: no batch; stopping with the weights of step %lld: %s", (long long)step,
                      (long long)step - 1, kept);
      break;
    }
    double lr = rt_lr_at(&tc, step);
    e->set_scalar(e, "lr", lr);
    e->set_scalar(e, "step", (double)step);
    e->set_seed(e, step_seed(seed, k > 1 ? step * k + k - 1 : step));
    // A micro-batch whose loss is not finite: the step is not run (its optimizer would apply the
    // others' gradients regardless). With several ranks every rank runs it, that one sending NaN
    // gradients (reduce_grads), so that no rank's optimizer updates.
    bool micro_finite = isfinite(loss_sum), run = micro_finite || world > 1;
    red.step = step, red.poison = !micro_finite, red.seconds = red.busy = red.gather = 0;
    fa.step = step;
    if (!feed(e, &batch, B * T) || (run && !e->step(e, err, sizeof err))) {
      progress_clear(&pg);
      diag_file_error(o->model_path, "step %lld: %s", (long long)step, err[0] ? err : "bad batch");
      rc = 1;
      break;
    }
    real += batch.real_tokens; // (with several ranks: the global batch's)
    // (NCCL: the device time of its all-reduce, and with --zero 1 its all-gather; buckets beside the
    // backward: the time the step waited for them; else the all-reduces' own, on the main thread
    // between the backward and the optimizer; and --zero 1's all-gather on the CPU after it)
    red.seconds = (nccl || overlapped ? e->reduce_seconds : red.busy) + red.gather;
    if (nccl)
      red.busy = e->reduce_seconds;
    double loss = (loss_sum + (micro_finite ? engine_scalar(e, g->loss) : NAN)) / (double)k;
    double norm = gnorm >= 0 && run ? engine_scalar(e, gnorm) : NAN;
    for (int j = 0; j < met.n; j++) {
      met.now[j] = (met.sum[j] + (micro_finite ? engine_scalar(e, met.node[j]) : NAN)) / (double)k;
      met.sum[j] = 0;
    }
    // Several ranks: the step's loss and metrics are their means over the ranks, and a SIGINT or
    // SIGTERM on any rank stops every rank at this step.
    int stop = stop_signal;
    if (world > 1) {
      shared[0] = loss, shared[met.n + 1] = stop ? 1 : 0;
      for (int j = 0; j < met.n; j++)
        shared[1 + j] = met.now[j];
      double t1 = rt_now();
      if (!dist_sum_f64(shared, met.n + 2, "the step's loss", step, err, sizeof err)) {
        diag_file_error(o->model_path, "step %lld: %s", (long long)step, err);
        rc = 1;
        break;
      }
      red.seconds += rt_now() - t1;
      red.busy += rt_now() - t1;
      loss = shared[0] / world;
      for (int j = 0; j < met.n; j++)
        met.now[j] = shared[1 + j] / world;
      stop = shared[met.n + 1] > 0 ? (stop ? stop : SIGTERM) : 0;
    }
    double dt = rt_now() - t0;
    step_secs += dt;
    comm_total += red.seconds;
    busy_total += red.busy;
    real_total += real;
    push(&c.loss, &c.n, &c.cap, loss);
    for (int j = 0; j < met.n; j++)
      push(&c.met, &c.nmet, &c.capmet, met.now[j]);
    // A loss or gradient norm that is not finite: the optimizer left the weights and moments as they
    // were (emit_c.c, emit_cuda.c, engine.c's interpreter test the same two values), so they are the
    // last finite ones.
    bool nonfinite = !isfinite(loss) || (gnorm >= 0 && !isfinite(norm));
    bool do_val = eval && !nonfinite && ((o->val_every > 0 && step % o->val_every == 0) || step == last);
    if (do_val) {
      last_val = validate(e, eval, val, val_first, val_batches, B * T, val_mean, err, sizeof err);
      if (isnan(last_val)) {
        progress_clear(&pg);
        diag_file_error(o->model_path, "validation at step %lld: %s", (long long)step, err);
        rc = 1;
        break;
      }
      if (c.nval == c.capval) {
        c.capval = c.capval ? 2 * c.capval : 64;
        c.val = rt_xrealloc(c.val, sizeof(double) * (size_t)c.capval);
        c.val_step = rt_xrealloc(c.val_step, sizeof(int64_t) * (size_t)c.capval);
      }
      c.val[c.nval] = last_val;
      c.val_step[c.nval++] = step - start;
      for (int j = 0; j < met.n; j++)
        push(&c.val_met, &c.nvalmet, &c.capvalmet, met.val[j] >= 0 ? val_mean[1 + met.val[j]] : NAN);
    }
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
    double elapsed = rt_now() - t_start, left = elapsed / (double)(step - start) * (double)(last - step);
    char eta_s[32];
    eta(left, eta_s, sizeof eta_s);
    double tok_s = (double)real / dt, mfu = 100.0 * (double)k * flops / dt / peak;
    if (isfinite(loss)) {
      pg.ema = 0.9 * pg.ema + 0.1 * loss;
      pg.weight = 0.9 * pg.weight + 0.1;
    }
    char met_s[512], comm_s[48] = "";
    if (world > 1)
      snprintf(comm_s, sizeof comm_s, " | comm %.1f ms", 1e3 * red.seconds);
    if (!o->quiet && (step == start + 1 || step == last || step % log_every == 0 || do_val)) {
      progress_clear(&pg);
      printf("step %5lld/%lld | loss %.4f%s | lr %.2e | norm %6.3f | %7.1f ms%s | %8.0f %s | MFU %5.2f%% | "
             "peak %.0f MB%s | ETA %s\n",
             (long long)step, (long long)last, loss, metrics_line(&met, met.now, " | ", "", met_s, sizeof met_s), lr,
             norm, 1e3 * dt, comm_s, tok_s, unit, mfu, (double)ru.ru_maxrss * 1024.0 / 1e6, device_s,
             eta_s); // (ru_maxrss: KiB; MB as the arena's)
      if (do_val && o->arrays)
        printf("step %5lld/%lld | val loss %.4f%s\n", (long long)step, (long long)last, last_val,
               metrics_line(&met, c.val_met + c.nvalmet - met.n, " | ", "val ", met_s, sizeof met_s));
      else if (do_val)
        printf("step %5lld/%lld | val loss %.4f (unigram entropy %.4f)%s\n", (long long)step, (long long)last,
               last_val, unigram,
               metrics_line(&met, c.val_met + c.nvalmet - met.n, " | ", "val ", met_s, sizeof met_s));
    } else if (pg.on) {
      progress_show(&pg, step, last, (double)real_total / step_secs,
                    100.0 * (double)k * flops * (double)(step - start) / step_secs / peak, eta_s);
    }
    fflush(stdout);
    // (a full disk: the log's write fails as the checkpoint's will; each is reported, once)
    bool logged = fprintf(log, "{\"step\":%lld,\"loss\":%.6f,\"lr\":%.6g,\"grad_norm\":%.6g,\"ms\":%.3f,\"%s\":%.1f,"
                          "\"mfu\":%.4f", (long long)step, loss, lr, norm, 1e3 * dt, o->arrays ? "ex_s" : "tok_s",
                          tok_s, mfu) > 0;
    if (world > 1)
      logged &= fprintf(log, ",\"comm_ms\":%.3f,\"allreduce_ms\":%.3f", 1e3 * red.seconds, 1e3 * red.busy) > 0;
    for (int j = 0; j < met.n; j++)
      logged &= fprintf(log, ",\"%s\":%.6g", met.name[j], met.now[j]) > 0;
    if (do_val)
      logged &= fprintf(log, ",\"val_loss\":%.6f", last_val) > 0;
    for (int j = 0; do_val && j < met.n; j++)
      logged &= fprintf(log, ",\"val_%s\":%.6g", met.name[j], c.val_met[c.nvalmet - met.n + j]) > 0;
    logged &= fprintf(log, "}\n") > 0;
    logged &= fflush(log) == 0;
    if (!logged && !log_failed) {
      progress_clear(&pg);
      diag_file_error(log_path, "cannot write the log at step %lld: %s; stopping", (long long)step, strerror(errno));
      log_failed = true;
      rc = 1;
    }
    if (nonfinite) {
      char why[400];
      progress_clear(&pg);
      nonfinite_culprit(e, loss, why, sizeof why);
      if (skipped < o->skip_nonfinite) {
        skipped++;
        fprintf(stderr, "mdlc: warning: step %lld: %s: the step is skipped, the weights are not updated (%lld of "
                "--skip-nonfinite %lld)\n", (long long)step, why, (long long)skipped, (long long)o->skip_nonfinite);
      } else {
        char kept[PATH_MAX + 96] = "rank 0 keeps them";
        rc = 1;
        if (zero && !gather_moments(e, zero, step, err, sizeof err)) // (every rank is here: the loss is shared)
          snprintf(kept, sizeof kept, "%s", err);
        else if (lead)
          keep_step_before(&writer, ckpt, e, o, step, ckpt_step, before, kept, sizeof kept);
        diag_file_error(o->model_path, "step %lld: %s; stopping with the weights of step %lld, which it did not "
                        "change: %s (--skip-nonfinite N skips up to N such steps)", (long long)step, why,
                        (long long)step - 1, kept);
        break;
      }
    }
    if (!ckpt_poll(&writer)) {
      progress_clear(&pg);
      rc = 1;
      break;
    }
    // (--zero 1: every rank sends rank 0 its moments first, at the steps every rank checkpoints; a
    // log that rank 0 alone failed to write stops it without a checkpoint, the last one standing)
    bool every = (o->ckpt_every > 0 && step % o->ckpt_every == 0) || step == last || stop;
    if (every || (log_failed && !zero)) {
      if (zero && !gather_moments(e, zero, step, err, sizeof err)) {
        diag_file_error(o->model_path, "step %lld: %s", (long long)step, err);
        rc = 1;
        break;
      }
      if (lead && !ckpt_start(&writer, ckpt, e, o, step, loader_state(train))) {
        progress_clear(&pg);
        rc = 1;
        break;
      }
      ckpt_step = step;
    }
    if (log_failed) {
      progress_clear(&pg);
      if (ckpt_wait(&writer) && ckpt_step == step)
        fprintf(stderr, "mdlc: wrote the checkpoint of step %lld to %s; continue with --resume\n", (long long)step,
                ckpt);
      break;
    }
    if (stop) {
      progress_clear(&pg);
      if (!ckpt_wait(&writer)) {
        rc = 1;
        break;
      }
      if (lead)
        printf("%s at step %lld: wrote %s; continue with --resume\n",
               stop == SIGINT ? "interrupted (SIGINT)" : "terminated (SIGTERM)", (long long)step, ckpt);
      stopped = stop;
      break;
    }
  }
  progress_clear(&pg);
  if (!ckpt_free(&writer))
    rc = 1;
  release_stop(&stops);
  if (fclose(log) != 0 && !log_failed) {
    diag_file_error(log_path, "cannot write the log: %s", strerror(errno));
    rc = 1;
  }
  if (rc == 0 && c.n > 0 && lead) {
    // The whole run's rate, and the steps' alone: on a GPU a 30-step run spends most of its time
    // validating and writing checkpoints (GPT-2 124M on an H200: 0.9 s of steps in 4.2 s).
    double secs = rt_now() - t_start;
    char val_s[48] = "no validation", met_s[512], val_met_s[512] = "", unigram_s[48] = "";
    if (!isnan(last_val)) // (a run stopped before its last step, with --val-every 0, has none)
      snprintf(val_s, sizeof val_s, "val loss %.4f", last_val);
    if (!isnan(last_val) && met.n)
      metrics_line(&met, c.val_met + c.nvalmet - met.n, ", ", "val ", val_met_s, sizeof val_met_s);
    if (!o->arrays)
      snprintf(unigram_s, sizeof unigram_s, ", unigram entropy %.4f", unigram);
    printf("trained %lld steps in %.1f s (%.0f %s; in the steps alone %.1f s, %.0f %s, the rest validation "
           "and checkpoints); final loss %.4f%s, %s%s%s\n",
           (long long)c.n, secs, (double)real_total / secs, unit, step_secs, (double)real_total / step_secs, unit,
           c.loss[c.n - 1], metrics_line(&met, c.met + c.nmet - met.n, ", ", "", met_s, sizeof met_s), val_s,
           val_met_s, unigram_s);
    if (world > 1)
      printf("data parallel over %d ranks: %.0f %s a rank; waiting on the all-reduces %.1f s, %.1f%% of the steps' "
             "time (in them %.1f s%s)\n", world, (double)real_total / step_secs / world, unit, comm_total,
             100.0 * comm_total / step_secs, busy_total,
             overlapped ? ", the rest beside the backward" : "");
    if (!write_svg(svg, &c, met.name, met.n, unigram, o->arrays))
      diag_file_error(svg, "cannot write the loss curve: %s", strerror(errno));
    printf("wrote %s, %s and %s\n", ckpt, log_path, svg);
  }
  for (int i = 0; k > 1 && i < ac.n; i++)
    free(ac.sum[i]);
  free(ac.sum);
  free(ac.tmp);
  free(c.loss);
  free(c.val);
  free(c.val_step);
  free(c.met);
  free(c.val_met);
  free(val_mean);
  free(shared);
  if (world > 1 && e->set_reduce)
    e->set_reduce(e, NULL, NULL, 0, false);
  if (fp8_shared && e->set_fp8_amax)
    e->set_fp8_amax(e, NULL, NULL);
  if (fp8_shared && k > 1 && micro->set_fp8_lead)
    micro->set_fp8_lead(micro, NULL);
  free(fa.micro);
  free(fa.ones);
  free(fa.bits);
  if (nccl)
    e->set_nccl(e, NULL, NULL);
  if (zero && e->set_shard)
    e->set_shard(e, NULL, NULL, NULL);
  engine_shard_free(zero);
  metrics_free(&met);
  loader_close(train);
  if (val)
    loader_close(val);
  return rc ? rc : stopped ? 128 + stopped : 0;
}
