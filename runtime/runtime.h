// runtime.h: the runtime's public pieces: learning-rate schedule, model flops and MFU, text batches.
#ifndef MDL_RUNTIME_H
#define MDL_RUNTIME_H
#include "mdl.h"
#include "rt_util.h"

//
// schedule.c: the learning rate at a step: warmup, then the train section's schedule over train.steps.
//
double rt_lr_at(const TrainConfig *tc, int64_t step); // step counts from 1

//
// flops.c: the model flops of one training step, counted from the forward graph.
//
// 3x the forward GEMM and attention flops (forward 1x + backward 2x): for GPT-2 this is llm.c's
// 6N + 6LCT per token with N the parameters that take part in matmuls. Causal attention counts half
// its products, fused or lowered into GEMMs (--attention plain), so MFU means the same with either.
double rt_step_flops(const Graph *g);
// The peak this machine's CPU is assumed to reach in fp32: cores x GHz x flops per cycle (FMA
// width x 2 units), from /proc/cpuinfo; *how names what was assumed.
double rt_cpu_peak_flops(const char *bf16_kernels, const char **how); // GEMMs in bf16 on these kernels (NULL: fp32)

//
// dist.c: data-parallel training over processes, launched by MPI (mpirun, or srun through MPI).
//
// Whether this process's launcher started it as one of several ranks (Open MPI's, PMIx's, MPICH's or
// Slurm's environment says so): then dist_init must run before training.
bool dist_launched(void);
// What the launcher's environment says before MPI starts (0 and 1 when not launched as several):
// this process's rank, and how many ranks share its machine.
int dist_env_rank(void);
int dist_env_local_size(void);
// Loads Open MPI (at run time: a machine without it trains alone) and initialises it when
// dist_launched(); nothing otherwise (a world of one). False with the reason in err.
bool dist_init(char *err, size_t n);
bool dist_on(void);     // more than one rank, MPI initialised
int dist_rank(void);    // 0 .. dist_size() - 1; 0 alone
int dist_size(void);    // 1 alone
int dist_local_rank(void), dist_local_size(void); // among the ranks of this machine
void dist_set_timeout(double seconds); // how long a rank waits for the others at a collective (300 s)
double dist_timeout(void);
// The gradients' all-reduce in buckets of this many bytes (default 25 MiB, PyTorch DDP's), one after
// the other after the backward (Open MPI's all-reduce of GPT-2 124M's 498 MB took 215-305 ms a step
// so here, 300-560 ms in one call); 0: one all-reduce over all of them. With overlap, each bucket is
// reduced on a thread of its own as soon as the backward has made it final, while the backward goes
// on (off by default: on a machine whose every core computes, the reduce then competes with the
// backward for its core, and the steps took 1410 ms against 1220); never where the MPI library
// cannot serve a second thread.
void dist_set_bucket(int64_t bytes);
int64_t dist_bucket(void);
void dist_set_overlap(bool on);
bool dist_overlap(void);
// In place: x becomes the mean (f32) or sum (f64) of every rank's x. Before it, every rank checks in
// (what, step: for the message) and waits at most the timeout for the others: a rank missing then is
// named on stderr and every rank stops (MPI_Abort, status 1). Alone: x as it is.
bool dist_mean_f32(float *x, int64_t n, const char *what, int64_t step, char *err, size_t en);
bool dist_sum_f64(double *x, int n, const char *what, int64_t step, char *err, size_t en);
// In place: x[i] becomes the largest of every rank's x[i] (unsigned), checked in and watched as above.
// Precision fp8's amaxes travel this way (fp8_amax_bits): as the bits of non-negative floats with
// NaN above infinity, whose unsigned order is the floats' order, so that the max is the max amax
// and a NaN on any rank wins, as it wins in one process.
bool dist_max_u32(uint32_t *x, int n, const char *what, int64_t step, char *err, size_t en);
// NCCL, the GPUs' all-reduce, loaded at run time (libnccl.so.2 of the CUDA toolkit): dist_nccl_load
// resolves it (the tests check it links without a GPU); dist_nccl_comm makes the ranks' communicator
// over each one's current CUDA device (the id from rank 0 by MPI_Bcast; NULL with err); then
// dist_nccl_mean_f32 enqueues, on a CUDA stream, x := the mean over the ranks (ncclAvg).
bool dist_nccl_load(char *err, size_t n);
void *dist_nccl_comm(char *err, size_t n);
bool dist_nccl_mean_f32(void *comm, void *x, int64_t count, void *stream, char *err, size_t n);
// ZeRO stage 1 (--zero 1): rank r's share of a flat buffer x is the floats [at[r], at[r + 1]).
// dist_allgather_f32 gives every rank every share (MPI_Allgatherv in place), dist_gather_f32 the
// other ranks' to root only, into root's `to` at the same places (MPI_Gatherv), each checked in and
// watched as dist_mean_f32 is; alone: nothing.
// dist_nccl_gather_f32 enqueues the same all-gather on a CUDA stream (an ncclBroadcast from each rank,
// grouped: NCCL's all-gather wants equal shares).
bool dist_allgather_f32(float *x, const int64_t *at, const char *what, int64_t step, char *err, size_t en);
bool dist_gather_f32(float *x, float *to, const int64_t *at, int root, const char *what, int64_t step, char *err,
                     size_t en);
