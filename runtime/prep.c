// prep.c: `mdlc prep INPUT -o DIR`: text to llm.c token shards and a tokenizer file.
//
// INPUT is a text file, a *.jsonl file (one JSON object per line; its text field is a document),
// or a folder: every file under it, recursively, in path order; names starting with '.' are left
// out, files holding NUL bytes are skipped with a note (not text: fortune's *.dat indexes), and a
// file already seen (a symlink or hard link to it) is skipped. Each file is a document, unless
// --doc-sep STR splits it at the lines equal to STR (the separator lines are dropped). Empty
// documents are left out.
//
// Two passes over the input, each file memory-mapped:
//   1. read: find the documents, count them and their bytes, and (vocab > 256) count the words
//      the BPE trainer learns from. Every user error (bad JSONL line, no text) shows up here,
//      before anything is written. Then train the merges (on every document, val included).
//   2. encode: every document as EOS + its tokens, to the val split when its index is k-1 mod
//      k (k = round(1 / val fraction), at least 2, at most the document count) and otherwise to
//      train, cut into shards of at most --shard-tokens tokens. A corpus of a single document is
//      cut in two at a line start near the val fraction from its end: the tail is the val split.
// A progress bar goes to stderr when it is a terminal; the summary goes to stdout.
#include "data.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

void prep_defaults(PrepOptions *o) {
  *o = (PrepOptions){.vocab = 256, .text_field = "text", .val_fraction = 0.05, .shard_tokens = 100000000};
}

typedef struct {
  char *path;
  dev_t dev;
  ino_t ino;
  int64_t size;
  bool jsonl;
  bool skip; // not text (found in pass 1) or seen before
} InputFile;

typedef struct {
  char *s;
  size_t n, cap;
} Text;

typedef struct {
  const char *split;
  int index;      // of the open (or next) shard
  ShardWriter w;
  bool open;
  int64_t tokens, docs;
} SplitOut;

typedef struct {
  const PrepOptions *o;
  InputFile *files;
  int nfiles, capfiles;
  int skipped_binary, skipped_seen, skipped_other;
  int pass;              // 1 read, 2 encode
  int64_t ndocs, nbytes; // found in pass 1
  int64_t doc;           // pass 2: documents written
  int64_t k;             // every k-th document is val
  TokTrainer *trainer;
  Tokenizer *tok;
  TokBuf ids;
  uint16_t *u16;
  size_t capu16;
  SplitOut train, val;
  Text key, value;       // JSON string scratch
  // progress
  bool tty;
  double t0, pass_t0, last_draw;
  int64_t total_bytes, done_bytes;
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
// Finding the input files.
//
static void add_file(Prep *p, const char *path, const struct stat *st) {
  if (p->nfiles == p->capfiles) {
    p->capfiles = p->capfiles ? 2 * p->capfiles : 64;
    p->files = realloc(p->files, (size_t)p->capfiles * sizeof *p->files);
  }
  size_t n = strlen(path);
  p->files[p->nfiles++] = (InputFile){.path = strdup(path), .dev = st->st_dev, .ino = st->st_ino,
                                      .size = st->st_size, .jsonl = n > 6 && !strcmp(path + n - 6, ".jsonl")};
}

typedef struct {
  dev_t dev;
  ino_t ino;
} DirId;

// Every file under dir, recursively; a folder reached twice (through a symlink) is walked once.
static void walk(Prep *p, const char *dir, DirId **seen, int *nseen) {
  DIR *d = opendir(dir);
  if (!d) {
    note(p, dir, "skipped: cannot open the folder: %s", strerror(errno));
    p->skipped_other++;
    return;
  }
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.')
      continue;
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    char *path = malloc(len);
    snprintf(path, len, "%s/%s", dir, e->d_name);
    struct stat st;
    if (stat(path, &st)) {
      note(p, path, "skipped: %s", strerror(errno));
      p->skipped_other++;
    } else if (S_ISDIR(st.st_mode)) {
      bool again = false;
      for (int i = 0; i < *nseen; i++)
        again |= (*seen)[i].dev == st.st_dev && (*seen)[i].ino == st.st_ino;
      if (!again) {
        *seen = realloc(*seen, (size_t)(*nseen + 1) * sizeof **seen);
        (*seen)[(*nseen)++] = (DirId){st.st_dev, st.st_ino};
        walk(p, path, seen, nseen);
      }
    } else if (S_ISREG(st.st_mode)) {
      add_file(p, path, &st);
    } else {
      note(p, path, "skipped: %s", "not a regular file");
      p->skipped_other++;
    }
    free(path);
  }
  closedir(d);
}

