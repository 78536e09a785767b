// test_prelude: each prelude of the emitted modules compiles on its own, as mdlc embeds it (the
// concatenation of its pieces in runtime/kernels/: prelude_libc.h, abi.h and prelude.h for C, then
// prelude_bf16.h; cuda_*.cuh and cuda_args.h for CUDA), so that an error in one shows here without a
// model: the C ones with cc -fsyntax-only and the warnings the C back end's tests ask for, the CUDA
// one with NVRTC for sm_80 and sm_90 without a warning. So do the pieces as the headers they also
// are: the C ones included one after the other, the runtime's headers that include the module ABI
// (backend.h: abi.h; emit_cuda.h: cuda_args.h), and the CUDA ones included in order with the CUDA
// emulator. So do the kernel templates of the CUDA prelude, instantiated as the emitter instantiates
// them at shapes that cover their parameters (template_instances): with NVRTC, and as C++ with the
// CUDA emulator (tests/unit/cuda_emu.h) as the emulated modules are compiled.
#include "emit_common.h"
#include "emit_cuda.h"
#include "test.h"
#include "harness.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static bool c_compiles_clean(const char *src, char *why, size_t n) {
  return compiles_clean("cc -std=c11 -fopenmp -fsyntax-only -Wall -Wextra -Werror -x c %s", src, why, n);
}

// The files that `includes` (lines `#include "NAME"`) names in runtime/kernels/, one after the other
// (NULL when one cannot be read): what the embedding concatenates, if the order is the Makefile's.
static char *pieces_text(const char *includes) {
  size_t len = 0, cap = 1 << 18;
  char *s = malloc(cap);
  for (const char *p = strchr(includes, '"'); p; p = strchr(strchr(p + 1, '"') + 1, '"')) {
    char path[256];
    snprintf(path, sizeof path, "runtime/kernels/%.*s", (int)(strchr(p + 1, '"') - p - 1), p + 1);
    FILE *f = fopen(path, "rb");
    if (!f) {
      free(s);
      return NULL;
    }
    len += fread(s + len, 1, cap - 1 - len, f);
    fclose(f);
  }
  s[len] = '\0';
  return s;
}

// The pieces of the preludes included as headers (-Iruntime/kernels), the C ones in the order of the
// Makefile's PRELUDES, with the module's warnings; and the runtime's headers that include the ABI's
// pieces, as the runtime is compiled (the project's include folders, -D_GNU_SOURCE).
static const char c_pieces[] = "#include \"prelude_libc.h\"\n#include \"abi.h\"\n#include \"prelude.h\"\n"
                               "#include \"prelude_bf16.h\"\n"
                               "#include \"fp8_bits.h\"\n#include \"prelude_c_fp8.h\"\n";
static const char runtime_abi[] = "#include \"mdl.h\"\n#include \"backend.h\"\n#include \"emit_cuda.h\"\n"
                                  "_Static_assert(sizeof(MdlArgs) == CUDA_MAX_ARGS * sizeof(int64_t), \"b\");\n"
                                  "int main(void) { MdlHooks h = {0}; MdlKernel k = {0}; MdlStatus s = {0};\n"
                                  "  return (int)(h.nthreads + (k.fn != 0) + s.code); }\n";
static const char cuda_pieces[] = "#include \"cuda_base.cuh\"\n#include \"cuda_args.h\"\n"
                                  "#include \"cuda_common.cuh\"\n#include \"cuda_mma.cuh\"\n"
                                  "#include \"fp8_bits.h\"\n#include \"cuda_fp8.cuh\"\n#include \"cuda_reduce.cuh\"\n"
                                  "#include \"cuda_attention.cuh\"\n#include \"cuda_ce.cuh\"\n"
                                  "#include \"cuda_opt.cuh\"\n";

