// loader.c: B x T batches from one split's shards, memory-mapped and read as one token stream
// (the shards concatenated in name order).
//
// A row is either a window of the stream (packed: window w is stream[w*T, w*T + T + 1), so over
// an epoch every token is an input once and a target once, and documents share rows with their
// boundaries marked by doc ids and positions), or one document (padded: the document from its
// EOS, cut to T tokens, then EOS padding with target -1 and doc id 1). An epoch visits every
// window or document once, in order or in a permutation made from the seed and the epoch
// (loader_permute, permute.c), so seeking to any (epoch, position) is O(1) and a resumed run sees
// the same batches.
// Rows run across epoch ends: a batch may finish one epoch and start the next.
//
// A worker thread prepares the next batch while the caller uses the current one: two buffers,
// one mutex and one condition variable. loader_next takes the prepared buffer and asks for the
// next one into the other buffer.
//
// From the text (LoaderOptions.from_text: `mdlc run --tokenize-on-the-fly`, the baseline of a
// naive pipeline) the stream is textstream.c's, the same tokens as the shards', and there is no
// worker: loader_next reads and encodes the documents its batch needs on the caller's thread, in
// the step's time. Packed rows go in order (a shuffled window w starts at token w*T of the split,
// which only the whole split tokenised would tell); padded rows are documents, in order or shuffled.
//
// An array dataset's batches (LoaderOptions.model) are arrays.c's: the loader hands every call on.
#include "data.h"

#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct Loader {
  LoaderOptions o;
  ArrayLoader *arrays; // an array dataset's (LoaderOptions.model): every call goes to arrays.c
  char *dir, *split;
  TextStream *text; // from_text: the stream, read in loader_next (no worker)
  Shard *shards;
  int nshards;
  int64_t *first;  // per shard: stream index of its first token; first[nshards] = ntokens
  int64_t ntokens;
  int64_t nrows;   // windows (packed) or documents (padded) per epoch
  int64_t *docs;   // padded: stream index where each document starts; docs[nrows] = ntokens
  int32_t *buf[2]; // tokens, targets, pos, doc: B*T each
  int64_t real[2];
  int32_t *scratch; // T + 1 tokens, the worker's
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool want, ready, stop, started;
  int fill;             // the buffer the worker fills
  LoaderState fill_at;  // where the batch being prepared (or ready) starts
  LoaderState after;    // where the prepared batch ends
};

// Copies stream[start, start + n) into dst; false after printing why (from the text only).
static bool copy_stream(const Loader *l, int64_t start, int64_t n, int32_t *dst) {
  if (l->text)
    return textstream_read(l->text, start, n, dst);
  int lo = 0, hi = l->nshards;
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    if (l->first[mid] <= start)
      lo = mid;
    else
      hi = mid;
  }
  for (int k = lo; n > 0; k++) {
    int64_t off = start - l->first[k], m = l->shards[k].n - off;
    if (m > n)
      m = n;
    for (int64_t i = 0; i < m; i++)
      dst[i] = l->shards[k].tokens[off + i];
    dst += m;
    start += m;
    n -= m;
  }
  return true;
}

static bool fill_packed_row(Loader *l, int64_t w, int32_t *tokens, int32_t *targets, int32_t *pos, int32_t *doc) {
  int64_t T = l->o.T;
  int32_t *s = l->scratch;
  if (!copy_stream(l, w * T, T + 1, s))
    return false;
  int32_t d = 0;
  int64_t last_eos = 0;
  for (int64_t t = 0; t < T; t++) {
    if (s[t] == TOK_EOS) {
      d++;
      last_eos = t;
    }
    tokens[t] = s[t];
    targets[t] = s[t + 1];
    pos[t] = (int32_t)(t - last_eos);
    doc[t] = d;
  }
  return true;
}

// Returns the row's real (non-padding) positions, or -1 after printing why (from the text only).
static int64_t fill_padded_row(Loader *l, int64_t d, int32_t *tokens, int32_t *targets, int32_t *pos, int32_t *doc) {
  int64_t T = l->o.T, len;
  bool last_has_target;
  if (l->text) {
    // The document's first T + 1 tokens: its last real token's target is the (T+1)-th, or else the
    // next document's EOS, as in the stream (the split's last document has none).
    int64_t got;
    if (!textstream_doc(l->text, d, T + 1, l->scratch, &got))
      return -1;
    len = got < T ? got : T;
    last_has_target = got > T || d + 1 < l->nrows;
    if (got <= T && last_has_target)
      l->scratch[got] = TOK_EOS;
  } else {
    int64_t start = l->docs[d];
    len = l->docs[d + 1] - start;
    if (len > T)
      len = T;
    last_has_target = start + len < l->ntokens;
    copy_stream(l, start, len + last_has_target, l->scratch);
  }
  for (int64_t t = 0; t < T; t++) {
    bool real = t < len;
    tokens[t] = real ? l->scratch[t] : TOK_EOS;
    targets[t] = real && (t + 1 < len || last_has_target) ? l->scratch[t + 1] : -1;
    pos[t] = (int32_t)t;
    doc[t] = real ? 0 : 1;
  }
  return len;
}

