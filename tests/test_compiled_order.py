"""gaswap.compiled.order: the partitioned graphs re-ordered before inductor lowers them, and inductor's buffer
reuse turned off, change where buffers live, not what the step computes."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch._functorch import config as functorch_config
from torch.fx.experimental.proxy_tensor import make_fx

from gaswap import zoo
from gaswap.compiled import dry_compile, order, partition
from gaswap.compiled.programs import Recorder, step_peak

BIG = 256 * 1024  # elements of the branches' values in `_branches`


def _branches(primals_x):  # a resident input: freeing it after its last reader frees nothing
    a, b = primals_x.exp(), primals_x.sin()  # two big values, each reduced to a number: the graph's order holds both
    return (a.view(-1).sum() + b.t().sum(),)


def _traced(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def _names(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def _live_peak(gm) -> int:
    """Bytes alive at once by the graph's order: each value from its node to its last reader (a view its
    base's), inputs not counted."""
    memory = order._Memory(list(gm.graph.nodes))
    last = {}
    for k, node in enumerate(gm.graph.nodes):
        for key in memory.read[node]:
            last[key] = k
    alive, peak = {}, 0
    for k, node in enumerate(gm.graph.nodes):
        alive |= {key: memory.size[key] for key in memory.made[node]}
        peak = max(peak, sum(alive.values()))
        alive = {key: size for key, size in alive.items() if last.get(key, k) > k}
    return peak


@pytest.mark.parametrize("name", list(order.ORDERS))
def test_each_order_keeps_every_node_in_an_order_that_runs(name):
    gm = _traced(_branches, torch.randn(512, 512))
    before = _names(gm)
    order.reorder(gm.graph, name)
    assert sorted(_names(gm)) == sorted(before)
    seen = set()
    for node in gm.graph.nodes:
        assert all(arg.name in seen for arg in node.all_input_nodes)
        seen.add(node.name)
    gm.recompile()
    x = torch.randn(512, 512)
    torch.testing.assert_close(gm(x), _branches(x))


@pytest.mark.parametrize("name", ["greedy", "demand_first"])
def test_greedy_and_demand_first_finish_a_branch_before_the_next_starts(name):
    gm = _traced(_branches, torch.randn(512, 512))
    assert _live_peak(gm) // (BIG * 4) == 2  # and a number or two
    order.reorder(gm.graph, name)
    assert _live_peak(gm) // (BIG * 4) == 1


def test_a_node_with_side_effects_stays_between_the_nodes_before_and_after_it():
    def fn(x, counter):
        a = x.exp()
        counter.add_(1)
        return (a.sum() + x.sin().sum(),)

    gm = _traced(fn, torch.randn(8, 8), torch.zeros(()))
    mutation = next(n.name for n in gm.graph.nodes if n.op == "call_function" and n.is_impure())
    names = _names(gm)
    before, after = set(names[:names.index(mutation)]), set(names[names.index(mutation) + 1:])
    order.reorder(gm.graph, "demand_last")
    moved = _names(gm)
    assert set(moved[:moved.index(mutation)]) == before and set(moved[moved.index(mutation) + 1:]) == after


def test_options():
    assert order.options() == {}
    assert order.options(buffer_reuse=False) == {"allow_buffer_reuse": False}
    chosen = order.options("rpo")["post_grad_custom_post_pass"]
    assert isinstance(chosen, order.OrderPass) and chosen.name == "rpo"
    assert chosen.uuid() != order.OrderPass("greedy").uuid()
    with pytest.raises(ValueError, match="unknown order 'lifo'"):
        order.options("lifo")


@pytest.mark.slow
def test_a_policy_compiled_in_another_order_without_buffer_reuse_trains_the_same(monkeypatch):
    torch.manual_seed(0)
    model, x, y = zoo.tiny_cnn(num_classes=10, width=8), torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    graph = partition.capture(model, x)
    ops = {op.name: op for op in graph.ops}
    policy = partition.make_policy(graph, {t: "recompute" for t in graph.candidates()
                                           if ops[graph.tensors[t].producer].recomputable})
    calls = []
    monkeypatch.setattr(order, "reorder", lambda graph, name: calls.append(name))
    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        # a graph found in inductor's caches (an earlier run's) skips the post-grad passes
        dry_compile.programs_of(copy.deepcopy(model), partition.backend(policy, **order.options("demand_last")), x)
    assert calls == ["demand_last", "demand_last"]  # the forward and the backward
    monkeypatch.undo()

    grads, peaks = [], []
    for options in ({}, order.options("demand_last", buffer_reuse=False)):
        m = copy.deepcopy(model)
        dry = dry_compile.programs_of(copy.deepcopy(model), partition.backend(policy, **options), x)
        torch.manual_seed(1)  # the CNN's dropout
        with Recorder() as recorder:
            F.cross_entropy(partition.compile(m, policy, **options)(x), y).backward()
        peaks.append(step_peak(recorder.programs, 16 * 10 * 4, "cross_entropy"))
        assert peaks[-1] == step_peak(dry, 16 * 10 * 4, "cross_entropy")
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_policy_asks_for_inductor_settings_in_its_provenance_and_bad_ones_are_refused():
    from gaswap.plan.policy import Policy, PolicyError

    def policy(inductor):
        return Policy("f", (), {}, provenance={"form": "compiled", "inductor": inductor})

    asked = partition.inductor_settings(policy({"order": "demand_first", "buffer_reuse": False}))
    assert isinstance(asked["post_grad_custom_post_pass"], order.OrderPass)
    assert asked["post_grad_custom_post_pass"].name == "demand_first" and asked["allow_buffer_reuse"] is False
    assert partition.inductor_settings(Policy("f", (), {}, provenance={"form": "compiled"})) == {}
    assert partition.inductor_settings(policy({"realize_reads": 1})) == {"realize_reads_threshold": 1}
    for bad, said in (({"order": "backwards"}, "provenance.inductor.order: 'backwards' is not one of greedy"),
                      ({"buffer_reuse": "no"}, "provenance.inductor.buffer_reuse: 'no' is not true or false"),
                      ({"realize_reads": 0}, "provenance.inductor.realize_reads: 0 is not a whole number of at least 1"),
                      ({"realize_reads": True}, "provenance.inductor.realize_reads: True is not a whole number"),
                      ({"fuse": 1}, "provenance.inductor: {'fuse': 1} is not a mapping"),
                      ("demand_first", "provenance.inductor: 'demand_first' is not a mapping")):
        with pytest.raises(PolicyError, match=re.escape(said)):
            partition.inductor_settings(policy(bad))
