// test_cuda_emit.c: the CUDA emitter, on a machine without a GPU. Every model is emitted as the fp32
// graph and as the bf16 one (precision_assign: GEMM operands through CASTs to bf16).
//  1. NVRTC: every model in models/ (gpt2-tiny, gpt2 124M, llama-tiny, mlp), fp32 and bf16, fused and
//     unfused, llama 125M, a model of grouped, windowed and cross attention (attnkv) and one of sixteen
//     attention lines over one q, k and v (manyreads: sums of gradients cut to fit) as they train,
//     emits a module that NVRTC compiles for sm_80, sm_86 and sm_90 (bf16 fused also for
//     sm_100 and sm_120, with NVRTC 12.8 or later) without an error or a warning;
//     GPT-2 124M's module compiles cold and a second compile is a cache hit (times printed, not
//     asserted); a changed source or another arch misses the cache; a module that does not compile
//     comes back with NVRTC's error; SHA-256 against FIPS 180-2 vectors. As the engine compiles it,
//     several programs at once (GPT-2 124M as 3, gpt2-tiny a program per kernel): a cubin each, every
//     kernel in exactly one, all from the cache the second time (see test_nvrtc_units). ptxas's
//     report on GPT-2's bf16 module for sm_90 names every kernel and no attention kernel spills.
//  2. The plan: emitting twice gives the same text; a unit per kernel (CudaUnit), each holding its one
//     kernel's definition, none in the head before them; every launch names a kernel of the source, every
//     GEMM and kernel argument lies inside the device arena (GEMM extents by their element types), a
//     bf16 GEMM result has no epilogue and beta 0; GPT-2 124M's twelve layers share their kernels (fp32
//     and bf16); the GEMM epilogues of gpt2-tiny (bias on qkv, bias + GELU on the MLP, with the
//     pre-GELU value kept for the backward) and a GELU epilogue without bias; in bf16, gpt2-tiny's
//     GEMMs read bf16 into f32 (the MLP's GELU, only kept rounded, moves to the epilogue kernel) and
//     its LM head's dx and dW GEMMs read bf16 dlogits from a chunk of their own; the wide model's
//     (x @ w) and its gradient, only read rounded, are written as bf16 by their GEMMs into the CASTs.
//     Attention: bf16 forwards and the backward's statistics, dq and dk, dv kernels with heads of 16
//     (gpt2-tiny) and 32 (attn) call the tensor cores' mma, with heads of 12 (attn-d12) they fall back
//     to the CUDA-core kernels; bf16 kernels round, fp32 ones do not.
//  3. Emulation: each module is compiled as C++ with tests/unit/cuda_emu.h (g++ -O1, no warning) and its
//     schedule run on the CPU, the GEMMs by a reference GEMM in double (f32 or bf16 operands and
//     result, as the plan says) with the same epilogues. On gpt2-tiny (B=2, T=16), llama-tiny (B=1,
//     T=80: keys in several tiles), the MLP, a model of every other op family, one of wide rows and
//     two of attention (heads of 32 and of 12: on tensor cores in bf16 or not), two of grouped-query,
//     multi-query, sliding-window and cross attention (attnkv: heads of 32 and of 12), one of norm backwards
//     whose rows are staged in shared memory (more rows than groups of rows), one of a tied embedding
//     whose table ends in a partial group of the backward's stores, manyreads, fp32 and bf16, fused
//     and unfused (bf16 unfused: the first three; the models after the wide one fused only), after one step
//     against the interpreter (INTERP_F32) on the same graph: the loss, every gradient and the AdamW
//     moments within 1e-5 relative per tensor (max |cuda - interp| / max |interp|) in fp32, and in
//     bf16 the loss within 1e-4, the gradients within 3e-3 and the moments within 4e-3 in L2 per
//     tensor, with some gradient off the fp32 graph's by over 4e-3 (see test_emulation); the
//     parameters agree within 1e-6 with AdamW computed here from the emulated gradients; a second step
//     gives bit-identical values (where kernels have variants, the variants' step: the whole arena);
//     a target >= V and a token id >= V are reported through the status argument; where the kernels
//     use ldmatrix (the tensor-core attention), every 8 x 8 tile it reads takes one pass of shared
//     memory's banks (the emulator counts the conflicts). Attention alone (q, k, v parameters) in
//     bf16, on tensor cores and not, with a kv head for each head and with one for both in a window,
//     against the interpreter: the output within 2e-5 where keys fit one tile, 1e-3 over several, dq,
//     dk and dv within 3e-5 (see test_attention_alone). A bf16 LM
//     head whose logits are exact products: the interpreter's loss of the logits rounded to bf16
//     within 1e-6, fused and unfused (see test_lmhead_rounding).
//  4. The optimizers other than AdamW (SGD with and without momentum, Lion, Muon; lr_scale, freeze,
//     clipping) on small MLPs: NVRTC compiles each module for sm_80 and sm_90, and 10 emulated steps
//     leave every parameter and moment within 1e-5 of the interpreter's, a frozen parameter bit for
//     bit as it was (see test_optimizers).
#include "mdl.h"
#include "backend.h"
#include "cuda.h"
#include "emit_cuda.h"
#include "runtime.h"
#include "test.h"
#include "harness.h"
#include "cubin_syms.h"
#include "cuda_emu_host.h"

#include <dirent.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

// The op families the models leave out, forward and backward: transcendental unary ops, division,
// reductions over inner and outer axes (one long enough for partial sums), max, softmax, permute and
// transpose, batched matmuls (one broadcasting its batch), concat and split, layernorm, rmsnorm, rope,
// attention neither causal nor within documents, dropout, relu, silu and an untied LM head.
static const char allops[] =
    "model allops\n"
    "dim B = 2\n"
    "dim T = 40\n"
    "dim C = 16\n"
    "dim V = 64\n"
    "input x: f32[B, T, C]\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input pos: i32[B, T]\n"
    "param w: [C, C] = normal(0.3)\n"
    "param b: [C] = zeros\n"
    "param g: [C] = ones\n"
    "param big: [192, 256] = normal(0.1)\n"
    "param tab: [V, C] = normal(0.5)\n"
    "param head: [C, V] = normal(0.3)\n"
    "e = embed(tab, tokens) + x\n"
    "a = tanh(e @ w + b)\n"
    "s = softmax(a * 2.0)\n"
    "m = max(a, axis=2, keepdim=true)\n"
    "u = exp(a - m) / sum(exp(a - m), axis=1, keepdim=true)\n"
    "p = permute(u, [0, 2, 1])\n"
    "bm = p @ transpose(p, 1, 2)\n"
    "wp = w @ p\n"
    "c1, c2 = split(concat([s, u], axis=-1), 2)\n"
    "r = rope(c1 * sqrt(g * g + 1.0), pos, heads=2)\n"
    "q = rmsnorm(r, g) + layernorm(c2, g)\n"
    "att = dropout(attention(q, silu(q), gelu(q), heads=2), p=0.25)\n"
    "h = relu(att) - neg(rsqrt(a * a + 1.0)) + log(a * a + 2.0)\n"
    "h = h + sigmoid(att) * abs(att - 0.1) + clamp(att, min=-0.2, max=0.3) + clamp(a, max=0.5) * stop_gradient(a)\n"
    "h = h + where(att > 0.05, att, 0.5 * att) + where(a <= -0.1, 1.0, a * a) * (a != 0.3) + (att >= a) * a\n"
    "h = h + 0.1 * log_softmax(att, axis=1) + softmax(a, axis=0)\n"
    "extra = mean(bm) + mean(wp * wp) + 0.001 * sum(reshape(big * big, [49152])) + mean(max(big, axis=0))\n"
    "more = 0.01 * mean(sum(big * big, axis=0)) + 0.1 * max(reshape(big, [49152]), axis=0)\n"
    "output loss = mean(cross_entropy(h @ head, targets)) + extra + more\n";

// Rows longer than a warp takes (layernorm, rmsnorm, softmax and cross-entropy by blocks of threads),
// attention heads of 32 channels, a GEMM with a GELU epilogue and no bias, an embedding of odd width.
static const char wide[] =
    "model wide\n"
    "dim B = 2\n"
    "dim T = 4\n"
    "dim C = 1100\n"
    "dim V = 2200\n"
    "dim E = 64\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "param tab: [V, C] = normal(0.02)\n"
    "param tab3: [V, 3] = normal(0.5)\n"
    "param w: [C, E] = normal(0.03)\n"
    "param wg: [E, E] = normal(0.2)\n"
    "param g: [C] = ones\n"
    "param bb: [C] = zeros\n"
    "param head: [C, V] = normal(0.02)\n"
    "x = layernorm(embed(tab, tokens), g, bb)\n"
    "h = gelu((x @ w) @ wg)\n"
    "a = attention(h, h, h, heads=2)\n"
    "y = rmsnorm(x + softmax(x * 3.0), g)\n"
    "p3 = embed(tab3, tokens)\n"
    "output loss = mean(cross_entropy(y @ head, targets)) + mean(a * a) + 0.1 * mean(p3 * p3)\n";

// Attention with several query and key tiles (T = 80), causal without documents (whole tiles skip
// the mask) and within documents without causality, after a qkv GEMM; with C = 64 its heads of 32
// run on tensor cores in bf16, with C = 24 (heads of 12) they do not. The causal one feeds a GEMM:
// in bf16 the attention kernel writes the operand's rounding itself. v is also read as it is (f32),
// so in bf16 q and k are slices of the qkv GEMM's rounding and v's rounding is one too, beside the
// f32 slice.
static const char attn[] =
    "model attn\n"
    "dim B = 2\n"
    "dim T = 80\n"
    "dim C = 64\n"
    "dim H = 2\n"
    "dim V = 64\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input doc: i32[B, T]\n"
    "param wte: [V, C] = normal(0.5)\n"
    "param wqkv: [C, 3*C] = normal(0.3)\n"
    "param head: [C, V] = normal(0.3)\n"
    "param wo: [C, C] = normal(0.3)\n"
    "q, k, v = split(embed(wte, tokens) @ wqkv, 3, axis=-1)\n"
    "a = attention(q, k, v, heads=H, causal=true) @ wo + attention(q, k, v, heads=H, doc=doc) + v\n"
    "output loss = mean(cross_entropy(a @ head, targets))\n";

// An embedding whose backward has a bucket of table rows with most positions (ids 0-31, 1280 of 1600:
// 40 steps of 32 over 7 chunks of 256 positions, the last partial) and one with the rest (ids 40-63);
// rows of 300 columns: two blocks of 8 warps per bucket, the second's warp 1 partly past the row, its
// last six wholly.
static const char hot[] =
    "model hot\n"
    "dim B = 4\n"
    "dim T = 400\n"
    "dim C = 300\n"
    "dim V = 64\n"
    "input hot: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "param tab: [V, C] = normal(0.5)\n"
    "param head: [C, V] = normal(0.3)\n"
    "output loss = mean(cross_entropy(embed(tab, hot) @ head, targets))\n";

// A tied embedding of 75 rows of 40, ids from 74 down: its backward adds the LM head's gradient to
// the table's as it stores it, eight table rows a group; the third bucket's 11 rows end in a group
// partly past the table (its loads from the last row, nothing stored past it); the second warp of a
// bucket has 24 columns past the row.
static const char tied[] =
    "model tied\n"
    "dim B = 2\n"
    "dim T = 24\n"
    "dim C = 40\n"
    "dim V = 75\n"
    "input tail: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "param tab: [V, C] = normal(0.5)\n"
    "param g: [C] = ones\n"
    "param bb: [C] = zeros\n"
    "output loss = mean(cross_entropy(layernorm(embed(tab, tail), g, bb) @ tab.T, targets))\n";

// Norm backwards over more rows than their 1024 groups of rows (1125 rows: groups of 2, the last of
// 1), with rows of 264 (a block of 64 threads a row, 5 elements a thread, the last partly past the
// row): the rows are staged in shared memory by cp.async, x, dy and the residual gradient the chain
// after dx adds.
static const char normrows[] =
    "model normrows\n"
    "dim B = 3\n"
    "dim T = 375\n"
    "dim C = 264\n"
    "dim V = 64\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "param tab: [V, C] = normal(0.5)\n"
    "param g: [C] = ones\n"
    "param bb: [C] = zeros\n"
    "param g2: [C] = ones\n"
    "param w: [C, C] = normal(0.05)\n"
    "param head: [C, V] = normal(0.05)\n"
    "e = embed(tab, tokens)\n"
    "x = e + layernorm(e, g, bb) @ w\n"
    "y = x + rmsnorm(x, g2) @ w\n"
    "output loss = mean(cross_entropy(y @ head, targets))\n";

// Grouped-query, multi-query, sliding-window and cross attention, T = 150 (three tiles of 64, windows
// across them): kv_heads=2 of 4 causal within documents in a window of 70, kv_heads=1 in a window of
// 100, kv_heads=2 over the S = 70 rows of an f32 input. With C = 128 the heads of 32 run on tensor
// cores in bf16; with C = 48 (heads of 12) on the CUDA-core kernels.
static const char attnkv[] =
    "model attnkv\n"
    "dim B = 2\n"
    "dim T = 150\n"
    "dim C = 128\n"
    "dim S = 70\n"
    "dim V = 64\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "input doc: i32[B, T]\n"
    "input ctx: f32[B, S, C]\n"
    "param wte: [V, C] = normal(0.5)\n"
    "param wq: [C, C] = normal(0.1)\n"
    "param wkv: [C, C] = normal(0.1)\n"
    "param wm: [C, C / 2] = normal(0.1)\n"
    "param wc: [C, C] = normal(0.1)\n"
    "param head: [C, V] = normal(0.3)\n"
    "x = embed(wte, tokens)\n"
    "k, v = split(x @ wkv, 2, axis=-1)\n"
    "a = attention(x @ wq, k, v, heads=4, kv_heads=2, causal=true, doc=doc, window=70) + x\n"
    "k1, v1 = split(a @ wm, 2, axis=-1)\n"
    "b = attention(a @ wq, k1, v1, heads=4, kv_heads=1, causal=true, window=100) + a\n"
    "kc, vc = split(ctx @ wc, 2, axis=-1)\n"
    "c = attention(b, kc, vc, heads=4, kv_heads=2) + b\n"
    "output loss = mean(cross_entropy(c @ head, targets))\n";
// Routing for a mixture of experts (topk, gather, scatter_add): a token's top-2 of 4 experts, each
// expert's 6 tokens by priority (many ties at 0, broken by the lower index), their gather, batched
// expert matmuls and the combine's scatter-add onto the residual; then indices from the batch
// ("idx", -1 to 5 along an axis of 4: some out of range) read by a gather and a scatter-add.
static const char routing[] =
    "model routing\n"
    "dim N = 16\n"
    "dim C = 8\n"
    "dim E = 4\n"
    "input x: f32[N, C]\n"
    "input idx: i32[N, 3]\n"
    "param wr: [C, E] = normal(0.5)\n"
    "param w1: [E, C, C] = normal(0.3)\n"
    "param w2: [C, C] = normal(0.3)\n"
    "t = tanh(x @ w2)\n"
    "probs = softmax(t @ wr)\n"
    "gate, choice = topk(probs, 2)\n"
    "gates = scatter_add(probs * 0.0, choice, gate, axis=1)\n"
    "prio, slot = topk(transpose((gates > 0.0) * (1.0 + probs), 0, 1), 6)\n"
    "weight = gather(transpose(gates, 0, 1), slot, axis=1)\n"
    "tok = reshape(slot, [E * 6, 1])\n"
    "ye = tanh(reshape(gather(t, tok, axis=0), [E, 6, C]) @ w1) * reshape(weight, [E, 6, 1])\n"
    "y = scatter_add(t, tok, reshape(ye, [E * 6, C]), axis=0)\n"
    "o = gather(y[:, 0:4], idx, axis=1)\n"
    "s = scatter_add(y[:, 4:8], idx, o * o, axis=1)\n"
    "output loss = mean(s * s) + mean(y * y) + mean(prio)\n";
