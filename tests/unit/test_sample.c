// test_sample.c: text generation from a checkpoint. The references are independent of the KV cache:
// the full forward graph (T tokens at once, one document) run by the interpreter, and, for the
// draws, softmax probabilities computed here. Checkpoints are written the way training writes
// them: every parameter, its AdamW moments, and the mdl.* metadata, with parameters initialised by
// the interpreter and then perturbed so that attention is far from uniform.
#include "data.h"
#include "mdl.h"
#include "runtime.h"
#include "sample.h"
#include "driver.h"
#include "test.h"
#include "scratch_dir.h"

#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

//
// Models and checkpoints.
//

typedef struct {
  Arena *a;
  Graph *g;
  Interp *it;
  int logits;
  int64_t T, V;
} Full;

// The model's full forward graph for one sequence (B = 1, T tokens; maxT when nonzero), its
// parameters initialised from the seed, then each moved by a uniform step in [-0.25, 0.25] (and
// rounded to f32, as the checkpoint stores them).
static bool full_open(Full *f, const char *model, int64_t T, int64_t maxT, uint64_t seed) {
  f->a = arena_new();
  DimOverride ov[] = {{"B", 1}, {"T", T}, {"maxT", maxT}};
  f->g = mdl_compile_file(f->a, model, ov, maxT ? 3 : 2);
  if (!f->g)
    return false;
  f->T = T;
  f->logits = -1;
  for (int i = 0; i < f->g->noutputs; i++)
    if (!strcmp(f->g->nodes[f->g->outputs[i]]->name, "logits"))
      f->logits = f->g->outputs[i];
  f->V = f->g->nodes[f->logits]->shape.d[2];
  f->it = interp_new(f->g, INTERP_F32);
  interp_init_params(f->it, seed);
  for (int k = 0; k < f->g->nparams; k++) {
    double *p = interp_param(f->it, f->g->params[k]);
    for (int64_t i = 0; i < interp_numel(f->it, f->g->params[k]); i++)
      p[i] = (float)(p[i] + 0.5 * (mdl_rng_uniform(seed, 77 + (uint64_t)k, (uint64_t)i) - 0.5));
  }
  return true;
}

static void full_close(Full *f) {
  interp_free(f->it);
  arena_free(f->a);
}

// Runs the full forward over seq[0..T) (pos = t, doc = 0, no targets); the logits of position t
// are then full_row(f, t).
static bool full_run(Full *f, const int32_t *seq) {
  int32_t pos[256], zero[256], none[256];
  for (int64_t t = 0; t < f->T; t++)
    pos[t] = (int32_t)t, zero[t] = 0, none[t] = -1;
  interp_set_input(f->it, "tokens", seq, NULL, f->T);
  interp_set_input(f->it, "pos", pos, NULL, f->T);
  interp_set_input(f->it, "doc", zero, NULL, f->T);
  interp_set_input(f->it, "targets", none, NULL, f->T);
  char err[256];
  if (!interp_run(f->it, f->logits + 1, err, sizeof err)) {
    printf("[fail] full forward: %s\n", err);
    return false;
  }
  return true;
}

static const double *full_row(Full *f, int64_t t) { return interp_value(f->it, f->logits) + t * f->V; }

static int32_t argmax(const double *x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; i++)
    if (x[i] > x[best])
      best = i;
  return (int32_t)best;
}

typedef struct {
  const char *source;    // mdl.source; NULL: the model's absolute path
  const char *tokenizer; // mdl.tokenizer; NULL: tmp/tokenizer.bin
  const char *format;    // mdl.format; NULL: "mdl-checkpoint-1"
  const char *dims;      // mdl.dims; NULL: the graph's dims with B = 8, T = min(64, maxT)
  const char *skip;      // a parameter left out
  bool extra;            // add a tensor that is no parameter
  bool no_meta;          // no metadata at all
  bool stored;           // the copies training stores: mdl.source_text (the model file's text) and
                         // mdl.tokenizer_base64 (the byte-level tokenizer)
} CkptOpts;

