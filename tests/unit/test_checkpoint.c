// test_checkpoint.c: the checkpoint pass (checkpoint.c). A recomputed value is a clone of its forward
// node, run by the same kernels on the same inputs, so a rewritten graph must train bit for bit as
// none's does; that is what most checks here compare, with memcmp, never with a tolerance.
//  1. gpt2-tiny, llama-tiny and the MLP, fp32 and bf16, on the C back end (fused): none, all and auto
//     with three budgets strictly between all's planned peak and none's (the MLP has no repeat body,
//     so all recomputes nothing and there is nothing between the two) run one step from the same
//     parameters (seed 7) and batch; the loss and every gradient are bit-identical to none's, and so
//     are the parameters after 2 steps. all recomputes values of gpt2-tiny and llama-tiny and plans a
//     smaller arena than none; the arena the back end plans for a rewritten graph is the peak the pass
//     reported.
//  2. The emulated CUDA kernels (tests/unit/cuda_emu_driver.cpp, as test_cuda_emit.c runs them) on
//     gpt2-tiny and llama-tiny, fp32 and bf16: none, all and one auto budget, the loss, every
//     gradient and the parameters after the step bit-identical to none's; all's module compiles with NVRTC where there
//     is one. The GEMMs run outside the module, as a GPU's GEMM library runs them, epilogues (bias,
//     GELU) included: a GELU the forward's GEMM applies in its epilogue and the backward recomputes
//     with one of the module's kernels is computed by two implementations, here as on a GPU
//     (cuBLASLt's epilogue and the module's kernel).
//  3. Dropout inside a repeat body: all recomputes the masked values in the backward (DROPOUT clones
//     that keep their seed ids), and none and all give bit-identical losses and gradients with the same
//     seed, while another seed changes the gradients (the masks are live).
//  4. gpt2-tiny, fp32 and bf16: auto under 9 budgets from none's peak down to all's plans within each
//     budget, and the planned peak never grows as the budget shrinks.
//  5. A budget one byte under all's peak: the pass fails, reports all's peak as the smallest budget
//     there is, and says what takes the memory (naming the parameters).
//  6. The forward is left as it is: after the pass the first fwd_end nodes have the ops and inputs
//     they had before it (every graph built above).
//  7. The optimizer per parameter (--optimizer-per-param, rule 1 of fuse.c), checked with the same
//     runs: gpt2-tiny and llama-tiny, fp32 and bf16, plan one optimizer step per parameter after the
//     gradient norm's, keep the parameters' bf16 copies, and train 2 steps (C back end) and 1 step
//     (emulated CUDA kernels) bit for bit as the one fused optimizer step does.
//  8. Which values auto recomputes: on a model whose layers save a tanh, a gelu and a GEMM output of
//     one size, under 25 budgets from none's peak down to all's, never a value ranked above one it
//     keeps by the documented rule (elementwise before GEMM outputs, then FLOPs per byte, worked out
//     from the shapes), with budgets where the costliest-first order would choose other values.
#include "mdl.h"
#include "backend.h"
#include "cuda.h"
#include "emit_c.h"
#include "emit_cuda.h"
#include "test.h"
#include "harness.h"
#include "cuda_emu_host.h"

#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// A gpt2-like model whose layers drop out the attention's projection and the MLP's hidden values;
// the latter is a saved value (the input of the down projection's weight gradient) inside the body,
// so all recomputes its dropout in the backward.
static const char dropout_model[] =
    "model drop\n"
    "dim B = 2\n"
    "dim T = 8\n"
    "dim C = 32\n"
    "dim H = 2\n"
    "dim L = 2\n"
    "dim V = 256\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input pos: i32[B, T]\n"
    "param wte: [V, C] = normal(0.5)\n"
    "param wpe: [T, C] = normal(0.1)\n"
    "x = embed(wte, tokens) + embed(wpe, pos)\n"
    "repeat h[L] {\n"
    "    param ln1_w: [C] = ones\n"
    "    param ln1_b: [C] = zeros\n"
    "    param attn_w: [C, 3*C] = normal(0.2)\n"
    "    param proj_w: [C, C] = normal(0.2)\n"
    "    param ln2_w: [C] = ones\n"
    "    param fc_w: [C, 4*C] = normal(0.2)\n"
    "    param fcproj_w: [4*C, C] = normal(0.1)\n"
    "    q, k, v = split(layernorm(x, ln1_w, ln1_b) @ attn_w, 3, axis=-1)\n"
    "    x = x + dropout(attention(q, k, v, heads=H, causal=true) @ proj_w, p=0.1)\n"
    "    x = x + dropout(gelu(layernorm(x, ln2_w) @ fc_w), p=0.1) @ fcproj_w\n"
    "}\n"
    "param head: [C, V] = normal(0.2)\n"
    "output loss = mean(cross_entropy(x @ head, targets))\n";

// The options mdlc fuses with; the pass measures its choices with the same ones. (Check 7 sets
// optimizer_per_param for its runs.)
static FuseOptions FO = {.fuse = true, .chunk_lmhead = true, .max_group = 64};
static const double LR = 2e-3;

static double mb(int64_t bytes) { return (double)bytes / 1e6; }

// The forward's ops and inputs, to compare before and after the pass.
typedef struct {
  int fwd_end;
  int *ops;  // per forward node
  int **ins; // per forward node: nin, then the inputs
} Forward;

static Forward forward_of(const Graph *g) {
  Forward fw = {.fwd_end = g->fwd_end};
  fw.ops = malloc(sizeof *fw.ops * (size_t)(g->fwd_end + 1));
  fw.ins = malloc(sizeof *fw.ins * (size_t)(g->fwd_end + 1));
  for (int i = 0; i < g->fwd_end; i++) {
    const IrNode *n = g->nodes[i];
    fw.ops[i] = n->op;
    fw.ins[i] = malloc(sizeof(int) * (size_t)(n->nin + 1));
    fw.ins[i][0] = n->nin;
    memcpy(fw.ins[i] + 1, n->in, sizeof(int) * (size_t)n->nin);
  }
  return fw;
}

