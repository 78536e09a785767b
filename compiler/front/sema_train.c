// sema_train.c: the train section: its lines sorted into free-dim bindings and settings, with --set
// and -D over them (step 2 of sema.c), the settings checked into g->train (step 3), and, once the
// graph is built, what its patterns say of each param (weight decay, freezing, lr scale, Muon).
#include "sema_impl.h"

#include <fnmatch.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

//
// Step 2: dims
//

static const char *const train_keys[] = {"optimizer", "schedule", "no_decay", "clip", "accumulate", "precision",
                                         "checkpoint", "lr_scale", "freeze", "muon_params", "amax_history"};

// The schedules' arguments (schedule_setting): `--set warmup=100` sets the schedule's, any other
// argument name the optimizer's.
static const char *const schedule_args[] = {"warmup", "min_lr", "steps", "decay"};

static bool is_train_key(const char *name) {
  for (size_t k = 0; k < sizeof train_keys / sizeof *train_keys; k++)
    if (!strcmp(train_keys[k], name))
      return true;
  return false;
}

// The train setting `key`, or NULL.
static Setting *find_setting(Sema *s, const char *key) {
  for (int i = 0; i < s->settings.n; i++)
    if (!strcmp(((Setting *)s->settings.v[i])->key, key))
      return s->settings.v[i];
  return NULL;
}

// A free dim's binding from the train section or --set (st); false when `name` is no dim.
static bool bind_dim(Sema *s, const Stmt *st, const char *where) {
  Sym *d = sema_find_in(&s->global, st->name);
  if (!d || d->kind != SYM_DIM)
    return false;
  if (d->decl->value) {
    if (sema_error(s, st->at, "'%s' is a fixed dim; only free dims (dim %s in LO..HI) are set %s", st->name, st->name,
                   where))
      diag_note(d->at, "'%s' is defined here", st->name);
  } else {
    d->bind = st->value;
  }
  return true;
}

// `--set KEY=VALUE` (st: KEY = VALUE parsed on its own) over the train section: a free dim's binding
// or a setting replaces the train section's; an argument of the optimizer or the schedule replaces
// or joins that call's keyword arguments (adamw and constant when the train section names none), so
// it is checked as though the train section said it.
static void apply_set(Sema *s, const Stmt *st) {
  if (bind_dim(s, st, "with --set"))
    return;
  if (is_train_key(st->name)) {
    Setting *set = find_setting(s, st->name);
    if (!set) {
      set = arena_alloc(s->a, sizeof *set);
      vec_push(s->a, &s->settings, set);
    }
    *set = (Setting){.key = st->name, .value = st->value, .at = st->at};
    return;
  }
  const char *key = "optimizer", *dflt = "adamw";
  for (size_t k = 0; k < sizeof schedule_args / sizeof *schedule_args; k++)
    if (!strcmp(schedule_args[k], st->name))
      key = "schedule", dflt = "constant";
  Setting *set = find_setting(s, key);
  if (!set) {
    Expr *name = arena_alloc(s->a, sizeof *name);
    *name = (Expr){.kind = E_NAME, .s = dflt, .at = st->at};
    set = arena_alloc(s->a, sizeof *set);
    *set = (Setting){.key = key, .value = name, .at = st->at};
    vec_push(s->a, &s->settings, set);
  }
  const Expr *old = set->value;
  if (old->kind != E_NAME && old->kind != E_CALL) { // (sema_train_config says what is wrong with it)
    sema_error(s, st->at, "--set %s: the %s setting is not a call to add '%s' to", st->name, key, st->name);
    return;
  }
  Expr *call = arena_alloc(s->a, sizeof *call);
  *call = *old;
  call->kind = E_CALL;
  int n = old->kind == E_CALL ? old->nargs : 0;
  call->args = arena_alloc(s->a, sizeof(Expr *) * (size_t)(n + 1));
  call->kw = arena_alloc(s->a, sizeof(char *) * (size_t)(n + 1));
  call->kw_at = arena_alloc(s->a, sizeof(SrcLoc) * (size_t)(n + 1));
  call->nargs = 0;
  for (int i = 0; i < n; i++)
    if (!old->kw[i] || strcmp(old->kw[i], st->name)) {
      call->args[call->nargs] = old->args[i];
      call->kw[call->nargs] = old->kw[i];
      call->kw_at[call->nargs++] = old->kw_at[i];
    }
  call->args[call->nargs] = st->value;
  call->kw[call->nargs] = st->name;
  call->kw_at[call->nargs++] = st->at;
  set->value = call;
}

