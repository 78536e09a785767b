// test_data.c: the tokenizer (pre-splitting, BPE training against a naive trainer, encode/decode,
// the tokenizer file), token shards, the loader (packing, padding, epochs, shuffling, resuming)
// and prep end to end (folder + JSONL in, decoded shards compared with the documents).
#include "data.h"
#include "runtime.h"
#include "test.h"
#include "scratch_dir.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

//
// Pre-splitting.
//
static void test_split(void) {
  const char *s = "Hello world,  it's 2024!\n\n  ok";
  const char *want[] = {"Hello", " world", ",", " ", " it", "'", "s", " 2024", "!", "\n\n ", " ok"};
  int nwant = (int)(sizeof want / sizeof *want), k = 0;
  bool same = true;
  for (size_t i = 0, n = strlen(s); i < n; k++) {
    size_t e = tok_word_end(s, n, i);
    same &= k < nwant && strlen(want[k]) == e - i && !memcmp(want[k], s + i, e - i);
    i = e;
  }
  CHECK(same && k == nwant, "split: letters, digits, other, leading space, whitespace runs", "%d words", k);

  // Cut at any word boundary, the text before it splits into the same words (prep encodes long
  // documents piece by piece).
  const char *v = "a  b\t\n  c d..  e1 2   ";
  size_t nv = strlen(v), ends[64];
  int nends = 0;
  for (size_t i = 0; i < nv; i = ends[nends++])
    ends[nends] = tok_word_end(v, nv, i);
  bool prefix_same = true;
  for (int c = 0; c < nends; c++) {
    int k = 0;
    for (size_t i = 0; i < ends[c]; i = tok_word_end(v, ends[c], i), k++)
      prefix_same &= tok_word_end(v, ends[c], i) == ends[k];
    prefix_same &= k == c + 1;
  }
  CHECK(prefix_same && nends > 10, "split: a prefix cut at a word boundary splits the same way", "%d words", nends);

  const char *u = "café über";
  size_t e1 = tok_word_end(u, strlen(u), 0);
  CHECK(e1 == strlen("café"), "split: UTF-8 bytes stay inside a word", "first word %zu bytes", e1);
  char run[300];
  memset(run, 'a', sizeof run);
  size_t e2 = tok_word_end(run, sizeof run, 0), e3 = tok_word_end(run, sizeof run, 256);
  CHECK(e2 == TOK_MAX_WORD && e3 == 300, "split: long runs are cut at TOK_MAX_WORD", "%zu %zu", e2, e3);
}

//
// BPE training.
//
static Tokenizer *train_on(const char *text, size_t n, int vocab) {
  TokTrainer *tr = tok_trainer_new();
  tok_trainer_add(tr, text, n);
  Tokenizer *t = tok_train(tr, vocab, NULL, NULL);
  tok_trainer_free(tr);
  return t;
}

static void test_bpe_by_hand(void) {
  // "aaabdaaabac": (a,a) occurs 4 times -> 256; then (256,a) and (a,b) tie at 2: the smaller pair
  // (a,b) -> 257; then (256,257) -> 258: "X d X a c". No pair occurs twice after that.
  const char *s = "aaabdaaabac";
  Tokenizer *t = train_on(s, strlen(s), 300);
  const uint32_t *pairs;
  int n = tok_merges(t, &pairs);
  uint32_t want[] = {'a', 'a', 'a', 'b', 256, 257};
  CHECK(n == 3 && !memcmp(pairs, want, sizeof want), "bpe: merges of aaabdaaabac, ties to the smallest pair",
        "%d merges: (%u,%u) (%u,%u) (%u,%u)", n, pairs[0], pairs[1], n > 1 ? pairs[2] : 0, n > 1 ? pairs[3] : 0,
        n > 2 ? pairs[4] : 0, n > 2 ? pairs[5] : 0);
  CHECK(tok_vocab(t) == 259, "bpe: training stops when no pair occurs twice", "vocab %d", tok_vocab(t));
  TokBuf b = {0};
  tok_encode(t, s, strlen(s), &b);
  int32_t ids[] = {258, 'd', 258, 'a', 'c'};
  CHECK(b.n == 5 && !memcmp(b.ids, ids, sizeof ids), "bpe: encode aaabdaaabac", "%zu ids", b.n);
  free(b.ids);
  tok_free(t);

  // Word counts weigh pairs: " cd" x3 gives (' ',c) and (c,d) 3 each (the tie goes to the
  // smaller pair), more than (a,b), twice inside the one word "abab".
  const char *w = "abab cd cd cd";
  t = train_on(w, strlen(w), 257);
  n = tok_merges(t, &pairs);
  CHECK(n == 1 && pairs[0] == ' ' && pairs[1] == 'c', "bpe: the most frequent pair over the word table wins",
        "(%u,%u)", pairs[0], pairs[1]);
  tok_free(t);
}

// A naive trainer: recount every pair over the word table each round.
typedef struct {
  int32_t sym[TOK_MAX_WORD];
  int len;
  int64_t count;
  char text[TOK_MAX_WORD];
  int bytes;
} NaiveWord;

