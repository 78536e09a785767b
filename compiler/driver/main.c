// main.c: the mdlc command line. Each verb runs the pipeline as far as it needs:
//   parse + check (front end) -> autodiff + AdamW -> fuse -> plan memory -> emit C -> cc + dlopen
// (or the reference interpreter instead of the last three), and `-d LETTERS` prints the IR after
// the passes it names (P: parse, A: autodiff, R: precision, F: fusion, M: memory plan).
#include "backend.h"
#include "emit_c.h"
#include "cuda.h"
#include "data.h"
#include "emit_cuda.h"
#include "mdl.h"
#include "runtime.h"
#include "sample.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

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
  const char *settings[32]; // --set KEY=VALUE, in order (lower.settings points here)
  const char *out, *weights, *batch, *data, *backend;
  const char *text; // the model's text where it is not read from `file` (eval: the checkpoint's copy)
  const char *precision; // --precision, else the train section's
  const char *checkpoint; // --checkpoint, else the train section's
  int64_t steps;
  uint64_t seed;
  bool fp64;
  FuseOptions fuse;
  LowerOptions lower; // --attention plain, --no-doc-mask: how the front end lowers attention
  bool reuse; // the memory planner shares memory between activations whose lives do not overlap
  bool profile;
  bool gemm_tuning; // the CUDA back end times cuBLASLt's candidates for each GEMM (--no-gemm-tuning)
  bool kernel_tuning; // and each kernel that has a variant against it (--no-kernel-tuning)
  PrepOptions prep;
  bool resume, pack, shuffle;
  int shuffle_set; // +1 --shuffle, -1 --no-shuffle, 0 neither: shuffled, but in order from the text packed
  bool pack_set, seed_set; // --no-pack, --seed given (a resumed run takes the checkpoint's otherwise)
  bool tokenize_on_the_fly; // training batches tokenised from the text as drawn (--tokenize-on-the-fly)
  int64_t val_every, val_batches, ckpt_every;
  int64_t accumulate; // > 0 overrides the train section's
  int64_t skip_nonfinite; // steps with a non-finite loss or gradient norm skipped (with a warning each)
  int64_t log_every; // a full step line every N steps (0: train_log_every's choice)
  bool quiet;        // run: errors and the final summary only
  int zero;          // run under mpirun/srun: the ZeRO stage, 0 or 1 (--zero)
  const char *cpu_reduce; // --bucket-mb or --overlap, as given (the CPU back end's all-reduce), else NULL
  SampleOptions sample;
  const char *lab_budget; // lab: --memory-budget
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
    "                                 compile and train on shards from prep, or on arrays named as the\n"
    "                                 model's inputs (.npy, .npz, .safetensors: a folder or a file; without\n"
    "                                 a val/ split, --val-fraction F of the examples held out, default 0.05)\n"
    "  eval  CHECKPOINT --data DIR [--val-batches N]\n"
    "                                 the validation loss (and every scalar output) of a checkpoint of\n"
    "                                 run, without training: the batches run validates on (packed and\n"
    "                                 shuffled as the checkpoint records), given the run's --backend\n"
    "                                 and --precision\n"
    "  lab   FILE.mdl --data DIR [--steps N] [--out DIR] [--memory-budget SIZE]\n"
    "                                 what each technique is worth here: the model trained with all\n"
    "                                 of them off, then one added per row, then each taken away alone;\n"
    "                                 tables in DIR/lab.md, lab.csv, lab.svg (default DIR: lab; N: 20\n"
    "                                 steps a row; SIZE: checkpointing's budget, default the step's\n"
    "                                 peak without it)\n"
    "\n"
    "options:\n"
    "  -D, --dim NAME=N       bind a dimension (overrides the train section)\n"
    "      --set KEY=VALUE    a train setting over the train section's, checked as it is: a setting\n"
    "                         (clip=0.5, precision=fp32, optimizer=adamw(lr=1e-3)), a free dim, or one\n"
    "                         argument of the optimizer or the schedule (lr=1e-3, warmup=100)\n"
    "  -d, --dump LETTERS     print the IR after passes: P parse, A autodiff + optimizer,\n"
    "                         R precision, C checkpoints (saved values, kept or recomputed),\n"
    "                         F fusion, M memory plan\n"
    "  -o, --out PATH         output file\n"
    "      --weights PATH     load parameters from a safetensors file\n"
    "      --batch PATH       a batch as safetensors (tokens, targets, pos, doc: i32 [B,T])\n"
    "      --data DIR         shards and tokenizer made by `mdlc prep`\n"
    "      --out DIR          checkpoint, log.jsonl and loss.svg (default: out)\n"
    "      --dist-timeout S   under mpirun/srun (data parallel, B per rank): how long a rank waits for\n"
    "                         the others at an all-reduce before it names the missing ones and stops\n"
    "                         every rank (default 300)\n"
    "      --bucket-mb MB     under mpirun/srun on the CPU: the gradients are all-reduced in buckets of\n"
    "                         MB MiB (default 25); 0: in one all-reduce\n"
    "      --overlap          and each bucket reduced on a thread of its own as soon as the backward has\n"
    "                         finished it, while the backward goes on (pays where a core is free for it)\n"
    "      --zero 0|1         under mpirun/srun: 1 shards the optimizer's state (ZeRO stage 1): each rank\n"
    "                         keeps and updates the moments of its share of the parameters, then the\n"
    "                         updated parameters are all-gathered (default 0; alone: one shard, no change)\n"
    "      --resume           continue the checkpoint in --out exactly: with its --seed, --no-shuffle,\n"
    "                         --no-pack and --accumulate (given with another value: refused)\n"
    "      --no-pack          one padded document per row instead of packed rows\n"
    "      --no-shuffle       batches in the data's order (the default: shuffled, deterministic from --seed;\n"
    "                         --shuffle says so explicitly)\n"
    "      --tokenize-on-the-fly  read the text prep made the shards from (DIR/source.txt) and tokenise\n"
    "                         each training batch as it is drawn, in the step's time, nothing prepared\n"
    "                         ahead (to measure what the shards are worth): the same batches; validation\n"
    "                         batches still come from the shards; packed rows in order (shuffled with --no-pack)\n"
    "      --val-every N      validation loss every N steps (default 100; and at the end)\n"
    "      --val-batches N    batches per validation (default 4)\n"
    "      --ckpt-every N     a checkpoint every N steps (default 100; and at the end)\n"
    "      --accumulate N     gradients accumulated over N micro-batches per step\n"
    "      --skip-nonfinite N skip up to N steps whose loss or gradient norm is not finite (a warning\n"
    "                         each; default 0: the run stops at the first, its weights not updated)\n"
    "      --steps N          training steps, at least 1 (default: the train section's, else 100)\n"
    "      --log-every N      a full step line every N steps, and at the first, the last and each\n"
    "                         validation (default: 1, 2, 5, 10, 20, ... so that a run prints 20 to 50);\n"
    "                         on a terminal a progress line stands for the steps between\n"
    "      --quiet            run: no step lines, errors and the final summary only\n"
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
    "      --attention A      flash (the default: one fused attention op, a kernel of its own) or plain:\n"
    "                         the scores materialised as [B,H,T,T], masked, softmax, then times V, in\n"
    "                         GEMMs and kernels as an unfused framework runs it (memory quadratic in T)\n"
    "      --no-doc-mask      attention ignores doc= and is causal over the whole packed row, so documents\n"
    "                         attend to each other: for the lab and the tests that show the leak, not for\n"
    "                         training\n"
    "      --no-fuse          one kernel per IR node (to measure what fusion is worth)\n"
    "      --no-chunk-lmhead  materialise the whole logits instead of running the LM head by chunks\n"
    "      --optimizer-per-param  AdamW as one kernel per parameter tensor (as torch.optim.AdamW with\n"
    "                         foreach=False) instead of one fused kernel over them all\n"
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

