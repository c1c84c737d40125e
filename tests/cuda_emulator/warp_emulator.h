// A CPU emulator of the CUDA surface the tensor-core kernels use, so that their indexing, fragment
// layouts, masking and cp.async pipelining run (and are tested) on a machine without a GPU.
//
// csrc/tensor_core.cuh includes this header instead of its inline PTX when REMAT_WARP_EMULATOR is
// defined; the kernel sources then build with g++ as ordinary host code (__global__ and the other
// qualifiers expand to nothing) and remat_emu::launch runs them:
//   - every CUDA thread of a block is a fiber (its own stack) on the calling host thread; the
//     fibers run round-robin in thread-index order, each until it blocks at a warp collective or
//     __syncthreads or exits. Blocks run one after another, so a launch is deterministic.
//   - a warp collective (mma_16816, ldmatrix_x4[_trans], __shfl_xor_sync) waits for all 32 lanes
//     of the warp; the last lane to arrive computes the result for all of them.
//   - cp_async_16 is deferred: its 16 bytes land in shared memory only when the issuing thread's
//     cp_async_wait<N> retires the copy's group, so a read before the wait sees the old bytes.
//   - each block's dynamic shared memory starts filled with 0xFF bytes (NaN as fp16, bf16 and
//     fp32), so a read of shared memory nobody wrote shows up as NaN; a guard page after its end
//     turns a store past the end into a crash rather than silent corruption.
//   - ldmatrix's bank conflicts are counted (take_ldmatrix_extra_passes), as passes a matrix
//     takes beyond one: the one property of speed the emulator sees exactly.
// A fault (a misaligned or out-of-bounds ldmatrix or cp.async address, lanes of one warp calling
// different collectives, a thread exiting while others wait for it, a deadlock) stops the launch:
// launch throws remat_emu::KernelFault with a message that names the check, the thread and the
// address. Uncaught, that aborts the program with the message (std::terminate prints what()).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <device_launch_parameters.h>  // declares threadIdx & co., before the macros below name them
#include <sys/mman.h>
#include <unistd.h>
#include <vector_types.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if !defined(__x86_64__) || defined(REMAT_EMU_UCONTEXT)
#define REMAT_EMU_USE_UCONTEXT 1
#include <ucontext.h>
#endif

// The CUDA headers define __global__, __device__, __host__ and __forceinline__ for a host
// compiler (the first three as nothing); __launch_bounds__ only under nvcc.
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
// Static __shared__ arrays would be per-thread locals here: the kernels must use REMAT_DYNAMIC_SMEM.
#undef __shared__
#define __shared__ _Pragma("GCC error \"the warp emulator has no static __shared__ memory: use REMAT_DYNAMIC_SMEM\"")

#define REMAT_DYNAMIC_SMEM(TYPE, NAME) TYPE* NAME = reinterpret_cast<TYPE*>(::remat_emu::dynamic_shared_memory())

