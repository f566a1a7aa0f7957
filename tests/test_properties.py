"""Properties of decoding and simulation on random training-step graphs (tests/strategies.py).

Each property says why it holds; the reference computations here are written independently of the
simulator, from the semantics in gaswap/simulator.py's docstring. GASWAP_PROPERTY_EXAMPLES sets the number
of examples per property (default 100; a thousand or more for a thorough hunt).

At the end, minimal hand-made examples of the simulator bugs these properties (and one search) found, all fixed.
"""
import os
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.graph import COUNTABLE, Graph, Op, Tensor, chain
from gaswap.plan.simulator import Simulator, lower_bound
from helpers import trace, unit_costs
from strategies import chromosomes, costs_for, training_graphs

K, S, R = int(Action.KEEP), int(Action.SWAP), int(Action.RECOMPUTE)
PROPERTY = settings(max_examples=int(os.environ.get("GASWAP_PROPERTY_EXAMPLES", 100)), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    """A graph, its costs, its encoding and one chromosome for it."""
    graph = draw(training_graphs())
    encoding = Encoding(graph)
    return graph, draw(costs_for(graph)), encoding, draw(chromosomes(encoding))


def simulate(graph, costs, order, actions, budget=None):
    return Simulator(graph, costs, budget).run(order, actions, trace=True)


def counted(graph) -> dict[str, int]:
    return {t.name: t.size if graph.counts(t) else 0 for t in graph.tensors.values()}


def resident_bytes(graph) -> int:
    """Counted bytes present before the step: parameters, buffers, inputs, counted optimizer state."""
    size = counted(graph)
    extra = sum(b for cat, b in graph.resident.items() if cat not in COUNTABLE or cat in graph.counted)
    return sum(size[t.name] for t in graph.tensors.values() if t.producer is None) + extra


def fixed_bytes(graph) -> int:
    """Bytes resident all step under any policy: what is resident before it, but the inputs a policy may
    swap (candidates)."""
    size, candidates = counted(graph), set(graph.candidates())
    return resident_bytes(graph) - sum(size[t] for t in candidates if graph.tensors[t].producer is None)


def liveness_peak(graph, order) -> int:
    """Keep-all peak by plain liveness: an op's outputs are allocated when it runs, a tensor is freed after
    its last reader (or right after its producer when nobody reads it); parameters, buffers, inputs,
    gradients and the loss stay all step."""
    size = counted(graph)
    persistent = {t.name for t in graph.tensors.values() if t.producer is None or t.kind == "grad"} | {graph.loss}
    last = {}
    for p, i in enumerate(order):
        for t in graph.ops[i].inputs:
            last[t] = p
    memory = peak = resident_bytes(graph)
    for p, i in enumerate(order):
        op = graph.ops[i]
        memory += sum(size[t] for t in op.outputs)
        peak = max(peak, memory)
        for t in set(op.inputs) | set(op.outputs):
            if t not in persistent and last.get(t, p) == p:
                memory -= size[t]
    return peak


def uniform(encoding, action) -> tuple[int, ...]:
    return tuple(action if action in allowed else K for allowed in encoding.allowed)


def op_events(result, kind):
    return [e for e in result.timeline if e.stream == "compute" and e.kind == kind]


# --- decoding -------------------------------------------------------------------------------------------

@PROPERTY
@given(problems())
def test_every_chromosome_decodes_to_a_valid_order(problem):
    """List scheduling only ever picks ready ops (so producers come first), prefers forward ops (and a
    forward op is always ready while any remains, since forward ops wait only on forward ops), and chains
    the non-recomputable ops in captured order."""
    graph, _, encoding, c = problem
    order = encoding.decode(c.keys)
    assert sorted(order) == list(range(len(graph.ops)))
    position = {graph.ops[i].name: p for p, i in enumerate(order)}
    for op in graph.ops:
        for t in op.inputs:
            producer = graph.tensors[t].producer
            assert producer is None or position[producer] < position[op.name]
    phases = [graph.ops[i].phase for i in order]
    assert phases == sorted(phases, key=lambda phase: phase == "bwd")
    pinned = [position[op.name] for op in graph.ops if not op.recomputable]
    assert pinned == sorted(pinned)
    assert encoding.decode(encoding.captured_keys()) == list(range(len(graph.ops)))


# --- memory -----------------------------------------------------------------------------------------------

@PROPERTY
@given(problems())
def test_keep_all_peak_is_plain_liveness(problem):
    """With every activation kept there are no copies and no recomputation: memory is liveness in the order."""
    graph, costs, encoding, c = problem
    for order in (list(range(len(graph.ops))), encoding.decode(c.keys)):
        r = simulate(graph, costs, order, uniform(encoding, K))
        assert r.valid and r.peak_bytes == liveness_peak(graph, order)


@PROPERTY
@given(problems())
def test_no_policy_goes_below_the_largest_working_set(problem):
    """While an op runs its inputs and outputs are all on the device, beside what no policy can move; after
    the last op every gradient and the loss are there. `lower_bound` claims no more than that."""
    graph, costs, encoding, c = problem
    size, fixed = counted(graph), fixed_bytes(graph)
    moveable = set(graph.candidates()) | {t.name for t in graph.tensors.values() if t.producer is not None}
    working = max(sum(size[t] for t in (set(op.inputs) | set(op.outputs)) & moveable) for op in graph.ops)
    ending = sum(size[t.name] for t in graph.tensors.values() if t.kind == "grad") + size[graph.loss]
    for actions in (c.actions, uniform(encoding, S), uniform(encoding, R)):
        r = simulate(graph, costs, encoding.decode(c.keys), actions)
        if r.valid:
            assert r.peak_bytes >= fixed + max(working, ending) >= lower_bound(graph)


@PROPERTY
@given(problems())
def test_memory_accounting_closes(problem):
    """Every allocation is freed once, no more: memory never goes negative, the traced levels reach the peak,
    and after the step exactly the persistent bytes remain (fixed, gradients, loss, and the inputs kept)."""
    graph, costs, encoding, c = problem
    r = simulate(graph, costs, encoding.decode(c.keys), c.actions)
    if not r.valid:
        return
    size, base = counted(graph), resident_bytes(graph)
    levels = [base] + [m for _, m in r.memory]
    assert min(levels) >= 0 and max(levels) == r.peak_bytes
    kept_inputs = sum(size[t] for t, a in zip(encoding.candidates, c.actions)
                      if graph.tensors[t].producer is None and a == K)
    grads = sum(size[t.name] for t in graph.tensors.values() if t.kind == "grad")
    assert levels[-1] == fixed_bytes(graph) + kept_inputs + grads + size[graph.loss]
    by_category = [sum(level.values()) for _, level in r.by_category()]
    assert by_category[-1] == levels[-1]
    assert max(by_category) == r.peak_bytes


# --- time -----------------------------------------------------------------------------------------------------

@PROPERTY
@given(problems())
def test_step_time_covers_the_compute_of_the_order(problem):
    """The compute stream runs every op of the order once plus the recomputations, one after another, and the
    step ends when all three streams are done."""
    graph, costs, encoding, c = problem
    order = encoding.decode(c.keys)
    r = simulate(graph, costs, order, c.actions)
    if not r.valid:
        return
    own = sum(costs.op_time[graph.ops[i].name] for i in order)
    again = sum(costs.op_time[e.name] for e in op_events(r, "recompute"))
    assert r.step_time >= r.compute_time == own + again >= own
    assert r.step_time == max((e.end for e in r.timeline), default=0.0)


@PROPERTY
@given(problems())
def test_swapping_everything_adds_copies_but_no_compute(problem):
    """A swapped tensor always has its host copy to come back from, so swapping is always realizable and
    never re-runs an op; each swapped candidate is copied out exactly once."""
    graph, costs, encoding, c = problem
    order = encoding.decode(c.keys)
    keep = simulate(graph, costs, order, uniform(encoding, K))
    swap = simulate(graph, costs, order, uniform(encoding, S))
    assert swap.valid and keep.valid
    assert swap.compute_time == keep.compute_time and not op_events(swap, "recompute")
    assert sorted(e.name for e in swap.timeline if e.kind == "swap_out") == sorted(encoding.candidates)
    assert swap.step_time >= keep.step_time
    for actions in (c.actions,):
        if R not in actions:
            assert simulate(graph, costs, order, actions).valid  # keep and swap are always realizable


@PROPERTY
@given(problems())
def test_recompute_never_changes_the_forward(problem):
    """Recomputed tensors are dropped after their last forward reader and re-produced only for backward
    readers: the forward runs exactly the ops of the order; the compute stream runs every op of the order
    once, in order, with recomputations of recomputable forward ops between backward ops only."""
    graph, costs, encoding, c = problem
    order = encoding.decode(c.keys)
    for actions in (c.actions, uniform(encoding, R)):
        r = simulate(graph, costs, order, actions)
        if not r.valid:
            continue
        assert [e.name for e in op_events(r, "run")] == [graph.ops[i].name for i in order]
        ops = {op.name: op for op in graph.ops}
        compute = [e for e in r.timeline if e.stream == "compute" and e.kind in ("run", "recompute")]
        forward = [k for k, e in enumerate(compute) if e.kind == "run" and ops[e.name].phase == "fwd"]
        assert all(e.kind == "run" for e in compute[:forward[-1]])
        assert all(ops[e.name].phase == "fwd" and ops[e.name].recomputable for e in op_events(r, "recompute"))


@PROPERTY
@given(problems())
def test_streams_are_queues_and_data_arrives_before_use(problem):
    """Each stream does one thing at a time; a copy back starts after the copy out ended; an op starts only
    once every input it reads has landed on the device."""
    graph, costs, encoding, c = problem
    r = simulate(graph, costs, encoding.decode(c.keys), c.actions)
    if not r.valid:
        return
    for stream in ("compute", "d2h", "h2d"):
        events = [e for e in r.timeline if e.stream == stream]
        assert all(e.start <= e.end for e in events)
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))
    out_end, landed = {}, {}
    inputs = {op.name: set(op.inputs) for op in graph.ops}
    for e in r.timeline:  # in the order things were issued
        if e.kind == "swap_out":
            out_end[e.name] = e.end
        elif e.kind == "swap_in":
            assert e.start >= out_end[e.name]
            landed[e.name] = e.end
        elif e.kind in ("run", "recompute"):
            assert all(e.start >= landed[t] for t in inputs[e.name] if t in landed)


