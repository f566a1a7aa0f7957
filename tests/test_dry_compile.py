"""gaswap.compiled.dry_compile: the programs inductor writes for a policy, without compiling their kernels, are
the programs a real compile runs; nothing runs and the model compiles for real afterwards."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx

from gaswap import zoo
from gaswap.compiled import dry_compile, library_calls, methods, partition
from gaswap.compiled.programs import Recorder, step_peak

pytestmark = pytest.mark.slow
OUTPUT_BYTES = 16 * 10 * 4  # the tiny CNN's logits: batch 16, 10 classes, float32


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, x, y = zoo.tiny_cnn(num_classes=10, width=8), torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    graph = partition.capture(model, x)
    candidates = graph.candidates()
    recomputable = [t for t in candidates if graph.ops[[op.name for op in graph.ops].index(
        graph.tensors[t].producer)].recomputable]
    policy = partition.make_policy(graph, {t: "recompute" for t in recomputable[::2]})
    return model, x, y, policy


def _real_peak(compiled, x, y) -> int:
    """The step peak of the programs a real compile runs, their library calls' scratch counted (as the dry
    compile's peaks count it)."""
    torch.manual_seed(1)  # the CNN's dropout
    with Recorder() as recorder:
        F.cross_entropy(compiled(x), y).backward()
    return step_peak(recorder.programs, OUTPUT_BYTES, "cross_entropy", library_calls.scratch)


def test_dry_programs_are_a_real_compile_s_nothing_ran_and_a_real_compile_after_reads_them_from_the_cache(
        tiny, fresh_inductor_cache, monkeypatch):
    from torch._dynamo.utils import counters

    model, x, y, policy = tiny
    # the session's own folder, where no other test compiles the tiny CNN: what the dry compile writes, alone
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(fresh_inductor_cache))
    dry_model = copy.deepcopy(model)
    before = [p.detach().clone() for p in dry_model.parameters()]
    counters.clear()
    dry = dry_compile.programs_of(dry_model, partition.backend(policy), x)
    assert len(dry) == 2 and [p.is_backward for p in dry] == [False, True]
    assert all(p.grad is None for p in dry_model.parameters())  # no backward ran
    assert all(torch.equal(a, b) for a, b in zip(before, dry_model.parameters()))
    assert counters["inductor"]["fxgraph_cache_miss"] == 2 and counters["inductor"]["fxgraph_cache_hit"] == 0
    peak = step_peak(dry, OUTPUT_BYTES, "cross_entropy", library_calls.scratch)

    counters.clear()
    after, fresh = copy.deepcopy(model), copy.deepcopy(model)
    assert _real_peak(partition.compile(after, policy), x, y) == peak
    assert counters["inductor"]["fxgraph_cache_hit"] == 2 and counters["inductor"]["fxgraph_cache_miss"] == 0
    with torch._inductor.config.patch(fx_graph_cache=False):  # a compile of its own, kernels and all
        assert _real_peak(partition.compile(fresh, policy), x, y) == peak
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(after.parameters(), fresh.parameters()))
    assert dry_compile.policy_peak(copy.deepcopy(model), policy, (x,), OUTPUT_BYTES, "cross_entropy") == peak


def test_torch_s_partition_dry_is_its_real_compile(tiny):
    model, x, y, _ = tiny
    dry = dry_compile.torch_peak(copy.deepcopy(model), 0.5, (x,), OUTPUT_BYTES, "cross_entropy")
    assert dry == _real_peak(methods.torch_compiled(copy.deepcopy(model), 0.5), x, y)


def test_a_model_that_fails_to_compile_says_so_in_one_line():
    class Breaks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y.sum() if y.sum().item() > 0 else -y.sum()  # a branch the data decides: a graph break

    with pytest.raises(dry_compile.ProgramError, match="inductor wrote 0 of a step's two programs: .+"):
        dry_compile.programs_of(Breaks(), compile_fx, torch.randn(3, 4))
    with torch.no_grad(), pytest.raises(dry_compile.ProgramError, match="inference graph"):
        dry_compile.programs_of(torch.nn.Linear(4, 4), compile_fx, torch.randn(3, 4))