// An integer, the whole of s; false for anything else, a value beyond int64_t included (strtoll would
// saturate it).
static bool parse_int(const char *s, int64_t *v) {
  char *end;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (!*s || *end || errno == ERANGE)
    return false;
  *v = x;
  return true;
}

// Digits after an optional sign: an integer's text, whether or not int64_t holds its value.
static bool integer_text(const char *s) {
  s += *s == '-' || *s == '+';
  return *s && strspn(s, "0123456789") == strlen(s);
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
      {"attention", required_argument, 0, 'L'}, {"no-doc-mask", no_argument, 0, 'Y'},
      {"vocab", required_argument, 0, 'v'},   {"doc-sep", required_argument, 0, 'e'},
      {"val-fraction", required_argument, 0, 'f'}, {"text-field", required_argument, 0, 't'},
      {"shard-tokens", required_argument, 0, 'n'}, {"force", no_argument, 0, 'r'},
      {"resume", no_argument, 0, 'R'},        {"no-pack", no_argument, 0, 'P'},
      {"shuffle", no_argument, 0, 'H'},       {"no-shuffle", no_argument, 0, 'W'},
      {"val-every", required_argument, 0, 'E'},
      {"tokenize-on-the-fly", no_argument, 0, 'I'},
      {"val-batches", required_argument, 0, 'B'}, {"ckpt-every", required_argument, 0, 'K'},
      {"accumulate", required_argument, 0, 'A'}, {"prompt", required_argument, 0, 'p'},
      {"tokens", required_argument, 0, 'T'},  {"temperature", required_argument, 0, 'm'},
      {"top-k", required_argument, 0, 'q'},  {"skip-nonfinite", required_argument, 0, 'X'},
      {"optimizer-per-param", no_argument, 0, 'Z'}, {"memory-budget", required_argument, 0, 'M'},
      {"log-every", required_argument, 0, 1001}, {"set", required_argument, 0, 1002},
      {"dist-timeout", required_argument, 0, 1003}, {"quiet", no_argument, 0, 'j'},
      {"bucket-mb", required_argument, 0, 1004}, {"overlap", no_argument, 0, 1005},
      {"zero", required_argument, 0, 1006},
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
        return usage_error(eq && eq > optarg && integer_text(eq + 1)
                               ? "-D %s: the value overflows a 64-bit integer (-9223372036854775808 to "
                                 "9223372036854775807)"
                               : "-D wants NAME=INTEGER, got '%s'",
                           optarg);
      if (o->ndims == 32)
        return usage_error("too many -D options (32 at most)%s", "");
      o->dims[o->ndims++] = (DimOverride){xstrndup(optarg, (size_t)(eq - optarg), "a -D option"), v};
      break;
    }
    case 1003: {
      char *end;
      double s = strtod(optarg, &end);
      if (!*optarg || *end || !(s > 0))
        return usage_error("--dist-timeout wants seconds (> 0), got '%s'", optarg);
      dist_set_timeout(s);
      break;
    }
    case 1004: {
      char *end;
      double mb = strtod(optarg, &end);
      if (!*optarg || *end || !(mb >= 0) || mb > 1e6)
        return usage_error("--bucket-mb wants megabytes (>= 0; 0: one all-reduce), got '%s'",
                           optarg);
      dist_set_bucket((int64_t)(mb * 1048576));
      o->cpu_reduce = "--bucket-mb";
      break;
    }
    case 1005:
      dist_set_overlap(true);
      o->cpu_reduce = "--overlap";
      break;
    case 1006:
      if (strcmp(optarg, "0") && strcmp(optarg, "1"))
        return usage_error("--zero wants the ZeRO stage, 0 (off) or 1 (the optimizer's state sharded over the "
                           "ranks), got '%s'", optarg);
      o->zero = optarg[0] - '0';
      break;
    case 1002:
      if (!strchr(optarg, '=') || optarg[0] == '=')
        return usage_error("--set wants KEY=VALUE (e.g. --set lr=1e-3), got '%s'", optarg);
      if (o->lower.nsettings == 32)
        return usage_error("too many --set options (32 at most)%s", "");
      o->settings[o->lower.nsettings++] = optarg;
      o->lower.settings = o->settings;
      break;
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
      if (!parse_int(optarg, &o->steps) || o->steps <= 0)
        return usage_error("--steps wants a positive count, got '%s'; use `mdlc eval` to evaluate without training",
                           optarg);
      break;
    case 'S':
      if (!parse_int(optarg, &v) || v < 0)
        return usage_error("--seed wants a non-negative integer, got '%s'", optarg);
      o->seed = (uint64_t)v;
      o->seed_set = true;
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
        return usage_error("--precision wants auto, fp32, bf16 or fp8, got '%s'", optarg);
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
    case 'L':
      if (strcmp(optarg, "flash") && strcmp(optarg, "plain"))
        return usage_error("--attention wants flash or plain, got '%s'", optarg);
      o->lower.plain_attention = !strcmp(optarg, "plain");
      break;
    case 'Y': o->lower.no_doc_mask = true; break;
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
    case 'P': o->pack = false, o->pack_set = true; break;
    case 'H': o->shuffle_set = 1; break;
    case 'W': o->shuffle_set = -1; break;
    case 'I': o->tokenize_on_the_fly = true; break;
    case 'E': case 'B': case 'K': case 'A': case 'X': {
      int64_t *dst = c == 'E' ? &o->val_every : c == 'B' ? &o->val_batches : c == 'K' ? &o->ckpt_every
                     : c == 'X' ? &o->skip_nonfinite : &o->accumulate;
      if (!parse_int(optarg, dst) || *dst < (c == 'B' || c == 'A'))
        return usage_error("expected a count, got '%s'", optarg);
      if (c == 'A' && *dst > CKPT_MAX_ACCUMULATE)
        return usage_error("--accumulate takes at most 1048576 micro-batches a step, got '%s'", optarg);
      break;
    }
    case 1001:
      if (!parse_int(optarg, &o->log_every) || o->log_every <= 0)
        return usage_error("--log-every wants a positive count, got '%s'", optarg);
      break;
    case 'j': o->quiet = true; break;
    case 'C': o->fuse.chunk_lmhead = false; break;
    case 'Z': o->fuse.optimizer_per_param = true; break;
    case 'M':
      if (checkpoint_budget(optarg, (int64_t)1 << 40, &(bool){0}) < 0)
        return usage_error("--memory-budget wants bytes, 512MiB, 2GiB or a fraction of the memory such as 0.5, got "
                           "'%s'", optarg);
      o->lab_budget = optarg;
      break;
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
  if (o->tokenize_on_the_fly && o->shuffle_set > 0 && o->pack)
    return usage_error("--tokenize-on-the-fly cannot --shuffle packed rows: a shuffled window w starts at token "
                       "w*T of the split, which only the whole split tokenised up front would tell; add --no-pack "
                       "(rows are documents) or leave out --shuffle%s", "");
  o->shuffle = o->shuffle_set > 0 || (!o->shuffle_set && !(o->tokenize_on_the_fly && o->pack));
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
    bool executes = !strcmp(o->verb, "run") || !strcmp(o->verb, "grad") || !strcmp(o->verb, "eval");
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
  if (!precision_parse(g->train.precision, dt))
    return false; // (sema and the options accept no other name)
  if (*dt != DT_F8E4M3)
    return true;
  // fp8 runs on the CPU (emulated: the interpreter and the C back end) and on GPUs with FP8 tensor cores.
  bool emits = strcmp(o->verb, "check") && strcmp(o->verb, "sample");
  bool executes = !strcmp(o->verb, "run") || !strcmp(o->verb, "grad") || !strcmp(o->verb, "eval");
  const char *msg = NULL;
  CudaDevice d;
  char why[256];
  if (executes && !strcmp(backend_of(o), "cuda") && cuda_device(&d, why, sizeof why) &&
      cuda_compute_capability(&d) < 89)
    msg = arena_printf(g->arena, "precision = fp8: the GPU %s has compute capability %d.%d, and FP8 GEMMs need 8.9 or "
                       "later (Ada, Hopper and newer); use bf16", d.name, cuda_compute_capability(&d) / 10,
                       cuda_compute_capability(&d) % 10);
  if (!msg) {
    static bool said;
    if (emits && !said && !o->quiet && !(executes && !strcmp(backend_of(o), "cuda")))
      fprintf(stderr, "mdlc: fp8 is emulated on the CPU (every fp8 value rounded in software, the GEMMs in f32), "
                      "slower than bf16 there and far slower than a GPU's fp8 GEMMs\n");
    said = true;
    return true;
  }
  if (g->train.precision_at.line > 0 && !o->precision)
    diag_error(g->train.precision_at, "%s", msg);
  else
    diag_file_error(o->file, "%s", msg);
  return false;
}

