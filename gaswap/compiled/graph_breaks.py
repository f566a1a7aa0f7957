"""Why torch.compile cannot compile a model as one graph of static shapes, in one line a user can act on.

gaswap's compiled policies partition the one joint graph of a whole training step (`fullgraph=True,
dynamic=False`); a model torch.compile can only compile in pieces is refused (`partition.Uncompilable`, bad
input) with: the cause (dynamo's own name for it: an `nn.LSTM`, data-dependent branching, a call it cannot
trace, a shape that depends on the data), the module whose code breaks the graph and the line, and what to
do: rewrite that line, or (where gaswap's eager capture traces it: a graph break, not data-dependent ops)
plan the model for gaswap's eager runtime.
"""
from __future__ import annotations

import os

import torch
from torch import fx

EAGER = ("or plan it for gaswap's eager runtime, which captures the step without torch.compile: set "
         "`search_space: hybrid` and run `gaswap search` on the experiment")
_DATA = ("neither of gaswap's paths plans a step whose ops or shapes depend on the data (gaswap's eager capture "
         "refuses it too)")
_HINTS = {  # dynamo's graph-break type (its `gb_type`) -> what to do about it
    "Attempted to wrap RNN, GRU, or LSTM": "torch.compile does not trace nn.RNN, nn.GRU or nn.LSTM (nor does "
                                           "gaswap's eager capture): unroll it over time with nn.LSTMCell / "
                                           "nn.GRUCell, which both trace",
    "Data-dependent branching": f"make the branch a tensor operation (torch.where): {_DATA}",
    "data-dependent control flow": f"compute with the tensor instead of a Python value read from its data "
                                   f"(`.item()`, `if tensor:`): {_DATA}",
}


def explain(error: BaseException, model) -> str:
    """One line: what in `model` (a module or function) kept torch.compile from tracing it into one graph,
    raised as `error` (dynamo's exception, or what wraps it), where, and what to do."""
    cause = _dynamo_error(error)
    kind = getattr(cause, "gb_type", None)
    if kind is None and "data-dependent" in str(cause):
        kind = "data-dependent control flow"
    kind = kind or _first_line(cause)
    hint = _HINTS.get(kind, f"remove or rewrite that call, {EAGER}")
    return (f"torch.compile cannot compile {_name(model)} as one graph ({kind}){_where(cause, model)}: gaswap's "
            f"compiled policies need the whole training step in one graph of static shapes; {hint}")


def dynamic_shape(gm: fx.GraphModule) -> str | None:
    """One line naming the first node of a joint graph whose shape depends on the data (an unbacked size:
    boolean indexing, nonzero, unique), with its module and line, and what to do; None when all are static."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and any(
                not isinstance(d, int) for d in val.shape):
            where = module_path(node)
            line = _last_line(node.meta.get("stack_trace") or "")
            return (f"torch.compile cannot compile the model with static shapes: {node.name} "
                    f"({getattr(node.target, '__name__', node.target)}){' in ' + where if where else ''} has a shape that depends on the data"
                    f"{' (' + line + ')' if line else ''}: gaswap's compiled policies need every shape fixed by the "
                    f"inputs' (mask with torch.where instead of indexing with a boolean tensor); {_DATA}")
    return None


def _dynamo_error(error: BaseException) -> BaseException:
    """The innermost of `error`'s causes and dynamo's `inner_exception`s."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None:
            break
        error = inner
    return error


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _where(cause: BaseException, model) -> str:
    """", in <module> (<Class>.forward, file.py:12: `code`)" for the innermost user frame dynamo names."""
    stack = getattr(cause, "real_stack", None) or []
    if not stack:
        return ""
    frame = stack[-1]
    module = _module_at(model, frame.filename, frame.lineno) if isinstance(model, torch.nn.Module) else None
    code = f": `{frame.line.strip()}`" if getattr(frame, "line", None) else ""
    place = f"{os.path.basename(frame.filename)}:{frame.lineno}{code}"
    rnns = [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
            if isinstance(m, torch.nn.RNNBase)] if module else []
    if module is None:
        return f", at {frame.name} ({place})"
    name, m = module
    called = f" called from {name or 'the model'}" if rnns else f" in {name or 'the model'}"
    return (f", {' and '.join(rnns[:3])}" if rnns else "") + f"{called} ({type(m).__name__}.{frame.name}, {place})"


def _module_at(model: torch.nn.Module, filename: str, lineno: int):
    """(path, module) of the first submodule of `model` whose forward holds line `lineno` of `filename`."""
    for name, m in model.named_modules():
        code = getattr(type(m).forward, "__code__", None)
        if code is not None and code.co_filename == filename and any(
                line == lineno for _, _, line in code.co_lines()):
            return name, m
    return None


def module_path(node: fx.Node) -> str:
    """The module path of an fx node (forward nodes; backward nodes carry their forward node's), as dynamo
    records it ("" when it has none)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L['self']", "").replace("['", ".").replace("']", "")


def _last_line(stack_trace: str) -> str:
    """"file.py:12: `code`" of the last frame of an fx node's stack trace."""
    lines = [line.strip() for line in stack_trace.strip().splitlines()]
    frames = [k for k, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return ""
    head = lines[frames[-1]]
    try:
        path, lineno = head.split('"')[1], head.split("line ")[1].split(",")[0]
    except IndexError:
        return ""
    code = lines[frames[-1] + 1] if frames[-1] + 1 < len(lines) else ""
    return f"{os.path.basename(path)}:{lineno}" + (f": `{code}`" if code else "")


def _name(model) -> str:
    return type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", repr(model))
