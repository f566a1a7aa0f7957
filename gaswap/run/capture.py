"""Capture one whole training step of a model (forward and backward, ATen level) as a storage-level `Graph`.

The step `loss = loss_fn(model(*inputs), target)` and the gradients of the loss w.r.t. the trainable
parameters are traced with `make_fx(functionalize(grad_and_value(...)))` on fake CPU tensors: nothing
is allocated, whatever device the model lives on (meta included). With loss "external" the loss is
computed outside the step: the step is `out = model(*inputs)` and the vector-Jacobian product of the
parameters with `grad_output`, a placeholder shaped like `out` (`torch.func.vjp`), and `out` takes the
loss's place in the graph. Functionalization turns in-place ops
(ReLU(inplace), BatchNorm's running statistics) into out-of-place ops; the buffer updates become
`copy_` ops at the end of the step. Ops are those of the CPU dispatch (e.g. dropout is bernoulli, div,
mul rather than CUDA's fused native_dropout).

Storages come from the fake tensors themselves: an fx node whose outputs share storage with an
earlier tensor (views, reshapes, `_unsafe_view`, `getitem`...) creates no storage and no `Op`.

Layers: global module hooks tag forward nodes with their module path (`fx.traceback.annotate`);
hooks on the autograd nodes tag backward nodes with the sequence number of the autograd node they
run for, which maps them to the forward node that created it (`meta["seq_nr"]`). Besides public
APIs this relies on `FakeTensorMode`, `enable_python_dispatcher` (the decompositions AOTAutograd
uses, e.g. functional BatchNorm), `autograd.graph.Node._sequence_nr` and, for loss "external",
`torch.func.vjp`'s variant that differentiates some arguments only (`_vjp_with_argnums`).
"""
from __future__ import annotations

import copy
import json
import logging
import operator
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch import fx, nn
from torch._dispatch.python import enable_python_dispatcher
from torch._functorch.eager_transforms import _vjp_with_argnums
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry

from gaswap.base.errors import BadInput
from gaswap.base.training_options import AUTOCAST, DEFAULT_LOSS, DEFAULT_OPTIMIZER, LOSSES, OPTIMIZER_STATE  # noqa: F401  (LOSSES: the losses `capture` takes)
from gaswap.plan import graph
from gaswap.plan.graph import Graph, Op, Tensor
from gaswap.run import values
from gaswap.run.dropout import eager_masks

if not hasattr(fx_traceback, "annotate"):
    raise ImportError(f"gaswap.run.capture needs torch >= 2.10 (torch.fx.traceback.annotate); found {torch.__version__}")



class CaptureError(BadInput):
    """A model whose training step cannot be traced; the message says where and what to do."""


class ValuesNeeded(CaptureError):
    """A forward pass that reads the value of a tensor given without values (on the meta device)."""


