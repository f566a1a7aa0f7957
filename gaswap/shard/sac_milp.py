"""torch's own SAC planner as a peer: `torch.distributed._tools.sac_ilp.sac_milp` (which blocks to checkpoint and
what fraction of each one's activation memory to discard, a MILP solved by pulp's CBC) followed by
`get_optimal_checkpointing_policy_per_module` (which ops of a block to save at that fraction), read back as gaswap
`Knobs` and evaluated by the same `ShardProblem` as every other method.

torch fills the MILP's inputs from MemTracker, RuntimeEstimator and SACEstimator statistics of a run (on a GPU, or
a fake-mode run priced by its roofline). Here they are filled from gaswap's own graph and costs, the figures every
method of the comparison is judged by, so the peer differs from gaswap in its decisions only:

- per op of a block (`SACStats`): its forward seconds (ms), the bytes of the storages it creates (a view creates
  none), random and state-mutating ops as torch's random ops (stored: `force_store_random`);
- per block (`ModStats`): `act_fw_per_module` the bytes of its activations the backward reads, less its output;
  `sac_memory` all its ops' outputs; `act_total` every activation the backward reads up to its output;
  `act_grad_per_module` its output's size twice (the gradients of its output and input at its backward's peak:
  torch measures this, gaswap's graph does not separate it); `grad_total` the gradients of the parameters after
  it (produced before its backward); the trade-off curve from SACEstimator's own greedy order and pwlf fit;
- the root (node 0) carries every parameter; it is never an AC unit.

`sac_milp` models memory coarsely (activations plus sharded parameters and gradients; no optimizer state, no
unsharded parameters, no collective buffers), so its `memory_budget` is not the rank's budget. `plan` gives the
peer its best chance: it bisects that argument for the fastest plan whose per-rank peak, by gaswap's simulator, is
under the budget.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings

from gaswap.plan.shard_search import Knobs, ShardProblem, peak_bytes

GIB = 2 ** 30
BISECTIONS = 12
ROOT_FQN = "Model"  # the root's name in sac_milp's module tree (MemTracker names it by its class)


def available() -> str | None:
    """None when torch's sac_milp can run here, else why not (pulp or pwlf missing)."""
    try:
        import pulp  # noqa: F401
        import pwlf  # noqa: F401
    except ImportError as err:
        return f"torch's sac_milp needs `pulp` and `pwlf` (pip install 'gaswap[peers]'): {err}"
    return None


def sac_stats(problem: ShardProblem, unit: str, saved: set):
    """One block's per-op statistics as torch's SACStats (gaswap's op order, forward ops the unit owns); `saved`:
    the forward outputs the backward reads."""
    from torch.distributed._tools.sac_estimator import SACStats

    g, ops = problem.graph, problem.owned[unit]
    return SACStats(
        func_names=[g.ops[i].target for i in ops],
        runtimes=[problem.op_time.get(g.ops[i].name, 0.0) * 1e3 for i in ops],
        memory=[sum(g.tensors[t].size for t in g.ops[i].outputs) for i in ops],
        view_like_ops=[p for p, i in enumerate(ops) if not g.ops[i].outputs and g.ops[i].recomputable],
        rand_ops=[p for p, i in enumerate(ops) if not g.ops[i].recomputable],
        saved_autograd_ops=[p for p, i in enumerate(ops) if saved.intersection(g.ops[i].outputs)],
        inplace_ops=[], force_store_random=True)


def saved_by_forward(graph) -> set:
    """The forward ops' outputs that backward ops read (what autograd saves)."""
    read = {t for op in graph.ops if op.phase == "bwd" for t in op.inputs}
    return {t for op in graph.ops if op.phase == "fwd" for t in op.outputs if t in read}


