"""A converted model on two CPU processes (gloo): under DDP and FSDP2 it gives the gradients of one process;
a tiny Llama converted before DDP, FSDP2 (fp32, bf16 mixed precision, the LM head a group of its own) and
tensor parallel trains as the stock model does under the same engine, every fusion running, and each rank
holds what the issue "When the model outgrows one GPU" bounds (0.6 of stock's bytes; 0.75 under tensor
parallel).

Each worker converts the same tiny model (same seed); for the comparisons with one process it takes half
of the batch and returns its gradients (after DDP's all-reduce, or FSDP2's reduce-scatter, gathered). All
runs happen in one spawn, to keep process start-up (torch + triton imports) to once.
"""

import pytest
import torch

from gloo_ranks import WORLD, full_grads, run_ranks

HIDDEN, FFN, BATCH, SEQ = 32, 64, 4, 8


class _PreLNBlock(torch.nn.Module):
    """Layers held as attributes, not in a Sequential: remat.convert fuses them through torch.fx."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc1, self.act, self.fc2 = torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 10)

    def forward(self, x):
        return self.head(x + self.fc2(self.act(self.fc1(self.norm(x)))))


def _model(kind="sequential"):
    from torch import nn

    torch.manual_seed(0)
    if kind == "fx":
        return _PreLNBlock()
    return nn.Sequential(
        nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN),  # -> LayerNormMLP
        nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 10),  # -> LayerNormLinear
    )


def _data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=generator), torch.randint(0, 10, (BATCH, SEQ), generator=generator)


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _worker(rank):
    import tempfile

    from remat.convert import convert

    # The tiny Llama saved before any engine's state, for tp_plan="auto": rank 0's folder (with a process group,
    # transformers writes on rank 0 only), both ranks reading it.
    saved = tempfile.TemporaryDirectory()
    _tiny_llama().save_pretrained(saved.name)
    folder = [saved.name]
    torch.distributed.broadcast_object_list(folder)
    x, y = _data()
    shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    ddp = torch.nn.parallel.DistributedDataParallel(convert(_model()))
    _loss(ddp, x[shard], y[shard]).backward()
    results = {"ddp": full_grads(ddp.module)}
    fx_ddp = torch.nn.parallel.DistributedDataParallel(convert(_model("fx")))
    _loss(fx_ddp, x[shard], y[shard]).backward()
    results["ddp_fx"] = full_grads(fx_ddp.module)
    try:
        from torch.distributed.fsdp import fully_shard

        model = convert(_model())
        for block in (model[0], model[4]):
            fully_shard(block)
        fully_shard(model)
        _loss(model, x[shard], y[shard]).backward()
        results["fsdp"] = full_grads(model)
    except Exception as error:  # noqa: BLE001 - reported as the skip reason
        results["fsdp_error"] = f"{type(error).__name__}: {error}"
    results["refusals"] = _converted_after_wrapping()
    results["tensor parallel"] = {run: _tensor_parallel_training(convert_first=run == "remat")
                                  for run in ("stock", "remat")}
    results["tensor parallel head"] = {run: _tensor_parallel_training(convert_first=run == "remat", head=True)
                                       for run in ("stock", "remat")}
    results["vocabulary parallel"] = _vocabulary_parallel_calls()
    for setup in FSDP_SETUPS:
        results[setup] = {run: _fsdp_training(run == "remat", *FSDP_SETUPS[setup]) for run in ("stock", "remat")}
    results["ddp llama"] = {run: _train(torch.nn.parallel.DistributedDataParallel(_tiny_llama(run == "remat")))
                            for run in ("stock", "remat")}
    results["zero3 llama"] = {run: _raised(_zero3_training, run == "remat") for run in ("stock", "remat")}
    results["zero3 families"] = {family: {run: _raised(_zero3_family_step, family, run == "remat")
                                          for run in ("stock", "remat")} for family in ZERO3_FAMILIES}
    # last: while its TrainingArguments live, transformers builds models partitioned (deepspeed.zero.Init)
    results["trainer zero3"] = {run: _raised(_trainer_zero3, run == "remat") for run in ("stock", "remat")}
    results["refusals"]["tp_plan auto"] = _what_convert_says(lambda: _loaded_tensor_parallel(folder[0]))  # last
    torch.distributed.barrier()  # both loaded before rank 0 removes the folder
    saved.cleanup()
    return results


def _raised(run, *args):
    """run(*args), or {"raised": its traceback}: a ZeRO-3 run that raises (deepspeed's CPU accelerator failing
    to build its comm op, say) fails its own tests with the traceback, not every test of this module."""
    import traceback

    try:
        return run(*args)
    except Exception:  # noqa: BLE001 - reported by the test that reads it
        return {"raised": traceback.format_exc()}


def _zero3_result(runs):
    """runs ({"stock": ..., "remat": ...}) of a ZeRO-3 setup, skipped where deepspeed is not installed (an
    optional test dependency), failed with the traceback where a run raised."""
    for run in runs.values():
        if "error" in run:
            pytest.skip(run["error"])
        if "raised" in run:
            pytest.fail(run["raised"])
    return runs


# Under ZeRO-3, the fusions beyond the Llama's: Qwen3-MoE's q/k norms (the attention's backward rebuilds q and k
# with their weights), the norm fused into its router, experts and shared expert; GPT-2's Conv1D projections and
# GELU MLP; a Sequential's LayerNorm -> MLP and LayerNorm -> Linear (remat.nn's modules) and the same fused
# through torch.fx in a module of a user's.
ZERO3_FAMILIES = ("Qwen3MoeConfig", "GPT2Config", "sequential", "fx")
ZERO3 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}  # deepspeed's config: ZeRO-3


def _zero3_family_step(config_name, convert_first):
    """One ZeRO-3 step of a tiny model of `config_name` (hf_models.tiny_causal_lm; its experts on their reference,
    as the single-process tests run them), or of this module's "sequential" or "fx" model: loss, whole
    gradients, fallbacks."""
    deepspeed = _deepspeed()
    if isinstance(deepspeed, str):
        return {"error": deepspeed}
    from deepspeed.utils import safe_get_full_grad

    from remat._guards import fallback_counts
    from remat.convert import convert

    from hf_models import experts_on_the_reference, tiny_causal_lm

    torch.manual_seed(0)  # the same weights in both runs
    if config_name in ("sequential", "fx"):
        model = _model(config_name)
        x, y = (t[:2] for t in _data())
        step = lambda engine: _loss(engine, x, y)  # noqa: E731
    else:
        model = tiny_causal_lm(config_name)
        ids = torch.randint(2, 90, (2, 16), generator=torch.Generator().manual_seed(1))
        step = lambda engine: engine(input_ids=ids, labels=ids).loss  # noqa: E731
    with experts_on_the_reference():
        model = convert(model) if convert_first else model
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ZERO3)
        torch.manual_seed(0)
        loss = step(engine)
        engine.backward(loss)
    # by state_dict key: a Sequential's fused modules hold its layers under new names, its state_dict keeps theirs
    grads = {key: safe_get_full_grad(p).clone() for key, p in model.state_dict(keep_vars=True).items()
             if isinstance(p, torch.nn.Parameter)}
    return {"loss": loss.detach(), "grads": grads, "fallbacks": repr(fallback_counts(model))}


def _trainer_zero3(convert_first):
    """Two SGD steps of the HF Trainer with a DeepSpeed ZeRO-3 config on the tiny Llama, converted first or
    not (convert, then hand the model to the Trainer): its parameters after them (whole) and its fallbacks."""
    import tempfile

    deepspeed = _deepspeed()
    if isinstance(deepspeed, str):
        return {"error": deepspeed}
    import transformers
    from deepspeed.utils import safe_get_full_fp32_param

    from remat._guards import fallback_counts

    model = _tiny_llama(convert_first)
    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True, optim="sgd", learning_rate=0.1, deepspeed=config)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": row, "labels": row}
                                                                          for row in ids])
    trainer.train()
    assert isinstance(trainer.model_wrapped, deepspeed.DeepSpeedEngine)  # ZeRO-3 ran, not a fallback to DDP
    return {"params": {name: safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()},
            "fallbacks": repr(fallback_counts(model))}


def _deepspeed():
    """deepspeed, on its CPU accelerator, told this rank's place in the gloo group (what its launcher sets);
    or why it is not there (an optional test dependency the test setup installs)."""
    import os

    rank = str(torch.distributed.get_rank())
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=rank, RANK=rank, WORLD_SIZE=str(WORLD))
    try:
        import deepspeed
    except ImportError as error:
        return f"deepspeed is not installed ({error})"
    return deepspeed


def _zero3_training(convert_first):
    """The tiny Llama under DeepSpeed ZeRO-3 (its CPU accelerator, on this gloo group), converted first or
    not: as _train, the gradients and parameters gathered whole with deepspeed's own accessors; or the
    reason deepspeed is not there (an optional test dependency the test setup installs)."""
    deepspeed = _deepspeed()
    if isinstance(deepspeed, str):
        return {"error": deepspeed}
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from remat._guards import fallback_counts

    model = _tiny_llama(convert_first)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=ZERO3)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    loss, held = _held_after_forward(model, lambda: engine(input_ids=ids, labels=ids).loss)
    engine.backward(loss)
    result = {"loss": loss.detach().float(), "saved": held,
              "grads": {name: safe_get_full_grad(p).clone() for name, p in model.named_parameters()}}
    engine.step()
    for _ in range(TP_STEPS - 1):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    result["params"] = {name: safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    result["fallbacks"] = repr(fallback_counts(model))
    return result


# FSDP2 on the tiny Llama: each decoder layer a group, the root one; (bf16 MixedPrecisionPolicy, the LM head a
# group of its own). The fused loss computes inside the head's own call there, where FSDP2 gathers its weight.
FSDP_SETUPS = {"fsdp2 llama": (False, False), "fsdp2 llama, head group": (False, True),
               "fsdp2 llama, bf16 mixed precision": (True, False)}


def _fsdp_training(convert_first, mixed_precision, head_group):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


    model = _tiny_llama(convert_first)
    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
        if mixed_precision else {}
    for module in (*model.model.layers, *([model.lm_head] if head_group else []), model):
        fully_shard(module, **policy)
    return _train(model)


# Tensor parallel, as the issue "When the model outgrows one GPU" measures it: a tiny Llama (hidden 64, 2 layers,
# 4 heads, 2 key/value heads), seq 32, batch 2 on every rank; its projections column-parallel (q/k/v, gate/up) and
# row-parallel (o, down) over the 2 ranks.
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}
TP_STEPS = 3


def _tiny_llama(converted=False, heads=4, key_value_heads=2, intermediate=128):
    """The issue's tiny Llama (the same weights every call), remat.convert-ed or not; with fewer heads or a
    narrower MLP, a tensor-parallel rank's share of it on one process."""
    import transformers

    from remat.convert import convert

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=intermediate,
                                      num_hidden_layers=2, num_attention_heads=heads, head_dim=16,
                                      num_key_value_heads=key_value_heads, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    return convert(model) if converted else model


