// nvrtc.c: CUDA C++ to cubin through NVRTC, with a cache on disk. NVRTC is loaded with dlopen (never
// linked), so the program builds and runs on machines without the CUDA toolkit; NVRTC itself needs no
// GPU, so the emitted modules are compiled (and tested) on any machine that has the toolkit.
//
// Cache: the key is the SHA-256 of (source, arch, NVRTC version, MDL_VERSION, options), each part
// followed by a NUL; the cubin lives in ($MDL_CACHE or ~/.cache/mdl)/cuda/<key>.cubin and is written
// through a temporary file and a rename, so a concurrent run never reads half a cubin. A module
// compiled as several programs at once (nvrtc_compile_units) caches each program's cubin so.
#include "emit_cuda.h"
#include "runtime.h"

#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

//
// SHA-256 (FIPS 180-4).
//
static const uint32_t sha_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static uint32_t ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void sha_block(uint32_t h[8], const unsigned char *p) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = k + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + sha_k[i] + w[i];
    uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

void nvrtc_sha256_hex(const void *data, size_t n, char hex[65]) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const unsigned char *p = data;
  size_t left = n;
  for (; left >= 64; left -= 64, p += 64)
    sha_block(h, p);
  unsigned char tail[128] = {0};
  memcpy(tail, p, left);
  tail[left] = 0x80;
  size_t len = left + 1 + 8 <= 64 ? 64 : 128;
  uint64_t bits = (uint64_t)n * 8;
  for (int i = 0; i < 8; i++)
    tail[len - 1 - i] = (unsigned char)(bits >> (8 * i));
  sha_block(h, tail);
  if (len == 128)
    sha_block(h, tail + 64);
  for (int i = 0; i < 8; i++)
    snprintf(hex + 8 * i, 9, "%08x", h[i]);
}

//
// NVRTC through dlopen: the few entry points we call, with their C types (nvrtcResult is an int enum,
// nvrtcProgram a pointer).
//
typedef int nvrtc_result;
typedef void *nvrtc_program;

static struct {
  bool tried, ok;
  char why[256];
  nvrtc_result (*version)(int *, int *);
  nvrtc_result (*create)(nvrtc_program *, const char *, const char *, int, const char *const *, const char *const *);
  nvrtc_result (*compile)(nvrtc_program, int, const char *const *);
  nvrtc_result (*log_size)(nvrtc_program, size_t *);
  nvrtc_result (*log)(nvrtc_program, char *);
  nvrtc_result (*cubin_size)(nvrtc_program, size_t *);
  nvrtc_result (*cubin)(nvrtc_program, char *);
  nvrtc_result (*destroy)(nvrtc_program *);
  const char *(*error_string)(nvrtc_result);
  int major, minor;
} nv;

static bool load(void) {
  if (nv.tried)
    return nv.ok;
  nv.tried = true;
  static const char *const names[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so",
                                      "/usr/local/cuda/lib64/libnvrtc.so.13", "/usr/local/cuda/lib64/libnvrtc.so.12",
                                      "/usr/local/cuda/lib64/libnvrtc.so"};
  void *so = NULL;
  for (size_t i = 0; i < sizeof names / sizeof *names && !so; i++)
    so = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!so) {
    snprintf(nv.why, sizeof nv.why, "cannot load NVRTC (libnvrtc.so.13 or .12, libnvrtc.so, /usr/local/cuda/lib64): %s",
             dlerror());
    return false;
  }
  struct {
    void **fn;
    const char *name;
  } syms[] = {{(void **)&nv.version, "nvrtcVersion"},
              {(void **)&nv.create, "nvrtcCreateProgram"},
              {(void **)&nv.compile, "nvrtcCompileProgram"},
              {(void **)&nv.log_size, "nvrtcGetProgramLogSize"},
              {(void **)&nv.log, "nvrtcGetProgramLog"},
              {(void **)&nv.cubin_size, "nvrtcGetCUBINSize"},
              {(void **)&nv.cubin, "nvrtcGetCUBIN"},
              {(void **)&nv.destroy, "nvrtcDestroyProgram"},
              {(void **)&nv.error_string, "nvrtcGetErrorString"}};
  for (size_t i = 0; i < sizeof syms / sizeof *syms; i++) {
    *syms[i].fn = dlsym(so, syms[i].name);
    if (!*syms[i].fn) {
      snprintf(nv.why, sizeof nv.why, "NVRTC has no %s", syms[i].name);
      return false;
    }
  }
  if (nv.version(&nv.major, &nv.minor) != 0) {
    snprintf(nv.why, sizeof nv.why, "nvrtcVersion failed");
    return false;
  }
  nv.ok = true;
  return true;
}

