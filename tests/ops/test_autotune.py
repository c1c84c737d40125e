"""Autotuning: the tuner (fastest candidate, JSON cache, robustness) and how attention uses it.

Timing needs a GPU; here a fake timer stands in, so every decision path runs on CPU. A GPU test
checks that tuning leaves the results unchanged.
"""

import json
import os

import pytest
import torch
import triton

import remat
from remat.ops.attention import attention_ref
from remat.triton_kernels import _autotune
from remat.triton_kernels import attention as kernels

from numerics import REL_TOL, rel_error

HAS_GPU = torch.cuda.is_available()
ATTENTION_SKIP_ERRORS = kernels._TUNER.skip_errors  # attention's own tuner's, before a test replaces it


class FakeTimer:
    """Milliseconds per configuration from a table; records what it timed, in order."""

    def __init__(self, times, default=5.0):
        self.times, self.default, self.timed = times, default, []
        self.current = None

    def __call__(self, fn):
        fn()  # the tuner's run(config) records self.current
        self.timed.append(self.current)
        return self.times.get(self.current, self.default)

    def run(self, config):
        self.current = config


def refuse_timer(fn):
    raise AssertionError("nothing should be timed here")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("REMAT_AUTOTUNE", raising=False)
    return tmp_path


CANDIDATES = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]


def test_picks_the_fastest_candidate(cache_dir):
    timer = FakeTimer({(128, 64, 8, 3): 3.0, (64, 64, 4, 3): 1.5, (128, 128, 8, 2): 2.0})
    tuner = _autotune.Tuner("t.json", timer=timer)
    assert tuner.best("k", CANDIDATES, timer.run) == (64, 64, 4, 3)
    assert timer.timed == CANDIDATES  # each once, in order
    assert tuner.best("k", CANDIDATES, timer.run) == (64, 64, 4, 3)
    assert len(timer.timed) == 3  # known now: not timed again


def test_ties_keep_the_default(cache_dir):
    timer = FakeTimer({}, default=1.0)
    assert _autotune.Tuner("t.json", timer=timer).best("k", CANDIDATES, timer.run) == CANDIDATES[0]


def test_candidates_that_cannot_run_are_skipped(cache_dir):
    class TooBig(Exception):
        pass

    def run(config):
        if config != (128, 128, 8, 2):
            raise TooBig(config)

    tuner = _autotune.Tuner("t.json", timer=lambda fn: fn() or 1.0, skip_errors=(TooBig,))
    with pytest.warns(UserWarning, match="skipped: TooBig"):
        assert tuner.best("k", CANDIDATES, run) == (128, 128, 8, 2)
    with pytest.raises(TooBig), pytest.warns(UserWarning):  # none runs: the error surfaces
        tuner.best("other", CANDIDATES[:2], run)
    with pytest.raises(ValueError):  # not a skip error: propagates at once
        _autotune.Tuner("u.json", timer=lambda fn: fn()).best("k", CANDIDATES, lambda c: int("x"))


def _failing_first(timer, error):
    """A run(config) that raises `error` for the first candidate and records the others in timer."""
    def run(config):
        if config == CANDIDATES[0]:
            raise error
        timer.run(config)

    return run


def test_a_candidate_that_fails_to_compile_or_run_is_skipped_and_recorded(cache_dir):
    timer = FakeTimer({(64, 64, 4, 3): 2.0, (128, 128, 8, 2): 1.0})
    tuner = _autotune.Tuner("t.json", timer=timer, skip_errors=(Exception,), usable=lambda: True)
    with pytest.warns(UserWarning, match=r"candidate \(128, 64, 8, 3\) of k skipped: RuntimeError: ptxas failed"):
        assert tuner.best("k", CANDIDATES, _failing_first(timer, RuntimeError("ptxas failed\n  at line 3"))) == (
            128, 128, 8, 2)
    assert timer.timed == CANDIDATES[1:]
    assert tuner.failures == {"k": {CANDIDATES[0]: "RuntimeError: ptxas failed at line 3"}}
    data = json.loads((cache_dir / "t.json").read_text())
    assert data["entries"] == {"k": [128, 128, 8, 2]}
    assert data["failed"] == {"k": {"128,64,8,3": "RuntimeError: ptxas failed at line 3"}}
    # another process's tuner keeps that record when it writes its own key
    other = FakeTimer({})
    another = _autotune.Tuner("t.json", timer=other, skip_errors=(Exception,), usable=lambda: True)
    another.best("j", CANDIDATES, other.run)
    data = json.loads((cache_dir / "t.json").read_text())
    assert sorted(data["entries"]) == ["j", "k"] and list(data["failed"]) == ["k"]


