// emit_cuda.c: the CUDA emitter. It turns the step plan (a Fusion and its MemPlan) into one CUDA C++
// translation unit for NVRTC (a prelude of our own, runtime/prelude.cuh, no #include) and a schedule
// (CudaPlan): the kernel launches and cuBLASLt GEMMs of one training step, in order.
//
// Design. The emitter mirrors emit_c.c: the same split of a step's nodes into anchors (ops that need
// a kernel shape of their own) and pointwise nodes, evaluated inline at any flat index by the same
// evaluator `val` through their index maps; the same groups of anchors (norm backward siblings,
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
//     (emit_embed_bwd);
//   - the optimizer: a sum of squares per fixed chunk, one block adding the chunks, then AdamW over
//     the flat buffers through a table of segments (each block bisects to the segments of its
//     chunk), rounding each parameter that has a bf16 copy (fuse.c, rule 11) into it as it updates it;
//   - the LM head, chunk by chunk: GEMMs into chunks whose rows are padded to 64-aligned classes, and
//     a cross-entropy kernel between them (emit_lmhead).
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
// What does not depend on the target (where values are, groups and their order, lines and scopes,
// the index maps of the evaluator) is in emit_common.c, whose state EmitCore this emitter embeds as
// e->core.
#include "mdl.h"
#include "emit_common.h"
#include "emit_cuda.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define LOG2E 1.4426950408889634 // log2(e): the tensor-core attention kernels exponentiate in base 2

enum {
  BLOCK = 256,          // threads per block of grid-stride and row kernels
  MAX_GRID = 4096,      // blocks of a grid-stride kernel
  SCRATCH_ALIGN = 256,  // scratch buffers start at multiples of this
  OPT_CHUNK = 8192,     // optimizer: elements per block
  OPT_UNROLL = 2,       // optimizer: float4s a thread loads before it updates them
  OPT_SUMSQ_LOADS = 4,  // gradient norm: values a thread loads before it adds their squares
  NORM_F32_ROWS = 16,   // norm backward: column partials of up to this many rows per lane summed in f32
  NORM_LANE_ELEMS = 8,  // norm backward with column sums: elements of a row per lane, at most
  ATT_BK = 32,          // attention: keys per tile
  ATT_MMA_WARPS = 8,    // attention on tensor cores: warps of a forward or dk, dv block, 16 rows each
  ATT_MMA_DQ_WARPS = 4, //   and of a dq block (168 registers a thread on sm_90: 3 blocks of 4 warps an
                        //   SM, 1 of 8; the forward's 128 allow 2 of 8, dk and dv's 232 one of either);
                        //   each kernel also has a variant of the other size (4 <-> 8), which the
                        //   runtime times against it on the device (see "Kernel variants")
  ATT_MMA_TILE = 64,    //   rows of the tiles a block stages in turn (keys and values, or queries and dout)
  FILL_SM = -1,         // Emit.min_blocks: as many blocks as the SM's threads allow (MDL_SM_THREADS)
};

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
_Static_assert(CUDA_ERR_EMBED_ID == 1 && CUDA_ERR_TARGET == 2, "the prelude's MDL_ERR_* codes");

const char *emit_cuda_prelude(void) { return ec_prelude_cuda; }

const char *cuda_error_what(long long code) {
  switch (code) {
  case CUDA_ERR_EMBED_ID: return "embed: id";
  case CUDA_ERR_TARGET: return "cross_entropy: target";
  default: return "error";
  }
}

//
// The emitter's state.
//

// One buffer of the kernel being built: b<ordinal> = arena + o.b[ordinal].
typedef struct {
  int node;        // or -1 (partial sums, statistics)
  int64_t off;     // byte offset in the device arena
  const char *type, *what;
  bool decl;       // the kernel declares the pointer (else it only reads the offset o.b[k])
} Slot;

// A kernel of the step: its code without the name (the key that finds an identical kernel).
typedef struct {
  const char *role;
  char *pre, *code, *notes; // "extern ... __launch_bounds__(n) ", "(char *arena, ...) {...}", comments
  const char *table;        // file-scope data the kernel reads (the optimizer's segments), or ""
  int shared;
} KText;

// A launch of the step: kernel kt, or GEMM gemm (an index in the step's GEMMs).
typedef struct {
  int kt, gemm;
  int64_t grid, chunk;
  int block, nargs;
  int64_t *args;
  int alt_kt;              // a variant of kernel kt on the same arguments (the runtime times both), or -1
  int64_t alt_grid;
  int alt_block;
} SLaunch;

// A store deferred to the end of a four-lane loop body.
typedef struct {
  int node, lane;
  const char *value;
} LaneStore;

// A distinct kernel of the module.
typedef struct {
  const char *key, *name;
  unsigned long hash;
} Known;

typedef struct {
  EmitCore core;   // the step, its groups, where values are (a phase: a kernel)
  Buf out;         // the translation unit
  int **users;     // per node: the nodes that read it
  int *nusers;

  // the step being emitted
  const char *sname; // its kernel name

  // one pass
  int64_t *soff;   // scratch offset per node, or -1
  int64_t stop;    // scratch used by this pass
  KText *kt;
  int nkt, capkt;
  SLaunch *sl;
  int nsl, capsl;
  CudaGemm *sg;
  int nsg, capsg;

  // the kernel being built
  const char *role;
  const char *table;
  Buf notes;
  Slot slots[CUDA_MAX_ARGS];
  int nslots;
  int *slot_of;    // per node: its slot in this kernel, or -1
  bool sh_d, sh_f; // the block reductions' shared arrays are declared
  int shared;
  int min_blocks; // blocks an SM must hold (__launch_bounds__'s second value, which caps registers), or
                  // 0, or FILL_SM: as many as the SM's threads allow
  int variant_of; // the launch (index in sl) of which the kernel being built is a variant, or -1
  const char *loop_ix; // the current loop's own flat index (stores happen there)
  int64_t loop_n;      // and the number of elements it visits
  int post_anchor;     // inside the loop that follows (or is) this anchor's, else -1
  const char *post_ix;
  bool post_inloop;
  int cur_q;
  int lane;            // four-lane body: the lane being written, else -1
  int out_cast[4];     // an attention forward's output: the bf16 CASTs it stores (rule 9)
  int nout_cast;
  bool out_f32;        // and whether it stores its f32 value too
  LaneStore *lst;
  int nlst, caplst;
  bool defer;          // stores are kept in held (statements), to be emitted after every load
  const char **held;
  int nheld, capheld;

  // the module
  Known *known;
  int nknown, capknown;
  CudaUnit *units;     // where each kernel's text begins in out (its comment, tables and code)
  int nunits, capunits;
  CudaLaunch *launches;
  int nlaunches, caplaunches;
  CudaGemm *gemms;
  int ngemms, capgemms;
  int64_t scratch_max;
} Emit;

static int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

//
// Lines and scopes.
//

static void note(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(Emit *e, const char *fmt, ...) {
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

static void orelse(Emit *e) { orelse_if(e, NULL); }

// A float literal that reads back as the same float, in as few digits as that takes.
static const char *flit(Emit *e, double v) {
  if (isnan(v))
    return "MDL_NAN";
  if (isinf(v))
    return v > 0 ? "MDL_INF" : "(-MDL_INF)";
  char buf[64];
  for (int prec = 1; prec <= 9; prec++) {
    snprintf(buf, sizeof buf, "%.*g", prec, (double)(float)v);
    if (strtof(buf, NULL) == (float)v)
      break;
  }
  bool frac = strpbrk(buf, ".e") != NULL;
  return ec_str(&e->core, "%s%s%sf%s", v < 0 ? "(" : "", buf, frac ? "" : ".0", v < 0 ? ")" : "");
}

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

static int64_t scratch_alloc(Emit *e, int64_t bytes) {
  int64_t at = e->stop;
  e->stop = align_up(at + (bytes ? bytes : 1), SCRATCH_ALIGN);
  return align_up(e->core.m->arena_bytes, SCRATCH_ALIGN) + at;
}

static int64_t buf_off(Emit *e, int c) {
  if (ec_offset(&e->core, c) >= 0)
    return ec_offset(&e->core, c);
  if (e->core.host[c] >= 0)
    return buf_off(e, e->core.host[c]);
  if (!e->core.scratch[c])
    return -1;
  if (e->soff[c] < 0)
    e->soff[c] = scratch_alloc(e, ec_numel(&e->core, c) * dtype_size(ec_node(&e->core, c)->dtype));
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
  int64_t off = buf_off(e, c);
  if (off < 0)
    ec_fail(&e->core, "node %d (%s) has no buffer in step %s", c, op_name(ec_node(&e->core, c)->op),
            e->core.f->steps[e->core.si].name);
  const IrNode *nd = ec_node(&e->core, c);
  return e->slot_of[c] =
             add_slot(e, c, off, ec_mtype(&e->core, c), ec_str(&e->core, "%s %s", op_name(nd->op), shape_txt(e, c)));
}

// The pointer (b<k>) to node c's buffer in the current kernel.
static const char *ptr(Emit *e, int c) {
  int k = slot(e, c);
  e->slots[k].decl = true;
  return slot_name(e, k);
}

// The offset argument (o.b[k]) of node c's buffer, for a kernel that addresses it through a table.
static const char *offset_arg(Emit *e, int c) { return ec_str(&e->core, "o.b[%d]", slot(e, c)); }

// A pointer to a scratch buffer that is no node (partial sums, row statistics).
static const char *raw_ptr(Emit *e, int64_t off, const char *type, const char *what) {
  for (int k = 0; k < e->nslots; k++)
    if (e->slots[k].node < 0 && e->slots[k].off == off)
      return slot_name(e, k);
  int k = add_slot(e, -1, off, type, what);
  e->slots[k].decl = true;
  return slot_name(e, k);
}

//
// Kernels: kbegin starts one, kend closes it and records its launch.
//

static void kbegin(Emit *e, const char *role) {
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

static int64_t grid_for(int64_t work, int block) {
  int64_t g = (work + block - 1) / block;
  return g < 1 ? 1 : g > MAX_GRID ? MAX_GRID : g;
}

// Threads of a grid-stride kernel's block for `work` items: 256, or fewer (a multiple of 32) when
// there is less to do.
static int block_for(int64_t work) { return work >= BLOCK ? BLOCK : (int)align_up(work < 1 ? 1 : work, 32); }

static int kend(Emit *e, int64_t grid, int block) {
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
static void relaunch(Emit *e, int kt, int64_t grid, int64_t chunk) {
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

static void gemm_add(Emit *e, CudaGemm gm) {
  gm.step = e->core.si;
  ec_grow(&e->sg, e->nsg, &e->capsg, sizeof *e->sg);
  e->sg[e->nsg] = gm;
  ec_grow(&e->sl, e->nsl, &e->capsl, sizeof *e->sl);
  e->sl[e->nsl++] = (SLaunch){.kt = -1, .gemm = e->nsg++, .alt_kt = -1};
}

// The shared arrays of the block reductions, declared at the top of the kernel when used.
static const char *sh_double(Emit *e) {
  if (!e->sh_d)
    e->shared += 384;
  e->sh_d = true;
  return "sh_d";
}

static const char *sh_float(Emit *e) {
  if (!e->sh_f)
    e->shared += 128;
  e->sh_f = true;
  return "sh_f";
}

//
// The inline evaluator.
//

static const char *val(Emit *e, int n, const char *ix);

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
    v = val(e, nd->in[0], ix);
  if (lane_ix(e, c, ix, true)) {
    ec_grow(&e->lst, e->nlst, &e->caplst, sizeof *e->lst);
    e->lst[e->nlst++] = (LaneStore){c, e->lane, v};
    return;
  }
  const char *stmt = ec_str(&e->core, "%s[%s] = %s;", ptr(e, c), ix, ec_store(&e->core, c, v));
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
static const char *val(Emit *e, int n, const char *ix) {
  int c = ec_canon(&e->core, n);
  const IrNode *nd = ec_node(&e->core, c);
  if (nd->op == OP_CONST)
    return flit(e, nd->fa[0]);
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
        ec_line(&e->core, "const float4 %s = reinterpret_cast<const float4 *>(%s)[q];", q, ptr(e, c));
        ec_memo_put(&e->core, c, "float4", q);
      }
      name = ec_str(&e->core, "%s.%c", q, "xyzw"[e->lane]);
    } else {
      ec_line(&e->core, "const %s %s = %s;", ec_ctype(&e->core, c), name,
              ec_load(&e->core, c, ec_str(&e->core, "%s[%s]", ptr(e, c), ix)));
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
static const char *core_val(EmitCore *core, int n, const char *ix) { return val((Emit *)core, n, ix); }
static const char *core_base(EmitCore *core, int n) { return ptr((Emit *)core, n); }

// The step's seed is read from device memory, where the runtime writes it before each step: a
// captured graph replays its launches' arguments as they were, so a seed passed by value would
// repeat the first step's dropout masks in every step.
static const char *core_seed(EmitCore *core) {
  (void)core;
  return "(*seed)";
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
static void flush_lanes(Emit *e) {
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
    ec_line(&e->core, "reinterpret_cast<%s *>(%s)[q] = make_%s(%s, %s, %s, %s);", vt, ptr(e, s->node), vt,
            ec_store(&e->core, s->node, v[0]), ec_store(&e->core, s->node, v[1]), ec_store(&e->core, s->node, v[2]),
            ec_store(&e->core, s->node, v[3]));
  }
  e->nlst = 0;
}

// One elementwise kernel over `n` elements writing nodes[0..k) (all of that size), grid-stride, four
// elements per thread when n is a multiple of 4. post_anchor names the GEMM whose epilogue this is.
static void pw_loop(Emit *e, const int *nodes, int k, int64_t n, int post_anchor, const char *role) {
  ec_phase_begin(&e->core);
  kbegin(e, role);
  bool vec = n % 4 == 0;
  int64_t work = vec ? n / 4 : n;
  int block = block_for(work);
  note(e, "elementwise over %lld%s: %s", (long long)n, vec ? ", 4 per thread" : "", op_list(e, nodes, k));
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
      const char *v = val(e, nodes[t], ix);
      if (!e->core.stored[nodes[t]]) {
        store(e, nodes[t], ix, v);
        e->core.stored[nodes[t]] = true;
        e->core.phase_nodes[e->core.nphase++] = nodes[t];
      }
    }
  }
  flush_lanes(e);
  e->lane = -1;
  ec_leave(&e->core);
  e->loop_ix = NULL;
  e->post_anchor = -1;
  e->cur_q = -1;
  kend(e, grid_for(work, block), block);
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

static void flush(Emit *e) {
  if (e->core.npending)
    pw_loops(e, e->core.pending, e->core.npending, -1, "prep");
  e->core.npending = 0;
}

// Rows of a matrix in memory: row r starts at element `at` + r * stride of node `node`'s buffer.
typedef struct {
  int node;
  int64_t at, stride;
} Rows;

// n's rows (last axis) in memory: n itself, or a SLICE of the last axis of a tensor in memory (q, k,
// v out of one qkv buffer), read in place with that tensor's stride.
static Rows rows_of(Emit *e, int n) {
  int src;
  int64_t start;
  if (ec_row_slice(&e->core, n, &src, &start))
    return (Rows){src, start, ec_last_dim(&e->core, src)};
  return (Rows){ec_need(&e->core, n), 0, ec_last_dim(&e->core, n)};
}

// The pointer expression of a Rows in the current kernel.
static const char *rows_base(Emit *e, Rows r) {
  return r.at ? ec_str(&e->core, "(%s + %lld)", ptr(e, r.node), (long long)r.at) : ptr(e, r.node);
}

// Evaluates the post outputs inside the anchor's own kernel, where the anchor's value at index ix is
// the expression y.
static void post_inloop(Emit *e, int anchor, const int *q, int nq, const char *ix, int64_t n, const char *y) {
  e->loop_ix = ix;
  e->loop_n = n;
  e->post_anchor = anchor;
  e->post_ix = ix;
  e->post_inloop = true;
  ec_memo_put(&e->core, anchor, ec_numel(&e->core, anchor) == 1 ? "0" : ix, y);
  for (int t = 0; t < nq; t++) {
    e->cur_q = q[t];
    val(e, q[t], ix);
  }
  e->post_anchor = -1;
  e->post_inloop = false;
  e->cur_q = -1;
}

// The output buffer of a row-wise or reducing anchor: whole (arena slot or scratch) when it is an
// output or read at other indices; otherwise only a local exists.
static bool whole(Emit *e, int a) {
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

typedef struct {
  int tpr, npl, rpb, block; // threads per row, elements per thread, rows per block, block size
  int64_t groups, grid;
} RowShape;

// The fewest threads per row (a warp at least, a power of two) that hold at most `most` elements each.
static RowShape row_shape(Emit *e, int64_t cols, int64_t groups, int most) {
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

static const char *rs_who(Emit *e, const RowShape *rs) {
  return rs->tpr == 32 ? "a warp" : ec_str(&e->core, "a block of %d threads", rs->tpr);
}

// Opens the scope of row group `var` (r, or k for blocks of rows); tr is the thread within the row.
static void rows_open(Emit *e, const RowShape *rs, const char *var) {
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

static const char *rsum(Emit *e, const RowShape *rs, const char *x) {
  return rs->tpr == 32 ? ec_str(&e->core, "mdl_warp_sum(%s)", x)
                       : ec_str(&e->core, "mdl_block_sum(%s, %s)", x, sh_double(e));
}

static const char *rfmax(Emit *e, const RowShape *rs, const char *x) {
  return rs->tpr == 32 ? ec_str(&e->core, "mdl_warp_fmax(%s)", x)
                       : ec_str(&e->core, "mdl_block_fmax(%s, %s)", x, sh_float(e));
}

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
            ec_load(&e->core, a, ec_str(&e->core, "%s[r * %lld + j]", ptr(e, a), (long long)cols)));
  } else {
    ec_line(&e->core, "%s[t] = 0.0f;", name);
    ec_enter(&e->core, "if (j < %lld)", (long long)cols);
    ec_line(&e->core, "const %s ix = r * %lld + j;", e->core.ixt, (long long)cols);
    const char *save = e->loop_ix;
    int64_t save_n = e->loop_n;
    e->loop_ix = "ix";
    e->loop_n = ec_numel(&e->core, x);
    ec_line(&e->core, "%s[t] = %s;", name, val(e, x, "ix"));
    e->loop_ix = save;
    e->loop_n = save_n;
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
    a = rows_of(e, nd->in[0]);
    b = rows_of(e, nd->in[1]);
  } else {
    a = (Rows){ec_need(&e->core, nd->in[0]), 0, sa.d[sa.rank - 1]};
    b = (Rows){ec_need(&e->core, nd->in[1]), 0, sb.d[sb.rank - 1]};
  }
  flush(e);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, mm), emitted, q);
  int64_t batches = ec_span(so, 0, so.rank - 2);
  int out = mm, bias = -1, aux = -1, resid = -1, cast = bf16_result(e, mm, n);
  CudaEpilogue epi = CUDA_EPI_NONE;
  if (cast >= 0)
    out = cast;
  else if (batches == 1)
    epi = epilogue_of(e, mm, n, &out, &bias, &aux, &resid);
  if (out == mm && ec_offset(&e->core, mm) < 0) {
    for (int t = 0; t < nq && !e->core.spill[mm] && e->core.host[mm] < 0; t++)
      if (ec_offset(&e->core, q[t]) >= 0 && ec_node(&e->core, q[t])->dtype == DT_F32)
        e->core.host[mm] = q[t];
    if (e->core.host[mm] < 0)
      e->core.scratch[mm] = true;
  }
  DType ab = ec_node(&e->core, a.node)->dtype, ct = cast >= 0 ? DT_BF16 : DT_F32;
  int64_t sab = dtype_size(ab), sc = dtype_size(ct);
  CudaGemm gm = {.ab = ab, .c_type = ct, .ta = ta, .tb = tb, .m = m, .n = n, .k = k, .lda = a.stride,
                 .ldb = b.stride, .ldc = n, .batch = 1, .a = buf_off(e, a.node) + sab * a.at,
                 .b = buf_off(e, b.node) + sab * b.at, .c = buf_off(e, out), .epilogue = epi,
                 .bias = bias >= 0 ? buf_off(e, bias) : -1, .aux = aux >= 0 ? buf_off(e, aux) : -1,
                 .beta = resid >= 0 ? 1.0f : 0.0f, .c_apart = resid >= 0, .cin = resid >= 0 ? buf_off(e, resid) : 0};
  ec_phase_begin(&e->core);
  if (batches > 1) {
    Shape ob = so;
    ob.rank -= 2;
    int64_t s1 = batch_stride(sa, ob, m * k), s2 = batch_stride(sb, ob, k * n);
    if (s1 >= 0 && s2 >= 0) {
      gm.batch = batches, gm.stride_a = s1, gm.stride_b = s2, gm.stride_c = m * n;
      gemm_add(e, gm);
    } else {
      Shape ba = sa, bb = sb;
      ba.rank -= 2, bb.rank -= 2;
      CudaGemm one = gm;
      for (int64_t t = 0; t < batches; t++) {
        one.a = gm.a + sab * shape_bcast_offset(ob, ba, t) * m * k;
        one.b = gm.b + sab * shape_bcast_offset(ob, bb, t) * k * n;
        one.c = gm.c + sc * t * m * n;
        gemm_add(e, one);
      }
    }
  } else {
    gemm_add(e, gm);
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

// Output r of a reduction from its accumulator: stored, then the outputs computed after it.
static void reduce_finish(Emit *e, int a, bool buf, const int *q, int nq) {
  const IrNode *nd = ec_node(&e->core, a);
  int64_t len = ec_node(&e->core, nd->in[0])->shape.d[nd->ia[0]];
  if (nd->op == OP_MEAN)
    ec_line(&e->core, "const float y = (float)(acc / %lld);", (long long)len);
  else if (nd->op == OP_TARGET_COUNT)
    ec_line(&e->core, "const float y = (float)(acc > 1.0 ? acc : 1.0);");
  else
    ec_line(&e->core, "const float y = (float)acc;");
  if (buf)
    ec_line(&e->core, "%s[r] = y;", ptr(e, a));
  post_inloop(e, a, q, nq, "r", ec_numel(&e->core, a), "y");
}

// SUM / MEAN / MAX over one axis (the input as [outer, len, inner]), the input computed inline;
// TARGET_COUNT as a sum over all its targets of 1 for each counted one. Contiguous rows: a warp per
// output (a thread when rows are short); few long rows: per-block partials, then a warp per output
// adds them. Strided: a thread per output, or, for long axes, partials per block of the axis added in
// block order.
static void emit_reduce(Emit *e, int gi, const bool *emitted) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int x = nd->in[0];
  Shape s = ec_node(&e->core, x)->shape;
  if (nd->op == OP_TARGET_COUNT) // (over every target)
    s = (Shape){.rank = 1, .d = {ec_numel(&e->core, x)}};
  int ax = (int)nd->ia[0];
  int64_t outer = ec_span(s, 0, ax), len = s.d[ax], inner = ec_span(s, ax + 1, s.rank), on = outer * inner;
  bool max = nd->op == OP_MAX, buf = whole(e, a);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, on, emitted, q);
  int *side = ec_xcalloc((size_t)e->core.g->n, sizeof *side);
  int nside = ec_side_set(&e->core, gi, ec_numel(&e->core, x), emitted, side);
  const char *acc_t = max ? "float" : "double", *init = max ? "-MDL_INF" : "0.0", *ixt = e->core.ixt;
  const char *what = op_name(nd->op);
  ec_phase_begin(&e->core);
  bool two = inner == 1 ? on < 128 && len >= 32768 : len >= 128 && on <= 65536;
  if (!two && (inner > 1 || len <= 32)) {
    kbegin(e, "");
    note(e, "%s: %lld outputs over %lld elements, a thread per output", what, (long long)on, (long long)len);
    ec_enter(&e->core, "for (%s r = blockIdx.x * blockDim.x + threadIdx.x; r < %lld; r += gridDim.x * blockDim.x)", ixt,
             (long long)on);
    if (inner == 1)
      ec_line(&e->core, "const %s base = r * %lld;", ixt, (long long)len);
    else
      ec_line(&e->core, "const %s base = r / %lld * %lld + r %% %lld;", ixt, (long long)inner, (long long)(len * inner),
              (long long)inner);
    ec_line(&e->core, "%s acc = %s;", acc_t, init);
    ec_enter(&e->core, "for (%s l = 0; l < %lld; l++)", ixt, (long long)len);
    ec_line(&e->core, "const %s ix = base + l%s;", ixt,
            inner == 1 ? "" : ec_str(&e->core, " * %lld", (long long)inner));
    e->loop_ix = "ix";
    e->loop_n = ec_numel(&e->core, x);
    ec_reduce_input(&e->core, a, side, nside);
    accumulate(e, max);
    ec_leave(&e->core);
    reduce_finish(e, a, buf, q, nq);
    ec_leave(&e->core);
    kend(e, grid_for(on, block_for(on)), block_for(on));
  } else if (!two) {
    kbegin(e, "");
    note(e, "%s: %lld outputs over %lld elements, a warp per output", what, (long long)on, (long long)len);
    ec_line(&e->core, "const %s r = blockIdx.x * %d + (threadIdx.x >> 5);", ixt, BLOCK / 32);
    ec_line(&e->core, "const int lane = threadIdx.x & 31;");
    ec_enter(&e->core, "if (r < %lld)", (long long)on);
    ec_line(&e->core, "%s acc = %s;", acc_t, init);
    ec_enter(&e->core, "for (%s l = lane; l < %lld; l += 32)", ixt, (long long)len);
    ec_line(&e->core, "const %s ix = r * %lld + l;", ixt, (long long)len);
    e->loop_ix = "ix";
    e->loop_n = ec_numel(&e->core, x);
    ec_reduce_input(&e->core, a, side, nside);
    accumulate(e, max);
    ec_leave(&e->core);
    ec_line(&e->core, "acc = %s(acc);", max ? "mdl_warp_max_nan" : "mdl_warp_sum");
    ec_enter(&e->core, "if (lane == 0)");
    reduce_finish(e, a, buf, q, nq);
    ec_leave(&e->core);
    ec_leave(&e->core);
    kend(e, (on + BLOCK / 32 - 1) / (BLOCK / 32), BLOCK);
  } else if (inner == 1) {
    int64_t bl = 8192, nb = (len + bl - 1) / bl;
    int64_t part = scratch_alloc(e, on * nb * 8);
    kbegin(e, "partial");
    note(e, "%s: %lld outputs over %lld elements, first %lld blocks of %lld per output", what, (long long)on,
         (long long)len, (long long)nb, (long long)bl);
    const char *p = raw_ptr(e, part, acc_t, "partial results");
    ec_line(&e->core, "const %s r = blockIdx.x / %lld, k = blockIdx.x %% %lld;", ixt, (long long)nb, (long long)nb);
    ec_line(&e->core, "const %s end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", ixt, (long long)bl,
            (long long)bl, (long long)len, (long long)bl, (long long)bl, (long long)len);
    ec_line(&e->core, "%s acc = %s;", acc_t, init);
    ec_enter(&e->core, "for (%s l = k * %lld + threadIdx.x; l < end; l += blockDim.x)", ixt, (long long)bl);
    ec_line(&e->core, "const %s ix = r * %lld + l;", ixt, (long long)len);
    e->loop_ix = "ix";
    e->loop_n = ec_numel(&e->core, x);
    ec_reduce_input(&e->core, a, side, nside);
    accumulate(e, max);
    ec_leave(&e->core);
    ec_line(&e->core, "acc = %s;",
            max ? ec_str(&e->core, "mdl_block_max_nan(acc, %s)", sh_float(e))
                : ec_str(&e->core, "mdl_block_sum(acc, %s)", sh_double(e)));
    ec_line(&e->core, "if (threadIdx.x == 0)");
    ec_line(&e->core, "  %s[blockIdx.x] = acc;", p);
    kend(e, on * nb, BLOCK);
    kbegin(e, "");
    note(e, "%s: the %lld partial results of each output added in order, a warp per output", what, (long long)nb);
    p = raw_ptr(e, part, acc_t, "partial results");
    ec_line(&e->core, "const %s r = blockIdx.x * %d + (threadIdx.x >> 5);", ixt, BLOCK / 32);
    ec_line(&e->core, "const int lane = threadIdx.x & 31;");
    ec_enter(&e->core, "if (r < %lld)", (long long)on);
    ec_line(&e->core, "%s acc = %s;", acc_t, init);
    ec_enter(&e->core, "for (%s k = lane; k < %lld; k += 32)", ixt, (long long)nb);
    ec_line(&e->core, "const %s v = %s[r * %lld + k];", acc_t, p, (long long)nb);
    accumulate(e, max);
    ec_leave(&e->core);
    ec_line(&e->core, "acc = %s(acc);", max ? "mdl_warp_max_nan" : "mdl_warp_sum");
    ec_enter(&e->core, "if (lane == 0)");
    reduce_finish(e, a, buf, q, nq);
    ec_leave(&e->core);
    ec_leave(&e->core);
    kend(e, (on + BLOCK / 32 - 1) / (BLOCK / 32), BLOCK);
  } else {
    // About two threads per thread slot of an H100/H200 (132 SMs of 2048): a column sum is bound by
    // memory, and only many loads in flight keep it busy. Where the columns come in fours (inner a
    // multiple of 4) a thread takes four adjacent columns, its loads and stores one float4 (ushort4)
    // for the four (a four-lane body, as pw_loop's), and the axis is cut into 4 times the blocks:
    // each column still adds its rows in order, and GPT-2's gelu backward column partials, a float
    // a thread per load with the stores between, moved their 250 MB at 1.9 TB/s on an H200.
    bool vec = inner % 4 == 0;
    int64_t per = vec ? 4 : 1, goal = 262144 * per;
    int64_t nb = goal / on < 1 ? 1 : goal / on;
    if (nb > (len + 7) / 8)
      nb = (len + 7) / 8;
    int64_t bl = (len + nb - 1) / nb;
    nb = (len + bl - 1) / bl;
    int64_t part = scratch_alloc(e, on * nb * 8), work = on / per * nb;
    kbegin(e, "partial");
    // (sized for one wave of full SMs: 32 registers a thread, which ptxas meets with a 4-byte spill
    // where the four lanes' GELU backward took 37, 6 blocks of 256 an SM)
    e->min_blocks = vec && block_for(work) == BLOCK ? FILL_SM : 0;
    note(e, "%s: %lld outputs over %lld elements, first partial results over %lld blocks of %lld%s", what,
         (long long)on, (long long)len, (long long)nb, (long long)bl, vec ? ", 4 outputs per thread" : "");
    const char *p = raw_ptr(e, part, acc_t, "partial results");
    ec_enter(&e->core, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)", ixt,
             (long long)work);
    ec_line(&e->core, "const %s k = u / %lld, r = u %% %lld%s;", ixt, (long long)(on / per), (long long)(on / per),
            vec ? " * 4" : "");
    ec_line(&e->core, "const %s base = r / %lld * %lld + r %% %lld;", ixt, (long long)inner, (long long)(len * inner),
            (long long)inner);
    ec_line(&e->core, "const %s end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", ixt, (long long)bl,
            (long long)bl, (long long)len, (long long)bl, (long long)bl, (long long)len);
    e->loop_n = ec_numel(&e->core, x);
    if (vec) {
      ec_line(&e->core, "%s acc0 = %s, acc1 = %s, acc2 = %s, acc3 = %s;", acc_t, init, init, init, init);
      ec_enter(&e->core, "for (%s l = k * %lld; l < end; l++)", ixt, (long long)bl);
      ec_line(&e->core, "const %s i0 = base + l * %lld;", ixt, (long long)inner);
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
        e->loop_ix = ix;
        const char *v = val(e, x, ix);
        for (int t = 0; t < nside; t++)
          if (!e->core.stored[side[t]])
            val(e, side[t], ix);
        if (max)
          ec_line(&e->core, "acc%d = mdl_max_nan(acc%d, %s);", lane, lane, v);
        else
          ec_line(&e->core, "acc%d += %s;", lane, v);
      }
      flush_lanes(e);
      e->lane = -1;
      ec_leave(&e->core);
      for (int lane = 0; lane < 4; lane++)
        ec_line(&e->core, "%s[k * %lld + r%s] = acc%d;", p, (long long)on,
                lane ? ec_str(&e->core, " + %d", lane) : "", lane);
    } else {
      ec_line(&e->core, "%s acc = %s;", acc_t, init);
      ec_enter(&e->core, "for (%s l = k * %lld; l < end; l++)", ixt, (long long)bl);
      ec_line(&e->core, "const %s ix = base + l * %lld;", ixt, (long long)inner);
      e->loop_ix = "ix";
      ec_reduce_input(&e->core, a, side, nside);
      accumulate(e, max);
      ec_leave(&e->core);
      ec_line(&e->core, "%s[u] = acc;", p);
    }
    ec_leave(&e->core);
    kend(e, grid_for(work, BLOCK), block_for(work));
    kbegin(e, "");
    note(e, "%s: the %lld partial results of each output added, a block per %d outputs in %d groups of rows",
         what, (long long)nb, colsum_width(nb, on), colsum_block(nb) / colsum_width(nb, on));
    p = raw_ptr(e, part, acc_t, "partial results");
    const char *acc = "acc";
    colsum_open(e, nb, on, &p, &acc, 1, max);
    reduce_finish(e, a, buf, q, nq);
    ec_leave(&e->core);
    kend(e, colsum_grid(nb, on), colsum_block(nb));
  }
  e->loop_ix = NULL;
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
  free(side);
}

