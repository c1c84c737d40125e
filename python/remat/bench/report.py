"""Tables, CSV, markdown and plots of benchmark results, tagged with the machine and versions."""

import csv
import datetime
import math
import os
import platform
import shutil
import subprocess

import torch

import remat
from remat.triton_kernels import _autotune

from .cases import best_peer_ratio

COLUMNS = ["op", "mode", "dtype", "shape", "implementation", "check", "p20_ms", "p50_ms", "p80_ms",
           "unit", "rate", "ratio_to_best_peer", "peak_mb", "fwd_saves_bytes", "saved_sbh_per_layer", "error"]

PERFORMANCE = "performance: CUDA events, L2 flushed before each call"
CPU_BANNER = """\
CPU run: timings are functional, not performance. remat's kernels are written for GPUs; here
remat runs its PyTorch reference, so the times only show that every implementation runs, and no
ratio to the peers is given. The check column is real on any device: every implementation's
output and gradients against float64, within twice PyTorch's own error. So is the memory:
"fwd saves" is what each implementation's forward keeps for the backward, counted exactly
(saved-tensor hooks, each storage once, beyond its inputs, weights and output); "sbh/layer" is
that per layer in bytes per sequence·batch·hidden."""


def environment(device, cases_planned=None):
    """Where and with what the numbers were measured."""
    on_gpu = device.type == "cuda"
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": (torch.cuda.get_device_name(device) if on_gpu
                   else f"CPU ({platform.processor() or platform.machine()})"),
        "driver": _nvidia_smi("driver_version") if on_gpu else "",
        "cuda": torch.version.cuda or "",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "remat": remat.__version__,
        "commit": _git_commit(),
        "backend_auto": remat.get_backend(),
        # Tuned attention blocks are chosen in the warm-up calls; the cache file says which won.
        "autotune": "on" if _autotune.enabled() else "off (fixed block table)",
        "timings": PERFORMANCE if on_gpu else "functional run on CPU: these are not performance figures",
        "fwd_saves": "allocated after the forward, from the allocator" if on_gpu else "exact count of saved tensors",
    }
    if cases_planned is not None:
        info["cases_planned"] = cases_planned
    return info


def is_performance(env):
    return env.get("timings") == PERFORMANCE


def _version(module):
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def _nvidia_smi(field):
    if shutil.which("nvidia-smi") is None:
        return "unknown"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git_commit():
    """$REMAT_COMMIT (for a copy of the tree without its git folder), else git's, "-dirty" when
    tracked files differ from it."""
    if os.environ.get("REMAT_COMMIT"):
        return os.environ["REMAT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty", "--abbrev=7"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def rows(results_by_case, with_ratios=True):
    """One dict per (case, implementation), with the ratio of ours to the best peer when
    `with_ratios` (a performance run)."""
    table = []
    for results in results_by_case:
        ratios = best_peer_ratio(results) if with_ratios else {}
        for r in results:
            c = r.case
            table.append({
                "op": c.op, "mode": c.mode, "dtype": str(c.dtype).replace("torch.", ""),
                "shape": c.shape, "implementation": r.implementation, "check": r.check or "-",
                "p20_ms": r.p20_ms, "p50_ms": r.p50_ms, "p80_ms": r.p80_ms,
                "unit": c.unit, "rate": r.rate,
                "ratio_to_best_peer": ratios.get(r.implementation, math.nan),
                "peak_mb": r.peak_mb, "fwd_saves_bytes": r.saved_bytes,
                "saved_sbh_per_layer": r.saved_sbh_per_layer, "error": r.error, "size": c.size,
            })
    return table


def _fmt(value, digits=3):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _fmt_bytes(size):
    """Bytes as people read them: "0 B", "2 KiB", "1.5 MiB", "3.2 GiB"."""
    if size is None:
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if abs(size) < 1024:
            return f"{size:.3g} {unit}"
        size /= 1024
    return f"{size:.3g} GiB"


def _columns(env, table):
    """(header, cell(row)) of the printed and markdown tables: no rate or peer ratio on CPU."""
    columns = [(name, lambda r, name=name: r[name])
               for name in ("op", "mode", "dtype", "shape", "implementation", "check")]
    columns.append(("p50 ms", lambda r: _fmt(r["p50_ms"])))
    if is_performance(env):
        columns += [("rate", _rate_cell),
                    ("vs best peer",
                     lambda r: "-" if math.isnan(r["ratio_to_best_peer"]) else f"{r['ratio_to_best_peer']:.2f}x"),
                    ("peak MB", lambda r: _fmt(r["peak_mb"], 4))]
    columns += [("fwd saves", lambda r: _fmt_bytes(r["fwd_saves_bytes"])),
                ("sbh/layer", lambda r: _fmt(r["saved_sbh_per_layer"], 3))]
    if not is_performance(env) and any(_untimed(r) for r in table):  # no rate column to say why
        columns.append(("not timed", _untimed))
    return columns


def _untimed(r):
    """Why a row has no timing ("" when it has one)."""
    if not math.isnan(r["rate"]):  # timed (a later memory error, if any, is in the CSV's error column)
        return ""
    if r["check"] == "wrong":
        return r["error"][:70]
    return f"error: {r['error'][:60]}" if r["error"] else "not measured (interrupted)"


def _rate_cell(r):
    return _untimed(r) or f"{_fmt(r['rate'], 4)} {r['unit']}"


def _header_lines(env):
    lines = [" | ".join(f"{k}: {v}" for k, v in env.items())]
    return lines if is_performance(env) else lines + CPU_BANNER.splitlines()


def aligned_lines(header, lines):
    """The header and rows of cells (strings) as text lines, each column padded to its widest cell."""
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [header, *lines]]


