"""`remat bench overhead`: the host (CPU, Python) time remat.convert adds to a Hugging Face decoder layer.

What is timed: one decoder layer of a tiny one-layer model, `model.model.layers[0]` (Llama) or
`model.transformer.h[0]` (GPT-2), forward then backward of a random output gradient, called with
the arguments the model itself passes it in training (captured by a forward pre-hook: the rotary
cos/sin, position ids, no mask). The stock layer and the layer of a converted deep copy
(remat.convert) run on the same input, interleaved call by call (A B, then B A, ...) with the
garbage collector off, so that drift of the machine falls on both alike; each call's wall-clock
time (time.perf_counter) is one sample, and the report gives p20 / p50 / p80 in microseconds,
the difference of the medians (remat - stock) and the median of the per-round differences.

The sizes are tiny (hidden 128, batch 1, sequence 8) so that the arithmetic is negligible and
what is left is the host's work: Python, the dispatcher, autograd. Head dim 32 (hidden 128 over 4
heads), the least remat's attention kernels take: at head dim 16 convert leaves attention stock.
remat's ops run their pure-PyTorch reference (remat.set_backend("reference")): PyTorch ops on the
CPU as stock's are, though more of them (the recomputation in the backward, attention written out
as matmuls and a softmax; the table counts them). On CPU the Triton kernels would run through the
interpreter, whose time is no host overhead a GPU run pays. Before anything is timed, the
converted layer's output and gradients (input and every weight) are checked against a float64
copy of the stock layer, within twice the stock layer's own error, as every benchmark case is:
both timings compute the same result.

A third row per layer times the converted layer with remat's kernels as empty launches: each op call
makes the backend's choice as a real call does, then allocates its outputs (the op's fake) and
computes nothing, switched in the untimed reset before each call. Its difference from stock is remat's
host overhead itself (Python, autograd, allocations), without the reference's arithmetic, which a
GPU's kernels do instead: the row held against the target. Each converted row is timed in a pair of
its own with stock (stock and the empty launches, then stock and the reference; the stock row is the
first pair's): interleaved three ways, stock ran after the reference's arithmetic half the time, which
slowed it (caches filled with other data) where the empty launches, running the same modules the
reference had just run, were not, and the ratio came out 5 to 8 points too low (docs/overhead.md).

Beside the layers: what torch's custom-op machinery costs per call, for a trivial op declared as
remat declares its ops (torch.library.custom_op with a fake and autograd): a call without grad
against calling its Python function directly, and a forward op with autograd whose backward calls
a backward op, forward + backward, against the same arithmetic on native autograd (remat's eager
calls skip it: remat.ops._family). The table counts one forward + backward's ops (a
TorchDispatchMode: remat's custom-op calls, and every aten op, those inside remat's ops
included). Finally cProfile, once, over the
converted layer's forward + backward: the top functions by cumulative and by own time, where the
next engineer looks first.

Performance is reported, never asserted; the target the suite is measured against is the empty
launches' p50 within TARGET_RATIO of stock's, in the same run (a ratio: the same on any machine).
"""

import collections
import contextlib
import copy
import cProfile
import functools
import gc
import math
import os
import pstats
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _backend, _guards
from . import report
from .check import compare, outputs_and_grads
from .timing import quantiles

SIZES_MEAN = "sequence lengths s (batch 1)"  # what `remat bench overhead --shapes` sets
TARGET_RATIO = 1.10  # the empty launches' p50 at most 10 % over stock's, in one run
MODELS = ("llama", "gpt2")
SEQ = (8,)
REPS, QUICK_REPS = 2000, 200  # timed calls of each layer (dispatch calls: DISPATCH_FACTOR times as many)
DISPATCH_FACTOR = 5
PROFILE_CALLS = 200  # forward + backward calls cProfile sees (fewer with fewer reps)
PROFILE_TOP = 15
BACKEND = "reference"
EMPTY_KERNELS = "remat, kernels as empty launches"