// Elementwise min and max (broadcast, with a number) and the min and max reductions; integer
// arithmetic on i32 (both signs of // and %, a divisor of 0, products that wrap around), comparisons
// and where on integers, float() and int() (toward zero, both signs), an integer condition; conv1d
// causal and not, depthwise and full (with a bias); a repeat index in an init, a slice and causal=.
// The gradients of pk and pq are the integer values themselves (times 0.001): compared exactly.
static const char newops[] =
    "model newops\n"
    "dim B = 2\n"
    "dim T = 8\n"
    "dim C = 16\n"
    "dim V = 64\n"
    "input x: f32[B, T, C]\n"
    "input targets: i32[B, T]\n"
    "input hot: i32[B, T]\n"
    "input pos: i32[B, T]\n"
    "param w: [C, C] = normal(0.3)\n"
    "param b: [C] = normal(0.1)\n"
    "param head: [C, V] = normal(0.3)\n"
    "param wd: [4, C] = normal(0.3)\n"
    "param wc: [3, C, C] = normal(0.2)\n"
    "param pk: [B, T] = normal(1)\n"
    "param pq: [B, T, C] = normal(1)\n"
    "a = tanh(x @ w + b)\n"
    "h = max(a, 0.1 * a) + min(a, b + 0.05) - max(a, axis=1, keepdim=true) + min(a, axis=2, keepdim=true)\n"
    "h = h + max(min(a, 0.3), -0.2) * min(x, b)\n"
    "k = (pos - 3) // 2 * 3 + (pos - 3) % -2 - pos % (pos - 1) + max(pos, 2) * min(-pos, -1) + abs(pos - 4) * -pos\n"
    "k = k + (hot * 100000000) % 1000 + (-hot) // (pos - 2) + where(pos >= 2, pos, 7)\n"
    "f = reshape(float(k) * 0.01 + (pos == 2) + (k < 1), [B, T, 1])\n"
    "h = h * (1.0 + 0.1 * f) + float(int(a * 3.0)) * a + where(reshape(pos % 2, [B, T, 1]), a, -a)\n"
    "h = h + conv1d(a, wd, causal=true) + conv1d(h, wc, b)\n"
    "repeat r[2] as i {\n  param wr: [C, C] = normal(0.1 * (i + 1))\n"
    "  h = h + conv1d(h, wr[0:i + 1, :], causal=i == 0)\n}\n"
    "ints = 0.001 * sum(float(k) * pk) + 0.001 * sum(float(int(a * 3.0)) * pq)\n"
    "output loss = mean(cross_entropy(h @ head, targets)) + ints\n";

// Sixteen attention lines over one q, k and v: their gradients are sums of sixteen values, which the
// fusion pass cuts into kernels of at most FUSE_MAX_BUFFERS buffers (one kernel would address 48).
#define MANY_ATTN "x = x + attention(q, k, v, heads=H, causal=true) @ wo\n"
#define MANY_ATTN4 MANY_ATTN MANY_ATTN MANY_ATTN MANY_ATTN
static const char manyreads[] =
    "model manyreads\n"
    "dim B = 2\n"
    "dim T = 16\n"
    "dim C = 32\n"
    "dim H = 2\n"
    "dim V = 64\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "param wte: [V, C] = normal(0.5)\n"
    "param wqkv: [C, 3*C] = normal(0.3)\n"
    "param wo: [C, C] = normal(0.05)\n"
    "x = embed(wte, tokens)\n"
    "q, k, v = split(x @ wqkv, 3, axis=-1)\n" MANY_ATTN4 MANY_ATTN4 MANY_ATTN4 MANY_ATTN4
    "output loss = mean(cross_entropy(x @ wte.T, targets))\n";

// The checks every model gets that test the runtime rather than the model (a second run
// bit-identical, bad target and token ids reported) left to the others for attnkv: each emulated step
// of it takes 10 s or more.
static bool lean(const Model *md) { return md->text == attnkv; }

static const Model models[] = {
    {"models/gpt2-tiny.mdl", {{"B", 2}, {"T", 16}}, 2, NULL},
    {"models/llama-tiny.mdl", {{"B", 1}, {"T", 80}}, 2, NULL}, // keys in several tiles, the last partial
    {"models/mlp.mdl", {{"B", 8}}, 1, NULL},
    {"allops.mdl", {{NULL, 0}}, 0, allops},
    {"wide.mdl", {{NULL, 0}}, 0, wide},
    {"attn.mdl", {{NULL, 0}}, 0, attn},
    {"attn-d12.mdl", {{"C", 24}}, 1, attn},
    {"tests/unit/sums.mdl", {{NULL, 0}}, 0, NULL},
    {"hot.mdl", {{NULL, 0}}, 0, hot},
    {"normrows.mdl", {{NULL, 0}}, 0, normrows},
    {"tied.mdl", {{NULL, 0}}, 0, tied},
    {"attnkv.mdl", {{NULL, 0}}, 0, attnkv},
    {"attnkv-d12.mdl", {{"C", 48}}, 1, attnkv},
    {"routing.mdl", {{NULL, 0}}, 0, routing},
    {"newops.mdl", {{NULL, 0}}, 0, newops},
    {"manyreads.mdl", {{NULL, 0}}, 0, manyreads},
};

// The training graph of md, its GEMMs' operands rounded to bf16 when prec is DT_BF16.
static Graph *load(Arena *a, const Model *md, DType prec) {
  char why[256];
  return training_graph(a, md, prec, why, sizeof why);
}

static const char *prec_name(DType prec) { return prec == DT_BF16 ? "bf16" : "fp32"; }

//
// 1. NVRTC.
//

