"""The `remat` command: `remat bench` (kernel microbenchmarks; without a GPU, what remat saves on
real models and the float64 check of every kernel), `remat memory` (a model's memory/time trade-off
under each policy), `remat plan` (the fastest per-layer mix of policies for a budget), `remat
calibrate` (the planner's constants measured on this GPU) and `remat info` (the available backends)."""

import argparse
import os
import re
import sys

from ._config_json import config_fields

# What the parser needs to know, written here so that it parses (and `--help` and a mistyped
# argument answer) before torch is imported; tests/tools/test_cli_startup.py holds them to the
# lists they repeat (remat.bench.SUITES, remat.memory.model_names()).
SUITES = {  # `remat bench` suite -> what its --shapes sizes are
    "layernorm": "widths N", "rms_norm": "widths N", "gelu": "row counts M", "gated": "row counts M",
    "attention": "sequence lengths s",
    "attention_varlen": "longest sequence lengths s (16 sequences, 16 heads of 128)",
    "linear_cross_entropy": "token counts T", "experts": "token counts T", "mlp": "hidden sizes h",
    "block": "sequence length s (the first size)",
}
# Other names of a suite (remat.bench.ALIASES): `remat bench moe` runs the experts suite.
SUITE_ALIASES = {"moe": "experts"}
# Suites run only when named, not by `all`: reports of their own (remat.bench.NAMED_SUITES), not kernel timings.
NAMED_SUITES = {"overhead": "sequence lengths s (batch 1)"}
DTYPES = ("bf16", "fp16", "fp32")
MODEL_NAMES = ("gpt2-small", "gpt2-medium", "gpt2-large", "tiny", "hf-gpt2-small", "hf-gpt2-medium", "bert-base",
               "vit-base", "llama-3-8b", "qwen3-8b", "qwen3-30b-a3b")
GPUS = ("A100", "H100", "H200")  # remat.planner.DEVICES less "cpu"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # remat.memory.HUB_ID: a Hugging Face model id, owner/name