@dataclass
class Captured:
    """A captured training step.

    `gm` is the traced step, callable with real tensors: `gm(*args) -> (loss, *grads)`, where `args`
    follow `placeholders` (parameters, then buffers, then inputs, then the target, then constants) and
    `grads` follow the "param" placeholders. With loss "external", `gm(*args) -> (output, *grads)` and the
    gradient of the output takes the target's place. `placeholders` lists (fx name, kind, source) with kind
    "param" (trainable parameter), "buffer" (buffer or frozen parameter), "input", "grad_output" or
    "constant" (a tensor made in forward, e.g. `torch.tensor([...])`, traced as a constant and lifted to a
    placeholder; its value is in `constants`, and `arguments` passes it on the model's device), and source
    the parameter or buffer path, "inputs.<i>", "target", "grad_output" or the constant's name. Calling `gm`
    updates the buffers it is given in place (BatchNorm running statistics), as a training step does.
    `arguments` builds `args` from a model; `gm` was traced with the CPU's dispatch, so use `gm_on(device)`
    to run it elsewhere. A forward pass that reads tensor values (`.item()`) was traced for the values of the
    example inputs (`specialized`, see gaswap.run.values); `arguments` refuses a batch that gives other values.
    """

    graph: Graph
    gm: fx.GraphModule
    seconds: float
    placeholders: list[tuple[str, str, str]] = field(default_factory=list)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: tuple[str, ...] = ()  # the graph's tensor of each "param" placeholder's gradient, in their order
    specialized: tuple[values.Specialization, ...] = ()  # the tensor values the step was traced for

    def arguments(self, model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None) -> list:
        """The positional arguments of `gm` taken from a model with real tensors and real inputs; `target`
        is the loss's target, or with loss "external" the gradient of the output (None if not known yet)."""
        state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        data = {f"inputs.{i}": x for i, x in enumerate(inputs)} | {"target": target, "grad_output": target}
        if self.constants:
            device = next(iter(state.values()), inputs[0] if inputs else torch.empty(0)).device
            data |= {name: value.to(device) for name, value in self.constants.items()}
        args = [state[src] if kind in ("param", "buffer") else data[src] for _, kind, src in self.placeholders]
        values.check(self.specialized, args)
        return args

    def gm_on(self, device) -> fx.GraphModule:
        """A copy of `gm` to run on `device`: device constants (e.g. `arange(..., device=cpu)`) name it, and
        ops the CPU's dispatch chose (`*_for_cpu`) are replaced by device-neutral equivalents computing the
        same outputs (SDPA's CPU flash attention: `sdpa_forward` / `sdpa_backward`); any other `*_for_cpu`
        op, or SDPA with dropout, is refused with a CaptureError naming it."""
        gm = copy.deepcopy(self.gm)
        device = torch.device(device)
        for node in gm.graph.nodes:
            node.args, node.kwargs = fx.node.map_aggregate(
                (node.args, node.kwargs), lambda a: device if isinstance(a, torch.device) else a
            )
            if device.type != "cpu" and node.op == "call_function" and "_for_cpu" in str(node.target):
                node.target = _device_neutral(node, device)
        gm.recompile()
        return gm


_SDPA_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _device_neutral(node: fx.Node, device: torch.device):
    """The replacement of a CPU-dispatch op for another device, or a CaptureError."""
    target = str(node.target)
    replacement = device_neutral(target)
    if replacement is not None:
        dropout = node.args[3] if target == _SDPA_CPU else node.args[6]
        if dropout:
            raise CaptureError(f"op {node.name}: scaled_dot_product_attention with dropout {dropout} was traced with "
                               f"the CPU's kernel and cannot be replayed on {device}; use dropout_p=0 in attention")
        return replacement
    raise CaptureError(f"op {node.name} ({target}) was traced with the CPU's dispatch and has no equivalent on "
                       f"{device} here; rewrite the layer with ops that are not device-specific")


def device_neutral(target: str):
    """What runs on another device in place of the CPU-dispatch op `target` (`*_for_cpu`, same arguments), or None:
    the runtime's replacement, which op timing on that device times too (gaswap.run.measure)."""
    return {_SDPA_CPU: sdpa_forward, _SDPA_CPU.replace(".default", "_backward.default"): sdpa_backward}.get(target)


def _attention_scores(query, key, is_causal, attn_mask, scale):
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores, scale


def sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """`_scaled_dot_product_flash_attention_for_cpu` on any device: (output, logsumexp), computed in float32
    (the attention matrix is materialized: transient memory the graph does not count)."""
    q, k, v = query.float(), key.float(), value.float()
    scores, _ = _attention_scores(q, k, is_causal, attn_mask, scale)
    logsumexp = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - logsumexp.unsqueeze(-1)) @ v
    # laid out as the CPU kernel lays them out (the graph's views rely on it): the output like the query,
    # the logsumexp as (batch, length, heads) transposed
    return torch.empty_like(query).copy_(out), _heads_inner(logsumexp)


def sdpa_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                  scale=None):
    """`_scaled_dot_product_flash_attention_for_cpu_backward` on any device: (grad_query, grad_key, grad_value)."""
    q, k, v, g, o = (t.float() for t in (query, key, value, grad_out, out))
    scores, scale = _attention_scores(q, k, is_causal, attn_mask, scale)
    p = torch.exp(scores - logsumexp.unsqueeze(-1))
    grad_v = p.transpose(-2, -1) @ g
    grad_p = g @ v.transpose(-2, -1)
    grad_s = p * (grad_p - (g * o).sum(-1, keepdim=True))
    grad_q = (grad_s @ k) * scale
    grad_k = (grad_s.transpose(-2, -1) @ q) * scale
    return _heads_inner(grad_q, query.dtype), _heads_inner(grad_k, key.dtype), _heads_inner(grad_v, value.dtype)


