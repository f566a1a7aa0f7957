"""What a GPU holds beyond the graph's tensors, measured per op (gaswap.run.workspace): on the CPU with the step
tracker standing in for CUDA's allocator statistics."""
import json
import time
from types import SimpleNamespace

import torch

from gaswap.plan.costs import Costs
from gaswap.plan.graph import Graph, Op, Tensor
from gaswap.plan.memory.allocator import replay
from gaswap.run import workspace
from gaswap.run.step_memory import DeviceMemory


class _TrackedAllocator:
    """torch.cuda's memory statistics read from the CPU step tracker (every storage an aten op makes)."""

    def __init__(self, memory: DeviceMemory):
        self.memory = memory

    def synchronize(self, dev):
        pass

    def memory_allocated(self, dev):
        return self.memory.current()

    def reset_peak_memory_stats(self, dev):
        self.memory.peak = self.memory.current()

    def max_memory_allocated(self, dev):
        return self.memory.peak


def _graph(signature: str) -> Graph:
    tensors = {"x": Tensor("x", 256_000, "input"), "t": Tensor("t", 512, "input"),
               "loss": Tensor("loss", 4, "activation", "ce")}
    return Graph((Op("ce", "aten.cross_entropy_loss.default", ("x", "t"), ("loss",), signature=signature),),
                 tensors, loss="loss")


def test_an_ops_transient_is_what_it_allocates_beyond_its_result():
    """cross_entropy_loss makes log_softmax's output (64 x 1000 float32) and frees it before returning a scalar:
    a 256,000-byte transient (plus nll_loss's total_weight, a scalar, gone too)."""
    signature = json.dumps({"target": "aten.cross_entropy_loss.default",
                            "args": [{"shape": [64, 1000], "dtype": "float32"}, {"shape": [64], "dtype": "int64"}],
                            "kwargs": {}})
    graph = _graph(signature)
    with DeviceMemory("cpu") as memory:
        measured = workspace.op_transients(graph, "cpu", api=_TrackedAllocator(memory))
    assert 256_000 <= measured["ce"] <= 256_000 + 64
    assert workspace.op_transients(graph, "cpu") == {}  # no allocator to read on a CPU without a stand-in
    assert workspace.workspace_bytes("cpu") == 0


def test_an_op_that_cannot_run_alone_counts_no_transient():
    graph = _graph(json.dumps({"target": "aten.no_such_op.default", "args": [], "kwargs": {}}))
    with DeviceMemory("cpu") as memory:
        assert workspace.op_transients(graph, "cpu", api=_TrackedAllocator(memory)) == {}


def test_measured_transients_raise_the_models_peaks():
    signature = json.dumps({"target": "aten.cross_entropy_loss.default",
                            "args": [{"shape": [64, 1000], "dtype": "float32"}, {"shape": [64], "dtype": "int64"}],
                            "kwargs": {}})
    graph = _graph(signature)
    with DeviceMemory("cpu") as memory:
        transients = workspace.op_transients(graph, "cpu", api=_TrackedAllocator(memory))
    from gaswap.plan.costs import Costs
    from gaswap.plan.simulator import Simulator

    result = Simulator(graph, Costs({"ce": 1.0}, 1e9, 1e9, "t", "t")).run([0], [], trace=True)
    plain, held = replay(graph, result, steps=1), replay(graph, result, steps=1, transients=transients)
    assert held.requested == plain.requested + transients["ce"]


class _CappedAllocator:
    """torch.cuda's memory functions over a ledger of bytes, with `set_per_process_memory_fraction`'s cap: a
    request past it raises OutOfMemoryError (the caching allocator's reservations are the ledger's bytes)."""

    total = 1 << 34

    def __init__(self):
        self.current = self.peak = 0
        self.fraction = 1.0
        self.fractions = []

    def allocate(self, nbytes):
        if self.current + nbytes > self.fraction * self.total:
            raise torch.OutOfMemoryError(f"stand-in: {nbytes} bytes past the cap")
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def free(self, nbytes):
        self.current -= nbytes

    def synchronize(self, dev):
        pass

    def empty_cache(self):
        pass

    def memory_allocated(self, dev):
        return self.current

    memory_reserved = memory_allocated

    def reset_peak_memory_stats(self, dev):
        self.peak = self.current

    def max_memory_allocated(self, dev):
        return self.peak

    def get_device_properties(self, dev):
        return SimpleNamespace(total_memory=self.total)

    def current_device(self):
        return 0

    def set_per_process_memory_fraction(self, fraction, dev):
        if not isinstance(dev, int) and dev.index is None:  # as torch refuses it
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{dev}")
        self.fraction = fraction
        self.fractions.append(fraction)


MiB = 1 << 20


def _planned_op(api, plans):
    """An op that runs the first of `plans` (workspace bytes) whose workspace it can allocate, as torch tries
    cuDNN's plans; out of memory when none fits. It returns a 1 MiB tensor."""

    def call(*args, **kwargs):
        out = torch.empty(MiB, dtype=torch.uint8)
        api.allocate(MiB)
        for workspace_bytes in plans:
            try:
                api.allocate(workspace_bytes)
            except torch.OutOfMemoryError:
                continue
            api.free(workspace_bytes)
            return out
        raise torch.OutOfMemoryError("stand-in: no plan fits")

    return call


