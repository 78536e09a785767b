// emit_c.c: the C emitter. It turns the step plan (a Fusion and its MemPlan) into one translation unit
// of C11 + OpenMP for the whole training step: a prelude of helpers (runtime/kernels/prelude.h), one function
// per step, mdl_step calling them in order, and a table of kernels the runtime can time one by one.
// This file holds the module: its steps, their kernels' pointers and shared code, and GEMMs; the loop
// families are in emit_c_rows.c, emit_c_lmhead.c, emit_c_attn.c and emit_c_opt.c, built with the
// toolkit of emit_c_kit.c (buffers, the inline evaluator, elementwise and row loops); emit_common.h
// lists them, emit_c_impl.h is what they share.
//
// Kernels that run the same loops on other buffers (one per layer: GPT-2 124M's 238 kernels are 30
// distinct ones) share one function that takes their buffers' arena offsets, and each kernel calls
// it with its own (write_kernels); so the C compiler compiles each distinct kernel once and a model's
// compile time hardly grows with its layers (GPT-2 124M 13.5 s -> 2.1 s; with 48 layers, 922 kernels,
// still 30 distinct: 55 s -> 4 s).
//
// Design. The nodes of a step split into anchors, ops that need a loop nest of their own (GEMM,
// reductions, row-wise ops, attention, gathers, the optimizer), and pointwise nodes (elementwise and
// index-mapped ops), which never get a loop of their own: the inline evaluator `c_val` computes a
// pointwise node as a local at whatever flat index a loop asks for, reading its inputs through their
// index maps (broadcast, permute, slice, concat), recursively, down to values in memory; a node used
// twice at one index is computed once. Anchors of one kind over the same inputs form one group
// (layernorm dx/dw/db, attention dq/dk/dv, cross-entropy with its backward, the LM-head pattern, the
// optimizer) and groups run in dependency order. Around each group:
//   - inputs it reads from memory that are pointwise nodes of the step are first written by an
//     elementwise loop (to their arena slot, or to a scratch buffer when the step keeps them);
//   - inputs a reduction or a row-wise op reads element by element are computed inline in its loop,
//     and a step output met there at the loop's own index is stored on the way (the residual add that
//     feeds a layernorm);
//   - step outputs that depend on the group and have its shape are computed in the group's own loop
//     (reductions, row-wise ops) or in a loop right after it (the GEMM epilogue; the GEMM then writes
//     straight into the epilogue's output when the matmul itself stays inside the step);
// and the outputs still unwritten get elementwise loops at the end. Whether a value may share a
// loop depends on how it is read (a consumer reading a reduction at another index cannot run in
// the reduction's loop), so a step is emitted in passes: a pass that meets such a read flags it, the
// next pass avoids it, and the text of the last pass is kept.
//
// Numerics follow interp.c op by op. Elementwise math is fp32; sums over many elements (norm
// statistics, column sums, reductions, the gradient norm) accumulate in double, in fixed blocks
// combined in a fixed order; softmax and cross-entropy denominators in 16 f32 lanes flushed to double
// lanes every 256 elements (c_exp_sum), and short dot products use `omp simd` reductions (an
// order fixed by the compiled code), so results do not depend on the thread count. Attention keeps
// one task per (batch, head) and sums its short rows of probabilities in fp32, in 8 lanes combined in
// a fixed tree, with a vectorizable exp (mdl_exp_shifted) for the softmax; the softmax and
// cross-entropy rows, gelu and silu use it too (mdl_exp_fast), and elementwise loops run over rows
// of the last axis, so that a bias read along rows does not keep them from vectorizing. AdamW runs in f32
// per element, as a fused optimizer on a GPU does (in double it measured 20% slower than f32, its
// square root and division at half the vector width; the interpreter keeps double). GEMMs go through mdl_gemm, which splits the rows of
// C over the OpenMP threads and calls the runtime's single-threaded sgemm in each block, so one
// pool of threads runs the whole step.
//
// bf16. After the precision pass, GEMM operands are CASTs to bf16: stored in 16 bits (uint16_t
// buffers, half the bytes), read and written through mdl_bf16_to_f32 / mdl_f32_to_bf16 (round to
// nearest even, as the interpreter's CAST), while every computation stays f32. A GEMM of bf16
// operands runs as the f32 GEMM of its operands widened exactly into scratch (mdl_widen_bf16, once
// per buffer and group): products of bf16 values are exact in f32 and sums accumulate in f32, as on
// a GPU's bf16 tensor cores. Its f32 result never goes into a bf16 buffer. The LM head widens x and W
// once for all its chunks and rounds dlogits to bf16 values before its backward GEMMs. The prelude's
// bf16 helpers (runtime/kernels/prelude_bf16.h) are emitted only for graphs that hold bf16 values, so fp32 code is unchanged.
//
// What does not depend on the target (where values are, groups and their order, lines and scopes,
// the index maps of the evaluator) is in emit_common.c, whose state EmitCore this emitter embeds as
// e->core; the walk over a step's passes and groups and the evaluator's walk are emit_walk.c's, which
// calls this target through c_target, its table of hooks.
#include "mdl.h"
#include "emit_common.h"
#include "emit_walk.h"
#include "emit_c.h"
#include "emit_c_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

