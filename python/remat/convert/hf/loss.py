"""A causal LM's head and loss on remat.linear_cross_entropy: in training, with labels, the model
computes its loss without the (tokens x vocabulary) logits.

A `*ForCausalLM` forward runs its base model, projects the last hidden states with `lm_head` into
logits and hands them to transformers' ForCausalLMLoss, which shifts the labels, upcasts the logits
to fp32 and keeps their log-softmax for the backward: 4 bytes per logit, beside the logits the output
holds. remat.convert gives such a model a class (named as its stock class, so that save_pretrained
writes the same architecture) whose forward, for a training call with labels, runs the base model
and `remat.linear_cross_entropy(hidden, lm_head.weight, shifted labels)` (with the config's
final_logit_softcapping, the Trainer's num_items_in_batch, a caller's shift_labels) and returns the
stock output with `logits=None`. Every other call (evaluation, generation, no labels, logits_to_keep,
positional arguments beyond the first) runs the stock forward, logits and all. So does a training call
that the fused loss would answer otherwise than stock, with a RematFallbackWarning saying why: one that
asks for the output tuple (return_dict=False, or the config's), whose second entry is the logits, and
one after `model.loss_function` was replaced (the probe proved the loss function the model had then).
A head FSDP2 shards in a group of its own, or ZeRO-3 partitions, computes the fused loss inside its own
call (engine_head). A column-parallel head (tensor parallel: ColwiseParallel on lm_head, whatever its output
layout) computes it on its shard of the vocabulary, the log-sum-exp combined across the ranks: the logits
are never gathered (remat.linear_cross_entropy with a DTensor weight).

Whether the model computes that loss is proved once, at conversion, by a probe: a small batch through
the stock forward and through the fused path must give the same loss. A model whose head or loss does
more (a logit scale, a mixture-of-experts auxiliary loss, another loss_type) fails it and stays stock,
with the reason in the report.
"""

import contextlib
import functools
import inspect
import sys

import torch
from torch import nn

from ... import _tensor_parallel as tensor_parallel
from ... import _zero3 as zero3
from ..._guards import fallback, hook_reason, tensor_reason
from ...ops.linear_cross_entropy import linear_cross_entropy
from ..swap import strip
from .probe import failed, mismatch, training_mode

_CLASSES = {}


def convert_loss(model, path, report):
    """Give the Hugging Face causal LM `model` the fused head and loss where its probe proves them the
    stock ones (in place: the model's class changes, nothing else); report what was done or why not."""
    if not _is_causal_lm(model):
        return
    reason = _head_reason(model)
    if reason is None:
        stock_class = type(model)
        model.__class__ = _fused_class(stock_class)
        model.__dict__["remat_head"] = model.get_output_embeddings()
        model.__dict__["remat_loss_function"] = model.loss_function  # the one the probe proves
        reason = _probe(model, stock_class)
        if reason is not None:
            _unfuse(model)
    if reason is not None:
        report.add(path, model, "skipped", f"LM head and loss kept stock: {reason}")
        return
    vocab = model.get_output_embeddings().out_features
    report.add(path, model, "LM head + loss fused (remat.linear_cross_entropy)",
               "in training with labels: no logits, their fp32 log-softmax not kept (4 B a logit), the fp32 "
               "log-sum-exp kept (4 B a token); evaluation and generation compute logits as stock",
               lambda: 4 * vocab - 4)


def revert_loss(model):
    """The stock class back, in place."""
    if "remat_head" in model.__dict__:
        _unfuse(model)


def _is_causal_lm(model):
    parameters = inspect.signature(type(model).forward).parameters
    return ("labels" in parameters and "logits_to_keep" in parameters and model.base_model is not model
            and isinstance(model.get_output_embeddings(), nn.Linear))


def _head_reason(model):
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"the head is a {type(head).__name__}, not an nn.Linear"
    reason = hook_reason(head) or tensor_reason("lm_head.weight", head.weight)
    if reason or head.bias is not None and (reason := tensor_reason("lm_head.bias", head.bias)):
        return reason
    if "forward" in vars(model):
        return "its forward is replaced on the instance"
    return None


def _fused_class(stock_class):
    """The class of a converted causal LM of `stock_class`: its name (save_pretrained writes the class
    name as the architecture, which loads back as the stock class), this module's (it pickles)."""
    cls = _CLASSES.get(stock_class)
    if cls is None:
        name = stock_class.__name__
        cls = type(name, (_FusedLossLM, stock_class), {"__module__": __name__, "__qualname__": f"fused.{name}",
                                                        "remat_stock": stock_class,
                                                        "remat_input": _first_input(stock_class),
                                                        "forward": _with_stock_signature(stock_class)})
        _CLASSES[stock_class] = cls
        fused.__dict__[name] = cls
    return cls


