"""The module form of gaswap.apply: `criterion(module(x), y).backward()` under a policy searched with loss
"external" trains bit for bit like the unchanged captured step, like eager PyTorch up to rounding, and holds
the memory the simulator predicts (CPU, tiny models)."""
import json
import random

import pytest
import torch
import torch.nn.functional as F

import gaswap
from gaswap.app.cli import main
from gaswap.plan import policy as policies
from gaswap.plan.costs import estimate, load_profile
from gaswap.plan.encoding import Encoding
from gaswap.plan.policy import PolicyError
from gaswap.plan.simulator import Simulator
from gaswap.run.capture import capture, make_inputs
from gaswap.run.runtime import PolicyModule, ProgramError, StepRunner
from gaswap.run.step_memory import DeviceMemory
from tiny_models import MODELS as ALL_MODELS
from tiny_models import policy_set

MODELS = {name: ALL_MODELS[name] for name in ("cnn", "gpt")}  # BatchNorm, residual and dropout; a GPT with dropout


def criterion(out, target):
    """The user's loss, computed outside the policy's step."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def setup(name, batch=4, dropout=True):
    make, specs, target_spec = MODELS[name]
    torch.manual_seed(0)
    model = make()
    for m in model.modules() if not dropout else ():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    inputs, target = make_inputs(specs, target_spec, batch, device="cpu", generator=torch.Generator().manual_seed(1))
    return model, inputs, target, capture(model, inputs, None, "external", optimizer="sgd_momentum")


def policies_for(cap):
    """keep-all, swap-all, recompute-all, a random order with everything kept, and a random order with random
    actions (the first valid one a seeded generator draws): name -> (order, actions)."""
    enc, rng = Encoding(cap.graph), random.Random(7)
    shuffled = enc.random(rng)
    mixed = enc.random(rng)
    while not simulate(cap, enc.decode(mixed.keys), mixed.actions, check=False).valid:
        mixed = enc.random(rng)
    return policy_set(enc, shuffled, mixed)


def simulate(cap, order, actions, check=True):
    sim = Simulator(cap.graph, estimate(cap.graph, load_profile("v100-pcie-16gb"))).run(order, actions, trace=True)
    assert sim.valid or not check, sim.reason
    return sim


def output_like(cap) -> torch.Tensor:
    """Zeros shaped like the model's output (the traced gradient placeholder)."""
    (like,) = [n.meta["val"] for n in cap.gm.graph.nodes if n.name == "grad_output"]
    return torch.zeros(like.shape, dtype=like.dtype)


