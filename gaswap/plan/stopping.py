"""When a search stops: one small rule per reason (pymoo's `Termination`). No torch here.

A rule's `update(search)` returns its progress toward stopping the search, 1.0 when it does; `name` is what
`SearchResult.stopped_by` records. The rules of a search are checked in the order `rules(ga)` gives, then
`Interrupted` (a signal, or a caller's `stop()`). Progress bars read them (`nearest`).
"""
from __future__ import annotations

import math

from gaswap.plan.problem import Generation

ALMOST = math.nextafter(1.0, 0.0)  # the most progress a rule reports before it stops the search


def _fraction(done: float, limit: float) -> float:
    return 1.0 if done >= limit else min(done / limit, ALMOST)


class MaxGenerations:
    name = "generations"

    def __init__(self, generations: int):
        self.generations = generations

    def update(self, search) -> float:
        return _fraction(search.generation, self.generations)


class MaxEvaluations:
    name = "evaluations"

    def __init__(self, evaluations: int):
        self.evaluations = evaluations

    def update(self, search) -> float:
        return _fraction(search.evaluations, self.evaluations)


class MaxSeconds:
    name = "seconds"

    def __init__(self, seconds: float):
        self.seconds = seconds

    def update(self, search) -> float:
        return _fraction(search.seconds(), self.seconds)


class Converged:
    """A policy fits and for `patience` generations neither the best feasible time nor the hypervolume
    improved by more than `tolerance` (relative); progress is the generations without such a gain so far."""

    name = "converged"

    def __init__(self, patience: int, tolerance: float):
        self.patience, self.tolerance = patience, tolerance

    def update(self, search) -> float:
        history = search.history
        if converged(history, self.patience, self.tolerance):
            return 1.0
        if not history or history[-1].best_time_s == math.inf:
            return 0.0
        stalled = 0
        while stalled < min(self.patience, len(history) - 1) and not _improved(
                history[-2 - stalled], history[-1], self.tolerance):
            stalled += 1
        return min(stalled / self.patience, ALMOST)


class Interrupted:
    """`stop()` (asked once per generation) says the search ends here, unfinished."""

    name = "interrupted"

    def __init__(self, stop):
        self.stop = stop

    def update(self, search) -> float:
        return 1.0 if self.stop() else 0.0


def rules(ga, stop=None) -> list:
    """The rules of GA settings `ga` (`ga.max_evaluations`, `ga.patience` 0 and `ga.max_seconds` None turn
    theirs off), with `Interrupted(stop)` last when `stop` is given."""
    found = [MaxGenerations(ga.generations)]
    if ga.max_evaluations:
        found.append(MaxEvaluations(ga.max_evaluations))
    if ga.max_seconds is not None:
        found.append(MaxSeconds(ga.max_seconds))
    if ga.patience:
        found.append(Converged(ga.patience, ga.tolerance))
    if stop is not None:
        found.append(Interrupted(stop))
    return found


def stopped_by(rules, search) -> str | None:
    """The name of the first rule that stops `search` now, or None."""
    return next((rule.name for rule in rules if rule.update(search) >= 1.0), None)


def nearest(rules, search) -> tuple[str, float]:
    """The rule nearest to stopping `search` besides `Interrupted`, and its progress: what a progress bar shows."""
    return max(((r.name, r.update(search)) for r in rules if not isinstance(r, Interrupted)), key=lambda p: p[1])


def _improved(then: Generation, now: Generation, tolerance: float) -> bool:
    faster = now.best_time_s < then.best_time_s * (1 - tolerance)
    wider = now.hypervolume > then.hypervolume * (1 + tolerance)
    return faster or wider


def converged(history: list[Generation], patience: int, tolerance: float) -> bool:
    """Whether a search with this history has converged: a policy fits and for `patience` generations neither
    the best feasible time nor the hypervolume improved by more than `tolerance` (relative)."""
    if len(history) <= patience or history[-1].best_time_s == math.inf:
        return False
    return not _improved(history[-1 - patience], history[-1], tolerance)


def stopping_generation(history: list[Generation], patience: int, tolerance: float) -> int | None:
    """The index of the first generation of `history` at which `converged` ends a search (None: none)."""
    return next((g for g in range(len(history)) if converged(history[:g + 1], patience, tolerance)), None)
