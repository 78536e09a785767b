// emit_cuda.c: the CUDA emitter. It turns the step plan (a Fusion and its MemPlan) into one CUDA C++
// translation unit for NVRTC (a prelude of our own, runtime/kernels/prelude.cuh, no #include) and a schedule
// (CudaPlan): the kernel launches and cuBLASLt GEMMs of one training step, in order. This file holds
// the module, its steps and their launch plan, kernels and their buffers, the inline evaluator,
// elementwise kernels and GEMMs; the other kernel families are in emit_cuda_rows.c, emit_cuda_lmhead.c,
// emit_cuda_attn.c and emit_cuda_opt.c (emit_common.h lists them), sharing emit_cuda_impl.h.
//
// Design. The emitter mirrors emit_c.c: the same split of a step's nodes into anchors (ops that need
// a kernel shape of their own) and pointwise nodes, evaluated inline at any flat index by the same
// evaluator `cu_val` through their index maps; the same groups of anchors (norm backward siblings,
// attention backward, cross-entropy with its gradient, the LM head, the optimizer), emitted in the
// same order, with the same passes that settle which values a step keeps whole. Where the C emitter
// opens a loop nest inside one function, this one opens a kernel: a step becomes a short sequence of
// launches (inputs computed first, the anchor's kernel, a second stage of a reduction, a GEMM and
// its epilogue, outputs left over), named after the step, "<step>" for the anchor and
// "<step>_<role>" for the others. Launch shapes per kind:
//   - elementwise: grid-stride loops, four elements per thread through float4 loads and stores
//     when the count is a multiple of 4 (arena offsets are 64-byte aligned);
//   - row-wise ops (layernorm / rmsnorm forward and backward, softmax, cross-entropy): a warp per
//     row, or a block for rows longer than 1024, the row in registers, shuffle reductions; a norm
//     backward whose blocks take several rows stages them in shared memory by cp.async, the next
//     row's copies in flight while the block works on this one (norm_stage);
//   - column sums (norm dw / db, reductions over an outer axis): per-block partial sums, then a
//     block per 32 columns adds them in groups of rows, in a fixed order (colsum_open):
//     deterministic, no atomics;
//   - attention: flash-style, one block per (batch, head, tile of queries), keys and values in
//     tiles in shared memory, online softmax; the forward stores each row's log-sum-exp, from which
//     the backward recomputes the probabilities: a first kernel takes D = dout . out per row, then
//     dq per query tile and dk, dv per key tile (each key tile owned by one block, summed in query
//     order); in bf16 with heads of a multiple of 16 channels the forward and the backward's dq and
//     dk, dv kernels run on tensor cores (mma.sync m16n8k16, FlashAttention-2's layout: a warp per
//     16 queries or keys, 8 warps a block in the forward and dk, dv, so that each staged tile of 64
//     keys or queries serves 128 rows, 4 in dq, whose registers allow no more), the B fragments of
//     the products read from shared tiles by ldmatrix (transposing for the products over keys or
//     queries), the tiles staged by cp.async into two buffers so that the next tile's copies run
//     while the warps compute on this one, the exponentials taken in base 2 (exp2f of the scores
//     times scale log2(e) less a maximum, one FMA); within documents each warp votes per tile to
//     skip tiles of other documents and to mask only tiles that cross one;
//   - embedding backward: the positions listed by bucket of 32 table rows in increasing order (a
//     stable counting sort), then a warp per bucket x 32 columns adds the rows of dy in that order,
//     loading 32 of them before adding, and stores the table 8 rows a group, their loads first
//     (cu_emit_embed_bwd);
//   - the optimizer: a sum of squares per fixed chunk, one block adding the chunks, then AdamW over
//     the flat buffers through a table of segments (each block bisects to the segments of its
//     chunk), rounding each parameter that has a bf16 copy (fuse.c, rule 11) into it as it updates it;
//   - the LM head, chunk by chunk: GEMMs into chunks whose rows are padded to 64-aligned classes, and
//     a cross-entropy kernel between them (cu_emit_lmhead).
// The families of fixed code with parameters (the tensor-core attention kernels, cross-entropy rows,
// the optimizer) are templates in runtime/kernels/prelude.cuh: their kernels here declare their buffers and
// call an instance of the template at the shapes chosen (template arguments, so the compiler sees the
// same constants it saw when the emitter printed them); what varies per model (elementwise chains,
// epilogues, row kernels' fused inputs and outputs) is emitted.
// GEMMs are not kernels: each is a CudaGemm (cuBLASLt, row-major description) whose epilogue covers
// bias and GELU when the chain allows; the rest of the chain is the "<step>_epilogue" kernel.
//
// Kernels address memory only through byte offsets passed at launch (MdlArgs), so the kernels of
// identical layers are the same text: each distinct kernel is emitted once, named after the first
// step that uses it, and launched by every step that does. Values a step keeps to itself (and
// reduction partials, the attention backward's D per row, the LM head's logits) live in scratch
// after the memory plan's arena, reused by every step.
//
// Numerics follow interp.c as emit_c does: fp32 elementwise math; sums over many elements in double
// (norm statistics, column sums, reductions, softmax denominators, the gradient norm) in a fixed
// order; AdamW in double per element. Every reduction tree is fixed by the launch shape, so results
// do not depend on scheduling.
//
// bf16 (the precision pass's CASTs, read only by GEMMs and layout ops): a bf16 value lives in memory
// as uint16_t and is a float everywhere else; kernels widen it as they load it and round it as they
// store it (ec_load / ec_store), and the four lanes of an elementwise kernel store four bf16 values
// as one 8-byte ushort4. A GEMM reads bf16 operands and sums in f32; its result is written as bf16
// by cuBLASLt itself when a CAST is its only reader and no epilogue is needed (cuBLASLt's bias and
// aux take D's type, and ours are f32), else it is f32 and the epilogue kernel rounds. The LM head's
// cross-entropy kernel writes dlogits rounded to bf16 into a chunk of its own for the dx and dW GEMMs.
// Attention marked bf16 (ia[4]) rounds where mdl.h says: q, k, v as every kernel loads them (the
// precision pass stores them as bf16 CASTs, which the kernels widen or pack into fragments as they
// are), and e in the forward's P V (on tensor cores, or in the CUDA-core kernels where those do not
// apply).
//
// fp8 (precision fp8): the device arena holds, between the memory plan's part and the scratch, each
// scaled tensor's scale, 1 / scale and amax (CudaPlan.fp8). A CAST to fp8, computed inline by the
// kernel that produces its input like a bf16 one, scales, rounds and notes |x| in its tensor's amax
// (mdl_cast_e4m3 / e5m2: an atomicMax on the float's bits where the amax does not cover it already);
// the value lives in memory as its one-byte code. A GEMM of fp8 operands names their 1 / scales
// (cuBLASLt's A and B scale pointers); the runtime does not run those yet, the emulator does.
//
// What does not depend on the target (where values are, groups and their order, lines and scopes,
// the index maps of the evaluator) is in emit_common.c, whose state EmitCore this emitter embeds as
// e->core.
#include "mdl.h"
#include "emit_common.h"
#include "emit_cuda.h"
#include "emit_cuda_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// The module's first kernel, after the prelude (a unit of its own, as every kernel: CudaUnit).
static const char accumulate_kernel[] =
    "\n"
    "// Not of the plan: the runtime's sum of gradients over micro-batches (Engine.inputs_from), y += x in\n"
    "// f32, element by element, as the host would add them.\n"
    "extern \"C\" __global__ void mdl_accumulate(float *y, const float *x, int64_t n) {\n"
    "  const int64_t stride = (int64_t)gridDim.x * blockDim.x;\n"
    "  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)\n"
    "    y[i] += x[i];\n"
    "}\n";