def _tensor_parallel_training(convert_first, head=False):
    """Stock or converted-then-parallelized tiny Llama: the first step's loss, bytes autograd keeps (this
    rank's), whole gradients, the parameters after TP_STEPS AdamW steps (whole), and the fallbacks. head: the
    LM head column-parallel too, its logits gathered (transformers' "colwise_gather_output")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


    mesh = init_device_mesh("cpu", (WORLD,))
    model = _tiny_llama(convert_first)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {name: styles[style]() for name, style in TP_PLAN.items()})
    if head:
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return _train(model)


def _vocabulary_parallel_calls():
    """remat.linear_cross_entropy with the weight (and bias) a DTensor Shard(0) over the ranks: a vocabulary of
    67 (34 and 33 rows), fp32, per reduction and option set, x plain and a DTensor Replicate(): {case: (loss,
    dx, whole dweight, whole dbias)}; and {"refused": ...} what a layout it does not take raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import remat

    mesh = init_device_mesh("cpu", (WORLD,))
    x, weight, bias, target = _vocabulary_case()
    results = {}
    for case, (options, replicated_x) in VOCABULARY_CASES.items():
        x_leaf = x.clone().requires_grad_()
        w_leaf, b_leaf = (torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in (weight, bias))
        given_x = DTensor.from_local(x_leaf, mesh, [Replicate()], run_check=False) if replicated_x else x_leaf
        loss = remat.linear_cross_entropy(given_x, w_leaf, target, b_leaf, **options)
        cotangent = torch.arange(1.0, 1.0 + loss.numel()).view(loss.shape) / loss.numel()
        (loss * cotangent).sum().backward()
        results[case] = (loss.detach(), x_leaf.grad, w_leaf.grad.full_tensor(), b_leaf.grad.full_tensor())
    refused = {}
    for argument, call in (
            ("weight", lambda: remat.linear_cross_entropy(x, distribute_tensor(weight, mesh, [Shard(1)]), target)),
            ("bias", lambda: remat.linear_cross_entropy(x, distribute_tensor(weight, mesh, [Shard(0)]), target, bias)),
            ("x", lambda: remat.linear_cross_entropy(distribute_tensor(x, mesh, [Shard(0)]),
                                                     distribute_tensor(weight, mesh, [Shard(0)]), target))):
        try:
            call()
            refused[argument] = "accepted"
        except ValueError as error:
            refused[argument] = str(error)
    results["refused"] = refused
    return results


