#!/usr/bin/env python3
"""How long a grid of causal attention blocks takes on a GPU's block slots, in the order it launches.

A GPU starts a kernel's blocks in index order, each on the first slot that frees up (a greedy list
schedule). Under causality the blocks of one (batch, head) differ in work: a query tile sees as many
key tiles as precede it, a key tile is seen by as many query tiles as follow it. This prints, for
GPT-2 124M's attention kernels on an H200 (B=8, 12 heads, T=1024; 132 SMs), the makespan over the
mean load of a slot with the tile fastest across blocks (each (batch, head) starting with its
heaviest tile: the emitter's order before) and with the tile slowest, heaviest first (its order now),
for each kernel at both of its block sizes (the emitted kernel and its variant). A block's cost is its
tiles plus one (loading its own rows, writing its output).

    python3 tools/block-schedule.py
"""
import heapq


def makespan(costs, slots):
    free = [0.0] * slots
    for c in costs:
        t = heapq.heappop(free)
        heapq.heappush(free, t + c)
    return max(free)


def kernel(name, tiles, bh, slots):
    """tiles: each block's tiles within one (batch, head), heaviest first."""
    fastest = [t + 1 for _ in range(bh) for t in tiles]  # (batch, head) slowest, tile fastest
    slowest = [t + 1 for t in tiles for _ in range(bh)]  # tile slowest, heaviest first
    mean = sum(fastest) / slots
    print("%-32s %5d blocks on %3d slots: tile fastest %.2f x the mean load, heaviest first %.2f x" %
          (name, len(fastest), slots, makespan(fastest, slots) / mean, makespan(slowest, slots) / mean))


BH, SMS = 8 * 12, 132
# forward: 128 query rows a block (8 query tiles), keys in tiles of 64: 16, 14, ..., 2; 2 blocks an SM
kernel("forward (128 queries a block)", [16 - 2 * i for i in range(8)], BH, 2 * SMS)
# dq: 64 query rows a block (16 tiles): 16, 15, ..., 1 key tiles; 3 blocks an SM (168 registers)
kernel("dq (64 queries a block)", [16 - i for i in range(16)], BH, 3 * SMS)
# dk, dv: 128 keys a block (8 tiles), queries in tiles of 64: 16, 14, ..., 2; 1 block an SM
kernel("dk, dv (128 keys a block)", [16 - 2 * i for i in range(8)], BH, SMS)
# The variants at the other block size, which the engine times against these on the device (sm_90
# registers: the forward's 128 allow 4 blocks of 4 warps an SM, dq's 225 one of 8, dk, dv's 240 two
# of 4). A variant's block does half (or twice) the rows' work a tile: the ratios compare each grid
# with its own mean, not one variant with the other.
kernel("forward, variant (64 queries)", [16 - i for i in range(16)], BH, 4 * SMS)
kernel("dq, variant (128 queries)", [16 - 2 * i for i in range(8)], BH, SMS)
kernel("dk, dv, variant (64 keys)", [16 - i for i in range(16)], BH, 2 * SMS)
