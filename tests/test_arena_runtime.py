"""A policy run from one preallocated arena (gaswap.run.arena_runtime): the same values bit for bit as the plain
runtime, the arena the size of its plan, and what is allocated outside it measured (CPU, tiny models)."""
import pytest
import torch
from test_runtime import _Dropping, fresh_args, policies_for, setup, train

from gaswap.plan.costs import estimate, load_profile
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.simulator import Simulator
from gaswap.run.arena_runtime import ArenaRunner, OutsideArena, arena_figures, out_variant
from gaswap.run.capture import capture, make_inputs
from gaswap.run.runtime import StepRunner
from gaswap.run.step_memory import DeviceMemory
from gaswap.run.streams import LaggingStreams, StreamRace
from tiny_models import MODELS


def programs(cap):
    costs = estimate(cap.graph, load_profile("v100-pcie-16gb"))
    for name, (order, actions) in policies_for(cap.graph).items():
        yield name, Simulator(cap.graph, costs).run(order, actions, trace=True).program


def run(runner, cap, model, inputs, target):
    torch.manual_seed(5)
    return runner(fresh_args(cap, model, inputs, target))


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_an_arena_runner_gives_the_plain_runtimes_values_from_one_buffer_the_size_of_its_plan(model_name):
    model, inputs, target, cap = setup(model_name)
    for name, program in programs(cap):
        expected = run(StepRunner(cap, program), cap, model, inputs, target)
        runner = ArenaRunner(cap, program)
        runner.plan.check()
        assert runner.buffer.numel() == runner.plan.size > 0, name
        assert runner.plan.lower_bound <= runner.plan.size, name
        start = runner.buffer.data_ptr()
        for (k, tensor), slot in runner.slots.items():  # every slot is a view of the buffer at its planned offset
            assert slot.untyped_storage().data_ptr() == start, (name, tensor)
        placed = {p.tensor for p in runner.plan.placements}
        assert placed and not placed & runner._returned(), name  # what the step returns is never in the arena
        for _ in range(2):  # the second step reuses the arena
            got = run(runner, cap, model, inputs, target)
            assert all(torch.equal(a, b) for a, b in zip(expected, got)), name
        swaps = sum(1 for verb, _ in program if verb.value == "swap_in")
        assert len(runner.placed["swap_in"]) <= swaps and (swaps == 0 or runner.placed["swap_in"]), name


@pytest.mark.parametrize("model_name", ["cnn", "gpt"])
def test_training_from_an_arena_is_bitwise_the_plain_runtimes(model_name):
    model, inputs, target, cap = setup(model_name)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, program in programs(cap):
        trained = []
        for runner in (StepRunner(cap, program), ArenaRunner(cap, program),
                       ArenaRunner(cap, program, results_in_arena=True)):  # `train` drops the gradients each step
            model.load_state_dict(state)
            trained.append(train(lambda: runner(fresh_args(cap, model, inputs, target)), model, inputs, target))
        assert all(torch.equal(a, b) for a, b in zip(trained[0], trained[1])), name
        assert all(torch.equal(a, b) for a, b in zip(trained[0], trained[2])), name


@pytest.mark.parametrize("model_name", ["gpt", "mlp"])
def test_only_what_the_step_returns_is_allocated_outside_the_arena(model_name):
    """GPT and the MLP have an out= overload for every op whose output is placed: nothing is copied here, and the
    only storages ops return outside the arena are the step's results (loss and gradients); what runs inside
    an op is not seen (see OutsideArena)."""
    model, inputs, target, cap = setup(model_name)
    for name in ("keep", "swap"):
        program = dict(programs(cap))[name]
        runner = ArenaRunner(cap, program)
        assert runner.placed["copy"] == [], name
        args = fresh_args(cap, model, inputs, target)
        with OutsideArena(runner.buffer) as outside:
            results = runner(args)
        assert outside.bytes == sum(t.untyped_storage().nbytes() for t in results) > 0, name


