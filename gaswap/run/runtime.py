"""Run a captured training step under a policy, for real: the graph searched is the graph executed.

The simulator turns a policy into a program (`SimResult.program`, stored in the policy file): which op
runs next, which tensor is copied to the host or back, which is dropped. `StepRunner` compiles the program
into Python code over the captured fx graph (`runner.source`), one statement per instruction in program
order: an op is a call of its ATen target, a view it reads is rebuilt from its base just before the first
op that reads it and dropped with that base (so a tensor dropped by the program is really gone), a copy is
a call of the step's `_Copies`, a free is a `del`. There is no interpreter loop: a keep-all program costs
about what the captured graph costs run plainly (scripts/runtime_overhead.py measures it). Copies go through the
runner's streams (gaswap/run/streams.py): on CUDA one stream per direction, events and one pinned host arena
sized from the program; on the CPU the same code copies into a host arena at once.

Two forms: `apply` wraps a model whose policy was searched with loss "external" into a `PolicyModule`,
used like the model (`criterion(module(x), y).backward()`), the program split around the caller's loss;
`apply_step` runs a policy whose step includes the loss as one call, `loss = step(*inputs, target)`.
Both run on the device the model's parameters are on at each call, with autocast off (a policy's casts
are ops of its graph).
"""
from __future__ import annotations

import keyword
import linecache
import math
import operator
import re
import time
from dataclasses import dataclass

import torch
from torch import fx, nn

from gaswap.base.errors import GaswapError
from gaswap.base.program import OP_VERBS, Instruction, ProgramSyntaxError, Verb, parse_program
from gaswap.base.training_options import DEFAULT_LOSS, DEFAULT_OPTIMIZER
from gaswap.plan import policy as policies
from gaswap.plan.graph import COUNTABLE
from gaswap.plan.policy import Policy, PolicyError
from gaswap.plan.walker import Hooks, ProgramFault, Walker
from gaswap.run.capture import Captured, capture, tensor_outputs
from gaswap.run.step_memory import host_memory
from gaswap.run.streams import for_device

HOST_ALIGNMENT = 512  # bytes: each host buffer of a runner's arena starts at a multiple of this


class ProgramError(GaswapError, RuntimeError):
    """The program and the graph disagree (a tensor the program should have kept is missing)."""


def device_clock(device: torch.device):
    """The clock steps and ops are timed with on `device`: on a CPU the process's CPU time (all intra-op threads
    summed: steady while other processes share the cores, where wall time counts their turns too), on a GPU
    the wall time around a synchronized device (the kernels' time, which host load barely moves)."""
    return time.process_time if device.type == "cpu" else time.perf_counter


CLOCK_NAMES = {"cpu": "CPU time", "cuda": "wall time"}  # what `device_clock` reads, as cost caches record it


