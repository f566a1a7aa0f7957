"""Policies that run inside torch.compile: keep / recompute decisions on the joint graph inductor partitions.

torch.compile (AOTAutograd) traces a model's forward and backward pass into one *joint graph*, then a
partitioner splits it into a forward and a backward graph: what the forward saves for the backward is kept,
everything else the backward needs is recomputed inside it. Inductor then compiles both and fuses their ops.
The partitioner is pluggable (`torch._inductor.config.custom_partitioner_fn`).

gaswap uses that graph itself, so the graph searched is the graph compiled:

- `capture(fn, *args)` compiles `fn` (a module or a step function) up to the partitioner, takes the joint
  graph inductor is about to partition (after its joint-graph passes, dead code removed, common
  subexpressions merged, as the partitioner does) and turns it into a gaswap `Graph`: op names are the
  joint graph's node names, stable for a given model, shapes and torch version. Forward ops are those the
  forward must run (what the output needs, and the buffer updates), and the backward values computed from
  forward values alone that no other backward op reads the sources of (ReLU's mask `le = relu <= 0`, a
  quarter of relu's bytes; a tanh's derivative), placed right after what they read (`_hoisted`): torch's
  min-cut partitioner may save such a value instead of its sources, and as candidates a policy can too.
  The rest is backward. Candidates are the forward values the backward reads, and the *decidable* ones
  (`Graph.decidable`) it does not read but may recompute from: those sources, and the outputs of library
  calls (a softmax's input `bmm`), which inductor materializes anyway. A kept one is saved only if the
  backward recomputes something from it, and the compiled simulator holds it until then.
  The gradient of the output is a `grad_output` tensor (torch.compile's caller runs the loss, or the step
  returns it), so inputs are not candidates: the caller holds them.
- Policies for it are searched in the `compiled` search space (keep / recompute per activation). The
  operator order is not searched: the compiler orders and fuses the ops (forward graph, then backward
  graph in the order AOTAutograd mimics of the autograd engine), and the simulator replays the captured
  order. The search space is keep / recompute; `backend` also runs policies that swap (see below).
- `backend(policy)` is a torch.compile backend (inductor with `PolicyPartitioner`): the partitioner checks
  that the joint graph is the one the policy was made for, and partitions it as the policy says, with no
  partitioner's choice left: the forward saves the kept candidates (and the outputs of forward ops that may
  not run twice, such as dropout's seeds), the backward recomputes every other forward value it needs from
  them and the primal inputs. The forward and backward modules are built by torch's own extraction, as its
  min-cut partitioner does once it has chosen what to save (`partition`). It then checks that the forward
  saves no tensor the policy recomputes. `compile(model, policy)` is `torch.compile(model,
  backend=backend(policy), fullgraph=True, dynamic=False)`.

Behaviour to know: a graph break (fullgraph=True) and dynamic shapes (dynamic=False) are refused by
torch.compile; a recompilation (new shapes, dtypes, or a changed model) gives another joint graph, which the
partitioner refuses naming both fingerprints. Eval mode and `torch.no_grad()` compile an inference graph,
which is not partitioned: the policy does not apply there.

Swapped tensors are saved by the forward and handed to torch's own activation offloading
(`torch/_functorch/_activation_offloading/`, as `MUST_CPU_OFFLOAD` does): the forward copies each to the host
after its last forward reader, the backward copies it back before its first reader. On CUDA the copies run
on a side stream into pinned host buffers, the reloads prefetched (`ao::offload` / `ao::reload`); on a CPU
they are plain host copies, which lower no memory (the host store is the same RAM) but run the same graph.
torch refuses to offload views, getitems and non-contiguous tensors: a policy that swaps one is refused.
"""
from __future__ import annotations

import copy
import hashlib
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx
from torch._functorch import config as functorch_config
from torch._functorch.compile_utils import fx_graph_cse, raise_getitems
from torch._dynamo.exc import ShortenTraceback
from torch._functorch.partitioners import (
    _extract_fwd_bwd_modules,
    _is_primal,
    _must_be_in_forward,
    get_default_op_list,
    is_sym_node,
    min_cut_rematerialization_partition,
    reordering_to_mimic_autograd_engine,
    thread_graphsafe_rng_from_hops,
)
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.utils._ordered_set import OrderedSet
from torch.utils._pytree import arg_tree_leaves

