"""Real FSDP2 training steps on the CPU: `world_size` processes (gloo backend), each rank metering its peak with
the CPU allocator's counts (`gaswap.run.peak_meter.PeakMeter`) and timing its steps in CPU seconds.

What gloo does to a rank's memory, and how the meter is kept honest (measured here, torch 2.13):

- each collective allocates one buffer of its full size while it runs: the all-gather a flat output it copies
  back from (on gloo's worker thread), the reduce-scatter a clone of its input (`c10d::_reduce_scatter_base_`
  clones it on the calling thread); both go when the collective is done. Real memory that NCCL does not use:
  `gloo_peak` adds it to the rank model's figure at each collective;
- the profiler counts a free only on a thread it follows: when gloo's worker thread drops the last reference to
  a buffer (it keeps the collective's work object, which holds its tensors, a moment after the caller goes on),
  the free is never counted and the meter reads that buffer as allocated to the end of the block, a whole
  buffer too high (by chance, on some ranks and steps). So the process group runs one worker thread, and on
  metered steps each collective is followed by a fence (a one-element all-reduce on a tensor made before the
  step, `_fenced`): the single worker starts the fence only after it has dropped the collective's work, so
  the caller's reference is the last and the buffers are freed, and counted, on the calling thread.
"""
from __future__ import annotations

import importlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gaswap.run.capture import make_inputs
from gaswap.run.measure import use_cpu
from gaswap.run.training import make_optimizer, split_step
from gaswap.shard.apply import shard
from gaswap.shard.tracker import apply_fsdp, resident_bytes

COLLECTIVE_SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)  # bytes of the full (world-size) buffer, for the link fit


def _resolve(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _fenced(call, fence: torch.Tensor):
    """`call` (dist.all_gather_single / reduce_scatter_single, what FSDP2 issues) run synchronously, then a fence
    (an all-reduce of `fence`, allocated before the step) through gloo's single worker thread: once the fence
    has run, the worker no longer holds the collective's work, and the work and its buffers go here."""

    def fenced(*args, async_op=False, **kwargs):
        work = call(*args, async_op=True, **kwargs)
        if async_op:  # FSDP2 waits later: leave it as it is
            return work
        work.wait()
        dist.all_reduce(fence, async_op=True).wait()
        del work
        return None

    return fenced


def _one_worker(gloo_class):
    """A `ProcessGroupGloo` that init_process_group makes as it makes gloo's (store, rank, size, timeout), with
    one worker thread (gloo's default is 2), so that its work runs, and is let go of, in issue order."""

    class OneWorker(gloo_class):
        def __init__(self, store, rank, size, timeout):
            options = gloo_class._Options()
            options._timeout = timeout
            options._threads = 1
            options._devices = [gloo_class.create_default_device()]
            super().__init__(store, rank, size, options)

    return OneWorker


def make_batch(inputs) -> tuple[tuple, torch.Tensor | None]:
    """(input tuple, target or None) of a gloo run, the same on every rank: `inputs` "module:function" (called
    with no arguments, no target) or an experiment's tensors as data, {"inputs": [spec, ...], "target": spec or
    None, "batch_size": n, "seed": s} (specs as `inputs:` / `target:` write them: shape with "batch", dtype,
    high), drawn with `gaswap.run.capture.make_inputs` from a generator seeded with `seed`."""
    if isinstance(inputs, str):
        return _resolve(inputs)(), None
    args, target = make_inputs(list(inputs["inputs"]), inputs.get("target"), int(inputs["batch_size"]), "cpu",
                               torch.Generator().manual_seed(int(inputs.get("seed", 1))))
    return args, target if inputs.get("target") else None


def _rank_main(rank: int, world_size: int, store_path: str, out_dir: str, model: str, model_kwargs: dict,
               inputs, units: list, optimizer: str, steps: int, metered: int, knobs: dict,
               collectives: list, repeats: int, plan: dict | None = None, record: bool = False,
               loss: str = "sum") -> None:
    from torch.distributed.device_mesh import init_device_mesh

    use_cpu(1)  # as ops are timed: one thread, glibc keeps freed memory (no page faults for reused buffers)

    store = dist.FileStore(store_path, world_size)
    c10d = dist.distributed_c10d
    gloo_class = c10d.ProcessGroupGloo
    c10d.ProcessGroupGloo = _one_worker(gloo_class)  # init_process_group ignores gloo's pg_options
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    finally:
        c10d.ProcessGroupGloo = gloo_class
    backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
    if backend.options._threads != 1:
        raise RuntimeError(f"gloo runs {backend.options._threads} worker threads, not 1: the fence needs one")
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)
        net = _resolve(model)(**model_kwargs)
        net = shard(net, plan, mesh) if plan is not None else apply_fsdp(net, units, mesh, **knobs)
        opt = make_optimizer(optimizer, net)
        args, target = make_batch(inputs)
        fence = torch.zeros(1)
        plain = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
        peaks, fwd_bwd, step_cpu, wall = [], [], [], []
        recorded = {"loss": [], "grads": [], "params": []}
        for step in range(steps):
            metering = step >= steps - metered
            if metering:  # the last steps are metered (the profiler slows them): forward and backward
                for name, call in plain.items():
                    setattr(dist, name, _fenced(call, fence))
            dist.barrier()
            started_wall = time.perf_counter()
            done = split_step(net, opt, args, loss=loss, target=target, metered=metering,
                              before_step=(lambda m: recorded["grads"].append(_local(m, "grad"))) if record else None)
            if record:
                recorded["loss"].append(done.loss)
                recorded["params"].append(_local(net))
            if metering:
                peaks.append(done.peak)
            elif step > 0:  # the first step warms up (and makes the optimizer's state)
                fwd_bwd.append(done.forward_backward_s)
                step_cpu.append(done.step_s)
                wall.append(time.perf_counter() - started_wall)
        for name, call in plain.items():
            setattr(dist, name, call)
        if record:
            torch.save(recorded, Path(out_dir, f"rank{rank}.pt"))
        resident = resident_bytes(net, opt, args)
        times = _time_collectives(world_size, collectives, repeats)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "peak_above_start": min(peaks), "peaks_above_start": peaks, "resident_at_start": resident,
             "fwd_bwd_cpu_s": fwd_bwd, "step_cpu_s": step_cpu, "step_wall_s": wall,
             "cpu_step_s": statistics.median(step_cpu) if step_cpu else None, "collective_s": times}))
    finally:
        dist.destroy_process_group()