def module_graph(problem: ShardProblem, stats: dict, saved: set):
    """torch's ilp_utils.Graph of the model: the root, then every block in forward order."""
    from torch.distributed._tools.ilp_utils import Graph
    from torch.distributed._tools.sac_estimator import SACEstimator

    g, root = problem.graph, ROOT_FQN
    estimator = SACEstimator()
    unit_of = {i: u for u in problem.units for i in problem.owned[u]}
    params = {t.name: t.size for t in g.tensors.values() if t.kind == "param"}
    param_unit = {}
    for i, op in enumerate(g.ops):  # a parameter belongs to the first block that reads it
        for t in op.inputs:
            if t in params and t not in param_unit:
                param_unit[t] = unit_of.get(i, "")
    nodes, total = [], 0
    order = [u for u in problem.units if u in problem.owned]
    for k, u in enumerate(order):
        ops = problem.owned[u]
        last = g.ops[ops[-1]]
        out = sum(g.tensors[t].size for t in last.outputs)
        held = sum(g.tensors[t].size for i in ops for t in g.ops[i].outputs if t in saved)
        total = sum(g.tensors[t].size for op in g.ops[:ops[-1] + 1] if op.phase == "fwd" for t in op.outputs
                    if t in saved) + out
        later = sum(n for t, n in params.items() if param_unit.get(t) in order[k + 1:] or param_unit.get(t) == "")
        s = stats[u]
        tradeoff = estimator._get_sac_tradeoff_pwlf_stats(s, estimator._get_greedy_order_meta(s))
        nodes.append({"fqn": f"{root}.{u}", "param_per_module": sum(n for t, n in params.items()
                                                                      if param_unit.get(t) == u),
                      "grad_total": later, "act_fw_per_module": max(0, held - out), "act_bw_per_module": 0,
                      "act_grad_per_module": 2 * out, "act_total": total, "input_per_module": 0,
                      "output_per_module": out, "fw_runtime_per_module": 0.0, "bw_runtime_per_module": 0.0,
                      "is_leaf": False, "sac_runtime": tradeoff.sac_runtime, "sac_memory": tradeoff.sac_memory,
                      "n_segments": tradeoff.n_segments, "slopes": tradeoff.slopes,
                      "intercepts": tradeoff.intercepts, "breakpoints": tradeoff.fit_breaks,
                      "tradeoff_curve": tradeoff.tradeoff_curve})
    all_saved = sum(g.tensors[t].size for t in saved)
    root_node = {"fqn": root, "param_per_module": sum(params.values()), "grad_total": 0,
                 "act_fw_per_module": all_saved, "act_bw_per_module": 0, "act_grad_per_module": 0,
                 "act_total": all_saved, "input_per_module": 0, "output_per_module": 0,
                 "fw_runtime_per_module": 0.0, "bw_runtime_per_module": 0.0, "is_leaf": False,
                 "sac_runtime": 0.0, "sac_memory": max(all_saved, 1), "n_segments": 0, "slopes": [],
                 "intercepts": [], "breakpoints": [], "tradeoff_curve": {}}
    graph = Graph(len(nodes) + 1)
    graph.fw_post_order = [n["fqn"] for n in nodes] + [root]
    for index, node in enumerate([root_node] + nodes):
        node["index"] = index
        node["pos_fw_post_order"] = graph.fw_post_order.index(node["fqn"])
        graph.add_node(node)
    for i in range(len(graph.nodes)):  # torch's ancestor-descendant matrix: the root above every block
        graph.ad_matrix[i][i] = 1
        if i:
            graph.ad_matrix[0][i] = 1
    return graph


def knobs_for(problem: ShardProblem, decisions: dict, stats: dict) -> Knobs:
    """sac_milp's {block fqn: fraction discarded} as gaswap knobs: per block, the ops torch's per-module MILP
    saves at 1 - fraction; the rest of the block's recomputable ops recomputed ("full" when all are)."""
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    base = problem.decode(problem.seed("keep_all"))
    root, recompute = ROOT_FQN, {}
    selectable = {u: sel for cls, sel in zip(problem.classes, problem.selectable) for u in cls}
    for fqn, discard in decisions.items():
        u = fqn[len(root) + 1:]
        with warnings.catch_warnings():  # as in `plan`
            warnings.simplefilter("ignore", DeprecationWarning)
            save = get_optimal_checkpointing_policy_per_module(stats[u], memory_budget=max(0.0, min(1.0, 1 - discard)))
        chosen = tuple(p for p in selectable[u] if not save or save[p] == 0)
        if chosen:
            recompute[u] = "full" if len(chosen) == len(selectable[u]) else chosen
    return dataclasses.replace(base, recompute=recompute)


def plan(problem: ShardProblem, budget: int) -> tuple[Knobs | None, dict]:
    """The fastest sac_milp plan whose per-rank peak (gaswap's simulator) is at most `budget` bytes, over
    `memory_budget` arguments bisected between 0 and its own no-AC peak; (None, info) when none fits. info:
    the `memory_budget` used (GiB), sac_milp's own peak bound and recomputation time, and the solves run."""
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline
    from torch.distributed._tools.sac_ilp import sac_milp

    logging.getLogger("torch.distributed._tools.sac_ilp").setLevel(logging.CRITICAL)
    saved = saved_by_forward(problem.graph)
    stats = {u: sac_stats(problem, u, saved) for u in problem.units if u in problem.owned}
    graph = module_graph(problem, stats, saved)
    units = [n["fqn"] for n in graph.nodes[1:]]
    W = problem.spec.shard_size
    solves = 0

    def solve(memory_budget: float):
        """(knobs, info) of sac_milp at `memory_budget`; "below" when its own model finds it infeasible (ask
        for more), "over" when its plan exceeds the rank's budget in gaswap's simulator (ask for less)."""
        nonlocal solves
        solves += 1
        with warnings.catch_warnings():  # pulp 3 deprecates the CBC command torch calls (removed in pulp 4)
            warnings.simplefilter("ignore", DeprecationWarning)
            decisions, rct, bound = sac_milp(graph, memory_budget=memory_budget, world_size=W, ac_units=units,
                                             fsdp_units=units)
        if bound < 0:
            return "below"
        knobs = knobs_for(problem, decisions, stats)
        if peak_bytes(problem.rank(knobs)) > budget:
            return "over"
        return knobs, {"memory_budget_gib": memory_budget, "milp_peak_bytes": bound, "milp_recompute_ms": rct}

    low, high = 0.0, get_peak_memory_runtime_baseline(graph)[0] / GIB  # no FSDP, no AC: nothing to discard
    best = solve(high)
    for _ in range(0 if isinstance(best, tuple) else BISECTIONS):
        mid = (low + high) / 2
        found = solve(mid)
        if found == "over":
            high = mid
        else:
            low = mid
            best = found if isinstance(found, tuple) else best
    knobs, info = best if isinstance(best, tuple) else (None, {})
    return knobs, info | {"solves": solves}