def text_table(table, env):
    columns = _columns(env, table)
    lines = [[cell(r) for _, cell in columns] for r in table]
    return "\n".join(_header_lines(env) + aligned_lines([name for name, _ in columns], lines))


def write_csv(table, env, path):
    write_rows_csv(table, COLUMNS, env, path)


def write_rows_csv(table, columns, env, path):
    """The rows' `columns`, then the environment's fields on every row (floats to 6 digits)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns + list(env), extrasaction="ignore")
        writer.writeheader()
        for row in table:
            writer.writerow({**{k: _fmt(v, 6) if isinstance(v, float) else v for k, v in row.items()}, **env})


def write_markdown(table, env, path):
    columns = _columns(env, table)
    header = [name if name != "p50 ms" else "p20 / p50 / p80 ms" for name, _ in columns]
    banner = [] if is_performance(env) else ["", *(f"> {line}" for line in CPU_BANNER.splitlines())]
    lines = ["# remat benchmark", "", *[f"- {k}: {v}" for k, v in env.items()], *banner, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in table:
        cells = [cell(r) for _, cell in columns]
        cells[header.index("p20 / p50 / p80 ms")] = f"{_fmt(r['p20_ms'])} / {_fmt(r['p50_ms'])} / {_fmt(r['p80_ms'])}"
        lines.append("| " + " | ".join(cells) + " |")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")


def write_plots(table, env, out_dir):
    """One PNG per (op, mode, dtype): rate against size, a line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    groups = {}
    for r in table:
        if not math.isnan(r["rate"]):
            groups.setdefault((r["op"], r["mode"], r["dtype"], r["unit"]), []).append(r)
    for (op, mode, dtype, unit), group in groups.items():
        figure, axes = plt.subplots(figsize=(6, 4))
        for name in dict.fromkeys(r["implementation"] for r in group):
            points = sorted((r["size"], r["rate"]) for r in group if r["implementation"] == name)
            axes.plot(*zip(*points), marker="o", label=name)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("size")
        axes.set_ylabel(unit)
        axes.set_title(f"{op} {mode} {dtype} on {env['device']}", fontsize=9)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        path = os.path.join(out_dir, f"{op}_{mode.replace('+', '_')}_{dtype}.png")
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def write_tables(table, env, out_dir, stem="bench"):
    """CSV and markdown: cheap, so rewritten after every case."""
    os.makedirs(out_dir, exist_ok=True)
    write_csv(table, env, os.path.join(out_dir, f"{stem}.csv"))
    write_markdown(table, env, os.path.join(out_dir, f"{stem}.md"))
