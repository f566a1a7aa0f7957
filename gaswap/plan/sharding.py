"""One rank's training step under FSDP2 (`fully_shard`), built from the single-device step. No torch here.

`shard_step(graph, params, spec)` turns a captured single-device `Graph` into the step one rank runs: its
parameters and gradients become shards (FSDP2's dim-0 chunks, padded to `ceil(dim0 / W)` rows on every rank),
and FSDP2's collectives and copies are ops of the graph, with their buffers, where FSDP2 issues them
(torch/distributed/fsdp/_fully_shard: _fsdp_state.py, _fsdp_param_group.py, _fsdp_collectives.py):

- unshard (`foreach_all_gather`): `fsdp_ag_alloc` allocates the flat all-gather output, W x the unit's padded
  shards, and copies this rank's shards in (with a parameter dtype for mixed precision, a cast copy of the
  shards first, `fsdp_ag_cast`, freed once the collective is issued); `fsdp_all_gather` is the collective
  (stream "all_gather");
- wait (`foreach_all_gather_copy_out`): `fsdp_ag_copy_out` allocates every unsharded parameter of the unit
  (W x its padded shard: the padding travels with it) and copies them out; in the backward the all-gather
  output goes right after; in the forward it is kept (`comm_ctx.all_gather_state`) until the next unit's wait
  (before that unit's copy-out) or the root's post-forward, so two all-gather outputs meet at each unit's start;
- pre-forward of a unit: unshard and wait; then the explicit forward prefetches (`forward_prefetch` units
  ahead, `set_modules_to_forward_prefetch`; 0, FSDP2's default, prefetches nothing);
- post-forward: reshard (the unsharded parameters go) when `reshard_after_forward` (FSDP2's default: every
  unit but the root); the unit is recorded in the post-forward order;
- pre-backward (before the unit's first backward op): unshard (unless prefetched) and wait, then prefetch the
  unit before it in post-forward order (`backward_prefetch` 1, FSDP2's default; k > 1: the k units before it,
  `set_modules_to_backward_prefetch`);
- post-backward (after the unit's last backward op; for a unit whose inputs need no gradient, e.g. the root,
  in the final callback at the end of the backward): reshard; the previous reduce-scatter input goes
  (`reduce_scatter_states`, one kept); `fsdp_rs_alloc` allocates the reduce-scatter input (W x the padded
  shards of the parameters that have a gradient, in the reduce dtype) and copies the unsharded gradients in
  (they go then); `fsdp_reduce_scatter` (stream "reduce_scatter") makes the sharded gradients (a view of its
  output, which lives to the end of the step; a cast copy when the reduce dtype is not the parameters');
- the final callback: the deferred post-backwards, then the last reduce-scatter input and any prefetched
  all-gather never waited for go.

A buffer that FSDP frees later than its last use is read by an `fsdp_free` op (no output, no time) where
FSDP drops it, so that the simulator's rule (a tensor goes after its last reader) frees it there.

`memory_report(rank)` runs the rank's graph through the simulator (keep-all, the graph's order) and reads the
bytes per category at the peak and after every op, in two views: gaswap's own categories, and
FSDPMemTracker's (`tracker=True`: what torch's tracker calls each tensor at that moment, e.g. an unsharded
gradient is "temporaries" until its unit's post-backward starts, a buffer is an activation or a temporary
until its collective is issued).

`Op` has no stream field: `RankGraph.stream` says which stream each op runs on ("compute", "all_gather",
"reduce_scatter"); `step_time` schedules them with a link profile (`Link`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from gaswap.base.errors import BadInput
from gaswap.base.program import Verb
from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action
from gaswap.plan.graph import Graph, Op, Tensor
from gaswap.plan.simulator import SimResult, Simulator

ROOT = ""
COMPUTE, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "compute", "all_gather", "reduce_scatter", "all_reduce"
STREAMS = (COMPUTE, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
CATEGORIES = ("sharded params", "unsharded params", "sharded grads", "unsharded grads", "optimizer state",
              "all-gather buffers", "reduce-scatter buffers", "activations", "temporaries", "inputs", "buffers")
OUTSIDE = ("loss",)  # layers of ops outside the model (the loss): no unit's forward or backward


class ShardError(BadInput, ValueError):
    """A sharding the model cannot express (unknown unit, world size below 2, an op reading a resharded
    parameter...)."""


@dataclass(frozen=True)
class ParamSpec:
    """A trainable parameter: its tensor in the step graph, its path in the model ("layers.0.wq.weight"), shape,
    bytes per element, and its gradient tensor in the graph (None: it gets none)."""

    tensor: str
    path: str
    shape: tuple[int, ...]
    itemsize: int
    grad: str | None = None


@dataclass(frozen=True)
class ShardSpec:
    """How the step is sharded: `world_size` ranks; `units`, the module paths `fully_shard` is applied to
    ("" is the root, added if missing); `reshard_after_forward` True / False for all, a {unit: bool}, or None
    (FSDP2's default: True except for the root); prefetch depths; this `rank`; `sharded_itemsize` the bytes per
    element of the sharded parameters when the graph was captured in another dtype (mixed precision: the graph
    in the parameter dtype, the shards in the original one); `reduce_itemsize` of the reduce-scatter (default:
    the gradients'); `optimizer_scalar_bytes` per parameter (Adam's `step`: 4); `recompute` {unit: "full" or
    positions among `unit_owned_forward(...)`}: activation checkpointing (see `_Builder.recompute_plan`);
    `checkpoint_rng_bytes` the device bytes of the RNG state torch's checkpoint stashes per checkpointed forward
    (`torch.get_rng_state()`: 5,056 on a CPU device; 0 on CUDA, whose RNG states are host tensors)."""

    world_size: int
    units: tuple[str, ...] = (ROOT,)
    reshard_after_forward: bool | dict | None = None
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    rank: int = 0
    sharded_itemsize: int | None = None
    reduce_itemsize: int | None = None
    optimizer_scalar_bytes: int = 0
    outside: tuple[str, ...] = OUTSIDE
    recompute: dict | None = None
    replicate: int = 1
    offload: bool | tuple = False
    checkpoint_rng_bytes: int = 0

    def offloads(self, unit: str) -> bool:
        """Whether `unit`'s parameters, gradients and optimizer state live on the host (FSDP2's CPUOffloadPolicy):
        `offload` True for every unit, or a tuple of the units given it."""
        return self.offload if isinstance(self.offload, bool) else unit in self.offload

    @property
    def shard_size(self) -> int:
        """The ranks a parameter is sharded over: `world_size`, or its shard dimension under HSDP (a 2-D mesh of
        `replicate` x shard_size ranks)."""
        return self.world_size // self.replicate

    def reshards(self, unit: str) -> bool:
        r = self.reshard_after_forward
        if isinstance(r, dict):
            return bool(r.get(unit, unit != ROOT))
        return unit != ROOT if r is None else bool(r)

    def post_forward_group(self, unit: str) -> int | None:
        """The ranks `unit` reshards to after its forward when `reshard_after_forward` is an int k (FSDP2's
        `_get_post_forward_mesh_info`: each rank keeps a 1/k slice of the unsharded parameters and the backward
        all-gather runs within k ranks); None for True / False (and for 1 and W, which FSDP2 turns into them)."""
        r = self.reshard_after_forward
        r = r.get(unit, unit != ROOT) if isinstance(r, dict) else r
        if isinstance(r, bool) or not isinstance(r, int) or r in (1, self.shard_size):
            return None
        return r


def padded_shard_numel(shape, world_size: int) -> int:
    """Elements of one rank's padded shard: ceil(dim0 / W) rows (FSDP2's `_get_dim0_padded_size` / W)."""
    shape = tuple(shape) or (1,)
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def local_shard_numel(shape, world_size: int, rank: int) -> int:
    """Elements of rank `rank`'s unpadded chunk (torch.chunk on dim 0): what the optimizer's state is shaped like."""
    shape = tuple(shape) or (1,)
    rows = math.ceil(shape[0] / world_size)
    return max(0, min(rows, shape[0] - rank * rows)) * math.prod(shape[1:])


@dataclass(frozen=True)
class RankGraph:
    """One rank's step: the graph, the spec, each op's stream, each tensor's category (gaswap's view), the
    tracker's relabellings (tensor -> ((op, category), ...): from that op on), the units' parameters, and the
    bytes each collective's buffer holds (op -> bytes)."""

    graph: Graph
    spec: ShardSpec
    stream: dict
    category: dict
    tracker_category: dict
    relabel: dict
    units: dict
    collective_bytes: dict = field(default_factory=dict)
    collective_kind: dict = field(default_factory=dict)
    recomputed: dict = field(default_factory=dict)  # recomputed op -> the forward op it repeats
    group_size: dict = field(default_factory=dict)  # all-gather op / copy-in -> its ranks, where not W
    host_copies: dict = field(default_factory=dict)  # offload: copy op -> ("h2d" or "d2h", bytes moved)
    host_bytes: dict = field(default_factory=dict)  # offload: {category: bytes held on the host, not the device}

    def ranks(self, op: str) -> int:
        """The ranks a collective (or an all-gather's copy-in) runs over."""
        return self.group_size.get(op, self.spec.shard_size)


