// test_precision_fp8.c: precision = fp8 in the precision pass and the reference interpreter.
//  1. The pass on gpt2-tiny (B=2, T=16), GEMM by GEMM: the forward GEMM of each weight reads two
//     E4M3 operands, except h.0.attn_w's ("first layer") and the LM head's (wte, "LM head"), kept in
//     bf16 with their reasons; each backward GEMM reads the E5M2 gradient and an E4M3 cast of the
//     scaled tensor its forward GEMM reads, or bf16 with its forward GEMM's reason; 21 scaled tensors
//     named after their weights. Every fp8 GEMM has cuBLASLt's FP8 layout (A as it is, B transposed:
//     C = A B^T), and each scaled tensor is cast exactly twice, once as it is and once transposed
//     (its shape's last two axes swapped), the copy a CAST of a PERMUTE of the same value. With
//     optimizer = muon the Newton-Schulz GEMMs stay bf16 with their reason; with plain attention its
//     GEMMs have "no weight operand"; a GEMM with a dimension not a multiple of 16 stays bf16 with
//     its reason.
//  2. One step of the MLP (models/mlp.mdl: w1 is the first layer, w3 the LM head, so w2's GEMMs are the
//     fp8 ones) against the contract computed here: the scales of the step from the calibration's
//     amaxes as 2^(floor(log2(max / amax)) - 1) by log2 and floor, the operands quantised by hand with
//     the prelude's conversions, the GEMM summed in double and descaled; the histories after the step
//     (this step's amax, then the calibration's) and the next step's scales from them.
//  3. The scaling rule at its edges (fp8_scale): amax at the format's largest value and just above, a
//     power of two, zero, tiny (the largest scale, 2^63) and huge (clamped to 2^-63 and flagged); and
//     the histories (fp8_state_update): the newest amax first, a scale from the largest of the last H,
//     an old peak forgotten after H steps, nothing changed by a non-finite amax.
// (An activation that overflows into an fp8 GEMM: test_fp8_cpu.c, on the interpreter and the C back end.)
#include "mdl.h"
#include "fp8_state.h"
#include "test.h"
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_bits.h"

static Graph *fp8_graph(Arena *a, const char *path, const char *text, const DimOverride *ov, int nov,
                        const LowerOptions *lo) {
  Graph *g = text ? mdl_compile_text_with(a, path, text, ov, nov, lo) : mdl_compile_file_with(a, path, ov, nov, lo);
  char why[512];
  if (!g || !autodiff(g, true) || !precision_assign(g, DT_F8E4M3, why, sizeof why)) {
    printf("[fail] %s: front end, autodiff or the fp8 pass failed: %s\n", path, g ? g->err : "");
    exit(1);
  }
  return g;
}

static int strip(const Graph *g, int id) {
  while (g->nodes[id]->op == OP_RESHAPE || g->nodes[id]->op == OP_PERMUTE || g->nodes[id]->op == OP_SLICE)
    id = g->nodes[id]->in[0];
  return id;
}

// The parameter a forward GEMM reads (its operand's CAST's source, through views), or NULL.
static const char *weight_of(const Graph *g, const IrNode *mm) {
  for (int k = 0; k < 2; k++) {
    int x = strip(g, mm->in[k]);
    if (g->nodes[x]->op == OP_CAST)
      x = strip(g, g->nodes[x]->in[0]);
    if (g->nodes[x]->op == OP_PARAM)
      return g->nodes[x]->name;
  }
  return NULL;
}

