// cuda.c: the CUDA back end's engine: runs the CudaPlan the pipeline emitted as one CUDA Graph of
// NVRTC-compiled kernels and cuBLASLt GEMMs behind the Engine hooks (the driver API in cuda_driver.c,
// the GEMMs in cuda_gemm.c).
//
// The step. Parameters are initialised on the host exactly as the interpreter does and copied up
// with their bf16 copies (fuse.c, rule 11); the AdamW moments start at zero. Inputs and the lr/step
// scalars are staged on the host and copied into their arena slots before each replay (but for inputs
// set on the device: gradient accumulation's sums, Engine.inputs_from, which copies the first
// micro-batch's gradients from the other engine's arena and adds the others' with the prelude's
// mdl_accumulate), and the step's seed into the 8 bytes the kernels' seed argument points to (a graph
// replays its launches' arguments as captured, so the seed cannot be one of them). Two engines share
// the primary context, so parameters go from one arena to another by device copies
// (Engine.take_params: training to validation). The launches
// of the plan (kernels, GEMMs) are captured once from one stream into a CUDA Graph, instantiated,
// and replayed every step. Every transfer goes through that same (non-blocking) stream and is
// waited for, so it is ordered with the steps without the legacy default stream; a step ends with a
// stream synchronisation, then the kernels' status is read back. With --profile (Engine.profile)
// the step runs the same launches outside the graph, with an event before each: each launch's
// device time is added to its plan step's Engine.kernel_seconds, and kept per launch for
// Engine.profile_launches (the launches inside the plan steps that make several). Precision fp8
// (fp8_step) cuts the step in two graphs at the optimizer's first launch: the host reads the amaxes
// between them and keeps the delayed scaling's state (fp8_state.c), as the CPU engine does; there
// the runtime raises them to its micro-batches' and ranks' (Engine.set_fp8_amax, on the host: the
// ranks are MPI processes), and a micro-batches' engine casts with the step engine's scales and only
// records its amaxes (Engine.set_fp8_lead).
#include "cuda_impl.h"
#include "backend.h"
#include "fp8_state.h"
#include "runtime.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static bool staged(const IrNode *nd) { return nd->op == OP_INPUT || nd->op == OP_SCALAR; }

static bool cu_set_input(Engine *e, const char *name, const int32_t *ids, const float *f, int64_t n) {
  CudaEngine *ce = (CudaEngine *)e;
  bool found = false;
  for (int i = 0; i < e->g->n; i++) {
    const IrNode *nd = e->g->nodes[i];
    if (nd->op != OP_INPUT || !nd->name || strcmp(nd->name, name) || ce->m->offset[i] < 0)
      continue;
    bool i32 = nd->dtype == DT_I32;
    if (n != shape_numel(nd->shape) || (i32 ? !ids : !f))
      return false;
    memcpy(ce->staging + (ce->m->offset[i] - ce->lo), i32 ? (const void *)ids : (const void *)f, (size_t)n * 4);
    ce->ndevice -= ce->on_device[i];
    ce->on_device[i] = false;
    found = true;
  }
  return found;
}

static void cu_set_seed(Engine *e, uint64_t seed) { ((CudaEngine *)e)->seed = seed; }

static void cu_set_scalar(Engine *e, const char *name, double v) {
  CudaEngine *ce = (CudaEngine *)e;
  for (int i = 0; i < e->g->n; i++) {
    const IrNode *nd = e->g->nodes[i];
    if (nd->op == OP_SCALAR && nd->name && !strcmp(nd->name, name) && ce->m->offset[i] >= 0)
      for (int64_t j = 0; j < shape_numel(nd->shape); j++)
        ((float *)(ce->staging + (ce->m->offset[i] - ce->lo)))[j] = (float)v;
  }
}

// Copies between the host and the arena, on the engine's stream, waited for.
static bool upload_to(CudaEngine *ce, CUdeviceptr dst, const void *src, size_t bytes, char *err, size_t n) {
  return CU(err, n, cuMemcpyHtoDAsync, dst, src, bytes, ce->stream) && CU(err, n, cuStreamSynchronize, ce->stream);
}

static bool upload(CudaEngine *ce, int64_t offset, const void *src, size_t bytes, char *err, size_t n) {
  return upload_to(ce, ce->arena + (CUdeviceptr)offset, src, bytes, err, n);
}

static bool download(CudaEngine *ce, void *dst, CUdeviceptr src, size_t bytes, char *err, size_t n) {
  return CU(err, n, cuMemcpyDtoHAsync, dst, src, bytes, ce->stream) && CU(err, n, cuStreamSynchronize, ce->stream);
}

// Inputs and scalars up, the graph replayed, the stream drained, then the kernels' status checked.
static bool enqueue(CudaEngine *ce, int i, char *err, size_t n);
static bool nccl_launches(CudaEngine *ce, int first, int last, bool comm, char *err, size_t n);
static const char *launch_kernel(const CudaEngine *ce, int i);

// The head of every step: the kernels' status zeroed, and in precision fp8 the region's amaxes.
static bool clear_step(CudaEngine *ce, char *err, size_t n) {
  const CudaPlan *p = ce->plan;
  return CU(err, n, cuMemsetD8Async, ce->status, 0, sizeof(MdlStatus), ce->stream) &&
         (!p->nfp8 || CU(err, n, cuMemsetD8Async, ce->arena + (CUdeviceptr)(p->fp8 + 8 * (int64_t)p->nfp8), 0,
                         4 * (size_t)p->nfp8, ce->stream));
}

// A step outside the graph (--profile): the same launches in the same order on the stream, with an
// event recorded before each; each launch's time is what the device took from its event to the
// next, launch gaps included (the CPU queues far ahead of short kernels), and a plan step's time is
// that of its launches. The events: one before each launch, one at the end, and one at the end of
// an fp8 step's first part (fp8_step), so that the host's wait for the amaxes between the parts is
// no launch's time.
static bool profile_events(CudaEngine *ce, char *err, size_t n) {
  const CudaPlan *p = ce->plan;
  if (ce->marks)
    return true;
  ce->marks = calloc((size_t)p->nlaunches + 2, sizeof *ce->marks);
  ce->launch_seconds = calloc((size_t)p->nlaunches + 1, sizeof *ce->launch_seconds);
  if (!ce->marks || !ce->launch_seconds)
    return rt_fail(err, n, "out of host memory");
  for (; ce->nmarks <= p->nlaunches + 1; ce->nmarks++)
    if (!CU(err, n, cuEventCreate, &ce->marks[ce->nmarks], 0))
      return false;
  return true;
}

// Launches [first, last) one by one on the stream, each after its event, and `end` after the last.
static bool profile_launches(CudaEngine *ce, int first, int last, CUevent end, char *err, size_t n) {
  bool ok = true;
  for (int i = first; ok && i < last; i++)
    ok = CU(err, n, cuEventRecord, ce->marks[i], ce->stream) && enqueue(ce, i, err, n);
  return ok && CU(err, n, cuEventRecord, end, ce->stream);
}

// Once the step's last event has passed: each launch's time added to its plan step's.
static bool profile_times(CudaEngine *ce, char *err, size_t n) {
  const CudaPlan *p = ce->plan;
  bool ok = CU(err, n, cuEventSynchronize, ce->marks[p->nlaunches]);
  for (int i = 0; ok && i < p->nlaunches; i++) {
    float ms = 0;
    CUevent end = p->nfp8 && i + 1 == ce->opt_launch ? ce->marks[p->nlaunches + 1] : ce->marks[i + 1];
    ok = CU(err, n, cuEventElapsedTime, &ms, ce->marks[i], end);
    if (ce->e.profile_warm) { // (the first step loads each kernel as it first launches)
      ce->e.kernel_seconds[p->launches[i].step] += 1e-3 * ms;
      ce->launch_seconds[i] += 1e-3 * ms;
    }
  }
  return ok;
}

