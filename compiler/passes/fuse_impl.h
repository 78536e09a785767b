// fuse_impl.h: what the files of the fusion pass share: its state Fuser and the groups it builds,
// and the functions one file calls in another. fuse.c (the rules) calls fuse_plan.c (the plan
// from the groups) and fuse_groups.c (what may fuse); fuse_plan.c calls fuse_groups.c. The pass's
// interface is in mdl.h (fuse.c).
#ifndef FUSE_IMPL_H
#define FUSE_IMPL_H

#include "mdl.h"

typedef struct {
  StepKind kind;
  int root;
  int *m; // members, in the order they joined
  int n, cap;
  int lo, last; // the smallest id that has been a member; the largest id its members have read
} Group;

typedef struct {
  Graph *g;
  Arena *a;
  FuseOptions opt;
  int max_group;
  int *grp;       // per node: its group, or -1
  Group *groups;
  int ngroups, gcap;
  int **users;    // per node: the distinct nodes that read it, ascending
  int *nusers;
  bool *view;
  bool *pinned;   // the input of a gradient view: lives in the gradient buffer
  FuseRejection *rej;
  int nrej, rcap;
  int *rej_at, rej_mask; // an open-addressed index of rej by (a, b): indices, -1 where free
  // For fuse_creates_cycle: per node, the largest input id of the members of any group that has held a
  // member at that node or after it, as a tree of prefix maxima (reach_tree; reach_bound says why).
  int *reach;
  // scratch
  int *seen, *gseen, epoch;
  int *queue;
  bool *extra, *cand, *bcast;
  int *copy_of;   // rule 11: per PARAM its copy, else -1
} Fuser;

static inline IrNode *node(const Fuser *F, int id) { return F->g->nodes[id]; }
static inline Op op_of(const Fuser *F, int id) { return F->g->nodes[id]->op; }
static inline int64_t numel(const Fuser *F, int id) { return shape_numel(F->g->nodes[id]->shape); }

//
// fuse_groups.c: what may fuse
//
bool fuse_is_leaf(Op op);
bool fuse_is_unary(Op op);
bool fuse_is_binary(Op op);
bool fuse_is_elementwise(Op op);
bool fuse_is_reduction(Op op);
bool fuse_is_cheap(Op op);
StepKind fuse_kind_of(Op op);
const char *fuse_shape_text(const Fuser *F, int id);
bool fuse_reads_identity(const Fuser *F, int c, int p);
bool fuse_reads_many_to_one(const Fuser *F, int c, int p);
int fuse_pair_slot(const int *table, int mask, int a, int b, bool (*same)(const void *, int, int, int),
                   const void *ctx);
void fuse_reject(Fuser *F, int a, int b, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
void fuse_reject_again(Fuser *F, int a, int b, const char *why);
void fuse_add_member(Fuser *F, int gi, int id);
void fuse_remove_member(Fuser *F, int gi, int id);
int fuse_new_group(Fuser *F, StepKind kind, int root);
bool fuse_is_out(const Fuser *F, int gi, int v);
bool fuse_creates_cycle(Fuser *F, int gi, const int *xs, int nx);
bool fuse_too_many_buffers(Fuser *F, int gi, const int *xs, int nx);
const char *fuse_buffer_cap(const Fuser *F);
bool fuse_try_add(Fuser *F, int gi, int id);

//
// fuse_plan.c: the step plan
//
void fuse_resolve_views(Fuser *F);
Fusion *fuse_assemble(Fuser *F);

#endif