bool dist_nccl_gather_f32(void *comm, void *x, const int64_t *at, void *stream, char *err, size_t n);
// The shards of ZeRO: n items of sizes size[] cut into `parts` contiguous runs balanced by size, run r
// the items [first[r], first[r + 1]) (first has parts + 1 entries); every rank computes the same.
void dist_partition(const int64_t *size, int n, int parts, int *first);
void dist_abort(int status); // every rank stops with status (MPI_Abort); alone: exit(status)
void dist_finalize(void);

//
// engine.c: one training step on any back end, behind one struct of hooks.
//
typedef struct Engine Engine;
typedef struct ZeroShard ZeroShard; // (below)
struct Engine {
  const char *name;
  const Graph *g;
  bool (*set_input)(Engine *e, const char *name, const int32_t *ids, const float *f, int64_t n);
  void (*set_scalar)(Engine *e, const char *name, double v); // "lr", "step"
  void (*set_seed)(Engine *e, uint64_t seed);                 // dropout masks of the next step
  bool (*step)(Engine *e, char *err, size_t n);               // one whole training step
  // A node's values as f32: params and AdamW moments (persistent), or step values that the back
  // end keeps in memory (the loss, gradients, the grad norm).
  void (*read)(Engine *e, int node, float *dst);
  void (*write)(Engine *e, int node, const float *src); // params and moments only
  // Between two engines of one compiled back end, memory to memory (one GPU's arenas, or the CPU's;
  // NULL, or false with nothing changed, where they cannot: the caller then goes through host
  // memory and read / write). take_params: every parameter of `from` (the same graph's parameters,
  // in order) copied into e's, with their bf16 copies. inputs_from: each f32 input names[i] of e
  // becomes node nodes[i] of `from` (first) or has it added (f32 adds, in call order, as a host sum
  // would), all of them or none; the steps keep those values until set_input names them again.
  bool (*take_params)(Engine *e, Engine *from);
  // Draws now the initial parameters still to be drawn (ParamDraw, below), which a step, a read or a
  // take_params from e would otherwise draw: the training loop calls it before its first step, so
  // that no step's time includes the draw.
  bool (*draw_params)(Engine *e, char *err, size_t n);
  bool (*inputs_from)(Engine *e, int n, const char *const *names, Engine *from, const int *nodes, bool first);
  // Checkpoints that do not stop the steps (device back ends; NULL elsewhere): snapshot copies every
  // parameter and AdamW moment as the last step left it, within the engine's memory; read_snapshot
  // then reads one of them (f32) into host memory as read would have, from any thread, while steps
  // run, until the next snapshot. snapshot is false, with nothing kept, where it cannot copy them
  // (memory); read_snapshot false with the reason in err.
  bool (*snapshot)(Engine *e);
  // A parameter's or moment's f32 values where they lie in host memory, to be read in place until
  // the next step (the CPU back end's arena: a checkpoint then needs no copy); NULL elsewhere.
  const float *(*values)(Engine *e, int node);
  // Gives back to the system the memory of values no later step reads before writing them: the
  // gradients and activations (a step's own values are dead between steps), and with params_too the
  // parameters and their bf16 copies (an engine that takes them anew before its next step, as
  // validation does); they read as zeros until written. NULL where nothing is given back.
  void (*idle)(Engine *e, bool params_too);
  bool (*read_snapshot)(Engine *e, int node, float *dst, char *err, size_t n);
  // Data-parallel training (dist.c): with a reduce set, each step runs its kernels one by one and,
  // once its gradients are final and before the optimizer's first kernel, calls fn(ctx, x, n) on each
  // buffer of gradients the optimizer reads (the flat gradient buffer, parameter order; with gradient
  // accumulation the "acc.<param>" inputs too), which makes it the mean over the ranks. fn NULL: none.
  // False where the back end cannot (NULL: none can).
  // With bucket > 0 (bytes), fn is called on the buckets of engine_grad_ranges instead; with overlap
  // too, each on a thread of the engine's own from the kernel that makes it final on, while the
  // backward goes on, and reduce_seconds is then the time the step waited for them (the
  // communication not hidden).
  bool (*set_reduce)(Engine *e, bool (*fn)(void *ctx, float *x, int64_t n, char *err, size_t en), void *ctx,
                     int64_t bucket, bool overlap);
  // The same on a GPU, in device memory: with an NCCL communicator (dist_nccl_comm) set, each step
  // runs its launches one by one on its stream with dist_nccl_mean_f32 of the same gradients before
  // the optimizer's first; where *poison is true at a step, those gradients are set to NaN first (a
  // rank whose micro-batch loss was not finite: no rank updates). reduce_seconds: the device time of
  // the last step's all-reduce. NULL where the back end has none.
  bool (*set_nccl)(Engine *e, void *comm, const bool *poison);
  // ZeRO stage 1 (after set_reduce or set_nccl): the step's optimizer updates only the parameters of
  // shard s (engine_shard) and touches only their moments; after it, the updated parameters and their
  // bf16 copies are all-gathered: on the CPU by gather(ctx, x, at) on each flat buffer (the arena's
  // params, then copies, at: the ranks' shares in floats from x), on a GPU by NCCL on the stream
  // (its time in reduce_seconds). The other parameters' moments are given back to the system by
  // idle and read as zeros. s NULL: every parameter again. False where the back end cannot.
  bool (*set_shard)(Engine *e, const ZeroShard *s,
                    bool (*gather)(void *ctx, float *x, const int64_t *at, char *err, size_t en), void *ctx);
  // With a shard set, for a checkpoint: every rank's moments gathered to rank 0, where Engine.values
  // then reads them until the next step or idle, from memory no step keeps between steps (the
  // gradients' buffer; the activations' where it has room): rank 0's checkpoint holds no second copy
  // of them and its memory does not grow. Every rank calls it. NULL: the caller gathers through read
  // and write (the GPU's moments stay whole in its arena).
  bool (*gather_moments)(Engine *e, int64_t step, char *err, size_t n);
  double reduce_seconds;
  // Precision fp8: the scales and amax histories (fp8_state.h), which checkpoints save and restore and which
  // name the tensor of a non-finite amax; NULL where the graph has no fp8 tensor.
  Fp8State *(*fp8)(Engine *e);
  // Precision fp8 beyond one pass of one process (NULL where the graph has no fp8 tensor, or where
  // the back end cannot). Every rank, and every micro-batch of a step, must cast with the same scales
  // and roll the same amaxes into the same histories: those of one process over the whole batch.
  // set_fp8_amax: each step calls fn(ctx, amax, n) on its amaxes (Fp8State.amax, n of them) where
  // the part before the optimizer has recorded them, before they are checked (a non-finite one
  // poisons the gradients) or rolled into the histories, and likewise after the calibration pass of
  // a first step, before its update; fn raises them to the step's (the max over the ranks, over the
  // step's other micro-batches). False from fn fails the step. fn NULL: none.
  void (*set_fp8_amax)(Engine *e, bool (*fn)(void *ctx, float *amax, int n, char *err, size_t en), void *ctx);
  // set_fp8_lead: with scale set (n floats: the step engine's Fp8State.scale, or all ones for a
  // calibration), e's steps are passes of another engine's step (gradient accumulation's micro-batches
  // on the gradients-only engine): each casts with scale[] as it is when the pass starts, leaves the
  // pass's own amaxes in e's Fp8State.amax, and neither calibrates, checks nor updates e's state
  // (whose scales are then a copy of scale[]). NULL: e's steps are whole steps of its own again.
  void (*set_fp8_lead)(Engine *e, const float *scale);
  void (*free)(Engine *e);
  bool cache_hit;         // compiled back ends: the module came from the cache
  double compile_seconds; // compiled back ends: time in the compiler
  int64_t arena_bytes;    // compiled back ends: the planned arena (0: not planned)
  int64_t device_bytes;   // device back ends: the device memory the engine allocated (0: host memory)
  double peak_flops;      // the peak MFU is measured against (0: this CPU's, rt_cpu_peak_flops)
  const char *peak_how;   // what that peak is
  // Profiling (compiled back ends): with `profile` set, a step runs kernel by kernel and adds each
  // kernel's time to kernel_seconds[i] (the kernels are the plan's steps, in order), from the second
  // step on: the first is a warm-up (its first touch of the arena's pages, its first launch of each
  // kernel), left out as the tokens/s figures leave it out.
  bool profile;
  bool profile_warm; // a profiled step has run
  const Fusion *fusion;
  double *kernel_seconds;
  int64_t profiled_steps;
  // Device back ends: prints the time of each launch inside the kernels that make several (a fused
  // LM head's GEMMs and cross-entropy, the optimizer's passes), or NULL.
  void (*profile_launches)(const Engine *e, double total_seconds, FILE *out);
};

