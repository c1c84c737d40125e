"""RMSNorm kernels (the RMSNorm mode of the LayerNorm kernels) in each stock style: against float64
and PyTorch's own error, the stock modules' rounding bitwise, recompute, determinism, bad input.

The launchers are called directly (the custom ops and modules come on top of them); the stock
modules are torch.nn.functional.rms_norm and transformers' LlamaRMSNorm, GemmaRMSNorm and
T5LayerNorm.
"""

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.ops import rms_norm as ref
from remat.triton_kernels import layer_norm as kernels

from kernel_checks import assert_within_twice_stock, kernel_device  # noqa: F401 (the device fixture)
from numerics import rel_error

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.t5.modeling_t5 import T5LayerNorm  # noqa: E402

STYLES = ref.STYLES
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rows, width): one row, width 1, primes, widths not a multiple of the block, many row blocks
# per program (300 x 33), a backward past the fused limit for ragged rows (4099: chunked), and a
# forward past the fused limit of every dtype (16411: looped).
SHAPES = [(1, 1), (1, 7), (3, 1), (5, 127), (17, 1000), (300, 33), (4, 4099), (3, 16411)]
# Weight dtypes other than x's that the stock modules accept: mixed-precision weights.
MIXED = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
         (torch.float16, torch.bfloat16)]
EPS = 1e-6


def make_inputs(shape, dtype, device, weight_dtype=None):
    """Fresh random x (mean off zero) and weight (never zeros, never ones)."""
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype)
    w = (torch.randn(shape[-1], device=device) + 1).to(weight_dtype or dtype)
    return x, w


def stock_module(style, weight, eps):
    """The stock implementation of `style`, holding a copy of weight as its parameter."""
    width = weight.shape[0]
    if style == "torch":
        module = torch.nn.RMSNorm(width, eps=eps, device=weight.device, dtype=weight.dtype)
    else:
        module = {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm, "t5": T5LayerNorm}[style](width, eps=eps)
    module.weight = torch.nn.Parameter(weight.detach().clone())
    return module


def float64_truth(x, w, dy, style, eps):
    """y and the gradients of x and w in float64, by autograd through torch's rms_norm, scaling by
    (1 + w) for gemma: every style's function without its roundings."""
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y64 = F.rms_norm(x64, (x.shape[-1],), w64 + 1 if style == "gemma" else w64, eps)
    y64.backward(dy.double())
    return y64, x64.grad, w64.grad


def stock_results(x, w, dy, style, eps):
    """y, dx, dw of the stock module in the inputs' own dtypes."""
    module = stock_module(style, w, eps)
    leaf = x.detach().clone().requires_grad_()
    y = module(leaf)
    y.backward(dy)
    return y, leaf.grad, module.weight.grad


def assert_one_element_dx_is_cancellation_noise(dx, want, dy, w, rstd, style):
    """A one-element row has dx = rstd g (1 - xhat^2) = rstd g eps / (x^2 + eps): mostly tiny, and
    in fp32 only the difference of two nearly equal terms (xhat^2 is within ulps of 1), so the
    stock module's dx is rounding noise as much as ours (errors of 10-30 % of a ~1e-7 result). Held
    instead, element by element, to 16 fp32 ulps of the cancelling terms rstd * g plus the rounding
    of dx to its dtype (half an ulp at |dx|, subnormals included: fp16's are 6e-8 apart)."""
    scale = w.double() + 1 if style == "gemma" else w.double()
    terms = (dy.double() * scale * rstd.double()[:, None]).abs()
    info = torch.finfo(dx.dtype)
    rounding = info.eps / 2 * want.abs().clamp(min=info.smallest_normal)
    bound = 16 * 2.0**-24 * terms + rounding
    error = (dx.double() - want).abs()
    assert (error <= bound).all(), f"dx: absolute errors {error.flatten().tolist()} > {bound.flatten().tolist()}"


def check_style(x, w, style, eps=EPS):
    """The kernels' y, dx, dw against float64 (at most twice the stock module's error), y rounded
    bitwise as the stock module rounds it given the kernel's rstd, and rstd itself in fp32."""
    y, rstd = kernels.rms_norm_fwd(x, w, eps, style)
    dy = torch.randn(y.shape, device=x.device).to(y.dtype)
    dx, dw, nothing = kernels.rms_norm_bwd(dy, x, w, rstd, style, False)
    truth = float64_truth(x, w, dy, style, eps)
    stock = stock_results(x, w, dy, style, eps)

    assert rstd.dtype == torch.float32 and rstd.shape == (x.shape[0],)
    assert rel_error(rstd, ref.rms_norm_rstd_ref(x.double(), eps)) <= 1e-6
    assert torch.equal(y, ref.rms_norm_output_ref(x, w, rstd, style)), "y is not rounded as the stock module rounds it"
    assert nothing.numel() == 0
    for name, ours, want, theirs in zip(("y", "dx", "dw"), (y, dx, dw), truth, stock):
        if name == "dx" and x.shape[1] == 1:
            assert ours.dtype == theirs.dtype
            assert_one_element_dx_is_cancellation_noise(ours, want, dy, w, rstd, style)
        else:
            assert_within_twice_stock(name, ours, want, theirs)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_and_stock_rounding(device, shape, dtype, style):
    check_style(*make_inputs(shape, dtype, device), style)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtypes", MIXED, ids=lambda d: f"x{str(d[0])[6:]}-w{str(d[1])[6:]}")
