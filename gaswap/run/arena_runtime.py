"""A policy's step run with its activations in one preallocated buffer, at the offsets `arena.plan` gives.

`ArenaRunner` is a `StepRunner` whose generated code puts each activation the program makes and frees
within the step into its slot of one buffer made when the runner is built (a device buffer on CUDA, a
host buffer on the CPU: the same code): an op with an out= overload of the same arguments writes into
its slots (`torch.ops.aten.<op>.out`), any other op's result is copied into its slot (`copy_`: a
transient the size of the output, outside the arena), and a swap-in lands in its slot. An out= overload
with a kernel for the device writes in place ("out"); one that PyTorch implements for every device as the
op then a copy ("out_composite": `convolution.out`, `relu.out`, ...) makes the same transient inside. What the runner
returns (loss, gradients; with loss "external" the model's output) and what an op re-makes and drops at
once are not placed: they come from the allocator as before. With `results_in_arena`, the loss and the
gradients are placed too, sharing memory with activations dead by then as the plan has it, and are valid
until the next step (a caller that drops them first, as `validate` does, gets the planned arena alone);
the model's output of loss "external" never is. `placed` says how each op was placed.
The hot path of the plain `StepRunner` is unchanged: the placement is decided when the code is written.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gaswap.plan.memory import arena
from gaswap.run.capture import Captured
from gaswap.run.runtime import StepRunner, Codegen


class ArenaRunner(StepRunner):
    """`StepRunner(captured, program, device, streams)` with the step's activations in one buffer.

    `plan` is the arena plan (`arena.plan(..., activations_only=True)`), `buffer` the arena (`plan.size`
    bytes), `placed` the ops by how their outputs reach their slots: "out" (an out= kernel of the device),
    "out_composite" (an out= overload with no kernel for the device: PyTorch's generic one makes the result,
    then copies it), "copy" (the result copied in here) and, for swap-ins, "swap_in"."""

    def __init__(self, captured: Captured, program, device="cpu", streams=None, *, results_in_arena: bool = False):
        self.results_in_arena = results_in_arena
        super().__init__(captured, program, device, streams)

    def _compile(self) -> tuple[str, dict]:
        self.plan = arena.plan(self.graph, self, activations_only=True, results=self.results_in_arena,
                               exclude=self._returned())
        self.buffer = arena_buffer(self.plan, self.device)
        self.slots: dict[tuple[int, str], torch.Tensor] = {}
        for p in self.plan.placements:
            val = self.nodes[p.tensor].meta["val"]
            self.slots[p.instruction, p.tensor] = carve(self.buffer, p.offset, val.shape, val.dtype, val.stride())
        self.placed: dict[str, list[str]] = {"out": [], "out_composite": [], "copy": [], "swap_in": []}
        return _ArenaCodegen(self).compile()

    def _returned(self) -> set[str]:
        """The tensors the step hands back, or views of which it hands back: they must outlive the step (with
        `results_in_arena`, only the model's output of loss "external", which the caller holds while the
        backward part runs)."""
        out, seen = set(), set()

        def visit(node) -> None:
            if not isinstance(node, fx.Node) or node.name in seen:
                return
            seen.add(node.name)
            if node.name in self.graph.tensors:
                out.add(node.name)
            if node.op == "call_function" and node.name not in self.ops:  # a view: its bases
                for a in node.all_input_nodes:
                    visit(a)

        handed = self.results if not self.results_in_arena else self.results[:1] if self.grad_output else []
        for node in handed:
            visit(node)
        return out


class _ArenaCodegen(Codegen):
    """The runner's code with each placed tensor written into its slot (a global of the code)."""

    def slot(self, tensor: str) -> str | None:
        carved = self.r.slots.get((self.at, tensor))
        return None if carved is None else self.constant(carved, f"{tensor}_slot")

    def on_swap_in(self, k: int, name: str) -> None:
        if (k, name) in self.r.slots:
            self.r.placed["swap_in"].append(name)
        super().on_swap_in(k, name)

    def store(self, node: fx.Node, call: str, new: list, dropped: list[str]) -> None:
        slots = {out: self.slot(out) for _, out in new}
        if not any(slots.values()):
            return super().store(node, call, new, dropped)
        val, variant = node.meta["val"], out_variant(node.target)
        results = [(None, val)] if isinstance(val, torch.Tensor) else list(enumerate(val))
        if variant is not None and len(variant[1]) == len(results) and all(isinstance(v, torch.Tensor) for _, v in
                                                                            results):
            overload, names, accepted = variant
            made = dict(new)  # index -> tensor name, for the outputs the program keeps
            outs = []
            for i, v in results:  # a slot, else a new tensor like the op's own (kept, or dropped after the op)
                slot = slots.get(made.get(i))
                if slot is None:
                    slot = self.local(made[i]) if i in made else self.fresh(f"{node.name}_{i}")
                    empty = self.constant(torch.empty_strided, "empty_strided")
                    self.emit(f"{slot} = {empty}({self.arg(tuple(v.shape))}, {self.arg(tuple(v.stride()))}, "
                              f"dtype={self.arg(v.dtype)}, device={self.arg(self.r.device)})")
                    if i not in made:
                        dropped.append(slot)
                outs.append(slot)
            args = [self.arg(a) for a in node.args]
            args += [f"{k}={self.arg(v)}" for k, v in node.kwargs.items() if k in accepted]
            args += [f"{name}={slot}" for name, slot in zip(names, outs)]
            self.emit(f"{self.constant(overload, str(overload))}({', '.join(args)})")
            has = torch._C._dispatch_has_kernel_for_dispatch_key  # a device kernel, or one made of other ops
            native = has(overload.name(), _DISPATCH_KEYS.get(self.r.device.type, "CPU")) or \
                has(overload.name(), "CompositeImplicitAutograd")
            self.r.placed["out" if native else "out_composite"].append(node.name)
        else:  # the op makes its result; the outputs with a slot are copied into it
            result = self.fresh(node.name + "_result")
            self.emit(f"{result} = {call}")
            for i, out in new:
                item = result if i is None else f"{result}[{i}]"
                if slots[out] is None:
                    self.emit(f"{self.local(out)} = {item}")
                else:
                    self.emit(f"{slots[out]}.copy_({item})")
            self.r.placed["copy"].append(node.name)
            dropped.append(result)
        for _, out in new:
            if slots[out] is not None:
                self.emit(f"{self.local(out)} = {slots[out]}")


