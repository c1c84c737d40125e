// Small device helpers shared by the remat CUDA kernels: fp32 conversion of the storage
// types, 16-byte vector packs, and deterministic warp/block sums.
#pragma once

#include <cstdint>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

// AT_DISPATCH over the storage types the kernels support (no double: fewer instantiations).
#define REMAT_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)           \
  AT_DISPATCH_SWITCH(TYPE, NAME,                              \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace remat {

constexpr int kWarpSize = 32;
constexpr int kMaxVecBytes = 16;

// ---------------------------------------------------------------------------------------------
// Conversions: all math is fp32; storage is float, c10::Half or c10::BFloat16.
// c10's conversions use the CUDA intrinsics (round to nearest even) in device code.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(c10::Half v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }

// ---------------------------------------------------------------------------------------------
// Vector packs: VEC consecutive elements loaded/stored as one (up to) 16-byte access.
// The caller guarantees the address is aligned to the pack's size (capped at 16 bytes).
// ---------------------------------------------------------------------------------------------
template <typename T>
constexpr int max_vec() { return kMaxVecBytes / static_cast<int>(sizeof(T)); }

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC > kMaxVecBytes ? kMaxVecBytes : sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Loads VEC elements of T at P as fp32 into OUT[0..VEC).
template <typename T, int VEC>
__device__ __forceinline__ void load_pack(const T* __restrict__ P, float* out) {
  const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(P);
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_float(p.v[j]);
}

// Loads VEC elements of T at P as one pack, unconverted (convert with to_float when used): a
// kernel that issues several loads before computing holds half the registers for 16-bit types.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_raw_pack(const T* __restrict__ P) {
  return *reinterpret_cast<const Pack<T, VEC>*>(P);
}

// Stores IN[0..VEC) (fp32) to P as VEC elements of T.
template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* __restrict__ P, const float* in) {
  Pack<T, VEC> p;
#pragma unroll
  for (int j = 0; j < VEC; ++j) p.v[j] = from_float<T>(in[j]);
  *reinterpret_cast<Pack<T, VEC>*>(P) = p;
}

// Fills OUT[0..VEC) with VALUE.
template <int VEC>
__device__ __forceinline__ void fill(float* out, float value) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = value;
}

// ---------------------------------------------------------------------------------------------
// Row loop of the elementwise tiles (host.h): thread (tx, ty) of block (bx, by) takes the rows
// by * BY + ty + k * G * BY (G = gridDim.y), UNROLL at a time: load(u, row) for each of them first,
// so all their loads are in flight together, then compute(u, row) for each. U indexes the caller's
// per-row registers (a compile-time constant once unrolled).
// ---------------------------------------------------------------------------------------------
template <int UNROLL, typename Load, typename Compute>
__device__ __forceinline__ void for_each_tile_row(int64_t M, Load&& load, Compute&& compute) {
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row0 < M;
       row0 += row_step * UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t row = row0 + u * row_step;
      if (row < M) load(u, row);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t row = row0 + u * row_step;
      if (row < M) compute(u, row);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Deterministic sums. The xor butterfly gives every lane the same bitwise result (each step
// adds the same two values, and fp32 addition is commutative), independent of scheduling.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ float2 warp_sum(float2 v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, m);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, m);
  }
  return v;
}

__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ float2 add(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }

// Sum over a 1-D block (blockDim.x a multiple of 32, at most 32 warps). Every thread returns the
// same value, summed over warps in a fixed order. BUF holds >= blockDim.x / 32 entries; it must
// not be written again until every thread has returned from this call (callers alternate
// between two buffers, so one __syncthreads per reduction suffices).
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* buf) {
  v = warp_sum(v);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  V total = buf[0];
  for (int w = 1; w < num_warps; ++w) total = add(total, buf[w]);
  return total;
}

// ---------------------------------------------------------------------------------------------
// Asynchronous 16-byte copies from global to shared memory (cp.async, sm_80+), for kernels that
// prefetch the next rows while computing on the current ones. Each thread waits only for its
// own copies, so a thread that reads back only what it copied needs no barrier. Older archs
// copy synchronously (same results).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(gmem));
#else
  *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}