// A checkpoint of f's parameters as training writes it.
static bool write_checkpoint(const char *path, const char *model, Full *f, CkptOpts o) {
  const Graph *g = f->g;
  int n = 0;
  StTensor *t = calloc((size_t)(3 * g->nparams + 1), sizeof *t);
  float **bufs = calloc((size_t)g->nparams + 1, sizeof *bufs);
  float *zeros = calloc(1 << 16, sizeof(float)), extra[3] = {1, 2, 3};
  char (*names)[128] = calloc((size_t)(2 * g->nparams), 128);
  for (int k = 0; k < g->nparams; k++) {
    const IrNode *p = g->nodes[g->params[k]];
    int64_t numel = shape_numel(p->shape);
    bufs[k] = malloc(sizeof(float) * (size_t)numel);
    for (int64_t i = 0; i < numel; i++)
      bufs[k][i] = (float)interp_param(f->it, p->id)[i];
    if (o.skip && !strcmp(o.skip, p->name))
      continue;
    t[n++] = (StTensor){p->name, DT_F32, p->shape, bufs[k]};
    snprintf(names[2 * k], 128, "%s.m", p->name);
    snprintf(names[2 * k + 1], 128, "%s.v", p->name);
    t[n++] = (StTensor){names[2 * k], DT_F32, p->shape, zeros};
    t[n++] = (StTensor){names[2 * k + 1], DT_F32, p->shape, zeros};
  }
  if (o.extra)
    t[n++] = (StTensor){"bogus", DT_F32, shape_of(1, (int64_t[]){3}), extra};
  char dims[512] = "", source[4096];
  int64_t maxT = 0;
  for (int i = 0; i < g->ndims; i++)
    if (!strcmp(g->dims[i].name, "maxT"))
      maxT = g->dims[i].value;
  for (int i = 0; i < g->ndims; i++) {
    const char *name = g->dims[i].name;
    int64_t v = !strcmp(name, "B") ? 8 : !strcmp(name, "T") ? (maxT < 64 ? maxT : 64) : g->dims[i].value;
    snprintf(dims + strlen(dims), sizeof dims - strlen(dims), "%s%s=%lld", i ? "," : "", name, (long long)v);
  }
  if (!realpath(model, source))
    snprintf(source, sizeof source, "%s", model);
  StMeta meta[] = {{"mdl.format", o.format ? o.format : "mdl-checkpoint-1"},
                   {"mdl.source", o.source ? o.source : source},
                   {"mdl.dims", o.dims ? o.dims : dims},
                   {"mdl.tokenizer", o.tokenizer ? o.tokenizer : path_in("tokenizer.bin")},
                   {"mdl.step", "3"}, {"mdl.source_text", NULL}, {"mdl.tokenizer_base64", NULL}};
  char *text = NULL, *tok64 = NULL;
  if (o.stored) {
    FILE *in = fopen(model, "rb");
    text = calloc(1, 1 << 16);
    if (in) {
      size_t got = fread(text, 1, (1 << 16) - 1, in);
      text[got] = 0;
      fclose(in);
    }
    Tokenizer *bytes = tok_new(NULL, 0, NULL, 0);
    size_t nb;
    unsigned char *file = tok_bytes(bytes, &nb);
    tok64 = rt_base64(file, nb);
    free(file);
    tok_free(bytes);
    meta[5].value = text;
    meta[6].value = tok64;
  }
  bool ok = st_write_meta(path, t, n, meta, o.no_meta ? 0 : o.stored ? 7 : 5);
  free(text);
  free(tok64);
  for (int k = 0; k < g->nparams; k++)
    free(bufs[k]);
  free(bufs);
  free(zeros);
  free(names);
  free(t);
  return ok;
}

//
// The KV cache is exact.
//

