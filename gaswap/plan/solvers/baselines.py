"""Baseline policies from the literature, as chromosomes the simulator judges like the GA's. No torch here.

Every baseline is a function `(graph, costs, budget) -> Chromosome`: the captured op order, and one action
per candidate of `Encoding(graph)` (RECOMPUTE only where the encoding allows it, KEEP elsewhere).
`BASELINES` maps their names to them.
"""
from __future__ import annotations

import itertools
import math

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Chromosome, Encoding
from gaswap.plan.graph import Graph
from gaswap.plan.problem import Problem
from gaswap.plan.simulator import SimResult, Simulator, liveness
from gaswap.plan.solvers.mincut import min_cut_policies, recompute_seconds_per_byte


def keep_all(graph: Graph, costs: Costs, budget: int) -> Chromosome:
    """Every activation stays on the device: plain PyTorch."""
    return Encoding(graph).uniform(Action.KEEP)


def recompute_all(graph: Graph, costs: Costs, budget: int) -> Chromosome:
    """Every activation that can be is recomputed for the backward pass."""
    return Encoding(graph).uniform(Action.RECOMPUTE)


def swap_all(graph: Graph, costs: Costs, budget: int) -> Chromosome:
    """vDNN / `torch.autograd.graph.save_on_cpu`: every saved activation goes to host memory and back.

    vDNN copies each layer's input back one layer ahead of its backward; `save_on_cpu` copies it back when
    the backward asks (no prefetch). The simulator issues each copy back just in time (at the latest op
    whose compute hides the copy) and only when it fits the budget, so this is vDNN with an ideal
    prefetch distance: at least as fast as one layer ahead whenever the copies fit.
    """
    return Encoding(graph).uniform(Action.SWAP)


def chen_sqrt(graph: Graph, costs: Costs, budget: int) -> Chromosome:
    """Chen et al. 2016, sqrt(n) checkpointing: of the n candidate groups (the outputs of one op) in forward
    order, keep every round(sqrt(n))-th, starting with the first, and recompute the others."""
    encoding = Encoding(graph)
    groups = _groups(encoding)
    every = max(1, round(math.sqrt(len(groups))))
    return _policy(encoding, [k for g, group in enumerate(groups) if g % every for k in group])


def chen_greedy(graph: Graph, costs: Costs, budget: int) -> Chromosome:
    """Chen et al. 2016, memory-greedy segmenting driven by the budget.

    For a segment size b, walk the groups in forward order adding up their bytes; the group that takes the
    sum past b is kept (a checkpoint, the sum restarts) and the others are recomputed. Every b from 0 (keep
    all) to the total is tried; the fastest policy that fits the budget wins, else the one with the
    lowest peak.
    """
    encoding = Encoding(graph)
    groups = _groups(encoding)
    sizes = [sum(graph.tensors[encoding.candidates[k]].size for k in group) for group in groups]
    policies = dict.fromkeys(_policy(encoding, _segment(encoding, groups, sizes, b))
                             for b in sorted({0, *itertools.accumulate(sizes)}))  # distinct, in order
    problem = Problem(graph, costs, budget)
    return min(policies, key=lambda c: _rank(problem.simulate(c), budget))


def dtr(graph: Graph, costs: Costs, budget: int) -> Chromosome:
    """Dynamic Tensor Rematerialization (Kirisame et al. 2021), replayed into a static policy.

    Walk the captured order with keep-all lifetimes; whenever an op's outputs take memory over the budget,
    evict resident candidates (recomputable, not used by this op, no forward reader left) with the smallest
    h = cost / (bytes * staleness) until it fits, where cost is the producer's time and staleness the time
    since the tensor was last produced or read. An evicted tensor comes back when an op reads it. Every
    tensor evicted at least once is recomputed.
    """
    encoding = Encoding(graph)
    sim = Simulator(graph, costs)
    index = {t: k for k, t in enumerate(sim.tensor_names)}
    evictable = {index[t]: k for k, (t, allowed) in enumerate(zip(encoding.candidates, encoding.allowed))
                 if Action.RECOMPUTE in allowed}
    order = encoding.decode(encoding.captured_keys())
    last_use, last_fwd, _ = liveness(sim, order)
    resident, last_access, evicted = set(), {}, set()
    clock, mem = 0.0, sim.base_bytes
    for p, i in enumerate(order):
        for t in sim.op_in[i]:
            if sim.producer[t] >= 0 and t not in resident:  # evicted earlier: rematerialized for this op
                resident.add(t)
                mem += sim.size[t]
        resident.update(sim.op_out[i])
        mem += sim.out_bytes[i]
        busy = set(sim.op_in[i]) | set(sim.op_out[i])
        while mem > budget:
            pool = [t for t in sorted(resident) if t in evictable and t not in busy and last_fwd[t] < p]
            if not pool:
                break
            victim = min(pool, key=lambda t: _h(sim, t, clock - last_access[t]))
            resident.discard(victim)
            evicted.add(evictable[victim])
            mem -= sim.size[victim]
        clock += sim.op_time[i]
        for t in busy:
            last_access[t] = clock
        for t in busy:
            if last_use[t] <= p and not sim.persistent[t] and t in resident:
                resident.discard(t)
                mem -= sim.size[t]
    return _policy(encoding, evicted)