// The first forward node of g that differs from fw (its op or inputs), fw.fwd_end when none does,
// -1 when g's forward is not as long.
static int forward_differs(const Forward *fw, const Graph *g) {
  if (g->fwd_end != fw->fwd_end)
    return -1;
  for (int i = 0; i < fw->fwd_end; i++) {
    const IrNode *n = g->nodes[i];
    if ((int)n->op != fw->ops[i] || n->nin != fw->ins[i][0] ||
        memcmp(n->in, fw->ins[i] + 1, sizeof(int) * (size_t)n->nin))
      return i;
  }
  return fw->fwd_end;
}

static void forward_free(Forward *fw) {
  for (int i = 0; i < fw->fwd_end; i++)
    free(fw->ins[i]);
  free(fw->ins);
  free(fw->ops);
}

static bool place(Graph *g, const char *policy, int64_t budget, char *why, size_t n) {
  return checkpoint_place(g, policy, budget, budget ? "the test's budget" : NULL, false, FO, true, NULL, why, n);
}

// md's training graph after the pass with policy (and budget for auto); NULL after a failed check.
// Whether the pass left the forward as it was goes into *forward_kept (check 6, reported by the caller).
static Graph *placed(Arena *a, const Model *md, bool bf16, const char *policy, int64_t budget, const char *label,
                     bool *forward_kept, char *differs, size_t dn) {
  char why[600], name[300];
  Graph *g = training_graph(a, md, bf16 ? DT_BF16 : DT_F32, why, sizeof why);
  Forward fw = {0};
  bool ok = g != NULL;
  if (ok) {
    fw = forward_of(g);
    ok = place(g, policy, budget, why, sizeof why);
  }
  snprintf(name, sizeof name, "checkpoint %s: the pass places the recomputation", label);
  if (!ok) {
    CHECK(false, name, "%s", why);
    if (g)
      forward_free(&fw);
    return NULL;
  }
  int at = forward_differs(&fw, g);
  if (at != fw.fwd_end && *forward_kept) {
    *forward_kept = false;
    if (at < 0)
      snprintf(differs, dn, "%s: the forward ends at %d, not %d", label, g->fwd_end, fw.fwd_end);
    else
      snprintf(differs, dn, "%s: node %d is %s with %d inputs, was op %d with %d", label, at,
               op_name(g->nodes[at]->op), g->nodes[at]->nin, fw.ops[at], fw.ins[at][0]);
  }
  forward_free(&fw);
  return g;
}

//
// Running a step.
//

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
    else if (!strcmp(nd->name, "pos"))
      ids[j] = (int32_t)(t < split ? t : t - split);
    else if (!strcmp(nd->name, "doc"))
      ids[j] = t < split ? 0 : 1;
    f[j] = (float)sin(0.7 * (double)j + 0.3);
  }
}

// What a run produced: step 1's loss and gradients (their bytes as the arena holds them), the
// parameters after the last step, and the arena it was planned for.
typedef struct {
  float loss;
  char **grad, **param;
  int64_t arena;
} Run;

static int64_t grad_bytes(const Graph *g, int k) {
  const IrNode *d = g->nodes[g->grads[k]];
  return dtype_size(d->dtype) * shape_numel(d->shape);
}

static int64_t param_bytes(const Graph *g, int k) { return 4 * shape_numel(g->nodes[g->params[k]]->shape); }

static char *dup_bytes(const void *x, int64_t n) {
  char *d = malloc((size_t)(n ? n : 1));
  memcpy(d, x, (size_t)n);
  return d;
}

static void run_free(const Graph *g, Run *r) {
  for (int k = 0; r->grad && k < g->nparams; k++) {
    free(r->grad[k]);
    free(r->param[k]);
  }
  free(r->grad);
  free(r->param);
}

static void keep_step1(const Graph *g, const MemPlan *m, char *arena, Run *out) {
  out->loss = *(float *)cpu_value(m, arena, g->loss);
  for (int k = 0; k < g->nparams && g->grads; k++) // (a forward-only graph has the loss alone)
    out->grad[k] = dup_bytes(cpu_value(m, arena, g->grads[k]), grad_bytes(g, k));
}

static void keep_params(const Graph *g, const MemPlan *m, char *arena, Run *out) {
  for (int k = 0; k < g->nparams; k++)
    out->param[k] = dup_bytes(cpu_value(m, arena, g->params[k]), param_bytes(g, k));
}

// `steps` steps of g's fused C module from the initial parameters of seed 7, its dropout masks drawn
// with `seed`, on 2 threads; false with the reason in why.
static bool cpu_steps(Graph *g, int steps, uint64_t seed, Run *out, char *why, size_t n) {
  Fusion *f = fuse(g, FO);
  MemPlan *m = memplan_with(f, true);
  CpuModule *cm = cpu_module(f, m, g->model, why, n);
  if (!cm)
    return false;
  char *arena = cpu_arena_new(m);
  cpu_init_params(g, m, arena, 7);
  set_inputs_by(g, batch, NULL, m, arena);
  cpu_set_threads(cm, 2);
  cm->hooks.seed = seed;
  out->grad = calloc((size_t)g->nparams, sizeof *out->grad);
  out->param = calloc((size_t)g->nparams, sizeof *out->param);
  out->arena = m->arena_bytes;
  bool ok = true;
  for (int s = 1; s <= steps && ok; s++) {
    cpu_set_scalar(g, m, arena, "lr", LR);
    cpu_set_scalar(g, m, arena, "step", s);
    ok = cpu_step(cm, arena);
    if (!ok)
      snprintf(why, n, "step %d: %s", s, cm->error);
    else if (s == 1)
      keep_step1(g, m, arena, out);
  }
  if (ok)
    keep_params(g, m, arena, out);
  cpu_arena_free(m, arena);
  cpu_unload(cm);
  return ok;
}