// The prelude and kernels that instantiate its templates as the emitters do, one kernel each: attention
// (mdl_att_fwd, mdl_att_dq, mdl_att_dkv) at heads of 64 (two tile buffers) and 128 (one), 4 and 8
// warps, shapes alternating between (causal, within documents, bf16 rows by cp.async, int indices, the
// log-sum-exp, a bf16 copy of the output) and (neither, bf16 rows loaded 4 channels at a time for q
// and f32 ones for the others, int64_t indices, f32 output), dk and dv alone once each; grouped kv
// heads in a window, and keys of another length; cross-entropy
// rows (mdl_ce_row) by a block or a warp, 8 bf16 or 4 f32 logits a load or one at a time, with the loss
// and / or the gradient; the optimizer's kernels (mdl_opt_sumsq, mdl_opt_norm, mdl_opt_update).
static char *template_instances(void) {
  size_t cap = 1 << 17, len = strlen(ec_prelude_cuda);
  char *s = malloc(len + cap), *p = s + len;
  memcpy(s, ec_prelude_cuda, len);
  const char *end = s + len + cap;
  int i = 0;
  for (int d = 64; d <= 128; d += 64)
    for (int w = 4; w <= 8; w += 4, i++) {
      bool tight = i % 2 == 0; // causal, within documents, cp.async
      int stages = d == 64 ? 2 : 1;
      long c = 12L * d, stride = 3 * c;
      p += snprintf(p, (size_t)(end - p),
                    "\ntypedef mdl_att_shape<%s, 2, 200, 12, %d, %ld, %d, %s, %s, %d> S%d;\n"
                    "typedef mdl_att_rows<uint16_t, %ld, %s> Q%d;\n"
                    "typedef mdl_att_rows<%s, %ld, false> R%d;\n",
                    tight ? "int" : "int64_t", d, c, w, tight ? "true" : "false", tight ? "true" : "false", stages, i,
                    stride + (tight ? 0 : 4), tight ? "true" : "false", i, tight ? "uint16_t" : "float", stride, i);
      const char *ptrs = "  uint16_t *h = (uint16_t *)arena;\n  float *f = (float *)(arena + (64 << 20));\n"
                         "  int32_t *doc = (int32_t *)(arena + (128 << 20));\n";
      char qkv[256];
      if (tight)
        snprintf(qkv, sizeof qkv, "Q%d{h}, Q%d{h + %ld}, Q%d{h + %ld}", i, i, c, i, 2 * c);
      else
        snprintf(qkv, sizeof qkv, "Q%d{h}, R%d{f}, R%d{f + %ld}", i, i, i, c);
      p += snprintf(p, (size_t)(end - p),
                    "extern \"C\" __global__ void __launch_bounds__(%d) fwd%d(char *arena) {\n%s"
                    "  mdl_att_fwd<S%d, %s>(%s, %s, f + (8 << 20), mdl_att_out<%s, %d>{f + (12 << 20), {%s}}, "
                    "0.18033688f);\n}\n",
                    32 * w, i, ptrs, i, tight ? "true" : "false", qkv, "doc",
                    tight ? "false" : "true", tight ? 1 : 0, tight ? "h + (16 << 20)" : "nullptr");
      char dq[64];
      snprintf(dq, sizeof dq, tight ? "Q%d{h + (20 << 20)}" : "R%d{f + (20 << 20)}", i);
      p += snprintf(p, (size_t)(end - p),
                    "extern \"C\" __global__ void __launch_bounds__(%d) dq%d(char *arena) {\n%s"
                    "  mdl_att_dq<S%d>(%s, %s, %s, f + (8 << 20), f + (9 << 20), f + (12 << 20), 0.18033688f, "
                    "0.125f);\n}\n",
                    32 * w, i, ptrs, i, qkv, dq, "doc");
      for (int k = 0; k < (i == 0 ? 3 : 1); k++) // dk and dv, then (the first shape) dk alone, dv alone
        p += snprintf(p, (size_t)(end - p),
                      "extern \"C\" __global__ void __launch_bounds__(%d) dkv%d_%d(char *arena) {\n%s"
                      "  mdl_att_dkv<S%d, %s, %s>(%s, %s, %s, f + (8 << 20), f + (9 << 20), f + (12 << 20), "
                      "f + (16 << 20), 0.18033688f, 0.125f);\n}\n",
                      32 * w, i, k, ptrs, i, k != 2 ? "true" : "false", k != 1 ? "true" : "false", qkv, dq,
                      "doc");
    }
  // Grouped heads: 4 kv heads (of 64 channels, k and v halves of one [B,T,512] buffer) for 12 query
  // heads, causal within documents in a window of 100 (SG); and 150 keys for 200 queries, not causal
  // (SX: k and v rows of their own length).
  const char *ptrs = "  uint16_t *h = (uint16_t *)arena;\n  float *f = (float *)(arena + (64 << 20));\n"
                     "  int32_t *doc = (int32_t *)(arena + (128 << 20));\n";
  p += snprintf(p, (size_t)(end - p), "%s",
                "\ntypedef mdl_att_shape<int, 2, 200, 12, 64, 768, 8, true, true, 2, 4, 200, 100> SG;\n"
                "typedef mdl_att_shape<int64_t, 2, 200, 12, 64, 768, 4, false, false, 2, 4, 150, 0> SX;\n"
                "typedef mdl_att_rows<uint16_t, 768, true> QG;\n"
                "typedef mdl_att_rows<uint16_t, 512, true> KG;\n"
                "typedef mdl_att_rows<uint16_t, 512, false, 150> KX;\n");
  for (int x = 0; x < 2; x++) {
    const char *sh = x ? "SX" : "SG", *kv = x ? "KX{h + (4 << 20)}, KX{h + (4 << 20) + 256}"
                                              : "KG{h + (4 << 20)}, KG{h + (4 << 20) + 256}";
    p += snprintf(p, (size_t)(end - p),
                  "extern \"C\" __global__ void __launch_bounds__(%d) fwd_%s(char *arena) {\n%s"
                  "  mdl_att_fwd<%s, true>(QG{h}, %s, doc, f + (8 << 20), mdl_att_out<true, 1>{f + (12 << 20), "
                  "{h + (16 << 20)}}, 0.18033688f);\n}\n"
                  "extern \"C\" __global__ void __launch_bounds__(%d) dq_%s(char *arena) {\n%s"
                  "  mdl_att_dq<%s>(QG{h}, %s, QG{h + (20 << 20)}, doc, f + (8 << 20), f + (9 << 20), f + (12 << 20), "
                  "0.18033688f, 0.125f);\n}\n"
                  "extern \"C\" __global__ void __launch_bounds__(%d) dkv_%s(char *arena) {\n%s"
                  "  mdl_att_dkv<%s, true, true>(QG{h}, %s, QG{h + (20 << 20)}, doc, f + (8 << 20), f + (9 << 20), "
                  "f + (12 << 20), f + (16 << 20), 0.18033688f, 0.125f);\n}\n",
                  x ? 128 : 256, sh, ptrs, sh, kv, x ? 128 : 256, sh, ptrs, sh, kv, x ? 128 : 256, sh, ptrs, sh, kv);
  }
  p += snprintf(p, (size_t)(end - p), "%s",
                "extern \"C\" __global__ void __launch_bounds__(1024) ce0(char *arena, MdlStatus *status) {\n"
                "  __shared__ double sh_d[48];\n  __shared__ float sh_f[32];\n"
                "  uint16_t *x = (uint16_t *)arena + blockIdx.x * 50304;\n"
                "  float *f = (float *)(arena + (256 << 20));\n"
                "  mdl_ce_row<int, 50257, 1024, 8, true, true>(x, x, 7, f + blockIdx.x, f + 8192, status, threadIdx.x, "
                "sh_f, sh_d);\n}\n"
                "extern \"C\" __global__ void __launch_bounds__(256) ce1(char *arena, MdlStatus *status) {\n"
                "  float *x = (float *)arena + (blockIdx.x * 8 + (threadIdx.x >> 5)) * 256, *f = x + (64 << 20);\n"
                "  mdl_ce_row<int64_t, 256, 32, 4, false, true>(x, f, 7, nullptr, f + 1, status, threadIdx.x & 31, "
                "nullptr, nullptr);\n}\n"
                "extern \"C\" __global__ void __launch_bounds__(256) ce2(char *arena, MdlStatus *status) {\n"
                "  float *x = (float *)arena + (blockIdx.x * 8 + (threadIdx.x >> 5)) * 1001, *f = x + (64 << 20);\n"
                "  mdl_ce_row<int, 1001, 32, 0, true, false>(x, (float *)nullptr, 7, f, nullptr, status, "
                "threadIdx.x & 31, nullptr, nullptr);\n}\n"
                "static __device__ const MdlSeg segs[3] = {{0, 4096, 8192, 12288, -1, 1000, 0, 0.1, 1.0}, "
                "{16384, 20480, 24576, 28672, 32768, 3000, 1000, 0.0, 0.5}, "
                "{40000, 44000, 48000, 52000, -1, 9, 4000, 0.1, 1.0}};\n"
                "extern \"C\" __global__ void __launch_bounds__(256) opt0(char *arena) {\n"
                "  __shared__ double sh_d[48];\n"
                "  mdl_opt_sumsq<3, 4009, 8192, 4>(arena, segs, (double *)(arena + 65536), sh_d);\n}\n"
                "extern \"C\" __global__ void __launch_bounds__(256) opt1(char *arena) {\n"
                "  __shared__ double sh_d[48];\n"
                "  mdl_opt_norm<1>((double *)(arena + 65536), (float *)(arena + 65600), sh_d);\n}\n"
                "extern \"C\" __global__ void __launch_bounds__(256) opt2(char *arena) {\n"
                "  const MdlAdamW h = {1.0, 1e-3, 0.9, 0.95, 1e-8, 10.0, 20.0};\n"
                "  mdl_opt_update<0, 2, 3, 4009, 8192, 2, true>(arena, segs, h);\n}\n"
                "extern \"C\" __global__ void __launch_bounds__(256) opt3(char *arena) {\n"
                "  const MdlAdamW h = {1.0, 1e-3, 0.9, 0.95, 1e-8, 10.0, 20.0};\n"
                "  const MdlSeg seg[1] = {{0, 4096, 8192, 12288, -1, 1000, 0, 0.1, 1.0}};\n"
                "  mdl_opt_update<0, 2, 1, 1000, 8192, 2, false>(arena, seg, h);\n}\n"
                "extern \"C\" __global__ void __launch_bounds__(256) opt4(char *arena) {\n"
                "  const MdlAdamW h = {1.0, 1e-3, 0.9, 1.0, 0.0, 1.0, 1.0};\n"
                "  mdl_opt_update<1, 1, 3, 4009, 8192, 2, true>(arena, segs, h);\n}\n"
                "extern \"C\" __global__ void __launch_bounds__(256) opt5(char *arena) {\n"
                "  const MdlAdamW h = {1.0, 1e-3, 0.0, 0.0, 0.0, 1.0, 1.0};\n"
                "  mdl_opt_update<1, 0, 3, 4009, 8192, 2, false>(arena, segs, h);\n}\n"
                "extern \"C\" __global__ void __launch_bounds__(256) opt6(char *arena) {\n"
                "  const MdlAdamW h = {1.0, 1e-4, 0.9, 0.99, 0.0, 1.0, 1.0};\n"
                "  mdl_opt_update<2, 1, 3, 4009, 8192, 2, true>(arena, segs, h);\n}\n");
  return s;
}

