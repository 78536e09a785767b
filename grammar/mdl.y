/* mdl.y: the .mdl grammar (bison, pure parser with locations). It only builds the AST of
 * compiler/front/front.h; names, types and shapes are sema.c's business.
 *
 * A file is a list of statements separated by newlines or ';'. Blocks ({ } after `repeat` and
 * `train`) hold statements too; the last one may end at the '}'. Expressions, tightest first:
 * postfix (.T, calls, indexing), unary minus, @, then * / %, then + -. On a syntax error the
 * parser reports it, skips to the end of the statement (or the block's '}') and goes on, so one
 * run reports several errors. */
%define api.pure full
%define api.location.type {Span}
%define parse.error detailed
%locations
%param {yyscan_t scanner}
%parse-param {Parser *p}

%code requires {
#include "front.h"
#ifndef YY_TYPEDEF_YY_SCANNER_T
#define YY_TYPEDEF_YY_SCANNER_T
typedef void *yyscan_t;
#endif
#define YYLLOC_DEFAULT(cur, rhs, n)                                                                \
  do {                                                                                             \
    if (n) {                                                                                       \
      (cur).first_line = YYRHSLOC(rhs, 1).first_line;                                              \
      (cur).first_column = YYRHSLOC(rhs, 1).first_column;                                          \
      (cur).begin = YYRHSLOC(rhs, 1).begin;                                                        \
      (cur).last_line = YYRHSLOC(rhs, n).last_line;                                                \
      (cur).last_column = YYRHSLOC(rhs, n).last_column;                                            \
      (cur).end = YYRHSLOC(rhs, n).end;                                                            \
    } else {                                                                                       \
      (cur).first_line = (cur).last_line = YYRHSLOC(rhs, 0).last_line;                             \
      (cur).first_column = (cur).last_column = YYRHSLOC(rhs, 0).last_column;                       \
      (cur).begin = (cur).end = YYRHSLOC(rhs, 0).end;                                              \
    }                                                                                              \
  } while (0)
}

%code provides {
int yylex(YYSTYPE *lval, YYLTYPE *lloc, yyscan_t scanner);
}

%code {
#include <stdlib.h>
#include <string.h>

#define YYMAXDEPTH 10000
#define YYMALLOC(n) xmalloc(n, "the parser's stack")
#define YYFREE free

// A syntax error. The parser then skips tokens up to the end of the statement (or the block's
// '}'), so the '{' it failed on, and any it skips, open no block the scanner should wait for.
static void yyerror(YYLTYPE *loc, yyscan_t scanner, Parser *p, const char *msg) {
  (void)scanner;
  p->errors++;
  if (p->braces.n > 0 && ((Span *)p->braces.v[p->braces.n - 1])->begin == loc->begin) {
    p->braces.n--; // the '{' the parser failed on: it and all up to its '}' are skipped
    p->skipped = 1;
  }
  p->recovering = true;
  p->depth = 0; // resynchronise at the next newline even inside an unclosed ( [ or table
  if (p->stop) // the scanner ended the text early and said why
    return;
  if (!strcmp(msg, "memory exhausted"))
    diag_error(span_loc(p, *loc), "nesting too deep: more than %d levels of the parser's stack", YYMAXDEPTH);
  else
    diag_error(span_loc(p, *loc), "%s", msg);
}

// The parser has resynchronised after a syntax error.
static void recovered(Parser *p) { p->recovering = false; }

static Expr *binary(Parser *p, int op, Expr *l, Expr *r, Span all, Span at) {
  Expr *e = ast_expr(p, E_BINARY, all, at);
  e->op = op;
  e->lhs = l;
  e->rhs = r;
  return e;
}

// Moves a parsed list into an expression's argument array, unwrapping keyword arguments.
static void take_args(Parser *p, Expr *e, PtrVec *v) {
  size_t n = (size_t)(v->n ? v->n : 1);
  e->nargs = v->n;
  e->args = arena_alloc(p->arena, sizeof(Expr *) * n);
  e->kw = arena_alloc(p->arena, sizeof(char *) * n);
  e->kw_at = arena_alloc(p->arena, sizeof(SrcLoc) * n);
  for (int i = 0; i < v->n; i++) {
    Expr *a = v->v[i];
    if (a->kind == E_KWARG) {
      e->kw[i] = a->s;
      e->kw_at[i] = a->at;
      a = a->lhs;
    }
    e->args[i] = a;
  }
}

static Stmt *shaped(Parser *p, StmtKind kind, Span name, const char *s, PtrVec *shape, Span shape_at) {
  Stmt *st = ast_stmt(p, kind, name);
  st->name = s;
  st->rank = shape->n;
  st->shape = (Expr **)shape->v;
  st->shape_at = span_loc(p, shape_at);
  return st;
}

static Stmt *block(Stmt *st, PtrVec *body) {
  st->body = (Stmt **)body->v;
  st->nbody = body->n;
  return st;
}
}

