"""Real FSDP2 training steps on the CPU: `world_size` processes (gloo backend), each rank metering its peak with
the CPU allocator's counts (`gaswap.run.peak_meter.PeakMeter`) and timing its steps in CPU seconds."""
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

from gaswap.run.peak_meter import PeakMeter
from gaswap.shard.tracker import apply_fsdp, build_optimizer


def _resolve(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _settled(name: str):
    """`dist.<name>` (the call FSDP2 makes for its collectives) that, once the collective is done, also waits (at
    most 50 ms) until gloo's worker thread has dropped its references to the tensors, so that a buffer FSDP frees
    goes when FSDP frees it; without this a rank may hold a freed buffer a moment longer, by chance."""
    call = getattr(dist, name)

    def settled(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        before = [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors]
        out = call(*args, **kwargs)
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline and any(
                torch._C._storage_Use_Count(t.untyped_storage()._cdata) > n for t, n in zip(tensors, before)):
            time.sleep(0)
        return out

    return settled


def _rank_main(rank: int, world_size: int, store_path: str, out_dir: str, model: str, model_kwargs: dict,
               inputs: str, units: list, optimizer: str, steps: int, metered: int, knobs: dict,
               collectives: list, settle: bool = False) -> None:
    torch.set_num_threads(1)
    if settle:
        for name in ("all_gather_single", "reduce_scatter_single"):
            setattr(dist, name, _settled(name))
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)
        net = apply_fsdp(_resolve(model)(**model_kwargs), units, mesh, **knobs)
        opt = build_optimizer(optimizer, net.parameters())
        args = _resolve(inputs)()
        peaks, cpu = [], []
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            started = time.process_time()
            if step >= steps - metered:  # the last steps are metered (the profiler slows them): forward and backward
                with PeakMeter("cpu") as meter:
                    net(*args).sum().backward()
                peaks.append(meter.peak)
            else:
                net(*args).sum().backward()
            opt.step()
            if 0 < step < steps - metered:
                cpu.append(time.process_time() - started)
        opt.zero_grad(set_to_none=True)
        resident = _resident(net, opt, args)
        times = {}
        for n in collectives:  # seconds per collective of n bytes (float32), after one warm-up
            shard = torch.empty(n // 4 // world_size)
            full = torch.empty(shard.numel() * world_size)
            for kind in ("all_gather", "reduce_scatter"):
                call = ((lambda: dist.all_gather_into_tensor(full, shard)) if kind == "all_gather"
                        else (lambda: dist.reduce_scatter_tensor(shard, full)))
                call()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(5):
                    call()
                times[f"{kind}:{n}"] = (time.perf_counter() - t0) / 5
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "peak_above_start": min(peaks), "peaks_above_start": peaks, "resident_at_start": resident,
             "cpu_step_s": statistics.median(cpu) if cpu else None, "collective_s": times}))
    finally:
        dist.destroy_process_group()


def _resident(net, opt, args) -> int:
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


def run_gloo(model: str, inputs: str, units, world_size: int, *, model_kwargs: dict | None = None,
             optimizer: str = "adam", steps: int = 7, metered: int = 3, knobs: dict | None = None, collectives=()) -> list[dict]:
    """Train `steps` steps of `model` ("module:factory", called with `model_kwargs`) on `inputs` ("module:function"
    returning the input tuple, the same on every rank) under fully_shard over `world_size` gloo processes; per rank
    (rank order), with `settle` (gloo's late release waited for, see `_settled`): the forward+backward peak above what was allocated before it (the CPU allocator's counts) of
    each of the last `metered` steps (`peaks_above_start`) and the lowest (`peak_above_start`: gloo's worker
    thread drops its reference to a collective's tensors a moment after the caller goes on, so a buffer FSDP
    frees may outlive its free on some ranks and some steps, a race that adds whole buffers), the bytes resident
    before a step, the median CPU seconds of the middle steps (forward, backward,
    optimizer step), and seconds per all-gather / reduce-scatter of each byte count in `collectives`."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        torch.multiprocessing.spawn(_rank_main, args=(world_size, store, tmp, model, model_kwargs or {}, inputs,
                                                      list(units), optimizer, steps, metered, knobs or {},
                                                      list(collectives)),
                                    nprocs=world_size, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
