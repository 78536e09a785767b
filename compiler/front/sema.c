// sema.c: the front end's steps and entry points: mdl_compile_file / mdl_compile_text parse the
// text, and sema_build analyses it, from the AST (front.h) to the forward graph (mdl.h).
//
// It runs in four steps over the parsed file:
//   1. declare (sema_names.c): top-level dims, consts and the train section are collected;
//      duplicate names and statements in the wrong place are reported (and skipped from then on).
//   2. dims (sema_train.c): free dims are bound (-D first, then the train section) and every dim is
//      evaluated. Dims and consts are declarative: each is evaluated on first use, in any order,
//      and a stack of the ones being evaluated turns a reference cycle into an error.
//   3. train (sema_train.c): the train section's settings fill g->train.
//   4. elaborate (sema_eval.c): statements run in order and append graph nodes. An expression
//      evaluates to a Val: a compile-time integer, float or boolean, a tensor (graph node), or the
//      tuple split() or topk() returns. Scalars meeting tensors become CONST nodes. `repeat NAME[N]
//      { }` elaborates its body N times, each time in a fresh scope whose params are named
//      NAME.i.pname. A builtin (sema_builtins.c) gets its arguments evaluated.
// Then the model is checked as a whole (check_model).
// Errors do not stop the analysis: a failed expression evaluates to V_ERR, which silently poisons
// whatever uses it, so every independent mistake is reported once. Messages are deduplicated by
// place and text, so an error inside a repeat body is not repeated for each repetition. It stops
// at the error limit (diag_stopped), at a limit on what the file builds (MDL_MAX_*: a repeat is
// measured by its first repetition and refused before the others), and at SEMA_MAX_DEPTH nested
// evaluations, where the recursion would otherwise run out of stack.
#include "sema_impl.h"

#include <stdlib.h>
#include <string.h>

// What a whole model must have: a loss when it has a train section (an error), and every param on
// the way to an output (a warning for each that is not: it would train to nothing). Once the model
// holds no other error.
static void check_model(Sema *s, const Stmt *train) {
  Graph *g = s->g;
  if (train && g->loss < 0)
    sema_error(s, train->at, "a train section, but no 'output loss = ...' (a scalar f32): there is nothing to train");
  bool *live = arena_alloc(s->a, (size_t)(g->n ? g->n : 1));
  for (int i = 0; i < s->nout; i++)
    live[s->out_nodes[i]] = true;
  for (int id = g->n - 1; id >= 0; id--)
    for (int k = 0; live[id] && k < node(s, id)->nin; k++)
      live[node(s, id)->in[k]] = true;
  SrcLoc last = {0};
  for (int i = 0; i < g->nparams; i++) {
    const IrNode *n = node(s, g->params[i]);
    if (live[n->id] || (n->loc.line == last.line && n->loc.col == last.col)) // (once for a repeat's copies)
      continue;
    last = n->loc;
    diag_warning(n->loc, "param '%s' is not used by any output: it gets no gradient and keeps its initial values",
                 n->name);
  }
}

Graph *sema_build(Parser *p, const DimOverride *ov, int nov, const LowerOptions *lo) {
  Sema sema = {.p = p, .a = p->arena, .g = ir_new(p->arena), .lower = lo ? *lo : (LowerOptions){0}};
  Sema *s = &sema;
  s->global.prefix = "";
  s->global.index = arena_alloc(s->a, sizeof(NameMap));
  s->scope = &s->global;
  int errors = diag_errors;
  if (p->stmts.n == 0) {
    diag_error((SrcLoc){.file = p->file, .text = p->text, .line = 1, .col = 1}, "empty file: no model");
    return NULL;
  }
  const Stmt *train = sema_declare(s);
  PtrVec sets = {0};
  for (int i = 0; i < s->lower.nsettings; i++) {
    Parser q = {.arena = s->a, .file = "--set", .text = s->lower.settings[i]};
    if (!parse_text(&q))
      continue;
    Stmt *st = q.stmts.n == 1 ? q.stmts.v[0] : NULL;
    if (!st || st->kind != S_ASSIGN || st->nnames != 1) {
      sema_error(s, (SrcLoc){.file = q.file, .text = q.text, .line = 1, .col = 1},
                 "--set wants KEY=VALUE (a train setting, a free dim, or an argument of the optimizer or the "
                 "schedule), got '%s'", q.text);
      continue;
    }
    vec_push(s->a, &sets, st);
  }
  sema_bind_dims(s, train, &sets, ov, nov);
  sema_train_config(s);
  s->out_nodes = arena_alloc(s->a, sizeof(int) * (size_t)(s->outputs.n ? s->outputs.n : 1));
  sema_elaborate(s, (Stmt **)p->stmts.v, p->stmts.n);
  sema_set_decay(s);
  sema_set_muon(s);
  if (diag_errors == errors)
    check_model(s, train);
  Graph *g = s->g;
  g->outputs = s->out_nodes;
  g->noutputs = s->nout;
  g->fwd_end = g->n;
  return diag_errors > errors ? NULL : g;
}

