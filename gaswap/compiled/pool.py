"""Compile in worker processes: each compiles a method's step into inductor's on-disk caches (its FX graphs,
the AOT autograd artifact, the C++ kernels), so that the process that times the methods loads each compiled
program from the caches (about a second) instead of generating it (tens of seconds to minutes, cold).

Workers share the caches with the measuring process (`TORCHINDUCTOR_CACHE_DIR`, else inductor's default
folder for this user); they build the experiment's model and inputs as `methods.setup` does and train one step
of each job: a gaswap policy (`partition.compile`) or torch.compile at an activation memory budget
(`methods.torch_compiled`). Timing stays in the measuring process, never while workers run.

Inductor's cache keys must come out the same in the workers as in the measuring process: `stable_cache_keys`
(both call it) names memory formats by a function of this module in the pickles hashed into the keys; left
to pickle, `torch.contiguous_format` is named by the first module in `sys.modules` that imported torch,
which differs between processes that imported other modules first (every compile then misses the cache).

The pool is only a shortcut: a job a worker fails on (or a pool that breaks) is left to the measuring process,
which compiles it itself and meets the same error there, as it would without a pool. A worker can also say
which activations a policy's partition saves (`partition.partitioned_by`, no code generated): policies that
save the same ones generate the same programs, and are compiled once (`distinct`).
"""
from __future__ import annotations

import copyreg
import logging
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Self

import torch
from torch._inductor import config as inductor_config

from gaswap.base import config
from gaswap.compiled import dry_compile, methods, partition
from gaswap.run import training

MAX_WORKERS = 4  # each holds a copy of the model and inductor's compile state
_state: dict = {}  # a worker's experiment, model, inputs, target and device (`_init`)


@dataclass(frozen=True)
class Job:
    """One compile: `policy` (a compiled gaswap Policy), else torch.compile at activation memory `budget`;
    `label` names it in progress lines."""

    label: str
    policy: object = None
    budget: float | None = None


def default_workers(device=None) -> int:
    """Worker processes for this machine: one per CPU this process may run on, at most `MAX_WORKERS`; none
    (compile in the measuring process) on a single CPU, where workers only add their start-up, or where the
    model trains on a GPU (`device`): there each worker would hold a training step's memory on the device while
    the measuring process times, and workers have not been measured there."""
    cpus = _cpus()
    on_gpu = device is not None and torch.device(device).type != "cpu"
    return 0 if cpus < 2 or on_gpu else min(cpus, MAX_WORKERS)


