// Attention's CUDA entry points: argument checks, outputs, the launches of attention_kernels.cuh,
// and their registration as torch.ops.remat_C.attention_fwd / attention_bwd and
// attention_varlen_fwd / _bwd (the schemas of remat::attention_fwd / _bwd, remat/ops/attention.py,
// and remat::attention_varlen_fwd / _bwd, remat/ops/attention_varlen.py, which register their
// fakes and autograd), plus remat_C::attention_launch_plan, the launches a call would make, for
// the tests.
//
// The kernels take half or bfloat16, head dims that are a multiple of 8 up to 256, causal or
// not, GQA, packed sequences, a sliding window, softcapping, ALiBi and dropout (the Triton
// kernels' mask, drawn from the seed tensor on the device).

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "attention_kernels.cuh"
#include "host.h"

namespace remat {
namespace {

constexpr const char* kOp = "attention (CUDA kernel)";

// q, k or v: DIMS-D (4: (batch, heads, seq, head_dim); 3: packed (total, heads, head_dim)), half
// or bfloat16 on the GPU, unit last stride.
void check_qkv_tensor(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.is_cuda(), kOp, ": ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == dims, kOp, ": ", name, " must be ",
              dims == 4 ? "4-D (batch, heads, seq, head_dim)" : "3-D (total, heads, head_dim)", ", got shape ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, kOp, ": ", name,
              " must be float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, kOp, ": ", name,
              " must have a unit stride in its last dim, got strides ", t.strides());
}

// q, k, v as check_qkv_tensor's (DIMS 4: k with q's batch; 3: packed), of one device and dtype,
// k and v of one shape, GQA heads, a head dim the kernels take.
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t dims) {
  check_qkv_tensor(q, "q", dims);
  check_qkv_tensor(k, "k", dims);
  check_qkv_tensor(v, "v", dims);
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), kOp, ": q, k and v must be on one device, got ",
              q.device(), ", ", k.device(), ", ", v.device());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), kOp,
              ": q, k and v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.sizes() == v.sizes(), kOp, ": k and v must have one shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK((dims == 3 || k.size(0) == q.size(0)) && k.size(-1) == q.size(-1), kOp, ": k must have q's ",
              dims == 4 ? "batch and " : "", "head_dim, got shapes ", q.sizes(), " and ", k.sizes());
  const int64_t heads = q.size(1), kv_heads = k.size(1);  // dim 1 of both layouts
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, kOp, ": q's heads (", heads, ") must be a multiple of k's (",
              kv_heads, ")");
  TORCH_CHECK(attn::padded_head_dim(static_cast<int>(q.size(-1))) != 0, kOp,
              ": head_dim must be a multiple of 8 from 8 to 256, got ", q.size(-1));
}

// The sequence lengths fit the kernels' int positions, with room for a window's sums.
void check_lengths(int64_t seqlen_q, int64_t seqlen_k) {
  TORCH_CHECK(seqlen_q <= std::numeric_limits<int>::max() / 2 && seqlen_k <= std::numeric_limits<int>::max() / 2,
              kOp, ": sequences too long: ", seqlen_q, ", ", seqlen_k);
}

// Every launch's 1-D grid (sequence blocks x heads x batch, grid_blocks) fits in grid.x.
void check_grids(const AttentionParams& p) {
  auto check = [&](auto, int64_t blocks, int, int, const AttentionParams&) {
    TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), kOp, ": too many blocks for one grid: batch ", p.batch,
                ", heads ", p.heads, ", kv_heads ", p.kv_heads, ", seqlen_q ", p.seqlen_q, ", seqlen_k ", p.seqlen_k);
  };
  attention_forward(p, check);
  attention_backward(p, check);
}

