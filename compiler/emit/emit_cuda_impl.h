// emit_cuda_impl.h: what the files of the CUDA emitter share (names prefixed cu_): its constants, its
// state Emit, and the functions one file calls in another. compiler/emit/emit_cuda.h is the emitter's
// interface; emit_common.h says which file does what.
#ifndef EMIT_CUDA_IMPL_H
#define EMIT_CUDA_IMPL_H

#include "emit_common.h"
#include "emit_walk.h"
#include "emit_cuda.h"

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
  ATT_MMA_TILE = 64,    //   rows of the tiles a block stages in turn (keys and values, or queries and dout):
                        //   cuda_attention.cuh's MDL_ATT_TILE
  FILL_SM = -1,         // Emit.min_blocks: as many blocks as the SM's threads allow (MDL_SM_THREADS)
};

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
  EmitCore core;   // the step, its groups, where values are, the loop being emitted (a phase: a kernel)
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
  int64_t fp8;         // precision fp8: the region of scales, 1 / scales and amaxes (CudaPlan.fp8)
  int64_t scratch0;    // where step-local scratch starts: after it
} Emit;

// Rows of a matrix in memory: row r starts at element `at` + r * stride of node `node`'s buffer.
typedef struct {
  int node;
  int64_t at, stride;
} Rows;

// How a row kernel spreads its rows over threads (cu_row_shape).
typedef struct {
  int tpr, npl, rpb, block; // threads per row, elements per thread, rows per block, block size
  int64_t groups, grid;
} RowShape;

//
// emit_cuda_kit.c: the toolkit the kernel families build with (they call nothing of emit_cuda.c's)
//

int64_t cu_align_up(int64_t x, int64_t a);

void cu_note(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cu_orelse(Emit *e);
const char *cu_flit(Emit *e, double v);
int64_t cu_scratch_alloc(Emit *e, int64_t bytes);
int64_t cu_buf_off(Emit *e, int c);
const char *cu_ptr(Emit *e, int c);
const char *cu_offset_arg(Emit *e, int c);
const char *cu_raw_ptr(Emit *e, int64_t off, const char *type, const char *what);
void cu_kbegin(Emit *e, const char *role);
int64_t cu_grid_for(int64_t work, int block);
int cu_block_for(int64_t work);
int cu_kend(Emit *e, int64_t grid, int block);
void cu_relaunch(Emit *e, int kt, int64_t grid, int64_t chunk);
void cu_gemm_add(Emit *e, CudaGemm gm);
const char *cu_sh_double(Emit *e);
const char *cu_sh_float(Emit *e);
void cu_flush_lanes(Emit *e);
Rows cu_rows_of(Emit *e, int n);
const char *cu_rows_base(Emit *e, Rows r);
// the target's hooks (emit_walk.h)
const char *cu_local(EmitCore *core, int c, const char *ix);
const char *cu_lanes(EmitCore *core, int c, const char *ix);
void cu_store(EmitCore *core, int c, const char *ix, const char *v);
const char *cu_base(EmitCore *core, int n);
const char *cu_seed(EmitCore *core);
const char *cu_fp8_cast(EmitCore *core, const IrNode *cast, const char *x);
void cu_pw_loop(EmitCore *core, const int *nodes, int k, int64_t n, int post_anchor, const char *role);
RowShape cu_row_shape(Emit *e, int64_t cols, int64_t groups, int most);
const char *cu_rs_who(Emit *e, const RowShape *rs);
void cu_rows_open(Emit *e, const RowShape *rs, const char *var);
const char *cu_rsum(Emit *e, const RowShape *rs, const char *x);
const char *cu_rfmax(Emit *e, const RowShape *rs, const char *x);

//
// emit_cuda_rows.c
//

void cu_emit_reduce(EmitCore *core, int gi);
void cu_emit_norm_fwd(EmitCore *core, int gi);
void cu_emit_norm_bwd(EmitCore *core, int gi);
void cu_emit_softmax(EmitCore *core, int gi);
void cu_emit_embed(EmitCore *core, int gi);
void cu_emit_embed_bwd(EmitCore *core, int gi);
void cu_emit_rope(EmitCore *core, int gi);
void cu_emit_attn_mask(EmitCore *core, int gi);
void cu_emit_max_bwd(EmitCore *core, int gi);
void cu_emit_topk(EmitCore *core, int gi);
void cu_emit_gather(EmitCore *core, int gi);
void cu_emit_scatter(EmitCore *core, int gi);

//
// emit_cuda_lmhead.c (its kernels call cuda_ce.cuh's mdl_ce_row)
//

void cu_emit_ce(EmitCore *core, int gi);
void cu_emit_lmhead(EmitCore *core, int gi);

//
// emit_cuda_attn.c (its tensor-core kernels instantiate cuda_attention.cuh's mdl_att_fwd, mdl_att_dq, mdl_att_dkv)
//

void cu_emit_attention(EmitCore *core, int gi);
void cu_emit_attention_bwd(EmitCore *core, int gi);

//
// emit_cuda_opt.c (its kernels instantiate cuda_opt.cuh's mdl_opt_sumsq, mdl_opt_norm, mdl_opt_update)
//

void cu_emit_optimizer(EmitCore *core, int gi);

#endif
