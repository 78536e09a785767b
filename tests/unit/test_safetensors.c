// test_safetensors.c: round trips through st_write/st_read, files laid out byte by byte the way
// Python's json.dumps + struct.pack write them, and one corrupt file per check the reader makes,
// each of which must fail with its own message.
#include "mdl.h"
#include "test.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[64], path[256], msg[2048];

static const char *at(const char *name) {
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return path;
}

// A file as a writer in another language lays it out: 8-byte little-endian length, the header
// exactly as given (no padding), the data.
static void write_raw(const char *name, uint64_t hlen, const char *header, const void *data, size_t n) {
  FILE *f = fopen(at(name), "wb");
  for (int k = 0; k < 8; k++)
    fputc((int)((hlen >> (8 * k)) & 0xFF), f);
  fwrite(header, 1, strlen(header), f);
  if (n)
    fwrite(data, 1, n, f);
  fclose(f);
}

// st_read with stderr captured into msg.
static bool read_quiet(Arena *a, const char *p, StFile *out) {
  fflush(stderr);
  int saved = dup(2);
  FILE *cap = tmpfile();
  dup2(fileno(cap), 2);
  bool ok = st_read(a, p, out);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  rewind(cap);
  size_t n = fread(msg, 1, sizeof msg - 1, cap);
  msg[n] = 0;
  fclose(cap);
  return ok;
}

static bool write_quiet(const char *p, const StTensor *t, int n) {
  fflush(stderr);
  int saved = dup(2);
  FILE *cap = tmpfile();
  dup2(fileno(cap), 2);
  bool ok = st_write(p, t, n);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  rewind(cap);
  size_t k = fread(msg, 1, sizeof msg - 1, cap);
  msg[k] = 0;
  fclose(cap);
  return ok;
}

// Entries in the test directory whose name contains ".tmp.".
static int temp_files(void) {
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    n += strstr(e->d_name, ".tmp.") != NULL;
  closedir(d);
  return n;
}

static void test_round_trip(void) {
  float f32[6] = {1.5f, -2, 3.25f, 0, 1e-30f, -7};
  int32_t i32[4] = {0, -1, 255, 2147483647};
  uint16_t bf16[4] = {0x3F80, 0xC000, 0x0000, 0x7F80};
  double f64[1] = {3.141592653589793};
  StTensor t[] = {
      {"h.0.attn_w", DT_F32, {2, {2, 3}}, f32},
      {"tokens", DT_I32, {1, {4}}, i32},
      {"half", DT_BF16, {2, {2, 2}}, bf16},
      {"loss", DT_F64, {0, {0}}, f64},
      {"empty", DT_F32, {2, {0, 3}}, f32},
      {"odd \"name\"\n", DT_F32, {1, {1}}, f32},
  };
  int n = (int)(sizeof t / sizeof t[0]);
  CHECK(write_quiet(at("rt.safetensors"), t, n), "write several dtypes", "%s", msg);
  CHECK(temp_files() == 0, "no temp file is left behind", "%d left", temp_files());

  Arena *a = arena_new();
  StFile f;
  bool ok = read_quiet(a, at("rt.safetensors"), &f);
  CHECK(ok && f.n == n, "read back", "ok %d, %d tensors: %s", ok, f.n, msg);
  for (int i = 0; ok && i < n && i < f.n; i++) {
    size_t bytes = (size_t)shape_numel(t[i].shape) * (t[i].dtype == DT_BF16 ? 2 : t[i].dtype == DT_F64 ? 8 : 4);
    bool same = strcmp(f.t[i].name, t[i].name) == 0 && f.t[i].dtype == t[i].dtype &&
                shape_eq(f.t[i].shape, t[i].shape) && memcmp(f.t[i].data, t[i].data, bytes) == 0;
    char name[96];
    snprintf(name, sizeof name, "round trip keeps order, name, dtype, shape, data: tensor %d", i);
    CHECK(same, name, "got '%s' dtype %d rank %d", f.t[i].name, (int)f.t[i].dtype, f.t[i].shape.rank);
  }
  const StTensor *tok = st_find(&f, "tokens");
  CHECK(tok && ((int32_t *)tok->data)[3] == 2147483647, "st_find", "tokens not found or wrong");
  CHECK(st_find(&f, "nothing") == NULL, "st_find of a missing name", "found something");

  // The header is padded with spaces to a multiple of 8 and the data follows it.
  FILE *fp = fopen(at("rt.safetensors"), "rb");
  unsigned char len8[8];
  size_t got = fread(len8, 1, 8, fp);
  uint64_t hlen = 0;
  for (int k = 7; k >= 0; k--)
    hlen = hlen << 8 | len8[k];
  char *hdr = calloc(1, hlen + 1);
  got += fread(hdr, 1, hlen, fp);
  fclose(fp);
  CHECK(got == 8 + hlen && hlen % 8 == 0 && hdr[0] == '{' && strrchr(hdr, '}') &&
            strspn(strrchr(hdr, '}') + 1, " ") == strlen(strrchr(hdr, '}') + 1),
        "header padded with spaces to 8 bytes", "length %llu: %s", (unsigned long long)hlen, hdr);
  free(hdr);

  // Writing again replaces the file.
  CHECK(write_quiet(at("rt.safetensors"), t + 1, 1), "overwrite", "%s", msg);
  ok = read_quiet(a, at("rt.safetensors"), &f);
  CHECK(ok && f.n == 1 && strcmp(f.t[0].name, "tokens") == 0, "overwrite replaces the file", "%d tensors", f.n);
  arena_free(a);

  StTensor f8 = {"x", DT_F8E4M3, {1, {1}}, f32};
  CHECK(!write_quiet(at("f8.safetensors"), &f8, 1) && strstr(msg, "cannot be stored"), "unsupported dtype on write",
        "'%s'", msg);
  StTensor dup2x[] = {t[1], t[1]};
  CHECK(!write_quiet(at("dup.safetensors"), dup2x, 2) && strstr(msg, "two tensors named 'tokens'"),
        "repeated name on write", "'%s'", msg);
  CHECK(!write_quiet("/nonexistent-dir/x.safetensors", t, 1) &&
            strstr(msg, "/nonexistent-dir/x.safetensors: error: cannot write: No such file or directory"),
        "write into a missing directory", "'%s'", msg);
  CHECK(temp_files() == 0, "failed writes leave no temp file", "%d left", temp_files());
}