@pytest.mark.parametrize("shape", [(9, 300), (3, 4099)], ids=lambda s: "x".join(map(str, s)))
def test_mixed_weight_dtypes(device, shape, dtypes, style):
    """Output dtypes as the stock modules promote them: Llama's and T5's follow the weight."""
    check_style(*make_inputs(shape, dtypes[0], device, weight_dtype=dtypes[1]), style)


def test_rows_with_a_stride_and_vectorised_wide_rows(device):
    """Rows with a stride above the width; 8192-wide aligned rows take the fused backward."""
    wide = torch.randn(6, 96, device=device)
    check_style(wide[:, :80], torch.randn(80, device=device) + 1, "llama")
    check_style(*make_inputs((2, 8192), torch.bfloat16, device), "gemma")


def test_no_weight(device):
    """torch.nn.RMSNorm(elementwise_affine=False): y = xhat in x's dtype, no dw."""
    x = make_inputs((7, 129), torch.bfloat16, device)[0]
    y, rstd = kernels.rms_norm_fwd(x, None, EPS, "torch")
    dy = torch.randn_like(y)
    dx, dw, _ = kernels.rms_norm_bwd(dy, x, None, rstd, "torch", False)
    assert torch.equal(y, ref.rms_norm_output_ref(x, None, rstd, "torch"))
    x64 = x.double().requires_grad_()
    y64 = F.rms_norm(x64, (129,), None, EPS)
    y64.backward(dy.double())
    leaf = x.clone().requires_grad_()
    stock = F.rms_norm(leaf, (129,), None, EPS)
    stock.backward(dy)
    assert_within_twice_stock("y", y, y64, stock)
    assert_within_twice_stock("dx", dx, x64.grad, leaf.grad)
    assert dw.numel() == 0


def test_empty_rows(device):
    x, w = make_inputs((0, 17), torch.float16, device)
    y, rstd = kernels.rms_norm_fwd(x, w, EPS, "gemma")
    assert y.shape == (0, 17) and rstd.shape == (0,)
    dx, dw, _ = kernels.rms_norm_bwd(torch.empty_like(y), x, w, rstd, "gemma", True)
    assert dx.shape == (0, 17) and torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("style", STYLES)
def test_recompute_output_is_the_forward_bitwise(device, style):
    """Each pairing of forward and backward paths: fused/fused, fused/chunked (4099 ragged),
    looped/chunked (16411), and an fp32 weight (Llama's and T5's y are then fp32)."""
    cases = [((13, 2053), torch.bfloat16), ((3, 4099), torch.bfloat16), ((2, 16411), torch.bfloat16),
             ((13, 2053), torch.float32)]
    for shape, weight_dtype in cases:
        x, w = make_inputs(shape, torch.bfloat16, device, weight_dtype)
        y, rstd = kernels.rms_norm_fwd(x, w, EPS, style)
        dy = torch.randn(y.shape, device=device).to(y.dtype)
        dx, dw, y_again = kernels.rms_norm_bwd(dy, x, w, rstd, style, True)
        assert torch.equal(y, y_again), f"{shape}: the recomputed output differs from the forward's"
        dx_plain, dw_plain, _ = kernels.rms_norm_bwd(dy, x, w, rstd, style, False)
        assert torch.equal(dx, dx_plain) and torch.equal(dw, dw_plain)


@pytest.mark.parametrize("shape", [(257, 97), (67, 4099)], ids=lambda s: "x".join(map(str, s)))
def test_weight_gradient_is_bitwise_reproducible(device, shape):
    """Fixed-G partial sums, fused and chunked backward: the same bits every run."""
    x, w = make_inputs(shape, torch.bfloat16, device, torch.float32)
    y, rstd = kernels.rms_norm_fwd(x, w, EPS, "llama")
    dy = torch.randn(y.shape, device=device).to(y.dtype)
    first = kernels.rms_norm_bwd(dy, x, w, rstd, "llama", False)
    again = kernels.rms_norm_bwd(dy, x, w, rstd, "llama", False)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


# --- the references against the stock modules, bitwise (no kernels: any machine) ---------------


@pytest.mark.parametrize("style", ["llama", "gemma", "t5"])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), *MIXED],
                         ids=lambda d: f"x{str(d[0])[6:]}-w{str(d[1])[6:]}")