// The gradients the optimizer reads (the gradient norm's inputs: with gradient accumulation the means
// with the micro-batches', not the flat gradient buffer), as byte ranges of the arena, each with the
// plan step before which it is reduced: the first that reads it after the step that writes it. With
// AdamW that is the optimizer's step for every one; Muon's products start on the last layers'
// gradients while the backward is still writing the first layers', so its ranges are reduced in
// buckets, each before its first reader. Sorted by that step, then by offset; neighbours of one step
// inside the flat gradient buffer merged across its padding (GPT-2's gradients are one range).
// malloc'd; NULL where the plan keeps one inside a kernel.
// With bucket > 0 (bytes), ranges are instead buckets of at most that many bytes (a gradient larger
// than that alone), each of gradients side by side in memory with no other between, sorted by the
// plan step after which they are all final (`ready`): a reduce of each can start then, while the
// backward goes on, and must end before `at`.
typedef struct {
  int64_t from, to; // bytes [from, to) of the arena
  int at;           // reduced before plan step `at`
  int ready;        // final after plan step `ready` (the last step writing one of them), ready < at
} GradRange;
GradRange *engine_grad_ranges(const Fusion *f, const MemPlan *m, int64_t bucket, int *nranges);

// ZeRO stage 1's shards: rank r of n updates the parameters g->params[first[r] .. first[r + 1]) (a
// contiguous run balanced by the elements the optimizer updates, dist_partition) and keeps their
// moments. engine_shard_at gives the shares of a plan's flat buffers: params, copies, m and v, each
// n + 1 float offsets from the arena's start (rank r's: [x[r], x[r + 1])).
struct ZeroShard {
  int rank, n;
  int *first;
};
ZeroShard *engine_shard(const Graph *g, int rank, int n);
void engine_shard_free(ZeroShard *s);
int engine_shard_owner(const ZeroShard *s, const Graph *g, int node); // the rank of a parameter's or moment's node
void engine_shard_at(const ZeroShard *s, const Graph *g, const MemPlan *m, int64_t *params, int64_t *copies,
                     int64_t *mom_m, int64_t *mom_v);