// The precision pass on a graph with its backward. A side engine (validation) runs the bf16 forward
// under fp8: the fp8 scales are the training step's state. The micro-batches' engine of gradient
// accumulation is no side engine here: its passes cast to fp8 with the step's scales (train.c).
static bool apply_precision(const Options *o, Graph *g, bool side) {
  DType dt;
  if (!gemm_precision(o, g, &dt))
    return false;
  if (side && dt == DT_F8E4M3)
    dt = DT_BF16;
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
  Graph *g = mdl_compile_file_with(a, o->file, o->dims, o->ndims, &o->lower);
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
  if (!apply_precision(o, g, false))
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

// optimizer = muon: which params Muon updates and which AdamW (sema.c's set_muon), in one line.
static void print_muon_split(const Graph *g) {
  int nm = 0, na = 0;
  for (int i = 0; i < g->nparams; i++) {
    const ParamInit *pi = &g->nodes[g->params[i]]->init;
    nm += !pi->frozen && pi->muon;
    na += !pi->frozen && !pi->muon;
  }
  printf("optimizer muon: Muon for %d hidden matri%s:", nm, nm == 1 ? "x" : "ces");
  for (int i = 0, k = 0; i < g->nparams; i++)
    if (g->nodes[g->params[i]]->init.muon && !g->nodes[g->params[i]]->init.frozen && k++ < 8)
      printf(" %s", g->nodes[g->params[i]]->name);
  printf("%s; AdamW for the other %d params\n", nm > 8 ? " ..." : "", na);
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
    char scale[48] = "";
    if (n->init.lr_scale > 0 && n->init.lr_scale != 1 && !n->init.frozen)
      snprintf(scale, sizeof scale, "  (lr x %g)", n->init.lr_scale);
    printf("param  %-24s %s%s%s%s%s\n", n->name, dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf),
           n->init.frozen ? "  (frozen)" : n->init.decay ? "" : "  (no weight decay)", scale,
           g->train.optimizer != OPT_MUON || n->init.frozen ? "" : n->init.muon ? "  (muon)" : "  (adamw)");
  }
  if (g->train.optimizer == OPT_MUON)
    print_muon_split(g);
  for (int i = 0; i < g->noutputs; i++) {
    const IrNode *n = g->nodes[g->outputs[i]];
    printf("output %-24s %s%s\n", n->name ? n->name : "?", dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf));
  }
  return 0;
}

