// Attention's CUDA entry points: argument checks, outputs, the launches of attention_kernels.cuh,
// and their registration as torch.ops.remat_C.attention_fwd / attention_bwd (the schemas of
// remat::attention_fwd / _bwd, remat/ops/attention.py, which registers their fakes and
// autograd), plus remat_C::attention_launch_plan, the launches a call would make, for the tests.
//
// The kernels take half or bfloat16, head dims that are a multiple of 8 up to 256, causal or
// not, GQA, a sliding window, softcapping and ALiBi. Dropout is refused here with an error naming
// the argument; remat's dispatch sends those calls to the Triton kernels instead.

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "attention_kernels.cuh"
#include "host.h"

namespace remat {
namespace {

constexpr const char* kOp = "attention (CUDA kernel)";

// q (B, H, Sq, D) or k/v (B, Hkv, Sk, D): 4-D, half or bfloat16 on the GPU, unit last stride.
void check_qkv_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), kOp, ": ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 4, kOp, ": ", name, " must be 4-D (batch, heads, seq, head_dim), got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, kOp, ": ", name,
              " must be float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) <= 1, kOp, ": ", name, " must have a unit stride in its last dim, got strides ",
              t.strides());
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_qkv_tensor(q, "q");
  check_qkv_tensor(k, "k");
  check_qkv_tensor(v, "v");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), kOp, ": q, k and v must be on one device, got ",
              q.device(), ", ", k.device(), ", ", v.device());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), kOp,
              ": q, k and v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.sizes() == v.sizes(), kOp, ": k and v must have one shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), kOp,
              ": k must have q's batch and head_dim (", q.size(0), ", ", q.size(3), "), got shape ", k.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, kOp, ": q's heads (", q.size(1),
              ") must be a multiple of k's (", k.size(1), ")");
  TORCH_CHECK(attn::padded_head_dim(static_cast<int>(q.size(3))) != 0, kOp,
              ": head_dim must be a multiple of 8 from 8 to 256, got ", q.size(3));
  // The 1-D grids (sequence blocks x heads x batch) fit: the largest are the backward's delta, 16
  // query rows a block, and its dK/dV, 64 keys a block (two blocks, a column half each, at 256).
  const int64_t key_block_blocks = attn::padded_head_dim(static_cast<int>(q.size(3))) > 128 ? 2 : 1;
  const int64_t key_blocks = ceil_div(k.size(2), attn::kWarps * attn::kRowsPerWarp) * key_block_blocks;
  const int64_t blocks = std::max(ceil_div(q.size(2), attn::kPreRows) * q.size(1), key_blocks * k.size(1));
  TORCH_CHECK(blocks * q.size(0) <= std::numeric_limits<int>::max(), kOp,
              ": too many blocks for one grid: q ", q.sizes(), ", k ", k.sizes());
  TORCH_CHECK(q.size(2) <= std::numeric_limits<int>::max() / 2 && k.size(2) <= std::numeric_limits<int>::max() / 2,
              kOp, ": sequences too long: ", q.size(2), ", ", k.size(2));
}

// The score options: their values, and dropout, which these kernels do not compute yet.
void check_features(const at::Tensor& q, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                    double dropout_p) {
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, kOp, ": softcap must be finite and >= 0, got ", softcap);
  if (present(alibi_slopes)) {
    const at::Tensor& slopes = *alibi_slopes;
    const bool per_head = slopes.dim() == 1 && slopes.size(0) == q.size(1);
    const bool per_batch = slopes.dim() == 2 && slopes.size(0) == q.size(0) && slopes.size(1) == q.size(1);
    TORCH_CHECK(slopes.device() == q.device() && slopes.scalar_type() == at::kFloat && (per_head || per_batch), kOp,
                ": alibi_slopes must be float32 of shape (heads,) or (batch, heads) on q's device, got ",
                slopes.scalar_type(), " ", slopes.sizes(), " on ", slopes.device());
  }
  TORCH_CHECK(dropout_p == 0.0, kOp, ": dropout_p is not supported; remat runs dropout with Triton");
}

