// trainlog.c: what a run reports: each step's line (on a terminal, the progress line between full
// ones) and its line of OUT/log.jsonl, and at the end the summary and the loss curve OUT/loss.svg.
#include "runtime.h"
#include "train_impl.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

// OUT/loss.svg: the training loss per step and the validation loss, on one set of axes, and each
// metric (names[0, nmet)) as a line of its own colour with its validation values as squares.
static bool write_svg(const char *path, const Curve *c, const char *const *names, int nmet, double unigram,
                      bool arrays) {
  static const char *colour[] = {"seagreen", "darkorange", "purple", "olive", "teal", "sienna"};
  char tmp[PATH_MAX + 40];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f)
    return false;
  double lo = INFINITY, hi = -INFINITY;
  for (int64_t i = 0; i < c->n; i++)
    if (isfinite(c->loss[i]))
      lo = fmin(lo, c->loss[i]), hi = fmax(hi, c->loss[i]);
  for (int64_t i = 0; i < c->nval; i++)
    lo = fmin(lo, c->val[i]), hi = fmax(hi, c->val[i]);
  for (int64_t i = 0; i < c->nmet; i++)
    if (isfinite(c->met[i]))
      lo = fmin(lo, c->met[i]), hi = fmax(hi, c->met[i]);
  for (int64_t i = 0; i < c->nvalmet; i++)
    if (isfinite(c->val_met[i]))
      lo = fmin(lo, c->val_met[i]), hi = fmax(hi, c->val_met[i]);
  if (isfinite(unigram))
    lo = fmin(lo, unigram), hi = fmax(hi, unigram);
  if (!(hi > lo))
    hi = lo + 1;
  const double W = 640, H = 400, L = 60, R = 20, T = 30, Bm = 40;
  double xs = (W - L - R) / (double)(c->n > 1 ? c->n - 1 : 1), ys = (H - T - Bm) / (hi - lo);
#define X(i) (L + (double)(i) * xs)
#define Y(v) (H - Bm - ((v) - lo) * ys)
  fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
             "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H);
  fprintf(f, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/>\n", L, H - Bm, W - R, H - Bm);
  fprintf(f, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/>\n", L, T, L, H - Bm);
  for (int k = 0; k <= 4; k++) {
    double v = lo + (hi - lo) * k / 4;
    fprintf(f, "<text x=\"%g\" y=\"%g\" text-anchor=\"end\">%.2f</text>\n", L - 4, Y(v) + 4, v);
  }
  fprintf(f, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">step (1 .. %lld)</text>\n", (L + W - R) / 2, H - 10,
          (long long)c->n);
  fprintf(f, "<text x=\"%g\" y=\"18\">loss%s: train (blue), validation (red)%s", L, arrays ? "" : " (nats/token)",
          isfinite(unigram) ? ", unigram entropy (grey)" : "");
  for (int j = 0; j < nmet; j++)
    fprintf(f, ", %s (%s)", names[j], colour[j % 6]);
  fprintf(f, "</text>\n");
  if (isfinite(unigram))
    fprintf(f, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"grey\" stroke-dasharray=\"4\"/>\n", L,
            Y(unigram), W - R, Y(unigram));
  fprintf(f, "<polyline fill=\"none\" stroke=\"steelblue\" points=\"");
  for (int64_t i = 0; i < c->n; i++)
    if (isfinite(c->loss[i]))
      fprintf(f, "%.1f,%.1f ", X(i), Y(c->loss[i]));
  fprintf(f, "\"/>\n");
  for (int64_t i = 0; i < c->nval; i++)
    fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"crimson\"/>\n", X(c->val_step[i] - 1), Y(c->val[i]));
  for (int j = 0; j < nmet; j++) {
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" points=\"", colour[j % 6]);
    for (int64_t i = 0; i < c->n; i++)
      if (isfinite(c->met[i * nmet + j]))
        fprintf(f, "%.1f,%.1f ", X(i), Y(c->met[i * nmet + j]));
    fprintf(f, "\"/>\n");
    for (int64_t i = 0; i < c->nval; i++)
      if (isfinite(c->val_met[i * nmet + j]))
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"6\" height=\"6\" fill=\"%s\"/>\n", X(c->val_step[i] - 1) - 3,
                Y(c->val_met[i * nmet + j]) - 3, colour[j % 6]);
  }
  fprintf(f, "</svg>\n");
#undef X
#undef Y
  return fclose(f) == 0 && rename(tmp, path) == 0;
}

