"""nn.Sequential: runs of consecutive children fused by position (LayerNorm, Linear[, GELU, Linear]).

The fused module sits at the run's first index and nn.Identity at the others, so len() and
indices stay and the default forward is unchanged; the Sequential becomes a RematSequential whose
state_dict()/load_state_dict() translate between the fused module's names (`0.norm.weight`,
`0.linear.weight`) and the original ones (`0.weight`, `1.weight`).
"""

import collections

from torch import nn

from .patterns import LAYER_NORM_LINEAR, LAYER_NORM_MLP, MLP, fusable, fused_module, gelu_approximate
from .swap import join


class RematSequential(nn.Sequential):
    """An nn.Sequential in which runs of children were fused by remat.convert.

    The fused module sits at the run's first index and nn.Identity at the others, so the
    default forward is unchanged. `remat_runs` maps the fused child's name to
    {submodule name: original child name}, e.g. {"0": {"norm": "0", "linear": "1"}};
    state_dict() and load_state_dict() translate through it, so keys are the original ones.
    """

    remat_runs: dict  # set by remat.convert on the instance

    def _to_original(self, prefix):
        """{fused key prefix: original key prefix}, e.g. {"seq.0.linear.": "seq.1."}."""
        return {f"{prefix}{first}.{sub}.": f"{prefix}{orig}."
                for first, subs in self.remat_runs.items() for sub, orig in subs.items()}

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        local = collections.OrderedDict()
        local._metadata = collections.OrderedDict()
        super().state_dict(*args, destination=local, prefix=prefix, keep_vars=keep_vars)
        renames = self._to_original(prefix)

        def original_key(key):
            for fused, orig in renames.items():
                if key.startswith(fused):
                    return orig + key[len(fused):]
            return key

        order = {name: i for i, name in enumerate(self._modules)}

        def position(key):  # the original child's position, for the original order
            return order.get(key[len(prefix):].split(".", 1)[0], -1)

        items = sorted(((original_key(k), v) for k, v in local.items()), key=lambda kv: position(kv[0]))
        if destination is None:
            destination = collections.OrderedDict()
            destination._metadata = collections.OrderedDict()
        destination.update(items)
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None:
            fused_children = {f"{prefix}{first}" for first in self.remat_runs}
            for key, value in local._metadata.items():
                mapped = original_key(key + ".")[:-1]
                if key in fused_children:
                    continue  # the fused module itself: no counterpart in the original
                metadata[mapped] = value
        return destination

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Original keys -> fused keys, before the children read theirs from this same dict.
        for first, subs in self.remat_runs.items():
            fused = self._modules[first]
            for sub, orig in subs.items():
                names = set(fused.get_submodule(sub).state_dict(keep_vars=True))
                for name in names:
                    old = f"{prefix}{orig}.{name}"
                    if old in state_dict:
                        state_dict[f"{prefix}{first}.{sub}.{name}"] = state_dict.pop(old)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


# Each pattern as a Sequential holds it: the layers options it needs, which children may start a
# run of it (fusable judges the rest, with the reason), and the fused module's submodules by position.
SEQUENTIAL_RUNS = (
    (LAYER_NORM_MLP, {"mlp", "layernorm"},
     lambda w: type(w[0]) is nn.LayerNorm and type(w[1]) is nn.Linear and type(w[3]) is nn.Linear,
     {"norm": 0, "fc1": 1, "fc2": 3}),
    (MLP, {"mlp"},
     lambda w: type(w[0]) is nn.Linear and type(w[2]) is nn.Linear and gelu_approximate(w[1]) is not None,
     {"fc1": 0, "fc2": 2}),
    (LAYER_NORM_LINEAR, {"layernorm"},
     lambda w: type(w[0]) is nn.LayerNorm and type(w[1]) is nn.Linear,
     {"norm": 0, "linear": 1}),
)


def _run_at(children, i, options, path, names, report):
    """(fused module, {submodule: offset}, length) for the first pattern fusable at index i, or None
    (with a skip row for each pattern that could start there but is not fusable)."""
    for pattern, needs, starts, subs in SEQUENTIAL_RUNS:
        window = children[i:i + len(pattern.roles)]
        if not needs <= options.layers or len(window) < len(pattern.roles) or not starts(window):
            continue
        reason = fusable(pattern, window)
        if reason is None:
            return fused_module(pattern, window, options.recompute), subs, len(window)
        report.add(join(path, names[i]), children[i], "skipped", f"{pattern.name}: {reason}")
    return None


def sequential_runs(seq, options, path, report):
    """Fuse runs among the children of the nn.Sequential `seq`; {child name: handled}."""
    names = list(seq._modules)
    children = [seq._modules[n] for n in names]
    runs, handled = {}, set()
    i = 0
    while i < len(children):
        fused = _run_at(children, i, options, path, names, report)
        if fused is None:
            i += 1
            continue
        module, subs, length = fused
        members = names[i:i + length]
        seq._modules[members[0]] = module
        for name in members[1:]:
            seq._modules[name] = nn.Identity()
        runs[members[0]] = {sub: names[i + offset] for sub, offset in subs.items()}
        handled.update(members)
        types = ", ".join(type(c).__name__ for c in children[i:i + length])
        report.add(join(path, members[0]), children[i], f"swapped to {type(module).__name__}",
                   f"fused ({types}) from {members[0]} to {members[-1]}; Identity at the rest",
                   module.saved_bytes_per_token)
        i += length
    if runs:
        seq.__class__ = RematSequential
        seq.remat_runs = runs
    return handled


def revert_sequential(seq, revert_module):
    """The plain nn.Sequential again, its original children in place (each reverted by revert_module)."""
    names = list(seq._modules)
    for first, subs in seq.remat_runs.items():
        fused = seq._modules[first]
        for sub, orig in subs.items():
            seq._modules[orig] = revert_module(fused.get_submodule(sub))
        if "fc1" in subs:  # an MLP: the GELU between fc1 and fc2
            act_index = names[names.index(subs["fc1"]) + 1]
            seq._modules[act_index] = fused.__dict__["remat_activation"]
    seq.__class__ = nn.Sequential
    del seq.remat_runs
