// emit_cuda_rows.c: the CUDA emitter's row and reduction kernels (sums, norms forward and backward,
// softmax, embed and its backward, rope, masks). See emit_cuda.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_cuda.h"
#include "emit_cuda_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

//
// Rows (cu_row_shape): the loops over a thread's elements of a row.
//

// A loop over this thread's elements of row r: opens "for t", then "if (j < cols)" with ix = r * cols + j.
static void row_each(Emit *e, const RowShape *rs, int64_t cols) {
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int t = 0; t < %d; t++)", rs->npl);
  ec_line(&e->core, "const %s j = tr + t * %d;", e->core.ixt, rs->tpr);
  ec_enter(&e->core, "if (j < %lld)", (long long)cols);
  ec_line(&e->core, "const %s ix = r * %lld + j;", e->core.ixt, (long long)cols);
}

static void row_each_end(Emit *e) {
  ec_leave(&e->core);
  ec_leave(&e->core);
}

// This thread's elements of row r of x in registers (`name`[t]; 0 beyond the row), read from memory
// or computed inline (a step output met on the way is stored there).
static void row_load(Emit *e, const RowShape *rs, int x, const char *name, int64_t cols) {
  ec_line(&e->core, "float %s[%d];", name, rs->npl);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int t = 0; t < %d; t++)", rs->npl);
  ec_line(&e->core, "const %s j = tr + t * %d;", e->core.ixt, rs->tpr);
  int a = ec_mem_alias(&e->core, x);
  if (a >= 0) {
    ec_line(&e->core, "%s[t] = j < %lld ? %s : 0.0f;", name, (long long)cols,
            ec_load(&e->core, a, ec_str(&e->core, "%s[r * %lld + j]", cu_ptr(e, a), (long long)cols)));
  } else {
    ec_line(&e->core, "%s[t] = 0.0f;", name);
    ec_enter(&e->core, "if (j < %lld)", (long long)cols);
    ec_line(&e->core, "const %s ix = r * %lld + j;", e->core.ixt, (long long)cols);
    const char *save = e->core.loop_ix;
    int64_t save_n = e->core.loop_n;
    e->core.loop_ix = "ix";
    e->core.loop_n = ec_numel(&e->core, x);
    ec_line(&e->core, "%s[t] = %s;", name, ew_val(&e->core, x, "ix"));
    e->core.loop_ix = save;
    e->core.loop_n = save_n;
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
}

// Is x read inline (not in memory)? Constants and anchors kept as locals are queued for memory.
static bool row_inline(Emit *e, int x) {
  if (ec_mem_alias(&e->core, x) >= 0)
    return false;
  int c = ec_canon(&e->core, x);
  if (e->core.in_step[c] && ec_is_pointwise(ec_node(&e->core, c)->op))
    return true;
  ec_need(&e->core, x);
  return false;
}

// Column sums of partial results: array i holds parts[i][k * cols + r] for k < nb. A block per w
// columns (colsum_width), its threads in row groups: thread (g, r) adds rows g, g + groups, ..., then
// the groups' sums are added pairwise in shared memory (group g takes g + groups / 2, and so on down
// to group 0). The order is fixed (deterministic), and there are enough threads in flight for the
// memory: a thread per column left all but a few SMs idle. Opens the scope where thread group 0
// holds column r's totals in accs[i]; the caller closes it and ends the kernel with grid
// colsum_grid(nb, cols) and block colsum_block(nb).
static int colsum_groups(int64_t nb) { return nb >= 128 ? 32 : nb >= 16 ? 8 : 1; }
static int colsum_block(int64_t nb) { return 32 * colsum_groups(nb); }
// Columns per block: 32 (a warp reads 128 contiguous bytes of a row of f32 partials) while that
// still gives COLSUM_BLOCKS blocks, else 16 or 8 (row segments of 64 or 32 bytes): GPT-2's norms, of
// 768 columns, get 96 blocks of 8 rather than 24 of 32 on 132 SMs.
enum { COLSUM_BLOCKS = 128 };
static int colsum_width(int64_t nb, int64_t cols) {
  if (colsum_groups(nb) == 1)
    return 32;
  int w = 32;
  while (w > 8 && (cols + w - 1) / w < COLSUM_BLOCKS)
    w /= 2;
  return w;
}
static int64_t colsum_grid(int64_t nb, int64_t cols) {
  int w = colsum_width(nb, cols);
  return (cols + w - 1) / w;
}

static void colsum_open(Emit *e, int64_t nb, int64_t cols, const char *const *parts, const char *const *accs, int n,
                        bool max) {
  int w = colsum_width(nb, cols), groups = colsum_block(nb) / w;
  const char *t = max ? "float" : "double", *init = max ? "-MDL_INF" : "0.0", *ixt = e->core.ixt;
  for (int i = 0; i < n && groups > 1; i++)
    ec_line(&e->core, "__shared__ %s cs%d[%d][%d];", t, i, groups, w);
  e->shared += groups > 1 ? n * groups * w * (max ? 4 : 8) : 0;
  if (groups > 1)
    ec_line(&e->core, "const int tx = threadIdx.x %% %d, ty = threadIdx.x / %d;", w, w);
  else
    ec_line(&e->core, "const int tx = threadIdx.x, ty = 0;");
  ec_line(&e->core, "const %s r = blockIdx.x * %d + tx;", ixt, w);
  for (int i = 0; i < n; i++)
    ec_line(&e->core, "%s %s = %s;", t, accs[i], init);
  ec_enter(&e->core, "if (r < %lld)", (long long)cols);
  ec_enter(&e->core, "for (%s k = ty; k < %lld; k += %d)", ixt, (long long)nb, groups);
  for (int i = 0; i < n; i++)
    if (max)
      ec_line(&e->core, "%s = mdl_max_nan(%s, %s[k * %lld + r]);", accs[i], accs[i], parts[i], (long long)cols);
    else
      ec_line(&e->core, "%s += %s[k * %lld + r];", accs[i], parts[i], (long long)cols);
  ec_leave(&e->core);
  ec_leave(&e->core);
  if (groups == 1) {
    ec_enter(&e->core, "if (r < %lld)", (long long)cols);
    return;
  }
  for (int i = 0; i < n; i++)
    ec_line(&e->core, "cs%d[ty][tx] = %s;", i, accs[i]);
  ec_enter(&e->core, "for (int h = %d; h > 0; h >>= 1)", groups / 2);
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "if (ty < h)");
  for (int i = 0; i < n; i++)
    if (max)
      ec_line(&e->core, "cs%d[ty][tx] = %s = mdl_max_nan(%s, cs%d[ty + h][tx]);", i, accs[i], accs[i], i);
    else
      ec_line(&e->core, "cs%d[ty][tx] = %s += cs%d[ty + h][tx];", i, accs[i], i);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_enter(&e->core, "if (ty == 0 && r < %lld)", (long long)cols);
}

// The accumulation of one value v into acc: a sum, or a max where a NaN wins (as in interp.c).
static void accumulate(Emit *e, bool max) {
  if (max)
    ec_line(&e->core, "acc = mdl_max_nan(acc, v);");
  else
    ec_line(&e->core, "acc += v;");
}

