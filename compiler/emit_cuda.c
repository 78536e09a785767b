// emit_cuda.c: the CUDA emitter. It turns the step plan (a Fusion and its MemPlan) into one CUDA C++
// translation unit for NVRTC (a prelude of our own, no #include) and a schedule (CudaPlan): the
// kernel launches and cuBLASLt GEMMs of one training step, in order.
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
//     row, or a block for rows longer than 1024, the row in registers, shuffle reductions;
//   - column sums (norm dw / db, reductions over an outer axis): per-block partial sums, then one
//     thread per column adds them in block order: deterministic, no atomics;
//   - attention: flash-style, one block per (batch, head, tile of queries), keys and values in
//     tiles in shared memory, online softmax; the backward recomputes the probabilities from the
//     row statistics of a first kernel, computes dq per query tile and dk, dv per key tile (each key
//     tile owned by one block, summed in query order);
//   - embedding backward: each block owns a range of vocabulary rows and columns and scans the ids
//     in order; the optimizer: a sum of squares per fixed chunk, one block adding the chunks, then
//     AdamW over the flat buffers through a table of segments.
// GEMMs are not kernels: each is a CudaGemm (cuBLASLt, row-major description) whose epilogue covers
// bias and GELU when the chain allows; the rest of the chain is the "<step>_epilogue" kernel.
//
// Kernels address memory only through byte offsets passed at launch (MdlArgs), so the kernels of
// identical layers are the same text: each distinct kernel is emitted once, named after the first
// step that uses it, and launched by every step that does. Values a step keeps to itself (and
// reduction partials, attention row statistics, the LM head's logits) live in scratch after the
// memory plan's arena, reused by every step.
//
// Numerics follow interp.c as emit_c does: fp32 elementwise math; sums over many elements in double
// (norm statistics, column sums, reductions, softmax denominators, the gradient norm) in a fixed
// order; AdamW in double per element. Every reduction tree is fixed by the launch shape, so results
// do not depend on scheduling.
#include "mdl.h"
#include "emit_cuda.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

enum {
  BLOCK = 256,          // threads per block of grid-stride and row kernels
  MAX_GRID = 4096,      // blocks of a grid-stride kernel
  SCRATCH_ALIGN = 256,  // scratch buffers start at multiples of this
  OPT_CHUNK = 8192,     // optimizer: elements per block
  ATT_BK = 32,          // attention: keys per tile
};

static const char prelude[] =
    "// Types (LP64, as on the Linux hosts NVRTC runs on: long is 64 bits).\n"
    "typedef long int64_t;\n"
    "typedef unsigned long uint64_t;\n"
    "typedef int int32_t;\n"
    "typedef unsigned int uint32_t;\n"
    "typedef unsigned short uint16_t;\n"
    "\n"
    "#define MDL_INF __int_as_float(0x7f800000)\n"
    "#define MDL_NAN __int_as_float(0x7fffffff)\n"
    "#define MDL_FULL 0xffffffffu\n"
    "#define MDL_ERR_EMBED_ID 1 // MdlStatus.code: an id outside the embedding table\n"
    "#define MDL_ERR_TARGET 2   // a cross-entropy target >= the number of classes\n"
    "\n"
    "// The kernels' arguments (runtime/emit_cuda.h holds the same layouts): the status a bad id or\n"
    "// target is reported in, and the byte offsets of the buffers a kernel uses.\n"
    "typedef struct {\n"
    "  unsigned long long set;\n"
    "  long long code, value, limit;\n"
    "} MdlStatus;\n"
    "\n"
    "typedef struct {\n"
    "  int64_t b[48];\n"
    "} MdlArgs;\n"
    "\n"
    "// A segment of the optimizer's flat buffers: byte offsets of p, g, m, v, its length, where it\n"
    "// starts in the concatenation of the segments, its weight decay.\n"
    "typedef struct {\n"
    "  int64_t p, g, m, v, n, start;\n"
    "  double wd;\n"
    "} MdlSeg;\n"
    "\n"
    "// The first report of a step wins; the runtime reads the status after the step.\n"
    "__device__ void mdl_report(MdlStatus *s, long long code, long long value, long long limit) {\n"
    "  if (atomicCAS(&s->set, 0ull, 1ull) == 0ull) {\n"
    "    s->code = code;\n"
    "    s->value = value;\n"
    "    s->limit = limit;\n"
    "  }\n"
    "}\n"
    "\n"
    "// Counter-based random numbers, as in mdl.h: splitmix64 of (seed, stream, index).\n"
    "__device__ __forceinline__ uint64_t mdl_rng_u64(uint64_t seed, uint64_t stream, uint64_t i) {\n"
    "  uint64_t z = seed * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull + i * 0xBF58476D1CE4E5B9ull;\n"
    "  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;\n"
    "  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;\n"
    "  return z ^ (z >> 31);\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ double mdl_rng_uniform(uint64_t seed, uint64_t stream, uint64_t i) {\n"
    "  return (double)(mdl_rng_u64(seed, stream, i) >> 40) / 16777216.0;\n"
    "}\n"
    "\n"
    "// Dropout keeps element i when its uniform number is >= p and scales it by 1 / (1 - p).\n"
    "__device__ __forceinline__ float mdl_dropout(uint64_t seed, uint64_t stream, int64_t i, double p, float x) {\n"
    "  return mdl_rng_uniform(seed, stream, (uint64_t)i) >= p ? (float)(x / (1.0 - p)) : 0.0f;\n"
    "}\n"
    "\n"
    "// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), and its\n"
    "// derivative, both through s = sigmoid(2u) = 0.5 (1 + tanh(u)) and 1 - tanh(u)^2 = 4 s (1 - s).\n"
    "__device__ __forceinline__ float mdl_gelu(float x) {\n"
    "  const float u = 0.797884561f * (x + 0.044715f * x * x * x);\n"
    "  return x / (1.0f + expf(-2.0f * u));\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ float mdl_gelu_grad(float x) {\n"
    "  const float u = 0.797884561f * (x + 0.044715f * x * x * x), s = 1.0f / (1.0f + expf(-2.0f * u));\n"
    "  return s + 2.0f * x * s * (1.0f - s) * 0.797884561f * (1.0f + 3.0f * 0.044715f * x * x);\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ float mdl_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }\n"
    "__device__ __forceinline__ float mdl_silu(float x) { return x * mdl_sigmoid(x); }\n"
    "\n"
    "__device__ __forceinline__ float mdl_silu_grad(float x, float dy) {\n"
    "  const float s = mdl_sigmoid(x);\n"
    "  return dy * s * (1.0f + x * (1.0f - s));\n"
    "}\n"
    "\n"
    "// bf16 <-> f32. To bf16: round to nearest, ties to even, on the bits; a NaN stays a quiet NaN.\n"
    "__device__ __forceinline__ uint16_t mdl_f32_to_bf16(float x) {\n"
    "  const uint32_t u = __float_as_uint(x);\n"
    "  if ((u & 0x7fffffffu) > 0x7f800000u)\n"
    "    return (uint16_t)((u >> 16) | 0x40u);\n"
    "  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ float mdl_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }\n"
    "\n"
    "// The larger of a and b where a NaN wins (max reductions, as interp.c).\n"
    "__device__ __forceinline__ float mdl_max_nan(float a, float b) {\n"
    "  return (b > a || isnan(b)) ? (isnan(a) ? a : b) : a;\n"
    "}\n"
    "\n"
    "// Reductions over the 32 lanes of a warp (butterfly: every lane gets the result) and over a block\n"
    "// (blockDim.x a multiple of 32; sh is 32 elements of shared memory). Fixed trees: deterministic.\n"
    "__device__ __forceinline__ double mdl_warp_sum(double v) {\n"
    "  for (int o = 16; o > 0; o >>= 1)\n"
    "    v += __shfl_xor_sync(MDL_FULL, v, o);\n"
    "  return v;\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ float mdl_warp_sumf(float v) {\n"
    "  for (int o = 16; o > 0; o >>= 1)\n"
    "    v += __shfl_xor_sync(MDL_FULL, v, o);\n"
    "  return v;\n"
    "}\n"
    "\n"
    "// Max ignoring NaNs (fmaxf), as softmax and cross-entropy take it.\n"
    "__device__ __forceinline__ float mdl_warp_fmax(float v) {\n"
    "  for (int o = 16; o > 0; o >>= 1)\n"
    "    v = fmaxf(v, __shfl_xor_sync(MDL_FULL, v, o));\n"
    "  return v;\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ float mdl_warp_max_nan(float v) {\n"
    "  for (int o = 16; o > 0; o >>= 1)\n"
    "    v = mdl_max_nan(v, __shfl_xor_sync(MDL_FULL, v, o));\n"
    "  return v;\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ double mdl_block_sum(double v, double *sh) {\n"
    "  v = mdl_warp_sum(v);\n"
    "  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;\n"
    "  __syncthreads();\n"
    "  if (lane == 0)\n"
    "    sh[w] = v;\n"
    "  __syncthreads();\n"
    "  return mdl_warp_sum(lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.0);\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ float mdl_block_fmax(float v, float *sh) {\n"
    "  v = mdl_warp_fmax(v);\n"
    "  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;\n"
    "  __syncthreads();\n"
    "  if (lane == 0)\n"
    "    sh[w] = v;\n"
    "  __syncthreads();\n"
    "  return mdl_warp_fmax(lane < (int)(blockDim.x >> 5) ? sh[lane] : -MDL_INF);\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ float mdl_block_max_nan(float v, float *sh) {\n"
    "  v = mdl_warp_max_nan(v);\n"
    "  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;\n"
    "  __syncthreads();\n"
    "  if (lane == 0)\n"
    "    sh[w] = v;\n"
    "  __syncthreads();\n"
    "  return mdl_warp_max_nan(lane < (int)(blockDim.x >> 5) ? sh[lane] : -MDL_INF);\n"
    "}\n";

_Static_assert(CUDA_MAX_ARGS == 48, "the prelude's MdlArgs holds 48 offsets");
_Static_assert(CUDA_ERR_EMBED_ID == 1 && CUDA_ERR_TARGET == 2, "the prelude's MDL_ERR_* codes");

const char *emit_cuda_prelude(void) { return prelude; }

const char *cuda_error_what(long long code) {
  switch (code) {
  case CUDA_ERR_EMBED_ID: return "embed: id";
  case CUDA_ERR_TARGET: return "cross_entropy: target";
  default: return "error";
  }
}

//
// Text buffers.
//

typedef struct {
  char *s;
  size_t len, cap;
} Buf;

static void bput(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bvput(Buf *b, const char *fmt, va_list ap) {
  for (;;) {
    va_list cp;
    va_copy(cp, ap);
    size_t room = b->cap - b->len;
    int n = vsnprintf(b->s ? b->s + b->len : NULL, room, fmt, cp);
    va_end(cp);
    if (n < 0)
      return;
    if ((size_t)n < room) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap - b->len <= (size_t)n)
      cap *= 2;
    char *s = realloc(b->s, cap);
    if (!s) {
      fprintf(stderr, "mdlc: out of memory (%zu bytes)\n", cap);
      exit(1);
    }
    b->s = s;
    b->cap = cap;
  }
}

static void bput(Buf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  bvput(b, fmt, ap);
  va_end(ap);
}

static void bappend(Buf *b, const Buf *x) {
  if (x->len)
    bput(b, "%.*s", (int)x->len, x->s);
}

//
// The emitter's state.
//

typedef enum { G_SINGLE, G_NORM_BWD, G_ATTN_BWD, G_CE, G_LMHEAD, G_OPT } GroupKind;

typedef struct {
  GroupKind kind;
  int *mem;     // member anchors
  int nmem;
  int *ext;     // external inputs (what the group reads)
  int n_ext;
  // G_LMHEAD: the pattern's nodes
  int mm, ce, ceb, dx, dw, x, w, tgt, dloss;
  bool tb;
} Group;

typedef struct {
  int node;
  const char *ix;   // flat index expression the value is taken at
  const char *name; // the expression holding it
  int depth;
} Memo;

typedef struct {
  const char *expr, *name;
  int depth;
} IxMemo;

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
  const Fusion *f;
  const MemPlan *m;
  const Graph *g;
  Arena *a;        // strings of one emission
  Buf out;         // the translation unit
  char err[512];
  bool failed;
  int **users;     // per node: the nodes that read it
  int *nusers;

  // the step being emitted
  int si;
  const char *sname; // its kernel name
  const char *ixt;   // index type of its kernels: "int" or "int64_t"
  bool *in_step;
  int *grp;
  Group *groups;
  int ngroups;
  bool **gdep;
  int *order;
  bool *spill;     // an internal anchor that must be kept whole in memory (sticky across passes)
  bool *post_bad;  // an output that cannot share its anchor's loop (sticky across passes)
  bool flagged;

  // one pass
  bool *written;   // value in memory (inputs of the step, or written by an earlier kernel)
  bool *scratch;   // gets a scratch buffer
  bool *stored;    // stored by the current phase
  int *host;       // a GEMM root -> the epilogue output it writes into, or -1
  int64_t *soff;   // scratch offset per node, or -1
  int64_t stop;    // scratch used by this pass
  int *phase_nodes;
  int nphase;
  int *pending;
  int npending;
  KText *kt;
  int nkt, capkt;
  SLaunch *sl;
  int nsl, capsl;
  CudaGemm *sg;
  int nsg, capsg;

  // the kernel being built
  const char *role;
  const char *table;
  Buf body, notes;
  Slot slots[CUDA_MAX_ARGS];
  int nslots;
  int *slot_of;    // per node: its slot in this kernel, or -1
  bool sh_d, sh_f; // the block reductions' shared arrays are declared
  int shared;
  int indent, depth, fresh;
  Memo *memo;
  int nmemo, capmemo;
  IxMemo *ixm;
  int nixm, capixm;
  const char *loop_ix; // the current loop's own flat index (stores happen there)
  int64_t loop_n;      // and the number of elements it visits
  int post_anchor;     // inside the loop that follows (or is) this anchor's, else -1
  const char *post_ix;
  bool post_inloop;
  int cur_q;
  int lane;            // four-lane body: the lane being written, else -1
  LaneStore *lst;
  int nlst, caplst;

  // the module
  Known *known;
  int nknown, capknown;
  CudaLaunch *launches;
  int nlaunches, caplaunches;
  CudaGemm *gemms;
  int ngemms, capgemms;
  int64_t scratch_max;
} Emit;

static bool fail(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(Emit *e, const char *fmt, ...) {
  if (!e->failed) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->err, sizeof e->err, fmt, ap);
    va_end(ap);
  }
  e->failed = true;
  return false;
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) {
    fprintf(stderr, "mdlc: out of memory (%zu bytes)\n", n * size);
    exit(1);
  }
  return p;
}

// Grows *p (of *cap elements of `size` bytes) to hold n + 1.
static void grow(void *p, int n, int *cap, size_t size) {
  void **pp = p;
  if (n < *cap)
    return;
  *cap = *cap ? 2 * *cap : 16;
  *pp = realloc(*pp, size * (size_t)*cap);
  if (!*pp) {
    fprintf(stderr, "mdlc: out of memory\n");
    exit(1);
  }
}

static const IrNode *node(const Emit *e, int n) { return e->g->nodes[n]; }
static int64_t numel(const Emit *e, int n) { return shape_numel(node(e, n)->shape); }
static int64_t last_dim(const Emit *e, int n) {
  Shape s = node(e, n)->shape;
  return s.rank ? s.d[s.rank - 1] : 1;
}
static const char *ctype(const Emit *e, int n) { return node(e, n)->dtype == DT_I32 ? "int32_t" : "float"; }

static bool is_leaf(Op op) {
  return op == OP_INPUT || op == OP_PARAM || op == OP_STATE || op == OP_SCALAR || op == OP_CONST;
}

// Ops computed inline at any flat index.
static bool is_pointwise(Op op) {
  switch (op) {
  case OP_NEG: case OP_EXP: case OP_LOG: case OP_TANH: case OP_SQRT: case OP_RSQRT: case OP_RELU:
  case OP_GELU: case OP_SILU: case OP_DROPOUT: case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV:
  case OP_RELU_BWD: case OP_GELU_BWD: case OP_SILU_BWD: case OP_RESHAPE: case OP_PERMUTE:
  case OP_BROADCAST: case OP_SLICE: case OP_SLICE_BWD: case OP_CONCAT:
    return true;
  default:
    return false;
  }
}

// A RESHAPE outside every step is a view: it lives where its input lives.
static int canon(const Emit *e, int n) {
  while (node(e, n)->op == OP_RESHAPE && !e->in_step[n] && e->f->step_of[n] < 0)
    n = node(e, n)->in[0];
  return n;
}

static int64_t offset(const Emit *e, int n) { return e->m->offset[n]; }

// Is node c's value readable from memory right now?
static bool in_memory(const Emit *e, int c) {
  Op op = node(e, c)->op;
  if (e->written[c])
    return true;
  if (op == OP_CONST)
    return false;
  if (is_leaf(op))
    return true;
  return !e->in_step[c] && offset(e, c) >= 0;
}

static bool has_target(const Emit *e, int c) { return offset(e, c) >= 0 || e->scratch[c] || e->host[c] >= 0; }

static void flag(Emit *e, bool *set, int n) {
  if (!set[n]) {
    set[n] = true;
    e->flagged = true;
  }
}

static int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

//
// Lines and scopes.
//