@PROPERTY
@given(problems())
def test_simulation_is_deterministic(problem):
    """A run keeps no state between calls: the same policy gives the same result, traced or not."""
    graph, costs, encoding, c = problem
    order = encoding.decode(c.keys)
    sim = Simulator(graph, costs)
    first, again, traced = sim.run(order, c.actions), sim.run(order, c.actions), sim.run(order, c.actions, trace=True)
    assert first == again
    assert (traced.step_time, traced.peak_bytes, traced.compute_time, traced.valid) == \
           (first.step_time, first.peak_bytes, first.compute_time, first.valid)


@PROPERTY
@given(problems())
def test_a_budget_that_is_never_reached_changes_nothing(problem):
    """Prefetches wait only while they would push memory over the budget; when the unbudgeted run never
    goes over it, nothing ever waits, so the budgeted run is the same."""
    graph, costs, encoding, c = problem
    order = encoding.decode(c.keys)
    free = simulate(graph, costs, order, c.actions)
    if free.valid:
        bounded = simulate(graph, costs, order, c.actions, budget=free.peak_bytes)
        assert (bounded.step_time, bounded.peak_bytes, bounded.compute_time) == \
               (free.step_time, free.peak_bytes, free.compute_time)


@PROPERTY
@given(problems(), st.integers(0, 200))
def test_a_budget_only_moves_copies(problem, budget):
    """The budget only holds prefetches back; whether a tensor comes back by copy or by recomputation depends
    on its action and on whether it is on the host, never on time: the same ops run, recomputations
    included, and a policy is valid or not whatever the budget."""
    graph, costs, encoding, c = problem
    order = encoding.decode(c.keys)
    free = simulate(graph, costs, order, c.actions)
    bounded = simulate(graph, costs, order, c.actions, budget=budget)
    assert free.valid == bounded.valid
    if free.valid:
        assert bounded.compute_time == free.compute_time
        assert [(e.kind, e.name) for e in op_events(bounded, "recompute") + op_events(bounded, "run")] == \
               [(e.kind, e.name) for e in op_events(free, "recompute") + op_events(free, "run")]


