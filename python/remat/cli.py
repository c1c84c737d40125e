"""The `remat` command: `remat bench` (kernel microbenchmarks), `remat memory` (a model's memory/time
trade-off under each policy), `remat plan` (the fastest per-layer mix of policies for a budget),
`remat calibrate` (the planner's constants measured on this GPU) and `remat info` (the available
backends)."""

import argparse
import sys


def _bench(args):
    from . import bench

    ops = list(bench.SUITES) if not args.ops or "all" in args.ops else args.ops
    dtypes = [bench.DTYPES[d] for d in args.dtype]
    sizes = [int(s) for s in args.shapes.split(",")] if args.shapes else None
    bench.run(ops, dtypes, quick=args.quick, out_dir=args.out, device=args.device,
              progress=not args.no_progress, sizes=sizes)


def _memory(args):
    from . import memory

    memory.run(args.model, batch=args.batch, seq=args.seq, budget_gb=args.budget, out_dir=args.out,
               device=args.device, dtype=_dtype(args.dtype))


def _dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _plan(args):
    from .planner import command

    try:
        command.run(args.model, args.batch, args.seq, args.budget, device=args.device, json_path=args.json,
                    dtype=_dtype(args.dtype), budget_kind=args.budget_kind, optimizer=_optimizer(args.optimizer))
    except ValueError as error:  # a budget below the least the model can keep: one line, not a traceback
        sys.exit(f"remat plan: {error}")


def _optimizer(text):
    """--optimizer: a name of remat.planner.OPTIMIZER_STATES or bytes per parameter element."""
    return int(text) if text is not None and text.isdigit() else text


def _budget(text):
    from .planner.command import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _calibrate(args):
    from .planner import calibrate, command

    try:
        model = example = None
        if args.model is not None:  # its plan choices timed too, for `remat plan --model` on this GPU
            model, example = command.model_on_gpu(args.model, args.batch, args.seq, _dtype(args.dtype))
        constants = calibrate.calibrate(model, example)
    except RuntimeError as error:
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
    import remat

    for name, (available, why) in remat.backends().items():
        print(f"{name:12s} {'yes' if available else 'no ':3s}  {why}")
    print(f"{'selected':12s} {remat.get_backend()}")


def _suite_name(name):
    from .bench import SUITES

    if name not in (*SUITES, "all"):
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(SUITES)}, all)")
    return name


def _model(name):
    """--model: a known name or a config.json path; argparse turns a wrong one into a one-line error."""
    from . import memory

    try:
        return memory.check_model(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parser():
    from .bench import DTYPES, SUITES

    top = argparse.ArgumentParser(prog="remat", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="kernel microbenchmarks against the peers")
    # No `choices` here: argparse (3.11.7, 3.12.1) checks a list default of a nargs="*"
    # positional against them as a whole and rejects a bare `remat bench --quick`.
    bench.add_argument("ops", nargs="*", type=_suite_name, metavar="OP",
                       help=f"one or more of {', '.join(SUITES)}, or all (default)")
    bench.add_argument("--dtype", nargs="+", default=["bf16"], choices=list(DTYPES))
    bench.add_argument("--shapes", help="comma-separated sizes instead of the standard ones: "
                       + ", ".join(f"{name} {suite.SIZES_MEAN}" for name, suite in SUITES.items()))
    bench.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    bench.add_argument("--out", default="bench/out", help="folder for CSV, markdown and PNG plots")
    bench.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(run=_bench)
    memory = commands.add_parser("memory", help="activation memory and step time of a model under each policy")
    memory.add_argument("--model", default="gpt2-small", type=_model,
                        help="gpt2-small, gpt2-medium, gpt2-large (remat.gpt stacks), bert-base, vit-base, "
                             "hf-gpt2-small, hf-gpt2-medium (Hugging Face, needs transformers), or a config.json path")
    memory.add_argument("--batch", type=int, default=8)
    memory.add_argument("--seq", type=int, default=1024)
    memory.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    memory.add_argument("--budget", type=float, help="device memory budget in GB: name the cheapest policy that fits")
    memory.add_argument("--out", default="bench/out/memory", help="folder for the CSV and the PNG frontier")
    memory.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    memory.set_defaults(run=_memory)
    plan = commands.add_parser("plan", help="the fastest per-layer mix of remat, checkpointing and offloading "
                               "that keeps at most --budget bytes for the backward")
    plan.add_argument("--model", default="gpt2-small", type=_model, help="as for remat memory")
    plan.add_argument("--batch", type=int, default=8)
    plan.add_argument("--seq", type=int, default=1024)
    plan.add_argument("--budget", type=_budget, required=True,
                      help="bytes kept for the backward (or the step's peak, see --budget-kind): 12GiB, 500MB, ...")
    plan.add_argument("--budget-kind", default="saved", choices=["saved", "peak"],
                      help="saved: bytes kept for the backward; peak: a training step's peak on the device "
                           "(parameters, gradients, --optimizer state, activations, the backward's largest transient)")
    plan.add_argument("--optimizer", help="with --budget-kind peak: sgd, momentum, adam, adamw (states per parameter "
                      "element in its dtype) or bytes per parameter element (12: fp32 master weights and Adam)")
    plan.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    plan.add_argument("--device", default="H200", choices=["A100", "H100", "H200", "cpu"],
                      help="whose constants predict the time of each choice; for a GPU, offloading a layer's "
                           "saved tensors to host memory is a choice too")
    plan.add_argument("--json", help="also write the plan here (remat.Plan.from_json reads it)")
    plan.set_defaults(run=_plan)
    calibrate = commands.add_parser("calibrate", help="measure this GPU's constants for remat plan and cache them; "
                                                      "with --model, time each plan choice of that model too")
    calibrate.add_argument("--model", type=_model, help="as for remat plan (random weights on this GPU)")
    calibrate.add_argument("--batch", type=int, default=8)
    calibrate.add_argument("--seq", type=int, default=1024)
    calibrate.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    calibrate.set_defaults(run=_calibrate)
    info = commands.add_parser("info", help="which backends are available and why")
    info.set_defaults(run=_info)
    return top


def main(argv=None):
    args = parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