static void line(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line(Emit *e, const char *fmt, ...) {
  bput(&e->body, "%*s", 2 * e->indent, "");
  va_list ap;
  va_start(ap, fmt);
  bvput(&e->body, fmt, ap);
  va_end(ap);
  bput(&e->body, "\n");
}

static void note(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(Emit *e, const char *fmt, ...) {
  bput(&e->notes, "// ");
  va_list ap;
  va_start(ap, fmt);
  bvput(&e->notes, fmt, ap);
  va_end(ap);
  bput(&e->notes, "\n");
}

// A line ending in "{" (or a bare "{"), and a new scope for memoised values.
static void enter(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void enter(Emit *e, const char *fmt, ...) {
  bput(&e->body, "%*s", 2 * e->indent, "");
  va_list ap;
  va_start(ap, fmt);
  bvput(&e->body, fmt, ap);
  va_end(ap);
  bput(&e->body, "%s{\n", e->body.s[e->body.len - 1] == ' ' ? "" : " ");
  e->indent++;
  e->depth++;
}

static void leave(Emit *e) {
  while (e->nmemo && e->memo[e->nmemo - 1].depth >= e->depth)
    e->nmemo--;
  while (e->nixm && e->ixm[e->nixm - 1].depth >= e->depth)
    e->nixm--;
  e->depth--;
  e->indent--;
  line(e, "}");
}

static bool ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// How many times the identifier `name` (not a member: x.name) occurs in [from, to).
static int occurrences(const char *from, const char *to, const char *name) {
  size_t n = strlen(name);
  int count = 0;
  for (const char *p = from; p + n <= to; p++)
    if (!memcmp(p, name, n) && (p == from || (!ident_char(p[-1]) && p[-1] != '.')) && !ident_char(p[n]))
      count++;
  return count;
}

// The end of the block that holds the line at ln (its closing brace, or the end of the text).
static const char *scope_end(const char *ln) {
  int depth = 0;
  for (const char *p = ln; *p; p++)
    if (*p == '{')
      depth++;
    else if (*p == '}' && --depth < 0)
      return p;
  return ln + strlen(ln);
}

// Is `name` one of the evaluator's values or indices (v12, f3, j7, i0..i3, ix)?
static bool temp_name(const char *s, size_t n) {
  if (n == 2 && !strncmp(s, "ix", 2))
    return true;
  if (n < 2 || !strchr("vfji", s[0]))
    return false;
  for (size_t k = 1; k < n; k++)
    if (s[k] < '0' || s[k] > '9')
      return false;
  return s[0] != 'i' || n == 2;
}

// Removes the declarations of evaluator values and indices their scope never reads (an index computed
// for a value that turned out to be a constant, a lane index only float4 loads needed), repeatedly,
// since a removed line may have been the last reader of another. Their initialisers have no effects.
static void drop_unused(Emit *e) {
  for (bool changed = true; changed && e->body.len;) {
    changed = false;
    e->body.s[e->body.len] = 0;
    for (char *ln = e->body.s; *ln;) {
      char *end = strchr(ln, '\n'), *p = ln;
      end = end ? end + 1 : ln + strlen(ln);
      while (*p == ' ')
        p++;
      char *eq = strstr(p, " = ");
      if (!strncmp(p, "const ", 6) && eq && eq < end && end[-2] == ';') {
        char *name = eq;
        while (name > p && ident_char(name[-1]))
          name--;
        char buf[32];
        size_t n = (size_t)(eq - name);
        if (n < sizeof buf && temp_name(name, n)) {
          memcpy(buf, name, n);
          buf[n] = 0;
          if (occurrences(ln, scope_end(ln), buf) == 1) {
            memmove(ln, end, e->body.len - (size_t)(end - e->body.s) + 1);
            e->body.len -= (size_t)(end - ln);
            changed = true;
            continue;
          }
        }
      }
      ln = end;
    }
  }
}

// Closes the scope of an if and opens its else.
static void orelse(Emit *e) {
  leave(e);
  e->body.len -= 2; // the "}\n" leave wrote
  bput(&e->body, "} else {\n");
  e->indent++;
  e->depth++;
}

static const char *str(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static const char *str(Emit *e, const char *fmt, ...) {
  va_list ap, cp;
  va_start(ap, fmt);
  va_copy(cp, ap);
  int n = vsnprintf(NULL, 0, fmt, cp);
  va_end(cp);
  char *s = arena_alloc(e->a, (size_t)(n > 0 ? n : 0) + 1);
  vsnprintf(s, (size_t)(n > 0 ? n : 0) + 1, fmt, ap);
  va_end(ap);
  return s;
}

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
  return str(e, "%s%s%sf%s", v < 0 ? "(" : "", buf, frac ? "" : ".0", v < 0 ? ")" : "");
}

// A double literal that reads back as the same double, in as few digits as that takes.
static const char *dlit(Emit *e, double v) {
  char buf[64];
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (strtod(buf, NULL) == v)
      break;
  }
  if (!strpbrk(buf, ".en"))
    strcat(buf, ".0");
  return str(e, "%s", buf);
}

static const char *shape_txt(Emit *e, int n) {
  char buf[128];
  return str(e, "%s%s", dtype_name(node(e, n)->dtype), shape_str(node(e, n)->shape, buf, sizeof buf));
}

//
// Scratch and buffers. A node's buffer is its arena slot, the buffer of the epilogue output its GEMM
// writes into, or a scratch buffer of the step; each kernel declares the buffers it uses in the order
// it first uses them (b0, b1, ...), so that the kernels of identical layers are identical text.
//

static int64_t scratch_alloc(Emit *e, int64_t bytes) {
  int64_t at = e->stop;
  e->stop = align_up(at + (bytes ? bytes : 1), SCRATCH_ALIGN);
  return align_up(e->m->arena_bytes, SCRATCH_ALIGN) + at;
}

static int64_t buf_off(Emit *e, int c) {
  if (offset(e, c) >= 0)
    return offset(e, c);
  if (e->host[c] >= 0)
    return buf_off(e, e->host[c]);
  if (!e->scratch[c])
    return -1;
  if (e->soff[c] < 0)
    e->soff[c] = scratch_alloc(e, numel(e, c) * 4);
  return e->soff[c];
}

static const char *slot_name(Emit *e, int k) { return str(e, "b%d", k); }

static int add_slot(Emit *e, int node_id, int64_t off, const char *type, const char *what) {
  if (e->nslots == CUDA_MAX_ARGS) {
    fail(e, "step %s: a kernel would address more than %d buffers", e->f->steps[e->si].name, CUDA_MAX_ARGS);
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
    fail(e, "node %d (%s) has no buffer in step %s", c, op_name(node(e, c)->op), e->f->steps[e->si].name);
  const IrNode *nd = node(e, c);
  return e->slot_of[c] = add_slot(e, c, off, ctype(e, c), str(e, "%s %s", op_name(nd->op), shape_txt(e, c)));
}

// The pointer (b<k>) to node c's buffer in the current kernel.
static const char *ptr(Emit *e, int c) {
  int k = slot(e, c);
  e->slots[k].decl = true;
  return slot_name(e, k);
}

// The offset argument (o.b[k]) of node c's buffer, for a kernel that addresses it through a table.
static const char *offset_arg(Emit *e, int c) { return str(e, "o.b[%d]", slot(e, c)); }

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
  e->body.len = e->notes.len = 0;
  for (int k = 0; k < e->nslots; k++)
    if (e->slots[k].node >= 0)
      e->slot_of[e->slots[k].node] = -1;
  e->nslots = 0;
  e->sh_d = e->sh_f = false;
  e->shared = 0;
  e->nmemo = e->nixm = 0;
  e->indent = 1;
  e->depth = 0;
  e->fresh = 0;
  e->loop_ix = NULL;
  e->post_anchor = e->cur_q = -1;
  e->post_inloop = false;
  e->lane = -1;
  e->nlst = 0;
}

static int64_t grid_for(int64_t work, int block) {
  int64_t g = (work + block - 1) / block;
  return g < 1 ? 1 : g > MAX_GRID ? MAX_GRID : g;
}

// Threads of a grid-stride kernel's block for `work` items: 256, or fewer (a multiple of 32) when
// there is less to do.
static int block_for(int64_t work) { return work >= BLOCK ? BLOCK : (int)align_up(work < 1 ? 1 : work, 32); }

static int kend(Emit *e, int64_t grid, int block) {
  drop_unused(e);
  Buf code = {0};
  bput(&code, "(char *arena, MdlStatus *status, uint64_t seed, int64_t chunk, MdlArgs o) {\n");
  for (int k = 0; k < e->nslots; k++)
    if (e->slots[k].decl)
      bput(&code, "  %s *const b%d = (%s *)(arena + o.b[%d]); // %s\n", e->slots[k].type, k, e->slots[k].type, k,
           e->slots[k].what);
  if (e->sh_d)
    bput(&code, "  __shared__ double sh_d[32];\n");
  if (e->sh_f)
    bput(&code, "  __shared__ float sh_f[32];\n");
  bappend(&code, &e->body);
  bput(&code, "}\n");
  grow(&e->kt, e->nkt, &e->capkt, sizeof *e->kt);
  KText *t = &e->kt[e->nkt];
  t->role = e->role;
  t->pre = (char *)str(e, "extern \"C\" __global__ void __launch_bounds__(%d) ", block);
  t->code = arena_strdup(e->a, code.s);
  t->notes = arena_strdup(e->a, e->notes.s ? e->notes.s : "");
  t->table = e->table;
  t->shared = e->shared;
  free(code.s);
  grow(&e->sl, e->nsl, &e->capsl, sizeof *e->sl);
  SLaunch *l = &e->sl[e->nsl++];
  *l = (SLaunch){.kt = e->nkt, .gemm = -1, .grid = grid, .block = block, .nargs = e->nslots};
  l->args = arena_alloc(e->a, sizeof(int64_t) * (size_t)(e->nslots + 1));
  for (int k = 0; k < e->nslots; k++)
    l->args[k] = e->slots[k].off;
  return e->nkt++;
}

// Launches kernel kt (just ended) once more with another grid and chunk argument.
static void relaunch(Emit *e, int kt, int64_t grid, int64_t chunk) {
  grow(&e->sl, e->nsl, &e->capsl, sizeof *e->sl);
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
  gm.step = e->si;
  grow(&e->sg, e->nsg, &e->capsg, sizeof *e->sg);
  e->sg[e->nsg] = gm;
  grow(&e->sl, e->nsl, &e->capsl, sizeof *e->sl);
  e->sl[e->nsl++] = (SLaunch){.kt = -1, .gemm = e->nsg++};
}

// The shared arrays of the block reductions, declared at the top of the kernel when used.
static const char *sh_double(Emit *e) {
  if (!e->sh_d)
    e->shared += 256;
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
// Memoised values and index variables of the current scopes.
//

static const char *memo_get(Emit *e, int n, const char *ix) {
  for (int i = e->nmemo - 1; i >= 0; i--)
    if (e->memo[i].node == n && strcmp(e->memo[i].ix, ix) == 0)
      return e->memo[i].name;
  return NULL;
}

static void memo_put(Emit *e, int n, const char *ix, const char *name) {
  grow(&e->memo, e->nmemo, &e->capmemo, sizeof *e->memo);
  e->memo[e->nmemo++] = (Memo){n, arena_strdup(e->a, ix), name, e->depth};
}

// A variable holding the index expression `expr` (or expr itself when it is a name or number).
static const char *ix_var(Emit *e, const char *expr) {
  bool simple = true;
  for (const char *p = expr; *p; p++)
    simple &= (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_';
  if (simple)
    return arena_strdup(e->a, expr);
  for (int i = e->nixm - 1; i >= 0; i--)
    if (strcmp(e->ixm[i].expr, expr) == 0)
      return e->ixm[i].name;
  const char *name = str(e, "j%d", ++e->fresh);
  line(e, "const %s %s = %s;", e->ixt, name, expr);
  grow(&e->ixm, e->nixm, &e->capixm, sizeof *e->ixm);
  e->ixm[e->nixm++] = (IxMemo){arena_strdup(e->a, expr), name, e->depth};
  return name;
}

// "(ix / div % size)", leaving out what is 1 or redundant: the coordinate of one block of axes.
static void coord(Buf *b, const char *ix, int64_t div, int64_t size, bool leftmost) {
  if (div == 1 && leftmost)
    bput(b, "%s", ix);
  else if (div == 1)
    bput(b, "%s %% %lld", ix, (long long)size);
  else if (leftmost)
    bput(b, "%s / %lld", ix, (long long)div);
  else
    bput(b, "%s / %lld %% %lld", ix, (long long)div, (long long)size);
}

static const char *buf_str(Emit *e, Buf *b) {
  const char *s = arena_strdup(e->a, b->s ? b->s : "0");
  free(b->s);
  return s;
}

// The flat index into a tensor of shape `in` of element `ix` of a tensor of shape `out` under numpy
// broadcasting, adjacent axes that are all kept or all broadcast merged.
static const char *ix_bcast(Emit *e, Shape out, Shape in, const char *ix) {
  if (shape_numel(in) == 1)
    return "0";
  if (shape_numel(in) == shape_numel(out))
    return ix;
  struct {
    bool kept;
    int64_t size;
  } blk[IR_MAX_RANK];
  int nb = 0;
  for (int k = 0; k < out.rank; k++) {
    if (out.d[k] == 1)
      continue;
    int j = k - (out.rank - in.rank);
    bool kept = j >= 0 && in.d[j] != 1;
    if (nb && blk[nb - 1].kept == kept)
      blk[nb - 1].size *= out.d[k];
    else
      blk[nb].kept = kept, blk[nb++].size = out.d[k];
  }
  Buf b = {0};
  int64_t out_inner = 1, in_inner = 1;
  for (int t = nb - 1; t >= 0; t--) {
    if (blk[t].kept) {
      if (b.len)
        bput(&b, " + ");
      bool paren = in_inner != 1 && (out_inner != 1 || t != 0);
      bput(&b, "%s", paren ? "(" : "");
      coord(&b, ix, out_inner, blk[t].size, t == 0);
      bput(&b, "%s", paren ? ")" : "");
      if (in_inner != 1)
        bput(&b, " * %lld", (long long)in_inner);
      in_inner *= blk[t].size;
    }
    out_inner *= blk[t].size;
  }
  return ix_var(e, buf_str(e, &b));
}

static const char *ix_permute(Emit *e, const IrNode *nd, Shape in, const char *ix) {
  Shape out = nd->shape;
  int64_t stride[IR_MAX_RANK];
  for (int k = in.rank - 1; k >= 0; k--)
    stride[k] = k == in.rank - 1 ? 1 : stride[k + 1] * in.d[k + 1];
  int first = 0;
  while (first < out.rank && out.d[first] == 1)
    first++;
  Buf b = {0};
  int64_t div = 1;
  for (int k = out.rank - 1; k >= 0; k--) {
    if (out.d[k] == 1)
      continue;
    if (b.len)
      bput(&b, " + ");
    int64_t s = stride[nd->ia[k]];
    bput(&b, "%s", s != 1 ? "(" : "");
    coord(&b, ix, div, out.d[k], k == first);
    bput(&b, "%s", s != 1 ? ")" : "");
    if (s != 1)
      bput(&b, " * %lld", (long long)s);
    div *= out.d[k];
  }
  return ix_var(e, buf_str(e, &b));
}

static int64_t span(Shape s, int from, int to) {
  int64_t n = 1;
  for (int i = from; i < to; i++)
    n *= s.d[i];
  return n;
}

// SLICE: element ix of the slice -> its index in the full input.
static const char *ix_slice(Emit *e, const IrNode *nd, Shape full, const char *ix) {
  int ax = (int)nd->ia[0];
  int64_t start = nd->ia[1], len = nd->ia[2] - start, flen = full.d[ax];
  int64_t outer = span(full, 0, ax), inner = span(full, ax + 1, full.rank);
  if (outer == 1)
    return start ? ix_var(e, str(e, "%s + %lld", ix, (long long)(start * inner))) : ix;
  return ix_var(e, str(e, "%s / %lld * %lld + %lld + %s %% %lld", ix, (long long)(len * inner),
                       (long long)(flen * inner), (long long)(start * inner), ix, (long long)(len * inner)));
}

// The coordinate along `ax` of element ix of a tensor of shape s.
static const char *ix_axis(Emit *e, Shape s, int ax, const char *ix) {
  Buf b = {0};
  coord(&b, ix, span(s, ax + 1, s.rank), s.d[ax], span(s, 0, ax) == 1);
  return ix_var(e, buf_str(e, &b));
}

// Element (outer o, axis coordinate c - at, inner) of a part of length len along ax, for element ix
// of the whole (shape s): the index into the part, or 0 when c is outside [at, at + len).
static const char *ix_part(Emit *e, Shape s, int ax, const char *ix, const char *c, int64_t at, int64_t len) {
  int64_t inner = span(s, ax + 1, s.rank), outer = span(s, 0, ax), flen = s.d[ax];
  Buf b = {0};
  bput(&b, "%s >= %lld && %s < %lld ? ", c, (long long)at, c, (long long)(at + len));
  if (outer > 1)
    bput(&b, "%s / %lld * %lld + ", ix, (long long)(flen * inner), (long long)(len * inner));
  bput(&b, "(%s - %lld)", c, (long long)at);
  if (inner > 1)
    bput(&b, " * %lld + %s %% %lld", (long long)inner, ix, (long long)inner);
  bput(&b, " : 0");
  return ix_var(e, buf_str(e, &b));
}

//
// The inline evaluator.
//

static const char *val(Emit *e, int n, const char *ix);

// Reading node c at ix from memory: records reads that the chosen layout must allow.
static void note_read(Emit *e, int c, const char *ix) {
  bool at_post = e->post_anchor == c && strcmp(ix, e->post_ix) == 0;
  if (e->in_step[c] && e->grp[c] >= 0 && !at_post && offset(e, c) < 0)
    flag(e, e->spill, c);
}

// Is ix the index of the lane being written in a four-lane loop body, for a value of that loop's size?
static bool lane_ix(const Emit *e, int c, const char *ix) {
  return e->lane >= 0 && node(e, c)->dtype == DT_F32 && e->loop_ix && !strcmp(ix, e->loop_ix) &&
         numel(e, c) == e->loop_n;
}

// Stores value v of node c at ix; in a four-lane body the lanes' stores become one float4 store.
static void store(Emit *e, int c, const char *ix, const char *v) {
  if (lane_ix(e, c, ix)) {
    grow(&e->lst, e->nlst, &e->caplst, sizeof *e->lst);
    e->lst[e->nlst++] = (LaneStore){c, e->lane, v};
    return;
  }
  line(e, "%s[%s] = %s;", ptr(e, c), ix, v);
}

static const char *pointwise_expr(Emit *e, int c, const char *ix) {
  const IrNode *nd = node(e, c);
  const IrNode *x0 = nd->nin > 0 ? node(e, nd->in[0]) : NULL, *x1 = nd->nin > 1 ? node(e, nd->in[1]) : NULL;
  switch (nd->op) {
  case OP_NEG: return str(e, "-%s", val(e, nd->in[0], ix));
  case OP_EXP: return str(e, "expf(%s)", val(e, nd->in[0], ix));
  case OP_LOG: return str(e, "logf(%s)", val(e, nd->in[0], ix));
  case OP_TANH: return str(e, "tanhf(%s)", val(e, nd->in[0], ix));
  case OP_SQRT: return str(e, "sqrtf(%s)", val(e, nd->in[0], ix));
  case OP_RSQRT: return str(e, "1.0f / sqrtf(%s)", val(e, nd->in[0], ix));
  case OP_RELU: {
    const char *a = val(e, nd->in[0], ix);
    return str(e, "%s > 0.0f ? %s : 0.0f", a, a);
  }
  case OP_GELU: return str(e, "mdl_gelu(%s)", val(e, nd->in[0], ix));
  case OP_SILU: return str(e, "mdl_silu(%s)", val(e, nd->in[0], ix));
  case OP_DROPOUT:
    return str(e, "mdl_dropout(seed, %lld, %s, %s, %s)", (long long)nd->ia[0], ix, dlit(e, nd->fa[0]),
               val(e, nd->in[0], ix));
  case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_RELU_BWD: case OP_GELU_BWD: case OP_SILU_BWD: {
    const char *a = val(e, nd->in[0], ix_bcast(e, nd->shape, x0->shape, ix));
    const char *b = val(e, nd->in[1], ix_bcast(e, nd->shape, x1->shape, ix));
    switch (nd->op) {
    case OP_ADD: return str(e, "%s + %s", a, b);
    case OP_SUB: return str(e, "%s - %s", a, b);
    case OP_MUL: return str(e, "%s * %s", a, b);
    case OP_DIV: return str(e, "%s / %s", a, b);
    case OP_RELU_BWD: return str(e, "%s > 0.0f ? %s : 0.0f", a, b);
    case OP_GELU_BWD: return str(e, "mdl_gelu_grad(%s) * %s", a, b);
    default: return str(e, "mdl_silu_grad(%s, %s)", a, b);
    }
  }
  case OP_RESHAPE: return val(e, nd->in[0], ix);
  case OP_BROADCAST: return val(e, nd->in[0], ix_bcast(e, nd->shape, x0->shape, ix));
  case OP_PERMUTE: return val(e, nd->in[0], ix_permute(e, nd, x0->shape, ix));
  case OP_SLICE: return val(e, nd->in[0], ix_slice(e, nd, x0->shape, ix));
  case OP_SLICE_BWD: {
    int ax = (int)nd->ia[0];
    const char *c = ix_axis(e, nd->shape, ax, ix);
    const char *j = ix_part(e, nd->shape, ax, ix, c, nd->ia[1], nd->ia[2] - nd->ia[1]);
    return str(e, "%s >= %lld && %s < %lld ? %s : %s", c, (long long)nd->ia[1], c, (long long)nd->ia[2],
               val(e, nd->in[0], j), nd->dtype == DT_I32 ? "0" : "0.0f");
  }
  case OP_CONCAT: {
    int ax = (int)nd->ia[0];
    const char *c = ix_axis(e, nd->shape, ax, ix);
    const char *v[64];
    int64_t at = 0, ends[64];
    if (nd->nin > 64) {
      fail(e, "concat of %d inputs", nd->nin);
      return "0";
    }
    for (int k = 0; k < nd->nin; k++) {
      int64_t len = node(e, nd->in[k])->shape.d[ax];
      v[k] = val(e, nd->in[k], ix_part(e, nd->shape, ax, ix, c, at, len));
      at += len;
      ends[k] = at;
    }
    Buf b = {0};
    for (int k = 0; k + 1 < nd->nin; k++)
      bput(&b, "%s < %lld ? %s : ", c, (long long)ends[k], v[k]);
    bput(&b, "%s", v[nd->nin - 1]);
    return buf_str(e, &b);
  }
  default:
    fail(e, "%s is not pointwise", op_name(nd->op));
    return "0";
  }
}

// The value of node n at flat index ix, as an expression; emits what computes it. A step output met
// at the current loop's own index is stored on the way. In a four-lane body, a value in memory read
// at the lane's own index comes from one float4 load shared by the four lanes.
static const char *val(Emit *e, int n, const char *ix) {
  int c = canon(e, n);
  const IrNode *nd = node(e, c);
  if (nd->op == OP_CONST)
    return flit(e, nd->fa[0]);
  if (numel(e, c) == 1)
    ix = "0";
  const char *hit = memo_get(e, c, ix);
  if (hit)
    return hit;
  const char *name = str(e, "v%d", ++e->fresh);
  if (in_memory(e, c)) {
    note_read(e, c, ix);
    if (lane_ix(e, c, ix)) {
      const char *q = memo_get(e, c, "float4");
      if (!q) {
        q = str(e, "f%d", ++e->fresh);
        line(e, "const float4 %s = reinterpret_cast<const float4 *>(%s)[q];", q, ptr(e, c));
        memo_put(e, c, "float4", q);
      }
      name = str(e, "%s.%c", q, "xyzw"[e->lane]);
    } else {
      line(e, "const %s %s = %s[%s];", ctype(e, c), name, ptr(e, c), ix);
    }
  } else if (e->in_step[c] && is_pointwise(nd->op)) {
    const char *expr = pointwise_expr(e, c, ix);
    line(e, "const %s %s = %s;", ctype(e, c), name, expr);
    bool own = e->loop_ix && numel(e, c) == e->loop_n && (strcmp(ix, e->loop_ix) == 0 || e->loop_n == 1);
    if (has_target(e, c) && !e->stored[c] && own) {
      store(e, c, ix, name);
      e->stored[c] = true;
      e->phase_nodes[e->nphase++] = c;
    }
  } else if (e->in_step[c] && e->grp[c] >= 0) {
    // An anchor of this step that is not in memory (yet): read inside its own kernel at another
    // index, or after it while only a local existed. Flag it; the next pass lays it out.
    if (e->post_inloop && e->post_anchor == c && e->cur_q >= 0)
      flag(e, e->post_bad, e->cur_q);
    else
      flag(e, e->spill, c);
    return "0.0f";
  } else {
    fail(e, "step %s reads node %d (%s), which no earlier step wrote", e->f->steps[e->si].name, c,
         op_name(nd->op));
    return "0";
  }
  memo_put(e, c, ix, name);
  return name;
}

//
// Phases: kernels after which their stores count as written.
//

static void phase_begin(Emit *e) { e->nphase = 0; }

static void phase_done(Emit *e, int n) {
  e->written[n] = true;
  e->stored[n] = true;
}

static void phase_end(Emit *e) {
  for (int i = 0; i < e->nphase; i++)
    e->written[e->phase_nodes[i]] = true;
  e->nphase = 0;
}

// The ops of a list of nodes, for a kernel's comment.
static const char *op_list(Emit *e, const int *nodes, int k) {
  Buf b = {0};
  for (int t = 0; t < k; t++)
    bput(&b, "%s%s", t ? ", " : "", op_name(node(e, nodes[t])->op));
  return buf_str(e, &b);
}

// The deferred stores of a four-lane body: one float4 store per node that has all four lanes.
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
      fail(e, "step %s: node %d is stored in some lanes only", e->f->steps[e->si].name, s->node);
      continue;
    }
    line(e, "reinterpret_cast<float4 *>(%s)[q] = make_float4(%s, %s, %s, %s);", ptr(e, s->node), v[0], v[1], v[2],
         v[3]);
  }
  e->nlst = 0;
}

// One elementwise kernel over `n` elements writing nodes[0..k) (all of that size), grid-stride, four
// elements per thread when n is a multiple of 4. post_anchor names the GEMM whose epilogue this is.
static void pw_loop(Emit *e, const int *nodes, int k, int64_t n, int post_anchor, const char *role) {
  phase_begin(e);
  kbegin(e, role);
  bool vec = n % 4 == 0;
  int64_t work = vec ? n / 4 : n;
  int block = block_for(work);
  note(e, "elementwise over %lld%s: %s", (long long)n, vec ? ", 4 per thread" : "", op_list(e, nodes, k));
  enter(e, "for (%s q = blockIdx.x * blockDim.x + threadIdx.x; q < %lld; q += gridDim.x * blockDim.x)", e->ixt,
        (long long)work);
  e->post_anchor = post_anchor;
  e->post_inloop = false;
  e->loop_n = n;
  if (vec) {
    line(e, "const %s i0 = 4 * q;", e->ixt);
    for (int lane = 1; lane < 4; lane++)
      line(e, "const %s i%d = i0 + %d;", e->ixt, lane, lane);
  }
  int mark = e->nphase;
  for (int lane = 0; lane < (vec ? 4 : 1); lane++) {
    const char *ix = vec ? str(e, "i%d", lane) : "q";
    if (vec)
      e->lane = lane;
    for (int i = mark; i < e->nphase; i++)
      e->stored[e->phase_nodes[i]] = false;
    e->nphase = mark;
    e->loop_ix = ix;
    e->post_ix = ix;
    for (int t = 0; t < k; t++) {
      e->cur_q = nodes[t];
      const char *v = val(e, nodes[t], ix);
      if (!e->stored[nodes[t]]) {
        store(e, nodes[t], ix, v);
        e->stored[nodes[t]] = true;
        e->phase_nodes[e->nphase++] = nodes[t];
      }
    }
  }
  flush_lanes(e);
  e->lane = -1;
  leave(e);
  e->loop_ix = NULL;
  e->post_anchor = -1;
  e->cur_q = -1;
  kend(e, grid_for(work, block), block);
  phase_end(e);
}

// Elementwise kernels for a list of nodes, one per distinct size, in order of first appearance.
static void pw_loops(Emit *e, const int *nodes, int k, int post_anchor, const char *role) {
  bool *done = xcalloc((size_t)k, sizeof *done);
  int *same = xcalloc((size_t)k, sizeof *same);
  for (int t = 0; t < k; t++) {
    if (done[t])
      continue;
    int ns = 0;
    for (int u = t; u < k; u++)
      if (!done[u] && numel(e, nodes[u]) == numel(e, nodes[t])) {
        same[ns++] = nodes[u];
        done[u] = true;
      }
    pw_loop(e, same, ns, numel(e, nodes[t]), post_anchor, role);
  }
  free(done);
  free(same);
}

// The node whose memory holds n's elements in n's flat order (n itself, its view's source, or the
// source of unwritten reshapes of this step), or -1.
static int mem_alias(Emit *e, int n) {
  for (;;) {
    int c = canon(e, n);
    if (in_memory(e, c))
      return c;
    if (!(e->in_step[c] && node(e, c)->op == OP_RESHAPE))
      return -1;
    n = node(e, c)->in[0];
  }
}

// Node n must be in memory before the next group: returns the node whose buffer to read, queueing
// an elementwise kernel when n is a pointwise node of this step or a constant.
static int need(Emit *e, int n) {
  int a = mem_alias(e, n);
  if (a >= 0)
    return a;
  int c = canon(e, n);
  Op op = node(e, c)->op;
  if (!(op == OP_CONST || (e->in_step[c] && is_pointwise(op)))) {
    if (e->in_step[c] && e->grp[c] >= 0) {
      flag(e, e->spill, c); // an anchor of this step kept as a local: whole in the next pass
      e->scratch[c] = true;
      return c;
    }
    fail(e, "step %s needs node %d (%s) in memory", e->f->steps[e->si].name, c, op_name(op));
    return c;
  }
  for (int i = 0; i < e->npending; i++)
    if (e->pending[i] == c)
      return c;
  if (offset(e, c) < 0)
    e->scratch[c] = true;
  e->pending[e->npending++] = c;
  return c;
}

static void flush(Emit *e) {
  if (e->npending)
    pw_loops(e, e->pending, e->npending, -1, "prep");
  e->npending = 0;
}

// Rows of a matrix in memory: row r starts at element `at` + r * stride of node `node`'s buffer.
typedef struct {
  int node;
  int64_t at, stride;
} Rows;

// n's rows (last axis) in memory: n itself, or an unwritten SLICE of the last axis of a tensor in
// memory (q, k, v out of one qkv buffer), read with that tensor's stride.
static Rows rows_of(Emit *e, int n) {
  int a = mem_alias(e, n);
  int c = canon(e, n);
  const IrNode *nd = node(e, c);
  if (a < 0 && e->in_step[c] && nd->op == OP_SLICE && offset(e, c) < 0 && nd->ia[0] == nd->shape.rank - 1) {
    int src = mem_alias(e, nd->in[0]);
    if (src >= 0)
      return (Rows){src, nd->ia[1], last_dim(e, src)};
  }
  return (Rows){need(e, n), 0, last_dim(e, n)};
}

// The pointer expression of a Rows in the current kernel.
static const char *rows_base(Emit *e, Rows r) {
  return r.at ? str(e, "(%s + %lld)", ptr(e, r.node), (long long)r.at) : ptr(e, r.node);
}

//
// Groups: which anchors emit together, and in what order.
//

// Follows RESHAPEs (views and reshapes of this step) up from n.
static int through_reshapes(Emit *e, int n) {
  while (node(e, n)->op == OP_RESHAPE && (e->in_step[n] || e->f->step_of[n] < 0))
    n = node(e, n)->in[0];
  return n;
}

static bool same_inputs(const Emit *e, const IrNode *a, const IrNode *b) {
  if (a->nin != b->nin)
    return false;
  for (int k = 0; k < a->nin; k++)
    if (canon(e, a->in[k]) != canon(e, b->in[k]))
      return false;
  return true;
}

static void group_add(Group *gr, int n) { gr->mem[gr->nmem++] = n; }

// The LM-head pattern around cross_entropy_bwd node ceb: logits = x @ W (or W^T), the loss and
// its gradient of the same logits, and dx = dlogits @ W^T (W), dW = dlogits^T x (x^T dlogits). Only
// when the logits and dlogits live nowhere else.
static bool match_lmhead(Emit *e, int ceb, Group *gr) {
  const IrNode *b = node(e, ceb);
  int mm = through_reshapes(e, b->in[0]);
  if (!e->in_step[mm] || node(e, mm)->op != OP_MATMUL)
    return false;
  const IrNode *m = node(e, mm);
  if (m->ia[0] || node(e, m->in[0])->shape.rank != 2 || node(e, m->in[1])->shape.rank != 2)
    return false;
  int x = canon(e, m->in[0]), w = canon(e, m->in[1]);
  bool tb = m->ia[1];
  int ce = -1, dx = -1, dw = -1;
  for (int k = 0; k < e->f->steps[e->si].nnodes; k++) {
    int n = e->f->steps[e->si].nodes[k];
    const IrNode *nd = node(e, n);
    if (nd->op == OP_CROSS_ENTROPY && through_reshapes(e, nd->in[0]) == mm &&
        canon(e, nd->in[1]) == canon(e, b->in[1]))
      ce = n;
    if (nd->op != OP_MATMUL || n == mm)
      continue;
    int a0 = through_reshapes(e, nd->in[0]), a1 = through_reshapes(e, nd->in[1]);
    if (a0 == ceb && !nd->ia[0] && nd->ia[1] == !tb && canon(e, nd->in[1]) == w)
      dx = n;
    if (tb && a0 == ceb && nd->ia[0] && !nd->ia[1] && canon(e, nd->in[1]) == x)
      dw = n;
    if (!tb && a1 == ceb && nd->ia[0] && !nd->ia[1] && canon(e, nd->in[0]) == x)
      dw = n;
  }
  if (ce < 0 || dx < 0 || dw < 0)
    return false;
  // Every consumer of the logits and of dlogits (through reshapes) must be one of the pattern.
  for (int n = mm; n < e->g->n; n++) {
    const IrNode *nd = node(e, n);
    for (int k = 0; k < nd->nin; k++) {
      int src = through_reshapes(e, nd->in[k]);
      if ((src != mm && src != ceb) || n == ce || n == ceb || n == dx || n == dw)
        continue;
      if (nd->op == OP_RESHAPE && (e->in_step[n] || e->f->step_of[n] < 0) && offset(e, n) < 0 &&
          (e->in_step[n] || canon(e, n) != n))
        continue;
      return false;
    }
  }
  if (offset(e, mm) >= 0 || offset(e, ceb) >= 0)
    return false;
  *gr = (Group){.kind = G_LMHEAD, .mm = mm, .ce = ce, .ceb = ceb, .dx = dx, .dw = dw, .x = m->in[0], .w = m->in[1],
                .tgt = b->in[1], .dloss = b->in[2], .tb = tb};
  return true;
}

static bool groups_build(Emit *e, bool split_all) {
  const Step *st = &e->f->steps[e->si];
  e->ngroups = 0;
  e->groups = arena_alloc(e->a, sizeof(Group) * (size_t)(st->nnodes + 1));
  for (int k = 0; k < st->nnodes; k++)
    e->grp[st->nodes[k]] = -1;
  for (int k = 0; k < st->nnodes && !split_all; k++) {
    int n = st->nodes[k];
    Group lm;
    if (e->in_step[n] && e->grp[n] < 0 && node(e, n)->op == OP_CROSS_ENTROPY_BWD && match_lmhead(e, n, &lm)) {
      lm.mem = arena_alloc(e->a, sizeof(int) * 5);
      int mem[5] = {lm.mm, lm.ce, lm.ceb, lm.dx, lm.dw};
      for (int i = 0; i < 5; i++) {
        group_add(&lm, mem[i]);
        e->grp[mem[i]] = e->ngroups;
      }
      lm.ext = arena_alloc(e->a, sizeof(int) * 4);
      lm.ext[0] = lm.x, lm.ext[1] = lm.w, lm.ext[2] = lm.tgt, lm.ext[3] = lm.dloss;
      lm.n_ext = 4;
      e->groups[e->ngroups++] = lm;
    }
  }
  for (int k = 0; k < st->nnodes; k++) {
    int n = st->nodes[k];
    const IrNode *nd = node(e, n);
    if (!e->in_step[n] || e->grp[n] >= 0 || is_pointwise(nd->op))
      continue;
    GroupKind kind = G_SINGLE;
    switch (nd->op) {
    case OP_LAYERNORM_BWD: case OP_RMSNORM_BWD: kind = G_NORM_BWD; break;
    case OP_ATTENTION_BWD: kind = G_ATTN_BWD; break;
    case OP_CROSS_ENTROPY: case OP_CROSS_ENTROPY_BWD: kind = G_CE; break;
    case OP_GRAD_NORM: case OP_ADAMW: kind = G_OPT; break;
    default: break;
    }
    Group *gr = &e->groups[e->ngroups];
    *gr = (Group){.kind = kind, .mem = arena_alloc(e->a, sizeof(int) * (size_t)st->nnodes)};
    group_add(gr, n);
    e->grp[n] = e->ngroups;
    for (int j = k + 1; j < st->nnodes && kind != G_SINGLE && !split_all; j++) {
      int n2 = st->nodes[j];
      const IrNode *m = node(e, n2);
      if (!e->in_step[n2] || e->grp[n2] >= 0)
        continue;
      bool join = false;
      if (kind == G_NORM_BWD)
        join = m->op == nd->op && same_inputs(e, nd, m) && m->fa[0] == nd->fa[0];
      else if (kind == G_ATTN_BWD)
        join = m->op == nd->op && same_inputs(e, nd, m) && m->fa[0] == nd->fa[0] && m->ia[0] == nd->ia[0] &&
               m->ia[1] == nd->ia[1];
      else if (kind == G_CE)
        join = (m->op == OP_CROSS_ENTROPY || m->op == OP_CROSS_ENTROPY_BWD) && m->op != nd->op &&
               gr->nmem == 1 && canon(e, m->in[0]) == canon(e, nd->in[0]) && canon(e, m->in[1]) == canon(e, nd->in[1]);
      else if (kind == G_OPT)
        join = m->op == OP_GRAD_NORM || m->op == OP_ADAMW;
      if (join) {
        group_add(gr, n2);
        e->grp[n2] = e->ngroups;
      }
    }
    int nin = 0;
    for (int i = 0; i < gr->nmem; i++)
      nin += node(e, gr->mem[i])->nin;
    gr->ext = arena_alloc(e->a, sizeof(int) * (size_t)(nin + 1));
    for (int i = 0; i < gr->nmem; i++) {
      const IrNode *m = node(e, gr->mem[i]);
      for (int j = 0; j < m->nin; j++)
        if (e->grp[canon(e, m->in[j])] != e->ngroups || !e->in_step[canon(e, m->in[j])])
          gr->ext[gr->n_ext++] = m->in[j];
    }
    e->ngroups++;
  }
  return true;
}

// The groups node n depends on directly (through pointwise nodes and views of this step).
static void direct_deps(Emit *e, int n, bool *deps, int *stamp, int mark) {
  int c = canon(e, n);
  if (!e->in_step[c] || stamp[c] == mark)
    return;
  stamp[c] = mark;
  if (e->grp[c] >= 0) {
    deps[e->grp[c]] = true;
    return;
  }
  for (int k = 0; k < node(e, c)->nin; k++)
    direct_deps(e, node(e, c)->in[k], deps, stamp, mark);
}

// Orders the groups (dependencies first, then the lowest member id). A group whose members depend
// on one another through the step is split into single anchors.
static bool groups_order(Emit *e) {
  int *stamp = xcalloc((size_t)e->g->n, sizeof *stamp);
  for (int attempt = 0; attempt < 2; attempt++) {
    groups_build(e, attempt == 1);
    int ng = e->ngroups, mark = 0;
    e->gdep = arena_alloc(e->a, sizeof(bool *) * (size_t)(ng + 1));
    for (int a = 0; a < ng; a++) {
      e->gdep[a] = arena_alloc(e->a, sizeof(bool) * (size_t)(ng + 1));
      for (int k = 0; k < e->groups[a].n_ext; k++)
        direct_deps(e, e->groups[a].ext[k], e->gdep[a], stamp, ++mark);
    }
    for (int k = 0; k < ng; k++) // transitive closure
      for (int a = 0; a < ng; a++)
        if (e->gdep[a][k])
          for (int c = 0; c < ng; c++)
            e->gdep[a][c] |= e->gdep[k][c];
    bool cyclic = false;
    for (int a = 0; a < ng; a++)
      cyclic |= e->gdep[a][a];
    if (cyclic)
      continue;
    e->order = arena_alloc(e->a, sizeof(int) * (size_t)(ng + 1));
    bool *done = xcalloc((size_t)ng + 1, sizeof *done);
    for (int k = 0; k < ng; k++) {
      int best = -1;
      for (int a = 0; a < ng && best < 0; a++) {
        bool ready = !done[a];
        for (int b = 0; b < ng && ready; b++)
          ready = !e->gdep[a][b] || done[b];
        if (ready)
          best = a;
      }
      done[best] = true;
      e->order[k] = best;
    }
    free(done);
    free(stamp);
    return true;
  }
  free(stamp);
  return fail(e, "step %s: its anchors depend on one another in a cycle", e->f->steps[e->si].name);
}

// Outputs of the step that can be computed in (or right after) group gi's kernel: pointwise,
// unwritten, of `n` float elements, depending on gi and on no group not yet emitted.
static int post_set(Emit *e, int gi, int64_t n, const bool *emitted, int *q) {
  const Step *st = &e->f->steps[e->si];
  int nq = 0, *stamp = xcalloc((size_t)e->g->n, sizeof *stamp);
  bool *deps = xcalloc((size_t)e->ngroups + 1, sizeof *deps);
  for (int k = 0; k < st->nnodes; k++) {
    int c = st->nodes[k];
    if (!e->in_step[c] || e->grp[c] >= 0 || !is_pointwise(node(e, c)->op) || offset(e, c) < 0 || e->written[c] ||
        e->post_bad[c] || numel(e, c) != n || node(e, c)->dtype != DT_F32)
      continue;
    memset(deps, 0, sizeof *deps * (size_t)e->ngroups);
    direct_deps(e, c, deps, stamp, k + 1);
    bool ok = deps[gi];
    for (int b = 0; b < e->ngroups && ok; b++)
      ok = !deps[b] || b == gi || emitted[b];
    if (ok)
      q[nq++] = c;
  }
  free(stamp);
  free(deps);
  return nq;
}

// Evaluates the post outputs inside the anchor's own kernel, where the anchor's value at index ix is
// the expression y.
static void post_inloop(Emit *e, int anchor, const int *q, int nq, const char *ix, int64_t n, const char *y) {
  e->loop_ix = ix;
  e->loop_n = n;
  e->post_anchor = anchor;
  e->post_ix = ix;
  e->post_inloop = true;
  memo_put(e, anchor, numel(e, anchor) == 1 ? "0" : ix, y);
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
  if (offset(e, a) >= 0)
    return true;
  if (e->spill[a]) {
    e->scratch[a] = true;
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
    fail(e, "step %s: rows of %lld elements are too long", e->f->steps[e->si].name, (long long)cols);
  return rs;
}

static const char *rs_who(Emit *e, const RowShape *rs) {
  return rs->tpr == 32 ? "a warp" : str(e, "a block of %d threads", rs->tpr);
}

// Opens the scope of row group `var` (r, or k for blocks of rows); tr is the thread within the row.
static void rows_open(Emit *e, const RowShape *rs, const char *var) {
  if (rs->tpr == 32) {
    line(e, "const %s %s = blockIdx.x * %d + (threadIdx.x >> 5);", e->ixt, var, rs->rpb);
    line(e, "const int tr = threadIdx.x & 31;");
  } else {
    line(e, "const %s %s = blockIdx.x;", e->ixt, var);
    line(e, "const int tr = threadIdx.x;");
  }
  if (rs->grid * rs->rpb > rs->groups)
    enter(e, "if (%s < %lld)", var, (long long)rs->groups);
  else
    enter(e, "%s", "");
}

static const char *rsum(Emit *e, const RowShape *rs, const char *x) {
  return rs->tpr == 32 ? str(e, "mdl_warp_sum(%s)", x) : str(e, "mdl_block_sum(%s, %s)", x, sh_double(e));
}

static const char *rfmax(Emit *e, const RowShape *rs, const char *x) {
  return rs->tpr == 32 ? str(e, "mdl_warp_fmax(%s)", x) : str(e, "mdl_block_fmax(%s, %s)", x, sh_float(e));
}

// A loop over this thread's elements of row r: opens "for t", then "if (j < cols)" with ix = r * cols + j.
static void row_each(Emit *e, const RowShape *rs, int64_t cols) {
  line(e, "#pragma unroll");
  enter(e, "for (int t = 0; t < %d; t++)", rs->npl);
  line(e, "const %s j = tr + t * %d;", e->ixt, rs->tpr);
  enter(e, "if (j < %lld)", (long long)cols);
  line(e, "const %s ix = r * %lld + j;", e->ixt, (long long)cols);
}

static void row_each_end(Emit *e) {
  leave(e);
  leave(e);
}

// This thread's elements of row r of x in registers (`name`[t]; 0 beyond the row), read from memory
// or computed inline (a step output met on the way is stored there).
static void row_load(Emit *e, const RowShape *rs, int x, const char *name, int64_t cols) {
  line(e, "float %s[%d];", name, rs->npl);
  line(e, "#pragma unroll");
  enter(e, "for (int t = 0; t < %d; t++)", rs->npl);
  line(e, "const %s j = tr + t * %d;", e->ixt, rs->tpr);
  int a = mem_alias(e, x);
  if (a >= 0) {
    line(e, "%s[t] = j < %lld ? %s[r * %lld + j] : 0.0f;", name, (long long)cols, ptr(e, a), (long long)cols);
  } else {
    line(e, "%s[t] = 0.0f;", name);
    enter(e, "if (j < %lld)", (long long)cols);
    line(e, "const %s ix = r * %lld + j;", e->ixt, (long long)cols);
    const char *save = e->loop_ix;
    int64_t save_n = e->loop_n;
    e->loop_ix = "ix";
    e->loop_n = numel(e, x);
    line(e, "%s[t] = %s;", name, val(e, x, "ix"));
    e->loop_ix = save;
    e->loop_n = save_n;
    leave(e);
  }
  leave(e);
}

// Is x read inline (not in memory)? Constants and anchors kept as locals are queued for memory.
static bool row_inline(Emit *e, int x) {
  if (mem_alias(e, x) >= 0)
    return false;
  int c = canon(e, x);
  if (e->in_step[c] && is_pointwise(node(e, c)->op))
    return true;
  need(e, x);
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
    if (node(e, u)->op == OP_RESHAPE && (e->in_step[u] || e->f->step_of[u] < 0))
      n += step_readers(e, u, first, outside);
    else if (!e->in_step[u])
      *outside = true;
    else if (n++ == 0)
      *first = u;
  }
  return n;
}

// The GEMM epilogue cuBLASLt can apply to mm (m x n): a bias ADD along the rows of a vector in memory
// and / or a GELU, on values nobody else reads at other indices. *out is the node the GEMM then writes,
// *aux the pre-GELU value it also keeps (or -1).
static CudaEpilogue epilogue_of(Emit *e, int mm, int64_t n, int *out, int *bias, int *aux) {
  *out = mm, *bias = *aux = -1;
  int r1 = -1;
  bool outside = false;
  if (e->spill[mm] || step_readers(e, mm, &r1, &outside) != 1)
    return CUDA_EPI_NONE;
  const IrNode *l1 = node(e, r1);
  if (numel(e, r1) != numel(e, mm) || last_dim(e, r1) != n || l1->dtype != DT_F32)
    return CUDA_EPI_NONE;
  if (l1->op == OP_GELU && offset(e, r1) >= 0 && (offset(e, mm) >= 0 || !outside)) {
    *aux = offset(e, mm) >= 0 ? mm : -1;
    *out = r1;
    return CUDA_EPI_GELU;
  }
  if (l1->op != OP_ADD || offset(e, mm) >= 0 || outside)
    return CUDA_EPI_NONE;
  bool first = through_reshapes(e, l1->in[0]) == mm, second = through_reshapes(e, l1->in[1]) == mm;
  if (first == second)
    return CUDA_EPI_NONE;
  int b = canon(e, l1->in[first ? 1 : 0]);
  if (!in_memory(e, b) || numel(e, b) != n || last_dim(e, b) != n || node(e, b)->dtype != DT_F32)
    return CUDA_EPI_NONE;
  *bias = b;
  *out = r1;
  int r2 = -1;
  bool out2 = false;
  int nr = step_readers(e, r1, &r2, &out2);
  for (int k = 0; k < e->nusers[r1]; k++) {
    int u = e->users[r1][k];
    if (e->in_step[u] && node(e, u)->op == OP_GELU && offset(e, u) >= 0 && numel(e, u) == numel(e, r1) &&
        (offset(e, r1) >= 0 || (nr == 1 && !out2))) {
      *aux = offset(e, r1) >= 0 ? r1 : -1;
      *out = u;
      return CUDA_EPI_BIAS_GELU;
    }
  }
  if (offset(e, r1) < 0)
    e->scratch[r1] = true;
  return CUDA_EPI_BIAS;
}

// The offset into a tensor of shape `in` of the element broadcasting maps to element idx of `out`.
static int64_t bcast_index(Shape out, Shape in, int64_t idx) {
  int64_t off = 0, stride = 1;
  for (int k = out.rank - 1, j = in.rank - 1; k >= 0; k--, j--) {
    int64_t c = idx % out.d[k];
    idx /= out.d[k];
    if (j < 0)
      continue;
    if (in.d[j] != 1)
      off += c * stride;
    stride *= in.d[j];
  }
  return off;
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

static const char *epi_name(CudaEpilogue k) {
  switch (k) {
  case CUDA_EPI_BIAS: return "bias";
  case CUDA_EPI_GELU: return "gelu";
  case CUDA_EPI_BIAS_GELU: return "bias, gelu";
  default: return "none";
  }
}

static void emit_gemm(Emit *e, int gi, const bool *emitted) {
  int mm = e->groups[gi].mem[0];
  const IrNode *nd = node(e, mm);
  Shape sa = node(e, nd->in[0])->shape, sb = node(e, nd->in[1])->shape, so = nd->shape;
  bool ta = nd->ia[0], tb = nd->ia[1];
  int64_t m = so.d[so.rank - 2], n = so.d[so.rank - 1], k = ta ? sa.d[sa.rank - 2] : sa.d[sa.rank - 1];
  Rows a, b;
  if (so.rank == 2) {
    a = rows_of(e, nd->in[0]);
    b = rows_of(e, nd->in[1]);
  } else {
    a = (Rows){need(e, nd->in[0]), 0, sa.d[sa.rank - 1]};
    b = (Rows){need(e, nd->in[1]), 0, sb.d[sb.rank - 1]};
  }
  flush(e);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = post_set(e, gi, numel(e, mm), emitted, q);
  int64_t batches = span(so, 0, so.rank - 2);
  int out = mm, bias = -1, aux = -1;
  CudaEpilogue epi = batches == 1 ? epilogue_of(e, mm, n, &out, &bias, &aux) : CUDA_EPI_NONE;
  if (out == mm && offset(e, mm) < 0) {
    for (int t = 0; t < nq && !e->spill[mm] && e->host[mm] < 0; t++)
      if (offset(e, q[t]) >= 0)
        e->host[mm] = q[t];
    if (e->host[mm] < 0)
      e->scratch[mm] = true;
  }
  CudaGemm gm = {.ta = ta, .tb = tb, .m = m, .n = n, .k = k, .lda = a.stride, .ldb = b.stride, .ldc = n, .batch = 1,
                 .a = buf_off(e, a.node) + 4 * a.at, .b = buf_off(e, b.node) + 4 * b.at, .c = buf_off(e, out),
                 .epilogue = epi, .bias = bias >= 0 ? buf_off(e, bias) : -1, .aux = aux >= 0 ? buf_off(e, aux) : -1};
  phase_begin(e);
  if (batches > 1) {
    Shape ob = so;
    ob.rank -= 2;
    int64_t s1 = batch_stride(sa, ob, m * k), s2 = batch_stride(sb, ob, k * n);
    if (s1 >= 0 && s2 >= 0) {
      gm.batch = batches, gm.stride_a = s1, gm.stride_b = s2, gm.stride_c = m * n;
      gemm_add(e, gm);
    } else {
      Shape ab = sa, bb = sb;
      ab.rank -= 2, bb.rank -= 2;
      CudaGemm one = gm;
      for (int64_t t = 0; t < batches; t++) {
        one.a = gm.a + 4 * bcast_index(ob, ab, t) * m * k;
        one.b = gm.b + 4 * bcast_index(ob, bb, t) * k * n;
        one.c = gm.c + 4 * t * m * n;
        gemm_add(e, one);
      }
    }
  } else {
    gemm_add(e, gm);
  }
  phase_done(e, out);
  if (aux >= 0)
    phase_done(e, aux);
  phase_end(e);
  nq = post_set(e, gi, numel(e, mm), emitted, q);
  if (nq)
    pw_loop(e, q, nq, numel(e, mm), mm, "epilogue");
  free(q);
}

// The accumulation of one value v into acc: a sum, or a max where a NaN wins (as in interp.c).
static void accumulate(Emit *e, bool max) {
  if (max)
    line(e, "acc = mdl_max_nan(acc, v);");
  else
    line(e, "acc += v;");
}

// Output r of a reduction from its accumulator: stored, then the outputs computed after it.
static void reduce_finish(Emit *e, int a, bool buf, const int *q, int nq) {
  const IrNode *nd = node(e, a);
  int64_t len = node(e, nd->in[0])->shape.d[nd->ia[0]];
  if (nd->op == OP_MEAN)
    line(e, "const float y = (float)(acc / %lld);", (long long)len);
  else
    line(e, "const float y = (float)acc;");
  if (buf)
    line(e, "%s[r] = y;", ptr(e, a));
  post_inloop(e, a, q, nq, "r", numel(e, a), "y");
}

// SUM / MEAN / MAX over one axis (the input as [outer, len, inner]), the input computed inline.
// Contiguous rows: a warp per output (a thread when rows are short); few long rows: per-block
// partials, then a warp per output adds them. Strided: a thread per output, or, for long axes,
// partials per block of the axis added in block order.
static void emit_reduce(Emit *e, int gi, const bool *emitted) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  int x = nd->in[0];
  Shape s = node(e, x)->shape;
  int ax = (int)nd->ia[0];
  int64_t outer = span(s, 0, ax), len = s.d[ax], inner = span(s, ax + 1, s.rank), on = outer * inner;
  bool max = nd->op == OP_MAX, buf = whole(e, a);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = post_set(e, gi, on, emitted, q);
  const char *acc_t = max ? "float" : "double", *init = max ? "-MDL_INF" : "0.0", *ixt = e->ixt;
  const char *what = op_name(nd->op);
  phase_begin(e);
  bool two = inner == 1 ? on < 128 && len >= 32768 : len >= 128 && on <= 65536;
  if (!two && (inner > 1 || len <= 32)) {
    kbegin(e, "");
    note(e, "%s: %lld outputs over %lld elements, a thread per output", what, (long long)on, (long long)len);
    enter(e, "for (%s r = blockIdx.x * blockDim.x + threadIdx.x; r < %lld; r += gridDim.x * blockDim.x)", ixt,
          (long long)on);
    if (inner == 1)
      line(e, "const %s base = r * %lld;", ixt, (long long)len);
    else
      line(e, "const %s base = r / %lld * %lld + r %% %lld;", ixt, (long long)inner, (long long)(len * inner),
           (long long)inner);
    line(e, "%s acc = %s;", acc_t, init);
    enter(e, "for (%s l = 0; l < %lld; l++)", ixt, (long long)len);
    line(e, "const %s ix = base + l%s;", ixt, inner == 1 ? "" : str(e, " * %lld", (long long)inner));
    e->loop_ix = "ix";
    e->loop_n = numel(e, x);
    line(e, "const float v = %s;", val(e, x, "ix"));
    accumulate(e, max);
    leave(e);
    reduce_finish(e, a, buf, q, nq);
    leave(e);
    kend(e, grid_for(on, block_for(on)), block_for(on));
  } else if (!two) {
    kbegin(e, "");
    note(e, "%s: %lld outputs over %lld elements, a warp per output", what, (long long)on, (long long)len);
    line(e, "const %s r = blockIdx.x * %d + (threadIdx.x >> 5);", ixt, BLOCK / 32);
    line(e, "const int lane = threadIdx.x & 31;");
    enter(e, "if (r < %lld)", (long long)on);
    line(e, "%s acc = %s;", acc_t, init);
    enter(e, "for (%s l = lane; l < %lld; l += 32)", ixt, (long long)len);
    line(e, "const %s ix = r * %lld + l;", ixt, (long long)len);
    e->loop_ix = "ix";
    e->loop_n = numel(e, x);
    line(e, "const float v = %s;", val(e, x, "ix"));
    accumulate(e, max);
    leave(e);
    line(e, "acc = %s(acc);", max ? "mdl_warp_max_nan" : "mdl_warp_sum");
    enter(e, "if (lane == 0)");
    reduce_finish(e, a, buf, q, nq);
    leave(e);
    leave(e);
    kend(e, (on + BLOCK / 32 - 1) / (BLOCK / 32), BLOCK);
  } else if (inner == 1) {
    int64_t bl = 8192, nb = (len + bl - 1) / bl;
    int64_t part = scratch_alloc(e, on * nb * 8);
    kbegin(e, "partial");
    note(e, "%s: %lld outputs over %lld elements, first %lld blocks of %lld per output", what, (long long)on,
         (long long)len, (long long)nb, (long long)bl);
    const char *p = raw_ptr(e, part, acc_t, "partial results");
    line(e, "const %s r = blockIdx.x / %lld, k = blockIdx.x %% %lld;", ixt, (long long)nb, (long long)nb);
    line(e, "const %s end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", ixt, (long long)bl, (long long)bl,
         (long long)len, (long long)bl, (long long)bl, (long long)len);
    line(e, "%s acc = %s;", acc_t, init);
    enter(e, "for (%s l = k * %lld + threadIdx.x; l < end; l += blockDim.x)", ixt, (long long)bl);
    line(e, "const %s ix = r * %lld + l;", ixt, (long long)len);
    e->loop_ix = "ix";
    e->loop_n = numel(e, x);
    line(e, "const float v = %s;", val(e, x, "ix"));
    accumulate(e, max);
    leave(e);
    line(e, "acc = %s;",
         max ? str(e, "mdl_block_max_nan(acc, %s)", sh_float(e)) : str(e, "mdl_block_sum(acc, %s)", sh_double(e)));
    line(e, "if (threadIdx.x == 0)");
    line(e, "  %s[blockIdx.x] = acc;", p);
    kend(e, on * nb, BLOCK);
    kbegin(e, "");
    note(e, "%s: the %lld partial results of each output added in order, a warp per output", what, (long long)nb);
    p = raw_ptr(e, part, acc_t, "partial results");
    line(e, "const %s r = blockIdx.x * %d + (threadIdx.x >> 5);", ixt, BLOCK / 32);
    line(e, "const int lane = threadIdx.x & 31;");
    enter(e, "if (r < %lld)", (long long)on);
    line(e, "%s acc = %s;", acc_t, init);
    enter(e, "for (%s k = lane; k < %lld; k += 32)", ixt, (long long)nb);
    line(e, "const %s v = %s[r * %lld + k];", acc_t, p, (long long)nb);
    accumulate(e, max);
    leave(e);
    line(e, "acc = %s(acc);", max ? "mdl_warp_max_nan" : "mdl_warp_sum");
    enter(e, "if (lane == 0)");
    reduce_finish(e, a, buf, q, nq);
    leave(e);
    leave(e);
    kend(e, (on + BLOCK / 32 - 1) / (BLOCK / 32), BLOCK);
  } else {
    int64_t nb = 65536 / on < 1 ? 1 : 65536 / on;
    if (nb > (len + 7) / 8)
      nb = (len + 7) / 8;
    int64_t bl = (len + nb - 1) / nb;
    nb = (len + bl - 1) / bl;
    int64_t part = scratch_alloc(e, on * nb * 8);
    kbegin(e, "partial");
    note(e, "%s: %lld outputs over %lld elements, first partial results over %lld blocks of %lld", what,
         (long long)on, (long long)len, (long long)nb, (long long)bl);
    const char *p = raw_ptr(e, part, acc_t, "partial results");
    enter(e, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)", ixt,
          (long long)(on * nb));
    line(e, "const %s k = u / %lld, r = u %% %lld;", ixt, (long long)on, (long long)on);
    line(e, "const %s base = r / %lld * %lld + r %% %lld;", ixt, (long long)inner, (long long)(len * inner),
         (long long)inner);
    line(e, "const %s end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", ixt, (long long)bl, (long long)bl,
         (long long)len, (long long)bl, (long long)bl, (long long)len);
    line(e, "%s acc = %s;", acc_t, init);
    enter(e, "for (%s l = k * %lld; l < end; l++)", ixt, (long long)bl);
    line(e, "const %s ix = base + l * %lld;", ixt, (long long)inner);
    e->loop_ix = "ix";
    e->loop_n = numel(e, x);
    line(e, "const float v = %s;", val(e, x, "ix"));
    accumulate(e, max);
    leave(e);
    line(e, "%s[u] = acc;", p);
    leave(e);
    kend(e, grid_for(on * nb, BLOCK), block_for(on * nb));
    kbegin(e, "");
    note(e, "%s: the %lld partial results of each output added in order, a thread per output", what,
         (long long)nb);
    p = raw_ptr(e, part, acc_t, "partial results");
    enter(e, "for (%s r = blockIdx.x * blockDim.x + threadIdx.x; r < %lld; r += gridDim.x * blockDim.x)", ixt,
          (long long)on);
    line(e, "%s acc = %s;", acc_t, init);
    enter(e, "for (%s k = 0; k < %lld; k++)", ixt, (long long)nb);
    line(e, "const %s v = %s[k * %lld + r];", acc_t, p, (long long)on);
    accumulate(e, max);
    leave(e);
    reduce_finish(e, a, buf, q, nq);
    leave(e);
    kend(e, grid_for(on, block_for(on)), block_for(on));
  }
  e->loop_ix = NULL;
  if (buf)
    phase_done(e, a);
  phase_end(e);
  free(q);
}

