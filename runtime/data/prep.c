// prep.c: `mdlc prep INPUT -o DIR`: text to llm.c token shards and a tokenizer file.
//
// INPUT is a text file, a *.jsonl file (one JSON object per line; its text field is a document),
// or a folder: every file under it, recursively, in path order; names starting with '.' are left
// out, files holding NUL bytes are skipped with a note (not text: fortune's *.dat indexes), and a
// file already seen (a symlink or hard link to it) is skipped. Each file is a document, unless
// --doc-sep STR splits it at the lines equal to STR (the separator lines are dropped). Empty
// documents are left out. (corpus.c finds the files and their documents.)
//
// Two passes over the input, each file memory-mapped:
//   1. read: find the documents, count them and their bytes, and (vocab > 256) count the words
//      the BPE trainer learns from. Every user error (bad JSONL line, no text) shows up here,
//      before anything is written. Then train the merges (on every document, val included).
//   2. encode: every document as EOS + its tokens, to the val split or to train by size (whole
//      documents, so that val's share of the bytes stays nearest the val fraction: corpus_part),
//      cut into shards of at most --shard-tokens tokens. A corpus of a single document is cut in
//      two at a line start near the val fraction from its end: the tail is the val split. A split
//      whose val share of the tokens is off by more than a factor of two (a few unequal documents)
//      gets a warning.
// Last, DIR/source.txt records the input, the options that decided the documents and the split,
// and every file's size and mtime, for `mdlc run --tokenize-on-the-fly`.
// A progress bar goes to stderr when it is a terminal; the summary goes to stdout.
#include "data.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

void prep_defaults(PrepOptions *o) {
  *o = (PrepOptions){.vocab = 256, .text_field = "text", .val_fraction = 0.05, .shard_tokens = 100000000};
}

typedef struct {
  const char *split;
  int index;      // of the open (or next) shard
  ShardWriter w;
  bool open;
  int64_t tokens, docs;
} SplitOut;

typedef struct {
  const PrepOptions *o;
  Corpus c;
  int skipped_binary;
  int pass;              // 1 read, 2 encode
  int64_t ndocs, nbytes; // found in pass 1
  int64_t doc;           // pass 2: documents written
  CorpusSplit split;     // pass 2
  CorpusTally tally;     // pass 2: the documents written
  TokTrainer *trainer;
  Tokenizer *tok;
  TokBuf ids;
  uint16_t *u16;
  size_t capu16;
  SplitOut train, val;
  DocReader r;
  // progress
  bool tty;
  double t0, pass_t0, last_draw;
  int64_t done_bytes;
} Prep;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}


//
// Progress.
//
// One line of progress: the phase, a bar, and MB/s when rate >= 0.
static void draw(Prep *p, const char *phase, double frac, double rate) {
  if (!p->tty)
    return;
  double t = now_s();
  if (t - p->last_draw < 0.1)
    return;
  p->last_draw = t;
  char bar[31];
  int fill = (int)(frac * 30);
  for (int i = 0; i < 30; i++)
    bar[i] = i < fill ? '#' : '.';
  bar[30] = 0;
  fprintf(stderr, "\r\033[Kprep: %-8s [%s] %3d%%", phase, bar, (int)(100 * frac));
  if (rate >= 0)
    fprintf(stderr, "  %.1f MB/s", rate / 1e6);
  fflush(stderr);
}

static void draw_done(Prep *p) {
  if (p->tty)
    fprintf(stderr, "\r\033[K");
}

// "path: note: ...", below the progress line.
static void note(Prep *p, const char *path, const char *fmt, const char *arg) {
  SrcLoc loc = {.file = path};
  draw_done(p);
  diag_note(loc, fmt, arg);
}

static void train_progress(void *ctx, int done, int total) {
  draw(ctx, "training", (double)done / total, -1);
}

//
// Documents.
//
static bool put_tokens(SplitOut *out, const PrepOptions *o, const uint16_t *tok, size_t n) {
  while (n) {
    if (!out->open) {
      size_t len = strlen(o->out_dir) + 32;
      char *path = xmalloc(len, "a shard's path");
      snprintf(path, len, "%s/%s_%06d.bin", o->out_dir, out->split, out->index);
      out->open = shard_writer_open(&out->w, path);
      free(path);
      if (!out->open)
        return false;
    }
    size_t m = (size_t)(o->shard_tokens - out->w.n);
    if (m > n)
      m = n;
    if (!shard_writer_put(&out->w, tok, m)) {
      out->open = false;
      return false;
    }
    tok += m;
    n -= m;
    out->tokens += (int64_t)m;
    if (out->w.n == o->shard_tokens) {
      out->open = false;
      out->index++;
      if (!shard_writer_finish(&out->w))
        return false;
    }
  }
  return true;
}