def _heads_inner(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """A copy of a (batch, heads, length[, dim]) tensor stored as (batch, length, heads[, dim])."""
    shape = (t.shape[0], t.shape[2], t.shape[1], *t.shape[3:])
    return torch.empty(shape, dtype=dtype or t.dtype, device=t.device).transpose(1, 2).copy_(t)


def capture(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    target: torch.Tensor | None,
    loss: str = DEFAULT_LOSS,
    *,
    optimizer: str = DEFAULT_OPTIMIZER,
    counted=graph.COUNTABLE,
    autocast: str | None = None,
    eager: bool = False,
) -> Captured:
    """Trace one training step of `model` (in its current train/eval mode) into a `Captured`.

    Only shapes, dtypes and strides of the parameters, buffers and inputs are used: they may live on
    any device, `meta` included. The model is not modified. `inputs` may mix float, integer and bool
    tensors. A model may return a tensor, a tuple or list (its first element is the output) or a
    mapping such as a Hugging Face ModelOutput (its "logits", else its first value).

    `loss` and `optimizer` default to what an experiment file defaults to (`gaswap.base.training_options`: "sum", which takes
    no target, and plain "sgd", which keeps no state), so a policy captured either way is the same policy.

    With loss "external" `target` is not used (pass None): the step stops at the model's output and
    starts its backward pass from a given gradient of it; the model must then return one tensor.

    `autocast` ("bfloat16" or "float16") runs the forward pass and the loss under `torch.autocast`,
    as mixed-precision training does: parameters stay in their dtype and the casts are ops of the
    graph. The op lists are those of CPU autocast, which keeps softmax and layer norm in low precision
    where CUDA's computes them in float32.

    `eager` traces the step as eager autograd runs `loss.backward()` (the sharded path: FSDP2 trains in eager
    mode), not as gaswap's runtime replays it: the backward goes through `torch.autograd.grad` with grad mode
    off, so it runs the kernels eager runs where a derivative formula depends on grad mode (F.silu's backward is
    `silu_backward`, where `torch.func.grad`, which differentiates with create_graph, runs sigmoid, sub, mul...);
    nothing is functionalized (in-place ops stay in place, as in eager); the Python dispatcher is off (eager runs
    the C++ kernels: dropout with p=0 returns its input where the Python decomposition clones it); and each autograd node's backward ends
    with an `autograd.release` op reading what the node held (its saved tensors and incoming gradients), which
    eager frees when the node is done, not after their last reader. The graph module of an eager capture is for
    reading only (it mutates its arguments); the shipped single-device path never uses it.
    """
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}: expected one of {LOSSES}")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}: expected one of {sorted(OPTIMIZER_STATE)}")
    if autocast not in (None, *AUTOCAST):
        raise ValueError(f"unknown autocast dtype {autocast!r}: expected one of {AUTOCAST} or None")
    start = time.perf_counter()
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    gm, placeholders, constants, specialized = _trace(model, inputs, target, loss, autocast, eager)
    g, grads = _build_graph(gm, placeholders, optimizer, counted, release=eager)
    if specialized:
        g = replace(g, specialized=tuple(s.record() for s in specialized))
    return Captured(g, gm, time.perf_counter() - start, placeholders, constants, grads, specialized)


