"""The caching-allocator model on hand-worked sequences, and the replay of simulated steps through it."""
import pytest

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.graph import chain
from gaswap.plan.memory.allocator import (
    CachingAllocator,
    OutOfMemory,
    ReservedProblem,
    allocation_size,
    predict,
    replay,
    replay_recorded,
    round_size,
)
from gaswap.plan.simulator import Simulator

KiB, MiB = 1 << 10, 1 << 20


def test_rounding_and_segment_sizes_follow_the_source():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    assert allocation_size(round_size(1)) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(MiB) == 2 * MiB  # kSmallSize itself is small
    assert allocation_size(MiB + 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB  # from kMinLargeAlloc on: rounded to 2 MiB
    assert allocation_size(11 * MiB + 512) == 12 * MiB


def test_small_requests_pack_into_2mib_segments():
    a = CachingAllocator()
    for _ in range(3):
        a.malloc(600 * KiB)  # 3 x 600 KiB = 1800 KiB fit one 2 MiB segment
    assert (a.reserved, a.allocated) == (2 * MiB, 1800 * KiB)
    a.malloc(600 * KiB)  # 248 KiB left: a second segment
    assert (a.reserved, a.segment_allocs) == (4 * MiB, 2)


def test_large_blocks_split_only_when_more_than_1mib_remains():
    a = CachingAllocator()
    x = a.malloc(3 * MiB)  # a 20 MiB segment, split: 3 MiB used, 17 MiB cached
    a.malloc(3 * MiB)  # served from the cached rest
    assert (a.reserved, a.allocated) == (20 * MiB, 6 * MiB)
    a.free(x)
    a.malloc(2 * MiB + 512 * KiB)  # best fit is x's 3 MiB block; 0.5 MiB left is not split off
    assert (a.reserved, a.allocated, a.requested) == (20 * MiB, 6 * MiB, 5 * MiB + 512 * KiB)
    b = CachingAllocator()
    b.malloc(11 * MiB)  # a 12 MiB segment whose 1 MiB rest is not split: the block counts 12 MiB
    assert (b.reserved, b.allocated) == (12 * MiB, 12 * MiB)


def test_freed_neighbours_merge_and_best_fit_takes_the_smallest_block():
    a = CachingAllocator()
    x, y, z = (a.malloc(512 * KiB) for _ in range(3))
    a.free(x)
    a.free(y)  # merges with x: one 1 MiB block at offset 0
    w = a.malloc(MiB)
    assert a.offset_of(w) == a.offset_of(z)[:1] + (0,)
    v = a.malloc(256 * KiB)  # the 512 KiB tail of the segment is the best (only) fit
    assert a.offset_of(v)[1] == 1536 * KiB and a.reserved == 2 * MiB


def test_fragmentation_reserves_more_than_is_allocated_unless_segments_expand():
    plain, expandable = CachingAllocator(), CachingAllocator(expandable_segments=True)
    for a in (plain, expandable):
        a.free(a.malloc(12 * MiB))
        a.malloc(14 * MiB)
    assert (plain.reserved, plain.peak_allocated) == (26 * MiB, 14 * MiB)  # the cached 12 MiB can't serve 14
    assert expandable.reserved == 20 * MiB  # one 20 MiB page; the freed 12 MiB merged with the rest


def test_expandable_segments_grow_by_pages_at_their_end():
    a = CachingAllocator(expandable_segments=True)
    a.malloc(12 * MiB)  # maps one 20 MiB page: 8 MiB free at the end
    a.malloc(12 * MiB)  # 8 MiB free + one more page
    assert (a.reserved, a.segment_allocs) == (40 * MiB, 2)
    a.malloc(16 * MiB)  # 16 MiB free at the end: served without mapping more
    assert a.reserved == 40 * MiB


def test_a_block_is_reused_only_by_its_own_stream():
    a = CachingAllocator()
    a.free(a.malloc(4 * MiB, "compute"))
    a.malloc(4 * MiB, "h2d")  # the compute stream's cached 20 MiB segment cannot serve it
    assert a.reserved == 40 * MiB
    a.malloc(4 * MiB, "compute")
    assert a.reserved == 40 * MiB


def test_a_block_in_use_by_another_stream_waits_for_that_work():
    a = CachingAllocator()
    x = a.malloc(12 * MiB)
    a.free(x, reusable_at=5.0)  # record_stream: a copy stream uses it until t = 5
    a.malloc(12 * MiB, now=1.0)
    assert a.reserved == 24 * MiB  # not reusable yet: a second segment
    a.malloc(12 * MiB, now=6.0)
    assert a.reserved == 24 * MiB  # the first one is back


def test_at_capacity_cached_segments_are_released_then_out_of_memory():
    a = CachingAllocator(capacity=24 * MiB)
    a.free(a.malloc(12 * MiB))
    a.malloc(14 * MiB)  # 12 + 14 > 24: the cached 12 MiB segment is given back first
    assert (a.reserved, a.peak_reserved) == (14 * MiB, 14 * MiB)
    with pytest.raises(OutOfMemory):
        a.malloc(12 * MiB)


# --------------------------------------------------------------------------- replaying simulated steps


def _setup(size=3 * MiB, n=6):
    graph = chain(n, size)
    costs = Costs({op.name: 1e-3 for op in graph.ops}, 1e9, 1e9, "test", "test")
    encoding = Encoding(graph)
    return graph, Simulator(graph, costs), encoding


@pytest.mark.parametrize("action", [Action.KEEP, Action.SWAP, Action.RECOMPUTE])
def test_replay_asks_for_exactly_what_the_simulator_counts(action):
    graph, sim, encoding = _setup(size=1000)  # odd sizes: rounding shows in `allocated`, not in `requested`
    c = encoding.uniform(action)
    result = sim.run(encoding.decode(c.keys), c.actions, trace=True)
    peaks = replay(graph, result, steps=1)
    assert peaks.requested == result.peak_bytes == peaks.simulated
    assert peaks.allocated == result.peak_bytes // 1000 * 1024  # every 1000 B tensor is a 1024 B block
    assert peaks.reserved == 2 * MiB  # all of it fits one small-pool segment


def test_replay_keep_all_of_3mib_tensors_hand_worked():
    graph, sim, encoding = _setup()
    c = encoding.uniform(Action.KEEP)
    result = sim.run(encoding.decode(c.keys), c.actions, trace=True)
    peaks = replay(graph, result)
    # x and a1..a6 stay for the backward; the first backward op adds g6: 8 x 3 MiB = 24 MiB at the peak.
    assert result.peak_bytes == peaks.requested == peaks.allocated == 24 * MiB
    # 3 MiB requests take 20 MiB segments, 6 blocks each (the 2 MiB rest is cached, too small): 2 segments.
    assert peaks.reserved == 40 * MiB
    assert replay(graph, result, expandable_segments=True).reserved == 40 * MiB  # two 20 MiB pages too


def test_swap_in_on_the_copy_stream_reserves_more():
    graph, sim, encoding = _setup(size=12 * MiB)
    c = encoding.uniform(Action.SWAP)
    result = sim.run(encoding.decode(c.keys), c.actions, trace=True)
    on_compute = replay(graph, result, swap_in_stream="compute")
    on_h2d = replay(graph, result, swap_in_stream="h2d")
    assert on_compute.requested == on_h2d.requested == result.peak_bytes
    assert on_h2d.reserved > on_compute.reserved
    late = replay(graph, result, swap_out_free="record_stream")  # frees at retire, reusable after the d2h
    assert late.requested <= result.peak_bytes and late.reserved >= on_compute.reserved


def test_adam_temporaries_are_modelled_after_the_step():
    from gaswap.plan.graph import Graph, Op, Tensor

    tensors = {"w": Tensor("w", 4 * MiB, "param"), "x": Tensor("x", MiB, "input"),
               "y": Tensor("y", MiB, "activation", "f"), "gw": Tensor("gw", 4 * MiB, "grad", "b")}
    ops = (Op("f", "f", ("x", "w"), ("y",)), Op("b", "b", ("y", "x"), ("gw",), "bwd"))
    graph = Graph(ops, tensors, resident={"optimizer_state": 8 * MiB}, loss="y")
    sim = Simulator(graph, Costs({"f": 1.0, "b": 1.0}, 1e9, 1e9, "t", "t"))
    result = sim.run([0, 1], [], trace=True)
    peaks = replay(graph, result, optimizer="adam", steps=1)
    # w + state (2 x w) + x + the loss y + gw + one sqrt temporary per parameter: 4 + 8 + 1 + 1 + 4 + 4 MiB
    assert peaks.optimizer_step == 22 * MiB
    assert replay(graph, result, optimizer="sgd", steps=1).optimizer_step == 18 * MiB


def test_a_search_can_target_reserved_memory():
    import pickle

    from gaswap.base.config import GASettings, load_search_space
    from gaswap.plan.search import search

    graph, sim, encoding = _setup()
    keep = encoding.uniform(Action.KEEP)
    reserved_keep = predict(sim, encoding.decode(keep.keys), keep.actions, steps=1).reserved
    problem = ReservedProblem(graph, sim.costs, reserved_keep - 1, load_search_space("hybrid"))  # keep-all: over
    assert problem.evaluate(keep).peak_bytes == reserved_keep
    assert pickle.loads(pickle.dumps(problem)).options == problem.options  # what worker processes get
    result = search(problem, GASettings(population=8, generations=3), seed=0)
    assert result.best is not None
    for e in result.front:  # every policy on the front fits the budget in reserved bytes
        order = problem.order(e.chromosome)
        assert e.peak_bytes == predict(sim, order, e.chromosome.actions, steps=1).reserved < reserved_keep


def test_a_recorded_trace_replays_to_the_gpus_own_segments():
    # A trace as torch.cuda.memory._snapshot() records it (hand-made here): the GPU reserved 12 MiB, then a
    # second segment of 14 MiB for a request its cached 12 MiB block could not serve; 3 small requests
    # shared one 2 MiB segment.
    trace = [{"action": "alloc", "addr": 0x1000, "size": 12 * MiB, "stream": 0},
             {"action": "segment_alloc", "addr": 0x1000, "size": 12 * MiB, "stream": 0},
             {"action": "free_requested", "addr": 0x1000, "size": 12 * MiB, "stream": 0},
             {"action": "free_completed", "addr": 0x1000, "size": 12 * MiB, "stream": 0},
             {"action": "segment_alloc", "addr": 0x9000, "size": 14 * MiB, "stream": 0},
             {"action": "alloc", "addr": 0x9000, "size": 14 * MiB, "stream": 0}]
    trace += [{"action": "alloc", "addr": 0x20000 + k, "size": 600 * KiB, "stream": 0} for k in range(3)]
    trace.insert(6, {"action": "segment_alloc", "addr": 0x20000, "size": 2 * MiB, "stream": 0})
    replayed = replay_recorded(trace)
    assert replayed["gpu"] == {"reserved": 28 * MiB, "segments": 3}
    assert replayed["model"] == {"allocated": 14 * MiB + 1800 * KiB, "reserved": 28 * MiB, "segments": 3}


def test_a_policy_files_program_replays_without_a_timeline():
    from types import SimpleNamespace

    graph, sim, encoding = _setup(size=12 * MiB)
    c = encoding.uniform(Action.SWAP)
    result = sim.run(encoding.decode(c.keys), c.actions, trace=True)
    bare = SimpleNamespace(program=tuple((str(v), n) for v, n in result.program), predicted={"peak_bytes": 1})
    for options in ({}, {"swap_in_stream": "h2d"}):  # frees at `free`: time plays no part, same peaks
        timed, untimed = replay(graph, result, **options), replay(graph, bare, **options)
        assert (untimed.requested, untimed.reserved) == (timed.requested, timed.reserved) and untimed.simulated == 1
    # record_stream: a retired block comes back at its `free` (untimed) or when the d2h queue drains (timed)
    untimed = replay(graph, bare, swap_out_free="record_stream")
    assert untimed.reserved >= replay(graph, bare).reserved


def test_lazy_optimizer_state_is_made_at_the_first_optimizer_step_hand_worked():
    """Adam over w (4 MiB): torch.optim makes exp_avg and exp_avg_sq at the first `step()`, in the holes the
    first step's activations left, which the second step's activation then cannot use.

    Resident (state first): w, exp_avg, exp_avg_sq take A[0,12) of a 20 MiB segment A; x and l share a 2 MiB
    small segment S; y (10 MiB) fits in no cached block: its own 10 MiB segment B; gw A[12,16), the sqrt
    temporary A[16,20). Step 2 reuses all of it: 20 + 10 + 2 = 32 MiB in 3 segments.
    Lazy: w A[0,4); step 1: y A[4,14), gw A[14,18); y freed; exp_avg A[4,8), exp_avg_sq A[8,12) (best fit in
    the 10 MiB hole); the 4 MiB temporary fits nowhere (two 2 MiB holes): segment C of 20 MiB. Step 2: y C[0,10),
    gw A[12,16), temporary A[16,20): 20 + 20 + 2 = 42 MiB in 3 segments. Allocated peaks are equal."""
    from gaswap.plan.graph import Graph, Op, Tensor

    tensors = {"w": Tensor("w", 4 * MiB, "param"), "x": Tensor("x", MiB, "input"),
               "y": Tensor("y", 10 * MiB, "activation", "f"), "l": Tensor("l", 512, "activation", "h"),
               "gw": Tensor("gw", 4 * MiB, "grad", "b")}
    ops = (Op("f", "f", ("x", "w"), ("y",)), Op("h", "h", ("y",), ("l",)), Op("b", "b", ("y", "x"), ("gw",), "bwd"))
    graph = Graph(ops, tensors, resident={"optimizer_state": 8 * MiB}, loss="l")
    result = Simulator(graph, Costs({"f": 1.0, "h": 1.0, "b": 1.0}, 1e9, 1e9, "t", "t")).run([0, 1, 2], [], trace=True)
    assert [str(verb) for verb, _ in result.program] == ["run", "run", "run", "free"]
    lazy = replay(graph, result, optimizer="adam")
    resident = replay(graph, result, optimizer="adam", optimizer_state="resident")
    assert (resident.reserved, resident.segments) == (32 * MiB, 3)
    assert (lazy.reserved, lazy.segments) == (42 * MiB, 3)
    assert lazy.allocated == resident.allocated == 27 * MiB + 512  # w, state, x, y, l, gw, the temporary
    # one step, lazy: the forward and backward ran without the state; the optimizer step holds it and the grads
    first = replay(graph, result, optimizer="adam", steps=1)
    assert first.optimizer_step == (4 + 8 + 1 + 4 + 4) * MiB + 512  # w, state, x, gw, temporary; l (y is gone)
    with pytest.raises(ValueError, match="optimizer_state"):
        replay(graph, result, optimizer_state="eager")


def test_a_one_step_reserved_search_holds_the_optimizer_state_two_steps_make_it():
    graph, sim, _ = _setup()
    assert ReservedProblem(graph, sim.costs).options == {"steps": 1, "optimizer_state": "resident"}
    assert ReservedProblem(graph, sim.costs, steps=2).options == {"steps": 2, "optimizer_state": "lazy"}


def test_a_workspace_and_an_ops_transient_are_held_beside_the_graphs_tensors_hand_worked():
    """cuBLAS's workspace (32 MiB, kept) takes a segment of its own; an op's 6 MiB transient (a cuDNN workspace)
    is allocated after the op's outputs and freed at once. Graph: w 4 MiB (param), x 1 MiB (input), y 10 MiB
    (f), l 512 B (h), gw 4 MiB (b); SGD, no state. Without either: w A[0,4) of a 20 MiB segment A; x, l in a
    2 MiB small segment; y A[4,14); gw A[14,18): 22 MiB reserved, allocated peak 19 MiB + 512 B (w x y l gw).
    With them: the workspace's own 32 MiB segment; f's transient A[14,20) (6 MiB fits the 6 MiB hole exactly)
    while y is alive: allocated peak 4+1+10+6+32 = 53 MiB at f, then 19 MiB + 512 B + 32 MiB at b; 54 MiB
    reserved, 3 segments."""
    from gaswap.plan.graph import Graph, Op, Tensor

    tensors = {"w": Tensor("w", 4 * MiB, "param"), "x": Tensor("x", MiB, "input"),
               "y": Tensor("y", 10 * MiB, "activation", "f"), "l": Tensor("l", 512, "activation", "h"),
               "gw": Tensor("gw", 4 * MiB, "grad", "b")}
    ops = (Op("f", "f", ("x", "w"), ("y",)), Op("h", "h", ("y",), ("l",)), Op("b", "b", ("y", "x"), ("gw",), "bwd"))
    graph = Graph(ops, tensors, loss="l")
    result = Simulator(graph, Costs({"f": 1.0, "h": 1.0, "b": 1.0}, 1e9, 1e9, "t", "t")).run([0, 1, 2], [], trace=True)
    plain = replay(graph, result, steps=1)
    assert (plain.reserved, plain.allocated, plain.segments) == (22 * MiB, 19 * MiB + 512, 2)
    held = replay(graph, result, steps=1, workspace=32 * MiB, transients={"f": 6 * MiB})
    assert (held.reserved, held.allocated, held.segments) == (54 * MiB, 53 * MiB, 3)
    assert held.requested == (4 + 1 + 10 + 6 + 32) * MiB  # at f: w, x, y, the transient, the workspace
    assert replay(graph, result, steps=2, workspace=32 * MiB, transients={"f": 6 * MiB}).reserved == 54 * MiB
