// test_fp8.c: the fp8 conversions of the emitted CUDA prelude (mdl_f32_to_e4m3 / e5m2, mdl_e4m3 / e5m2_to_f32).
//  1. On the CPU: the prelude is compiled with tests/unit/cuda_emu.h (g++ -Wall -Wextra -Werror) with a
//     small driver calling the conversions, and NVIDIA's own host conversions (cuda_fp8.h:
//     __nv_cvt_float_to_fp8 with __NV_SATFINITE, __nv_cvt_fp8_to_halfraw) are compiled apart as the
//     reference. Checked: hand-computed encodings (ties to even in the normal and subnormal ranges,
//     saturation, infinities, NaN, signed zero); all 256 codes of both formats widen to the values of
//     the formats' definitions (computed here with ldexp) and to NVIDIA's (NaNs as NaN); every non-NaN
//     code encodes back to itself; and encodings agree bit for bit with NVIDIA's on every float16 value
//     read as a float, every fp8 value, the midpoints between neighbours (ties) and the floats just
//     around them, +-0, +-inf, NaNs, values beyond the largest, float subnormals and 4M random floats.
//     The host's conversions (runtime/kernels/fp8_bits.h, the C back end's and the interpreter's) pass the
//     same checks, even without a compiler, and encode and widen bit for bit as the emulated prelude.
//  2. NVRTC: the prelude with a kernel using the conversions compiles for sm_80 (software path) and
//     sm_89, sm_90, sm_100 and sm_120 (cvt.rn.satfinite) without an error or a warning.
//  3. On a GPU of sm_89 or later: the hardware encoders agree with the software ones on all 2^32 floats.
// Without g++, cuda_fp8.h, NVRTC or a GPU the checks that need them print "[skip] ..." lines.
#include "mdl.h"
#include "emit_cuda.h"
#include "cuda.h"
#include "test.h"
#include "harness.h"

#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fp8_bits.h"

typedef void (*EncodeFn)(const float *x, uint8_t *e4, uint8_t *e5, long n);
typedef void (*DecodeFn)(float *e4, float *e5);

// The two formats: mantissa bits, exponent bias, the largest finite code.
typedef struct {
  const char *name;
  int man, bias;
  uint8_t max;
} Format;

static const Format e4m3 = {"e4m3", 3, 7, 0x7e}, e5m2 = {"e5m2", 2, 15, 0x7b};

static const char driver[] =
    "extern \"C\" void fp8_encode(const float *x, uint8_t *e4, uint8_t *e5, long n) {\n"
    "  for (long i = 0; i < n; i++) {\n"
    "    e4[i] = mdl_f32_to_e4m3(x[i]);\n"
    "    e5[i] = mdl_f32_to_e5m2(x[i]);\n"
    "  }\n"
    "}\n"
    "extern \"C\" void fp8_decode(float *e4, float *e5) {\n"
    "  for (int c = 0; c < 256; c++) {\n"
    "    e4[c] = mdl_e4m3_to_f32((uint8_t)c);\n"
    "    e5[c] = mdl_e5m2_to_f32((uint8_t)c);\n"
    "  }\n"
    "}\n";

static const char reference[] =
    "#include <cuda_fp8.h>\n"
    "extern \"C\" void fp8_encode(const float *x, unsigned char *e4, unsigned char *e5, long n) {\n"
    "  for (long i = 0; i < n; i++) {\n"
    "    e4[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);\n"
    "    e5[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E5M2);\n"
    "  }\n"
    "}\n"
    "extern \"C\" void fp8_decode(float *e4, float *e5) {\n"
    "  for (int c = 0; c < 256; c++) {\n"
    "    e4[c] = __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3)));\n"
    "    e5[c] = __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E5M2)));\n"
    "  }\n"
    "}\n";

