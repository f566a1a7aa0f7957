"""Policies run for real: same values bit for bit, and the predicted memory, on tiny models (CPU)."""
import random

import pytest
import torch
import torch.nn.functional as F

from gaswap import policy as policies
from gaswap import zoo
from gaswap.capture import capture, make_inputs
from gaswap.costs import estimate, load_profile
from gaswap.dropout import BERNOULLI_STRIDED
from gaswap.encoding import Action, Encoding
from gaswap.memory import DeviceMemory
from gaswap.runtime import ProgramError, StepRunner
from gaswap.simulator import Simulator
from tiny_models import MODELS, policy_set



def setup(name, batch=4):
    make, specs, target_spec = MODELS[name]
    torch.manual_seed(0)
    model = make()
    inputs, target = make_inputs(specs, target_spec, batch, device="cpu", generator=torch.Generator().manual_seed(1))
    cap = capture(model, inputs, target, "cross_entropy", optimizer="sgd_momentum")
    return model, inputs, target, cap


def policies_for(graph):
    """keep-all, swap-heavy, recompute-heavy, reordered and mixed: (name, order, actions)."""
    enc = Encoding(graph)
    shuffled = enc.random(random.Random(7))
    return policy_set(enc, shuffled, shuffled)


def fresh_args(cap, model, inputs, target):
    return cap.arguments(model, [x.clone() for x in inputs], target.clone())


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_every_policy_gives_the_same_values_and_the_predicted_peak(model_name):
    model, inputs, target, cap = setup(model_name)
    costs = estimate(cap.graph, load_profile("v100-pcie-16gb"))
    opt_state = [torch.zeros_like(p) for p in model.parameters()]  # momentum buffers, as the budget counts them
    torch.manual_seed(5)
    with torch.no_grad():
        expected = cap.gm(*fresh_args(cap, model, inputs, target))
    for name, (order, actions) in policies_for(cap.graph).items():
        sim = Simulator(cap.graph, costs).run(order, actions, trace=True)
        assert sim.valid, name
        runner = StepRunner(cap, sim.program)
        args = fresh_args(cap, model, inputs, target)
        torch.manual_seed(5)
        with DeviceMemory("cpu") as memory:
            memory.hold(args + opt_state)
            got = runner(args)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), name
        assert memory.peak == sim.peak_bytes, name


def train(step_fn, model, inputs, target, steps=3):
    """SGD with momentum, the step computing (loss, grads) from fresh argument lists."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for k in range(steps):
        torch.manual_seed(100 + k)
        _, *grads = step_fn()
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


@pytest.mark.parametrize("model_name", ["cnn", "gpt"])
def test_parameters_after_several_steps_are_bitwise_equal_to_the_unchanged_graph(model_name):
    model, inputs, target, cap = setup(model_name)
    costs = estimate(cap.graph, load_profile("v100-pcie-16gb"))
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def plain():
        with torch.no_grad():
            return cap.gm(*fresh_args(cap, model, inputs, target))

    reference = train(plain, model, inputs, target)
    for name, (order, actions) in policies_for(cap.graph).items():
        model.load_state_dict(state)
        runner = StepRunner(cap, Simulator(cap.graph, costs).run(order, actions, trace=True).program)
        trained = train(lambda: runner(fresh_args(cap, model, inputs, target)), model, inputs, target)
        assert all(torch.equal(a, b) for a, b in zip(reference, trained)), name


def test_the_captured_step_matches_eager_pytorch():
    torch.manual_seed(0)
    model = zoo.tiny_cnn(num_classes=10, width=8)  # BatchNorm and residual; dropout off (eager draws differently)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    inputs, target = make_inputs([{"shape": ["batch", 3, 16, 16]}], {"shape": ["batch"], "dtype": "int64", "high": 10},
                                 4, device="cpu", generator=torch.Generator().manual_seed(1))
    cap = capture(model, inputs, target, "cross_entropy")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    order, actions = policies_for(cap.graph)["mixed"]
    runner = StepRunner(cap, Simulator(cap.graph, estimate(cap.graph, load_profile("v100-pcie-16gb")))
                        .run(order, actions, trace=True).program)
    ours = train(lambda: runner(fresh_args(cap, model, inputs, target)), model, inputs, target)
    model.load_state_dict(state)

    def eager():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs[0]), target)
        loss.backward()
        return (loss, *[p.grad for p in model.parameters()])

    theirs = train(eager, model, inputs, target)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dropout_on_a_non_contiguous_tensor_draws_eagers_mask_under_every_policy():
    """A pre-norm TransformerEncoderLayer's residual dropout reads attention's transposed (non-contiguous)
    output: eager fills the mask in that layout. Loss and gradients under every policy equal eager's bit for bit."""
    model, inputs, target, cap = setup("encoder")
    assert any(n.target is BERNOULLI_STRIDED for n in cap.gm.graph.nodes)  # the draw that needs eager's layout
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs[0]), target)
    loss.backward()
    eager = (loss, *[p.grad for p in model.parameters()])
    costs = estimate(cap.graph, load_profile("v100-pcie-16gb"))
    for name, (order, actions) in policies_for(cap.graph).items():
        runner = StepRunner(cap, Simulator(cap.graph, costs).run(order, actions, trace=True).program)
        torch.manual_seed(5)
        got = runner(fresh_args(cap, model, inputs, target))
        assert len(got) == len(eager) and all(torch.equal(a, b) for a, b in zip(eager, got)), name


