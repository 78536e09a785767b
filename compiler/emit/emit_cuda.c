// emit_cuda.c: the CUDA emitter. It turns the step plan (a Fusion and its MemPlan) into one CUDA C++
// translation unit for NVRTC (a prelude of our own, the pieces in runtime/kernels/, no #include) and a schedule
// (CudaPlan): the kernel launches and cuBLASLt GEMMs of one training step, in order. This file holds
// the module, its steps and their launch plan, and GEMMs with their epilogues; the kernel families are
// in emit_cuda_rows.c, emit_cuda_lmhead.c, emit_cuda_attn.c and emit_cuda_opt.c, built with the
// toolkit of emit_cuda_kit.c (kernels and their buffers, the inline evaluator, elementwise kernels,
// row shapes); emit_common.h lists them, emit_cuda_impl.h is what they share.
//
// Design. The emitter mirrors emit_c.c: the same split of a step's nodes into anchors (ops that need
// a kernel shape of their own) and pointwise nodes, evaluated inline at any flat index by the same
// evaluator (emit_walk.c's ew_val) through their index maps; the same groups of anchors (norm backward siblings,
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
// the optimizer) are templates in runtime/kernels/ (cuda_attention.cuh, cuda_ce.cuh, cuda_opt.cuh): their kernels here declare their buffers and
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
#include "emit_walk.h"
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