def indexed(device: torch.device) -> torch.device:
    """`device` with its index: "cuda" is the current CUDA device (its streams and tensors say "cuda:0")."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class StepRunner:
    """Runs `program` over `captured.gm` on `device`: `runner(args) -> (loss, *grads)`.

    The program is compiled when the runner is made; `source` is the code. Copies go through `streams`
    (default: `gaswap.run.streams.for_device(device)`), made once per runner, into host buffers carved from one
    arena made here. A step with loss "external" also runs in two parts, around a loss computed outside
    it: `output, state = runner.forward(args)`, then `grads = runner.backward(state, grad_output)`.
    """

    timed = False  # compile a clock around each instruction, into `_times` (measure._TimedRunner)

    def __init__(self, captured: Captured, program, device="cpu", streams=None):
        self.device = indexed(torch.device(device))
        gm = captured.gm if self.device.type == "cpu" else captured.gm_on(self.device)
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.results = list(gm.graph.output_node().args[0])
        self.graph = captured.graph
        self.ops = {op.name: op for op in captured.graph.ops}
        self.program = _parse(program)
        self._check_program()
        self.grad_output = next((name for name, kind, _ in captured.placeholders if kind == "grad_output"), None)
        self.split = self._split() if self.grad_output else None
        self.constants = {n.name: _attribute(gm, n.target).to(self.device) for n in gm.graph.nodes
                          if n.op == "get_attr"}
        self.streams = streams or for_device(self.device)
        self.host = self._host_buffers()
        self._times: list[list[float]] = [[] for _ in self.program]
        try:
            self.source, self._functions = self._compile()
        except ProgramFault as e:
            raise ProgramError(f"the policy's program does not fit this graph: {e}") from None

    def _compile(self) -> tuple[str, dict]:
        """The program's code and its functions (a subclass may place the tensors: gaswap.run.arena_runtime)."""
        return Codegen(self).compile()

    @torch.no_grad()  # the graph computes the gradients itself: autograd must not keep tensors alive
    def __call__(self, args: list):
        """Run one training step (host copies count as host memory for an active `DeviceMemory`).

        The step takes ownership of `args` (the list is emptied): an input the policy swaps out can only
        leave the device if nothing else holds it.
        """
        with self.streams.running(done=True):
            return self._functions["step"](args, _Copies(self.streams, self.host))

    @torch.no_grad()
    def forward(self, args: list) -> tuple[torch.Tensor, "StepState"]:
        """The forward part of a step with loss "external": the program up to the first instruction of
        the backward pass. Returns the model's output and the state `backward` continues from. `args` are
        those of `__call__`, the gradient of the output left out (None); the step takes ownership of them.
        """
        if self.grad_output is None:
            raise ProgramError("this step computes its own loss: run it whole (runner(args)), not in two parts")
        copies = _Copies(self.streams, self.host)
        with self.streams.running(done=False):  # copies may be in flight until the backward part
            output, env = self._functions["forward"](args, copies)
        return output, StepState(env, copies)

    @torch.no_grad()
    def backward(self, state: "StepState", grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rest of the step, from the gradient of the output: the gradients of the parameters.
        The state is used up (its tensors are released)."""
        grad_output = grad_output.contiguous()  # the layout it was traced with
        with self.streams.running(done=True):
            return self._functions["backward"](state.env, state.copies, grad_output)

    def _host_buffers(self) -> dict[str, torch.Tensor]:
        """A contiguous host buffer for each tensor the program swaps out, all carved from one arena (pinned
        on CUDA) made here, so that every step copies into the same memory."""
        starts, size = {}, 0
        for verb, name in self.program:
            if verb == Verb.SWAP_OUT and name not in starts:
                starts[name] = size
                val = self.nodes[name].meta["val"]
                size += -(-val.numel() * val.element_size() // HOST_ALIGNMENT) * HOST_ALIGNMENT
        buffers = {}
        with host_memory():  # a runner made during a tracked step (PolicyModule's first call) holds no device memory
            arena = self.streams.host_buffer(size) if starts else None
            for name, start in starts.items():
                val = self.nodes[name].meta["val"]
                buffers[name] = arena[start:start + val.numel() * val.element_size()].view(val.dtype).view(val.shape)
        return buffers

    def _check_program(self) -> None:
        runs = [name for verb, name in self.program if verb == Verb.RUN]
        bad = [f"{verb} {name}" for verb, name in self.program if verb in OP_VERBS and name not in self.ops]
        if bad or sorted(runs) != sorted(self.ops):
            detail = f"unknown steps {bad[:3]}" if bad else "it does not run every op of the graph exactly once"
            raise ProgramError(f"the policy's program does not fit this graph: {detail}")

    def _split(self) -> int:
        """Where the backward part of the program starts: after the last forward op has run and the frees and
        copies to the host that follow it, at the first instruction that computes or brings a tensor back."""
        last_forward = max(k for k, (verb, name) in enumerate(self.program)
                           if verb == Verb.RUN and self.ops[name].phase == "fwd")
        split = next((k for k in range(last_forward + 1, len(self.program))
                      if self.program[k].verb in (*OP_VERBS, Verb.SWAP_IN)), len(self.program))
        early = [name for verb, name in self.program[:split]
                 if verb == Verb.RUN and self.grad_output in self.ops[name].inputs]
        if early:
            raise ProgramError(f"the policy's program runs {early[0]}, which reads the gradient of the output, before "
                               f"the forward pass ends: it cannot run with the loss outside the step")
        return split


@dataclass
class StepState:
    """A step under way between its two parts: the tensors on the device (by local name) and the copies."""

    env: dict
    copies: "_Copies"


def _parse(program) -> list[Instruction]:
    try:
        return list(parse_program(program))
    except ProgramSyntaxError as e:
        raise ProgramError(f"the policy's program does not fit this graph: {e}") from None


def _attribute(gm: fx.GraphModule, target: str) -> torch.Tensor:
    """The value of a `get_attr` node (a tensor constant of the traced step)."""
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


class Codegen(Hooks):
    """Writes a runner's program as Python functions: `step(args, copies)` and, with loss "external",
    `forward(args, copies) -> (output, state)` and `backward(state, copies, grad_output)`.

    The hooks of a `Walker` over the program, which refuses a program that reads a tensor it does not have
    before anything runs. While writing, it knows the local variable of each tensor on the device (`live`)
    and of each retired copy (their copies to the host may be under way: held, but no op may read them),
    and which tensors were swapped in and not yet waited for."""

    def __init__(self, runner: StepRunner):
        self.r = runner
        self.taken = set(keyword.kwlist) | set(runner.nodes)  # node names are the locals of their values
        self.globals: dict[str, object] = {}
        self.global_of: dict[object, str] = {}  # value (or id of an unhashable one) -> its name in `globals`
        self.sent = {name for verb, name in runner.program if verb == Verb.SWAP_OUT}  # copied to the host
        self.copies, self.args, self.state = self.fresh("copies"), self.fresh("args"), self.fresh("state")
        self.unused, self.started = self.fresh("unused"), self.fresh("started")
        self.constants = {name: self.constant(value, name) for name, value in runner.constants.items()}
        self.locals: dict[str, str] = {}  # tensor name -> local variable
        self.lines: list[str] = []
        self.live: dict[str, str] = {}
        self.retired: dict[str, list[str]] = {}  # a tensor re-made while its first copy waits is retired twice
        self.pending: set[str] = set()
        self.cached: dict[str, set[str]] = {}  # a view rebuilt and kept -> the tensors it is a view of
        self.walker: Walker | None = None  # the program read so far, in the function being written (`begin`)
        self.at = -1  # the index in the program of the instruction being written

    def compile(self) -> tuple[str, dict]:
        """The source, and its functions by name."""
        r = self.r
        self.begin("step", r.placeholders)
        self.run(r.program)
        self.end(r.results)
        if r.grad_output is not None:  # the output, then the gradients
            self.begin("forward", [name for name in r.placeholders if name != r.grad_output])
            self.run(r.program[:r.split])
            self.suspend()
            self.run(r.program[r.split:])
            self.end(r.results[1:])
        source = "\n".join(self.lines) + "\n"
        filename = f"<gaswap program {id(self):x}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
        namespace = dict(self.globals)
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - the code written above
        return source, {name: namespace[name] for name in ("step", "forward", "backward") if name in namespace}

    # --- functions ---------------------------------------------------------------------------------

    def begin(self, function: str, live: list[str]) -> None:
        """`def function(args, copies):`, taking the placeholders in `live` from `args` (then emptied); the
        program is read again from its start."""
        self.walker = Walker(self.r.graph, self)
        self.live = {name: self.local(name) for name in live} | self.constants
        self.retired, self.pending, self.cached = {}, set(), {}
        self.emit(f"def {function}({self.args}, {self.copies}):", indent=0)
        names = [self.live.get(name, self.unused) for name in self.r.placeholders]
        self.emit(f"({', '.join(names)},) = {self.args}")
        self.emit(f"{self.args}.clear()")

    def suspend(self) -> None:
        """End `forward` returning the output and the tensors held, and begin `backward` taking them back."""
        output, held = self.r.results[0], self.held()
        self.views([output])
        self.emit(f"return {self.arg(output)}, {{{', '.join(f'{h!r}: {h}' for h in held)}}}")
        self.emit("")
        grad = self.local(self.r.grad_output)
        self.emit(f"def backward({self.state}, {self.copies}, {grad}):", indent=0)
        for h in held:
            self.emit(f"{h} = {self.state}[{h!r}]")
        self.emit(f"{self.state}.clear()")
        self.live[self.r.grad_output] = grad
        self.cached = {}  # forward's locals

    def end(self, results: list) -> None:
        """Wait for the copies and return `results`."""
        self.emit(f"{self.copies}.finish()")
        self.views(results)
        self.emit(f"return ({''.join(self.arg(n) + ', ' for n in results)})")
        self.emit("")

    def held(self) -> list[str]:
        constants = set(self.constants.values())
        retired = [v for copies in self.retired.values() for v in copies]
        return [v for v in (*self.live.values(), *retired) if v not in constants]

    # --- instructions ------------------------------------------------------------------------------

    def run(self, program: list[Instruction]) -> None:
        """Write `program`, the next instructions of the walk, through the hooks below."""
        for instruction in program:
            if self.r.timed:
                self.clock()
            self.at = len(self.walker.program)
            self.walker.step(instruction)
            if self.r.timed:
                self.clock(self.r._times[self.at])

    def clock(self, times: list | None = None) -> None:
        """Read the clock (the device synchronized): start an instruction, or append its seconds to `times`."""
        if self.r.device.type == "cuda":
            sync, device = self.constant(torch.cuda.synchronize, "synchronize"), self.constant(self.r.device, "device")
            self.emit(f"{sync}({device})")
        now = f"{self.constant(device_clock(self.r.device), 'clock')}()"
        if times is None:
            self.emit(f"{self.started} = {now}")
        else:
            self.emit(f"{self.constant(times, 'times')}.append({now} - {self.started})")

    def on_run(self, k: int, op, made: list[str]) -> None:
        """Run (or re-run) an op: wait for inputs being copied in, rebuild the views it reads (kept for later
        readers until what they are views of goes), call it, keep the outputs in `made` (those not on the
        device already)."""
        node = self.r.nodes[op.name]
        for t in op.inputs:
            if t in self.pending:
                self.emit(f"{self.copies}.wait_for({t!r})")
                self.pending.discard(t)
        self.views(node.all_input_nodes)
        dropped: list[str] = []  # locals to drop after the op
        call, val = self.call(node), node.meta.get("val")
        if isinstance(val, torch.Tensor):
            outputs = [(None, node.name)]
        elif isinstance(val, (tuple, list)):
            indices = [i for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
            outputs = list(zip(indices, (out for out, _ in tensor_outputs(node, val))))
        else:
            outputs = []
        new = [(i, out) for i, out in outputs if out in made]
        self.store(node, call, new, dropped)
        for _, out in new:
            self.live[out] = self.local(out)
        if dropped:
            self.emit(f"del {', '.join(dropped)}")

    on_recompute = on_run

    def store(self, node: fx.Node, call: str, new: list, dropped: list[str]) -> None:
        """Write the op's call, keeping the outputs in `new` ((index in its result or None, tensor name)) in
        their locals; a local to drop after the op goes into `dropped`."""
        if not new:
            self.emit(call)
        elif len(new) == 1:
            (i, out), = new
            self.emit(f"{self.local(out)} = {call}" + ("" if i is None else f"[{i}]"))
        else:
            self.emit(f"{node.name} = {call}")
            for i, out in new:
                self.emit(f"{self.local(out)} = {node.name}[{i}]")
            dropped.append(node.name)

    def slot(self, tensor: str) -> str | None:
        """The expression of the memory the current instruction's `tensor` goes into (None: a new tensor)."""
        return None

    def on_swap_out(self, k: int, name: str) -> None:
        self.emit(f"{self.copies}.to_host({name!r}, {self.live[name]})")

    def on_retire(self, k: int, name: str) -> None:
        """No op reads `name` any more; its memory is held until it is freed (its copy may be under way)."""
        local, retired = self.live[name], self.fresh(name + "_retired")
        self.emit(f"{retired} = {local}")
        self.emit(f"del {local}")
        del self.live[name]
        self.retired.setdefault(name, []).append(retired)
        self.drop_views_of(name)

    def on_swap_in(self, k: int, name: str) -> None:
        into = self.slot(name)
        self.emit(f"{self.local(name)} = {self.copies}.to_device({name!r}{'' if into is None else ', ' + into})")
        self.live[name] = self.local(name)
        self.pending.add(name)

    def on_free(self, k: int, name: str, retired: bool) -> None:
        """Drop `name` (its oldest retired copy if `retired`); compute first waits for the copies that use it."""
        if retired:
            local = self.retired[name].pop(0)
        else:
            local = self.live[name]
            del self.live[name]
            if name in self.pending:  # swapped in and never read: its copy must land before its memory goes
                self.emit(f"{self.copies}.wait_for({name!r})")
                self.pending.discard(name)
        if name in self.sent:
            self.emit(f"{self.copies}.release({name!r})")
        if name not in self.constants:
            self.emit(f"del {local}")
        self.drop_views_of(name)

    def drop_views_of(self, name: str) -> None:
        """Drop the kept views of `name`, which is gone from the device: a view holds its memory."""
        gone = [view for view, bases in self.cached.items() if name in bases]
        for view in gone:
            del self.cached[view]
        if gone:
            self.emit(f"del {', '.join(gone)}")

    # --- expressions -------------------------------------------------------------------------------

    def views(self, nodes) -> None:
        """Write the values of `nodes` that are not on the device, views rebuilt from their bases (and the
        views those read) unless kept from an earlier reader; they are kept (`cached`) until a tensor they are
        views of goes (`drop_views_of`)."""
        order, bases = [], {}

        def visit(node: fx.Node) -> set[str]:  # the tensors on the device its value is a view of
            if node.name in self.live:
                return {node.name}
            if node.name in self.cached:
                return self.cached[node.name]
            if node.name in bases:
                return bases[node.name]
            if node.op != "call_function" or node.name in self.r.ops:
                raise ProgramError(f"{node.name} is needed but is not on the device")
            bases[node.name] = set().union(*(visit(a) for a in node.all_input_nodes))
            order.append(node)
            return bases[node.name]

        for node in nodes:
            if isinstance(node, fx.Node):
                visit(node)
        for node in order:
            self.emit(f"{node.name} = {self.call(node)}")
            self.cached[node.name] = bases[node.name]

    def call(self, node: fx.Node) -> str:
        if node.target is operator.getitem:
            return f"{self.arg(node.args[0])}[{self.arg(node.args[1])}]"
        target = node.target
        name = str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", "op")
        args = [self.arg(a) for a in node.args] + [f"{k}={self.arg(v)}" for k, v in node.kwargs.items()]
        return f"{self.constant(target, name)}({', '.join(args)})"

    def arg(self, a) -> str:
        if isinstance(a, fx.Node):
            return self.live.get(a.name, a.name)
        if isinstance(a, list):
            return f"[{', '.join(self.arg(x) for x in a)}]"
        if isinstance(a, tuple):
            return f"({''.join(self.arg(x) + ', ' for x in a)})"
        if a is None or isinstance(a, (bool, int, str)) or (isinstance(a, float) and math.isfinite(a)):
            return repr(a)
        return self.constant(a, type(a).__name__)

    # --- names -------------------------------------------------------------------------------------

    def emit(self, line: str, indent: int = 4) -> None:
        self.lines.append(" " * indent + line if line else "")

    def fresh(self, hint: str) -> str:
        """An identifier like `hint` that nothing else uses."""
        name = re.sub(r"\W", "_", hint)
        name = name if name and not name[0].isdigit() else "_" + name
        while name in self.taken:
            name += "_"
        self.taken.add(name)
        return name

    def local(self, tensor: str) -> str:
        """The local variable of a tensor: its node's name if it is one, else a fresh identifier."""
        if tensor not in self.locals:
            own = tensor in self.r.nodes and tensor.isidentifier() and not keyword.iskeyword(tensor)
            self.locals[tensor] = tensor if own else self.fresh(tensor)
        return self.locals[tensor]

    def constant(self, value, hint: str) -> str:
        """A global of the generated code holding `value` (one per distinct value)."""
        try:
            key = (type(value), value, hash(value))
        except TypeError:  # unhashable: one global per object
            key = id(value)
        if key not in self.global_of:
            self.global_of[key] = name = self.fresh(hint)
            self.globals[name] = value
        return self.global_of[key]


class _Copies:
    """One step's copies between the device and the runner's host buffers, ordered by the streams' events:
    a copy to the host waits for compute (the tensor has been made); a copy back is allocated on compute,
    then waits for compute (its memory may be some compute has just freed) and for the copy to the host;
    compute waits for a copy back before reading or freeing it, and for a copy to the host before freeing
    the tensor it reads."""

    def __init__(self, streams, host: dict[str, torch.Tensor]):
        self.streams, self.host = streams, host
        self.layouts: dict[str, tuple] = {}  # name -> (shape, stride, dtype, device) on the device
        self.saved: dict[str, object] = {}  # name -> event: the copy to the host has landed
        self.landed: dict[str, object] = {}  # name -> event: the copy to the device has landed

    def to_host(self, name: str, t: torch.Tensor) -> None:
        s = self.streams
        s.wait_stream(s.d2h, s.compute())
        s.copy(s.d2h, self.host[name], t)
        self.saved[name] = s.record(s.d2h)
        self.layouts[name] = (t.shape, t.stride(), t.dtype, t.device)

    def to_device(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """Copy `name` back to the device: into a new tensor, or `into` (a runner's arena slot)."""
        s = self.streams
        shape, stride, dtype, device = self.layouts[name]
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device) if into is None else into  # compute's memory
        s.wait_stream(s.h2d, s.compute())
        s.wait_event(s.h2d, self.saved[name])
        s.copy(s.h2d, t, self.host[name])
        self.landed[name] = s.record(s.h2d)
        return t

    def wait_for(self, name: str) -> None:
        """Before compute reads `name`: wait for its copy to the device, if one is in flight."""
        event = self.landed.pop(name, None)
        if event is not None:
            self.streams.wait_event(self.streams.compute(), event)

    def release(self, name: str) -> None:
        """Before a device copy of `name` is dropped: compute waits for its copy to the host (which reads it).
        This orders the free, where `record_stream` would hold the memory until every copy queued is done."""
        self.streams.wait_event(self.streams.compute(), self.saved[name])

    def finish(self) -> None:
        s = self.streams
        s.wait_stream(s.compute(), s.d2h)
        s.wait_stream(s.compute(), s.h2d)


class _Runners:
    """A policy's step runner for each device the model is on when called, made on first use there: a model
    wrapped on one device may be moved to another afterwards (`module.cuda()`)."""

    def __init__(self, model: nn.Module, captured: Captured, program, autocast: str | None):
        self.model, self.captured, self.program, self.autocast = model, captured, program, autocast
        self.runners: dict[torch.device, StepRunner] = {}

    def device(self, tensors) -> torch.device:
        """The device of the model's parameters; PolicyError if a tensor of `tensors` is elsewhere, or if the
        caller's autocast is not the policy's (its casts are ops of the graph, which runs with autocast off)."""
        device = next(self.model.parameters()).device
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and t.device != device:
                raise PolicyError(f"input {i} is on {t.device}, but the model's parameters are on {device}: "
                                  f"move the batch to {device} (x.to({str(device)!r}))")
        if torch.is_autocast_enabled(device.type):
            dtype = str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")
            if dtype != self.autocast:
                searched = f"with `autocast: {self.autocast}`" if self.autocast else "without autocast"
                raise PolicyError(f"called under torch.autocast({dtype}), but the policy was searched "
                                  f"{searched}: search it with `autocast: {dtype}` in the experiment, whose step then "
                                  f"holds the casts, or call it outside torch.autocast")
        return device

    def on(self, device: torch.device) -> StepRunner:
        if device not in self.runners:
            self.runners[device] = StepRunner(self.captured, self.program, device)
        return self.runners[device]


class PolicyStep:
    """A model's training step under a policy: `loss = step(*inputs, target)` fills each parameter's
    `.grad` (adding to it, as `loss.backward()` does) and returns the loss. Use it in place of
    `loss = criterion(model(*inputs), target); loss.backward()`; the optimizer is used as before. It runs
    on the device of the model's parameters at each call, with autocast off (the policy's casts are ops of
    its graph; under a torch.autocast other than the policy's it refuses to run).
    """

    def __init__(self, model, captured: Captured, program, autocast: str | None = None):
        self.model, self.captured = model, captured
        self.runners = _Runners(model, captured, program, autocast)
        self._specs = _input_specs(captured)  # the inputs', then the target's

    def __call__(self, *inputs_and_target):
        _check_inputs(inputs_and_target, self._specs, "tensors (the inputs, then the target)")
        *inputs, target = inputs_and_target
        device = self.runners.device([*inputs, target])
        args = self.captured.arguments(self.model, tuple(inputs), target)
        del inputs, target, inputs_and_target  # a swapped-out input leaves only if the caller holds no reference
        with torch.autocast(device.type, enabled=False):
            loss, *grads = self.runners.on(device)(args)
        for p, g in zip([p for p in self.model.parameters() if p.requires_grad], grads):
            p.grad = g if p.grad is None else p.grad + g
        return loss


class PolicyModule(nn.Module):
    """`model` whose training steps run under a policy searched with loss "external": a drop-in module.

    In training mode with gradients enabled, `module(*inputs)` runs the policy's program up to the
    backward pass and returns the model's output; the backward of any loss computed from it runs the rest
    of the program from the output's gradient and accumulates each parameter's `.grad` as autograd does.
    In eval mode or under `torch.no_grad()` it is the model itself. Parameters, buffers, train/eval,
    attributes and `state_dict` (same keys) are the model's. Inputs must have the shapes and dtypes the
    policy was searched for, on the device of the parameters (which may change after wrapping: the program
    runs where the parameters are at each call); each output can be backpropagated through once. As in
    the captured step, BatchNorm's running statistics are updated at the end of the backward part: a
    training-mode forward pass whose output is never backpropagated leaves them as they were.
    """

    def __init__(self, model: nn.Module, captured: Captured, program, autocast: str | None = None):
        super().__init__()
        self.model = model
        self.captured = captured
        self.autocast = autocast  # the mixed precision the policy was searched with: its casts are in the graph
        self._runners = _Runners(model, captured, program, autocast)
        self._input_specs = _input_specs(captured)
        self._trainable = [src for _, kind, src in captured.placeholders if kind == "param"]
        # state_dict keys are the model's own (no "model." prefix): checkpoints load with or without the policy
        self.register_state_dict_post_hook(_strip_model_prefix)
        self.register_load_state_dict_pre_hook(_add_model_prefix)

    def forward(self, *inputs):
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*inputs)
        _check_inputs(inputs, self._input_specs, "input(s)")
        device = self._runners.device(inputs)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.autocast(device.type, enabled=False):  # the graph has its casts already
            return _PolicyFunction.apply(self, self._runners.on(device), len(inputs), *inputs,
                                         *(params[k] for k in self._trainable))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)


