// fuse_groups.c: what may fuse, for the fusion pass (fuse.c): the ops' classes (elementwise, cheap to
// recompute, how a member reads its input), a group's members, the checks a node must pass to join
// a group (no cycle between steps, the cap on the buffers a kernel addresses), and the record of
// every refused pair with its reason ("not fused: A with B: reason").
#include "fuse_impl.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

bool fuse_is_leaf(Op op) {
  return op == OP_INPUT || op == OP_PARAM || op == OP_STATE || op == OP_SCALAR || op == OP_CONST;
}

bool fuse_is_unary(Op op) {
  switch (op) {
  case OP_NEG: case OP_EXP: case OP_LOG: case OP_TANH: case OP_SQRT: case OP_RSQRT: case OP_RELU:
  case OP_GELU: case OP_SILU: case OP_SIGMOID: case OP_ABS: case OP_CLAMP: case OP_STOP_GRADIENT: case OP_DROPOUT:
  case OP_CAST: return true;
  default: return false;
  }
}

bool fuse_is_binary(Op op) {
  switch (op) {
  case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_RELU_BWD: case OP_GELU_BWD:
  case OP_SILU_BWD: case OP_ABS_BWD: case OP_CLAMP_BWD: case OP_COMPARE: case OP_MINIMUM: case OP_MAXIMUM:
  case OP_FLOORDIV: case OP_MOD: return true;
  default: return false;
  }
}

bool fuse_is_elementwise(Op op) {
  switch (op) {
  case OP_BROADCAST: case OP_PERMUTE: case OP_SLICE: case OP_SLICE_BWD: case OP_CONCAT:
  case OP_RESHAPE: case OP_WHERE: return true;
  default: return fuse_is_unary(op) || fuse_is_binary(op);
  }
}

bool fuse_is_reduction(Op op) { return op == OP_SUM || op == OP_MEAN || op == OP_MAX; }

// Cheap enough to evaluate again for every element that reads it through a broadcast.
bool fuse_is_cheap(Op op) {
  switch (op) {
  case OP_NEG: case OP_RELU: case OP_ABS: case OP_CLAMP: case OP_STOP_GRADIENT: case OP_ADD: case OP_SUB: case OP_MUL:
  case OP_DIV: case OP_RELU_BWD: case OP_ABS_BWD: case OP_CLAMP_BWD: case OP_COMPARE: case OP_WHERE:
  case OP_MINIMUM: case OP_MAXIMUM: case OP_FLOORDIV: case OP_MOD:
  case OP_BROADCAST: case OP_PERMUTE: case OP_SLICE: case OP_SLICE_BWD: case OP_CONCAT:
  case OP_RESHAPE: return true;
  default: return false;
  }
}

// The kind of a step made of this op alone.
StepKind fuse_kind_of(Op op) {
  switch (op) {
  case OP_MATMUL: return STEP_GEMM;
  case OP_ATTENTION: case OP_ATTENTION_LSE: case OP_ATTENTION_BWD: return STEP_ATTENTION;
  case OP_GRAD_NORM: case OP_ADAMW: return STEP_OPTIMIZER;
  default: return STEP_KERNEL;
  }
}

const char *step_kind_name(StepKind k) {
  switch (k) {
  case STEP_KERNEL: return "kernel";
  case STEP_GEMM: return "gemm";
  case STEP_ATTENTION: return "attention";
  case STEP_LMHEAD: return "lmhead";
  case STEP_OPTIMIZER: return "optimizer";
  }
  return "?";
}

const char *fuse_shape_text(const Fuser *F, int id) {
  char buf[128];
  return arena_strdup(F->a, shape_str(node(F, id)->shape, buf, sizeof buf));
}

// Does consumer c read its input p at c's own flat index (every operand slot that holds p)?
bool fuse_reads_identity(const Fuser *F, int c, int p) {
  IrNode *n = node(F, c);
  if (n->op == OP_RESHAPE || fuse_is_unary(n->op))
    return true;
  if (!fuse_is_binary(n->op))
    return false;
  for (int k = 0; k < n->nin; k++)
    if (n->in[k] == p && !shape_eq(node(F, p)->shape, n->shape))
      return false;
  return true;
}

