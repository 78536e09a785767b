// main.c: the mdlc command line. Each verb runs the pipeline as far as it needs:
//   parse + check (front end) -> autodiff + AdamW -> fuse -> plan memory -> emit C -> cc + dlopen
// (or the reference interpreter instead of the last three), and `-d LETTERS` prints the IR after
// the passes it names (P: parse, A: autodiff, R: precision, F: fusion, M: memory plan).
#include "backend.h"
#include "cuda.h"
#include "data.h"
#include "emit_cuda.h"
#include "mdl.h"
#include "runtime.h"
#include "sample.h"

#include <errno.h>
#include <sys/stat.h>

#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { EXIT_USER = 1, EXIT_USAGE = 2 };

typedef struct {
  const char *verb, *file;
  const char *dump;     // -d letters
  DimOverride dims[32];
  int ndims;
  const char *out, *weights, *batch, *data, *backend;
  const char *precision; // --precision, else the train section's
  const char *checkpoint; // --checkpoint, else the train section's
  int64_t steps;
  uint64_t seed;
  bool fp64;
  FuseOptions fuse;
  bool reuse; // the memory planner shares memory between activations whose lives do not overlap
  bool profile;
  bool gemm_tuning; // the CUDA back end times cuBLASLt's candidates for each GEMM (--no-gemm-tuning)
  bool kernel_tuning; // and each kernel that has a variant against it (--no-kernel-tuning)
  PrepOptions prep;
  bool resume, pack, shuffle;
  bool tokenize_on_the_fly; // training batches tokenised from the text as drawn (--tokenize-on-the-fly)
  int64_t val_every, val_batches, ckpt_every;
  int64_t accumulate; // > 0 overrides the train section's
  int64_t skip_nonfinite; // steps with a non-finite loss or gradient norm skipped (with a warning each)
  SampleOptions sample;
} Options;

static const char usage_text[] =
    "usage: mdlc [options] VERB FILE\n"
    "\n"
    "verbs:\n"
    "  check FILE.mdl                 parse and check; parameter count and shapes\n"
    "  init  FILE.mdl -o W.safetensors  initialise the parameters (--seed N)\n"
    "  grad  FILE.mdl --weights W --batch BATCH -o OUT\n"
    "                                 loss and every gradient of one step, as safetensors\n"
    "  prep  INPUT -o DIR             pre-tokenise a text file, a folder or JSONL into shards\n"
    "                                 (--vocab N --doc-sep STR --val-fraction F --text-field NAME\n"
    "                                  --shard-tokens N --force)\n"
    "  build FILE.mdl -o DIR          emit the C, the step plan and the fusion report\n"
    "  sample CHECKPOINT [--prompt TEXT]  generate text (--tokens N --temperature T --top-k K --seed S)\n"
    "  run   FILE.mdl --data DIR [--steps N] [--out DIR] [--resume]\n"
    "                                 compile and train on shards from prep\n"
    "\n"
    "options:\n"
    "  -D, --dim NAME=N       bind a dimension (overrides the train section)\n"
    "  -d, --dump LETTERS     print the IR after passes: P parse, A autodiff + optimizer,\n"
    "                         R precision, C checkpoints (saved values, kept or recomputed),\n"
    "                         F fusion, M memory plan\n"
    "  -o, --out PATH         output file\n"
    "      --weights PATH     load parameters from a safetensors file\n"
    "      --batch PATH       a batch as safetensors (tokens, targets, pos, doc: i32 [B,T])\n"
    "      --data DIR         shards and tokenizer made by `mdlc prep`\n"
    "      --out DIR          checkpoint, log.jsonl and loss.svg (default: out)\n"
    "      --resume           continue the checkpoint in --out exactly\n"
    "      --no-pack          one padded document per row instead of packed rows\n"
    "      --shuffle          shuffled batches (deterministic from --seed)\n"
    "      --tokenize-on-the-fly  read the text prep made the shards from (DIR/source.txt) and tokenise\n"
    "                         each training batch as it is drawn, in the step's time, nothing prepared\n"
    "                         ahead (to measure what the shards are worth): the same batches; validation\n"
    "                         batches still come from the shards; --shuffle only with --no-pack\n"
    "      --val-every N      validation loss every N steps (default 100; and at the end)\n"
    "      --val-batches N    batches per validation (default 4)\n"
    "      --ckpt-every N     a checkpoint every N steps (default 100; and at the end)\n"
    "      --accumulate N     gradients accumulated over N micro-batches per step\n"
    "      --skip-nonfinite N skip up to N steps whose loss or gradient norm is not finite (a warning\n"
    "                         each; default 0: the run stops at the first, its weights not updated)\n"
    "      --steps N          training steps (default: the train section's, else 50)\n"
    "      --seed N           random seed (default 1337)\n"
    "      --backend NAME     auto (the default: cuda when a GPU is there, else cpu), cuda, cpu\n"
    "                         (compiled C), interp (the reference interpreter)\n"
    "      --fp64             run the interpreter in fp64\n"
    "      --precision P      auto, fp32 or bf16: the GEMMs' operands (default: the train section's, else\n"
    "                         auto: bf16, or fp32 on a CPU without a bf16 GEMM faster than its fp32 one)\n"
    "      --checkpoint C     none, all or auto[=BUDGET]: what the backward recomputes instead of keeping\n"
    "                         (all: every layer but its input; auto: as little as fits BUDGET, bytes as\n"
    "                         512MiB, 2GiB or a fraction of the memory such as 0.5; default: the train\n"
    "                         section's, else auto, whose budget is the memory available)\n"
    "      --no-fuse          one kernel per IR node (to measure what fusion is worth)\n"
    "      --no-chunk-lmhead  materialise the whole logits instead of running the LM head by chunks\n"
    "      --no-gemm-tuning   CUDA: each GEMM on cuBLASLt's first choice, untimed (what tuning is worth)\n"
    "      --no-kernel-tuning CUDA: each kernel that has a variant (attention's block sizes) as first\n"
    "                         emitted, not timed against it\n"
    "      --no-reuse         give every activation its own memory (what liveness-based reuse saves)\n"
    "      --profile          run each step kernel by kernel and print a table: time, GFLOP/s, GB/s\n"
    "  -h, --help             this text\n"
    "  -V, --version          the version\n";