// SUM / MEAN / MAX over one axis (the input as [outer, len, inner]), the input computed inline;
// TARGET_COUNT as a sum over all its targets of 1 for each counted one. Contiguous rows: a warp per
// output (a thread when rows are short); few long rows: per-block partials, then a warp per output
// adds them. Strided: a thread per output, or, for long axes, partials per block of the axis added in
// block order.
void cu_emit_reduce(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  EwReduce rd;
  ew_reduce_open(&e->core, gi, &rd);
  const char *init = rd.max ? "-MDL_INF" : "0.0", *ixt = e->core.ixt, *what = op_name(rd.nd->op);
  bool two = rd.inner == 1 ? rd.on < 128 && rd.len >= 32768 : rd.len >= 128 && rd.on <= 65536;
  if (!two && (rd.inner > 1 || rd.len <= 32)) {
    cu_kbegin(e, "");
    cu_note(e, "%s: %lld outputs over %lld elements, a thread per output", what, (long long)rd.on, (long long)rd.len);
    ec_enter(&e->core, "for (%s r = blockIdx.x * blockDim.x + threadIdx.x; r < %lld; r += gridDim.x * blockDim.x)", ixt,
             (long long)rd.on);
    if (rd.inner == 1)
      ec_line(&e->core, "const %s base = r * %lld;", ixt, (long long)rd.len);
    else
      ec_line(&e->core, "const %s base = r / %lld * %lld + r %% %lld;", ixt, (long long)rd.inner,
              (long long)(rd.len * rd.inner), (long long)rd.inner);
    ec_line(&e->core, "%s acc = %s;", rd.acc_t, init);
    ec_enter(&e->core, "for (%s l = 0; l < %lld; l++)", ixt, (long long)rd.len);
    ec_line(&e->core, "const %s ix = base + l%s;", ixt,
            rd.inner == 1 ? "" : ec_str(&e->core, " * %lld", (long long)rd.inner));
    e->core.loop_ix = "ix";
    e->core.loop_n = ec_numel(&e->core, rd.x);
    ec_reduce_input(&e->core, rd.a, rd.side, rd.nside);
    accumulate(e, rd.max);
    ec_leave(&e->core);
    ew_reduce_finish(&e->core, &rd);
    ec_leave(&e->core);
    cu_kend(e, cu_grid_for(rd.on, cu_block_for(rd.on)), cu_block_for(rd.on));
  } else if (!two) {
    cu_kbegin(e, "");
    cu_note(e, "%s: %lld outputs over %lld elements, a warp per output", what, (long long)rd.on, (long long)rd.len);
    ec_line(&e->core, "const %s r = blockIdx.x * %d + (threadIdx.x >> 5);", ixt, BLOCK / 32);
    ec_line(&e->core, "const int lane = threadIdx.x & 31;");
    ec_enter(&e->core, "if (r < %lld)", (long long)rd.on);
    ec_line(&e->core, "%s acc = %s;", rd.acc_t, init);
    ec_enter(&e->core, "for (%s l = lane; l < %lld; l += 32)", ixt, (long long)rd.len);
    ec_line(&e->core, "const %s ix = r * %lld + l;", ixt, (long long)rd.len);
    e->core.loop_ix = "ix";
    e->core.loop_n = ec_numel(&e->core, rd.x);
    ec_reduce_input(&e->core, rd.a, rd.side, rd.nside);
    accumulate(e, rd.max);
    ec_leave(&e->core);
    ec_line(&e->core, "acc = %s(acc);", rd.max ? "mdl_warp_max_nan" : "mdl_warp_sum");
    ec_enter(&e->core, "if (lane == 0)");
    ew_reduce_finish(&e->core, &rd);
    ec_leave(&e->core);
    ec_leave(&e->core);
    cu_kend(e, (rd.on + BLOCK / 32 - 1) / (BLOCK / 32), BLOCK);
  } else if (rd.inner == 1) {
    int64_t bl = 8192, nb = (rd.len + bl - 1) / bl;
    int64_t part = cu_scratch_alloc(e, rd.on * nb * 8);
    cu_kbegin(e, "partial");
    cu_note(e, "%s: %lld outputs over %lld elements, first %lld blocks of %lld per output", what, (long long)rd.on,
            (long long)rd.len, (long long)nb, (long long)bl);
    const char *p = cu_raw_ptr(e, part, rd.acc_t, "partial results");
    ec_line(&e->core, "const %s r = blockIdx.x / %lld, k = blockIdx.x %% %lld;", ixt, (long long)nb, (long long)nb);
    ec_line(&e->core, "const %s end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", ixt, (long long)bl,
            (long long)bl, (long long)rd.len, (long long)bl, (long long)bl, (long long)rd.len);
    ec_line(&e->core, "%s acc = %s;", rd.acc_t, init);
    ec_enter(&e->core, "for (%s l = k * %lld + threadIdx.x; l < end; l += blockDim.x)", ixt, (long long)bl);
    ec_line(&e->core, "const %s ix = r * %lld + l;", ixt, (long long)rd.len);
    e->core.loop_ix = "ix";
    e->core.loop_n = ec_numel(&e->core, rd.x);
    ec_reduce_input(&e->core, rd.a, rd.side, rd.nside);
    accumulate(e, rd.max);
    ec_leave(&e->core);
    ec_line(&e->core, "acc = %s;",
            rd.max ? ec_str(&e->core, "mdl_block_max_nan(acc, %s)", cu_sh_float(e))
                : ec_str(&e->core, "mdl_block_sum(acc, %s)", cu_sh_double(e)));
    ec_line(&e->core, "if (threadIdx.x == 0)");
    ec_line(&e->core, "  %s[blockIdx.x] = acc;", p);
    cu_kend(e, rd.on * nb, BLOCK);
    cu_kbegin(e, "");
    cu_note(e, "%s: the %lld partial results of each output added in order, a warp per output", what, (long long)nb);
    p = cu_raw_ptr(e, part, rd.acc_t, "partial results");
    ec_line(&e->core, "const %s r = blockIdx.x * %d + (threadIdx.x >> 5);", ixt, BLOCK / 32);
    ec_line(&e->core, "const int lane = threadIdx.x & 31;");
    ec_enter(&e->core, "if (r < %lld)", (long long)rd.on);
    ec_line(&e->core, "%s acc = %s;", rd.acc_t, init);
    ec_enter(&e->core, "for (%s k = lane; k < %lld; k += 32)", ixt, (long long)nb);
    ec_line(&e->core, "const %s v = %s[r * %lld + k];", rd.acc_t, p, (long long)nb);
    accumulate(e, rd.max);
    ec_leave(&e->core);
    ec_line(&e->core, "acc = %s(acc);", rd.max ? "mdl_warp_max_nan" : "mdl_warp_sum");
    ec_enter(&e->core, "if (lane == 0)");
    ew_reduce_finish(&e->core, &rd);
    ec_leave(&e->core);
    ec_leave(&e->core);
    cu_kend(e, (rd.on + BLOCK / 32 - 1) / (BLOCK / 32), BLOCK);
  } else {
    // About two threads per thread slot of an H100/H200 (132 SMs of 2048): a column sum is bound by
    // memory, and only many loads in flight keep it busy. Where the columns come in fours (inner a
    // multiple of 4) a thread takes four adjacent columns, its loads and stores one float4 (ushort4)
    // for the four (a four-lane body, as pw_loop's), and the axis is cut into 4 times the blocks:
    // each column still adds its rows in order, and GPT-2's gelu backward column partials, a float
    // a thread per load with the stores between, moved their 250 MB at 1.9 TB/s on an H200.
    bool vec = rd.inner % 4 == 0;
    int64_t per = vec ? 4 : 1, goal = 262144 * per;
    int64_t nb = goal / rd.on < 1 ? 1 : goal / rd.on;
    if (nb > (rd.len + 7) / 8)
      nb = (rd.len + 7) / 8;
    int64_t bl = (rd.len + nb - 1) / nb;
    nb = (rd.len + bl - 1) / bl;
    int64_t part = cu_scratch_alloc(e, rd.on * nb * 8), work = rd.on / per * nb;
    cu_kbegin(e, "partial");
    // (sized for one wave of full SMs: 32 registers a thread, which ptxas meets with a 4-byte spill
    // where the four lanes' GELU backward took 37, 6 blocks of 256 an SM)
    e->min_blocks = vec && cu_block_for(work) == BLOCK ? FILL_SM : 0;
    cu_note(e, "%s: %lld outputs over %lld elements, first partial results over %lld blocks of %lld%s", what,
            (long long)rd.on, (long long)rd.len, (long long)nb, (long long)bl, vec ? ", 4 outputs per thread" : "");
    const char *p = cu_raw_ptr(e, part, rd.acc_t, "partial results");
    ec_enter(&e->core, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)", ixt,
             (long long)work);
    ec_line(&e->core, "const %s k = u / %lld, r = u %% %lld%s;", ixt, (long long)(rd.on / per),
            (long long)(rd.on / per), vec ? " * 4" : "");
    ec_line(&e->core, "const %s base = r / %lld * %lld + r %% %lld;", ixt, (long long)rd.inner,
            (long long)(rd.len * rd.inner), (long long)rd.inner);
    ec_line(&e->core, "const %s end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", ixt, (long long)bl,
            (long long)bl, (long long)rd.len, (long long)bl, (long long)bl, (long long)rd.len);
    e->core.loop_n = ec_numel(&e->core, rd.x);
    if (vec) {
      ec_line(&e->core, "%s acc0 = %s, acc1 = %s, acc2 = %s, acc3 = %s;", rd.acc_t, init, init, init, init);
      ec_enter(&e->core, "for (%s l = k * %lld; l < end; l++)", ixt, (long long)bl);
      ec_line(&e->core, "const %s i0 = base + l * %lld;", ixt, (long long)rd.inner);
      for (int lane = 1; lane < 4; lane++) // (each declaration on a line of its own: unused ones are dropped)
        ec_line(&e->core, "const %s i%d = i0 + %d;", ixt, lane, lane);
      ec_line(&e->core, "const %s q = i0 / 4; // the four lanes' float4", ixt);
      int mark = e->core.nphase;
      for (int lane = 0; lane < 4; lane++) {
        const char *ix = ec_str(&e->core, "i%d", lane);
        for (int i = mark; i < e->core.nphase; i++)
          e->core.stored[e->core.phase_nodes[i]] = false;
        e->core.nphase = mark;
        e->lane = lane;
        e->core.loop_ix = ix;
        const char *v = ew_val(&e->core, rd.x, ix);
        for (int t = 0; t < rd.nside; t++)
          if (!e->core.stored[rd.side[t]])
            ew_val(&e->core, rd.side[t], ix);
        if (rd.max)
          ec_line(&e->core, "acc%d = mdl_max_nan(acc%d, %s);", lane, lane, v);
        else
          ec_line(&e->core, "acc%d += %s;", lane, v);
      }
      cu_flush_lanes(e);
      e->lane = -1;
      ec_leave(&e->core);
      for (int lane = 0; lane < 4; lane++)
        ec_line(&e->core, "%s[k * %lld + r%s] = acc%d;", p, (long long)rd.on,
                lane ? ec_str(&e->core, " + %d", lane) : "", lane);
    } else {
      ec_line(&e->core, "%s acc = %s;", rd.acc_t, init);
      ec_enter(&e->core, "for (%s l = k * %lld; l < end; l++)", ixt, (long long)bl);
      ec_line(&e->core, "const %s ix = base + l * %lld;", ixt, (long long)rd.inner);
      e->core.loop_ix = "ix";
      ec_reduce_input(&e->core, rd.a, rd.side, rd.nside);
      accumulate(e, rd.max);
      ec_leave(&e->core);
      ec_line(&e->core, "%s[u] = acc;", p);
    }
    ec_leave(&e->core);
    cu_kend(e, cu_grid_for(work, BLOCK), cu_block_for(work));
    cu_kbegin(e, "");
    cu_note(e, "%s: the %lld partial results of each output added, a block per %d outputs in %d groups of rows",
            what, (long long)nb, colsum_width(nb, rd.on), colsum_block(nb) / colsum_width(nb, rd.on));
    p = cu_raw_ptr(e, part, rd.acc_t, "partial results");
    const char *acc = "acc";
    colsum_open(e, nb, rd.on, &p, &acc, 1, rd.max);
    ew_reduce_finish(&e->core, &rd);
    ec_leave(&e->core);
    cu_kend(e, colsum_grid(nb, rd.on), colsum_block(nb));
  }
  e->core.loop_ix = NULL;
  if (rd.buf)
    ec_phase_done(&e->core, rd.a);
  ec_phase_end(&e->core);
  ew_reduce_close(&rd);
}

