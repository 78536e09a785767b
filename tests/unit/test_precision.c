// test_precision.c: the precision pass and bf16 rounding.
//  1. round_bf16 on hand-picked bit patterns (ties to even both ways, a carry into the exponent,
//     overflow to inf, NaN, -0, a subnormal) and on a million random floats against a reference
//     written differently (frexp / nearbyint / ldexp on the float's exact value).
//  2. The pass on gpt2-tiny, llama-tiny and the MLP (with their backward and AdamW): every MATMUL
//     reads two bf16 CASTs and every attention backward its dout through one, no value is cast
//     twice, the casts are exactly the distinct GEMM operands and attention douts of the graph before
//     the pass, the forward's casts stay in the forward, the graph's lists
//     (params, grads, updates, loss, outputs) still name the same nodes, and fp32 leaves the graph
//     untouched.
//  3. The IR rejects a bf16 value read by anything but matmul, cast and a bf16 attention backward's
//     dout, and a matmul of mixed dtypes.
//  4. Fusion of the bf16 graph (rule 9): no kernel of casts alone reads a value that a row-wise or
//     elementwise kernel computes, the number of casts those kernels write is as counted by hand.
//  5. Attention in a bf16 graph: the interpreter's output and gradients against the contract of
//     mdl.h (q, k, v and the softmax numerators rounded to bf16) computed in the test.
//  6. The interpreter on the bf16 graph: every CAST value is a bf16 value; the loss moves off the
//     fp32 one by a little (more than 1e-7, less than 1e-2 relative); 40 AdamW steps on one batch
//     bring the loss down as fp32 does (final losses within 5% of each other, both < 40% of start).
#include "mdl.h"
#include "test.h"
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// x rounded to 8 significant bits, ties to even, from the float's exact value (not its bits).
static double ref_bf16(float x) {
  if (isnan(x) || isinf(x) || x == 0)
    return x;
  int e;
  frexp((double)x, &e);         // x = m 2^e, |m| in [0.5, 1): 8 significant bits are m 2^8
  int ef = e < -125 ? -125 : e; // below the normal range the last bit stays at 2^-133
  double r = nearbyint(ldexp((double)x, 8 - ef)) * ldexp(1.0, ef - 8);
  return fabs(r) > 3.3895313892515355e38 ? copysign(INFINITY, x) : r;
}

