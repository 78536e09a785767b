// sema.c: semantic analysis: from the AST (front.h) to the forward graph (mdl.h), plus the front
// end's entry points mdl_compile_file / mdl_compile_text.
//
// It runs in four steps over the parsed file:
//   1. declare: top-level dims, consts and the train section are collected; duplicate names and
//      statements in the wrong place are reported (and skipped from then on).
//   2. dims: free dims are bound (-D first, then the train section) and every dim is evaluated.
//      Dims and consts are declarative: each is evaluated on first use, in any order, and a
//      stack of the ones being evaluated turns a reference cycle into an error.
//   3. train: the train section's settings fill g->train.
//   4. elaborate: statements run in order and append graph nodes. An expression evaluates to a
//      Val: a compile-time integer, float or boolean, a tensor (graph node), or the tuple split() or
//      topk() returns. Scalars meeting tensors become CONST nodes. `repeat NAME[N] { }` elaborates its
//      body N times, each time in a fresh scope whose params are named NAME.i.pname.
// Errors do not stop the analysis: a failed expression evaluates to V_ERR, which silently poisons
// whatever uses it, so every independent mistake is reported once. Messages are deduplicated by
// place and text, so an error inside a repeat body is not repeated for each repetition. It stops
// at the error limit (diag_stopped), at a limit on what the file builds (MDL_MAX_*: a repeat is
// measured by its first repetition and refused before the others), and at SEMA_MAX_DEPTH nested
// evaluations, where the recursion would otherwise run out of stack.
#include "front.h"

#include <float.h>
#include <fnmatch.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

typedef enum { V_ERR, V_INT, V_FLOAT, V_BOOL, V_TENSOR, V_TUPLE } ValKind;

typedef struct {
  ValKind kind;
  int64_t i;  // V_INT, V_BOOL
  double f;   // V_FLOAT
  int node;   // V_TENSOR
  int *tuple; // V_TUPLE: node ids
  int ntuple;
  bool topk;  // V_TUPLE: topk's (values, indices), else split's parts
} Val;

static const Val ERR = {.kind = V_ERR};

static Val int_val(int64_t i) { return (Val){.kind = V_INT, .i = i}; }
static Val float_val(double f) { return (Val){.kind = V_FLOAT, .f = f}; }
static Val tensor_val(int node) { return (Val){.kind = V_TENSOR, .node = node}; }

// SYM_INDEX: the index of `repeat NAME[N] as INDEX`, an integer constant inside one repetition.
typedef enum { SYM_DIM, SYM_CONST, SYM_PARAM, SYM_INPUT, SYM_VALUE, SYM_REPEAT, SYM_INDEX } SymKind;
static const char *const sym_kind[] = {"dim", "const", "param", "input", "value", "repeat block", "repeat index"};
static const char *const a_sym_kind[] = {"a dim", "a const", "a param", "an input", "a value", "a repeat block",
                                         "a repeat index"};

typedef enum { UNSEEN, EVALUATING, DONE } EvalState;

typedef struct Sym {
  const char *name;
  SymKind kind;
  SrcLoc at;
  const Stmt *decl; // dims and consts
  Val val;
  EvalState state;
  bool overridden;   // -D NAME=VALUE
  int64_t override;
  const Expr *bind;  // a free dim's value from the train section
  struct Sym *next;
} Sym;

// A hash map from names to pointers, open addressing in the arena. A file may declare 10^5 names,
// and a linear search for each made the analysis quadratic (100000 dims took 77 s).
typedef struct {
  const char **keys;
  void **vals;
  int n, cap;
} NameMap;

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

typedef struct Scope {
  Sym *syms;
  NameMap *index;     // the same names hashed (the top level only: a repeat's scopes are small)
  struct Scope *up;
  const char *prefix; // "" at the top level, "h.0." inside repetition 0 of `repeat h`
} Scope;

// A name some statement defines, for explaining why a use found nothing.
typedef struct {
  const char *name, *kind, *repeat;
  SrcLoc at;
  bool index; // the index of repeat block `repeat`
} Decl;

// One `KEY = value` line of the train section (other than dim bindings).
typedef struct {
  const char *key;
  const Expr *value;
  SrcLoc at;
} Setting;

typedef struct {
  Parser *p;
  Arena *a;
  Graph *g;
  Scope global, *scope;
  bool constant;     // evaluating a dim or const: only dims and consts may be named
  PtrVec stack;      // Sym* being evaluated (cycle detection)
  PtrVec dims;       // Sym* of every dim, declaration order
  PtrVec consts;     // Sym* of every const, declaration order
  PtrVec decls;      // Decl*
  PtrVec settings;   // Setting*
  PtrVec no_decay;   // the glob patterns (E_STRING Exprs: where each was written)
  PtrVec lr_scale;   // Expr* of the train section's lr_scale: its string keys, each then its value
  double *lr_scales; // per lr_scale key: the multiplier
  PtrVec freeze;     // Expr* strings: the freeze patterns
  PtrVec muon_params; // Expr* strings: the muon_params patterns
  SrcLoc muon_params_at; // where muon_params is set (line 0: it is not)
  PtrVec outputs;    // Stmt* of every output statement (duplicate names)
  PtrVec reported;   // "line:col:message" of every error printed
  int *out_nodes;    // the outputs built so far
  int nout;
  int dropouts;
  int depth;         // eval's recursion depth
  bool too_deep;     // the depth limit was reported
  int64_t stmts;     // statements elaborated so far, every repetition counted (MDL_MAX_STMTS)
  int64_t param_bytes; // f32 bytes of the params built so far (MDL_MAX_PARAM_BYTES)
  bool over_limit;   // a limit on the graph's size was reported: elaboration stops
  LowerOptions lower; // how attention is lowered (mdl.h)
  PtrVec masks;      // Mask* built by plain attention, shared by every attention with the same key
} Sema;

// An ATTENTION_MASK node and what it was built for.
typedef struct {
  int doc; // the doc ids node, or -1
  int64_t t;
  bool causal;
  int64_t window;
  int node;
} Mask;

enum { SEMA_MAX_DEPTH = 1000 };

//
// Errors
//

