"""NSGA-II over (step time, peak memory) with the memory budget as a constraint. No torch here.

    population <- seeds (keep-all, recompute-all, swap-all, ...) + random chromosomes; evaluate
    repeat for each generation:
        parents   <- binary tournaments on (front rank, crowding distance)
        offspring <- crossover (cx_prob) then mutation (mut_prob) of parent pairs; evaluate the new ones
        population <- NSGA-II selection of the best `population` of parents + offspring
        archive   <- feasible points nobody dominates; record best feasible time, front size, hypervolume

Constraint-domination (Deb): a policy over budget (or invalid) gets both objectives set to
INFEASIBLE + its violation, so every feasible policy dominates it and infeasible ones rank by violation.

Everything the loop carries from one generation to the next is a `_State`; with a checkpoint file it is
written after the initial population and after every generation (`gaswap.checkpoint`), so a stopped or
killed search resumes and reaches exactly what an uninterrupted one reaches (wall-clock seconds aside).
"""
from __future__ import annotations

import base64
import math
import multiprocessing
import os
import random
import signal
import struct
import time
from dataclasses import dataclass, field

from deap import base, creator, tools

from gaswap import checkpoint as checkpoints
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
        return {a.label: sum(1 for x in self.chromosome.actions if x == a) for a in Action}


