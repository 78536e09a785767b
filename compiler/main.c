// main.c: the mdlc command line. Each verb runs the pipeline as far as it needs:
//   parse + check (front end) -> autodiff + AdamW -> reference interpreter
// and `-d LETTERS` prints the IR after the passes it names (P: parse, A: autodiff).
#include "mdl.h"
#include "runtime.h"

#include <getopt.h>
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
  int64_t steps;
  uint64_t seed;
  bool fp64;
} Options;

static const char usage_text[] =
    "usage: mdlc [options] VERB FILE.mdl\n"
    "\n"
    "verbs:\n"
    "  check FILE.mdl                 parse and check; parameter count and shapes\n"
    "  init  FILE.mdl -o W.safetensors  initialise the parameters (--seed N)\n"
    "  grad  FILE.mdl --weights W --batch BATCH -o OUT\n"
    "                                 loss and every gradient of one step, as safetensors\n"
    "  run   FILE.mdl [--steps N] [--data TEXT]\n"
    "                                 compile and train (reference interpreter)\n"
    "\n"
    "options:\n"
    "  -D, --dim NAME=N       bind a dimension (overrides the train section)\n"
    "  -d, --dump LETTERS     print the IR after passes: P parse, A autodiff + optimizer\n"
    "  -o, --out PATH         output file\n"
    "      --weights PATH     load parameters from a safetensors file\n"
    "      --batch PATH       a batch as safetensors (tokens, targets, pos, doc: i32 [B,T])\n"
    "      --data PATH        training text (bytes are tokens)\n"
    "      --steps N          training steps (default: the train section's, else 50)\n"
    "      --seed N           random seed (default 1337)\n"
    "      --backend NAME     interp (the reference interpreter)\n"
    "      --fp64             run the interpreter in fp64\n"
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
      {"help", no_argument, 0, 'h'},          {"version", no_argument, 0, 'V'},
      {0, 0, 0, 0}};
  *o = (Options){.seed = 1337, .backend = "interp", .steps = -1};
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
      if (strspn(optarg, "PA") != strlen(optarg))
        return usage_error("unknown dump letters in '%s' (known: P parse, A autodiff)", optarg);
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
      if (strcmp(optarg, "interp"))
        return usage_error("unknown backend '%s' (available: interp)", optarg);
      o->backend = optarg;
      break;
    case 'F': o->fp64 = true; break;
    case 'h': fputs(usage_text, stdout); exit(0);
    case 'V': printf("mdlc %s\n", MDL_VERSION); exit(0);
    default: return usage_error("%s", "bad option");
    }
  }
  if (optind + 2 != argc)
    return usage_error("%s", optind == argc ? "no verb given" : "want exactly one VERB and one FILE.mdl");
  o->verb = argv[optind];
  o->file = argv[optind + 1];
  return 0;
}

static bool dumping(const Options *o, char letter) { return o->dump && strchr(o->dump, letter); }

// Front end, then autodiff (+ optimizer) when `train` is set; validates after each pass.
static Graph *compile(Arena *a, const Options *o, bool grads, bool optimizer) {
  Graph *g = mdl_compile_file(a, o->file, o->dims, o->ndims);
  if (!g)
    return NULL;
  char why[512];
  if (!ir_validate(g, why, sizeof why)) {
    fprintf(stderr, "%s: internal error: the front end built a broken graph: %s\n", o->file, why);
    return NULL;
  }
  if (dumping(o, 'P'))
    ir_dump(g, stdout);
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
  return g;
}