// Step 2: sorts the train section into free-dim bindings and settings, applies --set and then -D
// over both, then evaluates every dim (filling g->dims) and every const, so each error shows even
// when unused.
void sema_bind_dims(Sema *s, const Stmt *train, const PtrVec *sets, const DimOverride *ov, int nov) {
  for (int i = 0; train && i < train->nbody; i++) {
    const Stmt *st = train->body[i];
    if (st->rejected)
      continue;
    bool seen = false;
    for (int k = 0; k < i && !seen; k++)
      if (!train->body[k]->rejected && !strcmp(train->body[k]->name, st->name)) {
        if (sema_error(s, st->at, "duplicate definition of '%s'", st->name))
          diag_note(train->body[k]->at, "previous definition is here");
        seen = true;
      }
    if (seen || bind_dim(s, st, "in the train section"))
      continue;
    if (!is_train_key(st->name)) {
      sema_error(s, st->at, "unknown train setting '%s' (settings: free dims, optimizer, schedule, no_decay, "
                          "lr_scale, freeze, muon_params, clip, accumulate, precision, amax_history, checkpoint)", st->name);
      continue;
    }
    Setting *set = arena_alloc(s->a, sizeof *set);
    *set = (Setting){.key = st->name, .value = st->value, .at = st->at};
    vec_push(s->a, &s->settings, set);
  }
  for (int i = 0; i < sets->n; i++)
    apply_set(s, sets->v[i]);
  for (int i = 0; i < nov; i++) {
    Sym *d = sema_find_in(&s->global, ov[i].name);
    if (!d || d->kind != SYM_DIM) {
      sema_error(s, (SrcLoc){.file = s->p->file}, "-D %s=%lld: the model has no dim '%s'", ov[i].name,
                 (long long)ov[i].value, ov[i].name);
      continue;
    }
    d->overridden = true;
    d->override = ov[i].value;
  }
  Graph *g = s->g;
  g->dims = arena_alloc(s->a, sizeof(DimBinding) * (size_t)(s->dims.n ? s->dims.n : 1));
  for (int i = 0; i < s->dims.n; i++) {
    Sym *d = s->dims.v[i];
    Val v = sema_sym_value(s, d, d->at), own = d->overridden && d->decl->value ? sema_eval(s, d->decl->value) : v;
    g->dims[g->ndims++] = (DimBinding){d->name, v.kind == V_INT ? v.i : 0, own.kind == V_INT ? own.i : 0};
  }
  for (int i = 0; i < s->consts.n; i++) {
    Sym *c = s->consts.v[i];
    sema_sym_value(s, c, c->at);
  }
}

//
// Step 3: the train section
//

// NAME or NAME(keyword=value, ...) in the train section; arg[k] as sema_bind_args.
static bool train_call(Sema *s, const Builtin *b, const Expr *e, const char *setting, const char *names,
                       const Expr **arg) {
  if (e->kind == E_NAME && !strcmp(e->s, b->name)) {
    for (int k = 0; k < 8; k++)
      arg[k] = NULL;
    return true;
  }
  if (e->kind == E_CALL && !strcmp(e->s, b->name))
    return sema_bind_args(s, b, e, arg);
  sema_error(s, e->at, "unknown %s '%s' (available: %s)", setting,
             e->kind == E_NAME || e->kind == E_CALL ? e->s : ast_text(s->a, e->at.text, e), names);
  return false;
}

// A setting whose value is one of a few bare words, such as `precision = bf16`.
static const char *word(Sema *s, const Expr *e, const char *setting, const char *const *choices, int n) {
  for (int i = 0; e->kind == E_NAME && i < n; i++)
    if (!strcmp(e->s, choices[i]))
      return choices[i];
  char list[128] = "";
  for (int i = 0; i < n; i++)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? (i + 1 < n ? ", " : " or ") : "", choices[i]);
  sema_error(s, e->at, "unknown %s '%s' (expected %s)", setting, ast_text(s->a, e->at.text, e), list);
  return NULL;
}

