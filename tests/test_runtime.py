"""Policies run for real: same values bit for bit, and the predicted memory, on tiny models (CPU)."""
import random
import sys

import pytest
import torch
import torch.nn.functional as F
from tiny_models import MODELS, policy_set

from gaswap import zoo
from gaswap.base.program import Instruction, Verb
from gaswap.plan import policy as policies
from gaswap.plan.costs import estimate, load_profile
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.simulator import Simulator
from gaswap.run import workspace
from gaswap.run.capture import capture, make_inputs
from gaswap.run.dropout import BERNOULLI_STRIDED
from gaswap.run.runtime import HOST_ALIGNMENT, Codegen, ProgramError, StepRunner
from gaswap.run.step_memory import DeviceMemory
from gaswap.run.streams import LaggingStreams, StreamRace


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


def program_for(cap, name):
    """The program of one policy of `policies_for` (v100 estimates)."""
    order, actions = policies_for(cap.graph)[name]
    costs = estimate(cap.graph, load_profile("v100-pcie-16gb"))
    return Simulator(cap.graph, costs).run(order, actions, trace=True).program


def plain_step(cap, model, inputs, target):
    torch.manual_seed(5)
    with torch.no_grad():
        return cap.gm(*fresh_args(cap, model, inputs, target))


@pytest.mark.parametrize("model_name", ["cnn", "gpt"])
def test_copies_that_lag_as_far_as_cuda_lets_them_give_the_same_values(model_name):
    """Through the lagging stand-in for CUDA streams a copy runs only when a wait forces it: every wait the
    runtime needs must be there for the values to come out right (two steps: the host arena is reused)."""
    model, inputs, target, cap = setup(model_name)
    expected = plain_step(cap, model, inputs, target)
    for name in ("swap", "mixed"):
        for prompt in ((), ("h2d",), ("d2h",)):  # schedules CUDA may choose
            runner = StepRunner(cap, program_for(cap, name), streams=LaggingStreams(prompt))
            for _ in range(2):
                torch.manual_seed(5)
                got = runner(fresh_args(cap, model, inputs, target))
                assert all(torch.equal(a, b) for a, b in zip(expected, got)), (name, prompt)


class _Dropping(LaggingStreams):
    """The stand-in with one of the runtime's waits planted out: the wait `caller` (a method of `_Copies`) makes
    of stream `waiter` for stream `waited`."""

    def __init__(self, caller, waiter, waited, prompt=()):
        super().__init__(prompt)
        self.dropped, self.dropped_count = (caller, waiter, waited), 0

    def wait_stream(self, stream, other):
        if not self._drop(stream, other):
            super().wait_stream(stream, other)

    def wait_event(self, stream, event):
        if not self._drop(stream, event.stream):
            super().wait_event(stream, event)

    def _drop(self, stream, source) -> bool:
        caller = sys._getframe(2).f_code.co_name
        drop = (caller, stream.name, source.name) == self.dropped
        self.dropped_count += drop
        return drop


def _codegen_skips_the_wait(hook):
    """Plant a missing `wait_for` in the generated code: before an op reads a swap-in ("on_run"), or before an
    unread swap-in is freed ("on_free")."""
    def plant(monkeypatch):
        original = getattr(Codegen, hook)

        def planted(self, k, first, *rest):
            names = first.inputs if hook == "on_run" else [first] if not rest[0] else []
            self.pending.difference_update(names)
            monkeypatch.setattr(Codegen, "planted", getattr(Codegen, "planted", 0) + len(names), raising=False)
            return original(self, k, first, *rest)
        monkeypatch.setattr(Codegen, hook, planted)
    return plant


def crafted(cap, shape):
    """The "swap" program, changed so that a wait the simulator's programs never need alone is needed: "swap" as
    it is; "unread swap-in": its first swap-in freed unread, then swapped in again; "ends copying out" / "ends
    copying in": a gradient the step returns copied to the host at the end (and back)."""
    program = list(program_for(cap, "swap"))
    if shape == "unread swap-in":
        k, name = next((k, name) for k, (verb, name) in enumerate(program) if verb == Verb.SWAP_IN)
        program[k + 1:k + 1] = [Instruction(Verb.FREE, name), Instruction(Verb.SWAP_IN, name)]
    elif shape != "swap":
        grad = next(n.name for n in cap.gm.graph.output_node().args[0][1:] if n.name in cap.graph.tensors)
        verbs = [Verb.SWAP_OUT] + ([Verb.RETIRE, Verb.FREE, Verb.SWAP_IN] if shape == "ends copying in" else [])
        program += [Instruction(verb, grad) for verb in verbs]
    return program


