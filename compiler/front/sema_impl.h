// sema_impl.h: what the files of semantic analysis (compiler/front/sema*.c) share: its state Sema,
// the values expressions evaluate to, symbols and scopes, the builtins' table entries, and the
// functions one file calls in another. Their calls run one way: sema.c (the steps) calls the train
// section, the evaluator, names; the train section calls the evaluator; the evaluator calls the
// builtins; all of them call names (sema_names.c). front.h is the front end's own (sema_build).
#ifndef SEMA_IMPL_H
#define SEMA_IMPL_H

#include "front.h"

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

static inline Val int_val(int64_t i) { return (Val){.kind = V_INT, .i = i}; }
static inline Val float_val(double f) { return (Val){.kind = V_FLOAT, .f = f}; }
static inline Val tensor_val(int node) { return (Val){.kind = V_TENSOR, .node = node}; }

// SYM_INDEX: the index of `repeat NAME[N] as INDEX`, an integer constant inside one repetition.
typedef enum { SYM_DIM, SYM_CONST, SYM_PARAM, SYM_INPUT, SYM_VALUE, SYM_REPEAT, SYM_INDEX } SymKind;

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

static inline IrNode *node(Sema *s, int id) { return s->g->nodes[id]; }

// " (did you mean 'NAME'?)" for the nearest of the candidates within 2 edits of name (and fewer
// than its length), else "".
typedef struct {
  const char *name, *best;
  int dist;
} Nearest;

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

typedef enum { R_POSITIVE, R_NONNEG, R_UNIT } Range;

//
// sema_names.c: names, scopes, and errors
//
bool sema_error(Sema *s, SrcLoc at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
const char *sema_describe(Val v);
char *sema_shape_text(Sema *s, Shape sh);
Sym *sema_find_in(Scope *sc, const char *name);
Sym *sema_lookup(Sema *s, const char *name);
Sym *sema_add_sym(Sema *s, Scope *sc, const char *name, SymKind kind, SrcLoc at);
Sym *sema_define(Sema *s, const char *name, SymKind kind, SrcLoc at);
void sema_consider(Nearest *near, const char *candidate);
const char *sema_did_you_mean(Sema *s, const Nearest *near);
void sema_unknown_name(Sema *s, const Expr *e);
const Stmt *sema_declare(Sema *s);

//
// sema_builtins.c: the built-in ops, and building graph nodes
//
Val sema_add_op(Sema *s, Op op, const int *in, int nin, const int64_t ia[IR_NIA], const double fa[IR_NFA],
                SrcLoc at);
Val sema_reshape(Sema *s, int x, Shape sh, SrcLoc at);
bool sema_operand_nodes(Sema *s, const char *what, SrcLoc at, const Val *v, const SrcLoc *vat, int n, int *out);
bool sema_bind_args(Sema *s, const Builtin *b, const Expr *call, const Expr **arg);
const Builtin *sema_find_builtin(Sema *s, const Expr *e);

//
// sema_eval.c: statements and expressions
//
Val sema_eval(Sema *s, const Expr *e);
Val sema_sym_value(Sema *s, Sym *y, SrcLoc use);
bool sema_number(Sema *s, const Expr *e, const char *what, Range r, bool integer, double *out);
void sema_elaborate(Sema *s, Stmt **body, int n);

//
// sema_train.c: the train section
//
void sema_bind_dims(Sema *s, const Stmt *train, const PtrVec *sets, const DimOverride *ov, int nov);
void sema_train_config(Sema *s);
void sema_set_decay(Sema *s);
void sema_set_muon(Sema *s);

#endif
