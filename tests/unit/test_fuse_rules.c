// test_fuse_rules.c: hand-built graphs for the refusals of compiler/fuse.c that no model in models/
// and no other test reaches. For each: the refusal fires, with the reason that the fusion dump
// (fuse_dump, `mdlc -d F`) prints on its "not fused:" line, the steps come out as the rule says, and
// the compiled CPU step (emit_c, cpu_load) computes what the reference interpreter computes (fp32,
// every materialised value, relative 1e-5 of the tensor's largest element), so that a refusal
// deleted or broken shows both in the plan and, where the emitter would then compute a wrong value,
// in the numbers.
#include "mdl.h"
#include "backend.h"
#include "test.h"

#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const SrcLoc no_loc = {0};

static int input(Graph *g, const char *name, int rank, const int64_t *d) {
  return ir_leaf(g, OP_INPUT, name, DT_F32, shape_of(rank, d), no_loc);
}

static int add1(Graph *g, Op op, int x) { return ir_add(g, op, &x, 1, NULL, NULL, no_loc); }
static int add2(Graph *g, Op op, int x, int y) { return ir_add(g, op, (int[]){x, y}, 2, NULL, NULL, no_loc); }

// The fusion dump's text (fuse_dump), in the graph's arena.
static const char *dump_of(const Fusion *f) {
  char *text = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&text, &len);
  fuse_dump(f, out);
  fclose(out);
  const char *copy = arena_strdup(f->g->arena, text);
  free(text);
  return copy;
}

// Does the dump say that producer a and consumer b were not fused, for a reason containing `why`?
// The line reads "not fused: OP@line with OP@line: REASON (%a -> %b)".
static bool dump_says(const char *dump, int a, int b, const char *why) {
  char tail[64];
  snprintf(tail, sizeof tail, " (%%%d -> %%%d)\n", a, b);
  for (const char *line = dump; line && *line;) {
    const char *end = strchr(line, '\n');
    size_t n = end ? (size_t)(end - line) + 1 : strlen(line);
    size_t tn = strlen(tail);
    if (!strncmp(line, "not fused: ", 11) && n >= tn && !strncmp(line + n - tn, tail, tn)) {
      char *l = strndup(line, n);
      bool found = strstr(l, why) != NULL;
      free(l);
      if (found)
        return true;
    }
    line = end ? end + 1 : NULL;
  }
  return false;
}

// A smooth pattern, different per input.
static void pattern(float *x, int64_t n, int salt) {
  for (int64_t i = 0; i < n; i++)
    x[i] = (float)sin(0.37 * (double)i + 0.9 * salt + 0.2);
}

// Compiles f for the CPU and runs its step; runs the interpreter on the same inputs; compares every
// materialised non-leaf value (no memory reuse, so each is still there at the end). Returns the
// worst relative error, or NAN with why filled.
static double cpu_vs_interp(const Fusion *f, char *why, size_t n) {
  const Graph *g = f->g;
  MemPlan *m = memplan_with(f, false);
  char *src = emit_c(f, m, "hand-built graph"), err[256];
  CpuModule *cm = src ? cpu_load(src, err, sizeof err) : NULL;
  if (!cm) {
    snprintf(why, n, "%s", src ? err : "emit_c failed");
    return NAN;
  }
  char *arena = cpu_arena_new(m);
  Interp *it = interp_new(g, INTERP_F32);
  for (int i = 0; i < g->n; i++) {
    const IrNode *nd = g->nodes[i];
    if (nd->op != OP_INPUT)
      continue;
    int64_t count = shape_numel(nd->shape);
    float *x = malloc(sizeof *x * (size_t)count);
    pattern(x, count, i);
    cpu_set_input(g, m, arena, nd->name, NULL, x, count);
    interp_set_input(it, nd->name, NULL, x, count);
    free(x);
  }
  double worst = NAN;
  if (!cpu_step(cm, arena)) {
    snprintf(why, n, "cpu_step: %.200s", cm->error);
  } else if (!interp_run(it, g->n, err, sizeof err)) {
    snprintf(why, n, "interp_run: %.200s", err);
  } else {
    worst = 0;
    for (int i = 0; i < g->n; i++) {
      const IrNode *nd = g->nodes[i];
      if (nd->op == OP_INPUT || nd->op == OP_CONST || !f->materialised[i])
        continue;
      const float *got = cpu_value(m, arena, i);
      const double *ref = interp_value(it, i);
      double diff = 0, scale = 0;
      for (int64_t k = 0; k < shape_numel(nd->shape); k++) {
        diff = fmax(diff, fabs((double)got[k] - ref[k]));
        scale = fmax(scale, fabs(ref[k]));
      }
      double rel = scale > 0 ? diff / scale : diff;
      if (rel > worst) {
        worst = rel;
        snprintf(why, n, "%%%d %s: max |cpu - interp| %.3g, max |interp| %.3g", i, op_name(nd->op), diff, scale);
      }
    }
  }
  interp_free(it);
  cpu_arena_free(m, arena);
  cpu_unload(cm);
  return worst;
}

