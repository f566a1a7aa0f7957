"""One training step for every verb that trains: the optimizers, the step, warm-up and the meter of its peak.

Two kinds of step run here, with the same optimizers:
- a module step (`train_step`): a callable model, eager or compiled by torch.compile, its loss
  (`capture.loss_fn`) and torch's backward, then the optimizer: `gaswap compare` and compiled `validate`;
- a runtime step (`runtime_step`): gaswap's own runtime (a `StepRunner` or `ArenaRunner`) runs a captured
  step's forward and backward under a policy's program and hands back the gradients, then the optimizer:
  eager `validate` and the GPU check's memory run.

The meter. Two exist, for two questions, and this module is the one place that picks:
- `peak_meter.PeakMeter` is the independent meter, the one measured figures are judged by across methods: it
  reads torch's allocators (CUDA's caching allocator; the CPU allocator through the profiler), never
  gaswap's bookkeeping, so it meters eager runs, torch.compile and gaswap policies alike, above what is
  allocated when the step starts. Module steps are metered with it (`metered_round`).
- `step_memory.DeviceMemory` meters runtime steps, whose peak is compared with the simulator's: it counts
  the resident tensors the experiment counts (`resident`: parameters, inputs, optimizer state) as the
  simulator does, and on a CPU keeps what the runtime swaps out apart as host memory (`host_memory`), which
  the CPU allocator cannot tell from the rest (the host store is the same RAM). Its CPU mechanism, a
  dispatch mode, does not see the buffers inductor's generated code allocates, so it cannot meter a
  compiled step; PeakMeter cannot meter a swap on a CPU. Hence both.
"""
from __future__ import annotations

import copy
import gc
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from gaswap.run.capture import loss_fn, output_tensor
from gaswap.run.measure import sync
from gaswap.run.peak_meter import PeakMeter
from gaswap.run.step_memory import DeviceMemory

OPTIMIZERS = {  # each name of `base.training_options.OPTIMIZERS` (a test checks), at gaswap's fixed settings
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}
WARM_UP_STEPS = 2  # the first compiles (torch.compile) and creates the optimizer state; the second runs as all later


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of `model` that the optimizer steps."""
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer `name` (one of `training_options.OPTIMIZERS`) over `model`'s trainable parameters."""
    return OPTIMIZERS[name](trainable(model))