static void test_sha256(void) {
  static const struct {
    const char *in, *out;
  } v[] = {
      {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
      {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmn"
       "hijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu",
       "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
  };
  for (size_t i = 0; i < sizeof v / sizeof *v; i++) {
    char hex[65], name[80];
    nvrtc_sha256_hex(v[i].in, strlen(v[i].in), hex);
    snprintf(name, sizeof name, "nvrtc sha256 of a %zu-byte message", strlen(v[i].in));
    CHECK(!strcmp(hex, v[i].out), name, "got %s", hex);
  }
}

typedef struct {
  const char *src, *arch;
  NvrtcResult r;
  bool ok;
  char err[4096];
} Job;

static void *compile_job(void *p) {
  Job *j = p;
  j->ok = nvrtc_compile(j->src, j->arch, &j->r, j->err, sizeof j->err);
  return NULL;
}

// The module compiles for sm_80, sm_86 and sm_90, and bf16 fused for sm_100 and sm_120 too (two at a
// time) without an error or a warning (ptxas's too: a kernel asking for more threads an SM than sm_86
// or sm_120 hold is one). sm_89 compiles what sm_86 does: the prelude tells them apart by the fp8
// conversions alone (MDL_SM_THREADS is 1536 on both), which no fp32 or bf16 module uses, and
// test_fp8.c compiles those.
static void test_nvrtc_model(const char *path, const char *text, const char *label, bool fused, DType prec) {
  Arena *a = arena_new();
  Model md = {.path = path, .text = text};
  Graph *g = load(a, &md, prec);
  char name[200];
  if (!g) {
    snprintf(name, sizeof name, "nvrtc %s %s: compiles", label, prec_name(prec));
    CHECK(false, name, "front end, autodiff or precision failed");
    arena_free(a);
    return;
  }
  Fusion *f = fuse(g, (FuseOptions){.fuse = fused, .chunk_lmhead = fused});
  CudaPlan *p = emit_cuda_plan(f, memplan(f), path);
  snprintf(name, sizeof name, "nvrtc %s %s %s: emits", label, prec_name(prec), fused ? "fused" : "unfused");
  CHECK(p != NULL, name, "emit_cuda_plan failed");
  if (!p) {
    arena_free(a);
    return;
  }
  // (the Blackwell archs, sm_100 with 2048 threads an SM and sm_120 with 1536, for the models as they
  // train by default: bf16 and fused)
  Job jobs[5] = {{.src = p->source, .arch = "sm_80"},  {.src = p->source, .arch = "sm_90"},
                 {.src = p->source, .arch = "sm_86"},  {.src = p->source, .arch = "sm_100"},
                 {.src = p->source, .arch = "sm_120"}};
  int major = 0, minor = 0;
  bool blackwell = nvrtc_version(&major, &minor) && (major > 12 || (major == 12 && minor >= 8)); // (NVRTC 12.8+)
  int njobs = fused && prec == DT_BF16 && blackwell ? 5 : 3;
  for (int i = 0; i < njobs; i += 2) {
    pthread_t th;
    bool threaded = i + 1 < njobs && pthread_create(&th, NULL, compile_job, &jobs[i + 1]) == 0;
    if (i + 1 < njobs && !threaded)
      compile_job(&jobs[i + 1]);
    compile_job(&jobs[i]);
    if (threaded)
      pthread_join(th, NULL);
  }
  for (int i = 0; i < njobs; i++) {
    NvrtcResult *r = &jobs[i].r;
    snprintf(name, sizeof name, "nvrtc %s %s %s %s compiles (%d kernels, %s)", label, prec_name(prec),
             fused ? "fused" : "unfused", jobs[i].arch, p->nkernels,
             r->cache_hit ? "cache hit" : arena_printf(a, "%.2f s", r->seconds));
    CHECK(jobs[i].ok && r->size > 0 && !r->log, name, "%.600s", jobs[i].ok ? r->log : jobs[i].err);
    free(r->cubin);
    free(r->log);
  }
  arena_free(a);
}

// GPT-2 124M: a cold compile, then a cache hit returning the same cubin (both times are printed: the
// targets, under 2 s cold and 0.2 s warm, are checked by reading them, since timings on a shared
// machine would make the test flaky); another arch and a changed source miss the cache; a broken
// module reports NVRTC's error.
static void test_nvrtc_cache(void) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_file(a, "models/gpt2.mdl", NULL, 0);
  if (!g || !autodiff(g, true)) {
    CHECK(false, "nvrtc gpt2: compiles", "front end or autodiff failed");
    arena_free(a);
    return;
  }
  Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
  const char *src = emit_cuda(f, memplan(f), "models/gpt2.mdl");
  NvrtcResult cold = {0}, warm = {0}, other = {0};
  char err[4096] = "", name[200];
  double t0 = now();
  bool ok = src && nvrtc_compile(src, "sm_90", &cold, err, sizeof err);
  double tc = now() - t0;
  snprintf(name, sizeof name, "nvrtc gpt2 sm_90 compiles (%.2f s)", tc);
  CHECK(ok && !cold.cache_hit, name, "%.600s", src ? err : "emit failed");
  t0 = now();
  ok = ok && nvrtc_compile(src, "sm_90", &warm, err, sizeof err);
  double tw = now() - t0;
  snprintf(name, sizeof name, "nvrtc gpt2 sm_90: a second compile is a cache hit with the same cubin (%.3f s)", tw);
  CHECK(ok && warm.cache_hit && warm.size == cold.size && !memcmp(warm.cubin, cold.cubin, cold.size),
        name, "hit %d, %.3f s, %zu vs %zu bytes", warm.cache_hit, tw, warm.size, cold.size);
  free(cold.cubin);
  free(cold.log);
  free(warm.cubin);

  const char *tiny = "extern \"C\" __global__ void k(float *x) { x[threadIdx.x] *= 2.0f; }\n";
  ok = nvrtc_compile(tiny, "sm_90", &other, err, sizeof err);
  free(other.cubin);
  free(other.log);
  bool again = ok && nvrtc_compile(tiny, "sm_80", &other, err, sizeof err);
  CHECK(again && !other.cache_hit, "nvrtc cache: another arch misses the cache", "%s", again ? "a hit" : err);
  free(other.cubin);
  free(other.log);
  ok = nvrtc_compile("extern \"C\" __global__ void k(float *x) { x[threadIdx.x] *= 3.0f; }\n", "sm_90", &other,
                     err, sizeof err);
  CHECK(ok && !other.cache_hit, "nvrtc cache: a changed source misses the cache", "%s", ok ? "a hit" : err);
  free(other.cubin);
  free(other.log);
  ok = nvrtc_compile("extern \"C\" __global__ void k(float *x) { x[threadIdx.x] = undeclared; }\n", "sm_90", &other,
                     err, sizeof err);
  CHECK(!ok && strstr(err, "undeclared") && strstr(err, "error"), "nvrtc: a module that does not compile reports "
        "NVRTC's error", "got '%.300s'", ok ? "a cubin" : err);
  arena_free(a);
}

// The one .cubin in dir/cuda, into path; false when there is not exactly one.
static bool only_cubin(const char *dir, char *path, size_t n) {
  char sub[700];
  snprintf(sub, sizeof sub, "%s/cuda", dir);
  DIR *d = opendir(sub);
  int found = 0;
  for (struct dirent *de; d && (de = readdir(d));)
    if (strstr(de->d_name, ".cubin") && !strstr(de->d_name, ".tmp")) {
      snprintf(path, n, "%s/%s", sub, de->d_name);
      found++;
    }
  if (d)
    closedir(d);
  return found == 1;
}

// A cached cubin cut short (a full disk) is not taken: compiled again, the same bytes, the file
// whole again; a cubin that cannot be cached (a folder where its file goes) is still returned.
static void test_nvrtc_cache_damage(const char *cache) {
  char dir[600], path[1000] = "", err[4096] = "";
  snprintf(dir, sizeof dir, "%.500s/damage", cache);
  setenv("MDL_CACHE", dir, 1);
  fflush(stdout); // (the compiles below warn on stderr: whole lines after the results so far)
  const char *src = "extern \"C\" __global__ void k(float *x) { x[threadIdx.x] *= 5.0f; }\n";
  NvrtcResult cold = {0}, again = {0}, uncached = {0};
  bool ok = nvrtc_compile(src, "sm_90", &cold, err, sizeof err) && only_cubin(dir, path, sizeof path);
  CHECK(ok, "nvrtc cache: a compile writes one cubin", "%s", err);
  ok = ok && truncate(path, (off_t)(cold.size / 2)) == 0;
  ok = ok && nvrtc_compile(src, "sm_90", &again, err, sizeof err);
  struct stat st;
  bool whole = ok && stat(path, &st) == 0 && (size_t)st.st_size == cold.size;
  CHECK(ok && !again.cache_hit && again.size == cold.size && !memcmp(again.cubin, cold.cubin, cold.size) && whole,
        "nvrtc cache: a cubin cut short is compiled again and replaced", "%s",
        !ok ? err : again.cache_hit ? "taken from the cache" : "other bytes or the file not replaced");
  ok = ok && unlink(path) == 0 && mkdir(path, 0755) == 0;
  ok = ok && nvrtc_compile(src, "sm_90", &uncached, err, sizeof err);
  CHECK(ok && !uncached.cache_hit && uncached.size == cold.size && !memcmp(uncached.cubin, cold.cubin, cold.size),
        "nvrtc cache: a cubin that cannot be cached is still compiled and returned", "%s", ok ? "other bytes" : err);
  rmdir(path);
  free(cold.cubin);
  free(cold.log);
  free(again.cubin);
  free(again.log);
  free(uncached.cubin);
  free(uncached.log);
  setenv("MDL_CACHE", cache, 1);
}

//
// 2. The plan.
//

// Every launch names a kernel defined in the source; GEMM operands and kernel arguments lie in the arena.
// The module compiled as several programs at once, as the CUDA engine compiles it
// (nvrtc_compile_units): GPT-2 124M as it trains by default (bf16, fused) as 3 programs, and gpt2-tiny
// (bf16, fused) as a program per unit (every kernel with the head alone): a cubin per program, no
// warning, every kernel of the plan (variants and mdl_accumulate too) defined in exactly one cubin;
// compiled again, every cubin comes from the cache, the same bytes. Times printed.
static void test_nvrtc_units(void) {
  static const struct {
    const char *path;
    int threads;
  } cases[] = {{"models/gpt2.mdl", 3}, {"models/gpt2-tiny.mdl", 1 << 20}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    Arena *a = arena_new();
    Model md = {.path = cases[c].path};
    Graph *g = load(a, &md, DT_BF16);
    Fusion *f = g ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
    CudaPlan *p = f ? emit_cuda_plan(f, memplan(f), md.path) : NULL;
    char name[300], err[4096] = "";
    if (!p) {
      snprintf(name, sizeof name, "nvrtc %s as several programs: emits", md.path);
      CHECK(false, name, "front end, precision or emitter failed");
      arena_free(a);
      continue;
    }
    int want = cases[c].threads < p->nunits ? cases[c].threads : p->nunits;
    NvrtcModule cold = {0}, warm = {0};
    double t0 = now();
    bool ok = nvrtc_compile_units(p, "sm_90", cases[c].threads, &cold, err, sizeof err);
    double tc = now() - t0;
    bool clean = ok && cold.n == want && !cold.cache_hit;
    for (int i = 0; clean && i < cold.n; i++)
      clean = cold.parts[i].size > 0 && !cold.parts[i].log;
    snprintf(name, sizeof name, "nvrtc %s bf16 sm_90 as %d programs at once: a cubin each, no warning (%.2f s)",
             md.path, want, tc);
    CHECK(clean, name, "%.600s", !ok ? err : cold.n != want ? "another number of cubins" : "a warning or a cache hit");
    const char *missing = NULL;
    int defined = 0;
    for (int i = 0; ok && i <= 2 * p->nlaunches && !missing; i++) {
      const char *k = i == 2 * p->nlaunches ? "mdl_accumulate"
                      : i < p->nlaunches    ? p->launches[i].kernel
                                            : p->launches[i - p->nlaunches].alt;
      int in = 0;
      for (int j = 0; k && j < cold.n; j++)
        in += cubin_has_function(cold.parts[j].cubin, k);
      if (k && in != 1)
        missing = k;
      defined += k != NULL;
    }
    snprintf(name, sizeof name, "nvrtc %s bf16 as %d programs: each of the plan's kernels is in exactly one cubin",
             md.path, want);
    CHECK(ok && !missing && defined > 0, name, "%s", missing ? missing : "no cubins");
    t0 = now();
    ok = ok && nvrtc_compile_units(p, "sm_90", cases[c].threads, &warm, err, sizeof err);
    double tw = now() - t0;
    bool same = ok && warm.cache_hit && warm.n == cold.n && warm.seconds == 0;
    for (int i = 0; same && i < warm.n; i++)
      same = warm.parts[i].size == cold.parts[i].size &&
             !memcmp(warm.parts[i].cubin, cold.parts[i].cubin, cold.parts[i].size);
    snprintf(name, sizeof name, "nvrtc %s bf16 as %d programs, again: every cubin from the cache, the same (%.3f s)",
             md.path, want, tw);
    CHECK(same, name, "%s", ok ? "a miss or other bytes" : err);
    nvrtc_module_free(&cold);
    nvrtc_module_free(&warm);
    arena_free(a);
  }
}

// ptxas's report on GPT-2 124M's module as it trains by default (bf16, fused) for sm_90: every kernel
// of the plan is in it, and the tensor-core attention kernels (both block sizes) spill no register
// to local memory (a spill in their inner loops would cost far more than it shows in a test). The
// largest register count is printed.
static void test_nvrtc_resources(void) {
  Arena *a = arena_new();
  Model md = {.path = "models/gpt2.mdl"};
  Graph *g = load(a, &md, DT_BF16);
  Fusion *f = g ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
  CudaPlan *p = f ? emit_cuda_plan(f, memplan(f), md.path) : NULL;
  char err[4096] = "", *report = NULL, name[300];
  bool ok = p && nvrtc_resource_report(p->source, "sm_90", &report, err, sizeof err);
  CHECK(ok, "nvrtc gpt2 bf16 sm_90: ptxas reports each kernel's registers and spills", "%.600s",
        p ? err : "emit failed");
  // (per kernel of the report: its spill bytes, stored and loaded, and its registers)
  const char *missing = NULL, *spilled = NULL;
  int attention = 0, most = 0;
  for (int i = 0; ok && i < 2 * p->nlaunches && !missing; i++) {
    const char *k = i < p->nlaunches ? p->launches[i].kernel : p->launches[i - p->nlaunches].alt;
    if (!k)
      continue;
    char key[256];
    snprintf(key, sizeof key, "Function properties for %s\n", k);
    const char *at = strstr(report, key);
    long stores = -1, loads = -1, regs = -1;
    if (at) {
      const char *props = strchr(at, '\n') + 1, *used = strstr(props, "Used ");
      sscanf(strstr(props, "bytes stack frame, ") ? strstr(props, "bytes stack frame, ") : "", "bytes stack frame, %ld "
             "bytes spill stores, %ld bytes spill loads", &stores, &loads);
      if (used)
        sscanf(used, "Used %ld registers", &regs);
    }
    if (!at || stores < 0 || loads < 0 || regs < 0)
      missing = k;
    else if (strstr(k, "attention") && (stores || loads) && !spilled)
      spilled = k;
    attention += strstr(k, "attention") != NULL;
    most = regs > most ? (int)regs : most;
  }
  snprintf(name, sizeof name, "nvrtc gpt2 bf16 sm_90: every kernel in ptxas's report; the attention kernels' %d "
           "launches and variants spill nothing (at most %d registers a thread)", attention, most);
  CHECK(ok && !missing && !spilled && attention > 0, name, "%s %s", missing ? "not in the report:" : "spills:",
        missing ? missing : spilled ? spilled : "none");
  free(report);
  arena_free(a);
}

static const char *check_plan(const CudaPlan *p, const Fusion *f, char *why, size_t n) {
  int last_step = 0;
  for (int i = 0; i < p->nlaunches; i++) {
    const CudaLaunch *l = &p->launches[i];
    if (l->step < last_step || l->step >= f->nsteps)
      return snprintf(why, n, "launch %d: step %d out of order", i, l->step), why;
    last_step = l->step;
    if (l->kernel) {
      char def[256];
      snprintf(def, sizeof def, ") %s(char *arena", l->kernel);
      if (!strstr(p->source, def))
        return snprintf(why, n, "launch %d: no kernel %s in the source", i, l->kernel), why;
      for (int k = 0; k < l->nargs; k++)
        if (l->args[k] < 0 || l->args[k] >= p->arena_bytes || l->args[k] % 16)
          return snprintf(why, n, "launch %d (%s): argument %d = %lld outside the arena or unaligned", i, l->kernel, k,
                          (long long)l->args[k]), why;
      if (l->grid[0] < 1 || l->block[0] < 1 || l->block[0] > 1024 || l->block[0] % 32)
        return snprintf(why, n, "launch %d (%s): grid %u block %u", i, l->kernel, l->grid[0], l->block[0]), why;
    } else {
      const CudaGemm *gm = &p->gemms[l->gemm];
      int64_t sab = dtype_size(gm->ab), sc = dtype_size(gm->c_type);
      int64_t ea = sab * ((gm->batch - 1) * gm->stride_a + (gm->ta ? gm->k : gm->m) * gm->lda);
      int64_t eb = sab * ((gm->batch - 1) * gm->stride_b + (gm->tb ? gm->n : gm->k) * gm->ldb);
      int64_t ec = sc * ((gm->batch - 1) * gm->stride_c + gm->m * gm->ldc);
      if (gm->a < 0 || gm->b < 0 || gm->c < 0 || gm->a + ea > p->arena_bytes + sab * gm->lda ||
          gm->b + eb > p->arena_bytes + sab * gm->ldb || gm->c + ec > p->arena_bytes)
        return snprintf(why, n, "gemm %d: operands outside the arena", l->gemm), why;
      if ((gm->ab != DT_F32 && gm->ab != DT_BF16) || (gm->c_type != DT_F32 && gm->c_type != DT_BF16) ||
          (gm->c_type == DT_BF16 && (gm->epilogue != CUDA_EPI_NONE || gm->beta != 0 || gm->bias >= 0 || gm->aux >= 0)))
        return snprintf(why, n, "gemm %d: types %s x %s -> %s with epilogue %d, beta %g", l->gemm,
                        dtype_name(gm->ab), dtype_name(gm->ab), dtype_name(gm->c_type), gm->epilogue, gm->beta), why;
    }
  }
  // The units: one per kernel (mdl_accumulate's the first), in the order of the source, each holding
  // exactly one kernel's definition; the head before them holds none.
  size_t len = strlen(p->source);
  if (p->nunits != p->nkernels + 1 || p->units[0].at == 0 || p->units[p->nunits - 1].at >= len)
    return snprintf(why, n, "%d units of %d kernels", p->nunits, p->nkernels), why;
  char *head = strndup(p->source, p->units[0].at);
  bool bare = !strstr(head, "__global__");
  free(head);
  if (!bare || strncmp(p->source + p->units[0].at, "\n// Not of the plan:", 20))
    return snprintf(why, n, "the head holds a kernel, or mdl_accumulate is not the first unit"), why;
  for (int u = 0; u < p->nunits; u++) {
    size_t end = u + 1 < p->nunits ? p->units[u + 1].at : len;
    if (end <= p->units[u].at || p->units[u].cost == 0 || p->units[u].cost > end - p->units[u].at)
      return snprintf(why, n, "unit %d: [%zu, %zu), cost %zu", u, p->units[u].at, end, p->units[u].cost), why;
    int defs = 0;
    const char *k = p->source + p->units[u].at;
    for (; (k = strstr(k, "__global__")) && (size_t)(k - p->source) < end; k++)
      defs++;
    if (defs != 1)
      return snprintf(why, n, "unit %d defines %d kernels", u, defs), why;
  }
  return NULL;
}

static void kernels_with(const char *src, const char *name, const char *except, const char *needle, int *n,
                         int *with);

static void test_plans(void) {
  char why[300], name[200];
  for (int pr = 0; pr < 2; pr++)
    for (int fz = 0; fz < 2; fz++)
      for (size_t i = 0; i < sizeof models / sizeof *models; i++) {
        DType prec = pr ? DT_BF16 : DT_F32;
        Arena *a = arena_new();
        Graph *g = load(a, &models[i], prec);
        if (!g) {
          CHECK(false, "cuda plan: the model compiles", "%s %s", models[i].path, prec_name(prec));
          arena_free(a);
          continue;
        }
        Fusion *f = fuse(g, (FuseOptions){.fuse = fz, .chunk_lmhead = fz});
        MemPlan *m = memplan(f);
        CudaPlan *p = emit_cuda_plan(f, m, models[i].path), *q = emit_cuda_plan(f, m, models[i].path);
        const char *label = arena_printf(a, "%s%s %s", models[i].path, pr ? " bf16" : "", fz ? "fused" : "unfused");
        snprintf(name, sizeof name, "cuda plan %s: emitting twice gives the same text", label);
        CHECK(p && q && !strcmp(p->source, q->source), name, "%s", p && q ? "texts differ" : "emit failed");
        why[0] = 0;
        const char *bad = p ? check_plan(p, f, why, sizeof why) : "emit failed";
        snprintf(name, sizeof name, "cuda plan %s: %d launches name kernels of the source, in the arena; a unit "
                 "for each kernel", label, p ? p->nlaunches : 0);
        CHECK(!bad, name, "%s", bad);
        // A reduction step computes the elementwise values it holds (rule 10) in its own loop: one
        // kernel, or partial results and the kernel that adds them, and no kernel of their own. So
        // does a GEMM step holding a reduction, after its GEMM: its epilogue runs in the reduction.
        int worst = 0, members = 0;
        const char *at = "";
        for (int s = 0; p && s < f->nsteps; s++) {
          bool reduces = false;
          for (int k = 0; k < f->steps[s].nnodes; k++) {
            Op op = g->nodes[f->steps[s].nodes[k]]->op;
            reduces |= op == OP_SUM || op == OP_MEAN || op == OP_MAX;
          }
          if (!reduces || (f->steps[s].kind != STEP_KERNEL && f->steps[s].kind != STEP_GEMM))
            continue;
          int k = 0;
          for (int l = 0; l < p->nlaunches; l++)
            k += p->launches[l].step == s && p->launches[l].kernel;
          members += f->steps[s].nnodes > 1;
          if (k > worst)
            worst = k, at = f->steps[s].name;
        }
        snprintf(name, sizeof name, "cuda plan %s: reduction steps run at most 2 kernels (%d steps with more than "
                 "the reduction)", label, members);
        CHECK(worst <= 2, name, "%s runs %d", at, worst);
        arena_free(a);
      }

  for (int pr = 0; pr < 2; pr++) {
    DType prec = pr ? DT_BF16 : DT_F32;
    Arena *a = arena_new();
    Model md = {.path = "models/gpt2.mdl"};
    Graph *g = load(a, &md, prec);
    if (g) {
      Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
      CudaPlan *p = emit_cuda_plan(f, memplan(f), "models/gpt2.mdl");
      // The steps of layers 1-11 run the kernels of layer 0: few launches run a kernel named after
      // their own step.
      int own = 0, launches = 0;
      for (int i = 0; p && i < p->nlaunches; i++) {
        const CudaLaunch *l = &p->launches[i];
        const char *step = f->steps[l->step].name;
        if (!l->kernel)
          continue;
        launches++;
        own += !strncmp(l->kernel, step, strlen(step));
      }
      // (bf16 adds the CAST kernels of the weights and activations: a few more distinct kernels.)
      int most = pr ? 50 : 40;
      snprintf(name, sizeof name,
               "cuda plan gpt2 %s: the 12 layers share kernels (%d distinct kernels for %d launches)",
               prec_name(prec), p ? p->nkernels : 0, launches);
      CHECK(p && p->nkernels <= most && 4 * own < launches, name,
            "%d distinct (at most %d), %d launches run their own step's kernel", p ? p->nkernels : 0, most, own);
    }
    arena_free(a);
  }

  Arena *a = arena_new();
  Graph *g = load(a, &models[0], DT_F32);
  if (g) {
    Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
    MemPlan *m = memplan(f);
    CudaPlan *p = emit_cuda_plan(f, m, "gpt2-tiny");
    int bias = 0, bias_gelu = 0, aux = 0, resid = 0, alone = 0;
    for (int i = 0; p && i < p->ngemms; i++) {
      const CudaGemm *gm = &p->gemms[i];
      bias += gm->epilogue == CUDA_EPI_BIAS;
      bias_gelu += gm->epilogue == CUDA_EPI_BIAS_GELU;
      aux += gm->epilogue == CUDA_EPI_BIAS_GELU && gm->aux >= 0 && gm->bias >= 0;
      if (!gm->c_apart)
        continue;
      resid += gm->beta == 1.0f && gm->cin != gm->c && gm->epilogue == CUDA_EPI_BIAS;
      int launches = 0;
      for (int l = 0; l < p->nlaunches; l++)
        launches += p->launches[l].step == gm->step;
      alone += launches == 1;
    }
    // Per layer: qkv (bias), the MLP's first GEMM (bias + GELU, its input kept for gelu_bwd), and the
    // two projections, (x + a @ w) + b: cuBLASLt adds the bias and the residual x (its out-of-place C),
    // and the step runs no kernel of its own.
    CHECK(bias == 6 && bias_gelu == 2 && aux == 2 && resid == 4 && alone == 4,
          "cuda plan gpt2-tiny: GEMM epilogues (bias x 6, 4 of them with the residual as C; bias + gelu x 2)",
          "bias %d, bias + gelu %d (%d keep the pre-GELU value), %d with a residual C (%d steps of the GEMM alone)", bias,
          bias_gelu, aux, resid, alone);
  }
  arena_free(a);

  // bf16: every GEMM reads bf16 operands into an f32 result, but for the two that compute the
  // attention backward's dout, which it reads only rounded (a CAST): they store bf16; so does the LM
  // head's logits GEMM, whose loss reads them rounded. The MLP's GELU is only kept rounded, so its GEMM
  // adds the bias and the epilogue kernel does GELU and the rounding; the projections add the bias and
  // the residual as in fp32: 8 bias epilogues in all. The LM head's cross-entropy overwrites the bf16
  // logits with bf16 dlogits, which its dx and dW GEMMs read from the same chunk.
  a = arena_new();
  g = load(a, &models[0], DT_BF16);
  if (g) {
    Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
    const MemPlan *mp = memplan(f);
    CudaPlan *p = emit_cuda_plan(f, mp, "gpt2-tiny");
    int bias = 0, other = 0, bf16 = 0, dout = 0, lm[3], nlm = 0;
    for (int i = 0; p && i < p->ngemms; i++) {
      const CudaGemm *gm = &p->gemms[i];
      bias += gm->epilogue == CUDA_EPI_BIAS && gm->bias >= 0 && gm->aux < 0;
      other += gm->epilogue != CUDA_EPI_BIAS && gm->epilogue != CUDA_EPI_NONE;
      bf16 += gm->ab == DT_BF16 && gm->c_type == DT_F32;
      // A bf16 result read by an attention backward, with no epilogue and beta 0.
      bool to_att = false;
      for (int n = 0; n < g->n; n++)
        to_att |= g->nodes[n]->op == OP_ATTENTION_BWD &&
                  mp->offset[g->nodes[n]->in[g->nodes[n]->nin - 1]] == gm->c;
      dout += gm->ab == DT_BF16 && gm->c_type == DT_BF16 && gm->epilogue == CUDA_EPI_NONE && gm->beta == 0 && to_att;
      if (strstr(f->steps[gm->step].name, "lmhead") && nlm < 3)
        lm[nlm++] = i;
    }
    CHECK(p && bias == 8 && other == 0 && dout == 2 && bf16 == p->ngemms - 3,
          "cuda plan gpt2-tiny bf16: bf16 x bf16 -> f32 GEMMs, the bias in 8 of their epilogues; the attention "
          "backward's dout and the LM head's logits stored as bf16 by their GEMMs",
          "bias %d, other epilogues %d, %d of %d GEMMs bf16 -> f32, %d write a dout in bf16", bias, other, bf16,
          p ? p->ngemms : 0, dout);
    const CudaGemm *gl = p ? &p->gemms[lm[0]] : NULL, *gx = p ? &p->gemms[lm[1]] : NULL,
                   *gw = p ? &p->gemms[lm[2]] : NULL;
    CHECK(p && nlm == 3 && gl->c >= p->scratch && gx->a == gl->c && gw->a == gx->a && gl->c_type == DT_BF16 &&
              gl->ab == DT_BF16 && gx->ab == DT_BF16 && gw->ab == DT_BF16,
          "cuda plan gpt2-tiny bf16: the LM head's logits GEMM stores bf16 into a chunk of scratch, where its dx and "
          "dW GEMMs read bf16 dlogits",
          "%d GEMMs; logits at %lld, dx reads %lld, dW reads %lld (scratch from %lld)", nlm,
          gl ? (long long)gl->c : -1LL, gx ? (long long)gx->a : -1LL, gw ? (long long)gw->a : -1LL,
          p ? (long long)p->scratch : -1LL);
    // Its cross-entropy kernel takes the bf16 logits 16 bytes a load (eight), both passes, and stores
    // dlogits eight at a time over them (the rows 256 apart, 512-byte aligned): mdl_ce_row (prelude.cuh)
    // at eight a load, its gradient's row its logits' row, in the chunk of bf16 logits.
    int ces = 0, calls = 0, vw = 0;
    char xrow[64] = "", dxrow[64] = "";
    const char *call = p ? strstr(p->source, "mdl_ce_row<") : NULL;
    if (p) {
      kernels_with(p->source, "lmhead", NULL, "mdl_ce_row<", &ces, &calls);
      if (call)
        sscanf(call, "mdl_ce_row<%*[^,], %*d, %*d, %d, true, true>(%63[^,], %63[^,],", &vw, xrow, dxrow);
    }
    CHECK(ces == 1 && calls == 1 && vw == 8 && *xrow && !strcmp(xrow, dxrow) &&
              strstr(p->source, "uint16_t *const b0 = (uint16_t *)(arena + o.b[0]); // the chunk's logits, bf16"),
          "cuda plan gpt2-tiny bf16: the LM head's cross-entropy loads eight bf16 logits a load and stores eight "
          "dlogits over them", "%d kernels, %d calling mdl_ce_row, %d a load, x %s, dx %s", ces, calls, vw, xrow,
          dxrow);
  }
  arena_free(a);

  for (int pr = 0; pr < 2; pr++) {
    a = arena_new();
    g = load(a, &models[4], pr ? DT_BF16 : DT_F32);
    if (!g) {
      arena_free(a);
      continue;
    }
    Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
    MemPlan *m = memplan(f);
    CudaPlan *p = emit_cuda_plan(f, m, "wide");
    int gelu = 0, d16 = 0, into_cast = 0;
    for (int i = 0; p && i < p->ngemms; i++) {
      const CudaGemm *gm = &p->gemms[i];
      gelu += gm->epilogue == CUDA_EPI_GELU && gm->aux >= 0 && gm->bias < 0;
      d16 += gm->c_type == DT_BF16;
      for (int n = 0; gm->c_type == DT_BF16 && n < g->n; n++)
        into_cast += g->nodes[n]->op == OP_CAST && m->offset[n] == gm->c;
    }
    if (!pr)
      CHECK(gelu == 1 && d16 == 0, "cuda plan wide: a GELU epilogue without bias keeps the GEMM's output for gelu_bwd",
            "%d GELU epilogues, %d bf16 results", gelu, d16);
    else // (x @ w) @ wg: x @ w and its gradient are only read rounded, so cuBLASLt writes them as bf16
         // into the CASTs' slots; h = gelu(...) is only read rounded too (by attention), which cuBLASLt's
         // GELU epilogue cannot store (its output takes the aux's type, f32): the epilogue kernel
         // computes the GELU and stores h's rounding. (The third bf16 result: the LM head's logits, into
         // its chunk of scratch.)
      CHECK(gelu == 0 && d16 == 3 && into_cast == 2 && strstr(p->source, "mdl_gelu("),
            "cuda plan wide bf16: two GEMMs write bf16 results straight into their CASTs' slots, the GELU of a "
            "value read rounded in the epilogue kernel",
            "%d GEMMs with a bf16 result, %d of them into a CAST's slot; %d GELU epilogues", d16, into_cast, gelu);
    arena_free(a);
  }
}

// Counts the kernels of src whose name contains `name` (and not `except`, when given): *n of them,
// *with of those whose text contains `needle`.
static void kernels_with(const char *src, const char *name, const char *except, const char *needle, int *n,
                         int *with) {
  *n = *with = 0;
  for (const char *p = src; (p = strstr(p, "__global__ void __launch_bounds__(")); p++) {
    const char *id = strchr(p, ')') + 2, *paren = strchr(id, '(');
    const char *end = strstr(paren, "\n}\n");
    end = end ? end : paren + strlen(paren);
    char kname[128];
    snprintf(kname, sizeof kname, "%.*s", (int)(paren - id), id);
    if (!strstr(kname, name) || (except && strstr(kname, except)))
      continue;
    (*n)++;
    const char *hit = strstr(paren, needle);
    *with += hit && hit < end;
  }
}

// The attention kernels by precision and head size: bf16 forwards, and the backward's dq and dk, dv
// kernels, with heads of a multiple of 16 (gpt2-tiny: 16, attn: 32) run on tensor cores; heads of 12
// (attn-d12) fall back to the CUDA-core kernels, which round as the tensor cores would; fp32 graphs
// round nothing in attention. In bf16 graphs q, k and v are stored as bf16 (precision.c), so the
// forwards round only e (packed in pairs on tensor cores) and no attention kernel loads f32 rows by
// float4 (nor gives the tensor-core templates f32 rows). The backward's D kernels read dout and out as
// stored, bf16 in bf16 graphs; unfused, the forward's log-sum-exp is a kernel of its own, on CUDA
// cores. The tensor-core kernels are instances of prelude.cuh's mdl_att_fwd, mdl_att_dq and mdl_att_dkv
// (which take their products by mma and round their operands, and e, in bf16 pairs).
static void test_attention_kernels(void) {
  static const struct {
    int model;
    DType prec;
    bool mma;
  } cases[] = {{0, DT_BF16, true}, {5, DT_BF16, true}, {6, DT_BF16, false}, {0, DT_F32, false}, {5, DT_F32, false}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (int fz = 1; fz >= 0; fz--) {
      const Model *md = &models[cases[i].model];
      bool bf16 = cases[i].prec == DT_BF16;
      Arena *a = arena_new();
      Graph *g = load(a, md, cases[i].prec);
      CudaPlan *p = NULL;
      if (g) {
        Fusion *f = fuse(g, (FuseOptions){.fuse = fz, .chunk_lmhead = fz});
        p = emit_cuda_plan(f, memplan(f), md->path);
      }
      const char *src = p ? p->source : "";
      int fwd, fwd_mma, fwd_round, bwd, bwd_round, bwd_pairs, grad, grad_mma, dsum, dsum16, lse, lse_mma, att, f4;
      int dq_mma, dkv_mma, f32_rows;
      kernels_with(src, "attention_fwd", NULL, "mdl_att_fwd<", &fwd, &fwd_mma);
      kernels_with(src, "attention_fwd", NULL, cases[i].mma ? "mdl_att_fwd<" : "mdl_f32_to_bf16(", &fwd, &fwd_round);
      kernels_with(src, "attention", NULL, "const float4 ", &att, &f4);
      kernels_with(src, "attention", NULL, "mdl_att_rows<float", &att, &f32_rows);
      kernels_with(src, "attention_bwd", "dsum", "mdl_f32_to_bf16(", &bwd, &bwd_round);
      kernels_with(src, "attention_bwd", "dsum", "mdl_att_d", &bwd, &bwd_pairs);
      kernels_with(src, "attention_bwd", "dsum", "mdl_att_dq<", &grad, &dq_mma);
      kernels_with(src, "attention_bwd", "dsum", "mdl_att_dkv<", &grad, &dkv_mma);
      grad_mma = dq_mma + dkv_mma;
      f4 += f32_rows;
      kernels_with(src, "attention_bwd_dsum", NULL, "mdl_bf16_to_f32(", &dsum, &dsum16);
      kernels_with(src, "attention_lse", NULL, "mdl_att_fwd<", &lse, &lse_mma);
      char name[300];
      const char *label = arena_printf(a, "%s %s %s", md->path, prec_name(cases[i].prec), fz ? "fused" : "unfused");
      if (cases[i].mma)
        snprintf(name, sizeof name, "cuda plan %s: its attention forward kernels (%d) run on tensor cores (mma), "
                 "rounding e in bf16 pairs", label, fwd);
      else if (bf16)
        snprintf(name, sizeof name, "cuda plan %s: its attention forward kernels (%d) fall back to CUDA cores, "
                 "rounding e to bf16", label, fwd);
      else
        snprintf(name, sizeof name, "cuda plan %s: its attention forward kernels (%d) neither use mma nor round", label,
                 fwd);
      CHECK(fwd > 0 && fwd_mma == (cases[i].mma ? fwd : 0) && fwd_round == (bf16 ? fwd : 0), name,
            "%d kernels, %d with mma, %d rounding", fwd, fwd_mma, fwd_round);
      if (bf16) {
        snprintf(name, sizeof name, "cuda plan %s: its attention kernels (%d) read q, k and v as bf16", label, att);
        CHECK(att > 0 && f4 == 0, name, "%d of %d load float4 rows", f4, att);
      }
      snprintf(name, sizeof name, "cuda plan %s: its attention backward kernels (%d) %s", label, bwd,
               bf16 ? "round their operands to bf16" : "round nothing");
      CHECK(bwd > 0 && bwd_round + bwd_pairs == (bf16 ? bwd : 0),
            name, "%d kernels, %d rounding, %d packing bf16 pairs", bwd, bwd_round, bwd_pairs);
      snprintf(name, sizeof name, "cuda plan %s: its attention backward's dq and dk, dv kernels (%d) %s", label, grad,
               cases[i].mma ? "run on tensor cores (mma)" : "do not use mma");
      CHECK(grad > 0 && grad_mma == (cases[i].mma ? grad : 0), name, "%d kernels, %d with mma", grad, grad_mma);
      snprintf(name, sizeof name, "cuda plan %s: its attention backward's D kernels (%d) read dout and out %s", label,
               dsum, bf16 ? "as bf16" : "as f32");
      CHECK(dsum > 0 && dsum16 == (bf16 ? dsum : 0), name, "%d kernels, %d widening bf16", dsum, dsum16);
      snprintf(name, sizeof name, "cuda plan %s: the forward's log-sum-exp %s", label,
               fz ? "is stored by the forward's kernel" : "is a kernel of its own, on CUDA cores");
      CHECK(fz ? lse == 0 && strstr(src, "_attention_fwd__") && strstr(src, "__lse") : lse > 0 && lse_mma == 0, name,
            "%d kernels of their own, %d with mma", lse, lse_mma);
      arena_free(a);
    }
}

//
// 3. Emulation.
//

// The batch of input node nd: token patterns, two documents per row (positions restart at the
// boundary; "docs": runs of 40 positions in documents 0, 1, 2, 0, ..., so that a document comes
// back after others), one ignored target; f32 inputs a smooth pattern.
static void batch(const IrNode *nd, int32_t *ids, float *f) {
  int64_t n = shape_numel(nd->shape), cols = nd->shape.d[nd->shape.rank - 1];
  for (int64_t j = 0; j < n; j++) {
    int64_t t = j % cols, split = cols / 2 - 1;
    ids[j] = 0;
    if (!strcmp(nd->name, "tokens"))
      ids[j] = (int32_t)((j * 37 + 11) % 64);
    else if (!strcmp(nd->name, "hot")) // 4 in 5 among ids 0-31, the rest among 40-63
      ids[j] = (int32_t)(j % 5 ? (j * 37 + 11) % 32 : 40 + j % 24);
    else if (!strcmp(nd->name, "tail")) // from 74 down: the last rows of a table of 75
      ids[j] = (int32_t)(74 - j % 75);
    else if (!strcmp(nd->name, "targets"))
      ids[j] = j == 3 ? -1 : (int32_t)((j * 53 + 7) % (nd->shape.rank == 1 ? 4 : 64));
    else if (!strcmp(nd->name, "idx")) // -1 to 5: some outside an axis of 4
      ids[j] = (int32_t)((j * 5) % 7) - 1;
    else if (!strcmp(nd->name, "pos"))
      ids[j] = (int32_t)(t < split ? t : t - split);
    else if (!strcmp(nd->name, "doc"))
      ids[j] = t < split ? 0 : 1;
    else if (!strcmp(nd->name, "docs"))
      ids[j] = (int32_t)((t / 40 + j / cols) % 3);
    f[j] = (float)sin(0.7 * (double)j + 0.3);
  }
}

// EMU_CHECKS at work: a kernel of 32 threads run by the emulator, compiled as the modules are, reads
// a float4 at its aligned address and a shared array inside its bounds (mode 0: the sum of its
// outputs, 944); at an address 4 bytes further (mode 1) it stops with "misaligned address", and
// with an index one past its shared array (mode 2) with "out of bounds", each exiting non-zero.
static void test_emu_checks(const char *dir) {
  static const char prog[] =
      "__global__ void k(const float *x, float *y, int mode) {\n"
      "  __shared__ float s[32];\n"
      "  const int t = threadIdx.x;\n"
      "  s[t] = x[t];\n"
      "  __syncthreads();\n"
      "  const float4 v = reinterpret_cast<const float4 *>(x + (mode == 1 ? 1 : 0))[t % 8];\n"
      "  y[t] = v.x + s[mode == 2 ? t + 1 : 31 - t];\n"
      "}\n"
      "struct Ctx { const float *x; float *y; int mode; };\n"
      "static void body(void *p) { Ctx *c = (Ctx *)p; k(c->x, c->y, c->mode); }\n"
      "int main(int argc, char **argv) {\n"
      "  alignas(16) static float x[40], y[32];\n"
      "  for (int i = 0; i < 40; i++) x[i] = (float)i;\n"
      "  Ctx c = {x, y, atoi(argv[1])};\n"
      "  mdl_emu::run(dim3{1, 1, 1}, dim3{32, 1, 1}, body, &c);\n"
      "  float sum = 0;\n"
      "  for (int t = 0; t < 32; t++) sum += y[t];\n"
      "  printf(\"sum %g\\n\", sum);\n"
      "  return 0;\n"
      "}\n";
  char src[600], bin[600], cmd[2400];
  snprintf(src, sizeof src, "%s/emu_checks.cpp", dir);
  snprintf(bin, sizeof bin, "%s/emu_checks", dir);
  FILE *f = fopen(src, "w");
  bool ok = f && fputs(prog, f) >= 0;
  ok = f && !fclose(f) && ok;
  snprintf(cmd, sizeof cmd, "g++ -std=c++17 -O1 -fopenmp " EMU_CHECKS " -Itests/unit -Iruntime/kernels -include cuda_emu.h %s -o %s "
           ">%s.log 2>&1", src, bin, bin);
  ok = ok && system(cmd) == 0;
  CHECK(ok, "cuda emu checks: a kernel compiles with the emulator and UBSan's checks", "see %s.log", bin);
  static const struct {
    const char *what, *expect;
    bool fails;
  } modes[] = {{"aligned and in bounds: runs, sum 944", "sum 944", false},
               {"a float4 read 4 bytes past its alignment stops the kernel", "misaligned address", true},
               {"a shared array read one past its end stops the kernel", "out of bounds", true}};
  for (int m = 0; ok && m < 3; m++) {
    char log[600], out[2000] = "", name[300];
    snprintf(log, sizeof log, "%s/emu_checks_%d.txt", dir, m);
    snprintf(cmd, sizeof cmd, "%s %d >%s 2>&1", bin, m, log);
    int rc = system(cmd);
    FILE *l = fopen(log, "r");
    size_t k = l ? fread(out, 1, sizeof out - 1, l) : 0;
    out[k] = 0;
    if (l)
      fclose(l);
    snprintf(name, sizeof name, "cuda emu checks: %s", modes[m].what);
    CHECK((rc != 0) == modes[m].fails && strstr(out, modes[m].expect), name, "exit %d: %.300s", rc, out);
  }
}

// Runs the plan's launches of steps [first, last] (last = -1: to the end of the step), reporting into
// *st (the first report of the step wins, as on the GPU); with alt, every kernel that has a variant
// runs the variant.
static void emu_steps(const CudaPlan *p, const Emu *emu, char *arena, MdlStatus *st, int first, int last, bool alt) {
  for (int i = 0; i < p->nlaunches; i++) {
    const CudaLaunch *l = &p->launches[i];
    if (l->step < first)
      continue;
    if (last >= 0 && l->step > last)
      break;
    if (l->kernel && alt && l->alt)
      emu->launch(emu->alt[i], l->alt_grid, l->alt_block, arena, st, 7, l->chunk, l->args, l->nargs);
    else if (l->kernel)
      emu->launch(emu->fn[i], l->grid, l->block, arena, st, 7, l->chunk, l->args, l->nargs);
    else
      ref_gemm(arena, &p->gemms[l->gemm]);
  }
}

// One training step of the plan on arena; the status of the step.
static MdlStatus emu_step(const CudaPlan *p, const Emu *emu, char *arena) {
  MdlStatus st = {0};
  emu_steps(p, emu, arena, &st, 0, -1, false);
  return st;
}

// The arena zeroed, but for the kernels' scratch, all NaN (0xff bytes, in f32 and in bf16): a kernel
// or GEMM that reads scratch it has not written (the LM head's padding classes, say) shows.
static char *arena_new_for(const CudaPlan *p) {
  size_t bytes = (size_t)(p->arena_bytes + 255) / 256 * 256;
  char *a = aligned_alloc(256, bytes ? bytes : 256);
  if (a) {
    memset(a, 0, bytes);
    memset(a + p->scratch, 0xff, (size_t)(p->arena_bytes - p->scratch));
  }
  return a;
}

// Kernel variants: the step again from `start` (a copy of the arena before it) with every kernel
// that has a variant running the variant, checked against `after`, the arena the plan's own
// kernels left: the whole arena the same to the bit (the variants sum every row in the same order).
// The number of launches with a variant in *n; true when there are none.
static bool variants_agree(const CudaPlan *p, const Emu *emu, const char *start, const char *after, int *n) {
  *n = 0;
  for (int i = 0; i < p->nlaunches; i++)
    *n += p->launches[i].alt != NULL;
  if (!*n)
    return true;
  char *arena = arena_new_for(p);
  memcpy(arena, start, (size_t)p->arena_bytes);
  MdlStatus st = {0};
  emu_steps(p, emu, arena, &st, 0, -1, true);
  bool same = !st.set && !memcmp(arena, after, (size_t)p->arena_bytes);
  free(arena);
  return same;
}

// The error of a against the reference b: bf16 in L2 (||a - b|| / ||b||), else max |a - b| / max |b|.
static double rel_l2(const double *a, const double *b, int64_t n) {
  double d = 0, r = 1e-60;
  for (int64_t i = 0; i < n; i++) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    r += b[i] * b[i];
  }
  return isnan(d) ? INFINITY : sqrt(d / r);
}

// One step of the interpreter (fp32 values, bf16 at every CAST) on g from the emulation's
// parameters, batch and scalars; *ok false with the reason in err when it fails.
static Interp *interp_step(Graph *g, bool *ok, char *err, size_t n) {
  Interp *it = interp_new(g, INTERP_F32);
  interp_init_params(it, 7);
  interp_set_seed(it, 7);
  set_inputs_by(g, batch, it, NULL, NULL);
  interp_set_scalar(it, "lr", 2e-3);
  interp_set_scalar(it, "step", 1);
  *ok = interp_run(it, g->n, err, n);
  return it;
}

// One step of md's plan (operands of its GEMMs in prec) in the emulator against the interpreter on
// the same graph. fp32: the loss, every gradient and the moments within 1e-5, max |cuda - interp| /
// max |interp| per tensor. bf16: where an f32 value computed in another order (attention, fused
// elementwise math) lies within an ulp of a bf16 rounding midpoint, it rounds the other way, and that
// 2^-8 difference spreads to every value computed from it; attention over several tiles of keys
// rounds e against the running maximum, at another scale than the interpreter's row maximum (as
// mdl.h allows), in its output and in the backward's D = dout . out. So the loss within 1e-4, the
// gradients within 3e-3 in L2 per tensor (||cuda - interp|| / ||interp||), the moments within 4e-3
// (v is quadratic in the gradient), and at least one gradient must differ from the fp32 graph's (the
// interpreter's) by over 4e-3: the rounding happens.
// An embedding backward adds the rows of dy in increasing position, as the C back end and the
// interpreter do: right after its step (eb, the node), bit for bit the sums of a plain loop in f32.
static void embed_sums_check(const Graph *g, const MemPlan *m, char *arena, int eb, const char *path,
                             const char *mode) {
  const IrNode *nd = g->nodes[eb];
  int64_t v = nd->shape.d[0], c = nd->shape.d[1], rows = shape_numel(g->nodes[nd->in[0]]->shape);
  const int32_t *id = cpu_value(m, arena, nd->in[0]);
  const float *dy = cpu_value(m, arena, nd->in[1]), *got = cpu_value(m, arena, eb);
  float *want = calloc((size_t)(v * c), sizeof *want);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < c && id[r] >= 0 && id[r] < v; j++)
      want[id[r] * c + j] += dy[r * c + j];
  char name[300];
  snprintf(name, sizeof name, "cuda emu %s %s: embed backward adds dy's rows in position order (bit for bit)", path,
           mode);
  CHECK(!memcmp(want, got, sizeof *want * (size_t)(v * c)), name, "sums differ from the loop's");
  free(want);
}