_Static_assert(CUDA_MAX_ARGS == 48, "the prelude's MdlArgs holds 48 offsets");
// A kernel addresses the values of its step (the fusion pass keeps them to FUSE_MAX_BUFFERS) and
// scratch of its own: a norm backward's partials of dw, db and its column sums at most.
_Static_assert(FUSE_MAX_BUFFERS + 2 + EC_MAX_COLSUMS <= CUDA_MAX_ARGS, "room for the step's buffers");
_Static_assert(CUDA_ERR_EMBED_ID == 1 && CUDA_ERR_TARGET == 2, "the prelude's MDL_ERR_* codes");

const char *emit_cuda_prelude(void) { return ec_prelude_cuda; }

static int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

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
  e->stop = align_up(at + (bytes ? bytes : 1), SCRATCH_ALIGN);
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
int cu_block_for(int64_t work) { return work >= BLOCK ? BLOCK : (int)align_up(work < 1 ? 1 : work, 32); }

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

// The evaluator hooks of EmitCore (core is the first member of Emit).
static const char *core_val(EmitCore *core, int n, const char *ix) { return cu_val((Emit *)core, n, ix); }
static const char *core_base(EmitCore *core, int n) { return cu_ptr((Emit *)core, n); }

// The step's seed is read from device memory, where the runtime writes it before each step: a
// captured graph replays its launches' arguments as they were, so a seed passed by value would
// repeat the first step's dropout masks in every step.
static const char *core_seed(EmitCore *core) {
  (void)core;
  return "(*seed)";
}