// Prints an error unless the same one was printed at the same place; returns whether it printed
// (so the caller knows whether to add its note).
static bool error_at(Sema *s, SrcLoc at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool error_at(Sema *s, SrcLoc at, const char *fmt, ...) {
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

static const char *describe(Val v) {
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

static char *shape_text(Sema *s, Shape sh) { return shape_str(sh, arena_alloc(s->a, 128), 128); }

static IrNode *node(Sema *s, int id) { return s->g->nodes[id]; }

//
// Scopes and names
//

static Sym *find_in(Scope *sc, const char *name) {
  if (sc->index)
    return map_get(sc->index, name);
  for (Sym *y = sc->syms; y; y = y->next)
    if (!strcmp(y->name, name))
      return y;
  return NULL;
}

static Sym *lookup(Sema *s, const char *name) {
  for (Scope *sc = s->scope; sc; sc = sc->up) {
    Sym *y = find_in(sc, name);
    if (y)
      return y;
  }
  return NULL;
}

static Sym *add_sym(Sema *s, Scope *sc, const char *name, SymKind kind, SrcLoc at) {
  Sym *y = arena_alloc(s->a, sizeof *y);
  *y = (Sym){.name = name, .kind = kind, .at = at, .next = sc->syms};
  sc->syms = y;
  if (sc->index)
    map_put(s->a, sc->index, name, y);
  return y;
}

// Defines a name in the current scope; a name visible from here already is a duplicate.
static Sym *define(Sema *s, const char *name, SymKind kind, SrcLoc at) {
  Sym *old = lookup(s, name);
  if (old) {
    if (error_at(s, at, "duplicate definition of '%s'", name))
      diag_note(old->at, "previous definition is here");
    return NULL;
  }
  return add_sym(s, s->scope, name, kind, at);
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

// " (did you mean 'NAME'?)" for the nearest of the candidates within 2 edits of name (and fewer
// than its length), else "".
typedef struct {
  const char *name, *best;
  int dist;
} Nearest;
static void consider(Nearest *near, const char *candidate) {
  int d = edit_distance(near->name, candidate);
  if (d < near->dist && d < (int)strlen(near->name)) {
    near->dist = d;
    near->best = candidate;
  }
}
static const char *did_you_mean(Sema *s, const Nearest *near) {
  return near->best ? arena_printf(s->a, " (did you mean '%s'?)", near->best) : "";
}

static void unknown_name(Sema *s, const Expr *e) {
  const Decl *d = NULL;
  for (int i = 0; i < s->decls.n && !d; i++)
    if (!strcmp(((Decl *)s->decls.v[i])->name, e->s))
      d = s->decls.v[i];
  if (d && d->index) {
    if (error_at(s, e->at, "'%s' is the index of repeat block '%s' and exists only inside its body", e->s, d->repeat))
      diag_note(d->at, "'%s' is defined here", e->s);
  } else if (d && s->constant) {
    error_at(s, e->at, "'%s' is %s; only dims and consts can be used here", e->s, d->kind);
  } else if (d && loc_before(e->at, d->at)) {
    if (error_at(s, e->at, "'%s' is used before its definition", e->s))
      diag_note(d->at, "'%s' is defined here", e->s);
  } else if (d && d->repeat) {
    if (error_at(s, e->at, "'%s' is local to repeat block '%s'", e->s, d->repeat))
      diag_note(d->at, "'%s' is defined here", e->s);
  } else {
    Nearest near = {e->s, NULL, 3};
    for (Scope *sc = s->scope; sc; sc = sc->up)
      for (Sym *y = sc->syms; y; y = y->next)
        consider(&near, y->name);
    error_at(s, e->at, "unknown name '%s'%s", e->s, did_you_mean(s, &near));
  }
}

//
// Expressions
//

static Val eval(Sema *s, const Expr *e);
static Val sym_value(Sema *s, Sym *y, SrcLoc use);

static Val eval_const(Sema *s, const Expr *e) {
  bool saved = s->constant;
  s->constant = true;
  Val v = eval(s, e);
  s->constant = saved;
  return v;
}

// Appends an op; ir.c's shape and dtype errors are reported at the op the user wrote.
static Val add_op(Sema *s, Op op, const int *in, int nin, const int64_t ia[IR_NIA], const double fa[IR_NFA],
                  SrcLoc at) {
  int id = ir_add(s->g, op, in, nin, ia, fa, at);
  if (id < 0) {
    error_at(s, at, "%s", s->g->err);
    return ERR;
  }
  return tensor_val(id);
}

static Val reshape(Sema *s, int x, Shape sh, SrcLoc at) {
  int id = ir_reshape(s->g, x, sh, at);
  if (id < 0) {
    error_at(s, at, "%s", s->g->err);
    return ERR;
  }
  return tensor_val(id);
}

// A binary operator as the .mdl spells it (the parser keeps the two-character ones as one letter).
static const char *op_text(int op) {
  switch (op) {
  case 'l': return "<=";
  case 'g': return ">=";
  case 'e': return "==";
  case 'n': return "!=";
  case '<': return "<";
  case '>': return ">";
  case '+': return "+";
  case '-': return "-";
  case '*': return "*";
  case '/': return "/";
  case '@': return "@";
  case 'q': return "//";
  default: return "%";
  }
}

// A scalar operand of a tensor op becomes a CONST node.
static int as_node(Sema *s, Val v, SrcLoc at) {
  if (v.kind == V_TENSOR)
    return v.node;
  int id = ir_const(s->g, v.kind == V_INT ? (double)v.i : v.f, at);
  if (id < 0)
    error_at(s, at, "%s", s->g->err);
  return id;
}

// a // b and a % b as Python and numpy take them: the quotient rounded down, the remainder with the
// sign of b (a == b * (a // b) + a % b); b != 0, and not INT64_MIN // -1.
static int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b != 0 && (a % b < 0) != (b < 0)); }
static int64_t floor_mod(int64_t a, int64_t b) { return a % b + (a % b != 0 && (a % b < 0) != (b < 0) ? b : 0); }

// The nodes of the operands v[0 .. n) of an elementwise op (`what` names it in messages, `at` its
// place, vat[k] each operand's): numbers become CONSTs, of i32 where a tensor operand is i32
// (integer arithmetic), else of f32. i32 and f32 tensors together, or a float number beside an i32
// tensor, is an error naming both.
static bool operand_nodes(Sema *s, const char *what, SrcLoc at, const Val *v, const SrcLoc *vat, int n, int *out) {
  const IrNode *i32 = NULL, *other = NULL;
  for (int k = 0; k < n; k++)
    if (v[k].kind == V_TENSOR) {
      if (node(s, v[k].node)->dtype == DT_I32)
        i32 = node(s, v[k].node);
      else
        other = node(s, v[k].node);
    }
  if (i32 && other) {
    error_at(s, at, "%s mixes i32 and %s tensors; convert one with float(x) or int(x)", what, dtype_name(other->dtype));
    return false;
  }
  for (int k = 0; k < n; k++) {
    if (v[k].kind == V_TENSOR) {
      out[k] = v[k].node;
    } else if (!i32) {
      if ((out[k] = as_node(s, v[k], vat[k])) < 0)
        return false;
    } else if (v[k].kind == V_FLOAT) {
      error_at(s, vat[k], "%s mixes an i32 tensor and the float number %g; convert the tensor with float(x)", what,
               v[k].f);
      return false;
    } else if (v[k].i < INT32_MIN || v[k].i > INT32_MAX) {
      error_at(s, vat[k], "%s: %lld does not fit in i32, the tensor's dtype", what, (long long)v[k].i);
      return false;
    } else if ((out[k] = ir_const_i32(s->g, (int32_t)v[k].i, vat[k])) < 0) {
      error_at(s, vat[k], "%s", s->g->err);
      return false;
    }
  }
  return true;
}

static Val arith_int(Sema *s, const Expr *e, int64_t a, int64_t b) {
  int64_t r = 0;
  bool overflow = false;
  switch (e->op) {
  case '+': overflow = __builtin_add_overflow(a, b, &r); break;
  case '-': overflow = __builtin_sub_overflow(a, b, &r); break;
  case '*': overflow = __builtin_mul_overflow(a, b, &r); break;
  case '/':
  case '%':
  case 'q':
    if (b == 0) {
      error_at(s, e->at, "division by zero in dimension arithmetic");
      return ERR;
    }
    if (a == INT64_MIN && b == -1) {
      overflow = true;
      break;
    }
    if (e->op == '/' && a % b != 0) {
      error_at(s, e->at, "%s: %lld is not divisible by %lld", ast_text(s->a, e->at.text, e), (long long)a,
               (long long)b);
      return ERR;
    }
    r = e->op == '/' ? a / b : e->op == 'q' ? floor_div(a, b) : floor_mod(a, b);
    break;
  }
  if (overflow) {
    error_at(s, e->at, "integer overflow in dimension arithmetic");
    return ERR;
  }
  return int_val(r);
}

static Val arith_scalar(Sema *s, const Expr *e, Val a, Val b) {
  if (a.kind == V_BOOL || b.kind == V_BOOL) {
    error_at(s, e->at, "'%s' does not apply to booleans", op_text(e->op));
    return ERR;
  }
  if (a.kind == V_INT && b.kind == V_INT)
    return arith_int(s, e, a.i, b.i);
  double x = a.kind == V_INT ? (double)a.i : a.f, y = b.kind == V_INT ? (double)b.i : b.f;
  switch (e->op) {
  case '+': return float_val(x + y);
  case '-': return float_val(x - y);
  case '*': return float_val(x * y);
  case '/':
    if (y == 0) {
      error_at(s, e->at, "division by zero");
      return ERR;
    }
    return float_val(x / y);
  }
  error_at(s, e->at, "'%s' needs integer operands", op_text(e->op));
  return ERR;
}

static bool is_comparison(int op) { return strchr("<>lgen", op) != NULL; }

// a REL b: on numbers a boolean now; on tensors a COMPARE node, 1 where it holds and 0 elsewhere.
static Val comparison(Sema *s, const Expr *e, Val a, Val b) {
  static const char ops[] = "<l>gen";
  int64_t rel = strchr(ops, e->op) - ops; // CMP_LT, CMP_LE, ... in Compare's order
  if (a.kind == V_BOOL || b.kind == V_BOOL) {
    error_at(s, e->at, "'%s' compares numbers and tensors, not booleans", op_text(e->op));
    return ERR;
  }
  if (a.kind != V_TENSOR && b.kind != V_TENSOR) {
    double x = a.kind == V_INT ? (double)a.i : a.f, y = b.kind == V_INT ? (double)b.i : b.f;
    return (Val){.kind = V_BOOL, .i = interp_compare(rel, x, y) != 0};
  }
  int in[2];
  if (!operand_nodes(s, arena_printf(s->a, "'%s'", op_text(e->op)), e->at, (Val[]){a, b},
                     (SrcLoc[]){e->lhs->at, e->rhs->at}, 2, in))
    return ERR;
  return add_op(s, OP_COMPARE, in, 2, (int64_t[8]){rel}, NULL, e->at);
}

static bool is_transpose(const Expr *e) { return e->kind == E_ATTR && !strcmp(e->s, "T"); }

// v.T (e is the .T expression): a PERMUTE swapping the last two axes.
static Val transpose(Sema *s, const Expr *e, Val v) {
  if (v.kind == V_ERR)
    return ERR;
  if (v.kind != V_TENSOR || node(s, v.node)->shape.rank < 2) {
    error_at(s, e->at, "'.T' needs a tensor of rank 2 or more, got %s",
             v.kind == V_TENSOR ? shape_text(s, node(s, v.node)->shape) : describe(v));
    return ERR;
  }
  int r = node(s, v.node)->shape.rank;
  int64_t perm[IR_NIA] = {0};
  for (int i = 0; i < r; i++)
    perm[i] = i;
  perm[r - 2] = r - 1;
  perm[r - 1] = r - 2;
  return add_op(s, OP_PERMUTE, &v.node, 1, perm, NULL, e->at);
}

// A `.T` operand of @ becomes the matmul's transpose flag rather than a PERMUTE node.
static Val matmul_operand(Sema *s, const Expr *e, bool *transposed) {
  *transposed = false;
  if (!is_transpose(e))
    return eval(s, e);
  Val v = eval(s, e->lhs);
  if (v.kind == V_TENSOR && node(s, v.node)->shape.rank >= 2) {
    *transposed = true;
    return v;
  }
  return transpose(s, e, v);
}

// a @ b. A rank > 2 activation times a 2-D weight is lowered to one 2-D GEMM between reshapes.
static Val matmul(Sema *s, const Expr *e) {
  bool ta, tb;
  Val a = matmul_operand(s, e->lhs, &ta), b = matmul_operand(s, e->rhs, &tb);
  if (a.kind == V_ERR || b.kind == V_ERR)
    return ERR;
  if (a.kind != V_TENSOR || b.kind != V_TENSOR) {
    error_at(s, e->at, "'@' needs two tensors, got %s and %s", describe(a), describe(b));
    return ERR;
  }
  Shape as = node(s, a.node)->shape, bs = node(s, b.node)->shape;
  int64_t flags[8] = {ta, tb};
  if (as.rank > 2 && bs.rank == 2 && !ta) {
    int64_t k = as.d[as.rank - 1];
    if (k == (tb ? bs.d[1] : bs.d[0])) {
      Shape flat = {.rank = 2, .d = {shape_numel(as) / k, k}};
      Val a2 = reshape(s, a.node, flat, e->at);
      if (a2.kind == V_ERR)
        return ERR;
      Val c = add_op(s, OP_MATMUL, (int[]){a2.node, b.node}, 2, flags, NULL, e->at);
      if (c.kind == V_ERR)
        return ERR;
      Shape out = as;
      out.d[out.rank - 1] = tb ? bs.d[0] : bs.d[1];
      return reshape(s, c.node, out, e->at);
    }
  }
  return add_op(s, OP_MATMUL, (int[]){a.node, b.node}, 2, flags, NULL, e->at);
}

static Val binary(Sema *s, const Expr *e) {
  if (e->op == '@')
    return matmul(s, e);
  Val a = eval(s, e->lhs), b = eval(s, e->rhs);
  if (a.kind == V_ERR || b.kind == V_ERR)
    return ERR;
  if (a.kind == V_TUPLE || b.kind == V_TUPLE) {
    error_at(s, e->at, "'%s' cannot take the several values of %s(); unpack them first", op_text(e->op),
             (a.kind == V_TUPLE ? a : b).topk ? "topk" : "split");
    return ERR;
  }
  if (is_comparison(e->op))
    return comparison(s, e, a, b);
  if (a.kind != V_TENSOR && b.kind != V_TENSOR)
    return arith_scalar(s, e, a, b);
  if (a.kind == V_BOOL || b.kind == V_BOOL) {
    error_at(s, e->at, "'%s' does not apply to booleans", op_text(e->op));
    return ERR;
  }
  int in[2];
  if (!operand_nodes(s, arena_printf(s->a, "'%s'", op_text(e->op)), e->at, (Val[]){a, b},
                     (SrcLoc[]){e->lhs->at, e->rhs->at}, 2, in))
    return ERR;
  bool ints = node(s, in[0])->dtype == DT_I32;
  if ((e->op == '%' || e->op == 'q') && !ints) {
    error_at(s, e->at, "'%s' applies to integers (i32 tensors, dims and consts), not to %s tensors", op_text(e->op),
             dtype_name(node(s, in[0])->dtype));
    return ERR;
  }
  if ((e->op == '%' || e->op == 'q') && b.kind == V_INT && b.i == 0) {
    error_at(s, e->at, "division by zero");
    return ERR;
  }
  if (e->op == '/' && ints) {
    error_at(s, e->at, "'/' does not apply to i32 tensors: a // b is the integer quotient, float(a) / b a float one");
    return ERR;
  }
  Op op = e->op == '+'   ? OP_ADD
          : e->op == '-' ? OP_SUB
          : e->op == '*' ? OP_MUL
          : e->op == '/' ? OP_DIV
          : e->op == 'q' ? OP_FLOORDIV
                         : OP_MOD;
  return add_op(s, op, in, 2, NULL, NULL, e->at);
}

static Val negate(Sema *s, const Expr *e) {
  Val v = eval(s, e->lhs);
  switch (v.kind) {
  case V_ERR: return ERR;
  case V_INT:
    if (v.i == INT64_MIN) {
      error_at(s, e->at, "integer overflow in dimension arithmetic");
      return ERR;
    }
    return int_val(-v.i);
  case V_FLOAT: return float_val(-v.f);
  case V_TENSOR: return add_op(s, OP_NEG, &v.node, 1, NULL, NULL, e->at);
  default: error_at(s, e->at, "unary '-' does not apply to %s", describe(v)); return ERR;
  }
}

static Val attr(Sema *s, const Expr *e) {
  if (!is_transpose(e)) {
    error_at(s, e->at, "unknown attribute '.%s' (the only one is .T)", e->s);
    return ERR;
  }
  return transpose(s, e, eval(s, e->lhs));
}

// Evaluates e to an integer (dims, consts, literals and their arithmetic).
static bool int_of(Sema *s, const Expr *e, const char *what, int64_t *out) {
  Val v = eval(s, e);
  if (v.kind == V_ERR)
    return false;
  if (v.kind != V_INT) {
    error_at(s, e->at, "%s must be an integer, got %s", what, describe(v));
    return false;
  }
  *out = v.i;
  return true;
}

// x[i, a:b, :]: SLICE per restricted axis; integer indices then drop their axes with a RESHAPE.
static Val index_expr(Sema *s, const Expr *e) {
  Val v = eval(s, e->lhs);
  if (v.kind == V_ERR)
    return ERR;
  if (v.kind != V_TENSOR) {
    error_at(s, e->at, "only tensors can be indexed, not %s", describe(v));
    return ERR;
  }
  Shape sh = node(s, v.node)->shape;
  if (e->nargs > sh.rank) {
    error_at(s, e->at, "%d indices for a tensor of rank %d", e->nargs, sh.rank);
    return ERR;
  }
  int x = v.node;
  Shape kept = {0};
  for (int ax = 0; ax < sh.rank; ax++) {
    const Expr *ix = ax < e->nargs ? e->args[ax] : NULL;
    int64_t n = sh.d[ax], lo = 0, hi = n;
    bool single = ix && ix->kind != E_SLICE;
    if (single) {
      if (!int_of(s, ix, "an index", &lo))
        return ERR;
      int64_t i = lo < 0 ? lo + n : lo;
      if (i < 0 || i >= n) {
        error_at(s, ix->at, "index %lld is out of range for axis %d of size %lld", (long long)lo, ax, (long long)n);
        return ERR;
      }
      lo = i;
      hi = i + 1;
    } else if (ix) {
      if ((ix->lo && !int_of(s, ix->lo, "a slice bound", &lo)) || (ix->hi && !int_of(s, ix->hi, "a slice bound", &hi)))
        return ERR;
      int64_t a = lo < 0 ? lo + n : lo, b = hi < 0 ? hi + n : hi;
      if (a < 0 || b > n || a >= b) {
        error_at(s, ix->at, "slice %lld:%lld is empty or out of range for axis %d of size %lld", (long long)lo,
                 (long long)hi, ax, (long long)n);
        return ERR;
      }
      lo = a;
      hi = b;
    }
    if (hi - lo != n) {
      Val sl = add_op(s, OP_SLICE, &x, 1, (int64_t[8]){ax, lo, hi}, NULL, ix->at);
      if (sl.kind == V_ERR)
        return ERR;
      x = sl.node;
    }
    if (!single)
      kept.d[kept.rank++] = hi - lo;
  }
  if (kept.rank == sh.rank)
    return tensor_val(x);
  return reshape(s, x, kept, e->at);
}

//
// Built-in ops
//

typedef struct Builtin Builtin;

// A builtin's argument as the evaluator hands it over, checked against its parameter's kind
// (Builtin.kinds): 't' a tensor, 'n' a tensor or a number, 'i' an integer, 'r' an integer that must
// be given (a keyword argument such as heads=N), 'f' a number (as a float), 'b' a boolean, 'v' any
// value (the builtin checks it), 'I' a list of integers, 'T' a list of tensors. An argument left out
// has the kind V_ERR.
typedef struct {
  Val v;         // 't' 'n' 'i' 'r' 'f' 'b' 'v'
  int64_t *ints; // 'I': the list's integers
  int *nodes;    // 'T': the list's tensors
  int n;         // 'I', 'T': the list's length
} Arg;

// A builtin gets its arguments evaluated (val) and their expressions (arg: where each was written,
// or NULL where it was left out); it runs only when every argument it was given evaluated.
typedef Val (*BuiltinFn)(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val);
// A check of a call's form (which arguments it was given) before they are evaluated.
typedef bool (*BuiltinForm)(Sema *s, const Builtin *b, const Expr **arg);

// params[0 .. max) are positional (the first `min` required); the rest are keyword-only.
enum { BUILTIN_PARAMS = 10 }; // parameters of a builtin at most (attention's nine)
struct Builtin {
  const char *name;
  int min, max;
  const char *params[BUILTIN_PARAMS];
  BuiltinFn fn;
  Op op;
  // Each parameter's kind (Arg), in the order of params. Spaces cut them into groups: the arguments
  // of a group are all evaluated, and the next group only when they all were.
  const char *kinds;
  BuiltinForm form; // or NULL
};

static int nparams(const Builtin *b) {
  int n = 0;
  while (n < BUILTIN_PARAMS && b->params[n])
    n++;
  return n;
}

// Matches a call's arguments to b's parameters: arg[k] is the expression given for params[k],
// or NULL. Reports wrong counts, unknown and repeated keywords.
static bool bind_args(Sema *s, const Builtin *b, const Expr *call, const Expr **arg) {
  int np = nparams(b), npos = 0, got = 0;
  bool ok = true, keywords = false;
  for (int k = 0; k < BUILTIN_PARAMS; k++)
    arg[k] = NULL;
  for (int i = 0; i < call->nargs; i++) {
    if (!call->kw[i]) {
      if (keywords) {
        error_at(s, call->args[i]->at, "%s: positional argument after keyword arguments", b->name);
        ok = false;
      } else if (npos < b->max) {
        arg[npos] = call->args[i];
      }
      npos++;
      continue;
    }
    keywords = true;
    int k = 0;
    while (k < np && strcmp(b->params[k], call->kw[i]))
      k++;
    if (k == np) {
      char known[160] = "";
      for (int j = 0; j < np; j++)
        snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", j ? ", " : "", b->params[j]);
      error_at(s, call->kw_at[i], "%s: unknown keyword argument '%s' (%s takes %s)", b->name, call->kw[i], b->name,
               np ? known : "none");
      ok = false;
    } else if (arg[k]) {
      error_at(s, call->kw_at[i], "%s: argument '%s' given twice", b->name, call->kw[i]);
      ok = false;
    } else {
      arg[k] = call->args[i];
    }
  }
  bool missing = false;
  for (int k = 0; k < b->max; k++) {
    got += arg[k] != NULL;
    missing |= k < b->min && !arg[k];
  }
  if (npos > b->max)
    got += npos - b->max;
  if (ok && (missing || npos > b->max)) {
    char hint[128] = "";
    if (npos > b->max && b->max < np)
      snprintf(hint, sizeof hint, " (%s is a keyword argument: %s=...)", b->params[b->max], b->params[b->max]);
    if (b->min == b->max)
      error_at(s, call->at, "%s takes %d argument%s, got %d%s", b->name, b->min, b->min == 1 ? "" : "s", got, hint);
    else
      error_at(s, call->at, "%s takes %d to %d arguments, got %d%s", b->name, b->min, b->max, got, hint);
    ok = false;
  }
  return ok;
}

static int tensor_arg(Sema *s, const Builtin *b, const Expr *e, const char *what) {
  Val v = eval(s, e);
  if (v.kind == V_ERR)
    return -1;
  if (v.kind != V_TENSOR) {
    error_at(s, e->at, "%s: %s must be a tensor, got %s", b->name, what, describe(v));
    return -1;
  }
  return v.node;
}

static bool int_arg(Sema *s, const Builtin *b, const Expr *e, const char *what, int64_t *out) {
  return int_of(s, e, arena_printf(s->a, "%s: %s", b->name, what), out);
}

static bool float_arg(Sema *s, const Builtin *b, const Expr *e, const char *what, double *out) {
  Val v = eval(s, e);
  if (v.kind == V_ERR)
    return false;
  if (v.kind != V_INT && v.kind != V_FLOAT) {
    error_at(s, e->at, "%s: %s must be a number, got %s", b->name, what, describe(v));
    return false;
  }
  *out = v.kind == V_INT ? (double)v.i : v.f;
  return true;
}

static bool bool_arg(Sema *s, const Builtin *b, const Expr *e, const char *what, int64_t *out) {
  Val v = eval(s, e);
  if (v.kind == V_ERR)
    return false;
  if (v.kind != V_BOOL) {
    error_at(s, e->at, "%s: %s must be true or false, got %s", b->name, what, describe(v));
    return false;
  }
  *out = v.i != 0;
  return true;
}

// The integers of a list literal such as [B, T, -1].
static bool int_list(Sema *s, const Builtin *b, const Expr *e, const char *what, int64_t *out, int *n) {
  if (e->kind != E_LIST) {
    error_at(s, e->at, "%s: %s must be a list such as [0, 2, 1]", b->name, what);
    return false;
  }
  if (e->nargs > IR_MAX_RANK) {
    error_at(s, e->at, "%s: %s has %d entries; tensors have at most %d axes", b->name, what, e->nargs, IR_MAX_RANK);
    return false;
  }
  for (int i = 0; i < e->nargs; i++)
    if (!int_of(s, e->args[i], arena_printf(s->a, "%s: %s entry", b->name, what), &out[i]))
      return false;
  *n = e->nargs;
  return true;
}

// The tensors of a list literal such as [a, b].
static bool tensor_list(Sema *s, const Builtin *b, const Expr *list, Arg *out) {
  if (list->kind != E_LIST || list->nargs == 0) {
    error_at(s, list->at, "%s: the first argument must be a list of tensors, such as [a, b]", b->name);
    return false;
  }
  out->nodes = arena_alloc(s->a, sizeof(int) * (size_t)list->nargs);
  out->n = list->nargs;
  for (int i = 0; i < list->nargs; i++)
    if ((out->nodes[i] = tensor_arg(s, b, list->args[i], "each list entry")) < 0)
      return false;
  return true;
}

// Evaluates argument e of builtin b's parameter k as the parameter's kind says.
static bool eval_arg(Sema *s, const Builtin *b, int k, char kind, const Expr *e, Arg *out) {
  const char *what = b->params[k];
  switch (kind) {
  case 't': out->v = tensor_val(tensor_arg(s, b, e, what)); return out->v.node >= 0;
  case 'n':
    out->v = eval(s, e);
    if (out->v.kind == V_ERR)
      return false;
    if (out->v.kind != V_TENSOR && out->v.kind != V_INT && out->v.kind != V_FLOAT) {
      error_at(s, e->at, "%s: %s must be a tensor or a number, got %s", b->name, what, describe(out->v));
      return false;
    }
    return true;
  case 'i':
  case 'r': out->v.kind = V_INT; return int_arg(s, b, e, what, &out->v.i);
  case 'f': out->v.kind = V_FLOAT; return float_arg(s, b, e, what, &out->v.f);
  case 'b': out->v.kind = V_BOOL; return bool_arg(s, b, e, what, &out->v.i);
  case 'I':
    out->ints = arena_alloc(s->a, sizeof(int64_t) * IR_MAX_RANK);
    return int_list(s, b, e, what, out->ints, &out->n);
  case 'T': return tensor_list(s, b, e, out);
  default: out->v = eval(s, e); return out->v.kind != V_ERR;
  }
}

// Evaluates a call's arguments (arg, as bind_args matched them) a group of b->kinds at a time; false
// after a group where one failed or a required one was left out (reported).
static bool eval_args(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, Arg *val) {
  for (int k = 0; k < BUILTIN_PARAMS; k++)
    val[k] = (Arg){0};
  bool ok = true;
  int k = 0;
  for (const char *c = b->kinds; *c && (ok || *c != ' '); c++) {
    if (*c == ' ')
      continue;
    if (arg[k]) {
      ok = eval_arg(s, b, k, *c, arg[k], &val[k]) && ok;
    } else if (*c == 'r') {
      error_at(s, call->at, "%s: %s=N is required", b->name, b->params[k]);
      ok = false;
    }
    k++;
  }
  return ok;
}

// An evaluated argument, or dflt where it was left out.
static int64_t int_or(const Arg *a, int64_t dflt) { return a->v.kind == V_INT ? a->v.i : dflt; }
static double float_or(const Arg *a, double dflt) { return a->v.kind == V_FLOAT ? a->v.f : dflt; }
static bool bool_or(const Arg *a, bool dflt) { return a->v.kind == V_BOOL ? a->v.i != 0 : dflt; }

// An axis of a tensor of the given rank (e: the argument, a: its value, dflt where it is left out);
// negative axes count from the end.
static bool axis_arg(Sema *s, const Builtin *b, const Expr *e, const Arg *v, int64_t dflt, int rank, SrcLoc at,
                     int64_t *out) {
  int64_t a = int_or(v, dflt);
  int64_t k = a < 0 ? a + rank : a;
  if (k < 0 || k >= rank) {
    error_at(s, e ? e->at : at, "%s: axis %lld is out of range for a tensor of rank %d", b->name, (long long)a, rank);
    return false;
  }
  *out = k;
  return true;
}

static bool need_i32(Sema *s, const Builtin *b, int x, const char *what, SrcLoc at) {
  if (node(s, x)->dtype == DT_I32)
    return true;
  error_at(s, at, "%s: %s must be i32, got %s", b->name, what, dtype_name(node(s, x)->dtype));
  return false;
}

// gelu relu silu exp log tanh sqrt rsqrt neg: elementwise on tensors, folded on scalars.
static Val builtin_unary(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)arg;
  Val v = val[0].v;
  if (v.kind == V_TENSOR)
    return add_op(s, b->op, &v.node, 1, NULL, NULL, call->at);
  if (v.kind == V_INT && (b->op == OP_ABS || b->op == OP_NEG) && v.i != INT64_MIN) // an integer stays one
    return int_val(b->op == OP_NEG || v.i < 0 ? -v.i : v.i);
  double x = v.kind == V_INT ? (double)v.i : v.f;
  if (((b->op == OP_SQRT || b->op == OP_RSQRT) && x < 0) || (b->op == OP_LOG && x <= 0) ||
      (b->op == OP_RSQRT && x == 0)) {
    error_at(s, call->at, "%s(%g) is not a real number", b->name, x);
    return ERR;
  }
  return float_val(interp_unary(b->op, x));
}

// float(x) and int(x): an f32 tensor of an i32 one and back (CAST), int toward zero, saturating at
// the i32 range, NaN to 0 (interp_to_i32); on numbers at compile time, int toward zero (a 64-bit
// integer); a tensor of the wanted dtype is itself. No gradient flows through an integer.
static Val builtin_cast(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)arg;
  bool to_int = !strcmp(b->name, "int");
  Val v = val[0].v;
  switch (v.kind) {
  case V_INT: return to_int ? v : float_val((double)v.i);
  case V_FLOAT:
    if (!to_int)
      return v;
    if (!(fabs(v.f) < 9.2e18)) {
      error_at(s, call->at, "int(%g) is not a 64-bit integer", v.f);
      return ERR;
    }
    return int_val((int64_t)v.f);
  default: {
    DType from = node(s, v.node)->dtype, to = to_int ? DT_I32 : DT_F32;
    if (from == to)
      return v;
    return add_op(s, OP_CAST, &v.node, 1, (int64_t[8]){to}, NULL, call->at);
  }
  }
}