//
// The kernel's pointers, declared at its top: every node read or written through memory has one (its
// arena slot, a scratch buffer, or for a GEMM root the buffer of its epilogue's output).
//

static const char *shape_txt(Emit *e, int n) {
  char buf[128];
  return c_str(e, "%s%s", dtype_name(ec_node(&e->core, n)->dtype),
               shape_str(ec_node(&e->core, n)->shape, buf, sizeof buf));
}

static const char *node_label(Emit *e, int n) {
  const IrNode *nd = ec_node(&e->core, n);
  return c_str(e, "%%%d %s%s%s", n, op_name(nd->op), nd->name ? " " : "", nd->name ? nd->name : "");
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

// The pointer declarations of the kernel (arena slots and scratch buffers, then the GEMMs that write
// into their epilogue's output) and the frees of its scratch buffers.
// The kernel's pointers: into decl at their arena offsets, and into shared the same lines reading the
// offsets from o[] (their values appended to k->off), for a kernel whose code others share.
static void write_decls(Emit *e, Buf *decl, Buf *shared, Kernel *k, Buf *frees) {
  qsort(e->decls, (size_t)e->ndecls, sizeof *e->decls, cmp_int);
  // With its offsets out of sight the C compiler must assume that any two of the pointers may
  // overlap, and keeps loops it vectorized with constant offsets scalar (attention's backward ran
  // 25% slower): where the kernel's buffers are disjoint, its shared code says so (restrict, which
  // is then part of what kernels must have alike to share it).
  bool disjoint = true;
  for (int i = 0; i < e->ndecls && disjoint; i++)
    for (int j = 0; j < i && disjoint; j++) {
      int a = e->decls[i], b = e->decls[j];
      int64_t oa = ec_offset(&e->core, a), ob = ec_offset(&e->core, b);
      if (oa >= 0 && ob >= 0)
        disjoint = oa >= ob + ec_numel(&e->core, b) * dtype_size(ec_node(&e->core, b)->dtype) ||
                   ob >= oa + ec_numel(&e->core, a) * dtype_size(ec_node(&e->core, a)->dtype);
    }
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < e->ndecls; i++) {
      int c = e->decls[i];
      const char *t = ec_mtype(&e->core, c);
      Buf line = {0};
      if (pass == 0 && ec_offset(&e->core, c) >= 0) {
        ec_bput(decl, "  %s *const b%d = (%s *)(arena + %lld); // %s %s\n", t, c, t, (long long)ec_offset(&e->core, c),
                node_label(e, c), shape_txt(e, c));
        ec_bput(shared, "  %s *const%s b%d = (%s *)(arena + o[%d]); // %s %s\n", t, disjoint ? " restrict" : "", c, t,
                k->noff, node_label(e, c), shape_txt(e, c));
        k->off = xrealloc(k->off, sizeof *k->off * (size_t)(k->noff + 1), "a kernel's offsets");
        k->off[k->noff++] = ec_offset(&e->core, c);
      } else if (pass == 0 && e->core.host[c] < 0) {
        ec_bput(&line, "  %s *const b%d = mdl_scratch(%lld); // %s %s, kept in this kernel\n", t, c,
                (long long)ec_numel(&e->core, c) * dtype_size(ec_node(&e->core, c)->dtype), node_label(e, c),
                shape_txt(e, c));
        ec_bput(frees, "  mdl_free(b%d);\n", c);
      } else if (pass == 1 && ec_offset(&e->core, c) < 0 && e->core.host[c] >= 0) {
        ec_bput(&line, "  float *const b%d = b%d; // %s %s: the GEMM writes into its epilogue's output\n", c,
                e->core.host[c], node_label(e, c), shape_txt(e, c));
      }
      if (line.len) {
        ec_bappend(decl, &line);
        ec_bappend(shared, &line);
      }
      free(line.s);
    }
}