// Fills one batch starting at *s and advances *s past it; returns its real tokens, or -1 after
// printing why (from the text only).
static int64_t fill_batch(Loader *l, int32_t *buf, LoaderState *s) {
  int64_t B = l->o.B, T = l->o.T, BT = B * T, real = 0;
  for (int64_t r = 0; r < B; r++) {
    int64_t unit = l->o.shuffle ? loader_permute(l->o.seed, s->epoch, l->nrows, s->position) : s->position;
    int32_t *tok = buf + r * T, *tgt = buf + BT + r * T, *pos = buf + 2 * BT + r * T, *doc = buf + 3 * BT + r * T;
    int64_t row = !l->o.pack ? fill_padded_row(l, unit, tok, tgt, pos, doc)
                  : fill_packed_row(l, unit, tok, tgt, pos, doc) ? T : -1;
    if (row < 0)
      return -1;
    real += row;
    if (++s->position == l->nrows) {
      s->position = 0;
      s->epoch++;
    }
  }
  return real;
}

static void *worker(void *arg) {
  Loader *l = arg;
  pthread_mutex_lock(&l->mu);
  for (;;) {
    while (!l->want && !l->stop)
      pthread_cond_wait(&l->cv, &l->mu);
    if (l->stop)
      break;
    l->want = false;
    int idx = l->fill;
    LoaderState s = l->fill_at;
    pthread_mutex_unlock(&l->mu);
    int64_t real = fill_batch(l, l->buf[idx], &s);
    pthread_mutex_lock(&l->mu);
    l->real[idx] = real;
    l->after = s;
    l->ready = true;
    pthread_cond_broadcast(&l->cv);
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

// Opens the split's shards; false after printing why.
static bool open_shards(Loader *l) {
  char **paths;
  int n = shard_list(l->dir, l->split, &paths);
  if (n < 0)
    return false;
  if (n == 0) {
    diag_file_error(l->dir, "no %s shards (%s_*.bin)", l->split, l->split);
    free(paths);
    return false;
  }
  l->shards = xcalloc((size_t)n, sizeof *l->shards, "the loader's shards");
  l->first = xcalloc((size_t)n + 1, sizeof *l->first, "the loader's shards");
  bool ok = true;
  for (int i = 0; i < n && ok; i++) {
    ok = shard_open(&l->shards[i], paths[i], l->o.vocab);
    if (ok) {
      l->nshards++;
      l->first[i + 1] = l->first[i] + l->shards[i].n;
    }
  }
  shard_list_free(paths, n);
  if (!ok)
    return false;
  l->ntokens = l->first[l->nshards];
  return true;
}

// The split's stream from the text; false after printing why.
static bool open_text(Loader *l) {
  if (l->o.pack && l->o.shuffle) {
    diag_file_error(l->dir, "packed rows read from the text cannot be shuffled: window w starts at token w*T of the "
                    "%s split, which only the whole split tokenised would tell (padded rows, one document each, "
                    "can be)", l->split);
    return false;
  }
  if (!(l->text = textstream_open(l->dir, l->split, l->o.vocab, l->o.shuffle)))
    return false;
  l->ntokens = textstream_tokens(l->text);
  return true;
}

// Opens the split's stream and counts its rows (indexing the documents of the shards' stream for
// padded rows); false after printing why.
static bool open_stream(Loader *l) {
  if (!(l->o.from_text ? open_text(l) : open_shards(l)))
    return false;
  if (l->o.pack) {
    l->nrows = l->ntokens > 0 ? (l->ntokens - 1) / l->o.T : 0;
    if (l->nrows < 1) {
      diag_file_error(l->dir, "the %s split holds %lld tokens: a packed row of T = %lld needs %lld", l->split,
                      (long long)l->ntokens, (long long)l->o.T, (long long)l->o.T + 1);
      return false;
    }
    return true;
  }
  if (l->ntokens < 1) {
    diag_file_error(l->dir, "the %s split holds no tokens", l->split);
    return false;
  }
  if (l->text) {
    l->nrows = textstream_docs(l->text);
    return true;
  }
  int64_t cap = 1024;
  l->docs = xmalloc((size_t)cap * sizeof *l->docs, "the documents' index");
  l->docs[l->nrows++] = 0;
  for (int k = 0; k < l->nshards; k++)
    for (int64_t i = 0; i < l->shards[k].n; i++) {
      int64_t at = l->first[k] + i;
      if (l->shards[k].tokens[i] != TOK_EOS || at == 0)
        continue;
      if (l->nrows + 1 >= cap) {
        cap *= 2;
        l->docs = xrealloc(l->docs, (size_t)cap * sizeof *l->docs, "the documents' index");
      }
      l->docs[l->nrows++] = at;
    }
  l->docs[l->nrows] = l->ntokens;
  return true;
}

Loader *loader_open(const char *dir, const char *split, LoaderOptions o) {
  Loader *l = xcalloc(1, sizeof *l, "the loader");
  l->o = o;
  l->dir = xstrdup(dir, "the loader");
  l->split = xstrdup(split, "the loader");
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cv, NULL);
  if (o.model) {
    if (!(l->arrays = arrays_loader_open(dir, split, o))) {
      loader_close(l);
      return NULL;
    }
    return l;
  }
  if (o.B < 1 || o.T < 1 || o.vocab < 1 || o.T >= INT32_MAX) {
    diag_file_error(dir, "cannot load batches of B = %lld, T = %lld for a vocabulary of %lld", (long long)o.B,
                    (long long)o.T, (long long)o.vocab);
    loader_close(l);
    return NULL;
  }
  if (!open_stream(l)) {
    loader_close(l);
    return NULL;
  }
  for (int i = 0; i < (l->text ? 1 : 2); i++) // (from the text, one: nothing is prepared ahead)
    l->buf[i] = xmalloc(sizeof(int32_t) * 4 * (size_t)(o.B * o.T), "the loader's batches");
  l->scratch = xmalloc(sizeof(int32_t) * (size_t)(o.T + 1), "the loader's batches");
  if (l->text)
    return l;
  l->want = true;
  int rc = pthread_create(&l->thread, NULL, worker, l);
  if (rc) { // (EAGAIN: no memory for its stack, as under ulimit -v, or no thread left)
    diag_file_error(dir, "cannot start the loader thread: out of memory or of threads (%s)", strerror(rc));
    loader_close(l);
    return NULL;
  }
  l->started = true;
  return l;
}

// From the text: the batch is read and encoded now, on the caller's thread.
static bool next_from_text(Loader *l, Batch *b) {
  int64_t BT = l->o.B * l->o.T;
  LoaderState s = l->fill_at;
  int64_t real = fill_batch(l, l->buf[0], &s);
  if (real < 0)
    return false;
  l->fill_at = s;
  *b = (Batch){l->buf[0], l->buf[0] + BT, l->buf[0] + 2 * BT, l->buf[0] + 3 * BT, real, NULL, 0};
  return true;
}

bool loader_next(Loader *l, Batch *b) {
  if (l->arrays) {
    arrays_loader_next(l->arrays, b);
    return true;
  }
  if (l->text)
    return next_from_text(l, b);
  pthread_mutex_lock(&l->mu);
  while (!l->ready)
    pthread_cond_wait(&l->cv, &l->mu);
  int idx = l->fill;
  int64_t BT = l->o.B * l->o.T;
  *b = (Batch){l->buf[idx], l->buf[idx] + BT, l->buf[idx] + 2 * BT, l->buf[idx] + 3 * BT, l->real[idx], NULL, 0};
  l->ready = false;
  l->fill = 1 - idx;
  l->fill_at = l->after;
  l->want = true;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
  return true;
}

LoaderState loader_state(const Loader *l) {
  if (l->arrays)
    return arrays_loader_state(l->arrays);
  pthread_mutex_t *mu = (pthread_mutex_t *)&l->mu;
  pthread_mutex_lock(mu);
  LoaderState s = l->fill_at;
  pthread_mutex_unlock(mu);
  return s;
}

bool loader_seek(Loader *l, LoaderState s) {
  if (l->arrays)
    return arrays_loader_seek(l->arrays, s);
  if (s.epoch < 0 || s.position < 0 || s.position >= l->nrows) {
    diag_file_error(l->dir, "cannot resume at epoch %lld, position %lld: the %s split has %lld %s per epoch",
                    (long long)s.epoch, (long long)s.position, l->split, (long long)l->nrows,
                    l->o.pack ? "windows" : "documents");
    return false;
  }
  if (l->text) {
    l->fill_at = s;
    return true;
  }
  pthread_mutex_lock(&l->mu);
  while (!l->ready)
    pthread_cond_wait(&l->cv, &l->mu);
  l->ready = false;
  l->fill_at = s;
  l->want = true;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
  return true;
}

int64_t loader_rows(const Loader *l) { return l->arrays ? arrays_loader_rows(l->arrays) : l->nrows; }

int64_t loader_tokens(const Loader *l) { return l->arrays ? arrays_loader_rows(l->arrays) : l->ntokens; }

void loader_close(Loader *l) {
  if (!l)
    return;
  if (l->started) {
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    pthread_join(l->thread, NULL);
  }
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->cv);
  textstream_close(l->text);
  arrays_loader_close(l->arrays);
  for (int i = 0; i < l->nshards; i++)
    shard_close(&l->shards[i]);
  free(l->shards);
  free(l->first);
  free(l->docs);
  free(l->buf[0]);
  free(l->buf[1]);
  free(l->scratch);
  free(l->dir);
  free(l->split);
  free(l);
}