// LAYERNORM / RMSNORM forward, a warp (or block) per row, the row in registers; x (the residual sum)
// computed inline.
static void emit_norm_fwd(Emit *e, int gi, const bool *emitted) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool ln = nd->op == OP_LAYERNORM;
  int64_t cols = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / cols;
  row_inline(e, nd->in[0]);
  int w = ec_need(&e->core, nd->in[1]), bias = ln ? ec_need(&e->core, nd->in[2]) : -1;
  flush(e);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), emitted, q);
  bool buf = whole(e, a);
  RowShape rs = row_shape(e, cols, rows, 32);
  ec_phase_begin(&e->core);
  kbegin(e, "");
  note(e, "%s: %lld rows of %lld, %s per row", op_name(nd->op), (long long)rows, (long long)cols, rs_who(e, &rs));
  rows_open(e, &rs, "r");
  row_load(e, &rs, nd->in[0], "xv", cols);
  ec_line(&e->core, "double s = 0;");
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
  if (ln) {
    ec_line(&e->core, "  s += xv[t];");
    ec_line(&e->core, "const double mean = %s / %lld;", rsum(e, &rs, "s"), (long long)cols);
    ec_line(&e->core, "double var = 0;");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    ec_line(&e->core, "  var += tr + t * %d < %lld ? (xv[t] - mean) * (xv[t] - mean) : 0.0;", rs.tpr, (long long)cols);
    ec_line(&e->core, "const double rstd = 1.0 / sqrt(%s / %lld + %s);", rsum(e, &rs, "var"), (long long)cols,
            ec_dlit(&e->core, nd->fa[0]));
  } else {
    ec_line(&e->core, "  s += (double)xv[t] * xv[t];");
    ec_line(&e->core, "const double sc = 1.0 / sqrt(%s / %lld + %s);", rsum(e, &rs, "s"), (long long)cols,
            ec_dlit(&e->core, nd->fa[0]));
  }
  row_each(e, &rs, cols);
  if (ln)
    ec_line(&e->core, "const float y = (float)((xv[t] - mean) * rstd * %s[j] + %s[j]);", ptr(e, w), ptr(e, bias));
  else
    ec_line(&e->core, "const float y = (float)(xv[t] * sc * %s[j]);", ptr(e, w));
  if (buf)
    ec_line(&e->core, "%s[ix] = y;", ptr(e, a));
  post_inloop(e, a, q, nq, "ix", ec_numel(&e->core, a), "y");
  row_each_end(e);
  ec_leave(&e->core);
  kend(e, rs.grid, rs.block);
  e->loop_ix = NULL;
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
            "true);", (long long)(cols / 4), rs->tpr, buf, k, ptr(e, st->node[k]), row, (long long)cols);
  ec_line(&e->core, "mdl_cp_async_commit();");
}

// LAYERNORM_BWD / RMSNORM_BWD siblings: dx per row; dw (and db) as column sums: each row group
// adds a fixed block of rows into per-column partials, then the column sums add the blocks in a fixed
// order (colsum_open).
static void emit_norm_bwd(Emit *e, int gi, const bool *emitted) {
  const Group *gr = &e->core.groups[gi];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  bool ln = nd->op == OP_LAYERNORM_BWD;
  int dx, dw, db, sums[EC_MAX_COLSUMS], nsum = ec_norm_members(&e->core, gi, &dx, &dw, &db, sums);
  int x = nd->in[0], dy = nd->in[2];
  int64_t cols = ec_last_dim(&e->core, x), rows = ec_numel(&e->core, x) / cols;
  row_inline(e, x);
  row_inline(e, dy);
  int w = dx >= 0 ? ec_need(&e->core, nd->in[1]) : -1; // (the weight scales dx only)
  flush(e);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = dx >= 0 ? ec_post_set(&e->core, gi, ec_numel(&e->core, dx), emitted, q) : 0;
  bool dxbuf = dx >= 0 && whole(e, dx);
  bool cols_sum = dw >= 0 || db >= 0 || nsum > 0;
  int64_t bl = cols_sum ? (rows + 1023) / 1024 : 1, nb = (rows + bl - 1) / bl;
  // A lane's column sums over its block's rows: in f32 over at most NORM_F32_ROWS rows (a row of 768
  // takes 24 of them per lane and sum; double accumulators would spill registers), else in double.
  // The partials keep that type (an f32 sum stored as f32 loses nothing, in half the bytes: 9.4 MB
  // instead of 18.9 written and read back per GPT-2 norm backward) and are added in double.
  const char *at = bl <= NORM_F32_ROWS ? "float" : "double";
  int64_t psz = bl <= NORM_F32_ROWS ? 4 : 8;
  int64_t pdw = dw >= 0 ? scratch_alloc(e, nb * cols * psz) : -1;
  int64_t pdb = db >= 0 ? scratch_alloc(e, nb * cols * psz) : -1;
  int64_t psum[EC_MAX_COLSUMS];
  for (int i = 0; i < nsum; i++)
    psum[i] = scratch_alloc(e, nb * cols * psz);
  // With column sums there are at most 1024 groups of rows (1024 partials per column), so a group gets
  // a block of threads (up to NORM_LANE_ELEMS elements per lane) rather than a warp: GPT-2's 8192 rows
  // of 768 are then 4096 warps of 6 elements a lane, not 1024 warps (128 blocks, under one wave on
  // 132 SMs) of 24 at 244 registers.
  RowShape rs = row_shape(e, cols, nb, cols_sum ? NORM_LANE_ELEMS : 32);
  const char *ixt = e->core.ixt;
  NormStage st = {0};
  if (cols_sum && rs.tpr > 32 && bl > 1 && (dx >= 0 || dw >= 0))
    st = norm_stage(e, x, dy, q, nq, cols);
  // A thread's x and dy at element t (j): in registers, or staged, in this row's buffers.
  const char *xv = st.n ? "xs[j]" : "xv[t]", *dyv = st.n ? "dys[j]" : "dyv[t]";
  ec_phase_begin(&e->core);
  kbegin(e, "");
  // Each block's rows are a chain of loads and block reductions, so the kernel takes as long as its
  // waves of blocks: at most 64 registers a thread (32 warps an SM) puts GPT-2's 1024 blocks of 128
  // threads in one wave on 132 SMs, where the 72 that ptxas chose (sm_90) fitted 7 blocks an SM, 924.
  if (cols_sum)
    e->min_blocks = 1024 / rs.block;
  note(e, "%s: %lld rows of %lld, %s per row%s", op_name(nd->op), (long long)rows, (long long)cols, rs_who(e, &rs),
       cols_sum ? ec_str(&e->core, "; column partials over %lld blocks of %lld rows", (long long)nb, (long long)bl)
                : "");
  const char *sw = pdw >= 0 ? raw_ptr(e, pdw, at, "dw partials") : NULL;
  const char *sb = pdb >= 0 ? raw_ptr(e, pdb, at, "db partials") : NULL, *ss[EC_MAX_COLSUMS];
  for (int i = 0; i < nsum; i++)
    ss[i] = raw_ptr(e, psum[i], at, "column sum partials");
  rows_open(e, &rs, cols_sum ? "k" : "r");
  if (cols_sum) {
    if (sw)
      ec_line(&e->core, "%s sw[%d] = {0};", at, rs.npl);
    if (sb)
      ec_line(&e->core, "%s sb[%d] = {0};", at, rs.npl);
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "%s sa%d[%d] = {0};", at, i, rs.npl);
    ec_line(&e->core, "const %s end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", ixt, (long long)bl,
            (long long)bl, (long long)rows, (long long)bl, (long long)bl, (long long)rows);
    if (st.n) {
      ec_line(&e->core, "// Rows by cp.async, two buffers: x, dy%s.",
              st.n > 2 ? ", then what the chain after dx reads" : "");
      ec_line(&e->core, "__shared__ __align__(16) float st[2][%d][%lld];", st.n, (long long)cols);
      e->shared += (int)(2 * st.n * cols * 4);
      norm_stage_row(e, &st, &rs, cols, "0", ec_str(&e->core, "k * %lld", (long long)bl));
    }
    ec_enter(&e->core, "for (%s r = k * %lld; r < end; r++)", ixt, (long long)bl);
  }
  if (st.n) {
    ec_line(&e->core, "const int cur = (int)(r - k * %lld) & 1;", (long long)bl);
    ec_line(&e->core, "__syncthreads(); // (every thread is done with the other buffer: the row before)");
    ec_enter(&e->core, "if (r + 1 < end)");
    norm_stage_row(e, &st, &rs, cols, "cur ^ 1", "(r + 1)");
    orelse(e);
    ec_line(&e->core, "mdl_cp_async_commit(); // (an empty group: the wait below is the same)");
    ec_leave(&e->core);
    ec_line(&e->core, "mdl_cp_async_wait<1>(); // this row's copies have landed");
    ec_line(&e->core, "__syncthreads();");
    ec_line(&e->core, "const float *const xs = st[cur][0], *const dys = st[cur][1]; // (this row's)");
  } else {
    if (dx >= 0 || dw >= 0) // (db alone reads dy only)
      row_load(e, &rs, x, "xv", cols);
    row_load(e, &rs, dy, "dyv", cols);
  }
  const char *wp = w >= 0 ? ptr(e, w) : NULL;
  // Layernorm: the mean, then one block reduction for the variance, mg and mgx together; rmsnorm:
  // one for its sum of squares and mgx. The sums that need the row's scale are taken without it and
  // scaled after (mgx = rstd sum g (x - mean)).
  bool pair = rs.tpr > 32 && rs.tpr <= 512; // (block sums of up to 16 warps' sums at once)
  if (dx < 0 && dw < 0) { // db alone needs no statistics
    if (sb) {
      row_each(e, &rs, cols);
      ec_line(&e->core, "sb[t] += %s;", dyv);
      row_each_end(e);
    }
  } else if (ln) {
    ec_line(&e->core, "double s = 0;");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    if (st.n && cols % rs.tpr)
      ec_line(&e->core, "  s += tr + t * %d < %lld ? xs[tr + t * %d] : 0.0f;", rs.tpr, (long long)cols, rs.tpr);
    else if (st.n)
      ec_line(&e->core, "  s += xs[tr + t * %d];", rs.tpr);
    else
      ec_line(&e->core, "  s += xv[t];");
    ec_line(&e->core, "const double mean = %s / %lld;", rsum(e, &rs, "s"), (long long)cols);
    ec_line(&e->core, "double var = 0%s;", dx >= 0 ? ", mg = 0, mgx = 0" : "");
    row_each(e, &rs, cols);
    ec_line(&e->core, "const double xm = %s - mean;", xv);
    ec_line(&e->core, "var += xm * xm;");
    if (dx >= 0) {
      ec_line(&e->core, "const double g = (double)%s * %s[j];", dyv, wp);
      ec_line(&e->core, "mg += g;");
      ec_line(&e->core, "mgx += g * xm;");
    }
    if (sb)
      ec_line(&e->core, "sb[t] += %s;", dyv);
    row_each_end(e);
    if (dx >= 0 && pair)
      ec_line(&e->core, "mdl_block_sum3(var, mg, mgx, %s);", sh_double(e));
    else if (dx >= 0)
      ec_line(&e->core, "var = %s, mg = %s, mgx = %s;", rsum(e, &rs, "var"), rsum(e, &rs, "mg"), rsum(e, &rs, "mgx"));
    else
      ec_line(&e->core, "var = %s;", rsum(e, &rs, "var"));
    ec_line(&e->core, "const double rstd = 1.0 / sqrt(var / %lld + %s);", (long long)cols,
            ec_dlit(&e->core, nd->fa[0]));
    if (dx >= 0) {
      ec_line(&e->core, "mg /= %lld;", (long long)cols);
      ec_line(&e->core, "mgx *= rstd / %lld; // the mean of g xhat", (long long)cols);
    }
    if (sw && dx < 0) {
      row_each(e, &rs, cols);
      ec_line(&e->core, "sw[t] += (%s)(%s * ((%s - mean) * rstd));", at, dyv, xv);
      row_each_end(e);
    }
  } else {
    ec_line(&e->core, "double s = 0%s;", dx >= 0 ? ", mgx = 0" : "");
    row_each(e, &rs, cols);
    ec_line(&e->core, "s += (double)%s * %s;", xv, xv);
    if (dx >= 0)
      ec_line(&e->core, "mgx += (double)%s * %s[j] * %s;", dyv, wp, xv);
    row_each_end(e);
    if (dx >= 0 && pair)
      ec_line(&e->core, "mdl_block_sum2(s, mgx, %s);", sh_double(e));
    else if (dx >= 0)
      ec_line(&e->core, "s = %s, mgx = %s;", rsum(e, &rs, "s"), rsum(e, &rs, "mgx"));
    else
      ec_line(&e->core, "s = %s;", rsum(e, &rs, "s"));
    ec_line(&e->core, "const double sc = 1.0 / sqrt(s / %lld + %s);", (long long)cols, ec_dlit(&e->core, nd->fa[0]));
    if (dx >= 0)
      ec_line(&e->core, "mgx /= %lld;", (long long)cols);
    if (sw && dx < 0) {
      row_each(e, &rs, cols);
      ec_line(&e->core, "sw[t] += (%s)((double)%s * %s * sc);", at, dyv, xv);
      row_each_end(e);
    }
  }
  if (dx >= 0) {
    row_each(e, &rs, cols);
    for (int k = 2; k < st.n; k++) // (the chain reads these from their rows in shared memory)
      ec_memo_put(&e->core, st.node[k], "ix", ec_str(&e->core, "st[cur][%d][j]", k));
    if (ln) {
      ec_line(&e->core, "const double xhat = (%s - mean) * rstd;", xv);
      if (sw)
        ec_line(&e->core, "sw[t] += (%s)(%s * xhat);", at, dyv);
      ec_line(&e->core, "const float d = (float)(rstd * ((double)%s * %s[j] - mg - xhat * mgx));", dyv, wp);
    } else {
      if (sw)
        ec_line(&e->core, "sw[t] += (%s)((double)%s * %s * sc);", at, dyv, xv);
      ec_line(&e->core, "const float d = (float)(sc * %s * %s[j] - sc * sc * sc * %s * mgx);", dyv, wp, xv);
    }
    if (dxbuf)
      ec_line(&e->core, "%s[ix] = d;", ptr(e, dx));
    post_inloop(e, dx, q, nq, "ix", ec_numel(&e->core, dx), "d");
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "sa%d[t] += %s;", i, val(e, ec_node(&e->core, sums[i])->in[0], "ix"));
    row_each_end(e);
  }
  if (cols_sum) {
    ec_leave(&e->core);
    ec_line(&e->core, "#pragma unroll");
    ec_enter(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    ec_line(&e->core, "const %s j = tr + t * %d;", ixt, rs.tpr);
    ec_enter(&e->core, "if (j < %lld)", (long long)cols);
    if (sw)
      ec_line(&e->core, "%s[k * %lld + j] = sw[t];", sw, (long long)cols);
    if (sb)
      ec_line(&e->core, "%s[k * %lld + j] = sb[t];", sb, (long long)cols);
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "%s[k * %lld + j] = sa%d[t];", ss[i], (long long)cols, i);
    ec_leave(&e->core);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  kend(e, rs.grid, rs.block);
  e->loop_ix = NULL;
  if (cols_sum) {
    kbegin(e, "colsum");
    note(e, "%s: column sums of %lld blocks of rows, a block per %d columns in %d groups of rows", op_name(nd->op),
         (long long)nb, colsum_width(nb, cols), colsum_block(nb) / colsum_width(nb, cols));
    const char *parts[2 + EC_MAX_COLSUMS], *accs[2 + EC_MAX_COLSUMS];
    int np = 0;
    if (pdw >= 0)
      parts[np] = raw_ptr(e, pdw, at, "dw partials"), accs[np++] = "w";
    if (pdb >= 0)
      parts[np] = raw_ptr(e, pdb, at, "db partials"), accs[np++] = "b";
    for (int i = 0; i < nsum; i++) {
      parts[np] = raw_ptr(e, psum[i], at, "column sum partials");
      accs[np++] = ec_str(&e->core, "a%d", i);
    }
    colsum_open(e, nb, cols, parts, accs, np, false);
    if (dw >= 0)
      ec_line(&e->core, "%s[r] = (float)w;", ptr(e, dw));
    if (db >= 0)
      ec_line(&e->core, "%s[r] = (float)b;", ptr(e, db));
    for (int i = 0; i < nsum; i++)
      ec_line(&e->core, "%s[r] = (float)a%d;", ptr(e, sums[i]), i);
    ec_leave(&e->core);
    kend(e, colsum_grid(nb, cols), colsum_block(nb));
  }
  if (dxbuf)
    ec_phase_done(&e->core, dx);
  if (dw >= 0)
    ec_phase_done(&e->core, dw);
  if (db >= 0)
    ec_phase_done(&e->core, db);
  for (int i = 0; i < nsum; i++)
    ec_phase_done(&e->core, sums[i]);
  ec_phase_end(&e->core);
  free(q);
}