def knapsack(graph: Graph, costs: Costs, budget: int) -> Chromosome:
    """PyTorch's `memory_budget` partitioner (torch._functorch.partitioners), greedy knapsack.

    The room for saved activations is the budget less the keep-all peak without the recomputable
    candidates; candidates are saved by recompute time (their producer's) per byte, best first, while
    they fit in the room, and the rest are recomputed.
    """
    encoding = Encoding(graph)
    sizes = [graph.tensors[t].size for t in encoding.candidates]
    movable = [k for k, allowed in enumerate(encoding.allowed) if Action.RECOMPUTE in allowed]
    room = budget - Problem(graph, costs).keep_all().peak_bytes
    room += sum(sizes[k] for k in movable)

    recomputed = []
    for k in sorted(movable, key=lambda k: recompute_seconds_per_byte(graph, costs, encoding.candidates[k]),
                    reverse=True):
        if sizes[k] <= room:
            room -= sizes[k]
        else:
            recomputed.append(k)
    return _policy(encoding, recomputed)


def min_cut(graph: Graph, costs: Costs, budget: int) -> Chromosome:
    """torch.compile's min-cut partitioner under a memory budget (`activation_memory_budget`-like): of the
    keep/recompute `mincut.min_cut_policies` (the minimum-bytes cut, then more saved by recompute time per
    byte), the fastest that fits `budget`, else the one with the lowest peak."""
    problem = Problem(graph, costs, budget, actions=(Action.KEEP, Action.RECOMPUTE))
    policies = min_cut_policies(problem) or [keep_all(graph, costs, budget)]
    return min(policies, key=lambda c: _rank(problem.simulate(c), budget))


BASELINES = {
    "keep_all": keep_all,
    "recompute_all": recompute_all,
    "swap_all": swap_all,
    "chen_sqrt": chen_sqrt,
    "chen_greedy": chen_greedy,
    "dtr": dtr,
    "knapsack": knapsack,
    "min_cut": min_cut,
}


# --- helpers ---
def _policy(encoding: Encoding, recomputed) -> Chromosome:
    """The captured order, RECOMPUTE for the candidates (indices) in `recomputed` that allow it, else KEEP."""
    recomputed = set(recomputed)
    actions = tuple(int(Action.RECOMPUTE if k in recomputed and Action.RECOMPUTE in allowed else Action.KEEP)
                    for k, allowed in enumerate(encoding.allowed))
    return Chromosome(encoding.captured_keys(), actions)


def _groups(encoding: Encoding) -> list[list[int]]:
    """Candidate indices grouped by producing op (inputs alone), in forward order."""
    graph = encoding.graph
    position = graph.op_index()
    groups: dict[str, list[int]] = {}
    for k, t in enumerate(encoding.candidates):
        groups.setdefault(graph.tensors[t].producer or t, []).append(k)
    return sorted(groups.values(), key=lambda g: position.get(graph.tensors[encoding.candidates[g[0]]].producer, -1))


def _segment(encoding: Encoding, groups: list[list[int]], sizes: list[int], limit: int) -> list[int]:
    """Chen's greedy pass: candidates recomputed with segments of at most about `limit` bytes."""
    recomputed, total = [], 0
    for group, size in zip(groups, sizes):
        total += size
        if total > limit or not all(Action.RECOMPUTE in encoding.allowed[k] for k in group):
            total = 0
        else:
            recomputed += group
    return recomputed


def _rank(r: SimResult, budget: int) -> tuple:
    """Sort key: fitting policies first, fastest first; then the others by peak."""
    fits = r.valid and r.peak_bytes <= budget
    return (not fits, r.step_time if fits else r.peak_bytes)


def _h(sim: Simulator, t: int, staleness: float) -> float:
    """DTR's eviction score: lower goes first."""
    cost = sim.op_time[sim.producer[t]]
    return math.inf if staleness <= 0 or sim.size[t] == 0 else cost / (sim.size[t] * staleness)