//
// Entry points
//

// The offset of the first byte that is not part of a well-formed UTF-8 sequence, or -1.
static long bad_utf8(const unsigned char *t, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned c = t[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!len || i + len > n)
      return (long)i;
    uint32_t cp = len == 1 ? c : c & (0x7f >> len);
    for (size_t k = 1; k < len; k++) {
      if ((t[i + k] & 0xc0) != 0x80)
        return (long)i;
      cp = cp << 6 | (t[i + k] & 0x3f);
    }
    static const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
      return (long)i;
    i += len;
  }
  return -1;
}

// The place of byte `offset` of a text, as the scanner counts lines and columns (in bytes).
static SrcLoc offset_loc(const char *path, const char *text, size_t offset) {
  SrcLoc at = {.file = path, .text = text, .line = 1, .col = 1};
  for (size_t i = 0; i < offset; i++) {
    at.col = text[i] == '\n' ? 1 : at.col + 1;
    at.line += text[i] == '\n';
  }
  return at;
}

// Every error in a .mdl names its line and column, even the ones that say it is no text at all.
static bool is_text(const char *path, const char *text, size_t n) {
  const char *nul = memchr(text, 0, n);
  long bad = bad_utf8((const unsigned char *)text, nul ? (size_t)(nul - text) : n);
  if (bad >= 0) {
    diag_error(offset_loc(path, text, (size_t)bad), "invalid UTF-8 (byte 0x%02x at offset %ld): .mdl files are UTF-8 text",
               (unsigned char)text[bad], bad);
    return false;
  }
  if (nul) {
    diag_error(offset_loc(path, text, (size_t)(nul - text)), "NUL byte (offset %ld): not a text file",
               (long)(nul - text));
    return false;
  }
  return true;
}

Graph *mdl_compile_text_with(Arena *a, const char *path, const char *text, const DimOverride *ov, int nov,
                             const LowerOptions *lo) {
  diag_begin();
  if (!is_text(path, text, strlen(text)))
    return NULL;
  Parser p = {.arena = a, .file = path, .text = text};
  if (!parse_text(&p))
    return NULL;
  Graph *g = sema_build(&p, ov, nov, lo);
  if (g) // (checkpoints store it)
    g->source = arena_strdup(a, text);
  return g;
}

Graph *mdl_compile_text(Arena *a, const char *path, const char *text, const DimOverride *ov, int nov) {
  return mdl_compile_text_with(a, path, text, ov, nov, NULL);
}

static Graph *compile_bytes(Arena *a, const char *path, const char *bytes, size_t n, const DimOverride *ov, int nov,
                            const LowerOptions *lo) {
  char *text = arena_alloc(a, n + 1);
  memcpy(text, bytes, n);
  if (memchr(text, 0, n)) {
    diag_begin();
    is_text(path, text, n);
    return NULL;
  }
  return mdl_compile_text_with(a, path, text, ov, nov, lo);
}

Graph *mdl_compile_bytes(Arena *a, const char *path, const char *bytes, size_t n, const DimOverride *ov, int nov) {
  return compile_bytes(a, path, bytes, n, ov, nov, NULL);
}

Graph *mdl_compile_file(Arena *a, const char *path, const DimOverride *ov, int nov) {
  return mdl_compile_file_with(a, path, ov, nov, NULL);
}

Graph *mdl_compile_file_with(Arena *a, const char *path, const DimOverride *ov, int nov, const LowerOptions *lo) {
  char why[256];
  size_t n;
  char *buf = file_read(path, &n, 0, why, sizeof why);
  if (!buf) {
    diag_file_error(path, "%s", why);
    return NULL;
  }
  Graph *g = compile_bytes(a, path, buf, n, ov, nov, lo);
  free(buf);
  return g;
}