static int compare_files(const void *a, const void *b) {
  return strcmp(((const InputFile *)a)->path, ((const InputFile *)b)->path);
}

// The input's files in path order, each file once; false after printing why.
static bool find_files(Prep *p) {
  const char *in = p->o->input;
  struct stat st;
  if (stat(in, &st)) {
    diag_file_error(in, "cannot open: %s", strerror(errno));
    return false;
  }
  if (!S_ISDIR(st.st_mode)) {
    if (!S_ISREG(st.st_mode)) {
      diag_file_error(in, "not a regular file or a folder");
      return false;
    }
    add_file(p, in, &st);
    return true;
  }
  size_t n = strlen(in);
  char *root = strndup(in, n > 1 && in[n - 1] == '/' ? n - 1 : n);
  DirId *seen = malloc(sizeof *seen);
  seen[0] = (DirId){st.st_dev, st.st_ino};
  int nseen = 1;
  walk(p, root, &seen, &nseen);
  free(seen);
  free(root);
  qsort(p->files, (size_t)p->nfiles, sizeof *p->files, compare_files);
  for (int i = 0; i < p->nfiles; i++)
    for (int j = 0; j < i && !p->files[i].skip; j++)
      if (!p->files[j].skip && p->files[j].dev == p->files[i].dev && p->files[j].ino == p->files[i].ino) {
        p->files[i].skip = true;
        p->skipped_seen++;
      }
  for (int i = 0; i < p->nfiles; i++)
    p->total_bytes += p->files[i].skip ? 0 : p->files[i].size;
  return true;
}

//
// JSON: just enough to take one string field out of each line's object.
//
typedef struct {
  const char *s, *end, *err;
} Json;

static void json_ws(Json *j) {
  while (j->s < j->end && (*j->s == ' ' || *j->s == '\t' || *j->s == '\r' || *j->s == '\n'))
    j->s++;
}

static void text_put(Text *t, const char *s, size_t n) {
  if (!t)
    return;
  if (t->n + n > t->cap) {
    t->cap = 2 * (t->n + n) + 256;
    t->s = realloc(t->s, t->cap);
  }
  memcpy(t->s + t->n, s, n);
  t->n += n;
}

static int json_hex4(Json *j) {
  if (j->end - j->s < 4)
    return -1;
  int v = 0;
  for (int i = 0; i < 4; i++) {
    char c = j->s[i];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0)
      return -1;
    v = 16 * v + d;
  }
  j->s += 4;
  return v;
}

// A string at j->s (after its opening quote has been checked), decoded into out (may be NULL).
static bool json_string(Json *j, Text *out) {
  j->s++;
  if (out)
    out->n = 0;
  while (j->s < j->end && *j->s != '"') {
    unsigned char c = (unsigned char)*j->s;
    if (c < 0x20) {
      j->err = "a control character inside a string";
      return false;
    }
    if (c != '\\') {
      const char *run = j->s;
      while (j->s < j->end && *j->s != '"' && *j->s != '\\' && (unsigned char)*j->s >= 0x20)
        j->s++;
      text_put(out, run, (size_t)(j->s - run));
      continue;
    }
    if (++j->s == j->end)
      break;
    char esc = *j->s++;
    const char *simple = strchr("\"\\/bfnrt", esc);
    if (simple && esc) {
      static const char value[] = "\"\\/\b\f\n\r\t";
      text_put(out, &value[simple - "\"\\/bfnrt"], 1);
      continue;
    }
    if (esc != 'u') {
      j->err = "a bad escape in a string";
      return false;
    }
    int cp = json_hex4(j);
    if (cp >= 0xD800 && cp < 0xDC00) {
      int lo = -1;
      if (j->end - j->s >= 2 && j->s[0] == '\\' && j->s[1] == 'u') {
        j->s += 2;
        lo = json_hex4(j);
      }
      cp = lo >= 0xDC00 && lo < 0xE000 ? 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00) : -1;
    } else if (cp >= 0xDC00 && cp < 0xE000) {
      cp = -1;
    }
    if (cp < 0) {
      j->err = "a bad \\u escape in a string";
      return false;
    }
    if (cp == 0) {
      j->err = "a NUL character (\\u0000) in a string: text never holds one";
      return false;
    }
    char u[4];
    size_t n;
    if (cp < 0x80) {
      u[0] = (char)cp;
      n = 1;
    } else if (cp < 0x800) {
      u[0] = (char)(0xC0 | cp >> 6);
      u[1] = (char)(0x80 | (cp & 0x3F));
      n = 2;
    } else if (cp < 0x10000) {
      u[0] = (char)(0xE0 | cp >> 12);
      u[1] = (char)(0x80 | (cp >> 6 & 0x3F));
      u[2] = (char)(0x80 | (cp & 0x3F));
      n = 3;
    } else {
      u[0] = (char)(0xF0 | cp >> 18);
      u[1] = (char)(0x80 | (cp >> 12 & 0x3F));
      u[2] = (char)(0x80 | (cp >> 6 & 0x3F));
      u[3] = (char)(0x80 | (cp & 0x3F));
      n = 4;
    }
    text_put(out, u, n);
  }
  if (j->s == j->end) {
    j->err = "an unterminated string";
    return false;
  }
  j->s++;
  return true;
}

