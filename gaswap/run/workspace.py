"""What a GPU holds beyond the graph's tensors, measured on the device (docs/gpu_memory.md, "Memory the graph
does not hold"): cuBLAS's workspace, made once through the caching allocator at the first matmul and kept
(`workspace_bytes`), and each op's transients, allocated and freed while it runs: cuDNN's workspaces, temporaries
inside an op such as the attention matrix of SDPA's math replacement (`op_transients`). Both go to the allocator
model (`allocator.replay(workspace=..., transients=...)`). Op calls are built as op timing builds them
(`measure.op_call`: what the runtime runs on the device, inputs drawn like real ones).

A search keeps their sum under the budget (`margin`: docs/gpu_memory.md, "The margin a search keeps"): measured
on a CUDA device, from a hardware profile's architecture where the device is absent, none on a CPU.
"""
from __future__ import annotations

import gc
import logging
import os
import re
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.utils._pytree import tree_leaves

from gaswap.plan.costs import Costs
from gaswap.plan.graph import Graph
from gaswap.plan.memory import allocator
from gaswap.run.measure import op_call, resolve_device

log = logging.getLogger(__name__)

# cuBLAS's workspace with CUBLAS_WORKSPACE_CONFIG unset: torch's `parseChosenWorkspaceSize`
# (aten/src/ATen/cuda/CublasHandlePool.cpp): 4096 KiB x 8 = 32 MiB on compute capability 9.x (Hopper; 10.x and
# 12.x, Blackwell, in the current source), else ":4096:2:16:8" = 8 MiB + 128 KiB. cuBLASLt uses the same one
# (`TORCH_CUBLASLT_UNIFIED_WORKSPACE`, on by default). One per stream that runs a matmul: gaswap's runtime runs
# every op of the step on the compute stream, from one thread.
CUBLAS_WORKSPACE_32MIB = 4096 * 1024 * 8
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
WORKSPACE_32MIB_MAJORS = (9, 10, 12)
# compute capability of each shipped GPU profile (its file's first line names the architecture)
PROFILE_CAPABILITY = {"h100-sxm-80gb": (9, 0), "a100-pcie-40gb": (8, 0), "v100-pcie-16gb": (7, 0)}


@dataclass(frozen=True)
class Margin:
    """What a search keeps under the budget for what the device holds beyond the graph's tensors: cuBLAS's
    workspace (kept all step) plus the largest transient of one op (ops run one at a time on the compute
    stream), and where the figures come from (`source`, `note`: what they leave out); `transients`, each op's
    measured (`op_transients`: the search's policies predict with them, `workflow.device_peak`); `capped_seconds`,
    the times of the ops whose transient shrinks when memory is short, timed so (`capped_costs`)."""

    workspace_bytes: int
    transient_bytes: int
    transient_op: str | None
    source: str
    note: str = ""
    transients: dict = field(default_factory=dict, compare=False)
    capped_seconds: dict = field(default_factory=dict, compare=False)  # `Transients.capped_seconds`

    @property
    def margin_bytes(self) -> int:
        return self.workspace_bytes + self.transient_bytes

    def reserved_bytes(self, expandable_segments: bool = False) -> int:
        """What the two may add to the allocator's reservations, at most: each in a segment (or pages) of its own."""
        return sum(_footprint(n, expandable_segments) for n in (self.workspace_bytes, self.transient_bytes) if n)

    def as_dict(self) -> dict:
        """The record results and policy files keep (each op's transients and times left out)."""
        return {k: v for k, v in asdict(self).items() if k not in ("transients", "capped_seconds")} \
            | {"margin_bytes": self.margin_bytes, "ops_timed_capped": len(self.capped_seconds)}


