"""The memory of the programs inductor generates for a compiled step, read from the programs themselves.

The search's simulator guesses which intermediates inductor fuses away and which it writes; inductor's
choices (inlining a recomputed value into each kernel that reads it, fusing kernels that read the same
buffers) move a compiled step's peak by up to 30 %. The generated program settles it: its wrapper (`def
call`) allocates each buffer (with its size and stride, or a library call's output checked against
them), hands freed ones to new buffers (`# reuse`) and deletes them, in the order they run. `Recorder`
keeps the program of each graph compiled (or loaded from inductor's cache) while it is open;
`Program.walk` replays its allocations and frees to the peak. It reads only the shapes of static graphs
(gaswap compiles no dynamic shapes); no code of it runs.

A step's peak (`step_peak`) is the largest of: the forward graph's peak; the eager loss after it (what the
forward leaves alive, plus the loss's own tensors, `compiled_costs.LOSS_TEMPORARIES`, in units of the
model output's size); the backward graph's peak. Graph inputs named `primals_*` (parameters, buffers, the
batch) are resident before the step and not counted, as the meter (`gaswap.run.peak_meter`) does not count them.
The backward's other inputs are what the forward saved, in the order the forward returns them (aot_autograd
passes the saved values last in the forward's outputs, first in the backward's inputs): several of them can
be views of one buffer (slices of a matmul's output), which the backward holds once.
A library call's scratch (what it holds while it runs beyond its outputs: a convolution's reorders, cuDNN's
workspace) is not in the program's text; `step_peak` counts it where given it (`library_calls.scratch`
measures it). Not counted: the optimizer's step (it runs after the backward has freed its buffers).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from gaswap.base.errors import GaswapError
from gaswap.compiled.step_model import LOSS_TEMPORARIES

RESIDENT_PREFIX = "primals_"  # aot_autograd's name for a forward input: a parameter, buffer or user input
SCRATCH = "(a library call's scratch)"  # `Walk.at_peak`'s name for the scratch of the call at the peak
_CALL = "def call(self, args)"
_TUPLE = r"(\([^()]*\))"
_INPUT = re.compile(rf"(\w+) = rand_strided\({_TUPLE}, {_TUPLE}, device='([\w:]+)', dtype=torch\.(\w+)\)$")
_EMPTY = re.compile(rf"(\w+) = empty_strided\w*\({_TUPLE}, {_TUPLE}, torch\.(\w+)\)$")
_ASSERT = re.compile(rf"assert_size_stride\((\w+), {_TUPLE}, {_TUPLE}")
_REUSE = re.compile(r"(\w+) = .*; del (\w+)\s+# reuse$")
_VIEW = re.compile(rf"(\w+) = reinterpret_tensor\((\w+), {_TUPLE}, {_TUPLE}, \d+\)(; del \w+\s+# reuse)?$")
_PLAIN_REUSE = re.compile(r"(\w+) = (\w+); del \w+\s+# reuse$")
_ITEM = re.compile(r"(\w+) = (\w+)\[\d+\]$")  # one output of a library call that returns several
_ALIAS = re.compile(r"(\w+) = (reinterpret_tensor\(|\w+$)")
_MADE = re.compile(r"(\w+) = [\w.]+\((.*)")  # a buffer a library call returns
_DEL = re.compile(r"del ([\w, ]+)$")


class Layout(NamedTuple):
    """A buffer's or input's size, stride and dtype (`torch.<dtype>`'s name), as its program prints them."""
    size: tuple
    stride: tuple
    dtype: str


class Walk(NamedTuple):
    """A program's bytes at its peak, at its end (what it returns), and {buffer or input: bytes} at its peak
    and at its end."""
    peak: int
    end: int
    at_peak: dict
    at_end: dict


class ProgramError(GaswapError, RuntimeError):
    """A generated program this module cannot read."""


@dataclass(frozen=True)
class Program:
    """The source of one graph's generated program (inductor's wrapper, with its benchmark harness)."""
    code: str

    def walk(self, storage: dict | None = None, scratch: dict | None = None) -> Walk:
        """The program's memory other than its `primals_*` inputs: the other inputs from the start until
        deleted, each buffer from the line that allocates it (a library call's several outputs at the call)
        until its `del`, a reused buffer handing its bytes on. `storage`: {input: (storage, bytes)} of inputs
        that are views of a storage they share (`saved_storage`), counted once and freed with the last.
        `scratch`: {index of a line of `body`: bytes its library call holds, while it runs, beyond what it
        returns} (`library_calls.scratch`), at its peak under the name `SCRATCH`."""
        args, body, sizes, items = self._parts[:4]
        storage = storage or {}
        alive, views, shared = {}, {}, {}  # bytes of each buffer or input; the inputs alive on each storage
        view_of = {}  # input: the storage it is a view of
        for name in args:
            key, nbytes = storage.get(name, (None, None))
            if nbytes:
                view_of[name] = f"saved {key}"
                views.setdefault(view_of[name], set()).add(name)
                shared[view_of[name]] = nbytes
            elif nbytes is None and not name.startswith(RESIDENT_PREFIX):  # 0: a view of a resident input
                alive[name] = sizes.get(name, 0)
        held = peak = sum(alive.values()) + sum(shared.values())
        at_peak = alive | shared

        def free(name: str) -> int:
            if name in alive:
                return alive.pop(name)
            key = view_of.pop(name, None)
            if key is None:
                return 0
            views[key].discard(name)
            return 0 if views[key] else shared.pop(key)

        scratch = scratch or {}
        for k, line in enumerate(body):
            if m := _REUSE.match(line):
                if m.group(2) in view_of:  # a saved input handed on: its storage with it
                    views[view_of[m.group(2)]].add(m.group(1))
                    view_of[m.group(1)] = view_of.pop(m.group(2))
                    views[view_of[m.group(1)]].discard(m.group(2))
                else:
                    alive[m.group(1)] = alive.pop(m.group(2), 0)
            elif m := _DEL.match(line):
                held -= sum(free(name) for name in re.findall(r"\w+", m.group(1)))
            elif _ITEM.match(line) or _ALIAS.match(line):
                continue
            elif (m := _EMPTY.match(line) or _MADE.match(line)) and (m.group(1) in sizes or m.group(1) in items):
                for name in items.get(m.group(1), [m.group(1)]):
                    alive[name] = sizes.get(name, 0)
                    held += alive[name]
            if held > peak:
                peak, at_peak = held, alive | shared
            if held + scratch.get(k, 0) > peak:  # a library call's scratch, beside its outputs (counted above)
                peak, at_peak = held + scratch[k], alive | shared | {SCRATCH: scratch[k]}
        return Walk(peak, held, at_peak, alive | shared)

    def saved_storage(self, count: int) -> list[tuple[str, int]]:
        """(storage, bytes) of the last `count` values a forward returns (what it saves for the backward): a
        buffer's own name and bytes (as the walk hands them on through reuses), a view's
        (`reinterpret_tensor(buf, ...)`) its buffer's, a resident input's 0 bytes; None bytes where the walk
        does not hold the buffer at the end (the backward then counts the value by its own size)."""
        returned, left = self._parts[4], self.walk().at_end
        if count > len(returned):
            raise ProgramError(f"the backward takes {count} saved values, the forward returns {len(returned)}")
        out = []
        for value in returned[len(returned) - count:]:
            base = re.match(r"(?:reinterpret_tensor\()?(\w*)", value).group(1)
            out.append((base, 0 if base.startswith(RESIDENT_PREFIX) else left.get(base)))
        return out

    @property
    def arguments(self) -> list[str]:
        """The graph's inputs, in order."""
        return self._parts[0]

    @property
    def body(self) -> list[str]:
        """The lines of `call` between its inputs and its return, stripped: what runs, in order."""
        return self._parts[1]

    @property
    def layouts(self) -> dict[str, Layout]:
        """{name: Layout} of the inputs, the buffers allocated, the library calls' outputs, the views named and
        what a reuse hands a freed buffer on as."""
        return self._parts[5]

    @property
    def device(self) -> str:
        """The device the program runs on (its inputs'), as it prints it: "cpu", "cuda:0"."""
        return self._parts[6]

    @property
    def is_backward(self) -> bool:
        """Whether the graph is a backward (it takes the output's gradient, `tangents_*`)."""
        return any(name.startswith("tangents_") for name in self.arguments)

    @cached_property
    def _parts(self) -> tuple[list[str], list[str], dict, dict, list[str], dict, str]:
        """(inputs, the lines of `call` between them and its return, {name: bytes}, {call: [its outputs]},
        the values returned, {name: Layout}, the inputs' device), parsed once."""
        lines = [line.strip() for line in self.code.splitlines()]
        start = next((k for k, line in enumerate(lines) if line.startswith(_CALL)), None)
        if start is None or start + 1 >= len(lines):
            raise ProgramError("no `def call(self, args)` in the generated program")
        end = next((k for k in range(start, len(lines)) if lines[k].startswith("return")), len(lines))
        body = lines[start + 2:end]
        layouts, views, items, device = _layouts(body, lines[end:])
        args = re.findall(r"\w+", lines[start + 1].split("=")[0])
        sizes = {name: bytes_of(layout) for name, layout in layouts.items()}
        return args, body, sizes, items, _returned(lines[end]) if end < len(lines) else [], layouts | views, device


def _returned(line: str) -> list[str]:
    """The values of `return (a, reinterpret_tensor(b, (2, 3), (3, 1), 0), None, )`, split at the commas
    outside brackets."""
    inner = line[len("return"):].strip()
    inner = inner[1:-1] if inner.startswith("(") and inner.endswith(")") else inner
    values, depth, current = [], 0, ""
    for ch in inner:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            values.append(current.strip())
            current = ""
        else:
            current += ch
    values.append(current.strip())
    return [v for v in values if v]


def _layouts(body: list[str], harness: list[str]) -> tuple[dict, dict, dict, str]:
    """({name: Layout} of the inputs (from the benchmark harness's `rand_strided`), the buffers allocated
    (`empty_strided_*`) and the library calls' outputs (their `assert_size_stride`, in the dtype of the call's
    first tensor argument); {name: Layout} of the views named (`reinterpret_tensor`) and of the buffers a reuse hands
    a freed one on to (as it is, or as a view); {call: [its outputs]} of the calls that return several; the inputs'
    device)."""
    shape, dtype, items, made_by, handed_on, device = {}, {}, {}, {}, {}, "cpu"
    for line in harness:
        if m := _INPUT.match(line):
            shape[m.group(1)], device, dtype[m.group(1)] = (m.group(2), m.group(3)), m.group(4), m.group(5)
    for line in body:
        if m := _EMPTY.match(line):
            shape[m.group(1)], dtype[m.group(1)] = (m.group(2), m.group(3)), m.group(4)
        elif m := _ITEM.match(line):
            items.setdefault(m.group(2), []).append(m.group(1))
            made_by[m.group(1)] = m.group(2)
        elif m := _ASSERT.match(line):
            shape.setdefault(m.group(1), (m.group(2), m.group(3)))
        elif m := _VIEW.match(line):
            handed_on[m.group(1)] = (m.group(2), m.group(3), m.group(4))
        elif m := _PLAIN_REUSE.match(line):
            handed_on[m.group(1)] = (m.group(2), None, None)
        elif (m := _MADE.match(line)) and not _REUSE.match(line) and not _ALIAS.match(line):
            argument = next((n for n in re.findall(r"\w+", m.group(2)) if n in dtype), None)
            dtype[m.group(1)] = dtype[argument] if argument else "float32"
    for name, parent in made_by.items():
        dtype.setdefault(name, dtype.get(parent, "float32"))
    layouts = {n: Layout(*_numbers(*s), dtype.get(n, "float32")) for n, s in shape.items()}
    views = {}  # in the order handed on: a reuse of a reuse finds its base's
    for name, (base, size, stride) in handed_on.items():
        known = layouts.get(base) or views.get(base)
        if size is not None:
            views[name] = Layout(*_numbers(size, stride), known.dtype if known else dtype.get(base, "float32"))
        elif known is not None:
            views[name] = known
    return layouts, views, items, device


def _numbers(size: str, stride: str) -> tuple[tuple, tuple]:
    """The printed `size` and `stride` of a static shape, read."""
    try:
        sizes, strides = ast.literal_eval(size), ast.literal_eval(stride)
    except (ValueError, SyntaxError):  # a symbol: a dynamic shape
        raise ProgramError(f"a size that is not a number: {size} (a dynamic shape)") from None
    if not all(isinstance(n, int) for n in (*sizes, *strides)):
        raise ProgramError(f"a size that is not a number: {size}")
    return tuple(sizes), tuple(strides)


def bytes_of(layout: Layout) -> int:
    """Bytes a tensor of `layout` spans."""
    return _extent(layout.size, layout.stride) * _itemsize(layout.dtype)


def _extent(sizes: tuple, strides: tuple) -> int:
    """Elements a tensor of `sizes` and `strides` spans."""
    if 0 in sizes:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(sizes, strides))


