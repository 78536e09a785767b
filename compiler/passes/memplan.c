// memplan.c: the memory planner. Every materialised node of a Fusion gets a byte offset in one
// arena; the back ends allocate the arena once and run every step inside it.
//
// Layout, each piece 64-byte aligned:
//   params | grads | m | v | copies | inputs | scalars | activations
// The first four are flat buffers of param_bytes each with the parameters in declaration order at
// the same relative offsets (parameter i starts at the same place in all four), so one loop walks
// a parameter, its gradient and its moments together. g->grads[i] is placed in the gradient buffer
// (when it is a view, the node it views is; a frozen parameter's place there is left unused); the
// STATE nodes "<p>.m" and "<p>.v" in m and v; an ADAMW node writes its parameter in place and so
// shares the PARAM's offset. Only the moments the optimizer keeps take room (MemPlan.moments): m
// and v for AdamW, m alone for Lion and SGD with momentum, neither for plain SGD or a graph
// without an optimizer (then m, and v, are empty at the end of the gradients).
// The parameters' bf16 copies (Fusion.copy_of, rule 11 of fuse.c) follow, in parameter order: they
// persist from one step to the next like the parameters. A matrix's copy has room for its rows
// rounded up to a multiple of 64 (MEMPLAN_ROWS), zero beyond its own rows: a GEMM may then read it
// as that many rows (the CUDA LM head reads GPT-2's 50257-row embedding as 50304, which keeps
// cuBLASLt on its fast, aligned kernels). INPUT and SCALAR nodes have fixed slots.
// Every other materialised node is an activation: it is live from the step that writes it to the
// last step that reads it (directly or through a view; the loss, the gradient norm and every
// materialised model output stay live to the end of the step so the runtime can read them), and
// activations whose lifetimes do not overlap may share memory. Placement is greedy by size: largest
// first, each at the lowest offset that does not overlap a placed buffer alive at the same time. A
// view (a RESHAPE of a materialised node, or a SLICE that attention reads in place) shares its
// input's offset; its readers keep the input alive. Each tensor takes dtype_size bytes per element
// (4 for f32 and i32, 2 for bf16).
// After a step only the four flat buffers, the copies, the inputs, the scalars, the loss, the
// gradient norm and the materialised outputs hold values.
#include "mdl.h"

#include <stdlib.h>
#include <string.h>

enum { ALIGN = 64 };

static int64_t align_up(int64_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

static int64_t bytes_of(const IrNode *n) { return dtype_size(n->dtype) * shape_numel(n->shape); }

int64_t memplan_copy_rows(const IrNode *copy) {
  return (copy->shape.d[0] + MEMPLAN_ROWS - 1) / MEMPLAN_ROWS * MEMPLAN_ROWS;
}

int64_t memplan_copy_bytes(const IrNode *copy) {
  int64_t bytes = bytes_of(copy);
  return copy->shape.rank == 2 ? bytes / copy->shape.d[0] * memplan_copy_rows(copy) : bytes;
}

static bool is_leaf(Op op) {
  return op == OP_INPUT || op == OP_PARAM || op == OP_STATE || op == OP_SCALAR || op == OP_CONST;
}

static bool is_view(const Fusion *f, int id) {
  return f->materialised[id] && f->step_of[id] < 0 && !is_leaf(f->g->nodes[id]->op) && !fuse_is_copy(f, id);
}

static int base_of(const Fusion *f, int id) {
  while (is_view(f, id))
    id = f->g->nodes[id]->in[0];
  return id;
}

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && !strcmp(s + n - k, suffix);
}

typedef struct {
  int id;
  int64_t size, offset;
  int first, last; // steps
} Buffer;

static int by_size(const void *pa, const void *pb) {
  const Buffer *a = pa, *b = pb;
  if (a->size != b->size)
    return a->size > b->size ? -1 : 1;
  if (a->first != b->first)
    return a->first - b->first;
  return a->id - b->id;
}