static bool profile_step(CudaEngine *ce, char *err, size_t n) {
  const CudaPlan *p = ce->plan;
  return profile_events(ce, err, n) && clear_step(ce, err, n) &&
         profile_launches(ce, 0, p->nlaunches, ce->marks[p->nlaunches], err, n) && profile_times(ce, err, n);
}

// Part `part` of an fp8 step on the stream: 0, the step's head (clear_step) and the launches before the
// optimizer's first; 1, the others. Replayed from its graph, or with --profile launch by launch, timed
// when `timed` (the calibration's run is not); over several ranks launch by launch as nccl_step runs
// them, the gradients' all-reduces among them where `comm` (the calibration's run has none: its
// gradients are thrown away).
static bool fp8_part(CudaEngine *ce, int part, bool timed, bool comm, char *err, size_t n) {
  const CudaPlan *p = ce->plan;
  int first = part ? ce->opt_launch : 0, last = part ? p->nlaunches : ce->opt_launch;
  if (ce->nccl)
    return (part || clear_step(ce, err, n)) && nccl_launches(ce, first, last, comm, err, n);
  if (!ce->e.profile) {
    CUgraphExec x = part ? ce->exec_opt : ce->exec;
    return !x || CU(err, n, cuGraphLaunch, x, ce->stream);
  }
  bool ok = part || clear_step(ce, err, n);
  if (timed)
    return ok && profile_launches(ce, first, last, ce->marks[part ? p->nlaunches : p->nlaunches + 1], err, n);
  for (int i = first; ok && i < last; i++)
    ok = enqueue(ce, i, err, n);
  return ok;
}

// The scales and their inverses (exact: powers of two) sent up into the region, every step: 8n bytes,
// so that a state set on the host (a checkpoint restored through Engine.fp8) needs no other rule.
static bool fp8_send(CudaEngine *ce, char *err, size_t n) {
  const Fp8State *st = &ce->fp8;
  for (int t = 0; t < st->n; t++)
    ce->fp8_up[t] = st->scale[t], ce->fp8_up[st->n + t] = 1.0f / st->scale[t];
  return CU(err, n, cuMemcpyHtoDAsync, ce->arena + (CUdeviceptr)ce->plan->fp8, ce->fp8_up, 8 * (size_t)st->n,
            ce->stream);
}

// The amaxes of the first part read into the state (u32 bits of non-negative floats, NaN above
// infinity: the floats themselves), once it has run, and raised by Engine.set_fp8_amax's fn to the
// step's (its micro-batches', its ranks'); `fn` false: as recorded (a led pass's are its own).
static bool fp8_amaxes(CudaEngine *ce, bool fn, char *err, size_t n) {
  Fp8State *st = &ce->fp8;
  return download(ce, st->amax, ce->arena + (CUdeviceptr)(ce->plan->fp8 + 8 * (int64_t)st->n), 4 * (size_t)st->n,
                  err, n) &&
         (!fn || !ce->fp8_fn || ce->fp8_fn(ce->fp8_ctx, st->amax, st->n, err, n));
}

// A step in precision fp8, as ce_step_fp8 (engine.c) runs one on the CPU, with the scale arithmetic
// on the host in precision.c (fp8_state_update, fp8_state_check), so that the scales are the CPU back
// ends' to the bit: the scales sent up, the launches before the optimizer's first, the amaxes read
// back (one wait mid-step, for 4n bytes) and raised to the step's (Engine.set_fp8_amax), then the
// optimizer's launches. A non-finite amax makes a gradient the optimizer reads NaN, so that it skips
// the step as it skips any non-finite gradient (the runtime then names the tensor through
// Engine.fp8), and the state is not rolled. With no history yet (the first step) the first part runs
// once more beforehand with every scale 1, and the scales its amaxes (raised likewise) give are the
// step's (calibration). cu_step rolls the state (fp8_state_update) once the step's status is clean.
// Over several ranks (nccl_step) every rank gets the same amaxes from the hook (their max, over MPI on
// the host, while the stream is idle), so every rank checks alike and poisons alike: before the
// optimizer's first launch, before or after the gradient's all-reduce (NaN either way). A led step
// (Engine.set_fp8_lead) copies the lead's scales, runs whole and leaves its amaxes, nothing more.
static bool fp8_step(CudaEngine *ce, char *err, size_t n) {
  static const float nan_value = NAN; // (the source of an asynchronous copy: it must outlive the call)
  Fp8State *st = &ce->fp8;
  char why[8];
  bool timed = ce->e.profile && !ce->nccl; // (nccl_step times no launch)
  ce->fp8_bad = false;
  if (timed && !profile_events(ce, err, n))
    return false;
  if (ce->fp8_lead) {
    memcpy(st->scale, ce->fp8_lead, sizeof(float) * (size_t)st->n);
    return fp8_send(ce, err, n) && fp8_part(ce, 0, timed, true, err, n) && fp8_part(ce, 1, timed, true, err, n) &&
           fp8_amaxes(ce, false, err, n) && (!timed || profile_times(ce, err, n));
  }
  if (!st->recorded) {
    if (!fp8_send(ce, err, n) || !fp8_part(ce, 0, false, false, err, n) || !fp8_amaxes(ce, true, err, n))
      return false;
    fp8_state_update(st, ce->e.g, why, sizeof why); // (refused: the scales stay 1 and the step below names it)
  }
  if (!fp8_send(ce, err, n) || !fp8_part(ce, 0, timed, true, err, n) || !fp8_amaxes(ce, true, err, n))
    return false;
  ce->fp8_bad = fp8_state_check(st, ce->e.g, why, sizeof why);
  if (ce->fp8_bad && ce->fp8_poison >= 0 &&
      !CU(err, n, cuMemcpyHtoDAsync, ce->arena + (CUdeviceptr)ce->fp8_poison, &nan_value, sizeof nan_value, ce->stream))
    return false;
  return fp8_part(ce, 1, timed, true, err, n) && (!timed || profile_times(ce, err, n));
}

static Fp8State *cu_fp8(Engine *e) { return &((CudaEngine *)e)->fp8; }

static void cu_set_fp8_amax(Engine *e, bool (*fn)(void *ctx, float *amax, int n, char *err, size_t en), void *ctx) {
  ((CudaEngine *)e)->fp8_fn = fn, ((CudaEngine *)e)->fp8_ctx = ctx;
}

static void cu_set_fp8_lead(Engine *e, const float *scale) { ((CudaEngine *)e)->fp8_lead = scale; }

