// sema_eval.c: statements and expressions: evaluation of the AST into values and graph nodes
// (step 4 of sema.c), dims and consts evaluated on first use, and a builtin call's arguments
// evaluated as the builtin's table entry says before the builtin (sema_builtins.c) runs.
#include "sema_impl.h"

#include <float.h>
#include <string.h>

static const char *const sym_kind[] = {"dim", "const", "param", "input", "value", "repeat block", "repeat index"};
static const char *const a_sym_kind[] = {"a dim", "a const", "a param", "an input", "a value", "a repeat block",
                                         "a repeat index"};

enum { SEMA_MAX_DEPTH = 1000 };

//
// Expressions
//

static Val eval_const(Sema *s, const Expr *e) {
  bool saved = s->constant;
  s->constant = true;
  Val v = sema_eval(s, e);
  s->constant = saved;
  return v;
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

// a // b and a % b as Python and numpy take them: the quotient rounded down, the remainder with the
// sign of b (a == b * (a // b) + a % b); b != 0, and not INT64_MIN // -1.
static int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b != 0 && (a % b < 0) != (b < 0)); }
static int64_t floor_mod(int64_t a, int64_t b) { return a % b + (a % b != 0 && (a % b < 0) != (b < 0) ? b : 0); }

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
      sema_error(s, e->at, "division by zero in dimension arithmetic");
      return ERR;
    }
    if (a == INT64_MIN && b == -1) {
      overflow = true;
      break;
    }
    if (e->op == '/' && a % b != 0) {
      sema_error(s, e->at, "%s: %lld is not divisible by %lld", ast_text(s->a, e->at.text, e), (long long)a,
                 (long long)b);
      return ERR;
    }
    r = e->op == '/' ? a / b : e->op == 'q' ? floor_div(a, b) : floor_mod(a, b);
    break;
  }
  if (overflow) {
    sema_error(s, e->at, "integer overflow in dimension arithmetic");
    return ERR;
  }
  return int_val(r);
}

static Val arith_scalar(Sema *s, const Expr *e, Val a, Val b) {
  if (a.kind == V_BOOL || b.kind == V_BOOL) {
    sema_error(s, e->at, "'%s' does not apply to booleans", op_text(e->op));
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
      sema_error(s, e->at, "division by zero");
      return ERR;
    }
    return float_val(x / y);
  }
  sema_error(s, e->at, "'%s' needs integer operands", op_text(e->op));
  return ERR;
}

static bool is_comparison(int op) { return strchr("<>lgen", op) != NULL; }

// a REL b: on numbers a boolean now; on tensors a COMPARE node, 1 where it holds and 0 elsewhere.
static Val comparison(Sema *s, const Expr *e, Val a, Val b) {
  static const char ops[] = "<l>gen";
  int64_t rel = strchr(ops, e->op) - ops; // CMP_LT, CMP_LE, ... in Compare's order
  if (a.kind == V_BOOL || b.kind == V_BOOL) {
    sema_error(s, e->at, "'%s' compares numbers and tensors, not booleans", op_text(e->op));
    return ERR;
  }
  if (a.kind != V_TENSOR && b.kind != V_TENSOR) {
    double x = a.kind == V_INT ? (double)a.i : a.f, y = b.kind == V_INT ? (double)b.i : b.f;
    return (Val){.kind = V_BOOL, .i = interp_compare(rel, x, y) != 0};
  }
  int in[2];
  if (!sema_operand_nodes(s, arena_printf(s->a, "'%s'", op_text(e->op)), e->at, (Val[]){a, b},
                          (SrcLoc[]){e->lhs->at, e->rhs->at}, 2, in))
    return ERR;
  return sema_add_op(s, OP_COMPARE, in, 2, (int64_t[8]){rel}, NULL, e->at);
}

static bool is_transpose(const Expr *e) { return e->kind == E_ATTR && !strcmp(e->s, "T"); }