static void test_rounding(void) {
  static const struct {
    uint32_t in, out;
    const char *what;
  } cases[] = {
      {0x3f800000, 0x3f800000, "1 stays 1"},
      {0x3f808000, 0x3f800000, "1 + 2^-8 (a tie) goes down to the even 1"},
      {0x3f818000, 0x3f820000, "1 + 3*2^-8 (a tie) goes up to the even 1 + 2^-6"},
      {0x3f808001, 0x3f810000, "just above a tie goes up"},
      {0x3f807fff, 0x3f800000, "just below a tie goes down"},
      {0x3fffffff, 0x40000000, "a carry into the exponent: 2 - 2^-23 becomes 2"},
      {0x7f7fffff, 0x7f800000, "the largest float overflows to inf"},
      {0x80000000, 0x80000000, "-0 stays -0"},
      {0x00012345, 0x00010000, "a subnormal rounds on the same bits"},
      {0xc0490fdb, 0xc0490000, "-pi"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint32_t got = bits(round_bf16(from_bits(cases[i].in)));
    char name[160];
    snprintf(name, sizeof name, "round_bf16: %s", cases[i].what);
    CHECK(got == cases[i].out, name, "0x%08x gave 0x%08x, want 0x%08x", cases[i].in, got, cases[i].out);
  }
  CHECK(isnan(round_bf16(NAN)), "round_bf16: NaN stays NaN", "got %g", round_bf16(NAN));
  int bad = 0;
  uint32_t first = 0;
  for (uint64_t i = 0; i < 1000000; i++) {
    uint32_t u = (uint32_t)mdl_rng_u64(3, 1, i);
    float x = from_bits(u);
    if (isnan(x))
      continue;
    double got = round_bf16(x), want = ref_bf16(x);
    if (got != want && !(got == 0 && want == 0)) {
      if (!bad++)
        first = u;
    }
  }
  CHECK(bad == 0, "round_bf16 matches frexp/nearbyint rounding on 1e6 random floats", "%d differ, first 0x%08x", bad,
        first);
}

static Graph *training_graph_or_exit(Arena *a, const char *path, const DimOverride *ov, int nov) {
  Graph *g = mdl_compile_file(a, path, ov, nov);
  if (!g || !autodiff(g, true)) {
    printf("[fail] %s: front end or autodiff failed\n", path);
    exit(1);
  }
  return g;
}

static void test_structure(const char *path, const DimOverride *ov, int nov) {
  Arena *a = arena_new(), *b = arena_new();
  Graph *g = training_graph_or_exit(a, path, ov, nov), *before = training_graph_or_exit(b, path, ov, nov);
  char why[256], name[256];
  // The distinct GEMM operands, attention inputs (q, k, v; of a SLICE, what it slices: the whole qkv
  // value is rounded once and the slice becomes a bf16 view of that) and attention backward douts
  // before the pass, and the attention outputs the backward reads (rounded through the output
  // projection's CAST, by a view of it).
  int want_casts = 0, matmuls = 0, atts = 0, want_views = 0, fwd_atts = 0, ces = 0;
  bool *operand = calloc((size_t)before->n, 1);
  for (int i = 0; i < before->n; i++) {
    const IrNode *n = before->nodes[i];
    if (n->op == OP_ATTENTION) {
      fwd_atts++;
      for (int k = 0; k < 3; k++) {
        int x = before->nodes[n->in[k]]->op == OP_SLICE ? before->nodes[n->in[k]]->in[0] : n->in[k];
        if (!operand[x]) {
          operand[x] = true;
          want_casts++;
        }
      }
    }
    if (n->op == OP_CROSS_ENTROPY || n->op == OP_CROSS_ENTROPY_BWD) { // the logits
      ces++;
      if (!operand[n->in[0]]) {
        operand[n->in[0]] = true;
        want_casts++;
      }
    }
    if (n->op == OP_MATMUL || n->op == OP_ATTENTION_BWD) {
      matmuls += n->op == OP_MATMUL;
      atts += n->op == OP_ATTENTION_BWD;
      for (int k = n->op == OP_MATMUL ? 0 : n->nin - 1; k < n->nin; k++)
        if (!operand[n->in[k]]) {
          operand[n->in[k]] = true;
          want_casts++;
        }
      if (n->op == OP_ATTENTION_BWD && !operand[att_bwd_out(n)]) {
        operand[att_bwd_out(n)] = true;
        want_views++;
      }
    }
  }
  bool ok = precision_assign(g, DT_BF16, why, sizeof why);
  snprintf(name, sizeof name, "precision: %s: the bf16 graph validates", path);
  CHECK(ok, name, "%s", why);
  if (!ok)
    return;
  int casts = 0, got_matmuls = 0, bad_matmul = 0, twice = 0, fwd_bad = 0, got_atts = 0, bad_att = 0, bad_qkv = 0;
  int got_ces = 0, bad_ce = 0;
  int *cast_of = malloc(sizeof(int) * (size_t)g->n);
  memset(cast_of, -1, sizeof(int) * (size_t)g->n);
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op == OP_CAST) {
      casts++;
      if (cast_of[n->in[0]] >= 0)
        twice++;
      cast_of[n->in[0]] = i;
    }
    if (n->op == OP_ATTENTION || n->op == OP_ATTENTION_LSE || n->op == OP_ATTENTION_BWD)
      for (int k = 0; k < 3; k++) { // q, k, v: a CAST, or a SLICE of one
        const IrNode *x = g->nodes[n->in[k]];
        const IrNode *c = x->op == OP_SLICE ? g->nodes[x->in[0]] : x;
        bad_qkv += x->dtype != DT_BF16 || c->op != OP_CAST || n->ia[4] != DT_BF16;
      }
    if (n->op == OP_ATTENTION_BWD) {
      const IrNode *x = g->nodes[n->in[n->nin - 1]], *o = g->nodes[att_bwd_out(n)];
      got_atts++;
      bad_att += x->op != OP_CAST || x->dtype != DT_BF16 || n->ia[4] != DT_BF16;
      // out: RESHAPE(CAST(RESHAPE(attention))), bf16
      const IrNode *oc = o->op == OP_RESHAPE ? g->nodes[o->in[0]] : o;
      const IrNode *ov = oc->op == OP_CAST ? g->nodes[oc->in[0]] : oc;
      bad_att += o->op != OP_RESHAPE || o->dtype != DT_BF16 || oc->op != OP_CAST || ov->op != OP_RESHAPE ||
                 g->nodes[ov->in[0]]->op != OP_ATTENTION;
    }
    if (n->op == OP_CROSS_ENTROPY || n->op == OP_CROSS_ENTROPY_BWD) {
      const IrNode *x = g->nodes[n->in[0]];
      got_ces++;
      bad_ce += x->op != OP_CAST || x->dtype != DT_BF16 || n->dtype != DT_F32 || g->nodes[n->in[1]]->dtype != DT_I32;
      // forward and backward read the same rounding
      for (int j = 0; j < i; j++)
        bad_ce += g->nodes[j]->op == OP_CROSS_ENTROPY && n->op == OP_CROSS_ENTROPY_BWD &&
                  g->nodes[j]->in[1] == n->in[1] && g->nodes[j]->in[0] != n->in[0];
    }
    if (n->op != OP_MATMUL)
      continue;
    got_matmuls++;
    for (int k = 0; k < 2; k++) {
      const IrNode *x = g->nodes[n->in[k]];
      if (x->op != OP_CAST || x->dtype != DT_BF16)
        bad_matmul++;
      if (i < g->fwd_end && n->in[k] >= g->fwd_end)
        fwd_bad++;
    }
    if (n->dtype != DT_F32)
      bad_matmul++;
  }
  snprintf(name, sizeof name, "precision: %s: every matmul reads two bf16 casts and yields f32", path);
  CHECK(bad_matmul == 0 && got_matmuls == matmuls, name, "%d bad operands, %d matmuls (had %d)", bad_matmul,
        got_matmuls, matmuls);
  snprintf(name, sizeof name,
           "precision: %s: every attention backward (%d) reads its dout through a bf16 cast, its out through the "
           "output projection's", path, atts);
  CHECK(bad_att == 0 && got_atts == atts, name, "%d bad, %d attention backward nodes (had %d)", bad_att, got_atts,
        atts);
  snprintf(name, sizeof name, "precision: %s: every cross-entropy and its backward (%d) reads the logits through one "
           "bf16 cast and yields f32", path, ces);
  CHECK(bad_ce == 0 && got_ces == ces && ces > 0, name, "%d bad, %d cross-entropy nodes (had %d)", bad_ce, got_ces,
        ces);
  if (fwd_atts) {
    snprintf(name, sizeof name, "precision: %s: every attention (%d forward) reads q, k and v as bf16 casts or "
             "slices of one", path, fwd_atts);
    CHECK(bad_qkv == 0, name, "%d bad", bad_qkv);
  }
  snprintf(name, sizeof name, "precision: %s: one cast per GEMM operand, attention input, dout and logits value (%d), "
           "none twice", path, want_casts);
  CHECK(casts == want_casts && twice == 0 && g->n == before->n + casts + want_views, name,
        "%d casts (%d twice), %d nodes, had %d, %d views", casts, twice, g->n, before->n, want_views);
  snprintf(name, sizeof name, "precision: %s: the forward's casts stay in the forward", path);
  CHECK(fwd_bad == 0, name, "%d forward matmuls read a cast after fwd_end", fwd_bad);
  int lists = 0;
  for (int k = 0; k < g->nparams; k++) {
    const IrNode *p = g->nodes[g->params[k]], *p0 = before->nodes[before->params[k]];
    lists += p->op != OP_PARAM || strcmp(p->name, p0->name) != 0;
    lists += g->nodes[g->grads[k]]->grad_of != g->params[k] && g->nodes[g->grads[k]]->op != OP_PARAM;
    lists += g->nodes[g->updates[k]]->op != OP_ADAMW || g->nodes[g->updates[k]]->param_of != g->params[k];
  }
  lists += g->nodes[g->loss]->op != before->nodes[before->loss]->op || g->nodes[g->loss]->shape.rank != 0;
  for (int k = 0; k < g->noutputs; k++)
    lists += g->nodes[g->outputs[k]]->op != before->nodes[before->outputs[k]]->op;
  snprintf(name, sizeof name, "precision: %s: params, grads, updates, loss and outputs renumbered", path);
  CHECK(lists == 0, name, "%d entries name the wrong node", lists);
  int n = g->n;
  IrNode **nodes = g->nodes;
  snprintf(name, sizeof name, "precision: %s: fp32 leaves the graph as it is", path);
  CHECK(precision_assign(g, DT_F32, why, sizeof why) && g->n == n && g->nodes == nodes, name, "n %d -> %d", n, g->n);
  free(operand);
  free(cast_of);
  arena_free(a);
  arena_free(b);
}

