"""Predict step time and peak memory of one training step under a policy. No torch here.

Three streams: compute runs ops in the policy's order; a device->host (d2h) and a host->device (h2d) copy
stream overlap with it (unless `Costs.copies_overlap` is False, as on a CPU: then a copy holds up compute,
and a swapped tensor is copied back just before its reader, since nothing is gained by doing it earlier).
Memory is counted in bytes on the device, in time order:

- parameters, buffers, inputs and optimizer state are resident all step (as the graph counts them);
- an op allocates its outputs when it starts; a tensor is freed when the last op reading it ends;
  gradients and the loss live to the end of the step;
- KEEP: the default above; with `hold_sources` (a compiled step, whose backward recomputes from what the
  forward saved, each recomputed value once) a kept tensor also stays until the recomputations that start
  from it have run: those of the tensors not kept that are computed from it, directly or through other
  tensors not kept; and so does a recomputed one, once re-produced (held through the op the recomputation
  is for: one op longer than the compiled backward holds it);
- SWAP: a d2h copy starts when the producer ends (and the d2h stream is free); the device copy is freed once
  that copy is done and no forward reader remains. The h2d copy back is issued, with its device memory
  allocated, at the latest op before the first backward reader whose preceding compute covers the copy
  (just-in-time prefetch); under a budget it waits while it would push memory over the budget before its
  reader runs (`room_until`); a reader waits for the copy to land;
- RECOMPUTE: freed after its last forward reader; before its first backward reader its producer runs again,
  first re-producing (recursively) inputs that are gone; re-produced tensors stay until their last reader.
  One `inlined_if_recomputed` (a compiled step's: inductor computes it inside the kernels that read it)
  takes no memory when recomputed; what its producer reads stays until its last reader instead.

A tensor that must be re-produced but cannot be (its producer is random or mutates state, and it is
neither resident nor on the host) makes the policy invalid: the result says why.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from gaswap.base.errors import GaswapError
from gaswap.base.program import Action, Instruction, Verb
from gaswap.plan.costs import Costs
from gaswap.plan.graph import COUNTABLE, Graph
from gaswap.plan.walker import Layout, Walker

# Streams of the timeline, and the one event kind that is not an instruction (compute waits for a copy).
COMPUTE, D2H, H2D = "compute", "d2h", "h2d"
WAIT = "wait"
# What device memory holds, for traced runs (`SimResult.changes`).
CATEGORIES = ("parameters", "optimizer state", "inputs and buffers", "gradients", "activations", "swapped in",
              "recomputed")


@dataclass(frozen=True)
class Event:
    """One interval on a stream, and why it happened."""

    stream: str  # COMPUTE | D2H | H2D
    kind: str  # Verb.RUN | Verb.RECOMPUTE | Verb.SWAP_OUT | Verb.SWAP_IN | WAIT
    name: str  # the op or tensor concerned
    start: float
    end: float
    reason: str


@dataclass(frozen=True)
class SimResult:
    """Predicted step time (s) and peak device bytes; `timeline` and `memory` only when traced."""

    step_time: float
    peak_bytes: int
    compute_time: float  # seconds of compute, recomputation included
    saved_bytes: int = 0  # kept candidates the backward reads, or recomputes from (with `hold_sources`)
    valid: bool = True
    reason: str = ""  # why a policy is invalid
    timeline: tuple[Event, ...] = ()
    memory: tuple[tuple[float, int], ...] = ()  # (time, device bytes) after each change
    changes: tuple[tuple[float, str, int], ...] = ()  # (time, one of CATEGORIES, +/- bytes), in order
    program: tuple[Instruction, ...] = ()  # the simulated step as a runtime replays it, in issue order

    def by_category(self) -> list[tuple[float, dict[str, int]]]:
        """Device bytes per category after each change of a traced run: [(time, {category: bytes})]."""
        level = dict.fromkeys(CATEGORIES, 0)
        out = []
        for when, category, delta in self.changes:
            level[category] += delta
            out.append((when, dict(level)))
        return out


class Unrealizable(GaswapError):
    """A tensor is needed again but the policy left no way to bring it back."""


class Liveness(NamedTuple):
    """Per tensor, positions in an order: its last reader, its last forward reader (-1: none) and its first
    backward reader (len(order): none)."""

    last_use: list[int]
    last_fwd: list[int]
    first_bwd: list[int]


def liveness(sim: "Simulator", order) -> Liveness:
    """Where each tensor of `sim` is read in `order` (indices into graph.ops, each op once)."""
    return Liveness(*(a.tolist() for a in _liveness(sim, _positions(sim, order), len(order))))


def _positions(sim: "Simulator", order) -> np.ndarray:
    """The position of each op in `order`, and 0 after the last op (where `sim.made_by` points for tensors
    no op makes)."""
    pos = np.zeros(len(sim.op_time) + 1, dtype=np.intp)
    pos[np.asarray(order, dtype=np.intp)] = sim.positions[:len(order)]
    return pos


def _liveness(sim: "Simulator", pos: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`liveness` as arrays, from the op positions `pos` of an order of `n` ops."""
    never = np.empty(len(sim.size), dtype=np.intp)
    never.fill(n)
    return (sim.reads.reduce(np.maximum, pos, sim.unread.copy()),
            sim.fwd_reads.reduce(np.maximum, pos, sim.unread.copy()),
            sim.bwd_reads.reduce(np.minimum, pos, never))