// Sorts the n buffers of b by offset, least first, through tmp (n more): a radix sort, a byte a
// pass, as many passes as the largest offset has bytes (a buffer is sorted against thousands alive
// with it in a long model, for each buffer placed). Buffers at one offset may come in any order.
static void sort_by_offset(Buffer **b, Buffer **tmp, int n) {
  int64_t most = 0;
  for (int i = 0; i < n; i++)
    most = b[i]->offset > most ? b[i]->offset : most;
  for (int shift = 0; shift < 64 && most >> shift; shift += 8) {
    int count[257] = {0};
    for (int i = 0; i < n; i++)
      count[((b[i]->offset >> shift) & 255) + 1]++;
    for (int d = 0; d < 256; d++)
      count[d + 1] += count[d];
    for (int i = 0; i < n; i++)
      tmp[count[(b[i]->offset >> shift) & 255]++] = b[i];
    memcpy(b, tmp, sizeof *b * (size_t)n);
  }
}

// The placed buffers by lifetime: a segment tree over the steps [0, span) whose nodes hold the
// buffers alive over the whole of their range and over no larger node's (a buffer is in at most two
// nodes a level), and the buffers by first step. The buffers alive at some step of [first, last] are
// then those alive at `first` (on the path from the root to first's leaf, each once) and those whose
// first step is in (first, last].
typedef struct {
  Buffer **b;
  int n, cap;
} List;

typedef struct {
  List *node, *by_first;
  int span;
} Timeline;

static void push(List *l, Buffer *b) {
  if (l->n == l->cap) {
    l->cap = l->cap ? 2 * l->cap : 4;
    l->b = xrealloc(l->b, sizeof(Buffer *) * (size_t)l->cap, "the memory plan's timeline");
  }
  l->b[l->n++] = b;
}

static void insert(Timeline *t, int at, int lo, int hi, Buffer *b, int first, int last) {
  if (last < lo || hi < first)
    return;
  if (first <= lo && hi <= last) {
    push(&t->node[at], b);
    return;
  }
  int mid = lo + (hi - lo) / 2;
  insert(t, 2 * at, lo, mid, b, first, last);
  insert(t, 2 * at + 1, mid + 1, hi, b, first, last);
}

// Appends to alive the buffers of t alive at some step of [first, last]; returns their count.
static int alive_during(const Timeline *t, int first, int last, Buffer **alive) {
  int na = 0;
  for (int at = 1, lo = 0, hi = t->span - 1;;) {
    for (int k = 0; k < t->node[at].n; k++)
      alive[na++] = t->node[at].b[k];
    if (lo == hi)
      break;
    int mid = lo + (hi - lo) / 2;
    if (first <= mid)
      hi = mid, at = 2 * at;
    else
      lo = mid + 1, at = 2 * at + 1;
  }
  for (int s = first + 1; s <= last; s++)
    for (int k = 0; k < t->by_first[s].n; k++)
      alive[na++] = t->by_first[s].b[k];
  return na;
}

