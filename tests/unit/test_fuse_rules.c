// test_fuse_rules.c: hand-built graphs for the refusals of compiler/passes/fuse.c that no model in models/
// and no other test reaches (found by line and branch coverage of fuse.c over the unit tests and
// `mdlc build` of every model). For each: the refusal fires, with the reason that the fusion dump
// (fuse_dump, `mdlc -d F`) prints on its "not fused:" line, the steps come out as the rule says, and
// the compiled CPU step (emit_c, cpu_load) computes what the reference interpreter computes (fp32,
// every materialised value, gradients included, relative 1e-5 of the tensor's largest element).
//   rule 2: the LM head is not chunked when the logits are also read by another op, when the logits
//           GEMM's first operand is transposed, when the graph has no backward (validation), and
//           when the loss' gradient depends on the per-row losses;
//   rule 3: nor is that cross-entropy's backward in the kernel of its forward;
//   rule 4: a GEMM epilogue reads neither its chain through a broadcast nor another epilogue value;
//   rule 5: a layernorm does not take in an ADD that a step between them reads;
//   rule 7: a chain after a norm backward's dx reads neither its db nor anything computed from it;
//   rule 9: a lone CAST stays out of its input's kernel past the group size cap;
//   rule 10: a reduction does not take in a kernel whose values another of its members reads.
// Deleting any one of these refusals makes a check here fail: the reason is missing from the dump,
// the steps differ, fuse() finds a cycle between steps, or (rule 7's db, rule 2 without backward)
// the numbers are wrong or the pass crashes. Where the fusion would still compute the same numbers
// (rule 4's epilogue value and rule 10's kernel value can only be read through a broadcast of
// leading 1s, the same flat index) or a later refusal still keeps the graph apart (rule 4's
// iteration space, then its broadcast check; rule 2's extra reader and transposed operand, then the
// check on the gradient's readers), the dump's reason and the steps are what show it.
#include "mdl.h"
#include "runtime.h"
#include "backend.h"
#include "emit_c.h"
#include "test.h"
#include "harness.h"

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

// Compiles f for the CPU and runs its step; runs the interpreter on the same inputs and initial
// parameters (i32 inputs: ids below IDS); compares every materialised non-leaf value, gradients
// included (no memory reuse, so each is still there at the end). Returns the worst relative error,
// or NAN with why filled.
enum { IDS = 16 };
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
  cpu_init_params(g, m, arena, 7);
  interp_init_params(it, 7);
  for (int i = 0; i < g->n; i++) {
    const IrNode *nd = g->nodes[i];
    if (nd->op != OP_INPUT)
      continue;
    int64_t count = shape_numel(nd->shape);
    float *x = malloc(sizeof *x * (size_t)count);
    int32_t *ids = malloc(sizeof *ids * (size_t)count);
    pattern(x, count, i);
    for (int64_t k = 0; k < count; k++)
      ids[k] = (int32_t)((k * 5 + 1) % IDS);
    bool i32 = nd->dtype == DT_I32;
    cpu_set_input(g, m, arena, nd->name, i32 ? ids : NULL, i32 ? NULL : x, count);
    interp_set_input(it, nd->name, i32 ? ids : NULL, i32 ? NULL : x, count);
    free(x);
    free(ids);
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
      const void *got = cpu_value(m, arena, i);
      const double *ref = interp_value(it, i);
      double diff = 0, scale = 0;
      for (int64_t k = 0; k < shape_numel(nd->shape); k++) {
        double v = nd->dtype == DT_BF16 ? bf16_value(((const uint16_t *)got)[k]) : ((const float *)got)[k];
        diff = fmax(diff, fabs(v - ref[k]));
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

// Fuses g (the forward graph: every node); NULL after a [fail] line when it does not fuse.
static Fusion *fused(const char *label, Graph *g, int max_group) {
  g->fwd_end = g->n;
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .max_group = max_group});
  char name[160];
  snprintf(name, sizeof name, "%s: the graph fuses", label);
  if (!f)
    CHECK(false, name, "%s", g->err);
  return f;
}

