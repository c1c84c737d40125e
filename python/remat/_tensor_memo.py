"""A value remembered for one tensor as it is now.

Several places hand something from one call to the next for the very same input: a fused op's norm
statistics to the next op applying that norm to that x, q's fused output to k and v, a producer's
verdict to its consumer, the packing read once from position_ids for every layer. Each holds its
value only while the tensor is the same object, not modified in place since (its version), and
holds the tensor by a weak reference, so that remembering keeps nothing alive.
"""

import weakref

MISSING = object()  # what get() gives when nothing is remembered for the tensor (None may be a value)


class TensorMemo:
    """One value remembered for one tensor (put), given back for that tensor unchanged (get)."""

    __slots__ = ("_entry",)

    def __init__(self):
        self._entry = None  # (weak reference to the tensor, its version, the value)

    def get(self, tensor):
        """The value put for `tensor`, if it is the same object at the same version, else MISSING."""
        entry = self._entry
        if entry is None or entry[0]() is not tensor or entry[1] != tensor._version:
            return MISSING
        return entry[2]

    def put(self, tensor, value):
        self._entry = (weakref.ref(tensor), tensor._version, value)

    def clear(self):
        self._entry = None
