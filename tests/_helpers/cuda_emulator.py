"""Builds CUDA kernel sources for the CPU warp emulator and loads them with ctypes (no GPU needed).

``build_emulated(sources, name)`` compiles C++ files that include the kernels (with
REMAT_WARP_EMULATOR defined, csrc/tensor_core.cuh takes its primitives from
tests/cuda_emulator/warp_emulator.h) into a shared library, cached under the temp folder by a hash
of the sources, the headers beside them and the flags. A test that needs it is skipped, with the
reason, only when g++ or the CUDA toolkit's headers are absent; a compile error fails it.

``emulated_attention_fwd`` / ``emulated_attention_bwd`` run csrc/attention_kernels.cuh's forward
and backward on CPU tensors through tests/cuda_emulator/attention_harness.cpp;
``emulated_attention_varlen_fwd`` / ``_bwd`` the same over packed sequences.
"""

import ctypes
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
EMULATOR = os.path.join(ROOT, "tests", "cuda_emulator")
CUDA_HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "vector_types.h", "device_launch_parameters.h")
# The half/bfloat16 operator switches of torch's extension build (cpp_extension.COMMON_NVCC_FLAGS),
# so that a kernel that builds here also builds there.
TORCH_HALF_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__")
ERROR_BYTES = 4096