// Does consumer c read some element of p more than once (a broadcast)?
bool fuse_reads_many_to_one(const Fuser *F, int c, int p) {
  IrNode *n = node(F, c);
  if (n->op == OP_BROADCAST || fuse_is_binary(n->op))
    return numel(F, p) < numel(F, c);
  return false;
}

// A slot of an open-addressed table of `mask + 1` ints for the key (a, b): the slot holding an index
// i with same(i), or the free slot (-1) where such an index would go.
int fuse_pair_slot(const int *table, int mask, int a, int b, bool (*same)(const void *, int, int, int),
                   const void *ctx) {
  uint64_t h = ((uint64_t)(uint32_t)a * 0x9E3779B97F4A7C15u) ^ ((uint64_t)(uint32_t)b * 0xC2B2AE3D27D4EB4Fu);
  int at = (int)((h ^ (h >> 29)) & (uint64_t)mask);
  while (table[at] >= 0 && !same(ctx, table[at], a, b))
    at = (at + 1) & mask;
  return at;
}

static bool same_rejection(const void *ctx, int i, int a, int b) {
  const Fuser *F = ctx;
  return F->rej[i].a == a && F->rej[i].b == b;
}

// The index of the reason recorded for the pair (a, b), or -1.
static int rejection_of(const Fuser *F, int a, int b) {
  if (!F->rej_at)
    return -1;
  return F->rej_at[fuse_pair_slot(F->rej_at, F->rej_mask, a, b, same_rejection, F)];
}

void fuse_reject(Fuser *F, int a, int b, const char *fmt, ...) {
  if (rejection_of(F, a, b) >= 0)
    return;
  if (F->nrej == F->rcap) {
    F->rcap = F->rcap ? 2 * F->rcap : 64;
    FuseRejection *r = arena_alloc(F->a, sizeof *r * (size_t)F->rcap);
    if (F->nrej)
      memcpy(r, F->rej, sizeof *r * (size_t)F->nrej);
    F->rej = r;
    F->rej_mask = 2 * F->rcap - 1; // (at most half full)
    F->rej_at = arena_alloc(F->a, sizeof(int) * (size_t)(F->rej_mask + 1));
    memset(F->rej_at, -1, sizeof(int) * (size_t)(F->rej_mask + 1));
    for (int i = 0; i < F->nrej; i++)
      F->rej_at[fuse_pair_slot(F->rej_at, F->rej_mask, F->rej[i].a, F->rej[i].b, same_rejection, F)] = i;
  }
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  F->rej[F->nrej] = (FuseRejection){a, b, arena_strdup(F->a, buf)};
  F->rej_at[fuse_pair_slot(F->rej_at, F->rej_mask, a, b, same_rejection, F)] = F->nrej++;
}

// A later rule's reason for a pair replaces an earlier one: it is the reason the pair stays apart.
void fuse_reject_again(Fuser *F, int a, int b, const char *why) {
  int i = rejection_of(F, a, b);
  if (i >= 0)
    F->rej[i].reason = arena_strdup(F->a, why);
  else
    fuse_reject(F, a, b, "%s", why);
}

// fuse_creates_cycle's bound. reach_note records that a group holds node id, which reads inputs up to
// `last`; reach_bound(x) is the least b >= x such that every group with a member at or before b
// reads nothing after b (at least: the records only grow, so stale ones only make b larger). From a
// node after b that is in no such group, every path goes on through nodes after b (ids are a
// topological order, and a group reached there has all its members after b), so none leads back to
// a node at or before b.
static void reach_note(Fuser *F, int id, int last) {
  for (int i = id + 1; i <= F->g->n; i += i & -i)
    if (F->reach[i - 1] < last)
      F->reach[i - 1] = last;
}

