// ckpt.c: the training checkpoint: its writer (in the background, while the next steps run) and its
// reader (a resumed run's, and the check that a checkpoint is this model's).
//
// The checkpoint is a safetensors file: every parameter under its .mdl name, the optimizer's moments
// as "<param>.m" / "<param>.v" (those it keeps), and __metadata__ strings: mdl.format, mdl.optimizer
// (adamw, sgd or lion: a run resumes only its own optimizer's moments), mdl.source (the .mdl path),
// mdl.model, mdl.dims (every dim, "name=value,..."), mdl.step, mdl.seed, mdl.loader ("epoch,position"),
// mdl.data, mdl.tokenizer (its path); what else decides the order of the batches, which a resumed run
// takes from them (main.c's resume_batch_order; B and T are dims): mdl.shuffle and mdl.pack ("true"
// or "false") and mdl.accumulate (micro-batches a step); and the two files those paths name, so that a checkpoint moved
// away from them still samples and resumes: mdl.source_text (the .mdl text the run compiled) and
// mdl.tokenizer_base64 (tokenizer.bin's bytes in base64). Metadata strings rather than tensors: the
// tensors stay the model's parameters and moments, which is what other readers load by name, and
// safetensors keeps free-form strings there (a tokenizer of 50k merges is 0.5 MB of base64, well
// within a reader's header limit). Checkpoints written before these were stored lack them.
// Precision fp8 adds its scaling state (mdl.h, Fp8State): the tensors fp8.scale [n] and
// fp8.amax_history [n, H] and the metadata mdl.fp8_recorded (the steps in the histories); every
// checkpoint says mdl.precision. A resumed fp8 run continues with them bit for bit; a checkpoint
// without them (another precision), or with another model's, is refused for it.
#include "fp8_state.h"
#include "runtime.h"
#include "train_impl.h"

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// With several ranks (dist.c), B is the global batch, the ranks' B times their number: a checkpoint
// of 2 ranks at B=2 is one of B=4, which 1 process at B=4 or 4 ranks at B=1 resume.
static char *dims_string(const Graph *g) {
  size_t cap = 1, len = 0; // (each dim: a comma, its name, '=' and at most 20 digits and a sign)
  for (int i = 0; i < g->ndims; i++)
    cap += strlen(g->dims[i].name) + 23;
  char *s = rt_xrealloc(NULL, cap);
  s[0] = 0;
  for (int i = 0; i < g->ndims; i++)
    len += (size_t)snprintf(s + len, cap - len, "%s%s=%lld", i ? "," : "", g->dims[i].name,
                            (long long)g->dims[i].value * (strcmp(g->dims[i].name, "B") ? 1 : dist_size()));
  return s;
}

// Every parameter, then every AdamW moment (when the engine's graph has them).
static int checkpoint_nodes(const Graph *g, int *nodes) {
  int n = 0;
  for (int i = 0; i < g->nparams; i++)
    nodes[n++] = g->params[i];
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_STATE)
      nodes[n++] = i;
  return n;
}

// Checkpoints are written in the background: the parameters and moments are read from the engine
// between two steps, then a thread writes them (atomically, as st_write_meta writes) while the next
// steps run. An engine that can copy them within its own memory (Engine.snapshot: a GPU's, in about
// a millisecond) is read by the thread instead, from that copy. One write at a time: the next
// checkpoint, and the end of the run, wait for the last; a write that failed stops the run at the end
// of the step that notices it (ckpt_poll). The buffers the values are read into are kept from one
// checkpoint to the next (ckpt_free at the end): GPT-2 124M's 1.5 GB took 0.74-1.03 s to read into
// fresh ones here, most of it the first touch of their pages, and 3.1-5.4 s to write, against 0.8 s a
// step at B=1, T=32 (30 ms on an H200). Where the engine's values lie in host memory (Engine.values:
// the CPU's arena), a copy would double the memory the parameters and moments take, so the
// checkpoint is written from them in place, the steps waiting for it.
static void *ckpt_write(void *arg) {
  CkptWriter *w = arg;
  if (w->threaded) { // (SIGINT and SIGTERM go to the training loop's thread)
    sigset_t stops;
    sigemptyset(&stops);
    sigaddset(&stops, SIGINT);
    sigaddset(&stops, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stops, NULL);
  }
  bool ok = true;
  char why[256];
  for (int i = 0; w->snap && ok && i < w->n; i++)
    if (!(ok = w->snap->read_snapshot(w->snap, w->nodes[i], w->t[i].data, why, sizeof why)))
      diag_file_error(w->path, "cannot write the checkpoint: %s", why);
  w->ok = ok && st_write_meta(w->path, w->t, w->nt, w->meta, w->nmeta);
  __atomic_store_n(&w->done, true, __ATOMIC_RELEASE);
  return NULL;
}

