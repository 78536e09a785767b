// driver.h: what the driver offers beyond mdlc's command line, for the tests: a sampler opened from a
// checkpoint, its model compiled (sampling.c), and `mdlc sample` itself.
#ifndef MDL_DRIVER_H
#define MDL_DRIVER_H
#include "mdl.h"
#include "sample.h"

// The checkpoint read, its model compiled for one token per step, the parameters loaded (sampler_read,
// sampler_start); NULL after printing why.
Sampler *sampler_open(const char *checkpoint);
// `mdlc sample`: opens o->checkpoint and prints the prompt, then the generated text, as it comes
// (sampler_print). Returns the exit status: 0, or 1 after printing "path: error: reason".
int sample_run(const SampleOptions *o);
#endif
