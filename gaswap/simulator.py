"""Predict step time and peak memory of one training step under a policy. No torch here.

Three streams: compute runs ops in the policy's order; a device->host (d2h) and a host->device (h2d) copy
stream overlap with it (unless `Costs.copies_overlap` is False, as on a CPU: then a copy holds up compute,
and a swapped tensor is copied back just before its reader, since nothing is gained by doing it earlier).
Memory is counted in bytes on the device, in time order:

- parameters, buffers, inputs and optimizer state are resident all step (as the graph counts them);
- an op allocates its outputs when it starts; a tensor is freed when the last op reading it ends;
  gradients and the loss live to the end of the step;
- KEEP: the default above;
- SWAP: a d2h copy starts when the producer ends (and the d2h stream is free); the device copy is freed once
  that copy is done and no forward reader remains. The h2d copy back is issued, with its device memory
  allocated, at the latest op before the first backward reader whose preceding compute covers the copy
  (just-in-time prefetch); under a budget it waits while it would push memory over the budget before its
  reader runs (`room_until`); a reader waits for the copy to land;
- RECOMPUTE: freed after its last forward reader; before its first backward reader its producer runs again,
  first re-producing (recursively) inputs that are gone; re-produced tensors stay until their last reader.

A tensor that must be re-produced but cannot be (its producer is random or mutates state, and it is
neither resident nor on the host) makes the policy invalid: the result says why.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

from gaswap.costs import Costs
from gaswap.graph import COUNTABLE, Graph
from gaswap.program import Action, Instruction, Verb

KEEP, SWAP = Action.KEEP, Action.SWAP
# `SimResult.program` is the simulated step as a runtime replays it: Instructions in issue order.
# What device memory holds, for traced runs (`SimResult.changes`).
CATEGORIES = ("parameters", "optimizer state", "inputs and buffers", "gradients", "activations", "swapped in",
              "recomputed")


@dataclass(frozen=True)
class Event:
    """One interval on a stream, and why it happened."""

    stream: str  # "compute" | "d2h" | "h2d"
    kind: str  # "op" | "recompute" | "swap_out" | "swap_in" | "wait"
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
    valid: bool = True
    reason: str = ""  # why a policy is invalid
    timeline: tuple[Event, ...] = ()
    memory: tuple[tuple[float, int], ...] = ()  # (time, device bytes) after each change
    changes: tuple[tuple[float, str, int], ...] = ()  # (time, one of CATEGORIES, +/- bytes), in order
    program: tuple[Instruction, ...] = ()  # what a runtime does, in order

    def by_category(self) -> list[tuple[float, dict[str, int]]]:
        """Device bytes per category after each change of a traced run: [(time, {category: bytes})]."""
        level = dict.fromkeys(CATEGORIES, 0)
        out = []
        for when, category, delta in self.changes:
            level[category] += delta
            out.append((when, dict(level)))
        return out


class Unrealizable(Exception):
    """A tensor is needed again but the policy left no way to bring it back."""


class Simulator:
    """Holds the graph and costs as flat arrays, so that `run` evaluates many policies fast."""

    def __init__(self, graph: Graph, costs: Costs, budget: int | None = None):
        self.graph = graph
        self.costs = costs
        names = list(graph.tensors)
        tid = {t: k for k, t in enumerate(names)}
        oid = graph.op_index()
        self.tensor_names = names
        self.op_names = [op.name for op in graph.ops]
        self.op_time = [costs.op_time[op.name] for op in graph.ops]
        self.op_in = [tuple(tid[t] for t in op.inputs) for op in graph.ops]
        self.op_out = [tuple(tid[t] for t in op.outputs) for op in graph.ops]
        self.op_fwd = [op.phase == "fwd" for op in graph.ops]
        self.op_recomputable = [op.recomputable and op.phase == "fwd" for op in graph.ops]
        tensors = list(graph.tensors.values())
        self.size = [t.size if graph.counts(t) else 0 for t in tensors]
        self.kind = [t.kind for t in tensors]
        self.producer = [oid[t.producer] if t.producer is not None else -1 for t in tensors]
        # persistent: resident from production (or the start) to the end of the step
        self.persistent = [t.producer is None or t.kind == "grad" or t.name == graph.loss for t in tensors]
        self.base_bytes = graph.resident_bytes()
        self.candidates = [tid[t] for t in graph.candidates()]
        self.out_bytes = [sum(self.size[t] for t in out) for out in self.op_out]
        self.budget = budget  # prefetches wait while they would push memory over it
        self.d2h_time = [costs.copy_time(t.size, "d2h") for t in tensors]
        self.h2d_time = [costs.copy_time(t.size, "h2d") for t in tensors]
        self.serial_copies = not costs.copies_overlap

    def run(self, order, actions, *, trace: bool = False) -> SimResult:
        """Simulate the ops in `order` (indices into graph.ops) with `actions` aligned with candidates."""
        try:
            return _Run(self, order, actions, trace).result()
        except Unrealizable as err:
            inf = float("inf")
            return SimResult(inf, 2**62, inf, valid=False, reason=str(err))


class _Run:
    """The state of one simulation; a class so that recursion shares it without globals."""

    def __init__(self, sim: Simulator, order, actions, trace: bool):
        self.sim, self.order, self.trace = sim, order, trace
        nt = len(sim.size)
        self.act = act = [KEEP] * nt
        for k, a in zip(sim.candidates, actions):
            act[k] = a
        self.events: list[Event] = []
        self.memory: list[tuple[float, int]] = []
        self.changes: list[tuple[float, str, int]] = []
        self.program: list[Instruction] = []
        self.category: list[str] = [""] * nt  # what each resident tensor counts as (traced runs)
        if trace:
            self.note_resident()
        self.mem = sim.base_bytes
        self.peak = self.mem
        self.pending: list[tuple[float, int, int]] = []  # (time, tensor, bytes) frees waiting for a copy
        self.resident = [p < 0 for p in sim.producer]  # parameters, buffers, inputs are there from the start
        self.on_host = [False] * nt
        self.ready = [0.0] * nt  # when a resident tensor's data is usable
        self.d2h_end = [0.0] * nt
        self.clock = self.d2h_free = self.h2d_free = 0.0
        self.compute = 0.0
        self.pos = 0  # position of the op being prepared or run
        self.needed = [0] * nt  # inputs of the recomputations under way (nested)

    def result(self) -> SimResult:
        sim, order, act = self.sim, self.order, self.act
        nt, n = len(sim.size), len(order)
        last_use, last_fwd, first_bwd = [-1] * nt, [-1] * nt, [n] * nt
        for p, i in enumerate(order):
            fwd = sim.op_fwd[i]
            for t in sim.op_in[i]:
                last_use[t] = p
                if fwd:
                    last_fwd[t] = p
                elif first_bwd[t] > p:
                    first_bwd[t] = p
        self.last_use = last_use
        pos_of = [0] * len(order)
        for p, i in enumerate(order):
            pos_of[i] = p
        made = [pos_of[i] if i >= 0 else 0 for i in sim.producer]
        release: list[list[int]] = [[] for _ in range(n)]  # tensors to release after position p
        for t in range(nt):
            if act[t] != KEEP:  # gone after its forward readers, back for the backward ones
                release[max(last_fwd[t], made[t])].append(t)
                release[max(last_use[t], made[t])].append(t)
            elif not sim.persistent[t]:
                release[max(last_use[t], made[t])].append(t)
        self.release_after = release
        prefetch: list[list[int]] = [[] for _ in range(n)]
        swapped = [t for t in sim.candidates if act[t] == SWAP]
        if swapped:
            prefix, self.made_before = [0.0], [0]  # compute time and bytes allocated before each position
            for i in order:
                prefix.append(prefix[-1] + sim.op_time[i])
                self.made_before.append(self.made_before[-1] + sim.out_bytes[i])
            for t in sorted(swapped, key=first_bwd.__getitem__):  # same position: first needed, first copied
                c = first_bwd[t]
                p = min(c, bisect.bisect_right(prefix, prefix[c] - sim.h2d_time[t]) - 1)  # zero-time ops: not past c
                if sim.serial_copies:
                    p = c
                prefetch[max(p, last_fwd[t] + 1, made[t] + 1)].append(t)
                if sim.producer[t] < 0:  # an input: its copy to the host starts with the step
                    self.swap_out(t, 0.0)

        op_in, op_out, names = sim.op_in, sim.op_out, sim.op_names
        budget = sim.budget
        resident = self.resident
        for p, i in enumerate(order):
            self.pos = p
            for t in prefetch[p]:
                if resident[t]:
                    continue
                if p < first_bwd[t]:
                    if self.d2h_end[t] > self.clock:
                        prefetch[p + 1].append(t)  # its device copy is still there: don't hold it twice
                        continue
                    if budget is not None and not self.room_until(t, p, first_bwd[t]):
                        prefetch[p + 1].append(t)  # no room under the budget yet
                        continue
                self.swap_in(t, self.clock, f"prefetch for {names[order[first_bwd[t]]]}")
            for t in op_in[i]:
                if not resident[t]:
                    self.rematerialize(t, names[i])
            self.run_op(i, self.start_time(op_in[i]), "op", f"position {p} of the order")
            end = self.clock
            for t in op_out[i]:
                if act[t] == SWAP:
                    self.swap_out(t, end)
            for t in release[p]:
                if resident[t]:
                    self.release(t, end)
        self.settle(float("inf"))
        step = max(self.clock, self.d2h_free, self.h2d_free)
        return SimResult(step, self.peak, self.compute, timeline=tuple(self.events), memory=tuple(self.memory),
                         changes=tuple(self.changes), program=tuple(self.program))

    # --- memory ---
    def note_resident(self) -> None:
        """Record what is resident from the start, by category (traced runs)."""
        sim = self.sim
        for t, kind in enumerate(sim.kind):
            if sim.producer[t] < 0:
                self.category[t] = "parameters" if kind == "param" else "inputs and buffers"
                self.changes.append((0.0, self.category[t], sim.size[t]))
        for category, nbytes in sim.graph.resident.items():
            if category in sim.graph.counted or category not in COUNTABLE:
                self.changes.append((0.0, category.replace("_", " "), nbytes))

    def settle(self, when: float) -> None:
        """Apply the frees of swapped-out tensors whose copies have landed by `when`."""
        pending = self.pending
        while pending and pending[0][0] <= when:
            freed_at, t, freed = heapq.heappop(pending)
            self.mem -= freed
            if self.trace:
                self.memory.append((freed_at, self.mem))
                self.changes.append((freed_at, self.category[t], -freed))
                self.program.append(Instruction(Verb.FREE, self.sim.tensor_names[t]))

    def room_until(self, t: int, p: int, c: int) -> bool:
        """Whether bringing `t` back now keeps memory under the budget while the ops at positions p..c-1 run
        (its reader is at c). A projection from what is known now: op outputs and the frees that follow
        them, device copies of swapped tensors that go when their copies to the host land, and ops that wait
        for copies to the device (at least until the host copy has landed and been copied back); the memory
        of recomputations and of later prefetches is not foreseen."""
        sim, order, act = self.sim, self.order, self.act
        size, op_out, op_time, out_bytes = sim.size, sim.op_out, sim.op_time, sim.out_bytes
        self.settle(self.clock)
        level = self.mem + size[t]
        if level + self.made_before[c] - self.made_before[p] <= sim.budget:  # fits even if nothing is freed
            return True
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
                if act[u] == SWAP:
                    d2h_free = max(d2h_free, clock) + sim.d2h_time[u]
                born[u] = d2h_free if act[u] == SWAP else clock
            for u in self.release_after[q]:
                if u in gone or not (self.resident[u] or u in born):
                    continue
                gone.add(u)
                copying_until = born[u] if u in born else self.d2h_end[u]
                if act[u] == SWAP and copying_until > clock:
                    bisect.insort(landing, (copying_until, size[u]), lo=k)
                else:
                    level -= size[u]
        return True

    def alloc(self, nbytes: int, when: float) -> None:
        self.settle(when)
        self.mem += nbytes
        if self.mem > self.peak:
            self.peak = self.mem
        if self.trace:
            self.memory.append((when, self.mem))

    def free(self, t: int, when: float) -> None:
        self.resident[t] = False
        self.mem -= self.sim.size[t]
        if self.trace:
            self.memory.append((when, self.mem))
            self.changes.append((when, self.category[t], -self.sim.size[t]))
            self.program.append(Instruction(Verb.FREE, self.sim.tensor_names[t]))

    def release(self, t: int, when: float) -> None:
        """Free `t` after its last reader; a swapped tensor's device copy waits for its d2h copy."""
        if self.act[t] == SWAP and self.on_host[t] and self.d2h_end[t] > when:
            self.resident[t] = False
            heapq.heappush(self.pending, (self.d2h_end[t], t, self.sim.size[t]))
            if self.trace:
                self.program.append(Instruction(Verb.RETIRE, self.sim.tensor_names[t]))
        else:
            self.free(t, when)

    # --- streams ---
    def start_time(self, inputs) -> float:
        """When an op reading `inputs` can start: compute is free and every input has landed."""
        start = self.clock
        for t in inputs:
            if self.ready[t] > start:
                start = self.ready[t]
        return start

    def run_op(self, i: int, start: float, kind: str, reason: str) -> None:
        sim = self.sim
        if self.trace and start > self.clock:
            waited = [sim.tensor_names[t] for t in sim.op_in[i] if self.ready[t] > self.clock]
            self.events.append(Event("compute", "wait", sim.op_names[i], self.clock, start,
                                     "wait for swap-in of " + ", ".join(waited)))
        end = start + sim.op_time[i]
        nbytes = 0
        for t in sim.op_out[i]:
            nbytes += sim.size[t]
        self.alloc(nbytes, start)
        # A recomputed op may re-produce an output that is already here: that copy is made, then dropped
        # (the kept one stays, and is ready when it was).
        duplicates = [t for t in sim.op_out[i] if self.resident[t]]
        for t in sim.op_out[i]:
            if self.trace:
                cat = "recomputed" if kind == "recompute" else "gradients" if sim.kind[t] == "grad" else "activations"
                self.changes.append((start, cat, sim.size[t]))
                if t not in duplicates:
                    self.category[t] = cat
            if t not in duplicates:
                self.resident[t] = True
                self.ready[t] = end
        for t in duplicates:
            self.mem -= sim.size[t]
            if self.trace:
                self.changes.append((start, "recomputed", -sim.size[t]))
                self.memory.append((start, self.mem))
        self.clock = end
        self.compute += sim.op_time[i]
        if self.trace:
            self.events.append(Event("compute", kind, sim.op_names[i], start, end, reason))
            self.program.append(Instruction(Verb.RUN if kind == "op" else Verb.RECOMPUTE, sim.op_names[i]))

    def swap_out(self, t: int, when: float) -> None:
        start = max(self.d2h_free, when, self.clock if self.sim.serial_copies else when)
        self.d2h_free = self.d2h_end[t] = end = start + self.sim.d2h_time[t]
        if self.sim.serial_copies:
            self.clock = end
        self.on_host[t] = True
        if self.trace:
            name = self.sim.tensor_names[t]
            self.events.append(Event("d2h", "swap_out", name, start, end, f"swap-out {name} after its producer"))
            self.program.append(Instruction(Verb.SWAP_OUT, name))

    def swap_in(self, t: int, when: float, reason: str) -> None:
        self.alloc(self.sim.size[t], when)
        self.resident[t] = True
        if self.trace:
            self.category[t] = "swapped in"
            self.changes.append((when, "swapped in", self.sim.size[t]))
        start = max(self.h2d_free, when, self.d2h_end[t], self.clock if self.sim.serial_copies else when)
        self.h2d_free = self.ready[t] = end = start + self.sim.h2d_time[t]
        if self.sim.serial_copies:
            self.clock = end
        if self.trace:
            name = self.sim.tensor_names[t]
            self.events.append(Event("h2d", "swap_in", name, start, end, f"swap-in {name}: {reason}"))
            self.program.append(Instruction(Verb.SWAP_IN, name))

    # --- bringing tensors back ---
    def rematerialize(self, t: int, reader: str) -> None:
        """Make `t` resident again for `reader`: copy it back from the host or re-run its producer."""
        sim = self.sim
        if self.on_host[t]:
            self.swap_in(t, self.clock, f"on demand for {reader}")
            return
        i = sim.producer[t]
        if i < 0 or not sim.op_recomputable[i]:
            why = "its producer is random or mutates state" if i >= 0 else "it has no producer"
            raise Unrealizable(f"{sim.tensor_names[t]} is needed by {reader} but is gone and {why}")
        needed = self.needed
        for u in sim.op_in[i]:
            needed[u] += 1  # re-producing another input must not drop this one
        for u in sim.op_in[i]:
            if not self.resident[u]:
                self.rematerialize(u, sim.op_names[i])
        self.run_op(i, self.start_time(sim.op_in[i]), "recompute", f"recompute {sim.op_names[i]} for {reader}")
        for u in sim.op_in[i]:
            needed[u] -= 1
        for u in sim.op_in[i] + sim.op_out[i]:  # drop what no later op reads, nor a recompute under way
            transient = not sim.persistent[u] or self.act[u] != KEEP
            if self.resident[u] and self.last_use[u] < self.pos and transient and u != t and not needed[u]:
                self.free(u, self.clock)


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
