"""The CPU warp emulator (tests/cuda_emulator/warp_emulator.h) against the PTX semantics it stands
in for: mma.m16n8k16 on fragments built from the documented per-lane layouts, ldmatrix .x4 with and
without .trans, shfl.bfly, cp.async's deferred groups and zero fill, the built-in indices, and the
faults (bad addresses, deadlocks, divergent collectives). The kernels are in
tests/cuda_emulator/emulator_selftest.cpp; no GPU is needed. Last, a smoke test that the
attention harness runs csrc/attention_kernels.cuh (its numerical tests are elsewhere)."""

import ctypes
import subprocess
import sys

import pytest
import torch

from remat.ops.attention import attention_grads_ref, attention_ref

from attention_checks import assert_matches_float64
from cuda_emulator import _GuardedOutput, build_emulated, call, emulated_attention_bwd, emulated_attention_fwd

FLOAT16_TYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# The fiber switch of x86-64 (a few instructions) and the ucontext one of other machines.
SWITCHES = {"stack-switch": (), "ucontext": ("-DREMAT_EMU_UCONTEXT",)}


def selftest(switch="stack-switch"):
    return build_emulated("emulator_selftest.cpp", "emulator_selftest", SWITCHES[switch])


def ptr(tensor):
    assert tensor.is_contiguous()
    return ctypes.c_void_p(tensor.data_ptr())


# ---- mma_16816 ----

def bits16(values):
    """The 16-bit patterns of a float16/bfloat16 tensor, as int64."""
    return values.view(torch.int16).to(torch.int64) & 0xFFFF


def pack(low, high):
    return bits16(low) | bits16(high) << 16


def mma_fragments(a, b, c):
    """Per-lane registers of A (16 x 16), B (16 x 8), C (16 x 8 fp32), lane = 4 g + t (PTX ISA,
    "Matrix Fragments for mma.m16n8k16")."""
    ra, rb, rc = [], [], []
    for lane in range(32):
        g, t = divmod(lane, 4)
        a_at = ((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))  # (row, first k) of a[0..3]
        ra.append([pack(a[r, k], a[r, k + 1]) for r, k in a_at])
        rb.append([pack(b[k, g], b[k + 1, g]) for k in (2 * t, 2 * t + 8)])
        rc.append([c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]])
    return torch.tensor(ra), torch.tensor(rb), torch.tensor(rc)


def accumulator_matrix(rd):
    d = torch.empty(16, 8, dtype=rd.dtype)
    for lane in range(32):
        g, t = divmod(lane, 4)
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = rd[lane]
    return d


@pytest.mark.parametrize("values", ["normal", "integers"])
@pytest.mark.parametrize("name", FLOAT16_TYPES)
def test_mma_16816_is_a_times_b_plus_c_with_the_fragment_layouts(name, values):
    dtype, warps = FLOAT16_TYPES[name], 2

    def draw(*shape):
        if values == "integers":  # every partial sum is an exact fp32 value: the result must be exact
            return torch.randint(-4, 5, shape).to(torch.float64)
        return torch.randn(shape, dtype=torch.float64)

    a, b, c = draw(warps, 16, 16).to(dtype), draw(warps, 16, 8).to(dtype), draw(warps, 16, 8).to(torch.float32)
    fragments = [mma_fragments(a[w], b[w], c[w]) for w in range(warps)]
    ra = torch.cat([f[0] for f in fragments]).to(torch.int32).contiguous()  # uint32 bit patterns
    rb = torch.cat([f[1] for f in fragments]).to(torch.int32).contiguous()
    rd = torch.cat([f[2] for f in fragments]).to(torch.float32).contiguous()
    assert call(selftest().selftest_mma, int(name == "bf16"), warps, ptr(ra), ptr(rb), ptr(rd)) == ""
    for w in range(warps):
        d = accumulator_matrix(rd[32 * w:32 * (w + 1)]).double()
        a64, b64, c64 = a[w].double(), b[w].double(), c[w].double()
        reference = c64 + a64 @ b64
        # Sixteen fp32 additions onto exact products: each rounds by at most 2^-24 relative.
        bound = 17 * 2.0**-24 * (c64.abs() + a64.abs() @ b64.abs()) if values == "normal" else 0.0
        assert ((d - reference).abs() <= bound).all(), f"warp {w}: max error {(d - reference).abs().max():.3g}"
        assert not torch.equal(d, c64)