// A CAST to fp8: its tensor's scale and amax in the arena's fp8 region (CudaPlan.fp8).
static const char *core_fp8_cast(EmitCore *core, const IrNode *cast, const char *x) {
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
static void pw_loop(Emit *e, const int *nodes, int k, int64_t n, int post_anchor, const char *role) {
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
static void pw_loops(Emit *e, const int *nodes, int k, int post_anchor, const char *role) {
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
    pw_loop(e, same, ns, ec_numel(&e->core, nodes[t]), post_anchor, role);
  }
  free(done);
  free(same);
}

void cu_flush(Emit *e) {
  if (e->core.npending)
    pw_loops(e, e->core.pending, e->core.npending, -1, "prep");
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
// Anchors.
//

// The nodes of this step that read c, looking through RESHAPEs (of the step, and views); the first
// in *first, and in *outside whether a node of another step reads c.
static int step_readers(Emit *e, int c, int *first, bool *outside) {
  int n = 0;
  for (int k = 0; k < e->nusers[c]; k++) {
    int u = e->users[c][k];
    if (ec_node(&e->core, u)->op == OP_RESHAPE && (e->core.in_step[u] || e->core.f->step_of[u] < 0))
      n += step_readers(e, u, first, outside);
    else if (!e->core.in_step[u])
      *outside = true;
    else if (n++ == 0)
      *first = u;
  }
  return n;
}

// Is u an f32 ADD of v (through RESHAPEs) and x, an f32 tensor in memory of `count` elements and
// row length n (v's count: a residual, which cuBLASLt adds as its out-of-place C; n: a bias)?
static bool add_of(Emit *e, int v, int u, int64_t count, int64_t n, int *x) {
  const IrNode *nd = ec_node(&e->core, u);
  if (nd->op != OP_ADD || nd->dtype != DT_F32 || ec_numel(&e->core, u) != ec_numel(&e->core, v))
    return false;
  bool first = ec_through_reshapes(&e->core, nd->in[0]) == v, second = ec_through_reshapes(&e->core, nd->in[1]) == v;
  if (first == second)
    return false;
  int c = ec_canon(&e->core, nd->in[first ? 1 : 0]);
  if (!ec_in_memory(&e->core, c) || ec_offset(&e->core, c) < 0 || ec_node(&e->core, c)->dtype != DT_F32 ||
      ec_numel(&e->core, c) != count || ec_last_dim(&e->core, c) != n)
    return false;
  *x = c;
  return true;
}

// u, the only reader of v, is written and reads it through an ADD of a bias or a residual (add_of)?
static bool then_written_add(Emit *e, int v, int64_t count, int64_t n, int *u, int *x) {
  bool outside = false;
  return !e->core.spill[v] && ec_offset(&e->core, v) < 0 && step_readers(e, v, u, &outside) == 1 && !outside &&
         ec_offset(&e->core, *u) >= 0 && add_of(e, v, *u, count, n, x);
}

// The GEMM epilogue cuBLASLt can apply to mm (m x n): a bias ADD along the rows of a vector in memory
// and / or a GELU, on values nobody else reads at other indices; or, without GELU, the ADD of a
// residual after that (*resid, added as the out-of-place C). *out is the node the GEMM then writes,
// *aux the pre-GELU value it also keeps (or -1).
static CudaEpilogue epilogue_of(Emit *e, int mm, int64_t n, int *out, int *bias, int *aux, int *resid) {
  *out = mm, *bias = *aux = *resid = -1;
  int r1 = -1;
  bool outside = false;
  if (e->core.spill[mm] || step_readers(e, mm, &r1, &outside) != 1)
    return CUDA_EPI_NONE;
  const IrNode *l1 = ec_node(&e->core, r1);
  if (ec_numel(&e->core, r1) != ec_numel(&e->core, mm) || ec_last_dim(&e->core, r1) != n || l1->dtype != DT_F32)
    return CUDA_EPI_NONE;
  if (l1->op == OP_GELU && ec_offset(&e->core, r1) >= 0 && (ec_offset(&e->core, mm) >= 0 || !outside)) {
    *aux = ec_offset(&e->core, mm) >= 0 ? mm : -1;
    *out = r1;
    return CUDA_EPI_GELU;
  }
  if (l1->op != OP_ADD || ec_offset(&e->core, mm) >= 0 || outside)
    return CUDA_EPI_NONE;
  int r2 = -1;
  if (add_of(e, mm, r1, ec_numel(&e->core, mm), n, resid)) { // the residual, then maybe the bias
    if (ec_offset(&e->core, r1) >= 0) {
      *out = r1;
      return CUDA_EPI_NONE;
    }
    if (then_written_add(e, r1, n, n, &r2, bias)) {
      *out = r2;
      return CUDA_EPI_BIAS;
    }
    *resid = -1;
    return CUDA_EPI_NONE;
  }
  bool first = ec_through_reshapes(&e->core, l1->in[0]) == mm, second = ec_through_reshapes(&e->core, l1->in[1]) == mm;
  if (first == second)
    return CUDA_EPI_NONE;
  int b = ec_canon(&e->core, l1->in[first ? 1 : 0]);
  if (!ec_in_memory(&e->core, b) || ec_numel(&e->core, b) != n || ec_last_dim(&e->core, b) != n ||
      ec_node(&e->core, b)->dtype != DT_F32)
    return CUDA_EPI_NONE;
  *bias = b;
  *out = r1;
  bool out2 = false;
  int nr = step_readers(e, r1, &r2, &out2);
  for (int k = 0; k < e->nusers[r1]; k++) {
    int u = e->users[r1][k];
    if (e->core.in_step[u] && ec_node(&e->core, u)->op == OP_GELU && ec_offset(&e->core, u) >= 0 &&
        ec_numel(&e->core, u) == ec_numel(&e->core, r1) && (ec_offset(&e->core, r1) >= 0 || (nr == 1 && !out2))) {
      *aux = ec_offset(&e->core, r1) >= 0 ? r1 : -1;
      *out = u;
      return CUDA_EPI_BIAS_GELU;
    }
  }
  if (then_written_add(e, r1, ec_numel(&e->core, r1), n, &r2, resid)) { // the bias, then the residual
    *out = r2;
    return CUDA_EPI_BIAS;
  }
  if (ec_offset(&e->core, r1) < 0)
    e->core.scratch[r1] = true;
  return CUDA_EPI_BIAS;
}

// The batch stride of a matmul operand of shape s (matrix of mk elements) for output batch shape ob:
// 0 when it has one matrix, mk when it has one per output batch, -1 when it broadcasts otherwise.
static int64_t batch_stride(Shape s, Shape ob, int64_t mk) {
  Shape b = s;
  b.rank -= 2;
  if (shape_numel(b) == 1)
    return 0;
  return shape_numel(b) == shape_numel(ob) ? mk : -1;
}

// The CAST to bf16 that is the only reader of GEMM result mm (n columns) and has a slot in the arena,
// or -1: cuBLASLt then writes the GEMM's sum rounded to bf16 there itself (D of type bf16), which is
// the CAST of the matmul's f32 value. Nothing else may need the f32 value.
static int bf16_result(Emit *e, int mm, int64_t n) {
  int r = -1;
  bool outside = false;
  if (e->core.spill[mm] || ec_offset(&e->core, mm) >= 0 || step_readers(e, mm, &r, &outside) != 1 || outside)
    return -1;
  const IrNode *nd = ec_node(&e->core, r);
  if (nd->op != OP_CAST || nd->dtype != DT_BF16 || ec_offset(&e->core, r) < 0 ||
      ec_numel(&e->core, r) != ec_numel(&e->core, mm) || ec_last_dim(&e->core, r) != n)
    return -1;
  return r;
}

static const char *epi_name(CudaEpilogue k) {
  switch (k) {
  case CUDA_EPI_BIAS: return "bias";
  case CUDA_EPI_GELU: return "gelu";
  case CUDA_EPI_BIAS_GELU: return "bias, gelu";
  default: return "none";
  }
}

static void emit_gemm(Emit *e, int gi, const bool *emitted) {
  int mm = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, mm);
  Shape sa = ec_node(&e->core, nd->in[0])->shape, sb = ec_node(&e->core, nd->in[1])->shape, so = nd->shape;
  bool ta = nd->ia[0], tb = nd->ia[1];
  int64_t m = so.d[so.rank - 2], n = so.d[so.rank - 1], k = ta ? sa.d[sa.rank - 2] : sa.d[sa.rank - 1];
  Rows a, b;
  if (so.rank == 2) {
    a = cu_rows_of(e, nd->in[0]);
    b = cu_rows_of(e, nd->in[1]);
  } else {
    a = (Rows){ec_need(&e->core, nd->in[0]), 0, sa.d[sa.rank - 1]};
    b = (Rows){ec_need(&e->core, nd->in[1]), 0, sb.d[sb.rank - 1]};
  }
  cu_flush(e);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, mm), emitted, q);
  int64_t batches = ec_span(so, 0, so.rank - 2);
  int out = mm, bias = -1, aux = -1, resid = -1, cast = bf16_result(e, mm, n);
  CudaEpilogue epi = CUDA_EPI_NONE;
  DType ab = ec_node(&e->core, a.node)->dtype, ct = cast >= 0 ? DT_BF16 : DT_F32;
  bool fp8 = ab == DT_F8E4M3 || ab == DT_F8E5M2;
  // (an fp8 GEMM takes no epilogue: cuBLASLt's FP8 kernels with an f32 D want a bf16 bias, and ours
  // is f32; the bias, GELU and residual run in the kernel after it, as a batched GEMM's do)
  if (cast >= 0)
    out = cast;
  else if (batches == 1 && !fp8)
    epi = epilogue_of(e, mm, n, &out, &bias, &aux, &resid);
  if (out == mm && ec_offset(&e->core, mm) < 0) {
    for (int t = 0; t < nq && !e->core.spill[mm] && e->core.host[mm] < 0; t++)
      if (ec_offset(&e->core, q[t]) >= 0 && ec_node(&e->core, q[t])->dtype == DT_F32)
        e->core.host[mm] = q[t];
    if (e->core.host[mm] < 0)
      e->core.scratch[mm] = true;
  }
  int64_t sab = dtype_size(ab), sc = dtype_size(ct); // (fp8: one byte, A's and B's)
  CudaGemm gm = {.ab = ab, .c_type = ct, .ta = ta, .tb = tb, .m = m, .n = n, .k = k, .lda = a.stride,
                 .ldb = b.stride, .ldc = n, .batch = 1, .a = cu_buf_off(e, a.node) + sab * a.at,
                 .b = cu_buf_off(e, b.node) + sab * b.at, .c = cu_buf_off(e, out), .epilogue = epi,
                 .bias = bias >= 0 ? cu_buf_off(e, bias) : -1, .aux = aux >= 0 ? cu_buf_off(e, aux) : -1,
                 .beta = resid >= 0 ? 1.0f : 0.0f, .c_apart = resid >= 0, .cin = resid >= 0 ? cu_buf_off(e, resid) : 0,
                 .b_fp8 = fp8 ? ec_node(&e->core, b.node)->dtype : DT_F32,
                 .a_scale = fp8 ? e->fp8 + 4 * (e->core.g->nfp8 + nd->ia[2]) : 0,
                 .b_scale = fp8 ? e->fp8 + 4 * (e->core.g->nfp8 + nd->ia[3]) : 0};
  ec_phase_begin(&e->core);
  if (batches > 1) {
    Shape ob = so;
    ob.rank -= 2;
    int64_t s1 = batch_stride(sa, ob, m * k), s2 = batch_stride(sb, ob, k * n);
    if (s1 >= 0 && s2 >= 0) {
      gm.batch = batches, gm.stride_a = s1, gm.stride_b = s2, gm.stride_c = m * n;
      cu_gemm_add(e, gm);
    } else {
      Shape ba = sa, bb = sb;
      ba.rank -= 2, bb.rank -= 2;
      CudaGemm one = gm;
      for (int64_t t = 0; t < batches; t++) {
        one.a = gm.a + sab * shape_bcast_offset(ob, ba, t) * m * k;
        one.b = gm.b + sab * shape_bcast_offset(ob, bb, t) * k * n;
        one.c = gm.c + sc * t * m * n;
        cu_gemm_add(e, one);
      }
    }
  } else {
    cu_gemm_add(e, gm);
  }
  ec_phase_done(&e->core, out);
  if (aux >= 0)
    ec_phase_done(&e->core, aux);
  ec_phase_end(&e->core);
  nq = ec_post_set(&e->core, gi, ec_numel(&e->core, mm), emitted, q);
  if (nq && !ec_reduction_after(&e->core, gi, emitted, ec_numel(&e->core, mm)))
    pw_loop(e, q, nq, ec_numel(&e->core, mm), mm, "epilogue");
  free(q);
}

