// test_packing.c: sequence packing must not leak across documents. On a row packed with three
// documents: perturbing one document leaves every other document's logits bit-identical, and each
// document's per-token losses equal those of the document run alone (within fp32 tolerance).
// Checked on the compiled CPU back end (fused) and on the reference interpreter, for gpt2-tiny and
// llama-tiny (rotary positions come from the per-document pos input), with the fused attention and
// with attention lowered into GEMMs and a mask (--attention plain). The check must catch a leak: with
// --no-doc-mask (attention ignores the doc ids), perturbing the middle document moves the logits of
// the document after it, with either lowering (the one before it stays as it was: attention is causal).
#include "backend.h"
#include "emit_c.h"
#include "mdl.h"
#include "runtime.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { T = 32 };
static const int doc_start[] = {0, 10, 22, T}; // three documents: [0,10) [10,22) [22,32)

typedef struct {
  int32_t tokens[T], targets[T], pos[T], doc[T];
} Row;

static Row packed_row(int perturb_at) {
  Row r;
  for (int d = 0; d < 3; d++)
    for (int t = doc_start[d]; t < doc_start[d + 1]; t++) {
      r.tokens[t] = t == doc_start[d] ? 0 : (int32_t)(1 + (t * 37 + d * 11) % 255); // EOS starts a document
      r.pos[t] = t - doc_start[d];
      r.doc[t] = d;
    }
  if (perturb_at >= 0)
    r.tokens[perturb_at] = (r.tokens[perturb_at] + 100) % 255 + 1;
  for (int t = 0; t < T; t++)
    r.targets[t] = t + 1 < T && r.doc[t + 1] == r.doc[t] ? r.tokens[t + 1] : -1;
  return r;
}

// Document d of `from` alone at the start of a row; the rest is padding (EOS, ignored, doc 1).
static Row alone_row(const Row *from, int d) {
  Row r;
  int n = doc_start[d + 1] - doc_start[d];
  for (int t = 0; t < T; t++) {
    bool real = t < n;
    r.tokens[t] = real ? from->tokens[doc_start[d] + t] : 0;
    r.targets[t] = real ? from->targets[doc_start[d] + t] : -1;
    r.pos[t] = real ? t : t - n;
    r.doc[t] = real ? 0 : 1;
  }
  return r;
}

typedef struct {
  float *logits, ce[T];
  int64_t V;
} Out;

static bool forward(Engine *e, int logits, int ce, const Row *r, Out *o) {
  char err[256];
  bool ok = e->set_input(e, "tokens", r->tokens, NULL, T) && e->set_input(e, "targets", r->targets, NULL, T) &&
            e->set_input(e, "pos", r->pos, NULL, T) && e->set_input(e, "doc", r->doc, NULL, T) &&
            e->step(e, err, sizeof err);
  if (!ok) {
    printf("[fail] packing: forward: %s\n", err);
    return false;
  }
  o->V = e->g->nodes[logits]->shape.d[2];
  o->logits = malloc(sizeof(float) * (size_t)(T * o->V));
  e->read(e, logits, o->logits);
  e->read(e, ce, o->ce);
  return true;
}

// masked: the doc ids reach attention (else --no-doc-mask: the leak must show).
static void check_engine(const char *model, const char *how, Engine *e, bool masked) {
  const Graph *g = e->g;
  int logits = -1, ce = -1;
  for (int i = 0; i < g->noutputs; i++)
    if (g->nodes[g->outputs[i]]->name && !strcmp(g->nodes[g->outputs[i]]->name, "logits"))
      logits = g->outputs[i];
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i]->op == OP_CROSS_ENTROPY)
      ce = i;
  char name[160];
  Out base, pert;
  if (logits < 0 || ce < 0 || !forward(e, logits, ce, &(Row){0}, &base))
    return;
  free(base.logits);
  Row r0 = packed_row(-1), r1 = packed_row(15);
  if (!forward(e, logits, ce, &r0, &base) || !forward(e, logits, ce, &r1, &pert))
    return;
  int64_t V = base.V;
  for (int d = 0; d < 3; d++) {
    size_t a = (size_t)(doc_start[d] * V), n = (size_t)((doc_start[d + 1] - doc_start[d]) * V);
    bool same = !memcmp(base.logits + a, pert.logits + a, n * sizeof(float)), moves = d == 1 || (!masked && d == 2);
    snprintf(name, sizeof name, "packing %s %s%s: perturbing document 1 %s document %d's logits", model, e->name, how,
             moves ? "changes" : "leaves bit-identical", d);
    CHECK(moves ? !same : same, name, "logits %s", same ? "unchanged" : "changed");
  }
  for (int d = 0; d < 3 && masked; d++) {
    Row alone = alone_row(&r0, d);
    Out o;
    if (!forward(e, logits, ce, &alone, &o))
      return;
    double worst = 0;
    for (int t = doc_start[d]; t < doc_start[d + 1]; t++) {
      double ref = base.ce[t], got = o.ce[t - doc_start[d]];
      worst = fmax(worst, fabs(ref - got) / fmax(1e-6, fabs(ref)));
    }
    snprintf(name, sizeof name, "packing %s %s%s: document %d's per-token losses packed = alone", model, e->name, how,
             d);
    CHECK(worst < 1e-5, name, "worst relative difference %.3g", worst);
    free(o.logits);
  }
  free(base.logits);
  free(pert.logits);
}

int main(void) {
  const char *models[] = {"models/gpt2-tiny.mdl", "models/llama-tiny.mdl"};
  for (int k = 0; k < 4 * 2; k++) {
    const char *model = models[k / 4];
    LowerOptions lo = {.plain_attention = k % 2, .no_doc_mask = k % 4 >= 2};
    const char *how = lo.plain_attention ? (lo.no_doc_mask ? ", plain attention, no doc mask" : ", plain attention")
                                         : (lo.no_doc_mask ? ", no doc mask" : "");
    Arena *a = arena_new();
    DimOverride ov[] = {{"B", 1}, {"T", T}};
    Graph *g = mdl_compile_file_with(a, model, ov, 2, &lo);
    char name[200];
    snprintf(name, sizeof name, "packing %s%s: the model compiles", model, how);
    CHECK(g != NULL, name, "see above");
    if (!g)
      continue;
    Engine *ie = engine_interp(g, INTERP_F32, 5);
    check_engine(model, how, ie, !lo.no_doc_mask);
    ie->free(ie);
    Fusion *f = fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true});
    MemPlan *m = memplan(f);
    char *src = emit_c(f, m, model);
    char err[512] = "";
    Engine *ce = src ? engine_cpu(f, m, src, 5, err, sizeof err) : NULL;
    snprintf(name, sizeof name, "packing %s%s: the forward graph compiles for the CPU", model, how);
    CHECK(ce != NULL, name, "%s", err);
    if (ce) {
      check_engine(model, how, ce, !lo.no_doc_mask);
      ce->free(ce);
    }
    arena_free(a);
  }
  TEST_EXIT();
}