static void test_emulation(const Model *md, bool fused, DType prec, const char *dir) {
  Arena *a = arena_new();
  Graph *g = load(a, md, prec);
  char name[300], why[2048] = "";
  bool bf16 = prec == DT_BF16;
  const char *mode = arena_printf(a, "%s%s", bf16 ? "bf16 " : "", fused ? "fused" : "unfused");
  const double tol_loss = bf16 ? 1e-4 : 1e-5, tol = bf16 ? 3e-3 : 1e-5, tol_m = bf16 ? 4e-3 : 1e-5;
  double (*err_of)(const double *, const double *, int64_t) = bf16 ? rel_l2 : rel_err;
  const char *how = bf16 ? "in L2" : "relative";
  if (!g) {
    snprintf(name, sizeof name, "cuda emu %s %s: compiles", md->path, mode);
    CHECK(false, name, "front end, autodiff or precision failed");
    arena_free(a);
    return;
  }
  Fusion *f = fuse(g, (FuseOptions){.fuse = fused, .chunk_lmhead = fused});
  MemPlan *m = memplan(f);
  CudaPlan *p = emit_cuda_plan(f, m, md->path);
  Emu emu = {0};
  char tag[64];
  const char *base = strrchr(md->path, '/') ? strrchr(md->path, '/') + 1 : md->path;
  snprintf(tag, sizeof tag, "%.*s_%s_%s", (int)strcspn(base, "."), base, prec_name(prec), fused ? "fused" : "unfused");
  double t0 = now();
  bool ok = p && emu_load(p, dir, tag, &emu, why, sizeof why);
  snprintf(name, sizeof name, "cuda emu %s %s: the module compiles with the emulator (%d kernels, %.1f s)", md->path,
           mode, p ? p->nkernels : 0, now() - t0);
  CHECK(ok, name, "%.1500s", p ? why : "emit failed");
  if (!ok) {
    emu_free(&emu);
    arena_free(a);
    return;
  }

  // The reference: one step of the interpreter from the same parameters and batch.
  char err[256];
  bool iok;
  Interp *it = interp_step(g, &iok, err, sizeof err);

  char *arena = arena_new_for(p);
  cpu_init_params(g, m, arena, 7);
  set_inputs_by(g, batch, NULL, m, arena);
  cpu_set_scalar(g, m, arena, "lr", 2e-3);
  cpu_set_scalar(g, m, arena, "step", 1);
  double **p0 = calloc((size_t)g->nparams, sizeof *p0);
  for (int k = 0; k < g->nparams; k++)
    p0[k] = from_float(cpu_value(m, arena, g->params[k]), shape_numel(g->nodes[g->params[k]]->shape));
  char *start = malloc((size_t)p->arena_bytes);
  memcpy(start, arena, (size_t)p->arena_bytes);
  // The step, stopped after each embedding backward to check its sums there (its ids and dy are
  // what the step read; their memory may be reused after it).
  t0 = now();
  MdlStatus st = {0};
  int from = 0;
  for (int s = 0; s < f->nsteps; s++) {
    int eb = f->steps[s].root;
    if (g->nodes[eb]->op != OP_EMBED_BWD || m->offset[eb] < 0) // (a tied table's: added to in the kernel)
      continue;
    emu_steps(p, &emu, arena, &st, from, s, false);
    from = s + 1;
    embed_sums_check(g, m, arena, eb, md->path, mode);
  }
  emu_steps(p, &emu, arena, &st, from, -1, false);
  double t_step = now() - t0;
  snprintf(name, sizeof name, "cuda emu %s %s: one step runs (%d launches, %.1f s)", md->path, mode, p->nlaunches,
           t_step);
  CHECK(iok && !st.set, name, "%s", iok ? cuda_error_what(st.code) : err);
  int nalt;
  bool agree = variants_agree(p, &emu, start, arena, &nalt);
  free(start);
  if (nalt) {
    snprintf(name, sizeof name, "cuda emu %s %s: the kernels' variants leave the same arena to the bit (%d launches "
             "with one)", md->path, mode, nalt);
    CHECK(agree, name, "the arenas differ");
  }
  // (the tensor-core kernels' ldmatrix reads, kernels and variants: every 8 x 8 tile in one pass)
  void (*ldsm_stats)(unsigned long long *, unsigned long long *) =
      (void (*)(unsigned long long *, unsigned long long *))dlsym(emu.so, "mdl_emu_ldsm_stats");
  unsigned long long tiles = 0, extra = 0;
  if (ldsm_stats)
    ldsm_stats(&tiles, &extra);
  if (tiles) {
    snprintf(name, sizeof name, "cuda emu %s %s: ldmatrix reads its %llu 8 x 8 tiles from shared memory without a "
             "bank conflict", md->path, mode, tiles);
    CHECK(extra == 0, name, "%llu extra passes", extra);
  }

  double loss = *(float *)cpu_value(m, arena, g->loss), ref = interp_value(it, g->loss)[0];
  snprintf(name, sizeof name, "cuda emu %s %s: loss matches the interpreter within %.0e (%.6f)", md->path, mode,
           tol_loss, ref);
  CHECK(fabs(loss - ref) <= tol_loss * fabs(ref), name, "loss %.8f vs %.8f", loss, ref);
  double worst = 0, worst_m = 0, worst_p = 0, ss = 0;
  const char *which = "?", *which_m = "?", *which_p = "?";
  double **grads = calloc((size_t)g->nparams, sizeof *grads);
  for (int k = 0; k < g->nparams; k++) {
    int64_t n = shape_numel(g->nodes[g->params[k]]->shape);
    grads[k] = from_float(cpu_value(m, arena, g->grads[k]), n);
    for (int64_t i = 0; i < n; i++)
      ss += grads[k][i] * grads[k][i];
    double e = err_of(grads[k], interp_value(it, g->grads[k]), n);
    if (e > worst || isinf(e))
      worst = e, which = g->nodes[g->params[k]]->name;
  }
  // The AdamW moments against the interpreter's; the parameters against AdamW computed here from the
  // emulated gradients (the first step's update is about lr sign(g): gradients that are rounding noise,
  // such as a key bias's, make whole differences, so the parameters are checked against the same
  // gradients).
  const double gn = (float)sqrt(ss), lr = (float)2e-3;
  for (int i = 0; i < g->n; i++) {
    const IrNode *u = g->nodes[i];
    int64_t n = shape_numel(u->shape);
    if (u->op == OP_STATE) {
      double *x = from_float(cpu_value(m, arena, i), n), e = err_of(x, interp_param(it, i), n);
      if (e > worst_m || isinf(e))
        worst_m = e, which_m = u->name;
      free(x);
    }
    if (u->op != OP_ADAMW)
      continue;
    int k = 0;
    while (g->params[k] != u->in[0])
      k++;
    const double b1 = u->fa[0], b2 = u->fa[1], eps = u->fa[2], wd = u->fa[3], clip = u->fa[4];
    const double sc = clip > 0 ? fmin(1.0, clip / (gn + 1e-6)) : 1.0;
    double *want = malloc(sizeof *want * (size_t)n), *got = from_float(cpu_value(m, arena, u->in[0]), n);
    for (int64_t j = 0; j < n; j++) {
      double gi = sc * grads[k][j], mo = (float)((1 - b1) * gi), vo = (float)((1 - b2) * gi * gi);
      want[j] = (float)(p0[k][j] - lr * (mo / (1 - b1) / (sqrt(vo / (1 - b2)) + eps) + wd * p0[k][j]));
    }
    double e = rel_err(got, want, n);
    if (e > worst_p || isinf(e))
      worst_p = e, which_p = u->name ? u->name : g->nodes[u->in[0]]->name;
    free(want);
    free(got);
  }
  snprintf(name, sizeof name, "cuda emu %s %s: every gradient within %.0e %s (worst %.1e)", md->path, mode, tol,
           how, worst);
  CHECK(worst < tol, name, "%s: %.3g", which, worst);
  snprintf(name, sizeof name, "cuda emu %s %s: AdamW moments within %.0e %s (worst %.1e)", md->path, mode, tol_m,
           how, worst_m);
  CHECK(worst_m < tol_m, name, "%s: %.3g", which_m, worst_m);
  snprintf(name, sizeof name, "cuda emu %s %s: parameters after AdamW within 1e-6 of AdamW on these gradients "
           "(worst %.1e)", md->path, mode, worst_p);
  CHECK(worst_p < 1e-6, name, "%s: %.3g", which_p, worst_p);
  // The bf16 copies of the weights (fuse.c, rule 11): the optimizer kernel rounds each new parameter
  // into its copy, bit for bit as the host rounds it.
  int ncopies = 0;
  int64_t differ = 0, ncopied = 0;
  for (int k = 0; k < g->nparams; k++) {
    int c = m->copy_of[g->params[k]];
    if (c < 0)
      continue;
    int64_t n = shape_numel(g->nodes[c]->shape);
    uint16_t *want = malloc(sizeof *want * (size_t)n);
    cpu_bf16_from_f32(cpu_value(m, arena, g->params[k]), want, n);
    const uint16_t *got = cpu_value(m, arena, c);
    for (int64_t i = 0; i < n; i++)
      differ += got[i] != want[i];
    ncopies++;
    ncopied += n;
    free(want);
  }
  if (ncopies) {
    snprintf(name, sizeof name, "cuda emu %s %s: the optimizer rounds the new weights into their %d bf16 copies "
             "(%lld values)", md->path, mode, ncopies, (long long)ncopied);
    CHECK(differ == 0, name, "%lld differ", (long long)differ);
  }
  for (int k = 0; k < g->nparams; k++)
    free(p0[k]);
  free(p0);

  // The same step again, from the same start: bit-identical. Where kernels have variants,
  // variants_agree has run the step again from the same start already and found the whole arena the
  // same to the bit (a kernel that is not deterministic would differ there as here).
  if (!nalt && !lean(md)) {
    cpu_init_params(g, m, arena, 7);
    memset(arena + m->m, 0, (size_t)(2 * m->param_bytes));
    cpu_set_scalar(g, m, arena, "step", 1);
    emu_step(p, &emu, arena);
    bool same = *(float *)cpu_value(m, arena, g->loss) == (float)loss;
    for (int k = 0; k < g->nparams; k++) {
      int64_t n = shape_numel(g->nodes[g->params[k]]->shape);
      double *again = from_float(cpu_value(m, arena, g->grads[k]), n);
      same &= !memcmp(again, grads[k], sizeof(double) * (size_t)n);
      free(again);
    }
    snprintf(name, sizeof name, "cuda emu %s %s: a second run is bit-identical", md->path, mode);
    CHECK(same, name, "results differ");
  }

  // bf16 rounds: a gradient is clearly off the fp32 graph's (the interpreter's): by 1e-3, where f32
  // alone stays within 1e-5 (a bf16 operand is off by up to 2^-9 relative).
  if (bf16) {
    Graph *g32 = load(a, md, DT_F32);
    bool ok32 = false;
    Interp *r32 = g32 ? interp_step(g32, &ok32, err, sizeof err) : NULL;
    double far = 0;
    const char *at = "?";
    for (int k = 0; ok32 && k < g->nparams; k++) {
      double e = rel_l2(grads[k], interp_value(r32, g32->grads[k]), shape_numel(g->nodes[g->params[k]]->shape));
      if (e > far)
        far = e, at = g->nodes[g->params[k]]->name;
    }
    snprintf(name, sizeof name, "cuda emu %s %s: a gradient differs from the fp32 graph's by over 1e-3 (%.1e in L2 "
             "at %s)", md->path, mode, far, at);
    CHECK(ok32 && far > 1e-3, name, "%s", ok32 ? "too close: no bf16 rounding?" : err);
    if (r32)
      interp_free(r32);
  }

  // Bad targets and ids are reported (models with tokens and targets of [B, T]).
  int32_t *targets = NULL, *tokens = NULL;
  int64_t v = 0, rows = 0;
  for (int i = 0; i < g->n; i++) {
    const IrNode *u = g->nodes[i];
    if (u->op == OP_INPUT && !strcmp(u->name, "targets") && u->shape.rank == 2)
      targets = cpu_value(m, arena, i);
    else if (u->op == OP_INPUT && !strcmp(u->name, "tokens"))
      tokens = cpu_value(m, arena, i);
    else if (u->op == OP_CROSS_ENTROPY)
      v = g->nodes[u->in[0]]->shape.d[g->nodes[u->in[0]]->shape.rank - 1];
    else if (u->op == OP_EMBED && g->nodes[u->in[1]]->name && !strcmp(g->nodes[u->in[1]]->name, "tokens"))
      rows = g->nodes[u->in[0]]->shape.d[0];
  }
  if (fused && targets && tokens && !lean(md)) {
    targets[5] = (int32_t)v + 44;
    st = emu_step(p, &emu, arena);
    snprintf(name, sizeof name, "cuda emu %s %s: a target >= V is reported", md->path, mode);
    CHECK(st.set && st.code == CUDA_ERR_TARGET && st.value == v + 44 && st.limit == v, name,
          "set %llu code %lld value %lld limit %lld", st.set, st.code, st.value, st.limit);
    targets[5] = 1;
    tokens[0] = (int32_t)rows + 7;
    st = emu_step(p, &emu, arena);
    snprintf(name, sizeof name, "cuda emu %s %s: a token id >= V is reported", md->path, mode);
    CHECK(st.set && st.code == CUDA_ERR_EMBED_ID && st.value == rows + 7 && st.limit == rows &&
              !strcmp(cuda_error_what(st.code), "embed: id"),
          name, "set %llu code %lld value %lld limit %lld", st.set, st.code, st.value, st.limit);
  }
  for (int k = 0; k < g->nparams; k++)
    free(grads[k]);
  free(grads);
  free(arena);
  interp_free(it);
  emu_free(&emu);
  arena_free(a);
}