// One line per kernel: name, ms per step, share of the step, GFLOP/s, GB/s, the .mdl ops inside;
// slowest first.
void engine_profile_report(const Engine *e, FILE *out);

// Every back end draws its initial parameters from the seed when they are first needed (a step, a
// read, a take_params from it), not when it is made, and never draws a parameter written before
// then (Engine.write, take_params into it): an engine whose parameters all come from elsewhere (the
// validation and micro-batch engines, a resumed run, --weights) draws none, where GPT-2 124M's draw
// takes 2 s on two cores. ParamDraw keeps which parameters are still to be drawn.
typedef struct {
  uint64_t seed;
  bool *pending; // pending[k]: parameter g->params[k] is still to be drawn
  int left;      // how many are
} ParamDraw;
void param_draw_init(ParamDraw *d, const Graph *g, uint64_t seed);
void param_draw_written(ParamDraw *d, const Graph *g, int node); // node (any node) now holds its values
void param_draw_all_written(ParamDraw *d);
// draw(ctx, k) for every pending parameter k, in order; false (the rest still pending) when one fails.
bool param_draw_now(ParamDraw *d, bool (*draw)(void *ctx, int k), void *ctx);
void param_draw_free(ParamDraw *d);

// The reference interpreter; parameters initialised from the seed.
Engine *engine_interp(const Graph *g, InterpPrecision prec, uint64_t seed);
// (interp.c, for the interpreter's engine) Runs nodes [from, end) as they are: a step cut where the
// engine must act between its parts (the gradients' all-reduce, fp8's amaxes). fp8 casts use the
// scales as they are and raise the amaxes as they are (interp_run's calibration, clearing and update
// are left to the caller). False with a message on error.
bool interp_run_nodes(Interp *it, int from, int end, char *err, size_t n);
// The compiled CPU back end for an emitted module; parameters initialised from the seed as the
// interpreter does. NULL with a message in err when the module does not compile or load.
Engine *engine_cpu(const Fusion *f, const MemPlan *m, const char *source, uint64_t seed, char *err, size_t n);
double engine_scalar(Engine *e, int node); // a rank-0 value (the loss, the grad norm)
//
// ckptmeta.c: a training checkpoint's metadata, parsed strictly and range-checked.
//
#define CKPT_FORMAT "mdl-checkpoint-1"
#define CKPT_MAX_DIM 2147483647       // a dim's value in mdl.dims
#define CKPT_MAX_STEP (INT64_C(1) << 53) // mdl.step
#define CKPT_MAX_ACCUMULATE 1048576   // mdl.accumulate, as --accumulate and the train section
// What a checkpoint records (the fields it lacks: NULL, -1 or false; older checkpoints lack some).
typedef struct {
  const char *source, *model, *dims_text, *tokenizer, *optimizer, *precision; // mdl.source ... (as stored)
  const char *text, *tokenizer_base64; // the stored copies: mdl.source_text, mdl.tokenizer_base64
  DimOverride *dims;                   // mdl.dims, each dim's value as trained
  int ndims;
  int64_t step, accumulate, fp8_recorded; // mdl.step, mdl.accumulate, mdl.fp8_recorded
  bool has_seed, has_loader;
  uint64_t seed;                         // mdl.seed
  int64_t epoch, position;               // mdl.loader
  int shuffle, pack;                     // mdl.shuffle, mdl.pack: 1, 0, or -1 (not recorded)
} CkptMeta;
// Reads every mdl.* field of f (the checkpoint at path) that is there into m (a's memory): false after
// saying which field is bad and why, naming path; a checkpoint without mdl.format is no mdl checkpoint.
bool ckpt_meta_read(Arena *a, const char *path, const StFile *f, CkptMeta *m);
//
// train.c: the training loop: shards (or their text) in, metrics, validation, checkpoints and resume, loss curve
// (its parts in runtime/train/: train_impl.h).
//
typedef struct {
  const char *model_path;     // absolute path of the .mdl (recorded in checkpoints)
  const char *data_dir;       // shards from `mdlc prep`
  const char *tokenizer_path; // recorded in checkpoints, for `mdlc sample`
  const char *tokenizer_base64; // the tokenizer's file in base64, stored in checkpoints (NULL: not stored)
  const char *out_dir;        // checkpoint.safetensors, log.jsonl, loss.svg
  int64_t steps;              // > 0 overrides the train section's
  bool resume, pack, shuffle;
  bool tokenize_on_the_fly;   // training batches from the text data_dir/source.txt names, tokenised as
                              // each is drawn, in the step's time (validation's from the shards)
  uint64_t seed;
  int64_t val_every, val_batches; // validation every N steps (and at the end), on N batches
  int64_t ckpt_every;             // a checkpoint every N steps (and at the end)
  int64_t skip_nonfinite;         // steps with a non-finite loss or gradient norm skipped before stopping
  bool out_claimed;               // the caller holds out_dir (train_claim_out); else train_run claims it
  int64_t log_every;              // a full step line every N steps (0: train_log_every's choice)
  bool quiet;                     // no step lines, no progress: errors and the final summary only
  bool arrays;                    // data_dir is an array dataset (arrays.c), not shards
  double val_fraction;            // arrays without a val split: the share of examples held out
  int zero;                       // ZeRO stage (0 or 1): with several ranks, 1 shards the optimizer's state
} TrainOptions;

