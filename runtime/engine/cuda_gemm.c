// cuda_gemm.c: the CUDA engine's GEMMs on cuBLASLt (loaded with dlopen): each GEMM's descriptors, and
// its algorithm timed among the heuristic's candidates when the engine is built.
//
// cuBLASLt. libcublasLt.so.13 (or libcublasLt.so, or $MDL_LIBCUBLASLT; also looked for under
// /usr/local/cuda/lib64). Our matrices are row-major and cuBLASLt's column-major, so row-major
// C[m,n] = op(A) op(B) is computed as the column-major C^T[n,m] = op(B)^T op(A)^T: the operands
// swap places, m and n swap, and the leading dimensions stay. In that view a bias over the columns
// of C is a bias over the rows of C^T, which is what the BIAS epilogue adds, and GELU's
// pre-activation (which the backward reads) goes to the epilogue's aux output. A residual added to
// the product is cuBLASLt's C with beta 1, out of place (CudaGemm.c_apart: C and D two matrices of
// one layout, as cublasLtMatmul allows), so the GEMM writes x + a @ w (+ b) without a kernel after
// it. (No BGRAD epilogue: a bias gradient is summed by the fused kernels.) The element types of a
// GEMM are the CudaGemm's, set by the emitter: A and B f32 or bf16, always summed in f32
// (CUBLAS_COMPUTE_32F, f32 alpha and beta); D f32, or bf16 for a GEMM whose only reader rounds it (no
// epilogue then: cuBLASLt's bias and aux would take D's type, ours are f32). Precision fp8: A and B
// E4M3 or E5M2 (CUDA_R_8F_E4M3, _E5M2; never both E5M2), row-major A [m, k] times B stored [n, k]
// (CudaGemm.tb), which the swap above makes cuBLASLt's "TN", the one layout its FP8 kernels take; the
// sums times A's and B's 1 / scale, given as cuBLASLt's B and A scale pointers into the arena's fp8
// region. CUBLASLT_MATMUL_DESC_FAST_ACCUM stays off: Hopper's fast accumulation keeps the sums in the
// tensor cores' narrower accumulator and skips the periodic promotion to f32, which costs accuracy on
// long inner dimensions (the backward's GEMMs over B*T); the CPU back ends sum in f32. When the
// engine is built the heuristic offers up to 8 algorithms per GEMM and each is timed on the arena
// (three runs after one), the fastest kept; capture and replay do no searching. A GEMM it offers
// none for (an fp8 layout other than TN, say) is an error naming the GEMM, its plan step and shapes.
#include "cuda_impl.h"
#include "runtime.h"

#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

Lt cuda_lt;

bool lt_ok(cublasStatus_t s, const char *fn, char *err, size_t n) {
  if (s == CUBLAS_STATUS_SUCCESS)
    return true;
  const char *name = cuda_lt.cublasLtGetStatusName ? cuda_lt.cublasLtGetStatusName(s) : NULL;
  return rt_fail(err, n, "%s: %s", fn, name ? name : "unknown cuBLAS status");
}

