// trainlog.c: what a run reports as it goes: the step lines, the progress line between them on a
// terminal, and the loss curve OUT/loss.svg.
#include "runtime.h"
#include "train_impl.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>

// OUT/loss.svg: the training loss per step and the validation loss, on one set of axes, and each
// metric (names[0, nmet)) as a line of its own colour with its validation values as squares.
bool write_svg(const char *path, const Curve *c, const char *const *names, int nmet, double unigram,
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

void push(double **a, int64_t *n, int64_t *cap, double v) {
  if (*n == *cap) {
    *cap = *cap ? 2 * *cap : 256;
    *a = rt_xrealloc(*a, sizeof(double) * (size_t)*cap);
  }
  (*a)[(*n)++] = v;
}

void eta(double seconds, char *buf, size_t n) {
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

void progress_show(Progress *p, int64_t step, int64_t last, double tok_s, double mfu, const char *eta_s) {
  progress_clear(p);
  printf("step %lld/%lld | loss %.4f (smoothed) | %.0f tok/s | MFU %.2f%% | ETA %s", (long long)step,
         (long long)last, p->weight > 0 ? p->ema / p->weight : NAN, tok_s, mfu, eta_s);
  fflush(stdout);
  p->shown = true;
}

// "SEP NAME VALUE" for each metric (prefix "val " at validation), into buf; "" when there are none.
const char *metrics_line(const Metrics *m, const double *v, const char *sep, const char *prefix, char *buf,
                                size_t n) {
  size_t k = 0;
  buf[0] = 0;
  for (int j = 0; j < m->n && k < n; j++)
    k += (size_t)snprintf(buf + k, n - k, "%s%s%s %.4f", sep, prefix, m->name[j], v[j]);
  return buf;
}
