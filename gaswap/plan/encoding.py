"""Chromosomes: an operator order (random keys) plus one action per candidate activation.

Decoding is list scheduling: among the ops whose inputs are ready, the one with the smallest key runs next,
forward ops before backward ops, and random or state-mutating ops in their captured order (so a policy
draws the same random numbers as the unchanged step). Every key vector decodes to a valid topological order.
Variation operators are free functions that take an explicit `random.Random`.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from gaswap.base.program import Action
from gaswap.plan.graph import Graph


@dataclass(frozen=True)
class Chromosome:
    """`keys[i]` orders op i (smaller runs earlier when ready); `actions[k]` is the action of candidate k."""

    keys: tuple[float, ...]
    actions: tuple[int, ...]


class Encoding:
    """What a chromosome means for one graph: its candidates, their allowed actions, and order decoding."""

    def __init__(self, graph: Graph, actions=(Action.KEEP, Action.SWAP, Action.RECOMPUTE)):
        self.graph = graph
        self.candidates: list[str] = graph.candidates()
        index = graph.op_index()
        self._phase = [0 if op.phase == "fwd" else 1 for op in graph.ops]
        producer_of = {t.name: index[t.producer] for t in graph.tensors.values() if t.producer is not None}
        succ: list[set[int]] = [set() for _ in graph.ops]
        self._npred = [0] * len(graph.ops)
        # Random and state-mutating ops keep their captured order: random numbers are drawn in sequence.
        pinned = [i for i, op in enumerate(graph.ops) if not op.recomputable]
        previous_pinned = dict(zip(pinned[1:], pinned))
        for i, op in enumerate(graph.ops):
            preds = {producer_of[t] for t in op.inputs if t in producer_of}
            if i in previous_pinned:
                preds.add(previous_pinned[i])
            for p in preds:
                succ[p].add(i)
            self._npred[i] = len(preds)
        self._succ = [sorted(s) for s in succ]
        self._sources = [i for i, n in enumerate(self._npred) if n == 0]
        rematerializable = _rematerializable(graph, set(self.candidates))
        allowed = [Action(a) for a in actions]
        if Action.KEEP not in allowed:
            allowed.insert(0, Action.KEEP)
        self.allowed: list[tuple[Action, ...]] = [
            tuple(a for a in allowed if (a != Action.RECOMPUTE or t in rematerializable)
                  and (a != Action.SWAP or t not in graph.unswappable)) for t in self.candidates
        ]

    def decode(self, keys) -> list[int]:
        """The op order (indices into graph.ops) that list scheduling by `keys` gives."""
        npred, succ = self._npred[:], self._succ
        entries = list(zip(self._phase, keys, range(len(npred))))  # (phase, key, op): the heap's order
        ready = [entries[i] for i in self._sources]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)[2]
            order.append(i)
            for j in succ[i]:
                npred[j] -= 1
                if npred[j] == 0:
                    heapq.heappush(ready, entries[j])
        return order

    def captured_keys(self) -> tuple[float, ...]:
        """Keys that decode to the captured order."""
        n = len(self.graph.ops)
        return tuple(i / n for i in range(n))

    def uniform(self, action: Action) -> Chromosome:
        """The captured order with `action` wherever allowed, KEEP elsewhere (keep-all, swap-all...)."""
        acts = tuple(int(action if action in allowed else Action.KEEP) for allowed in self.allowed)
        return Chromosome(self.captured_keys(), acts)

    def read_back(self, actions: dict[str, str]) -> Chromosome:
        """Per-tensor `actions` (a partition's, by tensor name) as a chromosome of the captured order, KEEP where
        this encoding allows a tensor no such action."""
        acts = []
        for t, allowed in zip(self.candidates, self.allowed):
            action = Action.parse(actions[t])
            acts.append(int(action if action in allowed else Action.KEEP))
        return Chromosome(self.captured_keys(), tuple(acts))

    def random(self, rng: random.Random, *, order: bool = True) -> Chromosome:
        """A random chromosome: random allowed actions, and random keys when the order evolves."""
        keys = tuple(rng.random() for _ in self.graph.ops) if order else self.captured_keys()
        return Chromosome(keys, tuple(int(rng.choice(a)) for a in self.allowed))


def _rematerializable(graph: Graph, candidates: set[str]) -> set[str]:
    """Activations that can be re-produced in the backward pass by re-running recomputable forward ops.

    A tensor qualifies when its producer is a recomputable forward op and each input of that producer is
    resident for the whole step, a candidate (which the policy keeps, swaps or recomputes), or itself
    rematerializable.
    """
    ok: set[str] = set()
    for op in graph.ops:  # captured order: inputs are decided before outputs
        if op.phase != "fwd" or not op.recomputable:
            continue
        inputs_ok = all(
            graph.tensors[u].producer is None or u in candidates or u in ok for u in op.inputs
        )
        if inputs_ok:
            ok.update(op.outputs)
    return ok


def crossover(a: Chromosome, b: Chromosome, rng: random.Random, *, kind: str = "uniform", indpb: float = 0.5):
    """Two children of `a` and `b`, crossing keys and actions with the same operator."""
    ka, kb = _cross(list(a.keys), list(b.keys), rng, kind, indpb)
    aa, ab = _cross(list(a.actions), list(b.actions), rng, kind, indpb)
    return Chromosome(tuple(ka), tuple(aa)), Chromosome(tuple(kb), tuple(ab))


def _cross(x: list, y: list, rng: random.Random, kind: str, indpb: float):
    if len(x) < 2:
        return x, y
    if kind == "two_point":
        i, j = sorted(rng.sample(range(len(x) + 1), 2))
        x[i:j], y[i:j] = y[i:j], x[i:j]
    else:
        for k in range(len(x)):
            if rng.random() < indpb:
                x[k], y[k] = y[k], x[k]
    return x, y


def mutate(
    c: Chromosome,
    rng: random.Random,
    allowed: list[tuple[Action, ...]],
    *,
    order: bool = True,
    key_sigma: float = 0.1,
    key_indpb: float = 0.05,
    action_indpb: float = 0.05,
) -> Chromosome:
    """Gaussian noise on some keys (when the order evolves) and a new allowed action for some genes."""
    keys = c.keys
    if order:
        keys = tuple(k + rng.gauss(0.0, key_sigma) if rng.random() < key_indpb else k for k in keys)
    actions = tuple(
        int(rng.choice(allowed[i])) if rng.random() < action_indpb else a for i, a in enumerate(c.actions)
    )
    return Chromosome(keys, actions)