def test_a_failure_that_breaks_the_cuda_context_is_raised_at_once(cache_dir):
    """After an illegal memory access every launch in the process fails: the later candidates are not
    tried (they would all be recorded as failing), and nothing is remembered."""
    timer = FakeTimer({})
    tuner = _autotune.Tuner("t.json", timer=timer, skip_errors=(Exception,), usable=lambda: False)
    with pytest.warns(UserWarning, match="skipped"), pytest.raises(RuntimeError, match="illegal memory access"):
        tuner.best("k", CANDIDATES, _failing_first(timer, RuntimeError("CUDA error: an illegal memory access")))
    assert timer.timed == [] and not (cache_dir / "t.json").exists()


def test_cache_round_trip_through_json(cache_dir):
    timer = FakeTimer({(128, 128, 8, 2): 0.5})
    _autotune.Tuner("t.json", timer=timer).best("fwd|a", CANDIDATES, timer.run)
    data = json.loads((cache_dir / "t.json").read_text())
    assert data["format"] == 1 and data["entries"] == {"fwd|a": [128, 128, 8, 2]}
    fresh = _autotune.Tuner("t.json", timer=refuse_timer)  # a new process: reads the file
    assert fresh.best("fwd|a", CANDIDATES, timer.run) == (128, 128, 8, 2)
    assert [p.name for p in cache_dir.iterdir()] == ["t.json"]  # no temporary file left behind


def test_writers_merge_what_the_file_holds(cache_dir):
    timer = FakeTimer({})
    first, second = (_autotune.Tuner("t.json", timer=timer) for _ in range(2))
    first.best("a", CANDIDATES, timer.run)
    second.best("b", CANDIDATES, timer.run)  # loaded after "a" was written
    first.best("c", CANDIDATES, timer.run)  # its memory lacks "b": the file keeps it anyway
    entries = json.loads((cache_dir / "t.json").read_text())["entries"]
    assert sorted(entries) == ["a", "b", "c"]


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00", b"[1, 2]", b'{"format": 99, "entries": {}}'])
def test_corrupt_cache_is_ignored_with_a_warning_and_replaced(cache_dir, content):
    (cache_dir / "t.json").write_bytes(content)
    timer = FakeTimer({(64, 64, 4, 3): 1.0})
    tuner = _autotune.Tuner("t.json", timer=timer)
    with pytest.warns(UserWarning, match="unreadable tuning cache"):
        assert tuner.best("k", CANDIDATES, timer.run) == (64, 64, 4, 3)
    assert json.loads((cache_dir / "t.json").read_text())["entries"] == {"k": [64, 64, 4, 3]}


def test_malformed_entries_and_stale_configs_are_tuned_again(cache_dir):
    (cache_dir / "t.json").write_text(json.dumps({"format": 1, "entries": {
        "bad": ["x", 1], "stale": [32, 32, 4, 1], "good": [128, 128, 8, 2]}}))
    timer = FakeTimer({(64, 64, 4, 3): 1.0})
    tuner = _autotune.Tuner("t.json", timer=timer)
    assert tuner.best("good", CANDIDATES, timer.run) == (128, 128, 8, 2) and timer.timed == []
    assert tuner.best("bad", CANDIDATES, timer.run) == (64, 64, 4, 3)
    assert tuner.best("stale", CANDIDATES, timer.run) == (64, 64, 4, 3)  # no longer a candidate


def test_unwritable_cache_warns_and_keeps_results_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("REMAT_CACHE_DIR", str(blocker / "sub"))  # a folder under a file
    timer = FakeTimer({(64, 64, 4, 3): 1.0})
    tuner = _autotune.Tuner("t.json", timer=timer)
    with pytest.warns(UserWarning, match="could not write"):
        assert tuner.best("k", CANDIDATES, timer.run) == (64, 64, 4, 3)
    assert tuner.best("k", CANDIDATES, timer.run) == (64, 64, 4, 3) and len(timer.timed) == 3


def test_no_timing_when_not_allowed(cache_dir):
    tuner = _autotune.Tuner("t.json", timer=refuse_timer)
    assert tuner.best("k", CANDIDATES, lambda c: None, may_time=False) == CANDIDATES[0]
    assert not (cache_dir / "t.json").exists()