// For two token sequences in turn (the second overwrites the cache the first filled), the logits
// of decode mode at every position equal the full forward's at that position.
static void test_kv_exact(const char *model, const char *label) {
  Full f;
  char name[128], ck[64];
  snprintf(ck, sizeof ck, "kv-%s.safetensors", label);
  if (!full_open(&f, model, 32, 0, 11)) {
    CHECK(false, label, "%s does not compile", model);
    return;
  }
  snprintf(name, sizeof name, "kv %s: checkpoint written", label);
  CHECK(write_checkpoint(path_in(ck), model, &f, (CkptOpts){0}), name, "st_write_meta failed");
  Sampler *s = sampler_open(path_in(ck));
  snprintf(name, sizeof name, "kv %s: the checkpoint opens, V = 256, context = maxT = 128", label);
  CHECK(s && sampler_vocab(s) == 256 && sampler_context(s) == 128, name, "vocab %lld context %lld",
        s ? (long long)sampler_vocab(s) : -1, s ? (long long)sampler_context(s) : -1);
  for (int round = 0; s && round < 2; round++) {
    int32_t seq[32];
    seq[0] = TOK_EOS;
    for (int t = 1; t < 32; t++)
      seq[t] = (int32_t)(mdl_rng_u64(5, (uint64_t)round, (uint64_t)t) % 256);
    if (!full_run(&f, seq))
      break;
    sampler_reset(s);
    double worst = 0;
    int at = -1;
    for (int t = 0; t < 32; t++) {
      const double *d = sampler_feed(s, seq[t]), *r = full_row(&f, t);
      if (!d) {
        worst = INFINITY, at = t;
        break;
      }
      double scale = 0;
      for (int64_t v = 0; v < f.V; v++)
        scale = fmax(scale, fabs(r[v]));
      for (int64_t v = 0; v < f.V; v++)
        if (fabs(d[v] - r[v]) / scale > worst)
          worst = fabs(d[v] - r[v]) / scale, at = t;
    }
    snprintf(name, sizeof name, "kv %s: sequence %d, decode logits = full forward logits at all 32 positions",
             label, round + 1);
    CHECK(worst <= 1e-5, name, "relative error %.3g at position %d", worst, at);
  }
  // The past matters: the logits at position 31 differ from those of the last token fed alone.
  if (s) {
    const double *last = full_row(&f, 31);
    double *kept = malloc(sizeof(double) * (size_t)f.V), diff = 0;
    memcpy(kept, last, sizeof(double) * (size_t)f.V);
    sampler_reset(s);
    const double *alone = sampler_feed(s, 0);
    for (int64_t v = 0; alone && v < f.V; v++)
      diff = fmax(diff, fabs(alone[v] - kept[v]));
    snprintf(name, sizeof name, "kv %s: attention reads the cache (position 31 differs from a lone token)", label);
    CHECK(diff > 1e-3, name, "largest difference %.3g", diff);
    free(kept);
  }
  sampler_close(s);
  full_close(&f);
}

//
// Generation.
//

// Greedy decoding by the full forward: argmax of the logits at the last position, appended, again;
// the same stopping rules (count, EOS, context).
// Greedy decoding over the full forward as nanoGPT crops: the model sees the last `context` tokens.
static int64_t greedy_reference(Full *f, const int32_t *ctx, int64_t n, int64_t count, int64_t context, int32_t *ref) {
  int32_t seq[256] = {0};
  int64_t len = n < context ? n : context, got = 0;
  memcpy(seq, ctx + (n - len), sizeof *ctx * (size_t)len);
  while (got < count && full_run(f, seq)) {
    int32_t id = argmax(full_row(f, len - 1), f->V);
    if (id == TOK_EOS)
      break;
    ref[got++] = id;
    if (len == context)
      memmove(seq, seq + 1, sizeof *seq * (size_t)--len);
    seq[len++] = id;
  }
  return got;
}

static bool same(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
  return na == nb && !memcmp(a, b, sizeof *a * (size_t)na);
}

static void test_generate(const char *model, const char *label) {
  Full f;
  char name[160], ck[64];
  snprintf(ck, sizeof ck, "gen-%s.safetensors", label);
  if (!full_open(&f, model, 32, 0, 21) || !write_checkpoint(path_in(ck), model, &f, (CkptOpts){0})) {
    CHECK(false, label, "no checkpoint for %s", model);
    return;
  }
  Sampler *s = sampler_open(path_in(ck));
  if (!s) {
    CHECK(false, label, "the checkpoint does not open");
    full_close(&f);
    return;
  }
  const int32_t ctx[] = {TOK_EOS, 'H', 'i', ' '};
  int32_t ref[32], out[32], again[32], k1[32], seed1[32], seed1b[32], seed2[32];
  SampleOptions o;
  sample_defaults(&o);
  o.tokens = 20;
  o.temperature = 0;
  int64_t nref = greedy_reference(&f, ctx, 4, 20, 128, ref);
  int64_t n = sampler_generate(s, ctx, 4, &o, out, NULL, NULL);
  snprintf(name, sizeof name, "generate %s: greedy = argmax of the full forward, step by step (%lld tokens)", label,
           (long long)nref);
  CHECK(nref > 0 && same(out, n, ref, nref), name, "%lld tokens, reference %lld; first %d vs %d", (long long)n,
        (long long)nref, n > 0 ? out[0] : -1, nref > 0 ? ref[0] : -1);
  int64_t na = sampler_generate(s, ctx, 4, &o, again, NULL, NULL);
  snprintf(name, sizeof name, "generate %s: greedy is deterministic", label);
  CHECK(same(out, n, again, na), name, "%lld then %lld tokens", (long long)n, (long long)na);

  o.temperature = 1;
  o.top_k = 1;
  int64_t nk = sampler_generate(s, ctx, 4, &o, k1, NULL, NULL);
  snprintf(name, sizeof name, "generate %s: top-k 1 at temperature 1 = greedy", label);
  CHECK(same(k1, nk, out, n), name, "%lld vs %lld tokens", (long long)nk, (long long)n);

  o.top_k = 0;
  o.seed = 1;
  int64_t n1 = sampler_generate(s, ctx, 4, &o, seed1, NULL, NULL);
  int64_t n1b = sampler_generate(s, ctx, 4, &o, seed1b, NULL, NULL);
  o.seed = 2;
  int64_t n2 = sampler_generate(s, ctx, 4, &o, seed2, NULL, NULL);
  snprintf(name, sizeof name, "generate %s: temperature 1, the same seed draws the same tokens", label);
  CHECK(n1 > 0 && same(seed1, n1, seed1b, n1b), name, "%lld and %lld tokens", (long long)n1, (long long)n1b);
  snprintf(name, sizeof name, "generate %s: temperature 1, another seed draws other tokens", label);
  CHECK(!same(seed1, n1, seed2, n2), name, "seeds 1 and 2 gave the same %lld tokens", (long long)n1);
  snprintf(name, sizeof name, "generate %s: temperature 1 differs from greedy", label);
  CHECK(!same(seed1, n1, out, n), name, "seed 1 drew the greedy tokens");
  sampler_close(s);
  full_close(&f);
}

