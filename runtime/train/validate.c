// validate.c: the validation loss (and the metrics) on held-out batches, at the steps of a run that
// are due one and in `mdlc eval`, and the unigram entropy of the training tokens it is measured against.
#include "runtime.h"
#include "train_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

// The means over the first `batches` validation batches (from `first`) of the loss, into mean[0], and
// of the scalar outputs of eval's graph, into mean[1..] (in the graph's order). The same batches
// every time, so that the figures of one run compare, a resumed run's equal an uninterrupted one's,
// and `mdlc eval` on a checkpoint gives the figures of the run that wrote it.
static bool val_means(Engine *eval, Loader *val, LoaderState first, int64_t batches, int64_t BT, double *mean,
                      char *err, size_t n) {
  const Graph *g = eval->g;
  if (!loader_seek(val, first))
    return rt_fail(err, n, "cannot go back to the first validation batch");
  for (int i = 0; i <= g->noutputs; i++)
    mean[i] = 0;
  for (int64_t b = 0; b < batches; b++) {
    Batch batch;
    loader_next(val, &batch);
    if (!feed_batch(eval, &batch, BT) || !eval->step(eval, err, n))
      return false;
    mean[0] += engine_scalar(eval, g->loss);
    for (int i = 0; i < g->noutputs; i++)
      mean[i + 1] += engine_scalar(eval, g->outputs[i]);
  }
  for (int i = 0; i <= g->noutputs; i++)
    mean[i] /= (double)batches * (dist_on() ? dist_size() : 1);
  return dist_sum_f64(mean, g->noutputs + 1, "a validation", -1, err, n); // (each rank's own slices)
}

// Arrays validate on the first `want` (--val-batches) batches of B examples, at most as many as the
// val split fills, so that no example counts twice (one batch, wrapping, where it holds fewer than B).
int64_t array_val_batches(const Loader *val, int64_t B, int64_t want) {
  int64_t fill = loader_rows(val) / B;
  return fill < 1 ? 1 : fill < want ? fill : want;
}

// The mean validation loss, on the eval engine with the training parameters, and the means of its
// scalar outputs in mean[1..] (val_means).
static double validate(Engine *train, Engine *eval, Loader *val, LoaderState first, int64_t batches, int64_t BT,
                       double *mean, char *err, size_t n) {
  err[0] = 0;
  if (train->idle) // the training step's gradients and activations are dead until its next step
    train->idle(train, false);
  copy_params(train, eval);
  double loss = val_means(eval, val, first, batches, BT, mean, err, n) ? mean[0] : NAN;
  if (isnan(loss) && !err[0])
    rt_fail(err, n, "the validation loss is NaN: the model's outputs on the validation batches are not finite, "
            "though the training step's loss and gradient norm were");
  if (eval->idle) // its parameters come anew from the training engine at the next validation
    eval->idle(eval, true);
  return loss;
}

// Unigram entropy (nats/token) of the training tokens: the loss of a model that knows only token
// frequencies; the trained model must end well below it. A figure for the log only: a shard that
// cannot be read for it (mapped a second time, under a memory limit) leaves it out (NaN) with a
// warning, and the run goes on (the loader has the shards it trains on).
double unigram_entropy(const char *dir, int64_t vocab) {
  char **paths;
  int n = shard_list(dir, "train", &paths);
  double *count = calloc((size_t)vocab, sizeof *count), total = 0, h = 0;
  if (!count) { // (a figure for the log only)
    shard_list_free(paths, n);
    return NAN;
  }
  for (int i = 0; i < n; i++) {
    Shard s;
    char why[200];
    if (!shard_map(&s, paths[i], vocab, why, sizeof why)) {
      fprintf(stderr, "mdlc: warning: %s: %s; the unigram entropy is left out\n", paths[i], why);
      total = 0;
      break;
    }
    for (int64_t k = 0; k < s.n; k++)
      count[s.tokens[k]]++;
    total += (double)s.n;
    shard_close(&s);
  }
  for (int64_t v = 0; total > 0 && v < vocab; v++)
    if (count[v] > 0)
      h -= count[v] / total * log(count[v] / total);
  free(count);
  shard_list_free(paths, n);
  return total > 0 ? h : NAN;
}