from gaswap.base.errors import BadInput, GaswapError
from gaswap.base.training_options import OPTIMIZER_STATE
from gaswap.compiled import offload_ops
from gaswap.compiled import order as orders
from gaswap.compiled.graph_breaks import dynamic_shape, explain, module_path
from gaswap.plan import graph as graphs
from gaswap.plan import policy as policies
from gaswap.plan.graph import Graph, Tensor
from gaswap.plan.op_types import is_library_call
from gaswap.plan.policy import Policy, PolicyError
from gaswap.run.capture import make_op, storage_key, tensor_nbytes
from gaswap.run.values import ancestors

SPACE = "compiled"  # the search space of compiled policies: keep / recompute, captured order
SWAP_SPACE = "compiled_swap"  # the same with swaps, where they lower the device's memory (`space_for`)
OFFLOADED_PREFIX = "cpu_offload_"  # torch's activation offloading names a saved value's host copy so
RETRACES = 1 << 10  # dynamo's recompile limit while gaswap traces a function compiled before (`retraced`)


class CompiledCaptureError(GaswapError, RuntimeError):
    """torch.compile could not trace the model up to its partitioner; the message says why."""


class OtherGraph(PolicyError, ShortenTraceback):
    """A policy refused by the partitioner inside torch.compile (made for another graph: another batch size,
    dtype or model), raised to the caller as it is: dynamo wraps what a backend raises in BackendCompilerFailed,
    except a `ShortenTraceback`, which it re-raises with its own frames cut."""

    first_useful_frame = None  # ShortenTraceback's: no frame to cut the traceback at

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message  # without the lines dynamo appends to the arguments of what passes through it


class Uncompilable(BadInput, RuntimeError):
    """torch.compile can compile the model only in pieces or with dynamic shapes (`graph_breaks`): a graph break,
    data-dependent control flow, an nn.LSTM, a shape that depends on the data; the message says where and
    what to do."""


@dataclass(frozen=True)
class Joint:
    """A joint graph as gaswap sees it: the `Graph`, and each fx node's storage (tensor name)."""

    graph: Graph
    storage_of: dict[str, str]  # fx node name -> name of the storage its value lives in
    inputs: list  # [(shape, dtype name)] of the step's inputs (not parameters or buffers), in the graph's order


def capture(fn: Callable, *example_args, optimizer: str = "sgd_momentum", counted=graphs.COUNTABLE) -> Graph:
    """The `Graph` of the joint forward+backward graph that torch.compile's partitioner gets for `fn`.

    `fn` is a module (its output is differentiated by the caller's loss) or a step function returning the
    loss; `example_args` are real tensors of the shapes it will train with (torch.compile traces them as
    fake tensors; nothing runs). Compiles with fullgraph=True and dynamic=False, up to the partitioner only
    (inductor generates no code: a few seconds). `optimizer` and `counted` are as in `gaswap.run.capture`.
    """
    return _record(_Recorder(optimizer, counted), fn, example_args).joint.graph


def torch_partition(fn: Callable, *example_args, budget: float = 1.0, optimizer: str = "sgd_momentum",
                    counted=graphs.COUNTABLE) -> tuple[Graph, dict[str, str]]:
    """The graph of `capture` and what torch.compile's own partitioner does with it at
    `torch._functorch.config.activation_memory_budget = budget`, as keep/recompute actions per candidate."""
    graph, actions = torch_partitions(fn, *example_args, budgets=(budget,), optimizer=optimizer, counted=counted)
    return graph, actions[budget]


def torch_partitions(fn: Callable, *example_args, budgets=(1.0,), optimizer: str = "sgd_momentum",
                     counted=graphs.COUNTABLE) -> tuple[Graph, dict[float, dict[str, str]]]:
    """`torch_partition` at each of `budgets` from one trace: {budget: actions} (densenet: 4.8-5.0 CPU s for
    three budgets, 2.1-2.3 for one)."""
    recorder = _record(_Recorder(optimizer, counted, tuple(budgets)), fn, example_args)
    return recorder.joint.graph, {b: policy_of_partition(recorder.joint, saved) for b, saved in recorder.saved.items()}