// where(cond, a, b): a where cond is not 0 (a comparison's 1), else b; a and b may be numbers.
static Val builtin_where(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b;
  Val v[3];
  for (int i = 0; i < 3; i++)
    v[i] = val[i].v;
  if (v[0].kind != V_TENSOR) {
    error_at(s, arg[0]->at, "where: cond must be a tensor (a comparison such as x > 0); a constant condition picks "
             "a or b by itself");
    return ERR;
  }
  int in[3] = {v[0].node};
  if (!operand_nodes(s, "where", call->at, v + 1, (SrcLoc[]){arg[1]->at, arg[2]->at}, 2, in + 1))
    return ERR;
  return add_op(s, OP_WHERE, in, 3, NULL, NULL, call->at);
}

// clamp(x, min=, max=): x within [min, max], a bound left out being none (at least one given).
static Val builtin_clamp(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b;
  int x = val[0].v.node;
  double lo = float_or(&val[1], -INFINITY), hi = float_or(&val[2], INFINITY);
  if (!arg[1] && !arg[2]) {
    error_at(s, call->at, "clamp: give min=, max= or both");
    return ERR;
  }
  if (!(lo <= hi)) {
    error_at(s, call->at, "clamp: min %g is above max %g", lo, hi);
    return ERR;
  }
  return add_op(s, OP_CLAMP, &x, 1, NULL, (double[6]){lo, hi}, call->at);
}

// sum / mean / max over one axis, or over everything: reshape to [numel], reduce axis 0 -> [].
// The mean over everything of a cross-entropy is the mean over the targets it counts, as PyTorch's
// cross_entropy(..., ignore_index=-1) takes it: sum / target_count(targets), an ignored (negative)
// target counting in neither; with every target ignored the loss is 0 and so are its gradients.
// Over one axis a mean divides by the axis' length, whatever the values.
static Val reduce_tensor(Sema *s, const Builtin *b, Op op, const Expr *call, int x, const Expr *axis_e,
                         const Arg *axis_v, const Arg *keep_v) {
  bool keep = bool_or(keep_v, false);
  Shape sh = node(s, x)->shape;
  if (axis_e) {
    int64_t axis;
    if (!axis_arg(s, b, axis_e, axis_v, 0, sh.rank, call->at, &axis))
      return ERR;
    return add_op(s, op, &x, 1, (int64_t[8]){axis, keep}, NULL, call->at);
  }
  int targets = node(s, x)->op == OP_CROSS_ENTROPY && op == OP_MEAN ? node(s, x)->in[1] : -1;
  if (sh.rank != 1) {
    Val flat = reshape(s, x, (Shape){.rank = 1, .d = {shape_numel(sh)}}, call->at);
    if (flat.kind == V_ERR)
      return ERR;
    x = flat.node;
  }
  Val r;
  if (targets >= 0) {
    Val sum = add_op(s, OP_SUM, &x, 1, (int64_t[8]){0, 0}, NULL, call->at);
    Val count = add_op(s, OP_TARGET_COUNT, &targets, 1, NULL, NULL, call->at);
    if (sum.kind == V_ERR || count.kind == V_ERR)
      return ERR;
    r = add_op(s, OP_DIV, (int[]){sum.node, count.node}, 2, NULL, NULL, call->at);
  } else {
    r = add_op(s, op, &x, 1, (int64_t[8]){0, 0}, NULL, call->at);
  }
  if (r.kind == V_ERR || !keep || sh.rank == 0)
    return r;
  Shape ones = {.rank = sh.rank};
  for (int i = 0; i < sh.rank; i++)
    ones.d[i] = 1;
  return reshape(s, r.node, ones, call->at);
}

static Val builtin_reduce(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  return reduce_tensor(s, b, b->op, call, val[0].v.node, arg[1], &val[1], &val[2]);
}

// max(a, b) / min(a, b): elementwise with broadcasting (either may be a number; two numbers fold);
// max(x, axis=, keepdim=) / min(...): a reduction, told apart by the second positional argument.
// The min reduction is -max(-x): the same values, and the same gradient rule at ties.
static bool minmax_form(Sema *s, const Builtin *b, const Expr **arg) {
  if (arg[1] && (arg[2] || arg[3])) {
    error_at(s, arg[2] ? arg[2]->at : arg[3]->at, "%s(a, b) is elementwise and takes no axis= or keepdim=; the "
             "reduction is %s(x, axis=...)", b->name, b->name);
    return false;
  }
  return true;
}

static Val builtin_minmax(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  bool is_max = b->op == OP_MAXIMUM;
  if (!arg[1]) {
    if (val[0].v.kind != V_TENSOR) {
      error_at(s, arg[0]->at, "%s: x must be a tensor, got %s", b->name, describe(val[0].v));
      return ERR;
    }
    int x = val[0].v.node;
    if (!is_max) {
      Val neg = add_op(s, OP_NEG, &x, 1, NULL, NULL, call->at);
      if (neg.kind == V_ERR)
        return ERR;
      x = neg.node;
    }
    Val r = reduce_tensor(s, b, OP_MAX, call, x, arg[2], &val[2], &val[3]);
    return is_max || r.kind == V_ERR ? r : add_op(s, OP_NEG, &r.node, 1, NULL, NULL, call->at);
  }
  Val v[2];
  for (int i = 0; i < 2; i++) {
    v[i] = val[i].v;
    if (v[i].kind != V_TENSOR && v[i].kind != V_INT && v[i].kind != V_FLOAT) {
      error_at(s, arg[i]->at, "%s: %s must be a tensor or a number, got %s", b->name, b->params[i], describe(v[i]));
      return ERR;
    }
  }
  if (v[0].kind == V_INT && v[1].kind == V_INT)
    return int_val(is_max == (v[0].i > v[1].i) ? v[0].i : v[1].i);
  if (v[0].kind != V_TENSOR && v[1].kind != V_TENSOR) {
    double x = v[0].kind == V_INT ? (double)v[0].i : v[0].f, y = v[1].kind == V_INT ? (double)v[1].i : v[1].f;
    return float_val(is_max ? fmax(x, y) : fmin(x, y));
  }
  int in[2];
  if (!operand_nodes(s, b->name, call->at, v, (SrcLoc[]){arg[0]->at, arg[1]->at}, 2, in))
    return ERR;
  return add_op(s, b->op, in, 2, NULL, NULL, call->at);
}

static Val builtin_reshape(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b;
  int x = val[0].v.node, n = val[1].n;
  const int64_t *d = val[1].ints;
  Shape sh = {.rank = n};
  int64_t known = 1;
  int infer = -1;
  for (int i = 0; i < n; i++) {
    if (d[i] == -1 && infer < 0) {
      infer = i;
      continue;
    }
    if (d[i] <= 0) {
      error_at(s, arg[1]->args[i]->at, d[i] == -1 ? "reshape: only one size may be -1"
                                                  : "reshape: sizes must be positive (or one -1), got %lld",
               (long long)d[i]);
      return ERR;
    }
    if (__builtin_mul_overflow(known, d[i], &known)) {
      error_at(s, arg[1]->at, "integer overflow in dimension arithmetic");
      return ERR;
    }
    sh.d[i] = d[i];
  }
  int64_t numel = shape_numel(node(s, x)->shape);
  if (infer >= 0) {
    if (numel % known) {
      error_at(s, call->at, "reshape: cannot reshape %s (%lld elements) to %s", shape_text(s, node(s, x)->shape),
               (long long)numel, shape_text(s, shape_of(n, d)));
      return ERR;
    }
    sh.d[infer] = numel / known;
  }
  return reshape(s, x, sh, call->at);
}

static Val builtin_permute(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b;
  int x = val[0].v.node, n = val[1].n;
  int64_t perm[8] = {0};
  memcpy(perm, val[1].ints, sizeof(int64_t) * (size_t)n);
  int r = node(s, x)->shape.rank;
  if (n != r) {
    error_at(s, arg[1]->at, "permute: %d axes given for a tensor of rank %d", n, r);
    return ERR;
  }
  for (int i = 0; i < n; i++)
    if (perm[i] < 0)
      perm[i] += r;
  return add_op(s, OP_PERMUTE, &x, 1, perm, NULL, call->at);
}

