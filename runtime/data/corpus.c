// corpus.c: the documents of a text input, found as `mdlc prep` finds them, and DIR/source.txt,
// prep's record of the text it read and how it split it.
//
// Prep reads the documents twice (to count them and train the BPE merges, then to encode them);
// `mdlc run --tokenize-on-the-fly` reads them a third time, as it trains. All three go through
// this file: the same walk over a folder, the same JSONL parser, the same --doc-sep rule, the
// same train/val split and the same cuts of long documents, so the third read sees exactly the
// documents, split for split and piece for piece, that went into the shards.
//
// source.txt holds what decides that (the input, --doc-sep, --text-field, --val-fraction), every
// file read with its size and modification time, and each split's document and token counts. The
// reader walks the input again and compares: a file added, gone or changed since prep is an error
// that names it, rather than batches that quietly differ from the shards'.
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

//
// Finding the input files.
//
static void add_file(Corpus *c, const char *path, const struct stat *st) {
  if (c->nfiles == c->cap) {
    c->cap = c->cap ? 2 * c->cap : 64;
    c->files = xrealloc(c->files, (size_t)c->cap * sizeof *c->files, "the list of text files");
  }
  size_t n = strlen(path);
  c->files[c->nfiles++] = (CorpusFile){.path = xstrdup(path, "the list of text files"), .dev = st->st_dev, .ino = st->st_ino,
                                       .size = st->st_size,
                                       .mtime_ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec,
                                       .jsonl = n > 6 && !strcmp(path + n - 6, ".jsonl")};
}

typedef struct {
  dev_t dev;
  ino_t ino;
} DirId;

// Every file under dir, recursively; a folder reached twice (through a symlink) is walked once.
static void walk(Corpus *c, const char *dir, DirId **seen, int *nseen, bool quiet) {
  DIR *d = opendir(dir);
  if (!d) {
    if (!quiet)
      diag_note((SrcLoc){.file = dir}, "skipped: cannot open the folder: %s", strerror(errno));
    c->skipped_other++;
    return;
  }
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.')
      continue;
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    char *path = xmalloc(len, "a file's path");
    snprintf(path, len, "%s/%s", dir, e->d_name);
    struct stat st;
    if (stat(path, &st)) {
      if (!quiet)
        diag_note((SrcLoc){.file = path}, "skipped: %s", strerror(errno));
      c->skipped_other++;
    } else if (S_ISDIR(st.st_mode)) {
      bool again = false;
      for (int i = 0; i < *nseen; i++)
        again |= (*seen)[i].dev == st.st_dev && (*seen)[i].ino == st.st_ino;
      if (!again) {
        *seen = xrealloc(*seen, (size_t)(*nseen + 1) * sizeof **seen, "the list of folders");
        (*seen)[(*nseen)++] = (DirId){st.st_dev, st.st_ino};
        walk(c, path, seen, nseen, quiet);
      }
    } else if (S_ISREG(st.st_mode)) {
      add_file(c, path, &st);
    } else {
      if (!quiet)
        diag_note((SrcLoc){.file = path}, "skipped: %s", "not a regular file");
      c->skipped_other++;
    }
    free(path);
  }
  closedir(d);
}

static int compare_files(const void *a, const void *b) {
  return strcmp(((const CorpusFile *)a)->path, ((const CorpusFile *)b)->path);
}

