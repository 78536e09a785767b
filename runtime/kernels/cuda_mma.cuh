// Tensor cores (mma.sync), ldmatrix and cp.async, and the bf16 pairs their fragments hold.

// Two floats rounded to bf16 and packed into one register, lo in the low half (the order of the
// elements of an mma fragment). On the GPU one cvt.rn.bf16x2.f32 (its second source is the low
// half), which rounds as mdl_f32_to_bf16 does but may give a NaN other bits.
__device__ __forceinline__ uint32_t mdl_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (uint32_t)mdl_f32_to_bf16(lo) | (uint32_t)mdl_f32_to_bf16(hi) << 16;
#endif
}

// Tensor cores (sm_80 and later): d += A B for one 16 x 8 tile, A 16 x 16 bf16 (row-major), B 16 x 8
// bf16 (column-major), d f32, computed by the warp together: every lane passes its fragments of A
// and B and gets its four elements of d. With g = lane >> 2 and t = lane & 3, a lane holds (PTX ISA,
// "Matrix Fragments for mma.m16n8k16 with floating point type"; a register holds two bf16, the
// lower column or row in its low half):
//   a[0] = A[g][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]    a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]    b[1] = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t], D[g][2t+1]    d[2], d[3] = D[g+8][2t], D[g+8][2t+1]
// So the accumulators of two adjacent tiles (columns 0-7, then 8-15), rounded and packed in pairs, are
// the A fragment of one k16 step: a[0], a[1] from the first's (d[0], d[1]), (d[2], d[3]); a[2], a[3]
// from the second's. The CUDA emulator (tests/unit/cuda_emu.h) has its own definition.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void mdl_mma_bf16_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// The 32-bit shared-memory address of a generic pointer into shared memory (ldmatrix, cp.async).
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ uint32_t mdl_smem(const void *p) {
  uint32_t a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
#endif

// Four 8 x 8 tiles of bf16 from shared memory, transposed, by the warp together (ldmatrix .trans):
// lanes 8 i .. 8 i + 7 each give the address of a row of tile i (8 values, 16-byte aligned), and
// r[i] of lane l holds that tile's rows 2 (l & 3) and 2 (l & 3) + 1 of column l >> 2 (the lower
// row in the low half). Of a tile whose rows are keys and columns channels, that is an mma B
// fragment register (b[0] or b[1] above) of the product over keys: one instruction for four
// registers that took four 16-bit loads and three shifts or ors each. mdl_ldsm_x4, the same without
// .trans: r[i] of lane l holds columns 2 (l & 3) and 2 (l & 3) + 1 of row l >> 2 of tile i; of the
// same tile, a B fragment register of the product over channels (Q K^T): b[0] or b[1] of key g.
// The emulator has its own.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void mdl_ldsm_x4_t(uint32_t r[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mdl_smem(p)) : "memory");
}
__device__ __forceinline__ void mdl_ldsm_x4(uint32_t r[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mdl_smem(p)) : "memory");
}
#endif

// Copies from global to shared memory that do not wait (cp.async, sm_80): 16 or 4 bytes from src to
// dst (both aligned to their size), or zeros unless in (src must still be a valid address). The
// thread's copies since the last mdl_cp_async_commit form a group; mdl_cp_async_wait<n> waits until
// at most the n latest groups are in flight. Other threads see the bytes after a barrier that
// follows the wait. The emulator has its own.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void mdl_cp_async16(void *dst, const void *src, bool in) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(mdl_smem(dst)), "l"(src), "r"(in ? 16 : 0) : "memory");
}
__device__ __forceinline__ void mdl_cp_async4(void *dst, const void *src, bool in) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
               :: "r"(mdl_smem(dst)), "l"(src), "r"(in ? 4 : 0) : "memory");
}
__device__ __forceinline__ void mdl_cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void mdl_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
#endif