bool nvrtc_available(char *why, size_t n) {
  if (load())
    return true;
  return rt_fail(why, n, "%s", nv.why);
}

bool nvrtc_version(int *major, int *minor) {
  if (!load())
    return false;
  *major = nv.major;
  *minor = nv.minor;
  return true;
}

//
// The cache.
//
static bool cache_path(const char *key, char *path, size_t n, char *err, size_t errn) {
  char dir[900];
  if (!rt_cache_dir("cuda", dir, sizeof dir, err, errn))
    return false;
  snprintf(path, n, "%s/%s.cubin", dir, key);
  return true;
}

// The whole of a regular file, malloc'd; NULL when it cannot be read, is empty or is not a regular
// file (a folder where a cubin goes, a FIFO).
static void *read_file(const char *path, size_t *size) {
  char why[256];
  char *data = file_read(path, size, 0, why, sizeof why);
  if (data && !*size) {
    free(data);
    data = NULL;
  }
  if (!data)
    *size = 0;
  return data;
}

// Whether data (size bytes) is a whole cubin: a 64-bit ELF file for the CUDA machine whose program
// and section header tables lie inside it. A cached file that is not (cut short by a full disk,
// damaged) is compiled again and replaced; the driver would refuse it.
static bool is_cubin(const unsigned char *data, size_t size) {
  Elf64_Ehdr h;
  if (size < sizeof h || memcmp(data, ELFMAG, SELFMAG) || data[EI_CLASS] != ELFCLASS64)
    return false;
  memcpy(&h, data, sizeof h);
  return h.e_machine == EM_CUDA && h.e_phoff <= size && (uint64_t)h.e_phentsize * h.e_phnum <= size - h.e_phoff &&
         h.e_shoff <= size && (uint64_t)h.e_shentsize * h.e_shnum <= size - h.e_shoff;
}

// The program's log, malloc'd, or NULL when it is empty.
static char *program_log(nvrtc_program prog) {
  size_t len = 0;
  char *log = NULL;
  if (nv.log_size(prog, &len) != 0 || len <= 1 || !(log = malloc(len)) || nv.log(prog, log) != 0) {
    free(log);
    return NULL;
  }
  return log;
}

// Runs NVRTC; the cubin (malloc'd) and its log, or NULL with the log in err.
static void *run_nvrtc(const char *src, const char *const *opts, int nopts, size_t *size, char **log, char *err,
                       size_t n) {
  nvrtc_program prog = NULL;
  nvrtc_result r = nv.create(&prog, src, "model.cu", 0, NULL, NULL);
  if (r != 0) {
    rt_fail(err, n, "nvrtcCreateProgram: %s", nv.error_string(r));
    return NULL;
  }
  r = nv.compile(prog, nopts, opts);
  void *cubin = NULL;
  *log = program_log(prog);
  if (r != 0) {
    rt_fail(err, n, "NVRTC: %s", *log ? *log : nv.error_string(r));
    free(*log);
    *log = NULL;
  } else if (nv.cubin_size(prog, size) != 0 || !(cubin = malloc(*size ? *size : 1)) || nv.cubin(prog, cubin) != 0) {
    free(cubin);
    cubin = NULL;
    rt_fail(err, n, "NVRTC produced no cubin");
  }
  nv.destroy(&prog);
  return cubin;
}

// Every compile's options into opts (archopt holds the arch's), then `extra` if not NULL, then with
// split --split-compile=0 (NVRTC 12.1 and later), which optimises the kernels on as many threads as
// the machine has: GPT-2 124M's module took 3.5 s on one thread and 2.0-2.4 s on two, its longest
// kernel (attention backward's dk/dv) alone 0.7 s. Returns how many (at most 5).
static int compile_options(const char *arch, char archopt[64], const char *extra, bool split, const char *opts[5]) {
  snprintf(archopt, 64, "--gpu-architecture=%s", arch);
  int k = 0;
  opts[k++] = archopt;
  opts[k++] = "--std=c++17";
  opts[k++] = "--fmad=true";
  if (extra)
    opts[k++] = extra;
  if (split && (nv.major > 12 || (nv.major == 12 && nv.minor >= 1)))
    opts[k++] = "--split-compile=0";
  return k;
}