bool corpus_find(Corpus *c, const char *input, bool quiet) {
  memset(c, 0, sizeof *c);
  struct stat st;
  if (stat(input, &st)) {
    diag_file_error(input, "cannot open: %s", strerror(errno));
    return false;
  }
  size_t n = strlen(input);
  c->root = xstrndup(input, n > 1 && input[n - 1] == '/' ? n - 1 : n, "the corpus's path");
  if (!S_ISDIR(st.st_mode)) {
    if (!S_ISREG(st.st_mode)) {
      diag_file_error(input, "not a regular file or a folder");
      return false;
    }
    add_file(c, input, &st);
    c->total_bytes = st.st_size;
    return true;
  }
  c->folder = true;
  DirId *seen = xmalloc(sizeof *seen, "the list of folders");
  seen[0] = (DirId){st.st_dev, st.st_ino};
  int nseen = 1;
  walk(c, c->root, &seen, &nseen, quiet);
  free(seen);
  qsort(c->files, (size_t)c->nfiles, sizeof *c->files, compare_files);
  for (int i = 0; i < c->nfiles; i++)
    for (int j = 0; j < i && !c->files[i].skip; j++)
      if (!c->files[j].skip && c->files[j].dev == c->files[i].dev && c->files[j].ino == c->files[i].ino) {
        c->files[i].skip = c->files[i].seen = true;
        c->skipped_seen++;
      }
  for (int i = 0; i < c->nfiles; i++)
    c->total_bytes += c->files[i].skip ? 0 : c->files[i].size;
  return true;
}

