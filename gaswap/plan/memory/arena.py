"""Address planning: every device tensor of a step at a fixed offset in one arena (OLLA / SwapAdvisor style).

A post-pass on a chosen policy. The step's allocations (`allocator.step_events`, the same replay the
allocator model uses) each get an offset so that no two alive at the same time overlap; the arena's size is
then all the process reserves: no rounding to segments, no blocks stranded in the wrong pool or stream.
Placement is greedy: in a given order, each allocation goes into the tightest gap among the placed ones
whose lifetimes overlap it, else on top (TFLite's "greedy by size" and OLLA's starting point); four orders
are tried (size with two tie-breaks, size x lifetime, time) and the smallest arena kept. The lower
bound is the most bytes (aligned) alive at once: no placement does better.

The torch side (`arena_buffer`, `carve`) gives one buffer and views of it at planned offsets;
`gaswap.run.arena_runtime.ArenaRunner` runs a policy's step with its activations there.
"""
from __future__ import annotations

from dataclasses import dataclass

from gaswap.plan.graph import Graph
from gaswap.plan.memory.allocator import step_events

ALIGNMENT = 512  # bytes; CUDA's allocator hands out 512 B multiples, and every dtype's alignment divides it


@dataclass(frozen=True)
class Placement:
    """One allocation of the step: which tensor, made by which instruction (-1: before the program; -2:
    resident all step), its bytes and its offset in the arena; alive from event `start` to `end`."""

    tensor: str
    instruction: int
    nbytes: int
    offset: int
    start: int
    end: int


@dataclass(frozen=True)
class ArenaPlan:
    size: int  # arena bytes: what the process reserves for the step
    lower_bound: int  # most aligned bytes alive at once
    placements: tuple[Placement, ...]

    def check(self) -> None:
        """Raise ValueError if two allocations alive at once overlap, or one leaves the arena."""
        items = sorted(self.placements, key=lambda p: p.start)
        for k, a in enumerate(items):
            if a.offset < 0 or a.offset + a.nbytes > self.size:
                raise ValueError(f"{a.tensor} at {a.offset} (+{a.nbytes}) leaves the arena of {self.size} bytes")
            for b in items[k + 1:]:
                if b.start >= a.end:
                    continue
                if a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes:
                    raise ValueError(f"{a.tensor} and {b.tensor} are alive together and overlap")


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan(graph: Graph, result, *, alignment: int = ALIGNMENT, activations_only: bool = False, results: bool = False,
         exclude=frozenset()) -> ArenaPlan:
    """Offsets for every allocation of one step of a traced SimResult (or of anything with a policy's
    `program`), resident tensors included. With `activations_only`, only what the program makes and frees
    within the step (and, with `results`, what it makes and hands back: alive at the step's end), less the
    tensors named in `exclude`: no resident tensor, input, or output an op re-makes and drops at once. That
    is what a runtime can place (gaswap.run.arena_runtime); a placement's `instruction` is then the index in the
    program that makes it."""
    resident, events = step_events(graph, result)
    end_of_step = len(events) + 1
    items: list[tuple[int, int, int, str, int]] = []  # (bytes, start, end, tensor, instruction)
    for nbytes in resident if not activations_only else ():
        items.append((_aligned(nbytes, alignment), 0, end_of_step, "", -2))
    opened: dict[int, tuple[int, int, str, int]] = {}
    for position, (kind, key, nbytes, _, _, tensor, at) in enumerate(events, 1):
        if kind == "malloc":
            opened[key] = (_aligned(nbytes, alignment), position, tensor, at)
        else:
            size, start, tensor, made = opened.pop(key)
            if not activations_only or (made >= 0 and at != made and tensor not in exclude):
                items.append((size, start, position, tensor, made))
    items += [(size, start, end_of_step, tensor, at) for size, start, tensor, at in opened.values()
              if not activations_only or (results and at >= 0 and tensor not in exclude)]
    items = [i for i in items if i[0] > 0]
    best = min((_place(sorted(items, key=order)) for order in ORDERS), key=lambda placed: _top(placed))
    return ArenaPlan(_top(best), _most_alive(items), tuple(sorted(best, key=lambda p: (p.start, p.offset))))


# Orders in which allocations are placed (items are (bytes, start, end, ...)); the plan keeps the smallest
# arena. By size, ties by start or by end (largest, latest first), by size x lifetime, and by time (the
# order a runtime allocates in).
ORDERS = (lambda i: (-i[0], i[1]), lambda i: (-i[0], -i[2]), lambda i: (-i[0] * (i[2] - i[1]), i[1]),
          lambda i: (i[1], -i[0]))


def _place(items) -> list[Placement]:
    placed: list[Placement] = []
    for size, start, end, tensor, at in items:
        busy = sorted((p.offset, p.offset + p.nbytes) for p in placed if p.start < end and start < p.end)
        placed.append(Placement(tensor, at, size, _best_gap(busy, size), start, end))
    return placed


def _top(placed: list[Placement]) -> int:
    return max((p.offset + p.nbytes for p in placed), default=0)


def _best_gap(busy: list[tuple[int, int]], size: int) -> int:
    """The offset of the smallest gap between `busy` ranges (sorted) that holds `size`, else the top."""
    best, best_gap, top = None, None, 0
    for lo, hi in busy:
        gap = lo - top
        if gap >= size and (best_gap is None or gap < best_gap):
            best, best_gap = top, gap
        top = max(top, hi)
    return top if best is None else best


def _most_alive(items) -> int:
    """The most bytes alive at any event."""
    deltas: dict[int, int] = {}
    for size, start, end, *_ in items:
        deltas[start] = deltas.get(start, 0) + size
        deltas[end] = deltas.get(end, 0) - size
    level = peak = 0
    for position in sorted(deltas):
        level += deltas[position]
        peak = max(peak, level)
    return peak
