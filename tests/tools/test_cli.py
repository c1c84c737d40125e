"""The `remat` command runs end to end on any machine and writes what it says it writes."""

import csv
import json

import pytest
import torch

from remat.cli import main
from remat.memory import cheapest_fitting, model_names
from remat.memory import run as memory_run


def test_bench_on_cpu_says_functional_checks_every_row_and_counts_memory_exactly(tmp_path, capsys):
    main(["bench", "layernorm", "--device", "cpu", "--dtype", "fp32", "--shapes", "33",
          "--no-progress", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "timings are functional, not performance" in printed and "functional run on CPU" in printed
    assert "vs best peer" not in printed and "rate" not in printed.split("\nop ")[1].splitlines()[0]
    with open(tmp_path / "bench.csv") as handle:
        rows = list(csv.DictReader(handle))
    implementations = {row["implementation"] for row in rows}
    assert {"torch", "torch.compile"} <= implementations and any(i.startswith("remat") for i in implementations)
    assert all(not row["error"] and float(row["p50_ms"]) > 0 for row in rows), rows
    assert all(row["check"].startswith("ok (") for row in rows), rows
    assert all(row["ratio_to_best_peer"] == "-" for row in rows)  # no peer ratios from CPU timings
    # Exact, on any device: each LayerNorm keeps fp32 mean and rstd per row (256 rows) beyond
    # its input, weights and output.
    assert all(row["fwd_saves_bytes"] == str(256 * 8) for row in rows), [row["fwd_saves_bytes"] for row in rows]
    assert all(row["torch"] and row["commit"] and row["device"].startswith("CPU") for row in rows)
    assert int(rows[0]["cases_planned"]) == 2
    markdown = (tmp_path / "bench.md").read_text()
    assert markdown.startswith("# remat benchmark") and "> CPU run: timings are functional" in markdown
    assert not list(tmp_path.glob("*.png"))  # no rate plots of CPU timings, and it says so
    assert "no plots (CPU timings are not performance)" in printed


def test_bench_commit_tag_from_the_environment(monkeypatch):
    """A copy of the tree without its git folder (a GPU machine's) still tags the results."""
    from remat.bench import report

    monkeypatch.setenv("REMAT_COMMIT", "abc1234")
    assert report.environment(torch.device("cpu"))["commit"] == "abc1234"
    monkeypatch.delenv("REMAT_COMMIT")
    assert report.environment(torch.device("cpu"))["commit"] not in ("", "abc1234")


def test_memory_counts_every_policy(tmp_path, capsys):
    results = memory_run("tiny", batch=2, seq=16, budget_gb=1.0, out_dir=str(tmp_path), device="meta")
    by_name = {r.policy.split(":")[0]: r for r in results}
    # Per layer in bf16: eager keeps 32·sbh, remat 20·sbh, a checkpointed block its input (2·sbh);
    # the stack's input belongs to the caller, so each figure is 2/L·sbh lower, plus statistics.
    layers = 4
    assert 32 - 2 / layers <= by_name["eager"].per_layer_sbh < 32
    assert 20 - 2 / layers <= by_name["remat"].per_layer_sbh < 20
    assert by_name["full checkpoint"].per_layer_sbh == pytest.approx(2 * (layers - 1) / layers)
    assert by_name["offload to host"].saved_bytes == 0 and by_name["offload to host"].host_bytes > 0
    # selective: inputs as full checkpoint, plus the outputs of the matmuls (qkv 6, out 2,
    # fc1 8, fc2 2) and of attention (2, and its fp32 logsumexp: 4·heads/hidden = 1/8), and a GPU
    # flash attention's seed and offset (24 bytes a layer, over s·b·h = 2048)
    assert by_name["selective checkpoint"].per_layer_sbh == pytest.approx(2 * (layers - 1) / layers + 20 + 1 / 8
                                                                          + 24 / 2048)
    assert cheapest_fitting(results, 1.0).policy == "eager"  # everything fits: the fastest predicted
    printed = capsys.readouterr().out
    assert "budget 1.0 GB: use 'eager'" in printed
    assert "remat plan, 1.0 GB kept for the backward: 4 stock (" in printed  # the planner's solver too
    with open(tmp_path / "memory_tiny.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["policy"] for row in rows] == [r.policy for r in results]
    assert rows[0]["choices"] == "stock stock stock stock" and float(rows[0]["predicted_ms"]) > 0
    assert (tmp_path / "memory_tiny.png").stat().st_size > 0


def _write_config(folder, **fields):
    folder.mkdir(parents=True)
    path = folder / "config.json"
    path.write_text(json.dumps(fields))
    return path


def test_memory_of_a_config_path_names_its_files_after_the_folder(tmp_path, monkeypatch):
    """`remat memory --model some/dir/config.json`: the CSV and plot are memory_dir.*, not a name
    built from the path (which named a folder that does not exist)."""
    pytest.importorskip("transformers", minversion="5.25")
    _write_config(tmp_path / "some" / "dir", model_type="gpt2", n_embd=32, n_layer=2, n_head=2, vocab_size=101,
                  n_positions=64)
    monkeypatch.chdir(tmp_path)
    main(["memory", "--model", "some/dir/config.json", "--batch", "2", "--seq", "16", "--dtype", "fp32",
          "--device", "cpu", "--out", "out"])
    with open(tmp_path / "out" / "memory_dir.csv") as handle:
        rows = {row["policy"]: row for row in csv.DictReader(handle)}
    # GPT-2 is a causal LM: its loss head counted, stock and fused. On CPU tensors: no offloading, no plans.
    assert list(rows) == ["eager", "remat", "remat + fused loss", "selective checkpoint", "full checkpoint"]
    assert not any(row["error"] for row in rows.values())
    assert float(rows["remat"]["saved_bytes"]) > float(rows["remat + fused loss"]["saved_bytes"])
    assert float(rows["eager"]["saved_bytes"]) > float(rows["remat"]["saved_bytes"]) > 0


@pytest.mark.parametrize("model", ["gpt2-smal", "no/such/config.json"])
def test_memory_with_an_unknown_model_is_a_one_line_error_listing_the_names(model, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["memory", "--model", model])
    assert stopped.value.code == 2
    printed = capsys.readouterr().err
    assert "Traceback" not in printed
    message = printed.strip().splitlines()[-1]
    assert message.startswith("remat memory: error: argument --model: model must be one of") and repr(model) in message
    assert all(name in message for name in model_names())


def test_memory_with_a_config_that_is_not_one_is_a_one_line_error(tmp_path, capsys):
    config = _write_config(tmp_path / "model", hidden_size=32)
    with pytest.raises(SystemExit) as stopped:
        main(["memory", "--model", str(config)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        'has no "model_type": it must be a Hugging Face config.json')


def test_bench_without_op_names_means_all():
    """`remat bench --quick` (the README's main job) parses: no op named is every op."""
    from remat.cli import parser

    assert parser().parse_args(["bench", "--quick"]).ops == []
    assert parser().parse_args(["bench", "gelu", "all"]).ops == ["gelu", "all"]
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "softmax"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a GPU")
def test_memory_timed_on_a_gpu_that_is_not_there_is_a_one_line_error():
    with pytest.raises(SystemExit) as stopped:
        main(["memory", "--model", "tiny", "--device", "cuda"])
    assert stopped.value.code.startswith("remat memory: --device cuda: torch sees no GPU here")


# --- The same arguments in remat memory and remat plan --------------------------------------------


def _tiny_bert(folder):
    """A BERT config.json with 32 positions: remat memory's default seq (1024) is more."""
    return _write_config(folder, model_type="bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, vocab_size=101, max_position_embeddings=32)


def test_the_default_seq_is_cut_to_the_model_s_positions_and_said(tmp_path, capsys):
    """bert-base has 512 positions: counted at 1024 by default, its position embeddings had no row for
    most tokens. The default is cut to the model's maximum and stderr says so; a seq asked for beyond it
    is a one-line error."""
    from remat.memory import shape

    pytest.importorskip("transformers", minversion="5.25")
    batch, seq, note = shape("bert-base")
    assert (batch, seq) == (8, 512) and "seq 512" in note and "1024" in note
    assert shape("llama-3-8b") == (1, 8192, None) and shape("bert-base", 2, 128) == (2, 128, None)
    config = str(_tiny_bert(tmp_path / "bert"))
    main(["memory", "--model", config, "--batch", "2", "--device", "meta", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr()
    assert "seq 32, the most its config's max_position_embeddings allows" in printed.err
    assert "batch 2 x seq 32" in printed.out
    main(["plan", "--model", config, "--batch", "2", "--budget", "1GiB"])
    printed = capsys.readouterr()
    assert "remat plan: " in printed.err and "batch 2, seq 32" in printed.out
    with pytest.raises(SystemExit, match="seq 64 is more than the 32 positions"):
        main(["plan", "--model", config, "--seq", "64", "--budget", "1GiB"])


def test_both_commands_take_the_same_budget_gpu_and_shape_arguments():
    from remat.cli import parser
    from remat.planner.command import model_shape

    for command in ("memory", "plan"):
        for text in ("4GiB", "500MB", str(4 * 2**30)):
            assert parser().parse_args([command, "--budget", text]).budget == text
        with pytest.raises(SystemExit):  # 4 bytes: a size without its unit
            parser().parse_args([command, "--budget", "4"])
        assert parser().parse_args([command, "--budget", "1GiB", "--gpu", "H100"]).gpu == "H100"
        args = parser().parse_args([command, "--budget", "1GiB"])
        assert args.batch is None and args.seq is None  # remat memory's defaults, for each model
    assert parser().parse_args(["plan", "--budget", "1GiB", "--device", "A100"]).gpu == "A100"  # the old name
    assert "--device" not in parser()._subparsers._group_actions[0].choices["plan"].format_help()
    assert model_shape("llama-3-8b") == (1, 8192) and model_shape("tiny", 2) == (2, 1024)


def test_memory_budget_with_units_and_plain_bytes(tmp_path, capsys):
    for text in ("1GiB", str(2**30)):
        main(["memory", "--model", "tiny", "--batch", "2", "--seq", "16", "--budget", text, "--device", "meta",
              "--out", str(tmp_path)])
        assert "budget 1.0 GB: use 'eager'" in capsys.readouterr().out


def test_plan_prints_binary_units():
    from remat.planner import Plan
    from remat.planner.command import plan_text

    plan = Plan(units=["0", "1"], choices=["remat", "full"], unit_bytes=[3 * 2**20, 4096], unit_seconds=[1e-4, 2e-4],
                base_bytes=512, budget=2**30, device="H200")
    text = plan_text(plan)
    assert "3.00 MiB" in text and "4.00 KiB" in text and "512 B" in text and "3.00 MiB" in text
    assert "budget 1.00 GiB kept for the backward; times predicted for H200" in text
    assert str(4096) not in text and str(plan.saved_bytes) not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU runs")
@pytest.mark.parametrize("interpret", ["0", "1"])
def test_info_says_one_thing_about_the_interpreter(interpret, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    main(["info"])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    interpreter_on = lines["interpreter"].split()[1] == "yes"
    assert interpreter_on == (interpret == "1")
    assert ("through the interpreter" in lines["triton"]) == interpreter_on, lines["triton"]


# --- A Hugging Face model id or folder: only its config is read ------------------------------------


def _counted_as(tmp_path, capsys, model):
    main(["memory", "--model", model, "--batch", "2", "--seq", "16", "--device", "meta", "--out", str(tmp_path)])
    return capsys.readouterr().out


def test_a_folder_holding_a_config_json(tmp_path, capsys):
    pytest.importorskip("transformers", minversion="5.25")
    _tiny_bert(tmp_path / "my-bert")
    printed = _counted_as(tmp_path / "out", capsys, str(tmp_path / "my-bert"))
    assert "BertModel, 2 layers, hidden 32" in printed
    assert (tmp_path / "out" / "memory_my-bert.csv").exists()


def test_a_hub_model_id_fetches_its_config_alone(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers", minversion="5.25")
    from remat import memory

    fetched = []

    def from_pretrained(name, *args, **kwargs):
        fetched.append(name)
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=101, n_positions=64)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    memory._pretrained_config.cache_clear()
    printed = _counted_as(tmp_path, capsys, "someone/tiny-gpt2")
    assert fetched == ["someone/tiny-gpt2"] and "GPT2Model, 2 layers, hidden 32" in printed
    assert "remat + fused loss" in printed  # a causal LM: its LM head and loss counted too
    assert (tmp_path / "memory_tiny-gpt2.csv").exists()


def test_a_hub_model_id_that_cannot_be_fetched_is_a_one_line_error(monkeypatch):
    transformers = pytest.importorskip("transformers", minversion="5.25")
    from remat import memory

    def offline(name, *args, **kwargs):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files of {name}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    memory._pretrained_config.cache_clear()
    for command in (["memory"], ["plan", "--budget", "1GiB"]):
        with pytest.raises(SystemExit) as stopped:
            main([*command, "--model", "nobody/no-such-model"])
        message = str(stopped.value.code)
        assert message.startswith(f"remat {command[0]}: model 'nobody/no-such-model': its config could not be read")
        assert "couldn't connect" in message
