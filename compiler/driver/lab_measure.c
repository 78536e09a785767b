// lab_measure.c: `mdlc lab`'s measurements that need the compiler (lab.c runs the rows): the GEMM
// library's rates, the plans' peaks and the largest batch within a budget, the cross-document leak check.
#include "backend.h"
#include "cuda.h"
#include "driver.h"
#include "runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <limits.h>
#include <stdlib.h>
#include <string.h>

// The step's planned peak at batch b (the lab's full configuration: bf16, fused), with checkpoint
// none, or with auto within budget; -1 where b does not compile or auto cannot meet the budget. The
// front end's messages for batches it refuses are not the user's business here: stderr is closed.
static int64_t lab_peak(const Options *o, int64_t b, bool ckpt, int64_t budget) {
  Options q = *o;
  q.dump = NULL;
  q.precision = "bf16";
  char spec[40];
  snprintf(spec, sizeof spec, "auto=%lld", (long long)budget);
  q.checkpoint = ckpt ? spec : "none";
  int k = 0;
  while (k < q.ndims && strcmp(q.dims[k].name, "B"))
    k++;
  if (k == q.ndims && q.ndims == 32)
    return -1;
  q.dims[k] = (DimOverride){"B", b};
  q.ndims += k == q.ndims;
  fflush(stderr);
  int saved = dup(2), null = open("/dev/null", O_WRONLY);
  dup2(null, 2);
  close(null);
  Arena *a = arena_new();
  PipelineOptions po = pipeline_options(&q, GRAPH_TRAIN, TARGET_GRAPH);
  Compilation c;
  int64_t peak = pipeline(a, &po, &c) ? c.g->ckpt.peak : -1;
  arena_free(a);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  return peak;
}

static bool lab_fits(const Options *o, int64_t b, bool ckpt, int64_t budget) {
  int64_t p = lab_peak(o, b, ckpt, budget);
  return p >= 0 && p <= budget;
}

