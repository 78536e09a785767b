// textdata.c: a plain text file read whole, cut into B x T windows of byte tokens in order.
#include "runtime.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

bool rt_text_open(TextData *d, const char *path) {
  memset(d, 0, sizeof *d);
  d->path = path;
  FILE *f = fopen(path, "rb");
  if (!f) {
    diag_file_error(path, "cannot open: %s", strerror(errno));
    return false;
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  if (n < 2) {
    fclose(f);
    diag_file_error(path, "empty corpus: %ld bytes", n < 0 ? 0 : n);
    return false;
  }
  d->bytes = malloc((size_t)n);
  if (!d->bytes || fread(d->bytes, 1, (size_t)n, f) != (size_t)n) {
    fclose(f);
    free(d->bytes);
    diag_file_error(path, "cannot read %ld bytes", n);
    return false;
  }
  fclose(f);
  d->n = n;
  return true;
}

void rt_text_close(TextData *d) { free(d->bytes); }

void rt_text_batch(TextData *d, int64_t B, int64_t T, int32_t *tokens, int32_t *targets, int32_t *pos,
                   int32_t *doc) {
  for (int64_t b = 0; b < B; b++) {
    if (d->cursor + T + 1 > d->n)
      d->cursor = 0;
    for (int64_t t = 0; t < T; t++) {
      int64_t i = (d->cursor + t) % d->n;
      tokens[b * T + t] = d->bytes[i];
      targets[b * T + t] = d->bytes[(i + 1) % d->n];
      pos[b * T + t] = (int32_t)t;
      doc[b * T + t] = 0;
    }
    d->cursor += T;
  }
}
