"""The benchmark suites' cases: every implementation passes its check, the float64 references are
right, and the memory column is the exact saved-byte count (CPU shapes, no torch.compile peers:
those are checked by the CLI run in tests/tools/test_cli.py and on the GPU)."""

import pytest
import torch

from remat import _backend, bench, cli
from remat.bench import attention, attention_varlen, block, experts, report
from remat.bench.cases import Timer, check_case, measure_case
from remat.gpt import RematGPTBlock

CPU = torch.device("cpu")


_MEASURED = {}  # (suite, dtype, sizes) -> _measured's result: tests reading one suite's run share it


def _measured(suite, dtype=torch.float32, sizes=None):
    """{(op, implementation): Result} of the suite's CPU cases with fwd+bwd, compiled peers left out."""
    key = (suite, dtype, tuple(sizes or ()))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(suite, dtype, sizes)
    return _MEASURED[key]


def _measure(suite, dtype, sizes):
    found = {}
    for case in bench.SUITES[suite].cases(CPU, [dtype], quick=True, sizes=sizes):
        if case.mode != "fwd+bwd":
            continue
        case.implementations = [impl for impl in case.implementations if not impl.compiles]
        for result in measure_case(case, Timer(CPU, warmup=0, reps=1), rounds=1):
            found[(case.op, result.implementation)] = result
    return found


@pytest.mark.parametrize("suite", [suite for suite in bench.SUITES if suite != "block"])  # block: below
def test_every_implementation_passes_its_check(suite):
    # A peer that cannot run here is a row that says why, not timed (the experts' Liger off a GPU: below).
    results = {key: r for key, r in _measured(suite).items() if not r.error.startswith("Skipped: ")}
    # Cases without a Check (attention with dropout: each implementation draws its own mask) are timed only.
    checked = {key: r for key, r in results.items() if r.case.check is not None}
    assert checked and all(r.check.startswith("ok (") for r in checked.values()), checked
    assert all(r.p50_ms > 0 for r in results.values()), results


def test_moe_runs_transformers_experts_and_counts_what_each_keeps():
    """`remat bench moe` on CPU (fp32; T = 32 tokens, h = 40, I = 40, 5 experts, top-2): remat's two
    policies, the stock loop and transformers' eager, batched_mm and grouped_mm experts (run by its
    Qwen3MoeExperts) each pass the float64 check of the output and every gradient; Liger's row says why
    it does not run. Bytes kept for the backward beyond x, the routing weights, the expert weights and
    the output: remat the sorted order and the offsets (int32); keep-hidden the pre-activation too;
    grouped_mm per pair docs/memory.md's table (the gathered token, the up projection's output, the
    gate's activation, the activation's output, the down projection's output, three int64 indices),
    plus the gathered routing weight and its int32 offsets; batched_mm each pair's expert weights."""
    tokens, width, inter, experts_count, top_k = (experts.CPU_TOKENS, experts.CPU_WIDTH, experts.CPU_INTER,
                                                  experts.CPU_EXPERTS, experts.CPU_TOP_K)
    pairs, b = tokens * top_k, 4
    assert bench.SUITES[cli.SUITE_ALIASES["moe"]] is experts and cli.parser().parse_args(["bench", "moe"]).ops == [
        "experts"]
    results = {name: r for (_, name), r in _measured("experts").items()}
    remat_name = next(name for name in results if name.startswith("remat-") and not name.endswith("-keep-hidden"))
    peers = ["torch", "transformers-eager", "transformers-batched_mm", "transformers-grouped_mm"]
    assert list(results) == [remat_name, f"{remat_name}-keep-hidden", *peers, "liger"]
    for name in [remat_name, f"{remat_name}-keep-hidden", *peers]:
        assert results[name].check.startswith("ok (") and not results[name].error, (name, results[name])
    liger = results["liger"]
    assert liger.error == "Skipped: GPU only: Triton kernels for CUDA tensors, not cpu" and liger.saved_bytes is None
    saved = {name: r.saved_bytes for name, r in results.items() if name != "liger"}
    assert saved[remat_name] == 4 * pairs + 4 * (experts_count + 1)
    assert saved[f"{remat_name}-keep-hidden"] == saved[remat_name] + pairs * 2 * inter * b
    assert saved["transformers-grouped_mm"] == pairs * ((2 * width + 2 * inter + 2 * inter + 1) * b + 24) + 4 * (
        experts_count)
    assert saved["transformers-eager"] == saved["torch"] > saved["transformers-grouped_mm"]  # the same loop
    assert saved["transformers-batched_mm"] > pairs * (2 * inter + inter) * width * b
    assert all(r.saved_sbh_per_layer == r.saved_bytes / (tokens * width) for name, r in results.items()
               if name != "liger")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_peers_run_in_half_precision_at_the_cpu_sizes(dtype):
    """transformers' peers pass their check in fp16 and bf16 too (torch's grouped_mm wants rows of a
    multiple of 16 bytes: the CPU sizes give it them), as `remat bench moe --device cpu` runs them."""
    (case,) = [c for c in experts.cases(CPU, [dtype], quick=True) if c.mode == "fwd+bwd"]
    case.implementations = [impl for impl in case.implementations if impl.name.startswith("transformers-")]
    results = check_case(case)
    assert len(results) == 3 and all(r.check.startswith("ok (") and not r.error for r in results), results