// Waits for the write under way, if any; false when the last write failed (it said why).
bool ckpt_wait(CkptWriter *w) {
  if (!w->running)
    return w->ok;
  if (w->threaded)
    pthread_join(w->thread, NULL);
  w->running = false;
  return w->ok;
}

// Waits as ckpt_wait does, then frees the buffers.
bool ckpt_free(CkptWriter *w) {
  bool ok = ckpt_wait(w);
  for (int i = 0; w->t && !w->in_place && i < w->n; i++)
    free(w->t[i].data);
  free(w->t);
  free(w->nodes);
  free(w->dims);
  free(w->fp8);
  *w = (CkptWriter){.ok = ok};
  return ok;
}

// False when the last write has ended and failed; a write still under way is left to run.
bool ckpt_poll(CkptWriter *w) {
  return !w->running || !__atomic_load_n(&w->done, __ATOMIC_ACQUIRE) || ckpt_wait(w);
}

// Reads the checkpoint of `step` from e and starts its write, once the last one is done; false when
// that one failed.
bool ckpt_start(CkptWriter *w, const char *path, Engine *e, const TrainOptions *o, int64_t step,
                       LoaderState ls) {
  if (!ckpt_wait(w))
    return false;
  const Graph *g = e->g;
  if (!w->t) { // (the first checkpoint of the run: the same nodes every time)
    w->nodes = rt_xrealloc(NULL, sizeof(int) * (size_t)g->n);
    w->n = w->nt = checkpoint_nodes(g, w->nodes);
    w->t = rt_xrealloc(NULL, (size_t)(w->n + 2) * sizeof *w->t);
    w->in_place = e->values != NULL;
    for (int i = 0; i < w->n; i++) {
      const IrNode *x = g->nodes[w->nodes[i]];
      w->t[i] = (StTensor){.name = x->name, .dtype = DT_F32, .shape = x->shape,
                           .data = w->in_place ? NULL : rt_xrealloc(NULL, sizeof(float) * (size_t)(shape_numel(x->shape) + 1))};
    }
    w->dims = dims_string(g);
  }
  w->snap = !w->in_place && e->snapshot && e->snapshot(e) ? e : NULL;
  for (int i = 0; w->in_place && i < w->n; i++)
    w->t[i].data = (void *)e->values(e, w->nodes[i]);
  for (int i = 0; !w->snap && !w->in_place && i < w->n; i++)
    e->read(e, w->nodes[i], w->t[i].data);
  snprintf(w->step_s, sizeof w->step_s, "%lld", (long long)step);
  snprintf(w->seed_s, sizeof w->seed_s, "%llu", (unsigned long long)o->seed);
  snprintf(w->loader_s, sizeof w->loader_s, "%lld,%lld", (long long)ls.epoch, (long long)ls.position);
  snprintf(w->acc_s, sizeof w->acc_s, "%lld", (long long)(g->train.accumulate > 1 ? g->train.accumulate : 1));
  StMeta meta[] = {{"mdl.format", CKPT_FORMAT}, {"mdl.source", o->model_path}, {"mdl.model", g->model},
                   {"mdl.dims", w->dims}, {"mdl.step", w->step_s}, {"mdl.seed", w->seed_s},
                   {"mdl.loader", w->loader_s}, {"mdl.data", o->data_dir},
                   {"mdl.tokenizer", o->tokenizer_path}, {"mdl.shuffle", o->shuffle ? "true" : "false"},
                   {"mdl.pack", o->pack ? "true" : "false"}, {"mdl.accumulate", w->acc_s},
                   {"mdl.optimizer", opt_rule_name(g->train.optimizer)}};
  memcpy(w->meta, meta, sizeof meta);
  w->nmeta = (int)(sizeof meta / sizeof *meta); // (then the stored copies: CKPT_META in all)
  w->meta[w->nmeta++] = (StMeta){"mdl.precision", g->train.precision};
  const Fp8State *st = e->fp8 ? e->fp8(e) : NULL;
  if (st) { // (copied now: the next step changes it while the write runs)
    size_t n = (size_t)st->n, nh = n * (size_t)st->H;
    w->fp8 = rt_xrealloc(w->fp8, sizeof(float) * (n + nh));
    memcpy(w->fp8, st->scale, sizeof(float) * n);
    memcpy(w->fp8 + n, st->hist, sizeof(float) * nh);
    w->t[w->n] = (StTensor){.name = "fp8.scale", .dtype = DT_F32, .shape = shape_of(1, (int64_t[]){st->n}), .data = w->fp8};
    w->t[w->n + 1] = (StTensor){.name = "fp8.amax_history", .dtype = DT_F32,
                                .shape = shape_of(2, (int64_t[]){st->n, st->H}), .data = w->fp8 + n};
    w->nt = w->n + 2;
    snprintf(w->fp8_recorded, sizeof w->fp8_recorded, "%lld", (long long)st->recorded);
    w->meta[w->nmeta++] = (StMeta){"mdl.fp8_recorded", w->fp8_recorded};
  }
  if (g->source)
    w->meta[w->nmeta++] = (StMeta){"mdl.source_text", g->source};
  if (o->tokenizer_base64)
    w->meta[w->nmeta++] = (StMeta){"mdl.tokenizer_base64", o->tokenizer_base64};
  w->path = path;
  w->running = w->threaded = true;
  w->done = false;
  if (w->in_place) { // (written before the next step changes them)
    w->threaded = false;
    ckpt_write(w);
  } else if (pthread_create(&w->thread, NULL, ckpt_write, w) != 0) {
    w->threaded = false;
    ckpt_write(w); // (no thread to be had: written here)
  }
  return true;
}