def test_cache_folder_and_switch_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("REMAT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _autotune.cache_dir() == os.path.join(str(tmp_path), "remat")
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "mine"))
    assert _autotune.cache_dir() == str(tmp_path / "mine")
    for value, on in [("0", False), ("off", False), ("1", True), ("", True)]:
        monkeypatch.setenv("REMAT_AUTOTUNE", value)
        assert _autotune.enabled() is on
    monkeypatch.delenv("REMAT_AUTOTUNE")
    assert _autotune.enabled()


# --- attention ----------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(cache_dir, monkeypatch):
    """Attention's tuner with a fake timer, on a stand-in GPU: returns the timer."""
    timer = FakeTimer({})
    monkeypatch.setattr(kernels, "_TUNER", _autotune.Tuner("attention-autotune.json", timer=timer))
    monkeypatch.setattr(kernels, "_gpu_signature", lambda device: "Fake GPU sm_90")
    return timer


def _choose(timer, kind="fwd", head_dim=64, dtype=torch.float16, causal=True, seqlens=(1000, 1000),
            device="cuda", may_time=True):
    return kernels._config_for(kind, head_dim, dtype, causal, *seqlens, torch.device(device), may_time, timer.run)


@pytest.mark.parametrize("kind", kernels.KINDS)
def test_attention_takes_the_fastest_candidate_and_persists_it(fake_gpu, kind):
    options = kernels.candidates(kind, 64, torch.float16, hopper=True, causal=True)  # as on "Fake GPU sm_90"
    fake_gpu.times = {options[-1]: 0.1}
    assert _choose(fake_gpu, kind) == options[-1]
    assert fake_gpu.timed == options
    entries = json.loads(_cache_file().read_text())["entries"]
    (key,) = entries
    assert key.startswith(f"{kind}|d64|causal|float16|Fake GPU sm_90|s1024|triton-")
    assert entries[key] == list(options[-1])


def _cache_file():
    from pathlib import Path

    return Path(os.environ["REMAT_CACHE_DIR"]) / "attention-autotune.json"


def test_attention_skips_any_candidate_that_fails(fake_gpu, monkeypatch):
    """Attention's own tuner: a candidate whose compile or launch fails (any error, not only too much
    shared memory) is skipped; Ctrl-C is not swallowed."""
    timer = fake_gpu
    tuner = _autotune.Tuner("attention-autotune.json", timer=timer, skip_errors=ATTENTION_SKIP_ERRORS,
                            usable=lambda: True)
    monkeypatch.setattr(kernels, "_TUNER", tuner)
    options = kernels.candidates("fwd", 64, torch.float16, hopper=True, causal=True)

    def run(config):
        if config == options[0]:
            raise triton.compiler.errors.CompilationError("src", None, "unsupported layout")
        timer.run(config)

    with pytest.warns(UserWarning, match="CompilationError"):
        assert kernels._config_for("fwd", 64, torch.float16, True, 1000, 1000, torch.device("cuda"), True, run) \
            in options[1:]
    (failed,) = tuner.failures.values()
    assert list(failed) == [options[0]] and failed[options[0]].startswith("CompilationError")

    def interrupted(config):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kernels._config_for("dq", 64, torch.float16, True, 1000, 1000, torch.device("cuda"), True, interrupted)


def test_attention_key_separates_gpus_and_problem_classes(fake_gpu, monkeypatch):
    _choose(fake_gpu)
    assert len(fake_gpu.timed) > 0
    timed = len(fake_gpu.timed)
    _choose(fake_gpu, seqlens=(900, 1000))  # the same length class: no new timing
    assert len(fake_gpu.timed) == timed
    monkeypatch.setattr(kernels, "_gpu_signature", lambda device: "Other GPU sm_80")
    _choose(fake_gpu)
    _choose(fake_gpu, causal=False)
    _choose(fake_gpu, dtype=torch.bfloat16)
    _choose(fake_gpu, head_dim=80)
    _choose(fake_gpu, seqlens=(4000, 4000))
    keys = json.loads(_cache_file().read_text())["entries"]
    assert len(keys) == 6 and sum("Other GPU sm_80" in key for key in keys) == 5