static void emit_group(Emit *e, int gi, const bool *emitted) {
  const Group *gr = &e->core.groups[gi];
  switch (gr->kind) {
  case G_NORM_BWD: cu_emit_norm_bwd(e, gi, emitted); return;
  case G_ATTN: cu_emit_attention(e, gi); return;
  case G_ATTN_BWD: cu_emit_attention_bwd(e, gi); return;
  case G_CE: cu_emit_ce(e, gi); return;
  case G_LMHEAD: cu_emit_lmhead(e, gi); return;
  case G_OPT: cu_emit_optimizer(e, gi); return;
  case G_SINGLE: break;
  }
  Op op = ec_node(&e->core, gr->mem[0])->op;
  switch (op) {
  case OP_MATMUL: emit_gemm(e, gi, emitted); return;
  case OP_SUM: case OP_MEAN: case OP_MAX: case OP_TARGET_COUNT: cu_emit_reduce(e, gi, emitted); return;
  case OP_LAYERNORM: case OP_RMSNORM: cu_emit_norm_fwd(e, gi, emitted); return;
  case OP_SOFTMAX: case OP_SOFTMAX_BWD: cu_emit_softmax(e, gi, emitted); return;
  case OP_EMBED: cu_emit_embed(e, gi); return;
  case OP_EMBED_BWD: cu_emit_embed_bwd(e, gi, emitted); return;
  case OP_ROPE: cu_emit_rope(e, gi); return;
  case OP_MAX_BWD: cu_emit_max_bwd(e, gi); return;
  case OP_TOPK: cu_emit_topk(e, gi); return;
  case OP_GATHER: cu_emit_gather(e, gi); return;
  case OP_GATHER_BWD: case OP_SCATTER_ADD: cu_emit_scatter(e, gi); return;
  case OP_ATTENTION_MASK: cu_emit_attn_mask(e, gi); return;
  default: ec_fail(&e->core, "no kernel for %s", op_name(op));
  }
}

