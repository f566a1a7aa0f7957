"""A model of PyTorch's CUDA caching allocator, and a replay of a policy's step through it. No torch here.

On a GPU the memory a process holds is what the caching allocator has reserved from the driver (segments),
not the sum of live tensor sizes. The rules below follow `c10/cuda/CUDACachingAllocator.cpp` (PyTorch 2.x;
constants from `c10/core/CachingDeviceAllocator.h`):

- a request is rounded up to a multiple of kMinBlockSize = 512 B (`round_size`; the optional
  `roundup_power2_divisions` setting is not modelled);
- requests of at most kSmallSize = 1 MiB come from the small pool, larger ones from the large pool;
- when no cached block fits, a segment is reserved (`get_allocation_size`): kSmallBuffer = 2 MiB for a
  small request, kLargeBuffer = 20 MiB for a request under kMinLargeAlloc = 10 MiB, else the request
  rounded up to kRoundLarge = 2 MiB;
- a cached block is chosen best-fit: the smallest free block of the same pool *and stream* that is large
  enough (ties: the older segment, then the lower offset; the source compares addresses); `max_split_size`
  (default unlimited) keeps blocks at or above it whole, and such a block serves only requests within
  `max_non_split_rounding` (default 20 MiB) of it;
- the chosen block is split when the rest is at least 512 B (small pool, or expandable segments) or more
  than 1 MiB (large pool, `should_split`); a freed block merges with free neighbours of its segment;
- a block freed while another stream still uses it (`record_stream`) goes back to the pool only once that
  stream's work queued at the free has finished (`process_events`, run at each malloc): here, at a time;
- on reaching `capacity`, cached unsplit segments are released (`release_cached_blocks`, after waiting for
  pending events) and the request retried, else OutOfMemory;
- `expandable_segments`: one segment per pool and stream that grows by mapping pages at its end
  (2 MiB pages for the small pool, 20 MiB for the large); free space at the end of the segment is reused
  before mapping more. Simplified: pages are unmapped only from the end of a segment, on reaching capacity,
  and best fit does not count the unmapped room after a block (the source's "expandable size").

`allocated` counts block sizes (rounded, like `max_memory_allocated`), `requested` the bytes asked for,
`reserved` segment bytes (`max_memory_reserved`).
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from gaswap.base.errors import GaswapError
from gaswap.base.program import Verb
from gaswap.plan.graph import Graph
from gaswap.plan.problem import Evaluated, Problem
from gaswap.plan.walker import Hooks, Walker

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded to a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment (and an expandable small-pool page)
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment for 1-10 MiB requests (and an expandable large-pool page)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here on a segment is the request rounded to ROUND_LARGE
ROUND_LARGE = 2 << 20  # kRoundLarge
NO_LIMIT = 2**63 - 1


def round_size(nbytes: int) -> int:
    """The block size a request of `nbytes` gets (`round_size`): a multiple of 512 B, at least 512 B."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """The segment reserved for a rounded request that no cached block serves (`get_allocation_size`)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class OutOfMemory(GaswapError):
    """The request does not fit under the capacity even after releasing cached segments."""


@dataclass(eq=False)
class _Block:
    segment: "_Segment"
    offset: int
    size: int
    allocated: bool = False
    requested: int = 0

    def key(self):
        return (self.segment.stream, self.size, self.segment.id, self.offset)


@dataclass(eq=False)
class _Segment:
    id: int
    small: bool
    stream: str
    size: int  # reserved (mapped) bytes
    expandable: bool = False
    blocks: list = field(default_factory=list)  # _Blocks in address order, covering [0, size)


