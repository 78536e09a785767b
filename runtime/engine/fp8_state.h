// fp8_state.h: delayed scaling (precision fp8): the scales and amax histories a training run keeps
// and updates beside its parameters (runtime/engine/fp8_state.c). The interpreter, the CPU and CUDA
// engines and the training loop keep one each; checkpoints save it.
#ifndef MDL_FP8_STATE_H
#define MDL_FP8_STATE_H
#include "mdl.h"

// Per scaled tensor i (Graph.fp8[i]): scale[i], the power of two its CAST multiplies by this step,
// and hist[i * H + j], the amax of the step j + 1 steps ago (H = amax_history). A step
// records each tensor's amax (amax[i]); fp8_state_update then rolls it into the history and sets the
// scales. recorded counts the steps in the histories (at most H): 0 before the first step, whose
// amaxes are unknown, so that step is run twice (fp8 calibration): once with every scale 1, to record
// them, its update skipped; then with the scales they give. No NaN reaches a history: a step with a
// non-finite amax, or one whose scale falls below FP8_MIN_SCALE, is reported and skipped whole.
#define FP8_MAX_EXP 63             // scales lie in [2^-63, 2^63]: 1 / (scale_a scale_b) is a normal float
struct Fp8State {
  int n, H;
  float *scale, *hist, *amax; // n, n * H, n
  int64_t recorded;
};
void fp8_state_init(Fp8State *st, const Graph *g); // all scales 1, histories empty (malloc'd)
void fp8_state_free(Fp8State *st);
// The largest finite value of an fp8 format.
double fp8_max(DType fmt);
// The scale of a tensor of format fmt whose amax history peaks at amax (finite, >= 0):
// 2^(floor(log2(fp8_max / amax)) - FP8_MARGIN), clamped to [2^-FP8_MAX_EXP, 2^FP8_MAX_EXP] (amax 0:
// the largest); *low set when the clamp raised it (a value beyond what a scale can bring in range).
float fp8_scale(DType fmt, double amax, bool *low);
// The end of a step: each amax rolled into its history (newest first), each scale recomputed from its
// history's maximum. False, with nothing changed, when an amax is not finite or a scale is clamped
// from below: `why` names the tensor (its .mdl name and line) and the value.
bool fp8_state_update(Fp8State *st, const Graph *g, char *why, size_t n);
// "amax of h.0.fc's input (line 30) is inf": the first non-finite or unscalable amax of this step, or
// false when there is none.
bool fp8_state_check(const Fp8State *st, const Graph *g, char *why, size_t n);
#endif