// LAYERNORM / RMSNORM forward, a warp (or block) per row, the row in registers; x (the residual sum)
// computed inline.
static void emit_norm_fwd(Emit *e, int gi, const bool *emitted) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  bool ln = nd->op == OP_LAYERNORM;
  int64_t cols = last_dim(e, a), rows = numel(e, a) / cols;
  row_inline(e, nd->in[0]);
  int w = need(e, nd->in[1]), bias = ln ? need(e, nd->in[2]) : -1;
  flush(e);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = post_set(e, gi, numel(e, a), emitted, q);
  bool buf = whole(e, a);
  RowShape rs = row_shape(e, cols, rows, 32);
  phase_begin(e);
  kbegin(e, "");
  note(e, "%s: %lld rows of %lld, %s per row", op_name(nd->op), (long long)rows, (long long)cols, rs_who(e, &rs));
  rows_open(e, &rs, "r");
  row_load(e, &rs, nd->in[0], "xv", cols);
  line(e, "double s = 0;");
  line(e, "#pragma unroll");
  line(e, "for (int t = 0; t < %d; t++)", rs.npl);
  if (ln) {
    line(e, "  s += xv[t];");
    line(e, "const double mean = %s / %lld;", rsum(e, &rs, "s"), (long long)cols);
    line(e, "double var = 0;");
    line(e, "#pragma unroll");
    line(e, "for (int t = 0; t < %d; t++)", rs.npl);
    line(e, "  var += tr + t * %d < %lld ? (xv[t] - mean) * (xv[t] - mean) : 0.0;", rs.tpr, (long long)cols);
    line(e, "const double rstd = 1.0 / sqrt(%s / %lld + %s);", rsum(e, &rs, "var"), (long long)cols,
         dlit(e, nd->fa[0]));
  } else {
    line(e, "  s += (double)xv[t] * xv[t];");
    line(e, "const double sc = 1.0 / sqrt(%s / %lld + %s);", rsum(e, &rs, "s"), (long long)cols, dlit(e, nd->fa[0]));
  }
  row_each(e, &rs, cols);
  if (ln)
    line(e, "const float y = (float)((xv[t] - mean) * rstd * %s[j] + %s[j]);", ptr(e, w), ptr(e, bias));
  else
    line(e, "const float y = (float)(xv[t] * sc * %s[j]);", ptr(e, w));
  if (buf)
    line(e, "%s[ix] = y;", ptr(e, a));
  post_inloop(e, a, q, nq, "ix", numel(e, a), "y");
  row_each_end(e);
  leave(e);
  kend(e, rs.grid, rs.block);
  e->loop_ix = NULL;
  if (buf)
    phase_done(e, a);
  phase_end(e);
  free(q);
}