// Where y differs from x bit for bit (both runs of graphs of one model: the same parameters in the
// same order): the loss, then every gradient (and with params, every parameter) with how many of
// its values differ. True when nowhere.
static bool same_bits(const Graph *g, const Run *x, const Run *y, bool params, char *why, size_t n) {
  int len = 0;
  why[0] = 0;
  if (memcmp(&x->loss, &y->loss, sizeof x->loss))
    len += snprintf(why + len, n - (size_t)len, "loss %.9g vs %.9g; ", (double)y->loss, (double)x->loss);
  for (int w = 0; w < (params ? 2 : 1); w++)
    for (int k = 0; k < g->nparams && (size_t)len < n; k++) {
      int64_t bytes = w ? param_bytes(g, k) : grad_bytes(g, k);
      int64_t size = w ? 4 : dtype_size(g->nodes[g->grads[k]]->dtype), diff = 0;
      const char *a = w ? x->param[k] : x->grad[k], *b = w ? y->param[k] : y->grad[k];
      double d = 0, m = 1e-30; // (f32 values: by how much, relative to the tensor's largest)
      for (int64_t i = 0; i < bytes; i += size) {
        diff += memcmp(a + i, b + i, (size_t)size) != 0;
        if (size == 4) {
          float u, v;
          memcpy(&u, a + i, 4);
          memcpy(&v, b + i, 4);
          d = fmax(d, fabs((double)u - v));
          m = fmax(m, fabs((double)u));
        }
      }
      if (diff)
        len += snprintf(why + len, n - (size_t)len, "%s %s: %lld of %lld values differ (by up to %.1e of its "
                        "largest); ", w ? "parameter" : "gradient", g->nodes[g->params[k]]->name, (long long)diff,
                        (long long)(bytes / size), d / m);
    }
  return len == 0;
}

//
// The CUDA kernels on the CPU (as test_cuda_emit.c runs them).
//

// One training step of g's fused CUDA module in the emulator (dropout seed 7) from the initial
// parameters of seed 7; false with the reason in why.
static bool emu_steps(Graph *g, const char *dir, const char *tag, Run *out, char *why, size_t n) {
  Fusion *f = fuse(g, FO);
  MemPlan *m = memplan_with(f, true);
  CudaPlan *p = emit_cuda_plan(f, m, g->model);
  Emu emu = {0};
  snprintf(why, n, "emit_cuda_plan failed");
  if (!p || !emu_load(p, dir, tag, &emu, why, n)) {
    emu_free(&emu);
    return false;
  }
  // (zeroed, but for the kernels' scratch: all NaN, so a kernel reading scratch it did not write shows)
  size_t bytes = (size_t)(p->arena_bytes + 255) / 256 * 256;
  char *arena = aligned_alloc(256, bytes ? bytes : 256);
  memset(arena, 0, bytes);
  memset(arena + p->scratch, 0xff, (size_t)(p->arena_bytes - p->scratch));
  cpu_init_params(g, m, arena, 7);
  set_inputs_by(g, batch, NULL, m, arena);
  cpu_set_scalar(g, m, arena, "lr", LR);
  cpu_set_scalar(g, m, arena, "step", 1);
  MdlStatus st = {0};
  for (int i = 0; i < p->nlaunches; i++) {
    const CudaLaunch *l = &p->launches[i];
    if (l->kernel)
      emu.launch(emu.fn[i], l->grid, l->block, arena, &st, 7, l->chunk, l->args, l->nargs);
    else
      ref_gemm(arena, &p->gemms[l->gemm]);
  }
  out->grad = calloc((size_t)g->nparams, sizeof *out->grad);
  out->param = calloc((size_t)g->nparams, sizeof *out->param);
  out->arena = m->arena_bytes;
  if (st.set) {
    snprintf(why, n, "the step reports %s", cuda_error_what(st.code));
  } else {
    keep_step1(g, m, arena, out);
    keep_params(g, m, arena, out);
  }
  free(arena);
  emu_free(&emu);
  return !st.set;
}

//
// The checks.
//

