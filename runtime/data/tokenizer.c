// tokenizer.c: byte-level BPE: the trainer, the encoder with its word cache, decode, and the
// tokenizer file.
//
// Text is first split into words (tok_word_end: runs of letters, digits or other bytes with
// their leading space, roughly as GPT-2 does), and merges never cross a word boundary.
//
// Training counts each distinct word once (a hash table of word -> count), then works on the
// word table: every adjacent pair has a count (summed over the words holding it, times their
// counts) and a list of the words that hold it. A merge of (a, b) into z visits only the words
// on (a, b)'s list: each word's pairs are taken out of the counts, the word is rewritten (left to
// right, non-overlapping), and its pairs are put back. The most frequent pair comes from a
// max-heap with lazy deletion: counts of old pairs only fall (every new pair holds the new id z),
// so an entry whose count is stale is pushed back with its true count when it surfaces, and the
// first entry that is current is the true maximum; ties go to the smallest (a, b).
//
// Encoding applies merges by rank: repeatedly merge the lowest-ranked pair present in the word.
// Each pair a merge creates holds its new id, so it ranks later: the result is exactly the word
// as training left it. Encoded words are cached (the cache is dropped when it grows large).
#include "data.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PIECE 65536          // bytes in one token, at most (a loaded file could ask for more)
#define CACHE_MAX_WORDS (1 << 20) // the encoder's cache is cleared beyond this

static void *tok_realloc(void *p, size_t n) {
  return xrealloc(p, n, "the tokenizer's tables");
}

static uint64_t mix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  return k ^ (k >> 33);
}

static uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t)a << 32 | b; }

//
// PairMap: (a, b) -> int32, open addressing. Keys are never UINT64_MAX (ids < 65536).
//
typedef struct {
  uint64_t *keys;
  int32_t *vals;
  size_t cap, n;
} PairMap;

static void pairmap_free(PairMap *m) {
  free(m->keys);
  free(m->vals);
  memset(m, 0, sizeof *m);
}

static size_t pairmap_find(const PairMap *m, uint64_t key) {
  size_t i = mix64(key) & (m->cap - 1);
  while (m->keys[i] != UINT64_MAX && m->keys[i] != key)
    i = (i + 1) & (m->cap - 1);
  return i;
}

static int32_t pairmap_get(const PairMap *m, uint64_t key) {
  if (!m->cap)
    return -1;
  size_t i = pairmap_find(m, key);
  return m->keys[i] == key ? m->vals[i] : -1;
}

static void pairmap_put(PairMap *m, uint64_t key, int32_t val) {
  if (2 * (m->n + 1) > m->cap) {
    PairMap big = {.cap = m->cap ? 2 * m->cap : 1024};
    big.keys = tok_realloc(NULL, big.cap * sizeof *big.keys);
    big.vals = tok_realloc(NULL, big.cap * sizeof *big.vals);
    memset(big.keys, 0xff, big.cap * sizeof *big.keys);
    for (size_t i = 0; i < m->cap; i++)
      if (m->keys[i] != UINT64_MAX) {
        size_t j = pairmap_find(&big, m->keys[i]);
        big.keys[j] = m->keys[i];
        big.vals[j] = m->vals[i];
      }
    big.n = m->n;
    pairmap_free(m);
    *m = big;
  }
  size_t i = pairmap_find(m, key);
  if (m->keys[i] != key) {
    m->keys[i] = key;
    m->n++;
  }
  m->vals[i] = val;
}

//
// WordMap: word bytes -> (val, val2), open addressing; the bytes live in one pool.
//
typedef struct {
  uint64_t hash;
  uint64_t off;  // in the pool
  uint32_t len;  // 0: empty slot (words are never empty)
  int32_t val2;
  int64_t val;
} WordEntry;

typedef struct {
  WordEntry *e;
  size_t cap, n;
  char *pool;
  size_t npool, cappool;
} WordMap;

static void wordmap_free(WordMap *m) {
  free(m->e);
  free(m->pool);
  memset(m, 0, sizeof *m);
}