class _Namespace:
    """The converted classes, by their stock names, for pickle (module attribute `fused`)."""


fused = _Namespace()


def _with_stock_signature(stock_class):
    """_FusedLossLM.forward under the stock forward's signature and documentation: the Trainer keeps the
    dataset's columns that the forward's signature names, and users read its help."""
    def forward(self, *args, **kwargs):
        return _FusedLossLM.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(stock_class.forward)
    forward.__doc__ = stock_class.forward.__doc__
    return forward


def _first_input(stock_class):
    """The name of the forward's first argument after self (input_ids): the one positional argument
    the fused path takes."""
    return list(inspect.signature(stock_class.forward).parameters)[1]


# What the fused class leaves on the model (the experts' implementation, also kept on the model, is not its own).
_FUSED_ENTRIES = ("remat_head", "remat_loss_function", "remat_fallbacks", "remat_decided")


def _unfuse(model):
    stock = model.remat_stock
    for name in _FUSED_ENTRIES:
        model.__dict__.pop(name, None)
    model.__class__ = stock


class _FusedLossLM:
    """The forward of a converted causal LM (see the module's docstring)."""

    remat_fused = True

    def forward(self, *args, labels=None, logits_to_keep=0, **kwargs):
        if self.training and labels is not None:  # a training step's loss: fused, or a warning saying why not
            reason = self._remat_refusal(args, logits_to_keep, kwargs)
            if reason is None:
                if args:
                    kwargs[self.remat_input] = args[0]
                kwargs.pop("return_dict", None)  # a ModelOutput: _remat_refusal made sure one is asked for
                return self._remat_fused_forward(labels, kwargs)
            fallback(self, reason, runs="its stock forward (the logits and transformers' loss)")
        return self.remat_stock.forward(self, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)

    def _remat_refusal(self, args, logits_to_keep, kwargs):
        """Why a training call with labels must run stock (the fused loss would answer it otherwise than the
        stock forward does, or cannot read the head as it is now); None for none."""
        head = self.get_output_embeddings()
        if not isinstance(logits_to_keep, int) or logits_to_keep != 0:
            return "logits_to_keep asks for some positions' logits, which the fused loss does not compute"
        if len(args) > 1:
            return "more than input_ids passed positionally"
        if head is not self.__dict__["remat_head"]:
            return "the output embeddings were replaced after remat.convert"
        if engine_head(head):
            reason = None
        elif tensor_parallel.is_sharded(head):  # its shard of the vocabulary, or why not
            reason = tensor_parallel.column_reason(head, "lm_head")
        else:
            reason = hook_reason(head) or next(filter(None, (
                tensor_reason(f"lm_head.{n}", p) for n, p in head.named_parameters(recurse=False))), None)
        if reason:  # a tensor-parallel plan other than column-parallel, FSDP2 sharding the head with its parent
            return f"the LM head: {reason}"
        if _asks_router_logits(self.config, kwargs):
            return "the router's logits are asked for (output_router_logits): their auxiliary loss is added"
        if _asks_tuple(self.config, kwargs):
            return ("return_dict=False asks for the output tuple, whose second entry is the logits, which the fused "
                    "loss does not compute (return_dict=True keeps the fused loss)")
        if not _same_callable(self.loss_function, self.__dict__.get("remat_loss_function")):
            return ("model.loss_function was replaced after remat.convert, whose probe proved the fused loss equal "
                    "to the one it had then: the stock forward calls the new one")
        return None

    def _remat_fused_forward(self, labels, kwargs):
        loss, outputs = self._remat_fused_loss(labels, kwargs)
        return _output_class(self)(loss=loss, logits=None, **_passed_on(outputs))

    def _remat_fused_loss(self, labels, kwargs):
        """(the loss, the base model's outputs) of a call's keyword arguments."""
        shift_labels = kwargs.pop("shift_labels", None)
        if getattr(self.config, "return_dict", True) is not True:  # else the base model returns a tuple
            kwargs = {**kwargs, "return_dict": True}
        outputs = self.base_model(**kwargs)
        hidden = outputs[0]
        if shift_labels is None:  # tokens < n predict n, as transformers' ForCausalLMLoss shifts them
            shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        head = self.get_output_embeddings()
        loss = functools.partial(linear_cross_entropy, target=shift_labels.flatten().to(hidden.device),
                                 softcap=getattr(self.config, "final_logit_softcapping", None),
                                 num_items_in_batch=kwargs.get("num_items_in_batch"))
        if engine_head(head):  # computed inside the head's own call: FSDP2 or ZeRO-3 gathers its weight there
            with _computing(head, loss):
                return head(hidden.flatten(0, -2)), outputs
        if tensor_parallel.is_sharded(head):  # the input as the head's layout hook hands it over (a DTensor)
            hidden = tensor_parallel.head_input(head, hidden)
        return loss(hidden.flatten(0, -2), head.weight, bias=head.bias), outputs

    def remat_revert(self):
        return strip(self, self.remat_stock)


