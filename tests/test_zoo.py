"""Tests of gaswap.zoo, and of capturing every zoo model: each captured graph is checked against an
independent liveness analysis, against what eager PyTorch saves for the backward pass, and (transformers,
U-Net) the traced step against eager PyTorch's loss and gradients."""
import copy
import resource
import sys
import time
import types
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from gaswap import zoo
from gaswap.base import config
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.simulator import Simulator, lower_bound
from gaswap.run import experiment
from gaswap.run.capture import make_inputs
from helpers import unit_costs
from tiny_models import classifier_capture as capture

pytestmark = pytest.mark.slow  # real models captured end to end: `pytest -m "not slow"` skips them

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["vgg16_12gb", "resnet50_8gb", "gpt2_small_0.4x", "bert_base_12gb", "unet_10gb", "gpt_tiny_cpu",
           "unet_tiny_cpu"]


def _ids(batch, seq, vocab):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _labels(*shape, classes):
    return torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(2))


def _mask(batch, seq, dtype=torch.int64):
    """An attention mask with padding at the end of the second sequence."""
    mask = torch.ones(batch, seq, dtype=dtype)
    mask[1, seq // 2:] = 0
    return mask


# name -> (model factory, inputs, target) at tiny sizes; "meta" models are too big to build for real.
TINY = {
    "alexnet": (lambda: zoo.alexnet(10), (torch.empty(2, 3, 64, 64, device="meta"),), _labels(2, classes=10)),
    "vgg16": (lambda: zoo.vgg16(10), (torch.empty(2, 3, 32, 32, device="meta"),), _labels(2, classes=10)),
    "resnet50": (lambda: zoo.resnet50(10), (torch.empty(2, 3, 32, 32, device="meta"),), _labels(2, classes=10)),
    "resnet18": (lambda: zoo.resnet18(10), (torch.randn(2, 3, 32, 32),), _labels(2, classes=10)),
    "mlp": (lambda: zoo.mlp((8, 16, 4), dropout=0.5), (torch.randn(4, 8),), _labels(4, classes=4)),
    "tiny_cnn": (lambda: zoo.tiny_cnn(4, 8), (torch.randn(2, 3, 8, 8),), _labels(2, classes=4)),
    "gpt": (lambda: zoo.gpt(50, 2, 16, 2, 8), (_ids(2, 8, 50),), _ids(2, 8, 50)),
    "bert": (lambda: zoo.bert(50, 2, 16, 2, 8), (_ids(2, 8, 50), _mask(2, 8)), _ids(2, 8, 50)),
    "bert_tokens": (lambda: zoo.bert(50, 1, 16, 2, 8, num_labels=3, dropout=0.0),
                    (_ids(2, 8, 50), _mask(2, 8, torch.bool)), _labels(2, 8, classes=3)),
    "unet": (lambda: zoo.unet(3, 3, 4, 2), (torch.randn(2, 3, 16, 16),), _labels(2, 16, 16, classes=3)),
}
RUNNABLE = [name for name, (_, inputs, _) in TINY.items() if inputs[0].device.type != "meta"]


def _build(name):
    factory, inputs, target = TINY[name]
    torch.manual_seed(0)
    with torch.device(inputs[0].device):
        return factory(), inputs, target


@pytest.fixture(scope="module")
def captured():
    """name -> (model, inputs, target, Captured) for every tiny zoo model."""
    out = {}
    for name in TINY:
        model, inputs, target = _build(name)
        out[name] = (model, inputs, target, capture(model, inputs, target))
    return out


# --- the captured graphs against independent analyses ----------------------------------------------

def _keep_all_peak(g) -> int:
    """Peak bytes of the captured order keeping everything, by a plain walk: resident bytes all step; an op
    allocates its outputs; a tensor is freed after its last reader (or its producer, if never read),
    except gradients and the loss, which live to the end."""
    index = g.op_index()
    last_reader = {t: i for i, op in enumerate(g.ops) for t in op.inputs}
    freed_after = defaultdict(list)
    for t in g.tensors.values():
        if t.producer is not None and t.kind != "grad" and t.name != g.loss:
            freed_after[last_reader.get(t.name, index[t.producer])].append(t)
    size = {t.name: t.size if g.counts(t) else 0 for t in g.tensors.values()}
    memory = peak = g.resident_bytes()
    for i, op in enumerate(g.ops):
        memory += sum(size[t] for t in op.outputs)
        peak = max(peak, memory)
        memory -= sum(size[t.name] for t in freed_after[i])
    return peak


def _saved_for_backward(g) -> set[str]:
    """Inputs and forward activations some backward op reads (the loss aside)."""
    phase = {op.name: op.phase for op in g.ops}
    made_in_fwd = {t.name for t in g.tensors.values()
                   if t.kind == "input" or (t.producer is not None and phase[t.producer] == "fwd")}
    return {t for op in g.ops if op.phase == "bwd" for t in op.inputs if t in made_in_fwd} - {g.loss}


@pytest.mark.parametrize("name", TINY)
def test_keep_all_peak_matches_a_plain_liveness_walk(name, captured):
    g = captured[name][3].graph
    saved = _saved_for_backward(g)
    assert saved == set(g.candidates())
    enc = Encoding(g)
    keep = enc.uniform(Action.KEEP)
    result = Simulator(g, unit_costs(g)).run(enc.decode(keep.keys), keep.actions)
    peak = _keep_all_peak(g)
    assert result.valid and result.peak_bytes == peak
    # at the end of the forward pass everything saved for the backward pass is there at once
    assert peak >= g.resident_bytes() + sum(g.tensors[t].size for t in saved if g.tensors[t].kind != "input")
    assert lower_bound(g) <= peak


def _eager_saved_bytes(model, inputs, target, autocast=None) -> list[int]:
    """Sizes of the distinct storages eager autograd saves for the backward pass (parameters and the target
    aside), sorted. BatchNorm's backward reads the running statistics: in the captured (functional) step
    those are the updated copies, activations like the others, so buffers are counted here."""
    resident = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), target)}
    saved = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        if key not in resident:
            saved[key] = t.untyped_storage().nbytes()
        return t

    amp = torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        _eager_loss(model, inputs, target)
    return sorted(saved.values())


