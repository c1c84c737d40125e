// csrc/attention_kernels.cuh's forward and backward on the CPU warp emulator, for
// tests/_helpers/cuda_emulator.py (emulated_attention_fwd / _bwd), which allocates the outputs.
#include "attention_kernels.cuh"

namespace {

// The buffers of a call, in this order: pointers, strides (batch, head, sequence; for lse and
// delta batch, head and 0) and bytes from the pointer to the end of the last element.
// dq_accum: the one-pass backward's zeroed fp32 dQ (shaped as dq), or null for the dQ kernel.
enum Buffer { kQ, kK, kV, kO, kLse, kDout, kDelta, kDq, kDk, kDv, kDqAccum, kBuffers };
const char* const kBufferNames[kBuffers] = {"q", "k", "v", "o", "lse", "do", "delta", "dq", "dk", "dv", "dq_accum"};

// The most dynamic shared memory a block may opt in to on sm_80 (A100), the smallest of the
// archs the kernels ship for (sm_90: 227 KiB).
constexpr int kMaxSharedBytes = 163 * 1024;

void copy_strides(int64_t (&to)[3], const int64_t* from) {
  for (int d = 0; d < 3; ++d) to[d] = from[d];
}

// The score options, as csrc/attention.cu takes them: window bounds (-1 unbounded), softcap (0:
// none), ALiBi slopes (fp32, (b, h) at b * alibi_batch_stride + h; null: none), dropout (at
// dropout_p, 0: none, with the int64 seed at dropout_seed).
struct ScoreOptions {
  int causal;
  int64_t window_left, window_right;
  float softcap;
  const float* alibi_slopes;
  int64_t alibi_batch_stride;
  double dropout_p;
  const int64_t* dropout_seed;
};

// SIZES: batch (sequences when packed), heads, kv_heads, seqlen_q, seqlen_k (the longest when
// packed), head_dim. CU_SEQLENS_Q / _K: packed sequences' int32 cumulative lengths, or null.
remat::AttentionParams make_params(const int* sizes, int bf16, float softmax_scale, const ScoreOptions& options,
                                   const int* cu_seqlens_q, const int* cu_seqlens_k, void* const* buffers,
                                   const int64_t* strides) {
  remat::AttentionParams p{};
  p.q = buffers[kQ];
  p.k = buffers[kK];
  p.v = buffers[kV];
  p.o = buffers[kO];
  p.lse = static_cast<float*>(buffers[kLse]);
  p.dout = buffers[kDout];
  p.delta = static_cast<float*>(buffers[kDelta]);
  p.dq = buffers[kDq];
  p.dk = buffers[kDk];
  p.dv = buffers[kDv];
  p.dq_accum = static_cast<float*>(buffers[kDqAccum]);
  copy_strides(p.q_stride, strides + 3 * kQ);
  copy_strides(p.k_stride, strides + 3 * kK);
  copy_strides(p.v_stride, strides + 3 * kV);
  copy_strides(p.o_stride, strides + 3 * kO);
  copy_strides(p.dout_stride, strides + 3 * kDout);
  copy_strides(p.dq_stride, strides + 3 * kDq);
  copy_strides(p.dk_stride, strides + 3 * kDk);
  copy_strides(p.dv_stride, strides + 3 * kDv);
  copy_strides(p.dq_accum_stride, strides + 3 * kDqAccum);
  p.lse_stride[0] = strides[3 * kLse];
  p.lse_stride[1] = strides[3 * kLse + 1];
  p.cu_seqlens_q = cu_seqlens_q;
  p.cu_seqlens_k = cu_seqlens_k;
  p.batch = sizes[0];
  p.heads = sizes[1];
  p.kv_heads = sizes[2];
  p.seqlen_q = sizes[3];
  p.seqlen_k = sizes[4];
  p.head_dim = sizes[5];
  p.softmax_scale = softmax_scale;
  remat::set_window(p, options.causal != 0, options.window_left, options.window_right);
  remat::set_softcap(p, options.softcap);
  p.alibi_slopes = options.alibi_slopes;
  p.alibi_batch_stride = options.alibi_batch_stride;
  remat::set_dropout(p, options.dropout_p, options.dropout_seed);
  p.bf16 = bf16 != 0;
  return p;
}

// Runs each launch on the emulator; as csrc/attention.cu's StreamLauncher, skips a grid without blocks.
struct EmulatorLauncher {
  template <class Kernel>
  void operator()(Kernel kernel, int64_t blocks, int threads, int smem, const remat::AttentionParams& p) const {
    if (blocks == 0) return;
    if (smem > kMaxSharedBytes) {
      throw remat_emu::KernelFault("remat_emu: a launch asks for " + std::to_string(smem) +
                                   " bytes of dynamic shared memory, more than an sm_80 block may have (" +
                                   std::to_string(kMaxSharedBytes) + ")");
    }
    remat_emu::launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), static_cast<size_t>(smem), p);
  }
};

}  // namespace

extern "C" {

// The forward (BACKWARD = 0: reads q, k, v; writes o, lse) or the backward (reads do, q, k, v, o,
// lse; writes delta, dk, dv and dq, or adds to dq_accum instead where given). SIZES and
// CU_SEQLENS_Q / _K as make_params's; the score options as ScoreOptions. cp.async may read only
// inside q, k, v and do. Returns 0, or -1 with the message in ERROR.
int emulated_attention(int backward, const int* sizes, int bf16, float softmax_scale, int causal, int64_t window_left,
                       int64_t window_right, float softcap, const float* alibi_slopes, int64_t alibi_batch_stride,
                       double dropout_p, const int64_t* dropout_seed, const int* cu_seqlens_q, const int* cu_seqlens_k, void* const* buffers, const int64_t* strides,
                       const int64_t* bytes, char* error, int error_bytes) {
  return remat_emu::report_errors(error, error_bytes, [&] {
    const ScoreOptions options{causal, window_left, window_right, softcap, alibi_slopes, alibi_batch_stride,
                               dropout_p, dropout_seed};
    const remat::AttentionParams p =
        make_params(sizes, bf16, softmax_scale, options, cu_seqlens_q, cu_seqlens_k, buffers, strides);
    std::vector<remat_emu::GlobalBuffer> readable;
    for (Buffer b : {kQ, kK, kV, kDout}) {
      if (b != kDout || backward) readable.push_back({buffers[b], static_cast<size_t>(bytes[b]), kBufferNames[b]});
    }
    remat_emu::ReadableGlobalMemory scope(readable);
    if (backward) {
      remat::attention_backward(p, EmulatorLauncher{});
    } else {
      remat::attention_forward(p, EmulatorLauncher{});
    }
  });
}

// The extra passes the kernels' ldmatrix calls took for bank conflicts since the last call.
uint64_t emulated_take_ldmatrix_extra_passes() { return remat_emu::take_ldmatrix_extra_passes(); }

}  // extern "C"