static uint64_t hash_bytes(const char *s, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++)
    h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
  return mix64(h);
}

static size_t wordmap_slot(const WordMap *m, const char *w, uint32_t len, uint64_t h) {
  size_t i = h & (m->cap - 1);
  for (;;) {
    const WordEntry *e = &m->e[i];
    if (!e->len || (e->hash == h && e->len == len && !memcmp(m->pool + e->off, w, len)))
      return i;
    i = (i + 1) & (m->cap - 1);
  }
}

// The entry of word w, inserted with zero values when new.
static WordEntry *wordmap_get(WordMap *m, const char *w, uint32_t len) {
  if (2 * (m->n + 1) > m->cap) {
    size_t cap = m->cap ? 2 * m->cap : 4096;
    WordEntry *e = tok_realloc(NULL, cap * sizeof *e);
    memset(e, 0, cap * sizeof *e);
    for (size_t i = 0; i < m->cap; i++)
      if (m->e[i].len) {
        size_t j = m->e[i].hash & (cap - 1);
        while (e[j].len)
          j = (j + 1) & (cap - 1);
        e[j] = m->e[i];
      }
    free(m->e);
    m->e = e;
    m->cap = cap;
  }
  uint64_t h = hash_bytes(w, len);
  WordEntry *e = &m->e[wordmap_slot(m, w, len, h)];
  if (!e->len) {
    if (m->npool + len > m->cappool) {
      m->cappool = 2 * (m->npool + len) + 65536;
      m->pool = tok_realloc(m->pool, m->cappool);
    }
    memcpy(m->pool + m->npool, w, len);
    *e = (WordEntry){.hash = h, .off = m->npool, .len = len};
    m->npool += len;
    m->n++;
  }
  return e;
}

//
// Pre-splitting.
//
enum { CL_SPACE, CL_LETTER, CL_DIGIT, CL_OTHER };

static int byte_class(unsigned char c) {
  if (c == ' ' || (c >= '\t' && c <= '\r'))
    return CL_SPACE;
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80)
    return CL_LETTER;
  if (c >= '0' && c <= '9')
    return CL_DIGIT;
  return CL_OTHER;
}

size_t tok_word_end(const char *text, size_t n, size_t i) {
  const unsigned char *s = (const unsigned char *)text;
  size_t j = i;
  if (s[i] == ' ' && i + 1 < n && byte_class(s[i + 1]) != CL_SPACE) {
    j = i + 1;
  } else if (byte_class(s[i]) == CL_SPACE) {
    while (j < n && byte_class(s[j]) == CL_SPACE)
      j++;
    if (j < n && j - i > 1 && s[j - 1] == ' ')
      j--;
    return j - i > TOK_MAX_WORD ? i + TOK_MAX_WORD : j;
  }
  int cl = byte_class(s[j]);
  while (j < n && byte_class(s[j]) == cl)
    j++;
  return j - i > TOK_MAX_WORD ? i + TOK_MAX_WORD : j;
}

//
// The tokenizer.
//
struct Tokenizer {
  int nmerges;
  uint32_t *pairs;     // 2 per merge, rank order
  PairMap rank;        // (a, b) -> rank
  uint64_t *piece_off; // per id: its bytes in pieces
  uint32_t *piece_len;
  char *pieces;
  WordMap cache;       // word -> (offset in cache_ids, count)
  int32_t *cache_ids;
  size_t ncache_ids, capcache_ids;
};

