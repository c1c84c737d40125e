"""`remat memory`: the activation-memory / step-time trade-off of a model under each policy.

For each policy it reports the bytes the forward keeps for the backward per layer: on a GPU read
from the allocator; without one counted exactly, each storage once, with saved-tensor hooks plus
what torch's checkpoints hold (block inputs, the op outputs selective checkpointing keeps), but
not for Hugging Face's own checkpointing (nan). On a GPU it also reports the step time and the
peak memory of one training step: absolute, so weights, input, gradients and activations, but
not optimizer state.
It draws the memory/time frontier, and with a budget names the cheapest policy whose peak fits,
and the per-layer mix `remat plan` chooses for that many bytes kept for the backward.

Each policy's row is printed, and the CSV rewritten, as soon as it is measured: a policy that
fails (out of memory, no pinned host memory for offloading) becomes a row with an error, and an
interrupt (Ctrl-C, `timeout -s INT`) stops the run but still reports what was measured.

Models: stacks of remat.gpt blocks sized like GPT-2 (gpt2-small, -medium, -large), with every
policy: eager; remat (fused recompute); torch selective checkpointing (keep matmul and attention
outputs); full checkpointing per block; offloading saved activations to host memory; remat with
full checkpointing of k of the L blocks. And Hugging Face models built from a config
(bert-base, vit-base, hf-gpt2-small, hf-gpt2-medium, or the path of a config.json), with eager,
remat.convert, Hugging Face's gradient checkpointing with and without remat, and offloading.
"""

import collections
import contextlib
import copy
import csv
import dataclasses
import gc
import json
import math
import os
import re

import torch

from .bench.cases import short_error
from .bench.timing import Timer, quantiles
from .convert.hf import memory_input as hf_memory_input
from .convert.hf import memory_models as hf_memory_models
from .gpt import GPTConfig, torch_stack
from .policies import policies as policy_table
from .saved import SavedStorages, count_saved_bytes

MODELS = {
    "gpt2-small": GPTConfig(hidden=768, heads=12, layers=12),
    "gpt2-medium": GPTConfig(hidden=1024, heads=16, layers=24),
    "gpt2-large": GPTConfig(hidden=1280, heads=20, layers=36),
    "tiny": GPTConfig(hidden=64, heads=2, layers=4),
}


@dataclasses.dataclass
class PolicyResult:
    policy: str
    saved_bytes: float  # kept on the device for the backward, all layers (nan: not measurable here)
    host_bytes: float  # kept in host memory (offloading)
    per_layer_sbh: float
    step_ms: float = math.nan
    peak_gb: float = math.nan  # absolute peak of one training step (weights, input, gradients, activations)
    error: str = ""  # why the policy could not be measured; its numbers are then nan


def policies(layers):
    """(name, make(stock stack) -> (module, offload)) for every policy remat memory measures: the
    eager-mode ones of remat.policies, with remat + full checkpointing of a quarter, half and three
    quarters of the blocks. Offloading is counted by the measurement itself (offload=True)."""
    return [(p.name, lambda s, p=p: (s, True) if p.offloads else (p.make(s), False))
            for p in policy_table(layers, checkpointed_fractions=(0.25, 0.5, 0.75), compiled=False)]


def _allocated_by_forward(module, x, offload, device):
    """(device bytes, host bytes) one forward keeps for the backward on a GPU.

    Device bytes: what the forward leaves allocated besides its output, from the allocator.
    Host bytes (offloading): the saved storages copied to the host, counted as count_saved_bytes does.
    """
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    offloaded = SavedStorages(module.parameters())

    def to_host(tensor):
        offloaded.add(tensor)
        return tensor.to("cpu")

    hooks = (torch.autograd.graph.saved_tensors_hooks(to_host, lambda t: t.to(device)) if offload
             else contextlib.nullcontext())
    with hooks:
        out = module(x)
    torch.cuda.synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before - out.untyped_storage().nbytes()
    host = offloaded.total_bytes(out, x) if offload else 0
    del out
    return kept, host


