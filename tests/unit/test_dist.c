// Data-parallel pieces that need no second process (tests/cli/dist.sh runs mpirun): what the launcher's
// environment says, the gradients a rank all-reduces (engine_grad_ranges: exactly what the optimizer
// reads, with and without gradient accumulation), ZeRO's shards, and that NCCL, the GPUs' all-reduce, loads and
// resolves where the CUDA toolkit has it.
#include "runtime.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void test_environment(void) {
  const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK",
                        "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
                        "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++)
    unsetenv(vars[i]);
  CHECK(!dist_launched() && dist_rank() == 0 && dist_size() == 1 && dist_env_local_size() == 1,
        "alone: no launcher, a world of one", "launched %d rank %d size %d", dist_launched(), dist_rank(), dist_size());
  setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  CHECK(!dist_launched(), "mpirun -np 1 is a world of one (MPI is not loaded)", "launched");
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  CHECK(dist_launched() && dist_rank() == 3 && dist_size() == 4 && dist_env_local_size() == 2 &&
            dist_local_rank() == 1 && !dist_on(),
        "under mpirun, before MPI starts: rank, size and the place on the machine from Open MPI's environment",
        "rank %d size %d local %d of %d", dist_rank(), dist_size(), dist_local_rank(), dist_env_local_size());
  for (size_t i = 0; i < 4; i++)
    unsetenv(vars[i]);
  setenv("SLURM_NTASKS", "8", 1);
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_LOCALID", "1", 1);
  CHECK(dist_launched() && dist_rank() == 5 && dist_size() == 8 && dist_local_rank() == 1,
        "under srun: the same from Slurm's", "rank %d size %d local %d", dist_rank(), dist_size(), dist_local_rank());
  unsetenv("SLURM_NTASKS");
  unsetenv("SLURM_PROCID");
  unsetenv("SLURM_LOCALID");
}

// The ranges of engine_grad_ranges for `model` (B=2, and T=16 but for the MLP) with `accumulate` micro-batches a
// step: every gradient the norm reads lies wholly in one range, reduced after the step that writes it
// and before every other step that reads it; the ranges of one step do not overlap, and what they
// cover beyond the gradients is the flat buffer's padding only. Returns the number of ranges (-1: none).
// With bucket > 0 the buckets instead: besides, each starts after every step that writes one of its
// gradients and ends before its reader, no two overlap, none is larger than `bucket` but for one
// gradient alone, and *readies counts the distinct steps after which one can start.
static int ranges_of(const char *model, const char *optimizer, int64_t accumulate, int64_t bucket, int64_t *flat_at,
                     int *readies) {
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  const char *set[] = {optimizer};
  LowerOptions lo = {.settings = set, .nsettings = optimizer ? 1 : 0};
  Graph *g = mdl_compile_file_with(a, model, ov, strstr(model, "mlp") ? 1 : 2, &lo);
  if (g)
    g->train.accumulate = accumulate;
  bool ok = g && autodiff(g, true);
  Fusion *f = ok ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true, .max_group = 64}) : NULL;
  MemPlan *m = f ? memplan(f) : NULL;
  int n = 0;
  GradRange *r = m ? engine_grad_ranges(f, m, bucket, &n) : NULL;
  const IrNode *norm = NULL;
  for (int i = 0; g && i < g->n && !norm; i++)
    norm = g->nodes[i]->op == OP_GRAD_NORM ? g->nodes[i] : NULL;
  bool good = r && norm;
  int64_t grad_bytes = 0, range_bytes = 0;
  for (int i = 0; good && i < norm->nin; i++) {
    int x = norm->in[i];
    int64_t lo = m->offset[x], hi = lo + 4 * shape_numel(g->nodes[x]->shape);
    int at = -1, ready = -1;
    for (int k = 0; k < n; k++)
      if (r[k].from <= lo && hi <= r[k].to)
        at = r[k].at, ready = r[k].ready;
    good = at > f->step_of[x] && f->step_of[x] >= 0 && ready >= f->step_of[x] && ready < at;
    for (int s = f->step_of[x] + 1; good && s < at; s++)
      for (int k = 0; k < f->steps[s].nins; k++)
        good &= f->steps[s].ins[k] != x;
    grad_bytes += hi - lo;
  }
  *readies = 0;
  for (int k = 0; good && k < n; k++) {
    good = r[k].from < r[k].to && (bucket > 0 || k == 0 || r[k - 1].at < r[k].at || r[k - 1].to <= r[k].from);
    for (int j = 0; good && bucket > 0 && j < k; j++)
      good = r[j].to <= r[k].from || r[k].to <= r[j].from;
    if (good && bucket > 0 && r[k].to - r[k].from > bucket) { // (larger: one gradient alone)
      int inside = 0;
      for (int i = 0; i < norm->nin; i++)
        inside += m->offset[norm->in[i]] >= r[k].from && m->offset[norm->in[i]] < r[k].to;
      good = inside == 1;
    }
    bool seen = false;
    for (int j = 0; j < k; j++)
      seen |= r[j].ready == r[k].ready;
    *readies += !seen;
    range_bytes += r[k].to - r[k].from;
  }
  good = good && range_bytes >= grad_bytes && range_bytes <= grad_bytes + m->param_bytes - grad_bytes + 64 * n;
  *flat_at = good && n == 1 && r[0].from == m->grads ? r[0].at : -1;
  if (good && n == 1 && norm) // (one range: all the gradients, reduced before the norm's step)
    good = r[0].at == f->step_of[norm->id];
  free(r);
  arena_free(a);
  return good ? n : -1;
}

