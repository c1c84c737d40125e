// Small kernels that check the warp emulator itself (tests/tools/test_warp_emulator.py calls them
// through ctypes). Each entry point returns 0, or -1 with the fault's message in `error`.
#include "tensor_core.cuh"

namespace {

using remat_emu::launch;
using remat_emu::report_errors;

// Each thread writes its threadIdx, blockIdx, blockDim and gridDim at out[12 * its global index].
__global__ void index_kernel(int* out) {
  int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int* mine = out + 12 * (block * blockDim.x * blockDim.y * blockDim.z + thread);
  const uint3 values[4] = {threadIdx, blockIdx, uint3{blockDim.x, blockDim.y, blockDim.z},
                           uint3{gridDim.x, gridDim.y, gridDim.z}};
  for (int i = 0; i < 4; ++i) {
    mine[3 * i] = values[i].x;
    mine[3 * i + 1] = values[i].y;
    mine[3 * i + 2] = values[i].z;
  }
}

// Lane l of warp w passes a[(32 w + l) * 4 ..], b[(32 w + l) * 2 ..] and accumulates into d[.. * 4].
template <typename T>
__global__ void mma_kernel(const uint32_t* a, const uint32_t* b, float* d) {
  int i = threadIdx.x;
  uint32_t ra[4] = {a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]};
  uint32_t rb[2] = {b[2 * i], b[2 * i + 1]};
  float rd[4] = {d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]};
  remat::tc::mma_16816<T>(rd, ra, rb);
  for (int j = 0; j < 4; ++j) d[4 * i + j] = rd[j];
}

// Shared memory holds its element index as uint16; lane l gives the row address smem + offsets[l].
__global__ void ldmatrix_kernel(const int* offsets, int smem_elements, bool transpose, uint32_t* out) {
  REMAT_DYNAMIC_SMEM(uint16_t, smem);
  for (int e = threadIdx.x; e < smem_elements; e += blockDim.x) smem[e] = static_cast<uint16_t>(e);
  __syncthreads();
  uint32_t r[4];
  if (transpose) {
    remat::tc::ldmatrix_x4_trans(r, smem + offsets[threadIdx.x]);
  } else {
    remat::tc::ldmatrix_x4(r, smem + offsets[threadIdx.x]);
  }
  for (int i = 0; i < 4; ++i) out[4 * threadIdx.x + i] = r[i];
}

__global__ void shfl_kernel(unsigned mask, int lane_mask, float* f, int* n, unsigned* u) {
  int i = threadIdx.x;
  f[i] = __shfl_xor_sync(mask, f[i], lane_mask);
  n[i] = __shfl_xor_sync(mask, n[i], lane_mask);
  u[i] = __shfl_xor_sync(mask, u[i], lane_mask);
}

// Each thread owns three 16-byte slots of shared memory (copy a, copy b, a zero fill) and records
// their words in seen[thread][stage][slot][4] at each stage of a cp.async pipeline:
//   0: untouched (the launch's fill)          1: after its own stores of `old` and issuing the copies
//   2: after cp_async_wait<1> (a landed)      3: after cp_async_wait<0> (b landed, the zero fill is
//   not committed)                            4: after a commit and cp_async_wait<0> (zeros)
constexpr int kCopyStages = 5;
__global__ void cp_async_kernel(const uint32_t* src, uint32_t old, uint32_t* seen) {
  REMAT_DYNAMIC_SMEM(uint32_t, smem);
  int i = threadIdx.x;
  uint32_t* slots = smem + 12 * i;
  auto record = [&](int stage) {
    for (int w = 0; w < 12; ++w) seen[(i * kCopyStages + stage) * 12 + w] = slots[w];
  };
  record(0);
  for (int w = 0; w < 12; ++w) slots[w] = old;
  remat::tc::cp_async_16(slots, src + 8 * i, true);
  remat::tc::cp_async_commit();
  remat::tc::cp_async_16(slots + 4, src + 8 * i + 4, true);
  remat::tc::cp_async_commit();
  remat::tc::cp_async_16(slots + 8, nullptr, false);
  record(1);
  remat::tc::cp_async_wait<1>();
  record(2);
  remat::tc::cp_async_wait<0>();
  record(3);
  remat::tc::cp_async_commit();
  remat::tc::cp_async_wait<0>();
  record(4);
}

// One cp.async by thread 0 to smem + dst_offset from src + src_offset (bytes), then a wait.
__global__ void cp_async_one_kernel(const char* src, int dst_offset, int src_offset) {
  REMAT_DYNAMIC_SMEM(char, smem);
  if (threadIdx.x == 0) {
    remat::tc::cp_async_16(smem + dst_offset, src + src_offset, true);
    remat::tc::cp_async_commit();
    remat::tc::cp_async_wait<0>();
  }
}

__global__ void early_exit_kernel() {
  if (threadIdx.x >= 32) return;
  __syncthreads();
}

__global__ void exit_before_barrier_kernel() {
  if (threadIdx.x < 32) return;
  __syncthreads();
}

__global__ void split_warp_kernel() {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __shfl_xor_sync(0xFFFFFFFFu, 1.0f, 1);
  }
}

__global__ void mixed_collectives_kernel() {
  if (threadIdx.x % 2 == 0) {
    __shfl_xor_sync(0xFFFFFFFFu, 1.0f, 1);
  } else {
    uint32_t r[4];
    REMAT_DYNAMIC_SMEM(char, smem);
    remat::tc::ldmatrix_x4(r, smem);
  }
}

__global__ void partial_warp_kernel() { __shfl_xor_sync(0xFFFFFFFFu, 1.0f, 1); }

