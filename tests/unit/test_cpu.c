// test_cpu.c: the compiled CPU back end (emit_c + cpu.c) against the reference interpreter
// (INTERP_F32) on gpt2-tiny, llama-tiny and the MLP (and the MLP with SGD, with and without
// momentum, with Lion and with Muon, with lr_scale and a frozen parameter), with fusion off and on. Both start from the same
// parameters and take the same batch (two documents per row, one ignored target), lr 2e-3; then:
//   - cpu_init_params gives exactly the interpreter's initial parameters;
//   - after one step the loss and every gradient agree per tensor within 1e-5 relative
//     (max |cpu - interp| / max |interp|);
//   - after 10 AdamW steps the parameters agree in the L2 sense, ||cpu - interp|| / ||interp||: within
//     5e-4 per tensor and 1e-4 over all of them. Not tighter, because AdamW's first steps are close to
//     lr * sign(g), which turns the rounding of near-zero gradients into whole updates: the GEMMs
//     here accumulate in fp32 (the interpreter in double), and the interpreter's own fp32 and fp64
//     runs already differ by up to 7e-5 on the zero-initialised attention biases of gpt2-tiny;
//   - a frozen parameter is bit for bit its initial value after the 10 steps;
//   - fusion on and off give the same loss and gradients within 1e-6 (the chunked LM head sums dW in
//     another order) and the same parameters after 10 steps, in the L2 measure above;
//   - a step gives bit-identical results with 1 and 2 threads (fixed-block reductions);
//   - emitting twice gives byte-identical text, which compiles without warnings;
//   - the module cache is hit for the same source and missed for a changed one; a source that does
//     not compile is reported;
//   - a target or a token id out of range ends the step with a message.
// With GEMM operands in bf16 (precision_assign) on the first three models, fusion off and on, the
// compiled step is compared with the interpreter on the same graph kernel by kernel and as a whole
// (test_bf16 says how and within what); CAST's rounding is checked bit by bit on chosen values; and a
// bf16 plan needs a smaller arena than the fp32 one. The interpreter's and the CPU back end's
// engines draw their initial parameters when first needed, never over ones written before
// (draw_checks.h).
#include "mdl.h"
#include "backend.h"
#include "emit_c.h"
#include "test.h"
#include "harness.h"
#include "draw_checks.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { STEPS = 10 };
static const double LR = 2e-3;
static bool matrix; // `test_cpu matrix` (test_matrix): the warnings check is the whole run's

// Every op family the models above leave out, forward and backward: the transcendental unary ops,
// division, reductions over inner and outer axes with and without keepdim (one long enough for
// blocked partial sums), max, softmax, permute and transpose, batched matmuls (one broadcasting its
// batch), concat and split, layernorm without bias, rmsnorm, rope, attention neither causal nor
// document-masked, dropout, and an untied LM head.
// q, k, v split from one qkv GEMM, with v also read as it is (f32): in bf16, attention reads q and k
// as slices of the GEMM output's one rounding, and v's rounding is a slice of it too.
static const char qkv_split[] =
    "model qkvsplit\n"
    "dim B = 2\n"
    "dim T = 24\n"
    "dim C = 32\n"
    "dim V = 256\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input doc: i32[B, T]\n"
    "param wte: [V, C] = normal(0.5)\n"
    "param wqkv: [C, 3*C] = normal(0.3)\n"
    "param head: [C, V] = normal(0.3)\n"
    "q, k, v = split(embed(wte, tokens) @ wqkv, 3, axis=-1)\n"
    "a = attention(q, k, v, heads=2, causal=true, doc=doc) + v\n"
    "output loss = mean(cross_entropy(a @ head, targets))\n";

static const char allops[] =
    "model allops\n"
    "dim B = 2\n"
    "dim T = 8\n"
    "dim C = 16\n"
    "dim V = 256\n"
    "input x: f32[B, T, C]\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input pos: i32[B, T]\n"
    "param w: [C, C] = normal(0.3)\n"
    "param b: [C] = zeros\n"
    "param g: [C] = ones\n"
    "param big: [64, 128] = normal(0.1)\n"
    "param tab: [V, C] = normal(0.5)\n"
    "param head: [C, V] = normal(0.3)\n"
    "e = embed(tab, tokens) + x\n"
    "a = tanh(e @ w + b)\n"
    "s = softmax(a * 2.0)\n"
    "m = max(a, axis=2, keepdim=true)\n"
    "u = exp(a - m) / sum(exp(a - m), axis=1, keepdim=true)\n"
    "p = permute(u, [0, 2, 1])\n"
    "bm = p @ transpose(p, 1, 2)\n"
    "wp = w @ p\n"
    "c1, c2 = split(concat([s, u], axis=-1), 2)\n"
    "r = rope(c1 * sqrt(g * g + 1.0), pos, heads=2)\n"
    "q = rmsnorm(r, g) + layernorm(c2, g)\n"
    "att = dropout(attention(q, silu(q), gelu(q), heads=2), p=0.25)\n"
    "h = relu(att) - neg(rsqrt(a * a + 1.0)) + log(a * a + 2.0)\n"
    "h = h + sigmoid(att) * abs(att - 0.1) + clamp(att, min=-0.2, max=0.3) + clamp(a, max=0.5) * stop_gradient(a)\n"
    "h = h + where(att > 0.05, att, 0.5 * att) + where(a <= -0.1, 1.0, a * a) * (a != 0.3) + (att >= a) * a\n"
    "h = h + 0.1 * log_softmax(att, axis=1) + softmax(a, axis=0)\n"
    "extra = mean(bm) + mean(wp * wp) + 0.001 * sum(reshape(big * big, [8192])) + mean(max(big, axis=0))\n"
    "output loss = mean(cross_entropy(h @ head, targets)) + extra\n";

// Routing for a mixture of experts (topk, gather, scatter_add): a token's top-2 of 4 experts, each
// expert's 6 tokens by priority (many ties at 0, broken by the lower index), their gather, batched
// expert matmuls and the combine's scatter-add onto the residual; then indices from the batch
// ("idx", -1 to 5 along an axis of 4: some out of range) read by a gather and a scatter-add.
static const char routing[] =
    "model routing\n"
    "dim N = 16\n"
    "dim C = 8\n"
    "dim E = 4\n"
    "input x: f32[N, C]\n"
    "input idx: i32[N, 3]\n"
    "param wr: [C, E] = normal(0.5)\n"
    "param w1: [E, C, C] = normal(0.3)\n"
    "param w2: [C, C] = normal(0.3)\n"
    "t = tanh(x @ w2)\n"
    "probs = softmax(t @ wr)\n"
    "gate, choice = topk(probs, 2)\n"
    "gates = scatter_add(probs * 0.0, choice, gate, axis=1)\n"
    "prio, slot = topk(transpose((gates > 0.0) * (1.0 + probs), 0, 1), 6)\n"
    "weight = gather(transpose(gates, 0, 1), slot, axis=1)\n"
    "tok = reshape(slot, [E * 6, 1])\n"
    "ye = tanh(reshape(gather(t, tok, axis=0), [E, 6, C]) @ w1) * reshape(weight, [E, 6, 1])\n"
    "y = scatter_add(t, tok, reshape(ye, [E * 6, C]), axis=0)\n"
    "o = gather(y[:, 0:4], idx, axis=1)\n"
    "s = scatter_add(y[:, 4:8], idx, o * o, axis=1)\n"
    "output loss = mean(s * s) + mean(y * y) + mean(prio)\n";
// The optimizers other than AdamW, on a small MLP, each with its settings: SGD with momentum and
// Nesterov, per-parameter lr_scale and a frozen bias; plain SGD with weight decay; Lion.
#define OPT_MLP                                                                                    \
  "dim B = 8\ndim N = 16\ndim H = 32\ndim K = 4\n"                                                   \
  "input x: f32[B, N]\ninput targets: i32[B]\n"                                                     \
  "param w1: [N, H] = normal(0.25)\nparam b1: [H] = zeros\nparam w2: [H, K] = normal(0.18)\n"        \
  "param b2: [K] = normal(0.1)\n"                                                                  \
  "h = relu(x @ w1 + b1)\noutput loss = mean(cross_entropy(h @ w2 + b2, targets))\n"