static Val builtin_transpose(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int r = node(s, x)->shape.rank;
  int64_t i, j, perm[8];
  if (!axis_arg(s, b, arg[1], &val[1], 0, r, call->at, &i) || !axis_arg(s, b, arg[2], &val[2], 0, r, call->at, &j))
    return ERR;
  if (i == j)
    return tensor_val(x);
  for (int k = 0; k < r; k++)
    perm[k] = k;
  perm[i] = j;
  perm[j] = i;
  return add_op(s, OP_PERMUTE, &x, 1, perm, NULL, call->at);
}

// split(x, n, axis=-1): n equal SLICEs, returned together for `a, b, c = split(...)`.
static Val builtin_split(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int64_t n = val[1].v.i, axis;
  Shape sh = node(s, x)->shape;
  if (!axis_arg(s, b, arg[2], &val[2], -1, sh.rank, call->at, &axis))
    return ERR;
  if (n <= 0 || n > 64) {
    error_at(s, arg[1]->at, "split: n must be between 1 and 64, got %lld", (long long)n);
    return ERR;
  }
  if (sh.d[axis] % n) {
    error_at(s, call->at, "split: size %lld of axis %lld is not divisible by %lld", (long long)sh.d[axis],
             (long long)axis, (long long)n);
    return ERR;
  }
  int64_t len = sh.d[axis] / n;
  Val t = {.kind = V_TUPLE, .ntuple = (int)n, .tuple = arena_alloc(s->a, sizeof(int) * (size_t)n)};
  for (int64_t i = 0; i < n; i++) {
    Val part = add_op(s, OP_SLICE, &x, 1, (int64_t[8]){axis, i * len, (i + 1) * len}, NULL, call->at);
    if (part.kind == V_ERR)
      return ERR;
    t.tuple[i] = part.node;
  }
  return t;
}

static Val builtin_concat(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  const int *in = val[0].nodes;
  int64_t axis;
  if (!axis_arg(s, b, arg[1], &val[1], -1, node(s, in[0])->shape.rank, call->at, &axis))
    return ERR;
  return add_op(s, OP_CONCAT, in, val[0].n, (int64_t[8]){axis}, NULL, call->at);
}

// topk(x, k, axis=-1): (values, indices i32), the k largest along the axis, largest first, ties by
// the lower index: TOPK gives the indices, a GATHER of x at them the values (the gradient's path).
static Val builtin_topk(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int64_t k = val[1].v.i, axis;
  Shape sh = node(s, x)->shape;
  if (!axis_arg(s, b, arg[2], &val[2], -1, sh.rank, call->at, &axis))
    return ERR;
  if (k < 1 || k > sh.d[axis]) {
    error_at(s, arg[1]->at, "topk: k must be between 1 and %lld (the size of axis %lld), got %lld",
             (long long)sh.d[axis], (long long)axis, (long long)k);
    return ERR;
  }
  Val idx = add_op(s, OP_TOPK, &x, 1, (int64_t[8]){axis, k}, NULL, call->at);
  if (idx.kind == V_ERR)
    return ERR;
  Val vals = add_op(s, OP_GATHER, (int[]){x, idx.node}, 2, (int64_t[8]){axis}, NULL, call->at);
  if (vals.kind == V_ERR)
    return ERR;
  Val t = {.kind = V_TUPLE, .ntuple = 2, .tuple = arena_alloc(s->a, sizeof(int) * 2), .topk = true};
  t.tuple[0] = vals.node;
  t.tuple[1] = idx.node;
  return t;
}

// gather(x, idx, axis=-1) and scatter_add(base, idx, src, axis=-1); the shapes are checked by the IR.
static Val builtin_gather(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  bool scatter = b->op == OP_SCATTER_ADD;
  int x = val[0].v.node, idx = val[1].v.node;
  int src = scatter ? val[2].v.node : 0;
  int64_t axis;
  if (!need_i32(s, b, idx, "idx", arg[1]->at))
    return ERR;
  int bad = node(s, x)->dtype != DT_F32 ? 0 : scatter && node(s, src)->dtype != DT_F32 ? 2 : -1;
  if (bad >= 0) {
    error_at(s, arg[bad]->at, "%s: %s must be f32, got i32", b->name, b->params[bad]);
    return ERR;
  }
  if (!axis_arg(s, b, arg[scatter ? 3 : 2], &val[scatter ? 3 : 2], -1, node(s, x)->shape.rank, call->at, &axis))
    return ERR;
  if (scatter)
    return add_op(s, OP_SCATTER_ADD, (int[]){x, idx, src}, 3, (int64_t[8]){axis}, NULL, call->at);
  return add_op(s, OP_GATHER, (int[]){x, idx}, 2, (int64_t[8]){axis}, NULL, call->at);
}

static Val builtin_embed(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int t = val[0].v.node, ids = val[1].v.node;
  if (!need_i32(s, b, ids, "ids", arg[1]->at))
    return ERR;
  return add_op(s, OP_EMBED, (int[]){t, ids}, 2, NULL, NULL, call->at);
}

// layernorm(x, w, b, eps=1e-5) and rmsnorm(x, w, eps=1e-5). A layernorm without b gets a zero bias.
static Val builtin_norm(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int layer = b->op == OP_LAYERNORM, eps_at = layer ? 3 : 2;
  int x = val[0].v.node, w = val[1].v.node;
  double eps = float_or(&val[eps_at], 1e-5);
  if (!(eps >= 0 && isfinite(eps))) {
    error_at(s, arg[eps_at]->at, "%s: eps must be finite and not negative, got %g", b->name, eps);
    return ERR;
  }
  int in[3] = {x, w, -1};
  if (layer && arg[2]) {
    in[2] = val[2].v.node;
  } else if (layer) {
    int zero = ir_const(s->g, 0, call->at);
    in[2] = zero < 0 ? -1 : ir_broadcast(s->g, zero, node(s, w)->shape, call->at);
    if (in[2] < 0)
      error_at(s, call->at, "%s", s->g->err);
  }
  if (layer && in[2] < 0)
    return ERR;
  return add_op(s, b->op, in, layer ? 3 : 2, NULL, (double[6]){eps}, call->at);
}

// x with axes `axis` and the last swapped (a PERMUTE; x itself when they are the same axis).
static int swap_last(Sema *s, int x, int64_t axis, SrcLoc at) {
  int r = node(s, x)->shape.rank;
  if (r == 0 || axis == r - 1)
    return x;
  int64_t perm[IR_NIA] = {0};
  for (int i = 0; i < r; i++)
    perm[i] = i;
  perm[axis] = r - 1;
  perm[r - 1] = axis;
  Val v = add_op(s, OP_PERMUTE, &x, 1, perm, NULL, at);
  return v.kind == V_ERR ? -1 : v.node;
}

// softmax(x, axis=-1): the SOFTMAX op works on the last axis; another axis is swapped there and back.
static Val builtin_softmax(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int r = node(s, x)->shape.rank;
  int64_t axis = r - 1;
  if (r > 0 && !axis_arg(s, b, arg[1], &val[1], -1, r, call->at, &axis))
    return ERR;
  int t = swap_last(s, x, axis, call->at);
  Val y = t < 0 ? ERR : add_op(s, OP_SOFTMAX, &t, 1, NULL, NULL, call->at);
  if (y.kind == V_ERR || t == x)
    return y;
  int back = swap_last(s, y.node, axis, call->at);
  return back < 0 ? ERR : tensor_val(back);
}

// log_softmax(x, axis=-1) = (x - m) - log(sum(exp(x - m))) over the axis, m its maximum taken as a
// constant (stop_gradient: the value does not depend on m, so neither does the gradient), so that
// exp never overflows and a large negative score keeps its value where log(softmax) would be -inf.
static Val builtin_log_softmax(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node;
  int r = node(s, x)->shape.rank;
  int64_t axis = 0;
  if (r == 0) {
    error_at(s, call->at, "log_softmax of a scalar");
    return ERR;
  }
  if (!axis_arg(s, b, arg[1], &val[1], -1, r, call->at, &axis))
    return ERR;
  SrcLoc at = call->at;
  Val m = add_op(s, OP_MAX, &x, 1, (int64_t[8]){axis, 1}, NULL, at);
  Val mc = m.kind == V_ERR ? ERR : add_op(s, OP_STOP_GRADIENT, &m.node, 1, NULL, NULL, at);
  Val y = mc.kind == V_ERR ? ERR : add_op(s, OP_SUB, (int[]){x, mc.node}, 2, NULL, NULL, at);
  Val e = y.kind == V_ERR ? ERR : add_op(s, OP_EXP, &y.node, 1, NULL, NULL, at);
  Val sum = e.kind == V_ERR ? ERR : add_op(s, OP_SUM, &e.node, 1, (int64_t[8]){axis, 1}, NULL, at);
  Val l = sum.kind == V_ERR ? ERR : add_op(s, OP_LOG, &sum.node, 1, NULL, NULL, at);
  return l.kind == V_ERR ? ERR : add_op(s, OP_SUB, (int[]){y.node, l.node}, 2, NULL, NULL, at);
}

// The mask of plain attention over t positions (doc: the doc ids node, or -1): built once, outside
// every repeat body, and shared by every attention that needs the same one (a model's layers).
static int attention_mask(Sema *s, int doc, int64_t t, bool causal, int64_t window, SrcLoc at) {
  for (int i = 0; i < s->masks.n; i++) {
    const Mask *m = s->masks.v[i];
    if (m->doc == doc && m->t == t && m->causal == causal && m->window == window)
      return m->node;
  }
  int body = s->g->cur_body;
  s->g->cur_body = 0;
  int id = ir_attention_mask(s->g, doc, t, causal, window, at);
  s->g->cur_body = body;
  if (id < 0) {
    error_at(s, at, "%s", s->g->err);
    return -1;
  }
  Mask *m = arena_alloc(s->a, sizeof *m);
  *m = (Mask){doc, t, causal, window, id};
  vec_push(s->a, &s->masks, m);
  return id;
}

// Attention's attributes (mdl.h: ATTENTION's ia[0], ia[1], ia[5], ia[6] and fa[0]).
typedef struct {
  int64_t heads, kv_heads, window;
  bool causal;
  double scale;
} AttnArgs;

// Attention lowered as an unfused framework runs it (LowerOptions.plain_attention): q [B,T,H*D] viewed
// as heads [B,T,H,D] and permuted to [B,H,T,D], k and v [B,S,KH*D] likewise to [B,KH,S,D]; with KH < H
// kv heads each is repeated for its H/KH query heads ([B,KH,1,S,D] broadcast to [B,KH,H/KH,S,D], a
// copy, as frameworks do); scores = q k^T * scale + mask, [B,H,T,S] in memory; P = softmax(scores);
// P v permuted back to [B,T,H*D]. in[3] is the doc ids node or -1.
static Val plain_attention(Sema *s, const int *in, AttnArgs a, SrcLoc at) {
  Graph *g = s->g;
  if (!ir_attention_fits(g, in[0], in[1], in[2], in[3], a.heads, a.kv_heads, a.causal, a.window)) {
    error_at(s, at, "%s", g->err);
    return ERR;
  }
  Shape x = node(s, in[0])->shape;
  int64_t nb = x.d[0], nt = x.d[1], ns = node(s, in[1])->shape.d[1], d = x.d[2] / a.heads;
  int64_t grp = a.heads / a.kv_heads;
  const int64_t to_heads[8] = {0, 2, 1, 3}; // [B,T,H,D] <-> [B,H,T,D] (its own inverse)
  int h[3];
  for (int i = 0; i < 3; i++) {
    int64_t rows = i ? ns : nt, nh = i ? a.kv_heads : a.heads;
    Val r = reshape(s, in[i], shape_of(4, (int64_t[]){nb, rows, nh, d}), at);
    if (r.kind == V_ERR)
      return ERR;
    Val p = add_op(s, OP_PERMUTE, &r.node, 1, to_heads, NULL, at);
    if (p.kind == V_ERR)
      return ERR;
    if (i && grp > 1) { // each kv head repeated for the query heads of its group
      p = reshape(s, p.node, shape_of(5, (int64_t[]){nb, a.kv_heads, 1, ns, d}), at);
      int bc = p.kind == V_ERR ? -1 : ir_broadcast(g, p.node, shape_of(5, (int64_t[]){nb, a.kv_heads, grp, ns, d}), at);
      if (bc < 0) {
        error_at(s, at, "%s", g->err);
        return ERR;
      }
      p = reshape(s, bc, shape_of(4, (int64_t[]){nb, a.heads, ns, d}), at);
      if (p.kind == V_ERR)
        return ERR;
    }
    h[i] = p.node;
  }
  Val sc = add_op(s, OP_MATMUL, (int[]){h[0], h[1]}, 2, (int64_t[8]){0, 1}, NULL, at);
  int c = sc.kind == V_ERR ? -1 : ir_const(g, a.scale, at);
  if (c < 0)
    return ERR;
  sc = add_op(s, OP_MUL, (int[]){sc.node, c}, 2, NULL, NULL, at);
  if (sc.kind != V_ERR && (a.causal || in[3] >= 0)) {
    int m = attention_mask(s, in[3], nt, a.causal, a.window, at);
    sc = m < 0 ? ERR : add_op(s, OP_ADD, (int[]){sc.node, m}, 2, NULL, NULL, at);
  }
  Val p = sc.kind == V_ERR ? ERR : add_op(s, OP_SOFTMAX, &sc.node, 1, NULL, NULL, at);
  Val o = p.kind == V_ERR ? ERR : add_op(s, OP_MATMUL, (int[]){p.node, h[2]}, 2, NULL, NULL, at);
  o = o.kind == V_ERR ? ERR : add_op(s, OP_PERMUTE, &o.node, 1, to_heads, NULL, at);
  return o.kind == V_ERR ? ERR : reshape(s, o.node, x, at);
}

static Val builtin_attention(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int in[4] = {val[0].v.node, val[1].v.node, val[2].v.node, val[5].v.node};
  AttnArgs a = {.heads = val[3].v.i, .causal = bool_or(&val[4], false)};
  a.kv_heads = int_or(&val[7], a.heads);
  a.window = int_or(&val[8], 0);
  if (arg[5] && !need_i32(s, b, in[3], "doc", arg[5]->at))
    return ERR;
  if (arg[7] && a.kv_heads <= 0) {
    error_at(s, arg[7]->at, "attention: kv_heads must be at least 1, got %lld", (long long)a.kv_heads);
    return ERR;
  }
  if (arg[8] && a.window <= 0) {
    error_at(s, arg[8]->at, "attention: window must be at least 1, got %lld", (long long)a.window);
    return ERR;
  }
  if (arg[8] && !a.causal) {
    error_at(s, arg[8]->at, "attention: window=%lld needs causal=true", (long long)a.window);
    return ERR;
  }
  Shape q = node(s, in[0])->shape;
  int64_t c = q.rank == 3 ? q.d[2] : 0;
  a.scale = float_or(&val[6], a.heads > 0 && c % a.heads == 0 ? 1 / sqrt((double)(c / a.heads)) : 1);
  bool doc = arg[5] && !s->lower.no_doc_mask; // (--no-doc-mask: the ids are checked, then ignored)
  // (the window stays as written even where it holds all T rows: a graph of one token decodes with a
  // cache of earlier positions, interp.c)
  if (!ir_attention_fits(s->g, in[0], in[1], in[2], arg[5] ? in[3] : -1, a.heads, a.kv_heads, a.causal, a.window)) {
    error_at(s, call->at, "%s", s->g->err);
    return ERR;
  }
  if (s->lower.plain_attention) {
    in[3] = doc ? in[3] : -1;
    return plain_attention(s, in, a, call->at);
  }
  int64_t kvh = a.kv_heads == a.heads ? 0 : a.kv_heads; // (0: one kv head per head, mdl.h)
  return add_op(s, OP_ATTENTION, in, doc ? 4 : 3, (int64_t[8]){a.heads, a.causal, doc, 0, 0, kvh, a.window},
                (double[6]){a.scale}, call->at);
}

