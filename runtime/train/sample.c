// sample.c: `mdlc sample`: text generation from a training checkpoint.
//
// A checkpoint records its model (the .mdl path and every dim's value) next to the parameters, and,
// since they were stored, the .mdl text and the tokenizer themselves: those copies are what the
// sampler uses, wherever the files went (a file still at the recorded path that differs gets one
// warning); a checkpoint without them (written before) needs the files at the recorded paths. The
// driver compiles the model again (sampler_model says what) with the recorded dims as -D overrides,
// except B = 1 and T = 1: a graph that processes one token. The reference interpreter runs it in decode mode (interp.c):
// every op of a language model is position-wise except attention, whose nodes keep the k and v rows
// of the positions fed so far, so one run per token costs one token's work and gives the logits the
// full forward graph gives at that position. Only the nodes up to the `logits` output run.
//
// Generation: EOS (documents start with it in the training data), then the prompt's tokens, are
// fed one by one (the prefill); then each new token is drawn from the last logits (argmax at
// temperature 0, else softmax(logits / temperature) over the top-k, with a counter-based random
// number indexed by the token's position in the sequence) and fed back, until the count or EOS.
// The model sees at most its context (the dim maxT, else T) of the last tokens, as nanoGPT crops
// them: a longer prompt is cut to its last ones, and once the context is full, each new token is
// drawn from a prefill of the last `context` tokens at positions 0..context-1 (one line on stderr
// says so, once).
#include "sample.h"

#include "data.h"
#include "runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct Sampler {
  Arena *a;              // the graph's arena
  Arena *file_arena;     // the checkpoint as read (f), until the parameters are copied
  StFile f;
  CheckpointModel m;     // its model, dims B = T = 1 (sampler_model)
  const char *text;      // the .mdl text to compile: the checkpoint's copy, else NULL (m.source's file)
  const char *path;      // the checkpoint, for messages
  const char *tokenizer; // recorded in the checkpoint
  const char *stored_tokenizer; // the copy it stores (base64), or NULL
  bool said_crop;        // the note that the context slides is out
  Graph *g;
  Interp *it;
  int logits;            // the node of "output logits"
  bool has[4];           // the graph has the input named input_names[i]
  int64_t vocab, context;
  int64_t pos;           // the position of the next token fed
};

// The inputs a language model may have, and the value each gets for one generated token.
enum { IN_TOKENS, IN_POS, IN_DOC, IN_TARGETS };
static const char *const input_names[] = {"tokens", "pos", "doc", "targets"};

void sample_defaults(SampleOptions *o) {
  *o = (SampleOptions){.tokens = 200, .temperature = 1.0, .top_k = 0, .seed = 0};
}

int64_t sampler_vocab(const Sampler *s) { return s->vocab; }
int64_t sampler_context(const Sampler *s) { return s->context; }
const char *sampler_tokenizer(const Sampler *s) { return s->tokenizer; }
void sampler_reset(Sampler *s) { s->pos = 0; }

void sampler_close(Sampler *s) {
  if (!s)
    return;
  interp_free(s->it);
  arena_free(s->file_arena);
  arena_free(s->a);
  free(s);
}

// A required metadata string, or NULL after saying it is missing.
static const char *need_meta(const char *path, const StFile *f, const char *key) {
  const char *v = st_meta(f, key);
  if (!v)
    diag_file_error(path, "not an mdl checkpoint (no %s in its metadata)", key);
  return v;
}

bool checkpoint_model(Arena *a, const char *path, const StFile *f, CheckpointModel *m) {
  CkptMeta meta;
  if (!ckpt_meta_read(a, path, f, &meta))
    return false;
  const char *source = need_meta(path, f, "mdl.source");
  const char *dims = source ? need_meta(path, f, "mdl.dims") : NULL;
  const char *tokenizer = dims ? need_meta(path, f, "mdl.tokenizer") : NULL;
  if (!tokenizer)
    return false;
  m->dims = meta.dims;
  m->ndims = meta.ndims;
  m->source = arena_strdup(a, source);
  m->tokenizer = arena_strdup(a, tokenizer);
  const char *text = st_meta(f, "mdl.source_text"), *tok = st_meta(f, "mdl.tokenizer_base64");
  m->text = text ? arena_strdup(a, text) : NULL;
  m->tokenizer_base64 = tok ? arena_strdup(a, tok) : NULL;
  if (!m->text && access(m->source, R_OK) != 0) {
    diag_file_error(path, "cannot read the checkpoint's model %s: %s", m->source, strerror(errno));
    return false;
  }
  return true;
}

