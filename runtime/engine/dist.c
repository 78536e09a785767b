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
// No collective may hang a run: the ranks check in before each (check_in), waiting at most the
// timeout for the others, naming the missing ones; a collective that does not end within the timeout
// ends the process (a watchdog). A rank that dies is Open MPI's to report: its launcher stops the
// others and names it.
#include "runtime.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef void *MpiHandle; // MPI_Comm, MPI_Datatype, MPI_Op, MPI_Request: pointers in Open MPI
typedef struct {
  char internal[128]; // nccl.h's ncclUniqueId (NCCL_UNIQUE_ID_BYTES)
} NcclId;

static struct {
  bool on;               // MPI is initialised (size > 1)
  int64_t collectives;   // collectives so far (the check-ins' tag)
  int rank, size, local_rank, local_size;
  double timeout;        // seconds a rank waits for the others at a collective
  int64_t bucket;        // the gradients' buckets (bytes; 0: one all-reduce after the backward)
  bool overlap;          // buckets reduced beside the backward, on the engine's thread
  void *lib;
  MpiHandle comm, f32, f64, i32, sum, u32, max;
  int (*init_thread)(int *, char ***, int, int *);
  int (*comm_rank)(MpiHandle, int *);
  int (*comm_size)(MpiHandle, int *);
  int (*allreduce)(const void *, void *, int, MpiHandle, MpiHandle, MpiHandle);
  int (*isend)(const void *, int, MpiHandle, int, int, MpiHandle, MpiHandle *);
  int (*irecv)(void *, int, MpiHandle, int, int, MpiHandle, MpiHandle *);
  int (*test)(MpiHandle *, int *, void *);
  int (*abort_)(MpiHandle, int);
  int (*finalize)(void);
  int (*bcast)(void *, int, MpiHandle, int, MpiHandle);
  int (*allgatherv)(const void *, int, MpiHandle, void *, const int *, const int *, MpiHandle, MpiHandle);
  int (*gatherv)(const void *, int, MpiHandle, void *, const int *, const int *, MpiHandle, int, MpiHandle);
  MpiHandle byte;
  // NCCL (dlopen of libnccl.so.2, the CUDA toolkit's): the GPUs' all-reduce
  void *nccl;
  int (*nccl_id)(NcclId *);
  int (*nccl_init)(void **, int, NcclId, int);
  int (*nccl_allreduce)(const void *, void *, size_t, int, int, void *, void *);
  const char *(*nccl_error)(int);
  int (*nccl_bcast)(const void *, void *, size_t, int, int, void *, void *);
  int (*nccl_group_start)(void), (*nccl_group_end)(void);
} D = {.size = 1, .local_size = 1, .timeout = 300, .bucket = 25 << 20};

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
  D.byte = dlsym(D.lib, "ompi_mpi_byte");
  D.u32 = dlsym(D.lib, "ompi_mpi_uint32_t");
  D.max = dlsym(D.lib, "ompi_mpi_op_max");
  void **fns[] = {(void **)&D.init_thread, (void **)&D.comm_rank, (void **)&D.comm_size, (void **)&D.allreduce,
                  (void **)&D.isend, (void **)&D.irecv, (void **)&D.test, (void **)&D.abort_,
                  (void **)&D.finalize, (void **)&D.bcast, (void **)&D.allgatherv, (void **)&D.gatherv};
  const char *names[] = {"MPI_Init_thread", "MPI_Comm_rank", "MPI_Comm_size", "MPI_Allreduce", "MPI_Isend",
                         "MPI_Irecv", "MPI_Test", "MPI_Abort", "MPI_Finalize", "MPI_Bcast", "MPI_Allgatherv",
                         "MPI_Gatherv"};
  for (size_t i = 0; i < sizeof fns / sizeof *fns; i++)
    if (!(*fns[i] = dlsym(D.lib, names[i])))
      return fail(err, n, "Open MPI's library has no %s", names[i]);
  if (!D.f32 || !D.f64 || !D.i32 || !D.sum || !D.byte || !D.u32 || !D.max)
    return fail(err, n, "Open MPI's library lacks a predefined datatype or operation");
  // SERIALIZED: the gradients' buckets are reduced on the engine's thread while the backward runs
  // (engine.c), the other collectives on the main thread between steps: never two at once.
  int provided = 0;
  if (D.init_thread(NULL, NULL, 2 /* MPI_THREAD_SERIALIZED */, &provided) != 0)
    return fail(err, n, "MPI_Init_thread failed");
  if (provided < 2)
    D.overlap = false; // (an MPI without threads: every all-reduce from the main thread)
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
int dist_local_rank(void) {
  int r = env_int(env_local_ranks);
  return D.on ? D.local_rank : dist_launched() && r > 0 ? r : 0;
}
int dist_local_size(void) { return D.local_size; }
void dist_set_timeout(double seconds) { D.timeout = seconds; }
void dist_set_bucket(int64_t bytes) { D.bucket = bytes; }
int64_t dist_bucket(void) { return D.bucket; }
void dist_set_overlap(bool on) { D.overlap = on; }
bool dist_overlap(void) { return D.overlap; }
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