// The launches of each plan step that makes several and takes at least 1% of the step, in order:
// a kernel by its name, a GEMM by its shape (M x N x K, the batch, the operands' type).
static void cu_profile_launches(const Engine *e, double total, FILE *out) {
  const CudaEngine *ce = (const CudaEngine *)e;
  const CudaPlan *p = ce->plan;
  if (!ce->launch_seconds || e->profiled_steps == 0)
    return;
  double steps = (double)e->profiled_steps;
  bool header = false;
  for (int i = 0; i < p->nlaunches;) {
    int s = p->launches[i].step, j = i;
    while (j < p->nlaunches && p->launches[j].step == s)
      j++;
    if (j - i > 1 && e->kernel_seconds[s] >= 0.01 * total) {
      if (!header)
        fprintf(out, "launches inside the kernels above that make several (ms/step):\n");
      header = true;
      fprintf(out, "  %s:", e->fusion->steps[s].name);
      for (int k = i; k < j; k++) {
        const CudaLaunch *l = &p->launches[k];
        if (l->kernel) {
          const char *kernel = launch_kernel(ce, k), *name = kernel, *base = e->fusion->steps[s].name;
          if (!strncmp(name, base, strlen(base)) && name[strlen(base)] == '_')
            name += strlen(base) + 1; // k88_lmhead..._ce: ce
          fprintf(out, " %s %.3f%s", *name ? name : kernel, 1e3 * ce->launch_seconds[k] / steps, k + 1 < j ? "," : "");
        } else {
          const CudaGemm *gm = &p->gemms[l->gemm];
          char batch[32] = "";
          if (gm->batch > 1)
            snprintf(batch, sizeof batch, " x%lld", (long long)gm->batch);
          fprintf(out, " gemm %lldx%lldx%lld%s %s %.3f%s", (long long)gm->m, (long long)gm->n, (long long)gm->k, batch,
                  dtype_name(gm->ab), 1e3 * ce->launch_seconds[k] / steps, k + 1 < j ? "," : "");
        }
      }
      fprintf(out, "\n");
    }
    i = j;
  }
}

// The staged inputs and scalars up: in one copy, or, where inputs were set on the device, each of the
// others in its own.
static bool send_staged(CudaEngine *ce, char *err, size_t n) {
  if (ce->hi <= ce->lo)
    return true;
  if (!ce->ndevice)
    return CU(err, n, cuMemcpyHtoDAsync, ce->arena + (CUdeviceptr)ce->lo, ce->staging, (size_t)(ce->hi - ce->lo),
              ce->stream);
  const Graph *g = ce->e.g;
  for (int i = 0; i < g->n; i++) {
    int64_t at = ce->m->offset[i];
    if (!staged(g->nodes[i]) || at < 0 || ce->on_device[i])
      continue;
    size_t bytes = (size_t)shape_numel(g->nodes[i]->shape) * dtype_size(g->nodes[i]->dtype);
    if (!CU(err, n, cuMemcpyHtoDAsync, ce->arena + (CUdeviceptr)at, ce->staging + (at - ce->lo), bytes, ce->stream))
      return false;
  }
  return true;
}

// A node's values sent up; a parameter's bf16 copy (MemPlan.copy_of) rounded here, as cpu_round_copy
// does, and sent along.
static bool write_node(CudaEngine *ce, int node, const float *src, char *err, size_t n) {
  int64_t count = shape_numel(ce->e.g->nodes[node]->shape);
  int c = ce->e.g->nodes[node]->op == OP_PARAM ? ce->m->copy_of[node] : -1;
  if (ce->m->offset[node] >= 0 && !upload(ce, ce->m->offset[node], src, sizeof(float) * (size_t)count, err, n))
    return false;
  if (c < 0)
    return true;
  uint16_t *y = malloc(sizeof *y * (size_t)(count ? count : 1));
  if (!y)
    return rt_fail(err, n, "out of host memory");
  cpu_bf16_from_f32(src, y, count);
  bool ok = upload(ce, ce->m->offset[c], y, sizeof *y * (size_t)count, err, n);
  free(y);
  return ok;
}

// The parameters still to be drawn (ParamDraw), each drawn on the host as the interpreter draws it
// and sent up as a write sends it.
typedef struct {
  CudaEngine *ce;
  char *err;
  size_t n;
} CuDraw;

static bool cu_draw(void *ctx, int k) {
  CuDraw *d = ctx;
  const Graph *g = d->ce->e.g;
  int64_t count = shape_numel(g->nodes[g->params[k]]->shape);
  float *x = malloc(sizeof *x * (size_t)(count ? count : 1));
  if (!x)
    return rt_fail(d->err, d->n, "out of host memory for the initial parameters");
  cpu_draw_param(g, d->ce->draw.seed, k, x);
  bool ok = write_node(d->ce, g->params[k], x, d->err, d->n);
  free(x);
  return ok;
}

static bool cu_params(CudaEngine *ce, char *err, size_t n) {
  CuDraw d = {ce, err, n};
  return param_draw_now(&ce->draw, cu_draw, &d);
}

static bool cu_draw_params(Engine *e, char *err, size_t n) { return cu_params((CudaEngine *)e, err, n); }

// The gradients' all-reduces of a step of several ranks (Engine.set_nccl) due before plan step `step`
// (INT32_MAX: every one left), from the first not yet reduced: each gradient made its mean over the
// ranks (NCCL, on the same stream, between the events red[2r] and red[2r + 1]).
static bool nccl_reduce(CudaEngine *ce, int step, char *err, size_t n) {
  bool ok = true;
  for (; ok && ce->next_range < ce->nranges && ce->ranges[ce->next_range].at <= step; ce->next_range++) {
    int r = ce->next_range;
    CUdeviceptr x = ce->arena + (CUdeviceptr)ce->ranges[r].from;
    size_t count = (size_t)(ce->ranges[r].to - ce->ranges[r].from) / 4;
    ok = CU(err, n, cuEventRecord, ce->red[2 * r], ce->stream);
    if (ok && *ce->poison && cuda_drv.cuMemsetD32Async) // (a NaN, as float bits)
      ok = CU(err, n, cuMemsetD32Async, x, 0x7fc00000u, count, ce->stream);
    ok = ok && dist_nccl_mean_f32(ce->nccl, (void *)x, (int64_t)count, ce->stream, err, n) &&
         CU(err, n, cuEventRecord, ce->red[2 * r + 1], ce->stream);
  }
  return ok;
}

// Launches [first, last) of a step of several ranks, one by one on the stream, as --profile runs them
// (an all-reduce is not captured into the step's graph), with `comm` each gradient reduced before the
// first launch of the plan step that first reads it (a step starting at launch 0 starts from the
// first gradient), and at the plan's end the gradients left and ZeRO's all-gather. Precision fp8 runs
// a step as two such parts, cut at the optimizer (fp8_part).
static bool nccl_launches(CudaEngine *ce, int first, int last, bool comm, char *err, size_t n) {
  const CudaPlan *p = ce->plan;
  bool ok = true;
  if (first == 0)
    ce->next_range = 0;
  for (int i = first; ok && i < last; i++)
    ok = (!comm || nccl_reduce(ce, p->launches[i].step, err, n)) && enqueue(ce, i, err, n);
  if (!ok || !comm || last < p->nlaunches)
    return ok;
  ok = nccl_reduce(ce, INT32_MAX, err, n);
  if (ok && ce->zero_at) { // (ZeRO stage 1: each rank's updated parameters, and their bf16 copies, to all)
    ok = CU(err, n, cuEventRecord, ce->gathered[0], ce->stream) &&
         dist_nccl_gather_f32(ce->nccl, (void *)ce->arena, ce->zero_at, ce->stream, err, n) &&
         (ce->m->copy_bytes == 0 ||
          dist_nccl_gather_f32(ce->nccl, (void *)ce->arena, ce->zero_at + ce->zero_ranks + 1, ce->stream, err, n)) &&
         CU(err, n, cuEventRecord, ce->gathered[1], ce->stream);
  }
  return ok;
}

