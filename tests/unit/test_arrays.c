// test_arrays.c: the .npy / .npz reader (npy.c) and array datasets (arrays.c): dtypes and shapes read
// back as written, every malformed file refused with the file, the array and the reason named, the
// inputs matched and checked against a model, the held-out split, and batches drawn in order,
// shuffled (each example once an epoch) and resumed exactly from a loader state.
#include "data.h"
#include "runtime.h"
#include "scratch_dir.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

// A .npy image by hand: header dict `dict`, format version major, then n data bytes.
static size_t make_npy(unsigned char *out, int major, const char *dict, const void *data, size_t n) {
  size_t pre = major == 1 ? 10 : 12, len = strlen(dict), total = (pre + len + 1 + 63) / 64 * 64;
  memcpy(out, "\x93NUMPY", 6);
  out[6] = (unsigned char)major;
  out[7] = 0;
  size_t hlen = total - pre;
  out[8] = (unsigned char)hlen;
  out[9] = (unsigned char)(hlen >> 8);
  if (major > 1)
    out[10] = out[11] = 0;
  memcpy(out + pre, dict, len);
  memset(out + pre + len, ' ', hlen - len - 1);
  out[total - 1] = '\n';
  memcpy(out + total, data, n);
  return total + n;
}

static const char *read_error(const char *name, const void *file, size_t n) {
  write_file(path_in(name), file, n);
  NpArray a;
  capture_begin();
  bool ok = npy_read(path_in(name), "x", &a);
  const char *err = capture_end();
  if (ok) {
    np_array_free(&a);
    return "";
  }
  return err;
}

static uint32_t crc(const unsigned char *p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; i++) {
    c ^= p[i];
    for (int k = 0; k < 8; k++)
      c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return c ^ 0xFFFFFFFFu;
}

static void put16(unsigned char *p, uint32_t v) { p[0] = (unsigned char)v, p[1] = (unsigned char)(v >> 8); }
static void put32(unsigned char *p, uint32_t v) { put16(p, v & 0xFFFF), put16(p + 2, v >> 16); }

// A zip of entries names[i] holding files[i] (lens[i] bytes), with the compression method given
// (0 stored; 8 claims deflate) and, with bad_crc, a wrong CRC-32 on the first.
static size_t make_zip(unsigned char *out, int n, const char **names, const unsigned char **files, const size_t *lens,
                       int method, bool bad_crc) {
  size_t at = 0, offs[8];
  for (int i = 0; i < n; i++) {
    offs[i] = at;
    unsigned char *h = out + at;
    memset(h, 0, 30);
    put32(h, 0x04034b50);
    put16(h + 8, (uint32_t)method);
    put32(h + 14, crc(files[i], lens[i]) ^ (bad_crc && i == 0));
    put32(h + 18, (uint32_t)lens[i]);
    put32(h + 22, (uint32_t)lens[i]);
    put16(h + 26, (uint32_t)strlen(names[i]));
    memcpy(h + 30, names[i], strlen(names[i]));
    at += 30 + strlen(names[i]);
    memcpy(out + at, files[i], lens[i]);
    at += lens[i];
  }
  size_t cd = at;
  for (int i = 0; i < n; i++) {
    unsigned char *h = out + at;
    memset(h, 0, 46);
    put32(h, 0x02014b50);
    put16(h + 10, (uint32_t)method);
    put32(h + 16, crc(files[i], lens[i]) ^ (bad_crc && i == 0));
    put32(h + 20, (uint32_t)lens[i]);
    put32(h + 24, (uint32_t)lens[i]);
    put16(h + 28, (uint32_t)strlen(names[i]));
    put32(h + 42, (uint32_t)offs[i]);
    memcpy(h + 46, names[i], strlen(names[i]));
    at += 46 + strlen(names[i]);
  }
  unsigned char *e = out + at;
  memset(e, 0, 22);
  put32(e, 0x06054b50);
  put16(e + 8, (uint32_t)n);
  put16(e + 10, (uint32_t)n);
  put32(e + 12, (uint32_t)(at - cd));
  put32(e + 16, (uint32_t)cd);
  return at + 22;
}

