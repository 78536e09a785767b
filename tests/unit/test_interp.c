// test_interp.c: the reference interpreter against values computed by hand or by an independent
// reference (PyTorch, for gelu/silu/layernorm/cross-entropy/AdamW, pasted as literals), and every
// backward op against central finite differences of its forward op through the interpreter.
#include "mdl.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const SrcLoc L0;
static Arena *arena;
static Graph *g;

#define SH(...) shape_of((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__})
#define IA(...) ((int64_t[8]){__VA_ARGS__})
#define FA(...) ((double[6]){__VA_ARGS__})
#define NODE(op, ia, fa, ...)                                                                      \
  must(ir_add(g, op, (int[]){__VA_ARGS__}, (int)(sizeof((int[]){__VA_ARGS__}) / sizeof(int)), ia, fa, L0))

static void fresh(void) {
  arena_free(arena);
  arena = arena_new();
  g = ir_new(arena);
}

static int must(int id) {
  if (id < 0) {
    printf("[fail] building a test graph: %s\n", g->err);
    exit(1);
  }
  return id;
}

static int param(const char *name, Shape s) { return must(ir_leaf(g, OP_PARAM, name, DT_F32, s, L0)); }
static int ids_input(const char *name, Shape s) { return must(ir_leaf(g, OP_INPUT, name, DT_I32, s, L0)); }

static void set(Interp *it, int node, const double *v) {
  memcpy(interp_param(it, node), v, sizeof(double) * (size_t)interp_numel(it, node));
}

// Fills a parameter with values in [-1, 1) from a fixed stream.
static void set_random(Interp *it, int node, uint64_t stream) {
  double *p = interp_param(it, node);
  for (int64_t i = 0; i < interp_numel(it, node); i++)
    p[i] = 2 * mdl_rng_uniform(42, stream, (uint64_t)i) - 1;
}

static void run(Interp *it) {
  char err[256];
  if (!interp_run(it, g->n, err, sizeof err)) {
    printf("[fail] interp_run: %s\n", err);
    exit(1);
  }
}

// Largest |a - b| over n values; a NaN on either side counts as infinite (fmax alone would drop it).
static double maxdiff(const double *a, const double *b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) {
    double x = fabs(a[i] - b[i]);
    m = fmax(m, isnan(x) ? INFINITY : x);
  }
  return m;
}

#define EXPECT(it, node, tol, name, ...)                                                           \
  do {                                                                                             \
    const double want_[] = {__VA_ARGS__};                                                         \
    int64_t n_ = (int64_t)(sizeof want_ / sizeof want_[0]);                                        \
    const double *got_ = interp_value(it, node);                                                   \
    CHECK(interp_numel(it, node) == n_ && maxdiff(got_, want_, n_) <= (tol), name,                 \
          "numel %lld (want %lld), max diff %g, first value %.17g (want %.17g)",                   \
          (long long)interp_numel(it, node), (long long)n_, maxdiff(got_, want_, n_), got_[0],     \
          want_[0]);                                                                               \
  } while (0)

static void test_elementwise(void) {
  fresh();
  int x = param("x", SH(3));
  int neg = NODE(OP_NEG, NULL, NULL, x), ex = NODE(OP_EXP, NULL, NULL, x);
  int th = NODE(OP_TANH, NULL, NULL, x), relu = NODE(OP_RELU, NULL, NULL, x);
  int ge = NODE(OP_GELU, NULL, NULL, x), si = NODE(OP_SILU, NULL, NULL, x);
  int sq = NODE(OP_SQRT, NULL, NULL, ex), rs = NODE(OP_RSQRT, NULL, NULL, ex);
  int lg = NODE(OP_LOG, NULL, NULL, ex);
  Interp *it = interp_new(g, INTERP_F64);
  set(it, x, (double[]){1, -0.5, 2});
  run(it);
  EXPECT(it, neg, 0, "neg", -1, 0.5, -2);
  EXPECT(it, ex, 1e-15, "exp", 2.718281828459045, 0.6065306597126334, 7.38905609893065);
  EXPECT(it, lg, 1e-15, "log of exp", 1, -0.5, 2);
  EXPECT(it, sq, 1e-15, "sqrt", 1.6487212707001282, 0.7788007830714049, 2.718281828459045);
  EXPECT(it, rs, 1e-15, "rsqrt", 0.6065306597126334, 1.2840254166877414, 0.36787944117144233);
  EXPECT(it, th, 1e-15, "tanh", 0.7615941559557649, -0.46211715726000974, 0.9640275800758169);
  EXPECT(it, relu, 0, "relu", 1, 0, 2);
  EXPECT(it, ge, 1e-14, "gelu (tanh approximation)", 0.8411919906082768, -0.15428599017485606,
         1.954597694087775);
  EXPECT(it, si, 1e-14, "silu", 0.7310585786300049, -0.1887703343990727, 1.7615941559557646);
  interp_free(it);

  // The gradients against PyTorch's, with dy = 1.
  fresh();
  x = param("x", SH(3));
  int ones = must(ir_broadcast(g, must(ir_const(g, 1, L0)), SH(3), L0));
  int gb = NODE(OP_GELU_BWD, NULL, NULL, x, ones);
  int sb = NODE(OP_SILU_BWD, NULL, NULL, x, ones), rb = NODE(OP_RELU_BWD, NULL, NULL, x, ones);
  it = interp_new(g, INTERP_F64);
  set(it, x, (double[]){1, -0.5, 2});
  run(it);
  EXPECT(it, gb, 1e-14, "gelu_bwd", 1.0829640838457826, 0.13263009646535764, 1.0860992566236183);
  EXPECT(it, sb, 1e-14, "silu_bwd", 0.9276705118714869, 0.2600388126973482, 1.0907842487848955);
  EXPECT(it, rb, 0, "relu_bwd", 1, 0, 1);
  interp_free(it);
}

