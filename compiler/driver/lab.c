// lab.c: `mdlc lab MODEL --data DIR`: what each training technique is worth for this model on this
// machine. Every technique mdl turns on by default can be switched off; the lab trains the same
// model on the same data from the same seed with all of them off (the baseline), then adds one per
// row in the order a practitioner's table of speed-ups lists them (bf16, compilation, flash
// attention, a fused optimizer, gradient checkpointing, sequence packing, pre-tokenised data, FP8),
// and then takes each away alone from the full system. Each row is a `mdlc run` of its own, in a
// process of its own (so its peak memory is its own): tokens/s is the median of its steps after the
// warm-up, with the slowest and fastest; MFU, peak memory, kernels per step, the loss after the same
// number of steps. Two questions need more than a row: checkpointing is worth the batch it allows
// (the largest batch within a memory budget with and without it, and the tokens/s there), and
// packing is only right with the document mask (the leak check: perturb one document, the other
// documents' logits must not move; off, they do, and the loss looks better than it is). Output: the
// tables in the terminal, lab.md, lab.csv and lab.svg in --out, each row's run in --out/rows/, which
// a marker file names as the lab's: a later lab removes the row folders there and nothing else, and
// refuses a rows folder without it. A SIGINT, SIGTERM or SIGHUP is passed on to the row's run.
#include "mdl.h"
#include "runtime.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

enum { NTECH = 8, FP8 = 7, CKPT = 4, PACK = 5, MAX_ARGS = 96 };

typedef struct {
  const char *name;      // as the tables print it
  const char *off[3];    // the run's options with it off
  const char *on[3];     // and on (none: on is the default)
  const char *published; // the gain the usual table of speed-ups quotes
} Technique;

static const Technique tech[NTECH] = {
    {"bf16", {"--precision", "fp32"}, {"--precision", "bf16"}, "2-3x"},
    {"fusion", {"--no-fuse"}, {0}, "1.3-2x"},
    {"flash attention", {"--attention", "plain"}, {0}, "1.5-3x (long context)"},
    {"fused optimizer", {"--optimizer-per-param"}, {0}, "5-10%"},
    {"checkpointing", {"--checkpoint", "none"}, {"--checkpoint", "auto"}, "bigger batches, ~30% compute"},
    {"packing", {"--no-pack"}, {0}, "10-40% (variable lengths)"},
    {"pre-tokenised data", {"--tokenize-on-the-fly"}, {0}, "up to 2x"},
    {"fp8", {0}, {"--precision", "fp8"}, "1.3-1.8x (new GPUs)"},
};

// One run: its options and what it measured.
typedef struct {
  char label[96];
  unsigned on;        // techniques on (bit k: tech[k])
  const char *extra[4]; // options after the techniques' (the checkpoint batch, --no-doc-mask)
  bool ran, ok;
  char why[300];      // a failed run: its last error line
  char dir[PATH_MAX];
  double tok_s, tok_lo, tok_hi, mfu, ms, loss, val_loss;
  int64_t steps, kernels;
  double peak_mb;     // the process's (host) or the device's, whichever holds the step
  bool device;
  char checkpoint[200]; // the run's checkpoint line
} Row;

static double median(double *x, int n) {
  for (int i = 1; i < n; i++) // (insertion sort: tens of steps)
    for (int j = i; j > 0 && x[j] < x[j - 1]; j--) {
      double t = x[j];
      x[j] = x[j - 1];
      x[j - 1] = t;
    }
  return n == 0 ? NAN : n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
}

static bool json_num(const char *line, const char *key, double *v) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = strstr(line, pat);
  return p && sscanf(p + strlen(pat), "%lf", v) == 1;
}

static bool json_str(const char *line, const char *key, char *out, size_t n) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":\"", key);
  const char *p = strstr(line, pat);
  if (!p)
    return false;
  p += strlen(pat);
  size_t k = 0;
  for (; *p && *p != '"' && k + 1 < n; p++)
    out[k++] = *p == '\\' && p[1] ? *++p : *p;
  out[k] = 0;
  return true;
}

// The steps the timing leaves out: the first touches every page and launches every kernel once.
static int64_t warmup_steps(int64_t steps) { return steps >= 8 ? 2 : 1; }