@pytest.mark.parametrize("name", RUNNABLE)
def test_saved_activations_are_what_eager_autograd_saves(name, captured):
    model, inputs, target, c = captured[name]
    g = c.graph
    candidates = sorted(g.tensors[t].size for t in g.candidates() if t != "target")
    assert candidates == _eager_saved_bytes(model, inputs, target)


def test_saved_activations_under_autocast_are_what_eager_autograd_saves():
    model, inputs, target = _build("gpt")
    g = capture(model, inputs, target, autocast="bfloat16").graph
    candidates = sorted(g.tensors[t].size for t in g.candidates() if t != "target")
    assert candidates == _eager_saved_bytes(model, inputs, target, "bfloat16")


# --- the traced step against eager PyTorch ----------------------------------------------------------

def _eager_loss(model, inputs, target):
    out = model(*inputs)
    out = getattr(out, "logits", out)  # a Hugging Face ModelOutput
    if out.shape[:-1] == target.shape:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return nn.functional.cross_entropy(out, target)


def _assert_step_matches_eager(model, inputs, target, c, autocast=None):
    """gm's loss, gradients and buffer updates equal eager PyTorch's on the same model copy."""
    traced, eager = copy.deepcopy(model), copy.deepcopy(model)
    loss, *grads = c.gm(*c.arguments(traced, inputs, target))
    with torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else nullcontext():
        ref = _eager_loss(eager, inputs, target)
    ref_grads = torch.autograd.grad(ref, list(eager.parameters()))
    torch.testing.assert_close(loss, ref)
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)
    for (name, a), b in zip(traced.named_buffers(), eager.buffers()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("name", ["gpt", "bert_tokens", "unet"])
def test_traced_step_matches_eager(name, captured):
    model, inputs, target, c = captured[name]
    _assert_step_matches_eager(model, inputs, target, c)


@pytest.mark.parametrize("name, autocast", [("gpt", "bfloat16"), ("unet", "float16")])
def test_traced_mixed_precision_step_matches_eager(name, autocast):
    model, inputs, target = _build(name)
    c = capture(model, inputs, target, autocast=autocast)
    _assert_step_matches_eager(model, inputs, target, c, autocast)


def test_traced_bert_with_dropout(captured):
    """Dropout draws its own masks (not recomputable); without it (eval mode) the step is eager's."""
    model, inputs, target, c = captured["bert"]
    assert any(not op.recomputable for op in c.graph.ops if op.layer.endswith("attn.drop"))
    loss, *grads = c.gm(*c.arguments(model, inputs, target))
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    model = copy.deepcopy(model).eval()
    _assert_step_matches_eager(model, inputs, target, capture(model, inputs, target))


# --- model properties ----------------------------------------------------------------------------

@pytest.mark.parametrize("factory, params", [
    (zoo.alexnet, 61_100_840), (zoo.vgg16, 138_357_544), (zoo.resnet18, 11_689_512), (zoo.resnet50, 25_557_032),
    (lambda: zoo.gpt(50257, 12, 768, 12, 1024), 124_439_808),  # GPT-2 small, as Hugging Face's GPT2LMHeadModel
    (lambda: zoo.bert(30522, 12, 768, 12, 512), 109_514_298 - 2 * 768),  # BertForMaskedLM less token types
    (lambda: zoo.unet(3, 2, 64, 4), 31_037_698),  # 9ab + 9bb + 4b per double conv(a, b), 8cc + c per up-conv
])
def test_parameter_counts(factory, params):
    with torch.device("meta"):
        model = factory()
    assert sum(p.numel() for p in model.parameters()) == params


def test_small_models_run():
    assert zoo.mlp((5, 7, 2))(torch.randn(3, 5)).shape == (3, 2)
    assert zoo.tiny_cnn(num_classes=4)(torch.randn(2, 3, 8, 8)).shape == (2, 4)
    assert zoo.gpt(vocab=30, layers=1, width=8, heads=2, seq=6)(_ids(2, 5, 30)).shape == (2, 5, 30)
    assert zoo.bert(vocab=30, layers=1, width=8, heads=2, seq=6)(_ids(2, 5, 30), _mask(2, 5)).shape == (2, 5, 30)
    assert zoo.bert(30, 1, 8, 2, 6, num_labels=4)(_ids(2, 5, 30)).shape == (2, 5, 4)
    assert zoo.unet(1, 5, 4, 3)(torch.randn(2, 1, 16, 24)).shape == (2, 5, 16, 24)


def test_tied_embeddings_survive_a_meta_build():
    """One Parameter for the embedding and the LM head, and no buffer to re-initialize after to_empty."""
    with torch.device("meta"):
        model = zoo.gpt(vocab=30, layers=1, width=8, heads=2, seq=6)
    assert not list(model.buffers())
    model = model.to_empty(device="cpu")
    reference = zoo.gpt(vocab=30, layers=1, width=8, heads=2, seq=6)
    model.load_state_dict(reference.state_dict())
    ids = _ids(2, 6, 30)
    torch.testing.assert_close(model(ids), reference(ids))
    torch.testing.assert_close(copy.deepcopy(model)(ids), reference(ids))
    grad = torch.autograd.grad(model(ids).sum(), model.embed.tok.weight)[0]
    assert grad.shape == (30, 8)  # reaches the head's use of the weight too
    assert len(list(model.parameters())) == len(list(model.named_parameters(remove_duplicate=False)))


def test_attention_masks():
    torch.manual_seed(0)
    ids = _ids(2, 6, 30)
    changed = ids.clone()
    changed[:, 4:] = (changed[:, 4:] + 1) % 30
    gpt = zoo.gpt(vocab=30, layers=2, width=8, heads=2, seq=6)
    torch.testing.assert_close(gpt(ids)[:, :4], gpt(changed)[:, :4])  # causal: later tokens are not seen
    bert = zoo.bert(vocab=30, layers=2, width=8, heads=2, seq=6, dropout=0.0)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert not torch.allclose(bert(ids)[:, :4], bert(changed)[:, :4])  # bidirectional
    torch.testing.assert_close(bert(ids, mask)[0, :4], bert(changed, mask)[0, :4])  # padding is not seen
    torch.testing.assert_close(bert(ids, mask.bool()), bert(ids, mask))
    padding_only = torch.zeros(2, 6, dtype=torch.long)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            assert torch.isfinite(bert(ids, padding_only)).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="not divisible by 3 heads"):
        zoo.gpt(width=16, heads=3)
    with pytest.raises(ValueError, match="sequence length 9 exceeds the model's seq 8"):
        zoo.gpt(vocab=30, layers=1, width=8, heads=2, seq=8)(_ids(1, 9, 30))
    with pytest.raises(ValueError, match="multiples of 8"):
        zoo.unet(3, 2, 4, 3)(torch.randn(1, 3, 16, 12))