namespace remat_emu {

// A kernel broke a rule of the CUDA programming model that the emulator checks.
struct KernelFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A global buffer that cp_async_16 may read (see ReadableGlobalMemory).
struct GlobalBuffer {
  const void* data;
  size_t bytes;
  const char* name;
};

namespace detail {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 256 * 1024;  // per CUDA thread; pages are committed only when touched

// ---- Execution contexts: a saved stack pointer (x86-64) or a ucontext (elsewhere) ----

struct Context {
#if REMAT_EMU_USE_UCONTEXT
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

[[noreturn]] inline void fiber_main();

#if REMAT_EMU_USE_UCONTEXT
inline void prepare_context(Context& c, char* stack, size_t bytes) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, fiber_main, 0);
}
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#else
// glibc's swapcontext also saves the signal mask (a system call, ~0.3 us); a warp collective
// costs 64 switches, so on x86-64 the switch is these few instructions: push the callee-saved
// registers, store the stack pointer in *FROM, load TO, pop and return into the other context.
// (The floating-point control registers are not switched: every context shares their settings.)
[[gnu::naked, gnu::noinline]] inline void switch_stack(void** /*from*/, void* /*to*/) {
  asm("pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
// A stack that switch_stack "returns" into fiber_main from: six zero registers, then the return
// address; fiber_main starts with the stack pointer 8 below a 16-byte boundary, as after a call.
inline void prepare_context(Context& c, char* stack, size_t bytes) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15};
  auto* slots = reinterpret_cast<void**>(top - 64);
  for (int i = 0; i < 6; ++i) slots[i] = nullptr;
  slots[6] = reinterpret_cast<void*>(&fiber_main);
  slots[7] = nullptr;
  c.sp = slots;
}
// The memory barriers keep the compiler from caching across the switch what other fibers write
// meanwhile (a collective's results land in the waiting lanes' variables).
inline void switch_context(Context& from, Context& to) {
  asm volatile("" ::: "memory");
  switch_stack(&from.sp, to.sp);
  asm volatile("" ::: "memory");
}
#endif

// ---- Memory: page-guarded mappings for the fibers' stacks and the shared memory ----

inline size_t page_bytes() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
inline size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// An anonymous mapping freed with its owner.
class Mapping {
 public:
  explicit Mapping(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("remat_emu: mmap of " + std::to_string(bytes) + " bytes failed");
    data_ = static_cast<char*>(p);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data_) munmap(data_, bytes_);
  }
  char* data() const { return data_; }
  void guard(size_t offset, size_t bytes) const { mprotect(data_ + offset, bytes, PROT_NONE); }

 private:
  char* data_;
  size_t bytes_;
};

// ---- The state of a block's threads ----

enum class State { runnable, at_barrier, at_warp_collective, finished };

struct PendingCopy {
  unsigned char* dst;
  unsigned char bytes[16];
  int group;  // index of the commit group it belongs to (== commits so far when issued)
};

struct Thread {
  Context context;
  uint3 index;
  int linear = 0;
  State state = State::runnable;
  std::vector<PendingCopy> copies;  // cp.async copies issued and not landed yet, oldest first
  int commits = 0;                  // cp_async_commit calls so far
};

struct Warp {
  const char* collective = nullptr;  // what the lanes that arrived called
  int arrived = 0;
  void* lane_args[kWarpSize] = {};   // each lane's arguments, on that lane's stack
};

struct Block {
  uint3 index;
  dim3 grid, block;
  char* smem = nullptr;
  size_t smem_bytes = 0;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  int at_barrier = 0;
  int finished = 0;
  std::string fault;  // set by the first fault; the launch stops
  const std::function<void()>* body = nullptr;
  Context scheduler;
};

inline thread_local Block* current_block = nullptr;
inline thread_local Thread* current_thread = nullptr;
inline thread_local const std::vector<GlobalBuffer>* readable_global = nullptr;

inline Block& block() { return *current_block; }
inline Thread& thread() { return *current_thread; }

inline std::string where(const Thread& t) {
  const Block& b = block();
  char s[160];
  snprintf(s, sizeof s, "block (%u,%u,%u) thread %d (threadIdx (%u,%u,%u), warp %d lane %d)", b.index.x, b.index.y,
           b.index.z, t.linear, t.index.x, t.index.y, t.index.z, t.linear / kWarpSize, t.linear % kWarpSize);
  return s;
}

// Stops the launch: records MESSAGE and returns to the scheduler for good.
[[noreturn]] inline void fault(const std::string& message) {
  Block& b = block();
  if (b.fault.empty()) b.fault = "remat_emu: " + message;
  thread().state = State::finished;
  switch_context(thread().context, b.scheduler);
  __builtin_unreachable();
}

// Gives the host thread back to the scheduler until this thread is runnable again.
inline void wait_as(State state) {
  thread().state = state;
  switch_context(thread().context, block().scheduler);
}

// ---- Checks of addresses ----