// Attention alone, its q, k and v parameters (the same values in both runs), causal within
// documents or causal alone (alone's %s are the doc input and argument; the tensor-core kernels mask
// only tiles on the diagonal, past T or, by their warps' votes, across documents, and skip tiles of
// other documents: "docs" has documents that come back after others), heads of 32 (two buffers of
// tiles) and 128 (one): the emulated bf16 kernels against the interpreter's contract (mdl.h), the
// forward's output and the gradients of q, k and v in L2. Where a row's keys fit in one tile (of the forward
// and of the backward's statistics) the running maximum is the row's maximum, e is the
// interpreter's, and only f32 sums differ: within 2e-5 (rounding q, k, v or e anywhere else, or not
// at all, is off by 1e-4 or more). Over several tiles e is taken against the maximum so far and so
// rounds at another scale, as the contract accepts: out within 1e-3. The backward's P = exp(S - lse)
// is the interpreter's at any T on CUDA cores (heads of 12): dv within 3e-5 (rows of up to 150 keys
// round a few products the other way, their f32 sums being off the interpreter's double ones: 8e-6;
// leaving dout and P unrounded is off by 2e-3). On tensor cores (heads of 32) P is exp2f of S and
// lse scaled by log2(e), an f32 value an ulp or so off expf's, so more of it rounds to the other bf16
// neighbour: dv within 1e-4 (measured: 1.8e-5 within documents, 3.5e-5 without). dq and dk
// subtract D = dout . out, out being each side's own forward, so they are as close as the outputs
// are: within 3e-5 over one tile (measured: 7e-8), within the output's 1e-3 over several (measured:
// 1e-4 to 7e-4).
static const char alone[] =
    "model alone\n"
    "dim B = 2\n"
    "dim T = 64\n"
    "dim C = 64\n"
    "dim H = 2\n"
    "dim D = C / H\n"
    "%s"
    "input r: f32[B, T, C]\n"
    "param q: [B, T, C] = normal(1.0)\n"
    "param k: [B, T, KH*D] = normal(1.0)\n"
    "param v: [B, T, KH*D] = normal(1.0)\n"
    "output a = attention(q, k, v, heads=H, kv_heads=KH, causal=true%s)\n"
    "output loss = mean(a * r)\n";