Tokenizer *tok_new(const uint32_t *pairs, int nmerges, char *why, size_t nwhy) {
  if (nmerges < 0 || nmerges > TOK_MAX_VOCAB - 256) {
    snprintf(why, nwhy, "%d merges: the vocabulary would be outside 256..%d", nmerges, TOK_MAX_VOCAB);
    return NULL;
  }
  Tokenizer *t = tok_realloc(NULL, sizeof *t);
  memset(t, 0, sizeof *t);
  t->nmerges = nmerges;
  int vocab = 256 + nmerges;
  t->pairs = tok_realloc(NULL, 2 * (size_t)nmerges * sizeof *t->pairs);
  if (nmerges)
    memcpy(t->pairs, pairs, 2 * (size_t)nmerges * sizeof *t->pairs);
  t->piece_off = tok_realloc(NULL, (size_t)vocab * sizeof *t->piece_off);
  t->piece_len = tok_realloc(NULL, (size_t)vocab * sizeof *t->piece_len);
  size_t npieces = 0, cap = 4096;
  t->pieces = tok_realloc(NULL, cap);
  for (int id = 0; id < 256; id++) {
    t->piece_off[id] = npieces;
    t->piece_len[id] = id == TOK_EOS ? 0 : 1;
    t->pieces[npieces] = (char)id;
    npieces += t->piece_len[id];
  }
  for (int r = 0; r < nmerges; r++) {
    uint32_t a = pairs[2 * r], b = pairs[2 * r + 1], z = 256 + (uint32_t)r;
    if (a >= z || b >= z) {
      snprintf(why, nwhy, "merge %d (id %u) uses id %u, which is not defined before it", r, z, a >= z ? a : b);
      tok_free(t);
      return NULL;
    }
    if (a == TOK_EOS || b == TOK_EOS) {
      snprintf(why, nwhy, "merge %d (id %u) uses EOS (id 0), which text never holds", r, z);
      tok_free(t);
      return NULL;
    }
    int32_t dup = pairmap_get(&t->rank, pair_key(a, b));
    if (dup >= 0) {
      snprintf(why, nwhy, "merge %d (id %u) repeats merge %d (%u, %u)", r, z, dup, a, b);
      tok_free(t);
      return NULL;
    }
    pairmap_put(&t->rank, pair_key(a, b), r);
    size_t len = (size_t)t->piece_len[a] + t->piece_len[b];
    if (len > MAX_PIECE) {
      snprintf(why, nwhy, "merge %d (id %u) makes a token of %zu bytes (at most %d)", r, z, len, MAX_PIECE);
      tok_free(t);
      return NULL;
    }
    if (npieces + len > cap) {
      cap = 2 * (npieces + len);
      t->pieces = tok_realloc(t->pieces, cap);
    }
    memcpy(t->pieces + npieces, t->pieces + t->piece_off[a], t->piece_len[a]);
    memcpy(t->pieces + npieces + t->piece_len[a], t->pieces + t->piece_off[b], t->piece_len[b]);
    t->piece_off[z] = npieces;
    t->piece_len[z] = (uint32_t)len;
    npieces += len;
  }
  return t;
}

void tok_free(Tokenizer *t) {
  if (!t)
    return;
  free(t->pairs);
  pairmap_free(&t->rank);
  free(t->piece_off);
  free(t->piece_len);
  free(t->pieces);
  wordmap_free(&t->cache);
  free(t->cache_ids);
  free(t);
}

int tok_vocab(const Tokenizer *t) { return 256 + t->nmerges; }

int tok_merges(const Tokenizer *t, const uint32_t **pairs) {
  *pairs = t->pairs;
  return t->nmerges;
}

static void tokbuf_reserve(TokBuf *b, size_t more) {
  if (b->n + more > b->cap) {
    b->cap = 2 * (b->n + more) + 1024;
    b->ids = tok_realloc(b->ids, b->cap * sizeof *b->ids);
  }
}

// The ids of one word (len <= TOK_MAX_WORD) into sym; returns their count.
static int encode_word(const Tokenizer *t, const unsigned char *w, int len, int32_t *sym) {
  int n = len;
  for (int i = 0; i < n; i++)
    sym[i] = w[i];
  while (n >= 2) {
    int32_t best = INT32_MAX;
    for (int i = 0; i + 1 < n; i++) {
      int32_t r = pairmap_get(&t->rank, pair_key((uint32_t)sym[i], (uint32_t)sym[i + 1]));
      if (r >= 0 && r < best)
        best = r;
    }
    if (best == INT32_MAX)
      break;
    int32_t a = (int32_t)t->pairs[2 * best], b = (int32_t)t->pairs[2 * best + 1], z = 256 + best;
    int j = 0;
    for (int i = 0; i < n;) {
      if (i + 1 < n && sym[i] == a && sym[i + 1] == b) {
        sym[j++] = z;
        i += 2;
      } else {
        sym[j++] = sym[i++];
      }
    }
    n = j;
  }
  return n;
}

