// train_impl.h: what the files of the training loop share: the functions one file calls in another.
// runtime.h's training section is their interface to the rest of mdlc.
#ifndef TRAIN_IMPL_H
#define TRAIN_IMPL_H

#include "data.h"
#include "runtime.h"

#include <limits.h>
#include <pthread.h>
#include <stdio.h>

typedef struct Run Run;         // a run under way (train.c)
typedef struct RunStep RunStep; // one step of it

//
// outdir.c: the output folder (its lock: runtime.h's train_claim_out).
//
// What a run writes where in OUT: its checkpoint, its log (a line a step) and its loss curve.
typedef struct {
  char ckpt[PATH_MAX + 32], log[PATH_MAX + 16], svg[PATH_MAX + 16];
} OutFiles;
void out_files(const char *dir, OutFiles *f);
// On --resume: log.jsonl cut back to the lines of the steps up to `step`; false after saying why.
bool truncate_log(const char *path, int64_t step);
// The temporary files of checkpoint writes cut short (kill -9) next to ckpt, removed.
void remove_partial_writes(const char *ckpt);
//
// step.c: one optimizer step: its batch through the engine, and its figures.
//
// The metrics: every scalar output besides the loss (an accuracy, an auxiliary loss), each step's
// value (the mean over its micro-batches, as the loss) and each validation's (the mean over its
// batches), logged beside the loss: the step line, log.jsonl ("NAME", "val_NAME") and loss.svg.
typedef struct {
  int n;
  const char **name;
  int *node;   // in the training graph
  int *val;    // its index among the validation graph's outputs (val_means' mean[1 + val]), or -1
  double *now; // this step's values
  double *sum; // the micro-batches' sums (gradient accumulation)
} Metrics;
// Precision fp8's amaxes over several ranks or micro-batches (step.c says how they join).
typedef struct {
  int n;
  bool merge;     // this step's micro-batches ran: their amaxes join the step engine's
  float *micro;   // the max of this step's micro-batches' amaxes (NaN once one is NaN)
  float *ones;    // the scales of a calibration pass
  uint32_t *bits; // the ranks' all-reduce
  int64_t step;
} Fp8Amax;
// Gradient accumulation's state (step.c): the micro-batches' engine and the sums of their gradients.
typedef struct {
  Engine *micro;
  Fp8Amax *fp8;       // precision fp8 (else NULL)
  Metrics *metrics;   // their values summed into metrics->sum
  int n;              // the parameters that train (a frozen one has no gradient)
  int *param;         // per one of them: its index in the parameters
  int *grads;         // its gradient node in the micro-batches' graph
  const char **names; // "acc.<param>", per one of them
  float **sum;  // per one of them; the host's sums, allocated when first needed
  float *tmp;
} Accum;
// Data parallel (dist.c): the step engine's gradients made the mean over the ranks before its
// optimizer (Engine.set_reduce), and the time that takes. A rank whose micro-batch loss was not
// finite (poison) sends NaN gradients instead, so that every rank skips the update, as one process
// skips it.
typedef struct {
  Engine *e;
  int64_t step;
  bool poison;    // a micro-batch's loss was not finite (the step's own is read in the reduce)
  double seconds; // waited on the all-reduces, this step (with buckets: only what the backward did not hide)
  double busy;    // in the all-reduces, this step (with buckets on the engine's thread, beside the backward)
  double gather;  // in the all-gather of the updated parameters (--zero 1 on the CPU), this step
} Reduce;
// A batch's inputs into e, n a row's values times the rows (this rank's slice of them); false on error.
bool feed_batch(Engine *e, const Batch *b, int64_t n);
// Whether g can train on token shards; false after naming what is missing or extra.
bool shards_fit(const Graph *g, const char *data_dir);
void copy_params(Engine *from, Engine *to); // every parameter of `from` into `to` (two graphs of one model)
Metrics metrics_of(const Graph *g, const Graph *eval);
void metrics_free(Metrics *m);
// What made a step non-finite (the loss, an fp8 overflow, the first gradient that is not), into buf.
const char *nonfinite_culprit(Engine *e, double loss, char *buf, size_t n);
// The engine's hooks for data parallel, precision fp8 over ranks or micro-batches and --zero 1;
// one the engine lacks ends the run before its first step (rc 1, last = start) after saying so.
void run_hooks(Run *r);
void run_unhook(Run *r); // the hooks taken back, what they held freed
enum { STEP_RAN, STEP_FAILED, STEP_NO_BATCH }; // what train_step did
// One optimizer step, its figures on this rank into s and r->met; STEP_FAILED after saying why.
int train_step(Run *r, RunStep *s);
// The step's figures over the ranks (and s->stop on any rank), its time, the curves; false after saying why.
bool finish_step(Run *r, RunStep *s);
//
// validate.c: the validation loss.
//
// The batches to validate an array dataset on: --val-batches (want) batches of B, at most as many
// as its val split fills.
int64_t array_val_batches(const Loader *val, int64_t B, int64_t want);
// Validation where step s is due one (every val_every and the last, unless it is not finite; sets
// s->do_val, s->nonfinite), its figures into r->c; false after saying why it failed.
bool validate_step(Run *r, RunStep *s);
// The unigram entropy (nats/token) of dir's training shards; NaN, after a warning, where one cannot be read.
double unigram_entropy(const char *dir, int64_t vocab);
//
// trainlog.c: the step lines and log.jsonl's, the progress line, the summary and the loss curve.
//
// The run's curves, for OUT/loss.svg.
typedef struct {
  double *loss, *val;
  int64_t *val_step;
  int64_t n, nval, cap, capval;
  double *met, *val_met; // the metrics' values (Metrics), a step's (or a validation's) after another's
  int64_t nmet, capmet, nvalmet, capvalmet;
} Curve;
// On a terminal, the steps between two full lines show as one line rewritten in place ("\r", then
// the erase-line escape): the step, the loss smoothed over the last steps (an exponential moving
// average, corrected for its start as Adam's moments are), the rate and MFU of the steps so far, the
// time left. Anything else printed first clears it.
typedef struct {
  bool on;     // stdout is a terminal (and the run is not --quiet)
  bool shown;  // the line is on the screen, with no newline after it
  double ema, weight; // the average's sum and the weight it has gathered (1 - 0.9^steps)
} Progress;
void curve_push(double **a, int64_t *n, int64_t *cap, double v); // v appended to the array *a of *n (room for *cap)
void progress_clear(Progress *p); // the progress line off the screen, before anything else is printed
// The step's line (a full one, else on a terminal the progress line) and its line of log.jsonl; a
// log that cannot be written is said once, and ends the run (log_failed, rc 1).
void log_step(Run *r, const RunStep *s);
void log_summary(Run *r); // the end of a run that trained: its rates, final figures, OUT/loss.svg
//
// ckpt.c: the checkpoint, written in the background between steps and read on --resume.
//
// The writer of a run's checkpoints (ckpt.c says how they are written); {.ok = true} before the first.
enum { CKPT_META = 17 };
typedef struct {
  pthread_t thread;
  bool running, threaded; // a write is under way (threaded: on its own thread)
  bool ok;                // the last write's result
  bool done;              // the thread has set ok (atomic)
  const char *path;
  Engine *snap; // the engine whose snapshot the thread reads them from, or NULL (read before)
  StTensor *t; // the parameters and moments, in buffers kept for the next checkpoint
  bool in_place; // t's data are the engine's own (Engine.values), not buffers of ours
  int *nodes;  // their nodes
  int n;
  StMeta meta[CKPT_META];
  int nmeta;
  int nt;           // tensors written: the n above, then precision fp8's state
  float *fp8;       // its copy: the scales, then the histories
  char fp8_recorded[32];
  char step_s[32], seed_s[32], loader_s[64], acc_s[32], *dims;
} CkptWriter;
// Reads the checkpoint of `step` from e and starts its write, once the last one is done; false when
// that one failed.
bool ckpt_start(CkptWriter *w, const char *path, Engine *e, const TrainOptions *o, int64_t step, LoaderState ls);
bool ckpt_wait(CkptWriter *w); // waits for the write under way; false when the last write failed
bool ckpt_poll(CkptWriter *w); // false when the last write has ended and failed (one under way runs on)
bool ckpt_free(CkptWriter *w); // waits as ckpt_wait does, then frees the writer's buffers
// Whether the checkpoint read into f (from path) is one of g's, as the model at model_path has it;
// false after saying why (with warn: a warning where the model's text changed but still fits).
bool checkpoint_fits(Arena *a, const StFile *f, const char *path, const Graph *g, const char *model_path, bool warn);
// Loads the checkpoint at path into e (the moments of this rank's shard of `shards`) and fills the
// step, the loader's state and the seed it was written at; false after saying why.
bool read_checkpoint(const char *path, Engine *e, const char *model_path, int shards, int64_t *step, LoaderState *ls,
                     uint64_t *seed);
// --zero 1: every rank's moments gathered into rank 0's engine before a checkpoint (every rank calls it).
bool gather_moments(Engine *e, const ZeroShard *z, int64_t step, char *err, size_t n);
// A run that stops at `step` before changing any weight: the checkpoint of the step before, unless it
// is the one on disk (ckpt_step); what became of the weights goes into kept.
void keep_step_before(CkptWriter *w, const char *ckpt, Engine *e, const TrainOptions *o, int64_t step,
                      int64_t ckpt_step, LoaderState before, char *kept, size_t n);
//
// train.c: the loop that strings the parts together, and the state they share.
//
// A run under way: what the parts of train_loop share from one step to the next.
struct Run {
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
};

// One step of a run, as its parts see it.
struct RunStep {
  int64_t step;
  double t0, loss_sum; // its start; the losses of its first k - 1 micro-batches
  int64_t real;        // the tokens (examples) it counted
  LoaderState before;  // the data position at its start (a checkpoint of the step before resumes from it)
  double lr, loss, norm, dt;
  bool micro_finite, run; // its micro-batches' losses were finite; the step engine ran
  int stop;               // the SIGINT or SIGTERM it stops the run at, or 0
  bool nonfinite, do_val;
};

#endif