def _storage_bytes(tensors):
    """Bytes of the tensors' storages, each counted once (tied weights share one)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _step_peak_bytes(step, reset, module, x, dy):
    """Absolute peak device memory of one training step: the weights, input and output gradient
    it starts with, plus what it allocates (activations, gradients); not optimizer state.

    max_memory_allocated counts all that is allocated, so what is no part of this step is taken
    out: the timer's cache-flush buffer, the weights of builds kept for the other policies.
    """
    reset()
    torch.cuda.synchronize(x.device)
    unrelated = torch.cuda.memory_allocated(x.device) - _storage_bytes([*module.parameters(), x, dy])
    torch.cuda.reset_peak_memory_stats(x.device)
    step()
    torch.cuda.synchronize(x.device)
    return torch.cuda.max_memory_allocated(x.device) - unrelated


def _timed_step(module, x, dy, offload, timer):
    """(median ms, peak GB) of a training step, forward and backward."""
    def step():
        if offload:
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                out = module(x)
        else:
            out = module(x)
        out.backward(dy)

    def reset():
        x.grad = None
        for p in module.parameters():
            p.grad = None

    try:
        times = timer.times_ms(step, reset)
        peak = _step_peak_bytes(step, reset, module, x, dy)
    finally:
        reset()  # no gradients left behind to crowd the next policy, even if this one failed
    return quantiles(times)[1], peak / 2**30


# Hugging Face models, built from a config with random weights (no download): {name: (model_type,
# the config fields that differ from transformers' defaults)}, as each family file of
# remat.convert.hf gives them.
HF_MODELS = hf_memory_models()


class _LastHidden(torch.nn.Module):
    """A Hugging Face model as a tensor-to-tensor module: input ids (or pixels) to the last hidden state.
    input_name: the model's input, or a tuple of inputs each given x (T5's encoder and decoder ids)."""

    def __init__(self, model, input_name):
        super().__init__()
        self.model = model
        self.input_names = (input_name,) if isinstance(input_name, str) else tuple(input_name)

    def forward(self, x):
        return self.model(**dict.fromkeys(self.input_names, x)).last_hidden_state


def model_names():
    """The models run() knows by name; any other model is the path of a config.json."""
    return (*MODELS, *HF_MODELS)


def _config_fields(path):
    """The fields of a user's config.json; a ValueError naming the model if it is none."""
    try:
        with open(path) as handle:
            fields = json.load(handle)
    except (OSError, ValueError) as error:  # unreadable, or not JSON (json's error is a ValueError)
        raise ValueError(f"model {path!r} is not a readable config.json: {error}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"model {path!r} has no \"model_type\": it must be a Hugging Face config.json")
    return fields


def check_model(model):
    """model: one of model_names(), or the path of a Hugging Face config.json; else a ValueError
    that lists the names."""
    if model in model_names():
        return model
    if not os.path.isfile(model):
        raise ValueError(f"model must be one of {', '.join(model_names())}, or the path of a config.json; "
                         f"got {model!r}, which is neither a name nor a file")
    _config_fields(model)
    return model


def _file_label(model):
    """The model's name in the output file names: a name as it is; for a config path, the folder
    that holds it ("models/opt-125m/config.json" -> "opt-125m"), or its own name without ".json"."""
    if model in model_names():
        return model
    path = os.path.abspath(model)
    stem = os.path.splitext(os.path.basename(path))[0]
    label = os.path.basename(os.path.dirname(path)) if stem == "config" else stem
    return re.sub(r"[^\w.-]+", "_", label) or "config"


def _hf_config(name):
    import transformers

    if name in HF_MODELS:
        model_type, fields = HF_MODELS[name]
        return transformers.AutoConfig.for_model(model_type, **fields)
    fields = _config_fields(name)  # a config.json of the user's
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _hf_setup(name, batch, seq, device, dtype):
    """(policies, input, layers, width) for a Hugging Face model built from its config."""
    import transformers

    from .convert import convert

    config = _hf_config(name)
    model = transformers.AutoModel.from_config(config).to(device, dtype).train()
    make_input = hf_memory_input(config.model_type)  # the image models' pixels, from their family
    if make_input is not None:
        input_name, x, seq = make_input(config, batch, seq, device, dtype)
    else:
        x = torch.randint(0, config.vocab_size, (batch, seq), device=device)
        input_name = "input_ids"

    def checkpointed(m):
        m = copy.deepcopy(m)
        # activation_checkpointing_enable in recent transformers, which deprecates the older name;
        # 5.17 (on the GPU machines) has only gradient_checkpointing_enable
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        enable()
        return m

    table = [
        ("eager", lambda: (_LastHidden(model, input_name), False)),
        ("remat", lambda: (_LastHidden(convert(model), input_name), False)),
        ("full checkpoint (HF)", lambda: (_LastHidden(checkpointed(model), input_name), False)),
        ("remat + checkpoint (HF)", lambda: (_LastHidden(checkpointed(convert(model)), input_name), False)),
        ("offload to host", lambda: (_LastHidden(model, input_name), True)),
    ]
    layers = config.num_hidden_layers
    return table, x, layers, config.hidden_size, seq


