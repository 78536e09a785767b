// emit_cuda_kit.c: the CUDA emitter's toolkit, what its kernel families build with: lines and notes,
// scratch and the buffers of a kernel, kernels and their launches, the inline evaluator, elementwise
// kernels, and row kernels' shapes. See emit_cuda.c for the design.
#include "mdl.h"
#include "emit_common.h"
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
  e->loop_ix = NULL;
  e->post_anchor = e->cur_q = -1;
  e->post_inloop = false;
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
// The inline evaluator.
//

// Reading node c at ix from memory: records reads that the chosen layout must allow.
static void note_read(Emit *e, int c, const char *ix) {
  bool at_post = e->post_anchor == c && strcmp(ix, e->post_ix) == 0;
  if (e->core.in_step[c] && e->core.grp[c] >= 0 && !at_post && ec_offset(&e->core, c) < 0)
    ec_flag(&e->core, e->core.spill, c);
}

// Is ix the index of the lane being written in a four-lane loop body, for a value of that loop's size
// that the lanes load as one float4 (f32), or store as one float4 (f32) or ushort4 (bf16)?
static bool lane_ix(const Emit *e, int c, const char *ix, bool storing) {
  DType dt = ec_node(&e->core, c)->dtype;
  return e->lane >= 0 && (dt == DT_F32 || (storing && dt == DT_BF16)) && e->loop_ix && !strcmp(ix, e->loop_ix) &&
         ec_numel(&e->core, c) == e->loop_n;
}