// Rule 4: an epilogue link reads the GEMM's chain at its own index; a consumer that reads the
// product through a broadcast (a [1, 8] product added to a [4, 8] tensor) would have to run over
// another iteration space than the GEMM's, so it is a kernel of its own, reading the product.
//   h = x[1,4] @ w[4,8]; u = h + y[4,8]
static void epilogue_iteration_space(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  int x = input(g, "x", 2, (int64_t[]){1, 4}), w = input(g, "w", 2, (int64_t[]){4, 8});
  int y = input(g, "y", 2, (int64_t[]){4, 8});
  int h = add2(g, OP_MATMUL, x, w);
  int u = add2(g, OP_ADD, h, y);
  Fusion *f = fused("rule 4 (iteration space)", g, 0);
  if (f) {
    const char *dump = dump_of(f);
    CHECK(dump_says(dump, h, u, "iteration spaces differ: [1,8] vs [4,8]"),
          "rule 4: a consumer that reads the GEMM's product through a broadcast is no epilogue, and the dump says so",
          "no such line for %%%d -> %%%d in:\n%s", h, u, dump);
    CHECK(f->nsteps == 2 && f->steps[0].nnodes == 1 && f->step_of[u] == 1 && f->materialised[h],
          "rule 4: the GEMM writes its product; the broadcasting add is the next kernel",
          "%d steps, the GEMM's has %d nodes", f->nsteps, f->nsteps ? f->steps[0].nnodes : 0);
    check_numbers("rule 4 (iteration space)", f);
  }
  arena_free(a);
}

// Rule 7: the chain of elementwise consumers that a reduction step grows after its root reads only
// the previous link (and memory). Here the root is a layernorm backward's dx, whose step also holds
// its siblings dw and db (rule 3); a link that adds db ([8], broadcast over the rows of dx) would read
// a value the step is still summing over the rows while it computes dx row by row.
//   dx, dw, db = layernorm_bwd(x[4,8], w[8], dy[4,8]); u = dx + db
static void chain_reads_reduced(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  int x = input(g, "x", 2, (int64_t[]){4, 8}), w = input(g, "w", 1, (int64_t[]){8});
  int dy = input(g, "dy", 2, (int64_t[]){4, 8});
  int in[3] = {x, w, dy}, bwd[3];
  for (int k = 0; k < 3; k++)
    bwd[k] = ir_add(g, OP_LAYERNORM_BWD, in, 3, (int64_t[8]){k}, (double[6]){1e-5}, no_loc);
  int u = add2(g, OP_ADD, bwd[0], bwd[2]);
  Fusion *f = fused("rule 7 (chain)", g, 0);
  if (f) {
    const char *dump = dump_of(f);
    CHECK(dump_says(dump, bwd[0], u, "reads a value the reduction consumes"),
          "rule 7: a chain link after a norm backward's dx does not read its db, and the dump says so",
          "no such line for %%%d -> %%%d in:\n%s", bwd[0], u, dump);
    int s = f->step_of[bwd[0]];
    CHECK(s >= 0 && f->step_of[bwd[1]] == s && f->step_of[bwd[2]] == s && f->step_of[u] != s,
          "rule 7: dx, dw and db share a step; the add that reads db is not in it",
          "steps: dx %d, dw %d, db %d, add %d", s, f->step_of[bwd[1]], f->step_of[bwd[2]], f->step_of[u]);
    check_numbers("rule 7 (chain)", f);
  }
  arena_free(a);
}