// A kernel that makes NVRTC generate code for every conversion, and the GPU check: hardware encoders
// against the software reference over every 32-bit pattern (counts and the smallest input that differs).
static const char kernels[] =
    "extern \"C\" __global__ void fp8_roundtrip(const float *x, float *y, int n) {\n"
    "  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "  if (i < n)\n"
    "    y[i] = mdl_e4m3_to_f32(mdl_f32_to_e4m3(x[i])) + mdl_e5m2_to_f32(mdl_f32_to_e5m2(x[i]));\n"
    "}\n"
    "extern \"C\" __global__ void fp8_hw_vs_sw(unsigned long long *bad, unsigned *first) {\n"
    "  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;\n"
    "  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32); i += stride) {\n"
    "    const float x = __uint_as_float((uint32_t)i);\n"
    "    if (mdl_f32_to_e4m3(x) != mdl_f32_to_fp8(x, 3u, 7u, 0x43e00000u)) {\n"
    "      atomicAdd(&bad[0], 1ull);\n"
    "      atomicMin(&first[0], (unsigned)i);\n"
    "    }\n"
    "    if (mdl_f32_to_e5m2(x) != mdl_f32_to_fp8(x, 2u, 15u, 0x47600000u)) {\n"
    "      atomicAdd(&bad[1], 1ull);\n"
    "      atomicMin(&first[1], (unsigned)i);\n"
    "    }\n"
    "  }\n"
    "}\n";

// The value of a finite fp8 code by the format's definition.
static double fp8_value(int c, const Format *f) {
  int e = (c & 0x7f) >> f->man, m = c & ((1 << f->man) - 1);
  double v = e ? ldexp(1.0 + ldexp(m, -f->man), e - f->bias) : ldexp(m, 1 - f->bias - f->man);
  return c & 0x80 ? -v : v;
}

static bool fp8_is_nan(int c, const Format *f) {
  return f == &e4m3 ? (c & 0x7f) == 0x7f : (c & 0x7f) > 0x7c;
}

static float half_value(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  float v = e == 31 ? (m ? NAN : INFINITY) : e ? ldexpf(1.0f + ldexpf((float)m, -10), e - 15) : ldexpf((float)m, -24);
  return h & 0x8000 ? -v : v;
}

// Starts `sh -c cmd` with its output in log; finish() waits for it: true when it exited with 0.
static pid_t start(const char *cmd, const char *log) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    if (!freopen(log, "w", stdout) || dup2(fileno(stdout), 2) < 0)
      _exit(127);
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
  }
  return pid;
}

