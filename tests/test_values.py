"""Forward passes that read tensor values (gaswap.run.values): specialized on the example inputs as torch.compile
does, the values in the graph's fingerprint and the policy, and a batch giving other values refused."""
import random

import pytest
import torch
from torch import nn

from gaswap.app import workflow
from gaswap.base import config
from gaswap.base.errors import REFUSED
from gaswap.plan import policy as policies
from gaswap.plan.costs import estimate, load_profile
from gaswap.plan.encoding import Encoding
from gaswap.plan.graph import Graph
from gaswap.plan.simulator import Simulator
from gaswap.run.capture import ValuesNeeded, capture
from gaswap.run.experiment import make_inputs
from gaswap.run.runtime import StepRunner
from gaswap.run.values import ValueMismatch
from tiny_models import policy_set

READ = "aten._local_scalar_dense.default"
T = torch.zeros(())  # the target loss "sum" ignores


class Padded(nn.Module):
    """Skips its mask when the mask masks nothing (`if mask.all()`: a value read), as transformers' BERT does."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, mask):
        h = torch.tanh(self.inner(x))
        if not mask.all():
            h = h.masked_fill(~mask.unsqueeze(-1), 0.0)
        return self.head(h)


class Scaled(nn.Module):
    """Multiplies by a count read from an input: the value is an op argument, the graph's shape the same."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x, n):
        return torch.tanh(self.inner(x)) * n.sum().item()


class WeightGated(nn.Module):
    """Branches on a value computed from a parameter."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x):
        h = self.inner(x)
        return torch.tanh(h) if self.inner.weight.sum() > 0 else torch.sigmoid(h)


class Positions(nn.Module):
    """Reads a value computed from `arange` alone (as transformers' packed-sequence check does)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x):
        positions = torch.arange(x.shape[0])
        return self.inner(x) if bool((positions[1:] - positions[:-1] == 1).all()) else x


def _padded(mask_all: bool):
    torch.manual_seed(0)
    model = Padded()
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 5, dtype=torch.bool)
    if not mask_all:
        mask[1, 3:] = False
    return model, (x, mask)