static const char opt_sgd[] = "model optsgd\n" OPT_MLP
                              "train {\n optimizer = sgd(lr=0.1, momentum=0.9, nesterov=true, weight_decay=0.01)\n"
                              " lr_scale = {\"w*\": 0.5, \"b1\": 3}\n freeze = [\"b2\"]\n clip = 1.0\n}\n";
static const char opt_plain[] = "model optplain\n" OPT_MLP
                                "train {\n optimizer = sgd(lr=0.1, weight_decay=0.1)\n}\n";
static const char opt_lion[] = "model optlion\n" OPT_MLP
                               "train {\n optimizer = lion(lr=3e-4, weight_decay=0.1)\n lr_scale = {\"b*\": 2}\n}\n";
// Muon: a wide and a tall hidden matrix (w1, w2), AdamW for the biases and the head (w3).
static const char opt_muon[] = "model optmuon\ndim B = 8\ndim N = 16\ndim H = 32\ndim K = 4\n"
                               "input x: f32[B, N]\ninput targets: i32[B]\n"
                               "param w1: [N, H] = normal(0.25)\nparam b1: [H] = zeros\nparam w2: [H, 24] = normal(0.18)\n"
                               "param w3: [24, K] = normal(0.2)\nparam b3: [K] = zeros\n"
                               "h = relu(relu(x @ w1 + b1) @ w2)\noutput loss = mean(cross_entropy(h @ w3 + b3, targets))\n"
                               "train {\n optimizer = muon(lr=0.02, weight_decay=0.01, adam_lr=1e-3)\n"
                               " lr_scale = {\"w2\": 0.5}\n clip = 1.0\n}\n";
// Elementwise min and max (broadcast, with a number) and the min and max reductions; integer
// arithmetic on i32 (both signs of // and %, a divisor of 0, products that wrap around), comparisons
// and where on integers, float() and int() (toward zero, both signs), an integer condition; conv1d
// causal and not, depthwise and full (with a bias); a repeat index in an init, a slice and causal=.
// The gradients of pk and pq are the integer values themselves (times 0.001): compared exactly.
static const char newops[] =
    "model newops\n"
    "dim B = 2\n"
    "dim T = 8\n"
    "dim C = 16\n"
    "dim V = 256\n"
    "input x: f32[B, T, C]\n"
    "input targets: i32[B, T]\n"
    "input tokens: i32[B, T]\n"
    "input pos: i32[B, T]\n"
    "param w: [C, C] = normal(0.3)\n"
    "param b: [C] = normal(0.1)\n"
    "param head: [C, V] = normal(0.3)\n"
    "param wd: [4, C] = normal(0.3)\n"
    "param wc: [3, C, C] = normal(0.2)\n"
    "param pk: [B, T] = normal(1)\n"
    "param pq: [B, T, C] = normal(1)\n"
    "a = tanh(x @ w + b)\n"
    "h = max(a, 0.1 * a) + min(a, b + 0.05) - max(a, axis=1, keepdim=true) + min(a, axis=2, keepdim=true)\n"
    "h = h + max(min(a, 0.3), -0.2) * min(x, b)\n"
    "k = (pos - 3) // 2 * 3 + (pos - 3) % -2 - pos % (pos - 1) + max(pos, 2) * min(-pos, -1) + abs(pos - 4) * -pos\n"
    "k = k + (tokens * 100000000) % 1000 + (-tokens) // (pos - 2) + where(pos >= 2, pos, 7)\n"
    "f = reshape(float(k) * 0.01 + (pos == 2) + (k < 1), [B, T, 1])\n"
    "h = h * (1.0 + 0.1 * f) + float(int(a * 3.0)) * a + where(reshape(pos % 2, [B, T, 1]), a, -a)\n"
    "h = h + conv1d(a, wd, causal=true) + conv1d(h, wc, b)\n"
    "repeat r[2] as i {\n  param wr: [C, C] = normal(0.1 * (i + 1))\n"
    "  h = h + conv1d(h, wr[0:i + 1, :], causal=i == 0)\n}\n"
    "ints = 0.001 * sum(float(k) * pk) + 0.001 * sum(float(int(a * 3.0)) * pq)\n"
    "output loss = mean(cross_entropy(h @ head, targets)) + ints\n";

// What one run produced: the loss and gradients of step 1, the parameters after the last step.
typedef struct {
  double loss;
  double **grad, **param, **init;
} Run;

static int64_t count(const Graph *g, int k) { return shape_numel(g->nodes[g->params[k]]->shape); }

static double *dup_d(const double *x, int64_t n) {
  double *d = malloc(sizeof *d * (size_t)(n ? n : 1));
  memcpy(d, x, sizeof *d * (size_t)n);
  return d;
}

static void run_free(const Graph *g, Run *r) {
  for (int k = 0; k < g->nparams; k++) {
    free(r->grad[k]);
    free(r->param[k]);
    if (r->init)
      free(r->init[k]);
  }
  free(r->grad);
  free(r->param);
  free(r->init);
}

// Per-tensor L2 relative error: ||a - b|| / ||b||.
static double l2_err(const double *a, const double *b, int64_t n) {
  double d = 0, m = 1e-300;
  for (int64_t i = 0; i < n; i++) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    m += b[i] * b[i];
  }
  return sqrt(d / m);
}

// The L2 relative error over all the parameters together.
static double l2_all(const Graph *g, double **a, double **b) {
  double d = 0, m = 1e-300;
  for (int k = 0; k < g->nparams; k++)
    for (int64_t i = 0; i < count(g, k); i++) {
      d += (a[k][i] - b[k][i]) * (a[k][i] - b[k][i]);
      m += b[k][i] * b[k][i];
    }
  return sqrt(d / m);
}

// The worst per-tensor error (by `err`) over the gradients or parameters of two runs; *which names it.
static double worst(const Graph *g, double **a, double **b, double (*err)(const double *, const double *, int64_t),
                    const char **which) {
  double w = 0;
  for (int k = 0; k < g->nparams; k++) {
    if (!a[k] || !b[k]) // (a frozen parameter's gradient)
      continue;
    double e = err(a[k], b[k], count(g, k));
    if (e > w || isnan(e)) {
      w = isnan(e) ? INFINITY : e;
      *which = g->nodes[g->params[k]]->name;
    }
  }
  return w;
}

// The batch of input node nd: token patterns, two documents per row (positions restart at the
// boundary), one ignored target; f32 inputs are a smooth pattern.
static void batch(const IrNode *nd, int32_t *ids, float *f) {
  int64_t n = shape_numel(nd->shape), cols = nd->shape.d[nd->shape.rank - 1];
  for (int64_t j = 0; j < n; j++) {
    int64_t t = j % cols, split = cols / 2 - 1;
    ids[j] = 0;
    if (!strcmp(nd->name, "tokens"))
      ids[j] = (int32_t)((j * 37 + 11) % 256);
    else if (!strcmp(nd->name, "targets"))
      ids[j] = j == 3 ? -1 : (int32_t)((j * 53 + 7) % (nd->shape.rank == 1 ? 4 : 256));
    else if (!strcmp(nd->name, "idx")) // -1 to 5: some outside an axis of 4
      ids[j] = (int32_t)((j * 5) % 7) - 1;
    else if (!strcmp(nd->name, "pos"))
      ids[j] = (int32_t)(t < split ? t : t - split);
    else if (!strcmp(nd->name, "doc"))
      ids[j] = t < split ? 0 : 1;
    f[j] = (float)sin(0.7 * (double)j + 0.3);
  }
}