// Checks 1 and 6 on one model and precision.
static void test_model(const Model *md, bool bf16, bool has_body) {
  Arena *a = arena_new();
  const char *prec = bf16 ? "bf16" : "fp32", *base = strrchr(md->path, '/') ? strrchr(md->path, '/') + 1 : md->path;
  const char *model = arena_printf(a, "%.*s", (int)strcspn(base, "."), base);
  char label[160], name[400], why[4000], differs[300] = "";
  bool forward_kept = true;
  snprintf(label, sizeof label, "%s %s none", model, prec);
  Graph *none = placed(a, md, bf16, "none", 0, label, &forward_kept, differs, sizeof differs);
  snprintf(label, sizeof label, "%s %s all", model, prec);
  Graph *all = placed(a, md, bf16, "all", 0, label, &forward_kept, differs, sizeof differs);
  if (!none || !all) {
    arena_free(a);
    return;
  }
  int64_t lo = all->ckpt.peak, hi = none->ckpt.peak;
  if (has_body) {
    snprintf(name, sizeof name, "checkpoint %s %s all: recomputes %d of %d saved values and plans %.3f MB, less than "
             "none's %.3f MB", model, prec, all->ckpt.nrecomputed, all->ckpt.nsaved, mb(lo), mb(hi));
    CHECK(all->ckpt.nrecomputed > 0 && all->ckpt.nclones >= all->ckpt.nrecomputed && lo < hi, name,
          "%d recomputed by %d clones, peak %lld vs none's %lld", all->ckpt.nrecomputed, all->ckpt.nclones,
          (long long)lo, (long long)hi);
  } else {
    snprintf(name, sizeof name, "checkpoint %s %s all: no repeat body, so nothing is recomputed and the plan is "
             "none's (%.3f MB)", model, prec, mb(hi));
    CHECK(all->ckpt.nrecomputed == 0 && all->ckpt.nclones == 0 && lo == hi && all->n == none->n, name,
          "%d recomputed by %d clones, %d nodes (none: %d), peak %lld vs none's %lld", all->ckpt.nrecomputed,
          all->ckpt.nclones, all->n, none->n, (long long)lo, (long long)hi);
  }

  // The policies in the order they run: none (the reference), all, then auto's budgets.
  Graph *g[5] = {none, all};
  const char *what[5] = {"none", "all"};
  int ng = 2;
  for (int k = 1; k <= 3 && lo < hi; k++) {
    int64_t budget = lo + k * (hi - lo) / 4;
    what[ng] = arena_printf(a, "auto(%.3f MB)", mb(budget));
    snprintf(label, sizeof label, "%s %s %s", model, prec, what[ng]);
    g[ng] = placed(a, md, bf16, "auto", budget, label, &forward_kept, differs, sizeof differs);
    if (!g[ng])
      continue;
    snprintf(name, sizeof name, "checkpoint %s %s %s: recomputes %d of %d saved values, plans %.3f MB within the "
             "budget, less than none's", model, prec, what[ng], g[ng]->ckpt.nrecomputed, g[ng]->ckpt.nsaved,
             mb(g[ng]->ckpt.peak));
    CHECK(g[ng]->ckpt.nrecomputed > 0 && g[ng]->ckpt.peak <= budget && g[ng]->ckpt.peak < hi, name,
          "%d recomputed, peak %lld, budget %lld", g[ng]->ckpt.nrecomputed, (long long)g[ng]->ckpt.peak,
          (long long)budget);
    ng++;
  }
  snprintf(name, sizeof name, "checkpoint %s %s: the pass leaves the forward's ops and inputs as they were (none, "
           "all and %d auto budgets)", model, prec, ng - 2);
  CHECK(forward_kept, name, "%s", differs);

  Run ref = {0};
  bool have_ref = cpu_steps(none, 2, 7, &ref, why, sizeof why);
  snprintf(name, sizeof name, "checkpoint %s %s none: 2 steps run on the C back end", model, prec);
  CHECK(have_ref, name, "%s", why);
  for (int i = 0; i < ng && have_ref; i++) {
    snprintf(name, sizeof name, "checkpoint %s %s %s: the back end plans the arena the pass reported (%.3f MB)",
             model, prec, what[i], mb(g[i]->ckpt.peak));
    Run r = {0};
    bool ok = i == 0 ? true : cpu_steps(g[i], 2, 7, &r, why, sizeof why);
    const Run *x = i == 0 ? &ref : &r;
    if (!ok) {
      snprintf(name, sizeof name, "checkpoint %s %s %s: 2 steps run on the C back end", model, prec, what[i]);
      CHECK(false, name, "%s", why);
      continue;
    }
    CHECK(x->arena == g[i]->ckpt.peak, name, "memplan gives %lld bytes, the pass %lld", (long long)x->arena,
          (long long)g[i]->ckpt.peak);
    if (i == 0)
      continue;
    if (i == 1 && has_body) {
      snprintf(name, sizeof name, "checkpoint %s %s all: the C back end's arena is smaller than none's (%.3f MB vs "
               "%.3f MB)", model, prec, mb(r.arena), mb(ref.arena));
      CHECK(r.arena < ref.arena, name, "%lld vs %lld bytes", (long long)r.arena, (long long)ref.arena);
    }
    snprintf(name, sizeof name, "checkpoint %s %s %s: loss, every gradient and the parameters after 2 steps "
             "bit-identical to none's (C back end)", model, prec, what[i]);
    CHECK(same_bits(none, &ref, &r, true, why, sizeof why), name, "%s", why);
    run_free(g[i], &r);
  }
  run_free(none, &ref);
  arena_free(a);
}

// Check 2: the emulated CUDA kernels of none, all and auto at half-way, and NVRTC on all's module.
static void test_cuda(const char *dir, const char *model, bool bf16) {
  Arena *a = arena_new();
  const Model md = {arena_printf(a, "models/%s.mdl", model), {{"B", 2}, {"T", 16}}, 2, NULL};
  const char *prec = bf16 ? "bf16" : "fp32";
  char label[160], name[400], why[4000], differs[300] = "";
  bool forward_kept = true;
  snprintf(label, sizeof label, "cuda %s %s none", model, prec);
  Graph *none = placed(a, &md, bf16, "none", 0, label, &forward_kept, differs, sizeof differs);
  snprintf(label, sizeof label, "cuda %s %s all", model, prec);
  Graph *all = placed(a, &md, bf16, "all", 0, label, &forward_kept, differs, sizeof differs);
  if (!none || !all) {
    arena_free(a);
    return;
  }
  int64_t budget = all->ckpt.peak + (none->ckpt.peak - all->ckpt.peak) / 2;
  const char *half = arena_printf(a, "auto(%.3f MB)", mb(budget));
  snprintf(label, sizeof label, "cuda %s %s %s", model, prec, half);
  Graph *mid = placed(a, &md, bf16, "auto", budget, label, &forward_kept, differs, sizeof differs);
  snprintf(name, sizeof name, "checkpoint cuda %s %s: the pass leaves the forward's ops and inputs as they "
           "were (none, all, %s)", model, prec, half);
  CHECK(forward_kept, name, "%s", differs);
  Graph *g[3] = {none, all, mid};
  const char *what[3] = {"none", "all", half};
  Run ref = {0};
  bool have_ref = emu_steps(none, dir, arena_printf(a, "%s_none_%s", model, prec), &ref, why, sizeof why);
  snprintf(name, sizeof name, "checkpoint cuda %s %s none: one step runs in the emulator", model, prec);
  CHECK(have_ref, name, "%.1500s", why);
  for (int i = 1; i < 3 && have_ref && g[i]; i++) {
    Run r = {0};
    char tag[64];
    snprintf(tag, sizeof tag, "%s_%s_%s", model, i == 1 ? "all" : "auto", prec);
    bool ok = emu_steps(g[i], dir, tag, &r, why, sizeof why);
    snprintf(name, sizeof name, "checkpoint cuda %s %s %s (%d recomputed): loss, every gradient and the "
             "parameters after the step bit-identical to none's (emulated CUDA kernels)", model, prec, what[i],
             g[i]->ckpt.nrecomputed);
    CHECK(ok && g[i]->ckpt.nrecomputed > 0 && same_bits(none, &ref, &r, true, why, sizeof why), name, "%.1500s",
          ok ? (g[i]->ckpt.nrecomputed ? why : "nothing recomputed") : why);
    run_free(g[i], &r);
  }
  run_free(none, &ref);

  if (nvrtc_available(why, sizeof why)) {
    Fusion *f = fuse(all, FO);
    CudaPlan *p = emit_cuda_plan(f, memplan_with(f, true), model);
    NvrtcResult r = {0};
    bool ok = p && nvrtc_compile(p->source, "sm_90", &r, why, sizeof why);
    snprintf(name, sizeof name, "checkpoint cuda %s %s all: NVRTC compiles the module for sm_90 without a "
             "warning", model, prec);
    CHECK(ok && r.size > 0 && !r.log, name, "%.600s", ok ? r.log : p ? why : "emit_cuda_plan failed");
    free(r.cubin);
    free(r.log);
  } else {
    printf("[skip] checkpoint cuda %s %s all: NVRTC: %s\n", model, prec, why);
  }
  arena_free(a);
}

