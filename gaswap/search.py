"""NSGA-II over (step time, peak memory) with the memory budget as a constraint. No torch here.

    population <- seeds (keep-all, recompute-all, swap-all, ...) + random chromosomes; evaluate
    repeat for each generation:
        parents   <- binary tournaments on (front rank, crowding distance)
        offspring <- crossover (cx_prob) then mutation (mut_prob) of parent pairs; evaluate the new ones
        population <- NSGA-II selection of the best `population` of parents + offspring
        archive   <- feasible points nobody dominates; record best feasible time, front size, hypervolume

Constraint-domination (Deb): a policy over budget (or invalid) gets both objectives set to
INFEASIBLE + its violation, so every feasible policy dominates it and infeasible ones rank by violation.
"""
from __future__ import annotations

import multiprocessing
import random
import time
from dataclasses import dataclass, field

from deap import base, creator, tools

from gaswap.costs import Costs
from gaswap.encoding import Action, Chromosome, Encoding, crossover, mutate
from gaswap.graph import Graph
from gaswap.simulator import Simulator

INFEASIBLE = 1e9  # objective offset of policies that break the budget


@dataclass(frozen=True)
class Evaluated:
    """A chromosome with its predicted step time (s) and peak bytes."""

    chromosome: Chromosome
    step_time: float
    peak_bytes: int
    valid: bool = True

    def feasible(self, budget: int) -> bool:
        return self.valid and self.peak_bytes <= budget

    def counts(self) -> dict[str, int]:
        """How many candidates each action covers."""
        return {a.name.lower(): sum(1 for x in self.chromosome.actions if x == a) for a in Action}


@dataclass(frozen=True)
class SearchResult:
    """The Pareto front of feasible policies (fastest first) and how the search went."""

    front: tuple[Evaluated, ...]
    seeds: dict[str, Evaluated]
    history: tuple[dict, ...]
    evaluations: int
    seconds: float
    smallest_peak: int  # the lowest peak any evaluated valid policy reached (useful when none fits)

    @property
    def best(self) -> Evaluated | None:
        return self.front[0] if self.front else None