// LAYERNORM_BWD / RMSNORM_BWD siblings: dx per row; dw (and db) as column sums: each row group
// adds a fixed block of rows into per-column partials, then a thread per column adds the blocks in
// order.
static void emit_norm_bwd(Emit *e, int gi, const bool *emitted) {
  const Group *gr = &e->groups[gi];
  const IrNode *nd = node(e, gr->mem[0]);
  bool ln = nd->op == OP_LAYERNORM_BWD;
  int dx = -1, dw = -1, db = -1;
  for (int i = 0; i < gr->nmem; i++) {
    int which = (int)node(e, gr->mem[i])->ia[0];
    *(which == 0 ? &dx : which == 1 ? &dw : &db) = gr->mem[i];
  }
  int x = nd->in[0], dy = nd->in[2];
  int64_t cols = last_dim(e, x), rows = numel(e, x) / cols;
  row_inline(e, x);
  row_inline(e, dy);
  int w = need(e, nd->in[1]);
  flush(e);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = dx >= 0 ? post_set(e, gi, numel(e, dx), emitted, q) : 0;
  bool dxbuf = dx >= 0 && whole(e, dx);
  bool cols_sum = dw >= 0 || db >= 0;
  if (dw >= 0 && offset(e, dw) < 0)
    e->scratch[dw] = true;
  if (db >= 0 && offset(e, db) < 0)
    e->scratch[db] = true;
  int64_t bl = cols_sum ? (rows + 1023) / 1024 : 1, nb = (rows + bl - 1) / bl;
  int64_t pdw = dw >= 0 ? scratch_alloc(e, nb * cols * 8) : -1, pdb = db >= 0 ? scratch_alloc(e, nb * cols * 8) : -1;
  RowShape rs = row_shape(e, cols, nb, 32);
  const char *ixt = e->ixt;
  phase_begin(e);
  kbegin(e, "");
  note(e, "%s: %lld rows of %lld, %s per row%s", op_name(nd->op), (long long)rows, (long long)cols, rs_who(e, &rs),
       cols_sum ? str(e, "; column partials over %lld blocks of %lld rows", (long long)nb, (long long)bl) : "");
  const char *sw = pdw >= 0 ? raw_ptr(e, pdw, "double", "dw partials") : NULL;
  const char *sb = pdb >= 0 ? raw_ptr(e, pdb, "double", "db partials") : NULL;
  rows_open(e, &rs, cols_sum ? "k" : "r");
  if (cols_sum) {
    if (sw)
      line(e, "double sw[%d] = {0};", rs.npl);
    if (sb)
      line(e, "double sb[%d] = {0};", rs.npl);
    line(e, "const %s end = k * %lld + %lld < %lld ? k * %lld + %lld : %lld;", ixt, (long long)bl, (long long)bl,
         (long long)rows, (long long)bl, (long long)bl, (long long)rows);
    enter(e, "for (%s r = k * %lld; r < end; r++)", ixt, (long long)bl);
  }
  row_load(e, &rs, x, "xv", cols);
  row_load(e, &rs, dy, "dyv", cols);
  const char *wp = ptr(e, w);
  if (ln) {
    line(e, "double s = 0;");
    line(e, "#pragma unroll");
    line(e, "for (int t = 0; t < %d; t++)", rs.npl);
    line(e, "  s += xv[t];");
    line(e, "const double mean = %s / %lld;", rsum(e, &rs, "s"), (long long)cols);
    line(e, "double var = 0, mg = 0, mgx = 0;");
    line(e, "#pragma unroll");
    line(e, "for (int t = 0; t < %d; t++)", rs.npl);
    line(e, "  var += tr + t * %d < %lld ? (xv[t] - mean) * (xv[t] - mean) : 0.0;", rs.tpr, (long long)cols);
    line(e, "const double rstd = 1.0 / sqrt(%s / %lld + %s);", rsum(e, &rs, "var"), (long long)cols,
         dlit(e, nd->fa[0]));
    row_each(e, &rs, cols);
    line(e, "const double xhat = (xv[t] - mean) * rstd, g = (double)dyv[t] * %s[j];", wp);
    line(e, "mg += g;");
    line(e, "mgx += g * xhat;");
    if (sw)
      line(e, "sw[t] += dyv[t] * xhat;");
    if (sb)
      line(e, "sb[t] += dyv[t];");
    row_each_end(e);
    if (dx >= 0) {
      line(e, "mg = %s / %lld;", rsum(e, &rs, "mg"), (long long)cols);
      line(e, "mgx = %s / %lld;", rsum(e, &rs, "mgx"), (long long)cols);
    }
  } else {
    line(e, "double s = 0, mgx = 0;");
    line(e, "#pragma unroll");
    line(e, "for (int t = 0; t < %d; t++)", rs.npl);
    line(e, "  s += (double)xv[t] * xv[t];");
    line(e, "const double sc = 1.0 / sqrt(%s / %lld + %s);", rsum(e, &rs, "s"), (long long)cols, dlit(e, nd->fa[0]));
    row_each(e, &rs, cols);
    line(e, "mgx += (double)dyv[t] * %s[j] * xv[t];", wp);
    if (sw)
      line(e, "sw[t] += (double)dyv[t] * xv[t] * sc;");
    row_each_end(e);
    if (dx >= 0)
      line(e, "mgx = %s / %lld;", rsum(e, &rs, "mgx"), (long long)cols);
  }
  if (dx >= 0) {
    row_each(e, &rs, cols);
    if (ln)
      line(e, "const float d = (float)(rstd * ((double)dyv[t] * %s[j] - mg - (xv[t] - mean) * rstd * mgx));", wp);
    else
      line(e, "const float d = (float)(sc * dyv[t] * %s[j] - sc * sc * sc * xv[t] * mgx);", wp);
    if (dxbuf)
      line(e, "%s[ix] = d;", ptr(e, dx));
    post_inloop(e, dx, q, nq, "ix", numel(e, dx), "d");
    row_each_end(e);
  }
  if (cols_sum) {
    leave(e);
    line(e, "#pragma unroll");
    enter(e, "for (int t = 0; t < %d; t++)", rs.npl);
    line(e, "const %s j = tr + t * %d;", ixt, rs.tpr);
    enter(e, "if (j < %lld)", (long long)cols);
    if (sw)
      line(e, "%s[k * %lld + j] = sw[t];", sw, (long long)cols);
    if (sb)
      line(e, "%s[k * %lld + j] = sb[t];", sb, (long long)cols);
    leave(e);
    leave(e);
  }
  leave(e);
  kend(e, rs.grid, rs.block);
  e->loop_ix = NULL;
  if (cols_sum) {
    kbegin(e, "colsum");
    note(e, "%s: column sums of %lld blocks of rows, added in order, a thread per column", op_name(nd->op),
         (long long)nb);
    sw = pdw >= 0 ? raw_ptr(e, pdw, "double", "dw partials") : NULL;
    sb = pdb >= 0 ? raw_ptr(e, pdb, "double", "db partials") : NULL;
    enter(e, "for (%s j = blockIdx.x * blockDim.x + threadIdx.x; j < %lld; j += gridDim.x * blockDim.x)", ixt,
          (long long)cols);
    if (sw)
      line(e, "double w = 0;");
    if (sb)
      line(e, "double b = 0;");
    enter(e, "for (%s k = 0; k < %lld; k++)", ixt, (long long)nb);
    if (sw)
      line(e, "w += %s[k * %lld + j];", sw, (long long)cols);
    if (sb)
      line(e, "b += %s[k * %lld + j];", sb, (long long)cols);
    leave(e);
    if (dw >= 0)
      line(e, "%s[j] = (float)w;", ptr(e, dw));
    if (db >= 0)
      line(e, "%s[j] = (float)b;", ptr(e, db));
    leave(e);
    kend(e, grid_for(cols, block_for(cols)), block_for(cols));
  }
  if (dxbuf)
    phase_done(e, dx);
  if (dw >= 0)
    phase_done(e, dw);
  if (db >= 0)
    phase_done(e, db);
  phase_end(e);
  free(q);
}

