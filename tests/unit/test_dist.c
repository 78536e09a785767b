// Data-parallel pieces that need no second process (tests/cli/dist.sh runs mpirun): what the launcher's
// environment says, the gradients a rank all-reduces (engine_grad_ranges: exactly what the optimizer
// reads, with and without gradient accumulation), and that NCCL, the GPUs' all-reduce, loads and
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

// The ranges of engine_grad_ranges for gpt2-tiny with `accumulate` micro-batches a step.
static void test_ranges(int64_t accumulate) {
  Arena *a = arena_new();
  DimOverride ov[] = {{"B", 2}, {"T", 16}};
  Graph *g = mdl_compile_file(a, "models/gpt2-tiny.mdl", ov, 2);
  if (g)
    g->train.accumulate = accumulate;
  bool ok = g && autodiff(g, true);
  Fusion *f = ok ? fuse(g, (FuseOptions){.fuse = true, .chunk_lmhead = true, .max_group = 64}) : NULL;
  MemPlan *m = f ? memplan(f) : NULL;
  int n = 0, first = -1;
  int64_t(*r)[2] = m ? engine_grad_ranges(f, m, &n, &first) : NULL;
  const IrNode *norm = NULL;
  for (int i = 0; g && i < g->n && !norm; i++)
    norm = g->nodes[i]->op == OP_GRAD_NORM ? g->nodes[i] : NULL;
  // Every gradient the norm reads lies in one range, wholly; the ranges do not overlap; the bytes they
  // cover beyond the gradients are the flat buffer's padding only; each is written before `first`.
  bool covered = r && norm && first >= 0 && first < f->nsteps;
  int64_t grad_bytes = 0, range_bytes = 0;
  for (int i = 0; covered && i < norm->nin; i++) {
    int64_t lo = m->offset[norm->in[i]], hi = lo + 4 * shape_numel(g->nodes[norm->in[i]]->shape);
    bool in = false;
    for (int k = 0; k < n; k++)
      in |= r[k][0] <= lo && hi <= r[k][1];
    covered = in && f->step_of[norm->in[i]] < first;
    grad_bytes += hi - lo;
  }
  for (int k = 0; covered && k < n; k++) {
    covered = r[k][0] < r[k][1] && (k == 0 || r[k - 1][1] <= r[k][0]);
    range_bytes += r[k][1] - r[k][0];
  }
  bool optimizer_first = covered;
  for (int s = 0; covered && s < f->nsteps; s++)
    for (int k = 0; k < f->steps[s].nnodes; k++)
      optimizer_first &= (g->nodes[f->steps[s].nodes[k]]->op != OP_ADAMW &&
                          g->nodes[f->steps[s].nodes[k]]->op != OP_GRAD_NORM) || s >= first;
  if (accumulate == 1)
    CHECK(covered && optimizer_first && n == 1 && r[0][0] == m->grads && range_bytes <= m->param_bytes &&
              range_bytes >= grad_bytes,
          "without accumulation the gradients the optimizer reads are the flat gradient buffer: one all-reduce",
          "%d ranges, first step %d, %lld bytes of %lld", n, first, (long long)range_bytes, (long long)grad_bytes);
  else
    CHECK(covered && optimizer_first && n > 1 && range_bytes == grad_bytes,
          "with accumulation: the means with the micro-batches' (not the flat buffer), every one, nothing else",
          "%d ranges, first step %d, %lld bytes of %lld", n, first, (long long)range_bytes, (long long)grad_bytes);
  free(r);
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
  test_ranges(1);
  test_ranges(2);
  test_nccl();
  TEST_EXIT();
}
