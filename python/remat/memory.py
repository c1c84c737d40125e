"""`remat memory`: what a model keeps for the backward under each memory policy, and what that costs.

Counted on meta tensors by default: the model is built on the meta device at its real size (from a
name, a config.json, or a Hugging Face model id or folder, of which only the config is read) and
remat.planner counts, for each policy applied to every layer, the bytes one training forward keeps
for the backward, each storage once, SDPA counted as a GPU runs it.
Exact, on any machine, and without memory. `device="cpu"` counts on real CPU tensors instead (what
CPU kernels keep; memory and time at the model's size).

Policies (rows): eager (stock PyTorch); remat (remat.convert's fused layers); for a causal LM,
remat + the fused loss (its LM head and loss as remat.linear_cross_entropy too: what remat.convert
does to a ...ForCausalLM); selective checkpointing (matmul and attention outputs kept, the rest
recomputed); full checkpointing of every layer; offloading every layer's saved tensors to host
memory (meta only: a GPU's choice); and remat.plan's per-layer mix for 75 %, 50 % and 25 % of what
eager keeps (meta only; for a causal LM its LM head and loss are a choice of the plan too). With
`budget_gb`, the fastest that fits and remat plan's mix for it.

Each row's step time is predicted for a GPU (`gpu`, default H200) by the planner's cost model
(remat.planner.cost): the layers' forward at the GPU's data-sheet FLOP rate and bandwidth, the
backward taken as twice the forward (the cost model's own assumption), plus what the policy
recomputes or copies. A prediction, not a measurement. On a GPU (`device="cuda"`) each row is also
run: one training step timed, and its peak memory measured (weights, inputs, gradients,
activations; no optimizer state). A row that fails there keeps its counts and says why; an
interrupt (Ctrl-C, `timeout -s INT`) stops the timing but still reports everything counted.

The models are counted without their LM head (transformers' AutoModel, or a remat.gpt stack of
blocks). For a causal LM the head and transformers' loss are counted on their own, on meta (x, the
final hidden states, kept by the head; the fp32 log-softmax of the logits), and added to every row;
"remat + fused loss" adds remat.linear_cross_entropy's instead (x and an fp32 log-sum-exp a token).
The plan rows plan the causal LM itself (its *ForCausalLM, with labels): remat.plan chooses its head
and loss, stock or fused ("+ fused loss" in the row's name), and counts them in the row's total.
"""

import collections
import copy
import csv
import dataclasses
import functools
import gc
import math
import os
import re
import sys
import textwrap

import torch

from ._config_json import config_fields as _config_fields
from .bench.cases import short_error
from .bench.timing import Timer, quantiles
from .convert.hf import example_inputs
from .gpt import GPTConfig, torch_stack

MODELS = {
    "gpt2-small": GPTConfig(hidden=768, heads=12, layers=12),
    "gpt2-medium": GPTConfig(hidden=1024, heads=16, layers=24),
    "gpt2-large": GPTConfig(hidden=1280, heads=20, layers=36),
    "tiny": GPTConfig(hidden=64, heads=2, layers=4),
}
# Hugging Face models at their real sizes, built from a config with random weights (no download):
# {name: (model_type, the config fields that differ from transformers' defaults)}.
HF_MODELS = {
    "hf-gpt2-small": ("gpt2", {}),
    "hf-gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16)),
    "bert-base": ("bert", {}),
    "vit-base": ("vit", {"image_size": 384}),
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                               rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # a mixture of experts: 128 experts of FFN 768, 8 a token, in every layer; q/k norms per head
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                                        rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False)),
}
# `remat memory` without --model, and the main job
DEFAULT_MODELS = ("llama-3-8b", "qwen3-8b", "qwen3-30b-a3b", "hf-gpt2-small")
# (batch, seq) by default; (8, 1024) for the others
SHAPES = {"llama-3-8b": (1, 8192), "qwen3-8b": (1, 8192), "qwen3-30b-a3b": (1, 4096)}
DEFAULT_SHAPE = (8, 1024)
PLAN_FRACTIONS = (0.75, 0.5, 0.25)  # of what eager keeps: the budgets of the "plan" rows
DEFAULT_GPU = "H200"
POLICY_WIDTH = 44  # the table's policy column, at the least


