// test_onthefly.c: batches tokenised from the text as they are drawn (LoaderOptions.from_text, `mdlc
// run --tokenize-on-the-fly`) against the batches of the shards prep wrote from the same text: tokens,
// targets, pos and doc bit-identical over several epochs, crossing documents, shards and the
// megabyte pieces long documents are encoded in; packed and padded, in order and (padded) shuffled;
// resumed mid-epoch; for a folder (nested, JSONL, binary, a symlink, a long file), a --doc-sep file,
// a JSONL file and a single document, byte-level and with learned merges. Then the errors: no
// source.txt, shards without one, an input changed, touched, grown, shrunk or moved since prep, a
// file changed while training reads it, and packed rows shuffled.
#include "data.h"
#include "test.h"
#include "scratch_dir.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

// Deterministic text of about `bytes` bytes: made-up words (some UTF-8), digits, punctuation, runs
// of whitespace and newlines; `sep` lines (when not NULL) between some paragraphs, and now and then
// two in a row (an empty document).
static char *make_text(uint64_t seed, size_t bytes, const char *sep, size_t *n) {
  static const char *syl[] = {"ka", "to", "ri", "ne", "su", "mo", "la", "pé", "ü", "ng", "st", "or",
                              "an", "th", "e", "日", "本", "qu", "x", "ion", "42", "7"};
  static const char *ends[] = {". ", "!\n", ",  ", "?\n\n", ";\t", ".\r\n"};
  size_t cap = bytes + 256, len = 0;
  char *s = malloc(cap);
  for (uint64_t i = 0; len < bytes; i++) {
    int k = 1 + (int)(mdl_rng_u64(seed, 1, i) % 4);
    for (int j = 0; j < k; j++)
      len += (size_t)snprintf(s + len, cap - len, "%s", syl[mdl_rng_u64(seed, 2, i * 8 + (uint64_t)j) % 22]);
    uint64_t r = mdl_rng_u64(seed, 3, i) % 16;
    len += (size_t)snprintf(s + len, cap - len, "%s", r < 6 ? ends[r] : " ");
    if (sep && mdl_rng_u64(seed, 4, i) % 23 == 0)
      len += (size_t)snprintf(s + len, cap - len, "\n%s\n%s%s", sep, mdl_rng_u64(seed, 5, i) % 5 ? "" : sep,
                              mdl_rng_u64(seed, 5, i) % 5 ? "" : "\r\n");
  }
  *n = len;
  return s;
}

static void write_text(const char *path, uint64_t seed, size_t bytes, const char *sep) {
  size_t n;
  char *s = make_text(seed, bytes, sep, &n);
  write_file(path, s, n);
  free(s);
}

// A JSONL file of `lines` objects (blank lines, empty texts and escapes among them).
static void write_jsonl(const char *path, uint64_t seed, int lines) {
  FILE *f = fopen(path, "wb");
  for (int i = 0; i < lines; i++) {
    size_t n;
    char *s = make_text(seed + (uint64_t)i, 20 + mdl_rng_u64(seed, 6, (uint64_t)i) % 300, NULL, &n);
    fprintf(f, "{\"id\": %d, \"text\": \"", i);
    for (size_t k = 0; k < n && i % 11 != 3; k++) {
      unsigned char c = (unsigned char)s[k];
      if (c == '\n')
        fputs("\\n", f);
      else if (c == '\r' || c == '\t')
        fprintf(f, "\\u%04x", c);
      else if (c == '"' || c == '\\')
        fprintf(f, "\\%c", c);
      else
        fputc(c, f);
    }
    fprintf(f, " \\u00e9\\ud83c\\udf89\"%s}\n%s", i % 4 ? ", \"meta\": [1, {\"text\": 2}]" : "", i % 7 ? "" : "\n");
    free(s);
  }
  fclose(f);
}