static int naive_train(const char *s, size_t n, int vocab, uint32_t *pairs, NaiveWord **out, int *nout) {
  NaiveWord *w = NULL;
  int nw = 0;
  for (size_t i = 0; i < n;) {
    size_t e = tok_word_end(s, n, i);
    int k = 0;
    while (k < nw && !(w[k].bytes == (int)(e - i) && !memcmp(w[k].text, s + i, e - i)))
      k++;
    if (k == nw) {
      w = realloc(w, (size_t)(nw + 1) * sizeof *w);
      w[nw].len = w[nw].bytes = (int)(e - i);
      w[nw].count = 0;
      memcpy(w[nw].text, s + i, e - i);
      for (size_t j = i; j < e; j++)
        w[nw].sym[j - i] = (unsigned char)s[j];
      nw++;
    }
    w[k].count++;
    i = e;
  }
  int64_t *cnt = malloc(sizeof(int64_t) * (size_t)vocab * (size_t)vocab);
  int r = 0;
  for (; r < vocab - 256; r++) {
    memset(cnt, 0, sizeof(int64_t) * (size_t)vocab * (size_t)vocab);
    for (int k = 0; k < nw; k++)
      for (int i = 0; i + 1 < w[k].len; i++)
        cnt[w[k].sym[i] * vocab + w[k].sym[i + 1]] += w[k].count;
    int64_t best = 0, at = 0;
    for (int64_t i = 0; i < (int64_t)vocab * vocab; i++)
      if (cnt[i] > best)
        best = cnt[i], at = i;
    if (best < 2)
      break;
    int32_t a = (int32_t)(at / vocab), b = (int32_t)(at % vocab), z = 256 + r;
    pairs[2 * r] = (uint32_t)a;
    pairs[2 * r + 1] = (uint32_t)b;
    for (int k = 0; k < nw; k++) {
      int j = 0;
      for (int i = 0; i < w[k].len;)
        if (i + 1 < w[k].len && w[k].sym[i] == a && w[k].sym[i + 1] == b)
          w[k].sym[j++] = z, i += 2;
        else
          w[k].sym[j++] = w[k].sym[i++];
      w[k].len = j;
    }
  }
  free(cnt);
  *out = w;
  *nout = nw;
  return r;
}

// Deterministic text: sentences of made-up words (1-4 syllables, some UTF-8), a few frequent
// and many rare, with digits, punctuation and assorted whitespace.
static char *make_corpus(size_t *n, uint64_t seed, int sentences) {
  static const char *syl[] = {"ka", "to", "ri", "ne", "su", "mo", "la", "pé", "ü", "ng", "st", "or",
                              "an", "th", "e", "日", "本", "qu", "x", "ion", "42", "7"};
  char words[300][32];
  for (int w = 0; w < 300; w++) {
    int len = 0, k = 1 + (int)(mdl_rng_u64(seed, 4, (uint64_t)w) % 4);
    for (int i = 0; i < k; i++)
      len += snprintf(words[w] + len, sizeof words[w] - (size_t)len, "%s",
                      syl[mdl_rng_u64(seed, 5, (uint64_t)(w * 8 + i)) % (sizeof syl / sizeof *syl)]);
  }
  size_t cap = (size_t)sentences * 400 + 16, len = 0;
  char *s = malloc(cap);
  for (int i = 0; i < sentences; i++) {
    int nw = 3 + (int)(mdl_rng_u64(seed, 1, (uint64_t)i) % 9);
    for (int k = 0; k < nw; k++) {
      double u = mdl_rng_uniform(seed, 2, (uint64_t)(i * 16 + k));
      len += (size_t)snprintf(s + len, cap - len, "%s%s", k ? " " : "", words[(int)(300 * u * u * u)]);
    }
    static const char *ends[] = {". ", "!\n", ",  ", "?\n\n", ";\t"};
    len += (size_t)snprintf(s + len, cap - len, "%s", ends[mdl_rng_u64(seed, 3, (uint64_t)i) % 5]);
  }
  *n = len;
  return s;
}

static void test_bpe_against_naive(void) {
  size_t n;
  char *s = make_corpus(&n, 7, 1500);
  int vocab = 640;
  uint32_t *pairs_naive = malloc(sizeof(uint32_t) * 2 * (size_t)(vocab - 256));
  NaiveWord *w;
  int nw;
  int nnaive = naive_train(s, n, vocab, pairs_naive, &w, &nw);
  Tokenizer *t = train_on(s, n, vocab);
  const uint32_t *pairs;
  int nm = tok_merges(t, &pairs);
  int first_diff = -1;
  for (int r = 0; r < nm && r < nnaive && first_diff < 0; r++)
    if (pairs[2 * r] != pairs_naive[2 * r] || pairs[2 * r + 1] != pairs_naive[2 * r + 1])
      first_diff = r;
  CHECK(nm == nnaive && nm > 300 && first_diff < 0, "bpe: incremental trainer == naive recounting trainer",
        "%d vs %d merges, first difference at %d", nm, nnaive, first_diff);

  // Encoding a training word by rank gives exactly the word as training left it.
  int bad = -1;
  TokBuf b = {0};
  for (int k = 0; k < nw && bad < 0; k++) {
    b.n = 0;
    tok_encode(t, w[k].text, (size_t)w[k].bytes, &b);
    if ((int)b.n != w[k].len || memcmp(b.ids, w[k].sym, b.n * sizeof *b.ids))
      bad = k;
  }
  CHECK(bad < 0, "bpe: encode(word) == the trained word's symbols", "word '%.*s'", bad < 0 ? 0 : w[bad].bytes,
        bad < 0 ? "" : w[bad].text);

  // Encoding the corpus through the cache twice gives the same ids.
  b.n = 0;
  size_t n1 = tok_encode(t, s, n, &b);
  int32_t *first = malloc(n1 * sizeof *first);
  memcpy(first, b.ids, n1 * sizeof *first);
  b.n = 0;
  size_t n2 = tok_encode(t, s, n, &b);
  CHECK(n1 == n2 && !memcmp(first, b.ids, n1 * sizeof *first) && n1 < n / 2, "bpe: cached encoding is stable and compresses",
        "%zu then %zu ids for %zu bytes", n1, n2, n);
  free(first);
  free(b.ids);
  free(w);
  free(pairs_naive);
  free(s);
  tok_free(t);
}

