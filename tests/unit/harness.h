// harness.h: what the unit tests share: a model compiled into its training graph and its CPU
// module, a source checked with the C compiler, a graph's inputs set from a test's batch, arrays
// compared with a tolerance, ops counted, float bits, the clock, a scratch cache folder made and
// removed (static inline, so that each test stays one translation unit and one that uses only some
// of them compiles without warnings).
#ifndef MDL_HARNESS_H
#define MDL_HARNESS_H
#include <dirent.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mdl.h"
#include "backend.h"
#include "emit_c.h"
#include "test.h"

// A model the tests compile: a file, or the text of one (path then only names it), with up to three
// of its dimensions overridden.
typedef struct {
  const char *path;
  DimOverride ov[3];
  int nov;
  const char *text; // the model's source when it is not a file
} Model;

// md's graph as the front end builds it; NULL when it fails (the front end said why on stderr).
static inline Graph *compile_model(Arena *a, const Model *md) {
  return md->text ? mdl_compile_text(a, md->path, md->text, md->ov, md->nov)
                  : mdl_compile_file(a, md->path, md->ov, md->nov);
}

// md's training graph (backward pass and optimizer), its GEMM operands in prec (DT_F32: as written);
// NULL when the front end, autodiff or the precision pass fails, and why says which.
static inline Graph *training_graph(Arena *a, const Model *md, DType prec, char *why, size_t n) {
  Graph *g = compile_model(a, md);
  snprintf(why, n, "front end or autodiff failed");
  return g && autodiff(g, true) && precision_assign(g, prec, why, n) ? g : NULL;
}

// The CPU module of the plan (f, m): emit_c's file built by the C compiler; NULL when either fails,
// and why says which.
static inline CpuModule *cpu_module(const Fusion *f, const MemPlan *m, const char *label, char *why, size_t n) {
  char *src = emit_c(f, m, label);
  snprintf(why, n, "emit_c failed");
  return src ? cpu_load(src, why, n) : NULL;
}

// src, written to a temporary file, compiles with the command cc (its %s: the file's path) without a
// warning; else the compiler's first error is in why.
static inline bool compiles_clean(const char *cc, const char *src, char *why, size_t n) {
  char path[] = "/tmp/mdl-src-XXXXXX.c", log[] = "/tmp/mdl-src-XXXXXX.log", cmd[1024], run[1200];
  int fd = mkstemps(path, 2), lfd = mkstemps(log, 4);
  if (fd < 0 || lfd < 0)
    return false;
  close(lfd);
  FILE *f = fdopen(fd, "w");
  fputs(src, f);
  fclose(f);
  snprintf(cmd, sizeof cmd, cc, path);
  snprintf(run, sizeof run, "%s >%s 2>&1", cmd, log);
  int rc = system(run);
  snprintf(why, n, "?");
  f = fopen(log, "r");
  while (f && fgets(why, (int)n, f) && !strstr(why, "error"))
    ;
  if (f)
    fclose(f);
  unlink(path);
  unlink(log);
  return rc == 0;
}

// A test's batch: fills the values of input nd, shape_numel(nd->shape) of them, into ids (an i32
// input) or f (an f32 one); both have room for them.
typedef void InputFill(const IrNode *nd, int32_t *ids, float *f);

// A packed batch (an InputFill): token patterns, two documents per row (positions restart at the
// second), targets below 4 for one per row (rank 1) else below 256; f32 inputs a smooth pattern.
static inline void packed_batch(const IrNode *nd, int32_t *ids, float *f) {
  int64_t n = shape_numel(nd->shape), cols = nd->shape.d[nd->shape.rank - 1];
  for (int64_t j = 0; j < n; j++) {
    int64_t t = j % cols, split = cols / 2;
    ids[j] = !strcmp(nd->name, "tokens")    ? (int32_t)((j * 37 + 11) % 256)
             : !strcmp(nd->name, "targets") ? (int32_t)((j * 53 + 7) % (nd->shape.rank == 1 ? 4 : 256))
             : !strcmp(nd->name, "pos")     ? (int32_t)(t < split ? t : t - split)
             : !strcmp(nd->name, "doc")     ? (t < split ? 0 : 1)
                                            : 0;
    f[j] = (float)sin(0.7 * (double)j + 0.3);
  }
}

// Sets every input of g, as fill makes it, in the interpreter (it) or in a CPU module's arena (m,
// arena).
static inline void set_inputs_by(const Graph *g, InputFill *fill, Interp *it, const MemPlan *m, char *arena) {
  for (int i = 0; i < g->n; i++) {
    const IrNode *nd = g->nodes[i];
    if (nd->op != OP_INPUT)
      continue;
    int64_t n = shape_numel(nd->shape);
    int32_t *ids = malloc(sizeof *ids * (size_t)n);
    float *f = malloc(sizeof *f * (size_t)n);
    fill(nd, ids, f);
    bool i32 = nd->dtype == DT_I32;
    if (it)
      interp_set_input(it, nd->name, i32 ? ids : NULL, i32 ? NULL : f, n);
    else
      cpu_set_input(g, m, arena, nd->name, i32 ? ids : NULL, i32 ? NULL : f, n);
    free(ids);
    free(f);
  }
}

// n floats as doubles, in a new array (free it).
static inline double *from_float(const float *x, int64_t n) {
  double *d = malloc(sizeof *d * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++)
    d[i] = x[i];
  return d;
}

// Per-tensor relative error: max |a - b| / max |b|; a NaN on either side is an infinite error (fmax
// alone would drop it).
static inline double rel_err(const double *a, const double *b, int64_t n) {
  double d = 0, m = 1e-30;
  for (int64_t i = 0; i < n; i++) {
    double x = fabs(a[i] - b[i]);
    d = fmax(d, isnan(x) ? INFINITY : x);
    m = fmax(m, fabs(b[i]));
  }
  return d / m;
}

// The nodes of g that are op.
static inline int count_op(const Graph *g, Op op) {
  int n = 0;
  for (int i = 0; i < g->n; i++)
    n += g->nodes[i]->op == op;
  return n;
}

static inline bool is_fp8(DType t) { return t == DT_F8E4M3 || t == DT_F8E5M2; }

// A float's bits, and back.
static inline uint32_t bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

static inline float from_bits(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

// The value of a bf16 (its bits h).
static inline float bf16_value(uint16_t h) { return from_bits((uint32_t)h << 16); }

// Seconds on the monotonic clock.
static inline double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// Makes the folder dir (a mkdtemp template) and points MDL_CACHE at it, so that the modules a test
// builds stay out of the user's cache; false after a failed check named name.
static inline bool cache_dir_make(char *dir, const char *name) {
  if (!mkdtemp(dir)) {
    CHECK(false, name, "mkdtemp failed");
    return false;
  }
  setenv("MDL_CACHE", dir, 1);
  return true;
}

// Removes dir and everything in it.
static inline void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *ent;
  char path[1200];
  while (d && (ent = readdir(d)))
    if (strcmp(ent->d_name, ".") && strcmp(ent->d_name, "..")) {
      bool fits = snprintf(path, sizeof path, "%s/%s", dir, ent->d_name) < (int)sizeof path;
      if (fits && unlink(path))
        remove_dir(path);
    }
  if (d)
    closedir(d);
  rmdir(dir);
}
#endif