void curve_push(double **a, int64_t *n, int64_t *cap, double v) {
  if (*n == *cap) {
    *cap = *cap ? 2 * *cap : 256;
    *a = rt_xrealloc(*a, sizeof(double) * (size_t)*cap);
  }
  (*a)[(*n)++] = v;
}

static void eta(double seconds, char *buf, size_t n) {
  long s = (long)(seconds + 0.5);
  snprintf(buf, n, "%ld:%02ld", s / 60, s % 60);
}

// How often a run prints a full step line when --log-every does not say: the largest of 1, 2, 5,
// 10, 20, 50, ... that is at most steps / 20, so that a run prints 20 to 50 of them.
int64_t train_log_every(int64_t steps) {
  static const int64_t nice[] = {1, 2, 5};
  int64_t every = 1;
  for (int64_t scale = 1; scale <= steps / 20; scale *= 10)
    for (int k = 0; k < 3; k++)
      if (nice[k] * scale <= steps / 20)
        every = nice[k] * scale;
  return every;
}

void progress_clear(Progress *p) {
  if (p->shown)
    fputs("\r\033[K", stdout);
  p->shown = false;
}

static void progress_show(Progress *p, int64_t step, int64_t last, double tok_s, double mfu, const char *eta_s) {
  progress_clear(p);
  printf("step %lld/%lld | loss %.4f (smoothed) | %.0f tok/s | MFU %.2f%% | ETA %s", (long long)step,
         (long long)last, p->weight > 0 ? p->ema / p->weight : NAN, tok_s, mfu, eta_s);
  fflush(stdout);
  p->shown = true;
}

// "SEP NAME VALUE" for each metric (prefix "val " at validation), into buf; "" when there are none.
static const char *metrics_line(const Metrics *m, const double *v, const char *sep, const char *prefix, char *buf,
                                size_t n) {
  size_t k = 0;
  buf[0] = 0;
  for (int j = 0; j < m->n && k < n; j++)
    k += (size_t)snprintf(buf + k, n - k, "%s%s%s %.4f", sep, prefix, m->name[j], v[j]);
  return buf;
}
// The step's line (a full one, else on a terminal the progress line) and its line of log.jsonl; a
// log that cannot be written is said once, and ends the run (log_failed, rc 1).
void log_step(Run *r, const RunStep *s) {
  const TrainOptions *o = r->o;
  Engine *e = r->e, *eval = r->eval, *micro = r->micro;
  const Metrics *met = &r->met;
  const Curve *c = &r->c;
  int64_t step = s->step, start = r->start, last = r->last;
  double loss = s->loss, dt = s->dt;
  // Peak memory: the process's on the host, and what the engines hold on a device (allocated when
  // each is built, and a checkpoint's snapshot at the first checkpoint: never freed before the end,
  // so also their peak there).
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  int64_t device =
      e->device_bytes + (eval ? eval->device_bytes : 0) + (micro && micro != e ? micro->device_bytes : 0);
  char device_s[48] = "";
  if (device > 0)
    snprintf(device_s, sizeof device_s, ", device %.0f MB", (double)device / 1e6);
  double elapsed = rt_now() - r->t_start, left = elapsed / (double)(step - start) * (double)(last - step);
  char eta_s[32];
  eta(left, eta_s, sizeof eta_s);
  double tok_s = (double)s->real / dt, mfu = 100.0 * (double)r->k * r->flops / dt / r->peak;
  if (isfinite(loss)) {
    r->pg.ema = 0.9 * r->pg.ema + 0.1 * loss;
    r->pg.weight = 0.9 * r->pg.weight + 0.1;
  }
  char met_s[512], comm_s[48] = "";
  if (r->world > 1)
    snprintf(comm_s, sizeof comm_s, " | comm %.1f ms", 1e3 * r->red.seconds);
  if (!o->quiet && (step == start + 1 || step == last || step % r->log_every == 0 || s->do_val)) {
    progress_clear(&r->pg);
    printf("step %5lld/%lld | loss %.4f%s | lr %.2e | norm %6.3f | %7.1f ms%s | %8.0f %s | MFU %5.2f%% | "
           "peak %.0f MB%s | ETA %s\n",
           (long long)step, (long long)last, loss, metrics_line(met, met->now, " | ", "", met_s, sizeof met_s), s->lr,
           s->norm, 1e3 * dt, comm_s, tok_s, r->unit, mfu, (double)ru.ru_maxrss * 1024.0 / 1e6, device_s,
           eta_s); // (ru_maxrss: KiB; MB as the arena's)
    if (s->do_val && o->arrays)
      printf("step %5lld/%lld | val loss %.4f%s\n", (long long)step, (long long)last, r->last_val,
             metrics_line(met, c->val_met + c->nvalmet - met->n, " | ", "val ", met_s, sizeof met_s));
    else if (s->do_val)
      printf("step %5lld/%lld | val loss %.4f (unigram entropy %.4f)%s\n", (long long)step, (long long)last,
             r->last_val, r->unigram,
             metrics_line(met, c->val_met + c->nvalmet - met->n, " | ", "val ", met_s, sizeof met_s));
  } else if (r->pg.on) {
    progress_show(&r->pg, step, last, (double)r->real_total / r->step_secs,
                  100.0 * (double)r->k * r->flops * (double)(step - start) / r->step_secs / r->peak, eta_s);
  }
  fflush(stdout);
  // (a full disk: the log's write fails as the checkpoint's will; each is reported, once)
  FILE *log = r->log;
  bool logged = fprintf(log, "{\"step\":%lld,\"loss\":%.6f,\"lr\":%.6g,\"grad_norm\":%.6g,\"ms\":%.3f,\"%s\":%.1f,"
                        "\"mfu\":%.4f", (long long)step, loss, s->lr, s->norm, 1e3 * dt, o->arrays ? "ex_s" : "tok_s",
                        tok_s, mfu) > 0;
  if (r->world > 1)
    logged &= fprintf(log, ",\"comm_ms\":%.3f,\"allreduce_ms\":%.3f", 1e3 * r->red.seconds, 1e3 * r->red.busy) > 0;
  for (int j = 0; j < met->n; j++)
    logged &= fprintf(log, ",\"%s\":%.6g", met->name[j], met->now[j]) > 0;
  if (s->do_val)
    logged &= fprintf(log, ",\"val_loss\":%.6f", r->last_val) > 0;
  for (int j = 0; s->do_val && j < met->n; j++)
    logged &= fprintf(log, ",\"val_%s\":%.6g", met->name[j], c->val_met[c->nvalmet - met->n + j]) > 0;
  logged &= fprintf(log, "}\n") > 0;
  logged &= fflush(log) == 0;
  if (!logged && !r->log_failed) {
    progress_clear(&r->pg);
    diag_file_error(r->log_path, "cannot write the log at step %lld: %s; stopping", (long long)step, strerror(errno));
    r->log_failed = true;
    r->rc = 1;
  }
}