def inside(path: str, unit: str) -> bool:
    """Whether module `path` is `unit` or inside it (every path is inside the root, "")."""
    return unit == ROOT or path == unit or path.startswith(unit + ".")


def unit_of(path: str, units) -> str:
    """The unit owning a module path: the longest unit path that is it or contains it ("" owns the rest)."""
    best = ROOT
    for u in units:
        if u and inside(path, u) and len(u) > len(best):
            best = u
    return best


def unit_owned_forward(graph: Graph, units, unit: str, outside=OUTSIDE) -> list[int]:
    """Indices of the forward ops `unit` owns itself (its layer's owner is it, not a unit inside it): the
    positions a recompute choice names."""
    return owned_forward(graph, units, outside).get(unit, [])


def owned_forward(graph: Graph, units, outside=OUTSIDE) -> dict[str, list[int]]:
    """{unit: `unit_owned_forward`} for every unit owning a forward op, in one pass."""
    out, owner, by_unit = set(outside), {}, {}
    for i, op in enumerate(graph.ops):
        if op.phase != "fwd" or op.layer in out or op.layer.split(".")[0] in out:
            continue
        if op.layer not in owner:
            owner[op.layer] = unit_of(op.layer, units)
        by_unit.setdefault(owner[op.layer], []).append(i)
    return by_unit


def _tag(unit: str) -> str:
    return re.sub(r"\W", "_", unit) if unit else "root"


