// verbs.c: mdlc's verbs but run, lab and sample (run.c, lab_measure.c, sampling.c): check, init, grad,
// build and eval, each given what the pipeline compiled for it (eval compiles a checkpoint's model).
#include "backend.h"
#include "driver.h"
#include "emit_cuda.h"
#include "runtime.h"

#include <errno.h>
#include <sys/stat.h>

#include <stdlib.h>
#include <string.h>

// optimizer = muon: which params Muon updates and which AdamW (sema_train.c's sema_set_muon), in one line.
void print_muon_split(const Graph *g) {
  int nm = 0, na = 0;
  for (int i = 0; i < g->nparams; i++) {
    const ParamInit *pi = &g->nodes[g->params[i]]->init;
    nm += !pi->frozen && pi->muon;
    na += !pi->frozen && !pi->muon;
  }
  printf("optimizer muon: Muon for %d hidden matri%s:", nm, nm == 1 ? "x" : "ces");
  for (int i = 0, k = 0; i < g->nparams; i++)
    if (g->nodes[g->params[i]]->init.muon && !g->nodes[g->params[i]]->init.frozen && k++ < 8)
      printf(" %s", g->nodes[g->params[i]]->name);
  printf("%s; AdamW for the other %d params\n", nm > 8 ? " ..." : "", na);
}

int cmd_check(const Options *o, Compilation *c) {
  (void)o; // (what check prints depends on the graph alone)
  const Graph *g = c->g;
  char buf[128];
  printf("model %s: %lld parameters in %d tensors\n", g->model ? g->model : "?", (long long)ir_param_count(g),
         g->nparams);
  printf("dims:");
  for (int i = 0; i < g->ndims; i++)
    printf(" %s=%lld", g->dims[i].name, (long long)g->dims[i].value);
  printf("\n");
  for (int i = 0; i < g->fwd_end; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op == OP_INPUT)
      printf("input  %-24s %s%s\n", n->name, dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf));
  }
  for (int i = 0; i < g->nparams; i++) {
    const IrNode *n = g->nodes[g->params[i]];
    char scale[48] = "";
    if (n->init.lr_scale > 0 && n->init.lr_scale != 1 && !n->init.frozen)
      snprintf(scale, sizeof scale, "  (lr x %g)", n->init.lr_scale);
    printf("param  %-24s %s%s%s%s%s\n", n->name, dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf),
           n->init.frozen ? "  (frozen)" : n->init.decay ? "" : "  (no weight decay)", scale,
           g->train.optimizer != OPT_MUON || n->init.frozen ? "" : n->init.muon ? "  (muon)" : "  (adamw)");
  }
  if (g->train.optimizer == OPT_MUON)
    print_muon_split(g);
  for (int i = 0; i < g->noutputs; i++) {
    const IrNode *n = g->nodes[g->outputs[i]];
    printf("output %-24s %s%s\n", n->name ? n->name : "?", dtype_name(n->dtype), shape_str(n->shape, buf, sizeof buf));
  }
  return 0;
}

// Copies every parameter from a safetensors file; names and shapes must match the model.
bool load_weights_from(Engine *e, const Graph *g, const StFile *f, const char *path) {
  for (int i = 0; i < g->nparams; i++) {
    const StTensor *t = st_expect(f, path, "", g->nodes[g->params[i]]);
    if (!t)
      return false;
    e->write(e, g->params[i], t->data);
  }
  return true;
}

bool load_weights(Engine *e, const Graph *g, const char *path) {
  Arena *a = arena_new();
  StFile f;
  bool ok = st_read(a, path, &f) && load_weights_from(e, g, &f, path);
  arena_free(a);
  return ok;
}

// Writes the values of `count` nodes, as f32, under the given names.
static bool write_values(const char *path, Engine *e, const int *nodes, const char **names, int count) {
  StTensor *t = xmalloc((size_t)count * sizeof *t, "the tensors to write");
  for (int i = 0; i < count; i++) {
    const IrNode *n = e->g->nodes[nodes[i]];
    int64_t numel = shape_numel(n->shape);
    float *d = xmalloc(sizeof(float) * (size_t)numel, "a tensor to write");
    e->read(e, n->id, d);
    t[i] = (StTensor){.name = names[i], .dtype = DT_F32, .shape = n->shape, .data = d};
  }
  bool ok = st_write(path, t, count);
  for (int i = 0; i < count; i++)
    free(t[i].data);
  free(t);
  return ok;
}

