// test_frontend.c: the .mdl front end on small texts and on models/: shapes of outputs, param
// names, counts and inits, dims, train settings, rebinding, repeat naming, the lowering of each
// construct to IR nodes, and error counts (the exact messages are tests/errors/'s business).
#include "mdl.h"
#include "test.h"
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static Arena *arena;
static char errtext[16384]; // what the last compile() printed on stderr
static const LowerOptions *lowering; // how compile_any lowers (NULL: the defaults)

// Compiles a text (or, when text is NULL, the file at path) in a fresh arena with stderr captured
// in errtext; *errors gets the number of errors reported.
static Graph *compile_any(const char *path, const char *text, const DimOverride *ov, int nov, int *errors) {
  arena_free(arena);
  arena = arena_new();
  fflush(stderr);
  int saved = dup(2);
  FILE *tmp = tmpfile();
  dup2(fileno(tmp), 2);
  int before = diag_errors;
  Graph *g = text ? mdl_compile_text_with(arena, path, text, ov, nov, lowering)
                  : mdl_compile_file_with(arena, path, ov, nov, lowering);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  rewind(tmp);
  size_t n = fread(errtext, 1, sizeof errtext - 1, tmp);
  errtext[n] = 0;
  fclose(tmp);
  *errors = diag_errors - before;
  return g;
}

static Graph *compile_ov(const char *text, const DimOverride *ov, int nov, int *errors) {
  return compile_any("t.mdl", text, ov, nov, errors);
}

static Graph *compile(const char *text) {
  int errors;
  Graph *g = compile_ov(text, NULL, 0, &errors);
  if (!g)
    printf("unexpected errors:\n%s", errtext);
  return g;
}

// The number of errors a text gives; -1 when it compiles (or fails without saying why).
static int errors_of(const char *text) {
  int errors;
  Graph *g = compile_ov(text, NULL, 0, &errors);
  return g || errors == 0 ? -1 : errors;
}

static const IrNode *named(const Graph *g, const char *name) {
  for (int i = g->n - 1; i >= 0; i--)
    if (g->nodes[i]->name && !strcmp(g->nodes[i]->name, name))
      return g->nodes[i];
  return NULL;
}

static const IrNode *in(const Graph *g, const IrNode *n, int k) { return g->nodes[n->in[k]]; }

static bool has_shape(const IrNode *n, int rank, int64_t d0, int64_t d1, int64_t d2) {
  int64_t d[3] = {d0, d1, d2};
  if (!n || n->shape.rank != rank)
    return false;
  for (int i = 0; i < rank && i < 3; i++)
    if (n->shape.d[i] != d[i])
      return false;
  return true;
}

// Whether n's integer attributes ia[k..] are all 0 (a slot its op does not read).
static bool zero_from(const IrNode *n, int k) {
  for (; k < IR_NIA; k++)
    if (n->ia[k] != 0)
      return false;
  return true;
}

static int64_t dim(const Graph *g, const char *name) {
  for (int i = 0; i < g->ndims; i++)
    if (!strcmp(g->dims[i].name, name))
      return g->dims[i].value;
  return -1;
}

static void test_gpt2_tiny(void) {
  int errors;
  Graph *g = compile_any("models/gpt2-tiny.mdl", NULL, NULL, 0, &errors);
  CHECK(g != NULL, "gpt2-tiny compiles", "%s", errtext);
  if (!g)
    return;
  CHECK(!strcmp(g->model, "gpt2_tiny"), "gpt2-tiny model name", "got %s", g->model);
  CHECK(g->nparams == 28, "gpt2-tiny has 28 param tensors", "got %d", g->nparams);
  CHECK(ir_param_count(g) == 124672, "gpt2-tiny parameter count", "got %lld", (long long)ir_param_count(g));
  static const char *order[] = {"wte", "wpe", "h.0.ln1_w", "h.0.ln1_b", "h.0.attn_w"};
  bool ok = true;
  for (int i = 0; i < 5; i++)
    ok &= !strcmp(g->nodes[g->params[i]]->name, order[i]);
  ok &= !strcmp(g->nodes[g->params[14]]->name, "h.1.ln1_w") && !strcmp(g->nodes[g->params[27]]->name, "lnf_b");
  CHECK(ok, "gpt2-tiny params in declaration order, repeat params named h.i.x", "params[2] is %s",
        g->nodes[g->params[2]]->name);
  const char *want_dims[] = {"V", "maxT", "C", "H", "D", "L", "B", "T"};
  int64_t want_vals[] = {256, 128, 64, 4, 16, 2, 8, 64};
  ok = g->ndims == 8;
  for (int i = 0; ok && i < 8; i++)
    ok = !strcmp(g->dims[i].name, want_dims[i]) && g->dims[i].value == want_vals[i];
  CHECK(ok, "gpt2-tiny dims in declaration order with values", "ndims %d", g->ndims);
  const TrainConfig *t = &g->train;
  CHECK(t->lr == 2e-3 && t->beta1 == 0.9 && t->beta2 == 0.95 && t->eps == 1e-8 && t->weight_decay == 0.1,
        "gpt2-tiny optimizer settings", "lr %g b1 %g b2 %g eps %g wd %g", t->lr, t->beta1, t->beta2, t->eps,
        t->weight_decay);
  CHECK(t->schedule == SCHED_COSINE && t->warmup == 100 && t->min_lr == 1e-4 && t->steps == 4000 && t->clip == 1.0 &&
            t->accumulate == 1,
        "gpt2-tiny schedule, clip, accumulate", "warmup %lld min_lr %g steps %lld clip %g", (long long)t->warmup,
        t->min_lr, (long long)t->steps, t->clip);
  CHECK(!strcmp(t->precision, "auto") && !strcmp(t->checkpoint, "auto"), "gpt2-tiny precision and checkpoint",
        "%s %s", t->precision, t->checkpoint);
  const IrNode *loss = g->loss >= 0 ? g->nodes[g->loss] : NULL;
  // mean(cross_entropy(logits, targets)): the per-position losses summed over the [B*T] positions,
  // divided by how many targets count.
  const IrNode *sum = loss && loss->nin == 2 ? in(g, loss, 0) : NULL, *count = sum ? in(g, loss, 1) : NULL;
  CHECK(loss && loss->op == OP_DIV && loss->shape.rank == 0 && !strcmp(loss->name, "loss") && sum->op == OP_SUM &&
            has_shape(in(g, sum, 0), 1, 8 * 64, 0, 0) && in(g, in(g, sum, 0), 0)->op == OP_CROSS_ENTROPY &&
            count->op == OP_TARGET_COUNT && count->shape.rank == 0 && in(g, count, 0) == named(g, "targets"),
        "gpt2-tiny loss is the cross-entropy summed over its positions / target_count(targets)", "loss %d (%s)",
        g->loss, loss ? op_name(loss->op) : "none");
  CHECK(g->noutputs == 2 && has_shape(g->nodes[g->outputs[0]], 3, 8, 64, 256), "gpt2-tiny logits [8,64,256]",
        "noutputs %d", g->noutputs);
  CHECK(g->fwd_end == g->n, "gpt2-tiny forward graph ends at n", "fwd_end %d n %d", g->fwd_end, g->n);
  char why[256];
  CHECK(ir_validate(g, why, sizeof why), "gpt2-tiny graph validates", "%s", why);
  const IrNode *proj = named(g, "h.1.proj_w"), *wte = named(g, "wte");
  CHECK(proj && proj->init.kind == INIT_NORMAL && fabs(proj->init.std - 0.01) < 1e-15 && proj->init.decay,
        "scaled init normal(0.02 / sqrt(2*L)) = 0.01", "std %g", proj ? proj->init.std : -1);
  CHECK(wte && wte->init.decay && !named(g, "h.0.attn_b")->init.decay && !named(g, "h.1.ln2_w")->init.decay &&
            !named(g, "lnf_w")->init.decay && named(g, "h.0.fc_w")->init.decay,
        "no_decay patterns: 2-D weights decay, biases and layernorm params do not", "wte decay %d",
        wte ? wte->init.decay : -1);
  CHECK(named(g, "h.0.ln1_b")->init.kind == INIT_ZEROS && named(g, "h.0.ln1_w")->init.kind == INIT_ONES,
        "zeros and ones initializers", "kinds %d %d", named(g, "h.0.ln1_b")->init.kind,
        named(g, "h.0.ln1_w")->init.kind);
  // The tied head: wte.T lowers to the matmul's transpose flag on a 2-D GEMM.
  const IrNode *logits = g->nodes[g->outputs[0]];
  const IrNode *mm = logits->op == OP_RESHAPE ? in(g, logits, 0) : NULL;
  CHECK(mm && mm->op == OP_MATMUL && mm->ia[0] == 0 && mm->ia[1] == 1 && in(g, mm, 1) == wte &&
            has_shape(in(g, mm, 0), 2, 512, 64, 0),
        "x @ wte.T: reshape to [B*T, C], matmul with b transposed, reshape back", "logits op %s",
        op_name(logits->op));
  CHECK(count_op(g, OP_PERMUTE) == 0, "no PERMUTE nodes for .T operands of @", "%d", count_op(g, OP_PERMUTE));
  const IrNode *att = NULL;
  for (int i = 0; i < g->n && !att; i++)
    if (g->nodes[i]->op == OP_ATTENTION)
      att = g->nodes[i];
  CHECK(att && att->ia[0] == 4 && att->ia[1] == 1 && att->ia[2] == 1 && att->nin == 4 && fabs(att->fa[0] - 0.25) < 1e-15 &&
            !strcmp(in(g, att, 3)->name, "doc") && !strcmp(in(g, att, 0)->name, "h.0.q"),
        "attention: heads, causal, doc input, default scale 1/sqrt(16)", "attention missing or wrong");

  DimOverride ov[] = {{"B", 2}, {"T", 8}};
  g = compile_any("models/gpt2-tiny.mdl", NULL, ov, 2, &errors);
  CHECK(g && dim(g, "B") == 2 && dim(g, "T") == 8 && has_shape(named(g, "tokens"), 2, 2, 8, 0) &&
            has_shape(g->nodes[g->outputs[0]], 3, 2, 8, 256),
        "-D B=2 -D T=8 override the train section", "B %lld", g ? (long long)dim(g, "B") : -1);
  DimOverride bad[] = {{"T", 129}};
  g = compile_any("models/gpt2-tiny.mdl", NULL, bad, 1, &errors);
  CHECK(!g && errors == 1 && strstr(errtext, "out of bounds 1..128"), "-D T=129 is out of bounds 1..maxT", "%s",
        errtext);
}