static int count_op_in(const Graph *g, Op op, int from, int to) {
  int n = 0;
  for (int i = from; i < to; i++)
    n += g->nodes[i]->op == op;
  return n;
}

// Check 3: dropout inside a repeat body.
static void test_dropout(void) {
  Arena *a = arena_new();
  const Model md = {"drop.mdl", {{NULL, 0}}, 0, dropout_model};
  char name[400], why[4000], differs[300] = "";
  bool forward_kept = true;
  Graph *none = placed(a, &md, false, "none", 0, "dropout none", &forward_kept, differs, sizeof differs);
  Graph *all = placed(a, &md, false, "all", 0, "dropout all", &forward_kept, differs, sizeof differs);
  if (!none || !all) {
    arena_free(a);
    return;
  }
  // Every DROPOUT of all's backward beyond none's is a clone, and draws the mask of a forward dropout.
  int fwd = count_op_in(all, OP_DROPOUT, 0, all->fwd_end);
  int back_none = count_op_in(none, OP_DROPOUT, none->fwd_end, none->n);
  int back_all = count_op_in(all, OP_DROPOUT, all->fwd_end, all->n), foreign = 0;
  for (int i = all->fwd_end; i < all->n; i++) {
    const IrNode *c = all->nodes[i];
    bool drawn = c->op != OP_DROPOUT;
    for (int j = 0; j < all->fwd_end && !drawn; j++)
      drawn = all->nodes[j]->op == OP_DROPOUT && all->nodes[j]->ia[0] == c->ia[0];
    foreign += !drawn;
  }
  snprintf(name, sizeof name, "checkpoint dropout all: the backward recomputes dropouts (%d DROPOUT nodes, none's "
           "%d), each with the seed id of one of the %d forward dropouts", back_all, back_none, fwd);
  CHECK(fwd == 4 && back_all > back_none && foreign == 0, name, "%d forward, %d and %d in the backwards, %d with "
        "a seed id no forward dropout has", fwd, back_none, back_all, foreign);
  snprintf(name, sizeof name, "checkpoint dropout: the pass leaves the forward's ops and inputs as they were");
  CHECK(forward_kept, name, "%s", differs);

  Run ref = {0}, r = {0}, other = {0};
  bool ok = cpu_steps(none, 1, 7, &ref, why, sizeof why) && cpu_steps(all, 1, 7, &r, why, sizeof why) &&
            cpu_steps(none, 1, 8, &other, why, sizeof why);
  snprintf(name, sizeof name, "checkpoint dropout: none and all (%d recomputed), seed 7, give a bit-identical loss "
           "and gradients (C back end)", all->ckpt.nrecomputed);
  CHECK(ok && same_bits(none, &ref, &r, false, why, sizeof why), name, "%s", why);
  if (ok) {
    int differ = 0;
    for (int k = 0; k < none->nparams; k++)
      differ += memcmp(ref.grad[k], other.grad[k], (size_t)grad_bytes(none, k)) != 0;
    snprintf(name, sizeof name, "checkpoint dropout: seed 8 changes the gradients (%d of %d tensors differ from "
             "seed 7's): the masks are live", differ, none->nparams);
    CHECK(differ > 0, name, "every gradient is seed 7's");
  }
  run_free(none, &ref);
  run_free(all, &r);
  run_free(none, &other);
  arena_free(a);
}