//
// Steps.
//

static void pass_reset(Emit *e) {
  size_t n = (size_t)e->core.g->n;
  memset(e->core.written, 0, n * sizeof *e->core.written);
  memset(e->core.scratch, 0, n * sizeof *e->core.scratch);
  memset(e->core.stored, 0, n * sizeof *e->core.stored);
  for (size_t i = 0; i < n; i++) {
    e->core.host[i] = -1;
    e->soff[i] = -1;
  }
  e->stop = 0;
  e->nkt = e->nsl = e->nsg = 0;
  e->core.npending = e->core.nphase = 0;
  e->core.flagged = false;
}

static void emit_step_body(Emit *e) {
  const Step *st = &e->core.f->steps[e->core.si];
  bool *emitted = ec_xcalloc((size_t)e->core.ngroups + 1, sizeof *emitted);
  for (int k = 0; k < e->core.ngroups && !e->core.failed; k++) {
    emit_group(e, e->core.order[k], emitted);
    emitted[e->core.order[k]] = true;
  }
  free(emitted);
  int *rest = ec_xcalloc((size_t)st->nnodes + 1, sizeof *rest), nrest = ec_unwritten(&e->core, rest);
  if (nrest)
    pw_loops(e, rest, nrest, -1, e->core.ngroups ? "rest" : "");
  free(rest);
  ec_check_written(&e->core);
}

// A C identifier from a step name; unique among the steps.
static const char *kernel_name(Emit *e, const char *name, int si, const char **names) {
  char buf[160];
  size_t k = 0;
  for (const char *p = name ? name : ""; *p && k + 1 < sizeof buf - 16; p++)
    buf[k++] = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ? *p : '_';
  buf[k] = 0;
  if (!k || (buf[0] >= '0' && buf[0] <= '9'))
    snprintf(buf, sizeof buf, "k%d_%s", si + 1, name && *name ? name : "step");
  for (int i = 0; i < si; i++)
    if (!strcmp(names[i], buf)) {
      snprintf(buf + strlen(buf), 16, "_%d", si + 1);
      break;
    }
  return arena_strdup(e->core.a, buf);
}