# The vocabulary-parallel calls: (options, x a DTensor Replicate() rather than a plain tensor).
VOCABULARY_CASES = {"mean": ({}, False), "sum, every option": (dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3,
                                                                      softcap=5.0), True),
                    "none": (dict(reduction="none"), False)}


def _vocabulary_case():
    """x (3, 5, 37), weight (67, 37), bias (67,), target (3, 5) with targets in both shards and one ignored."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 37, generator=generator)
    weight, bias = torch.randn(67, 37, generator=generator) / 6, torch.randn(67, generator=generator)
    target = torch.randint(0, 67, (3, 5), generator=generator)
    target[0, :3] = torch.tensor([33, 34, -100])  # the last row of rank 0's shard, the first of rank 1's
    return x, weight, bias, target


def _held_after_forward(model, forward):
    """(forward(), the bytes of the storages autograd keeps for the backward once it returned, each once):
    what a rank holds between forward and backward. This rank's shards of the parameters are left out, and
    so are the whole weights FSDP2 gathered for the forward and freed after it (their storages are empty
    then; a count taken when each is saved would see them, and count a freed address reused twice)."""
    from remat.saved import _local

    kept = []

    def pack(tensor):
        kept.append(_local(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    parameters = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return out, sum(size for address, size in storages.items() if address not in parameters)


def _train(model):
    """One step of `model` (a tiny Llama, sharded) on the batch every rank takes: its loss, the bytes held
    between forward and backward, its whole gradients; then the parameters after TP_STEPS AdamW steps
    (whole) and the fallbacks."""
    from remat._guards import fallback_counts

    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    loss, held = _held_after_forward(model, lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()
    result = {"loss": loss.detach().float(), "saved": held, "grads": full_grads(model)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(TP_STEPS):
        if step:
            optimizer.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    result["params"] = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                        for name, p in model.named_parameters()}
    result["fallbacks"] = repr(fallback_counts(model))
    return result


def _converted_after_wrapping():
    """{engine: what remat.convert of a model it already wraps or shards said} (each call's error, or
    "converted"): asked on every rank, so that a collective one rank entered alone would hang the test."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def sharded():
        model = _model()
        fully_shard(model[0])
        return fully_shard(model)

    def parallel():
        mesh = init_device_mesh("cpu", (WORLD,))
        return parallelize_module(_model(), mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})

    return {engine: _what_convert_says(wrapped) for engine, wrapped in (
        ("ddp", lambda: torch.nn.parallel.DistributedDataParallel(_model())), ("fsdp2", sharded),
        ("tensor parallel", parallel))}