static void test_round_trip(void) {
  size_t n;
  char *corpus = make_corpus(&n, 11, 300);
  Tokenizer *bpe = train_on(corpus, n, 512);
  char why[128];
  Tokenizer *bytes = tok_new(NULL, 0, why, sizeof why);
  char all[256];
  for (int i = 1; i < 256; i++)
    all[i - 1] = (char)i;
  all[255] = 0;
  char seen[301];
  memcpy(seen, corpus + n / 2, 300);
  seen[300] = 0;
  const char *texts[] = {seen,
                         "Hello, wörld! 日本語のテキスト 🎉\n\ttabs  and   spaces\r\n123abc  \n\n",
                         "   leading and trailing   ",
                         "",
                         all};
  bool ok = true;
  TokBuf b = {0};
  char out[1024];
  for (int t = 0; t < 2; t++)
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
      Tokenizer *tk = t ? bytes : bpe;
      b.n = 0;
      tok_encode(tk, texts[i], strlen(texts[i]), &b);
      size_t m = tok_decode(tk, b.ids, b.n, out, sizeof out);
      ok &= m == strlen(texts[i]) && !memcmp(out, texts[i], m);
      ok &= t == 0 || b.n == strlen(texts[i]);
    }
  CHECK(ok, "tokenizer: decode(encode(text)) == text (UTF-8, whitespace, every byte)", "mismatch");
  b.n = 0;
  tok_encode(bpe, texts[0], strlen(texts[0]), &b);
  CHECK(b.n < strlen(texts[0]) / 3, "tokenizer: BPE encodes seen text in fewer ids", "%zu ids for %zu bytes", b.n,
        strlen(texts[0]));
  int32_t odd[] = {'a', TOK_EOS, 'b', 99999, -3};
  size_t m = tok_decode(bpe, odd, 5, out, sizeof out);
  CHECK(m == 8 && !memcmp(out, "ab\xEF\xBF\xBD\xEF\xBF\xBD", 8), "tokenizer: EOS decodes to nothing, bad ids to U+FFFD",
        "%zu bytes", m);
  m = tok_decode(bpe, odd, 5, out, 3);
  CHECK(m == 8, "tokenizer: decode reports the full length past cap", "%zu", m);
  free(b.ids);
  free(corpus);
  tok_free(bpe);
  tok_free(bytes);
}

static void put32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (unsigned char)(v >> (8 * i));
}

static void test_tokenizer_file(void) {
  size_t n;
  char *corpus = make_corpus(&n, 5, 200);
  Tokenizer *t = train_on(corpus, n, 400);
  const char *path = path_in("tokenizer.bin");
  bool saved = tok_save(t, path);
  Tokenizer *u = tok_load(path);
  const uint32_t *pa, *pb;
  int na = tok_merges(t, &pa), nb = u ? tok_merges(u, &pb) : -1;
  CHECK(saved && u && na == nb && !memcmp(pa, pb, sizeof(uint32_t) * 2 * (size_t)na) && tok_vocab(u) == 256 + na,
        "tokenizer file: save/load round trip", "%d vs %d merges", na, nb);
  struct stat st;
  stat(path, &st);
  CHECK(st.st_size == 16 + 8 * na, "tokenizer file: 16-byte header + 8 bytes per merge", "%lld bytes",
        (long long)st.st_size);
  tok_free(u);

  unsigned char buf[16 + 8 * 2];
  memcpy(buf, "MDLTOK1", 8);
  put32(buf + 8, 258);
  put32(buf + 12, 2);
  put32(buf + 16, 'a');
  put32(buf + 20, 'b');
  put32(buf + 24, 256);
  put32(buf + 28, 'c');
  const char *bad = path_in("bad.bin");
  write_file(bad, buf, sizeof buf);
  u = tok_load(bad);
  char out[8];
  int32_t id = 257;
  CHECK(u && tok_decode(u, &id, 1, out, sizeof out) == 3 && !memcmp(out, "abc", 3), "tokenizer file: hand-made file loads",
        "%s", u ? "wrong piece" : "rejected");
  tok_free(u);

  struct {
    const char *name, *want;
    size_t len;
    void (*edit)(unsigned char *);
  } cases[] = {
      {"bad magic", "bad magic", sizeof buf, NULL},
      {"truncated", "truncated: 2 merges need 32 bytes, file holds 28", sizeof buf - 4, NULL},
      {"merge id not yet defined", "merge 1 (id 257) uses id 258", sizeof buf, NULL},
      {"vocab mismatch", "vocab 300 does not match 256 + 2 merges", sizeof buf, NULL},
      {"merge with EOS", "uses EOS", sizeof buf, NULL},
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    unsigned char x[sizeof buf];
    memcpy(x, buf, sizeof buf);
    if (c == 0)
      x[0] = 'X';
    if (c == 2)
      put32(x + 24, 258);
    if (c == 3)
      put32(x + 8, 300);
    if (c == 4)
      put32(x + 16, TOK_EOS);
    write_file(bad, x, cases[c].len);
    capture_begin();
    u = tok_load(bad);
    const char *err = capture_end();
    char name[96];
    snprintf(name, sizeof name, "tokenizer file: %s is an error naming the file", cases[c].name);
    CHECK(!u && !strncmp(err, bad, strlen(bad)) && strstr(err, cases[c].want), name, "%s", err);
    tok_free(u);
  }
  capture_begin();
  u = tok_load(path_in("missing.bin"));
  const char *err = capture_end();
  CHECK(!u && strstr(err, "missing.bin: error: cannot open"), "tokenizer file: missing file", "%s", err);
  free(corpus);
  tok_free(t);
}

