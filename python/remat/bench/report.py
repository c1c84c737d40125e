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
from remat import _autotune

from .cases import best_peer_ratio

COLUMNS = ["op", "mode", "dtype", "shape", "implementation", "p20_ms", "p50_ms", "p80_ms",
           "unit", "rate", "ratio_to_best_peer", "peak_mb", "retained_mb", "saved_sbh_per_layer", "error"]


def environment(device):
    """Where and with what the numbers were measured."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})",
        "driver": _nvidia_smi("driver_version") if device.type == "cuda" else "",
        "cuda": torch.version.cuda or "",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "remat": remat.__version__,
        "commit": _git_commit(),
        "backend_auto": remat.get_backend(),
        # Tuned attention blocks are chosen in the warm-up calls; the cache file says which won.
        "autotune": "on" if _autotune.enabled() else "off (fixed block table)",
    }
    if device.type != "cuda":
        info["note"] = "functional run on CPU: these are not performance figures"
    return info


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
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def rows(results_by_case):
    """One dict per (case, implementation), with the ratio of ours to the best peer."""
    table = []
    for results in results_by_case:
        ratios = best_peer_ratio(results)
        for r in results:
            c = r.case
            table.append({
                "op": c.op, "mode": c.mode, "dtype": str(c.dtype).replace("torch.", ""),
                "shape": c.shape, "implementation": r.implementation,
                "p20_ms": r.p20_ms, "p50_ms": r.p50_ms, "p80_ms": r.p80_ms,
                "unit": c.unit, "rate": r.rate,
                "ratio_to_best_peer": ratios[r.implementation],
                "peak_mb": r.peak_mb, "retained_mb": r.retained_mb,
                "saved_sbh_per_layer": r.saved_sbh_per_layer, "error": r.error, "size": c.size,
            })
    return table


def _fmt(value, digits=3):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


TABLE_HEADER = ["op", "mode", "dtype", "shape", "implementation", "p50 ms", "rate", "vs best peer",
                "peak MB", "fwd saves MB", "sbh/layer"]


def _table_cells(r):
    if not math.isnan(r["rate"]):  # timed (a later memory error, if any, is in the CSV's error column)
        rate = f"{_fmt(r['rate'], 4)} {r['unit']}"
    else:
        rate = f"error: {r['error'][:60]}" if r["error"] else "not measured (interrupted)"
    ratio = r["ratio_to_best_peer"]
    return [r["op"], r["mode"], r["dtype"], r["shape"], r["implementation"], _fmt(r["p50_ms"]), rate,
            "-" if math.isnan(ratio) else f"{ratio:.2f}x", _fmt(r["peak_mb"], 4), _fmt(r["retained_mb"], 4),
            _fmt(r["saved_sbh_per_layer"], 3)]


def text_table(table, env):
    lines = [_table_cells(r) for r in table]
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(TABLE_HEADER)]
    out = [" | ".join(f"{k}: {v}" for k, v in env.items())]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in [TABLE_HEADER, *lines]]
    return "\n".join(out)


def write_csv(table, env, path):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS + list(env), extrasaction="ignore")
        writer.writeheader()
        for row in table:
            writer.writerow({**{k: _fmt(v, 6) if isinstance(v, float) else v for k, v in row.items()}, **env})


def write_markdown(table, env, path):
    header = TABLE_HEADER[:5] + ["p20 / p50 / p80 ms"] + TABLE_HEADER[6:]
    lines = ["# remat benchmark", "", *[f"- {k}: {v}" for k, v in env.items()], "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in table:
        cells = _table_cells(r)
        cells[5] = f"{_fmt(r['p20_ms'])} / {_fmt(r['p50_ms'])} / {_fmt(r['p80_ms'])}"
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


def write_all(table, env, out_dir, stem="bench"):
    os.makedirs(out_dir, exist_ok=True)
    write_csv(table, env, os.path.join(out_dir, f"{stem}.csv"))
    write_markdown(table, env, os.path.join(out_dir, f"{stem}.md"))
    return write_plots(table, env, out_dir)