// Checks 4 and 5 on gpt2-tiny: budgets from none's peak down to all's, then one below all's.
static void test_budgets(bool bf16) {
  Arena *a = arena_new();
  const Model md = {"models/gpt2-tiny.mdl", {{"B", 2}, {"T", 16}}, 2, NULL};
  const char *prec = bf16 ? "bf16" : "fp32";
  char name[400], why[600], seen[2000] = "";
  DType gemm = bf16 ? DT_BF16 : DT_F32;
  Graph *none = training_graph(a, &md, gemm, why, sizeof why), *all = training_graph(a, &md, gemm, why, sizeof why);
  bool ok = none && all && place(none, "none", 0, why, sizeof why) && place(all, "all", 0, why, sizeof why);
  snprintf(name, sizeof name, "checkpoint budgets gpt2-tiny %s: none and all place", prec);
  if (!ok) {
    CHECK(false, name, "%s", why);
    arena_free(a);
    return;
  }
  int64_t lo = all->ckpt.peak, hi = none->ckpt.peak, last = INT64_MAX;
  bool within = true, shrinks = true;
  int len = 0;
  for (int k = 0; k <= 8; k++) {
    int64_t budget = hi - k * (hi - lo) / 8;
    Graph *g = training_graph(a, &md, bf16 ? DT_BF16 : DT_F32, why, sizeof why);
    bool placed_ok = g && place(g, "auto", budget, why, sizeof why);
    int64_t peak = placed_ok ? g->ckpt.peak : -1;
    within &= placed_ok && peak <= budget;
    shrinks &= placed_ok && peak <= last;
    if ((size_t)len < sizeof seen)
      len += snprintf(seen + len, sizeof seen - (size_t)len, "%sbudget %lld: %s %lld (%d recomputed)",
                      k ? ", " : "", (long long)budget, placed_ok ? "peak" : why, (long long)peak,
                      placed_ok ? g->ckpt.nrecomputed : 0);
    last = peak;
  }
  snprintf(name, sizeof name, "checkpoint budgets gpt2-tiny %s: auto under 9 budgets from none's %.3f MB down to "
           "all's %.3f MB plans within each", prec, mb(hi), mb(lo));
  CHECK(within, name, "%s", seen);
  snprintf(name, sizeof name, "checkpoint budgets gpt2-tiny %s: the planned peak never grows as the budget shrinks",
           prec);
  CHECK(shrinks, name, "%s", seen);

  Graph *g = training_graph(a, &md, bf16 ? DT_BF16 : DT_F32, why, sizeof why);
  bool met = g && place(g, "auto", lo - 1, why, sizeof why);
  snprintf(name, sizeof name, "checkpoint budgets gpt2-tiny %s: a budget 1 byte under all's peak (%.3f MB) fails, "
           "reports all's peak and none's, and names the parameters", prec, mb(lo));
  CHECK(g && !met && g->ckpt.policy && g->ckpt.peak == lo && g->ckpt.peak_none == hi && strstr(why, "parameters"),
        name, "%s; peak %lld (all's %lld), none's %lld (%lld): %s", met ? "met" : "failed",
        g ? (long long)g->ckpt.peak : -1LL, (long long)lo, g ? (long long)g->ckpt.peak_none : -1LL, (long long)hi,
        why);
  arena_free(a);
}

// Check 8's model: each of its 4 layers saves three values of one size, [B, C] in f32: tanh(xin)
// (elementwise, 1 FLOP an element), gelu(xin) (elementwise, 8: the tanh approximation's count, as
// fusion counts it) and z @ w1 (a GEMM over K = 2 channels: 2 K = 4 FLOPs an element, fewer per byte
// than the gelu, yet a GEMM). Every one of them is read by its layer's backward alone, so each
// recomputed one frees its bytes at the backward's start, the peak.
static const char order_model[] =
    "model order\n"
    "dim B = 256\n"
    "dim C = 16\n"
    "dim K = 2\n"
    "dim L = 4\n"
    "input xin: f32[B, C]\n"
    "input z: f32[B, K]\n"
    "input targets: i32[B]\n"
    "x = xin * 1\n"
    "repeat h[L] {\n"
    "    param w1: [K, C] = normal(0.2)\n"
    "    param w2: [C, C] = normal(0.2)\n"
    "    param w3: [C, C] = normal(0.2)\n"
    "    param w4: [C, C] = normal(0.2)\n"
    "    x = x + (z @ w1) @ w2 + gelu(xin) @ w3 + tanh(xin) @ w4\n"
    "}\n"
    "param head: [C, 4] = normal(0.2)\n"
    "output loss = mean(cross_entropy(x @ head, targets))\n"
    "train {\n"
    "    precision = fp32\n"
    "}\n";

// Where auto's documented rule puts a saved value of order_model: its class (0 elementwise, 1 a
// GEMM: every elementwise value before every GEMM output), then the FLOPs of recomputing it per byte
// it frees, from its shape. -1 in cls for an op the model was not written to save.
typedef struct {
  int cls;
  double price;
} Rank;

static Rank rank_of(const Graph *g, int v) {
  const IrNode *n = g->nodes[v];
  double e = (double)shape_numel(n->shape), bytes = 4 * e;
  if (n->op == OP_MATMUL) {
    Shape x = g->nodes[n->in[0]]->shape;
    return (Rank){1, 2 * e * (double)x.d[x.rank - 1] / bytes};
  }
  if (n->op == OP_TANH || n->op == OP_GELU)
    return (Rank){0, (n->op == OP_GELU ? 8 : 1) * e / bytes};
  return (Rank){-1, 0};
}

static bool ranks_above(Rank a, Rank b) { return a.cls > b.cls || (a.cls == b.cls && a.price > b.price); }

// The pass with `policy`, and which forward values it recomputes (rec, per forward node), read from
// its listing (`mdlc -d C`: "recomputed %ID ...").
static bool place_listed(Graph *g, const char *policy, int64_t budget, bool *rec, char *why, size_t n) {
  char *text = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&text, &len);
  bool ok = out && checkpoint_place(g, policy, budget, budget ? "the test's budget" : NULL, false, FO, true, out,
                                    why, n);
  if (out)
    fclose(out);
  for (const char *p = text; ok && (p = strstr(p, "recomputed %")); p++) {
    int v = atoi(p + strlen("recomputed %"));
    if (v >= 0 && v < g->fwd_end)
      rec[v] = true;
  }
  free(text);
  return ok;
}