// The checkpoint's dims with B and T set to 1; the context is the value of maxT, else of T.
static bool decode_dims(Sampler *s, const CheckpointModel *m) {
  for (int i = 0; i < m->ndims; i++) {
    DimOverride *d = &m->dims[i];
    if (!strcmp(d->name, "maxT") || (!strcmp(d->name, "T") && !s->context))
      s->context = d->value;
    if (!strcmp(d->name, "B") || !strcmp(d->name, "T"))
      d->value = 1;
  }
  if (!s->context) {
    diag_file_error(s->path, "cannot sample: its model has no sequence dim (maxT or T in mdl.dims); sampling "
                             "generates tokens from a language model; `mdlc eval` reports this one's outputs");
    return false;
  }
  return true;
}

// The logits output and the inputs: every input must be one sampling can set, with one element.
static bool check_graph(Sampler *s, const char *source) {
  const Graph *g = s->g;
  s->logits = -1;
  for (int i = 0; i < g->noutputs; i++) {
    const IrNode *n = g->nodes[g->outputs[i]];
    if (n->name && !strcmp(n->name, "logits"))
      s->logits = n->id;
  }
  if (s->logits < 0) {
    diag_file_error(source, "the model has no 'output logits' to sample from");
    return false;
  }
  const IrNode *ln = g->nodes[s->logits];
  s->vocab = ln->shape.rank ? ln->shape.d[ln->shape.rank - 1] : 1;
  char buf[64];
  if (ln->dtype != DT_F32 || shape_numel(ln->shape) != s->vocab) {
    diag_file_error(source, "output logits is %s%s with B = T = 1; sampling wants f32[1, 1, V]",
                    dtype_name(ln->dtype), shape_str(ln->shape, buf, sizeof buf));
    return false;
  }
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op != OP_INPUT)
      continue;
    int k = 0;
    while (k < 4 && strcmp(n->name, input_names[k]))
      k++;
    if (k == 4 || n->dtype != DT_I32 || shape_numel(n->shape) != 1) {
      diag_file_error(source, "input '%s' (%s%s with B = T = 1) is not one sampling can feed: tokens, pos, doc, "
                      "targets, each i32[B, T]", n->name, dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf));
      return false;
    }
    s->has[k] = true;
  }
  if (!s->has[IN_TOKENS]) {
    diag_file_error(source, "the model has no input tokens: i32[B, T] to feed");
    return false;
  }
  return true;
}

static int find_param(const Graph *g, const char *name) {
  for (int k = 0; k < g->nparams; k++)
    if (!strcmp(g->nodes[g->params[k]]->name, name))
      return g->params[k];
  return -1;
}

// Every parameter is in the checkpoint with its shape, and every tensor of the checkpoint is a
// parameter, one of its AdamW moments ("<param>.m", "<param>.v") or an fp8 run's scaling state
// ("fp8.scale", "fp8.amax_history": training state, which sampling does not use). Copies the values in.
static bool load_params(Sampler *s, const StFile *f, const char *source) {
  const Graph *g = s->g;
  const char *prefix = arena_printf(s->a, "checkpoint does not match %s: ", source);
  for (int k = 0; k < g->nparams; k++) {
    const IrNode *n = g->nodes[g->params[k]];
    const StTensor *t = st_expect(f, s->path, prefix, n);
    if (!t)
      return false;
    double *p = interp_param(s->it, n->id);
    const float *src = t->data;
    int64_t bad = rt_first_nonfinite(src, shape_numel(n->shape));
    if (bad >= 0) { // (training stops before writing such weights: a checkpoint damaged, or made elsewhere)
      diag_file_error(s->path, "parameter '%s' is not finite (element %lld is %g): nothing to sample from",
                      n->name, (long long)bad, (double)src[bad]);
      return false;
    }
    for (int64_t i = 0; i < shape_numel(n->shape); i++)
      p[i] = src[i];
  }
  for (int i = 0; i < f->n; i++) {
    const char *name = f->t[i].name;
    size_t len = strlen(name);
    if (find_param(g, name) >= 0 || !strcmp(name, "fp8.scale") || !strcmp(name, "fp8.amax_history"))
      continue;
    if (len > 2 && (!strcmp(name + len - 2, ".m") || !strcmp(name + len - 2, ".v"))) {
      char *base = arena_alloc(s->a, len - 1);
      memcpy(base, name, len - 2);
      if (find_param(g, base) >= 0)
        continue;
    }
    diag_file_error(s->path, "checkpoint does not match %s: tensor '%s' is not a parameter of the model", source,
                    name);
    return false;
  }
  return true;
}