// v.T (e is the .T expression): a PERMUTE swapping the last two axes.
static Val transpose(Sema *s, const Expr *e, Val v) {
  if (v.kind == V_ERR)
    return ERR;
  if (v.kind != V_TENSOR || node(s, v.node)->shape.rank < 2) {
    sema_error(s, e->at, "'.T' needs a tensor of rank 2 or more, got %s",
               v.kind == V_TENSOR ? sema_shape_text(s, node(s, v.node)->shape) : sema_describe(v));
    return ERR;
  }
  int r = node(s, v.node)->shape.rank;
  int64_t perm[IR_NIA] = {0};
  for (int i = 0; i < r; i++)
    perm[i] = i;
  perm[r - 2] = r - 1;
  perm[r - 1] = r - 2;
  return sema_add_op(s, OP_PERMUTE, &v.node, 1, perm, NULL, e->at);
}

// A `.T` operand of @ becomes the matmul's transpose flag rather than a PERMUTE node.
static Val matmul_operand(Sema *s, const Expr *e, bool *transposed) {
  *transposed = false;
  if (!is_transpose(e))
    return sema_eval(s, e);
  Val v = sema_eval(s, e->lhs);
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
    sema_error(s, e->at, "'@' needs two tensors, got %s and %s", sema_describe(a), sema_describe(b));
    return ERR;
  }
  Shape as = node(s, a.node)->shape, bs = node(s, b.node)->shape;
  int64_t flags[8] = {ta, tb};
  if (as.rank > 2 && bs.rank == 2 && !ta) {
    int64_t k = as.d[as.rank - 1];
    if (k == (tb ? bs.d[1] : bs.d[0])) {
      Shape flat = {.rank = 2, .d = {shape_numel(as) / k, k}};
      Val a2 = sema_reshape(s, a.node, flat, e->at);
      if (a2.kind == V_ERR)
        return ERR;
      Val c = sema_add_op(s, OP_MATMUL, (int[]){a2.node, b.node}, 2, flags, NULL, e->at);
      if (c.kind == V_ERR)
        return ERR;
      Shape out = as;
      out.d[out.rank - 1] = tb ? bs.d[0] : bs.d[1];
      return sema_reshape(s, c.node, out, e->at);
    }
  }
  return sema_add_op(s, OP_MATMUL, (int[]){a.node, b.node}, 2, flags, NULL, e->at);
}

static Val binary(Sema *s, const Expr *e) {
  if (e->op == '@')
    return matmul(s, e);
  Val a = sema_eval(s, e->lhs), b = sema_eval(s, e->rhs);
  if (a.kind == V_ERR || b.kind == V_ERR)
    return ERR;
  if (a.kind == V_TUPLE || b.kind == V_TUPLE) {
    sema_error(s, e->at, "'%s' cannot take the several values of %s(); unpack them first", op_text(e->op),
               (a.kind == V_TUPLE ? a : b).topk ? "topk" : "split");
    return ERR;
  }
  if (is_comparison(e->op))
    return comparison(s, e, a, b);
  if (a.kind != V_TENSOR && b.kind != V_TENSOR)
    return arith_scalar(s, e, a, b);
  if (a.kind == V_BOOL || b.kind == V_BOOL) {
    sema_error(s, e->at, "'%s' does not apply to booleans", op_text(e->op));
    return ERR;
  }
  int in[2];
  if (!sema_operand_nodes(s, arena_printf(s->a, "'%s'", op_text(e->op)), e->at, (Val[]){a, b},
                          (SrcLoc[]){e->lhs->at, e->rhs->at}, 2, in))
    return ERR;
  bool ints = node(s, in[0])->dtype == DT_I32;
  if ((e->op == '%' || e->op == 'q') && !ints) {
    sema_error(s, e->at, "'%s' applies to integers (i32 tensors, dims and consts), not to %s tensors", op_text(e->op),
               dtype_name(node(s, in[0])->dtype));
    return ERR;
  }
  if ((e->op == '%' || e->op == 'q') && b.kind == V_INT && b.i == 0) {
    sema_error(s, e->at, "division by zero");
    return ERR;
  }
  if (e->op == '/' && ints) {
    sema_error(s, e->at, "'/' does not apply to i32 tensors: a // b is the integer quotient, float(a) / b a float one");
    return ERR;
  }
  Op op = e->op == '+'   ? OP_ADD
          : e->op == '-' ? OP_SUB
          : e->op == '*' ? OP_MUL
          : e->op == '/' ? OP_DIV
          : e->op == 'q' ? OP_FLOORDIV
                         : OP_MOD;
  return sema_add_op(s, op, in, 2, NULL, NULL, e->at);
}