def engine_head(head):
    """Whether an engine that gathers parameters in a module's own call shards the nn.Linear `head`, and
    nothing else hooks it: FSDP2 with the head in a group of its own (fully_shard(model.lm_head)), or
    DeepSpeed ZeRO-3. The fused loss is then computed inside the head's own call (_computing), where
    the engine's hooks gather its weight and set up its gradient's reduction, as for the logits stock
    computes there."""
    if not torch.distributed.is_available() or type(head).forward is not nn.Linear.forward:
        return False
    from torch.distributed.fsdp import FSDPModule

    if zero3.partitioned(head):
        return hook_reason(head, allow=zero3.is_hook) is None
    hooks = [*head._forward_pre_hooks.values(), *head._forward_hooks.values()]
    return isinstance(head, FSDPModule) and not head._backward_hooks and not head._backward_pre_hooks and \
        hook_reason(head, skip=("_forward_hooks", "_forward_pre_hooks")) is None and \
        all(type(getattr(hook, "__self__", None)).__module__.startswith("torch.distributed.fsdp.") for hook in hooks)


@contextlib.contextmanager
def _computing(head, loss):
    """While inside, a call of `head` (its hooks and all) returns loss(x, weight, bias=bias) of its input x
    and its weight and bias as they are in the call (gathered by the engine's hooks), not the logits."""
    def forward(x):
        reason = tensor_reason("lm_head.weight", head.weight) or tensor_reason("lm_head.bias", head.bias)
        if reason:  # FSDP2 and ZeRO-3 gather plain tensors; one sharded otherwise too (with tensor parallel) is not
            raise RuntimeError(f"remat's fused LM loss inside the head's own call: {reason}")
        return loss(x, head.weight, bias=head.bias)

    head.__dict__["forward"] = forward
    try:
        yield
    finally:
        del head.__dict__["forward"]


def _asks_router_logits(config, kwargs):
    """A mixture-of-experts model asked for its router's logits adds their auxiliary loss to the loss."""
    return bool(kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)))


def _asks_tuple(config, kwargs):
    """Whether a call asks for the output tuple: return_dict=False, or no return_dict and the config's not
    True, as transformers' can_return_tuple decides it for the stock forward."""
    return_dict = getattr(config, "return_dict", True)
    passed = kwargs.get("return_dict", return_dict)
    return not (return_dict if passed is None else passed)


def _same_callable(current, proved):
    """Whether the loss function now is the one the probe proved: the same object, or an equal bound
    method (a deep copy of the model makes a new one of the same function and model)."""
    return current is proved or current == proved


def _passed_on(outputs):
    """The base model's outputs a causal LM's output carries on (all but its last hidden state)."""
    return {k: v for k, v in outputs.items() if k != "last_hidden_state"}


def _output_class(model):
    """The stock forward's output class: CausalLMOutputWithPast, from the model file or transformers."""
    module = sys.modules[model.remat_stock.__module__]
    found = getattr(module, "CausalLMOutputWithPast", None)
    if found is None:
        from transformers.modeling_outputs import CausalLMOutputWithPast as found
    return found


def _probe(model, stock_class):
    """None when the fused path gives the stock loss on a small batch, else why not."""
    head = model.get_output_embeddings()
    if head.weight.is_meta:
        return None  # nothing to run on (remat memory's meta models): not probed, as the other rules
    generator = torch.Generator().manual_seed(0)
    vocab = head.out_features
    ids = torch.randint(0, vocab, (2, 5), generator=generator).to(head.weight.device)
    try:
        with torch.no_grad(), training_mode(False, model):  # no dropout in either
            want = stock_class.forward(model, input_ids=ids, labels=ids, return_dict=True)
            loss, outputs = model._remat_fused_loss(ids, {"input_ids": ids})
    except Exception as error:  # noqa: BLE001 - a forward the fused path does not know how to call
        return failed(error)
    extra = sorted(set(want) - {"loss", "logits"} - set(_passed_on(outputs)))
    if extra or _asks_router_logits(model.config, {}):
        return f"its output holds {', '.join(extra or ['router_logits'])} besides the loss and the base model's outputs"
    return mismatch(loss, want.loss, head.weight.dtype, "its head or loss computes more than cross-entropy of "
                    "lm_head's logits (a logit scale, an auxiliary loss, another loss_type)")