@dataclass(frozen=True)
class SearchResult:
    """The Pareto front of feasible policies (fastest first) and how the search went."""

    front: tuple[Evaluated, ...]
    seeds: dict[str, Evaluated]
    history: tuple[dict, ...]
    evaluations: int
    seconds: float
    smallest_peak: int  # the lowest peak any evaluated valid policy reached (useful when none fits)
    complete: bool = True  # False when `stop` ended the search before its generations (or patience) ran out
    generations_done: int = 0

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
    _shutdown: object = field(default=None, repr=False)  # shared flag: workers may now end on SIGTERM

    def __enter__(self):
        if self.workers > 1:
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
            self._shutdown = ctx.RawValue("b", 0)
            self._pool = ctx.Pool(self.workers, _init_pool_worker,
                                  (self._shutdown, self.graph, self.costs, self.encoding, self.budget))
        else:
            _init_worker(self.graph, self.costs, self.encoding, self.budget)
        return self

    def __exit__(self, exc_type, *exc):
        """Workers leave on their own when all went well, else are terminated; either way they are reaped."""
        if self._pool is not None:
            if exc_type is None:
                self._pool.close()
            else:
                self._shutdown.value = 1  # from now on the workers obey SIGTERM (Pool.terminate sends it)
                self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __call__(self, chromosomes: list[Chromosome]) -> list[Evaluated]:
        if self._pool is None:
            return [_evaluate(c) for c in chromosomes]
        chunk = max(1, len(chromosomes) // (4 * self.workers))
        return self._pool.map(_evaluate, chromosomes, chunksize=chunk)


_WORKER: dict = {}


def _init_worker(graph: Graph, costs: Costs, encoding: Encoding, budget: int | None) -> None:
    _WORKER.update(sim=Simulator(graph, costs, budget), enc=encoding, orders={})


def _init_pool_worker(shutdown, *args) -> None:
    """A worker process ignores Ctrl-C and SIGTERM sent to its process group: the parent decides when the
    search stops, and terminates its workers itself (`shutdown` set: SIGTERM then ends a worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum, frame):
        if shutdown.value:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    _init_worker(*args)


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
    checkpoint=None,
    resume: bool = False,
    stop=None,
    about: dict | None = None,
) -> SearchResult:
    """Evolve policies for `graph` under `budget` bytes; `space` and `ga` come from the experiment config.

    `on_generation(record)` is called after each generation with that generation's history row.
    Same inputs and seed give the same result, with any number of workers.
    `checkpoint` (a path): the state is written there after the initial population and every generation;
    with `resume`, the search continues from it (CheckpointError when it is missing, unreadable or made under
    another configuration) and ends exactly where an uninterrupted search ends. `stop()` is asked before
    each generation: True ends the search there, with `complete` False. `about` (plain data) is stored in
    the checkpoint to say what it belongs to.
    """
    started = time.perf_counter()
    rng = random.Random(seed)
    encoding = Encoding(graph, tuple(Action.parse(a) for a in space.actions))
    mu = max(4, -(-ga.population // 4) * 4)  # tournament pairs need a multiple of 4
    seeds = seed_policies(encoding) | dict(extra_seeds or {})
    key = checkpoints.fingerprint(graph, costs, space, ga, budget, seed, seeds) if checkpoint else None
    with Evaluator(graph, costs, encoding, budget, ga.workers) as evaluate:
        if resume:
            state = _State.restore(checkpoints.load(checkpoint, key), checkpoint, budget, ga, encoding, rng)
        else:
            state = _State(budget)
            initial = list(dict.fromkeys(seeds.values()))
            initial += [encoding.random(rng, order=space.order) for _ in range(mu - len(initial))]
            population = state.absorb(evaluate(initial))
            state.seeds = {name: next(i.evaluated for i in population if i[0] == c) for name, c in seeds.items()}
            state.population = tools.selNSGA2(population, mu)

        def elapsed() -> float:  # seconds spent on this search, earlier runs of a resumed one included
            return state.seconds + time.perf_counter() - started

        def save() -> None:
            if checkpoint is not None:
                checkpoints.save(checkpoint, state.plain(rng, elapsed()), key, about)

        if not resume:
            save()
        reference = _reference_point(state.seeds, budget)
        while not state.done(ga) and not (stop is not None and stop()):
            parents = _tournament(state.population, mu, rng)
            children = []
            for a, b in zip(parents[::2], parents[1::2]):
                ca, cb = a[0], b[0]
                if rng.random() < ga.cx_prob:
                    ca, cb = crossover(ca, cb, rng, kind=space.crossover, indpb=space.cx_indpb)
                children += [_maybe_mutate(c, rng, encoding, space, ga.mut_prob) for c in (ca, cb)]
            state.population = tools.selNSGA2(state.population + state.absorb(evaluate(children)), mu)
            state.advance(_record(state.generation + 1, state.evaluations, state.archive, reference, elapsed()))
            save()
            if on_generation:
                on_generation(state.history[-1])
    front = tuple(sorted(state.archive.values(), key=lambda e: (e.step_time, e.peak_bytes)))
    return SearchResult(front, state.seeds, tuple(state.history), state.evaluations, elapsed(), state.smallest_peak,
                        complete=state.done(ga), generations_done=state.generation)


@dataclass
class _State:
    """What the loop carries from one generation to the next: exactly what a checkpoint holds."""

    budget: int
    population: list = field(default_factory=list)  # DEAP individuals in selection order, crowding set
    archive: dict = field(default_factory=dict)  # Chromosome -> Evaluated: the feasible non-dominated ones
    seeds: dict = field(default_factory=dict)  # name -> Evaluated
    history: list = field(default_factory=list)
    generation: int = 0
    evaluations: int = 0
    smallest_peak: int = 2**62  # the lowest peak of any valid policy evaluated
    best_time: float = math.inf  # the best feasible time so far, and for how many generations it has held
    stale: int = 0
    seconds: float = 0.0  # search time spent before this process took over

    def absorb(self, results: list[Evaluated]) -> list:
        """Count, archive and wrap evaluated chromosomes as DEAP individuals."""
        self.evaluations += len(results)
        for e in results:
            if e.valid:
                self.smallest_peak = min(self.smallest_peak, e.peak_bytes)
            if e.feasible(self.budget):
                _add_to_archive(self.archive, e)
        return [_individual(e, self.budget) for e in results]

    def advance(self, record: dict) -> None:
        """Close a generation: its history row, and how long the best feasible time has held."""
        self.generation = record["generation"]
        self.history.append(record)
        if record["best_time_s"] < self.best_time:
            self.best_time, self.stale = record["best_time_s"], 0
        else:
            self.stale += 1

    def done(self, ga) -> bool:
        return self.generation >= ga.generations or bool(ga.patience and self.stale >= ga.patience)

    def plain(self, rng: random.Random, seconds: float) -> dict:
        """The state as JSON-able data (see gaswap.checkpoint)."""
        version, internal, gauss_next = rng.getstate()
        return {
            "generation": self.generation, "evaluations": self.evaluations, "seconds": seconds,
            "smallest_peak": self.smallest_peak, "best_time_s": self.best_time, "stale": self.stale,
            "rng": [version, list(internal), gauss_next],
            "population": [_plain(i.evaluated) + [i.fitness.crowding_dist] for i in self.population],
            "archive": [_plain(e) for e in self.archive.values()],
            "seeds": {name: _plain(e) for name, e in self.seeds.items()},
            "history": self.history,
        }

    @classmethod
    def restore(cls, plain: dict, path, budget: int, ga, encoding: Encoding, rng: random.Random) -> "_State":
        """The state of a checkpoint (already matched to this configuration); sets `rng` to its state."""
        if plain["generation"] > ga.generations:
            raise checkpoints.CheckpointError(
                f"{path}: the checkpoint is at generation {plain['generation']}, past ga.generations "
                f"{ga.generations}: raise ga.generations, or start the search afresh (without --resume)")
        try:
            version, internal, gauss_next = plain["rng"]
            rng.setstate((version, tuple(internal), gauss_next))
            state = cls(budget, generation=int(plain["generation"]), evaluations=int(plain["evaluations"]),
                        smallest_peak=int(plain["smallest_peak"]), best_time=float(plain["best_time_s"]),
                        stale=int(plain["stale"]), seconds=float(plain["seconds"]), history=list(plain["history"]))
            state.seeds = {str(name): _evaluated(row, encoding) for name, row in plain["seeds"].items()}
            for row in plain["archive"]:
                e = _evaluated(row, encoding)
                state.archive[e.chromosome] = e
            for row in plain["population"]:
                ind = _individual(_evaluated(row[:5], encoding), budget)
                ind.fitness.crowding_dist = float(row[5])
                state.population.append(ind)
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise checkpoints.CheckpointError(f"{path}: malformed checkpoint ({err})") from None
        return state


def _plain(e: Evaluated) -> list:
    """[keys, actions, step time, peak, valid]: keys as base64 of little-endian float64s (exact and fast to
    write for thousands of ops), actions as a string of digits."""
    keys = base64.b64encode(struct.pack(f"<{len(e.chromosome.keys)}d", *e.chromosome.keys)).decode()
    return [keys, "".join(map(str, e.chromosome.actions)), e.step_time, e.peak_bytes, e.valid]


def _evaluated(row: list, encoding: Encoding) -> Evaluated:
    packed, actions, step_time, peak_bytes, valid = row
    raw = base64.b64decode(packed, validate=True)
    if len(raw) != 8 * len(encoding.graph.ops) or len(actions) != len(encoding.candidates):
        raise ValueError(f"a chromosome of {len(raw) / 8:g} keys and {len(actions)} actions, this graph needs "
                         f"{len(encoding.graph.ops)} and {len(encoding.candidates)}")
    chromosome = Chromosome(struct.unpack(f"<{len(raw) // 8}d", raw), tuple(int(a) for a in actions))
    return Evaluated(chromosome, float(step_time), int(peak_bytes), bool(valid))


def _individual(e: Evaluated, budget: int):
    ind = _deap_types()([e.chromosome])
    ind.evaluated = e
    ind.fitness.values = objectives(e, budget)
    return ind


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


def _record(gen: int, evaluations: int, archive: dict, reference, seconds: float) -> dict:
    points = [(e.step_time, float(e.peak_bytes)) for e in archive.values()]
    best = min((p[0] for p in points), default=float("inf"))
    return {
        "generation": gen,
        "evaluations": evaluations,
        "best_time_s": best,
        "front_size": len(points),
        "hypervolume": hypervolume(points, reference),
        "seconds": seconds,
    }
