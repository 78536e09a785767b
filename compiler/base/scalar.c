// scalar.c: the IR's elementwise ops at one number, as the reference interpreter computes them:
// the float unary ops, the comparisons, i32 arithmetic and the f32 -> i32 conversion. The front
// end's constant evaluation computes with the same functions, so a constant folded at compile time
// is the value the interpreter would give.
#include "mdl.h"

static double gelu(double x) {
  return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

static double sigmoid(double x) { return 1 / (1 + exp(-x)); }

double interp_unary(Op op, double x) {
  switch (op) {
  case OP_NEG: return -x;
  case OP_EXP: return exp(x);
  case OP_LOG: return log(x);
  case OP_TANH: return tanh(x);
  case OP_SQRT: return sqrt(x);
  case OP_RSQRT: return 1 / sqrt(x);
  case OP_RELU: return x > 0 ? x : 0;
  case OP_GELU: return gelu(x);
  case OP_SIGMOID: return sigmoid(x);
  case OP_ABS: return fabs(x);
  case OP_STOP_GRADIENT: return x;
  default: return x * sigmoid(x); // OP_SILU
  }
}

double interp_compare(int64_t rel, double a, double b) {
  switch (rel) {
  case CMP_LT: return a < b;
  case CMP_LE: return a <= b;
  case CMP_GT: return a > b;
  case CMP_GE: return a >= b;
  case CMP_EQ: return a == b;
  default: return a != b;
  }
}

int32_t interp_i32(Op op, int32_t a, int32_t b) {
  uint32_t ua = (uint32_t)a, ub = (uint32_t)b;
  switch (op) {
  case OP_NEG: return (int32_t)(0u - ua);
  case OP_ABS: return a < 0 ? (int32_t)(0u - ua) : a;
  case OP_ADD: return (int32_t)(ua + ub);
  case OP_SUB: return (int32_t)(ua - ub);
  case OP_MUL: return (int32_t)(ua * ub);
  case OP_FLOORDIV: case OP_MOD: {
    if (b == 0)
      return 0;
    int64_t q = (int64_t)a / b, r = (int64_t)a % b;
    if (r != 0 && (r < 0) != (b < 0)) {
      q--;
      r += b;
    }
    return (int32_t)(uint32_t)(op == OP_FLOORDIV ? q : r); // INT32_MIN // -1 wraps to INT32_MIN
  }
  default: return a;
  }
}

int32_t interp_to_i32(double x) {
  if (x != x)
    return 0;
  if (x >= 2147483647.0)
    return INT32_MAX;
  if (x <= -2147483648.0)
    return INT32_MIN;
  return (int32_t)x;
}