inline std::string address_text(const void* p) {
  char s[32];
  snprintf(s, sizeof s, "%p", p);
  return s;
}

inline std::string hex_text(unsigned v) {
  char s[16];
  snprintf(s, sizeof s, "0x%08x", v);
  return s;
}

// Faults unless the 16 bytes at P are 16-byte aligned and inside the dynamic shared memory.
inline void check_shared_16(const void* p, const char* what, const Thread& t) {
  const Block& b = block();
  auto offset = static_cast<long long>(static_cast<const char*>(p) - b.smem);
  std::string detail = address_text(p) + " (shared memory offset " + std::to_string(offset) + " of " +
                       std::to_string(b.smem_bytes) + " bytes) at " + where(t);
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) fault(std::string(what) + " is not 16-byte aligned: " + detail);
  if (offset < 0 || static_cast<size_t>(offset) + 16 > b.smem_bytes)
    fault(std::string(what) + " is not inside the block's dynamic shared memory: " + detail);
}

// Faults unless the 16 bytes at P are 16-byte aligned and, when readable buffers are declared,
// inside one of them.
inline void check_global_16(const void* p, const char* what, const Thread& t) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    fault(std::string(what) + " " + address_text(p) + " is not 16-byte aligned at " + where(t));
  if (!readable_global) return;
  auto* c = static_cast<const char*>(p);
  std::string buffers;
  for (const GlobalBuffer& g : *readable_global) {
    auto* begin = static_cast<const char*>(g.data);
    if (c >= begin && c + 16 <= begin + g.bytes) return;
    buffers += std::string(buffers.empty() ? "" : ", ") + g.name + " [" + address_text(begin) + ", +" +
               std::to_string(g.bytes) + ")";
  }
  fault(std::string(what) + " " + address_text(p) + " is outside every readable global buffer (" + buffers +
        ") at " + where(t));
}

// ---- Warp collectives and the block barrier ----

// Waits until all 32 lanes of this thread's warp have called the collective NAME (each with its
// own ARGS), then the last lane to arrive runs execute(lanes), lanes[l] pointing at lane l's ARGS.
template <class Args, class Execute>
void warp_collective(const char* name, Args& args, Execute&& execute) {
  Block& b = block();
  Thread& t = thread();
  int warp_index = t.linear / kWarpSize, lane = t.linear % kWarpSize;
  if ((warp_index + 1) * kWarpSize > static_cast<int>(b.threads.size()))
    fault(std::string(name) + " in a warp of fewer than 32 threads (the block has " +
          std::to_string(b.threads.size()) + ") at " + where(t));
  Warp& w = b.warps[warp_index];
  if (w.arrived > 0 && std::strcmp(w.collective, name) != 0)
    fault(std::string(name) + " called while " + std::to_string(w.arrived) + " other lane(s) of the warp wait at " +
          w.collective + ", at " + where(t));
  w.collective = name;
  w.lane_args[lane] = &args;
  if (++w.arrived < kWarpSize) {
    wait_as(State::at_warp_collective);
    return;
  }
  Args* lanes[kWarpSize];
  for (int l = 0; l < kWarpSize; ++l) lanes[l] = static_cast<Args*>(w.lane_args[l]);
  execute(lanes);
  w.arrived = 0;
  for (int l = 0; l < kWarpSize; ++l) b.threads[warp_index * kWarpSize + l].state = State::runnable;
}

inline void block_barrier() {
  Block& b = block();
  Thread& t = thread();
  if (b.finished > 0)
    fault("__syncthreads after " + std::to_string(b.finished) +
          " thread(s) of the block exited (they never arrive), at " + where(t));
  if (++b.at_barrier < static_cast<int>(b.threads.size())) {
    wait_as(State::at_barrier);
    return;
  }
  b.at_barrier = 0;
  for (Thread& other : b.threads) other.state = State::runnable;
}