// A step of several ranks: the kernels' status zeroed, then every launch with the all-reduces.
static bool nccl_step(CudaEngine *ce, char *err, size_t n) {
  return CU(err, n, cuMemsetD8Async, ce->status, 0, sizeof(MdlStatus), ce->stream) &&
         nccl_launches(ce, 0, ce->plan->nlaunches, true, err, n);
}

const char *cuda_error_what(long long code) {
  switch (code) {
  case CUDA_ERR_EMBED_ID: return "embed: id";
  case CUDA_ERR_TARGET: return "cross_entropy: target";
  default: return "error";
  }
}

static bool cu_step(Engine *e, char *err, size_t n) {
  CudaEngine *ce = (CudaEngine *)e;
  MdlStatus st;
  if (!cu_params(ce, err, n) || !send_staged(ce, err, n) ||
      !CU(err, n, cuMemcpyHtoDAsync, ce->seed_dev, &ce->seed, sizeof ce->seed, ce->stream) ||
      !(ce->fp8.n     ? fp8_step(ce, err, n)
        : ce->nccl   ? nccl_step(ce, err, n)
        : e->profile ? profile_step(ce, err, n)
                     : CU(err, n, cuGraphLaunch, ce->exec, ce->stream)) ||
      !download(ce, &st, ce->status, sizeof st, err, n))
    return false;
  e->reduce_seconds = 0;
  for (int r = 0; ce->nccl && r < ce->nranges; r++) {
    float ms = 0;
    if (!CU(err, n, cuEventElapsedTime, &ms, ce->red[2 * r], ce->red[2 * r + 1]))
      return false;
    e->reduce_seconds += 1e-3 * ms;
  }
  float ms = 0;
  if (ce->nccl && ce->zero_at && !CU(err, n, cuEventElapsedTime, &ms, ce->gathered[0], ce->gathered[1]))
    return false;
  e->reduce_seconds += 1e-3 * ms;
  e->profiled_steps += e->profile && e->profile_warm;
  e->profile_warm |= e->profile;
  if (st.set)
    return rt_fail(err, n, "%s %lld out of range [0, %lld)", cuda_error_what(st.code), st.value, st.limit);
  char why[8];
  if (ce->fp8.n && !ce->fp8_bad && !ce->fp8_lead) // (a step that failed rolls nothing into the histories)
    fp8_state_update(&ce->fp8, e->g, why, sizeof why);
  return true;
}

// A value the plan keeps inside a kernel (never written to memory) reads as NaN, as on the CPU. A
// bf16 value comes down into the first half of dst and is widened in place, from its last element.
static void cu_read(Engine *e, int node, float *dst) {
  CudaEngine *ce = (CudaEngine *)e;
  int64_t count = shape_numel(e->g->nodes[node]->shape);
  bool bf16 = e->g->nodes[node]->dtype == DT_BF16;
  char err[256];
  if (!cu_params(ce, err, sizeof err))
    fprintf(stderr, "mdlc: cuda: %s\n", err);
  else if (ce->m->offset[node] >= 0) {
    if (download(ce, dst, ce->arena + (CUdeviceptr)ce->m->offset[node], (bf16 ? 2 : 4) * (size_t)count, err,
                 sizeof err)) {
      for (int64_t i = count - 1; bf16 && i >= 0; i--) {
        uint16_t h;
        memcpy(&h, (const char *)dst + 2 * i, 2);
        uint32_t u = (uint32_t)h << 16;
        memcpy(&dst[i], &u, 4);
      }
      return;
    }
    fprintf(stderr, "mdlc: cuda: %s\n", err);
  }
  for (int64_t i = 0; i < count; i++)
    dst[i] = NAN;
}

static void cu_write(Engine *e, int node, const float *src) {
  CudaEngine *ce = (CudaEngine *)e;
  char err[256];
  if (write_node(ce, node, src, err, sizeof err))
    param_draw_written(&ce->draw, e->g, node);
  else
    fprintf(stderr, "mdlc: cuda: %s\n", err);
}

static void cu_free(Engine *e);