static Val negate(Sema *s, const Expr *e) {
  Val v = sema_eval(s, e->lhs);
  switch (v.kind) {
  case V_ERR: return ERR;
  case V_INT:
    if (v.i == INT64_MIN) {
      sema_error(s, e->at, "integer overflow in dimension arithmetic");
      return ERR;
    }
    return int_val(-v.i);
  case V_FLOAT: return float_val(-v.f);
  case V_TENSOR: return sema_add_op(s, OP_NEG, &v.node, 1, NULL, NULL, e->at);
  default: sema_error(s, e->at, "unary '-' does not apply to %s", sema_describe(v)); return ERR;
  }
}

static Val attr(Sema *s, const Expr *e) {
  if (!is_transpose(e)) {
    sema_error(s, e->at, "unknown attribute '.%s' (the only one is .T)", e->s);
    return ERR;
  }
  return transpose(s, e, sema_eval(s, e->lhs));
}

// Evaluates e to an integer (dims, consts, literals and their arithmetic).
static bool int_of(Sema *s, const Expr *e, const char *what, int64_t *out) {
  Val v = sema_eval(s, e);
  if (v.kind == V_ERR)
    return false;
  if (v.kind != V_INT) {
    sema_error(s, e->at, "%s must be an integer, got %s", what, sema_describe(v));
    return false;
  }
  *out = v.i;
  return true;
}

// x[i, a:b, :]: SLICE per restricted axis; integer indices then drop their axes with a RESHAPE.
static Val index_expr(Sema *s, const Expr *e) {
  Val v = sema_eval(s, e->lhs);
  if (v.kind == V_ERR)
    return ERR;
  if (v.kind != V_TENSOR) {
    sema_error(s, e->at, "only tensors can be indexed, not %s", sema_describe(v));
    return ERR;
  }
  Shape sh = node(s, v.node)->shape;
  if (e->nargs > sh.rank) {
    sema_error(s, e->at, "%d indices for a tensor of rank %d", e->nargs, sh.rank);
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
        sema_error(s, ix->at, "index %lld is out of range for axis %d of size %lld", (long long)lo, ax, (long long)n);
        return ERR;
      }
      lo = i;
      hi = i + 1;
    } else if (ix) {
      if ((ix->lo && !int_of(s, ix->lo, "a slice bound", &lo)) || (ix->hi && !int_of(s, ix->hi, "a slice bound", &hi)))
        return ERR;
      int64_t a = lo < 0 ? lo + n : lo, b = hi < 0 ? hi + n : hi;
      if (a < 0 || b > n || a >= b) {
        sema_error(s, ix->at, "slice %lld:%lld is empty or out of range for axis %d of size %lld", (long long)lo,
                   (long long)hi, ax, (long long)n);
        return ERR;
      }
      lo = a;
      hi = b;
    }
    if (hi - lo != n) {
      Val sl = sema_add_op(s, OP_SLICE, &x, 1, (int64_t[8]){ax, lo, hi}, NULL, ix->at);
      if (sl.kind == V_ERR)
        return ERR;
      x = sl.node;
    }
    if (!single)
      kept.d[kept.rank++] = hi - lo;
  }
  if (kept.rank == sh.rank)
    return tensor_val(x);
  return sema_reshape(s, x, kept, e->at);
}

static int tensor_arg(Sema *s, const Builtin *b, const Expr *e, const char *what) {
  Val v = sema_eval(s, e);
  if (v.kind == V_ERR)
    return -1;
  if (v.kind != V_TENSOR) {
    sema_error(s, e->at, "%s: %s must be a tensor, got %s", b->name, what, sema_describe(v));
    return -1;
  }
  return v.node;
}

