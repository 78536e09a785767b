// pipeline.c: every pass of the compiler in order, from .mdl text to the module a back end runs.
//
// One function, pipeline(), reads as the list of passes, each followed by its validator and its `-d`
// dump: front end (P) -> the precision named, checked -> autodiff and the optimizer (A) -> precision
// (R) -> specialisation for evaluation -> checkpoint placement (C) -> fusion (F) -> memory plan (M) ->
// emit (the C module's text, the CUDA plan). The precision and checkpoint passes validate the graphs
// they build themselves; fusion and the memory plan read the graph as it is. It runs nothing, opens
// no device and reads no data: what depends on the machine (what `auto` precision is, the memory a
// checkpoint budget is measured against, the GPU's compute capability) is decided by the driver
// before and handed in as PipelineOptions. The dims are bound (shapes specialised) by the front end,
// from the model's text and -D. Validation graphs are specialised after the precision pass, which
// decides on what the graph's outputs read.
#include "emit_c.h"
#include "emit_cuda.h"
#include "mdl.h"

#include <string.h>

static bool dumping(const PipelineOptions *o, char letter) { return o->dump && strchr(o->dump, letter); }

// An internal error: a pass built a graph its validator refuses.
static bool valid(const PipelineOptions *o, const Graph *g, const char *pass) {
  char why[512];
  if (ir_validate(g, why, sizeof why))
    return true;
  fprintf(stderr, "%s: internal error: %s built a broken graph: %s\n", o->file, pass, why);
  return false;
}

// The GEMM precision: o->precision, else the train section's, `auto` being o->auto_precision; an
// error where it cannot run: fp8 on a GPU older than compute capability 8.9. Fp8 emulated on the CPU
// is said once (a run compiles several graphs).
static bool settle_precision(const PipelineOptions *o, Graph *g, DType *dt) {
  if (o->precision)
    g->train.precision = o->precision;
  if (!strcmp(g->train.precision, "auto")) {
    g->train.precision = o->auto_precision;
    g->train.precision_auto = true;
  }
  if (!precision_parse(g->train.precision, dt))
    return false; // (sema and the options accept no other name)
  if (*dt != DT_F8E4M3)
    return true;
  if (!o->gpu || o->compute_capability >= 89) {
    static bool said;
    if (o->fp8_emulated_note && !said)
      fprintf(stderr, "mdlc: fp8 is emulated on the CPU (every fp8 value rounded in software, the GEMMs on its values widened to bf16 or f32), "
                      "slower than bf16 there and far slower than a GPU's fp8 GEMMs\n");
    said = true;
    return true;
  }
  const char *msg = arena_printf(g->arena, "precision = fp8: the GPU %s has compute capability %d.%d, and FP8 GEMMs "
                                 "need 8.9 or later (Ada, Hopper and newer); use bf16", o->gpu,
                                 o->compute_capability / 10, o->compute_capability % 10);
  if (g->train.precision_at.line > 0 && !o->precision)
    diag_error(g->train.precision_at, "%s", msg);
  else
    diag_file_error(o->file, "%s", msg);
  return false;
}

// The precision pass. A validation graph runs the bf16 forward under fp8: the fp8 scales are the
// training step's state. The micro-batches' graph of gradient accumulation is no validation graph:
// its passes cast to fp8 with the step's scales (train.c).
static bool apply_precision(const PipelineOptions *o, Graph *g, DType dt) {
  if (o->kind == GRAPH_EVAL && dt == DT_F8E4M3)
    dt = DT_BF16;
  char why[512];
  if (precision_assign(g, dt, why, sizeof why))
    return true;
  fprintf(stderr, "%s: internal error: the precision pass built a broken graph: %s\n", o->file, why);
  return false;
}

// A forward graph for evaluation: dropout off. Validation reads the loss and the scalar outputs alone:
// no other output is kept, so the LM head's logits are never whole (rule 2 of fuse.c chunks it: 5.3 GB
// of them at GPT-2 124M, B=205, T=128).
static void specialise(const PipelineOptions *o, Graph *g) {
  ir_eval_mode(g);
  if (o->kind != GRAPH_EVAL)
    return;
  int kept = 0;
  for (int i = 0; i < g->noutputs; i++)
    if (g->outputs[i] != g->loss && g->nodes[g->outputs[i]]->shape.rank == 0)
      g->outputs[kept++] = g->outputs[i];
  g->noutputs = kept;
}