// Integer arithmetic on i32 against numpy's (np.int32 arrays: a // b, a % b, wrapping + - * and
// negation), 0 where the divisor is 0 (numpy's result, with its warning); min, max and comparisons
// of integers; casts toward zero, saturating, NaN to 0 (numpy's astype(np.int32) leaves those to the
// platform), and back to f32.
static void test_integers(void) {
  fresh();
  int a = ids_input("a", SH(8)), b = ids_input("b", SH(8)), x = must(ir_leaf(g, OP_INPUT, "x", DT_F32, SH(8), L0));
  int fd = NODE(OP_FLOORDIV, NULL, NULL, a, b), md = NODE(OP_MOD, NULL, NULL, a, b);
  int ad = NODE(OP_ADD, NULL, NULL, a, b), mu = NODE(OP_MUL, NULL, NULL, a, b), ng = NODE(OP_NEG, NULL, NULL, a);
  int ab = NODE(OP_ABS, NULL, NULL, a), mx = NODE(OP_MAXIMUM, NULL, NULL, a, b);
  int lt = NODE(OP_COMPARE, IA(CMP_LT), NULL, a, b), sevens = must(ir_const_i32(g, 7, L0));
  int sub = NODE(OP_SUB, NULL, NULL, a, sevens);
  int ti = NODE(OP_CAST, IA(DT_I32), NULL, x), tf = NODE(OP_CAST, IA(DT_F32), NULL, a);
  bool typed = g->nodes[fd]->dtype == DT_I32 && g->nodes[lt]->dtype == DT_F32 && g->nodes[ti]->dtype == DT_I32 &&
               g->nodes[tf]->dtype == DT_F32 && g->nodes[sub]->dtype == DT_I32;
  CHECK(typed, "i32 arithmetic is i32, its comparisons an f32 mask, casts of the dtype asked for", "dtypes");
  CHECK(ir_add(g, OP_ADD, (int[]){a, x}, 2, NULL, NULL, L0) < 0 && strstr(g->err, "i32 and f32 do not mix") &&
            ir_add(g, OP_MOD, (int[]){x, x}, 2, NULL, NULL, L0) < 0 && strstr(g->err, "needs i32 operands"),
        "i32 and f32 operands do not mix; // and % need i32", "%s", g->err);
  Interp *it = interp_new(g, INTERP_F32);
  const int32_t av[8] = {7, -7, 7, -7, 5, INT32_MIN, 2000000000, 0}, bv[8] = {2, 2, -2, -2, 0, -1, 3, -3};
  const float xv[8] = {2.7f, -2.7f, 0.5f, -0.5f, 3e9f, -3e9f, NAN, INFINITY};
  interp_set_input(it, "a", av, NULL, 8);
  interp_set_input(it, "b", bv, NULL, 8);
  interp_set_input(it, "x", NULL, xv, 8);
  run(it);
  EXPECT(it, fd, 0, "i32 //: rounded down, 0 for a divisor of 0, INT32_MIN // -1 wraps", 3, -4, -4, 3, 0,
         INT32_MIN, 666666666, 0);
  EXPECT(it, md, 0, "i32 %: the divisor's sign, 0 for a divisor of 0", 1, 1, -1, -1, 0, 0, 2, 0);
  EXPECT(it, ad, 0, "i32 +", 9, -5, 5, -9, 5, INT32_MAX, 2000000003, -3);
  EXPECT(it, mu, 0, "i32 *: wraps modulo 2^32", 14, -14, -14, 14, 0, INT32_MIN, 1705032704, 0);
  EXPECT(it, ng, 0, "i32 negation: -INT32_MIN wraps to itself", -7, 7, -7, 7, -5, INT32_MIN, -2000000000, 0);
  EXPECT(it, ab, 0, "i32 abs", 7, 7, 7, 7, 5, INT32_MIN, 2000000000, 0);
  EXPECT(it, mx, 0, "i32 maximum", 7, 2, 7, -2, 5, -1, 2000000000, 0);
  EXPECT(it, lt, 0, "i32 <", 0, 1, 0, 1, 0, 1, 0, 0);
  EXPECT(it, sub, 0, "i32 minus an i32 constant", 0, -14, 0, -14, -2, INT32_MAX - 6, 1999999993, -7);
  EXPECT(it, ti, 0, "int(x): toward zero, saturating, NaN to 0", 2, -2, 0, 0, INT32_MAX, INT32_MIN, 0, INT32_MAX);
  EXPECT(it, tf, 0, "float(i): rounded to f32", 7, -7, 7, -7, 5, -2147483648.0, 2000000000, 0);
  interp_free(it);
}

static void test_broadcast_and_precision(void) {
  fresh();
  int a = param("a", SH(2, 1)), b = param("b", SH(3));
  int add = NODE(OP_ADD, NULL, NULL, a, b), sub = NODE(OP_SUB, NULL, NULL, b, a);
  int mul = NODE(OP_MUL, NULL, NULL, a, b);
  int three = must(ir_const(g, 3, L0));
  int div = NODE(OP_DIV, NULL, NULL, a, three);
  int bc = must(ir_broadcast(g, b, SH(2, 2, 3), L0));
  Interp *it = interp_new(g, INTERP_F64);
  set(it, a, (double[]){1, 2});
  set(it, b, (double[]){10, 20, 30});
  run(it);
  EXPECT(it, add, 0, "add [2,1] + [3]", 11, 21, 31, 12, 22, 32);
  EXPECT(it, sub, 0, "sub [3] - [2,1]", 9, 19, 29, 8, 18, 28);
  EXPECT(it, mul, 0, "mul [2,1] * [3]", 10, 20, 30, 20, 40, 60);
  EXPECT(it, bc, 0, "broadcast [3] to [2,2,3]", 10, 20, 30, 10, 20, 30, 10, 20, 30, 10, 20, 30);
  CHECK(interp_value(it, div)[0] == 1.0 / 3, "f64 keeps doubles", "%.17g", interp_value(it, div)[0]);
  interp_free(it);

  it = interp_new(g, INTERP_F32);
  set(it, a, (double[]){1, 2});
  set(it, b, (double[]){10, 20, 30});
  run(it);
  CHECK(interp_value(it, div)[0] == (double)(float)(1.0 / 3) && interp_value(it, div)[1] == (double)(2.0f / 3),
        "f32 rounds each result to float", "%.17g", interp_value(it, div)[0]);
  interp_free(it);
}

static void test_matmul(void) {
  const double a[] = {1, 2, 3, 4, 5, 6}, at[] = {1, 4, 2, 5, 3, 6};        // [2,3] and its transpose
  const double b[] = {7, 8, 9, 10, 11, 12}, bt[] = {7, 9, 11, 8, 10, 12}; // [3,2] and its transpose
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      fresh();
      int pa = param("a", ta ? SH(3, 2) : SH(2, 3)), pb = param("b", tb ? SH(2, 3) : SH(3, 2));
      int mm = NODE(OP_MATMUL, IA(ta, tb), NULL, pa, pb);
      Interp *it = interp_new(g, INTERP_F64);
      set(it, pa, ta ? at : a);
      set(it, pb, tb ? bt : b);
      run(it);
      char name[64];
      snprintf(name, sizeof name, "matmul 2x3 @ 3x2 ta=%d tb=%d", ta, tb);
      EXPECT(it, mm, 0, name, 58, 64, 139, 154);
      interp_free(it);
    }
  // Batch axes broadcast: [2,1,2,3] @ [3,3,2] -> [2,3,2,2].
  fresh();
  int pa = param("a", SH(2, 1, 2, 3)), pb = param("b", SH(3, 3, 2));
  int mm = NODE(OP_MATMUL, NULL, NULL, pa, pb);
  Interp *it = interp_new(g, INTERP_F64);
  set_random(it, pa, 1);
  set_random(it, pb, 2);
  run(it);
  const double *A = interp_param(it, pa), *B = interp_param(it, pb), *Y = interp_value(it, mm);
  double err = 0;
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 3; j++)
      for (int r = 0; r < 2; r++)
        for (int c = 0; c < 2; c++) {
          double s = 0;
          for (int k = 0; k < 3; k++)
            s += A[(i * 2 + r) * 3 + k] * B[(j * 3 + k) * 2 + c];
          err = fmax(err, fabs(s - Y[((i * 3 + j) * 2 + r) * 2 + c]));
        }
  CHECK(interp_numel(it, mm) == 24 && err < 1e-15, "matmul with broadcast batch axes", "err %g", err);
  interp_free(it);
}