def saved_by(fn: Callable, policy: Policy, *example_args) -> list[str]:
    """The activations the forward saves for the backward when `fn` is compiled under `policy` (partitioned
    as `backend(policy)` does, then stopped before inductor generates code)."""
    return partitioned_by(fn, policy, *example_args).saved


def partitioned_by(fn: Callable, policy: Policy, *example_args) -> PolicyPartitioner:
    """The partitioner of `backend(policy)` after partitioning `fn`'s joint graph (`saved`, `offloaded`), stopped
    before inductor generates code (a compiled artifact from inductor's cache would skip the partitioner)."""
    partitioner = PolicyPartitioner(policy)

    class _Stop(_Recorder):
        def __call__(self, gm, joint_inputs, **kwargs):
            self.joint = True
            partitioner(gm, joint_inputs, **kwargs)
            raise _Captured()

    _record(_Stop("sgd_momentum", ()), fn, example_args)
    return partitioner


def retraced():
    """A context in which dynamo traces a function it has compiled before however often: gaswap's traces that stop
    at the partitioner or the written programs (`capture`, `dry_compile`) keep no compiled code, but dynamo counts
    the function's earlier compiles against its `recompile_limit` (8): a ninth capture of a model compiled eight
    times failed as "could not trace"."""
    return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, RETRACES))


def _record(recorder: "_Recorder", fn: Callable, example_args) -> "_Recorder":
    compiled = torch.compile(fn, backend=_inductor_with(recorder), fullgraph=True, dynamic=False)
    try:
        with retraced():
            compiled(*example_args)
    except Exception as e:  # noqa: BLE001 - dynamo wraps what the backend raises
        if recorder.dynamic is not None:
            raise Uncompilable(recorder.dynamic) from None
        if recorder.joint is None and isinstance(e, torch._dynamo.exc.TorchDynamoException) and not isinstance(
                e, torch._dynamo.exc.BackendCompilerFailed):  # dynamo's trace stopped: the model's code
            raise Uncompilable(explain(e, fn)) from None
        if recorder.joint is None:
            raise CompiledCaptureError(f"torch.compile could not trace {_name(fn)} (fullgraph=True, dynamic=False): "
                                       f"{str(e).strip().splitlines()[0]}") from e
    if recorder.joint is None:
        raise CompiledCaptureError(f"torch.compile of {_name(fn)} made no training graph: call it with inputs that "
                                   f"require a backward pass (parameters requiring grad, grad mode on)")
    return recorder


def backend(policy: Policy | str, **inductor_options) -> Callable:
    """A torch.compile backend that trains under `policy` (a compiled policy or its file):
    `torch.compile(model, backend=gaswap.compiled.partition.backend(policy), fullgraph=True, dynamic=False)`."""
    policy = policies.load(policy) if not isinstance(policy, Policy) else policy
    check_compiled(policy)
    return _inductor_with(PolicyPartitioner(policy), **(inductor_settings(policy) | inductor_options))


def inductor_settings(policy: Policy) -> dict:
    """The inductor options a compiled policy's `provenance.inductor` asks for (`gaswap.compiled.order.options`):
    `order`, the order its graphs are lowered in (one of `order.ORDERS`; none: as partitioned), `buffer_reuse`
    (false: inductor hands no freed buffer to a later one) and `realize_reads` (a value read by more kernels than
    this is written once, not recomputed in each; inductor's default 4). `gaswap compare` records them where a
    policy's programs fit its budget only so."""
    asked = policy.provenance.get("inductor") or {}
    if not isinstance(asked, dict) or set(asked) - {"order", "buffer_reuse", "realize_reads"}:
        raise PolicyError(f"provenance.inductor: {asked!r} is not a mapping of order, buffer_reuse and "
                          f"realize_reads")
    order, reuse, reads = asked.get("order"), asked.get("buffer_reuse", True), asked.get("realize_reads")
    if order is not None and order not in orders.ORDERS:
        raise PolicyError(f"provenance.inductor.order: {order!r} is not one of {', '.join(orders.ORDERS)}")
    if not isinstance(reuse, bool):
        raise PolicyError(f"provenance.inductor.buffer_reuse: {reuse!r} is not true or false")
    if reads is not None and (isinstance(reads, bool) or not isinstance(reads, int) or reads < 1):
        raise PolicyError(f"provenance.inductor.realize_reads: {reads!r} is not a whole number of at least 1")
    return orders.options(order, buffer_reuse=reuse, realize_reads=reads)