static int usage_error(const char *fmt, const char *arg) {
  fprintf(stderr, "mdlc: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\n(see mdlc --help)\n");
  return EXIT_USAGE;
}

static bool parse_int(const char *s, int64_t *v) {
  char *end;
  long long x = strtoll(s, &end, 10);
  if (!*s || *end)
    return false;
  *v = x;
  return true;
}

static int parse_options(int argc, char **argv, Options *o) {
  static const struct option longopts[] = {
      {"dim", required_argument, 0, 'D'},     {"dump", required_argument, 0, 'd'},
      {"out", required_argument, 0, 'o'},     {"weights", required_argument, 0, 'w'},
      {"batch", required_argument, 0, 'b'},   {"data", required_argument, 0, 'a'},
      {"steps", required_argument, 0, 's'},   {"seed", required_argument, 0, 'S'},
      {"backend", required_argument, 0, 'k'}, {"fp64", no_argument, 0, 'F'},
      {"precision", required_argument, 0, 'Q'}, {"checkpoint", required_argument, 0, 'c'},
      {"no-fuse", no_argument, 0, 'N'},       {"no-chunk-lmhead", no_argument, 0, 'C'},
      {"no-reuse", no_argument, 0, 'U'},      {"profile", no_argument, 0, 'O'},
      {"no-gemm-tuning", no_argument, 0, 'G'}, {"no-kernel-tuning", no_argument, 0, 'J'},
      {"vocab", required_argument, 0, 'v'},   {"doc-sep", required_argument, 0, 'e'},
      {"val-fraction", required_argument, 0, 'f'}, {"text-field", required_argument, 0, 't'},
      {"shard-tokens", required_argument, 0, 'n'}, {"force", no_argument, 0, 'r'},
      {"resume", no_argument, 0, 'R'},        {"no-pack", no_argument, 0, 'P'},
      {"shuffle", no_argument, 0, 'H'},       {"val-every", required_argument, 0, 'E'},
      {"tokenize-on-the-fly", no_argument, 0, 'I'},
      {"val-batches", required_argument, 0, 'B'}, {"ckpt-every", required_argument, 0, 'K'},
      {"accumulate", required_argument, 0, 'A'}, {"prompt", required_argument, 0, 'p'},
      {"tokens", required_argument, 0, 'T'},  {"temperature", required_argument, 0, 'm'},
      {"top-k", required_argument, 0, 'q'},  {"skip-nonfinite", required_argument, 0, 'X'},
      {"help", no_argument, 0, 'h'},          {"version", no_argument, 0, 'V'},
      {0, 0, 0, 0}};
  *o = (Options){.seed = 1337, .backend = "auto", .steps = -1, .pack = true, .reuse = true, .gemm_tuning = true,
                 .kernel_tuning = true,
                 .val_every = 100, .val_batches = 4,
                 .ckpt_every = 100,
                 .fuse = {.fuse = true, .chunk_lmhead = true, .max_group = 64}};
  prep_defaults(&o->prep);
  sample_defaults(&o->sample);
  int c;
  int64_t v;
  while ((c = getopt_long(argc, argv, "D:d:o:hV", longopts, NULL)) != -1) {
    switch (c) {
    case 'D': {
      char *eq = strchr(optarg, '=');
      if (!eq || eq == optarg || !parse_int(eq + 1, &v))
        return usage_error("-D wants NAME=INTEGER, got '%s'", optarg);
      if (o->ndims == 32)
        return usage_error("too many -D options (32 at most)%s", "");
      o->dims[o->ndims++] = (DimOverride){strndup(optarg, (size_t)(eq - optarg)), v};
      break;
    }
    case 'd':
      if (strspn(optarg, "PARCFM") != strlen(optarg))
        return usage_error("unknown dump letters in '%s' (known: P parse, A autodiff, R precision, C checkpoints, "
                           "F fusion, M memory)", optarg);
      o->dump = optarg;
      break;
    case 'o': o->out = optarg; break;
    case 'w': o->weights = optarg; break;
    case 'b': o->batch = optarg; break;
    case 'a': o->data = optarg; break;
    case 's':
      if (!parse_int(optarg, &o->steps) || o->steps < 0)
        return usage_error("--steps wants a count, got '%s'", optarg);
      break;
    case 'S':
      if (!parse_int(optarg, &v) || v < 0)
        return usage_error("--seed wants a non-negative integer, got '%s'", optarg);
      o->seed = (uint64_t)v;
      break;
    case 'k':
      if (strcmp(optarg, "interp") && strcmp(optarg, "cpu") && strcmp(optarg, "cuda") && strcmp(optarg, "auto"))
        return usage_error("unknown backend '%s' (available: auto, cuda, cpu, interp)", optarg);
      o->backend = optarg;
      break;
    case 'F': o->fp64 = true; break;
    case 'Q': {
      DType dt;
      if (!precision_parse(optarg, &dt) && strcmp(optarg, "auto"))
        return usage_error("--precision wants auto, fp32 or bf16, got '%s'", optarg);
      o->precision = optarg;
      break;
    }
    case 'c':
      if (strcmp(optarg, "none") && strcmp(optarg, "all") && strcmp(optarg, "auto") &&
          (strncmp(optarg, "auto=", 5) || checkpoint_budget(optarg + 5, (int64_t)1 << 40, &(bool){0}) < 0))
        return usage_error("--checkpoint wants none, all, auto or auto=BUDGET (bytes, 512MiB, 2GiB, or a fraction "
                           "of the memory such as 0.5), got '%s'", optarg);
      o->checkpoint = optarg;
      break;
    case 'N': o->fuse.fuse = false; break;
    case 'v':
      if (!parse_int(optarg, &v) || v < 256 || v > 65536)
        return usage_error("--vocab wants a size from 256 to 65536, got '%s'", optarg);
      o->prep.vocab = (int)v;
      break;
    case 'e': o->prep.doc_sep = optarg; break;
    case 'f': {
      char *end;
      o->prep.val_fraction = strtod(optarg, &end);
      if (*end || !(o->prep.val_fraction > 0 && o->prep.val_fraction <= 0.5))
        return usage_error("--val-fraction wants a fraction in (0, 0.5], got '%s'", optarg);
      break;
    }
    case 't': o->prep.text_field = optarg; break;
    case 'n':
      if (!parse_int(optarg, &o->prep.shard_tokens) || o->prep.shard_tokens <= 0)
        return usage_error("--shard-tokens wants a positive count, got '%s'", optarg);
      break;
    case 'r': o->prep.force = true; break;
    case 'R': o->resume = true; break;
    case 'p': o->sample.prompt = optarg; break;
    case 'T':
      if (!parse_int(optarg, &o->sample.tokens) || o->sample.tokens < 0)
        return usage_error("--tokens wants a count, got '%s'", optarg);
      break;
    case 'q':
      if (!parse_int(optarg, &o->sample.top_k) || o->sample.top_k < 0)
        return usage_error("--top-k wants a count (0: all), got '%s'", optarg);
      break;
    case 'm': {
      char *end;
      o->sample.temperature = strtod(optarg, &end);
      if (*end || !(o->sample.temperature >= 0 && o->sample.temperature <= 100))
        return usage_error("--temperature wants a number from 0 to 100, got '%s'", optarg);
      break;
    }
    case 'P': o->pack = false; break;
    case 'H': o->shuffle = true; break;
    case 'I': o->tokenize_on_the_fly = true; break;
    case 'E': case 'B': case 'K': case 'A': case 'X': {
      int64_t *dst = c == 'E' ? &o->val_every : c == 'B' ? &o->val_batches : c == 'K' ? &o->ckpt_every
                     : c == 'X' ? &o->skip_nonfinite : &o->accumulate;
      if (!parse_int(optarg, dst) || *dst < (c == 'B' || c == 'A'))
        return usage_error("expected a count, got '%s'", optarg);
      break;
    }
    case 'C': o->fuse.chunk_lmhead = false; break;
    case 'U': o->reuse = false; break;
    case 'G': o->gemm_tuning = false; break;
    case 'J': o->kernel_tuning = false; break;
    case 'O': o->profile = true; break;
    case 'h': fputs(usage_text, stdout); exit(0);
    case 'V': printf("mdlc %s\n", MDL_VERSION); exit(0);
    default: return usage_error("%s", "bad option");
    }
  }
  if (optind + 2 != argc)
    return usage_error("%s", optind == argc ? "no verb given" : "want exactly one VERB and one FILE.mdl");
  if (o->tokenize_on_the_fly && o->shuffle && o->pack)
    return usage_error("--tokenize-on-the-fly cannot --shuffle packed rows: a shuffled window w starts at token "
                       "w*T of the split, which only the whole split tokenised up front would tell; add --no-pack "
                       "(rows are documents) or leave out --shuffle%s", "");
  o->verb = argv[optind];
  o->file = argv[optind + 1];
  return 0;
}

