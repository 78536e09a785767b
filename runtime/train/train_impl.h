// train_impl.h: what the files of the training loop share: the functions one file calls in another.
// runtime.h's training section is their interface to the rest of mdlc.
#ifndef TRAIN_IMPL_H
#define TRAIN_IMPL_H

#include "data.h"
#include "runtime.h"

#include <pthread.h>

//
// outdir.c: the output folder (its lock: runtime.h's train_claim_out).
//
// On --resume: log.jsonl cut back to the lines of the steps up to `step`; false after saying why.
bool truncate_log(const char *path, int64_t step);
//
// step.c: one optimizer step's parts.
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
// The per-step seed of dropout masks, from the run's seed and the step (each rank's own).
uint64_t step_seed(uint64_t seed, int64_t step);
// A batch's inputs into e, n a row's values times the rows (this rank's slice of them); false on error.
bool feed(Engine *e, const Batch *b, int64_t n);
// Whether g can train on token shards; false after naming what is missing or extra.
bool shards_fit(const Graph *g, const char *data_dir);
void copy_params(Engine *from, Engine *to); // every parameter of `from` into `to` (two graphs of one model)
Metrics metrics_of(const Graph *g, const Graph *eval);
void metrics_free(Metrics *m);
// Engine.set_fp8_amax's hook (ctx: the Fp8Amax): the step's amaxes over its micro-batches and the ranks.
bool fp8_amax_step(void *ctx, float *amax, int n, char *err, size_t en);
// The first k - 1 micro-batches of step `step` on ac->micro, their gradients summed into e's inputs,
// their losses into loss_sum and counted tokens into real; false with a message in err.
bool accumulate_micro(Accum *ac, Engine *e, Loader *train, int64_t k, int64_t BT, uint64_t seed, int64_t step,
                      double *loss_sum, int64_t *real, char *err, size_t n);
// What made a step non-finite (the loss, an fp8 overflow, the first gradient that is not), into buf.
const char *nonfinite_culprit(Engine *e, double loss, char *buf, size_t n);
// Engine.set_reduce's and Engine.set_shard's hooks (ctx: the Reduce).
bool reduce_grads(void *ctx, float *x, int64_t n, char *err, size_t en);
bool gather_params(void *ctx, float *x, const int64_t *at, char *err, size_t en);

//
// validate.c: the validation loss.
//
// The batches to validate an array dataset on: --val-batches (want) batches of B, at most as many
// as its val split fills.
int64_t array_val_batches(const Loader *val, int64_t B, int64_t want);
// The mean validation loss over the first `batches` batches from `first`, on eval with train's
// parameters; the means of eval's scalar outputs into mean[1..]; NaN with a message in err.
double validate(Engine *train, Engine *eval, Loader *val, LoaderState first, int64_t batches, int64_t BT,
                double *mean, char *err, size_t n);
// The unigram entropy (nats/token) of dir's training shards; NaN, after a warning, where one cannot be read.
double unigram_entropy(const char *dir, int64_t vocab);

//
// trainlog.c: the step lines, the progress line and the loss curve.
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
// OUT/loss.svg from c (names[0, nmet): the metrics); false where it cannot be written.
bool write_svg(const char *path, const Curve *c, const char *const *names, int nmet, double unigram, bool arrays);
void push(double **a, int64_t *n, int64_t *cap, double v); // v appended to the array *a of *n (room for *cap)
void eta(double seconds, char *buf, size_t n);              // "M:SS"
void progress_clear(Progress *p);
void progress_show(Progress *p, int64_t step, int64_t last, double tok_s, double mfu, const char *eta_s);
// "SEP NAME VALUE" for each metric (prefix "val " at validation), into buf; "" when there are none.
const char *metrics_line(const Metrics *m, const double *v, const char *sep, const char *prefix, char *buf,
                         size_t n);

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

#endif