// Trains e's graph; eval (forward-only, may be NULL) computes the validation loss; micro (the
// gradients-only graph) runs the first k - 1 micro-batches when the train section accumulates
// gradients over k (NULL otherwise). Returns the exit status: 0, 1 after an error it reported, or
// 128 + the signal when a SIGINT or SIGTERM stopped it (after writing the checkpoint of its last step).
int train_run(Engine *e, Engine *eval, Engine *micro, const TrainOptions *o);
// What can be checked of a run's inputs before its model is compiled (10-20 s on a CPU): the shards
// of data_dir (val's, and train's unless the batches come from the text), the checkpoint in out_dir
// when resuming (its model configuration, every parameter's and moment's name and shape), and the
// weights file (names and shapes), when given. False after saying why.
bool train_check_inputs(const Graph *g, const char *model_path, const char *data_dir, const char *out_dir, bool resume,
                        bool from_text, const char *weights);
//
// validate.c: the validation loss, during a run and in `mdlc eval`.
//
// `mdlc eval`: eval (the forward graph of the checkpoint's model, its parameters loaded) over the
// first o->val_batches validation batches of o->data_dir, the batches a run with the same options
// validates on; prints the mean loss and the mean of each scalar output. Returns the exit status.
int train_eval(Engine *eval, const TrainOptions *o);
//
// trainlog.c: what a run reports as it goes.
//
// The full step lines' interval for a run of `steps` steps when --log-every does not say: 20 to 50
// lines a run (besides the first and last step's, and each validation's).
int64_t train_log_every(int64_t steps);
//
// ckpt.c: the training checkpoint, written and read.
//
// The tokenizer of a run that resumes the checkpoint ckpt on data whose tokenizer is tok_path: that
// file (the data's shards were made with it), or where it is gone, the copy the checkpoint stores;
// a warning when both are there and differ. NULL after saying why.
struct Tokenizer *train_resume_tokenizer(const char *ckpt, const char *tok_path);
//
// outdir.c: a run's output folder.
//
// Claims the output folder for one run: creates it (*created) and locks it (flock on DIR/lock, which
// holds the pid of the run that has it), and refuses, saying why, when another run holds it, or when
// a run that does not resume would overwrite a checkpoint or a log. The lock's fd, or -1 after the
// message. train_release_out closes it; with `remove`, the folder goes too when nothing else is in it.
int train_claim_out(const char *dir, bool resume, bool *created);
void train_release_out(int fd, const char *dir, bool remove);
//
// gemm.c: signals while a GEMM library runs.
//
// Gives the calling thread an alternate signal stack, once (every thread that calls sgemm or bgemm
// has one): a handler installed with SA_ONSTACK then never writes its frame where a GEMM kernel has
// pointed the stack (gemm.c, "Signals").
void rt_signal_stack(void);

#endif