// A tensor whose rows cp.async can copy 16 bytes at a time: 16-byte aligned data and batch,
// head and sequence strides that are multiples of 8 elements; else a fresh contiguous copy (which is,
// the head dim being a multiple of 8).
at::Tensor copyable(const at::Tensor& t) {
  bool ok = is_aligned(t.data_ptr(), 16);
  for (int d = 0; d < 3; ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

void set_strides(int64_t (&out)[3], const at::Tensor& t) {
  for (int d = 0; d < 3; ++d) out[d] = t.stride(d);
}

// The slopes as the kernels read them (contiguous fp32, (heads,) or (batch, heads)); undefined
// without ALiBi. The caller keeps the tensor alive through the launches.
at::Tensor alibi_rows(const std::optional<at::Tensor>& alibi_slopes) {
  return present(alibi_slopes) ? alibi_slopes->contiguous() : at::Tensor();
}

AttentionParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                            double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
                            const at::Tensor& alibi) {
  AttentionParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  set_strides(p.q_stride, q);
  set_strides(p.k_stride, k);
  set_strides(p.v_stride, v);
  p.batch = static_cast<int>(q.size(0));
  p.heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k.size(1));
  p.seqlen_q = static_cast<int>(q.size(2));
  p.seqlen_k = static_cast<int>(k.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.softmax_scale = static_cast<float>(softmax_scale);
  set_window(p, causal, window_left, window_right);
  set_softcap(p, static_cast<float>(softcap));
  if (alibi.defined()) {
    p.alibi_slopes = alibi.data_ptr<float>();
    p.alibi_batch_stride = alibi.dim() == 2 ? alibi.stride(0) : 0;
  }
  p.bf16 = q.scalar_type() == at::kBFloat16;
  return p;
}

// Launches on STREAM; a grid without blocks is skipped; shared memory above the default 48 KiB
// is allowed per kernel first.
struct StreamLauncher {
  cudaStream_t stream;
  template <class Kernel>
  void operator()(Kernel kernel, dim3 grid, dim3 block, int smem, const AttentionParams& p) const {
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    kernel<<<grid, block, smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                                 const at::Tensor& v_in, bool causal, double softmax_scale,
                                                 int64_t window_left, int64_t window_right, double softcap,
                                                 const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                                                 const std::optional<at::Tensor>& dropout_seed) {
  check_inputs(q_in, k_in, v_in);
  check_features(q_in, softcap, alibi_slopes, dropout_p);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = copyable(q_in), k = copyable(k_in), v = copyable(v_in), alibi = alibi_rows(alibi_slopes);
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3);
  // o (B, H, Sq, D) laid out as (B, Sq, H, D), as every backend returns it (ops/attention.py).
  at::Tensor o = at::empty({B, Sq, H, D}, q.options()).transpose(1, 2);
  at::Tensor lse = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));
  AttentionParams p = make_params(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi);
  p.o = o.data_ptr();
  set_strides(p.o_stride, o);
  p.lse = lse.data_ptr<float>();
  attention_forward(p, StreamLauncher{current_stream(q)});
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& o, const at::Tensor& lse, bool causal, double softmax_scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  check_inputs(q_in, k_in, v_in);
  check_features(q_in, softcap, alibi_slopes, dropout_p);
  check_like(kOp, dout_in, "do", q_in, "q");
  check_like(kOp, o, "o", q_in, "q");
  TORCH_CHECK(o.stride(3) == 1 && dout_in.stride(3) == 1, kOp, ": o and do must have a unit stride in their last dim");
  TORCH_CHECK(lse.device() == q_in.device() && lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                  lse.size(0) == q_in.size(0) && lse.size(1) == q_in.size(1) && lse.size(2) == q_in.size(2),
              kOp, ": lse must be float32 of shape (batch, heads, seqlen_q), got ", lse.scalar_type(), " ",
              lse.sizes());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = copyable(q_in), k = copyable(k_in), v = copyable(v_in), dout = copyable(dout_in);
  const at::Tensor alibi = alibi_rows(alibi_slopes);
  const at::Tensor lse_rows = lse.contiguous();
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor delta = at::empty(lse.sizes(), lse.options());
  AttentionParams p = make_params(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi);
  p.o = const_cast<void*>(o.data_ptr());
  set_strides(p.o_stride, o);
  p.lse = const_cast<float*>(lse_rows.data_ptr<float>());
  p.dout = dout.data_ptr();
  set_strides(p.dout_stride, dout);
  p.delta = delta.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  set_strides(p.dq_stride, dq);
  set_strides(p.dk_stride, dk);
  set_strides(p.dv_stride, dv);
  attention_backward(p, StreamLauncher{current_stream(q)});
  return {dq, dk, dv};
}

// The launches a forward (backward=false) or backward call of this shape would make, without a
// GPU: per launch, its kernel (0 forward, 1 the backward's delta, 2 dK/dV, 3 dQ), the padded
// head dim it was compiled for, grid x, y, z, threads and dynamic shared memory bytes, flattened.
std::vector<int64_t> attention_launch_plan(int64_t batch, int64_t heads, int64_t kv_heads, int64_t seqlen_q,
                                           int64_t seqlen_k, int64_t head_dim, bool bf16, bool causal,
                                           bool backward) {
  TORCH_CHECK(attn::padded_head_dim(static_cast<int>(head_dim)) != 0, kOp,
              ": head_dim must be a multiple of 8 from 8 to 256, got ", head_dim);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, kOp, ": heads must be a multiple of kv_heads");
  AttentionParams p{};
  p.batch = static_cast<int>(batch);
  p.heads = static_cast<int>(heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.head_dim = static_cast<int>(head_dim);
  p.bf16 = bf16;
  set_window(p, causal, -1, -1);
  std::vector<int64_t> plan;
  int index = backward ? 1 : 0;
  auto record = [&](auto, dim3 grid, dim3 block, int smem, const AttentionParams&) {
    plan.insert(plan.end(), {index++, attn::padded_head_dim(p.head_dim), grid.x, grid.y, grid.z, block.x, smem});
  };
  if (backward) {
    attention_backward(p, record);
  } else {
    attention_forward(p, record);
  }
  return plan;
}

}  // namespace
}  // namespace remat

TORCH_LIBRARY_FRAGMENT(remat_C, m) {
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, SymInt window_left=-1, "
      "SymInt window_right=-1, float softcap=0., Tensor? alibi_slopes=None, float dropout_p=0., "
      "Tensor? dropout_seed=None) -> (Tensor, Tensor)");
  m.def(
      "attention_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, "
      "float softmax_scale, SymInt window_left=-1, SymInt window_right=-1, float softcap=0., "
      "Tensor? alibi_slopes=None, float dropout_p=0., Tensor? dropout_seed=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "attention_launch_plan(int batch, int heads, int kv_heads, int seqlen_q, int seqlen_k, int head_dim, "
      "bool bf16, bool causal, bool backward) -> int[]",
      &remat::attention_launch_plan);
}

TORCH_LIBRARY_IMPL(remat_C, CUDA, m) {
  m.impl("attention_fwd", &remat::attention_fwd);
  m.impl("attention_bwd", &remat::attention_bwd);
}