static void test_npy(void) {
  float f[12];
  for (int i = 0; i < 12; i++)
    f[i] = (float)i * 0.5f - 1;
  int32_t ids[5] = {3, -1, 7, 0, 2};
  NpArray a;
  bool ok = npy_write(path_in("f.npy"), AT_F32, (Shape){2, {3, 4}}, f) && npy_read(path_in("f.npy"), "f", &a);
  CHECK(ok && a.type == AT_F32 && a.shape.rank == 2 && a.shape.d[0] == 3 && a.shape.d[1] == 4 &&
            !memcmp(a.data, f, sizeof f) && !strcmp(a.name, "f"),
        "npy: f32 [3,4] reads back as written", "type %d rank %d", a.type, a.shape.rank);
  if (ok)
    np_array_free(&a);
  ok = npy_write(path_in("i.npy"), AT_I32, (Shape){1, {5}}, ids) && npy_read(path_in("i.npy"), "i", &a);
  CHECK(ok && a.type == AT_I32 && a.shape.rank == 1 && a.shape.d[0] == 5 && !memcmp(a.data, ids, sizeof ids),
        "npy: i32 [5] reads back as written", "type %d", a.type);
  if (ok)
    np_array_free(&a);

  unsigned char buf[512];
  int64_t longs[3] = {1, -2, (int64_t)1 << 40};
  size_t n = make_npy(buf, 1, "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", longs, sizeof longs);
  write_file(path_in("l.npy"), buf, n);
  ok = npy_read(path_in("l.npy"), "l", &a);
  CHECK(ok && a.type == AT_I64 && a.shape.rank == 1 && a.shape.d[0] == 3 && !memcmp(a.data, longs, sizeof longs),
        "npy: int64 (numpy's default integer) is read", "ok %d", ok);
  if (ok)
    np_array_free(&a);
  double d[2] = {0.25, -3};
  n = make_npy(buf, 2, "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 2), }", d, sizeof d);
  write_file(path_in("d.npy"), buf, n);
  ok = npy_read(path_in("d.npy"), "d", &a);
  CHECK(ok && a.type == AT_F64 && a.shape.rank == 2 && a.shape.d[1] == 2 && !memcmp(a.data, d, sizeof d),
        "npy: format 2.0 and float64 are read", "ok %d", ok);
  if (ok)
    np_array_free(&a);
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", f, 4);
  write_file(path_in("s.npy"), buf, n);
  ok = npy_read(path_in("s.npy"), "s", &a);
  CHECK(ok && a.shape.rank == 0, "npy: a scalar (shape ()) is read", "ok %d", ok);
  if (ok)
    np_array_free(&a);

  struct {
    const char *what, *dict, *want;
    int major;
    size_t bytes;
  } bad[] = {
      {"Fortran order", "{'descr': '<f4', 'fortran_order': True, 'shape': (3, 4), }", "Fortran order", 1, 48},
      {"a big-endian dtype", "{'descr': '>f4', 'fortran_order': False, 'shape': (3, 4), }", "big-endian", 1, 48},
      {"float16", "{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }", "dtype '<f2' is not supported", 1, 4},
      {"a structured dtype", "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", "structured", 1, 8},
      {"a truncated array", "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", "truncated", 1, 40},
      {"bytes after the data", "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", "bytes after the data",
       1, 52},
      {"a header without shape", "{'descr': '<f4', 'fortran_order': False, }", "lacks 'shape'", 1, 48},
      {"format version 4", "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", "version 4.0", 4, 48},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    unsigned char zeros[64] = {0};
    n = make_npy(buf, bad[i].major == 4 ? 1 : bad[i].major, bad[i].dict, zeros, bad[i].bytes);
    if (bad[i].major == 4)
      buf[6] = 4;
    const char *err = read_error("bad.npy", buf, n);
    char name[96];
    snprintf(name, sizeof name, "npy: %s is refused with the file, the array and why", bad[i].what);
    CHECK(strstr(err, "bad.npy") && strstr(err, "array 'x'") && strstr(err, bad[i].want), name, "'%s'", err);
  }
  static const char zip_bytes[] = "PK\003\004 not numpy at all";
  const char *err = read_error("magic.npy", zip_bytes, sizeof zip_bytes - 1);
  CHECK(strstr(err, "magic.npy") && strstr(err, "not a .npy file"), "npy: a bad magic is refused", "'%s'", err);
}