static bool dumping(const Options *o, char letter) { return o->dump && strchr(o->dump, letter); }

static const char *backend_of(const Options *o);

// What `auto` precision is: bf16 (a GPU's tensor cores, and the numerics every back end reproduces),
// except for training or gradients on the CPU back end where the GEMM library has no bf16 GEMM faster
// than its f32 one (oneDNN without AMX: about half the rate), which run fp32. `why` says which.
static const char *auto_precision(const Options *o, const char **why) {
  static const char *chosen, *reason;
  if (!chosen) {
    bool executes = !strcmp(o->verb, "run") || !strcmp(o->verb, "grad");
    const char *backend = executes ? backend_of(o) : "none";
    char err[256];
    const GemmLib *lib = strcmp(backend, "cuda") && strcmp(backend, "none") ? rt_gemm(err, sizeof err) : NULL;
    static char buf[200];
    chosen = lib && !lib->bgemm ? "fp32" : "bf16";
    if (lib)
      snprintf(buf, sizeof buf, lib->bgemm ? "bf16: %s's bf16 GEMM (AMX) is faster than its fp32 one here"
                                           : "fp32: %s has no bf16 GEMM faster than its fp32 one on this CPU",
               lib->name);
    reason = !executes ? "bf16 where nothing runs" : !strcmp(backend, "cuda") ? "bf16 on a GPU"
             : !lib ? "bf16 (no GEMM library to ask)" : buf;
  }
  if (why)
    *why = reason;
  return chosen;
}