//
// Shards.
//
static void test_shards(void) {
  uint16_t tok[3000];
  for (int i = 0; i < 3000; i++)
    tok[i] = (uint16_t)(i * 7 % 1000);
  const char *p = path_in("s_train_000000.bin");
  Shard s;
  bool ok = shard_write(p, tok, 3000) && shard_open(&s, p, 1000);
  CHECK(ok && s.n == 3000 && !memcmp(s.tokens, tok, sizeof tok), "shard: write/read round trip", "n %lld",
        ok ? (long long)s.n : -1LL);
  if (ok)
    shard_close(&s);
  int32_t header[256];
  FILE *f = fopen(p, "rb");
  size_t got = fread(header, 4, 256, f);
  fclose(f);
  CHECK(got == 256 && header[0] == 20240520 && header[1] == 1 && header[2] == 3000 && header[3] == 0,
        "shard: llm.c header (magic, version, count)", "%d %d %d", header[0], header[1], header[2]);

  unsigned char raw[1024 + 2 * 1200] = {0};
  int32_t *h = (int32_t *)raw;
  const char *bad = path_in("bad_train.bin");
  struct {
    const char *name, *want;
    int32_t magic, version, count;
    size_t bytes;
    int64_t vocab;
  } cases[] = {
      {"bad magic", "bad magic 1234", 1234, 1, 1200, sizeof raw, 0},
      {"bad version", "version 2", SHARD_MAGIC, 2, 1200, sizeof raw, 0},
      {"truncated", "truncated: header says 5000 tokens, file holds 1200", SHARD_MAGIC, 1, 5000, sizeof raw, 0},
      {"short file", "truncated: 1000 bytes", SHARD_MAGIC, 1, 0, 1000, 0},
      {"extra bytes", "header says 1000 tokens, file holds 2400 bytes", SHARD_MAGIC, 1, 1000, sizeof raw, 0},
      {"token >= vocab", "token 300 at index 17 is outside the model's vocabulary (V = 256)", SHARD_MAGIC, 1, 1200,
       sizeof raw, 256},
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    memset(raw, 0, sizeof raw);
    h[0] = cases[c].magic;
    h[1] = cases[c].version;
    h[2] = cases[c].count;
    ((uint16_t *)(raw + 1024))[17] = 300;
    write_file(bad, raw, cases[c].bytes);
    capture_begin();
    bool opened = shard_open(&s, bad, cases[c].vocab);
    const char *err = capture_end();
    char name[96];
    snprintf(name, sizeof name, "shard: %s is an error naming the file", cases[c].name);
    CHECK(!opened && !strncmp(err, bad, strlen(bad)) && strstr(err, cases[c].want), name, "%s", err);
    if (opened)
      shard_close(&s);
  }
  remove(bad);
  remove(p);

  // Split names: ours and llm.c's, in name order; nothing else.
  const char *dir = path_in("names");
  mkdir(dir, 0755);
  const char *names[] = {"train_000001.bin", "fineweb_train_000002.bin", "train_000000.bin", "tiny_shakespeare_val.bin",
                         "tokenizer.bin", "trainer.bin", "train_000003.txt", "val_000000.bin", "retrain_x.bin"};
  char full[512];
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    snprintf(full, sizeof full, "%s/%s", dir, names[i]);
    write_file(full, "", 0);
  }
  char **paths;
  int n = shard_list(dir, "train", &paths);
  bool order = n == 3 && strstr(paths[0], "/fineweb_train_000002.bin") && strstr(paths[1], "/train_000000.bin") &&
               strstr(paths[2], "/train_000001.bin");
  shard_list_free(paths, n);
  int nv = shard_list(dir, "val", &paths);
  shard_list_free(paths, nv);
  CHECK(order && nv == 2, "shard: the shards of a split, sorted, llm.c's names included", "%d train, %d val", n, nv);
}

//
// The loader.
//
static void write_stream(const char *dir, const char *split, const uint16_t *tok, int64_t n, const int64_t *cuts,
                         int ncuts) {
  mkdir(dir, 0755);
  int64_t at = 0;
  for (int i = 0; i <= ncuts; i++) {
    int64_t end = i < ncuts ? cuts[i] : n;
    char p[512];
    snprintf(p, sizeof p, "%s/%s_%06d.bin", dir, split, i);
    shard_write(p, tok + at, end - at);
    at = end;
  }
}

static bool same_ints(const int32_t *a, const int32_t *b, int n) { return !memcmp(a, b, sizeof(int32_t) * (size_t)n); }