// Rule 9: a CAST alone joins the kernel that computes its input, within the group size cap. The
// layernorm with the ADD that produces its x (rule 5) is a 2-node kernel; with a cap of 2 the bf16
// rounding of its output stays a kernel of its own.
//   n = layernorm(x[4,8] + y[4,8], w[8], b[8]); c = cast(n, bf16)
static void cast_cap(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  int x = input(g, "x", 2, (int64_t[]){4, 8}), y = input(g, "y", 2, (int64_t[]){4, 8});
  int w = input(g, "w", 1, (int64_t[]){8}), b = input(g, "b", 1, (int64_t[]){8});
  int s = add2(g, OP_ADD, x, y);
  int n = ir_add(g, OP_LAYERNORM, (int[]){s, w, b}, 3, NULL, (double[6]){1e-5}, no_loc);
  int c = ir_add(g, OP_CAST, &n, 1, (int64_t[8]){DT_BF16}, NULL, no_loc);
  Fusion *f = fused("rule 9 (cap)", g, 2);
  if (f) {
    const char *dump = dump_of(f);
    CHECK(dump_says(dump, n, c, "group size cap (2 nodes)"),
          "rule 9: a lone CAST does not join its input's kernel past the group size cap, and the dump says so",
          "no such line for %%%d -> %%%d in:\n%s", n, c, dump);
    CHECK(f->nsteps == 2 && f->step_of[s] == f->step_of[n] && f->step_of[c] != f->step_of[n] && f->materialised[n],
          "rule 9: the layernorm writes its output; the rounding is a kernel of its own",
          "%d steps; add %d, layernorm %d, cast %d", f->nsteps, f->step_of[s], f->step_of[n], f->step_of[c]);
    check_numbers("rule 9 (cap)", f);
  }
  arena_free(a);
}

// Rule 10: a reduction takes in the elementwise kernel that writes its input, unless another member
// of the reduction's step reads that kernel's values: the step evaluates them at the reduction's
// input index only. Here the sum's chain (rule 7) multiplies the sum by v, the kernel's value itself.
//   v = exp(z[4]); s = sum(reshape(v, [4,1]), axis 1); u = s * v
static void reduction_member_reads(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  int z = input(g, "z", 1, (int64_t[]){4});
  int v = add1(g, OP_EXP, z);
  int r = ir_reshape(g, v, shape_of(2, (int64_t[]){4, 1}), no_loc);
  int s = ir_add(g, OP_SUM, &r, 1, (int64_t[8]){1, 0}, NULL, no_loc);
  int u = add2(g, OP_MUL, s, v);
  Fusion *f = fused("rule 10 (member)", g, 0);
  if (f) {
    const char *dump = dump_of(f);
    CHECK(dump_says(dump, v, r, "another member of the reduction reads the kernel's values at other indices"),
          "rule 10: a reduction whose chain reads the kernel's values does not take that kernel in, and the dump "
          "says so", "no such line for %%%d -> %%%d in:\n%s", v, r, dump);
    CHECK(f->nsteps == 2 && f->step_of[v] != f->step_of[s] && f->step_of[u] == f->step_of[s] && f->materialised[v],
          "rule 10: exp is a kernel of its own; the sum and its chain are the other",
          "%d steps; exp %d, sum %d, mul %d", f->nsteps, f->step_of[v], f->step_of[s], f->step_of[u]);
    check_numbers("rule 10 (member)", f);
  }
  arena_free(a);
}

// Rule 5: a layernorm takes in the ADD that produces its x, unless the layernorm also reads
// something computed from that sum: here its weight is a column sum of it, a step that must run
// between the two.
//   s = x[4,8] + y[4,8]; w = sum(s, axis 0); n = layernorm(s, w, b[8])
static void norm_add_cycle(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  int x = input(g, "x", 2, (int64_t[]){4, 8}), y = input(g, "y", 2, (int64_t[]){4, 8});
  int b = input(g, "b", 1, (int64_t[]){8});
  int s = add2(g, OP_ADD, x, y);
  int w = ir_add(g, OP_SUM, &s, 1, (int64_t[8]){0, 0}, NULL, no_loc);
  int n = ir_add(g, OP_LAYERNORM, (int[]){s, w, b}, 3, NULL, (double[6]){1e-5}, no_loc);
  Fusion *f = fused("rule 5 (cycle)", g, 0);
  if (f) {
    const char *dump = dump_of(f);
    CHECK(dump_says(dump, s, n, "would make the steps cyclic"),
          "rule 5: a layernorm whose weight is computed from its x does not take in the ADD, and the dump says so",
          "no such line for %%%d -> %%%d in:\n%s", s, n, dump);
    CHECK(f->step_of[s] != f->step_of[n] && f->step_of[w] != f->step_of[n] && f->step_of[s] < f->step_of[n],
          "rule 5: the sum runs between the ADD and the layernorm", "steps: add %d, sum %d, layernorm %d",
          f->step_of[s], f->step_of[w], f->step_of[n]);
    check_numbers("rule 5 (cycle)", f);
  }
  arena_free(a);
}