static bool write_params(const char *path, Engine *e) {
  const Graph *g = e->g;
  const char **names = xcalloc((size_t)g->nparams, sizeof *names, "the parameters' names");
  for (int i = 0; i < g->nparams; i++)
    names[i] = g->nodes[g->params[i]]->name;
  bool ok = write_values(path, e, g->params, names, g->nparams);
  free(names);
  return ok;
}

int cmd_init(const Options *o, Compilation *c) {
  Graph *g = c->g;
  if (!o->out)
    return usage_error("init needs -o W.safetensors%s", "");
  Engine *e = engine_interp(g, INTERP_F32, o->seed);
  bool ok = write_params(o->out, e);
  e->free(e);
  if (ok)
    printf("wrote %d parameters (%lld values, seed %llu) to %s\n", g->nparams, (long long)ir_param_count(g),
           (unsigned long long)o->seed, o->out);
  return ok ? 0 : EXIT_USER;
}

// Sets every model input from a batch file (i32 or f32 tensors named as the inputs).
static bool load_batch(Engine *e, const Graph *g, const char *path) {
  Arena *a = arena_new();
  StFile f;
  bool ok = st_read(a, path, &f);
  for (int i = 0; ok && i < g->fwd_end; i++) {
    const IrNode *n = g->nodes[i];
    if (n->op != OP_INPUT)
      continue;
    const StTensor *t = st_expect(&f, path, "", n);
    if (!t) {
      ok = false;
    } else if (!e->set_input(e, n->name, n->dtype == DT_I32 ? t->data : NULL, n->dtype == DT_F32 ? t->data : NULL,
                             shape_numel(n->shape))) {
      diag_file_error(path, "cannot set input '%s'", n->name);
      ok = false;
    }
  }
  arena_free(a);
  return ok;
}

int cmd_grad(const Options *o, Compilation *c) {
  Graph *g = c->g;
  if (!o->out || !o->weights || !o->batch)
    return usage_error("grad needs --weights W --batch BATCH -o OUT%s", "");
  Engine *e = open_engine(o, c, false);
  if (!e)
    return EXIT_USER;
  char err[512];
  int rc = EXIT_USER;
  if (load_weights(e, g, o->weights) && load_batch(e, g, o->batch)) {
    if (!e->step(e, err, sizeof err)) {
      diag_file_error(o->file, "%s", err);
    } else {
      int count = 1;
      int *nodes = xcalloc((size_t)g->nparams + 1, sizeof *nodes, "the gradients' list");
      const char **names = xcalloc((size_t)g->nparams + 1, sizeof *names, "the gradients' list");
      nodes[0] = g->loss;
      names[0] = "loss";
      for (int i = 0; i < g->nparams; i++)
        if (g->grads[i] >= 0) { // (a frozen parameter has none)
          nodes[count] = g->grads[i];
          names[count++] = g->nodes[g->params[i]]->name;
        }
      if (write_values(o->out, e, nodes, names, count)) {
        printf("loss %.6f; wrote the loss and %d gradients to %s (%s)\n", engine_scalar(e, g->loss), count - 1,
               o->out, e->name);
        rc = 0;
      }
      free(nodes);
      free(names);
    }
  }
  e->free(e);
  return rc;
}

// Writes DIR/model.c, DIR/model.cu, DIR/plan.txt (fusion and memory plan) and DIR/fusion.txt.
int cmd_build(const Options *o, Compilation *c) {
  const Graph *g = c->g;
  if (!o->out)
    return usage_error("build needs -o DIR%s", "");
  if (mkdir(o->out, 0777) && errno != EEXIST) {
    diag_file_error(o->out, "cannot create the directory: %s", strerror(errno));
    return EXIT_USER;
  }
  FuseOptions fo_off = o->fuse; // (the fusion report's other column)
  fo_off.fuse = false;
  Fusion *off = fuse(c->g, fo_off);
  MemPlan *moff = memplan(off);
  char path[4096];
  struct {
    const char *name;
    int what;
  } files[] = {{"model.c", 0}, {"model.cu", 3}, {"plan.txt", 1}, {"fusion.txt", 2}};
  for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
    snprintf(path, sizeof path, "%s/%s", o->out, files[i].name);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
      diag_file_error(tmp, "cannot write: %s", strerror(errno));
      return EXIT_USER;
    }
    if (files[i].what == 0)
      fputs(c->c_source, f);
    else if (files[i].what == 3)
      fputs(c->cuda->source, f);
    else if (files[i].what == 1) {
      fuse_dump(c->f, f);
      fputc('\n', f);
      memplan_dump(c->f, c->m, f);
    } else
      fusion_report(c->f, off, c->m, moff, f);
    if (fclose(f) || rename(tmp, path)) {
      diag_file_error(path, "cannot write: %s", strerror(errno));
      return EXIT_USER;
    }
  }
  printf("%s: %d kernels (%d unfused), arena %.2f MB (activations %.2f MB) -> %s/{model.c,model.cu,plan.txt,fusion.txt}\n",
         g->model, c->f->nsteps, off->nsteps, (double)c->m->arena_bytes / 1e6, (double)c->m->activation_bytes / 1e6,
         o->out);
  char line[1024];
  checkpoint_summary(&g->ckpt, true, true, line, sizeof line);
  printf("%s\n", line);
  return 0;
}