static void test_attention_alone(const char *dir) {
  static const struct {
    int64_t t, c;
    const char *doc; // the documents (batch), if any
    const char *what;
    double tol;
    int window; // (and one kv head for both query heads where there is a window)
  } cases[] = {
      {32, 64, "doc", "tensor cores, heads of 32, one key tile", 2e-5, 0},
      {150, 64, "doc", "tensor cores, heads of 32, several key tiles", 1e-3, 0},
      {150, 64, NULL, "tensor cores, heads of 32, several key tiles, no documents", 1e-3, 0},
      {300, 64, "doc", "tensor cores, heads of 32, blocks of 128 rows with warps past the tile", 1e-3, 0},
      {300, 64, "docs", "tensor cores, heads of 32, documents that come back after others", 1e-3, 0},
      {150, 256, "doc", "tensor cores, heads of 128 (tiles in one buffer), several key tiles", 1e-3, 0},
      {32, 24, "doc", "CUDA cores, heads of 12, one key tile", 2e-5, 0},
      {80, 24, "doc", "CUDA cores, heads of 12, several key tiles", 1e-3, 0},
      {150, 24, NULL, "CUDA cores, heads of 12, several key tiles, no documents", 1e-3, 0},
      {150, 64, "doc", "tensor cores, heads of 32, one kv head, window 70 across key tiles", 1e-3, 70},
      {300, 64, NULL, "tensor cores, heads of 32, one kv head, blocks of 128 rows, window 100", 1e-3, 100},
      {150, 24, "doc", "CUDA cores, heads of 12, one kv head, window 40 across key tiles", 1e-3, 40},
  };
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    char path[64], name[300], why[2048] = "";
    const char *doc = cases[ci].doc;
    int window = cases[ci].window;
    snprintf(path, sizeof path, "alone-t%lld-c%lld-%s-w%d.mdl", (long long)cases[ci].t, (long long)cases[ci].c,
             doc ? doc : "nodoc", window);
    Arena *a = arena_new();
    const char *dims = arena_printf(a, "dim KH = %s\n%s", window ? "1" : "H",
                                    doc ? arena_printf(a, "input %s: i32[B, T]\n", doc) : "");
    const char *opts = arena_printf(a, "%s%s", doc ? arena_printf(a, ", doc=%s", doc) : "",
                                    window ? arena_printf(a, ", window=%d", window) : "");
    Model md = {.path = path, .ov = {{"T", cases[ci].t}, {"C", cases[ci].c}}, .nov = 2,
                .text = arena_printf(a, alone, dims, opts)};
    Graph *g = load(a, &md, DT_BF16);
    Fusion *f = g ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
    MemPlan *m = f ? memplan(f) : NULL;
    CudaPlan *p = m ? emit_cuda_plan(f, m, path) : NULL;
    Emu emu = {0};
    bool ok = p && emu_load(p, dir, arena_printf(a, "alone_%zu", ci), &emu, why, sizeof why);
    snprintf(name, sizeof name, "cuda emu attention alone, bf16, %s: compiles", cases[ci].what);
    if (!ok) {
      CHECK(false, name, "%.1500s", p ? why : "front end or emit failed");
      emu_free(&emu);
      arena_free(a);
      continue;
    }
    char err[256];
    bool iok;
    Interp *it = interp_step(g, &iok, err, sizeof err);
    char *arena = arena_new_for(p);
    cpu_init_params(g, m, arena, 7);
    set_inputs_by(g, batch, NULL, m, arena);
    cpu_set_scalar(g, m, arena, "lr", 2e-3);
    cpu_set_scalar(g, m, arena, "step", 1);
    char *start = malloc((size_t)p->arena_bytes);
    memcpy(start, arena, (size_t)p->arena_bytes);
    MdlStatus st = emu_step(p, &emu, arena);
    int nalt;
    bool agree = variants_agree(p, &emu, start, arena, &nalt);
    free(start);
    if (cases[ci].c / 2 % 16 == 0) { // (heads of a multiple of 16 channels run on tensor cores)
      snprintf(name, sizeof name, "cuda emu attention alone, bf16, %s: the kernels' variants (the other block "
               "sizes) leave the same arena to the bit (%d launches with one)", cases[ci].what, nalt);
      CHECK(agree && nalt == 3, name, "%s", nalt == 3 ? "the arenas differ" : "not 3 launches with a variant");
    }
    int out = g->outputs[0];
    int64_t n = shape_numel(g->nodes[out]->shape);
    double *got = from_float(cpu_value(m, arena, out), n);
    double e_out = iok && !st.set ? rel_l2(got, interp_value(it, out), n) : INFINITY, e_grad[3] = {0};
    free(got);
    for (int k = 0; k < 3; k++) {
      e_grad[k] = INFINITY;
      if (!iok || st.set || k >= g->nparams)
        continue;
      int64_t np = shape_numel(g->nodes[g->params[k]]->shape);
      got = from_float(cpu_value(m, arena, g->grads[k]), np);
      e_grad[k] = rel_l2(got, interp_value(it, g->grads[k]), np);
      free(got);
    }
    snprintf(name, sizeof name, "cuda emu attention alone, bf16, %s: the output within %.0e in L2 of the "
             "interpreter's (%.1e)", cases[ci].what, cases[ci].tol, e_out);
    CHECK(e_out <= cases[ci].tol, name, "%s", iok ? "too far" : err);
    double tol_grad = cases[ci].c / 2 % 16 == 0 ? 1e-4 : 3e-5; // dv: P's rounding (on tensor cores)
    double tol_ds = cases[ci].tol > tol_grad ? cases[ci].tol : tol_grad; // dq, dk: as close as out (D)
    snprintf(name, sizeof name, "cuda emu attention alone, bf16, %s: dq, dk within %.0e and dv within %.0e in L2 of "
             "the interpreter's (%.1e, %.1e, %.1e)", cases[ci].what, tol_ds, tol_grad, e_grad[0], e_grad[1], e_grad[2]);
    CHECK(e_grad[0] <= tol_ds && e_grad[1] <= tol_ds && e_grad[2] <= tol_grad, name, "%s", iok ? "too far" : err);
    free(arena);
    interp_free(it);
    emu_free(&emu);
    arena_free(a);
  }
}

