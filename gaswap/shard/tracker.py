"""FSDPMemTracker's per-category peak of one rank under torch's fake process group (no ranks needed: with fake
tensors nothing is allocated, so any world size and model size runs here)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from gaswap.run.training import make_optimizer, split_step

# gaswap.plan.sharding's names for FSDPMemTracker's categories (`_FSDPRefType` values)
TRACKER_CATEGORIES = {
    "Sharded Param": "sharded params", "Unsharded Param": "unsharded params", "Buffer": "buffers",
    "Sharded Grad": "sharded grads", "Unsharded Grad": "unsharded grads", "Activation": "activations",
    "Temp": "temporaries", "All Gather": "all-gather buffers", "Reduce Scatter": "reduce-scatter buffers",
    "OptState": "optimizer state", "Inputs": "inputs",
}


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0, mesh_shape: tuple | None = None):
    """torch's fake process group of `world_size` ranks (this process is `rank`) and a CPU device mesh: 1-D, or
    `mesh_shape` (replicate, shard) for HSDP."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        shape = tuple(mesh_shape or (world_size,))
        yield init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)
    finally:
        dist.destroy_process_group()


def apply_fsdp(model: nn.Module, units, mesh, *, reshard_after_forward=None, forward_prefetch: int = 0,
               backward_prefetch: int = 1, offload=()) -> nn.Module:
    """`fully_shard` on every unit (module paths, "" the root), innermost first, with the knobs of
    `gaswap.plan.sharding.ShardSpec` (None: FSDP2's default; prefetch depths through set_modules_to_*_prefetch);
    the units in `offload` with `CPUOffloadPolicy` (pinned host memory where CUDA is present)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    def policy(unit: str):
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if unit in offload else OffloadPolicy()

    modules = dict(model.named_modules())
    paths = sorted((u for u in units if u), key=lambda u: -u.count("."))
    for u in paths:
        raf = reshard_after_forward.get(u, True) if isinstance(reshard_after_forward, dict) else reshard_after_forward
        fully_shard(modules[u], mesh=mesh, offload_policy=policy(u),
                    **({} if raf is None else {"reshard_after_forward": raf}))
    raf = reshard_after_forward.get("", None) if isinstance(reshard_after_forward, dict) else reshard_after_forward
    fully_shard(model, mesh=mesh, offload_policy=policy(""), **({} if raf is None else {"reshard_after_forward": raf}))
    ordered = [modules[u] for u in units if u]  # forward order of the units
    if forward_prefetch > 0:
        for i, m in enumerate(ordered):
            m.set_modules_to_forward_prefetch(ordered[i + 1:i + 1 + forward_prefetch])
    if backward_prefetch > 1:
        for i, m in enumerate(ordered):
            m.set_modules_to_backward_prefetch(list(reversed(ordered[max(0, i - backward_prefetch):i])))
    return model


@contextlib.contextmanager
def _post_forward_mesh_outside_fake_mode():
    """An integer `reshard_after_forward` makes `fully_shard` build the post-forward device mesh from the mesh's
    rank tensor (`_get_post_forward_mesh_info`); under FakeTensorMode that real int tensor is refused. Inside this
    block the mesh is built with the fake mode set aside (it holds ranks, no model data)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp._fully_shard import _fully_shard

    original = _fully_shard._get_post_forward_mesh_info

    def outside(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    _fully_shard._get_post_forward_mesh_info = outside
    try:
        yield
    finally:
        _fully_shard._get_post_forward_mesh_info = original


@contextlib.contextmanager
def _module_hooks_keep_no_grads():
    """FSDPMemTracker's ModTracker learns that a module's backward is done through
    `register_multi_grad_hook(module inputs, fn)` (mode "all"), whose hooks keep each input's gradient in a
    buffer until every input's gradient has come: the tracker then holds gradients that eager FSDP2, untracked,
    frees at once (e.g. the gradient of zoo.gpt's tied head's input, kept until the embedding's gradient
    completes at the end of the backward). Inside this block ModTracker gets the same hook that keeps None in
    place of the gradients (its callbacks do not read them), so the tracker measures the run as it is without
    it."""
    import threading

    from torch.distributed._tools import mod_tracker

    original = mod_tracker.register_multi_grad_hook

    def counting(tensors, fn, *, mode="all"):
        if mode != "all":
            return original(tensors, fn, mode=mode)
        from torch.autograd.graph import _get_grad_fn_or_grad_acc

        grad_fns = [_get_grad_fn_or_grad_acc(t) for t in tensors]
        n = len(tensors)  # the hooks must not hold the tensors themselves
        count: dict[int, int] = {}
        expected: dict[int, int] = {}
        lock = threading.Lock()

        def hook(grad):
            task = torch._C._current_graph_task_id()
            with lock:
                if task not in count:
                    count[task] = 0
                    expected[task] = sum(map(torch._C._will_engine_execute_node, grad_fns))
                count[task] += 1
                done = count[task] == expected[task]
                if done:
                    del count[task], expected[task]
            if done:
                fn([None] * n)

        return _Handles([t.register_hook(hook) for t in tensors])

    mod_tracker.register_multi_grad_hook = counting
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def remove(self):
        for h in self.handles:
            h.remove()


def measure_fsdp_tracker(make_model, make_inputs, units, world_size: int, *, optimizer: str = "adam",
                         reshard_after_forward=None, forward_prefetch: int = 0, backward_prefetch: int = 1,
                         fake: bool = True, steps: int = 2, hold_grads: bool = True, mesh_shape=None) -> dict:
    """FSDPMemTracker's peak snapshot of rank 0, {gaswap category: bytes} plus "total", for `steps` training
    steps (`model(*inputs).sum()`, backward, optimizer step, zero_grad; the peak of them all: the last, once the
    optimizer has its state) of `make_model()` sharded over `world_size` ranks of the fake process group.
    `fake`: the model and inputs are made under FakeTensorMode (nothing allocated). `hold_grads` False: the
    tracker's module hooks keep no gradients (`_module_hooks_keep_no_grads`: the run as it is untracked); True,
    the tracker as torch ships it. `mesh_shape` (replicate, shard): HSDP over a 2-D mesh of `world_size` ranks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    with fake_process_group(world_size, mesh_shape=mesh_shape) as mesh, (FakeTensorMode() if fake else contextlib.nullcontext()), \
            (contextlib.nullcontext() if hold_grads else _module_hooks_keep_no_grads()):
        with _post_forward_mesh_outside_fake_mode():
            model = apply_fsdp(make_model(), units, mesh, reshard_after_forward=reshard_after_forward,
                               forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch)
        opt = make_optimizer(optimizer, model)
        inputs = make_inputs()
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs(tuple(inputs))
        with tracker:
            for i in range(steps):
                if i:
                    tracker.reset_mod_stats()
                split_step(model, opt, inputs)
        snap = tracker.get_tracker_snapshot("peak")
    (dev_snap,) = snap.values()
    out = {TRACKER_CATEGORIES[str(k.value)]: int(v) for k, v in dev_snap.items() if k != "Total"}
    out["total"] = int(dev_snap["Total"])
    return out


def measure_fake_pg_peak(make_model, make_inputs, units, world_size: int, *, rank: int = 0, optimizer: str = "adam",
                         steps: int = 3, **knobs) -> dict:
    """Rank `rank` of `make_model()` sharded over `world_size` ranks of the fake process group, with real tensors
    (the collectives move no data; every buffer is allocated as on a real run): {"peak_above_start": the last
    step's forward+backward peak above what was allocated before it (the CPU allocator's counts, as
    `gaswap.shard.gloo` meters a gloo rank), "resident_at_start": `resident_bytes` before that step}."""
    with fake_process_group(world_size, rank) as mesh:
        torch.manual_seed(0)
        model = apply_fsdp(make_model(), units, mesh, **knobs)
        opt = make_optimizer(optimizer, model)
        inputs = make_inputs()
        for step in range(steps):
            if step == steps - 1:
                resident = resident_bytes(model, opt, inputs)
            last = split_step(model, opt, inputs, metered=step == steps - 1)
    return {"peak_above_start": last.peak, "resident_at_start": resident}


def resident_bytes(net, opt, args) -> int:
    """Bytes allocated before a step: the sharded parameters' storages, the optimizer's state, the buffers and
    the inputs (each storage once)."""
    seen, total = set(), 0
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in net.parameters()]
    tensors += [v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    tensors += list(net.buffers()) + [a for a in args if isinstance(a, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