// `mdlc eval CHECKPOINT --data DIR`: the checkpoint's model (the .mdl text it stores, else the file
// it names, as sample reads it; its dims as recorded, -D overriding them) compiled forward only as run
// compiles its validation, the parameters from the checkpoint, over the validation batches the run
// validated on (train_eval; the run's seed, and its shuffling and packing where the checkpoint records
// them and the command line does not say).
int cmd_eval(const Options *o) {
  if (!o->data) {
    diag_file_error(o->file, "eval needs --data DIR: the shards made by `mdlc prep`, or the arrays, to validate on");
    return EXIT_USER;
  }
  Arena *a = arena_new();
  StFile f;
  CheckpointModel m;
  CkptMeta meta;
  int rc = EXIT_USER;
  bool ok = st_read(a, o->file, &f) && checkpoint_model(a, o->file, &f, &m) && ckpt_meta_read(a, o->file, &f, &meta);
  if (ok) {
    Options q = *o;
    q.file = m.source;
    q.text = checkpoint_model_text(a, o->file, &m, "evaluating");
    q.ndims = 0;
    for (int i = 0; i < m.ndims + o->ndims; i++) {
      DimOverride d = i < m.ndims ? m.dims[i] : o->dims[i - m.ndims];
      int k = 0;
      while (k < q.ndims && strcmp(q.dims[k].name, d.name))
        k++;
      if (k == 32) {
        diag_file_error(o->file, "the checkpoint's model has more than 32 dims");
        arena_free(a);
        return EXIT_USER;
      }
      q.dims[k] = d;
      q.ndims += k == q.ndims;
    }
    q.seed = meta.has_seed ? meta.seed : o->seed;
    if (meta.shuffle >= 0 && !o->shuffle_set) // (the run's order of batches, as recorded, unless given)
      q.shuffle = meta.shuffle;
    if (meta.pack >= 0 && !o->pack_set)
      q.pack = meta.pack;
    // (the front end alone first: every parameter's shape is the checkpoint's before any is allocated)
    Graph *g = q.text ? mdl_compile_text_with(a, q.file, q.text, q.dims, q.ndims, &q.lower)
                      : mdl_compile_file_with(a, q.file, q.dims, q.ndims, &q.lower);
    const char *prefix = arena_printf(a, "checkpoint does not match %s: ", m.source);
    for (int k = 0; g && k < g->nparams; k++)
      if (!st_expect(&f, o->file, prefix, g->nodes[g->params[k]]))
        g = NULL;
    if (g)
      checkpoint_dims_note(o->file, &m, g, "evaluating");
    Engine *e = g ? open_side_engine(&q, a, false) : NULL;
    if (e && load_weights_from(e, e->g, &f, o->file)) {
      printf("evaluating %s (step %s of %s), back end %s, precision %s\n", o->file,
             meta.step >= 0 ? arena_printf(a, "%lld", (long long)meta.step) : "?", m.source, e->name,
             e->g->train.precision);
      TrainOptions to = {.model_path = m.source, .data_dir = o->data, .pack = q.pack, .shuffle = q.shuffle,
                         .seed = q.seed, .val_batches = o->val_batches, .arrays = arrays_found(o->data),
                         .val_fraction = o->prep.val_fraction};
      rc = train_eval(e, &to) ? EXIT_USER : 0;
    }
    if (e)
      e->free(e);
  }
  arena_free(a);
  return rc;
}