class _Builder:
    """Walks the single-device ops in order and emits the rank's ops, mirroring FSDP2's state machine."""

    def __init__(self, graph: Graph, params: list[ParamSpec], spec: ShardSpec):
        if spec.world_size < 2:
            raise ShardError(f"world size {spec.world_size}: sharding needs at least 2 ranks")
        if spec.replicate < 1 or spec.world_size % spec.replicate or spec.shard_size < 2:
            raise ShardError(f"HSDP mesh: {spec.replicate} replicas do not split {spec.world_size} ranks into shard "
                             f"groups of at least 2")
        self.g, self.spec, self.W = graph, spec, spec.shard_size
        self.units = tuple(dict.fromkeys([u for u in spec.units if u != ROOT] + [ROOT]))
        self.params = {p.tensor: p for p in params}
        for u in self.units:
            k = spec.reshard_after_forward.get(u) if isinstance(spec.reshard_after_forward, dict) \
                else spec.reshard_after_forward
            if not isinstance(k, bool) and isinstance(k, int) and not (1 <= k <= self.W and self.W % k == 0):
                raise ShardError(f"reshard_after_forward {k} ({u or 'root'}): an int must divide the world size "
                                 f"{self.W}")
        for p in params:
            if p.tensor not in graph.tensors or graph.tensors[p.tensor].kind != "param":
                raise ShardError(f"parameter {p.path}: {p.tensor!r} is not a parameter tensor of the graph")
        self.group: dict[str, list[ParamSpec]] = {}
        self.unit_of_param: dict[str, str] = {}
        for p in params:
            self.unit_of_param[p.tensor] = unit_of(p.path.rpartition(".")[0], self.units)
            self.group.setdefault(self.unit_of_param[p.tensor], []).append(p)
        self.grouped = [u for u in self.units if u in self.group]
        self.grad_of = {p.grad: p for p in params if p.grad is not None}
        self.outside = set(spec.outside)
        self.seed = self.backward_seed()
        self.forward_order: list[str] = []  # units by where their forward starts (set by `hook_events`)
        self.ops: list[Op] = []
        self.tensors: dict[str, Tensor] = {}
        self.stream: dict[str, str] = {}
        self.category: dict[str, str] = {}
        self.tracker: dict[str, str] = {}  # the tracker's first label
        self.relabel: dict[str, list] = {}
        self.pending_relabel: list[tuple[str, str]] = []
        self.collective_bytes: dict[str, int] = {}
        self.collective_kind: dict[str, str] = {}
        self.phase = "fwd"
        self.count = 0
        self.version: dict[str, int] = {}
        self.current: dict[str, str] = {}  # parameter tensor -> its unsharded tensor now
        self.pending: dict[str, list[str]] = {}  # unit -> [all-gather output, cast buffer?] issued, not waited
        self.unsharded: set[str] = set()
        self.ag_state: str | None = None
        self.post_forward_order: list[str] = []
        self.post_forward_indices: dict[str, list[int]] = {}
        self.rs_states: list[str] = []
        self.done_pre_backward: set[str] = set()
        self.done_post_backward: set[str] = set()
        self.recomputed: dict[str, str] = {}  # recomputed op -> the forward op it repeats
        self.slices: dict[str, list[str]] = {}  # unit -> its post-forward slices (int reshard_after_forward)
        self.group_size: dict[str, int] = {}
        self.host_copies: dict[str, tuple[str, int]] = {}
        self.host_bytes: dict[str, int] = {}
        self.ar_states: list[str] = []  # HSDP: all-reduced buffers in the reduce dtype, held to the end
        self.copy_of: dict[str, str] = {}  # recomputed tensor -> the forward's
        # what torch's checkpoint itself holds (`checkpoint_holds`): (kind, unit, tensors) to emit before op i,
        # after the clones run before op i, and after op i
        self.held_before: dict[int, list] = {}
        self.held_after_recompute: dict[int, list] = {}
        self.held_after: dict[int, list] = {}

    # --- sizes ---
    def shard_bytes(self, p: ParamSpec, itemsize: int | None = None) -> int:
        return padded_shard_numel(p.shape, self.W) * (itemsize or p.itemsize)

    def sharded_itemsize(self, p: ParamSpec) -> int:
        return self.spec.sharded_itemsize or p.itemsize

    # --- emitting ---
    def tensor(self, name: str, size: int, kind: str, producer, category: str, tracker: str | None = None) -> str:
        self.tensors[name] = Tensor(name, size, kind, producer)
        self.category[name] = category
        self.tracker[name] = tracker or category
        return name

    def emit(self, name: str, target: str, inputs, outputs, stream: str = COMPUTE, layer: str = "") -> str:
        op = Op(name, target, tuple(dict.fromkeys(inputs)), tuple(outputs), self.phase, layer, recomputable=False,
                signature=target)
        self.ops.append(op)
        self.stream[name] = stream
        for t, cat in self.pending_relabel:
            self.relabel.setdefault(t, []).append((name, cat))
        self.pending_relabel.clear()
        return name

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}.{self.count}"

    def free(self, tensors, why: str) -> None:
        tensors = [t for t in tensors if t]
        if tensors:
            self.emit(self.fresh(f"fsdp_free.{why}"), "fsdp.free", tensors, ())

    def temp(self) -> str:
        return "activations" if self.phase == "fwd" else "temporaries"

    # --- FSDP2's steps ---
    def unshard(self, u: str) -> None:
        if u in self.pending or u in self.unsharded or u not in self.group:
            return
        ps = self.group[u]
        k = self.version[u] = self.version.get(u, 0) + 1
        tag = f"{_tag(u)}.{k}"
        shards = self.slices.get(u) or self.host_to_device(u, tag) or [f"{p.tensor}.shard" for p in ps]
        inputs = list(shards)
        cast = None
        if self.spec.sharded_itemsize and any(self.sharded_itemsize(p) != p.itemsize for p in ps):
            cast_op = f"fsdp_ag_cast.{tag}"
            cast = self.tensor(f"ag_cast.{tag}", self.ag_input_bytes(u), "activation", cast_op,
                               "all-gather buffers", self.temp())
            self.emit(cast_op, "fsdp.all_gather_cast", shards, (cast,), layer=u)
            inputs = [cast]
        alloc = f"fsdp_ag_alloc.{tag}"
        nbytes = self.W * sum(self.shard_bytes(p) for p in ps)  # k x the post-forward slices: the same
        buf = self.tensor(f"ag_out.{tag}", nbytes, "activation", alloc, "all-gather buffers", self.temp())
        self.emit(alloc, "fsdp.all_gather_copy_in", inputs, (buf,), layer=u)
        op = self.emit(f"fsdp_all_gather.{tag}", "fsdp.all_gather", [buf] + ([cast] if cast else []), (),
                       stream=ALL_GATHER, layer=u)
        self.relabel.setdefault(buf, []).append((op, "all-gather buffers"))
        self.collective_bytes[op], self.collective_kind[op] = nbytes, "all_gather"
        if u in self.slices:
            self.group_size[alloc] = self.group_size[op] = self.spec.post_forward_group(u)
        self.pending[u] = buf

    def host_to_device(self, u: str, tag: str) -> list[str]:
        """CPU offload (`FSDPParam.all_gather_inputs`: `_sharded_param_data.to(device)`): the unit's shards copied
        host->device (in their own dtype) before the all-gather's copy-in, which is their last reader ([] without
        offload)."""
        if not self.spec.offloads(u):
            return []
        op = f"fsdp_h2d.{tag}"
        nbytes = sum(self.shard_bytes(p, self.sharded_itemsize(p)) for p in self.group[u])
        out = self.tensor(f"h2d.{tag}", nbytes, "activation", op, "all-gather buffers", self.temp())
        self.emit(op, "fsdp.h2d", [f"{p.tensor}.shard" for p in self.group[u]], (out,), layer=u)
        self.host_copies[op] = ("h2d", nbytes)
        return [out]

    def ag_input_bytes(self, u: str) -> int:
        """Bytes of this rank's all-gather input: its shards, or its post-forward slices."""
        if u in self.slices:
            return sum(self.tensors[t].size for t in self.slices[u])
        return sum(self.shard_bytes(p) for p in self.group[u])

    def wait_for_unshard(self, u: str, forward: bool) -> None:
        if u not in self.pending:
            return
        buf = self.pending.pop(u)
        if forward and self.ag_state is not None:
            self.free([self.ag_state], "all_gather_state")
            self.ag_state = None
        tag = buf.removeprefix("ag_out.")
        copy = f"fsdp_ag_copy_out.{tag}"
        outs = []
        for p in self.group[u]:
            name = self.tensor(f"{p.tensor}.unsharded.{tag}", self.W * self.shard_bytes(p), "activation", copy,
                               "unsharded params")
            self.current[p.tensor] = name
            outs.append(name)
        self.emit(copy, "fsdp.all_gather_copy_out", [buf], outs, layer=u)
        self.unsharded.add(u)
        if u in self.slices:  # FSDPParam.to_unsharded drops the post-forward slices after the copy-out
            self.free(self.slices.pop(u), f"post_forward.{_tag(u)}")
        if forward:
            self.ag_state = buf  # freed at the next unit's wait, or the root's post-forward

    def reshard(self, u: str, forward: bool) -> None:
        if forward and not self.spec.reshards(u):
            return
        if u in self.unsharded:
            if forward and self.spec.post_forward_group(u):
                self.keep_post_forward_slices(u, self.spec.post_forward_group(u))
            self.free([self.current.pop(p.tensor) for p in self.group[u]], f"reshard.{_tag(u)}")
            self.unsharded.discard(u)

    def keep_post_forward_slices(self, u: str, k: int) -> None:
        """Integer `reshard_after_forward` k (FSDPParam.to_sharded_post_forward): each unsharded parameter's
        1/k slice, this rank's among k, is cloned (a forward allocation: the tracker's activations) and kept for
        the backward all-gather over k ranks."""
        op = self.fresh(f"fsdp_post_forward_slice.{_tag(u)}")
        outs = [self.tensor(f"{p.tensor}.post_forward.{op.rpartition('.')[2]}", self.W * self.shard_bytes(p) // k,
                            "activation", op, "sharded params", "activations") for p in self.group[u]]
        self.emit(op, "fsdp.post_forward_slice", [self.current[p.tensor] for p in self.group[u]], outs, layer=u)
        self.slices[u] = outs

    def pre_forward(self, u: str, forward_order: list[str]) -> None:
        self.unshard(u)
        self.wait_for_unshard(u, forward=True)
        if self.spec.forward_prefetch > 0 and u in forward_order:
            i = forward_order.index(u)
            for t in forward_order[i + 1:i + 1 + self.spec.forward_prefetch]:
                self.unshard(t)

    def post_forward(self, u: str) -> None:
        if u in self.group:
            self.reshard(u, forward=True)
            self.post_forward_indices.setdefault(u, []).append(len(self.post_forward_order))
            self.post_forward_order.append(u)
        if u == ROOT and self.ag_state is not None:
            self.free([self.ag_state], "all_gather_state")
            self.ag_state = None

    def pre_backward(self, u: str) -> None:
        if u in self.done_pre_backward:
            return
        self.done_pre_backward.add(u)
        self.unshard(u)
        self.wait_for_unshard(u, forward=False)
        self.backward_prefetch(u)

    def backward_prefetch(self, u: str) -> None:
        """Unshard the unit(s) before `u` in post-forward order, as its pre-backward does."""
        k = self.spec.backward_prefetch
        if k == 1:  # FSDP2's default: the unit before this one in post-forward order
            if self.post_forward_indices.get(u):
                i = self.post_forward_indices[u].pop()
                if i > 0:
                    self.unshard(self.post_forward_order[i - 1])
        elif k > 1:
            order = self.post_forward_order
            i = max(j for j, v in enumerate(order) if v == u) if u in order else 0
            for t in reversed(order[max(0, i - k):i]):
                self.unshard(t)

    def post_backward(self, u: str) -> None:
        if u in self.done_post_backward or u not in self.group:
            return
        self.done_post_backward.add(u)
        ps = self.group[u]
        with_grad = [p for p in ps if p.grad is not None and p.grad in self.tensors]
        for p in with_grad:  # the tracker relabels them as its post-backward starts
            self.pending_relabel.append((p.grad, "unsharded grads"))
        self.reshard(u, forward=False)
        if self.rs_states:
            self.free(self.rs_states, "reduce_scatter_state")
            self.rs_states = []
        if with_grad:
            self.reduce_scatter(u, with_grad)

    def reduce_scatter(self, u: str, with_grad: list[ParamSpec]) -> None:
        """The reduce-scatter input (the unsharded gradients copied in, in the reduce dtype), the collective and
        the sharded gradients (a cast copy of its output when the reduce dtype is not the parameters')."""
        tag = _tag(u)
        reduce = self.spec.reduce_itemsize
        alloc = f"fsdp_rs_alloc.{tag}"
        nbytes = self.W * sum(self.shard_bytes(p, reduce) for p in with_grad)
        rs_in = self.tensor(f"rs_in.{tag}", nbytes, "activation", alloc, "reduce-scatter buffers", "temporaries")
        self.emit(alloc, "fsdp.reduce_scatter_copy_in", [p.grad for p in with_grad], (rs_in,), layer=u)
        rs = f"fsdp_reduce_scatter.{tag}"
        out_bytes = sum(self.shard_bytes(p, reduce) for p in with_grad)
        grad_bytes = sum(self.shard_bytes(p, self.sharded_itemsize(p)) for p in with_grad)
        if out_bytes == grad_bytes:
            out = self.tensor(f"grad_shard.{tag}", out_bytes, "grad", rs, "sharded grads", "temporaries")
            self.emit(rs, "fsdp.reduce_scatter", [rs_in], (out,), stream=REDUCE_SCATTER, layer=u)
            self.all_reduce(u, out, hold=False)
        else:
            raw = self.tensor(f"rs_out.{tag}", out_bytes, "activation", rs, "reduce-scatter buffers", "temporaries")
            self.emit(rs, "fsdp.reduce_scatter", [rs_in], (raw,), stream=REDUCE_SCATTER, layer=u)
            self.all_reduce(u, raw, hold=True)
            cast = f"fsdp_grad_cast.{tag}"
            out = self.tensor(f"grad_shard.{tag}", grad_bytes, "grad", cast, "sharded grads", "temporaries")
            self.emit(cast, "fsdp.grad_cast", [raw], (out,), layer=u)
        self.relabel.setdefault(rs_in, []).append((rs, "reduce-scatter buffers"))
        self.collective_bytes[rs], self.collective_kind[rs] = nbytes, "reduce_scatter"
        out = self.device_to_host(u, out)
        self.pending_relabel.append((out, "sharded grads"))
        self.rs_states.append(rs_in)

    def device_to_host(self, u: str, grad: str) -> str:
        """CPU offload (`foreach_reduce`: `new_sharded_grad.to("cpu")`): the sharded gradients copied to the host,
        where they stay (no device bytes); the device copy goes after it. Without offload: `grad` as it is."""
        if not self.spec.offloads(u):
            return grad
        op = f"fsdp_d2h.{_tag(u)}"
        nbytes = self.tensors[grad].size
        host = self.tensor(f"grad_shard_host.{_tag(u)}", 0, "grad", op, "sharded grads", "temporaries")
        self.emit(op, "fsdp.d2h", [grad], (host,), layer=u)
        self.host_copies[op] = ("d2h", nbytes)
        self.host_bytes["sharded grads"] = self.host_bytes.get("sharded grads", 0) + nbytes
        self.tensors[grad] = replace(self.tensors[grad], kind="activation")  # a device buffer now, not the grad
        return host

    def all_reduce(self, u: str, reduced: str, hold: bool) -> None:
        """HSDP (`foreach_reduce` with an all-reduce group): the reduce-scatter's output is all-reduced in place
        across the replicas (stream "all_reduce"); in the reduce dtype (`hold`: not the parameters') it is kept
        to the end of the backward (`FSDPParamGroup._all_reduce_state`, dropped in `finalize_backward`)."""
        if self.spec.replicate == 1:
            return
        op = self.emit(f"fsdp_all_reduce.{_tag(u)}", "fsdp.all_reduce", [reduced], (), stream=ALL_REDUCE, layer=u)
        self.collective_bytes[op], self.collective_kind[op] = self.tensors[reduced].size, "all_reduce"
        self.group_size[op] = self.spec.replicate
        if hold:
            self.ar_states.append(reduced)

    # --- activation checkpointing ---
    def recompute_plan(self) -> tuple[dict, dict]:
        """Where the recomputed forward ops go and what the backward reads instead: ({backward op index: the
        clones run before it}, {backward op index: {tensor: its recomputed copy}}), from `spec.recompute`.

        Per unit, its own forward ops (`unit_owned_forward`) at the chosen positions are recomputed (all of them
        for "full"): those whose outputs the unit's backward reads, and those these need, run again in forward
        order just before the unit's first backward op, after its pre-backward all-gather (torch's checkpoint
        unpacks its saved tensors there; FSDP2 skips its pre-forward hooks in the pre-backward state, so the
        recompute reads the re-gathered parameters). The unit's backward ops read the copies, so the forward's
        outputs go after their last forward reader and the copies after their last backward one. A backward
        op outside the unit still reads the forward's tensor (a checkpointed module's outputs are saved)."""
        clones_at, redirect = {}, {}
        if not self.spec.recompute:
            return clones_at, redirect
        owned = owned_forward(self.g, self.units, self.spec.outside)
        backward = self.backward_by_module()
        for u, chosen in self.spec.recompute.items():
            ops = self.recomputed_ops(u, chosen, owned.get(u, []))
            back = [i for i in backward.get(u, ()) if self.within(self.g.ops[i].layer, u, i)]
            if not ops or not back:
                continue
            clones, copy = self.clone_for_backward(ops, back)
            clones_at.setdefault(back[0], []).extend(clones)
            for i in back:
                if copy.keys() & set(self.g.ops[i].inputs):
                    redirect.setdefault(i, {}).update(copy)
            kept = [i for i in owned[u] if i not in ops]
            self.checkpoint_holds(u, owned[u], kept, back, read=[t for c in clones for t in c.inputs])
        return clones_at, redirect

    def checkpoint_holds(self, u: str, forward: list[int], kept: list[int], back: list[int], read) -> None:
        """What torch's non-reentrant checkpoint of unit `u` holds besides the tensors the backward reads
        (torch/utils/checkpoint.py, `_checkpoint_without_reentrant_generator`):

        - the RNG state it stashes as the checkpointed forward starts (`torch.get_rng_state()`, kept by the
          checkpoint's frame until the unit's last backward op has run and the frame goes), and a second one
          while the recompute runs (`torch.random.fork_rng` saves the state it restores after): each
          `spec.checkpoint_rng_bytes` (none without);
        - the forward's tensor inputs (`_NoopSaveInputs`, for the recompute), until the frame goes: the
          activations its ops read that no op of the unit made (an attention mask made once by the root, say);
        - selective checkpointing (`create_selective_checkpoint_contexts`): every output of an op saved
          (MUST_SAVE, the ops not recomputed, `kept`) goes into the policy's storage and stays there until the
          recompute takes it back out, whether the backward reads it or not: such an output that neither the
          backward nor a recomputed op reads (`read`: what the recomputed ops read) is held to the recompute; the
          recompute stops early, once it has packed the last tensor the backward reads, so a saved op after that
          point is never reached and its output is held until the frame goes. The stop is taken at the last op
          making a tensor the unit's backward reads (a tensor autograd saves as an input of a later op is packed
          at that op: the recompute may run a little further, and such an output is then held too long)."""
        n = self.spec.checkpoint_rng_bytes
        if n:
            self.held_before.setdefault(forward[0], []).append(("rng", u, n))
            self.held_after.setdefault(back[-1], []).append(("free", u, [f"checkpoint_rng.{_tag(u)}"]))
            self.held_before.setdefault(back[0], []).append(("fork", u, n))
            self.held_after_recompute.setdefault(back[0], []).append(("free", u, [f"checkpoint_fork.{_tag(u)}"]))
        needed = set(read) | {t for i in back for t in self.g.ops[i].inputs}
        made = {t: i for i in forward for t in self.g.ops[i].outputs}
        stop = max((made[t] for t in needed if t in made), default=-1)
        popped = [t for i in kept if i <= stop for t in self.g.ops[i].outputs if t not in needed]
        never = [t for i in kept if i > stop for t in self.g.ops[i].outputs if t not in needed]
        if popped:
            self.held_after_recompute.setdefault(back[0], []).append(("free", u, popped))
        ins = {op.name for op in map(self.g.ops.__getitem__, forward)}
        never += [t for i in forward for t in self.g.ops[i].inputs if self.g.tensors[t].kind in ("activation", "input")
                  and self.g.tensors[t].producer not in ins]
        if never:
            self.held_after.setdefault(back[-1], []).append(("free", u, list(dict.fromkeys(never))))

    def checkpoint_state(self, events) -> None:
        """Emit what `checkpoint_holds` placed here: an RNG state made ("rng": the forward's stash, "fork": the
        recompute's), or a zero-time op reading what the checkpoint held until now ("free")."""
        for kind, u, what in events:
            if kind == "free":
                self.free(what, f"checkpoint.{_tag(u)}")
                continue
            op = f"checkpoint_{kind}.{_tag(u)}"
            self.tensor(f"checkpoint_{kind}.{_tag(u)}", what, "activation", op, "activations", self.temp())
            self.emit(op, "checkpoint.rng_state", (), (op,), layer=u)

    def backward_by_module(self) -> dict[str, list[int]]:
        """{module path: its backward ops, those of modules inside it included}, in order."""
        backward: dict[str, list[int]] = {}
        for i, op in enumerate(self.g.ops):
            if op.phase != "bwd":
                continue
            parts = op.layer.split(".")
            for k in range(1, len(parts) + 1):
                backward.setdefault(".".join(parts[:k]), []).append(i)
        return backward

    def recomputed_ops(self, u: str, chosen, own: list[int]) -> set[int]:
        """The forward ops of unit `u` that `chosen` ("full" or positions among `own`, its own forward ops) names."""
        if u == ROOT or u not in self.units:
            raise ShardError(f"recompute: {u or 'the root'!r} is not a unit that can be checkpointed "
                             f"(units: {', '.join(x for x in self.units if x)})")
        positions = range(len(own)) if chosen == "full" else chosen
        if any(not 0 <= p < len(own) for p in positions):
            raise ShardError(f"recompute: unit {u!r} has {len(own)} forward ops, not positions {chosen}")
        return {own[p] for p in positions}

    def clone_for_backward(self, ops: set[int], back: list[int]) -> tuple[list[Op], dict[str, str]]:
        """The clones of those of `ops` whose outputs the backward ops `back` read (and of those these need), in
        forward order, reading each other's copies, and {forward tensor: its copy}."""
        g = self.g
        made = {t: i for i in ops for t in g.ops[i].outputs}
        needed = {t for i in back for t in g.ops[i].inputs if t in made}
        run = []
        for i in sorted(ops, reverse=True):
            if needed.intersection(g.ops[i].outputs):
                run.append(i)
                needed.update(t for t in g.ops[i].inputs if t in made)
        copy = {t: f"{t}.rc" for i in run for t in g.ops[i].outputs}
        clones = []
        for i in sorted(run):
            op = g.ops[i]
            clones.append(replace(op, name=f"{op.name}.rc", inputs=tuple(copy.get(t, t) for t in op.inputs),
                                  outputs=tuple(copy[t] for t in op.outputs), phase="bwd"))
            self.recomputed[f"{op.name}.rc"] = op.name
        self.copy_of.update({v: k for k, v in copy.items()})
        return clones, copy

    def step_op(self, op: Op, category: str) -> None:
        """Emit one op of the single-device step (or a recomputed copy): parameters read as the unit's unsharded
        ones, outputs categorised (gradients of sharded parameters are unsharded gradients)."""
        inputs = []
        for t in op.inputs:
            if t in self.params:
                if t not in self.current:
                    raise ShardError(f"op {op.name} ({op.layer or 'root'}) reads parameter {self.params[t].path} "
                                     f"while its unit {self.owner(self.params[t].path) or 'root'!r} is sharded")
                inputs.append(self.current[t])
            else:
                inputs.append(t)
        for t in op.outputs:
            src = self.g.tensors[self.copy_of.get(t, t)]
            if t in self.grad_of:
                self.tensor(t, src.size, "activation", op.name, "unsharded grads", "temporaries")
            elif src.kind == "grad":  # a gradient of no parameter we shard (kept as it is)
                self.tensor(t, src.size, "grad", op.name, "temporaries")
            else:
                self.tensor(t, src.size, src.kind, op.name, category)
        self.emit(op.name, op.target, inputs, op.outputs, layer=op.layer)
        self.ops[-1] = replace(op, inputs=tuple(dict.fromkeys(inputs)))

    # --- where the hooks fire ---
    def backward_seed(self) -> set[int]:
        """The seed of the backward (the loss's gradient, `ones_like`, untagged): made by `backward()` before
        autograd's engine runs and held by it to the end of the backward."""
        seed = set()
        for i, op in enumerate(self.g.ops):
            if op.phase == "bwd":
                if op.layer != "":
                    break
                seed.add(i)
        return seed

    def is_outside(self, layer: str) -> bool:
        return layer in self.outside or layer.split(".")[0] in self.outside

    def owner(self, layer: str):
        """The unit owning a module path (None: outside the model)."""
        return None if self.is_outside(layer) else unit_of(layer, self.units)

    def within(self, layer: str, u: str, i: int = -1) -> bool:
        """Whether op `i` of module `layer` is one of unit `u`'s (the loss and the backward's seed are no unit's)."""
        if self.is_outside(layer) or i in self.seed:
            return False
        return inside(layer, u)

    def members(self) -> dict[str, list[int]]:
        """{module path: the ops inside it, in order} ("" holds them all)."""
        members: dict[str, list[int]] = {ROOT: list(range(len(self.g.ops)))}
        for i, op in enumerate(self.g.ops):
            parts = op.layer.split(".") if op.layer else []
            for k in range(1, len(parts) + 1):
                members.setdefault(".".join(parts[:k]), []).append(i)
        return members

    def reads_outside(self, forward: list[int]) -> bool:
        """Whether the forward ops `forward` read an activation made outside them: the unit's inputs need a
        gradient, so its post-backward runs after its last backward op (else in the final callback)."""
        g = self.g
        inside = {t for i in forward for t in g.ops[i].outputs}
        return any(g.tensors[t].producer is not None and t not in inside and g.tensors[t].kind == "activation"
                   for i in forward for t in g.ops[i].inputs)

    def hook_events(self) -> tuple[dict, dict, list[str]]:
        """({op index: the hooks run before it}, {op index: the hooks run after it}, the units whose post-backward
        waits for the final callback); sets `forward_order`, the units by where their forward starts."""
        g, depth = self.g, {u: (-1 if u == ROOT else u.count(".")) for u in self.units}
        before: dict[int, list] = {}
        after: dict[int, list] = {}
        deferred, forward_spans, members = [], {}, self.members()
        for u in self.grouped + ([] if ROOT in self.grouped else [ROOT]):
            ops_in = members.get(u, ())
            f = [i for i in ops_in if g.ops[i].phase == "fwd" and self.within(g.ops[i].layer, u)]
            b = [i for i in ops_in if g.ops[i].phase == "bwd" and self.within(g.ops[i].layer, u, i)] \
                if u in self.group else []
            if f:  # the root's post-forward frees the last all-gather output, whether it has parameters or not
                forward_spans[u] = (f[0], f[-1])
                before.setdefault(f[0], []).append(("pre_forward", u))
                after.setdefault(f[-1], []).append(("post_forward", u))
            if b:
                before.setdefault(b[0], []).append(("pre_backward", u))
                if self.reads_outside(f):
                    after.setdefault(b[-1], []).append(("post_backward", u))
                else:
                    deferred.append(u)
        self.forward_order = sorted(forward_spans, key=lambda u: (forward_spans[u][0], depth[u]))
        for events in before.values():
            events.sort(key=lambda e: depth[e[1]])  # outer units first
        for events in after.values():
            events.sort(key=lambda e: -depth[e[1]])  # inner units first
        return before, after, deferred

    def run_hooks(self, events) -> None:
        for kind, u in events:
            if kind == "pre_forward":
                self.pre_forward(u, self.forward_order)
            elif kind == "post_forward":
                self.post_forward(u)
            elif kind == "pre_backward":
                self.pre_backward(u)
            else:
                self.post_backward(u)

    # --- the walk ---
    def build(self) -> RankGraph:
        self.add_residents()
        before, after, deferred = self.hook_events()
        clones_at, redirect = self.recompute_plan()
        for i, op in enumerate(self.g.ops):
            self.phase = op.phase
            self.run_hooks(before.get(i, ()))
            self.checkpoint_state(self.held_before.get(i, ()))
            for clone in clones_at.get(i, ()):
                self.step_op(clone, "activations")
            self.checkpoint_state(self.held_after_recompute.get(i, ()))
            if i in redirect:
                op = replace(op, inputs=tuple(redirect[i].get(t, t) for t in op.inputs))
            self.step_op(op, "activations" if op.phase == "fwd" or i in self.seed else "temporaries")
            self.checkpoint_state(self.held_after.get(i, ()))  # a frame goes as its last node is done: before hooks
            self.run_hooks(after.get(i, ()))
        self.final_callback(deferred)
        self.drop_unread_inputs()
        return self.rank_graph()

    def add_residents(self) -> None:
        """The tensors no op makes: the sharded parameters (in place of the parameters), inputs and buffers."""
        for name, t in self.g.tensors.items():
            if t.kind == "param" and name in self.params:
                p = self.params[name]
                nbytes = self.shard_bytes(p, self.sharded_itemsize(p))
                if self.spec.offloads(self.unit_of_param[name]):  # CPUOffloadPolicy: the shard lives on the host
                    self.host_bytes["sharded params"] = self.host_bytes.get("sharded params", 0) + nbytes
                    nbytes = 0
                self.tensor(f"{name}.shard", nbytes, "param", None, "sharded params")
            elif t.producer is None:
                cat = "inputs" if t.kind in ("input", "grad_output") else "buffers"
                self.tensor(name, t.size, t.kind, None, cat)

    def final_callback(self, deferred: list[str]) -> None:
        """FSDP2's final callback at the end of the backward: the deferred post-backwards (root first, as
        `all_states`), then the last reduce-scatter input, any prefetched all-gather never waited for and the
        backward's seed go."""
        self.phase = "bwd"
        order = [u for u in self.units if u == ROOT] + [u for u in self.units if u != ROOT]
        for u in order:
            if u in deferred:
                self.post_backward(u)
        held = [t for i in sorted(self.seed) for t in self.g.ops[i].outputs]
        slices = [t for ts in self.slices.values() for t in ts]  # units whose backward never ran
        self.free(self.rs_states + list(self.pending.values()) + held + slices + self.ar_states, "final")
        self.rs_states, self.pending, self.slices = [], {}, {}
        if self.pending_relabel:
            self.emit(self.fresh("fsdp_end"), "fsdp.end", (), ())

    def drop_unread_inputs(self) -> None:
        """Tensors nobody reads any more that nothing produces (the target of a loss that takes none) are dropped."""
        read = {t for op in self.ops for t in op.inputs}
        for name in [n for n, t in self.tensors.items() if t.producer is None and n not in read
                     and t.kind == "input"]:
            del self.tensors[name]

    def resident(self) -> dict:
        """The graph's resident bytes with the optimizer's state scaled to this rank's local shards (plus its
        scalars per parameter)."""
        resident = dict(self.g.resident)
        param_bytes = sum(t.size for t in self.g.tensors.values() if t.kind == "param")
        ratio = resident.get("optimizer_state", 0) / param_bytes if param_bytes else 0.0
        local = sum(local_shard_numel(p.shape, self.W, self.spec.rank % self.W) * self.sharded_itemsize(p)
                    for p in self.params.values())
        resident["optimizer_state"] = round(ratio * local) + self.spec.optimizer_scalar_bytes * len(self.params)
        host = [p for p in self.params.values() if self.spec.offloads(self.unit_of_param[p.tensor])]
        if host:  # on the host with the shards
            moved = round(ratio * sum(local_shard_numel(p.shape, self.W, self.spec.rank % self.W)
                                      * self.sharded_itemsize(p) for p in host)) \
                + self.spec.optimizer_scalar_bytes * len(host)
            self.host_bytes["optimizer state"] = moved
            resident["optimizer_state"] -= moved
        return resident

    def rank_graph(self) -> RankGraph:
        g = self.g
        graph = Graph(tuple(self.ops), self.tensors, self.resident(), g.counted, g.loss)
        units_out = {u: tuple(p.tensor for p in self.group[u]) for u in self.grouped}
        return RankGraph(graph, self.spec, self.stream, self.category, self.tracker,
                         {t: tuple(v) for t, v in self.relabel.items()}, units_out, self.collective_bytes,
                         self.collective_kind, self.recomputed, self.group_size, self.host_copies,
                         self.host_bytes)