static void test_ranges(void) {
  int64_t flat_at;
  int readies;
  int n = ranges_of("models/gpt2-tiny.mdl", NULL, 1, 0, &flat_at, &readies);
  CHECK(n == 1 && flat_at >= 0, "AdamW, no accumulation: the flat gradient buffer, one all-reduce before the "
        "optimizer", "%d ranges", n);
  n = ranges_of("models/gpt2-tiny.mdl", NULL, 2, 0, &flat_at, &readies);
  CHECK(n > 1, "with accumulation: the means with the micro-batches' (not the flat buffer), each before its reader",
        "%d ranges", n);
  n = ranges_of("models/gpt2-tiny.mdl", "optimizer=muon(lr=0.02)", 1, 0, &flat_at, &readies);
  CHECK(n == 1 && flat_at >= 0, "Muon on gpt2-tiny: the flat buffer, reduced before the gradient norm's step",
        "%d ranges", n);
  // (without clipping Muon's momentum would otherwise start on the last layers' gradients inside the
  // backward's kernels, before any place to reduce them: it waits for the norm, clip or not)
  n = ranges_of("models/mlp.mdl", "optimizer=muon(lr=0.02)", 1, 0, &flat_at, &readies);
  CHECK(n == 1 && flat_at >= 0, "Muon without clipping on the MLP: no gradient read before the norm's step",
        "%d ranges", n);
  // Buckets (--bucket-mb): the backward finishes gpt2-tiny's gradients layer by layer, so buckets of
  // 64 KiB start at several points of it.
  n = ranges_of("models/gpt2-tiny.mdl", NULL, 1, 64 << 10, &flat_at, &readies);
  CHECK(n > 4 && readies > 4, "buckets of 64 KiB on gpt2-tiny: disjoint, each started once the backward has "
        "written its gradients, at several points of the backward", "%d buckets, %d starts", n, readies);
  int small = n;
  n = ranges_of("models/gpt2-tiny.mdl", NULL, 1, 25 << 20, &flat_at, &readies);
  CHECK(n >= 1 && n < small, "buckets of 25 MiB on gpt2-tiny: fewer, larger ones (neighbours the backward "
        "finishes one after the other)", "%d buckets against %d of 64 KiB", n, small);
  n = ranges_of("models/gpt2-tiny.mdl", NULL, 2, 64 << 10, &flat_at, &readies);
  CHECK(n > 1, "buckets with accumulation: the micro-batches' means, bucketed the same way", "%d buckets", n);
}

static bool same(const int *a, const int *b, int n) {
  for (int i = 0; i < n; i++)
    if (a[i] != b[i])
      return false;
  return true;
}