// The checkpoint pass: o->checkpoint, else the train section's, else auto; auto's budget, where none
// is given, is o->memory. With dumping C, every saved value, kept or recomputed.
static bool place_checkpoints(const PipelineOptions *o, Graph *g) {
  const char *spec = o->checkpoint ? o->checkpoint : g->train.checkpoint ? g->train.checkpoint : "auto";
  const char *policy = spec, *how = NULL, *what = o->memory_what ? o->memory_what : "";
  int64_t budget = 0, mem = o->memory;
  if (!strncmp(spec, "auto", 4)) {
    policy = "auto";
    if (spec[4] == '=') {
      bool fraction;
      budget = checkpoint_budget(spec + 5, mem, &fraction);
      how = fraction ? arena_printf(g->arena, "%s of the %.2f GB %s", spec + 5, (double)mem / 1e9, what)
                     : arena_strdup(g->arena, spec + 5);
    } else if (mem > 0) {
      budget = mem;
      how = arena_printf(g->arena, "the %.2f GB %s", (double)mem / 1e9, what);
    }
  }
  char why[600];
  g->ckpt.policy = NULL;
  if (budget >= 0 && checkpoint_place(g, policy, budget, how, spec[4] != '=', o->fuse, o->reuse,
                                      dumping(o, 'C') ? stdout : NULL, why, sizeof why))
    return true;
  const CheckpointPlan *cp = &g->ckpt;
  char msg[1400];
  if (budget < 0) {
    snprintf(msg, sizeof msg, "the budget is a fraction of the memory, which this machine does not say");
  } else if (!cp->policy) {
    fprintf(stderr, "%s: internal error: %s\n", o->file, why);
    return false;
  } else if (spec[4] != '=') { // the memory there is: the model does not fit
    diag_file_error(o->file, "%s does not fit in memory: its step needs %.2f GB recomputing every layer (%.2f GB "
                    "keeping every activation), this machine has %.2f GB %s; %s", g->model ? g->model : "the model",
                    (double)cp->peak / 1e9, (double)cp->peak_none / 1e9, (double)budget / 1e9, what, why);
    return false;
  } else {
    snprintf(msg, sizeof msg, "a budget of %.2f MB cannot be met: recomputing every layer (checkpoint = all) the "
             "step still plans %.2f MB (none: %.2f MB), the smallest budget there is; %s", (double)budget / 1e6,
             (double)cp->peak / 1e6, (double)cp->peak_none / 1e6, why);
  }
  if (!o->checkpoint && g->train.checkpoint_at.line > 0)
    diag_error(g->train.checkpoint_at, "checkpoint = %s: %s", spec, msg);
  else
    diag_file_error(o->file, "--checkpoint %s: %s", spec, msg);
  return false;
}

// The modules o->target asks for, from the step plan: the C module's text, the CUDA plan (each
// emitter says why it could not emit).
static bool emit(const PipelineOptions *o, Compilation *c) {
  const char *name = o->module_name ? o->module_name : c->g->model ? c->g->model : "model";
  bool c_module = o->target == TARGET_C || o->target == TARGET_C_CUDA;
  bool cuda = o->target == TARGET_CUDA || o->target == TARGET_C_CUDA;
  if (c_module)
    c->c_source = emit_c(c->f, c->m, name);
  if (cuda)
    c->cuda = emit_cuda_plan(c->f, c->m, name);
  if (o->target == TARGET_CUDA && !c->cuda) // (the engine's message where it emitted the plan itself)
    diag_file_error(o->file, "the CUDA emitter could not emit %s", c->g->model ? c->g->model : "the model");
  return (!c_module || c->c_source) && (!cuda || c->cuda);
}

bool pipeline(Arena *a, const PipelineOptions *o, Compilation *c) {
  *c = (Compilation){0};
  Graph *g = c->g = o->text ? mdl_compile_text_with(a, o->file, o->text, o->dims, o->ndims, o->lower)
                            : mdl_compile_file_with(a, o->file, o->dims, o->ndims, o->lower);
  if (!g)
    return false;
  if (o->accumulate > 0)
    g->train.accumulate = o->accumulate;
  if (!valid(o, g, "the front end"))
    return false;
  if (dumping(o, 'P'))
    ir_dump(g, stdout);

  DType dt;
  if (!settle_precision(o, g, &dt))
    return false;
  if (o->kind == GRAPH_FORWARD)
    return true;

  bool backward = o->kind == GRAPH_GRADS || o->kind == GRAPH_TRAIN;
  if (o->kind == GRAPH_EVAL && g->loss < 0)
    return false; // (validation reads the loss; the training graph has said there is none)
  if (backward && g->loss < 0) {
    diag_file_error(o->file, "no 'output loss = ...': nothing to train");
    return false;
  }
  if (backward && g->nparams == 0) { // (at the loss, which nothing it reads can lower)
    diag_error(g->nodes[g->loss]->loc, "the model has no 'param': the loss has nothing to train");
    return false;
  }
  if (backward && !autodiff(g, o->kind == GRAPH_TRAIN)) {
    diag_file_error(o->file, "autodiff: %s", g->err);
    return false;
  }
  if (backward && !valid(o, g, "autodiff"))
    return false;
  if (backward && dumping(o, 'A'))
    ir_dump(g, stdout);

  if (!apply_precision(o, g, dt))
    return false;
  if (dumping(o, 'R'))
    ir_dump(g, stdout);

  if (!backward)
    specialise(o, g);

  if (backward && !place_checkpoints(o, g))
    return false;

  if (o->target == TARGET_GRAPH)
    return true;
  c->f = fuse(g, o->fuse);
  c->m = memplan_with(c->f, o->reuse);
  if (dumping(o, 'F'))
    fuse_dump(c->f, stdout);
  if (dumping(o, 'M'))
    memplan_dump(c->f, c->m, stdout);

  return o->target == TARGET_PLAN || emit(o, c);
}