static void test_reductions(void) {
  fresh();
  int x = param("x", SH(2, 3));
  int s0 = NODE(OP_SUM, IA(0, 0), NULL, x), s1k = NODE(OP_SUM, IA(1, 1), NULL, x);
  int m1 = NODE(OP_MEAN, IA(1, 0), NULL, x), mx0 = NODE(OP_MAX, IA(0, 0), NULL, x);
  int mx1k = NODE(OP_MAX, IA(1, 1), NULL, x);
  int flat = must(ir_reshape(g, x, SH(6), L0));
  int all = NODE(OP_SUM, IA(0, 0), NULL, flat);
  Interp *it = interp_new(g, INTERP_F64);
  set(it, x, (double[]){1, 5, 3, 4, 2, 6});
  run(it);
  EXPECT(it, s0, 0, "sum axis 0", 5, 7, 9);
  EXPECT(it, s1k, 0, "sum axis 1 keepdim", 9, 12);
  CHECK(g->nodes[s1k]->shape.rank == 2 && g->nodes[s1k]->shape.d[1] == 1, "keepdim keeps the axis", "rank %d",
        g->nodes[s1k]->shape.rank);
  EXPECT(it, m1, 0, "mean axis 1", 3, 4);
  EXPECT(it, mx0, 0, "max axis 0", 4, 5, 6);
  EXPECT(it, mx1k, 0, "max axis 1 keepdim", 5, 6);
  EXPECT(it, all, 0, "sum of everything to a scalar", 21);
  set(it, x, (double[]){1, NAN, 3, -INFINITY, -INFINITY, -INFINITY});
  run(it);
  const double *mv = interp_value(it, mx1k);
  CHECK(isnan(mv[0]) && mv[1] == -INFINITY, "max propagates NaN and handles -inf", "%g %g", mv[0], mv[1]);
  interp_free(it);

  // Ties share the gradient evenly.
  fresh();
  x = param("x", SH(2, 3));
  int y = NODE(OP_MAX, IA(1, 1), NULL, x);
  int dy = param("dy", SH(2, 1));
  int dx = NODE(OP_MAX_BWD, IA(1, 1), NULL, x, y, dy);
  it = interp_new(g, INTERP_F64);
  set(it, x, (double[]){2, 2, 1, 0, 7, 7});
  set(it, dy, (double[]){1, 3});
  run(it);
  EXPECT(it, dx, 0, "max_bwd with ties", 0.5, 0.5, 0, 0, 1.5, 1.5);
  interp_free(it);
}

static void test_layout(void) {
  fresh();
  int x = param("x", SH(2, 3));
  int sl = NODE(OP_SLICE, IA(1, 1, 3), NULL, x);
  int sb = must(ir_slice_bwd(g, sl, SH(2, 3), 1, 1, 3, L0));
  int c0 = NODE(OP_CONCAT, IA(0), NULL, x, x), c1 = NODE(OP_CONCAT, IA(1), NULL, x, sl);
  int tr = NODE(OP_PERMUTE, IA(1, 0), NULL, x);
  int x3 = must(ir_reshape(g, x, SH(1, 2, 3), L0));
  int p3 = NODE(OP_PERMUTE, IA(2, 0, 1), NULL, x3);
  Interp *it = interp_new(g, INTERP_F64);
  set(it, x, (double[]){0, 1, 2, 3, 4, 5});
  run(it);
  EXPECT(it, sl, 0, "slice axis 1 [1,3)", 1, 2, 4, 5);
  EXPECT(it, sb, 0, "slice_bwd puts dy back in zeros", 0, 1, 2, 0, 4, 5);
  EXPECT(it, c0, 0, "concat axis 0", 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5);
  EXPECT(it, c1, 0, "concat axis 1", 0, 1, 2, 1, 2, 3, 4, 5, 4, 5);
  EXPECT(it, tr, 0, "permute [1,0]", 0, 3, 1, 4, 2, 5);
  EXPECT(it, p3, 0, "permute [2,0,1] of [1,2,3]", 0, 3, 1, 4, 2, 5);
  interp_free(it);
}

static void test_embed(void) {
  fresh();
  int tab = param("wte", SH(4, 2));
  int ids = ids_input("tokens", SH(3));
  int e = NODE(OP_EMBED, NULL, NULL, tab, ids);
  int eb = must(ir_embed_bwd(g, ids, e, 4, L0));
  Interp *it = interp_new(g, INTERP_F64);
  set(it, tab, (double[]){0, 1, 10, 11, 20, 21, 30, 31});
  char err[256] = "";
  CHECK(!interp_run(it, g->n, err, sizeof err) && strcmp(err, "input 'tokens' was never set") == 0,
        "an input never set is an error", "message '%s'", err);
  CHECK(interp_set_input(it, "tokens", (int32_t[]){3, 0, 3}, NULL, 3), "set i32 input", "rejected");
  CHECK(!interp_set_input(it, "tokens", (int32_t[]){3, 0}, NULL, 2), "set input of the wrong size fails",
        "accepted");
  CHECK(!interp_set_input(it, "nothing", (int32_t[]){0}, NULL, 1), "set unknown input fails", "accepted");
  run(it);
  EXPECT(it, e, 0, "embed rows", 30, 31, 0, 1, 30, 31);
  EXPECT(it, eb, 0, "embed_bwd scatter-adds repeated ids", 0, 1, 0, 0, 0, 0, 60, 62);
  interp_free(it);

  fresh();
  tab = param("wte", SH(256, 1));
  ids = ids_input("tokens", SH(2));
  e = NODE(OP_EMBED, NULL, NULL, tab, ids);
  it = interp_new(g, INTERP_F32);
  interp_set_input(it, "tokens", (int32_t[]){5, 300}, NULL, 2);
  CHECK(!interp_run(it, g->n, err, sizeof err) && strcmp(err, "embed: id 300 out of range [0, 256)") == 0,
        "embed id out of range", "message '%s'", err);
  interp_set_input(it, "tokens", (int32_t[]){-1, 0}, NULL, 2);
  CHECK(!interp_run(it, g->n, err, sizeof err) && strcmp(err, "embed: id -1 out of range [0, 256)") == 0,
        "embed negative id", "message '%s'", err);
  interp_free(it);
}