// Places the activations at the lowest offsets that do not collide with a placed buffer alive at
// the same time (with `reuse` off: with any placed buffer); returns the peak.
static int64_t place(Buffer *buf, int n, bool reuse) {
  qsort(buf, (size_t)n, sizeof *buf, by_size);
  Timeline t = {.span = 1};
  for (int i = 0; i < n; i++)
    t.span = buf[i].last + 1 > t.span ? buf[i].last + 1 : t.span;
  t.node = xcalloc(4 * (size_t)t.span, sizeof(List), "the memory plan's timeline");
  t.by_first = xcalloc((size_t)t.span, sizeof(List), "the memory plan's timeline");
  Buffer **alive = xmalloc(sizeof(Buffer *) * (size_t)n, "the memory plan's buffers");
  Buffer **tmp = xmalloc(sizeof(Buffer *) * (size_t)n, "the memory plan's buffers");
  int64_t peak = 0;
  for (int i = 0; i < n; i++) {
    int first = reuse ? buf[i].first : 0, last = reuse ? buf[i].last : t.span - 1;
    int na = alive_during(&t, first, last, alive);
    sort_by_offset(alive, tmp, na);
    int64_t at = 0;
    for (int j = 0; j < na; j++) {
      if (alive[j]->offset >= at + buf[i].size)
        break;
      int64_t end = align_up(alive[j]->offset + alive[j]->size);
      if (end > at)
        at = end;
    }
    buf[i].offset = at;
    if (at + buf[i].size > peak)
      peak = at + buf[i].size;
    insert(&t, 1, 0, t.span - 1, &buf[i], first, last);
    push(&t.by_first[first], &buf[i]);
  }
  for (int k = 0; k < 4 * t.span; k++)
    free(t.node[k].b);
  for (int k = 0; k < t.span; k++)
    free(t.by_first[k].b);
  free(t.node);
  free(t.by_first);
  free(alive);
  free(tmp);
  return align_up(peak);
}

MemPlan *memplan(const Fusion *f) { return memplan_with(f, true); }

MemPlan *memplan_with(const Fusion *f, bool reuse) {
  const Graph *g = f->g;
  Arena *a = g->arena;
  MemPlan *mp = arena_alloc(a, sizeof *mp);
  mp->offset = arena_alloc(a, sizeof(int64_t) * (size_t)(g->n ? g->n : 1));
  for (int i = 0; i < g->n; i++)
    mp->offset[i] = -1;

  // The four flat buffers.
  int64_t *rel = arena_alloc(a, sizeof(int64_t) * (size_t)(g->n ? g->n : 1)); // per PARAM node
  int64_t at = 0;
  for (int i = 0; i < g->nparams; i++) {
    rel[g->params[i]] = at;
    at = align_up(at + bytes_of(g->nodes[g->params[i]]));
  }
  mp->param_bytes = at;
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_STATE && g->nodes[i]->param_of >= 0) {
      int k = ends_with(g->nodes[i]->name, ".v") ? 2 : 1;
      mp->moments = k > mp->moments ? k : mp->moments;
    }
  mp->params = 0;
  mp->grads = at;
  mp->m = 2 * at;
  mp->v = mp->m + (mp->moments > 0 ? at : 0);
  for (int i = 0; i < g->nparams; i++) {
    int p = g->params[i];
    mp->offset[p] = mp->params + rel[p];
    if (g->grads && g->grads[i] >= 0)
      mp->offset[base_of(f, g->grads[i])] = mp->grads + rel[p];
  }
  at = (2 + mp->moments) * at;
  mp->copies = at;
  mp->copy_of = f->copy_of;
  for (int i = 0; i < g->nparams; i++) {
    int c = f->copy_of[g->params[i]];
    if (c >= 0) {
      mp->offset[c] = at;
      at = align_up(at + memplan_copy_bytes(g->nodes[c]));
    }
  }
  mp->copy_bytes = at - mp->copies;
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op == OP_STATE && n->param_of >= 0)
      mp->offset[i] = (ends_with(n->name, ".v") ? mp->v : mp->m) + rel[n->param_of];
    else if (n->op == OP_ADAMW)
      mp->offset[i] = mp->offset[n->in[0]];
  }

  // Fixed slots: inputs, then scalars.
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < g->n; i++)
      if (g->nodes[i]->op == (pass ? OP_SCALAR : OP_INPUT)) {
        mp->offset[i] = at;
        at = align_up(at + bytes_of(g->nodes[i]));
      }

  // Activations with their lifetimes.
  int *first = arena_alloc(a, sizeof(int) * (size_t)(g->n ? g->n : 1));
  int *last = arena_alloc(a, sizeof(int) * (size_t)(g->n ? g->n : 1));
  for (int i = 0; i < g->n; i++)
    first[i] = last[i] = f->step_of[i];
  for (int s = 0; s < f->nsteps; s++)
    for (int k = 0; k < f->steps[s].nins; k++) {
      int b = base_of(f, f->steps[s].ins[k]);
      if (last[b] < s)
        last[b] = s;
    }
  if (g->loss >= 0)
    last[base_of(f, g->loss)] = f->nsteps;
  for (int i = 0; i < g->noutputs; i++)
    if (f->materialised[g->outputs[i]])
      last[base_of(f, g->outputs[i])] = f->nsteps;
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_GRAD_NORM && f->materialised[i])
      last[base_of(f, i)] = f->nsteps;
  Buffer *buf = xmalloc(sizeof *buf * (size_t)g->n, "the memory plan's buffers");
  int nbuf = 0;
  for (int i = 0; i < g->n; i++)
    if (f->materialised[i] && mp->offset[i] < 0 && f->step_of[i] >= 0)
      buf[nbuf++] = (Buffer){i, bytes_of(g->nodes[i]), 0, first[i], last[i]};
  mp->activation_bytes = place(buf, nbuf, reuse);
  for (int i = 0; i < nbuf; i++)
    mp->offset[buf[i].id] = at + buf[i].offset;
  free(buf);
  mp->arena_bytes = at + mp->activation_bytes;

  // Views share their input's offset (inputs come first in id order).
  for (int i = 0; i < g->n; i++)
    if (is_view(f, i) && mp->offset[i] < 0)
      mp->offset[i] = mp->offset[g->nodes[i]->in[0]];
  return mp;
}