static bool int_arg(Sema *s, const Builtin *b, const Expr *e, const char *what, int64_t *out) {
  return int_of(s, e, arena_printf(s->a, "%s: %s", b->name, what), out);
}

static bool float_arg(Sema *s, const Builtin *b, const Expr *e, const char *what, double *out) {
  Val v = sema_eval(s, e);
  if (v.kind == V_ERR)
    return false;
  if (v.kind != V_INT && v.kind != V_FLOAT) {
    sema_error(s, e->at, "%s: %s must be a number, got %s", b->name, what, sema_describe(v));
    return false;
  }
  *out = v.kind == V_INT ? (double)v.i : v.f;
  return true;
}

static bool bool_arg(Sema *s, const Builtin *b, const Expr *e, const char *what, int64_t *out) {
  Val v = sema_eval(s, e);
  if (v.kind == V_ERR)
    return false;
  if (v.kind != V_BOOL) {
    sema_error(s, e->at, "%s: %s must be true or false, got %s", b->name, what, sema_describe(v));
    return false;
  }
  *out = v.i != 0;
  return true;
}

// The integers of a list literal such as [B, T, -1].
static bool int_list(Sema *s, const Builtin *b, const Expr *e, const char *what, int64_t *out, int *n) {
  if (e->kind != E_LIST) {
    sema_error(s, e->at, "%s: %s must be a list such as [0, 2, 1]", b->name, what);
    return false;
  }
  if (e->nargs > IR_MAX_RANK) {
    sema_error(s, e->at, "%s: %s has %d entries; tensors have at most %d axes", b->name, what, e->nargs, IR_MAX_RANK);
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
    sema_error(s, list->at, "%s: the first argument must be a list of tensors, such as [a, b]", b->name);
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
    out->v = sema_eval(s, e);
    if (out->v.kind == V_ERR)
      return false;
    if (out->v.kind != V_TENSOR && out->v.kind != V_INT && out->v.kind != V_FLOAT) {
      sema_error(s, e->at, "%s: %s must be a tensor or a number, got %s", b->name, what, sema_describe(out->v));
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
  default: out->v = sema_eval(s, e); return out->v.kind != V_ERR;
  }
}

// Evaluates a call's arguments (arg, as sema_bind_args matched them) a group of b->kinds at a time; false
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
      sema_error(s, call->at, "%s: %s=N is required", b->name, b->params[k]);
      ok = false;
    }
    k++;
  }
  return ok;
}

static Val call(Sema *s, const Expr *e) {
  const Builtin *b = sema_find_builtin(s, e);
  const Expr *arg[BUILTIN_PARAMS];
  Arg val[BUILTIN_PARAMS];
  if (!b || !sema_bind_args(s, b, e, arg) || (b->form && !b->form(s, b, arg)) || !eval_args(s, b, e, arg, val))
    return ERR;
  return b->fn(s, b, e, arg, val);
}