@PROPERTY
@given(problems())
def test_the_program_is_runnable(problem):
    """The program a runtime replays never runs an op whose inputs it has dropped or not yet brought back,
    never copies back what is not on the host, and runs every op of the graph once, in the policy's order."""
    graph, costs, encoding, c = problem
    order = encoding.decode(c.keys)
    r = simulate(graph, costs, order, c.actions)
    if not r.valid:
        return
    ops = {op.name: op for op in graph.ops}
    present = {t.name for t in graph.tensors.values() if t.producer is None}
    retired, on_host, runs = Counter(), set(), []  # a tensor re-made while its first copy waits retires twice
    for verb, name in r.program:
        if verb in ("run", "recompute"):
            missing = set(ops[name].inputs) - present
            assert not missing, f"{verb} {name} reads {missing}, which the program dropped"
            present |= set(ops[name].outputs)
            runs += [name] if verb == "run" else []
        elif verb == "swap_out":
            assert name in present
            on_host.add(name)
        elif verb == "swap_in":
            assert name in on_host and name not in present
            present.add(name)
        elif verb == "retire":
            present.remove(name)
            retired[name] += 1
        elif retired[name]:  # free: a retired copy goes first (its tensor may be back on the device already)
            retired[name] -= 1
        else:
            present.remove(name)
    assert runs == [graph.ops[i].name for i in order]