// A call's score options and dropout, checked.
struct Scores {
  bool causal;
  double softmax_scale;
  int64_t window_left, window_right;
  double softcap;
  at::Tensor alibi;  // contiguous fp32 slopes, (heads,) or (batch, heads); undefined without ALiBi
  double dropout_p;
  at::Tensor dropout_seed;  // (1,) int64 on q's device; undefined without dropout
};

// The ALiBi slopes per head or per (batch, head) (BATCH counts the packed sequences), as the
// kernels read them.
at::Tensor checked_alibi(const at::Tensor& q, int64_t batch, const std::optional<at::Tensor>& alibi_slopes) {
  if (!present(alibi_slopes)) return at::Tensor();
  const at::Tensor& slopes = *alibi_slopes;
  const int64_t heads = q.size(1);  // dim 1 of both layouts
  const bool per_head = slopes.dim() == 1 && slopes.size(0) == heads;
  const bool per_batch = slopes.dim() == 2 && slopes.size(0) == batch && slopes.size(1) == heads;
  TORCH_CHECK(slopes.device() == q.device() && slopes.scalar_type() == at::kFloat && (per_head || per_batch), kOp,
              ": alibi_slopes must be float32 of shape (", heads, ",) or (", batch, ", ", heads, ") on q's device, got ",
              slopes.scalar_type(), " ", slopes.sizes(), " on ", slopes.device());
  return slopes.contiguous();
}

// The seed of a call with dropout (dropout_p in (0, 1)); undefined without.
at::Tensor checked_dropout_seed(const at::Tensor& q, double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  TORCH_CHECK(std::isfinite(dropout_p) && dropout_p >= 0.0 && dropout_p < 1.0, kOp,
              ": dropout_p must be in [0, 1), got ", dropout_p);
  if (dropout_p == 0.0) return at::Tensor();
  TORCH_CHECK(present(dropout_seed), kOp, ": dropout_seed must be given when dropout_p > 0");
  const at::Tensor& seed = *dropout_seed;
  TORCH_CHECK(seed.device() == q.device() && seed.scalar_type() == at::kLong && seed.numel() == 1, kOp,
              ": dropout_seed must be one int64 on q's device, got ", seed.scalar_type(), " ", seed.sizes(), " on ",
              seed.device());
  return seed.contiguous();
}

Scores checked_scores(const at::Tensor& q, int64_t batch, bool causal, double softmax_scale, int64_t window_left,
                      int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                      double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, kOp, ": softcap must be finite and >= 0, got ", softcap);
  return {causal, softmax_scale, window_left, window_right, softcap, checked_alibi(q, batch, alibi_slopes),
          dropout_p, checked_dropout_seed(q, dropout_p, dropout_seed)};
}

// A tensor whose rows cp.async can copy 16 bytes at a time: 16-byte aligned data and strides but
// the last that are multiples of 8 elements; else a fresh contiguous copy (which is, the head dim
// being a multiple of 8).
at::Tensor copyable(const at::Tensor& t) {
  bool ok = is_aligned(t.data_ptr(), 16);
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The (batch, head, sequence) strides of a 4-D tensor, or of a packed (total, heads, head_dim)
// one (batch stride 0: the kernels find a sequence's first row from cu_seqlens).
void set_strides(int64_t (&out)[3], const at::Tensor& t) {
  if (t.dim() == 3) {
    out[0] = 0;
    out[1] = t.stride(1);
    out[2] = t.stride(0);
  } else {
    for (int d = 0; d < 3; ++d) out[d] = t.stride(d);
  }
}

// lse's (or delta's) batch and head strides: (B, H, Sq), or packed (H, total_q).
void set_lse_strides(AttentionParams& p, const at::Tensor& lse) {
  p.lse_stride[0] = lse.dim() == 3 ? lse.stride(0) : 0;
  p.lse_stride[1] = lse.dim() == 3 ? lse.stride(1) : lse.stride(0);
}

// Packed sequences: int32 (batch + 1) cumulative lengths on q's device, and the longest lengths.
struct Packed {
  at::Tensor cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
};

void check_packed(const at::Tensor& q, const Packed& packed) {
  using Named = std::pair<const at::Tensor&, const char*>;
  for (const auto& [t, name] :
       {Named{packed.cu_seqlens_q, "cu_seqlens_q"}, Named{packed.cu_seqlens_k, "cu_seqlens_k"}}) {
    TORCH_CHECK(t.device() == q.device() && t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) >= 1 &&
                    t.is_contiguous(),
                kOp, ": ", name, " must be a contiguous 1-D int32 tensor (sequences + 1) on q's device, got ",
                t.scalar_type(), " ", t.sizes(), " on ", t.device());
  }
  TORCH_CHECK(packed.cu_seqlens_k.size(0) == packed.cu_seqlens_q.size(0), kOp,
              ": cu_seqlens_k must have cu_seqlens_q's length ", packed.cu_seqlens_q.size(0), ", got ",
              packed.cu_seqlens_k.size(0));
  TORCH_CHECK(packed.max_seqlen_q >= 0 && packed.max_seqlen_k >= 0, kOp,
              ": max_seqlen_q and max_seqlen_k must be >= 0, got ", packed.max_seqlen_q, ", ", packed.max_seqlen_k);
}

