"""The block benchmark's memory-budget policies really compile under their budget."""

import re

import torch

from remat.policies import compiled_with_budget

from numerics import saved_bytes


def _mlp_stack():
    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        layers += [torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)]
    return torch.nn.Sequential(*layers)


def test_budget_policy_is_not_served_the_plain_compile_from_the_cache():
    # The plain compile runs first on the same stack, as in the benchmark: a budget applied by a
    # config patch around the call would reuse its cached graph and save exactly as much.
    stack, x = _mlp_stack(), torch.randn(128, 64, requires_grad=True)
    plain = saved_bytes(lambda: torch.compile(stack)(x))
    tight = saved_bytes(lambda: compiled_with_budget(stack, 0.1)(x))
    assert tight < plain
    torch.testing.assert_close(compiled_with_budget(stack, 0.1)(x), stack(x))


def test_the_remat_plan_rows_keep_within_their_budgets():
    from remat.bench import block
    from remat.gpt import GPTConfig, torch_stack
    from remat.planner import saved_bytes_of
    from remat.planner.units import is_planned

    cpu = torch.device("cpu")
    (case,) = block.cases(cpu, [torch.float32], quick=True)
    names = [impl.name for impl in case.implementations]
    # each with the plan's predicted extra time, beside which the bench measures the real one
    assert [re.fullmatch(r"(remat plan \d+%) \(\+\d+\.\d\d ms predicted\)", name).group(1)
            for name in names[-3:]] == ["remat plan 75%", "remat plan 50%", "remat plan 25%"]
    shape = block.CPU_SHAPE
    stack = torch_stack(GPTConfig(hidden=shape["hidden"], heads=shape["heads"], layers=shape["layers"]),
                        device="meta")
    x = torch.empty(shape["batch"], shape["seq"], shape["hidden"], device="meta", requires_grad=True)
    stock = saved_bytes_of(stack, (x,))
    kept = []
    for variant in block.plan_policies(cpu, x):
        fraction = int(variant.name.split()[-1].rstrip("%")) / 100
        run = variant.fn(stack)
        assert run is not stack and not is_planned(stack)  # planned and applied on a copy
        kept.append(saved_bytes_of(run, (x,)))
        assert kept[-1] <= fraction * stock, variant.name
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == 3  # three different plans