//
// Anchors.
//

// The rows r of an fp8 GEMM operand (scaled tensor t) as f32, as c_widened does for bf16, or as bf16
// bits (b16): its values times 1 / its scale, exactly (prelude_c_fp8.h).
static Rows c_widened_fp8(Emit *e, Rows r, int64_t t, bool b16, int *wide, int *nwide) {
  e->uses_h = true;
  ec_line(&e->core, "%s *const w%d = mdl_widen_fp8%s(b%d, %lld, %d, 1.0f / h->fp8_scale[%lld], h->nthreads);",
          b16 ? "uint16_t" : "float", r.buf, b16 ? "_bf16" : "", c_ptr(e, r.buf), (long long)ec_numel(&e->core, r.buf),
          ec_node(&e->core, r.buf)->dtype == DT_F8E5M2, (long long)t);
  wide[(*nwide)++] = r.buf;
  r.base = r.off ? c_str(e, "w%d + %lld", r.buf, (long long)r.off) : c_str(e, "w%d", r.buf);
  return r;
}


// GEMM g (or one per batch) through mdl_bgemm (b16: operands of bf16 bits) or mdl_gemm into buffer c.
static void gemm_call(Emit *e, bool b16, const EwGemm *g, Rows a, Rows b, int c) {
  const char *fn = b16 ? "mdl_bgemm" : "mdl_gemm";
  long long m = g->m, n = g->n, k = g->k;
  if (g->batches == 1) {
    ec_line(&e->core, "%s(h, %d, %d, %lld, %lld, %lld, %s, %lld, %s, %lld, 0.0f, b%d, %lld);", fn, g->ta, g->tb, m, n,
            k, a.base, (long long)a.stride, b.base, (long long)b.stride, c, n);
    return;
  }
  // Batches: one parallel loop over every block of every batch's product, each block what the
  // product alone would split it into (mdl_bgemm_nb, mdl_gemm_nb), so the values are those of a call
  // per batch, and the threads wake once instead of once a batch (Muon's Newton-Schulz products of
  // the matrices of one shape, autodiff.c: small, and many).
  Shape ob = g->so, ab = g->sa, bb = g->sb;
  ob.rank -= 2, ab.rank -= 2, bb.rank -= 2;
  ec_enter(&e->core, "%s", "");
  if (b16) {
    ec_line(&e->core, "int cols;");
    ec_line(&e->core, "const int64_t nb = mdl_bgemm_nb(h, %lld, %lld, %lld, &cols);", m, n, k);
  } else {
    ec_line(&e->core, "const int64_t nb = mdl_gemm_nb(h, %lld, %lld, %lld);", m, n, k);
  }
  ec_line(&e->core, "#pragma omp parallel for num_threads(h->nthreads) schedule(static)");
  ec_enter(&e->core, "for (int64_t q = 0; q < %lld * nb; q++)", (long long)g->batches);
  ec_line(&e->core, "const int64_t t = q / nb;");
  const char *ia = ec_ix_bcast(&e->core, ob, ab, "t"), *ib = ec_ix_bcast(&e->core, ob, bb, "t");
  ec_line(&e->core,
          "%s_block(h, q %% nb, nb, %s%d, %d, %lld, %lld, %lld, %s + %s * %lld, %lld, %s + %s * %lld, %lld, 0.0f, "
          "b%d + t * %lld, %lld);",
          fn, b16 ? "cols, " : "", g->ta, g->tb, m, n, k, a.base, ia, m * k, (long long)a.stride, b.base, ib, k * n,
          (long long)b.stride, c, m * n, n);
  ec_leave(&e->core);
  ec_leave(&e->core);
}

