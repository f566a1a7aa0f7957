"""The scratch memory of the library calls in inductor's generated programs, measured by calling each alone.

A generated program allocates its buffers itself, and `programs.Program.walk` counts them; a library call it
makes (a convolution, its backward, a matmul: `extern_kernels.*`, `torch.ops.aten.*`) allocates its outputs,
which the program checks, and whatever else it needs while it runs, which the program does not show. That
scratch can hold the step's peak: on a ConvNeXt-style net, a depthwise convolution's backward laid out
channels-last (as inductor lays out a backward that recomputes a convolution) held 3.2 MB beside 0.14 MB of
output, and the policies that recompute one metered 33 to 56 % over their programs' peak
(results/compare_new_models/README.md). On a GPU the same holds for cuDNN's and cuBLAS's workspaces.

`scratch` calls each library call of a program once, with tensors of the sizes, strides and dtypes the program
gives its arguments (random values) and its other arguments as printed, under the allocator's count (CPU: the
profiler's memory events, one session for the calls of a program; CUDA: the caching allocator's peak, after a
first call; cuDNN sizes its workspace by the memory free, so there it is the scratch with memory to spare), and takes
what the call held at its peak beyond the outputs it returns. A call is replayed once per process: calls of the
same function on the same layouts and arguments are remembered (`_KNOWN`). Nothing of the program is run or
evaluated: its call lines are parsed (`ast`), their function looked up by name in `extern_kernels` and
`torch.ops.aten` only, their other arguments read as literals; a call this cannot read is left out (no scratch).
"""
from __future__ import annotations

import ast
import bisect
import gc
from functools import partial

import torch
from torch._inductor.select_algorithm import extern_kernels
from torch.utils._pytree import tree_leaves

from gaswap.base.errors import GaswapError
from gaswap.compiled.programs import Layout, Program
from gaswap.run.peak_meter import quiet_stderr

_KNOWN: dict[tuple, int] = {}  # a call's signature (`_signature`) -> its scratch bytes
_RANGE = "gaswap library call "  # the profiler ranges the calls run in


class _Unreadable(GaswapError):
    """A call argument this module does not replay."""


def scratch(program: Program) -> dict[int, int]:
    """{index of a line of `program.body`: bytes its library call held at its peak beyond what it returns} for
    the calls that held any (`Program.walk`'s `scratch`)."""
    calls = {k: call for k, line in enumerate(program.body) if (call := _call(line, program.layouts)) is not None}
    device = torch.device(program.device)
    new = {signature: partial(_materialized, *call, device) for signature, call in calls.values()
           if signature not in _KNOWN}
    if new:
        _KNOWN.update(_measure(list(new.items()), device))
    return {k: _KNOWN[signature] for k, (signature, _) in calls.items() if _KNOWN.get(signature, 0) > 0}


def _call(line: str, layouts: dict[str, Layout]) -> tuple[tuple, tuple] | None:
    """(signature, (function, arguments, keyword arguments) as descriptions) of a library call's line, None for
    another line or a call this module does not replay."""
    if "extern_kernels." not in line and "aten." not in line:
        return None
    try:
        statements = ast.parse(line).body
    except SyntaxError:
        return None
    call = getattr(statements[0], "value", None) if statements else None
    if not isinstance(call, ast.Call) or (function := _function(call.func)) is None:
        return None
    try:
        args = tuple(_describe(a, layouts) for a in call.args)
        kwargs = tuple((k.arg, _describe(k.value, layouts)) for k in call.keywords)
    except (_Unreadable, ValueError, TypeError, SyntaxError):  # literal_eval's refusals of what is not a literal
        return None
    return (ast.unparse(call.func), args, kwargs), (function, args, kwargs)


def _function(node: ast.expr):
    """The library function `node` names (`extern_kernels.<name>`, `torch.ops.aten.<op>.<overload>`,
    `aten.<op>.<overload>`), None for another."""
    path = []
    while isinstance(node, ast.Attribute):
        path.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    path.insert(0, node.id)
    if path[:3] == ["torch", "ops", "aten"]:
        path = path[2:]
    if len(path) == 2 and path[0] == "extern_kernels":
        return getattr(extern_kernels, path[1], None)
    if len(path) == 3 and path[0] == "aten":
        return getattr(getattr(torch.ops.aten, path[1], None), path[2], None)
    return None