static void test_npz(void) {
  unsigned char x[512], y[512], zip[2048];
  float xs[6] = {1, 2, 3, 4, 5, 6};
  int32_t ys[3] = {0, 1, 0};
  size_t nx = make_npy(x, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2), }", xs, sizeof xs);
  size_t ny = make_npy(y, 1, "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }", ys, sizeof ys);
  const char *names[] = {"x.npy", "targets.npy"};
  const unsigned char *files[] = {x, y};
  size_t lens[] = {nx, ny};
  size_t n = make_zip(zip, 2, names, files, lens, 0, false);
  write_file(path_in("ok.npz"), zip, n);
  NpArray *a;
  int got = npz_read(path_in("ok.npz"), &a);
  CHECK(got == 2 && !strcmp(a[0].name, "x") && !strcmp(a[1].name, "targets") && a[0].shape.d[1] == 2 &&
            !memcmp(a[0].data, xs, sizeof xs) && !memcmp(a[1].data, ys, sizeof ys),
        "npz: the stored arrays read back, named as their entries", "got %d", got);
  for (int i = 0; i < got; i++)
    np_array_free(&a[i]);
  if (got > 0)
    free(a);
  struct {
    const char *what, *want;
    int method;
    bool bad_crc;
  } bad[] = {{"a compressed archive (np.savez_compressed)", "save the arrays with np.savez", 8, false},
             {"a damaged entry", "CRC-32 does not match", 0, true}};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    n = make_zip(zip, 2, names, files, lens, bad[i].method, bad[i].bad_crc);
    write_file(path_in("bad.npz"), zip, n);
    capture_begin();
    got = npz_read(path_in("bad.npz"), &a);
    const char *err = capture_end();
    char name[96];
    snprintf(name, sizeof name, "npz: %s is refused, naming the file and the entry", bad[i].what);
    CHECK(got == -1 && strstr(err, "bad.npz") && strstr(err, "x.npy") && strstr(err, bad[i].want), name, "'%s'", err);
  }
  // Every truncation and every byte changed of a good archive: read or refused, never a crash (under
  // make sanitize, never a read outside the file), and a damaged entry never reads as good.
  n = make_zip(zip, 2, names, files, lens, 0, false);
  int bad_reads = 0, refused = 0;
  capture_begin();
  for (size_t cut = 0; cut <= n + n; cut++) {
    unsigned char copy[2048];
    memcpy(copy, zip, n);
    size_t len = cut < n ? cut : n;
    if (cut >= n && cut - n < n)
      copy[cut - n] ^= 0x5a;
    write_file(path_in("mut.npz"), copy, len);
    got = npz_read(path_in("mut.npz"), &a);
    refused += got < 0;
    for (int i = 0; i < got; i++) {
      bad_reads += a[i].shape.rank == 2 && memcmp(a[i].data, xs, sizeof xs) && !strcmp(a[i].name, "x");
      np_array_free(&a[i]);
    }
    if (got >= 0)
      free(a);
  }
  capture_end();
  CHECK(bad_reads == 0 && refused > (int)n, "npz: every truncation and byte flip of an archive is refused or reads "
        "the right values", "%d bad reads, %d refused", bad_reads, refused);
  write_file(path_in("text.npz"), "not a zip", 9);
  capture_begin();
  got = npz_read(path_in("text.npz"), &a);
  const char *err = capture_end();
  CHECK(got == -1 && strstr(err, "not a zip archive"), "npz: a file that is no zip is refused", "'%s'", err);
}

static const char model[] = "model m\n"
                            "dim B in 1..64\n"
                            "input x: f32[B, 3]\n"
                            "input y: i32[B]\n"
                            "param w: [3, 2] = normal(0.1)\n"
                            "output loss = mean(cross_entropy(x @ w, y))\n"
                            "train {\n B = 4\n}\n";

// A dataset folder: n examples, x[e] = (e, e + 0.5, -e), y[e] = e % 2 (as y_type).
static void write_set(const char *dir, int64_t n, ArrayType y_type, int64_t x_cols) {
  mkdir(dir, 0777);
  float *x = malloc(sizeof(float) * (size_t)(n * x_cols));
  int64_t *y = malloc(sizeof(int64_t) * (size_t)n);
  int32_t *y32 = malloc(sizeof(int32_t) * (size_t)n);
  for (int64_t e = 0; e < n; e++) {
    for (int64_t c = 0; c < x_cols; c++)
      x[e * x_cols + c] = c == 0 ? (float)e : c == 1 ? (float)e + 0.5f : -(float)e;
    y[e] = y32[e] = (int32_t)(e % 2);
  }
  char p[600];
  snprintf(p, sizeof p, "%s/x.npy", dir);
  npy_write(p, AT_F32, (Shape){2, {n, x_cols}}, x);
  snprintf(p, sizeof p, "%s/y.npy", dir);
  npy_write(p, y_type, (Shape){1, {n}}, y_type == AT_I64 ? (void *)y : (void *)y32);
  free(x);
  free(y);
  free(y32);
}