static Val builtin_rope(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node, pos = val[1].v.node;
  if (!need_i32(s, b, pos, "pos", arg[1]->at))
    return ERR;
  int64_t heads = val[2].v.i;
  double base = float_or(&val[3], 10000);
  if (!(base > 0 && isfinite(base))) {
    error_at(s, arg[3]->at, "rope: base must be positive and finite, got %g", base);
    return ERR;
  }
  return add_op(s, OP_ROPE, (int[]){x, pos}, 2, (int64_t[8]){heads, 0}, (double[6]){base}, call->at);
}

static Val builtin_cross_entropy(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int l = val[0].v.node, t = val[1].v.node;
  if (!need_i32(s, b, t, "targets", arg[1]->at))
    return ERR;
  return add_op(s, OP_CROSS_ENTROPY, (int[]){l, t}, 2, NULL, NULL, call->at);
}

// x shifted by s positions along axis 1 of [B, T, C], zeros coming in: element t of the result is
// x[t + s] where 0 <= t + s < T, else 0 (|s| < T). A SLICE and a CONCAT with a zero BROADCAST.
static int shifted(Sema *s, int x, int64_t by, SrcLoc at) {
  if (by == 0)
    return x;
  Shape sh = node(s, x)->shape, pad = sh;
  int64_t t = sh.d[1], n = by < 0 ? -by : by;
  pad.d[1] = n;
  int zero = ir_const(s->g, 0, at);
  int zeros = zero < 0 ? -1 : ir_broadcast(s->g, zero, pad, at);
  if (zeros < 0) {
    error_at(s, at, "%s", s->g->err);
    return -1;
  }
  Val part = add_op(s, OP_SLICE, &x, 1, (int64_t[8]){1, by < 0 ? 0 : n, by < 0 ? t - n : t}, NULL, at);
  if (part.kind == V_ERR)
    return -1;
  Val r = add_op(s, OP_CONCAT, by < 0 ? (int[]){zeros, part.node} : (int[]){part.node, zeros}, 2, (int64_t[8]){1},
                 NULL, at);
  return r.kind == V_ERR ? -1 : r.node;
}

// conv1d(x, w, b, causal=false): a 1-D convolution over the T axis of x [B, T, Cin], of the same
// length T (zeros beyond either end), as PyTorch's conv1d computes it (cross-correlation):
//   y[t] = sum_k w[k] . x[t + k - left] (+ b),  left = K - 1 when causal (y[t] sees x[t - K + 1 .. t]),
//   else (K - 1) / 2 rounded down ('same' padding, the extra tap of an even K on the right).
// w [K, Cin, Cout] is a full convolution (y [B, T, Cout]); w [K, C] a depthwise one, each channel its
// own filter (y [B, T, C]). b [Cout] is optional. Lowered to ops the back ends have (so autodiff
// and fusion come for free): per tap, x shifted (a SLICE and a CONCAT with zeros); a depthwise
// convolution sums the taps times their rows of w; a full one concatenates the K shifted copies
// along the channels and multiplies them by w viewed as [K * Cin, Cout], one GEMM.
static Val builtin_conv1d(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  int x = val[0].v.node, w = val[1].v.node;
  int bias = arg[2] ? val[2].v.node : -1;
  bool causal = bool_or(&val[3], false);
  Shape xs = node(s, x)->shape, ws = node(s, w)->shape;
  if (xs.rank != 3) {
    error_at(s, arg[0]->at, "conv1d: x must be [B, T, C], got %s", shape_text(s, xs));
    return ERR;
  }
  int64_t t = xs.d[1], cin = xs.d[2], k = ws.d[0];
  if (ws.rank != 2 && ws.rank != 3) {
    error_at(s, arg[1]->at, "conv1d: w must be [K, Cin, Cout] (a full convolution) or [K, C] (depthwise), got %s",
             shape_text(s, ws));
    return ERR;
  }
  if (ws.d[1] != cin) {
    error_at(s, arg[1]->at, "conv1d: w %s has %lld input channels, x %s has %lld", shape_text(s, ws),
             (long long)ws.d[1], shape_text(s, xs), (long long)cin);
    return ERR;
  }
  if (k > 64) { // (a full convolution concatenates K parts; the emitters read at most 64 at once)
    error_at(s, arg[1]->at, "conv1d: %lld taps; at most 64 (this lowering is for short convolutions)", (long long)k);
    return ERR;
  }
  int64_t cout = ws.rank == 3 ? ws.d[2] : cin;
  if (bias >= 0 && (node(s, bias)->shape.rank != 1 || node(s, bias)->shape.d[0] != cout)) {
    error_at(s, arg[2]->at, "conv1d: b must be [%lld] (the output channels), got %s", (long long)cout,
             shape_text(s, node(s, bias)->shape));
    return ERR;
  }
  for (int i = 0; i < 3; i++) {
    int v = i == 0 ? x : i == 1 ? w : bias;
    if (v >= 0 && node(s, v)->dtype != DT_F32) {
      error_at(s, arg[i]->at, "conv1d: %s must be f32, got %s", b->params[i], dtype_name(node(s, v)->dtype));
      return ERR;
    }
  }
  int64_t left = causal ? k - 1 : (k - 1) / 2;
  int *taps = arena_alloc(s->a, sizeof(int) * (size_t)k);
  int y = -1;
  for (int64_t j = 0; j < k; j++) {
    int64_t by = j - left; // tap j reads x[t + by]; one that only ever reads zeros is left out (-1)
    bool outside = by <= -t || by >= t;
    taps[j] = -1;
    if (!outside && (taps[j] = shifted(s, x, by, call->at)) < 0)
      return ERR;
    if (ws.rank == 3 || taps[j] < 0)
      continue;
    Val row = add_op(s, OP_SLICE, &w, 1, (int64_t[8]){0, j, j + 1}, NULL, call->at);
    Val term = row.kind == V_ERR ? ERR : add_op(s, OP_MUL, (int[]){taps[j], row.node}, 2, NULL, NULL, call->at);
    if (term.kind == V_ERR)
      return ERR;
    Val sum = y < 0 ? term : add_op(s, OP_ADD, (int[]){y, term.node}, 2, NULL, NULL, call->at);
    if (sum.kind == V_ERR)
      return ERR;
    y = sum.node;
  }
  if (ws.rank == 3) { // [B, T, K * Cin] (the taps that read nothing but zeros as zeros) @ [K * Cin, Cout]
    int zeros = -1;
    for (int64_t j = 0; j < k; j++) {
      if (taps[j] >= 0)
        continue;
      int zero = zeros >= 0 ? zeros : ir_const(s->g, 0, call->at);
      zeros = zero < 0 || zeros >= 0 ? zeros : ir_broadcast(s->g, zero, xs, call->at);
      if (zeros < 0) {
        error_at(s, call->at, "%s", s->g->err);
        return ERR;
      }
      taps[j] = zeros;
    }
    Val cols = k == 1 ? tensor_val(taps[0]) : add_op(s, OP_CONCAT, taps, (int)k, (int64_t[8]){2}, NULL, call->at);
    Val flat = cols.kind == V_ERR ? ERR
                                  : reshape(s, cols.node, (Shape){.rank = 2, .d = {xs.d[0] * t, k * cin}}, call->at);
    Val wf = reshape(s, w, (Shape){.rank = 2, .d = {k * cin, cout}}, call->at);
    Val prod = flat.kind == V_ERR || wf.kind == V_ERR
                   ? ERR
                   : add_op(s, OP_MATMUL, (int[]){flat.node, wf.node}, 2, (int64_t[8]){0, 0}, NULL, call->at);
    Val out = prod.kind == V_ERR ? ERR : reshape(s, prod.node, (Shape){.rank = 3, .d = {xs.d[0], t, cout}}, call->at);
    if (out.kind == V_ERR)
      return ERR;
    y = out.node;
  } // (the tap at x[t] itself is always there: y >= 0)
  if (bias < 0)
    return tensor_val(y);
  return add_op(s, OP_ADD, (int[]){y, bias}, 2, NULL, NULL, call->at);
}

// Each dropout gets its own random stream: its index among the graph's dropouts, from 1.
static Val builtin_dropout(Sema *s, const Builtin *b, const Expr *call, const Expr **arg, const Arg *val) {
  (void)b, (void)arg;
  int x = val[0].v.node;
  double p = float_or(&val[1], 0.1);
  return add_op(s, OP_DROPOUT, &x, 1, (int64_t[8]){++s->dropouts}, (double[6]){p}, call->at);
}

static const Builtin builtins[] = {
    {"gelu", 1, 1, {"x"}, builtin_unary, OP_GELU, "n", NULL},
    {"relu", 1, 1, {"x"}, builtin_unary, OP_RELU, "n", NULL},
    {"silu", 1, 1, {"x"}, builtin_unary, OP_SILU, "n", NULL},
    {"sigmoid", 1, 1, {"x"}, builtin_unary, OP_SIGMOID, "n", NULL},
    {"abs", 1, 1, {"x"}, builtin_unary, OP_ABS, "n", NULL},
    {"clamp", 1, 1, {"x", "min", "max"}, builtin_clamp, OP_CLAMP, "t f f", NULL},
    {"stop_gradient", 1, 1, {"x"}, builtin_unary, OP_STOP_GRADIENT, "n", NULL},
    {"where", 3, 3, {"cond", "a", "b"}, builtin_where, OP_WHERE, "n n n", NULL},
    {"float", 1, 1, {"x"}, builtin_cast, OP_CAST, "n", NULL},
    {"int", 1, 1, {"x"}, builtin_cast, OP_CAST, "n", NULL},
    {"exp", 1, 1, {"x"}, builtin_unary, OP_EXP, "n", NULL},
    {"log", 1, 1, {"x"}, builtin_unary, OP_LOG, "n", NULL},
    {"tanh", 1, 1, {"x"}, builtin_unary, OP_TANH, "n", NULL},
    {"sqrt", 1, 1, {"x"}, builtin_unary, OP_SQRT, "n", NULL},
    {"rsqrt", 1, 1, {"x"}, builtin_unary, OP_RSQRT, "n", NULL},
    {"neg", 1, 1, {"x"}, builtin_unary, OP_NEG, "n", NULL},
    {"sum", 1, 1, {"x", "axis", "keepdim"}, builtin_reduce, OP_SUM, "t i b", NULL},
    {"mean", 1, 1, {"x", "axis", "keepdim"}, builtin_reduce, OP_MEAN, "t i b", NULL},
    {"max", 1, 2, {"x", "y", "axis", "keepdim"}, builtin_minmax, OP_MAXIMUM, "v v i b", minmax_form},
    {"min", 1, 2, {"x", "y", "axis", "keepdim"}, builtin_minmax, OP_MINIMUM, "v v i b", minmax_form},
    {"reshape", 2, 2, {"x", "shape"}, builtin_reshape, OP_RESHAPE, "t I", NULL},
    {"permute", 2, 2, {"x", "axes"}, builtin_permute, OP_PERMUTE, "t I", NULL},
    {"transpose", 3, 3, {"x", "a", "b"}, builtin_transpose, OP_PERMUTE, "t i i", NULL},
    {"split", 2, 2, {"x", "n", "axis"}, builtin_split, OP_SLICE, "t i i", NULL},
    {"concat", 1, 1, {"xs", "axis"}, builtin_concat, OP_CONCAT, "T i", NULL},
    {"embed", 2, 2, {"table", "ids"}, builtin_embed, OP_EMBED, "tt", NULL},
    {"topk", 2, 2, {"x", "k", "axis"}, builtin_topk, OP_TOPK, "t i i", NULL},
    {"gather", 2, 2, {"x", "idx", "axis"}, builtin_gather, OP_GATHER, "tt i", NULL},
    {"scatter_add", 3, 3, {"base", "idx", "src", "axis"}, builtin_gather, OP_SCATTER_ADD, "ttt i", NULL},
    {"layernorm", 2, 3, {"x", "w", "b", "eps"}, builtin_norm, OP_LAYERNORM, "tt t f", NULL},
    {"rmsnorm", 2, 2, {"x", "w", "eps"}, builtin_norm, OP_RMSNORM, "tt f", NULL},
    {"softmax", 1, 1, {"x", "axis"}, builtin_softmax, OP_SOFTMAX, "t i", NULL},
    {"log_softmax", 1, 1, {"x", "axis"}, builtin_log_softmax, OP_SOFTMAX, "t i", NULL},
    {"attention", 3, 3, {"q", "k", "v", "heads", "causal", "doc", "scale", "kv_heads", "window"}, builtin_attention,
     OP_ATTENTION, "t t t r b t f i i", NULL},
    {"rope", 2, 2, {"x", "pos", "heads", "base"}, builtin_rope, OP_ROPE, "tt r f", NULL},
    {"cross_entropy", 2, 2, {"logits", "targets"}, builtin_cross_entropy, OP_CROSS_ENTROPY, "tt", NULL},
    {"dropout", 1, 1, {"x", "p"}, builtin_dropout, OP_DROPOUT, "t f", NULL},
    {"conv1d", 2, 3, {"x", "w", "b", "causal"}, builtin_conv1d, OP_MATMUL, "ttt b", NULL},
};

// The builtin a call names; NULL when there is none (reported).
static const Builtin *find_builtin(Sema *s, const Expr *e) {
  for (size_t i = 0; i < sizeof builtins / sizeof *builtins; i++)
    if (!strcmp(builtins[i].name, e->s))
      return &builtins[i];
  if (!strcmp(e->s, "normal"))
    error_at(s, e->at, "normal(std) initialises a param: param NAME: [shape] = normal(std)");
  else {
    Nearest near = {e->s, NULL, 3};
    for (size_t i = 0; i < sizeof builtins / sizeof *builtins; i++)
      consider(&near, builtins[i].name);
    error_at(s, e->at, "unknown op '%s'%s", e->s, did_you_mean(s, &near));
  }
  return NULL;
}

static Val call(Sema *s, const Expr *e) {
  const Builtin *b = find_builtin(s, e);
  const Expr *arg[BUILTIN_PARAMS];
  Arg val[BUILTIN_PARAMS];
  if (!b || !bind_args(s, b, e, arg) || (b->form && !b->form(s, b, arg)) || !eval_args(s, b, e, arg, val))
    return ERR;
  return b->fn(s, b, e, arg, val);
}

static Val name_value(Sema *s, const Expr *e) {
  Sym *y = lookup(s, e->s);
  if (!y) {
    unknown_name(s, e);
    return ERR;
  }
  if (y->kind == SYM_DIM || y->kind == SYM_CONST)
    return sym_value(s, y, e->at);
  if (y->kind == SYM_INDEX)
    return y->val;
  if (y->kind == SYM_REPEAT) {
    error_at(s, e->at, "'%s' names a repeat block, not a value", e->s);
    return ERR;
  }
  if (s->constant) {
    error_at(s, e->at, "'%s' is %s; only dims and consts can be used here", e->s, a_sym_kind[y->kind]);
    return ERR;
  }
  return y->val;
}