// The GEMM precision: --precision, else the train section's (`auto` resolved); an error where this
// build cannot run it.
static bool gemm_precision(const Options *o, Graph *g, DType *dt) {
  if (o->precision)
    g->train.precision = o->precision;
  if (!strcmp(g->train.precision, "auto")) {
    g->train.precision = auto_precision(o, NULL);
    g->train.precision_auto = true;
  }
  if (precision_parse(g->train.precision, dt))
    return true;
  const char *msg = "precision = %s: FP8 GEMMs are not implemented yet; use bf16 or fp32";
  if (g->train.precision_at.line > 0)
    diag_error(g->train.precision_at, msg, g->train.precision);
  else
    diag_file_error(o->file, msg, g->train.precision);
  return false;
}

// The precision pass on a graph with its backward.
static bool apply_precision(const Options *o, Graph *g) {
  DType dt;
  if (!gemm_precision(o, g, &dt))
    return false;
  char why[512];
  if (!precision_assign(g, dt, why, sizeof why)) {
    fprintf(stderr, "%s: internal error: the precision pass built a broken graph: %s\n", o->file, why);
    return false;
  }
  return true;
}

// The memory a checkpoint budget is measured against: the device's free memory on a GPU, else the
// host's available memory; -1 when unknown. `what` says which.
static int64_t memory_there(const Options *o, const char **what) {
  static int64_t bytes = -2;
  static const char *said;
  if (bytes == -2) {
    CudaDevice d;
    char why[256];
    if (!strcmp(backend_of(o), "cuda") && cuda_device(&d, why, sizeof why)) {
      bytes = cuda_free_memory(&d);
      said = "free on the GPU";
      if (bytes > 0) // (the engine's own: cuBLASLt's workspace, the modules, the graph)
        bytes -= bytes / 20;
    } else {
      static char buf[128];
      bytes = rt_host_memory_available(&said);
      snprintf(buf, sizeof buf, "available (%s)", said);
      said = buf;
    }
  }
  *what = said;
  return bytes;
}

