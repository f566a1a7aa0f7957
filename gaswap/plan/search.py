"""NSGA-II over (step time, peak memory) with the memory budget as a constraint. No torch here.

    population <- seeds (keep-all, recompute-all, swap-all; baselines, min-cut and MILP policies that fit)
                  + random chromosomes; evaluate
    repeat for each generation:
        parents   <- binary tournaments on (feasible first, less violation, front rank, crowding distance)
        offspring <- crossover (cx_prob) then mutation (mut_prob) of parent pairs, then, with probability
                     space.share_blocks, one block policy per class of identical blocks; evaluate the new ones
        population <- NSGA-II selection under constraint-domination (`select`) of the best `population` of
                     parents + offspring
        front     <- feasible points nobody dominates (`front.Front`); record best feasible time, front size,
                     hypervolume
        fastest   <- the FASTEST_KEPT fastest feasible points evaluated, one per (step time, peak)
                     (`front.Fastest`)

Objectives and constraint apart, as pymoo's F and G: an `Evaluated` holds F = (step time, peak bytes) and its
violation G (`Evaluated.violation`: 0 when it fits, inf when it is invalid). Selection is Deb's
constraint-domination, as pymoo's NSGA-II does it (`select`): the feasible first, by DEAP's NSGA-II
(`selNSGA2(..., nd="log")`: non-dominated sorting and crowding on F); then the infeasible, less violation first.
The tournaments compare the same way (`_tournament`): feasible beats infeasible, less violation wins, then
front rank and crowding distance. (Until this rule infeasible points were folded into the objectives as 1e9 +
violation, which is constraint-domination only while feasible peaks stay under 1 GB; see CHANGELOG.md.
Checkpoints of that rule are refused: `gaswap.plan.checkpoint` version 2.)

`Search` is the loop, step by step (pymoo's ask/tell): `initial()` or `restore(state)`, then `step()` while
`has_next()`, then `result()`; `state()` is everything carried from one generation to the next, as plain
data. `search()` drives it, with an optional checkpoint file (`gaswap.plan.checkpoint`) written after the initial
population, at most every CHECKPOINT_SECONDS after that, and when the search leaves between generations, so
a stopped or killed search resumes and reaches exactly what an uninterrupted one reaches (wall-clock seconds
aside). It stops on the first of its rules (`gaswap.plan.stopping`): `ga.generations`, `ga.max_evaluations`,
`ga.max_seconds`, convergence (`ga.patience` generations without the best time or the hypervolume improving
by `ga.tolerance`: on by default), or a caller's `stop()`. Evaluations go through `map(problem.evaluate, batch)`:
the builtin-like `serial_map` or a `gaswap.plan.parallel.ProcessMap`.
"""
from __future__ import annotations

import base64
import math
import random
import struct
import time
from dataclasses import asdict

from deap import base, creator, tools

from gaswap.plan import checkpoint as checkpoints
from gaswap.plan import stopping
from gaswap.plan.blocks import repeated_blocks, share
from gaswap.plan.encoding import Action, Chromosome, Encoding, crossover, mutate
from gaswap.plan.front import Fastest, Front
from gaswap.plan.parallel import executor, serial_map
from gaswap.plan.problem import Evaluated, Generation, Problem, SearchResult
from gaswap.plan.solvers import milp
from gaswap.plan.solvers.baselines import BASELINES
from gaswap.plan.solvers.mincut import min_cut_policies

SIMPLE_SEEDS = ("keep_all", "recompute_all", "swap_all")  # always in the initial population
MILP_SEED_NODES, MILP_SEED_GAP, MILP_SEED_SECONDS = 500, 0.01, 20.0  # the MILP seed is stopped early
CHECKPOINT_SECONDS = 30.0  # at most one checkpoint per this many seconds while a search runs


def _deap_types():
    """DEAP's creator classes, made once (not at import time)."""
    if not hasattr(creator, "GaswapFitness"):
        creator.create("GaswapFitness", base.Fitness, weights=(-1.0, -1.0))
        creator.create("GaswapIndividual", list, fitness=creator.GaswapFitness, evaluated=None, violation=0.0)
    return creator.GaswapIndividual