static Val name_value(Sema *s, const Expr *e) {
  Sym *y = sema_lookup(s, e->s);
  if (!y) {
    sema_unknown_name(s, e);
    return ERR;
  }
  if (y->kind == SYM_DIM || y->kind == SYM_CONST)
    return sema_sym_value(s, y, e->at);
  if (y->kind == SYM_INDEX)
    return y->val;
  if (y->kind == SYM_REPEAT) {
    sema_error(s, e->at, "'%s' names a repeat block, not a value", e->s);
    return ERR;
  }
  if (s->constant) {
    sema_error(s, e->at, "'%s' is %s; only dims and consts can be used here", e->s, a_sym_kind[y->kind]);
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
  case E_STRING: sema_error(s, e->at, "a string is only allowed in the train section's no_decay list"); break;
  case E_SIZE: sema_error(s, e->at, "a size is only allowed in the train section's checkpoint = auto(SIZE)"); break;
  case E_LIST: sema_error(s, e->at, "a list is not a value; lists are arguments of reshape, permute and concat"); break;
  case E_DICT: sema_error(s, e->at, "a {key: value} table is only allowed in the train section's lr_scale"); break;
  case E_SLICE: sema_error(s, e->at, "a slice a:b only goes inside x[...]"); break;
  case E_KWARG: sema_error(s, e->at, "'%s = ...' is only allowed as a call's argument", e->s); break;
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
    sema_error(s, st->at, "dim '%s' is not bound: set it in the train section or with -D %s=N", d->name, d->name);
    return ERR;
  }
  Val v = d->overridden ? int_val(d->override) : sema_eval(s, e);
  SrcLoc at = d->overridden ? st->at : e->at;
  if (v.kind == V_ERR)
    return ERR;
  if (v.kind != V_INT) {
    sema_error(s, at, "dim '%s' must be an integer, got %s", d->name, sema_describe(v));
    return ERR;
  }
  if (st->value)
    return v;
  int64_t lo, hi;
  if (!int_of(s, st->lo, "a dim bound", &lo) || !int_of(s, st->hi, "a dim bound", &hi))
    return ERR;
  if (v.i < lo || v.i > hi) {
    if (d->overridden)
      sema_error(s, st->at, "dim '%s' = %lld (from -D %s=%lld) is out of bounds %lld..%lld", d->name, (long long)v.i,
                 d->name, (long long)v.i, (long long)lo, (long long)hi);
    else
      sema_error(s, at, "dim '%s' = %lld is out of bounds %lld..%lld", d->name, (long long)v.i, (long long)lo,
                 (long long)hi);
    return ERR;
  }
  return v;
}

// Evaluates a dim or const on first use; a use while it is being evaluated closes a cycle.
// Evaluation recurses through nested expressions and the dims and consts they name; a depth limit
// turns a pathological text (a chain of 100000 additions or of dims naming the next) into one
// error instead of a stack overflow.
Val sema_eval(Sema *s, const Expr *e) {
  if (s->too_deep) // reported once; what is left of the text is likely the same again
    return ERR;
  if (s->depth >= SEMA_MAX_DEPTH) {
    sema_error(s, e->at, "nesting too deep: more than %d levels of expressions and the dims they name", SEMA_MAX_DEPTH);
    s->too_deep = true;
    return ERR;
  }
  s->depth++;
  Val v = eval_expr(s, e);
  s->depth--;
  return v;
}

Val sema_sym_value(Sema *s, Sym *y, SrcLoc use) {
  if (y->state == DONE)
    return y->val;
  if (y->state == EVALUATING) {
    int k = s->stack.n - 1;
    while (k > 0 && s->stack.v[k] != y)
      k--;
    char path[512] = "";
    for (int i = k; i < s->stack.n; i++)
      snprintf(path + strlen(path), sizeof path - strlen(path), "%s -> ", ((Sym *)s->stack.v[i])->name);
    sema_error(s, use, "reference cycle: %s%s", path, y->name);
    return ERR;
  }
  y->state = EVALUATING;
  vec_push(s->a, &s->stack, y);
  bool saved = s->constant;
  s->constant = true;
  Val v = y->kind == SYM_DIM ? dim_value(s, y) : sema_eval(s, y->decl->value);
  s->constant = saved;
  s->stack.n--;
  y->val = v;
  y->state = DONE;
  return v;
}