// Whether a checkpoint read into f is one of g's: the format, the metadata, the model's dims, and
// every parameter's and moment's name and shape; false after saying why. The model given
// (model_path, or the model file where NULL) decides: where its text is not the one the checkpoint
// stores, its parameters must still have the checkpoint's names and shapes (a refusal that says the
// model changed, else, with warn, a warning).
bool checkpoint_fits(Arena *a, const StFile *f, const char *path, const Graph *g, const char *model_path,
                            bool warn) {
  CkptMeta meta;
  bool ok = ckpt_meta_read(a, path, f, &meta);
  const char *model = model_path ? model_path : "the model file";
  const char *stored = ok ? st_meta(f, "mdl.source_text") : NULL;
  bool changed = stored && g->source && strcmp(stored, g->source);
  const char *why = changed ? arena_printf(a, " (%s differs from the model this checkpoint was trained with, "
                                           "stored in it)", model) : "";
  char *dims = dims_string(g);
  const char *cdims = meta.dims_text;
  if (ok && (!cdims || meta.step < 0 || !meta.has_loader || !meta.has_seed)) {
    diag_file_error(path, "checkpoint metadata is incomplete");
    ok = false;
  } else if (ok && strcmp(cdims, dims)) {
    diag_file_error(path, "checkpoint of another model configuration: it has %s, this run %s%s", cdims, dims, why);
    ok = false;
  }
  free(dims);
  // The moments are the optimizer's own (AdamW's m is not Lion's, SGD's m is a velocity): a training
  // graph resumes only a checkpoint of its optimizer (one written before this was stored: AdamW).
  const char *copt = ok ? meta.optimizer : NULL;
  const char *gopt = opt_rule_name(g->train.optimizer);
  if (ok && g->updates && strcmp(copt ? copt : "adamw", gopt)) {
    diag_file_error(path, "checkpoint of a run with optimizer %s, this run uses %s: their moments differ, so it "
                    "cannot be continued with %s (a new run can start from its parameters: --weights %s)",
                    copt ? copt : "adamw", gopt, gopt, path);
    ok = false;
  }
  int *nodes = rt_xrealloc(NULL, sizeof(int) * (size_t)g->n);
  int n = ok ? checkpoint_nodes(g, nodes) : 0;
  const char *prefix = changed ? arena_printf(a, "%s differs from the model this checkpoint was trained with "
                                              "(stored in it), and so do its parameters: ", model)
                               : arena_printf(a, "checkpoint does not match %s: ", g->model);
  for (int i = 0; ok && i < n; i++)
    ok = st_expect(f, path, prefix, g->nodes[nodes[i]]) != NULL;
  if (ok && changed && warn)
    fprintf(stderr, "%s: warning: %s differs from the model this checkpoint was trained with (stored in it); "
            "resuming with %s, whose parameters have the same names and shapes\n", path, model, model);
  free(nodes);
  return ok;
}