static void test_packing(void) {
  uint16_t s[] = {0, 5, 6, 7, 0, 8, 9, 0, 10, 11, 12, 13, 14, 0, 15, 16, 17};
  const char *dir = path_in("pack");
  int64_t cut[] = {6};
  write_stream(dir, "train", s, 17, cut, 1);
  Loader *l = loader_open(dir, "train", (LoaderOptions){.B = 2, .T = 4, .vocab = 256, .pack = true});
  CHECK(l && loader_rows(l) == 4 && loader_tokens(l) == 17, "pack: 17 tokens, T = 4: 4 windows", "%lld windows",
        l ? (long long)loader_rows(l) : -1LL);
  if (!l)
    return;
  Batch b;
  loader_next(l, &b);
  int32_t tok1[] = {0, 5, 6, 7, 0, 8, 9, 0}, tgt1[] = {5, 6, 7, 0, 8, 9, 0, 10};
  int32_t doc1[] = {1, 1, 1, 1, 1, 1, 1, 2}, pos1[] = {0, 1, 2, 3, 0, 1, 2, 0};
  CHECK(same_ints(b.tokens, tok1, 8) && same_ints(b.targets, tgt1, 8), "pack: tokens and targets (shifted by one)",
        "row 1 starts %d %d", b.tokens[4], b.targets[4]);
  CHECK(same_ints(b.doc, doc1, 8), "pack: doc id = EOS count so far in the row", "%d %d %d %d", b.doc[4], b.doc[5],
        b.doc[6], b.doc[7]);
  CHECK(same_ints(b.pos, pos1, 8) && b.real_tokens == 8, "pack: pos restarts at each EOS; no padding", "%d %d %d %d",
        b.pos[4], b.pos[5], b.pos[6], b.pos[7]);
  loader_next(l, &b);
  int32_t tok2[] = {10, 11, 12, 13, 14, 0, 15, 16}, tgt2[] = {11, 12, 13, 14, 0, 15, 16, 17};
  int32_t doc2[] = {0, 0, 0, 0, 0, 1, 1, 1}, pos2[] = {0, 1, 2, 3, 0, 0, 1, 2};
  CHECK(same_ints(b.tokens, tok2, 8) && same_ints(b.targets, tgt2, 8) && same_ints(b.doc, doc2, 8) &&
            same_ints(b.pos, pos2, 8),
        "pack: a document from an earlier row counts pos from the row start", "%d %d %d %d", b.pos[0], b.pos[1],
        b.pos[5], b.pos[6]);
  LoaderState st = loader_state(l);
  CHECK(st.epoch == 1 && st.position == 0, "pack: the epoch wraps after 4 windows", "epoch %lld position %lld",
        (long long)st.epoch, (long long)st.position);
  loader_next(l, &b);
  CHECK(same_ints(b.tokens, tok1, 8), "pack: the next epoch starts over", "%d", b.tokens[1]);
  loader_close(l);
}

// A stream with unique token values (position + 1) but for EOS every 37th position.
static uint16_t *unique_stream(int64_t n) {
  uint16_t *s = malloc(sizeof *s * (size_t)n);
  for (int64_t i = 0; i < n; i++)
    s[i] = i % 37 == 0 ? TOK_EOS : (uint16_t)(i + 1);
  return s;
}

static void test_epoch_invariant(void) {
  int64_t N = 1203, T = 16, B = 5, W = (N - 1) / T;
  uint16_t *s = unique_stream(N);
  const char *dir = path_in("epoch");
  int64_t cuts[] = {100, 700};
  write_stream(dir, "train", s, N, cuts, 2);
  for (int shuffle = 0; shuffle < 2; shuffle++) {
    Loader *l = loader_open(dir, "train", (LoaderOptions){.B = B, .T = T, .vocab = 2000, .pack = true,
                                                          .shuffle = shuffle, .seed = 3});
    int *as_input = calloc((size_t)N + 1, sizeof(int)), *as_target = calloc((size_t)N + 1, sizeof(int));
    int zeros_in = 0, zeros_tgt = 0;
    bool consistent = true;
    int64_t rows = 0;
    Batch b;
    while (rows < W) {
      loader_next(l, &b);
      for (int64_t r = 0; r < B && rows < W; r++, rows++)
        for (int64_t t = 0; t < T; t++) {
          int32_t x = b.tokens[r * T + t], y = b.targets[r * T + t];
          if (x)
            as_input[x]++;
          else
            zeros_in++;
          if (y)
            as_target[y]++;
          else
            zeros_tgt++;
          // x at stream position p (x = p + 1, or EOS): its target is the token at p + 1.
          if (x && y)
            consistent &= y == x + 1;
        }
    }
    int64_t eos_in = 0, eos_tgt = 0;
    bool once = true;
    for (int64_t p = 0; p <= W * T; p++) {
      if (p < W * T) {
        if (s[p])
          once &= as_input[s[p]] == 1;
        else
          eos_in++;
      }
      if (p >= 1) {
        if (s[p])
          once &= as_target[s[p]] == 1;
        else
          eos_tgt++;
      }
    }
    for (int64_t p = W * T + 1; p < N; p++)
      once &= !s[p] || (as_input[s[p]] == 0 && as_target[s[p]] == 0);
    char name[96];
    snprintf(name, sizeof name, "loader (%s): over an epoch every token is an input once and a target once",
             shuffle ? "shuffled" : "in order");
    CHECK(once && eos_in == zeros_in && eos_tgt == zeros_tgt && consistent, name, "eos %lld/%d %lld/%d",
          (long long)eos_in, zeros_in, (long long)eos_tgt, zeros_tgt);
    free(as_input);
    free(as_target);
    loader_close(l);
  }
  free(s);
}

