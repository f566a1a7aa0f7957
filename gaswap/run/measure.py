"""Measure op times and host<->device copy bandwidth on the device at hand, caching figures on disk.

Each distinct op signature is timed once per (device, torch version, cost-model version); the figures
live in a `CostCache` (see costs.py), so measuring the same graph again times nothing. Inputs are
rebuilt from the signature `{"target": "aten.mm.default", "args": [...], "kwargs": {...}}`:
 - a tensor `{"shape": [...], "dtype": "float32", "stride": [...]?}` becomes random normal values for
   floating/complex dtypes (uniform in [0, 1) where the op reads probabilities or rates: `multinomial`,
   `bernoulli`, `poisson`, `binomial`), and for integer dtypes indices drawn uniformly within the range the op
   gives them (`index_bounds`: an embedding's rows, a loss's classes, the size of a gather's dimension, ...) or
   zeros where no rule names one (always a valid index); bools are False;
 - a string naming a torch dtype, layout or memory format ("torch.float16", "float16") becomes that
   object, and a device string ("cuda:0", "cpu") becomes the device being measured;
 - other JSON values (numbers, lists, null, other strings) are passed as they are.
On a device other than the CPU, an op the CPU's dispatch chose (`*_for_cpu`) is timed as the runtime runs it
there: its device-neutral replacement (`capture.device_neutral`, e.g. SDPA's math). An op that cannot run
standalone gets a roofline estimate from a shipped profile and is logged and listed in `Costs.estimated`; the
failure is cached, so it is not retried.

Note: ops are measured at their real shapes; on a CPU a huge op may take a while (once per cache).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from gaswap.base.errors import GaswapError
from gaswap.base.program import Verb
from gaswap.plan.costs import CostCache, Costs, HardwareProfile, load_profile, roofline
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.graph import Graph
from gaswap.plan.simulator import Simulator
from gaswap.plan.walker import Hooks, Walker
from gaswap.run.capture import device_neutral
from gaswap.run.runtime import CLOCK_NAMES, StepRunner, device_clock

log = logging.getLogger(__name__)
MIN_REPEAT_SECONDS = 1e-3  # a timed repeat runs an op enough times to last at least this long
MAX_CALLS_PER_REPEAT = 1000
LINK_BYTES = 128 << 20
STARTING_THREADS = torch.get_num_threads()  # torch's intra-op threads when gaswap was imported: its default here
BUSY = 1.0  # load per CPU above which wall-clock figures are timed again when it is quieter


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" means cuda when available, else cpu."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


@functools.cache
def keep_freed_host_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of returning it to the OS, as CUDA's caching
    allocator does for the GPU; True if it could. Without it, a CPU training step pays page faults for
    memory it freed a moment ago, and its time varies from one process to the next by tens of percent.
    Process-wide; `use_cpu` calls it, for measuring and for validating, so that op timings and steps agree."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    largest = 2**31 - 1
    return all(libc.mallopt(option, value) == 1 for option, value in
               ((m_mmap_threshold, largest), (m_trim_threshold, largest), (m_top_pad, 256 << 20)))


def use_cpu(threads: int | None = None) -> None:
    """Set up this process's CPU as a device the same way for measuring and for running steps: glibc keeps
    freed memory (`keep_freed_host_memory`) and `threads` intra-op threads, torch's own default where not given
    (`STARTING_THREADS`: an experiment without `costs.threads` does not inherit the threads of one run before it
    in the same process, which also changes inductor's cache keys)."""
    keep_freed_host_memory()
    torch.set_num_threads(threads or STARTING_THREADS)


def device_name(device: str | torch.device) -> str:
    """A name for the hardware: the GPU's name, or "cpu: <model>, family <f> model <m>, <ISA> (<n> threads)"
    (CPU timings depend on all of these: a virtual machine's CPU is often named only "AMD EPYC", whatever its
    generation, and ATen picks its kernels by the vector ISA, `torch.backends.cpu.get_cpu_capability`)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "cpu":
        threads = torch.get_num_threads()
        return f"cpu: {_cpu_identity()}, {torch.backends.cpu.get_cpu_capability()} ({threads} thread{'' if threads == 1 else 's'})"
    return dev.type


@functools.cache
def _cpu_identity() -> str:
    """The CPU's model name, with its family and model numbers where /proc/cpuinfo gives them."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's block is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    return name


def measure(graph: Graph, device: str = "auto", cache_dir=None, *, progress=None, warmup=2, repeats=5,
            in_place=None, threads: int | None = None) -> Costs:
    """Measured Costs for every op of `graph`. `Costs.measured` is how many distinct signatures this call
    tried to time (0 when all came from the cache); `Costs.estimated` names the ops given a roofline figure.

    `in_place` is None or `(captured, make_args)`, the captured step of `graph` and a function giving real
    arguments for it: on a CPU the ops and copies are then timed in place as the whole step runs
    (`profile_step`; each signature gets the median of its ops), else each op alone on random inputs.
    `progress` is None, a callable(done, total) or a tqdm-like object (its `total` is set, then `update(1)`
    is called per signature). Figures are read from and added to the cache under `cache_dir`. On a CPU,
    `threads` intra-op threads time the ops (see `use_cpu`).
    """
    dev = resolve_device(device)
    if dev.type == "cpu":
        use_cpu(threads)
    in_place = in_place if dev.type == "cpu" else None
    name = device_name(dev)
    cache = cost_cache(dev, cache_dir, in_place=bool(in_place))
    signatures = {op.signature for op in graph.ops}
    todo = sorted(signatures - cache.op_time.keys() - cache.failed.keys() | signatures & _busy_figures(cache, dev))
    load = load_per_cpu()
    warm = not todo and cache.link is not None  # nothing to measure: a read-only cache is fine
    report = _reporter(progress, len(todo))
    try:
        if in_place and todo:
            profile = profile_step(*in_place, dev)
            cache.op_time |= _by_signature(graph, profile.op_time)
            cache.link = profile.link or cache.link
            report(len(todo))
        for done, signature in enumerate([] if in_place else todo, 1):
            _measure_signature(signature, dev, cache, warmup, repeats)
            report(done)
        cache.load |= dict.fromkeys((s for s in todo if s in cache.op_time), max(load, load_per_cpu()))
        if cache.link is None:
            d2h, h2d = measure_link(dev)
            cache.link = {"d2h": d2h, "h2d": h2d, "latency": _copy_latency(dev)}
    finally:
        if not warm:
            cache.save()
    return _costs(graph, cache, name, _fallback_profile(name), measured=len(todo), copies_overlap=dev.type != "cpu")


def cost_cache(device: str | torch.device, cache_dir=None, *, in_place: bool = False) -> CostCache:
    """The cache `measure` keeps the figures of `device` in: one per device, torch version, way of timing
    (ops alone or in place) and clock (`device_clock`)."""
    dev = resolve_device(device)
    timing = f"{'in place' if in_place else 'standalone'}, {CLOCK_NAMES.get(dev.type, 'wall time')}"
    return CostCache(device_name(dev), torch.__version__, cache_dir, timing=timing)


def load_per_cpu() -> float:
    """The 1-minute load average over the number of CPUs (above 1: processes wait for a core)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def _busy_figures(cache: CostCache, dev: torch.device) -> set[str]:
    """Figures of `cache` to time again: with a wall clock, those timed while processes waited for a core
    (`BUSY`), if the machine is quieter now. CPU time does not count other processes' turns: kept."""
    if device_clock(dev) is time.process_time:
        return set()
    now = load_per_cpu()
    busy = {s for s, load in cache.load.items() if load > BUSY and load > now}
    if busy:
        log.info("timing %d ops again: they were timed under a load of more than %g per CPU", len(busy), BUSY)
    return busy


def _by_signature(graph: Graph, op_time: dict[str, float]) -> dict[str, float]:
    """Median seconds per signature over the ops that share it."""
    times: dict[str, list[float]] = {}
    for op in graph.ops:
        times.setdefault(op.signature, []).append(op_time[op.name])
    return {signature: statistics.median(ts) for signature, ts in times.items()}


class DeviceError(GaswapError, RuntimeError):
    """The accelerator failed (e.g. a device-side assert): its context is unusable, so measuring stops."""


def _is_device_error(e: Exception) -> bool:
    """An error of the accelerator itself rather than of one op's arguments."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)


def _measure_signature(signature: str, dev: torch.device, cache: CostCache, warmup: int, repeats: int) -> None:
    """Time one signature into the cache, or record why it cannot run standalone (out of memory is
    not recorded: it may pass another time). The device is synchronized inside the `try`, so an
    asynchronous failure is charged to the op that caused it; an accelerator error is never cached and
    stops the measurement (DeviceError): every later op would fail on the broken context."""
    try:
        cache.op_time[signature] = time_signature(signature, dev, warmup, repeats)
        sync(dev)
    except Exception as e:  # any failure of a standalone run: fall back to the roofline
        reason = f"{type(e).__name__}: {e}"[:500]
        if _is_device_error(e):
            cache.op_time.pop(signature, None)
            raise DeviceError(f"the device failed while timing {signature[:200]} ({reason}); nothing was cached "
                              f"for it, the figures measured before it were kept; run the measurement again") from e
        if not isinstance(e, torch.OutOfMemoryError):
            cache.failed[signature] = reason
        log.warning("cannot run %s standalone (%s); using a roofline estimate", signature[:200], reason)


def _costs(graph: Graph, cache: CostCache, name: str, fallback: HardwareProfile, measured: int,
           copies_overlap: bool) -> Costs:
    """Costs from the cached figures; ops whose signature has none get `fallback`'s roofline. Copies overlap
    compute on a GPU (copy engines, streams); on a CPU the runtime's host store copies on the compute thread."""
    op_time, estimated = {}, []
    for op in graph.ops:
        if op.signature in cache.op_time:
            op_time[op.name] = cache.op_time[op.signature]
        else:
            op_time[op.name] = roofline(op, graph, fallback)
            estimated.append(op.name)
    if estimated:
        log.warning("%d of %d ops got a roofline estimate (profile %s)",
                    len(estimated), len(graph.ops), fallback.name)
    return Costs(
        op_time=op_time,
        d2h_bandwidth=cache.link["d2h"],
        h2d_bandwidth=cache.link["h2d"],
        device=name,
        source="measured",
        copy_latency=cache.link["latency"],
        copies_overlap=copies_overlap,
        measured=measured,
        estimated=tuple(estimated),
    )


def _fallback_profile(name: str) -> HardwareProfile:
    """The shipped profile nearest a device name: cpu, the named GPU model, else the A100."""
    if name.startswith("cpu"):
        return load_profile("cpu")
    for model in ("v100-pcie-16gb", "a100-pcie-40gb", "h100-sxm-80gb"):
        if model.split("-")[0] in name.lower():
            return load_profile(model)
    return load_profile("a100-pcie-40gb")


def _reporter(progress, total: int):
    """A function done -> None that forwards to a callable(done, total) or a tqdm-like object."""
    if progress is None:
        return lambda done: None
    if hasattr(progress, "update"):
        progress.total = total
        return lambda done: progress.update(1)
    return lambda done: progress(done, total)


# --------------------------------------------------------------------------- timing one op


def time_signature(signature: str, device: str | torch.device = "auto", warmup=2, repeats=5) -> float:
    """Median seconds per call of the op a signature describes, on random inputs of its shapes."""
    dev = resolve_device(device)
    fn, args, kwargs = op_call(signature, dev)
    with torch.no_grad():
        return _median_time(lambda: fn(*args, **kwargs), dev, warmup, repeats)


def op_call(signature: str, dev: torch.device) -> tuple:
    """(function, args, kwargs) of the call a signature describes on `dev`, inputs drawn like real ones."""
    spec = json.loads(signature)
    target, raw = spec["target"], spec.get("args", [])
    fn = _resolve_target(target, dev)
    bounds, unit = index_bounds(target, raw), target.split(".")[1] in UNIT_INPUTS
    args = [_decode(a, dev, bounds.get(i), unit and i == 0) for i, a in enumerate(raw)]
    kwargs = {k: _decode(v, dev) for k, v in spec.get("kwargs", {}).items()}
    return fn, args, kwargs


def _resolve_target(target: str, dev: torch.device):
    """"aten.convolution.default" -> torch.ops.aten.convolution.default; off the CPU, a CPU-dispatch op's
    replacement (what the runtime runs there)."""
    if dev.type != "cpu" and "_for_cpu" in target:
        replacement = device_neutral(target)
        if replacement is None:
            raise ValueError(f"{target} is the CPU's kernel and has no replacement on {dev.type}")
        return replacement
    fn = torch.ops
    for part in target.split("."):
        fn = getattr(fn, part)
    return fn


UNIT_INPUTS = frozenset({"multinomial", "bernoulli", "poisson", "binomial"})  # first input: probabilities, rates


def _dim_size(tensor_at: int, dim_at: int):
    return lambda args: args[tensor_at]["shape"][args[dim_at]]


def _classes(tensor_at: int):
    """A loss's classes: the input's dimension 1 (dimension 0 for one sample)."""
    return lambda args: args[tensor_at]["shape"][1 if len(args[tensor_at]["shape"]) > 1 else 0]


# op -> (position of its integer index argument, its exclusive upper bound from the signature's arguments)
INDEX_ARGUMENTS = {
    "embedding": (1, lambda args: args[0]["shape"][0]),
    "embedding_dense_backward": (1, lambda args: args[2]),
    "embedding_backward": (1, lambda args: args[2]),
    "_embedding_bag": (1, lambda args: args[0]["shape"][0]),
    "nll_loss_forward": (1, _classes(0)), "nll_loss2d_forward": (1, _classes(0)),
    "nll_loss_backward": (2, _classes(1)), "nll_loss2d_backward": (2, _classes(1)),
    "index_select": (2, _dim_size(0, 1)), "gather": (2, _dim_size(0, 1)), "scatter": (2, _dim_size(0, 1)),
    "scatter_add": (2, _dim_size(0, 1)), "scatter_reduce": (2, _dim_size(0, 1)), "index_add": (2, _dim_size(0, 1)),
    "index": (1, lambda args: args[0]["shape"]), "index_put": (1, lambda args: args[0]["shape"]),
}


def index_bounds(target: str, args: list) -> dict:
    """{argument position: exclusive upper bound} of the integer index arguments of an op (a list of bounds, one
    per dimension, for `index`'s list of indices); {} for an op no rule names, or arguments it cannot read."""
    rule = INDEX_ARGUMENTS.get(target.split(".")[1] if target.count(".") >= 2 else "")
    if rule is None:
        return {}
    position, bound = rule
    try:
        return {position: bound(args)}
    except (IndexError, KeyError, TypeError):
        return {}


def _decode(value, dev: torch.device, high=None, unit: bool = False):
    """A signature value as a call argument (see the module docstring); `high`: an index's exclusive bound (a
    list of them for a list of tensors), `unit`: probabilities."""
    if isinstance(value, dict) and "shape" in value and "dtype" in value:
        return _random_tensor(value["shape"], _torch_attr(value["dtype"]), value.get("stride"), dev,
                              high if isinstance(high, int) else None, unit)
    if isinstance(value, list):
        highs = high if isinstance(high, list) else [None] * len(value)
        return [_decode(v, dev, h) for v, h in zip(value, highs + [None] * (len(value) - len(highs)))]
    if isinstance(value, str):
        obj = _torch_attr(value)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        if value.split(":")[0] in ("cpu", "cuda"):
            return dev
    return value


def _torch_attr(name: str):
    return getattr(torch, name.removeprefix("torch."), None)


def _random_tensor(shape, dtype: torch.dtype, stride, dev: torch.device, high: int | None = None,
                   unit: bool = False) -> torch.Tensor:
    """Random normal floats (or complex; uniform in [0, 1) if `unit`), integers uniform in [0, `high`) (zeros
    without a bound), False for bools; laid out with `stride` if given."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype in signature: {dtype!r}")
    stride = stride or torch.empty(shape, device="meta").stride()
    numel = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    if dtype.is_floating_point or dtype.is_complex:
        storage = (torch.rand if unit else torch.randn)(numel, dtype=dtype, device=dev)
    elif high and dtype != torch.bool:
        storage = torch.randint(0, high, (numel,), dtype=dtype, device=dev)
    else:
        storage = torch.zeros(numel, dtype=dtype, device=dev)
    return storage.as_strided(shape, stride)


def _median_time(fn, dev: torch.device, warmup: int, repeats: int) -> float:
    """Median over `repeats` of the seconds per call, each repeat batching enough calls to last ~1 ms."""
    for _ in range(warmup):
        fn()
    calls = min(MAX_CALLS_PER_REPEAT, max(1, math.ceil(MIN_REPEAT_SECONDS / _timed(fn, 1, dev))))
    return statistics.median(_timed(fn, calls, dev) / calls for _ in range(repeats))


def _timed(fn, calls: int, dev: torch.device) -> float:
    """Seconds (`device_clock`) for `calls` calls of fn, synchronizing the device before and after."""
    clock = device_clock(dev)
    sync(dev)
    start = clock()
    for _ in range(calls):
        fn()
    sync(dev)
    return max(clock() - start, 1e-9)


def sync(dev: torch.device) -> None:
    """Wait for the work queued on `dev` (CUDA); nothing to wait for on a CPU."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# --------------------------------------------------------------------------- the host<->device link


def measure_link(device: str | torch.device = "auto", nbytes=LINK_BYTES, repeats=3) -> tuple[float, float]:
    """(d2h, h2d) bytes/s, best of `repeats` copies of `nbytes`. On CUDA the host buffer is pinned and the
    copies non-blocking; on a CPU the swap store is host memory, so it is a host-to-host copy."""
    dev = resolve_device(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    d2h = nbytes / min(_timed(lambda: host.copy_(on_device, non_blocking=True), 1, dev) for _ in range(repeats))
    h2d = nbytes / min(_timed(lambda: on_device.copy_(host, non_blocking=True), 1, dev) for _ in range(repeats))
    return d2h, h2d


def _copy_latency(dev: torch.device, warmup: int = 3, repeats: int = 21) -> float:
    """Seconds one tiny host<->device copy takes, the fixed cost added to every copy: the median of copies
    timed one at a time, each between two synchronizations (back-to-back copies would overlap their
    latencies and measure throughput)."""
    host = torch.empty(1, pin_memory=dev.type == "cuda")
    on_device = torch.empty(1, device=dev)
    copy = lambda: host.copy_(on_device, non_blocking=True)  # noqa: E731
    for _ in range(warmup):
        _timed(copy, 1, dev)
    return statistics.median(_timed(copy, 1, dev) for _ in range(repeats))


# --------------------------------------------------------------------------- timing ops in place


@dataclass(frozen=True)
class StepProfile:
    """What `profile_step` measured: median seconds per op (by name), and the host copies fitted as
    {"d2h", "h2d": bytes/s, "latency": s} (None when the step has nothing to swap)."""

    op_time: dict[str, float]
    link: dict[str, float] | None


def profile_step(captured, make_args, device: str | torch.device = "cpu", warmup=3, repeats=15) -> StepProfile:
    """Time a captured step in place: the runtime runs the whole step `warmup + repeats` times with every
    tensor kept (for the ops), then as often with every candidate swapped (for the copies, fitted as a
    latency plus bytes over a bandwidth per direction); `make_args()` gives the arguments of one run. Each
    reading is less the clock's own cost (`clock_overhead`).

    In place, an op finds its inputs where the op before left them (caches, allocator) and pays the
    runtime's own overhead (the views it is first to read rebuilt, waits for copies), as it will in
    training: the clock is read around each instruction of the runner's generated code, so what the step
    costs beyond its instructions is only the call itself. On a CPU, an op timed alone on the same inputs
    over and over looks a third faster than in a real step.
    """
    graph = captured.graph
    encoding = Encoding(graph)
    keep, swap = encoding.uniform(Action.KEEP), encoding.uniform(Action.SWAP)
    order = encoding.decode(keep.keys)
    simulator = Simulator(graph, Costs(dict.fromkeys((op.name for op in graph.ops), 1.0), 1.0, 1.0, "any", "any"))
    dev = resolve_device(device)

    def timed(actions) -> _TimedRunner:
        runner = _TimedRunner(captured, simulator.run(order, actions, trace=True).program, dev)
        for run in range(warmup + repeats):
            if run == warmup:
                runner.reset()
            runner(make_args())
        return runner

    op_time = _op_times(timed(keep.actions), clock_overhead(dev))
    link = _fit_link(graph, _Pricing.of(timed(swap.actions)).copies, dev) if int(Action.SWAP) in swap.actions else None
    return StepProfile(op_time, link)


class _Pricing(Hooks):
    """The readings of a timed runner's steps, instruction by instruction (walked over its program): each op's,
    less the clock's own `overhead` and charged with the frees that follow it (dropping tensors takes time on
    the compute thread, and the simulator's frees take none), in `op_time`; each copy's as read, by (verb,
    tensor), in `copies`."""

    def __init__(self, readings: list[list[float]], overhead: float):
        self.readings, self.overhead = readings, overhead
        self.op_time: dict[str, list[float]] = {}
        self.copies: dict[tuple[Verb, str], list[float]] = {}
        self.charged: list[float] | None = None  # the op the frees read now are charged to

    @classmethod
    def of(cls, runner: StepRunner, overhead: float = 0.0) -> "_Pricing":
        pricing = cls(runner._times, overhead)
        Walker(runner.graph, pricing).walk(runner.program)
        return pricing

    def seconds(self, k: int) -> list[float]:
        return [max(0.0, s - self.overhead) for s in self.readings[k]]

    def on_run(self, k: int, op, made: list[str]) -> None:
        self.charged = self.op_time[op.name] = self.seconds(k)

    def on_free(self, k: int, tensor: str, retired: bool) -> None:
        if self.charged is not None:
            self.charged[:] = [a + b for a, b in zip(self.charged, self.seconds(k))]

    def on_recompute(self, k: int, op, made: list[str]) -> None:
        self.charged = None

    def on_retire(self, k: int, tensor: str) -> None:
        self.charged = None

    def on_swap_out(self, k: int, tensor: str) -> None:
        self.charged = None
        self.copies.setdefault((Verb.SWAP_OUT, tensor), []).extend(self.readings[k])

    def on_swap_in(self, k: int, tensor: str) -> None:
        self.charged = None
        self.copies.setdefault((Verb.SWAP_IN, tensor), []).extend(self.readings[k])


def _op_times(runner: "_TimedRunner", overhead: float = 0.0) -> dict[str, float]:
    """Median seconds of each op over the timed steps (see `_Pricing`): each instruction's reading less the
    clock's own `overhead` (`clock_overhead`), which the untimed step does not pay."""
    return {name: statistics.median(seconds) for name, seconds in _Pricing.of(runner, overhead).op_time.items()}


def clock_overhead(device: torch.device, samples: int = 2001) -> float:
    """Seconds an empty instruction reads between the two clock readings `_TimedRunner` puts around each one
    (on a CPU the process's CPU time, a system call: 0.47 us on the 2-core machine; on a GPU a synchronize
    and the wall clock): median of `samples`. On a step of many small ops it is a large part of each reading
    (a GRU cell unrolled over 24 steps: 941 ops of about 3 us and as many frees, predicted 1.4x its time)."""
    clock = device_clock(device)
    readings = []
    for _ in range(samples):
        sync(device)
        started = clock()
        sync(device)
        readings.append(clock() - started)
    return statistics.median(readings)


def _fit_link(graph: Graph, copies: dict[tuple[Verb, str], list[float]], dev: torch.device) -> dict[str, float]:
    """Least-squares latency (shared) and bandwidth per direction of the copies timed by `profile_step`
    (`_Pricing.copies`); a direction whose fit is not a positive rate (e.g. copies all of one size) falls back
    to `measure_link`."""
    rows = [(verb == Verb.SWAP_OUT, graph.tensors[name].size, statistics.median(ts)) for (verb, name), ts in copies.items()]
    design = np.array([[1.0, size if out else 0.0, 0.0 if out else size] for out, size, _ in rows])
    (latency, per_byte_d2h, per_byte_h2d), *_ = np.linalg.lstsq(design, np.array([s for *_, s in rows]), rcond=None)
    fallback = measure_link(dev) if min(per_byte_d2h, per_byte_h2d) <= 0 else (0.0, 0.0)
    return {"d2h": float(1 / per_byte_d2h if per_byte_d2h > 0 else fallback[0]),
            "h2d": float(1 / per_byte_h2d if per_byte_h2d > 0 else fallback[1]),
            "latency": max(0.0, float(latency))}


class _TimedRunner(StepRunner):
    """A StepRunner whose generated code reads a clock around each instruction (synchronizing the device
    around each, so copies are timed whole, not overlapped): `_times` are the seconds of each instruction,
    over the steps run since it was made or `reset` (`_Pricing` reads them)."""

    timed = True

    def reset(self) -> None:
        for seconds in self._times:
            seconds.clear()
