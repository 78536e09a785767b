// run.c: `mdlc run`: the data and the output folder checked, the engines opened (training, validation,
// the micro-batches of accumulation), then train_run; on --resume, the checkpoint's order of batches.
#include "driver.h"
#include "runtime.h"

#include <errno.h>
#include <unistd.h>

#include <limits.h>
#include <stdlib.h>
#include <string.h>

// OUT/run.json, one line: what the run compiled (`mdlc lab` reads it): the back end, the precision,
// the kernels a step (the plan's steps), the arena, the device memory the engines hold, the
// checkpoint line. Formatted in an arena, so a line of any length is written whole.
static bool write_run_json(const char *dir, const Graph *g, const Engine *e, const Engine *eval, const Engine *micro,
                           const char *checkpoint) {
  Arena *a = arena_new();
  const char *text[2] = {g->model ? g->model : "", checkpoint};
  char *esc[2];
  for (int i = 0; i < 2; i++) { // (JSON strings: a quote and a backslash escaped)
    char *q = esc[i] = arena_alloc(a, 2 * strlen(text[i]) + 1);
    for (const char *c = text[i]; *c; c++) {
      if (*c == '"' || *c == '\\')
        *q++ = '\\';
      *q++ = *c;
    }
    *q = 0;
  }
  int64_t device = e->device_bytes + (eval ? eval->device_bytes : 0) + (micro ? micro->device_bytes : 0);
  char *json = arena_printf(a, "{\"model\":\"%s\",\"backend\":\"%s\",\"precision\":\"%s\",\"kernels\":%d,"
                            "\"arena_bytes\":%lld,\"device_bytes\":%lld,\"checkpoint\":\"%s\"}\n", esc[0], e->name,
                            g->train.precision, e->fusion ? e->fusion->nsteps : 0, (long long)e->arena_bytes,
                            (long long)device, esc[1]);
  char *path = arena_printf(a, "%s/run.json", dir), err[600];
  bool ok = rt_write_atomic(path, json, strlen(json), err, sizeof err);
  if (!ok)
    fprintf(stderr, "%s: error: %s\n", path, err);
  arena_free(a);
  return ok;
}

// A run option that decides the batches, given on the command line with another value than the
// checkpoint it resumes records: refused, the option and both values named.
static bool order_conflict(const char *path, const char *flag, const char *key, const char *stored,
                           const char *theirs, const char *ours) {
  diag_file_error(path, "%s: this checkpoint was trained with %s (%s = %s), this run asks for %s; a resumed run "
                  "keeps the checkpoint's order of batches: leave %s out to continue it, or train anew in another "
                  "--out", flag, theirs, key, stored, ours, flag);
  return false;
}