// `steps` interpreter steps from the initial parameters (seed 7): the loss and gradients of step 1,
// the parameters after the last. With keep, *keep is the interpreter, its values those of the last
// step (the caller frees it).
static bool interp_reference(const Graph *g, int steps, Run *ref, Interp **keep) {
  Interp *it = interp_new(g, INTERP_F32);
  interp_init_params(it, 7);
  interp_set_seed(it, 7);
  set_inputs_by(g, batch, it, NULL, NULL);
  ref->grad = calloc((size_t)g->nparams, sizeof *ref->grad);
  ref->param = calloc((size_t)g->nparams, sizeof *ref->param);
  ref->init = calloc((size_t)g->nparams, sizeof *ref->init);
  for (int k = 0; k < g->nparams; k++)
    ref->init[k] = dup_d(interp_param(it, g->params[k]), count(g, k));
  char err[256];
  for (int s = 1; s <= steps; s++) {
    interp_set_scalar(it, "lr", LR);
    interp_set_scalar(it, "step", s);
    if (!interp_run(it, g->n, err, sizeof err)) {
      printf("[fail] interp: %s\n", err);
      interp_free(it);
      return false;
    }
    if (s == 1) {
      ref->loss = interp_value(it, g->loss)[0];
      for (int k = 0; k < g->nparams; k++)
        ref->grad[k] = g->grads[k] < 0 ? NULL : dup_d(interp_value(it, g->grads[k]), count(g, k));
    }
  }
  for (int k = 0; k < g->nparams; k++)
    ref->param[k] = dup_d(interp_param(it, g->params[k]), count(g, k));
  if (keep)
    *keep = it;
  else
    interp_free(it);
  return true;
}

// `steps` compiled steps from the initial parameters (seed 7) with `threads` threads.
static bool cpu_run(const Graph *g, const MemPlan *m, CpuModule *cm, int threads, int steps, Run *out) {
  char *arena = cpu_arena_new(m);
  cpu_init_params(g, m, arena, 7);
  set_inputs_by(g, batch, NULL, m, arena);
  cpu_set_threads(cm, threads);
  cm->hooks.seed = 7;
  out->grad = calloc((size_t)g->nparams, sizeof *out->grad);
  out->param = calloc((size_t)g->nparams, sizeof *out->param);
  out->init = NULL;
  bool ok = true;
  for (int s = 1; s <= steps && ok; s++) {
    cpu_set_scalar(g, m, arena, "lr", LR);
    cpu_set_scalar(g, m, arena, "step", s);
    ok = cpu_step(cm, arena);
    if (!ok)
      printf("[fail] cpu_step: %s\n", cm->error);
    if (s == 1) {
      out->loss = *(float *)cpu_value(m, arena, g->loss);
      for (int k = 0; k < g->nparams; k++)
        out->grad[k] = g->grads[k] < 0 ? NULL : from_float(cpu_value(m, arena, g->grads[k]), count(g, k));
    }
  }
  for (int k = 0; k < g->nparams; k++)
    out->param[k] = from_float(cpu_value(m, arena, g->params[k]), count(g, k));
  cpu_arena_free(m, arena);
  return ok;
}

// The emitted file compiles without a warning, whole and each of its parts (prelude.h: MDL_PART; the
// runtime compiles the parts); else the compiler's first message is in why.
static bool emitted_compiles_clean(const char *src, char *why, size_t n) {
  const char *np = strstr(src, "\n#define MDL_NPARTS ");
  int parts = np ? atoi(np + strlen("\n#define MDL_NPARTS ")) : 0;
  bool ok = true;
  for (int p = -1; p < parts && ok; p++) { // p -1: whole
    char def[32] = "", cc[160];
    if (p >= 0)
      snprintf(def, sizeof def, "-DMDL_PART=%d ", p);
    snprintf(cc, sizeof cc, "cc -std=c11 -fopenmp -fsyntax-only -Wall -Wextra -Werror %s%%s", def);
    ok = compiles_clean(cc, src, why, n);
  }
  return ok;
}

static void test_model(const Model *md) {
  Arena *a = arena_new();
  Graph *g = compile_model(a, md);
  char name[160];
  snprintf(name, sizeof name, "cpu %s: compiles", md->path);
  CHECK(g && autodiff(g, true), name, "front end or autodiff failed");
  if (!g) {
    arena_free(a);
    return;
  }
  // A frozen parameter has no gradient node, no update and no place in the gradient norm.
  for (int k = 0; k < g->nparams; k++) {
    if (!g->nodes[g->params[k]]->init.frozen)
      continue;
    bool none = g->grads[k] < 0 && g->updates[k] < 0;
    for (int i = 0; i < g->n; i++)
      none &= g->nodes[i]->grad_of != g->params[k] && g->nodes[i]->param_of != g->params[k] &&
              !(g->nodes[i]->op == OP_GRAD_NORM && g->nodes[i]->nin != g->nparams - 1);
    snprintf(name, sizeof name, "cpu %s: frozen %s has no gradient, no update, no moment and no place in the norm",
             md->path, g->nodes[g->params[k]]->name);
    CHECK(none, name, "it has");
  }
  Run ref = {0}, got[2];
  memset(got, 0, sizeof got);
  bool have_ref = interp_reference(g, STEPS, &ref, NULL);
  for (int fz = 0; fz < 2 && have_ref; fz++) {
    const char *mode = fz ? "fused" : "unfused";
    Fusion *f = fuse(g, (FuseOptions){.fuse = fz, .chunk_lmhead = fz});
    MemPlan *m = memplan(f);
    char *src = emit_c(f, m, md->path), *again = emit_c(f, m, md->path);
    snprintf(name, sizeof name, "cpu %s %s: emits the same text twice", md->path, mode);
    CHECK(src && again && !strcmp(src, again), name, "emit_c %s", src ? "differs between runs" : "failed");
    if (!src)
      continue;
    snprintf(name, sizeof name, "cpu %s %s: the emitted C compiles with -Wall -Wextra -Werror", md->path, mode);
    char err[256];
    if (!matrix)
      CHECK(emitted_compiles_clean(src, err, sizeof err), name, "%s", err);
    CpuModule *cm = cpu_load(src, err, sizeof err);
    snprintf(name, sizeof name, "cpu %s %s: module loads (%d kernels)", md->path, mode, cm ? cm->nkernels : 0);
    CHECK(cm != NULL, name, "%s", err);
    if (!cm)
      continue;

    char *arena = cpu_arena_new(m);
    cpu_init_params(g, m, arena, 7);
    double init = 0;
    for (int k = 0; k < g->nparams; k++) {
      double *p = from_float(cpu_value(m, arena, g->params[k]), count(g, k));
      init = fmax(init, rel_err(p, ref.init[k], count(g, k)));
      free(p);
    }
    cpu_arena_free(m, arena);
    snprintf(name, sizeof name, "cpu %s %s: cpu_init_params matches interp_init_params", md->path, mode);
    CHECK(init == 0, name, "relative difference %g", init);

    bool ok = cpu_run(g, m, cm, 2, STEPS, &got[fz]);
    snprintf(name, sizeof name, "cpu %s %s: %d steps run", md->path, mode, STEPS);
    CHECK(ok, name, "a kernel reported an error");
    const char *which = "?";
    double el = fabs(got[fz].loss - ref.loss) / fabs(ref.loss), eg = worst(g, got[fz].grad, ref.grad, rel_err, &which);
    snprintf(name, sizeof name, "cpu %s %s: loss matches the interpreter (%.6f)", md->path, mode, ref.loss);
    CHECK(el < 1e-5, name, "loss %.8f vs %.8f", got[fz].loss, ref.loss);
    snprintf(name, sizeof name, "cpu %s %s: every gradient within 1e-5 relative (worst %.1e)", md->path, mode, eg);
    CHECK(eg < 1e-5, name, "%s: %.3g", which, eg);
    double ep = worst(g, got[fz].param, ref.param, l2_err, &which), ea = l2_all(g, got[fz].param, ref.param);
    snprintf(name, sizeof name, "cpu %s %s: parameters after %d steps within 5e-4 per tensor, 1e-4 overall (L2: "
             "worst %.1e, overall %.1e)", md->path, mode, STEPS, ep, ea);
    CHECK(ep < 5e-4 && ea < 1e-4, name, "%s: %.3g, overall %.3g", which, ep, ea);
    if (g->train.optimizer != OPT_ADAMW && g->train.optimizer != OPT_MUON) { // (no sign-like first steps)
      snprintf(name, sizeof name, "cpu %s %s: %s's parameters after %d steps within 1e-5 per tensor (L2: worst %.1e)",
               md->path, mode, opt_rule_name(g->train.optimizer), STEPS, ep);
      CHECK(ep < 1e-5, name, "%s: %.3g", which, ep);
    }
    for (int k = 0; k < g->nparams; k++) {
      if (g->grads[k] >= 0)
        continue;
      bool same = !memcmp(got[fz].param[k], ref.init[k], sizeof(double) * (size_t)count(g, k)) &&
                  !memcmp(ref.param[k], ref.init[k], sizeof(double) * (size_t)count(g, k));
      snprintf(name, sizeof name, "cpu %s %s: frozen %s is bit for bit its initial value after %d steps", md->path,
               mode, g->nodes[g->params[k]]->name, STEPS);
      CHECK(same, name, "it changed");
    }

    if (fz) {
      Run t1 = {0}, t2 = {0};
      cpu_run(g, m, cm, 1, 2, &t1);
      cpu_run(g, m, cm, 2, 2, &t2);
      bool same = t1.loss == t2.loss;
      for (int k = 0; k < g->nparams; k++)
        same &= (!t1.grad[k] || !memcmp(t1.grad[k], t2.grad[k], sizeof(double) * (size_t)count(g, k))) &&
                !memcmp(t1.param[k], t2.param[k], sizeof(double) * (size_t)count(g, k));
      snprintf(name, sizeof name, "cpu %s: 1 and 2 threads give bit-identical steps", md->path);
      CHECK(same, name, "results differ");
      run_free(g, &t1);
      run_free(g, &t2);
    }
    cpu_unload(cm);
  }
  if (have_ref && got[0].grad && got[1].grad) {
    const char *wg = "?", *wp = "?";
    double eg = worst(g, got[1].grad, got[0].grad, rel_err, &wg);
    double ep = worst(g, got[1].param, got[0].param, l2_err, &wp);
    double ea = l2_all(g, got[1].param, got[0].param);
    double el = fabs(got[1].loss - got[0].loss) / fabs(got[0].loss);
    snprintf(name, sizeof name, "cpu %s: fusion on and off agree (loss, gradients within 1e-6: worst %.1e)",
             md->path, eg);
    CHECK(el < 1e-6 && eg < 1e-6, name, "loss %.3g, %s %.3g", el, wg, eg);
    snprintf(name, sizeof name, "cpu %s: fusion on and off agree on parameters after %d steps (L2: worst %.1e, "
             "overall %.1e)", md->path, STEPS, ep, ea);
    CHECK(ep < 5e-4 && ea < 1e-4, name, "%s: %.3g, overall %.3g", wp, ep, ea);
  }
  for (int fz = 0; fz < 2; fz++)
    if (got[fz].grad)
      run_free(g, &got[fz]);
  if (have_ref)
    run_free(g, &ref);
  arena_free(a);
}

