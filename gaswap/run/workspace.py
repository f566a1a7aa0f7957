"""What a GPU holds beyond the graph's tensors, measured on the device (docs/gpu_memory.md, "Memory the graph
does not hold"): cuBLAS's workspace, made once through the caching allocator at the first matmul and kept
(`workspace_bytes`), and each op's transients, allocated and freed while it runs: cuDNN's workspaces, temporaries
inside an op such as the attention matrix of SDPA's math replacement (`op_transients`). Both go to the allocator
model (`allocator.replay(workspace=..., transients=...)`). Op calls are built as op timing builds them
(`measure.op_call`: what the runtime runs on the device, inputs drawn like real ones).
"""
from __future__ import annotations

import logging

import torch
from torch.utils._pytree import tree_leaves

from gaswap.plan.graph import Graph
from gaswap.run.measure import op_call

log = logging.getLogger(__name__)


def workspace_bytes(device, *, api=None) -> int:
    """Bytes a first matmul on `device` leaves allocated beyond its output: cuBLAS's workspace (0 on a CPU)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    api = api or torch.cuda
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()  # made again by the next matmul, through the allocator
    api.synchronize(dev)
    before = api.memory_allocated(dev)
    a = torch.ones(8, 8, device=dev)
    out = a @ a
    api.synchronize(dev)
    return max(0, api.memory_allocated(dev) - before - _bytes(a) - _bytes(out))


def op_transients(graph: Graph, device, *, api=None) -> dict[str, int]:
    """{op name: bytes it allocates and frees while it runs} for the ops of `graph` that do (CUDA; {} elsewhere),
    each signature measured once: the allocator's peak during one call, less what was there before and what the
    call returns. The call is made once before (handles and the workspace, kept, are not an op's transients). An
    op that cannot run standalone counts none (op timing prices it by roofline, and says so). `api`: torch.cuda's
    memory functions (a stand-in measures elsewhere, as the CPU tests do)."""
    dev = torch.device(device)
    if api is None and dev.type != "cuda":
        return {}
    api = api or torch.cuda
    by_signature: dict[str, int] = {}
    for op in graph.ops:
        if op.signature not in by_signature:
            by_signature[op.signature] = _transient(op.signature, dev, api)
    return {op.name: by_signature[op.signature] for op in graph.ops if by_signature[op.signature]}


def _transient(signature: str, dev: torch.device, api) -> int:
    try:
        fn, args, kwargs = op_call(signature, dev)
        with torch.no_grad():
            fn(*args, **kwargs)
            api.synchronize(dev)
            api.reset_peak_memory_stats(dev)
            before = api.memory_allocated(dev)
            out = fn(*args, **kwargs)
            api.synchronize(dev)
            return max(0, api.max_memory_allocated(dev) - before - _bytes(out))
    except Exception as e:  # noqa: BLE001 - an op that cannot run alone has no measured transient
        log.info("no transient measured for %s (%s: %s)", signature[:120], type(e).__name__, str(e)[:200])
        return 0


def _bytes(out) -> int:
    """Bytes of the distinct storages of the tensors in `out`."""
    storages = {}
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