static Val eval_expr(Sema *s, const Expr *e) {
  switch (e->kind) {
  case E_INT: return int_val(e->i);
  case E_FLOAT: return float_val(e->f);
  case E_BOOL: return (Val){.kind = V_BOOL, .i = e->i};
  case E_NAME: return name_value(s, e);
  case E_BINARY: return binary(s, e);
  case E_NEG: return negate(s, e);
  case E_ATTR: return attr(s, e);
  case E_CALL: return call(s, e);
  case E_INDEX: return index_expr(s, e);
  case E_STRING: error_at(s, e->at, "a string is only allowed in the train section's no_decay list"); break;
  case E_SIZE: error_at(s, e->at, "a size is only allowed in the train section's checkpoint = auto(SIZE)"); break;
  case E_LIST: error_at(s, e->at, "a list is not a value; lists are arguments of reshape, permute and concat"); break;
  case E_DICT: error_at(s, e->at, "a {key: value} table is only allowed in the train section's lr_scale"); break;
  case E_SLICE: error_at(s, e->at, "a slice a:b only goes inside x[...]"); break;
  case E_KWARG: error_at(s, e->at, "'%s = ...' is only allowed as a call's argument", e->s); break;
  }
  return ERR;
}

//
// Dims and consts
//

// The value of a dim: -D, else its expression (fixed) or its train-section binding (free), with
// the bounds of a free dim checked.
static Val dim_value(Sema *s, Sym *d) {
  const Stmt *st = d->decl;
  const Expr *e = st->value ? st->value : d->bind;
  if (!d->overridden && !e) {
    error_at(s, st->at, "dim '%s' is not bound: set it in the train section or with -D %s=N", d->name, d->name);
    return ERR;
  }
  Val v = d->overridden ? int_val(d->override) : eval(s, e);
  SrcLoc at = d->overridden ? st->at : e->at;
  if (v.kind == V_ERR)
    return ERR;
  if (v.kind != V_INT) {
    error_at(s, at, "dim '%s' must be an integer, got %s", d->name, describe(v));
    return ERR;
  }
  if (st->value)
    return v;
  int64_t lo, hi;
  if (!int_of(s, st->lo, "a dim bound", &lo) || !int_of(s, st->hi, "a dim bound", &hi))
    return ERR;
  if (v.i < lo || v.i > hi) {
    if (d->overridden)
      error_at(s, st->at, "dim '%s' = %lld (from -D %s=%lld) is out of bounds %lld..%lld", d->name, (long long)v.i,
               d->name, (long long)v.i, (long long)lo, (long long)hi);
    else
      error_at(s, at, "dim '%s' = %lld is out of bounds %lld..%lld", d->name, (long long)v.i, (long long)lo,
               (long long)hi);
    return ERR;
  }
  return v;
}

// Evaluates a dim or const on first use; a use while it is being evaluated closes a cycle.
// Evaluation recurses through nested expressions and the dims and consts they name; a depth limit
// turns a pathological text (a chain of 100000 additions or of dims naming the next) into one
// error instead of a stack overflow.
static Val eval(Sema *s, const Expr *e) {
  if (s->too_deep) // reported once; what is left of the text is likely the same again
    return ERR;
  if (s->depth >= SEMA_MAX_DEPTH) {
    error_at(s, e->at, "nesting too deep: more than %d levels of expressions and the dims they name", SEMA_MAX_DEPTH);
    s->too_deep = true;
    return ERR;
  }
  s->depth++;
  Val v = eval_expr(s, e);
  s->depth--;
  return v;
}

static Val sym_value(Sema *s, Sym *y, SrcLoc use) {
  if (y->state == DONE)
    return y->val;
  if (y->state == EVALUATING) {
    int k = s->stack.n - 1;
    while (k > 0 && s->stack.v[k] != y)
      k--;
    char path[512] = "";
    for (int i = k; i < s->stack.n; i++)
      snprintf(path + strlen(path), sizeof path - strlen(path), "%s -> ", ((Sym *)s->stack.v[i])->name);
    error_at(s, use, "reference cycle: %s%s", path, y->name);
    return ERR;
  }
  y->state = EVALUATING;
  vec_push(s->a, &s->stack, y);
  bool saved = s->constant;
  s->constant = true;
  Val v = y->kind == SYM_DIM ? dim_value(s, y) : eval(s, y->decl->value);
  s->constant = saved;
  s->stack.n--;
  y->val = v;
  y->state = DONE;
  return v;
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
      error_at(s, st->at, "'%s' is not allowed inside a repeat block", stmt_keyword(st->kind));
      st->rejected = true;
    }
  }
}

static void reject_duplicate(Sema *s, Stmt *st, const Stmt *old) {
  bool printed = st->kind == S_MODEL   ? error_at(s, st->at, "duplicate model statement: a file defines one model")
                 : st->kind == S_TRAIN ? error_at(s, st->at, "duplicate train section")
                                       : error_at(s, st->at, "duplicate definition of '%s'", st->name);
  if (printed)
    diag_note(old->at, "previous definition is here");
  st->rejected = true;
}

// Step 1 over the top-level statements; returns the train section, if any.
static const Stmt *declare(Sema *s) {
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
        Sym *y = add_sym(s, &s->global, st->name, st->kind == S_DIM ? SYM_DIM : SYM_CONST, st->at);
        y->decl = st;
        vec_push(s->a, st->kind == S_DIM ? &s->dims : &s->consts, y);
      }
      break;
    case S_ASSIGN: break;
    }
  }
  scan_body(s, (Stmt **)s->p->stmts.v, s->p->stmts.n, NULL);
  if (!model)
    error_at(s, (SrcLoc){.file = s->p->file, .text = s->p->text, .line = 1, .col = 1},
             "no model statement: a .mdl file starts with 'model NAME'");
  else
    s->g->model = model->name;
  for (int i = 0; train && i < train->nbody; i++) {
    Stmt *st = train->body[i];
    if (st->kind != S_ASSIGN || st->nnames != 1) {
      error_at(s, st->at, "only settings such as 'B = 8' are allowed in the train section");
      st->rejected = true;
    }
  }
  return train;
}

//
// Step 2: dims
//

static const char *const train_keys[] = {"optimizer", "schedule", "no_decay", "clip", "accumulate", "precision",
                                         "checkpoint", "lr_scale", "freeze", "muon_params", "amax_history"};

// The schedules' arguments (schedule_setting): `--set warmup=100` sets the schedule's, any other
// argument name the optimizer's.
static const char *const schedule_args[] = {"warmup", "min_lr", "steps", "decay"};

static bool is_train_key(const char *name) {
  for (size_t k = 0; k < sizeof train_keys / sizeof *train_keys; k++)
    if (!strcmp(train_keys[k], name))
      return true;
  return false;
}

// The train setting `key`, or NULL.
static Setting *find_setting(Sema *s, const char *key) {
  for (int i = 0; i < s->settings.n; i++)
    if (!strcmp(((Setting *)s->settings.v[i])->key, key))
      return s->settings.v[i];
  return NULL;
}

// A free dim's binding from the train section or --set (st); false when `name` is no dim.
static bool bind_dim(Sema *s, const Stmt *st, const char *where) {
  Sym *d = find_in(&s->global, st->name);
  if (!d || d->kind != SYM_DIM)
    return false;
  if (d->decl->value) {
    if (error_at(s, st->at, "'%s' is a fixed dim; only free dims (dim %s in LO..HI) are set %s", st->name, st->name,
                 where))
      diag_note(d->at, "'%s' is defined here", st->name);
  } else {
    d->bind = st->value;
  }
  return true;
}

// `--set KEY=VALUE` (st: KEY = VALUE parsed on its own) over the train section: a free dim's binding
// or a setting replaces the train section's; an argument of the optimizer or the schedule replaces
// or joins that call's keyword arguments (adamw and constant when the train section names none), so
// it is checked as though the train section said it.
static void apply_set(Sema *s, const Stmt *st) {
  if (bind_dim(s, st, "with --set"))
    return;
  if (is_train_key(st->name)) {
    Setting *set = find_setting(s, st->name);
    if (!set) {
      set = arena_alloc(s->a, sizeof *set);
      vec_push(s->a, &s->settings, set);
    }
    *set = (Setting){.key = st->name, .value = st->value, .at = st->at};
    return;
  }
  const char *key = "optimizer", *dflt = "adamw";
  for (size_t k = 0; k < sizeof schedule_args / sizeof *schedule_args; k++)
    if (!strcmp(schedule_args[k], st->name))
      key = "schedule", dflt = "constant";
  Setting *set = find_setting(s, key);
  if (!set) {
    Expr *name = arena_alloc(s->a, sizeof *name);
    *name = (Expr){.kind = E_NAME, .s = dflt, .at = st->at};
    set = arena_alloc(s->a, sizeof *set);
    *set = (Setting){.key = key, .value = name, .at = st->at};
    vec_push(s->a, &s->settings, set);
  }
  const Expr *old = set->value;
  if (old->kind != E_NAME && old->kind != E_CALL) { // (train_config says what is wrong with it)
    error_at(s, st->at, "--set %s: the %s setting is not a call to add '%s' to", st->name, key, st->name);
    return;
  }
  Expr *call = arena_alloc(s->a, sizeof *call);
  *call = *old;
  call->kind = E_CALL;
  int n = old->kind == E_CALL ? old->nargs : 0;
  call->args = arena_alloc(s->a, sizeof(Expr *) * (size_t)(n + 1));
  call->kw = arena_alloc(s->a, sizeof(char *) * (size_t)(n + 1));
  call->kw_at = arena_alloc(s->a, sizeof(SrcLoc) * (size_t)(n + 1));
  call->nargs = 0;
  for (int i = 0; i < n; i++)
    if (!old->kw[i] || strcmp(old->kw[i], st->name)) {
      call->args[call->nargs] = old->args[i];
      call->kw[call->nargs] = old->kw[i];
      call->kw_at[call->nargs++] = old->kw_at[i];
    }
  call->args[call->nargs] = st->value;
  call->kw[call->nargs] = st->name;
  call->kw_at[call->nargs++] = st->at;
  set->value = call;
}

// Step 2: sorts the train section into free-dim bindings and settings, applies --set and then -D
// over both, then evaluates every dim (filling g->dims) and every const, so each error shows even
// when unused.
static void bind_dims(Sema *s, const Stmt *train, const PtrVec *sets, const DimOverride *ov, int nov) {
  for (int i = 0; train && i < train->nbody; i++) {
    const Stmt *st = train->body[i];
    if (st->rejected)
      continue;
    bool seen = false;
    for (int k = 0; k < i && !seen; k++)
      if (!train->body[k]->rejected && !strcmp(train->body[k]->name, st->name)) {
        if (error_at(s, st->at, "duplicate definition of '%s'", st->name))
          diag_note(train->body[k]->at, "previous definition is here");
        seen = true;
      }
    if (seen || bind_dim(s, st, "in the train section"))
      continue;
    if (!is_train_key(st->name)) {
      error_at(s, st->at, "unknown train setting '%s' (settings: free dims, optimizer, schedule, no_decay, "
                          "lr_scale, freeze, muon_params, clip, accumulate, precision, amax_history, checkpoint)", st->name);
      continue;
    }
    Setting *set = arena_alloc(s->a, sizeof *set);
    *set = (Setting){.key = st->name, .value = st->value, .at = st->at};
    vec_push(s->a, &s->settings, set);
  }
  for (int i = 0; i < sets->n; i++)
    apply_set(s, sets->v[i]);
  for (int i = 0; i < nov; i++) {
    Sym *d = find_in(&s->global, ov[i].name);
    if (!d || d->kind != SYM_DIM) {
      error_at(s, (SrcLoc){.file = s->p->file}, "-D %s=%lld: the model has no dim '%s'", ov[i].name,
               (long long)ov[i].value, ov[i].name);
      continue;
    }
    d->overridden = true;
    d->override = ov[i].value;
  }
  Graph *g = s->g;
  g->dims = arena_alloc(s->a, sizeof(DimBinding) * (size_t)(s->dims.n ? s->dims.n : 1));
  for (int i = 0; i < s->dims.n; i++) {
    Sym *d = s->dims.v[i];
    Val v = sym_value(s, d, d->at), own = d->overridden && d->decl->value ? eval(s, d->decl->value) : v;
    g->dims[g->ndims++] = (DimBinding){d->name, v.kind == V_INT ? v.i : 0, own.kind == V_INT ? own.i : 0};
  }
  for (int i = 0; i < s->consts.n; i++) {
    Sym *c = s->consts.v[i];
    sym_value(s, c, c->at);
  }
}

//
// Step 3: the train section
//

typedef enum { R_POSITIVE, R_NONNEG, R_UNIT } Range;

// A number setting in range r (an integer where `integer`), finite and within a float's range: the
// step computes with it in f32.
static bool number(Sema *s, const Expr *e, const char *what, Range r, bool integer, double *out) {
  Val v = eval_const(s, e);
  if (v.kind == V_ERR)
    return false;
  if (v.kind != V_INT && (integer || v.kind != V_FLOAT)) {
    error_at(s, e->at, "%s must be %s, got %s", what, integer ? "an integer" : "a number", describe(v));
    return false;
  }
  double x = v.kind == V_INT ? (double)v.i : v.f;
  static const char *const want[] = {"positive", "at least 0", "in [0, 1)"};
  if ((r == R_POSITIVE && !(x > 0)) || (r == R_NONNEG && !(x >= 0)) || (r == R_UNIT && !(x >= 0 && x < 1))) {
    error_at(s, e->at, "%s must be %s, got %g", what, want[r], x);
    return false;
  }
  if (!(x <= FLT_MAX)) {
    error_at(s, e->at, "%s must be finite and at most %g (a float's largest), got %g", what, FLT_MAX, x);
    return false;
  }
  *out = x;
  return true;
}

// NAME or NAME(keyword=value, ...) in the train section; arg[k] as bind_args.
static bool train_call(Sema *s, const Builtin *b, const Expr *e, const char *setting, const char *names,
                       const Expr **arg) {
  if (e->kind == E_NAME && !strcmp(e->s, b->name)) {
    for (int k = 0; k < 8; k++)
      arg[k] = NULL;
    return true;
  }
  if (e->kind == E_CALL && !strcmp(e->s, b->name))
    return bind_args(s, b, e, arg);
  error_at(s, e->at, "unknown %s '%s' (available: %s)", setting,
           e->kind == E_NAME || e->kind == E_CALL ? e->s : ast_text(s->a, e->at.text, e), names);
  return false;
}

// A setting whose value is one of a few bare words, such as `precision = bf16`.
static const char *word(Sema *s, const Expr *e, const char *setting, const char *const *choices, int n) {
  for (int i = 0; e->kind == E_NAME && i < n; i++)
    if (!strcmp(e->s, choices[i]))
      return choices[i];
  char list[128] = "";
  for (int i = 0; i < n; i++)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? (i + 1 < n ? ", " : " or ") : "", choices[i]);
  error_at(s, e->at, "unknown %s '%s' (expected %s)", setting, ast_text(s->a, e->at.text, e), list);
  return NULL;
}

