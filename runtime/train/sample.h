// sample.h: `mdlc sample`: text generation from a checkpoint, one token per step with a KV cache
// (sample.c). Its pieces are public so that tests can drive them token by token; the driver compiles
// the model (compiler/driver/sampling.c).
#ifndef MDL_SAMPLE_H
#define MDL_SAMPLE_H
#include "mdl.h"

typedef struct {
  const char *checkpoint; // a safetensors checkpoint written by training ("mdl-checkpoint-1")
  const char *prompt;     // text to continue; may be empty or NULL (generation from EOS alone)
  int64_t tokens;         // new tokens at most
  double temperature;     // logits are divided by it; 0 = greedy (argmax)
  int64_t top_k;          // draw among the k most likely tokens; 0 = all of them
  uint64_t seed;          // the draws' random stream
} SampleOptions;

// 200 tokens, temperature 1, top-k 0 (the model's own distribution), seed 0.
void sample_defaults(SampleOptions *o);

// The model a training checkpoint records: its .mdl file, every dim as trained, its tokenizer, and
// the copies of the .mdl text and of the tokenizer (base64) it stores (NULL in older checkpoints).
typedef struct {
  const char *source, *tokenizer;
  const char *text, *tokenizer_base64;
  DimOverride *dims;
  int ndims;
} CheckpointModel;
// Reads them from f (the checkpoint at path, as st_read read it) into a's memory; false after
// printing why (not an mdl checkpoint, a field missing, the model file not readable where the
// checkpoint stores no copy of it).
bool checkpoint_model(Arena *a, const char *path, const StFile *f, CheckpointModel *m);
// The text eval and sample compile for m: the copy the checkpoint (path) stores, with one warning
// when the file at the recorded path differs from it (`doing`: what the verb does with the copy,
// "sampling"); NULL where it stores none (older checkpoints): then the file at the recorded path.
const char *checkpoint_model_text(Arena *a, const char *path, const CheckpointModel *m, const char *doing);
// Where m's file was compiled (a checkpoint storing no text), one note for each fixed dim of g (compiled
// with m's dims as -D) that the checkpoint sets to another value than the file gives (a run given -D
// for it, or the file changed since): the stored text with its dims is the run's own model, silently.
void checkpoint_dims_note(const char *path, const CheckpointModel *m, const Graph *g, const char *doing);

// A checkpoint's model compiled for one token per step (B = T = 1, the other dims as recorded),
// its parameters loaded into the interpreter in decode mode. It opens in three moves: sampler_read
// reads the checkpoint; whoever compiles (the driver's sampler_open) compiles sampler_model's text
// in sampler_arena, dropout off (ir_eval_mode); sampler_start takes the graph.
typedef struct Sampler Sampler;
Sampler *sampler_read(const char *checkpoint); // NULL after printing why
// The model to compile: its file and dims (B = T = 1), and in *text the copy of its text the
// checkpoint stores (a warning where the file differs), or NULL: then the file.
const CheckpointModel *sampler_model(const Sampler *s, const char **text);
Arena *sampler_arena(Sampler *s); // where the graph is to be allocated
// Checks graph g (NULL: it did not compile, said) against the checkpoint and loads the parameters into
// the interpreter; false after printing why (then sampler_close s).
bool sampler_start(Sampler *s, Graph *g);
void sampler_close(Sampler *s);
int64_t sampler_vocab(const Sampler *s);         // V: the logits of one step
int64_t sampler_context(const Sampler *s);       // the longest context: the dim maxT, else T
const char *sampler_tokenizer(const Sampler *s); // the tokenizer path the checkpoint records
// Starts a new sequence: the next token fed goes to position 0.
void sampler_reset(Sampler *s);
// Feeds one token at the next position and returns the logits that follow it (sampler_vocab
// values, valid until the next call); NULL after printing why (a bad id, a full context).
const double *sampler_feed(Sampler *s, int32_t token);
// Generates at most o->tokens new ids after the context ctx[0..n) (n >= 1), into out (may be NULL;
// room for o->tokens), calling emit (may be NULL) with each as it comes; stops early at EOS (not
// stored). The model sees the last sampler_context tokens at most: a longer ctx is cropped to its
// last ones, and once the context is full each new id is drawn from a prefill of the last ones
// (nanoGPT's crop); a note on stderr, once per sampler, says so. Returns the count, or -1 after
// printing why.
int64_t sampler_generate(Sampler *s, const int32_t *ctx, int64_t n, const SampleOptions *o, int32_t *out,
                         void (*emit)(void *arg, int32_t id), void *arg);

// The next token from n logits: the argmax at temperature 0 (the lowest id among ties); otherwise
// a draw from softmax(logits / temperature) over the top_k largest (ties to the lower id; 0 = all),
// with u = mdl_rng_uniform(seed, SAMPLE_RNG_STREAM, index).
#define SAMPLE_RNG_STREAM 0x73616d70u // "samp"
int32_t sample_pick(const double *logits, int64_t n, double temperature, int64_t top_k, uint64_t seed,
                    uint64_t index);
// The tokenizer (the copy the checkpoint stores, else the file it names), then the prompt and the
// text generated from it printed to stdout as it comes. Returns the exit status: 0, or 1 after
// printing "path: error: reason".
int sampler_print(Sampler *s, const SampleOptions *o);
#endif