// A training graph of md (NULL after a failed check): with GEMM operands in bf16 when bf16 is set.
static Graph *checked_training_graph(Arena *a, const Model *md, bool bf16) {
  char why[256], name[200];
  Graph *g = training_graph(a, md, bf16 ? DT_BF16 : DT_F32, why, sizeof why);
  bool ok = g != NULL;
  snprintf(name, sizeof name, "cpu bf16 %s: the %s training graph builds", md->path, bf16 ? "bf16" : "fp32");
  CHECK(ok, name, "%s", why);
  return ok ? g : NULL;
}

static uint16_t bf16_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (uint16_t)(u >> 16);
}

// How kernel outputs compare with the interpreter's values: the worst f32 output (max |cpu - interp|
// / max |interp| per tensor; a NaN counts as infinite), bf16 elements that differ (all of them one
// bf16 ulp apart when ulp1), i32 elements that differ, and the first kernel that reported an error.
typedef struct {
  double f32;
  int f32_node, failed;
  int64_t bf16_diff, bf16_total, i32_diff;
  bool ulp1;
} Forced;

// An arena ready for step 1: the initial parameters (seed 7), the batch, lr and step; 2 threads.
static char *first_step_arena(const Graph *g, const MemPlan *m, CpuModule *cm) {
  char *arena = cpu_arena_new(m);
  cpu_init_params(g, m, arena, 7);
  set_inputs_by(g, batch, NULL, m, arena);
  cpu_set_threads(cm, 2);
  cm->hooks.seed = 7;
  cpu_set_scalar(g, m, arena, "lr", LR);
  cpu_set_scalar(g, m, arena, "step", 1);
  return arena;
}

// Runs the module's kernels one by one, each on the interpreter's values of the materialised nodes
// it reads (written into the arena first; parameters, moments and inputs are already equal), and
// compares what it writes with the interpreter's values: so every kernel is checked alone, without
// the differences of the kernels before it.
static Forced kernels_forced(const Graph *g, const Fusion *f, const MemPlan *m, CpuModule *cm, Interp *it) {
  Forced r = {.f32_node = -1, .failed = -1, .ulp1 = true};
  char *arena = first_step_arena(g, m, cm);
  for (int k = 0; k < cm->nkernels && k < f->nsteps; k++) {
    const Step *st = &f->steps[k];
    for (int i = 0; i < st->nins; i++) {
      // A view's values are its base's (a strided SLICE view is not laid out as its own tensor).
      int id = st->ins[i];
      while (f->step_of[id] < 0 && f->materialised[id] && g->nodes[id]->op != OP_INPUT &&
             g->nodes[id]->op != OP_PARAM && g->nodes[id]->op != OP_STATE && g->nodes[id]->op != OP_SCALAR)
        id = g->nodes[id]->in[0];
      const IrNode *nd = g->nodes[id];
      bool leaf = nd->op == OP_INPUT || nd->op == OP_PARAM || nd->op == OP_STATE || nd->op == OP_SCALAR;
      if (leaf || m->offset[nd->id] < 0)
        continue;
      const double *v = interp_value(it, nd->id);
      void *dst = cpu_value(m, arena, nd->id);
      for (int64_t j = 0; j < shape_numel(nd->shape); j++)
        if (nd->dtype == DT_BF16)
          ((uint16_t *)dst)[j] = bf16_bits((float)v[j]);
        else if (nd->dtype == DT_I32)
          ((int32_t *)dst)[j] = (int32_t)v[j];
        else
          ((float *)dst)[j] = (float)v[j];
    }
    if (!cpu_run_kernel(cm, k, arena) && r.failed < 0)
      r.failed = k;
    for (int o = 0; o < st->nouts; o++) {
      const IrNode *nd = g->nodes[st->outs[o]];
      if (m->offset[nd->id] < 0)
        continue;
      const double *v = interp_value(it, nd->id);
      const void *x = cpu_value(m, arena, nd->id);
      int64_t n = shape_numel(nd->shape);
      double d = 0, mx = 1e-30, bmx = 0;
      for (int64_t j = 0; j < n && nd->dtype == DT_BF16; j++)
        bmx = fmax(bmx, fabs(v[j]));
      for (int64_t j = 0; j < n; j++)
        if (nd->dtype == DT_BF16) {
          // A value near 0 after cancellation (|error| within 1e-5 of the tensor's largest) may be
          // several ulps off: f32 and double sums differ there by more than the value's own ulp.
          uint16_t got = ((const uint16_t *)x)[j];
          int diff = (int)got - (int)bf16_bits((float)v[j]);
          r.bf16_diff += diff != 0;
          r.ulp1 &= (abs(diff) <= 1 || fabs(bf16_value(got) - v[j]) <= 1e-5 * bmx) &&
                    bf16_value(bf16_bits((float)v[j])) == (float)v[j];
        } else if (nd->dtype == DT_I32) {
          r.i32_diff += ((const int32_t *)x)[j] != (int32_t)v[j];
        } else {
          double e = fabs(((const float *)x)[j] - v[j]);
          d = isnan(e) ? INFINITY : fmax(d, e);
          mx = fmax(mx, fabs(v[j]));
        }
      r.bf16_total += nd->dtype == DT_BF16 ? n : 0;
      if (d / mx > r.f32) {
        r.f32 = d / mx;
        r.f32_node = nd->id;
      }
    }
  }
  cpu_arena_free(m, arena);
  return r;
}

