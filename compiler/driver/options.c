// options.c: mdlc's command line into Options: the usage text, each option checked as it is taken,
// then the command line as a whole (one verb, one file).
#include "driver.h"
#include "runtime.h"

#include <errno.h>

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

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

int usage_error(const char *fmt, const char *arg) {
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

// One option of the command line (getopt_long's c and optarg) into o; 0, else usage_error's status.
static int take_option(Options *o, int c) {
  int64_t v;
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
  return 0;
}

int parse_options(int argc, char **argv, Options *o) {
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
  while ((c = getopt_long(argc, argv, "D:d:o:hV", longopts, NULL)) != -1) {
    int rc = take_option(o, c);
    if (rc)
      return rc;
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

bool dumping(const Options *o, char letter) { return o->dump && strchr(o->dump, letter); }
