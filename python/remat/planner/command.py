"""`remat plan`: the plan for a model at a batch and sequence length and a budget, without a GPU.

The model is built on the meta device from its name or config.json (as `remat memory` builds
them), so planning GPT-2 large at batch 8 costs no memory: remat's fused ops and torch's
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


def meta_model(name, batch, seq, dtype):
    """(model on the meta device, its example inputs) for a `remat memory` model name or config.json."""
    from .. import memory
    from ..gpt import torch_stack

    memory.check_model(name)
    if name in memory.MODELS:
        config = memory.MODELS[name]
        stack = torch_stack(config, device="meta", dtype=dtype)
        return stack, (torch.empty(batch, seq, config.hidden, device="meta", dtype=dtype, requires_grad=True),)
    import transformers

    from ..convert.hf import memory_input

    config = memory._hf_config(name)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config).to(dtype).train()
    make_input = memory_input(config.model_type)
    if make_input is not None:
        input_name, x, _ = make_input(config, batch, seq, "meta", dtype)
    else:
        input_name, x = "input_ids", torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {input_name: x}


def run(name, batch, seq, budget, device="H100", dtype=torch.bfloat16, json_path=None):
    from . import plan

    model, example = meta_model(name, batch, seq, dtype)
    result = plan(model, example, parse_bytes(budget) if isinstance(budget, str) else budget, device=device)
    print(f"{name}: batch {batch}, seq {seq}, {str(dtype).replace('torch.', '')}")
    print(result, flush=True)
    if json_path:
        with open(json_path, "w") as handle:
            handle.write(result.to_json())
    return result