def test_a_policy_for_other_shapes_is_refused_saying_what_differs():
    _, _, _, small = setup("cnn", batch=4)
    _, _, _, big = setup("cnn", batch=8)
    enc = Encoding(small.graph)
    keep = enc.uniform(Action.KEEP)
    p = policies.from_result(small.graph, enc.candidates, enc.decode(keep.keys), keep.actions, {},
                             {"batch_size": 4, "torch_version": torch.__version__})
    with pytest.raises(policies.PolicyError, match="batch_size: policy 4, here 8"):
        policies.check_matches(p, big.graph, "p.yaml", provenance={"batch_size": 8, "torch_version": torch.__version__})


def test_a_program_that_misses_an_op_is_refused():
    _, _, _, cap = setup("mlp")
    program = [("run", op.name) for op in cap.graph.ops][1:]
    with pytest.raises(ProgramError, match="does not run every op"):
        StepRunner(cap, program)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_swaps_give_the_same_values_and_the_allocator_sees_the_predicted_peak():
    model, inputs, target, cap = setup("cnn", batch=64)
    model = model.cuda()
    inputs, target = [x.cuda() for x in inputs], target.cuda()
    costs = estimate(cap.graph, load_profile("v100-pcie-16gb"))
    opt_state = [torch.zeros_like(p) for p in model.parameters()]
    torch.manual_seed(5)
    with torch.no_grad():
        expected = cap.gm_on("cuda")(*fresh_args(cap, model, inputs, target))
    for name, (order, actions) in policies_for(cap.graph).items():
        sim = Simulator(cap.graph, costs).run(order, actions, trace=True)
        runner = StepRunner(cap, sim.program, "cuda")
        args = fresh_args(cap, model, inputs, target)
        torch.manual_seed(5)
        with DeviceMemory("cuda") as memory:
            got = runner(args)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), name
        # the allocator rounds blocks up (512 B) and convolutions take workspace: allow 5 %
        assert memory.peak <= 1.05 * sim.peak_bytes, name


def test_apply_trains_like_the_unchanged_step(tmp_path):
    import gaswap

    model, inputs, target, cap = setup("cnn")
    graph = cap.graph
    enc = Encoding(graph)
    order, actions = policies_for(graph)["mixed"]
    sim = Simulator(graph, estimate(graph, load_profile("v100-pcie-16gb"))).run(order, actions, trace=True)
    policies.save(policies.from_result(graph, enc.candidates, order, actions, {"peak_bytes": sim.peak_bytes},
                                       {"loss": "cross_entropy", "optimizer": "sgd_momentum"}, sim.program),
                  tmp_path / "policy.yaml")
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def plain():
        with torch.no_grad():
            return cap.gm(*fresh_args(cap, model, inputs, target))

    reference = train(plain, model, inputs, target)
    model.load_state_dict(state)
    step = gaswap.apply_step(model, tmp_path / "policy.yaml", inputs, target)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for k in range(3):  # the user's loop: the step replaces forward + backward
        torch.manual_seed(100 + k)
        step(inputs[0].clone(), target.clone())
        opt.step()
        opt.zero_grad()
    trained = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    assert all(torch.equal(a, b) for a, b in zip(reference, trained))
    with pytest.raises(policies.PolicyError, match="made for graph"):
        gaswap.apply_step(model, tmp_path / "policy.yaml", inputs[0][:2], target[:2])