static bool prep(const char *input, const char *out, int vocab, const char *doc_sep, double val_fraction,
                 int64_t shard_tokens) {
  PrepOptions o;
  prep_defaults(&o);
  o.input = input;
  o.out_dir = out;
  o.vocab = vocab;
  o.doc_sep = doc_sep;
  o.val_fraction = val_fraction;
  o.shard_tokens = shard_tokens;
  o.force = true;
  capture_begin();
  int rc = prep_run(&o);
  const char *err = capture_end();
  if (rc)
    printf("prep %s: %s\n", input, err);
  return rc == 0;
}

static int count_shards(const char *dir, const char *split) {
  char **paths;
  int n = shard_list(dir, split, &paths);
  shard_list_free(paths, n > 0 ? n : 0);
  return n;
}

static bool same_batch(const Batch *a, const Batch *b, int64_t BT) {
  size_t n = sizeof(int32_t) * (size_t)BT;
  return !memcmp(a->tokens, b->tokens, n) && !memcmp(a->targets, b->targets, n) && !memcmp(a->pos, b->pos, n) &&
         !memcmp(a->doc, b->doc, n) && a->real_tokens == b->real_tokens;
}

// The batches of the shards and of the text, side by side: `epochs` epochs of rows (at least 3
// batches), then a fresh text loader resumed at the state after a third of them. Returns a
// description of the first difference, or NULL.
static const char *compare(const char *dir, const char *split, LoaderOptions o, double epochs, int64_t *nbatches) {
  static char why[256];
  LoaderOptions ot = o;
  ot.from_text = true;
  Loader *a = loader_open(dir, split, o), *b = loader_open(dir, split, ot);
  if (!a || !b) {
    loader_close(a);
    loader_close(b);
    return "a loader does not open";
  }
  int64_t BT = o.B * o.T, n = (int64_t)(epochs * (double)loader_rows(a)) / o.B + 3;
  *nbatches = n;
  const char *diff = NULL;
  if (loader_rows(a) != loader_rows(b) || loader_tokens(a) != loader_tokens(b)) {
    snprintf(why, sizeof why, "rows %lld and %lld, tokens %lld and %lld", (long long)loader_rows(a),
             (long long)loader_rows(b), (long long)loader_tokens(a), (long long)loader_tokens(b));
    diff = why;
  }
  int32_t *keep = malloc(sizeof(int32_t) * 4 * (size_t)BT * (size_t)n);
  int64_t real[2] = {0, 0}, resume_at = n / 3;
  LoaderState st = {0, 0};
  for (int64_t i = 0; i < n && !diff; i++) {
    if (i == resume_at)
      st = loader_state(b);
    Batch x, y;
    loader_next(a, &x);
    if (!loader_next(b, &y)) {
      snprintf(why, sizeof why, "the text loader fails at batch %lld", (long long)i);
      diff = why;
    } else if (!same_batch(&x, &y, BT)) {
      int64_t k = 0;
      while (k < BT && x.tokens[k] == y.tokens[k] && x.targets[k] == y.targets[k] && x.pos[k] == y.pos[k] &&
             x.doc[k] == y.doc[k])
        k++;
      snprintf(why, sizeof why, "batch %lld differs at %lld: token %d/%d target %d/%d pos %d/%d doc %d/%d",
               (long long)i, (long long)k, x.tokens[k], y.tokens[k], x.targets[k], y.targets[k], x.pos[k], y.pos[k],
               x.doc[k], y.doc[k]);
      diff = why;
    } else {
      int32_t *dst = keep + 4 * BT * i;
      memcpy(dst, y.tokens, sizeof(int32_t) * (size_t)BT);
      memcpy(dst + BT, y.targets, sizeof(int32_t) * (size_t)BT);
      memcpy(dst + 2 * BT, y.pos, sizeof(int32_t) * (size_t)BT);
      memcpy(dst + 3 * BT, y.doc, sizeof(int32_t) * (size_t)BT);
      real[0] += x.real_tokens;
      real[1] += y.real_tokens;
    }
  }
  loader_close(a);
  loader_close(b);
  if (!diff) {
    Loader *c = loader_open(dir, split, ot);
    bool sought = c && loader_seek(c, st);
    for (int64_t i = resume_at; sought && i < n && !diff; i++) {
      Batch y;
      const int32_t *want = keep + 4 * BT * i;
      if (!loader_next(c, &y) || memcmp(y.tokens, want, sizeof(int32_t) * (size_t)BT) ||
          memcmp(y.targets, want + BT, sizeof(int32_t) * (size_t)BT) ||
          memcmp(y.pos, want + 2 * BT, sizeof(int32_t) * (size_t)BT) ||
          memcmp(y.doc, want + 3 * BT, sizeof(int32_t) * (size_t)BT)) {
        snprintf(why, sizeof why, "resumed at epoch %lld position %lld, batch %lld differs", (long long)st.epoch,
                 (long long)st.position, (long long)i);
        diff = why;
      }
    }
    if (!sought)
      diff = "the text loader does not resume";
    loader_close(c);
  }
  free(keep);
  return diff;
}