void corpus_free(Corpus *c) {
  for (int i = 0; i < c->nfiles; i++)
    free(c->files[i].path);
  free(c->files);
  free(c->root);
  memset(c, 0, sizeof *c);
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

static void text_put(CorpusText *t, const char *s, size_t n) {
  if (!t)
    return;
  if (t->n + n > t->cap) {
    t->cap = 2 * (t->n + n) + 256;
    t->s = xrealloc(t->s, t->cap, "a document's text");
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
static bool json_string(Json *j, CorpusText *out) {
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
      json_ws(j);
      if (c == '{') {
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

// The text field of one JSONL line into r->value; false with j->err when the line is bad.
static bool json_line_text(DocReader *r, Json *j) {
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
      if (!json_string(j, &r->key))
        return false;
      json_ws(j);
      if (j->s == j->end || *j->s++ != ':') {
        j->err = "':' expected after an object key";
        return false;
      }
      json_ws(j);
      bool wanted = !found && r->key.n == strlen(r->text_field) && !memcmp(r->key.s, r->text_field, r->key.n);
      if (wanted && (j->s == j->end || *j->s != '"')) {
        j->err = "the text field is not a string";
        return false;
      }
      if (wanted ? !json_string(j, &r->value) : !json_skip(j, 1))
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
// The documents of one file.
//
bool docs_open(DocReader *r, const char *path, bool jsonl) {
  docs_close(r);
  char why[256];
  int64_t size;
  struct stat st;
  int fd = file_open(path, O_RDONLY, &size, why, sizeof why);
  if (fd < 0 || fstat(fd, &st)) {
    diag_file_error(path, "%s", fd < 0 ? why : strerror(errno));
    if (fd >= 0)
      close(fd);
    return false;
  }
  size_t n = (size_t)size;
  char *s = n ? mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
  close(fd);
  if (s == MAP_FAILED) {
    diag_file_error(path, "cannot map: %s", strerror(errno));
    return false;
  }
  if (n)
    madvise(s, n, MADV_SEQUENTIAL);
  r->path = path;
  r->jsonl = jsonl;
  r->map = s;
  r->n = n;
  r->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
  r->at = r->doc = s;
  r->line = 0;
  r->done = false;
  return true;
}

// The next document of a JSONL file: the text field of its next line that is not blank.
static int next_jsonl(DocReader *r, const char **text, size_t *n) {
  const char *end = r->map + r->n;
  while (r->at < end) {
    const char *nl = memchr(r->at, '\n', (size_t)(end - r->at));
    const char *stop = nl ? nl : end;
    r->line++;
    Json j = {r->at, stop, NULL};
    r->at = nl ? nl + 1 : end;
    json_ws(&j);
    if (j.s == stop)
      continue;
    if (!json_line_text(r, &j)) {
      size_t len = strlen(r->path) + 32;
      char *where = xmalloc(len, "a file's path");
      snprintf(where, len, "%s:%lld", r->path, (long long)r->line);
      diag_file_error(where, "%s", j.err);
      free(where);
      return -1;
    }
    if (r->value.n) {
      *text = r->value.s;
      *n = r->value.n;
      return 1;
    }
  }
  r->done = true;
  return 0;
}

int docs_next(DocReader *r, const char **text, size_t *n) {
  if (r->done)
    return 0;
  if (r->jsonl)
    return next_jsonl(r, text, n);
  const char *end = r->map + r->n;
  if (!r->doc_sep) {
    r->done = true;
    r->at = end;
    *text = r->map;
    *n = r->n;
    return r->n > 0;
  }
  size_t seplen = strlen(r->doc_sep);
  while (r->at < end) {
    const char *nl = memchr(r->at, '\n', (size_t)(end - r->at));
    const char *stop = nl ? nl : end;
    size_t len = (size_t)(stop - r->at);
    if (len && r->at[len - 1] == '\r')
      len--;
    const char *line = r->at, *doc = r->doc;
    r->at = nl ? nl + 1 : end;
    if (len == seplen && !memcmp(line, r->doc_sep, seplen)) {
      r->doc = r->at;
      if (line > doc) {
        *text = doc;
        *n = (size_t)(line - doc);
        return 1;
      }
    }
  }
  r->done = true;
  *text = r->doc;
  *n = (size_t)(end - r->doc);
  return *n > 0;
}

DocPos docs_tell(const DocReader *r) {
  return (DocPos){.at = r->done ? (int64_t)r->n : (int64_t)(r->at - r->map), .line = r->line};
}

void docs_seek(DocReader *r, DocPos p) {
  r->at = r->doc = r->map + p.at;
  r->line = p.line;
  r->done = false;
}

void docs_close(DocReader *r) {
  if (r->map && r->n)
    munmap((void *)r->map, r->n);
  r->map = NULL;
  r->n = 0;
  r->path = NULL;
}

void docs_free(DocReader *r) {
  docs_close(r);
  free(r->key.s);
  free(r->value.s);
  r->key = r->value = (CorpusText){0};
}

//
// The split and the pieces.
//
CorpusSplit corpus_split(int64_t ndocs, int64_t bytes, double val_fraction) {
  return (CorpusSplit){.ndocs = ndocs, .bytes = bytes, .val_fraction = val_fraction};
}

// Whether document i of several, n bytes, goes to val: when val's bytes with it are nearer the
// fraction of the bytes so far than without it (val + n/2 below f * bytes), which spreads val over
// the input; when val has none yet and it brings val nearer f * the input's bytes (few documents
// of unequal sizes: three files of 2.5, 5 and 20 kB give the first to val, not the last); the last
// when none went (a val split is never empty). Train is never empty: past val's first document, one
// goes to val only while val holds fewer bytes than train.
static bool to_val(const CorpusSplit *s, const CorpusTally *t, int64_t i, size_t n) {
  double val = (double)t->val_bytes, f = s->val_fraction;
  if (t->val_bytes == 0 && (i == s->ndocs - 1 || 2 * val + (double)n < 2 * f * (double)s->bytes))
    return true;
  return 2 * val + (double)n < 2 * f * (double)(t->bytes + (int64_t)n);
}

void corpus_tally(const CorpusSplit *s, CorpusTally *t, int64_t i, size_t n) {
  if (s->ndocs > 1 && to_val(s, t, i, n))
    t->val_bytes += (int64_t)n;
  t->bytes += (int64_t)n;
}

// Where a single document is cut: at a line start near the val fraction from its end.
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

bool corpus_part(const CorpusSplit *s, const CorpusTally *t, int64_t i, bool val, const char *text, size_t n,
                 size_t *off, size_t *len) {
  if (s->ndocs == 1) {
    size_t cut = cut_point(text, n, s->val_fraction);
    *off = val ? cut : 0;
    *len = val ? n - cut : cut;
    return true;
  }
  *off = 0;
  *len = n;
  return to_val(s, t, i, n) == val;
}

size_t corpus_piece_end(const char *text, size_t n, size_t i) {
  size_t j = i;
  while (j < n && j - i < (1 << 20))
    j = tok_word_end(text, n, j);
  return j;
}

//
// DIR/source.txt.
//
// A value to the end of the line: '\\', newlines and other control bytes escaped.
static void put_value(FILE *f, const char *s) {
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '\\')
      fputs("\\\\", f);
    else if (c == '\n')
      fputs("\\n", f);
    else if (c < 0x20 || c == 0x7f)
      fprintf(f, "\\x%02x", c);
    else
      fputc(c, f);
  }
  fputc('\n', f);
}

// Undoes put_value in place; false on a bad escape.
static bool unescape(char *s) {
  char *out = s;
  for (; *s; s++) {
    if (*s != '\\') {
      *out++ = *s;
      continue;
    }
    s++;
    if (*s == '\\' || *s == 'n') {
      *out++ = *s == 'n' ? '\n' : '\\';
    } else if (*s == 'x' && s[1] && s[2]) {
      char hex[3] = {s[1], s[2], 0}, *end;
      long v = strtol(hex, &end, 16);
      if (*end || v <= 0)
        return false;
      *out++ = (char)v;
      s += 2;
    } else {
      return false;
    }
  }
  *out = 0;
  return true;
}

static void source_path(const char *dir, char *path, size_t n) { snprintf(path, n, "%s/source.txt", dir); }

bool source_write(const char *dir, const Source *s) {
  char path[PATH_MAX + 16];
  source_path(dir, path, sizeof path);
  DataFile d;
  if (!datafile_open(&d, path))
    return false;
  FILE *f = d.f;
  fprintf(f, "format %s\n", SOURCE_FORMAT);
  fprintf(f, "# The text `mdlc prep` made the shards beside this file from, and how it split it: what\n"
             "# `mdlc run --tokenize-on-the-fly` reads again. Files: text|binary (skipped), bytes, mtime, path.\n");
  fputs("input ", f);
  put_value(f, s->input);
  if (s->doc_sep) {
    fputs("doc-sep ", f);
    put_value(f, s->doc_sep);
  }
  fputs("text-field ", f);
  put_value(f, s->text_field);
  char frac[32]; // the shortest that reads back as the same double
  for (int digits = 1; digits <= 17; digits++) {
    snprintf(frac, sizeof frac, "%.*g", digits, s->split.val_fraction);
    if (strtod(frac, NULL) == s->split.val_fraction)
      break;
  }
  fprintf(f, "val-fraction %s\ndocuments %lld\nbytes %lld\nsplit by-size\n", frac, (long long)s->split.ndocs,
          (long long)s->split.bytes);
  fprintf(f, "train %lld documents %lld tokens\nval %lld documents %lld tokens\n", (long long)s->docs[0],
          (long long)s->tokens[0], (long long)s->docs[1], (long long)s->tokens[1]);
  for (int i = 0; i < s->nfiles; i++) {
    const CorpusFile *c = &s->files[i];
    fprintf(f, "file %s %lld %lld.%09lld ", c->binary ? "binary" : "text", (long long)c->size,
            (long long)(c->mtime_ns / 1000000000), (long long)(c->mtime_ns % 1000000000));
    put_value(f, c->path);
  }
  if (ferror(f)) {
    diag_file_error(path, "cannot write: %s", strerror(errno));
    datafile_abort(&d);
    return false;
  }
  return datafile_commit(&d);
}

// One "file KIND SIZE S.NS PATH" line's fields after "file "; false when malformed.
static bool parse_file(char *v, CorpusFile *c) {
  char kind[8];
  int skip = 0;
  long long size, sec, ns;
  if (sscanf(v, "%7s %lld %lld.%lld %n", kind, &size, &sec, &ns, &skip) != 4 || !skip || !v[skip] ||
      (strcmp(kind, "text") && strcmp(kind, "binary")) || !unescape(v + skip))
    return false;
  size_t n = strlen(v + skip);
  *c = (CorpusFile){.path = xstrdup(v + skip, "the list of text files"), .size = size, .mtime_ns = sec * 1000000000 + ns,
                    .jsonl = n > 6 && !strcmp(v + skip + n - 6, ".jsonl"), .binary = !strcmp(kind, "binary")};
  c->skip = c->binary;
  return true;
}

bool source_read(const char *dir, Source *s) {
  memset(s, 0, sizeof *s);
  char path[PATH_MAX + 16];
  source_path(dir, path, sizeof path);
  char why[256];
  int64_t size;
  FILE *f = file_fopen(path, "r", &size, why, sizeof why);
  if (!f) {
    if (errno == ENOENT)
      diag_file_error(path, "not found: the shards in %s do not say what text they came from (prepared before "
                      "`mdlc prep` recorded it, or made elsewhere, as llm.c's are); prepare the text again with "
                      "`mdlc prep INPUT -o %s --force`", dir, dir);
    else
      diag_file_error(path, "%s", why);
    return false;
  }
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  int lineno = 0, cap_files = 0;
  bool ok = true, format = false, have_split = false;
  int64_t ndocs = -1, bytes = -1;
  bool by_size = false;
  double frac = NAN;
  while (ok && (len = getline(&line, &cap, f)) > 0) {
    lineno++;
    if (line[len - 1] == '\n')
      line[--len] = 0;
    if (!len || line[0] == '#')
      continue;
    char *v = strchr(line, ' ');
    if (!v) {
      ok = false;
      break;
    }
    *v++ = 0;
    long long a, b;
    if (!strcmp(line, "format")) {
      format = !strcmp(v, SOURCE_FORMAT);
      if (!format) {
        diag_file_error(path, "format '%s': this mdlc reads %s (another version of prep wrote it: run `mdlc prep` again)", v,
                        SOURCE_FORMAT);
        free(line);
        fclose(f);
        return false;
      }
    } else if (!strcmp(line, "input") || !strcmp(line, "doc-sep") || !strcmp(line, "text-field")) {
      char **dst = line[0] == 'i' ? &s->input : line[0] == 'd' ? &s->doc_sep : &s->text_field;
      free(*dst);
      *dst = xstrdup(v, "the source list's settings");
      ok = unescape(*dst);
    } else if (!strcmp(line, "val-fraction")) {
      char *end;
      frac = strtod(v, &end);
      ok = !*end && frac > 0 && frac <= 0.5;
    } else if (!strcmp(line, "documents")) {
      ok = sscanf(v, "%lld", &a) == 1 && a > 0;
      ndocs = a;
    } else if (!strcmp(line, "bytes")) {
      ok = sscanf(v, "%lld", &a) == 1 && a > 0;
      bytes = a;
    } else if (!strcmp(line, "split")) {
      ok = by_size = !strcmp(v, "by-size");
    } else if (!strcmp(line, "train") || !strcmp(line, "val")) {
      int i = line[0] == 'v';
      ok = sscanf(v, "%lld documents %lld tokens", &a, &b) == 2 && a >= 0 && b >= 0;
      s->docs[i] = a;
      s->tokens[i] = b;
      have_split |= i;
    } else if (!strcmp(line, "file")) {
      if (s->nfiles == cap_files) {
        cap_files = cap_files ? 2 * cap_files : 64;
        s->files = xrealloc(s->files, (size_t)cap_files * sizeof *s->files, "the list of text files");
      }
      ok = parse_file(v, &s->files[s->nfiles]);
      s->nfiles += ok;
    }
  }
  free(line);
  fclose(f);
  if (!ok) {
    diag_file_error(path, "line %d is not what `mdlc prep` writes", lineno);
    source_free(s);
    return false;
  }
  if (!format || !s->input || !s->text_field || isnan(frac) || ndocs < 0 || bytes < 0 || !by_size || !have_split ||
      !s->nfiles) {
    diag_file_error(path, "incomplete: it lacks the %s", !format ? "format line" : !s->input ? "input"
                    : !s->text_field ? "text field" : isnan(frac) ? "val fraction" : ndocs < 0 ? "document count" : bytes < 0 ? "byte count"
                    : !by_size || !have_split ? "split" : "files");
    source_free(s);
    return false;
  }
  s->split = corpus_split(ndocs, bytes, frac);
  if (s->docs[0] + s->docs[1] != (ndocs == 1 ? 2 : ndocs)) {
    diag_file_error(path, "its split does not add up (%lld documents, %lld train, %lld val)", (long long)ndocs,
                    (long long)s->docs[0], (long long)s->docs[1]);
    source_free(s);
    return false;
  }
  return true;
}

static void format_mtime(int64_t ns, char *buf, size_t n) {
  time_t t = (time_t)(ns / 1000000000);
  struct tm tm;
  localtime_r(&t, &tm);
  size_t len = strftime(buf, n, "%Y-%m-%d %H:%M:%S", &tm);
  snprintf(buf + len, n - len, ".%09lld", (long long)(ns % 1000000000));
}

bool source_same_file(const CorpusFile *then, int64_t size, int64_t mtime_ns, const char *dir) {
  if (size == then->size && mtime_ns == then->mtime_ns)
    return true;
  char path[PATH_MAX + 16], a[64], b[64];
  source_path(dir, path, sizeof path);
  format_mtime(mtime_ns, a, sizeof a);
  format_mtime(then->mtime_ns, b, sizeof b);
  diag_file_error(then->path, "changed since `mdlc prep` read it: %lld bytes modified %s, prep read %lld bytes "
                  "modified %s (%s); prepare it again (`mdlc prep ... --force`) to train on it", (long long)size, a,
                  (long long)then->size, b, path);
  return false;
}

bool source_check(const Source *s, const char *dir) {
  char path[PATH_MAX + 16];
  source_path(dir, path, sizeof path);
  struct stat st;
  if (stat(s->input, &st)) {
    diag_file_error(s->input, "cannot open: %s: the input `mdlc prep` read (%s) has moved or gone since",
                    strerror(errno), path);
    return false;
  }
  Corpus c;
  bool ok = corpus_find(&c, s->input, true);
  int i = 0, j = 0; // c.files[i], s->files[j]
  const char *again = "; prepare it again (`mdlc prep ... --force`) to train on it";
  while (ok && (i < c.nfiles || j < s->nfiles)) {
    if (i < c.nfiles && c.files[i].seen) {
      i++;
      continue;
    }
    const CorpusFile *now = i < c.nfiles ? &c.files[i] : NULL, *then = j < s->nfiles ? &s->files[j] : NULL;
    int order = !now ? 1 : !then ? -1 : strcmp(now->path, then->path);
    if (order < 0) {
      diag_file_error(now->path, "added to the input since `mdlc prep` read it (%s)%s", path, again);
      ok = false;
    } else if (order > 0) {
      diag_file_error(then->path, "gone from the input since `mdlc prep` read it (%s)%s", path, again);
      ok = false;
    } else if (!source_same_file(then, now->size, now->mtime_ns, dir)) {
      ok = false;
    } else if (!then->binary && access(now->path, R_OK)) {
      diag_file_error(now->path, "cannot read: %s", strerror(errno));
      ok = false;
    }
    i++;
    j++;
  }
  corpus_free(&c);
  return ok;
}

void source_free(Source *s) {
  free(s->input);
  free(s->doc_sep);
  free(s->text_field);
  for (int i = 0; i < s->nfiles; i++)
    free(s->files[i].path);
  free(s->files);
  memset(s, 0, sizeof *s);
}
