// schedule.c: the learning-rate schedule of the train section: linear warmup, then cosine decay.
#include "runtime.h"

#include <math.h>

double rt_lr_at(const TrainConfig *tc, int64_t step) {
  if (tc->warmup > 0 && step <= tc->warmup)
    return tc->lr * (double)step / (double)tc->warmup;
  if (tc->steps <= tc->warmup)
    return tc->lr;
  if (step >= tc->steps)
    return tc->min_lr;
  double progress = (double)(step - tc->warmup) / (double)(tc->steps - tc->warmup);
  return tc->min_lr + 0.5 * (tc->lr - tc->min_lr) * (1.0 + cos(M_PI * progress));
}