// Q, K, V (4-D, or packed 3-D with PACKED) and the score options as the kernels take them; the
// launches' grids checked.
AttentionParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Scores& scores,
                            const Packed* packed) {
  AttentionParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  set_strides(p.q_stride, q);
  set_strides(p.k_stride, k);
  set_strides(p.v_stride, v);
  p.heads = static_cast<int>(q.size(1));  // dim 1 of both layouts
  p.kv_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(q.size(-1));
  const int64_t seqlen_q = packed ? packed->max_seqlen_q : q.size(2), seqlen_k = packed ? packed->max_seqlen_k : k.size(2);
  check_lengths(seqlen_q, seqlen_k);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.batch = static_cast<int>(packed ? packed->cu_seqlens_q.size(0) - 1 : q.size(0));
  if (packed != nullptr) {
    p.cu_seqlens_q = packed->cu_seqlens_q.data_ptr<int>();
    p.cu_seqlens_k = packed->cu_seqlens_k.data_ptr<int>();
  }
  p.softmax_scale = static_cast<float>(scores.softmax_scale);
  set_window(p, scores.causal, scores.window_left, scores.window_right);
  set_softcap(p, static_cast<float>(scores.softcap));
  if (scores.alibi.defined()) {
    p.alibi_slopes = scores.alibi.data_ptr<float>();
    p.alibi_batch_stride = scores.alibi.dim() == 2 ? scores.alibi.stride(0) : 0;
  }
  set_dropout(p, scores.dropout_p, scores.dropout_seed.defined() ? scores.dropout_seed.data_ptr<int64_t>() : nullptr);
  p.bf16 = q.scalar_type() == at::kBFloat16;
  check_grids(p);
  return p;
}