// LAYERNORM / RMSNORM forward, a warp (or block) per row, the row in registers; x (the residual sum)
// computed inline.
void cu_emit_norm_fwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool ln = nd->op == OP_LAYERNORM;
  int64_t cols = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / cols;
  row_inline(e, nd->in[0]);
  int w = ec_need(&e->core, nd->in[1]), bias = ln ? ec_need(&e->core, nd->in[2]) : -1;
  ew_flush(&e->core);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), e->core.emitted, q);
  bool buf = ew_whole(&e->core, a);
  RowShape rs = cu_row_shape(e, cols, rows, 32);
  ec_phase_begin(&e->core);
  cu_kbegin(e, "");
  cu_note(e, "%s: %lld rows of %lld, %s per row", op_name(nd->op), (long long)rows, (long long)cols, cu_rs_who(e, &rs));
  cu_rows_open(e, &rs, "r");
  row_load(e, &rs, nd->in[0], "xv", cols);
  ec_line(&e->core, "double s = 0;");
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
  if (ln) {
    ec_line(&e->core, "  s += xv[t];");
    ec_line(&e->core, "const double mean = %s / %lld;", cu_rsum(e, &rs, "s"), (long long)cols);
    ec_line(&e->core, "double var = 0;");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    ec_line(&e->core, "  var += tr + t * %d < %lld ? (xv[t] - mean) * (xv[t] - mean) : 0.0;", rs.tpr, (long long)cols);
    ec_line(&e->core, "const double rstd = 1.0 / sqrt(%s / %lld + %s);", cu_rsum(e, &rs, "var"), (long long)cols,
            ec_dlit(&e->core, nd->fa[0]));
  } else {
    ec_line(&e->core, "  s += (double)xv[t] * xv[t];");
    ec_line(&e->core, "const double sc = 1.0 / sqrt(%s / %lld + %s);", cu_rsum(e, &rs, "s"), (long long)cols,
            ec_dlit(&e->core, nd->fa[0]));
  }
  row_each(e, &rs, cols);
  if (ln)
    ec_line(&e->core, "const float y = (float)((xv[t] - mean) * rstd * %s[j] + %s[j]);", cu_ptr(e, w), cu_ptr(e, bias));
  else
    ec_line(&e->core, "const float y = (float)(xv[t] * sc * %s[j]);", cu_ptr(e, w));
  if (buf)
    ec_line(&e->core, "%s[ix] = y;", cu_ptr(e, a));
  ew_post_inloop(&e->core, a, q, nq, "ix", ec_numel(&e->core, a), "y");
  row_each_end(e);
  ec_leave(&e->core);
  cu_kend(e, rs.grid, rs.block);
  e->core.loop_ix = NULL;
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
}

// Norm backward rows staged in shared memory (NormStage): x, dy and up to NORM_STAGED_MORE f32 inputs
// of the chain after dx read at dx's own index, each row copied by cp.async into one of two buffers
// while the block works on the row before. A block of GPT-2's norm backward takes 8 rows of 768 one
// after the other, and its only wave of blocks took as long as that chain of loads: the rows' loads,
// two block reductions, then the residual gradient's loads, about 94 us a call on an H200 where the
// bytes alone need under 40.
enum { NORM_STAGED_MORE = 2, NORM_STAGE_BYTES = 32 << 10 };

typedef struct {
  int n;                             // arrays staged (0: none), x and dy first
  int node[2 + NORM_STAGED_MORE];    // the nodes they hold
} NormStage;

// What the norm backward (rows of `cols` f32, a block per group of rows) can stage: x and dy when both
// are in memory as f32, written by earlier steps, with rows of whole 16-byte chunks; then the chain's
// inputs of that kind at dx's index (same shape as their reader).
static NormStage norm_stage(Emit *e, int x, int dy, const int *q, int nq, int64_t cols) {
  NormStage st = {0};
  int ax = ec_mem_alias(&e->core, x), ady = ec_mem_alias(&e->core, dy);
  if (ax < 0 || ady < 0 || cols % 4 || e->core.in_step[ax] || e->core.in_step[ady] ||
      ec_node(&e->core, ax)->dtype != DT_F32 || ec_node(&e->core, ady)->dtype != DT_F32 ||
      2 * 2 * cols * 4 > NORM_STAGE_BYTES)
    return st;
  st.node[st.n++] = ax;
  st.node[st.n++] = ady;
  for (int t = 0; t < nq; t++) {
    const IrNode *u = ec_node(&e->core, q[t]);
    if (!ec_is_pointwise(u->op))
      continue;
    for (int i = 0; i < u->nin && st.n < 2 + NORM_STAGED_MORE; i++) {
      int c = ec_canon(&e->core, u->in[i]);
      bool have = false;
      for (int k = 0; k < st.n; k++)
        have |= st.node[k] == c;
      const IrNode *cn = ec_node(&e->core, c);
      if (!have && ec_in_memory(&e->core, c) && !e->core.in_step[c] && cn->dtype == DT_F32 &&
          shape_eq(cn->shape, u->shape) && 2 * (st.n + 1) * cols * 4 <= NORM_STAGE_BYTES)
        st.node[st.n++] = c;
    }
  }
  return st;
}

// Copies row `row` of each staged array into buffer `buf` (cp.async, one group).
static void norm_stage_row(Emit *e, const NormStage *st, const RowShape *rs, int64_t cols, const char *buf,
                           const char *row) {
  for (int k = 0; k < st->n; k++)
    ec_line(&e->core, "for (int u = tr; u < %lld; u += %d) mdl_cp_async16(&st[%s][%d][4 * u], &%s[%s * %lld + 4 * u], "
            "true);", (long long)(cols / 4), rs->tpr, buf, k, cu_ptr(e, st->node[k]), row, (long long)cols);
  ec_line(&e->core, "mdl_cp_async_commit();");
}

// The state of a norm backward's emission (cu_emit_norm_bwd), shared by its steps.
typedef struct {
  const IrNode *nd;
  bool ln;                           // LAYERNORM_BWD, else RMSNORM_BWD
  int dx, dw, db, sums[EC_MAX_COLSUMS], nsum; // the members (ec_norm_members), -1 where absent
  int x, dy, w;                      // the inputs (w: the weight, read by dx only, else -1)
  int64_t cols, rows;
  int *q, nq;                        // the outputs computed in dx's loop
  bool dxbuf, cols_sum;              // dx is whole in memory; there are column sums (dw, db, sums)
  int64_t bl, nb;                    // rows per block of column partials, blocks
  const char *at;                    // the partials' type
  int64_t pdw, pdb, psum[EC_MAX_COLSUMS]; // their scratch, or -1
  RowShape rs;
  const char *ixt;
  NormStage st;                      // the rows staged in shared memory
  const char *xv, *dyv;              // a thread's x and dy at element t (j)
  const char *sw, *sb, *ss[EC_MAX_COLSUMS], *wp; // pointers of the first kernel
} NormBwd;

// The plan of group gi's norm backward: its members, its inputs made ready (ew_flush), the blocks of
// rows of its column partials and their scratch, the row shape and what is staged.
static void norm_bwd_plan(Emit *e, int gi, NormBwd *p) {
  const Group *gr = &e->core.groups[gi];
  p->nd = ec_node(&e->core, gr->mem[0]);
  p->ln = p->nd->op == OP_LAYERNORM_BWD;
  p->nsum = ec_norm_members(&e->core, gi, &p->dx, &p->dw, &p->db, p->sums);
  p->x = p->nd->in[0], p->dy = p->nd->in[2];
  p->cols = ec_last_dim(&e->core, p->x), p->rows = ec_numel(&e->core, p->x) / p->cols;
  row_inline(e, p->x);
  row_inline(e, p->dy);
  p->w = p->dx >= 0 ? ec_need(&e->core, p->nd->in[1]) : -1; // (the weight scales dx only)
  ew_flush(&e->core);
  p->q = ec_xcalloc((size_t)e->core.g->n, sizeof *p->q);
  p->nq = p->dx >= 0 ? ec_post_set(&e->core, gi, ec_numel(&e->core, p->dx), e->core.emitted, p->q) : 0;
  p->dxbuf = p->dx >= 0 && ew_whole(&e->core, p->dx);
  p->cols_sum = p->dw >= 0 || p->db >= 0 || p->nsum > 0;
  p->bl = p->cols_sum ? (p->rows + 1023) / 1024 : 1, p->nb = (p->rows + p->bl - 1) / p->bl;
  // A lane's column sums over its block's rows: in f32 over at most NORM_F32_ROWS rows (a row of 768
  // takes 24 of them per lane and sum; double accumulators would spill registers), else in double.
  // The partials keep that type (an f32 sum stored as f32 loses nothing, in half the bytes: 9.4 MB
  // instead of 18.9 written and read back per GPT-2 norm backward) and are added in double.
  p->at = p->bl <= NORM_F32_ROWS ? "float" : "double";
  int64_t psz = p->bl <= NORM_F32_ROWS ? 4 : 8;
  p->pdw = p->dw >= 0 ? cu_scratch_alloc(e, p->nb * p->cols * psz) : -1;
  p->pdb = p->db >= 0 ? cu_scratch_alloc(e, p->nb * p->cols * psz) : -1;
  for (int i = 0; i < p->nsum; i++)
    p->psum[i] = cu_scratch_alloc(e, p->nb * p->cols * psz);
  // With column sums there are at most 1024 groups of rows (1024 partials per column), so a group gets
  // a block of threads (up to NORM_LANE_ELEMS elements per lane) rather than a warp: GPT-2's 8192 rows
  // of 768 are then 4096 warps of 6 elements a lane, not 1024 warps (128 blocks, under one wave on
  // 132 SMs) of 24 at 244 registers.
  p->rs = cu_row_shape(e, p->cols, p->nb, p->cols_sum ? NORM_LANE_ELEMS : 32);
  p->ixt = e->core.ixt;
  if (p->cols_sum && p->rs.tpr > 32 && p->bl > 1 && (p->dx >= 0 || p->dw >= 0))
    p->st = norm_stage(e, p->x, p->dy, p->q, p->nq, p->cols);
  // A thread's x and dy at element t (j): in registers, or staged, in this row's buffers.
  p->xv = p->st.n ? "xs[j]" : "xv[t]", p->dyv = p->st.n ? "dys[j]" : "dyv[t]";
}