// Copies every parameter from a safetensors file; names and shapes must match the model.

// The engine the options ask for: the interpreter, or the plan compiled for the CPU.
// The back end --backend names; "auto" is CUDA when a driver, a device and NVRTC are there, else
// the CPU (saying why in one line, once, unless --quiet).
static const char *backend_of(const Options *o) {
  static const char *chosen;
  if (strcmp(o->backend, "auto"))
    return o->backend;
  if (!chosen) {
    char why[256];
    chosen = cuda_available(why, sizeof why) ? "cuda" : "cpu";
    if (!strcmp(chosen, "cpu") && !o->quiet)
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
// when its kernels are a fallback older than the CPU (--quiet: the warning alone).
static void gemm_report(const GemmLib *lib, bool quiet) {
  rt_gemm_probe();
  if (!quiet) {
    printf("GEMM: %s, %s kernels%s: %.0f GFLOP/s fp32", lib->name, lib->kernels, lib->how, lib->sgemm_gflops);
    if (lib->bgemm)
      printf(", %.0f GFLOP/s bf16", lib->bgemm_gflops);
    printf(" (a 256x768x768 product split over the cores)\n");
  }
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
    gemm_report(lib, o->quiet);
    const char *how;
    e->peak_flops = rt_cpu_peak_flops(lib->bgemm && !strcmp(g->train.precision, "bf16"), &how);
    e->peak_how = arena_strdup(g->arena, how);
  }
  if (e && report && !o->quiet)
    printf("compiled %s for the CPU: %d kernels (fusion %s), arena %.1f MB (activations %.1f MB), %s\n", g->model,
           p.f->nsteps, o->fuse.fuse ? "on" : "off", (double)p.m->arena_bytes / 1e6,
           (double)p.m->activation_bytes / 1e6,
           e->cache_hit ? "module from the cache" : arena_printf(g->arena, "cc took %.2f s", e->compile_seconds));
  return e;
}

// Copies every parameter from a safetensors file; names and shapes must match the model.
static bool load_weights_from(Engine *e, const Graph *g, const StFile *f, const char *path) {
  for (int i = 0; i < g->nparams; i++) {
    const StTensor *t = st_expect(f, path, "", g->nodes[g->params[i]]);
    if (!t)
      return false;
    e->write(e, g->params[i], t->data);
  }
  return true;
}

static bool load_weights(Engine *e, const Graph *g, const char *path) {
  Arena *a = arena_new();
  StFile f;
  bool ok = st_read(a, path, &f) && load_weights_from(e, g, &f, path);
  arena_free(a);
  return ok;
}

// Writes the values of `count` nodes, as f32, under the given names.
static bool write_values(const char *path, Engine *e, const int *nodes, const char **names, int count) {
  StTensor *t = xmalloc((size_t)count * sizeof *t, "the tensors to write");
  for (int i = 0; i < count; i++) {
    const IrNode *n = e->g->nodes[nodes[i]];
    int64_t numel = shape_numel(n->shape);
    float *d = xmalloc(sizeof(float) * (size_t)numel, "a tensor to write");
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
  const char **names = xcalloc((size_t)g->nparams, sizeof *names, "the parameters' names");
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
      int count = 1;
      int *nodes = xcalloc((size_t)g->nparams + 1, sizeof *nodes, "the gradients' list");
      const char **names = xcalloc((size_t)g->nparams + 1, sizeof *names, "the gradients' list");
      nodes[0] = g->loss;
      names[0] = "loss";
      for (int i = 0; i < g->nparams; i++)
        if (g->grads[i] >= 0) { // (a frozen parameter has none)
          nodes[count] = g->grads[i];
          names[count++] = g->nodes[g->params[i]]->name;
        }
      if (write_values(o->out, e, nodes, names, count)) {
        printf("loss %.6f; wrote the loss and %d gradients to %s (%s)\n", engine_scalar(e, g->loss), count - 1,
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
  Graph *g = o->text ? mdl_compile_text_with(a, o->file, o->text, o->dims, o->ndims, &o->lower)
                     : mdl_compile_file_with(a, o->file, o->dims, o->ndims, &o->lower);
  if (!g || g->loss < 0 || (grads && !autodiff(g, false)) || !apply_precision(o, g, !grads))
    return NULL;
  Options quiet = *o;
  quiet.dump = NULL;
  if (grads && !apply_checkpoint(&quiet, g))
    return NULL;
  if (!grads) { // validation reads the loss and the scalar outputs alone: no other output is kept, so the LM
    ir_eval_mode(g); // head's logits are never whole (rule 2 of fuse.c chunks it: 5.3 GB of them at GPT-2 124M,
    int kept = 0;    // B=205, T=128)
    for (int i = 0; i < g->noutputs; i++)
      if (g->outputs[i] != g->loss && g->nodes[g->outputs[i]]->shape.rank == 0)
        g->outputs[kept++] = g->outputs[i];
    g->noutputs = kept;
  }
  return open_engine(&quiet, g, false);
}

// OUT/run.json, one line: what the run compiled (`mdlc lab` reads it): the back end, the precision,
// the kernels a step (the plan's steps), the arena, the device memory the engines hold, the
// checkpoint line. Formatted in an arena, so a line of any length is written whole.
static bool write_run_json(const char *dir, const Graph *g, const Engine *e, const Engine *eval, const Engine *micro,
                           const char *checkpoint) {
  Arena *a = arena_new();
  const char *text[2] = {g->model ? g->model : "", checkpoint};
  char *esc[2];
  for (int i = 0; i < 2; i++) { // (JSON strings: a quote and a backslash escaped)
    char *q = esc[i] = arena_alloc(a, 2 * strlen(text[i]) + 1);
    for (const char *c = text[i]; *c; c++) {
      if (*c == '"' || *c == '\\')
        *q++ = '\\';
      *q++ = *c;
    }
    *q = 0;
  }
  int64_t device = e->device_bytes + (eval ? eval->device_bytes : 0) + (micro ? micro->device_bytes : 0);
  char *json = arena_printf(a, "{\"model\":\"%s\",\"backend\":\"%s\",\"precision\":\"%s\",\"kernels\":%d,"
                            "\"arena_bytes\":%lld,\"device_bytes\":%lld,\"checkpoint\":\"%s\"}\n", esc[0], e->name,
                            g->train.precision, e->fusion ? e->fusion->nsteps : 0, (long long)e->arena_bytes,
                            (long long)device, esc[1]);
  char *path = arena_printf(a, "%s/run.json", dir), err[600];
  bool ok = rt_write_atomic(path, json, strlen(json), err, sizeof err);
  if (!ok)
    fprintf(stderr, "%s: error: %s\n", path, err);
  arena_free(a);
  return ok;
}

// A run option that decides the batches, given on the command line with another value than the
// checkpoint it resumes records: refused, the option and both values named.
static bool order_conflict(const char *path, const char *flag, const char *key, const char *stored,
                           const char *theirs, const char *ours) {
  diag_file_error(path, "%s: this checkpoint was trained with %s (%s = %s), this run asks for %s; a resumed run "
                  "keeps the checkpoint's order of batches: leave %s out to continue it, or train anew in another "
                  "--out", flag, theirs, key, stored, ours, flag);
  return false;
}

// On --resume, the options that decide which batches each step trains on are the checkpoint's, as
// its dims are (it records them: mdl.seed, mdl.shuffle, mdl.pack, mdl.accumulate): one left off the
// command line takes the checkpoint's value, one given with another value is refused, since the run
// would go on with another order of batches and its losses no longer be an uninterrupted run's. A
// checkpoint written before they were recorded resumes with today's defaults (shuffled, packed, the
// train section's accumulation), with a warning. Before the model is compiled (the accumulation
// shapes the graph); false after saying why.
static bool resume_batch_order(Options *o) {
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/checkpoint.safetensors", o->out ? o->out : "out");
  if (access(path, F_OK) != 0)
    return true; // (train_check_inputs says there is none to resume)
  Arena *a = arena_new();
  StFile f;
  CkptMeta meta;
  bool ok = st_read_header(a, path, &f) && ckpt_meta_read(a, path, &f, &meta);
  const char *seed = ok ? st_meta(&f, "mdl.seed") : NULL, *acc = ok ? st_meta(&f, "mdl.accumulate") : NULL;
  const char *taken = ""; // (the options taken from the checkpoint, as a command line gives them)
  if (ok && meta.has_seed) {
    if (o->seed_set && o->seed != meta.seed)
      ok = order_conflict(path, arena_printf(a, "--seed %llu", (unsigned long long)o->seed), "mdl.seed", seed,
                          arena_printf(a, "--seed %s", seed), arena_printf(a, "--seed %llu", (unsigned long long)o->seed));
    else if (!o->seed_set && meta.seed != o->seed)
      taken = arena_printf(a, "%s --seed %s", taken, seed);
    o->seed = meta.seed;
  }
  if (ok && meta.shuffle >= 0) {
    bool s = meta.shuffle;
    if (o->shuffle_set && (o->shuffle_set > 0) != s)
      ok = order_conflict(path, o->shuffle_set > 0 ? "--shuffle" : "--no-shuffle", "mdl.shuffle", s ? "true" : "false",
                          s ? "shuffled batches" : "batches in order", s ? "batches in order" : "shuffled batches");
    else if (!o->shuffle_set && s != o->shuffle)
      taken = arena_printf(a, "%s %s", taken, s ? "--shuffle" : "--no-shuffle");
    o->shuffle = s;
  }
  if (ok && meta.pack >= 0) {
    bool p = meta.pack;
    if (o->pack_set && p)
      ok = order_conflict(path, "--no-pack", "mdl.pack", "true", "packed rows", "padded rows");
    else if (!p && o->pack)
      taken = arena_printf(a, "%s --no-pack", taken);
    o->pack = p;
  }
  if (ok && meta.accumulate > 0) {
    int64_t k = meta.accumulate;
    if (o->accumulate > 0 && o->accumulate != k)
      ok = order_conflict(path, arena_printf(a, "--accumulate %lld", (long long)o->accumulate), "mdl.accumulate",
                          acc, arena_printf(a, "%s micro-batches a step", acc),
                          arena_printf(a, "%lld micro-batches a step", (long long)o->accumulate));
    else if (o->accumulate <= 0 && k > 1)
      taken = arena_printf(a, "%s --accumulate %s", taken, acc);
    o->accumulate = k;
  }
  if (ok && o->tokenize_on_the_fly && o->pack && o->shuffle) {
    diag_file_error(path, "this checkpoint was trained on shuffled packed rows (mdl.shuffle = true, mdl.pack = true), "
                    "which --tokenize-on-the-fly cannot draw (a shuffled window w starts at token w*T of the split): "
                    "resume it from the shards, without --tokenize-on-the-fly");
    ok = false;
  }
  if (ok && (meta.shuffle < 0 || meta.pack < 0 || meta.accumulate < 0))
    fprintf(stderr, "%s: warning: the checkpoint does not record its order of batches (written before checkpoints "
            "did): resuming with %s, %s rows and %s, as this command line says (today's defaults unless given)\n",
            path, o->shuffle ? "shuffled batches" : "batches in order", o->pack ? "packed" : "padded",
            o->accumulate > 0 ? arena_printf(a, "%lld micro-batches a step", (long long)o->accumulate)
                              : "the train section's accumulation");
  if (ok && *taken && !o->quiet)
    printf("resuming with the checkpoint's%s\n", taken);
  arena_free(a);
  return ok;
}

static int cmd_run(const Options *o, Graph *g) {
  if (!o->data) {
    diag_file_error(o->file, "run needs --data DIR: shards made by `mdlc prep TEXT -o DIR`, or arrays named as the "
                    "model's inputs (.npy, .npz, .safetensors)");
    return EXIT_USER;
  }
  char model_abs[PATH_MAX], data_abs[PATH_MAX], tok_path[PATH_MAX + 16], out_dir[PATH_MAX];
  if (!realpath(o->file, model_abs) || !realpath(o->data, data_abs)) {
    diag_file_error(realpath(o->file, model_abs) ? o->data : o->file, "cannot resolve the path: %s", strerror(errno));
    return EXIT_USER;
  }
  snprintf(tok_path, sizeof tok_path, "%s/tokenizer.bin", data_abs);
  snprintf(out_dir, sizeof out_dir, "%s", o->out ? o->out : "out");
  bool arrays = arrays_found(data_abs); // (else token shards)
  if (arrays && o->tokenize_on_the_fly) {
    diag_file_error(o->data, "--tokenize-on-the-fly reads the text token shards were made from; this is an array "
                    "dataset");
    return EXIT_USER;
  }
  if (o->tokenize_on_the_fly) { // (before anything is compiled or written: the loader checks again)
    Source src;
    bool same = source_read(data_abs, &src) && source_check(&src, data_abs);
    source_free(&src);
    if (!same)
      return EXIT_USER;
  }
  char ckpt_path[PATH_MAX + 32];
  snprintf(ckpt_path, sizeof ckpt_path, "%s/checkpoint.safetensors", out_dir);
  Tokenizer *tok = arrays ? NULL : o->resume ? train_resume_tokenizer(ckpt_path, tok_path) : tok_load(tok_path);
  if (!tok && !arrays)
    return EXIT_USER;
  char *tok_base64 = NULL; // (checkpoints store it)
  if (tok) {
    int vocab = tok_vocab(tok);
    size_t tok_n;
    unsigned char *tok_file = tok_bytes(tok, &tok_n);
    tok_base64 = rt_base64(tok_file, tok_n);
    free(tok_file);
    tok_free(tok);
    int64_t V = ir_dim(g, "V");
    if (V >= 0 && vocab > V) {
      diag_file_error(tok_path, "the data's tokenizer has %d tokens, more than the model's V = %lld: prepare the "
                      "data with --vocab %lld or run with -D V=%d", vocab, (long long)V, (long long)V, vocab);
      free(tok_base64);
      return EXIT_USER;
    }
  }
  bool created = false, lead = dist_env_rank() == 0; // (several ranks: rank 0 writes the run's files)
  int lock = lead ? train_claim_out(out_dir, o->resume, &created) : -1;
  if (lead && lock < 0) {
    free(tok_base64);
    return EXIT_USER;
  }
  if ((arrays && !arrays_check(data_abs, g, o->prep.val_fraction)) ||
      !train_check_inputs(g, model_abs, data_abs, out_dir, o->resume, o->tokenize_on_the_fly, o->weights)) {
    train_release_out(lock, out_dir, created);
    free(tok_base64);
    return EXIT_USER;
  }
  if (o->tokenize_on_the_fly && o->pack && !o->shuffle_set)
    printf("batches in order: packed rows read from the text cannot be shuffled (--no-pack shuffles them)\n");
  Engine *e = open_engine(o, g, true);
  if (!e) {
    train_release_out(lock, out_dir, created);
    free(tok_base64);
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
    if (!o->quiet)
      printf("training %s (%lld parameters), back end %s%s%s%s, precision %s%s%s\n", g->model,
             (long long)ir_param_count(g), e->name,
             strcmp(backend_of(o), "interp") && !o->fuse.fuse ? " (fusion off)" : "",
             o->lower.plain_attention ? ", attention plain (scores in memory, unfused)" : "",
             o->lower.no_doc_mask ? ", no doc mask (documents attend to each other)" : "", why ? "auto, " : "",
             why ? why : g->train.precision, o->resume ? ", resuming" : "");
    char line[1024];
    if (!o->quiet && g->train.optimizer == OPT_MUON)
      print_muon_split(g);
    checkpoint_summary(&g->ckpt, true, true, line, sizeof line);
    if (!o->quiet)
      printf("%s\n", line);
    TrainOptions to = {.model_path = model_abs, .data_dir = data_abs, .tokenizer_path = arrays ? "" : tok_path,
                       .tokenizer_base64 = tok_base64, .out_dir = out_dir,
                       .steps = o->steps, .resume = o->resume, .pack = o->pack, .shuffle = o->shuffle,
                       .tokenize_on_the_fly = o->tokenize_on_the_fly,
                       .seed = o->seed, .val_every = o->val_every, .val_batches = o->val_batches,
                       .ckpt_every = o->ckpt_every, .skip_nonfinite = o->skip_nonfinite, .out_claimed = true,
                       .log_every = o->log_every, .quiet = o->quiet, .arrays = arrays, .zero = o->zero,
                       .val_fraction = o->prep.val_fraction};
    e->profile = o->profile && e->kernel_seconds;
    if (o->profile && !e->profile)
      printf("--profile: the %s back end runs op by op, with nothing to time by kernel; the compiled back ends "
             "(--backend cpu or cuda) have a profile\n", backend_of(o));
    // Several ranks: MPI starts now, after every engine is compiled (cc is not forked under MPI).
    char derr[512];
    if (!dist_init(derr, sizeof derr)) {
      diag_file_error(o->file, "%s", derr);
      rc = EXIT_USER;
    } else {
      if (dist_on() && lead)
        printf("data parallel: %d ranks (MPI), %d on this machine, OMP_NUM_THREADS=%s each; the global batch is "
               "%d x B%s\n", dist_size(), dist_local_size(), getenv("OMP_NUM_THREADS"), dist_size(),
               o->zero ? "; ZeRO stage 1: each rank keeps and updates the moments of its share of the parameters"
                       : "");
      rc = train_run(e, eval, micro, &to);
      if (dist_on() && rc == EXIT_USER) // (a rank's error: the others would wait for it)
        dist_abort(rc);
      dist_finalize();
    }
    created = false; // (what the run wrote stays)
    if (rc == 0 && lead)
      engine_profile_report(e, stdout);
    if (rc == 0 && lead && !write_run_json(out_dir, g, e, eval, micro, line))
      rc = EXIT_USER;
  }
  if (eval)
    eval->free(eval);
  if (micro)
    micro->free(micro);
  arena_free(ea);
  e->free(e);
  train_release_out(lock, out_dir, created);
  free(tok_base64);
  return rc;
}

// `mdlc eval CHECKPOINT --data DIR`: the checkpoint's model (the .mdl text it stores, else the file
// it names, as sample reads it; its dims as recorded, -D overriding them) compiled forward only as run
// compiles its validation, the parameters from the checkpoint, over the validation batches the run
// validated on (train_eval; the run's seed, and its shuffling and packing where the checkpoint records
// them and the command line does not say).
static int cmd_eval(const Options *o) {
  if (!o->data) {
    diag_file_error(o->file, "eval needs --data DIR: the shards made by `mdlc prep`, or the arrays, to validate on");
    return EXIT_USER;
  }
  Arena *a = arena_new();
  StFile f;
  CheckpointModel m;
  CkptMeta meta;
  int rc = EXIT_USER;
  bool ok = st_read(a, o->file, &f) && checkpoint_model(a, o->file, &f, &m) && ckpt_meta_read(a, o->file, &f, &meta);
  if (ok) {
    Options q = *o;
    q.file = m.source;
    q.text = checkpoint_model_text(a, o->file, &m, "evaluating");
    q.ndims = 0;
    for (int i = 0; i < m.ndims + o->ndims; i++) {
      DimOverride d = i < m.ndims ? m.dims[i] : o->dims[i - m.ndims];
      int k = 0;
      while (k < q.ndims && strcmp(q.dims[k].name, d.name))
        k++;
      if (k == 32) {
        diag_file_error(o->file, "the checkpoint's model has more than 32 dims");
        arena_free(a);
        return EXIT_USER;
      }
      q.dims[k] = d;
      q.ndims += k == q.ndims;
    }
    q.seed = meta.has_seed ? meta.seed : o->seed;
    if (meta.shuffle >= 0 && !o->shuffle_set) // (the run's order of batches, as recorded, unless given)
      q.shuffle = meta.shuffle;
    if (meta.pack >= 0 && !o->pack_set)
      q.pack = meta.pack;
    // (the front end alone first: every parameter's shape is the checkpoint's before any is allocated)
    Graph *g = q.text ? mdl_compile_text_with(a, q.file, q.text, q.dims, q.ndims, &q.lower)
                      : mdl_compile_file_with(a, q.file, q.dims, q.ndims, &q.lower);
    const char *prefix = arena_printf(a, "checkpoint does not match %s: ", m.source);
    for (int k = 0; g && k < g->nparams; k++)
      if (!st_expect(&f, o->file, prefix, g->nodes[g->params[k]]))
        g = NULL;
    if (g)
      checkpoint_dims_note(o->file, &m, g, "evaluating");
    Engine *e = g ? open_side_engine(&q, a, false) : NULL;
    if (e && load_weights_from(e, e->g, &f, o->file)) {
      printf("evaluating %s (step %s of %s), back end %s, precision %s\n", o->file,
             meta.step >= 0 ? arena_printf(a, "%lld", (long long)meta.step) : "?", m.source, e->name,
             e->g->train.precision);
      TrainOptions to = {.model_path = m.source, .data_dir = o->data, .pack = q.pack, .shuffle = q.shuffle,
                         .seed = q.seed, .val_batches = o->val_batches, .arrays = arrays_found(o->data),
                         .val_fraction = o->prep.val_fraction};
      rc = train_eval(e, &to) ? EXIT_USER : 0;
    }
    if (e)
      e->free(e);
  }
  arena_free(a);
  return rc;
}

//
// lab: what main.c knows that lab.c's rows need (lab.c runs the rows).
//

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
  Graph *g = compile(a, &q, true, true);
  int64_t peak = g ? g->ckpt.peak : -1;
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
  Graph *g = mdl_compile_file_with(a, o->file, o->dims, o->ndims, &q.lower);
  bool precise = g && apply_precision(&q, g, false); // (which renumbers the nodes: the outputs are looked up after it)
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
  ir_eval_mode(g);
  Engine *e = open_engine(&q, g, false);
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
static int cmd_lab(const Options *o, Graph *g) {
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

// The verb of o, run; its exit status.
static int run_verb(Options *o) {
  if (!strcmp(o->verb, "sample")) {
    o->sample.checkpoint = o->file;
    o->sample.seed = o->seed;
    return sample_run(&o->sample);
  }
  if (!strcmp(o->verb, "eval"))
    return cmd_eval(o);
  if (!strcmp(o->verb, "run") && o->resume && !resume_batch_order(o))
    return EXIT_USER;
  if (!strcmp(o->verb, "run") && dist_launched()) {
    // One of several ranks (mpirun, srun): rank 0 speaks for the run; each rank takes its share of
    // the machine's cores unless OMP_NUM_THREADS says.
    o->quiet |= dist_env_rank() != 0;
    if (o->cpu_reduce && !strcmp(backend_of(o), "cuda")) // (NCCL reduces a GPU's gradients in one call)
      return usage_error("%s shapes the CPU back end's MPI all-reduce; on the CUDA back end NCCL reduces the "
                         "gradients in one call after the backward", o->cpu_reduce);
    long cores = sysconf(_SC_NPROCESSORS_ONLN), each = cores / dist_env_local_size();
    char threads[24];
    snprintf(threads, sizeof threads, "%ld", each > 0 ? each : 1);
    setenv("OMP_NUM_THREADS", threads, 0);
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
      {"lab", cmd_lab, true, true},
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
  return usage_error("unknown verb '%s' (verbs: check, init, grad, prep, build, run, eval, lab, sample)", o->verb);
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
