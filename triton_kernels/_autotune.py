"""Autotuning of kernel launch configurations: time the candidates on first use, keep the fastest.

A Tuner maps string keys (everything the best configuration depends on: kernel, head dim, dtype,
GPU, a size class, ...) to configurations (tuples of ints). The first call for a key times every
candidate on the caller's real inputs and keeps the fastest; the choice is remembered in memory
and persisted as plain JSON, so later processes skip the timing. The file lives in

    $REMAT_CACHE_DIR, else $XDG_CACHE_HOME/remat, else ~/.cache/remat

REMAT_AUTOTUNE=0 turns tuning off: callers then use their fixed tables.

Robustness:
- A cache file that cannot be read or parsed is ignored with a warning; the next write replaces it.
- Writes go to a temporary file in the same folder, then os.replace: a reader never sees half a
  file. Several processes may tune at once: each merges what the file holds before writing, and
  the last writer wins for a key they both tuned (either answer is a timed best).
- A remembered configuration that is no longer among the candidates (the kernel's table changed)
  is ignored and tuned again.
- A candidate that raises one of the tuner's skip_errors (it fails to compile or to run here) is
  skipped and recorded: a warning, Tuner.failures, and the file's "failed" section. When the
  failure leaves the CUDA context unusable (an illegal memory access), the error is raised at
  once: every later launch in this process would fail too (a benchmark runs each suite in a
  process of its own, so the next suite starts clean).
"""

import functools
import json
import os
import statistics
import tempfile
import time
import warnings

_FORMAT = 1  # the layout of the JSON file: {"format": 1, "entries": {key: [int, ...]}}


def enabled() -> bool:
    """False when REMAT_AUTOTUNE is 0 (or false/off/no): use the fixed configurations."""
    return os.environ.get("REMAT_AUTOTUNE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> str:
    """The folder of the tuning caches (see the module docstring)."""
    explicit = os.environ.get("REMAT_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "remat")


def cuda_time_ms(fn, min_reps=3, max_reps=20, budget_ms=40.0):
    """Median wall time of fn() on the current CUDA stream, in milliseconds.

    One untimed call first (it compiles the kernel), then at least min_reps timed calls, more
    while the total stays under budget_ms, so a slow candidate costs a few runs, not dozens.
    """
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    while len(times) < max_reps and (len(times) < min_reps or sum(times) < budget_ms):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_context_usable() -> bool:
    """False when the CUDA context is broken (a sticky error such as an illegal memory access):
    synchronizing raises then. True when CUDA has not been used in this process."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return True
    try:
        torch.cuda.synchronize()
    except Exception:  # torch.AcceleratorError, a RuntimeError in older torch
        return False
    return True


def _parse(text):
    """{key: config} from the file's text; ValueError when it is not a cache file of this format."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("entries"), dict):
        raise ValueError(f"not a format-{_FORMAT} tuning cache")
    entries = {}
    for key, config in data["entries"].items():
        if isinstance(config, list) and config and all(isinstance(v, int) and not isinstance(v, bool) for v in config):
            entries[key] = tuple(config)
    return entries


class Tuner:
    """Chooses, per key, the fastest of a list of candidate configurations.

    filename: the JSON file's name inside cache_dir() (read at each load, so REMAT_CACHE_DIR may
    change between calls). timer(fn) -> milliseconds measures one candidate; tests inject a fake.
    skip_errors: exceptions that rule a candidate out (e.g. too much shared memory on this GPU, a
    compiler error) instead of propagating; each is recorded in failures ({key: {config: error}}).
    usable() -> bool says whether the process can still launch after a failure (tests inject a fake).
    """

    def __init__(self, filename, timer=cuda_time_ms, skip_errors=(), usable=cuda_context_usable):
        self.filename = filename
        self.timer = timer
        self.skip_errors = tuple(skip_errors)
        self.usable = usable
        self.failures = {}
        self._memory = {}  # path -> {key: config}
        self._warned = set()

    def path(self) -> str:
        return os.path.join(cache_dir(), self.filename)

    def best(self, key, candidates, run, may_time=True):
        """The configuration to launch for key.

        candidates: tuples of ints, the default (fixed-table) one first. run(config) launches the
        kernel with config and must write only buffers the caller rewrites afterwards. Known keys
        (in memory or in the file) cost nothing; an unknown key is timed now, unless may_time is
        False (inside a trace or a CUDA graph capture), which gives the first candidate and
        remembers nothing.
        """
        candidates = [tuple(c) for c in candidates]
        entries = self._entries()
        known = entries.get(key)
        if known in candidates:
            return known
        if not may_time:
            return candidates[0]
        chosen = self._fastest(key, candidates, run)
        entries[key] = chosen
        self._persist(key, chosen)
        return chosen

    def _fastest(self, key, candidates, run):
        timings, first_error = [], None
        for config in candidates:
            try:
                timings.append((self.timer(functools.partial(run, config)), config))
            except self.skip_errors as error:  # this candidate cannot compile or run here; the others may
                first_error = first_error or error
                self._record_failure(key, config, error)
                if not self.usable():
                    raise
        if not timings:
            raise first_error
        # Ties go to the earlier candidate (the default first): min keeps the first of equals.
        return min(timings, key=lambda pair: pair[0])[1]

    def _record_failure(self, key, config, error):
        message = f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]
        self.failures.setdefault(key, {})[config] = message
        self._warn_once(f"candidate {config} of {key} skipped: {message}")

    def _entries(self):
        path = self.path()
        if path not in self._memory:
            self._memory[path] = self._read(path, quiet=False)
        return self._memory[path]

    def _read(self, path, quiet):
        try:
            with open(path, encoding="utf-8") as f:
                return _parse(f.read())
        except (FileNotFoundError, NotADirectoryError):  # nothing tuned yet (or no folder)
            return {}
        except (OSError, ValueError, UnicodeDecodeError) as error:
            if not quiet:
                self._warn_once(f"ignoring the unreadable tuning cache {path} ({error}); it will be rewritten")
            return {}

    def _persist(self, key, config):
        path = self.path()
        entries = self._read(path, quiet=True)  # what other processes added since we loaded
        entries.update(self._memory[path])
        entries[key] = config
        failed = self._failed_to_write(path)
        folder = os.path.dirname(path) or "."
        try:
            os.makedirs(folder, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"format": _FORMAT, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "entries": {k: list(v) for k, v in sorted(entries.items())},
                               **({"failed": dict(sorted(failed.items()))} if failed else {})}, f, indent=1)
                os.replace(temp, path)
            except BaseException:
                os.unlink(temp)
                raise
        except OSError as error:  # a read-only home, a full disk: tuning still works, in memory
            self._warn_once(f"could not write the tuning cache {path} ({error}); keeping the results in memory")

    def _failed_to_write(self, path):
        """The failed candidates the file will hold: those it holds (other processes'), and this tuner's."""
        failed = self._read_failed(path)
        for key, configs in self.failures.items():
            failed[key] = {",".join(map(str, config)): message for config, message in configs.items()}
        return failed

    @staticmethod
    def _read_failed(path):
        """The file's record of failed candidates ({key: {"128,64,8,3": error}}), {} if none or unreadable."""
        try:
            with open(path, encoding="utf-8") as f:
                failed = json.load(f).get("failed", {})
        except (OSError, ValueError, UnicodeDecodeError, AttributeError):
            return {}
        return failed if isinstance(failed, dict) else {}

    def _warn_once(self, message):
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(f"remat autotune: {message}", stacklevel=4)