_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}  # an out= kernel registered for the device: no copy inside
_OUT_VARIANTS: dict = {}
# A factory op's out= overload takes no tensor options: the out tensor has them (its slot, or a tensor made alike).
OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory", "memory_format"})


def out_variant(op) -> tuple[torch._ops.OpOverload, list[str], frozenset] | None:
    """The out= overload of ATen op `op` taking the same arguments (names and types; tensor options aside), its out
    arguments' names in the order of the results, and the names of the arguments it takes; None if none."""
    if op not in _OUT_VARIANTS:
        _OUT_VARIANTS[op] = _find_out_variant(op)
    return _OUT_VARIANTS[op]


def _find_out_variant(op):
    if not isinstance(op, torch._ops.OpOverload):
        return None
    signature = [(a.name, str(a.type)) for a in op._schema.arguments if a.name not in OPTIONS]
    packet = op.overloadpacket
    for name in packet.overloads():
        overload = getattr(packet, name)
        arguments = overload._schema.arguments
        outs = [a.name for a in arguments if a.is_out]
        if outs and [(a.name, str(a.type)) for a in arguments if not a.is_out and a.name not in OPTIONS] == signature:
            return overload, outs, frozenset(a.name for a in arguments if not a.is_out)
    return None


class OutsideArena(TorchDispatchMode):
    """While active, counts the storages ATen ops make outside `buffer` (an arena): `bytes` and `count` in all,
    and `by_op` (op name -> bytes). A storage is counted once, when an op first returns it; what views,
    in-place and out= ops return is not new memory. Like any dispatch mode (and `DeviceMemory` on the CPU) it
    sees the ops the step calls, not what runs inside them: the transient of an "out_composite" op is not
    counted (on a GPU, `max_memory_reserved` sees it)."""

    def __init__(self, buffer: torch.Tensor):
        super().__init__()
        self.arena = buffer.untyped_storage().data_ptr()
        self.bytes = self.count = 0
        self.by_op: dict[str, int] = {}
        self._seen: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # a view, in-place or out= op: no new memory
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                seen = ref.cdata in self._seen and not self._seen[ref.cdata].expired()
                if storage.data_ptr() == self.arena or seen:
                    continue
                self._seen[ref.cdata] = ref
                self.bytes += storage.nbytes()
                self.count += 1
                self.by_op[str(func)] = self.by_op.get(str(func), 0) + storage.nbytes()
        return out


def arena_figures(runner: ArenaRunner) -> dict:
    """What a report says of a runner's arena: its bytes and bound, and how the ops reached their slots."""
    return {"bytes": runner.plan.size, "lower_bound_bytes": runner.plan.lower_bound,
            "placed": len(runner.plan.placements), "ops_out": len(runner.placed["out"]),
            "ops_out_composite": sorted({str(runner.nodes[n].target) for n in runner.placed["out_composite"]}),
            "ops_copied": sorted({str(runner.nodes[n].target) for n in runner.placed["copy"]}),
            "largest_transient_bytes": max((_result_bytes(runner.nodes[n]) for n in
                                            runner.placed["copy"] + runner.placed["out_composite"]), default=0),
            "swap_ins": len(runner.placed["swap_in"])}


def _result_bytes(node: fx.Node) -> int:
    """Bytes of the tensors an op returns (what an op copied into its slots makes outside the arena first)."""
    val = node.meta["val"]
    return sum(v.untyped_storage().nbytes() for v in ([val] if isinstance(val, torch.Tensor) else val)
               if isinstance(v, torch.Tensor))


def arena_buffer(plan: arena.ArenaPlan, device="cpu"):
    """One byte buffer the size of the arena, on `device` (a host buffer on the CPU: the same code path)."""
    return torch.empty(plan.size, dtype=torch.uint8, device=device)


def carve(buffer, offset: int, shape, dtype, stride=None):
    """A tensor of `shape`/`dtype` (and `stride`, default contiguous) viewing `buffer` from `offset`."""
    stride = tuple(stride) if stride is not None else torch.empty(shape, device="meta").stride()
    numel = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    nbytes = numel * torch.empty((), dtype=dtype, device="meta").element_size()
    if offset % arena.ALIGNMENT or offset + nbytes > buffer.numel():
        raise ValueError(f"cannot carve {nbytes} bytes at offset {offset} from a {buffer.numel()}-byte arena")
    return buffer[offset:offset + nbytes].view(dtype).as_strided(tuple(shape), stride)