def select(individuals: list, k: int) -> list:
    """NSGA-II's survival under constraint-domination (pymoo's, Deb's): the feasible first, chosen and ordered by
    `selNSGA2(..., nd="log")` (fronts of F, crowding distances set), then the infeasible by increasing violation
    (stable; crowding distance 0). Returns up to `k` of `individuals`."""
    feasible = [i for i in individuals if i.violation == 0]
    infeasible = sorted((i for i in individuals if i.violation > 0), key=lambda i: i.violation)
    chosen = tools.selNSGA2(feasible, min(k, len(feasible)), nd="log") if feasible else []
    for i in infeasible:
        i.fitness.crowding_dist = 0.0
    return chosen + infeasible[:k - len(chosen)]


def seed_policies(problem: Problem, milp_ops: int = 0) -> dict[str, Chromosome]:
    """The policies every search starts from: keep-all, recompute-all and swap-all; those other baselines of
    `gaswap.plan.solvers.baselines` (Chen's sqrt(n) and greedy checkpointing, DTR, torch's knapsack) that fit the
    problem's budget; the fastest fitting min-cut policy of the search space (`mincut.min_cut_policies`:
    in the hybrid space its saved set may be swapped instead of kept); and on graphs of at most `milp_ops`
    ops (`ga.milp_seed_ops`) the keep/recompute MILP's policy, solved to a MILP_SEED_GAP gap within
    MILP_SEED_NODES nodes, where it fits. Actions the search space forbids fall back to keep. Policies over
    the budget are left out: they crowd the population (on a 12-layer GPT at 0.4x, where none fits, seeding
    all baselines gave +29.4 % instead of +20.9 % after 100 generations)."""
    graph, costs, budget = problem.graph, problem.costs, problem.budget
    seeds = {}
    for name, baseline in BASELINES.items():
        if name == "min_cut":  # below, with the space's own actions
            continue
        c = problem.restrict(baseline(graph, costs, budget))
        if name in SIMPLE_SEEDS or problem.evaluate(c).feasible(budget):
            seeds[name] = c
    cuts = min_cut_policies(problem)
    fitting = [(e.step_time, k) for k, c in enumerate(cuts)
               if (e := problem.evaluate(c)).feasible(budget)]
    if fitting:
        seeds["min_cut"] = cuts[min(fitting)[1]]
    if len(graph.ops) <= milp_ops and any(Action.RECOMPUTE in a for a in problem.encoding.allowed):
        m = milp.solve(graph, costs, budget, time_limit=MILP_SEED_SECONDS, node_limit=MILP_SEED_NODES,
                       rel_gap=MILP_SEED_GAP)
        c = None if m.chromosome is None else problem.restrict(m.chromosome)
        if c is not None and problem.evaluate(c).feasible(budget):
            seeds["milp"] = c
    return seeds