// GEMMs on bf16 operands (the precision pass), fusion off and on; the interpreter runs the same graph
// and rounds at every CAST. The compiled step can differ from it only where an f32 value lies within
// its last bits of a bf16 rounding midpoint (the GEMMs and attention sum in other orders): there the
// rounding goes the other way, one bf16 ulp (2^-8 relative), and that difference spreads through the
// layers after it. So:
//   - each kernel run alone on the interpreter's values of its inputs (kernels_forced) writes its
//     f32 outputs within 2e-4 relative (per tensor, max norm: attention's backward rounds its
//     probabilities to bf16 inside the kernel, and where exp's last f32 bit decides a rounding, dV
//     moves by one term's bf16 ulp; attnkv at T 160: 4.7e-5 with FMA contraction, 1.1e-4 built for
//     x86-64-v2, which has no FMA, on every GEMM path alike) and its bf16 outputs within one bf16
//     ulp (or, for a value near 0 left by cancellation, within 1e-5 of the tensor's largest), on at
//     most 1 element in 1000;
//   - the whole step: the loss within 1e-4 relative; the gradients within 1.5e-3 in the L2 measure
//     over all of them (gpt2-tiny: 7e-4, llama-tiny: 1e-4, mlp: 5e-9) and 5e-3 per tensor (gpt2-tiny:
//     2e-3); the parameters after the AdamW step within 3e-3 over all (AdamW's first step is about
//     lr * sign(g), so a gradient near 0 whose sign differs moves its parameter by 2 lr; gpt2-tiny:
//     1e-3);
//   - the gradients differ from those of the fp32 graph by more than 2.5e-3 over all (all three
//     models: 3e-3 to 4e-3), so the rounding does happen.
// The second step reads the bf16 copies of the weights that the first step's optimizer wrote (fuse.c,
// rule 11): after step 1 every copy is the new parameter rounded, bit for bit, and step 2's loss is
// the interpreter's loss from the parameters (and moments) after step 1, within 1e-4, when it moved
// by over 10x that from step 1's (so stale copies would show).
static void second_step(const Model *md, const Graph *g, const Fusion *f, const MemPlan *m, CpuModule *cm) {
  char name[256], err[256];
  char *arena = first_step_arena(g, m, cm);
  bool ok = cpu_step(cm, arena);
  double loss1 = *(float *)cpu_value(m, arena, g->loss);
  int64_t differ = 0, total = 0;
  for (int k = 0; k < g->nparams; k++) {
    int c = f->copy_of[g->params[k]];
    if (c < 0)
      continue;
    const float *p = cpu_value(m, arena, g->params[k]);
    const uint16_t *got = cpu_value(m, arena, c);
    for (int64_t i = 0; i < count(g, k); i++)
      differ += got[i] != bf16_bits((float)round_bf16(p[i]));
    total += count(g, k);
  }
  snprintf(name, sizeof name, "cpu bf16 %s: after a step the %d copies hold the new weights rounded (%lld values)",
           md->path, f->ncopies, (long long)total);
  CHECK(ok && f->ncopies > 0 && differ == 0, name, "%lld differ", (long long)differ);
  Interp *it = interp_new(g, INTERP_F32);
  interp_set_seed(it, 7);
  set_inputs_by(g, batch, it, NULL, NULL);
  cpu_params_to_interp(g, m, arena, it);
  interp_set_scalar(it, "lr", LR);
  interp_set_scalar(it, "step", 2);
  cpu_set_scalar(g, m, arena, "step", 2);
  ok = ok && interp_run(it, g->n, err, sizeof err) && cpu_step(cm, arena);
  double loss2 = *(float *)cpu_value(m, arena, g->loss), ref = ok ? interp_value(it, g->loss)[0] : NAN;
  snprintf(name, sizeof name, "cpu bf16 %s: step 2 reads the copies step 1 wrote (loss %.6f, step 1 %.6f)", md->path,
           ref, loss1);
  CHECK(ok && fabs(loss2 - ref) < 1e-4 * fabs(ref) && fabs(loss1 - ref) > 1e-3 * fabs(ref), name,
        "loss %.8f vs the interpreter's %.8f; step 1 %.8f", loss2, ref, loss1);
  interp_free(it);
  cpu_arena_free(m, arena);
}

static void test_bf16(const Model *md) {
  Arena *a = arena_new();
  Graph *g16 = checked_training_graph(a, md, true), *g32 = checked_training_graph(a, md, false);
  Run ref = {0}, r32 = {0};
  Interp *it = NULL;
  bool have = g16 && g32 && interp_reference(g16, 1, &ref, &it) && interp_reference(g32, 1, &r32, NULL);
  for (int fz = 0; fz < 2 && have; fz++) {
    const char *mode = fz ? "fused" : "unfused";
    char name[256], err[256];
    Fusion *f = fuse(g16, (FuseOptions){.fuse = fz, .chunk_lmhead = fz});
    MemPlan *m = memplan(f);
    char *src = emit_c(f, m, md->path);
    snprintf(name, sizeof name, "cpu bf16 %s %s: the emitted C compiles with -Wall -Wextra -Werror", md->path, mode);
    if (!matrix)
      CHECK(src && emitted_compiles_clean(src, err, sizeof err), name, "%s", src ? err : "emit_c failed");
    CpuModule *cm = src ? cpu_load(src, err, sizeof err) : NULL;
    snprintf(name, sizeof name, "cpu bf16 %s %s: module loads (%d kernels)", md->path, mode, cm ? cm->nkernels : 0);
    CHECK(cm != NULL, name, "%s", src ? err : "emit_c failed");
    if (!cm)
      continue;

    Forced kf = kernels_forced(g16, f, m, cm, it);
    snprintf(name, sizeof name, "cpu bf16 %s %s: every kernel on the interpreter's inputs writes its f32 outputs "
             "within 2e-4 (worst %.1e)", md->path, mode, kf.f32);
    CHECK(kf.failed < 0 && kf.f32 < 2e-4 && kf.i32_diff == 0, name, "node %d: %.3g; %lld i32 values differ; "
          "kernel %d reported an error", kf.f32_node, kf.f32, (long long)kf.i32_diff, kf.failed);
    snprintf(name, sizeof name, "cpu bf16 %s %s: ... and its bf16 outputs within one ulp, %lld of %lld values "
             "differ", md->path, mode, (long long)kf.bf16_diff, (long long)kf.bf16_total);
    CHECK(kf.bf16_total > 0 && kf.ulp1 && kf.bf16_diff * 1000 <= kf.bf16_total, name, "%s",
          kf.ulp1 ? "too many" : "some by more than one ulp");

    Run got = {0};
    bool ok = cpu_run(g16, m, cm, 2, 1, &got);
    snprintf(name, sizeof name, "cpu bf16 %s %s: a step runs", md->path, mode);
    CHECK(ok, name, "a kernel reported an error");
    const char *which = "?";
    double el = fabs(got.loss - ref.loss) / fabs(ref.loss);
    snprintf(name, sizeof name, "cpu bf16 %s %s: loss matches the interpreter (%.6f)", md->path, mode, ref.loss);
    CHECK(el < 1e-4, name, "loss %.8f vs %.8f", got.loss, ref.loss);
    double eg = l2_all(g16, got.grad, ref.grad), wg = worst(g16, got.grad, ref.grad, l2_err, &which);
    snprintf(name, sizeof name, "cpu bf16 %s %s: gradients within 1.5e-3 overall, 5e-3 per tensor (L2: overall "
             "%.1e, worst %.1e)", md->path, mode, eg, wg);
    CHECK(eg < 1.5e-3 && wg < 5e-3, name, "overall %.3g, %s %.3g", eg, which, wg);
    double ep = l2_all(g16, got.param, ref.param);
    snprintf(name, sizeof name, "cpu bf16 %s %s: parameters after the AdamW step within 3e-3 overall (L2: %.1e)",
             md->path, mode, ep);
    CHECK(ep < 3e-3, name, "%.3g", ep);
    double apart = l2_all(g16, got.grad, r32.grad);
    // (5x: where a value lands within an f32 rounding of a bf16 tie, the order of a GEMM's f32 sums,
    // which differs between libraries, flips its rounding, and the flips spread: on gpt2-tiny the L2
    // distance to the interpreter was 2.1e-4 with OpenBLAS's sgemm, 4.1e-4 with oneDNN's bf16 GEMM)
    snprintf(name, sizeof name, "cpu bf16 %s %s: gradients differ from the fp32 graph's by over 1e-3 and 5x more "
             "than from the bf16 graph's (L2: %.1e vs %.1e)", md->path, mode, apart, eg);
    CHECK(apart > 1e-3 && apart > 5 * eg, name, "%.3g vs %.3g: is anything rounded?", apart, eg);
    if (fz && cm->hooks.bgemm) { // the f32 GEMMs of widened operands, as where the library has no bf16 GEMM
      Run wide = {0};
      cm->hooks.bgemm = NULL;
      ok = cpu_run(g16, m, cm, 2, 1, &wide);
      double ew = l2_all(g16, wide.grad, ref.grad);
      snprintf(name, sizeof name, "cpu bf16 %s %s: without a bf16 GEMM in the library, gradients within 1.5e-3 "
               "overall (L2: %.1e)", md->path, mode, ew);
      CHECK(ok && ew < 1.5e-3 && fabs(wide.loss - ref.loss) < 1e-4 * fabs(ref.loss), name, "%.3g, loss %.8f vs %.8f",
            ew, wide.loss, ref.loss);
      run_free(g16, &wide);
    }
    if (fz)
      second_step(md, g16, f, m, cm);
    run_free(g16, &got);
    cpu_unload(cm);
  }
  if (it)
    interp_free(it);
  if (ref.grad)
    run_free(g16, &ref);
  if (r32.grad)
    run_free(g32, &r32);
  arena_free(a);
}