static const char *check_error(const char *dir, const Graph *g) {
  capture_begin();
  bool ok = arrays_check(dir, g, 0.2);
  const char *err = capture_end();
  return ok ? "" : err;
}

static void test_datasets(void) {
  Arena *ar = arena_new();
  Graph *g = mdl_compile_text(ar, "m.mdl", model, NULL, 0);
  if (!g) {
    CHECK(false, "arrays: the test model compiles", "no graph");
    return;
  }
  char *set = path_in("set");
  write_set(set, 10, AT_I64, 3);
  CHECK(arrays_found(set), "arrays: a folder of .npy files is an array dataset", "no");
  CHECK(!*check_error(set, g), "arrays: x f32 [10,3] and y int64 [10] fit inputs x: f32[B,3], y: i32[B]", "'%s'",
        captured);

  // The held-out split: 2 of 10 (--val-fraction 0.2), the same every time, disjoint from train.
  LoaderOptions lo = {.B = 4, .model = g, .val_fraction = 0.2};
  Loader *tr = loader_open(set, "train", lo), *va = loader_open(set, "val", lo);
  bool seen[10] = {false};
  int64_t count = 0;
  Batch b;
  for (int split = 0; tr && va && split < 2; split++) {
    Loader *l = split ? va : tr;
    int64_t rows = loader_rows(l);
    for (int64_t k = 0; k < (rows + 3) / 4; k++) {
      loader_next(l, &b);
      for (int64_t r = 0; r < 4 && k * 4 + r < rows; r++) {
        int e = (int)b.inputs[0].f[r * 3];
        count += !seen[e];
        seen[e] = true;
      }
    }
  }
  CHECK(tr && va && loader_rows(tr) == 8 && loader_rows(va) == 2 && count == 10,
        "arrays: --val-fraction 0.2 holds out 2 of 10 examples, the rest train, none in both", "train %lld val %lld, "
        "%lld distinct", tr ? (long long)loader_rows(tr) : -1LL, va ? (long long)loader_rows(va) : -1LL,
        (long long)count);
  loader_close(tr);
  loader_close(va);

  // In order: rows 0..3, then 4..7, then 8, 9 and the next epoch's 0, 1; y converted from int64.
  mkdir(path_in("split"), 0777);
  write_set(path_in("split/train"), 10, AT_I64, 3);
  write_set(path_in("split/val"), 3, AT_I32, 3);
  Loader *l = loader_open(path_in("split"), "train", lo);
  bool in_order = l != NULL;
  for (int k = 0; l && k < 3; k++) {
    loader_next(l, &b);
    for (int r = 0; r < 4; r++) {
      int e = (k * 4 + r) % 10;
      in_order &= b.ninputs == 2 && b.inputs[0].f[r * 3 + 1] == (float)e + 0.5f && b.inputs[1].ids[r] == e % 2 &&
                  b.inputs[0].numel == 12 && b.inputs[1].numel == 4;
    }
  }
  CHECK(in_order && loader_state(l).epoch == 1 && loader_state(l).position == 2,
        "arrays: train/ in order, B rows a batch, running across the epoch's end", "state %lld,%lld",
        l ? (long long)loader_state(l).epoch : -1LL, l ? (long long)loader_state(l).position : -1LL);
  loader_close(l);
  Loader *v = loader_open(path_in("split"), "val", lo);
  CHECK(v && loader_rows(v) == 3, "arrays: val/ is the val split", "%lld", v ? (long long)loader_rows(v) : -1LL);
  loader_close(v);

  // Shuffled: each epoch a permutation; a loader sought to a state draws what the first drew from it.
  lo.shuffle = true;
  lo.seed = 7;
  Loader *s1 = loader_open(path_in("split"), "train", lo), *s2 = loader_open(path_in("split"), "train", lo);
  int drawn[20], again[8];
  LoaderState mid = {0, 0};
  for (int k = 0; s1 && k < 5; k++) {
    if (k == 3)
      mid = loader_state(s1);
    loader_next(s1, &b);
    for (int r = 0; r < 4; r++)
      drawn[k * 4 + r] = (int)b.inputs[0].f[r * 3];
  }
  bool perm = s1 != NULL, moved = false;
  for (int ep = 0; perm && ep < 2; ep++) {
    bool hit[10] = {false};
    for (int i = 0; i < 10; i++)
      hit[drawn[ep * 10 + i]] = true;
    for (int i = 0; i < 10; i++)
      perm &= hit[i];
  }
  for (int i = 0; i < 10; i++)
    moved |= drawn[i] != i;
  bool same = s2 && loader_seek(s2, mid);
  for (int k = 0; same && k < 2; k++) {
    loader_next(s2, &b);
    for (int r = 0; r < 4; r++)
      again[k * 4 + r] = (int)b.inputs[0].f[r * 3];
  }
  CHECK(perm && moved, "arrays: shuffled, each epoch draws every example once, not in order", "perm %d moved %d",
        perm, moved);
  CHECK(same && !memcmp(again, drawn + 12, sizeof again), "arrays: a loader sought to a saved state draws the same "
        "batches (resume)", "same %d", same);
  loader_close(s1);
  loader_close(s2);

  // One .safetensors file holding both arrays (f32 x, i32 y): the val split held out of it.
  float xs[30];
  int32_t ys[10];
  for (int e = 0; e < 10; e++) {
    xs[3 * e] = (float)e, xs[3 * e + 1] = xs[3 * e + 2] = 0;
    ys[e] = e % 2;
  }
  StTensor t[2] = {{.name = "x", .dtype = DT_F32, .shape = {2, {10, 3}}, .data = xs},
                   {.name = "y", .dtype = DT_I32, .shape = {1, {10}}, .data = ys}};
  st_write(path_in("set.safetensors"), t, 2);
  lo.val_fraction = 0.3;
  Loader *st = loader_open(path_in("set.safetensors"), "train", lo);
  bool fine = st && loader_rows(st) == 7;
  for (int k = 0; fine && k < 2; k++) {
    loader_next(st, &b);
    for (int r = 0; r < 4; r++)
      fine &= b.inputs[1].ids[r] == (int)b.inputs[0].f[3 * r] % 2;
  }
  CHECK(arrays_found(path_in("set.safetensors")) && fine, "arrays: a .safetensors file is a dataset, 3 of its 10 "
        "examples held out", "rows %lld", st ? (long long)loader_rows(st) : -1LL);
  loader_close(st);

  // Refusals, each naming the file and the array, or the input.
  write_set(path_in("cols"), 10, AT_I32, 4);
  const char *err = check_error(path_in("cols"), g);
  CHECK(strstr(err, "cols/x.npy") && strstr(err, "array 'x' is [10,4]") && strstr(err, "f32[4,3]"),
        "arrays: an example of the wrong shape is refused, naming the file, the array and the input", "'%s'", err);
  write_set(path_in("noy"), 10, AT_I32, 3);
  remove(path_in("noy/y.npy"));
  err = check_error(path_in("noy"), g);
  CHECK(strstr(err, "no array 'y'") && strstr(err, "input y: i32[4]"), "arrays: a missing input is named",
        "'%s'", err);
  write_set(path_in("fy"), 10, AT_I32, 3);
  float fy[10] = {0};
  npy_write(path_in("fy/y.npy"), AT_F32, (Shape){1, {10}}, fy);
  err = check_error(path_in("fy"), g);
  CHECK(strstr(err, "fy/y.npy") && strstr(err, "array 'y' is float32") && strstr(err, "is i32"),
        "arrays: a float array for an i32 input is refused", "'%s'", err);
  write_set(path_in("big"), 10, AT_I32, 3);
  int64_t huge[10] = {0, 1, 0, (int64_t)1 << 33};
  npy_write(path_in("big/y.npy"), AT_I64, (Shape){1, {10}}, huge);
  err = check_error(path_in("big"), g);
  CHECK(strstr(err, "element 3 is 8589934592, outside int32"), "arrays: an int64 label outside int32 is refused",
        "'%s'", err);
  write_set(path_in("count"), 10, AT_I32, 3);
  int32_t y9[9] = {0};
  npy_write(path_in("count/y.npy"), AT_I32, (Shape){1, {9}}, y9);
  err = check_error(path_in("count"), g);
  CHECK(strstr(err, "array 'y' holds 9 examples, array 'x'"), "arrays: arrays of different example counts are "
        "refused", "'%s'", err);
  arena_free(ar);
}

