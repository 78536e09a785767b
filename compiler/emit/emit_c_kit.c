// emit_c_kit.c: the C emitter's toolkit, what its loop families build with: lines and notes, kernel
// pointers, the evaluator's hooks (how a value is named, read and stored), elementwise loops, row loops
// with per-thread scratch rows and GEMM operands widened to f32. See emit_c.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_c_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

//
// Lines and scopes.
//

void c_note(Emit *e, const char *fmt, ...) {
  ec_bput(&e->notes, "//   ");
  va_list ap;
  va_start(ap, fmt);
  ec_bvput(&e->notes, fmt, ap);
  va_end(ap);
  ec_bput(&e->notes, "\n");
}

void c_par_for(Emit *e, int64_t work, const char *schedule) {
  if (work >= PAR_MIN) {
    ec_line(&e->core, "#pragma omp parallel for num_threads(h->nthreads) schedule(%s)", schedule);
    e->uses_h = true;
  }
}

const char *c_str(Emit *e, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return arena_strdup(e->core.a, buf);
}

// A float literal that reads back as the same float, in as few digits as that takes.
const char *c_flit(Emit *e, double v) { return ec_flit(&e->core, v); }

//
// Buffers: every node read or written through memory gets one pointer, declared at the top of its
// kernel: its arena slot, a scratch buffer, or (a GEMM root) the buffer of its epilogue's output.
//

// Marks c's pointer as used; the declarations are written, in node order, when the kernel is done.
int c_ptr(Emit *e, int c) {
  if (e->declared[c])
    return c;
  if (ec_offset(&e->core, c) < 0 && e->core.host[c] < 0 && !e->core.scratch[c])
    ec_fail(&e->core, "node %d (%s) has no buffer in step %s", c, op_name(ec_node(&e->core, c)->op),
            e->core.f->steps[e->core.si].name);
  if (e->core.host[c] >= 0)
    c_ptr(e, e->core.host[c]);
  e->declared[c] = true;
  e->decls[e->ndecls++] = c;
  return c;
}

//
// The evaluator's hooks (emit_walk.h: EmitTarget).
//

// A local is named after its node and index (v12_i), which kernel_key numbers when it compares kernels.
const char *c_local(EmitCore *core, int c, const char *ix) { return ec_str(core, "v%d_%s", c, ix); }

// (A bf16 CAST's value is rounded already: its bits are stored as they are, not rounded again.)
void c_store(EmitCore *core, int c, const char *ix, const char *v) {
  const IrNode *nd = ec_node(core, c);
  bool rounded = nd->op == OP_CAST && nd->ia[0] == DT_BF16 && nd->dtype == DT_BF16;
  ec_line(core, "b%d[%s] = %s;", c_ptr((Emit *)core, c), ix,
          rounded ? ec_str(core, "mdl_bf16_bits(%s)", v) : ec_store(core, c, v));
}

const char *c_base(EmitCore *core, int n) { return ec_str(core, "b%d", c_ptr((Emit *)core, n)); }

const char *c_seed(EmitCore *core) {
  ((Emit *)core)->uses_h = true;
  return "h->seed";
}

const char *c_fp8_cast(EmitCore *core, const IrNode *cast, const char *x) {
  ((Emit *)core)->uses_h = true;
  return ec_str(core, "mdl_cast_%s(h, %lld, %s)", cast->ia[0] == DT_F8E5M2 ? "e5m2" : "e4m3", (long long)cast->ia[1], x);
}

//
// Elementwise loops, each a phase: its stores count as written after it.
//

// One elementwise loop over `numel` elements writing nodes[0..k) (all of that size). post_anchor
// names the GEMM whose epilogue this is, or -1. Over rows of the nodes' last axis when there are
// enough of them (ROW_MIN): a value broadcast along rows (a bias) is then read at the column c, so
// the loop over a row vectorizes (as i % width, it would be a gather, and GCC leaves it scalar).
enum { ROW_MIN = 16 };