// EOS + the document's tokens, encoded piece by piece (corpus_piece_end).
static bool write_doc(Prep *p, SplitOut *out, const char *text, size_t n) {
  static const uint16_t eos = TOK_EOS;
  out->docs++;
  if (!put_tokens(out, p->o, &eos, 1))
    return false;
  for (size_t i = 0; i < n;) {
    size_t j = corpus_piece_end(text, n, i);
    p->ids.n = 0;
    tok_encode(p->tok, text + i, j - i, &p->ids);
    if (p->ids.n > p->capu16) {
      p->capu16 = p->ids.n;
      p->u16 = xrealloc(p->u16, p->capu16 * sizeof *p->u16, "a document's tokens");
    }
    for (size_t k = 0; k < p->ids.n; k++)
      p->u16[k] = (uint16_t)p->ids.ids[k];
    if (!put_tokens(out, p->o, p->u16, p->ids.n))
      return false;
    i = j;
  }
  return true;
}

// One document: counted (pass 1) or written (pass 2).
static bool document(Prep *p, const char *text, size_t n) {
  if (!n)
    return true;
  if (p->pass == 1) {
    p->ndocs++;
    p->nbytes += (int64_t)n;
    if (p->trainer)
      tok_trainer_add(p->trainer, text, n);
    return true;
  }
  int64_t i = p->doc++;
  for (int val = 0; val < 2; val++) {
    size_t off, len;
    if (corpus_part(&p->split, &p->tally, i, val, text, n, &off, &len) &&
        !write_doc(p, val ? &p->val : &p->train, text + off, len))
      return false;
  }
  corpus_tally(&p->split, &p->tally, i, n);
  return true;
}

static void tick(Prep *p, int64_t file_done) {
  double done = (double)(p->done_bytes + file_done);
  if (p->c.total_bytes)
    draw(p, p->pass == 1 ? "reading" : "encoding", done / (double)p->c.total_bytes, done / (now_s() - p->pass_t0));
}

// One pass over every file; false after printing why.
static bool read_pass(Prep *p) {
  p->done_bytes = 0;
  p->pass_t0 = now_s();
  p->r.doc_sep = p->o->doc_sep;
  p->r.text_field = p->o->text_field;
  for (int i = 0; i < p->c.nfiles; i++) {
    CorpusFile *f = &p->c.files[i];
    if (f->skip)
      continue;
    DocReader *r = &p->r;
    if (!docs_open(r, f->path, f->jsonl))
      return false;
    if (p->pass == 1) {
      f->size = (int64_t)r->n;
      f->mtime_ns = r->mtime_ns;
    } else if (f->size != (int64_t)r->n || f->mtime_ns != r->mtime_ns) {
      diag_file_error(f->path, "the file changed while prep read it");
      return false;
    }
    bool ok = true;
    if (r->n && memchr(r->map, 0, r->n)) {
      if (!p->c.folder || p->pass == 2) {
        diag_file_error(f->path, "not a text file (it holds NUL bytes)");
        ok = false;
      } else {
        // The first few by name; the summary line counts them all.
        if (p->skipped_binary < 3)
          note(p, f->path, "skipped: %s", "not a text file (it holds NUL bytes)");
        else if (p->skipped_binary == 3)
          note(p, f->path, "skipped: %s", "not a text file (and so are any further ones; the summary counts them)");
        f->skip = f->binary = true;
        p->skipped_binary++;
        p->c.total_bytes -= f->size;
      }
    } else {
      const char *text;
      size_t n;
      int rc;
      while ((rc = docs_next(r, &text, &n)) > 0 && (ok = document(p, text, n)))
        tick(p, docs_tell(r).at);
      ok = ok && rc == 0;
      p->done_bytes += (int64_t)r->n;
    }
    docs_close(r);
    if (!ok)
      return false;
  }
  return true;
}

//
// The output folder.
//
static bool make_dirs(const char *path) {
  char *p = xstrdup(path, "a folder's path");
  bool ok = true;
  for (char *s = p + 1; ok; s++) {
    bool last = !*s;
    if (*s == '/' || last) {
      *s = 0;
      if (mkdir(p, 0777) && errno != EEXIST) {
        diag_file_error(path, "cannot create the folder: %s", strerror(errno));
        ok = false;
      }
      *s = '/';
    }
    if (last)
      break;
  }
  free(p);
  return ok;
}