COLUMNS = ["subject", "shape", "dtype", "implementation", "check", "p20_us", "p50_us", "p80_us", "minus_first_us",
           "paired_minus_first_us", "remat_op_calls", "aten_op_calls", "error"]


# ---------------------------------------------------------------------------------------------
# The layers
# ---------------------------------------------------------------------------------------------


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise RuntimeError(f"remat bench overhead needs transformers (pip install 'remat[hf]'): {error}") from None
    return transformers


def tiny_model(name, seq):
    """(one-layer model in training mode, its decoder layer, shape text) from a tiny config, seeded."""
    transformers = _transformers()
    torch.manual_seed(0)
    if name == "llama":
        config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=256, num_hidden_layers=1, vocab_size=256)
        model = transformers.LlamaForCausalLM(config)
        layer, shape = model.model.layers[0], f"b=1 s={seq} h=128 heads=4 kv=2 f=256"
    elif name == "gpt2":
        config = transformers.GPT2Config(n_embd=128, n_head=4, n_layer=1, vocab_size=256, n_positions=max(1024, seq),
                                         resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        layer, shape = model.transformer.h[0], f"b=1 s={seq} h=128 heads=4 f=512"
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    _randomize_norms(model)
    return model.train(), layer, shape


def _randomize_norms(model):
    """Norm weights and biases away from 1 and 0, so that the check sees a wrong use of them."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
                module.weight.normal_(1.0, 0.1)
                if getattr(module, "bias", None) is not None:
                    module.bias.normal_(0.0, 0.1)


def layer_call(model, layer, seq):
    """(args after hidden_states, kwargs) the model passes `layer` in a training forward of `seq` tokens."""
    seen = {}

    def hook(module, args, kwargs):
        seen["args"], seen["kwargs"] = args[1:], dict(kwargs)

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(torch.randint(0, model.config.vocab_size, (1, seq)), use_cache=False)
    finally:
        handle.remove()
    return seen["args"], seen["kwargs"]


class LayerPair:
    """A model's stock decoder layer and the same layer of a converted deep copy, on one input.

    step(layer) is what is timed: forward on x with the model's arguments, backward of dy.
    """

    def __init__(self, name, seq, dtype=torch.float32):
        import remat

        self.name = name
        model, self.stock, self.shape = tiny_model(name, seq)
        model.to(dtype)
        self.args, self.kwargs = layer_call(model, self.stock, seq)
        converted = remat.convert(copy.deepcopy(model))
        self.converted = _layer_of(converted, name)
        hidden = model.config.hidden_size
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(1, seq, hidden, generator=generator).to(dtype).requires_grad_()
        self.dy = torch.randn(1, seq, hidden, generator=generator).to(dtype)

    def forward(self, layer):
        return _forward(layer, self.x, self.args, self.kwargs)

    def step(self, layer):
        return lambda: _forward(layer, self.x, self.args, self.kwargs).backward(self.dy)

    def reset(self, layer):
        """Untimed before each call: gradients to None, as an optimizer's zero_grad leaves them."""
        params = list(layer.parameters())

        def clear():
            self.x.grad = None
            for p in params:
                p.grad = None

        return clear

    def outputs(self, layer):
        """{"out", "dx", "d<parameter name>"} of one forward + backward."""
        return outputs_and_grads(lambda: self.forward(layer), {"x": self.x, **dict(layer.named_parameters())},
                                 self.dy)

    def reference(self):
        """outputs() of a float64 copy of the stock layer on float64 copies of the inputs."""
        layer = copy.deepcopy(self.stock).double()
        x = self.x.detach().double().requires_grad_()
        args, kwargs = _float64(self.args), _float64(self.kwargs)
        return outputs_and_grads(lambda: _forward(layer, x, args, kwargs),
                                 {"x": x, **dict(layer.named_parameters())}, self.dy.double())

    def check(self):
        """The converted layer's verdict ("ok (1.00x)" or what is wrong) against the float64 reference, with
        the stock layer's own error as the bound, and the stock layer's names compared."""
        stock_names = [name for name, _ in self.stock.named_parameters()]
        ours_names = [name for name, _ in self.converted.named_parameters()]
        if stock_names != ours_names:
            return False, f"parameter names differ: {stock_names} vs {ours_names}"
        verdict = compare(self.outputs(self.converted), self.reference(), self.outputs(self.stock))
        return verdict.ok, verdict.text


def _layer_of(model, name):
    return model.model.layers[0] if name == "llama" else model.transformer.h[0]


def _forward(layer, x, args, kwargs):
    out = layer(x, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _float64(value):
    """Floating tensors in `value` (a tensor, tuple, list or dict of them) as float64; the rest as is."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_float64(item) for item in value)
    if isinstance(value, dict):
        return {key: _float64(item) for key, item in value.items()}
    return value


# ---------------------------------------------------------------------------------------------
# Timing, counting, profiling
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _gc_off():
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def interleaved_us(calls, reps, warmup=None):
    """{name: [µs of each call]} of `calls` ({name: (step, reset)}), `reps` rounds each, one call of
    each per round, the order reversed every other round; reset runs untimed before each call.
    Untimed before: `warmup` rounds (default min(20, reps))."""
    names = list(calls)
    for _ in range(min(20, reps) if warmup is None else warmup):
        for step, reset in calls.values():
            reset()
            step()
    samples = {name: [] for name in names}
    clock = time.perf_counter_ns
    with _gc_off():
        for index in range(reps):
            for name in names if index % 2 == 0 else reversed(names):
                step, reset = calls[name]
                reset()
                begin = clock()
                step()
                samples[name].append((clock() - begin) / 1e3)
    return samples


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched, by name ("remat::gated_fwd", "aten::mm"), those that remat's ops run
    included: a remat op is counted, then its PyTorch reference runs in the mode (what the "reference"
    backend runs), so that its aten ops are counted too. Another custom op's inside is not seen."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.references = _remat_references()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.counts[name] += 1
        reference = self.references.get(name)
        if reference is not None:
            with self:
                return reference(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _remat_references():
    """{"remat::<family>_fwd" and "_bwd": the family's PyTorch reference}."""
    from ..ops import FAMILIES

    found = {}
    for family in FAMILIES.values():
        forward, backward = family.qualified_op_names
        found[forward], found[backward] = family.forward_ref, family.backward_ref
    return found


def op_counts(step, reset):
    """Counter of the ops one call of `step` dispatches (see OpCounter)."""
    reset()
    with OpCounter() as counter:
        step()
    return counter.counts


def remat_calls(counts):
    """(remat custom-op calls, of which forward ops *_fwd, of which backward ops *_bwd, other ops: aten's,
    those inside remat's ops included)."""
    ours = {name: n for name, n in counts.items() if name.startswith("remat::")}
    forward = sum(n for name, n in ours.items() if name.endswith("_fwd"))
    backward = sum(n for name, n in ours.items() if name.endswith("_bwd"))
    return sum(ours.values()), forward, backward, sum(counts.values()) - sum(ours.values())


def profile_top(step, reset, calls, top=PROFILE_TOP, key="cumulative_us"):
    """The `top` Python functions by `key` ("cumulative_us" or "own_us") over `calls` calls of `step`
    (cProfile), as dicts: calls, own and cumulative µs per call of `step`, and the function's name.
    The harness's own functions (this module's) are left out; top=None: all of them."""
    profiler = cProfile.Profile()
    for _ in range(calls):
        reset()
        profiler.enable()
        step()
        profiler.disable()
    found = []
    here = os.path.abspath(__file__)
    for (path, line, function), (_, ncalls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        if os.path.abspath(path) == here:
            continue
        found.append({"calls": ncalls / calls, "own_us": own / calls * 1e6, "cumulative_us": cumulative / calls * 1e6,
                      "function": _function_name(path, line, function)})
    return top_functions(found, key, top)


def top_functions(rows, key="cumulative_us", top=PROFILE_TOP):
    """The `top` rows of profile_top by `key`, largest first."""
    return sorted(rows, key=lambda row: row[key], reverse=True)[:top]


def _function_name(path, line, function):
    if path == "~":  # a builtin: cProfile names it "<built-in method ...>" or "<method '...' of ... objects>"
        return function
    return f"{_short_path(path)}:{line}({function})"


def _short_path(path):
    """`path` from its top package on (remat/convert/hf/modules.py, transformers/models/...): the folders
    above it that hold an __init__.py are its packages; a file outside any package, by its name."""
    folder, parts = os.path.dirname(os.path.abspath(path)), [os.path.basename(path)]
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        parts.insert(0, os.path.basename(folder))
        folder = os.path.dirname(folder)
    return "/".join(parts)


def profile_text(title, rows):
    header = ["calls", "own µs", "cum µs", "function"]
    lines = [[f"{r['calls']:.0f}" if r["calls"] >= 1 else f"{r['calls']:.2f}", f"{r['own_us']:.1f}",
              f"{r['cumulative_us']:.1f}", r["function"]] for r in rows]
    return "\n".join([title, *report.aligned_lines(header, lines)])


# ---------------------------------------------------------------------------------------------
# torch's custom-op machinery, on a trivial op declared as remat declares its ops
# ---------------------------------------------------------------------------------------------


@functools.cache
def trivial_ops():
    """(plain function, custom forward op, custom backward op): y = 2·x, and its backward 2·dy, declared as
    remat's families declare theirs (torch.library.custom_op with a fake; the forward op's autograd
    calls the backward op). Registered once per process, in the remat_bench namespace."""

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def double_backward(dy: torch.Tensor) -> torch.Tensor:
        return dy * 2

    forward_op = torch.library.custom_op("remat_bench::double_fwd", double, mutates_args=())
    backward_op = torch.library.custom_op("remat_bench::double_bwd", double_backward, mutates_args=())
    forward_op.register_fake(torch.empty_like)
    backward_op.register_fake(torch.empty_like)

    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, dy):
        return backward_op(dy)

    forward_op.register_autograd(backward, setup_context=setup_context)
    return double, forward_op, backward_op


def dispatch_samples(reps, shape=(1, 8, 128)):
    """{subject: {implementation: [µs]}}: a custom-op call without grad against the Python function it
    runs; and forward + backward of the custom forward op (autograd, backward op) against native autograd."""
    double, forward_op, _ = trivial_ops()
    x = torch.randn(shape)
    leaf = torch.randn(shape, requires_grad=True)
    dy = torch.randn(shape)

    def clear():
        leaf.grad = None

    def nothing():
        pass

    plain = interleaved_us({"python function": (lambda: double(x), nothing),
                            "torch.library custom op": (lambda: forward_op(x), nothing)}, reps)
    paired = interleaved_us({"native autograd": (lambda: double(leaf).backward(dy), clear),
                             "custom op + autograd + backward op": (lambda: forward_op(leaf).backward(dy), clear)},
                            reps)
    return {"custom-op call, no grad": plain, "custom-op pair, fwd+bwd": paired}


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------


def _row(subject, shape, dtype, implementation, samples, first=None, check="-", counts=None, error=""):
    p20, p50, p80 = quantiles(samples) if samples else (math.nan,) * 3
    row = {"subject": subject, "shape": shape, "dtype": str(dtype).replace("torch.", ""),
           "implementation": implementation, "check": check, "p20_us": p20, "p50_us": p50, "p80_us": p80,
           "minus_first_us": math.nan, "paired_minus_first_us": math.nan, "remat_op_calls": "",
           "aten_op_calls": "", "error": error}
    if first is not None and samples:
        row["minus_first_us"] = p50 - statistics.median(first)
        row["paired_minus_first_us"] = statistics.median(b - a for a, b in zip(first, samples))
    if counts is not None:
        total, forward, backward, other = remat_calls(counts)
        row["remat_op_calls"] = f"{total} ({forward} fwd, {backward} bwd)" if total else "0"
        row["aten_op_calls"] = other
    return row


@contextlib.contextmanager
def _backend_set(name):
    """remat.set_backend(name) for the process (no use_backend block: its per-op bookkeeping would be
    timed too), the previous backend restored after."""
    previous = _backend.get_backend()
    _backend.set_backend(name)
    try:
        yield
    finally:
        _backend.set_backend(previous)


class _KernelSwitch:
    """remat's op implementations, real (the backend's: here the reference) or empty launches: each op
    call makes the backend's choice as a real call does (OpFamily._implementation: the device, the
    dtypes, _backend.choose), then allocates its outputs (the op's fake) and computes nothing, standing
    in for a GPU kernel launch, whose own host cost the GPU check measures. Switched by the untimed
    reset before each call, so that the switch itself is not timed."""

    def __init__(self):
        from ..ops._family import OpFamily

        self._owner, self._real = OpFamily, OpFamily._implementation
        choose = self._real

        def launch_nothing(family, index, args, device=None):
            choose(family, index, args, device)  # what a real call pays to find its kernel
            return (family.forward_fake, family.backward_fake)[index]

        self._empty = launch_nothing

    def _set(self, implementation):
        self._owner._implementation = implementation

    def real(self, calls):
        step, reset = calls
        return step, lambda: (self._set(self._real), reset())

    def empty(self, calls):
        step, reset = calls
        return step, lambda: (self._set(self._empty), reset())

    def restore(self):
        self._set(self._real)


def measure_layer(name, seq, dtype, reps, profile_calls):
    """(the two rows of the model's layer, the profile rows, summary facts) for `name` at `seq`."""
    pair = LayerPair(name, seq, dtype)
    subject = f"{name} layer fwd+bwd"
    ok, verdict = pair.check()
    stock_calls = (pair.step(pair.stock), pair.reset(pair.stock))
    ours_calls = (pair.step(pair.converted), pair.reset(pair.converted))
    stock_counts, ours_counts = op_counts(*stock_calls), op_counts(*ours_calls)
    if not ok:  # different work: not timed
        return ([_row(subject, pair.shape, dtype, "stock", [], counts=stock_counts),
                 _row(subject, pair.shape, dtype, "remat", [], check="wrong", counts=ours_counts, error=verdict),
                 _row(subject, pair.shape, dtype, EMPTY_KERNELS, [], check="wrong", error=verdict)],
                [], None)
    switch = _KernelSwitch()
    try:  # each converted row in a pair of its own with stock (see the module's docstring)
        empty = interleaved_us({"stock": switch.real(stock_calls), EMPTY_KERNELS: switch.empty(ours_calls)}, reps)
        reference = interleaved_us({"stock": switch.real(stock_calls), "remat": switch.real(ours_calls)}, reps)
    finally:
        switch.restore()
    rows = [_row(subject, pair.shape, dtype, "stock", empty["stock"], counts=stock_counts),
            _row(subject, pair.shape, dtype, "remat", reference["remat"], reference["stock"], check=verdict,
                 counts=ours_counts),
            _row(subject, pair.shape, dtype, EMPTY_KERNELS, empty[EMPTY_KERNELS], empty["stock"],
                 check="same calls")]
    profile = profile_top(*ours_calls, calls=profile_calls, top=None)
    return rows, profile, remat_calls(ours_counts)


def summary_lines(layer_rows, remat_counts, dispatch_rows):
    """Per model: the overhead per layer with remat's ops on the reference (their arithmetic on CPU
    included) and with its kernels as empty launches (remat's host overhead itself: its Python, autograd
    and the outputs' allocations), the latter against the target; and what torch's custom-op machinery
    would add, which remat's eager path skips."""
    costs = {r["subject"]: r["minus_first_us"] for r in dispatch_rows if not math.isnan(r["minus_first_us"])}
    pair_cost = costs.get("custom-op pair, fwd+bwd", math.nan)
    call_cost = costs.get("custom-op call, no grad", math.nan)
    lines = [f"torch's custom-op machinery (a trivial op, p50 difference): {call_cost:+.1f} µs a call without grad "
             f"over its Python function; {pair_cost:+.1f} µs a forward op with autograd and its backward op over "
             "the same arithmetic on native autograd. In eager mode remat calls its implementations directly "
             "(the ops are kept for torch.compile and tracing modes): none of this is in the rows above"]
    for (stock, ours, empty), counts in zip(layer_rows, remat_counts):
        if counts is None:
            lines.append(f"{ours['subject']} ({ours['shape']}): not timed, the layers differ: {ours['error']}")
            continue
        host = empty["minus_first_us"]
        ratio = empty["p50_us"] / stock["p50_us"]
        verdict = "within" if ratio <= TARGET_RATIO else "over"
        _, forward, backward, aten = counts
        lines.append(
            f"{ours['subject']} ({ours['shape']}, {ours['dtype']}): stock {stock['p50_us']:.0f} µs (p50). remat "
            f"with its kernels as empty launches {empty['p50_us']:.0f} µs: {host:+.0f} µs per layer, "
            f"{ratio - 1:+.1%} (paired {empty['paired_minus_first_us']:+.0f} µs), remat's host overhead, {verdict} "
            f"the target of {TARGET_RATIO - 1:+.0%}. remat on the reference {ours['p50_us']:.0f} µs: "
            f"{ours['minus_first_us']:+.0f} µs, the difference being the reference's arithmetic ({aten} aten ops "
            f"against stock's {stock['aten_op_calls']}, for {forward} fwd + {backward} bwd remat op calls), which "
            "the kernels do on a GPU")
    return lines


@contextlib.contextmanager
def _threads(count):
    """torch's intra-op threads set to `count`, the previous number restored after: at these sizes no op
    splits its work, and a second thread would only add scheduling noise."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def environment(reps):
    env = report.environment(torch.device("cpu"))
    for key in ("driver", "cuda", "autotune", "fwd_saves", "triton", "backend_auto"):
        env.pop(key, None)
    env["transformers"] = report._version("transformers")
    env["backend"] = f"{BACKEND}: remat's ops run their pure-PyTorch reference (not the Triton interpreter)"
    env["timings"] = (f"host wall-clock (time.perf_counter) of each forward + backward, {reps} calls each, each "
                      "converted row interleaved with stock in a pair of its own, gc off; p20 / p50 / p80 in µs")
    env["guards"] = ("kept fingerprints compared in place by remat._C" if _guards.native_comparison()
                     else "fingerprints taken in Python (remat._C is not built: REMAT_BUILD_CUDA=1 builds it)")
    env["torch_threads"] = torch.get_num_threads()
    # other work on the machine slows both alike, but widens the spread: say how busy it was
    env["cpus"] = os.cpu_count()
    env["load_average_1min"] = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "unknown"
    return env


def run(out_dir="bench/out", seqs=None, dtypes=(torch.float32,), reps=None, quick=False, models=MODELS,
        progress=True, profile_calls=None, threads=1):
    """Measure, print and write out_dir/overhead.csv, overhead.md and overhead_profile.txt.

    Returns (table rows, summary lines, {title: profile rows}).
    """
    reps = reps or (QUICK_REPS if quick else REPS)
    profile_calls = profile_calls or max(1, min(PROFILE_CALLS, reps // 10))
    layer_rows, counts, profiles = [], [], {}
    with _backend_set(BACKEND), _threads(threads):
        env = environment(reps)
        for dtype in dtypes:
            for seq in seqs or SEQ:
                for name in models:
                    if progress:
                        print(f"overhead: {name} layer, s={seq}, {dtype}", file=sys.stderr, flush=True)
                    rows, profile, found = measure_layer(name, seq, dtype, reps, profile_calls)
                    layer_rows.append(rows)
                    counts.append(found)
                    for key, what in (("cumulative_us", "cumulative time"), ("own_us", "own time")) if profile else ():
                        profiles[f"{rows[1]['subject']} ({rows[1]['shape']}, {rows[1]['dtype']}), remat: top "
                                 f"{PROFILE_TOP} functions by {what}, µs per layer call over {profile_calls} calls "
                                 "(cProfile's own cost inflates them)"] = top_functions(profile, key)
        if progress:
            print("overhead: custom-op dispatch", file=sys.stderr, flush=True)
        dispatch_rows = []
        for subject, samples in dispatch_samples(reps * DISPATCH_FACTOR).items():
            (base, base_samples), (other, other_samples) = samples.items()
            dispatch_rows += [_row(subject, "x: 1x8x128", torch.float32, base, base_samples),
                              _row(subject, "x: 1x8x128", torch.float32, other, other_samples, base_samples)]
    table = [row for rows in layer_rows for row in rows] + dispatch_rows
    summary = summary_lines(layer_rows, counts, dispatch_rows)
    profile_block = "\n\n".join(profile_text(title, rows) for title, rows in profiles.items())
    write(table, env, summary, profile_block, out_dir)
    print(text_report(table, env, summary, profile_block))
    print(f"wrote {out_dir}/overhead.csv, overhead.md and overhead_profile.txt")
    return table, summary, profiles


def _columns():
    fmt = report._fmt
    return [("subject", lambda r: r["subject"]), ("shape", lambda r: r["shape"]), ("dtype", lambda r: r["dtype"]),
            ("implementation", lambda r: r["implementation"]), ("check", lambda r: r["check"]),
            ("p20 µs", lambda r: fmt(r["p20_us"], 4)), ("p50 µs", lambda r: fmt(r["p50_us"], 4)),
            ("p80 µs", lambda r: fmt(r["p80_us"], 4)),
            ("- first p50", lambda r: _signed(r["minus_first_us"])),
            ("paired", lambda r: _signed(r["paired_minus_first_us"])),
            ("remat ops", lambda r: str(r["remat_op_calls"])), ("aten ops", lambda r: str(r["aten_op_calls"]))]


def _signed(value):
    return "-" if value is None or math.isnan(value) else f"{value:+.1f}"


def text_report(table, env, summary, profile_block):
    columns = _columns()
    lines = [" | ".join(f"{k}: {v}" for k, v in env.items())]
    lines += report.aligned_lines([name for name, _ in columns], [[cell(r) for _, cell in columns] for r in table])
    return "\n".join([*lines, "", *summary, "", profile_block])


def write(table, env, summary, profile_block, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    report.write_rows_csv(table, COLUMNS, env, os.path.join(out_dir, "overhead.csv"))
    columns = _columns()
    lines = ["# remat bench overhead: host time of a converted decoder layer", "",
             *[f"- {k}: {v}" for k, v in env.items()], "",
             "\"- first p50\": this row's p50 less the first row's of its subject; \"paired\": the median of the "
             "per-round differences. \"remat ops\": remat's custom-op calls in one forward + backward; \"aten "
             "ops\": torch's ops dispatched, those that remat's ops run on the reference included.", "",
             "| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in table]
    lines += ["", *[f"- {line}" for line in summary], "", "```", profile_block, "```"]
    with open(os.path.join(out_dir, "overhead.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "overhead_profile.txt"), "w") as handle:
        handle.write(profile_block + "\n")