// The compiled CAST to bf16 on values chosen by hand, unfused (so the CAST of x is in memory): round
// to nearest, ties to even (also below the normal range), overflow to infinity, signs kept, a NaN
// quiet NaN; and the same as the interpreter's round_bf16 wherever that is a number.
static void test_bf16_rounding(void) {
  static const char src[] = "model castbits\n"
                            "input x: f32[2, 8]\n"
                            "input targets: i32[2]\n"
                            "param w: [8, 4] = normal(0.1)\n"
                            "output loss = mean(cross_entropy(x @ w, targets))\n";
  static const uint32_t in[16] = {0x3f800000, 0x3f808000, 0x3f818000, 0x3f808001, 0x3f807fff, 0x80000000,
                                  0x7f7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xbf818000,
                                  0x00000001, 0x00008000, 0x00018000, 0x7f7f8000};
  static const uint16_t want[16] = {0x3f80, 0x3f80, 0x3f82, 0x3f81, 0x3f80, 0x8000, 0x7f80, 0x7f80,
                                    0xff80, 0x7fc0, 0x7fc0, 0xbf82, 0x0000, 0x0000, 0x0002, 0x7f80};
  Arena *a = arena_new();
  Model md = {"castbits.mdl", {{NULL, 0}}, 0, src};
  Graph *g = checked_training_graph(a, &md, true);
  int x = -1, cast = -1;
  for (int i = 0; g && i < g->n; i++) {
    x = g->nodes[i]->op == OP_INPUT && !strcmp(g->nodes[i]->name, "x") ? i : x;
    cast = g->nodes[i]->op == OP_CAST && g->nodes[i]->in[0] == x && x >= 0 ? i : cast;
  }
  Fusion *f = g ? fuse(g, (FuseOptions){0}) : NULL;
  MemPlan *m = f ? memplan(f) : NULL;
  char *code = m ? emit_c(f, m, md.path) : NULL, err[256] = "no CAST of x in memory";
  CpuModule *cm = code && cast >= 0 && m->offset[cast] >= 0 ? cpu_load(code, err, sizeof err) : NULL;
  CHECK(cm, "cpu bf16: a graph that casts its input compiles", "%s", err);
  if (cm) {
    char *arena = cpu_arena_new(m);
    float xs[16];
    memcpy(xs, in, sizeof xs);
    int32_t t[2] = {0, 1};
    cpu_set_input(g, m, arena, "x", NULL, xs, 16);
    cpu_set_input(g, m, arena, "targets", t, NULL, 2);
    cpu_step(cm, arena);
    const uint16_t *got = cpu_value(m, arena, cast);
    int bad = -1;
    for (int i = 0; i < 16; i++) {
      bool nan = isnan(xs[i]);
      if (got[i] != want[i] || (!nan && bf16_value(got[i]) != (float)round_bf16(xs[i])))
        bad = bad < 0 ? i : bad;
    }
    CHECK(bad < 0, "cpu bf16: CAST rounds to nearest even, overflows to inf, keeps signs, quiets NaNs",
          "input 0x%08x: got 0x%04x, want 0x%04x", bad >= 0 ? in[bad] : 0, bad >= 0 ? got[bad] : 0,
          bad >= 0 ? want[bad] : 0);
    cpu_arena_free(m, arena);
    cpu_unload(cm);
  }
  arena_free(a);
}

// The plan of a bf16 training graph takes less memory than the fp32 one, at the train section's dims:
// the activations that feed GEMMs are stored in 16 bits (outweighing the bf16 copies of the weights).
static void test_bf16_arena(const char *path) {
  Arena *a = arena_new();
  Model md = {path, {{NULL, 0}}, 0, NULL};
  Graph *g16 = checked_training_graph(a, &md, true), *g32 = checked_training_graph(a, &md, false);
  for (int fz = 0; fz < 2 && g16 && g32; fz++) {
    FuseOptions o = {.fuse = fz, .chunk_lmhead = fz};
    int64_t b16 = memplan(fuse(g16, o))->arena_bytes, b32 = memplan(fuse(g32, o))->arena_bytes;
    char name[256];
    snprintf(name, sizeof name, "cpu bf16 %s %s: the arena is smaller than fp32's (%lld < %lld bytes)", path,
             fz ? "fused" : "unfused", (long long)b16, (long long)b32);
    CHECK(b16 < b32, name, "it is not");
  }
  arena_free(a);
}