static void checkpoint_setting(Sema *s, const Expr *e, TrainConfig *t) {
  static const char *const modes[] = {"none", "all", "auto"};
  if (e->kind == E_CALL && !strcmp(e->s, "auto")) {
    static const Builtin b = {"auto", 1, 1, {"budget"}, NULL, OP_COUNT, NULL, NULL};
    const Expr *arg[BUILTIN_PARAMS];
    if (!sema_bind_args(s, &b, e, arg))
      return;
    if (arg[0]->kind == E_FLOAT && arg[0]->f > 0 && arg[0]->f <= 1) { // a fraction of the memory there is
      t->checkpoint = arena_printf(s->a, "auto=%s", ast_text(s->a, arg[0]->at.text, arg[0]));
      t->checkpoint_at = e->at;
      return;
    }
    if (arg[0]->kind != E_SIZE || strtod(arg[0]->s, NULL) <= 0) {
      sema_error(s, arg[0]->at, "checkpoint budget must be a positive size such as 2GiB, or a fraction of the memory "
                 "such as 0.5");
      return;
    }
    t->checkpoint = arena_printf(s->a, "auto=%s", arg[0]->s);
    t->checkpoint_at = e->at;
    return;
  }
  const char *w = word(s, e, "checkpoint mode", modes, 3);
  if (w) {
    t->checkpoint = w;
    t->checkpoint_at = e->at;
  }
}

// schedule = constant | linear | cosine | wsd, each NAME or NAME(warmup=, ...): runtime/train/schedule.c.
static void schedule_setting(Sema *s, const Expr *e, TrainConfig *t) {
  static const Builtin kinds[] = {{"constant", 0, 0, {"warmup"}, NULL, OP_COUNT, NULL, NULL},
                                  {"linear", 0, 0, {"warmup", "min_lr", "steps"}, NULL, OP_COUNT, NULL, NULL},
                                  {"cosine", 0, 0, {"warmup", "min_lr", "steps"}, NULL, OP_COUNT, NULL, NULL},
                                  {"wsd", 0, 0, {"warmup", "decay", "min_lr", "steps"}, NULL, OP_COUNT, NULL, NULL}};
  static const Schedule kind_of[] = {SCHED_CONSTANT, SCHED_LINEAR, SCHED_COSINE, SCHED_WSD};
  int k = 2; // (an unknown name: the error lists them all)
  for (int i = 0; i < 4; i++)
    if ((e->kind == E_NAME || e->kind == E_CALL) && !strcmp(e->s, kinds[i].name))
      k = i;
  const Builtin *b = &kinds[k];
  const Expr *arg[BUILTIN_PARAMS];
  if (!train_call(s, b, e, "schedule", "constant, linear, cosine or wsd", arg))
    return;
  t->schedule = kind_of[k];
  double x;
  for (int i = 0; i < 4 && b->params[i]; i++) {
    const char *p = b->params[i];
    if (!arg[i])
      continue;
    if (!strcmp(p, "warmup") && sema_number(s, arg[i], p, R_NONNEG, true, &x))
      t->warmup = (int64_t)x;
    else if (!strcmp(p, "min_lr") && sema_number(s, arg[i], p, R_NONNEG, false, &x))
      t->min_lr = x;
    else if (!strcmp(p, "steps") && sema_number(s, arg[i], p, R_NONNEG, true, &x))
      t->steps = (int64_t)x;
    else if (!strcmp(p, "decay") && sema_number(s, arg[i], p, R_POSITIVE, false, &x)) {
      if (x >= 1 && x != floor(x))
        sema_error(s, arg[i]->at, "decay must be a number of steps (an integer) or a fraction of the steps below 1, "
                   "got %g", x);
      else
        t->decay = x;
    }
  }
  if (t->schedule == SCHED_WSD && !arg[1])
    t->decay = 0.2;
}