// The LM head in two chunks (64 rows, then 16), as GPT-2 124M runs it (2 of 4096): llama-tiny (an
// untied head, x @ W with W [C, V]) and gpt2-tiny (tied, x @ wte^T with wte [V, C]) with at most
// 16384 logits a chunk ($MDL_LMHEAD_LOGITS). The dW GEMM of the second chunk accumulates. Their
// vocabulary cut to 250 classes, as GPT-2's 50257 is no multiple of 64: the chunks' rows are padded
// to 256 (the logits GEMM writes them, the kernel and the dx and dW GEMMs read them so); where W is
// the [V, C] embedding's bf16 copy (memplan pads its rows with zeros), the logits GEMM also computes
// 256 columns and the dx GEMM sums over 256 classes. Emulated against the interpreter, f32 and bf16.
static void test_lmhead_chunks(const char *dir, const char *path, bool tied) {
  FILE *fp = fopen(path, "rb");
  static char text[1 << 16];
  size_t len = fp ? fread(text, 1, sizeof text - 1, fp) : 0;
  if (fp)
    fclose(fp);
  text[len] = 0;
  char *vdim = strstr(text, "dim V = 256");
  char name[256];
  snprintf(name, sizeof name, "cuda lm head chunks: %s reads, with 256 classes", path);
  CHECK(vdim, name, "no model, or another V");
  if (!vdim)
    return;
  memcpy(vdim, "dim V = 250", 11);
  Model md = {tied ? "gpt2-tiny-chunked.mdl" : "llama-tiny-chunked.mdl", {{"B", 1}, {"T", 80}}, 2, text};
  setenv("MDL_LMHEAD_LOGITS", "16384", 1);
  for (int pr = 0; pr < 2; pr++) {
    bool bf16 = pr == 1;
    Arena *a = arena_new();
    Graph *g = load(a, &md, bf16 ? DT_BF16 : DT_F32);
    Fusion *f = g ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
    MemPlan *mp = f ? memplan(f) : NULL;
    CudaPlan *p = f ? emit_cuda_plan(f, mp, md.path) : NULL;
    int ce = 0, dw = 0, acc = 0, lm = -1, padded = 0, wide = 0;
    // Every bf16 copy of a matrix has room for rows up to a multiple of 64 before the next buffer:
    // the embedding's (250 rows) up to 256.
    int copies = 0, roomy = 0;
    for (int i = 0; mp && i < g->nparams; i++) {
      int cp = mp->copy_of[g->params[i]];
      if (cp < 0 || g->nodes[cp]->shape.rank != 2)
        continue;
      int64_t room = mp->copies + mp->copy_bytes - mp->offset[cp], rows = g->nodes[cp]->shape.d[0];
      for (int j = 0; j < g->nparams; j++) {
        int other = mp->copy_of[g->params[j]];
        if (other >= 0 && mp->offset[other] > mp->offset[cp] && mp->offset[other] - mp->offset[cp] < room)
          room = mp->offset[other] - mp->offset[cp];
      }
      copies++;
      roomy += room >= (rows + 63) / 64 * 64 * g->nodes[cp]->shape.d[1] * 2;
    }
    if (bf16)
      CHECK(copies > 0 && roomy == copies, arena_printf(a, "cuda lm head chunks: %s: memplan gives each bf16 copy of "
            "a matrix room for rows up to a multiple of 64", md.path), "%d of %d", roomy, copies);
    for (int s = 0; f && s < f->nsteps; s++)
      if (f->steps[s].kind == STEP_LMHEAD)
        lm = s;
    int64_t vn = tied && bf16 ? 256 : 250; // the logits GEMM's N, the dx GEMM's K
    for (int i = 0; p && i < p->nlaunches; i++) {
      const CudaLaunch *l = &p->launches[i];
      ce += l->kernel && strstr(l->kernel, "lmhead") && strstr(l->kernel, "_ce");
      const CudaGemm *gm = l->kernel ? NULL : &p->gemms[l->gemm];
      bool w = gm && gm->step == lm && gm->m * gm->n == 250 * 64 && gm->ta;
      dw += w; // dW = x^T dlogits: [C x V], K = the chunk's rows
      acc += w && gm->beta == 1.0f;
      // logits (N = V, into rows of 256), dx (K = V, from them), dW = x^T dlogits (dlogits its B, or
      // its A transposed where W is [V, C])
      bool lg = gm && gm->step == lm && gm->n == vn && gm->ldc == 256, dx = gm && gm->step == lm && gm->k == vn &&
                                                                                 gm->lda == 256;
      padded += lg || dx || (w && (gm->lda == 256 || gm->ldb == 256));
      wide += (lg || dx) && vn == 256;
    }
    const char *label = arena_printf(a, "cuda lm head chunks: %s %s", md.path, bf16 ? "bf16" : "f32");
    CHECK(ce == 2 && dw == 2 && acc == 1, arena_printf(a, "%s: 80 rows of 250 logits in 2 chunks (a cross-entropy "
          "kernel and a dW GEMM each, the second accumulating)", label), "%d cross-entropy launches, %d dW GEMMs (%d "
          "accumulating)", ce, dw, acc);
    CHECK(padded == 6, arena_printf(a, "%s: the chunks' rows of 250 logits are 256 apart in every GEMM", label),
          "%d of 6 GEMMs", padded);
    CHECK(wide == (vn == 256 ? 4 : 0), arena_printf(a, "%s: the logits and dx GEMMs %s", label, vn == 256 ?
          "run over 256 classes, W's copy padded with zero rows" : "run over the 250 classes"), "%d of 4", wide);
    arena_free(a);
    test_emulation(&md, true, bf16 ? DT_BF16 : DT_F32, dir);
  }
  // A value that is no positive count is refused, not taken for the default.
  Arena *a = arena_new();
  Model plain = {.path = path};
  Graph *g = load(a, &plain, DT_BF16);
  Fusion *f = g ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
  setenv("MDL_LMHEAD_LOGITS", "16k", 1);
  CHECK(f && !emit_cuda_plan(f, memplan(f), path),
        arena_printf(a, "cuda lm head chunks: %s: MDL_LMHEAD_LOGITS=16k is refused", path), "%s",
        f ? "a plan was emitted" : "no fusion");
  arena_free(a);
  unsetenv("MDL_LMHEAD_LOGITS");
}

// One step of a model with inputs x (n floats) and targets (rows), parameters drawn from seed 7 and lr
// 2e-3, by the interpreter and on the emulated GPU: the checks of the cross-entropy compare the two.
typedef struct {
  Interp *it;
  bool iok;        // the interpreter ran (else err says why)
  char err[256];
  char *arena;     // the emulated GPU's arena after the step
  MdlStatus st;    // its kernels' status
} BothRuns;

static BothRuns run_both(Graph *g, MemPlan *m, CudaPlan *p, Emu *emu, const float *x, int64_t n, const int32_t *tg,
                         int64_t rows) {
  BothRuns b = {.it = interp_new(g, INTERP_F32)};
  interp_init_params(b.it, 7);
  interp_set_input(b.it, "x", NULL, x, n);
  interp_set_input(b.it, "targets", tg, NULL, rows);
  interp_set_scalar(b.it, "lr", 2e-3);
  interp_set_scalar(b.it, "step", 1);
  b.iok = interp_run(b.it, g->n, b.err, sizeof b.err);
  b.arena = arena_new_for(p);
  cpu_init_params(g, m, b.arena, 7);
  cpu_set_input(g, m, b.arena, "x", NULL, x, n);
  cpu_set_input(g, m, b.arena, "targets", tg, NULL, rows);
  cpu_set_scalar(g, m, b.arena, "lr", 2e-3);
  cpu_set_scalar(g, m, b.arena, "step", 1);
  b.st = emu_step(p, emu, b.arena);
  return b;
}

static void both_free(BothRuns *b) {
  free(b->arena);
  interp_free(b->it);
}

// Cross-entropy at the edges of its online maximum, emulated against the interpreter: a row whose
// logits are -inf from 100 on, a row where every lane's first logit is -inf (but the target's), two
// finite rows; the loss and the gradient of s agree within 1e-5. With a NaN logit in the last row,
// the loss is NaN on both.
static const char celimits[] = "model celimits\n"
                               "dim R = 4\n"
                               "dim V = 300\n"
                               "input x: f32[R, V]\n"
                               "input targets: i32[R]\n"
                               "param s: [V] = normal(0.1)\n"
                               "output loss = mean(cross_entropy(x + s, targets))\n";

static void test_ce_limits(const char *dir) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "celimits.mdl", celimits, NULL, 0);
  char why[2048] = "";
  bool ok = g && autodiff(g, true);
  Fusion *f = ok ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true}) : NULL;
  MemPlan *m = f ? memplan(f) : NULL;
  CudaPlan *p = m ? emit_cuda_plan(f, m, "celimits.mdl") : NULL;
  Emu emu = {0};
  ok = p && emu_load(p, dir, "celimits", &emu, why, sizeof why);
  CHECK(ok, "cuda emu cross-entropy limits: the module compiles with the emulator", "%.1500s", why);
  for (int nan = 0; ok && nan < 2; nan++) {
    enum { R = 4, V = 300 };
    static float x[R * V];
    int32_t tg[R] = {1, 2, 0, 3};
    for (int j = 0; j < R * V; j++)
      x[j] = (float)(3 * sin(0.7 * j + 0.3));
    for (int j = 100; j < V; j++)
      x[j] = -INFINITY;
    for (int j = 0; j < 64; j++)
      if (j != tg[1])
        x[V + j] = -INFINITY;
    if (nan)
      x[3 * V + 7] = NAN;
    BothRuns b = run_both(g, m, p, &emu, x, R * V, tg, R);
    double loss = *(float *)cpu_value(m, b.arena, g->loss), ref = interp_value(b.it, g->loss)[0];
    if (nan) {
      CHECK(b.iok && !b.st.set && isnan(loss) && isnan(ref),
            "cuda emu cross-entropy limits: a NaN logit gives a NaN loss", "loss %g, interpreter %g (%s)", loss, ref,
            b.err);
    } else {
      int64_t n = shape_numel(g->nodes[g->params[0]]->shape);
      double *gs = from_float(cpu_value(m, b.arena, g->grads[0]), n);
      double e = rel_err(gs, interp_value(b.it, g->grads[0]), n);
      CHECK(b.iok && !b.st.set && isfinite(loss) && fabs(loss - ref) <= 1e-5 * fabs(ref) && e <= 1e-5,
            "cuda emu cross-entropy limits: rows of -inf logits give the interpreter's loss and gradient (1e-5)",
            "loss %.8f vs %.8f, gradient %.2e (%s)", loss, ref, e, b.err);
      free(gs);
    }
    both_free(&b);
  }
  emu_free(&emu);
  arena_free(a);
}

// The bf16 LM head's loss reads the logits rounded to bf16, emulated against the interpreter. With
// one channel each logit is a single product of two bf16 values, exact in f32 whatever the GEMM's
// order, so both round the same logits: the losses agree within 1e-6 and the gradients within 1e-5,
// while the loss of the same logits unrounded (computed here from the interpreter's) is over 2e-5
// away (5.6e-5). Fused, the step is the chunked LM head (its cross-entropy kernel overwrites bf16 logits
// with bf16 dlogits); unfused, the GEMM stores the logits' CAST and a cross-entropy kernel reads it.
static const char lmround[] = "model lmround\n"
                              "dim R = 64\n"
                              "dim V = 300\n"
                              "input x: f32[R, 1]\n"
                              "input targets: i32[R]\n"
                              "param s: [1] = ones\n"
                              "param w: [1, V] = normal(4.0)\n"
                              "output loss = mean(cross_entropy((x * s) @ w, targets))\n";