// The checkpoint pass on a training graph: --checkpoint, else the train section's, else auto; auto's
// budget, where none is given, is the memory there is (memory_there). With dumping C, every saved
// value, kept or recomputed.
static bool apply_checkpoint(const Options *o, Graph *g) {
  const char *spec = o->checkpoint ? o->checkpoint : g->train.checkpoint ? g->train.checkpoint : "auto";
  const char *policy = spec, *how = NULL, *what = "";
  int64_t budget = 0;
  if (!strncmp(spec, "auto", 4)) {
    policy = "auto";
    int64_t mem = memory_there(o, &what);
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

// Front end, then autodiff (+ optimizer) when `train` is set; validates after each pass.
static Graph *compile(Arena *a, const Options *o, bool grads, bool optimizer) {
  Graph *g = mdl_compile_file(a, o->file, o->dims, o->ndims);
  if (!g)
    return NULL;
  if (o->accumulate > 0)
    g->train.accumulate = o->accumulate;
  char why[512];
  if (!ir_validate(g, why, sizeof why)) {
    fprintf(stderr, "%s: internal error: the front end built a broken graph: %s\n", o->file, why);
    return NULL;
  }
  if (dumping(o, 'P'))
    ir_dump(g, stdout);
  DType dt;
  if (!gemm_precision(o, g, &dt))
    return NULL;
  if (!grads)
    return g;
  if (g->loss < 0) {
    diag_file_error(o->file, "no 'output loss = ...': nothing to train");
    return NULL;
  }
  if (!autodiff(g, optimizer)) {
    diag_file_error(o->file, "autodiff: %s", g->err);
    return NULL;
  }
  if (!ir_validate(g, why, sizeof why)) {
    fprintf(stderr, "%s: internal error: autodiff built a broken graph: %s\n", o->file, why);
    return NULL;
  }
  if (dumping(o, 'A'))
    ir_dump(g, stdout);
  if (!apply_precision(o, g))
    return NULL;
  if (dumping(o, 'R'))
    ir_dump(g, stdout);
  if (!apply_checkpoint(o, g))
    return NULL;
  return g;
}

typedef struct {
  Fusion *f;
  MemPlan *m;
} Plan;

// The passes a compiled back end adds: fuse, then plan memory. Dumps F and M.
static Plan plan(const Options *o, Graph *g) {
  Plan p = {.f = fuse(g, o->fuse)};
  p.m = memplan_with(p.f, o->reuse);
  if (dumping(o, 'F'))
    fuse_dump(p.f, stdout);
  if (dumping(o, 'M'))
    memplan_dump(p.f, p.m, stdout);
  return p;
}

static int cmd_check(const Options *o, Graph *g) {
  if (dumping(o, 'F') || dumping(o, 'M'))
    plan(o, g);
  char buf[128];
  printf("model %s: %lld parameters in %d tensors\n", g->model ? g->model : "?", (long long)ir_param_count(g),
         g->nparams);
  printf("dims:");
  for (int i = 0; i < g->ndims; i++)
    printf(" %s=%lld", g->dims[i].name, (long long)g->dims[i].value);
  printf("\n");
  for (int i = 0; i < g->fwd_end; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op == OP_INPUT)
      printf("input  %-24s %s%s\n", n->name, dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf));
  }
  for (int i = 0; i < g->nparams; i++) {
    const IrNode *n = g->nodes[g->params[i]];
    printf("param  %-24s %s%s%s\n", n->name, dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf),
           n->init.decay ? "" : "  (no weight decay)");
  }
  for (int i = 0; i < g->noutputs; i++) {
    const IrNode *n = g->nodes[g->outputs[i]];
    printf("output %-24s %s%s\n", n->name ? n->name : "?", dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf));
  }
  return 0;
}

// Copies every parameter from a safetensors file; names and shapes must match the model.

// The engine the options ask for: the interpreter, or the plan compiled for the CPU.
// The back end --backend names; "auto" is CUDA when a driver, a device and NVRTC are there, else
// the CPU (saying why in one line, once).
static const char *backend_of(const Options *o) {
  static const char *chosen;
  if (strcmp(o->backend, "auto"))
    return o->backend;
  if (!chosen) {
    char why[256];
    chosen = cuda_available(why, sizeof why) ? "cuda" : "cpu";
    if (!strcmp(chosen, "cpu"))
      fprintf(stderr, "mdlc: %s; using the CPU back end\n", why);
  }
  return chosen;
}

// The dense bf16 peak of the GPU MFU is measured against (cuda_bf16_peak).
static void gpu_peak(const CudaDevice *d, Engine *e) {
  char how[160];
  e->peak_flops = cuda_bf16_peak(d, how, sizeof how);
  e->peak_how = arena_strdup(e->g->arena, how);
}

// The GEMM library the CPU back end runs, its kernels and what a short probe measured; a warning
// when its kernels are a fallback older than the CPU.
static void gemm_report(const GemmLib *lib) {
  rt_gemm_probe();
  printf("GEMM: %s, %s kernels%s: %.0f GFLOP/s fp32", lib->name, lib->kernels, lib->how, lib->sgemm_gflops);
  if (lib->bgemm)
    printf(", %.0f GFLOP/s bf16", lib->bgemm_gflops);
  printf(" (a 256x768x768 product split over the cores)\n");
  if (lib->generic)
    fprintf(stderr, "mdlc: warning: %s runs its generic %s kernels on a CPU with AVX2 or later: GEMMs at a fraction "
            "of their speed (install oneDNN, Debian's libdnnl2, or name the CPU's family in OPENBLAS_CORETYPE)\n",
            lib->name, lib->kernels);
}

// The CPU back end's arenas must fit in the memory the machine has left, checked before anything is
// compiled or allocated: an arena is mapped without being touched, so one larger than the memory
// would be granted and the run killed once its steps reached its pages. `planned` adds up the arenas
// of the engines one run opens (training, validation, micro-batches).
static bool host_memory_fits(const Options *o, const Graph *g, int64_t arena_bytes) {
  static int64_t planned;
  const char *what;
  int64_t avail = rt_host_memory_available(&what);
  planned += arena_bytes;
  if (avail < 0 || planned <= avail)
    return true;
  diag_file_error(o->file, "%s does not fit in memory: its arenas need %.2f GB (this one %.2f GB for %lld parameters), "
                  "this machine has %.2f GB available (%s)", g->model ? g->model : "the model", (double)planned / 1e9,
                  (double)arena_bytes / 1e9, (long long)ir_param_count(g), (double)avail / 1e9, what);
  return false;
}

