// sampling.c: `mdlc sample`'s compiling part: the model a checkpoint records compiled by the front end
// for the sampler (runtime/train/sample.c), which reads the checkpoint and runs the graph.
#include "driver.h"

Sampler *sampler_open(const char *checkpoint) {
  Sampler *s = sampler_read(checkpoint);
  if (!s)
    return NULL;
  const char *text;
  const CheckpointModel *m = sampler_model(s, &text);
  Graph *g = text ? mdl_compile_text(sampler_arena(s), m->source, text, m->dims, m->ndims)
                  : mdl_compile_file(sampler_arena(s), m->source, m->dims, m->ndims);
  if (g)
    ir_eval_mode(g);
  if (!sampler_start(s, g)) {
    sampler_close(s);
    return NULL;
  }
  return s;
}

int sample_run(const SampleOptions *o) {
  Sampler *s = sampler_open(o->checkpoint);
  if (!s)
    return 1;
  int rc = sampler_print(s, o);
  sampler_close(s);
  return rc;
}