def shard_step(graph: Graph, params: list[ParamSpec], spec: ShardSpec) -> RankGraph:
    """Rank `spec.rank`'s step of the single-device `graph` under FSDP2 (see the module docstring)."""
    return _Builder(graph, list(params), spec).build()


# --- memory ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryReport:
    """Per-rank memory of a step: the peak, the op it is reached at, bytes by category there, and after each op
    (op name, total, {category: bytes}); `simulated_peak` is the simulator's figure (equal to `peak`)."""

    peak: int
    peak_op: str
    at_peak: dict
    timeline: tuple
    simulated_peak: int


def keep_all_run(rank: RankGraph, *, trace: bool = False) -> SimResult:
    """The rank's graph through the simulator, every activation kept, in the graph's order (memory only: ops
    cost nothing); ShardError if it cannot run."""
    g = rank.graph
    sim = Simulator(g, Costs({op.name: 0.0 for op in g.ops}, 1.0, 1.0, "shard", "shard"))
    result = sim.run(list(range(len(g.ops))), [int(Action.KEEP)] * len(sim.candidates), trace=trace)
    if not result.valid:
        raise ShardError(f"the rank's step cannot run: {result.reason}")
    return result


def memory_report(rank: RankGraph, *, tracker: bool = False, result: SimResult | None = None) -> MemoryReport:
    """Read, from the program of the rank's keep-all run (`result`, a traced `keep_all_run`, made if not
    given), the bytes per category at the peak and after each op (`tracker`: FSDPMemTracker's labels, see the
    module docstring)."""
    g = rank.graph
    result = result or keep_all_run(rank, trace=True)
    base = rank.tracker_category if tracker else rank.category
    label = dict(base)
    relabel_at: dict[str, list] = {}
    if tracker:
        for t, changes in rank.relabel.items():
            for op, cat in changes:
                relabel_at.setdefault(op, []).append((t, cat))
    level = dict.fromkeys(CATEGORIES, 0)
    level["optimizer state"] = g.resident.get("optimizer_state", 0)
    live: set[str] = set()
    for t in g.tensors.values():
        if t.producer is None:
            live.add(t.name)
            level[label[t.name]] += t.size
    total = sum(level.values())
    peak, peak_op, at_peak, timeline = total, "", dict(level), []
    outputs = {op.name: op.outputs for op in g.ops}
    for ins in result.program:
        if ins.verb == Verb.RUN:
            for t, cat in relabel_at.get(ins.name, ()):
                if t in live:
                    level[label[t]] -= g.tensors[t].size
                    level[cat] += g.tensors[t].size
                label[t] = cat
            for t in outputs[ins.name]:
                if t not in live:
                    live.add(t)
                    level[label[t]] += g.tensors[t].size
                    total += g.tensors[t].size
            timeline.append((ins.name, total, dict(level)))
            if total > peak:
                peak, peak_op, at_peak = total, ins.name, dict(level)
        elif ins.verb == Verb.FREE and ins.name in live:
            live.discard(ins.name)
            level[label[ins.name]] -= g.tensors[ins.name].size
            total -= g.tensors[ins.name].size
    if peak != result.peak_bytes:
        raise AssertionError(f"category walk peak {peak} != simulator peak {result.peak_bytes}")
    return MemoryReport(peak, peak_op, at_peak, tuple(timeline), result.peak_bytes)