// SOFTMAX (x) or SOFTMAX_BWD (y, dy) over the last axis, a warp (or block) per row.
static void emit_softmax(Emit *e, int gi, const bool *emitted) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  bool bwd = nd->op == OP_SOFTMAX_BWD;
  int64_t cols = last_dim(e, a), rows = numel(e, a) / cols;
  row_inline(e, nd->in[0]);
  if (bwd)
    row_inline(e, nd->in[1]);
  flush(e);
  int *q = xcalloc((size_t)e->g->n, sizeof *q);
  int nq = post_set(e, gi, numel(e, a), emitted, q);
  bool buf = whole(e, a);
  RowShape rs = row_shape(e, cols, rows, 32);
  phase_begin(e);
  kbegin(e, "");
  note(e, "%s: %lld rows of %lld, %s per row", op_name(nd->op), (long long)rows, (long long)cols, rs_who(e, &rs));
  rows_open(e, &rs, "r");
  row_load(e, &rs, nd->in[0], bwd ? "yv" : "xv", cols);
  if (bwd) {
    row_load(e, &rs, nd->in[1], "dyv", cols);
    line(e, "double dot = 0;");
    line(e, "#pragma unroll");
    line(e, "for (int t = 0; t < %d; t++)", rs.npl);
    line(e, "  dot += (double)yv[t] * dyv[t];");
    line(e, "dot = %s;", rsum(e, &rs, "dot"));
  } else {
    line(e, "float mx = -MDL_INF;");
    line(e, "#pragma unroll");
    line(e, "for (int t = 0; t < %d; t++)", rs.npl);
    line(e, "  mx = tr + t * %d < %lld ? fmaxf(mx, xv[t]) : mx;", rs.tpr, (long long)cols);
    line(e, "mx = %s;", rfmax(e, &rs, "mx"));
    line(e, "double sum = 0;");
    line(e, "#pragma unroll");
    enter(e, "for (int t = 0; t < %d; t++)", rs.npl);
    line(e, "xv[t] = tr + t * %d < %lld ? expf(xv[t] - mx) : 0.0f;", rs.tpr, (long long)cols);
    line(e, "sum += xv[t];");
    leave(e);
    line(e, "sum = %s;", rsum(e, &rs, "sum"));
  }
  row_each(e, &rs, cols);
  if (bwd)
    line(e, "const float y = (float)(yv[t] * (dyv[t] - dot));");
  else
    line(e, "const float y = (float)(xv[t] / sum);");
  if (buf)
    line(e, "%s[ix] = y;", ptr(e, a));
  post_inloop(e, a, q, nq, "ix", numel(e, a), "y");
  row_each_end(e);
  leave(e);
  kend(e, rs.grid, rs.block);
  e->loop_ix = NULL;
  if (buf)
    phase_done(e, a);
  phase_end(e);
  free(q);
}

// One row r of cross-entropy inside a row group, the logits row at x (in memory): the loss into
// loss[r] (loss may be NULL) and dloss[r] * (softmax - onehot) into the row at dx (may be NULL, may
// be x itself); an ignored target (< 0) gives zeros, one >= V a report.
static void ce_row(Emit *e, const RowShape *rs, int64_t v, const char *x, const char *tg, const char *loss,
                   const char *dx, const char *dloss) {
  const char *ixt = e->ixt;
  line(e, "const float *x = %s;", x);
  if (dx) {
    line(e, "float *dx = %s;", dx);
    dx = "dx";
  }
  line(e, "const int32_t tg = %s;", tg);
  enter(e, "if (tg < 0 || tg >= %lld)", (long long)v);
  line(e, "if (tg >= %lld && tr == 0)", (long long)v);
  line(e, "  mdl_report(status, MDL_ERR_TARGET, tg, %lld);", (long long)v);
  if (loss) {
    line(e, "if (tr == 0)");
    line(e, "  %s = 0.0f;", loss);
  }
  if (dx) {
    line(e, "for (%s j = tr; j < %lld; j += %d)", ixt, (long long)v, rs->tpr);
    line(e, "  %s[j] = 0.0f;", dx);
  }
  orelse(e);
  if (loss)
    line(e, "const float xt = x[tg];");
  line(e, "float mx = -MDL_INF;");
  line(e, "for (%s j = tr; j < %lld; j += %d)", ixt, (long long)v, rs->tpr);
  line(e, "  mx = fmaxf(mx, x[j]);");
  line(e, "mx = %s;", rfmax(e, rs, "mx"));
  line(e, "double sum = 0;");
  line(e, "for (%s j = tr; j < %lld; j += %d)", ixt, (long long)v, rs->tpr);
  line(e, "  sum += expf(x[j] - mx);");
  line(e, "sum = %s;", rsum(e, rs, "sum"));
  if (loss) {
    line(e, "if (tr == 0)");
    line(e, "  %s = (float)(mx + log(sum) - xt);", loss);
  }
  if (dx) {
    line(e, "const double g = %s, inv = 1.0 / sum;", dloss);
    line(e, "for (%s j = tr; j < %lld; j += %d)", ixt, (long long)v, rs->tpr);
    line(e, "  %s[j] = (float)(g * (expf(x[j] - mx) * inv - (j == tg)));", dx);
  }
  leave(e);
}

// The threads per row of a cross-entropy over v classes (the row is read from memory three times).
static RowShape ce_shape(Emit *e, int64_t v, int64_t rows) { return row_shape(e, v, rows, 64); }

// CROSS_ENTROPY and / or CROSS_ENTROPY_BWD over the same logits: one pass per row.
static void emit_ce(Emit *e, int gi) {
  const Group *gr = &e->groups[gi];
  int ce = -1, ceb = -1;
  for (int i = 0; i < gr->nmem; i++)
    *(node(e, gr->mem[i])->op == OP_CROSS_ENTROPY ? &ce : &ceb) = gr->mem[i];
  const IrNode *nd = node(e, gr->mem[0]);
  int64_t v = last_dim(e, nd->in[0]), rows = numel(e, nd->in[1]);
  int lg = need(e, nd->in[0]), tg = need(e, nd->in[1]), dl = ceb >= 0 ? need(e, node(e, ceb)->in[2]) : -1;
  flush(e);
  for (int i = 0; i < gr->nmem; i++)
    if (offset(e, gr->mem[i]) < 0)
      e->scratch[gr->mem[i]] = true;
  RowShape rs = ce_shape(e, v, rows);
  phase_begin(e);
  kbegin(e, "");
  note(e, "cross-entropy%s: %lld rows of %lld, %s per row",
       ceb >= 0 ? (ce >= 0 ? " and its gradient" : " gradient") : "", (long long)rows, (long long)v, rs_who(e, &rs));
  rows_open(e, &rs, "r");
  ce_row(e, &rs, v, str(e, "%s + r * %lld", ptr(e, lg), (long long)v), str(e, "%s[r]", ptr(e, tg)),
         ce >= 0 ? str(e, "%s[r]", ptr(e, ce)) : NULL,
         ceb >= 0 ? str(e, "%s + r * %lld", ptr(e, ceb), (long long)v) : NULL,
         dl >= 0 ? str(e, "%s[r]", ptr(e, dl)) : NULL);
  leave(e);
  kend(e, rs.grid, rs.block);
  for (int i = 0; i < gr->nmem; i++)
    phase_done(e, gr->mem[i]);
  phase_end(e);
}

