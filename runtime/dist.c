// dist.c: data-parallel training over processes. MPI starts and wires up the ranks (mpirun, or srun
// under Slurm through MPI); the gradients' all-reduce on the CPU back end is MPI_Allreduce.
//
// MPI is Open MPI, loaded at run time (dlopen of libmpi.so.40, the soname of Open MPI 3, 4 and 5),
// not linked: the same mdlc builds and trains alone on a machine without MPI, and only a process that
// its launcher says is one of several ranks loads it. Open MPI's handles (MPI_COMM_WORLD, MPI_FLOAT,
// MPI_SUM, ...) are the addresses of its predefined objects (mpi.h's OMPI_PREDEFINED_GLOBAL), so they
// come from dlsym too; MPICH's integer handles are another ABI, named in the error when it is the MPI
// that is found.
//
// No collective may hang a run: each is nonblocking, waited for at most the timeout; then the ranks
// still waiting name the ones they wait for (stop_waiting) and MPI_Abort stops every rank. A rank that
// dies is Open MPI's to report: its launcher stops the others and names it.
#include "runtime.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef void *MpiHandle; // MPI_Comm, MPI_Datatype, MPI_Op, MPI_Request: pointers in Open MPI

static struct {
  bool on;               // MPI is initialised (size > 1)
  int rank, size, local_rank, local_size;
  double timeout;        // seconds a rank waits for the others at a collective
  void *lib;
  MpiHandle comm, f32, f64, i32, sum;
  int (*init_thread)(int *, char ***, int, int *);
  int (*comm_rank)(MpiHandle, int *);
  int (*comm_size)(MpiHandle, int *);
  int (*iallreduce)(const void *, void *, int, MpiHandle, MpiHandle, MpiHandle, MpiHandle *);
  int (*isend)(const void *, int, MpiHandle, int, int, MpiHandle, MpiHandle *);
  int (*irecv)(void *, int, MpiHandle, int, int, MpiHandle, MpiHandle *);
  int (*test)(MpiHandle *, int *, void *);
  int (*abort_)(MpiHandle, int);
  int (*finalize)(void);
} D = {.size = 1, .local_size = 1, .timeout = 300};

// The first of the environment variables that is set, as an integer; -1 when none is.
static int env_int(const char *const *names) {
  for (; *names; names++) {
    const char *v = getenv(*names);
    if (v && *v)
      return atoi(v);
  }
  return -1;
}