# --- time ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """A collective's cost on W ranks: `latency` s per step of the ring, `bandwidth` bytes/s per rank's link
    (bus bandwidth); `all_gather(n, W)` for an output of n bytes, `reduce_scatter(n, W)` for an input of n:
    (W - 1) latency + (W - 1) / W n / bandwidth. The reduce-scatter has its own figures where given
    (`reduce_scatter_latency`, `reduce_scatter_bandwidth`: gloo on a CPU adds the reduction and a copy of the
    input), else the all-gather's. `fit` makes one from measured (bytes, seconds) pairs."""

    latency: float
    bandwidth: float
    reduce_scatter_latency: float | None = None
    reduce_scatter_bandwidth: float | None = None

    def all_gather(self, nbytes: int, world_size: int) -> float:
        return (world_size - 1) * self.latency + (world_size - 1) / world_size * nbytes / self.bandwidth

    def all_reduce(self, nbytes: int, world_size: int) -> float:
        """A ring all-reduce of n bytes: a reduce-scatter then an all-gather, 2 (W - 1) steps."""
        return 2 * self.all_gather(nbytes, world_size)

    def reduce_scatter(self, nbytes: int, world_size: int) -> float:
        latency = self.latency if self.reduce_scatter_latency is None else self.reduce_scatter_latency
        bandwidth = self.bandwidth if self.reduce_scatter_bandwidth is None else self.reduce_scatter_bandwidth
        return (world_size - 1) * latency + (world_size - 1) / world_size * nbytes / bandwidth

    @staticmethod
    def fit(world_size: int, all_gather, reduce_scatter=None) -> Link:
        """The Link whose costs fit measured collectives on `world_size` ranks best (least squares of seconds
        against bytes, a + b n, per collective): `all_gather` and `reduce_scatter` are [(bytes, seconds)]."""
        lat, bw = _fit_ring(world_size, all_gather)
        if reduce_scatter is None:
            return Link(lat, bw)
        return Link(lat, bw, *_fit_ring(world_size, reduce_scatter))