%union {
  int64_t i;
  double f;
  char *s;
  Expr *e;
  Stmt *st;
  PtrVec v;
}

%token <s> IDENT "identifier" STRING "string" SIZE "size"
%token <i> INT "integer"
%token <f> FLOAT "number"
%token NEWLINE "end of line" DOTDOT "'..'" EQ "'=='" NE "'!='" LE "'<='" GE "'>='" FLOORDIV "'//'"
%token KW_MODEL "'model'" KW_DIM "'dim'" KW_CONST "'const'" KW_INPUT "'input'" KW_PARAM "'param'"
%token KW_OUTPUT "'output'" KW_REPEAT "'repeat'" KW_TRAIN "'train'" KW_IN "'in'" KW_AS "'as'"
%token KW_TRUE "'true'" KW_FALSE "'false'"
%token DICT_OPEN "'{'" DICT_CLOSE "'}'"

%type <st> stmt line
%type <v> lines block targets exprs opt_exprs args opt_args indices pairs opt_pairs
%type <e> expr add mul mm unary postfix primary arg index

%%

file: lines { p->stmts = $1; }
    ;

lines: %empty           { $$ = (PtrVec){0}; }
     | lines line       { $$ = $1; if ($2) vec_push(p->arena, &$$, $2); }
     ;

line: sep               { $$ = NULL; }
    | stmt sep          { $$ = $1; }
    | error sep         { $$ = NULL; yyerrok; recovered(p); }
    ;

sep: NEWLINE | ';' ;

block: '{' lines '}'            { $$ = $2; }
     | '{' lines stmt '}'       { $$ = $2; vec_push(p->arena, &$$, $3); }
     | '{' lines error '}'      { $$ = $2; yyerrok; recovered(p); }
     ;

stmt: KW_MODEL IDENT                            { $$ = ast_stmt(p, S_MODEL, @2); $$->name = $2; }
    | KW_DIM IDENT '=' expr                     { $$ = ast_stmt(p, S_DIM, @2); $$->name = $2; $$->value = $4; }
    | KW_DIM IDENT KW_IN expr DOTDOT expr       {
                                                  $$ = ast_stmt(p, S_DIM, @2);
                                                  $$->name = $2;
                                                  $$->lo = $4;
                                                  $$->hi = $6;
                                                }
    | KW_CONST IDENT '=' expr                   { $$ = ast_stmt(p, S_CONST, @2); $$->name = $2; $$->value = $4; }
    | KW_INPUT IDENT ':' IDENT '[' opt_exprs ']' {
                                                  $$ = shaped(p, S_INPUT, @2, $2, &$6, @5);
                                                  $$->dtype = $4;
                                                  $$->dtype_at = span_loc(p, @4);
                                                }
    | KW_PARAM IDENT ':' '[' opt_exprs ']' '=' expr {
                                                  $$ = shaped(p, S_PARAM, @2, $2, &$5, @4);
                                                  $$->value = $8;
                                                }
    | KW_OUTPUT IDENT '=' expr                  { $$ = ast_stmt(p, S_OUTPUT, @2); $$->name = $2; $$->value = $4; }
    | targets '=' expr                          {
                                                  $$ = ast_stmt(p, S_ASSIGN, @1);
                                                  $$->nnames = $1.n;
                                                  $$->names = arena_alloc(p->arena, sizeof(char *) * (size_t)$1.n);
                                                  $$->names_at = arena_alloc(p->arena, sizeof(SrcLoc) * (size_t)$1.n);
                                                  for (int i = 0; i < $1.n; i++) {
                                                    Expr *t = $1.v[i];
                                                    $$->names[i] = t->s;
                                                    $$->names_at[i] = t->at;
                                                  }
                                                  $$->name = $$->names[0];
                                                  $$->value = $3;
                                                }
    | KW_REPEAT IDENT '[' expr ']' block        {
                                                  $$ = block(ast_stmt(p, S_REPEAT, @2), &$6);
                                                  $$->name = $2;
                                                  $$->value = $4;
                                                }
    | KW_REPEAT IDENT '[' expr ']' KW_AS IDENT block {
                                                  $$ = block(ast_stmt(p, S_REPEAT, @2), &$8);
                                                  $$->name = $2;
                                                  $$->value = $4;
                                                  $$->index = $7;
                                                  $$->index_at = span_loc(p, @7);
                                                }
    | KW_TRAIN block                            { $$ = block(ast_stmt(p, S_TRAIN, @1), &$2); $$->name = "train"; }
    ;

targets: IDENT                  { $$ = (PtrVec){0}; Expr *t = ast_expr(p, E_NAME, @1, @1); t->s = $1; vec_push(p->arena, &$$, t); }
       | targets ',' IDENT      { $$ = $1; Expr *t = ast_expr(p, E_NAME, @3, @3); t->s = $3; vec_push(p->arena, &$$, t); }
       ;

