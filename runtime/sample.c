// sample.c: `mdlc sample`: text generation from a training checkpoint.
//
// A checkpoint records its model (the .mdl path and every dim's value) next to the parameters. The
// sampler compiles that model again with the recorded dims as -D overrides, except B = 1 and T = 1:
// a graph that processes one token. The reference interpreter runs it in decode mode (interp.c):
// every op of a language model is position-wise except attention, whose nodes keep the k and v rows
// of the positions fed so far, so one run per token costs one token's work and gives the logits the
// full forward graph gives at that position. Only the nodes up to the `logits` output run.
//
// Generation: EOS (documents start with it in the training data), then the prompt's tokens, are
// fed one by one (the prefill); then each new token is drawn from the last logits (argmax at
// temperature 0, else softmax(logits / temperature) over the top-k, with a counter-based random
// number indexed by the token's position) and fed back, until the count, EOS, or the context
// (the dim maxT, else T) is reached.
#include "sample.h"

#include "data.h"
#include "runtime.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct Sampler {
  Arena *a;              // the graph's arena
  const char *path;      // the checkpoint, for messages
  const char *tokenizer; // recorded in the checkpoint
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

// "NAME=VALUE,NAME=VALUE,..." into -D overrides, each value as recorded. False after printing why.
static bool parse_dims(Arena *a, const char *path, const char *text, DimOverride **ov, int *nov) {
  int cap = 1;
  for (const char *p = text; *p; p++)
    cap += *p == ',';
  *ov = arena_alloc(a, sizeof **ov * (size_t)cap);
  *nov = 0;
  for (const char *p = text; *p;) {
    const char *eq = strchr(p, '='), *comma = strchr(p, ',');
    if (!comma)
      comma = p + strlen(p);
    char *end;
    errno = 0;
    long long v = eq && eq < comma ? strtoll(eq + 1, &end, 10) : 0;
    if (!eq || eq >= comma || eq == p || end != comma || eq + 1 == comma || errno || v < 1) {
      diag_file_error(path, "not an mdl checkpoint (mdl.dims '%s' is not NAME=VALUE,...)", text);
      return false;
    }
    char *name = arena_alloc(a, (size_t)(eq - p) + 1);
    memcpy(name, p, (size_t)(eq - p));
    (*ov)[(*nov)++] = (DimOverride){name, v};
    p = *comma ? comma + 1 : comma;
  }
  return true;
}