def compile(model: Callable, policy: Policy | str, **inductor_options) -> Callable:  # noqa: A001 - torch's name
    """`model` (or a step function) compiled by torch.compile with inductor, training under `policy`."""
    return torch.compile(model, backend=backend(policy, **inductor_options), fullgraph=True, dynamic=False)


def space_for(device) -> str:
    """The search space of compiled policies on `device`: swaps where the host's memory is apart from the
    device's and this torch offloads a compiled step's activations there (CUDA, `offload_ops.offload_path`);
    keep / recompute elsewhere (on a CPU a swap copies within the same memory and lowers nothing)."""
    cuda = torch.device(device).type == "cuda"
    return SWAP_SPACE if cuda and offload_ops.offload_path(True) == "async" else SPACE


def check_compiled(policy: Policy) -> None:
    """Refuse a policy that was not made for a compiled graph."""
    if policy.provenance.get("form") != "compiled":
        raise PolicyError("the policy was searched on gaswap's own captured graph, not on torch.compile's joint graph: "
                          "`gaswap compare EXPERIMENT` searches compiled policies (results/<experiment>/compiled/), "
                          "or use gaswap.apply / apply_step for this one")


class PolicyPartitioner(CustomPartitionerFn):
    """Inductor's partitioner under a policy: the forward saves what the policy keeps, the backward recomputes
    the rest (`saved_values`, `partition`)."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.saved: list[str] = []  # storages the forward saved in the last partition (for tests and reports)
        self.offloaded: list[str] = []  # those of them it offloaded to the host
        self.partitioned = False  # whether it partitioned (a graph found in inductor's caches skips it)

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        static_indices = kwargs.get("static_lifetime_input_indices") or []
        joint = _joint(gm, num_fwd_outputs, static_indices, self.policy.provenance.get("optimizer", "sgd_momentum"),
                       self.policy.provenance.get("counts", graphs.COUNTABLE))
        try:
            policies.check_release(self.policy, "policy", torch.__version__)
        except PolicyError as e:
            raise OtherGraph(str(e)) from None
        try:
            policies.check_matches(self.policy, joint.graph, "policy", provenance={"input_shapes": joint.inputs})
        except PolicyError as e:
            unnamed = "" if "inputs" in self.policy.provenance else (
                f" The inputs here: {', '.join(f'{shape} {dtype}' for shape, dtype in joint.inputs)}; the policy does "
                f"not name the inputs it was made for (make_policy(..., provenance={{'inputs': ..., 'batch_size': ...}}))")
            raise OtherGraph(str(e) + unnamed) from None
        check_recomputable(joint.graph, self.policy.actions)
        swapped = {t for t, a in self.policy.actions.items() if a == "swap"}
        fw, bw = partition(gm, saved_values(gm, joint, self.policy.actions), num_fwd_outputs, static_indices,
                           offloaded=swapped)
        self.saved = saved_storages(fw, num_fwd_outputs, joint)
        self.offloaded = sorted(n.name.removeprefix(OFFLOADED_PREFIX) for n in fw.graph.output_node().args[0]
                                if isinstance(n, fx.Node) and n.name.startswith(OFFLOADED_PREFIX))
        _check_saved(self.saved, self.policy.actions)
        self.partitioned = True
        return fw, bw

    def key(self) -> tuple | None:
        """(saved, offloaded) of its last partition, sorted: policies whose keys are equal generate the same
        programs; None before it has partitioned."""
        return (tuple(sorted(self.saved)), tuple(sorted(self.offloaded))) if self.partitioned else None

    def uuid(self) -> str:
        """Inductor's cache key: the policy's content and this module's code."""
        body = json.dumps([self.policy.fingerprint, sorted(self.policy.actions.items())])
        return hashlib.sha256(body.encode() + get_hash_for_files((__file__,))).hexdigest()


def saved_storages(fw: fx.GraphModule, num_fwd_outputs: int, joint: Joint) -> list[str]:
    """The activations (storage names) a partitioned forward graph saves for the backward."""
    outputs = arg_tree_leaves(*fw.graph.output_node().args)[num_fwd_outputs:]
    names = {joint.storage_of.get(n.name.removeprefix(OFFLOADED_PREFIX)) for n in outputs if isinstance(n, fx.Node)}
    return sorted(t for t in names if t is not None and joint.graph.tensors[t].kind == "activation")