static void test_lmhead_rounding(const char *dir, bool fused) {
  enum { R = 64, V = 300 };
  Arena *a = arena_new();
  Graph *g = mdl_compile_text(a, "lmround.mdl", lmround, NULL, 0);
  char why[2048] = "";
  const char *label = fused ? "cuda emu bf16 LM head fused" : "cuda emu bf16 LM head unfused";
  bool ok = g && autodiff(g, true) && precision_assign(g, DT_BF16, why, sizeof why);
  Fusion *f = ok ? fuse(g, (FuseOptions){.fuse = fused, .chunk_lmhead = fused}) : NULL;
  MemPlan *m = f ? memplan(f) : NULL;
  CudaPlan *p = m ? emit_cuda_plan(f, m, "lmround.mdl") : NULL;
  int lm = 0, mm = -1, ce = -1;
  for (int s = 0; f && s < f->nsteps; s++)
    lm += f->steps[s].kind == STEP_LMHEAD;
  for (int i = 0; g && i < g->n; i++) {
    mm = g->nodes[i]->op == OP_MATMUL && mm < 0 ? i : mm;
    ce = g->nodes[i]->op == OP_CROSS_ENTROPY ? i : ce;
  }
  Emu emu = {0};
  ok = p && lm == fused && mm >= 0 && ce >= 0 &&
       emu_load(p, dir, fused ? "lmround" : "lmround-u", &emu, why, sizeof why);
  CHECK(ok, arena_printf(a, "%s: the module compiles with the emulator, %s LM-head step", label, fused ? "one" : "no"),
        "%d LM-head steps; %.1500s", lm, why);
  if (!ok) {
    arena_free(a);
    return;
  }
  static float x[R];
  int32_t tg[R];
  for (int j = 0; j < R; j++) {
    x[j] = (float)(3 * sin(0.7 * j + 0.3));
    tg[j] = (j * 37 + 5) % V;
  }
  BothRuns b = run_both(g, m, p, &emu, x, R, tg, R);
  double loss = *(float *)cpu_value(m, b.arena, g->loss), ref = interp_value(b.it, g->loss)[0], plain = 0, e = 0;
  const double *lg = interp_value(b.it, mm); // the logits as the GEMM computes them, unrounded
  for (int r = 0; b.iok && r < R; r++) {
    double mx = -INFINITY, sum = 0;
    for (int j = 0; j < V; j++)
      mx = fmax(mx, lg[r * V + j]);
    for (int j = 0; j < V; j++)
      sum += exp(lg[r * V + j] - mx);
    plain += (mx + log(sum) - lg[r * V + tg[r]]) / R;
  }
  for (int k = 0; b.iok && k < g->nparams; k++) {
    int64_t n = shape_numel(g->nodes[g->params[k]]->shape);
    double *gr = from_float(cpu_value(m, b.arena, g->grads[k]), n);
    e = fmax(e, rel_err(gr, interp_value(b.it, g->grads[k]), n));
    free(gr);
  }
  CHECK(b.iok && !b.st.set && fabs(loss - ref) <= 1e-6 * fabs(ref) && e <= 1e-5 && fabs(plain - ref) > 2e-5 * fabs(ref),
        arena_printf(a, "%s: the loss of the logits rounded to bf16, as the interpreter's (1e-6), gradients (1e-5)",
                     label),
        "loss %.8f vs %.8f (unrounded logits: %.8f), gradients %.2e (%s)", loss, ref, plain, e, b.err);
  both_free(&b);
  emu_free(&emu);
  arena_free(a);
}

// The optimizers other than AdamW, on a small MLP: SGD with momentum and Nesterov, per-parameter
// lr_scale, a frozen bias and clipping; plain SGD with weight decay (no moments); Lion with lr_scale;
// Muon (its Newton-Schulz GEMMs and both optimizer steps) with lr_scale and clipping.
#define OPT_MLP                                                                                    \
  "dim B = 8\ndim N = 16\ndim H = 32\ndim K = 4\n"                                                   \
  "input x: f32[B, N]\ninput targets: i32[B]\n"                                                     \
  "param w1: [N, H] = normal(0.25)\nparam b1: [H] = zeros\nparam w2: [H, K] = normal(0.18)\n"        \
  "param b2: [K] = normal(0.1)\n"                                                                  \
  "h = relu(x @ w1 + b1)\noutput loss = mean(cross_entropy(h @ w2 + b2, targets))\n"
static const Model opt_models[] = {
    {"optsgd.mdl", {{NULL, 0}}, 0,
     "model optsgd\n" OPT_MLP "train {\n optimizer = sgd(lr=0.1, momentum=0.9, nesterov=true, weight_decay=0.01)\n"
     " lr_scale = {\"w*\": 0.5, \"b1\": 3}\n freeze = [\"b2\"]\n clip = 1.0\n}\n"},
    {"optplain.mdl", {{NULL, 0}}, 0, "model optplain\n" OPT_MLP "train {\n optimizer = sgd(lr=0.1, weight_decay=0.1)\n}\n"},
    {"optlion.mdl", {{NULL, 0}}, 0,
     "model optlion\n" OPT_MLP "train {\n optimizer = lion(lr=3e-4, weight_decay=0.1)\n lr_scale = {\"b*\": 2}\n}\n"},
    {"optmuon.mdl", {{NULL, 0}}, 0, // (Muon for the wide w1 and the tall w2; the head and biases AdamW)
     "model optmuon\ndim B = 8\ndim N = 16\ndim H = 32\ndim K = 4\ninput x: f32[B, N]\ninput targets: i32[B]\n"
     "param w1: [N, H] = normal(0.25)\nparam b1: [H] = zeros\nparam w2: [H, 24] = normal(0.18)\n"
     "param w3: [24, K] = normal(0.2)\nparam b3: [K] = zeros\n"
     "h = relu(relu(x @ w1 + b1) @ w2)\noutput loss = mean(cross_entropy(h @ w3 + b3, targets))\n"
     "train {\n optimizer = muon(lr=0.02, weight_decay=0.01, adam_lr=1e-3)\n lr_scale = {\"w2\": 0.5}\n clip = 1.0\n}\n"},
};

// Each of opt_models, fused: the module compiles with NVRTC for sm_80 and sm_90 (where NVRTC is
// installed); 10 emulated steps against 10 interpreter steps (INTERP_F32, the same start, batch and
// lr): every trained parameter and every moment within 1e-5 relative per tensor (max |cuda - interp|
// / max |interp|), the frozen parameter bit for bit its initial value.
static void test_optimizers(const char *dir, bool nvrtc) {
  for (size_t mi = 0; mi < sizeof opt_models / sizeof *opt_models; mi++) {
    const Model *md = &opt_models[mi];
    Arena *a = arena_new();
    Graph *g = load(a, md, DT_F32);
    char name[300], why[2048] = "", err[256];
    snprintf(name, sizeof name, "cuda optimizer %s: compiles", md->path);
    CHECK(g != NULL, name, "front end or autodiff failed");
    if (!g) {
      arena_free(a);
      continue;
    }
    Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
    MemPlan *m = memplan(f);
    CudaPlan *p = emit_cuda_plan(f, m, md->path);
    for (int i = 0; nvrtc && p && i < 2; i++) {
      Job j = {.src = p->source, .arch = i ? "sm_90" : "sm_80"};
      compile_job(&j);
      snprintf(name, sizeof name, "nvrtc %s fp32 fused %s compiles (%d kernels)", md->path, j.arch, p->nkernels);
      CHECK(j.ok && j.r.size > 0 && !j.r.log, name, "%.600s", j.ok ? j.r.log : j.err);
      free(j.r.cubin);
      free(j.r.log);
    }
    Emu emu = {0};
    char tag[64];
    snprintf(tag, sizeof tag, "opt%zu", mi);
    bool ok = p && emu_load(p, dir, tag, &emu, why, sizeof why);
    snprintf(name, sizeof name, "cuda emu %s: the module compiles with the emulator", md->path);
    CHECK(ok, name, "%.1500s", p ? why : "emit failed");
    Interp *it = interp_new(g, INTERP_F32);
    interp_init_params(it, 7);
    interp_set_seed(it, 7);
    set_inputs_by(g, batch, it, NULL, NULL);
    interp_set_scalar(it, "lr", 2e-3);
    char *arena = ok ? arena_new_for(p) : NULL;
    if (arena) {
      cpu_init_params(g, m, arena, 7);
      set_inputs_by(g, batch, NULL, m, arena);
      cpu_set_scalar(g, m, arena, "lr", 2e-3);
    }
    double **p0 = calloc((size_t)g->nparams, sizeof *p0);
    for (int k = 0; arena && k < g->nparams; k++)
      p0[k] = from_float(cpu_value(m, arena, g->params[k]), shape_numel(g->nodes[g->params[k]]->shape));
    bool run = true;
    for (int s = 1; ok && s <= 10 && run; s++) {
      interp_set_scalar(it, "step", s);
      cpu_set_scalar(g, m, arena, "step", s);
      MdlStatus st = emu_step(p, &emu, arena);
      run = !st.set && interp_run(it, g->n, err, sizeof err);
    }
    snprintf(name, sizeof name, "cuda emu %s: 10 steps run", md->path);
    CHECK(ok && run, name, "%s", ok ? err : "no module");
    double worst = 0;
    const char *which = "?";
    int frozen = 0;
    bool kept = true;
    for (int i = 0; ok && run && i < g->n; i++) {
      const IrNode *u = g->nodes[i];
      if (u->op != OP_PARAM && u->op != OP_STATE)
        continue;
      int64_t n = shape_numel(u->shape);
      double *x = from_float(cpu_value(m, arena, i), n);
      if (u->op == OP_PARAM && u->init.frozen) {
        int k = 0;
        while (g->params[k] != i)
          k++;
        frozen++;
        kept &= !memcmp(x, p0[k], sizeof(double) * (size_t)n);
      } else {
        double e = rel_err(x, interp_param(it, i), n);
        if (e > worst || isinf(e))
          worst = e, which = u->name;
      }
      free(x);
    }
    snprintf(name, sizeof name, "cuda emu %s: parameters and moments after 10 steps within 1e-5 of the "
             "interpreter's (worst %.1e)", md->path, worst);
    CHECK(ok && run && worst < 1e-5, name, "%s: %.3g", which, worst);
    if (frozen) {
      snprintf(name, sizeof name, "cuda emu %s: the frozen parameter is bit for bit its initial value", md->path);
      CHECK(kept, name, "it changed");
    }
    // ZeRO stage 1: with the module's mdl_own set to rank 1's share of 2, a step updates that share's
    // parameters and moments and leaves every other one as it was, bit for bit.
    int64_t *own = ok && run ? dlsym(emu.so, "mdl_own") : NULL;
    ZeroShard *z = own ? engine_shard(g, 1, 2) : NULL;
    bool only = z != NULL;
    if (z) {
      int64_t at[4][3];
      engine_shard_at(z, g, m, at[0], at[1], at[2], at[3]);
      own[0] = 4 * at[0][1], own[1] = 4 * at[0][2];
      char *before = malloc((size_t)m->arena_bytes);
      memcpy(before, arena, (size_t)m->arena_bytes);
      cpu_set_scalar(g, m, arena, "step", 11);
      only = !emu_step(p, &emu, arena).set;
      for (int i = 0; only && i < g->n; i++) {
        const IrNode *u = g->nodes[i];
        if ((u->op != OP_PARAM && u->op != OP_STATE) || (u->op == OP_PARAM && u->init.frozen))
          continue;
        bool same = !memcmp(before + m->offset[i], arena + m->offset[i], sizeof(float) * (size_t)shape_numel(u->shape));
        only = same == (engine_shard_owner(z, g, i) != 1);
      }
      own[0] = own[1] = 0;
      free(before);
    }
    snprintf(name, sizeof name, "cuda emu %s: with mdl_own (--zero 1) a step updates only its share", md->path);
    CHECK(only, name, "%s", z ? "a parameter or moment outside it changed, or one inside did not" : "no mdl_own");
    engine_shard_free(z);
    for (int k = 0; k < g->nparams; k++)
      free(p0[k]);
    free(p0);
    free(arena);
    interp_free(it);
    emu_free(&emu);
    arena_free(a);
  }
}

int main(void) {
  char dir[] = "/tmp/mdl-cuda-XXXXXX";
  if (!cache_dir_make(dir, "cuda: a temporary directory"))
    TEST_EXIT();
  test_sha256();
  test_plans();
  test_attention_kernels();
  char why[256];
  if (nvrtc_available(why, sizeof why)) {
    test_nvrtc_cache();
    test_nvrtc_cache_damage(dir);
    test_nvrtc_units();
    test_nvrtc_resources();
    static const char *const paths[] = {"models/gpt2-tiny.mdl", "models/gpt2.mdl", "models/llama-tiny.mdl",
                                        "models/mlp.mdl", "models/moe-tiny.mdl"};
    // (moe-tiny and the new ops below fused only: unfused, each of their nodes is a kernel of the kinds
    // the fused modules and the unfused models above already compile, and every arch costs 10-50 s)
    for (int pr = 0; pr < 2; pr++)
      for (size_t i = 0; i < sizeof paths / sizeof *paths; i++)
        for (int fz = 1; fz >= (strstr(paths[i], "moe") ? 1 : 0); fz--)
          test_nvrtc_model(paths[i], NULL, strrchr(paths[i], '/') + 1, fz, pr ? DT_BF16 : DT_F32);
    // LLaMA 125M (grouped-query attention) as it trains by default: bf16, fused
    test_nvrtc_model("models/llama.mdl", NULL, "llama.mdl", true, DT_BF16);
    // grouped, multi-query, windowed and cross attention: on tensor cores (bf16, heads of 32) and on
    // CUDA cores (heads of 12, fp32 and bf16)
    test_nvrtc_model(models[11].path, models[11].text, models[11].path, true, DT_BF16);
    for (int pr = 0; pr < 2; pr++)
      test_nvrtc_model(models[12].path, models[12].text, models[12].path, true, pr ? DT_BF16 : DT_F32);
    // integer arithmetic and casts, elementwise min/max, conv1d
    for (int pr = 0; pr < 2; pr++)
      test_nvrtc_model(models[14].path, models[14].text, models[14].path, true, pr ? DT_BF16 : DT_F32);
    // the sums of many gradients, cut to fit a kernel's buffers (as it trains by default: bf16, fused)
    test_nvrtc_model(models[15].path, models[15].text, models[15].path, true, DT_BF16);
  } else {
    printf("[skip] nvrtc: %s\n", why);
  }
  if (system("g++ --version >/dev/null 2>&1") == 0) {
    test_emu_checks(dir);
    // bf16 unfused (every CAST a step of its own) on the three models of models/ only, and the
    // attention models fused only (attention is a kernel of its own either way): the time.
    for (int pr = 0; pr < 2; pr++)
      for (size_t i = 0; i < sizeof models / sizeof *models; i++)
        for (int fz = 1; fz >= ((pr && i >= 3) || i >= 5 ? 1 : 0); fz--)
          test_emulation(&models[i], fz, pr ? DT_BF16 : DT_F32, dir);
    test_attention_alone(dir);
    test_lmhead_chunks(dir, "models/llama-tiny.mdl", false);
    test_lmhead_chunks(dir, "models/gpt2-tiny.mdl", true);
    test_ce_limits(dir);
    test_lmhead_rounding(dir, true);
    test_lmhead_rounding(dir, false);
    test_optimizers(dir, nvrtc_available(why, sizeof why));
  } else {
    printf("[skip] cuda emu: no g++\n");
  }
  remove_dir(dir);
  TEST_EXIT();
}
