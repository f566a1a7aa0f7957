"""Run a captured training step under a policy, for real: the graph searched is the graph executed.

The simulator turns a policy into a program (`SimResult.program`, stored in the policy file): which op
runs next, which tensor is copied to the host or back, which is dropped. `StepRunner` replays it on the
captured fx graph. Views are rebuilt from their base storage whenever an op needs them, so a tensor
dropped by the program is really gone. On CUDA, copies run on one stream per direction with pinned host
buffers and events, so compute waits only for the copies it reads; on the CPU the same code copies into a
host store synchronously.

Two forms: `apply` wraps a model whose policy was searched with loss "external" into a `PolicyModule`,
used like the model (`criterion(module(x), y).backward()`), the program split around the caller's loss;
`apply_step` runs a policy whose step includes the loss as one call, `loss = step(*inputs, target)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn

from gaswap import policy as policies
from gaswap.capture import Captured, capture, tensor_outputs
from gaswap.graph import COUNTABLE
from gaswap.memory import host_memory
from gaswap.policy import Policy, PolicyError
from gaswap.step import DEFAULT_LOSS, DEFAULT_OPTIMIZER


class ProgramError(RuntimeError):
    """The program and the graph disagree (a tensor the program should have kept is missing)."""


class StepRunner:
    """Replays `program` over `captured.gm` on `device`: `runner(args) -> (loss, *grads)`.

    A step with loss "external" also runs in two parts, around a loss computed outside it:
    `output, state = runner.forward(args)`, then `grads = runner.backward(state, grad_output)`.
    """

    def __init__(self, captured: Captured, program, device="cpu"):
        self.device = torch.device(device)
        gm = captured.gm if self.device.type == "cpu" else captured.gm_on(self.device)
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.results = list(gm.graph.output_node().args[0])
        self.ops = {op.name: op for op in captured.graph.ops}
        self.program = [tuple(step) for step in program]
        self._check_program()
        self.grad_output = next((name for name, kind, _ in captured.placeholders if kind == "grad_output"), None)
        self.split = self._split() if self.grad_output else None

    @torch.no_grad()  # the graph computes the gradients itself: autograd must not keep tensors alive
    def __call__(self, args: list):
        """Run one training step (host copies count as host memory for an active `DeviceMemory`).

        The step takes ownership of `args` (the list is emptied): an input the policy swaps out can only
        leave the device if nothing else holds it.
        """
        state = self._start(args)
        self._execute(self.program, state)
        return self._finish(self.results, state)

    @torch.no_grad()
    def forward(self, args: list) -> tuple[torch.Tensor, "StepState"]:
        """The forward part of a step with loss "external": the program up to the first instruction of
        the backward pass. Returns the model's output and the state `backward` continues from. `args` are
        those of `__call__`, the gradient of the output left out (None); the step takes ownership of them.
        """
        if self.grad_output is None:
            raise ProgramError("this step computes its own loss: run it whole (runner(args)), not in two parts")
        state = self._start(args)
        state.env.pop(self.grad_output)
        self._execute(self.program[:self.split], state)
        return self._value(self.results[0], state.env), state

    @torch.no_grad()
    def backward(self, state: "StepState", grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rest of the step, from the gradient of the output: the gradients of the parameters.
        The state is used up (its tensors are released)."""
        state.env[self.grad_output] = grad_output.contiguous()  # the layout it was traced with
        self._execute(self.program[self.split:], state)
        return self._finish(self.results[1:], state)

    def _start(self, args: list) -> "StepState":
        state = StepState(dict(zip(self.placeholders, args)), _Copies(self.device))
        args.clear()
        return state

    def _execute(self, program, state: "StepState") -> None:
        env, copies, retired = state.env, state.copies, state.retired
        for verb, name in program:
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

    def _finish(self, results: list, state: "StepState") -> tuple:
        """The values of `results`; the state's tensors are released (a gradient is then held by the caller alone)."""
        state.copies.finish()
        values = tuple(self._value(n, state.env) for n in results)
        state.env.clear()
        state.retired.clear()
        return values

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

    def _split(self) -> int:
        """Where the backward part of the program starts: after the last forward op has run and the frees and
        copies to the host that follow it, at the first instruction that computes or brings a tensor back."""
        last_forward = max(k for k, (verb, name) in enumerate(self.program)
                           if verb == "run" and self.ops[name].phase == "fwd")
        split = next((k for k in range(last_forward + 1, len(self.program))
                      if self.program[k][0] in ("run", "recompute", "swap_in")), len(self.program))
        early = [name for verb, name in self.program[:split] if verb == "run" and self.grad_output in self.ops[name].inputs]
        if early:
            raise ProgramError(f"the policy's program runs {early[0]}, which reads the gradient of the output, before "
                               f"the forward pass ends: it cannot run with the loss outside the step")
        return split


@dataclass
class StepState:
    """A step under way: tensors on the device by name, host copies, and device copies waiting to go."""

    env: dict
    copies: "_Copies"
    retired: dict = field(default_factory=dict)


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