// With `report`, one line on what was compiled.
static Engine *open_engine(const Options *o, Graph *g, bool report) {
  const char *backend = backend_of(o);
  if (!strcmp(backend, "interp"))
    return engine_interp(g, o->fp64 ? INTERP_F64 : INTERP_F32, o->seed);
  char err[512];
  Plan p = plan(o, g);
  if (!strcmp(backend, "cuda")) {
    Engine *e = engine_cuda(p.f, p.m, o->seed, o->gemm_tuning, o->kernel_tuning, err, sizeof err);
    CudaDevice d;
    if (!e)
      diag_file_error(o->file, "%s", err);
    else if (cuda_device(&d, err, sizeof err))
      gpu_peak(&d, e);
    return e;
  }
  if (!host_memory_fits(o, g, p.m->arena_bytes))
    return NULL;
  char *source = emit_c(p.f, p.m, o->file);
  if (!source)
    return NULL;
  Engine *e = engine_cpu(p.f, p.m, source, o->seed, err, sizeof err);
  if (!e)
    diag_file_error(o->file, "%s", err);
  if (e && report) { // and MFU against the peak of what the GEMMs run on: AMX's where they are bf16 there
    const GemmLib *lib = rt_gemm(err, sizeof err);
    gemm_report(lib);
    const char *how;
    e->peak_flops = rt_cpu_peak_flops(lib->bgemm && !strcmp(g->train.precision, "bf16"), &how);
    e->peak_how = arena_strdup(g->arena, how);
  }
  if (e && report)
    printf("compiled %s for the CPU: %d kernels (fusion %s), arena %.1f MB (activations %.1f MB), %s\n", g->model,
           p.f->nsteps, o->fuse.fuse ? "on" : "off", (double)p.m->arena_bytes / 1e6,
           (double)p.m->activation_bytes / 1e6,
           e->cache_hit ? "module from the cache" : arena_printf(g->arena, "cc took %.2f s", e->compile_seconds));
  return e;
}

// Copies every parameter from a safetensors file; names and shapes must match the model.
static bool load_weights(Engine *e, const Graph *g, const char *path) {
  Arena *a = arena_new();
  StFile f;
  bool ok = st_read(a, path, &f);
  for (int i = 0; ok && i < g->nparams; i++) {
    const StTensor *t = st_expect(&f, path, "", g->nodes[g->params[i]]);
    ok = t != NULL;
    if (ok)
      e->write(e, g->params[i], t->data);
  }
  arena_free(a);
  return ok;
}

// Writes the values of `count` nodes, as f32, under the given names.
static bool write_values(const char *path, Engine *e, const int *nodes, const char **names, int count) {
  StTensor *t = rt_xrealloc(NULL, (size_t)count * sizeof *t);
  for (int i = 0; i < count; i++) {
    const IrNode *n = e->g->nodes[nodes[i]];
    int64_t numel = shape_numel(n->shape);
    float *d = rt_xrealloc(NULL, sizeof(float) * (size_t)(numel ? numel : 1));
    e->read(e, n->id, d);
    t[i] = (StTensor){.name = names[i], .dtype = DT_F32, .shape = n->shape, .data = d};
  }
  bool ok = st_write(path, t, count);
  for (int i = 0; i < count; i++)
    free(t[i].data);
  free(t);
  return ok;
}

static bool write_params(const char *path, Engine *e) {
  const Graph *g = e->g;
  const char **names = calloc((size_t)g->nparams, sizeof *names);
  for (int i = 0; i < g->nparams; i++)
    names[i] = g->nodes[g->params[i]]->name;
  bool ok = write_values(path, e, g->params, names, g->nparams);
  free(names);
  return ok;
}

static int cmd_init(const Options *o, Graph *g) {
  if (!o->out)
    return usage_error("init needs -o W.safetensors%s", "");
  Engine *e = engine_interp(g, INTERP_F32, o->seed);
  bool ok = write_params(o->out, e);
  e->free(e);
  if (ok)
    printf("wrote %d parameters (%lld values, seed %llu) to %s\n", g->nparams, (long long)ir_param_count(g),
           (unsigned long long)o->seed, o->out);
  return ok ? 0 : EXIT_USER;
}

// Sets every model input from a batch file (i32 or f32 tensors named as the inputs).
static bool load_batch(Engine *e, const Graph *g, const char *path) {
  Arena *a = arena_new();
  StFile f;
  bool ok = st_read(a, path, &f);
  for (int i = 0; ok && i < g->fwd_end; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op != OP_INPUT)
      continue;
    const StTensor *t = st_expect(&f, path, "", n);
    if (!t) {
      ok = false;
    } else if (!e->set_input(e, n->name, n->dtype == DT_I32 ? t->data : NULL, n->dtype == DT_F32 ? t->data : NULL,
                             shape_numel(n->shape))) {
      diag_file_error(path, "cannot set input '%s'", n->name);
      ok = false;
    }
  }
  arena_free(a);
  return ok;
}