// Stores value v of node c at ix; in a four-lane body the lanes' stores become one vector store. A
// CAST of this step to bf16 stores its input rounded (v is that rounding widened back).
static void store(Emit *e, int c, const char *ix, const char *v) {
  const IrNode *nd = ec_node(&e->core, c);
  if (nd->op == OP_CAST && nd->dtype == DT_BF16 && e->core.in_step[c])
    v = cu_val(e, nd->in[0], ix);
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
  if (nd->op != OP_CONCAT || e->lane < 0 || !e->loop_ix || strcmp(ix, e->loop_ix) ||
      ec_numel(&e->core, c) != e->loop_n || ec_has_target(&e->core, c) || !ec_concat_direct(&e->core, c))
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

// The value of node n at flat index ix, as an expression; emits what computes it. A step output met
// at the current loop's own index is stored on the way. In a four-lane body, a value in memory read
// at the lane's own index comes from one float4 load shared by the four lanes (so do a CONCAT's
// parts, concat_lanes).
const char *cu_val(Emit *e, int n, const char *ix) {
  int c = ec_canon(&e->core, n);
  const IrNode *nd = ec_node(&e->core, c);
  if (nd->op == OP_CONST)
    return nd->dtype == DT_I32 ? ec_ilit(&e->core, nd->fa[0]) : cu_flit(e, nd->fa[0]);
  if (ec_numel(&e->core, c) == 1)
    ix = "0";
  const char *hit = ec_memo_get(&e->core, c, ix);
  if (hit)
    return hit;
  const char *name = ec_str(&e->core, "v%d", ++e->core.fresh);
  if (ec_in_memory(&e->core, c)) {
    note_read(e, c, ix);
    if (lane_ix(e, c, ix, false)) {
      const char *q = ec_memo_get(&e->core, c, "float4");
      if (!q) {
        q = ec_str(&e->core, "f%d", ++e->core.fresh);
        ec_line(&e->core, "const float4 %s = reinterpret_cast<const float4 *>(%s)[q];", q, cu_ptr(e, c));
        ec_memo_put(&e->core, c, "float4", q);
      }
      name = ec_str(&e->core, "%s.%c", q, "xyzw"[e->lane]);
    } else {
      ec_line(&e->core, "const %s %s = %s;", ec_ctype(&e->core, c), name,
              ec_load(&e->core, c, ec_str(&e->core, "%s[%s]", cu_ptr(e, c), ix)));
    }
  } else if (e->core.in_step[c] && concat_lanes(e, c, ix)) {
    const char *q = ec_memo_get(&e->core, c, "float4");
    if (!q) {
      q = ec_str(&e->core, "f%d", ++e->core.fresh);
      ec_line(&e->core, "const float4 %s = *(const float4 *)%s;", q, ec_concat_ptr(&e->core, c, "i0"));
      ec_memo_put(&e->core, c, "float4", q);
    }
    name = ec_str(&e->core, "%s.%c", q, "xyzw"[e->lane]);
  } else if (e->core.in_step[c] && ec_is_pointwise(nd->op)) {
    const char *expr = ec_pointwise_expr(&e->core, c, ix);
    ec_line(&e->core, "const %s %s = %s;", ec_ctype(&e->core, c), name, expr);
    bool own = e->loop_ix && ec_numel(&e->core, c) == e->loop_n && (strcmp(ix, e->loop_ix) == 0 || e->loop_n == 1);
    if (ec_has_target(&e->core, c) && !e->core.stored[c] && own) {
      store(e, c, ix, name);
      e->core.stored[c] = true;
      e->core.phase_nodes[e->core.nphase++] = c;
    }
  } else if (e->core.in_step[c] && e->core.grp[c] >= 0) {
    // An anchor of this step that is not in memory (yet): read inside its own kernel at another
    // index, or after it while only a local existed. Flag it; the next pass lays it out.
    if (e->post_inloop && e->post_anchor == c && e->cur_q >= 0)
      ec_flag(&e->core, e->core.post_bad, e->cur_q);
    else
      ec_flag(&e->core, e->core.spill, c);
    return "0.0f";
  } else {
    ec_fail(&e->core, "step %s reads node %d (%s), which no earlier step wrote", e->core.f->steps[e->core.si].name, c,
            op_name(nd->op));
    return "0";
  }
  ec_memo_put(&e->core, c, ix, name);
  return name;
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
void cu_pw_loop(Emit *e, const int *nodes, int k, int64_t n, int post_anchor, const char *role) {
  ec_phase_begin(&e->core);
  cu_kbegin(e, role);
  bool vec = n % 4 == 0;
  int64_t work = vec ? n / 4 : n;
  int block = cu_block_for(work);
  cu_note(e, "elementwise over %lld%s: %s", (long long)n, vec ? ", 4 per thread" : "", op_list(e, nodes, k));
  ec_enter(&e->core, "for (%s q = blockIdx.x * blockDim.x + threadIdx.x; q < %lld; q += gridDim.x * blockDim.x)",
           e->core.ixt, (long long)work);
  e->post_anchor = post_anchor;
  e->post_inloop = false;
  e->loop_n = n;
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
    e->loop_ix = ix;
    e->post_ix = ix;
    for (int t = 0; t < k; t++) {
      e->cur_q = nodes[t];
      const char *v = cu_val(e, nodes[t], ix);
      if (!e->core.stored[nodes[t]]) {
        store(e, nodes[t], ix, v);
        e->core.stored[nodes[t]] = true;
        e->core.phase_nodes[e->core.nphase++] = nodes[t];
      }
    }
  }
  cu_flush_lanes(e);
  e->lane = -1;
  ec_leave(&e->core);
  e->loop_ix = NULL;
  e->post_anchor = -1;
  e->cur_q = -1;
  cu_kend(e, cu_grid_for(work, block), block);
  ec_phase_end(&e->core);
}

// Elementwise kernels for a list of nodes, one per distinct size, in order of first appearance.
void cu_pw_loops(Emit *e, const int *nodes, int k, int post_anchor, const char *role) {
  bool *done = ec_xcalloc((size_t)k, sizeof *done);
  int *same = ec_xcalloc((size_t)k, sizeof *same);
  for (int t = 0; t < k; t++) {
    if (done[t])
      continue;
    int ns = 0;
    for (int u = t; u < k; u++)
      if (!done[u] && ec_numel(&e->core, nodes[u]) == ec_numel(&e->core, nodes[t])) {
        same[ns++] = nodes[u];
        done[u] = true;
      }
    cu_pw_loop(e, same, ns, ec_numel(&e->core, nodes[t]), post_anchor, role);
  }
  free(done);
  free(same);
}

void cu_flush(Emit *e) {
  if (e->core.npending)
    cu_pw_loops(e, e->core.pending, e->core.npending, -1, "prep");
  e->core.npending = 0;
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

// Evaluates the post outputs inside the anchor's own kernel, where the anchor's value at index ix is
// the expression y.
void cu_post_inloop(Emit *e, int anchor, const int *q, int nq, const char *ix, int64_t n, const char *y) {
  e->loop_ix = ix;
  e->loop_n = n;
  e->post_anchor = anchor;
  e->post_ix = ix;
  e->post_inloop = true;
  ec_memo_put(&e->core, anchor, ec_numel(&e->core, anchor) == 1 ? "0" : ix, y);
  for (int t = 0; t < nq; t++) {
    e->cur_q = q[t];
    cu_val(e, q[t], ix);
  }
  e->post_anchor = -1;
  e->post_inloop = false;
  e->cur_q = -1;
}

// The output buffer of a row-wise or reducing anchor: whole (arena slot or scratch) when it is an
// output or read at other indices; otherwise only a local exists.
bool cu_whole(Emit *e, int a) {
  if (ec_offset(&e->core, a) >= 0)
    return true;
  if (e->core.spill[a]) {
    e->core.scratch[a] = true;
    return true;
  }
  return false;
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