void c_pw_loop(EmitCore *core, const int *nodes, int k, int64_t numel, int post_anchor, const char *role) {
  Emit *e = (Emit *)core;
  (void)role; // (a loop of the C target has no name of its own)
  ec_phase_begin(&e->core);
  Buf b = {0};
  for (int t = 0; t < k; t++)
    ec_bput(&b, "%s%%%d", t ? " " : "", nodes[t]);
  c_note(e, "elementwise over %lld: %s", (long long)numel, b.s ? b.s : "");
  free(b.s);
  c_par_for(e, numel, "static");
  int64_t w = ec_last_dim(&e->core, nodes[0]);
  if (w >= ROW_MIN && numel / w >= ROW_MIN && numel % w == 0) {
    ec_enter(&e->core, "for (int64_t r = 0; r < %lld; r++)", (long long)(numel / w));
    ec_enter(&e->core, "for (int64_t c = 0; c < %lld; c++)", (long long)w);
    ec_line(&e->core, "const int64_t i = r * %lld + c;", (long long)w);
    e->core.row_ix = "i";
    e->core.row_r = "r";
    e->core.row_w = w;
  } else {
    ec_enter(&e->core, "for (int64_t i = 0; i < %lld; i++)", (long long)numel);
  }
  e->core.loop_ix = "i";
  e->core.loop_n = numel;
  e->core.post_anchor = post_anchor;
  e->core.post_ix = "i";
  e->core.post_inloop = false;
  ew_pw_values(&e->core, nodes, k, "i");
  ec_leave(&e->core);
  if (e->core.row_ix)
    ec_leave(&e->core);
  e->core.row_ix = NULL;
  e->core.loop_ix = NULL;
  e->core.post_anchor = -1;
  e->core.cur_q = -1;
  ec_phase_end(&e->core);
}

Rows c_rows_at(Emit *e, int buf, int64_t off, int64_t stride) {
  return (Rows){off ? c_str(e, "b%d + %lld", c_ptr(e, buf), (long long)off) : c_str(e, "b%d", c_ptr(e, buf)), stride,
                buf, off};
}

// n's rows (last axis) in memory: n itself, or a SLICE of the last axis of a tensor in memory (q, k,
// v out of one qkv buffer), read in place with that tensor's stride.
Rows c_rows_of(Emit *e, int n) {
  int src;
  int64_t start;
  if (ec_row_slice(&e->core, n, &src, &start))
    return c_rows_at(e, src, start, ec_last_dim(&e->core, src));
  return c_rows_at(e, ec_need(&e->core, n), 0, ec_last_dim(&e->core, n));
}

// The rows r of a GEMM's operand as f32: a bf16 operand reads them from its buffer widened into
// w<buf> (emitted here, once per group however many operands read that buffer; wide[] lists the
// buffers to free after the group).
Rows c_widened(Emit *e, Rows r, int *wide, int *nwide) {
  if (ec_node(&e->core, r.buf)->dtype != DT_BF16)
    return r;
  bool have = false;
  for (int i = 0; i < *nwide; i++)
    have |= wide[i] == r.buf;
  if (!have) {
    e->uses_h = true;
    ec_line(&e->core, "float *const w%d = mdl_widen_bf16(b%d, %lld, h->nthreads);", r.buf, c_ptr(e, r.buf),
            (long long)ec_numel(&e->core, r.buf));
    wide[(*nwide)++] = r.buf;
  }
  r.base = r.off ? c_str(e, "w%d + %lld", r.buf, (long long)r.off) : c_str(e, "w%d", r.buf);
  return r;
}

void c_free_widened(Emit *e, const int *wide, int nwide) {
  for (int i = 0; i < nwide; i++)
    ec_line(&e->core, "mdl_free(w%d);", wide[i]);
}

//
// Loops over rows with per-thread scratch rows.
//

void c_rows_open(Emit *e, const char *var, int64_t rows, int64_t work, const Tmp *tmp, int ntmp) {
  bool par = work >= PAR_MIN;
  if (ntmp) {
    if (par) {
      ec_line(&e->core, "#pragma omp parallel num_threads(h->nthreads)");
      e->uses_h = true;
    }
    ec_enter(&e->core, "%s", "");
    for (int i = 0; i < ntmp; i++)
      ec_line(&e->core, "float *%s = mdl_scratch(%lld * sizeof(float));", tmp[i].name, (long long)tmp[i].n);
    if (par)
      ec_line(&e->core, "#pragma omp for schedule(static)");
  } else {
    c_par_for(e, work, "static");
  }
  ec_enter(&e->core, "for (int64_t %s = 0; %s < %lld; %s++)", var, var, (long long)rows, var);
}