static int cmd_grad(const Options *o, Graph *g) {
  if (!o->out || !o->weights || !o->batch)
    return usage_error("grad needs --weights W --batch BATCH -o OUT%s", "");
  Engine *e = open_engine(o, g, false);
  if (!e)
    return EXIT_USER;
  char err[512];
  int rc = EXIT_USER;
  if (load_weights(e, g, o->weights) && load_batch(e, g, o->batch)) {
    if (!e->step(e, err, sizeof err)) {
      diag_file_error(o->file, "%s", err);
    } else {
      int count = g->nparams + 1;
      int *nodes = calloc((size_t)count, sizeof *nodes);
      const char **names = calloc((size_t)count, sizeof *names);
      nodes[0] = g->loss;
      names[0] = "loss";
      for (int i = 0; i < g->nparams; i++) {
        nodes[i + 1] = g->grads[i];
        names[i + 1] = g->nodes[g->params[i]]->name;
      }
      if (write_values(o->out, e, nodes, names, count)) {
        printf("loss %.6f; wrote the loss and %d gradients to %s (%s)\n", engine_scalar(e, g->loss), g->nparams,
               o->out, e->name);
        rc = 0;
      }
      free(nodes);
      free(names);
    }
  }
  e->free(e);
  return rc;
}

// Writes DIR/model.c, DIR/model.cu, DIR/plan.txt (fusion and memory plan) and DIR/fusion.txt.
static int cmd_build(const Options *o, Graph *g) {
  if (!o->out)
    return usage_error("build needs -o DIR%s", "");
  if (mkdir(o->out, 0777) && errno != EEXIST) {
    diag_file_error(o->out, "cannot create the directory: %s", strerror(errno));
    return EXIT_USER;
  }
  Plan on = plan(o, g);
  char *c_source = emit_c(on.f, on.m, o->file);
  FuseOptions fo_off = o->fuse;
  fo_off.fuse = false;
  Fusion *off = fuse(g, fo_off);
  MemPlan *moff = memplan(off);
  char *cu_source = emit_cuda(on.f, on.m, o->file);
  if (!c_source || !cu_source)
    return EXIT_USER;
  char path[4096];
  struct {
    const char *name;
    int what;
  } files[] = {{"model.c", 0}, {"model.cu", 3}, {"plan.txt", 1}, {"fusion.txt", 2}};
  for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
    snprintf(path, sizeof path, "%s/%s", o->out, files[i].name);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
      diag_file_error(tmp, "cannot write: %s", strerror(errno));
      return EXIT_USER;
    }
    if (files[i].what == 0)
      fputs(c_source, f);
    else if (files[i].what == 3)
      fputs(cu_source, f);
    else if (files[i].what == 1) {
      fuse_dump(on.f, f);
      fputc('\n', f);
      memplan_dump(on.f, on.m, f);
    } else
      fusion_report(on.f, off, on.m, moff, f);
    if (fclose(f) || rename(tmp, path)) {
      diag_file_error(path, "cannot write: %s", strerror(errno));
      return EXIT_USER;
    }
  }
  printf("%s: %d kernels (%d unfused), arena %.2f MB (activations %.2f MB) -> %s/{model.c,model.cu,plan.txt,fusion.txt}\n",
         g->model, on.f->nsteps, off->nsteps, (double)on.m->arena_bytes / 1e6, (double)on.m->activation_bytes / 1e6,
         o->out);
  char line[1024];
  checkpoint_summary(&g->ckpt, true, true, line, sizeof line);
  printf("%s\n", line);
  return 0;
}

// The forward graph alone (validation loss, dropout off), or forward + backward without the
// optimizer (the micro-batches of gradient accumulation), on the same back end.
static Engine *open_side_engine(const Options *o, Arena *a, bool grads) {
  Graph *g = mdl_compile_file(a, o->file, o->dims, o->ndims);
  if (!g || g->loss < 0 || (grads && !autodiff(g, false)) || !apply_precision(o, g))
    return NULL;
  Options quiet = *o;
  quiet.dump = NULL;
  if (grads && !apply_checkpoint(&quiet, g))
    return NULL;
  if (!grads) { // validation reads the loss alone: no named output is kept, so the LM head's logits are
    ir_eval_mode(g); // never whole (rule 2 of fuse.c chunks it: 5.3 GB of them at GPT-2 124M, B=205, T=128)
    g->noutputs = 0;
  }
  return open_engine(&quiet, g, false);
}