// Launches on STREAM (grids checked by make_params); a grid without blocks is skipped; shared
// memory above the default 48 KiB is allowed per kernel first.
struct StreamLauncher {
  cudaStream_t stream;
  template <class Kernel>
  void operator()(Kernel kernel, int64_t blocks, int threads, int smem, const AttentionParams& p) const {
    if (blocks == 0) return;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    kernel<<<dim3(static_cast<unsigned>(blocks)), dim3(threads), smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// The forward into O and LSE (allocated by the caller in the op's layouts).
void run_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const Scores& scores,
                 const Packed* packed, const at::Tensor& o, const at::Tensor& lse) {
  const at::Tensor q = copyable(q_in), k = copyable(k_in), v = copyable(v_in);
  AttentionParams p = make_params(q, k, v, scores, packed);
  p.o = o.data_ptr();
  set_strides(p.o_stride, o);
  p.lse = lse.data_ptr<float>();
  set_lse_strides(p, lse);
  attention_forward(p, StreamLauncher{current_stream(q)});
}

// Whether a backward runs in one pass, dQ added by fp32 atomics (attention_kernels.cuh): unless
// torch.use_deterministic_algorithms(True), as PyTorch's own flash attention backward decides.
bool one_pass_backward() { return !at::globalContext().deterministicAlgorithms(); }

// The backward: (dq, dk, dv), contiguous, shaped like q, k, v.
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                            const at::Tensor& k_in, const at::Tensor& v_in,
                                                            const at::Tensor& o, const at::Tensor& lse,
                                                            const Scores& scores, const Packed* packed) {
  check_like(kOp, dout_in, "do", q_in, "q");
  check_like(kOp, o, "o", q_in, "q");
  TORCH_CHECK(o.stride(-1) == 1 && dout_in.stride(-1) == 1, kOp,
              ": o and do must have a unit stride in their last dim");
  const at::Tensor q = copyable(q_in), k = copyable(k_in), v = copyable(v_in), dout = copyable(dout_in);
  const at::Tensor lse_rows = lse.contiguous();
  const bool one_pass = one_pass_backward();
  // One pass: dQ's fp32 sums, rounded to dq at the end (a transient of twice dq's bytes).
  at::Tensor dq_accum = one_pass ? at::zeros(q.sizes(), q.options().dtype(at::kFloat)) : at::Tensor();
  at::Tensor dq = one_pass ? at::Tensor() : at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor delta = at::empty(lse.sizes(), lse.options());
  AttentionParams p = make_params(q, k, v, scores, packed);
  p.o = const_cast<void*>(o.data_ptr());
  set_strides(p.o_stride, o);
  p.lse = const_cast<float*>(lse_rows.data_ptr<float>());
  set_lse_strides(p, lse_rows);
  p.dout = dout.data_ptr();
  set_strides(p.dout_stride, dout);
  p.delta = delta.data_ptr<float>();
  if (one_pass) {
    p.dq_accum = dq_accum.data_ptr<float>();
    set_strides(p.dq_accum_stride, dq_accum);
  } else {
    p.dq = dq.data_ptr();
    set_strides(p.dq_stride, dq);
  }
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  set_strides(p.dk_stride, dk);
  set_strides(p.dv_stride, dv);
  attention_backward(p, StreamLauncher{current_stream(q)});
  return {one_pass ? dq_accum.to(q.scalar_type()) : dq, dk, dv};
}

void check_lse(const at::Tensor& lse, const at::Tensor& q, at::IntArrayRef shape, const char* layout) {
  TORCH_CHECK(lse.device() == q.device() && lse.scalar_type() == at::kFloat && lse.sizes() == shape, kOp,
              ": lse must be float32 of shape ", layout, " ", shape, ", got ", lse.scalar_type(), " ", lse.sizes());
}

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 bool causal, double softmax_scale, int64_t window_left,
                                                 int64_t window_right, double softcap,
                                                 const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                                                 const std::optional<at::Tensor>& dropout_seed) {
  check_inputs(q, k, v, 4);
  const Scores scores = checked_scores(q, q.size(0), causal, softmax_scale, window_left, window_right, softcap,
                                       alibi_slopes, dropout_p, dropout_seed);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3);
  // o (B, H, Sq, D) laid out as (B, Sq, H, D), as every backend returns it (ops/attention.py).
  at::Tensor o = at::empty({B, Sq, H, D}, q.options()).transpose(1, 2);
  at::Tensor lse = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));
  run_forward(q, k, v, scores, nullptr, o, lse);
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, bool causal, double softmax_scale, int64_t window_left, int64_t window_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  check_inputs(q, k, v, 4);
  const Scores scores = checked_scores(q, q.size(0), causal, softmax_scale, window_left, window_right, softcap,
                                       alibi_slopes, dropout_p, dropout_seed);
  check_lse(lse, q, {q.size(0), q.size(1), q.size(2)}, "(batch, heads, seqlen_q)");
  const c10::cuda::CUDAGuard guard(q.device());
  return run_backward(dout, q, k, v, o, lse, scores, nullptr);
}