// Removes the shards of a split in DIR that this run did not write (--force over an older prep).
static int remove_stale(const Prep *p, const SplitOut *out) {
  char **paths;
  int n = shard_list(p->o->out_dir, out->split, &paths), removed = 0;
  for (int i = 0; i < n; i++) {
    const char *name = strrchr(paths[i], '/') + 1;
    size_t k = strlen(out->split);
    long idx = !strncmp(name, out->split, k) && name[k] == '_' ? strtol(name + k + 1, NULL, 10) : -1;
    char ours[64];
    snprintf(ours, sizeof ours, "%s_%06ld.bin", out->split, idx);
    if ((idx < 0 || idx >= out->index || strcmp(name, ours)) && !remove(paths[i]))
      removed++;
  }
  shard_list_free(paths, n > 0 ? n : 0);
  return removed;
}

static const char *size_str(char *buf, size_t n, int64_t bytes) {
  if (bytes < 1000000)
    snprintf(buf, n, "%lld bytes", (long long)bytes);
  else
    snprintf(buf, n, "%.2f MB", (double)bytes / 1e6);
  return buf;
}

static int count_shards(const SplitOut *s) { return s->index + (s->open ? 1 : 0); }

// DIR/source.txt: the input (absolute), the options, the split and every file read.
static bool write_source(const Prep *p, const char *abs_input) {
  const PrepOptions *o = p->o;
  Source s = {.input = (char *)abs_input, .doc_sep = (char *)o->doc_sep, .text_field = (char *)o->text_field,
              .split = p->split, .docs = {p->train.docs, p->val.docs}, .tokens = {p->train.tokens, p->val.tokens}};
  s.files = xmalloc(sizeof *s.files * (size_t)(p->c.nfiles ? p->c.nfiles : 1), "the source list");
  size_t root = strlen(p->c.root);
  for (int i = 0; i < p->c.nfiles; i++) {
    const CorpusFile *f = &p->c.files[i];
    if (f->seen)
      continue;
    s.files[s.nfiles] = *f;
    s.files[s.nfiles].path = xmalloc(strlen(abs_input) + strlen(f->path + root) + 1, "the source list");
    strcat(strcpy(s.files[s.nfiles++].path, abs_input), f->path + root);
  }
  bool ok = source_write(o->out_dir, &s);
  for (int i = 0; i < s.nfiles; i++)
    free(s.files[i].path);
  free(s.files);
  return ok;
}

static void prep_free(Prep *p) {
  corpus_free(&p->c);
  docs_free(&p->r);
  tok_trainer_free(p->trainer);
  tok_free(p->tok);
  free(p->ids.ids);
  free(p->u16);
}