// optimizer = adamw | sgd | lion | muon, each NAME or NAME(keyword=value, ...); the rules are
// docs/language.md's and interp.c's. Defaults as their reference implementations have them: AdamW's
// in ir_new, SGD torch.optim.SGD's (lr 1e-3, no momentum), Lion the paper's (lr 1e-4, betas 0.9 and
// 0.99), Muon Keller Jordan's SingleDeviceMuonWithAuxAdam's (lr 0.02, momentum 0.95, Nesterov; the
// AdamW of the other params at adam_lr 3e-4, betas 0.9 and 0.95, eps 1e-10), weight decay 0.
static void optimizer_setting(Sema *s, const Expr *e, TrainConfig *t) {
  static const Builtin kinds[] = {
      {"adamw", 0, 0, {"lr", "beta1", "beta2", "eps", "weight_decay"}, NULL, OP_COUNT, NULL, NULL},
      {"sgd", 0, 0, {"lr", "momentum", "nesterov", "weight_decay"}, NULL, OP_COUNT, NULL, NULL},
      {"lion", 0, 0, {"lr", "beta1", "beta2", "weight_decay"}, NULL, OP_COUNT, NULL, NULL},
      {"muon", 0, 0, {"lr", "momentum", "nesterov", "weight_decay", "adam_lr", "beta1", "beta2", "eps"}, NULL, OP_COUNT,
       NULL, NULL}};
  int k = 0; // (an unknown name: the error lists them all)
  for (int i = 0; i < 4; i++)
    if ((e->kind == E_NAME || e->kind == E_CALL) && !strcmp(e->s, kinds[i].name))
      k = i;
  const Builtin *b = &kinds[k];
  const Expr *arg[BUILTIN_PARAMS];
  if (!train_call(s, b, e, "optimizer", "adamw, sgd, lion or muon", arg))
    return;
  static const OptRule rule_of[] = {OPT_ADAMW, OPT_SGD, OPT_LION, OPT_MUON};
  t->optimizer = rule_of[k];
  if (t->optimizer == OPT_SGD)
    t->lr = 1e-3;
  else if (t->optimizer == OPT_LION)
    t->lr = 1e-4, t->beta2 = 0.99;
  else if (t->optimizer == OPT_MUON)
    t->lr = 0.02, t->adam_lr = 3e-4, t->momentum = 0.95, t->nesterov = true, t->eps = 1e-10;
  double x;
  for (int i = 0; i < 8 && b->params[i]; i++) {
    const char *p = b->params[i];
    if (!arg[i])
      continue;
    if (!strcmp(p, "nesterov")) {
      if (arg[i]->kind != E_BOOL)
        sema_error(s, arg[i]->at, "nesterov must be true or false, got %s", ast_text(s->a, s->p->text, arg[i]));
      else
        t->nesterov = arg[i]->i != 0;
      continue;
    }
    Range r = !strcmp(p, "lr") || !strcmp(p, "eps") || !strcmp(p, "adam_lr") ? R_POSITIVE
              : !strcmp(p, "weight_decay") ? R_NONNEG : R_UNIT;
    if (!sema_number(s, arg[i], p, r, false, &x))
      continue;
    double *dst = !strcmp(p, "lr") ? &t->lr : !strcmp(p, "adam_lr") ? &t->adam_lr
                  : !strcmp(p, "beta1") ? &t->beta1 : !strcmp(p, "beta2") ? &t->beta2 : !strcmp(p, "eps") ? &t->eps
                  : !strcmp(p, "momentum") ? &t->momentum : &t->weight_decay;
    if (!strcmp(p, "adam_lr") && !(x > 0))
      sema_error(s, arg[i]->at, "adam_lr must be positive, got %g", x);
    else
      *dst = x;
  }
  if (t->optimizer == OPT_SGD && t->nesterov && !(t->momentum > 0))
    sema_error(s, arg[2]->at, "nesterov needs a momentum above 0 (sgd(momentum=0.9, nesterov=true))");
}

// A list of name patterns (no_decay, freeze) into v; false after an error.
static bool patterns(Sema *s, const Expr *e, const char *setting, const char *example, PtrVec *v, bool exprs) {
  bool ok = e->kind == E_LIST;
  for (int k = 0; ok && k < e->nargs; k++)
    ok = e->args[k]->kind == E_STRING;
  if (!ok) {
    sema_error(s, e->at, "%s must be a list of name patterns such as %s", setting, example);
    return false;
  }
  for (int k = 0; k < e->nargs; k++)
    vec_push(s->a, v, exprs ? (void *)e->args[k] : (void *)e->args[k]->s);
  return true;
}

// lr_scale = {"pattern": multiplier, ...}: each a positive number.
static void lr_scale_setting(Sema *s, const Expr *e) {
  if (e->kind != E_DICT) {
    sema_error(s, e->at, "lr_scale must be a table of name patterns and multipliers such as {\"wte\": 0.1}");
    return;
  }
  s->lr_scales = arena_alloc(s->a, sizeof(double) * (size_t)(e->nargs / 2 + 1));
  for (int k = 0; k + 1 < e->nargs; k += 2) {
    const Expr *key = e->args[k];
    double x;
    if (key->kind != E_STRING) {
      sema_error(s, key->at, "an lr_scale key must be a name pattern in quotes such as \"wte\", got %s",
                 ast_text(s->a, s->p->text, key));
      continue;
    }
    if (!sema_number(s, e->args[k + 1], "an lr_scale multiplier", R_POSITIVE, false, &x))
      continue;
    s->lr_scales[s->lr_scale.n] = x;
    vec_push(s->a, &s->lr_scale, (void *)key);
  }
}