def test_unet_skips_are_concatenations(captured):
    g = captured["unet"][3].graph
    fwd = [op for op in g.ops if op.phase == "fwd"]
    cats = [op for op in fwd if op.target == "aten.cat.default"]
    assert [op.layer for op in cats] == ["", ""]  # depth 2: one skip per level, in the top-level forward
    skips = {op.outputs[0] for op in fwd if op.layer in ("down.0.5", "down.1.5")}  # the levels' last ReLU
    assert all(any(s in op.inputs for op in cats) for s in skips)
    assert sum(op.target == "aten.convolution.default" and op.layer.startswith("up.") for op in fwd) == 2


# --- configurations bigger than the host -------------------------------------------------------------

@pytest.mark.parametrize("name, factory, specs, target, batch", [
    ("gpt2 small", lambda: zoo.gpt(50257, 12, 768, 12, 1024), [{"shape": ["batch", 1024], "dtype": "int64"}],
     {"shape": ["batch", 1024], "dtype": "int64"}, 32),
    ("resnet50", zoo.resnet50, [{"shape": ["batch", 3, 224, 224]}], {"shape": ["batch"], "dtype": "int64"}, 512),
])
def test_configurations_bigger_than_the_host_capture_in_seconds(name, factory, specs, target, batch):
    with torch.device("meta"):
        model = factory()
    inputs, target = make_inputs(specs, target, batch)
    rss, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.process_time()
    c = capture(model, inputs, target, optimizer="adam")
    cpu_seconds = time.process_time() - cpu  # not wall time: a loaded CI machine must not fail it
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    activations = sum(t.size for t in c.graph.tensors.values() if t.kind == "activation")
    assert activations > 100e9 and grown_mib < 256 and cpu_seconds < 30


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_experiments_have_budgets_well_under_keep_all(name):
    exp = config.load_experiment(ROOT / "experiments" / f"{name}.yaml")
    inputs, target = experiment.make_inputs(exp)
    g = capture(experiment.build_model(exp), inputs, target, exp.loss, optimizer=exp.optimizer, counted=exp.counts).graph
    enc = Encoding(g)
    keep = enc.uniform(Action.KEEP)
    peak = Simulator(g, unit_costs(g)).run(enc.decode(keep.keys), keep.actions).peak_bytes
    budget = exp.budget.resolve(peak)
    assert lower_bound(g) < budget <= 0.7 * peak