def _fit_ring(world_size: int, points) -> tuple[float, float]:
    """(latency, bandwidth) of the ring model from [(bytes, seconds)]: a least-squares line a + b n, then
    latency a / (W - 1) (never below 0) and bandwidth (W - 1) / W / b."""
    n = len(points)
    if n < 2 or len({b for b, _ in points}) < 2:
        raise ValueError("a link fit needs collectives of at least two sizes")
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    slope = sum((b - mx) * (t - my) for b, t in points) / sum((b - mx) ** 2 for b, _ in points)
    if slope <= 0:
        raise ValueError(f"a link fit needs seconds growing with bytes; got slope {slope}")
    intercept = my - slope * mx
    return max(0.0, intercept) / (world_size - 1), (world_size - 1) / world_size / slope


def rank_op_times(rank: RankGraph, op_time: dict, link: Link, *, copy_bandwidth: float = 10e9,
                  host_overhead: float = 0.0, replica_link: Link | None = None, host_link=None) -> dict:
    """Seconds per op of the rank's graph: the single-device ops' from `op_time`, collectives from `link`,
    FSDP's copies at `copy_bandwidth` (bytes/s, read and written: the all-gather's copy-in moves this rank's
    shards, 1 / W of its buffer, the copy-out and the reduce-scatter's copy-in the whole buffer), plus
    `host_overhead` seconds for each of FSDP's ops (its Python around each copy and collective, which a
    CPU pays on the compute thread), frees none."""
    g = rank.graph
    out = {}
    for op in g.ops:
        if op.name in rank.collective_kind:
            n = rank.collective_bytes[op.name]
            kind = rank.collective_kind[op.name]
            over = replica_link or link if kind == "all_reduce" else link  # HSDP: across the replicas' link
            out[op.name] = getattr(over, kind)(n, rank.ranks(op.name)) + host_overhead
        elif op.name in rank.host_copies:  # CPU offload: `host_link.copy_time(bytes, direction)` (a HardwareProfile)
            direction, n = rank.host_copies[op.name]
            out[op.name] = (host_link.copy_time(n, direction) if host_link else 2 * n / copy_bandwidth) + host_overhead
        elif op.target in ("fsdp.free", "fsdp.end"):
            out[op.name] = 0.0
        elif op.target.startswith("fsdp."):
            moved = sum(g.tensors[t].size for t in op.outputs)
            if op.target == "fsdp.all_gather_copy_in":
                moved //= rank.ranks(op.name)
            out[op.name] = 2 * moved / copy_bandwidth + host_overhead
        else:
            out[op.name] = op_time.get(op.name, 0.0)
    return out


def step_time(rank: RankGraph, op_times: dict, *, overlap: bool = True) -> tuple[float, dict]:
    """(step seconds, busy seconds per stream): ops in the graph's order, each on its stream when that is free
    and what it reads is ready; a collective holds its buffers until it ends (FSDP's waits on its events). With
    `overlap` False (gloo on a CPU: collectives block the process) every op runs on one stream."""
    free = dict.fromkeys(STREAMS, 0.0)
    busy = dict.fromkeys(STREAMS, 0.0)
    ready: dict[str, float] = {}
    for op in rank.graph.ops:
        s = rank.stream[op.name] if overlap else COMPUTE
        start = max([free[s]] + [ready.get(t, 0.0) for t in op.inputs])
        end = start + op_times.get(op.name, 0.0)
        free[s] = end
        busy[rank.stream[op.name]] += end - start if op_times.get(op.name, 0.0) else 0.0
        for t in op.outputs:
            ready[t] = end
        if rank.stream[op.name] != COMPUTE:
            for t in op.inputs:
                ready[t] = max(ready.get(t, 0.0), end)
    return max(free.values()), busy
