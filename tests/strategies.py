"""Hypothesis strategies: random training-step graphs, their costs, and chromosomes for them (no torch).

A graph is built the way a captured step looks:

- forward: inputs (kind "input"), parameters ("param") and perhaps a buffer; each forward op reads one to
  three earlier tensors (repeats allowed, as in mul(x, x); fan-in and fan-out), maybe some parameters, and
  produces one or two activations; some ops are not recomputable (random, state-mutating); perhaps a
  buffer update that reads the buffer and produces nothing (BatchNorm's running statistics); a loss op
  ends the forward pass;
- backward, mirrored in reverse: for each forward op whose outputs received gradients, gradient
  contributions to the same output are first summed by an accumulate op; then one op reads the gradients
  and a random subset of the forward op's inputs and outputs (what autograd saves) and produces one
  gradient contribution per activation input; one weight-gradient op per parameter read, of kind "grad"
  when the parameter has a single reader (else contributions summed into the "grad" at the end). Some
  backward ops are not recomputable either.

Every graph has at least one candidate: the loss's backward reads the last forward output. Sizes may be 0. Costs are small dyadic numbers (whole seconds per op, power-of-two bandwidths), so that
sums of times are exact in floating point.
"""
from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Chromosome, Encoding
from gaswap.plan.graph import COUNTABLE, Graph, Op, Tensor

SIZES = st.integers(min_value=0, max_value=64)


@st.composite
def training_graphs(draw, max_forward: int = 8) -> Graph:
    tensors: dict[str, Tensor] = {}
    ops: list[Op] = []

    def tensor(name, kind="activation", producer=None):
        tensors[name] = Tensor(name, draw(SIZES), kind, producer)
        return name

    available = [tensor(f"x{k}", "input") for k in range(draw(st.integers(1, 2)))]
    params = [tensor(f"w{k}", "param") for k in range(draw(st.integers(0, 3)))]
    buffer = tensor("buf", "buffer") if draw(st.booleans()) else None
    update_at = draw(st.integers(0, max_forward)) if buffer else -1
    recomputable = st.integers(0, 4).map(bool)  # one in five is random or mutates state

    n_forward = draw(st.integers(1, max_forward))
    for i in range(n_forward):
        if i == update_at:
            ops.append(Op("update", "copy_", (buffer, draw(st.sampled_from(available))), (), "fwd",
                          recomputable=False))
        reads = draw(st.lists(st.sampled_from(available), min_size=1, max_size=3))
        weights = draw(st.lists(st.sampled_from(params), max_size=2, unique=True)) if params else []
        name = f"f{i}"
        outputs = tuple(tensor(f"y{i}_{j}", producer=name) for j in range(draw(st.sampled_from([1, 1, 1, 2]))))
        ops.append(Op(name, "f", tuple(reads + weights), outputs, "fwd", recomputable=draw(recomputable)))
        available += outputs
    loss_reads = [available[-1]] + draw(st.lists(st.sampled_from(available), max_size=1))
    tensors["L"] = Tensor("L", draw(st.integers(0, 4)), "activation", "loss")
    ops.append(Op("loss", "loss", tuple(loss_reads), ("L",), "fwd"))

    readers_of = {p: sum(p in op.inputs for op in ops) for p in params}
    grads: dict[str, list[str]] = {"L": ["L"]}  # tensor -> gradient contributions received so far
    weight_grads: dict[str, list[str]] = {p: [] for p in params}
    for f in reversed([op for op in ops if op.outputs]):
        flowing = [y for y in f.outputs if grads.get(y)]
        if not flowing:
            continue
        gys = []
        for y in flowing:
            if len(grads[y]) > 1:
                ops.append(Op(f"acc_{y}", "add", tuple(grads[y]), (tensor(f"sum_{y}", producer=f"acc_{y}"),), "bwd"))
                gys.append(f"sum_{y}")
            else:
                gys.append(grads[y][0])
        saved = draw(st.lists(st.sampled_from(sorted(set(f.inputs + f.outputs))), max_size=3, unique=True))
        if f.name == "loss" and f.inputs[0] not in saved:  # the last forward output is saved: a candidate
            saved.insert(0, f.inputs[0])
        targets = [t for t in dict.fromkeys(f.inputs) if tensors[t].kind == "activation"]
        if targets:
            name = f"b_{f.name}"
            outputs = tuple(tensor(f"g_{f.name}_{t}", producer=name) for t in targets)
            ops.append(Op(name, "fb", tuple(gys + saved), outputs, "bwd", recomputable=draw(recomputable)))
            for t, g in zip(targets, outputs):
                grads.setdefault(t, []).append(g)
        for p in (t for t in dict.fromkeys(f.inputs) if t in weight_grads):
            name = f"bw_{f.name}_{p}"
            kind = "grad" if readers_of[p] == 1 else "activation"
            extra = draw(st.lists(st.sampled_from(sorted(set(f.inputs))), max_size=2, unique=True))
            ops.append(Op(name, "fw", tuple(gys + extra), (tensor(f"d{p}_{f.name}", kind, name),), "bwd"))
            weight_grads[p].append(f"d{p}_{f.name}")
    for p, parts in weight_grads.items():
        if len(parts) > 1:
            ops.append(Op(f"acc_d{p}", "add", tuple(parts), (tensor(f"d{p}", "grad", f"acc_d{p}"),), "bwd"))

    resident = {"optimizer_state": draw(SIZES)} if draw(st.booleans()) else {}
    counted = frozenset(draw(st.lists(st.sampled_from(COUNTABLE), unique=True)))
    return Graph(tuple(ops), tensors, resident, counted, loss="L")


@st.composite
def costs_for(draw, graph: Graph) -> Costs:
    """Whole seconds per op (0 to 4) and power-of-two copy bandwidths, with a copy latency of 0, 1/4 or 1 s."""
    times = {op.name: float(draw(st.integers(0, 4))) for op in graph.ops}
    d2h, h2d = (draw(st.sampled_from([0.5, 1.0, 2.0, 8.0, 64.0])) for _ in range(2))
    return Costs(times, d2h, h2d, "test", "test", copy_latency=draw(st.sampled_from([0.0, 0.25, 1.0])))


@st.composite
def chromosomes(draw, encoding: Encoding) -> Chromosome:
    """Any keys (ties included) and any allowed action per candidate. Reports coverage (pytest
    --hypothesis-show-statistics): candidates, whether recompute is allowed, and the actions drawn."""
    keys = draw(st.lists(st.integers(0, 8).map(float), min_size=len(encoding.graph.ops),
                         max_size=len(encoding.graph.ops)))
    actions = [draw(st.sampled_from([int(a) for a in allowed])) for allowed in encoding.allowed]
    n = len(encoding.candidates)
    event(f"candidates: {n if n < 4 else '4+'}")
    event("recompute allowed for some candidate" if any(Action.RECOMPUTE in a for a in encoding.allowed)
          else "recompute allowed for none")
    for a in (Action.SWAP, Action.RECOMPUTE):
        event(f"chromosome {'has' if a in actions else 'has no'} {a.label}")
    return Chromosome(tuple(keys), tuple(actions))
