"""The points a search keeps besides its population. No torch here.

`Front`: the feasible points nobody dominates (DEAP's `tools.ParetoFront`, on `Evaluated`). `Fastest`: the
FASTEST_KEPT fastest feasible points, the runner-ups a front drops (where the model predicts nearly one peak
for every policy, the front holds 1-2 points). Both take points through `update(points)`.
"""
from __future__ import annotations

import bisect

from gaswap.plan.encoding import Chromosome
from gaswap.plan.problem import Evaluated

FASTEST_KEPT = 16  # fastest feasible policies a search keeps besides its front (`SearchResult.fastest`)


class Front:
    """Points no other point dominates (step time and peak, both lower is better), in the order they joined;
    a point equal to one held, or a chromosome held, is turned away."""

    def __init__(self, points=()):
        self._points: dict[Chromosome, Evaluated] = {}
        self.update(points)

    def update(self, points) -> None:
        for e in points:
            self._add(e)

    def _add(self, e: Evaluated) -> None:
        held = self._points
        if e.chromosome in held:
            return
        for o in held.values():
            if o.step_time <= e.step_time and o.peak_bytes <= e.peak_bytes:
                return
        for key in [k for k, o in held.items() if e.step_time <= o.step_time and e.peak_bytes <= o.peak_bytes]:
            del held[key]
        held[e.chromosome] = e

    def __iter__(self):
        return iter(self._points.values())

    def __len__(self) -> int:
        return len(self._points)

    def fastest_first(self) -> tuple[Evaluated, ...]:
        return tuple(sorted(self._points.values(), key=lambda e: (e.step_time, e.peak_bytes)))

    def hypervolume(self, reference: tuple[float, float]) -> float:
        return hypervolume([(e.step_time, float(e.peak_bytes)) for e in self._points.values()], reference)


class Fastest:
    """The FASTEST_KEPT fastest points added, in `points` sorted by (step time, peak), one per (step time,
    peak) pair, the first added winning (two chromosomes that simulate alike almost always run alike: they
    differ in genes that do not matter). Cheap: most points are turned away by one or two comparisons."""

    def __init__(self, points=()):
        self.points: list[Evaluated] = []
        self._keys: list[tuple[float, int]] = []  # the points' (step time, peak), in the same order
        self.update(points)

    def update(self, points) -> None:
        for e in points:
            self._add(e)

    def _add(self, e: Evaluated) -> None:
        keys, key = self._keys, (e.step_time, e.peak_bytes)
        if len(keys) == FASTEST_KEPT and key >= keys[-1]:
            return
        k = bisect.bisect_left(keys, key)
        if k < len(keys) and keys[k] == key:
            return
        keys.insert(k, key)
        self.points.insert(k, e)
        del keys[FASTEST_KEPT:], self.points[FASTEST_KEPT:]


def hypervolume(points: list[tuple[float, float]], reference: tuple[float, float]) -> float:
    """Area dominated by 2-D points (minimising both) up to `reference`."""
    area, prev_y = 0.0, reference[1]
    for x, y in sorted(p for p in points if p[0] < reference[0] and p[1] < reference[1]):
        if y < prev_y:
            area += (reference[0] - x) * (prev_y - y)
            prev_y = y
    return area