// Reads a finished row's DIR/log.jsonl (per step) and DIR/run.json (the run's plan).
static bool read_row(Row *r, char *err, size_t n) {
  char path[PATH_MAX + 16], line[4096];
  snprintf(path, sizeof path, "%s/log.jsonl", r->dir);
  FILE *f = fopen(path, "r");
  if (!f)
    return rt_fail(err, n, "%s: %s", path, strerror(errno));
  double *tok = NULL, *mfu = NULL, *ms = NULL;
  int64_t cnt = 0, cap = 0;
  r->loss = r->val_loss = NAN;
  while (fgets(line, sizeof line, f)) {
    double s, t, u, m, l, v;
    if (!json_num(line, "step", &s) || !json_num(line, "tok_s", &t) || !json_num(line, "mfu", &u) ||
        !json_num(line, "ms", &m) || !json_num(line, "loss", &l))
      continue;
    if (json_num(line, "val_loss", &v))
      r->val_loss = v;
    r->loss = l;
    r->steps = (int64_t)s;
    if (cnt == cap) {
      cap = cap ? 2 * cap : 64;
      tok = rt_xrealloc(tok, sizeof *tok * (size_t)cap);
      mfu = rt_xrealloc(mfu, sizeof *mfu * (size_t)cap);
      ms = rt_xrealloc(ms, sizeof *ms * (size_t)cap);
    }
    tok[cnt] = t, mfu[cnt] = u, ms[cnt] = m;
    cnt++;
  }
  fclose(f);
  int64_t w = warmup_steps(cnt), k = cnt - w;
  bool ok = k > 0;
  if (ok) {
    r->tok_lo = INFINITY, r->tok_hi = -INFINITY;
    for (int64_t i = w; i < cnt; i++)
      r->tok_lo = fmin(r->tok_lo, tok[i]), r->tok_hi = fmax(r->tok_hi, tok[i]);
    r->tok_s = median(tok + w, (int)k);
    r->mfu = median(mfu + w, (int)k);
    r->ms = median(ms + w, (int)k);
  } else {
    rt_fail(err, n, "%s: %lld steps logged, none after the warm-up", path, (long long)cnt);
  }
  free(tok);
  free(mfu);
  free(ms);
  snprintf(path, sizeof path, "%s/run.json", r->dir);
  f = fopen(path, "r");
  if (ok && !f)
    return rt_fail(err, n, "%s: %s", path, strerror(errno));
  if (f) {
    double kern = 0, dev = 0;
    ok = fgets(line, sizeof line, f) && json_num(line, "kernels", &kern);
    if (ok && json_num(line, "device_bytes", &dev) && dev > 0) {
      r->peak_mb = dev / 1e6;
      r->device = true;
    }
    r->kernels = (int64_t)kern;
    json_str(line, "checkpoint", r->checkpoint, sizeof r->checkpoint);
    fclose(f);
    if (!ok)
      rt_fail(err, n, "%s: no kernel count", path);
  }
  return ok;
}

// Formats a row's reason into why (n bytes); one too long for it ends in "..." to show the cut.
__attribute__((format(printf, 3, 4))) static void set_why(char *why, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int len = vsnprintf(why, n, fmt, ap);
  va_end(ap);
  if (len >= 0 && (size_t)len >= n && n > 3)
    memcpy(why + n - 4, "...", 4);
}

