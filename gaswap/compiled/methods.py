"""Compiled methods head to head: ways to train one model (eager, torch.compile at an activation memory budget,
gaswap's compiled policies), each with its own copy of the weights, warmed up and measured in rotated rounds.

`gaswap compare`, compiled `validate` and the scripts that read torch's partitions back build on this; the
step, the optimizers and the meter are `gaswap.run.training`'s.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from functools import partial

import torch

from gaswap.base import config
from gaswap.compiled import partition, programs
from gaswap.run import experiment, training
from gaswap.run.measure import resolve_device, use_cpu

RECORDED = ("torch.compile", "gaswap")  # the methods whose generated programs are read at their warm-up


@dataclass
class Method:
    """One way to train the model: a callable model (eager or compiled), its own weights and optimizer."""

    name: str
    knob: str  # torch's budget or gaswap's simulated budget
    model: torch.nn.Module
    run: object
    optimizer: object
    predicted: tuple = (None,) * 4  # (peak bytes above resident, step s) predicted: compiled model, ops one by one
    recomputed: int | None = None
    compile_s: float = 0.0
    origin: str = ""  # a gaswap policy's: "search", or the torch.compile partition it is ("torch 0.5")
    programs: list = field(default_factory=list)  # inductor's, recorded at the compile (`gaswap.compiled.programs`)
    precompiled_s: float | None = None  # compiled in a worker first (`gaswap.compiled.pool`): its seconds there

    def step(self, inputs, target, loss: str, device) -> tuple[float, float]:
        """One training step (`training.train_step`); (wall seconds, CPU seconds)."""
        return training.train_step(self.run, self.optimizer, inputs, target, loss, device)


def setup(exp: config.Experiment, device="auto") -> tuple:
    """(device, model, inputs, target, joint graph) of an experiment for compiled runs: its intra-op threads on
    a CPU, the model and inputs made from its seed, torch.compile's joint graph captured (a model it cannot
    compile as one graph: `partition.Uncompilable`, naming the experiment file)."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        use_cpu(exp.costs.threads)
    torch.manual_seed(exp.seed)
    model = experiment.build_model(exp, device=str(dev))
    inputs, target = experiment.make_inputs(exp, str(dev), torch.Generator(dev).manual_seed(exp.seed))
    try:
        graph = partition.capture(model, *inputs, optimizer=exp.optimizer, counted=exp.counts)
    except partition.Uncompilable as e:
        raise partition.Uncompilable(f"{exp.path}: {e}") from None
    return dev, model, inputs, target, graph


def torch_compiled(model, budget: float):
    """torch.compile with inductor, its partitioner at `activation_memory_budget = budget`."""
    return torch.compile(model, backend=torch_backend(budget), fullgraph=True, dynamic=False)


def torch_backend(budget: float):
    """Inductor as a torch.compile backend, its partitioner at `activation_memory_budget = budget`."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def inductor_at_budget(gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return inductor_at_budget


def allow_recompiles(count: int) -> None:
    """Let dynamo compile the model's forward once more for each of `count` methods (each is compiled apart;
    dynamo counts the compiles of one function across them all, and a run compiles some 20)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * count, 64)


def warm_up(m: Method, inputs, target, loss: str, device, progress) -> None:
    """`training.warm_up` (the compile), timed into `m.compile_s`, once; a compiled method's generated programs
    are recorded (`m.programs`) in its first step."""
    if m.compile_s:
        return
    recorder = programs.Recorder() if m.name in RECORDED else None
    m.compile_s = training.warm_up(partial(m.step, inputs, target, loss, device), first=recorder)
    m.programs = recorder.programs if recorder else []
    progress(f"  warmed up {m.name} {m.knob} ({m.compile_s:.0f} s)")