// Engine.snapshot: the flat buffers of the parameters and both AdamW moments (MemPlan params, m, v,
// which hold every parameter and moment) copied into a device buffer of their own, allocated at the
// first snapshot: 1.5 GB for GPT-2 124M, copied in about a millisecond where reading them to the host
// stops the steps for the PCIe transfer of 1.5 GB. False where there is no memory for it (said once;
// the checkpoints then read the arena between steps).
static bool cu_snapshot(Engine *e) {
  CudaEngine *ce = (CudaEngine *)e;
  const MemPlan *m = ce->m;
  char err[256];
  if (ce->snap_refused || m->param_bytes <= 0)
    return false;
  if (!cu_params(ce, err, sizeof err)) {
    fprintf(stderr, "mdlc: cuda: %s\n", err);
    return false;
  }
  const int nr = 1 + m->moments; // the parameters and the moments the optimizer keeps
  if (!ce->snap) {
    if (cuda_drv.cuMemAlloc(&ce->snap, (size_t)nr * (size_t)m->param_bytes) != CUDA_SUCCESS ||
        cuda_drv.cuStreamCreate(&ce->snap_stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
      if (ce->snap)
        cuda_drv.cuMemFree(ce->snap);
      ce->snap = 0;
      ce->snap_stream = NULL;
      ce->snap_refused = true;
      printf("cuda: no device memory for a copy of the parameters and moments (%.2f GB): each checkpoint is read "
             "between two steps\n", nr * (double)m->param_bytes / 1e9);
      return false;
    }
    e->device_bytes += nr * m->param_bytes;
  }
  const int64_t from[3] = {m->params, m->m, m->v};
  bool ok = true;
  for (int r = 0; ok && r < nr; r++)
    ok = CU(err, sizeof err, cuMemcpyDtoDAsync, ce->snap + (CUdeviceptr)(r * m->param_bytes),
            ce->arena + (CUdeviceptr)from[r], (size_t)m->param_bytes, ce->stream);
  ok = ok && CU(err, sizeof err, cuStreamSynchronize, ce->stream);
  if (!ok)
    fprintf(stderr, "mdlc: cuda: %s\n", err);
  return ok;
}

// Engine.read_snapshot: parameter or moment `node` as the last snapshot holds it, on a stream of its
// own (the steps' stream may be replaying the graph meanwhile), from whichever thread calls.
static bool cu_read_snapshot(Engine *e, int node, float *dst, char *err, size_t n) {
  CudaEngine *ce = (CudaEngine *)e;
  const MemPlan *m = ce->m;
  const IrNode *x = e->g->nodes[node];
  int64_t at = m->offset[node], bytes = 4 * shape_numel(x->shape);
  const int64_t from[3] = {m->params, m->m, m->v};
  int r = 0, nr = 1 + m->moments;
  while (r < nr && !(at >= from[r] && at + bytes <= from[r] + m->param_bytes))
    r++;
  if (!ce->snap || at < 0 || r == nr || x->dtype != DT_F32)
    return rt_fail(err, n, "%s is not in the snapshot of the parameters and moments", x->name ? x->name : "a node");
  CUdeviceptr src = ce->snap + (CUdeviceptr)(r * m->param_bytes + at - from[r]);
  return CU(err, n, cuCtxSetCurrent, ce->ctx) &&
         CU(err, n, cuMemcpyDtoHAsync, dst, src, (size_t)bytes, ce->snap_stream) &&
         CU(err, n, cuStreamSynchronize, ce->snap_stream);
}

// Engine.take_params: both CUDA engines (one primary context, so one address space), every
// parameter in both arenas, and a bf16 copy in `from`'s wherever e keeps one (the same rounding of
// the same values: AdamW rounds into it as cu_write does), else nothing is copied.
static bool cu_take_params(Engine *e, Engine *from) {
  CudaEngine *ce = (CudaEngine *)e, *cf = (CudaEngine *)from;
  if (from->free != cu_free || cf->dev.ordinal != ce->dev.ordinal || from->g->nparams != e->g->nparams)
    return false;
  for (int i = 0; i < e->g->nparams; i++) {
    int p = e->g->params[i], q = from->g->params[i], c = ce->m->copy_of[p], cq = cf->m->copy_of[q];
    if (ce->m->offset[p] < 0 || cf->m->offset[q] < 0 ||
        shape_numel(e->g->nodes[p]->shape) != shape_numel(from->g->nodes[q]->shape) ||
        (c >= 0 && (ce->m->offset[c] < 0 || cq < 0 || cf->m->offset[cq] < 0)))
      return false;
  }
  char err[256];
  bool ok = cu_params(cf, err, sizeof err);
  for (int i = 0; ok && i < e->g->nparams; i++) {
    int p = e->g->params[i], q = from->g->params[i], c = ce->m->copy_of[p], cq = cf->m->copy_of[q];
    size_t count = (size_t)shape_numel(e->g->nodes[p]->shape);
    ok = CU(err, sizeof err, cuMemcpyDtoDAsync, ce->arena + (CUdeviceptr)ce->m->offset[p],
            cf->arena + (CUdeviceptr)cf->m->offset[q], 4 * count, ce->stream) &&
         (c < 0 || CU(err, sizeof err, cuMemcpyDtoDAsync, ce->arena + (CUdeviceptr)ce->m->offset[c],
                      cf->arena + (CUdeviceptr)cf->m->offset[cq], 2 * count, ce->stream));
  }
  ok = ok && CU(err, sizeof err, cuStreamSynchronize, ce->stream);
  if (ok)
    param_draw_all_written(&ce->draw);
  else
    fprintf(stderr, "mdlc: cuda: %s\n", err);
  return ok;
}

// Engine.inputs_from: f32 inputs of e and f32 nodes of `from` in memory, of one size each, both CUDA
// engines, all checked before anything runs; the copies or adds run on e's stream, waited for once
// (from's next step overwrites what they read).
static bool cu_inputs_from(Engine *e, int n, const char *const *names, Engine *from, const int *nodes, bool first) {
  CudaEngine *ce = (CudaEngine *)e, *cf = (CudaEngine *)from;
  if (from->free != cu_free || cf->dev.ordinal != ce->dev.ordinal || !ce->accumulate)
    return false;
  int *in = malloc(sizeof *in * (size_t)(n ? n : 1));
  bool ok = in != NULL;
  for (int i = 0; ok && i < n; i++) {
    in[i] = rt_input_node(e->g, names[i]);
    ok = in[i] >= 0 && ce->m->offset[in[i]] >= 0 && e->g->nodes[in[i]]->dtype == DT_F32 &&
         cf->m->offset[nodes[i]] >= 0 && from->g->nodes[nodes[i]]->dtype == DT_F32 &&
         shape_numel(e->g->nodes[in[i]]->shape) == shape_numel(from->g->nodes[nodes[i]]->shape);
  }
  if (!ok) {
    free(in);
    return false;
  }
  char err[256];
  for (int i = 0; ok && i < n; i++) {
    int64_t count = shape_numel(from->g->nodes[nodes[i]]->shape), blocks = (count + 255) / 256;
    CUdeviceptr y = ce->arena + (CUdeviceptr)ce->m->offset[in[i]], x = cf->arena + (CUdeviceptr)cf->m->offset[nodes[i]];
    void *args[] = {&y, &x, &count};
    ok = first ? CU(err, sizeof err, cuMemcpyDtoDAsync, y, x, 4 * (size_t)count, ce->stream)
               : CU(err, sizeof err, cuLaunchKernel, ce->accumulate, (unsigned)(blocks < 65535 ? blocks : 65535), 1,
                    1, 256, 1, 1, 0, ce->stream, args, NULL);
    ce->ndevice += !ce->on_device[in[i]];
    ce->on_device[in[i]] = true;
  }
  ok = ok && CU(err, sizeof err, cuStreamSynchronize, ce->stream);
  if (!ok)
    fprintf(stderr, "mdlc: cuda: %s\n", err);
  free(in);
  return ok;
}

// Engine.set_nccl: the gradients of engine_grad_ranges, reduced over the ranks by NCCL each step.
static bool cu_set_nccl(Engine *e, void *comm, const bool *poison) {
  CudaEngine *ce = (CudaEngine *)e;
  char err[256];
  free(ce->ranges);
  ce->ranges = NULL;
  ce->nccl = NULL;
  if (!comm)
    return true;
  if (!e->fusion || !(ce->ranges = engine_grad_ranges(e->fusion, ce->m, 0, &ce->nranges)))
    return false;
  for (int i = 0; ce->red && i < 2 * ce->nred; i++)
    cuda_drv.cuEventDestroy(ce->red[i]);
  free(ce->red);
  ce->nred = 0;
  if (!(ce->red = calloc(2 * (size_t)ce->nranges, sizeof *ce->red)))
    return false;
  for (; ce->nred < ce->nranges; ce->nred++)
    if (!CU(err, sizeof err, cuEventCreate, &ce->red[2 * ce->nred], 0) ||
        !CU(err, sizeof err, cuEventCreate, &ce->red[2 * ce->nred + 1], 0)) {
      fprintf(stderr, "mdlc: cuda: %s\n", err);
      return false;
    }
  ce->nccl = comm;
  ce->poison = poison;
  return true;
}

// Engine.set_shard (after set_nccl): the modules' mdl_own, the parameters the optimizer updates, and
// the shares nccl_step all-gathers by NCCL after the optimizer (gather and ctx: the CPU's, unused).
static bool cu_set_shard(Engine *e, const ZeroShard *s, bool (*gather)(void *ctx, float *x, const int64_t *at,
                                                                        char *err, size_t en), void *ctx) {
  (void)gather, (void)ctx;
  CudaEngine *ce = (CudaEngine *)e;
  char err[256] = "";
  if (s && (!ce->nccl || !ce->m))
    return false;
  int64_t own[2] = {0, 0}, k = s ? s->n + 1 : 0, *at = s ? malloc(sizeof(int64_t) * 4 * (size_t)k) : NULL;
  if (s && !at)
    return false;
  if (s) {
    engine_shard_at(s, e->g, ce->m, at, at + k, at + 2 * k, at + 3 * k);
    bool none = at[s->rank + 1] == at[s->rank]; // (an empty shard: no parameter is at or after INT64_MAX)
    own[0] = none ? INT64_MAX : 4 * at[s->rank];
    own[1] = none ? INT64_MAX : 4 * at[s->rank + 1];
  }
  bool ok = true;
  for (int i = 0; ok && i < ce->nmods; i++) {
    CUdeviceptr ptr;
    size_t bytes = 0;
    if (ce->mods[i] && cuda_drv.cuModuleGetGlobal(&ptr, &bytes, ce->mods[i], "mdl_own") == CUDA_SUCCESS &&
        bytes == sizeof own)
      ok = upload_to(ce, ptr, own, sizeof own, err, sizeof err);
  }
  if (ok && s && !ce->gathered[0])
    ok = CU(err, sizeof err, cuEventCreate, &ce->gathered[0], 0) && CU(err, sizeof err, cuEventCreate, &ce->gathered[1], 0);
  free(ce->zero_at);
  ce->zero_at = ok ? at : NULL;
  ce->zero_ranks = s ? s->n : 0;
  if (!ok) {
    free(at);
    fprintf(stderr, "mdlc: cuda: %s\n", err);
  }
  return ok;
}

static void cu_free(Engine *e) {
  CudaEngine *ce = (CudaEngine *)e;
  free(ce->zero_at);
  free(ce->ranges);
  for (int i = 0; ce->red && i < 2 * ce->nred; i++)
    if (ce->red[i])
      cuda_drv.cuEventDestroy(ce->red[i]);
  free(ce->red);
  for (int i = 0; i < 2; i++)
    if (ce->gathered[i])
      cuda_drv.cuEventDestroy(ce->gathered[i]);
  if (ce->stream)
    cuda_drv.cuStreamSynchronize(ce->stream);
  for (int i = 0; i < ce->nmarks; i++)
    cuda_drv.cuEventDestroy(ce->marks[i]);
  if (ce->snap_stream)
    cuda_drv.cuStreamDestroy(ce->snap_stream);
  if (ce->snap)
    cuda_drv.cuMemFree(ce->snap);
  if (ce->exec)
    cuda_drv.cuGraphExecDestroy(ce->exec);
  if (ce->graph)
    cuda_drv.cuGraphDestroy(ce->graph);
  if (ce->exec_opt)
    cuda_drv.cuGraphExecDestroy(ce->exec_opt);
  if (ce->graph_opt)
    cuda_drv.cuGraphDestroy(ce->graph_opt);
  for (int i = 0; ce->gemms && i < ce->plan->ngemms; i++)
    lt_gemm_free(&ce->gemms[i]);
  if (ce->lt)
    cuda_lt.cublasLtDestroy(ce->lt);
  if (ce->stream)
    cuda_drv.cuStreamDestroy(ce->stream);
  CUdeviceptr bufs[] = {ce->arena, ce->status, ce->workspace, ce->seed_dev};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
    if (bufs[i])
      cuda_drv.cuMemFree(bufs[i]);
  for (int i = 0; i < ce->nmods; i++)
    if (ce->mods[i])
      cuda_drv.cuModuleUnload(ce->mods[i]);
  free(ce->mods);
  if (ce->ctx)
    cuda_drv.cuDevicePrimaryCtxRelease(ce->dev.ordinal);
  free(ce->gemms);
  free(ce->fns);
  free(ce->alt);
  free(ce->staging);
  free(ce->on_device);
  free(ce->marks);
  free(ce->launch_seconds);
  free(ce->e.kernel_seconds);
  fp8_state_free(&ce->fp8);
  free(ce->fp8_up);
  param_draw_free(&ce->draw);
  free(ce);
}

// The arena zeroed; the parameters come when first needed (cu_params).
static bool init_arena(CudaEngine *ce, char *err, size_t n) {
  return CU(err, n, cuMemsetD8Async, ce->arena, 0, (size_t)ce->plan->arena_bytes, ce->stream);
}

// The staging area: the arena bytes from the first input or scalar to the end of the last.
static bool init_staging(CudaEngine *ce, const Graph *g, char *err, size_t n) {
  ce->lo = INT64_MAX;
  ce->hi = 0;
  for (int i = 0; i < g->n; i++)
    if (staged(g->nodes[i]) && ce->m->offset[i] >= 0) {
      int64_t end = ce->m->offset[i] + 4 * shape_numel(g->nodes[i]->shape);
      ce->lo = ce->m->offset[i] < ce->lo ? ce->m->offset[i] : ce->lo;
      ce->hi = end > ce->hi ? end : ce->hi;
    }
  if (ce->hi <= ce->lo)
    ce->lo = ce->hi = 0;
  ce->staging = calloc((size_t)(ce->hi - ce->lo) + 1, 1);
  ce->on_device = calloc((size_t)g->n, sizeof *ce->on_device);
  return (ce->staging && ce->on_device) || rt_fail(err, n, "out of host memory");
}

// The kernel that launch i runs: the plan's, or its variant where that was timed faster.
static const char *launch_kernel(const CudaEngine *ce, int i) {
  const CudaLaunch *l = &ce->plan->launches[i];
  return ce->alt && ce->alt[i] ? l->alt : l->kernel;
}

// Kernel launch i of the plan with function fn (the launch's kernel, or its variant when alt).
static bool launch(CudaEngine *ce, int i, CUfunction fn, bool alt, char *err, size_t n) {
  const CudaLaunch *l = &ce->plan->launches[i];
  int64_t args[CUDA_MAX_ARGS] = {0};
  memcpy(args, l->args, sizeof(int64_t) * (size_t)l->nargs);
  CUdeviceptr arena = ce->arena, status = ce->status, seed = ce->seed_dev;
  int64_t chunk = l->chunk;
  void *params[] = {&arena, &status, &seed, &chunk, args};
  const unsigned *grid = alt ? l->alt_grid : l->grid, *block = alt ? l->alt_block : l->block;
  return CU(err, n, cuLaunchKernel, fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], 0, ce->stream, params,
            NULL) ||
         rt_fail(err + strlen(err), n - strlen(err), " (kernel %s)", alt ? l->alt : l->kernel);
}

