"""Tests of gaswap.run.capture (model -> training-step Graph) and gaswap.zoo, on tiny models."""
import copy
import json

import pytest
import torch
from torch import nn

from gaswap import zoo
from gaswap.plan.graph import Graph, Tensor
from gaswap.run import capture as capturing
from gaswap.run.capture import LOSSES, CaptureError, make_inputs
from tiny_models import classifier_capture as capture

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
    for loss, target in [("mse", torch.randn(2, 3)), ("sum", torch.empty(0)), ("cross_entropy", torch.zeros(2).long()),
                         ("external", None)]:
        g = capture(model, (x,), target, loss).graph
        assert _op(g, g.tensors[g.loss].producer).phase == "fwd"
    assert set(LOSSES) == {"cross_entropy", "mse", "sum", "external"}
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


class _Tied(nn.Module):
    """Weights tied the Hugging Face way: two modules' attributes naming one Parameter."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_tied_weights_are_one_parameter(gpt):
    torch.manual_seed(0)
    model, x, target = _Tied(), torch.randn(3, 4), torch.randn(3, 4)
    c = capture(model, (x,), target, "mse")
    g = c.graph
    assert [t.name for t in g.tensors.values() if t.kind == "param"] == ["p_a_weight", "p_a_bias", "p_b_bias"]
    assert sum(t.kind == "grad" for t in g.tensors.values()) == 3
    assert {op.layer for op in g.ops if "p_a_weight" in op.inputs and op.phase == "fwd"} == {"a", "b"}
    loss, *grads = c.gm(*c.arguments(model, (x,), target))
    ref = nn.functional.mse_loss(model(x), target)
    torch.testing.assert_close(loss, ref)
    for a, b in zip(grads, torch.autograd.grad(ref, list(model.parameters())), strict=True):
        torch.testing.assert_close(a, b)  # the tied weight's gradient sums both uses
    model, captured = gpt[:2]  # gpt's LM head reads the embedding's weight: one Parameter, no tie to break
    assert sum(t.kind == "param" for t in captured.graph.tensors.values()) == len(list(model.parameters()))
    readers = {op.layer for op in captured.graph.ops if "p_embed_tok_weight" in op.inputs and op.phase == "fwd"}
    assert readers == {"embed.tok", "head"}


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


# --- what models do: several inputs, aliasing, mixed precision, outputs, losses --------------------------

def test_several_inputs_integer_and_bool():
    torch.manual_seed(0)
    model = zoo.bert(vocab=20, layers=1, width=8, heads=2, seq=6, dropout=0.0)
    ids, labels = torch.randint(0, 20, (2, 6)), torch.randint(0, 20, (2, 6))
    for mask in (torch.tensor([[1, 1, 1, 1, 0, 0]] * 2), torch.tensor([[True] * 4 + [False] * 2] * 2)):
        c = capture(model, (ids, mask), labels)
        assert [source for _, _, source in c.placeholders[-3:]] == ["inputs.0", "inputs.1", "target"]
        sizes = {t.name: t.size for t in c.graph.tensors.values() if t.kind == "input"}
        assert sizes == {"input_0": 12 * 8, "input_1": 12 * mask.element_size(), "target": 12 * 8}
        assert "input_0" in c.graph.candidates()  # the embedding's backward reads the ids
        assert any("input_1" in op.inputs for op in c.graph.ops if op.layer == "blocks.0.attn")
        loss, *grads = c.gm(*c.arguments(model, (ids, mask), labels))
        ref = nn.functional.cross_entropy(model(ids, mask).reshape(-1, 20), labels.reshape(-1))
        torch.testing.assert_close(loss, ref)
        for a, b in zip(grads, torch.autograd.grad(ref, list(model.parameters())), strict=True):
            torch.testing.assert_close(a, b)


class _InPlaceOnViews(nn.Module):
    """In-place ops on a view and on its base, and a transposed view as the output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        h[:, :2].mul_(3)
        h.relu_()
        return h.t()