// The largest batch within budget, from b up (doubling, then halving the gap); 0 when 1 does not fit.
static int64_t lab_largest_batch(const Options *o, int64_t b, bool ckpt, int64_t budget) {
  int64_t lo = 0, hi = 0; // lo fits (0: none known), hi does not (0: none known)
  if (lab_fits(o, b, ckpt, budget)) {
    lo = b;
    while (!hi && lo <= 4096) {
      if (lab_fits(o, 2 * lo, ckpt, budget))
        lo *= 2;
      else
        hi = 2 * lo;
    }
  } else {
    hi = b;
    while (!lo && hi > 1) {
      if (lab_fits(o, hi / 2, ckpt, budget))
        lo = hi / 2;
      else
        hi /= 2;
    }
  }
  while (lo && hi - lo > 1) {
    int64_t mid = lo + (hi - lo) / 2;
    if (lab_fits(o, mid, ckpt, budget))
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// The cross-document leak check on the first packed row of the data that holds two documents:
// perturb a token of its first document; every position of every other document must keep its
// logits bit for bit. *passed says whether they did; the return is the sentence that says so.
static const char *lab_leak(const Options *o, Arena *out, bool mask, bool *passed) {
  Options q = *o;
  q.dump = NULL;
  q.lower.no_doc_mask = !mask;
  *passed = false;
  Arena *a = arena_new();
  PipelineOptions po = pipeline_options(&q, GRAPH_INFER, target_of(&q));
  Compilation c;
  bool precise = pipeline(a, &po, &c); // (the precision pass renumbers the nodes: the outputs are looked up after it)
  Graph *g = precise ? c.g : NULL;
  int logits = -1;
  for (int i = 0; precise && i < g->noutputs; i++)
    if (g->nodes[g->outputs[i]]->name && !strcmp(g->nodes[g->outputs[i]]->name, "logits"))
      logits = g->outputs[i];
  const char *said = NULL;
  if (!g || logits < 0 || rt_input_node(g, "doc") < 0 || rt_input_node(g, "tokens") < 0) {
    said = !precise ? "not checked: the model does not compile"
                    : "not checked: the model has no logits output or no doc input";
    arena_free(a);
    return arena_strdup(out, said);
  }
  Engine *e = open_engine(&q, &c, false);
  int64_t B = ir_dim(g, "B"), T = ir_dim(g, "T"), V = ir_dim(g, "V"), n = B * T;
  Loader *l = e ? loader_open(o->data, "train", (LoaderOptions){.B = B, .T = T, .vocab = V, .pack = true}) : NULL;
  Batch bt;
  int64_t row = -1, end = 0;
  for (int tries = 0; l && row < 0 && tries < 64 && loader_next(l, &bt); tries++)
    for (int64_t r = 0; r < B && row < 0; r++)
      for (int64_t t = 1; t < T && row < 0; t++)
        if (bt.doc[r * T + t] != bt.doc[r * T])
          row = r, end = t; // (the first document of row r is [0, end))
  int64_t changed = 0, others = 0;
  char err[512] = "";
  if (row >= 0) {
    int32_t *tokens = xmalloc(sizeof(int32_t) * (size_t)n, "the check's tokens");
    float *ref = xmalloc(sizeof(float) * (size_t)(n * V), "the check's logits");
    float *got = xmalloc(sizeof(float) * (size_t)(n * V), "the check's logits");
    memcpy(tokens, bt.tokens, sizeof(int32_t) * (size_t)n);
    bool ok = true;
    for (int pass = 0; pass < 2 && ok; pass++) {
      if (pass)
        tokens[row * T + end - 1] = (tokens[row * T + end - 1] + 1) % (int32_t)V;
      ok = e->set_input(e, "tokens", tokens, NULL, n) && e->set_input(e, "targets", bt.targets, NULL, n) &&
           (rt_input_node(g, "pos") < 0 || e->set_input(e, "pos", bt.pos, NULL, n)) &&
           e->set_input(e, "doc", bt.doc, NULL, n) && e->step(e, err, sizeof err);
      if (ok)
        e->read(e, logits, pass ? got : ref);
    }
    for (int64_t i = 0; ok && i < n; i++) {
      if (i / T == row && i % T < end)
        continue; // (the perturbed document itself)
      others++;
      changed += memcmp(ref + i * V, got + i * V, sizeof(float) * (size_t)V) != 0;
    }
    if (!ok)
      said = arena_printf(out, "not checked: %s", err[0] ? err : "an input could not be set");
    free(tokens);
    free(ref);
    free(got);
  } else if (l) {
    said = "not checked: no packed row of the data holds two documents";
  } else {
    said = "not checked: the model or the data could not be opened";
  }
  if (!said) {
    *passed = changed == 0;
    said = arena_printf(out, "%s: perturbing a token of one document of a packed row %s", *passed ? "the leak check "
                        "passes" : "the leak check fails", *passed ? arena_printf(out, "leaves the other %lld "
                        "positions' logits bit-identical", (long long)others) : arena_printf(out, "changes the "
                        "logits of %lld of the %lld positions of other documents", (long long)changed,
                        (long long)others));
  }
  if (l)
    loader_close(l);
  if (e)
    e->free(e);
  arena_free(a);
  return arena_strdup(out, said);
}

// `mdlc lab MODEL --data DIR`: the measurements that need the compiler, then lab_run's rows.
int cmd_lab(const Options *o, Compilation *c) {
  Graph *g = c->g;
  if (!o->data) {
    diag_file_error(o->file, "lab needs --data DIR: shards made by `mdlc prep TEXT -o DIR`");
    return EXIT_USER;
  }
  char data_abs[PATH_MAX], tok_path[PATH_MAX + 16];
  if (!realpath(o->data, data_abs)) {
    diag_file_error(o->data, "cannot resolve the path: %s", strerror(errno));
    return EXIT_USER;
  }
  if (arrays_found(data_abs)) { // (its rows measure tokens/s, packing and the data pipeline of text)
    diag_file_error(o->data, "lab measures language models on token shards (made by `mdlc prep TEXT -o DIR`), not "
                    "on arrays: time an array run with `mdlc run --profile`");
    return EXIT_USER;
  }
  // The data as every row's run checks it, once here rather than in each row.
  snprintf(tok_path, sizeof tok_path, "%s/tokenizer.bin", data_abs);
  Tokenizer *tok = tok_load(tok_path);
  if (!tok || !train_check_inputs(g, o->file, data_abs, "", false, false, NULL)) {
    if (tok)
      tok_free(tok);
    return EXIT_USER;
  }
  tok_free(tok);
  if (!lab_claim_out(o->out ? o->out : "lab"))
    return EXIT_USER;
  Arena *a = g->arena;
  LabOptions lo = {.arena = a, .model = o->file, .data = o->data, .out = o->out ? o->out : "lab",
                   .model_name = g->model ? g->model : o->file, .steps = o->steps > 0 ? o->steps : 20,
                   .nparams = g->nparams, .T = ir_dim(g, "T")};
  // Every run: the dims, the --set settings, the back end, the seed (the techniques' options are lab.c's).
  const char **pass = arena_alloc(a, sizeof(char *) * (size_t)(2 * o->ndims + 2 * o->lower.nsettings + 8));
  for (int i = 0; i < o->ndims; i++) {
    pass[lo.npass++] = "-D";
    pass[lo.npass++] = arena_printf(a, "%s=%lld", o->dims[i].name, (long long)o->dims[i].value);
  }
  for (int i = 0; i < o->lower.nsettings; i++) {
    pass[lo.npass++] = "--set";
    pass[lo.npass++] = o->settings[i];
  }
  pass[lo.npass++] = "--backend";
  pass[lo.npass++] = backend_of(o);
  pass[lo.npass++] = "--seed";
  pass[lo.npass++] = arena_printf(a, "%llu", (unsigned long long)o->seed);
  lo.pass = pass;
  bool cuda = !strcmp(backend_of(o), "cuda");
  // What the machine is, and what its GEMMs do in bf16.
  char err[256];
  const GemmLib *lib = cuda || !strcmp(backend_of(o), "interp") ? NULL : rt_gemm(err, sizeof err);
  if (lib) {
    rt_gemm_probe();
    lo.machine = arena_printf(a, "this CPU (%s, %.0f GFLOP/s fp32%s)", lib->name, lib->sgemm_gflops,
                              lib->bgemm ? arena_printf(a, ", %.0f bf16", lib->bgemm_gflops) : "");
    lo.bf16_why = lib->bgemm ? arena_printf(a, "%s's bf16 GEMM runs at %.0f GFLOP/s against %.0f fp32 (AMX)", lib->name,
                                            lib->bgemm_gflops, lib->sgemm_gflops)
                             : arena_printf(a, "%s has no bf16 GEMM faster than its fp32 one on this CPU", lib->name);
  } else {
    lo.machine = cuda ? "this GPU" : "the reference interpreter";
    lo.bf16_why = cuda ? "bf16 GEMMs run on the tensor cores" : "the interpreter computes in f32 either way";
  }
  int64_t B = ir_dim(g, "B"), heads = 0;
  for (int i = 0; i < g->fwd_end; i++)
    if (g->nodes[i]->op == OP_ATTENTION) {
      heads = g->nodes[i]->ia[0];
      lo.has_doc |= g->nodes[i]->ia[2] != 0;
    }
  lo.scores_mb = (double)B * (double)heads * (double)lo.T * (double)lo.T * 4 / 1e6;
  lo.setup = arena_printf(a, "B=%lld, T=%lld, %lld parameters, back end %s, data %s", (long long)B, (long long)lo.T,
                          (long long)ir_param_count(g), backend_of(o), o->data);
  if (!heads)
    lo.skip[2] = "the model has no attention";
  char source[PATH_MAX + 16];
  snprintf(source, sizeof source, "%s/source.txt", o->data);
  if (access(source, R_OK))
    lo.skip[6] = arena_printf(a, "%s: %s: the data does not say what text it came from (prepared before prep "
                              "recorded it); prepare it again to measure this", source, strerror(errno));
  // FP8: on a GPU of sm_89 or later in the ladder; on an older one skipped; on a CPU measured apart
  // (emulated: what it costs here), so that the ladder and the full system stay what this CPU runs best.
  DType fp8;
  CudaDevice dev;
  char devwhy[256];
  if (!precision_parse("fp8", &fp8))
    lo.skip[7] = "this build has no FP8 GEMMs yet";
  else if (!cuda)
    lo.apart[7] = "emulated on a CPU (each cast rounds in software, fp8 operands are widened for the f32 GEMM), "
                  "so it costs here; FP8's gain needs the tensor cores of sm_89 or later";
  else if (cuda_device(&dev, devwhy, sizeof devwhy) && atoi(dev.arch + 3) < 89)
    lo.skip[7] = arena_printf(a, "%s (%s) has no FP8 tensor cores (sm_89 or later)", dev.name, dev.arch);
  // Checkpointing's worth: the largest batch within a budget, without it and with it.
  printf("lab: the largest batches within the memory budget, without and with checkpointing\n");
  fflush(stdout);
  const char *what;
  int64_t mem = memory_there(o, &what);
  if (o->lab_budget) {
    bool fraction;
    lo.budget = checkpoint_budget(o->lab_budget, mem, &fraction);
    lo.budget_how = fraction ? arena_printf(a, "%s of the %.2f GB %s", o->lab_budget, (double)mem / 1e9, what)
                             : arena_printf(a, "--memory-budget %s", o->lab_budget);
  } else {
    lo.budget = lab_peak(o, B, false, 0);
    lo.budget_how = arena_printf(a, "the step's planned peak at B=%lld without checkpointing", (long long)B);
  }
  if (lo.budget <= 0) {
    lo.batch_how = "no budget to measure against (the memory there is cannot be read)";
  } else {
    lo.batch_none = lab_largest_batch(o, B, false, lo.budget);
    lo.batch_auto = lab_largest_batch(o, lo.batch_none > 0 ? lo.batch_none : B, true, lo.budget);
    if (!lo.batch_none || !lo.batch_auto)
      lo.batch_how = arena_printf(a, "no batch fits %.0f MB%s", (double)lo.budget / 1e6,
                                  lo.batch_auto ? " without it" : "");
    if (!lo.batch_none)
      lo.batch_none = lo.batch_auto = 0;
  }
  bool passed;
  lo.leak_on = lab_leak(o, a, true, &passed);
  lo.leak_off = lo.has_doc ? lab_leak(o, a, false, &passed) : NULL;
  return lab_run(&lo);
}