// Kernel `name` from the module that has it.
static bool get_function(CudaEngine *ce, const char *name, CUfunction *fn, char *err, size_t n) {
  for (int i = 0; i < ce->nmods; i++)
    if (cuda_drv.cuModuleGetFunction(fn, ce->mods[i], name) == CUDA_SUCCESS)
      return true;
  return rt_fail(err, n, "cuModuleGetFunction: no kernel %s in the module's %d cubin%s", name, ce->nmods,
                 ce->nmods == 1 ? "" : "s");
}

// The threads (and programs) NVRTC compiles the module on, into *k: $MDL_NVRTC_THREADS (1 to 64), else
// every online CPU (at most 64). False, saying why, when the variable is set to anything else.
static bool nvrtc_threads(int *k, char *err, size_t n) {
  const char *env = getenv("MDL_NVRTC_THREADS");
  if (env) {
    char *end;
    long v = strtol(env, &end, 10);
    if (end == env || *end || v < 1 || v > 64)
      return rt_fail(err, n, "MDL_NVRTC_THREADS=%s: not a number of threads from 1 to 64", env);
    *k = (int)v;
    return true;
  }
  long v = sysconf(_SC_NPROCESSORS_ONLN);
  *k = v < 1 ? 1 : v > 64 ? 64 : (int)v;
  return true;
}

static bool load_modules(CudaEngine *ce, const NvrtcModule *cubins, char *err, size_t n) {
  if (!(ce->mods = calloc((size_t)cubins->n, sizeof *ce->mods)))
    return rt_fail(err, n, "out of host memory");
  for (ce->nmods = 0; ce->nmods < cubins->n; ce->nmods++)
    if (!CU(err, n, cuModuleLoadData, &ce->mods[ce->nmods], cubins->parts[ce->nmods].cubin))
      return false;
  return true;
}

// Launch i of the plan (a kernel or a GEMM) on the stream.
static bool enqueue(CudaEngine *ce, int i, char *err, size_t n) {
  const CudaLaunch *l = &ce->plan->launches[i];
  if (!l->kernel)
    return lt_gemm_run(&ce->gemms[l->gemm], ce->lt, ce->workspace, ce->stream, err, n);
  return launch(ce, i, ce->fns[i], ce->alt && ce->alt[i], err, n);
}