// SOFTMAX (x) or SOFTMAX_BWD (y, dy) over the last axis, a warp (or block) per row.
static void emit_softmax(Emit *e, int gi, const bool *emitted) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  bool bwd = nd->op == OP_SOFTMAX_BWD;
  int64_t cols = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / cols;
  row_inline(e, nd->in[0]);
  if (bwd)
    row_inline(e, nd->in[1]);
  flush(e);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), emitted, q);
  bool buf = whole(e, a);
  RowShape rs = row_shape(e, cols, rows, 32);
  ec_phase_begin(&e->core);
  kbegin(e, "");
  note(e, "%s: %lld rows of %lld, %s per row", op_name(nd->op), (long long)rows, (long long)cols, rs_who(e, &rs));
  rows_open(e, &rs, "r");
  row_load(e, &rs, nd->in[0], bwd ? "yv" : "xv", cols);
  if (bwd) {
    row_load(e, &rs, nd->in[1], "dyv", cols);
    ec_line(&e->core, "double dot = 0;");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    ec_line(&e->core, "  dot += (double)yv[t] * dyv[t];");
    ec_line(&e->core, "dot = %s;", rsum(e, &rs, "dot"));
  } else {
    ec_line(&e->core, "float mx = -MDL_INF;");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    ec_line(&e->core, "  mx = tr + t * %d < %lld ? fmaxf(mx, xv[t]) : mx;", rs.tpr, (long long)cols);
    ec_line(&e->core, "mx = %s;", rfmax(e, &rs, "mx"));
    ec_line(&e->core, "double sum = 0;");
    ec_line(&e->core, "#pragma unroll");
    ec_enter(&e->core, "for (int t = 0; t < %d; t++)", rs.npl);
    ec_line(&e->core, "xv[t] = tr + t * %d < %lld ? expf(xv[t] - mx) : 0.0f;", rs.tpr, (long long)cols);
    ec_line(&e->core, "sum += xv[t];");
    ec_leave(&e->core);
    ec_line(&e->core, "sum = %s;", rsum(e, &rs, "sum"));
  }
  row_each(e, &rs, cols);
  if (bwd)
    ec_line(&e->core, "const float y = (float)(yv[t] * (dyv[t] - dot));");
  else
    ec_line(&e->core, "const float y = (float)(xv[t] / sum);");
  if (buf)
    ec_line(&e->core, "%s[ix] = y;", ptr(e, a));
  post_inloop(e, a, q, nq, "ix", ec_numel(&e->core, a), "y");
  row_each_end(e);
  ec_leave(&e->core);
  kend(e, rs.grid, rs.block);
  e->loop_ix = NULL;
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
}

// One row r of cross-entropy inside a row group, the logits row at x (in memory; bf16 values when
// x16, widened as they are loaded): the loss into loss[r] (loss may be NULL) and dloss[r] * (softmax -
// onehot) into the row at dx (may be NULL, may be x itself; of bf16 values when dx16, each the f32
// value rounded); an ignored target (< 0) gives zeros, one >= V a report. With vw (4 or 8) both passes
// take vw logits a load, 16 bytes (four f32 or eight bf16; four bf16, 8 bytes, where rows are only
// 8-byte aligned), then the last v % vw one by one: the caller knows the rows of x and dx start
// aligned to vw elements of theirs. (The LM head's cross-entropy, a block of 1024 threads a row
// reading one float each, moved GPT-2's logits at 2.2 TB/s on an H200: a load in flight per thread is
// too few bytes to cover the memory's latency. The float4 loops were not unrolled either, one load of
// 16 bytes in a pass's loop in the PTX: they now take two loads a thread at once.)
static void ce_row(Emit *e, const RowShape *rs, int64_t v, const char *x, bool x16, const char *tg,
                   const char *loss, const char *dx, bool dx16, const char *dloss, int vw) {
  const char *ixt = e->core.ixt;
  int64_t nv = vw ? v / vw : 0; // the vector loads of a row
  ec_line(&e->core, "const %s *x = %s;", x16 ? "uint16_t" : "float", x);
  const char *xj = x16 ? "mdl_bf16_to_f32(x[j])" : "x[j]"; // x[j] as f32
  if (dx) {
    ec_line(&e->core, "%s *dx = %s;", dx16 ? "uint16_t" : "float", dx);
    dx = "dx";
  }
  ec_line(&e->core, "const int32_t tg = %s;", tg);
  ec_enter(&e->core, "if (tg < 0 || tg >= %lld)", (long long)v);
  ec_line(&e->core, "if (tg >= %lld && tr == 0)", (long long)v);
  ec_line(&e->core, "  mdl_report(status, MDL_ERR_TARGET, tg, %lld);", (long long)v);
  if (loss) {
    ec_line(&e->core, "if (tr == 0)");
    ec_line(&e->core, "  %s = 0.0f;", loss);
  }
  if (dx) {
    ec_line(&e->core, "for (%s j = tr; j < %lld; j += %d)", ixt, (long long)v, rs->tpr);
    ec_line(&e->core, "  %s[j] = %s;", dx, dx16 ? "0" : "0.0f");
  }
  orelse(e);
  if (loss)
    ec_line(&e->core, "const float xt = %s;", x16 ? "mdl_bf16_to_f32(x[tg])" : "x[tg]");
  // (dx may be x: the lane that writes dx[tg] must not do so before every lane has read x[tg]; a
  // block's reductions below order them by __syncthreads, a warp's shuffles do not order memory)
  if (loss && dx && rs->tpr == 32)
    ec_line(&e->core, "__syncwarp();");
  // One pass for the maximum and the sum (online softmax): each thread keeps the largest logit it
  // has seen and its sum of exp(x - that), rescaled when the maximum grows; the threads' sums are
  // then rescaled to the row's maximum and added. The gradient's pass reads the row a second time.
  ec_line(&e->core, "float m = -MDL_INF;");
  ec_line(&e->core, "double part = 0;");
  // (Two loads of a thread in flight at once, the second's logits taken after the first's as a loop
  // of one would: the order of the sums is the same.)
  if (nv) {
    ec_enter(&e->core, "for (%s jv = tr; jv < %lld; jv += %d)", ixt, (long long)nv, 2 * rs->tpr);
    ec_line(&e->core, "float xa[%d], ya[%d];", vw, vw);
    ec_line(&e->core, "mdl_load%d(&x[%d * jv], xa);", vw, vw);
    ec_line(&e->core, "if (jv + %d < %lld)", rs->tpr, (long long)nv);
    ec_line(&e->core, "  mdl_load%d(&x[%d * (jv + %d)], ya);", vw, vw, rs->tpr);
    ec_line(&e->core, "else");
    ec_line(&e->core, "  for (int c = 0; c < %d; c++) ya[c] = -MDL_INF;", vw);
    for (int c = 0; c < 2 * vw; c++)
      ec_line(&e->core, "mdl_softmax_add(%ca[%d], m, part);", c < vw ? 'x' : 'y', c % vw);
    ec_leave(&e->core);
  }
  if (vw * nv < v) {
    ec_line(&e->core, "for (%s j = %lld + tr; j < %lld; j += %d)", ixt, (long long)(vw * nv), (long long)v, rs->tpr);
    ec_line(&e->core, "  mdl_softmax_add(%s, m, part);", xj);
  }
  ec_line(&e->core, "const float mx = %s;", rfmax(e, rs, "m"));
  ec_line(&e->core, "double sum = m == -MDL_INF ? 0.0 : part * (double)expf(m - mx);");
  ec_line(&e->core, "sum = %s;", rsum(e, rs, "sum"));
  if (loss) {
    ec_line(&e->core, "if (tr == 0)");
    ec_line(&e->core, "  %s = (float)(mx + log(sum) - xt);", loss);
  }
  if (dx) {
    ec_line(&e->core, "const double g = %s, inv = 1.0 / sum;", dloss);
    if (nv) {
      // (both loads before either store: dx may be x itself)
      ec_enter(&e->core, "for (%s jv = tr; jv < %lld; jv += %d)", ixt, (long long)nv, 2 * rs->tpr);
      ec_line(&e->core, "const bool two = jv + %d < %lld;", rs->tpr, (long long)nv);
      ec_line(&e->core, "float xa[%d], ya[%d];", vw, vw);
      ec_line(&e->core, "mdl_load%d(&x[%d * jv], xa);", vw, vw);
      ec_line(&e->core, "if (two)");
      ec_line(&e->core, "  mdl_load%d(&x[%d * (jv + %d)], ya);", vw, vw, rs->tpr);
      for (int h = 0; h < 2; h++) {
        const char *a = h ? "ya" : "xa", *j = h ? "jy" : "j";
        if (h)
          ec_enter(&e->core, "if (two)");
        ec_line(&e->core, "const %s %s = %d * (jv%s);", ixt, j, vw, h ? ec_str(&e->core, " + %d", rs->tpr) : "");
        for (int c = 0; c < vw; c++)
          ec_line(&e->core, "%s[%d] = mdl_ce_grad(%s[%d], mx, g, inv, %s%s == tg);", a, c, a, c, j,
                  c ? ec_str(&e->core, " + %d", c) : "");
        ec_line(&e->core, "mdl_store%d(&dx[%s], %s);", vw, j, a);
        if (h)
          ec_leave(&e->core);
      }
      ec_leave(&e->core);
    }
    if (vw * nv < v) {
      ec_line(&e->core, "for (%s j = %lld + tr; j < %lld; j += %d)", ixt, (long long)(vw * nv), (long long)v,
              rs->tpr);
      const char *d = ec_str(&e->core, "mdl_ce_grad(%s, mx, g, inv, j == tg)", xj);
      ec_line(&e->core, "  %s[j] = %s;", dx, dx16 ? ec_str(&e->core, "mdl_f32_to_bf16(%s)", d) : d);
    }
  }
  ec_leave(&e->core);
}

// The elements a load of a cross-entropy row takes (ce_row's vw): 16 bytes where rows of x and dx
// (elements of xs and ds bytes, `stride` apart, at 16-byte aligned bases) start 16-byte aligned, else
// 4 elements where they start aligned to 4, else none.
static int ce_width(int64_t stride, int xs, int ds) {
  int w = 16 / xs;
  if (stride % w == 0 && (ds == 0 || (stride * ds) % 16 == 0))
    return w;
  return stride % 4 == 0 ? 4 : 0;
}

// The threads per row of a cross-entropy over v classes (the row is read from memory twice).
static RowShape ce_shape(Emit *e, int64_t v, int64_t rows) { return row_shape(e, v, rows, 64); }

// CROSS_ENTROPY and / or CROSS_ENTROPY_BWD over the same logits: one pass per row.
static void emit_ce(Emit *e, int gi) {
  const Group *gr = &e->core.groups[gi];
  int ce = -1, ceb = -1;
  for (int i = 0; i < gr->nmem; i++)
    *(ec_node(&e->core, gr->mem[i])->op == OP_CROSS_ENTROPY ? &ce : &ceb) = gr->mem[i];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  int64_t v = ec_last_dim(&e->core, nd->in[0]), rows = ec_numel(&e->core, nd->in[1]);
  int lg = ec_need(&e->core, nd->in[0]), tg = ec_need(&e->core, nd->in[1]),
      dl = ceb >= 0 ? ec_need(&e->core, ec_node(&e->core, ceb)->in[2]) : -1;
  flush(e);
  for (int i = 0; i < gr->nmem; i++)
    if (ec_offset(&e->core, gr->mem[i]) < 0)
      e->core.scratch[gr->mem[i]] = true;
  RowShape rs = ce_shape(e, v, rows);
  ec_phase_begin(&e->core);
  kbegin(e, "");
  note(e, "cross-entropy%s: %lld rows of %lld, %s per row",
       ceb >= 0 ? (ce >= 0 ? " and its gradient" : " gradient") : "", (long long)rows, (long long)v, rs_who(e, &rs));
  rows_open(e, &rs, "r");
  ce_row(e, &rs, v, ec_str(&e->core, "%s + r * %lld", ptr(e, lg), (long long)v),
         ec_node(&e->core, lg)->dtype == DT_BF16, ec_str(&e->core, "%s[r]", ptr(e, tg)),
         ce >= 0 ? ec_str(&e->core, "%s[r]", ptr(e, ce)) : NULL,
         ceb >= 0 ? ec_str(&e->core, "%s + r * %lld", ptr(e, ceb), (long long)v) : NULL, false,
         dl >= 0 ? ec_str(&e->core, "%s[r]", ptr(e, dl)) : NULL,
         ce_width(v, (int)dtype_size(ec_node(&e->core, lg)->dtype), ceb >= 0 ? 4 : 0));
  ec_leave(&e->core);
  kend(e, rs.grid, rs.block);
  for (int i = 0; i < gr->nmem; i++)
    ec_phase_done(&e->core, gr->mem[i]);
  ec_phase_end(&e->core);
}

enum { LMHEAD_BYTES = 1 << 30 }; // the most bytes of logits of one chunk of the LM head