static unsigned long hash_str(const char *a, const char *b, const char *c) {
  unsigned long h = 1469598103934665603ul;
  for (const char *s[3] = {a, b, c}, **p = s; p < s + 3; p++)
    for (const char *q = *p; *q; q++)
      h = (h ^ (unsigned char)*q) * 1099511628211ul;
  return h;
}

// The name of kernel t of the step: an identical kernel's, or a new one (whose text is then added).
static const char *kernel_of(Emit *e, const KText *t, Buf *text) {
  unsigned long h = hash_str(t->table, t->pre, t->code);
  for (int i = 0; i < e->nknown; i++) {
    const Known *k = &e->known[i];
    size_t nt = strlen(t->table), np = strlen(t->pre);
    if (k->hash == h && !strncmp(k->key, t->table, nt) && !strncmp(k->key + nt, t->pre, np) &&
        !strcmp(k->key + nt + np, t->code))
      return k->name;
  }
  const char *name = *t->role ? ec_str(&e->core, "%s_%s", e->sname, t->role) : e->sname;
  for (int i = 0, n = 2; i < e->nknown; i++)
    if (!strcmp(e->known[i].name, name)) {
      name = ec_str(&e->core, "%s_%d", *t->role ? ec_str(&e->core, "%s_%s", e->sname, t->role) : e->sname, n++);
      i = -1;
    }
  ec_grow(&e->known, e->nknown, &e->capknown, sizeof *e->known);
  e->known[e->nknown++] = (Known){ec_str(&e->core, "%s%s%s", t->table, t->pre, t->code), name, h};
  // (a unit at this kernel's place in text: commit_step moves it to the module's)
  ec_grow(&e->units, e->nunits, &e->capunits, sizeof *e->units);
  e->units[e->nunits++] = (CudaUnit){text->len, strlen(t->pre) + strlen(name) + strlen(t->code)};
  ec_bput(text, "\n%s%s%s%s%s", t->table, t->notes, t->pre, name, t->code);
  return name;
}

// Appends the step's kernels and GEMMs, as the last pass left them, to the module and the schedule.
static void commit_step(Emit *e) {
  const Step *st = &e->core.f->steps[e->core.si];
  ec_bput(&e->out, "\n// %s: %s, %d op%s\n", e->sname, ec_kind_name(st->kind), st->nnodes, st->nnodes == 1 ? "" : "s");
  for (int k = 0; k < st->nnodes; k++) {
    const IrNode *nd = ec_node(&e->core, st->nodes[k]);
    char buf[128];
    ec_bput(&e->out, "//   %%%-5d %-18s %-20s %-10s %s%s\n", nd->id, op_name(nd->op), nd->name ? nd->name : "",
            nd->loc.line ? ec_str(&e->core, "line %d", nd->loc.line) : "", dtype_name(nd->dtype),
            shape_str(nd->shape, buf, sizeof buf));
  }
  ec_bput(&e->out, "// runs:\n");
  Buf text = {0};
  const char **names = ec_xcalloc((size_t)e->nkt + 1, sizeof *names);
  int first_unit = e->nunits;
  for (int i = 0; i < e->nsl; i++) {
    const SLaunch *l = &e->sl[i];
    ec_grow(&e->launches, e->nlaunches, &e->caplaunches, sizeof *e->launches);
    CudaLaunch *cl = &e->launches[e->nlaunches++];
    *cl = (CudaLaunch){.step = e->core.si, .gemm = -1};
    if (l->kt < 0) {
      const CudaGemm *gm = &e->sg[l->gemm];
      ec_grow(&e->gemms, e->ngemms, &e->capgemms, sizeof *e->gemms);
      cl->gemm = e->ngemms;
      e->gemms[e->ngemms++] = *gm;
      bool f32 = gm->ab == DT_F32 && gm->c_type == DT_F32;
      ec_bput(&e->out, "//   gemm %d: [%lld x %lld] = %s[%lld x %lld] %s[%lld x %lld]%s%s%s%s%s\n", cl->gemm,
              (long long)gm->m, (long long)gm->n, gm->ta ? "T" : "", (long long)gm->m, (long long)gm->k,
              gm->tb ? "T" : "", (long long)gm->k, (long long)gm->n,
              gm->batch > 1 ? ec_str(&e->core, ", %lld batches", (long long)gm->batch) : "",
              gm->beta != 0 ? (gm->c_apart ? " + a residual C" : " + C") : "",
              gm->epilogue != CUDA_EPI_NONE ? ", epilogue " : "",
              gm->epilogue != CUDA_EPI_NONE ? epi_name(gm->epilogue) : "",
              f32 ? "" : ec_str(&e->core, ", %s A and B, %s C", dtype_name(gm->ab), dtype_name(gm->c_type)));
      continue;
    }
    const KText *t = &e->kt[l->kt];
    if (!names[l->kt])
      names[l->kt] = kernel_of(e, t, &text);
    cl->kernel = names[l->kt];
    cl->grid[0] = (unsigned)l->grid, cl->grid[1] = cl->grid[2] = 1;
    cl->block[0] = (unsigned)l->block, cl->block[1] = cl->block[2] = 1;
    cl->shared = t->shared;
    cl->chunk = l->chunk;
    cl->nargs = l->nargs;
    memcpy(cl->args, l->args, sizeof(int64_t) * (size_t)l->nargs);
    if (l->alt_kt >= 0) {
      if (!names[l->alt_kt])
        names[l->alt_kt] = kernel_of(e, &e->kt[l->alt_kt], &text);
      cl->alt = names[l->alt_kt];
      cl->alt_grid[0] = (unsigned)l->alt_grid, cl->alt_grid[1] = cl->alt_grid[2] = 1;
      cl->alt_block[0] = (unsigned)l->alt_block, cl->alt_block[1] = cl->alt_block[2] = 1;
      cl->alt_shared = e->kt[l->alt_kt].shared;
    }
    ec_bput(&e->out, "//   %s<<<%lld, %d>>>%s%s\n", cl->kernel, (long long)l->grid, l->block,
            l->chunk ? ec_str(&e->core, " chunk %lld", (long long)l->chunk) : "",
            cl->alt ? ec_str(&e->core, " or %s<<<%lld, %d>>>, the faster on the device", cl->alt,
                             (long long)l->alt_grid, l->alt_block)
                    : "");
  }
  for (int u = first_unit; u < e->nunits; u++)
    e->units[u].at += e->out.len;
  ec_bappend(&e->out, &text);
  free(text.s);
  free(names);
  if (e->stop > e->scratch_max)
    e->scratch_max = e->stop;
}

