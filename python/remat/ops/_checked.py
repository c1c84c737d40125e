"""Checked: what a caller passing the same parameters at every call keeps of a fused op (remat.ops.fused):
its full argument check, passed once, and the call itself, every argument but x worked out."""

import torch

from .._validate import autocast_dtype


class Checked:
    """What a caller passing the same parameters at every call (a converted module: its fingerprint,
    _guards.decided, guards their classes, dtypes and shapes) keeps of the fused op's full argument
    check: the input's dtype, width and device it passed with. While x is like that input, outside
    autocast, and no Linear has LoRA adapters (which the fingerprint does not cover), only the
    parameters' data are read, unchecked; any other call is checked in full and, passing, is the one
    compared from then on. A new verdict of the caller's (other parameters) takes a new Checked.

    It keeps the call too (keep): the fused Function with every argument but x worked out, holding the
    caller's very parameters (not copies), which the caller repeats on the next x like this one
    (kept_call) while its verdict stands, instead of building the arguments again: decided once, paid
    once. The caller compares what its fingerprint does not cover and the call was made for (its norm's
    eps, its activation, its recompute switch: module attributes); the call checks that the tensors a
    kernel reads whole are still contiguous (a .data replaced in place). keeps_calls False (a caller whose
    call gathers ZeRO-3 partitioned parameters first) keeps none."""

    __slots__ = ("_like", "_autocast", "_call", "_made_for", "_whole", "keeps_calls")

    def __init__(self, keeps_calls=True):
        self._like = self._autocast = self._call = self._made_for = None
        self._whole, self.keeps_calls = (), keeps_calls

    def holds(self, x, linears):
        return self._like_passed(x) and not any(linear.adapters for linear in linears)

    def _like_passed(self, x):
        """Whether x is like the input that passed, outside autocast."""
        if self._like is None or not isinstance(x, torch.Tensor) or x.dim() == 0 or \
                (x.dtype, x.shape[-1], x.device) != self._like:
            return False
        # autocast asked of the recorded device type only where it has one (autocast_dtype, decided once)
        return not (self._autocast and torch.is_autocast_enabled(self._autocast))

    def passed(self, x):
        """Record x, whose call passed the full check (not under autocast: the check saw its cast). Nothing
        while torch.compile traces: a traced call's check is not kept (the graph's guards stand for it), and
        torch 2.11's dynamo cannot trace torch.amp.is_autocast_available."""
        if torch.compiler.is_compiling():
            return
        if autocast_dtype(x.device.type) is None:
            self._like = (x.dtype, x.shape[-1], x.device)
            self._autocast = x.device.type if torch.amp.is_autocast_available(x.device.type) else None

    def keep(self, call, whole, made_for):
        """Keep `call` (made for an x holds() passed, and for `made_for`: the norm's eps or None, the
        Activation or None, the recompute switch) where `whole` says it may be kept (not
        None, remat.ops.fused._whole_as_given); returns it. Nothing kept while torch.compile traces."""
        if self.keeps_calls and whole is not None and not torch.compiler.is_compiling():
            self._call, self._whole, self._made_for = call, whole, made_for
        return call

    def __reduce__(self):  # a copy or a pickle checks afresh: the kept call holds this object's parameters
        return Checked, (self.keeps_calls,)

    def kept_call(self, x, eps, act, recompute):
        """The call kept for inputs like x, made for a norm of this `eps` (None without one), the Activation
        `act` (None for norm_linears) and this recompute switch; else None."""
        if self._call is None or (eps, act, recompute) != self._made_for or not self._like_passed(x):
            return None
        for tensor in self._whole:  # (a loop, not a generator: this runs at every kept call)
            if not tensor.is_contiguous():
                return None
        return self._call