inline const char* waits_at(const Block& b, size_t thread) {
  switch (b.threads[thread].state) {
    case State::at_barrier: return "__syncthreads";
    case State::at_warp_collective: return b.warps[thread / kWarpSize].collective;
    case State::finished: return "exited";
    default: return "runnable";
  }
}

// What the threads of a block that cannot go on wait at, as ranges of threads.
inline std::string describe_waits(const Block& b) {
  std::string text;
  for (size_t i = 0; i < b.threads.size();) {
    size_t j = i;
    while (j + 1 < b.threads.size() && std::strcmp(waits_at(b, j + 1), waits_at(b, i)) == 0) ++j;
    text += "\n  threads " + std::to_string(i) + "-" + std::to_string(j) + ": " + waits_at(b, i);
    i = j + 1;
  }
  return text;
}

// The first code every fiber runs: the kernel, then the checks that nobody waits for this thread.
// Copies still in flight when a thread exits never land (nobody can wait for them).
[[noreturn]] inline void fiber_main() {
  (*block().body)();
  Block& b = block();
  Thread& t = thread();
  Warp& w = b.warps[t.linear / kWarpSize];
  if (w.arrived > 0)
    fault("thread exits while " + std::to_string(w.arrived) + " lanes of its warp wait for it at " + w.collective +
          ", at " + where(t));
  if (b.at_barrier > 0)
    fault("thread exits while " + std::to_string(b.at_barrier) + " threads wait for it at __syncthreads, at " +
          where(t));
  t.state = State::finished;
  ++b.finished;
  switch_context(t.context, b.scheduler);
  __builtin_unreachable();
}

// The index of the I-th thread (or block) of D, x fastest.
inline uint3 unflatten(size_t i, dim3 d) {
  return {static_cast<unsigned>(i % d.x), static_cast<unsigned>(i / d.x % d.y), static_cast<unsigned>(i / d.x / d.y)};
}

// Runs every thread of the current block to its end; returns the fault message ("" if none).
inline std::string run_block(Block& b, char* stacks, size_t stride) {
  for (size_t i = 0; i < b.threads.size(); ++i) {
    Thread& t = b.threads[i];
    t.state = State::runnable;
    t.copies.clear();
    t.commits = 0;
    prepare_context(t.context, stacks + i * stride + page_bytes(), kStackBytes);
  }
  for (Warp& w : b.warps) w = Warp{};
  b.at_barrier = b.finished = 0;
  std::memset(b.smem, 0xFF, b.smem_bytes);
  while (b.finished < static_cast<int>(b.threads.size())) {
    bool ran = false;
    for (Thread& t : b.threads) {
      if (t.state != State::runnable) continue;
      ran = true;
      current_thread = &t;
      switch_context(b.scheduler, t.context);
      if (!b.fault.empty()) return b.fault;
    }
    if (!ran) {
      char s[64];
      snprintf(s, sizeof s, "deadlock in block (%u,%u,%u):", b.index.x, b.index.y, b.index.z);
      return "remat_emu: " + std::string(s) + describe_waits(b);
    }
  }
  return "";
}

}  // namespace detail

// The current block's dynamic shared memory (16-byte aligned, smem_bytes long).
inline void* dynamic_shared_memory() { return detail::block().smem; }

// Bank conflicts of ldmatrix. Shared memory has 32 banks of 4 bytes: an 8 x 8 matrix (8 rows of
// 16 bytes) is read in one pass when its rows fall in 8 different 16-byte groups of banks
// (shared offset / 16 % 8), rows at one address counting once (a broadcast). Each pass more that
// a matrix takes, the most rows at distinct addresses in one group minus one, is counted here.
namespace detail {
inline std::atomic<uint64_t>& ldmatrix_extra_passes() {
  static std::atomic<uint64_t> passes{0};
  return passes;
}
}  // namespace detail

// The extra ldmatrix passes counted since the last call (on any host thread), and resets them.
inline uint64_t take_ldmatrix_extra_passes() { return detail::ldmatrix_extra_passes().exchange(0); }

