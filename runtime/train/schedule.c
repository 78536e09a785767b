// schedule.c: the learning rate at each step: a linear warmup to lr over `warmup` steps, then the
// train section's schedule (mdl.h: Schedule) over steps warmup + 1 ... `steps`, min_lr after them.
#include "runtime.h"

#include <math.h>

double rt_lr_at(const TrainConfig *tc, int64_t step) {
  if (tc->warmup > 0 && step <= tc->warmup)
    return tc->lr * (double)step / (double)tc->warmup;
  if (tc->schedule == SCHED_CONSTANT || tc->steps <= tc->warmup)
    return tc->lr;
  if (step >= tc->steps)
    return tc->min_lr;
  double span = (double)(tc->steps - tc->warmup), progress = (double)(step - tc->warmup) / span;
  switch (tc->schedule) {
  case SCHED_LINEAR:
    return tc->lr + (tc->min_lr - tc->lr) * progress;
  case SCHED_WSD: { // lr until the last `decay` steps, then a straight line to min_lr at `steps`
    double decay = tc->decay >= 1 ? tc->decay : tc->decay * span;
    if (decay > span)
      decay = span;
    double left = (double)(tc->steps - step);
    return left >= decay ? tc->lr : tc->min_lr + (tc->lr - tc->min_lr) * left / decay;
  }
  default:
    return tc->min_lr + 0.5 * (tc->lr - tc->min_lr) * (1.0 + cos(M_PI * progress));
  }
}