static void test_padded(void) {
  uint16_t s[] = {0, 1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 10, 0, 11};
  const char *dir = path_in("pad");
  write_stream(dir, "val", s, 14, NULL, 0);
  Loader *l = loader_open(dir, "val", (LoaderOptions){.B = 3, .T = 6, .vocab = 256, .pack = false});
  CHECK(l && loader_rows(l) == 3, "padded: one row per document", "%lld rows", l ? (long long)loader_rows(l) : -1LL);
  if (!l)
    return;
  Batch b;
  loader_next(l, &b);
  int32_t tok[] = {0, 1, 2, 3, 0, 0, 0, 4, 5, 6, 7, 8, 0, 11, 0, 0, 0, 0};
  int32_t tgt[] = {1, 2, 3, 0, -1, -1, 4, 5, 6, 7, 8, 9, 11, -1, -1, -1, -1, -1};
  int32_t doc[] = {0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1};
  int32_t pos[] = {0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5};
  CHECK(same_ints(b.tokens, tok, 18), "padded: each row is one document from its EOS, cut to T", "row 1: %d %d",
        b.tokens[6], b.tokens[11]);
  CHECK(same_ints(b.targets, tgt, 18), "padded: padding targets are -1 (and the stream's last token's)",
        "%d %d %d %d", b.targets[3], b.targets[4], b.targets[12], b.targets[13]);
  CHECK(same_ints(b.doc, doc, 18) && same_ints(b.pos, pos, 18), "padded: padding has doc 1, real tokens doc 0",
        "%d %d", b.doc[4], b.doc[13]);
  CHECK(b.real_tokens == 12, "padded: real_tokens counts non-padding positions", "%lld", (long long)b.real_tokens);
  loader_close(l);
}

static void take(Loader *l, int nbatches, int32_t *out, int64_t BT) {
  Batch b;
  for (int i = 0; i < nbatches; i++) {
    loader_next(l, &b);
    memcpy(out + i * 4 * BT, b.tokens, sizeof(int32_t) * (size_t)BT);
    memcpy(out + i * 4 * BT + BT, b.targets, sizeof(int32_t) * (size_t)BT);
    memcpy(out + i * 4 * BT + 2 * BT, b.pos, sizeof(int32_t) * (size_t)BT);
    memcpy(out + i * 4 * BT + 3 * BT, b.doc, sizeof(int32_t) * (size_t)BT);
  }
}

static void test_shuffle_and_seek(void) {
  int64_t N = 700, T = 8, B = 4, BT = B * T;
  uint16_t *s = unique_stream(N);
  const char *dir = path_in("shuf");
  write_stream(dir, "train", s, N, NULL, 0);
  int nb = 40; // 160 rows: past two epochs of 87 windows
  size_t bytes = sizeof(int32_t) * 4 * (size_t)(BT * nb);
  int32_t *x = malloc(bytes), *y = malloc(bytes), *z = malloc(bytes), *q = malloc(bytes);
  for (int pack = 1; pack >= 0; pack--) {
    LoaderOptions o = {.B = B, .T = T, .vocab = 1000, .pack = pack, .shuffle = true, .seed = 42};
    Loader *a = loader_open(dir, "train", o), *b2 = loader_open(dir, "train", o);
    take(a, nb, x, BT);
    take(b2, nb, y, BT);
    const char *mode = pack ? "packed" : "padded";
    char name[96];
    snprintf(name, sizeof name, "shuffle (%s): same seed, same batches", mode);
    CHECK(!memcmp(x, y, bytes), name, "differ");
    loader_close(a);
    loader_close(b2);
    o.seed = 43;
    a = loader_open(dir, "train", o);
    take(a, nb, z, BT);
    loader_close(a);
    snprintf(name, sizeof name, "shuffle (%s): another seed, another order", mode);
    CHECK(memcmp(x, z, bytes), name, "same batches");
    o.shuffle = false;
    a = loader_open(dir, "train", o);
    take(a, nb, q, BT);
    loader_close(a);
    snprintf(name, sizeof name, "shuffle (%s): not the sequential order", mode);
    CHECK(memcmp(x, q, bytes), name, "same batches");
    o.shuffle = true;
    o.seed = 42;

    // Resume: state after 15 batches, then 25 more; mid-epoch, and the run crosses epoch ends.
    a = loader_open(dir, "train", o);
    take(a, 15, z, BT);
    LoaderState st = loader_state(a);
    take(a, 25, z, BT);
    bool same_run = !memcmp(z, x + 15 * 4 * BT, sizeof(int32_t) * 4 * (size_t)(BT * 25));
    loader_seek(a, st);
    take(a, 25, q, BT);
    bool same_seek = !memcmp(q, z, sizeof(int32_t) * 4 * (size_t)(BT * 25));
    loader_close(a);
    a = loader_open(dir, "train", o);
    bool sought = loader_seek(a, st);
    take(a, 25, q, BT);
    bool same_fresh = sought && !memcmp(q, z, sizeof(int32_t) * 4 * (size_t)(BT * 25));
    snprintf(name, sizeof name, "resume (%s): loader_state + loader_seek give the same batches", mode);
    CHECK(same_run && same_seek && same_fresh, name, "run %d seek %d fresh %d (state %lld/%lld)", same_run, same_seek,
          same_fresh, (long long)st.epoch, (long long)st.position);
    capture_begin();
    bool bad = loader_seek(a, (LoaderState){0, loader_rows(a)});
    const char *err = capture_end();
    snprintf(name, sizeof name, "resume (%s): a position outside the split is an error", mode);
    CHECK(!bad && strstr(err, "cannot resume"), name, "%s", err);
    loader_close(a);
  }
  // Two epochs of one shuffled loader differ in order.
  Loader *a = loader_open(dir, "train", (LoaderOptions){.B = 87, .T = T, .vocab = 1000, .pack = true, .shuffle = true});
  Batch b;
  loader_next(a, &b);
  memcpy(x, b.tokens, sizeof(int32_t) * 87 * (size_t)T);
  loader_next(a, &b);
  CHECK(memcmp(x, b.tokens, sizeof(int32_t) * 87 * (size_t)T), "shuffle: each epoch has its own order", "same");
  loader_close(a);
  free(x);
  free(y);
  free(z);
  free(q);
  free(s);
}