static void test_rows(void) {
  fresh();
  int x = param("x", SH(1, 4)), w = param("w", SH(4)), b = param("b", SH(4));
  int ln = NODE(OP_LAYERNORM, NULL, FA(1e-5), x, w, b), rms = NODE(OP_RMSNORM, NULL, FA(1e-5), x, w);
  int v = param("v", SH(3));
  int sm = NODE(OP_SOFTMAX, NULL, NULL, v);
  Interp *it = interp_new(g, INTERP_F64);
  set(it, x, (double[]){1, 2, 3, 4});
  set(it, w, (double[]){1, 1, 2, 2});
  set(it, b, (double[]){0, 0, 1, 1});
  set(it, v, (double[]){1, 2, 3});
  run(it);
  EXPECT(it, ln, 1e-14, "layernorm of a row", -1.341635419968927, -0.4472118066563091, 1.8944236133126178,
         3.6832708399378538);
  EXPECT(it, rms, 1e-14, "rmsnorm of a row", 0.3651481282381064, 0.7302962564762128, 2.1908887694286383,
         2.921185025904851);
  EXPECT(it, sm, 1e-15, "softmax of [1,2,3]", 0.09003057317038045, 0.2447284710547976, 0.6652409557748218);
  interp_free(it);
}

static void test_cross_entropy(void) {
  fresh();
  int l = param("logits", SH(3, 3));
  int t = ids_input("targets", SH(3));
  int ce = NODE(OP_CROSS_ENTROPY, NULL, NULL, l, t);
  int dl = param("dloss", SH(3));
  int ceb = NODE(OP_CROSS_ENTROPY_BWD, NULL, NULL, l, t, dl);
  Interp *it = interp_new(g, INTERP_F64);
  set(it, l, (double[]){1, 2, 3, 0, 0, 0, 5, 1, 1});
  set(it, dl, (double[]){1, 1, 2});
  interp_set_input(it, "targets", (int32_t[]){2, -1, 0}, NULL, 3);
  run(it);
  EXPECT(it, ce, 1e-15, "cross_entropy with an ignored row", 0.4076059644443804, 0, 0.03597629974819324);
  EXPECT(it, ceb, 1e-15, "cross_entropy_bwd", 0.09003057317038043, 0.24472847105479764, -0.3347590442251782, 0,
         0, 0, -0.07067368805619245, 0.0353368440280961, 0.0353368440280961);
  interp_set_input(it, "targets", (int32_t[]){2, 3, 0}, NULL, 3);
  char err[256] = "";
  CHECK(!interp_run(it, g->n, err, sizeof err) && strcmp(err, "cross_entropy: target 3 out of range [0, 3)") == 0,
        "cross_entropy target >= V", "message '%s'", err);
  interp_free(it);
}

// The targets that count (>= 0), at least 1.
static void test_target_count(void) {
  fresh();
  int t = ids_input("targets", SH(2, 3));
  int n = NODE(OP_TARGET_COUNT, NULL, NULL, t);
  Interp *it = interp_new(g, INTERP_F32);
  interp_set_input(it, "targets", (int32_t[]){0, -1, 7, -3, 2, 1}, NULL, 6);
  run(it);
  EXPECT(it, n, 0, "target_count of [0, -1, 7, -3, 2, 1]", 4);
  interp_set_input(it, "targets", (int32_t[]){-1, -1, -1, -1, -1, -1}, NULL, 6);
  run(it);
  EXPECT(it, n, 0, "target_count with every target ignored is 1", 1);
  interp_free(it);
}

// T = 3, two heads of width 1. Head 0: q = 1, k_j = ln(j+1), so p_ij is proportional to j+1 over
// the allowed j; head 1: q = 0, a plain average of the allowed v_j.
static void test_attention(void) {
  for (int mode = 0; mode < 3; mode++) { // 0 causal, 1 causal + doc, 2 doc only
    fresh();
    int q = param("q", SH(1, 3, 2)), k = param("k", SH(1, 3, 2)), v = param("v", SH(1, 3, 2));
    int doc = ids_input("doc", SH(1, 3));
    int64_t causal = mode != 2, has_doc = mode != 0;
    int at = has_doc ? NODE(OP_ATTENTION, IA(2, causal, 1), FA(1), q, k, v, doc)
                     : NODE(OP_ATTENTION, IA(2, causal, 0), FA(1), q, k, v);
    // lse [1, 2 heads, 3]: head 0 log sum (j + 1) over the allowed j, head 1 log(their count).
    int lse = has_doc ? NODE(OP_ATTENTION_LSE, IA(2, causal, 1), FA(1), q, k, v, doc)
                      : NODE(OP_ATTENTION_LSE, IA(2, causal, 0), FA(1), q, k, v);
    Interp *it = interp_new(g, INTERP_F64);
    set(it, q, (double[]){1, 0, 1, 0, 1, 0});
    set(it, k, (double[]){log(1), 5, log(2), -3, log(3), 7});
    set(it, v, (double[]){1, 3, 10, 6, 100, 9});
    interp_set_input(it, "doc", (int32_t[]){0, 0, 1}, NULL, 3);
    run(it);
    if (mode == 0) {
      EXPECT(it, at, 1e-13, "attention causal T=3", 1, 3, 7, 4.5, 53.5, 6);
      EXPECT(it, lse, 1e-13, "attention_lse causal T=3", 0, log(3), log(6), 0, log(2), log(3));
    } else if (mode == 1) {
      EXPECT(it, at, 1e-13, "attention causal within documents", 1, 3, 7, 4.5, 100, 9);
      EXPECT(it, lse, 1e-13, "attention_lse causal within documents", 0, log(3), log(3), 0, log(2), 0);
    } else {
      EXPECT(it, at, 1e-13, "attention non-causal within documents", 7, 4.5, 7, 4.5, 100, 9);
      EXPECT(it, lse, 1e-13, "attention_lse non-causal within documents", log(3), log(3), log(3), log(2), log(2), 0);
    }
    interp_free(it);
  }
}

static void test_rope(void) {
  fresh();
  int x = param("x", SH(1, 2, 4));
  int pos = ids_input("pos", SH(1, 2));
  int r = NODE(OP_ROPE, IA(1, 0), FA(10000), x, pos);
  int back = NODE(OP_ROPE, IA(1, 1), FA(10000), r, pos);
  Interp *it = interp_new(g, INTERP_F64);
  set(it, x, (double[]){1, 0, 0, 1, 1, 0, 0, 1});
  interp_set_input(it, "pos", (int32_t[]){1, 2}, NULL, 2);
  run(it);
  // Pairs (0,2) rotate by pos, pairs (1,3) by pos * 10000^(-1/2) = pos / 100.
  EXPECT(it, r, 1e-15, "rope rotates pairs (i, i+D/2)", cos(1), -sin(0.01), sin(1), cos(0.01), cos(2),
         -sin(0.02), sin(2), cos(0.02));
  EXPECT(it, back, 1e-15, "inverse rope undoes rope", 1, 0, 0, 1, 1, 0, 0, 1);
  interp_free(it);
}