// Rule 7: a chain link whose other operand is computed from the step's own values would make the
// step wait for itself. The norm backward's step computes db; a link that adds dx to a tensor made
// from db cannot be in it.
//   dx, dw, db = layernorm_bwd(x[4,8], w[8], dy[4,8]); u = dx + db * z[4,8]
static void chain_cycle(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  int x = input(g, "x", 2, (int64_t[]){4, 8}), w = input(g, "w", 1, (int64_t[]){8});
  int dy = input(g, "dy", 2, (int64_t[]){4, 8}), z = input(g, "z", 2, (int64_t[]){4, 8});
  int in[3] = {x, w, dy}, bwd[3];
  for (int k = 0; k < 3; k++)
    bwd[k] = ir_add(g, OP_LAYERNORM_BWD, in, 3, (int64_t[8]){k}, (double[6]){1e-5}, no_loc);
  int y = add2(g, OP_MUL, bwd[2], z);
  int u = add2(g, OP_ADD, bwd[0], y);
  Fusion *f = fused("rule 7 (cycle)", g, 0);
  if (f) {
    const char *dump = dump_of(f);
    CHECK(dump_says(dump, bwd[0], u, "would make the steps cyclic"),
          "rule 7: a chain link whose other operand comes from the step's db is not in it, and the dump says so",
          "no such line for %%%d -> %%%d in:\n%s", bwd[0], u, dump);
    CHECK(f->step_of[u] != f->step_of[bwd[0]] && f->step_of[y] > f->step_of[bwd[2]],
          "rule 7: the add runs after the norm backward and the product of its db",
          "steps: dx %d, db %d, product %d, add %d", f->step_of[bwd[0]], f->step_of[bwd[2]], f->step_of[y],
          f->step_of[u]);
    check_numbers("rule 7 (cycle)", f);
  }
  arena_free(a);
}

// A model in .mdl text, with its backward pass (no optimizer), fused with the LM head chunked.
static Fusion *lmhead_model(Arena *a, const char *label, const char *src) {
  Graph *g = mdl_compile_text(a, label, src, NULL, 0);
  char name[160];
  snprintf(name, sizeof name, "%s: the model compiles and fuses", label);
  Fusion *f = g && autodiff(g, false) ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
  if (!f)
    CHECK(false, name, "%s", g ? g->err : "front end failed");
  return f;
}

// The node of op `op` in f's graph that reads node `in` (the first), or -1.
static int reader(const Fusion *f, Op op, int in) {
  for (int i = 0; i < f->g->n; i++)
    for (int k = 0; k < f->g->nodes[i]->nin; k++)
      if (f->g->nodes[i]->op == op && f->g->nodes[i]->in[k] == in)
        return i;
  return -1;
}

// Whether some step of f is the chunked LM head.
static bool has_lmhead(const Fusion *f) {
  for (int i = 0; i < f->nsteps; i++)
    if (f->steps[i].kind == STEP_LMHEAD)
      return true;
  return false;
}

