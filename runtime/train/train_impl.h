// train_impl.h: what the files of the training loop share: the functions one file calls in another.
// runtime.h's training section is their interface to the rest of mdlc.
#ifndef TRAIN_IMPL_H
#define TRAIN_IMPL_H

#include "data.h"
#include "runtime.h"

//
// outdir.c: the output folder (its lock: runtime.h's train_claim_out).
//
// On --resume: log.jsonl cut back to the lines of the steps up to `step`; false after saying why.
bool truncate_log(const char *path, int64_t step);

#endif