// The end of a run that trained: its rates, final figures and loss curve.
void log_summary(Run *r) {
  const TrainOptions *o = r->o;
  const Metrics *met = &r->met;
  const Curve *c = &r->c;
  const char *unit = r->unit;
  // The whole run's rate, and the steps' alone: on a GPU a 30-step run spends most of its time
  // validating and writing checkpoints (GPT-2 124M on an H200: 0.9 s of steps in 4.2 s).
  double secs = rt_now() - r->t_start;
  char val_s[48] = "no validation", met_s[512], val_met_s[512] = "", unigram_s[48] = "";
  if (!isnan(r->last_val)) // (a run stopped before its last step, with --val-every 0, has none)
    snprintf(val_s, sizeof val_s, "val loss %.4f", r->last_val);
  if (!isnan(r->last_val) && met->n)
    metrics_line(met, c->val_met + c->nvalmet - met->n, ", ", "val ", val_met_s, sizeof val_met_s);
  if (!o->arrays)
    snprintf(unigram_s, sizeof unigram_s, ", unigram entropy %.4f", r->unigram);
  printf("trained %lld steps in %.1f s (%.0f %s; in the steps alone %.1f s, %.0f %s, the rest validation "
         "and checkpoints); final loss %.4f%s, %s%s%s\n",
         (long long)c->n, secs, (double)r->real_total / secs, unit, r->step_secs, (double)r->real_total / r->step_secs,
         unit, c->loss[c->n - 1], metrics_line(met, c->met + c->nmet - met->n, ", ", "", met_s, sizeof met_s), val_s,
         val_met_s, unigram_s);
  if (r->world > 1)
    printf("data parallel over %d ranks: %.0f %s a rank; waiting on the all-reduces %.1f s, %.1f%% of the steps' "
           "time (in them %.1f s%s)\n", r->world, (double)r->real_total / r->step_secs / r->world, unit,
           r->comm_total, 100.0 * r->comm_total / r->step_secs, r->busy_total,
           r->overlapped ? ", the rest beside the backward" : "");
  if (!write_svg(r->svg, c, met->name, met->n, r->unigram, o->arrays))
    diag_file_error(r->svg, "cannot write the loss curve: %s", strerror(errno));
  printf("wrote %s, %s and %s\n", r->ckpt, r->log_path, r->svg);
}