// The last line of the run's output that says what went wrong, else its last line.
static void last_error(const char *path, char *why, size_t n) {
  FILE *f = fopen(path, "r");
  char line[1024], last[1024] = "", error[1024] = "";
  while (f && fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = 0;
    if (*line)
      snprintf(last, sizeof last, "%s", line);
    if (strstr(line, "error") || strstr(line, "mdlc:"))
      snprintf(error, sizeof error, "%s", line);
  }
  if (f)
    fclose(f);
  set_why(why, n, "%s", *error ? error : *last ? last : "no output");
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

// OUT/rows/lab-rows.txt, written before the first row: what says a rows folder is a lab's.
static const char rows_marker[] = "lab-rows.txt";
static const char rows_marker_text[] = "mdlc lab: each numbered folder here is the run of one row of a lab; the next "
                                       "`mdlc lab` into this --out removes them\n";

static bool has_marker(const char *rows) {
  char path[PATH_MAX + 32], line[sizeof rows_marker_text + 1] = "";
  snprintf(path, sizeof path, "%s/%s", rows, rows_marker);
  FILE *f = fopen(path, "r");
  bool ok = f && fgets(line, sizeof line, f) && !strcmp(line, rows_marker_text);
  if (f)
    fclose(f);
  return ok;
}

// A name the lab gives a row's folder: digits only (01, 02, ...).
static bool row_name(const char *name) { return *name && strspn(name, "0123456789") == strlen(name); }

// The lab's rows folder, rows, emptied of an earlier lab's row folders (what the marker says a lab
// wrote; anything else there stays) or made, and marked. A rows folder without the marker is not the
// lab's: refused, so that nothing in it is lost. False after saying why.
static bool claim_rows(const char *rows) {
  struct stat st;
  if (lstat(rows, &st) == 0) {
    if (!S_ISDIR(st.st_mode) || (!has_marker(rows) && rmdir(rows) != 0)) {
      fprintf(stderr, "%s: error: not made by `mdlc lab` (it has no %s), and the lab removes only what a lab "
              "wrote: move it away, or choose another --out\n", rows, rows_marker);
      return false;
    }
  } else if (errno != ENOENT) {
    fprintf(stderr, "%s: error: %s\n", rows, strerror(errno));
    return false;
  }
  if (mkdir(rows, 0777) && errno != EEXIST) {
    fprintf(stderr, "%s: error: cannot create the folder: %s\n", rows, strerror(errno));
    return false;
  }
  DIR *d = opendir(rows);
  if (!d) {
    fprintf(stderr, "%s: error: cannot read the folder: %s\n", rows, strerror(errno));
    return false;
  }
  bool ok = true;
  for (struct dirent *e; ok && (e = readdir(d));) {
    char path[PATH_MAX + 300];
    snprintf(path, sizeof path, "%s/%s", rows, e->d_name);
    if (row_name(e->d_name) && lstat(path, &st) == 0 && S_ISDIR(st.st_mode) &&
        nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0) {
      fprintf(stderr, "%s: error: cannot remove an earlier lab's row: %s\n", path, strerror(errno));
      ok = false;
    }
  }
  closedir(d);
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/%s", rows, rows_marker);
  FILE *f = ok ? fopen(path, "w") : NULL;
  if (ok && (!f || fputs(rows_marker_text, f) < 0 || fclose(f) != 0)) {
    fprintf(stderr, "%s: error: cannot write: %s\n", path, strerror(errno));
    ok = false;
  }
  return ok;
}

bool lab_claim_out(const char *out) {
  if (mkdir(out, 0777) && errno != EEXIST) {
    fprintf(stderr, "%s: error: cannot create the folder: %s\n", out, strerror(errno));
    return false;
  }
  char rows[PATH_MAX + 8];
  snprintf(rows, sizeof rows, "%s/rows", out);
  return claim_rows(rows);
}

// SIGINT, SIGTERM or SIGHUP while the rows run: passed on to the row's run (in a process group of its
// own, so that a terminal's Ctrl-C reaches it once, through here), which stops as a run does; no later
// row starts, and the lab then ends by the signal.
static volatile sig_atomic_t lab_stop, lab_child, lab_passed;
static void on_lab_stop(int sig) {
  lab_stop = sig;
  if (lab_child > 0)
    lab_passed = kill((pid_t)lab_child, sig) == 0;
}

static const int lab_signals[3] = {SIGINT, SIGTERM, SIGHUP};

// Catches lab_signals, but those ignored when the lab began (nohup), which stay ignored.
static void catch_lab_stop(void) {
  struct sigaction sa = {.sa_handler = on_lab_stop, .sa_flags = SA_RESTART}, old;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < 3; i++)
    if (sigaction(lab_signals[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN)
      sigaction(lab_signals[i], &sa, NULL);
}

// Runs row r as `mdlc run` in a process of its own, its output into r->dir/run.txt.
static void run_row(const LabOptions *o, const char *self, Row *r) {
  const char *argv[MAX_ARGS];
  int n = 0;
  char steps[32];
  snprintf(steps, sizeof steps, "%lld", (long long)o->steps);
  const char *base[] = {self, "run", o->model, "--data", o->data, "--out", r->dir, "--steps", steps,
                        "--val-every", "0", "--val-batches", "2", "--ckpt-every", "0",
                        "--no-shuffle"}; // (every row the same batches: packed rows from the text come in order)
  for (size_t i = 0; i < sizeof base / sizeof *base; i++)
    argv[n++] = base[i];
  for (int i = 0; i < o->npass && n < MAX_ARGS - 16; i++)
    argv[n++] = o->pass[i];
  for (int k = 0; k < NTECH; k++) {
    if (o->skip[k]) // (what cannot run here runs as the run's defaults have it)
      continue;
    const char *const *opt = r->on >> k & 1 ? tech[k].on : tech[k].off;
    for (int j = 0; j < 3 && opt[j]; j++)
      argv[n++] = opt[j];
  }
  for (int j = 0; j < 4 && r->extra[j]; j++)
    argv[n++] = r->extra[j];
  argv[n] = NULL;
  r->ran = true;
  char out[PATH_MAX + 16];
  snprintf(out, sizeof out, "%s/run.txt", r->dir);
  if (mkdir(r->dir, 0777) && errno != EEXIST) {
    set_why(r->why, sizeof r->why, "%s: cannot create: %s", r->dir, strerror(errno));
    return;
  }
  FILE *cmd = fopen(out, "w"); // the command first, so the row can be rerun by hand
  if (cmd) {
    fprintf(cmd, "$ mdlc");
    for (int i = 1; i < n; i++)
      fprintf(cmd, " %s", argv[i]);
    fprintf(cmd, "\n");
    fclose(cmd);
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out, O_WRONLY | O_APPEND, 0666);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawnattr_t at;
  posix_spawnattr_init(&at);
  posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&at, 0);
  pid_t pid;
  int rc = posix_spawn(&pid, self, &fa, &at, (char *const *)argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&at);
  if (rc) {
    set_why(r->why, sizeof r->why, "cannot start %s: %s", self, strerror(rc));
    return;
  }
  lab_child = pid;
  if (lab_stop) // (a signal between the lab's check and the spawn)
    lab_passed = kill(pid, lab_stop) == 0;
  int status;
  struct rusage ru;
  while (wait4(pid, &status, 0, &ru) < 0 && errno == EINTR)
    ;
  lab_child = 0;
  if (WIFSIGNALED(status)) {
    set_why(r->why, sizeof r->why, "killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    return;
  }
  if (WEXITSTATUS(status) && lab_passed) {
    set_why(r->why, sizeof r->why, "stopped by signal %d (%s), passed on by the lab", (int)lab_stop,
            strsignal(lab_stop));
    return;
  }
  if (WEXITSTATUS(status)) {
    last_error(out, r->why, sizeof r->why);
    return;
  }
  r->peak_mb = (double)ru.ru_maxrss * 1024.0 / 1e6; // (KiB; MB of 10^6 bytes, as the runs print)
  char err[400];
  r->ok = read_row(r, err, sizeof err);
  if (!r->ok)
    set_why(r->why, sizeof r->why, "%s", err);
}

static const char *label_of(unsigned on, int added, char *buf, size_t n) {
  if (added < 0)
    snprintf(buf, n, on ? "everything on" : "baseline (everything off)");
  else
    snprintf(buf, n, "+ %s", tech[added].name);
  return buf;
}

static void eta(double s, char *buf, size_t n) {
  if (s < 90)
    snprintf(buf, n, "%.0fs", s);
  else
    snprintf(buf, n, "%.0fm%02.0fs", floor(s / 60), fmod(s, 60));
}

typedef struct {
  const LabOptions *o;
  const char *self;
  Row *rows;
  int nrows, done;
  double t0;
} Lab;

static Row *add_row(Lab *L, unsigned on, const char *label) {
  Row *r = &L->rows[L->nrows++];
  *r = (Row){.on = on};
  snprintf(r->label, sizeof r->label, "%s", label);
  return r;
}

// Runs the rows not yet run, with a progress line each.
static void run_rows(Lab *L) {
  for (int i = 0; i < L->nrows && !lab_stop; i++) {
    Row *r = &L->rows[i];
    if (r->ran)
      continue;
    char left[32] = "?";
    if (L->done > 0)
      eta((rt_now() - L->t0) / L->done * (L->nrows - i), left, sizeof left);
    snprintf(r->dir, sizeof r->dir, "%s/rows/%02d", L->o->out, i + 1);
    printf("lab: row %d of %d: %s (ETA %s)\n", i + 1, L->nrows, r->label, L->done ? left : "?");
    fflush(stdout);
    run_row(L->o, L->self, r);
    L->done++;
    if (!r->ok)
      printf("lab: row %d failed: %s (see %s/run.txt)\n", i + 1, r->why, r->dir);
  }
}

// A ratio as the tables print it: 1.23x, or - where a run it compares failed.
static const char *times(Arena *a, double x) { return isfinite(x) ? arena_printf(a, "%.2fx", x) : "-"; }

static void fmt_tok(const Row *r, char *buf, size_t n) {
  if (!r->ok)
    snprintf(buf, n, "failed");
  else
    snprintf(buf, n, "%.0f (%.0f-%.0f)", r->tok_s, r->tok_lo, r->tok_hi);
}

// Why a technique is worth what it is here, in one line, from what the rows measured.
static void why_line(const LabOptions *o, int k, const Row *with, const Row *without, char *buf, size_t n) {
  double x = with->ok && without->ok ? with->tok_s / without->tok_s : NAN;
  const char *sign = x >= 1.05 ? "pays" : x > 0.95 ? "changes little" : "costs";
  switch (k) {
  case 0:
    snprintf(buf, n, "%s here: %s", sign, o->bf16_why);
    break;
  case 1:
    snprintf(buf, n, "%s: %lld kernels a step instead of %lld; fusion removes memory passes between kernels, not GEMM "
             "work", sign, (long long)with->kernels, (long long)without->kernels);
    break;
  case 2:
    snprintf(buf, n, "%s: the plain path materialises scores [B, H, T, T] at T = %lld (%.1f MB each, fp32) and runs "
             "softmax over them in memory", sign, (long long)o->T, o->scores_mb);
    break;
  case 3:
    snprintf(buf, n, "%s: %d optimizer kernels a step instead of 1%s", sign, o->nparams + 1,
             x >= 1.05 ? "" : with->device ? " (their launches are a small part of this step)"
                                           : " (a CPU kernel costs no launch, and both stream the same bytes)");
    break;
  case CKPT:
    snprintf(buf, n, "%s at this batch (%s): its worth is the batch it allows, below", sign,
             with->checkpoint[0] ? with->checkpoint : "the plan");
    break;
  case PACK:
    snprintf(buf, n, "%s: padded rows hold one document each, so fewer real tokens a step (tokens/s counts real "
             "tokens)", sign);
    break;
  case 6:
    if (without->ms > with->ms)
      snprintf(buf, n, "%s: tokenising each batch as it is drawn adds %.1f ms to a %.1f ms step", sign,
               without->ms - with->ms, with->ms);
    else
      snprintf(buf, n, "%s: tokenising each batch as it is drawn costs less than the steps' spread", sign);
    break;
  case FP8:
    snprintf(buf, n, "%s%s%s", sign, o->apart[k] ? ": " : "", o->apart[k] ? o->apart[k] : "");
    break;
  default:
    snprintf(buf, n, "%s", sign);
  }
}

typedef struct {
  FILE *md, *csv;
} Out;

static void both(Out *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void both(Out *out, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  if (out->md) {
    va_start(ap, fmt);
    vfprintf(out->md, fmt, ap);
    va_end(ap);
  }
}

static void csv_row(Out *out, const char *table, const char *label, const Row *r, double vs_prev, double vs_base) {
  if (!out->csv)
    return;
  fprintf(out->csv, "%s,\"%s\",%s,", table, label, r->ok ? "ok" : "failed");
  if (r->ok)
    fprintf(out->csv, "%.1f,%.1f,%.1f,%.4f,%.0f,%lld,%.4f,%.4f,%.6f,%.6f\n", r->tok_s, r->tok_lo, r->tok_hi, r->mfu,
            r->peak_mb, (long long)r->kernels, vs_prev, vs_base, r->loss, r->val_loss);
  else
    fprintf(out->csv, ",,,,,,,,,\n");
}

// lab.svg: speed-up per technique, added to the ladder (blue) and alone in the full system (orange).
static bool write_svg(const char *path, const double *cum, const double *alone) {
  char tmp[PATH_MAX + 32];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f)
    return false;
  double hi = 1.5;
  for (int k = 0; k < NTECH; k++)
    hi = fmax(hi, fmax(isfinite(cum[k]) ? cum[k] : 0, isfinite(alone[k]) ? alone[k] : 0));
  hi = ceil(hi * 2) / 2;
  const double W = 720, L = 150, R = 60, T = 40, bar = 12, gap = 10, H = T + NTECH * (2 * bar + gap) + 40;
  double xs = (W - L - R) / hi;
  fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
             "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H);
  fprintf(f, "<text x=\"%g\" y=\"18\">speed-up (tokens/s ratio): added to the ladder (blue), alone in the full "
             "system (orange)</text>\n", L);
  for (double v = 0; v <= hi + 1e-9; v += hi > 4 ? 1 : 0.5) {
    fprintf(f, "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"%s\"/>\n", L + v * xs, T - 6, L + v * xs,
            H - 34, v == 1 ? "black" : "#ddd");
    fprintf(f, "<text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%.1fx</text>\n", L + v * xs, H - 20, v);
  }
  for (int k = 0; k < NTECH; k++) {
    double y = T + k * (2 * bar + gap);
    fprintf(f, "<text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", L - 6, y + bar + 4, tech[k].name);
    const double *v[2] = {cum, alone};
    const char *color[2] = {"steelblue", "darkorange"};
    for (int s = 0; s < 2; s++) {
      double x = v[s][k], yy = y + s * bar;
      if (!isfinite(x)) {
        fprintf(f, "<text x=\"%g\" y=\"%.1f\" fill=\"grey\">not measured</text>\n", L + 4, yy + bar - 2);
        continue;
      }
      fprintf(f, "<rect x=\"%g\" y=\"%.1f\" width=\"%.1f\" height=\"%g\" fill=\"%s\"/>\n", L, yy, x * xs, bar - 1,
              color[s]);
      fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">%.2fx</text>\n", L + x * xs + 4, yy + bar - 2, x);
    }
  }
  fprintf(f, "</svg>\n");
  return fclose(f) == 0 && rename(tmp, path) == 0;
}

static FILE *open_out(const LabOptions *o, const char *name) {
  char path[PATH_MAX + 16];
  snprintf(path, sizeof path, "%s/%s", o->out, name);
  FILE *f = fopen(path, "w");
  if (!f)
    fprintf(stderr, "%s: error: cannot write: %s\n", path, strerror(errno));
  return f;
}

int lab_run(const LabOptions *o) {
  char self[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) {
    fprintf(stderr, "mdlc: lab: cannot find its own executable: %s\n", strerror(errno));
    return 1;
  }
  self[len] = 0;
  Row rows[2 * NTECH + 8];
  Lab L = {.o = o, .self = self, .rows = rows, .t0 = rt_now()};
  unsigned all = 0;
  char label[96];
  // The ladder: row 0 the baseline, row k + 1 adds technique k (FP8 only where it can run).
  int ladder[NTECH + 1], nladder = 0;
  for (int k = -1; k < NTECH; k++) {
    if (k >= 0 && (o->skip[k] || o->apart[k]))
      continue;
    if (k >= 0)
      all |= 1u << k;
    ladder[nladder++] = L.nrows;
    add_row(&L, all, label_of(all, k, label, sizeof label));
  }
  // Alone: everything on but technique k.
  int alone[NTECH];
  for (int k = 0; k < NTECH; k++) {
    alone[k] = -1;
    if (o->skip[k])
      continue;
    alone[k] = L.nrows;
    if (o->apart[k]) { // (measured the other way round: the full system with it added)
      snprintf(label, sizeof label, "everything on and %s", tech[k].name);
      add_row(&L, all | 1u << k, label);
      continue;
    }
    snprintf(label, sizeof label, "everything on but %s", tech[k].name);
    add_row(&L, all & ~(1u << k), label);
  }
  // Checkpointing's batches (everything else on), and packing without the document mask.
  char bnone[32], bauto[32];
  int ck_none = -1, ck_auto = -1;
  if (o->batch_none > 0 && o->batch_auto > 0) {
    snprintf(bnone, sizeof bnone, "B=%lld", (long long)o->batch_none);
    snprintf(bauto, sizeof bauto, "B=%lld", (long long)o->batch_auto);
    ck_none = L.nrows;
    snprintf(label, sizeof label, "largest batch without checkpointing (B=%lld)", (long long)o->batch_none);
    Row *r = add_row(&L, all & ~(1u << CKPT), label);
    r->extra[0] = "-D", r->extra[1] = bnone;
    ck_auto = L.nrows;
    snprintf(label, sizeof label, "largest batch with checkpointing (B=%lld)", (long long)o->batch_auto);
    r = add_row(&L, all, label);
    r->extra[0] = "-D", r->extra[1] = bauto;
  }
  int nomask = -1;
  if (o->has_doc) {
    nomask = L.nrows;
    Row *r = add_row(&L, all, "everything on, no document mask");
    r->extra[0] = "--no-doc-mask";
  }
  catch_lab_stop();
  run_rows(&L);
  if (lab_stop) {
    int sig = lab_stop, done = 0;
    while (done < L.nrows && L.rows[done].ran)
      done++;
    fflush(stdout);
    if (lab_passed)
      fprintf(stderr, "mdlc: lab: stopped by signal %d (%s) during row %d of %d, whose run it stopped too (see "
              "%s/run.txt); no tables written\n", sig, strsignal(sig), done, L.nrows, L.rows[done - 1].dir);
    else
      fprintf(stderr, "mdlc: lab: stopped by signal %d (%s) before row %d of %d; no tables written\n", sig,
              strsignal(sig), done + 1, L.nrows);
    signal(sig, SIG_DFL);
    raise(sig);
    return 128 + sig;
  }

  Out out = {open_out(o, "lab.md"), open_out(o, "lab.csv")};
  if (!out.md || !out.csv)
    return 1;
  fprintf(out.csv, "table,row,status,tok_s,tok_s_min,tok_s_max,mfu_percent,peak_mb,kernels,vs_previous,vs_baseline,"
                   "loss,val_loss\n");
  both(&out, "\n## %s on %s\n\n%s\n\n", o->model_name, o->machine, o->setup);
  int64_t w = warmup_steps(o->steps);
  both(&out, "Each row adds one technique to the row before (%lld steps a row; tokens/s: median after %lld warm-up "
       "step%s, slowest-fastest in brackets; loss: the last step's training loss and the validation loss).\n\n",
       (long long)o->steps, (long long)w, w > 1 ? "s" : "");
  both(&out, "| row | tokens/s | MFU | peak MB | kernels | vs previous | vs baseline | loss | val loss |\n");
  both(&out, "|---|---|---|---|---|---|---|---|---|\n");
  double cum[NTECH], alone_x[NTECH];
  for (int k = 0; k < NTECH; k++)
    cum[k] = alone_x[k] = NAN;
  const Row *base = &rows[ladder[0]];
  for (int i = 0; i < nladder; i++) {
    const Row *r = &rows[ladder[i]], *prev = i ? &rows[ladder[i - 1]] : r;
    double vp = r->ok && prev->ok ? r->tok_s / prev->tok_s : NAN, vb = r->ok && base->ok ? r->tok_s / base->tok_s : NAN;
    char tok[64];
    fmt_tok(r, tok, sizeof tok);
    if (r->ok)
      both(&out, "| %s | %s | %.2f%% | %.0f%s | %lld | %s | %s | %.4f | %.4f |\n", r->label, tok, r->mfu,
           r->peak_mb, r->device ? " (GPU)" : "", (long long)r->kernels, times(o->arena, vp), times(o->arena, vb),
           r->loss, r->val_loss);
    else
      both(&out, "| %s | %s: %s | | | | | | | |\n", r->label, tok, r->why);
    csv_row(&out, "ladder", r->label, r, vp, vb);
    if (i > 0) {
      int k = 0;
      while (!(r->on >> k & 1) || (prev->on >> k & 1))
        k++;
      cum[k] = vp;
    }
  }
  const Row *full = &rows[ladder[nladder - 1]];
  both(&out, "\nEach technique alone: the full system (%s tokens/s) with that one off.\n\n",
       full->ok ? arena_printf(o->arena, "%.0f", full->tok_s) : "failed");
  both(&out, "| technique | published | tokens/s without it | worth alone | loss without it | why |\n");
  both(&out, "|---|---|---|---|---|---|\n");
  for (int k = 0; k < NTECH; k++) {
    char why[400];
    if (alone[k] < 0) {
      both(&out, "| %s | %s | skipped | | | %s |\n", tech[k].name, tech[k].published, o->skip[k]);
      continue;
    }
    const Row *r = &rows[alone[k]];
    char tok[64];
    fmt_tok(r, tok, sizeof tok);
    // (a row apart runs the full system with it, against the full system without it; the others the
    // full system without it, against the full system)
    bool apart = o->apart[k];
    const Row *with = apart ? r : full, *without = apart ? full : r;
    alone_x[k] = r->ok && full->ok ? with->tok_s / without->tok_s : NAN;
    why_line(o, k, with, without, why, sizeof why);
    if (r->ok)
      both(&out, "| %s | %s | %s%s | %s | %.4f | %s |\n", tech[k].name, tech[k].published, tok,
           apart ? " (with it)" : "", times(o->arena, alone_x[k]), r->loss, why);
    else
      both(&out, "| %s | %s | %s | | | %s |\n", tech[k].name, tech[k].published, tok, r->why);
    csv_row(&out, apart ? "apart" : "alone", tech[k].name, r, NAN, alone_x[k]);
  }
  both(&out, "\n");
  if (ck_none >= 0) {
    const Row *a = &rows[ck_none], *b = &rows[ck_auto];
    both(&out, "Checkpointing: within %.0f MB (%s), the largest batch is B=%lld without it (%s tokens/s) and B=%lld "
         "with it (%s tokens/s, %s).\n", (double)o->budget / 1e6, o->budget_how, (long long)o->batch_none,
         a->ok ? arena_printf(o->arena, "%.0f", a->tok_s) : "failed", (long long)o->batch_auto,
         b->ok ? arena_printf(o->arena, "%.0f", b->tok_s) : "failed",
         a->ok && b->ok ? arena_printf(o->arena, "%.2fx", b->tok_s / a->tok_s) : "not compared");
    csv_row(&out, "checkpoint", a->label, a, NAN, NAN);
    csv_row(&out, "checkpoint", b->label, b, NAN, NAN);
  } else {
    both(&out, "Checkpointing: %s.\n", o->batch_how);
  }
  if (nomask >= 0) {
    const Row *r = &rows[nomask];
    both(&out, "Document mask: %s; without it %s (training loss %s against %s with it).\n", o->leak_on, o->leak_off,
         r->ok ? arena_printf(o->arena, "%.4f", r->loss) : "failed",
         full->ok ? arena_printf(o->arena, "%.4f", full->loss) : "failed");
    csv_row(&out, "no-doc-mask", r->label, r, NAN, NAN);
  } else {
    both(&out, "Document mask: %s.\n", o->leak_on);
  }
  // Steps of one run that vary by more than 3x: something else ran on the machine.
  const Row *noisy = NULL;
  for (int i = 0; i < L.nrows; i++)
    if (rows[i].ok && rows[i].tok_hi > 3 * rows[i].tok_lo && (!noisy || rows[i].tok_hi / rows[i].tok_lo >
                                                                           noisy->tok_hi / noisy->tok_lo))
      noisy = &rows[i];
  if (noisy)
    both(&out, "\nWarning: the steps of a run varied by up to %.0fx (%s: %.0f to %.0f tokens/s): the machine was "
         "busy with something else, so these ratios are not to be trusted; run the lab on a quiet machine.\n",
         noisy->tok_hi / noisy->tok_lo, noisy->label, noisy->tok_lo, noisy->tok_hi);
  char svg[PATH_MAX + 16];
  snprintf(svg, sizeof svg, "%s/lab.svg", o->out);
  bool ok = write_svg(svg, cum, alone_x);
  if (!ok)
    fprintf(stderr, "%s: error: cannot write: %s\n", svg, strerror(errno));
  ok &= fclose(out.md) == 0;
  ok &= fclose(out.csv) == 0;
  printf("\nlab: %s/lab.md, lab.csv, lab.svg; each row's run in %s/rows/ (%.0f s)\n", o->out, o->out,
         rt_now() - L.t0);
  int failed = 0;
  for (int i = 0; i < L.nrows; i++)
    failed += rows[i].ran && !rows[i].ok;
  if (failed)
    fprintf(stderr, "mdlc: lab: %d of %d runs failed (their reasons are in the tables)\n", failed, L.nrows);
  return ok && !failed ? 0 : 1;
}