@dataclasses.dataclass
class PolicyResult:
    policy: str
    saved_bytes: float  # kept on the device for the backward: the layers, the rest, the loss head (nan: failed)
    host_bytes: float  # kept in host memory (offloading)
    per_layer_bytes: float  # the layers' bytes on the device, over the number of layers
    predicted_ms: float = math.nan  # the step's time on the GPU named, by the cost model
    step_ms: float = math.nan  # measured on a GPU
    peak_gb: float = math.nan  # absolute peak of one training step (weights, input, gradients, activations)
    error: str = ""  # why the policy could not be counted or run
    choices: list = None  # one planner choice per layer (None: not a plan of the layers, the fused loss row)
    head: str = None  # a plan row's choice for a causal LM's LM head and loss ("stock", "fused"); None elsewhere
    sbh: int = 1  # tokens x hidden, for per_layer_sbh

    @property
    def per_layer_sbh(self):
        """The layers' bytes per layer, in bytes per s·b·h."""
        return self.per_layer_bytes / self.sbh


@dataclasses.dataclass
class Counted:
    """A model's description and what it was counted on."""

    name: str
    model_class: str
    layers: int
    hidden: int
    batch: int
    seq: int
    dtype: torch.dtype
    device: str  # what the bytes were counted on: "meta" or "cpu"
    gpu: str  # whose constants predict the times
    head: tuple = None  # (stock bytes, fused bytes) of a causal LM's head and loss, or None
    vocab: int = 0  # its vocabulary


# A Hugging Face Hub model id: owner/name (the Hub's ids all have an owner now; one without is taken
# for a mistyped name of model_names()).
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def model_names():
    """The models run() knows by name; any other model is a config.json, or a Hub id or folder."""
    return (*MODELS, *HF_MODELS)


def check_model(model):
    """model: one of model_names(), the path of a Hugging Face config.json, a folder holding one, or a
    Hugging Face model id (owner/name, whose config is fetched when the model is built); else a
    ValueError that lists the names."""
    if model in model_names() or os.path.isdir(model) or is_hub_id(model):
        return model
    if not os.path.isfile(model):
        raise ValueError(f"model must be one of {', '.join(model_names())}, the path of a config.json or of a "
                         f"folder holding one, or a Hugging Face model id (owner/name); got {model!r}, which is "
                         "none of these")
    _config_fields(model)
    return model


def is_hub_id(model):
    """Whether `model` reads as a Hub model id (owner/name) and names no file here."""
    return bool(HUB_ID.fullmatch(model)) and not model.endswith(".json") and not os.path.exists(model)


def default_shape(model):
    """(batch, seq) a model is counted at unless told: a long context for the 8B models, else 8 x 1024."""
    return SHAPES.get(model, DEFAULT_SHAPE)


def max_positions(model):
    """The longest sequence `model` takes (its config's max_position_embeddings), or None: no such
    limit (the remat.gpt stacks, image models, relative positions)."""
    if model in MODELS:
        return None
    longest = getattr(_hf_config(model), "max_position_embeddings", None)
    return longest if isinstance(longest, int) and longest > 0 else None


def shape(model, batch=None, seq=None):
    """(batch, seq, note): the shape `model` is counted at, batch and seq where given, else its
    default_shape, the default seq cut to the model's max_positions (note says so; else None). A seq
    asked for beyond them is a ValueError: the position embeddings have no row for it."""
    default_batch, default_seq = default_shape(model)
    longest = max_positions(model)
    note = None
    if seq is None:
        seq = default_seq
        if longest is not None and seq > longest:
            note = (f"{model}: seq {longest}, the most its config's max_position_embeddings allows (the default "
                    f"is {seq})")
            seq = longest
    elif longest is not None and seq > longest:
        raise ValueError(f"seq {seq} is more than the {longest} positions of {model} (its config's "
                         "max_position_embeddings)")
    return batch or default_batch, seq, note