// The logits MATMUL of the graph's cross-entropy (through RESHAPEs), or -1.
static int logits_gemm(const Fusion *f, int *ce) {
  *ce = -1;
  for (int i = 0; i < f->g->n && *ce < 0; i++)
    if (f->g->nodes[i]->op == OP_CROSS_ENTROPY)
      *ce = i;
  int x = *ce >= 0 ? f->g->nodes[*ce]->in[0] : -1;
  while (x >= 0 && f->g->nodes[x]->op == OP_RESHAPE)
    x = f->g->nodes[x]->in[0];
  return x >= 0 && f->g->nodes[x]->op == OP_MATMUL ? x : -1;
}

// Rule 2: the LM head is chunked only when nothing but the cross-entropy reads the logits (they are
// never materialised). A loss that also penalises the logits' size reads them again.
static const char logits_read_twice[] = "model lmhead_reread\n"
                                        "input x: f32[8, 4]\n"
                                        "input targets: i32[8]\n"
                                        "param head: [4, 16] = normal(0.5)\n"
                                        "logits = x @ head\n"
                                        "output loss = mean(cross_entropy(logits, targets)) + 0.01 * mean(logits * logits)\n";

// ... and only when the logits GEMM is x2[N, C] @ W: here its first operand is transposed.
static const char logits_transposed[] = "model lmhead_transposed\n"
                                        "input xt: f32[4, 8]\n"
                                        "input targets: i32[8]\n"
                                        "param head: [4, 16] = normal(0.5)\n"
                                        "output loss = mean(cross_entropy(xt.T @ head, targets))\n";

