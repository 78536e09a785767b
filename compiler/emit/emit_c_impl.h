// emit_c_impl.h: what the files of the C emitter share (names prefixed c_): its state Emit and the
// functions one file calls in another. emit_c.h is the emitter's interface (emit_c); emit_common.h
// says which file does what.
#ifndef EMIT_C_IMPL_H
#define EMIT_C_IMPL_H

#include "emit_common.h"
#include "emit_walk.h"

enum { PAR_MIN = 32768 }; // elements of work below which a loop stays on one thread

// One kernel as emitted: on its own (code), and, where its pointers are into the arena, as the body of
// a function that takes their offsets in o[] (shared), which kernels of the same loops share.
typedef struct {
  const char *name;
  char *head;      // the comment above it: its ops and loops
  char *code;      // the function, offsets built in
  char *shared;    // from the function's opening brace, offsets from o[]; NULL without arena pointers
  char *key;       // shared, comments dropped and node-numbered names numbered by first appearance
  int64_t *off;
  int noff;
} Kernel;

typedef struct {
  EmitCore core;   // the step, its groups, where values are, the loop being emitted (scratch: a malloc'd
                   // buffer in this kernel)
  Buf out;         // the translation unit

  // one pass
  bool *declared;  // its pointer is declared
  int *decls;      // nodes whose pointer the kernel uses
  int ndecls;
  Buf notes;
  bool uses_h;
} Emit;

// Rows of a matrix in memory: row r starts at base + r * stride, base being element `off` of node
// buf's buffer.
typedef struct {
  const char *base;
  int64_t stride;
  int buf;
  int64_t off;
} Rows;

typedef struct {
  const char *name;
  int64_t n; // floats
} Tmp;

//
// emit_c_kit.c: the toolkit the loop families build with (they call nothing of emit_c.c's)
//

void c_note(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void c_par_for(Emit *e, int64_t work, const char *schedule);
const char *c_str(Emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *c_flit(Emit *e, double v);
int c_ptr(Emit *e, int c);
Rows c_rows_at(Emit *e, int buf, int64_t off, int64_t stride);
Rows c_rows_of(Emit *e, int n);
Rows c_widened(Emit *e, Rows r, int *wide, int *nwide);
void c_free_widened(Emit *e, const int *wide, int nwide);
void c_rows_open(Emit *e, const char *var, int64_t rows, int64_t work, const Tmp *tmp, int ntmp);
void c_rows_close(Emit *e, const Tmp *tmp, int ntmp);
void c_row_ptr(Emit *e, int x, const char *name, const char *tmp, int64_t cols);
bool c_row_inline(Emit *e, int x);
// the target's hooks (emit_walk.h)
const char *c_local(EmitCore *core, int c, const char *ix);
void c_store(EmitCore *core, int c, const char *ix, const char *v);
const char *c_base(EmitCore *core, int n);
const char *c_seed(EmitCore *core);
const char *c_fp8_cast(EmitCore *core, const IrNode *cast, const char *x);
void c_pw_loop(EmitCore *core, const int *nodes, int k, int64_t numel, int post_anchor, const char *role);
void c_exp_sum(Emit *e, int64_t n, const char *expr, const char *dst);

//
// emit_c_rows.c
//

void c_emit_reduce(EmitCore *core, int gi);
void c_emit_norm_fwd(EmitCore *core, int gi);
void c_emit_norm_bwd(EmitCore *core, int gi);
void c_emit_softmax(EmitCore *core, int gi);
void c_emit_embed(EmitCore *core, int gi);
void c_emit_embed_bwd(EmitCore *core, int gi);
void c_emit_rope(EmitCore *core, int gi);
void c_emit_attn_mask(EmitCore *core, int gi);
void c_emit_max_bwd(EmitCore *core, int gi);
void c_emit_topk(EmitCore *core, int gi);
void c_emit_gather(EmitCore *core, int gi);
void c_emit_scatter(EmitCore *core, int gi);

//
// emit_c_lmhead.c
//

void c_emit_ce(EmitCore *core, int gi);
void c_emit_lmhead(EmitCore *core, int gi);

//
// emit_c_attn.c
//

void c_emit_attention(EmitCore *core, int gi);
void c_emit_attention_bwd(EmitCore *core, int gi);

//
// emit_c_opt.c
//

void c_emit_optimizer(EmitCore *core, int gi);

#endif