static void test_pass_gpt2(void) {
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  Graph *g = fp8_graph(a, "models/gpt2-tiny.mdl", NULL, ov, 2, NULL);
  static const struct {
    const char *weight, *why; // why NULL: fp8
  } want[] = {{"h.0.attn_w", "first layer"}, {"h.0.proj_w", NULL}, {"h.0.fc_w", NULL}, {"h.0.fcproj_w", NULL},
              {"h.1.attn_w", NULL},          {"h.1.proj_w", NULL}, {"h.1.fc_w", NULL}, {"h.1.fcproj_w", NULL},
              {"wte", "LM head"}};
  int fwd = 0, bwd_fp8 = 0, bwd_bf16 = 0, bad = 0, unshared = 0, layout = 0, fp8_gemms = 0;
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op != OP_MATMUL)
      continue;
    DType da = g->nodes[n->in[0]]->dtype, db = g->nodes[n->in[1]]->dtype;
    if (is_fp8(da))
      fp8_gemms++, layout += n->ia[0] != 0 || n->ia[1] != 1;
    if (i < g->fwd_end) {
      const char *w = weight_of(g, n);
      for (size_t k = 0; k < sizeof want / sizeof *want; k++) {
        if (!w || strcmp(w, want[k].weight))
          continue;
        fwd++;
        bool ok = want[k].why ? da == DT_BF16 && db == DT_BF16 && n->why && !strcmp(n->why, want[k].why)
                              : da == DT_F8E4M3 && db == DT_F8E4M3 && !n->why;
        char name[160];
        snprintf(name, sizeof name, "fp8 pass: gpt2-tiny's forward GEMM of %s reads %s", w,
                 want[k].why ? want[k].why : "E4M3 x E4M3");
        CHECK(ok, name, "operands %s, %s, why %s", dtype_name(da), dtype_name(db), n->why ? n->why : "(none)");
      }
      continue;
    }
    if (is_fp8(da)) {
      bwd_fp8++;
      bad += !((da == DT_F8E5M2) ^ (db == DT_F8E5M2)) || !is_fp8(db) || n->why;
      // its E4M3 operand is a cast of the scaled tensor a forward GEMM reads
      int64_t e4 = g->nodes[da == DT_F8E4M3 ? n->in[0] : n->in[1]]->ia[1];
      bool shared = false;
      for (int f = 0; f < g->fwd_end; f++)
        for (int k = 0; k < 2 && g->nodes[f]->op == OP_MATMUL; k++)
          shared |= is_fp8(g->nodes[g->nodes[f]->in[k]]->dtype) && g->nodes[g->nodes[f]->in[k]]->ia[1] == e4;
      unshared += !shared;
    } else {
      bwd_bf16++;
      bad += da != DT_BF16 || db != DT_BF16 || !n->why || (strcmp(n->why, "first layer") && strcmp(n->why, "LM head"));
    }
  }
  CHECK(fwd == 9, "fp8 pass: gpt2-tiny has the 9 forward GEMMs named", "found %d", fwd);
  CHECK(bwd_fp8 == 14 && bwd_bf16 == 4 && bad == 0, "fp8 pass: gpt2-tiny's backward GEMMs: 14 fp8 (E5M2 dout, E4M3 "
        "operand), 4 bf16 (first layer, LM head)", "%d fp8, %d bf16, %d bad", bwd_fp8, bwd_bf16, bad);
  CHECK(unshared == 0, "fp8 pass: each backward GEMM reads its forward GEMM's E4M3 scaled tensor", "%d do not",
        unshared);
  CHECK(fp8_gemms == 21 && layout == 0, "fp8 pass: all 21 fp8 GEMMs have cuBLASLt's FP8 layout (A, B transposed)",
        "%d fp8 GEMMs, %d in another layout", fp8_gemms, layout);
  int e4 = 0, e5 = 0, casts = 0, pairs = 0;
  for (int i = 0; i < g->nfp8; i++)
    g->fp8[i].fmt == DT_F8E5M2 ? e5++ : e4++;
  for (int i = 0; i < g->n; i++) {
    const IrNode *c = g->nodes[i];
    if (c->op != OP_CAST || !is_fp8(c->dtype))
      continue;
    casts++;
    // the transposed copy: right after the cast, the CAST of a PERMUTE of the same value, swapped
    const IrNode *p = i + 1 < g->n ? g->nodes[i + 1] : NULL, *t = i + 2 < g->n ? g->nodes[i + 2] : NULL;
    int r = c->shape.rank;
    pairs += p && t && p->op == OP_PERMUTE && p->in[0] == c->in[0] && t->op == OP_CAST && t->in[0] == p->id &&
             t->dtype == c->dtype && t->ia[1] == c->ia[1] && t->shape.d[r - 1] == c->shape.d[r - 2] &&
             t->shape.d[r - 2] == c->shape.d[r - 1];
  }
  CHECK(e4 == 14 && e5 == 7 && casts == 42 && pairs == 21,
        "fp8 pass: 21 scaled tensors (14 E4M3, 7 E5M2), each cast as it is and transposed",
        "%d E4M3, %d E5M2, %d casts, %d transposed pairs", e4, e5, casts, pairs);
  bool named = g->nfp8 == 21 && !strcmp(g->fp8[1].name, "h.0.proj_w") && !strcmp(g->fp8[0].name, "h.0.proj_w's input") &&
               !strcmp(g->fp8[20].name, "d h.0.proj_w's output");
  CHECK(named, "fp8 pass: scaled tensors are named after their weights", "#0 '%s', #1 '%s', #20 '%s'",
        g->nfp8 > 0 ? g->fp8[0].name : "", g->nfp8 > 1 ? g->fp8[1].name : "", g->nfp8 > 20 ? g->fp8[20].name : "");
  arena_free(a);

  // Muon: the Newton-Schulz GEMMs (the backward section's GEMMs of no forward operand) stay bf16.
  a = arena_new();
  const char *muon[] = {"optimizer=muon"};
  g = fp8_graph(a, "models/gpt2-tiny.mdl", NULL, ov, 2, &(LowerOptions){.settings = muon, .nsettings = 1});
  int ns = 0, ns_bad = 0;
  for (int i = g->fwd_end; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op != OP_MATMUL || (n->why && strcmp(n->why, "Muon's Newton-Schulz")))
      continue;
    if (n->why)
      ns++, ns_bad += g->nodes[n->in[0]]->dtype != DT_BF16;
  }
  CHECK(ns > 0 && ns_bad == 0, "fp8 pass: Muon's Newton-Schulz GEMMs stay bf16 with their reason", "%d, %d bad", ns,
        ns_bad);
  arena_free(a);

  // Attention lowered into GEMMs: its products read no weight.
  a = arena_new();
  g = fp8_graph(a, "models/gpt2-tiny.mdl", NULL, ov, 2, &(LowerOptions){.plain_attention = true});
  int plain = 0, plain_bad = 0;
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op == OP_MATMUL && n->why && !strcmp(n->why, "no weight operand"))
      plain++, plain_bad += g->nodes[n->in[0]]->dtype != DT_BF16;
  }
  CHECK(plain == 6 * 2 && plain_bad == 0, "fp8 pass: plain attention's GEMMs (2 a layer, 4 backward) stay bf16: "
        "no weight operand", "%d, %d bad", plain, plain_bad);
  arena_free(a);
}

