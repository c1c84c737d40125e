"""remat.ops.fused's statistics shared between fused ops: SharedStatistics, the fp32 row statistics one fused
op computed of a norm over its input, handed to the next fused op applying the same norm to the same input,
which keeps those very tensors instead of its own (a parallel layer's x and statistics kept once)."""

import weakref

import torch

from .._tensor_memo import MISSING, TensorMemo


class SharedStatistics:
    """The fp32 row statistics a fused op computed of one norm over one input, handed to the next
    fused op applying the same norm to the same input (a parallel layer's attention and MLP, Phi's
    and GPT-J's), which keeps these very tensors for its backward instead of its own: saved once.

    The same kernel on the same input gives the same statistics bit for bit, so either op's are
    the other's. Holds weak references only: the statistics live while some backward keeps them,
    and the input must be the same tensor object, not modified in place since. Not used while
    torch.compile traces (each op then keeps its own).
    """

    def __init__(self):
        self._stored = TensorMemo()  # weak references to the statistics, for x

    def lookup(self, x):
        """The statistics stored for `x`, if still alive, else None."""
        refs = self._stored.get(_rows_of(x))
        if refs is MISSING:
            return None
        stats = tuple(s() for s in refs)
        return None if any(s is None for s in stats) else stats

    def store(self, x, stats):
        self._stored.put(_rows_of(x), tuple(weakref.ref(s) for s in stats))


def _rows_of(x):
    """The tensor whose rows x's rows are: x's base where x is a reshape of all of it keeping its last
    dimension (a mixture of experts' block and its router flatten the tokens, each in its own view),
    else x. Their row statistics are the same tensors."""
    base = x._base
    if base is not None and base.numel() == x.numel() and base.dim() and x.dim() and base.shape[-1] == x.shape[-1] \
            and base.is_contiguous() and x.is_contiguous() and base.data_ptr() == x.data_ptr():
        return base
    return x


class _StatisticsSlot:
    """What one fused op call exchanges with a SharedStatistics: the statistics given, and those kept."""

    def __init__(self, given):
        self.given, self.kept = given, None

    def exchange(self, stats):
        self.kept = self.given if self.given is not None else stats
        return self.kept


def exchange(slot, stats):
    return stats if slot is None else slot.exchange(stats)


def sharing(shared, x, call):
    """call(x, slot): the fused op with the statistics `shared` holds for `x`, storing those it kept (a
    kept call, which takes x and the slot, is passed as it is)."""
    if shared is None or torch.compiler.is_compiling():
        return call(x, None)
    slot = _StatisticsSlot(shared.lookup(x))
    out = call(x, slot)
    if slot.kept:
        shared.store(x, slot.kept)
    return out