// The whole of a regular file in the arena, as text, or NULL (no message) when it cannot be read.
static char *read_text(Arena *a, const char *path) {
  char why[256];
  size_t n;
  char *buf = file_read(path, &n, 0, why, sizeof why), *text = buf ? arena_alloc(a, n + 1) : NULL;
  if (buf)
    memcpy(text, buf, n + 1);
  free(buf);
  return text;
}

const char *checkpoint_model_text(Arena *a, const char *path, const CheckpointModel *m, const char *doing) {
  if (!m->text)
    return NULL;
  const char *disk = read_text(a, m->source);
  if (disk && strcmp(disk, m->text))
    fprintf(stderr, "%s: warning: %s differs from the model this checkpoint was trained with; %s with the copy "
            "of that model stored in the checkpoint\n", path, m->source, doing);
  return m->text;
}

void checkpoint_dims_note(const char *path, const CheckpointModel *m, const Graph *g, const char *doing) {
  for (int i = 0; !m->text && i < g->ndims; i++) { // (the stored text with its dims is the run's own model)
    const DimBinding *d = &g->dims[i];
    for (int k = 0; k < m->ndims; k++)
      if (d->value != d->text_value && !strcmp(m->dims[k].name, d->name) && m->dims[k].value == d->value)
        fprintf(stderr, "%s: note: %s fixes dim %s = %lld; this checkpoint was trained with %s=%lld (given with "
                "-D, or the model changed since), which %s uses\n", path, m->source,
                d->name, (long long)d->text_value, d->name, (long long)d->value, doing);
  }
}

Sampler *sampler_read(const char *checkpoint) {
  Sampler *s = xcalloc(1, sizeof *s, "the sampler");
  s->file_arena = arena_new();
  s->a = arena_new();
  s->path = arena_strdup(s->a, checkpoint);
  if (!st_read(s->file_arena, s->path, &s->f) || !checkpoint_model(s->a, s->path, &s->f, &s->m) ||
      !decode_dims(s, &s->m)) {
    sampler_close(s);
    return NULL;
  }
  s->tokenizer = s->m.tokenizer;
  s->stored_tokenizer = s->m.tokenizer_base64;
  s->text = checkpoint_model_text(s->file_arena, s->path, &s->m, "sampling");
  return s;
}

Arena *sampler_arena(Sampler *s) { return s->a; }

const CheckpointModel *sampler_model(const Sampler *s, const char **text) {
  *text = s->text;
  return &s->m;
}

// Every parameter's shape is the checkpoint's before the interpreter allocates them (dims as recorded
// that no tensor there has are refused without allocating for them); the checkpoint as read is
// dropped once the parameters are copied.
bool sampler_start(Sampler *s, Graph *g) {
  s->g = g;
  const CheckpointModel *m = &s->m;
  if (!s->g || !check_graph(s, m->source))
    return false;
  const char *prefix = arena_printf(s->a, "checkpoint does not match %s: ", m->source);
  for (int k = 0; k < s->g->nparams; k++)
    if (!st_expect(&s->f, s->path, prefix, s->g->nodes[s->g->params[k]]))
      return false;
  checkpoint_dims_note(s->path, m, s->g, "sampling");
  s->it = interp_new(s->g, INTERP_F32);
  if (!load_params(s, &s->f, m->source))
    return false;
  interp_set_decode(s->it, s->context);
  arena_free(s->file_arena);
  s->file_arena = NULL;
  return true;
}

