// emit_cuda_kit.c: the CUDA emitter's toolkit, what its kernel families build with: lines and notes,
// scratch and the buffers of a kernel, kernels and their launches, the evaluator's hooks (how a value
// is named, read and stored, four lanes at once), elementwise kernels, and row kernels' shapes. See
// emit_cuda.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_cuda.h"
#include "emit_cuda_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>


int64_t cu_align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

//
// Lines and scopes.
//

void cu_note(Emit *e, const char *fmt, ...) {
  ec_bput(&e->notes, "// ");
  va_list ap;
  va_start(ap, fmt);
  ec_bvput(&e->notes, fmt, ap);
  va_end(ap);
  ec_bput(&e->notes, "\n");
}

// Closes the scope of an if and opens its else (cond NULL) or its else-if.
static void orelse_if(Emit *e, const char *cond) {
  ec_leave(&e->core);
  e->core.body.len -= 2; // the "}\n" leave wrote
  if (cond)
    ec_bput(&e->core.body, "} else if (%s) {\n", cond);
  else
    ec_bput(&e->core.body, "} else {\n");
  e->core.indent++;
  e->core.depth++;
}

void cu_orelse(Emit *e) { orelse_if(e, NULL); }

// A float literal that reads back as the same float, in as few digits as that takes.
const char *cu_flit(Emit *e, double v) { return ec_flit(&e->core, v); }

static const char *shape_txt(Emit *e, int n) {
  char buf[128];
  return ec_str(&e->core, "%s%s", dtype_name(ec_node(&e->core, n)->dtype),
                shape_str(ec_node(&e->core, n)->shape, buf, sizeof buf));
}

//
// Scratch and buffers. A node's buffer is its arena slot, the buffer of the epilogue output its GEMM
// writes into, or a scratch buffer of the step; each kernel declares the buffers it uses in the order
// it first uses them (b0, b1, ...), so that the kernels of identical layers are identical text.
//

int64_t cu_scratch_alloc(Emit *e, int64_t bytes) {
  int64_t at = e->stop;
  e->stop = cu_align_up(at + (bytes ? bytes : 1), SCRATCH_ALIGN);
  return e->scratch0 + at;
}

int64_t cu_buf_off(Emit *e, int c) {
  if (ec_offset(&e->core, c) >= 0)
    return ec_offset(&e->core, c);
  if (e->core.host[c] >= 0)
    return cu_buf_off(e, e->core.host[c]);
  if (!e->core.scratch[c])
    return -1;
  if (e->soff[c] < 0)
    e->soff[c] = cu_scratch_alloc(e, ec_numel(&e->core, c) * dtype_size(ec_node(&e->core, c)->dtype));
  return e->soff[c];
}

static const char *slot_name(Emit *e, int k) { return ec_str(&e->core, "b%d", k); }

static int add_slot(Emit *e, int node_id, int64_t off, const char *type, const char *what) {
  if (e->nslots == CUDA_MAX_ARGS) {
    ec_fail(&e->core, "step %s: a kernel would address more than %d buffers", e->core.f->steps[e->core.si].name,
            CUDA_MAX_ARGS);
    return 0;
  }
  e->slots[e->nslots] = (Slot){node_id, off, type, what, false};
  return e->nslots++;
}

// The slot of node c's buffer in the current kernel.
static int slot(Emit *e, int c) {
  if (e->slot_of[c] >= 0)
    return e->slot_of[c];
  int64_t off = cu_buf_off(e, c);
  if (off < 0)
    ec_fail(&e->core, "node %d (%s) has no buffer in step %s", c, op_name(ec_node(&e->core, c)->op),
            e->core.f->steps[e->core.si].name);
  const IrNode *nd = ec_node(&e->core, c);
  return e->slot_of[c] =
             add_slot(e, c, off, ec_mtype(&e->core, c), ec_str(&e->core, "%s %s", op_name(nd->op), shape_txt(e, c)));
}

// The pointer (b<k>) to node c's buffer in the current kernel.
const char *cu_ptr(Emit *e, int c) {
  int k = slot(e, c);
  e->slots[k].decl = true;
  return slot_name(e, k);
}

// The offset argument (o.b[k]) of node c's buffer, for a kernel that addresses it through a table.
const char *cu_offset_arg(Emit *e, int c) { return ec_str(&e->core, "o.b[%d]", slot(e, c)); }

// A pointer to a scratch buffer that is no node (partial sums, row statistics).
const char *cu_raw_ptr(Emit *e, int64_t off, const char *type, const char *what) {
  for (int k = 0; k < e->nslots; k++)
    if (e->slots[k].node < 0 && e->slots[k].off == off)
      return slot_name(e, k);
  int k = add_slot(e, -1, off, type, what);
  e->slots[k].decl = true;
  return slot_name(e, k);
}