static void test_dropout(void) {
  fresh();
  int x = param("x", SH(10000));
  int d = NODE(OP_DROPOUT, IA(3), FA(0.25), x);
  Interp *it = interp_new(g, INTERP_F64);
  double *xv = interp_param(it, x);
  for (int i = 0; i < 10000; i++)
    xv[i] = 1;
  interp_set_seed(it, 9);
  run(it);
  const double *y = interp_value(it, d);
  int kept = 0, bad = 0;
  for (int i = 0; i < 10000; i++) {
    bool keep = mdl_rng_uniform(9, 3, (uint64_t)i) >= 0.25;
    kept += keep;
    bad += y[i] != (keep ? 1 / 0.75 : 0);
  }
  CHECK(bad == 0, "dropout keeps u >= p and scales by 1/(1-p)", "%d elements differ", bad);
  CHECK(kept > 7300 && kept < 7700, "dropout keeps about 1-p", "kept %d of 10000", kept);
  double first[64];
  memcpy(first, y, sizeof first);
  interp_set_seed(it, 10);
  run(it);
  CHECK(maxdiff(first, interp_value(it, d), 64) > 0, "another seed, another mask", "same mask");
  // Decode mode (sampling) evaluates: every element kept, unscaled, as under ir_eval_mode's p = 0.
  interp_set_decode(it, 4);
  run(it);
  CHECK(maxdiff(xv, interp_value(it, d), 10000) == 0, "decode mode: dropout keeps everything", "a mask applied");
  interp_free(it);
}

static void test_adamw(void) {
  for (int variant = 0; variant < 2; variant++) { // 0: weight decay, two steps; 1: clipped, one step
    fresh();
    int p = param("p", SH(2)), gr = param("g", SH(2));
    int m = must(ir_leaf(g, OP_STATE, "p.m", DT_F32, SH(2), L0));
    int v = must(ir_leaf(g, OP_STATE, "p.v", DT_F32, SH(2), L0));
    int lr = must(ir_leaf(g, OP_SCALAR, "lr", DT_F32, (Shape){0}, L0));
    int step = must(ir_leaf(g, OP_SCALAR, "step", DT_F32, (Shape){0}, L0));
    int gn = NODE(OP_GRAD_NORM, NULL, NULL, gr);
    int up = variant == 0 ? NODE(OP_ADAMW, NULL, FA(0.9, 0.999, 1e-8, 0.01, 0), p, gr, m, v, gn, lr, step)
                          : NODE(OP_ADAMW, NULL, FA(0.9, 0.999, 1e-8, 0, 0.1), p, gr, m, v, gn, lr, step);
    Interp *it = interp_new(g, INTERP_F64);
    set(it, p, (double[]){1, -2});
    set(it, gr, (double[]){0.5, 0.1});
    char err[256] = "";
    CHECK(!interp_run(it, g->n, err, sizeof err) && strcmp(err, "scalar 'lr' was never set") == 0,
          variant ? "a scalar never set is an error" : "adamw needs its scalars", "message '%s'", err);
    interp_set_scalar(it, "lr", 0.1);
    interp_set_scalar(it, "step", 1);
    run(it);
    if (variant == 0) {
      EXPECT(it, gn, 1e-15, "grad_norm", sqrt(0.26));
      EXPECT(it, up, 1e-15, "adamw step 1", 0.899000002, -2.097999990000001);
      EXPECT(it, p, 1e-15, "adamw writes the param in place", 0.899000002, -2.097999990000001);
      EXPECT(it, m, 1e-15, "adamw first moment", 0.05, 0.01);
      EXPECT(it, v, 1e-18, "adamw second moment", 0.00025, 1e-5);
      set(it, gr, (double[]){-0.3, 0.2});
      interp_set_scalar(it, "step", 2);
      run(it);
      EXPECT(it, p, 1e-14, "adamw step 2 with weight decay", 0.8789511989397751, -2.1924201864887465);
      EXPECT(it, m, 1e-15, "adamw first moment, step 2", 0.015, 0.029);
      EXPECT(it, v, 1e-18, "adamw second moment, step 2", 0.00033975, 4.999e-05);
    } else {
      EXPECT(it, p, 1e-14, "adamw with clipping", 0.900000010198058, -2.0999999490097307);
      EXPECT(it, m, 1e-15, "adamw clipped moment", 0.009805787526177681, 0.0019611575052355364);
    }
    interp_free(it);
  }
  fresh();
  int a = param("a", SH(2)), b = param("b", SH(1, 1));
  int gn = NODE(OP_GRAD_NORM, NULL, NULL, a, b);
  Interp *it = interp_new(g, INTERP_F64);
  set(it, a, (double[]){3, 4});
  set(it, b, (double[]){12});
  run(it);
  EXPECT(it, gn, 0, "grad_norm over several tensors", 13);
  interp_free(it);
}

