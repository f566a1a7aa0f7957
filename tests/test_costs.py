"""Cost model: roofline estimates, hardware profiles, measuring on the CPU and the on-disk cache."""
import dataclasses
import json
import re
import time

import pytest
import torch

from gaswap.plan.costs import CostCache, Costs, HardwareProfile, estimate, load_profile, profile_names
from gaswap.plan.graph import Graph, Op, Tensor
from gaswap.run import measure as measuring
from gaswap.run.measure import cost_cache, device_name, measure, measure_link

SHIPPED = {"v100-pcie-16gb", "a100-pcie-40gb", "h100-sxm-80gb"}


def T(*shape, dtype="float32"):
    return {"shape": list(shape), "dtype": dtype}


def sig(target, *args, **kwargs):
    return json.dumps({"target": target, "args": list(args), "kwargs": kwargs})


def nbytes(*shape, itemsize=4):
    return itemsize * torch.Size(shape).numel()


def small_graph() -> Graph:
    """x -> mm -> relu -> mm (same signature as the first) -> conv, plus one op that cannot run."""
    n = 32
    mm = sig("aten.mm.default", T(n, n), T(n, n))
    conv = sig("aten.convolution.default", T(1, 2, 8, 8), T(4, 2, 3, 3), None,
               [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    tensors = {
        "x": Tensor("x", nbytes(n, n), "input"),
        "w": Tensor("w", nbytes(n, n), "param"),
        "cw": Tensor("cw", nbytes(4, 2, 3, 3), "param"),
        "a": Tensor("a", nbytes(n, n), "activation", "mm1"),
        "b": Tensor("b", nbytes(n, n), "activation", "relu"),
        "c": Tensor("c", nbytes(n, n), "activation", "mm2"),
        "d": Tensor("d", nbytes(1, 4, 8, 8), "activation", "conv"),
        "e": Tensor("e", nbytes(1, 4, 8, 8), "activation", "bogus"),
    }
    ops = (
        Op("mm1", "aten.mm.default", ("x", "w"), ("a",), flops=2 * n**3, signature=mm),
        Op("relu", "aten.relu.default", ("a",), ("b",), signature=sig("aten.relu.default", T(n, n))),
        Op("mm2", "aten.mm.default", ("b", "w"), ("c",), flops=2 * n**3, signature=mm),
        Op("conv", "aten.convolution.default", ("c", "cw"), ("d",), flops=2 * 4 * 64 * 18, signature=conv),
        Op("bogus", "aten.no_such_op.default", ("d",), ("e",),
           signature=sig("aten.no_such_op.default", T(1, 4, 8, 8))),
    )
    return Graph(ops, tensors)


# --------------------------------------------------------------------------- estimate and profiles


PROFILE = HardwareProfile(
    name="toy",
    peak_flops={"float32": 1e12, "float16": 4e12},
    memory_bandwidth=1e11,
    d2h_bandwidth=1e10,
    h2d_bandwidth=2e10,
    memory_bytes=1 << 30,
    launch_overhead=5e-6,
    efficiency=0.5,
    copy_latency=1e-5,
)


def test_estimate_roofline_by_hand():
    n = 1024
    tensors = {
        "x": Tensor("x", nbytes(n, n, itemsize=2), "input"),
        "w": Tensor("w", nbytes(n, n, itemsize=2), "param"),
        "y": Tensor("y", nbytes(n, n, itemsize=2), "activation", "mm"),
        "z": Tensor("z", nbytes(n, n, itemsize=2), "activation", "relu"),
    }
    half = dict(dtype="float16")
    ops = (
        Op("mm", "aten.mm.default", ("x", "w"), ("y",), flops=2 * n**3,
           signature=sig("aten.mm.default", T(n, n, **half), T(n, n, **half))),
        Op("relu", "aten.relu.default", ("y",), ("z",), signature=sig("aten.relu.default", T(n, n, **half))),
    )
    costs = estimate(Graph(ops, tensors), PROFILE)
    # mm: 2^31 FLOPs at 0.5 * 4e12 (fp16 peak) = 1.0737e-3 s, vs 3 * 2 MiB at 0.5 * 1e11 B/s = 1.26e-4 s.
    assert costs.op_time["mm"] == pytest.approx(2 * n**3 / 2e12 + 5e-6)
    # relu: no FLOPs counted; 2 * 2 MiB at 0.5 * 1e11 B/s.
    assert costs.op_time["relu"] == pytest.approx(2 * 2 * n * n / 5e10 + 5e-6)
    assert costs.source == "estimated:toy" and costs.device == "toy"
    assert costs.copy_time(10**6, "d2h") == pytest.approx(1e-5 + 1e-4)
    assert costs.copy_time(10**6, "h2d") == pytest.approx(1e-5 + 5e-5)
    with pytest.raises(ValueError):
        costs.copy_time(1, "sideways")


def test_unknown_dtype_uses_float32_peak():
    tensors = {"x": Tensor("x", 0, "input"), "y": Tensor("y", 0, "activation", "mm")}
    op = Op("mm", "aten.mm.default", ("x",), ("y",), flops=1e9,
            signature=sig("aten.mm.default", T(1, dtype="int64")))
    assert estimate(Graph((op,), tensors), PROFILE).op_time["mm"] == pytest.approx(1e9 / 5e11 + 5e-6)


def test_shipped_profiles_load():
    assert SHIPPED <= set(profile_names())
    for name in profile_names():
        p = load_profile(name)
        assert p.name == name
        assert {"float32", "float16", "bfloat16"} <= p.peak_flops.keys()
        assert all(v > 0 for v in p.peak_flops.values())
        assert p.memory_bandwidth > 0 and p.d2h_bandwidth > 0 and p.h2d_bandwidth > 0 and p.memory_bytes > 0
        assert 0 < p.efficiency <= 1 and 0 < p.launch_overhead < 1e-4
        assert estimate(small_graph(), p).op_time["mm1"] > 0


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match="h100-sxm-80gb"):
        load_profile("tpu-v9")


# --------------------------------------------------------------------------- measuring on the CPU


class Progress:
    def __init__(self):
        self.calls = []

    def __call__(self, done, total):
        self.calls.append((done, total))


def test_measure_cpu_and_cache(tmp_path, caplog):
    graph = small_graph()
    progress = Progress()
    first = measure(graph, "cpu", tmp_path, progress=progress, warmup=1, repeats=2)
    assert first.source == "measured" and first.device == device_name("cpu")
    assert set(first.op_time) == {op.name for op in graph.ops}
    assert all(t > 0 for t in first.op_time.values())
    assert first.measured == 4  # mm1 and mm2 share a signature
    assert progress.calls[-1] == (4, 4)
    assert first.op_time["mm1"] == first.op_time["mm2"]
    assert first.estimated == ("bogus",) and "roofline" in caplog.text
    assert first.d2h_bandwidth > 0 and first.h2d_bandwidth > 0 and first.copy_latency > 0

    second = measure(graph, "cpu", tmp_path)
    assert second.measured == 0
    assert second == Costs(**{**first.__dict__, "measured": 0})


def test_cpu_device_name_tells_generations_and_isa_apart(monkeypatch):
    # A virtual machine's CPU is often named only "AMD EPYC": costs measured on one generation must not be
    # read as another's, so the name carries the family, the model and the ISA ATen dispatches on.
    name = device_name("cpu")
    assert torch.backends.cpu.get_cpu_capability() in name
    assert name.endswith(f"({torch.get_num_threads()} thread{'' if torch.get_num_threads() == 1 else 's'})")
    if "cpu family" in open("/proc/cpuinfo").read():
        assert ", family " in name and " model " in name
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert device_name("cpu") != name or "AVX2" in name


def test_in_place_op_times_are_less_the_clocks_own_cost_per_reading():
    """Each instruction's reading includes one clock call: `_op_times` takes it off each (never below zero),
    an op charged with the frees after it."""
    from types import SimpleNamespace

    from gaswap.base.program import Verb
    from gaswap.plan.graph import Op, Tensor
    from gaswap.run.measure import _op_times, clock_overhead

    graph = Graph((Op("a", "a", (), ("x",)), Op("b", "b", (), ("y",))),
                  {"x": Tensor("x", 1, producer="a"), "y": Tensor("y", 1, producer="b")}, loss="y")
    runner = SimpleNamespace(graph=graph, program=[(Verb.RUN, "a"), (Verb.FREE, "x"), (Verb.RUN, "b")],
                             _times=[[3e-6, 4e-6, 3e-6], [1e-6, 1e-6, 1e-6], [0.2e-6, 0.2e-6, 0.2e-6]])
    times = _op_times(runner, overhead=0.5e-6)
    assert times["a"] == pytest.approx(3e-6) and times["b"] == 0.0  # (3 - 0.5) + (1 - 0.5); 0.2 - 0.5 -> 0
    assert _op_times(runner) == {"a": pytest.approx(4e-6), "b": pytest.approx(0.2e-6)}
    assert 0 < clock_overhead(torch.device("cpu"), samples=101) < 1e-4


def test_corrupted_cache_is_moved_aside(tmp_path):
    graph = small_graph()
    measure(graph, "cpu", tmp_path, warmup=0, repeats=1)
    path = cost_cache("cpu", tmp_path).path
    path.write_text(path.read_text()[:50])  # truncated
    with pytest.warns(UserWarning, match=re.escape(str(path))):
        again = measure(graph, "cpu", tmp_path, warmup=0, repeats=1)
    assert again.measured == 4
    assert path.with_name(path.name + ".bad").exists()
    assert measure(graph, "cpu", tmp_path).measured == 0


def test_cache_of_another_device_or_torch_is_not_used(tmp_path):
    graph = small_graph()
    for device, version in [("cpu: other", torch.__version__), (device_name("cpu"), "0.0")]:
        other = CostCache(device, version, tmp_path)
        other.op_time = {op.signature: 123.0 for op in graph.ops}
        other.link = {"d2h": 1.0, "h2d": 1.0, "latency": 1.0}
        other.save()
    costs = measure(graph, "cpu", tmp_path, warmup=0, repeats=1)
    assert costs.measured == 4 and 123.0 not in costs.op_time.values()

    # A file at the right name whose stored key is another one is not trusted either.
    path = cost_cache("cpu", tmp_path).path
    body = json.loads(path.read_text())
    body["key"]["torch"] = "0.0"
    path.write_text(json.dumps(body))
    with pytest.warns(UserWarning, match="0.0"):
        assert measure(graph, "cpu", tmp_path, warmup=0, repeats=1).measured == 4


def test_strided_and_integer_inputs(tmp_path):
    x = {"shape": [4, 3], "dtype": "float32", "stride": [1, 4]}  # a transposed 3x4
    idx = T(5, dtype="int64")
    tensors = {"w": Tensor("w", 4 * 12, "param"), "y": Tensor("y", 4 * 12, "activation", "t"),
               "z": Tensor("z", 4 * 15, "activation", "emb")}
    ops = (
        Op("t", "aten.clone.default", ("w",), ("y",),
           signature=sig("aten.clone.default", x, memory_format="torch.contiguous_format")),
        Op("emb", "aten.embedding.default", ("y",), ("z",), signature=sig("aten.embedding.default", T(4, 3), idx)),
    )
    costs = measure(Graph(ops, tensors), "cpu", tmp_path, warmup=0, repeats=1)
    assert costs.estimated == () and all(t > 0 for t in costs.op_time.values())


def test_measure_link_cpu():
    d2h, h2d = measure_link("cpu", nbytes=16 << 20)
    assert d2h > 0 and h2d > 0


def test_measure_in_place_times_every_op_of_the_running_step(tmp_path):
    """On a CPU, with the captured step at hand, ops are timed as the whole step runs (every op of the graph,
    a median per signature), cached apart from standalone figures, and copies are marked as holding up compute."""
    from gaswap import zoo
    from gaswap.run.capture import capture, make_inputs
    from gaswap.run.measure import profile_step

    torch.manual_seed(0)
    model = zoo.tiny_cnn(num_classes=10, width=8)
    inputs, target = make_inputs([{"shape": ["batch", 3, 16, 16]}], {"shape": ["batch"], "dtype": "int64", "high": 10},
                                 4, device="cpu", generator=torch.Generator().manual_seed(1))
    captured = capture(model, inputs, target, "cross_entropy")
    runs = []

    def make_args():
        runs.append(1)
        return captured.arguments(model, tuple(x.clone() for x in inputs), target.clone())

    graph = captured.graph
    profile = profile_step(captured, make_args, "cpu", warmup=1, repeats=3)
    assert len(runs) == 8  # kept, then swapped
    assert set(profile.op_time) == {op.name for op in graph.ops} and all(t >= 0 for t in profile.op_time.values())
    assert sum(profile.op_time.values()) > 0
    assert profile.link["d2h"] > 0 and profile.link["h2d"] > 0 and profile.link["latency"] >= 0

    first = measure(graph, "cpu", tmp_path, in_place=(captured, make_args))
    signatures = {op.signature for op in graph.ops}
    assert first.measured == len(signatures) and not first.estimated and not first.copies_overlap
    assert set(first.op_time) == {op.name for op in graph.ops}
    assert measure(graph, "cpu", tmp_path, in_place=(captured, make_args)).measured == 0  # cached
    assert cost_cache("cpu", tmp_path).op_time == {}  # standalone: another cache


def test_copies_timed_in_place_are_fitted_as_a_latency_plus_bandwidths():
    from gaswap.base.program import Verb
    from gaswap.plan.graph import chain
    from gaswap.run.measure import _fit_link

    graph = chain(4, size=1000)
    sizes = {name: 1000 * (k + 1) for k, name in enumerate(["a1", "a2", "a3"])}
    graph = Graph(graph.ops, {n: dataclasses.replace(t, size=sizes.get(n, t.size)) for n, t in graph.tensors.items()},
                  loss=graph.loss)
    copies = {(Verb.SWAP_OUT, n): [2e-6 + b / 1e9] * 3 for n, b in sizes.items()}
    copies |= {(Verb.SWAP_IN, n): [2e-6 + b / 4e9] for n, b in sizes.items()}
    link = _fit_link(graph, copies, torch.device("cpu"))
    assert link == pytest.approx({"d2h": 1e9, "h2d": 4e9, "latency": 2e-6}, rel=1e-6)
    assert all(type(v) is float for v in link.values())  # plain floats: they go into YAML policy files


def test_cpu_figures_are_process_cpu_time_and_record_the_load_they_were_timed_under(tmp_path, monkeypatch):
    monkeypatch.setattr(measuring, "load_per_cpu", lambda: 5.0)  # a busy machine
    graph = small_graph()
    measure(graph, "cpu", tmp_path, warmup=0, repeats=1)
    cache = cost_cache("cpu", tmp_path)
    assert cache.key["timing"] == "standalone, CPU time"
    assert cache.load == dict.fromkeys(cache.op_time, 5.0) and cache.op_time
    monkeypatch.setattr(measuring, "load_per_cpu", lambda: 0.1)
    assert measure(graph, "cpu", tmp_path).measured == 0  # CPU time does not count the others' turns: kept


def test_wall_clock_figures_timed_on_a_busy_machine_are_timed_again_once_it_is_quieter(tmp_path, monkeypatch):
    """As on a GPU, where ops are timed by the wall clock: figures taken while processes waited for a core are
    not trusted once the machine is quieter, and are timed again (and then kept)."""
    monkeypatch.setattr(measuring, "device_clock", lambda dev: time.perf_counter)
    graph = small_graph()
    signatures = len({op.signature for op in graph.ops})
    load = [3.0]
    monkeypatch.setattr(measuring, "load_per_cpu", lambda: load[0])
    measure(graph, "cpu", tmp_path, warmup=0, repeats=1)
    assert measure(graph, "cpu", tmp_path).measured == 0  # as busy now as then: nothing better to get
    load[0] = 0.2
    assert measure(graph, "cpu", tmp_path, warmup=0, repeats=1).measured == signatures - 1  # one op cannot run alone
    assert set(cost_cache("cpu", tmp_path).load.values()) == {0.2}
    assert measure(graph, "cpu", tmp_path).measured == 0


@pytest.mark.parametrize("load", [-1, float("nan"), "busy"])
def test_a_cache_with_an_implausible_load_is_moved_aside(tmp_path, load):
    cache = cost_cache("cpu", tmp_path)
    cache.op_time, cache.load = {"sig": 1e-3}, {"sig": load}
    cache.save()
    with pytest.warns(UserWarning, match="load"):
        assert cost_cache("cpu", tmp_path).op_time == {}