static void emit_gemm(EmitCore *core, int gi) {
  Emit *e = (Emit *)core;
  EwGemm g;
  ew_gemm_shape(&e->core, gi, &g);
  Rows a, b;
  if (g.so.rank == 2) {
    a = c_rows_of(e, g.nd->in[0]);
    b = c_rows_of(e, g.nd->in[1]);
  } else {
    a = c_rows_at(e, ec_need(&e->core, g.nd->in[0]), 0, g.sa.d[g.sa.rank - 1]);
    b = c_rows_at(e, ec_need(&e->core, g.nd->in[1]), 0, g.sb.d[g.sb.rank - 1]);
  }
  ew_flush(&e->core);
  int *q = ec_xcalloc((size_t)e->core.g->n, sizeof *q);
  int nq = ec_post_set(&e->core, gi, ec_numel(&e->core, g.mm), e->core.emitted, q);
  // The product is f32: it may be written into an f32 output of the epilogue only.
  ew_gemm_place(&e->core, g.mm, q, nq);
  int c = c_ptr(e, g.mm);
  e->uses_h = true;
  ec_phase_begin(&e->core);
  // bf16 operands: the library's bf16 GEMM where the runtime has one (h->bgemm), else an f32 GEMM of
  // the operands widened, in a scope of its own.
  bool a16 = ec_node(&e->core, g.nd->in[0])->dtype == DT_BF16;
  bool b16 = ec_node(&e->core, g.nd->in[1])->dtype == DT_BF16;
  bool bf16 = a16 && b16, mixed = a16 != b16;
  DType d8 = ec_node(&e->core, g.nd->in[0])->dtype;
  bool fp8 = d8 == DT_F8E4M3 || d8 == DT_F8E5M2;
  int wide[2], nwide = 0;
  c_note(e, "gemm %%%d: [%lld x %lld] = %s[%lld x %lld] %s[%lld x %lld]%s%s%s", g.mm, (long long)g.m,
         (long long)g.n, g.ta ? "T" : "", (long long)g.m, (long long)g.k, g.tb ? "T" : "", (long long)g.k,
         (long long)g.n,
         bf16 ? ", bf16 operands (widened to f32 where the library has no bf16 GEMM)"
              : mixed ? ", a bf16 operand widened to f32"
              : fp8 ? ", fp8 operands descaled (exact) into bf16 for the library's bf16 GEMM, else into f32" : "",
         g.batches > 1 ? c_str(e, ", %lld batches", (long long)g.batches) : "", nq ? ", epilogue after" : "");
  if (bf16) {
    ec_enter(&e->core, "if (h->bgemm)");
    gemm_call(e, true, &g, a, b, c);
    ec_leave(&e->core);
    ec_enter(&e->core, "else");
  } else if (fp8) { // (the codes' values are bf16 values, so the bf16 GEMM's products are the f32 ones)
    ec_enter(&e->core, "if (h->bgemm)");
    Rows a16 = c_widened_fp8(e, a, g.nd->ia[2], true, wide, &nwide);
    Rows b16 = c_widened_fp8(e, b, g.nd->ia[3], true, wide, &nwide);
    gemm_call(e, true, &g, a16, b16, c);
    c_free_widened(e, wide, nwide);
    nwide = 0;
    ec_leave(&e->core);
    ec_enter(&e->core, "else");
  } else if (mixed)
    ec_enter(&e->core, "%s", "");
  if (bf16 || mixed) {
    a = c_widened(e, a, wide, &nwide);
    b = c_widened(e, b, wide, &nwide);
  } else if (fp8) {
    a = c_widened_fp8(e, a, g.nd->ia[2], false, wide, &nwide);
    b = c_widened_fp8(e, b, g.nd->ia[3], false, wide, &nwide);
  }
  gemm_call(e, false, &g, a, b, c);
  if (bf16 || mixed || fp8) {
    c_free_widened(e, wide, nwide);
    ec_leave(&e->core);
  }
  ec_phase_done(&e->core, g.mm);
  ec_phase_end(&e->core);
  if (nq && !ec_reduction_after(&e->core, gi, e->core.emitted, ec_numel(&e->core, g.mm)))
    c_pw_loop(&e->core, q, nq, ec_numel(&e->core, g.mm), g.mm, "epilogue");
  free(q);
}