// Each input's values (an InputFill): ids in [0, 4), smooth floats.
static void small_inputs(const IrNode *nd, int32_t *ids, float *f) {
  for (int64_t j = 0; j < shape_numel(nd->shape); j++) {
    ids[j] = (int32_t)((j * 53 + 7) % 4);
    f[j] = (float)sin(0.7 * (double)j + 0.3);
  }
}

// The scale of the contract, by log2 and floor: 2^(floor(log2(max / amax)) - 1).
static double ref_scale(DType fmt, double amax) {
  return ldexp(1, (int)floor(log2((fmt == DT_F8E5M2 ? 57344.0 : 448.0) / amax)) - 1);
}

static double quant(DType fmt, double x, double scale) {
  float s = (float)(x * scale);
  return fmt == DT_F8E5M2 ? mdl_e5m2_to_f32(mdl_f32_to_e5m2(s)) : mdl_e4m3_to_f32(mdl_f32_to_e4m3(s));
}

// The GEMM of node mm recomputed from its operands' f32 sources: quantised with the scales given, summed
// in double, descaled; the largest difference from the interpreter's value relative to max |y|.
static double gemm_error(const Graph *g, Interp *it, const IrNode *mm, const double *src[2], const double sc[2]) {
  const IrNode *a = g->nodes[mm->in[0]], *b = g->nodes[mm->in[1]];
  int64_t m = mm->shape.d[0], n = mm->shape.d[1];
  int64_t k = mm->ia[0] ? a->shape.d[0] : a->shape.d[1];
  const double *y = interp_value(it, mm->id);
  double worst = 0, big = 0;
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = 0;
      for (int64_t l = 0; l < k; l++) {
        double x = src[0][mm->ia[0] ? l * m + i : i * k + l], w = src[1][mm->ia[1] ? j * k + l : l * n + j];
        s += quant(a->dtype, x, sc[0]) * quant(b->dtype, w, sc[1]);
      }
      s /= sc[0] * sc[1];
      worst = fmax(worst, fabs(s - y[i * n + j]));
      big = fmax(big, fabs(s));
    }
  return worst / big;
}