def file_label(model):
    """The model's name in the output file names: a name as it is; for a config path, the folder
    that holds it ("models/opt-125m/config.json" -> "opt-125m"), or its own name without ".json"."""
    if model in model_names():
        return model
    path = os.path.abspath(model)
    if os.path.isfile(path):
        stem = os.path.splitext(os.path.basename(path))[0]
        label = os.path.basename(os.path.dirname(path)) if stem == "config" else stem
    else:  # a folder, or a Hub id: its last part
        label = os.path.basename(os.path.normpath(model))
    return re.sub(r"[^\w.-]+", "_", label) or "config"


def _hf_config(name):
    import transformers

    if name in HF_MODELS:
        model_type, fields = HF_MODELS[name]
        return transformers.AutoConfig.for_model(model_type, **fields)
    if os.path.isfile(name):
        fields = _config_fields(name)  # a config.json of the user's
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return copy.deepcopy(_pretrained_config(name))  # a copy: a model built from it may change its config


@functools.cache
def _pretrained_config(name):
    """The config of a Hub model id or a folder holding a config.json: the config alone is read."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(name)
    except Exception as error:  # noqa: BLE001 - offline, no such model, gated, not a transformers config
        raise ValueError(f"model {name!r}: its config could not be read as a Hugging Face model id or folder "
                         f"({short_error(error)}); pass one of {', '.join(model_names())} or the path of a "
                         "config.json") from None


def _hf_input(model, batch, seq, device, dtype):
    """The model's keyword inputs, made from its config: token ids (an encoder-decoder's for both
    stacks), or images or audio of the size its config says."""
    inputs, reason = example_inputs(model, batch, seq, device, dtype)
    if reason:
        raise ValueError(f"model: {type(model).__name__}: {reason}")
    return inputs


def model_on(name, batch, seq, dtype, device):
    """(model, its example inputs) for a name or config.json: on meta (no memory) or with random
    weights and inputs on a real device."""
    check_model(name)
    if name in MODELS:
        config = MODELS[name]
        stack = torch_stack(config, device=device, dtype=dtype)
        x = torch.randn(batch, seq, config.hidden, device=device, dtype=dtype, requires_grad=True)
        return stack, (x,)
    import transformers

    config = _hf_config(name)
    with torch.device(device):
        model = transformers.AutoModel.from_config(config).to(dtype).train()
    return model, _hf_input(model, batch, seq, device, dtype)


def meta_model(name, batch, seq, dtype):
    """(model on the meta device, its example inputs) for a `remat memory` model name or config.json."""
    return model_on(name, batch, seq, dtype, "meta")


def plan_model(name, batch, seq, dtype):
    """(model on meta, its example inputs) that the plan rows plan: for a causal LM its *ForCausalLM
    with labels (remat.plan then chooses its LM head and loss too), else meta_model's."""
    if _causal_lm_head(name) is None:
        return meta_model(name, batch, seq, dtype)
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(name)).to(dtype).train()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


# --- The LM head and its loss -------------------------------------------------------------------


def _causal_lm_head(name):
    """(hidden, vocab) of a decoder-only causal LM's head, else None (the remat.gpt stacks, encoders,
    encoder-decoders and image models have no causal loss to count)."""
    if name in MODELS:
        return None
    from transformers.models.auto import modeling_auto

    config = _hf_config(name)
    causal = (config.model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
              and config.model_type not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES  # BERT-like encoders
              and not getattr(config, "is_encoder_decoder", False))
    hidden, vocab = getattr(config, "hidden_size", None), getattr(config, "vocab_size", None)
    return (hidden, vocab) if causal and hidden and vocab else None


