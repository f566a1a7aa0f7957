"""Tests of gaswap.capture (model -> training-step Graph) and gaswap.zoo, on tiny models."""
import copy
import json
import resource

import pytest
import torch
from torch import nn

from gaswap import zoo
from gaswap.capture import LOSSES, CaptureError, capture, make_inputs
from gaswap.graph import Graph

F32 = 4  # bytes per float32


def _classify_inputs(batch, *shape, classes=10):
    return make_inputs([{"shape": ["batch", *shape]}], {"shape": ["batch"], "dtype": "int64", "high": classes},
                       batch, device="cpu", generator=torch.Generator().manual_seed(0))


def _cnn(**kw):
    torch.manual_seed(0)
    model = zoo.tiny_cnn(**kw)
    return model, capture(model, *_classify_inputs(2, 3, 8, 8))


def _gpt(**kw):
    torch.manual_seed(0)
    model = zoo.gpt(vocab=50, layers=2, width=16, heads=2, seq=8, **kw)
    ids = {"shape": ["batch", 8], "dtype": "int64", "high": 50}
    inputs, target = make_inputs([ids], ids, 2, device="cpu", generator=torch.Generator().manual_seed(0))
    return model, capture(model, inputs, target), inputs, target


def _op(g: Graph, name: str):
    return next(op for op in g.ops if op.name == name)


@pytest.fixture(scope="module")
def cnn():
    return _cnn()


@pytest.fixture(scope="module")
def gpt():
    return _gpt()


# --- the graph is valid and complete ---------------------------------------------------------------

@pytest.mark.parametrize("which", ["mlp", "tiny_cnn", "gpt"])
def test_captures_a_valid_graph(which, cnn, gpt):
    if which == "mlp":
        model = zoo.mlp()
        captured = capture(model, *_classify_inputs(4, 32), optimizer="adam")
    else:
        model, captured = cnn if which == "tiny_cnn" else gpt[:2]
    g = captured.graph
    assert Graph.from_dict(json.loads(json.dumps(g.to_dict()))).fingerprint() == g.fingerprint()
    fx_names = {n.name for n in captured.gm.graph.nodes}
    assert {op.name for op in g.ops} <= fx_names
    assert {t.name for t in g.tensors.values()} - fx_names <= {t for t in g.tensors if "." in t}
    phases = [op.phase for op in g.ops]
    assert phases == sorted(phases, key=lambda p: p != "fwd")  # the whole forward pass comes first
    assert g.loss in g.tensors and g.candidates()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(t.size for t in g.tensors.values() if t.kind == "param") == param_bytes
    multiple = 2 if which == "mlp" else 1  # adam, else the default sgd_momentum
    assert g.resident == {"optimizer_state": multiple * param_bytes}


def test_capture_is_deterministic():
    model = zoo.mlp()
    a = capture(model, *_classify_inputs(4, 32)).graph
    b = capture(copy.deepcopy(model), *_classify_inputs(4, 32)).graph
    assert a.to_dict() == b.to_dict()


def test_losses_and_bad_arguments():
    model = zoo.mlp((6, 5, 3))
    x = torch.randn(2, 6)
    for loss, target in [("mse", torch.randn(2, 3)), ("sum", torch.empty(0)), ("cross_entropy", torch.zeros(2).long())]:
        g = capture(model, (x,), target, loss).graph
        assert _op(g, g.tensors[g.loss].producer).phase == "fwd"
    assert set(LOSSES) == {"cross_entropy", "mse", "sum"}
    with pytest.raises(ValueError, match="loss"):
        capture(model, (x,), torch.randn(2, 3), "hinge")
    with pytest.raises(ValueError, match="optimizer"):
        capture(model, (x,), torch.randn(2, 3), "mse", optimizer="lamb")


def test_model_is_not_modified():
    model = zoo.tiny_cnn()
    before = copy.deepcopy(model.state_dict())
    capture(model, *_classify_inputs(2, 3, 8, 8))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.device.type == "cpu" for p in model.parameters()) and model.training


# --- storages ---------------------------------------------------------------------------------------

def test_views_create_no_storage(gpt):
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    g = capture(model, (torch.randn(2, 3, 4),), torch.zeros(2).long()).graph
    addmm = next(op for op in g.ops if op.target == "aten.addmm.default")
    assert "input_0" in addmm.inputs and "p_1_weight" in addmm.inputs  # flatten and t() read their bases
    views = {f"aten.{v}.default" for v in ("view", "t", "expand", "permute", "transpose", "_unsafe_view", "detach")}
    for captured in (capture(model, (torch.randn(2, 3, 4),), torch.zeros(2).long()), gpt[1]):
        assert not [op.target for op in captured.graph.ops if op.target in views]
        fx_targets = {str(n.target) for n in captured.gm.graph.nodes}
        assert "aten.view.default" in fx_targets
    assert "aten._unsafe_view.default" in {str(n.target) for n in gpt[1].gm.graph.nodes}