def _input_specs(captured: Captured) -> list[tuple[str, tuple, torch.dtype]]:
    """(name, shape, dtype) of what a caller passes to a policy's step: the inputs ("input k"), then the loss's
    target ("the target") where the step takes one."""
    traced = {n.name: n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder"}
    return [(f"input {src.removeprefix('inputs.')}" if src.startswith("inputs.") else "the target",
             tuple(traced[name].shape), traced[name].dtype)
            for name, kind, src in captured.placeholders if kind == "input"]


def _check_inputs(given, specs, what: str) -> None:
    """Refuse (PolicyError) tensors other than those the policy was searched for, saying what differs: their
    number, a value that is no tensor, a shape or dtype, or one that requires grad. (Their device is checked
    against the model's by `_Runners.device`.)"""
    if len(given) != len(specs):
        raise PolicyError(f"the policy was searched for {len(specs)} {what}, got {len(given)}")
    for x, (name, shape, dtype) in zip(given, specs):
        if not isinstance(x, torch.Tensor):
            raise PolicyError(f"{name} is {type(x).__name__}, not a tensor")
        if (tuple(x.shape), x.dtype) != (shape, dtype):
            raise PolicyError(
                f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}, but the policy was searched for "
                f"shape {shape} and dtype {dtype}. Feed batches of that shape (e.g. DataLoader(drop_last=True)), "
                f"or search a policy for these shapes")
        if x.requires_grad:
            raise PolicyError(f"{name} requires grad, but the policy's step computes parameter gradients only")