expr: add
    | add '<' add       { $$ = binary(p, '<', $1, $3, @$, @2); }
    | add '>' add       { $$ = binary(p, '>', $1, $3, @$, @2); }
    | add LE add        { $$ = binary(p, 'l', $1, $3, @$, @2); }
    | add GE add        { $$ = binary(p, 'g', $1, $3, @$, @2); }
    | add EQ add        { $$ = binary(p, 'e', $1, $3, @$, @2); }
    | add NE add        { $$ = binary(p, 'n', $1, $3, @$, @2); }
    ;

add: mul
   | add '+' mul        { $$ = binary(p, '+', $1, $3, @$, @2); }
   | add '-' mul        { $$ = binary(p, '-', $1, $3, @$, @2); }
   ;

mul: mm
   | mul '*' mm         { $$ = binary(p, '*', $1, $3, @$, @2); }
   | mul '/' mm         { $$ = binary(p, '/', $1, $3, @$, @2); }
   | mul '%' mm         { $$ = binary(p, '%', $1, $3, @$, @2); }
   | mul FLOORDIV mm    { $$ = binary(p, 'q', $1, $3, @$, @2); }
   ;

mm: unary
  | mm '@' unary        { $$ = binary(p, '@', $1, $3, @$, @2); }
  ;

unary: postfix
     | '-' unary        { $$ = ast_expr(p, E_NEG, @$, @1); $$->lhs = $2; }
     ;

postfix: primary
       | postfix '.' IDENT              { $$ = ast_expr(p, E_ATTR, @$, @3); $$->lhs = $1; $$->s = $3; }
       | postfix '[' indices ']'        { $$ = ast_expr(p, E_INDEX, @$, @2); $$->lhs = $1; take_args(p, $$, &$3); }
       | IDENT '(' opt_args ')'         { $$ = ast_expr(p, E_CALL, @$, @1); $$->s = $1; take_args(p, $$, &$3); }
       ;

primary: INT                    { $$ = ast_expr(p, E_INT, @1, @1); $$->i = $1; }
       | FLOAT                  { $$ = ast_expr(p, E_FLOAT, @1, @1); $$->f = $1; }
       | KW_TRUE                { $$ = ast_expr(p, E_BOOL, @1, @1); $$->i = 1; }
       | KW_FALSE               { $$ = ast_expr(p, E_BOOL, @1, @1); $$->i = 0; }
       | STRING                 { $$ = ast_expr(p, E_STRING, @1, @1); $$->s = $1; }
       | SIZE                   { $$ = ast_expr(p, E_SIZE, @1, @1); $$->s = $1; }
       | IDENT                  { $$ = ast_expr(p, E_NAME, @1, @1); $$->s = $1; }
       | '(' expr ')'           { $$ = $2; $$->span = @$; }
       | '[' opt_exprs ']'      { $$ = ast_expr(p, E_LIST, @$, @1); take_args(p, $$, &$2); }
       | DICT_OPEN opt_pairs DICT_CLOSE { $$ = ast_expr(p, E_DICT, @$, @1); take_args(p, $$, &$2); }
       ;

opt_pairs: %empty               { $$ = (PtrVec){0}; }
         | pairs
         | pairs ','
         ;

pairs: expr ':' expr            { $$ = (PtrVec){0}; vec_push(p->arena, &$$, $1); vec_push(p->arena, &$$, $3); }
     | pairs ',' expr ':' expr  { $$ = $1; vec_push(p->arena, &$$, $3); vec_push(p->arena, &$$, $5); }
     ;

opt_exprs: %empty               { $$ = (PtrVec){0}; }
         | exprs
         | exprs ','
         ;

exprs: expr                     { $$ = (PtrVec){0}; vec_push(p->arena, &$$, $1); }
     | exprs ',' expr           { $$ = $1; vec_push(p->arena, &$$, $3); }
     ;

opt_args: %empty                { $$ = (PtrVec){0}; }
        | args
        | args ','
        ;

args: arg                       { $$ = (PtrVec){0}; vec_push(p->arena, &$$, $1); }
    | args ',' arg              { $$ = $1; vec_push(p->arena, &$$, $3); }
    ;

arg: expr
   | IDENT '=' expr             { $$ = ast_expr(p, E_KWARG, @1, @1); $$->s = $1; $$->lhs = $3; }
   ;

indices: index                  { $$ = (PtrVec){0}; vec_push(p->arena, &$$, $1); }
       | indices ',' index      { $$ = $1; vec_push(p->arena, &$$, $3); }
       ;

index: expr
     | ':'                      { $$ = ast_expr(p, E_SLICE, @$, @1); }
     | expr ':'                 { $$ = ast_expr(p, E_SLICE, @$, @2); $$->lo = $1; }
     | ':' expr                 { $$ = ast_expr(p, E_SLICE, @$, @1); $$->hi = $2; }
     | expr ':' expr            { $$ = ast_expr(p, E_SLICE, @$, @2); $$->lo = $1; $$->hi = $3; }
     ;

%%