def _gpt_setup(name, batch, seq, device, dtype):
    config = MODELS[name]
    stack = torch_stack(config, device=device, dtype=dtype)
    x = torch.randn(batch, seq, config.hidden, device=device, dtype=dtype, requires_grad=True)
    table = [(policy, lambda make=make: make(stack)) for policy, make in policies(config.layers)]
    return table, x, config.layers, config.hidden, seq


def run(model="gpt2-small", batch=8, seq=1024, budget_gb=None, out_dir="bench/out/memory", device=None,
        dtype=torch.bfloat16):
    check_model(model)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    setup = _gpt_setup if model in MODELS else _hf_setup
    table, x, layers, hidden, seq = setup(model, batch, seq, device, dtype)
    sbh = seq * batch * hidden
    timer = Timer(device, warmup=2, reps=5) if on_gpu else None
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, f"memory_{_file_label(model)}.csv")
    _print_header(model, layers, hidden, batch, seq, dtype, device)
    results = []
    interrupted = False
    try:
        for name, make in table:
            results.append(_measure_or_error(name, make, x, layers, sbh, device, timer))
            _print_row(results[-1])
            _write_csv(results, csv_path)  # after each policy: a kill loses only the one underway
            _release_memory(device)
    except KeyboardInterrupt:  # Ctrl-C, `timeout -s INT`: stop measuring, report what was measured
        interrupted = True
    _print_budget(results, budget_gb)
    if budget_gb is not None:
        _print_plan(model, batch, seq, budget_gb, dtype, device)
    _write_csv(results, csv_path)
    _plot(results, os.path.join(out_dir, f"memory_{_file_label(model)}.png"), model, on_gpu)
    if interrupted:
        print("(interrupted: partial results)", flush=True)
    return results


def _measure(name, make, x, layers, sbh, device, timer):
    """One policy's row: the bytes it keeps for the backward, and on a GPU its step time and peak."""
    module, offload = make()
    on_gpu = device.type == "cuda"
    if on_gpu:
        device_bytes, host_bytes = _allocated_by_forward(module, x, offload, device)
    elif "(HF)" in name:
        # Hugging Face's gradient checkpointing keeps what it keeps out of reach of saved-tensor
        # hooks, and is not a Checkpointed block that count_saved_bytes knows how to count:
        # without a GPU's allocator to read, not counted.
        device_bytes = host_bytes = math.nan
    else:
        device_bytes, host_bytes = count_saved_bytes(module, x, offload)
    result = PolicyResult(name, device_bytes, host_bytes, (host_bytes if offload else device_bytes) / layers / sbh)
    if on_gpu:
        with torch.no_grad():  # only the output's shape is wanted: no graph kept alive while timing
            dy = torch.randn_like(module(x))
        result.step_ms, result.peak_gb = _timed_step(module, x, dy, offload, timer)
    return result


def _measure_or_error(name, make, *args):
    """The policy's row; if it fails (out of memory, no pinned host memory), a row that says why,
    so that one policy's failure costs only its own row."""
    try:
        return _measure(name, make, *args)
    except Exception as error:  # noqa: BLE001 - any failure of one policy is reported in its row
        return PolicyResult(name, math.nan, math.nan, math.nan, error=short_error(error))


def _release_memory(device):
    """Frees what the last policy left (its build, its graph, a failed step's tensors), so that
    none of it counts in the next policy's peak or pushes it out of memory."""
    if device.type == "cuda":
        gc.collect()  # reference cycles (an exception's traceback and its frames) hold tensors too
        torch.cuda.empty_cache()


def cheapest_fitting(results, budget_gb):
    """The fastest policy whose device memory fits the budget (peak on a GPU, else saved bytes)."""
    def need(r):
        return r.peak_gb if not math.isnan(r.peak_gb) else r.saved_bytes / 2**30

    fitting = [r for r in results if not r.error and need(r) <= budget_gb]
    if not fitting:
        return None
    # Without timings, prefer the policy that recomputes least: eager < remat < checkpointing.
    order = {r.policy: i for i, r in enumerate(results)}
    return min(fitting, key=lambda r: (r.step_ms if not math.isnan(r.step_ms) else order[r.policy]))