//
// Kernels: cu_kbegin starts one, cu_kend closes it and records its launch.
//

void cu_kbegin(Emit *e, const char *role) {
  e->role = role;
  e->table = "";
  e->core.body.len = e->notes.len = 0;
  for (int k = 0; k < e->nslots; k++)
    if (e->slots[k].node >= 0)
      e->slot_of[e->slots[k].node] = -1;
  e->nslots = 0;
  e->sh_d = e->sh_f = false;
  e->shared = 0;
  e->min_blocks = 0;
  e->core.nmemo = e->core.nixm = 0;
  e->core.indent = 1;
  e->core.depth = 0;
  e->core.fresh = 0;
  e->core.loop_ix = NULL;
  e->core.post_anchor = e->core.cur_q = -1;
  e->core.post_inloop = false;
  e->lane = -1;
  e->nlst = 0;
  e->variant_of = -1;
}

int64_t cu_grid_for(int64_t work, int block) {
  int64_t g = (work + block - 1) / block;
  return g < 1 ? 1 : g > MAX_GRID ? MAX_GRID : g;
}

// Threads of a grid-stride kernel's block for `work` items: 256, or fewer (a multiple of 32) when
// there is less to do.
int cu_block_for(int64_t work) { return work >= BLOCK ? BLOCK : (int)cu_align_up(work < 1 ? 1 : work, 32); }

int cu_kend(Emit *e, int64_t grid, int block) {
  ec_drop_unused(&e->core);
  Buf code = {0};
  ec_bput(&code, "(char *arena, MdlStatus *status, const uint64_t *seed, int64_t chunk, MdlArgs o) {\n");
  for (int k = 0; k < e->nslots; k++)
    if (e->slots[k].decl)
      ec_bput(&code, "  %s *const b%d = (%s *)(arena + o.b[%d]); // %s\n", e->slots[k].type, k, e->slots[k].type, k,
              e->slots[k].what);
  if (e->sh_d)
    ec_bput(&code, "  __shared__ double sh_d[48];\n");
  if (e->sh_f)
    ec_bput(&code, "  __shared__ float sh_f[32];\n");
  ec_bappend(&code, &e->core.body);
  ec_bput(&code, "}\n");
  ec_grow(&e->kt, e->nkt, &e->capkt, sizeof *e->kt);
  KText *t = &e->kt[e->nkt];
  t->role = e->role;
  const char *bounds = e->min_blocks == FILL_SM ? ec_str(&e->core, "%d, MDL_SM_THREADS / %d", block, block)
                       : e->min_blocks      ? ec_str(&e->core, "%d, %d", block, e->min_blocks)
                                            : ec_str(&e->core, "%d", block);
  t->pre = (char *)ec_str(&e->core, "extern \"C\" __global__ void __launch_bounds__(%s) ", bounds);
  t->code = arena_strdup(e->core.a, code.s);
  t->notes = arena_strdup(e->core.a, e->notes.s ? e->notes.s : "");
  t->table = e->table;
  t->shared = e->shared;
  free(code.s);
  if (e->variant_of >= 0) {
    // A variant runs on its launch's arguments: the same buffers in the same order.
    SLaunch *l = &e->sl[e->variant_of];
    bool same = l->nargs == e->nslots;
    for (int k = 0; same && k < e->nslots; k++)
      same = l->args[k] == e->slots[k].off;
    if (!same)
      ec_fail(&e->core, "step %s: a kernel variant addresses other buffers than its kernel",
              e->core.f->steps[e->core.si].name);
    l->alt_kt = e->nkt, l->alt_grid = grid, l->alt_block = block;
    return e->nkt++;
  }
  ec_grow(&e->sl, e->nsl, &e->capsl, sizeof *e->sl);
  SLaunch *l = &e->sl[e->nsl++];
  *l = (SLaunch){.kt = e->nkt, .gemm = -1, .grid = grid, .block = block, .nargs = e->nslots, .alt_kt = -1};
  l->args = arena_alloc(e->core.a, sizeof(int64_t) * (size_t)(e->nslots + 1));
  for (int k = 0; k < e->nslots; k++)
    l->args[k] = e->slots[k].off;
  return e->nkt++;
}