// Each optimizer rule over 10 steps of one parameter against its reference: torch.optim.SGD and
// torch.optim.AdamW, and Lion's published rule (Chen et al. 2023), as tests/torch/optim_ref.py
// computes them (its output pasted below, with the gradients it uses: g_t[i] = sin(1.3 t + 0.7 i)
// (1 + 0.1 i)). The SGD with Nesterov case runs at lr 0.1 with lr_scale 0.5, PyTorch's at 0.05.
static void test_optimizers(void) {
  static const double want[5][5] = {
      // made by tests/torch/optim_ref.py with torch 2.15.0+cu132
      // sgd(lr=0.1, momentum=0.9, weight_decay=0.01)
      {0.5849934791073663, -2.0205002036805, 0.7571554632358815, 0.5813224487727129, 3.5106365163003166},
      // sgd(lr=0.1, momentum=0.9, nesterov=true, weight_decay=0.01), lr_scale 0.5
      {0.7938051650711262, -2.0192428225799097, 0.5970613142555837, 0.25852847909635535, 3.228526335626645},
      // sgd(lr=0.1, weight_decay=0.1)
      {0.8832870488761533, -1.8462040284312393, 0.4150273994143923, -0.017338893828170103, 2.7279405343782708},
      // adamw(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
      {0.74637945535119, -2.103288457424043, 0.5318117406945461, 0.32029913228500584, 3.2551210414143363},
      // lion(lr=0.03, beta1=0.9, beta2=0.99, weight_decay=0.1)
      {0.9115594375806918, -1.881609245266674, 0.42564712943280564, 0.05812877901373374, 2.91094228639069},
  };
  static const char *const what[5] = {"sgd, momentum 0.9, weight decay", "sgd, Nesterov, lr_scale 0.5",
                                      "sgd without momentum, weight decay", "adamw", "lion, weight decay"};
  static const OptRule rule[5] = {OPT_SGD, OPT_SGD, OPT_SGD, OPT_ADAMW, OPT_LION};
  static const int moments[5] = {1, 1, 0, 2, 1};
  static const double fa[5][6] = {{0.9, 0, 0, 0.01, 0, 1}, {0.9, 1, 0, 0.01, 0, 0.5}, {0, 0, 0, 0.1, 0, 1},
                                  {0.9, 0.999, 1e-8, 0.01, 0, 1}, {0.9, 0.99, 0, 0.1, 0, 1}};
  static const double lr[5] = {0.1, 0.1, 0.1, 0.1, 0.03};
  for (int c = 0; c < 5; c++) {
    fresh();
    int p = param("p", SH(5)), gr = param("g", SH(5));
    int in[7] = {p, gr}, nin = 2;
    for (int k = 0; k < moments[c]; k++)
      in[nin++] = must(ir_leaf(g, OP_STATE, k ? "p.v" : "p.m", DT_F32, SH(5), L0));
    int lrn = must(ir_leaf(g, OP_SCALAR, "lr", DT_F32, (Shape){0}, L0));
    int step = must(ir_leaf(g, OP_SCALAR, "step", DT_F32, (Shape){0}, L0));
    in[nin++] = NODE(OP_GRAD_NORM, NULL, NULL, gr);
    in[nin++] = lrn;
    in[nin++] = step;
    int up = must(ir_add(g, OP_ADAMW, in, nin, IA(rule[c]), fa[c], L0));
    Interp *it = interp_new(g, INTERP_F64);
    set(it, p, (double[]){1, -2, 0.5, 0, 3});
    interp_set_scalar(it, "lr", lr[c]);
    for (int t = 1; t <= 10; t++) {
      double gt[5];
      for (int i = 0; i < 5; i++)
        gt[i] = sin(1.3 * t + 0.7 * i) * (1 + 0.1 * i);
      set(it, gr, gt);
      interp_set_scalar(it, "step", t);
      run(it);
    }
    char name[96];
    snprintf(name, sizeof name, "%s: 10 steps as the reference", what[c]);
    EXPECT(it, up, 1e-13, name, want[c][0], want[c][1], want[c][2], want[c][3], want[c][4]);
    interp_free(it);
  }
  // A rule with the wrong number of moments is refused by the IR.
  fresh();
  int p = param("p", SH(2)), gr = param("g", SH(2));
  int lrn = must(ir_leaf(g, OP_SCALAR, "lr", DT_F32, (Shape){0}, L0));
  int step = must(ir_leaf(g, OP_SCALAR, "step", DT_F32, (Shape){0}, L0));
  int gn = NODE(OP_GRAD_NORM, NULL, NULL, gr);
  CHECK(ir_add(g, OP_ADAMW, (int[]){p, gr, gn, lrn, step}, 5, IA(OPT_LION), FA(0.9, 0.99), L0) < 0 &&
            strstr(g->err, "lion takes"),
        "lion without its moment is refused", "err '%s'", g->err);
}

// Muon over 10 steps against Keller Jordan's muon_update and SingleDeviceMuon's step (float64, as
// tests/torch/optim_ref.py runs them; its output pasted below): a wide 3 x 5 and a tall 5 x 3 matrix
// (the iterations on the other side), Nesterov and not, with and without weight decay. The model's
// loss is sum(w * gw) + sum(v * gv), so the gradients are the inputs, set to g_t[i] = sin(1.3 t +
// 0.37 i^2) (1 + 0.1 i) each step (i the flat index; f32, as the reference rounds them) from p0[i] =
// 0.1 cos(0.9 i). The whole training graph runs: autodiff's Newton-Schulz steps (MATMULs) and the
// update.
static void test_muon(void) {
  static const double want[4][15] = {
      // made by tests/torch/optim_ref.py with torch 2.15.0+cu132
      // muon(lr=0.02, momentum=0.95, weight_decay=0.1), 3 x 5
      {0.07809124049670867, 0.047391029976215034, -0.015119444099105277, -0.07703825374963578,
       -0.12170885639106778, -0.006291360650233007, 0.05964235318342855, 0.07977152442084784, 0.04987292160451575,
       -0.044248227978554516, -0.11433466021560652, -0.09153395209375148, 0.005687338293168639,
       0.03321620539989423, 0.11149681106452203},
      // muon(lr=0.02, momentum=0.95, weight_decay=0.1), 5 x 3
      {0.08383958134540855, 0.04015354530531709, -0.007005252261151837, -0.07168381595006672, -0.10872331255788734,
       0.004937203313529916, 0.06646438486197512, 0.07457255949032052, 0.03126183140542792, -0.047642673327817985,
       -0.11287240974930222, -0.08162671204081119, 0.017780950181746646, 0.02869163387738941, 0.12179109158221375},
      // muon(lr=0.05, momentum=0.9, nesterov=false), 3 x 5
      {0.04135686456941377, -0.003514879854557722, 0.02149487400337843, -0.054706069396221454,
       -0.17287541459818231, 0.04156362175889938, -0.008549686327744273, 0.016986391569057575,
       -0.02655511791453434, -0.08723244604683136, -0.16475936155332066, -0.11741284532710666, 0.04604953119874234,
       -0.006979163962406334, 0.13949853223872874},
      // muon(lr=0.05, momentum=0.9, nesterov=false), 5 x 3
      {0.018926634046120286, 0.04435705545724779, 0.0554792703834586, -0.05829662690409873, -0.15280502232485899,
       0.05059716655179473, 0.03757793478153651, 0.006246680405244919, 0.007914157664272697, -0.052058297621056106,
       -0.208906660790536, -0.13596155535844326, 0.07710553756316443, -0.035561926240480546, 0.15655281351216968},
  };
  static const char *const opt[2] = {"muon(lr=0.02, weight_decay=0.1)", "muon(lr=0.05, momentum=0.9, nesterov=false)"};
  // u: a third matrix of w's shape, with gradients of its own, which Muon orthogonalises in one batch
  // with w (autodiff.c's muon_ortho); its values are checked against a model where it is alone.
  for (int c = 0; c < 2; c++) {
    double alone[15];
    for (int pass = 0; pass < 2; pass++) { // (pass 0: u alone; pass 1: w, v and u)
      char text[640];
      snprintf(text, sizeof text, "model mu\n%sinput gu: f32[3, 5]\n%sparam u: [3, 5] = zeros\n"
               "output loss = %ssum(u * gu)\ntrain {\n optimizer = %s\n}\n",
               pass ? "input gw: f32[3, 5]\ninput gv: f32[5, 3]\n" : "",
               pass ? "param w: [3, 5] = zeros\nparam v: [5, 3] = zeros\n" : "",
               pass ? "sum(w * gw) + sum(v * gv) + " : "", opt[c]);
      Arena *a = arena_new();
      Graph *mg = mdl_compile_text(a, "mu.mdl", text, NULL, 0);
      CHECK(mg && autodiff(mg, true), "muon: the model compiles", "%s", mg ? mg->err : "front end");
      if (!mg || !mg->updates) {
        arena_free(a);
        continue;
      }
      int np = mg->nparams, batched = 0;
      bool all = true;
      for (int k = 0; k < np; k++)
        all = all && mg->nodes[mg->params[k]]->init.muon;
      for (int i = 0; i < mg->n; i++)
        batched += mg->nodes[i]->op == OP_MATMUL && mg->nodes[i]->shape.rank == 3 && mg->nodes[i]->shape.d[0] == 2;
      if (pass) {
        CHECK(all, "muon: the matrices are hidden matrices (no embedding, no LM head)", "not all");
        CHECK(batched == 15, "muon: w and u (one shape) are orthogonalised in one batch: 15 batched products",
              "%d batched products", batched);
      }
      Interp *it = interp_new(mg, INTERP_F64);
      for (int k = 0; k < np; k++)
        for (int i = 0; i < 15; i++)
          interp_param(it, mg->params[k])[i] = k == np - 1 ? 0.1 * sin(0.5 * i) : 0.1 * cos(0.9 * i);
      interp_set_scalar(it, "lr", mg->train.lr);
      char err[256] = "";
      bool ok = true;
      for (int t = 1; t <= 10 && ok; t++) {
        float gt[15], gu[15];
        for (int i = 0; i < 15; i++) {
          gt[i] = (float)(sin(1.3 * t + 0.37 * i * i) * (1 + 0.1 * i));
          gu[i] = (float)(cos(0.7 * t + 0.11 * i) * (1 + 0.05 * i));
        }
        if (pass) {
          interp_set_input(it, "gw", NULL, gt, 15);
          interp_set_input(it, "gv", NULL, gt, 15);
        }
        interp_set_input(it, "gu", NULL, gu, 15);
        interp_set_scalar(it, "step", t);
        ok = interp_run(it, mg->n, err, sizeof err);
      }
      const double *uv = interp_param(it, mg->params[np - 1]);
      if (!pass) {
        memcpy(alone, uv, sizeof alone);
      } else {
        for (int k = 0; k < 2; k++) {
          double worst = 0;
          for (int i = 0; ok && i < 15; i++)
            worst = fmax(worst, fabs(interp_param(it, mg->params[k])[i] - want[2 * c + k][i]));
          char name[160];
          snprintf(name, sizeof name, "%s, %s: 10 steps as Keller Jordan's Muon within 1e-12 (worst %.1e)", opt[c],
                   k ? "5 x 3" : "3 x 5", worst);
          CHECK(ok && worst < 1e-12, name, "%s", ok ? "differs" : err);
        }
        double worst = 0;
        for (int i = 0; ok && i < 15; i++)
          worst = fmax(worst, fabs(uv[i] - alone[i]));
        char name[160];
        snprintf(name, sizeof name, "%s: a matrix batched with another trains as it does alone, within 1e-12 (worst %.1e)",
                 opt[c], worst);
        CHECK(ok && worst < 1e-12, name, "%s", ok ? "differs" : err);
      }
      interp_free(it);
      arena_free(a);
    }
  }
}

