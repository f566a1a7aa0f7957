"""CUDA's ordering rules, checked on the CPU: a race detector for the stand-in streams (`LaggingStreams`).

Three streams: compute, d2h, h2d. Each keeps a vector clock: its own count of work, and the count of each
other stream's work it has waited for (through an event, directly or by way of a third stream). Compute's
work is every aten op run inside `running`, seen by a dispatch mode; a copy stream's work is its copies. An
access is a byte range of a tensor (its extent in its storage) read or written at a clock. Two accesses of
overlapping ranges by two streams, at least one a write, race unless the later one's stream has waited for
the earlier one. What that covers, in CUDA's terms:
 - a copy to the host reading a tensor compute made after the copy stream last waited for compute;
 - a copy to the device writing memory compute made or read since (on a GPU the caching allocator gives a
   compute allocation memory that compute's queued kernels may still read: the block of a freed tensor);
 - a copy back reading a host buffer before the copy to the host that fills it;
 - compute reading or writing memory a copy it has not waited for reads or writes (a read before the copy
   lands; the block of a freed tensor reused);
 - compute freeing the storage of a copy it has not waited for (with no `record_stream`, the allocator may give
   the block to the next compute allocation while the copy runs);
 - a step ending with copies compute has not waited for (it hands its tensors to the caller's compute work).
Each raises `StreamRace` at once, whatever the schedule of the lagging copies.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gaswap.base.errors import GaswapError

COMPUTE = "compute"
STREAMS = (COMPUTE, "d2h", "h2d")


class StreamRace(GaswapError, RuntimeError):
    """Two streams touch the same memory and no wait orders them (a missing wait in the runtime)."""


class LaggingStream:
    """Work queued in order, run up to a mark when a wait asks for it (marks count from the first item), or at
    once if `prompt`; `clock` is the stream's vector clock (stream name -> work waited for or done)."""

    def __init__(self, name: str, prompt: bool = False):
        self.name, self.prompt = name, prompt
        self.pending: deque = deque()
        self.done = 0  # items run
        self.queued = 0  # items queued
        self.clock = dict.fromkeys(STREAMS, 0)

    def queue(self, work) -> None:
        self.pending.append(work)
        self.queued += 1
        if self.prompt:
            self.run_to(self.queued)

    def run_to(self, mark: int) -> None:
        while self.done < mark:
            self.done += 1
            self.pending.popleft()()


@dataclass(frozen=True)
class Event:
    """Recorded on `stream` when `mark` items were queued on it, its vector clock then."""

    stream: LaggingStream
    mark: int
    clock: dict


@dataclass
class _Access:
    """A copy's read or write of bytes [start, end) at its stream's clock `at`; `storage` to see a free."""

    stream: str
    at: int
    start: int
    end: int
    write: bool
    what: str
    storage: StorageWeakRef