// Laid out as Python's json.dumps (", " and ": " separators, \u escapes) with an unpadded header
// whose length is not a multiple of 8, so the tensors sit at odd file offsets.
// Metadata strings (a checkpoint's step, model, data position) survive a round trip.
static void test_metadata(void) {
  float x[2] = {1, 2};
  StTensor t[] = {{"x", DT_F32, {1, {2}}, x}};
  StMeta meta[] = {{"mdl.step", "1200"}, {"mdl.model", "gpt2 \"tiny\""}};
  CHECK(st_write_meta(at("meta.safetensors"), t, 1, meta, 2), "write with metadata", "write failed");
  Arena *a = arena_new();
  StFile f;
  bool ok = st_read(a, at("meta.safetensors"), &f);
  CHECK(ok && f.n == 1 && f.nmeta == 2, "read back a tensor and two metadata strings", "n %d, nmeta %d", f.n, f.nmeta);
  const char *step = ok ? st_meta(&f, "mdl.step") : NULL, *model = ok ? st_meta(&f, "mdl.model") : NULL;
  CHECK(step && !strcmp(step, "1200"), "metadata value mdl.step", "got %s", step ? step : "(none)");
  CHECK(model && !strcmp(model, "gpt2 \"tiny\""), "metadata value with quotes", "got %s", model ? model : "(none)");
  CHECK(ok && !st_meta(&f, "mdl.absent"), "absent metadata key reads as NULL", "found");
  CHECK(ok && ((float *)f.t[0].data)[1] == 2, "tensor data after metadata", "wrong data");
  StFile h;
  ok = st_read_header(a, at("meta.safetensors"), &h);
  CHECK(ok && h.n == 1 && !strcmp(h.t[0].name, "x") && h.t[0].shape.d[0] == 2 && !h.t[0].data &&
        st_meta(&h, "mdl.step") && !strcmp(st_meta(&h, "mdl.step"), "1200"),
        "st_read_header: names, shapes and metadata, no data", "ok %d, n %d", ok, h.n);
  arena_free(a);
}

static void test_foreign_file(void) {
  const char *hdr = "{\"b\": {\"dtype\": \"I32\", \"shape\": [2], \"data_offsets\": [8, 16]}, "
                    "\"a\\u00e9\\ud83d\\ude00\": {\"dtype\": \"F32\", \"shape\": [1, 2], \"data_offsets\": [0, 8]}, "
                    "\"__metadata__\": {\"format\": \"pt\"}}";
  unsigned char data[16] = {0, 0, 0x80, 0x3F, 0, 0, 0, 0xC0, 7, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF};
  write_raw("py.safetensors", strlen(hdr), hdr, data, sizeof data);
  Arena *a = arena_new();
  StFile f;
  bool ok = read_quiet(a, at("py.safetensors"), &f);
  CHECK(ok && f.n == 2, "read a file laid out by Python", "%s", msg);
  if (ok && f.n == 2) {
    const int32_t *b = f.t[0].data;
    const float *af = f.t[1].data;
    CHECK(strcmp(f.t[0].name, "b") == 0 && f.t[0].dtype == DT_I32 && b[0] == 7 && b[1] == -1,
          "i32 tensor from a foreign file", "%s %d %d", f.t[0].name, b[0], b[1]);
    CHECK(strcmp(f.t[1].name, "a\xC3\xA9\xF0\x9F\x98\x80") == 0, "\\u escapes and surrogate pairs decode to UTF-8",
          "'%s'", f.t[1].name);
    CHECK(f.t[1].shape.rank == 2 && f.t[1].shape.d[1] == 2 && af[0] == 1.0f && af[1] == -2.0f,
          "f32 tensor from a foreign file", "%g %g", af[0], af[1]);
  }
  write_raw("none.safetensors", 2, "{}", NULL, 0);
  CHECK(read_quiet(a, at("none.safetensors"), &f) && f.n == 0, "a file with no tensors", "%s", msg);
  arena_free(a);
}