int train_eval(Engine *eval, const TrainOptions *o) {
  const Graph *g = eval->g;
  int64_t B = ir_dim(g, "B"), T = o->arrays ? 1 : ir_dim(g, "T"), V = ir_dim(g, "V");
  if (g->loss < 0 || (o->arrays ? B <= 0 : !shards_fit(g, o->data_dir))) {
    if (g->loss < 0 || o->arrays)
      diag_file_error(o->model_path, "evaluation needs a loss%s", o->arrays ? " and a dim B" : "");
    return 1;
  }
  LoaderOptions lo = {.B = B, .T = T, .vocab = V, .pack = o->pack, .shuffle = o->shuffle && !o->arrays,
                      .seed = o->seed, .model = o->arrays ? g : NULL, .val_fraction = o->val_fraction};
  Loader *val = loader_open(o->data_dir, "val", lo);
  if (!val)
    return 1;
  int64_t batches = o->arrays ? array_val_batches(val, B, o->val_batches) : o->val_batches;
  double *mean = rt_xrealloc(NULL, sizeof(double) * (size_t)(g->noutputs + 1));
  char err[512] = "";
  bool ok = val_means(eval, val, loader_state(val), batches, B * T, mean, err, sizeof err);
  if (!ok)
    diag_file_error(o->model_path, "evaluation: %s", err);
  if (ok && o->arrays)
    printf("val loss %.4f over %lld validation batches of %lld examples\n", mean[0], (long long)batches,
           (long long)B);
  else if (ok)
    printf("val loss %.4f (unigram entropy %.4f) over %lld validation batches of %lldx%lld\n", mean[0],
           unigram_entropy(o->data_dir, V), (long long)o->val_batches, (long long)B, (long long)T);
  for (int i = 0; ok && i < g->noutputs; i++) // (the scalar outputs besides the loss: the driver's open_side_engine)
    printf("%s %.6g\n", g->nodes[g->outputs[i]]->name, mean[i + 1]);
  free(mean);
  loader_close(val);
  return ok ? 0 : 1;
}
// Validation at the steps it is due (every val_every and the last, unless the step is not finite),
// its figures into the curves; false after saying why it failed.
bool validate_step(Run *r, RunStep *s) {
  // A loss or gradient norm that is not finite: the optimizer left the weights and moments as they
  // were (emit_c.c, emit_cuda.c, engine.c's interpreter test the same two values), so they are the
  // last finite ones.
  const TrainOptions *o = r->o;
  int64_t step = s->step;
  Curve *c = &r->c;
  s->nonfinite = !isfinite(s->loss) || (r->gnorm >= 0 && !isfinite(s->norm));
  s->do_val = r->eval && !s->nonfinite && ((o->val_every > 0 && step % o->val_every == 0) || step == r->last);
  if (!s->do_val)
    return true;
  r->last_val = validate(r->e, r->eval, r->val, r->val_first, r->val_batches, r->B * r->T, r->val_mean, r->err,
                         sizeof r->err);
  if (isnan(r->last_val)) {
    progress_clear(&r->pg);
    diag_file_error(o->model_path, "validation at step %lld: %s", (long long)step, r->err);
    r->rc = 1;
    return false;
  }
  if (c->nval == c->capval) {
    c->capval = c->capval ? 2 * c->capval : 64;
    c->val = rt_xrealloc(c->val, sizeof(double) * (size_t)c->capval);
    c->val_step = rt_xrealloc(c->val_step, sizeof(int64_t) * (size_t)c->capval);
  }
  c->val[c->nval] = r->last_val;
  c->val_step[c->nval++] = step - r->start;
  for (int j = 0; j < r->met.n; j++)
    curve_push(&c->val_met, &c->nvalmet, &c->capvalmet, r->met.val[j] >= 0 ? r->val_mean[1 + r->met.val[j]] : NAN);
  return true;
}