static void test_loader_errors(void) {
  const char *dir = path_in("empty");
  mkdir(dir, 0755);
  capture_begin();
  Loader *l = loader_open(dir, "train", (LoaderOptions){.B = 1, .T = 4, .vocab = 256, .pack = true});
  const char *err = capture_end();
  CHECK(!l && strstr(err, "no train shards"), "loader: a folder without shards is an error", "%s", err);
  uint16_t s[] = {0, 1, 2, 3};
  write_stream(path_in("short"), "train", s, 4, NULL, 0);
  capture_begin();
  l = loader_open(path_in("short"), "train", (LoaderOptions){.B = 1, .T = 4, .vocab = 256, .pack = true});
  err = capture_end();
  CHECK(!l && strstr(err, "holds 4 tokens: a packed row of T = 4 needs 5"), "loader: too few tokens for a row", "%s",
        err);
  capture_begin();
  l = loader_open(path_in("short"), "train", (LoaderOptions){.B = 1, .T = 2, .vocab = 3, .pack = true});
  err = capture_end();
  CHECK(!l && strstr(err, "train_000000.bin: error: token 3 at index 3"), "loader: tokens >= V are found at open",
        "%s", err);
}

//
// prep, end to end.
//
static int64_t read_split(const char *dir, const char *split, int32_t **out) {
  char **paths;
  int n = shard_list(dir, split, &paths);
  int64_t total = 0;
  *out = NULL;
  for (int i = 0; i < n; i++) {
    Shard s;
    if (!shard_open(&s, paths[i], 0))
      continue;
    *out = realloc(*out, sizeof(int32_t) * (size_t)(total + s.n));
    for (int64_t k = 0; k < s.n; k++)
      (*out)[total + k] = s.tokens[k];
    total += s.n;
    shard_close(&s);
  }
  shard_list_free(paths, n);
  return total;
}

// The documents of a token stream (each starts with EOS), decoded, joined by "|".
static char *docs_of(const Tokenizer *t, const int32_t *ids, int64_t n, int *ndocs) {
  char *s = malloc(4 * (size_t)n + 16);
  size_t len = 0;
  *ndocs = 0;
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] == TOK_EOS) {
      if ((*ndocs)++)
        s[len++] = '|';
      continue;
    }
    len += tok_decode(t, &ids[i], 1, s + len, 16);
  }
  s[len] = 0;
  return s;
}

static void test_prep(void) {
  const char *in = path_in("corpus");
  mkdir(in, 0755);
  mkdir(path_in("corpus/a"), 0755);
  const char *one = "alpha one\n%\nbeta two\n%\n%\ngamma three\n";
  write_file(path_in("corpus/a/one.txt"), one, strlen(one));
  const char *jl = "{\"id\": 1, \"text\": \"delta \\u00e9\\n\", \"tags\": [1, {\"x\": null}]}\n"
                   "\n"
                   "{\"text\": \"epsilon \\ud83c\\udf89\", \"text\": \"ignored\"}\n"
                   "{\"meta\": {\"text\": \"nested is not the field\"}, \"text\": \"zeta\"}\n";
  write_file(path_in("corpus/b.jsonl"), jl, strlen(jl));
  write_file(path_in("corpus/c.txt"), "eta\n", 4);
  write_file(path_in("corpus/d.dat"), "\0\0\1binary", 9);
  write_file(path_in("corpus/.hidden"), "hidden", 6);
  CHECK(symlink("a/one.txt", path_in("corpus/e.txt")) == 0, "prep: the corpus's symbolic link is made", "%s",
        strerror(errno));
  PrepOptions o;
  prep_defaults(&o);
  o.input = in;
  o.out_dir = path_in("out");
  o.vocab = 270;
  o.doc_sep = "%";
  o.val_fraction = 0.25;
  capture_begin();
  int rc = prep_run(&o);
  const char *err = capture_end();
  CHECK(rc == 0 && strstr(err, "d.dat: note: skipped: not a text file"), "prep: a folder with text, JSONL, binary, a symlink",
        "rc %d: %s", rc, err);
  Tokenizer *t = tok_load(path_in("out/tokenizer.bin"));
  int32_t *train = NULL, *val = NULL;
  int64_t ntrain = read_split(o.out_dir, "train", &train), nval = read_split(o.out_dir, "val", &val);
  int dtrain = 0, dval = 0;
  char *st = t ? docs_of(t, train, ntrain, &dtrain) : NULL, *sv = t ? docs_of(t, val, nval, &dval) : NULL;
  // Documents in path order: a/one.txt (3), b.jsonl (3), c.txt (1), of 10, 9, 12, 9, 12, 4 and 4
  // bytes; a quarter of the 60 is 15: the first (10, nearer 15 than none) and the 6th (val 14 of 56
  // bytes with it) go to val.
  const char *want_train = "beta two\n|gamma three\n|delta \xC3\xA9\n|epsilon \xF0\x9F\x8E\x89|eta\n";
  const char *want_val = "alpha one\n|zeta";
  CHECK(t && tok_vocab(t) <= 270 && st && sv && !strcmp(st, want_train) && !strcmp(sv, want_val),
        "prep: every document once, EOS first, val by size, decoded back exactly", "train '%s' val '%s'",
        st ? st : "", sv ? sv : "");
  CHECK(train && val && train[0] == TOK_EOS && val[0] == TOK_EOS && dtrain == 5 && dval == 2,
        "prep: 5 train and 2 val documents", "%d %d", dtrain, dval);
  free(st);
  free(sv);
  free(train);
  free(val);
  tok_free(t);

  // A single text file is one document, cut in two for the val split.
  const char *book = "line one\nline two\nline three\nline four\n";
  write_file(path_in("book.txt"), book, strlen(book));
  o.input = path_in("book.txt");
  o.out_dir = path_in("out_book");
  o.doc_sep = NULL;
  o.vocab = 256;
  capture_begin();
  rc = prep_run(&o);
  capture_end();
  t = tok_load(path_in("out_book/tokenizer.bin"));
  ntrain = read_split(o.out_dir, "train", &train);
  nval = read_split(o.out_dir, "val", &val);
  st = t ? docs_of(t, train, ntrain, &dtrain) : NULL;
  sv = t ? docs_of(t, val, nval, &dval) : NULL;
  CHECK(rc == 0 && st && sv && !strcmp(st, "line one\nline two\nline three\n") && !strcmp(sv, "line four\n"),
        "prep: one document is cut at a line start for val", "train '%s' val '%s'", st ? st : "", sv ? sv : "");
  CHECK(ntrain == 1 + 29 && nval == 1 + 10, "prep: vocab 256 is one token per byte", "%lld %lld", (long long)ntrain,
        (long long)nval);
  free(st);
  free(sv);
  free(train);
  free(val);
  tok_free(t);

  // Shards of at most --shard-tokens tokens, read back as one stream by the loader.
  o.out_dir = path_in("out_small");
  o.shard_tokens = 7;
  capture_begin();
  rc = prep_run(&o);
  capture_end();
  char **paths;
  int nshards = shard_list(o.out_dir, "train", &paths);
  shard_list_free(paths, nshards);
  Loader *l = loader_open(o.out_dir, "train", (LoaderOptions){.B = 1, .T = 29, .vocab = 256, .pack = true});
  Batch b;
  bool ok = l && loader_next(l, &b);
  char text[32];
  Tokenizer *bytes = tok_new(NULL, 0, text, sizeof text);
  size_t m = ok ? tok_decode(bytes, b.targets, 29, text, sizeof text) : 0;
  tok_free(bytes);
  CHECK(rc == 0 && nshards == 5 && ok && m == 29 && !memcmp(text, book, 29),
        "prep: shards of --shard-tokens tokens, the loader joins them", "%d shards", nshards);
  loader_close(l);
}