# ---- conversions ----

def test_host_conversions_round_to_nearest_even():
    # Ties of both types (1 + 2^-11 for fp16, 1 + 2^-8 for bf16, each way), fp16 overflow and
    # subnormals, then random values over many binades.
    special = [1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 65519.0, 65520.0, 2.0**-25,
               3 * 2.0**-26, -(2.0**-24), 1e-40, -0.0, float("inf"), 3.0e38, -1.0 / 3]
    x = torch.cat([torch.tensor(special), torch.randn(2000) * torch.exp2(torch.randint(-30, 30, (2000,)).float())])
    x = x.float().contiguous()
    n = x.numel()
    half_pairs, bf16_pairs = torch.zeros(n // 2, dtype=torch.int32), torch.zeros(n // 2, dtype=torch.int32)
    half_back, bf16_back = torch.zeros(n), torch.zeros(n)
    selftest().selftest_conversions(ptr(x), n, ptr(half_pairs), ptr(bf16_pairs), ptr(half_back), ptr(bf16_back))
    for dtype, pairs, back in ((torch.float16, half_pairs, half_back), (torch.bfloat16, bf16_pairs, bf16_back)):
        rounded = x.to(dtype)  # torch rounds to nearest even on every CPU
        assert torch.equal(back, rounded.float()), dtype
        bits = (pairs.to(torch.int64) & 0xFFFFFFFF)
        want = bits16(rounded[0::2]) | bits16(rounded[1::2]) << 16  # x in the low half, y in the high
        assert torch.equal(bits, want), dtype


# ---- ldmatrix ----

SMEM_ELEMENTS = 1024  # 16-bit elements: 128 rows of 16 bytes, element e holding the value e


def run_ldmatrix(offsets, transpose):
    offsets = torch.tensor(offsets, dtype=torch.int32)
    out = torch.zeros(32, 4, dtype=torch.int32)
    message = call(selftest().selftest_ldmatrix, ptr(offsets), SMEM_ELEMENTS, int(transpose), ptr(out))
    return message, out.to(torch.int64) & 0xFFFFFFFF


def expected_ldmatrix(offsets, transpose):
    """Lane l, register i: row l / 4, columns 2 (l % 4) and + 1 of matrix i (of its transpose with
    .trans), matrix i's row r starting at element offsets[8 i + r]."""
    out = torch.zeros(32, 4, dtype=torch.int64)
    for lane in range(32):
        row, col = lane // 4, 2 * (lane % 4)
        for i in range(4):
            if transpose:
                low, high = offsets[8 * i + col] + row, offsets[8 * i + col + 1] + row
            else:
                low, high = offsets[8 * i + row] + col, offsets[8 * i + row] + col + 1
            out[lane, i] = low | high << 16
    return out


@pytest.mark.parametrize("transpose", [False, True], ids=["x4", "x4.trans"])
def test_ldmatrix_gives_each_lane_its_rows_and_columns(transpose):
    rows = torch.randperm(SMEM_ELEMENTS // 8)[:32]
    rows[31] = SMEM_ELEMENTS // 8 - 1  # the last 16 bytes of shared memory are inside it
    offsets = (rows * 8).tolist()
    message, out = run_ldmatrix(offsets, transpose)
    assert message == ""
    assert torch.equal(out, expected_ldmatrix(offsets, transpose))


@pytest.mark.parametrize("offset, problem", [
    (8 * 3 + 4, "is not 16-byte aligned"),                 # 8 bytes into a row
    (SMEM_ELEMENTS, "is not inside the block's dynamic shared memory"),  # just past the end
    (-8, "is not inside the block's dynamic shared memory"),
])
@pytest.mark.parametrize("transpose", [False, True], ids=["x4", "x4.trans"])
def test_ldmatrix_faults_on_a_bad_row_address(transpose, offset, problem):
    offsets = [8 * lane for lane in range(32)]
    offsets[5] = offset
    message, _ = run_ldmatrix(offsets, transpose)
    name = "ldmatrix_x4_trans" if transpose else "ldmatrix_x4"
    assert f"{name} row address {problem}" in message
    assert f"(shared memory offset {2 * offset} of {2 * SMEM_ELEMENTS} bytes)" in message
    assert "thread 5 (threadIdx (5,0,0), warp 0 lane 5)" in message


def test_ldmatrix_counts_the_passes_bank_conflicts_cost():
    """Matrix 0's rows 128 bytes apart share one bank group (8 passes, 7 extra); matrix 1's
    consecutive rows take one; matrix 2's eight rows at one address are a broadcast (one pass);
    matrix 3's rows 0 and 1 differ by 128 bytes (2 passes: 1 extra)."""
    library = selftest()
    library.selftest_take_ldmatrix_extra_passes.restype = ctypes.c_uint64
    offsets = ([64 * r for r in range(8)] + [512 + 8 * r for r in range(8)] + [640] * 8
               + [768, 832] + [776 + 8 * r for r in range(6)])
    library.selftest_take_ldmatrix_extra_passes()
    for transpose in (False, True):
        message, _ = run_ldmatrix(offsets, transpose)
        assert message == ""
        assert library.selftest_take_ldmatrix_extra_passes() == 7 + 0 + 0 + 1
    message, _ = run_ldmatrix([8 * lane for lane in range(32)], False)
    assert message == "" and library.selftest_take_ldmatrix_extra_passes() == 0


# ---- __shfl_xor_sync ----

def run_shfl(lane_mask, threads=64, mask=0xFFFFFFFF):
    f = torch.randn(threads, dtype=torch.float32)
    n = torch.randint(-2**31, 2**31 - 1, (threads,), dtype=torch.int32)
    u = torch.randint(-2**31, 2**31 - 1, (threads,), dtype=torch.int32)  # read as unsigned
    inputs = [f.clone(), n.clone(), u.clone()]
    message = call(selftest().selftest_shfl_xor, threads, ctypes.c_uint(mask), lane_mask, ptr(f), ptr(n), ptr(u))
    return message, inputs, [f, n, u]


@pytest.mark.parametrize("lane_mask", [1, 2, 4, 8, 16, 31, 37])
def test_shfl_xor_gives_each_lane_the_value_of_lane_xor_mask(lane_mask):
    message, inputs, outputs = run_shfl(lane_mask)
    assert message == ""
    lanes = torch.arange(64)
    source = lanes // 32 * 32 + (lanes % 32 ^ lane_mask % 32)  # within its own warp; the mask's low 5 bits
    for before, after in zip(inputs, outputs):
        assert torch.equal(after, before[source])


def test_shfl_xor_faults_on_a_partial_mask():
    message, _, _ = run_shfl(1, mask=0x0000FFFF)
    assert "__shfl_xor_sync with mask 0x0000ffff: the emulator takes the full mask only" in message


# ---- cp.async ----

OLD = 0x3C003C00  # what each thread stores in its slots before the copies (1.0 as two fp16)
GARBAGE = 0xFFFFFFFF  # the launch's fill of shared memory


@pytest.mark.parametrize("switch", SWITCHES)
def test_cp_async_lands_only_when_its_group_is_waited_for(switch):
    src = torch.randint(0, 2**31 - 1, (32 * 8,), dtype=torch.int32)
    seen = torch.zeros(32, 5, 3, 4, dtype=torch.int32)
    assert call(selftest(switch).selftest_cp_async, ptr(src), ctypes.c_uint(OLD), ptr(seen)) == ""
    seen = seen.to(torch.int64) & 0xFFFFFFFF
    copy_a, copy_b = src.view(32, 2, 4)[:, 0], src.view(32, 2, 4)[:, 1]
    old = torch.full((32, 4), OLD, dtype=torch.int64)
    zeros = torch.zeros(32, 4, dtype=torch.int64)
    expected = [  # per stage: slots a, b and the zero fill
        [torch.full((32, 4), GARBAGE, dtype=torch.int64)] * 3,
        [old, old, old],  # issued: nothing has landed
        [copy_a, old, old],  # wait<1>: the older group only
        [copy_a, copy_b, old],  # wait<0>: the zero fill was never committed
        [copy_a, copy_b, zeros],  # committed and waited: 16 zero bytes
    ]
    for stage, slots in enumerate(expected):
        for slot, want in enumerate(slots):
            assert torch.equal(seen[:, stage, slot], want.to(torch.int64)), f"stage {stage}, slot {slot}"


def run_cp_async_one(dst_offset, src_offset, readable_bytes=-1, smem_bytes=256):
    src = torch.zeros(256, dtype=torch.uint8)
    assert src.data_ptr() % 16 == 0
    return call(selftest().selftest_cp_async_one, ptr(src), readable_bytes, smem_bytes, dst_offset, src_offset)


def test_cp_async_accepts_the_last_16_bytes_of_shared_and_readable_memory():
    assert run_cp_async_one(dst_offset=240, src_offset=48, readable_bytes=64) == ""


@pytest.mark.parametrize("dst_offset, src_offset, readable_bytes, expected", [
    (8, 0, -1, ("cp_async_16 destination is not 16-byte aligned", "(shared memory offset 8 of 256 bytes)")),
    (256, 0, -1, ("cp_async_16 destination is not inside the block's dynamic shared memory", "offset 256 of 256")),
    (-16, 0, -1, ("cp_async_16 destination is not inside the block's dynamic shared memory", "offset -16 of 256")),
    (0, 4, -1, ("cp_async_16 source 0x", "is not 16-byte aligned")),
    (0, 64, 64, ("cp_async_16 source 0x", "is outside every readable global buffer (src [0x", ", +64)")),
])
def test_cp_async_faults_on_a_bad_address(dst_offset, src_offset, readable_bytes, expected):
    message = run_cp_async_one(dst_offset, src_offset, readable_bytes)
    assert all(part in message for part in expected), message
    assert "at block (0,0,0) thread 0 (threadIdx (0,0,0), warp 0 lane 0)" in message


# ---- built-in indices ----

def test_each_thread_sees_its_own_indices_x_fastest():
    grid, block = (2, 3, 1), (8, 4, 2)
    threads = 8 * 4 * 2
    out = torch.full((2 * 3 * threads, 12), -1, dtype=torch.int32)
    grid_t, block_t = torch.tensor(grid, dtype=torch.int32), torch.tensor(block, dtype=torch.int32)
    assert call(selftest().selftest_indices, ptr(grid_t), ptr(block_t), ptr(out)) == ""
    expected = [[tx, ty, tz, bx, by, 0, *block, *grid]
                for by in range(3) for bx in range(2)
                for tz in range(2) for ty in range(4) for tx in range(8)]
    assert out.tolist() == expected


# ---- faults of the programming model ----

@pytest.mark.parametrize("case, expected", [
    (0, "thread exits while 32 threads wait for it at __syncthreads, at block (0,0,0) thread 32 "),
    (1, "__syncthreads after 32 thread(s) of the block exited (they never arrive), at block (0,0,0) thread 32 "),
    (2, "deadlock in block (0,0,0):\n  threads 0-15: __syncthreads\n  threads 16-31: __shfl_xor_sync"),
    (3, "ldmatrix_x4 called while 1 other lane(s) of the warp wait at __shfl_xor_sync, at block (0,0,0) thread 1 "),
    (4, "__shfl_xor_sync in a warp of fewer than 32 threads (the block has 48) at block (0,0,0) thread 32 "),
], ids=["exit-while-others-wait", "barrier-after-exit", "deadlock", "mixed-collectives", "partial-warp"])
@pytest.mark.parametrize("switch", SWITCHES)
def test_a_kernel_that_breaks_a_rule_faults_with_a_message(switch, case, expected):
    message = call(selftest(switch).selftest_fault, case)
    assert message.startswith("remat_emu: " + expected), message


def test_static_shared_memory_is_a_compile_error(tmp_path):
    # It would be one array per thread here, not per block.
    source = tmp_path / "static_shared.cpp"
    source.write_text('#include "tensor_core.cuh"\n__global__ void kernel() { __shared__ float x[32]; x[0] = 0; }\n')
    with pytest.raises(RuntimeError, match="the warp emulator has no static __shared__ memory: use REMAT_DYNAMIC_SMEM"):
        build_emulated(str(source), "static_shared")


def test_an_uncaught_fault_aborts_the_process_with_its_message():
    library = selftest()._name
    done = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({library!r}).selftest_unguarded_fault()"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "remat_emu: thread exits while 32 threads wait for it at __syncthreads" in done.stderr, done.stderr


# ---- many blocks of collectives and barriers ----

@pytest.mark.parametrize("switch", SWITCHES)
def test_many_blocks_of_shuffles_mmas_and_barriers_give_the_known_result(switch):
    blocks, threads, iterations = 5, 128, 40
    values = torch.zeros(blocks * threads, dtype=torch.float32)
    accumulators = torch.zeros_like(values)
    assert call(selftest(switch).selftest_busy, blocks, threads, iterations, ptr(values), ptr(accumulators)) == ""
    moved = 0  # each iteration moves every value to lane l ^ (1 << k % 5)
    for k in range(iterations):
        moved ^= 1 << k % 5
    lanes = torch.arange(blocks * threads) % 32
    assert torch.equal(values, ((lanes ^ moved) + iterations).to(torch.float32))
    assert torch.equal(accumulators, torch.full_like(values, 4 * 16 * iterations))


# ---- the attention harness (tests/cuda_emulator/attention_harness.cpp) ----

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_attention_harness_runs_the_kernels_forward_and_backward(dtype):
    # A smoke test of the harness, not of the kernels: GQA, causal with Sq < Sk, both sequences
    # ending inside a tile, head dim 40 (computed at 64), q in the (B, S, H, D) layout, k
    # contiguous but 2 bytes off 16-byte alignment (copied, as cp.async cannot read it).
    q = torch.randn(1, 37, 4, 40).to(dtype).transpose(1, 2)
    k = torch.randn(1 + 2 * 45 * 40).to(dtype)[1:].view(1, 2, 45, 40)
    v = torch.randn(1, 2, 45, 40).to(dtype)
    do = torch.randn(q.shape).to(dtype)
    o, lse = emulated_attention_fwd(q, k, v, True, 0.3)
    dq, dk, dv = emulated_attention_bwd(do, q, k, v, o, lse, True, 0.3)
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    o_ref, lse_ref = attention_ref(q64, k64, v64, True, 0.3)
    grads_ref = attention_grads_ref(do64, q64, k64, v64, o_ref, True, 0.3)
    assert_matches_float64((o, lse, dq, dk, dv), (o_ref, lse_ref, *grads_ref), dtype)
    assert o.transpose(1, 2).is_contiguous() and dq.is_contiguous() and dq.shape == q.shape


def test_an_output_guard_reports_a_store_past_either_end():
    out = _GuardedOutput("o", (2, 3, 5, 8), torch.float16, order=(0, 2, 1, 3))
    assert out.tensor.shape == (2, 3, 5, 8) and out.tensor.transpose(1, 2).is_contiguous()
    assert out.tensor.isnan().all()
    out.tensor.zero_()
    out.check_guards()  # stores inside the tensor are fine
    assert out.guard == 64 * 3 * 8  # 64 sequence rows of (H, D)
    out.buffer[out.guard + out.tensor.numel() + 5] = 1.0
    with pytest.raises(RuntimeError, match=r"wrote 1 element\(s\) after o \(guard elements \[5\] of 1536\)"):
        out.check_guards()
    out = _GuardedOutput("lse", (2, 3, 5), torch.float32)
    out.buffer[out.guard - 1] = 0.0
    with pytest.raises(RuntimeError, match=r"wrote 1 element\(s\) before lse \(guard elements \[63\] of 64\)"):
        out.check_guards()


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q.float(), k, v), "q must be float16 or bfloat16"),
    (lambda q, k, v: (q, k.bfloat16(), v), "k must have q's dtype"),
    (lambda q, k, v: (q, k, v.transpose(2, 3)), "v must have a unit stride in its last dim"),
    (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), "head_dim must be a multiple of 8 from 8 to 256, got 12"),
    (lambda q, k, v: (q[:, :3], k, v), r"q's heads \(3\) must be a multiple of k's \(2\)"),
])
def test_the_attention_wrappers_name_a_bad_argument(change, message):
    q, k, v = torch.randn(1, 4, 16, 16).half(), torch.randn(1, 2, 16, 16).half(), torch.randn(1, 2, 16, 16).half()
    with pytest.raises(ValueError, match=message):
        emulated_attention_fwd(*change(q, k, v), False, 0.25)