// On --resume, the options that decide which batches each step trains on are the checkpoint's, as
// its dims are (it records them: mdl.seed, mdl.shuffle, mdl.pack, mdl.accumulate): one left off the
// command line takes the checkpoint's value, one given with another value is refused, since the run
// would go on with another order of batches and its losses no longer be an uninterrupted run's. A
// checkpoint written before they were recorded resumes with today's defaults (shuffled, packed, the
// train section's accumulation), with a warning. Before the model is compiled (the accumulation
// shapes the graph); false after saying why.
bool resume_batch_order(Options *o) {
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/checkpoint.safetensors", o->out ? o->out : "out");
  if (access(path, F_OK) != 0)
    return true; // (train_check_inputs says there is none to resume)
  Arena *a = arena_new();
  StFile f;
  CkptMeta meta;
  bool ok = st_read_header(a, path, &f) && ckpt_meta_read(a, path, &f, &meta);
  const char *seed = ok ? st_meta(&f, "mdl.seed") : NULL, *acc = ok ? st_meta(&f, "mdl.accumulate") : NULL;
  const char *taken = ""; // (the options taken from the checkpoint, as a command line gives them)
  if (ok && meta.has_seed) {
    if (o->seed_set && o->seed != meta.seed)
      ok = order_conflict(path, arena_printf(a, "--seed %llu", (unsigned long long)o->seed), "mdl.seed", seed,
                          arena_printf(a, "--seed %s", seed), arena_printf(a, "--seed %llu", (unsigned long long)o->seed));
    else if (!o->seed_set && meta.seed != o->seed)
      taken = arena_printf(a, "%s --seed %s", taken, seed);
    o->seed = meta.seed;
  }
  if (ok && meta.shuffle >= 0) {
    bool s = meta.shuffle;
    if (o->shuffle_set && (o->shuffle_set > 0) != s)
      ok = order_conflict(path, o->shuffle_set > 0 ? "--shuffle" : "--no-shuffle", "mdl.shuffle", s ? "true" : "false",
                          s ? "shuffled batches" : "batches in order", s ? "batches in order" : "shuffled batches");
    else if (!o->shuffle_set && s != o->shuffle)
      taken = arena_printf(a, "%s %s", taken, s ? "--shuffle" : "--no-shuffle");
    o->shuffle = s;
  }
  if (ok && meta.pack >= 0) {
    bool p = meta.pack;
    if (o->pack_set && p)
      ok = order_conflict(path, "--no-pack", "mdl.pack", "true", "packed rows", "padded rows");
    else if (!p && o->pack)
      taken = arena_printf(a, "%s --no-pack", taken);
    o->pack = p;
  }
  if (ok && meta.accumulate > 0) {
    int64_t k = meta.accumulate;
    if (o->accumulate > 0 && o->accumulate != k)
      ok = order_conflict(path, arena_printf(a, "--accumulate %lld", (long long)o->accumulate), "mdl.accumulate",
                          acc, arena_printf(a, "%s micro-batches a step", acc),
                          arena_printf(a, "%lld micro-batches a step", (long long)o->accumulate));
    else if (o->accumulate <= 0 && k > 1)
      taken = arena_printf(a, "%s --accumulate %s", taken, acc);
    o->accumulate = k;
  }
  if (ok && o->tokenize_on_the_fly && o->pack && o->shuffle) {
    diag_file_error(path, "this checkpoint was trained on shuffled packed rows (mdl.shuffle = true, mdl.pack = true), "
                    "which --tokenize-on-the-fly cannot draw (a shuffled window w starts at token w*T of the split): "
                    "resume it from the shards, without --tokenize-on-the-fly");
    ok = false;
  }
  if (ok && (meta.shuffle < 0 || meta.pack < 0 || meta.accumulate < 0))
    fprintf(stderr, "%s: warning: the checkpoint does not record its order of batches (written before checkpoints "
            "did): resuming with %s, %s rows and %s, as this command line says (today's defaults unless given)\n",
            path, o->shuffle ? "shuffled batches" : "batches in order", o->pack ? "packed" : "padded",
            o->accumulate > 0 ? arena_printf(a, "%lld micro-batches a step", (long long)o->accumulate)
                              : "the train section's accumulation");
  if (ok && *taken && !o->quiet)
    printf("resuming with the checkpoint's%s\n", taken);
  arena_free(a);
  return ok;
}