class _LossHead(torch.nn.Module):
    """A causal LM's head and loss over final hidden states x, which it makes itself (the body's
    output, not counted in the body: the head's matmul keeps it, so it counts here)."""

    def __init__(self, hidden, vocab, fused):
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.fused = fused

    def forward(self, labels):
        weight = self.lm_head.weight
        x = torch.empty(*labels.shape, weight.shape[1], dtype=weight.dtype, device=weight.device, requires_grad=True)
        if not self.fused:  # as a transformers causal LM computes its loss
            from transformers.loss.loss_utils import ForCausalLMLoss

            return ForCausalLMLoss(self.lm_head(x), labels, weight.shape[0])
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]  # ForCausalLMLoss's shift
        from .ops.linear_cross_entropy import linear_cross_entropy

        return linear_cross_entropy(x, weight, shifted)


def loss_head_bytes(hidden, vocab, batch, seq, dtype):
    """(stock, fused) bytes a causal LM's head and loss keep for the backward, counted on meta:
    stock, transformers' loss (x, the fp32 log-softmax of the logits, the shifted labels);
    fused, remat.linear_cross_entropy (x, an fp32 log-sum-exp and the label a token)."""
    from .planner.counting import count_forward

    labels = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    counts = []
    for fused in (False, True):
        with torch.device("meta"):
            head = _LossHead(hidden, vocab, fused).to(dtype)
        counts.append(count_forward(head, (labels,), {}).total_bytes())
    return tuple(counts)


# --- Counting -----------------------------------------------------------------------------------


def _forward_seconds(saves, constants):
    """The layers' stock forward on the device, by the cost model (what full checkpointing reruns)."""
    from .planner.cost import extra_seconds

    return sum(extra_seconds("full", unit, unit, constants) for unit in saves.units)


def _uniform_row(name, choice, saves, stock, constants, base_seconds, head, sbh):
    """The row of one choice applied to every layer."""
    from .planner.cost import extra_seconds

    outside = saves.outside.internal_bytes + sum(saves.key_bytes[k] for k in saves.outside.shared_keys)
    total = saves.total_bytes()
    extra = sum(extra_seconds(choice, s, c, constants) for s, c in zip(stock.units, saves.units))
    return PolicyResult(name, total + head, sum(u.offloaded_bytes for u in saves.units),
                        (total - outside) / len(saves.units), (base_seconds + extra) * 1e3,
                        choices=[choice] * len(saves.units), sbh=sbh)


def _plan_row(label, model, example, budget, counted, base_seconds, sbh):
    """remat.plan's mix for `budget` bytes kept: the layers, the rest and, for a causal LM (planned
    with labels), its LM head and loss, stock or fused as the plan chooses."""
    from .planner import CHOICES, plan

    try:
        chosen = plan(model, example, int(budget), device=counted.gpu)
    except ValueError as error:  # below the least the model can keep: the row says so
        return PolicyResult(label, math.nan, math.nan, math.nan, error=short_error(error), sbh=sbh)
    tally = collections.Counter(chosen.choices)
    mix = ", ".join(f"{tally[c]} {c}" for c in CHOICES if tally[c])
    if chosen.head == "fused":
        mix += " + fused loss"
    return PolicyResult(f"{label}: {mix}", chosen.saved_bytes, chosen.host_bytes,
                        sum(chosen.unit_bytes) / counted.layers, (base_seconds + chosen.extra_seconds) * 1e3,
                        choices=list(chosen.choices), head=chosen.head, sbh=sbh)


UNIFORM = {"stock": "eager", "remat": "remat", "remat-keep": "remat, experts keep pre-activation",
           "selective": "selective checkpoint", "full": "full checkpoint",
           "offload": "offload to host"}