# --- minimal examples of the simulator bugs the properties above found ---------------------------------------

def _two_output_graph(b_size=1):
    """f0: x -> (a, b); f1: (a, b) -> c; loss: c -> L; b1(L, c); b0(g1, b). Candidates b and c; a is read
    by the forward only, and re-produced by re-running f0 (which also re-produces b)."""
    tensors = {t.name: t for t in (Tensor("x", 1, "input"), Tensor("a", 1, "activation", "f0"),
                                   Tensor("b", b_size, "activation", "f0"), Tensor("c", 1, "activation", "f1"),
                                   Tensor("L", 1, "activation", "loss"), Tensor("g1", 1, "activation", "b1"),
                                   Tensor("g0", 1, "activation", "b0"))}
    ops = (Op("f0", "f", ("x",), ("a", "b")), Op("f1", "f", ("a", "b"), ("c",)), Op("loss", "l", ("c",), ("L",)),
           Op("b1", "b", ("L", "c"), ("g1",), "bwd"), Op("b0", "b", ("g1", "b"), ("g0",), "bwd"))
    return Graph(ops, tensors, loss="L")


def test_bug_1_zero_time_swap_in_after_zero_time_ops():
    """chain(1) with 0-byte tensors, no copy latency and 0-second ops: the just-in-time prefetch position
    bisect_right(prefix, prefix[c] - h2d_time) - 1 is n when h2d_time is 0 and no time passes after the
    reader at c, and prefetch[n] was out of range (fixed in 2956480: clamped to c)."""
    g = chain(1, size=0)
    r = Simulator(g, unit_costs(g, op_time=0.0)).run([0, 1], (S,), trace=True)
    assert r.valid and r.step_time == 0.0 and r.peak_bytes == 0
    assert [str(i) for i in r.program] == ["swap_out x", "run f1", "free x", "swap_in x", "run b1", "free x", "free g1"]


