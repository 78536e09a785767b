// diag.c: diagnostics. "file:line:col: error: message", then the source line and a caret.
#include "mdl.h"

#include <stdarg.h>
#include <string.h>

int diag_errors;

static void show_line(SrcLoc loc) {
  if (!loc.text || loc.line <= 0)
    return;
  const char *p = loc.text;
  for (int l = 1; l < loc.line && *p; p++)
    if (*p == '\n')
      l++;
  const char *end = strchr(p, '\n');
  int len = end ? (int)(end - p) : (int)strlen(p);
  fprintf(stderr, "%5d | %.*s\n      | ", loc.line, len, p);
  for (int i = 1; i < loc.col && i <= len; i++)
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

void diag_error(SrcLoc loc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report(loc, "error", fmt, ap);
  va_end(ap);
  diag_errors++;
}

void diag_note(SrcLoc loc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report(loc, "note", fmt, ap);
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