static void test_models(void) {
  struct {
    const char *path;
    int64_t params;
    int tensors;
  } models[] = {
      {"models/gpt2.mdl", 124439808, 148},
      {"models/llama-tiny.mdl", 131904, 21},
      {"models/mlp.mdl", 1732, 6},
  };
  for (int i = 0; i < 3; i++) {
    int errors;
    Graph *g = compile_any(models[i].path, NULL, NULL, 0, &errors);
    char name[128];
    snprintf(name, sizeof name, "%s: %lld parameters in %d tensors", models[i].path, (long long)models[i].params,
             models[i].tensors);
    CHECK(g && ir_param_count(g) == models[i].params && g->nparams == models[i].tensors && g->loss >= 0, name,
          "got %lld in %d", g ? (long long)ir_param_count(g) : -1, g ? g->nparams : -1);
  }
  Graph *g = compile("model m\ndim B in 1..8\ninput x: f32[B, 16]\ninput targets: i32[B]\n"
                     "param w: [16, 4] = zeros\noutput loss = mean(cross_entropy(x @ w, targets))\n"
                     "train {\n B = 4\n}\n");
  const IrNode *div = g ? g->nodes[g->loss] : NULL, *ce = div && div->op == OP_DIV ? in(g, in(g, div, 0), 0) : NULL;
  CHECK(ce && ce->op == OP_CROSS_ENTROPY && has_shape(ce, 1, 4, 0, 0) && in(g, div, 1)->op == OP_TARGET_COUNT,
        "cross_entropy: one loss per row, their mean over the counted targets", "%s", errtext);
  const TrainConfig *t = g ? &g->train : NULL;
  CHECK(t && t->lr == 3e-4 && t->beta1 == 0.9 && t->beta2 == 0.95 && t->eps == 1e-8 && t->weight_decay == 0 &&
            t->warmup == 0 && t->min_lr == 0 && t->clip == 0 && t->accumulate == 1 && t->steps == 0 &&
            t->schedule == SCHED_CONSTANT &&
            !strcmp(t->precision, "auto") && !strcmp(t->checkpoint, "auto"),
        "train settings default as documented", "lr %g precision %s", t ? t->lr : -1, t ? t->precision : "?");
  CHECK(g && named(g, "w")->init.decay, "without no_decay every param decays", "decay off");
}

// Only a whole-tensor mean of a cross-entropy counts targets: over an axis, a mean divides by the
// axis' length; a sum stays a sum, and the mean of anything else (a cross-entropy scaled) is plain.
static void test_counted_mean(void) {
  Graph *h = compile("model m\ninput x: f32[2, 3, 4]\ninput targets: i32[2, 3]\nparam w: [4, 5] = zeros\n"
                     "ce = cross_entropy(x @ w, targets)\nkept = mean(ce, keepdim=true)\nrows = mean(ce, axis=1)\n"
                     "total = sum(ce)\nscaled = mean(ce * 2.0)\noutput loss = mean(ce)\n");
  const IrNode *kept = h ? named(h, "kept") : NULL, *rows = h ? named(h, "rows") : NULL;
  const IrNode *div = kept ? in(h, kept, 0) : NULL;
  CHECK(div && has_shape(kept, 2, 1, 1, 0) && div->op == OP_DIV && in(h, div, 1)->op == OP_TARGET_COUNT &&
            has_shape(in(h, in(h, div, 0), 0), 1, 6, 0, 0),
        "mean(cross_entropy(...), keepdim=true): over the counted targets, shaped [1, 1]", "%s", errtext);
  CHECK(rows && rows->op == OP_MEAN && rows->ia[0] == 1 && has_shape(rows, 1, 2, 0, 0),
        "mean(cross_entropy(...), axis=1) is a mean over the axis", "%s", errtext);
  CHECK(h && named(h, "total")->op == OP_SUM && named(h, "scaled")->op == OP_MEAN,
        "sum(cross_entropy(...)) and mean(cross_entropy(...) * 2.0) count every position", "%s", errtext);
  int counts = 0;
  for (int i = 0; h && i < h->n; i++)
    counts += h->nodes[i]->op == OP_TARGET_COUNT;
  CHECK(counts == 2, "target_count: one per counted mean", "%d", counts);
}

