"""Per block class, a ladder of selective-recompute choices (which of a block's forward ops to recompute), each
priced by a static model of one block, and a budget-aware fill that mixes them over the blocks. No torch here.

The static model (`BlockModel`) mirrors what `sharding.shard_step` builds for one unit's recompute choice:

- held from the forward to the backward: with nothing recomputed, the outputs of the unit's forward ops that a
  backward op reads; with a choice, every output of a saved op (torch's SAC policy stores each saved op's output,
  whether the backward reads it or not), plus the outputs of recomputed ops that a backward op outside the unit
  reads (a checkpointed module's outputs are saved);
- recompute seconds: the recomputed ops whose outputs the unit's backward reads, and the recomputed ops these
  need, each at its forward time.

Where the step is compute-bound both are exact per block (the rank's peak and step time move by them); where the
collectives are exposed, recompute can hide behind them and the search's own evaluation decides.

A ladder (`ladder`) is the choices that no other choice found beats on both (held bytes, seconds): local searches
of `seconds + price * held` over a range of prices, SACEstimator's greedy prefixes (the ops freeing the most bytes
per second first) and removals from "everything recomputable". `fill` spends a per-rank saving over the classes
as a greedy knapsack on the lower convex hull of each class's (keep, ladder, full) points: the cheapest seconds per
byte first, one unit at a time, so that each class ends with its first k units on one rung and the rest on the
rung before (the two choices and split point of `shard_search`'s genes).
"""
from __future__ import annotations

from dataclasses import dataclass

from gaswap.plan.graph import Graph
from gaswap.plan.sharding import inside

PRICES = 48  # local searches, at prices spread geometrically over the block's own seconds per byte
KEEP, FULL = -1, -2  # hull points that are not ladder rungs: nothing recomputed, everything recomputed
BUCKETS = 1000  # `fill_first` counts savings in this many parts of the saving asked for


@dataclass(frozen=True)
class Rung:
    """One recompute choice of a block: positions among its own forward ops, bytes held to the backward, seconds
    of recomputation."""

    positions: tuple
    held: int
    seconds: float


class BlockModel:
    """The static model of one unit (`unit`, its own forward ops `own`, `op_time` in seconds per op name)."""

    def __init__(self, graph: Graph, unit: str, own: list[int], op_time: dict):
        own_reads, other_reads = backward_reads(graph, unit)
        ops = [graph.ops[i] for i in own]
        self.n = len(own)

        def size(op, where=None) -> int:
            return sum(graph.tensors[t].size for t in op.outputs if where is None or where(t))

        self.out_bytes = [size(op) for op in ops]
        self.read_bytes = [size(op, lambda t: t in own_reads or t in other_reads) for op in ops]
        self.outside_bytes = [size(op, other_reads.__contains__) for op in ops]
        self.read_by_backward = [bool(own_reads.intersection(op.outputs)) for op in ops]
        made = {t: p for p, op in enumerate(ops) for t in op.outputs}
        self.needs = [sorted({made[t] for t in op.inputs if t in made and made[t] != p}) for p, op in enumerate(ops)]
        self.seconds_of = [op_time.get(op.name, 0.0) for op in ops]

    def keep(self) -> Rung:
        return Rung((), sum(self.read_bytes), 0.0)

    def cost(self, positions) -> Rung:
        """The rung of recomputing `positions` (empty: the keep rung)."""
        chosen = set(positions)
        if not chosen:
            return self.keep()
        held = sum(self.outside_bytes[p] if p in chosen else self.out_bytes[p] for p in range(self.n))
        run = [p for p in chosen if self.read_by_backward[p]]
        seen = set(run)
        while run:
            for q in self.needs[run.pop()]:
                if q in chosen and q not in seen:
                    seen.add(q)
                    run.append(q)
        return Rung(tuple(sorted(chosen)), held, sum(self.seconds_of[p] for p in seen))


def backward_reads(graph: Graph, unit: str) -> tuple[set, set]:
    """The tensors the backward ops of `unit` (a block: its module or inside it) read, and those other backward
    ops read."""
    mine, other = set(), set()
    for op in graph.ops:
        if op.phase == "bwd":
            (mine if inside(op.layer, unit) else other).update(op.inputs)
    return mine, other


