"""What to save for the backward pass as a minimum cut, in the spirit of torch's min-cut partitioner. No torch.

torch.compile's partitioner (torch._functorch.partitioners.min_cut_rematerialization_partition) saves the
fewest bytes from which the backward can recompute everything it reads, and never recomputes compute-bound
ops (matmuls, convolutions, attention) or random ones; with `activation_memory_budget` it then saves more,
by recompute time per byte, as the budget allows. Here on a gaswap Graph:

    nodes      every forward activation and input t, split into t_in -> t_out
    t_in -> t_out   capacity size(t) when t is a candidate (it can be saved), else infinite
    t_out -> u_in   infinite, for each forward op reading t and producing u
    source -> u_in  infinite when u's producer may not be recomputed (random, state-mutating, compute-bound,
                    or u is a candidate whose action set lacks RECOMPUTE), and for the step's inputs
    t_out -> sink   infinite for each candidate (the backward reads it)

A minimum source-sink cut crosses only split edges of candidates: those are saved (kept), every other
candidate is recomputed. Parameters and buffers are resident all step: recomputation reads them for free.
Max-flow is scipy.sparse.csgraph.maximum_flow on integer capacities (bytes in units that keep the sum
under 2**30).
"""
from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Chromosome, Encoding
from gaswap.plan.graph import Graph
from gaswap.plan.op_types import is_compute_intensive
from gaswap.plan.problem import Problem

FILLS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # fractions of the recomputed bytes saved back


def recompute_seconds_per_byte(graph: Graph, costs: Costs, tensor: str) -> float:
    """What recomputing `tensor` costs per byte it frees: its producer's time over its size (inf when empty);
    torch's partitioners save the highest first."""
    size = graph.tensors[tensor].size
    return costs.op_time[graph.tensors[tensor].producer] / size if size else float("inf")


def min_cut_saved(encoding: Encoding, pinned=is_compute_intensive) -> set[int]:
    """Candidate indices (into encoding.candidates) of a minimum-bytes set to save (see the module docstring);
    `pinned(target)` says which ops besides random and state-mutating ones are never recomputed."""
    candidate = {t: k for k, t in enumerate(encoding.candidates)}
    if not candidate:
        return set()
    node, edges = _network(encoding, candidate, pinned)
    source, sink = 2 * len(node), 2 * len(node) + 1
    size = 2 * len(node) + 2
    rows, cols = zip(*edges)
    capacity = csr_matrix((np.fromiter(edges.values(), np.int32, len(edges)), (rows, cols)), shape=(size, size))
    flow = maximum_flow(capacity, source, sink).flow
    residual = (capacity - flow).tocsr()  # flow is antisymmetric: reverse edges get what flows forward
    residual.eliminate_zeros()
    reached = set(breadth_first_order(residual, source, directed=True, return_predecessors=False).tolist())
    return {candidate[t] for t, n in node.items() if t in candidate and 2 * n in reached and 2 * n + 1 not in reached}


def _network(encoding: Encoding, candidate: dict[str, int], pinned) -> tuple[dict[str, int], dict]:
    """The flow network of the module docstring: tensor -> node number n (t_in is 2n, t_out 2n + 1; source and
    sink follow the last), and (from, to) -> integer capacity."""
    graph = encoding.graph
    phase = {op.name: op.phase for op in graph.ops}
    nodes = [t.name for t in graph.tensors.values()
             if t.kind == "input" or (t.producer is not None and phase[t.producer] == "fwd")]
    node = {t: n for n, t in enumerate(nodes)}
    source, sink = 2 * len(nodes), 2 * len(nodes) + 1
    total = sum(graph.tensors[t].size for t in candidate) or 1
    unit = max(1, -(-total // 2**28))
    infinite = 2**30
    edges: dict[tuple[int, int], int] = {}

    def edge(a: int, b: int, capacity: int) -> None:
        edges[a, b] = max(edges.get((a, b), 0), capacity)

    for t, n in node.items():
        k = candidate.get(t)
        edge(2 * n, 2 * n + 1, infinite if k is None else max(1, -(-graph.tensors[t].size // unit)))
        if k is not None:
            edge(2 * n + 1, sink, infinite)
            if Action.RECOMPUTE not in encoding.allowed[k]:
                edge(source, 2 * n, infinite)
        if graph.tensors[t].producer is None:
            edge(source, 2 * n, infinite)
    for op in graph.ops:
        if op.phase != "fwd":
            continue
        pinned_op = not op.recomputable or pinned(op.target)
        for u in (u for u in op.outputs if u in node):
            if pinned_op:
                edge(source, 2 * node[u], infinite)
            for t in (t for t in op.inputs if t in node):
                edge(2 * node[t] + 1, 2 * node[u], infinite)
    return node, edges


def min_cut_policies(problem: Problem) -> list[Chromosome]:
    """Min-cut policies in the captured order for `problem`'s space: for each cut (compute-bound ops pinned
    as torch does, or only random and state-mutating ones) and each fill of FILLS (more candidates saved by
    their producer's time per byte, best first, up to that fraction of the recomputed bytes), the saved
    candidates kept and, where the space allows swapping, also swapped; the others recomputed."""
    encoding, graph, costs = problem.encoding, problem.graph, problem.costs
    if not any(Action.RECOMPUTE in allowed for allowed in encoding.allowed):
        return []
    sizes = [graph.tensors[t].size for t in encoding.candidates]

    def ratio(k: int) -> float:
        return recompute_seconds_per_byte(graph, costs, encoding.candidates[k])

    saving = [Action.KEEP] + ([Action.SWAP] if any(Action.SWAP in a for a in encoding.allowed) else [])
    policies = {}
    for pinned in (is_compute_intensive, lambda target: False):
        saved = min_cut_saved(encoding, pinned)
        ranked = sorted((k for k, allowed in enumerate(encoding.allowed)
                         if Action.RECOMPUTE in allowed and k not in saved), key=ratio, reverse=True)
        room = sum(sizes[k] for k in ranked)
        for fill in FILLS:
            keep, added = set(saved), 0
            for k in ranked:
                if added + sizes[k] > fill * room:
                    break
                keep.add(k)
                added += sizes[k]
            for action in saving:
                actions = tuple(int(action if k in keep and action in allowed else
                                    Action.KEEP if k in keep or Action.RECOMPUTE not in allowed else Action.RECOMPUTE)
                                for k, allowed in enumerate(encoding.allowed))
                policies[Chromosome(encoding.captured_keys(), actions)] = None
    return list(policies)