def test_activation_sizes_by_hand():
    """mlp 4 -> 8 -> 3 at batch 2 with loss = output.sum(), counted by hand."""
    b, i, h, o = 2, 4, 8, 3
    g = capture(zoo.mlp((i, h, o)), (torch.randn(b, i),), torch.empty(0), "sum").graph
    fwd = sum(t.size for t in g.tensors.values() if t.kind == "activation" and _op(g, t.producer).phase == "fwd")
    bwd = sum(t.size for t in g.tensors.values() if t.kind == "activation" and _op(g, t.producer).phase == "bwd")
    grads = sum(t.size for t in g.tensors.values() if t.kind == "grad")
    assert fwd == (b * h + b * h + b * o) * F32 + F32  # linear, relu, linear, scalar loss
    assert bwd == F32 + (b * h + b * h) * F32  # ones (d loss), d relu-output, d linear-output
    assert grads == (h * i + h + o * h + o) * F32
    assert sum(t.size for t in g.tensors.values() if t.kind == "input") == b * i * F32


def test_gradients_are_grad_tensors_sized_like_parameters(cnn, gpt):
    for model, captured in (cnn, gpt[:2]):
        g = captured.graph
        grads = [t for t in g.tensors.values() if t.kind == "grad"]
        params = [t for t in g.tensors.values() if t.kind == "param"]
        assert sorted(t.size for t in grads) == sorted(t.size for t in params)
        assert all(_op(g, t.producer).phase == "bwd" for t in grads)


def test_tied_embedding_is_one_parameter(gpt):
    model, captured = gpt[:2]
    params = [t for t in captured.graph.tensors.values() if t.kind == "param"]
    assert len(params) == len(list(model.parameters())) == len(list(model.named_parameters(remove_duplicate=False))) - 1
    assert "p_tok_weight" in captured.graph.tensors and "p_head_weight" not in captured.graph.tensors
    readers = {op.layer for op in captured.graph.ops if "p_tok_weight" in op.inputs and op.phase == "fwd"}
    assert readers == {"tok", "head"}


# --- op properties -----------------------------------------------------------------------------------

def test_dropout_is_not_recomputable():
    model = zoo.mlp((6, 8, 3), dropout=0.5)
    g = capture(model, (torch.randn(2, 6),), torch.zeros(2).long()).graph
    dropout = [op for op in g.ops if op.layer == "2" and op.phase == "fwd"]
    assert any(not op.recomputable for op in dropout)
    assert all(op.recomputable for op in g.ops if op.layer in ("0", "1"))


def test_batchnorm_running_stats_updates_are_not_recomputable(cnn):
    g = cnn[1].graph
    updates = [op for op in g.ops if op.target == "aten.copy_.default"]
    assert {op.inputs[0] for op in updates} == {t.name for t in g.tensors.values() if t.kind == "buffer"}
    assert all(not op.recomputable and op.outputs == () for op in updates)
    assert {op.layer for op in updates} == {"stem.1", "block.1"}
    norms = [op for op in g.ops if "batch_norm" in op.target and op.phase == "fwd"]
    assert len(norms) == 2 and all(op.recomputable for op in norms)


def test_phases(cnn):
    g = cnn[1].graph
    loss_op = _op(g, g.tensors[g.loss].producer)
    assert loss_op.phase == "fwd" and loss_op.layer == "loss"
    assert {op.layer for op in g.ops if op.phase == "fwd"} >= {"stem.0", "stem.1", "block.0", "fc", "loss"}
    assert any(op.phase == "bwd" and op.layer == "loss" for op in g.ops)


def test_conv_backward_has_the_conv_layer(cnn):
    g = cnn[1].graph
    convs = {op.inputs[1]: op.layer for op in g.ops if op.target == "aten.convolution.default"}
    backs = [op for op in g.ops if op.target == "aten.convolution_backward.default"]
    assert len(backs) == len(convs) == 2
    for op in backs:
        weight = next(t for t in op.inputs if t in convs)
        assert op.layer == convs[weight] and op.phase == "bwd"


def test_flops_and_signatures(cnn):
    g = cnn[1].graph
    conv = _op(g, "convolution")
    assert conv.flops == 2 * 2 * 8 * 8 * 8 * 3 * 3 * 3  # 2 * batch * out_channels * H * W * in_channels * kh * kw
    sig = json.loads(conv.signature)
    assert sig["target"] == "aten.convolution.default"
    assert sig["args"][0] == {"shape": [2, 3, 8, 8], "dtype": "float32"}
    addmm = json.loads(next(op for op in g.ops if op.target == "aten.addmm.default").signature)
    assert addmm["args"][2]["stride"] == [1, 8]  # the transposed weight is not contiguous
    deep = capture(zoo.mlp((8, 8, 8, 8, 8)), (torch.randn(2, 8),), torch.zeros(2).long()).graph
    hidden = [op.signature for op in deep.ops if op.target == "aten.addmm.default"]
    assert len(hidden) == 4 and len(set(hidden)) == 1  # identical layers are measured once


# --- the traced module runs ---------------------------------------------------------------------------

