// Warp-level tensor-core primitives of the attention kernels (sm_80+): the m16n8k16 matrix
// product, ldmatrix loads from shared memory and cp.async copies into it, as inline PTX.
//
// Written by hand rather than with CuTe: a handful of instructions whose fragment layouts the
// kernels spell out in comments, no CUTLASS dependency or its compile time, and the same kernel
// source also builds for the host against the tests' CPU warp emulator (REMAT_WARP_EMULATOR,
// tests/cuda_emulator/), which implements exactly these functions (and __syncthreads and
// __shfl_xor_sync), so that the kernels' indexing is checked on a machine without a GPU.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 * g + t:
//   A, 16 x 16 (rows x k), 4 registers of two 16-bit values each:
//     a[0] = (g, 2t..2t+1)   a[1] = (g+8, 2t..2t+1)   a[2] = (g, 2t+8..2t+9)   a[3] = (g+8, 2t+8..2t+9)
//   B, 16 x 8 (k x cols), 2 registers:  b[0] = (2t..2t+1, g)   b[1] = (2t+8..2t+9, g)
//   C, D, 16 x 8 fp32, 4 values:  c[0..1] = (g, 2t..2t+1)   c[2..3] = (g+8, 2t..2t+1)
// ldmatrix .x4 loads four 8 x 8 matrices of 16-bit values: lanes 8i..8i+7 give the addresses of
// the 8 rows of matrix i (16 contiguous bytes each), and register i of lane l receives row l / 4,
// columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i; with .trans, of its transpose. .x2: two
// matrices, addresses from lanes 0..15.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(REMAT_WARP_EMULATOR)
#include "warp_emulator.h"  // the host versions of the functions below
#else

// The block's dynamic shared memory (its size is given at launch), as a TYPE array NAME.
#define REMAT_DYNAMIC_SMEM(TYPE, NAME) extern __shared__ __align__(16) TYPE NAME[]

namespace remat {
namespace tc {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// D += A B for a 16 x 16 A and a 16 x 8 B of T (__half or __nv_bfloat16), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Four 8 x 8 matrices; ROW: this lane's row address (see the layout above).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// Copies 16 bytes from global SRC to shared DST without holding registers; when !VALID, writes
// 16 zero bytes and reads nothing (SRC may then be any address).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}

// Closes the group of this thread's cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are still in flight (the newest N).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace tc
}  // namespace remat

#endif  // REMAT_WARP_EMULATOR

namespace remat {
namespace tc {

// Two fp32 values as one register of two T (round to nearest even), X in the low half.
template <typename T>
__host__ __device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

}  // namespace tc
}  // namespace remat