// A number setting in range r (an integer where `integer`), finite and within a float's range: the
// step computes with it in f32.
bool sema_number(Sema *s, const Expr *e, const char *what, Range r, bool integer, double *out) {
  Val v = eval_const(s, e);
  if (v.kind == V_ERR)
    return false;
  if (v.kind != V_INT && (integer || v.kind != V_FLOAT)) {
    sema_error(s, e->at, "%s must be %s, got %s", what, integer ? "an integer" : "a number", sema_describe(v));
    return false;
  }
  double x = v.kind == V_INT ? (double)v.i : v.f;
  static const char *const want[] = {"positive", "at least 0", "in [0, 1)"};
  if ((r == R_POSITIVE && !(x > 0)) || (r == R_NONNEG && !(x >= 0)) || (r == R_UNIT && !(x >= 0 && x < 1))) {
    sema_error(s, e->at, "%s must be %s, got %g", what, want[r], x);
    return false;
  }
  if (!(x <= FLT_MAX)) {
    sema_error(s, e->at, "%s must be finite and at most %g (a float's largest), got %g", what, FLT_MAX, x);
    return false;
  }
  *out = x;
  return true;
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
    sema_error(s, at, "a tensor has at most %d axes, this shape has %d", IR_MAX_RANK, rank);
    return false;
  }
  *out = (Shape){.rank = rank};
  int64_t numel = 1;
  bool overflow = false;
  for (int i = 0; i < rank; i++) {
    if (!int_of(s, dims[i], "a shape entry", &out->d[i]))
      return false;
    if (out->d[i] <= 0) {
      sema_error(s, dims[i]->at, "shape entry %s must be positive, got %lld", ast_text(s->a, s->p->text, dims[i]),
                 (long long)out->d[i]);
      return false;
    }
    overflow = overflow || __builtin_mul_overflow(numel, out->d[i], &numel);
  }
  if (overflow || numel > IR_MAX_NUMEL) {
    char count[32] = "more than 2^63";
    if (!overflow)
      snprintf(count, sizeof count, "%lld", (long long)numel);
    sema_error(s, at, "%s '%s': shape %s has %s elements; a tensor may have at most 2^36 (%lld)",
               st->kind == S_PARAM ? "param" : "input", st->name, sema_shape_text(s, *out), count,
               (long long)IR_MAX_NUMEL);
    return false;
  }
  return true;
}

// Binds a name to a value: rebinding a value (the closest one in scope: loop-carried values in a
// repeat body update the outer binding), or defining a new one in the current scope.
static void assign(Sema *s, const char *name, SrcLoc at, Val v) {
  Sym *y = sema_lookup(s, name);
  if (y && y->kind != SYM_VALUE) {
    if (sema_error(s, at, "cannot assign to %s '%s'", sym_kind[y->kind], name))
      diag_note(y->at, "'%s' is defined here", name);
    return;
  }
  if (!y)
    y = sema_add_sym(s, s->scope, name, SYM_VALUE, at);
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
        sema_error(s, st->names_at[i], "'%s' is assigned twice in one statement", st->names[i]);
        return;
      }
  Val v = sema_eval(s, st->value);
  if (st->nnames == 1 && v.kind == V_TUPLE) {
    sema_error(s, st->at, "%s gives %d values; unpack them into %d names", v.topk ? "topk" : "split", v.ntuple,
               v.ntuple);
    v = ERR;
  } else if (st->nnames > 1 && v.kind != V_ERR && (v.kind != V_TUPLE || v.ntuple != st->nnames)) {
    sema_error(s, st->at, "%d names, but the right side gives %d value%s", st->nnames,
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
    sema_error(s, st->dtype_at, "unknown dtype '%s' (inputs are i32 or f32)", st->dtype);
  Sym *y = sema_define(s, st->name, SYM_INPUT, st->at);
  Shape sh;
  bool ok = eval_shape(s, st, &sh);
  if (!y || !ok || !known)
    return;
  int id = ir_leaf(s->g, OP_INPUT, st->name, st->dtype[0] == 'i' ? DT_I32 : DT_F32, sh, st->at);
  if (id < 0)
    sema_error(s, st->at, "%s", s->g->err);
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
    if (!sema_bind_args(s, &b, e, arg) || !sema_number(s, arg[0], "normal: std", R_NONNEG, false, &std))
      return false;
    *init = (ParamInit){.kind = INIT_NORMAL, .std = std};
    return true;
  }
  sema_error(s, e->at, "unknown initializer '%s' (use normal(std), zeros or ones)", ast_text(s->a, s->p->text, e));
  return false;
}