size_t tok_encode(Tokenizer *t, const char *text, size_t n, TokBuf *out) {
  size_t before = out->n;
  int32_t sym[TOK_MAX_WORD];
  for (size_t i = 0; i < n;) {
    size_t e = tok_word_end(text, n, i);
    uint32_t len = (uint32_t)(e - i);
    tokbuf_reserve(out, len);
    if (!t->nmerges || len == 1) {
      for (size_t k = i; k < e; k++)
        out->ids[out->n++] = (unsigned char)text[k];
      i = e;
      continue;
    }
    if (t->cache.n >= CACHE_MAX_WORDS) {
      wordmap_free(&t->cache);
      t->ncache_ids = 0;
    }
    WordEntry *we = wordmap_get(&t->cache, text + i, len);
    if (!we->val2) {
      int k = encode_word(t, (const unsigned char *)text + i, (int)len, sym);
      if (t->ncache_ids + (size_t)k > t->capcache_ids) {
        t->capcache_ids = 2 * (t->ncache_ids + (size_t)k) + 4096;
        t->cache_ids = tok_realloc(t->cache_ids, t->capcache_ids * sizeof *t->cache_ids);
      }
      memcpy(t->cache_ids + t->ncache_ids, sym, (size_t)k * sizeof *sym);
      we->val = (int64_t)t->ncache_ids;
      we->val2 = k;
      t->ncache_ids += (size_t)k;
    }
    memcpy(out->ids + out->n, t->cache_ids + we->val, (size_t)we->val2 * sizeof *out->ids);
    out->n += (size_t)we->val2;
    i = e;
  }
  return out->n - before;
}

size_t tok_decode(const Tokenizer *t, const int32_t *ids, size_t n, char *out, size_t cap) {
  static const char replacement[] = "\xEF\xBF\xBD"; // U+FFFD
  size_t total = 0;
  for (size_t i = 0; i < n; i++) {
    const char *p = replacement;
    size_t len = 3;
    if (ids[i] >= 0 && ids[i] < tok_vocab(t)) {
      p = t->pieces + t->piece_off[ids[i]];
      len = t->piece_len[ids[i]];
    }
    for (size_t k = 0; k < len; k++, total++)
      if (total < cap)
        out[total] = p[k];
  }
  return total;
}

//
// The tokenizer file.
//
static const char tok_magic[8] = "MDLTOK1";

static void put_u32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get_u32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

unsigned char *tok_bytes(const Tokenizer *t, size_t *n) {
  *n = 16 + 8 * (size_t)t->nmerges;
  unsigned char *buf = tok_realloc(NULL, *n);
  memcpy(buf, tok_magic, 8);
  put_u32(buf + 8, (uint32_t)tok_vocab(t));
  put_u32(buf + 12, (uint32_t)t->nmerges);
  for (int i = 0; i < 2 * t->nmerges; i++)
    put_u32(buf + 16 + 4 * i, t->pairs[i]);
  return buf;
}

bool tok_save(const Tokenizer *t, const char *path) {
  size_t n;
  unsigned char *buf = tok_bytes(t, &n);
  DataFile f;
  bool ok = datafile_open(&f, path);
  if (ok && fwrite(buf, 1, n, f.f) != n) {
    diag_file_error(path, "cannot write: %s", strerror(errno));
    datafile_abort(&f);
    ok = false;
  } else if (ok) {
    ok = datafile_commit(&f);
  }
  free(buf);
  return ok;
}