class _PolicyFunction(torch.autograd.Function):
    """A policy's step as one autograd node: the forward part of the program, then the rest in backward."""

    @staticmethod
    def forward(ctx, module: PolicyModule, runner: StepRunner, n_inputs: int, *inputs_and_params):
        args = module.captured.arguments(module.model, inputs_and_params[:n_inputs], None)
        output, ctx.state = runner.forward(args)
        ctx.runner, ctx.n_inputs = runner, n_inputs
        return output.detach()  # an alias: the state must not hold the tensor autograd attaches this node to

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.state is None:
            raise RuntimeError("backward through a policy's step a second time: the first released its tensors; "
                               "run the forward pass again")
        with torch.autocast(ctx.runner.device.type, enabled=False):
            grads = ctx.runner.backward(ctx.state, grad_output)
        ctx.state = None
        return (None, None, None, *[None] * ctx.n_inputs, *grads)


def _strip_model_prefix(module, state: dict, prefix: str, metadata) -> None:
    _move_keys(state, prefix + "model.", prefix)


def _add_model_prefix(module, state: dict, prefix: str, *args) -> None:
    _move_keys(state, prefix, prefix + "model.")


def _move_keys(state: dict, old: str, new: str) -> None:
    """Rename the keys of `state` that start with `old` to start with `new` instead."""
    for key in [k for k in state if k.startswith(old)]:
        state[new + key[len(old):]] = state.pop(key)


