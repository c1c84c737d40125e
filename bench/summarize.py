"""The summary gpu_check.sh writes after every step and prints last: every step, the smoke check,
the tests, the sanitizer and each benchmark suite (a row for each, also when it failed or ran out
of time), with where each file is. Reads only what the steps left in the work folder (no torch
import: quick, and it still works when the GPU environment is broken).

    python bench/summarize.py WORK_DIR [--budget 380] [--elapsed SECONDS] [--running STEP] [--modelled]
"""

import argparse
import csv
import math
import os
import xml.etree.ElementTree as ElementTree

SUITES = ("layernorm", "rms_norm", "gelu", "gated", "mlp", "attention", "block")  # as gpu_check.sh runs them
TAGS = ("device", "driver", "torch", "cuda", "triton", "commit")


def read_csv(path, delimiter=","):
    try:
        with open(path, newline="") as handle:
            return list(csv.DictReader(handle, delimiter=delimiter))
    except OSError:
        return []


def read_steps(out_dir):
    """{step name: {limit, seconds, status}} from steps.tsv, in the order the steps ran."""
    steps = {}
    for row in read_csv(os.path.join(out_dir, "steps.tsv"), delimiter="\t"):
        steps[row["step"]] = row
    return steps


def _step_line(name, step):
    if step.get("part") == "background":  # beside the steps: no limit of its own in the budget
        return f"  {name:<38} {step['seconds']:>4} s  {step['status']}"
    if step["limit"] == "-":  # left out
        return f"  {name:<38} {step['status']}"
    extra = "   (with the time left)" if step.get("part") == "extra" else ""
    return f"  {name:<38} {step['status']:<24} {step['seconds']:>4} s (limit {step['limit']} s){extra}"


def tags(out_dir, suites):
    """GPU, driver, versions and commit, from the first results that carry them."""
    for path in [os.path.join(out_dir, "smoke", "smoke.csv"),
                 *(os.path.join(out_dir, "bench", suite, "bench.csv") for suite in suites)]:
        rows = read_csv(path)
        if rows and "commit" in rows[0]:
            return " | ".join(f"{key} {rows[0].get(key) or '-'}" for key in TAGS)
    return "no results carry the tags (see environment.txt)"


def smoke_lines(out_dir):
    rows = read_csv(os.path.join(out_dir, "smoke", "smoke.csv"))
    if not rows:
        return ["smoke: no results (see smoke.log)"]
    bad = [row for row in rows if not row["check"].startswith("ok")]
    dtypes = ", ".join(sorted({row["dtype"] for row in rows}))
    lines = [f"smoke ({dtypes}; remat against float64, at most twice PyTorch's error): "
             f"{len(rows) - len(bad)} of {len(rows)} ok   smoke/smoke.md"]
    lines += [f"  {row['check'].upper()}: {row['dtype']} {row['op'] or row['suite']} {row['shape']} "
              f"{row['implementation']} {row['error']}".rstrip() for row in bad]
    return lines


