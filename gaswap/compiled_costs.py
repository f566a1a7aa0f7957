"""A cost and memory model of the *compiled* training step, for the simulator to price compiled policies.

gaswap's costs (`measure.measure`) time each op of a graph alone, and the simulator counts every tensor an
op makes. Inductor does not run the joint graph that way: it runs matmuls and convolutions as library calls
("extern" kernels), and fuses everything else (pointwise ops, reductions, concatenations, views) into a few
generated C++ (or Triton) kernels whose intermediates never reach memory. This module turns the joint graph
and its costs into what the compiled step does, leaving the simulator as it is:

- `fused_graph(graph, loss)`: the same graph, with the tensors that stay inside a fused kernel sized 0 (made
  and read only by generated ops, with no library call in between, and not a candidate, a gradient or the
  loss), and the eager loss between the compiled forward and backward as an op of its own (`with_loss`).
- `calibrate(...)`: the cost of the compiled kernels. Generated ops are priced at `scale` times their
  standalone sum (a fused kernel reads and writes less than its ops one by one), extern ops at
  `extern_scale` times theirs, and the step pays a fixed `overhead` (the compiled module's call, the loss,
  the optimizer step: work outside the joint graph). The three are fitted on three compiled runs: keep-all,
  recompute-generated (what generated ops make, recomputed) and recompute-all; every other policy is a
  prediction. (Fitted on keep-all and recompute-all alone, the extra time of recompute-all was all put on
  its recomputed convolutions on DenseNet: generated recomputation was priced free, and the search chose
  80 recomputations that cost 14-18 % of the step.)
- The standalone op times are `gaswap.measure`'s, which on a CPU are CPU seconds, not wall seconds (wall
  time taken on a loaded machine is several times the op's cost: that made the first compiled predictions
  9-13x too slow on DenseNet).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import numpy as np

from gaswap.costs import Costs
from gaswap.encoding import Action, Chromosome
from gaswap.graph import Graph, Op, Tensor
from gaswap.problem import Problem
from gaswap.simulator import SimResult, Simulator

# Ops inductor runs as library calls on CPU and CUDA (matmul, convolution, attention families); the rest
# it generates and fuses. Prefixes of the aten target names.
EXTERN = ("aten.convolution.", "aten.convolution_backward.", "aten.mm.", "aten.addmm.", "aten.bmm.",
          "aten.baddbmm.", "aten._scaled_dot_product", "aten._flash_attention", "aten._efficient_attention",
          "aten.randint.", "aten._cudnn_", "aten.mkldnn_", "aten._convolution")


def is_extern(target: str) -> bool:
    """Whether inductor runs an op of this aten target as a library call (not fused)."""
    return target.startswith(EXTERN)


# What the eager loss between the compiled forward and backward holds besides the model's output and its
# gradient, in units of the output's size: cross entropy saves log_softmax's result and makes nll_loss's
# gradient before log_softmax's backward makes the output's; mse saves its input; sum saves nothing.
LOSS_TEMPORARIES = {"cross_entropy": 1, "mse": 0, "sum": 0}


def fused_graph(graph: Graph, loss: str = "sum") -> Graph:
    """`graph` as inductor runs it, for the simulator (the same under every policy), with the step's `loss`
    computed eagerly between the compiled forward and backward (`with_loss`):

    - a tensor stays inside a fused kernel (sized 0) if a generated op makes it, generated ops alone read it,
      no library call runs between its making and its last reading (inductor does not fuse across one: an
      unrolled GRU's gradient sums, chained across 24 matmuls, would otherwise keep every matmul's output
      alive: predicted 13.7 MB, measured 6.3), and it is neither the loss nor a candidate (a kept one is
      saved; a recomputed one is counted too: measured on DenseNet, counting recomputed tensors as fused
      predicted peaks up to 2.2x too low, since inductor materializes much of what the backward recomputes);
    - an op reading such a tensor reads what it is computed from instead (inductor inlines it), so those
      tensors live until the op runs.

    Saved tensors are freed after their last reader, as the compiled backward frees its inputs. (Holding
    them to the backward's end matched the resident-set meter on the CNN, but torch's allocator counts
    show the frees: that variant predicted keep-all 15 % high on the CNN and 12 % high on DenseNet.)
    """
    candidates = set(graph.candidates())
    extern = {op.name for op in graph.ops if is_extern(op.target)}
    readers = graph.consumers()
    position = graph.op_index()
    extern_at = [k for k, op in enumerate(graph.ops) if op.name in extern]

    def library_call_between(t: str) -> bool:
        start, end = position[graph.tensors[t].producer], max(position[r] for r in readers[t])
        return bisect.bisect_right(extern_at, start) < bisect.bisect_left(extern_at, end)

    inside = {name for name, t in graph.tensors.items()
              if t.kind == "activation" and t.producer not in extern and name not in candidates and name != graph.loss
              and readers[name] and not any(r in extern for r in readers[name]) and not library_call_between(name)}
    producer = {op.name: op for op in graph.ops}
    sources: dict[str, tuple[str, ...]] = {}  # inside tensor -> the materialized tensors it is computed from

    def source(t: str) -> tuple[str, ...]:
        if t not in inside:
            return (t,)
        if t not in sources:
            sources[t] = tuple(dict.fromkeys(s for i in producer[graph.tensors[t].producer].inputs for s in source(i)))
        return sources[t]

    ops = [replace(op, inputs=tuple(dict.fromkeys((*op.inputs, *(s for i in op.inputs for s in source(i))))))
           for op in graph.ops]
    tensors = {name: Tensor(t.name, 0, t.kind, t.producer) if name in inside else t
               for name, t in graph.tensors.items()}
    return with_loss(Graph(tuple(ops), tensors, graph.resident, graph.counted, graph.loss), loss)


LOSS_OP = "gaswap.loss"


def with_loss(graph: Graph, loss: str) -> Graph:
    """`graph` (a compiled joint graph, whose output's gradient arrives from outside) with the eager loss
    that makes that gradient: an op `LOSS_OP`, between the forward and backward ops, reads the output (which
    is then freed: the graph has no loss tensor held to the end), makes the gradient and holds the loss's
    temporaries (`LOSS_TEMPORARIES`) while it runs. The gradient is a new activation its readers read; the
    resident `grad_output` placeholder is sized 0 (the meter sees the gradient appear, not resident all
    step). The output becomes a candidate, to be kept (see `CompiledProblem`)."""
    grad_output = next((t for t in graph.tensors.values() if t.kind == "grad_output"), None)
    if grad_output is None or graph.loss is None:
        return graph
    made = Tensor(f"{LOSS_OP}.grad_output", grad_output.size, "activation", LOSS_OP)
    temporary = Tensor(f"{LOSS_OP}.temporaries", LOSS_TEMPORARIES[loss] * grad_output.size, "activation", LOSS_OP)
    tensors = dict(graph.tensors) | {grad_output.name: replace(grad_output, size=0), made.name: made,
                                     temporary.name: temporary}
    ops = [replace(op, inputs=(*op.inputs, made.name)) if grad_output.name in op.inputs else op for op in graph.ops]
    loss_op = Op(LOSS_OP, f"loss.{loss}", (graph.loss,), (made.name, temporary.name), phase="bwd")
    ops = [o for o in ops if o.phase == "fwd"] + [loss_op] + [o for o in ops if o.phase != "fwd"]
    return Graph(tuple(ops), tensors, graph.resident, graph.counted, None)


class CompiledProblem(Problem):
    """A `Problem` whose policies are simulated as inductor runs them, the eager `loss` around them: on the
    joint graph's `fused_graph` (`fused`: the joint graph's candidates, whose actions a chromosome gives, and
    the output, kept until the loss op, run where the backward starts, reads it); `graph` stays the joint
    graph."""

    def __init__(self, graph: Graph, costs: Costs, budget: int | None = None, space=None, *, actions=None,
                 loss: str = "sum"):
        super().__init__(graph, costs, budget, space, actions=actions)
        self.loss = loss
        self.fused = fused_graph(graph, loss)
        index = self.fused.op_index()
        self._position = [index[op.name] for op in graph.ops]  # joint graph's op k -> the fused graph's op
        self._loss = index.get(LOSS_OP)
        joint = {t: k for k, t in enumerate(self.encoding.candidates)}
        self._action = [joint.get(t) for t in self.fused.candidates()]  # None: the output the loss reads, kept
        loss_time = {LOSS_OP: 0.0} if self._loss is not None else {}  # in the calibrated overhead
        self.simulator = Simulator(self.fused, replace(costs, op_time=costs.op_time | loss_time), budget)

    def __getstate__(self) -> dict:
        return super().__getstate__() | {"loss": self.loss}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["graph"], state["costs"], state["budget"], state["space"], actions=state["actions"],
                      loss=state["loss"])

    def simulate(self, c: Chromosome, *, trace: bool = False) -> SimResult:
        order = [self._position[k] for k in self.order(c)]
        if self._loss is not None:  # where the backward starts
            start = next((i for i, k in enumerate(order) if self.fused.ops[k].phase == "bwd"), len(order))
            order.insert(start, self._loss)
        actions = tuple(int(Action.KEEP) if k is None else c.actions[k] for k in self._action)
        return self.simulator.run(order, actions, trace=trace)

    def actions_of(self, c: Chromosome) -> dict[str, str]:
        """`c`'s actions by candidate name ("keep" / "recompute")."""
        return {t: Action(a).name.lower() for t, a in zip(self.encoding.candidates, c.actions)}