class Search:
    """NSGA-II on `problem` (its budget and search space) with the GA settings `ga`, seeded by `seed`.

    `seeds` (name -> chromosome) join the simple seed policies in the initial population. `map(func, items)`
    evaluates a batch (in order). `stop()`, asked before each generation, ends the search unfinished when
    True. Same inputs and seed give the same search, with any map.
    """

    def __init__(self, problem: Problem, ga, seed: int, *, seeds: dict[str, Chromosome] | None = None,
                 map=serial_map, stop=None):
        self.problem, self.ga, self.map = problem, ga, map
        self.rules = stopping.rules(ga, stop)
        self.space, self.budget = problem.space, problem.budget
        self.rng = random.Random(seed)
        self.mu = max(4, -(-ga.population // 4) * 4)  # tournament pairs need a multiple of 4
        chosen = seed_policies(problem, ga.milp_seed_ops) | dict(seeds or {})  # in BASELINES' order below
        rank = {name: k for k, name in enumerate(BASELINES)}
        self.seed_chromosomes = dict(sorted(chosen.items(), key=lambda item: rank.get(item[0], len(rank))))
        self.population: list = []  # DEAP individuals in selection order, crowding distances set
        self.front = Front()  # the feasible non-dominated points
        self.fastest = Fastest()  # the fastest feasible points
        self.seeds: dict[str, Evaluated] = {}
        self.history: list[Generation] = []
        self.generation = 0
        self.evaluations = 0
        self.smallest_peak = 2**62  # the lowest peak of any valid policy evaluated
        self.seconds_before = 0.0  # search time spent before this process took over
        self.reference = (math.inf, float(problem.budget))  # hypervolume reference point
        self.started = time.perf_counter()
        self.share_blocks = problem.space.share_blocks
        self.classes = repeated_blocks(problem.encoding) if self.share_blocks else []

    # --- the loop ---
    def initial(self) -> None:
        """Evaluate the seeds and random chromosomes up to the population size; select the population."""
        encoding, space = self.problem.encoding, self.space
        initial = list(dict.fromkeys(self.seed_chromosomes.values()))
        initial += [self._maybe_share(encoding.random(self.rng, order=space.order))
                    for _ in range(self.mu - len(initial))]
        population = self._absorb(self._evaluate(initial))
        self.seeds = {name: next(i.evaluated for i in population if i[0] == c)
                      for name, c in self.seed_chromosomes.items()}
        self.population = select(population, self.mu)
        self.reference = _reference_point(self.seeds, self.budget)

    def has_next(self) -> bool:
        """Whether the search goes on (see `stopped_by`)."""
        return self.stopped_by() is None

    def stopped_by(self) -> str | None:
        """The name of the rule that ends the search now (`gaswap.plan.stopping`), or None."""
        return stopping.stopped_by(self.rules, self)

    def step(self) -> Generation:
        """One generation: tournaments, variation, evaluation of the children, NSGA-II selection."""
        rng, space, ga = self.rng, self.space, self.ga
        parents = _tournament(self.population, self.mu, rng)
        children = []
        for a, b in zip(parents[::2], parents[1::2]):
            ca, cb = a[0], b[0]
            if rng.random() < ga.cx_prob:
                ca, cb = crossover(ca, cb, rng, kind=space.crossover, indpb=space.cx_indpb)
            children += [self._maybe_share(self._maybe_mutate(c)) for c in (ca, cb)]
        self.population = select(self.population + self._absorb(self._evaluate(children)), self.mu)
        record = Generation(self.generation + 1, self.evaluations,
                            min((e.step_time for e in self.front), default=math.inf), len(self.front),
                            self.front.hypervolume(self.reference), self.seconds())
        self.generation = record.generation
        self.history.append(record)
        return record

    def seconds(self) -> float:
        """Seconds spent on this search, earlier runs of a resumed one included."""
        return self.seconds_before + time.perf_counter() - self.started

    def result(self) -> SearchResult:
        """The front (fastest first), the fastest feasible policies and how the search went: complete when a
        rule other than `stop()` ended it."""
        stopped_by = self.stopped_by()
        complete = stopped_by not in (None, stopping.Interrupted.name)
        return SearchResult(self.front.fastest_first(), self.seeds, tuple(self.history), self.evaluations,
                            self.seconds(), self.smallest_peak, complete=complete, generations_done=self.generation,
                            stopped_by=stopped_by if complete else "interrupted",
                            fastest=tuple(self.fastest.points))

    # --- state ---
    def state(self) -> dict:
        """Everything the loop carries to the next generation, as JSON-able data (see gaswap.plan.checkpoint)."""
        version, internal, gauss_next = self.rng.getstate()
        return {
            "generation": self.generation, "evaluations": self.evaluations, "seconds": self.seconds(),
            "smallest_peak": self.smallest_peak,
            "rng": [version, list(internal), gauss_next],
            "population": [_plain(i.evaluated) + [i.fitness.crowding_dist] for i in self.population],
            "archive": [_plain(e) for e in self.front],
            "fastest": [_plain(e) for e in self.fastest.points],
            "seeds": {name: _plain(e) for name, e in self.seeds.items()},
            "history": [asdict(h) for h in self.history],
        }

    def restore(self, plain: dict, path="checkpoint") -> None:
        """Continue from `plain` (a `state()`, already matched to this configuration) instead of `initial()`;
        CheckpointError (naming `path`) when it is malformed, past `ga.generations`, or does not add up
        (`_check_restored`: genes out of range, stored figures the simulator does not give). A checkpoint
        written before searches kept their fastest policies (no "fastest") starts them from its archive."""
        if plain["generation"] > self.ga.generations:
            raise checkpoints.CheckpointError(
                f"{path}: the checkpoint is at generation {plain['generation']}, past ga.generations "
                f"{self.ga.generations}: raise ga.generations, or start the search afresh (without --resume)")
        encoding = self.problem.encoding
        try:
            version, internal, gauss_next = plain["rng"]
            self.rng.setstate((version, tuple(internal), gauss_next))
            self.generation, self.evaluations = int(plain["generation"]), int(plain["evaluations"])
            self.smallest_peak, self.seconds_before = int(plain["smallest_peak"]), float(plain["seconds"])
            self.history = [Generation(**h) for h in plain["history"]]
            seeds = {str(name): _evaluated(row, encoding) for name, row in plain["seeds"].items()}
            archive = [_evaluated(row, encoding) for row in plain["archive"]]
            fastest = [_evaluated(row, encoding) for row in plain.get("fastest", plain["archive"])]
            population = [(_evaluated(row[:5], encoding), float(row[5])) for row in plain["population"]]
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise checkpoints.CheckpointError(f"{path}: malformed checkpoint ({err})") from None
        self._check_restored(seeds, archive, fastest, [e for e, _ in population], path)
        self.seeds, self.front, self.fastest = seeds, Front(archive), Fastest(fastest)
        self.population = []
        for e, crowding in population:
            ind = _individual(e, self.budget)
            ind.fitness.crowding_dist = crowding
            self.population.append(ind)
        self.started = time.perf_counter()
        self.reference = _reference_point(self.seeds, self.budget)

    def _check_restored(self, seeds: dict, archive: list, fastest: list, population: list, path) -> None:
        """Refuse (CheckpointError) restored points that do not add up (`checkpoint.check_points`): the seeds
        must be this configuration's, the population `mu` strong, the history one record per generation."""
        checkpoints.check_points({"seed": list(seeds.values()), "population": population, "archive": archive,
                                  "fastest": fastest}, self.problem.encoding.allowed, self._evaluate,
                                 self.budget, path)
        if {name: e.chromosome for name, e in seeds.items()} != self.seed_chromosomes:
            raise checkpoints.CheckpointError(f"{path}: the checkpoint's seed policies are not this search's "
                                              f"({', '.join(seeds) or 'none'}); {checkpoints.EDITED}")
        if len(population) != self.mu or len(self.history) != self.generation:
            raise checkpoints.CheckpointError(
                f"{path}: the checkpoint holds {len(population)} individuals and {len(self.history)} generation "
                f"records, a search at generation {self.generation} holds {self.mu} and {self.generation}; "
                f"{checkpoints.EDITED}")

    # --- helpers ---
    def _evaluate(self, chromosomes: list[Chromosome]) -> list[Evaluated]:
        return list(self.map(self.problem.evaluate, chromosomes))

    def _absorb(self, results: list[Evaluated]) -> list:
        """Count, keep on the front and among the fastest, and wrap evaluated chromosomes as DEAP individuals."""
        self.evaluations += len(results)
        self.smallest_peak = min([self.smallest_peak, *(e.peak_bytes for e in results if e.valid)])
        feasible = [e for e in results if e.feasible(self.budget)]
        self.front.update(feasible)
        self.fastest.update(feasible)
        return [_individual(e, self.budget) for e in results]

    def _maybe_share(self, c: Chromosome) -> Chromosome:
        """With probability space.share_blocks (where the graph has identical blocks), `c` with one block
        policy per class of identical blocks (`gaswap.plan.blocks.share`)."""
        if self.classes and self.rng.random() < self.share_blocks:
            return share(c, self.classes, self.rng, order=self.space.order)
        return c

    def _maybe_mutate(self, c: Chromosome) -> Chromosome:
        space, rng = self.space, self.rng
        if rng.random() >= self.ga.mut_prob:
            return c
        return mutate(c, rng, self.problem.encoding.allowed, order=space.order, key_sigma=space.key_sigma,
                      key_indpb=space.key_indpb, action_indpb=space.action_indpb)


def search(problem: Problem, ga, seed: int, *, seeds: dict[str, Chromosome] | None = None, on_generation=None,
           checkpoint=None, resume: bool = False, stop=None, about: dict | None = None,
           checkpoint_seconds: float = CHECKPOINT_SECONDS) -> SearchResult:
    """Run a `Search` on `problem` to its end, evaluating with the map `ga` asks for (`parallel.executor`).

    `on_generation(record, nearest)` is called after each generation with its `Generation` and the stopping
    rule nearest to ending the search, as (name, progress) (`stopping.nearest`: what a progress bar shows).
    `checkpoint` (a path): the state is written there after the initial population, then after a generation
    when `checkpoint_seconds` passed since the last write, and whenever the search leaves between two
    generations (done, `stop`, or an exception raised by `on_generation`): a search killed outright loses
    at most `checkpoint_seconds` of work. With `resume`, the search continues from it (CheckpointError when
    it is missing, unreadable or made under another configuration) and ends exactly where an uninterrupted
    search ends. `stop()` is asked before each generation: True ends the search there, with `complete`
    False. `about` (plain data) is stored in the checkpoint to say what it belongs to.
    """
    with executor(ga) as pmap:
        s = Search(problem, ga, seed, seeds=seeds, map=pmap, stop=stop)
        key = None
        if checkpoint is not None:
            key = checkpoints.fingerprint(problem.graph, problem.costs, problem.space, ga, problem.budget, seed,
                                          s.seed_chromosomes)
        if resume:
            s.restore(checkpoints.load(checkpoint, key), checkpoint)
        else:
            s.initial()
        saved = time.perf_counter()

        def save() -> None:
            nonlocal saved
            if checkpoint is not None:
                checkpoints.save(checkpoint, s.state(), key, about)
                saved = time.perf_counter()

        if not resume:
            save()
        unsaved = False
        while s.has_next():
            record = s.step()
            unsaved = True
            if time.perf_counter() - saved >= checkpoint_seconds:
                save()
                unsaved = False
            if on_generation:
                try:
                    on_generation(record, stopping.nearest(s.rules, s))
                except BaseException:
                    if unsaved:  # between two generations: the state is whole
                        save()
                    raise
        if unsaved:
            save()
        return s.result()


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
    """`e` as a DEAP individual: its fitness is F (step time, peak), its `violation` G apart."""
    ind = _deap_types()([e.chromosome])
    ind.evaluated = e
    ind.violation = e.violation(budget)
    ind.fitness.values = e.objectives
    return ind


def _tournament(population: list, k: int, rng: random.Random) -> list:
    """Binary tournaments under constraint-domination, with our own rng: feasible beats infeasible, less
    violation wins, then the lower non-domination rank among the feasible (DEAP's log sort), then the larger
    crowding distance; a tie goes to the first drawn."""
    feasible = [i for i in population if i.violation == 0]
    rank = {}
    if feasible:
        for r, front in enumerate(tools.sortLogNondominated(feasible, len(feasible))):
            for ind in front:
                rank[id(ind)] = r

    def key(i):
        return (i.violation, rank.get(id(i), 0), -i.fitness.crowding_dist)

    return [a if key(a) <= key(b) else b for a, b in (rng.sample(population, 2) for _ in range(k))]


def _reference_point(seeds: dict[str, Evaluated], budget: int) -> tuple[float, float]:
    """Hypervolume reference: twice the slowest valid seed's time, and the budget."""
    times = [e.step_time for e in seeds.values() if e.valid]
    return 2 * max(times), float(budget)