static int cmd_run(const Options *o, Graph *g) {
  if (!o->data) {
    diag_file_error(o->file, "run needs --data DIR: shards made by `mdlc prep TEXT -o DIR`");
    return EXIT_USER;
  }
  char model_abs[PATH_MAX], data_abs[PATH_MAX], tok_path[PATH_MAX + 16], out_dir[PATH_MAX];
  if (!realpath(o->file, model_abs) || !realpath(o->data, data_abs)) {
    diag_file_error(realpath(o->file, model_abs) ? o->data : o->file, "cannot resolve the path: %s", strerror(errno));
    return EXIT_USER;
  }
  snprintf(tok_path, sizeof tok_path, "%s/tokenizer.bin", data_abs);
  snprintf(out_dir, sizeof out_dir, "%s", o->out ? o->out : "out");
  if (o->tokenize_on_the_fly) { // (before anything is compiled or written: the loader checks again)
    Source src;
    bool same = source_read(data_abs, &src) && source_check(&src, data_abs);
    source_free(&src);
    if (!same)
      return EXIT_USER;
  }
  Tokenizer *tok = tok_load(tok_path);
  if (!tok)
    return EXIT_USER;
  int vocab = tok_vocab(tok);
  tok_free(tok);
  int64_t V = ir_dim(g, "V");
  if (V >= 0 && vocab > V) {
    diag_file_error(tok_path, "the data's tokenizer has %d tokens, more than the model's V = %lld: prepare the data "
                    "with --vocab %lld or run with -D V=%d", vocab, (long long)V, (long long)V, vocab);
    return EXIT_USER;
  }
  bool created;
  int lock = train_claim_out(out_dir, o->resume, &created);
  if (lock < 0)
    return EXIT_USER;
  Engine *e = open_engine(o, g, true);
  if (!e) {
    train_release_out(lock, out_dir, created);
    return EXIT_USER;
  }
  Arena *ea = arena_new();
  Engine *eval = open_side_engine(o, ea, false);
  Engine *micro = g->train.accumulate > 1 ? open_side_engine(o, ea, true) : NULL;
  int rc = EXIT_USER;
  if (eval && (micro || g->train.accumulate <= 1) && (!o->weights || load_weights(e, g, o->weights))) {
    const char *why = NULL;
    if (g->train.precision_auto)
      auto_precision(o, &why);
    printf("training %s (%lld parameters), back end %s%s, precision %s%s%s\n", g->model,
           (long long)ir_param_count(g), e->name, strcmp(backend_of(o), "interp") && !o->fuse.fuse ? " (fusion off)" : "",
           why ? "auto, " : "", why ? why : g->train.precision, o->resume ? ", resuming" : "");
    char line[1024];
    checkpoint_summary(&g->ckpt, true, true, line, sizeof line);
    printf("%s\n", line);
    TrainOptions to = {.model_path = model_abs, .data_dir = data_abs, .tokenizer_path = tok_path, .out_dir = out_dir,
                       .steps = o->steps, .resume = o->resume, .pack = o->pack, .shuffle = o->shuffle,
                       .tokenize_on_the_fly = o->tokenize_on_the_fly,
                       .seed = o->seed, .val_every = o->val_every, .val_batches = o->val_batches,
                       .ckpt_every = o->ckpt_every, .skip_nonfinite = o->skip_nonfinite, .out_claimed = true};
    e->profile = o->profile && e->kernel_seconds;
    if (o->profile && !e->profile)
      printf("--profile: the %s back end runs op by op, with nothing to time by kernel; the compiled back ends "
             "(--backend cpu or cuda) have a profile\n", backend_of(o));
    rc = train_run(e, eval, micro, &to);
    created = false; // (what the run wrote stays)
    if (rc == 0)
      engine_profile_report(e, stdout);
  }
  if (eval)
    eval->free(eval);
  if (micro)
    micro->free(micro);
  arena_free(ea);
  e->free(e);
  train_release_out(lock, out_dir, created);
  return rc;
}

// The verb of o, run; its exit status.
static int run_verb(Options *o) {
  if (!strcmp(o->verb, "sample")) {
    o->sample.checkpoint = o->file;
    o->sample.seed = o->seed;
    return sample_run(&o->sample);
  }
  if (!strcmp(o->verb, "prep")) {
    if (!o->out)
      return usage_error("prep needs -o DIR%s", "");
    o->prep.input = o->file;
    o->prep.out_dir = o->out;
    return prep_run(&o->prep);
  }
  static const struct {
    const char *verb;
    int (*fn)(const Options *, Graph *);
    bool grads, optimizer;
  } verbs[] = {
      {"check", cmd_check, false, false},
      {"init", cmd_init, false, false},
      {"grad", cmd_grad, true, false},
      {"build", cmd_build, true, true},
      {"run", cmd_run, true, true},
  };
  for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++) {
    if (strcmp(o->verb, verbs[i].verb))
      continue;
    Arena *a = arena_new();
    bool train = verbs[i].optimizer || dumping(o, 'A') || dumping(o, 'R') || dumping(o, 'C') || dumping(o, 'F') ||
                 dumping(o, 'M');
    Graph *g = compile(a, o, verbs[i].grads || train, train);
    int rc = g ? verbs[i].fn(o, g) : EXIT_USER;
    arena_free(a);
    return rc;
  }
  return usage_error("unknown verb '%s' (verbs: check, init, grad, prep, build, run, sample)", o->verb);
}

int main(int argc, char **argv) {
  Options o;
  int rc = parse_options(argc, argv, &o);
  if (!rc)
    rc = run_verb(&o);
  for (int i = 0; i < o.ndims; i++)
    free((char *)o.dims[i].name);
  return rc;
}