@dataclass(frozen=True)
class Calibration:
    """How a compiled step costs: `scale` times the standalone time of the generated ops, `extern_scale` times
    that of the library calls, plus `overhead` seconds per step; `points` are the (policy, measured s)
    fitted on."""

    scale: float
    overhead: float
    points: tuple = ()
    extern_scale: float = 1.0

    def costs(self, graph: Graph, costs: Costs) -> Costs:
        """`costs` with every generated op's time multiplied by `scale`, every extern op's by `extern_scale`."""
        op_time = {op.name: costs.op_time[op.name] * (self.extern_scale if is_extern(op.target) else self.scale)
                   for op in graph.ops}
        return replace(costs, op_time=op_time,
                       source=f"{costs.source}+compiled(scale {self.scale:.3g}, extern {self.extern_scale:.3g})")

    def to_dict(self) -> dict:
        return {"scale": self.scale, "extern_scale": self.extern_scale, "overhead_s": self.overhead,
                "points": [list(p) for p in self.points]}


def split_time(graph: Graph, costs: Costs, simulate) -> tuple[float, float]:
    """(extern seconds, generated seconds) of one simulated policy: `simulate(costs)` returns its step time;
    run with generated ops zeroed, then with extern ops zeroed."""
    only = lambda keep: replace(costs, op_time={op.name: costs.op_time[op.name] if is_extern(op.target) == keep  # noqa: E731
                                                else 0.0 for op in graph.ops})
    return simulate(only(True)), simulate(only(False))