def test_moe_states_why_a_peer_does_not_run(monkeypatch):
    """batched_mm over BATCHED_MM_MAX_BYTES of gathered weights is skipped with the bytes, before
    it allocates; with LIGER_FUSED_MOE_AUTOTUNE=0 Liger's row says it runs untuned."""
    monkeypatch.setattr(experts, "BATCHED_MM_MAX_BYTES", 10**6)
    (case,) = [c for c in experts.cases(CPU, [torch.float32], quick=True) if c.mode == "fwd+bwd"]
    case.implementations = [impl for impl in case.implementations if impl.name == "transformers-batched_mm"]
    (result,) = check_case(case)
    gathered = experts.CPU_TOKENS * experts.CPU_TOP_K * 3 * experts.CPU_INTER * experts.CPU_WIDTH * 4
    assert result.error == (f"Skipped: each pair's weights gathered: {gathered / 1e9:.3g} GB > 0.001 GB (their "
                            "gradients as much again)") and not result.check
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "0")
    assert experts.implementations(CPU)[-1].name == "liger (autotune off)"


def test_mlp_memory_is_the_exact_saved_byte_count():
    """Beyond the input, weights and output (fp32, T = 128 tokens, h = 64, f = 256): the stock
    MLP keeps fc1's and GELU's outputs, remat's fc1's only; with a LayerNorm in front the stock
    stack also keeps the LayerNorm output, and both the fp32 mean and rstd per token."""
    tokens, hidden, ffn = 128, 64, 256
    results = _measured("mlp", sizes=[hidden])
    remat_name = next(name for op, name in results if name.startswith("remat"))
    stats = tokens * 2 * 4
    assert results[("mlp", remat_name)].saved_bytes == tokens * ffn * 4
    assert results[("mlp", "torch")].saved_bytes == 2 * tokens * ffn * 4
    assert results[("ln_mlp", remat_name)].saved_bytes == tokens * ffn * 4 + stats
    assert results[("ln_mlp", "torch")].saved_bytes == tokens * hidden * 4 + 2 * tokens * ffn * 4 + stats


def test_varlen_memory_is_the_lse_and_cu_seqlens():
    """Beyond the packed q, k, v and the output (the caller's), remat.attention_varlen keeps the fp32
    lse (heads x total tokens) and the int32 cu_seqlens; the padded run keeps the padded copies too."""
    (longest, count, heads, _), = attention_varlen.CPU_MIXES
    total = sum(attention_varlen.length_mix(longest, count))
    results = {name: r for (_, name), r in _measured("attention_varlen").items()}
    remat_name = next(name for name in results if name.startswith("remat-") and name != "remat-padded")
    assert results[remat_name].saved_bytes == 4 * heads * total + 4 * (count + 1)
    assert results["remat-padded"].saved_bytes > 3 * 4 * heads * total