def policy_of_partition(joint: Joint, saved: list[str]) -> dict[str, str]:
    """The keep/recompute actions of a partition: a candidate is kept if the forward saved it, or if its op may
    not run twice (the partition saved something computed from it instead, e.g. a dropout mask from its seed).
    Tensors the partition saves that are not candidates have no action, and the projection is approximate
    there: fused forward values no backward op reads (torch may save a softmax's max and sum besides its input
    `bmm`, a candidate, to recompute its output; or an embedding's output) and backward values hoisted into
    the forward whose sources other backward ops read (a GELU's derivative, LayerNorm's `rsqrt / width`)."""
    kept = set(saved)
    ops = {op.name: op for op in joint.graph.ops}
    return {t: "keep" if t in kept or not ops[joint.graph.tensors[t].producer].recomputable else "recompute"
            for t in joint.graph.candidates()}


# --- the joint graph as a gaswap Graph ------------------------------------------------------------------

def _joint(gm: fx.GraphModule, num_fwd_outputs: int, static_indices, optimizer: str, counted) -> Joint:
    """Prepare `gm` as the min-cut partitioner does (dead code out, common subexpressions merged; in place)
    and describe it as a `Graph`."""
    gm.graph.eliminate_dead_code()
    if functorch_config.cse:
        gm.graph = fx_graph_cse(gm.graph)
    gm.recompile()
    nodes = list(gm.graph.nodes)
    outputs = arg_tree_leaves(*gm.graph.output_node().args)
    fwd_outputs, grads = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]
    if num_fwd_outputs != 1:
        raise PolicyError(f"the compiled step returns {num_fwd_outputs} tensors; gaswap's compiled policies need one "
                          f"(the model's output, or the loss)")
    primals = [n for n in nodes if n.op == "placeholder" and not n.target.startswith("tangents")]
    forward = ancestors([*fwd_outputs, *(n for n in nodes if n.op == "call_function" and _must_be_in_forward(n))])
    hoisted, leaves = _hoisted(nodes, forward)
    storage: dict = {}
    tensors: dict[str, Tensor] = {}
    storage_of: dict[str, str] = {}
    ran_at: dict[str, int] = {}  # storage made in the forward -> where its op runs in the captured order (inputs -1)
    ops = []  # (op, its place in the captured order)
    for i, node in enumerate(nodes):
        val = node.meta.get("val")
        if node.op == "placeholder":
            if not isinstance(val, torch.Tensor):
                continue
            kind = _placeholder_kind(node, primals, grads, static_indices)
            storage.setdefault(storage_key(val), node.name)
            tensors[node.name] = Tensor(node.name, tensor_nbytes(val), kind)
            if kind != "grad_output":
                ran_at[node.name] = -1
        elif node.op == "call_function":
            op = make_op(node, storage, tensors, node in forward or node in hoisted, module_path(node))
            if op is not None:  # a hoisted op runs right after what it reads
                at = max((ran_at[storage_of[a.name]] for a in node.all_input_nodes if a.name in storage_of),
                         default=-1) if node in hoisted else i
                ops.append((op, (op.phase != "fwd", at, i)))
                if op.phase == "fwd":
                    ran_at.update(dict.fromkeys(op.outputs, at))
        if isinstance(val, torch.Tensor) and storage_key(val) in storage:
            storage_of[node.name] = storage[storage_key(val)]
    for node in grads:
        if isinstance(node, fx.Node) and storage_of.get(node.name) in tensors:
            name = storage_of[node.name]
            if tensors[name].producer is not None:
                tensors[name] = Tensor(name, tensors[name].size, "grad", tensors[name].producer)
    param_bytes = sum(t.size for t in tensors.values() if t.kind == "param")
    ops = [op for op, _ in sorted(ops, key=lambda pair: pair[1])]
    loss = storage_of[fwd_outputs[0].name]
    sources = {storage_of[n.name] for n in leaves if tensors[storage_of[n.name]].kind == "activation"}
    decidable = (_recomputed_from(ops, tensors) | sources) - {loss}
    read_by_backward = {t for op in ops if op.phase != "fwd" for t in op.inputs}
    g = Graph(tuple(ops), tensors, resident={"optimizer_state": OPTIMIZER_STATE[optimizer] * param_bytes},
              counted=frozenset(counted), loss=loss, decidable=decidable,
              unswappable=_unswappable(nodes, tensors) | (decidable - read_by_backward))
    inputs = [(list(n.meta["val"].shape), str(n.meta["val"].dtype).removeprefix("torch.")) for n in primals
              if tensors.get(n.name) is not None and tensors[n.name].kind == "input"]
    return Joint(g, storage_of, inputs)