def test_traced_step_matches_eager(gpt):
    torch.manual_seed(0)
    mlp = zoo.mlp()
    x, y = _classify_inputs(3, 32)
    gpt_model, gpt_captured, ids, target = gpt
    for model, captured, inputs, tgt in [(mlp, capture(mlp, x, y), x, y), (gpt_model, gpt_captured, ids, target)]:
        loss, *grads = captured.gm(*captured.arguments(model, inputs, tgt))
        out = model(*inputs)
        ref_loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))
        ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
        torch.testing.assert_close(loss, ref_loss)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b)


def test_traced_step_updates_batchnorm_buffers(cnn):
    model, captured = cnn
    eager = copy.deepcopy(model)
    inputs, target = _classify_inputs(2, 3, 8, 8)
    fresh = copy.deepcopy(model)
    captured.gm(*captured.arguments(fresh, inputs, target))
    eager(*inputs)
    for name, buf in eager.named_buffers():
        torch.testing.assert_close(dict(fresh.named_buffers())[name], buf)


def test_gm_on_another_device(gpt):
    model, captured, (ids,), target = gpt
    meta = copy.deepcopy(model).to("meta")
    moved = captured.gm_on("meta")
    devices = [n.kwargs.get("device") for gm in (captured.gm, moved) for n in gm.graph.nodes if n.name == "arange"]
    assert devices == [torch.device("cpu"), torch.device("meta")]  # the positions of gpt's embedding
    loss, *_ = moved(*captured.arguments(meta, (ids.to("meta"),), target.to("meta")))
    assert loss.device.type == "meta"


# --- big configurations on the meta device, errors --------------------------------------------------------

def test_meta_device_capture_allocates_nothing():
    with torch.device("meta"):
        model = zoo.alexnet()
    inputs, target = make_inputs([{"shape": ["batch", 3, 224, 224]}], {"shape": ["batch"], "dtype": "int64"}, 256)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    captured = capture(model, inputs, target)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    activations = sum(t.size for t in captured.graph.tensors.values() if t.kind == "activation")
    assert activations > 2 * 2**30 and grown_mib < 256
    assert captured.seconds < 30


class _Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_untraceable_model_raises_capture_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), _Branchy()))
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(2, 4),), torch.zeros(2).long())
    message = str(info.value)
    assert "'1.1'" in message and "_Branchy" in message and "_local_scalar_dense" in message
    assert "To fix" in message and info.value.__cause__ is not None
    with pytest.raises(CaptureError, match="module '0'"):
        capture(zoo.mlp(), (torch.randn(2, 5),), torch.zeros(2).long())
    g = capture(zoo.mlp(), (torch.randn(2, 32),), torch.zeros(2).long()).graph  # no state left behind
    assert [op.layer for op in g.ops if op.phase == "fwd"] == ["0", "1", "2", "3", "4", "loss", "loss"]


# --- inputs ------------------------------------------------------------------------------------------

def test_make_inputs():
    specs = [{"shape": ["batch", 3], "dtype": "float32"}, {"shape": [5, "batch"], "dtype": "int64", "high": 7}]
    labels = {"shape": ["batch"], "dtype": "int64", "high": 3}
    (x, ids), target = make_inputs(specs, labels, 4)
    assert x.device.type == "meta" and x.shape == (4, 3) and ids.shape == (5, 4) and target.dtype == torch.int64
    a = make_inputs(specs, labels, 4, "cpu", torch.Generator().manual_seed(1))
    b = make_inputs(specs, labels, 4, "cpu", torch.Generator().manual_seed(1))
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[0][1], b[0][1]) and torch.equal(a[1], b[1])
    assert int(a[0][1].min()) >= 0 and int(a[0][1].max()) < 7
    with pytest.raises(ValueError, match="high"):
        make_inputs([{"shape": [2], "dtype": "int64"}], {"shape": [2]}, 1, "cpu")
    with pytest.raises(ValueError, match="dtype"):
        make_inputs([{"shape": [2], "dtype": "float33"}], {"shape": [2]}, 1)


# --- zoo ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("factory, params", [
    (zoo.alexnet, 61_100_840), (zoo.vgg16, 138_357_544), (zoo.resnet18, 11_689_512), (zoo.resnet50, 25_557_032),
])
def test_zoo_matches_torchvision_sizes(factory, params):
    with torch.device("meta"):
        model = factory()
    assert sum(p.numel() for p in model.parameters()) == params


def test_zoo_small_models_run():
    assert zoo.mlp((5, 7, 2))(torch.randn(3, 5)).shape == (3, 2)
    assert zoo.tiny_cnn(num_classes=4)(torch.randn(2, 3, 8, 8)).shape == (2, 4)
    model = zoo.gpt(vocab=30, layers=1, width=8, heads=2, seq=6)
    assert model(torch.randint(0, 30, (2, 5))).shape == (2, 5, 30)
    assert model.head.weight is model.tok.weight


def test_resolve():
    assert zoo.resolve("gaswap.zoo:alexnet") is zoo.alexnet
    with pytest.raises(ValueError, match="no_such_module"):
        zoo.resolve("gaswap.no_such_module:alexnet")
    with pytest.raises(ValueError, match="nope"):
        zoo.resolve("gaswap.zoo:nope")
    with pytest.raises(ValueError, match="module:callable"):
        zoo.resolve("gaswap.zoo.alexnet")