// Rule 9 on the bf16 graph: a step made of casts (and reshapes) alone reads a weight or the output of
// a GEMM, attention or LM-head step, never a value that a row-wise or elementwise kernel computes
// (that kernel writes the rounding itself); no "not fused" pair shares a step; and the casts that
// joined kernels are counted, so the test fails if the rule stops firing.
static void test_fusion(const char *path, const DimOverride *ov, int nov, int want_joined) {
  Arena *a = arena_new();
  Graph *g = training_graph_or_exit(a, path, ov, nov);
  char why[256], name[256];
  if (!precision_assign(g, DT_BF16, why, sizeof why)) {
    printf("[fail] precision: %s: %s\n", path, why);
    arena_free(a);
    return;
  }
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
  snprintf(name, sizeof name, "precision: %s: the bf16 graph fuses", path);
  CHECK(f != NULL, name, "%s", g->err);
  if (!f) {
    arena_free(a);
    return;
  }
  int lone_bad = 0, joined = 0, shared = 0;
  for (int s = 0; s < f->nsteps; s++) {
    const Step *st = &f->steps[s];
    bool only_casts = true;
    for (int k = 0; k < st->nnodes; k++) {
      Op op = g->nodes[st->nodes[k]]->op;
      only_casts = only_casts && (op == OP_CAST || op == OP_RESHAPE);
    }
    for (int k = 0; k < st->nnodes; k++) {
      const IrNode *c = g->nodes[st->nodes[k]];
      if (c->op != OP_CAST)
        continue;
      int x = c->in[0];
      while (g->nodes[x]->op == OP_RESHAPE && f->step_of[x] < 0)
        x = g->nodes[x]->in[0];
      int from = f->step_of[x];
      bool kernel_input = from >= 0 && f->steps[from].kind == STEP_KERNEL;
      if (only_casts && kernel_input && g->nodes[f->steps[from].root]->op != OP_SUM &&
          g->nodes[f->steps[from].root]->op != OP_MEAN && g->nodes[f->steps[from].root]->op != OP_MAX) {
        if (!lone_bad)
          printf("  %s: %s reads %%%d of %s\n", path, st->name, x, f->steps[from].name);
        lone_bad++;
      }
      joined += !only_casts && st->kind == STEP_KERNEL && from == s;
    }
  }
  for (int i = 0; i < f->nrejected; i++)
    shared += f->step_of[f->rejected[i].a] >= 0 && f->step_of[f->rejected[i].a] == f->step_of[f->rejected[i].b];
  snprintf(name, sizeof name, "precision: %s: no cast kernel reads what a row-wise or elementwise kernel computes",
           path);
  CHECK(lone_bad == 0, name, "%d casts left alone", lone_bad);
  snprintf(name, sizeof name, "precision: %s: %d casts written by the kernel of their input", path, want_joined);
  CHECK(joined == want_joined, name, "%d", joined);
  snprintf(name, sizeof name, "precision: %s: no 'not fused' pair shares a step", path);
  CHECK(shared == 0, name, "%d", shared);
  arena_free(a);
}