static int cmd_check(const Options *o, Graph *g) {
  (void)o;
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
static bool load_weights(Interp *it, const Graph *g, const char *path) {
  Arena *a = arena_new();
  StFile f;
  bool ok = st_read(a, path, &f);
  for (int i = 0; ok && i < g->nparams; i++) {
    const IrNode *p = g->nodes[g->params[i]];
    const StTensor *t = st_find(&f, p->name);
    char want[128], got[128];
    if (!t) {
      diag_file_error(path, "no tensor '%s' (a parameter of %s)", p->name, g->model);
      ok = false;
    } else if (!shape_eq(t->shape, p->shape) || (t->dtype != DT_F32 && t->dtype != DT_F64)) {
      diag_file_error(path, "tensor '%s' is %s%s, the model wants f32%s", p->name, dtype_name(t->dtype),
                      shape_str(t->shape, got, sizeof got), shape_str(p->shape, want, sizeof want));
      ok = false;
    } else {
      double *dst = interp_param(it, p->id);
      for (int64_t k = 0; k < shape_numel(p->shape); k++)
        dst[k] = t->dtype == DT_F32 ? ((const float *)t->data)[k] : ((const double *)t->data)[k];
    }
  }
  arena_free(a);
  return ok;
}

// Writes `count` tensors whose values come from the interpreter, as f32.
static bool write_values(const char *path, Interp *it, const Graph *g, const int *nodes, const char **names,
                         int count) {
  StTensor *t = calloc((size_t)count, sizeof *t);
  for (int i = 0; i < count; i++) {
    const IrNode *n = g->nodes[nodes[i]];
    int64_t numel = shape_numel(n->shape);
    float *d = malloc(sizeof(float) * (size_t)(numel ? numel : 1));
    const double *v = n->op == OP_PARAM ? interp_param(it, n->id) : interp_value(it, n->id);
    for (int64_t k = 0; k < numel; k++)
      d[k] = (float)v[k];
    t[i] = (StTensor){.name = names[i], .dtype = DT_F32, .shape = n->shape, .data = d};
  }
  bool ok = st_write(path, t, count);
  for (int i = 0; i < count; i++)
    free(t[i].data);
  free(t);
  return ok;
}

static int cmd_init(const Options *o, Graph *g) {
  if (!o->out)
    return usage_error("init needs -o W.safetensors%s", "");
  Interp *it = interp_new(g, INTERP_F32);
  interp_init_params(it, o->seed);
  const char **names = calloc((size_t)g->nparams, sizeof *names);
  for (int i = 0; i < g->nparams; i++)
    names[i] = g->nodes[g->params[i]]->name;
  bool ok = write_values(o->out, it, g, g->params, names, g->nparams);
  free(names);
  interp_free(it);
  if (ok)
    printf("wrote %d parameters (%lld values, seed %llu) to %s\n", g->nparams, (long long)ir_param_count(g),
           (unsigned long long)o->seed, o->out);
  return ok ? 0 : EXIT_USER;
}

// Sets every model input from a batch file (i32 or f32 tensors named as the inputs).
static bool load_batch(Interp *it, const Graph *g, const char *path) {
  Arena *a = arena_new();
  StFile f;
  bool ok = st_read(a, path, &f);
  for (int i = 0; ok && i < g->fwd_end; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op != OP_INPUT)
      continue;
    const StTensor *t = st_find(&f, n->name);
    char want[128], got[128];
    if (!t) {
      diag_file_error(path, "no tensor '%s' (an input of %s)", n->name, g->model);
      ok = false;
    } else if (!shape_eq(t->shape, n->shape) || t->dtype != n->dtype) {
      diag_file_error(path, "tensor '%s' is %s%s, the model wants %s%s", n->name, dtype_name(t->dtype),
                      shape_str(t->shape, got, sizeof got), dtype_name(n->dtype), shape_str(n->shape, want, sizeof want));
      ok = false;
    } else if (!interp_set_input(it, n->name, n->dtype == DT_I32 ? t->data : NULL,
                                 n->dtype == DT_F32 ? t->data : NULL, shape_numel(n->shape))) {
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
  Interp *it = interp_new(g, o->fp64 ? INTERP_F64 : INTERP_F32);
  interp_set_seed(it, o->seed);
  char err[512];
  int rc = EXIT_USER;
  if (load_weights(it, g, o->weights) && load_batch(it, g, o->batch)) {
    if (!interp_run(it, g->n, err, sizeof err)) {
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
      if (write_values(o->out, it, g, nodes, names, count)) {
        printf("loss %.6f; wrote the loss and %d gradients to %s\n", interp_value(it, g->loss)[0], g->nparams, o->out);
        rc = 0;
      }
      free(nodes);
      free(names);
    }
  }
  interp_free(it);
  return rc;
}

static int64_t dim_value(const Graph *g, const char *name) {
  for (int i = 0; i < g->ndims; i++)
    if (!strcmp(g->dims[i].name, name))
      return g->dims[i].value;
  return -1;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Trains in the reference interpreter on byte tokens of a text file.
static int cmd_run(const Options *o, Graph *g) {
  static const char default_text[] = "/usr/share/common-licenses/GPL-3";
  int64_t B = dim_value(g, "B"), T = dim_value(g, "T");
  const IrNode *tok = NULL;
  for (int i = 0; i < g->fwd_end; i++)
    if (g->nodes[i]->op == OP_INPUT && !strcmp(g->nodes[i]->name, "tokens"))
      tok = g->nodes[i];
  if (B <= 0 || T <= 0 || !tok || tok->shape.rank != 2) {
    diag_file_error(o->file, "run trains language models: it needs dims B and T and an input tokens: i32[B, T]");
    return EXIT_USER;
  }
  TextData data;
  const char *path = o->data ? o->data : default_text;
  if (!rt_text_open(&data, path))
    return EXIT_USER;
  TrainConfig tc = g->train;
  int64_t steps = o->steps >= 0 ? o->steps : tc.steps > 0 ? tc.steps : 50;
  if (tc.steps <= 0)
    tc.steps = steps;
  Interp *it = interp_new(g, o->fp64 ? INTERP_F64 : INTERP_F32);
  interp_set_seed(it, o->seed);
  interp_init_params(it, o->seed);
  int rc = 0;
  if (o->weights && !load_weights(it, g, o->weights))
    rc = EXIT_USER;
  int gnorm = -1;
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_GRAD_NORM)
      gnorm = i;
  const char *peak_how;
  double peak = rt_cpu_peak_flops(&peak_how), flops = rt_step_flops(g);
  printf("training %s (%lld parameters) on %s: %lld steps of %lldx%lld tokens, reference interpreter (%s)\n",
         g->model, (long long)ir_param_count(g), path, (long long)steps, (long long)B, (long long)T,
         o->fp64 ? "fp64" : "fp32");
  printf("MFU = model flops (3x forward GEMM + attention flops from the graph: %.3g per step) / %s\n", flops, peak_how);
  int32_t *buf = malloc(sizeof(int32_t) * (size_t)(4 * B * T));
  int32_t *tokens = buf, *targets = buf + B * T, *pos = buf + 2 * B * T, *doc = buf + 3 * B * T;
  char err[512];
  for (int64_t step = 1; rc == 0 && step <= steps; step++) {
    double t0 = now_s();
    rt_text_batch(&data, B, T, tokens, targets, pos, doc);
    interp_set_input(it, "tokens", tokens, NULL, B * T);
    interp_set_input(it, "targets", targets, NULL, B * T);
    interp_set_input(it, "pos", pos, NULL, B * T);
    interp_set_input(it, "doc", doc, NULL, B * T);
    double lr = rt_lr_at(&tc, step);
    interp_set_scalar(it, "lr", lr);
    interp_set_scalar(it, "step", (double)step);
    if (!interp_run(it, g->n, err, sizeof err)) {
      diag_file_error(o->file, "step %lld: %s", (long long)step, err);
      rc = EXIT_USER;
      break;
    }
    double dt = now_s() - t0, loss = interp_value(it, g->loss)[0];
    printf("step %4lld/%lld | loss %.4f | lr %.2e | norm %.3f | %7.1f ms | %8.0f tok/s | MFU %.2f%%\n",
           (long long)step, (long long)steps, loss, lr, gnorm >= 0 ? interp_value(it, gnorm)[0] : NAN, 1e3 * dt,
           (double)(B * T) / dt, 100.0 * flops / dt / peak);
    fflush(stdout);
    if (!isfinite(loss)) {
      diag_file_error(o->file, "step %lld: the loss is %g; stopping", (long long)step, loss);
      rc = EXIT_USER;
    }
  }
  if (rc == 0 && o->out) {
    const char **names = calloc((size_t)g->nparams, sizeof *names);
    for (int i = 0; i < g->nparams; i++)
      names[i] = g->nodes[g->params[i]]->name;
    if (!write_values(o->out, it, g, g->params, names, g->nparams))
      rc = EXIT_USER;
    else
      printf("wrote the trained parameters to %s\n", o->out);
    free(names);
  }
  free(buf);
  interp_free(it);
  rt_text_close(&data);
  return rc;
}

int main(int argc, char **argv) {
  Options o;
  int rc = parse_options(argc, argv, &o);
  if (rc)
    return rc;
  static const struct {
    const char *verb;
    int (*fn)(const Options *, Graph *);
    bool grads, optimizer;
  } verbs[] = {
      {"check", cmd_check, false, false},
      {"init", cmd_init, false, false},
      {"grad", cmd_grad, true, false},
      {"run", cmd_run, true, true},
  };
  for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++) {
    if (strcmp(o.verb, verbs[i].verb))
      continue;
    Arena *a = arena_new();
    Graph *g = compile(a, &o, verbs[i].grads || dumping(&o, 'A'), verbs[i].optimizer || dumping(&o, 'A'));
    rc = g ? verbs[i].fn(&o, g) : EXIT_USER;
    arena_free(a);
    return rc;
  }
  return usage_error("unknown verb '%s' (verbs: check, init, grad, run)", o.verb);
}