static double amax_of(Interp *it, int node) {
  double m = 0;
  for (int64_t i = 0; i < interp_numel(it, node); i++)
    m = fmax(m, fabs(interp_value(it, node)[i]));
  return m;
}

// The MLP at B = 8: w2's forward GEMM has m = 8, so it and its backward GEMMs stay bf16, and nothing
// is scaled.
static void test_pass_alignment(void) {
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 8}};
  Graph *g = fp8_graph(a, "models/mlp.mdl", NULL, ov, 1, NULL);
  int kept = 0, fp8 = 0;
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op != OP_MATMUL)
      continue;
    fp8 += is_fp8(g->nodes[n->in[0]]->dtype);
    kept += n->why && !strcmp(n->why, "dimensions not multiples of 16");
  }
  CHECK(kept == 3 && fp8 == 0 && g->nfp8 == 0,
        "fp8 pass: the MLP at B = 8 keeps w2's three GEMMs bf16 (dimensions not multiples of 16)",
        "%d kept for that reason, %d fp8 GEMMs, %d scaled tensors", kept, fp8, g->nfp8);
  arena_free(a);
}

static void test_interp_mlp(void) {
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 16}};
  Graph *g = fp8_graph(a, "models/mlp.mdl", NULL, ov, 1, NULL);
  Interp *it = interp_new(g, INTERP_F32);
  interp_init_params(it, 3);
  set_inputs_by(g, small_inputs, it, NULL, NULL);
  int w2 = -1;
  for (int k = 0; k < g->nparams; k++)
    if (!strcmp(g->nodes[g->params[k]]->name, "w2"))
      w2 = g->params[k];
  double *w2_before = malloc(sizeof(double) * 32 * 32);
  memcpy(w2_before, interp_param(it, w2), sizeof(double) * 32 * 32);
  interp_set_scalar(it, "lr", 1e-2);
  interp_set_scalar(it, "step", 1);
  char err[256];
  bool ran = interp_run(it, g->n, err, sizeof err);
  CHECK(ran, "fp8 interp: the MLP's first step runs", "%s", err);
  const Fp8State *st = interp_fp8(it);
  CHECK(g->nfp8 == 3 && st->n == 3 && st->H == 16 && st->recorded == 2,
        "fp8 interp: w2's GEMMs have 3 scaled tensors, 16 steps of history, 2 recorded (calibration and step 1)",
        "%d tensors, H %d, recorded %lld", g->nfp8, st->H, (long long)st->recorded);
  // The forward GEMM (E4M3 x E4M3), the backward's dh (E5M2 x E4M3) and dw2 (E4M3 x E5M2).
  int checked = 0;
  for (int i = 0; i < g->n && ran; i++) {
    const IrNode *mm = g->nodes[i];
    if (mm->op != OP_MATMUL || !is_fp8(g->nodes[mm->in[0]]->dtype))
      continue;
    const double *src[2];
    double sc[2];
    bool ok = true;
    for (int k = 0; k < 2; k++) {
      const IrNode *c = g->nodes[mm->in[k]];
      int from = c->in[0], t = (int)c->ia[1];
      src[k] = g->nodes[from]->op == OP_PARAM && from == w2 ? w2_before : interp_value(it, from);
      // the step's scale is the calibration's amax's (hist[1]); this step's amax is hist[0]
      double now = from == w2 ? 0 : amax_of(it, from);
      if (from == w2)
        for (int j = 0; j < 32 * 32; j++)
          now = fmax(now, fabs(w2_before[j]));
      ok &= st->hist[t * st->H] == (float)now;
      sc[k] = ref_scale(c->dtype, st->hist[t * st->H + 1]);
    }
    char name[160];
    snprintf(name, sizeof name, "fp8 interp: the MLP's GEMM %%%d (%s x %s) is the contract's, and its amaxes "
             "are in the histories", i, dtype_name(g->nodes[mm->in[0]]->dtype), dtype_name(g->nodes[mm->in[1]]->dtype));
    double e = gemm_error(g, it, mm, src, sc);
    CHECK(ok && e < 2e-6, name, "amaxes %s, relative error %.3g", ok ? "recorded" : "wrong", e);
    checked++;
  }
  CHECK(checked == 3, "fp8 interp: three fp8 GEMMs checked", "%d", checked);
  bool scales = true;
  for (int t = 0; t < st->n; t++) {
    double peak = fmax(st->hist[t * st->H], st->hist[t * st->H + 1]);
    scales &= st->scale[t] == (float)ref_scale(g->fp8[t].fmt, peak);
  }
  CHECK(scales, "fp8 interp: the next step's scales come from the histories' maxima", "scale[0] %g", st->scale[0]);
  free(w2_before);
  interp_free(it);
  arena_free(a);
}