static void test_names_and_repeat(void) {
  Graph *g = compile("model m\ninput a: f32[4]\nx = a * 2\nx = x + 1\noutput y = x\n");
  const IrNode *y = g ? g->nodes[g->outputs[0]] : NULL;
  CHECK(y && y->op == OP_ADD && in(g, y, 0)->op == OP_MUL && in(g, in(g, y, 0), 1)->op == OP_CONST &&
            in(g, in(g, y, 0), 1)->fa[0] == 2 && in(g, y, 1)->fa[0] == 1,
        "assignment rebinds a value; scalars become CONST nodes", "wrong graph");
  CHECK(y && !strcmp(in(g, y, 0)->name, "x") && !strcmp(y->name, "y"), "nodes carry the names they were bound to",
        "names");

  g = compile("model m\ndim L = 3\ninput a: f32[2, 8]\nx = a\n"
              "repeat blk[L] {\n  param w: [8, 8] = normal(0.1)\n  t = x @ w\n  x = x + t\n}\noutput y = x\n");
  CHECK(g && g->nparams == 3 && !strcmp(g->nodes[g->params[2]]->name, "blk.2.w"), "repeat: one param per repetition",
        "nparams %d", g ? g->nparams : -1);
  // Loop-carried x: the output is repetition 2's add, whose first input is repetition 1's.
  y = g ? g->nodes[g->outputs[0]] : NULL;
  CHECK(y && y->op == OP_ADD && in(g, y, 0)->op == OP_ADD && in(g, in(g, y, 0), 0)->op == OP_ADD &&
            in(g, in(g, in(g, y, 0), 0), 0)->op == OP_INPUT,
        "repeat: an outer value assigned in the body is carried to the next repetition", "chain broken");
  CHECK(y && in(g, in(g, y, 1), 1) == g->nodes[g->params[2]] && !strcmp(in(g, y, 1)->name, "blk.2.t"),
        "repeat: params resolve to the current repetition's; locals named NAME.i.x", "wrong param");
  CHECK(errors_of("model m\ndim L = 2\ninput a: f32[4]\nrepeat h[L] {\n t = a\n}\ny = t\n") == 1,
        "repeat: values new in the body stay local to it", "%s", errtext);
  g = compile("model m\ndim L = 2\ninput a: f32[4]\nx = a\nrepeat h[L] {\n repeat g[2] {\n  param b: [4] = zeros\n"
              "  x = x + b\n }\n}\nrepeat e[0] {\n param z: [4] = zeros\n}\n");
  CHECK(g && g->nparams == 4 && !strcmp(g->nodes[g->params[3]]->name, "h.1.g.1.b"),
        "nested repeats name params h.i.g.j.x; zero repetitions add nothing", "nparams %d", g ? g->nparams : -1);
  g = compile("model m\ndim D = C / H\ndim C = 64\ndim H = 4\nconst s = 1 / sqrt(D)\nconst n = 2 * H\n"
              "input a: f32[n, D]\noutput y = a * s\n");
  CHECK(g && dim(g, "D") == 16 && has_shape(named(g, "a"), 2, 8, 16, 0) &&
            fabs(in(g, g->nodes[g->outputs[0]], 1)->fa[0] - 0.25) < 1e-15,
        "dims and consts are declarative; integer consts size shapes; float consts fold", "%s", errtext);
  g = compile("model m\ndim L = 3\ninput a: f32[2, 4]\nx = a\nrepeat h[L] as i {\n"
              " param w: [4, 4 * (i + 1)] = normal(0.02 / sqrt(2 * (i + 1)))\n"
              " x = x + sum(x @ w, axis=1, keepdim=true) * (i + 1)\n repeat k[2] as j {\n  x = x * (i * 2 + j)\n }\n}\n"
              "output y = x\n");
  const IrNode *w2 = g && g->nparams == 3 ? g->nodes[g->params[2]] : NULL;
  y = g ? g->nodes[g->outputs[0]] : NULL;
  CHECK(w2 && has_shape(w2, 2, 4, 12, 0) && fabs(w2->init.std - 0.02 / sqrt(6.0)) < 1e-15 && y->op == OP_MUL &&
            in(g, y, 1)->op == OP_CONST && in(g, y, 1)->fa[0] == 5,
        "repeat ... as i: the index sizes shapes, scales inits and enters arithmetic, nested indices too", "%s",
        errtext);
  g = compile("model m\ninput a: f32[-7 // 2 + 6, -7 % 2, 7 // -2 + 5, 7 % -2 + 2, 6 // 3]\n");
  CHECK(g && named(g, "a")->shape.rank == 5 && named(g, "a")->shape.d[0] == 2 && named(g, "a")->shape.d[1] == 1 &&
            named(g, "a")->shape.d[2] == 1 && named(g, "a")->shape.d[3] == 1 && named(g, "a")->shape.d[4] == 2,
        "// and % on integers round the quotient down; the remainder has the divisor's sign", "%s", errtext);
  g = compile("model m\ninput a: f32[abs(2 - 5), max(2, 4), min(7, 5), int(2.9), neg(-2)]\n");
  CHECK(g && named(g, "a")->shape.rank == 5 && named(g, "a")->shape.d[0] == 3 && named(g, "a")->shape.d[1] == 4 &&
            named(g, "a")->shape.d[2] == 5 && named(g, "a")->shape.d[3] == 2 && named(g, "a")->shape.d[4] == 2,
        "abs, neg, min, max and int of integers are integers (they may size a shape)", "%s", errtext);
  CHECK(errors_of("model m\ninput a: f32[4]\nrepeat h[2] as i {\n i = 1\n}\ny = a * i\n") == 2 &&
            strstr(errtext, "cannot assign to repeat index 'i'") &&
            strstr(errtext, "'i' is the index of repeat block 'h' and exists only inside its body"),
        "repeat index: assigning to it, or using it after the body, is an error", "%s", errtext);
  g = compile("model m; input a: f32[2,\n 3]; y = (a +\n a *\n 2)\n");
  CHECK(g && has_shape(named(g, "y"), 2, 2, 3, 0), "';' separates statements; newlines inside ( ) and [ ] do not",
        "%s", errtext);
  g = compile("model m # caf\xc3\xa9 in a comment is fine\ninput a: f32[2, 3]\ninput b: f32[3, 5]\n"
              "output y = -a @ b * 2 + 1\n");
  y = g ? g->nodes[g->outputs[0]] : NULL;
  CHECK(y && y->op == OP_ADD && in(g, y, 0)->op == OP_MUL && in(g, in(g, y, 0), 0)->op == OP_MATMUL &&
            in(g, in(g, in(g, y, 0), 0), 0)->op == OP_NEG,
        "precedence: unary -, then @, then *, then +", "wrong tree");
}

