"""An independent meter of the memory a block of code adds to what is resident when it starts.

It reads torch's allocators, never gaswap's own tracker, so it meters eager runs, torch.compile and gaswap
policies alike:

- `peak`: the most tensor bytes allocated at once above the start. CUDA: the caching allocator's
  `max_memory_allocated`. CPU: torch's CPU allocator counts every allocation and free while the profiler
  meters memory (`profile_memory=True`); the peak is the highest running total. Deterministic: it counts
  bytes asked of malloc, not pages, so the heap's state does not move it. Bytes freed during the block that
  were allocated before it lower it only if they were allocated under an earlier meter (the allocator knows
  their size): Python's cycle collector, running mid-block, freed such garbage from an earlier metered step
  and a test read 61,736 B low. So the meter collects garbage before it starts (both devices: on CUDA the
  same garbage would sit in the base).
- `rss_peak` (CPU only): the process's resident-set high-water mark (`VmHWM`, reset through
  /proc/self/clear_refs after glibc's `malloc_trim` hands freed memory back), less what was resident before.
  It counts everything malloc keeps (fragmentation, Python objects, scratch buffers) and moves with the
  heap's state: the same step can read one activation apart on two runs.

It meters module steps (eager and compiled); `gaswap.run.training` says why, and is where verbs reach it.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys

import torch

from gaswap.run.measure import sync


class PeakMeter:
    """`with PeakMeter(device) as m: ...`, then `m.peak` (allocator bytes) and `m.rss_peak` (CPU: resident
    bytes; CUDA: None), both above what the block started with. `allocator=False` on a CPU meters the resident
    set alone (`peak` None), without the profiler the allocator's count runs (which also keeps its own records in
    the resident set). A metered step costs more than a plain one either way (the collection, malloc's trim and
    the pages faulted back): densenet's eager step, the heap frozen, 0.11-0.14 s plain, 0.21-0.24 metered with the
    allocator's count, 0.20-0.21 without."""

    def __init__(self, device, allocator: bool = True):
        self.device = torch.device(device)
        self.allocator = allocator or self.device.type == "cuda"  # CUDA's count costs nothing
        self.peak = 0 if self.allocator else None
        self.rss_peak = None

    def __enter__(self) -> "PeakMeter":
        gc.collect()  # garbage freed mid-block would lower the peak (module docstring)
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _libc().malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            self._base = _status("VmRSS")
            if not self.allocator:
                return self
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    profile_memory=True)
            with quiet_stderr():  # the profiler prints two lines per start and stop
                self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        sync(self.device)
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        self.rss_peak = _status("VmHWM") - self._base
        if not self.allocator:
            return
        with quiet_stderr():
            self._profiler.__exit__(*exc)
        self.peak = allocated_peak(self._profiler)


def allocated_peak(profiler) -> int:
    """The highest running total of the bytes allocated (less those freed) in a finished profile."""
    events = sorted((e.start_ns(), k, e.nbytes()) for k, e in enumerate(profiler.profiler.kineto_results.events())
                    if e.name() == "[memory]")
    live = peak = 0
    for _, _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 sent to /dev/null for the block (what C++ code prints too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"))


def _status(key: str) -> int:
    """A figure of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")