static void test_scale_rule(void) {
  static const struct {
    DType fmt;
    double amax, scale;
    bool low;
  } cases[] = {{DT_F8E4M3, 448, 0.5, false},       {DT_F8E4M3, 448.5, 0.25, false}, {DT_F8E4M3, 224, 1, false},
               {DT_F8E4M3, 1, 128, false},         {DT_F8E5M2, 1, 16384, false},    {DT_F8E5M2, 57344, 0.5, false},
               {DT_F8E4M3, 0, 0x1p63, false},      {DT_F8E4M3, 1e-30, 0x1p63, false},
               {DT_F8E4M3, 3e38, 0x1p-63, true},   {DT_F8E5M2, 1e20, 0x1p-52, false}};
  int bad = 0;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    bool low;
    float got = fp8_scale(cases[i].fmt, cases[i].amax, &low);
    if (got != (float)cases[i].scale || low != cases[i].low) {
      printf("  %s amax %g: scale %g (low %d), want %g (low %d)\n", dtype_name(cases[i].fmt), cases[i].amax,
             (double)got, low, cases[i].scale, cases[i].low);
      bad++;
    }
  }
  CHECK(bad == 0, "fp8 scale: 2^(floor(log2(max / amax)) - 1) at the rule's edges", "%d cases wrong", bad);

  Arena *a = arena_new();
  Graph g = {.arena = a, .nfp8 = 1, .train = {.amax_history = 3}};
  g.fp8 = &(Fp8Tensor){DT_F8E4M3, "x", {0}};
  Fp8State st;
  fp8_state_init(&st, &g);
  static const float amax[] = {10, 1, 1, 1, 1};
  static const float want[] = {16, 16, 16, 128, 128}; // (448 / 10 -> 2^5 - 1; 448 / 1 -> 2^8 - 1)
  char why[128];
  bool rolled = true;
  for (int s = 0; s < 5; s++) {
    st.amax[0] = amax[s];
    rolled &= fp8_state_update(&st, &g, why, sizeof why) && st.hist[0] == amax[s] && st.scale[0] == want[s];
  }
  st.amax[0] = INFINITY;
  bool kept = !fp8_state_update(&st, &g, why, sizeof why) && st.hist[0] == 1 && st.scale[0] == 128 &&
              st.recorded == 3 && strstr(why, "amax of x");
  CHECK(rolled && kept, "fp8 state: newest first, scales from the last 3 amaxes, an old peak forgotten, an "
        "infinite amax changes nothing", "rolled %d, kept %d (%s)", rolled, kept, why);
  fp8_state_free(&st);
  arena_free(a);
}

int main(void) {
  test_scale_rule();
  test_pass_gpt2();
  test_pass_alignment();
  test_interp_mlp();
  TEST_EXIT();
}