static void emit_gemm(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  EwGemm g;
  ew_gemm_shape(&e->core, gi, &g);
  Rows a, b;
  if (g.so.rank == 2) {
    a = cu_rows_of(e, g.nd->in[0]);
    b = cu_rows_of(e, g.nd->in[1]);
  } else {
    a = (Rows){ec_need(&e->core, g.nd->in[0]), 0, g.sa.d[g.sa.rank - 1]};
    b = (Rows){ec_need(&e->core, g.nd->in[1]), 0, g.sb.d[g.sb.rank - 1]};
  }
  ew_flush(&e->core);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, g.mm), e->core.emitted, q);
  int out = g.mm, bias = -1, aux = -1, resid = -1, cast = bf16_result(e, g.mm, g.n);
  CudaEpilogue epi = CUDA_EPI_NONE;
  DType ab = ec_node(&e->core, a.node)->dtype, ct = cast >= 0 ? DT_BF16 : DT_F32;
  bool fp8 = ab == DT_F8E4M3 || ab == DT_F8E5M2;
  // (an fp8 GEMM takes no epilogue: cuBLASLt's FP8 kernels with an f32 D want a bf16 bias, and ours
  // is f32; the bias, GELU and residual run in the kernel after it, as a batched GEMM's do)
  if (cast >= 0)
    out = cast;
  else if (g.batches == 1 && !fp8)
    epi = epilogue_of(e, g.mm, g.n, &out, &bias, &aux, &resid);
  if (out == g.mm)
    ew_gemm_place(&e->core, g.mm, q, nq);
  int64_t sab = dtype_size(ab), sc = dtype_size(ct); // (fp8: one byte, A's and B's)
  CudaGemm gm = {.ab = ab, .c_type = ct, .ta = g.ta, .tb = g.tb, .m = g.m, .n = g.n, .k = g.k, .lda = a.stride,
                 .ldb = b.stride, .ldc = g.n, .batch = 1, .a = cu_buf_off(e, a.node) + sab * a.at,
                 .b = cu_buf_off(e, b.node) + sab * b.at, .c = cu_buf_off(e, out), .epilogue = epi,
                 .bias = bias >= 0 ? cu_buf_off(e, bias) : -1, .aux = aux >= 0 ? cu_buf_off(e, aux) : -1,
                 .beta = resid >= 0 ? 1.0f : 0.0f, .c_apart = resid >= 0, .cin = resid >= 0 ? cu_buf_off(e, resid) : 0,
                 .b_fp8 = fp8 ? ec_node(&e->core, b.node)->dtype : DT_F32,
                 .a_scale = fp8 ? e->fp8 + 4 * (e->core.g->nfp8 + g.nd->ia[2]) : 0,
                 .b_scale = fp8 ? e->fp8 + 4 * (e->core.g->nfp8 + g.nd->ia[3]) : 0};
  ec_phase_begin(&e->core);
  if (g.batches > 1) {
    Shape ob = g.so;
    ob.rank -= 2;
    int64_t s1 = batch_stride(g.sa, ob, g.m * g.k), s2 = batch_stride(g.sb, ob, g.k * g.n);
    if (s1 >= 0 && s2 >= 0) {
      gm.batch = g.batches, gm.stride_a = s1, gm.stride_b = s2, gm.stride_c = g.m * g.n;
      cu_gemm_add(e, gm);
    } else {
      Shape ba = g.sa, bb = g.sb;
      ba.rank -= 2, bb.rank -= 2;
      CudaGemm one = gm;
      for (int64_t t = 0; t < g.batches; t++) {
        one.a = gm.a + sab * shape_bcast_offset(ob, ba, t) * g.m * g.k;
        one.b = gm.b + sab * shape_bcast_offset(ob, bb, t) * g.k * g.n;
        one.c = gm.c + sc * t * g.m * g.n;
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
  nq = ec_post_set(&e->core, gi, ec_numel(&e->core, g.mm), e->core.emitted, q);
  if (nq && !ec_reduction_after(&e->core, gi, e->core.emitted, ec_numel(&e->core, g.mm)))
    cu_pw_loop(&e->core, q, nq, ec_numel(&e->core, g.mm), g.mm, "epilogue");
  free(q);
}

//
// Steps.
//

// The CUDA target's part of a pass's reset (emit_walk.c resets the rest).
static void pass_reset(EmitCore *core) {
  Emit *e = (Emit *)core;
  for (int i = 0; i < core->g->n; i++)
    e->soff[i] = -1;
  e->stop = 0;
  e->nkt = e->nsl = e->nsg = 0;
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
  ew_step_head(&e->core, &e->out, e->sname);
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

// The CUDA target: its hooks and its kernel families.
static const EmitTarget cuda_target = {
    .narrow_ix = true, .seed = cu_seed, .base = cu_base, .fp8_cast = cu_fp8_cast, .local = cu_local,
    .lanes = cu_lanes, .store = cu_store, .pw_loop = cu_pw_loop, .pass_reset = pass_reset,
    .kernel = {[EK_GEMM] = emit_gemm, [EK_REDUCE] = cu_emit_reduce, [EK_NORM_FWD] = cu_emit_norm_fwd,
               [EK_NORM_BWD] = cu_emit_norm_bwd, [EK_SOFTMAX] = cu_emit_softmax, [EK_EMBED] = cu_emit_embed,
               [EK_EMBED_BWD] = cu_emit_embed_bwd, [EK_ROPE] = cu_emit_rope, [EK_MAX_BWD] = cu_emit_max_bwd,
               [EK_TOPK] = cu_emit_topk, [EK_GATHER] = cu_emit_gather, [EK_SCATTER] = cu_emit_scatter,
               [EK_ATTN_MASK] = cu_emit_attn_mask, [EK_ATTENTION] = cu_emit_attention,
               [EK_ATTENTION_BWD] = cu_emit_attention_bwd, [EK_CE] = cu_emit_ce, [EK_LMHEAD] = cu_emit_lmhead,
               [EK_OPTIMIZER] = cu_emit_optimizer},
};

CudaPlan *emit_cuda_plan(const Fusion *f, const MemPlan *m, const char *source_path) {
  const Graph *g = f->g;
  size_t n = (size_t)g->n;
  Emit e = {0};
  ew_open(&e.core, &cuda_target, f, m);
  e.soff = ec_xcalloc(n, sizeof *e.soff);
  e.slot_of = ec_xcalloc(n, sizeof *e.slot_of);
  for (size_t i = 0; i < n; i++)
    e.slot_of[i] = -1;
  build_users(&e);

  e.fp8 = cu_align_up(m->arena_bytes, SCRATCH_ALIGN);
  int64_t scratch = e.scratch0 = g->nfp8 ? cu_align_up(e.fp8 + 12 * (int64_t)g->nfp8, SCRATCH_ALIGN) : e.fp8;
  ec_bput(&e.out, "// Generated by mdlc %s from %s: do not edit.\n", MDL_VERSION, source_path ? source_path : "?");
  ec_bput(&e.out, "// Model %s: one training step (forward, backward, AdamW) as %d steps on one device arena:\n",
          g->model ? g->model : "?", f->nsteps);
  ec_bput(&e.out, "//   the memory plan's part   %lld bytes\n", (long long)m->arena_bytes);
  ec_bput(&e.out, "//   params, grads, m, v at   %lld, %lld, %lld, %lld (%lld bytes each)\n", (long long)m->params,
          (long long)m->grads, (long long)m->m, (long long)m->v, (long long)m->param_bytes);
  ec_bput(&e.out, "//   step-local scratch from  %lld\n", (long long)scratch);
  ec_bput(&e.out,
          "// NVRTC compiles this file; runtime/engine/cuda.c runs the launches each step's comment lists (kernels,\n");
  ec_bput(&e.out,
          "// and GEMMs through cuBLASLt), every kernel with (arena, status, seed, chunk, the byte offsets of\n");
  ec_bput(&e.out, "// its buffers).\n\n");
  ec_bput(&e.out, "%s", ec_prelude_cuda);
  ec_grow(&e.units, e.nunits, &e.capunits, sizeof *e.units);
  e.units[e.nunits++] = (CudaUnit){e.out.len, strlen(accumulate_kernel)};
  ec_bput(&e.out, "%s", accumulate_kernel);

  const char **names = ec_xcalloc((size_t)f->nsteps + 1, sizeof *names);
  for (int si = 0; si < f->nsteps; si++) {
    names[si] = e.sname = ew_kernel_name(&e.core, f->steps[si].name, si, names);
    if (!ew_step(&e.core, si))
      break;
    commit_step(&e);
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
  free(e.notes.s);
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
  free(e.soff);
  free(e.slot_of);
  ew_close(&e.core);
  return plan;
}

char *emit_cuda(const Fusion *f, const MemPlan *m, const char *source_path) {
  CudaPlan *p = emit_cuda_plan(f, m, source_path);
  return p ? (char *)p->source : NULL;
}