// The same source is a cache hit; a changed one compiles anew. Bad ids and targets are reported.
static void test_cache_and_errors(void) {
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  Graph *g = mdl_compile_file(a, "models/gpt2-tiny.mdl", ov, 2);
  if (!g || !autodiff(g, true)) {
    CHECK(false, "cpu cache: gpt2-tiny compiles", "front end failed");
    arena_free(a);
    return;
  }
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
  MemPlan *m = memplan(f);
  char *src = emit_c(f, m, "models/gpt2-tiny.mdl"), err[256];
  CpuModule *first = src ? cpu_load(src, err, sizeof err) : NULL;
  CpuModule *second = first ? cpu_load(src, err, sizeof err) : NULL;
  CHECK(second && second->cache_hit && second->compile_seconds == 0 && !strcmp(first->path, second->path),
        "cpu cache: the same source is a cache hit, without a compile", "%s",
        second ? "it compiled again" : err);
  size_t n = src ? strlen(src) : 0;
  char *changed = malloc(n + 32);
  snprintf(changed, n + 32, "%s// changed\n", src ? src : "");
  CpuModule *third = first ? cpu_load(changed, err, sizeof err) : NULL;
  CHECK(third && !third->cache_hit && third->compile_seconds > 0 && strcmp(first->path, third->path),
        "cpu cache: a changed source misses the cache and compiles", "%s", third ? "it was a hit" : err);

  CpuModule *bad = cpu_load("this is not C\n", err, sizeof err);
  CHECK(!bad && strstr(err, "the C compiler failed"), "cpu cache: a source that does not compile is reported",
        "got '%s'", bad ? "a module" : err);
  cpu_unload(bad);
  // in parts: part 1 fails; the message names the log, which holds the compiler's words for it
  bad = cpu_load("// two parts\n#define MDL_NPARTS 2\n#if MDL_PART == 1\nthis is not C\n#endif\nvoid mdl_x(void) {}\n", err,
                 sizeof err);
  const char *see = strstr(err, "(see "), *end = see ? strstr(see, ".log)") : NULL;
  char logpath[300] = "", words[4096] = "";
  if (see && end && end - see - 5 + 4 < (ptrdiff_t)sizeof logpath)
    snprintf(logpath, sizeof logpath, "%.*s", (int)(end - see - 5 + 4), see + 5);
  FILE *lf = logpath[0] ? fopen(logpath, "r") : NULL;
  if (lf) {
    words[fread(words, 1, sizeof words - 1, lf)] = 0;
    fclose(lf);
  }
  CHECK(!bad && strstr(err, "the C compiler failed") && strstr(words, "error"),
        "cpu cache: a module in parts whose part does not compile is reported, its log kept", "got '%s' (log '%s')",
        bad ? "a module" : err, logpath);
  cpu_unload(bad);

  if (first) {
    char *arena = cpu_arena_new(m);
    cpu_init_params(g, m, arena, 7);
    set_inputs_by(g, batch, NULL, m, arena);
    cpu_set_scalar(g, m, arena, "lr", LR);
    cpu_set_scalar(g, m, arena, "step", 1);
    int32_t *targets = NULL, *tokens = NULL;
    for (int i = 0; i < g->n; i++)
      if (g->nodes[i]->op == OP_INPUT && !strcmp(g->nodes[i]->name, "targets"))
        targets = cpu_value(m, arena, i);
      else if (g->nodes[i]->op == OP_INPUT && !strcmp(g->nodes[i]->name, "tokens"))
        tokens = cpu_value(m, arena, i);
    CHECK(cpu_step(first, arena), "cpu errors: a good batch runs", "%s", first->error);
    targets[5] = 300;
    bool ok = cpu_step(first, arena);
    CHECK(!ok && strstr(first->error, "target 300 out of range [0, 256)"),
          "cpu errors: a target >= V ends the step with a message", "got '%s'", first->error);
    targets[5] = 1;
    tokens[0] = 999;
    ok = cpu_step(first, arena);
    CHECK(!ok && strstr(first->error, "embed: id 999 out of range [0, 256)"),
          "cpu errors: a token id >= V ends the step with a message", "got '%s'", first->error);
    cpu_arena_free(m, arena);
  }
  cpu_unload(first);
  cpu_unload(second);
  cpu_unload(third);
  free(changed);
  arena_free(a);
}

// Removes the test's cache directory and everything in it.
// Extreme values through the compiled C's exp (a polynomial that saturates outside [-87, 88] and
// vectorizes, emit_c.c's prelude): cross-entropy over rows with -inf logits, and gelu and silu from
// -1e4 to 1e4 (where exp(-2u) leaves the float range both ways), and a clamp between bounds beyond
// the float range (+-1e39, infinite as floats), loss and gradient against the interpreter's libm; a
// NaN logit or activation gives a NaN loss, as there.
static const char limits[] = "model limits\n"
                             "dim R = 4\n"
                             "dim V = 300\n"
                             "input x: f32[R, V]\n"
                             "input z: f32[R, V]\n"
                             "input targets: i32[R]\n"
                             "param s: [V] = normal(0.1)\n"
                             "output loss = mean(cross_entropy(x + s, targets)) + mean(gelu(z + s)) + "
                             "mean(silu(z * s)) + mean(clamp(z * s, min=-1e39, max=1e39))\n";

static void test_limits(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "limits.mdl", limits, NULL, 0);
  bool ok = g && autodiff(g, true);
  CHECK(ok, "cpu limits: compiles", "front end or autodiff failed");
  Fusion *f = ok ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
  MemPlan *m = f ? memplan(f) : NULL;
  char *src = m ? emit_c(f, m, "limits.mdl") : NULL, err[256] = "";
  CpuModule *cm = src ? cpu_load(src, err, sizeof err) : NULL;
  CHECK(cm != NULL, "cpu limits: module loads", "%s", err);
  for (int nan = 0; cm && nan < 3; nan++) {
    enum { R = 4, V = 300 };
    static float x[R * V], z[R * V];
    int32_t tg[R] = {1, 2, 0, 3};
    for (int j = 0; j < R * V; j++) {
      x[j] = (float)(3 * sin(0.7 * j + 0.3));
      z[j] = (float)(j % 2 ? 1 : -1) * powf(10.0f, (float)(j % 100) / 25.0f); // +-1 .. +-1e4
    }
    for (int j = 100; j < V; j++)
      x[j] = -INFINITY;
    for (int j = 0; j < 64; j++)
      if (j != tg[1])
        x[V + j] = -INFINITY;
    if (nan == 1)
      x[3 * V + 7] = NAN;
    if (nan == 2)
      z[2 * V + 9] = NAN;
    Interp *it = interp_new(g, INTERP_F32);
    interp_init_params(it, 7);
    interp_set_input(it, "x", NULL, x, R * V);
    interp_set_input(it, "z", NULL, z, R * V);
    interp_set_input(it, "targets", tg, NULL, R);
    interp_set_scalar(it, "lr", 2e-3);
    interp_set_scalar(it, "step", 1);
    bool iok = interp_run(it, g->n, err, sizeof err);
    char *arena = cpu_arena_new(m);
    cpu_init_params(g, m, arena, 7);
    cpu_set_input(g, m, arena, "x", NULL, x, R * V);
    cpu_set_input(g, m, arena, "z", NULL, z, R * V);
    cpu_set_input(g, m, arena, "targets", tg, NULL, R);
    cpu_set_scalar(g, m, arena, "lr", 2e-3);
    cpu_set_scalar(g, m, arena, "step", 1);
    bool cok = cpu_step(cm, arena);
    double loss = *(float *)cpu_value(m, arena, g->loss), ref = interp_value(it, g->loss)[0];
    if (nan) {
      CHECK(iok && cok && isnan(loss) && isnan(ref),
            nan == 1 ? "cpu limits: a NaN logit gives a NaN loss" : "cpu limits: a NaN activation gives a NaN loss",
            "loss %g, interpreter %g (%s)", loss, ref, err);
    } else {
      int64_t n = shape_numel(g->nodes[g->params[0]]->shape);
      double *gs = from_float(cpu_value(m, arena, g->grads[0]), n);
      double e = rel_err(gs, interp_value(it, g->grads[0]), n);
      CHECK(iok && cok && isfinite(loss) && fabs(loss - ref) <= 1e-5 * fabs(ref) && e <= 1e-5,
            "cpu limits: -inf logits, gelu and silu at +-1e4 give the interpreter's loss and gradient (1e-5)",
            "loss %.8f vs %.8f, gradient %.2e (%s)", loss, ref, e, err);
      free(gs);
    }
    cpu_arena_free(m, arena);
    interp_free(it);
  }
  cpu_unload(cm);
  arena_free(a);
}

typedef struct {
  const Fusion *f;
  const MemPlan *m;
  const char *src;
} CpuMake;

static Engine *make_cpu(const void *ctx, uint64_t seed) {
  const CpuMake *c = ctx;
  char err[256];
  return engine_cpu(c->f, c->m, c->src, seed, err, sizeof err);
}