static int reach_prefix(const Fuser *F, int x) {
  int m = -1;
  for (int i = x + 1; i > 0; i -= i & -i)
    if (F->reach[i - 1] > m)
      m = F->reach[i - 1];
  return m;
}

static int reach_bound(const Fuser *F, int x) {
  for (int b; (b = reach_prefix(F, x)) > x;)
    x = b;
  return x;
}

void fuse_add_member(Fuser *F, int gi, int id) {
  Group *G = &F->groups[gi];
  if (G->n == G->cap) {
    G->cap = G->cap ? 2 * G->cap : 8;
    int *m = arena_alloc(F->a, sizeof(int) * (size_t)G->cap);
    if (G->n)
      memcpy(m, G->m, sizeof(int) * (size_t)G->n);
    G->m = m;
  }
  G->m[G->n++] = id;
  F->grp[id] = gi;
  if (G->n == 1 || id < G->lo)
    G->lo = id;
  for (int k = 0; k < node(F, id)->nin; k++)
    if (node(F, id)->in[k] > G->last)
      G->last = node(F, id)->in[k];
  reach_note(F, G->lo, G->last);
}

void fuse_remove_member(Fuser *F, int gi, int id) {
  Group *G = &F->groups[gi];
  for (int i = 0; i < G->n; i++)
    if (G->m[i] == id) {
      memmove(G->m + i, G->m + i + 1, sizeof(int) * (size_t)(G->n - i - 1));
      G->n--;
      break;
    }
  F->grp[id] = -1;
}

int fuse_new_group(Fuser *F, StepKind kind, int root) {
  if (F->ngroups == F->gcap) {
    F->gcap = F->gcap ? 2 * F->gcap : 64;
    Group *g = arena_alloc(F->a, sizeof *g * (size_t)F->gcap);
    if (F->ngroups)
      memcpy(g, F->groups, sizeof *g * (size_t)F->ngroups);
    F->groups = g;
  }
  int gi = F->ngroups++;
  F->groups[gi] = (Group){.kind = kind, .root = root, .last = -1};
  fuse_add_member(F, gi, root);
  return gi;
}

// Is node v a named model output of a graph without a backward (evaluation, sampling: their readers
// read it), or a scalar output of any graph (a metric, which the runtime reads after every step, even
// where a member of its step reads it too: an auxiliary loss added to the loss)? In a training graph
// nothing reads the other outputs: rule 2 keeps the logits out of memory there.
static bool read_as_output(const Fuser *F, int v) {
  for (int o = 0; o < F->g->noutputs; o++)
    if (F->g->outputs[o] == v && (!F->g->grads || node(F, v)->shape.rank == 0))
      return true;
  return false;
}

// Is member v of group gi one of its outs (written to memory): read by another step, the loss, an
// ADAMW or GRAD_NORM, read as a model output (read_as_output), or read by nobody?
bool fuse_is_out(const Fuser *F, int gi, int v) {
  Op op = op_of(F, v);
  bool out = F->nusers[v] == 0 || v == F->g->loss || op == OP_ADAMW || op == OP_GRAD_NORM || read_as_output(F, v);
  for (int k = 0; k < F->nusers[v] && !out; k++)
    out = F->grp[F->users[v][k]] != gi;
  return out;
}

static bool in_set(const Fuser *F, int gi, int v) { return (gi >= 0 && F->grp[v] == gi) || F->extra[v]; }

// May a path from node u lead back to a node at or before `bound` (a reach_bound)?
static bool may_lead_back(const Fuser *F, int u, int bound) {
  return (F->grp[u] >= 0 ? F->groups[F->grp[u]].lo : u) <= bound;
}