// One program, through the cache; split as compile_options says.
static bool compile_cached(const char *src, const char *arch, bool split, NvrtcResult *out, char *err, size_t n) {
  *out = (NvrtcResult){0};
  if (!load())
    return rt_fail(err, n, "%s", nv.why);
  char archopt[64], version[32];
  snprintf(version, sizeof version, "%d.%d", nv.major, nv.minor);
  const char *opts[5];
  int nopts = compile_options(arch, archopt, NULL, split, opts);

  // The key: every part followed by a NUL, so that ("ab", "c") and ("a", "bc") differ.
  const char *parts[8] = {src, arch, version, MDL_VERSION};
  int nparts = 4;
  for (int i = 0; i < nopts; i++)
    parts[nparts++] = opts[i];
  size_t total = 0;
  for (int i = 0; i < nparts; i++)
    total += strlen(parts[i]) + 1;
  char *keybuf = malloc(total), *p = keybuf;
  if (!keybuf)
    return rt_fail(err, n, "out of memory");
  for (int i = 0; i < nparts; i++) {
    size_t len = strlen(parts[i]) + 1;
    memcpy(p, parts[i], len);
    p += len;
  }
  char key[65], path[1024];
  nvrtc_sha256_hex(keybuf, total, key);
  free(keybuf);
  if (!cache_path(key, path, sizeof path, err, n))
    return false;

  size_t size = 0;
  void *cubin = read_file(path, &size);
  if (cubin && is_cubin(cubin, size)) {
    *out = (NvrtcResult){cubin, size, true, 0, NULL};
    return true;
  }
  if (cubin)
    fprintf(stderr, "mdlc: warning: %s: not a whole cubin (damaged or cut short); compiling again\n", path);
  free(cubin);
  double t0 = rt_now();
  char *log = NULL;
  cubin = run_nvrtc(src, opts, nopts, &size, &log, err, n);
  if (!cubin)
    return false;
  double seconds = rt_now() - t0;
  char why[1200];
  if (!rt_write_atomic(path, cubin, size, why, sizeof why))
    fprintf(stderr, "mdlc: warning: the compiled module is not cached: %s\n", why);
  *out = (NvrtcResult){cubin, size, false, seconds, log};
  return true;
}

bool nvrtc_compile(const char *src, const char *arch, NvrtcResult *out, char *err, size_t n) {
  return compile_cached(src, arch, true, out, err, n);
}

//
// A module as several programs, compiled at once. Every program is the module's head followed by some
// of its units in the order of the source; the units go to programs by cost, the costliest first,
// each to the program with the least so far. On two cores GPT-2 124M's bf16 module for sm_90 took
// 2.36-2.45 s as one program (--split-compile=0) and 1.91-1.99 s as two, each on its own thread.
//
typedef struct {
  char *src;                // the head and this program's units
  const char *arch;
  NvrtcResult r;
  bool ok;
  char err[4096];
} Program;

static void *compile_program(void *p) {
  Program *pr = p;
  pr->ok = compile_cached(pr->src, pr->arch, false, &pr->r, pr->err, sizeof pr->err);
  return NULL;
}

void nvrtc_module_free(NvrtcModule *m) {
  for (int i = 0; i < m->n; i++) {
    free(m->parts[i].cubin);
    free(m->parts[i].log);
  }
  free(m->parts);
  *m = (NvrtcModule){0};
}

static size_t unit_end(const CudaPlan *plan, size_t len, int u) {
  return u + 1 < plan->nunits ? plan->units[u + 1].at : len;
}

// of[u]: the program of unit u, the costliest unit first, each to the program with the least cost so
// far (ties to the lower program, and among units of one cost the earlier in the source).
static bool assign_units(const CudaPlan *plan, int np, int *of) {
  int *order = calloc((size_t)plan->nunits + 1, sizeof *order);
  size_t *load_of = calloc((size_t)np, sizeof *load_of);
  if (!order || !load_of) {
    free(order);
    free(load_of);
    return false;
  }
  for (int u = 0; u < plan->nunits; u++) {
    int at = u;
    for (; at > 0 && plan->units[order[at - 1]].cost < plan->units[u].cost; at--)
      order[at] = order[at - 1];
    order[at] = u;
  }
  for (int k = 0; k < plan->nunits; k++) {
    int best = 0;
    for (int p = 1; p < np; p++)
      best = load_of[p] < load_of[best] ? p : best;
    of[order[k]] = best;
    load_of[best] += plan->units[order[k]].cost;
  }
  free(order);
  free(load_of);
  return true;
}