int main(void) {
  char why[1024];
  CHECK(c_compiles_clean(ec_prelude_c, why, sizeof why),
        "prelude: the C prelude (runtime/kernels/prelude_libc.h, abi.h, prelude.h) compiles as C11 without a warning",
        "%s", why);
  size_t n = strlen(ec_prelude_c), nb = strlen(ec_prelude_c_bf16);
  char *both = malloc(n + nb + 1);
  memcpy(both, ec_prelude_c, n);
  memcpy(both + n, ec_prelude_c_bf16, nb + 1);
  CHECK(c_compiles_clean(both, why, sizeof why),
        "prelude: runtime/kernels/prelude_bf16.h after prelude.h compiles as C11 without a warning", "%s", why);
  free(both);
  char *c_text = pieces_text(c_pieces), *cuda_text = pieces_text(cuda_pieces);
  size_t nc = strlen(ec_prelude_c), nc16 = strlen(ec_prelude_c_bf16), nf8 = strlen(ec_prelude_fp8);
  CHECK(c_text && !strncmp(c_text, ec_prelude_c, nc) && !strncmp(c_text + nc, ec_prelude_c_bf16, nc16) &&
            !strncmp(c_text + nc + nc16, ec_prelude_fp8, nf8) &&
            !strcmp(c_text + nc + nc16 + nf8, ec_prelude_c_fp8),
        "prelude: the C preludes are their pieces in runtime/kernels/ one after the other (c_pieces)", "%s",
        c_text ? "the text differs" : "a piece cannot be read");
  CHECK(cuda_text && !strcmp(cuda_text, ec_prelude_cuda),
        "prelude: the CUDA prelude is its pieces in runtime/kernels/ one after the other (cuda_pieces)", "%s",
        cuda_text ? "the text differs" : "a piece cannot be read");
  free(c_text);
  free(cuda_text);
  CHECK(compiles_clean("cc -std=c11 -fopenmp -fsyntax-only -Wall -Wextra -Werror -Iruntime/kernels -x c %s", c_pieces,
                       why, sizeof why),
        "prelude: the C prelude's pieces and the bf16 and fp8 ones compile as headers, in order, without a warning",
        "%s", why);
  CHECK(compiles_clean("cc -std=c11 -D_GNU_SOURCE -fsyntax-only -Wall -Wextra -Werror -Icompiler -Icompiler/emit "
                       "-Iruntime/engine -Iruntime/kernels -x c %s", runtime_abi, why, sizeof why),
        "prelude: the runtime's backend.h (with abi.h) and emit_cuda.h (with cuda_args.h) compile as C11", "%s", why);

  char *att = template_instances();
  if (system("g++ --version >/dev/null 2>&1") == 0)
    CHECK(compiles_clean("g++ -std=c++17 -O1 -fopenmp -c -o /dev/null -Wall -Wextra -Werror -Wno-unknown-pragmas "
                         "-Wno-unused-parameter -Itests/unit -Iruntime/kernels -include cuda_emu.h -x c++ %s", att, why, sizeof why),
          "prelude: the kernel templates compile as C++ with the CUDA emulator without a warning", "%s", why);
  else
    printf("[skip] prelude: the kernel templates with the CUDA emulator: no g++\n");
  if (system("g++ --version >/dev/null 2>&1") == 0)
    CHECK(compiles_clean("g++ -std=c++17 -fsyntax-only -Wall -Wextra -Werror -Wno-unknown-pragmas "
                         "-Wno-unused-parameter -Itests/unit -Iruntime/kernels -include cuda_emu.h -x c++ %s",
                         cuda_pieces, why, sizeof why),
          "prelude: the CUDA prelude's pieces compile as headers, in order, with the CUDA emulator", "%s", why);

  if (!nvrtc_available(why, sizeof why)) {
    printf("[skip] prelude: the CUDA prelude with NVRTC: %s\n", why);
    free(att);
    TEST_EXIT();
  }
  const char *archs[] = {"sm_80", "sm_90"};
  for (int i = 0; i < 2; i++) {
    for (int t = 0; t < 2; t++) {
      NvrtcResult r = {0};
      bool ok = nvrtc_compile(t ? att : ec_prelude_cuda, archs[i], &r, why, sizeof why);
      char name[160];
      snprintf(name, sizeof name, "prelude: %s with NVRTC for %s without a warning",
               t ? "the kernel templates, instantiated, compile" : "the CUDA prelude compiles", archs[i]);
      CHECK(ok && !r.log, name, "%.600s", ok ? r.log : why);
      free(r.cubin);
      free(r.log);
    }
  }
  free(att);
  TEST_EXIT();
}