// A load like the attention kernels': per iteration a butterfly shuffle (v moves to lane l ^ m,
// then + 1) and an mma of all-ones fragments (each accumulator + 16), a barrier every 16.
__global__ void busy_kernel(int iterations, float* values, float* accumulators) {
  int i = (blockIdx.x * blockDim.x + threadIdx.x);
  float v = static_cast<float>(threadIdx.x % 32);
  float d[4] = {0, 0, 0, 0};
  uint32_t ones = remat::tc::pack2<__half>(1.0f, 1.0f);
  uint32_t a[4] = {ones, ones, ones, ones}, b[2] = {ones, ones};
  for (int k = 0; k < iterations; ++k) {
    v = __shfl_xor_sync(0xFFFFFFFFu, v, 1 << (k % 5)) + 1.0f;
    remat::tc::mma_16816<__half>(d, a, b);
    if (k % 16 == 15) __syncthreads();
  }
  values[i] = v;
  accumulators[i] = d[0] + d[1] + d[2] + d[3];
}

}  // namespace

extern "C" {

int selftest_indices(const unsigned* grid, const unsigned* block, int* out, char* error, int error_bytes) {
  return report_errors(error, error_bytes, [&] {
    launch(index_kernel, dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), 0, out);
  });
}

int selftest_mma(int bf16, int warps, const uint32_t* a, const uint32_t* b, float* d, char* error, int error_bytes) {
  return report_errors(error, error_bytes, [&] {
    auto kernel = bf16 ? mma_kernel<__nv_bfloat16> : mma_kernel<__half>;
    launch(kernel, dim3(1), dim3(32 * warps), 0, a, b, d);
  });
}

int selftest_ldmatrix(const int* offsets, int smem_elements, int transpose, uint32_t* out, char* error,
                      int error_bytes) {
  return report_errors(error, error_bytes, [&] {
    launch(ldmatrix_kernel, dim3(1), dim3(32), 2 * static_cast<size_t>(smem_elements), offsets, smem_elements,
           transpose != 0, out);
  });
}

// The extra passes of the ldmatrix calls since the last call (remat_emu::take_ldmatrix_extra_passes).
uint64_t selftest_take_ldmatrix_extra_passes() { return remat_emu::take_ldmatrix_extra_passes(); }

int selftest_shfl_xor(int threads, unsigned mask, int lane_mask, float* f, int* n, unsigned* u, char* error,
                      int error_bytes) {
  return report_errors(error, error_bytes,
                       [&] { launch(shfl_kernel, dim3(1), dim3(threads), 0, mask, lane_mask, f, n, u); });
}

int selftest_cp_async(const uint32_t* src, uint32_t old, uint32_t* seen, char* error, int error_bytes) {
  return report_errors(error, error_bytes, [&] { launch(cp_async_kernel, dim3(1), dim3(32), 32 * 48, src, old, seen); });
}

// With readable_bytes >= 0, src's first readable_bytes bytes are the only readable global memory.
int selftest_cp_async_one(const char* src, int readable_bytes, int smem_bytes, int dst_offset, int src_offset,
                          char* error, int error_bytes) {
  return report_errors(error, error_bytes, [&] {
    std::vector<remat_emu::GlobalBuffer> readable;
    if (readable_bytes >= 0) readable.push_back({src, static_cast<size_t>(readable_bytes), "src"});
    remat_emu::ReadableGlobalMemory scope(readable);
    launch(cp_async_one_kernel, dim3(1), dim3(32), smem_bytes, src, dst_offset, src_offset);
  });
}

// Kernels that break a rule: 0 early exit, 1 exit before a barrier, 2 a warp split between a
// barrier and a shuffle, 3 lanes calling different collectives, 4 a collective in a 48-thread block.
int selftest_fault(int which, char* error, int error_bytes) {
  return report_errors(error, error_bytes, [&] {
    switch (which) {
      case 0: launch(early_exit_kernel, dim3(2), dim3(64), 0); break;
      case 1: launch(exit_before_barrier_kernel, dim3(1), dim3(64), 0); break;
      case 2: launch(split_warp_kernel, dim3(1), dim3(32), 0); break;
      case 3: launch(mixed_collectives_kernel, dim3(1), dim3(32), 64); break;
      case 4: launch(partial_warp_kernel, dim3(1), dim3(48), 0); break;
      default: throw std::invalid_argument("selftest_fault: no case " + std::to_string(which));
    }
  });
}

// The conversions the kernels use, on host: pairs packed by remat::tc::pack2 (__floats2half2_rn,
// __floats2bfloat162_rn), single values by __float2half_rn / __float2bfloat16_rn, and back.
void selftest_conversions(const float* x, int n, uint32_t* half_pairs, uint32_t* bf16_pairs, float* half_back,
                          float* bf16_back) {
  for (int i = 0; i + 1 < n; i += 2) {
    half_pairs[i / 2] = remat::tc::pack2<__half>(x[i], x[i + 1]);
    bf16_pairs[i / 2] = remat::tc::pack2<__nv_bfloat16>(x[i], x[i + 1]);
  }
  for (int i = 0; i < n; ++i) {
    half_back[i] = __half2float(__float2half_rn(x[i]));
    bf16_back[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
  }
}

// Lets the fault escape: the process aborts with the message (what an unguarded caller sees).
void selftest_unguarded_fault() { launch(early_exit_kernel, dim3(1), dim3(64), 0); }

int selftest_busy(int blocks, int threads, int iterations, float* values, float* accumulators, char* error,
                  int error_bytes) {
  return report_errors(error, error_bytes, [&] {
    launch(busy_kernel, dim3(blocks), dim3(threads), 0, iterations, values, accumulators);
  });
}

}  // extern "C"
