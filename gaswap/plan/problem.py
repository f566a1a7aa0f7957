"""The planning problem and what solving it gives. No torch here.

A `Problem` is pymoo's shape for ours: a graph, its costs, a memory budget and a search space;
`evaluate(chromosome)` decodes and simulates a policy and returns its objectives (step time, peak bytes) and,
apart, its constraint violation (`Problem.violation`: 0 when it fits the budget). Search, baselines, the MILP,
bench, the speed benchmark, the workflow and report all evaluate through it, and worker processes are handed
one (it pickles without its caches).

`Evaluated` is one evaluated policy; `Generation` one generation's record; `SearchResult` what a search
returns. They are plain frozen data: results, reports and checkpoints read them without DEAP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Chromosome, Encoding
from gaswap.plan.graph import Graph
from gaswap.plan.simulator import SimResult, Simulator

ORDER_CACHE = 4096  # decoded orders kept per problem (a search re-evaluates many unchanged key vectors)


@dataclass(frozen=True)
class Evaluated:
    """A chromosome with its predicted step time (s) and peak bytes."""

    chromosome: Chromosome
    step_time: float
    peak_bytes: int
    valid: bool = True

    @property
    def objectives(self) -> tuple[float, int]:
        """(step time, peak bytes): both minimised."""
        return self.step_time, self.peak_bytes

    def violation(self, budget: int) -> float:
        """How far the policy breaks the budget, relative to it: 0 when it fits, inf when it is invalid."""
        if not self.valid:
            return math.inf
        return (self.peak_bytes - budget) / budget if self.peak_bytes > budget else 0.0

    def feasible(self, budget: int) -> bool:
        return self.valid and self.peak_bytes <= budget

    def counts(self) -> dict[str, int]:
        """How many candidates each action covers."""
        return {a.label: sum(1 for x in self.chromosome.actions if x == a) for a in Action}


class Problem:
    """`graph` with `costs` under `budget` bytes (None: no budget), policies drawn from `space` (an object
    with `actions`, names such as "keep"; None: every action, or those given as `actions`). The budget is a constraint of the search and
    also steers the simulator (prefetches wait while they would break it)."""

    def __init__(self, graph: Graph, costs: Costs, budget: int | None = None, space=None, *, actions=None):
        self.graph, self.costs, self.budget, self.space = graph, costs, budget, space
        if actions is None:
            actions = tuple(Action.parse(a) for a in space.actions) if space is not None else tuple(Action)
        self.actions = tuple(Action(a) for a in actions)
        self.encoding = Encoding(graph, self.actions)
        self.simulator = Simulator(graph, costs, budget)
        self._orders: dict[tuple[float, ...], list[int]] = {}

    def __getstate__(self) -> dict:
        """What a worker process needs: the problem without its cache of decoded orders."""
        return {"graph": self.graph, "costs": self.costs, "budget": self.budget, "space": self.space,
                "actions": self.actions}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["graph"], state["costs"], state["budget"], state["space"], actions=state["actions"])

    def order(self, c: Chromosome) -> list[int]:
        """The op order (indices into graph.ops) `c`'s keys decode to (cached)."""
        order = self._orders.get(c.keys)
        if order is None:
            if len(self._orders) >= ORDER_CACHE:
                self._orders.clear()
            order = self._orders[c.keys] = self.encoding.decode(c.keys)
        return order

    def simulate(self, c: Chromosome, *, trace: bool = False) -> SimResult:
        """The simulator's verdict on `c` (traced: timeline, memory and program too)."""
        return self.simulator.run(self.order(c), c.actions, trace=trace)

    def evaluate(self, c: Chromosome) -> Evaluated:
        """`c`'s objectives, with validity; its violation is `violation(evaluated)`."""
        r = self.simulate(c)
        return Evaluated(c, r.step_time, r.peak_bytes, r.valid)

    def violation(self, e: Evaluated) -> float:
        """0 when `e` fits the budget (or there is none), its relative excess otherwise, inf when invalid."""
        return e.violation(self.budget) if self.budget is not None else (0.0 if e.valid else math.inf)

    def restrict(self, c: Chromosome) -> Chromosome:
        """`c` with every action the search space does not allow for a candidate replaced by KEEP."""
        allowed = self.encoding.allowed
        if all(a in ok for a, ok in zip(c.actions, allowed)):
            return c
        return Chromosome(c.keys, tuple(a if a in ok else int(Action.KEEP) for a, ok in zip(c.actions, allowed)))

    def keep_all(self) -> Evaluated:
        """The captured order with every activation kept: what plain PyTorch does."""
        return self.evaluate(self.encoding.uniform(Action.KEEP))


@dataclass(frozen=True)
class Generation:
    """One generation of a search: evaluations so far, best feasible time, archive size and hypervolume, and
    search seconds so far."""

    generation: int
    evaluations: int
    best_time_s: float
    front_size: int
    hypervolume: float
    seconds: float


GENERATION_FIELDS = tuple(f.name for f in fields(Generation))


@dataclass(frozen=True)
class SearchResult:
    """The Pareto front of feasible policies (fastest first), the fastest feasible policies evaluated, and how
    the search went."""

    front: tuple[Evaluated, ...]
    seeds: dict[str, Evaluated]
    history: tuple[Generation, ...]
    evaluations: int
    seconds: float
    smallest_peak: int  # the lowest peak any evaluated valid policy reached (useful when none fits)
    complete: bool = True  # False when `stop` ended the search before it ran its course
    generations_done: int = 0
    stopped_by: str = ""  # what ended it: "generations", "evaluations", "seconds", "converged", "interrupted"
    fastest: tuple[Evaluated, ...] = ()  # up to front.FASTEST_KEPT, fastest first, one per (step time, peak)

    @property
    def best(self) -> Evaluated | None:
        return self.front[0] if self.front else None
