"""The zoo's models of other kinds, written for the compiled model's errors on unseen models: a depthwise-separable
CNN, shifted-window attention, a top-k mixture of experts, a net of normalisation variants. Each trains, is
captured whole by torch.compile's joint graph, and its compare experiment loads."""
from pathlib import Path

import pytest
import torch

from gaswap import zoo
from gaswap.base import config
from gaswap.compiled import partition

ROOT = Path(__file__).resolve().parents[1]

# name -> (tiny model, inputs, experiment file)
KINDS = {
    "separable_cnn": (lambda: zoo.separable_cnn(4, 8, 2, 2), lambda: (torch.randn(2, 3, 8, 8),), "separable"),
    "window_attention": (lambda: zoo.window_attention(16, 2, 12, 3, 4, 2, 4), lambda: (torch.randn(2, 3, 16, 16),),
                         "window"),
    "mixture": (lambda: zoo.mixture(32, 16, 4, 2, 2), lambda: (torch.randint(0, 32, (2, 8)),), "mixture"),
    "norm_mix": (lambda: zoo.norm_mix(8, 2, 4), lambda: (torch.randn(2, 3, 8, 8),), "normmix"),
}


@pytest.mark.parametrize("name", KINDS)
def test_each_kind_trains_and_its_experiment_names_it(name):
    make, inputs, experiment = KINDS[name]
    torch.manual_seed(0)
    model = make()
    out = model(*inputs())
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    exp = config.load_experiment(ROOT / "experiments" / f"compare_{experiment}_cpu.yaml")
    assert exp.model.factory == f"gaswap.zoo:{name}" and zoo.shipped(exp.model.factory)


@pytest.mark.slow
@pytest.mark.parametrize("name", KINDS)
def test_each_kind_compiles_as_one_graph(name):
    make, inputs, _ = KINDS[name]
    torch.manual_seed(0)
    graph = partition.capture(make(), *inputs())
    assert graph.candidates() and any(op.phase == "bwd" for op in graph.ops)


def test_the_shifted_windows_keep_wrapped_around_tokens_apart():
    block = zoo._WindowBlock(width=6, heads=2, window=4, shift=True)
    mask = block._mask(8, 8, "cpu")  # 4 windows of 16 tokens
    assert mask.shape == (4, 16, 16)
    assert not mask[0].any()  # the first window holds one region: nothing masked
    last = mask[3]  # the last window holds four regions of 2 x 2 tokens: each sees its own 4 tokens
    assert (~last).sum(-1).tolist() == [4] * 16
    assert not zoo._WindowBlock(6, 2, 4, shift=False)._mask(8, 8, "cpu").any()


def test_each_token_goes_to_k_experts_with_gates_summing_to_one():
    torch.manual_seed(0)
    mixture = zoo._TopKMixture(width=8, experts=4, k=2)
    x = torch.randn(5, 8)
    top, chosen = mixture.router(x).topk(2, -1)
    gates = torch.zeros(5, 4).scatter(1, chosen, top.softmax(-1))
    assert ((gates > 0).sum(-1) == 2).all() and torch.allclose(gates.sum(-1), torch.ones(5))
    expected = sum(gates[:, e:e + 1] * (torch.nn.functional.silu(x @ mixture.up[e]) @ mixture.down[e])
                   for e in range(4))
    assert torch.allclose(mixture(x), expected, atol=1e-5)