static bool json_skip(Json *j, int depth) {
  json_ws(j);
  if (j->s == j->end) {
    j->err = "a value is missing";
    return false;
  }
  if (depth > 512) {
    j->err = "values nested too deeply";
    return false;
  }
  char c = *j->s;
  if (c == '"')
    return json_string(j, NULL);
  if (c == '{' || c == '[') {
    char close = c == '{' ? '}' : ']';
    j->s++;
    json_ws(j);
    if (j->s < j->end && *j->s == close) {
      j->s++;
      return true;
    }
    for (;;) {
      if (c == '{') {
        json_ws(j);
        if (j->s == j->end || *j->s != '"') {
          j->err = "an object key must be a string";
          return false;
        }
        if (!json_string(j, NULL))
          return false;
        json_ws(j);
        if (j->s == j->end || *j->s++ != ':') {
          j->err = "':' expected after an object key";
          return false;
        }
      }
      if (!json_skip(j, depth + 1))
        return false;
      json_ws(j);
      if (j->s < j->end && *j->s == ',') {
        j->s++;
        continue;
      }
      if (j->s < j->end && *j->s == close) {
        j->s++;
        return true;
      }
      j->err = c == '{' ? "',' or '}' expected in an object" : "',' or ']' expected in an array";
      return false;
    }
  }
  static const char *const words[] = {"true", "false", "null"};
  for (int i = 0; i < 3; i++) {
    size_t n = strlen(words[i]);
    if ((size_t)(j->end - j->s) >= n && !memcmp(j->s, words[i], n)) {
      j->s += n;
      return true;
    }
  }
  const char *start = j->s;
  while (j->s < j->end && strchr("+-.eE0123456789", *j->s) && *j->s)
    j->s++;
  if (j->s == start || !(start[0] == '-' || (start[0] >= '0' && start[0] <= '9'))) {
    j->err = "a value expected (string, number, object, array, true, false or null)";
    return false;
  }
  return true;
}

// The text field of one JSONL line into p->value; false with j->err when the line is bad.
static bool json_line_text(Prep *p, Json *j) {
  json_ws(j);
  if (j->s == j->end || *j->s++ != '{') {
    j->err = "not a JSON object";
    return false;
  }
  bool found = false;
  json_ws(j);
  if (j->s < j->end && *j->s == '}') {
    j->s++;
  } else {
    for (;;) {
      json_ws(j);
      if (j->s == j->end || *j->s != '"') {
        j->err = "an object key must be a string";
        return false;
      }
      if (!json_string(j, &p->key))
        return false;
      json_ws(j);
      if (j->s == j->end || *j->s++ != ':') {
        j->err = "':' expected after an object key";
        return false;
      }
      json_ws(j);
      bool wanted = !found && p->key.n == strlen(p->o->text_field) && !memcmp(p->key.s, p->o->text_field, p->key.n);
      if (wanted && (j->s == j->end || *j->s != '"')) {
        j->err = "the text field is not a string";
        return false;
      }
      if (wanted ? !json_string(j, &p->value) : !json_skip(j, 1))
        return false;
      found |= wanted;
      json_ws(j);
      if (j->s < j->end && *j->s == ',') {
        j->s++;
        continue;
      }
      if (j->s < j->end && *j->s == '}') {
        j->s++;
        break;
      }
      j->err = "',' or '}' expected in an object";
      return false;
    }
  }
  json_ws(j);
  if (j->s != j->end) {
    j->err = "text after the object";
    return false;
  }
  if (!found) {
    j->err = "no text field";
    return false;
  }
  return true;
}

