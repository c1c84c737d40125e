"""`remat plan`: the plan for a model at a batch and sequence length and a budget, without a GPU.

The model is built on the meta device from its name or config.json (remat.memory.meta_model, as
`remat memory` builds them), so planning GPT-2 large at batch 8 costs no memory: remat's fused ops and torch's
checkpoints keep on meta what they keep on a GPU. (Stock attention through SDPA takes another
kernel on meta than on a GPU, so a stock or selective unit's count there is meta's SDPA's.)
"""

import re

import torch

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text):
    """"12GiB", "500MB", "1.5GiB" or a plain number of bytes -> bytes; a ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).upper()
    if not match or unit not in _UNITS:
        raise ValueError(f"budget must be bytes, as 12GiB, 500MB or 1000000, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def run(name, batch, seq, budget, device="H100", dtype=torch.bfloat16, json_path=None, budget_kind="saved",
        optimizer=None):
    from .. import memory
    from . import plan

    model, example = memory.meta_model(name, batch, seq, dtype)
    result = plan(model, example, parse_bytes(budget) if isinstance(budget, str) else budget,
                  budget_kind=budget_kind, device=device, optimizer=optimizer)
    print(f"{name}: batch {batch}, seq {seq}, {str(dtype).replace('torch.', '')}")
    print(result, flush=True)
    if json_path:
        with open(json_path, "w") as handle:
            handle.write(result.to_json())
    return result
