"""Search one rank's FSDP2 step: activation checkpointing per block class and FSDP's knobs, NSGA-II on (per-rank
peak, step time) under a per-rank budget. No torch here.

Genes (`ShardProblem.decode`): per class of identical units (`unit_classes`: their own forward ops match one by
one), two recompute choices, each a mode (0 keep, 1 full AC, 2 selective, 3 a rung of the class's ladder), one bit
per recomputable forward op of the class (recomputed when selective) and a rung (`recompute_ladder.ladder`: the op
sets a static model of one block finds best for their held bytes and seconds), and a count k: the class's first k units (in forward order, whose
activations live longest) take the first choice, the others the second; an offload count k (the first k of
`offload_order`, the non-root units then the root, get FSDP2's CPUOffloadPolicy: their parameters, gradients and
optimizer state on the host; only where the host's copies and optimizer step can be priced, `host_link` and
`host_step`); per non-root unit, `reshard_after_forward` (0 False, 1 True, 2.. an int: the world size's divisors
from 2 to 8, `reshard_groups`); the forward and backward prefetch depths (the backward's from 1: FSDP2 cannot
turn it off). Two choices and a split per class (not one per unit) keep the genes few on deep models and still
express what per-module planners such as torch's sac_milp pick (early blocks checkpointed more).

An evaluation builds the rank's graph (`sharding.shard_step`), its peak from the simulator (every activation
kept, the graph's order: the recompute is in the graph) and its step time from `sharding.step_time` (ops from the
single-device costs, recomputed ops as their originals, collectives from a `Link`). Selection is NSGA-II (`deap.tools.selNSGA2`) under constraint domination: a policy under the budget
beats any over it, and of two over it the smaller peak wins. Seeds (`SEEDS`): keep-all, full AC and torchtitan's
selective AC (matmul and attention outputs saved, the rest recomputed) on every unit, full AC on the first half
of the units with the rest kept or selective, full AC with half or all of the units offloaded, and greedy
selective choices (a block's ops freeing the most bytes per second of recomputation first), and the budget's fill
(`ShardProblem.fill`: ladder rungs mixed over the blocks as a knapsack on the static model, for the spec's FSDP
knobs and each prefetch depth). After the generations, the fill is redone for the FSDP knobs of the fastest plans seen (`FILL_FINAL`).
Randomness is passed in.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field, replace

from deap import base, tools

from gaswap.plan.costs import Costs, HardwareProfile
from gaswap.plan.graph import Graph
from gaswap.plan.recompute_ladder import (
    FULL,
    KEEP,
    BlockModel,
    fill,
    fill_first,
    hull,
    ladder,
)
from gaswap.plan.sharding import (
    OUTSIDE,
    ROOT,
    Link,
    ParamSpec,
    RankGraph,
    ShardError,
    ShardSpec,
    keep_all_run,
    owned_forward,
    rank_op_times,
    shard_step,
    step_time,
)

MODES = ("keep", "full", "selective", "ladder")
FILL_TRIES = 4  # evaluations a fill may take to come under the budget (each raises the saving by the overshoot)
FILL_FINAL = 3  # after the generations, the fill redone for the FSDP knobs of this many of the fastest plans
MAX_PREFETCH = 2
MIN_BACKWARD_PREFETCH = 1  # FSDP2 (torch 2.13) prefetches one unit in the backward at least: an empty list is 1
MAX_RESHARD_GROUP = 8  # the largest integer reshard_after_forward a gene takes (ranks within one node)
# torchtitan's per-op selective AC (torchtitan/distributed/activation_checkpoint.py at TORCHTITAN_COMMIT): it saves
# the outputs of `_get_default_save_ops()` (torch's compute-intensive ops and its own additions; gaswap's op
# targets are `str(func)`), except every second mm / linear of a block, and recomputes the rest
TORCHTITAN_COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"
TORCHTITAN_SAVED = frozenset({
    "aten._efficient_attention_forward.default", "aten._flash_attention_forward.default",
    "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_mm.default", "aten.addmm.default", "aten.bmm.default", "aten.convolution.default",
    "aten.convolution_backward.default", "aten.mm.default", "aten.upsample_bilinear2d.default",
    "aten._scaled_dot_product_cudnn_attention.default", "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default", "aten.max.default", "aten.linear.default",
    "aten.topk.default"})
TORCHTITAN_MM = ("aten.mm.default", "aten.linear.default")  # counted: every second one recomputed


# seed name -> (the first units' choice, the other units' choice, how many units are first: "all" or "half", the
# fraction of `offload_order` offloaded)
SEEDS = {"keep_all": ("keep", "keep", "all", 0), "full_ac": ("full", "full", "all", 0),
         "selective_ac": ("selective", "selective", "all", 0), "full_ac_first_half": ("full", "keep", "half", 0),
         "full_then_selective": ("full", "selective", "half", 0), "full_ac_offload_half": ("full", "full", "all", 0.5),
         "full_ac_offload_all": ("full", "full", "all", 1),
         **{f"{g}_ac": (g, g, "all", 0) for g in ("greedy_quarter", "greedy_half", "greedy_three_quarters")},
         **{f"full_then_{g}": ("full", g, "half", 0) for g in ("greedy_half", "greedy_three_quarters")}}
# a greedy recompute choice: the fraction of a block's recomputable ops, those freeing the most bytes per second of
# recomputation first (`ShardProblem.by_bytes_per_second`, the order torch's SACEstimator ranks ops in)
GREEDY = {"greedy_quarter": 0.25, "greedy_half": 0.5, "greedy_three_quarters": 0.75}


def torchtitan_saves(targets) -> list[bool]:
    """Per op of a block's forward (its aten targets in order), whether torchtitan's per-op selective AC saves
    its output."""
    out, mm = [], 0
    for target in targets:
        mm += target in TORCHTITAN_MM
        out.append(target in TORCHTITAN_SAVED and not (target in TORCHTITAN_MM and mm % 2 == 0))
    return out


def link_for(profile: HardwareProfile, world_size: int, name: str | None = None) -> tuple[str, Link]:
    """The profile's interconnect a ring of `world_size` ranks runs over: `name`, else its first link within
    `gpus_per_node` and its slowest beyond (the ring crosses nodes); ShardError when the profile has none."""
    if not profile.links:
        raise ShardError(f"hardware profile {profile.name!r} has no `links`: it cannot cost collectives")
    if name is None:
        within = profile.gpus_per_node is None or world_size <= profile.gpus_per_node
        name = next(iter(profile.links)) if within else min(profile.links,
                                                            key=lambda k: profile.links[k]["bandwidth_Bps"])
    if name not in profile.links:
        raise ShardError(f"link {name!r} is not one of hardware profile {profile.name!r}'s: "
                         f"{', '.join(profile.links)}")
    figures = profile.links[name]
    return name, Link(figures["latency_s"], figures["bandwidth_Bps"])


def unit_classes(graph: Graph, units, outside=OUTSIDE) -> list[tuple[str, ...]]:
    """Non-root units grouped by their own forward ops (target, signature, layer inside the unit,
    recomputability), in captured order: identical blocks share a class; a unique unit is a class of one."""
    owned = owned_forward(graph, units, outside)
    classes: dict[tuple, list[str]] = {}
    for u in units:
        if u == ROOT or u not in owned:
            continue
        key = tuple((graph.ops[i].target, graph.ops[i].signature, graph.ops[i].layer[len(u):],
                     graph.ops[i].recomputable) for i in owned[u])
        classes.setdefault(key, []).append(u)
    return [tuple(v) for v in classes.values()]


@dataclass(frozen=True)
class Knobs:
    """One point of the search space: {unit: "full" or positions} recomputed, {unit: bool or int} resharded after
    the forward (an int: to that many ranks), prefetch depths, the units offloaded to the host."""

    recompute: dict
    reshard: dict
    forward_prefetch: int
    backward_prefetch: int
    offload: tuple = ()  # units whose parameters, gradients and optimizer state live on the host

    def spec(self, base_spec: ShardSpec) -> ShardSpec:
        return replace(base_spec, recompute=self.recompute or None, reshard_after_forward=self.reshard,
                       forward_prefetch=self.forward_prefetch, backward_prefetch=self.backward_prefetch,
                       offload=self.offload or base_spec.offload)


@dataclass(frozen=True)
class Point:
    """An evaluated plan: per-rank peak (bytes), step time (s), its knobs and genes, and what first proposed it
    (`origin`: "seed NAME", "fill ..." (`ShardProblem.fill`), "random" or "GA")."""

    peak: int
    step_time: float
    knobs: Knobs
    genes: tuple
    origin: str = ""

    def fits(self, budget: int) -> bool:
        return self.peak <= budget


@dataclass
class ShardProblem:
    """The single-device `graph`, its parameters, the run's `spec` (world size, units, dtypes), seconds per op
    of the single-device graph, the `link`, the per-rank `budget` and FSDP's copy bandwidth (bytes/s)."""

    graph: Graph
    params: list[ParamSpec]
    spec: ShardSpec
    op_time: dict
    link: Link
    budget: int
    copy_bandwidth: float
    replica_link: Link | None = None  # HSDP: the link the all-reduce across replicas runs over
    host_link: Costs | None = None  # CPU offload: the host<->device copies (`Costs.copy_time`)
    host_step: float | None = None  # CPU offload: seconds of the host's optimizer step per offloaded shard byte
    classes: list = field(init=False)
    selectable: list = field(init=False)  # per class: the positions a selective gene may recompute
    ladders: list = field(init=False)  # per class: its ladder of recompute choices (`recompute_ladder.Rung`)
    hulls: list = field(init=False)  # per class: the lower convex hull of its keep, ladder and full points
    units: list = field(init=False)  # non-root units, in the spec's order
    owned: dict = field(init=False)  # unit -> its own forward ops
    reshard_groups: tuple = field(init=False)  # the integer reshard_after_forward values a gene takes
    offload_order: list = field(init=False)  # the offload gene k offloads the first k of these units
    cache: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        units = tuple(dict.fromkeys([u for u in self.spec.units if u != ROOT] + [ROOT]))
        self.classes = unit_classes(self.graph, units, self.spec.outside)
        owned = owned_forward(self.graph, units, self.spec.outside)
        self.selectable = [tuple(p for p, i in enumerate(owned[c[0]]) if self.graph.ops[i].recomputable)
                           for c in self.classes]
        self.units = [u for u in units if u != ROOT]
        self.owned = owned
        self.ladders, self.hulls = [], []
        for c, sel in zip(self.classes, self.selectable):
            model = BlockModel(self.graph, c[0], owned[c[0]], self.op_time)
            rungs = ladder(model, sel, self.by_bytes_per_second(c[0], sel))
            full = model.cost(range(model.n))
            self.ladders.append(rungs)
            self.hulls.append(hull([(model.keep().held, 0.0, KEEP)] + [(r.held, r.seconds, i) for i, r in
                                                                       enumerate(rungs)] + [(full.held, full.seconds, FULL)]))
        W = self.spec.shard_size
        self.reshard_groups = tuple(k for k in range(2, min(MAX_RESHARD_GROUP, W - 1) + 1) if W % k == 0)
        priced = self.host_step is not None and self.host_link is not None and self.spec.offload is False
        self.offload_order = self.units + [ROOT] if priced else []

    # --- genes ---
    def length(self) -> int:
        return self.class_genes() + 1 + len(self.units) + 2

    def class_genes(self) -> int:
        """How many genes the classes' recompute choices take (they come first)."""
        return sum(5 + 2 * len(s) for s in self.selectable)

    def decode(self, genes) -> Knobs:
        genes, k, recompute = list(genes), 0, {}
        for cls, sel, rungs in zip(self.classes, self.selectable, self.ladders):
            first, k = self._choice(genes, k, sel, rungs)
            rest, k = self._choice(genes, k, sel, rungs)
            for i, u in enumerate(cls):  # the first `genes[k]` units (in forward order) take `first`
                chosen = first if i < genes[k] else rest
                if chosen:
                    recompute[u] = chosen
            k += 1
        offload = tuple(self.offload_order[:genes[k]])
        k += 1
        reshard = {u: self.reshard_value(b) for u, b in zip(self.units, genes[k:k + len(self.units)])} | {ROOT: False}
        k += len(self.units)
        return Knobs(recompute, reshard, genes[k], MIN_BACKWARD_PREFETCH + genes[k + 1], offload)

    @staticmethod
    def _choice(genes: list, k: int, sel: tuple, rungs: list) -> tuple:
        """One recompute choice (a mode gene, a bit per selectable op, a rung) read at `k`, and the next position."""
        mode, bits, rung = genes[k], genes[k + 1:k + 1 + len(sel)], genes[k + 1 + len(sel)]
        chosen = "full" if mode == 1 else tuple(p for p, b in zip(sel, bits) if b) if mode == 2 else \
            rungs[rung].positions if mode == 3 and rungs else ()
        return chosen, k + 2 + len(sel)

    def seed(self, name: str) -> tuple:
        """Genes of a seed (`SEEDS`), with the spec's reshard and prefetch knobs: "keep_all", "full_ac",
        "selective_ac" (torchtitan's per-op selective AC, `torchtitan_saves`) on every unit; "full_ac_first_half"
        (full AC on the first half of each class's units, the rest kept), "full_then_selective" (full AC on
        the first half, torchtitan's selective AC on the rest), "full_ac_offload_half" and "full_ac_offload_all"
        (full AC, half or all of `offload_order` offloaded: none where offload is not searched), and greedy
        choices (`GREEDY`) on every unit or after full AC on the first half."""
        genes = []
        for cls, sel in zip(self.classes, self.selectable):
            saves = torchtitan_saves([self.graph.ops[i].target for i in self.owned[cls[0]]])
            choices = {"keep": [0] + [0] * len(sel) + [0], "full": [1] + [0] * len(sel) + [0],
                       "selective": [2] + [int(not saves[p]) for p in sel] + [0]}
            ranked = self.by_bytes_per_second(cls[0], sel)
            for greedy, fraction in GREEDY.items():
                chosen = set(ranked[:round(fraction * len(ranked))])
                choices[greedy] = [2] + [int(p in chosen) for p in sel] + [0]
            first, rest, k, _ = SEEDS[name]
            genes += choices[first] + choices[rest] + [len(cls) if k == "all" else (len(cls) + 1) // 2]
        offload = round(SEEDS[name][3] * len(self.offload_order))
        reshard = [self.reshard_gene(u) for u in self.units]
        prefetch = [min(self.spec.forward_prefetch, MAX_PREFETCH),
                    min(max(self.spec.backward_prefetch, MIN_BACKWARD_PREFETCH), MAX_PREFETCH) - MIN_BACKWARD_PREFETCH]
        return tuple(genes + [offload] + reshard + prefetch)

    def by_bytes_per_second(self, unit: str, sel: tuple) -> list[int]:
        """The selectable positions of `unit`'s forward ops, those whose outputs free the most bytes per second
        of recomputation first (ties: forward order)."""
        ops = self.owned[unit]

        def rate(p: int) -> float:
            op = self.graph.ops[ops[p]]
            return sum(self.graph.tensors[t].size for t in op.outputs) / max(self.op_time.get(op.name, 0.0), 1e-9)

        return sorted(sel, key=lambda p: (-rate(p), p))

    def bounds(self) -> list[int]:
        """The largest value of each gene."""
        out = []
        for cls, sel, rungs in zip(self.classes, self.selectable, self.ladders):
            out += ([len(MODES) - 1] + [1] * len(sel) + [max(len(rungs) - 1, 0)]) * 2 + [len(cls)]
        return out + [len(self.offload_order)] + [1 + len(self.reshard_groups)] * len(self.units) + \
            [MAX_PREFETCH, MAX_PREFETCH - MIN_BACKWARD_PREFETCH]

    def fill(self, genes, origin: str = "fill") -> tuple:
        """`genes` with each class's recompute choices replaced by the fill for the problem's budget
        (`recompute_ladder.fill` on `hulls`), the FSDP and offload genes unchanged: the saving asked for is the
        peak of the same genes with every unit kept, less the budget, raised by the overshoot of each try that
        does not fit (`FILL_TRIES` at most). Where the first try does not fit, the static model missed part of
        the peak: often the last unit's recompute, which runs as the backward starts, at the peak; so the fill is
        also tried with each class's last unit kept (`recompute_ladder.fill_first`). The faster fitting result is returned
        (none fitting: the smaller peak)."""
        tail = list(genes[self.class_genes():])
        keep = self.with_choices([(KEEP, KEEP, 0)] * len(self.classes), tail)
        need = self.evaluate(keep, origin).peak - self.budget
        if need <= 0:
            return keep
        found = []
        for last in (0, 1):  # the classes' last units counted, then kept
            saving = need
            for tries in range(1, FILL_TRIES + 1):
                way = fill_first if last else fill
                out = self.with_choices(way([(len(c), h) for c, h in zip(self.classes, self.hulls)], saving), tail)
                point = self.evaluate(out, origin)
                saving += point.peak - self.budget
                if point.fits(self.budget):
                    break
            found.append(point)
            if tries == 1 and point.fits(self.budget):
                break
        return min(found, key=lambda p: (0, p.step_time) if p.fits(self.budget) else (1, p.peak)).genes

    def with_choices(self, choices: list[tuple], tail: list) -> tuple:
        """Genes from per class (the first units' choice, the others', how many are first), each choice KEEP,
        FULL or a rung of the class's ladder, then `tail` (the offload, reshard and prefetch genes)."""
        genes = []
        for (first, rest, k), sel in zip(choices, self.selectable):
            for tag in (first, rest):
                mode = 0 if tag == KEEP else 1 if tag == FULL else 3
                genes += [mode] + [0] * len(sel) + [tag if mode == 3 else 0]
            genes.append(k)
        return tuple(genes + tail)

    def reshard_value(self, gene: int):
        """A reshard gene's `reshard_after_forward`: 0 False, 1 True, 2.. `reshard_groups`."""
        return bool(gene) if gene < 2 else self.reshard_groups[gene - 2]

    def reshard_gene(self, unit: str) -> int:
        """The spec's `reshard_after_forward` of `unit` as a gene (an int not among `reshard_groups`: True)."""
        k = self.spec.post_forward_group(unit)
        if k in self.reshard_groups:
            return 2 + self.reshard_groups.index(k)
        return int(self.spec.reshards(unit))

    # --- evaluation ---
    def rank(self, knobs: Knobs) -> RankGraph:
        return shard_step(self.graph, self.params, knobs.spec(self.spec))

    def evaluate(self, genes, origin: str = "") -> Point:
        """The plan of `genes` (simulated once per distinct knobs; `origin` is kept from the first time)."""
        knobs = self.decode(genes)
        key = (tuple(sorted(knobs.recompute.items())), tuple(sorted(knobs.reshard.items())),
               knobs.forward_prefetch, knobs.backward_prefetch, knobs.offload)
        if key not in self.cache:
            rank = self.rank(knobs)
            self.cache[key] = Point(peak_bytes(rank), self.time(rank), knobs, tuple(genes), origin)
        return replace(self.cache[key], genes=tuple(genes))

    def time(self, rank: RankGraph) -> float:
        """The rank's step time: its ops on their streams (`sharding.step_time`), then the host's optimizer step
        over the offloaded shards (the device's optimizer step, the same for every plan, is not counted)."""
        times = dict(self.op_time)
        times.update({c: self.op_time.get(o, 0.0) for c, o in rank.recomputed.items()})
        host = rank.host_bytes.get("sharded params", 0) * (self.host_step or 0.0)
        return step_time(rank, rank_op_times(rank, times, self.link, copy_bandwidth=self.copy_bandwidth,
                                                replica_link=self.replica_link, host_link=self.host_link))[0] + host


def peak_bytes(rank: RankGraph) -> int:
    """The rank's peak (the simulator's, every activation kept, the graph's order)."""
    return keep_all_run(rank).peak_bytes


# --- NSGA-II -------------------------------------------------------------------------------------

class _Fitness(base.Fitness):
    weights = (-1.0, -1.0)


class _Individual(list):
    def __init__(self, genes, point: Point):
        super().__init__(genes)
        self.point = point
        self.fitness = _Fitness((float(point.peak), point.step_time))


def select(individuals: list, k: int, budget: int) -> list:
    """`k` survivors under constraint domination: NSGA-II among those under the budget, then those over it by
    their peak."""
    feasible = [i for i in individuals if i.point.fits(budget)]
    if len(feasible) >= k:
        return tools.selNSGA2(feasible, k)
    over = sorted((i for i in individuals if not i.point.fits(budget)), key=lambda i: i.point.peak)
    return feasible + over[:k - len(feasible)]


def _vary(a: list, b: list, bounds: list[int], rng: random.Random, cx: float, mut: float) -> list:
    """A child: uniform crossover of `a` and `b` (probability `cx`), then mutated (probability `mut`): each gene
    redrawn with probability 2 / len, one at least."""
    child = [x if rng.random() < 0.5 else y for x, y in zip(a, b)] if rng.random() < cx else list(a)
    if rng.random() < mut:
        picked = {rng.randrange(len(child))} | {k for k in range(len(child)) if rng.random() < 2 / len(child)}
        for k in picked:
            child[k] = rng.randint(0, bounds[k])
    return child


@dataclass(frozen=True)
class ShardResult:
    """The seeds, the front (under the budget, by peak), the fastest plan under the budget (None: none fits),
    evaluations (distinct plans simulated), CPU seconds and, per generation, (best feasible time, front size)."""

    seeds: dict
    front: list
    best: Point | None
    evaluations: int
    seconds: float
    history: list


def search(problem: ShardProblem, rng: random.Random, *, population: int = 16, generations: int = 8,
           cx_prob: float = 0.9, mut_prob: float = 0.5, max_seconds: float | None = None) -> ShardResult:
    """NSGA-II over `problem`: the first generation is selected from `SEEDS` and `population` random plans (so
    that the seeds, which share the spec's FSDP knobs, do not crowd the knobs' variety out of a small
    population); stops after `generations` or `max_seconds` of CPU time."""
    started = time.process_time()
    bounds = problem.bounds()
    seeds = {name: problem.evaluate(problem.seed(name), f"seed {name}") for name in SEEDS}
    base = list(problem.seed("keep_all"))
    for f, b in itertools.product(range(MAX_PREFETCH + 1), range(MIN_BACKWARD_PREFETCH, MAX_PREFETCH + 1)):
        name = f"fill prefetch {f}/{b}"  # the budget's fill for each prefetch depth, the spec's other knobs
        seeds[name] = problem.evaluate(problem.fill(base[:-2] + [f, b - MIN_BACKWARD_PREFETCH], name), name)
    pop = [_Individual(p.genes, p) for p in seeds.values()]
    for _ in range(population):  # beside the seeds, a population of random plans: FSDP's knobs vary
        genes = [rng.randint(0, hi) for hi in bounds]
        pop.append(_Individual(genes, problem.evaluate(genes, "random")))
    seen = list(pop)
    pop = select(pop, population, problem.budget)
    history = []
    for _ in range(generations):
        if max_seconds is not None and time.process_time() - started > max_seconds:
            break
        children = []
        for _ in range(population):
            a, b = (min(rng.sample(pop, 2), key=lambda i: _rank_key(i, problem.budget)) for _ in range(2))
            genes = _vary(a, b, bounds, rng, cx_prob, mut_prob)
            children.append(_Individual(genes, problem.evaluate(genes, "GA")))
        seen += children
        pop = select(pop + children, population, problem.budget)
        front = _front(seen, problem.budget)
        history.append((min((p.step_time for p in front), default=float("inf")), len(front)))
    seen += [_Individual(g, problem.evaluate(g, "fill after the GA")) for g in _final_fills(problem, seen)]
    front = _front(seen, problem.budget)
    best = min(front, key=lambda p: p.step_time) if front else None
    return ShardResult(seeds, front, best, len(problem.cache), time.process_time() - started, history)


def _final_fills(problem: ShardProblem, seen: list) -> list[tuple]:
    """The fill (`ShardProblem.fill`) for the FSDP and offload genes of the fastest plans seen: those of the
    fastest under the budget first, then of the fastest at all, `FILL_FINAL` distinct settings at most."""
    n = problem.class_genes()
    tails = []
    ranked = sorted((i for i in seen if i.point.fits(problem.budget)), key=lambda i: i.point.step_time) + \
        sorted(seen, key=lambda i: i.point.step_time)
    for i in ranked:
        if tuple(i[n:]) not in tails:
            tails.append(tuple(i[n:]))
        if len(tails) == FILL_FINAL:
            break
    return [problem.fill(problem.with_choices([(KEEP, KEEP, 0)] * len(problem.classes), list(t)), "fill after the GA")
            for t in tails]


def _rank_key(ind, budget: int) -> tuple:
    """Binary tournament order: under the budget first (then faster), else smaller peak."""
    p = ind.point
    return (0, p.step_time, p.peak) if p.fits(budget) else (1, p.peak, p.step_time)


def _front(individuals, budget: int) -> list[Point]:
    """The non-dominated plans under the budget, distinct, by peak."""
    feasible = {}
    for i in individuals:
        if i.point.fits(budget):
            feasible.setdefault((i.point.peak, i.point.step_time), i)
    if not feasible:
        return []
    first = tools.sortNondominated(list(feasible.values()), len(feasible), first_front_only=True)[0]
    return sorted((i.point for i in first), key=lambda p: p.peak)