def _footprint(nbytes: int, expandable: bool) -> int:
    """The most a block of `nbytes` kept or made at the peak adds to the reservations: the segment a request that
    no cached block serves gets; with expandable segments, its size in whole pages of its pool."""
    size = allocator.round_size(nbytes)
    if not expandable:
        return allocator.allocation_size(size)
    page = allocator.SMALL_BUFFER if size <= allocator.SMALL_SIZE else allocator.LARGE_BUFFER
    return -(-size // page) * page


def cublas_workspace(capability: tuple[int, int], config: str | None = None) -> int:
    """cuBLAS's workspace in bytes on a device of compute `capability`, as torch sizes it: `config` (the value of
    CUBLAS_WORKSPACE_CONFIG, ":SIZE_KiB:COUNT" pairs) when it parses, else the default for the architecture."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return CUBLAS_WORKSPACE_32MIB if capability[0] in WORKSPACE_32MIB_MAJORS else CUBLAS_WORKSPACE_DEFAULT


def margin(costs: Costs, device: str, graph: Graph) -> Margin:
    """The margin a search on `graph` keeps under its budget, for the `costs` it plans with: from the hardware
    profile they were estimated from (cuBLAS's default workspace for its architecture; op transients unknown);
    measured on the device they were measured on (`device`, the experiment's `costs.device`; CUDA:
    `workspace_bytes` and `op_transients`; none on a CPU: no workspace, and the step meter sees no op transient,
    docs/gpu_memory.md); none for costs from neither (a test's)."""
    if costs.source.startswith("estimated:"):
        return profile_margin(costs.source.removeprefix("estimated:"))
    if costs.source != "measured":
        return Margin(0, 0, None, f"costs {costs.source}", "neither measured on a device nor from a hardware profile")
    dev = resolve_device(device)
    if dev.type == "cpu":
        return Margin(0, 0, None, "cpu", "no cuBLAS workspace; the tensors a CPU kernel allocates inside it "
                                         "(convolutions' scratch) are host memory the step meter does not count")
    measured = measure_transients(graph, dev)
    transients = measured.bytes
    op = max(transients, key=transients.get, default=None)
    return Margin(workspace_bytes(dev), transients.get(op, 0), op, f"measured on {dev}",
                  "each op's least transient: cuDNN takes a larger workspace where the device has memory to spare "
                  "(a run capped at the budget, `capped`, leaves it none)", transients, measured.capped_seconds)


def capped_costs(costs: Costs, margin: Margin) -> Costs:
    """`costs` with the times of the ops `margin` timed capped (`capped_seconds`): what they take in a run capped
    at an absolute budget, where cuDNN's convolutions get the least workspace and its slower plans (on an H100,
    AlexNet's planned at 6.5 GB ran 1.8-2.1x the step time its ops predicted timed alone with the whole device free:
    results/gpu_check/, run 8)."""
    if not margin.capped_seconds:
        return costs
    return replace(costs, op_time=costs.op_time | margin.capped_seconds)


def profile_margin(profile: str) -> Margin:
    """The margin for costs estimated from a shipped hardware profile: cuBLAS's workspace on its architecture
    (CUBLAS_WORKSPACE_CONFIG as set here, else torch's default); none for the CPU profile."""
    capability = PROFILE_CAPABILITY.get(profile)
    if capability is None:
        return Margin(0, 0, None, f"profile {profile}", "not a GPU profile: no cuBLAS workspace")
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    setting = f"CUBLAS_WORKSPACE_CONFIG={config}" if re.search(r":[0-9]+:[0-9]+", config or "") else "torch's default"
    return Margin(cublas_workspace(capability, config), 0, None,
                  f"profile {profile}: cuBLAS workspace on sm_{capability[0]}{capability[1]}, {setting}",
                  "op transients (cuDNN workspaces, temporaries inside ops) need the device: not counted")


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


@dataclass(frozen=True)
class Transients:
    """What `measure_transients` measured: `bytes`, {op name: bytes it allocates and frees while it runs} (ops that
    do); `capped_seconds`, {op name: seconds per call capped at its least transient} for the ops whose least is
    below their transient with memory to spare (cuDNN's convolutions, whose plans differ in speed too)."""

    bytes: dict[str, int]
    capped_seconds: dict[str, float]


def op_transients(graph: Graph, device, *, api=None, least: bool = True) -> dict[str, int]:
    """{op name: bytes it allocates and frees while it runs} for the ops of `graph` that do (`measure_transients`)."""
    return measure_transients(graph, device, api=api, least=least).bytes


def measure_transients(graph: Graph, device, *, api=None, least: bool = True) -> Transients:
    """Each op's transient (CUDA; none elsewhere), each signature measured once: the allocator's peak during one
    call, less what was there before and what the call returns. The call is made once before (handles and the
    workspace, kept, are not an op's transients). An op that cannot run standalone counts none (op timing prices
    it by roofline, and says so).

    With `least` (the default), the least the op runs with: cuDNN's convolutions take a workspace as large as
    the device has free (torch tries cuDNN's plans in turn and skips one whose workspace it cannot allocate;
    on an 80 GB H100 AlexNet's first convolution's backward takes 2.2 GB, and 10 KB when memory is short), so
    the op is called again with the process capped (`capped`) at what it holds plus a headroom that grows
    eightfold from 2 MiB until the call runs; the transient then is its least, and where that is less than with
    memory to spare the op is timed there too (`Transients.capped_seconds`). Without, the transient on a device
    with memory to spare. `api`: torch.cuda's memory functions (a stand-in measures elsewhere, as the CPU tests
    do; one without `set_per_process_memory_fraction` gives the transient with memory to spare)."""
    dev = torch.device(device)
    if api is None and dev.type != "cuda":
        return Transients({}, {})
    api = api or torch.cuda
    by_signature: dict[str, tuple[int, float | None]] = {}
    for op in graph.ops:
        if op.signature not in by_signature:
            by_signature[op.signature] = _transient(op.signature, dev, api, least)
    measured = {op.name: by_signature[op.signature] for op in graph.ops}
    return Transients({name: n for name, (n, _) in measured.items() if n},
                      {name: s for name, (_, s) in measured.items() if s is not None})


HEADROOM_START, HEADROOM_GROWTH = 2 << 20, 8


def _transient(signature: str, dev: torch.device, api, least: bool) -> tuple[int, float | None]:
    """(the op's transient, its seconds per call capped at its least transient where that is below the one with
    memory to spare, else None)."""
    try:
        fn, args, kwargs = op_call(signature, dev)
        with torch.no_grad():
            fn(*args, **kwargs)
            spare, out_bytes = _measured_call(fn, args, kwargs, dev, api)
    except Exception as e:  # noqa: BLE001 - an op that cannot run alone has no measured transient
        log.info("no transient measured for %s (%s: %s)", signature[:120], type(e).__name__, str(e)[:200])
        return 0, None
    if not (least and spare and hasattr(api, "set_per_process_memory_fraction")):
        return spare, None
    headroom = HEADROOM_START
    with torch.no_grad():
        while headroom < spare:
            api.empty_cache()  # what the cap counts: the segments of the op's inputs
            try:
                with capped(dev, api.memory_reserved(dev) + _footprint(out_bytes, False) + headroom, api=api):
                    transient = _measured_call(fn, args, kwargs, dev, api)[0]
                    if transient >= spare:
                        return spare, None
                    return transient, _seconds_per_call(fn, args, kwargs, dev, api)
            except torch.OutOfMemoryError:
                headroom *= HEADROOM_GROWTH
    return spare, None


def _seconds_per_call(fn, args, kwargs, dev: torch.device, api, warmup: int = 2, repeats: int = 5) -> float:
    """Median wall seconds of one call, the device synchronized around each (ops that shrink their transient when
    memory is short are cuDNN's convolutions, milliseconds long)."""
    for _ in range(warmup):
        fn(*args, **kwargs)
    seconds = []
    for _ in range(repeats):
        api.synchronize(dev)
        started = time.perf_counter()
        fn(*args, **kwargs)
        api.synchronize(dev)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _measured_call(fn, args, kwargs, dev: torch.device, api) -> tuple[int, int]:
    """(the call's transient, the bytes it returns)."""
    api.synchronize(dev)
    api.reset_peak_memory_stats(dev)
    before = api.memory_allocated(dev)
    out = fn(*args, **kwargs)
    api.synchronize(dev)
    out_bytes = _bytes(out)
    return max(0, api.max_memory_allocated(dev) - before - out_bytes), out_bytes


def fresh_allocator(device, *, api=None) -> None:
    """On CUDA, hand back to the device every segment the caching allocator holds unused (after a garbage
    collection frees what earlier work left unreferenced): a run metered or capped from here reserves only the
    segments of its own requests, as the allocator model replays them from an empty cache, not those that earlier
    work in the process (measuring costs) cut to other sizes. Nothing on a CPU. `api`: torch.cuda, or a stand-in."""
    if torch.device(device).type != "cuda":
        return
    gc.collect()
    (api or torch.cuda).empty_cache()


@contextmanager
def capped(device, limit_bytes: int, *, api=None):
    """The process's CUDA memory capped at `limit_bytes` (`torch.cuda.set_per_process_memory_fraction`: the
    caching allocator refuses to reserve beyond it, after freeing its cache), as on a device of that size; the
    cap lifted (fraction 1) after. `api`: torch.cuda, or a stand-in."""
    api = api or torch.cuda
    dev = torch.device(device)
    if dev.index is None:  # torch's fraction is per device: name it
        dev = torch.device(dev.type, api.current_device())
    total = api.get_device_properties(dev).total_memory
    api.set_per_process_memory_fraction(min(1.0, limit_bytes / total), dev)
    try:
        yield
    finally:
        api.set_per_process_memory_fraction(1.0, dev)


def _bytes(out) -> int:
    """Bytes of the distinct storages of the tensors in `out`."""
    storages = {}
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
