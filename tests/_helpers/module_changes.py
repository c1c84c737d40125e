"""Changes a user makes to modules after remat.convert, which a converted module's checks must see: a forward
hook that changes the output, a weight replaced by a tensor subclass (as quantised weights are), a parametrization."""

import torch
from torch import nn


def double_output(module, args, output):
    return output * 2


class Plain(torch.Tensor):
    """A tensor subclass that computes like a tensor (quantised weights are subclasses too)."""


def to_subclass(module):
    module.weight = nn.Parameter(torch.Tensor._make_subclass(Plain, module.weight.detach(), True))


def scale_parametrization(module):
    class Scale(nn.Module):
        def forward(self, weight):
            return weight * 1.5

    torch.nn.utils.parametrize.register_parametrization(module, "weight", Scale())