// Launches kernel kt (just ended) once more with another grid and chunk argument.
void cu_relaunch(Emit *e, int kt, int64_t grid, int64_t chunk) {
  ec_grow(&e->sl, e->nsl, &e->capsl, sizeof *e->sl);
  SLaunch *last = NULL;
  for (int i = 0; i < e->nsl; i++)
    if (e->sl[i].kt == kt)
      last = &e->sl[i];
  e->sl[e->nsl] = *last;
  e->sl[e->nsl].grid = grid;
  e->sl[e->nsl].chunk = chunk;
  e->nsl++;
}

void cu_gemm_add(Emit *e, CudaGemm gm) {
  gm.step = e->core.si;
  ec_grow(&e->sg, e->nsg, &e->capsg, sizeof *e->sg);
  e->sg[e->nsg] = gm;
  ec_grow(&e->sl, e->nsl, &e->capsl, sizeof *e->sl);
  e->sl[e->nsl++] = (SLaunch){.kt = -1, .gemm = e->nsg++, .alt_kt = -1};
}

// The shared arrays of the block reductions, declared at the top of the kernel when used.
const char *cu_sh_double(Emit *e) {
  if (!e->sh_d)
    e->shared += 384;
  e->sh_d = true;
  return "sh_d";
}

const char *cu_sh_float(Emit *e) {
  if (!e->sh_f)
    e->shared += 128;
  e->sh_f = true;
  return "sh_f";
}

//
// The evaluator's hooks (emit_walk.h: EmitTarget).
//

// Is ix the index of the lane being written in a four-lane loop body, for a value of that loop's size
// that the lanes load as one float4 (f32), or store as one float4 (f32) or ushort4 (bf16)?
static bool lane_ix(const Emit *e, int c, const char *ix, bool storing) {
  DType dt = ec_node(&e->core, c)->dtype;
  return e->lane >= 0 && (dt == DT_F32 || (storing && dt == DT_BF16)) && e->core.loop_ix &&
         !strcmp(ix, e->core.loop_ix) && ec_numel(&e->core, c) == e->core.loop_n;
}

// Stores value v of node c at ix; in a four-lane body the lanes' stores become one vector store. A
// CAST of this step to bf16 stores its input rounded (v is that rounding widened back).
void cu_store(EmitCore *core, int c, const char *ix, const char *v) {
  Emit *e = (Emit *)core;
  const IrNode *nd = ec_node(&e->core, c);
  if (nd->op == OP_CAST && nd->dtype == DT_BF16 && e->core.in_step[c])
    v = ew_val(&e->core, nd->in[0], ix);
  if (lane_ix(e, c, ix, true)) {
    ec_grow(&e->lst, e->nlst, &e->caplst, sizeof *e->lst);
    e->lst[e->nlst++] = (LaneStore){c, e->lane, v};
    return;
  }
  const char *stmt = ec_str(&e->core, "%s[%s] = %s;", cu_ptr(e, c), ix, ec_store(&e->core, c, v));
  if (e->defer) {
    ec_grow(&e->held, e->nheld, &e->capheld, sizeof *e->held);
    e->held[e->nheld++] = stmt;
    return;
  }
  ec_line(&e->core, "%s", stmt);
}

// A CONCAT read at the lane's own index in a four-lane body, whose four lanes' values lie side by
// side in one f32 part (ec_concat_ptr), 16-byte aligned: the axis is followed by a multiple of 4
// elements, or is the last and every part's length a multiple of 4 (lane 0's index, i0 in both
// four-lane bodies, is a multiple of 4). GPT-2's qkv gradient: dq, dk, dv.
static bool concat_lanes(Emit *e, int c, const char *ix) {
  const IrNode *nd = ec_node(&e->core, c);
  if (nd->op != OP_CONCAT || e->lane < 0 || !e->core.loop_ix || strcmp(ix, e->core.loop_ix) ||
      ec_numel(&e->core, c) != e->core.loop_n || ec_has_target(&e->core, c) || !ec_concat_direct(&e->core, c))
    return false;
  int ax = (int)nd->ia[0];
  int64_t inner = ec_span(nd->shape, ax + 1, nd->shape.rank);
  bool fours = inner % 4 == 0 || inner == 1;
  for (int k = 0; k < nd->nin; k++) {
    const IrNode *in = ec_node(&e->core, ec_canon(&e->core, nd->in[k]));
    fours = fours && in->dtype == DT_F32 && (inner % 4 == 0 || in->shape.d[ax] % 4 == 0);
  }
  return fours;
}