def apply(model, policy_path, example_inputs) -> PolicyModule:
    """`model` as a module whose training steps run under the policy file at `policy_path`, which must have
    been searched with `loss: external`: use it in place of the model (`criterion(module(x), y).backward()`).

    `example_inputs` is one batch of the model's forward inputs: a tensor, or a tuple of tensors for a forward
    taking several positional inputs (e.g. `(ids, attention_mask)`), as the experiment's `inputs` describe them
    at its `batch_size`. Only their shapes and dtypes are used (to capture the step; values do not matter): they
    must be those the policy was searched for, else the policy is refused with a message saying what differs.
    The module runs on the device the model's parameters are on when it is called (wrap, then `.cuda()`, works).
    """
    policy, captured = _load(model, policy_path, example_inputs, None, external=True)
    return PolicyModule(model, captured, policy.program, autocast=policy.provenance.get("autocast"))


def apply_step(model, policy_path, example_inputs, example_target) -> PolicyStep:
    """The training step of `model`, loss included, under the policy file at `policy_path`.

    `example_inputs` (a tensor or a tuple) and `example_target` fix the shapes and dtypes: they must be
    those the policy was searched for, else the policy is refused with a message saying what differs. The
    step runs on the device the model's parameters are on when it is called.
    """
    policy, captured = _load(model, policy_path, example_inputs, example_target, external=False)
    return PolicyStep(model, captured, policy.program, autocast=policy.provenance.get("autocast"))