// The first kernel: its partials' pointers, the row group's scope, its accumulators of column partials
// and its loop over the block's rows, each row's x and dy loaded (or staged).
static void norm_bwd_open(Emit *e, NormBwd *p) {
  cu_kbegin(e, "");
  // Each block's rows are a chain of loads and block reductions, so the kernel takes as long as its
  // waves of blocks: at most 64 registers a thread (32 warps an SM) puts GPT-2's 1024 blocks of 128
  // threads in one wave on 132 SMs, where the 72 that ptxas chose (sm_90) fitted 7 blocks an SM, 924.
  if (p->cols_sum)
    e->min_blocks = 1024 / p->rs.block;
  cu_note(e, "%s: %lld rows of %lld, %s per row%s", op_name(p->nd->op), (long long)p->rows, (long long)p->cols,
          cu_rs_who(e, &p->rs),
          p->cols_sum ? ec_str(&e->core, "; column partials over %lld blocks of %lld rows", (long long)p->nb,
                               (long long)p->bl)
                      : "");
  p->sw = p->pdw >= 0 ? cu_raw_ptr(e, p->pdw, p->at, "dw partials") : NULL;
  p->sb = p->pdb >= 0 ? cu_raw_ptr(e, p->pdb, p->at, "db partials") : NULL;
  for (int i = 0; i < p->nsum; i++)
    p->ss[i] = cu_raw_ptr(e, p->psum[i], p->at, "column sum partials");
  cu_rows_open(e, &p->rs, p->cols_sum ? "k" : "r");
  if (p->cols_sum) {
    if (p->sw)
      ec_line(&e->core, "%s sw[%d] = {0};", p->at, p->rs.npl);
    if (p->sb)
      ec_line(&e->core, "%s sb[%d] = {0};", p->at, p->rs.npl);
    for (int i = 0; i < p->nsum; i++)
      ec_line(&e->core, "%s sa%d[%d] = {0};", p->at, i, p->rs.npl);
    ec_line(&e->core, "const %s end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", p->ixt, (long long)p->bl,
            (long long)p->bl, (long long)p->rows, (long long)p->bl, (long long)p->bl, (long long)p->rows);
    if (p->st.n) {
      ec_line(&e->core, "// Rows by cp.async, two buffers: x, dy%s.",
              p->st.n > 2 ? ", then what the chain after dx reads" : "");
      ec_line(&e->core, "__shared__ __align__(16) float st[2][%d][%lld];", p->st.n, (long long)p->cols);
      e->shared += (int)(2 * p->st.n * p->cols * 4);
      norm_stage_row(e, &p->st, &p->rs, p->cols, "0", ec_str(&e->core, "k * %lld", (long long)p->bl));
    }
    ec_enter(&e->core, "for (%s r = k * %lld; r < end; r++)", p->ixt, (long long)p->bl);
  }
  if (p->st.n) {
    ec_line(&e->core, "const int cur = (int)(r - k * %lld) & 1;", (long long)p->bl);
    ec_line(&e->core, "__syncthreads(); // (every thread is done with the other buffer: the row before)");
    ec_enter(&e->core, "if (r + 1 < end)");
    norm_stage_row(e, &p->st, &p->rs, p->cols, "cur ^ 1", "(r + 1)");
    cu_orelse(e);
    ec_line(&e->core, "mdl_cp_async_commit(); // (an empty group: the wait below is the same)");
    ec_leave(&e->core);
    ec_line(&e->core, "mdl_cp_async_wait<1>(); // this row's copies have landed");
    ec_line(&e->core, "__syncthreads();");
    ec_line(&e->core, "const float *const xs = st[cur][0], *const dys = st[cur][1]; // (this row's)");
  } else {
    if (p->dx >= 0 || p->dw >= 0) // (db alone reads dy only)
      row_load(e, &p->rs, p->x, "xv", p->cols);
    row_load(e, &p->rs, p->dy, "dyv", p->cols);
  }
  p->wp = p->w >= 0 ? cu_ptr(e, p->w) : NULL;
}

// The row's statistics (and, without dx, dw's terms).
static void norm_bwd_stats(Emit *e, const NormBwd *p) {
  // Layernorm: the mean, then one block reduction for the variance, mg and mgx together; rmsnorm:
  // one for its sum of squares and mgx. The sums that need the row's scale are taken without it and
  // scaled after (mgx = rstd sum g (x - mean)).
  bool pair = p->rs.tpr > 32 && p->rs.tpr <= 512; // (block sums of up to 16 warps' sums at once)
  if (p->dx < 0 && p->dw < 0) { // db alone needs no statistics
    if (p->sb) {
      row_each(e, &p->rs, p->cols);
      ec_line(&e->core, "sb[t] += %s;", p->dyv);
      row_each_end(e);
    }
  } else if (p->ln) {
    ec_line(&e->core, "double s = 0;");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", p->rs.npl);
    if (p->st.n && p->cols % p->rs.tpr)
      ec_line(&e->core, "  s += tr + t * %d < %lld ? xs[tr + t * %d] : 0.0f;", p->rs.tpr, (long long)p->cols,
              p->rs.tpr);
    else if (p->st.n)
      ec_line(&e->core, "  s += xs[tr + t * %d];", p->rs.tpr);
    else
      ec_line(&e->core, "  s += xv[t];");
    ec_line(&e->core, "const double mean = %s / %lld;", cu_rsum(e, &p->rs, "s"), (long long)p->cols);
    ec_line(&e->core, "double var = 0%s;", p->dx >= 0 ? ", mg = 0, mgx = 0" : "");
    row_each(e, &p->rs, p->cols);
    ec_line(&e->core, "const double xm = %s - mean;", p->xv);
    ec_line(&e->core, "var += xm * xm;");
    if (p->dx >= 0) {
      ec_line(&e->core, "const double g = (double)%s * %s[j];", p->dyv, p->wp);
      ec_line(&e->core, "mg += g;");
      ec_line(&e->core, "mgx += g * xm;");
    }
    if (p->sb)
      ec_line(&e->core, "sb[t] += %s;", p->dyv);
    row_each_end(e);
    if (p->dx >= 0 && pair)
      ec_line(&e->core, "mdl_block_sum3(var, mg, mgx, %s);", cu_sh_double(e));
    else if (p->dx >= 0)
      ec_line(&e->core, "var = %s, mg = %s, mgx = %s;", cu_rsum(e, &p->rs, "var"), cu_rsum(e, &p->rs, "mg"),
              cu_rsum(e, &p->rs, "mgx"));
    else
      ec_line(&e->core, "var = %s;", cu_rsum(e, &p->rs, "var"));
    ec_line(&e->core, "const double rstd = 1.0 / sqrt(var / %lld + %s);", (long long)p->cols,
            ec_dlit(&e->core, p->nd->fa[0]));
    if (p->dx >= 0) {
      ec_line(&e->core, "mg /= %lld;", (long long)p->cols);
      ec_line(&e->core, "mgx *= rstd / %lld; // the mean of g xhat", (long long)p->cols);
    }
    if (p->sw && p->dx < 0) {
      row_each(e, &p->rs, p->cols);
      ec_line(&e->core, "sw[t] += (%s)(%s * ((%s - mean) * rstd));", p->at, p->dyv, p->xv);
      row_each_end(e);
    }
  } else {
    ec_line(&e->core, "double s = 0%s;", p->dx >= 0 ? ", mgx = 0" : "");
    row_each(e, &p->rs, p->cols);
    ec_line(&e->core, "s += (double)%s * %s;", p->xv, p->xv);
    if (p->dx >= 0)
      ec_line(&e->core, "mgx += (double)%s * %s[j] * %s;", p->dyv, p->wp, p->xv);
    row_each_end(e);
    if (p->dx >= 0 && pair)
      ec_line(&e->core, "mdl_block_sum2(s, mgx, %s);", cu_sh_double(e));
    else if (p->dx >= 0)
      ec_line(&e->core, "s = %s, mgx = %s;", cu_rsum(e, &p->rs, "s"), cu_rsum(e, &p->rs, "mgx"));
    else
      ec_line(&e->core, "s = %s;", cu_rsum(e, &p->rs, "s"));
    ec_line(&e->core, "const double sc = 1.0 / sqrt(s / %lld + %s);", (long long)p->cols,
            ec_dlit(&e->core, p->nd->fa[0]));
    if (p->dx >= 0)
      ec_line(&e->core, "mgx /= %lld;", (long long)p->cols);
    if (p->sw && p->dx < 0) {
      row_each(e, &p->rs, p->cols);
      ec_line(&e->core, "sw[t] += (%s)((double)%s * %s * sc);", p->at, p->dyv, p->xv);
      row_each_end(e);
    }
  }
}