def _itemsize(dtype: str) -> int:
    import torch

    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise ProgramError(f"an unknown dtype: torch.{dtype}")
    return kind.itemsize


def step_peak(programs: list[Program], output_bytes: int, loss: str, scratch=None) -> int:
    """The peak bytes above resident of a training step that runs `programs` (a forward, then a backward)
    with an eager `loss` over a model output of `output_bytes` between them; with `scratch` (a program ->
    `Program.walk`'s scratch, e.g. `library_calls.scratch`), its library calls' scratch counted."""
    forward = [p for p in programs if not p.is_backward]
    backward = [p for p in programs if p.is_backward]
    if len(forward) != 1 or len(backward) != 1:
        raise ProgramError(f"expected one forward and one backward graph, got {len(forward)} and {len(backward)}"
                           " (a graph break or a recompilation)")
    scratch = scratch or (lambda program: None)
    forward_peak, saved = forward[0].walk(scratch=scratch(forward[0]))[:2]
    inputs = [name for name in backward[0].arguments if not name.startswith("tangents_")]
    storage = dict(zip(inputs, forward[0].saved_storage(len(inputs))))
    return max(forward_peak, saved + (1 + LOSS_TEMPORARIES[loss]) * output_bytes,
               backward[0].walk(storage, scratch(backward[0])).peak)


class Recorder:
    """`with Recorder() as r: <compile and run a step>`, then `r.programs`: each graph inductor compiled
    inside, or loaded from its cache. Not reentrant."""

    def __enter__(self) -> "Recorder":
        from torch._inductor.graph import GraphLowering

        if GraphLowering.save_output_code is not None:
            raise RuntimeError("another recorder of inductor's output code is open")
        self.programs: list[Program] = []
        GraphLowering.save_output_code = staticmethod(lambda code: self.programs.append(Program(code)))
        return self

    def __exit__(self, *exc) -> None:
        from torch._inductor.graph import GraphLowering

        GraphLowering.save_output_code = None