def test_in_place_ops_on_views_and_aliases():
    torch.manual_seed(0)
    model, x, target = _InPlaceOnViews(), torch.randn(5, 4), torch.randn(6, 5)
    c = capture(model, (x,), target, "mse")
    g = c.graph
    fwd = [op for op in g.ops if op.phase == "fwd"]
    assert all(not op.target.endswith("_.default") for op in fwd)  # functionalized: no in-place op left
    assert all(len(set(op.outputs)) == len(op.outputs) for op in g.ops)
    loss, *grads = c.gm(*c.arguments(model, (x,), target))
    ref = nn.functional.mse_loss(model(x), target)
    torch.testing.assert_close(loss, ref)
    for a, b in zip(grads, torch.autograd.grad(ref, list(model.parameters())), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autocast_halves_activations_and_keeps_fp32_parameters(dtype):
    model, (x, y) = zoo.mlp((32, 64, 64, 10)), _classify_inputs(256, 32)
    full, half = capture(model, x, y).graph, capture(model, x, y, autocast=dtype).graph
    matmuls = [json.loads(op.signature) for op in half.ops if op.target == "aten.addmm.default"]
    assert matmuls and all(sig["args"][1]["dtype"] == dtype for sig in matmuls)
    assert any(op.target == "aten._to_copy.default" for op in half.ops)  # the casts are ops of the graph
    def weights(g):
        return sorted((t.kind, t.size) for t in g.tensors.values() if t.kind in ("param", "grad"))

    assert weights(half) == weights(full)  # float32 parameters and gradients

    def saved(g):
        return sum(g.tensors[t].size for t in g.candidates() if g.tensors[t].kind == "activation")

    assert saved(half) < 0.75 * saved(full)  # half-size activations, plus low-precision copies of the weights
    with pytest.raises(ValueError, match="autocast"):
        capture(model, x, y, autocast="float8")


class _Outputs(nn.Module):
    def __init__(self, wrap):
        super().__init__()
        self.fc, self.wrap = nn.Linear(4, 3), wrap

    def forward(self, x):
        return self.wrap(self.fc(x), x)


@pytest.mark.parametrize("wrap", [lambda out, x: (out, x), lambda out, x: {"hidden": x, "logits": out},
                                  lambda out, x: [out]])
def test_tuple_and_mapping_outputs_give_their_logits(wrap):
    torch.manual_seed(0)
    model, x, y = _Outputs(wrap), torch.randn(2, 4), torch.tensor([0, 2])
    c = capture(model, (x,), y)
    loss, *_ = c.gm(*c.arguments(model, (x,), y))
    torch.testing.assert_close(loss, nn.functional.cross_entropy(model.fc(x), y))
    with pytest.raises(CaptureError, match="returned str, not a tensor"):
        capture(_Outputs(lambda out, x: "logits"), (x,), y)


def test_external_loss_steps_back_from_a_given_gradient_of_the_output():
    """Loss "external": the forward pass to the model's output, then the backward pass from a placeholder
    gradient shaped like it, which is resident all step but no candidate; nor are the inputs (the caller
    holds them)."""
    torch.manual_seed(0)
    model = zoo.tiny_cnn(width=4)  # BatchNorm and residual; dropout off (eager draws differently)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    inputs, _ = _classify_inputs(2, 3, 8, 8)
    c = capture(copy.deepcopy(model), inputs, None, "external")
    g = c.graph
    assert c.placeholders[-2:] == [("input_0", "input", "inputs.0"), ("grad_output", "grad_output", "grad_output")]
    assert g.tensors["grad_output"] == Tensor("grad_output", 2 * 10 * F32, "grad_output")
    assert g.tensors[g.loss].size == 2 * 10 * F32 and _op(g, g.tensors[g.loss].producer).layer == "fc"
    assert {op.phase for op in g.ops if "grad_output" in op.inputs} == {"bwd"}
    assert not {op.layer for op in g.ops} & {"loss"}
    assert g.candidates() and not {"grad_output", "input_0"} & set(g.candidates())
    assert g.resident_bytes() >= g.tensors["grad_output"].size + g.tensors["input_0"].size
    grad_output = torch.randn(2, 10)
    fresh = copy.deepcopy(model)
    out, *grads = c.gm(*c.arguments(fresh, inputs, grad_output))
    ref = model(*inputs)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, torch.autograd.grad(ref, list(model.parameters()), grad_output), strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(fresh.buffers(), model.buffers(), strict=True):  # BatchNorm statistics, updated in the step
        torch.testing.assert_close(a, b)
    with pytest.raises(CaptureError, match="loss 'external': its forward returns tuple, not one tensor"):
        capture(_Outputs(lambda out, x: (out, x)), (torch.randn(2, 4),), None, "external")


def test_cross_entropy_finds_the_class_dimension():
    torch.manual_seed(0)
    seg = nn.Conv2d(2, 3, 1)  # [B, C, H, W] against [B, H, W]
    lm = nn.Linear(4, 7)  # [B, T, V] against [B, T]
    for model, x, y, ref in [
        (seg, torch.randn(2, 2, 4, 4), torch.randint(0, 3, (2, 4, 4)), nn.functional.cross_entropy),
        (lm, torch.randn(2, 5, 4), torch.randint(0, 7, (2, 5)),
         lambda out, y: nn.functional.cross_entropy(out.reshape(-1, 7), y.reshape(-1))),
    ]:
        c = capture(model, (x,), y)
        loss, *_ = c.gm(*c.arguments(model, (x,), y))
        torch.testing.assert_close(loss, ref(model(x), y))


# --- models that cannot be captured ----------------------------------------------------------------------

class _Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class _Reads(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        return self.how(x)


class _NoSetupContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


_LIB = torch.library.Library("gaswap_test", "DEF")
_LIB.define("no_fake_kernel(Tensor x) -> Tensor")
_LIB.impl("no_fake_kernel", lambda x: x * 2, "CPU")


def test_untraceable_model_raises_capture_error():
    """A branch on a value is specialized on the example's values (gaswap.run.values); without values, refused."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), _Branchy()))
    x = torch.randn(2, 4)
    (read,) = capture(model, (x,), torch.zeros(2).long()).graph.specialized
    assert read[1].endswith("in module '1.1' (_Branchy)") and read[2] == bool(torch.relu(model[0](x)).sum() > 0)
    with pytest.raises(CaptureError) as info:
        capture(model, (x.to("meta"),), torch.zeros(2).long())
    message = str(info.value)
    assert "'1.1'" in message and "_Branchy" in message and "_local_scalar_dense" in message
    assert "To fix" in message and "example inputs with values" in message and info.value.__cause__ is not None
    with pytest.raises(CaptureError, match="module '0'"):
        capture(zoo.mlp(), (torch.randn(2, 5),), torch.zeros(2).long())
    g = capture(zoo.mlp(), (torch.randn(2, 32),), torch.zeros(2).long()).graph  # no state left behind
    assert [op.layer for op in g.ops if op.phase == "fwd"] == ["0", "1", "2", "3", "4", "loss", "loss"]


@pytest.mark.parametrize("how, op, hint", [
    (lambda x: x[x > 0].sum() + x, "op aten.nonzero.default", "depends on tensor values"),
    (lambda x: x * len(x.tolist()), "tolist()", "depends on tensor values"),
    (lambda x: x + torch.from_numpy(x.detach().numpy()), "data pointer", "depends on tensor values"),
    (lambda x: torch.ops.gaswap_test.no_fake_kernel(x), "op gaswap_test.no_fake_kernel.default", "register_fake"),
    (_NoSetupContext.apply, "setup_context", "add setup_context to the Function"),
])
def test_capture_errors_name_the_module_the_op_and_the_fix(how, op, hint):
    model = nn.Sequential(nn.Linear(4, 4), _Reads(how))
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(2, 4),), torch.empty(0), "sum")
    message = str(info.value)
    assert message.startswith("cannot capture Sequential: in module '1' (_Reads), ") and "\n" not in message
    assert op in message and hint in message.partition("To fix: ")[2]


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
    (mask,), _ = make_inputs([{"shape": [64], "dtype": "bool"}], None, 1, "cpu", torch.Generator().manual_seed(1))
    assert mask.dtype == torch.bool and 0 < int(mask.sum()) < 64
    with pytest.raises(ValueError, match="high"):
        make_inputs([{"shape": [2], "dtype": "int64"}], {"shape": [2]}, 1, "cpu")
    with pytest.raises(ValueError, match="dtype"):
        make_inputs([{"shape": [2], "dtype": "float33"}], {"shape": [2]}, 1)


# --- traced with the CPU's dispatch, run elsewhere: constants and CPU-only kernels -------------------------

class _AttentionWithConstant(nn.Module):
    """SDPA (traced as the CPU's flash kernel) and a tensor made in forward (traced as a constant)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)  # (batch 2, heads 2, length 5, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (y.transpose(1, 2).reshape(2, 5, 8) * torch.tensor([1.0, 2, 3, 4, 5, 6, 7, 8])).sum(-1)


def test_tensor_constants_become_placeholders_and_the_step_runs_under_a_program():
    from gaswap.plan.costs import Costs
    from gaswap.plan.encoding import Action, Encoding
    from gaswap.plan.simulator import Simulator
    from gaswap.run.runtime import StepRunner

    torch.manual_seed(0)
    model, x, y = _AttentionWithConstant(), torch.randn(2, 5, 8), torch.randn(2, 5)
    captured = capture(model, (x,), y, "mse")
    assert not [n for n in captured.gm.graph.nodes if n.op == "get_attr"]
    (name,) = [name for name, kind, _ in captured.placeholders if kind == "constant"]
    assert captured.graph.tensors[name].kind == "buffer" and captured.graph.tensors[name].size == 32
    encoding = Encoding(captured.graph)
    keep = encoding.uniform(Action.KEEP)
    sim = Simulator(captured.graph, Costs({op.name: 1.0 for op in captured.graph.ops}, 1.0, 1.0, "t", "t"))
    program = sim.run(encoding.decode(keep.keys), keep.actions, trace=True).program
    loss, *grads = StepRunner(captured, program)(captured.arguments(model, (x,), y))  # a ProgramError before
    ref = nn.functional.mse_loss(model(x), y)
    torch.testing.assert_close(loss, ref)
    for a, b in zip(grads, torch.autograd.grad(ref, list(model.parameters())), strict=True):
        torch.testing.assert_close(a, b)


def test_cpu_flash_attention_is_replaced_off_the_cpu_by_equal_math():
    from gaswap.run.capture import sdpa_backward, sdpa_forward

    torch.manual_seed(0)
    model, x, y = _AttentionWithConstant(), torch.randn(2, 5, 8), torch.randn(2, 5)
    captured = capture(model, (x,), y, "mse")
    targets = [str(n.target) for n in captured.gm.graph.nodes]
    assert any("_for_cpu" in t for t in targets)  # what the CPU's dispatch traced
    moved = captured.gm_on("meta")  # any device but the CPU: the meta device stands in for CUDA
    assert not any("_for_cpu" in str(n.target) for n in moved.graph.nodes)
    loss, *_ = moved(*captured.arguments(copy.deepcopy(model).to("meta"), (x.to("meta"),), y.to("meta")))
    assert loss.device.type == "meta"
    q, k, v = torch.randn(3, 2, 2, 5, 4).unbind(0)
    mask = torch.randn(5, 5)
    cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    for causal, kwargs in [(False, {}), (True, {}), (False, {"attn_mask": mask, "scale": 0.3})]:
        out, lse = cpu(q, k, v, 0.0, causal, **kwargs)
        mine = sdpa_forward(q, k, v, 0.0, causal, **kwargs)
        torch.testing.assert_close(mine, (out, lse))
        grad = torch.randn_like(out)
        grads = sdpa_backward(grad, q, k, v, out, lse, 0.0, causal, **kwargs)
        expected = cpu_backward(grad, q, k, v, out, lse, 0.0, causal, **kwargs)
        torch.testing.assert_close(grads, expected)
        assert [t.stride() for t in (*mine, *grads)] == [t.stride() for t in (out, lse, *expected)]  # same layouts


def test_other_cpu_only_ops_are_refused_by_name():
    from torch import fx

    def scale_for_cpu(x):
        return x * 2

    g = fx.Graph()
    g.output(g.call_function(scale_for_cpu, (g.placeholder("x"),)))
    captured = type("C", (), {"gm": fx.GraphModule({}, g)})()
    with pytest.raises(CaptureError, match="scale_for_cpu.*CPU's dispatch"):
        capturing.Captured.gm_on(captured, "meta")


class _SiluRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return torch.nn.functional.silu(self.drop(torch.relu_(self.fc(x))))


def test_eager_capture_runs_what_loss_backward_runs():
    """`eager`: silu's backward is eager's one silu_backward (torch.func.grad's create_graph runs sigmoid, sub,
    mul...), relu_ stays in place, dropout(p=0) returns its input (no clone), and each autograd node's backward
    ends with an autograd.release op reading what it held; the default capture is unchanged."""
    model, x, t = _SiluRelu(), torch.randn(4, 8), torch.empty(())
    eager = capturing.capture(model, (x,), t, "sum", eager=True).graph
    default = capturing.capture(model, (x,), t, "sum").graph
    targets = [op.target for op in eager.ops]
    assert "aten.silu_backward.default" in targets and "aten.sigmoid.default" not in targets
    assert "aten.relu_.default" in targets and "aten.clone.default" not in targets
    default_targets = [op.target for op in default.ops]
    assert "aten.silu_backward.default" not in default_targets and "autograd.release" not in default_targets
    releases = [op for op in eager.ops if op.target == "autograd.release"]
    silu_bw = next(op for op in eager.ops if op.target == "aten.silu_backward.default")
    after = eager.ops[eager.ops.index(silu_bw) + 1]
    assert after.target == "autograd.release" and set(after.inputs) == set(silu_bw.inputs) and not after.outputs
    assert all(op.phase == "bwd" for op in releases)