// While alive, every cp_async_16 with valid=true on this host thread must read inside BUFFERS.
class ReadableGlobalMemory {
 public:
  explicit ReadableGlobalMemory(std::vector<GlobalBuffer> buffers) : buffers_(std::move(buffers)) {
    previous_ = detail::readable_global;
    detail::readable_global = &buffers_;
  }
  ReadableGlobalMemory(const ReadableGlobalMemory&) = delete;
  ReadableGlobalMemory& operator=(const ReadableGlobalMemory&) = delete;
  ~ReadableGlobalMemory() { detail::readable_global = previous_; }

 private:
  std::vector<GlobalBuffer> buffers_;
  const std::vector<GlobalBuffer>* previous_;
};

// Runs kernel(args...) as a grid of GRID blocks of BLOCK threads with SMEM_BYTES of dynamic
// shared memory each; throws KernelFault on the first fault.
template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem_bytes, const Args&... args) {
  size_t threads = size_t{block.x} * block.y * block.z;
  size_t blocks = size_t{grid.x} * grid.y * grid.z;
  if (threads == 0 || threads > 1024)
    throw KernelFault("remat_emu: launch with " + std::to_string(threads) + " threads a block (1 to 1024)");
  if (blocks == 0) throw KernelFault("remat_emu: launch of an empty grid");
  const std::function<void()> body = [&] { kernel(args...); };

  size_t page = detail::page_bytes();
  size_t stride = page + detail::kStackBytes;  // a guard page below each stack
  detail::Mapping stacks(threads * stride);
  for (size_t i = 0; i < threads; ++i) stacks.guard(i * stride, page);
  // The shared memory ends where a guard page begins; its size rounded to 16 keeps it aligned.
  size_t smem_span = detail::round_up(detail::round_up(smem_bytes, 16), page);
  detail::Mapping smem(smem_span + page);
  smem.guard(smem_span, page);

  detail::Block b;
  b.grid = grid;
  b.block = block;
  b.smem_bytes = smem_bytes;
  b.smem = smem.data() + smem_span - detail::round_up(smem_bytes, 16);
  b.threads.resize(threads);
  for (size_t i = 0; i < threads; ++i) {
    b.threads[i].linear = static_cast<int>(i);
    b.threads[i].index = detail::unflatten(i, block);
  }
  b.warps.resize((threads + detail::kWarpSize - 1) / detail::kWarpSize);
  b.body = &body;

  detail::Block* outer_block = detail::current_block;
  detail::Thread* outer_thread = detail::current_thread;
  detail::current_block = &b;
  std::string fault;
  for (size_t i = 0; i < blocks && fault.empty(); ++i) {
    b.index = detail::unflatten(i, grid);
    fault = detail::run_block(b, stacks.data(), stride);
  }
  detail::current_block = outer_block;
  detail::current_thread = outer_thread;
  if (!fault.empty()) throw KernelFault(fault);
}

// Runs F for a C entry point: returns 0, or -1 with the message of the exception (a KernelFault,
// or a bad argument) in MESSAGE, BYTES long at most.
template <class F>
int report_errors(char* message, size_t bytes, F&& f) {
  try {
    f();
    if (bytes > 0) message[0] = 0;
    return 0;
  } catch (const std::exception& e) {
    snprintf(message, bytes, "%s", e.what());
    return -1;
  }
}

}  // namespace remat_emu

// ---- The CUDA built-ins, as the current thread sees them ----

#define threadIdx (static_cast<const uint3&>(::remat_emu::detail::thread().index))
#define blockIdx (static_cast<const uint3&>(::remat_emu::detail::block().index))
#define blockDim (static_cast<const dim3&>(::remat_emu::detail::block().block))
#define gridDim (static_cast<const dim3&>(::remat_emu::detail::block().grid))
#define warpSize 32

inline void __syncthreads() { remat_emu::detail::block_barrier(); }