MISSING_WAITS = {  # a wait of the runtime -> the stand-in without it (or a plant in the generated code), the program
    "d2h waits for compute before copying to the host": (("to_host", "d2h", "compute"), "swap"),
    "h2d waits for compute before copying back": (("to_device", "h2d", "compute"), "swap"),
    "h2d waits for the copy to the host": (("to_device", "h2d", "d2h"), "swap"),
    "compute waits for the copy to the host before a free": (("release", "compute", "d2h"), "swap"),
    "compute waits for a copy back before reading it": (_codegen_skips_the_wait("on_run"), "swap"),
    "compute waits for a copy back before freeing it unread": (_codegen_skips_the_wait("on_free"), "unread swap-in"),
    "the step's end waits for the copies to the host": (("finish", "compute", "d2h"), "ends copying out"),
    "the step's end waits for the copies back": (("finish", "compute", "h2d"), "ends copying in"),
}


@pytest.mark.parametrize("model_name", ["cnn", "gpt"])
@pytest.mark.parametrize("defect", sorted(MISSING_WAITS))
def test_the_lagging_streams_catch_each_missing_wait(defect, model_name, monkeypatch):
    """Each wait of the runtime planted out, one at a time: the stand-in names the race under every schedule;
    with the wait, the same program gives the plain step's values under every schedule."""
    model, inputs, target, cap = setup(model_name)
    plant, shape = MISSING_WAITS[defect]
    program = crafted(cap, shape)
    expected = plain_step(cap, model, inputs, target)
    for prompt in ((), ("h2d",), ("d2h",), ("d2h", "h2d")):
        torch.manual_seed(5)
        got = StepRunner(cap, program, streams=LaggingStreams(prompt))(fresh_args(cap, model, inputs, target))
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), prompt
    if callable(plant):
        plant(monkeypatch)
    for prompt in ((), ("h2d",), ("d2h",), ("d2h", "h2d")):
        streams = LaggingStreams(prompt) if callable(plant) else _Dropping(*plant, prompt=prompt)
        runner = StepRunner(cap, program, streams=streams)
        with pytest.raises(StreamRace):
            runner(fresh_args(cap, model, inputs, target))
        assert getattr(streams, "dropped_count", getattr(Codegen, "planted", 1)) > 0


def test_the_stand_in_catches_a_copy_into_memory_compute_may_still_read():
    """A swap-in lands in memory an op queued before it still reads (on a GPU: the block of a tensor just
    freed): the copy stream must wait for compute first. Also compute freeing a copy's destination before
    waiting for it, and compute overwriting a tensor the copy to the host still reads."""
    streams, host = LaggingStreams(), torch.arange(4.0)
    with pytest.raises(StreamRace, match="writes memory compute's op"), streams.running(done=False):
        slot = torch.zeros(4)
        _ = slot + 1  # compute reads the slot
        streams.copy(streams.h2d, slot, host)  # no wait for compute
    streams = LaggingStreams()
    with pytest.raises(StreamRace, match="freed memory the h2d copy"), streams.running(done=False):
        dst = torch.empty(4)
        streams.wait_stream(streams.h2d, streams.compute())
        streams.copy(streams.h2d, dst, host)
        del dst
        _ = host + 1
    streams, src, buffer = LaggingStreams(), torch.ones(4), torch.empty(4)
    with pytest.raises(StreamRace, match=r"compute's op #\d+ \(aten.mul_.Tensor\) writes memory the d2h copy"), \
            streams.running(done=False):
        streams.wait_stream(streams.d2h, streams.compute())
        streams.copy(streams.d2h, buffer, src)
        src.mul_(2)
    streams = LaggingStreams()  # the same, ordered: no race, and the copy has the values before the write
    with streams.running(done=True):
        src = torch.ones(4)
        streams.wait_stream(streams.d2h, streams.compute())
        streams.copy(streams.d2h, buffer, src)
        streams.wait_stream(streams.compute(), streams.d2h)
        src.mul_(2)
    assert torch.equal(buffer, torch.ones(4))