// The LM head chunk by chunk: logits rows = x W^T (or x W) into a scratch chunk (a GEMM),
// cross-entropy and its gradient in place (a kernel), then dx rows = dlogits W (W^T) and
// dW += dlogits^T x (x^T dlogits) (two GEMMs, the second accumulating from the second chunk on).
// With bf16 operands (x and W are CASTs, dlogits read through the CAST dlc) the loss reads the logits
// rounded to bf16 too (their CAST lc): the GEMM stores them so, and the kernel overwrites them with
// dlogits rounded to bf16, which the two GEMMs read. (Where the logits stayed f32, 4096 of GPT-2's
// rows took 824 MB of logits, which the kernel reads twice, and 412 MB of bf16 dlogits apart; 412 MB
// in all now.) A graph whose loss reads f32 logits beside bf16 GEMM operands has dlogits
// written into a chunk of their own.
// The chunks' rows are padded to vp, a multiple of 64 classes: cuBLASLt runs its fast kernels only
// where rows start 16-byte aligned. Where W is [V, C] and the parameter's bf16 copy, whose rows
// memplan pads with zeros to a multiple of 64 too, the logits GEMM also computes vp columns (the
// padding's logits are 0 and never read) and the dx GEMM sums over vp classes (the kernel writes
// the padding's dlogits as 0): with every dimension a multiple of 64 the two run several times
// faster on an H200 than over GPT-2's 50257 classes (llm.c pads its vocabulary to 50304 for this).
static void emit_lmhead(Emit *e, int gi) {
  const Group *gr = &e->core.groups[gi];
  const IrNode *xm = ec_node(&e->core, gr->x);
  int64_t n = xm->shape.d[0], c = xm->shape.d[1], v = ec_last_dim(&e->core, gr->mm);
  bool bwd = gr->ceb >= 0; // (a graph without a backward: the logits GEMM and the loss alone)
  int x = ec_need(&e->core, gr->x), w = ec_need(&e->core, gr->w), tg = ec_need(&e->core, gr->tgt),
      dl = bwd ? ec_need(&e->core, gr->dloss) : -1;
  flush(e);
  DType ab = ec_node(&e->core, x)->dtype;
  bool d16 = gr->dlc >= 0, l16 = gr->lc >= 0;
  if (ec_node(&e->core, w)->dtype != ab || (bwd && (d16 != (ab == DT_BF16) || (l16 && !d16))))
    ec_fail(&e->core, "step %s: the LM head's x, W and dlogits are not all f32 or all bf16",
            e->core.f->steps[e->core.si].name);
  int outs[3] = {gr->ce, gr->dx, gr->dw}, nout = bwd ? 3 : 1;
  for (int i = 0; i < nout; i++)
    if (ec_offset(&e->core, outs[i]) < 0)
      e->core.scratch[outs[i]] = true;
  // As few chunks as hold at most 1 GiB of logits (256M in f32, 512M in bf16), of equal multiples of 64
  // rows. Each chunk reads W for two GEMMs and reads and writes all of dW once (a GEMM with K = its
  // rows): GPT-2 124M at B=8, T=1024 takes one chunk of its 8192 rows in bf16 (824 MB; in f32, 2
  // chunks of 4096 rows), moving 0.4 GB of W and dW where 2 chunks moved 0.8 GB and chunks of 640
  // rows (13) 5.9 GB, in GEMMs of a K too small to keep the tensor cores busy.
  int64_t most = LMHEAD_BYTES / (l16 ? 2 : 4);
  const char *env = getenv("MDL_LMHEAD_LOGITS"); // fewer logits, on a GPU short of memory
  if (env) {
    char *end;
    long long k = strtoll(env, &end, 10);
    if (end == env || *end || k < 1)
      ec_fail(&e->core, "MDL_LMHEAD_LOGITS=%s: not a positive number of logits", env);
    else
      most = k;
  }
  int64_t nch = (n * v + most - 1) / most;
  int64_t rc = (n + nch - 1) / nch;
  rc = (rc + 63) / 64 * 64;
  if (rc > n)
    rc = n;
  // grads: where the kernel writes dlogits and the dx and dW GEMMs read them; vp: their rows' length.
  int64_t vp = (v + MEMPLAN_ROWS - 1) / MEMPLAN_ROWS * MEMPLAN_ROWS;
  bool padw = gr->tb && d16 && fuse_is_copy(e->core.f, w) && memplan_copy_rows(ec_node(&e->core, w)) >= vp;
  int64_t vn = padw ? vp : v; // the logits GEMM's N and the dx GEMM's K
  int64_t ldw = gr->tb ? c : v, logits = scratch_alloc(e, rc * vp * (l16 ? 2 : 4));
  int64_t grads = d16 && !l16 ? scratch_alloc(e, rc * vp * 2) : logits, sab = dtype_size(ab);
  int64_t ox = buf_off(e, x), ow = buf_off(e, w), odx = bwd ? buf_off(e, gr->dx) : -1,
          odw = bwd ? buf_off(e, gr->dw) : -1;
  RowShape rs = ce_shape(e, v, rc);
  ec_phase_begin(&e->core);
  int kt = -1;
  for (int64_t r0 = 0; r0 < n; r0 += rc) {
    int64_t rn = n - r0 < rc ? n - r0 : rc;
    gemm_add(e, (CudaGemm){.ab = ab, .c_type = l16 ? DT_BF16 : DT_F32, .ta = 0, .tb = gr->tb, .m = rn, .n = vn, .k = c,
                           .lda = c, .ldb = ldw, .ldc = vp, .batch = 1, .a = ox + sab * r0 * c, .b = ow, .c = logits,
                           .bias = -1, .aux = -1});
    int64_t grid = (rn + rs.rpb - 1) / rs.rpb;
    if (kt < 0) {
      kbegin(e, "ce");
      note(e, "LM head: cross-entropy%s of a chunk of at most %lld rows of %lld classes (rows %lld "
              "apart), %s; chunk = its first row; %s per row", bwd ? " and its gradient" : "", (long long)rc,
           (long long)v, (long long)vp,
           !bwd ? (l16 ? "bf16 logits" : "f32 logits")
           : l16 ? "bf16 logits, the gradient rounded to bf16 in place"
           : d16 ? "the gradient rounded to bf16 into a chunk of its own" : "in place", rs_who(e, &rs));
      const char *lp = raw_ptr(e, logits, l16 ? "uint16_t" : "float",
                               l16 ? "the chunk's logits, bf16" : "the chunk's logits");
      const char *gp = d16 && !l16 ? raw_ptr(e, grads, "uint16_t", "the chunk's dlogits, bf16") : lp;
      ec_line(&e->core, "const %s rn = %lld - chunk < %lld ? %lld - chunk : %lld;", e->core.ixt, (long long)n,
              (long long)rc, (long long)n, (long long)rc);
      const char *row = rs.tpr == 32 ? ec_str(&e->core, "blockIdx.x * %d + (threadIdx.x >> 5)", rs.rpb) : "blockIdx.x";
      ec_line(&e->core, "const %s i = %s;", e->core.ixt, row);
      ec_line(&e->core, "const int tr = threadIdx.x%s;", rs.tpr == 32 ? " & 31" : "");
      ec_enter(&e->core, "if (i < rn)");
      ec_line(&e->core, "const %s r = chunk + i;", e->core.ixt);
      ce_row(e, &rs, v, ec_str(&e->core, "%s + i * %lld", lp, (long long)vp), l16,
             ec_str(&e->core, "%s[r]", ptr(e, tg)), ec_str(&e->core, "%s[r]", ptr(e, gr->ce)),
             bwd ? ec_str(&e->core, "%s + i * %lld", gp, (long long)vp) : NULL, d16,
             bwd ? ec_str(&e->core, "%s[r]", ptr(e, dl)) : NULL,
             ce_width(vp, l16 ? 2 : 4, !bwd ? 0 : d16 ? 2 : 4)); // rows vp apart
      if (vn > v && bwd)
        ec_line(&e->core, "for (int j = %lld + tr; j < %lld; j += %d) %s[i * %lld + j] = 0;", (long long)v,
                (long long)vn, rs.tpr, gp, (long long)vp);
      ec_leave(&e->core);
      kt = kend(e, grid, rs.block);
      e->sl[e->nsl - 1].chunk = r0;
    } else {
      relaunch(e, kt, grid, r0);
    }
    if (!bwd)
      continue;
    gemm_add(e, (CudaGemm){.ab = ab, .ta = 0, .tb = !gr->tb, .m = rn, .n = c, .k = vn, .lda = vp, .ldb = ldw, .ldc = c,
                           .batch = 1, .a = grads, .b = ow, .c = odx + 4 * r0 * c, .bias = -1, .aux = -1});
    if (gr->tb)
      gemm_add(e, (CudaGemm){.ab = ab, .ta = 1, .tb = 0, .m = v, .n = c, .k = rn, .lda = vp, .ldb = c, .ldc = c,
                             .batch = 1, .a = grads, .b = ox + sab * r0 * c, .c = odw, .beta = r0 ? 1.0f : 0.0f,
                             .bias = -1, .aux = -1});
    else
      gemm_add(e, (CudaGemm){.ab = ab, .ta = 1, .tb = 0, .m = c, .n = v, .k = rn, .lda = c, .ldb = vp, .ldc = v,
                             .batch = 1, .a = ox + sab * r0 * c, .b = grads, .c = odw, .beta = r0 ? 1.0f : 0.0f,
                             .bias = -1, .aux = -1});
  }
  for (int i = 0; i < nout; i++)
    ec_phase_done(&e->core, outs[i]);
  ec_phase_end(&e->core);
}

//
// Attention. Heads of q, k, v [B,T,C] (rows possibly strided: slices of one qkv buffer), D = C / H.
//

typedef struct {
  int64_t nb, nt, nc, heads, d;
  bool causal, has_doc;
  bool bf16; // the products read q, k, v rounded to bf16, and P V reads e rounded (ia[4], mdl.h)
  double scale;
  Rows q, k, v, dout, o; // o: the forward's output, as the backward's D reads it
  int doc, dpl; // doc: node or -1; dpl: channels per lane
  int lse;      // the ATTENTION_LSE node (the rows' log-sum-exp, [B, heads, T]), or -1
} Att;

typedef enum { ATT_FWD, ATT_STATS, ATT_DQ } AttMode;

// The block's batch b, head hd and tile (its first row, `first`, of tiles of `rows`, nt of them) with
// the tile slowest across blocks: blocks start in index order, so the tiles of most work start first
// and the last to start are the lightest. Under causality that is the last query tiles (from_end:
// their rows see the most keys) or the first key tiles (seen by the most queries). Tiles had been
// fastest, so every (batch, head) began with its heaviest tile: on GPT-2's 1024 rows the last heavy
// tiles started late: a greedy schedule of the causal forward's blocks on an H200's 264 slots (a
// block's cost its key tiles plus one) ends 38% after the mean load of a slot, heaviest-first 7%.
static void att_block(Emit *e, const Att *A, int64_t nt, int64_t rows, const char *first, bool from_end) {
  int64_t nbh = A->nb * A->heads;
  ec_line(&e->core, "const %s bh = blockIdx.x %% %lld, b = bh / %lld, hd = bh %% %lld;", e->core.ixt, (long long)nbh,
          (long long)A->heads, (long long)A->heads);
  if (from_end && A->causal && nt > 1)
    ec_line(&e->core, "const %s %s = (%lld - blockIdx.x / %lld) * %lld; // (the last tiles, seeing the most keys, "
            "first)", e->core.ixt, first,
            (long long)(nt - 1), (long long)nbh, (long long)rows);
  else
    ec_line(&e->core, "const %s %s = blockIdx.x / %lld * %lld;%s", e->core.ixt, first, (long long)nbh, (long long)rows,
            !from_end && A->causal && nt > 1 ? " // (the first tiles, seen by the most queries, first)" : "");
}

static Att att_of(Emit *e, const IrNode *nd) {
  Shape s = ec_node(&e->core, nd->in[0])->shape;
  Att A = {.nb = s.d[0], .nt = s.d[1], .nc = s.d[2], .heads = nd->ia[0], .causal = nd->ia[1], .has_doc = nd->ia[2],
           .bf16 = nd->ia[4] == DT_BF16, .scale = nd->fa[0], .doc = -1, .lse = -1};
  A.d = A.nc / A.heads;
  A.dpl = (int)((A.d + 31) / 32);
  return A;
}

// Element (t, c) of head hd, batch b of rows r, as an expression.
static const char *at_row(Emit *e, Rows r, const Att *A, const char *t, const char *c) {
  return ec_str(&e->core, "%s[(b * %lld + %s) * %lld + hd * %lld + %s]", rows_base(e, r), (long long)A->nt, t,
                (long long)r.stride, (long long)A->d, c);
}

// An element of q, k or v as the products read it: rounded to bf16 when the node says so.
static const char *att_in(Emit *e, const Att *A, const char *x) {
  return A->bf16 ? ec_str(&e->core, "mdl_bf16_to_f32(mdl_f32_to_bf16(%s))", x) : x;
}

static bool att_stored16(Emit *e, Rows r) { return ec_node(&e->core, r.node)->dtype == DT_BF16; }

// Element (row t, channel c) of q, k, v or dout as the products read it: att_in of an f32 value, or
// a value stored as bf16 (the backward's dout, precision.c) widened.
static const char *att_elem(Emit *e, const Att *A, Rows r, const char *t, const char *c) {
  const char *x = at_row(e, r, A, t, c);
  return att_stored16(e, r) ? ec_str(&e->core, "mdl_bf16_to_f32(%s)", x) : att_in(e, A, x);
}

// Channels c0 and c1 of row t as one register of two bf16 values (c0 in the low half): rounded from
// f32, or the two stored halves.
static const char *att_pair(Emit *e, const Att *A, Rows r, const char *t, const char *c0, const char *c1) {
  if (att_stored16(e, r))
    return ec_str(&e->core, "((uint32_t)%s | (uint32_t)%s << 16)", at_row(e, r, A, t, c0), at_row(e, r, A, t, c1));
  return ec_str(&e->core, "mdl_bf16x2(%s, %s)", at_row(e, r, A, t, c0), at_row(e, r, A, t, c1));
}

// The mask of key j for query row i (i's document in `di`, j's in `dj`).
static const char *att_allowed(Emit *e, const Att *A, const char *di, const char *dj) {
  return ec_str(&e->core, "j < %lld%s%s", (long long)A->nt, A->causal ? " && j <= i" : "",
                A->has_doc ? ec_str(&e->core, " && %s == %s", dj, di) : "");
}

// A statement for each channel c = lane + 32 t of the lane (t < dpl), skipping c >= D.
static void lanes_stmt(Emit *e, const Att *A, const char *stmt) {
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int t = 0; t < %d; t++)", A->dpl);
  if (A->d % 32) {
    ec_line(&e->core, "  if (lane + 32 * t < %lld)", (long long)A->d);
    ec_line(&e->core, "    %s", stmt);
  } else {
    ec_line(&e->core, "  %s", stmt);
  }
}

// Queries per block (a multiple of 4, at most 16) such that the shared tiles fit in 48 KB.
static int att_bq(Emit *e, const Att *A, int per_query) {
  int64_t kv = 2 * ATT_BK * (A->d + 1) * 4 + ATT_BK * 4;
  for (int bq = 16; bq >= 4; bq /= 2)
    if (kv + (int64_t)bq * per_query <= 48 << 10)
      return bq;
  ec_fail(&e->core, "step %s: attention heads of %lld do not fit in shared memory", e->core.f->steps[e->core.si].name,
          (long long)A->d);
  return 4;
}

// The query-tile kernels: the forward (out, and the rows' log-sum-exp A->lse when it is >= 0), the
// statistics alone (ATT_STATS: an ATTENTION_LSE without its forward) and the backward's dq (out = dq,
// from A->lse and dsum = D per row). One block of 4 warps per (batch, head, tile of queries), each
// warp owning every 4th query row of the tile; keys and values in shared tiles of 32, a key per lane;
// online softmax (forward, statistics) or probabilities from the statistics (dq). bf16: q, k, v and
// dout rounded as they are staged; the forward sums e rounded in P V and unrounded in l; dq reads dS
// rounded.
static void att_query_kernel(Emit *e, const Att *A, AttMode mode, int out, int64_t dsum) {
  const char *ixt = e->core.ixt;
  int64_t d = A->d, t = A->nt;
  int bq = att_bq(e, A, (int)(d * 4 * (mode == ATT_DQ ? 2 : 1) + 4)), rw = bq / 4;
  bool values = mode != ATT_STATS; // the statistics alone need the keys only
  int64_t nqt = (t + bq - 1) / bq;
  bool guard = d % 32 != 0;
  kbegin(e, mode == ATT_FWD ? "" : mode == ATT_STATS ? "stats" : "dq");
  note(e, "attention%s: B %lld, T %lld, %lld heads of %lld%s%s; a block per (batch, head, %d queries), "
          "keys in tiles of %d",
       mode == ATT_FWD ? (A->lse >= 0 ? " and its log-sum-exp per row" : "")
       : mode == ATT_STATS ? " statistics (log-sum-exp per row)" : " backward, dq",
       (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
       A->has_doc ? ", within documents" : "", bq, ATT_BK);
  e->shared = (int)(bq * d * 4 * (mode == ATT_DQ ? 2 : 1) + (values ? 2 : 1) * ATT_BK * (d + 1) * 4 +
                    (A->has_doc ? ATT_BK * 4 : 0));
  ec_line(&e->core, "__shared__ float Qs[%d][%lld];", bq, (long long)d);
  if (mode == ATT_DQ)
    ec_line(&e->core, "__shared__ float Os[%d][%lld];", bq, (long long)d);
  if (values)
    ec_line(&e->core, "__shared__ float Ks[%d][%lld], Vs[%d][%lld];", ATT_BK, (long long)d + 1, ATT_BK,
            (long long)d + 1);
  else
    ec_line(&e->core, "__shared__ float Ks[%d][%lld];", ATT_BK, (long long)d + 1);
  if (A->has_doc)
    ec_line(&e->core, "__shared__ int32_t Dk[%d];", ATT_BK);
  ec_line(&e->core, "const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;");
  att_block(e, A, nqt, bq, "q0", true);
  const char *lp = A->lse >= 0 ? ptr(e, A->lse) : NULL;
  const char *sp = dsum >= 0 ? raw_ptr(e, dsum, "float", "dout . out per row") : NULL;
  ec_enter(&e->core, "for (int u = threadIdx.x; u < %lld; u += %d)", (long long)(bq * d), 128);
  ec_line(&e->core, "const int i = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = q0 + i < %lld;", (long long)t);
  ec_line(&e->core, "Qs[i][c] = in ? %s : 0.0f;", att_elem(e, A, A->q, "q0 + i", "c"));
  if (mode == ATT_DQ)
    ec_line(&e->core, "Os[i][c] = in ? %s : 0.0f;", att_elem(e, A, A->dout, "q0 + i", "c"));
  ec_leave(&e->core);
  if (mode == ATT_DQ)
    ec_line(&e->core, "float acc[%d][%d], lr[%d], sr[%d];", rw, A->dpl, rw, rw);
  else if (values)
    ec_line(&e->core, "float m[%d], l[%d], acc[%d][%d];", rw, rw, rw, A->dpl);
  else
    ec_line(&e->core, "float m[%d], l[%d];", rw, rw);
  if (A->has_doc)
    ec_line(&e->core, "int32_t di[%d];", rw);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int rr = 0; rr < %d; rr++)", rw);
  if (mode == ATT_DQ || A->has_doc)
    ec_line(&e->core, "const %s i = q0 + w + 4 * rr;", ixt);
  if (mode == ATT_DQ) {
    ec_line(&e->core, "lr[rr] = i < %lld ? %s[(b * %lld + hd) * %lld + i] : 0.0f;", (long long)t, lp,
            (long long)A->heads, (long long)t);
    ec_line(&e->core, "sr[rr] = i < %lld ? %s[(b * %lld + hd) * %lld + i] : 0.0f;", (long long)t, sp,
            (long long)A->heads, (long long)t);
  } else {
    ec_line(&e->core, "m[rr] = -MDL_INF;");
    ec_line(&e->core, "l[rr] = 0.0f;");
  }
  if (A->has_doc)
    ec_line(&e->core, "di[rr] = i < %lld ? %s[b * %lld + i] : 0;", (long long)t, ptr(e, A->doc), (long long)t);
  if (values) {
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int t = 0; t < %d; t++)", A->dpl);
    ec_line(&e->core, "  acc[rr][t] = 0.0f;");
  }
  ec_leave(&e->core);
  if (A->causal)
    ec_line(&e->core, "const %s kend = q0 + %d < %lld ? q0 + %d : %lld;", ixt, bq, (long long)t, bq, (long long)t);
  else
    ec_line(&e->core, "const %s kend = %lld;", ixt, (long long)t);
  ec_enter(&e->core, "for (%s k0 = 0; k0 < kend; k0 += %d)", ixt, ATT_BK);
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "for (int u = threadIdx.x; u < %lld; u += %d)", (long long)(ATT_BK * d), 128);
  ec_line(&e->core, "const int jj = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = k0 + jj < %lld;", (long long)t);
  ec_line(&e->core, "Ks[jj][c] = in ? %s : 0.0f;", att_elem(e, A, A->k, "k0 + jj", "c"));
  if (values)
    ec_line(&e->core, "Vs[jj][c] = in ? %s : 0.0f;", att_elem(e, A, A->v, "k0 + jj", "c"));
  ec_leave(&e->core);
  if (A->has_doc) {
    ec_line(&e->core, "if (threadIdx.x < %d)", ATT_BK);
    ec_line(&e->core, "  Dk[threadIdx.x] = k0 + threadIdx.x < %lld ? %s[b * %lld + k0 + threadIdx.x] : 0;",
            (long long)t, ptr(e, A->doc), (long long)t);
  }
  ec_line(&e->core, "__syncthreads();");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int rr = 0; rr < %d; rr++)", rw);
  ec_line(&e->core, "const int ii = w + 4 * rr;");
  ec_line(&e->core, "const %s i = q0 + ii, j = k0 + lane;", ixt);
  ec_line(&e->core, "if (i >= %lld)", (long long)t);
  ec_line(&e->core, "  continue;");
  ec_line(&e->core, "const bool ok = %s;", att_allowed(e, A, "di[rr]", "Dk[lane]"));
  ec_line(&e->core, "float s = -MDL_INF;");
  ec_enter(&e->core, "if (ok)");
  ec_line(&e->core, "float dot = 0.0f;");
  ec_line(&e->core, "#pragma unroll 8");
  ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  dot += Qs[ii][c] * Ks[lane][c];");
  ec_line(&e->core, "s = dot * %s;", flit(e, A->scale));
  ec_leave(&e->core);
  if (mode == ATT_DQ) {
    ec_line(&e->core, "float ds = 0.0f;");
    ec_enter(&e->core, "if (ok)");
    ec_line(&e->core, "const float p = expf(s - lr[rr]);");
    ec_line(&e->core, "float dp = 0.0f;");
    ec_line(&e->core, "#pragma unroll 8");
    ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dp += Os[ii][c] * Vs[lane][c];");
    ec_line(&e->core, "ds = p * (dp - sr[rr]);");
    if (A->bf16)
      ec_line(&e->core, "ds = mdl_bf16_to_f32(mdl_f32_to_bf16(ds)); // dq reads dS rounded");
    ec_leave(&e->core);
    ec_line(&e->core, "#pragma unroll 4");
    ec_enter(&e->core, "for (int jj = 0; jj < %d; jj++)", ATT_BK);
    ec_line(&e->core, "const float dj = __shfl_sync(MDL_FULL, ds, jj);");
    lanes_stmt(e, A, "acc[rr][t] += dj * Ks[jj][lane + 32 * t];");
    ec_leave(&e->core);
  } else {
    ec_line(&e->core, "const float bm = mdl_warp_fmax(s);");
    ec_line(&e->core, "if (bm == -MDL_INF)");
    ec_line(&e->core, "  continue;");
    ec_line(&e->core, "const float mn = fmaxf(m[rr], bm), corr = expf(m[rr] - mn);");
    ec_line(&e->core, "const float p = ok ? expf(s - mn) : 0.0f;");
    ec_line(&e->core, "l[rr] = l[rr] * corr + mdl_warp_sumf(p);");
    ec_line(&e->core, "m[rr] = mn;");
    if (values) {
      ec_line(&e->core, "#pragma unroll");
      ec_line(&e->core, "for (int t = 0; t < %d; t++)", A->dpl);
      ec_line(&e->core, "  acc[rr][t] *= corr;");
      // P V reads e rounded (l does not; mdl.h)
      if (A->bf16)
        ec_line(&e->core, "const float pr = mdl_bf16_to_f32(mdl_f32_to_bf16(p)); // P V reads e rounded, l does not");
      ec_line(&e->core, "#pragma unroll 4");
      ec_enter(&e->core, "for (int jj = 0; jj < %d; jj++)", ATT_BK);
      ec_line(&e->core, "const float pj = __shfl_sync(MDL_FULL, %s, jj);", A->bf16 ? "pr" : "p");
      lanes_stmt(e, A, "acc[rr][t] += pj * Vs[jj][lane + 32 * t];");
      ec_leave(&e->core);
    }
  }
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int rr = 0; rr < %d; rr++)", rw);
  ec_line(&e->core, "const %s i = q0 + w + 4 * rr;", ixt);
  ec_line(&e->core, "if (i >= %lld)", (long long)t);
  ec_line(&e->core, "  continue;");
  const char *o = out >= 0 && (mode != ATT_FWD || e->out_f32) ? ptr(e, out) : NULL;
  if (mode != ATT_DQ && lp) {
    ec_line(&e->core, "if (lane == 0)");
    ec_line(&e->core, "  %s[(b * %lld + hd) * %lld + i] = m[rr] + logf(l[rr]);", lp, (long long)A->heads, (long long)t);
  }
  if (values) {
    ec_line(&e->core, "#pragma unroll");
    ec_enter(&e->core, "for (int t = 0; t < %d; t++)", A->dpl);
    ec_line(&e->core, "const int c = lane + 32 * t;");
    if (guard && mode == ATT_DQ)
      ec_line(&e->core, "if (c < %lld)", (long long)d);
    const char *ix = ec_str(&e->core, "(b * %lld + i) * %lld + hd * %lld + c", (long long)t, (long long)A->nc,
                            (long long)d);
    if (mode == ATT_FWD) {
      if (guard)
        ec_enter(&e->core, "if (c < %lld)", (long long)d);
      ec_line(&e->core, "const float y = acc[rr][t] / l[rr];");
      if (e->out_f32)
        ec_line(&e->core, "%s[%s] = y;", o, ix);
      for (int k = 0; k < e->nout_cast; k++)
        ec_line(&e->core, "%s[%s] = mdl_f32_to_bf16(y);", ptr(e, e->out_cast[k]), ix);
      if (guard)
        ec_leave(&e->core);
    } else {
      ec_line(&e->core, "%s%s[%s] = %s * acc[rr][t];", guard ? "  " : "", o, ix, flit(e, A->scale));
    }
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  kend(e, A->nb * A->heads * nqt, 128);
}