static void test_ops(void) {
  Graph *g = compile("model m\ninput x: f32[2, 6, 8]\n"
                     "a, b, c = split(x, 3, axis=1)\n"
                     "s1 = x[:, 0:4, 2]\n"
                     "s2 = x[1, -2:, :]\n"
                     "m1 = mean(x)\n"
                     "m2 = sum(x, axis=-1, keepdim=true)\n"
                     "m3 = max(x, axis=0)\n"
                     "m4 = sum(x, keepdim=true)\n"
                     "r = reshape(x, [-1, 4])\n"
                     "p = permute(x, [2, 0, 1])\n"
                     "t = transpose(x, 0, -1)\n"
                     "tt = x.T\n"
                     "cc = concat([a, b, c], axis=1)\n"
                     "sm = softmax(x)\n"
                     "d1 = dropout(x, p=0.25)\n"
                     "d2 = dropout(x)\n"
                     "g = gelu(x) + relu(x) + silu(x) + exp(x) + log(x) + tanh(x) + sqrt(x) + rsqrt(x) + neg(x)\n");
  CHECK(g != NULL, "every op compiles", "%s", errtext);
  if (!g)
    return;
  const IrNode *a = named(g, "a"), *c = named(g, "c");
  CHECK(has_shape(a, 3, 2, 2, 8) && a->op == OP_SLICE && a->ia[0] == 1 && c->ia[1] == 4 && c->ia[2] == 6,
        "split(x, 3, axis=1): equal SLICEs", "a %s", a ? op_name(a->op) : "missing");
  const IrNode *s1 = named(g, "s1");
  CHECK(has_shape(s1, 2, 2, 4, 0) && s1->op == OP_RESHAPE && in(g, s1, 0)->op == OP_SLICE &&
            in(g, s1, 0)->ia[0] == 2 && in(g, s1, 0)->ia[1] == 2 && in(g, in(g, s1, 0), 0)->op == OP_SLICE,
        "x[:, 0:4, 2]: slices, then a reshape drops the indexed axis", "shape");
  const IrNode *s2 = named(g, "s2");
  CHECK(has_shape(s2, 2, 2, 8, 0) && in(g, s2, 0)->ia[1] == 4 && in(g, s2, 0)->ia[2] == 6,
        "x[1, -2:, :]: negative bounds count from the end", "shape");
  const IrNode *m1 = named(g, "m1");
  CHECK(m1 && m1->op == OP_MEAN && m1->shape.rank == 0 && m1->ia[0] == 0 && has_shape(in(g, m1, 0), 1, 96, 0, 0),
        "mean(x): reshape to [numel], reduce axis 0 to a scalar", "m1");
  CHECK(has_shape(named(g, "m2"), 3, 2, 6, 1) && named(g, "m2")->ia[0] == 2 && named(g, "m2")->ia[1] == 1,
        "sum(x, axis=-1, keepdim=true)", "m2");
  CHECK(has_shape(named(g, "m3"), 2, 6, 8, 0) && named(g, "m3")->op == OP_MAX, "max(x, axis=0)", "m3");
  CHECK(has_shape(named(g, "m4"), 3, 1, 1, 1) && in(g, named(g, "m4"), 0)->op == OP_SUM,
        "sum(x, keepdim=true) keeps every axis as 1", "m4");
  CHECK(has_shape(named(g, "r"), 2, 24, 4, 0), "reshape(x, [-1, 4]) infers -1", "r");
  const IrNode *p = named(g, "p"), *t = named(g, "t"), *tt = named(g, "tt");
  CHECK(has_shape(p, 3, 8, 2, 6) && p->ia[0] == 2 && p->ia[1] == 0 && p->ia[2] == 1, "permute(x, [2, 0, 1])", "p");
  CHECK(has_shape(t, 3, 8, 6, 2) && t->op == OP_PERMUTE, "transpose(x, 0, -1)", "t");
  CHECK(has_shape(tt, 3, 2, 8, 6) && tt->op == OP_PERMUTE, "x.T outside @ is a PERMUTE of the last two axes", "tt");
  CHECK(tt && tt->ia[0] == 0 && tt->ia[1] == 2 && tt->ia[2] == 1 && zero_from(tt, 3),
        "x.T: the permutation [0, 2, 1], every slot past the rank 0", "ia %lld %lld %lld, then %s",
        tt ? (long long)tt->ia[0] : -1LL, tt ? (long long)tt->ia[1] : -1LL, tt ? (long long)tt->ia[2] : -1LL,
        tt && zero_from(tt, 3) ? "zeros" : "not zeros");
  CHECK(has_shape(named(g, "cc"), 3, 2, 6, 8) && named(g, "cc")->nin == 3 && named(g, "cc")->ia[0] == 1,
        "concat([a, b, c], axis=1)", "cc");
  CHECK(named(g, "sm") && named(g, "sm")->op == OP_SOFTMAX, "softmax over the last axis", "sm");
  const IrNode *d1 = named(g, "d1"), *d2 = named(g, "d2");
  CHECK(d1 && d2 && d1->ia[0] == 1 && d2->ia[0] == 2 && d1->fa[0] == 0.25 && d2->fa[0] == 0.1,
        "dropout: stream ids 1, 2, ...; p defaults to 0.1", "streams");
  int unary = 0;
  for (Op o = OP_NEG; o <= OP_SILU; o++)
    unary += o != OP_DROPOUT && count_op(g, o) == 1;
  CHECK(unary == 9, "the nine elementwise functions", "%d of 9", unary);

  g = compile("model m\ninput x: f32[2, 3]\noutput y = x[:, :]\n");
  CHECK(g && g->n == 1 && g->outputs[0] == 0, "x[:, :] adds no node", "%s", errtext);

  g = compile("model m\ninput x: f32[2, 4, 8]\ninput pos: i32[2, 4]\ninput ids: i32[2, 4]\n"
              "param w: [8] = ones\nparam tab: [10, 8] = zeros\n"
              "n1 = layernorm(x, w)\nn2 = rmsnorm(x, w, eps=1e-6)\n"
              "r = rope(x, pos, heads=2, base=500)\ne = embed(tab, ids)\n"
              "at = attention(x, x, x, heads=2, scale=0.5)\n");
  CHECK(g != NULL, "norms, rope, embed, attention compile", "%s", errtext);
  if (!g)
    return;
  const IrNode *n1 = named(g, "n1"), *n2 = named(g, "n2"), *r = named(g, "r"), *at = named(g, "at");
  CHECK(n1->op == OP_LAYERNORM && n1->fa[0] == 1e-5 && in(g, n1, 2)->op == OP_BROADCAST &&
            in(g, in(g, n1, 2), 0)->op == OP_CONST && in(g, in(g, n1, 2), 0)->fa[0] == 0,
        "layernorm(x, w): eps 1e-5 and a zero bias", "n1");
  CHECK(n2->op == OP_RMSNORM && n2->nin == 2 && n2->fa[0] == 1e-6, "rmsnorm(x, w, eps=1e-6)", "n2");
  CHECK(r->op == OP_ROPE && r->ia[0] == 2 && r->ia[1] == 0 && r->fa[0] == 500, "rope(x, pos, heads=2, base=500)",
        "r");
  CHECK(has_shape(named(g, "e"), 3, 2, 4, 8), "embed(table, ids) -> [..., C]", "e");
  CHECK(at->nin == 3 && at->ia[1] == 0 && at->ia[2] == 0 && at->fa[0] == 0.5,
        "attention without doc: not causal by default, explicit scale", "at");

  g = compile("model m\ninput x: f32[2, 3, 4]\ninput w: f32[5, 4]\ninput y: f32[2, 4, 3]\n"
              "a = x @ w.T\nb = x @ y\nc = (x * 2).T @ x\n");
  CHECK(g && has_shape(named(g, "a"), 3, 2, 3, 5) && named(g, "a")->op == OP_RESHAPE &&
            in(g, named(g, "a"), 0)->ia[1] == 1,
        "[2,3,4] @ w.T with w [5,4]: 2-D GEMM with b transposed", "%s", errtext);
  CHECK(g && has_shape(named(g, "b"), 3, 2, 3, 3) && named(g, "b")->op == OP_MATMUL, "batched matmul stays batched",
        "b");
  CHECK(g && named(g, "c")->op == OP_MATMUL && named(g, "c")->ia[0] == 1 && count_op(g, OP_PERMUTE) == 0,
        "(expr).T @ x: a transposed by the matmul's flag", "c");
  g = compile("model m\ninput x: f32[2]\noutput loss = mean(x)\ntrain {\n checkpoint = auto(2GiB)\n precision = fp8\n}\n");
  CHECK(g && !strcmp(g->train.checkpoint, "auto=2GiB") && !strcmp(g->train.precision, "fp8"),
        "checkpoint = auto(2GiB) -> \"auto=2GiB\"", "%s", g ? g->train.checkpoint : errtext);
}