# Printed with flush=True: under `timeout` stdout is often a pipe, and a killed process loses its buffer.
def _print_header(model, layers, hidden, batch, seq, dtype, device):
    print(f"{model}: {layers} layers, hidden {hidden}, batch {batch}, seq {seq}, "
          f"{str(dtype).replace('torch.', '')} on {device}")
    if device.type != "cuda":
        print("saved bytes are exact; step time and peak memory need a GPU")
    print("saved: what the forward keeps for the backward; sbh/layer: per layer, in bytes per s·b·h")
    print("peak: absolute peak of one training step: weights, input, gradients, activations; not optimizer state")
    print(f"{'policy':28s} {'saved GB':>9s} {'host GB':>8s} {'sbh/layer':>9s} {'step ms':>8s} {'peak GB':>8s}",
          flush=True)


def _print_row(r):
    print(f"{r.policy:28s} {r.saved_bytes / 2**30:9.3f} {r.host_bytes / 2**30:8.3f} {r.per_layer_sbh:9.2f} "
          f"{r.step_ms:8.1f} {r.peak_gb:8.2f}" + (f"  error: {r.error}" if r.error else ""), flush=True)


def meta_model(name, batch, seq, dtype):
    """(model on the meta device, its example inputs) for a `remat memory` model name or config.json."""
    check_model(name)
    if name in MODELS:
        config = MODELS[name]
        stack = torch_stack(config, device="meta", dtype=dtype)
        return stack, (torch.empty(batch, seq, config.hidden, device="meta", dtype=dtype, requires_grad=True),)
    import transformers

    config = _hf_config(name)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config).to(dtype).train()
    make_input = hf_memory_input(config.model_type)
    if make_input is not None:
        input_name, x, _ = make_input(config, batch, seq, "meta", dtype)
    else:
        input_name, x = "input_ids", torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {input_name: x}


def _print_plan(model, batch, seq, budget_gb, dtype, device):
    """remat plan's per-layer mix for the budget, taken as bytes kept for the backward (counted on meta)."""
    from .planner import plan
    from .planner.cost import device_constants

    label = f"remat plan, {budget_gb} GB kept for the backward"
    try:
        network, example = meta_model(model, batch, seq, dtype)
        result = plan(network, example, int(budget_gb * 2**30), device=device_constants(device).name)
    except ValueError as error:  # too small a budget, a GPU without constants: said, not raised
        print(f"{label}: {error}", flush=True)
        return
    mix = ", ".join(f"{count} {choice}" for choice, count in collections.Counter(result.choices).items())
    print(f"{label}: {mix} ({result.saved_bytes / 2**30:.3f} GB, {result.extra_seconds * 1e3:.2f} ms "
          f"more per step predicted for {result.device})", flush=True)


def _print_budget(results, budget_gb):
    if budget_gb is not None:
        best = cheapest_fitting(results, budget_gb)
        print(f"budget {budget_gb} GB: " + (f"use '{best.policy}'" if best else "no policy fits"), flush=True)


def _write_csv(results, path):
    """Written to a temporary file, then renamed over the CSV: a kill mid-write leaves the last one whole."""
    partial = path + ".partial"
    with open(partial, "w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")  # quotes an error message's commas
        writer.writerow(["policy", "saved_bytes", "host_bytes", "sbh_per_layer", "step_ms", "peak_gb", "error"])
        for r in results:
            writer.writerow([r.policy, r.saved_bytes, r.host_bytes, f"{r.per_layer_sbh:.3f}", f"{r.step_ms:.3f}",
                             f"{r.peak_gb:.3f}", r.error])
    os.replace(partial, path)


def _plot(results, path, model, on_gpu):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    for i, r in enumerate(results):
        if r.error:  # nothing measured to draw
            continue
        x = r.step_ms if on_gpu else i
        axes.scatter(x, r.saved_bytes / 2**30, label=r.policy)
    axes.set_xlabel("step time, ms" if on_gpu else "policy (no GPU: no step time)")
    axes.set_ylabel("activation memory kept on the device, GB")
    axes.set_title(f"{model}: memory against step time", fontsize=9)
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