// Precision fp8's scaling state from checkpoint f into e (nothing where neither has one); false after
// saying why where one has it and the other not, or where it is another model's.
static bool read_fp8_state(const StFile *f, const CkptMeta *meta, const char *path, Engine *e) {
  const StTensor *sc = st_find(f, "fp8.scale"), *hi = st_find(f, "fp8.amax_history");
  const char *prec = meta->precision;
  bool rec = meta->fp8_recorded >= 0;
  Fp8State *st = e->fp8 ? e->fp8(e) : NULL;
  const char *mine = e->g->train.precision;
  if (!st && !sc)
    return true;
  if (!st || !sc || !hi || !rec) {
    diag_file_error(path, "checkpoint of a run in precision %s, this run is %s: %s, so it cannot be continued "
                    "(a new run can start from its parameters: --weights %s)", prec ? prec : sc ? "fp8" : "fp32 or bf16",
                    mine, st ? "it holds no fp8 scales and amax histories to continue with"
                             : "its fp8 scales and amax histories would be dropped", path);
    return false;
  }
  if (sc->dtype != DT_F32 || hi->dtype != DT_F32 || sc->shape.rank != 1 || sc->shape.d[0] != st->n ||
      hi->shape.rank != 2 || hi->shape.d[0] != st->n || hi->shape.d[1] != st->H) {
    diag_file_error(path, "its fp8 state is for %lld scaled tensors with %lld steps of amax history, this run has %d "
                    "with %d (another model, or amax_history changed)", (long long)sc->shape.d[0],
                    (long long)(hi->shape.rank == 2 ? hi->shape.d[1] : 0), st->n, st->H);
    return false;
  }
  memcpy(st->scale, sc->data, sizeof(float) * (size_t)st->n);
  memcpy(st->hist, hi->data, sizeof(float) * (size_t)st->n * (size_t)st->H);
  st->recorded = meta->fp8_recorded;
  return true;
}

// Loads a checkpoint into e after checking that it was written for this model (checkpoint_fits);
// fills step, loader state and seed. With the optimizer's state in `shards` (--zero 1 over that many
// ranks) this rank loads the moments of its own shard only.
bool read_checkpoint(const char *path, Engine *e, const char *model_path, int shards, int64_t *step,
                            LoaderState *ls, uint64_t *seed) {
  const Graph *g = e->g;
  ZeroShard *zero = shards > 1 ? engine_shard(g, dist_rank(), shards) : NULL; // (--zero 1)
  Arena *a = arena_new();
  StFile f;
  CkptMeta meta;
  bool ok = st_read(a, path, &f) && checkpoint_fits(a, &f, path, g, model_path, true) &&
            ckpt_meta_read(a, path, &f, &meta);
  int *nodes = rt_xrealloc(NULL, sizeof(int) * (size_t)g->n);
  int n = ok ? checkpoint_nodes(g, nodes) : 0;
  for (int i = 0; ok && i < n; i++) {
    const StTensor *t = st_find(&f, g->nodes[nodes[i]]->name);
    int64_t bad = rt_first_nonfinite(t->data, shape_numel(g->nodes[nodes[i]]->shape));
    if (bad >= 0) {
      diag_file_error(path, "tensor '%s' is not finite (element %lld is %g): this checkpoint cannot be continued",
                      t->name, (long long)bad, (double)((const float *)t->data)[bad]);
      ok = false;
    }
  }
  for (int i = 0; ok && i < n; i++) // (--zero 1: a rank keeps the moments of its own shard)
    if (!zero || g->nodes[nodes[i]]->op != OP_STATE || engine_shard_owner(zero, g, nodes[i]) == zero->rank)
      e->write(e, nodes[i], st_find(&f, g->nodes[nodes[i]]->name)->data);
  ok = ok && read_fp8_state(&f, &meta, path, e);
  if (ok) {
    *step = meta.step;
    *seed = meta.seed;
    *ls = (LoaderState){meta.epoch, meta.position};
  }
  free(nodes);
  engine_shard_free(zero);
  arena_free(a);
  return ok;
}

// Whether two tokenizers have the same merges.
static bool same_tokenizer(const Tokenizer *x, const Tokenizer *y) {
  size_t nx, ny;
  unsigned char *bx = tok_bytes(x, &nx), *by = tok_bytes(y, &ny);
  bool same = nx == ny && !memcmp(bx, by, nx);
  free(bx);
  free(by);
  return same;
}