typedef struct {
  const char *name, *input, *doc_sep;
  int64_t shard_tokens, T;
  double val_fraction;
} TestCorpus;

static void check_corpus(const TestCorpus *c, int vocab) {
  char out[600], name[300];
  snprintf(out, sizeof out, "%s-%d", c->input, vocab);
  bool ok = prep(c->input, out, vocab, c->doc_sep, c->val_fraction, c->shard_tokens);
  int nshards = count_shards(out, "train");
  snprintf(name, sizeof name, "on the fly: %s, vocab %d: prep writes several train shards", c->name, vocab);
  CHECK(ok && nshards > 2, name, "prep %s, %d shards", ok ? "ran" : "failed", nshards);
  if (!ok)
    return;
  static const struct {
    const char *split;
    bool pack, shuffle;
  } modes[] = {{"train", true, false}, {"train", false, false}, {"train", false, true}, {"val", true, false},
               {"val", false, true}};
  for (size_t m = 0; m < sizeof modes / sizeof *modes; m++) {
    LoaderOptions o = {.B = 3, .T = c->T, .vocab = 65536, .pack = modes[m].pack, .shuffle = modes[m].shuffle,
                       .seed = 7};
    int64_t n = 0;
    const char *diff = compare(out, modes[m].split, o, 2.5, &n);
    snprintf(name, sizeof name, "on the fly: %s, vocab %d, %s, %s%s: the shards' batches, resumed too", c->name, vocab,
             modes[m].split, modes[m].pack ? "packed" : "padded", modes[m].shuffle ? ", shuffled" : "");
    CHECK(!diff, name, "%s (%lld batches)", diff ? diff : "", (long long)n);
  }
}

