"""Measured device memory of a real training step, independent of the simulator's bookkeeping.

CUDA: the caching allocator's own figures, from a baseline taken at entry, so that only what the simulator
counts is counted: the bytes of the tensors `hold` is given (parameters, inputs, optimizer state as the
experiment counts them) plus what the step allocates beyond the baseline (`requested_bytes`: exact sizes,
as the simulator counts them; block-rounded `allocated` and segment `reserved` peaks are kept beside).
What else sits on the device (inputs kept for cloning, uncounted parameters, cuBLAS workspaces, made
before entry by a warm-up matmul) is in the baseline and not counted.
CPU (where "device" and "host" are the same RAM): a dispatch mode sees every tensor any aten op creates
while it is active and follows each storage with a weak reference, so a storage counts until the last
tensor or view holding it is gone. Storages made inside `host_memory()` are host memory, counted apart.
It meters the steps of gaswap's own runtime; `gaswap.run.training` says why, and is where verbs reach it.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class DeviceMemory:
    """Live and peak device bytes while a step runs. Use as a context manager around the step."""

    def __init__(self, device: torch.device | str, *, cuda_api=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._api = cuda_api or (torch.cuda if self.cuda else None)  # a stand-in in CPU tests
        self._storages: dict[int, tuple[StorageWeakRef, int, bool]] = {}  # cdata -> (ref, bytes, on host)
        self._mode = _Allocations(self) if not self.cuda else None
        self._host = False
        self.peak = 0
        self.held = 0  # CUDA: bytes of the tensors given to `hold`
        self.allocated_peak = self.reserved_peak = 0  # CUDA: block-rounded and segment peaks (absolute reserved)
        self._baseline: dict[str, int] = {}

    def __enter__(self) -> "DeviceMemory":
        if self.cuda:
            if self._api is torch.cuda:
                _warm_up_cublas(self.device)
            self._api.synchronize(self.device)
            self._api.reset_peak_memory_stats(self.device)
            stats = self._api.memory_stats(self.device)
            self._baseline = {k: stats.get(f"{k}_bytes.all.current", 0) for k in ("requested", "allocated")}
        else:
            self._mode.__enter__()
        self.peak = self.current()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        if self.cuda:
            self._api.synchronize(self.device)
            stats = self._api.memory_stats(self.device)
            step_peak = stats.get("requested_bytes.all.peak", 0) - self._baseline["requested"]
            self.peak = max(self.peak, self.held + step_peak)
            self.allocated_peak = self.held + stats.get("allocated_bytes.all.peak", 0) - self._baseline["allocated"]
            self.reserved_peak = stats.get("reserved_bytes.all.peak", 0)
        else:
            self._mode.__exit__(*exc)

    def hold(self, tensors) -> None:
        """Count tensors made before the step that stay on the device (parameters, inputs, optimizer state)."""
        if self.cuda:
            seen = set()
            for t in tree_leaves(tensors):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    self.held += t.untyped_storage().nbytes()
        else:
            for t in tree_leaves(tensors):
                if isinstance(t, torch.Tensor):
                    self._add(t)
        self.sample()

    def current(self) -> int:
        """Device bytes alive now (CUDA: held plus what was requested since entry)."""
        if self.cuda:
            now = self._api.memory_stats(self.device).get("requested_bytes.all.current", 0)
            return self.held + now - self._baseline.get("requested", now)
        return self._live(on_host=False)

    def host_bytes(self) -> int:
        """Host bytes alive now (CPU: tensors made inside `host_memory()`; CUDA: not tracked, 0)."""
        return 0 if self.cuda else self._live(on_host=True)

    def sample(self) -> int:
        """Note the bytes alive now toward the peak (on the CPU done after every op; CUDA's allocator keeps
        its own peak, read at exit)."""
        now = self.current()
        self.peak = max(self.peak, now)
        return now

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata not in self._storages or self._storages[ref.cdata][0].expired():
            self._storages[ref.cdata] = (ref, storage.nbytes(), self._host)

    def _live(self, on_host: bool) -> int:
        total = 0
        for key in list(self._storages):
            ref, nbytes, host = self._storages[key]
            if ref.expired():
                del self._storages[key]
            elif host == on_host:
                total += nbytes
        return total


def _warm_up_cublas(device: torch.device) -> None:
    """One matmul, so that cuBLAS's workspace exists before the baseline is taken."""
    a = torch.ones(8, 8, device=device)
    (a @ a).sum().item()


_ACTIVE: list[DeviceMemory] = []  # trackers entered and not yet left, innermost last


@contextmanager
def host_memory():
    """Tensors made inside are host memory for the active CPU tracker (a runtime's host store)."""
    tracker = _ACTIVE[-1] if _ACTIVE else None
    if tracker is None:
        yield
        return
    tracker._host, previous = True, tracker._host
    try:
        yield
    finally:
        tracker._host = previous


class _Allocations(TorchDispatchMode):
    """Registers the storage of every tensor an aten op returns, and samples the live bytes after it."""

    def __init__(self, memory: DeviceMemory):
        super().__init__()
        self.memory = memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.memory._add(t)
        self.memory.sample()  # the op's inputs and outputs are all alive here
        return out