// ZeRO's partition (dist_partition): contiguous runs, each boundary the nearest to its share of the
// total; frozen parameters (size 0) and more ranks than parameters; balanced within one item.
static void test_partition(void) {
  int first[8];
  dist_partition((const int64_t[]){10, 10, 10, 10}, 4, 2, first);
  CHECK(same(first, (const int[]){0, 2, 4}, 3), "4 equal items over 2 ranks: 2 each", "%d %d %d", first[0], first[1],
        first[2]);
  dist_partition((const int64_t[]){100, 1, 1, 1}, 4, 2, first);
  CHECK(same(first, (const int[]){0, 1, 4}, 3), "a large first item: it alone, the rest on the other rank",
        "%d %d %d", first[0], first[1], first[2]);
  dist_partition((const int64_t[]){0, 4, 0, 4, 0}, 5, 2, first);
  CHECK(same(first, (const int[]){0, 3, 5}, 3), "frozen parameters (no elements) join the run before them",
        "%d %d %d", first[0], first[1], first[2]);
  dist_partition((const int64_t[]){5}, 1, 3, first);
  CHECK(same(first, (const int[]){0, 0, 1, 1}, 4), "more ranks than parameters: some ranks own none",
        "%d %d %d %d", first[0], first[1], first[2], first[3]);
  uint64_t x = 12345;
  bool balanced = true;
  for (int trial = 0; trial < 200 && balanced; trial++) {
    int64_t size[40], total = 0, most = 0;
    int n = 1 + trial % 40, parts = 1 + trial % 7;
    for (int i = 0; i < n; i++) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      size[i] = (int64_t)(x >> 40) % 1000;
      total += size[i];
      most = size[i] > most ? size[i] : most;
    }
    dist_partition(size, n, parts, first);
    balanced = first[0] == 0 && first[parts] == n;
    for (int r = 0; balanced && r < parts; r++) {
      int64_t share = 0;
      for (int i = first[r]; i < first[r + 1]; i++)
        share += size[i];
      balanced = first[r] <= first[r + 1] && (double)share <= (double)total / parts + 2.0 * (double)most;
    }
  }
  CHECK(balanced, "200 random lists: every rank's share within two items of total / ranks", "unbalanced");
}

// engine_shard on gpt2-tiny at 3 ranks: every parameter in one shard, each moment with its parameter,
// and the shares of the flat buffers back to back from the start of each to its end.
static void test_shard(void) {
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  LowerOptions lo = {0};
  Graph *g = mdl_compile_file_with(a, "models/gpt2-tiny.mdl", ov, 2, &lo);
  bool ok = g && autodiff(g, true);
  Fusion *f = ok ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true, .max_group = 64}) : NULL;
  MemPlan *m = f ? memplan(f) : NULL;
  ZeroShard *z = m ? engine_shard(g, 1, 3) : NULL;
  int64_t at[4][4];
  ok = z && z->first[0] == 0 && z->first[3] == g->nparams;
  for (int i = 0; ok && i < g->n; i++)
    if (g->nodes[i]->op == OP_STATE) {
      int r = engine_shard_owner(z, g, i), k = 0;
      while (g->params[k] != g->nodes[i]->param_of)
        k++;
      ok = z->first[r] <= k && k < z->first[r + 1] && engine_shard_owner(z, g, g->params[k]) == r;
    }
  if (ok) {
    engine_shard_at(z, g, m, at[0], at[1], at[2], at[3]);
    int64_t base[4] = {m->params, m->copies, m->m, m->v}, size[4] = {m->param_bytes, m->copy_bytes,
                                                                       m->param_bytes, m->param_bytes};
    for (int b = 0; b < 4; b++)
      for (int r = 0; r < 3; r++)
        ok &= at[b][0] == base[b] / 4 && at[b][3] == (base[b] + size[b]) / 4 && at[b][r] <= at[b][r + 1];
    ok &= at[0][1] > at[0][0] && at[0][2] > at[0][1] && at[0][3] > at[0][2];
  }
  CHECK(ok, "ZeRO's shards of gpt2-tiny over 3 ranks: each parameter and its moments in one, the flat buffers "
        "cut back to back", "bad shards");
  engine_shard_free(z);
  arena_free(a);
}

static void test_nccl(void) {
  char err[512] = "";
  if (access("/usr/local/cuda/lib64/libnccl.so.2", R_OK) != 0) {
    printf("[skip] NCCL loads: no /usr/local/cuda/lib64/libnccl.so.2\n");
    return;
  }
  CHECK(dist_nccl_load(err, sizeof err), "NCCL (the CUDA toolkit's libnccl.so.2) loads, its entry points resolved",
        "%s", err);
  CHECK(!dist_nccl_comm(err, sizeof err), "no NCCL communicator without several ranks", "one was made");
}

int main(void) {
  test_environment();
  test_ranges();
  test_partition();
  test_shard();
  test_nccl();
  TEST_EXIT();
}