// Closes the group of copies issued since the last commit (an empty group is allowed).
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most PENDING of this thread's committed groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
#endif
}

// ---------------------------------------------------------------------------------------------
// Second step of a deterministic column reduction: OUT[c] = sum_g P[g, c] over the G rows of
// fp32 partials that the first step's blocks wrote (one row each), in a fixed order: thread
// (x, y) sums rows g = y, y + kPartialSumRows, ..., then row y == 0 adds the kPartialSumRows
// thread sums in y order. Up to two (P, OUT) pairs in one launch (blockIdx.y picks the pair: dw
// and db of a LayerNorm). Block (kPartialSumCols, kPartialSumRows), grid (ceil(N /
// kPartialSumCols), pairs).
// ---------------------------------------------------------------------------------------------
constexpr int kPartialSumCols = 32;
constexpr int kPartialSumRows = 8;

template <typename Out>
__global__ void __launch_bounds__(kPartialSumCols * kPartialSumRows) sum_partial_rows_kernel(
    const float* __restrict__ P0,  // (G, N) fp32 partials of the first output
    Out* __restrict__ OUT0,        // (N,)
    const float* __restrict__ P1,  // (G, N) fp32 partials of the second output, or unused
    Out* __restrict__ OUT1,        // (N,), or unused
    int G, int N) {
  __shared__ float buf[kPartialSumRows][kPartialSumCols];
  const float* P = blockIdx.y == 0 ? P0 : P1;
  Out* OUT = blockIdx.y == 0 ? OUT0 : OUT1;
  const int col = blockIdx.x * kPartialSumCols + threadIdx.x;
  float s = 0.f;
  if (col < N) {
    for (int g = threadIdx.y; g < G; g += kPartialSumRows) s += P[static_cast<int64_t>(g) * N + col];
  }
  buf[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < N) {
    float total = buf[0][threadIdx.x];
#pragma unroll
    for (int r = 1; r < kPartialSumRows; ++r) total += buf[r][threadIdx.x];
    OUT[col] = from_float<Out>(total);
  }
}

// OUT_i (N,), in its own dtype, = the column sums of the (G, N) fp32 PARTIALS_i, in a fixed
// order, for each pair whose tensors are defined; one launch for both. Both outputs share a dtype.
inline void sum_partial_rows(const at::Tensor& partials0, at::Tensor& out0, const at::Tensor& partials1,
                             at::Tensor& out1, cudaStream_t stream) {
  const bool has0 = partials0.defined(), has1 = partials1.defined();
  if (!has0 && !has1) return;
  const at::Tensor& first_partials = has0 ? partials0 : partials1;
  at::Tensor& first_out = has0 ? out0 : out1;
  TORCH_CHECK(!(has0 && has1) || out0.scalar_type() == out1.scalar_type(),
              "sum_partial_rows: outputs of different dtypes");
  const int G = static_cast<int>(first_partials.size(0));
  const int N = static_cast<int>(first_partials.size(1));
  const dim3 block(kPartialSumCols, kPartialSumRows);
  const dim3 grid(static_cast<unsigned>((N + kPartialSumCols - 1) / kPartialSumCols), has0 && has1 ? 2 : 1);
  REMAT_DISPATCH_FLOAT_TYPES(first_out.scalar_type(), "remat_sum_partial_rows", [&] {
    scalar_t* second_out = has0 && has1 ? out1.data_ptr<scalar_t>() : nullptr;
    sum_partial_rows_kernel<scalar_t><<<grid, block, 0, stream>>>(
        first_partials.data_ptr<float>(), first_out.data_ptr<scalar_t>(),
        has0 && has1 ? partials1.data_ptr<float>() : nullptr, second_out, G, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The same for one (PARTIALS, OUT) pair.
inline void sum_partial_rows(const at::Tensor& partials, at::Tensor& out, cudaStream_t stream) {
  at::Tensor none;
  sum_partial_rows(partials, out, at::Tensor(), none, stream);
}

}  // namespace remat
