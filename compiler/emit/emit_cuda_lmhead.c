// emit_cuda_lmhead.c: the CUDA emitter's cross-entropy and LM head (the logits GEMMs and the loss in
// chunks of rows). See emit_cuda.c for the design.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_cuda.h"
#include "emit_cuda_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// One row of cross-entropy inside a row group: mdl_ce_row (runtime/kernels/cuda_ce.cuh) on the logits row at
// x (a pointer expression: its type says f32 or bf16), the target tg, the loss into loss (an element,
// or NULL), dloss times (softmax - onehot) into the row at dx (NULL: none; may be x itself) with dloss
// an element; vw logits a load (ce_width).
static void ce_row(Emit *e, const RowShape *rs, int64_t v, const char *x, const char *tg, const char *loss,
                   const char *dx, const char *dloss, int vw) {
  const char *sh_f = rs->tpr == 32 ? "nullptr" : cu_sh_float(e), *sh_d = rs->tpr == 32 ? "nullptr" : cu_sh_double(e);
  ec_line(&e->core, "mdl_ce_row<%s, %lld, %d, %d, %s, %s>(%s, %s, %s, %s, %s, status, tr, %s, %s);", e->core.ixt,
          (long long)v, rs->tpr, vw, loss ? "true" : "false", dx ? "true" : "false", x, dx ? dx : "(float *)nullptr",
          tg, loss ? ec_str(&e->core, "&%s", loss) : "nullptr", dloss ? ec_str(&e->core, "&%s", dloss) : "nullptr",
          sh_f, sh_d);
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
static RowShape ce_shape(Emit *e, int64_t v, int64_t rows) { return cu_row_shape(e, v, rows, 64); }

// CROSS_ENTROPY and / or CROSS_ENTROPY_BWD over the same logits: one pass per row.
void cu_emit_ce(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  const Group *gr = &e->core.groups[gi];
  int ce = -1, ceb = -1;
  for (int i = 0; i < gr->nmem; i++)
    *(ec_node(&e->core, gr->mem[i])->op == OP_CROSS_ENTROPY ? &ce : &ceb) = gr->mem[i];
  const IrNode *nd = ec_node(&e->core, gr->mem[0]);
  int64_t v = ec_last_dim(&e->core, nd->in[0]), rows = ec_numel(&e->core, nd->in[1]);
  int lg = ec_need(&e->core, nd->in[0]), tg = ec_need(&e->core, nd->in[1]),
      dl = ceb >= 0 ? ec_need(&e->core, ec_node(&e->core, ceb)->in[2]) : -1;
  ew_outputs_open(&e->core, gr->mem, gr->nmem);
  RowShape rs = ce_shape(e, v, rows);
  cu_kbegin(e, "");
  cu_note(e, "cross-entropy%s: %lld rows of %lld, %s per row",
          ceb >= 0 ? (ce >= 0 ? " and its gradient" : " gradient") : "", (long long)rows, (long long)v,
          cu_rs_who(e, &rs));
  cu_rows_open(e, &rs, "r");
  ce_row(e, &rs, v, ec_str(&e->core, "%s + r * %lld", cu_ptr(e, lg), (long long)v),
         ec_str(&e->core, "%s[r]", cu_ptr(e, tg)), ce >= 0 ? ec_str(&e->core, "%s[r]", cu_ptr(e, ce)) : NULL,
         ceb >= 0 ? ec_str(&e->core, "%s + r * %lld", cu_ptr(e, ceb), (long long)v) : NULL,
         dl >= 0 ? ec_str(&e->core, "%s[r]", cu_ptr(e, dl)) : NULL,
         ce_width(v, (int)dtype_size(ec_node(&e->core, lg)->dtype), ceb >= 0 ? 4 : 0));
  ec_leave(&e->core);
  cu_kend(e, rs.grid, rs.block);
  ew_outputs_done(&e->core, gr->mem, gr->nmem);
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
void cu_emit_lmhead(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  const Group *gr = &e->core.groups[gi];
  const IrNode *xm = ec_node(&e->core, gr->x);
  int64_t n = xm->shape.d[0], c = xm->shape.d[1], v = ec_last_dim(&e->core, gr->mm);
  bool bwd = gr->ceb >= 0; // (a graph without a backward: the logits GEMM and the loss alone)
  int x = ec_need(&e->core, gr->x), w = ec_need(&e->core, gr->w), tg = ec_need(&e->core, gr->tgt),
      dl = bwd ? ec_need(&e->core, gr->dloss) : -1;
  ew_flush(&e->core);
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
  int64_t ldw = gr->tb ? c : v, logits = cu_scratch_alloc(e, rc * vp * (l16 ? 2 : 4));
  int64_t grads = d16 && !l16 ? cu_scratch_alloc(e, rc * vp * 2) : logits, sab = dtype_size(ab);
  int64_t ox = cu_buf_off(e, x), ow = cu_buf_off(e, w), odx = bwd ? cu_buf_off(e, gr->dx) : -1,
          odw = bwd ? cu_buf_off(e, gr->dw) : -1;
  RowShape rs = ce_shape(e, v, rc);
  ec_phase_begin(&e->core);
  int kt = -1;
  for (int64_t r0 = 0; r0 < n; r0 += rc) {
    int64_t rn = n - r0 < rc ? n - r0 : rc;
    cu_gemm_add(e, (CudaGemm){.ab = ab, .c_type = l16 ? DT_BF16 : DT_F32, .ta = 0, .tb = gr->tb, .m = rn, .n = vn,
                              .k = c, .lda = c, .ldb = ldw, .ldc = vp, .batch = 1, .a = ox + sab * r0 * c, .b = ow,
                              .c = logits, .bias = -1, .aux = -1});
    int64_t grid = (rn + rs.rpb - 1) / rs.rpb;
    if (kt < 0) {
      cu_kbegin(e, "ce");
      cu_note(e, "LM head: cross-entropy%s of a chunk of at most %lld rows of %lld classes (rows %lld "
                 "apart), %s; chunk = its first row; %s per row", bwd ? " and its gradient" : "", (long long)rc,
              (long long)v, (long long)vp,
              !bwd ? (l16 ? "bf16 logits" : "f32 logits")
              : l16 ? "bf16 logits, the gradient rounded to bf16 in place"
              : d16 ? "the gradient rounded to bf16 into a chunk of its own" : "in place", cu_rs_who(e, &rs));
      const char *lp = cu_raw_ptr(e, logits, l16 ? "uint16_t" : "float",
                                  l16 ? "the chunk's logits, bf16" : "the chunk's logits");
      const char *gp = d16 && !l16 ? cu_raw_ptr(e, grads, "uint16_t", "the chunk's dlogits, bf16") : lp;
      ec_line(&e->core, "const %s rn = %lld - chunk < %lld ? %lld - chunk : %lld;", e->core.ixt, (long long)n,
              (long long)rc, (long long)n, (long long)rc);
      const char *row = rs.tpr == 32 ? ec_str(&e->core, "blockIdx.x * %d + (threadIdx.x >> 5)", rs.rpb) : "blockIdx.x";
      ec_line(&e->core, "const %s i = %s;", e->core.ixt, row);
      ec_line(&e->core, "const int tr = threadIdx.x%s;", rs.tpr == 32 ? " & 31" : "");
      ec_enter(&e->core, "if (i < rn)");
      ec_line(&e->core, "const %s r = chunk + i;", e->core.ixt);
      ce_row(e, &rs, v, ec_str(&e->core, "%s + i * %lld", lp, (long long)vp), ec_str(&e->core, "%s[r]", cu_ptr(e, tg)),
             ec_str(&e->core, "%s[r]", cu_ptr(e, gr->ce)),
             bwd ? ec_str(&e->core, "%s + i * %lld", gp, (long long)vp) : NULL,
             bwd ? ec_str(&e->core, "%s[r]", cu_ptr(e, dl)) : NULL,
             ce_width(vp, l16 ? 2 : 4, !bwd ? 0 : d16 ? 2 : 4)); // rows vp apart
      if (vn > v && bwd)
        ec_line(&e->core, "for (int j = %lld + tr; j < %lld; j += %d) %s[i * %lld + j] = 0;", (long long)v,
                (long long)vn, rs.tpr, gp, (long long)vp);
      ec_leave(&e->core);
      kt = cu_kend(e, grid, rs.block);
      e->sl[e->nsl - 1].chunk = r0;
    } else {
      cu_relaunch(e, kt, grid, r0);
    }
    if (!bwd)
      continue;
    cu_gemm_add(e, (CudaGemm){.ab = ab, .ta = 0, .tb = !gr->tb, .m = rn, .n = c, .k = vn, .lda = vp, .ldb = ldw,
                              .ldc = c, .batch = 1, .a = grads, .b = ow, .c = odx + 4 * r0 * c, .bias = -1, .aux = -1});
    if (gr->tb)
      cu_gemm_add(e, (CudaGemm){.ab = ab, .ta = 1, .tb = 0, .m = v, .n = c, .k = rn, .lda = vp, .ldb = c, .ldc = c,
                                .batch = 1, .a = grads, .b = ox + sab * r0 * c, .c = odw, .beta = r0 ? 1.0f : 0.0f,
                                .bias = -1, .aux = -1});
    else
      cu_gemm_add(e, (CudaGemm){.ab = ab, .ta = 1, .tb = 0, .m = c, .n = v, .k = rn, .lda = c, .ldb = vp, .ldc = v,
                                .batch = 1, .a = ox + sab * r0 * c, .b = grads, .c = odw, .beta = r0 ? 1.0f : 0.0f,
                                .bias = -1, .aux = -1});
  }
  ew_outputs_done(&e->core, outs, nout);
}