static void test_init(void) {
  fresh();
  int w = param("w", SH(100, 100)), o = param("o", SH(3)), z = param("z", SH(3));
  g->nodes[w]->init = (ParamInit){.kind = INIT_NORMAL, .std = 0.02, .decay = true};
  g->nodes[o]->init = (ParamInit){.kind = INIT_ONES};
  g->nodes[z]->init = (ParamInit){.kind = INIT_ZEROS};
  Interp *it = interp_new(g, INTERP_F32), *again = interp_new(g, INTERP_F32);
  set(it, z, (double[]){5, 5, 5});
  interp_init_params(it, 1);
  interp_init_params(again, 1);
  const double *wv = interp_param(it, w);
  double mean = 0, var = 0;
  for (int i = 0; i < 10000; i++)
    mean += wv[i] / 10000;
  for (int i = 0; i < 10000; i++)
    var += (wv[i] - mean) * (wv[i] - mean) / 10000;
  CHECK(fabs(mean) < 0.001 && fabs(sqrt(var) - 0.02) < 0.001, "normal init has the asked std",
        "mean %g std %g", mean, sqrt(var));
  double u1 = mdl_rng_uniform(1, 1000, 0), u2 = mdl_rng_uniform(1, 1000, 1);
  CHECK(wv[0] == (double)(float)(0.02 * sqrt(-2 * log(1 - u1)) * cos(2 * M_PI * u2)),
        "normal init is Box-Muller on the shared generator", "%.9g", wv[0]);
  CHECK(maxdiff(wv, interp_param(again, w), 10000) == 0, "init is deterministic", "runs differ");
  EXPECT(it, o, 0, "ones init", 1, 1, 1);
  EXPECT(it, z, 0, "zeros init", 0, 0, 0);
  interp_init_params(again, 2);
  CHECK(maxdiff(wv, interp_param(again, w), 10000) > 0, "another seed, other weights", "same weights");
  interp_free(it);
  interp_free(again);
}

// Central differences of L = sum(r * y) with respect to parameter x, against the backward node dx
// (computed with dy = r). Returns max |error| / max |dx|.
static double fd_error(Interp *it, int y, int r, int x, int dx) {
  run(it);
  int64_t nx = interp_numel(it, x), ny = interp_numel(it, y);
  double *an = malloc(sizeof(double) * (size_t)nx), *xv = interp_param(it, x), err = 0, scale = 1e-12;
  memcpy(an, interp_value(it, dx), sizeof(double) * (size_t)nx);
  for (int64_t i = 0; i < nx; i++) {
    double save = xv[i], h = 1e-5, lp = 0, lm = 0;
    xv[i] = save + h;
    run(it);
    for (int64_t j = 0; j < ny; j++)
      lp += interp_value(it, r)[j] * interp_value(it, y)[j];
    xv[i] = save - h;
    run(it);
    for (int64_t j = 0; j < ny; j++)
      lm += interp_value(it, r)[j] * interp_value(it, y)[j];
    xv[i] = save;
    err = fmax(err, fabs((lp - lm) / (2 * h) - an[i]));
    scale = fmax(scale, fabs(an[i]));
  }
  free(an);
  return err / scale;
}

#define FD_CHECK(it, y, r, x, dx, name)                                                            \
  do {                                                                                             \
    double e_ = fd_error(it, y, r, x, dx);                                                         \
    CHECK(e_ < 1e-7, name, "relative error %g", e_);                                               \
  } while (0)