def count(name, batch, seq, dtype=torch.bfloat16, device="meta", gpu=DEFAULT_GPU):
    """(Counted, [PolicyResult]) for model `name` at batch x seq: every policy's bytes, counted on
    `device` ("meta", or "cpu" for real CPU tensors), and its step time predicted for `gpu`. The plan
    rows (meta only) are planned for fractions of what eager keeps, its stock LM head and loss included
    (plan_model: a causal LM is planned with them)."""
    from .planner import CHOICES, ON_ANY_DEVICE, measure
    from .planner.cost import device_constants

    model, example = model_on(name, batch, seq, dtype, device)
    constants = device_constants(gpu)
    on_meta = device == "meta"
    saves, paths, _ = measure(model, example, CHOICES if on_meta else ON_ANY_DEVICE)
    hidden = MODELS[name].hidden if name in MODELS else _hf_config(name).hidden_size
    head_shape = _causal_lm_head(name)
    counted = Counted(name, type(model).__name__, len(paths), hidden, batch, seq, dtype, device, constants.name,
                      loss_head_bytes(*head_shape, batch, seq, dtype) if head_shape else None,
                      head_shape[1] if head_shape else 0)
    head = counted.head[0] if counted.head else 0
    sbh = batch * seq * hidden
    base = 3 * _forward_seconds(saves["stock"], constants)  # forward + backward, the backward twice the forward
    rows = [_uniform_row(UNIFORM[c], c, saves[c], saves["stock"], constants, base, head, sbh) for c in saves]
    if counted.head:
        rows.insert(2, _fused_loss_row(rows[1], counted, constants))
    if on_meta:
        eager = rows[0].saved_bytes
        planned, planned_example = plan_model(name, batch, seq, dtype)
        rows += [_plan_row(f"plan {fraction:.0%}", planned, planned_example, fraction * eager, counted, base, sbh)
                 for fraction in PLAN_FRACTIONS]
    return counted, rows


def _fused_loss_row(remat_row, counted, constants):
    """remat's row with the fused loss's bytes in place of the stock head's; its time adds the
    logits the fused backward recomputes (2·T·h·V FLOPs; the stock loss's own traffic it saves is
    not counted)."""
    from .planner.cost import fused_loss_seconds

    stock, fused = counted.head
    recompute = fused_loss_seconds(counted.batch * counted.seq, counted.hidden, counted.vocab, constants)
    return dataclasses.replace(remat_row, policy="remat + fused loss", choices=None,
                               saved_bytes=remat_row.saved_bytes - stock + fused,
                               predicted_ms=remat_row.predicted_ms + recompute * 1e3)


# --- Timing on a GPU ----------------------------------------------------------------------------