// Would group gi, grown by the nodes xs, depend on itself through nodes outside it? Walks the
// readers of the grown group; a node that belongs to another group stands for the whole group.
bool fuse_creates_cycle(Fuser *F, int gi, const int *xs, int nx) {
  int nm = gi >= 0 ? F->groups[gi].n : 0, top = 0;
  for (int i = 0; i < nx; i++) {
    F->extra[xs[i]] = true;
    top = xs[i] > top ? xs[i] : top;
  }
  for (int i = 0; i < nm; i++)
    top = F->groups[gi].m[i] > top ? F->groups[gi].m[i] : top;
  // Only nodes at or before `bound`, and groups with a member there, can lead back (reach_bound).
  int bound = reach_bound(F, top);
  F->epoch++;
  int head = 0, tail = 0;
  bool cycle = false;
  // Seeds: readers of the grown group that are outside it.
  for (int i = 0; i < nm + nx; i++) {
    int v = i < nm ? F->groups[gi].m[i] : xs[i - nm];
    for (int k = 0; k < F->nusers[v]; k++) {
      int u = F->users[v][k];
      if (!in_set(F, gi, u) && F->seen[u] != F->epoch && may_lead_back(F, u, bound)) {
        F->seen[u] = F->epoch;
        F->queue[tail++] = u;
      }
    }
  }
  while (head < tail && !cycle) {
    int v = F->queue[head++];
    const int *from = &v;
    int nfrom = 1;
    int h = F->grp[v];
    if (h >= 0) {
      if (F->gseen[h] == F->epoch)
        continue;
      F->gseen[h] = F->epoch;
      from = F->groups[h].m;
      nfrom = F->groups[h].n;
    }
    for (int i = 0; i < nfrom && !cycle; i++) {
      int w = from[i];
      F->seen[w] = F->epoch;
      for (int k = 0; k < F->nusers[w]; k++) {
        int u = F->users[w][k];
        if (in_set(F, gi, u)) {
          cycle = true;
          break;
        }
        if (F->seen[u] != F->epoch && may_lead_back(F, u, bound)) {
          F->seen[u] = F->epoch;
          F->queue[tail++] = u;
        }
      }
    }
  }
  for (int i = 0; i < nx; i++)
    F->extra[xs[i]] = false;
  return cycle;
}

// How many buffers group gi, grown by the nodes xs, would address: the distinct values its members
// read from outside it (CONSTs apart: emitters write them inline) and the members read outside it or
// kept (its outs, as fuse_is_out says, with the group grown).
static int buffers_with(Fuser *F, int gi, const int *xs, int nx) {
  for (int i = 0; i < nx; i++)
    F->extra[xs[i]] = true;
  F->epoch++;
  int count = 0, nm = gi >= 0 ? F->groups[gi].n : 0;
  for (int i = 0; i < nm + nx; i++) {
    int v = i < nm ? F->groups[gi].m[i] : xs[i - nm];
    const IrNode *n = node(F, v);
    for (int k = 0; k < n->nin; k++) {
      int x = n->in[k];
      if (!in_set(F, gi, x) && op_of(F, x) != OP_CONST && F->seen[x] != F->epoch) {
        F->seen[x] = F->epoch;
        count++;
      }
    }
    bool out = F->nusers[v] == 0 || v == F->g->loss || n->op == OP_ADAMW || n->op == OP_GRAD_NORM ||
               read_as_output(F, v);
    for (int k = 0; k < F->nusers[v] && !out; k++)
      out = !in_set(F, gi, F->users[v][k]);
    count += out;
  }
  for (int i = 0; i < nx; i++)
    F->extra[xs[i]] = false;
  return count;
}

// Would group gi grown by xs address more buffers than a kernel may (FUSE_MAX_BUFFERS)?
bool fuse_too_many_buffers(Fuser *F, int gi, const int *xs, int nx) {
  return buffers_with(F, gi, xs, nx) > FUSE_MAX_BUFFERS;
}

const char *fuse_buffer_cap(const Fuser *F) {
  return arena_printf(F->a, "buffer cap (%d buffers a kernel)", FUSE_MAX_BUFFERS);
}

// Adds id to group gi unless that would make the steps cyclic.
bool fuse_try_add(Fuser *F, int gi, int id) {
  if (fuse_creates_cycle(F, gi, &id, 1))
    return false;
  fuse_add_member(F, gi, id);
  return true;
}