const double *sampler_feed(Sampler *s, int32_t token) {
  if (s->pos >= s->context) {
    diag_file_error(s->path, "the context is full: the model reads at most %lld tokens", (long long)s->context);
    return NULL;
  }
  int32_t value[4] = {[IN_TOKENS] = token, [IN_POS] = (int32_t)s->pos, [IN_DOC] = 0, [IN_TARGETS] = -1};
  for (int k = 0; k < 4; k++)
    if (s->has[k])
      interp_set_input(s->it, input_names[k], &value[k], NULL, 1);
  interp_set_decode_pos(s->it, s->pos);
  char err[256];
  if (!interp_run(s->it, s->logits + 1, err, sizeof err)) {
    diag_file_error(s->path, "at position %lld: %s", (long long)s->pos, err);
    return NULL;
  }
  s->pos++;
  return interp_value(s->it, s->logits);
}

// Feeds win[0..n) from position 0; the logits after the last, or NULL after saying why.
static const double *prefill(Sampler *s, const int32_t *win, int64_t n) {
  const double *logits = NULL;
  sampler_reset(s);
  for (int64_t i = 0; i < n; i++)
    if (!(logits = sampler_feed(s, win[i])))
      return NULL;
  return logits;
}

int64_t sampler_generate(Sampler *s, const int32_t *ctx, int64_t n, const SampleOptions *o, int32_t *out,
                         void (*emit)(void *arg, int32_t id), void *arg) {
  if (n < 1) {
    diag_file_error(s->path, "nothing to continue: the context holds no token (not even the leading EOS)");
    return -1;
  }
  int64_t c = s->context, len = n < c ? n : c; // win[0..len): the last tokens, what the model sees
  int32_t *win = xmalloc(sizeof *win * (size_t)c, "the sampler's context window");
  memcpy(win, ctx + (n - len), sizeof *win * (size_t)len);
  if (n > c && !s->said_crop) {
    s->said_crop = true;
    fprintf(stderr, "%s: note: the prompt is %lld tokens with its leading EOS, more than the model's context of "
            "%lld: the model sees the last %lld tokens, before and after each new one\n", s->path, (long long)n,
            (long long)c, (long long)c);
  }
  const double *logits = prefill(s, win, len);
  int64_t count = 0, seen = n; // seen: the tokens of the sequence so far, cropped or not
  while (logits && count < o->tokens) {
    int32_t id = sample_pick(logits, s->vocab, o->temperature, o->top_k, o->seed, (uint64_t)seen);
    if (id == TOK_EOS)
      break;
    if (out)
      out[count] = id;
    count++;
    if (emit)
      emit(arg, id);
    if (count == o->tokens)
      break;
    seen++;
    if (len < c) {
      win[len++] = id;
      logits = sampler_feed(s, id);
      continue;
    }
    if (!s->said_crop) {
      s->said_crop = true;
      fprintf(stderr, "%s: note: the model's context of %lld tokens is full: each further token is drawn from the "
              "last %lld, fed again from position 0 (the context slides)\n", s->path, (long long)c, (long long)c);
    }
    memmove(win, win + 1, sizeof *win * (size_t)(c - 1));
    win[c - 1] = id;
    logits = prefill(s, win, c);
  }
  free(win);
  return logits ? count : -1;
}

typedef struct {
  double logit;
  int32_t id;
} Cand;

// Largest logit first; ties to the lower id.
static int by_logit(const void *pa, const void *pb) {
  const Cand *a = pa, *b = pb;
  if (a->logit != b->logit)
    return a->logit > b->logit ? -1 : 1;
  return (a->id > b->id) - (a->id < b->id);
}