static void test_errors(void) {
  int errors;
  CHECK(errors_of("model m\ninput x: f32[4]\ny = x + foo\nz = bar(x)\nw = x @ x\n") == 3,
        "three independent semantic errors are all reported", "%s", errtext);
  CHECK(errors_of("model m\ndim A = = 2\ninput x f32[4]\ny = (1 +)\n") == 3,
        "three syntax errors on three lines are all reported", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\nrepeat h[4] {\n y = x + nothere\n}\n") == 1,
        "an error inside a repeat body is reported once, not once per repetition", "%s", errtext);
  CHECK(errors_of("model m\ndim A = B\ndim B = C\ndim C = A\n") == 1 && strstr(errtext, "A -> B -> C -> A"),
        "a reference cycle is reported once with its path", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\ny = undefined\nz = y * 2 + y\n") == 1,
        "a failed value does not cascade into more errors", "%s", errtext);
  CHECK(errors_of("") == 1 && strstr(errtext, "empty file: no model"), "an empty text is an error", "%s", errtext);
  CHECK(errors_of("model m\ndim C = 4\ninput C: f32[2]\nparam C: [2] = zeros\nconst C = 1\n") == 3,
        "each redefinition of a name is reported", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\nrepeat h[2] {\n param w: [4] = zeros\n param w: [4] = ones\n}\n") == 1,
        "a param defined twice in one repeat body", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[2, 4]\na, b = split(x, 3)\n") == 1, "split must divide the axis", "%s",
        errtext);
  CHECK(errors_of("model m\ninput x: f32[2, 4]\ny = x[2]\nz = x[0:0]\nw = x[1, 2, 3]\n") == 3,
        "indices out of range, empty slices and too many indices", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[2, 4]\ny = softmax(x, axis=0)\nz = log_softmax(x, axis=-2)\n") == -1,
        "softmax and log_softmax over a non-last axis are accepted", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[2, 4]\ny = log_softmax(x, axis=2)\n") == 1 &&
            strstr(errtext, "axis 2 is out of range"),
        "log_softmax: an axis out of range is named", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[2, 3, 4]\ny = attention(x, x, x, heads=3)\n") == 1,
        "attention heads must divide C", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[2, 3]\ninput t: f32[2]\ny = cross_entropy(x, t)\n") == 1 &&
            strstr(errtext, "cross_entropy: targets must be i32, got f32"),
        "cross_entropy targets must be i32", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\ny = sum(x, axis=0, axis=0)\nz = sum(x, axes=0)\nq = sum(axis=0, x)\n") == 3,
        "repeated, unknown and misplaced keyword arguments", "%s", errtext);
  CHECK(errors_of("model m\ntrain {\n clip = -1\n accumulate = 0\n optimizer = rmsprop(lr=1)\n"
                  " schedule = cosine(warmup=1.5)\n no_decay = [\"a\", 3]\n checkpoint = auto(0GiB)\n"
                  " optimizer = adamw(beta1=1)\n}\n") == 7,
        "bad train values: each reported", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\ny = where(1 < 2, x, 0.0)\n") == 1 && strstr(errtext, "cond must be a tensor"),
        "where: a constant condition is refused", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\ninput z: f32[3]\ny = where(x > 0, x, z)\n") == 1 &&
            strstr(errtext, "where: cannot broadcast"),
        "where: shapes that do not broadcast are named", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\ny = x < x < x\n") == 1 && strstr(errtext, "syntax error"),
        "comparisons do not chain", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\ny = (x > 0) + (true == 1)\n") == 1 &&
            strstr(errtext, "'==' compares numbers and tensors, not booleans"),
        "a comparison of a boolean is refused, spelled as written", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\ny = clamp(x)\nz = clamp(x, min=1, max=0)\n") == 2 &&
            strstr(errtext, "give min=, max= or both") && strstr(errtext, "min 1 is above max 0"),
        "clamp: without bounds, or with min above max", "%s", errtext);
  CHECK(errors_of("model m\ntrain {\n schedule = step(gamma=0.1)\n}\n") == 1 &&
            strstr(errtext, "unknown schedule 'step' (available: constant, linear, cosine or wsd)"),
        "an unknown schedule is named, with the schedules there are", "%s", errtext);
  CHECK(errors_of("model m\ntrain {\n schedule = wsd(decay=1.5)\n}\n") == 1 &&
            strstr(errtext, "decay must be a number of steps (an integer) or a fraction"),
        "wsd: a decay of 1.5 is neither steps nor a fraction", "%s", errtext);
  CHECK(errors_of("model m\ntrain {\n schedule = constant(min_lr=0.1)\n}\n") == 1,
        "constant takes no min_lr", "%s", errtext);
  CHECK(errors_of("model m\ndim B in 1..4\ninput x: f32[B]\n") == 1 && strstr(errtext, "-D B=N"),
        "an unbound free dim is an error", "%s", errtext);
  DimOverride ov[] = {{"B", 3}, {"Q", 1}};
  Graph *g = compile_ov("model m\ndim B in 1..4\ninput x: f32[B]\n", ov, 1, &errors);
  CHECK(g && has_shape(named(g, "x"), 1, 3, 0, 0), "-D binds a free dim", "%s", errtext);
  g = compile_ov("model m\ndim B in 1..4\ninput x: f32[B]\n", ov, 2, &errors);
  CHECK(!g && errors == 1 && strstr(errtext, "no dim 'Q'"), "-D of an unknown dim is an error", "%s", errtext);
  CHECK(errors_of("model m\ndim A = 9223372036854775807\ndim B = A + 1\n") == 1, "integer overflow is caught", "%s",
        errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\noutput loss = x\n") == 1, "a non-scalar loss is an error", "%s",
        errtext);
  CHECK(errors_of("model m\ndim L = 2\nrepeat h[L] {\n input z: f32[2]\n output o = z\n}\n") == 2,
        "inputs and outputs are not allowed in repeat bodies", "%s", errtext);
  CHECK(errors_of("model m\nrepeat h[2] {\n param w: [2] = zeros\n") == 1 && strstr(errtext, "unterminated block"),
        "an unclosed block is one error", "%s", errtext);
}