// dx by row (with the outputs computed after it, and the column sums' terms), then the partials stored,
// and the first kernel closed.
static void norm_bwd_dx(Emit *e, const NormBwd *p) {
  if (p->dx >= 0) {
    row_each(e, &p->rs, p->cols);
    for (int k = 2; k < p->st.n; k++) // (the chain reads these from their rows in shared memory)
      ec_memo_put(&e->core, p->st.node[k], "ix", ec_str(&e->core, "st[cur][%d][j]", k));
    if (p->ln) {
      ec_line(&e->core, "const double xhat = (%s - mean) * rstd;", p->xv);
      if (p->sw)
        ec_line(&e->core, "sw[t] += (%s)(%s * xhat);", p->at, p->dyv);
      ec_line(&e->core, "const float d = (float)(rstd * ((double)%s * %s[j] - mg - xhat * mgx));", p->dyv, p->wp);
    } else {
      if (p->sw)
        ec_line(&e->core, "sw[t] += (%s)((double)%s * %s * sc);", p->at, p->dyv, p->xv);
      ec_line(&e->core, "const float d = (float)(sc * %s * %s[j] - sc * sc * sc * %s * mgx);", p->dyv, p->wp, p->xv);
    }
    if (p->dxbuf)
      ec_line(&e->core, "%s[ix] = d;", cu_ptr(e, p->dx));
    ew_post_inloop(&e->core, p->dx, p->q, p->nq, "ix", ec_numel(&e->core, p->dx), "d");
    for (int i = 0; i < p->nsum; i++)
      ec_line(&e->core, "sa%d[t] += %s;", i, ew_val(&e->core, ec_node(&e->core, p->sums[i])->in[0], "ix"));
    row_each_end(e);
  }
  if (p->cols_sum) {
    ec_leave(&e->core);
    ec_line(&e->core, "#pragma unroll");
    ec_enter(&e->core, "for (int t = 0; t < %d; t++)", p->rs.npl);
    ec_line(&e->core, "const %s j = tr + t * %d;", p->ixt, p->rs.tpr);
    ec_enter(&e->core, "if (j < %lld)", (long long)p->cols);
    if (p->sw)
      ec_line(&e->core, "%s[k * %lld + j] = sw[t];", p->sw, (long long)p->cols);
    if (p->sb)
      ec_line(&e->core, "%s[k * %lld + j] = sb[t];", p->sb, (long long)p->cols);
    for (int i = 0; i < p->nsum; i++)
      ec_line(&e->core, "%s[k * %lld + j] = sa%d[t];", p->ss[i], (long long)p->cols, i);
    ec_leave(&e->core);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  cu_kend(e, p->rs.grid, p->rs.block);
  e->core.loop_ix = NULL;
}

// The second kernel, where there are column sums: the partials added in a fixed order (colsum_open).
static void norm_bwd_colsum(Emit *e, const NormBwd *p) {
  cu_kbegin(e, "colsum");
  cu_note(e, "%s: column sums of %lld blocks of rows, a block per %d columns in %d groups of rows",
          op_name(p->nd->op), (long long)p->nb, colsum_width(p->nb, p->cols),
          colsum_block(p->nb) / colsum_width(p->nb, p->cols));
  const char *parts[2 + EC_MAX_COLSUMS], *accs[2 + EC_MAX_COLSUMS];
  int np = 0;
  if (p->pdw >= 0)
    parts[np] = cu_raw_ptr(e, p->pdw, p->at, "dw partials"), accs[np++] = "w";
  if (p->pdb >= 0)
    parts[np] = cu_raw_ptr(e, p->pdb, p->at, "db partials"), accs[np++] = "b";
  for (int i = 0; i < p->nsum; i++) {
    parts[np] = cu_raw_ptr(e, p->psum[i], p->at, "column sum partials");
    accs[np++] = ec_str(&e->core, "a%d", i);
  }
  colsum_open(e, p->nb, p->cols, parts, accs, np, false);
  if (p->dw >= 0)
    ec_line(&e->core, "%s[r] = (float)w;", cu_ptr(e, p->dw));
  if (p->db >= 0)
    ec_line(&e->core, "%s[r] = (float)b;", cu_ptr(e, p->db));
  for (int i = 0; i < p->nsum; i++)
    ec_line(&e->core, "%s[r] = (float)a%d;", cu_ptr(e, p->sums[i]), i);
  ec_leave(&e->core);
  cu_kend(e, colsum_grid(p->nb, p->cols), colsum_block(p->nb));
}

// LAYERNORM_BWD / RMSNORM_BWD siblings: dx per row; dw (and db) as column sums: each row group
// adds a fixed block of rows into per-column partials, then the column sums add the blocks in a fixed
// order (colsum_open).
void cu_emit_norm_bwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  NormBwd p = {0};
  norm_bwd_plan(e, gi, &p);
  ec_phase_begin(&e->core);
  norm_bwd_open(e, &p);
  norm_bwd_stats(e, &p);
  norm_bwd_dx(e, &p);
  if (p.cols_sum)
    norm_bwd_colsum(e, &p);
  if (p.dxbuf)
    ec_phase_done(&e->core, p.dx);
  if (p.dw >= 0)
    ec_phase_done(&e->core, p.dw);
  if (p.db >= 0)
    ec_phase_done(&e->core, p.db);
  for (int i = 0; i < p.nsum; i++)
    ec_phase_done(&e->core, p.sums[i]);
  ec_phase_end(&e->core);
  free(p.q);
}

// SOFTMAX (x) or SOFTMAX_BWD (y, dy) over the last axis, a warp (or block) per row.
void cu_emit_softmax(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool bwd = nd->op == OP_SOFTMAX_BWD;
  int64_t cols = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / cols;
  row_inline(e, nd->in[0]);
  if (bwd)
    row_inline(e, nd->in[1]);
  ew_flush(&e->core);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), e->core.emitted, q);
  bool buf = ew_whole(&e->core, a);
  RowShape rs = cu_row_shape(e, cols, rows, 32);
  ec_phase_begin(&e->core);
  cu_kbegin(e, "");
  cu_note(e, "%s: %lld rows of %lld, %s per row", op_name(nd->op), (long long)rows, (long long)cols, cu_rs_who(e, &rs));
  cu_rows_open(e, &rs, "r");
  row_load(e, &rs, nd->in[0], bwd ? "yv" : "xv", cols);
  if (bwd) {
    row_load(e, &rs, nd->in[1], "dyv", cols);
    ec_line(&e->core, "double dot = 0;");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    ec_line(&e->core, "  dot += (double)yv[t] * dyv[t];");
    ec_line(&e->core, "dot = %s;", cu_rsum(e, &rs, "dot"));
  } else {
    ec_line(&e->core, "float mx = -MDL_INF;");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    ec_line(&e->core, "  mx = tr + t * %d < %lld ? fmaxf(mx, xv[t]) : mx;", rs.tpr, (long long)cols);
    ec_line(&e->core, "mx = %s;", cu_rfmax(e, &rs, "mx"));
    ec_line(&e->core, "double sum = 0;");
    ec_line(&e->core, "#pragma unroll");
    ec_enter(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    ec_line(&e->core, "xv[t] = tr + t * %d < %lld ? expf(xv[t] - mx) : 0.0f;", rs.tpr, (long long)cols);
    ec_line(&e->core, "sum += xv[t];");
    ec_leave(&e->core);
    ec_line(&e->core, "sum = %s;", cu_rsum(e, &rs, "sum"));
  }
  row_each(e, &rs, cols);
  if (bwd)
    ec_line(&e->core, "const float y = (float)(yv[t] * (dyv[t] - dot));");
  else
    ec_line(&e->core, "const float y = (float)(xv[t] / sum);");
  if (buf)
    ec_line(&e->core, "%s[ix] = y;", cu_ptr(e, a));
  ew_post_inloop(&e->core, a, q, nq, "ix", ec_numel(&e->core, a), "y");
  row_each_end(e);
  ec_leave(&e->core);
  cu_kend(e, rs.grid, rs.block);
  e->core.loop_ix = NULL;
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
}