@functools.cache
def cuda_include_dir():
    """The first toolkit include folder (CUDA_HOME, CUDA_PATH, /usr/local/cuda, nvcc's) whose
    headers the kernels include compile on the host with g++, or None."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:  # a wrapper script resolves to its own folder; /usr/local/cuda covers that case
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    test = "".join(f"#include <{header}>\n" for header in CUDA_HEADERS)
    for folder in dict.fromkeys(os.path.join(home, "include") for home in homes if home):
        if os.path.isdir(folder) and subprocess.run(
                ["g++", "-std=c++20", "-fsyntax-only", "-x", "c++", "-I", folder, "-"], input=test, text=True,
                capture_output=True).returncode == 0:
            return folder
    return None


def _compile_command(sources, flags, output, cuda_include):
    return (["g++", "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-DREMAT_WARP_EMULATOR",
             *TORCH_HALF_FLAGS, *flags, "-I", CSRC, "-I", EMULATOR, "-I", cuda_include]
            + list(sources) + ["-o", output])


def _digest(sources, command):
    """Hash of the command, the sources and every header of csrc/ and tests/cuda_emulator/."""
    headers = sorted(glob.glob(os.path.join(CSRC, "*.cuh")) + glob.glob(os.path.join(CSRC, "*.h"))
                     + glob.glob(os.path.join(EMULATOR, "*.h")))
    digest = hashlib.sha256("\0".join(command).encode())
    for path in list(sources) + headers:
        with open(path, "rb") as handle:
            digest.update(path.encode() + b"\0" + handle.read())
    return digest.hexdigest()[:20]


def build_emulated(sources, name, flags=()):
    """ctypes.CDLL of SOURCES (file names in tests/cuda_emulator/ or paths) built for the emulator,
    with the extra compiler FLAGS.

    Skips the calling test when g++ or the CUDA headers are absent; raises RuntimeError with the
    compiler's output when the build fails.
    """
    if isinstance(sources, str):
        sources = (sources,)
    return _build(tuple(s if os.path.isabs(s) else os.path.join(EMULATOR, s) for s in sources), name, tuple(flags))


@functools.cache
def _build(sources, name, flags):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: the CUDA warp emulator builds the kernels with it")
    cuda_include = cuda_include_dir()
    if cuda_include is None:
        pytest.skip(f"no CUDA toolkit headers ({', '.join(CUDA_HEADERS)}) that compile with g++ under CUDA_HOME, "
                    "CUDA_PATH, /usr/local/cuda or nvcc's toolkit")
    cache = os.path.join(tempfile.gettempdir(), "remat-cuda-emulator")
    os.makedirs(cache, exist_ok=True)
    digest = _digest(sources, _compile_command(sources, flags, "", cuda_include))
    library = os.path.join(cache, f"{name}-{digest}.so")
    if not os.path.exists(library):
        partial = f"{library}.{os.getpid()}.tmp"  # a parallel build of the same sources replaces it whole
        done = subprocess.run(_compile_command(sources, flags, partial, cuda_include), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {name} for the warp emulator failed:\n{done.stderr[-8000:]}")
        os.replace(partial, library)
    return ctypes.CDLL(library)


def call(function, *args):
    """Calls a C entry point whose last two parameters are (char* error, int error_bytes) and
    which returns 0 or -1: "" when it succeeded, else its error message."""
    error = ctypes.create_string_buffer(ERROR_BYTES)
    status = function(*args, error, len(error))
    return "" if status == 0 else error.value.decode(errors="replace") or f"status {status}"


# ---- attention (csrc/attention_kernels.cuh) ----

# attention_harness.cpp's order; dq_accum: the one-pass backward's fp32 dQ (None: the dQ kernel's)
_BUFFERS = ("q", "k", "v", "o", "lse", "do", "delta", "dq", "dk", "dv", "dq_accum")
_ROW_BUFFERS = ("lse", "delta")  # fp32 per query row
_GUARD_ROWS = 64  # sequence rows of a known pattern either side of each output (a kernel's tile height)
_GUARD_BITS = {2: 0x5A5A, 4: 0x5A5A5A5A}
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32}


class _GuardedOutput:
    """An output tensor (dim SEQ_DIM its sequence) inside a buffer with _GUARD_ROWS rows of a known
    pattern either side, its own elements NaN until the kernels store them (zeros with ZEROED: an
    accumulator the kernels add to). A store past either end by up to a tile of rows changes the
    pattern; one into another (batch, head) slice of the tensor shows only in the values."""

    def __init__(self, name, shape, dtype, order=None, seq_dim=2, zeroed=False):
        self.name = name
        order = tuple(range(len(shape))) if order is None else order
        layout = [shape[d] for d in order]  # the memory order of the dims
        numel, row = 1, 1
        for position in reversed(range(len(layout))):
            if order[position] == seq_dim:
                row = numel
            numel *= layout[position]
        self.guard = _GUARD_ROWS * row
        self.buffer = torch.empty(numel + 2 * self.guard, dtype=dtype)
        bits = self.buffer.view(_INT_OF_SIZE[self.buffer.element_size()])
        bits.fill_(_GUARD_BITS[self.buffer.element_size()])
        # All ones, NaN, so that an element no kernel stores shows; or zeros, for an accumulator.
        bits[self.guard:self.guard + numel] = 0 if zeroed else -1
        in_memory = self.buffer[self.guard:self.guard + numel].view(layout)
        self.tensor = in_memory.permute([order.index(d) for d in range(len(shape))])

    def check_guards(self):
        bits = self.buffer.view(_INT_OF_SIZE[self.buffer.element_size()])
        pattern = _GUARD_BITS[self.buffer.element_size()]
        for side, guard in (("before", bits[:self.guard]), ("after", bits[-self.guard:])):
            written = (guard != pattern).nonzero().flatten().tolist()
            if written:
                raise RuntimeError(f"the attention kernels wrote {len(written)} element(s) {side} {self.name} "
                                   f"(guard elements {written[:8]} of {self.guard})")


def _check_16bit_4d(t, name, dtype=None, dims=4):
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor")
    if t.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must have q's dtype {dtype}, got {t.dtype}")
    if t.dim() != dims:
        layout = "4-D (batch, heads, seq, head_dim)" if dims == 4 else "3-D (total, heads, head_dim)"
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.size(-1) > 1:
        raise ValueError(f"{name} must have a unit stride in its last dim, got strides {t.stride()}")


def _check_qkv(q, k, v, dims=4):
    """csrc/attention.cu's checks of q, k, v: 4-D, or packed 3-D (total, heads, head_dim) at DIMS 3."""
    _check_16bit_4d(q, "q", dims=dims)
    _check_16bit_4d(k, "k", q.dtype, dims)
    _check_16bit_4d(v, "v", q.dtype, dims)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if (dims == 4 and k.size(0) != q.size(0)) or k.size(-1) != q.size(-1):
        raise ValueError(f"k must have q's batch and head_dim, got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if k.size(1) == 0 or q.size(1) % k.size(1) != 0:  # heads: dim 1 of both layouts
        raise ValueError(f"q's heads ({q.size(1)}) must be a multiple of k's ({k.size(1)})")
    if not (8 <= q.size(-1) <= 256 and q.size(-1) % 8 == 0):
        raise ValueError(f"head_dim must be a multiple of 8 from 8 to 256, got {q.size(-1)}")


def _copyable(t):
    """As csrc/attention.cu's copyable(): T when cp.async can copy its rows 16 bytes at a time
    (16-byte aligned data, strides but the last multiples of 8), else a contiguous copy (a fresh
    one: t.contiguous() would keep a contiguous tensor's misaligned data)."""
    ok = t.data_ptr() % 16 == 0 and all(t.size(d) <= 1 or t.stride(d) % 8 == 0 for d in range(t.dim() - 1))
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def _span_bytes(t):
    """Bytes from t's first element to the end of its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _kernel_strides(t, rows=False):
    """(batch, head, sequence) strides as csrc/attention.cu's set_strides gives them: of a 4-D
    tensor, a packed (total, heads, head_dim) one (batch stride 0), or with ROWS of lse-like fp32
    rows, (B, H, Sq) or packed (H, total), whose sequence stride is unused (0)."""
    if rows:
        return (t.stride(0), t.stride(1), 0) if t.dim() == 3 else (0, t.stride(0), 0)
    return tuple(t.stride()[:3]) if t.dim() == 4 else (0, t.stride(1), t.stride(0))


def _run_attention(backward, tensors, causal, scale, sizes, window_left, window_right, softcap, alibi_slopes,
                   dropout_p, dropout_seed, cu_seqlens=(None, None)):
    """Calls attention_harness.cpp's entry point with TENSORS, a dict by _BUFFERS name, and the
    score options as csrc/attention.cu takes them (ALIBI_SLOPES: None, or fp32 (H,) or (B, H);
    DROPOUT_SEED: a (1,) int64 tensor, read when DROPOUT_P > 0); CU_SEQLENS: packed sequences'
    int32 cumulative lengths (q's, k's), or None."""
    library = build_emulated("attention_harness.cpp", "attention_harness")
    pointers = (ctypes.c_void_p * len(_BUFFERS))()
    strides = (ctypes.c_int64 * (3 * len(_BUFFERS)))()
    spans = (ctypes.c_int64 * len(_BUFFERS))()
    for i, name in enumerate(_BUFFERS):
        t = tensors.get(name)
        if t is None:
            continue
        pointers[i] = t.data_ptr()
        spans[i] = _span_bytes(t)
        strides[3 * i:3 * i + 3] = list(_kernel_strides(t, rows=name in _ROW_BUFFERS))
    bf16 = int(tensors["q"].dtype == torch.bfloat16)
    slopes, slopes_batch_stride = None, 0
    if alibi_slopes is not None:
        if alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) not in ((sizes[1],), (sizes[0], sizes[1])):
            raise ValueError(f"alibi_slopes must be float32 of shape (heads,) or (batch, heads), got "
                             f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")
        slopes = alibi_slopes.contiguous()
        slopes_batch_stride = slopes.stride(0) if slopes.dim() == 2 else 0
    seed = None
    if dropout_p > 0:
        if not isinstance(dropout_seed, torch.Tensor) or dropout_seed.dtype != torch.int64 or dropout_seed.numel() != 1:
            raise ValueError("dropout_seed must be one int64 when dropout_p > 0")
        seed = dropout_seed.contiguous()
    message = call(library.emulated_attention, int(backward), (ctypes.c_int * 6)(*sizes), bf16, ctypes.c_float(scale),
                   int(causal), ctypes.c_int64(window_left), ctypes.c_int64(window_right), ctypes.c_float(softcap),
                   ctypes.c_void_p(None if slopes is None else slopes.data_ptr()), ctypes.c_int64(slopes_batch_stride),
                   ctypes.c_double(dropout_p), ctypes.c_void_p(None if seed is None else seed.data_ptr()),
                   *[ctypes.c_void_p(None if c is None else c.data_ptr()) for c in cu_seqlens], pointers, strides,
                   spans)
    if message:
        raise RuntimeError(f"attention {'backward' if backward else 'forward'}: {message}")


def take_ldmatrix_extra_passes():
    """The passes beyond one a matrix that the attention kernels' ldmatrix calls took for bank
    conflicts since the last call (in this process), and resets the count."""
    library = build_emulated("attention_harness.cpp", "attention_harness")
    library.emulated_take_ldmatrix_extra_passes.restype = ctypes.c_uint64
    return library.emulated_take_ldmatrix_extra_passes()


def emulated_attention_fwd(q, k, v, causal, scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                           dropout_p=0.0, dropout_seed=None):
    """csrc/attention_kernels.cuh's forward on the emulator: (o, lse) for (B, H, Sq, D) q and
    (B, Hkv, Sk, D) k, v (float16 or bfloat16 CPU tensors, unit last stride), with the score
    options of remat.ops.attention.attention_fwd. As csrc/attention.cu:
    inputs cp.async cannot read are copied contiguous first; o is (B, Sq, H, D) memory viewed as
    (B, H, Sq, D), lse (B, H, Sq) fp32. Raises RuntimeError on a kernel fault or a store outside o
    or lse; elements the kernels never store come back NaN."""
    _check_qkv(q, k, v)
    q, k, v = _copyable(q), _copyable(k), _copyable(v)
    B, H, Sq, D = q.shape
    o = _GuardedOutput("o", (B, H, Sq, D), q.dtype, order=(0, 2, 1, 3))
    lse = _GuardedOutput("lse", (B, H, Sq), torch.float32)
    _run_attention(False, {"q": q, "k": k, "v": v, "o": o.tensor, "lse": lse.tensor}, causal, scale,
                   (B, H, k.size(1), Sq, k.size(2), D), window_left, window_right, softcap, alibi_slopes, dropout_p,
                   dropout_seed)
    o.check_guards()
    lse.check_guards()
    return o.tensor, lse.tensor


def _backward_outputs(q, k, v, delta_shape, seq_dims, deterministic):
    """The backward's guarded outputs by _BUFFERS name: dq (deterministic) or the zeroed fp32
    dq_accum the one-pass backward adds to, dk, dv and the delta workspace. SEQ_DIMS: the
    sequence dims of the gradients and of delta."""
    seq_dim, delta_seq_dim = seq_dims
    dq_name, dq_dtype = ("dq", q.dtype) if deterministic else ("dq_accum", torch.float32)
    return {dq_name: _GuardedOutput(dq_name, q.shape, dq_dtype, seq_dim=seq_dim, zeroed=not deterministic),
            "dk": _GuardedOutput("dk", k.shape, k.dtype, seq_dim=seq_dim),
            "dv": _GuardedOutput("dv", v.shape, v.dtype, seq_dim=seq_dim),
            "delta": _GuardedOutput("delta", delta_shape, torch.float32, seq_dim=delta_seq_dim)}


def _backward_results(outputs, dtype):
    """(dq, dk, dv) from _backward_outputs's after the launches, their guards checked: the
    one-pass backward's dq rounded from its fp32 sums, as csrc/attention.cu rounds it."""
    for out in outputs.values():
        out.check_guards()
    dq = outputs["dq"].tensor if "dq" in outputs else outputs["dq_accum"].tensor.to(dtype)
    return dq, outputs["dk"].tensor, outputs["dv"].tensor


def emulated_attention_bwd(do, q, k, v, o, lse, causal, scale, window_left=-1, window_right=-1, softcap=0.0,
                           alibi_slopes=None, dropout_p=0.0, dropout_seed=None, deterministic=True):
    """csrc/attention_kernels.cuh's backward on the emulator: (dq, dk, dv), contiguous, shaped like
    q, k, v (as csrc/attention.cu allocates them), the score options as the forward's. DO and O:
    q's shape and dtype, unit last stride; LSE: (B, H, Sq) fp32. DETERMINISTIC=False runs the
    one-pass backward (dQ added by atomics). Raises RuntimeError on a kernel fault or a store
    outside an output or the delta workspace; elements the kernels never store come back NaN."""
    _check_qkv(q, k, v)
    for t, name in ((do, "do"), (o, "o")):
        _check_16bit_4d(t, name, q.dtype)
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != q.shape[:3]:
        raise ValueError(f"lse must be float32 of shape (batch, heads, seqlen_q) {tuple(q.shape[:3])}")
    q, k, v, do = _copyable(q), _copyable(k), _copyable(v), _copyable(do)
    B, H, Sq, D = q.shape
    outputs = _backward_outputs(q, k, v, (B, H, Sq), (2, 2), deterministic)
    tensors = {"q": q, "k": k, "v": v, "o": o, "lse": lse.contiguous(), "do": do,
               **{name: out.tensor for name, out in outputs.items()}}
    _run_attention(True, tensors, causal, scale, (B, H, k.size(1), Sq, k.size(2), D), window_left, window_right,
                   softcap, alibi_slopes, dropout_p, dropout_seed)
    return _backward_results(outputs, q.dtype)


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k):
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int32 tensor")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_k must have cu_seqlens_q's length")


