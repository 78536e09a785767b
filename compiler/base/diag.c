// diag.c: diagnostics. "file:line:col: error: message", then the source line and a caret.
//
// Output stays proportional to the mistakes, not to the file: a compilation prints at most
// DIAG_MAX_ERRORS errors (then one "too many errors" at the next one's place), and a long source
// line is shown as a window around the caret.
#include "mdl.h"

#include <stdarg.h>
#include <string.h>

int diag_errors;
static int first_error;   // diag_errors when the current compilation began
static bool shown = true; // the last error was printed, so its notes are printed too

enum { SHOW_WIDTH = 120 }; // bytes of a source line shown at most

static bool continuation(char c) { return ((unsigned char)c & 0xc0) == 0x80; }

static void show_line(SrcLoc loc) {
  if (!loc.text || loc.line <= 0)
    return;
  const char *p = loc.text;
  for (int l = 1; l < loc.line && *p; p++)
    if (*p == '\n')
      l++;
  const char *end = strchr(p, '\n');
  int len = end ? (int)(end - p) : (int)strlen(p);
  int from = 0, to = len;
  if (len > SHOW_WIDTH) {
    from = loc.col - 1 - SHOW_WIDTH / 2;
    if (from > len - SHOW_WIDTH)
      from = len - SHOW_WIDTH;
    if (from < 0)
      from = 0;
    to = from + SHOW_WIDTH;
    while (from > 0 && continuation(p[from])) // cut between characters, not inside one
      from--;
    while (to < len && continuation(p[to]))
      to++;
  }
  const char *more = "...";
  fprintf(stderr, "%5d | %s%.*s%s\n      | %s", loc.line, from ? more : "", to - from, p + from, to < len ? more : "",
          from ? "   " : "");
  for (int i = from + 1; i < loc.col && i <= to; i++) // one blank per character before the caret
    if (!continuation(p[i - 1]))
      fputc(p[i - 1] == '\t' ? '\t' : ' ', stderr);
  fprintf(stderr, "^\n");
}

static void report(SrcLoc loc, const char *kind, const char *fmt, va_list ap) {
  if (loc.line > 0)
    fprintf(stderr, "%s:%d:%d: %s: ", loc.file, loc.line, loc.col, kind);
  else
    fprintf(stderr, "%s: %s: ", loc.file ? loc.file : "mdlc", kind);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  show_line(loc);
}

static void too_many(SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void too_many(SrcLoc loc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report(loc, "error", fmt, ap);
  va_end(ap);
}

void diag_begin(void) {
  first_error = diag_errors;
  shown = true;
}

bool diag_stopped(void) { return diag_errors - first_error > DIAG_MAX_ERRORS; }

void diag_error(SrcLoc loc, const char *fmt, ...) {
  int before = diag_errors++ - first_error;
  shown = before < DIAG_MAX_ERRORS;
  if (shown) {
    va_list ap;
    va_start(ap, fmt);
    report(loc, "error", fmt, ap);
    va_end(ap);
  } else if (before == DIAG_MAX_ERRORS) {
    too_many(loc, "too many errors (more than %d); stopping here", DIAG_MAX_ERRORS);
  }
}

void diag_note(SrcLoc loc, const char *fmt, ...) {
  if (!shown)
    return;
  va_list ap;
  va_start(ap, fmt);
  report(loc, "note", fmt, ap);
  va_end(ap);
}

void diag_warning(SrcLoc loc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report(loc, "warning", fmt, ap);
  va_end(ap);
}

void diag_file_error(const char *path, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: error: ", path);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  __atomic_add_fetch(&diag_errors, 1, __ATOMIC_RELAXED); // (the checkpoint writer's thread reports too)
}