// A tokenizer's bytes (what checkpoints store, in base64) parse back to the same tokenizer; base64
// round-trips every length and refuses what is not base64.
static void test_tokenizer_bytes(void) {
  uint32_t pairs[] = {'a', 'b', 256, 'c'};
  Tokenizer *t = tok_new(pairs, 2, NULL, 0);
  size_t n, m;
  unsigned char *bytes = tok_bytes(t, &n);
  char *text = rt_base64(bytes, n);
  unsigned char *back = rt_unbase64(text, &m);
  Tokenizer *u = back ? tok_parse(back, m, "stored") : NULL;
  const uint32_t *up = NULL;
  CHECK(u && m == n && !memcmp(back, bytes, n) && tok_merges(u, &up) == 2 && !memcmp(up, pairs, sizeof pairs),
        "tokenizer: its bytes through base64 parse back to the same merges", "%zu bytes, back %zu", n, m);
  free(bytes);
  free(text);
  free(back);
  tok_free(t);
  tok_free(u);
  const char *raw = "\x00\xffz1+/";
  bool all = true;
  for (size_t len = 0; len <= 6; len++) {
    char *b = rt_base64(raw, len);
    unsigned char *d = rt_unbase64(b, &m);
    all = all && strlen(b) == 4 * ((len + 2) / 3) && d && m == len && !memcmp(d, raw, len);
    free(b);
    free(d);
  }
  CHECK(all, "base64: lengths 0 to 6 round-trip", "one did not");
  const char *words[] = {"M", "Ma", "Man"}, *want[] = {"TQ==", "TWE=", "TWFu"};
  bool rfc = true;
  for (int i = 0; i < 3; i++) {
    char *b = rt_base64(words[i], strlen(words[i]));
    rfc = rfc && !strcmp(b, want[i]);
    free(b);
  }
  CHECK(rfc, "base64: RFC 4648's alphabet and padding", "no");
  const char *bad[] = {"TWF", "TW=u", "TWF*", "T===", "TQ==TWFu"};
  bool refused = true;
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    unsigned char *d = rt_unbase64(bad[i], &m);
    refused = refused && !d;
    free(d);
  }
  CHECK(refused, "base64: text that is not base64 is refused", "one was read");
}

int main(void) {
  snprintf(tmp, sizeof tmp, "/tmp/mdl_data_XXXXXX");
  if (!mkdtemp(tmp)) {
    perror("mkdtemp");
    return 1;
  }
  test_split();
  test_bpe_by_hand();
  test_bpe_against_naive();
  test_round_trip();
  test_tokenizer_file();
  test_tokenizer_bytes();
  test_shards();
  test_packing();
  test_epoch_invariant();
  test_padded();
  test_shuffle_and_seek();
  test_loader_errors();
  test_prep();
  nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  TEST_EXIT();
}
