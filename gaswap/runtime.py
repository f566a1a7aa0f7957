"""Run a captured training step under a policy, for real: the graph searched is the graph executed.

The simulator turns a policy into a program (`SimResult.program`, stored in the policy file): which op
runs next, which tensor is copied to the host or back, which is dropped. `StepRunner` replays it on the
captured fx graph. Views are rebuilt from their base storage whenever an op needs them, so a tensor
dropped by the program is really gone. On CUDA, copies run on one stream per direction with pinned host
buffers and events, so compute waits only for the copies it reads; on the CPU the same code copies into a
host store synchronously.
"""
from __future__ import annotations


import torch
from torch import fx

from gaswap.capture import Captured, tensor_outputs
from gaswap.graph import COUNTABLE
from gaswap.memory import host_memory


class ProgramError(RuntimeError):
    """The program and the graph disagree (a tensor the program should have kept is missing)."""


class StepRunner:
    """Replays `program` over `captured.gm` on `device`: `runner(args) -> (loss, *grads)`."""

    def __init__(self, captured: Captured, program, device="cpu"):
        self.device = torch.device(device)
        gm = captured.gm if self.device.type == "cpu" else captured.gm_on(self.device)
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.results = list(gm.graph.output_node().args[0])
        self.ops = {op.name: op for op in captured.graph.ops}
        self.program = [tuple(step) for step in program]
        self._check_program()

    @torch.no_grad()  # the graph computes the gradients itself: autograd must not keep tensors alive
    def __call__(self, args: list):
        """Run one training step (host copies count as host memory for an active `DeviceMemory`).

        The step takes ownership of `args` (the list is emptied): an input the policy swaps out can only
        leave the device if nothing else holds it.
        """
        copies = _Copies(self.device)
        env = dict(zip(self.placeholders, args))
        args.clear()
        retired = {}
        for verb, name in self.program:
            if verb in ("run", "recompute"):
                self._run(name, env, copies)
            elif verb == "swap_out":
                copies.to_host(name, env[name])
            elif verb == "retire":
                retired[name] = env.pop(name)
            elif verb == "swap_in":
                env[name] = copies.to_device(name)
            elif verb == "free":
                (retired if name in retired else env).pop(name)
        copies.finish()
        return tuple(self._value(n, env) for n in self.results)

    def _run(self, name: str, env: dict, copies: "_Copies") -> None:
        op, node = self.ops[name], self.nodes[name]
        for t in op.inputs:
            if t not in env:
                raise ProgramError(f"op {name} needs {t}, which the program has not kept, swapped in or recomputed")
            copies.wait_for(t, env[t])
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self._value(n, env))
        result = node.target(*args, **kwargs)
        for out, value in tensor_outputs(node, result):
            if out in op.outputs and out not in env:  # a recompute re-makes outputs that are here: drop those
                env[out] = value

    def _value(self, node: fx.Node, env: dict):
        """The value of an fx node: a stored tensor, or a view rebuilt from one."""
        if node.name in env:
            return env[node.name]
        if node.op != "call_function" or node.name in self.ops:
            raise ProgramError(f"{node.name} is needed but is not on the device")
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self._value(n, env))
        return node.target(*args, **kwargs)

    def _check_program(self) -> None:
        known = {"run", "recompute", "swap_out", "retire", "swap_in", "free"}
        runs = [name for verb, name in self.program if verb == "run"]
        bad = [f"{v} {n}" for v, n in self.program if v not in known or (v in ("run", "recompute") and n not in self.ops)]
        if bad or sorted(runs) != sorted(self.ops):
            detail = f"unknown steps {bad[:3]}" if bad else "it does not run every op of the graph exactly once"
            raise ProgramError(f"the policy's program does not fit this graph: {detail}")


class _Copies:
    """Host copies of swapped tensors. CUDA: pinned buffers, one stream per direction, events."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        self.landed: dict[str, object] = {}  # name -> event: the copy to the device has landed
        self.saved: dict[str, object] = {}  # name -> event: the copy to the host has landed
        if self.cuda:
            self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def to_host(self, name: str, t: torch.Tensor) -> None:
        if not self.cuda:
            with host_memory():
                self.host[name] = t.clone()
            return
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).as_strided(t.shape, t.stride())
        self.d2h.wait_stream(torch.cuda.current_stream())  # the producer has run
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            t.record_stream(self.d2h)  # the allocator keeps t's memory until this copy is done
            self.saved[name] = torch.cuda.Event()
            self.saved[name].record()
        self.host[name] = host

    def to_device(self, name: str) -> torch.Tensor:
        host = self.host[name]
        if not self.cuda:
            return host.clone()
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(self.saved[name])
            t = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=torch.cuda.current_device())
            t.copy_(host, non_blocking=True)
            self.landed[name] = torch.cuda.Event()
            self.landed[name].record()
        return t

    def wait_for(self, name: str, t: torch.Tensor) -> None:
        """Before compute reads `t`: wait for its copy to the device, if one is in flight."""
        event = self.landed.pop(name, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            t.record_stream(torch.cuda.current_stream())

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.d2h)
            torch.cuda.current_stream().wait_stream(self.h2d)



class PolicyStep:
    """A model's training step under a policy: `loss = step(*inputs, target)` fills each parameter's
    `.grad` (adding to it, as `loss.backward()` does) and returns the loss. Use it in place of
    `loss = criterion(model(*inputs), target); loss.backward()`; the optimizer is used as before.
    """

    def __init__(self, model, captured: Captured, program, device):
        self.model, self.captured = model, captured
        self.runner = StepRunner(captured, program, device)
        self.trainable = [p for p in model.parameters() if p.requires_grad]

    def __call__(self, *inputs_and_target):
        *inputs, target = inputs_and_target
        args = self.captured.arguments(self.model, tuple(inputs), target)
        del inputs, target, inputs_and_target  # a swapped-out input leaves only if the caller holds no reference
        loss, *grads = self.runner(args)
        for p, g in zip(self.trainable, grads):
            p.grad = g if p.grad is None else p.grad + g
        return loss


def apply(model, policy_path, example_inputs, example_target, *, device=None) -> PolicyStep:
    """The training step of `model` under the policy file at `policy_path`.

    `example_inputs` (a tensor or a tuple) and `example_target` fix the shapes and dtypes: they must be
    those the policy was searched for, else the policy is refused with a message saying what differs.
    """
    from gaswap import policy as policies
    from gaswap.capture import capture

    policy = policies.load(policy_path)
    if not policy.program:
        raise policies.PolicyError(f"{policy_path}: the policy has no program; re-run the search that made it")
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    prov = policy.provenance
    captured = capture(model, inputs, example_target, prov.get("loss", "cross_entropy"),
                       optimizer=prov.get("optimizer", "sgd_momentum"), counted=prov.get("counts", COUNTABLE),
                       autocast=prov.get("autocast"))
    policies.check_matches(policy, captured.graph, policy_path)
    device = device or next(model.parameters()).device
    return PolicyStep(model, captured, policy.program, device)
