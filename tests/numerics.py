"""Measures shared by the tests: numerical error against a reference, and bytes saved by autograd."""

import torch

# Bound on ‖out − ref‖ / ‖ref‖ against a float64 reference. Each is a few times the rounding of
# the output dtype itself (unit roundoff: fp32 6e-8, fp16 4.9e-4, bf16 3.9e-3), leaving room for
# fp32 accumulation over up to ~1e5 terms.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_error(out, ref):
    """‖out − ref‖ / ‖ref‖ in float64 (0 when both are empty).

    Where the exact result is zero (dx of a LayerNorm over one element), the float64 reference
    holds only rounding noise (~1e-14), so the scale has a floor of 1e-6 per element: the error
    is then measured absolutely, at a level far below any real gradient.
    """
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double(), ref.double()
    scale = max(ref.norm().item(), 1e-6 * ref.numel() ** 0.5)
    return (out - ref).norm().item() / scale


def assert_close_to_ref(name, out, ref, dtype):
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    error = rel_error(out, ref)
    assert error <= REL_TOL[dtype], f"{name}: relative error {error:.3g} > {REL_TOL[dtype]:.1g} ({dtype})"


def saved_bytes(fn, exclude=()):
    """Bytes of the unique storages autograd saves while running fn(), leaving out those of `exclude`.

    Pass a model's parameters as `exclude` to count activations only.
    """
    skipped = {t.untyped_storage().data_ptr() for t in exclude}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skipped:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def assert_compiled_matches_eager(model, x, tol=1e-5):
    """torch.compile(fullgraph=True) of model runs without a graph break and gives eager's output and gradients."""
    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True)(x)
    out.sum().backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = model(x)
    expected.sum().backward()
    assert rel_error(out, expected) < tol
    for (name, p), got in zip(model.named_parameters(), compiled_grads):
        assert rel_error(got, p.grad) < tol, name