def emulated_attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                  window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                                  dropout_seed=None):
    """The forward over packed sequences, as remat.ops.attention_varlen.attention_varlen_fwd: q
    (total_q, H, D), k and v (total_k, Hkv, D), sequence b at rows cu_seqlens[b]:cu_seqlens[b + 1];
    returns o (total_q, H, D) and lse (H, total_q) fp32. As emulated_attention_fwd otherwise."""
    _check_qkv(q, k, v, dims=3)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    q, k, v = _copyable(q), _copyable(k), _copyable(v)
    total_q, H, D = q.shape
    o = _GuardedOutput("o", (total_q, H, D), q.dtype, seq_dim=0)
    lse = _GuardedOutput("lse", (H, total_q), torch.float32, seq_dim=1)
    _run_attention(False, {"q": q, "k": k, "v": v, "o": o.tensor, "lse": lse.tensor}, causal, scale,
                   (cu_seqlens_q.numel() - 1, H, k.size(1), max_seqlen_q, max_seqlen_k, D), window_left, window_right,
                   softcap, alibi_slopes, dropout_p, dropout_seed, (cu_seqlens_q, cu_seqlens_k))
    o.check_guards()
    lse.check_guards()
    return o.tensor, lse.tensor


def emulated_attention_varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                                  dropout_seed=None, deterministic=True):
    """The backward over packed sequences: (dq, dk, dv), contiguous, shaped like q, k, v; DO and O
    like q, LSE (H, total_q) fp32. As emulated_attention_bwd otherwise."""
    _check_qkv(q, k, v, dims=3)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    for t, name in ((do, "do"), (o, "o")):
        _check_16bit_4d(t, name, q.dtype, dims=3)
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must be float32 of shape (heads, total_q) {(q.shape[1], q.shape[0])}")
    q, k, v, do = _copyable(q), _copyable(k), _copyable(v), _copyable(do)
    total_q, H, D = q.shape
    outputs = _backward_outputs(q, k, v, (H, total_q), (0, 1), deterministic)
    tensors = {"q": q, "k": k, "v": v, "o": o, "lse": lse.contiguous(), "do": do,
               **{name: out.tensor for name, out in outputs.items()}}
    sizes = (cu_seqlens_q.numel() - 1, H, k.size(1), max_seqlen_q, max_seqlen_k, D)
    _run_attention(True, tensors, causal, scale, sizes, window_left, window_right, softcap, alibi_slopes, dropout_p,
                   dropout_seed, (cu_seqlens_q, cu_seqlens_k))
    return _backward_results(outputs, q.dtype)