def test_a_non_dense_input_is_swapped_and_comes_back_in_its_layout():
    """`tokens[:, :-1]` as the input, swapped out and back: the host buffer is contiguous, the device copy
    gets the input's strides again (the same code on every device)."""
    make, _, _ = MODELS["gpt"]
    torch.manual_seed(0)
    model = make()
    tokens = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(1))
    inputs, target = (tokens[:, :-1],), tokens[:, 1:]
    cap = capture(model, inputs, target, "cross_entropy", optimizer="sgd_momentum")
    program = program_for(cap, "swap")
    assert ("swap_out", "input_0") in program and not inputs[0].is_contiguous()
    expected = plain_step(cap, model, inputs, target)
    for streams in (None, LaggingStreams()):
        torch.manual_seed(5)
        fresh = tokens.clone()
        got = StepRunner(cap, program, streams=streams)(cap.arguments(model, [fresh[:, :-1]], fresh[:, 1:]))
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_runner_copies_into_one_host_arena_sized_from_its_program():
    model, inputs, target, cap = setup("cnn")
    program = program_for(cap, "swap")
    runner = StepRunner(cap, program)
    swapped = {name for verb, name in program if verb == "swap_out"}
    assert set(runner.host) == swapped
    (arena,) = {b.untyped_storage().data_ptr() for b in runner.host.values()}
    size = -(-max(b.data_ptr() - arena + b.nbytes for b in runner.host.values()) // HOST_ALIGNMENT) * HOST_ALIGNMENT
    assert size == sum(-(-cap.graph.tensors[name].size // HOST_ALIGNMENT) * HOST_ALIGNMENT for name in swapped)
    where = {name: b.data_ptr() for name, b in runner.host.items()}
    for _ in range(2):
        with DeviceMemory("cpu") as memory:
            runner(fresh_args(cap, model, inputs, target))
        assert memory.host_bytes() == next(iter(runner.host.values())).untyped_storage().nbytes()  # the arena alone
    assert where == {name: b.data_ptr() for name, b in runner.host.items()}


def test_apply_step_runs_with_autocast_off_and_refuses_another_autocast(tmp_path, monkeypatch):
    """A policy's casts are ops of its graph: under torch.autocast of the policy's dtype the step runs with
    autocast off and gives the values it gives outside; under another autocast it is refused. (On the CPU,
    autocast applied again to a graph captured under it would change nothing, its ops having their dtypes
    already; CUDA's op lists differ from the CPU's the graph was captured with, hence the check of the state.)"""
    import gaswap

    autocast_seen = []
    call = StepRunner.__call__
    monkeypatch.setattr(StepRunner, "__call__", lambda self, args: (
        autocast_seen.append(torch.is_autocast_enabled("cpu")), call(self, args))[1])
    model, inputs, target, cap = setup("cnn")
    plain = gaswap.apply_step(model, save_policy(tmp_path / "plain", cap, None), inputs, target)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            policies.PolicyError, match=r"called under torch.autocast\(bfloat16\), but the policy was searched without"):
        plain(inputs[0].clone(), target.clone())
    mixed_cap = capture(model, inputs, target, "cross_entropy", optimizer="sgd_momentum", autocast="bfloat16")
    step = gaswap.apply_step(model, save_policy(tmp_path / "mixed", mixed_cap, "bfloat16"), inputs, target)
    results = []
    for context in (torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with context:
            loss = step(inputs[0].clone(), target.clone())
        results.append([loss, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert autocast_seen == [False, False]


def save_policy(directory, cap, autocast):
    """The mixed policy of `cap` (loss cross-entropy) as a policy file in `directory`."""
    enc = Encoding(cap.graph)
    order, actions = policies_for(cap.graph)["mixed"]
    sim = Simulator(cap.graph, estimate(cap.graph, load_profile("v100-pcie-16gb"))).run(order, actions, trace=True)
    directory.mkdir(parents=True, exist_ok=True)
    policies.save(policies.from_result(cap.graph, enc.candidates, order, actions, {"peak_bytes": sim.peak_bytes},
                                       {"loss": "cross_entropy", "optimizer": "sgd_momentum", "autocast": autocast},
                                       sim.program), directory / "policy.yaml")
    return directory / "policy.yaml"


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


@pytest.fixture
def deterministic():
    """Deterministic algorithms for a bitwise CUDA test (cuBLAS's workspace is set in conftest.py); ops with
    no deterministic CUDA kernel (adaptive average pooling's backward) warn instead of failing."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_swaps_give_the_same_values_and_the_allocator_sees_the_predicted_peak(deterministic):
    model, inputs, target, cap = setup("cnn", batch=64)
    model = model.cuda()
    inputs, target = [x.cuda() for x in inputs], target.cuda()
    costs = estimate(cap.graph, load_profile("v100-pcie-16gb"))
    opt_state = [torch.zeros_like(p) for p in model.parameters()]
    torch.manual_seed(5)
    with torch.no_grad():
        expected = cap.gm_on("cuda")(*fresh_args(cap, model, inputs, target))
    # the tolerance is the margin a search keeps (workspace.margin, docs/gpu_memory.md) less cuBLAS's workspace: the
    # meter counts requested bytes (no rounding) above a baseline taken after the workspace is made, so only an
    # op's transients (cuDNN's workspaces) come on top of the simulator's peak; at most one runs at a time. The run
    # is not capped, so a convolution takes the workspace it prefers with memory to spare (least=False)
    margin = max(workspace.op_transients(cap.graph, "cuda", least=False).values(), default=0)
    for name, (order, actions) in policies_for(cap.graph).items():
        sim = Simulator(cap.graph, costs).run(order, actions, trace=True)
        runner = StepRunner(cap, sim.program, "cuda")
        args = fresh_args(cap, model, inputs, target)
        torch.manual_seed(5)
        with DeviceMemory("cuda") as memory:
            got = runner(args)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), name
        assert memory.peak <= sim.peak_bytes + margin, (name, memory.peak, sim.peak_bytes, margin)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runs_a_policy_from_one_device_arena_with_the_plain_runtimes_values(deterministic):
    """gaswap.run.arena_runtime on CUDA: the activations (and here the gradients) in one device buffer the size of
    the plan, swap-ins landing in it through the copy streams; bitwise the plain runtime's results."""
    from gaswap.run.arena_runtime import ArenaRunner

    for model_name in ("cnn", "gpt"):
        model, inputs, target, cap = setup(model_name, batch=16)
        model = model.cuda()
        inputs, target = [x.cuda() for x in inputs], target.cuda()
        costs = estimate(cap.graph, load_profile("v100-pcie-16gb"))
        for name, (order, actions) in policies_for(cap.graph).items():
            program = Simulator(cap.graph, costs).run(order, actions, trace=True).program
            arena = ArenaRunner(cap, program, "cuda", results_in_arena=True)
            assert arena.buffer.is_cuda and arena.buffer.numel() == arena.plan.size, (model_name, name)
            results = []
            for runner in (StepRunner(cap, program, "cuda"), arena, arena):  # the arena reused by a second step
                torch.manual_seed(5)
                results.append([t.clone() for t in runner(fresh_args(cap, model, inputs, target))])
            for got in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(results[0], got)), (model_name, name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_runner_makes_its_copy_streams_once_on_its_device_and_pins_one_arena(deterministic):
    model, inputs, target, cap = setup("cnn")
    model = model.cuda()
    inputs, target = [x.cuda() for x in inputs], target.cuda()
    runner = StepRunner(cap, program_for(cap, "swap"), "cuda")
    streams = (runner.streams.d2h, runner.streams.h2d)
    expected = None
    for _ in range(2):
        torch.manual_seed(5)
        got = runner(fresh_args(cap, model, inputs, target))
        assert expected is None or all(torch.equal(a, b) for a, b in zip(expected, got))
        expected = got
    assert (runner.streams.d2h, runner.streams.h2d) == streams
    assert all(s.device == runner.device for s in streams)
    assert all(b.is_pinned() for b in runner.host.values())


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


def test_a_tensor_retired_twice_keeps_both_device_copies_until_their_frees():
    """Over a slow link, a recompute re-makes a swapped tensor (another output of its op) while the first device
    copy still waits for its copy to the host: the program retires it twice and frees it twice. Both copies are
    held until their frees (the runtime refused such a program before, and the allocator replay lost a copy), and
    the policy check accepts it."""
    import collections

    from gaswap.plan.costs import Costs
    from gaswap.plan.memory import allocator

    model, inputs, target, cap = setup("gpt")
    slow_link = Costs(dict.fromkeys((op.name for op in cap.graph.ops), 1e-3), 1e5, 1e5, "any", "any")
    enc = Encoding(cap.graph)
    c = enc.random(random.Random(59))
    sim = Simulator(cap.graph, slow_link).run(enc.decode(c.keys), c.actions, trace=True)
    retires = collections.Counter(name for verb, name in sim.program if verb.value == "retire")
    assert sim.valid and max(retires.values()) == 2
    assert allocator.replay(cap.graph, sim).requested == sim.peak_bytes
    made = policies.from_result(cap.graph, enc.candidates, enc.decode(c.keys), c.actions,
                                {"peak_bytes": sim.peak_bytes, "step_time_s": sim.step_time}, {}, sim.program)
    policies.check_content(made, cap.graph)  # the policy check refused it before (it counted one retired copy)
    expected = plain_step(cap, model, inputs, target)
    for prompt in ((), ("h2d",), ("d2h",)):
        runner = StepRunner(cap, sim.program, streams=LaggingStreams(prompt))
        torch.manual_seed(5)
        got = runner(fresh_args(cap, model, inputs, target))
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), prompt


def test_the_peak_meter_is_not_lowered_by_garbage_of_an_earlier_metered_block():
    """Cyclic garbage holding a tensor allocated under an earlier meter, collected mid-block, would take its bytes
    off the running total (the allocator knows their size): the meter collects before it starts."""
    import gc

    from gaswap.run.peak_meter import PeakMeter

    class Node:
        pass

    enabled = gc.isenabled()
    gc.disable()
    try:
        with PeakMeter("cpu"):
            node = Node()
            node.tensor, node.itself = torch.ones(100_000), node
        del node  # garbage now, freed only by the collector
        with PeakMeter("cpu") as meter:
            gc.collect()  # as the collector may run in the middle of a step
            made = torch.ones(200_000)
        assert meter.peak == made.nbytes
    finally:
        if enabled:
            gc.enable()