def _unswappable(nodes: list[fx.Node], tensors: dict[str, Tensor]) -> frozenset:
    """The activations torch's activation offloading refuses to offload (`can_offload`): those a view, a getitem
    or a non-contiguous tensor makes (an activation is named by the node that first makes its storage). (`_joint`
    adds the decidable ones the backward does not read: never saved, so nothing to offload.)"""
    op_types = get_default_op_list()
    return frozenset(n.name for n in nodes if n.name in tensors and tensors[n.name].kind == "activation"
                     and (op_types.is_view(n) or n.target is operator.getitem
                          or (isinstance(n.meta.get("val"), torch.Tensor) and not n.meta["val"].is_contiguous())))


def _recomputed_from(ops, tensors: dict[str, Tensor]) -> frozenset:
    """Forward activations the backward may recompute from though it does not read them: the outputs of
    library calls (matmuls, convolutions), which inductor materializes under any policy (torch's min-cut saves
    a softmax's input `bmm` to recompute the softmax, or a projection's output `addmm` to recompute the
    dropout after it), and of ops that may not run twice, which the forward always saves (`saved_values`:
    a recomputed dropout mask is drawn again from the saved seeds)."""
    return frozenset(t for op in ops if op.phase == "fwd" and (is_library_call(op.target) or not op.recomputable)
                     for t in op.outputs if tensors[t].kind == "activation")


def _hoisted(nodes: list[fx.Node], forward: set) -> tuple[set[fx.Node], set[fx.Node]]:
    """The backward nodes to run in the forward, and the forward activations they read (their leaves).

    A backward value computed from forward values alone can be computed in the forward and saved, in place of
    what it is computed from, as torch's min-cut partitioner does: ReLU's mask `le = relu <= 0` (a quarter of
    relu's bytes), a tanh's derivative `1 - tanh**2`, BatchNorm's `x - mean`, or the `clone` that makes a GRU
    gate's slice contiguous (a third of the gates' bytes). Such a value (with the backward nodes it is
    computed from) is hoisted when its leaves are read by no other backward op (so keep-all saves one of
    them, not both) and, unless it is itself a bool mask, none is a bool (dropout's `gt` stays a kept bool,
    not a float32 copy scaled). The value is then a candidate, and its leaves are `Graph.decidable`: kept,
    the backward computes the value from them (both placements are a policy's choice)."""
    computed = set()  # backward nodes computed from forward values (and parameters, inputs, buffers) alone
    for n in nodes:
        if n.op == "call_function" and n not in forward and n.all_input_nodes and all(
                a in forward or a in computed or (a.op == "placeholder" and _is_primal(a)) for a in n.all_input_nodes):
            computed.add(n)
    read_elsewhere = {storage_key(a.meta["val"]) for n in nodes if n.op == "call_function" and n not in forward
                      and n not in computed for a in n.all_input_nodes if _is_tensor(a)}
    hoisted: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    for value in computed:
        if not any(u.op != "output" and u not in forward and u not in computed for u in value.users):
            continue  # read by other such nodes alone
        chain, stack = set(), [value]
        while stack:
            c = stack.pop()
            if c not in chain:
                chain.add(c)
                stack += [a for a in c.all_input_nodes if a in computed]
        read = {a for c in chain for a in c.all_input_nodes if a not in computed}
        activations = {a for a in read if a.op != "placeholder" and _is_tensor(a)}
        if (activations and not any(storage_key(a.meta["val"]) in read_elsewhere for a in activations)
                and (_is_bool(value.meta.get("val")) or not any(_is_bool(c.meta.get("val")) for c in chain | read))):
            hoisted |= chain
            leaves |= activations
    return hoisted, leaves