// A text made of a head, `n` copies of `unit` and a tail, in the arena (freed by the next compile).
static char *repeated(const char *head, const char *unit, int n, const char *tail) {
  size_t hl = strlen(head), ul = strlen(unit), tl = strlen(tail);
  char *t = malloc(hl + ul * (size_t)n + tl + 1), *q = t;
  memcpy(q, head, hl);
  q += hl;
  for (int i = 0; i < n; i++, q += ul)
    memcpy(q, unit, ul);
  memcpy(q, tail, tl + 1);
  return t;
}

// How many "error:" lines the last compile printed.
static int printed_errors(void) {
  int n = 0;
  for (const char *q = errtext; (q = strstr(q, ": error: ")); q++)
    n++;
  return n;
}

// Compiles a generated text and frees it; the number of errors as errors_of.
static int errors_of_owned(char *text) {
  int n = errors_of(text);
  free(text);
  return n;
}

static void test_error_volume(void) {
  // 5000 unclosed braces: one syntax error, not one "never closed" per brace.
  CHECK(errors_of_owned(repeated("model m\n", "{", 5000, "\n")) == 1 && printed_errors() == 1,
        "5000 stray '{': one error", "%d printed", printed_errors());
  CHECK(errors_of("model m\ninput x: f32[4]\nrepeat a[2] {\n repeat b[2] {\n  repeat c[2] {\n   y = x\n") == 1 &&
            strstr(errtext, "nor are the 2 after it"),
        "three nested blocks never closed: one error at the outermost", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\nrepeat h[2] {\n y = = x {\n  z = 1\n }\n w = x\n}\noutput o = x\n") == 1,
        "a bad statement holding braces is skipped whole: one error", "%s", errtext);
  // More than DIAG_MAX_ERRORS mistakes: 20 printed, then "too many errors", then nothing.
  int errors = errors_of_owned(repeated("model m\ninput x: f32[4]\n", "y = x + nope\n", 40, ""));
  CHECK(errors > DIAG_MAX_ERRORS && printed_errors() == DIAG_MAX_ERRORS + 1 &&
            strstr(errtext, "too many errors (more than 20); stopping here"),
        "semantic errors stop after 20 with 'too many errors'", "%d errors, %d printed", errors, printed_errors());
  errors = errors_of_owned(repeated("model m\n", "dim = = 1\n", 5000, ""));
  CHECK(errors > DIAG_MAX_ERRORS && printed_errors() == DIAG_MAX_ERRORS + 1 && strlen(errtext) < 4096,
        "5000 syntax errors print 21 errors", "%d printed, %zu bytes", printed_errors(), strlen(errtext));
  // 16 copies of a model with 640 bytes changed at random (a fixed seed): bounded output.
  FILE *f = fopen("models/gpt2.mdl", "rb");
  char model[4096];
  size_t len = f ? fread(model, 1, sizeof model - 1, f) : 0;
  if (f)
    fclose(f);
  model[len] = 0;
  char *mutated = repeated("", model, 16, "");
  size_t n = strlen(mutated);
  uint64_t r = 12345;
  static const char noise[] = "{}()[]=+-*@:,;\nxL0 ";
  for (int i = 0; i < 640 && n > 0; i++) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    mutated[(r >> 33) % n] = noise[(r >> 13) % (sizeof noise - 1)];
  }
  errors = errors_of_owned(mutated);
  CHECK(n > 30000 && errors > 0 && printed_errors() <= DIAG_MAX_ERRORS + 1 && strlen(errtext) < 16384,
        "a 30 KB mutated model prints at most 21 errors", "%zu bytes in, %d errors, %zu bytes out", n,
        printed_errors(), strlen(errtext));
  // A long line is shown as a window around the caret, not whole.
  errors = errors_of_owned(repeated("model m\ninput x: f32[4]\ny = nope", "; z = x", 3000, "\n"));
  CHECK(errors == 1 && strlen(errtext) < 512 && strstr(errtext, "    3 | y = nope; z = x") && strstr(errtext, "x...\n"),
        "an error on a 20 KB line shows 120 bytes of it", "%zu bytes: %.300s", strlen(errtext), errtext);
}

