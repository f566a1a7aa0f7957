"""Forward passes that read tensor values, specialized for the example input as torch.compile does.

A forward pass that turns a tensor into a Python value (`.item()`, `bool(t)`, `torch.equal`: ops tagged
`data_dependent_output`, e.g. Hugging Face's check that an attention mask masks nothing, `mask.all()`) cannot
be traced on fake tensors alone. While `capture` traces, `ValueReads` answers such an op with the value the
example inputs give: it cuts the ops the read tensor is computed from out of the graph traced so far (a
*guard*), runs them on the real example tensors and hands the value to the forward pass, which goes on down
the branch that value picks. The captured step is then right for that value only: each read of a value
computed from the step's arguments (one computed from constants alone, as transformers' packed-sequence check
on `arange` positions, is the same on every batch and is not recorded) is a
`Specialization` (op, where, value, guard), recorded in the graph (`Graph.specialized`, part of its
fingerprint and so of a policy's) and checked on every batch the step is given (`check`): a batch whose guard
gives another value is refused with `ValueMismatch`, naming the op and both values.

A read whose guard needs a tensor that has no values at capture (a parameter or input on the meta device)
cannot be specialized: `capture` refuses it, saying which tensor to give real values. Besides public APIs this
relies on `torch.fx.experimental.proxy_tensor`'s `get_proxy_mode` and `get_proxy_slot` (the graph being traced).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from gaswap.base.errors import BadInput, Refusal


class ValueMismatch(Refusal):
    """A batch whose values send the forward pass down another branch than the one the step was captured for."""


class ValueNeeded(BadInput):
    """A read whose guard needs a tensor without values (meta) at capture; `capture` turns it into a CaptureError."""


@dataclass(frozen=True)
class Specialization:
    """One value the captured step is specialized on: `op` (an aten op's name) read `value` `where` (the traced
    tensor and its module); `guard(*args)` recomputes it from the step's arguments at `indices` (positions in
    `Captured.placeholders`)."""

    op: str
    where: str
    value: bool | int | float
    guard: fx.GraphModule
    indices: tuple[int, ...]

    def record(self) -> tuple[str, str, bool | int | float]:
        """(op, where, value): what `Graph.specialized` holds."""
        return (self.op, self.where, self.value)


class ValueReads(TorchDispatchMode):
    """Inside `make_fx`, answers the ops that read tensor values with the example's values (see the module
    docstring). `real[i]` is the real tensor of the traced function's i-th argument (None where there is none),
    `labels[i]` its name in messages; `layer()` names the module being traced. The reads are in `specialized`, in the order they happened."""

    def __init__(self, real: list, labels: list[str], layer):
        super().__init__()
        self.real, self.labels, self.layer = real, labels, layer
        self.specialized: list[Specialization] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.data_dependent_output not in func.tags:
            return func(*args, **kwargs)
        try:  # constants (tensors made in forward) have values: the tracer answers itself
            return func(*args, **kwargs)
        except DataDependentOutputException:
            pass
        tracer = get_proxy_mode().tracer
        guard, indices, read = _guard(tracer, func, args, kwargs)
        where = f"{read} in {self.layer()}"
        missing = [i for i in indices if not _has_values(self.real[i])]
        if missing:
            raise ValueNeeded(f"op {func} reads the value of {where}, computed from {self.labels[missing[0]]}, "
                              f"which has no values (on the meta device)")
        value = evaluate(guard, [self.real[i] for i in indices])
        if indices:  # a value computed from no argument (e.g. from `arange`) is the same on every batch
            self.specialized.append(Specialization(str(func), where, value, guard, indices))
        return value


def _has_values(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "meta"


def _guard(tracer, func, args, kwargs) -> tuple[fx.GraphModule, tuple[int, ...], str]:
    """The ops of the graph traced so far that `func(*args, **kwargs)` depends on, ending with it, as a
    GraphModule of the traced arguments it reads; their positions among the traced arguments; the name of the
    (first) tensor read."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    nodes = [get_proxy_slot(a, tracer).proxy.node if isinstance(a, torch.Tensor) else None for a in flat]
    needed = ancestors(nodes)
    placeholders = [n for n in tracer.graph.nodes if n.op == "placeholder"]
    g, env, indices = fx.Graph(), {}, []
    for node in tracer.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            env[node] = g.placeholder(node.name)
            indices.append(placeholders.index(node))
        else:
            env[node] = g.node_copy(node, env.__getitem__)
    call_args, call_kwargs = pytree.tree_unflatten([a if n is None else env[n] for a, n in zip(flat, nodes)], spec)
    g.output(g.call_function(func, tuple(call_args), dict(call_kwargs)))
    read = next(n.name for n in nodes if n is not None)
    return fx.GraphModule(tracer.root, g), tuple(indices), read


def ancestors(roots) -> set[fx.Node]:
    """The fx nodes among `roots` and every node they depend on (capture's and the partitioner's graph walk too)."""
    seen, todo = set(), [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def evaluate(guard: fx.GraphModule, args: list):
    """The value `guard` computes from real tensors, with every tracing mode, functorch transform and autocast
    off, and on the device of the tensors (its constants moved there)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    with _disable_current_modes(), torch._C._DisableFuncTorch(), torch.no_grad(), \
            torch.autocast(device.type, enabled=False):
        return _on(guard, device)(*args)


def _on(guard: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """`guard` with its device arguments and tensor constants on `device` (itself on the CPU)."""
    if device.type == "cpu":
        return guard
    moved = copy.deepcopy(guard).to(device)
    for node in moved.graph.nodes:
        node.args, node.kwargs = fx.node.map_aggregate(
            (node.args, node.kwargs), lambda a: device if isinstance(a, torch.device) else a)
    moved.recompile()
    return moved


def check(specialized, args: list) -> None:
    """ValueMismatch if a batch (`args`, the step's arguments) gives a read another value than the step was
    captured with; a guard needing an argument not given (None) is not checked."""
    for s in specialized:
        needed = [args[i] for i in s.indices]
        if any(a is None for a in needed):
            continue
        value = evaluate(s.guard, needed)
        if value != s.value:
            raise ValueMismatch(
                f"this batch gives {value!r} where the step was captured with {s.value!r}: op {s.op} reads the value "
                f"of {s.where}, and the captured step (like torch.compile's) is only right for the value it saw. "
                f"Capture (search) with a batch like this one, or make the forward pass depend on shapes only")