class PolicyModule(nn.Module):
    """`model` whose training steps run under a policy searched with loss "external": a drop-in module.

    In training mode with gradients enabled, `module(*inputs)` runs the policy's program up to the
    backward pass and returns the model's output; the backward of any loss computed from it runs the rest
    of the program from the output's gradient and accumulates each parameter's `.grad` as autograd does.
    In eval mode or under `torch.no_grad()` it is the model itself. Parameters, buffers, train/eval,
    attributes and `state_dict` (same keys) are the model's. Inputs must have the shapes and dtypes the
    policy was searched for; each output can be backpropagated through once. As in the captured step,
    BatchNorm's running statistics are updated at the end of the backward part: a training-mode forward
    pass whose output is never backpropagated leaves them as they were.
    """

    def __init__(self, model: nn.Module, captured: Captured, program, device, autocast: str | None = None):
        super().__init__()
        self.model = model
        self.captured = captured
        self.runner = StepRunner(captured, program, device)
        self.autocast = autocast  # the mixed precision the policy was searched with: its casts are in the graph
        traced = {n.name: n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder"}
        self._input_specs = [(tuple(traced[name].shape), traced[name].dtype)
                             for name, kind, _ in captured.placeholders if kind == "input"]
        self._trainable = [src for _, kind, src in captured.placeholders if kind == "param"]
        # state_dict keys are the model's own (no "model." prefix): checkpoints load with or without the policy
        self.register_state_dict_post_hook(_strip_model_prefix)
        self.register_load_state_dict_pre_hook(_add_model_prefix)

    def forward(self, *inputs):
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*inputs)
        self._check(inputs)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.autocast(self.runner.device.type, enabled=False):  # the graph has its casts already
            return _PolicyFunction.apply(self, len(inputs), *inputs, *(params[k] for k in self._trainable))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)

    def _check(self, inputs) -> None:
        """Refuse inputs other than those the policy was searched for, saying what differs."""
        if len(inputs) != len(self._input_specs):
            raise PolicyError(f"the policy was searched for {len(self._input_specs)} input(s), got {len(inputs)}")
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self._input_specs)):
            if not isinstance(x, torch.Tensor):
                raise PolicyError(f"input {i} is {type(x).__name__}, not a tensor")
            if (tuple(x.shape), x.dtype) != (shape, dtype):
                raise PolicyError(
                    f"input {i} has shape {tuple(x.shape)} and dtype {x.dtype}, but the policy was searched for "
                    f"shape {shape} and dtype {dtype}. Feed batches of that shape (e.g. DataLoader(drop_last=True)), "
                    f"or search a policy for these shapes")
            if x.requires_grad:
                raise PolicyError(f"input {i} requires grad, but the policy's step computes parameter gradients only")
        device = self.runner.device.type
        if torch.is_autocast_enabled(device):
            dtype = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
            if dtype != self.autocast:
                searched = f"with `autocast: {self.autocast}`" if self.autocast else "without autocast"
                raise PolicyError(f"the module is called under torch.autocast({dtype}), but the policy was searched "
                                  f"{searched}: search it with `autocast: {dtype}` in the experiment, whose step then "
                                  f"holds the casts, or call the module outside torch.autocast")


class _PolicyFunction(torch.autograd.Function):
    """A policy's step as one autograd node: the forward part of the program, then the rest in backward."""

    @staticmethod
    def forward(ctx, module: PolicyModule, n_inputs: int, *inputs_and_params):
        args = module.captured.arguments(module.model, inputs_and_params[:n_inputs], None)
        output, ctx.state = module.runner.forward(args)
        ctx.runner, ctx.n_inputs = module.runner, n_inputs
        return output.detach()  # an alias: the state must not hold the tensor autograd attaches this node to

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.state is None:
            raise RuntimeError("backward through a policy's step a second time: the first released its tensors; "
                               "run the forward pass again")
        with torch.autocast(ctx.runner.device.type, enabled=False):
            grads = ctx.runner.backward(ctx.state, grad_output)
        ctx.state = None
        return (None, None, *[None] * ctx.n_inputs, *grads)


def _strip_model_prefix(module, state: dict, prefix: str, metadata) -> None:
    _move_keys(state, prefix + "model.", prefix)


def _add_model_prefix(module, state: dict, prefix: str, *args) -> None:
    _move_keys(state, prefix, prefix + "model.")


def _move_keys(state: dict, old: str, new: str) -> None:
    """Rename the keys of `state` that start with `old` to start with `new` instead."""
    for key in [k for k in state if k.startswith(old)]:
        state[new + key[len(old):]] = state.pop(key)


def apply(model, policy_path, example_inputs, *, device=None) -> PolicyModule:
    """`model` as a module whose training steps run under the policy file at `policy_path`, which must have
    been searched with `loss: external`: use it in place of the model (`criterion(module(x), y).backward()`).

    `example_inputs` is one batch of the model's forward inputs: a tensor, or a tuple of tensors for a forward
    taking several positional inputs (e.g. `(ids, attention_mask)`), as the experiment's `inputs` describe them
    at its `batch_size`. Only their shapes and dtypes are used (to capture the step; values do not matter): they
    must be those the policy was searched for, else the policy is refused with a message saying what differs.
    """
    policy, captured = _load(model, policy_path, example_inputs, None, external=True)
    return PolicyModule(model, captured, policy.program, device or next(model.parameters()).device,
                        autocast=policy.provenance.get("autocast"))


def apply_step(model, policy_path, example_inputs, example_target, *, device=None) -> PolicyStep:
    """The training step of `model`, loss included, under the policy file at `policy_path`.

    `example_inputs` (a tensor or a tuple) and `example_target` fix the shapes and dtypes: they must be
    those the policy was searched for, else the policy is refused with a message saying what differs.
    """
    policy, captured = _load(model, policy_path, example_inputs, example_target, external=False)
    return PolicyStep(model, captured, policy.program, device or next(model.parameters()).device)


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
    policies.check_matches(policy, captured.graph, policy_path, torch_version=torch.__version__)
    return policy, captured
