// sema_names.c: names and scopes: the top-level declarations (step 1 of sema.c: duplicates and
// statements out of place), the scopes names are defined in and looked up from, and what is said
// about a name that finds nothing (used before its definition, local to a repeat, did you mean).
// Also sema_error, through which every file of the analysis reports.
#include "sema_impl.h"

#include <stdarg.h>
#include <string.h>

static uint64_t name_hash(const char *s) {
  uint64_t h = 14695981039346656037ull; // FNV-1a
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static int map_slot(const NameMap *m, const char *name) {
  int i = (int)(name_hash(name) & (uint64_t)(m->cap - 1));
  while (m->keys[i] && strcmp(m->keys[i], name))
    i = (i + 1) & (m->cap - 1);
  return i;
}

static void *map_get(const NameMap *m, const char *name) { return m->cap ? m->vals[map_slot(m, name)] : NULL; }

// Sets name's value (a later one replaces an earlier one).
static void map_put(Arena *a, NameMap *m, const char *name, void *val) {
  if (2 * (m->n + 1) > m->cap) { // at most half full
    NameMap old = *m;
    m->cap = old.cap ? 2 * old.cap : 64;
    m->n = 0;
    m->keys = arena_alloc(a, sizeof(char *) * (size_t)m->cap);
    m->vals = arena_alloc(a, sizeof(void *) * (size_t)m->cap);
    for (int i = 0; i < old.cap; i++)
      if (old.keys[i])
        map_put(a, m, old.keys[i], old.vals[i]);
  }
  int i = map_slot(m, name);
  m->n += !m->keys[i];
  m->keys[i] = name;
  m->vals[i] = val;
}

//
// Errors
//

// Prints an error unless the same one was printed at the same place; returns whether it printed
// (so the caller knows whether to add its note).
bool sema_error(Sema *s, SrcLoc at, const char *fmt, ...) {
  if (diag_stopped())
    return false;
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char *key = arena_printf(s->a, "%d:%d:%s", at.line, at.col, msg);
  for (int i = 0; i < s->reported.n; i++)
    if (!strcmp(s->reported.v[i], key))
      return false;
  vec_push(s->a, &s->reported, key);
  diag_error(at, "%s", msg);
  return true;
}

const char *sema_describe(Val v) {
  switch (v.kind) {
  case V_INT: return "an integer";
  case V_FLOAT: return "a number";
  case V_BOOL: return "a boolean";
  case V_TENSOR: return "a tensor";
  case V_TUPLE: return v.topk ? "several values (topk)" : "several values (split)";
  case V_ERR: break;
  }
  return "an error";
}

char *sema_shape_text(Sema *s, Shape sh) { return shape_str(sh, arena_alloc(s->a, 128), 128); }

//
// Scopes and names
//

Sym *sema_find_in(Scope *sc, const char *name) {
  if (sc->index)
    return map_get(sc->index, name);
  for (Sym *y = sc->syms; y; y = y->next)
    if (!strcmp(y->name, name))
      return y;
  return NULL;
}

Sym *sema_lookup(Sema *s, const char *name) {
  for (Scope *sc = s->scope; sc; sc = sc->up) {
    Sym *y = sema_find_in(sc, name);
    if (y)
      return y;
  }
  return NULL;
}

Sym *sema_add_sym(Sema *s, Scope *sc, const char *name, SymKind kind, SrcLoc at) {
  Sym *y = arena_alloc(s->a, sizeof *y);
  *y = (Sym){.name = name, .kind = kind, .at = at, .next = sc->syms};
  sc->syms = y;
  if (sc->index)
    map_put(s->a, sc->index, name, y);
  return y;
}

// Defines a name in the current scope; a name visible from here already is a duplicate.
Sym *sema_define(Sema *s, const char *name, SymKind kind, SrcLoc at) {
  Sym *old = sema_lookup(s, name);
  if (old) {
    if (sema_error(s, at, "duplicate definition of '%s'", name))
      diag_note(old->at, "previous definition is here");
    return NULL;
  }
  return sema_add_sym(s, s->scope, name, kind, at);
}

static bool loc_before(SrcLoc a, SrcLoc b) { return a.line < b.line || (a.line == b.line && a.col < b.col); }

// The edit distance (insertions, deletions, substitutions) between a and b, or 3 when it is more
// than 2 (all "did you mean" needs).
static int edit_distance(const char *a, const char *b) {
  size_t n = strlen(a), m = strlen(b);
  if (n > m + 2 || m > n + 2 || m > 62)
    return 3;
  int row[64];
  for (size_t j = 0; j <= m; j++)
    row[j] = (int)j;
  for (size_t i = 1; i <= n; i++) {
    int diag = row[0], best = row[0] = (int)i;
    for (size_t j = 1; j <= m; j++) {
      int up = row[j], d = diag + (a[i - 1] != b[j - 1]);
      if (up + 1 < d)
        d = up + 1;
      if (row[j - 1] + 1 < d)
        d = row[j - 1] + 1;
      diag = up;
      row[j] = d;
      if (d < best)
        best = d;
    }
    if (best > 2)
      return 3;
  }
  return row[m] < 3 ? row[m] : 3;
}

void sema_consider(Nearest *near, const char *candidate) {
  int d = edit_distance(near->name, candidate);
  if (d < near->dist && d < (int)strlen(near->name)) {
    near->dist = d;
    near->best = candidate;
  }
}
const char *sema_did_you_mean(Sema *s, const Nearest *near) {
  return near->best ? arena_printf(s->a, " (did you mean '%s'?)", near->best) : "";
}

void sema_unknown_name(Sema *s, const Expr *e) {
  const Decl *d = NULL;
  for (int i = 0; i < s->decls.n && !d; i++)
    if (!strcmp(((Decl *)s->decls.v[i])->name, e->s))
      d = s->decls.v[i];
  if (d && d->index) {
    if (sema_error(s, e->at, "'%s' is the index of repeat block '%s' and exists only inside its body", e->s, d->repeat))
      diag_note(d->at, "'%s' is defined here", e->s);
  } else if (d && s->constant) {
    sema_error(s, e->at, "'%s' is %s; only dims and consts can be used here", e->s, d->kind);
  } else if (d && loc_before(e->at, d->at)) {
    if (sema_error(s, e->at, "'%s' is used before its definition", e->s))
      diag_note(d->at, "'%s' is defined here", e->s);
  } else if (d && d->repeat) {
    if (sema_error(s, e->at, "'%s' is local to repeat block '%s'", e->s, d->repeat))
      diag_note(d->at, "'%s' is defined here", e->s);
  } else {
    Nearest near = {e->s, NULL, 3};
    for (Scope *sc = s->scope; sc; sc = sc->up)
      for (Sym *y = sc->syms; y; y = y->next)
        sema_consider(&near, y->name);
    sema_error(s, e->at, "unknown name '%s'%s", e->s, sema_did_you_mean(s, &near));
  }
}

//
// Step 1: declarations
//

static const char *stmt_keyword(StmtKind k) {
  static const char *const kw[] = {"model", "dim", "const", "input", "param", "output", "assignment", "repeat",
                                   "train"};
  return kw[k];
}

static void add_decl(Sema *s, const char *name, const char *kind, const char *repeat, SrcLoc at) {
  Decl *d = arena_alloc(s->a, sizeof *d);
  *d = (Decl){.name = name, .kind = kind, .repeat = repeat, .at = at};
  vec_push(s->a, &s->decls, d);
}

// Records every name a statement defines (for "used before its definition" and friends) and
// rejects statements that do not belong in a repeat body.
static void scan_body(Sema *s, Stmt **body, int n, const char *repeat) {
  for (int i = 0; i < n; i++) {
    Stmt *st = body[i];
    switch (st->kind) {
    case S_PARAM: add_decl(s, st->name, "a param", repeat, st->at); break;
    case S_INPUT: add_decl(s, st->name, "an input", repeat, st->at); break;
    case S_OUTPUT: add_decl(s, st->name, "a value", repeat, st->at); break;
    case S_ASSIGN:
      for (int k = 0; k < st->nnames; k++)
        add_decl(s, st->names[k], "a value", repeat, st->names_at[k]);
      break;
    case S_REPEAT:
      if (st->index) {
        add_decl(s, st->index, "a repeat index", st->name, st->index_at);
        ((Decl *)s->decls.v[s->decls.n - 1])->index = true;
      }
      scan_body(s, st->body, st->nbody, st->name);
      break;
    default: break;
    }
    if (repeat && st->kind != S_PARAM && st->kind != S_ASSIGN && st->kind != S_REPEAT) {
      sema_error(s, st->at, "'%s' is not allowed inside a repeat block", stmt_keyword(st->kind));
      st->rejected = true;
    }
  }
}

static void reject_duplicate(Sema *s, Stmt *st, const Stmt *old) {
  bool printed = st->kind == S_MODEL   ? sema_error(s, st->at, "duplicate model statement: a file defines one model")
                 : st->kind == S_TRAIN ? sema_error(s, st->at, "duplicate train section")
                                       : sema_error(s, st->at, "duplicate definition of '%s'", st->name);
  if (printed)
    diag_note(old->at, "previous definition is here");
  st->rejected = true;
}

// Step 1 over the top-level statements; returns the train section, if any.
const Stmt *sema_declare(Sema *s) {
  NameMap top = {0}, outputs = {0}; // statement by name
  Stmt *model = NULL, *train = NULL;
  for (int i = 0; i < s->p->stmts.n; i++) {
    Stmt *st = s->p->stmts.v[i];
    Stmt *old;
    switch (st->kind) {
    case S_MODEL:
      if (model)
        reject_duplicate(s, st, model);
      else
        model = st;
      break;
    case S_TRAIN:
      if (train)
        reject_duplicate(s, st, train);
      else
        train = st;
      break;
    case S_OUTPUT:
      if ((old = map_get(&outputs, st->name))) {
        reject_duplicate(s, st, old);
      } else {
        vec_push(s->a, &s->outputs, st);
        map_put(s->a, &outputs, st->name, st);
      }
      break;
    case S_DIM: case S_CONST: case S_PARAM: case S_INPUT: case S_REPEAT:
      if ((old = map_get(&top, st->name))) {
        reject_duplicate(s, st, old);
        break;
      }
      map_put(s->a, &top, st->name, st);
      if (st->kind == S_DIM || st->kind == S_CONST) {
        Sym *y = sema_add_sym(s, &s->global, st->name, st->kind == S_DIM ? SYM_DIM : SYM_CONST, st->at);
        y->decl = st;
        vec_push(s->a, st->kind == S_DIM ? &s->dims : &s->consts, y);
      }
      break;
    case S_ASSIGN: break;
    }
  }
  scan_body(s, (Stmt **)s->p->stmts.v, s->p->stmts.n, NULL);
  if (!model)
    sema_error(s, (SrcLoc){.file = s->p->file, .text = s->p->text, .line = 1, .col = 1},
               "no model statement: a .mdl file starts with 'model NAME'");
  else
    s->g->model = model->name;
  for (int i = 0; train && i < train->nbody; i++) {
    Stmt *st = train->body[i];
    if (st->kind != S_ASSIGN || st->nnames != 1) {
      sema_error(s, st->at, "only settings such as 'B = 8' are allowed in the train section");
      st->rejected = true;
    }
  }
  return train;
}