// Shuffled epochs: each epoch's order a permutation of the examples, another in the next epoch
// (loader_permute's for that epoch), and a loader sought to a state in the middle of an epoch goes on
// with that epoch's order, then the next's, as the uninterrupted loader does. Example e's first
// feature is e, so the draws name the examples.
static void test_epochs(void) {
  Arena *ar = arena_new();
  Graph *g = mdl_compile_text(ar, "m.mdl", model, NULL, 0);
  mkdir(path_in("ep"), 0777);
  write_set(path_in("ep/train"), 10, AT_I32, 3);
  write_set(path_in("ep/val"), 3, AT_I32, 3);
  LoaderOptions lo = {.B = 4, .model = g, .shuffle = true, .seed = 7};
  Loader *l = g ? loader_open(path_in("ep"), "train", lo) : NULL;
  int drawn[32];
  Batch b;
  for (int k = 0; l && k < 8; k++) {
    loader_next(l, &b);
    for (int r = 0; r < 4; r++)
      drawn[4 * k + r] = (int)b.inputs[0].f[3 * r];
  }
  bool perm = l != NULL, formula = l != NULL;
  for (int ep = 0; l && ep < 3; ep++) {
    int hit[10] = {0};
    for (int i = 0; i < 10; i++) {
      hit[drawn[10 * ep + i]]++;
      formula &= drawn[10 * ep + i] == loader_permute(7, ep, 10, i);
    }
    for (int i = 0; i < 10; i++)
      perm &= hit[i] == 1;
  }
  CHECK(perm, "epochs: each shuffled epoch draws every example once", "drawn %d %d %d ...", drawn[0], drawn[1],
        drawn[2]);
  CHECK(l && memcmp(drawn, drawn + 10, 10 * sizeof *drawn) && memcmp(drawn + 10, drawn + 20, 10 * sizeof *drawn),
        "epochs: two epochs' orders differ", "epoch 0 %d %d %d, epoch 1 %d %d %d", drawn[0], drawn[1], drawn[2],
        drawn[10], drawn[11], drawn[12]);
  CHECK(formula, "epochs: epoch k's order is loader_permute(seed, k, n, i) for i = 0..n-1", "no");
  loader_close(l);

  // Resumed at epoch 1, position 6 (16 examples drawn: one epoch of 10, then 6): the next 16 draws are
  // the uninterrupted loader's, epoch 1's last 4 then epoch 2's first 12.
  Loader *r = g ? loader_open(path_in("ep"), "train", lo) : NULL;
  bool same = r && loader_seek(r, (LoaderState){1, 6});
  for (int k = 0; same && k < 4; k++) {
    loader_next(r, &b);
    for (int i = 0; i < 4; i++)
      same &= (int)b.inputs[0].f[3 * i] == drawn[16 + 4 * k + i];
  }
  CHECK(same && loader_state(r).epoch == 3 && loader_state(r).position == 2,
        "epochs: a loader resumed mid-epoch continues that epoch's order into the next", "same %d", same);
  loader_close(r);
  arena_free(ar);
}

