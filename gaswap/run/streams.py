"""Streams and events for the runtime's copies between the device and the host.

A runner copies through one of these backends, made once per runner for its device (`for_device`):
 - `CudaStreams`: the compute stream current on the runner's device, and one copy stream per direction
   made once; events are `torch.cuda.Event`s; copies are non-blocking; host memory is pinned.
 - `SyncStreams`: the CPU, where the host store is the same RAM: a copy runs at once and waits are nothing.
 - `LaggingStreams`: a CPU stand-in for CUDA that lags as far as CUDA may. Work queued on a copy stream
   runs only when a wait forces it (or, for the streams named `prompt`, as soon as it is queued, after
   what it waits for); a copy's destination holds poison (NaN, or the dtype's largest value) until the
   copy runs; a copy whose source or destination tensor was freed before it ran copies nothing. Each
   setting is a schedule CUDA may choose: a runtime that forgets a wait, or frees a tensor before the copy
   that reads it, gives wrong values under one of them, which the bitwise CPU tests see.

The compute stream is synchronous in all three as far as the copies can tell (the copy streams wait for
it, never the reverse without an event). Every copy is host memory for an active CPU `DeviceMemory`.
"""
from __future__ import annotations

import weakref
from collections import deque

import torch

from gaswap.run.step_memory import host_memory


def for_device(device: torch.device):
    """The backend a runner on `device` copies through: `CudaStreams` on CUDA, else `SyncStreams`."""
    return CudaStreams(device) if device.type == "cuda" else SyncStreams()


class CudaStreams:
    """CUDA streams and events on one device; the copy streams are made once, here."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def compute(self):
        """The stream the step's ops run on: the one current on this device now."""
        return torch.cuda.current_stream(self.device)

    def wait_stream(self, stream, other) -> None:
        """Work queued on `stream` from now on waits for the work queued on `other` so far."""
        stream.wait_stream(other)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst.copy_(src)` on `stream`."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class SyncStreams:
    """The CPU: copies run at once, there is nothing to wait for."""

    d2h = h2d = None

    def compute(self):
        return None

    def wait_stream(self, stream, other) -> None:
        pass

    def wait_event(self, stream, event) -> None:
        pass

    def record(self, stream):
        return None

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        with host_memory():
            dst.copy_(src)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class LaggingStreams:
    """A CPU stand-in for CUDA streams that runs copy-stream work as late as CUDA may, except on the copy
    streams named in `prompt` ("d2h", "h2d"), which run their work as soon as it is queued (see the module
    docstring)."""

    def __init__(self, prompt: tuple[str, ...] = ()):
        self.d2h, self.h2d = _LaggingStream("d2h", "d2h" in prompt), _LaggingStream("h2d", "h2d" in prompt)

    def compute(self):
        return _COMPUTE

    def wait_stream(self, stream, other) -> None:
        if other is not _COMPUTE:
            self.wait_event(stream, self.record(other))

    def wait_event(self, stream, event) -> None:
        source, mark = event
        if source is _COMPUTE:
            return
        if stream is _COMPUTE:
            source.run_to(mark)
        else:
            stream.queue(lambda: source.run_to(mark))

    def record(self, stream):
        return (stream, stream.queued if stream is not _COMPUTE else 0)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        with host_memory():
            _poison(dst)
        dst_ref, src_ref = weakref.ref(dst), weakref.ref(src)

        def run():
            dst, src = dst_ref(), src_ref()
            if dst is not None and src is not None:
                with host_memory():
                    dst.copy_(src)

        stream.queue(run)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class _LaggingStream:
    """Work queued in order, run up to a mark when a wait asks for it (marks count from the first item), or
    at once if `prompt`."""

    def __init__(self, name: str, prompt: bool = False):
        self.name, self.prompt = name, prompt
        self.pending: deque = deque()
        self.done = 0  # items run
        self.queued = 0  # items queued

    def queue(self, work) -> None:
        self.pending.append(work)
        self.queued += 1
        if self.prompt:
            self.run_to(self.queued)

    def run_to(self, mark: int) -> None:
        while self.done < mark:
            self.done += 1
            self.pending.popleft()()


_COMPUTE = _LaggingStream("compute")  # never queued on: compute work runs at once


def _poison(t: torch.Tensor) -> None:
    """Fill `t` with a value no correct result holds by chance: NaN, or the dtype's largest value."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)
