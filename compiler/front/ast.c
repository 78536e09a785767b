// ast.c: constructors for the syntax tree the parser builds (front.h), and the small helpers the
// parser and sema share: growable pointer arrays, span -> SrcLoc, and quoting an expression's
// source text for messages. Everything lives in the compilation's arena.
#include "front.h"

#include <string.h>

void vec_push(Arena *a, PtrVec *v, void *p) {
  if (v->n == v->cap) {
    int cap = v->cap ? 2 * v->cap : 8;
    void **nv = arena_alloc(a, sizeof(void *) * (size_t)cap);
    if (v->n)
      memcpy(nv, v->v, sizeof(void *) * (size_t)v->n);
    v->v = nv;
    v->cap = cap;
  }
  v->v[v->n++] = p;
}

SrcLoc span_loc(const Parser *p, Span s) {
  return (SrcLoc){.file = p->file, .text = p->text, .line = s.first_line, .col = s.first_column};
}

Expr *ast_expr(Parser *p, ExprKind kind, Span span, Span at) {
  Expr *e = arena_alloc(p->arena, sizeof *e);
  e->kind = kind;
  e->span = span;
  e->at = span_loc(p, at);
  return e;
}

Stmt *ast_stmt(Parser *p, StmtKind kind, Span at) {
  Stmt *s = arena_alloc(p->arena, sizeof *s);
  s->kind = kind;
  s->at = span_loc(p, at);
  return s;
}

// The expression's text with comments dropped and each run of white space (newlines of wrapped
// lines included) squeezed to one blank.
char *ast_text(Arena *a, const char *text, const Expr *e) {
  int n = e->span.end - e->span.begin;
  char *s = arena_alloc(a, (size_t)n + 1);
  int k = 0;
  for (int i = e->span.begin; i < e->span.end; i++) {
    char c = text[i];
    if (c == '#') { // a comment runs to the end of its line
      while (i + 1 < e->span.end && text[i + 1] != '\n')
        i++;
      c = ' ';
    }
    bool space = c == ' ' || c == '\t' || c == '\r' || c == '\n';
    if (space && (k == 0 || s[k - 1] == ' '))
      continue;
    s[k++] = space ? ' ' : c;
  }
  while (k > 0 && s[k - 1] == ' ')
    k--;
  s[k] = 0;
  return s;
}