def fresh_copy(model: torch.nn.Module, optimizer: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A deep copy of `model` (same weights) and a new optimizer `optimizer` over it."""
    m = copy.deepcopy(model)
    return m, make_optimizer(optimizer, m)


# --- a module step ---------------------------------------------------------------------------------------

def train_step(run, optimizer: torch.optim.Optimizer, inputs, target, loss: str, device) -> tuple[float, float]:
    """One step of a callable model `run` (eager or compiled): forward, loss, backward, optimizer step;
    (wall seconds, CPU seconds), the device synchronized before and after."""
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    loss_fn(loss, output_tensor(run(*inputs)), target).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


@dataclass(frozen=True)
class SplitStep:
    """A step as sharded runs read it: CPU seconds of the forward and backward, and of the whole step (the
    optimizer's included); `peak`, the forward and backward's peak above its start (metered steps only)."""

    forward_backward_s: float
    step_s: float
    peak: int | None = None
    loss: torch.Tensor | None = None


def split_step(model, optimizer: torch.optim.Optimizer, inputs, *, loss: str = "sum", target=None,
               device="cpu", metered: bool = False, before_step=None) -> SplitStep:
    """One step of `model` (e.g. wrapped by `fully_shard`): forward, loss and backward (inside a `PeakMeter`
    when `metered`), then `before_step(model)` if given (e.g. reading the gradients; timed with the step),
    the optimizer step and its zero_grad, each timed in CPU seconds (the meter's entry and exit outside). `loss`
    of the result: the loss, detached."""
    meter = PeakMeter(device) if metered else nullcontext()
    with meter:
        started = time.process_time()
        value = loss_fn(loss, output_tensor(model(*inputs)), target)
        value.backward()
        middle = time.process_time()
    resumed = time.process_time()
    if before_step is not None:
        before_step(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    forward_backward = middle - started
    return SplitStep(forward_backward, forward_backward + time.process_time() - resumed,
                     meter.peak if metered else None, value.detach())


def warm_up(step, first=None, steps: int = WARM_UP_STEPS) -> float:
    """Run `step()` `steps` times, the first inside the context manager `first` if given (a recorder of
    inductor's programs); the wall seconds taken (the compile, for a compiled model)."""
    started = time.perf_counter()
    with first or nullcontext():
        step()
    for _ in range(steps - 1):
        step()
    return time.perf_counter() - started


def metered_round(step, device, timed: int, allocator: bool = True
                  ) -> tuple[int | None, int | None, list[tuple[float, float]]]:
    """One round of `step()` (a module step, returning (wall s, CPU s)): a step under the independent meter (with
    `allocator` False, on a CPU its resident set's alone: `PeakMeter`), an untimed step (the meter handed memory
    back to the OS, and slows the steps right after it), then `timed` timed steps: (peak bytes above resident or
    None, resident-set peak or None, [(wall s, CPU s)] of the timed steps)."""
    peak, rss_peak = metered_peak(step, device, allocator)
    step()
    return peak, rss_peak, [step() for _ in range(timed)]


def step_clock(device) -> str:
    """The clock a step on `device` is timed by: "cpu" seconds on a CPU, "wall" seconds of a synchronized step on a
    GPU (the CPU time of a GPU step is the host's, however long its kernels run)."""
    return "cpu" if torch.device(device).type == "cpu" else "wall"


def device_seconds(timed: list[tuple[float, float]], device) -> list[float]:
    """The seconds of `timed` steps ((wall s, CPU s) pairs, as `train_step` gives them) by `step_clock`."""
    on_cpu = step_clock(device) == "cpu"
    return [cpu if on_cpu else wall for wall, cpu in timed]


@contextmanager
def frozen_heap():
    """For the block, the objects alive at its start left out of the cycle collector's passes (`gc.freeze`, after
    a collection): the meter's collection before each metered step (`PeakMeter`) and the collector's own full
    passes walk only what the block makes. In a process holding compiled models such a pass is long: 0.22 s with
    densenet's eager model alone (446,523 objects), against a 0.10 s step; frozen, nothing."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def metered_peak(step, device, allocator: bool = True) -> tuple[int | None, int | None]:
    """`step()` under the independent meter: (peak bytes above resident (None: not `allocator`, on a CPU),
    resident-set peak (CPU) or None)."""
    with PeakMeter(device, allocator) as meter:
        step()
    return meter.peak, meter.rss_peak


# --- a runtime step --------------------------------------------------------------------------------------

@dataclass
class RuntimeStep:
    """What one step of gaswap's runtime gives back."""

    loss: torch.Tensor  # with loss "external", the model's output
    memory: DeviceMemory | None  # the step meter's figures, if it was metered
    seconds: float  # the forward and backward, by the clock given, the device synchronized
    optimizer_peak: int  # CUDA: the allocator's allocated bytes at most during the optimizer step; else 0
    issued: float = 0.0  # the same clock until the runner returned, before the device is synchronized: on a GPU
    # the host's time to issue the step (a step the host issues for as long as it runs is bound by the host)


def resident(captured, args: list, optimizer: torch.optim.Optimizer, counts, extra=()) -> list[torch.Tensor]:
    """The tensors alive before a step that the simulator counts: the step's arguments (parameters only if
    `counts` names them), the optimizer's state if counted, and `extra` (an arena's buffer)."""
    held = [a for (_, kind, _), a in zip(captured.placeholders, args) if kind != "param" or "parameters" in counts]
    if "optimizer_state" in counts:
        held += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return held + list(extra)


def runtime_step(runner, args: list, held: list, optimizer: torch.optim.Optimizer, params, device, *,
                 metered: bool = True, clock=time.perf_counter) -> RuntimeStep:
    """One step of gaswap's runtime: `runner(args)` runs the forward and backward (timed by `clock`, the device
    synchronized before and after: the step alone, the meter's entry and exit outside), under the step meter
    (`DeviceMemory`, counting `held` as resident) when `metered`; then the optimizer steps `params` with the
    gradients it gave. `args` and `held` are emptied: the step owns its inputs (an input the policy swaps out
    must be free to go)."""
    device = torch.device(device)
    with DeviceMemory(device) if metered else nullcontext() as memory:
        if memory is not None:
            memory.hold(held)
        held.clear()
        sync(device)
        started = clock()
        loss, *grads = runner(args)
        issued = clock() - started
        sync(device)
        seconds = clock() - started
    return RuntimeStep(loss, memory, seconds, optimizer_step(optimizer, params, grads, device), issued)


def optimizer_step(optimizer: torch.optim.Optimizer, params, grads: list, device) -> int:
    """Step `optimizer` with `grads` (one per parameter of `params`, computed apart; the list is emptied),
    then drop them; on CUDA, the allocator's allocated bytes at most during the step (0 elsewhere)."""
    for p, g in zip(params, grads):
        p.grad = g
    grads.clear()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    optimizer.step()
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    optimizer.zero_grad(set_to_none=True)
    return peak