def _what_convert_says(wrapped):
    """What remat.convert(wrapped()) says: its error, or "converted"."""
    from remat.convert import convert

    try:
        convert(wrapped())
        return "converted"
    except ValueError as error:
        return str(error)


def _loaded_tensor_parallel(folder):
    """The tiny Llama saved in `folder` as transformers loads it with tp_plan="auto" (sharded as it loads). Run
    last in a worker: the load leaves the ranks' DeepSpeed state unlike each other (a ZeRO-3 run after it
    hangs)."""
    import os

    import transformers
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # the ZeRO-3 Trainer's, which would make this load a ZeRO-3 one
    # transformers reads the rank and world from torchrun's variables; set only here
    before = dict(os.environ)
    rank = str(torch.distributed.get_rank())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto")
    finally:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("distributed"))


def _single_process_grads(kind):
    from remat.convert import convert

    model, report = convert(_model(kind), report=True)
    assert report.swapped, "nothing was fused: the distributed test would not test remat"
    _loss(model, *_data()).backward()
    return full_grads(model)


@pytest.fixture(scope="module")
def single_process_grads():
    return _single_process_grads("sequential")


def _assert_close(got, want):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_ddp_matches_single_process(distributed_results, single_process_grads):
    for results in distributed_results:
        _assert_close(results["ddp"], single_process_grads)