static void test_backward_ops(void) {
  fresh();
  int x = param("x", SH(2, 5)), w = param("w", SH(5)), b = param("b", SH(5)), r = param("r", SH(2, 5));
  int ln = NODE(OP_LAYERNORM, NULL, FA(1e-5), x, w, b);
  int dx = NODE(OP_LAYERNORM_BWD, IA(0), FA(1e-5), x, w, r), dw = NODE(OP_LAYERNORM_BWD, IA(1), FA(1e-5), x, w, r);
  int db = NODE(OP_LAYERNORM_BWD, IA(2), FA(1e-5), x, w, r);
  int rms = NODE(OP_RMSNORM, NULL, FA(1e-5), x, w);
  int rdx = NODE(OP_RMSNORM_BWD, IA(0), FA(1e-5), x, w, r), rdw = NODE(OP_RMSNORM_BWD, IA(1), FA(1e-5), x, w, r);
  int sm = NODE(OP_SOFTMAX, NULL, NULL, x), sdx = NODE(OP_SOFTMAX_BWD, NULL, NULL, sm, r);
  int mx = NODE(OP_MAX, IA(1, 0), NULL, x), r1 = param("r1", SH(2));
  int mdx = NODE(OP_MAX_BWD, IA(1, 0), NULL, x, mx, r1);
  int ge = NODE(OP_GELU, NULL, NULL, x), gdx = NODE(OP_GELU_BWD, NULL, NULL, x, r);
  int si = NODE(OP_SILU, NULL, NULL, x), sidx = NODE(OP_SILU_BWD, NULL, NULL, x, r);
  int sl = NODE(OP_SLICE, IA(1, 1, 4), NULL, x), r3 = param("r3", SH(2, 3));
  int sldx = must(ir_slice_bwd(g, r3, SH(2, 5), 1, 1, 4, L0));
  Interp *it = interp_new(g, INTERP_F64);
  set_random(it, x, 1);
  set_random(it, w, 2);
  set_random(it, b, 3);
  set_random(it, r, 4);
  set_random(it, r1, 5);
  set_random(it, r3, 6);
  FD_CHECK(it, ln, r, x, dx, "layernorm_bwd dx");
  FD_CHECK(it, ln, r, w, dw, "layernorm_bwd dw");
  FD_CHECK(it, ln, r, b, db, "layernorm_bwd db");
  FD_CHECK(it, rms, r, x, rdx, "rmsnorm_bwd dx");
  FD_CHECK(it, rms, r, w, rdw, "rmsnorm_bwd dw");
  FD_CHECK(it, sm, r, x, sdx, "softmax_bwd");
  FD_CHECK(it, mx, r1, x, mdx, "max_bwd");
  FD_CHECK(it, ge, r, x, gdx, "gelu_bwd");
  FD_CHECK(it, si, r, x, sidx, "silu_bwd");
  FD_CHECK(it, sl, r3, x, sldx, "slice_bwd");
  interp_free(it);

  fresh();
  int l = param("logits", SH(4, 5)), rl = param("r", SH(4));
  int t = ids_input("targets", SH(4));
  int ce = NODE(OP_CROSS_ENTROPY, NULL, NULL, l, t), cdx = NODE(OP_CROSS_ENTROPY_BWD, NULL, NULL, l, t, rl);
  int tab = param("tab", SH(3, 2)), ids = ids_input("ids", SH(2, 2)), re = param("re", SH(2, 2, 2));
  int em = NODE(OP_EMBED, NULL, NULL, tab, ids), edx = must(ir_embed_bwd(g, ids, re, 3, L0));
  it = interp_new(g, INTERP_F64);
  set_random(it, l, 7);
  set_random(it, rl, 8);
  set_random(it, tab, 9);
  set_random(it, re, 10);
  interp_set_input(it, "targets", (int32_t[]){4, -1, 0, 2}, NULL, 4);
  interp_set_input(it, "ids", (int32_t[]){2, 0, 2, 2}, NULL, 4);
  FD_CHECK(it, ce, rl, l, cdx, "cross_entropy_bwd");
  FD_CHECK(it, em, re, tab, edx, "embed_bwd");
  interp_free(it);

  for (int has_doc = 0; has_doc < 2; has_doc++) {
    fresh();
    int q = param("q", SH(2, 4, 4)), k = param("k", SH(2, 4, 4)), v = param("v", SH(2, 4, 4));
    int ra = param("r", SH(2, 4, 4)), doc = ids_input("doc", SH(2, 4));
    int at, lse, d[3];
    if (has_doc) {
      at = NODE(OP_ATTENTION, IA(2, 1, 1), FA(0.7), q, k, v, doc);
      lse = NODE(OP_ATTENTION_LSE, IA(2, 1, 1), FA(0.7), q, k, v, doc);
      for (int wh = 0; wh < 3; wh++)
        d[wh] = NODE(OP_ATTENTION_BWD, IA(2, 1, 1, wh), FA(0.7), q, k, v, doc, at, lse, ra);
    } else {
      at = NODE(OP_ATTENTION, IA(2, 0, 0), FA(0.7), q, k, v);
      lse = NODE(OP_ATTENTION_LSE, IA(2, 0, 0), FA(0.7), q, k, v);
      for (int wh = 0; wh < 3; wh++)
        d[wh] = NODE(OP_ATTENTION_BWD, IA(2, 0, 0, wh), FA(0.7), q, k, v, at, lse, ra);
    }
    int pos = ids_input("pos", SH(2, 4));
    int ro = NODE(OP_ROPE, IA(2, 0), FA(100), q, pos), rodx = NODE(OP_ROPE, IA(2, 1), FA(100), ra, pos);
    it = interp_new(g, INTERP_F64);
    set_random(it, q, 11);
    set_random(it, k, 12);
    set_random(it, v, 13);
    set_random(it, ra, 14);
    interp_set_input(it, "doc", (int32_t[]){0, 0, 1, 1, 0, 1, 1, 1}, NULL, 8);
    interp_set_input(it, "pos", (int32_t[]){0, 1, 0, 1, 0, 0, 1, 2}, NULL, 8);
    FD_CHECK(it, at, ra, q, d[0], has_doc ? "attention_bwd dq (causal, doc)" : "attention_bwd dq (full)");
    FD_CHECK(it, at, ra, k, d[1], has_doc ? "attention_bwd dk (causal, doc)" : "attention_bwd dk (full)");
    FD_CHECK(it, at, ra, v, d[2], has_doc ? "attention_bwd dv (causal, doc)" : "attention_bwd dv (full)");
    if (has_doc)
      FD_CHECK(it, ro, ra, q, rodx, "inverse rope is the rope gradient");
    interp_free(it);
  }
}

int main(void) {
  test_elementwise();
  test_integers();
  test_broadcast_and_precision();
  test_matmul();
  test_reductions();
  test_layout();
  test_embed();
  test_rows();
  test_cross_entropy();
  test_target_count();
  test_attention();
  test_rope();
  test_dropout();
  test_adamw();
  test_optimizers();
  test_muon();
  test_init();
  test_backward_ops();
  arena_free(arena);
  TEST_EXIT();
}