@dataclass
class Evaluator:
    """Decodes and simulates chromosomes, in this process or in a pool of worker processes."""

    graph: Graph
    costs: Costs
    encoding: Encoding
    budget: int | None = None
    workers: int = 1
    _pool: object = field(default=None, repr=False)

    def __enter__(self):
        if self.workers > 1:
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
            self._pool = ctx.Pool(self.workers, _init_worker, (self.graph, self.costs, self.encoding, self.budget))
        else:
            _init_worker(self.graph, self.costs, self.encoding, self.budget)
        return self

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    def __call__(self, chromosomes: list[Chromosome]) -> list[Evaluated]:
        if self._pool is None:
            return [_evaluate(c) for c in chromosomes]
        chunk = max(1, len(chromosomes) // (4 * self.workers))
        return self._pool.map(_evaluate, chromosomes, chunksize=chunk)


_WORKER: dict = {}


def _init_worker(graph: Graph, costs: Costs, encoding: Encoding, budget: int | None) -> None:
    _WORKER.update(sim=Simulator(graph, costs, budget), enc=encoding, orders={})


def _evaluate(c: Chromosome) -> Evaluated:
    sim, enc, orders = _WORKER["sim"], _WORKER["enc"], _WORKER["orders"]
    order = orders.get(c.keys)
    if order is None:
        if len(orders) > 4096:
            orders.clear()
        order = orders[c.keys] = enc.decode(c.keys)
    r = sim.run(order, c.actions)
    return Evaluated(c, r.step_time, r.peak_bytes, r.valid)


def _deap_types():
    """DEAP's creator classes, made once (not at import time)."""
    if not hasattr(creator, "GaswapFitness"):
        creator.create("GaswapFitness", base.Fitness, weights=(-1.0, -1.0))
        creator.create("GaswapIndividual", list, fitness=creator.GaswapFitness, evaluated=None)
    return creator.GaswapIndividual


def objectives(e: Evaluated, budget: int) -> tuple[float, float]:
    """NSGA-II objectives with constraint-domination folded in (see the module docstring)."""
    if not e.valid:
        return INFEASIBLE * 2, INFEASIBLE * 2
    if e.peak_bytes > budget:
        violation = (e.peak_bytes - budget) / budget
        return INFEASIBLE + violation, INFEASIBLE + violation
    return e.step_time, float(e.peak_bytes)


def seed_policies(encoding: Encoding) -> dict[str, Chromosome]:
    """The simple policies every search starts from (actions the search space forbids fall back to keep)."""
    return {
        "keep_all": encoding.uniform(Action.KEEP),
        "recompute_all": encoding.uniform(Action.RECOMPUTE),
        "swap_all": encoding.uniform(Action.SWAP),
    }


def search(
    graph: Graph,
    costs: Costs,
    space,
    ga,
    budget: int,
    seed: int,
    *,
    extra_seeds: dict[str, Chromosome] | None = None,
    on_generation=None,
) -> SearchResult:
    """Evolve policies for `graph` under `budget` bytes; `space` and `ga` come from the experiment config.

    `on_generation(record)` is called after each generation with that generation's history row.
    Same inputs and seed give the same result, with any number of workers.
    """
    started = time.perf_counter()
    rng = random.Random(seed)
    encoding = Encoding(graph, tuple(Action.parse(a) for a in space.actions))
    Individual = _deap_types()
    mu = max(4, -(-ga.population // 4) * 4)  # tournament pairs need a multiple of 4

    seeds = seed_policies(encoding) | dict(extra_seeds or {})
    archive: dict[Chromosome, Evaluated] = {}
    history: list[dict] = []
    smallest = [2**62]
    evaluations = 0
    with Evaluator(graph, costs, encoding, budget, ga.workers) as evaluate:

        def assess(chromosomes: list[Chromosome]) -> list:
            nonlocal evaluations
            results = evaluate(chromosomes)
            evaluations += len(results)
            individuals = []
            for e in results:
                ind = Individual([e.chromosome])
                ind.evaluated = e
                ind.fitness.values = objectives(e, budget)
                individuals.append(ind)
                if e.valid:
                    smallest[0] = min(smallest[0], e.peak_bytes)
                if e.feasible(budget):
                    _add_to_archive(archive, e)
            return individuals

        initial = list(dict.fromkeys(seeds.values()))
        initial += [encoding.random(rng, order=space.order) for _ in range(mu - len(initial))]
        population = assess(initial)
        seed_results = {name: next(i.evaluated for i in population if i[0] == c) for name, c in seeds.items()}
        population = tools.selNSGA2(population, mu)
        reference = _reference_point(seed_results, budget)
        best_time, stale = float("inf"), 0
        for gen in range(1, ga.generations + 1):
            parents = _tournament(population, mu, rng)
            children = []
            for a, b in zip(parents[::2], parents[1::2]):
                ca, cb = a[0], b[0]
                if rng.random() < ga.cx_prob:
                    ca, cb = crossover(ca, cb, rng, kind=space.crossover, indpb=space.cx_indpb)
                children += [_maybe_mutate(c, rng, encoding, space, ga.mut_prob) for c in (ca, cb)]
            population = tools.selNSGA2(population + assess(children), mu)
            record = _record(gen, evaluations, archive, reference, started)
            history.append(record)
            if on_generation:
                on_generation(record)
            if record["best_time_s"] < best_time:
                best_time, stale = record["best_time_s"], 0
            else:
                stale += 1
            if ga.patience and stale >= ga.patience:
                break
    front = tuple(sorted(archive.values(), key=lambda e: (e.step_time, e.peak_bytes)))
    return SearchResult(front, seed_results, tuple(history), evaluations, time.perf_counter() - started, smallest[0])


def _maybe_mutate(c: Chromosome, rng: random.Random, encoding: Encoding, space, prob: float) -> Chromosome:
    if rng.random() >= prob:
        return c
    return mutate(c, rng, encoding.allowed, order=space.order, key_sigma=space.key_sigma,
                  key_indpb=space.key_indpb, action_indpb=space.action_indpb)


def _tournament(population: list, k: int, rng: random.Random) -> list:
    """Binary tournaments on (non-domination rank, then larger crowding distance), with our own rng."""
    rank = {}
    for r, front in enumerate(tools.sortNondominated(population, len(population))):
        for ind in front:
            rank[id(ind)] = r

    def better(a, b):
        ka = (rank[id(a)], -a.fitness.crowding_dist)
        kb = (rank[id(b)], -b.fitness.crowding_dist)
        return a if ka <= kb else b

    return [better(*rng.sample(population, 2)) for _ in range(k)]


def _add_to_archive(archive: dict, e: Evaluated) -> None:
    """Keep only feasible points that no other point dominates (time and peak, both lower is better)."""
    if e.chromosome in archive:
        return
    for o in archive.values():
        if o.step_time <= e.step_time and o.peak_bytes <= e.peak_bytes:
            return
    for key in [k for k, o in archive.items() if e.step_time <= o.step_time and e.peak_bytes <= o.peak_bytes]:
        del archive[key]
    archive[e.chromosome] = e


def _reference_point(seeds: dict[str, Evaluated], budget: int) -> tuple[float, float]:
    """Hypervolume reference: twice the slowest valid seed's time, and the budget."""
    times = [e.step_time for e in seeds.values() if e.valid]
    return 2 * max(times), float(budget)


def hypervolume(points: list[tuple[float, float]], reference: tuple[float, float]) -> float:
    """Area dominated by 2-D points (minimising both) up to `reference`."""
    area, prev_y = 0.0, reference[1]
    for x, y in sorted(p for p in points if p[0] < reference[0] and p[1] < reference[1]):
        if y < prev_y:
            area += (reference[0] - x) * (prev_y - y)
            prev_y = y
    return area


def _record(gen: int, evaluations: int, archive: dict, reference, started: float) -> dict:
    points = [(e.step_time, float(e.peak_bytes)) for e in archive.values()]
    best = min((p[0] for p in points), default=float("inf"))
    return {
        "generation": gen,
        "evaluations": evaluations,
        "best_time_s": best,
        "front_size": len(points),
        "hypervolume": hypervolume(points, reference),
        "seconds": time.perf_counter() - started,
    }