// Emits step si: passes until the layout of its values settles, then the last pass is kept.
static bool emit_step(Emit *e, int si, const char *name) {
  const Step *st = &e->core.f->steps[si];
  e->core.si = si;
  e->sname = name;
  int64_t most = 0;
  for (int k = 0; k < st->nnodes; k++) {
    const IrNode *nd = ec_node(&e->core, st->nodes[k]);
    e->core.in_step[st->nodes[k]] = !ec_is_leaf(nd->op);
    most = ec_numel(&e->core, nd->id) > most ? ec_numel(&e->core, nd->id) : most;
    for (int j = 0; j < nd->nin; j++)
      most = ec_numel(&e->core, nd->in[j]) > most ? ec_numel(&e->core, nd->in[j]) : most;
  }
  e->core.ixt = most < (int64_t)1 << 30 ? "int" : "int64_t";
  memset(e->core.spill, 0, sizeof *e->core.spill * (size_t)e->core.g->n);
  memset(e->core.post_bad, 0, sizeof *e->core.post_bad * (size_t)e->core.g->n);
  bool ok = ec_groups_order(&e->core);
  for (int pass = 0; ok && pass < 32; pass++) {
    pass_reset(e);
    emit_step_body(e);
    if (e->core.failed || !e->core.flagged)
      break;
  }
  if (!e->core.failed && e->core.flagged)
    ec_fail(&e->core, "step %s: the layout of its values did not settle", st->name);
  for (int k = 0; k < st->nnodes; k++) {
    e->core.in_step[st->nodes[k]] = false;
    e->core.grp[st->nodes[k]] = -1;
  }
  if (e->core.failed)
    return false;
  commit_step(e);
  return true;
}

static void build_users(Emit *e) {
  const Graph *g = e->core.g;
  e->users = ec_xcalloc((size_t)g->n, sizeof *e->users);
  e->nusers = ec_xcalloc((size_t)g->n, sizeof *e->nusers);
  int *cap = ec_xcalloc((size_t)g->n, sizeof *cap);
  for (int i = 0; i < g->n; i++)
    for (int k = 0; k < g->nodes[i]->nin; k++)
      cap[g->nodes[i]->in[k]]++;
  for (int i = 0; i < g->n; i++)
    e->users[i] = ec_xcalloc((size_t)cap[i] + 1, sizeof **e->users);
  for (int i = 0; i < g->n; i++)
    for (int k = 0; k < g->nodes[i]->nin; k++) {
      int x = g->nodes[i]->in[k];
      if (!e->nusers[x] || e->users[x][e->nusers[x] - 1] != i)
        e->users[x][e->nusers[x]++] = i;
    }
  free(cap);
}