void sema_train_config(Sema *s) {
  TrainConfig *t = &s->g->train;
  for (int i = 0; i < s->settings.n; i++) {
    const Setting *set = s->settings.v[i];
    const Expr *e = set->value;
    double x;
    if (!strcmp(set->key, "optimizer")) {
      optimizer_setting(s, e, t);
    } else if (!strcmp(set->key, "lr_scale")) {
      lr_scale_setting(s, e);
    } else if (!strcmp(set->key, "freeze")) {
      patterns(s, e, "freeze", "[\"wte\", \"h.0.*\"]", &s->freeze, true);
    } else if (!strcmp(set->key, "muon_params")) {
      if (patterns(s, e, "muon_params", "[\"h.*.attn_w\", \"h.*.mlp*_w\"]", &s->muon_params, true))
        s->muon_params_at = set->at;
    } else if (!strcmp(set->key, "schedule")) {
      schedule_setting(s, e, t);
    } else if (!strcmp(set->key, "no_decay")) {
      patterns(s, e, "no_decay", "[\"*_b\", \"ln*\"]", &s->no_decay, true);
    } else if (!strcmp(set->key, "clip")) {
      if (sema_number(s, e, "clip", R_NONNEG, false, &x))
        t->clip = x;
    } else if (!strcmp(set->key, "accumulate")) {
      if (!sema_number(s, e, "accumulate", R_POSITIVE, true, &x))
        continue;
      if (x > 1048576) // (as --accumulate and a checkpoint's mdl.accumulate)
        sema_error(s, e->at, "accumulate must be at most 1048576 micro-batches a step, got %g", x);
      else
        t->accumulate = (int64_t)x;
    } else if (!strcmp(set->key, "amax_history")) { // (fp8: the steps each tensor's scale looks back on)
      if (!sema_number(s, e, "amax_history", R_POSITIVE, true, &x))
        continue;
      if (x > 1024)
        sema_error(s, e->at, "amax_history must be at most 1024 steps, got %g", x);
      else
        t->amax_history = (int64_t)x;
    } else if (!strcmp(set->key, "precision")) {
      static const char *const precisions[] = {"auto", "fp32", "bf16", "fp8"};
      const char *w = word(s, e, "precision", precisions, 4);
      if (w) {
        t->precision = w;
        t->precision_at = e->at;
      }
    } else {
      checkpoint_setting(s, e, t);
    }
  }
}

// Weight decay applies to every param no no_decay pattern matches and that is not frozen; a frozen
// param matches a freeze pattern; a param's lr_scale is the last lr_scale pattern's that matches it
// (1 where none does). A no_decay, freeze or lr_scale pattern that matches no param is an error (a
// misspelt name would otherwise leave the run quietly training what it meant to hold, or decaying
// what it meant to spare).
void sema_set_decay(Sema *s) {
  Graph *g = s->g;
  for (int i = 0; i < g->nparams; i++) {
    IrNode *p = node(s, g->params[i]);
    for (int k = 0; k < s->no_decay.n; k++)
      if (fnmatch(((const Expr *)s->no_decay.v[k])->s, p->name, 0) == 0)
        p->init.decay = false;
    for (int k = 0; k < s->freeze.n; k++)
      if (fnmatch(((const Expr *)s->freeze.v[k])->s, p->name, 0) == 0)
        p->init.frozen = true, p->init.decay = false;
    for (int k = 0; k < s->lr_scale.n; k++)
      if (fnmatch(((const Expr *)s->lr_scale.v[k])->s, p->name, 0) == 0)
        p->init.lr_scale = s->lr_scales[k];
  }
  static const char *const what[3] = {"no_decay", "freeze", "lr_scale"};
  for (int w = 0; w < 3; w++) {
    const PtrVec *v = w == 2 ? &s->lr_scale : w ? &s->freeze : &s->no_decay;
    for (int k = 0; k < v->n; k++) {
      const Expr *pat = v->v[k];
      bool hit = false;
      for (int i = 0; i < g->nparams && !hit; i++)
        hit = fnmatch(pat->s, node(s, g->params[i])->name, 0) == 0;
      if (!hit)
        sema_error(s, pat->at, "%s pattern \"%s\" matches no param", what[w], pat->s);
    }
  }
  int frozen = 0;
  for (int i = 0; i < g->nparams; i++)
    frozen += node(s, g->params[i])->init.frozen;
  if (s->freeze.n && frozen == g->nparams)
    sema_error(s, ((const Expr *)s->freeze.v[0])->at, "freeze leaves no param to train: all %d are frozen", frozen);
}