def test_ddp_of_a_model_fused_through_fx(distributed_results):
    want = _single_process_grads("fx")
    for results in distributed_results:
        _assert_close(results["ddp_fx"], want)


def test_fsdp2_matches_single_process(distributed_results, single_process_grads):
    if "fsdp_error" in distributed_results[0]:
        pytest.skip(f"FSDP2 (fully_shard) on CPU/gloo failed with this torch: {distributed_results[0]['fsdp_error']}")
    for results in distributed_results:
        _assert_close(results["fsdp"], single_process_grads)


@pytest.mark.parametrize("engine, says", [("ddp", "is wrapped in DistributedDataParallel"),
                                          ("fsdp2", "is sharded by FSDP2's fully_shard"),
                                          ("tensor parallel", "has DTensor parameters (1.weight"),
                                          ("tp_plan auto", "has DTensor parameters (model.embed_tokens.weight")])
def test_a_model_an_engine_already_wraps_is_refused_at_once(distributed_results, engine, says):
    """Converted after wrapping, a model is refused before convert calls it (no probe forward outside the
    engine: no hang in a collective, no root left unsharded), with what wraps it and the order to use. A model
    transformers sharded as it loaded (tp_plan="auto", which hung in convert's probe before) included."""
    for results in distributed_results:
        said = results["refusals"][engine]
        assert said.startswith(f"model {says}") and "remat.convert the model before handing it" in said, said
        assert ("load it without tp_plan, convert it, then parallelize_module it" in said) == ("DTensor" in says)


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _assert_trains_as_stock(runs, bound):
    """The converted run of `runs` ({"stock": ..., "remat": ...}, from _train) had no fallback, its loss is
    stock's within 1e-5, every whole gradient and the parameters after TP_STEPS AdamW steps within 1e-4, and
    it held at most `bound` of stock's bytes."""
    stock, remat = runs["stock"], runs["remat"]
    assert remat["fallbacks"] == "{}"
    assert _rel(remat["loss"], stock["loss"]) <= 1e-5
    assert stock["grads"].keys() == remat["grads"].keys()
    for key, grad in stock["grads"].items():
        assert _rel(remat["grads"][key], grad) <= 1e-4, key
    for key, param in stock["params"].items():
        assert _rel(remat["params"][key], param) <= 1e-4, key
    assert remat["saved"] <= bound * stock["saved"], (remat["saved"], stock["saved"])


def test_tensor_parallel_fuses_and_trains_as_stock(distributed_results):
    """Converted before parallelize_module: the norms fused into the column-parallel q/k/v projections and
    the gated MLP across its column/row-parallel pair compute on each rank's shards (no fallback), the loss,
    every gradient and the parameters after 3 AdamW steps are stock tensor parallel's, and each rank keeps
    at most 0.75 of the bytes stock keeps there (the issue's bound)."""
    for results in distributed_results:
        _assert_trains_as_stock(results["tensor parallel"], 0.75)