typedef struct {
  const char *name, *header;
  size_t data_len;
  const char *want; // part of the message
} Bad;

static void test_corrupt(void) {
  static const Bad bad[] = {
      {"bad JSON: missing brace", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}", 4,
       "bad header JSON at byte 53: expected ',' or '}'"},
      {"bad JSON: text after the object", "{} x", 0, "unexpected text after the header object"},
      {"bad JSON: unterminated string", "{\"a", 0, "unterminated string"},
      {"bad JSON: bad escape", "{\"a\\x\":{}}", 0, "bad escape"},
      {"bad JSON: bare word", "{\"a\":nope}", 0, "bad number"},
      {"bad JSON: trailing comma", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},}", 4,
       "expected a member name"},
      {"not an object", "[1, 2]", 0, "not a safetensors file"},
      {"offsets out of range", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
       "tensor 'a': data_offsets [0, 8] out of range: the data area has 4 bytes"},
      {"offsets reversed", "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4,
       "tensor 'a': data_offsets [4, 0] end before they begin"},
      {"wrong size for dtype", "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
       "tensor 'a': F32[3] needs 12 bytes, data_offsets give 8"},
      {"size overflow", "{\"a\":{\"dtype\":\"F64\",\"shape\":[1099511627776,1099511627776],\"data_offsets\":[0,8]}}",
       8, "F64[1099511627776,1099511627776] needs more bytes than 64 bits can count"},
      {"overlapping tensors",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
       12, "tensors 'a' and 'b' overlap"},
      {"hole in the data",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
       12, "bytes [4, 8) of the data area belong to no tensor"},
      {"trailing data", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8,
       "bytes [4, 8) of the data area belong to no tensor"},
      {"unsupported dtype", "{\"a\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]}}", 2,
       "unsupported dtype 'F16'"},
      {"missing data_offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "tensor 'a': missing 'data_offsets'"},
      {"unknown key", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4,
       "unexpected key 'x'"},
      {"duplicate tensor name",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
       8, "duplicate key 'a'"},
      {"negative dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "shape holds"},
      {"fractional dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, "shape holds"},
      {"too many axes", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
       "more than 6 axes"},
      {"one offset", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]}}", 4,
       "data_offsets must be two non-negative integers"},
      {"metadata not an object", "{\"__metadata__\":3}", 0, "__metadata__ is not an object"},
  };
  Arena *a = arena_new();
  StFile f;
  static const unsigned char zeros[128];
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    write_raw("bad.safetensors", strlen(bad[i].header), bad[i].header, zeros, bad[i].data_len);
    bool ok = read_quiet(a, at("bad.safetensors"), &f);
    char prefix[300];
    snprintf(prefix, sizeof prefix, "%s: error: ", at("bad.safetensors"));
    CHECK(!ok && strncmp(msg, prefix, strlen(prefix)) == 0 && strstr(msg, bad[i].want) && f.n == 0, bad[i].name,
          "ok %d, message '%s'", ok, msg);
  }

  write_raw("trunc.safetensors", 1234, "{\"a\":", zeros, 100 - 8 - 5);
  CHECK(!read_quiet(a, at("trunc.safetensors"), &f) && strstr(msg, "truncated: header says 1234 bytes, file has 100"),
        "header longer than the file", "'%s'", msg);
  FILE *fp = fopen(at("tiny.safetensors"), "wb");
  fwrite("abcde", 1, 5, fp);
  fclose(fp);
  CHECK(!read_quiet(a, at("tiny.safetensors"), &f) && strstr(msg, "truncated: file has 5 bytes"),
        "file shorter than the length field", "'%s'", msg);
  CHECK(!read_quiet(a, at("missing.safetensors"), &f) && strstr(msg, "cannot open: No such file or directory"),
        "missing file", "'%s'", msg);
  CHECK(!read_quiet(a, dir, &f) && strstr(msg, "not a regular file"), "a directory", "'%s'", msg);
  arena_free(a);
}

int main(void) {
  snprintf(dir, sizeof dir, "/tmp/mdl-st-XXXXXX");
  if (!mkdtemp(dir)) {
    printf("[fail] mkdtemp\n");
    return 1;
  }
  test_round_trip();
  test_foreign_file();
  test_metadata();
  test_corrupt();
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0)
    printf("[fail] removing %s\n", dir);
  TEST_EXIT();
}
