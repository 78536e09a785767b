// runtime.h: the runtime's public pieces: learning-rate schedule, model flops and MFU, text batches.
#ifndef MDL_RUNTIME_H
#define MDL_RUNTIME_H
#include "mdl.h"

//
// schedule.c: linear warmup then cosine decay to min_lr over train.steps (constant after).
//
double rt_lr_at(const TrainConfig *tc, int64_t step); // step counts from 1

//
// flops.c: the model flops of one training step, counted from the forward graph.
//
// 3x the forward GEMM and attention flops (forward 1x + backward 2x): for GPT-2 this is llm.c's
// 6N + 6LCT per token with N the parameters that take part in matmuls.
double rt_step_flops(const Graph *g);
// The peak this machine's CPU is assumed to reach in fp32: cores x GHz x flops per cycle (FMA
// width x 2 units), from /proc/cpuinfo; *how names what was assumed.
double rt_cpu_peak_flops(const char **how);

//
// textdata.c: batches of B x T byte tokens taken in order from a text file (wrapping around).
//
typedef struct {
  const char *path;
  unsigned char *bytes;
  int64_t n, cursor;
} TextData;

bool rt_text_open(TextData *d, const char *path); // prints "path: reason" on failure
void rt_text_close(TextData *d);
// tokens[b,t] = bytes[c + t], targets[b,t] = bytes[c + t + 1]; pos = t; doc = 0.
void rt_text_batch(TextData *d, int64_t B, int64_t T, int32_t *tokens, int32_t *targets, int32_t *pos,
                   int32_t *doc);
#endif