// Causal, where a block holds more rows than a staged tile (the forward's and dk, dv's 128 in 8 warps,
// tiles of 64), a tile can be wholly masked for some of the warps (`before`), and within documents
// for any warp (`none` of att_mma_docs): those skip its products (its terms would be exact zeros: the
// sums are the same) and wait at the next tile's barrier. (One test for both: a second `continue`
// cost the forward a 20-byte spill on sm_90.)
static void att_mma_skip(Emit *e, const Att *A, int rows, const char *before, const char *why) {
  bool causal = A->causal && rows > ATT_MMA_TILE;
  if (!causal && !A->has_doc)
    return;
  ec_line(&e->core, "if (%s%s%s)", causal ? before : "", causal && A->has_doc ? " || " : "", A->has_doc ? "none" : "");
  ec_line(&e->core, "  continue; // %s", why);
}

// Shared memory of the tensor-core forward: the tile's keys and values as bf16, rows padded by 8
// (no bank conflicts in the fragment loads), and the keys' documents.
static int64_t att_mma_shared(const Att *A) {
  return 2 * ATT_MMA_TILE * (A->d + 8) * 2 + (A->has_doc ? ATT_MMA_TILE * 4 : 0);
}

// Whether rows of r can be read four channels at a time (a float4 of f32 values, a ushort4 of bf16
// ones) at channels that are multiples of 4: its stride and start in elements are (buffers start
// 64-byte aligned).
static bool att_rows16(Rows r) { return r.stride % 4 == 0 && r.at % 4 == 0; }

// Does the forward run on tensor cores: bf16 products, heads of a multiple of 16 channels (the k16
// steps of Q K^T, the n8 tiles of P V), tiles that fit in 48 KB of shared memory, keys and values
// staged by float4 loads (always so for such heads: q, k, v are whole or equal parts of one tensor).
static bool att_mma(const Att *A) {
  return A->bf16 && A->d % 16 == 0 && att_mma_shared(A) <= 48 << 10 && att_rows16(A->k) && att_rows16(A->v);
}

// The B fragments of step k of a product over the rows of the shared tile xs (keys or queries,
// bf16 values, rows 16-byte aligned) for output tiles n and n + 1 (channels 8 n .. 8 n + 15), by one
// transposing ldmatrix: name[0], name[1] of tile n (rows 16 k + 2 tq, + 1 and 8 further of channel
// 8 n + g), name[2], name[3] of tile n + 1.
static void att_mma_ldsm(Emit *e, const char *xs, const char *name) {
  ec_line(&e->core, "uint32_t %s[4];", name);
  ec_line(&e->core, "mdl_ldsm_x4_t(%s, (const uint16_t *)%s[16 * k + (lane & 15)] + 8 * n + (lane >> 4) * 8);", name,
          xs);
}

// One tile of the online softmax on tensor cores, rows r0 and r1 of the lane (s: the tile's scores
// by n8 tile): the rows' maxima over the tile, then the new running maxima m0, m1; z0, z1 what e =
// exp(s - z) subtracts, c0, c1 the factors exp(m - m_new) by which l0, l1 are rescaled here (and
// whatever else the caller summed over earlier tiles, by the caller).
static void att_mma_online_max(Emit *e, const Att *A) {
  ec_line(&e->core, "// The rows' maxima over the tile: the lane's, then its quad's (lanes 4 g .. 4 g + 3 share r0).");
  ec_line(&e->core, "float x0 = -MDL_INF, x1 = -MDL_INF;");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ATT_MMA_TILE / 8);
  ec_line(&e->core, "x0 = fmaxf(x0, fmaxf(s[n][0], s[n][1]));");
  ec_line(&e->core, "x1 = fmaxf(x1, fmaxf(s[n][2], s[n][3]));");
  ec_leave(&e->core);
  ec_line(&e->core, "x0 = fmaxf(x0, __shfl_xor_sync(MDL_FULL, x0, 1));");
  ec_line(&e->core, "x0 = fmaxf(x0, __shfl_xor_sync(MDL_FULL, x0, 2));");
  ec_line(&e->core, "x1 = fmaxf(x1, __shfl_xor_sync(MDL_FULL, x1, 1));");
  ec_line(&e->core, "x1 = fmaxf(x1, __shfl_xor_sync(MDL_FULL, x1, 2));");
  ec_line(&e->core, "// The new maxima; a row that has seen no key yet subtracts 0, not -inf (its e are 0).");
  ec_line(&e->core, "// What earlier tiles summed is rescaled by exp(m - m_new).");
  ec_line(&e->core, "const float mn0 = fmaxf(m0, x0 * %s), mn1 = fmaxf(m1, x1 * %s); // (scaled: see s)",
          flit(e, A->scale * LOG2E), flit(e, A->scale * LOG2E));
  ec_line(&e->core, "const float z0 = mn0 == -MDL_INF ? 0.0f : mn0, z1 = mn1 == -MDL_INF ? 0.0f : mn1;");
  ec_line(&e->core, "const float c0 = exp2f(m0 - z0), c1 = exp2f(m1 - z1);");
  ec_line(&e->core, "m0 = mn0;");
  ec_line(&e->core, "m1 = mn1;");
  ec_line(&e->core, "l0 *= c0;");
  ec_line(&e->core, "l1 *= c1;");
}

static void att_mma_query_rows(Emit *e, const Att *A, int rows, bool dout);
static const char *att_mma_exp(Emit *e, const Att *A, const char *s, const char *z);
static void att_mma_query_tiles(Emit *e, const Att *A, int rows, bool dp);

// Kernel variants. How many warps a tensor-core attention block should have (8 warps staging a tile
// for 128 rows, or 4 for 64: more blocks, finer causal balance, half the rows to amortize each staged
// tile over, other register limits) is a question of the device, and of the kernel: each of the
// three kernels is emitted at its first size (ATT_MMA_WARPS, ATT_MMA_DQ_WARPS) and at the other, as a
// variant of the same launch on the same arguments, and the runtime times the two on the device
// before it captures the step (--no-kernel-tuning: the first). Both compute every row's sums in the
// same order over the same tiles, so they give the same values to the bit. On GPT-2 (sm_90) the
// forward takes 128 registers at either size, dk, dv 240 and dq 168 at 4 warps, 225 at 8; the
// forward at 4 warps spills 12 bytes on sm_80. NVRTC's cold compile of GPT-2's module grows from
// about 1.5 to 2.0 s here.
static int att_other_warps(int warps) { return warps == 8 ? 4 : 8; }

// Begins an attention kernel of `warps` warps: the kernel of role `role`, or, where variant_of >= 0,
// its variant (role + "_w4", "_w8") for launch variant_of.
static void att_kbegin(Emit *e, const char *role, int warps, int variant_of) {
  kbegin(e, variant_of < 0 ? role : ec_str(&e->core, "%s%sw%d", role, *role ? "_" : "", warps));
  e->variant_of = variant_of;
}

// The forward on tensor cores (att_mma), FlashAttention-2 style: a block of 8 warps per (batch, head,
// 128 queries), 16 query rows per warp with their Q in registers as mma A fragments (rounded to bf16
// once); keys and values staged in shared tiles of 64, rounded to bf16, each read by the 8 warps (with
// 4 warps per 64 queries, the staging took as long as the products: GPT-2's forward and dq, staging
// the same bytes, ran in 0.26 and 0.25 ms a layer though dq does 1.5 times the products); S = Q K^T by
// mma, scaled and masked; the online softmax of each row over the quad of lanes that holds it; e =
// exp(S - m) summed unrounded into l and, rounded, reused as the A fragments of O += P V (the
// accumulators of two adjacent n8 tiles of S are one k16 step); out = O / l in f32.
static void att_mma_kernel(Emit *e, const Att *A, int out, int warps, int variant_of) {
  int rows = 16 * warps;
  int64_t d = A->d, t = A->nt, nqt = (t + rows - 1) / rows;
  int ntiles = (int)(d / 8);
  att_kbegin(e, "", warps, variant_of);
  note(e, "attention on tensor cores: B %lld, T %lld, %lld heads of %lld%s%s; a block of %d warps per (batch, head, "
          "%d queries), 16 query rows per warp, keys in tiles of %d; bf16 products (mma m16n8k16), f32 softmax",
       (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
       A->has_doc ? ", within documents" : "", warps, rows, ATT_MMA_TILE);
  // Two blocks of 8 warps an SM (four of 4), so at most 128 registers a thread: ptxas (sm_90) took 133
  // for GPT-2's forward on bf16 q, k, v, which would leave one block, and fits 128 without spilling.
  // Heads of 128 hold twice the accumulators and Q: at 128 registers they spilled 344 bytes; left
  // free, 211.
  e->min_blocks = d <= 64 ? 16 / warps : 0;
  att_mma_query_rows(e, A, rows, false);
  ec_line(&e->core, "// Per row: the running maximum m and this lane's part of the sum l; acc[n]: the output's");
  ec_line(&e->core, "// channels 8 n .. 8 n + 7 (accumulators).");
  ec_line(&e->core, "float m0 = -MDL_INF, m1 = -MDL_INF, l0 = 0.0f, l1 = 0.0f, acc[%d][4];", ntiles);
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "  acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;");
  att_mma_query_tiles(e, A, rows, false);
  att_mma_online_max(e, A);
  ec_line(&e->core, "// (where no row of the warp has a new maximum every factor is exactly 1)");
  ec_enter(&e->core, "if (__any_sync(MDL_FULL, c0 != 1.0f || c1 != 1.0f))");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "acc[n][0] *= c0;");
  ec_line(&e->core, "acc[n][1] *= c0;");
  ec_line(&e->core, "acc[n][2] *= c1;");
  ec_line(&e->core, "acc[n][3] *= c1;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_line(&e->core, "// e = exp(S - m) goes into l as it is; rounded to bf16, tiles 2 k and 2 k + 1 of S are the A");
  ec_line(&e->core, "// fragment of step k of O += P V, whose B fragment is keys 16 k + 2 tq, + 1 and 8 further of");
  ec_line(&e->core, "// channel 8 n + g.");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %d; k++)", ATT_MMA_TILE / 16);
  ec_line(&e->core, "uint32_t pa[4];");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int h = 0; h < 2; h++)");
  ec_line(&e->core, "const float (&sv)[4] = s[2 * k + h];");
  for (int r = 0; r < 2; r++)
    ec_line(&e->core, "const float e%d = %s, e%d = %s;", 2 * r,
            att_mma_exp(e, A, r ? "sv[2]" : "sv[0]", r ? "z1" : "z0"), 2 * r + 1,
            att_mma_exp(e, A, r ? "sv[3]" : "sv[1]", r ? "z1" : "z0"));
  ec_line(&e->core, "l0 += e0 + e1;");
  ec_line(&e->core, "l1 += e2 + e3;");
  ec_line(&e->core, "pa[2 * h] = mdl_bf16x2(e0, e1);");
  ec_line(&e->core, "pa[2 * h + 1] = mdl_bf16x2(e2, e3);");
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n += 2)", ntiles);
  att_mma_ldsm(e, "Vs[cur]", "vb");
  ec_line(&e->core, "mdl_mma_bf16_16816(acc[n], pa, vb);");
  ec_line(&e->core, "mdl_mma_bf16_16816(acc[n + 1], pa, vb + 2);");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_line(&e->core, "// l: the sum of the quad's four parts; out = O / l (O: acc).");
  ec_line(&e->core, "l0 += __shfl_xor_sync(MDL_FULL, l0, 1);");
  ec_line(&e->core, "l0 += __shfl_xor_sync(MDL_FULL, l0, 2);");
  ec_line(&e->core, "l1 += __shfl_xor_sync(MDL_FULL, l1, 1);");
  ec_line(&e->core, "l1 += __shfl_xor_sync(MDL_FULL, l1, 2);");
  if (A->lse >= 0) {
    ec_line(&e->core, "// The rows' log-sum-exp, which the backward reads (lane tq = 0 writes its rows'), from base 2");
    ec_line(&e->core, "// to e.");
    for (int r = 0; r < 2; r++) {
      ec_line(&e->core, "if (tq == 0 && r%d < %lld)", r, (long long)t);
      ec_line(&e->core, "  %s[(b * %lld + hd) * %lld + r%d] = (m%d + log2f(l%d)) * %s;", ptr(e, A->lse),
              (long long)A->heads, (long long)t, r, r, r, flit(e, 1 / LOG2E));
    }
  }
  const char *o = e->out_f32 ? ptr(e, out) : NULL;
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "const int c = 8 * n + 2 * tq;");
  for (int r = 0; r < 2; r++) {
    const char *ix = ec_str(&e->core, "(b * %lld + r%d) * %lld + hd * %lld + c", (long long)t, r, (long long)A->nc,
                            (long long)d);
    ec_enter(&e->core, "if (r%d < %lld)", r, (long long)t);
    ec_line(&e->core, "const float y0 = acc[n][%d] / l%d, y1 = acc[n][%d] / l%d;", 2 * r, r, 2 * r + 1, r);
    if (e->out_f32)
      ec_line(&e->core, "*(float2 *)&%s[%s] = make_float2(y0, y1);", o, ix);
    for (int k = 0; k < e->nout_cast; k++)
      ec_line(&e->core, "*(ushort2 *)&%s[%s] = make_ushort2(mdl_f32_to_bf16(y0), mdl_f32_to_bf16(y1));",
              ptr(e, e->out_cast[k]), ix);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  kend(e, A->nb * A->heads * nqt, 32 * warps);
}

