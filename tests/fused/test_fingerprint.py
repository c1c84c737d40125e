"""remat._C.same_fingerprint, the in-place comparison a converted module's kept verdict asks at every call
where the extension is built (remat._guards.unchanged): it answers "unchanged" exactly where the fingerprint
taken again in Python equals the kept one. Apart from the Hugging Face tests so that the oldest stack's run,
whose extension is built against its own torch, checks it too."""

import pytest
import torch
from torch import nn

from remat import _guards

from module_changes import double_output, scale_parametrization, to_subclass

pytestmark = pytest.mark.skipif(not _guards.native_comparison(),
                                reason="remat._C is not built here: the fingerprint is taken in Python")


def _guarded_modules():
    torch.manual_seed(0)
    return [nn.LayerNorm(6), nn.Linear(6, 5), nn.GELU(), None, nn.Linear(5, 3, bias=False)]


def _set_data(module, data):
    module.weight.data = data


FINGERPRINT_CHANGES = {
    "nothing": lambda m: None,
    "eval": lambda m: m[2].eval(),
    "forward hook": lambda m: m[1].register_forward_hook(double_output),
    "pre-hook": lambda m: m[4].register_forward_pre_hook(lambda mod, args: None),
    "backward hook": lambda m: m[0].register_full_backward_hook(lambda mod, gi, go: None),
    "backward pre-hook": lambda m: m[0].register_full_backward_pre_hook(lambda mod, go: None),
    "dtype in place": lambda m: m[1].to(torch.float64),  # .to() casts the same Parameter's data
    "shape in place": lambda m: _set_data(m[4], m[4].weight.data[:2]),
    "a parameter replaced": lambda m: setattr(m[1], "weight", nn.Parameter(m[1].weight.detach().clone())),
    "a bias dropped": lambda m: setattr(m[1], "bias", None),
    "a parameter added": lambda m: m[2].register_parameter("scale", nn.Parameter(torch.ones(1))),
    "a subclass parameter": lambda m: to_subclass(m[4]),
    "a parametrization": lambda m: scale_parametrization(m[1]),
    "a module replaced": lambda m: m.__setitem__(2, nn.GELU()),
    "a module gone": lambda m: m.__setitem__(4, None),
}


@pytest.mark.parametrize("change", FINGERPRINT_CHANGES)
def test_the_native_comparison_answers_what_the_fingerprint_does(change):
    """remat._C.same_fingerprint, which a converted module's kept verdict asks at every call where the
    extension is built, answers unchanged exactly where the fingerprint taken again equals the kept one."""
    modules = _guarded_modules()
    kept = _guards.fingerprint(modules)
    FINGERPRINT_CHANGES[change](modules)
    assert _guards.unchanged(kept, modules) == (change == "nothing") == (_guards.fingerprint(modules) == kept)


def test_the_native_comparison_sees_a_global_hook():
    modules = _guarded_modules()
    kept = _guards.fingerprint(modules)
    handle = torch.nn.modules.module.register_module_forward_hook(double_output)
    try:
        assert not _guards.unchanged(kept, modules)
    finally:
        handle.remove()
    assert _guards.unchanged(kept, modules)
    assert not _guards.unchanged(kept[:-1], modules) and not _guards.unchanged(kept + [1], modules)