static void check_numbers(const char *label, const Fusion *f) {
  char why[256] = "";
  double rel = cpu_vs_interp(f, why, sizeof why);
  char name[200];
  snprintf(name, sizeof name, "%s: the compiled CPU step matches the interpreter", label);
  CHECK(rel < 1e-5, name, "worst relative error %.3g (%s)", rel, why);
}

// Rule 4: a GEMM epilogue link may not read another epilogue value through a broadcast. The GEMM's
// product h is [1, 8]; its epilogue runs on through r = reshape(h, [8]) and e = exp(r), then back
// to t = reshape(e, [1, 8]); u = t * r reads t at its own index but r ([8]) broadcast to [1, 8]:
// an epilogue value at an index other than the link's own, so u stops the chain.
//   h = x[1,4] @ w[4,8]; r = reshape(h, [8]); e = exp(r); t = reshape(e, [1,8]); u = t * r
static void epilogue_broadcast(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  int x = input(g, "x", 2, (int64_t[]){1, 4}), w = input(g, "w", 2, (int64_t[]){4, 8});
  int h = add2(g, OP_MATMUL, x, w);
  int r = ir_reshape(g, h, shape_of(1, (int64_t[]){8}), no_loc);
  int e = add1(g, OP_EXP, r);
  int t = ir_reshape(g, e, shape_of(2, (int64_t[]){1, 8}), no_loc);
  int u = add2(g, OP_MUL, t, r);
  g->fwd_end = g->n;
  Fusion *f = fuse(g, (FuseOptions){.fuse = true});
  if (!f) {
    CHECK(false, "rule 4 (epilogue broadcast): the graph fuses", "%s", g->err);
    arena_free(a);
    return;
  }
  const char *dump = dump_of(f);
  CHECK(dump_says(dump, t, u, "reads another epilogue value through a broadcast"),
        "rule 4: a GEMM epilogue does not read another epilogue value through a broadcast, and the dump says so",
        "no such line for %%%d -> %%%d in:\n%s", t, u, dump);
  int gs = f->step_of[h];
  CHECK(gs >= 0 && f->steps[gs].kind == STEP_GEMM && f->step_of[e] == gs && f->step_of[u] != gs,
        "rule 4: the epilogue keeps exp and stops before the broadcasting multiply",
        "the GEMM's step %d, exp's %d, the multiply's %d", gs, f->step_of[e], f->step_of[u]);
  check_numbers("rule 4 (epilogue broadcast)", f);
  arena_free(a);
}

// Removes the test's cache directory and everything in it.
static void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *ent;
  while (d && (ent = readdir(d))) {
    if (!strcmp(ent->d_name, ".") || !strcmp(ent->d_name, ".."))
      continue;
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, ent->d_name);
    unlink(path);
  }
  if (d)
    closedir(d);
  rmdir(dir);
}

int main(void) {
  char dir[] = "/tmp/mdl-cache-XXXXXX";
  if (!mkdtemp(dir)) {
    CHECK(false, "fuse rules: a cache directory", "mkdtemp failed");
    TEST_EXIT();
  }
  setenv("MDL_CACHE", dir, 1);
  epilogue_broadcast();
  remove_dir(dir);
  TEST_EXIT();
}