def test_tensor_parallel_with_a_column_parallel_head_computes_the_loss_on_vocabulary_shards(distributed_results):
    """The LM head column-parallel too (its logits gathered, as transformers' plan for Llama has it): the fused
    loss runs on each rank's rows of the head, the log-sum-exp combined across the ranks (no fallback), trains
    as stock, and each rank keeps neither the gathered logits nor their fp32 log-softmax."""
    for results in distributed_results:
        runs = results["tensor parallel head"]
        _assert_trains_as_stock(runs, 0.75)
        # stock keeps the gathered logits' fp32 log-softmax (2 x 32 tokens x 128 classes x 4 bytes), remat exactly
        # what its fused loss keeps with the head on one rank (x, the target, 4 bytes a token)
        assert runs["stock"]["saved"] - runs["remat"]["saved"] >= 2 * 32 * 128 * 4
        assert runs["remat"]["saved"] == results["tensor parallel"]["remat"]["saved"]


def _held_by_one_process(converted, **shares):
    """The bytes one process keeps between forward and backward of the tiny Llama (or the share `shares` of
    it) on the batch _train gives every rank."""
    model = _tiny_llama(converted, **shares)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return _held_after_forward(model, lambda: model(input_ids=ids, labels=ids).loss)[1]


def test_a_rank_keeps_what_one_process_keeps_for_its_share(distributed_results):
    """The bytes a rank keeps, against one process's count, stock and converted: under DDP, FSDP2 and ZeRO-3 exactly
    what one process keeps for the rank's batch (data parallel divides the batch, not what a sample keeps);
    under tensor parallel exactly what one process keeps for the model of the rank's share, half the heads,
    half the key/value heads and half the MLP's intermediate (the norms, residual stream and the loss's
    inputs are whole on every rank), the vocabulary-parallel head's loss included."""
    for run in ("stock", "remat"):
        whole = _held_by_one_process(run == "remat")
        share = _held_by_one_process(run == "remat", heads=2, key_value_heads=1, intermediate=64)
        for results in distributed_results:
            for setup in ("ddp llama", "fsdp2 llama", "fsdp2 llama, head group", "zero3 llama"):
                runs = _zero3_result(results[setup]) if setup.startswith("zero3") else results[setup]
                # ZeRO-3 re-partitions a parameter after its module's call: the four fused norms' weights, which
                # the projections after them read in their backward, are kept whole meanwhile (64 fp32 each)
                lent = 4 * 64 * 4 if (setup, run) == ("zero3 llama", "remat") else 0
                assert runs[run]["saved"] == whole + lent, (run, setup)
            for setup in ("tensor parallel", "tensor parallel head"):
                assert results[setup][run]["saved"] == share, (run, setup)


def test_a_vocabulary_parallel_loss_is_the_whole_vocabularys(distributed_results):
    """remat.linear_cross_entropy with a weight sharded on the vocabulary across the ranks (uneven shards, a
    bias, x plain or Replicate()): every rank's loss and gradients (x's summed across the ranks, the weight's
    and bias's gathered) are one process's float64 ones, within fp32 rounding."""
    import remat

    x, weight, bias, target = (t.double() if t.is_floating_point() else t for t in _vocabulary_case())
    for case, (options, _) in VOCABULARY_CASES.items():
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        loss = remat.linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], **options)
        cotangent = torch.arange(1.0, 1.0 + loss.numel()).view(loss.shape) / loss.numel()
        (loss * cotangent).sum().backward()
        for results in distributed_results:
            got = results["vocabulary parallel"][case]
            for name, mine, want in zip(("loss", "dx", "dweight", "dbias"), got, (loss, *(t.grad for t in leaves))):
                assert _rel(mine, want) <= 1e-5, (case, name)


def test_a_vocabulary_parallel_layout_it_does_not_take_is_refused_naming_the_argument(distributed_results):
    for results in distributed_results:
        refused = results["vocabulary parallel"]["refused"]
        assert refused["weight"].startswith("weight must be a DTensor Shard(0)")
        assert refused["bias"].startswith("bias must be None or a DTensor Shard(0)")
        assert refused["x"].startswith("x must be the whole input on every rank")