// Packed sequences, as remat::attention_varlen_fwd / _bwd (ops/attention_varlen.py): q (total_q,
// H, D), k and v (total_k, Hkv, D); o like q, lse (H, total_q).
Packed checked_packed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                      const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  check_inputs(q, k, v, 3);
  Packed packed{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  check_packed(q, packed);
  return packed;
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, double softmax_scale,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  const Packed packed = checked_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const Scores scores = checked_scores(q, cu_seqlens_q.size(0) - 1, causal, softmax_scale, window_left, window_right,
                                       softcap, alibi_slopes, dropout_p, dropout_seed);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor o = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  run_forward(q, k, v, scores, &packed, o, lse);
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool causal, double softmax_scale, int64_t window_left, int64_t window_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  const Packed packed = checked_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const Scores scores = checked_scores(q, cu_seqlens_q.size(0) - 1, causal, softmax_scale, window_left, window_right,
                                       softcap, alibi_slopes, dropout_p, dropout_seed);
  check_lse(lse, q, {q.size(1), q.size(0)}, "(heads, total_q)");
  const c10::cuda::CUDAGuard guard(q.device());
  return run_backward(dout, q, k, v, o, lse, scores, &packed);
}

// The launches a forward (backward=false) or backward call of this shape would make, without a
// GPU: per launch, its kernel (0 forward, 1 the backward's delta, 2 dK/dV, 3 dQ), the padded
// head dim it was compiled for, grid x, y, z (the 1-D grids' blocks, 1, 1), threads and dynamic
// shared memory bytes, flattened. DETERMINISTIC: the backward as under
// torch.use_deterministic_algorithms(True) (a dQ kernel), else as one_pass_backward's; None: as
// this process's setting now.
std::vector<int64_t> attention_launch_plan(int64_t batch, int64_t heads, int64_t kv_heads, int64_t seqlen_q,
                                           int64_t seqlen_k, int64_t head_dim, bool bf16, bool causal,
                                           bool backward, std::optional<bool> deterministic) {
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
  float never_read = 0.f;  // the one pass's dQ sums: a plan launches nothing, so any non-null pointer
  if (deterministic.has_value() ? !*deterministic : one_pass_backward()) p.dq_accum = &never_read;
  std::vector<int64_t> plan;
  int index = backward ? 1 : 0;
  auto record = [&](auto, int64_t blocks, int threads, int smem, const AttentionParams&) {
    plan.insert(plan.end(), {index++, attn::padded_head_dim(p.head_dim), blocks, 1, 1, threads, smem});
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
      "attention_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, float softmax_scale, SymInt window_left=-1, "
      "SymInt window_right=-1, float softcap=0., Tensor? alibi_slopes=None, float dropout_p=0., "
      "Tensor? dropout_seed=None) -> (Tensor, Tensor)");
  m.def(
      "attention_varlen_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, float softmax_scale, "
      "SymInt window_left=-1, SymInt window_right=-1, float softcap=0., Tensor? alibi_slopes=None, "
      "float dropout_p=0., Tensor? dropout_seed=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "attention_launch_plan(int batch, int heads, int kv_heads, int seqlen_q, int seqlen_k, int head_dim, "
      "bool bf16, bool causal, bool backward, bool? deterministic=None) -> int[]",
      &remat::attention_launch_plan);
}

TORCH_LIBRARY_IMPL(remat_C, CUDA, m) {
  m.impl("attention_fwd", &remat::attention_fwd);
  m.impl("attention_bwd", &remat::attention_bwd);
  m.impl("attention_varlen_fwd", &remat::attention_varlen_fwd);
  m.impl("attention_varlen_bwd", &remat::attention_varlen_bwd);
}