def test_bug_2_recomputed_duplicate_is_in_the_traces():
    """Recomputing c for b1 re-runs f1, which needs a: f0 runs again and re-produces b, still kept for b0.
    The duplicate b (4 bytes) is allocated with f0's outputs (peak 11) and dropped at once, but neither the
    drop in `memory` nor the pair in `changes` is recorded: by_category peaks at 8."""
    g = _two_output_graph(b_size=4)
    enc = Encoding(g)
    r = Simulator(g, unit_costs(g)).run(list(range(5)), (K, R), trace=True)
    assert enc.candidates == ["b", "c"] and r.peak_bytes == 11
    assert max(sum(level.values()) for _, level in r.by_category()) == r.peak_bytes


def test_bug_3_recompute_reads_a_tensor_before_its_swap_in_lands():
    """b swapped (d2h 1/64 s, h2d 4 s), c recomputed. b's prefetch for b0 is issued at t=2 and lands at t=6.
    Recomputing c for b1 re-runs f0 (for a), which re-produces b: the duplicate is dropped (the swap-in's
    copy stays) but ready[b] became f0's end (4), so f1 read b at 4, two seconds before it lands (fixed in
    2956480: the kept copy keeps its ready time)."""
    g = _two_output_graph()
    costs = Costs({op.name: 1.0 for op in g.ops}, 64.0, 0.25, "test", "test")
    r = Simulator(g, costs).run(list(range(5)), (S, R), trace=True)
    assert ("h2d", "swap_in", "b", 2.0, 6.0) in trace(r)
    f1_again = next(e for e in r.timeline if e.kind == "recompute" and e.name == "f1")
    assert f1_again.start >= 6.0


def test_bug_4_a_budget_never_reached_still_holds_a_prefetch_back():
    """a (2 bytes) and b (1 byte) swapped, 2 s per byte each way; loss takes 4 s, other ops 0 s. Unbounded, the
    peak is 4 (at t=4: b's device copy until its d2h lands at 6, b's swap-in, a's swap-in). Under a budget of 4
    a's prefetch at t=4 was held back, because 1 + 1 + 2 bytes plus bL's output (1) would be 5 now, though bL
    only starts at 8, after b's old copy is gone: the run changed (peak 3) although 4 was never exceeded.
    (Fixed: admission projects memory through the ops before the reader, with the waits already known.)"""
    tensors = {t.name: t for t in (Tensor("x", 0, "input"), Tensor("a", 2, "activation", "f0"),
                                   Tensor("b", 1, "activation", "f1"), Tensor("L", 0, "activation", "loss"),
                                   Tensor("gb", 1, "activation", "bL"), Tensor("ga", 0, "activation", "ba"))}
    ops = (Op("f0", "f", ("x",), ("a",)), Op("f1", "f", ("x",), ("b",)), Op("loss", "l", ("a", "b"), ("L",)),
           Op("bL", "b", ("L", "b"), ("gb",), "bwd"), Op("ba", "b", ("gb", "a"), ("ga",), "bwd"))
    g = Graph(ops, tensors, loss="L")
    costs = Costs({"f0": 0.0, "f1": 0.0, "loss": 4.0, "bL": 0.0, "ba": 0.0}, 0.5, 0.5, "test", "test")
    free = Simulator(g, costs).run(list(range(5)), (S, S))
    bounded = Simulator(g, costs, budget=free.peak_bytes).run(list(range(5)), (S, S))
    assert free.peak_bytes == 4
    assert bounded.peak_bytes == free.peak_bytes


