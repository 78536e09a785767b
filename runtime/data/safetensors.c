// safetensors.c: reads and writes safetensors files, the format for weights, gradients, checkpoints
// and batches. Layout: an 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the data area, which the tensors' [begin, end) ranges must tile exactly (no overlap, no hole).
//
// The reader parses the header with a small JSON parser of its own (a tree in the caller's arena),
// checks every field against the file (lengths, dtypes, offsets, sizes) before it reads any data,
// then reads each tensor into its own arena block, so data is aligned whatever the file's offsets.
// The writer emits the header in the given tensor order, padded with spaces to a multiple of
// 8 bytes, to "path.tmp.<pid>", fsyncs it and renames it over the path, so a reader never sees a
// half-written file. Every failure is reported as "path: reason".
#include "mdl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this file assumes a little-endian host"
#endif

//
// JSON: just enough for a safetensors header.
//

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } JKind;

typedef struct JVal {
  JKind kind;
  const char *key;     // member name, for a member of an object
  const char *str;     // J_STR, decoded
  bool is_int;         // J_NUM without fraction or exponent that fits in int64
  int64_t i;           // J_NUM when is_int
  struct JVal *child;  // J_ARR / J_OBJ: first element
  struct JVal *next;   // next element of the parent
} JVal;

typedef struct {
  Arena *a;
  const char *s, *p, *end;
  char err[160];
  int depth;
} JParser;

static JVal *jfail(JParser *j, const char *what) {
  if (!j->err[0])
    snprintf(j->err, sizeof j->err, "bad header JSON at byte %td: %s", j->p - j->s, what);
  return NULL;
}

static void skip_ws(JParser *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
    j->p++;
}

static int hex4(const char *p) {
  int v = 0;
  for (int k = 0; k < 4; k++) {
    char c = p[k];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0)
      return -1;
    v = v * 16 + d;
  }
  return v;
}