def test_an_ops_least_transient_is_measured_with_the_process_capped(monkeypatch):
    """cuDNN's convolutions take a workspace as large as the device has free: the least is what a capped call
    takes (a 1 GiB plan first, a 64 KiB one when memory is short); an op whose transient cannot shrink (8 MiB
    for every plan) runs once the headroom grows past it (2 MiB, then 16 MiB)."""
    api = _CappedAllocator()
    ops = {"elastic": _planned_op(api, [1 << 30, 64 << 10]), "fixed": _planned_op(api, [8 * MiB])}
    monkeypatch.setattr(workspace, "op_call", lambda signature, dev: (ops[json.loads(signature)["target"]], (), {}))
    tensors = {"x": Tensor("x", 4, "input"), "a": Tensor("a", MiB, "activation", "conv"),
               "loss": Tensor("loss", 4, "activation", "mm")}
    graph = Graph((Op("conv", "elastic", ("x",), ("a",), signature=json.dumps({"target": "elastic"})),
                   Op("mm", "fixed", ("a",), ("loss",), signature=json.dumps({"target": "fixed"}))), tensors, loss="loss")
    assert workspace.op_transients(graph, "cuda", api=api) == {"conv": 64 << 10, "mm": 8 * MiB}
    assert api.fractions[-1] == 1.0 and api.fraction == 1.0  # the cap lifted after each call
    assert workspace.op_transients(graph, "cuda", api=api, least=False) == {"conv": 1 << 30, "mm": 8 * MiB}


def test_an_op_whose_transient_shrinks_when_memory_is_short_is_timed_there(monkeypatch):
    """On an H100 cuDNN's plans with little workspace ran AlexNet's convolutions up to 8x slower, and a policy
    capped at its budget 1.8-2.1x its predicted step (results/gpu_check/, runs 2 and 8): an op whose least transient
    is below the one with memory to spare is timed capped; one whose transient cannot shrink is not."""
    api = _CappedAllocator()
    plans = {1 << 30: 0.0, 64 << 10: 0.02}  # workspace bytes -> seconds the plan takes

    def elastic(*args, **kwargs):
        out = torch.empty(MiB, dtype=torch.uint8)
        api.allocate(MiB)
        for workspace_bytes, seconds in plans.items():
            try:
                api.allocate(workspace_bytes)
            except torch.OutOfMemoryError:
                continue
            time.sleep(seconds)
            api.free(workspace_bytes)
            return out
        raise torch.OutOfMemoryError("stand-in: no plan fits")

    ops = {"elastic": elastic, "fixed": _planned_op(api, [8 * MiB])}
    monkeypatch.setattr(workspace, "op_call", lambda signature, dev: (ops[json.loads(signature)["target"]], (), {}))
    tensors = {"x": Tensor("x", 4, "input"), "a": Tensor("a", MiB, "activation", "conv"),
               "loss": Tensor("loss", 4, "activation", "mm")}
    graph = Graph((Op("conv", "elastic", ("x",), ("a",), signature=json.dumps({"target": "elastic"})),
                   Op("mm", "fixed", ("a",), ("loss",), signature=json.dumps({"target": "fixed"}))), tensors, loss="loss")
    measured = workspace.measure_transients(graph, "cuda", api=api)
    assert measured.bytes == {"conv": 64 << 10, "mm": 8 * MiB}
    assert list(measured.capped_seconds) == ["conv"] and 0.02 <= measured.capped_seconds["conv"] < 0.2
    assert workspace.measure_transients(graph, "cuda", api=api, least=False).capped_seconds == {}
    margin = workspace.Margin(0, 8 * MiB, "mm", "t", "", measured.bytes, measured.capped_seconds)
    costs = workspace.capped_costs(Costs({"conv": 0.001, "mm": 0.002}, 1e9, 1e9, "t", "measured"), margin)
    assert costs.op_time == {"conv": measured.capped_seconds["conv"], "mm": 0.002}
    assert margin.as_dict()["ops_timed_capped"] == 1 and "capped_seconds" not in margin.as_dict()


def test_a_fresh_allocator_hands_back_the_unused_segments_on_cuda_only():
    """On an H100 the segments that measuring costs left cached counted against `validate`'s cap: AlexNet ran out of
    memory at 7.34 GB with 2.07 GiB reserved but unallocated, and peaked at 0.9993 of its prediction from a fresh
    allocator (results/gpu_check/, run 8)."""
    emptied = []
    api = SimpleNamespace(empty_cache=lambda: emptied.append(True))
    workspace.fresh_allocator("cpu", api=api)
    assert emptied == []
    workspace.fresh_allocator("cuda", api=api)
    assert emptied == [True]


def test_a_capped_run_lifts_its_cap_when_it_fails():
    api = _CappedAllocator()
    try:
        with workspace.capped("cuda", 1 << 30, api=api):
            assert api.fraction == (1 << 30) / api.total
            raise torch.OutOfMemoryError("stand-in")
    except torch.OutOfMemoryError:
        pass
    assert api.fraction == 1.0