// Check 8: which values auto recomputes. Under 25 budgets from none's peak down to all's, what it
// recomputes is never ranked above what it keeps (the rank from the rule and the shapes, above);
// the sweep meets a budget where a tanh is recomputed and every gelu kept (the price within a
// class) and one where a gelu is recomputed and every GEMM output kept (the class before the price:
// the GEMM's 1 FLOP a byte is below the gelu's 2), and there the costliest-first order would take
// other values.
static void test_auto_order(void) {
  Arena *a = arena_new();
  const Model md = {"order.mdl", {{NULL, 0}}, 0, order_model};
  char name[600], why[600], seen[3000] = "";
  Graph *none = training_graph(a, &md, DT_F32, why, sizeof why);
  Graph *all = training_graph(a, &md, DT_F32, why, sizeof why);
  bool *cand = all ? calloc((size_t)all->fwd_end + 1, sizeof(bool)) : NULL;
  bool ok = none && cand && place(none, "none", 0, why, sizeof why) && place_listed(all, "all", 0, cand, why, sizeof why);
  int ids[64], nc = 0, foreign = 0;
  for (int v = 0; ok && v < all->fwd_end; v++)
    if (cand[v] && nc < 64) {
      ids[nc++] = v;
      foreign += rank_of(all, v).cls < 0;
    }
  snprintf(name, sizeof name, "checkpoint auto order: all recomputes the model's 12 values (4 tanh, 4 gelu, 4 GEMM "
           "outputs) and nothing else");
  CHECK(ok && nc == 12 && !foreign, name, "%s", ok ? arena_printf(a, "%d values, %d of other ops", nc, foreign) : why);
  if (!ok || nc != 12 || foreign) {
    free(cand);
    arena_free(a);
    return;
  }
  int64_t lo = all->ckpt.peak, hi = none->ckpt.peak;
  bool follows = true, placed_all = true, tanh_first = false, class_first = false;
  int reversed_differs = 0, len = 0;
  for (int j = 0; j <= 24; j++) {
    int64_t budget = hi - j * (hi - lo) / 24;
    Graph *g = training_graph(a, &md, DT_F32, why, sizeof why);
    bool *rec = g ? calloc((size_t)g->fwd_end + 1, sizeof(bool)) : NULL;
    if (!rec || !place_listed(g, "auto", budget, rec, why, sizeof why)) {
      placed_all = false;
      free(rec);
      break;
    }
    int k = 0, count[3] = {0}, total[3] = {0}; // tanh, gelu, GEMM output
    for (int i = 0; i < nc; i++) {
      int v = ids[i], kind = all->nodes[v]->op == OP_TANH ? 0 : all->nodes[v]->op == OP_GELU ? 1 : 2;
      total[kind]++;
      count[kind] += rec[v];
      k += rec[v];
      for (int w = 0; w < nc; w++)
        follows &= !(rec[v] && !rec[ids[w]] && ranks_above(rank_of(all, v), rank_of(all, ids[w])));
    }
    tanh_first |= count[0] > 0 && count[1] == 0;
    class_first |= count[1] > 0 && count[2] == 0;
    // the costliest-first order's k values: those of the highest ranks (ids descending among equals)
    int taken = 0, same = 0;
    bool *rev = calloc((size_t)all->fwd_end + 1, sizeof(bool));
    while (rev && taken < k) {
      int best = -1;
      for (int i = 0; i < nc; i++)
        if (!rev[ids[i]] && (best < 0 || !ranks_above(rank_of(all, best), rank_of(all, ids[i]))))
          best = ids[i];
      rev[best] = true;
      same += rec[best];
      taken++;
    }
    reversed_differs += k > 0 && k < nc && same < k;
    free(rev);
    free(rec);
    if ((size_t)len < sizeof seen)
      len += snprintf(seen + len, sizeof seen - (size_t)len, "%s%lld: %d tanh %d gelu %d GEMM", j ? ", " : "",
                      (long long)budget, count[0], count[1], count[2]);
  }
  snprintf(name, sizeof name, "checkpoint auto order: under 25 budgets from none's %.3f MB down to all's %.3f MB, "
           "auto never recomputes a value ranked above one it keeps (elementwise before GEMM outputs, then FLOPs "
           "per byte: tanh 0.25, gelu 2, the GEMM over K=2 1)", mb(hi), mb(lo));
  CHECK(placed_all && follows, name, "%s", placed_all ? seen : why);
  snprintf(name, sizeof name, "checkpoint auto order: some budget recomputes a tanh with every gelu kept, another a "
           "gelu with every GEMM output kept, where the costliest-first order would choose otherwise (%d budgets)",
           reversed_differs);
  CHECK(placed_all && tanh_first && class_first && reversed_differs > 0, name, "%s", placed_all ? seen : why);
  free(cand);
  arena_free(a);
}

// Check 7: the validation engine's graph (forward only, dropout off, the loss its one output: the
// models' logits output is sampling's). Its LM head is chunked as the training step's is (rule 2 of
// fuse.c): the logits never whole in the arena, which at a batch that checkpointing makes possible
// (GPT-2 124M, B=205, T=128) held 5.3 GB of them while training took 4.3; and its loss is the
// interpreter's, on the C back end and on the emulated CUDA kernels.
static void test_eval_lmhead(const char *dir, const char *model, bool bf16, bool emu) {
  Arena *a = arena_new();
  const char *prec = bf16 ? "bf16" : "fp32";
  DimOverride ov[2] = {{"B", 2}, {"T", 16}};
  char name[400], why[4000] = "the model does not compile";
  Graph *g = mdl_compile_file(a, arena_printf(a, "models/%s.mdl", model), ov, 2);
  if (g) { // as the runtime opens it: dropout off, the loss its one output
    ir_eval_mode(g);
    g->noutputs = 0;
    if (bf16 && !precision_assign(g, DT_BF16, why, sizeof why))
      g = NULL;
  }
  snprintf(name, sizeof name, "checkpoint eval %s %s: the forward-only graph builds", model, prec);
  CHECK(g != NULL, name, "%s", why);
  if (!g) {
    arena_free(a);
    return;
  }
  Fusion *f = fuse(g, FO);
  MemPlan *m = memplan_with(f, true);
  int lm = -1;
  for (int s = 0; s < f->nsteps; s++)
    if (f->steps[s].kind == STEP_LMHEAD)
      lm = s;
  int64_t logits = lm >= 0 ? shape_numel(g->nodes[f->steps[lm].root]->shape) : 0;
  snprintf(name, sizeof name, "checkpoint eval %s %s: the LM head is one chunked step, its %lld logits never in the "
           "arena", model, prec, (long long)logits);
  CHECK(lm >= 0 && m->offset[f->steps[lm].root] < 0, name, "%s",
        lm < 0 ? "no LM head step" : "the logits GEMM's output is in the arena");

  Interp *it = interp_new(g, INTERP_F32);
  interp_init_params(it, 7);
  set_inputs_by(g, batch, it, NULL, NULL);
  bool have = interp_run(it, g->n, why, sizeof why);
  double ref = have ? interp_value(it, g->loss)[0] : NAN, tol = bf16 ? 1e-3 : 1e-5;
  interp_free(it);
  Run r = {0}, c = {0};
  bool ok = have && cpu_steps(g, 1, 7, &r, why, sizeof why);
  snprintf(name, sizeof name, "checkpoint eval %s %s: the C back end's loss is the interpreter's within %g (%.6f)",
           model, prec, tol, ref);
  CHECK(ok && fabs(r.loss - ref) <= tol * fabs(ref), name, "%s", ok ? arena_printf(a, "%.6f", r.loss) : why);
  if (emu) {
    bool eok = have && emu_steps(g, dir, arena_printf(a, "eval_%s_%s", model, prec), &c, why, sizeof why);
    snprintf(name, sizeof name, "checkpoint eval %s %s: the emulated CUDA kernels' loss is the interpreter's within %g",
             model, prec, tol);
    CHECK(eok && fabs(c.loss - ref) <= tol * fabs(ref), name, "%.1500s", eok ? arena_printf(a, "%.6f", c.loss) : why);
  }
  run_free(g, &r);
  run_free(g, &c);
  arena_free(a);
}

