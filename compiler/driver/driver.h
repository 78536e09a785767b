// driver.h: what the driver's files share (main.c, options.c, engines.c, verbs.c, run.c,
// lab_measure.c, sampling.c): the options of a command line and the functions that cross files; and what the
// driver offers the tests: a sampler opened from a checkpoint, its model compiled, and `mdlc sample`.
#ifndef MDL_DRIVER_H
#define MDL_DRIVER_H
#include "data.h"
#include "mdl.h"
#include "runtime.h"
#include "sample.h"

enum { EXIT_USER = 1, EXIT_USAGE = 2 };

typedef struct {
  const char *verb, *file;
  const char *dump;     // -d letters
  DimOverride dims[32];
  int ndims;
  const char *settings[32]; // --set KEY=VALUE, in order (lower.settings points here)
  const char *out, *weights, *batch, *data, *backend;
  const char *text; // the model's text where it is not read from `file` (eval: the checkpoint's copy)
  const char *precision; // --precision, else the train section's
  const char *checkpoint; // --checkpoint, else the train section's
  int64_t steps;
  uint64_t seed;
  bool fp64;
  FuseOptions fuse;
  LowerOptions lower; // --attention plain, --no-doc-mask: how the front end lowers attention
  bool reuse; // the memory planner shares memory between activations whose lives do not overlap
  bool profile;
  bool gemm_tuning; // the CUDA back end times cuBLASLt's candidates for each GEMM (--no-gemm-tuning)
  bool kernel_tuning; // and each kernel that has a variant against it (--no-kernel-tuning)
  PrepOptions prep;
  bool resume, pack, shuffle;
  int shuffle_set; // +1 --shuffle, -1 --no-shuffle, 0 neither: shuffled, but in order from the text packed
  bool pack_set, seed_set; // --no-pack, --seed given (a resumed run takes the checkpoint's otherwise)
  bool tokenize_on_the_fly; // training batches tokenised from the text as drawn (--tokenize-on-the-fly)
  int64_t val_every, val_batches, ckpt_every;
  int64_t accumulate; // > 0 overrides the train section's
  int64_t skip_nonfinite; // steps with a non-finite loss or gradient norm skipped (with a warning each)
  int64_t log_every; // a full step line every N steps (0: train_log_every's choice)
  bool quiet;        // run: errors and the final summary only
  int zero;          // run under mpirun/srun: the ZeRO stage, 0 or 1 (--zero)
  const char *cpu_reduce; // --bucket-mb or --overlap, as given (the CPU back end's all-reduce), else NULL
  SampleOptions sample;
  const char *lab_budget; // lab: --memory-budget
} Options;

//
// options.c: the command line.
//
// A usage error: "mdlc: " fmt (with arg), then where to look; EXIT_USAGE.
int usage_error(const char *fmt, const char *arg);
// argv into o (defaults for what it does not say); 0, else the exit status after the message.
int parse_options(int argc, char **argv, Options *o);
bool dumping(const Options *o, char letter); // -d names the letter

//
// engines.c: the engine choice, and what depends on the machine, decided before the pipeline.
//
// The back end --backend names; "auto" is CUDA when a driver, a device and NVRTC are there, else
// the CPU (saying why in one line, once, unless --quiet).
const char *backend_of(const Options *o);
// What `auto` precision is here; `why` (may be NULL) says why.
const char *auto_precision(const Options *o, const char **why);
// The memory a checkpoint budget is measured against (-1: unknown); `what` says which.
int64_t memory_there(const Options *o, const char **what);
// The pipeline's options for o: the graph `kind`, built for `target`, with the machine's part decided.
PipelineOptions pipeline_options(const Options *o, GraphKind kind, Target target);
Target target_of(const Options *o); // the pipeline's target for o's back end
// The engine for what the pipeline compiled for o's back end; NULL after saying why. With `report`,
// one line on what was compiled.
Engine *open_engine(const Options *o, const Compilation *c, bool report);
// The validation graph (forward, dropout off, scalar outputs) or the micro-batches' (forward and
// backward, no optimizer), compiled in a and opened on the same back end.
Engine *open_side_engine(const Options *o, Arena *a, bool grads);

//
// verbs.c, run.c, lab_measure.c: the verbs, each given what the pipeline compiled for it.
//
int cmd_check(const Options *o, Compilation *c);
int cmd_init(const Options *o, Compilation *c);
int cmd_grad(const Options *o, Compilation *c);
int cmd_build(const Options *o, Compilation *c);
int cmd_run(const Options *o, Compilation *c);
int cmd_lab(const Options *o, Compilation *c);
int cmd_eval(const Options *o); // (compiles the checkpoint's model itself)
// On --resume, the checkpoint's order of batches into o (run.c); false after saying why.
bool resume_batch_order(Options *o);
void print_muon_split(const Graph *g); // optimizer = muon: which params each rule updates, in one line
// Every parameter from a safetensors file (names and shapes must match); false after saying why.
bool load_weights_from(Engine *e, const Graph *g, const StFile *f, const char *path);
bool load_weights(Engine *e, const Graph *g, const char *path);

//
// sampling.c: `mdlc sample`'s compiling part.
//
// The checkpoint read, its model compiled for one token per step, the parameters loaded (sampler_read,
// sampler_start); NULL after printing why.
Sampler *sampler_open(const char *checkpoint);
// `mdlc sample`: opens o->checkpoint and prints the prompt, then the generated text, as it comes
// (sampler_print). Returns the exit status: 0, or 1 after printing "path: error: reason".
int sample_run(const SampleOptions *o);
#endif