def test_the_ops_that_fall_back_to_a_copy_are_counted_and_what_they_allocate_is_measured():
    model, inputs, target, cap = setup("cnn")
    program = dict(programs(cap))["keep"]
    runner = ArenaRunner(cap, program)
    copied = {str(runner.nodes[n].target) for n in runner.placed["copy"]}
    for n in runner.placed["copy"]:  # no out= overload of the same arguments, or a result that is not all tensors
        val = runner.nodes[n].meta["val"]
        assert out_variant(runner.nodes[n].target) is None or not all(isinstance(v, torch.Tensor) for v in val), n
    assert copied
    args = fresh_args(cap, model, inputs, target)
    with OutsideArena(runner.buffer) as outside:
        results = runner(args)
    returned = sum(t.untyped_storage().nbytes() for t in results)
    assert outside.bytes > returned  # the fallbacks' own results, then copied into their slots
    assert set(outside.by_op) >= {op for op in copied if "empty" not in op}


@pytest.mark.parametrize("model_name", ["gpt", "mlp"])
def test_with_the_results_in_the_arena_the_step_allocates_nothing_else(model_name):
    """The loss and gradients placed too: the peak the CPU tracker measures (tensors ops return) is the arguments
    plus the planned arena, exactly."""
    model, inputs, target, cap = setup(model_name)
    for name in ("keep", "swap"):
        runner = ArenaRunner(cap, dict(programs(cap))[name], results_in_arena=True)
        args = fresh_args(cap, model, inputs, target)
        held = sum(a.untyped_storage().nbytes() for a in args)
        with DeviceMemory("cpu") as memory:
            memory.hold(list(args) + [runner.buffer])
            with OutsideArena(runner.buffer) as outside:
                results = runner(args)
        assert outside.bytes == 0, name
        assert all(t.untyped_storage().data_ptr() == runner.buffer.data_ptr() for t in results), name
        assert memory.peak == held + runner.plan.size, name


def test_the_arena_is_counted_once_by_the_cpu_memory_tracker():
    model, inputs, target, cap = setup("mlp")
    program = dict(programs(cap))["swap"]
    runner = ArenaRunner(cap, program)
    args = fresh_args(cap, model, inputs, target)
    held = list(args)
    with DeviceMemory("cpu") as memory:
        memory.hold(held + [runner.buffer])
        del held
        with OutsideArena(runner.buffer) as outside:
            runner(args)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    inputs_bytes = sum(x.untyped_storage().nbytes() for x in inputs) + target.untyped_storage().nbytes()
    assert memory.peak <= params + inputs_bytes + runner.plan.size + outside.bytes
    assert memory.peak >= params + runner.plan.size


@pytest.mark.parametrize("prompt", [(), ("h2d",), ("d2h",)])
def test_copies_that_lag_as_far_as_cuda_lets_them_land_in_the_right_slots(prompt):
    model, inputs, target, cap = setup("gpt")
    for name in ("swap", "mixed"):
        program = dict(programs(cap))[name]
        expected = run(StepRunner(cap, program), cap, model, inputs, target)
        runner = ArenaRunner(cap, program, streams=LaggingStreams(prompt))
        for _ in range(2):
            got = run(runner, cap, model, inputs, target)
            assert all(torch.equal(a, b) for a, b in zip(expected, got)), (name, prompt)


@pytest.mark.parametrize("dropped", [("to_device", "h2d", "compute"), ("to_host", "d2h", "compute"),
                                     ("release", "compute", "d2h")])
def test_in_an_arena_a_missing_wait_is_a_race_on_a_reused_slot(dropped):
    """In the arena a slot is reused within the step, so a swap-in that does not wait for compute writes a slot
    an earlier op may still read (on a GPU); the stand-in names the race."""
    model, inputs, target, cap = setup("gpt")
    runner = ArenaRunner(cap, dict(programs(cap))["swap"], streams=_Dropping(*dropped))
    with pytest.raises(StreamRace):
        run(runner, cap, model, inputs, target)
    assert runner.streams.dropped_count > 0