static void test_limits(void) {
  // Nesting: the scanner's limit on ( [ {, the parser's stack, and the evaluator's depth.
  CHECK(errors_of_owned(repeated("model m\ny = ", "(", 10000, "1\n")) == 1 &&
            strstr(errtext, "t.mdl:2:261: error: nesting too deep: more than 256 levels") && !strstr(errtext, "memory"),
        "10000 nested '(': 'nesting too deep' at the 257th", "%.200s", errtext);
  CHECK(errors_of_owned(repeated("model m\ninput x: f32[2]\n", "repeat h[1] {\n", 5000, "")) == 1 &&
            strstr(errtext, "nesting too deep"),
        "5000 nested repeat blocks: one 'nesting too deep'", "%.200s", errtext);
  CHECK(errors_of_owned(repeated("model m\ndim A = ", "-", 20000, "1\n")) == 1 &&
            strstr(errtext, "nesting too deep: more than 10000 levels of the parser's stack") && !strstr(errtext, "memory"),
        "20000 unary '-': 'nesting too deep', not bison's 'memory exhausted'", "%.200s", errtext);
  CHECK(errors_of_owned(repeated("model m\ndim A = 1", " + 1", 200000, "\n")) == 1 &&
            strstr(errtext, "more than 1000 levels of expressions"),
        "a chain of 200000 additions is an error, not a stack overflow", "%.200s", errtext);
  Graph *g;
  char *chain = malloc(20 * 10000 + 64), *q = chain;
  q += sprintf(q, "model m\n");
  for (int i = 0; i < 10000; i++)
    q += sprintf(q, "dim A%d = A%d\n", i, i + 1);
  sprintf(q, "dim A10000 = 1\n");
  CHECK(errors_of_owned(chain) == 1 && strstr(errtext, "more than 1000 levels"),
        "10000 dims each naming the next: one error, not a stack overflow", "%.200s", errtext);
  CHECK(errors_of_owned(repeated("model m\ndim A = ", "-", 900, "1\n")) == -1, "900 unary '-' still compile", "%.200s",
        errtext);
  // Names are hashed: 50000 top-level dims (77 s when each lookup was a linear search), and the
  // duplicate of an early one still found, with its first definition.
  char *many = malloc(24 * 50000 + 64);
  q = many + sprintf(many, "model m\n");
  for (int i = 0; i < 50000; i++)
    q += sprintf(q, "dim A%d = %d\n", i, i + 1);
  g = compile(many);
  CHECK(g && g->ndims == 50000 && dim(g, "A49999") == 50000 && dim(g, "A7") == 8, "50000 dims, each with its value",
        "%s", errtext);
  sprintf(q, "input x: f32[A49999]\ndim A7 = 3\n");
  CHECK(errors_of_owned(many) == 1 && strstr(errtext, "t.mdl:50003:5: error: duplicate definition of 'A7'") &&
            strstr(errtext, "t.mdl:9:5: note: previous definition is here"),
        "a duplicate among 50000 dims is found, with its first definition", "%.300s", errtext);

  // Unrolling: a repeat count whose unrolled body would pass a limit is refused after one copy.
  CHECK(errors_of("model m\ndim L = 4000000000\ninput x: f32[2, 8]\ny = x\n"
                  "repeat h[L] {\n param w: [8, 8] = zeros\n y = y @ w\n}\n") == 1 &&
            strstr(errtext, "L = 4000000000 repetitions would build 8000000001 graph nodes") &&
            strstr(errtext, "the limit is 262144") && strstr(errtext, "'L' is defined here"),
        "repeat h[L] with L = 4000000000: an error naming L and the limit", "%s", errtext);
  CHECK(errors_of("model m\ndim L = 100000\ninput x: f32[2, 8]\ny = x\n"
                  "repeat h[L] {\n param w: [8, 8] = zeros\n y = relu(y @ w) + y\n}\n") == 1 &&
            strstr(errtext, "L = 100000 repetitions would build 400001 graph nodes (4 per repetition)"),
        "repeat h[L] with L = 100000 layers: too many graph nodes", "%s", errtext);
  CHECK(errors_of("model m\nrepeat h[100000000] {\n}\n") == 1 && strstr(errtext, "would run 100000002 statements"),
        "an empty body repeated 10^8 times: too many statements", "%s", errtext);
  CHECK(errors_of("model m\nrepeat h[70000] {\n param w: [1] = zeros\n}\n") == 1 &&
            strstr(errtext, "70000 parameter tensors"),
        "70000 parameter tensors: too many", "%s", errtext);
  CHECK(errors_of("model m\nrepeat h[200] {\n param w: [65536, 262144] = zeros\n}\n") == 1 &&
            strstr(errtext, "bytes of f32 parameters"),
        "200 params of 2^34 elements: too many parameter bytes", "%s", errtext);
  CHECK(errors_of("model m\ninput x: f32[4]\nrepeat a[1000] {\n repeat b[1000] {\n  param w: [4] = zeros\n }\n}\n") == 1 &&
            strstr(errtext, "repeat a[1000]"),
        "nested repeats: the outer one is refused after its first repetition", "%s", errtext);
  g = compile("model m\nrepeat h[20000] {\n param w: [2] = zeros\n}\n");
  bool ordered = g && g->nparams == 20000;
  for (int i = 0; ordered && i < g->nparams; i++)
    ordered = g->params[i] == i && g->nodes[i]->op == OP_PARAM;
  CHECK(ordered && !strcmp(g->nodes[g->params[19999]]->name, "h.19999.w"),
        "20000 params in a repeat, in order (the param list grows by doubling)", "nparams %d", g ? g->nparams : -1);

  // Sizes: every tensor within 2^36 elements, so no later product of sizes overflows.
  CHECK(errors_of("model m\ndim V = 2147483648\ndim C = 1073741824\nparam wte: [V, C] = zeros\n") == 1 &&
            strstr(errtext, "t.mdl:4:12: error: param 'wte': shape [2147483648,1073741824] has 2305843009213693952 elements"),
        "V = 2^31, C = 2^30: an error at the param's declaration", "%s", errtext);
  CHECK(errors_of("model m\ndim N = 4294967296\ninput x: f32[N, N, N]\n") == 1 && strstr(errtext, "more than 2^63 elements"),
        "a shape whose element count overflows 64 bits", "%s", errtext);
  CHECK(errors_of("model m\ninput a: f32[524288, 1]\ninput b: f32[1, 262144]\ny = a * b\n") == 1 &&
            strstr(errtext, "t.mdl:4:7: error: mul: the result [524288,262144] has 137438953472 elements"),
        "a broadcast result with 2^37 elements: an error at the op", "%s", errtext);
  CHECK(errors_of("model m\ninput a: f32[262144, 1]\ninput b: f32[1, 262144]\ny = a * b\n") == -1,
        "a result of 2^36 elements compiles", "%s", errtext);
  DimOverride big[] = {{"B", 1ll << 40}};
  int errors;
  g = compile_ov("model m\ndim B in 1..1099511627776\ninput x: f32[B, 1024]\n", big, 1, &errors);
  CHECK(!g && errors == 1 && strstr(errtext, "input 'x': shape [1099511627776,1024]"),
        "-D B=2^40 is checked like any dim", "%s", errtext);

  // Encoding errors have a line and a column, like every other.
  char path[] = "/tmp/mdl-test-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0 && write(fd, "model m\nin\0put x: f32[4]\n", 25) == 25, "a temporary file", "cannot write %s", path);
  close(fd);
  g = compile_any(path, NULL, NULL, 0, &errors);
  CHECK(!g && errors == 1 && strstr(errtext, ":2:3: error: NUL byte (offset 10): not a text file\n    2 | in\n      |   ^"),
        "a NUL byte: file:line:col, the line up to it and a caret", "%s", errtext);
  unlink(path);
  g = compile_ov("model m\ninput x: f32[4]\ny = x # caf\xe9\n", NULL, 0, &errors);
  CHECK(!g && errors == 1 && strstr(errtext, "t.mdl:3:12: error: invalid UTF-8 (byte 0xe9 at offset 35)"),
        "invalid UTF-8: file:line:col", "%s", errtext);
}

// The lowering options: plain attention is MATMULs, a SOFTMAX and one ATTENTION_MASK per distinct mask;
// its shape errors are the fused op's, word for word; --no-doc-mask drops the doc input of either
// lowering but still checks it.
static void test_lowering(void) {
  static const char text[] = "model m\n"
                             "input x: f32[2, 6, 8]\n"
                             "input d: i32[2, 6]\n"
                             "y = attention(x, x, x, heads=2, causal=true, doc=d)\n"
                             "z = attention(y, y, y, heads=2, causal=true, doc=d)\n"
                             "w = attention(z, z, z, heads=4)\n";
  LowerOptions plain = {.plain_attention = true}, nodoc = {.no_doc_mask = true},
               both = {.plain_attention = true, .no_doc_mask = true};
  lowering = &plain;
  Graph *g = compile(text);
  const IrNode *m = NULL, *y = g ? named(g, "y") : NULL, *w = g ? named(g, "w") : NULL;
  for (int i = 0; g && i < g->n; i++)
    if (g->nodes[i]->op == OP_ATTENTION_MASK)
      m = g->nodes[i];
  CHECK(g && count_op(g, OP_ATTENTION) == 0 && count_op(g, OP_MATMUL) == 6 && count_op(g, OP_SOFTMAX) == 3 &&
            count_op(g, OP_ATTENTION_MASK) == 1 && m && m->ia[0] == 1 && m->ia[1] == 1 && !strcmp(in(g, m, 0)->name, "d") &&
            shape_eq(m->shape, shape_of(4, (int64_t[]){2, 1, 6, 6})) && m->body == 0 && y && y->op == OP_RESHAPE && has_shape(y, 3, 2, 6, 8) && w &&
            has_shape(w, 3, 2, 6, 8),
        "plain attention: two GEMMs and a softmax each, one mask [B,1,T,T] for the two causal ones within documents",
        "%d attention, %d matmul, %d softmax, %d masks", g ? count_op(g, OP_ATTENTION) : -1,
        g ? count_op(g, OP_MATMUL) : -1, g ? count_op(g, OP_SOFTMAX) : -1, g ? count_op(g, OP_ATTENTION_MASK) : -1);
  static const char bad[] = "model m\ninput x: f32[2, 3, 4]\ny = attention(x, x, x, heads=3)\n";
  lowering = NULL;
  static char fused[sizeof errtext];
  snprintf(fused, sizeof fused, "%s", errors_of(bad) == 1 ? errtext : "");
  lowering = &plain;
  CHECK(errors_of(bad) == 1 && fused[0] && !strcmp(errtext, fused), "plain attention: the fused op's error, word for word",
        "%s vs %s", errtext, fused);
  for (int k = 0; k < 2; k++) {
    lowering = k ? &both : &nodoc;
    g = compile(text);
    int doc_readers = 0;
    for (int i = 0; g && i < g->n; i++)
      for (int j = 0; j < g->nodes[i]->nin; j++)
        doc_readers += in(g, g->nodes[i], j)->op == OP_INPUT && !strcmp(in(g, g->nodes[i], j)->name, "d");
    const IrNode *a = NULL;
    for (int i = 0; g && i < g->n && !a; i++)
      if (g->nodes[i]->op == (k ? OP_ATTENTION_MASK : OP_ATTENTION))
        a = g->nodes[i];
    CHECK(g && a && doc_readers == 0 && (k ? a->ia[1] == 0 && shape_eq(a->shape, shape_of(4, (int64_t[]){1, 1, 6, 6})) : a->nin == 3 && a->ia[2] == 0),
          k ? "--no-doc-mask, plain: a causal mask [1,1,T,T] without the doc ids"
            : "--no-doc-mask: attention without its doc input",
          "%d readers of the doc ids", doc_readers);
    CHECK(errors_of("model m\ninput x: f32[2, 6, 8]\ninput d: f32[2, 6]\ny = attention(x, x, x, heads=2, doc=d)\n") ==
              1,
          k ? "--no-doc-mask, plain: doc= is still checked" : "--no-doc-mask: doc= is still checked", "%s", errtext);
  }
  lowering = NULL;
}

