"""`remat plan`: models built on meta, counted as on a GPU, planned from a budget on the command line."""

import pytest
import torch

from remat.cli import main
from remat.gpt import GPTConfig, torch_stack
from remat.memory import size_text
from remat.planner import Plan, measure
from remat.planner.command import parse_bytes

BF16 = 2


def test_a_stock_gpt_block_on_meta_keeps_what_it_keeps_on_a_gpu():
    # design notes: eager keeps 32 sbh per block on an H200 (flash SDPA); on meta, SDPA's math
    # path would keep the s x s probabilities as well
    batch, seq, hidden, heads = 2, 64, 64, 2
    stack = torch_stack(GPTConfig(hidden=hidden, heads=heads, layers=2), device="meta", dtype=torch.bfloat16)
    x = torch.empty(batch, seq, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    saves, _, _ = measure(stack, (x,))
    sbh, rows = seq * batch * hidden, seq * batch
    # x, LN1(x), qkv, o, LN2 input and output: 2 + 2 + 6 + 2 + 2 + 2 sbh; fc1 and GELU outputs
    # 8 + 8 sbh; two LayerNorms' fp32 mean and rstd; attention's fp32 log-sum-exp per head and row
    expected = 32 * sbh + 2 * 8 * rows + 4 * heads * rows
    second = saves["stock"].units[1]  # its input is the first block's output (the first one's is the caller's)
    kept = second.internal_bytes + sum(saves["stock"].key_bytes[k] for k in second.shared_keys)
    assert 0 <= kept - expected <= 32  # plus flash attention's RNG seed and offset (scalars)


@pytest.mark.parametrize("text, expected", [("12GiB", 12 * 2**30), ("500MB", 500 * 10**6), ("1.5KiB", 1536),
                                            ("1000", 1000)])
def test_budgets_on_the_command_line(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["12 parsecs", "", "GiB", "-1GB"])
def test_a_budget_that_is_no_size_is_a_clear_error(text):
    with pytest.raises(ValueError, match="budget must be bytes"):
        parse_bytes(text)


def test_plan_command_prints_and_writes_the_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    main(["plan", "--model", "tiny", "--batch", "2", "--seq", "16", "--budget", "40KiB", "--device", "H200",
          "--json", str(path)])
    printed = capsys.readouterr().out
    plan = Plan.from_json(path.read_text())
    assert plan.saved_bytes <= 40 * 1024 and plan.device == "H200" and len(plan.choices) == 4
    assert size_text(plan.saved_bytes).strip() in printed and "times predicted for H200" in printed


def test_plan_command_with_too_small_a_budget_names_the_least(capsys):
    with pytest.raises(SystemExit, match="below the least this model can keep at these inputs: [0-9]+ bytes"):
        # planned for the CPU: no offloading, which could keep nothing on the device
        main(["plan", "--model", "tiny", "--batch", "2", "--seq", "16", "--budget", "1KiB", "--device", "cpu"])


def test_memory_with_a_budget_prints_the_plans_mix(capsys):
    from remat.memory import _print_plan

    _print_plan("tiny", 2, 16, 1e-4, torch.bfloat16, torch.device("cpu"))  # 107 kB: less than stock keeps
    printed = capsys.readouterr().out
    assert printed.startswith("remat plan, 0.0001 GB kept for the backward: ") and "full" in printed
    _print_plan("tiny", 2, 16, 1e-7, torch.bfloat16, torch.device("cpu"))
    assert "below the least this model can keep" in capsys.readouterr().out


def test_plan_command_with_a_peak_budget_counts_the_optimizer(tmp_path, capsys):
    path = tmp_path / "plan.json"
    main(["plan", "--model", "tiny", "--batch", "2", "--seq", "16", "--budget", "2MiB", "--budget-kind", "peak",
          "--optimizer", "adam", "--device", "H200", "--json", str(path)])
    plan = Plan.from_json(path.read_text())
    assert plan.budget_kind == "peak" and plan.peak_bytes <= 2 * 2**20
    with_bytes = tmp_path / "bytes.json"
    main(["plan", "--model", "tiny", "--batch", "2", "--seq", "16", "--budget", "4MiB", "--budget-kind", "peak",
          "--optimizer", "12", "--json", str(with_bytes)])  # 12 bytes per element: more than Adam's 2 x bf16
    assert Plan.from_json(with_bytes.read_text()).fixed_bytes > plan.fixed_bytes
    assert "predicted peak" in capsys.readouterr().out


def test_plan_command_for_a_gpu_offloads_below_what_checkpointing_keeps(tmp_path):
    path = tmp_path / "plan.json"
    main(["plan", "--model", "tiny", "--batch", "2", "--seq", "16", "--budget", "1KiB", "--device", "H200",
          "--json", str(path)])
    plan = Plan.from_json(path.read_text())
    assert "offload" in plan.choices and plan.saved_bytes <= 1024 < plan.host_bytes


def test_a_fused_gpt_block_on_meta_keeps_what_the_design_notes_say():
    # remat's choice for a remat.gpt stock block (fused through torch.fx, SDPA stock): 20 sbh per
    # block in bf16, not 32 (LayerNormLinear keeps x, not LN(x); LayerNormMLP keeps fc1's output only)
    batch, seq, hidden, heads = 2, 64, 64, 2
    stack = torch_stack(GPTConfig(hidden=hidden, heads=heads, layers=2), device="meta", dtype=torch.bfloat16)
    x = torch.empty(batch, seq, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    saves, _, fusable = measure(stack, (x,))
    assert fusable == [True, True]
    sbh, rows = seq * batch * hidden, seq * batch
    second = saves["remat"].units[1]
    kept = second.internal_bytes + sum(saves["remat"].key_bytes[k] for k in second.shared_keys)
    assert 0 <= kept - (20 * sbh + 2 * 8 * rows + 4 * heads * rows) <= 32