def test_reference_rounds_as_the_transformers_module(style, dtypes):
    """The reference's rstd is computed by the module's own operations, so its y is bitwise the
    module's: the check that each style's casts sit where the module has them."""
    x, w = make_inputs((16, 300), dtypes[0], "cpu", dtypes[1])
    with torch.no_grad():
        stock = stock_module(style, w, EPS)(x)
    ours, _ = ref.rms_norm_fwd_ref(x, w, EPS, style)
    assert ours.dtype == stock.dtype and torch.equal(ours, stock)


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_fused_rms_norm"), reason="needs torch's _fused_rms_norm (2.9+)")
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), *MIXED],
                         ids=lambda d: f"x{str(d[0])[6:]}-w{str(d[1])[6:]}")
def test_reference_rounds_as_torch_rms_norm(dtypes):
    """Given torch's own rstd (_fused_rms_norm returns it), the "torch" style's y is bitwise
    torch.rms_norm's: (xhat * w) in fp32, one cast to x's dtype."""
    x, w = make_inputs((16, 300), dtypes[0], "cpu", dtypes[1])
    _, stock_rstd = torch.ops.aten._fused_rms_norm(x, [300], w, EPS)
    stock = torch.rms_norm(x, (300,), w, EPS)
    ours = ref.rms_norm_output_ref(x, w, stock_rstd.squeeze(-1), "torch")
    assert ours.dtype == stock.dtype and torch.equal(ours, stock)


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_fused_rms_norm"), reason="needs torch's _fused_rms_norm (2.9+)")
def test_default_eps_is_float32s():
    """torch's eps=None is finfo(float32).eps for bf16 input, not finfo(bfloat16).eps (2**-7)."""
    x = (torch.randn(4, 64) * 0.03).to(torch.bfloat16)  # mean square ~1e-3: eps = 2**-7 would show
    _, stock_rstd = torch.ops.aten._fused_rms_norm(x, [64], None, None)
    assert ref.default_eps(torch.bfloat16) == torch.finfo(torch.float32).eps
    assert rel_error(ref.rms_norm_rstd_ref(x, ref.default_eps(x.dtype)), stock_rstd.squeeze(-1)) < 1e-6
    assert rel_error(ref.rms_norm_rstd_ref(x, torch.finfo(x.dtype).eps), stock_rstd.squeeze(-1)) > 0.1
    assert torch.equal(remat.rms_norm(x, (64,)), remat.rms_norm(x, (64,), eps=2.0**-23))  # eps=None


def test_reference_backward_matches_float64():
    """The reference's gradient formula against autograd, each style, in float64."""
    x, w = make_inputs((7, 129), torch.float64, "cpu")
    dy = torch.randn(7, 129, dtype=torch.float64)
    for style in STYLES:
        y64, dx64, dw64 = float64_truth(x, w, dy, style, EPS)
        _, rstd = ref.rms_norm_fwd_ref(x, w, EPS, style)
        dx, dw, y = ref.rms_norm_bwd_ref(dy, x, w, rstd, style, True)
        for name, ours, want in (("y", y, y64), ("dx", dx, dx64), ("dw", dw, dw64)):
            assert rel_error(ours, want) < 1e-12, f"{style} {name}"


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x, w, r: kernels.rms_norm_fwd(x, w, EPS, "rms"), ValueError, "style must be one of"),
        (lambda x, w, r: kernels.rms_norm_fwd(x, w[:5], EPS, "torch"), ValueError, "weight must have shape (8,)"),
        (lambda x, w, r: kernels.rms_norm_fwd(x, None, EPS, "llama"), ValueError, "weight is required for style"),
        (lambda x, w, r: kernels.rms_norm_fwd(x.long(), w, EPS, "torch"), TypeError, "x must have dtype"),
        (lambda x, w, r: kernels.rms_norm_fwd(x[None], w, EPS, "torch"), ValueError, "x must have 2 dims"),
        (lambda x, w, r: kernels.rms_norm_fwd(x, w.int(), EPS, "t5"), TypeError, "weight must have dtype"),
        (lambda x, w, r: kernels.rms_norm_fwd(x, w.to("meta"), EPS, "gemma"), ValueError, "weight is on meta"),
        (lambda x, w, r: kernels.rms_norm_fwd(x, w, -1.0, "torch"), ValueError, "eps must be"),
        (lambda x, w, r: kernels.rms_norm_fwd(x, w, None, "torch"), ValueError, "eps must be"),
        (lambda x, w, r: kernels.rms_norm_bwd(x[:2], x, w, r, "torch", False), ValueError, "dy must have shape (3, 8)"),
        (lambda x, w, r: kernels.rms_norm_bwd(x, x, w, r.half(), "torch", False), TypeError, "rstd must have dtype"),
        (lambda x, w, r: kernels.rms_norm_bwd(x, x, w, r[:1], "torch", False), ValueError, "rstd must have shape (3,)"),
        (lambda x, w, r: kernels.rms_norm_bwd(x, x, w, r, "gemma2", False), ValueError, "style must be one of"),
    ],
    ids=["style", "weight-shape", "weight-required", "int-x", "3d-x", "weight-dtype", "weight-device", "eps",
         "eps-none", "dy-shape", "rstd-dtype", "rstd-shape", "bwd-style"],
)
def test_bad_input_is_named(call, error, words):
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(error) as caught:
        call(x, w, torch.ones(3))
    assert words in str(caught.value)
