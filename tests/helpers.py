"""Small hand-made graphs and costs shared by the core tests (no torch)."""
from gaswap.plan.costs import Costs
from gaswap.plan.graph import Graph


def unit_costs(graph: Graph, op_time: float = 1.0, bandwidth: float = 1.0, **times) -> Costs:
    """Every op takes `op_time` seconds unless named in `times`; copies move `bandwidth` bytes/s."""
    return Costs({op.name: times.get(op.name, op_time) for op in graph.ops}, bandwidth, bandwidth, "test", "test")


def trace(result):
    """A timeline as compact tuples: (stream, kind, name, start, end)."""
    return [(e.stream, e.kind, e.name, e.start, e.end) for e in result.timeline]