static void slurp(const char *path, char *buf, size_t cap) {
  FILE *f = fopen(path, "rb");
  size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
  if (f)
    fclose(f);
  buf[n] = 0;
}

// A context of maxT = 16: generation goes on past it, each token drawn from the last 16 tokens fed
// from position 0, as nanoGPT crops (the full forward with T = 16 over them); a prompt longer than
// the context is cropped the same way. sampler_feed itself refuses a 17th token.
static void test_context_limit(void) {
  Full f;
  if (!full_open(&f, "models/gpt2-tiny.mdl", 16, 16, 31) ||
      !write_checkpoint(path_in("short.safetensors"), "models/gpt2-tiny.mdl", &f, (CkptOpts){0})) {
    CHECK(false, "context: checkpoint with maxT = 16", "not written");
    return;
  }
  Sampler *s = sampler_open(path_in("short.safetensors"));
  CHECK(s && sampler_context(s) == 16, "context: maxT = 16 is the context", "context %lld",
        s ? (long long)sampler_context(s) : -1);
  if (s) {
    const int32_t ctx[] = {TOK_EOS, 'a', 'b'};
    int32_t ref[64], out[64], lctx[24] = {TOK_EOS};
    SampleOptions o;
    sample_defaults(&o);
    o.temperature = 0;
    o.tokens = 40;
    int64_t nref = greedy_reference(&f, ctx, 3, 40, 16, ref);
    int64_t n = sampler_generate(s, ctx, 3, &o, out, NULL, NULL);
    CHECK(nref == 40 && same(out, n, ref, nref), "context: 40 tokens past maxT = 16, each from the last 16",
          "%lld tokens, reference %lld", (long long)n, (long long)nref);
    for (int i = 1; i < 24; i++)
      lctx[i] = 'a' + i % 7;
    o.tokens = 10;
    nref = greedy_reference(&f, lctx, 24, 10, 16, ref);
    n = sampler_generate(s, lctx, 24, &o, out, NULL, NULL);
    CHECK(nref == 10 && same(out, n, ref, nref), "context: a prompt of 24 tokens is cropped to its last 16",
          "%lld tokens, reference %lld", (long long)n, (long long)nref);
    const double *l = NULL;
    sampler_reset(s);
    for (int t = 0; t < 16; t++)
      l = sampler_feed(s, 'x');
    int saved = dup(2), fd = open(path_in("full.txt"), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    dup2(fd, 2);
    close(fd);
    const double *over = sampler_feed(s, 'x');
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char msg[512], want[512];
    slurp(path_in("full.txt"), msg, sizeof msg);
    snprintf(want, sizeof want, "%s: error: the context is full: the model reads at most 16 tokens\n",
             path_in("short.safetensors"));
    CHECK(l && !over && !strcmp(msg, want), "context: a 17th token is refused", "stderr \"%s\"", msg);
  }
  sampler_close(s);
  full_close(&f);
}

// sample_pick against probabilities computed here: softmax(logits / temperature) over the top k.
static void test_pick(void) {
  const double logits[] = {1, 3, 2, 0, 3};
  bool greedy = sample_pick(logits, 5, 0, 0, 1, 0) == 1;
  CHECK(greedy, "pick: temperature 0 is the argmax, the lower id among ties", "got %d",
        sample_pick(logits, 5, 0, 0, 1, 0));
  struct {
    double temperature;
    int64_t k;
  } cases[] = {{1, 0}, {1, 2}, {0.5, 3}, {2, 0}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    double want[5] = {0}, total = 0, worst = 0;
    // Top k by logit, ties to the lower id: the order is 1, 4, 2, 0, 3.
    const int order[] = {1, 4, 2, 0, 3};
    int64_t k = cases[c].k ? cases[c].k : 5;
    for (int64_t i = 0; i < k; i++)
      total += want[order[i]] = exp(logits[order[i]] / cases[c].temperature);
    int count[5] = {0}, draws = 20000;
    for (int i = 0; i < draws; i++)
      count[sample_pick(logits, 5, cases[c].temperature, cases[c].k, 9, (uint64_t)i)]++;
    for (int v = 0; v < 5; v++)
      worst = fmax(worst, fabs(count[v] / (double)draws - want[v] / total));
    char name[128];
    snprintf(name, sizeof name, "pick: temperature %g, top-k %lld: frequencies = softmax over the top k",
             cases[c].temperature, (long long)cases[c].k);
    CHECK(worst < 0.015, name, "largest gap %.4f (counts %d %d %d %d %d)", worst, count[0], count[1], count[2],
          count[3], count[4]);
  }
  int differ = 0;
  for (uint64_t i = 0; i < 50; i++)
    differ += sample_pick(logits, 5, 1, 0, 1, i) != sample_pick(logits, 5, 1, 0, 2, i);
  CHECK(differ > 10, "pick: the seed changes the draws", "%d of 50 differ", differ);
}

//
// sample_run: stdout, stderr, exit status.
//

static char out_text[8192], err_text[4096];

// Runs sample_run with stdout and stderr captured into out_text and err_text.
static int run_captured(const SampleOptions *o) {
  fflush(stdout);
  fflush(stderr);
  int so = dup(1), se = dup(2);
  int fo = open(path_in("stdout.txt"), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  int fe = open(path_in("stderr.txt"), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  dup2(fo, 1);
  dup2(fe, 2);
  close(fo);
  close(fe);
  int rc = sample_run(o);
  fflush(stdout);
  fflush(stderr);
  dup2(so, 1);
  dup2(se, 2);
  close(so);
  close(se);
  slurp(path_in("stdout.txt"), out_text, sizeof out_text);
  slurp(path_in("stderr.txt"), err_text, sizeof err_text);
  return rc;
}

// The text sample_run should print: the prompt, then the bytes of the tokens sampler_generate draws
// with the same options after EOS + the prompt's bytes (the byte-level tokenizer), then a newline.
static void expected_text(const char *ck, const SampleOptions *o, char *buf, size_t cap) {
  Sampler *s = sampler_open(ck);
  int32_t ctx[64] = {TOK_EOS}, out[256];
  int64_t n = 1;
  for (const char *p = o->prompt; *p; p++)
    ctx[n++] = (unsigned char)*p;
  int64_t got = s ? sampler_generate(s, ctx, n, o, out, NULL, NULL) : 0;
  size_t len = (size_t)snprintf(buf, cap, "%s", o->prompt);
  for (int64_t i = 0; i < got && len + 2 < cap; i++)
    buf[len++] = (char)out[i];
  buf[len++] = '\n';
  buf[len] = 0;
  sampler_close(s);
}

static void expect_error(const SampleOptions *o, const char *name, const char *want) {
  int rc = run_captured(o);
  CHECK(rc == 1 && !strcmp(err_text, want), name, "status %d, stderr \"%s\", want \"%s\"", rc, err_text, want);
}

static void test_run(void) {
  Tokenizer *bytes = tok_new(NULL, 0, NULL, 0);
  uint32_t pairs[88];
  for (int r = 0; r < 44; r++)
    pairs[2 * r] = 97 + (uint32_t)r % 26, pairs[2 * r + 1] = 98 + (uint32_t)r / 26;
  char why[128];
  Tokenizer *big = tok_new(pairs, 44, why, sizeof why);
  CHECK(bytes && big && tok_save(bytes, path_in("tokenizer.bin")) && tok_save(big, path_in("tok300.bin")),
        "run: tokenizers written", "%s", big ? "save failed" : why);
  tok_free(bytes);
  tok_free(big);

  Full f;
  const char *model = "models/gpt2-tiny.mdl";
  if (!full_open(&f, model, 8, 0, 41)) {
    CHECK(false, "run: gpt2-tiny", "does not compile");
    return;
  }
  char *ck = path_in("run.safetensors");
  CHECK(write_checkpoint(ck, model, &f, (CkptOpts){0}), "run: checkpoint written", "failed");

  SampleOptions o;
  sample_defaults(&o);
  o.checkpoint = ck;
  o.prompt = "Hello";
  o.tokens = 40;
  o.temperature = 0.8;
  o.top_k = 20;
  o.seed = 5;
  char want[1024];
  expected_text(ck, &o, want, sizeof want);
  int rc = run_captured(&o);
  CHECK(rc == 0 && !strcmp(out_text, want) && !err_text[0] && strlen(want) > strlen("Hello\n"),
        "run: prints the prompt, then the tokens drawn after EOS + prompt", "status %d, %zu bytes out (want %zu), "
        "stderr \"%s\"", rc, strlen(out_text), strlen(want), err_text);
  o.prompt = "";
  expected_text(ck, &o, want, sizeof want);
  rc = run_captured(&o);
  CHECK(rc == 0 && !strcmp(out_text, want), "run: an empty prompt continues EOS alone", "status %d, stderr \"%s\"",
        rc, err_text);
  o.tokens = 0;
  rc = run_captured(&o);
  CHECK(rc == 0 && !strcmp(out_text, "\n"), "run: --tokens 0 prints the prompt only", "status %d, out \"%s\"", rc,
        out_text);
  sample_defaults(&o);
  o.prompt = "Hi";

  char want_err[8192];
  o.checkpoint = path_in("none.safetensors");
  snprintf(want_err, sizeof want_err, "%s: error: cannot open: No such file or directory\n", o.checkpoint);
  expect_error(&o, "run: a missing checkpoint", want_err);

  o.checkpoint = path_in("junk.safetensors");
  write_file(o.checkpoint, "\x10\0\0\0\0\0\0\0{\"a\":", 13);
  rc = run_captured(&o);
  char prefix[256];
  snprintf(prefix, sizeof prefix, "%s: error: ", o.checkpoint);
  CHECK(rc == 1 && !strncmp(err_text, prefix, strlen(prefix)) && strchr(err_text, '\n') == err_text + strlen(err_text) - 1,
        "run: a corrupt checkpoint: one line naming it", "status %d, stderr \"%s\"", rc, err_text);

  struct {
    const char *name, *file;
    CkptOpts opts;
    const char *error; // after "CHECKPOINT: error: "; %s is the folder
  } bad[] = {
      {"run: no metadata", "plain.safetensors", {.no_meta = true},
       "not an mdl checkpoint (no mdl.format in its metadata)"},
      {"run: another format", "format.safetensors", {.format = "mdl-checkpoint-9"},
       "checkpoint format 'mdl-checkpoint-9' is not one this mdlc reads (mdl-checkpoint-1)"},
      {"run: malformed dims", "dims.safetensors", {.dims = "V=256,C"},
       "bad checkpoint metadata: mdl.dims = 'V=256,C' is not NAME=VALUE,... with each dim once and each value a "
       "whole number from 1 to 2147483647"},
      {"run: the model file is gone", "gone.safetensors", {.source = "/nonexistent/gone.mdl"},
       "cannot read the checkpoint's model /nonexistent/gone.mdl: No such file or directory"},
      {"run: the model changed a parameter's shape", "changed.safetensors", {.source = "%s/changed.mdl"},
       "checkpoint does not match %s/changed.mdl: tensor 'h.0.fc_w' is [64,256], the model wants [64,128]"},
      {"run: a parameter missing", "skip.safetensors", {.skip = "lnf_b"},
       "checkpoint does not match %s: no tensor 'lnf_b' (the model's parameter [64])"},
      {"run: a tensor that is no parameter", "extra.safetensors", {.extra = true},
       "checkpoint does not match %s: tensor 'bogus' is not a parameter of the model"},
  };
  // changed.mdl: gpt2-tiny with an MLP of 2C instead of 4C.
  FILE *in = fopen(model, "rb");
  char text[8192], *p;
  size_t tn = fread(text, 1, sizeof text - 1, in);
  fclose(in);
  text[tn] = 0;
  while ((p = strstr(text, "4*C")))
    *p = '2';
  write_file(path_in("changed.mdl"), text, strlen(text));
  char model_abs[4096], src[512], msg[1024];
  if (!realpath(model, model_abs))
    snprintf(model_abs, sizeof model_abs, "%s", model);
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    CkptOpts co = bad[i].opts;
    if (co.source && strstr(co.source, "%s")) {
      snprintf(src, sizeof src, co.source, tmp);
      co.source = src;
    }
    o.checkpoint = path_in(bad[i].file);
    write_checkpoint(o.checkpoint, model, &f, co);
    snprintf(msg, sizeof msg, bad[i].error, strstr(bad[i].error, "changed.mdl") ? tmp : model_abs);
    snprintf(want_err, sizeof want_err, "%s: error: %s\n", o.checkpoint, msg);
    expect_error(&o, bad[i].name, want_err);
  }

  o.checkpoint = path_in("notok.safetensors");
  write_checkpoint(o.checkpoint, model, &f, (CkptOpts){.tokenizer = path_in("none.bin")});
  snprintf(want_err, sizeof want_err, "%s: error: cannot open: No such file or directory\n", path_in("none.bin"));
  expect_error(&o, "run: a missing tokenizer", want_err);

  o.checkpoint = path_in("tok300.safetensors");
  write_checkpoint(o.checkpoint, model, &f, (CkptOpts){.tokenizer = path_in("tok300.bin")});
  snprintf(want_err, sizeof want_err, "%s: error: tokenizer has 300 tokens, the model's V is 256\n",
           path_in("tok300.bin"));
  expect_error(&o, "run: a tokenizer larger than the model's vocabulary", want_err);
  full_close(&f);

  if (!full_open(&f, model, 16, 16, 43)) {
    CHECK(false, "run: gpt2-tiny with maxT = 16", "does not compile");
    return;
  }
  o.checkpoint = path_in("short-run.safetensors");
  write_checkpoint(o.checkpoint, model, &f, (CkptOpts){0});
  o.temperature = 0.8;
  o.top_k = 20;
  o.prompt = "abcdefghijklmnopqrst";
  o.tokens = 30;
  expected_text(o.checkpoint, &o, want, sizeof want);
  rc = run_captured(&o);
  // (a checkpoint storing no text, of maxT = 16 where the file says 128: a note says the checkpoint's is used)
  char maxt[4096 + 1024];
  snprintf(maxt, sizeof maxt, "%s: note: %s fixes dim maxT = 128; this checkpoint was trained with maxT=16 (given "
           "with -D, or the model changed since), which sampling uses\n", o.checkpoint, model_abs);
  snprintf(want_err, sizeof want_err, "%s%s: note: the prompt is 21 tokens with its leading EOS, more than the "
           "model's context of 16: the model sees the last 16 tokens, before and after each new one\n", maxt,
           o.checkpoint);
  CHECK(rc == 0 && !strcmp(out_text, want) && !strcmp(err_text, want_err),
        "run: a prompt longer than the context is cropped, with one note", "status %d, out \"%s\", stderr \"%s\"", rc,
        out_text, err_text);
  o.prompt = "abcdefghijklmno";
  expected_text(o.checkpoint, &o, want, sizeof want);
  rc = run_captured(&o);
  snprintf(want_err, sizeof want_err, "%s%s: note: the model's context of 16 tokens is full: each further token is "
           "drawn from the last 16, fed again from position 0 (the context slides)\n", maxt, o.checkpoint);
  CHECK(rc == 0 && !strcmp(out_text, want) && strlen(out_text) == strlen(o.prompt) + 31 && !strcmp(err_text, want_err),
        "run: 30 tokens after a prompt that fills the context, with one note", "status %d, out \"%s\", stderr \"%s\"",
        rc, out_text, err_text);
  full_close(&f);
}

// A checkpoint that stores its model and tokenizer samples without the files it names, the same
// text as one that reads them; a file at the recorded path that differs gets one warning, and the
// stored copy is used. (The checkpoints of the other tests store neither, as older ones did.)
static void test_stored(void) {
  Full f;
  const char *model = "models/gpt2-tiny.mdl";
  if (!full_open(&f, model, 8, 0, 41)) {
    CHECK(false, "stored: gpt2-tiny", "does not compile");
    return;
  }
  SampleOptions o;
  sample_defaults(&o);
  o.prompt = "Hello";
  o.tokens = 40;
  o.temperature = 0.8;
  o.top_k = 20;
  o.seed = 5;
  char want[sizeof out_text], want_err[2048];
  o.checkpoint = path_in("files.safetensors");
  write_checkpoint(o.checkpoint, model, &f, (CkptOpts){0});
  int rc = run_captured(&o);
  snprintf(want, sizeof want, "%s", out_text);
  CHECK(rc == 0 && strlen(want) > strlen("Hello\n"), "stored: the checkpoint that reads the files samples",
        "status %d, stderr \"%s\"", rc, err_text);

  o.checkpoint = path_in("alone.safetensors");
  write_checkpoint(o.checkpoint, model, &f,
                   (CkptOpts){.stored = true, .source = "/nonexistent/tiny.mdl", .tokenizer = "/nonexistent/t.bin"});
  rc = run_captured(&o);
  CHECK(rc == 0 && !strcmp(out_text, want) && !err_text[0],
        "stored: with the model and tokenizer files gone, the same text from the stored copies",
        "status %d, out \"%s\", want \"%s\", stderr \"%s\"", rc, out_text, want, err_text);

  // changed.mdl (written by test_run): another shape of h.0.fc_w; tok300.bin: another tokenizer.
  char changed[512];
  snprintf(changed, sizeof changed, "%s", path_in("changed.mdl"));
  o.checkpoint = path_in("differs.safetensors");
  write_checkpoint(o.checkpoint, model, &f, (CkptOpts){.stored = true, .source = changed});
  rc = run_captured(&o);
  snprintf(want_err, sizeof want_err, "%s: warning: %s differs from the model this checkpoint was trained with; "
           "sampling with the copy of that model stored in the checkpoint\n", o.checkpoint, changed);
  CHECK(rc == 0 && !strcmp(out_text, want) && !strcmp(err_text, want_err),
        "stored: a model file that differs: one warning, the stored model samples", "status %d, stderr \"%s\"", rc,
        err_text);
  o.checkpoint = path_in("tokdiffers.safetensors");
  write_checkpoint(o.checkpoint, model, &f, (CkptOpts){.stored = true, .tokenizer = path_in("tok300.bin")});
  rc = run_captured(&o);
  snprintf(want_err, sizeof want_err, "%s: warning: %s differs from the tokenizer this checkpoint was trained with; "
           "sampling with the copy of that tokenizer stored in the checkpoint\n", o.checkpoint, path_in("tok300.bin"));
  CHECK(rc == 0 && !strcmp(out_text, want) && !strcmp(err_text, want_err),
        "stored: a tokenizer file that differs: one warning, the stored tokenizer samples", "status %d, stderr \"%s\"",
        rc, err_text);
  full_close(&f);
}

// llama-tiny with grouped-query attention (2 kv heads for 4 query heads: the cache holds 2) in a
// window of 12 keys, shorter than the 32 positions test_kv_exact feeds.
static const char llama_gqa[] =
    "model llama_gqa\n"
    "dim V = 256\n"
    "dim maxT = 128\n"
    "dim C = 64\n"
    "dim H = 4\n"
    "dim KH = 2\n"
    "dim B in 1..1024\n"
    "dim T in 1..maxT\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input pos: i32[B, T]\n"
    "input doc: i32[B, T]\n"
    "param tok_emb: [V, C] = normal(0.5)\n"
    "param wq: [C, C] = normal(0.2)\n"
    "param wk: [C, C / 2] = normal(0.2)\n"
    "param wv: [C, C / 2] = normal(0.2)\n"
    "param norm: [C] = ones\n"
    "param lm_head: [C, V] = normal(0.2)\n"
    "x = embed(tok_emb, tokens)\n"
    "q = rope(x @ wq, pos, heads=H)\n"
    "k = rope(x @ wk, pos, heads=KH)\n"
    "x = x + attention(q, k, x @ wv, heads=H, kv_heads=KH, causal=true, doc=doc, window=12)\n"
    "output logits = rmsnorm(x, norm) @ lm_head\n"
    "output loss = mean(cross_entropy(logits, targets))\n"
    "train {\n    B = 2\n    T = 32\n}\n";

int main(void) {
  snprintf(tmp, sizeof tmp, "/tmp/mdl_sample_XXXXXX");
  if (!mkdtemp(tmp)) {
    perror("mkdtemp");
    return 1;
  }
  test_pick();
  test_kv_exact("models/gpt2-tiny.mdl", "gpt2-tiny");
  test_kv_exact("models/llama-tiny.mdl", "llama-tiny");
  FILE *gqa = fopen(path_in("llama-gqa.mdl"), "w");
  bool written = gqa && fputs(llama_gqa, gqa) >= 0;
  if (gqa)
    written &= fclose(gqa) == 0;
  CHECK(written, "kv llama-gqa: the model is written", "cannot write %s", path_in("llama-gqa.mdl"));
  if (written)
    test_kv_exact(path_in("llama-gqa.mdl"), "llama-gqa (kv_heads=2 of 4, window=12)");
  test_generate("models/gpt2-tiny.mdl", "gpt2-tiny");
  test_generate("models/llama-tiny.mdl", "llama-tiny");
  test_context_limit();
  test_run();
  test_stored();
  nftw(tmp, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
  TEST_EXIT();
}