// EMBED: rows of the table by id, four floats at a time when the width allows; a bad id is reported
// and gives a row of zeros.
void cu_emit_embed(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t v = ec_node(&e->core, nd->in[0])->shape.d[0], c = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / c;
  int tab = ec_need(&e->core, nd->in[0]), ids = ec_need(&e->core, nd->in[1]);
  ew_anchor_open(&e->core, a);
  int w = c % 4 == 0 ? 4 : 1;
  int64_t cw = c / w, work = rows * cw;
  cu_kbegin(e, "");
  cu_note(e, "embed: %lld rows of %lld from a table of %lld, %d per thread", (long long)rows, (long long)c,
          (long long)v, w);
  const char *t = w == 4 ? "float4" : "float";
  const char *tp = cu_ptr(e, tab), *ip = cu_ptr(e, ids), *op = cu_ptr(e, a);
  ec_enter(&e->core, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)",
           e->core.ixt, (long long)work);
  ec_line(&e->core, "const %s r = u / %lld, c = u %% %lld;", e->core.ixt, (long long)cw, (long long)cw);
  ec_line(&e->core, "const int32_t id = %s[r];", ip);
  ec_enter(&e->core, "if (id < 0 || id >= %lld)", (long long)v);
  ec_line(&e->core, "if (c == 0)");
  ec_line(&e->core, "  mdl_report(status, MDL_ERR_EMBED_ID, id, %lld);", (long long)v);
  ec_line(&e->core, "reinterpret_cast<%s *>(%s)[u] = %s;", t, op,
          w == 4 ? "make_float4(0.0f, 0.0f, 0.0f, 0.0f)" : "0.0f");
  cu_orelse(e);
  ec_line(&e->core, "reinterpret_cast<%s *>(%s)[u] = reinterpret_cast<const %s *>(%s)[(%s)id * %lld + c];", t, op, t,
          tp, e->core.ixt, (long long)cw);
  ec_leave(&e->core);
  ec_leave(&e->core);
  cu_kend(e, cu_grid_for(work, cu_block_for(work)), cu_block_for(work));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// EMBED_BWD: a scatter-add without atomic float adds, every sum in the interpreter's order (the rows of
// dy by increasing position). Table rows are taken in buckets of 32 (EMBED_ROWS). A stable counting
// sort first lists each bucket's positions in increasing order: the ids are counted per bucket, and per
// bucket and chunk of 256 positions (atomic integer adds, exact); the buckets' counts' prefix sums say
// where each bucket's list starts, and a position goes after the earlier chunks' positions of its
// bucket and after its own chunk's earlier ones (a rank among 256 in shared memory). Then a warp owns
// 32 table rows x 32 columns (a lane a column, its 32 sums in shared memory) and walks its bucket's
// list 32 positions at a time, loading the 32 rows of dy before adding them in order: a frequent
// token's sums no longer wait on one load after another (with byte tokens, GPT-2's 8192 positions
// fall in 8 buckets; its blocks had scanned every id, a load at a time, for 0.8 ms of a 30 ms step on
// an H200). The warp then stores its 32 rows in groups of EMBED_GROUP, each group's values computed
// (and the loads of the chain after it made: a tied table's other gradient) before any is stored:
// one row after another, every load waited behind the row before's store, which the compiler may
// not pass (the buffers may alias for all it knows), one load in flight a lane over GPT-2's 154 MB.
enum { EMBED_ROWS = 32, EMBED_CHUNK = 256, EMBED_WARPS = 8, EMBED_GROUP = 8 };

// The end of the embedding backward with a chain after it: the warp's 32 table rows (acc) stored in
// groups of EMBED_GROUP, every value of a group (and every load of its chain) before its stores;
// tp: the table's own buffer, or NULL where only the chain is stored.
static void embed_store_groups(Emit *e, int a, const int *q, int nq, const char *tp) {
  const IrNode *nd = ec_node(&e->core, a);
  int64_t v = nd->shape.d[0], c = nd->shape.d[1];
  const char *ixt = e->core.ixt;
  bool part = v % EMBED_GROUP != 0; // (a last group partly past the table)
  ec_line(&e->core, "// The table rows in groups of %d: a group's values, and the loads they take, before its "
          "stores%s", EMBED_GROUP, part ? "" : ".");
  if (part)
    ec_line(&e->core, "// (rows past the table compute from its last row and store nothing).");
  ec_enter(&e->core, "for (int k0 = 0; k0 < %d && v0 + k0 < %lld; k0 += %d)", EMBED_ROWS, (long long)v,
           EMBED_GROUP);
  int mark = e->core.nphase;
  e->defer = true;
  int held_at[EMBED_GROUP + 1] = {0}; // (group row u's stores: held[held_at[u] .. held_at[u + 1]))
  for (int u = 0; u < EMBED_GROUP; u++) {
    const char *ix = ec_str(&e->core, "ix%d", u), *y = ec_str(&e->core, "y%d", u);
    if (part)
      ec_line(&e->core, "const %s %s = (v0 + k0 + %d < %lld ? v0 + k0 + %d : %lld) * %lld + c;", ixt, ix, u,
              (long long)v, u, (long long)v - 1, (long long)c);
    else
      ec_line(&e->core, "const %s %s = (v0 + k0 + %d) * %lld + c;", ixt, ix, u, (long long)c);
    ec_line(&e->core, "const float %s = acc[w][k0 + %d][lane];", y, u);
    for (int i = mark; i < e->core.nphase; i++)
      e->core.stored[e->core.phase_nodes[i]] = false;
    e->core.nphase = mark;
    if (tp) {
      ec_grow(&e->held, e->nheld, &e->capheld, sizeof *e->held);
      e->held[e->nheld++] = ec_str(&e->core, "%s[%s] = %s;", tp, ix, y);
    }
    ew_post_inloop(&e->core, a, q, nq, ix, ec_numel(&e->core, a), y);
    held_at[u + 1] = e->nheld;
  }
  e->defer = false;
  for (int u = 0; u < EMBED_GROUP; u++) {
    if (held_at[u + 1] == held_at[u])
      continue;
    if (part)
      ec_enter(&e->core, "if (v0 + k0 + %d < %lld)", u, (long long)v);
    for (int i = held_at[u]; i < held_at[u + 1]; i++)
      ec_line(&e->core, "%s", e->held[i]);
    if (part)
      ec_leave(&e->core);
  }
  e->nheld = 0;
  ec_leave(&e->core);
}

