"""What a newcomer meets first says what is true: the example output the docs quote is what the example
prints (docs/conversion.md), the main job's GPT-2 table they quote is what it counts (docs/benchmarking.md),
the backends say what they do on this machine, and a conversion that changes nothing says why."""

import importlib.util
import os
import re
import warnings

import pytest
import torch

import remat
from remat.convert import RematWarning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSS_ROW = re.compile(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s", re.MULTILINE)
MEMORY = re.compile(r"(torch|remat):.*?([\d.]+) KiB saved activations/step")


def _read(doc):
    with open(os.path.join(ROOT, doc)) as handle:
        return handle.read()


def _quoted_example_output():
    """The output block docs/conversion.md shows under `python examples/train_gpt2.py`."""
    text = _read(os.path.join("docs", "conversion.md"))
    after = text[text.index("`python examples/train_gpt2.py` trains"):]
    return after.split("```")[1]


def test_the_docs_show_what_the_example_prints(monkeypatch, capsys):
    """The figures docs/conversion.md quotes (the loss of each step it shows, the saved KiB of each run)
    are the example's, run as it says: on CPU, without TRITON_INTERPRET (the kernels' reference)."""
    pytest.importorskip("transformers", minversion="5.25")
    quoted = _quoted_example_output()
    spec = importlib.util.spec_from_file_location("train_gpt2", os.path.join(ROOT, "examples", "train_gpt2.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at each call: CPU tensors run the reference, as the docs say
    monkeypatch.setattr("sys.argv", ["train_gpt2.py", "--device", "cpu"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        example.main()
    printed = capsys.readouterr().out
    losses = {step: (a, b) for step, a, b in LOSS_ROW.findall(printed)}
    shown = LOSS_ROW.findall(quoted)
    assert len(shown) >= 3 and all(losses[step] == (a, b) for step, a, b in shown), (shown, losses)
    assert dict(MEMORY.findall(quoted)) == dict(MEMORY.findall(printed)), printed


def test_backends_say_what_they_do_on_this_machine():
    found = remat.backends()
    if torch.cuda.is_available():
        assert torch.cuda.get_device_name() in found["triton"][1]
        return
    assert found["triton"][1].endswith("no GPU here: runs only CPU tensors, through the interpreter "
                                       "(TRITON_INTERPRET=1)") or not found["triton"][0]
    assert found["cuda"][1].endswith("no GPU here, so it runs nothing") or not found["cuda"][0]
    assert "REMAT_BUILD_CUDA=1" in found["cuda"][1] or found["cuda"][0]


def test_a_conversion_that_finds_nothing_to_fuse_says_what_remat_fuses():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    with pytest.warns(RematWarning) as caught:
        _, report = remat.convert(model, report=True)
    assert len(report) == 0  # no module was a candidate: the report has nothing to say why
    message = str(caught[0].message)
    assert "found none of the modules remat fuses" in message and "nn.LayerNorm" in message
    assert "report=True" not in message


def test_the_docs_show_the_gpt2_table_the_main_job_prints(tmp_path, monkeypatch):
    """The main job's GPT-2 small table in docs/benchmarking.md is what `remat memory` counts and predicts
    today (with the H200's data-sheet constants: no calibration cache of this machine's)."""
    pytest.importorskip("transformers", minversion="5.25")
    from remat import memory

    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    text = _read(os.path.join("docs", "benchmarking.md"))
    quoted = text[text.index("GPT-2 small's table:"):].split("```")[1].strip("\n").splitlines()
    counted, rows = memory.count("hf-gpt2-small", 8, 1024, gpu="H200")
    assert quoted[1:] == [memory._row_text(r, rows[0].predicted_ms, on_gpu=False) for r in rows]