static void lmhead_refusals(void) {
  static const struct {
    const char *label, *src, *why;
  } cases[] = {
      {"rule 2 (logits read twice)", logits_read_twice, "LM head not chunked: the logits are also read by mul@6"},
      {"rule 2 (transposed operand)", logits_transposed,
       "LM head not chunked: the logits GEMM is not x2[N,C] @ W with 2-D operands"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    Arena *a = arena_new();
    Fusion *f = lmhead_model(a, cases[i].label, cases[i].src);
    if (f) {
      int ce, mm = logits_gemm(f, &ce);
      const char *dump = dump_of(f);
      char name[200];
      snprintf(name, sizeof name, "%s: the LM head is not chunked, and the dump says why", cases[i].label);
      CHECK(mm >= 0 && dump_says(dump, mm, ce, cases[i].why) && !has_lmhead(f), name,
            "no line '%s' for %%%d -> %%%d in:\n%s", cases[i].why, mm, ce, dump);
      snprintf(name, sizeof name, "%s: the cross-entropy and its backward share a kernel instead", cases[i].label);
      int cb = reader(f, OP_CROSS_ENTROPY_BWD, ce >= 0 ? f->g->nodes[ce]->in[0] : -1);
      CHECK(ce >= 0 && cb >= 0 && f->step_of[ce] == f->step_of[cb] && f->steps[f->step_of[ce]].kind == STEP_KERNEL,
            name, "cross-entropy %d, its backward %d", ce, cb);
      check_numbers(cases[i].label, f);
    }
    arena_free(a);
  }
  // The forward graph alone (what validation runs): the logits GEMM and the loss are chunked as well;
  // but not where the logits are a model output (what sampling reads), and the dump says why.
  static const char forward[] = "model lmhead_forward\n"
                                "input x: f32[8, 4]\n"
                                "input targets: i32[8]\n"
                                "param head: [4, 16] = normal(0.5)\n"
                                "output loss = mean(cross_entropy(x @ head, targets))\n";
  static const char forward_out[] = "model lmhead_forward_out\n"
                                    "input x: f32[8, 4]\n"
                                    "input targets: i32[8]\n"
                                    "param head: [4, 16] = normal(0.5)\n"
                                    "output logits = x @ head\n"
                                    "output loss = mean(cross_entropy(logits, targets))\n";
  for (int k = 0; k < 2; k++) {
    Arena *fa = arena_new();
    const char *label = k ? "rule 2 (forward only, logits an output)" : "rule 2 (forward only)";
    Graph *fg = mdl_compile_text(fa, "forward.mdl", k ? forward_out : forward, NULL, 0);
    Fusion *ff = fg ? fuse(fg, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
    char name[200];
    if (ff) {
      int ce, mm = logits_gemm(ff, &ce);
      const char *dump = dump_of(ff);
      if (k) {
        snprintf(name, sizeof name, "%s: not chunked, and the dump says why", label);
        CHECK(mm >= 0 && dump_says(dump, mm, ce, "LM head not chunked: the logits are a model output") &&
                  !has_lmhead(ff), name, "no such line for %%%d -> %%%d in:\n%s", mm, ce, dump);
      } else {
        snprintf(name, sizeof name, "%s: the logits GEMM and the loss are one LM-head step", label);
        CHECK(mm >= 0 && ce >= 0 && has_lmhead(ff) && ff->step_of[mm] == ff->step_of[ce] &&
                  ff->steps[ff->step_of[mm]].kind == STEP_LMHEAD, name, "dump:\n%s", dump);
      }
      check_numbers(label, ff);
    } else {
      snprintf(name, sizeof name, "%s: the model compiles and fuses", label);
      CHECK(false, name, "%s", fg ? fg->err : "front end failed");
    }
    arena_free(fa);
  }
  // The control: the same head read by the cross-entropy alone is chunked.
  static const char alone[] = "model lmhead_alone\n"
                              "input x: f32[8, 4]\n"
                              "input targets: i32[8]\n"
                              "param head: [4, 16] = normal(0.5)\n"
                              "output loss = mean(cross_entropy(x @ head, targets))\n";
  Arena *a = arena_new();
  Fusion *f = lmhead_model(a, "rule 2 (control)", alone);
  CHECK(f && has_lmhead(f), "rule 2: the same head read by the cross-entropy alone is chunked", "no LM-head step");
  arena_free(a);
}

// Rules 2 and 3: the cross-entropy's backward reads the gradient of its per-row losses; when the
// loss is a nonlinear function of them (their mean square), that gradient is computed from the
// losses themselves, so the backward cannot be in the step that computes them: neither in the LM
// head (rule 2, chunked) nor in the cross-entropy's kernel (rule 3).
static const char loss_of_loss[] = "model loss_of_loss\n"
                                   "input x: f32[8, 4]\n"
                                   "input targets: i32[8]\n"
                                   "param head: [4, 16] = normal(0.5)\n"
                                   "c = cross_entropy(x @ head, targets)\n"
                                   "output loss = mean(c * c)\n";

static void loss_gradient_cycle(void) {
  Arena *a = arena_new();
  Fusion *f = lmhead_model(a, "rules 2 and 3 (loss of the loss)", loss_of_loss);
  if (f) {
    int ce, mm = logits_gemm(f, &ce);
    int cb = reader(f, OP_CROSS_ENTROPY_BWD, ce >= 0 ? f->g->nodes[ce]->in[0] : -1);
    const char *dump = dump_of(f);
    CHECK(mm >= 0 && dump_says(dump, mm, ce, "LM head not chunked: the loss' gradient depends on the loss itself") &&
              !has_lmhead(f),
          "rule 2: the LM head is not chunked when the loss' gradient depends on the loss, and the dump says so",
          "no such line for %%%d -> %%%d in:\n%s", mm, ce, dump);
    CHECK(cb >= 0 && dump_says(dump, ce, cb, "the loss' gradient depends on the loss itself") &&
              f->step_of[ce] != f->step_of[cb],
          "rule 3: nor is the cross-entropy's backward in its kernel, and the dump says so",
          "no such line for %%%d -> %%%d in:\n%s", ce, cb, dump);
    check_numbers("rules 2 and 3 (loss of the loss)", f);
  }
  arena_free(a);
}

// Outs: a named output of a graph without a backward is written to memory, whoever else reads it.
// gpt2-tiny's forward-only graph in bf16 (as `mdlc lab`'s leak check and evaluation read it): the
// logits' RESHAPE is read by the loss's CAST inside the loss's kernel alone, so without the rule it
// stayed in registers and reading the output returned whatever the arena held.
static void named_outputs_written(void) {
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  Graph *g = mdl_compile_file(a, "models/gpt2-tiny.mdl", ov, 2);
  char why[256] = "";
  bool ok = g != NULL;
  if (ok) {
    ir_eval_mode(g);
    ok = precision_assign(g, DT_BF16, why, sizeof why);
  }
  CHECK(ok, "fuse rules outs: gpt2-tiny's forward-only graph in bf16 builds", "%s", why);
  if (!ok) {
    arena_free(a);
    return;
  }
  int logits = -1;
  for (int o = 0; o < g->noutputs; o++)
    if (!strcmp(g->nodes[g->outputs[o]]->name, "logits"))
      logits = g->outputs[o];
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true, .max_group = 64});
  CHECK(logits >= 0 && f->materialised[logits] && f->step_of[logits] >= 0,
        "fuse rules outs: the bf16 logits, read inside the loss's kernel, are written as an output", "logits %%%d: "
        "step %d, materialised %d", logits, logits >= 0 ? f->step_of[logits] : -1,
        logits >= 0 && f->materialised[logits]);
  // Two documents a row; the logits the compiled step writes are the interpreter's (bf16 operands
  // either way; the GEMMs sum in another order: a few bf16 ulps of the largest logit).
  enum { N = 2 * 16 };
  int32_t tokens[N], targets[N], pos[N], doc[N];
  for (int i = 0; i < N; i++) {
    int t = i % 16, d = t >= 9;
    tokens[i] = t == 0 || t == 9 ? 0 : (i * 37 + 11) % 255 + 1;
    targets[i] = t == 8 || t == 15 ? -1 : (i * 53 + 7) % 256;
    pos[i] = d ? t - 9 : t;
    doc[i] = d;
  }
  MemPlan *m = memplan(f);
  char *src = emit_c(f, m, "gpt2-tiny"), err[512] = "";
  Engine *ce = src ? engine_cpu(f, m, src, 7, err, sizeof err) : NULL, *ie = engine_interp(g, INTERP_F32, 7);
  int64_t V = g->nodes[logits]->shape.d[2];
  float *x = malloc(sizeof(float) * (size_t)(N * V)), *y = malloc(sizeof(float) * (size_t)(N * V));
  Engine *e[2] = {ce, ie};
  for (int k = 0; k < 2 && ce; k++) {
    ok = e[k]->set_input(e[k], "tokens", tokens, NULL, N) && e[k]->set_input(e[k], "targets", targets, NULL, N) &&
         e[k]->set_input(e[k], "pos", pos, NULL, N) && e[k]->set_input(e[k], "doc", doc, NULL, N) &&
         e[k]->step(e[k], err, sizeof err);
    if (ok)
      e[k]->read(e[k], logits, k ? y : x);
  }
  double diff = 0, scale = 0;
  for (int64_t i = 0; ce && ok && i < N * V; i++)
    diff = fmax(diff, fabs((double)x[i] - y[i])), scale = fmax(scale, fabs((double)y[i]));
  CHECK(ce && ok && diff <= 1e-2 * scale && scale > 0, "fuse rules outs: the bf16 logits the compiled step writes "
        "are the interpreter's within 1% of the largest", "%s", ce && ok ? arena_printf(a, "max |cpu - interp| %.3g, "
        "max |interp| %.3g", diff, scale) : err);
  free(x);
  free(y);
  if (ce)
    ce->free(ce);
  ie->free(ie);
  arena_free(a);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); // the lines printed before a crash are kept
  char dir[] = "/tmp/mdl-cache-XXXXXX";
  if (!cache_dir_make(dir, "fuse rules: a cache directory"))
    TEST_EXIT();
  epilogue_broadcast();
  epilogue_iteration_space();
  chain_reads_reduced();
  cast_cap();
  reduction_member_reads();
  lmhead_refusals();
  norm_add_cycle();
  chain_cycle();
  loss_gradient_cycle();
  named_outputs_written();
  remove_dir(dir);
  TEST_EXIT();
}