void cu_emit_embed_bwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t v = nd->shape.d[0], c = nd->shape.d[1], rows = ec_numel(&e->core, nd->in[0]);
  int ids = ec_need(&e->core, nd->in[0]), dy = ec_need(&e->core, nd->in[1]);
  ew_flush(&e->core);
  // The chain after it (a tied table's other gradient added, rule 7 of fuse.c) is computed as each
  // element of the table is stored; the table itself is stored only when something else reads it.
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), e->core.emitted, q);
  bool buf = ew_whole(&e->core, a) || nq == 0;
  if (buf && ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  int vr = EMBED_ROWS, ch = EMBED_CHUNK;
  int64_t nvb = (v + vr - 1) / vr, nch = (rows + ch - 1) / ch, nh = nvb * nch;
  int warps = (int)((c + 31) / 32 < EMBED_WARPS ? (c + 31) / 32 : EMBED_WARPS), cb = 32 * warps;
  int64_t ncb = (c + cb - 1) / cb;
  int64_t cnt = cu_scratch_alloc(e, 4 * nvb), hist = cu_scratch_alloc(e, 4 * nh),
          start = cu_scratch_alloc(e, 4 * (nvb + 1)), pos = cu_scratch_alloc(e, 4 * rows);
  const char *ixt = e->core.ixt;
  ec_phase_begin(&e->core);

  cu_kbegin(e, "zero");
  cu_note(e, "embed backward: the counts of %lld buckets and of each in %lld chunks set to zero", (long long)nvb,
          (long long)nch);
  const char *cp = cu_raw_ptr(e, cnt, "int", "bucket counts");
  const char *hp = cu_raw_ptr(e, hist, "int", "counts by bucket and chunk");
  ec_enter(&e->core, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)", ixt,
           (long long)nh);
  ec_line(&e->core, "%s[u] = 0;", hp);
  ec_line(&e->core, "if (u < %lld)", (long long)nvb);
  ec_line(&e->core, "  %s[u] = 0;", cp);
  ec_leave(&e->core);
  cu_kend(e, cu_grid_for(nh, cu_block_for(nh)), cu_block_for(nh));

  cu_kbegin(e, "count");
  cu_note(e, "embed backward: %lld ids counted by bucket of %d table rows, and by bucket and chunk of %d positions, a "
             "block per chunk", (long long)rows, vr, ch);
  const char *ip = cu_ptr(e, ids);
  cp = cu_raw_ptr(e, cnt, "int", "bucket counts");
  hp = cu_raw_ptr(e, hist, "int", "counts by bucket and chunk");
  ec_enter(&e->core, "for (%s k = blockIdx.x; k < %lld; k += gridDim.x)", ixt, (long long)nch);
  ec_line(&e->core, "const %s r = k * %d + threadIdx.x;", ixt, ch);
  ec_line(&e->core, "const int32_t id = r < %lld ? %s[r] : 0;", (long long)rows, ip);
  ec_line(&e->core, "if (id < 0 || id >= %lld)", (long long)v);
  ec_line(&e->core, "  mdl_report(status, MDL_ERR_EMBED_ID, id, %lld);", (long long)v);
  ec_enter(&e->core, "else if (r < %lld)", (long long)rows);
  ec_line(&e->core, "atomicAdd(&%s[id / %d], 1);", cp, vr);
  ec_line(&e->core, "atomicAdd(&%s[id / %d * %lld + k], 1);", hp, vr, (long long)nch);
  ec_leave(&e->core);
  ec_leave(&e->core);
  cu_kend(e, cu_grid_for(nch, 1), ch);

  cu_kbegin(e, "offsets");
  cu_note(e, "embed backward: where each of the %lld buckets starts (prefix sums of the counts), one block",
          (long long)nvb);
  cp = cu_raw_ptr(e, cnt, "int", "bucket counts");
  const char *sp = cu_raw_ptr(e, start, "int", "bucket starts");
  int64_t per = (nvb + BLOCK - 1) / BLOCK;
  ec_line(&e->core, "__shared__ int part[%d];", BLOCK + 1);
  ec_line(&e->core, "const %s lo = threadIdx.x * %lld, hi = lo + %lld < %lld ? lo + %lld : %lld;", ixt, (long long)per,
          (long long)per, (long long)nvb, (long long)per, (long long)nvb);
  ec_line(&e->core, "int n = 0;");
  ec_line(&e->core, "for (%s b = lo; b < hi; b++)", ixt);
  ec_line(&e->core, "  n += %s[b];", cp);
  ec_line(&e->core, "part[threadIdx.x + 1] = n;");
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "if (threadIdx.x == 0)");
  ec_line(&e->core, "part[0] = 0;");
  ec_line(&e->core, "for (int t = 1; t <= %d; t++)", BLOCK);
  ec_line(&e->core, "  part[t] += part[t - 1];");
  ec_line(&e->core, "%s[%lld] = part[%d];", sp, (long long)nvb, BLOCK);
  ec_leave(&e->core);
  ec_line(&e->core, "__syncthreads();");
  ec_line(&e->core, "n = part[threadIdx.x];");
  ec_enter(&e->core, "for (%s b = lo; b < hi; b++)", ixt);
  ec_line(&e->core, "%s[b] = n;", sp);
  ec_line(&e->core, "n += %s[b];", cp);
  ec_leave(&e->core);
  e->shared = 4 * (BLOCK + 1);
  cu_kend(e, 1, BLOCK);

  cu_kbegin(e, "place");
  cu_note(e, "embed backward: each position into its bucket's list, after the earlier ones of its bucket, a block per "
             "chunk");
  ip = cu_ptr(e, ids);
  hp = cu_raw_ptr(e, hist, "int", "counts by bucket and chunk");
  sp = cu_raw_ptr(e, start, "int", "bucket starts");
  const char *pp = cu_raw_ptr(e, pos, "int", "positions by bucket");
  ec_line(&e->core, "__shared__ int bk[%d];", ch);
  ec_enter(&e->core, "for (%s k = blockIdx.x; k < %lld; k += gridDim.x)", ixt, (long long)nch);
  ec_line(&e->core, "const %s r = k * %d + threadIdx.x;", ixt, ch);
  ec_line(&e->core, "const int32_t id = r < %lld ? %s[r] : -1;", (long long)rows, ip);
  ec_line(&e->core, "const int b = id >= 0 && id < %lld ? id / %d : -1;", (long long)v, vr);
  ec_line(&e->core, "__syncthreads();");
  ec_line(&e->core, "bk[threadIdx.x] = b;");
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "if (b >= 0)");
  ec_line(&e->core, "int at = %s[b];", sp);
  ec_line(&e->core, "for (%s g = 0; g < k; g++)", ixt);
  ec_line(&e->core, "  at += %s[b * %lld + g];", hp, (long long)nch);
  ec_line(&e->core, "for (int t = 0; t < (int)threadIdx.x; t++)");
  ec_line(&e->core, "  at += bk[t] == b;");
  ec_line(&e->core, "%s[at] = (int)r;", pp);
  ec_leave(&e->core);
  ec_leave(&e->core);
  e->shared = 4 * ch;
  cu_kend(e, cu_grid_for(nch, 1), ch);

  cu_kbegin(e, "");
  cu_note(e, "embed backward: %lld rows of %lld into a table of %lld; a warp per %d table rows x 32 columns, walking "
             "its bucket's positions in order, %d at a time", (long long)rows, (long long)c, (long long)v, vr, 32);
  e->shared = warps * vr * 32 * 4;
  ec_line(&e->core, "__shared__ float acc[%d][%d][32];", warps, vr);
  ip = cu_ptr(e, ids);
  const char *dp = cu_ptr(e, dy), *tp = buf ? cu_ptr(e, a) : NULL;
  sp = cu_raw_ptr(e, start, "int", "bucket starts");
  pp = cu_raw_ptr(e, pos, "int", "positions by bucket");
  ec_line(&e->core, "const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;");
  ec_line(&e->core, "const %s bk = blockIdx.x / %lld, v0 = bk * %d, c = blockIdx.x %% %lld * %d + threadIdx.x;", ixt,
          (long long)ncb, vr, (long long)ncb, cb);
  if (ncb * cb > c) {
    ec_line(&e->core, "if (c - lane >= %lld)", (long long)c);
    ec_line(&e->core, "  return; // the whole warp");
  }
  ec_line(&e->core, "for (int k = 0; k < %d; k++)", vr);
  ec_line(&e->core, "  acc[w][k][lane] = 0.0f;");
  ec_line(&e->core, "const int at = %s[bk], n = %s[bk + 1] - at;", sp, sp);
  ec_enter(&e->core, "for (int i0 = 0; i0 < n; i0 += 32)");
  ec_line(&e->core, "int p = 0, k = 0;");
  ec_enter(&e->core, "if (i0 + lane < n)");
  ec_line(&e->core, "p = %s[at + i0 + lane];", pp);
  ec_line(&e->core, "k = %s[p] - (int)v0;", ip);
  ec_leave(&e->core);
  ec_line(&e->core, "float d[32];");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int u = 0; u < 32; u++)");
  ec_line(&e->core, "const %s pu = __shfl_sync(0xffffffffu, p, u);", ixt);
  ec_line(&e->core, "d[u] = i0 + u < n && c < %lld ? %s[pu * %lld + c] : 0.0f;", (long long)c, dp, (long long)c);
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int u = 0; u < 32; u++)");
  ec_line(&e->core, "const int ku = __shfl_sync(0xffffffffu, k, u);");
  ec_line(&e->core, "if (i0 + u < n)");
  ec_line(&e->core, "  acc[w][ku][lane] += d[u];");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_enter(&e->core, "if (c < %lld)", (long long)c);
  if (nq == 0) { // (the table alone: stores, nothing to load)
    ec_enter(&e->core, "for (int k = 0; k < %d && v0 + k < %lld; k++)", vr, (long long)v);
    ec_line(&e->core, "%s[(v0 + k) * %lld + c] = acc[w][k][lane];", tp, (long long)c);
    ec_leave(&e->core);
  } else {
    embed_store_groups(e, a, q, nq, tp);
  }
  ec_leave(&e->core);
  e->core.loop_ix = NULL;
  cu_kend(e, nvb * ncb, cb);
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
}

// ROPE: a thread per (row, head, pair); the angle in double, as the interpreter takes it.
void cu_emit_rope(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int64_t rows = s.d[0] * s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads, work = rows * heads * (d / 2);
  Rows x = cu_rows_of(e, nd->in[0]);
  int pos = ec_need(&e->core, nd->in[1]);
  ew_anchor_open(&e->core, a);
  cu_kbegin(e, "");
  cu_note(e, "rope%s: %lld rows, %lld heads of %lld, a thread per pair", nd->ia[1] ? " (inverse)" : "", (long long)rows,
          (long long)heads, (long long)d);
  const char *xp = cu_rows_base(e, x), *pp = cu_ptr(e, pos), *yp = cu_ptr(e, a);
  ec_enter(&e->core, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)",
           e->core.ixt, (long long)work);
  ec_line(&e->core, "const %s r = u / %lld, hd = u / %lld %% %lld, i = u %% %lld;", e->core.ixt,
          (long long)(heads * (d / 2)), (long long)(d / 2), (long long)heads, (long long)(d / 2));
  ec_line(&e->core, "const double th = %s(double)%s[r] * pow(%s, -2.0 * (double)i / %lld);", nd->ia[1] ? "-1.0 * " : "",
          pp, ec_dlit(&e->core, nd->fa[0]), (long long)d);
  ec_line(&e->core, "const float cs = (float)cos(th), sn = (float)sin(th);");
  ec_line(&e->core, "const %s p = hd * %lld + i, p2 = p + %lld;", e->core.ixt, (long long)d, (long long)(d / 2));
  ec_line(&e->core, "const float x1 = %s[r * %lld + p], x2 = %s[r * %lld + p2];", xp, (long long)x.stride, xp,
          (long long)x.stride);
  ec_line(&e->core, "%s[r * %lld + p] = x1 * cs - x2 * sn;", yp, (long long)nc);
  ec_line(&e->core, "%s[r * %lld + p2] = x1 * sn + x2 * cs;", yp, (long long)nc);
  ec_leave(&e->core);
  cu_kend(e, cu_grid_for(work, cu_block_for(work)), cu_block_for(work));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// ATTENTION_MASK ([doc]) -> [B or 1, 1, T, T]: 0 where query i may see key j (j <= i when causal,
// i - j < window with a window, the same doc id with ids), -inf where not; a thread per element.
void cu_emit_attn_mask(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t nt = nd->shape.d[3], work = ec_numel(&e->core, a);
  bool causal = nd->ia[0];
  int doc = nd->ia[1] ? ec_need(&e->core, nd->in[0]) : -1;
  ew_anchor_open(&e->core, a);
  cu_kbegin(e, "");
  cu_note(e, "attention mask: %lld rows of %lld keys%s%s, a thread per element", (long long)(work / nt), (long long)nt,
          causal ? ", causal" : "", doc >= 0 ? ", within documents" : "");
  const char *dp = doc >= 0 ? cu_ptr(e, doc) : NULL, *yp = cu_ptr(e, a);
  ec_enter(&e->core, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)",
           e->core.ixt, (long long)work);
  ec_line(&e->core, "const %s r = u / %lld, i = r %% %lld, j = u %% %lld;", e->core.ixt, (long long)nt, (long long)nt,
          (long long)nt);
  Buf cond = {0};
  ec_bput(&cond, "%s", causal ? "j <= i" : "");
  if (doc >= 0) // (r - i: the row's first position)
    ec_bput(&cond, "%s%s[r - i + j] == %s[r]", causal ? " && " : "", dp, dp);
  if (nd->ia[2])
    ec_bput(&cond, " && i - j < %lld", (long long)nd->ia[2]);
  ec_line(&e->core, "%s[u] = %s ? 0.0f : -MDL_INF;", yp, cond.len ? ec_buf_str(&e->core, &cond) : "true");
  ec_leave(&e->core);
  cu_kend(e, cu_grid_for(work, cu_block_for(work)), cu_block_for(work));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// MAX_BWD (x, y, dy): the gradient goes to the maxima, shared evenly between ties; a thread per output.