int32_t sample_pick(const double *logits, int64_t n, double temperature, int64_t top_k, uint64_t seed,
                    uint64_t index) {
  if (temperature <= 0) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
      if (logits[i] > logits[best])
        best = i;
    return (int32_t)best;
  }
  Cand *c = xmalloc(sizeof *c * (size_t)n, "the sampler's candidates");
  for (int64_t i = 0; i < n; i++)
    c[i] = (Cand){logits[i], (int32_t)i};
  qsort(c, (size_t)n, sizeof *c, by_logit);
  int64_t k = top_k > 0 && top_k < n ? top_k : n;
  double total = 0, top = c[0].logit;
  for (int64_t i = 0; i < k; i++)
    total += c[i].logit = exp((c[i].logit - top) / temperature);
  double u = mdl_rng_uniform(seed, SAMPLE_RNG_STREAM, index) * total, cum = 0;
  int32_t id = c[k - 1].id;
  for (int64_t i = 0; i < k; i++)
    if (u < (cum += c[i].logit)) {
      id = c[i].id;
      break;
    }
  free(c);
  return id;
}

// Prints one generated token's bytes as it comes; arg is the tokenizer.
static void print_token(void *arg, int32_t id) {
  const Tokenizer *tok = arg;
  char small[256], *buf = small;
  size_t n = tok_decode(tok, &id, 1, small, sizeof small);
  if (n > sizeof small)
    tok_decode(tok, &id, 1, buf = xmalloc(n, "a token's text"), n);
  fwrite(buf, 1, n, stdout);
  if (buf != small)
    free(buf);
  fflush(stdout);
}

// The tokenizer: the copy the checkpoint stores (a file still at the recorded path that differs gets
// a warning), else the file at the recorded path. NULL after saying why; *name is set for messages.
static Tokenizer *load_tokenizer(const Sampler *s, const char **name) {
  *name = s->tokenizer;
  if (!s->stored_tokenizer)
    return tok_load(s->tokenizer);
  *name = s->path;
  size_t n;
  unsigned char *bytes = rt_unbase64(s->stored_tokenizer, &n);
  Tokenizer *t = bytes ? tok_parse(bytes, n, s->path) : NULL;
  if (!bytes)
    diag_file_error(s->path, "mdl.tokenizer_base64 is not base64");
  char why[256];
  size_t got = 0;
  int64_t size = -1;
  int fd = t ? file_open(s->tokenizer, O_RDONLY, &size, why, sizeof why) : -1; // (a FIFO there: not read)
  if (fd >= 0)
    close(fd);
  unsigned char *disk = size == (int64_t)n ? (unsigned char *)file_read(s->tokenizer, &got, n, why, sizeof why) : NULL;
  if (fd >= 0 && (!disk || got != n || memcmp(disk, bytes, n)))
    fprintf(stderr, "%s: warning: %s differs from the tokenizer this checkpoint was trained with; sampling "
            "with the copy of that tokenizer stored in the checkpoint\n", s->path, s->tokenizer);
  free(disk);
  free(bytes);
  return t;
}

int sampler_print(Sampler *s, const SampleOptions *o) {
  const char *tok_name;
  Tokenizer *tok = load_tokenizer(s, &tok_name);
  if (!tok)
    return 1;
  if (tok_vocab(tok) > s->vocab) {
    diag_file_error(tok_name, "tokenizer has %d tokens, the model's V is %lld", tok_vocab(tok),
                    (long long)s->vocab);
    tok_free(tok);
    return 1;
  }
  const char *prompt = o->prompt ? o->prompt : ""; // (no --prompt: generation starts from EOS alone)
  size_t len = strlen(prompt);
  TokBuf ctx = {.ids = xmalloc(sizeof(int32_t) * (len + 1), "the prompt's tokens"), .n = 1, .cap = len + 1};
  ctx.ids[0] = TOK_EOS;
  tok_encode(tok, prompt, len, &ctx);
  fputs(prompt, stdout);
  fflush(stdout);
  int64_t got = sampler_generate(s, ctx.ids, (int64_t)ctx.n, o, NULL, print_token, tok);
  putchar('\n');
  fflush(stdout);
  free(ctx.ids);
  tok_free(tok);
  return got < 0 ? 1 : 0;
}
