"""Capture the single-device step that `gaswap.plan.sharding` turns into one rank's step: the graph, the FSDP
units (module paths) and, per trainable parameter, its tensor in the graph, its module path, shape, dtype size
and gradient tensor."""
from __future__ import annotations

from torch import nn

from gaswap.plan.sharding import ParamSpec
from gaswap.run.capture import Captured, capture


def fsdp_units(model: nn.Module, unit_classes=()) -> list[str]:
    """Module paths of the modules of `unit_classes` (the FSDP units, e.g. every decoder layer), then "" (the
    root, which holds what no unit claims); fully_shard is applied in this order (innermost first)."""
    classes = tuple(unit_classes)
    return [name for name, m in model.named_modules() if name and classes and isinstance(m, classes)] + [""]


def param_specs(model: nn.Module, captured: Captured) -> list[ParamSpec]:
    """One ParamSpec per trainable parameter of `model`, in `named_parameters` order (FSDP's order)."""
    params = [(name, src) for name, kind, src in captured.placeholders if kind == "param"]
    named = dict(model.named_parameters())
    return [ParamSpec(name, src, tuple(named[src].shape), named[src].element_size(), grad)
            for (name, src), grad in zip(params, captured.grads)]


def capture_for_sharding(model: nn.Module, inputs, target=None, loss: str = "sum", *, optimizer: str = "adam",
                         unit_classes=(), autocast=None, eager: bool = True):
    """(captured step, FSDP units, parameter specs) of `model` (any device, meta included: fake tensors).
    `eager` (the default): the step as eager autograd runs it, which FSDP2 does (`gaswap.run.capture.capture`'s
    `eager`: eager's backward kernels, in-place ops in place, what an autograd node holds freed when it is done);
    False: the functionalized step gaswap's single-device runtime replays."""
    if target is None:  # losses that take none ("sum") still get a scalar placeholder
        import torch

        target = torch.empty((), device="meta")
    captured = capture(model, inputs, target, loss, optimizer=optimizer, autocast=autocast, eager=eager)
    return captured, fsdp_units(model, unit_classes), param_specs(model, captured)