class CachingAllocator:
    """The allocator of one device. `malloc` returns a handle for `free`; times are seconds of the step."""

    def __init__(self, *, expandable_segments: bool = False, capacity: int | None = None,
                 max_split_size: int | None = None, max_non_split_rounding: int = LARGE_BUFFER):
        self.expandable = expandable_segments
        self.capacity = capacity
        self.max_split = max_split_size or NO_LIMIT
        self.max_non_split_rounding = max_non_split_rounding
        self.free_blocks = {True: [], False: []}  # small? -> sorted [(key, block)] of cached free blocks
        self.segments: list[_Segment] = []
        self.live: dict[int, _Block] = {}
        self.pending: list[tuple[float, int, _Block]] = []  # (reusable at, tiebreak, block) freed in use
        self._ids = itertools.count()
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = self.peak_requested = 0
        self.segment_allocs = 0  # cudaMalloc calls (or page mappings) made

    # --- the public interface ---
    def malloc(self, nbytes: int, stream: str = "compute", now: float = 0.0) -> int:
        """Allocate `nbytes` on `stream` at time `now`; returns a handle."""
        self.process_events(now)
        handle = next(self._ids)
        if nbytes == 0:  # a zero-byte tensor allocates nothing
            self.live[handle] = None
            return handle
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, stream, size)
        if block is None:
            block = self._grow(small, stream, size)
        block = self._split(block, size)
        block.allocated, block.requested = True, nbytes
        self.live[handle] = block
        self.allocated += block.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        return handle

    def free(self, handle: int, reusable_at: float | None = None) -> None:
        """Free a block; with `reusable_at`, another stream still uses it until then (`record_stream`)."""
        block = self.live.pop(handle)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        if reusable_at is None:
            self._cache(block)
        else:
            self.pending.append((reusable_at, next(self._ids), block))

    def process_events(self, now: float) -> None:
        """Return to their pools the blocks whose other streams' work has finished by `now`."""
        done = [p for p in self.pending if p[0] <= now]
        if done:
            self.pending = [p for p in self.pending if p[0] > now]
            for *_, block in sorted(done, key=lambda p: p[:2]):
                self._cache(block)

    def offset_of(self, handle: int) -> tuple[int, int]:
        """(segment id, offset) of a live block."""
        block = self.live[handle]
        return block.segment.id, block.offset

    # --- finding a block ---
    def _best_fit(self, small: bool, stream: str, size: int) -> _Block | None:
        blocks = self.free_blocks[small]
        k = bisect.bisect_left(blocks, ((stream, size),))
        while k < len(blocks) and blocks[k][0][0] == stream:
            block = blocks[k][1]
            if block.segment.expandable != self.expandable:  # expandable segments turned off: skip them
                k += 1
                continue
            if size < self.max_split <= block.size:  # do not return an oversized block for a smaller request
                return None
            if size >= self.max_split and block.size >= size + self.max_non_split_rounding:
                return None
            del blocks[k]
            return block
        return None

    def _grow(self, small: bool, stream: str, size: int) -> _Block:
        """A new segment (or more mapped pages of the expandable one) holding a free block of `size`."""
        for attempt in range(2):
            block = self._expand(small, stream, size) if self.expandable else self._new_segment(small, stream, size)
            if block is not None:
                return block
            if attempt == 0:
                self.release_cached()
        raise OutOfMemory(f"cannot allocate {size} bytes: {self.reserved} reserved of {self.capacity}")

    def _fits(self, extra: int) -> bool:
        return self.capacity is None or self.reserved + extra <= self.capacity

    def _reserve(self, extra: int) -> None:
        self.reserved += extra
        self.segment_allocs += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _new_segment(self, small: bool, stream: str, size: int) -> _Block | None:
        alloc = allocation_size(size)
        if not self._fits(alloc):
            return None
        segment = _Segment(next(self._ids), small, stream, alloc)
        block = _Block(segment, 0, alloc)
        segment.blocks.append(block)
        self.segments.append(segment)
        self._reserve(alloc)
        return block

    def _expand(self, small: bool, stream: str, size: int) -> _Block | None:
        segment = next((s for s in self.segments if s.expandable and s.small == small and s.stream == stream), None)
        if segment is None:
            segment = _Segment(next(self._ids), small, stream, 0, expandable=True)
            self.segments.append(segment)
        tail = segment.blocks[-1] if segment.blocks and not segment.blocks[-1].allocated else None
        have = tail.size if tail is not None and tail in self._cached(tail) else 0
        page = SMALL_BUFFER if small else LARGE_BUFFER
        extra = -(-(size - have) // page) * page
        if not self._fits(extra):
            return None
        self._reserve(extra)
        if have:
            self._uncache(tail)
            tail.size += extra
        else:
            tail = _Block(segment, segment.size, extra)
            segment.blocks.append(tail)
        segment.size += extra
        return tail

    def _split(self, block: _Block, size: int) -> _Block:
        rest = block.size - size
        small_or_expandable = block.segment.small or block.segment.expandable
        if (rest >= MIN_BLOCK) if small_or_expandable else (size < self.max_split and rest > SMALL_SIZE):
            blocks = block.segment.blocks
            remainder = _Block(block.segment, block.offset + size, rest)
            blocks.insert(blocks.index(block) + 1, remainder)
            block.size = size
            self._insert(remainder)
        return block

    # --- the cache of free blocks ---
    def _cached(self, block: _Block) -> list:
        blocks = self.free_blocks[block.segment.small]
        k = bisect.bisect_left(blocks, (block.key(),))
        return [block] if k < len(blocks) and blocks[k][1] is block else []

    def _insert(self, block: _Block) -> None:
        bisect.insort(self.free_blocks[block.segment.small], (block.key(), block))

    def _uncache(self, block: _Block) -> None:
        blocks = self.free_blocks[block.segment.small]
        del blocks[bisect.bisect_left(blocks, (block.key(),))]

    def _cache(self, block: _Block) -> None:
        """Put a freed block back, merged with free cached neighbours (`free_block`, `try_merge_blocks`)."""
        blocks = block.segment.blocks
        k = blocks.index(block)
        for j in (k + 1, k - 1):
            if 0 <= j < len(blocks) and not blocks[j].allocated and self._cached(blocks[j]):
                other = blocks[j]
                self._uncache(other)
                block.offset = min(block.offset, other.offset)
                block.size += other.size
                blocks.remove(other)
        self._insert(block)

    def release_cached(self) -> None:
        """Wait for pending frees, then give back every fully free segment (`release_cached_blocks`) and,
        for expandable segments, the free pages at their end."""
        self.process_events(float("inf"))
        for segment in list(self.segments):
            blocks = segment.blocks
            if segment.expandable:
                tail = blocks[-1] if blocks and not blocks[-1].allocated and self._cached(blocks[-1]) else None
                if tail is None:
                    continue
                page = SMALL_BUFFER if segment.small else LARGE_BUFFER
                drop = segment.size - -(-tail.offset // page) * page  # the whole free pages at the end
                if drop <= 0:
                    continue
                self._uncache(tail)
                tail.size -= drop
                segment.size -= drop
                self.reserved -= drop
                if tail.size:
                    self._insert(tail)
                else:
                    blocks.pop()
            elif len(blocks) == 1 and not blocks[0].allocated:
                self._uncache(blocks[0])
                self.segments.remove(segment)
                self.reserved -= segment.size


# --------------------------------------------------------------------------- replaying a simulated step


@dataclass(frozen=True)
class AllocatorPeaks:
    """Peaks of one step replayed through the allocator model, in bytes; `simulated` is the simulator's."""

    simulated: int
    requested: int  # peak of the bytes asked for: equals `simulated` when the replay matches the simulator
    allocated: int  # peak of rounded block bytes (max_memory_allocated)
    reserved: int  # peak of segment bytes (max_memory_reserved)
    optimizer_step: int  # peak allocated during the optimizer step after the step (0 if not replayed)
    segments: int  # segments (or page mappings) reserved

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# Bytes the optimizer step allocates at once, as temporaries, in multiples of the parameters' bytes:
# torch.optim.Adam's foreach path (the default on CUDA) makes one tensor per parameter
# (`torch._foreach_sqrt(exp_avg_sqs)`) while every gradient is alive; SGD (with or without momentum,
# no nesterov) updates in place. Modelled, not measured.
OPTIMIZER_TEMPORARIES = {"sgd": 0, "sgd_momentum": 0, "adam": 1}


def replay(graph: Graph, result, *, steps: int = 2, expandable_segments: bool = False, swap_in_stream: str = "compute",
           swap_out_free: str = "event", optimizer: str | None = None, capacity: int | None = None,
           optimizer_state: str = "lazy", workspace: int = 0, transients: dict[str, int] | None = None
           ) -> AllocatorPeaks:
    """Replay a traced SimResult's program (or a policy's: anything with a `program`) through the allocator
    model for `steps` training steps.

    What is resident all step (parameters, buffers, inputs, optimizer state, as the graph counts them) is
    allocated first, once (optimizer state as one tensor per parameter and state slot). Then, per step:
    `run`/`recompute` allocate the op's outputs on the compute stream (a recompute of a tensor still there
    allocates and drops a copy, as the simulator does), `swap_in` allocates on `swap_in_stream` ("compute",
    or "h2d": the stream's own pool), `free` frees. `swap_out_free` says how a swapped-out tensor's memory
    goes: "event" (compute waits for the copy's event, then frees: at the simulator's `free`) or
    "record_stream" (freed at `retire`, reusable once the d2h work queued by then is done). At the end of
    a step the loss and gradients go (after the optimizer step's temporaries, if `optimizer` is given);
    the next step allocates its inputs again. The peaks are over all steps (the allocator caches segments
    across steps, so the second step shows the steady state).

    `optimizer_state` says when the optimizer state (as the graph counts it) is made: "lazy", as torch.optim
    does (`_init_group` at the first `step()`: Adam's exp_avg and exp_avg_sq, SGD's momentum buffers), during
    the first step's optimizer step, while the gradients are alive, parameter by parameter (each parameter's
    slots in turn), before the step's temporaries, so the first step's forward and backward run without it;
    "resident": allocated first with the parameters, slot by slot (a steady state with no first step).

    What the device holds beyond the graph's tensors (docs/gpu_memory.md, "Memory the graph does not hold"):
    `workspace` bytes made once and kept (cuBLAS's workspace, made through the allocator at the first matmul:
    a block of 10 MiB or more takes a segment of its own, so it is modelled as made before the first step), and
    `transients` (op name -> bytes an op allocates and frees while it runs: cuDNN's workspaces, temporaries
    inside an op, as measured on the device by `gaswap.run.measure.op_transients`), each allocated after the
    op's outputs and freed before the next instruction."""
    if optimizer_state not in ("lazy", "resident"):
        raise ValueError(f"optimizer_state must be 'lazy' or 'resident', got {optimizer_state!r}")
    alloc = CachingAllocator(expandable_segments=expandable_segments, capacity=capacity)
    _, events = step_events(graph, result, swap_in_stream=swap_in_stream, swap_out_free=swap_out_free,
                            transients=transients)
    lazy = optimizer_state == "lazy"
    for nbytes in _resident(graph) + ([] if lazy else _optimizer_state(graph)) + ([workspace] if workspace else []):
        alloc.malloc(nbytes)
    optimizer_peak = 0
    for step in range(steps):
        handles: dict[int, int] = {}
        for kind, key, nbytes, stream, when, *_ in events:
            if kind == "malloc":
                handles[key] = alloc.malloc(nbytes, stream, when)
            else:
                alloc.free(handles.pop(key), when)
        if lazy and step == 0:
            for nbytes in _optimizer_state(graph, by_parameter=True):
                alloc.malloc(nbytes)
        if optimizer:
            before, alloc.peak_allocated = alloc.peak_allocated, alloc.allocated
            temps = [alloc.malloc(t.size if graph.counts(t) else 0) for t in graph.tensors.values()
                     if t.kind == "param" for _ in range(OPTIMIZER_TEMPORARIES[optimizer])]
            optimizer_peak = max(optimizer_peak, alloc.peak_allocated)
            alloc.peak_allocated = max(before, alloc.peak_allocated)
            for handle in temps:
                alloc.free(handle)
        for handle in handles.values():  # the loss and gradients: gone after the optimizer step
            alloc.free(handle)
        alloc.process_events(float("inf"))
    simulated = getattr(result, "peak_bytes", None) or getattr(result, "predicted", {}).get("peak_bytes", 0)
    return AllocatorPeaks(simulated, alloc.peak_requested, alloc.peak_allocated, alloc.peak_reserved, optimizer_peak,
                          alloc.segment_allocs)


def step_events(graph: Graph, result, *, swap_in_stream: str = "compute", swap_out_free: str = "event",
                transients: dict[str, int] | None = None):
    """The allocations of one step of a traced SimResult, as `replay` describes them: (resident, events).

    `resident` lists the bytes of what is there before the step (parameters, buffers, optimizer state;
    not the inputs); `events` are ("malloc", key, bytes, stream, time, tensor, instruction) and ("free", key,
    0, "", reusable_at or None, tensor, instruction) in program order, keys unique per allocation, `instruction`
    the index in `result.program` (-1: before it). Keys never freed are alive at the step's end. An op with
    `transients` bytes allocates them after its outputs and frees them at once (the tensor named is "")."""
    if not result.program:
        raise ValueError("allocator replay needs a traced SimResult (Simulator.run(..., trace=True))")
    allocations = _Allocations(graph, result, swap_in_stream, swap_out_free, transients or {})
    Walker(graph, allocations).walk(result.program)
    return _resident(graph) + _optimizer_state(graph), allocations.events


def _resident(graph: Graph) -> list[int]:
    """The bytes of what is there before any step, optimizer state aside: parameters and buffers."""
    return [t.size if graph.counts(t) else 0 for t in graph.tensors.values() if t.producer is None and t.kind != "input"]


class _Allocations(Hooks):
    """The hooks of `step_events`: each instruction's mallocs and frees, keyed per allocation."""

    def __init__(self, graph: Graph, result, swap_in_stream: str, swap_out_free: str, transients: dict[str, int]):
        self.size = {t.name: (t.size if graph.counts(t) else 0) for t in graph.tensors.values()}
        self.transients = transients
        self.swap_in_stream, self.record_stream = swap_in_stream, swap_out_free == "record_stream"
        self.times = _instruction_times(result)
        self.timed = bool(getattr(result, "timeline", ()))
        self.landed = {} if self.timed else _landing_positions(result.program)
        self.events: list[tuple] = []
        self.keys = itertools.count()
        self.at = -1  # the instruction being replayed
        self.live = {t.name: self.malloc(t.name, "compute", 0.0) for t in graph.tensors.values() if t.kind == "input"}
        # swapped-out device copies waiting for their copy to the host, oldest first (a tensor re-made by a
        # recompute while its first copy waits is retired twice); with record_stream they are freed at once
        self.retired: dict[str, list[int]] = {}
        self.d2h_queued = 0.0  # when the d2h work issued so far ends

    def malloc(self, name: str, stream: str, when: float, nbytes: int | None = None) -> int:
        key = next(self.keys)
        self.events.append(("malloc", key, self.size[name] if nbytes is None else nbytes, stream, when, name, self.at))
        return key

    def free(self, key: int, reusable_at: float | None = None) -> None:
        self.events.append(("free", key, 0, "", reusable_at, "", self.at))

    def on_run(self, k: int, op, made: list[str]) -> None:
        self.at, start = k, self.times[k][0]
        dropped = []
        for t in op.outputs:
            key = self.malloc(t, "compute", start)
            if t in made:
                self.live[t] = key
            else:  # re-produced while kept: the copy is dropped after the op
                dropped.append(key)
        if self.transients.get(op.name):  # the op's own temporaries, while it runs
            dropped.insert(0, self.malloc("", "compute", start, self.transients[op.name]))
        for key in dropped:
            self.free(key)

    on_recompute = on_run

    def on_swap_in(self, k: int, tensor: str) -> None:
        self.at = k
        self.live[tensor] = self.malloc(tensor, self.swap_in_stream, self.times[k][0])

    def on_swap_out(self, k: int, tensor: str) -> None:
        self.d2h_queued = max(self.d2h_queued, self.times[k][1])

    def on_retire(self, k: int, tensor: str) -> None:
        """The device copy waits for its copy to the host; a swap-in may come first."""
        self.at = k
        key = self.live.pop(tensor)
        if self.record_stream:
            self.free(key, self.d2h_queued if self.timed else self.landed[k])
        else:
            self.retired.setdefault(tensor, []).append(key)

    def on_free(self, k: int, tensor: str, retired: bool) -> None:
        """A retired copy goes before the swapped-in one (see Simulator.settle); with record_stream it went at
        its retire."""
        self.at = k
        if not retired:
            self.free(self.live.pop(tensor))
        elif not self.record_stream:
            self.free(self.retired[tensor].pop(0))


def replay_recorded(trace, *, expandable_segments: bool = False) -> dict:
    """Replay an allocation trace recorded on a GPU through the model, beside what the GPU did.

    `trace` is one device's entries of `torch.cuda.memory._snapshot()["device_traces"]` (recorded with
    `torch.cuda.memory._record_memory_history()`): "alloc" is a malloc of `size` on `stream`, "free_completed"
    the moment its block (matched by `addr`) is free for reuse; "segment_alloc"/"segment_map" and
    "segment_free"/"segment_unmap" are what the GPU reserved and gave back. The model sees the same
    requests in the same order, so its reserved peak and segment count are compared with the GPU's
    own, free of any difference between a simulated and a real step. Memory reserved before the trace
    started is not seen by either side."""
    alloc = CachingAllocator(expandable_segments=expandable_segments)
    live: dict[int, int] = {}
    reserved = peak = segments = 0
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            live[entry["addr"]] = alloc.malloc(entry["size"], str(entry.get("stream", 0)))
        elif action == "free_completed" and entry["addr"] in live:
            alloc.free(live.pop(entry["addr"]))
        elif action in ("segment_alloc", "segment_map"):
            reserved += entry["size"]
            segments += 1
            peak = max(peak, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= entry["size"]
    return {"model": {"allocated": alloc.peak_allocated, "reserved": alloc.peak_reserved,
                      "segments": alloc.segment_allocs},
            "gpu": {"reserved": peak, "segments": segments}}


def _optimizer_state(graph: Graph, *, by_parameter: bool = False) -> list[int]:
    """The optimizer state as tensors: k per parameter when it is k times the parameters' bytes, else one; slot
    by slot (all parameters' first slot, then the second), or `by_parameter` (each parameter's k slots in turn:
    the order torch.optim makes them in at its first step)."""
    state = graph.resident.get("optimizer_state", 0)
    if not state or "optimizer_state" not in graph.counted:
        return []
    params = [t.size for t in graph.tensors.values() if t.kind == "param"]
    total = sum(params)
    if total and state % total == 0:
        k = state // total
        return [p for p in params for _ in range(k)] if by_parameter else params * k
    return [state]


def _instruction_times(result) -> list[tuple[float, float]]:
    """(start, end) of each instruction of a traced SimResult: run/recompute/swap_out/swap_in take their
    timeline event's (both are appended together, in the same order); free/retire the time reached so far.
    A program without a timeline (a policy file's) gets its positions as times (see `_landing_positions`)."""
    if not getattr(result, "timeline", ()):
        return [(float(k), float(k)) for k in range(len(result.program))]
    events = iter([e for e in result.timeline if e.kind != "wait"])
    now, out = 0.0, []
    for verb, _ in result.program:
        if verb in (Verb.RUN, Verb.RECOMPUTE, Verb.SWAP_OUT, Verb.SWAP_IN):
            event = next(events)
            out.append((event.start, event.end))
            if event.stream == "compute":
                now = max(now, event.end)
        else:
            out.append((now, now))
    return out


def _landing_positions(program) -> dict[int, float]:
    """For a program without a timeline: the position of each `retire`'s matching `free` (the simulator issues
    it once the copy to the host has landed), used as the time a record_stream-freed block becomes reusable."""
    out, waiting = {}, {}
    for k, (verb, name) in enumerate(program):
        if verb == Verb.RETIRE:
            waiting[name] = k
        elif verb == Verb.FREE and name in waiting:
            out[waiting.pop(name)] = float(k)
    return out | {k: float(len(program)) for k in waiting.values()}


def predict(simulator, order, actions, **options) -> AllocatorPeaks:
    """The allocator-model peaks of one policy (a traced simulation, then `replay`)."""
    result = simulator.run(order, actions, trace=True)
    if not result.valid:
        raise ValueError(f"invalid policy: {result.reason}")
    return replay(simulator.graph, result, **options)


def figures(graph: Graph, result, **options) -> dict:
    """The live (simulator), allocated and reserved (allocator model) peak bytes of a traced SimResult; `options`
    go to `replay`."""
    peaks = replay(graph, result, **options)
    return {"live_bytes": result.peak_bytes, "allocated_bytes": peaks.allocated, "reserved_bytes": peaks.reserved}


class ReservedProblem(Problem):
    """A `Problem` whose peak objective, and so its budget constraint, is the allocator model's reserved peak:
    `search(ReservedProblem(graph, costs, budget, space), ...)` targets what the process may reserve.
    `options` go to `replay` (default one step with the optimizer state resident: the steady state; with two
    steps or more, the first makes it, as torch.optim does). Each evaluation is a traced simulation plus a
    replay: several times slower than `Problem.evaluate`."""

    def __init__(self, graph: Graph, costs, budget: int | None = None, space=None, *, actions=None, **options):
        super().__init__(graph, costs, budget, space, actions=actions)
        self.options = {"steps": 1} | options
        self.options.setdefault("optimizer_state", "lazy" if self.options["steps"] > 1 else "resident")

    def __getstate__(self) -> dict:
        return super().__getstate__() | {"options": self.options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["graph"], state["costs"], state["budget"], state["space"], actions=state["actions"],
                      **state["options"])

    def evaluate(self, c) -> Evaluated:
        r = self.simulate(c, trace=True)
        if not r.valid:
            return Evaluated(c, r.step_time, r.peak_bytes, False)
        return Evaluated(c, r.step_time, replay(self.graph, r, **self.options).reserved, True)
