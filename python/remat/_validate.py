"""Argument checks shared by every public op: each error names the argument and what was expected."""

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes):
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_float_tensor(name, value, dtypes=FLOAT_DTYPES):
    """`value` must be a tensor of one of `dtypes`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {value.dtype}")


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
    """An optional weight or bias: None, or a float tensor of `shape` on `like`'s device."""
    if value is None:
        return
    check_float_tensor(name, value)
    check_shape(name, value, shape)
    check_same_device(name, value, like_name, like)


def rows_with_unit_stride(x, width):
    """x as a (rows, width) matrix whose last dim has stride 1: a view when strides allow, else a copy."""
    count = x.numel() // width if width else math.prod(x.shape[:-1])
    rows = x.reshape(count, width)
    if rows.stride(-1) != 1 and rows.numel() > 0:
        rows = rows.contiguous()
    return rows


def autocast_dtype(device_type):
    """The autocast dtype when autocast is on for `device_type`, else None."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def cast_for_autocast(dtype, *tensors):
    """The floating tensors cast to dtype (None stays None); autograd flows back through the casts."""
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)