//
// Steps.
//

// The C target's part of a pass's reset (emit_walk.c resets the rest).
static void pass_reset(EmitCore *core) {
  Emit *e = (Emit *)core;
  memset(e->declared, 0, (size_t)core->g->n * sizeof *e->declared);
  e->notes.len = 0;
  e->ndecls = 0;
  e->uses_h = false;
}

// The text two kernels share exactly when one's code computes the other's on other buffers: comments
// dropped, and the names that carry a node's number (buffers b12, widened w12, values v12_i) numbered
// by first appearance.
static char *kernel_key(const char *s) {
  Buf k = {0};
  const char **names = NULL; // (each compared on its first lens[i] characters)
  size_t *lens = NULL, nnames = 0;
  while (*s) {
    if (s[0] == '/' && s[1] == '/') {
      s += strcspn(s, "\n");
      continue;
    }
    bool ident = (*s == '_' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z'));
    if (!ident) {
      ec_bput(&k, "%c", *s++);
      continue;
    }
    size_t n = strspn(s, "_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789");
    size_t digits = strspn(s + 1, "0123456789"), stem = 1 + digits;
    bool numbered = digits && strchr("bwv", s[0]) && (stem == n || (s[0] == 'v' && s[stem] == '_'));
    if (!numbered) {
      ec_bput(&k, "%.*s", (int)n, s);
    } else { // (a value's local v12_i: its stem v12 numbered, its index suffix kept)
      size_t i = 0;
      while (i < nnames && !(lens[i] == stem && !strncmp(names[i], s, stem)))
        i++;
      if (i == nnames) {
        names = xrealloc(names, sizeof *names * (nnames + 1), "a kernel's local names");
        lens = xrealloc(lens, sizeof *lens * (nnames + 1), "a kernel's local names");
        names[nnames] = s;
        lens[nnames++] = stem;
      }
      ec_bput(&k, "%c#%zu%.*s", s[0], i, (int)(n - stem), s + stem);
    }
    s += n;
  }
  free(names);
  free(lens);
  return k.s ? k.s : xstrdup("", "a kernel's text");
}

// Emits step si as the function `name`, into k.
static bool emit_kernel(Emit *e, int si, const char *name, Kernel *k) {
  if (!ew_step(&e->core, si))
    return false;
  ec_drop_unused(&e->core);

  Buf head = {0}, code = {0}, shared = {0};
  ew_step_head(&e->core, &head, name);
  ec_bput(&head, "// loops:\n");
  ec_bappend(&head, &e->notes);
  ec_bput(&code, "MDL_FN void %s(char *arena, const MdlHooks *h) {\n", name);
  Buf decl = {0}, frees = {0}, sdecl = {0};
  write_decls(e, &decl, &sdecl, k, &frees);
  Buf *both[2] = {&code, &shared};
  for (int i = 0; i < 2; i++) {
    if (!e->uses_h)
      ec_bput(both[i], "  (void)h;\n");
    if (i == 0 && !decl.len && !strstr(e->core.body.s ? e->core.body.s : "", "arena"))
      ec_bput(both[i], "  (void)arena;\n");
    ec_bappend(both[i], i ? &sdecl : &decl);
    ec_bappend(both[i], &e->core.body);
    ec_bappend(both[i], &frees);
    ec_bput(both[i], "}\n");
  }
  free(decl.s);
  free(sdecl.s);
  free(frees.s);
  *k = (Kernel){.name = name, .head = head.s, .code = code.s, .shared = k->noff ? shared.s : NULL, .off = k->off,
                .noff = k->noff};
  if (k->noff)
    k->key = kernel_key(shared.s);
  else
    free(shared.s);
  return true;
}

// Parts of a module (prelude.h: MDL_PART): the C compiler runs on each side by side, so the cold
// compile of GPT-2 124M takes about half as long on two cores (2.1 s whole); a part that holds little
// costs only the prelude (0.03 s), so a machine of more cores gets more of them.
enum { C_PARTS = 4 };

// The kernels into out, in order. Kernels of the same loops on other buffers (one per layer, most of
// them) share one function, NAME__code(arena, h, o), emitted once before the first of them, and each
// is a call of it with its buffers' arena offsets in o[]: the C compiler then compiles each distinct
// kernel once, however many layers the model has. A kernel alone in its loops is emitted whole. Each
// distinct kernel (with the calls of it) goes to one of nparts parts, the largest first into the part
// that holds the least code so far; part[i] is kernel i's. The step and the kernel table are part 0's.
static void write_kernels(Buf *out, const Kernel *ks, int n, int nparts, int *part) {
  int *first = ec_xcalloc((size_t)n + 1, sizeof *first), *count = ec_xcalloc((size_t)n + 1, sizeof *count);
  for (int i = 0; i < n; i++) {
    first[i] = i;
    for (int j = 0; j < i && ks[i].key; j++)
      if (ks[j].key && first[j] == j && !strcmp(ks[i].key, ks[j].key)) {
        first[i] = j;
        break;
      }
    count[first[i]]++;
  }
  size_t *size = ec_xcalloc((size_t)n + 1, sizeof *size), load[C_PARTS] = {0};
  bool *placed = ec_xcalloc((size_t)n + 1, sizeof *placed);
  for (int i = 0; i < n; i++)
    size[i] = first[i] != i ? 0 : strlen(count[i] < 2 ? ks[i].code : ks[i].shared);
  for (;;) { // the largest distinct kernel not yet placed, into the least loaded part
    int big = -1, p = 0;
    for (int i = 0; i < n; i++)
      if (first[i] == i && !placed[i] && (big < 0 || size[i] > size[big]))
        big = i;
    if (big < 0)
      break;
    for (int q = 1; q < nparts; q++)
      if (load[q] < load[p])
        p = q;
    placed[big] = true;
    part[big] = p;
    load[p] += size[big];
  }
  for (int i = 0; i < n; i++)
    part[i] = part[first[i]];
  for (int i = 0; i < n; i++) {
    const Kernel *k = &ks[i], *f = &ks[first[i]];
    ec_bput(out, "\n#if MDL_IN(%d)", part[i]);
    if (count[first[i]] < 2) {
      ec_bput(out, "%s%s#endif\n", k->head, k->code);
      continue;
    }
    if (first[i] == i) {
      ec_bput(out, "\n// The loops of %d kernels, each on its own buffers (o[]: their offsets in the arena; the names\n"
              "// are those of %s's):\n//", count[i], k->name);
      for (int j = i, col = 2; j < n; j++)
        if (first[j] == i) {
          col += (int)strlen(ks[j].name) + 1;
          if (col > 110)
            ec_bput(out, "\n//"), col = 2 + (int)strlen(ks[j].name) + 1;
          ec_bput(out, " %s", ks[j].name);
        }
      ec_bput(out, "\nMDL_FN void %s__code(char *arena, const MdlHooks *h, const int64_t *o) "
              "{\n%s", k->name, k->shared);
    }
    ec_bput(out, "%sMDL_FN void %s(char *arena, const MdlHooks *h) {\n  static const int64_t o[] = {", k->head,
            k->name);
    for (int j = 0; j < k->noff; j++)
      ec_bput(out, "%s%lld", j ? ", " : "", (long long)k->off[j]);
    ec_bput(out, "};\n  %s__code(arena, h, o);\n}\n#endif\n", f->name);
  }
  free(first);
  free(count);
  free(size);
  free(placed);
}

// The C target: its hooks and its loop families.
static const EmitTarget c_target = {
    .concat_values = true, .seed = c_seed, .base = c_base, .fp8_cast = c_fp8_cast, .local = c_local, .store = c_store,
    .pw_loop = c_pw_loop, .pass_reset = pass_reset,
    .kernel = {[EK_GEMM] = emit_gemm, [EK_REDUCE] = c_emit_reduce, [EK_NORM_FWD] = c_emit_norm_fwd,
               [EK_NORM_BWD] = c_emit_norm_bwd, [EK_SOFTMAX] = c_emit_softmax, [EK_EMBED] = c_emit_embed,
               [EK_EMBED_BWD] = c_emit_embed_bwd, [EK_ROPE] = c_emit_rope, [EK_MAX_BWD] = c_emit_max_bwd,
               [EK_TOPK] = c_emit_topk, [EK_GATHER] = c_emit_gather, [EK_SCATTER] = c_emit_scatter,
               [EK_ATTN_MASK] = c_emit_attn_mask, [EK_ATTENTION] = c_emit_attention,
               [EK_ATTENTION_BWD] = c_emit_attention_bwd, [EK_CE] = c_emit_ce, [EK_LMHEAD] = c_emit_lmhead,
               [EK_OPTIMIZER] = c_emit_optimizer},
};

char *emit_c(const Fusion *f, const MemPlan *m, const char *source_path) {
  const Graph *g = f->g;
  size_t n = (size_t)g->n;
  Emit e = {0};
  ew_open(&e.core, &c_target, f, m);
  e.declared = ec_xcalloc(n, sizeof *e.declared);
  e.decls = ec_xcalloc(n, sizeof *e.decls);

  ec_bput(&e.out, "// Generated by mdlc %s from %s: do not edit.\n", MDL_VERSION, source_path ? source_path : "?");
  ec_bput(&e.out,
          "// Model %s: one training step (forward, backward, AdamW) as %d kernels over one arena of %lld bytes\n",
          g->model ? g->model : "?", f->nsteps, (long long)m->arena_bytes);
  ec_bput(&e.out, "// (parameters, gradients and AdamW moments at %lld, %lld, %lld and %lld, %lld bytes each).\n",
          (long long)m->params, (long long)m->grads, (long long)m->m, (long long)m->v, (long long)m->param_bytes);
  ec_bput(&e.out, "// Build: cc -O3 -march=native -fno-math-errno -fopenmp -shared -fPIC (or each part with -c\n"
                  "// -DMDL_PART=p, the objects then linked with -shared: runtime/engine/cpu.c does so and loads it).\n");
  ec_bput(&e.out, "%s", ec_prelude_c);
  bool bf16 = false;
  for (int i = 0; i < g->n; i++)
    bf16 |= g->nodes[i]->dtype == DT_BF16 ||
            ((g->nodes[i]->op == OP_ATTENTION || g->nodes[i]->op == OP_ATTENTION_LSE ||
              g->nodes[i]->op == OP_ATTENTION_BWD) && g->nodes[i]->ia[4] == DT_BF16);
  if (bf16) // only in the code of graphs that hold bf16 values (so an fp32 graph's code is what it was)
    ec_bput(&e.out, "%s", ec_prelude_c_bf16);
  if (g->nfp8) // and fp8 values
    ec_bput(&e.out, "%s%s", ec_prelude_fp8, ec_prelude_c_fp8);

  const char **names = ec_xcalloc((size_t)f->nsteps + 1, sizeof *names);
  Kernel *ks = ec_xcalloc((size_t)f->nsteps + 1, sizeof *ks);
  for (int si = 0; si < f->nsteps; si++) {
    names[si] = ew_kernel_name(&e.core, f->steps[si].name, si, names);
    if (!emit_kernel(&e, si, names[si], &ks[si]))
      break;
  }
  char *text = NULL;
  if (e.core.failed) {
    fprintf(stderr, "mdlc: emit_c: %s\n", e.core.err);
  } else {
    int nparts = 0, *part = ec_xcalloc((size_t)f->nsteps + 1, sizeof *part);
    for (int si = 0; si < f->nsteps; si++) { // one part a distinct kernel, C_PARTS at most
      bool seen = false;
      for (int j = 0; j < si && ks[si].key && !seen; j++)
        seen = ks[j].key && !strcmp(ks[j].key, ks[si].key);
      nparts += !seen;
    }
    Buf body = {0};
    nparts = nparts < 1 ? 1 : nparts > C_PARTS ? C_PARTS : nparts;
    write_kernels(&body, ks, f->nsteps, nparts, part);
    ec_bput(&e.out, "\n// The kernels, each in one of the module's %d parts (compiled whole, or each part on its own)\n",
            nparts);
    ec_bput(&e.out, "#define MDL_NPARTS %d\n", nparts);
    for (int si = 0, col = 0; si < f->nsteps; si++) {
      if (col == 0 || col + (int)strlen(names[si]) > 108)
        ec_bput(&e.out, "%sMDL_FN MdlKernelFn", si ? ";\n" : ""), col = 18;
      else
        ec_bput(&e.out, ",");
      ec_bput(&e.out, " %s", names[si]);
      col += (int)strlen(names[si]) + 2;
    }
    ec_bput(&e.out, ";\n");
    ec_bappend(&e.out, &body);
    free(body.s);
    free(part);
    ec_bput(&e.out, "\n#if MDL_IN(0)\n// The whole step, kernel after kernel.\n");
    ec_bput(&e.out, "void mdl_step(char *arena, const MdlHooks *h) {\n");
    for (int si = 0; si < f->nsteps; si++)
      ec_bput(&e.out, "  %s(arena, h);\n", names[si]);
    ec_bput(&e.out, "}\n\nconst MdlKernel mdl_kernels[] = {\n");
    for (int si = 0; si < f->nsteps; si++)
      ec_bput(&e.out, "    {\"%s\", %s},\n", names[si], names[si]);
    ec_bput(&e.out, "};\nconst int mdl_nkernels = %d;\n", f->nsteps);
    ec_bput(&e.out, "const int64_t mdl_arena_bytes = %lld;\n#endif\n", (long long)m->arena_bytes);
    text = arena_alloc(g->arena, e.out.len + 1);
    memcpy(text, e.out.s, e.out.len);
  }
  for (int si = 0; si < f->nsteps; si++) {
    free(ks[si].head);
    free(ks[si].code);
    free(ks[si].shared);
    free(ks[si].key);
    free(ks[si].off);
  }
  free(ks);
  free(names);
  free(e.out.s);
  free(e.notes.s);
  free(e.declared);
  free(e.decls);
  ew_close(&e.core);
  return text;
}
