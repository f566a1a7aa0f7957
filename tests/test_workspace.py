"""What a GPU holds beyond the graph's tensors, measured per op (gaswap.run.workspace): on the CPU with the step
tracker standing in for CUDA's allocator statistics."""
import json

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