// Every rank checks in for the next collective before it starts: sends each other rank the
// collective's number and waits, at most the timeout, for each other rank's (point to point,
// nonblocking, polled: the ranks wait for the slowest here). A rank missing then is named, and
// MPI_Abort stops every rank: the collective would wait for it forever.
static void check_in(const char *what, int64_t step) {
  int tag = (int)(D.collectives++ % 32000), me = (int)tag, peers = D.size - 1;
  // (kept from one collective to the next: a step makes one per bucket; the world's size is fixed)
  static int *got, *done;
  static MpiHandle *rq;
  if (!got) {
    got = malloc(sizeof *got * (size_t)D.size);
    done = malloc(sizeof *done * (size_t)(2 * D.size));
    rq = malloc(sizeof *rq * (size_t)(2 * D.size));
  }
  if (!got || !rq || !done) {
    fprintf(stderr, "mdlc: rank %d: out of host memory\n", D.rank);
    dist_abort(1);
  }
  memset(got, 0, sizeof *got * (size_t)D.size);
  memset(done, 0, sizeof *done * (size_t)(2 * D.size));
  for (int r = 0, k = 0; r < D.size; r++)
    if (r != D.rank) {
      D.irecv(&got[r], 1, D.i32, r, tag, D.comm, &rq[2 * k]);
      D.isend(&me, 1, D.i32, r, tag, D.comm, &rq[2 * k + 1]);
      k++;
    }
  double t0 = rt_now();
  for (int left = 2 * peers; left > 0;) {
    for (int i = 0; i < 2 * peers; i++) {
      int flag = 0;
      if (!done[i] && (D.test(&rq[i], &flag, NULL), flag))
        done[i] = 1, left--;
    }
    if (left > 0 && rt_now() - t0 > D.timeout) {
      char missing[256] = "", at[48] = "";
      int nmissing = 0;
      for (int r = 0, k = 0; r < D.size; r++)
        if (r != D.rank && !done[2 * k++]) {
          if (strlen(missing) < sizeof missing - 16)
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", nmissing ? ", " : "", r);
          nmissing++;
        }
      if (step >= 0)
        snprintf(at, sizeof at, " of step %lld", (long long)step);
      fprintf(stderr, "mdlc: rank %d: rank%s %s did not reach %s%s within %.0f s (dead or hung); stopping every "
              "rank (the last checkpoint written stays as it was)\n", D.rank, nmissing > 1 ? "s" : "", missing,
              what, at, D.timeout);
      dist_abort(1);
    }
    if (left > 0)
      sched_yield();
  }
}

// The collective itself is MPI's blocking one (Open MPI's tuned all-reduce: 221-275 ms for GPT-2
// 124M's 498 MB of gradients over two ranks here, its nonblocking one 534-616 ms). A rank that stops
// inside it, after every rank checked in, would hold the others there: a watchdog thread, armed
// around the call, ends this process after the timeout (the launcher then stops every rank; no MPI
// call can be made while the collective holds the library).
static struct {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  bool started, armed;
  double deadline;
  const char *what;
  int64_t step;
} W = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