void c_rows_close(Emit *e, const Tmp *tmp, int ntmp) {
  ec_leave(&e->core);
  if (ntmp) {
    for (int i = 0; i < ntmp; i++)
      ec_line(&e->core, "mdl_free(%s);", tmp[i].name);
    ec_leave(&e->core);
  }
}

// Inside a row loop over r: a pointer named `name` to row r of x (cols wide), computed inline into
// the per-thread row `tmp` when x is not in memory.
void c_row_ptr(Emit *e, int x, const char *name, const char *tmp, int64_t cols) {
  int a = ec_mem_alias(&e->core, x);
  if (a >= 0) {
    ec_line(&e->core, "const %s *%s = b%d + r * %lld;", ec_ctype(&e->core, a), name, c_ptr(e, a), (long long)cols);
    return;
  }
  ec_enter(&e->core, "for (int64_t j = 0; j < %lld; j++)", (long long)cols);
  ec_line(&e->core, "const int64_t ix = r * %lld + j;", (long long)cols);
  const char *save = e->core.loop_ix;
  int64_t save_n = e->core.loop_n;
  e->core.loop_ix = "ix";
  e->core.loop_n = ec_numel(&e->core, x);
  ec_line(&e->core, "%s[j] = %s;", tmp, ew_val(&e->core, x, "ix"));
  e->core.loop_ix = save;
  e->core.loop_n = save_n;
  ec_leave(&e->core);
  ec_line(&e->core, "const float *%s = %s;", name, tmp);
}

// Is x read inline (not in memory)? Then the row loop needs a scratch row for it.
bool c_row_inline(Emit *e, int x) {
  if (ec_mem_alias(&e->core, x) >= 0)
    return false;
  int c = ec_canon(&e->core, x);
  if (e->core.in_step[c] && ec_is_pointwise(ec_node(&e->core, c)->op))
    return true;
  ec_need(&e->core, x); // a constant or an anchor kept as a local: in memory first
  return false;
}

// Declares `double sum`, the sum over j in [0, n) of ej = `expr` (stored in dst[j] too unless dst is
// NULL): 16 f32 lanes by the element's place in a block of 256, each block's lanes added into 16
// double lanes, then a fixed tree. The order depends on n alone (not on the alignment that a vector
// loop peels for), the f32 part of each lane sums 16 terms, and the loop vectorizes: a sum in double
// lanes halves the vector width and measured 5-6x slower on the LM head's rows, GCC keeping each
// element's exp in scalar code.
void c_exp_sum(Emit *e, int64_t n, const char *expr, const char *dst) {
  ec_line(&e->core, "double sum;");
  ec_enter(&e->core, "%s", "");
  ec_line(&e->core, "double lane[16] = {0};");
  ec_enter(&e->core, "for (int64_t j0 = 0; j0 < %lld; j0 += 256)", (long long)n);
  ec_line(&e->core, "const int64_t j1 = j0 + 256 < %lld ? j0 + 256 : %lld;", (long long)n, (long long)n);
  ec_line(&e->core, "float part[16] = {0};");
  ec_line(&e->core, "int64_t k = j0;");
  ec_enter(&e->core, "for (; k + 16 <= j1; k += 16)");
  ec_enter(&e->core, "for (int64_t u = 0; u < 16; u++)");
  ec_line(&e->core, "const int64_t j = k + u;");
  ec_line(&e->core, "const float ej = %s;", expr);
  if (dst)
    ec_line(&e->core, "%s[j] = ej;", dst);
  ec_line(&e->core, "part[u] += ej;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  if (n % 16) { // the last block's tail (emitted only where there is one: GCC warns of part[] overrun)
    ec_enter(&e->core, "for (int64_t j = k; j < j1; j++)");
    ec_line(&e->core, "const float ej = %s;", expr);
    if (dst)
      ec_line(&e->core, "%s[j] = ej;", dst);
    ec_line(&e->core, "part[j - k] += ej;");
    ec_leave(&e->core);
  }
  ec_line(&e->core, "for (int u = 0; u < 16; u++)");
  ec_line(&e->core, "  lane[u] += part[u];");
  ec_leave(&e->core);
  ec_line(&e->core, "for (int w = 8; w > 0; w /= 2)");
  ec_line(&e->core, "  for (int u = 0; u < w; u++)");
  ec_line(&e->core, "    lane[u] += lane[u + w];");
  ec_line(&e->core, "sum = lane[0];");
  ec_leave(&e->core);
}