static void test_ir_rules(void) {
  Arena *a = arena_new();
  Graph *g = ir_new(a);
  SrcLoc l = {0};
  int x = ir_leaf(g, OP_PARAM, "x", DT_F32, shape_of(2, (int64_t[]){2, 3}), l);
  int w = ir_leaf(g, OP_PARAM, "w", DT_F32, shape_of(2, (int64_t[]){3, 4}), l);
  int xc = ir_add(g, OP_CAST, &x, 1, (int64_t[8]){DT_BF16}, NULL, l);
  CHECK(xc >= 0 && g->nodes[xc]->dtype == DT_BF16, "ir: cast to bf16 has dtype bf16", "%s", g->err);
  int bad = ir_add(g, OP_ADD, (int[]){xc, xc}, 2, NULL, NULL, l);
  CHECK(bad < 0 && strstr(g->err, "add: reads a bf16 value"), "ir: add of a bf16 value is rejected", "got %d: %s",
        bad, g->err);
  bad = ir_add(g, OP_MATMUL, (int[]){xc, w}, 2, NULL, NULL, l);
  CHECK(bad < 0 && strstr(g->err, "both must have one dtype"), "ir: matmul of bf16 and f32 is rejected", "got %d: %s",
        bad, g->err);
  int wc = ir_add(g, OP_CAST, &w, 1, (int64_t[8]){DT_BF16}, NULL, l);
  int mm = ir_add(g, OP_MATMUL, (int[]){xc, wc}, 2, NULL, NULL, l);
  CHECK(mm >= 0 && g->nodes[mm]->dtype == DT_F32, "ir: matmul of two bf16 values yields f32", "%s", g->err);
  bad = ir_add(g, OP_CAST, &xc, 1, (int64_t[8]){DT_I32}, NULL, l);
  CHECK(bad < 0 && strstr(g->err, "cast from bf16 to i32"), "ir: a cast of bf16 to i32 is rejected (f32 only)",
        "got %d: %s", bad, g->err);
  int xi = ir_add(g, OP_CAST, &x, 1, (int64_t[8]){DT_I32}, NULL, l);
  CHECK(xi >= 0 && g->nodes[xi]->dtype == DT_I32, "ir: a cast of f32 to i32 (int(x)) has dtype i32", "%s", g->err);
  // A cross-entropy (logits [2, 3], targets i32[2]) reads bf16 logits (the precision pass's CAST of
  // them); a softmax does not.
  int tg = ir_leaf(g, OP_INPUT, "t", DT_I32, shape_of(1, (int64_t[]){2}), l);
  int ce = ir_add(g, OP_CROSS_ENTROPY, (int[]){xc, tg}, 2, NULL, NULL, l);
  CHECK(ce >= 0 && g->nodes[ce]->dtype == DT_F32, "ir: a cross-entropy of bf16 logits yields f32", "%s", g->err);
  bad = ir_add(g, OP_SOFTMAX, &xc, 1, NULL, NULL, l);
  CHECK(bad < 0 && strstr(g->err, "softmax: reads a bf16 value"), "ir: softmax of a bf16 value is rejected",
        "got %d: %s", bad, g->err);
  // Attention backward (q, k, v, out, lse, dout) [1, 4, 8], 2 heads: a bf16 q, k, v, out and dout when
  // its products read bf16 (ia[4]), not when they read f32, and never a bf16 lse.
  Shape qs = shape_of(3, (int64_t[]){1, 4, 8});
  int q = ir_leaf(g, OP_PARAM, "q", DT_F32, qs, l), dout = ir_leaf(g, OP_PARAM, "dout", DT_F32, qs, l);
  int qc = ir_add(g, OP_CAST, &q, 1, (int64_t[8]){DT_BF16}, NULL, l);
  int dc = ir_add(g, OP_CAST, &dout, 1, (int64_t[8]){DT_BF16}, NULL, l);
  double scale[8] = {0.5};
  int lse = ir_add(g, OP_ATTENTION_LSE, (int[]){q, q, q}, 3, (int64_t[8]){2, 1, 0, 0, DT_BF16}, scale, l);
  CHECK(lse >= 0 && shape_eq(g->nodes[lse]->shape, shape_of(3, (int64_t[]){1, 2, 4})),
        "ir: attention_lse is [B, heads, T]", "%s", g->err);
  int lc = ir_add(g, OP_CAST, &lse, 1, (int64_t[8]){DT_BF16}, NULL, l);
  int ok16 = ir_add(g, OP_ATTENTION_BWD, (int[]){q, q, q, qc, lse, dc}, 6, (int64_t[8]){2, 1, 0, 0, DT_BF16}, scale, l);
  CHECK(ok16 >= 0, "ir: a bf16 attention backward reads a bf16 out and dout", "%s", g->err);
  bad = ir_add(g, OP_ATTENTION_BWD, (int[]){q, q, q, q, lse, dc}, 6, (int64_t[8]){2, 1, 0, 0, DT_F32}, scale, l);
  CHECK(bad < 0 && strstr(g->err, "reads a bf16 value"), "ir: an f32 attention backward rejects a bf16 dout",
        "got %d: %s", bad, g->err);
  ok16 = ir_add(g, OP_ATTENTION_BWD, (int[]){qc, qc, qc, q, lse, dout}, 6, (int64_t[8]){2, 1, 0, 0, DT_BF16}, scale, l);
  CHECK(ok16 >= 0, "ir: a bf16 attention backward reads a bf16 q, k and v", "%s", g->err);
  bad = ir_add(g, OP_ATTENTION_BWD, (int[]){qc, q, q, q, lse, dout}, 6, (int64_t[8]){2, 1, 0, 0, DT_F32}, scale, l);
  CHECK(bad < 0 && strstr(g->err, "reads a bf16 value"), "ir: an f32 attention backward rejects a bf16 q",
        "got %d: %s", bad, g->err);
  bad = ir_add(g, OP_ATTENTION, (int[]){q, qc, q}, 3, (int64_t[8]){2, 1, 0, 0, DT_F32}, scale, l);
  CHECK(bad < 0 && strstr(g->err, "reads a bf16 value"), "ir: an f32 attention rejects a bf16 k", "got %d: %s",
        bad, g->err);
  bad = ir_add(g, OP_ATTENTION_BWD, (int[]){q, q, q, q, lc, dout}, 6, (int64_t[8]){2, 1, 0, 0, DT_BF16}, scale, l);
  CHECK(bad < 0 && strstr(g->err, "reads a bf16 value"), "ir: attention backward rejects a bf16 lse", "got %d: %s",
        bad, g->err);
  bad = ir_add(g, OP_ATTENTION_BWD, (int[]){q, q, q, q, q, dout}, 6, (int64_t[8]){2, 1, 0, 0, DT_BF16}, scale, l);
  CHECK(bad < 0 && strstr(g->err, "attention_bwd: lse [1,4,8], not [1,2,4]"),
        "ir: attention backward rejects an lse of the wrong shape", "got %d: %s", bad, g->err);
  arena_free(a);
}

