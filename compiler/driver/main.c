// main.c: mdlc: the command line parsed (options.c), then its verb run. The driver decides what depends on
// the machine (the back end, what `auto` precision is, the memory a checkpoint budget is measured against,
// the GPU's compute capability: engines.c), then each verb runs the pipeline (compiler/pipeline.c) as far
// as it needs and hands what it compiled to an engine: the reference interpreter, the C module (cc +
// dlopen) or the CUDA plan. `-d LETTERS` prints the IR after the passes it names (P: parse, A: autodiff,
// R: precision, C: checkpoints, F: fusion, M: memory plan).
#include "driver.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
  // Per verb the graph it compiles and how far: a target of -1 is the back end's (target_of).
  static const struct {
    const char *verb;
    int (*fn)(const Options *, Compilation *);
    bool grads, optimizer;
    int target;
  } verbs[] = {
      {"check", cmd_check, false, false, TARGET_GRAPH},
      {"init", cmd_init, false, false, TARGET_GRAPH},
      {"grad", cmd_grad, true, false, -1},
      {"build", cmd_build, true, true, TARGET_C_CUDA},
      {"run", cmd_run, true, true, -1},
      {"lab", cmd_lab, true, true, TARGET_GRAPH},
  };
  for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++) {
    if (strcmp(o->verb, verbs[i].verb))
      continue;
    Arena *a = arena_new();
    bool train = verbs[i].optimizer || dumping(o, 'A') || dumping(o, 'R') || dumping(o, 'C') || dumping(o, 'F') ||
                 dumping(o, 'M');
    GraphKind kind = train ? GRAPH_TRAIN : verbs[i].grads ? GRAPH_GRADS : GRAPH_FORWARD;
    Target target = verbs[i].target >= 0 ? (Target)verbs[i].target : target_of(o);
    if (!strcmp(o->verb, "check") && (dumping(o, 'F') || dumping(o, 'M')))
      target = TARGET_PLAN;
    PipelineOptions po = pipeline_options(o, kind, target);
    Compilation c;
    int rc = pipeline(a, &po, &c) ? verbs[i].fn(o, &c) : EXIT_USER;
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