int cmd_run(const Options *o, Compilation *c) {
  Graph *g = c->g;
  if (!o->data) {
    diag_file_error(o->file, "run needs --data DIR: shards made by `mdlc prep TEXT -o DIR`, or arrays named as the "
                    "model's inputs (.npy, .npz, .safetensors)");
    return EXIT_USER;
  }
  char model_abs[PATH_MAX], data_abs[PATH_MAX], tok_path[PATH_MAX + 16], out_dir[PATH_MAX];
  if (!realpath(o->file, model_abs) || !realpath(o->data, data_abs)) {
    diag_file_error(realpath(o->file, model_abs) ? o->data : o->file, "cannot resolve the path: %s", strerror(errno));
    return EXIT_USER;
  }
  snprintf(tok_path, sizeof tok_path, "%s/tokenizer.bin", data_abs);
  snprintf(out_dir, sizeof out_dir, "%s", o->out ? o->out : "out");
  bool arrays = arrays_found(data_abs); // (else token shards)
  if (arrays && o->tokenize_on_the_fly) {
    diag_file_error(o->data, "--tokenize-on-the-fly reads the text token shards were made from; this is an array "
                    "dataset");
    return EXIT_USER;
  }
  if (o->tokenize_on_the_fly) { // (before anything is compiled or written: the loader checks again)
    Source src;
    bool same = source_read(data_abs, &src) && source_check(&src, data_abs);
    source_free(&src);
    if (!same)
      return EXIT_USER;
  }
  char ckpt_path[PATH_MAX + 32];
  snprintf(ckpt_path, sizeof ckpt_path, "%s/checkpoint.safetensors", out_dir);
  Tokenizer *tok = arrays ? NULL : o->resume ? train_resume_tokenizer(ckpt_path, tok_path) : tok_load(tok_path);
  if (!tok && !arrays)
    return EXIT_USER;
  char *tok_base64 = NULL; // (checkpoints store it)
  if (tok) {
    int vocab = tok_vocab(tok);
    size_t tok_n;
    unsigned char *tok_file = tok_bytes(tok, &tok_n);
    tok_base64 = rt_base64(tok_file, tok_n);
    free(tok_file);
    tok_free(tok);
    int64_t V = ir_dim(g, "V");
    if (V >= 0 && vocab > V) {
      diag_file_error(tok_path, "the data's tokenizer has %d tokens, more than the model's V = %lld: prepare the "
                      "data with --vocab %lld or run with -D V=%d", vocab, (long long)V, (long long)V, vocab);
      free(tok_base64);
      return EXIT_USER;
    }
  }
  bool created = false, lead = dist_env_rank() == 0; // (several ranks: rank 0 writes the run's files)
  int lock = lead ? train_claim_out(out_dir, o->resume, &created) : -1;
  if (lead && lock < 0) {
    free(tok_base64);
    return EXIT_USER;
  }
  if ((arrays && !arrays_check(data_abs, g, o->prep.val_fraction)) ||
      !train_check_inputs(g, model_abs, data_abs, out_dir, o->resume, o->tokenize_on_the_fly, o->weights)) {
    train_release_out(lock, out_dir, created);
    free(tok_base64);
    return EXIT_USER;
  }
  if (o->tokenize_on_the_fly && o->pack && !o->shuffle_set)
    printf("batches in order: packed rows read from the text cannot be shuffled (--no-pack shuffles them)\n");
  Engine *e = open_engine(o, c, true);
  if (!e) {
    train_release_out(lock, out_dir, created);
    free(tok_base64);
    return EXIT_USER;
  }
  Arena *ea = arena_new();
  Engine *eval = open_side_engine(o, ea, false);
  Engine *micro = g->train.accumulate > 1 ? open_side_engine(o, ea, true) : NULL;
  int rc = EXIT_USER;
  if (eval && (micro || g->train.accumulate <= 1) && (!o->weights || load_weights(e, g, o->weights))) {
    const char *why = NULL;
    if (g->train.precision_auto)
      auto_precision(o, &why);
    if (!o->quiet)
      printf("training %s (%lld parameters), back end %s%s%s%s, precision %s%s%s\n", g->model,
             (long long)ir_param_count(g), e->name,
             strcmp(backend_of(o), "interp") && !o->fuse.fuse ? " (fusion off)" : "",
             o->lower.plain_attention ? ", attention plain (scores in memory, unfused)" : "",
             o->lower.no_doc_mask ? ", no doc mask (documents attend to each other)" : "", why ? "auto, " : "",
             why ? why : g->train.precision, o->resume ? ", resuming" : "");
    char line[1024];
    if (!o->quiet && g->train.optimizer == OPT_MUON)
      print_muon_split(g);
    checkpoint_summary(&g->ckpt, true, true, line, sizeof line);
    if (!o->quiet)
      printf("%s\n", line);
    TrainOptions to = {.model_path = model_abs, .data_dir = data_abs, .tokenizer_path = arrays ? "" : tok_path,
                       .tokenizer_base64 = tok_base64, .out_dir = out_dir,
                       .steps = o->steps, .resume = o->resume, .pack = o->pack, .shuffle = o->shuffle,
                       .tokenize_on_the_fly = o->tokenize_on_the_fly,
                       .seed = o->seed, .val_every = o->val_every, .val_batches = o->val_batches,
                       .ckpt_every = o->ckpt_every, .skip_nonfinite = o->skip_nonfinite, .out_claimed = true,
                       .log_every = o->log_every, .quiet = o->quiet, .arrays = arrays, .zero = o->zero,
                       .val_fraction = o->prep.val_fraction};
    e->profile = o->profile && e->kernel_seconds;
    if (o->profile && !e->profile)
      printf("--profile: the %s back end runs op by op, with nothing to time by kernel; the compiled back ends "
             "(--backend cpu or cuda) have a profile\n", backend_of(o));
    // Several ranks: MPI starts now, after every engine is compiled (cc is not forked under MPI).
    char derr[512];
    if (!dist_init(derr, sizeof derr)) {
      diag_file_error(o->file, "%s", derr);
      rc = EXIT_USER;
    } else {
      if (dist_on() && lead)
        printf("data parallel: %d ranks (MPI), %d on this machine, OMP_NUM_THREADS=%s each; the global batch is "
               "%d x B%s\n", dist_size(), dist_local_size(), getenv("OMP_NUM_THREADS"), dist_size(),
               o->zero ? "; ZeRO stage 1: each rank keeps and updates the moments of its share of the parameters"
                       : "");
      rc = train_run(e, eval, micro, &to);
      if (dist_on() && rc == EXIT_USER) // (a rank's error: the others would wait for it)
        dist_abort(rc);
      dist_finalize();
    }
    created = false; // (what the run wrote stays)
    if (rc == 0 && lead)
      engine_profile_report(e, stdout);
    if (rc == 0 && lead && !write_run_json(out_dir, g, e, eval, micro, line))
      rc = EXIT_USER;
  }
  if (eval)
    eval->free(eval);
  if (micro)
    micro->free(micro);
  arena_free(ea);
  e->free(e);
  train_release_out(lock, out_dir, created);
  free(tok_base64);
  return rc;
}