Tokenizer *train_resume_tokenizer(const char *ckpt, const char *tok_path) {
  Arena *a = arena_new();
  StFile f;
  bool there = access(ckpt, F_OK) == 0, ok = !there || st_read_header(a, ckpt, &f); // (none: the resume says so)
  const char *b64 = there && ok ? st_meta(&f, "mdl.tokenizer_base64") : NULL;
  Tokenizer *stored = NULL, *t = NULL;
  if (b64) {
    size_t n;
    unsigned char *bytes = rt_unbase64(b64, &n);
    if (!bytes)
      diag_file_error(ckpt, "mdl.tokenizer_base64 is not base64");
    stored = bytes ? tok_parse(bytes, n, ckpt) : NULL;
    ok = stored != NULL;
    free(bytes);
  }
  if (ok && stored && access(tok_path, F_OK) != 0) {
    t = stored;
    stored = NULL;
  } else if (ok && (t = tok_load(tok_path)) && stored && !same_tokenizer(t, stored)) {
    fprintf(stderr, "%s: warning: %s differs from the tokenizer this checkpoint was trained with (stored in it); "
            "resuming with %s, which made the data's shards\n", ckpt, tok_path, tok_path);
  }
  if (stored)
    tok_free(stored);
  arena_free(a);
  return t;
}

// ZeRO stage 1: every rank's moments gathered into rank 0's engine, for a checkpoint that does not
// depend on the ranks: by the engine (Engine.gather_moments, the CPU's: into memory the step does not
// keep), else through host memory, read from each rank and written into rank 0's (a GPU's arena holds
// every moment anyway; the moments' nodes of a rank's shard are contiguous in node order, as the
// shard's parameters are in parameter order). Every rank calls it.
bool gather_moments(Engine *e, const ZeroShard *z, int64_t step, char *err, size_t n) {
  if (e->gather_moments)
    return e->gather_moments(e, step, err, n);
  const Graph *g = e->g;
  int64_t *at = calloc((size_t)z->n + 1, sizeof *at), total = 0;
  if (!at)
    return rt_fail(err, n, "out of host memory");
  for (int i = 0; i < g->n; i++) // (at[r]: where rank r's first moment goes)
    if (g->nodes[i]->op == OP_STATE)
      at[engine_shard_owner(z, g, i) + 1] += shape_numel(g->nodes[i]->shape);
  for (int r = 0; r < z->n; r++)
    at[r + 1] += at[r];
  total = at[z->n];
  float *buf = calloc((size_t)(total ? total : 1), sizeof *buf); // (a rank writes only its own share)
  if (!buf) {
    free(at);
    return rt_fail(err, n, "out of host memory gathering the moments (%.0f MB)", 4e-6 * (double)total);
  }
  int64_t off = 0;
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_STATE) {
      if (engine_shard_owner(z, g, i) == z->rank)
        e->read(e, i, buf + off);
      off += shape_numel(g->nodes[i]->shape);
    }
  bool ok = dist_gather_f32(buf, buf, at, 0, "the moments' gather for the checkpoint", step, err, n);
  off = 0;
  for (int i = 0; ok && z->rank == 0 && i < g->n; i++)
    if (g->nodes[i]->op == OP_STATE) {
      if (engine_shard_owner(z, g, i) != z->rank)
        e->write(e, i, buf + off);
      off += shape_numel(g->nodes[i]->shape);
    }
  free(buf);
  free(at);
  return ok;
}

// A run that stops at `step` before changing any weight (a loss that is not finite, no batch): the
// weights are those of the step before, whose checkpoint (with the data position of this step's
// batches: a resumed run redoes this step) is written unless it is the one on disk. What became of
// them goes into kept.
void keep_step_before(CkptWriter *w, const char *ckpt, Engine *e, const TrainOptions *o, int64_t step,
                             int64_t ckpt_step, LoaderState before, char *kept, size_t n) {
  if (step - 1 > ckpt_step && step - 1 > 0) {
    if (ckpt_start(w, ckpt, e, o, step - 1, before) && ckpt_wait(w))
      snprintf(kept, n, "wrote them to %s", ckpt);
    else
      snprintf(kept, n, "their checkpoint could not be written");
  } else if (ckpt_step >= 0) {
    snprintf(kept, n, "%s holds them", ckpt);
  } else {
    snprintf(kept, n, "no checkpoint was written");
  }
}
