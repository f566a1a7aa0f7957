"""A cost and memory model of the *compiled* training step, for the simulator to price compiled policies.

gaswap's costs (`measure.measure`) time each op of a graph alone, and the simulator counts every tensor an
op makes. Inductor does not run the joint graph that way: it runs matmuls and convolutions as library calls
("extern" kernels), and fuses everything else (pointwise ops, reductions, concatenations, views) into a few
generated C++ (or Triton) kernels whose intermediates never reach memory. This module turns the joint graph
and its costs into what the compiled step does, leaving the simulator as it is:

- `fused_graph(graph, loss)`: the same graph, with the tensors inductor computes inside the kernels that
  read them sized 0 (`inlined`), and the eager loss between the compiled forward and backward as an op of
  its own (`with_loss`); `CompiledProblem` also gives no memory to the recomputed candidates inductor
  would inline (`inlined`'s second set).
- `calibrate(...)`: the cost of a compiled step, measured where it differs from policy to policy. Every
  policy runs the same forward and backward once; a policy adds the ops it recomputes, and drops the masks
  and the other tensors it does not save. So a step costs a `base` (keep-all, no mask kept, nothing saved:
  measured, not summed from ops), plus the recomputed generated ops at `scale` times their standalone time
  (inductor fuses them into the backward's kernels), the recomputed library calls at `extern_scale` times
  theirs, plus a price per byte of bool mask kept and one per byte saved for the backward, plus a price where
  the backward recomputes no convolution (laid out plainly: `Calibration`). The six are fitted (the base no less
  than the step's library calls alone: `fit`) on seven compiled
  runs: keep-all, masks recomputed, recompute-generated,
  recompute-all and three random halves (in a compare, one random half and torch.compile's three partitions,
  compiled there anyway); every other policy is a prediction. (The model before priced the
  whole step's generated ops with one scale: fusion makes the forward's several times cheaper than their
  standalone sum while a recomputation in the backward is not, so one scale could not fit both. On GPT-2 it
  priced recomputing every generated op free, where it measured +32 %.)
- `fit_peaks`: the memory side, fitted on the same runs' metered peaks when they are given: a peak offset
  (what inductor's programs hold under every policy and no op makes) and whether the recomputed candidates
  `inlined` names take memory (`Calibration`'s why).
- The standalone op times are `gaswap.run.measure`'s, which on a CPU are CPU seconds, not wall seconds (wall
  time taken on a loaded machine is several times the op's cost: that made the first compiled predictions
  9-13x too slow on DenseNet).
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, replace

import numpy as np

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Chromosome
from gaswap.plan.graph import Graph, Op, Tensor
from gaswap.plan.op_types import is_heavy, is_library_call, is_realized
from gaswap.plan.problem import Problem
from gaswap.plan.simulator import SimResult, Simulator

TERMS = ("extern", "generated", "mask", "saved", "plain")  # a calibration point's terms, in order after its label
PARSIMONY = 0.1  # `fit` takes the fewest terms whose worst error left out is within this share of the least

# What the eager loss between the compiled forward and backward holds besides the model's output and its
# gradient, in units of the output's size: cross entropy saves log_softmax's result and makes nll_loss's
# gradient before log_softmax's backward makes the output's; mse saves its input; sum saves nothing.
LOSS_TEMPORARIES = {"cross_entropy": 1, "mse": 0, "sum": 0}


def fused_graph(graph: Graph, loss: str = "sum", cpu: bool = True) -> Graph:
    """`graph` as inductor runs it on a CPU (`cpu`) or a GPU, for the simulator (the same under every
    policy), with the step's `loss` computed eagerly between the compiled forward and backward (`with_loss`):

    - a tensor inductor inlines (`inlined`: not a candidate) is sized 0, and an op reading one reads what it
      is computed from instead, so those tensors live until the op runs. (The first rule, "made and read by
      generated ops with no library call in between", missed that inductor inlines a value into readers on
      both sides of a library call: on compare_cnn_cpu it kept ReLU's gradient written across the
      convolution's backward, and erred -13 to -33 % on five of thirteen policies.)
    - a candidate is counted: a kept one is saved; a recomputed one too, unless inductor would inline it
      (`CompiledProblem` tells the simulator which: `inlined_if_recomputed`).

    Saved tensors are freed after their last reader, as the compiled backward frees its inputs. (Holding
    them to the backward's end matched the resident-set meter on the CNN, but torch's allocator counts
    show the frees: that variant predicted keep-all 15 % high on the CNN and 12 % high on DenseNet.)
    """
    return with_loss(without(graph, inlined(graph, cpu)[0]), loss)


def without(graph: Graph, inside: set[str]) -> Graph:
    """`graph` with the tensors `inside` sized 0, and each op reading one of them reading what it is computed
    from instead."""
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
    return replace(graph, ops=tuple(ops), tensors=tensors)


# inductor's thresholds (torch._inductor.config): distinct buffers a value read more than once may read and
# stay inlined (`realize_reads_threshold`); that any value may read (`realize_cpu_acc_reads_threshold`, 8 on
# a GPU); ops an inlined expression may hold (`realize_cpu_opcount_threshold`, 30 on a GPU).
REUSED_READS, READS, OPS = 4, {True: 12, False: 8}, {True: 50, False: 30}


def library_calls(graph: Graph) -> set[str]:
    """The ops of `graph` inductor runs as library calls: `is_library_call`'s, and an `add` of a matrix product
    read by nothing else (inductor makes the two one `addmm`: an unrolled RNN's gradient sums)."""
    readers = graph.consumers()
    by_name = {op.name: op for op in graph.ops}
    calls = {op.name for op in graph.ops if is_library_call(op.target)}
    for op in graph.ops:
        if op.target == "aten.add.Tensor" and any(
                graph.tensors[t].producer in by_name and by_name[graph.tensors[t].producer].target == "aten.mm.default"
                and readers[t] == [op.name] and graph.tensors[t].size == graph.tensors[op.outputs[0]].size
                for t in op.inputs):
            calls.add(op.name)
    return calls


def inlined(graph: Graph, cpu: bool = True) -> tuple[set[str], set[str]]:
    """The tensors of `graph` inductor computes inside the kernels that read them instead of writing them to
    memory, and the candidates it would so compute where a policy recomputes them (the others it saves).

    As inductor's lowering decides: a tensor made by a generated op that is not realized (`op_types`), read by
    generated ops alone, in the same graph (the forward's or the backward's: a candidate's backward readers
    read its recomputation), and not the loss, is inlined unless its expression is too big: a value read by
    several ops of a graph is written when its inlined expression reads more than `REUSED_READS` buffers or,
    on a CPU, holds heavy math; any value when it reads more than `READS` or holds more than `OPS` ops. An
    inlined value's buffers stay alive until its last reader runs. Measured against inductor's programs,
    one more rule: a value whose readers run after a library call that follows its making is inlined only if
    every buffer it reads is smaller than it. (On compare_cnn_cpu, ReLU's gradient, read on both sides of a
    convolution's backward, is computed twice from the 4x smaller mask and small gradients; on
    compare_gru_cpu, inductor writes the gradient sums of the 24 steps, which read buffers of their size.)"""
    candidates = set(graph.candidates())
    readers = graph.consumers()
    by_name = {op.name: op for op in graph.ops}
    calls = library_calls(graph)
    position = graph.op_index()
    call_at = sorted(position[name] for name in calls)
    reads: dict[str, frozenset] = {}  # inlined tensor -> the buffers its expression reads
    heavy: dict[str, bool] = {}
    count: dict[str, int] = {}  # ops in its expression
    recomputable = set()
    for op in graph.ops:  # in topological order
        if op.name in calls or is_realized(op.target):
            continue
        srcs, costly, n = set(), is_heavy(op.target) and cpu, 1
        for t in op.inputs:
            if t in reads:
                srcs |= reads[t]
                costly |= heavy[t]
                n += count[t]
            else:
                srcs.add(t)
        for t in op.outputs:
            users = [by_name[r] for r in readers[t]]
            candidate = t in candidates
            if (graph.tensors[t].kind != "activation" or t == graph.loss or not users
                    or any(u.name in calls or not candidate and u.phase != op.phase for u in users)):
                continue
            if not _small_enough(graph, op, t, users, (srcs, costly, n), (position, call_at), cpu):
                continue
            if candidate:
                recomputable.add(t)
            else:
                reads[t], heavy[t], count[t] = frozenset(srcs), costly, n
    return set(reads), recomputable


def _small_enough(graph: Graph, op: Op, t: str, users: list[Op], expression, positions, cpu: bool) -> bool:
    """Whether `inlined` leaves `t` (made by `op`, read by `users`) inlined, by the size of its expression
    (the buffers it reads, whether it holds heavy math, its op count) and where the library calls are
    (`positions`: op name -> position, and the library calls' positions, sorted)."""
    srcs, heavy, n = expression
    position, call_at = positions
    spans = []  # (made at, last read at, readers) in each graph it is computed in
    for phase in ("fwd", "bwd"):
        at = [position[u.name] for u in users if u.phase == phase]
        if at:
            spans.append((position[op.name] if phase == op.phase else min(at) - 1, max(at), len(at)))
    reused = any(k > 1 for *_, k in spans)
    if len(srcs) > READS[cpu] or n > OPS[cpu] or reused and (heavy or len(srcs) > REUSED_READS):
        return False
    return not (any(bisect.bisect_right(call_at, a) < bisect.bisect_left(call_at, b) for a, b, _ in spans)
                and any(graph.tensors[s].size >= graph.tensors[t].size for s in srcs))


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
    return replace(graph, ops=tuple(ops), tensors=tensors, loss=None)


class CompiledProblem(Problem):
    """A `Problem` whose policies are simulated as inductor runs them, the eager `loss` around them: on the
    joint graph's `fused_graph` (`fused`: the joint graph's candidates, whose actions a chromosome gives, and
    the output, kept until the loss op, run where the backward starts, reads it); `graph` stays the joint
    graph. With a `calibration`, a simulated step time is the whole compiled step's (`Calibration`); without,
    it is the sum of `costs`' op times (peaks are the same either way). `inline_recomputed`: whether the
    recomputed candidates `inlined` names take no memory (`Calibration`'s why); by default the calibration's
    choice, and so without one."""

    def __init__(self, graph: Graph, costs: Costs, budget: int | None = None, space=None, *, actions=None,
                 loss: str = "sum", calibration: Calibration | None = None, inline_recomputed: bool | None = None):
        super().__init__(graph, costs, budget, space, actions=actions)
        self.loss, self.calibration = loss, calibration
        if inline_recomputed is None:
            inline_recomputed = calibration is None or calibration.inline_recomputed
        self.inline_recomputed = inline_recomputed
        inside, recomputable = inlined(graph, cpu=costs.device.startswith("cpu"))  # else inductor's GPU rules
        self.fused = with_loss(without(graph, inside), loss)  # = fused_graph(graph, loss, cpu)
        index = self.fused.op_index()
        self._position = [index[op.name] for op in graph.ops]  # joint graph's op k -> the fused graph's op
        self._loss = index.get(LOSS_OP)
        joint = {t: k for k, t in enumerate(self.encoding.candidates)}
        self._action = [joint.get(t) for t in self.fused.candidates()]  # None: the output the loss reads, kept
        self._constant = constant_candidates(graph, self.encoding)  # always recomputed (`canonical`)
        self._convolutions = convolution_candidates(graph, self.encoding)  # `plain_backward`
        self._read_back, self._sources = backward_reads(graph, self.encoding)  # `plain_backward`
        self._masks = [(k, size) for k, size in mask_bytes(graph, self.encoding.candidates)
                       if Action.RECOMPUTE in self.encoding.allowed[k]]  # (candidate, bytes): masks a policy may keep
        loss_time = {LOSS_OP: 0.0} if self._loss is not None else {}  # in the calibrated base
        simulated = costs if calibration is None else calibration.costs(graph, costs)
        self.simulator = Simulator(self.fused, replace(simulated, op_time=simulated.op_time | loss_time), budget,
                                   hold_sources=True,
                                   inlined_if_recomputed=recomputable if inline_recomputed else ())
        self._offset = 0.0
        if calibration is not None:  # the keep-all step (masks and saved bytes aside) costs `base`
            keep = self.encoding.uniform(Action.KEEP)
            keep_all = self.simulate(keep)
            self._offset = calibration.base - (keep_all.step_time - calibration.mask_rate * self.kept_mask_bytes(keep)
                                               - calibration.saved_rate * keep_all.saved_bytes
                                               - calibration.plain_rate * self.plain_backward(keep))

    def __getstate__(self) -> dict:
        return super().__getstate__() | {"loss": self.loss, "calibration": self.calibration}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["graph"], state["costs"], state["budget"], state["space"], actions=state["actions"],
                      loss=state["loss"], calibration=state["calibration"])

    def simulate(self, c: Chromosome, *, trace: bool = False) -> SimResult:
        order = [self._position[k] for k in self.order(c)]
        if self._loss is not None:  # where the backward starts
            start = next((i for i, k in enumerate(order) if self.fused.ops[k].phase == "bwd"), len(order))
            order.insert(start, self._loss)
        c = self.canonical(c)
        actions = tuple(int(Action.KEEP) if k is None else c.actions[k] for k in self._action)
        r = self.simulator.run(order, actions, trace=trace)
        if self.calibration is None:
            return r
        return replace(r, step_time=r.step_time + self._offset + self.calibration.mask_rate * self.kept_mask_bytes(c)
                       + self.calibration.saved_rate * r.saved_bytes
                       + self.calibration.plain_rate * self.plain_backward(c),
                       peak_bytes=r.peak_bytes + self.calibration.peak_offset)

    def canonical(self, c: Chromosome) -> Chromosome:
        """`c` as it runs: the candidates computed from constants alone recomputed, whatever `c` says."""
        if not self._constant or all(c.actions[k] == Action.RECOMPUTE for k in self._constant):
            return c
        actions = list(c.actions)
        for k in self._constant:
            actions[k] = int(Action.RECOMPUTE)
        return Chromosome(c.keys, tuple(actions))

    def plain_backward(self, c: Chromosome) -> float:
        """1.0 where the forward holds convolutions and the backward of `c` runs none of them again (inductor then
        lays it out plainly, not channels-last: `Calibration`'s why), else 0.0. The backward runs a recomputation
        where it reads the value, or a value recomputed from it: on a ConvNeXt-style net five of six convolution
        outputs recomputed alone (their readers' inputs kept) put no convolution in the backward, and its layout
        was keep-all's (results/compare_new_models/backward_layout_probe.txt)."""
        if not self._convolutions:
            return 0.0
        if not any(c.actions[k] == Action.RECOMPUTE for k in self._convolutions):
            return 1.0  # no convolution recomputed: none to run
        recomputed = {k for k, a in enumerate(c.actions) if a == Action.RECOMPUTE}
        todo, run = [k for k in self._read_back if k in recomputed], set()
        while todo:
            k = todo.pop()
            if k not in run:
                run.add(k)
                todo += [j for j in self._sources.get(k, ()) if j in recomputed]
        return float(not any(k in run for k in self._convolutions))

    def kept_mask_bytes(self, c: Chromosome) -> int:
        """Bytes of the bool masks `c` keeps, of those it could recompute (the others are kept by every policy:
        their cost is in the base)."""
        c = self.canonical(c)
        return sum(size for k, size in self._masks if c.actions[k] == Action.KEEP)

    def actions_of(self, c: Chromosome) -> dict[str, str]:
        """`c`'s actions by candidate name ("keep" / "recompute"), as it runs (`canonical`)."""
        return {t: Action(a).name.lower() for t, a in zip(self.encoding.candidates, self.canonical(c).actions)}


def constant_candidates(graph: Graph, encoding) -> list[int]:
    """Indices (in `encoding.candidates`) of the recomputable candidates computed from constants alone: by ops
    that read no input, parameter or buffer, directly or through the ops before them (`iota`, `arange`, a
    causal mask made from them). A compiled step always recomputes those: torch's partitioner does, they
    cost almost no memory, and saving one costs time (on compare_gpt_cpu, saving the causal masks and the
    `iota` they come from made the attention kernels 7 ms a step slower)."""
    constant = set()
    for op in graph.ops:  # in topological order
        if op.recomputable and all(t in constant for t in op.inputs):
            constant.update(op.outputs)
    return [k for k, (t, allowed) in enumerate(zip(encoding.candidates, encoding.allowed))
            if Action.RECOMPUTE in allowed and t in constant]


def convolution_candidates(graph: Graph, encoding) -> list[int]:
    """Indices (in `encoding.candidates`) of the candidates whose recomputation runs a forward convolution: made
    by one, or computed from activations no candidate holds, one of which one makes (recomputed where the backward
    runs it, such a candidate puts a convolution in the backward: `CompiledProblem.plain_backward`)."""
    producer = {op.name: op for op in graph.ops}
    candidates = set(encoding.candidates)

    def runs_convolution(t: str) -> bool:
        todo, seen = [graph.tensors[t].producer], set()
        while todo:
            op = producer.get(todo.pop())
            if op is None or op.name in seen:
                continue
            seen.add(op.name)
            if op.target.startswith("aten.convolution."):
                return True
            todo += [graph.tensors[i].producer for i in op.inputs
                     if graph.tensors[i].kind == "activation" and i not in candidates]
        return False

    return [k for k, (t, allowed) in enumerate(zip(encoding.candidates, encoding.allowed))
            if Action.RECOMPUTE in allowed and runs_convolution(t)]


def backward_reads(graph: Graph, encoding) -> tuple[set[int], dict[int, set[int]]]:
    """(indices in `encoding.candidates` of the candidates the backward reads: directly, or through activations no
    candidate holds that are computed from them; {candidate: the nearest candidates it is computed from, through
    activations no candidate holds}): a recomputed candidate runs in the backward where one of the first is
    recomputed from it, or it is one (`CompiledProblem.plain_backward`)."""
    index = {t: k for k, t in enumerate(encoding.candidates)}
    nearest: dict[str, set[int]] = {}  # a tensor -> the candidates it is computed from, through non-candidates
    sources, read = {}, set()

    def through(t: str) -> set[int]:
        if t in index:
            return {index[t]}
        return nearest.get(t, set()) if graph.tensors[t].kind == "activation" else set()

    for op in graph.ops:  # in topological order
        found = set().union(*(through(t) for t in op.inputs)) if op.inputs else set()
        if op.phase == "bwd":
            read |= found
            continue
        for t in op.outputs:
            nearest[t] = found
            if t in index:
                sources[index[t]] = found
    return read, sources


# Comparisons: their results are bool masks (ReLU's `le`, dropout's `gt`).
MASKS = ("aten.le.", "aten.lt.", "aten.gt.", "aten.ge.", "aten.eq.", "aten.ne.", "aten.logical_")


def mask_bytes(graph: Graph, candidates: list[str]) -> list[tuple[int, int]]:
    """(index in `candidates`, bytes) of the candidates that are bool masks."""
    producer = {op.name: op for op in graph.ops}
    return [(k, graph.tensors[t].size) for k, t in enumerate(candidates)
            if graph.tensors[t].producer in producer and producer[graph.tensors[t].producer].target.startswith(MASKS)]


@dataclass(frozen=True)
class Calibration:
    """How a compiled step costs: `base` seconds for keep-all with no mask kept and nothing saved (the compiled
    forward and backward, the eager loss, the optimizer step), plus `scale` times the standalone time of the
    generated ops a policy recomputes and `extern_scale` times that of the library calls it recomputes, plus
    `mask_rate` seconds per byte of bool mask kept and `saved_rate` per byte the forward saves for the
    backward, plus `plain_rate` seconds where the backward recomputes none of the forward's convolutions
    (`CompiledProblem.plain_backward`). `samples` are the fit's inputs (`fit`: label, terms, measured s), which
    `refit` fits again with more; `points` the (label, measured s, predicted s) of each.

    Why `plain_rate`: inductor lays a graph out channels-last only where it holds a convolution
    (`GraphLowering.decide_layout_opt`), so a backward that recomputes none of the forward's convolutions runs
    laid out plainly, converting around the channels-last buffers and library calls of the forward's layout. On
    a ConvNeXt-style net never tuned on, torch's 0.2 partition (five convolutions recomputed) ran 12.9 ms a step
    against 16.9 and 16.3 for its 1 and 0.5 partitions (none recomputed); without the term the fit priced every
    policy within 1 % of keep-all and erred 23.4 % on its own points, with it 4.7 %
    (results/compiled_model/plain_backward.txt).

    Why saved bytes are priced: a saved tensor is written by the forward and read back by the backward,
    while inductor fuses a pointwise recomputation into the backward kernel that reads its sources (on
    compare_cnn_cpu, saving ReLU's output `relu_1` for its mask made a step 73 ms, recomputing it from the
    saved convolution 63 ms; the standalone times of the recomputed ops alone saw no difference).

    Why masks are priced apart: inductor's CPU kernels that store and read a kept mask can be several
    times slower than the ones that recompute it (on compare_cnn_cpu, the ReLU mask `le` is stored in
    another layout than the channels-last convolution outputs around it, and both kernels transpose it
    8x8 bools at a time: keep-all 114 ms a step, the same with the masks recomputed 62 ms).

    Why a `peak_offset` (bytes added to every simulated peak, fitted on the calibration policies' measured
    peaks, `with_peaks`; `peak_samples` its (label, simulated, measured) points): the programs inductor
    generates on a CPU hold buffers no op of the joint graph makes, the same under every policy: the
    batch and the weights copied into the channels-last layout the convolutions take, kept for the
    weights' gradients (on compare_cnn_cpu 0.83 MB, which the simulator missed on five of seven points).
    The median leaves out the points the simulator errs on for reasons of their own.

    Why `inline_recomputed` (whether the recomputed candidates `inlined` names take no memory, or are
    counted as a kept one is; chosen by the calibration's measured peaks, `fit_peaks`): the rules of
    `inlined` hold on some models and not on others (on compare_mixture_cpu, the backward writes the
    recomputed gates and expert activations the rules inline, and torch's 0.2 partition measured 24.8 MB
    where the model said 17.3 MB; on compare_cnn_cpu inductor inlines them)."""

    base: float
    scale: float
    extern_scale: float = 1.0
    mask_rate: float = 0.0
    saved_rate: float = 0.0
    samples: tuple = ()
    peak_offset: int = 0
    peak_samples: tuple = ()
    inline_recomputed: bool = True
    terms: tuple = TERMS  # the terms fitted (`fit`); the others at their defaults
    plain_rate: float = 0.0

    def predict(self, point) -> float:
        """Seconds a step of a fit point (label, extern s, generated s, mask bytes, saved bytes, plain backward,
        measured s; a point without the plain term, as before it, counts it 0)."""
        factors = (self.extern_scale, self.scale, self.mask_rate, self.saved_rate, self.plain_rate)
        return self.base + sum(term * f for term, f in zip(point[1:-1], factors))

    @property
    def points(self) -> tuple:
        """(label, measured s, predicted s) of each sample fitted on."""
        return tuple((p[0], p[-1], self.predict(p)) for p in self.samples)

    def costs(self, graph: Graph, costs: Costs) -> Costs:
        """`costs` with every generated op's time multiplied by `scale`, every extern op's by `extern_scale`."""
        op_time = {op.name: costs.op_time[op.name] * (self.extern_scale if is_library_call(op.target) else self.scale)
                   for op in graph.ops}
        return replace(costs, op_time=op_time,
                       source=f"{costs.source}+compiled(scale {self.scale:.3g}, extern {self.extern_scale:.3g})")

    def worst_error(self) -> float:
        """The largest relative error of the fit on its own points."""
        return max((abs(p - m) / m for _, m, p in self.points), default=0.0)

    def with_peaks(self, peak_samples: list[tuple[str, int, int]]) -> Calibration:
        """This calibration with its `peak_offset` fitted on `peak_samples` (label, simulated peak, measured
        peak, both above resident): the median of measured less simulated (`peak_offset`'s why)."""
        if not peak_samples:
            return self
        offset = int(np.median([measured - simulated for _, simulated, measured in peak_samples]))
        return replace(self, peak_offset=offset, peak_samples=tuple(peak_samples))

    def to_dict(self) -> dict:
        return {"base_s": self.base, "scale": self.scale, "extern_scale": self.extern_scale,
                "mask_s_per_byte": self.mask_rate, "saved_s_per_byte": self.saved_rate,
                "plain_backward_s": self.plain_rate,
                "peak_offset_bytes": self.peak_offset, "inline_recomputed": self.inline_recomputed,
                "terms_fitted": list(self.terms),
                "points": [list(p) for p in self.points]}


def features(problem: CompiledProblem, chromosomes: list[Chromosome], inline_recomputed: bool | None = None
             ) -> list[tuple[float, float, int, int, float]]:
    """Each of `chromosomes` in the calibration's terms: what it adds to keep-all (standalone seconds of the
    library calls it recomputes, of the generated ops it recomputes), the bytes of bool masks it keeps, the
    bytes the forward saves for the backward and whether its backward is laid out plainly
    (`CompiledProblem.plain_backward`), simulated with the recomputed values inductor inlines taking
    memory or not as `inline_recomputed` says (by default as `problem` simulates them: a calibration is
    fitted on the terms of the simulation that predicts from it). `problem`'s calibration is not used
    otherwise."""
    if inline_recomputed is None:
        inline_recomputed = problem.inline_recomputed
    keep_all = problem.encoding.uniform(Action.KEEP)
    extra, saved = [], []
    for extern in (True, False):
        only = replace(problem.costs, op_time={op.name: problem.costs.op_time[op.name] if is_library_call(op.target) == extern
                                               else 0.0 for op in problem.graph.ops})
        p = CompiledProblem(problem.graph, only, None, actions=problem.actions, loss=problem.loss,
                            inline_recomputed=inline_recomputed)
        base = p.simulate(keep_all).step_time
        runs = [p.simulate(c) for c in chromosomes]
        extra.append([r.step_time - base for r in runs])
        saved = [r.saved_bytes for r in runs]  # the same whatever the costs
    return [(e, g, problem.kept_mask_bytes(c), s, problem.plain_backward(c))
            for e, g, c, s in zip(*extra, chromosomes, saved)]


def fit(points: list[tuple], floor: float = 0.0) -> Calibration:
    """Fit `measured = base + extern_scale * extern + scale * generated + mask_rate * mask bytes + saved_rate *
    saved bytes + plain_rate * plain backward` on points (label, extern s, generated s, mask bytes, saved bytes,
    plain backward (1 or 0), measured s; points made before the plain term, without it, count it 0) by
    non-negative least squares (`fit_terms`), the base at least `floor` seconds (`library_seconds`). With more points than
    the six factors, only some terms are fitted: the fewest whose fit predicts the points, each left out in turn,
    within `PARSIMONY` of the best worst error; the others keep their defaults (the standalone cost's 1, byte rates
    0). (Fitted on all four, separable's calibration on the AMD machine put keep-all's base at 1.2 to 9.2 ms and its
    pick 23 to 36 % under its measured time in four runs; with the terms chosen so, -8.3, -14.2 and -1.3 % in three,
    and in the fourth all four were kept: results/compiled_model/term_choice.txt.)

    Why the floor: with none, separable's fit at d2b6f46 kept all four terms again, put the base at 0 ms and the
    library calls at 2.52x their standalone time, and predicted its first finalist 26.5 ms, measured 54.5 ms. Every
    policy runs each of the step's library calls once (inductor calls the same kernels), so the base is no less
    than their standalone time; bounded so, each calibration point of four separable runs, left out, is predicted
    within 13.8 % (median) against 20.4 %, and the base of no other experiment's fit moves
    (results/compiled_model/base_floor.txt)."""
    if len(points) <= len(TERMS) + 1:
        return fit_terms(points, TERMS, floor)

    def worst_left_out(terms) -> float:
        return max(abs(fit_terms(points[:k] + points[k + 1:], terms, floor).predict(p) / p[-1] - 1)
                   for k, p in enumerate(points))

    subsets = [t for n in range(len(TERMS) + 1) for t in itertools.combinations(TERMS, n)]
    scores = [worst_left_out(t) for t in subsets]
    close = [k for k, score in enumerate(scores) if score <= min(scores) * (1 + PARSIMONY)]
    return fit_terms(points, subsets[min(close, key=lambda k: (len(subsets[k]), scores[k]))], floor)


def fit_terms(points: list[tuple], terms=TERMS, floor: float = 0.0) -> Calibration:
    """`fit` of the named `terms` alone (the others at their defaults), each scaled to the points' range first, the
    base `floor` or more. A term that does not vary over the points cannot be told from the base: it keeps its
    default too."""
    from scipy.optimize import nnls

    points = [_padded(p) for p in points]
    default = {1: 1.0, 2: 1.0, 3: 0.0, 4: 0.0, 5: 0.0}
    spread = {k: max(p[k] for p in points) - min(p[k] for p in points) for k in default}
    free = [k for k in default if TERMS[k - 1] in terms and spread[k] > 1e-9 * max(abs(p[k]) for p in points)]
    fixed = {k: f for k, f in default.items() if k not in free}
    rows = [[p[k] / spread[k] for k in free] + [1.0] for p in points]
    ys = [p[-1] - floor - sum(p[k] * f for k, f in fixed.items()) for p in points]
    solved, _ = nnls(np.array(rows), np.array(ys))
    factor = fixed | {k: float(x) / spread[k] for k, x in zip(free, solved)}
    return Calibration(floor + float(solved[-1]), factor[2], factor[1], factor[3], factor[4], tuple(points),
                       terms=tuple(TERMS[k - 1] for k in free), plain_rate=factor[5])


def _padded(point: tuple) -> tuple:
    """`point` with a 0 for each term it lacks (made before the term was), its measured seconds last."""
    return (point[0], *point[1:-1], *(0.0,) * (len(TERMS) + 2 - len(point)), point[-1])


def library_seconds(graph: Graph, costs: Costs) -> float:
    """Standalone seconds of `graph`'s library calls (`is_library_call`), each once: what every compiled step of
    it costs at least (`fit`'s floor under the base)."""
    return sum(costs.op_time[op.name] for op in graph.ops if is_library_call(op.target))


CALIBRATION_MIXES = 3  # random half-recomputed policies calibrated on besides the four set ones
# random halves where torch's partitions are calibrated on too (`calibrate`): a fit on the four set policies, one
# half and torch's three partitions predicted the two other halves within 0.1 to 8.4 %, 2.2 % median, on the five
# runs of results/compare_time/*_one_finalist (results/compiled_model/calibration_partitions.txt)
PARTITION_MIXES = 1


def calibration_policies(problem: CompiledProblem, seed: int = 0, mixes: int = CALIBRATION_MIXES
                         ) -> dict[str, Chromosome]:
    """The distinct policies calibrated on: keep-all; the same with masks recomputed; every generated
    candidate recomputed; everything recomputed; `mixes` random halves (terms that vary together in the set
    policies vary apart in these)."""
    import random

    encoding, graph = problem.encoding, problem.graph
    producer = {op.name: op for op in graph.ops}
    masks = {k for k, _ in problem._masks}
    made_by_generated = [k for k, t in enumerate(encoding.candidates) if graph.tensors[t].producer in producer
                         and not is_library_call(producer[graph.tensors[t].producer].target)]
    recomputable = [Action.RECOMPUTE in allowed for allowed in encoding.allowed]

    def recompute(chosen) -> Chromosome:
        return Chromosome(encoding.captured_keys(), tuple(int(Action.RECOMPUTE if ok and k in chosen else Action.KEEP)
                                                          for k, ok in enumerate(recomputable)))
    everything = range(len(encoding.candidates))
    rng = random.Random(seed)
    chosen = {"keep-all": (), "masks recomputed": masks,
              "recompute-generated": made_by_generated,
              "recompute-all": everything}
    chosen |= {f"random half {m + 1}": [k for k in everything if rng.random() < 0.5] for m in range(mixes)}
    out = {}
    for label, ks in chosen.items():
        c = problem.canonical(recompute(set(ks)))
        if c.actions not in {d.actions for d in out.values()}:
            out[label] = c
    return out


def refit(calibration: Calibration, problem: CompiledProblem, measured: list[tuple[str, Chromosome, float]]
          ) -> Calibration:
    """`calibration` fitted again on its samples and the `measured` (label, policy, CPU seconds a step) besides,
    priced by `problem` (of the same graph) as `calibration` simulates (`features`)."""
    again = fit([*calibration.samples, *samples(problem, measured, calibration.inline_recomputed)],
                library_seconds(problem.graph, problem.costs))
    return replace(again, inline_recomputed=calibration.inline_recomputed).with_peaks(list(calibration.peak_samples))


def samples(problem: CompiledProblem, measured: list[tuple[str, Chromosome, float]],
            inline_recomputed: bool | None = None) -> list[tuple]:
    """The `measured` (label, policy, CPU seconds a step) as `fit`'s points, in `features`' terms."""
    labels, chromosomes, seconds = zip(*measured)
    terms = features(problem, list(chromosomes), inline_recomputed)
    return [(label, *t, s) for label, t, s in zip(labels, terms, seconds)]


def calibrate(graph: Graph, costs: Costs, cpu_times, loss: str = "sum", partitions: dict | None = None
              ) -> Calibration:
    """Fit the compiled step's cost (`fit`) on `graph` compiled under each of `calibration_policies`:
    `cpu_times({label: actions})` compiles and trains under each set of per-tensor actions (see
    `Problem.actions_of`) and returns, in that order, CPU seconds per step, or (CPU seconds, measured peak bytes
    above resident) pairs: then the peak's offset is fitted too (`Calibration.with_peaks`). `partitions`
    ({label: per-tensor actions}: torch's partitions, which a compare compiles and times anyway) are calibrated
    on as well, first, in place of all random halves but `PARTITION_MIXES`."""
    problem, chosen = calibration_set(graph, costs, loss, partitions)
    measured = cpu_times({label: problem.actions_of(c) for label, c in chosen.items()})
    return fit_measured(problem, [(label, c, *(m if isinstance(m, tuple) else (m, None)))
                                  for label, c, m in zip(chosen, chosen.values(), measured)])


def calibration_set(graph: Graph, costs: Costs, loss: str = "sum", partitions: dict | None = None
                    ) -> tuple[CompiledProblem, dict[str, Chromosome]]:
    """The uncalibrated problem `calibrate` prices with, and the policies it measures ({label: chromosome}):
    `partitions` first (as `calibrate` takes them), then the `calibration_policies` that differ from them."""
    problem = CompiledProblem(graph, costs, None, actions=(Action.KEEP, Action.RECOMPUTE), loss=loss)
    chosen = {label: problem.canonical(problem.encoding.read_back(a)) for label, a in (partitions or {}).items()}
    for label, c in calibration_policies(problem, mixes=PARTITION_MIXES if partitions else CALIBRATION_MIXES).items():
        if c.actions not in {d.actions for d in chosen.values()}:
            chosen[label] = c
    return problem, chosen


def fit_measured(problem: CompiledProblem, measured: list[tuple[str, Chromosome, float, int | None]]) -> Calibration:
    """The calibration fitted on `measured` (label, policy, CPU seconds a step, peak bytes above resident or None)
    of `problem` (uncalibrated): the memory side first (`fit_peaks`), as it chooses how recomputed values are
    simulated, then the time (`fit`) on terms simulated that way. (Fitted on the inlined simulation and predicting
    by the held one, separable's model missed torch's partitions by up to 22.5 %:
    results/compiled_model/inline_consistent.txt.)"""
    peaks = [(label, c, peak) for label, c, _, peak in measured if peak is not None]
    memory = fit_peaks(Calibration(0.0, 1.0), problem, peaks)
    timed = fit(samples(problem, [(label, c, s) for label, c, s, _ in measured], memory.inline_recomputed),
                library_seconds(problem.graph, problem.costs))
    return replace(timed, inline_recomputed=memory.inline_recomputed, peak_offset=memory.peak_offset,
                   peak_samples=memory.peak_samples)


def fit_peaks(calibration: Calibration, problem: CompiledProblem, measured: list[tuple[str, Chromosome, int]]
              ) -> Calibration:
    """`calibration` with the memory side fitted on `measured` (label, policy, peak bytes above resident) of
    `problem` (uncalibrated): of the recomputed candidates `inlined` inlined or counted
    (`inline_recomputed`), the one whose simulated peaks, once offset (`with_peaks`), are nearer the
    measured on average (relative); inlined on a tie. Without `measured`, `calibration` as it is."""
    if not measured:
        return calibration
    best = None
    for inline in (True, False):
        trial = replace(calibration, inline_recomputed=inline, peak_offset=0)
        priced = CompiledProblem(problem.graph, problem.costs, None, problem.space, actions=problem.actions,
                                 loss=problem.loss, calibration=trial)
        fitted = trial.with_peaks(peak_samples(priced, measured))
        error = np.mean([abs(m - s - fitted.peak_offset) / max(m, 1) for _, s, m in fitted.peak_samples])
        if best is None or error < best[0]:
            best = (error, fitted)
    return best[1]


def peak_samples(problem: CompiledProblem, measured: list[tuple[str, Chromosome, int]]) -> list[tuple[str, int, int]]:
    """The `measured` (label, policy, peak bytes above resident) as `Calibration.with_peaks`' samples (label,
    simulated peak above resident, measured), simulated by `problem` (its calibration's offset left out)."""
    resident = problem.fused.resident_bytes()
    offset = problem.calibration.peak_offset if problem.calibration is not None else 0
    return [(label, problem.simulate(c).peak_bytes - offset - resident, peak) for label, c, peak in measured]