// Loss after each of `steps` AdamW steps on one batch (losses[0] is the first step's loss).
static bool train(Graph *g, int steps, double *losses, bool check_casts, int *not_bf16) {
  Interp *it = interp_new(g, INTERP_F32);
  interp_init_params(it, 5);
  interp_set_seed(it, 5);
  set_inputs_by(g, packed_batch, it, NULL, NULL);
  char err[256];
  for (int s = 1; s <= steps; s++) {
    interp_set_scalar(it, "lr", 3e-3);
    interp_set_scalar(it, "step", s);
    if (!interp_run(it, g->n, err, sizeof err)) {
      printf("[fail] interp: %s\n", err);
      interp_free(it);
      return false;
    }
    losses[s - 1] = interp_value(it, g->loss)[0];
    for (int i = 0; i < g->n && check_casts && s == 1; i++) {
      if (g->nodes[i]->op != OP_CAST)
        continue;
      const double *v = interp_value(it, i);
      for (int64_t j = 0; j < interp_numel(it, i); j++)
        *not_bf16 += round_bf16(v[j]) != v[j];
    }
  }
  interp_free(it);
  return true;
}

// gpt2-tiny's training graph at B=2, T=16 after the bf16 precision pass, or NULL after a [fail] line.
static Graph *tiny_bf16(Arena *a) {
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  Graph *g = training_graph_or_exit(a, "models/gpt2-tiny.mdl", ov, 2);
  char why[256];
  if (!precision_assign(g, DT_BF16, why, sizeof why)) {
    printf("[fail] precision: %s\n", why);
    return NULL;
  }
  return g;
}