// fp32 atomicAdd (to global memory, as the one-pass backward's dQ): a fiber runs until it blocks
// at a collective or a barrier, so a plain read-modify-write is never interleaved with another.
inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}

namespace remat_emu::detail {

// Lane l receives the value of lane l ^ (the low 5 bits of its lane_mask): PTX shfl.sync.bfly, width 32.
template <class T>
T shfl_xor(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) == 4 && std::is_trivially_copyable_v<T>);
  if (mask != 0xFFFFFFFFu)
    fault("__shfl_xor_sync with mask " + hex_text(mask) + ": the emulator takes the full mask only, at " +
          where(thread()));
  struct Args {
    T value;
    int lane_mask;
    T result;
  } args{value, lane_mask, value};
  warp_collective("__shfl_xor_sync", args, [](Args* const* lanes) {
    for (int l = 0; l < kWarpSize; ++l) lanes[l]->result = lanes[l ^ (lanes[l]->lane_mask & 31)]->value;
  });
  return args.result;
}

}  // namespace remat_emu::detail

inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
  return remat_emu::detail::shfl_xor(mask, v, lane_mask);
}
inline int __shfl_xor_sync(unsigned mask, int v, int lane_mask) {
  return remat_emu::detail::shfl_xor(mask, v, lane_mask);
}
inline unsigned __shfl_xor_sync(unsigned mask, unsigned v, int lane_mask) {
  return remat_emu::detail::shfl_xor(mask, v, lane_mask);
}

// ---- The tensor-core primitives of tensor_core.cuh ----

namespace remat::tc {

namespace emulated {

// The value of one 16-bit half (HIGH: bits 16..31) of REGISTER, as a T.
template <typename T>
float half_of(uint32_t reg, bool high) {
  auto bits = static_cast<unsigned short>(high ? reg >> 16 : reg & 0xFFFF);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
  } else {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
  }
}

template <typename T>
constexpr const char* mma_name() {
  return std::is_same_v<T, __nv_bfloat16> ? "mma_16816<__nv_bfloat16>" : "mma_16816<__half>";
}

// Adds the extra passes the four matrices of one ldmatrix take (see take_ldmatrix_extra_passes).
template <class Lane>
void count_bank_conflicts(Lane* const* lanes) {
  const char* smem = static_cast<const char*>(remat_emu::dynamic_shared_memory());
  uint64_t extra = 0;
  for (int matrix = 0; matrix < 4; ++matrix) {
    long long units[8];  // the rows' 16-byte units of shared memory
    int addresses[8] = {};  // distinct row addresses in each bank group
    for (int r = 0; r < 8; ++r) {
      units[r] = (static_cast<const char*>(lanes[8 * matrix + r]->row) - smem) / 16;
      bool repeated = false;
      for (int e = 0; e < r; ++e) repeated = repeated || units[e] == units[r];
      if (!repeated) ++addresses[units[r] % 8];
    }
    int passes = 1;
    for (int group = 0; group < 8; ++group) passes = addresses[group] > passes ? addresses[group] : passes;
    extra += passes - 1;
  }
  remat_emu::detail::ldmatrix_extra_passes() += extra;
}

// The four 8 x 8 matrices whose rows the 32 lanes' ROW addresses give; lane l receives in r[i]
// row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i (TRANSPOSE: of its transpose).
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool transpose) {
  struct Args {
    const void* row;
    uint32_t* r;
  } args{row, r};
  namespace d = remat_emu::detail;
  const char* name = transpose ? "ldmatrix_x4_trans" : "ldmatrix_x4";
  d::warp_collective(name, args, [&](Args* const* lanes) {
    d::Thread* warp_threads = &d::thread() - d::thread().linear % d::kWarpSize;
    for (int l = 0; l < d::kWarpSize; ++l)
      d::check_shared_16(lanes[l]->row, (std::string(name) + " row address").c_str(), warp_threads[l]);
    count_bank_conflicts(lanes);
    auto element = [&](int matrix, int row, int col) {
      uint16_t v;
      std::memcpy(&v, static_cast<const char*>(lanes[8 * matrix + row]->row) + 2 * col, 2);
      return uint32_t{v};
    };
    for (int l = 0; l < d::kWarpSize; ++l) {
      int row = l / 4, col = 2 * (l % 4);
      for (int i = 0; i < 4; ++i) {
        lanes[l]->r[i] = transpose ? element(i, col, row) | element(i, col + 1, row) << 16
                                   : element(i, row, col) | element(i, row, col + 1) << 16;
      }
    }
  });
}

}  // namespace emulated