def _eager(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(*inputs).sum()
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


def test_a_value_read_is_specialized_on_the_example_and_the_step_is_eagers_bit_for_bit():
    for mask_all in (False, True):
        model, inputs = _padded(mask_all)
        c = capture(model, inputs, T)
        assert c.graph.specialized == ((READ, "all_1 in the top-level forward of Padded", mask_all),)
        got = c.gm(*c.arguments(model, inputs, T))
        assert all(torch.equal(a, b) for a, b in zip(got, _eager(model, inputs), strict=True))
    masked, unmasked = (capture(*_padded(m), T).graph for m in (False, True))
    assert len(masked.ops) > len(unmasked.ops)  # the masking ops are traced down one branch only
    assert masked.fingerprint() != unmasked.fingerprint()


def test_a_value_computed_from_no_argument_is_answered_and_not_recorded():
    torch.manual_seed(0)
    model, x = Positions(), torch.randn(3, 6)
    c = capture(model, (x,), T)
    assert c.graph.specialized == () and c.specialized == ()
    assert any(op.target == "aten.addmm.default" for op in c.graph.ops)  # the branch the value picked
    got = c.gm(*c.arguments(model, (x,), T))
    assert all(torch.equal(a, b) for a, b in zip(got, _eager(model, (x,)), strict=True))


def test_a_batch_giving_another_value_is_refused_naming_the_op_and_the_values():
    model, inputs = _padded(mask_all=False)
    c = capture(model, inputs, T)
    other = inputs[1].clone()
    other[0, 1] = False  # masks elsewhere: the same branch, accepted
    c.arguments(model, (inputs[0], other), T)
    with pytest.raises(ValueMismatch, match=rf"gives True where the step was captured with False: op {READ}") as err:
        c.arguments(model, (inputs[0], torch.ones_like(other)), T)
    assert err.value.exit_code == REFUSED


def test_the_value_is_in_the_fingerprint_where_the_ops_are_the_same():
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(2, 6)
    two, three = (capture(model, (x, torch.tensor([1, k])), T) for k in (1, 2))
    assert [op.name for op in two.graph.ops] == [op.name for op in three.graph.ops]
    assert two.graph.fingerprint() != three.graph.fingerprint()
    assert (two.graph.specialized[0][2], three.graph.specialized[0][2]) == (2, 3)
    got = three.gm(*three.arguments(model, (x, torch.tensor([1, 2])), T))
    assert all(torch.equal(a, b) for a, b in zip(got, _eager(model, (x, torch.tensor([1, 2]))), strict=True))
    with pytest.raises(ValueMismatch, match="gives 3 where the step was captured with 2"):
        two.arguments(model, (x, torch.tensor([0, 3])), T)


def test_a_value_read_from_parameters_or_inputs_without_values_is_refused_naming_them():
    torch.manual_seed(0)
    real = WeightGated()
    c = capture(real, (torch.randn(2, 6),), T)
    assert c.graph.specialized[0][2] == bool(real.inner.weight.sum() > 0)
    with torch.device("meta"):
        meta = WeightGated()
    with pytest.raises(ValuesNeeded, match=rf"op {READ} reads the value of .* computed from inner.weight"):
        capture(meta, (torch.randn(2, 6),), T)
    model, (x, mask) = _padded(mask_all=False)
    with pytest.raises(ValuesNeeded, match="computed from input 1, which has no values"):
        capture(model, (x, mask.to("meta")), T)


def test_a_meta_model_with_real_inputs_gives_the_real_models_graph():
    model, inputs = _padded(mask_all=False)
    with torch.device("meta"):
        meta = Padded()
    assert capture(meta, inputs, T).graph.fingerprint() == capture(model, inputs, T).graph.fingerprint()


def test_a_policy_records_the_values_and_is_refused_for_a_step_reading_others(tmp_path):
    masked, unmasked = (capture(*_padded(m), T).graph for m in (False, True))
    policy = policies.from_result(masked, masked.candidates(), list(range(len(masked.ops))),
                                  [0] * len(masked.candidates()), {"peak_bytes": 1, "step_time_s": 1}, {})
    policies.save(policy, tmp_path / "p.yaml")
    loaded = policies.load(tmp_path / "p.yaml")
    assert loaded.provenance["specialized"] == [[READ, "all_1 in the top-level forward of Padded", False]]
    with pytest.raises(policies.PolicyError, match=rf"op {READ} read False from all_1 .*; this model and inputs "
                                                   r"give True") as err:
        policies.check_matches(loaded, unmasked, tmp_path / "p.yaml")
    assert err.value.exit_code == REFUSED


def test_a_search_captures_with_the_experiments_seeded_inputs_when_the_forward_reads_them(tmp_path):
    (tmp_path / "padded.py").write_text("import torch\nfrom torch import nn\n\n\nclass Padded(nn.Module):\n"
                                        "    def __init__(self):\n        super().__init__()\n"
                                        "        self.inner = nn.Linear(6, 6)\n\n"
                                        "    def forward(self, x, mask):\n        h = self.inner(x)\n"
                                        "        return h if mask.all() else h.masked_fill(~mask.unsqueeze(-1), 0.0)\n")
    (tmp_path / "padded.yaml").write_text(
        "model: {factory: 'padded:Padded'}\ninputs: [{shape: [batch, 5, 6]}, {shape: [batch, 5], dtype: bool}]\n"
        "batch_size: 2\nbudget: 0.9x\ncosts: {source: estimate, profile: v100-pcie-16gb}\n")
    captured = workflow.capture_step(config.load_experiment(tmp_path / "padded.yaml"))
    (read,) = captured.graph.specialized
    # the value validate's batch gives: the experiment's inputs made on the CPU from its seed
    exp = config.load_experiment(tmp_path / "padded.yaml")
    (_, mask), _ = make_inputs(exp, "cpu", torch.Generator().manual_seed(exp.seed))
    assert read[0] == READ and read[2] == bool(mask.all())


def test_specialized_values_survive_the_plain_data_round_trip():
    g = capture(*_padded(mask_all=False), T).graph
    again = Graph.from_dict(g.to_dict())
    assert again.specialized == g.specialized and again.fingerprint() == g.fingerprint()


def test_every_policy_runs_a_specialized_step_bit_for_bit_and_checks_each_batch():
    model, inputs = _padded(mask_all=False)
    c = capture(model, inputs, T)
    costs = estimate(c.graph, load_profile("v100-pcie-16gb"))
    encoding = Encoding(c.graph)
    shuffled = encoding.random(random.Random(3))
    expected = _eager(model, inputs)
    for name, (order, actions) in policy_set(encoding, shuffled, shuffled).items():
        runner = StepRunner(c, Simulator(c.graph, costs).run(order, actions, trace=True).program)
        got = runner(c.arguments(model, [x.clone() for x in inputs], T))
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), name
