"""Address planning: offsets that never overlap while alive, an arena at its lower bound where one exists."""
import pytest
import torch

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.graph import chain
from gaswap.plan.memory.allocator import replay
from gaswap.plan.memory.arena import _best_gap, plan
from gaswap.run.arena_runtime import arena_buffer, carve
from gaswap.plan.simulator import Simulator

MiB = 1 << 20


def test_best_gap_takes_the_tightest_hole_else_the_top():
    busy = [(0, 100), (150, 200), (260, 300)]  # holes of 50 and 60 bytes
    assert _best_gap(busy, 50) == 100
    assert _best_gap(busy, 55) == 200
    assert _best_gap(busy, 70) == 300
    assert _best_gap([], 10) == 0


@pytest.mark.parametrize("action", [Action.KEEP, Action.SWAP, Action.RECOMPUTE])
def test_plan_is_valid_and_reserves_no_more_than_the_allocator(action):
    graph = chain(8, 3 * MiB + 100)
    sim = Simulator(graph, Costs({op.name: 1e-3 for op in graph.ops}, 1e9, 1e9, "t", "t"))
    encoding = Encoding(graph)
    c = encoding.uniform(action)
    result = sim.run(encoding.decode(c.keys), c.actions, trace=True)
    arena = plan(graph, result)
    arena.check()
    aligned = 3 * MiB + 512
    assert arena.lower_bound == result.peak_bytes // (3 * MiB + 100) * aligned  # most tensors alive at once
    assert arena.lower_bound <= arena.size <= replay(graph, result).reserved
    if action == Action.KEEP:  # a chain kept whole stacks up and unwinds: the greedy plan is optimal
        assert arena.size == arena.lower_bound


def test_check_catches_an_overlap():
    graph = chain(3, 1000)
    sim = Simulator(graph, Costs({op.name: 1.0 for op in graph.ops}, 1e9, 1e9, "t", "t"))
    result = sim.run(list(range(len(graph.ops))), [Action.KEEP] * 3, trace=True)
    arena = plan(graph, result)
    broken = type(arena)(arena.size, arena.lower_bound, tuple(p.__class__(**(p.__dict__ | {"offset": 0}))
                                                            for p in arena.placements))
    with pytest.raises(ValueError, match="overlap"):
        broken.check()


def test_carved_tensors_share_one_buffer_without_overlap():
    buffer = arena_buffer(type("Plan", (), {"size": 4096})(), "cpu")
    a = carve(buffer, 0, (4, 8), torch.float32)
    b = carve(buffer, 512, (2, 3), torch.float64, stride=(1, 2))  # a non-contiguous layout
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.sum().item() == 32 and b.sum().item() == 12
    assert b.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    with pytest.raises(ValueError):
        carve(buffer, 100, (4,), torch.float32)  # misaligned
    with pytest.raises(ValueError):
        carve(buffer, 3584, (1024,), torch.float32)  # past the end
