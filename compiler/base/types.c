// types.c: what the IR's types say of themselves: the names of ops, dtypes and optimizer rules, a
// dtype's size and bf16 rounding, a shape's size, equality, text and broadcasting, a dim's bound
// value. The base under the compiler and the runtime: both read the IR's types through these.
#include "mdl.h"

#include <string.h>

static const char *op_names[] = {
#define X(op, name) name,
    IR_OPS(X)
#undef X
};

const char *op_name(Op op) { return op < OP_COUNT ? op_names[op] : "?"; }

const char *opt_rule_name(OptRule r) {
  return r == OPT_SGD ? "sgd" : r == OPT_LION ? "lion" : r == OPT_MUON ? "muon" : "adamw";
}

int opt_rule_moments(OptRule r, double momentum) {
  return r == OPT_ADAMW ? 2 : r == OPT_LION || r == OPT_MUON || momentum != 0;
}

const char *dtype_name(DType dt) {
  switch (dt) {
  case DT_F32: return "f32";
  case DT_I32: return "i32";
  case DT_BF16: return "bf16";
  case DT_F8E4M3: return "f8e4m3";
  case DT_F8E5M2: return "f8e5m2";
  case DT_F64: return "f64";
  }
  return "?";
}

int dtype_size(DType dt) {
  switch (dt) {
  case DT_BF16: return 2;
  case DT_F8E4M3: case DT_F8E5M2: return 1;
  case DT_F64: return 8;
  case DT_F32: case DT_I32: return 4;
  }
  return 4;
}

double round_bf16(double x) {
  float f = (float)x;
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return x; // NaN
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  memcpy(&f, &u, 4);
  return f;
}

int64_t shape_numel(Shape s) {
  int64_t n = 1;
  for (int i = 0; i < s.rank; i++)
    n *= s.d[i];
  return n;
}

bool shape_eq(Shape a, Shape b) {
  if (a.rank != b.rank)
    return false;
  for (int i = 0; i < a.rank; i++)
    if (a.d[i] != b.d[i])
      return false;
  return true;
}

char *shape_str(Shape s, char *buf, size_t n) {
  size_t k = (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < s.rank && k < n; i++)
    k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? "," : "", (long long)s.d[i]);
  if (k < n)
    snprintf(buf + k, n - k, "]");
  return buf;
}

Shape shape_of(int rank, const int64_t *d) {
  Shape s = {.rank = rank};
  for (int i = 0; i < rank; i++)
    s.d[i] = d[i];
  return s;
}

int64_t shape_bcast_offset(Shape out, Shape in, int64_t idx) {
  int64_t off = 0, stride = 1;
  for (int k = out.rank - 1, j = in.rank - 1; k >= 0; k--, j--) {
    int64_t c = idx % out.d[k];
    idx /= out.d[k];
    if (j < 0)
      continue;
    if (in.d[j] != 1)
      off += c * stride;
    stride *= in.d[j];
  }
  return off;
}

int64_t ir_dim(const Graph *g, const char *name) {
  for (int i = 0; i < g->ndims; i++)
    if (!strcmp(g->dims[i].name, name))
      return g->dims[i].value;
  return -1;
}