CudaPlan *emit_cuda_plan(const Fusion *f, const MemPlan *m, const char *source_path) {
  const Graph *g = f->g;
  size_t n = (size_t)g->n;
  Emit e = {.core = {.f = f, .m = m, .g = g, .a = arena_new(), .val = core_val, .seed = core_seed, .base = core_base,
                     .fp8_cast = core_fp8_cast}};
  e.core.in_step = ec_xcalloc(n, sizeof *e.core.in_step);
  e.core.grp = ec_xcalloc(n, sizeof *e.core.grp);
  e.core.spill = ec_xcalloc(n, sizeof *e.core.spill);
  e.core.post_bad = ec_xcalloc(n, sizeof *e.core.post_bad);
  e.core.written = ec_xcalloc(n, sizeof *e.core.written);
  e.core.scratch = ec_xcalloc(n, sizeof *e.core.scratch);
  e.core.stored = ec_xcalloc(n, sizeof *e.core.stored);
  e.core.host = ec_xcalloc(n, sizeof *e.core.host);
  e.soff = ec_xcalloc(n, sizeof *e.soff);
  e.slot_of = ec_xcalloc(n, sizeof *e.slot_of);
  e.core.phase_nodes = ec_xcalloc(n, sizeof *e.core.phase_nodes);
  e.core.pending = ec_xcalloc(n, sizeof *e.core.pending);
  for (size_t i = 0; i < n; i++)
    e.core.grp[i] = e.slot_of[i] = -1;
  build_users(&e);

  e.fp8 = align_up(m->arena_bytes, SCRATCH_ALIGN);
  int64_t scratch = e.scratch0 = g->nfp8 ? align_up(e.fp8 + 12 * (int64_t)g->nfp8, SCRATCH_ALIGN) : e.fp8;
  ec_bput(&e.out, "// Generated by mdlc %s from %s: do not edit.\n", MDL_VERSION, source_path ? source_path : "?");
  ec_bput(&e.out, "// Model %s: one training step (forward, backward, AdamW) as %d steps on one device arena:\n",
          g->model ? g->model : "?", f->nsteps);
  ec_bput(&e.out, "//   the memory plan's part   %lld bytes\n", (long long)m->arena_bytes);
  ec_bput(&e.out, "//   params, grads, m, v at   %lld, %lld, %lld, %lld (%lld bytes each)\n", (long long)m->params,
          (long long)m->grads, (long long)m->m, (long long)m->v, (long long)m->param_bytes);
  ec_bput(&e.out, "//   step-local scratch from  %lld\n", (long long)scratch);
  ec_bput(&e.out,
          "// NVRTC compiles this file; runtime/cuda.c runs the launches each step's comment lists (kernels,\n");
  ec_bput(&e.out,
          "// and GEMMs through cuBLASLt), every kernel with (arena, status, seed, chunk, the byte offsets of\n");
  ec_bput(&e.out, "// its buffers).\n\n");
  ec_bput(&e.out, "%s", ec_prelude_cuda);
  ec_grow(&e.units, e.nunits, &e.capunits, sizeof *e.units);
  e.units[e.nunits++] = (CudaUnit){e.out.len, strlen(accumulate_kernel)};
  ec_bput(&e.out, "%s", accumulate_kernel);

  const char **names = ec_xcalloc((size_t)f->nsteps + 1, sizeof *names);
  for (int si = 0; si < f->nsteps; si++) {
    names[si] = kernel_name(&e, f->steps[si].name, si, names);
    if (!emit_step(&e, si, names[si]))
      break;
  }
  CudaPlan *plan = NULL;
  if (e.core.failed) {
    fprintf(stderr, "mdlc: emit_cuda: %s\n", e.core.err);
  } else {
    int ngemm = 0;
    for (int i = 0; i < e.nlaunches; i++)
      ngemm += e.launches[i].gemm >= 0;
    ec_bput(&e.out,
            "\n// Schedule: %d launches per step, %d kernels (%d distinct) and %d GEMMs; device arena %lld "
            "bytes.\n",
            e.nlaunches, e.nlaunches - ngemm, e.nknown, ngemm, (long long)(scratch + e.scratch_max));
    plan = arena_alloc(g->arena, sizeof *plan);
    char *text = arena_alloc(g->arena, e.out.len + 1);
    memcpy(text, e.out.s, e.out.len);
    plan->source = text;
    plan->nlaunches = e.nlaunches;
    plan->launches = arena_alloc(g->arena, sizeof *plan->launches * (size_t)(e.nlaunches + 1));
    plan->ngemms = e.ngemms;
    plan->gemms = arena_alloc(g->arena, sizeof *plan->gemms * (size_t)(e.ngemms + 1));
    if (e.ngemms)
      memcpy(plan->gemms, e.gemms, sizeof *plan->gemms * (size_t)e.ngemms);
    for (int i = 0; i < e.nlaunches; i++) {
      plan->launches[i] = e.launches[i];
      if (e.launches[i].kernel)
        plan->launches[i].kernel = arena_strdup(g->arena, e.launches[i].kernel);
      if (e.launches[i].alt)
        plan->launches[i].alt = arena_strdup(g->arena, e.launches[i].alt);
    }
    plan->nkernels = e.nknown;
    plan->nunits = e.nunits;
    plan->units = arena_alloc(g->arena, sizeof *plan->units * (size_t)e.nunits);
    memcpy(plan->units, e.units, sizeof *plan->units * (size_t)e.nunits);
    plan->scratch = scratch;
    plan->arena_bytes = scratch + e.scratch_max;
    plan->fp8 = e.fp8;
    plan->nfp8 = g->nfp8;
  }
  free(names);
  free(e.out.s);
  free(e.core.body.s);
  free(e.notes.s);
  free(e.core.memo);
  free(e.core.ixm);
  free(e.lst);
  free(e.held);
  free(e.kt);
  free(e.sl);
  free(e.sg);
  free(e.known);
  free(e.units);
  free(e.launches);
  free(e.gemms);
  for (size_t i = 0; i < n; i++)
    free(e.users[i]);
  free(e.users);
  free(e.nusers);
  free(e.core.in_step);
  free(e.core.grp);
  free(e.core.spill);
  free(e.core.post_bad);
  free(e.core.written);
  free(e.core.scratch);
  free(e.core.stored);
  free(e.core.host);
  free(e.soff);
  free(e.slot_of);
  free(e.core.phase_nodes);
  free(e.core.pending);
  arena_free(e.core.a);
  return plan;
}

char *emit_cuda(const Fusion *f, const MemPlan *m, const char *source_path) {
  CudaPlan *p = emit_cuda_plan(f, m, source_path);
  return p ? (char *)p->source : NULL;
}