def _sharing_copy(model):
    """A copy of the model's modules that shares its parameters and buffers (as remat.plan measures
    on), for one policy's changes: the model itself is left stock."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _output_tensor(out):
    """The tensor a training step backpropagates from: the output, or a model output's first
    (last_hidden_state)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def _storage_bytes(tensors):
    """Bytes of the tensors' storages, each counted once (tied weights share one)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _timed_step(module, example, timer):
    """(median ms, peak GB) of a training step, forward and backward of the output, on a GPU. The
    peak is absolute: the weights, inputs and output gradient it starts with, plus what it allocates;
    what is no part of this step (the timer's cache-flush buffer) is taken out."""
    args, kwargs = (example, {}) if isinstance(example, tuple) else ((), example)
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    with torch.no_grad():  # only the output's shape is wanted: no graph kept alive while timing
        dy = torch.randn_like(_output_tensor(module(*args, **kwargs)))

    def step():
        _output_tensor(module(*args, **kwargs)).backward(dy)

    def reset():
        for t in (*inputs, *module.parameters()):
            t.grad = None

    try:
        times = timer.times_ms(step, reset)
        reset()
        device = dy.device
        torch.cuda.synchronize(device)
        unrelated = torch.cuda.memory_allocated(device) - _storage_bytes([*module.parameters(), *inputs, dy])
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - unrelated
    finally:
        reset()  # no gradients left behind to crowd the next policy, even if this one failed
    return quantiles(times)[1], peak / 2**30


def time_row(row, model, paths, example, timer):
    """Run one row's policy on the real model on the GPU: its step time and peak, in the row."""
    from .planner.units import apply_choices

    shell = _sharing_copy(model).train()
    apply_choices(shell, paths, row.choices)
    row.step_ms, row.peak_gb = _timed_step(shell, example, timer)


def _time_rows(counted, rows, device="cuda"):
    """Time every row that is a plan of the layers, on a model with random weights on `device` (a
    GPU); a row that fails says why, Ctrl-C stops the timing. Returns True when interrupted."""
    from .planner.units import find_units

    model, example = model_on(counted.name, counted.batch, counted.seq, counted.dtype, device)
    paths, timer = find_units(model), Timer(device, warmup=2, reps=5)
    try:
        for row in rows:
            if row.choices is None or row.error:
                continue
            try:
                time_row(row, model, paths, example, timer)
            except Exception as error:  # noqa: BLE001 - out of memory, no pinned memory: this row only
                row.error = short_error(error)
            finally:
                gc.collect()  # reference cycles (an exception's traceback and its frames) hold tensors too
                torch.cuda.empty_cache()
            print(f"  timed {row.policy}: " + (f"error: {row.error}" if row.error else
                                               f"{row.step_ms:.1f} ms, peak {row.peak_gb:.2f} GB"), flush=True)
    except KeyboardInterrupt:  # Ctrl-C, `timeout -s INT`: stop timing, report what there is
        return True
    return False


# --- The run ------------------------------------------------------------------------------------


def run(model=None, batch=None, seq=None, budget_gb=None, out_dir="bench/out/memory", device=None,
        dtype=torch.bfloat16, gpu=None):
    """Count (and on a GPU, time) every policy of `model` (a name or config.json; None: the
    DEFAULT_MODELS); print the table, write memory_<model>.csv and .png to out_dir. Returns the
    model's [PolicyResult], or {name: [PolicyResult]} for several models.

    device: what the bytes are counted on and whether steps are timed: None, meta on any machine
    and timing when a GPU is visible; "meta"; "cpu" (real CPU tensors, nothing timed); "cuda" (meta
    counts, steps timed on the GPU). gpu: whose constants predict the step times (default the GPU
    here when the table knows it, else H200)."""
    models = DEFAULT_MODELS if model is None else (model,) if isinstance(model, str) else tuple(model)
    for name in models:
        check_model(name)
    shapes = {name: shape(name, batch, seq) for name in models}  # every model's config read before any run
    on_gpu = device == "cuda" or (device is None and torch.cuda.is_available())
    counting = "cpu" if device == "cpu" else "meta"
    gpu = gpu or _gpu_here()
    os.makedirs(out_dir, exist_ok=True)
    found = {}
    for name in models:
        model_batch, model_seq, note = shapes[name]
        if note:
            print(f"remat memory: {note}", file=sys.stderr, flush=True)
        found[name], interrupted = _run_one(name, model_batch, model_seq, budget_gb, out_dir, counting, on_gpu,
                                            dtype, gpu)
        if interrupted:  # Ctrl-C: the models after this one are not run
            break
    return found[models[0]] if len(models) == 1 else found


def _gpu_here():
    """The table's name of the GPU here (its constants predict the times), else DEFAULT_GPU."""
    from .planner.devices import DEVICES

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((d for d in DEVICES if d != "cpu" and d in name), DEFAULT_GPU)


def _run_one(name, batch, seq, budget_gb, out_dir, counting, on_gpu, dtype, gpu):
    """(the model's rows, whether its timing was interrupted): counted, timed on a GPU, printed, written."""
    counted, rows = count(name, batch, seq, dtype, counting, gpu)
    path = os.path.join(out_dir, f"memory_{file_label(name)}")
    _write_csv(rows, path + ".csv")  # the counts, before any timing: a run killed while timing keeps them
    interrupted = False
    if on_gpu:
        print(f"{name}: counted; timing each policy on this GPU", flush=True)
        interrupted = _time_rows(counted, rows)
        _write_csv(rows, path + ".csv")
    _print_table(counted, rows, on_gpu)
    if budget_gb is not None:
        _print_budget(rows, budget_gb)
        _print_plan(name, batch, seq, budget_gb, dtype, gpu)
    _plot(rows, path + ".png", counted, on_gpu)
    print(f"wrote {path}.csv and .png" + (" (interrupted: partial results)" if interrupted else ""), flush=True)
    return rows, interrupted


def cheapest_fitting(results, budget_gb):
    """The fastest policy whose device memory fits the budget. Where steps were measured (a GPU), among
    those: by measured peak and step time; else by the bytes kept and the predicted time."""
    usable = [r for r in results if not r.error and not math.isnan(r.saved_bytes)]
    measured = [r for r in usable if not math.isnan(r.step_ms)]
    if measured:
        fitting = [r for r in measured if r.peak_gb <= budget_gb]
        return min(fitting, key=lambda r: r.step_ms) if fitting else None
    fitting = [r for r in usable if r.saved_bytes / 2**30 <= budget_gb]
    return min(fitting, key=lambda r: r.predicted_ms) if fitting else None


# --- Output -------------------------------------------------------------------------------------
# Printed with flush=True: under `timeout` stdout is often a pipe, and a killed process loses its buffer.


def _print_table(counted, rows, on_gpu):
    tokens = counted.batch * counted.seq
    print(f"\n{counted.name}: {counted.model_class}, {counted.layers} layers, hidden {counted.hidden}, "
          f"batch {counted.batch} x seq {counted.seq} ({tokens} tokens), {str(counted.dtype).replace('torch.', '')}")
    how = ("counted on meta tensors: exact, at full size, no memory used (attention as a GPU runs SDPA)"
           if counted.device == "meta" else "counted on CPU tensors: exact for what CPU kernels keep")
    _print_note(f"{how}; step times predicted for {counted.gpu} by remat.planner's cost model"
                + (", and measured on this GPU" if on_gpu else ", not measured"))
    width = max(POLICY_WIDTH, *(len(r.policy) for r in rows))  # a long plan row widens the column
    print(f"{'policy':{width}s} {'per layer':>10s} {'total':>10s} {'host':>10s} {'pred. ms':>9s} {'vs eager':>8s}"
          + (f" {'step ms':>8s} {'peak GB':>8s}" if on_gpu else ""))
    eager_ms = rows[0].predicted_ms
    for r in rows:
        print(_row_text(r, eager_ms, on_gpu, width))
    _print_notes(counted)


def _print_note(text):
    print(textwrap.fill(text, width=100, initial_indent="  ", subsequent_indent="  "), flush=True)


def _row_text(r, eager_ms, on_gpu, width=None):
    width = width or POLICY_WIDTH
    if math.isnan(r.saved_bytes):
        return f"{r.policy:{width}s} {r.error}"
    host = size_text(r.host_bytes) if r.host_bytes else f"{'-':>10s}"
    line = (f"{r.policy:{width}s} {size_text(r.per_layer_bytes)} {size_text(r.saved_bytes)} {host} "
            f"{r.predicted_ms:9.4g} {r.predicted_ms / eager_ms - 1:+8.0%}")
    if on_gpu:
        line += f" {r.step_ms:8.1f} {r.peak_gb:8.2f}"
    return line + (f"  error: {r.error}" if r.error else "")


def size_text(count):
    """Bytes in binary units, 10 characters wide: "  1.43 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:6.2f} {unit}"
    return f"{count:6.0f} B  "


def _print_notes(counted):
    head = ""
    if counted.head:
        stock, fused = counted.head
        head = (f", and the LM head with transformers' loss ({size_text(stock).strip()}: its input and the fp32 "
                f"log-softmax of the logits); \"remat + fused loss\" has remat.linear_cross_entropy's instead "
                f"({size_text(fused).strip()}), as remat.convert does to a causal LM")
    _print_note(f"per layer: the layers' bytes over the {counted.layers} layers; total: the layers, what the model "
                f"keeps outside them{head}; host: offloaded to host memory")
    _print_note("pred. ms: the layers' forward and backward (twice the forward) at the GPU's data-sheet FLOP/s and "
                "bandwidth, plus what the policy recomputes or copies; plan N%: remat.plan's fastest per-layer mix "
                "keeping N% of eager's bytes, for a causal LM with its LM head and loss stock or fused (\"+ fused "
                "loss\") as the plan chooses")


def _print_plan(model, batch, seq, budget_gb, dtype, device):
    """remat plan's per-layer mix for the budget, taken as bytes the model keeps for the backward
    (plan_model's: a causal LM with its LM head and loss, their choice the plan's), counted on meta;
    device: whose constants time it (a name or a device)."""
    from .planner import plan
    from .planner.cost import device_constants

    label = f"remat plan, {budget_gb} GB kept for the backward"
    try:
        network, example = plan_model(model, batch, seq, dtype)
        result = plan(network, example, int(budget_gb * 2**30), device=device_constants(device).name)
    except ValueError as error:  # too small a budget, a GPU without constants: said, not raised
        print(f"{label}: {error}", flush=True)
        return
    mix = ", ".join(f"{count} {choice}" for choice, count in collections.Counter(result.choices).items())
    if result.head is not None:
        mix += f", LM head and loss {result.head}"
    print(f"{label}: {mix} ({result.saved_bytes / 2**30:.3f} GB, {result.extra_seconds * 1e3:.2f} ms "
          f"more per step predicted for {result.device})", flush=True)


def _print_budget(results, budget_gb):
    best = cheapest_fitting(results, budget_gb)
    print(f"budget {budget_gb} GB: " + (f"use '{best.policy}'" if best else "no policy fits"), flush=True)


def _write_csv(results, path):
    """Written to a temporary file, then renamed over the CSV: a kill mid-write leaves the last one whole."""
    partial = path + ".partial"
    with open(partial, "w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")  # quotes an error message's commas
        writer.writerow(["policy", "choices", "saved_bytes", "host_bytes", "per_layer_bytes", "sbh_per_layer",
                         "predicted_ms", "step_ms", "peak_gb", "error"])
        for r in results:
            writer.writerow([r.policy, " ".join(r.choices or ()), r.saved_bytes, r.host_bytes, r.per_layer_bytes,
                             f"{r.per_layer_sbh:.4f}", f"{r.predicted_ms:.6g}", f"{r.step_ms:.6g}",
                             f"{r.peak_gb:.4f}", r.error])
    os.replace(partial, path)


def _plot(results, path, counted, on_gpu):
    """Memory kept against predicted step time (and measured, on a GPU), one point per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if math.isnan(r.saved_bytes):  # nothing counted to draw
            continue
        points = axes.scatter(r.predicted_ms, r.saved_bytes / 2**30, label=r.policy)
        if on_gpu and not math.isnan(r.step_ms):
            axes.scatter(r.step_ms, r.saved_bytes / 2**30, marker="x", color=points.get_facecolor()[0])
    axes.set_xlabel(f"step time predicted for {counted.gpu}, ms (cost model)"
                    + ("; x: measured here" if on_gpu else ""))
    axes.set_ylabel("activation memory kept for the backward, GiB")
    axes.set_title(f"{counted.name}: batch {counted.batch} x seq {counted.seq}, counted on {counted.device}",
                   fontsize=9)
    axes.legend(fontsize=6)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