def fit(points: list[tuple[str, float, float, float]]) -> Calibration:
    """Fit `measured = extern_scale * extern + scale * generated + overhead` on points (label, extern s,
    generated s, measured s) by non-negative least squares. A term that does not vary over the points cannot
    be told from the overhead: its scale is 1."""
    from scipy.optimize import nnls

    fixed = {k: 1.0 for k in (1, 2) if len({round(p[k], 9) for p in points}) < 2}
    free = [k for k in (1, 2) if k not in fixed]
    rows = [[p[k] for k in free] + [1.0] for p in points]
    ys = [p[3] - sum(p[k] * f for k, f in fixed.items()) for p in points]
    solved, _ = nnls(np.array(rows), np.array(ys)) if points else ([], 0.0)
    scales = fixed | dict(zip(free, solved))
    return Calibration(float(scales[2]), float(solved[-1]) if points else 0.0,
                       tuple((label, m) for label, _, _, m in points), float(scales[1]))


def calibrate(graph: Graph, costs: Costs, cpu_times, provenance: dict) -> Calibration:
    """Fit the compiled step's cost (`fit`) on `graph` compiled under keep-all, recompute-generated (every
    candidate a generated op makes, recomputed) and recompute-all: `cpu_times(policies)` compiles and trains
    under each policy and returns CPU seconds per step; `provenance` must name the graph's optimizer and
    counts (see `compiled.make_policy`)."""
    from gaswap import compiled

    problem = CompiledProblem(graph, costs, None, actions=(Action.KEEP, Action.RECOMPUTE))
    encoding, producer = problem.encoding, {op.name: op for op in graph.ops}
    generated = tuple(int(Action.RECOMPUTE) if Action.RECOMPUTE in allowed
                      and not is_extern(producer[graph.tensors[t].producer].target) else int(Action.KEEP)
                      for t, allowed in zip(encoding.candidates, encoding.allowed))
    chromosomes = {"keep-all": encoding.uniform(Action.KEEP),
                   "recompute-generated": Chromosome(encoding.captured_keys(), generated),
                   "recompute-all": encoding.uniform(Action.RECOMPUTE)}
    distinct = {}
    for label, c in chromosomes.items():
        if c.actions not in {d.actions for d in distinct.values()}:
            distinct[label] = c
    made = [compiled.make_policy(graph, problem.actions_of(c), provenance=provenance) for c in distinct.values()]
    points = []
    for (label, c), seconds in zip(distinct.items(), cpu_times(made)):
        extern, generated_s = split_time(graph, costs, lambda cs: CompiledProblem(graph, cs, None, actions=(
            Action.KEEP, Action.RECOMPUTE)).simulate(c).step_time)
        points.append((label, extern, generated_s, seconds))
    return fit(points)
