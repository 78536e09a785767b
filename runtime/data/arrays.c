// arrays.c: training data as named arrays, one per model input, whose first axis is the examples
// (features, labels, images as patches): the folder's (or the file's) .npy, .npz and .safetensors
// arrays are found, matched to the model's inputs by name, checked against each input's declaration
// and converted to its i32 or f32, all before anything is compiled. A batch is B examples: in order,
// or in a permutation per epoch from the seed (loader_permute, as shards' rows are shuffled), rows
// running across epoch ends; the loader's state (epoch, position in that epoch's order) is what a
// checkpoint keeps, so a resumed run draws the batches an uninterrupted one would.
//
// The splits: DIR/train/ (else DIR's own files, less DIR/val.*) is the train split; DIR/val/ (else
// DIR/val.npz or DIR/val.safetensors) the val split; a dataset without one holds out a share of its
// examples (--val-fraction, as prep's), chosen by a permutation of a fixed seed so that every run and
// `mdlc eval` on the dataset hold out the same ones, each split kept in the file's order.
#include "data.h"
#include "rt_util.h"

#include <dirent.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define HOLD_OUT_SEED 0x76616c6964ull // the permutation that picks the held-out examples

static bool has_ext(const char *name, const char *ext) {
  size_t n = strlen(name), e = strlen(ext);
  return n > e && !strcmp(name + n - e, ext);
}

static bool array_file(const char *name) {
  return name[0] != '.' && (has_ext(name, ".npy") || has_ext(name, ".npz") || has_ext(name, ".safetensors"));
}

static bool is_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