def _load(model, policy_path, example_inputs, example_target, *, external: bool) -> tuple[Policy, Captured]:
    """The policy file and the model's step captured as the policy was, refusing a policy of the other form
    (loss inside the step or not), of another model or of other shapes."""
    policy = policies.load(policy_path)
    if not policy.program:
        raise PolicyError(f"{policy_path}: the policy has no program; re-run the search that made it")
    prov = policy.provenance
    loss = prov.get("loss", DEFAULT_LOSS)  # a policy without provenance: the experiment file's defaults
    if external and loss != "external":
        raise PolicyError(f"{policy_path}: the policy's step includes the loss ({loss}), so it cannot run as a "
                          f"module; use gaswap.apply_step(model, policy, inputs, target), or search a policy "
                          f"with `loss: external`")
    if not external and loss == "external":
        raise PolicyError(f"{policy_path}: the policy was searched with `loss: external` (the loss is computed "
                          f"outside its step); use gaswap.apply(model, policy, inputs), which returns a module")
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    captured = capture(model, inputs, example_target, loss, optimizer=prov.get("optimizer", DEFAULT_OPTIMIZER),
                       counted=prov.get("counts", COUNTABLE), autocast=prov.get("autocast"))
    here = {"input_shapes": [(list(x.shape), str(x.dtype).removeprefix("torch.")) for x in inputs]}
    policies.check_matches(policy, captured.graph, policy_path, provenance=here, torch_version=torch.__version__)
    return policy, captured