static const char *region(const MemPlan *m, const IrNode *n, int64_t off) {
  if (n->op == OP_INPUT || n->op == OP_SCALAR)
    return op_name(n->op);
  if (off < m->grads)
    return "params";
  if (off < m->m)
    return "grads";
  if (off < m->v)
    return "m";
  if (off < m->copies)
    return "v";
  if (off < m->copies + m->copy_bytes)
    return "copies";
  return "act";
}

void memplan_dump(const Fusion *f, const MemPlan *m, FILE *out) {
  const Graph *g = f->g;
  int64_t act = m->arena_bytes - m->activation_bytes;
  static const char *const flat[] = {"params, grads", "params, grads, m", "params, grads, m, v"};
  fprintf(out, "memory plan of %s: arena %lld bytes = %d x %lld (%s) + %lld (bf16 copies) + "
               "%lld (inputs, scalars) + %lld (activations, peak)\n",
          g->model ? g->model : "?", (long long)m->arena_bytes, 2 + m->moments, (long long)m->param_bytes,
          flat[m->moments], (long long)m->copy_bytes,
          (long long)(act - (2 + m->moments) * m->param_bytes - m->copy_bytes), (long long)m->activation_bytes);
  fprintf(out, "%-7s %12s %10s  %-6s %-28s %s\n", "region", "offset", "bytes", "node", "op / name", "shape");
  for (int i = 0; i < g->n; i++) {
    const IrNode *n = g->nodes[i];
    if (m->offset[i] < 0)
      continue;
    char buf[128];
    const char *what = n->name ? n->name : "";
    char label[160];
    snprintf(label, sizeof label, "%s%s%s", op_name(n->op), *what ? " " : "", what);
    fprintf(out, "%-7s %12lld %10lld  %%%-5d %-28s %s%s", is_view(f, i) ? "view" : region(m, n, m->offset[i]),
            (long long)m->offset[i], (long long)bytes_of(n), i, label, dtype_name(n->dtype),
            shape_str(n->shape, buf, sizeof buf));
    if (is_view(f, i))
      fprintf(out, "  = %%%d", n->in[0]);
    else if (f->step_of[i] >= 0)
      fprintf(out, "  written by %s", f->steps[f->step_of[i]].name);
    else if (fuse_is_copy(f, i))
      fprintf(out, "  copy of %%%d, written by the optimizer", n->in[0]);
    fprintf(out, "\n");
  }
}