# --- factories by path ----------------------------------------------------------------------------------

def test_resolve():
    assert zoo.resolve("gaswap.zoo:alexnet") is zoo.alexnet
    with pytest.raises(ValueError, match="no_such_module"):
        zoo.resolve("gaswap.no_such_module:alexnet")
    with pytest.raises(ValueError, match="nope"):
        zoo.resolve("gaswap.zoo:nope")
    with pytest.raises(ValueError, match="module:callable"):
        zoo.resolve("gaswap.zoo.alexnet")


def test_torchvision_factory_by_path():
    pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = zoo.resolve("torchvision.models:resnet18")(num_classes=10)
        ours = zoo.resnet18(num_classes=10)
    inputs, target = (torch.empty(2, 3, 32, 32, device="meta"),), _labels(2, classes=10)
    theirs, ours = capture(model, inputs, target).graph, capture(ours, inputs, target).graph
    assert (len(theirs.ops), len(theirs.candidates())) == (len(ours.ops), len(ours.candidates()))


@pytest.mark.parametrize("architecture, config_kwargs, with_mask", [
    ("GPT2LMHeadModel", {"vocab_size": 50, "n_positions": 8, "n_embd": 16, "n_layer": 2, "n_head": 2}, False),
    ("BertForMaskedLM", {"vocab_size": 50, "max_position_embeddings": 8, "hidden_size": 16,
                         "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}, True),
])
def test_transformers_factory_by_path(architecture, config_kwargs, with_mask):
    pytest.importorskip("transformers")
    model = zoo.resolve("gaswap.zoo:huggingface")(architecture, attn_implementation="eager", **config_kwargs)
    model.eval()  # no dropout: the traced step is deterministic
    inputs, target = ((_ids(2, 8, 50), _mask(2, 8)) if with_mask else (_ids(2, 8, 50),)), _ids(2, 8, 50)
    c = capture(model, inputs, target)
    assert c.graph.candidates()
    _assert_step_matches_eager(model, inputs, target, c)


def test_bert_with_an_attention_mask_is_specialized_searched_and_runs_bit_for_bit():
    """transformers 5.x's BERT reads its mask (`mask.all()`: skip masking when nothing is padded): the step is
    specialized on the example's value, a short search's policy runs it bit for bit, another value is refused."""
    pytest.importorskip("transformers")
    from gaswap.plan.problem import Problem
    from gaswap.plan.search import search
    from gaswap.run.runtime import StepRunner
    from gaswap.run.values import ValueMismatch

    torch.manual_seed(0)
    model = zoo.huggingface("BertForMaskedLM", attn_implementation="eager", vocab_size=50, max_position_embeddings=8,
                            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32).eval()
    inputs, target = (_ids(2, 8, 50), _mask(2, 8)), _ids(2, 8, 50)
    c = capture(model, inputs, target)
    assert [(op, value) for op, _, value in c.graph.specialized] == [("aten._local_scalar_dense.default", False)]
    hybrid = config.load_search_space("hybrid")
    keep_all = Problem(c.graph, unit_costs(c.graph), None, hybrid).keep_all().peak_bytes
    problem = Problem(c.graph, unit_costs(c.graph), int(0.9 * keep_all), hybrid)  # half of keep-all is resident
    best = search(problem, config.GASettings(population=8, generations=2, milp_seed_ops=0), seed=0).best
    assert best is not None and best.peak_bytes <= problem.budget
    program = problem.simulate(best.chromosome, trace=True).program
    with torch.no_grad():
        expected = c.gm(*c.arguments(model, inputs, target))
    got = StepRunner(c, program)(c.arguments(model, [x.clone() for x in inputs], target))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    _assert_step_matches_eager(model, inputs, target, c)
    with pytest.raises(ValueMismatch, match="gives True where the step was captured with False"):
        c.arguments(model, (inputs[0], torch.ones_like(inputs[1])), target)


def test_huggingface_builds_the_class_from_its_config(monkeypatch):
    class Config:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class Model(nn.Module):
        config_class = Config

        def __init__(self, config):
            super().__init__()
            self.config = config

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(TinyModel=Model))
    model = zoo.huggingface("TinyModel", n_layer=2)
    assert isinstance(model, Model) and model.config.kwargs == {"n_layer": 2}