def _junit_counts(path):
    """(tests, failures + errors, skipped, seconds) of a junit XML, or None."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = lambda key: sum(int(float(s.get(key, 0))) for s in suites)  # noqa: E731
    seconds = sum(float(s.get("time", 0)) for s in suites)
    return total("tests"), total("failures") + total("errors"), total("skipped"), seconds


def _pytest_last_line(path):
    try:
        with open(path, errors="replace") as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError:
        return "no log"
    summary = [line for line in lines if line.startswith("=") and (" passed" in line or " failed" in line
                                                                      or " error" in line or "no tests ran" in line)]
    return (summary or lines or ["empty log"])[-1].strip("= ")


def test_lines(out_dir, steps, groups):
    lines = ["tests on the GPU:"]
    for group in groups:  # a group that ran in the background has its row as background work
        step = steps.get(f"tests: {group}") or steps.get(f"background: tests: {group}")
        status = step["status"].split(";")[0] if step else "not run"  # a background row adds its log's last line
        counts = _junit_counts(os.path.join(out_dir, f"pytest_{group}.xml"))
        if counts is not None:
            tests, failed, skipped, seconds = counts
            result = f"{tests - failed - skipped} passed, {failed} failed, {skipped} skipped in {seconds:.0f} s"
        elif step and step["status"].startswith("skipped"):
            result = ""
        else:
            result = _pytest_last_line(os.path.join(out_dir, f"pytest_{group}.log"))
        lines.append(f"  {group:<10} {status:<26} {result}   pytest_{group}.log".rstrip())
    return lines


def sanitizer_line(out_dir):
    for name in ("memcheck_summary.txt",):
        try:
            with open(os.path.join(out_dir, name)) as handle:
                text = " ".join(handle.read().split())
                return f"sanitizer: {text or 'no output'}   sanitizer_memcheck.log"
        except OSError:
            pass
    return "sanitizer: not run"


def _cases(rows):
    return list(dict.fromkeys((r["op"], r["mode"], r["dtype"], r["shape"]) for r in rows))


def suite_row(out_dir, suite, steps):
    """One line for the suite: its step's status, cases measured of planned, wrong, failed and skipped
    rows (a peer that cannot run a case says why in an error "Skipped: ...": not a failure)."""
    step = steps.get(f"bench: {suite}")
    rows = read_csv(os.path.join(out_dir, "bench", suite, "bench.csv"))
    status = step["status"] if step else "not run"
    planned = rows[0].get("cases_planned", "?") if rows else "?"
    wrong = sum(r["check"] == "wrong" for r in rows)
    untimed = [r for r in rows if r["error"] and r["check"] != "wrong" and r["p50_ms"] == "-"]
    skipped = sum(r["error"].startswith("Skipped:") for r in untimed)
    file = f"bench/{suite}/bench.md" if rows else f"bench/{suite}.log"
    return (f"  {suite:<10} {status:<30} {len(_cases(rows)):>3} of {planned:<3} cases {len(rows):>4} rows "
            f"{wrong:>3} wrong {len(untimed) - skipped:>3} failed {skipped:>3} skipped   {file}")


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _best_peer(rows):
    peers = [r for r in rows if not r["implementation"].startswith("remat") and not math.isnan(_number(r["rate"]))
             and r["p50_ms"] != "-"]
    return max(peers, key=lambda r: _number(r["rate"]), default=None)


def _result(row):
    if row["p50_ms"] == "-":
        return f"not timed: {row['error'][:60]}"
    ratio = _number(row["ratio_to_best_peer"])
    return f"{_number(row['rate']):.4g} {row['unit']}" + ("" if math.isnan(ratio) else f" {ratio:.2f}x")


def _saves(row, suite):
    """What the forward keeps: per layer in s·b·h for the block, else in MiB."""
    per_layer, saved = _number(row.get("saved_sbh_per_layer")), _number(row.get("fwd_saves_bytes"))
    if suite == "block":
        return "-" if math.isnan(per_layer) else f"{per_layer:.3g} sbh/layer"
    return "-" if math.isnan(saved) else f"{saved / 2**20:.4g} MiB"


def headline_lines(out_dir, suites):
    """remat's rows of every case: rate, ratio to the best peer (named), what the forward keeps."""
    lines = ["remat against the best peer (p50; check; what the forward keeps for the backward):"]
    for suite in suites:
        rows = read_csv(os.path.join(out_dir, "bench", suite, "bench.csv"))
        for case in _cases(rows):
            in_case = [r for r in rows if (r["op"], r["mode"], r["dtype"], r["shape"]) == case]
            best = _best_peer(in_case)
            peer = f"best peer {best['implementation']} {_number(best['rate']):.4g}" if best else "no peer timed"
            shown = in_case if suite == "block" else [r for r in in_case if r["implementation"].startswith("remat")]
            for r in shown:
                lines.append(f"  {case[0]:<16} {case[1]:<7} {case[3]:<28} {r['implementation']:<24} "
                             f"{r['check']:<11} {_result(r):<30} saves {_saves(r, suite)}"
                             + ("" if suite == "block" else f"   ({peer})"))
    return lines


def memory_lines(out_dir, step):
    """`remat memory`'s status and the end of its log (its table and the budget's verdict)."""
    lines = [f"memory policies (remat memory, gpt2-medium): {step['status'] if step else 'not run'}"
             "   memory.log, memory/"]
    try:
        with open(os.path.join(out_dir, "memory.log"), errors="replace") as handle:
            lines += ["  " + line.rstrip() for line in handle.readlines()[-12:]]
    except OSError:
        pass
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--suites", nargs="+", default=list(SUITES))
    parser.add_argument("--test-groups", nargs="+", default=["triton", "cuda", "rest", "exhaustive"])
    parser.add_argument("--budget", type=int, default=380)
    parser.add_argument("--elapsed", type=int, help="seconds the run took so far")
    parser.add_argument("--running", metavar="STEP", help="the run goes on: STEP is the last one that ended")
    parser.add_argument("--modelled", action="store_true", help="the seconds are modelled ones (the dry run)")
    args = parser.parse_args(argv)
    steps = read_steps(args.out_dir)
    spent = f"{args.elapsed} s" if args.elapsed is not None else "?"
    state = f"; still running, last step ended: {args.running}" if args.running else ""
    modelled = " (modelled seconds: a dry run)" if args.modelled else ""
    out = [f"== summary: {spent} of the {args.budget} s budget{modelled}{state}",
           f"tags: {tags(args.out_dir, args.suites)}", "steps:"]
    out += [_step_line(name, step) for name, step in steps.items()]
    out += smoke_lines(args.out_dir)
    out += test_lines(args.out_dir, steps, args.test_groups)
    out.append(sanitizer_line(args.out_dir))
    out.append("benchmarks (bf16, --quick; each suite its own step):")
    out += [suite_row(args.out_dir, suite, steps) for suite in args.suites]
    out += headline_lines(args.out_dir, args.suites)
    out += memory_lines(args.out_dir, steps.get("memory"))
    out.append(f"files, in {os.path.basename(os.path.abspath(args.out_dir))}/ (gpu_check.tar.gz holds it): steps.tsv, "
               "run.txt, console.log, environment.txt, backends.txt, build.log, smoke/smoke.{csv,md}, "
               "pytest_<group>.{log,xml}, sanitizer_memcheck.log, bench/<suite>/bench.{csv,md} and PNGs, "
               "bench_<suite>.log, autotune/ (tuned attention blocks, failed candidates), memory/, warm_*.log")
    print("\n".join(out))


if __name__ == "__main__":
    main()
