"""The conversion report: one row per candidate module, swapped, kept or skipped and why, with what
each swap saves, and the counts of the calls that ran a stock forward. "kept": a module left as it
is that runs on remat all the same (an attention module whose attention function is remat's through
transformers' attention interface)."""

import collections

from .._guards import fallback_counts

# saves: a function giving the activation bytes per token the swap keeps less than stock, under the
# model's requires_grad when it is called (None for skipped rows).
ReportRow = collections.namedtuple("ReportRow", "path type action reason saves", defaults=(None,))
_NOT_SWAPPED = ("skipped", "kept")  # the actions of rows that swap nothing (no saves)


def _no_saving():
    return 0


class ConversionReport(list):
    """A list of ReportRow(path, type, action, reason, saves); str() is a table.

    saved_bytes_per_token() totals what the swaps keep less than stock, per token of a layer's input
    (the bytes of the activation dtype, taken as the parameters'), for layers whose input requires
    grad, under the requires_grad of the model's parameters at the time of asking: freeze weights or
    add LoRA adapters after conversion and it changes as the saving does. fallbacks() counts the
    calls that ran a stock forward instead, per module and reason.
    """

    model = None  # a weak reference to the converted model, set by convert()

    def add(self, path, module, action, reason="", saves=None):
        if action not in _NOT_SWAPPED and saves is None:
            saves = _no_saving
        self.append(ReportRow(path or "(root)", type(module).__name__, action, reason, saves))

    @property
    def swapped(self):
        return [row for row in self if row.action not in _NOT_SWAPPED]

    @property
    def kept(self):
        return [row for row in self if row.action == "kept"]

    @property
    def skipped(self):
        return [row for row in self if row.action == "skipped"]

    def saved_bytes_per_token(self):
        """Activation bytes per token all the swaps keep less than stock, at the current requires_grad."""
        return sum(row.saves() for row in self.swapped)

    def fallbacks(self):
        """{module path: {reason: calls}} of the converted modules that ran their stock forward."""
        model = self.model() if self.model is not None else None
        return fallback_counts(model) if model is not None else {}

    def __str__(self):
        header = ("module", "type", "action", "saves B/token", "reason")
        rows = [header] + [(row.path, row.type, row.action, "" if row.saves is None else str(row.saves()),
                            row.reason) for row in self]
        widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
        lines = []
        for n, row in enumerate(rows):
            cells = [str(row[i]).ljust(widths[i]) for i in range(4)] + [row[4]]
            lines.append("  ".join(cells).rstrip())
            if n == 0:
                lines.append("  ".join("-" * w for w in widths) + "  ------")
        kept = f"{len(self.kept)} kept, " if self.kept else ""
        lines.append(f"{len(self.swapped)} swapped, {kept}{len(self.skipped)} skipped; "
                     f"{self.saved_bytes_per_token()} activation bytes saved per token "
                     "(for layers whose input requires grad, at the current requires_grad)")
        return "\n".join(lines)

    def __repr__(self):
        return (f"ConversionReport({len(self)} rows: {len(self.swapped)} swapped, {len(self.kept)} kept, "
                f"{len(self.skipped)} skipped, "
                f"{self.saved_bytes_per_token()} bytes/token saved)")
