"""GPU memory of experiments' policies as the device would see it: live bytes (the simulator), the caching
allocator model's allocated and reserved peaks (plain and with expandable segments), and an arena plan.

`python -m gaswap memory experiments/alexnet_4gb.yaml ...` prints a markdown table. For each experiment:
keep-all, the fastest baseline that fits the budget (less the device's margin, as `gaswap search` plans:
`budgets`), and the experiment's shipped policy (results/<name>/policy.yaml) when it matches the captured graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gaswap.app import workflow
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.memory import allocator, arena
from gaswap.plan.simulator import Simulator
from gaswap.plan.solvers.baselines import BASELINES
from gaswap.plan import policy as policy_files

GiB = 1 << 30


@dataclass(frozen=True)
class Row:
    experiment: str
    policy: str
    budget: int
    step_time: float
    live: int  # the simulator's peak: bytes of live tensors
    allocated: int  # allocator model: peak of rounded blocks
    reserved: int  # allocator model: peak of segments
    reserved_expandable: int  # ... with expandable_segments:True
    optimizer_step: int  # allocated peak during the optimizer step that follows
    arena: int  # planned arena
    arena_bound: int  # most aligned bytes alive at once


def policies(prepared, planned: int, results_root: str | Path = "results") -> list[tuple[str, list[int], tuple]]:
    """(name, order, actions) of keep-all, the fastest baseline under `planned` live bytes (the budget less the
    device's margin: `budgets`), the shipped policy."""
    graph, costs, exp = prepared.graph, prepared.costs, prepared.experiment
    encoding = Encoding(graph)
    keep = encoding.uniform(Action.KEEP)
    out = [("keep-all", encoding.decode(keep.keys), keep.actions)]
    best = None
    budgeted = Simulator(graph, costs, planned)
    for name, baseline in BASELINES.items():
        c = baseline(graph, costs, planned)
        r = budgeted.run(encoding.decode(c.keys), c.actions)
        if r.valid and r.peak_bytes <= planned and (best is None or r.step_time < best[0]):
            best = (r.step_time, name, c)
    if best is not None:
        out.append((best[1], encoding.decode(best[2].keys), best[2].actions))
    shipped = Path(results_root) / exp.name / "policy.yaml"
    if shipped.exists():
        p = policy_files.load(shipped)
        if p.fingerprint == graph.fingerprint():
            out.append(("shipped policy", p.order_indices(graph), p.action_codes(graph.candidates())))
    return out


def budgets(prepared) -> tuple[int, int]:
    """(the experiment's budget, the live bytes policies are planned for), resolved as `gaswap search` resolves
    them (`workflow.planning_budget`: a fraction of keep-all's peak on the device, less the device's margin)."""
    keep_peak = workflow.planning_problem(prepared).keep_all().peak_bytes
    return workflow.planning_budget(prepared.experiment, keep_peak, workflow.device_margin(prepared))


def rows(prepared, results_root: str | Path = "results") -> list[Row]:
    """A `Row` per policy of `policies`: its live peak, the allocator model's and the arena plan's."""
    graph, costs, exp = prepared.graph, prepared.costs, prepared.experiment
    budget, planned = budgets(prepared)
    sim = Simulator(graph, costs, planned)
    out = []
    for name, order, actions in policies(prepared, planned, results_root):
        result = sim.run(order, actions, trace=True)
        plain = allocator.replay(graph, result, optimizer=exp.optimizer)
        expandable = allocator.replay(graph, result, expandable_segments=True)
        plan = arena.plan(graph, result)
        out.append(Row(exp.name, name, budget, result.step_time, result.peak_bytes, plain.allocated, plain.reserved,
                       expandable.reserved, plain.optimizer_step, plan.size, plan.lower_bound))
    return out


def markdown(table: list[Row]) -> str:
    """The rows as a markdown table, sizes in GiB to three decimals."""
    head = ("| experiment | policy | budget | live peak | allocated | reserved | reserved (expandable) | "
            "optimizer step | arena | arena bound | reserved / live | arena / live |")
    lines = [head, "|" + "---|" * 12]
    for r in table:
        g = lambda n: f"{n / GiB:.3f}"  # noqa: E731
        lines.append(f"| {r.experiment} | {r.policy} | {g(r.budget)} | {g(r.live)} | {g(r.allocated)} | "
                     f"{g(r.reserved)} | {g(r.reserved_expandable)} | {g(r.optimizer_step)} | {g(r.arena)} | "
                     f"{g(r.arena_bound)} | {r.reserved / r.live:.3f} | {r.arena / r.live:.3f} |")
    return "\n".join(lines)
