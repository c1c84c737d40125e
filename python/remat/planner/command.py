"""`remat plan`: the plan for a model at a batch and sequence length and a budget, without a GPU.

The model is built on the meta device from its name or config.json (remat.memory.meta_model, as
`remat memory` builds them), so planning GPT-2 large at batch 8 costs no memory: remat's fused ops and torch's
checkpoints keep on meta what they keep on a GPU. (Stock attention through SDPA takes another
kernel on meta than on a GPU, so a stock or selective unit's count there is meta's SDPA's.)
"""

import re
import sys

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


def model_shape(name, batch=None, seq=None, command="remat plan"):
    """(batch, seq) the model `name` is planned at: remat memory's (remat.memory.shape), its default seq
    cut to the model's positions with a note on stderr."""
    from .. import memory

    batch, seq, note = memory.shape(name, batch, seq)
    if note:
        print(f"{command}: {note}", file=sys.stderr, flush=True)
    return batch, seq


def model_on_gpu(name, batch, seq, dtype=torch.bfloat16):
    """The model `remat plan --model name` plans, and its example inputs, on the current GPU with
    random weights and inputs (token ids 0): what remat.calibrate times its choices on. Its
    signature is the meta model's, so the plan finds the times. A RuntimeError without a GPU."""
    from .. import memory

    if not torch.cuda.is_available():
        raise RuntimeError("timing a model's plan choices needs a CUDA GPU, and torch sees none")
    model, example = memory.meta_model(name, batch, seq, dtype)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
        for buffer in model.buffers():  # rotary frequencies, position ids: the times do not depend on them
            buffer.zero_() if not buffer.is_floating_point() else buffer.normal_(0.0, 0.02)

    def real(t):
        if not isinstance(t, torch.Tensor):
            return t
        made = torch.zeros(t.shape, dtype=t.dtype, device="cuda")
        return (made.normal_() if t.is_floating_point() else made).requires_grad_(t.requires_grad)

    example = tuple(map(real, example)) if isinstance(example, tuple) else {k: real(v) for k, v in example.items()}
    return model, example


def run(name, batch=None, seq=None, budget=None, device=None, dtype=torch.bfloat16, json_path=None,
        budget_kind="saved", optimizer=None):
    """Plan model `name` (as remat memory builds it, at its shape: batch and seq where given, else remat
    memory's defaults) for `budget` (bytes, or text as "12GiB"), its times predicted for `device` (a
    name of remat.planner.DEVICES; default the GPU here where it is one, else H200, as remat memory);
    print the plan in human units, write it as JSON to json_path. Returns the Plan."""
    from .. import memory
    from . import plan

    memory.check_model(name)
    batch, seq = model_shape(name, batch, seq)
    model, example = memory.meta_model(name, batch, seq, dtype)
    result = plan(model, example, parse_bytes(budget) if isinstance(budget, str) else budget,
                  budget_kind=budget_kind, device=device or memory._gpu_here(), optimizer=optimizer)
    print(f"{name}: batch {batch}, seq {seq}, {str(dtype).replace('torch.', '')}")
    print(plan_text(result), flush=True)
    if json_path:
        with open(json_path, "w") as handle:
            handle.write(result.to_json())
    return result


def plan_text(result):
    """The Plan `result` as a table, its bytes in binary units as remat memory prints them (str(result)
    has the exact counts)."""
    from ..memory import size_text

    def row(label, choice="", count=None, seconds=None):
        size = size_text(count).strip() if count is not None else ""
        return f"{label:40s} {choice:10s} {size:>10s}" + (f" {seconds * 1e3:9.3f}" if seconds is not None else "")

    lines = [f"{'unit':40s} {'choice':10s} {'saved':>10s} {'extra ms':>9s}"]
    lines += [row(u, c, b, s) for u, c, b, s in zip(result.units, result.choices, result.unit_bytes,
                                                     result.unit_seconds)]
    if result.head is not None:
        lines.append(row("(LM head + loss)", result.head, result.head_bytes, result.head_seconds))
    lines.append(row("(outside the units)", count=result.base_bytes))
    lines.append(row("total", count=result.saved_bytes, seconds=result.extra_seconds))
    if result.host_bytes:
        lines.append(row("(offloaded to host memory)", count=result.host_bytes))
    if result.budget_kind == "peak":
        lines.append(row("+ parameters, gradients, optimizer state", count=result.fixed_bytes))
        lines.append(row("+ largest backward transient (a model)", count=result.transient_bytes))
        lines.append(row("predicted peak", count=result.peak_bytes))
    kind = "of the step's peak" if result.budget_kind == "peak" else "kept for the backward"
    how = "measured on" if result.measured else "predicted for"
    lines.append(f"budget {size_text(result.budget).strip()} {kind}; times {how} {result.device}")
    return "\n".join(lines)