// ATTENTION forward: on tensor cores where att_mma allows, else on CUDA cores (att_query_kernel); with
// its ATTENTION_LSE (rule 3 of fuse.c) it stores the rows' log-sum-exp as well. An ATTENTION_LSE alone
// (no fusion) computes the scores and their statistics only.
static void emit_attention(Emit *e, int gi) {
  int a, lse;
  ec_attention_members(&e->core, gi, &a, &lse);
  const IrNode *nd = ec_node(&e->core, a >= 0 ? a : lse);
  Att A = att_of(e, nd);
  A.q = rows_of(e, nd->in[0]);
  A.k = rows_of(e, nd->in[1]);
  A.v = rows_of(e, nd->in[2]);
  A.doc = A.has_doc ? ec_need(&e->core, nd->in[3]) : -1;
  A.lse = lse;
  flush(e);
  e->nout_cast = a >= 0 ? ec_output_casts(&e->core, a, e->out_cast, 4, &e->out_f32) : 0;
  if (a >= 0 && e->out_f32 && ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  if (lse >= 0 && ec_offset(&e->core, lse) < 0)
    e->core.scratch[lse] = true;
  ec_phase_begin(&e->core);
  if (a < 0)
    att_query_kernel(e, &A, ATT_STATS, -1, -1);
  else if (att_mma(&A)) {
    int l = e->nsl;
    att_mma_kernel(e, &A, a, ATT_MMA_WARPS, -1);
    att_mma_kernel(e, &A, a, att_other_warps(ATT_MMA_WARPS), l);
  } else
    att_query_kernel(e, &A, ATT_FWD, a, -1);
  if (a >= 0 && e->out_f32)
    ec_phase_done(&e->core, a);
  for (int k = 0; k < e->nout_cast; k++)
    ec_phase_done(&e->core, e->out_cast[k]);
  if (lse >= 0)
    ec_phase_done(&e->core, lse);
  ec_phase_end(&e->core);
  e->nout_cast = 0;
  e->out_f32 = false;
}

// dk and dv: one warp per (batch, head, tile of 32 keys), a key per lane, the query rows that may
// see the tile taken in order through shared tiles; each key's sums are its lane's alone. bf16: q, k,
// v and dout rounded as they are staged, dk reads dS rounded and dv reads P rounded.
static void att_key_kernel(Emit *e, const Att *A, int dk, int dv, int64_t dsum) {
  const char *ixt = e->core.ixt;
  int64_t d = A->d, t = A->nt, nkt = (t + ATT_BK - 1) / ATT_BK;
  int64_t kv = 2 * ATT_BK * (d + 1) * 4 + ATT_BK * 4;
  int bq = 32;
  while (bq > 4 && kv + bq * (2 * d * 4 + 12) > 48 << 10)
    bq /= 2;
  if (kv + bq * (2 * d * 4 + 12) > 48 << 10)
    ec_fail(&e->core, "step %s: attention heads of %lld do not fit in shared memory", e->core.f->steps[e->core.si].name,
            (long long)d);
  kbegin(e, "dkv");
  note(e, "attention backward, %s: B %lld, T %lld, %lld heads of %lld%s%s; a warp per (batch, head, %d keys), "
          "a key per lane, queries in tiles of %d", dk >= 0 && dv >= 0 ? "dk and dv" : dk >= 0 ? "dk" : "dv",
       (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
       A->has_doc ? ", within documents" : "", ATT_BK, bq);
  e->shared = (int)(kv + bq * (2 * d * 4 + 12));
  ec_line(&e->core, "__shared__ float Ks[%d][%lld], Qs[%d][%lld], Os[%d][%lld], Ls[%d];", ATT_BK, (long long)d + 1, bq,
          (long long)d, bq, (long long)d, bq);
  if (dk >= 0)
    ec_line(&e->core, "__shared__ float Vs[%d][%lld], Ss[%d];", ATT_BK, (long long)d + 1, bq);
  if (A->has_doc)
    ec_line(&e->core, "__shared__ int32_t Dk[%d], Dq[%d];", ATT_BK, bq);
  const char *lp = ptr(e, A->lse);
  const char *sp = dk >= 0 ? raw_ptr(e, dsum, "float", "dout . out per row") : NULL;
  ec_line(&e->core, "const int lane = threadIdx.x;");
  att_block(e, A, nkt, ATT_BK, "k0", false);
  ec_line(&e->core, "const %s j = k0 + lane;", ixt);
  ec_enter(&e->core, "for (int u = lane; u < %lld; u += 32)", (long long)(ATT_BK * d));
  ec_line(&e->core, "const int jj = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = k0 + jj < %lld;", (long long)t);
  ec_line(&e->core, "Ks[jj][c] = in ? %s : 0.0f;", att_elem(e, A, A->k, "k0 + jj", "c"));
  if (dk >= 0)
    ec_line(&e->core, "Vs[jj][c] = in ? %s : 0.0f;", att_elem(e, A, A->v, "k0 + jj", "c"));
  ec_leave(&e->core);
  if (A->has_doc)
    ec_line(&e->core, "Dk[lane] = j < %lld ? %s[b * %lld + j] : 0;", (long long)t, ptr(e, A->doc), (long long)t);
  if (dk >= 0)
    ec_line(&e->core, "float dka[%lld];", (long long)d);
  if (dv >= 0)
    ec_line(&e->core, "float dva[%lld];", (long long)d);
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  %s%s0.0f;", dk >= 0 ? "dka[c] = " : "", dv >= 0 ? "dva[c] = " : "");
  ec_enter(&e->core, "for (%s i0 = %s; i0 < %lld; i0 += %d)", ixt, A->causal ? "k0" : "0", (long long)t, bq);
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "for (int u = lane; u < %lld; u += 32)", (long long)(bq * d));
  ec_line(&e->core, "const int ii = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  ec_line(&e->core, "const bool in = i0 + ii < %lld;", (long long)t);
  ec_line(&e->core, "Qs[ii][c] = in ? %s : 0.0f;", att_elem(e, A, A->q, "i0 + ii", "c"));
  ec_line(&e->core, "Os[ii][c] = in ? %s : 0.0f;", att_elem(e, A, A->dout, "i0 + ii", "c"));
  ec_leave(&e->core);
  ec_enter(&e->core, "for (int u = lane; u < %d; u += 32)", bq);
  ec_line(&e->core, "const bool in = i0 + u < %lld;", (long long)t);
  ec_line(&e->core, "Ls[u] = in ? %s[(b * %lld + hd) * %lld + i0 + u] : 0.0f;", lp, (long long)A->heads, (long long)t);
  if (dk >= 0)
    ec_line(&e->core, "Ss[u] = in ? %s[(b * %lld + hd) * %lld + i0 + u] : 0.0f;", sp, (long long)A->heads,
            (long long)t);
  if (A->has_doc)
    ec_line(&e->core, "Dq[u] = in ? %s[b * %lld + i0 + u] : 0;", ptr(e, A->doc), (long long)t);
  ec_leave(&e->core);
  ec_line(&e->core, "__syncthreads();");
  ec_enter(&e->core, "for (int ii = 0; ii < %d; ii++)", bq);
  ec_line(&e->core, "const %s i = i0 + ii;", ixt);
  ec_line(&e->core, "if (i >= %lld)", (long long)t);
  ec_line(&e->core, "  break;");
  ec_line(&e->core, "if (!(%s))", att_allowed(e, A, "Dq[ii]", "Dk[lane]"));
  ec_line(&e->core, "  continue;");
  ec_line(&e->core, "float dot = 0.0f;");
  ec_line(&e->core, "#pragma unroll 8");
  ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
  ec_line(&e->core, "  dot += Qs[ii][c] * Ks[lane][c];");
  ec_line(&e->core, "const float p = expf(dot * %s - Ls[ii]);", flit(e, A->scale));
  if (dv >= 0) {
    if (A->bf16)
      ec_line(&e->core, "const float pr = mdl_bf16_to_f32(mdl_f32_to_bf16(p)); // dv reads P rounded");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dva[c] += %s * Os[ii][c];", A->bf16 ? "pr" : "p");
  }
  if (dk >= 0) {
    ec_line(&e->core, "float dp = 0.0f;");
    ec_line(&e->core, "#pragma unroll 8");
    ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dp += Os[ii][c] * Vs[lane][c];");
    ec_line(&e->core, "const float ds = %s;%s",
            A->bf16 ? "mdl_bf16_to_f32(mdl_f32_to_bf16(p * (dp - Ss[ii])))" : "p * (dp - Ss[ii])",
            A->bf16 ? " // dk reads dS rounded" : "");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
    ec_line(&e->core, "  dka[c] += ds * Qs[ii][c];");
  }
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_enter(&e->core, "if (j < %lld)", (long long)t);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int c = 0; c < %lld; c++)", (long long)d);
  if (dk >= 0)
    ec_line(&e->core, "%s[(b * %lld + j) * %lld + hd * %lld + c] = %s * dka[c];", ptr(e, dk), (long long)t,
            (long long)A->nc, (long long)d, flit(e, A->scale));
  if (dv >= 0)
    ec_line(&e->core, "%s[(b * %lld + j) * %lld + hd * %lld + c] = dva[c];", ptr(e, dv), (long long)t, (long long)A->nc,
            (long long)d);
  ec_leave(&e->core);
  ec_leave(&e->core);
  kend(e, A->nb * A->heads * nkt, 32);
}

// Shared memory of the tensor-core backward kernels: two tiles of 64 rows as bf16 channel pairs, rows
// padded by 8 channels (keys and values for dq; queries and dout, with their log-sum-exp and D, for dk
// and dv), and the tile's documents.
static int64_t att_mma_bwd_shared(const Att *A, bool keys) {
  return att_mma_shared(A) + (keys ? 2 * ATT_MMA_TILE * 4 : 0);
}

// Does the backward run its dq and dk, dv kernels on tensor cores: as the forward (att_mma), and
// q and dout also read by float4 loads.
static bool att_mma_bwd(const Att *A) {
  return att_mma(A) && att_mma_bwd_shared(A, true) <= 48 << 10 && att_rows16(A->q) && att_rows16(A->dout);
}

// Whether rows of r can be copied to shared memory as they are, 16 bytes (8 channels) at a time by
// cp.async: bf16, with stride and start multiples of 8 elements.
static bool att_rows_async(Emit *e, Rows r) { return att_stored16(e, r) && r.stride % 8 == 0 && r.at % 8 == 0; }

// One row's share of att_mma_stage for the thread's (jj, c): the 8 channels from c by cp.async, or 4
// by a load and a store (x: the local for them).
static void att_mma_stage_row(Emit *e, const Att *A, const char *x0, Rows r, const char *sh, const char *buf,
                              const char *x) {
  const char *jj = strcmp(x0, "0") ? ec_str(&e->core, "%s + jj", x0) : "jj";
  if (att_rows_async(e, r)) { // (beyond T the copy reads nothing, from row x0, and fills zeros)
    ec_line(&e->core, "mdl_cp_async16(&%s[%s][jj][c / 2], &%s, in);", sh, buf,
            at_row(e, r, A, ec_str(&e->core, "(in ? %s : %s)", jj, x0), "c"));
  } else if (att_stored16(e, r)) { // four bf16 values: the two pairs as they are
    ec_line(&e->core, "const ushort4 %s = in ? *(const ushort4 *)&%s : make_ushort4(0, 0, 0, 0);", x,
            at_row(e, r, A, jj, "c"));
    ec_line(&e->core, "%s[%s][jj][c / 2] = (uint32_t)%s.x | (uint32_t)%s.y << 16;", sh, buf, x, x);
    ec_line(&e->core, "%s[%s][jj][c / 2 + 1] = (uint32_t)%s.z | (uint32_t)%s.w << 16;", sh, buf, x, x);
  } else {
    ec_line(&e->core, "const float4 %s = in ? *(const float4 *)&%s : make_float4(0.0f, 0.0f, 0.0f, 0.0f);", x,
            at_row(e, r, A, jj, "c"));
    ec_line(&e->core, "%s[%s][jj][c / 2] = mdl_bf16x2(%s.x, %s.y);", sh, buf, x, x);
    ec_line(&e->core, "%s[%s][jj][c / 2 + 1] = mdl_bf16x2(%s.z, %s.w);", sh, buf, x, x);
  }
}

// Starts staging rows x0 + jj (jj < 64) of a and b (unless bs is NULL), as bf16, into buffer buf of
// the shared tiles as and bs (channel pairs), by the block's threads; 0 beyond T. Rows that
// att_rows_async allows go by cp.async (the caller commits and waits); others (f32 rows, which are
// rounded here, or rows not 16-byte aligned) by loads and stores that are done when this returns.
static void att_mma_stage(Emit *e, const Att *A, int threads, const char *x0, Rows a, const char *as, Rows b,
                          const char *bs, const char *buf) {
  int64_t d = A->d;
  int per_a = att_rows_async(e, a) ? 8 : 4, per_b = bs && att_rows_async(e, b) ? 8 : 4; // channels at a time
  for (int i = 0; i < (bs ? 2 : 1); i++) {
    int per = i ? per_b : per_a;
    if (i && per_b == per_a) { // one loop for both
      att_mma_stage_row(e, A, x0, b, bs, buf, "bx");
      break;
    }
    if (i)
      ec_leave(&e->core);
    ec_enter(&e->core, "for (int u = threadIdx.x; u < %lld; u += %d)", (long long)(ATT_MMA_TILE * d / per), threads);
    ec_line(&e->core, "const int jj = u / %lld, c = u %% %lld * %d;", (long long)(d / per), (long long)(d / per), per);
    ec_line(&e->core, "const bool in = %s%s < %lld;", strcmp(x0, "0") ? ec_str(&e->core, "%s + ", x0) : "", "jj",
            (long long)A->nt);
    att_mma_stage_row(e, A, x0, i ? b : a, i ? bs : as, buf, i ? "bx" : "ax");
  }
  ec_leave(&e->core);
}

// Starts staging per-row values of the tile's rows x0 + jj by threads jj < 64 into buffer buf: what
// names the destinations (shared arrays), from the element expressions src (each row jj of the
// tile, by cp.async of 4 bytes, 0 beyond T).
static void att_mma_stage_rows(Emit *e, const Att *A, const char *x0, const char *buf, int n, const char *const *dst,
                               const char *const *src) {
  ec_enter(&e->core, "if (threadIdx.x < %d)", ATT_MMA_TILE);
  ec_line(&e->core, "const %s i = %sthreadIdx.x, at = i < %lld ? i : %s; // (beyond T: read nothing, from %s)",
          e->core.ixt, strcmp(x0, "0") ? ec_str(&e->core, "%s + ", x0) : "", (long long)A->nt, x0, x0);
  for (int k = 0; k < n; k++)
    ec_line(&e->core, "mdl_cp_async4(&%s[%s][threadIdx.x], &%s, i < %lld);", dst[k], buf, src[k], (long long)A->nt);
  ec_leave(&e->core);
}

// How many buffers of `bytes` a block's tiles take: two where they fit in 48 KB (the next tile's
// copies then run while the warps compute on this one), else one.
static int att_mma_stages(int64_t bytes) { return 2 * bytes <= 48 << 10 ? 2 : 1; }

// What a block stages per tile: rows of a and b (unless bs is NULL) into the shared tiles as and bs,
// and nrow per-row values (att_mma_stage_rows), by its `threads`.
typedef struct {
  int threads;
  Rows a, b;
  const char *as, *bs;
  int nrow;
  const char *rdst[3], *rsrc[3];
} AttStage;

static void att_mma_issue(Emit *e, const Att *A, const AttStage *st, const char *x0, const char *buf) {
  att_mma_stage(e, A, st->threads, x0, st->a, st->as, st->b, st->bs, buf);
  if (st->nrow)
    att_mma_stage_rows(e, A, x0, buf, st->nrow, st->rdst, st->rsrc);
}

// Opens the loop over the tiles var = start, start + 64, .. < end, each staged into buffer `cur` of
// `stages` (att_mma_stages) and in shared memory for every warp where the loop's body begins. With
// two, tile 0's copies start before the loop and each tile starts the next one's into the other
// buffer before it waits for its own: the copies run while the warps compute.
static void att_mma_tile_loop(Emit *e, const Att *A, const AttStage *st, int stages, const char *var,
                              const char *start, const char *end) {
  const char *ixt = e->core.ixt;
  if (stages == 2) {
    att_mma_issue(e, A, st, start, "0");
    ec_line(&e->core, "mdl_cp_async_commit();");
    ec_enter(&e->core, "for (%s %s = %s, cur = 0; %s < %s; %s += %d, cur ^= 1)", ixt, var, start, var, end, var,
             ATT_MMA_TILE);
    ec_line(&e->core, "__syncthreads(); // (every warp is done with the other buffer: the tile before)");
    ec_enter(&e->core, "if (%s + %d < %s)", var, ATT_MMA_TILE, end);
    att_mma_issue(e, A, st, ec_str(&e->core, "%s + %d", var, ATT_MMA_TILE), "cur ^ 1");
    ec_leave(&e->core);
    ec_line(&e->core, "mdl_cp_async_commit();");
    ec_line(&e->core, "mdl_cp_async_wait<1>(); // this tile's copies have landed; the next tile's may be in flight");
  } else {
    ec_line(&e->core, "// (one buffer: cur stays 0)");
    ec_enter(&e->core, "for (%s %s = %s, cur = 0; %s < %s; %s += %d)", ixt, var, start, var, end, var, ATT_MMA_TILE);
    ec_line(&e->core, "__syncthreads();");
    att_mma_issue(e, A, st, var, "cur");
    ec_line(&e->core, "mdl_cp_async_commit();");
    ec_line(&e->core, "mdl_cp_async_wait<0>();");
  }
  ec_line(&e->core, "__syncthreads();");
}

// The A fragments of the k16 steps over the channels of rows r0 and r1 = r0 + 8 of x, as bf16; 0
// beyond T.
static void att_mma_frags(Emit *e, const Att *A, Rows x, const char *name) {
  ec_line(&e->core, "uint32_t %s[%lld][4];", name, (long long)(A->d / 16));
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %lld; k++)", (long long)(A->d / 16));
  ec_line(&e->core, "const int c = 16 * k + 2 * tq;");
  for (int r = 0; r < 4; r++) {
    const char *row = r & 1 ? "r1" : "r0", *c0 = r & 2 ? "c + 8" : "c", *c1 = r & 2 ? "c + 9" : "c + 1";
    ec_line(&e->core, "%s[k][%d] = %s < %lld ? %s : 0u;", name, r, row, (long long)A->nt,
            att_pair(e, A, x, row, c0, c1));
  }
  ec_leave(&e->core);
}

// exp2(s scale log2(e) - z) for an unscaled score s of att_mma_scores and z (a maximum or log-sum-exp)
// in base 2: e^(scale s) over e^z', the product and the difference in one FMA.
static const char *att_mma_exp(Emit *e, const Att *A, const char *s, const char *z) {
  return ec_str(&e->core, "exp2f(fmaf(%s, %s, -%s))", s, flit(e, A->scale * LOG2E), z);
}

// The two products of a tile with the warp's rows by mma: s = X Y^T (unscaled: the kernels take exp2f
// of s times scale log2(e) less a maximum or log-sum-exp in base 2, one FMA, cheaper than expf of a
// scaled s less the maximum; att_mma_exp) and dp = Z W^T (unless za is NULL) over the channels, X, Z
// as A fragments xa, za; Y, W the shared tiles ys, ws; tile n of s, dp: columns 8 n .. 8 n + 7 of the
// tile (B fragment: row 8 n + g of ys, channels 16 k + 2 tq, + 1 and 8 further).
static void att_mma_scores(Emit *e, const Att *A, const char *xa, const char *ys, const char *za, const char *ws) {
  int stiles = ATT_MMA_TILE / 8;
  if (za)
    ec_line(&e->core, "float s[%d][4], dp[%d][4];", stiles, stiles);
  else
    ec_line(&e->core, "float s[%d][4];", stiles);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", stiles);
  ec_line(&e->core, "s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;");
  if (za)
    ec_line(&e->core, "dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;");
  ec_leave(&e->core);
  ec_line(&e->core, "// (the B fragments of step k of tiles n and n + 1 by one ldmatrix: lanes 0-7 give rows 8 n ..");
  ec_line(&e->core, "// 8 n + 7 at channel 16 k, lanes 8-15 the same rows at 16 k + 8, lanes 16-31 rows 8 n + 8 ..)");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n += 2)", stiles);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %lld; k++)", (long long)(A->d / 16));
  for (int i = 0; i < (za ? 2 : 1); i++) {
    const char *b = i ? "wb" : "yb", *x = i ? za : xa, *acc = i ? "dp" : "s";
    ec_line(&e->core, "uint32_t %s[4];", b);
    ec_line(&e->core, "mdl_ldsm_x4(%s, (const uint16_t *)%s[8 * n + (lane & 7) + (lane >> 4) * 8] + 16 * k + "
            "(lane >> 3 & 1) * 8);", b, i ? ws : ys);
    ec_line(&e->core, "mdl_mma_bf16_16816(%s[n], %s[k], %s);", acc, x, b);
    ec_line(&e->core, "mdl_mma_bf16_16816(%s[n + 1], %s[k], %s + 2);", acc, x, b);
  }
  ec_leave(&e->core);
  ec_leave(&e->core);
}

// Within documents, the warp's 16 rows (documents d0, d1 of each lane) against the staged tile's 64
// (documents tile_docs[]): when the rows are all of one document, a tile with none of its rows in it has
// nothing for them (`none`: att_mma_skip) and one with all of them in it needs no document mask
// (`one`), by three votes of the warp in place of a comparison per score. Any documents are allowed,
// in any order; packed sequences make most tiles one or the other.
static void att_mma_docs(Emit *e, const char *tile_docs) {
  _Static_assert(ATT_MMA_TILE == 64, "a tile's documents are read two a lane");
  ec_line(&e->core, "// Documents: the warp's rows all in dw's (rows1); the tile's rows none or all in it.");
  ec_line(&e->core, "const int32_t dw = __shfl_sync(MDL_FULL, d0, 0), dt0 = %s[lane], dt1 = %s[lane + 32];",
          tile_docs, tile_docs);
  ec_line(&e->core, "const bool rows1 = __all_sync(MDL_FULL, d0 == dw && d1 == dw);");
  ec_line(&e->core, "const bool none = rows1 && __all_sync(MDL_FULL, dt0 != dw && dt1 != dw);");
  ec_line(&e->core, "const bool one = rows1 && __all_sync(MDL_FULL, dt0 == dw && dt1 == dw);");
}

// Masks s (-inf where the query may not see the key) when `edge` holds: ij
// declares i and j of accumulator x of tile n, di and dj are their documents; row_bound: the query
// (a column) must be below T too.
static void att_mma_mask(Emit *e, const Att *A, const char *edge, const char *ij, const char *dj, const char *di,
                         bool row_bound) {
  ec_enter(&e->core, "if (%s)", edge);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ATT_MMA_TILE / 8);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int x = 0; x < 4; x++)");
  ec_line(&e->core, "const %s %s;", e->core.ixt, ij);
  ec_line(&e->core, "if (!(%s%s))", row_bound ? ec_str(&e->core, "i < %lld && ", (long long)A->nt) : "",
          att_allowed(e, A, di, dj));
  ec_line(&e->core, "  s[n][x] = -MDL_INF;");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
}

// The set-up of a block by query tile on tensor cores (the forward's and dq's): `rows` queries of a
// (batch, head), 16 query rows per warp, with Q (and dout for dq) as mma A fragments in registers,
// and the shared tiles of keys and values (bf16 pairs, rows 16-byte aligned for ldmatrix).
static void att_mma_query_rows(Emit *e, const Att *A, int rows, bool dout) {
  const char *ixt = e->core.ixt;
  int64_t t = A->nt, nqt = (t + rows - 1) / rows;
  int stages = att_mma_stages(att_mma_shared(A));
  e->shared = (int)(stages * att_mma_shared(A));
  long long pairs = A->d / 2 + 4;
  ec_line(&e->core, "// The tiles' keys and values as bf16 pairs%s.", stages == 2 ? ", in two buffers" : "");
  ec_line(&e->core, "__shared__ __align__(16) uint32_t Ks[%d][%d][%lld], Vs[%d][%d][%lld];", stages, ATT_MMA_TILE,
          pairs, stages, ATT_MMA_TILE, pairs);
  if (A->has_doc)
    ec_line(&e->core, "__shared__ int32_t Dk[%d][%d];", stages, ATT_MMA_TILE);
  ec_line(&e->core, "const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;");
  att_block(e, A, nqt, rows, "q0", true);
  ec_line(&e->core, "// The lane's query rows: r0 (accumulators 0 and 1 of a tile) and r1 (2 and 3).");
  ec_line(&e->core, "const %s r0 = q0 + 16 * w + g, r1 = r0 + 8;", ixt);
  ec_line(&e->core, "// Q%s as the A fragments of the k16 steps over the channels, rounded once; 0 beyond T.",
          dout ? " and dout" : "");
  att_mma_frags(e, A, A->q, "qa");
  if (dout)
    att_mma_frags(e, A, A->dout, "oa");
  if (A->has_doc)
    ec_line(&e->core, "const int32_t d0 = r0 < %lld ? %s[b * %lld + r0] : 0, d1 = r1 < %lld ? %s[b * %lld + r1] : 0;",
            (long long)t, ptr(e, A->doc), (long long)t, (long long)t, ptr(e, A->doc), (long long)t);
}

// Opens the loop over the key tiles of the block's `rows` queries (att_mma_query_rows): stages the
// tile, and leaves S = Q K^T (scaled, -inf where the row may not see the key) in s and, with dp,
// dP = dout V^T in dp.
static void att_mma_query_tiles(Emit *e, const Att *A, int rows, bool dp) {
  const char *ixt = e->core.ixt;
  int64_t t = A->nt;
  if (A->causal)
    ec_line(&e->core, "const %s kend = q0 + %d < %lld ? q0 + %d : %lld; // later keys are masked for every row", ixt,
            rows, (long long)t, rows, (long long)t);
  else
    ec_line(&e->core, "const %s kend = %lld;", ixt, (long long)t);
  AttStage st = {.threads = rows / 16 * 32, .a = A->k, .b = A->v, .as = "Ks", .bs = "Vs"}; // (a warp per 16 rows)
  if (A->has_doc) {
    st.rdst[st.nrow] = "Dk";
    st.rsrc[st.nrow++] = ec_str(&e->core, "%s[b * %lld + at]", ptr(e, A->doc), (long long)t);
  }
  att_mma_tile_loop(e, A, &st, att_mma_stages(att_mma_shared(A)), "k0", "0", "kend");
  if (A->has_doc)
    att_mma_docs(e, "Dk[cur]");
  att_mma_skip(e, A, rows, "k0 > q0 + 16 * w + 15", "the warp's rows see none of the tile's keys");
  ec_line(&e->core, "// S = Q K^T (unscaled)%s: tile n holds keys k0 + 8 n .. k0 + 8 n + 7.",
          dp ? " and dP = dout V^T" : "");
  att_mma_scores(e, A, "qa", "Ks[cur]", dp ? "oa" : NULL, "Vs[cur]");
  const char *edge = ec_str(&e->core, "%sk0 + %d > %lld%s", A->has_doc ? "!one || " : "", ATT_MMA_TILE, (long long)t,
                            A->causal ? ec_str(&e->core, " || k0 + %d > q0 + 16 * w", ATT_MMA_TILE - 1) : "");
  ec_line(&e->core, "// Keys the row may not see get -inf (in tiles past T%s%s).",
          A->causal ? ", past a row of the warp" : "", A->has_doc ? ", in other documents" : "");
  const char *ij = A->causal ? "i = x < 2 ? r0 : r1, j = k0 + 8 * n + 2 * tq + (x & 1)"
                             : "j = k0 + 8 * n + 2 * tq + (x & 1)";
  att_mma_mask(e, A, edge, ij, "Dk[cur][j - k0]", "(x < 2 ? d0 : d1)", false);
}

// D = dout . out for each row of each head (mdl.h: both as the backward reads them, a bf16 CAST
// widened or an f32 value rounded when the products are bf16), which dS = P (dP - D) subtracts in the
// dq and dk kernels: a warp per (batch, row, head), a channel per lane.
static void att_dsum_kernel(Emit *e, const Att *A, int64_t dsum) {
  const char *ixt = e->core.ixt;
  int64_t rows = A->nb * A->nt * A->heads;
  kbegin(e, "dsum");
  note(e, "attention backward, D = dout . out: B %lld, T %lld, %lld heads of %lld; a warp per row of a head",
       (long long)A->nb, (long long)A->nt, (long long)A->heads, (long long)A->d);
  const char *sp = raw_ptr(e, dsum, "float", "dout . out per row");
  ec_line(&e->core, "const %s u = (%s)blockIdx.x * 8 + (threadIdx.x >> 5);", ixt, ixt);
  ec_line(&e->core, "const int lane = threadIdx.x & 31;");
  ec_line(&e->core, "if (u >= %lld)", (long long)rows);
  ec_line(&e->core, "  return; // the whole warp");
  ec_line(&e->core, "const %s b = u / %lld, i = u / %lld %% %lld, hd = u %% %lld;", ixt, (long long)(A->nt * A->heads),
          (long long)A->heads, (long long)A->nt, (long long)A->heads);
  ec_line(&e->core, "float dd = 0.0f;");
  char stmt[512];
  snprintf(stmt, sizeof stmt, "dd += %s * %s;", att_elem(e, A, A->dout, "i", "lane + 32 * t"),
           att_elem(e, A, A->o, "i", "lane + 32 * t"));
  lanes_stmt(e, A, stmt);
  ec_line(&e->core, "dd = mdl_warp_sumf(dd);");
  ec_line(&e->core, "if (lane == 0)");
  ec_line(&e->core, "  %s[(b * %lld + hd) * %lld + i] = dd;", sp, (long long)A->heads, (long long)A->nt);
  kend(e, (rows + 7) / 8, 256);
}

