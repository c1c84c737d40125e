"""remat.specs.Linear(..., transposed=True): a weight stored (in, out), as transformers' Conv1D keeps it,
computed as Conv1D computes it (addmm) with no transposed view of it, its gradient laid out as it is
stored. The same numbers, bit for bit, as the (out, in) view of the same weight, and close to float64."""

import pytest
import torch
import torch.nn.functional as F

from remat.ops.fused import fused_mlp, norm_linears
from remat.specs import Activation, Linear, Norm

from numerics import assert_close_to_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS, WIDTH, OUT, FFN = 7, 37, 53, 101  # prime widths, rows not a multiple of any block


def _leaf(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape) * scale).to(device, dtype).requires_grad_()


def _params(dtype, device):
    """x (1, ROWS, WIDTH); a LayerNorm's weight and bias; two Conv1D-like (in, out) weights with biases, the
    first reading x's width, the second reading the first's output (an MLP's fc1 and fc2)."""
    return {"x": _leaf(1, ROWS, WIDTH, dtype=dtype, device=device),
            "nw": _leaf(WIDTH, dtype=dtype, device=device, scale=0.5), "nb": _leaf(WIDTH, dtype=dtype, device=device),
            "w1": _leaf(WIDTH, FFN, dtype=dtype, device=device, scale=WIDTH ** -0.5),
            "b1": _leaf(FFN, dtype=dtype, device=device),
            "w2": _leaf(FFN, WIDTH, dtype=dtype, device=device, scale=FFN ** -0.5),
            "b2": _leaf(WIDTH, dtype=dtype, device=device),
            "wq": _leaf(OUT, WIDTH, dtype=dtype, device=device, scale=WIDTH ** -0.5)}  # an (out, in) one beside


def _run(call, params, dy_seed=1):
    """(the outputs, {name: gradient}) of call(params) with a fixed random gradient per output."""
    outs = call(params)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    generator = torch.Generator().manual_seed(dy_seed)
    grads = [torch.randn(o.shape, generator=generator).to(o.device, o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    got = {name: p.grad for name, p in params.items()}
    for p in params.values():
        p.grad = None
    return [o.detach() for o in outs], got, grads


def _float64(params):
    return {name: p.detach().double().requires_grad_() for name, p in params.items()}


def _norm_linears(transposed):
    def call(p):
        w1 = p["w1"] if transposed else p["w1"].t()
        return norm_linears(p["x"], Norm(p["nw"], p["nb"], 1e-5), [Linear(w1, p["b1"], (), transposed),
                                                                          Linear(p["wq"], None)])
    return call


def _norm_linears_reference(p):
    normed = F.layer_norm(p["x"], (WIDTH,), p["nw"], p["nb"], 1e-5)
    return [normed @ p["w1"] + p["b1"], normed @ p["wq"].t()]


def _mlp(transposed):
    def call(p):
        w1, w2 = (p["w1"], p["w2"]) if transposed else (p["w1"].t(), p["w2"].t())
        return fused_mlp(p["x"], Linear(w1, p["b1"], (), transposed), Activation("gelu_tanh"),
                               Linear(w2, p["b2"], (), transposed), Norm(p["nw"], p["nb"], 1e-5))
    return call


def _mlp_reference(p):
    normed = F.layer_norm(p["x"], (WIDTH,), p["nw"], p["nb"], 1e-5)
    return F.gelu(normed @ p["w1"] + p["b1"], approximate="tanh") @ p["w2"] + p["b2"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["norm_linears", "fused_mlp"])
def test_transposed_weights_compute_what_their_view_computes(target, op, dtype):
    device, _ = target
    make, reference = {"norm_linears": (_norm_linears, _norm_linears_reference),
                       "fused_mlp": (_mlp, _mlp_reference)}[op]
    params = _params(dtype, device)
    outs, grads, dys = _run(make(True), params)
    view_outs, view_grads, _ = _run(make(False), params)
    for out, view_out in zip(outs, view_outs):
        assert torch.equal(out, view_out)
    for name, grad in grads.items():
        assert (grad is None) == (view_grads[name] is None), name
        if grad is not None:
            assert torch.equal(grad, view_grads[name]), name
    assert grads["w1"].shape == (WIDTH, FFN) and grads["w1"].is_contiguous()  # laid out as stored
    ref_params = _float64(params)
    ref_outs = reference(ref_params)
    ref_outs = ref_outs if isinstance(ref_outs, list) else [ref_outs]
    torch.autograd.backward(ref_outs, [dy.double() for dy in dys])
    for out, ref in zip(outs, ref_outs):
        assert_close_to_ref("out", out.float(), ref.detach(), dtype)
    for name, grad in grads.items():
        if grad is not None:
            assert_close_to_ref(f"d{name}", grad.float(), ref_params[name].grad, dtype)


def test_a_transposed_weight_of_another_shape_is_refused_by_name():
    x, norm = torch.randn(3, WIDTH), Norm(torch.ones(WIDTH), torch.zeros(WIDTH), 1e-5)
    with pytest.raises(ValueError, match=r"weight must have shape \(37, out_features\) \(transposed\), got \(53, 37\)"):
        norm_linears(x, norm, [Linear(torch.randn(OUT, WIDTH), None, (), True)])
    with pytest.raises(ValueError, match=r"b2 must have shape \(37,\)"):
        fused_mlp(x, Linear(torch.randn(WIDTH, FFN), None, (), True), Activation("gelu"),
                        Linear(torch.randn(FFN, WIDTH), torch.zeros(FFN), (), True))
    with pytest.raises(TypeError, match="transposed of the Linear of weight must be True or False, got 'yes'"):
        norm_linears(x, norm, [Linear(torch.randn(WIDTH, OUT), None, (), "yes")])