def test_block_memory_per_layer_in_sbh():
    """fp32, per layer in bytes per s·b·h (remat/gpt.py: 32 and 20 in bf16): eager keeps 64,
    remat 40, both less the stack's input (4 sbh over L = 2 layers: the caller's) plus fp32
    statistics (two LayerNorms' mean and rstd, 16/h, and attention's logsumexp, 4·heads/h); a
    fully checkpointed stack keeps the second block's input. remat's ops on their references: the
    bytes autograd keeps are the kernels' (the ops' autograd is the same), and under the interpreter
    this case alone took 70 to 150 s."""
    with _backend.use_backend("reference"):
        results = {r.implementation: r for r in measure_case(_block_case(), Timer(CPU, warmup=0, reps=1),
                                                             rounds=1)}
    assert all(r.check.startswith("ok (") for r in results.values()), results
    shape = block.CPU_SHAPE
    statistics = (16 + 4 * shape["heads"]) / shape["hidden"]
    assert results["eager"].saved_sbh_per_layer == 64 - 4 / shape["layers"] + statistics
    assert results["remat"].saved_sbh_per_layer == 40 - 4 / shape["layers"] + statistics
    assert results["full checkpoint"].saved_sbh_per_layer == 4 / shape["layers"]
    assert results["offload to host"].saved_bytes == 0


def _block_case():
    # fp32: bf16 tl.dot is broken under the Triton interpreter (triton#11584), and the check says so
    (case,) = block.cases(CPU, [torch.float32], quick=True)
    case.implementations = [impl for impl in case.implementations if not impl.compiles]
    return case


def test_block_policies_train_the_stock_weights_in_stock_order():
    """The check compares each policy's weight gradients with the stock stack's by name: every
    policy's module must yield its weights in the stock order (remat's fused layers hold copies)."""
    stack, x, _ = _block_case().make_inputs()
    stock = list(stack.parameters())
    for policy in block.policies(CPU):
        if policy.compiles:
            continue
        run = policy.fn(stack)
        params = block.parameters_in_stock_order(run)
        assert [p.shape for p in params] == [p.shape for p in stock], policy.name
        assert all(torch.equal(p, q) for p, q in zip(params, stock)), policy.name
        if any(isinstance(m, RematGPTBlock) for m in run.modules()):
            assert not any(p is q for p, q in zip(params, stock)), policy.name


def test_attention_reference_in_chunks_equals_the_whole(monkeypatch):
    """The float64 reference runs a few heads at a time on the GPU's long sequences; forced here
    into chunks of one head, it must give what one SDPA call over all heads gives."""
    q, k, v, do = (torch.randn(2, 3, 40, 16, requires_grad=i < 3) for i in range(4))
    whole = attention._float64_reference(True)((q, k, v, do))
    monkeypatch.setattr(attention, "REFERENCE_CHUNK_BYTES", 40 * 40 * 8)
    chunked = attention._float64_reference(True)((q, k, v, do))
    assert whole.keys() == chunked.keys() == {"out", "dq", "dk", "dv"}
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], rtol=1e-12, atol=1e-12)


def test_gpu_table_keeps_rates_and_peer_ratios():
    """On a GPU (a performance run) the table has the rate, the ratio to the best peer and the peak."""
    case = next(iter(bench.SUITES["layernorm"].cases(CPU, [torch.float32], quick=True)))
    results = measure_case(case, Timer(CPU, warmup=0, reps=1), rounds=1)
    env = {"device": "NVIDIA H200", "timings": report.PERFORMANCE}
    text = report.text_table(report.rows([results]), env)
    header = text.splitlines()[1]
    assert "rate" in header and "vs best peer" in header and "peak MB" in header and "CPU run" not in text
    ours = next(line for line in text.splitlines()[2:] if " remat-" in line)
    assert "GB/s" in ours and ours.split("GB/s")[1].split()[0].endswith("x")


def test_shapes_option_reaches_every_suite_on_cpu():
    """--shapes sets the sizes on CPU too (GELU's row count was ignored there)."""
    shapes = {suite: {case.shape for case in bench.SUITES[suite].cases(CPU, [torch.float32], quick=True, sizes=[48])}
              for suite in ("layernorm", "rms_norm", "gelu", "gated", "mlp")}
    assert shapes == {"layernorm": {"M=256 N=48"}, "rms_norm": {"M=256 N=48"}, "gelu": {"M=48 N=1000"},
                      "gated": {"M=48 N=1000"}, "mlp": {"T=128 h=48 f=192", "T=128 h=48 f=129 (gated)"}}