def _is_bool(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _placeholder_kind(node: fx.Node, primals: list, grads: list, static_indices) -> str:
    if node.target.startswith("tangents"):
        return "grad_output"
    i = primals.index(node)
    if i < len(grads) and grads[i] is not None:
        return "param"
    return "buffer" if i in static_indices else "input"


# --- the policy's partition ----------------------------------------------------------------------------

def saved_values(gm: fx.GraphModule, joint: Joint, actions: dict[str, str]) -> list[fx.Node]:
    """The fx nodes of `gm` the forward may save under `actions`, in graph order: every kept or swapped
    candidate, every output of a forward op that may not run twice (e.g. dropout's seeds: the backward
    regenerates a recomputed mask from them), and the primal inputs (parameters, inputs, buffers). `partition`
    drops those the backward does not read."""
    kept = {t for t, a in actions.items() if a in ("keep", "swap")}
    kept |= {t for op in joint.graph.ops if op.phase == "fwd" and not op.recomputable for t in op.outputs}
    return [n for n in gm.graph.nodes if n.name in kept or (n.op == "placeholder" and _is_primal(n))]


def partition(gm: fx.GraphModule, saved: list[fx.Node], num_fwd_outputs: int, static_indices,
              offloaded: set[str] = frozenset()) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward modules of the joint graph `gm` where the forward saves `saved` (those the backward
    reads) and the backward recomputes every other forward value it needs from them, as torch's min-cut
    partitioner builds them once it has chosen what to save: its extraction, then the backward reordered as
    the autograd engine would run it (a recomputation just before its first reader), getitems raised, the
    random states of higher-order ops threaded through. (Its rng functionalization is for recomputed random
    ops: a policy never recomputes those.) The saved values named in `offloaded` go to the host and back
    (`offload`)."""
    primals = [n for n in gm.graph.nodes if n.op == "placeholder" and _is_primal(n)]
    if any(is_sym_node(n) for n in gm.graph.nodes):
        raise PolicyError("the joint graph has symbolic sizes: compiled policies need static shapes (dynamic=False)")
    static = OrderedSet(p for i, p in enumerate(primals) if i in static_indices)
    fw, bw = _extract_fwd_bwd_modules(gm, list(saved), saved_sym_nodes=[], num_fwd_outputs=num_fwd_outputs,
                                      static_lifetime_input_nodes=static)
    bw = reordering_to_mimic_autograd_engine(bw)
    if offloaded:
        offload(fw, bw, offloaded, num_fwd_outputs, static)
    return (thread_graphsafe_rng_from_hops(raise_getitems(fw), is_backward=False),
            thread_graphsafe_rng_from_hops(raise_getitems(bw), is_backward=True))


def offload(fw: fx.GraphModule, bw: fx.GraphModule, names: set[str], num_fwd_outputs: int, static) -> None:
    """Offload the values named `names` that the forward `fw` saves for the backward `bw` with torch's activation
    offloading: copied to the host after their last forward reader, back before their first backward reader
    (CUDA: on a side stream into pinned buffers, reloads prefetched; CPU: synchronous copies). A swapped value
    the backward does not read is not saved, so there is nothing to offload. Refuses one torch cannot offload."""
    try:
        from torch._functorch._activation_offloading.activation_offloading import enable_activation_offloading
    except ImportError:
        raise PolicyError(f"the policy swaps {sorted(names)[0]}: torch {torch.__version__} has no activation "
                          f"offloading in compiled graphs; keep or recompute it") from None
    saved = {n.name: n for n in arg_tree_leaves(*fw.graph.output_node().args)[num_fwd_outputs:]
             if isinstance(n, fx.Node)}
    chosen = [saved[t] for t in sorted(names) if t in saved]
    for node in chosen:
        node.meta["should_offload"] = True
    cuda = any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_cuda for n in chosen)
    if chosen:
        offload_ops.require_offload(cuda, chosen[0].name)  # torch 2.11 on CUDA: refused (gaswap.compiled.offload_ops)
    with functorch_config.patch(activation_offload_separate_stream=cuda, activation_offload_sink_wait=cuda,
                                activation_reload_prefetch=cuda):
        enable_activation_offloading(fw, bw, num_fwd_outputs, static)
    refused = [n.name for n in chosen if not n.meta.get("saved_for_offloading")]
    if refused:
        raise _swap_refused(refused[0], "a view, a getitem or a non-contiguous tensor")


def _swap_refused(name: str, kind: str) -> PolicyError:
    """The refusal of a policy that swaps `name`, a `kind` of value torch's activation offloading refuses."""
    return PolicyError(f"the policy swaps {name}, which torch's activation offloading refuses ({kind}): keep or "
                       f"recompute it")


def check_recomputable(graph: Graph, actions: dict[str, str]) -> None:
    """Refuse actions that recompute a tensor whose op may not run twice (a random op, a mutation)."""
    ops = {op.name: op for op in graph.ops}
    wrong = [t for t, a in actions.items() if a == "recompute" and t in graph.tensors
             and graph.tensors[t].producer in ops and not ops[graph.tensors[t].producer].recomputable]
    if wrong:
        raise PolicyError(f"the policy recomputes {wrong[0]}, whose op may not run twice (a random op or a "
                          f"mutation); keep it")


def _check_saved(saved: list[str], actions: dict[str, str]) -> None:
    """Refuse a partition that saves an activation the policy recomputes (torch's extraction saved more)."""
    wrong = [t for t in saved if actions.get(t) == "recompute"]
    if wrong:
        raise PolicyError(f"the partition saved {len(wrong)} tensors the policy recomputes (e.g. {wrong[0]}); "
                          f"this torch version does not extract forward and backward graphs as gaswap expects")


# --- plumbing ---------------------------------------------------------------------------------------------

class _Recorder(CustomPartitionerFn):
    """A partitioner that records the joint graph it is given (and, at each of `budgets`, what torch's min-cut
    partitioner at that activation memory budget saves, each partitioning a copy), then stops the compilation
    there."""

    def __init__(self, optimizer: str, counted, budgets: tuple = ()):
        self.optimizer, self.counted, self.budgets = optimizer, counted, budgets
        self.joint: Joint | None = None
        self.saved: dict[float, list[str]] = {}
        self.dynamic: str | None = None  # why the joint graph has a shape the data decides (`dynamic_shape`)

    def __call__(self, gm, joint_inputs, **kwargs):
        self.dynamic = dynamic_shape(gm)
        if self.dynamic is not None:
            raise _Captured()
        self.joint = _joint(gm, kwargs["num_fwd_outputs"], kwargs.get("static_lifetime_input_indices") or [],
                            self.optimizer, self.counted)
        for budget in self.budgets:
            with functorch_config.patch(activation_memory_budget=budget):
                fw, _ = min_cut_rematerialization_partition(copy.deepcopy(gm), joint_inputs, **kwargs)
            self.saved[budget] = saved_storages(fw, kwargs["num_fwd_outputs"], self.joint)
        raise _Captured()

    def uuid(self):
        return None  # never cached


class _Captured(GaswapError):
    """Raised by `_Recorder` once it has the joint graph: nothing more to compile."""


def _inductor_with(partitioner: CustomPartitionerFn, **options) -> Callable:
    """Inductor as a torch.compile backend, with `partitioner` in place of its min-cut partitioner."""
    from torch._inductor.compile_fx import compile_fx

    def gaswap_inductor(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches={**options, "custom_partitioner_fn": partitioner})

    gaswap_inductor.partitioner = partitioner
    return gaswap_inductor


def _name(fn) -> str:
    return type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", repr(fn))


def make_policy(graph: Graph, actions: dict[str, str], predicted: dict | None = None, provenance: dict | None = None,
                program=()) -> Policy:
    """A compiled policy for `graph` (from `capture`): `actions` maps candidates to "keep", "recompute" or "swap"
    (candidates not named are kept); the order is the captured one."""
    unknown = sorted(set(actions) - set(graph.candidates()))
    if unknown:
        raise PolicyError(f"not candidates of this graph: {', '.join(unknown[:3])}")
    full = {t: actions.get(t, "keep") for t in graph.candidates()}
    check_recomputable(graph, full)
    refused = min((t for t, a in full.items() if a == "swap" and t in graph.unswappable), default=None)
    if refused is not None:
        raise _swap_refused(refused, "a view, a getitem, a non-contiguous tensor, or a value the backward never "
                                        "reads")
    return Policy(graph.fingerprint(), tuple(op.name for op in graph.ops), full, dict(predicted or {}),
                  {"form": "compiled"} | dict(provenance or {}), tuple(program))