def test_bug_5_a_prefetch_admitted_before_a_large_allocation():
    """a (2 bytes) swapped; 1 s per op, a's copy back takes 2 s, so its just-in-time prefetch is issued at b1,
    two ops before its reader b0. Admission used to look at b1's output only (1 + 2 + 1 = 4 bytes, under a
    budget of 6) and let the copy land before b2 allocates 4 bytes: peak 7, over the budget, and the AlexNet
    search found no policy at 0.75x while it found one at a smaller budget. Now the prefetch waits until b0
    needs it, and the run keeps to the budget (6: b0 reads g2 and a)."""
    tensors = {t.name: t for t in (Tensor("x", 0, "input"), Tensor("a", 2, "activation", "f0"),
                                   Tensor("h", 1, "activation", "f1"), Tensor("L", 0, "activation", "loss"),
                                   Tensor("g1", 1, "activation", "b1"), Tensor("g2", 4, "activation", "b2"),
                                   Tensor("ga", 0, "activation", "b0"))}
    ops = (Op("f0", "f", ("x",), ("a",)), Op("f1", "f", ("a",), ("h",)), Op("loss", "l", ("h",), ("L",)),
           Op("b1", "b", ("L", "h"), ("g1",), "bwd"), Op("b2", "b", ("g1",), ("g2",), "bwd"),
           Op("b0", "b", ("g2", "a"), ("ga",), "bwd"))
    g = Graph(ops, tensors, loss="L")
    costs = Costs({op.name: 1.0 for op in ops}, 2.0, 1.0, "test", "test")
    assert Encoding(g).candidates == ["a", "h"]
    free = Simulator(g, costs).run(list(range(6)), (S, K))
    bounded = Simulator(g, costs, budget=6).run(list(range(6)), (S, K), trace=True)
    assert free.peak_bytes == 7
    assert bounded.peak_bytes == 6
    assert ("h2d", "swap_in", "a", 5.0, 7.0) in trace(bounded)


def test_bug_6_a_nested_recompute_dropped_an_input_its_caller_still_reads():
    """f2 reads a and b; c is recomputed for b0, and a and b, read by the forward only, are gone by then.
    Recomputing c re-runs f0 (for a), then f1 (for b),
    and f1's recompute dropped a as read by no later position, though f2 was about to read it: f2 ran
    without a, memory under-counted, and the runtime refused the program (a is not on the device)."""
    tensors = {t.name: t for t in (Tensor("x", 1, "input"), Tensor("a", 1, "activation", "f0"),
                                   Tensor("b", 1, "activation", "f1"), Tensor("c", 1, "activation", "f2"),
                                   Tensor("L", 1, "activation", "loss"), Tensor("gc", 1, "activation", "bL"),
                                   Tensor("gx", 1, "activation", "b0"))}
    ops = (Op("f0", "f", ("x",), ("a",)), Op("f1", "f", ("a",), ("b",)), Op("f2", "f", ("a", "b"), ("c",)),
           Op("loss", "l", ("c",), ("L",)), Op("bL", "b", ("L",), ("gc",), "bwd"),
           Op("b0", "b", ("gc", "c"), ("gx",), "bwd"))
    g = Graph(ops, tensors, loss="L")
    enc = Encoding(g)
    assert enc.candidates == ["c"]
    r = Simulator(g, unit_costs(g)).run(list(range(6)), (R,), trace=True)
    present = {"x", "L"}
    for verb, name in r.program:  # replay the program: every op finds its inputs
        if verb in ("run", "recompute"):
            op = next(o for o in ops if o.name == name)
            assert set(op.inputs) <= present, f"{name} reads {set(op.inputs) - present}, which is gone"
            present |= set(op.outputs)
        elif verb == "free":
            present.discard(name)
    assert r.peak_bytes == 6  # x, L, gc, a, b and c while f2 re-makes c (a was not counted)
