"""budget_kind="peak": the budget is a whole training step's peak on the device, not only the
activations kept for the backward.

The peak is a model, not a measurement:

    peak = fixed + saved + transient
    fixed     = parameters + buffers + gradients + optimizer state (exact, from the model)
    saved     = the bytes the plan keeps for the backward (exact, as counted for budget_kind="saved")
    transient = the largest of, over the units and outside them, what a unit's backward holds
                besides: what its choice rebuilds (stock's bytes less the choice's, for the unit;
                for "offload", what comes back from the host) and twice its largest op output
                (that output's gradient and its input's gradient, alive together)

It assumes every kept byte is still alive when the largest transient happens (so it overstates
the peak a little: the backward frees the later units' bytes as it goes), and it leaves out the
allocator's rounding and fragmentation, the optimizer step's own temporaries and whatever else the
process holds. On a GPU, check it against torch.cuda.max_memory_allocated.

Optimizer state: a name of OPTIMIZER_STATES (the states torch.optim keeps per parameter element,
each in the parameter's dtype: Adam and AdamW two, SGD with momentum one), or an int of bytes per
parameter element that trains (12 for fp32 master weights and Adam's two fp32 states beside bf16
weights). None: no optimizer state.
"""

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


def fixed_bytes(model, optimizer=None):
    """Bytes a training step holds whatever the plan: parameters, buffers, the gradients of the
    parameters that train, and the optimizer state (see the module docstring)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:  # tied weights once
        storages[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
    trained = [p for p in model.parameters() if p.requires_grad]
    gradients = sum(p.numel() * p.element_size() for p in trained)
    return sum(storages.values()) + gradients + _optimizer_bytes(trained, optimizer)


def _optimizer_bytes(trained, optimizer):
    if optimizer is None:
        return 0
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZER_STATES:
        return OPTIMIZER_STATES[optimizer.lower()] * sum(p.numel() * p.element_size() for p in trained)
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        return optimizer * sum(p.numel() for p in trained)
    raise ValueError(f"optimizer must be None, one of {', '.join(OPTIMIZER_STATES)} or an int of bytes per "
                     f"parameter element >= 0, got {optimizer!r}")


def transient_bytes(choice, stock, saves):
    """The peak model's transient of one unit's backward under `choice`: stock, the unit's stock
    UnitSaves; saves, the choice's."""
    if choice == "offload":
        rebuilt = saves.offloaded_bytes
    else:
        rebuilt = max(0, stock.internal_bytes - saves.internal_bytes)
    return rebuilt + 2 * stock.work.largest_output