// The LM head chunk by chunk: logits rows = x W^T (or x W) into a scratch chunk (a GEMM),
// cross-entropy and its gradient in place (a kernel), then dx rows = dlogits W (W^T) and
// dW += dlogits^T x (x^T dlogits) (two GEMMs, the second accumulating from the second chunk on).
static void emit_lmhead(Emit *e, int gi) {
  const Group *gr = &e->groups[gi];
  const IrNode *xm = node(e, gr->x);
  int64_t n = xm->shape.d[0], c = xm->shape.d[1], v = last_dim(e, gr->mm);
  int x = need(e, gr->x), w = need(e, gr->w), tg = need(e, gr->tgt), dl = need(e, gr->dloss);
  flush(e);
  int outs[3] = {gr->ce, gr->dx, gr->dw};
  for (int i = 0; i < 3; i++)
    if (offset(e, outs[i]) < 0)
      e->scratch[outs[i]] = true;
  // Chunks of a multiple of 64 rows, at most 32M logits (128 MB).
  int64_t rc = (32 << 20) / v / 64 * 64;
  if (rc < 64)
    rc = 64;
  if (rc > n)
    rc = n;
  int64_t ldw = gr->tb ? c : v, logits = scratch_alloc(e, rc * v * 4);
  int64_t ox = buf_off(e, x), ow = buf_off(e, w), odx = buf_off(e, gr->dx), odw = buf_off(e, gr->dw);
  RowShape rs = ce_shape(e, v, rc);
  phase_begin(e);
  int kt = -1;
  for (int64_t r0 = 0; r0 < n; r0 += rc) {
    int64_t rn = n - r0 < rc ? n - r0 : rc;
    gemm_add(e, (CudaGemm){.ta = 0, .tb = gr->tb, .m = rn, .n = v, .k = c, .lda = c, .ldb = ldw, .ldc = v, .batch = 1,
                           .a = ox + 4 * r0 * c, .b = ow, .c = logits, .bias = -1, .aux = -1});
    int64_t grid = (rn + rs.rpb - 1) / rs.rpb;
    if (kt < 0) {
      kbegin(e, "ce");
      note(e, "LM head: cross-entropy and its gradient of a chunk of at most %lld rows of %lld classes, in place; "
              "chunk = its first row; %s per row", (long long)rc, (long long)v, rs_who(e, &rs));
      const char *lp = raw_ptr(e, logits, "float", "the chunk's logits");
      line(e, "const %s rn = %lld - chunk < %lld ? %lld - chunk : %lld;", e->ixt, (long long)n, (long long)rc,
           (long long)n, (long long)rc);
      const char *row = rs.tpr == 32 ? str(e, "blockIdx.x * %d + (threadIdx.x >> 5)", rs.rpb) : "blockIdx.x";
      line(e, "const %s i = %s;", e->ixt, row);
      line(e, "const int tr = threadIdx.x%s;", rs.tpr == 32 ? " & 31" : "");
      enter(e, "if (i < rn)");
      line(e, "const %s r = chunk + i;", e->ixt);
      ce_row(e, &rs, v, str(e, "%s + i * %lld", lp, (long long)v), str(e, "%s[r]", ptr(e, tg)),
             str(e, "%s[r]", ptr(e, gr->ce)), str(e, "%s + i * %lld", lp, (long long)v), str(e, "%s[r]", ptr(e, dl)));
      leave(e);
      kt = kend(e, grid, rs.block);
      e->sl[e->nsl - 1].chunk = r0;
    } else {
      relaunch(e, kt, grid, r0);
    }
    gemm_add(e, (CudaGemm){.ta = 0, .tb = !gr->tb, .m = rn, .n = c, .k = v, .lda = v, .ldb = ldw, .ldc = c, .batch = 1,
                           .a = logits, .b = ow, .c = odx + 4 * r0 * c, .bias = -1, .aux = -1});
    if (gr->tb)
      gemm_add(e, (CudaGemm){.ta = 1, .tb = 0, .m = v, .n = c, .k = rn, .lda = v, .ldb = c, .ldc = c, .batch = 1,
                             .a = logits, .b = ox + 4 * r0 * c, .c = odw, .beta = r0 ? 1.0f : 0.0f, .bias = -1,
                             .aux = -1});
    else
      gemm_add(e, (CudaGemm){.ta = 1, .tb = 0, .m = c, .n = v, .k = rn, .lda = c, .ldb = v, .ldc = v, .batch = 1,
                             .a = ox + 4 * r0 * c, .b = logits, .c = odw, .beta = r0 ? 1.0f : 0.0f, .bias = -1,
                             .aux = -1});
  }
  for (int i = 0; i < 3; i++)
    phase_done(e, outs[i]);
  phase_end(e);
}

//
// Attention. Heads of q, k, v [B,T,C] (rows possibly strided: slices of one qkv buffer), D = C / H.
//

typedef struct {
  int64_t nb, nt, nc, heads, d;
  bool causal, has_doc;
  double scale;
  Rows q, k, v, dout;
  int doc, dpl; // doc: node or -1; dpl: channels per lane
} Att;

typedef enum { ATT_FWD, ATT_STATS, ATT_DQ } AttMode;

static Att att_of(const IrNode *nd) {
  Shape s = nd->shape;
  Att A = {.nb = s.d[0], .nt = s.d[1], .nc = s.d[2], .heads = nd->ia[0], .causal = nd->ia[1], .has_doc = nd->ia[2],
           .scale = nd->fa[0], .doc = -1};
  A.d = A.nc / A.heads;
  A.dpl = (int)((A.d + 31) / 32);
  return A;
}

// Element (t, c) of head hd, batch b of rows r, as an expression.
static const char *at_row(Emit *e, Rows r, const Att *A, const char *t, const char *c) {
  return str(e, "%s[(b * %lld + %s) * %lld + hd * %lld + %s]", rows_base(e, r), (long long)A->nt, t,
             (long long)r.stride, (long long)A->d, c);
}

// The mask of key j for query row i (i's document in `di`, j's in `dj`).
static const char *att_allowed(Emit *e, const Att *A, const char *di, const char *dj) {
  return str(e, "j < %lld%s%s", (long long)A->nt, A->causal ? " && j <= i" : "",
             A->has_doc ? str(e, " && %s == %s", dj, di) : "");
}

// A statement for each channel c = lane + 32 t of the lane (t < dpl), skipping c >= D.
static void lanes_stmt(Emit *e, const Att *A, const char *stmt) {
  line(e, "#pragma unroll");
  line(e, "for (int t = 0; t < %d; t++)", A->dpl);
  if (A->d % 32) {
    line(e, "  if (lane + 32 * t < %lld)", (long long)A->d);
    line(e, "    %s", stmt);
  } else {
    line(e, "  %s", stmt);
  }
}

// Queries per block (a multiple of 4, at most 16) such that the shared tiles fit in 48 KB.
static int att_bq(Emit *e, const Att *A, int per_query) {
  int64_t kv = 2 * ATT_BK * (A->d + 1) * 4 + ATT_BK * 4;
  for (int bq = 16; bq >= 4; bq /= 2)
    if (kv + (int64_t)bq * per_query <= 48 << 10)
      return bq;
  fail(e, "step %s: attention heads of %lld do not fit in shared memory", e->f->steps[e->si].name, (long long)A->d);
  return 4;
}

