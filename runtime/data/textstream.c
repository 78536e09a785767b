// textstream.c: one split's token stream read from the text `mdlc prep` made the shards from
// (DIR/source.txt), each document encoded with DIR/tokenizer.bin when a read reaches it: what
// `mdlc run --tokenize-on-the-fly` trains on instead of the shards.
//
// The stream is the shards' stream by construction: corpus.c's reader finds the documents as
// prep's passes did, corpus_part assigns them (or the halves of a single one) to the splits as
// prep did, and each is EOS followed by its text's tokens, encoded piece by piece at the cuts
// prep made (corpus_piece_end) with the merges prep saved.
//
// A cursor goes forward over the documents, file by file, and keeps the split's tokens from the
// start of the last read on: a read that starts at or after the last one's start (packed rows in
// order) encodes what it needs beyond them, each document once; a read further back (the next
// epoch, a resumed run) starts over from the first document. Memory: the tokens since the last
// read's start and one piece (a megabyte of text at most) under way; never the whole split.
// Documents by index (padded rows) skip the documents before them without encoding them, or, with
// an index of where each starts (made at open, for shuffled rows), jump there.
#include "data.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

// Where one of the split's documents is read from.
typedef struct {
  int file;     // in src.files
  DocPos pos;   // docs_seek there, and docs_next returns it
  int64_t gdoc; // its index among all the input's documents
  CorpusTally tally; // the split of the documents before it
} DocStart;

struct TextStream {
  char *dir;
  const char *split;
  bool val;
  Source src;
  Tokenizer *tok;
  DocReader r;
  int file;       // the file r has open, or -1
  int next_file;  // the next to open when it runs out
  int64_t gdoc;   // the input's documents the cursor has passed
  CorpusTally tally; // and how they were split
  int64_t doc;    // the split's documents it has taken: the index of the next
  DocStart last;  // where the document taken last starts
  // The document under way: its part in the split, and where its next piece starts.
  bool in_doc;
  const char *part;
  size_t part_n, piece;
  TokBuf buf;     // stream[base, base + buf.n)
  int64_t base;
  DocStart *index; // per document of the split, when indexed
};

static void rewind_stream(TextStream *s) {
  docs_close(&s->r);
  s->file = -1;
  s->next_file = 0;
  s->gdoc = s->doc = 0;
  s->tally = (CorpusTally){0, 0};
  s->in_doc = false;
  s->buf.n = 0;
  s->base = 0;
}

static bool open_file(TextStream *s, int f) {
  const CorpusFile *cf = &s->src.files[f];
  s->file = -1;
  if (!docs_open(&s->r, cf->path, cf->jsonl) || !source_same_file(cf, (int64_t)s->r.n, s->r.mtime_ns, s->dir)) {
    docs_close(&s->r);
    return false;
  }
  s->file = f;
  s->next_file = f + 1;
  return true;
}

// The input's next document: 1 (where it starts in s->last), 0 after the last, -1 after printing why.
static int next_input_doc(TextStream *s, const char **text, size_t *n) {
  for (;;) {
    if (s->file >= 0) {
      DocPos pos = docs_tell(&s->r);
      int rc = docs_next(&s->r, text, n);
      if (rc < 0)
        return -1;
      if (rc > 0) {
        s->last = (DocStart){.file = s->file, .pos = pos, .gdoc = s->gdoc++, .tally = s->tally};
        return 1;
      }
      docs_close(&s->r);
      s->file = -1;
    }
    while (s->next_file < s->src.nfiles && s->src.files[s->next_file].binary)
      s->next_file++;
    if (s->next_file == s->src.nfiles) {
      if (s->gdoc != s->src.split.ndocs) {
        diag_file_error(s->src.input, "holds %lld documents where `mdlc prep` found %lld", (long long)s->gdoc,
                        (long long)s->src.split.ndocs);
        return -1;
      }
      return 0;
    }
    if (!open_file(s, s->next_file))
      return -1;
  }
}

// The split's next document becomes the one under way: 1, 0 after the last, -1 after printing why.
static int next_split_doc(TextStream *s) {
  for (;;) {
    const char *text;
    size_t n, off, len;
    int rc = next_input_doc(s, &text, &n);
    if (rc <= 0)
      return rc;
    bool taken = corpus_part(&s->src.split, &s->tally, s->last.gdoc, s->val, text, n, &off, &len);
    corpus_tally(&s->src.split, &s->tally, s->last.gdoc, n);
    if (taken) {
      s->doc++;
      s->part = text + off;
      s->part_n = len;
      s->piece = 0;
      s->in_doc = true;
      return 1;
    }
  }
}

static void put_eos(TokBuf *b) {
  if (b->n == b->cap) {
    b->cap = b->cap ? 2 * b->cap : 4096;
    b->ids = xrealloc(b->ids, b->cap * sizeof *b->ids, "a document's tokens");
  }
  b->ids[b->n++] = TOK_EOS;
}