static void test_identical(void) {
  // A folder: nested text files, JSONL, a binary file, a symlink to a file seen, an empty file and a
  // long file (more than one megabyte piece), in path order.
  char *dir = strdup(path_in("folder")), *fortunes = strdup(path_in("fortunes.txt")),
       *jsonl = strdup(path_in("docs.jsonl")), *book = strdup(path_in("book.txt"));
  mkdir(dir, 0755);
  mkdir(path_in("folder/sub"), 0755);
  mkdir(path_in("folder/sub/deeper"), 0755);
  for (int i = 0; i < 6; i++) {
    char p[64];
    snprintf(p, sizeof p, "folder/%c%d.txt", 'a' + i, i);
    write_text(path_in(p), 10 + (uint64_t)i, 50 + 700 * (size_t)i, NULL);
  }
  write_text(path_in("folder/sub/b.txt"), 20, 4000, NULL);
  write_text(path_in("folder/sub/deeper/long.txt"), 21, (3 << 20) / 2, NULL);
  write_jsonl(path_in("folder/sub/c.jsonl"), 22, 40);
  write_file(path_in("folder/sub/d.dat"), "\0\0\1binary", 9);
  write_file(path_in("folder/sub/empty.txt"), "", 0);
  CHECK(symlink("../a0.txt", path_in("folder/sub/e.txt")) == 0, "on the fly: the folder's symbolic link is made",
        "failed");

  const char *sep = "%% \\x5c\t%"; // (source.txt escapes the backslash and the tab)
  write_text(fortunes, 30, 40000, sep);
  write_jsonl(jsonl, 40, 300);
  write_text(book, 50, 30000, NULL);

  TestCorpus corpora[] = {
      {"a folder", dir, NULL, 40000, 64, 0.2},
      {"a --doc-sep file", fortunes, sep, 997, 24, 0.1},
      {"a JSONL file", jsonl, NULL, 4999, 40, 0.05},
      {"a single document", book, NULL, 3001, 16, 0.25},
  };
  for (size_t i = 0; i < sizeof corpora / sizeof *corpora; i++) {
    check_corpus(&corpora[i], 256);
    check_corpus(&corpora[i], 420);
  }
  free(dir);
  free(fortunes);
  free(jsonl);
  free(book);
}

static struct timespec mtime_of(const char *path) {
  struct stat st;
  stat(path, &st);
  return st.st_mtim;
}

static void set_mtime(const char *path, struct timespec m) {
  struct timespec t[2] = {{.tv_nsec = UTIME_OMIT}, m};
  utimensat(AT_FDCWD, path, t, 0);
}

// Opening a text loader fails with a message holding all of want (NULL-terminated).
static void expect_refused(const char *name, const char *dir, LoaderOptions o, const char *const *want) {
  o.from_text = true;
  capture_begin();
  Loader *l = loader_open(dir, "train", o);
  const char *err = capture_end();
  bool all = true;
  for (int i = 0; want[i]; i++)
    all &= strstr(err, want[i]) != NULL;
  CHECK(!l && all, name, "%s", l ? "it opened" : err);
  loader_close(l);
}

