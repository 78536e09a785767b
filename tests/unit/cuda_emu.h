// cuda_emu.h: runs CUDA kernels on the CPU, so that the kernels mdlc emits can be tested on machines
// without a GPU (in the spirit of tinygrad's emulator). Include it before an emitted .cu file and
// compile the pair as C++17 with g++ (-fopenmp runs blocks on several cores):
//   g++ -std=c++17 -O1 -fopenmp -include tests/unit/cuda_emu.h model.cu ...
// and launch a kernel with mdl_emu::run(grid, block, body, ctx), where body(ctx) calls it once for
// the current thread.
//
// Design. The CUDA keywords become plain C++ (__global__ and __device__ vanish, __shared__ becomes a
// function-local `static thread_local`, which every thread of a block shares because a block runs on
// one OS thread). The threads of a block are fibers (ucontext), one per CUDA thread, run round-robin
// on one OS thread; threadIdx, blockIdx, blockDim and gridDim are thread-locals the scheduler sets
// before it resumes a fiber, in increasing order of threadIdx in some blocks and decreasing in the
// others (a thread that reads what another wrote, with no barrier between them, then sees the old value
// in one or the other, whichever of the two the GPU would run first). A fiber runs until it waits:
// __syncthreads waits until every live thread of the block has arrived, __syncwarp every live thread of
// its warp, a warp shuffle until every live thread of its warp has put its value in the warp's exchange
// slots (then reads its partner's, and waits once more so that no slot is overwritten before it is
// read). The tensor cores' mma.sync is warp-collective the same way: the lanes put their fragments in
// the warp's slots, wait, each computes its own part of D from the whole A and B, and wait again; so
// are ldmatrix, __all_sync and __any_sync. A cp.async copy lands at one end or the other of the window
// the GPU allows it, by block (cp_async): a missing wait or barrier around a double-buffered tile then
// shows as wrong values. A thread that returns stops counting for the barriers; a whole pass over the
// fibers without any arrival, release or exit is a deadlock and aborts. Blocks are independent, so
// OpenMP runs them in parallel, each OS thread with its own fibers.
#ifndef MDL_CUDA_EMU_H
#define MDL_CUDA_EMU_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
};
struct __attribute__((aligned(8))) float2 {
  float x, y;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(4))) ushort2 {
  unsigned short x, y;
};
struct __attribute__((aligned(8))) ushort4 {
  unsigned short x, y, z, w;
};
struct __attribute__((aligned(16))) uint4 {
  unsigned x, y, z, w;
};

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;
static const int warpSize = 32;

inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline ushort2 make_ushort2(unsigned short x, unsigned short y) { return ushort2{x, y}; }
inline ushort4 make_ushort4(unsigned short x, unsigned short y, unsigned short z, unsigned short w) {
  return ushort4{x, y, z, w};
}
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

// Bit casts, and __expf (the GPU's fast exp; here the exact one).
inline float __int_as_float(int x) {
  float f;
  memcpy(&f, &x, 4);
  return f;
}
inline float __uint_as_float(unsigned x) {
  float f;
  memcpy(&f, &x, 4);
  return f;
}
inline unsigned __float_as_uint(float x) {
  unsigned u;
  memcpy(&u, &x, 4);
  return u;
}
inline float __expf(float x) { return expf(x); }

inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long expect, unsigned long long desired) {
  __atomic_compare_exchange_n(p, &expect, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expect;
}
inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicMax(unsigned *p, unsigned v) {
  unsigned old = *p;
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline float atomicAdd(float *p, float v) {
  float old = *p, sum;
  do
    sum = old + v;
  while (!__atomic_compare_exchange(p, &old, &sum, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  return old;
}

namespace mdl_emu {

enum { STACK = 128 << 10, MAX_THREADS = 1024 };

struct Fiber {
  ucontext_t ctx;
  char *stack;
  bool done;
  uint3 idx;
};

// An asynchronous copy (cp.async) not yet done: n bytes from src (zeros unless in) to dst, of the
// issuing thread's commit group `group`.
struct Copy {
  void *dst;
  const void *src;
  int n;
  bool in;
  unsigned group;
};
enum { MAX_COPIES = 64 }; // pending a thread

struct Barrier {
  unsigned gen;
  int count, live;
};

struct Block {
  Fiber fibers[MAX_THREADS];
  ucontext_t sched;
  int nthreads, cur;
  Barrier block;
  Barrier warp[MAX_THREADS / 32];
  uint64_t slot[MAX_THREADS];
  uint32_t frag[MAX_THREADS][6]; // mma: a lane's A (4 registers) and B (2) fragments
  Copy copies[MAX_THREADS][MAX_COPIES];
  int ncopies[MAX_THREADS];
  unsigned groups[MAX_THREADS]; // commit groups a thread has closed
  bool eager;                   // copies land when issued (odd blocks), not at the wait (even ones)
  bool reverse;                 // the fibers run from the last thread to the first (blocks 2, 3 mod 4)
  unsigned long events;
  void (*body)(void *);
  void *ctx;
};

inline thread_local Block *blk;

inline void yield() {
  Block *B = blk;
  swapcontext(&B->fibers[B->cur].ctx, &B->sched);
}

// Arrives at barrier b and waits until all its live threads have.
inline void wait(Barrier &b) {
  Block *B = blk;
  B->events++;
  unsigned gen = b.gen;
  if (++b.count >= b.live) {
    b.count = 0;
    b.gen++;
    return;
  }
  while (b.gen == gen)
    yield();
}

// A thread that ends leaves its barriers, which may release the threads waiting there.
inline void leave(Barrier &b) {
  b.live--;
  if (b.count > 0 && b.count >= b.live) {
    b.count = 0;
    b.gen++;
  }
}

// Copy c lands in shared memory.
inline void land(const Copy &c) {
  if (c.in)
    memcpy(c.dst, c.src, (size_t)c.n);
  else
    memset(c.dst, 0, (size_t)c.n);
}

// cp.async of n bytes (zeros unless in) by the calling thread. The GPU lands it at some time before
// the wait_group that covers it; the emulator at the two ends of that window: at once in blocks of
// odd index (a buffer refilled while other warps still read it shows there), at the wait in even
// ones (a read before the wait sees what was there before).
inline void cp_async(void *dst, const void *src, int n, bool in) {
  Block *B = blk;
  int t = B->cur;
  if ((uintptr_t)dst % (unsigned)n || (in && (uintptr_t)src % (unsigned)n)) {
    fprintf(stderr, "cuda_emu: cp.async of %d bytes from %p to %p, not aligned\n", n, src, dst);
    abort();
  }
  Copy c{dst, src, n, in, B->groups[t]};
  if (B->eager)
    return land(c);
  if (B->ncopies[t] == MAX_COPIES) {
    fprintf(stderr, "cuda_emu: thread %d has %d cp.async pending\n", t, MAX_COPIES);
    abort();
  }
  B->copies[t][B->ncopies[t]++] = c;
}

inline void cp_async_commit() { blk->groups[blk->cur]++; }

// cp.async.wait_group n: the copies of every commit group of the thread but its n latest land.
inline void cp_async_wait(unsigned n) {
  Block *B = blk;
  int t = B->cur, kept = 0;
  for (int i = 0; i < B->ncopies[t]; i++) {
    const Copy c = B->copies[t][i];
    if (c.group + n < B->groups[t])
      land(c);
    else
      B->copies[t][kept++] = c;
  }
  B->ncopies[t] = kept;
}

inline void trampoline() {
  Block *B = blk;
  int t = B->cur;
  B->body(B->ctx);
  for (int i = 0; i < B->ncopies[t]; i++) // (what a thread left in flight lands all the same)
    land(B->copies[t][i]);
  B->fibers[t].done = true;
  B->events++;
  leave(B->block);
  leave(B->warp[t / 32]);
}

inline void run_block(Block *B, uint3 bidx, dim3 block) {
  int n = (int)(block.x * block.y * block.z);
  B->nthreads = n;
  B->block = Barrier{0, 0, n};
  for (int w = 0; w * 32 < n; w++)
    B->warp[w] = Barrier{0, 0, n - w * 32 < 32 ? n - w * 32 : 32};
  for (int t = 0; t < n; t++) {
    Fiber *f = &B->fibers[t];
    if (!f->stack && !(f->stack = (char *)malloc(STACK))) {
      fprintf(stderr, "cuda_emu: out of memory for fiber stacks\n");
      abort();
    }
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = f->stack;
    f->ctx.uc_stack.ss_size = STACK;
    f->ctx.uc_link = &B->sched;
    makecontext(&f->ctx, trampoline, 0);
    f->done = false;
    B->ncopies[t] = 0;
    B->groups[t] = 0;
    f->idx = uint3{(unsigned)t % block.x, (unsigned)t / block.x % block.y, (unsigned)t / (block.x * block.y)};
  }
  blockIdx = bidx;
  blockDim = block;
  B->eager = (bidx.x + bidx.y + bidx.z) % 2;
  B->reverse = (bidx.x + bidx.y + bidx.z) / 2 % 2; // (both orders with both ends of cp.async's window)
  for (int live = n; live > 0;) {
    unsigned long before = B->events;
    live = 0;
    for (int i = 0; i < n; i++) {
      int t = B->reverse ? n - 1 - i : i;
      if (B->fibers[t].done)
        continue;
      B->cur = t;
      threadIdx = B->fibers[t].idx;
      swapcontext(&B->sched, &B->fibers[t].ctx);
      live += !B->fibers[t].done;
    }
    if (live && B->events == before) {
      fprintf(stderr, "cuda_emu: deadlock in block (%u, %u, %u): threads wait at barriers that never fill\n",
              bidx.x, bidx.y, bidx.z);
      abort();
    }
  }
}

// Runs body(ctx) once per thread of every block of the grid.
inline void run(dim3 grid, dim3 block, void (*body)(void *), void *ctx) {
  long nb = (long)grid.x * grid.y * grid.z;
  if (block.x * block.y * block.z > MAX_THREADS || block.x * block.y * block.z == 0) {
    fprintf(stderr, "cuda_emu: bad block size %u x %u x %u\n", block.x, block.y, block.z);
    abort();
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (long b = 0; b < nb; b++) {
    static thread_local Block *mine;
    if (!mine && !(mine = (Block *)calloc(1, sizeof(Block)))) {
      fprintf(stderr, "cuda_emu: out of memory\n");
      abort();
    }
    blk = mine;
    gridDim = grid;
    mine->body = body;
    mine->ctx = ctx;
    run_block(mine, uint3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y), (unsigned)(b / (grid.x * grid.y))},
              block);
  }
}

// Exchanges v among the lanes of the calling thread's warp: returns the value lane `src` put.
template <class T> T exchange(T v, unsigned src) {
  Block *B = blk;
  int t = B->cur, base = t / 32 * 32;
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a value wider than 8 bytes");
  memcpy(&B->slot[t], &v, sizeof v);
  wait(B->warp[t / 32]);
  T r;
  memcpy(&r, &B->slot[base + (int)src], sizeof r);
  wait(B->warp[t / 32]);
  return r;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (d += A B) with the fragment layout the
// prelude describes above mdl_mma_bf16_16816: A[r][k] is in lane 4 (r % 8) + (k % 8) / 2, register
// r / 8 + 2 (k / 8); B[k][n] in lane 4 n + (k % 8) / 2, register k / 8; the half k % 2 (low first).
// Every lane of the warp must take part, as on the GPU. The products of two bf16 values are exact;
// they and d are added in double and rounded to f32 once (the GPU adds in an order and precision of
// its own: the two agree within f32 summation error).
inline float bf16_half(uint32_t reg, int k) { return __uint_as_float((k & 1 ? reg >> 16 : reg & 0xffffu) << 16); }

inline void mma_bf16_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  Block *B = blk;
  int t = B->cur, w = t / 32, base = w * 32, lane = t % 32;
  memcpy(B->frag[t], a, 4 * sizeof *a);
  memcpy(B->frag[t] + 4, b, 2 * sizeof *b);
  wait(B->warp[w]);
  if (B->warp[w].live != 32) { // (the lanes that returned released the barrier)
    fprintf(stderr, "cuda_emu: mma.sync in warp %d of block (%u, %u, %u) with %d of its 32 threads\n", w, blockIdx.x,
            blockIdx.y, blockIdx.z, B->warp[w].live);
    abort();
  }
  const int g = lane >> 2, tq = lane & 3;
  for (int i = 0; i < 4; i++) {
    const int r = g + (i >= 2 ? 8 : 0), n = 2 * tq + (i & 1);
    double s = d[i];
    for (int k = 0; k < 16; k++)
      s += (double)bf16_half(B->frag[base + 4 * (r % 8) + (k % 8) / 2][r / 8 + 2 * (k / 8)], k) *
           bf16_half(B->frag[base + 4 * n + (k % 8) / 2][4 + k / 8], k);
    d[i] = (float)s;
  }
  wait(B->warp[w]);
}

// Shared-memory bank conflicts of ldmatrix, over every block this object has run so far (static: one
// count per shared object, where an inline variable would be one for all those loaded): the 8 x 8
// tiles read, and the extra passes they took. A tile's 8 rows of 16 bytes go to the 32 banks in one
// pass when they lie in 8 different 16-byte groups of banks (address / 16 mod 8); rows in one group
// take a pass each. Counted from the rows' addresses relative to the tile's first row, which the
// emulator's shared arrays lay out as the GPU's do (one array per tile).
static unsigned long long ldsm_tiles, ldsm_extra_passes;

inline void count_ldsm_passes(const uint64_t *rows) {
  int in_group[8] = {0}, passes = 1;
  for (int j = 0; j < 8; j++) {
    int g = (int)(((rows[j] - rows[0]) / 16) % 8);
    passes = ++in_group[g] > passes ? in_group[g] : passes;
  }
  __atomic_fetch_add(&ldsm_tiles, 1ull, __ATOMIC_RELAXED);
  __atomic_fetch_add(&ldsm_extra_passes, (unsigned long long)(passes - 1), __ATOMIC_RELAXED);
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16, transposed (trans) or not: lanes 8 i .. 8 i + 7 give the
// row addresses of 8 x 8 tile i (16-byte aligned); lane l gets in r[i] columns 2 (l % 4) and
// 2 (l % 4) + 1 (low half first) of row l / 4 of tile i, or with trans rows 2 (l % 4) and 2 (l % 4) + 1
// of column l / 4. Every lane of the warp must take part, as on the GPU; lane 0 counts the tiles'
// bank conflicts.
inline void ldsm_x4(uint32_t r[4], const void *p, bool trans) {
  Block *B = blk;
  int t = B->cur, w = t / 32, base = w * 32, lane = t % 32;
  if ((uintptr_t)p % 16) {
    fprintf(stderr, "cuda_emu: ldmatrix row address %p of lane %d is not 16-byte aligned\n", p, lane);
    abort();
  }
  uint64_t a = (uint64_t)(uintptr_t)p;
  memcpy(&B->slot[t], &a, sizeof a);
  wait(B->warp[w]);
  if (B->warp[w].live != 32) {
    fprintf(stderr, "cuda_emu: ldmatrix in warp %d of block (%u, %u, %u) with %d of its 32 threads\n", w, blockIdx.x,
            blockIdx.y, blockIdx.z, B->warp[w].live);
    abort();
  }
  for (int i = 0; lane == 0 && i < 4; i++)
    count_ldsm_passes(&B->slot[base + 8 * i]);
  for (int i = 0; i < 4; i++) {
    uint16_t lo, hi;
    if (trans) {
      const char *r0 = (const char *)(uintptr_t)B->slot[base + 8 * i + 2 * (lane % 4)];
      const char *r1 = (const char *)(uintptr_t)B->slot[base + 8 * i + 2 * (lane % 4) + 1];
      memcpy(&lo, r0 + 2 * (lane / 4), 2);
      memcpy(&hi, r1 + 2 * (lane / 4), 2);
    } else {
      const char *row = (const char *)(uintptr_t)B->slot[base + 8 * i + lane / 4];
      memcpy(&lo, row + 4 * (lane % 4), 2);
      memcpy(&hi, row + 4 * (lane % 4) + 2, 2);
    }
    r[i] = (uint32_t)lo | (uint32_t)hi << 16;
  }
  wait(B->warp[w]);
}

// Whether pred holds in every live lane of the calling thread's warp (__all_sync with a full mask).
inline bool warp_all(bool pred) {
  Block *B = blk;
  int t = B->cur, w = t / 32, base = w * 32;
  B->slot[t] = pred;
  wait(B->warp[w]);
  bool all = true;
  for (int u = base; u < base + 32 && u < B->nthreads; u++)
    all = all && (B->fibers[u].done || B->slot[u]);
  wait(B->warp[w]);
  return all;
}

} // namespace mdl_emu

// The prelude defines mdl_ldsm_x4 and mdl_ldsm_x4_t for the GPU only; these are the emulator's.
inline void mdl_ldsm_x4(uint32_t r[4], const void *p) { mdl_emu::ldsm_x4(r, p, false); }
inline void mdl_ldsm_x4_t(uint32_t r[4], const void *p) { mdl_emu::ldsm_x4(r, p, true); }

// The prelude defines mdl_mma_bf16_16816 for the GPU only; this is the emulator's.
inline void mdl_mma_bf16_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  mdl_emu::mma_bf16_16816(d, a, b);
}

// The prelude defines the cp.async helpers for the GPU only; these are the emulator's.
inline void mdl_cp_async16(void *dst, const void *src, bool in) { mdl_emu::cp_async(dst, src, 16, in); }
inline void mdl_cp_async4(void *dst, const void *src, bool in) { mdl_emu::cp_async(dst, src, 4, in); }
inline void mdl_cp_async_commit() { mdl_emu::cp_async_commit(); }
template <int N> inline void mdl_cp_async_wait() { mdl_emu::cp_async_wait(N); }

inline void __syncthreads() { mdl_emu::wait(mdl_emu::blk->block); }
inline void __syncwarp(unsigned = 0xffffffffu) { mdl_emu::wait(mdl_emu::blk->warp[mdl_emu::blk->cur / 32]); }

template <class T> T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  unsigned lane = (unsigned)mdl_emu::blk->cur % 32, src = lane ^ (unsigned)mask;
  if ((src & ~(unsigned)(width - 1)) != (lane & ~(unsigned)(width - 1)))
    src = lane;
  return mdl_emu::exchange(v, src);
}

inline bool __all_sync(unsigned, bool pred) { return mdl_emu::warp_all(pred); }
inline bool __any_sync(unsigned, bool pred) { return !mdl_emu::warp_all(!pred); }

template <class T> T __shfl_sync(unsigned, T v, int src, int width = 32) {
  unsigned lane = (unsigned)mdl_emu::blk->cur % 32;
  return mdl_emu::exchange(v, (lane & ~(unsigned)(width - 1)) + ((unsigned)src & (unsigned)(width - 1)));
}

#endif