class StreamCheck:
    """The vector clocks of three `LaggingStream`s and the accesses that may still race (see the module)."""

    def __init__(self, compute: LaggingStream, d2h: LaggingStream, h2d: LaggingStream):
        self.streams = {s.name: s for s in (compute, d2h, h2d)}
        self.compute = compute
        self.by_compute: dict[tuple[int, int], list] = {}  # range -> [last write, last read, op of each]
        self.by_copies: list[_Access] = []  # accesses some stream has not waited for yet
        self._side = 0  # inside the stand-in's own work (a copy, a poison fill): not compute's

    @contextlib.contextmanager
    def running(self, done: bool):
        """Count the aten ops run inside as compute's work; with `done`, a step that ends with a copy compute has
        not waited for is a race."""
        with _ComputeOps(self):
            yield
        self.frees()
        if done:
            late = [name for name in ("d2h", "h2d")
                    if self.compute.clock[name] < self.streams[name].clock[name]]
            if late:
                raise StreamRace(f"the step ends with work on the {late[0]} stream compute has not waited for "
                                 f"(its tensors go to the caller, whose work is ordered with compute only)")
            self.by_compute.clear()

    @contextlib.contextmanager
    def side(self):
        """The stand-in's own work inside: not compute's."""
        self._side += 1
        try:
            yield
        finally:
            self._side -= 1

    def record(self, stream: LaggingStream) -> Event:
        return Event(stream, stream.queued, dict(stream.clock))

    def wait(self, stream: LaggingStream, event: Event) -> None:
        """`stream` waits for `event`: its clock takes in the event's."""
        self.frees()
        for name, at in event.clock.items():
            stream.clock[name] = max(stream.clock[name], at)
        self.by_copies = [a for a in self.by_copies
                          if any(s.clock[a.stream] < a.at for s in self.streams.values() if s.name != a.stream)]

    def copy(self, stream: LaggingStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A copy `dst <- src` queued on `stream`: check it against what it has not waited for, then note it."""
        self.frees()
        stream.clock[stream.name] += 1
        at, what = stream.clock[stream.name], f"{stream.name} copy #{stream.clock[stream.name]}"
        for t, write in ((src, False), (dst, True)):
            span = extent(t)
            if span is None:
                continue
            self._against_compute(stream, span, write, what)
            for a in self.by_copies:
                if a.stream != stream.name and a.at > stream.clock[a.stream] and (a.write or write) and \
                        _overlap(span, (a.start, a.end)):
                    raise StreamRace(f"the {what} {_verb(write)} memory the {a.what} {_verb(a.write)}, without "
                                     f"waiting for it")
            self.by_copies.append(_Access(stream.name, at, *span, write, what, StorageWeakRef(t.untyped_storage())))

    def _against_compute(self, stream: LaggingStream, span, write: bool, what: str) -> None:
        seen = stream.clock[COMPUTE]
        for key, (wrote, read, wrote_op, read_op) in self.by_compute.items():
            if not _overlap(span, key):
                continue
            if wrote > seen:
                raise StreamRace(f"the {what} {_verb(write)} memory compute's op #{wrote} ({wrote_op}) writes, "
                                 f"and its stream has waited for compute's work up to op #{seen} only")
            if write and read > seen:
                raise StreamRace(f"the {what} writes memory compute's op #{read} ({read_op}) reads, and its "
                                 f"stream has waited for compute's work up to op #{seen} only")

    def compute_op(self, func, args, kwargs) -> set:
        """Note one aten op of compute's, before it runs: what it reads and writes of its arguments, checked
        against the copies in flight. Returns the storages of its arguments (for `compute_made`)."""
        self.frees()
        self.compute.clock[COMPUTE] += 1
        storages = set()
        for t, write in _argument_accesses(func, args, kwargs):
            storages.add(_storage(t))
            self._compute_access(t, write, str(func))
        return storages

    def compute_made(self, func, out, storages: set) -> None:
        """The tensors compute's op just returned in new memory: written by it."""
        schema = func._schema
        outs = [out] if len(schema.returns) == 1 else list(out) if isinstance(out, (tuple, list)) else []
        for r, value in zip(schema.returns, outs):
            if r.alias_info is None:  # new memory, unless an unannotated alias (`_unsafe_view`)
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor) and _storage(t) not in storages:
                        self._compute_access(t, True, str(func))

    def _compute_access(self, t: torch.Tensor, write: bool, op: str) -> None:
        span, at = extent(t), self.compute.clock[COMPUTE]
        if span is None:
            return
        for a in self.by_copies:
            if a.at > self.compute.clock[a.stream] and (a.write or write) and _overlap(span, (a.start, a.end)):
                raise StreamRace(f"compute's op #{at} ({op}) {_verb(write)} memory the {a.what} "
                                 f"{_verb(a.write)}, without waiting for it")
        entry = self.by_compute.setdefault(span, [0, 0, "", ""])
        if write:
            entry[0], entry[2] = at, op
        else:
            entry[1], entry[3] = at, op

    def frees(self) -> None:
        """A storage freed while a copy compute has not waited for uses it is a race."""
        for a in self.by_copies:
            if a.at > self.compute.clock[a.stream] and a.storage.expired():
                raise StreamRace(f"compute freed memory the {a.what} {_verb(a.write)} before waiting for it (the "
                                 f"allocator may hand it to the next compute allocation while the copy runs)")


class _ComputeOps(TorchDispatchMode):
    """Every aten op run while active, outside the stand-in's own work, is one step of compute."""

    def __init__(self, check: StreamCheck):
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.check._side:
            return func(*args, **kwargs)
        storages = self.check.compute_op(func, args, kwargs)
        out = func(*args, **kwargs)
        self.check.compute_made(func, out, storages)
        return out


def _argument_accesses(func, args, kwargs):
    """(tensor, is a write) for each tensor argument of an aten op (written where the schema says so); none for a
    view op (all returns aliases, nothing written: it touches no bytes)."""
    schema = func._schema
    if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) \
            and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        write = arg.alias_info is not None and arg.alias_info.is_write
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                yield t, write


def _storage(t: torch.Tensor) -> int | None:
    return t.untyped_storage().data_ptr() if t.device.type == "cpu" and t.layout == torch.strided else None


def extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes [start, end) of a CPU tensor's elements in memory; None for an empty or non-CPU tensor."""
    if t.device.type != "cpu" or t.numel() == 0 or t.layout != torch.strided:
        return None
    start = t.data_ptr()
    return start, start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _verb(write: bool) -> str:
    return "writes" if write else "reads"