static void *watchdog(void *arg) {
  (void)arg;
  pthread_mutex_lock(&W.lock);
  for (;;) {
    while (!W.armed)
      pthread_cond_wait(&W.cond, &W.lock);
    double left = W.deadline - rt_now();
    if (left <= 0) {
      char at[48] = "";
      if (W.step >= 0)
        snprintf(at, sizeof at, " of step %lld", (long long)W.step);
      fprintf(stderr, "mdlc: rank %d: %s%s did not complete within %.0f s of every rank reaching it (a rank "
              "stopped inside it); stopping (the last checkpoint written stays as it was)\n", D.rank, W.what, at,
              D.timeout);
      _exit(1);
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double wake = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec + (left < 1 ? left : 1);
    ts.tv_sec = (time_t)wake;
    ts.tv_nsec = (long)((wake - (double)ts.tv_sec) * 1e9);
    pthread_cond_timedwait(&W.cond, &W.lock, &ts);
  }
  return NULL;
}

static void arm(const char *what, int64_t step, bool on) {
  pthread_mutex_lock(&W.lock);
  if (!W.started) {
    pthread_t th;
    W.started = pthread_create(&th, NULL, watchdog, NULL) == 0;
    if (W.started)
      pthread_detach(th);
  }
  W.armed = on;
  W.what = what;
  W.step = step;
  W.deadline = rt_now() + D.timeout;
  pthread_cond_signal(&W.cond);
  pthread_mutex_unlock(&W.lock);
}

bool dist_mean_f32(float *x, int64_t n, const char *what, int64_t step, char *err, size_t en) {
  if (!D.on)
    return true;
  check_in(what, step);
  bool ok = true;
  arm(what, step, true);
  for (int64_t at = 0; ok && at < n;) { // (MPI counts are int)
    int c = n - at > (1 << 30) ? 1 << 30 : (int)(n - at);
    ok = D.allreduce((const void *)1 /* MPI_IN_PLACE */, x + at, c, D.f32, D.sum, D.comm) == 0;
    at += c;
  }
  arm(what, step, false);
  if (!ok)
    return rt_fail(err, en, "MPI_Allreduce of %s failed", what);
  float inv = 1.0f / (float)D.size;
  for (int64_t i = 0; i < n; i++)
    x[i] *= inv;
  return true;
}

bool dist_sum_f64(double *x, int n, const char *what, int64_t step, char *err, size_t en) {
  if (!D.on)
    return true;
  check_in(what, step);
  arm(what, step, true);
  bool ok = D.allreduce((const void *)1 /* MPI_IN_PLACE */, x, n, D.f64, D.sum, D.comm) == 0;
  arm(what, step, false);
  return ok || rt_fail(err, en, "MPI_Allreduce of %s failed", what);
}

bool dist_max_u32(uint32_t *x, int n, const char *what, int64_t step, char *err, size_t en) {
  if (!D.on)
    return true;
  check_in(what, step);
  arm(what, step, true);
  bool ok = D.allreduce((const void *)1 /* MPI_IN_PLACE */, x, n, D.u32, D.max, D.comm) == 0;
  arm(what, step, false);
  return ok || rt_fail(err, en, "MPI_Allreduce of %s failed", what);
}

// MPI's counts and displacements (ints) of the float ranges [at[r], at[r + 1]) of x, one per rank; false
// where one does not fit an int.
static bool mpi_ranges(const int64_t *at, int *count, int *disp) {
  for (int r = 0; r < D.size; r++) {
    if (at[r + 1] > INT32_MAX || at[r] > INT32_MAX)
      return false;
    count[r] = (int)(at[r + 1] - at[r]);
    disp[r] = (int)at[r];
  }
  return true;
}

// MPI_Allgatherv in place (root < 0: to is x), or MPI_Gatherv of x's shares into root's `to` (root's
// own share left as it is there), with the check-in and the watchdog of every collective.
static bool gather_ranges(float *x, float *to, const int64_t *at, int root, const char *what, int64_t step, char *err,
                          size_t en) {
  if (!D.on)
    return true;
  int *count = malloc(sizeof(int) * (size_t)D.size), *disp = malloc(sizeof(int) * (size_t)D.size);
  if (!count || !disp || !mpi_ranges(at, count, disp)) {
    free(count);
    free(disp);
    return rt_fail(err, en, "%s: %s", what, count && disp ? "a rank's share is over 2^31 values" : "out of memory");
  }
  check_in(what, step);
  arm(what, step, true);
  const void *in_place = (const void *)1; // MPI_IN_PLACE
  bool ok = root < 0 ? D.allgatherv(in_place, 0, D.f32, x, count, disp, D.f32, D.comm) == 0
            : D.rank == root ? D.gatherv(in_place, 0, D.f32, to, count, disp, D.f32, root, D.comm) == 0
                             : D.gatherv(x + disp[D.rank], count[D.rank], D.f32, NULL, NULL, NULL, D.f32, root,
                                         D.comm) == 0;
  arm(what, step, false);
  free(count);
  free(disp);
  return ok || rt_fail(err, en, "%s of %s failed", root < 0 ? "MPI_Allgatherv" : "MPI_Gatherv", what);
}

bool dist_allgather_f32(float *x, const int64_t *at, const char *what, int64_t step, char *err, size_t en) {
  return gather_ranges(x, x, at, -1, what, step, err, en);
}

bool dist_gather_f32(float *x, float *to, const int64_t *at, int root, const char *what, int64_t step, char *err,
                     size_t en) {
  return gather_ranges(x, to, at, root, what, step, err, en);
}

// Cuts n items of sizes size[] into parts contiguous runs: each boundary the item boundary nearest to
// its share r/parts of the total (the earlier one on a tie), never before the last boundary.
void dist_partition(const int64_t *size, int n, int parts, int *first) {
  int64_t total = 0;
  for (int i = 0; i < n; i++)
    total += size[i];
  first[0] = 0;
  int i = 0;
  int64_t below = 0; // the sizes of items [0, i)
  for (int r = 1; r < parts; r++) {
    double want = (double)total * r / parts;
    while (i < n && (double)(below + size[i]) <= want)
      below += size[i++];
    if (i < n && (double)(below + size[i]) - want < want - (double)below)
      below += size[i++];
    first[r] = i;
  }
  first[parts] = n;
}

bool dist_nccl_load(char *err, size_t n) {
  if (D.nccl)
    return true;
  const char *sonames[] = {"libnccl.so.2", "libnccl.so", "/usr/local/cuda/lib64/libnccl.so.2", NULL};
  for (int i = 0; sonames[i] && !D.nccl; i++)
    D.nccl = dlopen(sonames[i], RTLD_NOW | RTLD_LOCAL);
  if (!D.nccl)
    return rt_fail(err, n, "NCCL (libnccl.so.2) cannot be loaded: %s", dlerror());
  void **fns[] = {(void **)&D.nccl_id, (void **)&D.nccl_init, (void **)&D.nccl_allreduce, (void **)&D.nccl_error,
                  (void **)&D.nccl_bcast, (void **)&D.nccl_group_start, (void **)&D.nccl_group_end};
  const char *names[] = {"ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclGetErrorString",
                         "ncclBroadcast", "ncclGroupStart", "ncclGroupEnd"};
  for (size_t i = 0; i < sizeof fns / sizeof *fns; i++)
    if (!(*fns[i] = dlsym(D.nccl, names[i]))) {
      dlclose(D.nccl);
      D.nccl = NULL;
      return rt_fail(err, n, "NCCL's library has no %s", names[i]);
    }
  return true;
}

void *dist_nccl_comm(char *err, size_t n) {
  if (!D.on || !dist_nccl_load(err, n))
    return NULL;
  NcclId id;
  memset(&id, 0, sizeof id);
  int r = D.rank == 0 ? D.nccl_id(&id) : 0;
  if (r != 0) {
    rt_fail(err, n, "ncclGetUniqueId: %s", D.nccl_error(r));
    dist_abort(1); // (the other ranks wait for the id)
  }
  if (D.bcast(&id, (int)sizeof id, D.byte, 0, D.comm) != 0) {
    rt_fail(err, n, "MPI_Bcast of NCCL's id failed");
    return NULL;
  }
  void *comm = NULL;
  if ((r = D.nccl_init(&comm, D.size, id, D.rank)) != 0) {
    rt_fail(err, n, "ncclCommInitRank (rank %d of %d): %s", D.rank, D.size, D.nccl_error(r));
    return NULL;
  }
  return comm;
}

bool dist_nccl_gather_f32(void *comm, void *x, const int64_t *at, void *stream, char *err, size_t n) {
  int r = D.nccl_group_start();
  for (int k = 0; r == 0 && k < D.size; k++) {
    void *part = (char *)x + 4 * at[k];
    if (at[k + 1] > at[k])
      r = D.nccl_bcast(part, part, (size_t)(at[k + 1] - at[k]), 7 /* ncclFloat32 */, k, comm, stream);
  }
  int end = D.nccl_group_end();
  r = r ? r : end;
  return r == 0 || rt_fail(err, n, "ncclBroadcast of the updated parameters: %s", D.nccl_error(r));
}

bool dist_nccl_mean_f32(void *comm, void *x, int64_t count, void *stream, char *err, size_t n) {
  int r = D.nccl_allreduce(x, x, (size_t)count, 7 /* ncclFloat32 */, 4 /* ncclAvg */, comm, stream);
  return r == 0 || rt_fail(err, n, "ncclAllReduce: %s", D.nccl_error(r));
}
