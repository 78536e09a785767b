// front.h: the front end's private declarations: source spans, the AST the parser builds, and
// the glue between the flex scanner (grammar/mdl.l), the bison parser (grammar/mdl.y) and
// semantic analysis (compiler/front/sema*.c). Public entry points live in mdl.h ("front end").
#ifndef MDL_FRONT_H
#define MDL_FRONT_H

#include "mdl.h"

// A source span as bison tracks it: 1-based lines and columns of the first and last character,
// plus byte offsets [begin, end) into the text so a message can quote what the user wrote.
typedef struct {
  int first_line, first_column, last_line, last_column;
  int begin, end;
} Span;

//
// ast.c: the syntax tree. Everything is allocated in the compilation's arena.
//
typedef enum {
  E_INT,    // i
  E_FLOAT,  // f
  E_BOOL,   // i (0 or 1)
  E_STRING, // s (without the quotes)
  E_SIZE,   // s: a byte size such as 2GiB (checkpoint budgets)
  E_NAME,   // s
  E_BINARY, // op in "+-*/%@", 'q' for //, comparisons "<>lgen"; lhs, rhs
  E_NEG,    // lhs
  E_ATTR,   // lhs.s (only .T exists)
  E_CALL,   // s(args); kw[i] is the keyword of args[i] or NULL
  E_INDEX,  // lhs[args]; each arg an index expression or an E_SLICE
  E_SLICE,  // lo:hi inside an index; either may be NULL
  E_LIST,   // [args]
  E_DICT,   // {"key": value, ...}: args[2k] the keys, args[2k + 1] their values
  E_KWARG,  // s = lhs: a keyword argument, only while parsing (then in Expr.kw)
} ExprKind;

typedef struct Expr Expr;
struct Expr {
  ExprKind kind;
  Span span;     // the whole expression
  SrcLoc at;     // the token a message points at: the operator, the callee, the literal
  int64_t i;
  double f;
  const char *s;
  int op;
  Expr *lhs, *rhs;
  Expr **args;
  const char **kw;
  SrcLoc *kw_at;
  int nargs;
  Expr *lo, *hi;
};

typedef enum {
  S_MODEL,  // model NAME
  S_DIM,    // dim NAME = value | dim NAME in lo..hi (free: value NULL)
  S_CONST,  // const NAME = value
  S_INPUT,  // input NAME: dtype[shape]
  S_PARAM,  // param NAME: [shape] = value (the initializer)
  S_OUTPUT, // output NAME = value
  S_ASSIGN, // names[0], names[1], ... = value
  S_REPEAT, // repeat NAME[value] { body }
  S_TRAIN,  // train { body }
} StmtKind;

typedef struct Stmt Stmt;
struct Stmt {
  StmtKind kind;
  SrcLoc at;          // the statement's name (or keyword for train)
  const char *name;
  const char **names; // S_ASSIGN targets
  SrcLoc *names_at;
  int nnames;
  Expr *value;
  Expr *lo, *hi;      // free dim bounds
  const char *dtype;  // S_INPUT
  SrcLoc dtype_at;
  Expr **shape;       // S_INPUT, S_PARAM
  int rank;
  SrcLoc shape_at;
  Stmt **body;        // S_REPEAT, S_TRAIN
  const char *index;  // S_REPEAT: the index's name in `repeat NAME[N] as INDEX`, or NULL
  SrcLoc index_at;
  int nbody;
  bool rejected;      // sema reported it (duplicate, misplaced) and skips it
};

// A growable array of pointers in the arena, used by the parser for lists.
typedef struct {
  void **v;
  int n, cap;
} PtrVec;

void vec_push(Arena *a, PtrVec *v, void *p);

typedef struct Parser Parser;
SrcLoc span_loc(const Parser *p, Span s);
Expr *ast_expr(Parser *p, ExprKind kind, Span span, Span at);
Stmt *ast_stmt(Parser *p, StmtKind kind, Span at);
// The source text of an expression, as the user wrote it.
char *ast_text(Arena *a, const char *text, const Expr *e);

//
// grammar/mdl.l, grammar/mdl.y: the scanner and the parser.
//
// State shared by the scanner and the parser's actions.
struct Parser {
  Arena *arena;
  const char *file, *text;
  PtrVec stmts;       // top-level statements
  int errors;         // syntax and lexical errors
  int line, col, offset; // the scanner's position
  int depth;          // open ( [ and tables' {: newlines inside them are not statement ends
  int dicts;          // open tables' { (a '{' followed by a string: {"wte": 0.1})
  PtrVec braces;      // Span* of every open '{' that opens a block
  bool recovering;    // after a syntax error, until the parser resynchronises (yyerrok)
  int skipped;        // nesting of the '{' skipped while recovering: tokens inside are dropped
  bool stop;          // nesting too deep: the scanner ends the text here
  bool at_eof;        // the end of the text was reached (and the last newline sent)
  int pending_close;  // '}' and newline tokens still to send at the end, closing open blocks
};

// ( [ and { nest at most this deep: far beyond any model, and well inside the parser's stack.
enum { FRONT_MAX_NESTING = 256 };

// Runs the scanner and the parser over p->text; fills p->stmts. Returns false on syntax errors
// (all already reported).
bool parse_text(Parser *p);

//
// sema.c: the front end's steps, over names, dims, the train section and the graph (sema_impl.h
// says which file does what).
//
Graph *sema_build(Parser *p, const DimOverride *ov, int nov, const LowerOptions *lo);

#endif