def _local(model, attr: str | None = None) -> dict:
    """{name: this rank's shard of each parameter (or of its gradient, `attr` "grad"), cloned}."""
    out = {}
    for name, p in model.named_parameters():
        t = p if attr is None else getattr(p, attr)
        out[name] = None if t is None else (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
    return out


def _time_collectives(world_size: int, sizes, repeats: int) -> dict:
    """{"<kind>:<bytes>": {"cpu": [...], "wall": [...]}}: CPU seconds of this process (its threads, gloo's
    worker included) and wall seconds per all-gather / reduce-scatter of float32 buffers of `bytes` (the
    all-gather's output, the reduce-scatter's input), `repeats` times each after one warm-up."""
    out = {}
    for n in sizes:
        shard = torch.ones(n // 4 // world_size)
        full = torch.ones(shard.numel() * world_size)
        for kind in ("all_gather", "reduce_scatter"):
            call = ((lambda full=full, shard=shard: dist.all_gather_single(full, shard)) if kind == "all_gather"
                    else (lambda full=full, shard=shard: dist.reduce_scatter_single(shard, full)))
            call()
            cpu, wall = [], []
            for _ in range(repeats):
                dist.barrier()
                c0, w0 = time.process_time(), time.perf_counter()
                call()
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
            out[f"{kind}:{n}"] = {"cpu": cpu, "wall": wall}
    return out


def run_gloo(model: str, inputs, units, world_size: int, *, model_kwargs: dict | None = None,
             optimizer: str = "adam", steps: int = 7, metered: int = 3, knobs: dict | None = None, collectives=(),
             repeats: int = 5, plan: dict | None = None, record: bool = False, loss: str = "sum") -> list[dict]:
    """Train `steps` steps of `model` ("module:factory", called with `model_kwargs`) on `inputs` (the same on every
    rank: "module:function" returning the input tuple, or an experiment's input specs, see `make_batch`) with
    `loss` ("sum", or one taking the specs' target) under fully_shard over `world_size` gloo processes. Per
    rank (rank order): the forward+backward peak above what was allocated before it (the CPU allocator's
    counts, gloo's late frees fenced: see the module docstring) of each of the last `metered` steps
    (`peaks_above_start`, and the lowest, `peak_above_start`), the bytes resident before a step, the CPU
    seconds of forward+backward (`fwd_bwd_cpu_s`) and of the whole step with the optimizer's (`step_cpu_s`),
    and its wall seconds, of each unmetered step after the first (`cpu_step_s`: the median), and the CPU and
    wall seconds of `repeats` all-gathers / reduce-scatters of each byte count in `collectives`. `plan`: a sharded
    plan's data applied by `gaswap.shard.apply.shard` in place of `knobs`; `record`: also, per step, the loss and
    this rank's shards of the gradients (before the optimizer step) and of the parameters (after it), as
    `recorded` {"loss": [...], "grads": [{name: tensor}], "params": [...]}."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        torch.multiprocessing.spawn(_rank_main, args=(world_size, store, tmp, model, model_kwargs or {}, inputs,
                                                      list(units), optimizer, steps, metered, knobs or {},
                                                      list(collectives), repeats, plan, record, loss),
                                    nprocs=world_size, join=True)
        out = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
        if record:
            for r, result in enumerate(out):
                result["recorded"] = torch.load(Path(tmp, f"rank{r}.pt"), weights_only=True)
        return out


def checkpoint_rng_bytes() -> int:
    """Bytes of the RNG state torch's checkpoint stashes on this device per checkpointed forward (a CPU run: the
    CPU generator's state, `torch.get_rng_state()`; `ShardSpec.checkpoint_rng_bytes`)."""
    return torch.get_rng_state().nbytes


def gloo_peak(report, rank) -> int:
    """A rank's peak on gloo: the rank model's (`report`, `gaswap.plan.sharding.memory_report(rank)`), or, if
    higher, the bytes live at a collective plus the buffer gloo allocates while it runs (its full size: the
    all-gather's output, the reduce-scatter's input; see the module docstring)."""
    at = {name: total for name, total, _ in report.timeline}
    during = [at[op] + n for op, n in rank.collective_bytes.items() if op in at]
    return max([report.peak] + during)