static void checkpoint_setting(Sema *s, const Expr *e, TrainConfig *t) {
  static const char *const modes[] = {"none", "all", "auto"};
  if (e->kind == E_CALL && !strcmp(e->s, "auto")) {
    static const Builtin b = {"auto", 1, 1, {"budget"}, NULL, OP_COUNT, NULL, NULL};
    const Expr *arg[BUILTIN_PARAMS];
    if (!bind_args(s, &b, e, arg))
      return;
    if (arg[0]->kind == E_FLOAT && arg[0]->f > 0 && arg[0]->f <= 1) { // a fraction of the memory there is
      t->checkpoint = arena_printf(s->a, "auto=%s", ast_text(s->a, arg[0]->at.text, arg[0]));
      t->checkpoint_at = e->at;
      return;
    }
    if (arg[0]->kind != E_SIZE || strtod(arg[0]->s, NULL) <= 0) {
      error_at(s, arg[0]->at, "checkpoint budget must be a positive size such as 2GiB, or a fraction of the memory "
               "such as 0.5");
      return;
    }
    t->checkpoint = arena_printf(s->a, "auto=%s", arg[0]->s);
    t->checkpoint_at = e->at;
    return;
  }
  const char *w = word(s, e, "checkpoint mode", modes, 3);
  if (w) {
    t->checkpoint = w;
    t->checkpoint_at = e->at;
  }
}

// schedule = constant | linear | cosine | wsd, each NAME or NAME(warmup=, ...): runtime/train/schedule.c.
static void schedule_setting(Sema *s, const Expr *e, TrainConfig *t) {
  static const Builtin kinds[] = {{"constant", 0, 0, {"warmup"}, NULL, OP_COUNT, NULL, NULL},
                                  {"linear", 0, 0, {"warmup", "min_lr", "steps"}, NULL, OP_COUNT, NULL, NULL},
                                  {"cosine", 0, 0, {"warmup", "min_lr", "steps"}, NULL, OP_COUNT, NULL, NULL},
                                  {"wsd", 0, 0, {"warmup", "decay", "min_lr", "steps"}, NULL, OP_COUNT, NULL, NULL}};
  static const Schedule kind_of[] = {SCHED_CONSTANT, SCHED_LINEAR, SCHED_COSINE, SCHED_WSD};
  int k = 2; // (an unknown name: the error lists them all)
  for (int i = 0; i < 4; i++)
    if ((e->kind == E_NAME || e->kind == E_CALL) && !strcmp(e->s, kinds[i].name))
      k = i;
  const Builtin *b = &kinds[k];
  const Expr *arg[BUILTIN_PARAMS];
  if (!train_call(s, b, e, "schedule", "constant, linear, cosine or wsd", arg))
    return;
  t->schedule = kind_of[k];
  double x;
  for (int i = 0; i < 4 && b->params[i]; i++) {
    const char *p = b->params[i];
    if (!arg[i])
      continue;
    if (!strcmp(p, "warmup") && number(s, arg[i], p, R_NONNEG, true, &x))
      t->warmup = (int64_t)x;
    else if (!strcmp(p, "min_lr") && number(s, arg[i], p, R_NONNEG, false, &x))
      t->min_lr = x;
    else if (!strcmp(p, "steps") && number(s, arg[i], p, R_NONNEG, true, &x))
      t->steps = (int64_t)x;
    else if (!strcmp(p, "decay") && number(s, arg[i], p, R_POSITIVE, false, &x)) {
      if (x >= 1 && x != floor(x))
        error_at(s, arg[i]->at, "decay must be a number of steps (an integer) or a fraction of the steps below 1, "
                 "got %g", x);
      else
        t->decay = x;
    }
  }
  if (t->schedule == SCHED_WSD && !arg[1])
    t->decay = 0.2;
}

// optimizer = adamw | sgd | lion | muon, each NAME or NAME(keyword=value, ...); the rules are
// docs/language.md's and interp.c's. Defaults as their reference implementations have them: AdamW's
// in ir_new, SGD torch.optim.SGD's (lr 1e-3, no momentum), Lion the paper's (lr 1e-4, betas 0.9 and
// 0.99), Muon Keller Jordan's SingleDeviceMuonWithAuxAdam's (lr 0.02, momentum 0.95, Nesterov; the
// AdamW of the other params at adam_lr 3e-4, betas 0.9 and 0.95, eps 1e-10), weight decay 0.
static void optimizer_setting(Sema *s, const Expr *e, TrainConfig *t) {
  static const Builtin kinds[] = {
      {"adamw", 0, 0, {"lr", "beta1", "beta2", "eps", "weight_decay"}, NULL, OP_COUNT, NULL, NULL},
      {"sgd", 0, 0, {"lr", "momentum", "nesterov", "weight_decay"}, NULL, OP_COUNT, NULL, NULL},
      {"lion", 0, 0, {"lr", "beta1", "beta2", "weight_decay"}, NULL, OP_COUNT, NULL, NULL},
      {"muon", 0, 0, {"lr", "momentum", "nesterov", "weight_decay", "adam_lr", "beta1", "beta2", "eps"}, NULL, OP_COUNT, NULL, NULL}};
  int k = 0; // (an unknown name: the error lists them all)
  for (int i = 0; i < 4; i++)
    if ((e->kind == E_NAME || e->kind == E_CALL) && !strcmp(e->s, kinds[i].name))
      k = i;
  const Builtin *b = &kinds[k];
  const Expr *arg[BUILTIN_PARAMS];
  if (!train_call(s, b, e, "optimizer", "adamw, sgd, lion or muon", arg))
    return;
  static const OptRule rule_of[] = {OPT_ADAMW, OPT_SGD, OPT_LION, OPT_MUON};
  t->optimizer = rule_of[k];
  if (t->optimizer == OPT_SGD)
    t->lr = 1e-3;
  else if (t->optimizer == OPT_LION)
    t->lr = 1e-4, t->beta2 = 0.99;
  else if (t->optimizer == OPT_MUON)
    t->lr = 0.02, t->adam_lr = 3e-4, t->momentum = 0.95, t->nesterov = true, t->eps = 1e-10;
  double x;
  for (int i = 0; i < 8 && b->params[i]; i++) {
    const char *p = b->params[i];
    if (!arg[i])
      continue;
    if (!strcmp(p, "nesterov")) {
      if (arg[i]->kind != E_BOOL)
        error_at(s, arg[i]->at, "nesterov must be true or false, got %s", ast_text(s->a, s->p->text, arg[i]));
      else
        t->nesterov = arg[i]->i != 0;
      continue;
    }
    Range r = !strcmp(p, "lr") || !strcmp(p, "eps") || !strcmp(p, "adam_lr") ? R_POSITIVE
              : !strcmp(p, "weight_decay") ? R_NONNEG : R_UNIT;
    if (!number(s, arg[i], p, r, false, &x))
      continue;
    double *dst = !strcmp(p, "lr") ? &t->lr : !strcmp(p, "adam_lr") ? &t->adam_lr
                  : !strcmp(p, "beta1") ? &t->beta1 : !strcmp(p, "beta2") ? &t->beta2 : !strcmp(p, "eps") ? &t->eps
                  : !strcmp(p, "momentum") ? &t->momentum : &t->weight_decay;
    if (!strcmp(p, "adam_lr") && !(x > 0))
      error_at(s, arg[i]->at, "adam_lr must be positive, got %g", x);
    else
      *dst = x;
  }
  if (t->optimizer == OPT_SGD && t->nesterov && !(t->momentum > 0))
    error_at(s, arg[2]->at, "nesterov needs a momentum above 0 (sgd(momentum=0.9, nesterov=true))");
}

// A list of name patterns (no_decay, freeze) into v; false after an error.
static bool patterns(Sema *s, const Expr *e, const char *setting, const char *example, PtrVec *v, bool exprs) {
  bool ok = e->kind == E_LIST;
  for (int k = 0; ok && k < e->nargs; k++)
    ok = e->args[k]->kind == E_STRING;
  if (!ok) {
    error_at(s, e->at, "%s must be a list of name patterns such as %s", setting, example);
    return false;
  }
  for (int k = 0; k < e->nargs; k++)
    vec_push(s->a, v, exprs ? (void *)e->args[k] : (void *)e->args[k]->s);
  return true;
}

// lr_scale = {"pattern": multiplier, ...}: each a positive number.
static void lr_scale_setting(Sema *s, const Expr *e) {
  if (e->kind != E_DICT) {
    error_at(s, e->at, "lr_scale must be a table of name patterns and multipliers such as {\"wte\": 0.1}");
    return;
  }
  s->lr_scales = arena_alloc(s->a, sizeof(double) * (size_t)(e->nargs / 2 + 1));
  for (int k = 0; k + 1 < e->nargs; k += 2) {
    const Expr *key = e->args[k];
    double x;
    if (key->kind != E_STRING) {
      error_at(s, key->at, "an lr_scale key must be a name pattern in quotes such as \"wte\", got %s",
               ast_text(s->a, s->p->text, key));
      continue;
    }
    if (!number(s, e->args[k + 1], "an lr_scale multiplier", R_POSITIVE, false, &x))
      continue;
    s->lr_scales[s->lr_scale.n] = x;
    vec_push(s->a, &s->lr_scale, (void *)key);
  }
}

static void train_config(Sema *s) {
  TrainConfig *t = &s->g->train;
  for (int i = 0; i < s->settings.n; i++) {
    const Setting *set = s->settings.v[i];
    const Expr *e = set->value;
    double x;
    if (!strcmp(set->key, "optimizer")) {
      optimizer_setting(s, e, t);
    } else if (!strcmp(set->key, "lr_scale")) {
      lr_scale_setting(s, e);
    } else if (!strcmp(set->key, "freeze")) {
      patterns(s, e, "freeze", "[\"wte\", \"h.0.*\"]", &s->freeze, true);
    } else if (!strcmp(set->key, "muon_params")) {
      if (patterns(s, e, "muon_params", "[\"h.*.attn_w\", \"h.*.mlp*_w\"]", &s->muon_params, true))
        s->muon_params_at = set->at;
    } else if (!strcmp(set->key, "schedule")) {
      schedule_setting(s, e, t);
    } else if (!strcmp(set->key, "no_decay")) {
      patterns(s, e, "no_decay", "[\"*_b\", \"ln*\"]", &s->no_decay, true);
    } else if (!strcmp(set->key, "clip")) {
      if (number(s, e, "clip", R_NONNEG, false, &x))
        t->clip = x;
    } else if (!strcmp(set->key, "accumulate")) {
      if (!number(s, e, "accumulate", R_POSITIVE, true, &x))
        continue;
      if (x > 1048576) // (as --accumulate and a checkpoint's mdl.accumulate)
        error_at(s, e->at, "accumulate must be at most 1048576 micro-batches a step, got %g", x);
      else
        t->accumulate = (int64_t)x;
    } else if (!strcmp(set->key, "amax_history")) { // (fp8: the steps each tensor's scale looks back on)
      if (!number(s, e, "amax_history", R_POSITIVE, true, &x))
        continue;
      if (x > 1024)
        error_at(s, e->at, "amax_history must be at most 1024 steps, got %g", x);
      else
        t->amax_history = (int64_t)x;
    } else if (!strcmp(set->key, "precision")) {
      static const char *const precisions[] = {"auto", "fp32", "bf16", "fp8"};
      const char *w = word(s, e, "precision", precisions, 4);
      if (w) {
        t->precision = w;
        t->precision_at = e->at;
      }
    } else {
      checkpoint_setting(s, e, t);
    }
  }
}

//
// Step 4: elaboration
//

// The shape of a declared tensor (st an input or a param), its elements within IR_MAX_NUMEL.
static bool eval_shape(Sema *s, const Stmt *st, Shape *out) {
  Expr **dims = st->shape;
  int rank = st->rank;
  SrcLoc at = st->shape_at;
  if (rank > IR_MAX_RANK) {
    error_at(s, at, "a tensor has at most %d axes, this shape has %d", IR_MAX_RANK, rank);
    return false;
  }
  *out = (Shape){.rank = rank};
  int64_t numel = 1;
  bool overflow = false;
  for (int i = 0; i < rank; i++) {
    if (!int_of(s, dims[i], "a shape entry", &out->d[i]))
      return false;
    if (out->d[i] <= 0) {
      error_at(s, dims[i]->at, "shape entry %s must be positive, got %lld", ast_text(s->a, s->p->text, dims[i]),
               (long long)out->d[i]);
      return false;
    }
    overflow = overflow || __builtin_mul_overflow(numel, out->d[i], &numel);
  }
  if (overflow || numel > IR_MAX_NUMEL) {
    char count[32] = "more than 2^63";
    if (!overflow)
      snprintf(count, sizeof count, "%lld", (long long)numel);
    error_at(s, at, "%s '%s': shape %s has %s elements; a tensor may have at most 2^36 (%lld)",
             st->kind == S_PARAM ? "param" : "input", st->name, shape_text(s, *out), count, (long long)IR_MAX_NUMEL);
    return false;
  }
  return true;
}

// Binds a name to a value: rebinding a value (the closest one in scope: loop-carried values in a
// repeat body update the outer binding), or defining a new one in the current scope.
static void assign(Sema *s, const char *name, SrcLoc at, Val v) {
  Sym *y = lookup(s, name);
  if (y && y->kind != SYM_VALUE) {
    if (error_at(s, at, "cannot assign to %s '%s'", sym_kind[y->kind], name))
      diag_note(y->at, "'%s' is defined here", name);
    return;
  }
  if (!y)
    y = add_sym(s, s->scope, name, SYM_VALUE, at);
  y->val = v;
  if (v.kind == V_TENSOR) {
    IrNode *n = node(s, v.node);
    if (!n->name)
      n->name = arena_printf(s->a, "%s%s", s->scope->prefix, name);
  }
}

static void assign_stmt(Sema *s, const Stmt *st) {
  for (int i = 0; i < st->nnames; i++)
    for (int k = 0; k < i; k++)
      if (!strcmp(st->names[i], st->names[k])) {
        error_at(s, st->names_at[i], "'%s' is assigned twice in one statement", st->names[i]);
        return;
      }
  Val v = eval(s, st->value);
  if (st->nnames == 1 && v.kind == V_TUPLE) {
    error_at(s, st->at, "%s gives %d values; unpack them into %d names", v.topk ? "topk" : "split", v.ntuple,
             v.ntuple);
    v = ERR;
  } else if (st->nnames > 1 && v.kind != V_ERR && (v.kind != V_TUPLE || v.ntuple != st->nnames)) {
    error_at(s, st->at, "%d names, but the right side gives %d value%s", st->nnames,
             v.kind == V_TUPLE ? v.ntuple : 1, v.kind == V_TUPLE && v.ntuple != 1 ? "s" : "");
    v = ERR;
  }
  for (int i = 0; i < st->nnames; i++)
    assign(s, st->names[i], st->names_at[i], st->nnames > 1 && v.kind == V_TUPLE ? tensor_val(v.tuple[i]) : v);
}

// A failed input is still defined (as V_ERR) so that its uses report nothing more.
static void input_stmt(Sema *s, const Stmt *st) {
  bool known = !strcmp(st->dtype, "i32") || !strcmp(st->dtype, "f32");
  if (!known)
    error_at(s, st->dtype_at, "unknown dtype '%s' (inputs are i32 or f32)", st->dtype);
  Sym *y = define(s, st->name, SYM_INPUT, st->at);
  Shape sh;
  bool ok = eval_shape(s, st, &sh);
  if (!y || !ok || !known)
    return;
  int id = ir_leaf(s->g, OP_INPUT, st->name, st->dtype[0] == 'i' ? DT_I32 : DT_F32, sh, st->at);
  if (id < 0)
    error_at(s, st->at, "%s", s->g->err);
  else
    y->val = tensor_val(id);
}