// The bf16 loss is the cross-entropy of the logits rounded to bf16: recomputed here from the f32
// logits the interpreter holds, rounded, row by row; and the rounding moves it.
static void test_loss_rounding(void) {
  Arena *a = arena_new();
  Graph *g = tiny_bf16(a);
  char err[256];
  if (!g) {
    arena_free(a);
    return;
  }
  int ce = -1;
  for (int i = 0; i < g->n && ce < 0; i++)
    if (g->nodes[i]->op == OP_CROSS_ENTROPY)
      ce = i;
  Interp *it = interp_new(g, INTERP_F32);
  interp_init_params(it, 5);
  interp_set_seed(it, 5);
  set_inputs_by(g, packed_batch, it, NULL, NULL);
  interp_set_scalar(it, "lr", 3e-3);
  interp_set_scalar(it, "step", 1);
  bool ran = ce >= 0 && interp_run(it, g->n, err, sizeof err);
  CHECK(ran, "precision: gpt2-tiny bf16: one step interpreted", "%s", ce < 0 ? "no cross-entropy" : err);
  if (!ran) {
    interp_free(it);
    arena_free(a);
    return;
  }
  const IrNode *c = g->nodes[ce], *cast = g->nodes[c->in[0]];
  const double *logits = interp_value(it, cast->in[0]), *loss = interp_value(it, ce), *tg = interp_value(it, c->in[1]);
  int64_t v = cast->shape.d[cast->shape.rank - 1], rows = interp_numel(it, ce);
  double err16 = 0, moved = 0;
  for (int64_t r = 0; r < rows; r++) {
    const double *x = logits + r * v;
    double want[2];
    for (int k = 0; k < 2; k++) { // k = 0: rounded logits, 1: as they are
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < v; j++)
        m = fmax(m, k ? x[j] : round_bf16(x[j]));
      for (int64_t j = 0; j < v; j++)
        sum += exp((k ? x[j] : round_bf16(x[j])) - m);
      int64_t t = (int64_t)tg[r];
      want[k] = m + log(sum) - (k ? x[t] : round_bf16(x[t]));
    }
    err16 = fmax(err16, fabs(loss[r] - want[0]));
    moved = fmax(moved, fabs(want[1] - want[0]));
  }
  CHECK(cast->op == OP_CAST && err16 <= 1e-6 && moved > 1e-5,
        "precision: gpt2-tiny bf16: the loss is the cross-entropy of the logits rounded to bf16",
        "%lld rows: max error %.3g, rounding moves it by %.3g", (long long)rows, err16, moved);
  interp_free(it);
  arena_free(a);
}