// Values checked when the arrays are opened, against what the model makes of them: NaN and infinity
// in a float input; a cross_entropy's targets below its class count (a negative one is ignored, so
// allowed); an embed's ids in [0, rows), also through a reshape. Each refusal names the file, the
// array, the example (the row of the file's first axis) and the value.
static const char embed_model[] = "model e\n"
                                  "dim B in 1..64\n"
                                  "input ids: i32[B, 2]\n"
                                  "input y: i32[B]\n"
                                  "param tab: [5, 3] = normal(0.1)\n"
                                  "param w: [3, 2] = normal(0.1)\n"
                                  "h = sum(embed(table=tab, ids=reshape(ids, [B, 2])), axis=1)\n"
                                  "output loss = mean(cross_entropy(h @ w, y))\n"
                                  "train {\n B = 4\n}\n";

static void test_values(void) {
  Arena *ar = arena_new();
  Graph *g = mdl_compile_text(ar, "m.mdl", model, NULL, 0), *ge = mdl_compile_text(ar, "e.mdl", embed_model, NULL, 0);
  if (!g || !ge) {
    CHECK(false, "values: the test models compile", "no graph");
    return;
  }
  float x[30];
  for (int i = 0; i < 30; i++)
    x[i] = (float)i;
  x[6 * 3 + 1] = NAN;
  write_set(path_in("nan"), 10, AT_I32, 3);
  npy_write(path_in("nan/x.npy"), AT_F32, (Shape){2, {10, 3}}, x);
  const char *err = check_error(path_in("nan"), g);
  CHECK(strstr(err, "nan/x.npy: error: array 'x', example 6, element 1 is nan: the model's input 'x' takes finite "
                "numbers only"), "values: a NaN feature is refused when opened, naming file, array, example, element",
        "'%s'", err);
  double xd[30] = {0};
  xd[9 * 3] = 1e300;
  npy_write(path_in("nan/x.npy"), AT_F64, (Shape){2, {10, 3}}, xd);
  err = check_error(path_in("nan"), g);
  CHECK(strstr(err, "array 'x', example 9, element 0 is 1e+300, beyond float32's range"),
        "values: a float64 feature that is infinite in float32 is refused", "'%s'", err);
  x[6 * 3 + 1] = -INFINITY;
  npy_write(path_in("nan/x.npy"), AT_F32, (Shape){2, {10, 3}}, x);
  err = check_error(path_in("nan"), g);
  CHECK(strstr(err, "array 'x', example 6, element 1 is -inf"), "values: an infinite feature is refused", "'%s'", err);

  // Targets: the model's cross_entropy has 2 classes (x @ w, w [3, 2]).
  write_set(path_in("tgt"), 10, AT_I32, 3);
  int32_t y[10] = {0, 1, 0, 1, 0, 1, 0, 1, 0, 1};
  y[3] = -1;
  npy_write(path_in("tgt/y.npy"), AT_I32, (Shape){1, {10}}, y);
  err = check_error(path_in("tgt"), g);
  CHECK(!*err, "values: a negative target (ignored by cross_entropy) is accepted", "'%s'", err);
  y[7] = 2;
  npy_write(path_in("tgt/y.npy"), AT_I32, (Shape){1, {10}}, y);
  err = check_error(path_in("tgt"), g);
  CHECK(strstr(err, "tgt/y.npy: error: array 'y', example 7 is 2, not below 2: the model's input 'y' is the targets "
                "of a cross_entropy (m.mdl:6:20) over 2 classes"),
        "values: a target at the class count is refused when opened, naming file, array, example and the loss",
        "'%s'", err);

  // Ids: the embed's table has 5 rows; targets 2 classes; ids [10, 2] reach the embed through a reshape.
  mkdir(path_in("ids"), 0777);
  int32_t ids[20], ye[10] = {0};
  for (int i = 0; i < 20; i++)
    ids[i] = i % 5;
  npy_write(path_in("ids/ids.npy"), AT_I32, (Shape){2, {10, 2}}, ids);
  npy_write(path_in("ids/y.npy"), AT_I32, (Shape){1, {10}}, ye);
  err = check_error(path_in("ids"), ge);
  CHECK(!*err, "values: ids 0..4 of a 5-row table are accepted", "'%s'", err);
  ids[2 * 4 + 1] = 5;
  npy_write(path_in("ids/ids.npy"), AT_I32, (Shape){2, {10, 2}}, ids);
  err = check_error(path_in("ids"), ge);
  CHECK(strstr(err, "ids/ids.npy: error: array 'ids', example 4, element 1 is 5, outside [0, 5): the model's input "
                "'ids' is the ids of an embed (e.mdl:7:9) whose table has 5 rows"),
        "values: an id past the table is refused when opened, naming file, array, example, element", "'%s'", err);
  ids[2 * 4 + 1] = -1;
  npy_write(path_in("ids/ids.npy"), AT_I32, (Shape){2, {10, 2}}, ids);
  err = check_error(path_in("ids"), ge);
  CHECK(strstr(err, "array 'ids', example 4, element 1 is -1, outside [0, 5)"), "values: a negative id is refused",
        "'%s'", err);
  arena_free(ar);
}

int main(void) {
  snprintf(tmp, sizeof tmp, "/tmp/mdl-arrays-XXXXXX");
  if (!mkdtemp(tmp)) {
    perror("mkdtemp");
    return 1;
  }
  test_npy();
  test_npz();
  test_datasets();
  test_values();
  test_epochs();
  nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  TEST_EXIT();
}