static const char *const env_sizes[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE", "SLURM_NTASKS", NULL};
static const char *const env_ranks[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", NULL};
static const char *const env_local_ranks[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", NULL};
static const char *const env_local_sizes[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                                              "SLURM_NTASKS_PER_NODE", NULL};

bool dist_launched(void) { return env_int(env_sizes) > 1; }

int dist_env_rank(void) {
  int r = env_int(env_ranks);
  return dist_launched() && r > 0 ? r : 0;
}

int dist_env_local_size(void) {
  int n = env_int(env_local_sizes);
  return dist_launched() && n > 0 ? n : 1;
}

static bool fail(char *err, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool fail(char *err, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, n, fmt, ap);
  va_end(ap);
  if (D.lib)
    dlclose(D.lib);
  D.lib = NULL;
  return false;
}

bool dist_init(char *err, size_t n) {
  if (D.on || !dist_launched())
    return true;
  const char *sonames[] = {"libmpi.so.40", "libmpi.so", NULL};
  for (int i = 0; sonames[i] && !D.lib; i++)
    D.lib = dlopen(sonames[i], RTLD_NOW | RTLD_GLOBAL);
  if (!D.lib)
    return fail(err, n, "this process is one of several ranks (its launcher says so), but Open MPI's libmpi.so.40 "
                "cannot be loaded: %s (install openmpi-bin, or run without mpirun/srun to train alone)", dlerror());
  if (!dlsym(D.lib, "ompi_mpi_comm_world"))
    return fail(err, n, "the MPI library loaded is not Open MPI (no ompi_mpi_comm_world): mdlc speaks Open MPI's "
                "ABI; launch it with Open MPI's mpirun, or srun with Open MPI's libraries first on the path");
  D.comm = dlsym(D.lib, "ompi_mpi_comm_world");
  D.f32 = dlsym(D.lib, "ompi_mpi_float");
  D.f64 = dlsym(D.lib, "ompi_mpi_double");
  D.i32 = dlsym(D.lib, "ompi_mpi_int");
  D.sum = dlsym(D.lib, "ompi_mpi_op_sum");
  void **fns[] = {(void **)&D.init_thread, (void **)&D.comm_rank, (void **)&D.comm_size, (void **)&D.iallreduce,
                  (void **)&D.isend, (void **)&D.irecv, (void **)&D.test, (void **)&D.abort_,
                  (void **)&D.finalize};
  const char *names[] = {"MPI_Init_thread", "MPI_Comm_rank", "MPI_Comm_size", "MPI_Iallreduce", "MPI_Isend",
                         "MPI_Irecv", "MPI_Test", "MPI_Abort", "MPI_Finalize"};
  for (size_t i = 0; i < sizeof fns / sizeof *fns; i++)
    if (!(*fns[i] = dlsym(D.lib, names[i])))
      return fail(err, n, "Open MPI's library has no %s", names[i]);
  if (!D.f32 || !D.f64 || !D.i32 || !D.sum)
    return fail(err, n, "Open MPI's library lacks a predefined datatype or operation");
  int provided = 0;
  if (D.init_thread(NULL, NULL, 1 /* MPI_THREAD_FUNNELED */, &provided) != 0)
    return fail(err, n, "MPI_Init_thread failed");
  D.comm_rank(D.comm, &D.rank);
  D.comm_size(D.comm, &D.size);
  D.on = D.size > 1;
  int lr = env_int(env_local_ranks), ls = env_int(env_local_sizes);
  D.local_rank = lr >= 0 ? lr : D.rank;
  D.local_size = ls > 0 ? ls : 1;
  return true;
}

bool dist_on(void) { return D.on; }
// Before MPI starts (dist_init), what the launcher's environment says: a run checks its checkpoint's
// global batch before it starts MPI.
int dist_rank(void) { return D.on ? D.rank : dist_env_rank(); }
int dist_size(void) {
  int n = env_int(env_sizes);
  return D.on ? D.size : dist_launched() ? n : 1;
}
int dist_local_rank(void) { return D.local_rank; }
int dist_local_size(void) { return D.local_size; }
void dist_set_timeout(double seconds) { D.timeout = seconds; }
double dist_timeout(void) { return D.timeout; }

void dist_abort(int status) {
  fflush(stdout);
  fflush(stderr);
  if (D.on)
    D.abort_(D.comm, status);
  exit(status);
}

void dist_finalize(void) {
  if (D.on)
    D.finalize();
  D.on = false;
}

// A collective that has not completed within the timeout: every rank still waiting in it sends every
// other a probe and waits a little for theirs; the ranks that do not answer are the ones it waits for
// (dead, hung, or still short of the collective), named before MPI_Abort stops every rank.
static void stop_waiting(const char *what, int64_t step) {
  int me = D.rank, peers = D.size - 1;
  int *got = calloc((size_t)D.size, sizeof *got), *done = calloc((size_t)(2 * D.size), sizeof *done);
  MpiHandle *rq = calloc((size_t)(2 * D.size), sizeof *rq);
  char missing[256] = "";
  int nmissing = 0;
  if (got && done && rq) {
    for (int r = 0, k = 0; r < D.size; r++)
      if (r != D.rank) {
        D.irecv(&got[r], 1, D.i32, r, 32001, D.comm, &rq[2 * k]);
        D.isend(&me, 1, D.i32, r, 32001, D.comm, &rq[2 * k + 1]);
        k++;
      }
    double t0 = rt_now(), window = D.timeout / 4 > 2 ? D.timeout / 4 : 2;
    struct timespec nap = {0, 1000000};
    for (int left = peers; left > 0 && rt_now() - t0 < window;) {
      for (int i = 0; i < peers; i++) {
        int flag = 0;
        if (!done[2 * i] && (D.test(&rq[2 * i], &flag, NULL), flag))
          done[2 * i] = 1, left--;
      }
      nanosleep(&nap, NULL);
    }
    for (int r = 0, k = 0; r < D.size; r++)
      if (r != D.rank && !done[2 * k++]) {
        if (strlen(missing) < sizeof missing - 16)
          snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", nmissing ? ", " : "", r);
        nmissing++;
      }
  }
  char at[48] = "";
  if (step >= 0)
    snprintf(at, sizeof at, " of step %lld", (long long)step);
  if (nmissing)
    fprintf(stderr, "mdlc: rank %d: rank%s %s did not reach %s%s within %.0f s (dead or hung); stopping every "
            "rank (the last checkpoint written stays as it was)\n", D.rank, nmissing > 1 ? "s" : "", missing, what,
            at, D.timeout);
  else
    fprintf(stderr, "mdlc: rank %d: %s%s did not complete within %.0f s; stopping every rank (the last checkpoint "
            "written stays as it was)\n", D.rank, what, at, D.timeout);
  dist_abort(1);
}

// Waits for a nonblocking collective, at most the timeout (then stop_waiting). MPI progresses it in
// MPI_Test: polled, in a tight loop for the first millisecond (shared memory finishes a small one in
// microseconds), then every 0.1 ms.
static void wait_for(MpiHandle *rq, const char *what, int64_t step) {
  double t0 = rt_now();
  struct timespec nap = {0, 100000};
  for (int flag = 0;;) {
    D.test(rq, &flag, NULL);
    if (flag)
      return;
    double dt = rt_now() - t0;
    if (dt > D.timeout)
      stop_waiting(what, step);
    if (dt > 1e-3)
      nanosleep(&nap, NULL);
  }
}

bool dist_mean_f32(float *x, int64_t n, const char *what, int64_t step, char *err, size_t en) {
  if (!D.on)
    return true;
  for (int64_t at = 0; at < n;) { // (MPI counts are int)
    int c = n - at > (1 << 30) ? 1 << 30 : (int)(n - at);
    MpiHandle rq;
    if (D.iallreduce((const void *)1 /* MPI_IN_PLACE */, x + at, c, D.f32, D.sum, D.comm, &rq) != 0)
      return rt_fail(err, en, "MPI_Iallreduce of %s failed", what);
    wait_for(&rq, what, step);
    at += c;
  }
  float inv = 1.0f / (float)D.size;
  for (int64_t i = 0; i < n; i++)
    x[i] *= inv;
  return true;
}

bool dist_sum_f64(double *x, int n, const char *what, int64_t step, char *err, size_t en) {
  if (!D.on)
    return true;
  MpiHandle rq;
  if (D.iallreduce((const void *)1 /* MPI_IN_PLACE */, x, n, D.f64, D.sum, D.comm, &rq) != 0)
    return rt_fail(err, en, "MPI_Iallreduce of %s failed", what);
  wait_for(&rq, what, step);
  return true;
}
