// permute.c: the order of an epoch, shuffled: a bijection of [0, n) chosen by (seed, epoch), a
// 4-round Feistel network over the next power of four, cycle-walked into range. It needs no table,
// so any position of any epoch is found in O(1): the shard loader (loader.c) and the array loader
// (arrays.c) both seek with it, and arrays.c holds its val examples out with it.
#include "data.h"

int64_t loader_permute(uint64_t seed, int64_t epoch, int64_t n, int64_t i) {
  int half = 1;
  while ((int64_t)1 << (2 * half) < n)
    half++;
  uint64_t mask = ((uint64_t)1 << half) - 1, x = (uint64_t)i;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; round++) {
      uint64_t f = mdl_rng_u64(seed, 0x6c6f61646572ull ^ ((uint64_t)epoch << 2 | round), right) & mask;
      uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = left << half | right;
  } while (x >= (uint64_t)n);
  return (int64_t)x;
}