// --set KEY=VALUE (LowerOptions.settings): over the train section's settings, dims and the optimizer's
// and schedule's arguments, checked as the train section is, errors at "--set" with the text quoted.
static Graph *compile_set(const char *text, const char *const *set, int n, int *errors) {
  LowerOptions lo = {.settings = set, .nsettings = n};
  lowering = &lo;
  Graph *g = compile_ov(text, NULL, 0, errors);
  lowering = NULL;
  return g;
}

static void test_set(void) {
  static const char text[] = "model m\n"
                             "dim B in 1..64\n"
                             "input x: f32[B, 4]\n"
                             "param w: [4] = ones\n"
                             "output loss = mean(x * w)\n"
                             "train {\n"
                             " B = 8\n"
                             " optimizer = adamw(lr=1e-3, beta2=0.99)\n"
                             " schedule = cosine(warmup=10, min_lr=1e-4, steps=100)\n"
                             " clip = 1.0\n"
                             "}\n";
  int errors;
  const char *over[] = {"lr=3e-3", "warmup=5", "clip=0.5", "B=16", "precision=fp32", "weight_decay=0.2"};
  Graph *g = compile_set(text, over, 6, &errors);
  const TrainConfig *t = g ? &g->train : NULL;
  CHECK(t && t->lr == 3e-3 && t->beta2 == 0.99 && t->weight_decay == 0.2 && t->schedule == SCHED_COSINE &&
            t->warmup == 5 && t->min_lr == 1e-4 && t->steps == 100 && t->clip == 0.5 && dim(g, "B") == 16 &&
            !strcmp(t->precision, "fp32"),
        "--set replaces settings, dims and single arguments, keeping the train section's other arguments",
        "%s lr %g beta2 %g wd %g warmup %lld clip %g B %lld", errtext, t ? t->lr : 0, t ? t->beta2 : 0,
        t ? t->weight_decay : 0, t ? (long long)t->warmup : 0, t ? t->clip : 0, g ? (long long)dim(g, "B") : 0);

  const char *later[] = {"lr=1", "optimizer=adamw(beta1=0.8)", "lr=2e-3", "schedule=constant", "warmup=3"};
  g = compile_set(text, later, 5, &errors);
  t = g ? &g->train : NULL;
  CHECK(t && t->lr == 2e-3 && t->beta1 == 0.8 && t->beta2 == 0.95 && t->schedule == SCHED_CONSTANT && t->warmup == 3,
        "--set applies in order: a whole optimizer replaces the earlier one, a later argument joins it",
        "%s lr %g beta1 %g beta2 %g", errtext, t ? t->lr : 0, t ? t->beta1 : 0, t ? t->beta2 : 0);

  static const char bare[] = "model m\ninput x: f32[2]\nparam w: [2] = ones\noutput loss = mean(x * w)\n";
  const char *none[] = {"lr=0.25", "warmup=7"};
  g = compile_set(bare, none, 2, &errors);
  t = g ? &g->train : NULL;
  CHECK(t && t->lr == 0.25 && t->schedule == SCHED_CONSTANT && t->warmup == 7,
        "--set of an argument with no train section: adamw's and the constant schedule's", "%s", errtext);

  const char *bad[] = {"lr=-1", "min_lr=x", "clip=2", "precision=fp16", "B=0", "a b=1"};
  g = compile_set(text, bad, 6, &errors);
  CHECK(!g && errors == 5 && strstr(errtext, "--set:1:4: error: lr must be positive, got -1\n    1 | lr=-1\n") &&
            strstr(errtext, "--set:1:8: error: 'x' is ") && strstr(errtext, "--set:1:11: error: unknown precision 'fp16'") &&
            strstr(errtext, "--set:1:3: error: dim 'B' = 0 is out of bounds 1..64") &&
            strstr(errtext, "--set:1:3: error: syntax error"),
        "a bad --set value is an error at --set, quoting it, each one reported", "%d errors:\n%s", errors, errtext);
  const char *unknown[] = {"decay=3", "C=4"};
  g = compile_set(text, unknown, 2, &errors);
  CHECK(!g && errors == 2 &&
            strstr(errtext, "--set:1:1: error: cosine: unknown keyword argument 'decay' (cosine takes warmup, "
                            "min_lr, steps)") &&
            strstr(errtext, "--set:1:1: error: adamw: unknown keyword argument 'C' (adamw takes lr, beta1"),
        "--set of an argument the optimizer or schedule does not take names what they take", "%d errors:\n%s", errors,
        errtext);

  const char *fixed[] = {"x=1", "w=2"};
  static const char dims[] = "model m\ndim C = 4\ninput x: f32[C]\nparam w: [C] = ones\noutput loss = mean(x * w)\n";
  const char *c4[] = {"C=8"};
  g = compile_set(dims, c4, 1, &errors);
  CHECK(!g && errors == 1 && strstr(errtext, "--set:1:1: error: 'C' is a fixed dim; only free dims (dim C in "
                                             "LO..HI) are set with --set"),
        "--set of a fixed dim is refused", "%s", errtext);
  g = compile_set(dims, fixed, 2, &errors);
  CHECK(!g && errors == 2 && strstr(errtext, "adamw: unknown keyword argument 'x'"),
        "--set of a name that is no setting, dim or argument is refused", "%s", errtext);
  const char *twice[] = {"clip=1 ; lr=2"};
  g = compile_set(dims, twice, 1, &errors);
  CHECK(!g && errors == 1 && strstr(errtext, "--set wants KEY=VALUE"), "--set takes one setting", "%s", errtext);
}

int main(void) {
  arena = arena_new();
  test_gpt2_tiny();
  test_models();
  test_names_and_repeat();
  test_ops();
  test_counted_mean();
  test_errors();
  test_error_volume();
  test_limits();
  test_lowering();
  test_set();
  arena_free(arena);
  TEST_EXIT();
}