static int optimizer_steps(const Fusion *f) {
  int n = 0;
  for (int s = 0; s < f->nsteps; s++)
    n += f->steps[s].kind == STEP_OPTIMIZER;
  return n;
}

// Check 7 on one model and precision.
static void test_per_param(const char *dir, const char *model, bool bf16, bool emu) {
  Arena *a = arena_new();
  const char *prec = bf16 ? "bf16" : "fp32";
  const Model md = {arena_printf(a, "models/%s.mdl", model), {{"B", 2}, {"T", 16}}, 2, NULL};
  char label[160], name[400], why[4000], differs[300] = "";
  bool kept = true;
  snprintf(label, sizeof label, "%s %s per-param", model, prec);
  Graph *g = placed(a, &md, bf16, "none", 0, label, &kept, differs, sizeof differs);
  if (!g) {
    arena_free(a);
    return;
  }
  Fusion *fused = fuse(g, FO);
  FO.optimizer_per_param = true;
  Fusion *each = fuse(g, FO);
  snprintf(name, sizeof name, "optimizer per param %s %s: %d optimizer steps (the gradient norm's and one per "
           "parameter) where fused has 1, with the same %d bf16 copies", model, prec, g->nparams + 1, fused->ncopies);
  CHECK(optimizer_steps(fused) == 1 && optimizer_steps(each) == g->nparams + 1 && each->ncopies == fused->ncopies &&
            each->nsteps == fused->nsteps + g->nparams,
        name, "fused: %d optimizer steps of %d, %d copies; per param: %d of %d, %d copies", optimizer_steps(fused),
        fused->nsteps, fused->ncopies, optimizer_steps(each), each->nsteps, each->ncopies);
  Run ref = {0}, r = {0};
  FO.optimizer_per_param = false;
  bool ok = cpu_steps(g, 2, 7, &ref, why, sizeof why);
  FO.optimizer_per_param = true;
  ok = ok && cpu_steps(g, 2, 7, &r, why, sizeof why);
  snprintf(name, sizeof name, "optimizer per param %s %s: the loss, gradients and the parameters after 2 steps "
           "bit-identical to the fused optimizer's (C back end)", model, prec);
  CHECK(ok && same_bits(g, &ref, &r, true, why, sizeof why), name, "%.1500s", why);
  run_free(g, &ref);
  run_free(g, &r);
  if (emu) {
    Run cref = {0}, c = {0};
    FO.optimizer_per_param = false;
    ok = emu_steps(g, dir, arena_printf(a, "fused_opt_%s_%s", model, prec), &cref, why, sizeof why);
    FO.optimizer_per_param = true;
    ok = ok && emu_steps(g, dir, arena_printf(a, "per_param_%s_%s", model, prec), &c, why, sizeof why);
    snprintf(name, sizeof name, "optimizer per param %s %s: the loss, gradients and the parameters after the step "
             "bit-identical to the fused optimizer's (emulated CUDA kernels)", model, prec);
    CHECK(ok && same_bits(g, &cref, &c, true, why, sizeof why), name, "%.1500s", why);
    run_free(g, &cref);
    run_free(g, &c);
  }
  FO.optimizer_per_param = false;
  arena_free(a);
}

int main(void) {
  char dir[] = "/tmp/mdl-ckpt-XXXXXX";
  if (!cache_dir_make(dir, "checkpoint: a temporary directory"))
    TEST_EXIT();
  const Model models[] = {
      {"models/gpt2-tiny.mdl", {{"B", 2}, {"T", 16}}, 2, NULL},
      {"models/llama-tiny.mdl", {{"B", 2}, {"T", 16}}, 2, NULL},
      {"models/mlp.mdl", {{"B", 8}}, 1, NULL},
  };
  for (int bf16 = 0; bf16 < 2; bf16++) {
    for (int i = 0; i < 3; i++)
      test_model(&models[i], bf16, i < 2);
    test_budgets(bf16);
  }
  test_dropout();
  test_auto_order();
  if (system("g++ --version >/dev/null 2>&1") == 0) {
    for (int m = 0; m < 2; m++) {
      test_cuda(dir, m ? "llama-tiny" : "gpt2-tiny", false);
      test_cuda(dir, m ? "llama-tiny" : "gpt2-tiny", true);
    }
  } else {
    printf("[skip] checkpoint cuda: no g++\n");
  }
  bool gxx = system("g++ --version >/dev/null 2>&1") == 0;
  for (int bf16 = 0; bf16 < 2; bf16++) {
    test_eval_lmhead(dir, "gpt2-tiny", bf16, gxx);
    test_eval_lmhead(dir, "llama-tiny", bf16, gxx);
    test_per_param(dir, "gpt2-tiny", bf16, gxx);
    test_per_param(dir, "llama-tiny", bf16, gxx);
  }
  remove_dir(dir);
  TEST_EXIT();
}