@pytest.mark.parametrize("setup", [*(s for s in FSDP_SETUPS if not FSDP_SETUPS[s][0]), "ddp llama"])
def test_fsdp2_and_ddp_fuse_and_train_as_stock(distributed_results, setup):
    """Converted before fully_shard (each layer a group; the LM head alone in one too) or DDP: every fusion
    runs (the head's fused loss inside its own FSDP2 call), loss, gradients and the parameters after 3
    AdamW steps are stock's under the same engine, and each rank holds at most 0.6 of what stock holds
    between forward and backward (the issue's bound)."""
    for results in distributed_results:
        _assert_trains_as_stock(results[setup], 0.6)


def test_fsdp2_in_bf16_mixed_precision_is_as_accurate_as_stock(distributed_results):
    """Under MixedPrecisionPolicy(param_dtype=bf16) the converted model's loss and whole gradient are as
    close to fp32 FSDP2's as stock bf16 FSDP2's are: within twice its error, with the 1e-3 floor of the
    single-process autocast tests (hf_models.assert_autocast_step_as_accurate_as_stock: stock's loss takes
    fp32 logits and may land closer by chance than bf16's resolution), every fusion running and at most
    0.6 of stock's bytes held."""
    def whole(grads):
        return torch.cat([grads[key].double().flatten() for key in sorted(grads)])

    for results in distributed_results:
        exact = results["fsdp2 llama"]["stock"]
        stock, remat = (results["fsdp2 llama, bf16 mixed precision"][run] for run in ("stock", "remat"))
        assert remat["fallbacks"] == "{}"
        assert _rel(remat["loss"], exact["loss"]) <= 2 * _rel(stock["loss"], exact["loss"]) + 1e-3
        want = whole(exact["grads"])
        assert _rel(whole(remat["grads"]), want) <= 2 * _rel(whole(stock["grads"]), want) + 1e-3
        assert remat["saved"] <= 0.6 * stock["saved"], (remat["saved"], stock["saved"])


def test_zero3_fuses_and_trains_as_stock(distributed_results):
    """Converted before deepspeed.initialize (ZeRO-3): the fused modules gather what they read (a norm's
    weight lent to the projections after it, an MLP's projections registered with it: deepspeed's
    register_external_parameter), every fusion runs, the fused loss inside the head's own call; loss,
    gradients and the parameters after 3 AdamW steps are stock ZeRO-3's, and each rank holds at most 0.75
    of what stock holds between forward and backward (the issue's bound)."""
    for results in distributed_results:
        _assert_trains_as_stock(_zero3_result(results["zero3 llama"]), 0.75)


def test_the_trainer_with_zero3_trains_a_converted_model_as_stock(distributed_results):
    """The HF Trainer with a DeepSpeed ZeRO-3 config (on CPU: DS_ACCELERATOR=cpu, gloo) trains the converted
    tiny Llama to the stock one's parameters, every fusion running. (The Trainer's fsdp= runs DDP on CPU:
    accelerate enables FSDP on accelerators only; FSDP2 itself is tested above through fully_shard.)"""
    for results in distributed_results:
        runs = _zero3_result(results["trainer zero3"])
        stock, remat = runs["stock"], runs["remat"]
        assert remat["fallbacks"] == "{}"
        for key, param in stock["params"].items():
            assert _rel(remat["params"][key], param) <= 1e-5, key


@pytest.mark.parametrize("family", ZERO3_FAMILIES)
def test_zero3_runs_every_fusion_of_other_families(distributed_results, family):
    """Under ZeRO-3 the q/k norms, the norm fused into a router and experts, GPT-2's MLP and the fusions of a
    Sequential and of torch.fx run fused, the loss and every gradient stock ZeRO-3's (gradients with hf_models'
    floor: a key bias's is rounding noise only)."""
    from hf_models import grad_error

    for results in distributed_results:
        runs = _zero3_result(results["zero3 families"][family])
        stock, remat = runs["stock"], runs["remat"]
        assert remat["fallbacks"] == "{}"
        assert _rel(remat["loss"], stock["loss"]) <= 1e-5
        total = sum(g.double().norm() ** 2 for g in stock["grads"].values()) ** 0.5
        for key, grad in stock["grads"].items():
            assert grad_error(remat["grads"][key], grad, total) <= 1e-4, key