// In a four-lane body, a value in memory read at the lane's own index comes from one float4 load
// shared by the four lanes, and so do a CONCAT's parts (concat_lanes).
const char *cu_lanes(EmitCore *core, int c, const char *ix) {
  Emit *e = (Emit *)core;
  bool mem = ec_in_memory(core, c);
  if (mem ? !lane_ix(e, c, ix, false) : !concat_lanes(e, c, ix))
    return NULL;
  const char *q = ec_memo_get(core, c, "float4");
  if (!q) {
    q = ec_str(core, "f%d", ++core->fresh);
    if (mem)
      ec_line(core, "const float4 %s = reinterpret_cast<const float4 *>(%s)[q];", q, cu_ptr(e, c));
    else
      ec_line(core, "const float4 %s = *(const float4 *)%s;", q, ec_concat_ptr(core, c, "i0"));
    ec_memo_put(core, c, "float4", q);
  }
  return ec_str(core, "%s.%c", q, "xyzw"[e->lane]);
}

// A local's name: v and a number, fresh in the kernel.
const char *cu_local(EmitCore *core, int c, const char *ix) {
  (void)c, (void)ix;
  return ec_str(core, "v%d", ++core->fresh);
}

const char *cu_base(EmitCore *core, int n) { return cu_ptr((Emit *)core, n); }

// The step's seed is read from device memory, where the runtime writes it before each step: a
// captured graph replays its launches' arguments as they were, so a seed passed by value would
// repeat the first step's dropout masks in every step.
const char *cu_seed(EmitCore *core) {
  (void)core;
  return "(*seed)";
}

// A CAST to fp8: its tensor's scale and amax in the arena's fp8 region (CudaPlan.fp8).
const char *cu_fp8_cast(EmitCore *core, const IrNode *cast, const char *x) {
  const Emit *e = (const Emit *)core;
  int64_t t = cast->ia[1], n = core->g->nfp8;
  return ec_str(core, "mdl_cast_%s(%s, (const float *)(arena + %lld), (unsigned *)(arena + %lld))",
                cast->ia[0] == DT_F8E5M2 ? "e5m2" : "e4m3", x, (long long)(e->fp8 + 4 * t),
                (long long)(e->fp8 + 8 * n + 4 * t));
}

//
// Elementwise kernels, each a phase: its stores count as written after it.
//

// The ops of a list of nodes, for a kernel's comment.
static const char *op_list(Emit *e, const int *nodes, int k) {
  Buf b = {0};
  for (int t = 0; t < k; t++)
    ec_bput(&b, "%s%s", t ? ", " : "", op_name(ec_node(&e->core, nodes[t])->op));
  return ec_buf_str(&e->core, &b);
}

// The deferred stores of a four-lane body: one float4 (f32) or ushort4 (bf16) store per node that has
// all four lanes.
void cu_flush_lanes(Emit *e) {
  for (int i = 0; i < e->nlst; i++) {
    const LaneStore *s = &e->lst[i];
    if (s->lane != 0)
      continue;
    const char *v[4] = {s->value, NULL, NULL, NULL};
    for (int j = 0; j < e->nlst; j++)
      if (e->lst[j].node == s->node && e->lst[j].lane > 0)
        v[e->lst[j].lane] = e->lst[j].value;
    if (!v[1] || !v[2] || !v[3]) {
      ec_fail(&e->core, "step %s: node %d is stored in some lanes only", e->core.f->steps[e->core.si].name, s->node);
      continue;
    }
    const char *vt = ec_node(&e->core, s->node)->dtype == DT_BF16 ? "ushort4" : "float4";
    ec_line(&e->core, "reinterpret_cast<%s *>(%s)[q] = make_%s(%s, %s, %s, %s);", vt, cu_ptr(e, s->node), vt,
            ec_store(&e->core, s->node, v[0]), ec_store(&e->core, s->node, v[1]), ec_store(&e->core, s->node, v[2]),
            ec_store(&e->core, s->node, v[3]));
  }
  e->nlst = 0;
}