static Engine *make_interp(const void *ctx, uint64_t seed) { return engine_interp(ctx, INTERP_F32, seed); }

// draw_checks.h on gpt2-tiny, bf16 (parameters with copies), fused: the interpreter and the CPU back end.
static void test_param_draw(void) {
  Arena *a = arena_new();
  Graph *g = checked_training_graph(a, &(Model){"models/gpt2-tiny.mdl", {{"B", 2}, {"T", 16}}, 2, NULL}, true);
  if (g) {
    param_draw_unit_checks(g);
    draw_checks("interp gpt2-tiny", g, make_interp, g);
    Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
    MemPlan *m = memplan(f);
    CpuMake c = {f, m, emit_c(f, m, "gpt2-tiny")};
    draw_checks("cpu gpt2-tiny bf16 fused", g, make_cpu, &c);
  }
  arena_free(a);
}

// Attention long enough to run on the GEMM library (emit_c.c, attn_by_gemm): query blocks of 64 rows
// and a last one of 32, causal within documents, then both kinds of non-causal attention.
static const char attn_gemm[] =
    "model attngemm\n"
    "dim B = 2\n"
    "dim T = 160\n"
    "dim C = 64\n"
    "dim V = 256\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input doc: i32[B, T]\n"
    "param wte: [V, C] = normal(0.5)\n"
    "param wqkv: [C, 3*C] = normal(0.15)\n"
    "param w2: [C, 3*C] = normal(0.15)\n"
    "param head: [C, V] = normal(0.15)\n"
    "q, k, v = split(embed(wte, tokens) @ wqkv, 3, axis=-1)\n"
    "a = attention(q, k, v, heads=2, causal=true, doc=doc) + v\n"
    "q2, k2, v2 = split(a @ w2, 3, axis=-1)\n"
    "b = attention(q2, k2, v2, heads=2, doc=doc) + attention(q2, k2, v2, heads=2) + a\n"
    "output loss = mean(cross_entropy(b @ head, targets))\n";

// Grouped-query, multi-query, sliding-window and cross attention (keys of another length, from an
// f32 input): kv_heads=2 of 4 causal within documents in a window, kv_heads=1 in another window,
// kv_heads=2 over S rows of ctx. At T 24, C 32 the row loops; at T 160, C 128 (heads of 32) the
// GEMM library, with windows that span query blocks.
static const char attn_kv[] =
    "model attnkv\n"
    "dim B = 2\n"
    "dim T = 24\n"
    "dim C = 32\n"
    "dim S = 11\n"
    "dim W = T / 4\n"
    "dim W2 = T / 2 + 1\n"
    "dim V = 256\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input doc: i32[B, T]\n"
    "input ctx: f32[B, S, C]\n"
    "param wte: [V, C] = normal(0.5)\n"
    "param wq: [C, C] = normal(0.15)\n"
    "param wkv: [C, C] = normal(0.15)\n"
    "param wm: [C, C / 2] = normal(0.15)\n"
    "param wc: [C, C] = normal(0.15)\n"
    "param head: [C, V] = normal(0.15)\n"
    "x = embed(wte, tokens)\n"
    "k, v = split(x @ wkv, 2, axis=-1)\n"
    "a = attention(x @ wq, k, v, heads=4, kv_heads=2, causal=true, doc=doc, window=W) + x\n"
    "k1, v1 = split(a @ wm, 2, axis=-1)\n"
    "b = attention(a @ wq, k1, v1, heads=4, kv_heads=1, causal=true, window=W2) + a\n"
    "kc, vc = split(ctx @ wc, 2, axis=-1)\n"
    "c = attention(b, kc, vc, heads=4, kv_heads=2) + b\n"
    "output loss = mean(cross_entropy(c @ head, targets))\n";

// `test_cpu matrix`: the comparisons with the interpreter, fp32 and bf16, on the models whose loops
// differ most (rows of 16 and 32 in bf16, attention by row loops and by GEMMs), for one GEMM path
// and one target level; tests/cli/matrix.sh runs it under each that the host can run (MDL_GEMM,
// ONEDNN_MAX_CPU_ISA, MDL_MARCH), in the cache it names.
static void test_matrix(void) {
  char err[256];
  const GemmLib *lib = rt_gemm(err, sizeof err);
  const char *cap = getenv("ONEDNN_MAX_CPU_ISA"), *march = getenv("MDL_MARCH");
  march = march && *march ? march : "native";
  char why[256];
  bool runs = cpu_march_ok(why, sizeof why);
  if (!lib) { // (a library that is not installed)
    printf("[skip] cpu matrix: %s\n", err);
    return;
  }
  if (cap && !strncmp(lib->name, "oneDNN", 6) && strcasecmp(lib->kernels, cap)) {
    printf("[skip] cpu matrix: oneDNN capped at %s: this CPU runs at most %s\n", cap, lib->kernels);
    return;
  }
  if (!runs) {
    printf("[skip] cpu matrix: %s\n", why);
    return;
  }
  printf("[ok] cpu matrix: GEMMs on %s (%s), modules built for -march=%s\n", lib->name, lib->kernels, march);
  const Model models[] = {
      {"models/gpt2-tiny.mdl", {{"B", 4}, {"T", 32}}, 2, NULL},
      {"qkvsplit.mdl", {{NULL, 0}}, 0, qkv_split},
      {"attnkv.mdl", {{"T", 160}, {"C", 128}}, 2, attn_kv},
  };
  test_model(&models[1]);
  test_model(&models[2]);
  for (size_t i = 0; i < sizeof models / sizeof *models; i++)
    test_bf16(&models[i]);
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "matrix")) {
    matrix = true;
    test_matrix();
    TEST_EXIT();
  }
  char dir[] = "/tmp/mdl-cache-XXXXXX";
  if (!cache_dir_make(dir, "cpu: a cache directory"))
    TEST_EXIT();
  const Model models[] = {
      {"models/gpt2-tiny.mdl", {{"B", 4}, {"T", 32}}, 2, NULL}, // 128 rows: the LM head in 2 chunks
      {"models/llama-tiny.mdl", {{"B", 4}, {"T", 32}}, 2, NULL},
      {"models/mlp.mdl", {{"B", 8}}, 1, NULL},
      {"allops.mdl", {{NULL, 0}}, 0, allops},
      {"tests/unit/sums.mdl", {{NULL, 0}}, 0, NULL},
      {"qkvsplit.mdl", {{NULL, 0}}, 0, qkv_split},
      {"attngemm.mdl", {{NULL, 0}}, 0, attn_gemm},
      {"attnkv.mdl", {{NULL, 0}}, 0, attn_kv},
      {"attnkv.mdl", {{"T", 160}, {"C", 128}}, 2, attn_kv},
      {"routing.mdl", {{NULL, 0}}, 0, routing},
      {"optsgd.mdl", {{NULL, 0}}, 0, opt_sgd},
      {"optplain.mdl", {{NULL, 0}}, 0, opt_plain},
      {"optlion.mdl", {{NULL, 0}}, 0, opt_lion},
      {"optmuon.mdl", {{NULL, 0}}, 0, opt_muon},
      {"newops.mdl", {{NULL, 0}}, 0, newops},
      {"tests/unit/colsums.mdl", {{NULL, 0}}, 0, NULL},
  };
  for (size_t i = 0; i < sizeof models / sizeof *models; i++)
    test_model(&models[i]);
  for (size_t i = 0; i < 3; i++)
    test_bf16(&models[i]);
  test_bf16(&models[4]);
  test_bf16(&models[5]);
  test_bf16(&models[6]);
  test_bf16(&models[7]);
  test_bf16(&models[8]);
  test_bf16(&models[9]);
  test_bf16(&models[15]);
  test_bf16_arena("models/gpt2-tiny.mdl");
  test_bf16_arena("models/llama-tiny.mdl");
  test_bf16_rounding();
  test_limits();
  test_cache_and_errors();
  test_param_draw();
  remove_dir(dir);
  TEST_EXIT();
}