static void test_interp(void) {
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  Arena *a = arena_new();
  Graph *g32 = training_graph_or_exit(a, "models/gpt2-tiny.mdl", ov, 2);
  Graph *g16 = training_graph_or_exit(a, "models/gpt2-tiny.mdl", ov, 2);
  char why[256];
  if (!precision_assign(g16, DT_BF16, why, sizeof why)) {
    printf("[fail] precision: %s\n", why);
    return;
  }
  enum { STEPS = 40 };
  double l32[STEPS], l16[STEPS];
  int not_bf16 = 0;
  if (!train(g32, STEPS, l32, false, NULL) || !train(g16, STEPS, l16, true, &not_bf16))
    return;
  CHECK(not_bf16 == 0, "interp: every cast value of gpt2-tiny is a bf16 value", "%d are not", not_bf16);
  double d = fabs(l16[0] - l32[0]) / fabs(l32[0]);
  CHECK(d > 1e-7 && d < 1e-2, "interp: the bf16 loss is near the fp32 one, not equal to it",
        "fp32 %.9g, bf16 %.9g (relative %.3g)", l32[0], l16[0], d);
  double end = fabs(l16[STEPS - 1] - l32[STEPS - 1]) / l32[STEPS - 1];
  CHECK(l16[STEPS - 1] < 0.4 * l16[0] && l32[STEPS - 1] < 0.4 * l32[0] && end < 0.05,
        "interp: 40 AdamW steps with bf16 GEMMs train as fp32 does", "fp32 %.4f -> %.4f, bf16 %.4f -> %.4f", l32[0],
        l32[STEPS - 1], l16[0], l16[STEPS - 1]);
  arena_free(a);
}

// Attention of a bf16 graph against the contract of mdl.h, computed here in double from the
// interpreter's own q, k, v (and dout and out): S = scale bf(q) bf(k)^T, e = exp(S - max), out = sum
// bf(e) bf(v) / sum e; dq, dk, dv softmax's backward with every product on bf16 operands (P exact in
// dS) and D = bf(dout) . bf(out), out the interpreter's forward value.
// Also: the rounding moves the
// output (the same formulas without bf differ by more than 1e-4).
static void test_attention(void) {
  Arena *a = arena_new();
  Graph *g = tiny_bf16(a);
  char err[256];
  if (!g) {
    arena_free(a);
    return;
  }
  Interp *it = interp_new(g, INTERP_F64);
  interp_init_params(it, 3);
  interp_set_seed(it, 3);
  set_inputs_by(g, packed_batch, it, NULL, NULL);
  interp_set_scalar(it, "lr", 3e-3);
  interp_set_scalar(it, "step", 1);
  if (!interp_run(it, g->n, err, sizeof err)) {
    printf("[fail] interp: %s\n", err);
    return;
  }
  int att = -1, bwd[3] = {-1, -1, -1};
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_ATTENTION && att < 0)
      att = i;
  const IrNode *A = g->nodes[att];
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op == OP_ATTENTION_BWD && !memcmp(n->in, A->in, sizeof(int) * 3))
      bwd[n->ia[3]] = i;
  }
  CHECK(A->ia[4] == DT_BF16 && bwd[0] >= 0 && bwd[1] >= 0 && bwd[2] >= 0,
        "attention: the precision pass marks attention and its backward bf16", "ia[4] = %lld", (long long)A->ia[4]);
  if (bwd[0] < 0 || bwd[1] < 0 || bwd[2] < 0)
    return;
  int64_t nb = A->shape.d[0], nt = A->shape.d[1], nc = A->shape.d[2], hs = A->ia[0], d = nc / hs;
  double scale = A->fa[0];
  const double *q = interp_value(it, A->in[0]), *k = interp_value(it, A->in[1]), *v = interp_value(it, A->in[2]);
  const double *doc = interp_value(it, A->in[3]), *dout = interp_value(it, att_bwd_dout(g->nodes[bwd[0]]));
  const double *out = interp_value(it, att);
  const double *got[4] = {interp_value(it, att), interp_value(it, bwd[0]), interp_value(it, bwd[1]),
                          interp_value(it, bwd[2])};
  size_t n = (size_t)(nb * nt * nc);
  double *want[5];
  for (int w = 0; w < 5; w++)
    want[w] = calloc(n, sizeof(double)); // out, dq, dk, dv, and out without rounding
  double *e = malloc(sizeof(double) * (size_t)nt), *e32 = malloc(sizeof(double) * (size_t)nt);
  double *ds = malloc(sizeof(double) * (size_t)nt);
