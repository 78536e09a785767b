// corpus.c: the documents of a text input, found as `mdlc prep` finds them: the walk over a
// folder, the JSONL parser, the --doc-sep rule, the train/val split and the cuts of long documents
// into the pieces they are encoded in. Prep reads the documents twice (to count them and train the
// BPE merges, then to encode them), both times through the reader here.
#include "data.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

//
// Finding the input files.
//
static void add_file(Corpus *c, const char *path, const struct stat *st) {
  if (c->nfiles == c->cap) {
    c->cap = c->cap ? 2 * c->cap : 64;
    c->files = realloc(c->files, (size_t)c->cap * sizeof *c->files);
  }
  size_t n = strlen(path);
  c->files[c->nfiles++] = (CorpusFile){.path = strdup(path), .dev = st->st_dev, .ino = st->st_ino,
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
    char *path = malloc(len);
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
        *seen = realloc(*seen, (size_t)(*nseen + 1) * sizeof **seen);
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
  c->root = strndup(input, n > 1 && input[n - 1] == '/' ? n - 1 : n);
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
  DirId *seen = malloc(sizeof *seen);
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
  int fd = open(path, O_RDONLY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st)) {
    diag_file_error(path, "cannot open: %s", strerror(errno));
    if (fd >= 0)
      close(fd);
    return false;
  }
  size_t n = (size_t)st.st_size;
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
      char *where = malloc(len);
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
CorpusSplit corpus_split(int64_t ndocs, double val_fraction) {
  int64_t k = llround(1 / val_fraction);
  if (k > ndocs)
    k = ndocs;
  if (k < 2)
    k = 2;
  return (CorpusSplit){.ndocs = ndocs, .k = k, .val_fraction = val_fraction};
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

bool corpus_part(const CorpusSplit *s, int64_t i, bool val, const char *text, size_t n, size_t *off, size_t *len) {
  if (s->ndocs == 1) {
    size_t cut = cut_point(text, n, s->val_fraction);
    *off = val ? cut : 0;
    *len = val ? n - cut : cut;
    return true;
  }
  *off = 0;
  *len = n;
  return (i % s->k == s->k - 1) == val;
}

size_t corpus_piece_end(const char *text, size_t n, size_t i) {
  size_t j = i;
  while (j < n && j - i < (1 << 20))
    j = tok_word_end(text, n, j);
  return j;
}