//
// Documents.
//
static size_t cut_point(const char *s, size_t n, double f) {
  size_t want = n - (size_t)llround(f * (double)n);
  if (want >= n)
    want = n - 1;
  if (want < 1)
    want = 1;
  for (size_t i = want; i > want / 2; i--)
    if (s[i - 1] == '\n')
      return i;
  size_t i = want;
  while (i < n && ((unsigned char)s[i] & 0xC0) == 0x80)
    i++;
  return i < n ? i : want;
}

static bool put_tokens(SplitOut *out, const PrepOptions *o, const uint16_t *tok, size_t n) {
  while (n) {
    if (!out->open) {
      size_t len = strlen(o->out_dir) + 32;
      char *path = malloc(len);
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

// EOS + the document's tokens. Long documents are encoded a megabyte at a time, cut at word
// boundaries: each piece splits into the same words as the whole document.
static bool write_doc(Prep *p, SplitOut *out, const char *text, size_t n) {
  static const uint16_t eos = TOK_EOS;
  out->docs++;
  if (!put_tokens(out, p->o, &eos, 1))
    return false;
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j < n && j - i < (1 << 20))
      j = tok_word_end(text, n, j);
    p->ids.n = 0;
    tok_encode(p->tok, text + i, j - i, &p->ids);
    if (p->ids.n > p->capu16) {
      p->capu16 = p->ids.n;
      p->u16 = realloc(p->u16, p->capu16 * sizeof *p->u16);
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
  if (p->ndocs == 1) {
    size_t cut = cut_point(text, n, p->o->val_fraction);
    return write_doc(p, &p->train, text, cut) && write_doc(p, &p->val, text + cut, n - cut);
  }
  return write_doc(p, i % p->k == p->k - 1 ? &p->val : &p->train, text, n);
}

static void tick(Prep *p, int64_t file_done) {
  double done = (double)(p->done_bytes + file_done);
  if (p->total_bytes)
    draw(p, p->pass == 1 ? "reading" : "encoding", done / (double)p->total_bytes, done / (now_s() - p->pass_t0));
}

// The documents of one file's text.
static bool file_documents(Prep *p, const InputFile *f, const char *s, size_t n) {
  const char *end = s + n;
  if (f->jsonl) {
    int64_t line = 0;
    for (const char *at = s; at < end;) {
      const char *nl = memchr(at, '\n', (size_t)(end - at));
      const char *stop = nl ? nl : end;
      line++;
      Json j = {at, stop, NULL};
      json_ws(&j);
      if (j.s != stop) {
        if (!json_line_text(p, &j)) {
          size_t len = strlen(f->path) + 32;
          char *where = malloc(len);
          snprintf(where, len, "%s:%lld", f->path, (long long)line);
          diag_file_error(where, "%s", j.err);
          free(where);
          return false;
        }
        if (!document(p, p->value.s, p->value.n))
          return false;
      }
      at = nl ? nl + 1 : end;
      tick(p, at - s);
    }
    return true;
  }
  if (!p->o->doc_sep)
    return document(p, s, n);
  size_t seplen = strlen(p->o->doc_sep);
  const char *doc = s;
  for (const char *at = s; at < end;) {
    const char *nl = memchr(at, '\n', (size_t)(end - at));
    const char *stop = nl ? nl : end;
    size_t len = (size_t)(stop - at);
    if (len && at[len - 1] == '\r')
      len--;
    const char *next = nl ? nl + 1 : end;
    if (len == seplen && !memcmp(at, p->o->doc_sep, seplen)) {
      if (!document(p, doc, (size_t)(at - doc)))
        return false;
      doc = next;
      tick(p, next - s);
    }
    at = next;
  }
  return document(p, doc, (size_t)(end - doc));
}

// One pass over every file; false after printing why.
static bool read_pass(Prep *p) {
  bool single = p->nfiles == 1 && !strcmp(p->files[0].path, p->o->input);
  p->done_bytes = 0;
  p->pass_t0 = now_s();
  for (int i = 0; i < p->nfiles; i++) {
    InputFile *f = &p->files[i];
    if (f->skip)
      continue;
    int fd = open(f->path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) {
      diag_file_error(f->path, "cannot open: %s", strerror(errno));
      if (fd >= 0)
        close(fd);
      return false;
    }
    size_t n = (size_t)st.st_size;
    char *s = n ? mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
    close(fd);
    if (s == MAP_FAILED) {
      diag_file_error(f->path, "cannot map: %s", strerror(errno));
      return false;
    }
    bool ok = true;
    if (n && memchr(s, 0, n)) {
      if (single || p->pass == 2) {
        diag_file_error(f->path, "not a text file (it holds NUL bytes)");
        ok = false;
      } else {
        // The first few by name; the summary line counts them all.
        if (p->skipped_binary < 3)
          note(p, f->path, "skipped: %s", "not a text file (it holds NUL bytes)");
        else if (p->skipped_binary == 3)
          note(p, f->path, "skipped: %s", "not a text file (and so are any further ones; the summary counts them)");
        f->skip = true;
        p->skipped_binary++;
        p->total_bytes -= f->size;
      }
    } else {
      if (n)
        madvise(s, n, MADV_SEQUENTIAL);
      ok = file_documents(p, f, s, n);
      p->done_bytes += f->skip ? 0 : (int64_t)n;
    }
    if (n)
      munmap(s, n);
    if (!ok)
      return false;
  }
  return true;
}

//
// The output folder.
//
static bool make_dirs(const char *path) {
  char *p = strdup(path);
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

static void prep_free(Prep *p) {
  for (int i = 0; i < p->nfiles; i++)
    free(p->files[i].path);
  free(p->files);
  tok_trainer_free(p->trainer);
  tok_free(p->tok);
  free(p->ids.ids);
  free(p->u16);
  free(p->key.s);
  free(p->value.s);
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
  if (!find_files(&p))
    goto done;
  if (o->vocab > 256)
    p.trainer = tok_trainer_new();
  p.pass = 1;
  if (!read_pass(&p))
    goto done;
  draw_done(&p);
  if (!p.nbytes) {
    diag_file_error(in, "empty corpus: no text in %d file%s", p.nfiles, p.nfiles == 1 ? "" : "s");
    goto done;
  }
  if (p.ndocs == 1 && p.nbytes < 2) {
    diag_file_error(in, "one document of %lld byte: too little to hold out a validation part", (long long)p.nbytes);
    goto done;
  }
  p.k = llround(1 / o->val_fraction);
  if (p.k > p.ndocs)
    p.k = p.ndocs;
  if (p.k < 2)
    p.k = 2;

  if (p.trainer) {
    p.tok = tok_train(p.trainer, o->vocab, train_progress, &p);
    draw_done(&p);
  } else {
    char why[128];
    p.tok = tok_new(NULL, 0, why, sizeof why);
  }
  if (!make_dirs(o->out_dir))
    goto done;
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
  size_t len = strlen(o->out_dir) + 32;
  char *tokpath = malloc(len);
  snprintf(tokpath, len, "%s/tokenizer.bin", o->out_dir);
  ok = ok && tok_save(p.tok, tokpath);
  free(tokpath);
  if (!ok)
    goto done;
  int removed = remove_stale(&p, &p.train) + remove_stale(&p, &p.val);

  double dt = now_s() - p.t0;
  int64_t tokens = p.train.tokens + p.val.tokens, eos = p.train.docs + p.val.docs;
  char size[32];
  printf("prep: %lld document%s (%lld train, %lld val%s), %s of text from %d file%s", (long long)p.ndocs,
         p.ndocs == 1 ? "" : "s", (long long)p.train.docs, (long long)p.val.docs,
         p.ndocs == 1 ? ": the one document cut in two" : "", size_str(size, sizeof size, p.nbytes),
         p.nfiles - p.skipped_binary - p.skipped_seen, p.nfiles - p.skipped_binary - p.skipped_seen == 1 ? "" : "s");
  if (p.skipped_binary || p.skipped_seen || p.skipped_other)
    printf(" (skipped: %d not text, %d seen before, %d other)", p.skipped_binary, p.skipped_seen, p.skipped_other);
  printf("\nprep: %lld tokens (train %lld, val %lld), %.2f bytes per token (EOS not counted), vocab %d\n",
         (long long)tokens, (long long)p.train.tokens, (long long)p.val.tokens,
         (double)p.nbytes / (double)(tokens - eos), tok_vocab(p.tok));
  printf("prep: wrote %d train shard%s, %d val shard%s and tokenizer.bin to %s", count_shards(&p.train),
         count_shards(&p.train) == 1 ? "" : "s", count_shards(&p.val), count_shards(&p.val) == 1 ? "" : "s", o->out_dir);
  if (removed)
    printf(", removed %d old shard%s", removed, removed == 1 ? "" : "s");
  printf(" in %.2f s (%.1f MB/s)\n", dt, (double)p.nbytes / 1e6 / dt);
  rc = 0;
done:
  for (int i = 0; i < 2; i++) {
    SplitOut *s = i ? &p.val : &p.train;
    if (s->open)
      datafile_abort(&s->w.file);
  }
  prep_free(&p);
  return rc;
}