int prep_run(const PrepOptions *o) {
  const char *in = o->input;
  if (!o->out_dir) {
    diag_file_error(in, "no output folder (-o DIR)");
    return 1;
  }
  if (o->vocab < 256 || o->vocab > TOK_MAX_VOCAB) {
    diag_file_error(in, "--vocab %d is outside 256..%d", o->vocab, TOK_MAX_VOCAB);
    return 1;
  }
  if (!(o->val_fraction > 0 && o->val_fraction <= 0.5)) {
    diag_file_error(in, "--val-fraction %g is outside (0, 0.5]", o->val_fraction);
    return 1;
  }
  if (o->shard_tokens < 1 || o->shard_tokens > INT32_MAX) {
    diag_file_error(in, "--shard-tokens %lld is outside 1..%d", (long long)o->shard_tokens, INT32_MAX);
    return 1;
  }
  if (!o->text_field || !*o->text_field) {
    diag_file_error(in, "--text-field is empty");
    return 1;
  }
  struct stat st;
  if (!stat(o->out_dir, &st)) {
    if (!S_ISDIR(st.st_mode)) {
      diag_file_error(o->out_dir, "not a folder");
      return 1;
    }
    char **paths;
    int ntrain = shard_list(o->out_dir, "train", &paths);
    shard_list_free(paths, ntrain > 0 ? ntrain : 0);
    int nval = shard_list(o->out_dir, "val", &paths);
    shard_list_free(paths, nval > 0 ? nval : 0);
    if (ntrain < 0 || nval < 0)
      return 1;
    if ((ntrain || nval) && !o->force) {
      diag_file_error(o->out_dir, "already holds shards; use --force to overwrite");
      return 1;
    }
  }

  Prep p = {.o = o, .tty = isatty(2), .t0 = now_s(), .train = {.split = "train"}, .val = {.split = "val"}};
  int rc = 1;
  char *abs_input = NULL, *path = NULL;
  if (!corpus_find(&p.c, in, false))
    goto done;
  if (!(abs_input = realpath(in, NULL))) {
    diag_file_error(in, "cannot resolve the path: %s", strerror(errno));
    goto done;
  }
  if (o->vocab > 256)
    p.trainer = tok_trainer_new();
  p.pass = 1;
  if (!read_pass(&p))
    goto done;
  draw_done(&p);
  if (!p.nbytes) {
    diag_file_error(in, "empty corpus: no text in %d file%s", p.c.nfiles, p.c.nfiles == 1 ? "" : "s");
    goto done;
  }
  if (p.ndocs == 1 && p.nbytes < 2) {
    diag_file_error(in, "one document of %lld byte: too little to hold out a validation part", (long long)p.nbytes);
    goto done;
  }
  p.split = corpus_split(p.ndocs, p.nbytes, o->val_fraction);

  if (p.trainer) {
    p.tok = tok_train(p.trainer, o->vocab, train_progress, &p);
    draw_done(&p);
  } else {
    char why[128];
    p.tok = tok_new(NULL, 0, why, sizeof why);
  }
  if (!make_dirs(o->out_dir))
    goto done;
  // An older prep's record describes shards this one replaces: it goes first, and the new one is
  // written last, so that a prep cut short leaves no record of shards it did not finish.
  size_t len = strlen(o->out_dir) + 32;
  path = xmalloc(len, "a file's path");
  snprintf(path, len, "%s/source.txt", o->out_dir);
  if (remove(path) && errno != ENOENT) {
    diag_file_error(path, "cannot remove: %s", strerror(errno));
    goto done;
  }
  p.pass = 2;
  if (!read_pass(&p))
    goto done;
  draw_done(&p);
  if (p.doc != p.ndocs) {
    diag_file_error(in, "the input changed while prep read it (%lld documents, then %lld)", (long long)p.ndocs,
                    (long long)p.doc);
    goto done;
  }
  bool ok = true;
  SplitOut *outs[2] = {&p.train, &p.val};
  for (int i = 0; i < 2; i++)
    if (outs[i]->open) {
      outs[i]->index++;
      outs[i]->open = false;
      ok = shard_writer_finish(&outs[i]->w) && ok;
    }
  snprintf(path, len, "%s/tokenizer.bin", o->out_dir);
  ok = ok && tok_save(p.tok, path) && write_source(&p, abs_input);
  if (!ok)
    goto done;
  int removed = remove_stale(&p, &p.train) + remove_stale(&p, &p.val);

  double dt = now_s() - p.t0;
  int64_t tokens = p.train.tokens + p.val.tokens, eos = p.train.docs + p.val.docs;
  char size[32];
  printf("prep: %lld document%s (%lld train, %lld val%s), %s of text from %d file%s", (long long)p.ndocs,
         p.ndocs == 1 ? "" : "s", (long long)p.train.docs, (long long)p.val.docs,
         p.ndocs == 1 ? ": the one document cut in two" : "", size_str(size, sizeof size, p.nbytes),
         p.c.nfiles - p.skipped_binary - p.c.skipped_seen,
         p.c.nfiles - p.skipped_binary - p.c.skipped_seen == 1 ? "" : "s");
  if (p.skipped_binary || p.c.skipped_seen || p.c.skipped_other)
    printf(" (skipped: %d not text, %d seen before, %d other)", p.skipped_binary, p.c.skipped_seen,
           p.c.skipped_other);
  printf("\nprep: %lld tokens (train %lld, val %lld), %.2f bytes per token (EOS not counted), vocab %d\n",
         (long long)tokens, (long long)p.train.tokens, (long long)p.val.tokens,
         (double)p.nbytes / (double)(tokens - eos), tok_vocab(p.tok));
  printf("prep: wrote %d train shard%s, %d val shard%s, tokenizer.bin and source.txt to %s", count_shards(&p.train),
         count_shards(&p.train) == 1 ? "" : "s", count_shards(&p.val), count_shards(&p.val) == 1 ? "" : "s", o->out_dir);
  if (removed)
    printf(", removed %d old shard%s", removed, removed == 1 ? "" : "s");
  printf(" in %.2f s (%.1f MB/s)\n", dt, (double)p.nbytes / 1e6 / dt);
  double share = (double)p.val.tokens / (double)tokens;
  if (share > 2 * o->val_fraction || share < o->val_fraction / 2)
    fprintf(stderr, "%s: warning: the val split holds %.1f%% of the tokens, where --val-fraction asks %.1f%%: "
            "documents stay whole, and these %lld split no nearer (--doc-sep cuts files into more documents)\n", in,
            100 * share, 100 * o->val_fraction, (long long)p.ndocs);
  rc = 0;
done:
  for (int i = 0; i < 2; i++) {
    SplitOut *s = i ? &p.val : &p.train;
    if (s->open)
      datafile_abort(&s->w.file);
  }
  free(abs_input);
  free(path);
  prep_free(&p);
  return rc;
}
