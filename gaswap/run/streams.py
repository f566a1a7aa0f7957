"""Streams and events for the runtime's copies between the device and the host.

A runner copies through one of these backends, made once per runner for its device (`for_device`):
 - `CudaStreams`: the compute stream current on the runner's device, and one copy stream per direction
   made once; events are `torch.cuda.Event`s; copies are non-blocking; host memory is pinned.
 - `SyncStreams`: the CPU, where the host store is the same RAM: a copy runs at once and waits are nothing.
 - `LaggingStreams`: a CPU stand-in for CUDA that checks every wait the runtime relies on (gaswap.run.stream_check)
   and runs copy-stream work as late as CUDA may (`prompt`: as soon as it is queued).

A runner runs each part of a step inside `streams.running(done)` (`done`: the part ends the step, after which no
copy may be in flight); only the stand-in does anything there. Every copy is host memory for an active CPU
`DeviceMemory`.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from gaswap.run.step_memory import host_memory
from gaswap.run.stream_check import (
    COMPUTE,
    Event,
    LaggingStream,
    StreamCheck,
    StreamRace,
)

__all__ = ["CudaStreams", "LaggingStreams", "StreamRace", "SyncStreams", "for_device"]


def for_device(device: torch.device):
    """The backend a runner on `device` copies through: `CudaStreams` on CUDA, else `SyncStreams`."""
    return CudaStreams(device) if device.type == "cuda" else SyncStreams()


class CudaStreams:
    """CUDA streams and events on one device; the copy streams are made once, here."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def running(self, done: bool):
        """Around a part of a step: nothing to do on CUDA."""
        return contextlib.nullcontext()

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

    def running(self, done: bool):
        return contextlib.nullcontext()

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
    """A CPU stand-in for CUDA streams, with CUDA's ordering rules checked.

    Values: work queued on a copy stream runs only when a wait forces it (or, on the streams named in `prompt`,
    "d2h" / "h2d", as soon as it is queued, after what it waits for); a copy's destination holds poison (NaN, or
    the dtype's largest value) until the copy runs, so a read that comes too early gives wrong values.

    Order: compute ops run at once on the host, yet on a GPU they run late too, and the caching allocator hands
    memory freed on the compute stream to the next compute allocation at once. Inside `running`, every aten op
    is a step of the compute stream, and `StreamCheck` keeps each stream's vector clock (what it has waited
    for): a copy that reads what compute wrote after the copy's stream last waited for it, that writes memory
    compute touched (made, read, wrote) since, or that reads a host buffer the other copy stream writes without
    its event; compute reading, writing or freeing memory of a copy it has not waited for; a step that ends with
    copies compute has not waited for: each raises `StreamRace` at once, under every schedule.
    """

    def __init__(self, prompt: tuple[str, ...] = ()):
        self.d2h, self.h2d = LaggingStream("d2h", "d2h" in prompt), LaggingStream("h2d", "h2d" in prompt)
        self._compute = LaggingStream(COMPUTE)  # never queued on: compute work runs at once
        self.check = StreamCheck(self._compute, self.d2h, self.h2d)

    def running(self, done: bool):
        """Count the aten ops run inside as compute work; with `done`, refuse to end with copies in flight."""
        return self.check.running(done)

    def compute(self):
        return self._compute

    def wait_stream(self, stream, other) -> None:
        self.wait_event(stream, self.record(other))

    def wait_event(self, stream, event: Event) -> None:
        self.check.wait(stream, event)
        source = event.stream
        if source is self._compute:
            return  # compute's work ran when it was called
        if stream is self._compute:
            source.run_to(event.mark)
        else:
            stream.queue(lambda: source.run_to(event.mark))

    def record(self, stream) -> Event:
        return self.check.record(stream)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.check.copy(stream, dst, src)
        with self.check.side(), host_memory():
            _poison(dst)
        dst_ref, src_ref = weakref.ref(dst), weakref.ref(src)

        def run():
            dst, src = dst_ref(), src_ref()
            if dst is not None and src is not None:
                with self.check.side(), host_memory():
                    dst.copy_(src)

        stream.queue(run)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


def _poison(t: torch.Tensor) -> None:
    """Fill `t` with a value no correct result holds by chance: NaN, or the dtype's largest value."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)