void cu_emit_max_bwd(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int ax = (int)nd->ia[0];
  int64_t outer = ec_span(s, 0, ax), len = s.d[ax], inner = ec_span(s, ax + 1, s.rank), on = outer * inner;
  int x = ec_need(&e->core, nd->in[0]), y = ec_need(&e->core, nd->in[1]), dy = ec_need(&e->core, nd->in[2]);
  ew_anchor_open(&e->core, a);
  cu_kbegin(e, "");
  cu_note(e, "max backward: %lld outputs over %lld elements, a thread per output", (long long)on, (long long)len);
  const char *xp = cu_ptr(e, x), *yp = cu_ptr(e, y), *dp = cu_ptr(e, dy), *op = cu_ptr(e, a);
  ec_enter(&e->core, "for (%s r = blockIdx.x * blockDim.x + threadIdx.x; r < %lld; r += gridDim.x * blockDim.x)",
           e->core.ixt, (long long)on);
  ec_line(&e->core, "const %s base = r / %lld * %lld + r %% %lld;", e->core.ixt, (long long)inner,
          (long long)(len * inner), (long long)inner);
  ec_line(&e->core, "const float m = %s[r];", yp);
  ec_line(&e->core, "%s ties = 0;", e->core.ixt);
  ec_line(&e->core, "for (%s l = 0; l < %lld; l++)", e->core.ixt, (long long)len);
  ec_line(&e->core, "  ties += %s[base + l * %lld] == m;", xp, (long long)inner);
  ec_line(&e->core, "const float g = (float)((double)%s[r] / (double)ties);", dp);
  ec_line(&e->core, "for (%s l = 0; l < %lld; l++)", e->core.ixt, (long long)len);
  ec_line(&e->core, "  %s[base + l * %lld] = %s[base + l * %lld] == m ? g : 0.0f;", op, (long long)inner, xp,
          (long long)inner);
  ec_leave(&e->core);
  cu_kend(e, cu_grid_for(on, cu_block_for(on)), cu_block_for(on));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// TOPK: a thread per line along the axis, the k first positions in TOPK's order found one by one (the
// next is the first of those after the last one found), as the interpreter does.
void cu_emit_topk(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  int ax = (int)nd->ia[0];
  int64_t k = nd->ia[1], outer = ec_span(s, 0, ax), len = s.d[ax], inner = ec_span(s, ax + 1, s.rank);
  int64_t lines = outer * inner;
  int x = ec_need(&e->core, nd->in[0]);
  const char *t = e->core.ixt;
  ew_anchor_open(&e->core, a);
  cu_kbegin(e, "");
  cu_note(e, "topk: the %lld largest of %lld lines of %lld, a thread per line", (long long)k, (long long)lines,
          (long long)len);
  const char *xp = cu_ptr(e, x), *yp = cu_ptr(e, a);
  ec_enter(&e->core, "for (%s c = blockIdx.x * blockDim.x + threadIdx.x; c < %lld; c += gridDim.x * blockDim.x)", t,
           (long long)lines);
  ec_line(&e->core, "const float *x = %s + c / %lld * %lld + c %% %lld;", xp, (long long)inner,
          (long long)(len * inner), (long long)inner);
  ec_line(&e->core, "int32_t *y = %s + c / %lld * %lld + c %% %lld;", yp, (long long)inner, (long long)(k * inner),
          (long long)inner);
  ec_line(&e->core, "%s last = -1;", t);
  ec_enter(&e->core, "for (%s p = 0; p < %lld; p++)", t, (long long)k);
  ec_line(&e->core, "%s best = -1;", t);
  ec_enter(&e->core, "for (%s l = 0; l < %lld; l++)", t, (long long)len);
  ec_line(&e->core, "const float v = x[l * %lld];", (long long)inner);
  ec_line(&e->core, "if (last >= 0 && !(%s))",
          ec_topk_before(&e->core, ec_str(&e->core, "x[last * %lld]", (long long)inner), "last", "v", "l"));
  ec_line(&e->core, "  continue;");
  ec_line(&e->core, "if (best < 0 || %s)",
          ec_topk_before(&e->core, "v", "l", ec_str(&e->core, "x[best * %lld]", (long long)inner), "best"));
  ec_line(&e->core, "  best = l;");
  ec_leave(&e->core);
  ec_line(&e->core, "y[p * %lld] = (int32_t)best;", (long long)inner);
  ec_line(&e->core, "last = best;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  cu_kend(e, cu_grid_for(lines, cu_block_for(lines)), cu_block_for(lines));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// GATHER: a thread per output element; an index outside the axis reads 0.
void cu_emit_gather(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int ax = (int)nd->ia[0];
  int64_t n = ec_numel(&e->core, a), ylen = s.d[ax], inner = ec_span(s, ax + 1, s.rank);
  int64_t xlen = ec_node(&e->core, nd->in[0])->shape.d[ax];
  int x = ec_need(&e->core, nd->in[0]), idx = ec_need(&e->core, nd->in[1]);
  ew_anchor_open(&e->core, a);
  cu_kbegin(e, "");
  cu_note(e, "gather: %lld values along an axis of %lld, a thread per value", (long long)n, (long long)xlen);
  const char *xp = cu_ptr(e, x), *ip = cu_ptr(e, idx), *yp = cu_ptr(e, a);
  ec_enter(&e->core, "for (%s r = blockIdx.x * blockDim.x + threadIdx.x; r < %lld; r += gridDim.x * blockDim.x)",
           e->core.ixt, (long long)n);
  ec_line(&e->core, "const int32_t l = %s[%s];", ip, ec_ix_bcast(&e->core, s, ec_node(&e->core, nd->in[1])->shape, "r"));
  ec_line(&e->core, "%s[r] = l >= 0 && l < %lld ? %s[(r / %lld * %lld + l) * %lld + r %% %lld] : 0.0f;", yp,
          (long long)xlen, xp, (long long)(ylen * inner), (long long)xlen, (long long)inner, (long long)inner);
  ec_leave(&e->core);
  cu_kend(e, cu_grid_for(n, cu_block_for(n)), cu_block_for(n));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// SCATTER_ADD (base, idx, src) and GATHER_BWD (idx, src) over zeros: a thread per line along the axis,
// its sources added in order (no atomics: no two threads add into one element, and every sum is in
// the interpreter's order).
void cu_emit_scatter(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool has_base = nd->op == OP_SCATTER_ADD;
  Shape ys = nd->shape, ss = ec_node(&e->core, nd->in[has_base + 1])->shape;
  int ax = (int)nd->ia[0];
  int64_t ylen = ys.d[ax], slen = ss.d[ax], inner = ec_span(ys, ax + 1, ys.rank), lines = ec_span(ys, 0, ax) * inner;
  int base = has_base ? ec_need(&e->core, nd->in[0]) : -1;
  int idx = ec_need(&e->core, nd->in[has_base]), src = ec_need(&e->core, nd->in[has_base + 1]);
  const char *t = e->core.ixt;
  ew_anchor_open(&e->core, a);
  cu_kbegin(e, "");
  cu_note(e, "scatter-add: %lld lines, %lld sources into %lld places each, a thread per line", (long long)lines,
          (long long)slen, (long long)ylen);
  const char *bp = has_base ? cu_ptr(e, base) : NULL, *ip = cu_ptr(e, idx), *sp = cu_ptr(e, src), *yp = cu_ptr(e, a);
  ec_enter(&e->core, "for (%s c = blockIdx.x * blockDim.x + threadIdx.x; c < %lld; c += gridDim.x * blockDim.x)", t,
           (long long)lines);
  ec_line(&e->core, "const %s o = c / %lld, i = c %% %lld;", t, (long long)inner, (long long)inner);
  ec_line(&e->core, "float *y = %s + o * %lld + i;", yp, (long long)(ylen * inner));
  if (has_base)
    ec_line(&e->core, "const float *x = %s + o * %lld + i;", bp, (long long)(ylen * inner));
  ec_line(&e->core, "for (%s l = 0; l < %lld; l++)", t, (long long)ylen);
  ec_line(&e->core, "  y[l * %lld] = %s;", (long long)inner,
          has_base ? ec_str(&e->core, "x[l * %lld]", (long long)inner) : "0.0f");
  ec_enter(&e->core, "for (%s j = 0; j < %lld; j++)", t, (long long)slen);
  ec_line(&e->core, "const %s r = (o * %lld + j) * %lld + i;", t, (long long)slen, (long long)inner);
  ec_line(&e->core, "const int32_t l = %s[%s];", ip, ec_ix_bcast(&e->core, ss, ec_node(&e->core, nd->in[has_base])->shape, "r"));
  ec_line(&e->core, "if (l >= 0 && l < %lld)", (long long)ylen);
  ec_line(&e->core, "  y[(%s)l * %lld] += %s[r];", t, (long long)inner, sp);
  ec_leave(&e->core);
  ec_leave(&e->core);
  cu_kend(e, cu_grid_for(lines, cu_block_for(lines)), cu_block_for(lines));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}