// dq on tensor cores (att_mma_bwd), FlashAttention-2's backward by query tile: a block of 4 warps per
// (batch, head, 64 queries), 16 query rows per warp with Q and dout as mma A fragments (bf16);
// keys and values staged in shared tiles of 64 as bf16; S = Q K^T and dP = dout V^T by mma, P =
// exp(S - lse), dS = P (dP - D) in f32; rounded, the dS accumulators of two adjacent n8 tiles are the
// A fragment of one k16 step of dq += dS K; dq = scale dq.
static void att_mma_dq_kernel(Emit *e, const Att *A, int out, int64_t dsum, int warps, int variant_of) {
  int rows = 16 * warps;
  int64_t d = A->d, t = A->nt, nqt = (t + rows - 1) / rows;
  int ntiles = (int)(d / 8);
  att_kbegin(e, "dq", warps, variant_of);
  note(e, "attention backward, dq on tensor cores: B %lld, T %lld, %lld heads of %lld%s%s; a block of %d warps per "
          "(batch, head, %d queries), 16 query rows per warp, keys in tiles of %d; bf16 products (mma m16n8k16)",
       (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
       A->has_doc ? ", within documents" : "", warps, rows, ATT_MMA_TILE);
  att_mma_query_rows(e, A, rows, true);
  const char *lp = ptr(e, A->lse);
  const char *sp = raw_ptr(e, dsum, "float", "dout . out per row");
  ec_line(&e->core, "// The rows' log-sum-exp in base 2 (as s), and D.");
  for (int r = 0; r < 2; r++)
    ec_line(&e->core, "const float l%d = r%d < %lld ? %s[(b * %lld + hd) * %lld + r%d] * %s : 0.0f, "
            "s%d = r%d < %lld ? %s[(b * %lld + hd) * %lld + r%d] : 0.0f;", r, r, (long long)t, lp,
            (long long)A->heads, (long long)t, r, flit(e, LOG2E), r, r, (long long)t, sp, (long long)A->heads,
            (long long)t, r);
  ec_line(&e->core, "float acc[%d][4]; // dq's channels 8 n .. 8 n + 7", ntiles);
  ec_line(&e->core, "#pragma unroll");
  ec_line(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "  acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;");
  att_mma_query_tiles(e, A, rows, true);
  ec_line(&e->core, "// P = exp(S - lse), dS = P (dP - D); rounded, tiles 2 k and 2 k + 1 of dS are the A fragment");
  ec_line(&e->core, "// of step k of dq += dS K, whose B fragment is keys 16 k + 2 tq, + 1 and 8 further of");
  ec_line(&e->core, "// channel 8 n + g.");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %d; k++)", ATT_MMA_TILE / 16);
  ec_line(&e->core, "uint32_t da[4];");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int h = 0; h < 2; h++)");
  ec_line(&e->core, "const float (&sv)[4] = s[2 * k + h], (&pv)[4] = dp[2 * k + h];");
  for (int r = 0; r < 2; r++)
    ec_line(&e->core, "da[2 * h%s] = mdl_bf16x2(%s * (pv[%d] - s%d), %s * (pv[%d] - s%d));", r ? " + 1" : "",
            att_mma_exp(e, A, r ? "sv[2]" : "sv[0]", r ? "l1" : "l0"), 2 * r, r,
            att_mma_exp(e, A, r ? "sv[3]" : "sv[1]", r ? "l1" : "l0"), 2 * r + 1, r);
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n += 2)", ntiles);
  att_mma_ldsm(e, "Ks[cur]", "kb");
  ec_line(&e->core, "mdl_mma_bf16_16816(acc[n], da, kb);");
  ec_line(&e->core, "mdl_mma_bf16_16816(acc[n + 1], da, kb + 2);");
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
  const char *o = ptr(e, out);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "const int c = 8 * n + 2 * tq;");
  for (int r = 0; r < 2; r++) {
    ec_line(&e->core, "if (r%d < %lld)", r, (long long)t);
    ec_line(&e->core, "  *(float2 *)&%s[(b * %lld + r%d) * %lld + hd * %lld + c] = make_float2(%s * acc[n][%d], "
            "%s * acc[n][%d]);", o, (long long)t, r, (long long)A->nc, (long long)d, flit(e, A->scale), 2 * r,
            flit(e, A->scale), 2 * r + 1);
  }
  ec_leave(&e->core);
  kend(e, A->nb * A->heads * nqt, 32 * warps);
}

// dk and dv on tensor cores (att_mma_bwd), FlashAttention-2's backward by key tile: a block of 8 warps
// per (batch, head, 128 keys), 16 keys per warp with K and V as mma A fragments (bf16); the queries that
// may see the tile, and their dout, staged in shared tiles of 64 as bf16 with their log-sum-exp and D;
// S^T = K Q^T and dP^T = V dout^T by mma, P^T = exp(S^T - lse), dS^T = P^T (dP^T - D) in f32; rounded,
// the accumulators of two adjacent n8 tiles are the A fragments of one k16 step of dv += P^T dout and
// dk += dS^T Q; dk = scale dk.
static void att_mma_dkv_kernel(Emit *e, const Att *A, int dk, int dv, int64_t dsum, int warps, int variant_of) {
  const char *ixt = e->core.ixt;
  int rows = 16 * warps;
  int64_t d = A->d, t = A->nt, nkt = (t + rows - 1) / rows;
  int ntiles = (int)(d / 8);
  att_kbegin(e, "dkv", warps, variant_of);
  note(e, "attention backward, %s on tensor cores: B %lld, T %lld, %lld heads of %lld%s%s; a block of %d warps per "
          "(batch, head, %d keys), 16 keys per warp, queries in tiles of %d; bf16 products (mma m16n8k16)",
       dk >= 0 && dv >= 0 ? "dk and dv" : dk >= 0 ? "dk" : "dv", (long long)A->nb, (long long)t, (long long)A->heads,
       (long long)d, A->causal ? ", causal" : "", A->has_doc ? ", within documents" : "",
       warps, rows, ATT_MMA_TILE);
  int stages = att_mma_stages(att_mma_bwd_shared(A, true));
  e->shared = (int)(stages * att_mma_bwd_shared(A, true));
  ec_line(&e->core, "// The tiles' queries and dout as bf16 pairs, their log-sum-exp%s%s.", dk >= 0 ? " and D" : "",
          stages == 2 ? ", in two buffers" : "");
  ec_line(&e->core, "__shared__ __align__(16) uint32_t Qs[%d][%d][%lld], Os[%d][%d][%lld];", stages, ATT_MMA_TILE,
          (long long)(d / 2 + 4), stages, ATT_MMA_TILE, (long long)(d / 2 + 4));
  if (dk >= 0)
    ec_line(&e->core, "__shared__ float Ls[%d][%d], Ss[%d][%d];", stages, ATT_MMA_TILE, stages, ATT_MMA_TILE);
  else
    ec_line(&e->core, "__shared__ float Ls[%d][%d];", stages, ATT_MMA_TILE);
  if (A->has_doc)
    ec_line(&e->core, "__shared__ int32_t Dq[%d][%d];", stages, ATT_MMA_TILE);
  ec_line(&e->core, "const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;");
  att_block(e, A, nkt, rows, "k0", false);
  ec_line(&e->core, "// The lane's keys: r0 (accumulators 0 and 1 of a tile) and r1 (2 and 3).");
  ec_line(&e->core, "const %s r0 = k0 + 16 * w + g, r1 = r0 + 8;", ixt);
  ec_line(&e->core, "// K and V as the A fragments of the k16 steps over the channels, rounded once; 0 beyond T.");
  att_mma_frags(e, A, A->k, "ka");
  if (dk >= 0)
    att_mma_frags(e, A, A->v, "va");
  if (A->has_doc)
    ec_line(&e->core, "const int32_t d0 = r0 < %lld ? %s[b * %lld + r0] : 0, d1 = r1 < %lld ? %s[b * %lld + r1] : 0;",
            (long long)t, ptr(e, A->doc), (long long)t, (long long)t, ptr(e, A->doc), (long long)t);
  const char *lp = ptr(e, A->lse);
  const char *sp = dk >= 0 ? raw_ptr(e, dsum, "float", "dout . out per row") : NULL;
  ec_line(&e->core, "float %s; // channels 8 n .. 8 n + 7",
          dk >= 0 && dv >= 0 ? ec_str(&e->core, "dka[%d][4], dva[%d][4]", ntiles, ntiles)
                             : ec_str(&e->core, "%s[%d][4]", dk >= 0 ? "dka" : "dva", ntiles));
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  if (dk >= 0)
    ec_line(&e->core, "dka[n][0] = dka[n][1] = dka[n][2] = dka[n][3] = 0.0f;");
  if (dv >= 0)
    ec_line(&e->core, "dva[n][0] = dva[n][1] = dva[n][2] = dva[n][3] = 0.0f;");
  ec_leave(&e->core);
  if (A->causal)
    ec_line(&e->core, "// (queries before k0 see none of the keys)");
  AttStage st = {.threads = 32 * warps, .a = A->q, .b = A->dout, .as = "Qs", .bs = "Os", .nrow = 1,
                 .rdst = {"Ls"}, .rsrc = {ec_str(&e->core, "%s[(b * %lld + hd) * %lld + at]", lp, (long long)A->heads,
                                                  (long long)t)}};
  if (sp) {
    st.rdst[st.nrow] = "Ss";
    st.rsrc[st.nrow++] = ec_str(&e->core, "%s[(b * %lld + hd) * %lld + at]", sp, (long long)A->heads, (long long)t);
  }
  if (A->has_doc) {
    st.rdst[st.nrow] = "Dq";
    st.rsrc[st.nrow++] = ec_str(&e->core, "%s[b * %lld + at]", ptr(e, A->doc), (long long)t);
  }
  att_mma_tile_loop(e, A, &st, stages, "i0", A->causal ? "k0" : "0", ec_str(&e->core, "%lld", (long long)t));
  if (A->has_doc)
    att_mma_docs(e, "Dq[cur]");
  att_mma_skip(e, A, rows, ec_str(&e->core, "i0 + %d < k0 + 16 * w", ATT_MMA_TILE - 1),
               "none of the tile's queries sees the warp's keys");
  ec_line(&e->core, "// S^T = K Q^T (unscaled)%s: tile n holds queries i0 + 8 n .. i0 + 8 n + 7.",
          dk >= 0 ? " and dP^T = V dout^T" : "");
  att_mma_scores(e, A, "ka", "Qs[cur]", dk >= 0 ? "va" : NULL, "Os[cur]");
  const char *edge = ec_str(&e->core, "%si0 + %d > %lld%s", A->has_doc ? "!one || " : "", ATT_MMA_TILE, (long long)t,
                            A->causal ? " || i0 < k0 + 16 * w + 15" : "");
  ec_line(&e->core, "// Queries that may not see the key get -inf (in tiles past T%s%s).",
          A->causal ? ", before a key of the warp" : "", A->has_doc ? ", in other documents" : "");
  att_mma_mask(e, A, edge, "i = i0 + 8 * n + 2 * tq + (x & 1), j = x < 2 ? r0 : r1", "(x < 2 ? d0 : d1)",
               "Dq[cur][i - i0]", true);
  ec_line(&e->core, "// P^T = exp(S^T - lse), dS^T = P^T (dP^T - D); rounded, tiles 2 k and 2 k + 1 are the A");
  ec_line(&e->core, "// fragments of step k of dv += P^T dout and dk += dS^T Q, whose B fragments are queries");
  ec_line(&e->core, "// 16 k + 2 tq, + 1 and 8 further of channel 8 n + g.");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int k = 0; k < %d; k++)", ATT_MMA_TILE / 16);
  ec_line(&e->core, "uint32_t %s;", dk >= 0 && dv >= 0 ? "pa[4], da[4]" : dk >= 0 ? "da[4]" : "pa[4]");
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int h = 0; h < 2; h++)");
  ec_line(&e->core, "const int i = 16 * k + 8 * h + 2 * tq;");
  ec_line(&e->core, "const float (&sv)[4] = s[2 * k + h]%s;", dk >= 0 ? ", (&pv)[4] = dp[2 * k + h]" : "");
  ec_line(&e->core, "const float L0 = Ls[cur][i] * %s, L1 = Ls[cur][i + 1] * %s; // (in base 2, as s)",
          flit(e, LOG2E), flit(e, LOG2E));
  for (int r = 0; r < 2; r++)
    ec_line(&e->core, "const float p%d = %s, p%d = %s;", 2 * r, att_mma_exp(e, A, r ? "sv[2]" : "sv[0]", "L0"),
            2 * r + 1, att_mma_exp(e, A, r ? "sv[3]" : "sv[1]", "L1"));
  if (dv >= 0) {
    ec_line(&e->core, "pa[2 * h] = mdl_bf16x2(p0, p1);");
    ec_line(&e->core, "pa[2 * h + 1] = mdl_bf16x2(p2, p3);");
  }
  if (dk >= 0) {
    ec_line(&e->core, "const float S0 = Ss[cur][i], S1 = Ss[cur][i + 1];");
    ec_line(&e->core, "da[2 * h] = mdl_bf16x2(p0 * (pv[0] - S0), p1 * (pv[1] - S1));");
    ec_line(&e->core, "da[2 * h + 1] = mdl_bf16x2(p2 * (pv[2] - S0), p3 * (pv[3] - S1));");
  }
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n += 2)", ntiles);
  if (dv >= 0) {
    att_mma_ldsm(e, "Os[cur]", "ob");
    ec_line(&e->core, "mdl_mma_bf16_16816(dva[n], pa, ob);");
    ec_line(&e->core, "mdl_mma_bf16_16816(dva[n + 1], pa, ob + 2);");
  }
  if (dk >= 0) {
    att_mma_ldsm(e, "Qs[cur]", "qb");
    ec_line(&e->core, "mdl_mma_bf16_16816(dka[n], da, qb);");
    ec_line(&e->core, "mdl_mma_bf16_16816(dka[n + 1], da, qb + 2);");
  }
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_leave(&e->core);
  ec_line(&e->core, "#pragma unroll");
  ec_enter(&e->core, "for (int n = 0; n < %d; n++)", ntiles);
  ec_line(&e->core, "const int c = 8 * n + 2 * tq;");
  for (int r = 0; r < 2; r++) {
    ec_enter(&e->core, "if (r%d < %lld)", r, (long long)t);
    if (dk >= 0)
      ec_line(&e->core, "*(float2 *)&%s[(b * %lld + r%d) * %lld + hd * %lld + c] = make_float2(%s * dka[n][%d], "
              "%s * dka[n][%d]);", ptr(e, dk), (long long)t, r, (long long)A->nc, (long long)d, flit(e, A->scale),
              2 * r, flit(e, A->scale), 2 * r + 1);
    if (dv >= 0)
      ec_line(&e->core, "*(float2 *)&%s[(b * %lld + r%d) * %lld + hd * %lld + c] = make_float2(dva[n][%d], "
              "dva[n][%d]);", ptr(e, dv), (long long)t, r, (long long)A->nc, (long long)d, 2 * r, 2 * r + 1);
    ec_leave(&e->core);
  }
  ec_leave(&e->core);
  kend(e, A->nb * A->heads * nkt, 32 * warps);
}

// ATTENTION_BWD siblings, from the forward's log-sum-exp per row (ATTENTION_LSE): D = dout . out per
// row, then dq per query tile and dk, dv per key tile (on tensor cores where att_mma_bwd allows), each
// recomputing the probabilities P = exp(S - lse). bf16: every kernel reads q, k, v and dout rounded,
// dq and dk read dS rounded, dv reads P rounded, D reads dout and out rounded (mdl.h).
static void emit_attention_bwd(Emit *e, int gi) {
  const Group *gr = &e->core.groups[gi];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  int out[3] = {-1, -1, -1};
  for (int i = 0; i < gr->nmem; i++)
    out[ec_node(&e->core, gr->mem[i])->ia[3]] = gr->mem[i];
  Att A = att_of(e, nd);
  A.q = rows_of(e, nd->in[0]);
  A.k = rows_of(e, nd->in[1]);
  A.v = rows_of(e, nd->in[2]);
  A.doc = A.has_doc ? ec_need(&e->core, nd->in[3]) : -1;
  A.dout = rows_of(e, att_bwd_dout(nd));
  A.lse = ec_need(&e->core, att_bwd_lse(nd));
  bool ds = out[0] >= 0 || out[1] >= 0; // dq and dk need dS = P (dP - D); dv only P
  if (ds)
    A.o = rows_of(e, att_bwd_out(nd));
  flush(e);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0 && ec_offset(&e->core, out[i]) < 0)
      e->core.scratch[out[i]] = true;
  int64_t dsum = ds ? scratch_alloc(e, A.nb * A.heads * A.nt * 4) : -1;
  ec_phase_begin(&e->core);
  bool mma = att_mma_bwd(&A);
  if (ds)
    att_dsum_kernel(e, &A, dsum);
  if (out[0] >= 0 && mma) {
    int l = e->nsl;
    att_mma_dq_kernel(e, &A, out[0], dsum, ATT_MMA_DQ_WARPS, -1);
    att_mma_dq_kernel(e, &A, out[0], dsum, att_other_warps(ATT_MMA_DQ_WARPS), l);
  } else if (out[0] >= 0)
    att_query_kernel(e, &A, ATT_DQ, out[0], dsum);
  if ((out[1] >= 0 || out[2] >= 0) && mma) {
    int l = e->nsl;
    att_mma_dkv_kernel(e, &A, out[1], out[2], dsum, ATT_MMA_WARPS, -1);
    att_mma_dkv_kernel(e, &A, out[1], out[2], dsum, att_other_warps(ATT_MMA_WARPS), l);
  } else if (out[1] >= 0 || out[2] >= 0)
    att_key_kernel(e, &A, out[1], out[2], dsum);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0)
      ec_phase_done(&e->core, out[i]);
  ec_phase_end(&e->core);
}

// EMBED: rows of the table by id, four floats at a time when the width allows; a bad id is reported
// and gives a row of zeros.
static void emit_embed(Emit *e, int gi) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t v = ec_node(&e->core, nd->in[0])->shape.d[0], c = ec_last_dim(&e->core, a), rows = ec_numel(&e->core, a) / c;
  int tab = ec_need(&e->core, nd->in[0]), ids = ec_need(&e->core, nd->in[1]);
  flush(e);
  if (ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  int w = c % 4 == 0 ? 4 : 1;
  int64_t cw = c / w, work = rows * cw;
  ec_phase_begin(&e->core);
  kbegin(e, "");
  note(e, "embed: %lld rows of %lld from a table of %lld, %d per thread", (long long)rows, (long long)c,
       (long long)v, w);
  const char *t = w == 4 ? "float4" : "float";
  const char *tp = ptr(e, tab), *ip = ptr(e, ids), *op = ptr(e, a);
  ec_enter(&e->core, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)",
           e->core.ixt, (long long)work);
  ec_line(&e->core, "const %s r = u / %lld, c = u %% %lld;", e->core.ixt, (long long)cw, (long long)cw);
  ec_line(&e->core, "const int32_t id = %s[r];", ip);
  ec_enter(&e->core, "if (id < 0 || id >= %lld)", (long long)v);
  ec_line(&e->core, "if (c == 0)");
  ec_line(&e->core, "  mdl_report(status, MDL_ERR_EMBED_ID, id, %lld);", (long long)v);
  ec_line(&e->core, "reinterpret_cast<%s *>(%s)[u] = %s;", t, op,
          w == 4 ? "make_float4(0.0f, 0.0f, 0.0f, 0.0f)" : "0.0f");
  orelse(e);
  ec_line(&e->core, "reinterpret_cast<%s *>(%s)[u] = reinterpret_cast<const %s *>(%s)[(%s)id * %lld + c];", t, op, t,
          tp, e->core.ixt, (long long)cw);
  ec_leave(&e->core);
  ec_leave(&e->core);
  kend(e, grid_for(work, block_for(work)), block_for(work));
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
    post_inloop(e, a, q, nq, ix, ec_numel(&e->core, a), y);
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

static void emit_embed_bwd(Emit *e, int gi, const bool *emitted) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t v = nd->shape.d[0], c = nd->shape.d[1], rows = ec_numel(&e->core, nd->in[0]);
  int ids = ec_need(&e->core, nd->in[0]), dy = ec_need(&e->core, nd->in[1]);
  flush(e);
  // The chain after it (a tied table's other gradient added, rule 7 of fuse.c) is computed as each
  // element of the table is stored; the table itself is stored only when something else reads it.
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, a), emitted, q);
  bool buf = whole(e, a) || nq == 0;
  if (buf && ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  int vr = EMBED_ROWS, ch = EMBED_CHUNK;
  int64_t nvb = (v + vr - 1) / vr, nch = (rows + ch - 1) / ch, nh = nvb * nch;
  int warps = (int)((c + 31) / 32 < EMBED_WARPS ? (c + 31) / 32 : EMBED_WARPS), cb = 32 * warps;
  int64_t ncb = (c + cb - 1) / cb;
  int64_t cnt = scratch_alloc(e, 4 * nvb), hist = scratch_alloc(e, 4 * nh), start = scratch_alloc(e, 4 * (nvb + 1)),
          pos = scratch_alloc(e, 4 * rows);
  const char *ixt = e->core.ixt;
  ec_phase_begin(&e->core);

  kbegin(e, "zero");
  note(e, "embed backward: the counts of %lld buckets and of each in %lld chunks set to zero", (long long)nvb,
       (long long)nch);
  const char *cp = raw_ptr(e, cnt, "int", "bucket counts");
  const char *hp = raw_ptr(e, hist, "int", "counts by bucket and chunk");
  ec_enter(&e->core, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)", ixt,
           (long long)nh);
  ec_line(&e->core, "%s[u] = 0;", hp);
  ec_line(&e->core, "if (u < %lld)", (long long)nvb);
  ec_line(&e->core, "  %s[u] = 0;", cp);
  ec_leave(&e->core);
  kend(e, grid_for(nh, block_for(nh)), block_for(nh));

  kbegin(e, "count");
  note(e, "embed backward: %lld ids counted by bucket of %d table rows, and by bucket and chunk of %d positions, a "
          "block per chunk", (long long)rows, vr, ch);
  const char *ip = ptr(e, ids);
  cp = raw_ptr(e, cnt, "int", "bucket counts");
  hp = raw_ptr(e, hist, "int", "counts by bucket and chunk");
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
  kend(e, grid_for(nch, 1), ch);

  kbegin(e, "offsets");
  note(e, "embed backward: where each of the %lld buckets starts (prefix sums of the counts), one block",
       (long long)nvb);
  cp = raw_ptr(e, cnt, "int", "bucket counts");
  const char *sp = raw_ptr(e, start, "int", "bucket starts");
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
  kend(e, 1, BLOCK);

  kbegin(e, "place");
  note(e, "embed backward: each position into its bucket's list, after the earlier ones of its bucket, a block per "
          "chunk");
  ip = ptr(e, ids);
  hp = raw_ptr(e, hist, "int", "counts by bucket and chunk");
  sp = raw_ptr(e, start, "int", "bucket starts");
  const char *pp = raw_ptr(e, pos, "int", "positions by bucket");
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
  kend(e, grid_for(nch, 1), ch);

  kbegin(e, "");
  note(e, "embed backward: %lld rows of %lld into a table of %lld; a warp per %d table rows x 32 columns, walking "
          "its bucket's positions in order, %d at a time", (long long)rows, (long long)c, (long long)v, vr, 32);
  e->shared = warps * vr * 32 * 4;
  ec_line(&e->core, "__shared__ float acc[%d][%d][32];", warps, vr);
  ip = ptr(e, ids);
  const char *dp = ptr(e, dy), *tp = buf ? ptr(e, a) : NULL;
  sp = raw_ptr(e, start, "int", "bucket starts");
  pp = raw_ptr(e, pos, "int", "positions by bucket");
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
  e->loop_ix = NULL;
  kend(e, nvb * ncb, cb);
  if (buf)
    ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
  free(q);
}