Tokenizer *tok_load(const char *path) {
  char why[256];
  size_t n;
  unsigned char *buf = (unsigned char *)file_read(path, &n, 16 + 8 * (size_t)(TOK_MAX_VOCAB - 256), why, sizeof why);
  if (!buf) {
    diag_file_error(path, "%s", why);
    return NULL;
  }
  Tokenizer *t = tok_parse(buf, n, path);
  free(buf);
  return t;
}

Tokenizer *tok_parse(const unsigned char *buf, size_t n, const char *name) {
  Tokenizer *t = NULL;
  char why[256];
  if (n < 16) {
    diag_file_error(name, "truncated: %zu bytes, a tokenizer file has at least 16", n);
  } else if (memcmp(buf, tok_magic, 8)) {
    diag_file_error(name, "not a tokenizer file (bad magic; want \"MDLTOK1\")");
  } else {
    uint32_t vocab = get_u32(buf + 8), nmerges = get_u32(buf + 12);
    size_t want = 16 + 8 * (size_t)nmerges;
    if (vocab < 256 || vocab > TOK_MAX_VOCAB) {
      diag_file_error(name, "vocab %u is outside 256..%d", vocab, TOK_MAX_VOCAB);
    } else if (nmerges != vocab - 256) {
      diag_file_error(name, "vocab %u does not match 256 + %u merges", vocab, nmerges);
    } else if (n < want) {
      diag_file_error(name, "truncated: %u merges need %zu bytes, file holds %zu", nmerges, want, n);
    } else if (n > want) {
      diag_file_error(name, "%zu bytes after the %u merges", n - want, nmerges);
    } else {
      uint32_t *pairs = tok_realloc(NULL, 2 * (size_t)nmerges * sizeof *pairs);
      for (size_t i = 0; i < 2 * (size_t)nmerges; i++)
        pairs[i] = get_u32(buf + 16 + 4 * i);
      t = tok_new(pairs, (int)nmerges, why, sizeof why);
      if (!t)
        diag_file_error(name, "%s", why);
      free(pairs);
    }
  }
  return t;
}

//
// The trainer.
//
struct TokTrainer {
  WordMap words; // word -> count
};

TokTrainer *tok_trainer_new(void) {
  TokTrainer *tr = tok_realloc(NULL, sizeof *tr);
  memset(tr, 0, sizeof *tr);
  return tr;
}

void tok_trainer_free(TokTrainer *tr) {
  if (!tr)
    return;
  wordmap_free(&tr->words);
  free(tr);
}

void tok_trainer_add(TokTrainer *tr, const char *text, size_t n) {
  for (size_t i = 0; i < n;) {
    size_t e = tok_word_end(text, n, i);
    wordmap_get(&tr->words, text + i, (uint32_t)(e - i))->val++;
    i = e;
  }
}

typedef struct {
  int64_t count;
  uint64_t key;
} HeapEntry;

// Training state: the word table, the pairs with their counts and word lists, the heap.
typedef struct {
  int32_t *sym;      // every word's symbols, one after another
  int64_t *woff;     // per word: offset in sym
  int32_t *wlen;
  int64_t *wcount;
  int32_t *wstamp;   // per word: the last merge that visited it
  int64_t nwords;
  PairMap index;     // (a, b) -> pair number
  uint64_t *pkey;
  int64_t *pcount;
  int32_t **plist;   // words holding the pair (stale entries allowed)
  int32_t *plen, *pcap;
  int32_t *pstamp;   // the last merge that collected it as a new pair
  int32_t npairs, cappairs;
  HeapEntry *heap;
  size_t nheap, capheap;
} Train;

static bool heap_before(HeapEntry x, HeapEntry y) {
  return x.count > y.count || (x.count == y.count && x.key < y.key);
}

static void heap_push(Train *s, int64_t count, uint64_t key) {
  if (s->nheap == s->capheap) {
    s->capheap = s->capheap ? 2 * s->capheap : 4096;
    s->heap = tok_realloc(s->heap, s->capheap * sizeof *s->heap);
  }
  size_t i = s->nheap++;
  s->heap[i] = (HeapEntry){count, key};
  while (i && heap_before(s->heap[i], s->heap[(i - 1) / 2])) {
    HeapEntry tmp = s->heap[i];
    s->heap[i] = s->heap[(i - 1) / 2];
    s->heap[(i - 1) / 2] = tmp;
    i = (i - 1) / 2;
  }
}