// A param read by the MATMUL that makes a cross-entropy's logits (through layout, casts and
// elementwise ops such as a bias): the LM head. head[id] is set for each.
static void mark_heads(Sema *s, bool *head) {
  Graph *g = s->g;
  bool *seen = arena_alloc(s->a, (size_t)(g->n ? g->n : 1));
  int *stack = arena_alloc(s->a, sizeof(int) * (size_t)(g->n ? g->n : 1)), top = 0;
  for (int i = 0; i < g->n; i++)
    if (node(s, i)->op == OP_CROSS_ENTROPY && !seen[node(s, i)->in[0]])
      seen[stack[top++] = node(s, i)->in[0]] = true;
  while (top > 0) {
    const IrNode *n = node(s, stack[--top]);
    bool through = n->op == OP_RESHAPE || n->op == OP_PERMUTE || n->op == OP_CAST || n->op == OP_BROADCAST ||
                   n->op == OP_ADD || n->op == OP_SUB || n->op == OP_MUL || n->op == OP_DIV || n->op == OP_NEG;
    for (int k = 0; (through || n->op == OP_MATMUL) && k < n->nin; k++) {
      int x = n->in[k];
      while (n->op == OP_MATMUL && (node(s, x)->op == OP_RESHAPE || node(s, x)->op == OP_PERMUTE ||
                                    node(s, x)->op == OP_CAST))
        x = node(s, x)->in[0];
      if (n->op == OP_MATMUL) {
        if (node(s, x)->op == OP_PARAM)
          head[x] = true;
      } else if (!seen[x]) {
        seen[stack[top++] = x] = true;
      }
    }
  }
}

// optimizer = muon: which params Muon updates. By default the hidden matrices: every 2-D param that is
// neither an embedding table (read by embed) nor the LM head (mark_heads); with muon_params, the 2-D
// params its patterns match (one matching no param, or a param that is not 2-D, is an error). The
// rest, and every frozen param, take AdamW.
void sema_set_muon(Sema *s) {
  Graph *g = s->g;
  if (s->muon_params_at.line && g->train.optimizer != OPT_MUON) {
    sema_error(s, s->muon_params_at, "muon_params says which params Muon updates: it needs optimizer = muon");
    return;
  }
  if (g->train.optimizer != OPT_MUON)
    return;
  bool *head = arena_alloc(s->a, (size_t)(g->n ? g->n : 1)), *table = arena_alloc(s->a, (size_t)(g->n ? g->n : 1));
  mark_heads(s, head);
  for (int i = 0; i < g->n; i++)
    if (node(s, i)->op == OP_EMBED)
      table[node(s, i)->in[0]] = true;
  for (int i = 0; i < g->nparams; i++) {
    IrNode *p = node(s, g->params[i]);
    bool pick = p->shape.rank == 2 && !table[p->id] && !head[p->id];
    if (s->muon_params.n) {
      pick = false;
      for (int k = 0; k < s->muon_params.n; k++) {
        const Expr *pat = s->muon_params.v[k];
        if (fnmatch(pat->s, p->name, 0) != 0)
          continue;
        if (p->shape.rank != 2)
          sema_error(s, pat->at, "muon_params pattern \"%s\" matches '%s' of shape %s: Muon updates matrices (2-D) "
                     "only", pat->s, p->name, sema_shape_text(s, p->shape));
        pick = true;
      }
    }
    p->init.muon = pick && !p->init.frozen;
  }
  for (int k = 0; k < s->muon_params.n; k++) {
    const Expr *pat = s->muon_params.v[k];
    bool hit = false;
    for (int i = 0; i < g->nparams && !hit; i++)
      hit = fnmatch(pat->s, node(s, g->params[i])->name, 0) == 0;
    if (!hit)
      sema_error(s, pat->at, "muon_params pattern \"%s\" matches no param", pat->s);
  }
}
