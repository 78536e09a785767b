// ckptmeta.c: a training checkpoint's metadata (the mdl.* strings), parsed strictly and range-checked
// once for --resume, eval and sample: a number with anything around it, out of its range or of
// another form is refused with the checkpoint's path, the field and the range, never read as
// whatever prefix strtoll takes.
#include "runtime.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

// A whole decimal number lo..hi (digits alone, no sign unless lo < 0), into *v.
static bool whole(const char *text, int64_t lo, int64_t hi, int64_t *v) {
  size_t sign = text[0] == '-' && lo < 0;
  if (!text[sign] || strspn(text + sign, "0123456789") != strlen(text + sign))
    return false;
  char *end;
  errno = 0;
  long long x = strtoll(text, &end, 10);
  if (errno || *end || x < lo || x > hi)
    return false;
  *v = x;
  return true;
}

static bool refuse(const char *path, const char *key, const char *value, const char *want) {
  diag_file_error(path, "bad checkpoint metadata: %s = '%.80s%s' is not %s", key, value, strlen(value) > 80 ? "..." : "",
                  want);
  return false;
}

// "NAME=VALUE,NAME=VALUE,...": each name a dim's (a letter or '_', then letters, digits, '_'), once,
// each value a whole number 1..CKPT_MAX_DIM.
static bool parse_dims(Arena *a, const char *path, const char *text, CkptMeta *m) {
  const char *want = "NAME=VALUE,... with each dim once and each value a whole number from 1 to 2147483647";
  int cap = 1;
  for (const char *p = text; *p; p++)
    cap += *p == ',';
  m->dims = arena_alloc(a, sizeof *m->dims * (size_t)cap);
  m->ndims = 0;
  for (const char *p = text; ; p++) {
    const char *eq = p, *comma;
    while (*eq == '_' || (*eq >= 'a' && *eq <= 'z') || (*eq >= 'A' && *eq <= 'Z') ||
           (eq > p && *eq >= '0' && *eq <= '9'))
      eq++;
    if (eq == p || *eq != '=')
      return refuse(path, "mdl.dims", text, want);
    for (comma = eq + 1; *comma && *comma != ','; comma++) {
    }
    char *name = arena_alloc(a, (size_t)(eq - p) + 1), *value = arena_alloc(a, (size_t)(comma - eq));
    memcpy(name, p, (size_t)(eq - p));
    memcpy(value, eq + 1, (size_t)(comma - eq - 1));
    int64_t v;
    if (!whole(value, 1, CKPT_MAX_DIM, &v))
      return refuse(path, "mdl.dims", text, want);
    for (int i = 0; i < m->ndims; i++)
      if (!strcmp(m->dims[i].name, name))
        return refuse(path, "mdl.dims", text, want);
    m->dims[m->ndims++] = (DimOverride){name, v};
    if (!*comma)
      return true;
    p = comma;
  }
}

// One of the words of list (NULL-ended), or NULL.
static bool one_of(const char *text, const char *const *list) {
  for (; *list; list++)
    if (!strcmp(text, *list))
      return true;
  return false;
}

bool ckpt_meta_read(Arena *a, const char *path, const StFile *f, CkptMeta *m) {
  *m = (CkptMeta){.step = -1, .accumulate = -1, .fp8_recorded = -1, .shuffle = -1, .pack = -1};
  const char *format = st_meta(f, "mdl.format");
  if (!format) {
    diag_file_error(path, "not an mdl checkpoint (no mdl.format in its metadata)");
    return false;
  }
  if (strcmp(format, CKPT_FORMAT)) {
    diag_file_error(path, "checkpoint format '%s' is not one this mdlc reads (%s)", format, CKPT_FORMAT);
    return false;
  }
  m->source = st_meta(f, "mdl.source");
  m->model = st_meta(f, "mdl.model");
  m->dims_text = st_meta(f, "mdl.dims");
  m->tokenizer = st_meta(f, "mdl.tokenizer");
  m->optimizer = st_meta(f, "mdl.optimizer");
  m->precision = st_meta(f, "mdl.precision");
  m->text = st_meta(f, "mdl.source_text");
  m->tokenizer_base64 = st_meta(f, "mdl.tokenizer_base64");
  static const char *const optimizers[] = {"adamw", "sgd", "lion", "muon", NULL};
  static const char *const precisions[] = {"fp32", "bf16", "fp8", "auto", NULL}; // (auto: as a train section says it)
  static const char *const bools[] = {"true", "false", NULL};
  const char *step = st_meta(f, "mdl.step"), *seed = st_meta(f, "mdl.seed"), *loader = st_meta(f, "mdl.loader"),
             *acc = st_meta(f, "mdl.accumulate"), *rec = st_meta(f, "mdl.fp8_recorded"),
             *shuffle = st_meta(f, "mdl.shuffle"), *pack = st_meta(f, "mdl.pack");
  if (m->source && !*m->source)
    return refuse(path, "mdl.source", m->source, "the path of the model's .mdl file");
  if (m->model && !*m->model)
    return refuse(path, "mdl.model", m->model, "the model's name");
  if (m->dims_text && !parse_dims(a, path, m->dims_text, m))
    return false;
  if (step && !whole(step, 0, CKPT_MAX_STEP, &m->step))
    return refuse(path, "mdl.step", step, "a whole number of steps from 0 to 2^53");
  if (seed) { // (a u64: digits alone, within 2^64 - 1)
    char *end;
    errno = 0;
    m->seed = strtoull(seed, &end, 10);
    if (*seed < '0' || *seed > '9' || *end || errno)
      return refuse(path, "mdl.seed", seed, "a whole number from 0 to 2^64 - 1");
    m->has_seed = true;
  }
  if (loader) {
    const char *comma = strchr(loader, ',');
    char *epoch = arena_alloc(a, strlen(loader) + 1);
    memcpy(epoch, loader, comma ? (size_t)(comma - loader) : 0);
    if (!comma || !whole(epoch, 0, INT64_MAX, &m->epoch) || !whole(comma + 1, 0, INT64_MAX, &m->position))
      return refuse(path, "mdl.loader", loader, "EPOCH,POSITION, two whole numbers from 0");
    m->has_loader = true;
  }
  if (acc && !whole(acc, 1, CKPT_MAX_ACCUMULATE, &m->accumulate))
    return refuse(path, "mdl.accumulate", acc, "a whole number of micro-batches a step from 1 to 1048576");
  if (rec && !whole(rec, 0, INT64_MAX, &m->fp8_recorded))
    return refuse(path, "mdl.fp8_recorded", rec, "a whole number of steps from 0");
  if (shuffle && !one_of(shuffle, bools))
    return refuse(path, "mdl.shuffle", shuffle, "true or false");
  if (pack && !one_of(pack, bools))
    return refuse(path, "mdl.pack", pack, "true or false");
  m->shuffle = shuffle ? !strcmp(shuffle, "true") : -1;
  m->pack = pack ? !strcmp(pack, "true") : -1;
  if (m->optimizer && !one_of(m->optimizer, optimizers))
    return refuse(path, "mdl.optimizer", m->optimizer, "adamw, sgd, lion or muon");
  if (m->precision && !one_of(m->precision, precisions))
    return refuse(path, "mdl.precision", m->precision, "fp32, bf16, fp8 or auto");
  return true;
}