static HeapEntry heap_pop(Train *s) {
  HeapEntry top = s->heap[0];
  s->heap[0] = s->heap[--s->nheap];
  for (size_t i = 0;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < s->nheap && heap_before(s->heap[l], s->heap[m]))
      m = l;
    if (r < s->nheap && heap_before(s->heap[r], s->heap[m]))
      m = r;
    if (m == i)
      break;
    HeapEntry tmp = s->heap[i];
    s->heap[i] = s->heap[m];
    s->heap[m] = tmp;
    i = m;
  }
  return top;
}

static int32_t pair_of(Train *s, uint32_t a, uint32_t b) {
  uint64_t key = pair_key(a, b);
  int32_t p = pairmap_get(&s->index, key);
  if (p >= 0)
    return p;
  if (s->npairs == s->cappairs) {
    s->cappairs = s->cappairs ? 2 * s->cappairs : 4096;
    size_t c = (size_t)s->cappairs;
    s->pkey = tok_realloc(s->pkey, c * sizeof *s->pkey);
    s->pcount = tok_realloc(s->pcount, c * sizeof *s->pcount);
    s->plist = tok_realloc(s->plist, c * sizeof *s->plist);
    s->plen = tok_realloc(s->plen, c * sizeof *s->plen);
    s->pcap = tok_realloc(s->pcap, c * sizeof *s->pcap);
    s->pstamp = tok_realloc(s->pstamp, c * sizeof *s->pstamp);
  }
  p = s->npairs++;
  s->pkey[p] = key;
  s->pcount[p] = 0;
  s->plist[p] = NULL;
  s->plen[p] = s->pcap[p] = 0;
  s->pstamp[p] = -1;
  pairmap_put(&s->index, key, p);
  return p;
}

// Adds sign x the word's count to each of its pairs; with sign > 0 also lists the word on them.
static void count_word_pairs(Train *s, int32_t w, int sign) {
  const int32_t *sym = s->sym + s->woff[w];
  for (int i = 0; i + 1 < s->wlen[w]; i++) {
    int32_t p = pair_of(s, (uint32_t)sym[i], (uint32_t)sym[i + 1]);
    s->pcount[p] += sign * s->wcount[w];
    if (sign > 0 && (!s->plen[p] || s->plist[p][s->plen[p] - 1] != w)) {
      if (s->plen[p] == s->pcap[p]) {
        s->pcap[p] = s->pcap[p] ? 2 * s->pcap[p] : 4;
        s->plist[p] = tok_realloc(s->plist[p], (size_t)s->pcap[p] * sizeof **s->plist);
      }
      s->plist[p][s->plen[p]++] = w;
    }
  }
}

static void train_free(Train *s) {
  free(s->sym);
  free(s->woff);
  free(s->wlen);
  free(s->wcount);
  free(s->wstamp);
  pairmap_free(&s->index);
  for (int32_t p = 0; p < s->npairs; p++)
    free(s->plist[p]);
  free(s->pkey);
  free(s->pcount);
  free(s->plist);
  free(s->plen);
  free(s->pcap);
  free(s->pstamp);
  free(s->heap);
}