def _model(name):
    """--model: a known name, a config.json path, a folder holding one, or a Hugging Face model id
    (owner/name: only its config is fetched, when the model is built); argparse turns a wrong one into a
    one-line error (remat.memory.check_model says the same)."""
    hub_id = HUB_ID.fullmatch(name) and not name.endswith(".json") and not os.path.exists(name)
    if name in MODEL_NAMES or os.path.isdir(name) or hub_id:
        return name
    if not os.path.isfile(name):
        raise argparse.ArgumentTypeError(f"model must be one of {', '.join(MODEL_NAMES)}, the path of a config.json "
                                         "or of a folder holding one, or a Hugging Face model id (owner/name); got "
                                         f"{name!r}, which is none of these")
    try:
        config_fields(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name


def _dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _gpu_in_use(device):
    """Whether `remat bench` runs on a GPU: --device cuda, or none given and torch sees one."""
    if device is not None:
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def _bench(args):
    if not args.ops and not _gpu_in_use(args.device):
        _main_job_without_gpu(args)
        return
    if "overhead" in args.ops:
        _overhead(args)
        if set(args.ops) == {"overhead"}:
            return
    elif args.reps is not None:
        sys.exit("remat bench: --reps sets the overhead suite's timed calls: name it (remat bench overhead --reps N)")
    from . import bench

    kernel_ops = [op for op in args.ops if op not in NAMED_SUITES]
    ops = list(bench.SUITES) if not kernel_ops or "all" in kernel_ops else kernel_ops
    dtypes = [bench.DTYPES[d] for d in args.dtype or ["bf16"]]
    sizes = [int(s) for s in args.shapes.split(",")] if args.shapes else None
    bench.run(ops, dtypes, quick=args.quick, out_dir=args.out, device=args.device,
              progress=not args.no_progress, sizes=sizes)


def _overhead(args):
    """`remat bench overhead`: host time of a converted decoder layer against stock's, on CPU."""
    from .bench import overhead

    if args.device is not None and args.device != "cpu":
        sys.exit("remat bench overhead: it measures host (CPU, Python) time on CPU tensors, with remat's ops on "
                 f"their PyTorch reference; --device {args.device} is not supported")
    seqs = [int(s) for s in args.shapes.split(",")] if args.shapes else None
    overhead.run(out_dir=args.out, seqs=seqs, dtypes=[_dtype(d) for d in args.dtype or ["fp32"]], reps=args.reps,
                 quick=args.quick, progress=not args.no_progress)


def _main_job_without_gpu(args):
    """`remat bench` without ops and without a GPU: what a CPU can tell for certain."""
    from .bench import without_gpu

    if args.shapes:
        sys.exit("remat bench: --shapes sets the microbenchmarks' sizes: name the ops to time (or all), "
                 "e.g. remat bench layernorm --shapes 256,1000 --device cpu")
    if "bf16" in (args.dtype or ()):
        sys.exit("remat bench: --dtype bf16: without a GPU the kernels are checked through the Triton interpreter, "
                 "whose tl.dot is wrong on bf16 operands (triton issue 11584); bf16 is checked on a GPU. "
                 "Choose fp32 and/or fp16")
    _, rows = without_gpu.run(out_dir=args.out, dtypes=args.dtype or without_gpu.CHECK_DTYPES,
                              progress=not args.no_progress)
    if not all(without_gpu.passed(row) for row in rows):
        sys.exit(f"remat bench: {sum(not without_gpu.passed(row) for row in rows)} kernel checks failed "
                 f"(see {args.out}/check.md)")


def _memory(args):
    from . import memory
    from .planner.command import parse_bytes

    if args.device == "cuda" and not _gpu_in_use(None):
        sys.exit("remat memory: --device cuda: torch sees no GPU here (without --device, the counts run on meta)")
    budget_gb = None if args.budget is None else parse_bytes(args.budget) / 2**30  # memory.run's "GB" is 2**30 B
    try:
        memory.run(args.model or None, batch=args.batch, seq=args.seq, budget_gb=budget_gb, out_dir=args.out,
                   device=args.device, dtype=_dtype(args.dtype), gpu=args.gpu)
    except ValueError as error:  # a seq beyond the model's positions, a Hub id not fetched: one line
        sys.exit(f"remat memory: {error}")


def _plan(args):
    from .planner import command

    try:
        command.run(args.model, args.batch, args.seq, args.budget, device=args.gpu, json_path=args.json,
                    dtype=_dtype(args.dtype), budget_kind=args.budget_kind, optimizer=_optimizer(args.optimizer))
    except ValueError as error:  # a budget below the least the model can keep: one line, not a traceback
        sys.exit(f"remat plan: {error}")


def _optimizer(text):
    """--optimizer: a name of remat.planner.OPTIMIZER_STATES or bytes per parameter element."""
    return int(text) if text is not None and text.isdigit() else text


# The syntax remat.planner.command.parse_bytes reads (the budget's value is read there): checked here
# without importing the planner, which imports torch.
_BYTES = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*((?:[kKmMgGtT][iI]?)?[bB]|)\s*")


_LEAST_PLAIN_BUDGET = 2**20  # a plain number below it is taken for a size without its unit (4 for 4GiB)


def _budget(text):
    """--budget: "12GiB", "500MB", "1.5GiB" or a plain number of bytes, as text for remat to read."""
    match = _BYTES.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(f"budget must be bytes, as 12GiB, 500MB or 1000000, got {text!r}")
    if not match.group(2) and float(match.group(1)) < _LEAST_PLAIN_BUDGET:
        raise argparse.ArgumentTypeError(f"budget {text.strip()} without a unit is {text.strip()} bytes: give its "
                                         f"unit, as {text.strip()}GiB or {text.strip()}MB")
    return text


def _calibrate(args):
    from .planner import calibrate, command

    try:
        model = example = None
        if args.model is not None:  # its plan choices timed too, for `remat plan --model` on this GPU
            args.batch, args.seq = command.model_shape(args.model, args.batch, args.seq, "remat calibrate")
            model, example = command.model_on_gpu(args.model, args.batch, args.seq, _dtype(args.dtype))
        constants = calibrate.calibrate(model, example)
    except (RuntimeError, ValueError) as error:
        sys.exit(f"remat calibrate: {error}")
    print(f"{constants.name}: matmul {constants.flops_per_s / 1e12:.0f} TFLOP/s, memory "
          f"{constants.bytes_per_s / 1e9:.0f} GB/s, host link {constants.host_bytes_per_s / 1e9:.1f} GB/s; "
          f"cached in {calibrate.cache_path()}")
    if model is not None:
        seconds = calibrate.measured_choices(constants.name, calibrate.model_signature(model, example))
        print(f"{args.model} (batch {args.batch}, seq {args.seq}): extra ms per layer "
              + ", ".join(f"{choice} {s * 1e3:.3f}" for choice, s in seconds.items())
              + f"; cached in {calibrate.CHOICES_FILE} beside it")


def _info(_args):
    from . import _backend  # the backends alone: not the kernels, layers and conversion

    for name, (available, why) in _backend.backends().items():
        print(f"{name:12s} {'yes' if available else 'no ':3s}  {why}")
    print(f"{'selected':12s} {_backend.get_backend()}")


def _suite_name(name):
    """An OP: a suite's name (an alias gives the suite's own), a named suite, or all."""
    name = SUITE_ALIASES.get(name, name)
    if name not in (*SUITES, *NAMED_SUITES, "all"):
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from "
                                         f"{', '.join([*SUITES, *SUITE_ALIASES, *NAMED_SUITES])}, all)")
    return name


