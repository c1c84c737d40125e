"""DeepSpeed ZeRO-3: the parameters a fused op reads of modules it does not call.

ZeRO-3 partitions every parameter across the ranks and gathers a module's own in hooks around its
forward and its backward. A fused op reads parameters of other modules: a norm's weight inside the
projection after it (the norm's call only hands its input over), an MLP's projections inside the MLP.
DeepSpeed's public answer is `deepspeed.zero.register_external_parameter(module, parameter)`: the
parameter is gathered with `module`'s own, in its forward and in its backward. So a producer that hands
its work over (Handoff.give) lends its parameters to the modules that do it, at its call, before theirs;
a fused MLP registers its projections' at its call (gathered for that first one by deepspeed.zero.
GatheredParameters with fwd_module, as its documentation shows: ZeRO's hook had run by then). Nothing here
imports deepspeed unless a parameter is one ZeRO-3 partitioned (it carries a `ds_id`).
"""

import contextlib

_HOOKS_MODULE = "deepspeed.runtime.zero."  # where ZeRO-3's module hooks are defined (parameter_offload)


def is_hook(hook):
    """Whether `hook` is one of the hooks ZeRO-3 puts on every module (gather, release, backward set-up),
    or deepspeed's profiling wrapper around one (instrument_w_nvtx: the function it wraps in its closure)."""
    module = getattr(hook, "__module__", None) or ""
    if module == "deepspeed.utils.nvtx":
        return any(is_hook(cell.cell_contents) for cell in getattr(hook, "__closure__", None) or ()
                   if callable(cell.cell_contents))
    return module.startswith(_HOOKS_MODULE)


def partitioned(module):
    """Whether ZeRO-3 partitions `module`'s own parameters."""
    return bool(_partitioned_params([module]))


def any_partitioned(modules):
    """Whether ZeRO-3 partitions the own parameters of one of `modules` (None entries skipped): a fused op
    reading them gathers them first, at every call (no kept call, remat.ops.fused.Checked)."""
    return bool(_partitioned_params([m for m in modules if m is not None]))


def _partitioned_params(owners):
    """The own parameters of the modules `owners` that ZeRO-3 partitions."""
    return [p for owner in owners for p in owner._parameters.values() if p is not None and hasattr(p, "ds_id")]


def lend(owners, borrowers):
    """Register the own parameters of the modules `owners` as external parameters of each of `borrowers`
    (that ZeRO-3 partitions: the others need nothing); whether one was not registered before."""
    params = _partitioned_params(owners)
    new = [(b, p) for b in borrowers for p in params if id(p) not in getattr(b, "_external_params", {})]
    if new:
        import deepspeed  # a parameter carries a ds_id: deepspeed partitioned it, so it is imported

        register_external_parameter = deepspeed.zero.register_external_parameter

        for borrower, param in new:
            register_external_parameter(borrower, param)
    return bool(new)


def gathered(module, owners):
    """A context in which the ZeRO-3 partitioned parameters of the modules `owners`, which `module`'s fused op
    reads in its call, are whole: registered as `module`'s external parameters (gathered with its own from
    its next call on, forward and backward), and those not gathered yet (the call that registers them)
    gathered for this one. A null context where ZeRO-3 partitions none of them."""
    params = _partitioned_params(owners)
    if not params:
        return contextlib.nullcontext()
    lend(owners, [module])
    missing = [p for p in params if p.ds_status.name != "AVAILABLE"]
    if not missing:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(missing, fwd_module=module)