def kernel_threads(workers: int) -> int:
    """Inductor's compile threads (C++ compilers at once) in each of `workers` processes: twice their share
    of the CPUs, at most all of them, so that the CPUs stay busy while a worker is in its Python part (dynamo,
    lowering) or compiles the last job alone."""
    cpus = _cpus()
    return max(1, min(cpus, 2 * cpus // max(workers, 1)))


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class CompilePool:
    """`with CompilePool(experiment_path, workers) as pool:` then `pool.submit(jobs)` (compiling starts),
    `pool.compile(jobs)` (those and the submitted ones compiled: the caches filled) and `pool.partitions(
    policies)` (what each saves). With `workers` 0 it compiles nothing (compile in the measuring process) and
    finds partitions in this process with `local` ((model, inputs)), else not."""

    def __init__(self, experiment_path, workers: int, progress=print, local: tuple | None = None):
        self.path, self.workers, self.progress, self.local = str(experiment_path), workers, progress, local
        self.seconds: dict[str, float] = {}  # a job's label -> the worker's wall seconds compiling it
        self._executor = None
        self._pending: dict = {}  # future -> Job
        self._submitted: dict[tuple, Job] = {}  # `_job_key` -> the job submitted for it (each compiled once)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (their memory is not the timed steps' to share)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor, self._pending = None, {}

    def submit(self, jobs: list[Job]) -> None:
        """Start compiling `jobs` in the workers (`compile` waits for them); a job that compiles what one
        submitted before compiles is not submitted again."""
        first: dict[tuple, Job] = {}
        for job in jobs:
            if _job_key(job) not in self._submitted:
                first.setdefault(_job_key(job), job)
        new = list(first.values())
        executor = self._start() if new else None
        try:
            self._pending |= {executor.submit(_compile, job): job for job in new} if executor else {}
        except (OSError, BrokenProcessPool):  # no process to start here: this process compiles
            self._broken()
            return
        if executor:
            self._submitted |= {_job_key(job): job for job in new}

    def compile(self, jobs: list[Job]) -> list[float | None]:
        """Compile `jobs` in the workers and wait for them and those submitted before; per job of `jobs` the
        worker's wall seconds (of the job submitted first for what it compiles), or None where it left the job
        to the measuring process."""
        self.submit(jobs)
        if self._pending:
            pending = list(self._pending.values())
            self.progress(f"  compiling {len(pending)} in {min(self.workers, len(pending))} worker processes: "
                          + ", ".join(job.label for job in pending))
            for k, (job, seconds) in enumerate(self._wait(), 1):
                if seconds is not None:
                    self.seconds[job.label] = seconds
                    self.progress(f"  compiled {job.label} ({k} of {len(pending)}, {len(pending) - k} to go; "
                                  f"{seconds:.0f} s in a worker)")
        first = [self._submitted.get(_job_key(job)) for job in jobs]
        return [None if job is None else self.seconds.get(job.label) for job in first]

    def partitions(self, policies: list) -> list[tuple | None]:
        """Per policy, the activations its partition saves and those it offloads ((saved, offloaded), sorted
        names), found in the workers (without workers, in this process with `local`); None where not found."""
        if self.workers <= 0:
            return [None if self.local is None else partition_of(*self.local, policy) for policy in policies]
        executor = self._start() if policies else None
        try:
            futures = [executor.submit(_partition, policy) for policy in policies] if executor else []
            return [future.result() for future in futures] if futures else [None] * len(policies)
        except (OSError, BrokenProcessPool):
            self._broken()
            return [None] * len(policies)

    def program_peaks(self, policies: list, output_bytes: int) -> list:
        """Per policy, a future of what `dry_compile.policy_peak_and_partition` answers for it in a worker
        ((program peak, partition key), or None where the worker failed: the measuring process writes it
        itself and meets the error there); none without workers."""
        executor = self._start() if policies and self.workers > 0 else None
        try:
            return [executor.submit(_program_peak, policy, output_bytes) for policy in policies] if executor else []
        except (OSError, BrokenProcessPool):
            self._broken()
            return []

    def map(self, fn, args: list[tuple]) -> list | None:
        """`fn(*a)` for each of `args` in the workers, the results in order: work that compiles nothing, done while
        they would idle (a compare's searches, one per budget). None without workers, or where a worker failed
        (the caller runs them itself and meets the error there)."""
        executor = self._start() if args and self.workers > 0 else None
        if executor is None:
            return None
        try:
            return [future.result() for future in [executor.submit(fn, *a) for a in args]]
        except BrokenProcessPool:
            self._broken()
        except Exception:  # noqa: BLE001 - the caller runs it again and reports what fails
            pass
        return None

    def _start(self):
        if self.workers > 0 and self._executor is None:
            stable_cache_keys()  # the keys of the measuring process's compiles, as the workers hash them
            self._executor = ProcessPoolExecutor(self.workers, mp_context=get_context("spawn"), initializer=_init,
                                                 initargs=(self.path, kernel_threads(self.workers)))
        return self._executor

    def _wait(self):
        """(Job, seconds or None) of the pending jobs as they finish."""
        try:
            for future in as_completed(list(self._pending)):
                yield self._pending.pop(future), future.result()
        except BrokenProcessPool:
            self._broken()

    def _broken(self) -> None:
        self.progress("  the compile workers stopped; compiling in this process")
        self.workers, self._executor, self._pending, self._submitted = 0, None, {}, {}


def _job_key(job: Job) -> tuple:
    """What a job compiles: torch.compile at its budget, or a policy's partition under its inductor settings."""
    if job.policy is None:
        return ("torch.compile", job.budget)
    return actions_key(job.policy), _settings_key(job.policy)


def actions_key(policy) -> tuple:
    """A compiled policy's actions as a key (policies with the same key partition alike)."""
    return tuple(sorted(policy.actions.items()))


def _settings_key(policy) -> tuple:
    """The inductor settings a compiled policy asks for (`partition.inductor_settings`) as a key: policies of one
    partition compiled under other settings generate other programs."""
    settings = (getattr(policy, "provenance", None) or {}).get("inductor") or {}
    return tuple(sorted(settings.items())) if isinstance(settings, dict) else (("invalid", repr(settings)),)


class Programs:
    """The programs made so far, one per distinct partition: `same` finds, for new methods, the one made
    before for a policy whose partition saves the same activations, under the same inductor settings (the same
    programs: compiled and timed once); `compile` compiles the others in the pool. `known` ({`actions_key`: partition key}, filled by
    whoever partitioned a policy already, as `compare_screen`'s dry compiles do) spares tracing those again."""

    def __init__(self, pool: CompilePool, known: dict | None = None):
        self.pool = pool
        self.known = {} if known is None else known
        self._by_key: dict = {}

    def same(self, made: list, what: str) -> list:
        """`made`: [(Method, its Policy)] (`what`s, in progress lines); per entry the Method made before (earlier
        here or in an earlier call) whose partition saves the same activations, else None (this one now stands
        for its partition)."""
        unknown = [policy for _, policy in made if actions_key(policy) not in self.known]
        found = iter(self.pool.partitions(unknown) if len(made) > 1 or self._by_key else [None] * len(unknown))
        keys = [self.known[actions_key(policy)] if actions_key(policy) in self.known else next(found)
                for _, policy in made]
        keys = [None if key is None else (key, _settings_key(policy)) for (_, policy), key in zip(made, keys)]
        out = []
        for (m, _), key in zip(made, keys):
            first = m if key is None else self._by_key.setdefault(key, m)
            out.append(None if first is m else first)
        repeated = sum(first is not None for first in out)
        if repeated:
            self.pool.progress(f"  {repeated} of {len(made)} {what}s save the same activations as one made before "
                               f"(the same programs): compiled and timed once")
        return out

    def compile(self, made: list, what: str | list[str]) -> None:
        """Compile `made` ([(Method, its Policy)]) in the pool, each named `what` (or its own of a list of them)
        and its knob in progress; each Method's `precompiled_s` set (None: left to this process)."""
        whats = [what] * len(made) if isinstance(what, str) else what
        jobs = [Job(f"{w} {m.knob}" + ("" if m.recomputed is None else f" ({m.recomputed} recomputed)"), policy)
                for (m, policy), w in zip(made, whats)]
        for (m, _), seconds in zip(made, self.pool.compile(jobs)):
            m.precompiled_s = seconds


def stable_cache_keys() -> None:
    """Pickle `torch.memory_format`s as `_memory_format(name)` in this process (see the module's doc)."""
    copyreg.pickle(torch.memory_format, _reduce_memory_format)


def _reduce_memory_format(memory_format) -> tuple:
    return _memory_format, (str(memory_format).removeprefix("torch."),)


def _memory_format(name: str):
    return getattr(torch, name)


# --- in a worker -----------------------------------------------------------------------------------------

def _init(experiment_path: str, compile_threads: int = 1) -> None:
    """Set up this worker as `methods.setup` sets up the measuring process (the same model, inputs and
    threads), its cache keys as stable (`stable_cache_keys`), its kernels compiled `compile_threads` at once."""
    for name in ("torch._inductor", "torch._dynamo", "torch._functorch"):
        logging.getLogger(name).setLevel(logging.ERROR)  # e.g. "failed to pickle cache key" of partitioned_by
    inductor_config.compile_threads = compile_threads
    stable_cache_keys()
    exp = config.load_experiment(experiment_path)
    device, model, inputs, target, _ = methods.setup(exp)
    _state.update(exp=exp, model=model, inputs=inputs, target=target, device=device)


def _compile(job: Job) -> float | None:
    """Train one step of the job's compiled model (the compile); its wall seconds, None if it failed."""
    exp = _state["exp"]
    model, optimizer = training.fresh_copy(_state["model"], exp.optimizer)
    run = (partition.compile(model, job.policy) if job.policy is not None
           else methods.torch_compiled(model, job.budget))
    started = time.perf_counter()
    try:
        training.train_step(run, optimizer, _state["inputs"], _state["target"], exp.loss, _state["device"])
    except Exception:  # noqa: BLE001 - the measuring process compiles it again and reports what fails
        return None
    finally:
        torch._dynamo.reset()
    return time.perf_counter() - started


def _partition(policy) -> tuple | None:
    try:
        return partition_of(_state["model"], _state["inputs"], policy)
    finally:
        torch._dynamo.reset()  # a worker traces the model afresh for each policy: no recompile limit to reach


def _program_peak(policy, output_bytes: int) -> tuple | None:
    """`dry_compile.policy_peak_and_partition` of `policy` on this worker's model; None if it failed."""
    try:
        return dry_compile.policy_peak_and_partition(_state["model"], policy, _state["inputs"], output_bytes,
                                                     _state["exp"].loss)
    except Exception:  # noqa: BLE001 - the measuring process writes it again and reports what fails
        return None
    finally:
        torch._dynamo.reset()


def partition_of(model, inputs, policy) -> tuple | None:
    """(saved, offloaded) of `policy`'s partition of `model`'s step on `inputs` (sorted activation names,
    `partition.partitioned_by`), None if it failed (the compile that follows reports why)."""

    quiet = logging.getLogger("torch._inductor.codecache")  # "failed to pickle cache key": the stop is not cached
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        p = partition.partitioned_by(model, policy, *inputs)
    except Exception:  # noqa: BLE001 - the measuring process compiles it and reports what fails
        return None
    finally:
        quiet.setLevel(level)
    return p.key()