// The query-tile kernels: the forward (out), the backward's row statistics (lse, and dsum = dout . out
// when dsum >= 0) and the backward's dq (out = dq). One block of 4 warps per (batch, head, tile of
// queries), each warp owning every 4th query row of the tile; keys and values in shared tiles of 32,
// a key per lane; online softmax (forward, statistics) or probabilities from the statistics (dq).
static void att_query_kernel(Emit *e, const Att *A, AttMode mode, int out, int64_t lse, int64_t dsum) {
  const char *ixt = e->ixt;
  int64_t d = A->d, t = A->nt;
  int bq = att_bq(e, A, (int)(d * 4 * (mode == ATT_DQ ? 2 : 1) + 4)), rw = bq / 4;
  int64_t nqt = (t + bq - 1) / bq;
  bool guard = d % 32 != 0;
  kbegin(e, mode == ATT_FWD ? "" : mode == ATT_STATS ? "stats" : "dq");
  note(e, "attention%s: B %lld, T %lld, %lld heads of %lld%s%s; a block per (batch, head, %d queries), "
          "keys in tiles of %d",
       mode == ATT_FWD ? "" : mode == ATT_STATS ? " backward, row statistics" : " backward, dq",
       (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
       A->has_doc ? ", within documents" : "", bq, ATT_BK);
  e->shared = (int)(bq * d * 4 * (mode == ATT_DQ ? 2 : 1) + 2 * ATT_BK * (d + 1) * 4 + (A->has_doc ? ATT_BK * 4 : 0));
  line(e, "__shared__ float Qs[%d][%lld];", bq, (long long)d);
  if (mode == ATT_DQ)
    line(e, "__shared__ float Os[%d][%lld];", bq, (long long)d);
  line(e, "__shared__ float Ks[%d][%lld], Vs[%d][%lld];", ATT_BK, (long long)d + 1, ATT_BK, (long long)d + 1);
  if (A->has_doc)
    line(e, "__shared__ int32_t Dk[%d];", ATT_BK);
  line(e, "const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;");
  line(e, "const %s b = blockIdx.x / %lld, hd = blockIdx.x / %lld %% %lld, q0 = blockIdx.x %% %lld * %d;", ixt,
       (long long)(A->heads * nqt), (long long)nqt, (long long)A->heads, (long long)nqt, bq);
  const char *lp = lse >= 0 ? raw_ptr(e, lse, "float", "log-sum-exp per row") : NULL;
  const char *sp = dsum >= 0 ? raw_ptr(e, dsum, "float", "dout . out per row") : NULL;
  enter(e, "for (int u = threadIdx.x; u < %lld; u += %d)", (long long)(bq * d), 128);
  line(e, "const int i = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  line(e, "const bool in = q0 + i < %lld;", (long long)t);
  line(e, "Qs[i][c] = in ? %s : 0.0f;", at_row(e, A->q, A, "q0 + i", "c"));
  if (mode == ATT_DQ)
    line(e, "Os[i][c] = in ? %s : 0.0f;", at_row(e, A->dout, A, "q0 + i", "c"));
  leave(e);
  if (mode == ATT_DQ)
    line(e, "float acc[%d][%d], lr[%d], sr[%d];", rw, A->dpl, rw, rw);
  else
    line(e, "float m[%d], l[%d], acc[%d][%d];", rw, rw, rw, A->dpl);
  if (A->has_doc)
    line(e, "int32_t di[%d];", rw);
  line(e, "#pragma unroll");
  enter(e, "for (int rr = 0; rr < %d; rr++)", rw);
  if (mode == ATT_DQ || A->has_doc)
    line(e, "const %s i = q0 + w + 4 * rr;", ixt);
  if (mode == ATT_DQ) {
    line(e, "lr[rr] = i < %lld ? %s[(b * %lld + hd) * %lld + i] : 0.0f;", (long long)t, lp, (long long)A->heads,
         (long long)t);
    line(e, "sr[rr] = i < %lld ? %s[(b * %lld + hd) * %lld + i] : 0.0f;", (long long)t, sp, (long long)A->heads,
         (long long)t);
  } else {
    line(e, "m[rr] = -MDL_INF;");
    line(e, "l[rr] = 0.0f;");
  }
  if (A->has_doc)
    line(e, "di[rr] = i < %lld ? %s[b * %lld + i] : 0;", (long long)t, ptr(e, A->doc), (long long)t);
  line(e, "#pragma unroll");
  line(e, "for (int t = 0; t < %d; t++)", A->dpl);
  line(e, "  acc[rr][t] = 0.0f;");
  leave(e);
  if (A->causal)
    line(e, "const %s kend = q0 + %d < %lld ? q0 + %d : %lld;", ixt, bq, (long long)t, bq, (long long)t);
  else
    line(e, "const %s kend = %lld;", ixt, (long long)t);
  enter(e, "for (%s k0 = 0; k0 < kend; k0 += %d)", ixt, ATT_BK);
  line(e, "__syncthreads();");
  enter(e, "for (int u = threadIdx.x; u < %lld; u += %d)", (long long)(ATT_BK * d), 128);
  line(e, "const int jj = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  line(e, "const bool in = k0 + jj < %lld;", (long long)t);
  line(e, "Ks[jj][c] = in ? %s : 0.0f;", at_row(e, A->k, A, "k0 + jj", "c"));
  line(e, "Vs[jj][c] = in ? %s : 0.0f;", at_row(e, A->v, A, "k0 + jj", "c"));
  leave(e);
  if (A->has_doc) {
    line(e, "if (threadIdx.x < %d)", ATT_BK);
    line(e, "  Dk[threadIdx.x] = k0 + threadIdx.x < %lld ? %s[b * %lld + k0 + threadIdx.x] : 0;", (long long)t,
         ptr(e, A->doc), (long long)t);
  }
  line(e, "__syncthreads();");
  line(e, "#pragma unroll");
  enter(e, "for (int rr = 0; rr < %d; rr++)", rw);
  line(e, "const int ii = w + 4 * rr;");
  line(e, "const %s i = q0 + ii, j = k0 + lane;", ixt);
  line(e, "if (i >= %lld)", (long long)t);
  line(e, "  continue;");
  line(e, "const bool ok = %s;", att_allowed(e, A, "di[rr]", "Dk[lane]"));
  line(e, "float s = -MDL_INF;");
  enter(e, "if (ok)");
  line(e, "float dot = 0.0f;");
  line(e, "#pragma unroll 8");
  line(e, "for (int c = 0; c < %lld; c++)", (long long)d);
  line(e, "  dot += Qs[ii][c] * Ks[lane][c];");
  line(e, "s = dot * %s;", flit(e, A->scale));
  leave(e);
  if (mode == ATT_DQ) {
    line(e, "float ds = 0.0f;");
    enter(e, "if (ok)");
    line(e, "const float p = expf(s - lr[rr]);");
    line(e, "float dp = 0.0f;");
    line(e, "#pragma unroll 8");
    line(e, "for (int c = 0; c < %lld; c++)", (long long)d);
    line(e, "  dp += Os[ii][c] * Vs[lane][c];");
    line(e, "ds = p * (dp - sr[rr]);");
    leave(e);
    line(e, "#pragma unroll 4");
    enter(e, "for (int jj = 0; jj < %d; jj++)", ATT_BK);
    line(e, "const float dj = __shfl_sync(MDL_FULL, ds, jj);");
    lanes_stmt(e, A, "acc[rr][t] += dj * Ks[jj][lane + 32 * t];");
    leave(e);
  } else {
    line(e, "const float bm = mdl_warp_fmax(s);");
    line(e, "if (bm == -MDL_INF)");
    line(e, "  continue;");
    line(e, "const float mn = fmaxf(m[rr], bm), corr = expf(m[rr] - mn);");
    line(e, "const float p = ok ? expf(s - mn) : 0.0f;");
    line(e, "l[rr] = l[rr] * corr + mdl_warp_sumf(p);");
    line(e, "m[rr] = mn;");
    line(e, "#pragma unroll");
    line(e, "for (int t = 0; t < %d; t++)", A->dpl);
    line(e, "  acc[rr][t] *= corr;");
    line(e, "#pragma unroll 4");
    enter(e, "for (int jj = 0; jj < %d; jj++)", ATT_BK);
    line(e, "const float pj = __shfl_sync(MDL_FULL, p, jj);");
    lanes_stmt(e, A, "acc[rr][t] += pj * Vs[jj][lane + 32 * t];");
    leave(e);
  }
  leave(e);
  leave(e);
  line(e, "#pragma unroll");
  enter(e, "for (int rr = 0; rr < %d; rr++)", rw);
  line(e, "const %s i = q0 + w + 4 * rr;", ixt);
  line(e, "if (i >= %lld)", (long long)t);
  line(e, "  continue;");
  const char *o = out >= 0 ? ptr(e, out) : NULL;
  if (mode == ATT_STATS) {
    if (sp) {
      line(e, "float dd = 0.0f;");
      line(e, "#pragma unroll");
      enter(e, "for (int t = 0; t < %d; t++)", A->dpl);
      line(e, "const int c = lane + 32 * t;");
      if (guard)
        line(e, "if (c < %lld)", (long long)d);
      line(e, "%sdd += %s * (acc[rr][t] / l[rr]);", guard ? "  " : "", at_row(e, A->dout, A, "i", "c"));
      leave(e);
      line(e, "dd = mdl_warp_sumf(dd);");
    }
    enter(e, "if (lane == 0)");
    line(e, "%s[(b * %lld + hd) * %lld + i] = m[rr] + logf(l[rr]);", lp, (long long)A->heads, (long long)t);
    if (sp)
      line(e, "%s[(b * %lld + hd) * %lld + i] = dd;", sp, (long long)A->heads, (long long)t);
    leave(e);
  } else {
    line(e, "#pragma unroll");
    enter(e, "for (int t = 0; t < %d; t++)", A->dpl);
    line(e, "const int c = lane + 32 * t;");
    if (guard)
      line(e, "if (c < %lld)", (long long)d);
    line(e, "%s%s[(b * %lld + i) * %lld + hd * %lld + c] = %s;", guard ? "  " : "", o, (long long)t,
         (long long)A->nc, (long long)d,
         mode == ATT_FWD ? "acc[rr][t] / l[rr]" : str(e, "%s * acc[rr][t]", flit(e, A->scale)));
    leave(e);
  }
  leave(e);
  kend(e, A->nb * A->heads * nqt, 128);
}

// ATTENTION forward.
static void emit_attention(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  Att A = att_of(nd);
  A.q = rows_of(e, nd->in[0]);
  A.k = rows_of(e, nd->in[1]);
  A.v = rows_of(e, nd->in[2]);
  A.doc = A.has_doc ? need(e, nd->in[3]) : -1;
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  phase_begin(e);
  att_query_kernel(e, &A, ATT_FWD, a, -1, -1);
  phase_done(e, a);
  phase_end(e);
}

// dk and dv: one warp per (batch, head, tile of 32 keys), a key per lane, the query rows that may
// see the tile taken in order through shared tiles; each key's sums are its lane's alone.
static void att_key_kernel(Emit *e, const Att *A, int dk, int dv, int64_t lse, int64_t dsum) {
  const char *ixt = e->ixt;
  int64_t d = A->d, t = A->nt, nkt = (t + ATT_BK - 1) / ATT_BK;
  int64_t kv = 2 * ATT_BK * (d + 1) * 4 + ATT_BK * 4;
  int bq = 32;
  while (bq > 4 && kv + bq * (2 * d * 4 + 12) > 48 << 10)
    bq /= 2;
  if (kv + bq * (2 * d * 4 + 12) > 48 << 10)
    fail(e, "step %s: attention heads of %lld do not fit in shared memory", e->f->steps[e->si].name, (long long)d);
  kbegin(e, "dkv");
  note(e, "attention backward, %s: B %lld, T %lld, %lld heads of %lld%s%s; a warp per (batch, head, %d keys), "
          "a key per lane, queries in tiles of %d", dk >= 0 && dv >= 0 ? "dk and dv" : dk >= 0 ? "dk" : "dv",
       (long long)A->nb, (long long)t, (long long)A->heads, (long long)d, A->causal ? ", causal" : "",
       A->has_doc ? ", within documents" : "", ATT_BK, bq);
  e->shared = (int)(kv + bq * (2 * d * 4 + 12));
  line(e, "__shared__ float Ks[%d][%lld], Qs[%d][%lld], Os[%d][%lld], Ls[%d];", ATT_BK, (long long)d + 1, bq,
       (long long)d, bq, (long long)d, bq);
  if (dk >= 0)
    line(e, "__shared__ float Vs[%d][%lld], Ss[%d];", ATT_BK, (long long)d + 1, bq);
  if (A->has_doc)
    line(e, "__shared__ int32_t Dk[%d], Dq[%d];", ATT_BK, bq);
  const char *lp = raw_ptr(e, lse, "float", "log-sum-exp per row");
  const char *sp = dk >= 0 ? raw_ptr(e, dsum, "float", "dout . out per row") : NULL;
  line(e, "const int lane = threadIdx.x;");
  line(e, "const %s b = blockIdx.x / %lld, hd = blockIdx.x / %lld %% %lld, k0 = blockIdx.x %% %lld * %d;", ixt,
       (long long)(A->heads * nkt), (long long)nkt, (long long)A->heads, (long long)nkt, ATT_BK);
  line(e, "const %s j = k0 + lane;", ixt);
  enter(e, "for (int u = lane; u < %lld; u += 32)", (long long)(ATT_BK * d));
  line(e, "const int jj = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  line(e, "const bool in = k0 + jj < %lld;", (long long)t);
  line(e, "Ks[jj][c] = in ? %s : 0.0f;", at_row(e, A->k, A, "k0 + jj", "c"));
  if (dk >= 0)
    line(e, "Vs[jj][c] = in ? %s : 0.0f;", at_row(e, A->v, A, "k0 + jj", "c"));
  leave(e);
  if (A->has_doc)
    line(e, "Dk[lane] = j < %lld ? %s[b * %lld + j] : 0;", (long long)t, ptr(e, A->doc), (long long)t);
  if (dk >= 0)
    line(e, "float dka[%lld];", (long long)d);
  if (dv >= 0)
    line(e, "float dva[%lld];", (long long)d);
  line(e, "#pragma unroll");
  line(e, "for (int c = 0; c < %lld; c++)", (long long)d);
  line(e, "  %s%s0.0f;", dk >= 0 ? "dka[c] = " : "", dv >= 0 ? "dva[c] = " : "");
  enter(e, "for (%s i0 = %s; i0 < %lld; i0 += %d)", ixt, A->causal ? "k0" : "0", (long long)t, bq);
  line(e, "__syncthreads();");
  enter(e, "for (int u = lane; u < %lld; u += 32)", (long long)(bq * d));
  line(e, "const int ii = u / %lld, c = u %% %lld;", (long long)d, (long long)d);
  line(e, "const bool in = i0 + ii < %lld;", (long long)t);
  line(e, "Qs[ii][c] = in ? %s : 0.0f;", at_row(e, A->q, A, "i0 + ii", "c"));
  line(e, "Os[ii][c] = in ? %s : 0.0f;", at_row(e, A->dout, A, "i0 + ii", "c"));
  leave(e);
  enter(e, "for (int u = lane; u < %d; u += 32)", bq);
  line(e, "const bool in = i0 + u < %lld;", (long long)t);
  line(e, "Ls[u] = in ? %s[(b * %lld + hd) * %lld + i0 + u] : 0.0f;", lp, (long long)A->heads, (long long)t);
  if (dk >= 0)
    line(e, "Ss[u] = in ? %s[(b * %lld + hd) * %lld + i0 + u] : 0.0f;", sp, (long long)A->heads, (long long)t);
  if (A->has_doc)
    line(e, "Dq[u] = in ? %s[b * %lld + i0 + u] : 0;", ptr(e, A->doc), (long long)t);
  leave(e);
  line(e, "__syncthreads();");
  enter(e, "for (int ii = 0; ii < %d; ii++)", bq);
  line(e, "const %s i = i0 + ii;", ixt);
  line(e, "if (i >= %lld)", (long long)t);
  line(e, "  break;");
  line(e, "if (!(%s))", att_allowed(e, A, "Dq[ii]", "Dk[lane]"));
  line(e, "  continue;");
  line(e, "float dot = 0.0f;");
  line(e, "#pragma unroll 8");
  line(e, "for (int c = 0; c < %lld; c++)", (long long)d);
  line(e, "  dot += Qs[ii][c] * Ks[lane][c];");
  line(e, "const float p = expf(dot * %s - Ls[ii]);", flit(e, A->scale));
  if (dv >= 0) {
    line(e, "#pragma unroll");
    line(e, "for (int c = 0; c < %lld; c++)", (long long)d);
    line(e, "  dva[c] += p * Os[ii][c];");
  }
  if (dk >= 0) {
    line(e, "float dp = 0.0f;");
    line(e, "#pragma unroll 8");
    line(e, "for (int c = 0; c < %lld; c++)", (long long)d);
    line(e, "  dp += Os[ii][c] * Vs[lane][c];");
    line(e, "const float ds = p * (dp - Ss[ii]);");
    line(e, "#pragma unroll");
    line(e, "for (int c = 0; c < %lld; c++)", (long long)d);
    line(e, "  dka[c] += ds * Qs[ii][c];");
  }
  leave(e);
  leave(e);
  enter(e, "if (j < %lld)", (long long)t);
  line(e, "#pragma unroll");
  enter(e, "for (int c = 0; c < %lld; c++)", (long long)d);
  if (dk >= 0)
    line(e, "%s[(b * %lld + j) * %lld + hd * %lld + c] = %s * dka[c];", ptr(e, dk), (long long)t, (long long)A->nc,
         (long long)d, flit(e, A->scale));
  if (dv >= 0)
    line(e, "%s[(b * %lld + j) * %lld + hd * %lld + c] = dva[c];", ptr(e, dv), (long long)t, (long long)A->nc,
         (long long)d);
  leave(e);
  leave(e);
  kend(e, A->nb * A->heads * nkt, 32);
}

// ATTENTION_BWD siblings: the row statistics (log-sum-exp, dout . out) by a forward pass, then dq per
// query tile and dk, dv per key tile, each recomputing the probabilities from the statistics.
static void emit_attention_bwd(Emit *e, int gi) {
  const Group *gr = &e->groups[gi];
  const IrNode *nd = node(e, gr->mem[0]);
  int out[3] = {-1, -1, -1};
  for (int i = 0; i < gr->nmem; i++)
    out[node(e, gr->mem[i])->ia[3]] = gr->mem[i];
  Att A = att_of(nd);
  A.q = rows_of(e, nd->in[0]);
  A.k = rows_of(e, nd->in[1]);
  A.v = rows_of(e, nd->in[2]);
  A.doc = A.has_doc ? need(e, nd->in[3]) : -1;
  A.dout = rows_of(e, nd->in[A.has_doc ? 4 : 3]);
  flush(e);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0 && offset(e, out[i]) < 0)
      e->scratch[out[i]] = true;
  bool ds = out[0] >= 0 || out[1] >= 0; // dq and dk need dS = P (dP - dout . out); dv only P
  int64_t rows = A.nb * A.heads * A.nt;
  int64_t lse = scratch_alloc(e, rows * 4), dsum = ds ? scratch_alloc(e, rows * 4) : -1;
  phase_begin(e);
  att_query_kernel(e, &A, ATT_STATS, -1, lse, dsum);
  if (out[0] >= 0)
    att_query_kernel(e, &A, ATT_DQ, out[0], lse, dsum);
  if (out[1] >= 0 || out[2] >= 0)
    att_key_kernel(e, &A, out[1], out[2], lse, dsum);
  for (int i = 0; i < 3; i++)
    if (out[i] >= 0)
      phase_done(e, out[i]);
  phase_end(e);
}

// EMBED: rows of the table by id, four floats at a time when the width allows; a bad id is reported
// and gives a row of zeros.
static void emit_embed(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  int64_t v = node(e, nd->in[0])->shape.d[0], c = last_dim(e, a), rows = numel(e, a) / c;
  int tab = need(e, nd->in[0]), ids = need(e, nd->in[1]);
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  int w = c % 4 == 0 ? 4 : 1;
  int64_t cw = c / w, work = rows * cw;
  phase_begin(e);
  kbegin(e, "");
  note(e, "embed: %lld rows of %lld from a table of %lld, %d per thread", (long long)rows, (long long)c,
       (long long)v, w);
  const char *t = w == 4 ? "float4" : "float";
  const char *tp = ptr(e, tab), *ip = ptr(e, ids), *op = ptr(e, a);
  enter(e, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)", e->ixt,
        (long long)work);
  line(e, "const %s r = u / %lld, c = u %% %lld;", e->ixt, (long long)cw, (long long)cw);
  line(e, "const int32_t id = %s[r];", ip);
  enter(e, "if (id < 0 || id >= %lld)", (long long)v);
  line(e, "if (c == 0)");
  line(e, "  mdl_report(status, MDL_ERR_EMBED_ID, id, %lld);", (long long)v);
  line(e, "reinterpret_cast<%s *>(%s)[u] = %s;", t, op, w == 4 ? "make_float4(0.0f, 0.0f, 0.0f, 0.0f)" : "0.0f");
  orelse(e);
  line(e, "reinterpret_cast<%s *>(%s)[u] = reinterpret_cast<const %s *>(%s)[(%s)id * %lld + c];", t, op, t, tp,
       e->ixt, (long long)cw);
  leave(e);
  leave(e);
  kend(e, grid_for(work, block_for(work)), block_for(work));
  phase_done(e, a);
  phase_end(e);
}

// EMBED_BWD: a scatter-add without atomics. Each block owns 32 rows of the table and 256 of its
// columns (a column per thread, its 32 sums in shared memory) and scans every id in order, adding the
// rows of dy whose id falls in its range: deterministic, every sum in the interpreter's order.
static void emit_embed_bwd(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  int64_t v = nd->shape.d[0], c = nd->shape.d[1], rows = numel(e, nd->in[0]);
  int ids = need(e, nd->in[0]), dy = need(e, nd->in[1]);
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  int vr = 32, cb = c < BLOCK ? (int)align_up(c, 32) : BLOCK;
  int64_t nvb = (v + vr - 1) / vr, ncb = (c + cb - 1) / cb;
  phase_begin(e);
  kbegin(e, "");
  note(e, "embed backward: %lld rows of %lld into a table of %lld; a block per %d table rows x %d columns",
       (long long)rows, (long long)c, (long long)v, vr, cb);
  e->shared = vr * cb * 4;
  line(e, "__shared__ float acc[%d][%d];", vr, cb);
  const char *ip = ptr(e, ids), *dp = ptr(e, dy), *op = ptr(e, a);
  line(e, "const %s v0 = blockIdx.x / %lld * %d, c = blockIdx.x %% %lld * %d + threadIdx.x;", e->ixt, (long long)ncb,
       vr, (long long)ncb, cb);
  line(e, "for (int k = 0; k < %d; k++)", vr);
  line(e, "  acc[k][threadIdx.x] = 0.0f;");
  enter(e, "for (%s r = 0; r < %lld; r++)", e->ixt, (long long)rows);
  line(e, "const int32_t id = %s[r];", ip);
  line(e, "if (id >= v0 && id < v0 + %d && c < %lld)", vr, (long long)c);
  line(e, "  acc[id - v0][threadIdx.x] += %s[r * %lld + c];", dp, (long long)c);
  line(e, "else if ((id < 0 || id >= %lld) && blockIdx.x == 0 && threadIdx.x == 0)", (long long)v);
  line(e, "  mdl_report(status, MDL_ERR_EMBED_ID, id, %lld);", (long long)v);
  leave(e);
  line(e, "if (c < %lld)", (long long)c);
  line(e, "  for (int k = 0; k < %d && v0 + k < %lld; k++)", vr, (long long)v);
  line(e, "    %s[(v0 + k) * %lld + c] = acc[k][threadIdx.x];", op, (long long)c);
  kend(e, nvb * ncb, cb);
  phase_done(e, a);
  phase_end(e);
}

// ROPE: a thread per (row, head, pair); the angle in double, as the interpreter takes it.
static void emit_rope(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  Shape s = nd->shape;
  int64_t rows = s.d[0] * s.d[1], nc = s.d[2], heads = nd->ia[0], d = nc / heads, work = rows * heads * (d / 2);
  Rows x = rows_of(e, nd->in[0]);
  int pos = need(e, nd->in[1]);
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  phase_begin(e);
  kbegin(e, "");
  note(e, "rope%s: %lld rows, %lld heads of %lld, a thread per pair", nd->ia[1] ? " (inverse)" : "", (long long)rows,
       (long long)heads, (long long)d);
  const char *xp = rows_base(e, x), *pp = ptr(e, pos), *yp = ptr(e, a);
  enter(e, "for (%s u = blockIdx.x * blockDim.x + threadIdx.x; u < %lld; u += gridDim.x * blockDim.x)", e->ixt,
        (long long)work);
  line(e, "const %s r = u / %lld, hd = u / %lld %% %lld, i = u %% %lld;", e->ixt, (long long)(heads * (d / 2)),
       (long long)(d / 2), (long long)heads, (long long)(d / 2));
  line(e, "const double th = %s(double)%s[r] * pow(%s, -2.0 * (double)i / %lld);", nd->ia[1] ? "-1.0 * " : "", pp,
       dlit(e, nd->fa[0]), (long long)d);
  line(e, "const float cs = (float)cos(th), sn = (float)sin(th);");
  line(e, "const %s p = hd * %lld + i, p2 = p + %lld;", e->ixt, (long long)d, (long long)(d / 2));
  line(e, "const float x1 = %s[r * %lld + p], x2 = %s[r * %lld + p2];", xp, (long long)x.stride, xp,
       (long long)x.stride);
  line(e, "%s[r * %lld + p] = x1 * cs - x2 * sn;", yp, (long long)nc);
  line(e, "%s[r * %lld + p2] = x1 * sn + x2 * cs;", yp, (long long)nc);
  leave(e);
  kend(e, grid_for(work, block_for(work)), block_for(work));
  phase_done(e, a);
  phase_end(e);
}

// MAX_BWD (x, y, dy): the gradient goes to the maxima, shared evenly between ties; a thread per output.
static void emit_max_bwd(Emit *e, int gi) {
  int a = e->groups[gi].mem[0];
  const IrNode *nd = node(e, a);
  Shape s = nd->shape;
  int ax = (int)nd->ia[0];
  int64_t outer = span(s, 0, ax), len = s.d[ax], inner = span(s, ax + 1, s.rank), on = outer * inner;
  int x = need(e, nd->in[0]), y = need(e, nd->in[1]), dy = need(e, nd->in[2]);
  flush(e);
  if (offset(e, a) < 0)
    e->scratch[a] = true;
  phase_begin(e);
  kbegin(e, "");
  note(e, "max backward: %lld outputs over %lld elements, a thread per output", (long long)on, (long long)len);
  const char *xp = ptr(e, x), *yp = ptr(e, y), *dp = ptr(e, dy), *op = ptr(e, a);
  enter(e, "for (%s r = blockIdx.x * blockDim.x + threadIdx.x; r < %lld; r += gridDim.x * blockDim.x)", e->ixt,
        (long long)on);
  line(e, "const %s base = r / %lld * %lld + r %% %lld;", e->ixt, (long long)inner, (long long)(len * inner),
       (long long)inner);
  line(e, "const float m = %s[r];", yp);
  line(e, "%s ties = 0;", e->ixt);
  line(e, "for (%s l = 0; l < %lld; l++)", e->ixt, (long long)len);
  line(e, "  ties += %s[base + l * %lld] == m;", xp, (long long)inner);
  line(e, "const float g = (float)((double)%s[r] / (double)ties);", dp);
  line(e, "for (%s l = 0; l < %lld; l++)", e->ixt, (long long)len);
  line(e, "  %s[base + l * %lld] = %s[base + l * %lld] == m ? g : 0.0f;", op, (long long)inner, xp, (long long)inner);
  leave(e);
  kend(e, grid_for(on, block_for(on)), block_for(on));
  phase_done(e, a);
  phase_end(e);
}

// The optimizer's segments: a table at file scope named `name`, or, for one segment, a local array
// from the kernel's arguments (so that the kernels of equal segments are the same text). Entries are
// {p, g, m, v, n, start, wd}; nodes -1 stand for fields left 0.
static void seg_table(Emit *e, const char *name, int nseg, const int (*nodes)[4], const int64_t *n,
                      const double *wd) {
  if (nseg == 1) {
    const char *f[4];
    for (int k = 0; k < 4; k++)
      f[k] = nodes[0][k] >= 0 ? offset_arg(e, nodes[0][k]) : "0";
    line(e, "const MdlSeg seg[1] = {{%s, %s, %s, %s, %lld, 0, %s}};", f[0], f[1], f[2], f[3], (long long)n[0],
         dlit(e, wd[0]));
    return;
  }
  Buf b = {0};
  bput(&b, "static __device__ const MdlSeg %s[%d] = {\n", name, nseg);
  int64_t start = 0;
  for (int s = 0; s < nseg; s++) {
    bput(&b, "    {");
    for (int k = 0; k < 4; k++)
      bput(&b, "%lld, ", nodes[s][k] >= 0 ? (long long)buf_off(e, nodes[s][k]) : 0LL);
    const char *pname = node(e, nodes[s][0])->name;
    bput(&b, "%lld, %lld, %s}, // %s\n", (long long)n[s], (long long)start, dlit(e, wd[s]), pname ? pname : "");
    start += n[s];
  }
  bput(&b, "};\n\n");
  e->table = buf_str(e, &b);
  line(e, "const MdlSeg *const seg = %s;", name);
}

// The loop over this block's chunk of the concatenated segments: opens "for s" and the loop over the
// chunk's elements i of segment s (k = i - start).
static void seg_loop(Emit *e, int nseg, int64_t total) {
  line(e, "const int64_t c0 = (int64_t)blockIdx.x * %d, c1 = c0 + %d < %lld ? c0 + %d : %lld;", OPT_CHUNK, OPT_CHUNK,
       (long long)total, OPT_CHUNK, (long long)total);
  enter(e, "for (int s = 0; s < %d; s++)", nseg);
  line(e, "const int64_t lo = c0 > seg[s].start ? c0 : seg[s].start;");
  line(e, "const int64_t hi = c1 < seg[s].start + seg[s].n ? c1 : seg[s].start + seg[s].n;");
  enter(e, "for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)");
  line(e, "const int64_t k = i - seg[s].start;");
}

// GRAD_NORM (a sum of squares per fixed chunk of the concatenated gradients, then one block adding the
// chunks in order) and AdamW over tables of parameter segments, in double per element like the
// interpreter; p, m and v in place.
static void emit_optimizer(Emit *e, int gi) {
  const Group *gr = &e->groups[gi];
  for (int i = 0; i < gr->nmem; i++)
    if (node(e, gr->mem[i])->op == OP_GRAD_NORM) {
      const IrNode *nd = node(e, gr->mem[i]);
      for (int k = 0; k < nd->nin; k++)
        need(e, nd->in[k]);
    }
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = node(e, gr->mem[i]);
    if (nd->op != OP_ADAMW)
      continue;
    for (int k = 1; k < 7; k++)
      if (k != 4 || e->grp[canon(e, nd->in[4])] != gi)
        need(e, nd->in[k]);
  }
  flush(e);
  phase_begin(e);
  for (int i = 0; i < gr->nmem; i++) {
    const IrNode *nd = node(e, gr->mem[i]);
    if (nd->op != OP_GRAD_NORM)
      continue;
    int gn = gr->mem[i];
    if (offset(e, gn) < 0)
      e->scratch[gn] = true;
    int (*nodes)[4] = xcalloc((size_t)nd->nin, sizeof *nodes);
    int64_t *n = xcalloc((size_t)nd->nin, sizeof *n), total = 0;
    double *wd = xcalloc((size_t)nd->nin, sizeof *wd);
    for (int k = 0; k < nd->nin; k++) {
      nodes[k][0] = need(e, nd->in[k]);
      nodes[k][1] = nodes[k][2] = nodes[k][3] = -1;
      n[k] = numel(e, nd->in[k]);
      total += n[k];
    }
    int64_t nb = (total + OPT_CHUNK - 1) / OPT_CHUNK, part = scratch_alloc(e, nb * 8);
    kbegin(e, "sumsq");
    note(e, "gradient norm: sums of squares of %d tensors, %lld values, in %lld chunks of %d", nd->nin,
         (long long)total, (long long)nb, OPT_CHUNK);
    seg_table(e, str(e, "%s_grads", e->sname), nd->nin, (const int(*)[4])nodes, n, wd);
    const char *pp = raw_ptr(e, part, "double", "sums of squares per chunk");
    line(e, "double acc = 0;");
    seg_loop(e, nd->nin, total);
    line(e, "const float x = ((const float *)(arena + seg[s].p))[k];");
    line(e, "acc += (double)x * x;");
    leave(e);
    leave(e);
    line(e, "acc = mdl_block_sum(acc, %s);", sh_double(e));
    line(e, "if (threadIdx.x == 0)");
    line(e, "  %s[blockIdx.x] = acc;", pp);
    kend(e, nb, BLOCK);
    kbegin(e, "norm");
    note(e, "gradient norm: the %lld chunks added in order by one block", (long long)nb);
    pp = raw_ptr(e, part, "double", "sums of squares per chunk");
    line(e, "double acc = 0;");
    line(e, "for (int64_t k = threadIdx.x; k < %lld; k += blockDim.x)", (long long)nb);
    line(e, "  acc += %s[k];", pp);
    line(e, "acc = mdl_block_sum(acc, %s);", sh_double(e));
    line(e, "if (threadIdx.x == 0)");
    line(e, "  %s[0] = (float)sqrt(acc);", ptr(e, gn));
    kend(e, 1, BLOCK);
    phase_done(e, gn);
    free(nodes);
    free(n);
    free(wd);
  }
  // ADAMWs that share hyperparameters and scalars run over one table.
  bool *done = xcalloc((size_t)gr->nmem, sizeof *done);
  for (int i = 0, table = 0; i < gr->nmem; i++) {
    const IrNode *a = node(e, gr->mem[i]);
    if (done[i] || a->op != OP_ADAMW)
      continue;
    int *seg = xcalloc((size_t)gr->nmem, sizeof *seg), ns = 0;
    int64_t total = 0;
    for (int j = i; j < gr->nmem; j++) {
      const IrNode *b = node(e, gr->mem[j]);
      if (done[j] || b->op != OP_ADAMW || memcmp(a->fa, b->fa, sizeof(double) * 3) || a->fa[4] != b->fa[4])
        continue;
      bool same = true;
      for (int k = 4; k < 7; k++)
        same &= canon(e, a->in[k]) == canon(e, b->in[k]);
      if (!same)
        continue;
      done[j] = true;
      seg[ns++] = gr->mem[j];
      total += numel(e, gr->mem[j]);
    }
    int (*nodes)[4] = xcalloc((size_t)ns, sizeof *nodes);
    int64_t *n = xcalloc((size_t)ns, sizeof *n);
    double *wd = xcalloc((size_t)ns, sizeof *wd);
    for (int j = 0; j < ns; j++) {
      const IrNode *u = node(e, seg[j]);
      for (int k = 0; k < 4; k++) {
        nodes[j][k] = canon(e, u->in[k]);
        if (offset(e, nodes[j][k]) < 0)
          fail(e, "adamw %d: parameter, gradient or moments not in memory", seg[j]);
      }
      if (offset(e, seg[j]) >= 0 && offset(e, seg[j]) != offset(e, nodes[j][0]))
        fail(e, "adamw %d: the new parameter is not written in place", seg[j]);
      n[j] = numel(e, seg[j]);
      wd[j] = u->fa[3];
    }
    int gnorm = need(e, a->in[4]), lr = need(e, a->in[5]), step = need(e, a->in[6]);
    kbegin(e, table ? str(e, "%d", table + 1) : "");
    note(e, "AdamW over %d parameters, %lld values (beta1 %g, beta2 %g, eps %g, clip %g), chunks of %d", ns,
         (long long)total, a->fa[0], a->fa[1], a->fa[2], a->fa[4], OPT_CHUNK);
    seg_table(e, str(e, "%s_seg%s", e->sname, table ? str(e, "%d", table + 1) : ""), ns, (const int(*)[4])nodes, n, wd);
    line(e, "const double clip = %s, gnorm = %s[0];", dlit(e, a->fa[4]), ptr(e, gnorm));
    line(e, "const double sc = clip > 0 ? fmin(1.0, clip / (gnorm + 1e-6)) : 1.0;");
    line(e, "const double lr = %s[0], step = %s[0];", ptr(e, lr), ptr(e, step));
    line(e, "const double beta1 = %s, beta2 = %s, eps = %s;", dlit(e, a->fa[0]), dlit(e, a->fa[1]), dlit(e, a->fa[2]));
    line(e, "const double k1 = 1.0 / (1.0 - pow(beta1, step)), k2 = 1.0 / (1.0 - pow(beta2, step));");
    seg_loop(e, ns, total);
    line(e, "float *p = (float *)(arena + seg[s].p), *m = (float *)(arena + seg[s].m);");
    line(e, "float *v = (float *)(arena + seg[s].v);");
    line(e, "const double gi = sc * ((const float *)(arena + seg[s].g))[k];");
    line(e, "m[k] = (float)(beta1 * m[k] + (1 - beta1) * gi);");
    line(e, "v[k] = (float)(beta2 * v[k] + (1 - beta2) * gi * gi);");
    line(e, "p[k] = (float)(p[k] - lr * (m[k] * k1 / (sqrt(v[k] * k2) + eps) + seg[s].wd * p[k]));");
    leave(e);
    leave(e);
    kend(e, (total + OPT_CHUNK - 1) / OPT_CHUNK, BLOCK);
    for (int j = 0; j < ns; j++)
      phase_done(e, seg[j]);
    free(seg);
    free(nodes);
    free(n);
    free(wd);
    table++;
  }
  free(done);
  phase_end(e);
}

static void emit_group(Emit *e, int gi, const bool *emitted) {
  const Group *gr = &e->groups[gi];
  switch (gr->kind) {
  case G_NORM_BWD: emit_norm_bwd(e, gi, emitted); return;
  case G_ATTN_BWD: emit_attention_bwd(e, gi); return;
  case G_CE: emit_ce(e, gi); return;
  case G_LMHEAD: emit_lmhead(e, gi); return;
  case G_OPT: emit_optimizer(e, gi); return;
  case G_SINGLE: break;
  }
  Op op = node(e, gr->mem[0])->op;
  switch (op) {
  case OP_MATMUL: emit_gemm(e, gi, emitted); return;
  case OP_SUM: case OP_MEAN: case OP_MAX: emit_reduce(e, gi, emitted); return;
  case OP_LAYERNORM: case OP_RMSNORM: emit_norm_fwd(e, gi, emitted); return;
  case OP_SOFTMAX: case OP_SOFTMAX_BWD: emit_softmax(e, gi, emitted); return;
  case OP_ATTENTION: emit_attention(e, gi); return;
  case OP_EMBED: emit_embed(e, gi); return;
  case OP_EMBED_BWD: emit_embed_bwd(e, gi); return;
  case OP_ROPE: emit_rope(e, gi); return;
  case OP_MAX_BWD: emit_max_bwd(e, gi); return;
  default: fail(e, "no kernel for %s", op_name(op));
  }
}

//
// Steps.
//

static void pass_reset(Emit *e) {
  size_t n = (size_t)e->g->n;
  memset(e->written, 0, n * sizeof *e->written);
  memset(e->scratch, 0, n * sizeof *e->scratch);
  memset(e->stored, 0, n * sizeof *e->stored);
  for (size_t i = 0; i < n; i++) {
    e->host[i] = -1;
    e->soff[i] = -1;
  }
  e->stop = 0;
  e->nkt = e->nsl = e->nsg = 0;
  e->npending = e->nphase = 0;
  e->flagged = false;
}

static void emit_step_body(Emit *e) {
  const Step *st = &e->f->steps[e->si];
  bool *emitted = xcalloc((size_t)e->ngroups + 1, sizeof *emitted);
  for (int k = 0; k < e->ngroups && !e->failed; k++) {
    emit_group(e, e->order[k], emitted);
    emitted[e->order[k]] = true;
  }
  free(emitted);
  int *rest = xcalloc((size_t)st->nnodes + 1, sizeof *rest), nrest = 0;
  for (int k = 0; k < st->nnodes; k++) {
    int c = st->nodes[k];
    if (e->in_step[c] && offset(e, c) >= 0 && !e->written[c] && is_pointwise(node(e, c)->op))
      rest[nrest++] = c;
  }
  if (nrest)
    pw_loops(e, rest, nrest, -1, e->ngroups ? "rest" : "");
  free(rest);
  for (int k = 0; k < st->nnodes && !e->failed; k++) {
    int c = st->nodes[k];
    if (e->in_step[c] && offset(e, c) >= 0 && !e->written[c] && !e->flagged)
      fail(e, "step %s never writes node %d (%s)", st->name, c, op_name(node(e, c)->op));
  }
}

static const char *kind_name(StepKind k) {
  switch (k) {
  case STEP_KERNEL: return "kernel";
  case STEP_GEMM: return "GEMM";
  case STEP_ATTENTION: return "attention";
  case STEP_LMHEAD: return "LM head";
  case STEP_OPTIMIZER: return "optimizer";
  }
  return "?";
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
  return arena_strdup(e->a, buf);
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
  const char *name = *t->role ? str(e, "%s_%s", e->sname, t->role) : e->sname;
  for (int i = 0, n = 2; i < e->nknown; i++)
    if (!strcmp(e->known[i].name, name)) {
      name = str(e, "%s_%d", *t->role ? str(e, "%s_%s", e->sname, t->role) : e->sname, n++);
      i = -1;
    }
  grow(&e->known, e->nknown, &e->capknown, sizeof *e->known);
  e->known[e->nknown++] = (Known){str(e, "%s%s%s", t->table, t->pre, t->code), name, h};
  bput(text, "\n%s%s%s%s%s", t->table, t->notes, t->pre, name, t->code);
  return name;
}

// Appends the step's kernels and GEMMs, as the last pass left them, to the module and the schedule.
static void commit_step(Emit *e) {
  const Step *st = &e->f->steps[e->si];
  bput(&e->out, "\n// %s: %s, %d op%s\n", e->sname, kind_name(st->kind), st->nnodes, st->nnodes == 1 ? "" : "s");
  for (int k = 0; k < st->nnodes; k++) {
    const IrNode *nd = node(e, st->nodes[k]);
    char buf[128];
    bput(&e->out, "//   %%%-5d %-18s %-20s %-10s %s%s\n", nd->id, op_name(nd->op), nd->name ? nd->name : "",
         nd->loc.line ? str(e, "line %d", nd->loc.line) : "", dtype_name(nd->dtype),
         shape_str(nd->shape, buf, sizeof buf));
  }
  bput(&e->out, "// runs:\n");
  Buf text = {0};
  const char **names = xcalloc((size_t)e->nkt + 1, sizeof *names);
  for (int i = 0; i < e->nsl; i++) {
    const SLaunch *l = &e->sl[i];
    grow(&e->launches, e->nlaunches, &e->caplaunches, sizeof *e->launches);
    CudaLaunch *cl = &e->launches[e->nlaunches++];
    *cl = (CudaLaunch){.step = e->si, .gemm = -1};
    if (l->kt < 0) {
      const CudaGemm *gm = &e->sg[l->gemm];
      grow(&e->gemms, e->ngemms, &e->capgemms, sizeof *e->gemms);
      cl->gemm = e->ngemms;
      e->gemms[e->ngemms++] = *gm;
      bput(&e->out, "//   gemm %d: [%lld x %lld] = %s[%lld x %lld] %s[%lld x %lld]%s%s%s%s\n", cl->gemm,
           (long long)gm->m, (long long)gm->n, gm->ta ? "T" : "", (long long)gm->m, (long long)gm->k,
           gm->tb ? "T" : "", (long long)gm->k, (long long)gm->n,
           gm->batch > 1 ? str(e, ", %lld batches", (long long)gm->batch) : "",
           gm->beta != 0 ? " + C" : "", gm->epilogue != CUDA_EPI_NONE ? ", epilogue " : "",
           gm->epilogue != CUDA_EPI_NONE ? epi_name(gm->epilogue) : "");
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
    bput(&e->out, "//   %s<<<%lld, %d>>>%s\n", cl->kernel, (long long)l->grid, l->block,
         l->chunk ? str(e, " chunk %lld", (long long)l->chunk) : "");
  }
  bappend(&e->out, &text);
  free(text.s);
  free(names);
  if (e->stop > e->scratch_max)
    e->scratch_max = e->stop;
}

// Emits step si: passes until the layout of its values settles, then the last pass is kept.
static bool emit_step(Emit *e, int si, const char *name) {
  const Step *st = &e->f->steps[si];
  e->si = si;
  e->sname = name;
  int64_t most = 0;
  for (int k = 0; k < st->nnodes; k++) {
    const IrNode *nd = node(e, st->nodes[k]);
    e->in_step[st->nodes[k]] = !is_leaf(nd->op);
    most = numel(e, nd->id) > most ? numel(e, nd->id) : most;
    for (int j = 0; j < nd->nin; j++)
      most = numel(e, nd->in[j]) > most ? numel(e, nd->in[j]) : most;
  }
  e->ixt = most < (int64_t)1 << 30 ? "int" : "int64_t";
  memset(e->spill, 0, sizeof *e->spill * (size_t)e->g->n);
  memset(e->post_bad, 0, sizeof *e->post_bad * (size_t)e->g->n);
  bool ok = groups_order(e);
  for (int pass = 0; ok && pass < 32; pass++) {
    pass_reset(e);
    emit_step_body(e);
    if (e->failed || !e->flagged)
      break;
  }
  if (!e->failed && e->flagged)
    fail(e, "step %s: the layout of its values did not settle", st->name);
  for (int k = 0; k < st->nnodes; k++) {
    e->in_step[st->nodes[k]] = false;
    e->grp[st->nodes[k]] = -1;
  }
  if (e->failed)
    return false;
  commit_step(e);
  return true;
}

static void build_users(Emit *e) {
  const Graph *g = e->g;
  e->users = xcalloc((size_t)g->n, sizeof *e->users);
  e->nusers = xcalloc((size_t)g->n, sizeof *e->nusers);
  int *cap = xcalloc((size_t)g->n, sizeof *cap);
  for (int i = 0; i < g->n; i++)
    for (int k = 0; k < g->nodes[i]->nin; k++)
      cap[g->nodes[i]->in[k]]++;
  for (int i = 0; i < g->n; i++)
    e->users[i] = xcalloc((size_t)cap[i] + 1, sizeof **e->users);
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
  Emit e = {.f = f, .m = m, .g = g, .a = arena_new()};
  e.in_step = xcalloc(n, sizeof *e.in_step);
  e.grp = xcalloc(n, sizeof *e.grp);
  e.spill = xcalloc(n, sizeof *e.spill);
  e.post_bad = xcalloc(n, sizeof *e.post_bad);
  e.written = xcalloc(n, sizeof *e.written);
  e.scratch = xcalloc(n, sizeof *e.scratch);
  e.stored = xcalloc(n, sizeof *e.stored);
  e.host = xcalloc(n, sizeof *e.host);
  e.soff = xcalloc(n, sizeof *e.soff);
  e.slot_of = xcalloc(n, sizeof *e.slot_of);
  e.phase_nodes = xcalloc(n, sizeof *e.phase_nodes);
  e.pending = xcalloc(n, sizeof *e.pending);
  for (size_t i = 0; i < n; i++)
    e.grp[i] = e.slot_of[i] = -1;
  build_users(&e);

  int64_t scratch = align_up(m->arena_bytes, SCRATCH_ALIGN);
  bput(&e.out, "// Generated by mdlc %s from %s: do not edit.\n", MDL_VERSION, source_path ? source_path : "?");
  bput(&e.out, "// Model %s: one training step (forward, backward, AdamW) as %d steps on one device arena:\n",
       g->model ? g->model : "?", f->nsteps);
  bput(&e.out, "//   the memory plan's part   %lld bytes\n", (long long)m->arena_bytes);
  bput(&e.out, "//   params, grads, m, v at   %lld, %lld, %lld, %lld (%lld bytes each)\n", (long long)m->params,
       (long long)m->grads, (long long)m->m, (long long)m->v, (long long)m->param_bytes);
  bput(&e.out, "//   step-local scratch from  %lld\n", (long long)scratch);
  bput(&e.out, "// NVRTC compiles this file; runtime/cuda.c runs the launches each step's comment lists (kernels,\n");
  bput(&e.out, "// and GEMMs through cuBLASLt), every kernel with (arena, status, seed, chunk, the byte offsets of\n");
  bput(&e.out, "// its buffers).\n\n");
  bput(&e.out, "%s", prelude);

  const char **names = xcalloc((size_t)f->nsteps + 1, sizeof *names);
  for (int si = 0; si < f->nsteps; si++) {
    names[si] = kernel_name(&e, f->steps[si].name, si, names);
    if (!emit_step(&e, si, names[si]))
      break;
  }
  CudaPlan *plan = NULL;
  if (e.failed) {
    fprintf(stderr, "mdlc: emit_cuda: %s\n", e.err);
  } else {
    int ngemm = 0;
    for (int i = 0; i < e.nlaunches; i++)
      ngemm += e.launches[i].gemm >= 0;
    bput(&e.out, "\n// Schedule: %d launches per step, %d kernels (%d distinct) and %d GEMMs; device arena %lld "
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
    }
    plan->nkernels = e.nknown;
    plan->scratch = scratch;
    plan->arena_bytes = scratch + e.scratch_max;
  }
  free(names);
  free(e.out.s);
  free(e.body.s);
  free(e.notes.s);
  free(e.memo);
  free(e.ixm);
  free(e.lst);
  free(e.kt);
  free(e.sl);
  free(e.sg);
  free(e.known);
  free(e.launches);
  free(e.gemms);
  for (size_t i = 0; i < n; i++)
    free(e.users[i]);
  free(e.users);
  free(e.nusers);
  free(e.in_step);
  free(e.grp);
  free(e.spill);
  free(e.post_bad);
  free(e.written);
  free(e.scratch);
  free(e.stored);
  free(e.host);
  free(e.soff);
  free(e.slot_of);
  free(e.phase_nodes);
  free(e.pending);
  arena_free(e.a);
  return plan;
}

char *emit_cuda(const Fusion *f, const MemPlan *m, const char *source_path) {
  CudaPlan *p = emit_cuda_plan(f, m, source_path);
  return p ? (char *)p->source : NULL;
}