#define X(t, c) (((b)*nt + (t)) * nc + h * d + (c))
#define R(x) ref_bf16((float)(x))
  for (int64_t b = 0; b < nb; b++)
    for (int64_t h = 0; h < hs; h++)
      for (int64_t i = 0; i < nt; i++) {
        double m = -INFINITY, m32 = -INFINITY, l = 0, l32 = 0;
        for (int64_t j = 0; j < nt; j++) {
          bool ok = j <= i && doc[b * nt + j] == doc[b * nt + i];
          double s = 0, s32 = 0;
          for (int64_t c = 0; c < d; c++) {
            s += R(q[X(i, c)]) * R(k[X(j, c)]);
            s32 += q[X(i, c)] * k[X(j, c)];
          }
          e[j] = ok ? s * scale : -INFINITY;
          e32[j] = ok ? s32 * scale : -INFINITY;
          m = fmax(m, e[j]);
          m32 = fmax(m32, e32[j]);
        }
        for (int64_t j = 0; j < nt; j++) {
          l += e[j] = exp(e[j] - m);
          l32 += e32[j] = exp(e32[j] - m32);
        }
        for (int64_t j = 0; j < nt; j++)
          for (int64_t c = 0; c < d; c++) {
            want[0][X(i, c)] += R(e[j]) * R(v[X(j, c)]) / l;
            want[4][X(i, c)] += e32[j] * v[X(j, c)] / l32;
          }
        // backward: P = e / l; dP = bf(dout) . bf(v); dS = P (dP - bf(dout) . bf(out)); products on bf16
        double dot = 0;
        for (int64_t c = 0; c < d; c++)
          dot += R(dout[X(i, c)]) * R(out[X(i, c)]);
        for (int64_t j = 0; j < nt; j++) {
          double dp = 0;
          for (int64_t c = 0; c < d; c++)
            dp += R(dout[X(i, c)]) * R(v[X(j, c)]);
          ds[j] = dp;
        }
        for (int64_t j = 0; j < nt; j++) {
          double p = e[j] / l, dsj = R(p * (ds[j] - dot));
          for (int64_t c = 0; c < d; c++) {
            want[1][X(i, c)] += scale * dsj * R(k[X(j, c)]);
            want[2][X(j, c)] += scale * dsj * R(q[X(i, c)]);
            want[3][X(j, c)] += R(p) * R(dout[X(i, c)]);
          }
        }
      }
#undef X
#undef R
  const char *what[4] = {"out", "dq", "dk", "dv"};
  for (int w = 0; w < 4; w++) {
    double diff = 0, ref = 0;
    for (size_t j = 0; j < n; j++) {
      diff = fmax(diff, fabs(got[w][j] - want[w][j]));
      ref = fmax(ref, fabs(want[w][j]));
    }
    char name[128];
    snprintf(name, sizeof name, "attention bf16: the interpreter's %s follows the contract (within 1e-6)", what[w]);
    CHECK(diff <= 1e-6 * ref && ref > 0, name, "max error %.3g of %.3g", diff, ref);
  }
  double moved = 0, ref = 0;
  for (size_t j = 0; j < n; j++) {
    moved = fmax(moved, fabs(want[4][j] - want[0][j]));
    ref = fmax(ref, fabs(want[4][j]));
  }
  CHECK(moved > 1e-4 * ref, "attention bf16: rounding q, k, v and e moves the output", "%.3g of %.3g", moved, ref);
  for (int w = 0; w < 5; w++)
    free(want[w]);
  free(e);
  free(e32);
  free(ds);
  interp_free(it);
  arena_free(a);
}

int main(void) {
  test_rounding();
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  test_structure("models/gpt2-tiny.mdl", ov, 2);
  test_loss_rounding();
  test_structure("models/llama-tiny.mdl", ov, 2);
  test_structure("models/mlp.mdl", NULL, 0);
  test_fusion("models/gpt2-tiny.mdl", ov, 2, 11); // 5 norm outputs, 3 gradients a layer
  test_fusion("models/llama-tiny.mdl", ov, 2, 25); // and q, k: the rope kernels store their roundings
  test_ir_rules();
  test_attention();
  test_interp();
  TEST_EXIT();
}
