"""One reading of a step program: its instructions in order, checked, with the device's bytes counted once.

`Walker(graph, hooks)` goes through a program (`walk`, or one `step` at a time as a builder does: Checkmate's
`ScheduleBuilder` is the model). It knows which tensors are on the device, which have a copy on the host,
which device copies are retired (held until freed while their copy to the host may be under way; no op reads
them), which ops have run, and the bytes held (`level`, `peak`: the graph's sizes, what is resident all step
included). An instruction that does not fit refuses the program (`ProgramFault`, naming its line). After each
instruction it calls its verb's hook on `hooks` (`Hooks.on_<verb>`): the simulator's traced run builds its
program through a walker, and the policy check, the allocator replay, the runtime's code generation and the
pricing of timed steps are hooks on one.

A new verb (a collective `all_gather`, say) is a `Verb` member (base/program.py), its method `_all_gather`
here (what it needs, what it changes), a no-op `Hooks.on_all_gather`, and an override in each consumer that
cares. No torch here.
"""
from __future__ import annotations

from typing import NamedTuple

from gaswap.base.errors import GaswapError
from gaswap.base.program import Instruction, Verb
from gaswap.plan.graph import Graph, Op


class ProgramFault(GaswapError, ValueError):
    """An instruction that does not fit the program's state where it stands."""

    def __init__(self, line: int, instruction: Instruction, problem: str):
        super().__init__(f"program line {line} ({instruction}): {problem}")
        self.line, self.instruction, self.problem = line, instruction, problem


class Hooks:
    """What a consumer of a walk overrides: one method per verb, called once the instruction is checked and
    applied (the walker's state is after it). `k` is the instruction's index in the program."""

    def on_run(self, k: int, op: Op, made: list[str]) -> None:
        """`op` ran; `made`: its outputs (all of them: an op runs once)."""

    def on_recompute(self, k: int, op: Op, made: list[str]) -> None:
        """`op` ran again; `made`: the outputs that were not on the device (the others are made and dropped)."""

    def on_swap_out(self, k: int, tensor: str) -> None:
        """A copy of `tensor` to the host starts (its device copy stays)."""

    def on_retire(self, k: int, tensor: str) -> None:
        """`tensor`'s device copy is retired: held, unreadable, until a `free` of it."""

    def on_swap_in(self, k: int, tensor: str) -> None:
        """`tensor` is allocated on the device and copied back."""

    def on_free(self, k: int, tensor: str, retired: bool) -> None:
        """A device copy of `tensor` goes: its oldest retired one if `retired`, else the one ops read."""


class Layout(NamedTuple):
    """What a walker reads of a graph, once per graph (`Layout.of`): op name -> index, counted tensor bytes,
    the tensors on the device when the step starts, and the bytes resident all step."""

    ops: dict[str, int]
    size: dict[str, int]
    resident: frozenset[str]
    resident_bytes: int

    @classmethod
    def of(cls, graph: Graph) -> "Layout":
        return cls(graph.op_index(), {t: x.size if graph.counts(x) else 0 for t, x in graph.tensors.items()},
                   frozenset(t for t, x in graph.tensors.items() if x.producer is None), graph.resident_bytes())


class Walker:
    """The state of a program read so far (see the module): `device`, `host`, `retired` (tensor -> retired
    copies), `ran` (ops in the order they first ran), `level` and `peak` (bytes), `program` (what was read).
    `layout`: `Layout.of(graph)`, when the caller walks many programs of one graph."""

    def __init__(self, graph: Graph, hooks: Hooks | None = None, layout: Layout | None = None):
        self.graph, self.hooks = graph, hooks or Hooks()
        layout = layout or Layout.of(graph)
        self.ops, self.size = layout.ops, layout.size
        self.device = set(layout.resident)
        self.host: set[str] = set()
        self.retired: dict[str, int] = {}
        self.ran: list[str] = []
        self.done: set[str] = set()
        self.level = self.peak = layout.resident_bytes
        self.program: list[Instruction] = []
        self.verbs = {verb: (getattr(self, "_" + verb.value), getattr(self.hooks, "on_" + verb.value)) for verb in Verb}

    def walk(self, program) -> "Walker":
        """Read every instruction of `program` ((verb, name) pairs); returns the walker."""
        for instruction in program:
            self.step(instruction)
        return self

    def step(self, instruction) -> None:
        """Read one instruction: check it, apply it, call its hook; ProgramFault if it does not fit."""
        verb, name = instruction
        if type(instruction) is not Instruction or type(verb) is not Verb:  # a (verb, name) pair, of strings or not
            instruction = Instruction(Verb(verb), name)
        k = len(self.program)
        self.program.append(instruction)
        apply, hook = self.verbs[instruction.verb]
        hook(k, *apply(name))
        if self.level > self.peak:
            self.peak = self.level

    def unfreed(self) -> list[str]:
        """Tensors made in the step and still held (on the device or retired), but for the gradients and the
        loss, which live to the step's end."""
        graph = self.graph
        return sorted(t for t in self.device | self.retired.keys() if graph.tensors[t].producer is not None
                      and graph.tensors[t].kind != "grad" and t != graph.loss)

    # --- one method per verb: check, apply, and return the hook's arguments after `k` ---

    def _run(self, name: str) -> tuple:
        op = self._op(name)
        if name in self.done:
            self.fault(f"runs {name} a second time")
        self._inputs_present(op)
        self.done.add(name)
        self.ran.append(name)
        return op, self._make(op)

    def _recompute(self, name: str) -> tuple:
        op = self._op(name)
        if name not in self.done or op.phase != "fwd" or not op.recomputable:
            self.fault(f"{name} cannot be recomputed there (not yet run, a backward op, random or stateful)")
        self._inputs_present(op)
        return op, self._make(op)

    def _swap_out(self, name: str) -> tuple:
        self._need(name in self.device, name)
        self.host.add(name)
        return (name,)

    def _retire(self, name: str) -> tuple:
        self._need(name in self.device and name in self.host, name)
        self.device.remove(name)
        self.retired[name] = self.retired.get(name, 0) + 1
        return (name,)

    def _swap_in(self, name: str) -> tuple:
        self._need(name in self.host and name not in self.device, name)
        self.device.add(name)
        self.level += self.size[name]
        return (name,)

    def _free(self, name: str) -> tuple:
        retired = name in self.retired  # the oldest retired copy goes first (its copy to the host has landed)
        self._need(retired or name in self.device, name)
        if retired:
            self.retired[name] -= 1
            if not self.retired[name]:
                del self.retired[name]
        else:
            self.device.remove(name)
        self.level -= self.size[name]
        return name, retired

    # --- checks ---

    def _op(self, name: str) -> Op:
        if name not in self.ops:
            self.fault(f"this graph has no op {name!r}")
        return self.graph.ops[self.ops[name]]

    def _inputs_present(self, op: Op) -> None:
        missing = [t for t in op.inputs if t not in self.device]
        if missing:
            self.fault(f"reads {missing[0]}, which the program has not kept, swapped in or recomputed")

    def _make(self, op: Op) -> list[str]:
        """Put the outputs of `op` that are not on the device there; returns them."""
        made, device = [], self.device
        for t in op.outputs:
            if t not in device:
                made.append(t)
                device.add(t)
                self.level += self.size[t]
        return made

    def _need(self, ok: bool, name: str) -> None:
        if not ok:
            self.fault(f"{name!r} is not where this instruction needs it")

    def fault(self, problem: str) -> None:
        """Refuse the instruction being read."""
        raise ProgramFault(len(self.program), self.program[-1], problem)