bool checkpoint_model(Arena *a, const char *path, const StFile *f, CheckpointModel *m) {
  const char *format = st_meta(f, "mdl.format");
  if (!format) {
    diag_file_error(path, "not an mdl checkpoint (no mdl.format in its metadata)");
    return false;
  }
  if (strcmp(format, "mdl-checkpoint-1")) {
    diag_file_error(path, "checkpoint format '%s' is not one this mdlc reads (mdl-checkpoint-1)", format);
    return false;
  }
  const char *source = need_meta(path, f, "mdl.source");
  const char *dims = source ? need_meta(path, f, "mdl.dims") : NULL;
  const char *tokenizer = dims ? need_meta(path, f, "mdl.tokenizer") : NULL;
  if (!tokenizer || !parse_dims(a, path, dims, &m->dims, &m->ndims))
    return false;
  m->source = arena_strdup(a, source);
  m->tokenizer = arena_strdup(a, tokenizer);
  if (access(m->source, R_OK) != 0) {
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
    diag_file_error(s->path, "not an mdl checkpoint (mdl.dims has neither maxT nor T)");
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
// parameter or one of its AdamW moments ("<param>.m", "<param>.v"). Copies the values in.
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
    if (find_param(g, name) >= 0)
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

// Reads the checkpoint (its own arena, dropped once the parameters are copied), then compiles and
// checks the model it names.
static bool open_from(Sampler *s, Arena *file_arena) {
  StFile f;
  CheckpointModel m;
  if (!st_read(file_arena, s->path, &f) || !checkpoint_model(s->a, s->path, &f, &m) || !decode_dims(s, &m))
    return false;
  s->tokenizer = m.tokenizer;
  s->g = mdl_compile_file(s->a, m.source, m.dims, m.ndims);
  if (!s->g || !check_graph(s, m.source))
    return false;
  ir_eval_mode(s->g);
  s->it = interp_new(s->g, INTERP_F32);
  if (!load_params(s, &f, m.source))
    return false;
  interp_set_decode(s->it, s->context);
  return true;
}

Sampler *sampler_open(const char *checkpoint) {
  Sampler *s = calloc(1, sizeof *s);
  Arena *file_arena = arena_new();
  if (!s || !file_arena) {
    fprintf(stderr, "mdlc: out of memory\n");
    exit(1);
  }
  s->a = arena_new();
  s->path = arena_strdup(s->a, checkpoint);
  bool ok = open_from(s, file_arena);
  arena_free(file_arena);
  if (!ok) {
    sampler_close(s);
    return NULL;
  }
  return s;
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

// A context of n tokens fits the model; false after saying why.
static bool context_fits(const Sampler *s, int64_t n) {
  if (n >= 1 && n <= s->context)
    return true;
  diag_file_error(s->path, "the prompt is %lld tokens with its leading EOS; the model's context is 1 to %lld",
                  (long long)n, (long long)s->context);
  return false;
}

int64_t sampler_generate(Sampler *s, const int32_t *ctx, int64_t n, const SampleOptions *o, int32_t *out,
                         void (*emit)(void *arg, int32_t id), void *arg) {
  if (!context_fits(s, n))
    return -1;
  sampler_reset(s);
  const double *logits = NULL;
  for (int64_t i = 0; i < n; i++)
    if (!(logits = sampler_feed(s, ctx[i])))
      return -1;
  int64_t count = 0;
  while (count < o->tokens) {
    int32_t id = sample_pick(logits, s->vocab, o->temperature, o->top_k, o->seed, (uint64_t)s->pos);
    if (id == TOK_EOS)
      break;
    out[count++] = id;
    if (emit)
      emit(arg, id);
    if (count == o->tokens || s->pos == s->context)
      break;
    if (!(logits = sampler_feed(s, id)))
      return -1;
  }
  return count;
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
  Cand *c = malloc(sizeof *c * (size_t)n);
  if (!c) {
    fprintf(stderr, "mdlc: out of memory\n");
    exit(1);
  }
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
  if (n > sizeof small && (buf = malloc(n)))
    tok_decode(tok, &id, 1, buf, n);
  fwrite(buf, 1, buf ? n : 0, stdout);
  if (buf != small)
    free(buf);
  fflush(stdout);
}

int sample_run(const SampleOptions *o) {
  Sampler *s = sampler_open(o->checkpoint);
  if (!s)
    return 1;
  Tokenizer *tok = tok_load(s->tokenizer);
  if (!tok) {
    sampler_close(s);
    return 1;
  }
  if (tok_vocab(tok) > s->vocab) {
    diag_file_error(s->tokenizer, "tokenizer has %d tokens, the model's V is %lld", tok_vocab(tok),
                    (long long)s->vocab);
    tok_free(tok);
    sampler_close(s);
    return 1;
  }
  const char *prompt = o->prompt ? o->prompt : ""; // (no --prompt: generation starts from EOS alone)
  size_t len = strlen(prompt);
  TokBuf ctx = {.ids = malloc(sizeof(int32_t) * (len + 1)), .n = 1, .cap = len + 1};
  int32_t *out = malloc(sizeof(int32_t) * (size_t)(s->context + 1));
  if (!ctx.ids || !out) {
    fprintf(stderr, "mdlc: out of memory\n");
    exit(1);
  }
  ctx.ids[0] = TOK_EOS;
  tok_encode(tok, prompt, len, &ctx);
  int64_t got = -1;
  if (context_fits(s, (int64_t)ctx.n)) {
    fputs(prompt, stdout);
    fflush(stdout);
    got = sampler_generate(s, ctx.ids, (int64_t)ctx.n, o, out, print_token, tok);
    putchar('\n');
    fflush(stdout);
  }
  free(out);
  free(ctx.ids);
  tok_free(tok);
  sampler_close(s);
  return got < 0 ? 1 : 0;
}