BATCH_HELP = "default 1 for llama-3-8b, qwen3-8b and qwen3-30b-a3b, else 8"
SEQ_HELP = ("default 8192 for llama-3-8b and qwen3-8b, 4096 for qwen3-30b-a3b, else 1024, or the model's "
            "max_position_embeddings where that is less (bert-base: 512)")
GPU_HELP = ("whose data-sheet constants predict the step times (default: the GPU here when it is one of these, "
            "else H200)")


def parser():
    top = argparse.ArgumentParser(prog="remat", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="kernel microbenchmarks against the peers; without a GPU and without "
                                "OP, what remat saves on real models and the float64 check of every kernel")
    # No `choices` here: argparse (3.11.7, 3.12.1) checks a list default of a nargs="*"
    # positional against them as a whole and rejects a bare `remat bench --quick`.
    bench.add_argument("ops", nargs="*", type=_suite_name, metavar="OP",
                       help=f"one or more of {', '.join(SUITES)}, or all (default on a GPU); "
                            + ", ".join(f"{alias} is {name}" for alias, name in SUITE_ALIASES.items())
                            + " (a mixture of experts' routed experts). Without OP and "
                            "without a GPU: remat memory's report of the default models and every kernel checked "
                            "against float64 at small shapes (name OPs, or all, to time them on the CPU anyway). "
                            "overhead (only when named, not in all): the host time a converted Hugging Face "
                            "decoder layer adds to stock's forward + backward, on CPU")
    bench.add_argument("--dtype", nargs="+", choices=DTYPES,
                       help="default bf16 (overhead: fp32); without a GPU and without OP, the dtypes checked: "
                            "fp32 fp16")
    bench.add_argument("--shapes", help="comma-separated sizes instead of the standard ones: "
                       + ", ".join(f"{name} {sizes}" for name, sizes in {**SUITES, **NAMED_SUITES}.items()))
    bench.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    bench.add_argument("--reps", type=int, metavar="N",
                       help="overhead: timed calls of each layer (default 2000, --quick 200)")
    bench.add_argument("--out", default="bench/out", help="folder for CSV, markdown and PNG plots")
    bench.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(run=_bench, package=True)
    memory = commands.add_parser("memory", help="what a model keeps for the backward under each policy, counted "
                                 "exactly on meta tensors, its step time predicted for a GPU (and on a GPU measured)")
    memory.add_argument("--model", nargs="+", type=_model, metavar="MODEL",
                        help="one or more of llama-3-8b, qwen3-8b, qwen3-30b-a3b, hf-gpt2-small, hf-gpt2-medium, "
                             "bert-base, "
                             "vit-base (Hugging Face configurations, needs transformers), gpt2-small, gpt2-medium, "
                             "gpt2-large, tiny (remat.gpt stacks of blocks), config.json paths or their folders, or "
                             "Hugging Face model ids as meta-llama/Llama-3.1-8B (only the config is fetched) "
                             "(default: llama-3-8b qwen3-8b qwen3-30b-a3b hf-gpt2-small)")
    memory.add_argument("--batch", type=int, help=BATCH_HELP)
    memory.add_argument("--seq", type=int, help=SEQ_HELP)
    memory.add_argument("--dtype", default="bf16", choices=DTYPES)
    memory.add_argument("--budget", type=_budget, help="device memory budget, as 40GiB, 500MB or plain bytes: name "
                        "the fastest policy that fits, and remat plan's mix for it")
    memory.add_argument("--gpu", choices=GPUS, help=GPU_HELP)
    memory.add_argument("--out", default="bench/out/memory", help="folder for the CSV and the PNG of each model")
    memory.add_argument("--device", choices=["meta", "cpu", "cuda"],
                        help="meta: count at any size without memory; cpu: count on real CPU tensors; cuda: count "
                             "on meta and time each policy on this GPU (default: cuda when available, else meta)")
    memory.set_defaults(run=_memory, package=True)
    plan = commands.add_parser("plan", help="the fastest per-layer mix of remat, checkpointing and offloading "
                               "that keeps at most --budget bytes for the backward")
    plan.add_argument("--model", default="gpt2-small", type=_model, help="as for remat memory")
    plan.add_argument("--batch", type=int, help=BATCH_HELP)
    plan.add_argument("--seq", type=int, help=SEQ_HELP)
    plan.add_argument("--budget", type=_budget, required=True,
                      help="bytes kept for the backward (or the step's peak, see --budget-kind): 12GiB, 500MB or "
                           "plain bytes")
    plan.add_argument("--budget-kind", default="saved", choices=["saved", "peak"],
                      help="saved: bytes kept for the backward; peak: a training step's peak on the device "
                           "(parameters, gradients, --optimizer state, activations, the backward's largest transient)")
    plan.add_argument("--optimizer", help="with --budget-kind peak: sgd, momentum, adam, adamw (states per parameter "
                      "element in its dtype) or bytes per parameter element (12: fp32 master weights and Adam)")
    plan.add_argument("--dtype", default="bf16", choices=DTYPES)
    plan.add_argument("--gpu", choices=[*GPUS, "cpu"], help=GPU_HELP + "; for a GPU, offloading a layer's saved "
                      "tensors to host memory is a choice too (cpu: the CPU's constants, no offloading)")
    plan.add_argument("--device", dest="gpu", choices=[*GPUS, "cpu"], help=argparse.SUPPRESS)  # --gpu's old name
    plan.add_argument("--json", help="also write the plan here (remat.Plan.from_json reads it)")
    plan.set_defaults(run=_plan, package=True)
    calibrate = commands.add_parser("calibrate", help="measure this GPU's constants for remat plan and cache them; "
                                                      "with --model, time each plan choice of that model too")
    calibrate.add_argument("--model", type=_model, help="as for remat plan (random weights on this GPU)")
    calibrate.add_argument("--batch", type=int, help=BATCH_HELP)
    calibrate.add_argument("--seq", type=int, help=SEQ_HELP)
    calibrate.add_argument("--dtype", default="bf16", choices=DTYPES)
    calibrate.set_defaults(run=_calibrate, package=True)
    info = commands.add_parser("info", help="which backends are available and why")
    info.set_defaults(run=_info, package=False)
    return top


def main(argv=None):
    args = parser().parse_args(argv)
    if args.package:  # the kernels, layers and conversion, as `import remat` has them (see remat/__init__.py)
        import remat

        remat._load()
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