def make_inputs(
    specs: list[dict], target_spec: dict, batch_size: int, device="meta", generator: torch.Generator | None = None
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Example inputs and target from specs like {"shape": ["batch", 3, 224, 224], "dtype": "float32"}.

    "batch" in a shape becomes `batch_size`. On `meta` nothing is allocated; elsewhere floats are
    randn, integers randint(0, spec["high"]) and bools fair coin flips, drawn from `generator` (on the
    same device) if given.
    Without a target spec (losses "sum" and "external" need none) the target is a scalar the loss ignores.
    """
    inputs = tuple(_make_tensor(s, batch_size, device, generator) for s in specs)
    return inputs, _make_tensor(target_spec or {"shape": []}, batch_size, device, generator)


def _make_tensor(spec: dict, batch_size: int, device, generator) -> torch.Tensor:
    shape = [batch_size if d == "batch" else int(d) for d in spec["shape"]]
    dtype = getattr(torch, spec.get("dtype", "float32"), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"input spec {spec}: unknown dtype {spec.get('dtype')!r}")
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, device=device, generator=generator).bool()
    if "high" not in spec:
        raise ValueError(f"input spec {spec}: integer inputs need 'high' (values are drawn in [0, high))")
    return torch.randint(0, spec["high"], shape, dtype=dtype, device=device, generator=generator)


# --- tracing ---------------------------------------------------------------------------------------

def output_tensor(output) -> torch.Tensor:
    """The tensor the loss reads from a model's output: itself, the first element of a tuple or list,
    or a mapping's "logits" (Hugging Face ModelOutput) or first value."""
    if isinstance(output, Mapping):
        output = output["logits"] if "logits" in output else next(iter(output.values()))
    elif isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the model returned {type(output).__name__}, not a tensor (or a tuple or mapping of them)")
    return output


def loss_fn(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss. Cross-entropy takes the classes in the last dimension when the target has the output's
    other dimensions (language models: [B, T, V] and [B, T]), else in dimension 1 as F.cross_entropy
    does (segmentation: [B, C, H, W] and [B, H, W])."""
    if name == "cross_entropy":
        if output.shape[:-1] == target.shape:
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
        return F.cross_entropy(output, target)
    if name == "mse":
        return F.mse_loss(output, target)
    return output.sum()


def _trace(model, inputs, target, loss, autocast, eager: bool = False):
    """Trace the step on fake CPU tensors; return the GraphModule, its placeholders, its constants and the
    values it was specialized on (`eager`: see `capture`; values: gaswap.run.values)."""
    mode = FakeTensorMode()
    params = {k: _fake(p, mode) for k, p in model.named_parameters() if p.requires_grad}
    if eager:  # differentiated by the autograd engine itself: the leaves require grad before tracing
        params = {k: p.requires_grad_() for k, p in params.items()}
    fixed = {k: _fake(p, mode) for k, p in model.named_parameters() if not p.requires_grad}
    fixed |= {k: _fake(b, mode) for k, b in model.named_buffers()}
    names, n_params, n_fixed = list(params), len(params), len(fixed)
    layers = _Layers(model)

    def loss_of(p, f, inputs, target):
        with _autocast(autocast):
            out = torch.func.functional_call(model, (p, f), inputs)
            with layers.annotated("loss"):
                value = loss_fn(loss, output_tensor(out), target)
        layers.watch_backward(value)
        return value

    def output_of(p, f, inputs):
        with _autocast(autocast):
            out = torch.func.functional_call(model, (p, f), inputs)
        layers.watch_backward(out)
        return out

    def step(*flat):
        p = dict(zip(names, flat[:n_params]))
        f = dict(zip(fixed, flat[n_params:n_params + n_fixed]))
        inputs, last = flat[n_params + n_fixed:-1], flat[-1]
        if loss == "external":  # `last` is the gradient of the output; the buffers are arguments, not
            # differentiated, as with grad_and_value (a transformed function may not mutate what it closes over)
            out, vjp = _vjp_with_argnums(output_of, p, f, inputs, argnums=0)
            grads = vjp(last)  # with an int argnums, the gradients of that argument alone
            return (out, *(grads[k] for k in names))
        grads, value = torch.func.grad_and_value(loss_of)(p, f, inputs, last)
        return (value, *(grads[k] for k in names))

    def eager_step(*flat):  # as `loss.backward()` runs it: grad mode off in the backward, no create_graph
        p = dict(zip(names, flat[:n_params]))
        f = dict(zip(fixed, flat[n_params:n_params + n_fixed]))
        inputs, last = flat[n_params + n_fixed:-1], flat[-1]
        with torch.enable_grad():
            if loss == "external":
                out = output_of(p, f, inputs)
                grads = torch.autograd.grad(out, list(p.values()), last, allow_unused=True, materialize_grads=True)
            else:
                out = loss_of(p, f, inputs, last)
                grads = torch.autograd.grad(out, list(p.values()), allow_unused=True, materialize_grads=True)
        return (out.detach(), *grads)

    traced = eager_step if eager else torch.func.functionalize(step, remove="mutations")
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    real = [state[k] for k in (*names, *fixed)] + [*inputs, None if loss == "external" else target]
    labels = [*names, *fixed, *(f"input {i}" for i in range(len(inputs))), "the target"]
    reads = values.ValueReads(real, labels, lambda: _where(model, layers.where[-1] if layers.where else None))

    def reading(*flat):
        with reads:
            return traced(*flat)

    try:
        dispatcher = nullcontext() if eager else enable_python_dispatcher()  # eager runs C++ kernels, not Python decompositions
        with _quiet_fake_tensor_log(), fx_traceback.preserve_node_meta(), dispatcher, layers.active():
            last = _output_like(model, inputs, autocast, mode, real[:-1], labels) if loss == "external" else target
            data = [_fake(x, mode) for x in (*inputs, last)]
            gm = make_fx(reading, tracing_mode="fake")(*params.values(), *fixed.values(), *data)
        gm = eager_masks(gm)  # dropout masks as eager draws them, whatever the layout
    except CaptureError:
        raise
    except values.ValueNeeded as e:
        raise ValuesNeeded(f"cannot capture {type(model).__name__}: {e}. To fix: give example inputs with values "
                           f"(e.g. on the CPU; the model may stay on meta): the step is specialized for the values "
                           f"they give, as torch.compile does") from e
    except Exception as e:  # noqa: BLE001 - any tracing failure becomes one clear CaptureError
        raise CaptureError(_explain(model, layers.failed_at, e)) from e
    sources = [("param", k) for k in params] + [("buffer", k) for k in fixed]
    sources += [("input", f"inputs.{i}") for i in range(len(inputs))]
    sources += [("grad_output", "grad_output")] if loss == "external" else [("input", "target")]
    gm, constants = _rename_placeholders(gm, [_placeholder_name(kind, src) for kind, src in sources])
    sources += [("constant", name) for name in constants]
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]  # as uniquified by fx
    return gm, [(name, kind, src) for name, (kind, src) in zip(names, sources)], constants, tuple(reads.specialized)


def _output_like(model, inputs, autocast, mode: FakeTensorMode, real: list, labels: list[str]) -> torch.Tensor:
    """A meta tensor with the shape and dtype of the model's output (contiguous): the gradient of the
    output that a step with loss "external" is given. Traces the forward pass on fake tensors (`real`: the
    real parameters, then buffers, then inputs, for the values it reads; see gaswap.run.values)."""
    keys = [k for k, p in model.named_parameters() if p.requires_grad]
    keys += [k for k, p in model.named_parameters() if not p.requires_grad] + [k for k, _ in model.named_buffers()]
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    returned = []

    def forward(*flat):
        with values.ValueReads(real, labels, lambda: "the forward pass"), _autocast(autocast):
            out = torch.func.functional_call(model, dict(zip(keys, flat[:len(keys)])), flat[len(keys):])
        returned.append(type(out).__name__)
        return out if isinstance(out, torch.Tensor) else ()

    with torch.no_grad():
        traced = make_fx(forward, tracing_mode="fake")(*(_fake(state[k], mode) for k in keys),
                                                        *(_fake(x, mode) for x in inputs))
    out = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    if not isinstance(out, fx.Node):
        raise CaptureError(f"cannot capture {type(model).__name__} with loss 'external': its forward returns "
                           f"{returned[0]}, not one tensor. To fix: return the tensor the loss reads "
                           f"(the model's output is handed to your loss as it is)")
    return torch.empty(out.meta["val"].shape, dtype=out.meta["val"].dtype, device="meta")


def _autocast(dtype: str | None):
    """CPU autocast to `dtype`, or nothing (tracing runs on fake CPU tensors)."""
    return torch.autocast("cpu", dtype=getattr(torch, dtype)) if dtype else nullcontext()


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """Silence the fake-tensor logger, which logs a traceback for each failing op before raising it."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fake(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake CPU tensor with t's shape, strides and dtype (t's data is never read)."""
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


class _Layers:
    """Tags traced nodes with the module they run in (forward) or the autograd node they run for (backward).

    Forward nodes get `meta["custom"]["layer"]` = module path (from global module hooks); backward
    nodes get `meta["custom"]["grad_fn"]` = the sequence number of the autograd node, which equals the
    `meta["seq_nr"]` of the forward node that created it.
    """

    def __init__(self, model: nn.Module):
        self.paths: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(module), name)
        self.stack: list = []  # open annotation contexts
        self.where: list[str] = []  # module paths entered and not left
        self.failed_at: str | None = None

    def _enter(self, key: str, value) -> None:
        ctx = fx_traceback.annotate({key: value})
        ctx.__enter__()
        self.stack.append(ctx)

    def _exit(self) -> None:
        self.stack.pop().__exit__(None, None, None)

    def _pre(self, module, args) -> None:
        if id(module) in self.paths:
            self.where.append(self.paths[id(module)])
            self._enter("layer", self.paths[id(module)])

    def _post(self, module, args, output) -> None:
        if id(module) in self.paths:
            self.where.pop()
            self._exit()

    @contextmanager
    def annotated(self, layer: str) -> Iterator[None]:
        """Tag the forward nodes traced inside with `layer` (used for the loss)."""
        self.where.append(layer)
        self._enter("layer", layer)
        yield
        self._exit()
        self.where.pop()

    def watch_backward(self, loss: torch.Tensor) -> None:
        """Hook every autograd node behind `loss` so that its backward ops are tagged with its number."""
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            todo += [nxt for nxt, _ in node.next_functions]
            node.register_prehook(lambda grads, seq=node._sequence_nr(): self._enter("grad_fn", seq))
            node.register_hook(lambda grad_inputs, grad_outputs: self._exit())

    @contextmanager
    def active(self) -> Iterator[None]:
        pre = nn.modules.module.register_module_forward_pre_hook(self._pre)
        post = nn.modules.module.register_module_forward_hook(self._post)
        try:
            yield
        except BaseException:
            self.failed_at = self.where[-1] if self.where else None
            raise
        finally:
            pre.remove()
            post.remove()
            while self.stack:
                self._exit()


def _where(model: nn.Module, layer: str | None) -> str:
    """Where in the step a module path is, in words: "module 'bert' (BertModel)", "the loss function"..."""
    if layer is None:
        return "the training step"
    if layer == "loss":
        return "the loss function"
    if layer:
        return f"module '{layer}' ({type(model.get_submodule(layer)).__name__})"
    return f"the top-level forward of {type(model).__name__}"


def _explain(model: nn.Module, layer: str | None, e: Exception) -> str:
    """One message: where tracing failed (module path and type, op), why, and what to do."""
    where = _where(model, layer)
    op = getattr(e, "func", None)
    detail = (str(e).strip().splitlines() or [""])[0].rstrip(".")
    what = [f"op {op}"] if op is not None else []
    if detail and detail != str(op):
        what.append(detail)
    problem = ": ".join(what) or type(e).__name__
    return f"cannot capture {type(model).__name__}: in {where}, {problem}. To fix: {_hint(e)}."


# Messages of ops that read the data of a fake tensor (.tolist(), .numpy()) rather than raise a data-dependent error.
_READS_DATA = ("data-dependent", "unallocated storage", "doesn't have storage")


def _hint(e: Exception) -> str:
    """What to do about a tracing failure, by its kind."""
    data_dependent = (DataDependentOutputException, DynamicOutputShapeException)
    if isinstance(e, data_dependent) or any(s in str(e) for s in _READS_DATA):
        return ("the forward pass depends on tensor values (Python if/while on a tensor, .item(), .tolist(), "
                ".numpy(), nonzero, boolean masks); make control flow depend on shapes only, e.g. with torch.where")
    if isinstance(e, UnsupportedOperatorException):
        return ("the op has no fake-tensor (meta) kernel; register one with torch.library.register_fake, "
                "or compute the same thing with standard torch ops")
    if "setup_context" in str(e):
        return ("torch.func.grad, which capture uses, cannot run a torch.library custom op or an autograd.Function "
                "without a setup_context staticmethod; add setup_context to the Function, or use standard torch ops")
    return ("the step must be traceable by make_fx on fake tensors: no data-dependent control flow, "
            "every tensor registered as a parameter or buffer, inputs and target of matching shapes")


def _placeholder_name(kind: str, source: str) -> str:
    if source in ("target", "grad_output"):
        return source
    prefix = {"param": "p_", "buffer": "b_", "input": "input_"}[kind]
    return re.sub(r"\W", "_", prefix + source.removeprefix("inputs."))


def _rename_placeholders(gm: fx.GraphModule, names: list[str]) -> tuple[fx.GraphModule, dict[str, torch.Tensor]]:
    """A copy of gm whose placeholders are named `names` (other nodes keep their names and meta), and whose
    tensor constants (`get_attr` nodes, e.g. a `torch.tensor([...])` made in forward) are lifted to
    placeholders after them, keeping their names: returns the copy and {name: constant value}."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    todo = iter(names)
    lifted = [n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor)]
    constants = {}
    nodes = list(gm.graph.nodes)
    last_placeholder = max((k for k, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    for k, node in enumerate(nodes):
        if node.op == "placeholder":
            env[node] = g.placeholder(next(todo))
            env[node].meta = dict(node.meta)
        elif node not in env:
            env[node] = g.node_copy(node, env.__getitem__)
        if k == last_placeholder:
            for constant in lifted:
                env[constant] = g.placeholder(constant.name)
                env[constant].meta = dict(constant.meta)
                constants[env[constant].name] = getattr(gm, constant.target).detach()
    return fx.GraphModule(gm, g), constants


# --- graph construction ----------------------------------------------------------------------------

def _build_graph(gm: fx.GraphModule, placeholders, optimizer: str, counted,
                 release: bool = False) -> tuple[Graph, tuple[str, ...]]:
    """The storage-level Graph of a traced step (see the module docstring) and the tensor of each trainable
    parameter's gradient in it; `release`: each autograd node's backward ends with an `autograd.release` op
    (see `capture`'s `eager`)."""
    nodes = list(gm.graph.nodes)
    output = nodes[-1].args[0]
    loss_node, grad_nodes = output[0], output[1:]
    forward = values.ancestors([loss_node])
    layer_of = _layers(nodes, {name: src for name, kind, src in placeholders if kind == "buffer"})
    storage: dict[StorageWeakRef, str] = {}  # storage -> tensor name
    tensors: dict[str, Tensor] = {}
    kinds = {name: kind for name, kind, _ in placeholders}
    ops = []
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            t = node.meta["val"]
            storage[storage_key(t)] = node.name
            kind = kinds.get(node.name, "buffer")
            tensors[node.name] = Tensor(node.name, tensor_nbytes(t), "buffer" if kind == "constant" else kind)
        elif node.op == "call_function":
            op = make_op(node, storage, tensors, node in forward, layer_of.get(node, ""))
            if op is not None:
                ops.append(op)
    if release:
        ops = _with_releases(nodes, ops, storage, tensors, layer_of, forward)
    grads = tuple(storage[storage_key(node.meta["val"])] for node in grad_nodes)
    for name in grads:
        if tensors[name].producer is not None:
            tensors[name] = replace(tensors[name], kind="grad")
    param_bytes = sum(t.size for t in tensors.values() if t.kind == "param")
    # Ops that the loss does not depend on (e.g. BatchNorm's counter update) move after the forward
    # ones: still a topological order, with the whole forward pass first.
    ops.sort(key=lambda op: op.phase != "fwd")
    return Graph(
        tuple(ops),
        tensors,
        resident={"optimizer_state": OPTIMIZER_STATE[optimizer] * param_bytes},
        counted=frozenset(counted),
        loss=storage[storage_key(loss_node.meta["val"])],
    ), grads


def _with_releases(nodes, ops, storage, tensors, layer_of, forward) -> list[Op]:
    """`ops` with an `autograd.release` op after the last op each autograd node runs in the backward (the
    nodes tagged with its `grad_fn`), reading the storages the node's ops read that the node did not make and
    that an op made (its saved activations and its incoming gradients): eager autograd frees them when the
    node has run (`release_variables`, and the node's inputs going out of scope), not after their last
    reader inside the node."""
    held: dict = {}  # grad_fn -> storages read, in order
    group: dict = {}  # grad_fn -> names of its nodes
    last: dict = {}  # grad_fn -> its last node
    for node in nodes:
        seq = node.meta.get("custom", {}).get("grad_fn") if node.op == "call_function" else None
        if seq is None or node in forward:
            continue
        last[seq] = node
        group.setdefault(seq, set()).add(node.name)
        for a in node.all_input_nodes:
            if isinstance(a.meta.get("val"), torch.Tensor):
                held.setdefault(seq, {})[storage[storage_key(a.meta["val"])]] = None
    after: dict = {}  # op name -> release op placed after it
    names = {op.name for op in ops}
    position = {node: k for k, node in enumerate(nodes)}
    for seq, node in last.items():
        reads = [t for t in held.get(seq, ()) if tensors[t].producer not in (None, *group[seq])]
        if not reads:
            continue
        # after the last op of the node that is an Op of the graph (view-only nodes make none)
        anchor = max((n for n in nodes[:position[node] + 1] if n.name in names
                      and n.meta.get("custom", {}).get("grad_fn") == seq), key=position.get, default=None)
        release = Op(f"release_{anchor.name if anchor is not None else node.name}", "autograd.release",
                     tuple(reads), (), "bwd", layer_of.get(node, ""), recomputable=False, signature="autograd.release")
        if anchor is None:  # a node that only views: after the last op before it
            anchor = max((n for n in nodes[:position[node]] if n.name in names), key=position.get)
        after.setdefault(anchor.name, []).append(release)
    out = []
    for op in ops:
        out.append(op)
        out += after.get(op.name, [])
    return out


def make_op(node: fx.Node, storage, tensors, forward: bool, layer: str) -> Op | None:
    """The Op of a call_function node, registering its new storages; None if it creates none and mutates nothing."""
    target = node.target
    is_aten = isinstance(target, torch._ops.OpOverload)
    mutates = _mutates(node)
    outputs = []
    for name, t in tensor_outputs(node, node.meta.get("val")):
        if storage_key(t) not in storage:
            storage[storage_key(t)] = name
            tensors[name] = Tensor(name, tensor_nbytes(t), "activation", node.name)
            outputs.append(name)
    if not outputs and not mutates:
        return None
    args = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    random = is_aten and torch.Tag.nondeterministic_seeded in target.tags
    return Op(
        name=node.name,
        target=str(target),
        inputs=tuple(dict.fromkeys(storage[storage_key(a.meta["val"])] for a in args)),
        outputs=tuple(outputs),
        phase="fwd" if forward else "bwd",
        layer=layer,
        recomputable=not (random or mutates),
        flops=_flops(node) if is_aten else 0.0,
        signature=_signature(node),
    )


def _mutates(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """What identifies a tensor's storage (views and in-place results share it)."""
    return StorageWeakRef(t.untyped_storage())


def tensor_nbytes(t: torch.Tensor) -> int:
    """The bytes of a tensor's whole storage."""
    return t.untyped_storage().nbytes()


def tensor_outputs(node: fx.Node, val) -> list[tuple[str, torch.Tensor]]:
    """(name, value) of each tensor in `val`, what `node` returns (its fake value here, its real result
    in the runtime); tuple elements are named after their getitem node."""
    if isinstance(val, torch.Tensor):
        return [(node.name, val)]
    if not isinstance(val, (tuple, list)):
        return []
    getitems = [u for u in node.users if u.target is operator.getitem]
    names = {u.args[1]: u.name for u in reversed(getitems)}  # the first getitem of an index wins
    return [(names.get(i, f"{node.name}.{i}"), v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]


def _layers(nodes: list[fx.Node], sources: dict[str, str]) -> dict[fx.Node, str]:
    """Module path of each node: its own tag (forward), the tag of the forward node it differentiates
    (backward), or, for an untagged buffer update, the module owning the buffer."""
    created_in: dict[int, str] = {}  # autograd sequence number -> layer of the forward node that created it
    out = {}
    for n in nodes:
        custom = n.meta.get("custom", {})
        if "layer" in custom:
            out[n] = custom["layer"]
            created_in.setdefault(n.meta.get("seq_nr"), custom["layer"])
        elif "grad_fn" in custom:
            out[n] = created_in.get(custom["grad_fn"], "")
        elif _mutates(n) and getattr(n.args[0], "name", None) in sources:
            out[n] = sources[n.args[0].name].rpartition(".")[0]
    return out


def _flops(node: fx.Node) -> float:
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is None:
        return 0.0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
    return float(formula(*args, **kwargs, out_val=node.meta["val"]))


def _signature(node: fx.Node) -> str:
    """Canonical JSON of the op and its arguments (tensors as shape/dtype[/stride]): equal for equal work."""
    body = {"target": str(node.target), "args": _jsonable(node.args), "kwargs": _jsonable(node.kwargs)}
    return json.dumps(body, sort_keys=True)


def _jsonable(a):
    if isinstance(a, fx.Node):
        a = a.meta.get("val")
    if isinstance(a, torch.Tensor):
        spec = {"shape": list(a.shape), "dtype": _dtype_name(a.dtype)}
        if not a.is_contiguous():
            spec["stride"] = list(a.stride())
        return spec
    if isinstance(a, (list, tuple)):
        return [_jsonable(x) for x in a]
    if isinstance(a, dict):
        return {str(k): _jsonable(v) for k, v in a.items()}
    if isinstance(a, torch.dtype):
        return _dtype_name(a)
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    return str(a)  # device, layout, memory_format


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