def test_attention_fixed_table_without_tuning(fake_gpu, monkeypatch):
    fake_gpu.times = {kernels.candidates("dq", 128, torch.float32)[-1]: 0.1}
    monkeypatch.setenv("REMAT_AUTOTUNE", "0")
    assert _choose(fake_gpu, "dq", 128, torch.float32) == kernels._FP32_CONFIGS["dq"][128]
    monkeypatch.delenv("REMAT_AUTOTUNE")
    assert _choose(fake_gpu, "dq", 128, torch.float32, may_time=False) == kernels._FP32_CONFIGS["dq"][128]
    assert _choose(fake_gpu, "dq", 128, torch.float32, device="cpu") == kernels._INTERPRETER_CONFIG
    assert fake_gpu.timed == [] and not _cache_file().exists()


def test_no_timing_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert kernels._may_time(torch.empty(2))
    with FakeTensorMode():
        fake = torch.empty(2, 3)
    assert not kernels._may_time(fake)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", kernels.HEAD_DIMS)
def test_candidate_lists(head_dim, dtype):
    half = dtype != torch.float32
    for kind in kernels.KINDS:
        options = kernels.candidates(kind, head_dim, dtype)
        table = (kernels._HALF_CONFIGS if half else kernels._FP32_CONFIGS)[kind][kernels.padded_head_dim(head_dim)]
        assert options[0] == table and len(set(options)) == len(options) >= 2
        for block_m, block_n, warps, stages in options:
            assert block_m >= 16 and block_n >= 16 and warps in (4, 8) and stages >= 1


@pytest.mark.skipif(not HAS_GPU, reason="timing needs a GPU")
def test_tuning_on_a_gpu_leaves_results_unchanged(cache_dir, monkeypatch):
    """The first call times every candidate (writing the launcher's scratch outputs) and must
    return what a later, cached call returns, bit for bit; the file then names this GPU."""
    monkeypatch.setattr(kernels, "_TUNER", _autotune.Tuner("attention-autotune.json",
                                                           skip_errors=kernels._TUNER.skip_errors))
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def run():
        o = remat.ops.attention.attention(q, k, v, causal=True)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    entries = json.loads(_cache_file().read_text())["entries"]
    assert sorted(key.split("|")[0] for key in entries) == ["dkdv", "dq", "fwd"]
    assert all(torch.cuda.get_device_name() in key for key in entries)


@pytest.mark.skipif(not HAS_GPU, reason="the candidates other than the interpreter's run on a GPU only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_every_candidate_matches_the_reference(monkeypatch, head_dim, dtype):
    """Each autotuning candidate, forced in turn for all three kernels: forward and gradients
    against float64 (ragged lengths, causal, GQA), so tuning can only change the speed."""
    q = torch.randn(2, 4, 150, head_dim, device="cuda").to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 173, head_dim, device="cuda").to(dtype).requires_grad_() for _ in range(2))
    do = torch.randn(q.shape, device="cuda").to(dtype)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, _ = attention_ref(*leaves, causal=True)
    ref = (ref_o, *torch.autograd.grad(ref_o, leaves, do.double()))
    hopper = torch.cuda.get_device_capability() == (9, 0)
    options = {kind: kernels.candidates(kind, head_dim, dtype, hopper) for kind in kernels.KINDS}
    for index in range(max(len(o) for o in options.values())):
        chosen = {kind: o[min(index, len(o) - 1)] for kind, o in options.items()}
        monkeypatch.setattr(kernels, "_select_config", lambda kind, q, k, causal, run, chosen=chosen: chosen[kind])
        o = remat.ops.attention.attention(q, k, v, causal=True)
        ours = (o, *torch.autograd.grad(o, (q, k, v), do))
        for name, got, want in zip(("o", "dq", "dk", "dv"), ours, ref):
            assert rel_error(got, want) <= REL_TOL[dtype], f"{name} with {chosen}: {rel_error(got, want):.3g}"


def test_hopper_only_candidates_are_timed_on_sm_90_only(fake_gpu, monkeypatch):
    hopper_only = kernels._HOPPER_HALF_CANDIDATES["fwd"][128]
    _choose(fake_gpu, "fwd", 128, torch.bfloat16)  # "Fake GPU sm_90"
    assert set(hopper_only) <= set(fake_gpu.timed)
    fake_gpu.timed.clear()
    monkeypatch.setattr(kernels, "_gpu_signature", lambda device: "Other GPU sm_80")
    _choose(fake_gpu, "fwd", 128, torch.bfloat16)
    assert fake_gpu.timed and not set(hopper_only) & set(fake_gpu.timed)