static bool param_init(Sema *s, const Expr *e, ParamInit *init) {
  if (e->kind == E_NAME && (!strcmp(e->s, "zeros") || !strcmp(e->s, "ones"))) {
    init->kind = e->s[0] == 'z' ? INIT_ZEROS : INIT_ONES;
    return true;
  }
  if (e->kind == E_CALL && !strcmp(e->s, "normal")) {
    static const Builtin b = {"normal", 1, 1, {"std"}, NULL, OP_COUNT, NULL, NULL};
    const Expr *arg[BUILTIN_PARAMS];
    double std;
    if (!bind_args(s, &b, e, arg) || !number(s, arg[0], "normal: std", R_NONNEG, false, &std))
      return false;
    *init = (ParamInit){.kind = INIT_NORMAL, .std = std};
    return true;
  }
  error_at(s, e->at, "unknown initializer '%s' (use normal(std), zeros or ones)", ast_text(s->a, s->p->text, e));
  return false;
}

static void param_stmt(Sema *s, const Stmt *st) {
  Sym *y = define(s, st->name, SYM_PARAM, st->at);
  Shape sh;
  ParamInit init = {0};
  bool ok = eval_shape(s, st, &sh);
  ok = param_init(s, st->value, &init) && ok;
  if (!y || !ok)
    return;
  int64_t bytes = 4 * shape_numel(sh); // at most 2^38: eval_shape bounds the elements
  if (s->param_bytes + bytes > MDL_MAX_PARAM_BYTES || s->g->nparams >= MDL_MAX_PARAMS) {
    error_at(s, st->at, "param '%s' takes the model past %s", st->name,
             s->g->nparams >= MDL_MAX_PARAMS ? arena_printf(s->a, "%d parameter tensors", MDL_MAX_PARAMS)
                                            : "2^42 bytes (4 TiB) of f32 parameters");
    s->over_limit = true;
    return;
  }
  int id = ir_leaf(s->g, OP_PARAM, arena_printf(s->a, "%s%s", s->scope->prefix, st->name), DT_F32, sh, st->at);
  if (id < 0) {
    error_at(s, st->at, "%s", s->g->err);
    return;
  }
  s->param_bytes += bytes;
  init.decay = true;
  node(s, id)->init = init;
  y->val = tensor_val(id);
}

static void output_stmt(Sema *s, const Stmt *st) {
  Val v = eval(s, st->value);
  if (v.kind != V_ERR && v.kind != V_TENSOR) {
    error_at(s, st->value->at, "output '%s' must be a tensor, got %s", st->name, describe(v));
    v = ERR;
  } else if (v.kind == V_TENSOR && node(s, v.node)->dtype == DT_I32) { // (metrics and logits are read as f32)
    error_at(s, st->value->at, "output '%s' is an i32 tensor; outputs are f32: write float(...)", st->name);
    v = ERR;
  }
  assign(s, st->name, st->at, v);
  if (v.kind == V_ERR)
    return;
  IrNode *n = node(s, v.node);
  if (n->op != OP_INPUT && n->op != OP_PARAM)
    n->name = st->name;
  s->out_nodes[s->nout++] = v.node;
  if (strcmp(st->name, "loss"))
    return;
  if (n->shape.rank != 0 || n->dtype != DT_F32)
    error_at(s, st->at, "output 'loss' must be a scalar f32 (shape []), got %s%s", dtype_name(n->dtype),
             shape_text(s, n->shape));
  else
    s->g->loss = v.node;
}

static void elaborate(Sema *s, Stmt **body, int n);

// What the graph has cost so far, in the units MDL_MAX_* bound.
typedef struct {
  int64_t v[4];
} Cost;

static const char *const cost_what[] = {"build %s graph nodes", "build %s parameter tensors",
                                        "take %s bytes of f32 parameters", "run %s statements"};
static const int64_t cost_limit[] = {MDL_MAX_NODES, MDL_MAX_PARAMS, MDL_MAX_PARAM_BYTES, MDL_MAX_STMTS};

static Cost cost_now(const Sema *s) { return (Cost){{s->g->n, s->g->nparams, s->param_bytes, s->stmts}}; }

// After the first of n repetitions (which took `before` to now): would the other n - 1 pass a
// limit? Then say so, naming the count and the limit, instead of building them.
static bool repeat_fits(Sema *s, const Stmt *st, int64_t n, Cost before) {
  Cost now = cost_now(s);
  for (int k = 0; k < 4; k++) {
    int64_t total, each = now.v[k] - before.v[k];
    if (!__builtin_mul_overflow(each, n - 1, &total) && !__builtin_add_overflow(total, now.v[k], &total) &&
        total <= cost_limit[k])
      continue;
    const char *count = ast_text(s->a, s->p->text, st->value);
    char total_text[48] = "more than 2^63";
    if (!__builtin_mul_overflow(each, n, &total) && !__builtin_add_overflow(total, before.v[k], &total))
      snprintf(total_text, sizeof total_text, "%lld", (long long)total);
    Sym *dim = st->value->kind == E_NAME ? lookup(s, st->value->s) : NULL;
    char what[96];
    snprintf(what, sizeof what, cost_what[k], total_text);
    if (error_at(s, st->value->at, "repeat %s[%s]: %s%lld repetitions would %s (%lld per repetition); the limit is %lld",
                 st->name, count, st->value->kind == E_INT ? "" : arena_printf(s->a, "%s = ", count), (long long)n,
                 what, (long long)each, (long long)cost_limit[k]) && dim)
      diag_note(dim->at, "'%s' is defined here", dim->name);
    s->over_limit = true;
    return false;
  }
  return true;
}

// repeat NAME[N] { body }: N copies of the body, copy i in a scope whose params are NAME.i.x. The
// first copy measures what one costs, so that a count too large is refused before the others. With
// `as INDEX`, INDEX is i in copy i: an integer constant of that scope (usable in shapes and inits).
static void repeat_stmt(Sema *s, const Stmt *st) {
  int64_t n;
  if (!int_of(s, st->value, "a repeat count", &n))
    return;
  if (n < 0) {
    error_at(s, st->value->at, "a repeat count must not be negative, got %lld", (long long)n);
    return;
  }
  if (!define(s, st->name, SYM_REPEAT, st->at))
    return;
  Sym *taken = st->index ? lookup(s, st->index) : NULL;
  if (taken) {
    if (error_at(s, st->index_at, "duplicate definition of '%s'", st->index))
      diag_note(taken->at, "previous definition is here");
    return;
  }
  Cost before = cost_now(s);
  for (int64_t i = 0; i < n && !s->over_limit && !diag_stopped(); i++) {
    s->stmts++; // an empty body still costs its repetitions
    Scope sc = {.up = s->scope, .prefix = arena_printf(s->a, "%s%s.%lld.", s->scope->prefix, st->name, (long long)i)};
    s->scope = &sc;
    if (st->index)
      add_sym(s, &sc, st->index, SYM_INDEX, st->index_at)->val = int_val(i);
    int outer = s->g->cur_body;
    s->g->cur_body = ++s->g->nbodies; // the checkpoint pass's unit (IrNode.body)
    elaborate(s, st->body, st->nbody);
    s->g->cur_body = outer;
    s->scope = sc.up;
    if (i == 0 && !repeat_fits(s, st, n, before))
      return;
  }
}

static void elaborate(Sema *s, Stmt **body, int n) {
  for (int i = 0; i < n && !s->over_limit && !diag_stopped(); i++) {
    const Stmt *st = body[i];
    if (st->rejected)
      continue;
    if (++s->stmts > MDL_MAX_STMTS || s->g->n > MDL_MAX_NODES) { // a huge text, no repeat needed
      bool nodes = s->g->n > MDL_MAX_NODES;
      error_at(s, st->at, "the model is too large: more than %d %s", nodes ? MDL_MAX_NODES : MDL_MAX_STMTS,
               nodes ? "graph nodes" : "statements to run");
      s->over_limit = true;
      return;
    }
    switch (st->kind) {
    case S_INPUT: input_stmt(s, st); break;
    case S_PARAM: param_stmt(s, st); break;
    case S_ASSIGN: assign_stmt(s, st); break;
    case S_OUTPUT: output_stmt(s, st); break;
    case S_REPEAT: repeat_stmt(s, st); break;
    case S_MODEL: case S_DIM: case S_CONST: case S_TRAIN: break;
    }
  }
}

// Weight decay applies to every param no no_decay pattern matches and that is not frozen; a frozen
// param matches a freeze pattern; a param's lr_scale is the last lr_scale pattern's that matches it
// (1 where none does). A no_decay, freeze or lr_scale pattern that matches no param is an error (a
// misspelt name would otherwise leave the run quietly training what it meant to hold, or decaying
// what it meant to spare).
static void set_decay(Sema *s) {
  Graph *g = s->g;
  for (int i = 0; i < g->nparams; i++) {
    IrNode *p = node(s, g->params[i]);
    for (int k = 0; k < s->no_decay.n; k++)
      if (fnmatch(((const Expr *)s->no_decay.v[k])->s, p->name, 0) == 0)
        p->init.decay = false;
    for (int k = 0; k < s->freeze.n; k++)
      if (fnmatch(((const Expr *)s->freeze.v[k])->s, p->name, 0) == 0)
        p->init.frozen = true, p->init.decay = false;
    for (int k = 0; k < s->lr_scale.n; k++)
      if (fnmatch(((const Expr *)s->lr_scale.v[k])->s, p->name, 0) == 0)
        p->init.lr_scale = s->lr_scales[k];
  }
  static const char *const what[3] = {"no_decay", "freeze", "lr_scale"};
  for (int w = 0; w < 3; w++) {
    const PtrVec *v = w == 2 ? &s->lr_scale : w ? &s->freeze : &s->no_decay;
    for (int k = 0; k < v->n; k++) {
      const Expr *pat = v->v[k];
      bool hit = false;
      for (int i = 0; i < g->nparams && !hit; i++)
        hit = fnmatch(pat->s, node(s, g->params[i])->name, 0) == 0;
      if (!hit)
        error_at(s, pat->at, "%s pattern \"%s\" matches no param", what[w], pat->s);
    }
  }
  int frozen = 0;
  for (int i = 0; i < g->nparams; i++)
    frozen += node(s, g->params[i])->init.frozen;
  if (s->freeze.n && frozen == g->nparams)
    error_at(s, ((const Expr *)s->freeze.v[0])->at, "freeze leaves no param to train: all %d are frozen", frozen);
}

// A param read by the MATMUL that makes a cross-entropy's logits (through layout, casts and
// elementwise ops such as a bias): the LM head. head[id] is set for each.
static void mark_heads(Sema *s, bool *head) {
  Graph *g = s->g;
  bool *seen = arena_alloc(s->a, (size_t)(g->n ? g->n : 1));
  int *stack = arena_alloc(s->a, sizeof(int) * (size_t)(g->n ? g->n : 1)), top = 0;
  for (int i = 0; i < g->n; i++)
    if (node(s, i)->op == OP_CROSS_ENTROPY && !seen[node(s, i)->in[0]])
      seen[stack[top++] = node(s, i)->in[0]] = true;
  while (top > 0) {
    const IrNode *n = node(s, stack[--top]);
    bool through = n->op == OP_RESHAPE || n->op == OP_PERMUTE || n->op == OP_CAST || n->op == OP_BROADCAST ||
                   n->op == OP_ADD || n->op == OP_SUB || n->op == OP_MUL || n->op == OP_DIV || n->op == OP_NEG;
    for (int k = 0; (through || n->op == OP_MATMUL) && k < n->nin; k++) {
      int x = n->in[k];
      while (n->op == OP_MATMUL && (node(s, x)->op == OP_RESHAPE || node(s, x)->op == OP_PERMUTE ||
                                    node(s, x)->op == OP_CAST))
        x = node(s, x)->in[0];
      if (n->op == OP_MATMUL) {
        if (node(s, x)->op == OP_PARAM)
          head[x] = true;
      } else if (!seen[x]) {
        seen[stack[top++] = x] = true;
      }
    }
  }
}

// optimizer = muon: which params Muon updates. By default the hidden matrices: every 2-D param that is
// neither an embedding table (read by embed) nor the LM head (mark_heads); with muon_params, the 2-D
// params its patterns match (one matching no param, or a param that is not 2-D, is an error). The
// rest, and every frozen param, take AdamW.
static void set_muon(Sema *s) {
  Graph *g = s->g;
  if (s->muon_params_at.line && g->train.optimizer != OPT_MUON) {
    error_at(s, s->muon_params_at, "muon_params says which params Muon updates: it needs optimizer = muon");
    return;
  }
  if (g->train.optimizer != OPT_MUON)
    return;
  bool *head = arena_alloc(s->a, (size_t)(g->n ? g->n : 1)), *table = arena_alloc(s->a, (size_t)(g->n ? g->n : 1));
  mark_heads(s, head);
  for (int i = 0; i < g->n; i++)
    if (node(s, i)->op == OP_EMBED)
      table[node(s, i)->in[0]] = true;
  for (int i = 0; i < g->nparams; i++) {
    IrNode *p = node(s, g->params[i]);
    bool pick = p->shape.rank == 2 && !table[p->id] && !head[p->id];
    if (s->muon_params.n) {
      pick = false;
      for (int k = 0; k < s->muon_params.n; k++) {
        const Expr *pat = s->muon_params.v[k];
        if (fnmatch(pat->s, p->name, 0) != 0)
          continue;
        if (p->shape.rank != 2)
          error_at(s, pat->at, "muon_params pattern \"%s\" matches '%s' of shape %s: Muon updates matrices (2-D) "
                   "only", pat->s, p->name, shape_text(s, p->shape));
        pick = true;
      }
    }
    p->init.muon = pick && !p->init.frozen;
  }
  for (int k = 0; k < s->muon_params.n; k++) {
    const Expr *pat = s->muon_params.v[k];
    bool hit = false;
    for (int i = 0; i < g->nparams && !hit; i++)
      hit = fnmatch(pat->s, node(s, g->params[i])->name, 0) == 0;
    if (!hit)
      error_at(s, pat->at, "muon_params pattern \"%s\" matches no param", pat->s);
  }
}

// What a whole model must have: a loss when it has a train section (an error), and every param on
// the way to an output (a warning for each that is not: it would train to nothing). Once the model
// holds no other error.
static void check_model(Sema *s, const Stmt *train) {
  Graph *g = s->g;
  if (train && g->loss < 0)
    error_at(s, train->at, "a train section, but no 'output loss = ...' (a scalar f32): there is nothing to train");
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
  const Stmt *train = declare(s);
  PtrVec sets = {0};
  for (int i = 0; i < s->lower.nsettings; i++) {
    Parser q = {.arena = s->a, .file = "--set", .text = s->lower.settings[i]};
    if (!parse_text(&q))
      continue;
    Stmt *st = q.stmts.n == 1 ? q.stmts.v[0] : NULL;
    if (!st || st->kind != S_ASSIGN || st->nnames != 1) {
      error_at(s, (SrcLoc){.file = q.file, .text = q.text, .line = 1, .col = 1},
               "--set wants KEY=VALUE (a train setting, a free dim, or an argument of the optimizer or the "
               "schedule), got '%s'", q.text);
      continue;
    }
    vec_push(s->a, &sets, st);
  }
  bind_dims(s, train, &sets, ov, nov);
  train_config(s);
  s->out_nodes = arena_alloc(s->a, sizeof(int) * (size_t)(s->outputs.n ? s->outputs.n : 1));
  elaborate(s, (Stmt **)p->stmts.v, p->stmts.n);
  set_decay(s);
  set_muon(s);
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
