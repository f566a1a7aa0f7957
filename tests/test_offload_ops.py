"""The compiled path's swaps on CUDA need torch's asynchronous activation offloading (`torch.ops.ao`, torch 2.13);
on a torch without it (2.11) they are refused in one line naming the torch version, while the CPU's synchronous
copies work on both (gaswap.compiled.offload_ops)."""
import re

import pytest
import torch

from gaswap.base.errors import REFUSED
from gaswap.compiled import offload_ops, partition


def fake_cuda_graphs():
    """A forward saving `relu` for a backward, over fake CUDA tensors (as inductor's partitioner sees them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def forward(x, w):
        relu = torch.relu(x @ w)
        return relu.sum(), relu

    def backward(x, relu, tangents_1):
        return ((relu > 0) * tangents_1,)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        x, w, relu, grad = (torch.empty(64, 64, device="cuda") for _ in range(4))
    fw, bw = torch.fx.symbolic_trace(forward), torch.fx.symbolic_trace(backward)
    FakeTensorProp(fw, mode).propagate(x, w)
    FakeTensorProp(bw, mode).propagate(x, relu, grad)
    return mode, fw, bw


def _offload(mode, fw, bw):
    from torch.utils._ordered_set import OrderedSet
    with mode:
        partition.offload(fw, bw, {"relu"}, 1, OrderedSet())


def test_the_path_taken_follows_what_this_torch_has():
    async_ops = offload_ops.has_async_offload()
    assert offload_ops.offload_path(cuda=False) == "sync"
    assert offload_ops.offload_path(cuda=True) == ("async" if async_ops else "refused")
    mode, fw, bw = fake_cuda_graphs()
    if async_ops:
        _offload(mode, fw, bw)
        assert torch.ops.ao.offload.default in [n.target for n in fw.graph.nodes]
    else:
        with pytest.raises(offload_ops.CompiledSwapRefused, match=re.escape(torch.__version__)):
            _offload(mode, fw, bw)


def test_without_the_async_ops_a_cuda_swap_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(offload_ops, "has_async_offload", lambda: False)
    mode, fw, bw = fake_cuda_graphs()
    with pytest.raises(offload_ops.CompiledSwapRefused) as refused:
        _offload(mode, fw, bw)
    message = str(refused.value)
    assert "\n" not in message and f"torch {torch.__version__}" in message and "relu" in message
    assert "torch >= 2.13" in message and "actions: [keep, recompute]" in message
    assert refused.value.exit_code == REFUSED
    assert not any("offload" in str(n.target) for n in fw.graph.nodes)  # refused before the graphs change