// One elementwise kernel over `n` elements writing nodes[0..k) (all of that size), grid-stride, four
// elements per thread when n is a multiple of 4. post_anchor names the GEMM whose epilogue this is.
void cu_pw_loop(EmitCore *core, const int *nodes, int k, int64_t n, int post_anchor, const char *role) {
  Emit *e = (Emit *)core;
  ec_phase_begin(&e->core);
  cu_kbegin(e, role);
  bool vec = n % 4 == 0;
  int64_t work = vec ? n / 4 : n;
  int block = cu_block_for(work);
  cu_note(e, "elementwise over %lld%s: %s", (long long)n, vec ? ", 4 per thread" : "", op_list(e, nodes, k));
  ec_enter(&e->core, "for (%s q = blockIdx.x * blockDim.x + threadIdx.x; q < %lld; q += gridDim.x * blockDim.x)",
           e->core.ixt, (long long)work);
  e->core.post_anchor = post_anchor;
  e->core.post_inloop = false;
  e->core.loop_n = n;
  if (vec) {
    ec_line(&e->core, "const %s i0 = 4 * q;", e->core.ixt);
    for (int lane = 1; lane < 4; lane++)
      ec_line(&e->core, "const %s i%d = i0 + %d;", e->core.ixt, lane, lane);
  }
  int mark = e->core.nphase;
  for (int lane = 0; lane < (vec ? 4 : 1); lane++) {
    const char *ix = vec ? ec_str(&e->core, "i%d", lane) : "q";
    if (vec)
      e->lane = lane;
    for (int i = mark; i < e->core.nphase; i++)
      e->core.stored[e->core.phase_nodes[i]] = false;
    e->core.nphase = mark;
    e->core.loop_ix = ix;
    e->core.post_ix = ix;
    ew_pw_values(&e->core, nodes, k, ix);
  }
  cu_flush_lanes(e);
  e->lane = -1;
  ec_leave(&e->core);
  e->core.loop_ix = NULL;
  e->core.post_anchor = -1;
  e->core.cur_q = -1;
  cu_kend(e, cu_grid_for(work, block), block);
  ec_phase_end(&e->core);
}

// n's rows (last axis) in memory: n itself, or a SLICE of the last axis of a tensor in memory (q, k,
// v out of one qkv buffer), read in place with that tensor's stride.
Rows cu_rows_of(Emit *e, int n) {
  int src;
  int64_t start;
  if (ec_row_slice(&e->core, n, &src, &start))
    return (Rows){src, start, ec_last_dim(&e->core, src)};
  return (Rows){ec_need(&e->core, n), 0, ec_last_dim(&e->core, n)};
}

// The pointer expression of a Rows in the current kernel.
const char *cu_rows_base(Emit *e, Rows r) {
  return r.at ? ec_str(&e->core, "(%s + %lld)", cu_ptr(e, r.node), (long long)r.at) : cu_ptr(e, r.node);
}

//
// Rows: a warp per row, or a block for long rows, the row's elements spread over the threads
// (element j of the row lives in thread j % TPR, slot j / TPR).
//

// The fewest threads per row (a warp at least, a power of two) that hold at most `most` elements each.
RowShape cu_row_shape(Emit *e, int64_t cols, int64_t groups, int most) {
  int tpr = 32;
  while (tpr < 1024 && (cols + tpr - 1) / tpr > most)
    tpr *= 2;
  RowShape rs = {tpr, (int)((cols + tpr - 1) / tpr), tpr == 32 ? BLOCK / 32 : 1, tpr == 32 ? BLOCK : tpr, groups, 0};
  rs.grid = (groups + rs.rpb - 1) / rs.rpb;
  if (rs.npl > 64)
    ec_fail(&e->core, "step %s: rows of %lld elements are too long", e->core.f->steps[e->core.si].name,
            (long long)cols);
  return rs;
}

const char *cu_rs_who(Emit *e, const RowShape *rs) {
  return rs->tpr == 32 ? "a warp" : ec_str(&e->core, "a block of %d threads", rs->tpr);
}

// Opens the scope of row group `var` (r, or k for blocks of rows); tr is the thread within the row.
void cu_rows_open(Emit *e, const RowShape *rs, const char *var) {
  if (rs->tpr == 32) {
    ec_line(&e->core, "const %s %s = blockIdx.x * %d + (threadIdx.x >> 5);", e->core.ixt, var, rs->rpb);
    ec_line(&e->core, "const int tr = threadIdx.x & 31;");
  } else {
    ec_line(&e->core, "const %s %s = blockIdx.x;", e->core.ixt, var);
    ec_line(&e->core, "const int tr = threadIdx.x;");
  }
  if (rs->grid * rs->rpb > rs->groups)
    ec_enter(&e->core, "if (%s < %lld)", var, (long long)rs->groups);
  else
    ec_enter(&e->core, "%s", "");
}

const char *cu_rsum(Emit *e, const RowShape *rs, const char *x) {
  return rs->tpr == 32 ? ec_str(&e->core, "mdl_warp_sum(%s)", x)
                       : ec_str(&e->core, "mdl_block_sum(%s, %s)", x, cu_sh_double(e));
}

const char *cu_rfmax(Emit *e, const RowShape *rs, const char *x) {
  return rs->tpr == 32 ? ec_str(&e->core, "mdl_warp_fmax(%s)", x)
                       : ec_str(&e->core, "mdl_block_fmax(%s, %s)", x, cu_sh_float(e));
}