// Opens cuBLASLt (once per $MDL_LIBCUBLASLT) and resolves every function we use.
bool lt_open(char *err, size_t n) {
  const char *env = getenv("MDL_LIBCUBLASLT");
  env = env ? env : "";
  if (cuda_lt.so && !strcmp(cuda_lt.path, env))
    return true;
  const char *paths[] = {*env ? env : "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so",
                         "/usr/local/cuda/lib64/libcublasLt.so.13", "/usr/local/cuda/lib64/libcublasLt.so.12",
                         "/usr/local/cuda/lib64/libcublasLt.so"};
  void *so = NULL;
  for (size_t i = 0; i < (*env ? 1 : sizeof paths / sizeof *paths) && !so; i++)
    so = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
  if (!so)
    return *env ? rt_fail(err, n, "cuBLASLt not found (%s)", dlerror())
                : rt_fail(err, n, "cuBLASLt not found (libcublasLt.so.13 or .12, libcublasLt.so, "
                                  "/usr/local/cuda/lib64)");
  Lt t = {.so = so};
  snprintf(t.path, sizeof t.path, "%s", env);
#define X(ret, name, params)                                                                                   \
  if (!(*(void **)&t.name = dlsym(so, #name))) {                                                               \
    dlclose(so);                                                                                               \
    return rt_fail(err, n, "cuBLASLt lacks %s", #name);                                                           \
  }
  LT_FUNCTIONS(X)
#undef X
  cuda_lt = t;
  return true;
}

static int lt_type(DType t) {
  return t == DT_BF16 ? CUDA_R_16BF : t == DT_F8E4M3 ? CUDA_R_8F_E4M3 : t == DT_F8E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_32F;
}

void lt_gemm_free(LtGemm *q) {
  if (q->desc)
    cuda_lt.cublasLtMatmulDescDestroy(q->desc);
  if (q->la)
    cuda_lt.cublasLtMatrixLayoutDestroy(q->la);
  if (q->lb)
    cuda_lt.cublasLtMatrixLayoutDestroy(q->lb);
  if (q->lc)
    cuda_lt.cublasLtMatrixLayoutDestroy(q->lc);
  *q = (LtGemm){0};
}

static bool lt_layout(cublasLtMatrixLayout_t *l, int type, int64_t rows, int64_t cols, int64_t ld, int32_t batch,
                      int64_t stride, char *err, size_t n) {
  return LT(err, n, cublasLtMatrixLayoutCreate, l, type, (uint64_t)rows, (uint64_t)cols, ld) &&
         (batch <= 1 ||
          (LT(err, n, cublasLtMatrixLayoutSetAttribute, *l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch) &&
           LT(err, n, cublasLtMatrixLayoutSetAttribute, *l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
              sizeof stride)));
}

// Builds the descriptors of row-major C = op(A) op(B) (+ epilogue) on the arena at `base` and asks
// the heuristic for an algorithm that fits the workspace.
static bool lt_gemm_new(LtGemm *q, cublasLtHandle_t h, const CudaGemm *gm, CUdeviceptr base, char *err, size_t n) {
  *q = (LtGemm){.a = base + (CUdeviceptr)gm->b, .b = base + (CUdeviceptr)gm->a, .c = base + (CUdeviceptr)gm->c,
                .cin = base + (CUdeviceptr)(gm->c_apart ? gm->cin : gm->c), .beta = gm->beta};
  bool fp8 = gm->ab == DT_F8E4M3 || gm->ab == DT_F8E5M2;
  int ta_type = lt_type(fp8 ? gm->b_fp8 : gm->ab), tb_type = lt_type(gm->ab), cd = lt_type(gm->c_type);
  // (fp8: cuBLASLt multiplies the f32 sums by its A's and B's scale, our B's and A's 1 / scale, read
  // from the arena when the GEMM runs, so a graph captured once follows the scales of every step)
  void *a_scale = fp8 ? (void *)(uintptr_t)(base + (CUdeviceptr)gm->b_scale) : NULL;
  void *b_scale = fp8 ? (void *)(uintptr_t)(base + (CUdeviceptr)gm->a_scale) : NULL;
  int32_t ta = gm->tb ? CUBLAS_OP_T : CUBLAS_OP_N, tb = gm->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  int32_t batch = (int32_t)(gm->batch > 1 ? gm->batch : 1);
  // A row-major [r, c] matrix with leading dimension ld is the column-major [c, r] one with the same
  // ld: cuBLASLt's A (our B, [k, n] or [n, k] when tb) and B (our A, [m, k] or [k, m] when ta).
  int64_t a_rows = gm->tb ? gm->k : gm->n, a_cols = gm->tb ? gm->n : gm->k;
  int64_t b_rows = gm->ta ? gm->m : gm->k, b_cols = gm->ta ? gm->k : gm->m;
  uint32_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  switch (gm->epilogue) {
  case CUDA_EPI_NONE: break;
  case CUDA_EPI_BIAS: epi = CUBLASLT_EPILOGUE_BIAS; break;
  case CUDA_EPI_GELU: epi = gm->aux >= 0 ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_GELU; break;
  case CUDA_EPI_BIAS_GELU: epi = gm->aux >= 0 ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS; break;
  }
  void *bias = gm->bias >= 0 ? (void *)(uintptr_t)(base + (CUdeviceptr)gm->bias) : NULL;
  void *aux = gm->aux >= 0 ? (void *)(uintptr_t)(base + (CUdeviceptr)gm->aux) : NULL;
  int64_t aux_ld = gm->ldc;
  int32_t bias_type = CUDA_R_32F;
  bool ok = LT(err, n, cublasLtMatmulDescCreate, &q->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) &&
            LT(err, n, cublasLtMatmulDescSetAttribute, q->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) &&
            LT(err, n, cublasLtMatmulDescSetAttribute, q->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) &&
            LT(err, n, cublasLtMatmulDescSetAttribute, q->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) &&
            (!bias || (LT(err, n, cublasLtMatmulDescSetAttribute, q->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                          sizeof bias) &&
                       LT(err, n, cublasLtMatmulDescSetAttribute, q->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                          &bias_type, sizeof bias_type))) &&
            (!aux || (LT(err, n, cublasLtMatmulDescSetAttribute, q->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                         &aux, sizeof aux) &&
                      LT(err, n, cublasLtMatmulDescSetAttribute, q->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                         &aux_ld, sizeof aux_ld) &&
                      (batch <= 1 || LT(err, n, cublasLtMatmulDescSetAttribute, q->desc,
                                        CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &gm->stride_c,
                                        sizeof gm->stride_c)))) &&
            (!fp8 || (LT(err, n, cublasLtMatmulDescSetAttribute, q->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                         &a_scale, sizeof a_scale) &&
                      LT(err, n, cublasLtMatmulDescSetAttribute, q->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                         &b_scale, sizeof b_scale))) &&
            lt_layout(&q->la, ta_type, a_rows, a_cols, gm->ldb, batch, gm->stride_b, err, n) &&
            lt_layout(&q->lb, tb_type, b_rows, b_cols, gm->lda, batch, gm->stride_a, err, n) &&
            lt_layout(&q->lc, cd, gm->n, gm->m, gm->ldc, batch, gm->stride_c, err, n);
  if (!ok) {
    lt_gemm_free(q);
    return false;
  }
  cublasLtMatmulPreference_t pref = NULL;
  uint64_t ws = LT_WORKSPACE_BYTES;
  cublasLtMatmulHeuristicResult_t res[LT_CANDIDATES];
  int got = 0;
  ok = LT(err, n, cublasLtMatmulPreferenceCreate, &pref) &&
       LT(err, n, cublasLtMatmulPreferenceSetAttribute, pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
          sizeof ws) &&
       LT(err, n, cublasLtMatmulAlgoGetHeuristic, h, q->desc, q->la, q->lb, q->lc, q->lc, pref, LT_CANDIDATES, res,
          &got);
  if (pref)
    cuda_lt.cublasLtMatmulPreferenceDestroy(pref);
  if (ok && got < 1)
    ok = rt_fail(err, n, "cublasLtMatmulAlgoGetHeuristic: no algorithm");
  if (!ok) {
    lt_gemm_free(q);
    return false;
  }
  for (int i = 0; i < got && i < LT_CANDIDATES; i++)
    if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= LT_WORKSPACE_BYTES)
      q->cand[q->ncand++] = res[i].algo;
  if (q->ncand == 0)
    q->cand[q->ncand++] = res[0].algo;
  q->algo = q->cand[0];
  return true;
}

bool lt_gemm_run(const LtGemm *q, cublasLtHandle_t h, CUdeviceptr ws, CUstream s, char *err, size_t n) {
  const float one = 1.0f;
  return LT(err, n, cublasLtMatmul, h, q->desc, &one, (const void *)(uintptr_t)q->a, q->la,
            (const void *)(uintptr_t)q->b, q->lb, &q->beta, (const void *)(uintptr_t)q->cin, q->lc,
            (void *)(uintptr_t)q->c, q->lc, &q->algo, (void *)(uintptr_t)ws, LT_WORKSPACE_BYTES, s);
}

// Times each of the heuristic's candidates for GEMM q on the arena (one untimed run, then
// LT_TUNE_RUNS between two events) and keeps the fastest in q->algo; a candidate that fails to run
// is passed over (where none runs, the first is kept, for the eager run to report). Returns the index
// of the one kept (0: the heuristic's first), -1 on a CUDA error. The runs write the GEMM's output,
// and those that accumulate (beta 1) add to it: harmless before the first step, which computes
// every activation and gradient afresh.
static int lt_gemm_tune(CudaEngine *ce, LtGemm *q, CUevent ev[2], char *err, size_t n) {
  int best = 0;
  float best_ms = INFINITY;
  for (int c = 0; c < q->ncand && q->ncand > 1; c++) {
    char why[256];
    q->algo = q->cand[c];
    bool ran = lt_gemm_run(q, ce->lt, ce->workspace, ce->stream, why, sizeof why);
    if (!ran)
      continue;
    if (!CU(err, n, cuEventRecord, ev[0], ce->stream))
      return -1;
    for (int r = 0; ran && r < LT_TUNE_RUNS; r++)
      ran = lt_gemm_run(q, ce->lt, ce->workspace, ce->stream, why, sizeof why);
    float ms = 0;
    if (!CU(err, n, cuEventRecord, ev[1], ce->stream) || !CU(err, n, cuEventSynchronize, ev[1]) ||
        !CU(err, n, cuEventElapsedTime, &ms, ev[0], ev[1]))
      return -1;
    if (ran && ms < best_ms)
      best_ms = ms, best = c;
  }
  q->algo = q->cand[best];
  return best;
}

// The alignment of a byte offset in the arena, up to 256 (cuBLASLt's kernels ask for up to that);
// -1 for none.
static int64_t alignment(int64_t off) {
  int64_t a = off & -off;
  return off < 0 ? -1 : off == 0 || a > 256 ? 256 : a;
}

// Two GEMMs cuBLASLt tells apart only by their addresses: the same descriptors (types, transposes,
// shapes, leading dimensions, batches and strides, epilogue, beta, C apart) and addresses of the same
// alignments. The heuristic offers both the same candidates, at the same speeds: one is timed, the
// other runs on its choice. GPT-2 124M's 150 GEMMs are 16 kinds (each layer's, and the LM head's
// chunks, the same 3 to 7); timing each GEMM apart also let timing noise give layers of one shape
// different algorithms.
static bool same_kind(const CudaGemm *x, const CudaGemm *y) {
  return x->ab == y->ab && x->b_fp8 == y->b_fp8 && x->c_type == y->c_type && x->ta == y->ta && x->tb == y->tb &&
         x->m == y->m && x->n == y->n && x->k == y->k && x->lda == y->lda && x->ldb == y->ldb && x->ldc == y->ldc &&
         x->batch == y->batch && x->stride_a == y->stride_a && x->stride_b == y->stride_b &&
         x->stride_c == y->stride_c && x->beta == y->beta && x->epilogue == y->epilogue && x->c_apart == y->c_apart &&
         alignment(x->a) == alignment(y->a) && alignment(x->b) == alignment(y->b) &&
         alignment(x->c) == alignment(y->c) && alignment(x->bias) == alignment(y->bias) &&
         alignment(x->aux) == alignment(y->aux) && alignment(x->c_apart ? x->cin : -1) ==
         alignment(y->c_apart ? y->cin : -1);
}

// An earlier GEMM of i's kind with the same candidates, whose choice i takes; -1 when there is none.
static int tuned_twin(const CudaEngine *ce, int i, const int *kept) {
  const LtGemm *q = &ce->gemms[i];
  for (int j = 0; j < i; j++) {
    const LtGemm *r = &ce->gemms[j];
    if (kept[j] >= 0 && same_kind(&ce->plan->gemms[j], &ce->plan->gemms[i]) && r->ncand == q->ncand &&
        !memcmp(r->cand, q->cand, sizeof *q->cand * (size_t)q->ncand))
      return j;
  }
  return -1;
}

// Descriptors and algorithms for every GEMM (the fastest of the heuristic's candidates, timed here
// for one GEMM of each kind), each then run once eagerly: this checks every call with a precise
// message before capture, and loads cuBLASLt's kernels outside it.
bool lt_init_gemms(CudaEngine *ce, const Fusion *f, char *err, size_t n) {
  const CudaPlan *p = ce->plan;
  ce->gemms = calloc((size_t)p->ngemms + 1, sizeof *ce->gemms);
  int *kept_of = calloc((size_t)p->ngemms + 1, sizeof *kept_of);
  if (!ce->gemms || !kept_of) {
    free(kept_of);
    return rt_fail(err, n, "out of host memory");
  }
  if (!LT(err, n, cublasLtCreate, &ce->lt)) {
    free(kept_of);
    return false;
  }
  CUevent ev[2] = {NULL, NULL};
  bool ok = CU(err, n, cuEventCreate, &ev[0], 0) && CU(err, n, cuEventCreate, &ev[1], 0);
  for (int i = 0; ok && i < p->ngemms; i++) {
    const CudaGemm *gm = &p->gemms[i];
    char why[256] = "";
    int kept = -2; // the index of the candidate kept, -1 on a CUDA error, -2 when there is none
    if (lt_gemm_new(&ce->gemms[i], ce->lt, gm, ce->arena, why, sizeof why)) {
      int twin = ce->tune ? tuned_twin(ce, i, kept_of) : -1;
      if (twin >= 0) {
        kept = kept_of[twin];
        ce->gemms[i].algo = ce->gemms[twin].algo;
      } else {
        kept = ce->tune ? lt_gemm_tune(ce, &ce->gemms[i], ev, err, n) : 0;
        ce->kinds += ce->tune;
      }
    }
    kept_of[i] = kept;
    ce->retuned += kept > 0;
    if (kept == -1)
      ok = false;
    else if (kept == -2 || !lt_gemm_run(&ce->gemms[i], ce->lt, ce->workspace, ce->stream, why, sizeof why))
      ok = rt_fail(err, n, "GEMM %d of step %s (%s[%lld x %lld] = %s%s[%lld x %lld] %s%s[%lld x %lld]): %s", i,
                   f->steps[gm->step].name, dtype_name(gm->c_type), (long long)gm->m, (long long)gm->n,
                   dtype_name(gm->ab), gm->ta ? "T" : "", (long long)gm->m, (long long)gm->k,
                   gm->ab == DT_F8E4M3 || gm->ab == DT_F8E5M2 ? dtype_name(gm->b_fp8) : "", gm->tb ? "T" : "",
                   (long long)gm->k, (long long)gm->n, why);
  }
  for (int i = 0; i < 2; i++)
    if (ev[i])
      cuda_drv.cuEventDestroy(ev[i]);
  free(kept_of);
  return ok && CU(err, n, cuStreamSynchronize, ce->stream);
}