// Merges (a, b) into z in every word holding it; pushes the pairs that hold z onto the heap.
static void apply_merge(Train *s, int32_t pab, int32_t z) {
  uint32_t a = (uint32_t)(s->pkey[pab] >> 32), b = (uint32_t)s->pkey[pab];
  // (a, b)'s list does not grow during the merge: no word holds (a, b) after it.
  const int32_t *list = s->plist[pab];
  int32_t nlist = s->plen[pab];
  int32_t *fresh = NULL;
  int32_t nfresh = 0, capfresh = 0;
  for (int32_t k = 0; k < nlist; k++) {
    int32_t w = list[k];
    if (s->wstamp[w] == z)
      continue;
    s->wstamp[w] = z;
    int32_t *sym = s->sym + s->woff[w];
    int32_t n = s->wlen[w];
    bool holds = false;
    for (int32_t i = 0; i + 1 < n && !holds; i++)
      holds = (uint32_t)sym[i] == a && (uint32_t)sym[i + 1] == b;
    if (!holds)
      continue;
    count_word_pairs(s, w, -1);
    int32_t j = 0;
    for (int32_t i = 0; i < n;) {
      if (i + 1 < n && (uint32_t)sym[i] == a && (uint32_t)sym[i + 1] == b) {
        sym[j++] = z;
        i += 2;
      } else {
        sym[j++] = sym[i++];
      }
    }
    s->wlen[w] = j;
    count_word_pairs(s, w, +1);
    for (int32_t i = 0; i + 1 < j; i++) {
      if (sym[i] != z && sym[i + 1] != z)
        continue;
      int32_t p = pairmap_get(&s->index, pair_key((uint32_t)sym[i], (uint32_t)sym[i + 1]));
      if (s->pstamp[p] == z)
        continue;
      s->pstamp[p] = z;
      if (nfresh == capfresh) {
        capfresh = capfresh ? 2 * capfresh : 64;
        fresh = tok_realloc(fresh, (size_t)capfresh * sizeof *fresh);
      }
      fresh[nfresh++] = p;
    }
  }
  for (int32_t k = 0; k < nfresh; k++)
    heap_push(s, s->pcount[fresh[k]], s->pkey[fresh[k]]);
  free(fresh);
}

Tokenizer *tok_train(TokTrainer *tr, int vocab, void (*progress)(void *ctx, int done, int total), void *ctx) {
  if (vocab < 256 || vocab > TOK_MAX_VOCAB)
    return NULL;
  Train s = {0};
  const WordMap *m = &tr->words;
  s.sym = tok_realloc(NULL, m->npool * sizeof *s.sym);
  s.woff = tok_realloc(NULL, m->n * sizeof *s.woff);
  s.wlen = tok_realloc(NULL, m->n * sizeof *s.wlen);
  s.wcount = tok_realloc(NULL, m->n * sizeof *s.wcount);
  s.wstamp = tok_realloc(NULL, m->n * sizeof *s.wstamp);
  int64_t nsym = 0;
  for (size_t i = 0; i < m->cap; i++) {
    const WordEntry *e = &m->e[i];
    if (!e->len)
      continue;
    int64_t w = s.nwords++;
    s.woff[w] = nsym;
    s.wlen[w] = (int32_t)e->len;
    s.wcount[w] = e->val;
    s.wstamp[w] = -1;
    for (uint32_t k = 0; k < e->len; k++)
      s.sym[nsym++] = (unsigned char)m->pool[e->off + k];
  }
  for (int64_t w = 0; w < s.nwords; w++)
    count_word_pairs(&s, (int32_t)w, +1);
  for (int32_t p = 0; p < s.npairs; p++)
    heap_push(&s, s.pcount[p], s.pkey[p]);
  int want = vocab - 256, nmerges = 0;
  uint32_t *pairs = tok_realloc(NULL, 2 * (size_t)want * sizeof *pairs);
  while (nmerges < want && s.nheap) {
    HeapEntry top = heap_pop(&s);
    int32_t p = pairmap_get(&s.index, top.key);
    if (top.count != s.pcount[p]) {
      if (s.pcount[p] > 0)
        heap_push(&s, s.pcount[p], top.key);
      continue;
    }
    if (top.count < 2)
      break;
    pairs[2 * nmerges] = (uint32_t)(top.key >> 32);
    pairs[2 * nmerges + 1] = (uint32_t)top.key;
    apply_merge(&s, p, 256 + nmerges);
    nmerges++;
    if (progress && (nmerges % 64 == 0 || nmerges == want))
      progress(ctx, nmerges, want);
  }
  train_free(&s);
  char why[256];
  Tokenizer *t = tok_new(pairs, nmerges, why, sizeof why);
  free(pairs);
  return t;
}