def ladder(model: BlockModel, selectable: tuple, greedy_order: list[int]) -> list[Rung]:
    """The non-dominated selective choices found (see the module's docstring), most held first; a choice that
    recomputes nothing or everything is left to the keep and full modes."""
    found = {}

    def note(positions) -> Rung:
        rung = model.cost(positions)
        found.setdefault(rung.positions, rung)
        return rung

    for n in range(1, len(greedy_order) + 1):
        note(greedy_order[:n])
    current = set(selectable)
    while len(current) > 1:  # removals: each time the op whose saving costs the fewest held bytes per second
        base = note(current)
        trials = [(model.cost(current - {p}), p) for p in current]
        _, p = min(trials, key=lambda rp: (rp[0].held - base.held) / max(base.seconds - rp[0].seconds, 1e-12))
        current.discard(p)
    top = model.keep().held
    span = max(sum(model.seconds_of), 1e-12) / max(top, 1)
    start = set(selectable)
    for k in range(PRICES):
        price = span * 10 ** (3 * k / (PRICES - 1) - 1.5)
        start = _descend(model, selectable, start, price, note)
    return frontier(r for r in found.values() if 0 < len(r.positions) < len(selectable) or
                    (len(r.positions) == len(selectable) < model.n))


def _descend(model: BlockModel, selectable: tuple, start: set, price: float, note) -> set:
    """Single-op flips that lower `seconds + price * held`, from `start`, until none does; the choice reached."""
    current = set(start)
    def value(r: Rung) -> float:
        return r.seconds + price * r.held

    best = value(note(current))
    improved = True
    while improved:
        improved = False
        for p in selectable:
            trial = current ^ {p}
            if not trial:
                continue
            v = value(note(trial))
            if v < best - 1e-15:
                current, best, improved = trial, v, True
    return current


def frontier(rungs) -> list[Rung]:
    """The rungs no other beats on both held bytes and seconds, most held (fastest) first."""
    out = []
    for r in sorted(rungs, key=lambda r: (r.seconds, r.held, r.positions)):
        if not out or r.held < out[-1].held:
            out.append(r)
    return out


def hull(points: list[tuple]) -> list[tuple]:
    """The lower convex hull of (held, seconds, tag) points, most held first: the points a greedy knapsack
    visits (each step the cheapest seconds per byte saved)."""
    pts = sorted(points, key=lambda p: (-p[0], p[1]))
    out = []
    for p in pts:
        if out and p[0] == out[-1][0]:  # as much held as the point before, and no faster
            continue
        while out and p[1] <= out[-1][1]:  # saves bytes at no extra time: the points before are dominated
            out.pop()
        while len(out) >= 2 and _slope(out[-2], out[-1]) >= _slope(out[-1], p):
            out.pop()
        out.append(p)
    return out


def _slope(a: tuple, b: tuple) -> float:
    """Seconds added per byte saved from a to b."""
    return (b[1] - a[1]) / max(a[0] - b[0], 1)


def fill(classes: list[tuple[int, list[tuple]]], saving: int) -> list[tuple]:
    """Per class (its unit count, its hull from `hull`), (tag of the first k units' point, tag of the others',
    k) saving at least `saving` bytes over all units (or as much as the hulls allow), cheapest seconds per byte
    first, one unit at a time."""
    level = [0] * len(classes)  # per class: its units stand on hull point `level`, the first `moved` on the next
    moved = [0] * len(classes)
    saved = 0
    while saved < saving:
        options = [(_slope(h[level[c]], h[level[c] + 1]), c) for c, (n, h) in enumerate(classes)
                   if level[c] + 1 < len(h) and n]
        if not options:
            break
        _, c = min(options)
        n, h = classes[c]
        saved += h[level[c]][0] - h[level[c] + 1][0]
        moved[c] += 1
        if moved[c] == n:
            level[c], moved[c] = level[c] + 1, 0
    return [(h[min(level[c] + 1, len(h) - 1)][2], h[level[c]][2], moved[c]) for c, (_, h) in enumerate(classes)]


def fill_first(classes: list[tuple[int, list[tuple]]], saving: int) -> list[tuple]:
    """Per class (its unit count, its hull from `hull`), (tag of one hull point, KEEP, k): the first k units on
    that point and the others kept, k below the unit count (the class's last unit kept: for a step whose peak
    comes as the last unit's recompute runs), saving at least `saving` bytes at the fewest seconds (a knapsack
    over the classes, savings counted in `BUCKETS` parts of `saving`, rounded down); where no choice saves
    enough, each class's option saving the most."""
    options = [[(0, 0.0, (KEEP, KEEP, 0))] + [(k * (h[0][0] - x[0]), k * x[1], (x[2], KEEP, k))
                                              for k in range(1, n) for x in h[1:]] for n, h in classes]
    part = max(1, -(-saving // BUCKETS))
    target = -(-saving // part)
    best = {0: (0.0, [])}  # parts saved (at most `target`) -> (seconds, options so far)
    for o in options:
        step = {}
        for saved, (seconds, picked) in best.items():
            for s in o:
                key = min(target, saved + s[0] // part)
                if key not in step or seconds + s[1] < step[key][0]:
                    step[key] = (seconds + s[1], picked + [s])
        best = step
    if saving > 0 and target in best:
        return [s[2] for s in best[target][1]]
    return [max(o, key=lambda s: (s[0], -s[1]))[2] for o in options] if saving > 0 else [o[0][2] for o in options]