static bool finish(pid_t pid) {
  int status = 0;
  return pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static void read_log(const char *log, char *why, size_t n) {
  FILE *f = fopen(log, "r");
  size_t k = f ? fread(why, 1, n - 1, f) : 0;
  why[k] = 0;
  if (f)
    fclose(f);
}

static bool write_file(const char *path, const char *a, const char *b, const char *c) {
  FILE *f = fopen(path, "w");
  if (!f)
    return false;
  bool ok = fputs(a, f) >= 0 && fputs(b, f) >= 0 && fputs(c, f) >= 0;
  return fclose(f) == 0 && ok;
}

//
// 1. The CPU: hand-computed values, definitions and NVIDIA's conversions.
//

// The conversions under test, named in every check: the emulated device prelude, or the host's.
static const char *label = "fp8";

static void test_hand(EncodeFn enc) {
  static const struct {
    float x;
    uint8_t e4, e5;
    const char *what;
  } cases[] = {
      {1.0f, 0x38, 0x3c, "1"},
      {-1.0f, 0xb8, 0xbc, "-1"},
      {0.0f, 0x00, 0x00, "+0"},
      {-0.0f, 0x80, 0x80, "-0"},
      {1.0625f, 0x38, 0x3c, "1 + 2^-4: e4m3 tie between 1 and 1.125, to even (down)"},
      {1.1875f, 0x3a, 0x3d, "1.1875: e4m3 tie between 1.125 and 1.25, to even (up)"},
      {1.125f, 0x39, 0x3c, "1.125: e5m2 tie between 1 and 1.25, to even (down)"},
      {1.375f, 0x3b, 0x3e, "1.375: e5m2 tie between 1.25 and 1.5, to even (up)"},
      {240.0f, 0x77, 0x5c, "240: e5m2 tie between 224 and 256, to even (up)"},
      {448.0f, 0x7e, 0x5f, "448, e4m3's largest"},
      {464.0f, 0x7e, 0x5f, "464: e4m3 tie between 448 and 480 (NaN's code): 448"},
      {1e30f, 0x7e, 0x7b, "1e30 saturates"},
      {-1e30f, 0xfe, 0xfb, "-1e30 saturates with its sign"},
      {57344.0f, 0x7e, 0x7b, "57344, e5m2's largest"},
      {61440.0f, 0x7e, 0x7b, "61440: e5m2 tie between 57344 and infinity: saturates"},
      {INFINITY, 0x7e, 0x7b, "+inf: the largest finite value"},
      {-INFINITY, 0xfe, 0xfb, "-inf: minus the largest finite value"},
      {NAN, 0x7f, 0x7f, "NaN"},
      {-NAN, 0x7f, 0x7f, "-NaN: the same NaN"},
      {0x1p-6f, 0x08, 0x24, "2^-6, e4m3's smallest normal"},
      {0x1.ep-7f, 0x08, 0x24, "15 * 2^-10: e4m3 tie between its largest subnormal and smallest normal: up"},
      {0x1p-9f, 0x01, 0x18, "2^-9, e4m3's smallest subnormal"},
      {0x1p-10f, 0x00, 0x14, "2^-10: e4m3 tie between 0 and 2^-9: 0"},
      {-0x1p-10f, 0x80, 0x94, "-2^-10: -0"},
      {0x1.8p-9f, 0x02, 0x1a, "3 * 2^-10: e4m3 tie between 2^-9 and 2^-8: 2^-8"},
      {0x1p-14f, 0x00, 0x04, "2^-14, e5m2's smallest normal"},
      {0x1p-16f, 0x00, 0x01, "2^-16, e5m2's smallest subnormal"},
      {0x1p-17f, 0x00, 0x00, "2^-17: e5m2 tie between 0 and 2^-16: 0"},
      {0x1.8p-16f, 0x00, 0x02, "3 * 2^-17: e5m2 tie between 2^-16 and 2^-15: 2^-15"},
      {0x1.000002p-17f, 0x00, 0x01, "just above 2^-17: e5m2's smallest subnormal"},
      {FLT_TRUE_MIN, 0x00, 0x00, "the smallest float subnormal: 0"},
  };
  enum { N = sizeof cases / sizeof *cases };
  float x[N];
  uint8_t g4[N], g5[N];
  for (int i = 0; i < N; i++)
    x[i] = cases[i].x;
  enc(x, g4, g5, N);
  for (int i = 0; i < N; i++) {
    char name[200];
    snprintf(name, sizeof name, "%s %s -> e4m3 0x%02x, e5m2 0x%02x", label, cases[i].what, cases[i].e4, cases[i].e5);
    CHECK(g4[i] == cases[i].e4 && g5[i] == cases[i].e5, name, "got 0x%02x, 0x%02x", g4[i], g5[i]);
  }
}

// Widening: every code against the format's definition (and NaN where the format has it).
static void test_decode_definition(DecodeFn dec) {
  float d[2][256];
  dec(d[0], d[1]);
  const Format *fs[2] = {&e4m3, &e5m2};
  for (int k = 0; k < 2; k++) {
    int bad = -1;
    for (int c = 0; c < 256 && bad < 0; c++) {
      bool ok;
      if (fp8_is_nan(c, fs[k]))
        ok = isnan(d[k][c]);
      else if (fs[k] == &e5m2 && (c & 0x7f) == 0x7c)
        ok = bits(d[k][c]) == bits(c & 0x80 ? -INFINITY : INFINITY);
      else
        ok = bits(d[k][c]) == bits((float)fp8_value(c, fs[k]));
      if (!ok)
        bad = c;
    }
    char name[160];
    snprintf(name, sizeof name, "%s %s: all 256 codes widen exactly to the format's values (-0, NaN%s)", label,
             fs[k]->name, k ? ", +-inf" : "");
    CHECK(bad < 0, name, "code 0x%02x gives %a (0x%08x)", bad, bad < 0 ? 0.0 : d[k][bad],
          bad < 0 ? 0 : bits(d[k][bad]));
  }
}

// Every non-NaN code encodes back to itself; NaN codes become 0x7f.
static void test_roundtrip(EncodeFn enc, DecodeFn dec) {
  float d[2][256];
  uint8_t g[2][2][256];
  dec(d[0], d[1]);
  enc(d[0], g[0][0], g[0][1], 256);
  enc(d[1], g[1][0], g[1][1], 256);
  const Format *fs[2] = {&e4m3, &e5m2};
  for (int k = 0; k < 2; k++) {
    int bad = -1;
    for (int c = 0; c < 256 && bad < 0; c++) {
      int want = fp8_is_nan(c, fs[k]) ? 0x7f : fs[k] == &e5m2 && (c & 0x7f) == 0x7c ? (c & 0x80) | fs[k]->max : c;
      if (g[k][k][c] != want)
        bad = c;
    }
    char name[120];
    snprintf(name, sizeof name, "%s %s: every code widened and encoded again is itself (NaN 0x7f%s)", label, fs[k]->name,
             k ? ", inf saturated" : "");
    CHECK(bad < 0, name, "code 0x%02x comes back as 0x%02x", bad, bad < 0 ? 0 : g[k][k][bad]);
  }
}

static void test_decode_reference(DecodeFn dec, DecodeFn ref) {
  float d[2][256], r[2][256];
  dec(d[0], d[1]);
  ref(r[0], r[1]);
  for (int k = 0; k < 2; k++) {
    int bad = -1;
    for (int c = 0; c < 256 && bad < 0; c++)
      if (isnan(d[k][c]) != isnan(r[k][c]) || (!isnan(r[k][c]) && bits(d[k][c]) != bits(r[k][c])))
        bad = c;
    char name[120];
    snprintf(name, sizeof name, "%s %s: all 256 codes widen as cuda_fp8.h's __nv_cvt_fp8_to_halfraw", label,
             k ? "e5m2" : "e4m3");
    CHECK(bad < 0, name, "code 0x%02x: %a vs NVIDIA's %a", bad, bad < 0 ? 0.0 : d[k][bad], bad < 0 ? 0.0 : r[k][bad]);
  }
}

// Adds x to the inputs (room for it was counted).
static void push(float *x, long *n, float v) { x[(*n)++] = v; }

// The inputs of the comparison with NVIDIA's encoders; *nrandom of them random.
static float *inputs(long *n, long *nrandom) {
  enum { RANDOM = 4000000 };
  float *x = malloc(sizeof *x * (65536 + 2 * 256 * 8 + 64 + RANDOM));
  if (!x)
    return NULL;
  *n = 0;
  for (int h = 0; h < 65536; h++)
    push(x, n, half_value((uint16_t)h));
  const Format *fs[2] = {&e4m3, &e5m2};
  for (int k = 0; k < 2; k++)
    for (int c = 0; c < 0x7f; c++) {
      if (fp8_is_nan(c, fs[k]) || (fs[k] == &e5m2 && c >= 0x7c))
        break;
      float v = (float)fp8_value(c, fs[k]);
      // The midpoint to the next code (or, above the largest, to where the next code would be).
      float next = (float)(c == fs[k]->max ? 2 * fp8_value(c, fs[k]) - fp8_value(c - 1, fs[k])
                                            : fp8_value(c + 1, fs[k]));
      float mid = (v + next) / 2, near[4] = {v, mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
      for (int i = 0; i < 4; i++) {
        push(x, n, near[i]);
        push(x, n, -near[i]);
      }
    }
  static const uint32_t special[] = {
      0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001,
      0x7fffffff, 0xffffffff, 0x7fa00000, 0x00000001, 0x80000001, 0x007fffff, 0x807fffff, 0x00800000,
      0x7f7fffff, 0xff7fffff, 0x43e00001, 0x43e80000, 0x43e80001, 0x43f00000, 0x47600001, 0x47700000,
      0x476fffff, 0x47800000, 0x4f000000, 0xc3e80000, 0xc7700000, 0x3a800000, 0x37800000, 0x37000000};
  for (size_t i = 0; i < sizeof special / sizeof *special; i++)
    push(x, n, from_bits(special[i]));
  // Half of the random floats uniform over bit patterns, half with exponents in [-20, 17] (where
  // the formats have their values) and random mantissas and signs.
  for (long i = 0; i < RANDOM; i++) {
    uint64_t r = mdl_rng_u64(2024, 8, (uint64_t)i);
    uint32_t u = (uint32_t)r;
    if (i % 2)
      u = (u & 0x807fffffu) | (uint32_t)(127 - 20 + (int)((r >> 32) % 38)) << 23;
    push(x, n, from_bits(u));
  }
  *nrandom = RANDOM;
  return x;
}

static void test_encode_reference(EncodeFn enc, EncodeFn ref) {
  long n = 0, nrandom = 0;
  float *x = inputs(&n, &nrandom);
  uint8_t *g = malloc(4 * (size_t)n);
  if (!x || !g) {
    CHECK(false, "fp8: memory for the inputs", "malloc failed");
    free(x);
    free(g);
    return;
  }
  double t0 = now();
  enc(x, g, g + n, n);
  double t_enc = now() - t0;
  t0 = now();
  ref(x, g + 2 * n, g + 3 * n, n);
  double t_ref = now() - t0;
  // The deterministic inputs, then the random ones, per format.
  static const char *const names[2] = {"e4m3", "e5m2"};
  for (int k = 0; k < 2; k++)
    for (int part = 0; part < 2; part++) {
      long lo = part ? n - nrandom : 0, hi = part ? n : n - nrandom, bad = 0, first = -1;
      for (long i = lo; i < hi; i++)
        if (g[k * n + i] != g[(2 + k) * n + i]) {
          bad++;
          if (first < 0)
            first = i;
        }
      char name[300];
      if (part)
        snprintf(name, sizeof name, "%s %s: %ld random floats encode as cuda_fp8.h's __nv_cvt_float_to_fp8 "
                 "(__NV_SATFINITE) (all %ld inputs, both formats: %.2f s, NVIDIA's %.2f s)", label, names[k], nrandom, n,
                 t_enc, t_ref);
      else
        snprintf(name, sizeof name, "%s %s: every float16 value, every fp8 value, the midpoints and their "
                 "neighbours, +-0, +-inf, NaNs, values beyond the largest, subnormals (%ld floats) encode as "
                 "cuda_fp8.h's __nv_cvt_float_to_fp8 (__NV_SATFINITE)", label, names[k], hi - lo);
      CHECK(bad == 0, name, "%ld differ; the first: %a (0x%08x) gives 0x%02x, NVIDIA's 0x%02x", bad,
            first < 0 ? 0.0 : x[first], first < 0 ? 0 : bits(x[first]), first < 0 ? 0 : g[k * n + first],
            first < 0 ? 0 : g[(2 + k) * n + first]);
    }
  free(x);
  free(g);
}

// The host's conversions (runtime/kernels/fp8_bits.h: the C back end's and the interpreter's).
static void host_encode(const float *x, uint8_t *e4, uint8_t *e5, long n) {
  for (long i = 0; i < n; i++) {
    e4[i] = mdl_f32_to_e4m3(x[i]);
    e5[i] = mdl_f32_to_e5m2(x[i]);
  }
}

static void host_decode(float *e4, float *e5) {
  for (int c = 0; c < 256; c++) {
    e4[c] = mdl_e4m3_to_f32((uint8_t)c);
    e5[c] = mdl_e5m2_to_f32((uint8_t)c);
  }
}

// The host's encodings against the emulated device prelude's, on the same inputs as NVIDIA's.
static void test_host_vs_device(EncodeFn dev, DecodeFn dev_dec) {
  long n = 0, nrandom = 0;
  float *x = inputs(&n, &nrandom);
  uint8_t *g = malloc(4 * (size_t)n);
  if (!x || !g) {
    CHECK(false, "fp8: memory for the inputs", "malloc failed");
    free(x);
    free(g);
    return;
  }
  host_encode(x, g, g + n, n);
  dev(x, g + 2 * n, g + 3 * n, n);
  long bad = 0, first = -1;
  for (long i = 0; i < 2 * n; i++)
    if (g[i] != g[2 * n + i] && bad++ == 0)
      first = i % n;
  char name[200];
  snprintf(name, sizeof name, "fp8: the host's conversions (fp8_bits.h) encode %ld floats bit for bit as the "
           "device prelude's, both formats", n);
  CHECK(bad == 0, name, "%ld differ; the first: %a (0x%08x)", bad, first < 0 ? 0.0 : x[first],
        first < 0 ? 0 : bits(x[first]));
  float d[4][256];
  host_decode(d[0], d[1]);
  dev_dec(d[2], d[3]);
  bad = 0;
  for (int k = 0; k < 2; k++)
    for (int c = 0; c < 256; c++)
      bad += bits(d[k][c]) != bits(d[2 + k][c]);
  CHECK(bad == 0, "fp8: the host's widenings of all 256 codes of both formats are the device prelude's, bit for bit",
        "%ld differ", bad);
  free(x);
  free(g);
}

static void test_cpu(const char *dir) {
  char emu_src[300], emu_so[300], emu_log[300], ref_src[300], ref_so[300], ref_log[300], cmd[2][1600];
  snprintf(emu_src, sizeof emu_src, "%s/emu.cpp", dir);
  snprintf(emu_so, sizeof emu_so, "%s/emu.so", dir);
  snprintf(emu_log, sizeof emu_log, "%s/emu.log", dir);
  snprintf(ref_src, sizeof ref_src, "%s/ref.cpp", dir);
  snprintf(ref_so, sizeof ref_so, "%s/ref.so", dir);
  snprintf(ref_log, sizeof ref_log, "%s/ref.log", dir);
  if (!write_file(emu_src, "#include \"cuda_emu.h\"\n", emit_cuda_prelude(), driver) ||
      !write_file(ref_src, reference, "", "")) {
    CHECK(false, "fp8: write the sources", "in %s", dir);
    return;
  }
  snprintf(cmd[0], sizeof cmd[0],
           "g++ -std=c++17 -O1 -shared -fPIC -Wall -Wextra -Werror -Wno-unknown-pragmas -Wno-unused-parameter "
           "-Itests/unit -Iruntime/kernels %s -o %s", emu_src, emu_so);
  // NVIDIA's header with the host compiler, else through nvcc (host code only: no GPU involved).
  snprintf(cmd[1], sizeof cmd[1],
           "g++ -std=c++17 -O1 -shared -fPIC -I/usr/local/cuda/include %s -o %s || "
           "/usr/local/cuda/bin/nvcc -O1 -shared -Xcompiler -fPIC -x cu %s -o %s", ref_src, ref_so, ref_src, ref_so);
  double t0 = now();
  pid_t pe = start(cmd[0], emu_log), pr = start(cmd[1], ref_log);
  bool emu_ok = finish(pe), ref_ok = finish(pr);
  char why[4096];
  read_log(emu_log, why, sizeof why);
  char name[160];
  snprintf(name, sizeof name, "fp8: the prelude compiles with tests/unit/cuda_emu.h (g++ -Wall -Wextra -Werror, %.1f s)",
           now() - t0);
  CHECK(emu_ok, name, "%.1500s", why);
  void *he = emu_ok ? dlopen(emu_so, RTLD_NOW | RTLD_LOCAL) : NULL;
  if (emu_ok)
    CHECK(he != NULL, "fp8: the emulated prelude loads", "%s", dlerror());
  if (!he)
    return;
  EncodeFn enc = (EncodeFn)dlsym(he, "fp8_encode");
  DecodeFn dec = (DecodeFn)dlsym(he, "fp8_decode");
  test_hand(enc);
  test_decode_definition(dec);
  test_roundtrip(enc, dec);
  test_host_vs_device(enc, dec);
  void *hr = ref_ok ? dlopen(ref_so, RTLD_NOW | RTLD_LOCAL) : NULL;
  if (hr) {
    test_decode_reference(dec, (DecodeFn)dlsym(hr, "fp8_decode"));
    test_encode_reference(enc, (EncodeFn)dlsym(hr, "fp8_encode"));
    label = "fp8 host";
    test_decode_reference(host_decode, (DecodeFn)dlsym(hr, "fp8_decode"));
    test_encode_reference(host_encode, (EncodeFn)dlsym(hr, "fp8_encode"));
    label = "fp8";
    dlclose(hr);
  } else {
    read_log(ref_log, why, sizeof why);
    char *nl = strchr(why, '\n');
    if (nl)
      *nl = 0;
    printf("[skip] fp8: NVIDIA's reference conversions (cuda_fp8.h with g++ or nvcc): %.300s\n",
           ref_ok ? dlerror() : why);
  }
  dlclose(he);
}

//
// 2. NVRTC.
//

static void test_nvrtc(const char *src) {
  // sm_80 the software encoders; sm_89 and later cvt.rn.satfinite (sm_100 and sm_120 need NVRTC 12.8).
  static const char *const archs[] = {"sm_80", "sm_89", "sm_90", "sm_100", "sm_120"};
  for (int i = 0; i < 5; i++) {
    NvrtcResult r = {0};
    char err[4096] = "", name[160];
    bool ok = nvrtc_compile(src, archs[i], &r, err, sizeof err);
    snprintf(name, sizeof name, "fp8 nvrtc %s: the prelude and a kernel using the fp8 conversions compile without "
             "a warning (%s%.2f s)", archs[i], i ? "cvt.rn.satfinite, " : "", r.seconds);
    CHECK(ok && r.size > 0 && !r.log, name, "%.1500s", ok ? r.log : err);
    free(r.cubin);
    free(r.log);
  }
}

//
// 3. A GPU: the driver through dlopen, the few entry points this check calls.
//

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static void test_gpu(const char *src) {
  CudaDevice d;
  char why[512];
  if (!cuda_device(&d, why, sizeof why)) {
    printf("[skip] fp8 gpu: %s\n", why);
    return;
  }
  if (atoi(d.arch + 3) < 89) {
    printf("[skip] fp8 gpu: %s has no fp8 conversions (sm_89 or later)\n", d.arch);
    return;
  }
  const char *env = getenv("MDL_LIBCUDA");
  void *so = dlopen(env && *env ? env : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  CUresult (*retain)(void **, int), (*release)(int), (*set_current)(void *);
  CUresult (*load)(void **, const void *), (*unload)(void *), (*get_function)(void **, void *, const char *);
  CUresult (*mem_alloc)(CUdeviceptr *, size_t), (*mem_free)(CUdeviceptr);
  CUresult (*memset8)(CUdeviceptr, unsigned char, size_t), (*copy_dtoh)(void *, CUdeviceptr, size_t);
  CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                     void **);
  CUresult (*sync)(void);
#define SYM(var, name) (*(void **)&(var) = so ? dlsym(so, name) : NULL)
  bool found = SYM(retain, "cuDevicePrimaryCtxRetain") &&
               SYM(release, "cuDevicePrimaryCtxRelease_v2") && SYM(set_current, "cuCtxSetCurrent") &&
               SYM(load, "cuModuleLoadData") && SYM(unload, "cuModuleUnload") &&
               SYM(get_function, "cuModuleGetFunction") && SYM(mem_alloc, "cuMemAlloc_v2") &&
               SYM(mem_free, "cuMemFree_v2") && SYM(memset8, "cuMemsetD8_v2") &&
               SYM(copy_dtoh, "cuMemcpyDtoH_v2") && SYM(launch, "cuLaunchKernel") && SYM(sync, "cuCtxSynchronize");
#undef SYM
  if (!found) {
    CHECK(false, "fp8 gpu: the driver's entry points", "%s", so ? "missing" : dlerror());
    if (so)
      dlclose(so);
    return;
  }
  NvrtcResult r = {0};
  char err[4096] = "";
  int step = 0;
  void *ctx = NULL, *mod = NULL, *fn = NULL;
  CUdeviceptr buf = 0;
  unsigned char out[24];
  CUresult rc = 0;
  bool ok = nvrtc_compile(src, d.arch, &r, err, sizeof err);
  if (ok) {
    // Each step stops the chain at the first failure; `step` says which.
    if ((rc = retain(&ctx, d.ordinal)) == 0 && ++step &&
        (rc = set_current(ctx)) == 0 && ++step && (rc = load(&mod, r.cubin)) == 0 && ++step &&
        (rc = get_function(&fn, mod, "fp8_hw_vs_sw")) == 0 && ++step && (rc = mem_alloc(&buf, 24)) == 0 && ++step &&
        (rc = memset8(buf, 0, 16)) == 0 && ++step && (rc = memset8(buf + 16, 0xff, 8)) == 0 && ++step) {
      CUdeviceptr bad = buf, first = buf + 16;
      void *args[] = {&bad, &first};
      if ((rc = launch(fn, 1024, 1, 1, 256, 1, 1, 0, NULL, args, NULL)) == 0 && ++step && (rc = sync()) == 0 &&
          ++step && (rc = copy_dtoh(out, buf, 24)) == 0)
        ++step;
    }
    ok = step == 10;
  }
  char name[200];
  if (r.cubin && !ok)
    snprintf(err, sizeof err, "driver call %d of 10 failed with CUresult %d", step + 1, rc);
  snprintf(name, sizeof name, "fp8 gpu %s (%s): the kernel runs", d.name, d.arch);
  CHECK(ok, name, "%.1500s", err);
  if (ok) {
    unsigned long long nbad[2];
    unsigned first[2];
    memcpy(nbad, out, 16);
    memcpy(first, out + 16, 8);
    for (int k = 0; k < 2; k++) {
      snprintf(name, sizeof name, "fp8 gpu %s: cvt.rn.satfinite.%sx2.f32 agrees with the software encoder on all "
               "2^32 floats", d.arch, k ? "e5m2" : "e4m3");
      CHECK(nbad[k] == 0, name, "%llu differ, the first at 0x%08x", nbad[k], first[k]);
    }
  }
  if (buf)
    mem_free(buf);
  if (mod)
    unload(mod);
  if (ctx)
    release(d.ordinal);
  free(r.cubin);
  free(r.log);
  dlclose(so);
}

int main(void) {
  char dir[] = "/tmp/mdl-fp8-XXXXXX";
  if (!cache_dir_make(dir, "fp8: a temporary directory"))
    TEST_EXIT();
  // The host's conversions need no compiler: their definitions and hand-computed values always.
  label = "fp8 host";
  test_hand(host_encode);
  test_decode_definition(host_decode);
  test_roundtrip(host_encode, host_decode);
  label = "fp8";
  if (system("g++ --version >/dev/null 2>&1") == 0)
    test_cpu(dir);
  else
    printf("[skip] fp8: no g++ for the emulated prelude\n");
  size_t np = strlen(emit_cuda_prelude()), nk = strlen(kernels);
  char *src = malloc(np + nk + 2);
  if (src) {
    memcpy(src, emit_cuda_prelude(), np);
    src[np] = '\n';
    memcpy(src + np + 1, kernels, nk + 1);
  }
  char why[256];
  if (src && nvrtc_available(why, sizeof why)) {
    test_nvrtc(src);
    test_gpu(src);
  } else {
    printf("[skip] fp8 nvrtc: %s\n", src ? why : "out of memory");
  }
  free(src);
  char cmd[200];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0)
    printf("[fail] fp8: cannot remove %s\n", dir);
  TEST_EXIT();
}