static void test_errors(void) {
  LoaderOptions o = {.B = 2, .T = 8, .vocab = 256, .pack = true};
  char *in = strdup(path_in("err")), *out = strdup(path_in("err-out"));
  mkdir(in, 0755);
  write_text(path_in("err/one.txt"), 60, 3000, NULL);
  write_text(path_in("err/two.txt"), 61, 3000, NULL);
  write_text(path_in("err/three.txt"), 62, 3000, NULL);
  CHECK(prep(in, out, 256, NULL, 0.3, 500), "on the fly errors: prep", "failed");
  Loader *l = loader_open(out, "train", (LoaderOptions){.B = 2, .T = 8, .vocab = 256, .pack = true, .from_text = true});
  CHECK(l != NULL, "on the fly errors: the untouched input opens", "refused");
  loader_close(l);

  o.shuffle = true;
  expect_refused("on the fly: packed rows cannot be shuffled", out, o,
                 (const char *[]){out, "cannot be shuffled", "only the whole split tokenised", NULL});
  o.shuffle = false;

  char *one = strdup(path_in("err/one.txt")), size[64];
  struct timespec was = mtime_of(one), later = was;
  struct stat st;
  stat(one, &st);
  later.tv_sec += 5;
  set_mtime(one, later);
  snprintf(size, sizeof size, "%lld bytes", (long long)st.st_size);
  expect_refused("on the fly: a file touched since prep (same bytes, new mtime)", out, o,
                 (const char *[]){one, "changed since `mdlc prep` read it", size, NULL});
  set_mtime(one, was);
  l = loader_open(out, "train", (LoaderOptions){.B = 2, .T = 8, .vocab = 256, .pack = true, .from_text = true});
  CHECK(l != NULL, "on the fly: the mtime put back, the input opens again", "refused");
  loader_close(l);

  FILE *f = fopen(one, "ab");
  fputs("more", f);
  fclose(f);
  char grown[64], read[64];
  snprintf(grown, sizeof grown, "%lld bytes", (long long)st.st_size + 4);
  snprintf(read, sizeof read, "prep read %lld bytes", (long long)st.st_size);
  expect_refused("on the fly: a file grown since prep", out, o, (const char *[]){one, "changed since", grown, read, NULL});
  write_text(one, 60, 3000, NULL);
  set_mtime(one, was);
  free(one);

  write_text(path_in("err/four.txt"), 63, 100, NULL);
  expect_refused("on the fly: a file added since prep", out, o,
                 (const char *[]){path_in("err/four.txt"), "added to the input since", NULL});
  remove(path_in("err/four.txt"));
  rename(path_in("err/two.txt"), path_in("two.away"));
  expect_refused("on the fly: a file gone since prep", out, o,
                 (const char *[]){path_in("err/two.txt"), "gone from the input since", NULL});
  rename(path_in("two.away"), path_in("err/two.txt"));
  rename(in, path_in("err-moved"));
  expect_refused("on the fly: the input moved since prep", out, o,
                 (const char *[]){in, "cannot open", "has moved or gone", "source.txt", NULL});
  rename(path_in("err-moved"), in);

  // Changed while training reads it: the loader opens, then a file of the train split changes before
  // the cursor reaches it (in path order one.txt, three.txt, two.txt: the first two are train).
  l = loader_open(out, "train", (LoaderOptions){.B = 2, .T = 8, .vocab = 256, .pack = true, .from_text = true});
  write_text(path_in("err/three.txt"), 64, 2000, NULL);
  Batch b;
  bool failed = false;
  capture_begin();
  for (int i = 0; l && i < 2000 && !failed; i++)
    failed = !loader_next(l, &b);
  const char *err = capture_end();
  CHECK(failed && strstr(err, path_in("err/three.txt")) && strstr(err, "changed since"),
        "on the fly: a file changed while training reads it stops the loader with its name", "%s",
        failed ? err : "no failure");
  loader_close(l);

  // A DIR made before source.txt existed, and llm.c shards with no tokenizer and no source.
  remove(path_in("err-out/source.txt"));
  expect_refused("on the fly: a DIR without source.txt", out, o,
                 (const char *[]){"source.txt: error: not found", "prepare the text again", NULL});
  char llmc[600];
  snprintf(llmc, sizeof llmc, "%s", path_in("llmc"));
  mkdir(llmc, 0755);
  uint16_t tok[64] = {0};
  for (int i = 0; i < 64; i++)
    tok[i] = (uint16_t)(i % 7 ? 100 + i : 0);
  char p[700];
  snprintf(p, sizeof p, "%s/fineweb_train_000001.bin", llmc);
  shard_write(p, tok, 64);
  expect_refused("on the fly: llm.c shards that do not say where they came from", llmc, o,
                 (const char *[]){"llmc/source.txt: error: not found", "made elsewhere", NULL});
  write_file(path_in("llmc/source.txt"), "format mdl-source-2\ninput /x\n", 29);
  expect_refused("on the fly: an incomplete source.txt", llmc, o,
                 (const char *[]){"source.txt: error: incomplete", NULL});
  write_file(path_in("llmc/source.txt"), "format mdl-source-1\ninput /x\n", 29);
  expect_refused("on the fly: a source.txt of another prep's split", llmc, o,
                 (const char *[]){"format 'mdl-source-1'", "run `mdlc prep` again", NULL});
  free(in);
  free(out);
}

int main(void) {
  snprintf(tmp, sizeof tmp, "/tmp/mdl_onthefly_XXXXXX");
  if (!mkdtemp(tmp)) {
    perror("mkdtemp");
    return 1;
  }
  test_identical();
  test_errors();
  nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  TEST_EXIT();
}
