"""Argument checks shared by every public op: each error names the argument and what was expected."""

import math
import operator

import torch

# float64 as the stock ops take it (gradcheck, numerics studies): it runs the references, which compute
# in it (the kernels compute in fp32).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dtype_names(dtypes):
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_float_tensor(name, value, dtypes=FLOAT_DTYPES):
    """`value` must be a tensor of one of `dtypes`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {value.dtype}")


def integer(value):
    """`value` as an int when it is one or integer-like as torch takes it (numpy's and torch's integer
    scalars: operator.index), else None; bools are not integers here."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):  # no operator.index of a tuple: torch
        return None  # 2.11's dynamo fails on it instead of raising TypeError
    try:
        return operator.index(value)
    except TypeError:  # a tensor of several elements, or of floats
        return None


def check_choice(name, value, choices):
    """`value` must be one of `choices` (names, such as a style or an activation)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_same_device(name, value, reference_name, reference):
    if value.device != reference.device:
        raise ValueError(
            f"{name} is on {value.device} but {reference_name} is on {reference.device}; "
            "move them to the same device"
        )


def check_shape(name, value, shape):
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")


def check_optional_param(name, value, shape, like_name, like):
    """An optional weight or bias: None, or a tensor of `shape` on `like`'s device, in its dtype or float32.

    The kernels compute in fp32, so a float32 parameter with a half-precision input is exact (as
    torch.nn.functional.layer_norm allows). Any other mix (a bfloat16 weight with a float16
    input, a float16 weight with a float32 input) is refused as PyTorch refuses it, rather than
    silently rounded to one of the two.
    """
    if value is None:
        return
    check_float_tensor(name, value)
    if value.dtype != like.dtype and value.dtype != torch.float32:
        allowed = tuple(dict.fromkeys((like.dtype, torch.float32)))
        raise TypeError(
            f"{name} must have dtype {_dtype_names(allowed)} ({like_name} is {_dtype_names((like.dtype,))}), "
            f"got {value.dtype}"
        )
    check_shape(name, value, shape)
    check_same_device(name, value, like_name, like)


def check_eps(eps):
    """eps must be a finite non-negative number: a negative one makes rsqrt(var + eps) NaN."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def check_self_attention_input(x, in_proj_weight, layout="(batch, seq, embed_dim)"):
    """x of a self-attention block: a 3-D float tensor of width embed_dim, on the weights' device and,
    outside autocast, in their dtype (inside, the projections cast it as torch's own layers do)."""
    check_float_tensor("x", x)
    embed_dim = in_proj_weight.shape[1]
    if x.dim() != 3 or x.shape[-1] != embed_dim:
        raise ValueError(f"x must have shape {layout} with embed_dim {embed_dim}, got {tuple(x.shape)}")
    check_same_device("x", x, "in_proj_weight", in_proj_weight)
    if autocast_dtype(x.device.type) is None and x.dtype != in_proj_weight.dtype:
        raise TypeError(f"x has dtype {x.dtype} but in_proj_weight has {in_proj_weight.dtype}; they must match")


def rows_with_unit_stride(x, width):
    """x as a (rows, width) matrix whose last dim has stride 1: a view when strides allow, else a copy."""
    count = x.numel() // width if width else math.prod(x.shape[:-1])
    rows = x.reshape(count, width)
    if rows.stride(-1) != 1 and rows.numel() > 0:
        rows = rows.contiguous()
    return rows


def autocast_dtype(device_type):
    """The autocast dtype when autocast is on for `device_type`, else None."""
    # Devices without autocast (meta, for shape-only runs) have none to apply; asking torch
    # whether it is enabled there raises instead. Skipped while torch.compile traces, which it does
    # on devices with autocast (and torch 2.11's dynamo cannot trace that question).
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(device_type):
        return None
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_dtype_for(x):
    """The dtype autocast casts the op's inputs to when `x` is a tensor of a device where autocast is
    on, else None. Asked before the argument checks: under autocast, an op accepts what the stock op
    accepts (rotary leaves q and k in fp32 beside a bf16 v; stock attention casts all three)."""
    return autocast_dtype(x.device.type) if isinstance(x, torch.Tensor) else None


def cast_for_autocast(dtype, *tensors):
    """The tensors cast to dtype as autocast casts them: floating ones but float64 (anything else,
    None included, stays as it is); autograd flows back through the casts."""
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)