// Times kernel launch i (its variant when alt) on the arena: one untimed run, then LT_TUNE_RUNS
// between two events; the milliseconds in *ms.
static bool time_launch(CudaEngine *ce, int i, bool alt, CUevent ev[2], float *ms, char *err, size_t n) {
  const CudaLaunch *l = &ce->plan->launches[i];
  CUfunction fn;
  if (!get_function(ce, alt ? l->alt : l->kernel, &fn, err, n))
    return false;
  bool ok = launch(ce, i, fn, alt, err, n) && CU(err, n, cuEventRecord, ev[0], ce->stream);
  for (int r = 0; ok && r < LT_TUNE_RUNS; r++)
    ok = launch(ce, i, fn, alt, err, n);
  return ok && CU(err, n, cuEventRecord, ev[1], ce->stream) && CU(err, n, cuEventSynchronize, ev[1]) &&
         CU(err, n, cuEventElapsedTime, ms, ev[0], ev[1]);
}

// Which launches run their kernel's variant: with tune_kernels, each kernel that has one is timed
// against it, once (its first launch; the layers' launches of it follow), and the faster runs;
// without, the plan's own kernel. The runs write the kernels' outputs, all of which the first step
// computes afresh (as the GEMMs' tuning runs do). Before the first step the inputs are zeros: one
// document, the whole causal triangle of attention's work, as unpacked data has it.
static bool tune_variants(CudaEngine *ce, char *err, size_t n) {
  const CudaPlan *p = ce->plan;
  ce->alt = calloc((size_t)p->nlaunches + 1, sizeof *ce->alt);
  if (!ce->alt)
    return rt_fail(err, n, "out of host memory");
  CUevent ev[2] = {NULL, NULL};
  bool ok = !ce->tune_kernels || (CU(err, n, cuEventCreate, &ev[0], 0) && CU(err, n, cuEventCreate, &ev[1], 0));
  for (int i = 0; ok && i < p->nlaunches; i++) {
    const CudaLaunch *l = &p->launches[i];
    if (!l->kernel || !l->alt)
      continue;
    int first = i;
    for (int j = 0; j < i && first == i; j++)
      if (p->launches[j].alt && !strcmp(p->launches[j].kernel, l->kernel) && !strcmp(p->launches[j].alt, l->alt))
        first = j;
    if (first < i) {
      ce->alt[i] = ce->alt[first];
      continue;
    }
    ce->variants++;
    float own = 0, other = 0;
    char why[256];
    // (a variant that does not launch here, for want of registers or shared memory on this device,
    // is passed over, as a GEMM candidate that fails to run is)
    if (ce->tune_kernels && (ok = time_launch(ce, i, false, ev, &own, err, n))) {
      bool ran = time_launch(ce, i, true, ev, &other, why, sizeof why);
      ce->alt[i] = ran && other < own;
      size_t at = strlen(ce->timed);
      char alt_ms[32] = "(did not launch)";
      if (ran)
        snprintf(alt_ms, sizeof alt_ms, "%.3f", other / LT_TUNE_RUNS);
      snprintf(ce->timed + at, sizeof ce->timed - at, "%s%s %.3f, %s %s ms", at ? "; " : "", l->kernel,
               own / LT_TUNE_RUNS, l->alt + (strncmp(l->alt, l->kernel, strlen(l->kernel)) ? 0 : strlen(l->kernel)),
               alt_ms);
    }
    ce->on_alt += ce->alt[i];
  }
  for (int i = 0; i < 2; i++)
    if (ev[i])
      cuda_drv.cuEventDestroy(ev[i]);
  return ok && CU(err, n, cuStreamSynchronize, ce->stream);
}