def _describe(node: ast.expr, layouts: dict[str, Layout]) -> tuple:
    """A hashable description of a call argument: ("tensor", layout, offset), ("torch", name) of a dtype or
    memory format, ("list" | "tuple", items) or ("value", literal)."""
    if isinstance(node, ast.Name) and node.id in layouts:
        return "tensor", layouts[node.id], 0
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "reinterpret_tensor":
        if len(node.args) != 4 or not isinstance(node.args[0], ast.Name) or node.args[0].id not in layouts:
            raise _Unreadable(ast.unparse(node))
        base, size, stride, offset = node.args
        layout = Layout(ast.literal_eval(size), ast.literal_eval(stride), layouts[base.id].dtype)
        return "tensor", layout, ast.literal_eval(offset)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        if isinstance(getattr(torch, node.attr, None), (torch.dtype, torch.memory_format, torch.layout)):
            return "torch", node.attr
        raise _Unreadable(ast.unparse(node))
    if isinstance(node, (ast.List, ast.Tuple)):
        return type(node).__name__.lower(), tuple(_describe(e, layouts) for e in node.elts)
    try:
        return "value", ast.literal_eval(node)
    except ValueError:
        raise _Unreadable(ast.unparse(node)) from None


def _made(description: tuple, device: torch.device):
    """The argument `description` describes: a tensor of its layout with random values (zeros for integers
    and booleans)."""
    kind, value = description[0], description[1]
    if kind == "tensor":
        size, stride, dtype = value.size, value.stride, getattr(torch, value.dtype)
        extent = description[2] + (0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride)))
        filled = torch.randn if dtype.is_floating_point or dtype.is_complex else torch.zeros
        return filled(extent, dtype=dtype, device=device).as_strided(size, stride, description[2])
    if kind == "torch":
        return getattr(torch, value)
    if kind in ("list", "tuple"):
        items = [_made(d, device) for d in value]
        return items if kind == "list" else tuple(items)
    return value


def _materialized(function, args: tuple, kwargs: tuple, device: torch.device) -> tuple:
    """(function, arguments, keyword arguments) of a call `_call` described, its tensors made on `device`."""
    return function, [_made(a, device) for a in args], {name: _made(a, device) for name, a in kwargs}


def _returned_bytes(result, arguments: list) -> int:
    """Bytes of the storages of the tensors `result` holds that no argument holds (what the call allocated)."""
    held = {t.untyped_storage().data_ptr() for t in tree_leaves(arguments) if isinstance(t, torch.Tensor)}
    made = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tree_leaves(result) if isinstance(t, torch.Tensor)}
    return sum(n for ptr, n in made.items() if ptr not in held)


def _measure(calls: list[tuple], device: torch.device) -> dict:
    """{key: scratch bytes} of `calls` ((key, a function making (function, args, kwargs)) pairs), each called once
    on `device`; 0 for a call that cannot be made or fails on the tensors made for it; none while a profiler runs
    (the calls would count in its meter)."""
    if device.type == "cuda":
        return {key: _cuda_scratch(make, device) for key, make in calls}
    if torch.autograd._profiler_enabled():
        return {}
    returned = {}
    gc.collect()  # garbage freed inside a range would lower its count
    with quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                profile_memory=True) as profile:
        for k, (_, make) in enumerate(calls):
            try:
                function, arguments, keywords = make()
                with torch.profiler.record_function(f"{_RANGE}{k}"):
                    result = function(*arguments, **keywords)
            except Exception:  # a call that needs other values than random ones: no scratch known
                continue
            returned[k] = _returned_bytes(result, arguments + list(keywords.values()))
            del result, arguments, keywords
    peaks = _range_peaks(profile)
    return {key: max(0, peaks.get(k, 0) - returned[k]) if k in returned else 0 for k, (key, _) in enumerate(calls)}


def _range_peaks(profile) -> dict[int, int]:
    """{k: the most bytes allocated at once inside the range `_RANGE k`, above its start} of a finished profile."""
    events = list(profile.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times, totals, live = [t for t, _ in memory], [], 0
    for _, nbytes in memory:
        live += nbytes
        totals.append(live)
    peaks = {}
    for e in events:
        if e.name().startswith(_RANGE):
            first = bisect.bisect_left(times, e.start_ns())
            last = bisect.bisect_right(times, e.start_ns() + e.duration_ns())
            start = totals[first - 1] if first else 0
            peaks[int(e.name()[len(_RANGE):])] = max(totals[first:last], default=start) - start
    return peaks


def _cuda_scratch(make, device: torch.device) -> int:
    """The scratch of one call on a GPU, by the caching allocator's peak (0 where it cannot be made or fails),
    called once before (cuDNN's and cuBLAS's handles and workspaces, made once and kept, are no call's scratch)."""
    try:
        function, arguments, keywords = make()
        function(*arguments, **keywords)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        result = function(*arguments, **keywords)
    except Exception:  # a call that needs other values than random ones: no scratch known
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    return max(0, peak - _returned_bytes(result, arguments + list(keywords.values())))