// Appends the stream's next tokens (a document's EOS, or its next piece's tokens): 1, 0 at the end
// of the split, -1 after printing why.
static int produce(TextStream *s) {
  for (;;) {
    if (!s->in_doc) {
      int rc = next_split_doc(s);
      if (rc > 0)
        put_eos(&s->buf);
      return rc;
    }
    if (s->piece < s->part_n) {
      size_t end = corpus_piece_end(s->part, s->part_n, s->piece);
      tok_encode(s->tok, s->part + s->piece, end - s->piece, &s->buf);
      s->piece = end;
      return 1;
    }
    s->in_doc = false;
  }
}

static bool ran_out(const TextStream *s, const char *what) {
  diag_file_error(s->src.input, "gives the %s split of %s fewer %s than `mdlc prep` wrote (%lld tokens, %lld "
                  "documents): the input or tokenizer.bin changed since", s->split, s->dir, what,
                  (long long)s->src.tokens[s->val], (long long)s->src.docs[s->val]);
  return false;
}

bool textstream_read(TextStream *s, int64_t start, int64_t n, int32_t *dst) {
  if (start < s->base)
    rewind_stream(s);
  for (;;) {
    // Tokens before start are wanted no more: dropped once they are half of those held or more.
    int64_t drop = start - s->base;
    if (drop > (int64_t)s->buf.n)
      drop = (int64_t)s->buf.n;
    if (drop > 0 && 2 * drop >= (int64_t)s->buf.n) {
      memmove(s->buf.ids, s->buf.ids + drop, sizeof *s->buf.ids * (s->buf.n - (size_t)drop));
      s->buf.n -= (size_t)drop;
      s->base += drop;
    }
    if (s->base + (int64_t)s->buf.n >= start + n)
      break;
    int rc = produce(s);
    if (rc <= 0)
      return rc == 0 ? ran_out(s, "tokens") : false;
  }
  memcpy(dst, s->buf.ids + (start - s->base), sizeof *dst * (size_t)n);
  return true;
}

bool textstream_doc(TextStream *s, int64_t d, int64_t n, int32_t *dst, int64_t *got) {
  if (s->index) {
    const DocStart *at = &s->index[d];
    if (s->file != at->file && !open_file(s, at->file))
      return false;
    docs_seek(&s->r, at->pos);
    s->gdoc = at->gdoc;
    s->tally = at->tally;
    s->doc = d;
  } else if (d < s->doc) {
    rewind_stream(s);
  }
  s->buf.n = 0;
  s->base = INT64_MAX; // (the tokens held are no longer the stream's from some start)
  int rc = 1;
  while (rc > 0 && s->doc <= d)
    rc = next_split_doc(s);
  if (rc <= 0)
    return rc == 0 ? ran_out(s, "documents") : false;
  put_eos(&s->buf);
  while ((int64_t)s->buf.n < n && s->piece < s->part_n) {
    size_t end = corpus_piece_end(s->part, s->part_n, s->piece);
    tok_encode(s->tok, s->part + s->piece, end - s->piece, &s->buf);
    s->piece = end;
  }
  s->in_doc = false;
  *got = (int64_t)s->buf.n < n ? (int64_t)s->buf.n : n;
  memcpy(dst, s->buf.ids, sizeof *dst * (size_t)*got);
  return true;
}

// Where each of the split's documents starts: one pass over the text, encoding nothing.
static bool build_index(TextStream *s) {
  int64_t ndocs = s->src.docs[s->val];
  s->index = xrealloc(NULL, sizeof *s->index * (size_t)(ndocs + 1), "the documents' index");
  int rc;
  while ((rc = next_split_doc(s)) > 0) {
    if (s->doc > ndocs)
      break;
    s->index[s->doc - 1] = s->last;
  }
  if (rc < 0)
    return false;
  if (s->doc != ndocs) {
    diag_file_error(s->src.input, "gives the %s split of %s %lld documents where `mdlc prep` wrote %lld: the input "
                    "changed since", s->split, s->dir, (long long)s->doc, (long long)ndocs);
    return false;
  }
  rewind_stream(s);
  return true;
}

TextStream *textstream_open(const char *dir, const char *split, int64_t vocab, bool index) {
  TextStream *s = xcalloc(1, sizeof *s, "the text stream");
  s->dir = xstrdup(dir, "the text stream");
  s->split = !strcmp(split, "val") ? "val" : "train";
  s->val = !strcmp(split, "val");
  s->file = -1;
  bool ok = source_read(dir, &s->src) && source_check(&s->src, dir);
  if (ok) {
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/tokenizer.bin", dir);
    ok = (s->tok = tok_load(path)) != NULL;
    if (ok && tok_vocab(s->tok) > vocab) {
      diag_file_error(path, "%d tokens, more than the model's V = %lld", tok_vocab(s->tok), (long long)vocab);
      ok = false;
    }
  }
  if (ok) {
    s->r.doc_sep = s->src.doc_sep;
    s->r.text_field = s->src.text_field;
    ok = !index || build_index(s);
  }
  if (!ok) {
    textstream_close(s);
    return NULL;
  }
  return s;
}

int64_t textstream_tokens(const TextStream *s) { return s->src.tokens[s->val]; }

int64_t textstream_docs(const TextStream *s) { return s->src.docs[s->val]; }

void textstream_close(TextStream *s) {
  if (!s)
    return;
  docs_free(&s->r);
  source_free(&s->src);
  tok_free(s->tok);
  free(s->buf.ids);
  free(s->index);
  free(s->dir);
  free(s);
}