// The name of a file less its folder and extension.
static void stem(const char *path, char *buf, size_t n) {
  const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
  snprintf(buf, n, "%s", base);
  char *dot = strrchr(buf, '.');
  if (dot)
    *dot = 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

// The array files of folder dir, sorted; with only (a stem), those of that stem, with skip, the others.
// A name such as x.npy that is not a regular file (a folder, a FIFO) is listed too: its reader refuses it.
static int list_dir(const char *dir, const char *only, const char *skip, char ***out) {
  DIR *d = opendir(dir);
  int n = 0, cap = 0;
  *out = NULL;
  if (!d)
    return 0;
  for (struct dirent *e; (e = readdir(d));) {
    char s[256], path[PATH_MAX];
    stem(e->d_name, s, sizeof s);
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (!array_file(e->d_name) || (only && strcmp(s, only)) || (skip && !strcmp(s, skip)))
      continue;
    if (n == cap)
      *out = xrealloc(*out, sizeof(char *) * (size_t)(cap = cap ? 2 * cap : 8), "the list of array files");
    (*out)[n++] = xstrdup(path, "the list of array files");
  }
  closedir(d);
  if (n > 1)
    qsort(*out, (size_t)n, sizeof(char *), cmp_str);
  return n;
}

// The files of one split ("train" or "val").
static int split_files(const char *path, const char *split, char ***out) {
  if (!is_dir(path)) {
    *out = NULL;
    if (strcmp(split, "train"))
      return 0;
    *out = xrealloc(NULL, sizeof(char *), "the list of array files");
    (*out)[0] = xstrdup(path, "the list of array files");
    return 1;
  }
  char sub[PATH_MAX];
  snprintf(sub, sizeof sub, "%s/%s", path, split);
  if (is_dir(sub))
    return list_dir(sub, NULL, NULL, out);
  return !strcmp(split, "val") ? list_dir(path, "val", NULL, out) : list_dir(path, NULL, "val", out);
}

static void free_files(char **files, int n) {
  for (int i = 0; i < n; i++)
    free(files[i]);
  free(files);
}

bool arrays_found(const char *path) {
  if (!is_dir(path))
    return array_file(strrchr(path, '/') ? strrchr(path, '/') + 1 : path);
  char **shards;
  int ns = shard_list(path, "train", &shards);
  if (ns > 0) {
    shard_list_free(shards, ns);
    return false;
  }
  if (ns == 0)
    shard_list_free(shards, ns);
  char **files;
  int n = split_files(path, "train", &files);
  free_files(files, n);
  return n > 0;
}

// Every array of a split's files, in file order.
typedef struct {
  NpArray *a;
  int n, cap;
} ArrayList;

static void list_free(ArrayList *l) {
  for (int i = 0; i < l->n; i++)
    np_array_free(&l->a[i]);
  free(l->a);
  *l = (ArrayList){0};
}

static NpArray *list_push(ArrayList *l) {
  if (l->n == l->cap)
    l->a = xrealloc(l->a, sizeof(NpArray) * (size_t)(l->cap = l->cap ? 2 * l->cap : 8), "the list of arrays");
  l->a[l->n] = (NpArray){0};
  return &l->a[l->n++];
}

static bool read_safetensors(const char *path, ArrayList *l) {
  Arena *a = arena_new();
  StFile f;
  bool ok = st_read(a, path, &f);
  for (int i = 0; ok && i < f.n; i++) {
    const StTensor *t = &f.t[i];
    ArrayType type = t->dtype == DT_F32 ? AT_F32 : t->dtype == DT_I32 ? AT_I32 : t->dtype == DT_F64 ? AT_F64 : AT_BF16;
    size_t bytes = (size_t)shape_numel(t->shape) * (size_t)array_type_size(type);
    NpArray *x = list_push(l);
    *x = (NpArray){.name = xstrdup(t->name, "an array"), .file = xstrdup(path, "an array"), .type = type, .shape = t->shape,
                   .data = xrealloc(NULL, bytes ? bytes : 1, "an array")};
    memcpy(x->data, t->data, bytes);
  }
  arena_free(a);
  return ok;
}

static bool read_file(const char *path, ArrayList *l) {
  if (has_ext(path, ".safetensors"))
    return read_safetensors(path, l);
  if (has_ext(path, ".npz")) {
    NpArray *got;
    int n = npz_read(path, &got);
    for (int i = 0; i < n; i++)
      *list_push(l) = got[i];
    free(got);
    return n >= 0;
  }
  char name[256];
  stem(path, name, sizeof name);
  return npy_read(path, name, list_push(l)) || (l->n--, false);
}

// One split's examples for a model's inputs: per input, every example's row in the input's dtype.
typedef struct {
  int n; // inputs
  const char **names;
  DType *dtype;   // DT_F32 or DT_I32
  int64_t *row;   // elements per example
  char **data;    // examples * row elements each
  int64_t examples;
} Split;

static void split_free(Split *s) {
  for (int i = 0; i < s->n; i++)
    free(s->data[i]);
  free(s->names);
  free(s->dtype);
  free(s->row);
  free(s->data);
  *s = (Split){0};
}

// The model's inputs: the forward graph's INPUT nodes.
static int model_inputs(const Graph *g, const IrNode **out) {
  int n = 0;
  for (int i = 0; i < g->fwd_end; i++)
    if (g->nodes[i]->op == OP_INPUT)
      out[n++] = g->nodes[i];
  return n;
}

// Converts array a (rows of `row` elements) into dst, the input's dtype; false after saying why.
static bool convert(const NpArray *a, const IrNode *in, char *dst, int64_t count) {
  const char *src = a->data;
  bool to_f32 = in->dtype == DT_F32;
  for (int64_t i = 0; i < count; i++) {
    double v;
    switch (a->type) {
    case AT_F32: v = ((const float *)src)[i]; break;
    case AT_F64: v = ((const double *)src)[i]; break;
    case AT_BF16: {
      uint32_t bits = (uint32_t)((const uint16_t *)src)[i] << 16;
      float f;
      memcpy(&f, &bits, 4);
      v = f;
      break;
    }
    case AT_I8: v = ((const int8_t *)src)[i]; break;
    case AT_U8: case AT_BOOL: v = ((const uint8_t *)src)[i]; break;
    case AT_I16: v = ((const int16_t *)src)[i]; break;
    case AT_U16: v = ((const uint16_t *)src)[i]; break;
    case AT_I32: v = ((const int32_t *)src)[i]; break;
    default: {
      int64_t x = ((const int64_t *)src)[i];
      if (x < INT32_MIN || x > INT32_MAX) {
        diag_file_error(a->file, "array '%s': element %lld is %lld, outside int32, the model's input '%s' is i32",
                        a->name, (long long)i, (long long)x, in->name);
        return false;
      }
      v = (double)x;
    }
    }
    if (to_f32)
      ((float *)dst)[i] = (float)v;
    else
      ((int32_t *)dst)[i] = (int32_t)v;
  }
  return true;
}

// The values the model lets an i32 input take, where it makes them known: the ids of an embed
// (0 <= id < its table's rows) and the targets of a cross_entropy (below its class count; a negative
// target is ignored), reached from the input through reshapes, permutes and broadcasts, which carry
// every value of it. lo_by and hi_by are the ops that set each end (NULL: no bound that way).
typedef struct {
  int64_t lo, hi;
  const IrNode *lo_by, *hi_by;
} IdRange;

// The upper end an embed (its table's rows) or a cross_entropy (its logits' classes) sets.
static int64_t limit_of(const Graph *g, const IrNode *by) {
  const Shape *of = &g->nodes[by->in[0]]->shape; // the table [V, C], or the logits [..., V]
  return by->op == OP_EMBED ? of->d[0] : of->d[of->rank - 1];
}

static IdRange input_range(const Graph *g, const IrNode *in) {
  IdRange r = {INT64_MIN, INT64_MAX, NULL, NULL};
  int *whole = rt_xrealloc(NULL, sizeof(int) * (size_t)(g->fwd_end + 1)); // node i carries all of the input
  for (int i = 0; i < g->fwd_end; i++) {
    const IrNode *n = g->nodes[i];
    Op op = n->op;
    whole[i] = n == in || ((op == OP_RESHAPE || op == OP_PERMUTE || op == OP_BROADCAST || op == OP_STOP_GRADIENT) &&
                           whole[n->in[0]]);
    if ((op != OP_EMBED && op != OP_CROSS_ENTROPY) || !whole[n->in[1]])
      continue;
    int64_t v = limit_of(g, n);
    if (op == OP_EMBED && !r.lo_by)
      r.lo = 0, r.lo_by = n;
    if (v < r.hi)
      r.hi = v, r.hi_by = n;
  }
  free(whole);
  return r;
}

// "example E" or "example E, element K" of array a, whose flat element i it is.
static const char *element_at(const NpArray *a, int64_t i, char *buf, size_t n) {
  int64_t row = a->shape.d[0] ? shape_numel(a->shape) / a->shape.d[0] : 1;
  if (row == 1)
    snprintf(buf, n, "example %lld", (long long)i);
  else
    snprintf(buf, n, "example %lld, element %lld", (long long)(i / row), (long long)(i % row));
  return buf;
}

// The converted values of array a (count of them, in dst) checked as the model will use them: no
// NaN or infinity in a float input, an i32 input inside the range the model gives it; false after
// naming the file, the array, the example and the value.
static bool check_values(const Graph *g, const NpArray *a, const IrNode *in, const char *dst, int64_t count) {
  char at[96], where[160] = "";
  if (in->dtype == DT_F32) {
    int64_t i = rt_first_nonfinite((const float *)dst, count);
    double v = i < 0 ? 0 : a->type == AT_F64 ? ((const double *)a->data)[i] : ((const float *)dst)[i];
    if (i >= 0)
      diag_file_error(a->file, "array '%s', %s is %g%s: the model's input '%s' takes finite numbers only (drop or "
                      "replace the example)", a->name, element_at(a, i, at, sizeof at), v,
                      isfinite(v) ? ", beyond float32's range" : "", in->name);
    return i < 0;
  }
  IdRange r = input_range(g, in);
  const int32_t *x = (const int32_t *)dst;
  for (int64_t i = 0; i < count; i++) {
    if (x[i] >= r.lo && x[i] < r.hi)
      continue;
    const IrNode *by = x[i] < r.lo ? r.lo_by : r.hi_by;
    int64_t v = limit_of(g, by);
    if (by->loc.line)
      snprintf(where, sizeof where, " (%s:%d:%d)", by->loc.file, by->loc.line, by->loc.col);
    if (by->op == OP_EMBED)
      diag_file_error(a->file, "array '%s', %s is %d, outside [0, %lld): the model's input '%s' is the ids of an "
                      "embed%s whose table has %lld rows", a->name, element_at(a, i, at, sizeof at), x[i],
                      (long long)v, in->name, where, (long long)v);
    else
      diag_file_error(a->file, "array '%s', %s is %d, not below %lld: the model's input '%s' is the targets of a "
                      "cross_entropy%s over %lld classes (a negative target is ignored)", a->name,
                      element_at(a, i, at, sizeof at), x[i], (long long)v, in->name, where, (long long)v);
    return false;
  }
  return true;
}

// Whether array a can fill input `in` (B the batch dim): its dtype, its rank and the shape of one example.
static bool fits(const NpArray *a, const IrNode *in, int64_t B) {
  char want[96], got[96], ex[96];
  Shape one = in->shape;
  one.rank--;
  memmove(one.d, one.d + 1, sizeof(int64_t) * (size_t)one.rank);
  shape_str(one, ex, sizeof ex);
  shape_str(in->shape, want, sizeof want);
  shape_str(a->shape, got, sizeof got);
  bool is_float = a->type == AT_F32 || a->type == AT_F64 || a->type == AT_BF16;
  if (in->dtype == DT_F32 && !is_float) {
    diag_file_error(a->file, "array '%s' is %s, the model's input '%s' is f32%s: save it as float32 "
                    "(x.astype(np.float32))", a->name, array_type_name(a->type), in->name, want);
    return false;
  }
  if (in->dtype == DT_I32 && is_float) {
    diag_file_error(a->file, "array '%s' is %s, the model's input '%s' is i32%s: save it as an integer array "
                    "(x.astype(np.int32))", a->name, array_type_name(a->type), in->name, want);
    return false;
  }
  bool same = a->shape.rank == in->shape.rank && a->shape.rank >= 1;
  for (int k = 1; same && k < a->shape.rank; k++)
    same = a->shape.d[k] == in->shape.d[k];
  if (!same) {
    diag_file_error(a->file, "array '%s' is %s, the model's input '%s' is %s%s with B = %lld: the array must be "
                    "[examples%s%s]", a->name, got, in->name, dtype_name(in->dtype), want, (long long)B,
                    one.rank ? "," : "", one.rank ? ex + 1 : "]");
    return false;
  }
  if (a->shape.d[0] == 0) {
    diag_file_error(a->file, "array '%s' holds no examples", a->name);
    return false;
  }
  return true;
}

// The arrays of one split's files matched to g's inputs. *none: the split has no files (nothing
// printed); else false after saying why.
static bool split_load(const char *path, const char *split, const Graph *g, Split *s, bool *none) {
  *s = (Split){0};
  char **files;
  int nf = split_files(path, split, &files);
  *none = nf == 0;
  if (nf == 0)
    return false;
  ArrayList l = {0};
  bool ok = true;
  for (int i = 0; ok && i < nf; i++)
    ok = read_file(files[i], &l);
  int64_t B = ir_dim(g, "B");
  const IrNode **in = xrealloc(NULL, sizeof(IrNode *) * (size_t)(g->fwd_end + 1), "the model's inputs");
  int nin = model_inputs(g, in);
  s->names = xrealloc(NULL, sizeof(char *) * (size_t)(nin + 1), "the model's inputs");
  s->dtype = xrealloc(NULL, sizeof(DType) * (size_t)(nin + 1), "the model's inputs");
  s->row = xrealloc(NULL, sizeof(int64_t) * (size_t)(nin + 1), "the model's inputs");
  s->data = xcalloc((size_t)(nin + 1), sizeof(char *), "the model's inputs");
  const NpArray *first = NULL;
  for (int i = 0; ok && i < nin; i++) {
    char want[96];
    shape_str(in[i]->shape, want, sizeof want);
    if (in[i]->shape.rank < 1 || in[i]->shape.d[0] != B) {
      diag_file_error(path, "the model's input '%s' is %s%s, whose first axis is not B = %lld: "
                      "an array dataset gives each input one row per example, B of them a batch", in[i]->name,
                      dtype_name(in[i]->dtype), want, (long long)B);
      ok = false;
      break;
    }
    const NpArray *a = NULL;
    for (int k = 0; k < l.n; k++) {
      if (strcmp(l.a[k].name, in[i]->name))
        continue;
      if (a) {
        diag_file_error(path, "array '%s' is in both %s and %s: which one fills the input is unclear", a->name,
                        a->file, l.a[k].file);
        ok = false;
      }
      a = &l.a[k];
    }
    if (!ok)
      break;
    if (!a) {
      char found[512] = "";
      size_t k = 0;
      for (int j = 0; j < l.n && k + 64 < sizeof found; j++)
        k += (size_t)snprintf(found + k, sizeof found - k, "%s'%s'", j ? ", " : "", l.a[j].name);
      diag_file_error(path, "no array '%s' in the %s split for the model's input %s: %s%s (arrays there: %s)",
                      in[i]->name, split, in[i]->name, dtype_name(in[i]->dtype), want, l.n ? found : "none");
      ok = false;
      break;
    }
    if (!(ok = fits(a, in[i], B)))
      break;
    if (first && a->shape.d[0] != first->shape.d[0]) {
      diag_file_error(a->file, "array '%s' holds %lld examples, array '%s' (%s) %lld: every input's array has one "
                      "row per example", a->name, (long long)a->shape.d[0], first->name, first->file,
                      (long long)first->shape.d[0]);
      ok = false;
      break;
    }
    first = first ? first : a;
    s->names[i] = in[i]->name;
    s->dtype[i] = in[i]->dtype;
    s->row[i] = shape_numel(a->shape) / a->shape.d[0];
    s->examples = a->shape.d[0];
    s->data[i] = malloc(4 * (size_t)shape_numel(a->shape));
    s->n = i + 1;
    if (!s->data[i]) {
      diag_file_error(a->file, "out of memory for array '%s'", a->name);
      ok = false;
    } else {
      ok = convert(a, in[i], s->data[i], shape_numel(a->shape)) &&
           check_values(g, a, in[i], s->data[i], shape_numel(a->shape));
    }
  }
  if (ok && nin == 0) {
    diag_file_error(path, "the model has no inputs for the arrays to fill");
    ok = false;
  }
  free(in);
  list_free(&l);
  free_files(files, nf);
  if (!ok)
    split_free(s);
  return ok;
}

// Keeps the examples of s that `keep` marks, in order.
static void split_keep(Split *s, const bool *keep) {
  for (int i = 0; i < s->n; i++) {
    size_t row = 4 * (size_t)s->row[i];
    int64_t k = 0;
    for (int64_t e = 0; e < s->examples; e++)
      if (keep[e])
        memmove(s->data[i] + (size_t)k++ * row, s->data[i] + (size_t)e * row, row);
  }
  int64_t k = 0;
  for (int64_t e = 0; e < s->examples; e++)
    k += keep[e];
  s->examples = k;
}

// One split of the dataset at path for g: its own files, or, where the dataset has no val files, the
// held-out share of train's examples (val) or the rest (train).
static bool open_split(const char *path, const char *split, const Graph *g, double val_fraction, Split *s) {
  char **files;
  int nval_files = split_files(path, "val", &files);
  free_files(files, nval_files);
  bool held_out = nval_files == 0, none;
  if (!split_load(path, held_out ? "train" : split, g, s, &none)) {
    if (none)
      diag_file_error(path, "no .npy, .npz or .safetensors files for the %s split", held_out ? "train" : split);
    return false;
  }
  if (!held_out)
    return true;
  int64_t n = s->examples, nval = llround((double)n * val_fraction);
  nval = nval < 1 ? 1 : nval > n - 1 ? n - 1 : nval;
  if (n < 2) {
    diag_file_error(path, "%lld example, none to hold out for validation: give a val split (a val/ folder, or "
                    "val.npz beside the data)", (long long)n);
    split_free(s);
    return false;
  }
  bool *val = xcalloc((size_t)n, sizeof *val, "the split's examples");
  for (int64_t j = 0; j < nval; j++)
    val[loader_permute(HOLD_OUT_SEED, 0, n, j)] = true;
  for (int64_t e = 0; strcmp(split, "val") && e < n; e++)
    val[e] = !val[e];
  split_keep(s, val);
  free(val);
  return true;
}

bool arrays_check(const char *path, const Graph *g, double val_fraction) {
  Split s;
  for (int i = 0; i < 2; i++) {
    if (!open_split(path, i ? "val" : "train", g, val_fraction, &s))
      return false;
    split_free(&s);
  }
  return true;
}

struct ArrayLoader {
  Split s;
  LoaderOptions o;
  LoaderState at;
  BatchInput *in;
  char **buf; // per input, B rows
  char *path, *split;
};

ArrayLoader *arrays_loader_open(const char *path, const char *split, LoaderOptions o) {
  ArrayLoader *l = xcalloc(1, sizeof *l, "the array loader");
  l->o = o;
  l->path = xstrdup(path, "the array loader");
  l->split = xstrdup(split, "the array loader");
  if (o.B < 1 || !open_split(path, split, o.model, o.val_fraction, &l->s)) {
    if (o.B < 1)
      diag_file_error(path, "cannot draw batches of B = %lld examples", (long long)o.B);
    arrays_loader_close(l);
    return NULL;
  }
  l->in = xcalloc((size_t)l->s.n, sizeof *l->in, "the array loader's batches");
  l->buf = xcalloc((size_t)l->s.n, sizeof *l->buf, "the array loader's batches");
  for (int i = 0; i < l->s.n; i++) {
    l->buf[i] = xrealloc(NULL, 4 * (size_t)(o.B * l->s.row[i]), "the array loader's batches");
    l->in[i] = (BatchInput){.name = l->s.names[i], .numel = o.B * l->s.row[i],
                            .ids = l->s.dtype[i] == DT_I32 ? (const int32_t *)l->buf[i] : NULL,
                            .f = l->s.dtype[i] == DT_F32 ? (const float *)l->buf[i] : NULL};
  }
  return l;
}

void arrays_loader_next(ArrayLoader *l, Batch *b) {
  int64_t n = l->s.examples;
  for (int64_t r = 0; r < l->o.B; r++) {
    int64_t e = l->o.shuffle ? loader_permute(l->o.seed, l->at.epoch, n, l->at.position) : l->at.position;
    for (int i = 0; i < l->s.n; i++) {
      size_t row = 4 * (size_t)l->s.row[i];
      memcpy(l->buf[i] + (size_t)r * row, l->s.data[i] + (size_t)e * row, row);
    }
    if (++l->at.position == n)
      l->at = (LoaderState){l->at.epoch + 1, 0};
  }
  *b = (Batch){.real_tokens = l->o.B, .inputs = l->in, .ninputs = l->s.n};
}

LoaderState arrays_loader_state(const ArrayLoader *l) { return l->at; }

bool arrays_loader_seek(ArrayLoader *l, LoaderState s) {
  if (s.epoch < 0 || s.position < 0 || s.position >= l->s.examples) {
    diag_file_error(l->path, "cannot resume at epoch %lld, position %lld: the %s split has %lld examples",
                    (long long)s.epoch, (long long)s.position, l->split, (long long)l->s.examples);
    return false;
  }
  l->at = s;
  return true;
}

int64_t arrays_loader_rows(const ArrayLoader *l) { return l->s.examples; }

void arrays_loader_close(ArrayLoader *l) {
  if (!l)
    return;
  for (int i = 0; l->buf && i < l->s.n; i++)
    free(l->buf[i]);
  free(l->buf);
  free(l->in);
  split_free(&l->s);
  free(l->path);
  free(l->split);
  free(l);
}