// Launches [first, last), after the step's head (clear_step) when `head`, captured from the stream
// into a graph and instantiated.
static bool capture_part(CudaEngine *ce, int first, int last, bool head, CUgraph *graph, CUgraphExec *exec, char *err,
                         size_t n) {
  if (!CU(err, n, cuStreamBeginCapture, ce->stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    return false;
  bool ok = !head || clear_step(ce, err, n);
  for (int i = first; ok && i < last; i++)
    ok = enqueue(ce, i, err, n);
  char why[256];
  bool ended = CU(why, sizeof why, cuStreamEndCapture, ce->stream, graph);
  if (ok && !ended)
    ok = rt_fail(err, n, "%s", why);
  return ok && CU(err, n, cuGraphInstantiateWithFlags, exec, *graph, 0);
}

// The whole step, launch by launch, captured into one graph; in precision fp8 into two, cut at the
// optimizer's first launch (fp8_step reads the amaxes between them).
static bool capture(CudaEngine *ce, char *err, size_t n) {
  const CudaPlan *p = ce->plan;
  ce->fns = calloc((size_t)p->nlaunches + 1, sizeof *ce->fns);
  if (!ce->fns)
    return rt_fail(err, n, "out of host memory");
  for (int i = 0; i < p->nlaunches; i++)
    if (p->launches[i].kernel && !get_function(ce, launch_kernel(ce, i), &ce->fns[i], err, n))
      return false;
  int cut = p->nfp8 ? ce->opt_launch : p->nlaunches;
  return capture_part(ce, 0, cut, true, &ce->graph, &ce->exec, err, n) &&
         (cut == p->nlaunches || capture_part(ce, cut, p->nlaunches, false, &ce->graph_opt, &ce->exec_opt, err, n));
}

// Where the engine's device memory does not fit (an allocation failed as out of memory), what it
// takes, what was free when it started, and how to take less, after the driver's message.
static void explain_oom(const CudaEngine *ce, size_t free_bytes, size_t total, char *err, size_t n) {
  if (!strstr(err, "OUT_OF_MEMORY"))
    return;
  double takes = (double)(ce->plan->arena_bytes + LT_WORKSPACE_BYTES);
  rt_fail(err + strlen(err), n - strlen(err), ": the engine takes %.2f GB of device memory (the step's arena %.2f "
          "GB) and %.2f GB of the device's %.2f were free; a smaller batch (-D B=...) takes less, and --accumulate K "
          "trains on K of them a step", takes / 1e9, (double)ce->plan->arena_bytes / 1e9, (double)free_bytes / 1e9,
          (double)total / 1e9);
}

// An engine that failed before any device set-up: what it holds so far, freed; NULL.
static Engine *drop_early(CudaEngine *ce) {
  free(ce->e.kernel_seconds);
  fp8_state_free(&ce->fp8);
  free(ce->fp8_up);
  free(ce);
  return NULL;
}

// Precision fp8's state (fp8_step): the scales 1 and no history, where the step is cut, and the
// gradient to poison, as the CPU engine finds them (GRAD_NORM's first input: the optimizer reads every
// gradient through the norm, so one NaN there skips the whole update).
static bool init_fp8(CudaEngine *ce, const Fusion *f, const MemPlan *m, char *err, size_t n) {
  const Graph *g = f->g;
  if (cuda_compute_capability(&ce->dev) < 89)
    return rt_fail(err, n, "precision fp8: the GPU %s (%s) has no FP8 tensor cores (sm_89 or later); use bf16",
                   ce->dev.name, ce->dev.arch);
  fp8_state_init(&ce->fp8, g);
  if (!(ce->fp8_up = calloc(2 * (size_t)g->nfp8, sizeof *ce->fp8_up)))
    return rt_fail(err, n, "out of host memory");
  int opt = f->nsteps;
  for (int i = f->nsteps - 1; i >= 0; i--)
    opt = f->steps[i].kind == STEP_OPTIMIZER ? i : opt;
  const CudaPlan *p = ce->plan;
  ce->opt_launch = p->nlaunches;
  for (int i = p->nlaunches - 1; i >= 0; i--)
    ce->opt_launch = p->launches[i].step >= opt ? i : ce->opt_launch;
  ce->fp8_poison = -1;
  for (int i = 0; i < g->n && ce->fp8_poison < 0; i++)
    if (g->nodes[i]->op == OP_GRAD_NORM)
      ce->fp8_poison = m->offset[g->nodes[i]->in[0]];
  ce->e.fp8 = cu_fp8;
  ce->e.set_fp8_amax = cu_set_fp8_amax;
  ce->e.set_fp8_lead = cu_set_fp8_lead;
  return true;
}

Engine *engine_cuda(const Fusion *f, const MemPlan *m, const CudaPlan *plan, uint64_t seed, bool tune_gemms,
                    bool tune_kernels, char *err, size_t n) {
  CudaEngine *ce = calloc(1, sizeof *ce);
  if (!ce) {
    rt_fail(err, n, "out of host memory");
    return NULL;
  }
  ce->m = m;
  ce->seed = seed;
  ce->tune = tune_gemms;
  ce->tune_kernels = tune_kernels;
  ce->e = (Engine){.name = "cuda", .g = f->g, .fusion = f, .set_input = cu_set_input, .set_scalar = cu_set_scalar,
                   .set_seed = cu_set_seed, .step = cu_step, .read = cu_read, .write = cu_write, .free = cu_free,
                   .take_params = cu_take_params, .draw_params = cu_draw_params, .inputs_from = cu_inputs_from,
                   .profile_launches = cu_profile_launches, .snapshot = cu_snapshot, .set_nccl = cu_set_nccl, .set_shard = cu_set_shard,
                   .read_snapshot = cu_read_snapshot,
                   .kernel_seconds = calloc((size_t)f->nsteps + 1, sizeof(double))};
  if (!ce->e.kernel_seconds) {
    rt_fail(err, n, "out of host memory");
    return drop_early(ce);
  }
  if (!cu_driver_device(&ce->dev, err, n) || !cu_driver_complete(err, n) || !lt_open(err, n) ||
      !nvrtc_available(err, n))
    return drop_early(ce);
  ce->plan = plan;
  if (!ce->plan) {
    rt_fail(err, n, "the CUDA emitter could not emit %s", f->g->model ? f->g->model : "the model");
    return drop_early(ce);
  }
  if (ce->plan->nfp8 && !init_fp8(ce, f, m, err, n))
    return drop_early(ce);
  NvrtcModule cubins = {0};
  double tc = rt_now();
  int threads = 1;
  if (!nvrtc_threads(&threads, err, n) || !nvrtc_compile_units(ce->plan, ce->dev.arch, threads, &cubins, err, n))
    return drop_early(ce);
  tc = rt_now() - tc;
  ce->e.cache_hit = cubins.cache_hit;
  ce->e.compile_seconds = cubins.seconds;
  double t0 = rt_now();
  size_t free0 = 0, total0 = 0;
  param_draw_init(&ce->draw, f->g, seed);
  bool ok = CU(err, n, cuDevicePrimaryCtxRetain, &ce->ctx, ce->dev.ordinal) && CU(err, n, cuCtxSetCurrent, ce->ctx) &&
            load_modules(ce, &cubins, err, n) &&
            CU(err, n, cuStreamCreate, &ce->stream, CU_STREAM_NON_BLOCKING) &&
            CU(err, n, cuMemGetInfo, &free0, &total0) &&
            CU(err, n, cuMemAlloc, &ce->arena, (size_t)ce->plan->arena_bytes) &&
            CU(err, n, cuMemAlloc, &ce->status, sizeof(MdlStatus)) &&
            CU(err, n, cuMemAlloc, &ce->seed_dev, sizeof ce->seed) &&
            upload_to(ce, ce->seed_dev, &ce->seed, sizeof ce->seed, err, n) &&
            CU(err, n, cuMemAlloc, &ce->workspace, LT_WORKSPACE_BYTES) && init_arena(ce, err, n) &&
            init_staging(ce, f->g, err, n) && CU(err, n, cuStreamSynchronize, ce->stream);
  // (the set-up's parts, timed for the "cuda:" line: the module and memory, the GEMMs' tuning, the
  // kernel variants' timing, the graph's capture)
  double t_memory = rt_now();
  ok = ok && lt_init_gemms(ce, f, err, n);
  double t_gemms = rt_now();
  ok = ok && tune_variants(ce, err, n);
  double t_variants = rt_now();
  ok = ok && capture(ce, err, n);
  double t_capture = rt_now();
  int programs = cubins.n;
  nvrtc_module_free(&cubins);
  if (!ok) {
    explain_oom(ce, free0, total0, err, n);
    cu_free(&ce->e);
    return NULL;
  }
  char ignored[256];
  if (!get_function(ce, "mdl_accumulate", &ce->accumulate, ignored, sizeof ignored))
    ce->accumulate = NULL; // (a module without it: inputs_from declines and the host adds)
  ce->e.device_bytes = ce->plan->arena_bytes + LT_WORKSPACE_BYTES + (int64_t)(sizeof(MdlStatus) + sizeof ce->seed);
  size_t free_bytes = 0, total = 0;
  cuda_drv.cuMemGetInfo(&free_bytes, &total);
  char compiled[96];
  if (ce->e.cache_hit)
    snprintf(compiled, sizeof compiled, "%d cubin%s from the cache in %.3f s", programs, programs == 1 ? "" : "s", tc);
  else if (programs == 1)
    snprintf(compiled, sizeof compiled, "NVRTC %.2f s", ce->e.compile_seconds);
  else
    snprintf(compiled, sizeof compiled, "NVRTC %.2f s (%d programs at once)", ce->e.compile_seconds, programs);
  char tuning[96] = "on the heuristic's first algorithms, untimed";
  if (ce->tune)
    snprintf(tuning, sizeof tuning, "%d kinds timed; %d run faster on another algorithm than the heuristic's first",
             ce->kinds, ce->retuned);
  char variants[96] = "";
  if (ce->variants && ce->tune_kernels)
    snprintf(variants, sizeof variants, ", %d of the %d with a variant on it (timed faster)", ce->on_alt,
             ce->variants);
  else if (ce->variants)
    snprintf(variants, sizeof variants, ", %d with a variant, untimed", ce->variants);
  printf("cuda: %s (%s): %d kernels%s and %d GEMMs (%s) in %s of %d launches; %s; arena %.1f MB; set up in "
         "%.2f s (module and memory %.2f, GEMMs %.2f, kernel variants %.2f, graph %.2f); device memory in use %.2f "
         "GiB of %.2f\n",
         ce->dev.name, ce->dev.arch, ce->plan->nkernels, variants, ce->plan->ngemms, tuning,
         ce->graph_opt ? "two graphs (fp8: cut at the optimizer for the amaxes)" : "one graph", ce->plan->nlaunches,
         compiled, (double)ce->plan->arena_bytes / 1e6, rt_now() - t0, t_memory - t0, t_gemms - t_memory,
         t_variants - t_gemms, t_capture - t_variants, (double)(total - free_bytes) / (1 << 30),
         (double)total / (1 << 30));
  if (*ce->timed)
    printf("cuda: kernels and their variants, a launch each: %s\n", ce->timed);
  return &ce->e;
}
