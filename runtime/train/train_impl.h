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