static void param_stmt(Sema *s, const Stmt *st) {
  Sym *y = sema_define(s, st->name, SYM_PARAM, st->at);
  Shape sh;
  ParamInit init = {0};
  bool ok = eval_shape(s, st, &sh);
  ok = param_init(s, st->value, &init) && ok;
  if (!y || !ok)
    return;
  int64_t bytes = 4 * shape_numel(sh); // at most 2^38: eval_shape bounds the elements
  if (s->param_bytes + bytes > MDL_MAX_PARAM_BYTES || s->g->nparams >= MDL_MAX_PARAMS) {
    sema_error(s, st->at, "param '%s' takes the model past %s", st->name,
               s->g->nparams >= MDL_MAX_PARAMS ? arena_printf(s->a, "%d parameter tensors", MDL_MAX_PARAMS)
                                            : "2^42 bytes (4 TiB) of f32 parameters");
    s->over_limit = true;
    return;
  }
  int id = ir_leaf(s->g, OP_PARAM, arena_printf(s->a, "%s%s", s->scope->prefix, st->name), DT_F32, sh, st->at);
  if (id < 0) {
    sema_error(s, st->at, "%s", s->g->err);
    return;
  }
  s->param_bytes += bytes;
  init.decay = true;
  node(s, id)->init = init;
  y->val = tensor_val(id);
}

static void output_stmt(Sema *s, const Stmt *st) {
  Val v = sema_eval(s, st->value);
  if (v.kind != V_ERR && v.kind != V_TENSOR) {
    sema_error(s, st->value->at, "output '%s' must be a tensor, got %s", st->name, sema_describe(v));
    v = ERR;
  } else if (v.kind == V_TENSOR && node(s, v.node)->dtype == DT_I32) { // (metrics and logits are read as f32)
    sema_error(s, st->value->at, "output '%s' is an i32 tensor; outputs are f32: write float(...)", st->name);
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
    sema_error(s, st->at, "output 'loss' must be a scalar f32 (shape []), got %s%s", dtype_name(n->dtype),
               sema_shape_text(s, n->shape));
  else
    s->g->loss = v.node;
}

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
    Sym *dim = st->value->kind == E_NAME ? sema_lookup(s, st->value->s) : NULL;
    char what[96];
    snprintf(what, sizeof what, cost_what[k], total_text);
    if (sema_error(s, st->value->at, "repeat %s[%s]: %s%lld repetitions would %s (%lld per repetition); the limit is %lld",
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
    sema_error(s, st->value->at, "a repeat count must not be negative, got %lld", (long long)n);
    return;
  }
  if (!sema_define(s, st->name, SYM_REPEAT, st->at))
    return;
  Sym *taken = st->index ? sema_lookup(s, st->index) : NULL;
  if (taken) {
    if (sema_error(s, st->index_at, "duplicate definition of '%s'", st->index))
      diag_note(taken->at, "previous definition is here");
    return;
  }
  Cost before = cost_now(s);
  for (int64_t i = 0; i < n && !s->over_limit && !diag_stopped(); i++) {
    s->stmts++; // an empty body still costs its repetitions
    Scope sc = {.up = s->scope, .prefix = arena_printf(s->a, "%s%s.%lld.", s->scope->prefix, st->name, (long long)i)};
    s->scope = &sc;
    if (st->index)
      sema_add_sym(s, &sc, st->index, SYM_INDEX, st->index_at)->val = int_val(i);
    int outer = s->g->cur_body;
    s->g->cur_body = ++s->g->nbodies; // the checkpoint pass's unit (IrNode.body)
    sema_elaborate(s, st->body, st->nbody);
    s->g->cur_body = outer;
    s->scope = sc.up;
    if (i == 0 && !repeat_fits(s, st, n, before))
      return;
  }
}

void sema_elaborate(Sema *s, Stmt **body, int n) {
  for (int i = 0; i < n && !s->over_limit && !diag_stopped(); i++) {
    const Stmt *st = body[i];
    if (st->rejected)
      continue;
    if (++s->stmts > MDL_MAX_STMTS || s->g->n > MDL_MAX_NODES) { // a huge text, no repeat needed
      bool nodes = s->g->n > MDL_MAX_NODES;
      sema_error(s, st->at, "the model is too large: more than %d %s", nodes ? MDL_MAX_NODES : MDL_MAX_STMTS,
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