// D += A B for a 16 x 16 A and a 16 x 8 B of T: the products are exact in fp32 (11- or 8-bit
// significands), summed in fp32 in k order onto the accumulator.
template <typename T>
void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Args {
    float* d;
    const uint32_t* a;
    const uint32_t* b;
  } args{d, a, b};
  remat_emu::detail::warp_collective(emulated::mma_name<T>(), args, [](Args* const* lanes) {
    float A[16][16], B[16][8], D[16][8];
    for (int lane = 0; lane < 32; ++lane) {
      int g = lane / 4, t = lane % 4;
      const Args& x = *lanes[lane];
      for (int j = 0; j < 2; ++j) {  // j: the low or high half of a register
        A[g][2 * t + j] = emulated::half_of<T>(x.a[0], j);
        A[g + 8][2 * t + j] = emulated::half_of<T>(x.a[1], j);
        A[g][2 * t + 8 + j] = emulated::half_of<T>(x.a[2], j);
        A[g + 8][2 * t + 8 + j] = emulated::half_of<T>(x.a[3], j);
        B[2 * t + j][g] = emulated::half_of<T>(x.b[0], j);
        B[2 * t + 8 + j][g] = emulated::half_of<T>(x.b[1], j);
        D[g][2 * t + j] = x.d[j];
        D[g + 8][2 * t + j] = x.d[2 + j];
      }
    }
    for (int i = 0; i < 16; ++i)
      for (int n = 0; n < 8; ++n)
        for (int k = 0; k < 16; ++k) D[i][n] += A[i][k] * B[k][n];
    for (int lane = 0; lane < 32; ++lane) {
      int g = lane / 4, t = lane % 4;
      for (int j = 0; j < 2; ++j) {
        lanes[lane]->d[j] = D[g][2 * t + j];
        lanes[lane]->d[2 + j] = D[g + 8][2 * t + j];
      }
    }
  });
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { emulated::ldmatrix_x4(r, row, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { emulated::ldmatrix_x4(r, row, true); }

// Queues the copy in this thread's current (uncommitted) group; the source is read now.
inline void cp_async_16(void* dst, const void* src, bool valid) {
  namespace d = remat_emu::detail;
  d::Thread& t = d::thread();
  d::check_shared_16(dst, "cp_async_16 destination", t);
  d::PendingCopy copy{static_cast<unsigned char*>(dst), {}, t.commits};
  if (valid) {
    d::check_global_16(src, "cp_async_16 source", t);
    std::memcpy(copy.bytes, src, 16);
  }
  t.copies.push_back(copy);
}

inline void cp_async_commit() { ++remat_emu::detail::thread().commits; }

// Lands, in issue order, the copies of every committed group but the newest N.
template <int N>
void cp_async_wait() {
  static_assert(N >= 0);
  remat_emu::detail::Thread& t = remat_emu::detail::thread();
  size_t landed = 0;
  while (landed < t.copies.size() && t.copies[landed].group < t.commits - N) {
    std::memcpy(t.copies[landed].dst, t.copies[landed].bytes, 16);
    ++landed;
  }
  t.copies.erase(t.copies.begin(), t.copies.begin() + static_cast<std::ptrdiff_t>(landed));
}

}  // namespace remat::tc