class _Reads(NamedTuple):
    """Reads of tensors by ops, grouped by tensor: a per-graph table that per-order positions reduce over."""

    tensors: np.ndarray  # each tensor read at least once, ascending
    ops: np.ndarray  # the reader of each read, grouped by tensor
    starts: np.ndarray  # where each tensor's group begins in `ops`

    @classmethod
    def of(cls, reads) -> "_Reads":
        """From (tensor, op) pairs."""
        pairs = np.array(sorted(reads), dtype=np.intp).reshape(-1, 2)
        tensors, starts = np.unique(pairs[:, 0], return_index=True)
        return cls(tensors, pairs[:, 1].copy(), starts)

    def reduce(self, ufunc, pos: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`out` with, for each tensor read, `ufunc` over the positions (`pos`) of its readers."""
        if len(self.ops):
            out[self.tensors] = ufunc.reduceat(pos[self.ops], self.starts)
        return out


class Simulator:
    """Holds the graph and costs as flat arrays, so that `run` evaluates many policies fast."""

    def __init__(self, graph: Graph, costs: Costs, budget: int | None = None, *, hold_sources: bool | None = None,
                 inlined_if_recomputed=()):
        """`hold_sources` (see the module's KEEP): by default, where the graph has `decidable` tensors, which
        only a compiled graph has. `inlined_if_recomputed`: names of candidates that take no memory when
        recomputed (see the module's RECOMPUTE)."""
        self.graph, self.costs = graph, costs
        self.budget = budget  # prefetches wait while they would push memory over it
        self.serial_copies = not costs.copies_overlap
        self.tensor_names = list(graph.tensors)
        tid = {t: k for k, t in enumerate(self.tensor_names)}
        self.op_tables(tid)
        self.tensor_tables(tid, graph.op_index())
        self.static_tables()
        # candidate -> the nearest candidates it is computed from (through tensors that are not candidates),
        # candidates latest made first: where a recomputation may start (`hold_sources`)
        hold = bool(graph.decidable) if hold_sources is None else hold_sources
        self.sources = _candidate_sources(graph, self.candidates, tid) if hold else None
        self.recompute_tables([tid[t] for t in inlined_if_recomputed])
        self._layout: Layout | None = None

    def op_tables(self, tid: dict[str, int]) -> None:
        """Per op, by index into graph.ops: name, time, input and output tensors, phase, recomputability."""
        ops = self.graph.ops
        self.op_names = [op.name for op in ops]
        self.op_time = [self.costs.op_time[op.name] for op in ops]
        self.op_in = [tuple(tid[t] for t in op.inputs) for op in ops]
        self.op_out = [tuple(tid[t] for t in op.outputs) for op in ops]
        self.op_touched = [a + b for a, b in zip(self.op_in, self.op_out)]  # inputs, then outputs
        self.op_fwd = [op.phase == "fwd" for op in ops]
        self.op_recomputable = [op.recomputable and op.phase == "fwd" for op in ops]

    def tensor_tables(self, tid: dict[str, int], oid: dict[str, int]) -> None:
        """Per tensor, by index into graph.tensors: counted size, kind, producer, persistence, copy times;
        the candidates, and the bytes each op makes."""
        graph, costs = self.graph, self.costs
        tensors = list(graph.tensors.values())
        self.size = [t.size if graph.counts(t) else 0 for t in tensors]
        self.kind = [t.kind for t in tensors]
        self.producer = [oid[t.producer] if t.producer is not None else -1 for t in tensors]
        # persistent: resident from production (or the start) to the end of the step
        self.persistent = [t.producer is None or t.kind == "grad" or t.name == graph.loss for t in tensors]
        self.base_bytes = graph.resident_bytes()
        self.candidates = [tid[t] for t in graph.candidates()]
        self.out_bytes = [sum(self.size[t] for t in out) for out in self.op_out]
        self.d2h_time = [costs.copy_time(t.size, "d2h") for t in tensors]
        self.h2d_time = [costs.copy_time(t.size, "h2d") for t in tensors]

    def recompute_tables(self, inlined: list[int]) -> None:
        """Which tensors take no memory when recomputed (`inlined_if_recomputed`), what their producers read
        that is not resident all step, and which forward values that are not candidates can be re-produced."""
        self.inlined_if_recomputed = np.zeros(len(self.size), dtype=bool)
        self.inlined_if_recomputed[inlined] = True
        self.inline_sources = {t: np.array([u for u in self.op_in[self.producer[t]] if not self.persistent[u]],
                                           dtype=np.intp) for t in self.inlined_if_recomputed.nonzero()[0].tolist()}
        candidate = set(self.candidates)
        self.reproducible = np.array([p >= 0 and self.op_recomputable[p] and not self.persistent[t] and t not in candidate
                                      for t, p in enumerate(self.producer)], dtype=bool)

    def static_tables(self) -> None:
        """Arrays that turn an order into its liveness and schedules without a loop over ops in Python."""
        reads = [(t, i) for i, inputs in enumerate(self.op_in) for t in inputs]
        self.reads = _Reads.of(reads)
        self.fwd_reads = _Reads.of((t, i) for t, i in reads if self.op_fwd[i])
        self.bwd_reads = _Reads.of((t, i) for t, i in reads if not self.op_fwd[i])
        self.positions = np.arange(len(self.op_time), dtype=np.intp)
        self.unread = np.full(len(self.size), -1, dtype=np.intp)
        self.made_by = np.array([p if p >= 0 else len(self.op_time) for p in self.producer], dtype=np.intp)
        self.transient = ~np.array(self.persistent, dtype=bool)
        self.candidate_ids = np.array(self.candidates, dtype=np.intp)
        self.op_time_array = np.array(self.op_time, dtype=float)
        self.size_array = np.array(self.size, dtype=np.int64)
        self.out_bytes_array = np.array(self.out_bytes, dtype=np.int64)
        self.h2d_time_array = np.array(self.h2d_time, dtype=float)
        self.resident_at_start = [p < 0 for p in self.producer]  # parameters, buffers, inputs

    def layout(self) -> Layout:
        """The graph as a `Walker` reads it (made on the first traced run)."""
        if self._layout is None:
            self._layout = Layout.of(self.graph)
        return self._layout

    def run(self, order, actions, *, trace: bool = False) -> SimResult:
        """Simulate the ops in `order` (indices into graph.ops, each op once) with `actions` aligned with
        candidates; `trace` records the timeline, the memory changes and the program."""
        try:
            return (_TracedRun if trace else _Run)(self, order, actions).result()
        except Unrealizable as err:
            inf = float("inf")
            return SimResult(inf, 2**62, inf, valid=False, reason=str(err))


def _candidate_sources(graph: Graph, candidates: list[int], tid: dict[str, int]) -> list[tuple[int, list[int]]]:
    """(candidate, the nearest candidates it is computed from) for each candidate, latest made first."""
    is_candidate = set(candidates)
    nearest: dict[int, set[int]] = {}  # tensor -> the candidates its producer reads, through non-candidates
    made_at: dict[int, int] = {}
    for k, op in enumerate(graph.ops):  # in topological order
        found: set[int] = set()
        for u in (tid[i] for i in op.inputs):
            found |= {u} if u in is_candidate else nearest.get(u, set())
        for t in (tid[o] for o in op.outputs):
            nearest[t], made_at[t] = found, k
    latest_first = sorted(candidates, key=lambda t: -made_at.get(t, -1))
    return [(t, sorted(nearest.get(t, ()))) for t in latest_first]


def hold_sources(sources, moved: np.ndarray, last_use: np.ndarray, first_bwd: np.ndarray, n: int,
                 swapped: np.ndarray | None = None) -> list[int]:
    """Extend (in place) the `last_use` of each candidate to the first backward reader of every candidate not
    kept (`moved`) that is recomputed from it, directly or through others recomputed (`Simulator.sources`).
    Returns the kept candidates recomputed from. A `swapped` candidate (moved too) comes back from the host
    where a recomputation reads it: it is neither recomputed from its sources nor held."""
    needed: dict[int, int] = {}  # candidate -> the latest position a recomputation from it runs at
    held = []
    for t, inputs in sources:
        if swapped is not None and swapped[t]:
            continue
        if moved[t]:
            at = max(needed.get(t, -1), int(first_bwd[t]) if first_bwd[t] < n else -1)
            if at >= 0:
                if at > last_use[t]:  # once re-produced, it stays for the recomputations that read it
                    last_use[t] = at
                for u in inputs:
                    if needed.get(u, -1) < at:
                        needed[u] = at
        elif t in needed:
            held.append(t)
            if needed[t] > last_use[t]:
                last_use[t] = needed[t]
    return held


class _Run:
    """One simulation, untraced; a class so that recursion shares its state without globals.

    Phases: liveness of the order (`liveness`), the release schedule (`release_schedule`), the prefetch
    schedule (`prefetch_schedule`), then the main loop (`execute`). `_TracedRun` records what happens.
    The phases before the main loop work on arrays, from the simulator's per-graph tables.
    """

    def __init__(self, sim: Simulator, order, actions):
        self.sim, self.order = sim, order
        nt, n = len(sim.size), len(order)
        order_array = np.fromiter(order, dtype=np.intp, count=n)
        pos = _positions(sim, order_array)
        last_use, last_fwd, first_bwd = _liveness(sim, pos, n)
        made = pos[sim.made_by]  # position of each tensor's producer (0: inputs)
        m = min(len(actions), len(sim.candidates))
        acts = np.fromiter(actions, dtype=np.intp, count=m)
        candidates = sim.candidate_ids[:m]
        keep = acts == int(Action.KEEP)  # an int: comparing an array with the enum is several times slower
        moved = np.zeros(nt, dtype=bool)  # not KEEP: gone after the forward readers, back for the backward ones
        moved[candidates[~keep]] = True
        kept = candidates[keep]
        saved = kept[first_bwd[kept] < n]  # read by the backward
        self.saved_bytes = int(sim.size_array[saved].sum())
        swapped = candidates[acts == int(Action.SWAP)]  # in the order of the candidates
        swaps = np.zeros(nt, dtype=bool)
        swaps[swapped] = True
        if sim.sources is not None:
            held = hold_sources(sim.sources, moved, last_use, first_bwd, n, swaps)  # recomputed from
            self.saved_bytes += sum(sim.size[t] for t in held if first_bwd[t] >= n)
        self.size, self.out_bytes = sim.size, sim.out_bytes
        recomputed = candidates[acts == int(Action.RECOMPUTE)]
        inlined = recomputed[sim.inlined_if_recomputed[recomputed]]
        if len(inlined):
            self.inline(inlined, moved, last_use, last_fwd, first_bwd, n)
        self.swapped = swaps.tolist()
        self.last_use = last_use.tolist()
        self.droppable = (moved | sim.transient).tolist()  # what a recomputation may drop after its last reader
        self.first_bwd: dict[int, int] = {}  # swapped tensor -> position of its first backward reader
        # released[release_at[p]:release_at[p + 1]]: the tensors to release after position p
        self.released, self.release_at = self.release_schedule(made, last_use, last_fwd, moved)
        self.made_before: list[int] = []  # bytes allocated by the ops before each position (when swapping)
        self.inputs_out: list[int] = []  # swapped inputs: copied to the host as the step starts
        self.prefetch: dict[int, list[int]] = {}  # position -> swapped tensors whose copy back is tried there
        if len(swapped):
            self.prefetch_schedule(order_array, swapped, made, last_fwd, first_bwd)
        self.mem = sim.base_bytes
        self.peak = self.mem
        self.pending: list[tuple[float, int, int]] = []  # (time, tensor, bytes) frees waiting for a copy
        self.resident = sim.resident_at_start[:]
        self.on_host = [False] * nt
        self.ready = [0.0] * nt  # when a resident tensor's data is usable
        self.d2h_end = [0.0] * nt
        self.clock = self.d2h_free = self.h2d_free = 0.0
        self.compute = 0.0
        self.pos = 0  # position of the op being prepared or run
        self.needed = [0] * nt  # inputs of the recomputations under way (nested)
        self.siblings: list[int] = []  # other outputs of the ops re-run for the op at `pos` (`rematerialize`)

    def inline(self, inlined, moved, last_use, last_fwd, first_bwd, n: int) -> None:
        """The recomputed tensors `inlined` take no memory; what their producers read stays, in the forward and
        when re-produced for the backward, until their last readers there (a forward value the backward does
        not read is re-produced there, as a recomputed one is)."""
        sim = self.sim
        self.size, self.out_bytes = sim.size[:], sim.out_bytes[:]
        for t in inlined.tolist():
            self.size[t] = 0
            self.out_bytes[sim.producer[t]] -= sim.size[t]
        sources = [sim.inline_sources[t] for t in inlined.tolist()]
        ts = np.repeat(inlined, [len(u) for u in sources])  # (t, u) pairs: u is read to make t
        us = np.concatenate(sources)
        moved[us[~moved[us] & (first_bwd[us] >= n) & sim.reproducible[us]]] = True
        back = moved[us]
        while True:  # to a fixed point: an inlined tensor may be made from another
            before = (last_use[us].sum(), last_fwd[us].sum())
            np.maximum.at(last_use, us, last_use[ts])
            np.maximum.at(last_fwd, us[back], last_fwd[ts[back]])
            if (last_use[us].sum(), last_fwd[us].sum()) == before:
                break

    # --- schedules ---
    def release_schedule(self, made, last_use, last_fwd, moved) -> tuple[list[int], list[int]]:
        """After which position each tensor is released: after its last reader, and a moved one also after
        its last forward reader (never before it is made); persistent kept tensors never. Returns the
        tensors by position (ascending tensor, the forward release first) and where each position begins."""
        early = moved.nonzero()[0]
        late = (moved | self.sim.transient).nonzero()[0]
        nt2 = 2 * len(moved)  # sort key: (position, tensor, early before late)
        key = np.concatenate((np.maximum(last_fwd[early], made[early]) * nt2 + 2 * early,
                              np.maximum(last_use[late], made[late]) * nt2 + 2 * late + 1))
        key.sort()
        starts = key.searchsorted(self.sim.positions[:len(self.order)] * nt2)
        return (key % nt2 // 2).tolist(), starts.tolist() + [len(key)]

    def prefetch_schedule(self, order, swapped, made, last_fwd, first_bwd) -> None:
        """At which position each swapped tensor's copy back is first tried: the latest op before its first
        backward reader whose preceding compute covers the copy (at the reader itself with serial copies),
        never before its last forward reader has run nor before it is made."""
        sim = self.sim
        prefix = np.concatenate(([0.0], np.cumsum(sim.op_time_array[order])))  # compute time before each position
        if sim.budget is not None:
            self.made_before = np.concatenate(([0], np.cumsum(sim.out_bytes_array[order]))).tolist()
        reader = first_bwd[swapped]
        self.first_bwd = dict(zip(swapped.tolist(), reader.tolist()))
        at = reader
        if not sim.serial_copies:  # zero-time ops: not past the reader
            at = np.minimum(reader, prefix.searchsorted(prefix[reader] - sim.h2d_time_array[swapped], "right") - 1)
        at = np.maximum(at, np.maximum(last_fwd[swapped], made[swapped]) + 1)
        first_needed = reader.argsort(kind="stable")  # same position: first needed, first copied
        for t, p in zip(swapped[first_needed].tolist(), at[first_needed].tolist()):
            self.prefetch.setdefault(p, []).append(t)
            if sim.producer[t] < 0:
                self.inputs_out.append(t)

    # --- the main loop ---
    def result(self) -> SimResult:
        self.execute()
        return SimResult(max(self.clock, self.d2h_free, self.h2d_free), self.peak, self.compute, self.saved_bytes)

    def execute(self) -> None:
        """Run the ops in order: prefetches due, rematerializations, the op, swap-outs, releases.

        This is `_TracedRun.execute` with `run_op`, `swap_out`, `free` and `settle` written inline, as it
        runs for every op of every evaluation (the traced run overrides those to record). The clock, memory,
        peak and compute time live in local variables here, and in `self` around the calls that use them.
        """
        sim = self.sim
        op_in, op_out, op_time, out_bytes, size, names = (sim.op_in, sim.op_out, sim.op_time, self.out_bytes,
                                                          self.size, sim.op_names)
        d2h_time, serial = sim.d2h_time, sim.serial_copies
        resident, ready, swapped, on_host, d2h_end = self.resident, self.ready, self.swapped, self.on_host, self.d2h_end
        prefetch, released, release_at, pending = self.prefetch, self.released, self.release_at, self.pending
        for t in self.inputs_out:  # an input's copy to the host starts with the step
            self.swap_out(t, 0.0)
        clock, mem, peak, compute = self.clock, self.mem, self.peak, self.compute
        for p, i in enumerate(self.order):
            if p in prefetch:
                self.clock, self.mem, self.peak = clock, mem, peak
                self.issue_prefetches(p)
                clock, mem, peak = self.clock, self.mem, self.peak
            start = clock
            for t in op_in[i]:
                if not resident[t]:  # bring back what is gone, then start when all has landed
                    self.pos, self.clock, self.mem, self.peak, self.compute = p, clock, mem, peak, compute
                    for u in op_in[i]:
                        if not resident[u]:
                            self.rematerialize(u, names[i])
                    self.drop_siblings()
                    start = self.start_time(i)
                    clock, mem, peak, compute = self.clock, self.mem, self.peak, self.compute
                    break
                if ready[t] > start:
                    start = ready[t]
            while pending and pending[0][0] <= start:  # copies to the host landed by then: their frees
                mem -= heapq.heappop(pending)[2]
            mem += out_bytes[i]
            if mem > peak:
                peak = mem
            end = clock = start + op_time[i]
            compute += op_time[i]
            for t in op_out[i]:
                if resident[t]:
                    mem -= size[t]
                else:
                    resident[t] = True
                    ready[t] = end
                if swapped[t]:  # its copy to the host starts
                    copy = max(self.d2h_free, clock) + d2h_time[t]
                    self.d2h_free = d2h_end[t] = copy
                    on_host[t] = True
                    if serial:
                        clock = copy
            # after the last reader; a swapped tensor's device copy waits for its copy to the host
            for t in released[release_at[p]:release_at[p + 1]]:
                if resident[t]:
                    if swapped[t] and on_host[t] and d2h_end[t] > clock:
                        self.retire(t)
                    else:
                        resident[t] = False
                        mem -= size[t]
        self.clock, self.mem, self.peak, self.compute = clock, mem, peak, compute
        self.settle(float("inf"))

    def issue_prefetches(self, p: int) -> None:
        """Copy back the swapped tensors due at position p, unless their device copy is still there or,
        before their reader, there is no room under the budget yet: those are tried again at p + 1."""
        first_bwd, resident, budget = self.first_bwd, self.resident, self.sim.budget
        for t in self.prefetch.pop(p):
            if resident[t]:
                continue
            c = first_bwd[t]
            if p < c and (self.d2h_end[t] > self.clock or budget is not None and not self.room_until(t, p, c)):
                self.prefetch.setdefault(p + 1, []).append(t)
                continue
            self.swap_in(t, self.clock, "prefetch for", self.sim.op_names[self.order[c]])

    # --- memory ---
    def settle(self, when: float) -> None:
        """Apply the frees of swapped-out tensors whose copies have landed by `when`."""
        pending = self.pending
        while pending and pending[0][0] <= when:
            self.landed(*heapq.heappop(pending))

    def landed(self, when: float, t: int, nbytes: int) -> None:
        """The copy to the host of a retired tensor has landed: its device copy goes."""
        self.mem -= nbytes

    def room_until(self, t: int, p: int, c: int) -> bool:
        """Whether bringing `t` back now keeps memory under the budget while the ops at positions p..c-1 run
        (its reader is at c). A projection from what is known now: op outputs and the frees that follow
        them, device copies of swapped tensors that go when their copies to the host land, and ops that wait
        for copies to the device (at least until the host copy has landed and been copied back); the memory
        of recomputations and of later prefetches is not foreseen."""
        sim = self.sim
        self.settle(self.clock)
        level = self.mem + self.size[t]
        if level + self.made_before[c] - self.made_before[p] <= sim.budget:  # fits even if nothing is freed
            return True
        order, swapped = self.order, self.swapped
        size, op_out, op_time, out_bytes = self.size, sim.op_out, sim.op_time, self.out_bytes
        landing = sorted((when, nbytes) for when, _, nbytes in self.pending)
        born: dict[int, float] = {}  # tensors made in the window -> when their copy to the host lands
        gone = set()
        clock, d2h_free = self.clock, max(self.clock, self.d2h_free)
        k = 0
        for q in range(p, c):
            i = order[q]
            for u in sim.op_in[i]:  # an op waits for copies to the device: under way, or not before the host has it
                if u in born:
                    continue
                if self.resident[u]:
                    clock = max(clock, self.ready[u])
                elif self.on_host[u]:
                    clock = max(clock, self.d2h_end[u] + sim.h2d_time[u])
            while k < len(landing) and landing[k][0] <= clock:
                level -= landing[k][1]
                k += 1
            if level + out_bytes[i] > sim.budget:
                return False
            level += out_bytes[i]
            clock += op_time[i]
            for u in op_out[i]:
                if swapped[u]:
                    d2h_free = max(d2h_free, clock) + sim.d2h_time[u]
                born[u] = d2h_free if swapped[u] else clock
            for u in self.released[self.release_at[q]:self.release_at[q + 1]]:
                if u in gone or not (self.resident[u] or u in born):
                    continue
                gone.add(u)
                copying_until = born[u] if u in born else self.d2h_end[u]
                if swapped[u] and copying_until > clock:
                    bisect.insort(landing, (copying_until, size[u]), lo=k)
                else:
                    level -= size[u]
        return True

    def free(self, t: int, when: float) -> None:
        self.resident[t] = False
        self.mem -= self.size[t]

    def retire(self, t: int) -> None:
        """`t`'s device copy goes once its copy to the host has landed."""
        self.resident[t] = False
        heapq.heappush(self.pending, (self.d2h_end[t], t, self.size[t]))

    # --- streams ---
    def start_time(self, i: int) -> float:
        """When op i can start: compute is free and every input has landed."""
        start, ready = self.clock, self.ready
        for t in self.sim.op_in[i]:
            if ready[t] > start:
                start = ready[t]
        return start

    def run_op(self, i: int, start: float, reader: str = "") -> None:
        """Op i runs from `start` (again, for `reader`, when one is named): its outputs are allocated; one
        already here (a recomputed op re-producing a kept output) is made, then dropped, and the kept one
        stays, ready when it was."""
        sim = self.sim
        end = start + sim.op_time[i]
        if self.pending and self.pending[0][0] <= start:  # frees of copies landed by then
            self.settle(start)
        mem = self.mem + self.out_bytes[i]
        if mem > self.peak:
            self.peak = mem
        resident, ready, size = self.resident, self.ready, self.size
        for t in sim.op_out[i]:
            if resident[t]:
                mem -= size[t]
            else:
                resident[t] = True
                ready[t] = end
        self.mem = mem
        self.clock = end
        self.compute += sim.op_time[i]

    def swap_out(self, t: int, when: float) -> float:
        """Start copying `t` to the host; returns when the copy starts."""
        sim = self.sim
        start = max(self.d2h_free, when, self.clock if sim.serial_copies else when)
        self.d2h_free = self.d2h_end[t] = end = start + sim.d2h_time[t]
        if sim.serial_copies:
            self.clock = end
        self.on_host[t] = True
        return start

    def swap_in(self, t: int, when: float, why: str, reader: str) -> float:
        """Allocate `t` on the device and copy it back (`why` `reader`: "prefetch for b3"); returns when the
        copy starts."""
        sim = self.sim
        self.settle(when)
        self.mem += self.size[t]
        if self.mem > self.peak:
            self.peak = self.mem
        self.resident[t] = True
        start = max(self.h2d_free, when, self.d2h_end[t], self.clock if sim.serial_copies else when)
        self.h2d_free = self.ready[t] = end = start + sim.h2d_time[t]
        if sim.serial_copies:
            self.clock = end
        return start

    # --- bringing tensors back ---
    def rematerialize(self, t: int, reader: str) -> None:
        """Make `t` resident again for `reader`: copy it back from the host or re-run its producer."""
        sim = self.sim
        if self.on_host[t]:
            self.swap_in(t, self.clock, "on demand for", reader)
            return
        i = sim.producer[t]
        if i < 0 or not sim.op_recomputable[i]:
            why = "its producer is random or mutates state" if i >= 0 else "it has no producer"
            raise Unrealizable(f"{sim.tensor_names[t]} is needed by {reader} but is gone and {why}")
        resident = self.resident
        for u in sim.op_in[i]:
            if not resident[u]:
                self.rematerialize_inputs(i)
                break
        self.run_op(i, self.start_time(i), reader)
        last_use, needed, droppable = self.last_use, self.needed, self.droppable
        for u in sim.op_in[i]:  # drop what no later op reads, nor a recompute under way
            if resident[u] and last_use[u] < self.pos and droppable[u] and not needed[u]:
                self.free(u, self.clock)
        # the op's other outputs: another recomputation for the same reader may read one (batch norm's mean
        # and variance, made together, read by two branches): dropped once the reader's inputs are all back
        self.siblings += [u for u in sim.op_out[i] if u != t and last_use[u] < self.pos and droppable[u]]

    def drop_siblings(self) -> None:
        """Free the `siblings` no later op reads (`rematerialize`)."""
        resident, last_use = self.resident, self.last_use
        for u in self.siblings:
            if resident[u] and last_use[u] < self.pos:
                self.free(u, self.clock)
        self.siblings.clear()

    def rematerialize_inputs(self, i: int) -> None:
        """Make the inputs of op i resident before it runs again; re-producing one must not drop another."""
        needed, resident, inputs = self.needed, self.resident, self.sim.op_in[i]
        for u in inputs:
            needed[u] += 1
        for u in inputs:
            if not resident[u]:
                self.rematerialize(u, self.sim.op_names[i])
        for u in inputs:
            needed[u] -= 1


class _TracedRun(_Run):
    """A simulation that records what happens: timeline events, memory after each change, changes by
    category and the program, built through a `Walker` (which refuses an instruction that does not fit, so
    the simulator never emits a program the policy check or a runtime would refuse). Untraced runs do none
    of this work."""

    def __init__(self, sim: Simulator, order, actions):
        self.events: list[Event] = []
        self.memory: list[tuple[float, int]] = []
        self.changes: list[tuple[float, str, int]] = []
        self.walker = Walker(sim.graph, layout=sim.layout())  # the program, checked as it is built
        self.category: list[str] = [""] * len(sim.size)  # what each resident tensor counts as
        for t, kind in enumerate(sim.kind):  # resident from the start
            if sim.producer[t] < 0:
                self.category[t] = "parameters" if kind == "param" else "inputs and buffers"
                self.changes.append((0.0, self.category[t], sim.size[t]))
        for category, nbytes in sim.graph.resident.items():
            if category in sim.graph.counted or category not in COUNTABLE:
                self.changes.append((0.0, category.replace("_", " "), nbytes))
        super().__init__(sim, order, actions)

    def result(self) -> SimResult:
        self.execute()
        return SimResult(max(self.clock, self.d2h_free, self.h2d_free), self.peak, self.compute, self.saved_bytes,
                         timeline=tuple(self.events), memory=tuple(self.memory), changes=tuple(self.changes),
                         program=tuple(self.walker.program))

    def execute(self) -> None:
        """`_Run.execute` through the hooks `run_op` and `free`, which record."""
        sim, resident, swapped = self.sim, self.resident, self.swapped
        for t in self.inputs_out:
            self.swap_out(t, 0.0)
        for p, i in enumerate(self.order):
            self.pos = p
            if p in self.prefetch:
                self.issue_prefetches(p)
            for t in sim.op_in[i]:
                if not resident[t]:
                    self.rematerialize(t, sim.op_names[i])
            self.drop_siblings()
            self.run_op(i, self.start_time(i))
            for t in sim.op_out[i]:
                if swapped[t]:
                    self.swap_out(t, self.clock)
            clock = self.clock
            for t in self.released[self.release_at[p]:self.release_at[p + 1]]:
                if resident[t]:
                    if swapped[t] and self.on_host[t] and self.d2h_end[t] > clock:
                        self.retire(t)
                    else:
                        self.free(t, clock)
        self.settle(float("inf"))

    def landed(self, when: float, t: int, nbytes: int) -> None:
        super().landed(when, t, nbytes)
        self.memory.append((when, self.mem))
        self.changes.append((when, self.category[t], -nbytes))
        self.walker.step(Instruction(Verb.FREE, self.sim.tensor_names[t]))

    def free(self, t: int, when: float) -> None:
        super().free(t, when)
        self.memory.append((when, self.mem))
        self.changes.append((when, self.category[t], -self.size[t]))
        self.walker.step(Instruction(Verb.FREE, self.sim.tensor_names[t]))

    def retire(self, t: int) -> None:
        super().retire(t)
        self.walker.step(Instruction(Verb.RETIRE, self.sim.tensor_names[t]))

    def run_op(self, i: int, start: float, reader: str = "") -> None:
        if reader:
            self.record_op(i, start, Verb.RECOMPUTE, f"recompute {self.sim.op_names[i]} for {reader}")
        else:
            self.record_op(i, start, Verb.RUN, f"position {self.pos} of the order")

    def record_op(self, i: int, start: float, verb: Verb, reason: str) -> None:
        sim = self.sim
        if start > self.clock:
            waited = [sim.tensor_names[t] for t in sim.op_in[i] if self.ready[t] > self.clock]
            self.events.append(Event(COMPUTE, WAIT, sim.op_names[i], self.clock, start,
                                     "wait for swap-in of " + ", ".join(waited)))
        duplicates = [t for t in sim.op_out[i] if self.resident[t]]
        _Run.run_op(self, i, start)
        for t in sim.op_out[i]:
            category = "recomputed" if verb == Verb.RECOMPUTE else "gradients" if sim.kind[t] == "grad" else "activations"
            self.changes.append((start, category, self.size[t]))
            if t not in duplicates:
                self.category[t] = category
        level = self.mem + sum(self.size[t] for t in duplicates)  # just after the outputs were allocated
        self.memory.append((start, level))
        for t in duplicates:
            level -= self.size[t]
            self.changes.append((start, "recomputed", -self.size[t]))
            self.memory.append((start, level))
        self.events.append(Event(COMPUTE, verb, sim.op_names[i], start, self.clock, reason))
        self.walker.step(Instruction(verb, sim.op_names[i]))

    def swap_out(self, t: int, when: float) -> float:
        start = super().swap_out(t, when)
        name = self.sim.tensor_names[t]
        self.events.append(Event(D2H, Verb.SWAP_OUT, name, start, self.d2h_end[t], f"swap-out {name} after its producer"))
        self.walker.step(Instruction(Verb.SWAP_OUT, name))
        return start

    def swap_in(self, t: int, when: float, why: str, reader: str) -> float:
        start = super().swap_in(t, when, why, reader)
        self.memory.append((when, self.mem))  # after its allocation
        name = self.sim.tensor_names[t]
        self.category[t] = "swapped in"
        self.changes.append((when, "swapped in", self.size[t]))
        self.events.append(Event(H2D, Verb.SWAP_IN, name, start, self.ready[t], f"swap-in {name}: {why} {reader}"))
        self.walker.step(Instruction(Verb.SWAP_IN, name))
        return start


def lower_bound(graph: Graph) -> int:
    """Bytes no policy can go below: memory resident all step (inputs may be swapped out, so they are left
    out) plus the larger of all gradients (alive together at the end of the step) and the biggest single
    op's inputs and outputs (alive together while it runs)."""
    counted = {t.name: (t.size if graph.counts(t) else 0) for t in graph.tensors.values()}
    swappable = set(graph.candidates())
    fixed = graph.resident_bytes() - sum(counted[t] for t in swappable if graph.tensors[t].producer is None)
    grads = sum(counted[t.name] for t in graph.tensors.values() if t.kind == "grad")
    working = max(
        (sum(counted[t] for t in set(op.inputs) | set(op.outputs) if t in swappable or graph.tensors[t].producer)
         for op in graph.ops),
        default=0,
    )
    return fixed + max(grads, working)
