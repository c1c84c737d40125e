"""The one swap mechanism: a converted module is the stock instance (or a shallow copy of it) with
a remat class, holding the very same parameters and submodules; `remat_fused` marks it converted,
and its remat_revert() gives the stock class back."""

import copy


def join(path, name):
    """The dotted path of child `name` of the module at `path` ("" for the root)."""
    return f"{path}.{name}" if path else name


def with_class(module, cls):
    """A shallow copy of `module` as class `cls` (a stock class or its state-free remat subclass):
    the same parameter, buffer and submodule objects."""
    new = copy.copy(module)
    new.__class__ = cls
    return new


def strip(module, stock_class):
    """`module` as `stock_class` again, without the remat_* entries conversion added to its __dict__."""
    stock = with_class(module, stock_class)
    for name in [n for n in vars(stock) if n.startswith("remat_")]:
        del stock.__dict__[name]
    return stock


def is_converted(module):
    """True for a module remat.convert made (it is converted already)."""
    return bool(getattr(module, "remat_fused", False))