def measure(methods: list[Method], inputs, target, loss: str, device, rounds: int, steps: int, progress, *,
            metered: int | None = None, prune=None, round_s: float = 0.0) -> list[dict]:
    """Warm up (compile) each method, then `rounds` rounds in rotated order of `training.metered_round` with
    `steps` timed steps each: a row per method (`gaswap compare`'s columns but the program peak). The allocator's
    peak is metered in the first round alone, in a step of its own before the round's: it is the same bytes every
    run (542 of 542 rows in results/compare_time read the same in every round); each round's metered step meters
    the resident set, on a CPU without the profiler the allocator's count runs (`PeakMeter`). The rounds run
    with the heap frozen (`training.frozen_heap`). With `metered`, only the first `metered` rounds meter, the
    others run an untimed step in its place; with `prune`, after each round `prune(rows so far)` gives the indices
    of the methods still worth timing (the others keep the rounds they ran). With `round_s`, a method whose first
    round's steps ran faster than that in all takes as many steps a round from its second on as last that long
    (`steps_for`)."""
    allow_recompiles(len(methods))
    clock = training.step_clock(device)  # what the rows' step times, and the pruning, read
    runs = [{"wall": [], "cpu": [], "peak": [], "rss": []} for _ in methods]
    cold = [m for m in methods if not m.compile_s]
    for k, m in enumerate(cold):
        if m.name != "eager":
            doing = "loading" if m.precompiled_s is not None else "compiling"
            progress(f"  {doing} {m.name} {m.knob} ({k + 1} of {len(cold)}; {len(cold) - k - 1} after it)")
        warm_up(m, inputs, target, loss, device, progress)
    alive = list(range(len(methods)))
    count = [steps] * len(methods)  # timed steps a round, each method's
    with training.frozen_heap():  # the compiled models' objects walked by no collection in the rounds
        for r in range(rounds):
            for i in alive[r % len(alive):] + alive[:r % len(alive)]:
                step = partial(methods[i].step, inputs, target, loss, device)
                if r == 0:
                    runs[i]["peak"].append(training.metered_peak(step, device)[0])
                if metered is None or r < metered:
                    _, rss_peak, timed = training.metered_round(step, device, count[i], allocator=False)
                    runs[i]["rss"].append(rss_peak)
                else:
                    step()
                    timed = [step() for _ in range(count[i])]
                runs[i]["wall"] += [wall for wall, _ in timed]
                runs[i]["cpu"] += [cpu for _, cpu in timed]
                if r == 0:
                    count[i] = steps_for(runs[i][clock], steps, round_s)
            if prune is not None and r + 1 < rounds:
                kept = prune(_rows(methods, runs, clock))
                if len(kept) < len(alive):
                    progress(f"  {len(alive) - len(kept)} of {len(alive)} no longer timed: clearly slower than another "
                             f"at the same budget")
                alive = [i for i in alive if i in kept]
    return _rows(methods, runs, clock)


# a method's round (the calibration's, the finalists', the head to head's) lasts at least this long from its second
# on (`steps_for`): the GRU's calibration had timed its 9 ms steps three a round, 2.4 s for seven methods in all
ROUND_S = 0.25


def steps_for(seconds: list[float], steps: int, round_s: float) -> int:
    """Timed steps a round for a method whose steps took `seconds`: `steps`, or as many as last `round_s` by their
    median where that is more (a step of a few milliseconds, on a GPU or a small model, timed three times a round
    leaves its median to the noise: on an H100 the same program read 2.96 to 3.75 ms in one compare)."""
    if not seconds or round_s <= 0:
        return steps
    return max(steps, math.ceil(round_s / max(statistics.median(seconds), 1e-9)))


def _rows(methods: list[Method], runs: list[dict], clock: str) -> list[dict]:
    """A row per method; its step time (`step_s`, `step_min`, `step_max`) by `clock`, the device's
    (`training.step_clock`)."""
    rows = []
    for m, run in zip(methods, runs):
        c, p = run[clock], run["peak"]
        rows.append({"method": m.name, "knob": m.knob, "predicted_peak_bytes": m.predicted[0],
                     "predicted_step_s": m.predicted[1], "opwise_peak_bytes": m.predicted[2],
                     "opwise_step_s": m.predicted[3], "peak_bytes": int(statistics.median(p)), "peak_min": min(p),
                     "peak_max": max(p), "step_s": statistics.median(c), "step_min": min(c), "step_max": max(c),
                     "wall_step_s": statistics.median(run["wall"]), "compile_s": m.compile_s + (m.precompiled_s or 0.0),
                     "recomputed": m.recomputed, "rss_peak_bytes": _median_or_none(run["rss"]), "origin": m.origin,
                     "steps_timed": len(c)})
    return rows


def _median_or_none(values: list) -> int | None:
    return None if None in values else int(statistics.median(values))