def test_with_the_loss_outside_the_output_handed_out_is_not_in_the_arena():
    """Loss "external": the model's output is the caller's while the backward part runs; a slot of the arena
    reused by the backward part must not be it."""
    make, specs, _ = MODELS["mlp"]
    torch.manual_seed(0)
    model = make()
    inputs, _ = make_inputs(specs, None, 4, device="cpu", generator=torch.Generator().manual_seed(1))
    cap = capture(model, inputs, None, "external")
    enc = Encoding(cap.graph)
    keep = enc.uniform(Action.KEEP)
    costs = estimate(cap.graph, load_profile("v100-pcie-16gb"))
    program = Simulator(cap.graph, costs).run(enc.decode(keep.keys), enc.uniform(Action.SWAP).actions,
                                               trace=True).program
    figures = []
    for runner in (StepRunner(cap, program), ArenaRunner(cap, program, results_in_arena=True)):
        args = cap.arguments(model, [x.clone() for x in inputs], None)
        torch.manual_seed(5)  # dropout
        output, state = runner.forward(args)
        kept = output.clone()
        grads = runner.backward(state, torch.ones_like(output))
        assert torch.equal(output, kept)
        figures.append((kept, grads))
    (out_a, grads_a), (out_b, grads_b) = figures
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_out_variants_match_arguments_and_skip_tensor_options():
    aten = torch.ops.aten
    overload, names, accepted = out_variant(aten.max_pool2d_with_indices.default)
    assert overload is aten.max_pool2d_with_indices.out and names == ["out", "indices"]
    assert out_variant(aten.sum.dim_IntList)[0] is aten.sum.IntList_out
    overload, names, accepted = out_variant(aten.ones_like.default)  # a factory op: the slot holds dtype and device
    assert overload is aten.ones_like.out and "dtype" not in accepted
    assert out_variant(aten._safe_softmax.default) is None


def test_out_overloads_that_copy_inside_are_told_apart_from_kernels_that_write_in_place():
    model, inputs, target, cap = setup("gpt")
    runner = ArenaRunner(cap, dict(programs(cap))["keep"])
    native = {str(runner.nodes[n].target) for n in runner.placed["out"]}
    composite = {str(runner.nodes[n].target) for n in runner.placed["out_composite"]}
    assert "aten.mm.default" in native and "aten.addmm.default" in native  # structured kernels: in place
    assert "aten.native_layer_norm.default" in composite  # made, then copied, inside its out= overload
    figures = arena_figures(runner)
    assert figures["largest_transient_bytes"] >= max(
        runner.nodes[n].meta["val"][0].untyped_storage().nbytes() for n in runner.placed["out_composite"]
        if str(runner.nodes[n].target) == "aten.native_layer_norm.default")


def test_validate_runs_a_policy_from_an_arena_and_counts_it(tmp_path):
    from gaswap.app import validate, workflow
    from gaswap.base import config

    path = tmp_path / "exp.yaml"  # 1.0x: a V100's cuBLAS workspace is kept, and is more than a tiny CNN's peak
    path.write_text("model: {factory: gaswap.zoo:tiny_cnn, kwargs: {num_classes: 10, width: 8}}\n"
                    "inputs: [{shape: [batch, 3, 16, 16]}]\ntarget: {shape: [batch], dtype: int64, high: 10}\n"
                    "loss: cross_entropy\nbatch_size: 8\nbudget: 1.0x\n"
                    "costs: {source: estimate, profile: v100-pcie-16gb}\nga: {population: 8, generations: 2}\n")
    exp = config.load_experiment(path)
    out = tmp_path / "results" / "exp"
    workflow.run_search(workflow.prepare(exp), out)
    plain = validate.validate(out / "policy.yaml", steps=3, device="cpu")
    report = validate.validate(out / "policy.yaml", steps=3, device="cpu", arena=True)
    assert "arena" not in plain
    arena = report["arena"]
    assert 0 < arena["lower_bound_bytes"] <= arena["bytes"] < report["measured"]["peak_bytes"]
    assert arena["ops_copied"] and arena["largest_transient_bytes"] > 0  # BatchNorm has no out= overload
    assert report["loss"] == plain["loss"]  # the same step, from the arena
