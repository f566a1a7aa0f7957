"""Operator order and buffer reuse for compiled policies: what inductor is told beyond what the forward saves.

Inductor lowers a graph's nodes in the graph's order, fuses them, then (`reorder_for_peak_memory`, on by
default) keeps the order of least peak by its own estimate among the fused graph's order and three
heuristics of its own, ties to the graph's order; an order given to the graph is thus honoured where that
estimate finds it no worse. `OrderPass(name)` is an inductor post-grad pass
(`torch._inductor.config.post_grad_custom_post_pass`) that re-orders the forward and the backward graph by
one of `ORDERS` before inductor lowers them; a node with side effects (an in-place buffer update) stays
between the nodes before and after it.

Its wrapper then hands a freed buffer to a later allocation of the same size (`# reuse`) where its estimate
says that raises no peak; the estimate is not the program's, and a buffer held for reuse can raise the
program's peak. `options(order, buffer_reuse=False)` frees each buffer after its last reader instead.

Measured on the five CPU compare experiments (`scripts/compiled_order.py`, results/compiled_order/): demand_first
lowers window's lowest gaswap policy by 4.9 % (the meter agrees to the byte, gradients bitwise equal), buffer
reuse off torch's 0.2 partitions of window and mixture by 4.3 and 3.4 %; nothing moves the other peaks, each
held by one kernel's working set or by what the forward saved.
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.multiprocessing.reductions import StorageWeakRef

from gaswap.compiled.programs import RESIDENT_PREFIX


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def _storages(node: fx.Node) -> list:
    return [StorageWeakRef(t.untyped_storage()) for t in _tensors(node.meta.get("val"))]


class _Memory:
    """The storages each node allocates and reads (a view reads its base's), and their bytes."""

    def __init__(self, nodes: list[fx.Node]):
        self.size, self.made, self.read, self.readers = {}, {}, {}, {}
        for node in nodes:
            self.made[node] = []
            for key, t in zip(_storages(node), _tensors(node.meta.get("val"))):
                if key not in self.size:
                    self.size[key] = t.untyped_storage().nbytes()
                    if node.op != "placeholder":
                        self.made[node].append(key)
        for node in nodes:
            self.read[node] = {key for arg in node.all_input_nodes for key in _storages(arg)}
            for key in self.read[node]:
                self.readers.setdefault(key, set()).add(node)


def memory_greedy(nodes: list[fx.Node], memory: _Memory, kept: set) -> list[fx.Node]:
    """At each step the ready node that adds the fewest bytes (allocated less freed), the earlier in the
    graph's order on a tie (OLLA's and SwapAdvisor's greedy rule). `kept`: storages never freed here (the
    graph's outputs, parameters and the batch)."""
    index = {n: k for k, n in enumerate(nodes)}
    inside = set(nodes)
    waiting = {n: len(set(n.all_input_nodes) & inside) for n in nodes}
    pending = {key: len(readers & inside) for key, readers in memory.readers.items()}

    def added(n: fx.Node) -> int:
        freed = sum(memory.size[k] for k in memory.read[n] if pending.get(k) == 1 and k not in kept)
        return sum(memory.size[k] for k in memory.made[n]) - freed

    ready, order = {n for n in nodes if waiting[n] == 0}, []
    while ready:
        node = min(ready, key=lambda n: (added(n), index[n]))
        ready.remove(node)
        order.append(node)
        for key in memory.read[node]:
            pending[key] -= 1
        for user in set(node.users) & inside:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.add(user)
    return order


def _post_order(nodes: list[fx.Node], roots: list[fx.Node], edges: Callable) -> list[fx.Node]:
    """Depth-first post-order from `roots` along `edges`, within `nodes`."""
    inside, seen, out = set(nodes), set(roots), []
    stack = [(root, iter(edges(root))) for root in reversed(roots)]
    while stack:
        node, it = stack[-1]
        nxt = next((m for m in it if m in inside and m not in seen), None)
        if nxt is None:
            stack.pop()
            out.append(node)
        else:
            seen.add(nxt)
            stack.append((nxt, iter(edges(nxt))))
    return out


def demand_first(nodes: list[fx.Node], memory: _Memory, kept: set) -> list[fx.Node]:
    """Depth-first from the last values back to what they read, each value made just before the first that
    needs it: the graph's outputs, and each node's inputs, in their order."""
    inside = set(nodes)
    return _post_order(nodes, [n for n in nodes if not set(n.users) & inside], lambda n: n.all_input_nodes)


def demand_last(nodes: list[fx.Node], memory: _Memory, kept: set) -> list[fx.Node]:
    """`demand_first`, outputs and inputs visited last to first."""
    inside = set(nodes)
    return _post_order(nodes, [n for n in nodes if not set(n.users) & inside][::-1],
                       lambda n: n.all_input_nodes[::-1])


def reverse_post_order(nodes: list[fx.Node], memory: _Memory, kept: set) -> list[fx.Node]:
    """Reverse post-order of a depth-first walk along users from the nodes that read only graph inputs (the
    first of them ends up first): each chain of values followed as far as it goes before the next."""
    inside = set(nodes)
    sources = [n for n in nodes if not set(n.all_input_nodes) & inside][::-1]
    return _post_order(nodes, sources, lambda n: list(n.users)[::-1])[::-1]


ORDERS: dict[str, Callable] = {"greedy": memory_greedy, "demand_first": demand_first, "demand_last": demand_last,
                               "rpo": reverse_post_order}


def reorder(graph: fx.Graph, name: str) -> None:
    """Re-order `graph`'s nodes by `ORDERS[name]`: placeholders stay first, the output last, a node with side
    effects between the nodes before and after it."""
    nodes = list(graph.nodes)
    memory = _Memory(nodes)
    kept = {key for node in nodes if node.op == "output" for key in memory.read[node]} | {
        key for node in nodes if node.op == "placeholder" and node.name.startswith(RESIDENT_PREFIX)
        for key in _storages(node)}
    order, segment = [], []
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            order.append(node)
        elif node.op == "output" or node.is_impure():
            order += ORDERS[name](segment, memory, kept) if segment else []
            order.append(node)
            segment = []
        else:
            segment.append(node)
    if len(order) != len(nodes):
        raise AssertionError(f"order {name} placed {len(order)} of {len(nodes)} nodes")
    for before, node in pairwise(order):
        if before.next is not node:
            before.append(node)
    graph.lint()


class OrderPass(CustomGraphPass):
    """An inductor post-grad pass that re-orders each graph by `ORDERS[name]`."""

    def __init__(self, name: str):
        if name not in ORDERS:
            raise ValueError(f"unknown order {name!r}: one of {', '.join(ORDERS)}")
        self.name = name

    def __call__(self, graph: fx.Graph) -> None:
        reorder(graph, self.name)

    def uuid(self) -> str:
        """Inductor's cache key: the order's name and this module's code."""
        return f"{self.name}:{get_hash_for_files((__file__,)).hex()}"


def options(order: str | None = None, *, buffer_reuse: bool = True, realize_reads: int | None = None) -> dict:
    """Inductor options (`partition.backend(policy, **options(...))`, or compile_fx's `config_patches`) that
    compile the graphs in `order` (None: as partitioned), with or without inductor's reuse of freed buffers, and
    with a pointwise value read by more than `realize_reads` kernels written to memory rather than recomputed in
    each (inductor's `realize_reads_threshold`; None: its default, 4)."""
    out = {} if order is None else {"post_grad_custom_post_pass": OrderPass(order)}
    out |= {} if realize_reads is None else {"realize_reads_threshold": realize_reads}
    return out if buffer_reuse else out | {"allow_buffer_reuse": False}