def train(model, step, steps=3):
    """SGD with momentum; `step()` fills the gradients. Returns the parameters and buffers afterwards."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for k in range(steps):
        torch.manual_seed(100 + k)  # the dropout masks of step k
        step()
        opt.step()
        opt.zero_grad()
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def unchanged_graph_step(cap, model, inputs, target):
    """One step of the captured graph as it is, from the gradient of `criterion` as eager autograd computes it.
    The graph runs twice with the same random numbers: on copies of the buffers to get the output, hence the
    gradient, then for real."""
    rng = torch.random.get_rng_state()
    args = cap.arguments(model, inputs, output_like(cap))
    probe = [a.clone() if kind == "buffer" else a for (_, kind, _), a in zip(cap.placeholders, args)]
    with torch.no_grad():
        out = cap.gm(*probe)[0]
    (grad_output,) = torch.autograd.grad(criterion(out.requires_grad_(), target), out)
    torch.random.set_rng_state(rng)
    with torch.no_grad():
        _, *grads = cap.gm(*cap.arguments(model, inputs, grad_output))
    for p, g in zip([p for p in model.parameters() if p.requires_grad], grads, strict=True):
        p.grad = g


@pytest.mark.slow
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_training_is_bitwise_equal_to_the_unchanged_graph(model_name):
    model, inputs, target, cap = setup(model_name)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reference = train(model, lambda: unchanged_graph_step(cap, model, inputs, target))
    assert not all(torch.equal(a, b) for a, b in zip(reference, state.values()))  # it trained
    for name, (order, actions) in policies_for(cap).items():
        model.load_state_dict(state)
        module = PolicyModule(model, cap, simulate(cap, order, actions).program)

        def step():
            loss = criterion(module(*[x.clone() for x in inputs]), target)  # the user's loop
            loss.backward()

        trained = train(model, step)
        assert all(torch.equal(a, b) for a, b in zip(reference, trained, strict=True)), name


@pytest.mark.slow
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_training_matches_eager_pytorch(model_name):
    model, inputs, target, cap = setup(model_name, dropout=False)  # eager draws dropout masks otherwise
    state = {k: v.clone() for k, v in model.state_dict().items()}
    order, actions = policies_for(cap)["mixed"]
    module = PolicyModule(model, cap, simulate(cap, order, actions).program)
    ours = train(model, lambda: criterion(module(*inputs), target).backward())
    model.load_state_dict(state)
    eager = train(model, lambda: criterion(model(*inputs), target).backward())
    for a, b in zip(ours, eager, strict=True):  # parameters and BatchNorm running statistics
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_the_module_step_holds_the_predicted_peak(model_name):
    """Device memory measured over `module(x).backward(grad_output)` equals the simulator's peak.

    Counted as the simulator counts them: the parameters, buffers, input batch and optimizer state, held
    before the step; the gradient of the output, which the simulator holds all step (so it is made before the
    step and handed to backward); and every tensor the step makes, the output included. A user's criterion
    runs outside the policy and is not simulated: its own tensors come on top, so this step has none.
    """
    model, inputs, _, cap = setup(model_name)
    opt_state = [torch.zeros_like(p) for p in model.parameters()]  # momentum buffers, as the budget counts them
    grad_output = torch.randn_like(output_like(cap))
    peaks = set()
    for name, (order, actions) in policies_for(cap).items():
        sim = simulate(cap, order, actions)
        module = PolicyModule(model, cap, sim.program)
        model.zero_grad(set_to_none=True)
        batch = [x.clone() for x in inputs]
        with DeviceMemory("cpu") as memory:
            memory.hold([*model.parameters(), *model.buffers(), *batch, grad_output, *opt_state])
            module(*batch).backward(grad_output)
        assert memory.peak == sim.peak_bytes, name
        assert all(p.grad is not None for p in model.parameters()), name
        peaks.add(sim.peak_bytes)
    assert len(peaks) > 1  # the policies differ in memory


def save_policy(tmp_path, cap, loss: str, autocast=None):
    """A policy file for the captured graph (the mixed policy), with `loss` (and `autocast`) in its provenance."""
    graph, enc = cap.graph, Encoding(cap.graph)
    order, actions = policies_for(cap)["mixed"]
    sim = simulate(cap, order, actions)
    path = tmp_path / f"{loss}.yaml"
    policies.save(policies.from_result(graph, enc.candidates, order, actions, {"peak_bytes": sim.peak_bytes},
                                       {"loss": loss, "optimizer": "sgd_momentum", "autocast": autocast}, sim.program),
                  path)
    return path


def test_apply_returns_the_model_as_a_drop_in_module(tmp_path):
    model, inputs, target, cap = setup("cnn")
    module = gaswap.apply(model, save_policy(tmp_path, cap, "external"), inputs)
    assert isinstance(module, PolicyModule) and module.fc is model.fc
    assert [id(p) for p in module.parameters()] == [id(p) for p in model.parameters()]
    assert list(module.state_dict()) == list(model.state_dict())  # checkpoints load with or without the policy
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    criterion(module(*inputs), target).backward()
    torch.optim.SGD(module.parameters(), lr=0.1).step()
    module.load_state_dict(saved)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    module.eval()
    assert not model.training
    torch.testing.assert_close(module(*inputs), model(*inputs), rtol=0, atol=0)  # the plain model, in eval mode
    module.train()
    assert model.training
    with torch.no_grad():  # the plain model, which takes any batch size
        assert module(inputs[0][:2]).shape == (2, 10)


def test_a_policy_whose_step_includes_the_loss_is_refused_naming_apply_step(tmp_path):
    model, inputs, target, external = setup("cnn")
    with_loss = save_policy(tmp_path, capture(model, inputs, target, "cross_entropy"), "cross_entropy")
    with pytest.raises(PolicyError, match=r"the policy's step includes the loss \(cross_entropy\), so it cannot run "
                                          r"as a module; use gaswap.apply_step\(model, policy, inputs, target\)"):
        gaswap.apply(model, with_loss, inputs)
    with pytest.raises(PolicyError, match=r"searched with `loss: external`.*use gaswap.apply\(model, policy, inputs\)"):
        gaswap.apply_step(model, save_policy(tmp_path, external, "external"), inputs, target)


def test_a_module_wrapped_before_its_model_moves_runs_where_the_parameters_are(tmp_path):
    """Wrapped while the model is on the meta device (as `apply` then `.cuda()` would be), the module runs on
    the CPU once the model is there, bit for bit as one wrapped there; a batch on another device is refused."""
    model, inputs, target, cap = setup("cnn")
    path = save_policy(tmp_path, cap, "external")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    here = gaswap.apply(model, path, inputs)
    reference = train(model, lambda: criterion(here(*inputs), target).backward())
    with torch.device("meta"):
        moved = MODELS["cnn"][0]()
    module = gaswap.apply(moved, path, [x.to("meta") for x in inputs])
    moved.to_empty(device="cpu")
    moved.load_state_dict(state)
    trained = train(moved, lambda: criterion(module(*inputs), target).backward())
    assert all(torch.equal(a, b) for a, b in zip(reference, trained, strict=True))
    with pytest.raises(PolicyError, match=r"input 0 is on meta, but the model's parameters are on cpu: move the "
                                          r"batch to cpu"):
        module(inputs[0].to("meta"))


def test_other_shapes_are_refused_saying_which(tmp_path):
    model, inputs, _, cap = setup("cnn")
    path = save_policy(tmp_path, cap, "external")
    with pytest.raises(PolicyError, match="made for graph"):
        gaswap.apply(model, path, inputs[0][:2])
    module = gaswap.apply(model, path, inputs)
    with pytest.raises(PolicyError, match=r"input 0 has shape \(2, 3, 16, 16\) and dtype torch.float32, but the "
                                          r"policy was searched for shape \(4, 3, 16, 16\) and dtype torch.float32"):
        module(inputs[0][:2])
    with pytest.raises(PolicyError, match="dtype torch.float64, but"):
        module(inputs[0].double())
    with pytest.raises(PolicyError, match="searched for 1 input"):
        module(*inputs, inputs[0])


def test_backward_twice_through_one_step_is_refused():
    model, inputs, target, cap = setup("cnn")
    order, actions = policies_for(cap)["keep"]
    loss = criterion(PolicyModule(model, cap, simulate(cap, order, actions).program)(*inputs), target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time"):
        loss.backward()


def test_a_program_reading_the_output_gradient_before_the_forward_ends_is_refused():
    _, _, _, cap = setup("cnn")
    order, actions = policies_for(cap)["keep"]
    program = simulate(cap, order, actions).program
    reader = next(op.name for op in cap.graph.ops if "grad_output" in op.inputs)
    with pytest.raises(ProgramError, match=f"runs {reader}, which reads the gradient of the output, before"):
        StepRunner(cap, [("run", reader)] + [s for s in program if s != ("run", reader)])


def test_validate_runs_an_external_loss_policy(tmp_path, capsys):
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("model: {factory: gaswap.zoo:tiny_cnn, kwargs: {width: 4}}\n"
                          "inputs: [{shape: [batch, 3, 8, 8]}]\nloss: external\nbatch_size: 4\n"
                          "optimizer: sgd_momentum\nbudget: 1.0x\ncosts: {source: estimate, profile: v100-pcie-16gb}\n"
                          "ga: {population: 8, generations: 3}\n")
    assert main(["search", str(experiment), "--results", str(tmp_path / "results")]) == 0
    policy = tmp_path / "results/exp/policy.yaml"
    assert main(["validate", str(policy), "--steps", "3", "--device", "cpu"]) == 0
    report = json.loads(policy.with_name("validation.json").read_text())
    assert report["measured"]["peak_bytes"] == report["predicted"]["peak_bytes"]
    assert report["loss"] is None


def test_an_output_dropped_without_backward_releases_the_step():
    model, inputs, _, cap = setup("cnn")
    order, actions = policies_for(cap)["keep"]
    module = PolicyModule(model, cap, simulate(cap, order, actions).program)
    with DeviceMemory("cpu") as memory:
        memory.hold([*model.parameters(), *model.buffers(), *inputs])
        before = memory.current()
        out = module(*inputs)
        assert memory.current() > before  # the activations the backward would read
        del out
        assert memory.current() == before


def test_autocast_around_the_module_must_match_the_policys(tmp_path):
    """The casts of mixed precision are ops of the searched graph: a policy searched without autocast is
    refused under torch.autocast, and one searched with bfloat16 gives the same values whether or not the
    caller wraps it in autocast(bfloat16)."""
    model, inputs, target, cap = setup("cnn", dropout=False)
    plain = gaswap.apply(model, save_policy(tmp_path, cap, "external"), inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            PolicyError, match=r"called under torch.autocast\(bfloat16\), but the policy was searched without autocast"):
        plain(*inputs)

    mixed_cap = capture(model, inputs, None, "external", optimizer="sgd_momentum", autocast="bfloat16")
    path = save_policy(tmp_path / "mixed", mixed_cap, "external", autocast="bfloat16")
    mixed = gaswap.apply(model, path, inputs)
    outside = mixed(*inputs)  # forward only: BatchNorm statistics (updated in the backward part) stay put
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = mixed(*inputs)
    assert outside.dtype == torch.bfloat16 and torch.equal(inside, outside)