static size_t put_utf8(char *o, unsigned cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xC0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xE0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (char)(0xF0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

// A string starting at the opening quote, decoded into the arena (escapes, \u with surrogates).
static const char *parse_string(JParser *j) {
  const char *q = ++j->p;
  while (q < j->end && *q != '"')
    q += *q == '\\' && q + 1 < j->end ? 2 : 1;
  if (q >= j->end)
    return (const char *)jfail(j, "unterminated string");
  char *out = arena_alloc(j->a, (size_t)(q - j->p) + 1), *o = out; // decoding never grows
  while (j->p < q) {
    unsigned char c = (unsigned char)*j->p;
    if (c < 0x20)
      return (const char *)jfail(j, "control character in a string");
    if (c != '\\') {
      *o++ = *j->p++;
      continue;
    }
    char e = j->p[1];
    j->p += 2;
    const char *simple = strchr("\"\\/bfnrt", e);
    if (e && simple) {
      *o++ = "\"\\/\b\f\n\r\t"[simple - "\"\\/bfnrt"];
      continue;
    }
    if (e != 'u' || q - j->p < 4 || hex4(j->p) < 0)
      return (const char *)jfail(j, "bad escape in a string");
    unsigned cp = (unsigned)hex4(j->p);
    j->p += 4;
    if (cp >= 0xD800 && cp < 0xDC00) {
      int lo = q - j->p >= 6 && j->p[0] == '\\' && j->p[1] == 'u' ? hex4(j->p + 2) : -1;
      if (lo < 0xDC00 || lo >= 0xE000)
        return (const char *)jfail(j, "unpaired surrogate in a string");
      cp = 0x10000 + ((cp - 0xD800) << 10) + ((unsigned)lo - 0xDC00);
      j->p += 6;
    } else if (cp >= 0xDC00 && cp < 0xE000) {
      return (const char *)jfail(j, "unpaired surrogate in a string");
    }
    if (cp == 0)
      return (const char *)jfail(j, "NUL character in a string");
    o += put_utf8(o, cp);
  }
  *o = 0;
  j->p = q + 1;
  return out;
}

// A number per JSON's grammar; exact int64 value when it is an integer literal.
static bool parse_number(JParser *j, JVal *v) {
  const char *p = j->p;
  bool neg = p < j->end && *p == '-';
  p += neg;
  if (p >= j->end || *p < '0' || *p > '9')
    return jfail(j, "bad number");
  bool overflow = false;
  int64_t acc = 0;
  if (*p == '0')
    p++;
  else
    for (; p < j->end && *p >= '0' && *p <= '9'; p++) {
      if (acc > (INT64_MAX - (*p - '0')) / 10)
        overflow = true;
      else
        acc = acc * 10 + (*p - '0');
    }
  bool frac = false;
  if (p < j->end && *p == '.') {
    frac = true;
    if (++p >= j->end || *p < '0' || *p > '9')
      return jfail(j, "bad number");
    while (p < j->end && *p >= '0' && *p <= '9')
      p++;
  }
  if (p < j->end && (*p == 'e' || *p == 'E')) {
    frac = true;
    p++;
    if (p < j->end && (*p == '+' || *p == '-'))
      p++;
    if (p >= j->end || *p < '0' || *p > '9')
      return jfail(j, "bad number");
    while (p < j->end && *p >= '0' && *p <= '9')
      p++;
  }
  v->kind = J_NUM;
  v->is_int = !frac && !overflow;
  v->i = neg ? -acc : acc;
  j->p = p;
  return true;
}

static bool literal(JParser *j, const char *word) {
  size_t n = strlen(word);
  if ((size_t)(j->end - j->p) < n || memcmp(j->p, word, n) != 0)
    return false;
  j->p += n;
  return true;
}

static JVal *parse_value(JParser *j);

static int by_name(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

// A member name that object v holds twice, or NULL. The names are sorted, not compared pairwise:
// n log n comparisons for n members however they were chosen (a crafted header holds 100k keys).
static const char *duplicate_key(JParser *j, const JVal *v) {
  size_t n = 0, i = 0;
  for (const JVal *m = v->child; m; m = m->next)
    n++;
  if (n < 2)
    return NULL;
  const char **names = arena_alloc(j->a, n * sizeof *names);
  for (const JVal *m = v->child; m; m = m->next)
    names[i++] = m->key;
  qsort(names, n, sizeof *names, by_name);
  for (i = 1; i < n; i++)
    if (!strcmp(names[i - 1], names[i]))
      return names[i];
  return NULL;
}

// An array or object: elements separated by ',' up to `close`; objects have "key": value members.
static JVal *parse_container(JParser *j, JVal *v, char close) {
  JVal **tail = &v->child;
  j->p++;
  skip_ws(j);
  if (j->p < j->end && *j->p == close) {
    j->p++;
    return v;
  }
  for (;;) {
    const char *key = NULL;
    skip_ws(j);
    if (close == '}') {
      if (j->p >= j->end || *j->p != '"')
        return jfail(j, "expected a member name");
      if (!(key = parse_string(j)))
        return NULL;
      skip_ws(j);
      if (j->p >= j->end || *j->p != ':')
        return jfail(j, "expected ':'");
      j->p++;
    }
    JVal *e = parse_value(j);
    if (!e)
      return NULL;
    e->key = key;
    *tail = e;
    tail = &e->next;
    skip_ws(j);
    if (j->p < j->end && *j->p == ',') {
      j->p++;
      continue;
    }
    if (j->p < j->end && *j->p == close) {
      j->p++;
      const char *twice = close == '}' ? duplicate_key(j, v) : NULL;
      if (twice)
        snprintf(j->err, sizeof j->err, "duplicate key '%.100s' in the header", twice);
      return twice ? NULL : v;
    }
    return jfail(j, close == '}' ? "expected ',' or '}'" : "expected ',' or ']'");
  }
}

static JVal *parse_value(JParser *j) {
  skip_ws(j);
  if (j->p >= j->end)
    return jfail(j, "unexpected end");
  if (j->depth > 64)
    return jfail(j, "nested too deeply");
  JVal *v = arena_alloc(j->a, sizeof *v);
  switch (*j->p) {
  case '{':
  case '[': {
    v->kind = *j->p == '{' ? J_OBJ : J_ARR;
    j->depth++;
    JVal *r = parse_container(j, v, *j->p == '{' ? '}' : ']');
    j->depth--;
    return r;
  }
  case '"':
    v->kind = J_STR;
    return (v->str = parse_string(j)) ? v : NULL;
  default:
    if (literal(j, "true") || literal(j, "false")) {
      v->kind = J_BOOL;
      return v;
    }
    if (literal(j, "null"))
      return v;
    return parse_number(j, v) ? v : NULL;
  }
}

//
// Reading.
//

static const struct {
  const char *name;
  DType dt;
  int size;
} dtypes[] = {{"F32", DT_F32, 4}, {"I32", DT_I32, 4}, {"BF16", DT_BF16, 2}, {"F64", DT_F64, 8}};

static const char *dtype_tag(DType dt) {
  for (size_t k = 0; k < sizeof dtypes / sizeof dtypes[0]; k++)
    if (dtypes[k].dt == dt)
      return dtypes[k].name;
  return NULL;
}

typedef struct {
  uint64_t begin, end;
  int tensor; // index in StFile.t
} Range;

// One tensor entry of the header: {"dtype": .., "shape": [..], "data_offsets": [b, e]}.
static bool read_entry(const JVal *e, uint64_t data_len, StTensor *t, Range *r, char *why, size_t n) {
  const char *name = e->key;
  if (e->kind != J_OBJ) {
    snprintf(why, n, "tensor '%s': entry is not an object", name);
    return false;
  }
  const JVal *dtype = NULL, *shape = NULL, *offs = NULL;
  for (const JVal *m = e->child; m; m = m->next) {
    if (strcmp(m->key, "dtype") == 0)
      dtype = m;
    else if (strcmp(m->key, "shape") == 0)
      shape = m;
    else if (strcmp(m->key, "data_offsets") == 0)
      offs = m;
    else {
      snprintf(why, n, "tensor '%s': unexpected key '%s'", name, m->key);
      return false;
    }
  }
  if (!dtype || !shape || !offs) {
    snprintf(why, n, "tensor '%s': missing '%s'", name, !dtype ? "dtype" : !shape ? "shape" : "data_offsets");
    return false;
  }
  if (dtype->kind != J_STR) {
    snprintf(why, n, "tensor '%s': dtype is not a string", name);
    return false;
  }
  int esize = 0;
  for (size_t k = 0; k < sizeof dtypes / sizeof dtypes[0]; k++)
    if (strcmp(dtype->str, dtypes[k].name) == 0) {
      t->dtype = dtypes[k].dt;
      esize = dtypes[k].size;
    }
  if (!esize) {
    snprintf(why, n, "tensor '%s': unsupported dtype '%s' (supported: F32, I32, BF16, F64)", name, dtype->str);
    return false;
  }
  if (shape->kind != J_ARR) {
    snprintf(why, n, "tensor '%s': shape is not an array", name);
    return false;
  }
  t->shape.rank = 0;
  bool empty = false;
  for (const JVal *d = shape->child; d; d = d->next) {
    if (t->shape.rank == IR_MAX_RANK) {
      snprintf(why, n, "tensor '%s': more than %d axes", name, IR_MAX_RANK);
      return false;
    }
    if (d->kind != J_NUM || !d->is_int || d->i < 0 || d->i > ((int64_t)1 << 40)) {
      snprintf(why, n, "tensor '%s': shape holds something other than an integer in [0, 2^40]", name);
      return false;
    }
    t->shape.d[t->shape.rank++] = d->i;
    empty |= d->i == 0;
  }
  // The byte size, or UINT64_MAX when it does not fit in 64 bits (then it cannot match the offsets).
  uint64_t bytes = empty ? 0 : (uint64_t)esize;
  for (int k = 0; k < t->shape.rank && bytes; k++)
    if (__builtin_mul_overflow(bytes, (uint64_t)t->shape.d[k], &bytes))
      bytes = UINT64_MAX;
  const JVal *b = offs->kind == J_ARR ? offs->child : NULL, *en = b ? b->next : NULL;
  if (!b || !en || en->next || b->kind != J_NUM || !b->is_int || b->i < 0 || en->kind != J_NUM || !en->is_int ||
      en->i < 0) {
    snprintf(why, n, "tensor '%s': data_offsets must be two non-negative integers", name);
    return false;
  }
  r->begin = (uint64_t)b->i;
  r->end = (uint64_t)en->i;
  if (r->begin > r->end) {
    snprintf(why, n, "tensor '%s': data_offsets [%llu, %llu] end before they begin", name,
             (unsigned long long)r->begin, (unsigned long long)r->end);
    return false;
  }
  if (r->end > data_len) {
    snprintf(why, n, "tensor '%s': data_offsets [%llu, %llu] out of range: the data area has %llu bytes", name,
             (unsigned long long)r->begin, (unsigned long long)r->end, (unsigned long long)data_len);
    return false;
  }
  if (r->end - r->begin != bytes) {
    char sh[128], need[64];
    if (bytes == UINT64_MAX)
      snprintf(need, sizeof need, "more bytes than 64 bits can count");
    else
      snprintf(need, sizeof need, "%llu bytes", (unsigned long long)bytes);
    snprintf(why, n, "tensor '%s': %s%s needs %s, data_offsets give %llu", name, dtype->str,
             shape_str(t->shape, sh, sizeof sh), need, (unsigned long long)(r->end - r->begin));
    return false;
  }
  return true;
}

static int by_begin(const void *a, const void *b) {
  const Range *x = a, *y = b;
  return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : x->end < y->end ? -1 : x->end > y->end;
}

// The ranges must tile [0, data_len): sorted by begin, each starts where the previous ended.
static bool check_tiling(const StTensor *t, const Range *r, int n, uint64_t data_len, char *why, size_t wn) {
  Range *s = xmalloc(sizeof(Range) * (size_t)n, "the tensors' ranges");
  memcpy(s, r, sizeof(Range) * (size_t)n);
  qsort(s, (size_t)n, sizeof *s, by_begin);
  uint64_t at = 0;
  bool ok = true;
  for (int k = 0; k < n && ok; k++) {
    if (s[k].begin < at) {
      snprintf(why, wn, "tensors '%s' and '%s' overlap", t[s[k - 1].tensor].name, t[s[k].tensor].name);
      ok = false;
    } else if (s[k].begin > at) {
      snprintf(why, wn, "bytes [%llu, %llu) of the data area belong to no tensor", (unsigned long long)at,
               (unsigned long long)s[k].begin);
      ok = false;
    }
    at = s[k].end;
  }
  if (ok && at != data_len) {
    snprintf(why, wn, "bytes [%llu, %llu) of the data area belong to no tensor", (unsigned long long)at,
             (unsigned long long)data_len);
    ok = false;
  }
  free(s);
  return ok;
}

// Reads exactly n bytes at offset off; false with errno set, or 0 at an early end of file.
static bool read_at(int fd, void *buf, size_t n, uint64_t off) {
  for (size_t done = 0; done < n;) {
    ssize_t k = pread(fd, (char *)buf + done, n - done, (off_t)(off + done));
    if (k < 0 && errno == EINTR)
      continue;
    if (k == 0)
      errno = 0;
    if (k <= 0)
      return false;
    done += (size_t)k;
  }
  return true;
}

static const char *read_error(void) { return errno ? strerror(errno) : "unexpected end of file"; }

static bool parse_file(Arena *a, int fd, uint64_t size, bool data, StFile *out, char *why, size_t wn) {
  unsigned char len8[8];
  if (size < 8) {
    snprintf(why, wn, "truncated: file has %llu bytes, fewer than the 8-byte header length",
             (unsigned long long)size);
    return false;
  }
  if (!read_at(fd, len8, 8, 0)) {
    snprintf(why, wn, "cannot read: %s", read_error());
    return false;
  }
  uint64_t hlen = 0;
  for (int k = 7; k >= 0; k--)
    hlen = hlen << 8 | len8[k];
  if (hlen > size - 8) {
    snprintf(why, wn, "truncated: header says %llu bytes, file has %llu", (unsigned long long)hlen,
             (unsigned long long)size);
    return false;
  }
  char *text = arena_alloc(a, (size_t)hlen + 1);
  if (!read_at(fd, text, (size_t)hlen, 8)) {
    snprintf(why, wn, "cannot read: %s", read_error());
    return false;
  }
  JParser j = {.a = a, .s = text, .p = text, .end = text + hlen};
  skip_ws(&j);
  if (j.p >= j.end || *j.p != '{') {
    snprintf(why, wn, "not a safetensors file: the header does not start with '{'");
    return false;
  }
  JVal *root = parse_value(&j);
  skip_ws(&j);
  if (root && j.p != j.end)
    jfail(&j, "unexpected text after the header object");
  if (!root || j.err[0]) {
    snprintf(why, wn, "%s", j.err);
    return false;
  }
  uint64_t data_len = size - 8 - hlen;
  int n = 0;
  for (JVal *e = root->child; e; e = e->next)
    n += strcmp(e->key, "__metadata__") != 0;
  out->t = arena_alloc(a, sizeof(StTensor) * (size_t)(n ? n : 1));
  out->n = n;
  Range *r = arena_alloc(a, sizeof(Range) * (size_t)(n ? n : 1));
  int i = 0;
  for (JVal *e = root->child; e; e = e->next) {
    if (strcmp(e->key, "__metadata__") == 0) {
      if (e->kind != J_OBJ) {
        snprintf(why, wn, "__metadata__ is not an object");
        return false;
      }
      for (JVal *m = e->child; m; m = m->next)
        out->nmeta += m->kind == J_STR;
      out->meta = arena_alloc(a, sizeof(StMeta) * (size_t)(out->nmeta ? out->nmeta : 1));
      int k = 0;
      for (JVal *m = e->child; m; m = m->next)
        if (m->kind == J_STR)
          out->meta[k++] = (StMeta){m->key, m->str};
      continue;
    }
    out->t[i].name = e->key;
    r[i].tensor = i;
    if (!read_entry(e, data_len, &out->t[i], &r[i], why, wn))
      return false;
    i++;
  }
  if (!check_tiling(out->t, r, n, data_len, why, wn))
    return false;
  for (i = 0; data && i < n; i++) {
    size_t bytes = (size_t)(r[i].end - r[i].begin);
    out->t[i].data = arena_alloc(a, bytes ? bytes : 1);
    if (!read_at(fd, out->t[i].data, bytes, 8 + hlen + r[i].begin)) {
      snprintf(why, wn, "cannot read tensor '%s': %s", out->t[i].name, read_error());
      return false;
    }
  }
  return true;
}

static bool read_file(Arena *a, const char *path, bool data, StFile *out) {
  *out = (StFile){0};
  char why[512] = "";
  int64_t size;
  int fd = file_open(path, O_RDONLY, &size, why, sizeof why);
  bool ok = fd >= 0 && parse_file(a, fd, (uint64_t)size, data, out, why, sizeof why);
  if (fd >= 0)
    close(fd);
  if (!ok) {
    diag_file_error(path, "%s", why);
    *out = (StFile){0};
  }
  return ok;
}

bool st_read(Arena *a, const char *path, StFile *out) { return read_file(a, path, true, out); }
bool st_read_header(Arena *a, const char *path, StFile *out) { return read_file(a, path, false, out); }

const char *st_meta(const StFile *f, const char *key) {
  for (int i = 0; i < f->nmeta; i++)
    if (!strcmp(f->meta[i].key, key))
      return f->meta[i].value;
  return NULL;
}

const StTensor *st_expect(const StFile *f, const char *path, const char *prefix, const IrNode *n) {
  const StTensor *t = st_find(f, n->name);
  char have[128], want[128];
  shape_str(n->shape, want, sizeof want);
  const char *kind = n->op == OP_PARAM ? "parameter" : n->op == OP_INPUT ? "input" : "state";
  if (!t) {
    diag_file_error(path, "%sno tensor '%s' (the model's %s %s)", prefix, n->name, kind, want);
    return NULL;
  }
  if (t->dtype != n->dtype || !shape_eq(t->shape, n->shape)) {
    bool dt = t->dtype != n->dtype;
    diag_file_error(path, "%stensor '%s' is %s%s, the model wants %s%s", prefix, n->name, dt ? dtype_name(t->dtype) : "",
                    shape_str(t->shape, have, sizeof have), dt ? dtype_name(n->dtype) : "", want);
    return NULL;
  }
  return t;
}

const StTensor *st_find(const StFile *f, const char *name) {
  for (int i = 0; i < f->n; i++)
    if (strcmp(f->t[i].name, name) == 0)
      return &f->t[i];
  return NULL;
}

//
// Writing.
//

typedef struct {
  char *s;
  size_t len, cap;
} Buf;

static void buf_put(Buf *b, const char *s, size_t n) {
  if (b->len + n + 1 > b->cap) {
    b->cap = 2 * (b->len + n + 1);
    b->s = xrealloc(b->s, b->cap, "a safetensors header");
  }
  memcpy(b->s + b->len, s, n);
  b->len += n;
  b->s[b->len] = 0;
}

static void buf_printf(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(Buf *b, const char *fmt, ...) {
  char tmp[64];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  buf_put(b, tmp, (size_t)n);
}

static void buf_json_string(Buf *b, const char *s) {
  buf_put(b, "\"", 1);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      buf_put(b, "\\", 1);
      buf_put(b, s, 1);
    } else if (c < 0x20) {
      buf_printf(b, "\\u%04x", c);
    } else {
      buf_put(b, s, 1);
    }
  }
  buf_put(b, "\"", 1);
}

static bool write_all(int fd, const void *p, size_t n) {
  for (size_t done = 0; done < n;) {
    ssize_t k = write(fd, (const char *)p + done, n - done);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      return false;
    done += (size_t)k;
  }
  return true;
}

// The header JSON for t[0..n), padded with spaces to a multiple of 8 bytes; false when a tensor
// cannot be written (unsupported dtype, reserved or repeated name).
static bool build_header(Buf *h, const StTensor *t, int n, const StMeta *meta, int nmeta, char *why,
                         size_t wn) {
  uint64_t off = 0;
  buf_put(h, "{", 1);
  if (nmeta) {
    buf_put(h, "\"__metadata__\":{", 16);
    for (int i = 0; i < nmeta; i++) {
      if (i)
        buf_put(h, ",", 1);
      buf_json_string(h, meta[i].key);
      buf_put(h, ":", 1);
      buf_json_string(h, meta[i].value);
    }
    buf_put(h, n ? "}," : "}", n ? 2 : 1);
  }
  for (int i = 0; i < n; i++) {
    const char *tag = dtype_tag(t[i].dtype);
    if (!tag) {
      snprintf(why, wn, "tensor '%s': dtype %s cannot be stored (F32, I32, BF16, F64)", t[i].name,
               dtype_name(t[i].dtype));
      return false;
    }
    for (int k = 0; k < i; k++)
      if (strcmp(t[k].name, t[i].name) == 0) {
        snprintf(why, wn, "two tensors named '%s'", t[i].name);
        return false;
      }
    if (strcmp(t[i].name, "__metadata__") == 0) {
      snprintf(why, wn, "'__metadata__' is not a tensor name");
      return false;
    }
    uint64_t bytes = (uint64_t)shape_numel(t[i].shape) * (uint64_t)dtype_size(t[i].dtype);
    if (i)
      buf_put(h, ",", 1);
    buf_json_string(h, t[i].name);
    buf_printf(h, ":{\"dtype\":\"%s\",\"shape\":[", tag);
    for (int d = 0; d < t[i].shape.rank; d++)
      buf_printf(h, "%s%lld", d ? "," : "", (long long)t[i].shape.d[d]);
    buf_printf(h, "],\"data_offsets\":[%llu,", (unsigned long long)off);
    off += bytes;
    buf_printf(h, "%llu]}", (unsigned long long)off);
  }
  buf_put(h, "}", 1);
  while (h->len % 8)
    buf_put(h, " ", 1);
  return true;
}

bool st_write(const char *path, const StTensor *t, int n) { return st_write_meta(path, t, n, NULL, 0); }

bool st_write_meta(const char *path, const StTensor *t, int n, const StMeta *meta, int nmeta) {
  Buf h = {0};
  char why[512] = "";
  if (!build_header(&h, t, n, meta, nmeta, why, sizeof why)) {
    free(h.s);
    diag_file_error(path, "cannot write: %s", why);
    return false;
  }
  char *tmp = xmalloc(strlen(path) + 32, "a file name");
  sprintf(tmp, "%s.tmp.%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  bool ok = fd >= 0;
  if (ok) {
    unsigned char len8[8];
    for (int k = 0; k < 8; k++)
      len8[k] = (unsigned char)((uint64_t)h.len >> (8 * k));
    ok = write_all(fd, len8, 8) && write_all(fd, h.s, h.len);
    for (int i = 0; ok && i < n; i++)
      ok = write_all(fd, t[i].data, (size_t)shape_numel(t[i].shape) * (size_t)dtype_size(t[i].dtype));
    ok = ok && fsync(fd) == 0;
    ok = close(fd) == 0 && ok;
    ok = ok && rename(tmp, path) == 0;
  }
  if (!ok) {
    diag_file_error(path, "cannot write: %s", strerror(errno));
    unlink(tmp);
  }
  free(tmp);
  free(h.s);
  return ok;
}