// ROPE: a thread per (row, head, pair); the angle in double, as the interpreter takes it.
static void emit_rope(Emit *e, int gi) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int64_t rows = s.d[0] * s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads, work = rows * heads * (d / 2);
  Rows x = rows_of(e, nd->in[0]);
  int pos = ec_need(&e->core, nd->in[1]);
  flush(e);
  if (ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  ec_phase_begin(&e->core);
  kbegin(e, "");
  note(e, "rope%s: %lld rows, %lld heads of %lld, a thread per pair", nd->ia[1] ? " (inverse)" : "", (long long)rows,
       (long long)heads, (long long)d);
  const char *xp = rows_base(e, x), *pp = ptr(e, pos), *yp = ptr(e, a);
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
  kend(e, grid_for(work, block_for(work)), block_for(work));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// ATTENTION_MASK ([doc]) -> [B or 1, 1, T, T]: 0 where query i may see key j (j <= i when causal, the
// same doc id with ids), -inf where not; a thread per element.
static void emit_attn_mask(Emit *e, int gi) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  int64_t nt = nd->shape.d[3], work = ec_numel(&e->core, a);
  bool causal = nd->ia[0];
  int doc = nd->ia[1] ? ec_need(&e->core, nd->in[0]) : -1;
  flush(e);
  if (ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  ec_phase_begin(&e->core);
  kbegin(e, "");
  note(e, "attention mask: %lld rows of %lld keys%s%s, a thread per element", (long long)(work / nt), (long long)nt,
       causal ? ", causal" : "", doc >= 0 ? ", within documents" : "");
  const char *dp = doc >= 0 ? ptr(e, doc) : NULL, *yp = ptr(e, a);
  ec_enter(&e->core, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)",
           e->core.ixt, (long long)work);
  ec_line(&e->core, "const %s r = u / %lld, i = r %% %lld, j = u %% %lld;", e->core.ixt, (long long)nt, (long long)nt,
          (long long)nt);
  Buf cond = {0};
  ec_bput(&cond, "%s", causal ? "j <= i" : "");
  if (doc >= 0) // (r - i: the row's first position)
    ec_bput(&cond, "%s%s[r - i + j] == %s[r]", causal ? " && " : "", dp, dp);
  ec_line(&e->core, "%s[u] = %s ? 0.0f : -MDL_INF;", yp, cond.len ? ec_buf_str(&e->core, &cond) : "true");
  ec_leave(&e->core);
  kend(e, grid_for(work, block_for(work)), block_for(work));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// MAX_BWD (x, y, dy): the gradient goes to the maxima, shared evenly between ties; a thread per output.
static void emit_max_bwd(Emit *e, int gi) {
  int a = e->core.groups[gi].mem[0];
  const IrNode *nd = ec_node(&e->core, a);
  Shape s = nd->shape;
  int ax = (int)nd->ia[0];
  int64_t outer = ec_span(s, 0, ax), len = s.d[ax], inner = ec_span(s, ax + 1, s.rank), on = outer * inner;
  int x = ec_need(&e->core, nd->in[0]), y = ec_need(&e->core, nd->in[1]), dy = ec_need(&e->core, nd->in[2]);
  flush(e);
  if (ec_offset(&e->core, a) < 0)
    e->core.scratch[a] = true;
  ec_phase_begin(&e->core);
  kbegin(e, "");
  note(e, "max backward: %lld outputs over %lld elements, a thread per output", (long long)on, (long long)len);
  const char *xp = ptr(e, x), *yp = ptr(e, y), *dp = ptr(e, dy), *op = ptr(e, a);
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
  kend(e, grid_for(on, block_for(on)), block_for(on));
  ec_phase_done(&e->core, a);
  ec_phase_end(&e->core);
}

// The optimizer's segments: a table at file scope named `name`, or, for one segment, a local array
// from the kernel's arguments (so that the kernels of equal segments are the same text). Entries are
// {p, g, m, v, c, n, start, wd}; nodes -1 stand for fields left 0 (p, g, m, v) or -1 (c: no copy).
static void seg_table(Emit *e, const char *name, int nseg, const int (*nodes)[5], const int64_t *n,
                      const double *wd) {
  if (nseg == 1) {
    const char *f[5];
    for (int k = 0; k < 5; k++)
      f[k] = nodes[0][k] >= 0 ? offset_arg(e, nodes[0][k]) : k == 4 ? "-1" : "0";
    ec_line(&e->core, "const MdlSeg seg[1] = {{%s, %s, %s, %s, %s, %lld, 0, %s}};", f[0], f[1], f[2], f[3], f[4],
            (long long)n[0], ec_dlit(&e->core, wd[0]));
    return;
  }
  Buf b = {0};
  ec_bput(&b, "static __device__ const MdlSeg %s[%d] = {\n", name, nseg);
  int64_t start = 0;
  for (int s = 0; s < nseg; s++) {
    ec_bput(&b, "    {");
    for (int k = 0; k < 5; k++)
      ec_bput(&b, "%lld, ", nodes[s][k] >= 0 ? (long long)buf_off(e, nodes[s][k]) : k == 4 ? -1LL : 0LL);
    const char *pname = ec_node(&e->core, nodes[s][0])->name;
    ec_bput(&b, "%lld, %lld, %s}, // %s\n", (long long)n[s], (long long)start, ec_dlit(&e->core, wd[s]),
            pname ? pname : "");
    start += n[s];
  }
  ec_bput(&b, "};\n\n");
  e->table = ec_buf_str(&e->core, &b);
  ec_line(&e->core, "const MdlSeg *const seg = %s;", name);
}

// Opens the loop over the segments that meet this block's chunk [c0, c1) of the concatenated
// segments: the first found by bisection over their starts, the loop ending at the first that starts
// past the chunk; [lo, hi): the chunk's elements of segment s, as indices into it. (A loop over every segment, in every thread, read GPT-2's 148-entry table a
// thousand times per thread, for 32 elements: the optimizer took 3.6 ms a step on an H200.)
static void seg_open(Emit *e, int nseg, int64_t total) {
  ec_line(&e->core, "const int64_t c0 = (int64_t)blockIdx.x * %d, c1 = c0 + %d < %lld ? c0 + %d : %lld;", OPT_CHUNK,
          OPT_CHUNK, (long long)total, OPT_CHUNK, (long long)total);
  ec_line(&e->core, "int s0 = 0;");
  ec_line(&e->core, "for (int s1 = %d; s0 < s1;) { // the last segment starting at or before c0", nseg - 1);
  ec_line(&e->core, "  const int mid = (s0 + s1 + 1) / 2;");
  ec_line(&e->core, "  if (seg[mid].start <= c0) s0 = mid; else s1 = mid - 1;");
  ec_line(&e->core, "}");
  ec_enter(&e->core, "for (int s = s0; s < %d && seg[s].start < c1; s++)", nseg);
  ec_line(&e->core, "const int64_t lo = (c0 > seg[s].start ? c0 : seg[s].start) - seg[s].start;");
  ec_line(&e->core, "const int64_t hi = (c1 < seg[s].start + seg[s].n ? c1 : seg[s].start + seg[s].n) - "
                    "seg[s].start;");
}

// The loop over this block's chunk of the concatenated segments: opens the loop over segments
// (seg_open) and the loop over the chunk's elements of segment s, OPT_SUMSQ_LOADS of a thread's from k.
static void seg_loop(Emit *e, int nseg, int64_t total) {
  seg_open(e, nseg, total);
  ec_enter(&e->core, "for (int64_t k = lo + threadIdx.x; k < hi; k += %d * blockDim.x)", OPT_SUMSQ_LOADS);
}

// GRAD_NORM (a sum of squares per fixed chunk of the concatenated gradients, then one block adding the
// chunks in order) and AdamW over tables of parameter segments, in double per element like the
// interpreter; p, m and v in place.
static void emit_optimizer(Emit *e, int gi) {
  const Group *gr = &e->core.groups[gi];
  for (int i = 0; i < gr->nmem; i++)
    if (ec_node(&e->core, gr->mem[i])->op == OP_GRAD_NORM) {
      const IrNode *nd = ec_node(&e->core, gr->mem[i]);
      for (int k = 0; k < nd->nin; k++)
        ec_need(&e->core, nd->in[k]);
    }
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = ec_node(&e->core, gr->mem[i]);
    if (nd->op != OP_ADAMW)
      continue;
    for (int k = 1; k < 7; k++)
      if (k != 4 || e->core.grp[ec_canon(&e->core, nd->in[4])] != gi)
        ec_need(&e->core, nd->in[k]);
  }
  flush(e);
  ec_phase_begin(&e->core);
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = ec_node(&e->core, gr->mem[i]);
    if (nd->op != OP_GRAD_NORM)
      continue;
    int gn = gr->mem[i];
    if (ec_offset(&e->core, gn) < 0)
      e->core.scratch[gn] = true;
    int (*nodes)[5] = ec_xcalloc((size_t)nd->nin, sizeof *nodes);
    int64_t *n = ec_xcalloc((size_t)nd->nin, sizeof *n), total = 0;
    double *wd = ec_xcalloc((size_t)nd->nin, sizeof *wd);
    for (int k = 0; k < nd->nin; k++) {
      nodes[k][0] = ec_need(&e->core, nd->in[k]);
      nodes[k][1] = nodes[k][2] = nodes[k][3] = nodes[k][4] = -1;
      n[k] = ec_numel(&e->core, nd->in[k]);
      total += n[k];
    }
    int64_t nb = (total + OPT_CHUNK - 1) / OPT_CHUNK, part = scratch_alloc(e, nb * 8);
    kbegin(e, "sumsq");
    note(e, "gradient norm: sums of squares of %d tensors, %lld values, in %lld chunks of %d", nd->nin,
         (long long)total, (long long)nb, OPT_CHUNK);
    seg_table(e, ec_str(&e->core, "%s_grads", e->sname), nd->nin, (const int(*)[5])nodes, n, wd);
    const char *pp = raw_ptr(e, part, "double", "sums of squares per chunk");
    ec_line(&e->core, "double acc = 0;");
    seg_loop(e, nd->nin, total);
    // (OPT_SUMSQ_LOADS loads a thread in flight, the values added in the order of a loop of one load,
    // which the compiler had left as it was)
    ec_line(&e->core, "const float *const gs = (const float *)(arena + seg[s].p);");
    ec_line(&e->core, "float x[%d];", OPT_SUMSQ_LOADS);
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int u = 0; u < %d; u++)", OPT_SUMSQ_LOADS);
    ec_line(&e->core, "  x[u] = k + u * blockDim.x < hi ? gs[k + u * blockDim.x] : 0.0f;");
    ec_line(&e->core, "#pragma unroll");
    ec_line(&e->core, "for (int u = 0; u < %d; u++)", OPT_SUMSQ_LOADS);
    ec_line(&e->core, "  acc += (double)x[u] * x[u];");
    ec_leave(&e->core);
    ec_leave(&e->core);
    ec_line(&e->core, "acc = mdl_block_sum(acc, %s);", sh_double(e));
    ec_line(&e->core, "if (threadIdx.x == 0)");
    ec_line(&e->core, "  %s[blockIdx.x] = acc;", pp);
    kend(e, nb, BLOCK);
    kbegin(e, "norm");
    note(e, "gradient norm: the %lld chunks added in order by one block", (long long)nb);
    pp = raw_ptr(e, part, "double", "sums of squares per chunk");
    ec_line(&e->core, "double acc = 0;");
    ec_line(&e->core, "for (int64_t k = threadIdx.x; k < %lld; k += blockDim.x)", (long long)nb);
    ec_line(&e->core, "  acc += %s[k];", pp);
    ec_line(&e->core, "acc = mdl_block_sum(acc, %s);", sh_double(e));
    ec_line(&e->core, "if (threadIdx.x == 0)");
    ec_line(&e->core, "  %s[0] = (float)sqrt(acc);", ptr(e, gn));
    kend(e, 1, BLOCK);
    ec_phase_done(&e->core, gn);
    free(nodes);
    free(n);
    free(wd);
  }
  // ADAMWs that share hyperparameters and scalars run over one table.
  bool *done = ec_xcalloc((size_t)gr->nmem, sizeof *done);
  for (int i = 0, table = 0; i < gr->nmem; i++) {
    const IrNode *a = ec_node(&e->core, gr->mem[i]);
    if (done[i] || a->op != OP_ADAMW)
      continue;
    int *seg = ec_xcalloc((size_t)gr->nmem, sizeof *seg), ns = 0;
    int64_t total = 0;
    for (int j = i; j < gr->nmem; j++) {
      const IrNode *b = ec_node(&e->core, gr->mem[j]);
      if (done[j] || b->op != OP_ADAMW || memcmp(a->fa, b->fa, sizeof(double) * 3) || a->fa[4] != b->fa[4])
        continue;
      bool same = true;
      for (int k = 4; k < 7; k++)
        same &= ec_canon(&e->core, a->in[k]) == ec_canon(&e->core, b->in[k]);
      if (!same)
        continue;
      done[j] = true;
      seg[ns++] = gr->mem[j];
      total += ec_numel(&e->core, gr->mem[j]);
    }
    int (*nodes)[5] = ec_xcalloc((size_t)ns, sizeof *nodes);
    int ncopies = 0;
    int64_t *n = ec_xcalloc((size_t)ns, sizeof *n);
    double *wd = ec_xcalloc((size_t)ns, sizeof *wd);
    for (int j = 0; j < ns; j++) {
      const IrNode *u = ec_node(&e->core, seg[j]);
      for (int k = 0; k < 4; k++) {
        nodes[j][k] = ec_canon(&e->core, u->in[k]);
        if (ec_offset(&e->core, nodes[j][k]) < 0)
          ec_fail(&e->core, "adamw %d: parameter, gradient or moments not in memory", seg[j]);
      }
      if (ec_offset(&e->core, seg[j]) >= 0 && ec_offset(&e->core, seg[j]) != ec_offset(&e->core, nodes[j][0]))
        ec_fail(&e->core, "adamw %d: the new parameter is not written in place", seg[j]);
      nodes[j][4] = e->core.f->copy_of[nodes[j][0]];
      ncopies += nodes[j][4] >= 0;
      n[j] = ec_numel(&e->core, seg[j]);
      wd[j] = u->fa[3];
    }
    int gnorm = ec_need(&e->core, a->in[4]), lr = ec_need(&e->core, a->in[5]), step = ec_need(&e->core, a->in[6]);
    kbegin(e, table ? ec_str(&e->core, "%d", table + 1) : "");
    note(e, "AdamW over %d parameters, %lld values (beta1 %g, beta2 %g, eps %g, clip %g), chunks of %d%s", ns,
         (long long)total, a->fa[0], a->fa[1], a->fa[2], a->fa[4], OPT_CHUNK,
         ncopies ? ec_str(&e->core, "; %d bf16 copies", ncopies) : "");
    seg_table(e, ec_str(&e->core, "%s_seg%s", e->sname, table ? ec_str(&e->core, "%d", table + 1) : ""), ns,
              (const int(*)[5])nodes, n, wd);
    ec_line(&e->core, "const double clip = %s, gnorm = %s[0];", ec_dlit(&e->core, a->fa[4]), ptr(e, gnorm));
    // A non-finite loss or gradient norm leaves p, m and v as they were, as the C back end does: the
    // runtime reads the same two values after the step and stops or skips it (train.c).
    int loss = e->core.f->g->loss >= 0 ? ec_need(&e->core, e->core.f->g->loss) : -1;
    ec_line(&e->core, "if (!isfinite(gnorm)%s)", loss >= 0 ? ec_str(&e->core, " || !isfinite(%s[0])", ptr(e, loss)) : "");
    ec_line(&e->core, "  return;");
    ec_line(&e->core, "const double sc = clip > 0 ? fmin(1.0, clip / (gnorm + 1e-6)) : 1.0;");
    ec_line(&e->core, "const double lr = %s[0], step = %s[0];", ptr(e, lr), ptr(e, step));
    ec_line(&e->core, "const double beta1 = %s, beta2 = %s, eps = %s;", ec_dlit(&e->core, a->fa[0]),
            ec_dlit(&e->core, a->fa[1]), ec_dlit(&e->core, a->fa[2]));
    ec_line(&e->core, "const MdlAdamW h = {sc, lr, beta1, beta2, eps, 1.0 / (1.0 - pow(beta1, step)), "
            "1.0 / (1.0 - pow(beta2, step))};");
    // Four elements a float4, OPT_UNROLL float4s of g, m, v and p loaded before any is updated: the
    // stores of one element may alias the loads of the next as far as the compiler knows, so one at
    // a time a thread would keep a single element's loads in flight and the kernel would wait on
    // memory. Buffers start 64-byte aligned; where a chunk or segment does not start or end at a
    // multiple of 4, up to 3 elements at each end go one a thread.
    seg_open(e, ns, total);
    ec_line(&e->core, "float *p = (float *)(arena + seg[s].p), *m = (float *)(arena + seg[s].m);");
    ec_line(&e->core, "float *v = (float *)(arena + seg[s].v);");
    ec_line(&e->core, "const float *g = (const float *)(arena + seg[s].g);");
    ec_line(&e->core, "const double wd = seg[s].wd;");
    if (ncopies)
      ec_line(&e->core, "uint16_t *const cp = seg[s].c >= 0 ? (uint16_t *)(arena + seg[s].c) : NULL;");
    ec_line(&e->core, "const int64_t lo4 = (lo + 3) / 4 * 4, hi4 = hi / 4 * 4 > lo4 ? hi / 4 * 4 : lo4;");
    ec_enter(&e->core, "if (threadIdx.x < 8)");
    ec_line(&e->core, "const int64_t k = threadIdx.x < 4 ? lo + threadIdx.x : hi4 + threadIdx.x - 4;");
    ec_enter(&e->core, "if (k < hi && (threadIdx.x >= 4 || k < lo4))");
    ec_line(&e->core, "float mk = m[k], vk = v[k];");
    ec_line(&e->core, "const float pk = mdl_adamw(h, wd, g[k], mk, vk, p[k]);");
    ec_line(&e->core, "m[k] = mk, v[k] = vk, p[k] = pk;");
    if (ncopies) {
      ec_line(&e->core, "if (cp)");
      ec_line(&e->core, "  cp[k] = mdl_f32_to_bf16(pk);");
    }
    ec_leave(&e->core);
    ec_leave(&e->core);
    ec_enter(&e->core, "for (int64_t k0 = lo4 / 4 + threadIdx.x; k0 < hi4 / 4; k0 += %d * blockDim.x)", OPT_UNROLL);
    ec_line(&e->core, "float4 gv[%d], mv[%d], vv[%d], pv[%d];", OPT_UNROLL, OPT_UNROLL, OPT_UNROLL, OPT_UNROLL);
    ec_line(&e->core, "#pragma unroll");
    ec_enter(&e->core, "for (int u = 0; u < %d; u++)", OPT_UNROLL);
    ec_line(&e->core, "const int64_t q = k0 + u * blockDim.x;");
    ec_line(&e->core, "gv[u] = mv[u] = vv[u] = pv[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);");
    ec_line(&e->core, "if (q < hi4 / 4)");
    ec_line(&e->core, "  gv[u] = ((const float4 *)g)[q], mv[u] = ((float4 *)m)[q], vv[u] = ((float4 *)v)[q], "
                      "pv[u] = ((float4 *)p)[q];");
    ec_leave(&e->core);
    ec_line(&e->core, "#pragma unroll");
    ec_enter(&e->core, "for (int u = 0; u < %d; u++)", OPT_UNROLL);
    ec_line(&e->core, "const int64_t q = k0 + u * blockDim.x;");
    ec_line(&e->core, "if (q >= hi4 / 4)");
    ec_line(&e->core, "  break;");
    ec_line(&e->core, "float4 &mq = mv[u], &vq = vv[u], &pq = pv[u];");
    ec_line(&e->core, "pq.x = mdl_adamw(h, wd, gv[u].x, mq.x, vq.x, pq.x);");
    ec_line(&e->core, "pq.y = mdl_adamw(h, wd, gv[u].y, mq.y, vq.y, pq.y);");
    ec_line(&e->core, "pq.z = mdl_adamw(h, wd, gv[u].z, mq.z, vq.z, pq.z);");
    ec_line(&e->core, "pq.w = mdl_adamw(h, wd, gv[u].w, mq.w, vq.w, pq.w);");
    ec_line(&e->core, "((float4 *)m)[q] = mq, ((float4 *)v)[q] = vq, ((float4 *)p)[q] = pq;");
    if (ncopies) {
      ec_line(&e->core, "if (cp)");
      ec_line(&e->core, "  ((ushort4 *)cp)[q] = make_ushort4(mdl_f32_to_bf16(pq.x), mdl_f32_to_bf16(pq.y), "
                        "mdl_f32_to_bf16(pq.z), mdl_f32_to_bf16(pq.w));");
    }
    ec_leave(&e->core);
    ec_leave(&e->core);
    ec_leave(&e->core);
    kend(e, (total + OPT_CHUNK - 1) / OPT_CHUNK, BLOCK);
    for (int j = 0; j < ns; j++)
      ec_phase_done(&e->core, seg[j]);
    free(seg);
    free(nodes);
    free(n);
    free(wd);
    table++;
  }
  free(done);
  ec_phase_end(&e->core);
}

static void emit_group(Emit *e, int gi, const bool *emitted) {
  const Group *gr = &e->core.groups[gi];
  switch (gr->kind) {
  case G_NORM_BWD: emit_norm_bwd(e, gi, emitted); return;
  case G_ATTN: emit_attention(e, gi); return;
  case G_ATTN_BWD: emit_attention_bwd(e, gi); return;
  case G_CE: emit_ce(e, gi); return;
  case G_LMHEAD: emit_lmhead(e, gi); return;
  case G_OPT: emit_optimizer(e, gi); return;
  case G_SINGLE: break;
  }
  Op op = ec_node(&e->core, gr->mem[0])->op;
  switch (op) {
  case OP_MATMUL: emit_gemm(e, gi, emitted); return;
  case OP_SUM: case OP_MEAN: case OP_MAX: case OP_TARGET_COUNT: emit_reduce(e, gi, emitted); return;
  case OP_LAYERNORM: case OP_RMSNORM: emit_norm_fwd(e, gi, emitted); return;
  case OP_SOFTMAX: case OP_SOFTMAX_BWD: emit_softmax(e, gi, emitted); return;
  case OP_EMBED: emit_embed(e, gi); return;
  case OP_EMBED_BWD: emit_embed_bwd(e, gi, emitted); return;
  case OP_ROPE: emit_rope(e, gi); return;
  case OP_MAX_BWD: emit_max_bwd(e, gi); return;
  case OP_ATTENTION_MASK: emit_attn_mask(e, gi); return;
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
  Emit e = {.core = {.f = f, .m = m, .g = g, .a = arena_new(), .val = core_val, .seed = core_seed, .base = core_base}};
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

  int64_t scratch = align_up(m->arena_bytes, SCRATCH_ALIGN);
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
