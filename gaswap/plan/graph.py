"""The training-step dataflow graph: operators are nodes, storages are edges. No torch here.

A `Tensor` is a *storage*: views and in-place results alias their base, so they are not tensors of their
own; an op that reads a view lists the base storage among its inputs. Every tensor has at most one
producer (None for parameters, buffers, inputs and the gradient of the output, which are resident for the
whole step).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from gaswap.base.errors import GaswapError
from gaswap.base.training_options import COUNTABLE

PHASES = ("fwd", "bwd")
# Tensor kinds. "param", "buffer" and "input" exist before the step; "activation" is any storage an op
# produces; "grad" is a parameter gradient, an output of the step that lives until the step ends.
# "grad_output" is the gradient of the model's output in a step whose loss is computed outside it (the
# backward pass starts from it): counted as resident all step, like an input.
KINDS = ("param", "buffer", "input", "grad_output", "activation", "grad")
RESIDENT_KINDS = ("param", "buffer", "input", "grad_output")  # tensors without a producer


class GraphError(GaswapError, ValueError):
    """A graph that breaks an invariant (unknown tensor, two producers, a cycle...)."""


@dataclass(frozen=True)
class Tensor:
    """One storage: its stable name, its size in bytes, who produces it and what kind it is."""

    name: str
    size: int
    kind: str = "activation"
    producer: str | None = None


@dataclass(frozen=True)
class Op:
    """One operator of the training step.

    `inputs` are the storages it reads (views resolved to their base), `outputs` the storages it creates.
    `layer` is the module path it belongs to; `recomputable` is False for random and state-mutating ops.
    `signature` identifies the op for the cost model: ops with equal signatures cost the same.
    """

    name: str
    target: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    phase: str = "fwd"
    layer: str = ""
    recomputable: bool = True
    flops: float = 0.0
    signature: str = ""


@dataclass(frozen=True)
class Graph:
    """A validated training-step graph. `ops` are in a valid (captured) topological order.

    `resident` holds bytes present for the whole step that are not tensors of the graph, by category
    (today "optimizer_state"); `counted` names which of COUNTABLE count toward the memory budget.
    `decidable` names forward activations a policy decides about although the backward does not read them:
    kept, a recomputation in the backward may start from one (compiled graphs: library calls' outputs).
    `specialized` lists the tensor values a step that reads them was traced for, as (op, where, value): the graph
    is that step's for those values only (part of the fingerprint; see `specialization_differences`).
    `unswappable` names candidates no policy may swap (compiled graphs: torch's activation offloading refuses
    views, getitems and non-contiguous tensors, and a decidable tensor the backward does not read is never
    saved); derived from the graph, so not part of the fingerprint.
    """

    ops: tuple[Op, ...]
    tensors: dict[str, Tensor]
    resident: dict[str, int] = field(default_factory=dict)
    counted: frozenset = frozenset(COUNTABLE)
    loss: str | None = None
    decidable: frozenset = frozenset()
    specialized: tuple = ()
    unswappable: frozenset = frozenset()

    def __post_init__(self):
        _validate(self)

    # --- derived views, computed on demand (graphs are small; callers cache what they need) ---
    def op_index(self) -> dict[str, int]:
        """Op name -> position in the captured order."""
        return {op.name: i for i, op in enumerate(self.ops)}

    def consumers(self) -> dict[str, list[str]]:
        """Tensor name -> names of the ops reading it, in captured order."""
        out: dict[str, list[str]] = {t: [] for t in self.tensors}
        for op in self.ops:
            for t in op.inputs:
                out[t].append(op.name)
        return out

    def candidates(self) -> list[str]:
        """Tensors a policy decides about: inputs and forward activations that the backward pass reads, and
        the `decidable` ones.

        In a step given the gradient of its output from outside (a "grad_output" tensor), the caller holds
        the inputs all step, so they are not candidates; nor is the gradient, which arrives with the backward.
        """
        phase = {op.name: op.phase for op in self.ops}
        cons = self.consumers()
        inputs_swappable = not any(t.kind == "grad_output" for t in self.tensors.values())
        return [
            t.name
            for t in self.tensors.values()
            if ((t.kind == "input" and inputs_swappable) or (t.kind == "activation" and phase[t.producer] == "fwd"))
            and t.name != self.loss
            and (t.name in self.decidable or any(phase[c] == "bwd" for c in cons[t.name]))
        ]

    def counts(self, tensor: Tensor) -> bool:
        """Whether a tensor's bytes count toward the budget (parameters and gradients may be left out)."""
        if tensor.kind == "param":
            return "parameters" in self.counted
        if tensor.kind == "grad":
            return "gradients" in self.counted
        return True

    def resident_bytes(self) -> int:
        """Counted bytes resident for the whole step: parameters, buffers, inputs, optimizer state."""
        total = sum(t.size for t in self.tensors.values() if t.producer is None and self.counts(t))
        for cat, size in self.resident.items():
            if cat not in COUNTABLE or cat in self.counted:
                total += size
        return total

    def fingerprint(self) -> str:
        """A hash of the graph's structure and sizes: equal fingerprints mean the same step."""
        body = {
            "ops": [[o.name, o.target, list(o.inputs), list(o.outputs), o.phase] for o in self.ops],
            "tensors": sorted([t.name, t.size, t.kind] for t in self.tensors.values()),
            "resident": sorted(self.resident.items()),
            "counted": sorted(self.counted),
        } | ({"decidable": sorted(self.decidable)} if self.decidable else {})
        body |= {"specialized": [list(s) for s in self.specialized]} if self.specialized else {}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    # --- plain-data round trip (JSON-able), used by caches and worker processes ---
    def to_dict(self) -> dict:
        return {
            "ops": [op.__dict__ | {"inputs": list(op.inputs), "outputs": list(op.outputs)} for op in self.ops],
            "tensors": [t.__dict__ for t in self.tensors.values()],
            "resident": dict(self.resident),
            "counted": sorted(self.counted),
            "loss": self.loss,
            "decidable": sorted(self.decidable),
            "specialized": [list(s) for s in self.specialized],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Graph":
        ops = tuple(
            Op(**(o | {"inputs": tuple(o["inputs"]), "outputs": tuple(o["outputs"])})) for o in d["ops"]
        )
        tensors = {t["name"]: Tensor(**t) for t in d["tensors"]}
        return cls(ops, tensors, dict(d.get("resident", {})), frozenset(d.get("counted", COUNTABLE)), d.get("loss"),
                   frozenset(d.get("decidable", ())), tuple(tuple(s) for s in d.get("specialized", ())))


def specialization_differences(recorded, graph: Graph) -> str:
    """What differs between the values a plan's graph was specialized on (`recorded`: its `specialized`, as
    lists or tuples; None when not recorded) and `graph`'s, in words; "" when they agree."""
    mine = [tuple(s) for s in recorded or ()]
    if recorded is None or mine == list(graph.specialized):
        return ""
    for (op, where, value), (op2, where2, value2) in zip(mine, graph.specialized):
        if (op, where) == (op2, where2) and value != value2:
            return (f"the plan was made for a step whose op {op} read {value!r} from {where}; this model and inputs "
                    f"give {value2!r} (the step is specialized on the values its forward pass reads, as torch.compile "
                    f"does): search with inputs like these")
    return (f"the plan was made for a step specialized on {len(mine)} value(s) the forward pass reads "
            f"({_said(mine)}); this model and inputs read {len(graph.specialized)} ({_said(graph.specialized)})")


def _said(specialized) -> str:
    return "; ".join(f"{op} of {where} = {value!r}" for op, where, value in list(specialized)[:3]) or "none"


def _validate(g: Graph) -> None:
    """Raise GraphError on the first broken invariant: tensors, then ops in order, then producers, loss and
    decidable tensors."""
    for t in g.tensors.values():
        _check_tensor(t)
    seen_ops: set[str] = set()
    produced: set[str] = set()
    bwd_outputs: set[str] = set()
    for op in g.ops:
        if op.name in seen_ops:
            raise GraphError(f"op {op.name!r} appears twice")
        if op.phase not in PHASES:
            raise GraphError(f"op {op.name!r}: phase {op.phase!r} is not one of {PHASES}")
        _check_reads(g, op, produced, bwd_outputs)
        for t in op.outputs:
            if t not in g.tensors:
                raise GraphError(f"op {op.name!r} writes unknown tensor {t!r}")
            if g.tensors[t].producer != op.name:
                raise GraphError(f"op {op.name!r} writes {t!r}, whose producer is {g.tensors[t].producer!r}")
            produced.add(t)
            if op.phase == "bwd":
                bwd_outputs.add(t)
        seen_ops.add(op.name)
    for t in g.tensors.values():
        if t.producer is not None and t.producer not in seen_ops:
            raise GraphError(f"tensor {t.name!r}: producer {t.producer!r} is not an op of the graph")
    if g.loss is not None and g.loss not in g.tensors:
        raise GraphError(f"loss tensor {g.loss!r} is not in the graph")
    phase = {op.name: op.phase for op in g.ops}
    for t in sorted(g.decidable):
        if t not in g.tensors or g.tensors[t].kind != "activation" or phase[g.tensors[t].producer] != "fwd":
            raise GraphError(f"decidable tensor {t!r} is not a forward activation of the graph")


def _check_tensor(t: Tensor) -> None:
    if t.kind not in KINDS:
        raise GraphError(f"tensor {t.name!r}: unknown kind {t.kind!r} (expected one of {KINDS})")
    if t.size < 0:
        raise GraphError(f"tensor {t.name!r}: negative size {t.size}")
    if (t.producer is None) != (t.kind in RESIDENT_KINDS):
        raise GraphError(f"tensor {t.name!r}: kind {t.kind!r} and producer {t.producer!r} disagree")


def _check_reads(g: Graph, op: Op, produced: set[str], bwd_outputs: set[str]) -> None:
    """`op` reads known tensors, already produced (by the forward, for a forward op)."""
    for t in op.inputs:
        if t not in g.tensors:
            raise GraphError(f"op {op.name!r} reads unknown tensor {t!r}")
        if op.phase == "fwd" and t in bwd_outputs:
            raise GraphError(f"forward op {op.name!r} reads {t!r}, produced in the backward pass")
        src = g.tensors[t].producer
        if src is not None and t not in produced:
            raise GraphError(f"op {op.name!r} reads {t!r} before its producer {src!r} (ops not in order)")


def chain(n: int, size: int = 1, *, name: str = "chain") -> Graph:
    """A linear training step of n forward ops and their n backward ops (for tests and benchmarks).

    Forward: a{i} = f{i}(a{i-1}); backward: g{i} = b{i}(g{i+1}, a{i-1}), the gradient flowing back.
    Every forward output is read by exactly one backward op, as in a plain chain of layers.
    """
    tensors = {"x": Tensor("x", size, "input")}
    ops = []
    prev = "x"
    for i in range(1, n + 1):
        tensors[f"a{i}"] = Tensor(f"a{i}", size, "activation", f"f{i}")
        ops.append(Op(f"f{i}", "fwd", (prev,), (f"a{i}",), "fwd", f"layer{i}", signature="f"))
        prev = f"a{i}"
    grad = prev
    for i in range(n, 0, -1):
        saved = f"a{i-1}" if i > 1 else "x"
        tensors[f"g{i}"] = Tensor(f"g{i}", size, "activation", f"b{i}")
        ops.append(Op(f"b{i}", "bwd", (grad, saved), (f"g{i}",), "bwd", f"layer{i}", signature="b"))
        grad = f"g{i}"
    return Graph(tuple(ops), tensors, loss=f"a{n}")


def residual_graph(n_ops: int, size: int = 1 << 20) -> Graph:
    """A synthetic training step of about `n_ops` ops: residual layers with weights, and their backward.

    Layer i (weight w{i}): h = f(x, w), y = x + h forward; backward gh = bf(gy, h, w) (input gradient),
    gw = bw(gy, x) (weight gradient, free to run anywhere after gy) and gx = gy + gh.
    """
    layers = max(1, n_ops // 5)
    tensors = {"x0": Tensor("x0", size, "input")}
    ops = []
    for i in range(1, layers + 1):
        tensors[f"w{i}"] = Tensor(f"w{i}", size // 4, "param")
        tensors[f"h{i}"] = Tensor(f"h{i}", size, "activation", f"f{i}")
        tensors[f"x{i}"] = Tensor(f"x{i}", size, "activation", f"add{i}")
        ops.append(Op(f"f{i}", "f", (f"x{i-1}", f"w{i}"), (f"h{i}",), "fwd", f"layer{i}", signature="f"))
        ops.append(Op(f"add{i}", "add", (f"x{i-1}", f"h{i}"), (f"x{i}",), "fwd", f"layer{i}", signature="add"))
    grad = f"x{layers}"
    for i in range(layers, 0, -1):
        tensors[f"gh{i}"] = Tensor(f"gh{i}", size, "activation", f"bf{i}")
        tensors[f"gw{i}"] = Tensor(f"gw{i}", size // 4, "grad", f"bw{i}")
        tensors[f"gx{i}"] = Tensor(f"gx{i}", size, "activation", f"badd{i}")
        ops.append(Op(f"bf{i}", "bf", (grad, f"h{i}", f"w{i}"), (f"gh{i}",), "bwd", f"layer{i}", signature="bf"))
        ops.append(Op(f"bw{i}", "bw", (grad, f"x{i-1}"), (f"gw{i}",), "bwd", f"layer{i}", signature="bw"))
        ops.append(Op(f"badd{i}", "badd", (grad, f"gh{i}"), (f"gx{i}",), "bwd", f"layer{i}", signature="badd"))
        grad = f"gx{i}"
    return Graph(tuple(ops), tensors, loss=f"x{layers}")