// Program p's source (malloc'd): the module's head, then its units in the order of the source.
static char *program_source(const CudaPlan *plan, const int *of, int p) {
  size_t len = strlen(plan->source), head = plan->units[0].at, total = head;
  for (int u = 0; u < plan->nunits; u++)
    total += of[u] == p ? unit_end(plan, len, u) - plan->units[u].at : 0;
  char *src = malloc(total + 1);
  if (!src)
    return NULL;
  memcpy(src, plan->source, head);
  size_t at = head;
  for (int u = 0; u < plan->nunits; u++)
    if (of[u] == p) {
      size_t ulen = unit_end(plan, len, u) - plan->units[u].at;
      memcpy(src + at, plan->source + plan->units[u].at, ulen);
      at += ulen;
    }
  src[at] = 0;
  return src;
}

// Compiles the np programs of `of`, each on a thread of its own (the last on this one, and any whose
// thread does not start); their cubins into out->parts. False with the first failure's log in err.
static bool compile_programs(const CudaPlan *plan, const char *arch, const int *of, int np, NvrtcModule *out,
                             char *err, size_t n) {
  Program *pr = calloc((size_t)np, sizeof *pr);
  pthread_t *th = calloc((size_t)np, sizeof *th);
  bool *started = calloc((size_t)np, sizeof *started);
  bool ok = pr && th && started;
  for (int p = 0; ok && p < np; p++) {
    pr[p].arch = arch;
    ok = (pr[p].src = program_source(plan, of, p)) != NULL;
  }
  for (int p = 0; ok && p < np - 1; p++)
    started[p] = pthread_create(&th[p], NULL, compile_program, &pr[p]) == 0;
  if (ok) {
    compile_program(&pr[np - 1]);
    for (int p = 0; p < np - 1; p++)
      if (started[p])
        pthread_join(th[p], NULL);
      else
        compile_program(&pr[p]);
  } else {
    rt_fail(err, n, "out of memory");
  }
  out->n = np;
  for (int p = 0; pr && p < np; p++) {
    out->parts[p] = pr[p].r;
    if (ok && !pr[p].ok)
      ok = rt_fail(err, n, "%s", pr[p].err);
    free(pr[p].src);
  }
  free(pr);
  free(th);
  free(started);
  return ok;
}

bool nvrtc_compile_units(const CudaPlan *plan, const char *arch, int threads, NvrtcModule *out, char *err, size_t n) {
  *out = (NvrtcModule){0};
  if (!load()) // (before the threads: load() is not thread-safe)
    return rt_fail(err, n, "%s", nv.why);
  int np = threads < plan->nunits ? threads : plan->nunits;
  np = np < 1 ? 1 : np;
  int *of = calloc((size_t)plan->nunits + 1, sizeof *of);
  if (!(out->parts = calloc((size_t)np, sizeof *out->parts)) || !of) {
    free(of);
    free(out->parts);
    out->parts = NULL;
    return rt_fail(err, n, "out of memory");
  }
  double t0 = rt_now();
  bool ok;
  if (np == 1) {
    out->n = 1;
    ok = compile_cached(plan->source, arch, true, &out->parts[0], err, n);
  } else {
    ok = assign_units(plan, np, of) ? compile_programs(plan, arch, of, np, out, err, n)
                                    : rt_fail(err, n, "out of memory");
  }
  free(of);
  out->cache_hit = true;
  for (int p = 0; p < out->n; p++)
    out->cache_hit = out->cache_hit && out->parts[p].cache_hit;
  out->seconds = out->cache_hit ? 0 : rt_now() - t0;
  if (!ok)
    nvrtc_module_free(out);
  return ok;
}

bool nvrtc_resource_report(const char *src, const char *arch, char **report, char *err, size_t n) {
  *report = NULL;
  if (!load())
    return rt_fail(err, n, "%s", nv.why);
  char archopt[64];
  const char *opts[5];
  int nopts = compile_options(arch, archopt, "--ptxas-options=-v", true, opts);
  size_t size = 0;
  void *cubin = run_nvrtc(src, opts, nopts, &size, report, err, n);
  free(cubin);
  return cubin != NULL && (*report || rt_fail(err, n, "ptxas printed no report"));
}
