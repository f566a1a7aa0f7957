"""One training step (`gaswap.run.training`): its optimizers, and that every verb that trains steps and meters
through it rather than a copy of its own."""
import ast
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gaswap import zoo
from gaswap.base import config, training_options
from gaswap.run import training

PACKAGE = Path(__file__).resolve().parents[1] / "gaswap"
STEP_OWNER = PACKAGE / "run" / "training.py"


def _dotted(node) -> str:
    """'torch.optim.SGD' for the attribute chain torch.optim.SGD; '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def step_written_outside(sources: dict[str, str]) -> list[str]:
    """Where a module other than run/training.py builds an optimizer, runs a backward or an optimizer's
    zero_grad, or makes a peak meter: each a second copy of the training step."""
    found = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            line = f"{name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and _dotted(node).startswith("torch.optim"):
                found.append(f"{line} names torch.optim")
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    "torch.optim" in n for n in [getattr(node, "module", None) or "", *(a.name for a in node.names)]):
                found.append(f"{line} imports torch.optim")
            elif isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if called in ("DeviceMemory", "PeakMeter", "zero_grad") or (called == "backward" and not node.args):
                    found.append(f"{line} calls {called}")
    return sorted(set(found))  # torch.optim.SGD names torch.optim twice


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py")) if p != STEP_OWNER}


def test_only_training_builds_optimizers_runs_a_step_or_makes_a_meter():
    assert step_written_outside(_sources()) == []


def test_a_step_written_again_elsewhere_is_caught():
    planted = _sources()
    planted["app/planted.py"] = ("import torch\n\ndef step(model, loss, meter):\n"
                                 "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                                 "    loss.backward()\n    opt.zero_grad()\n    return PeakMeter('cpu')\n")
    assert step_written_outside(planted) == ["app/planted.py:4 names torch.optim", "app/planted.py:5 calls backward",
                                             "app/planted.py:6 calls zero_grad", "app/planted.py:7 calls PeakMeter"]
    planted["app/planted.py"] = "from torch.optim import SGD\n"
    assert step_written_outside(planted) == ["app/planted.py:1 imports torch.optim"]


@pytest.mark.parametrize("name", training_options.OPTIMIZERS)
def test_each_optimizer_an_experiment_may_name_keeps_the_state_the_budget_counts(name):
    model = zoo.mlp(sizes=(4, 8, 2))
    optimizer = training.make_optimizer(name, model)
    loss = model(torch.ones(3, 4)).sum()
    loss.backward()
    optimizer.step()
    params = training.trainable(model)
    state = sum(t.numel() for p in params for t in optimizer.state[p].values()
                if isinstance(t, torch.Tensor) and t.shape == p.shape)
    assert state == training_options.OPTIMIZER_STATE[name] * sum(p.numel() for p in params)
    assert set(training.OPTIMIZERS) == set(training_options.OPTIMIZERS)


def test_a_fresh_copy_has_the_same_weights_and_its_own_optimizer():
    model = zoo.mlp(sizes=(4, 8, 2))
    copy, optimizer = training.fresh_copy(model, "sgd_momentum")
    assert all(torch.equal(a, b) and a is not b for a, b in zip(model.parameters(), copy.parameters()))
    x, y = torch.ones(3, 4), torch.tensor([0, 1, 0])
    wall, cpu = training.train_step(copy, optimizer, (x,), y, "cross_entropy", torch.device("cpu"))
    assert wall > 0 and cpu >= 0 and all(p.grad is None for p in copy.parameters())  # gradients dropped
    assert not torch.equal(next(model.parameters()), next(copy.parameters()))  # the copy trained, not the model
    assert optimizer.state  # momentum: the step made its buffers


def _counting(monkeypatch, name: str) -> list:
    """Replace `training.<name>` by a wrapper that records each call's (args, kwargs, result)."""
    calls, real = [], getattr(training, name)

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(training, name, wrapper)
    return calls


def _mlp_experiment(tmp_path) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text("model: {factory: gaswap.zoo:mlp, kwargs: {sizes: [12, 32, 5]}}\n"
                    "inputs: [{shape: [batch, 12]}]\ntarget: {shape: [batch], dtype: int64, high: 5}\n"
                    "loss: cross_entropy\noptimizer: sgd_momentum\nbatch_size: 8\nbudget: 1.0x\n"
                    "costs: {source: estimate, profile: v100-pcie-16gb}\nga: {population: 8, generations: 2}\n")
    return path


def test_validate_runs_and_meters_every_step_through_training(tmp_path, monkeypatch):
    from gaswap.app import validate, workflow

    exp = config.load_experiment(_mlp_experiment(tmp_path))
    out = tmp_path / "results" / "exp"
    workflow.run_search(workflow.prepare(exp), out)
    calls = _counting(monkeypatch, "runtime_step")
    report = validate.validate(out / "policy.yaml", steps=4, device="cpu")
    # the first warms up; on a CPU only the last step is metered, and left out of the timing
    assert [kwargs["metered"] for _, kwargs, _ in calls] == [False, False, False, True]
    assert report["measured"]["peak_bytes"] == calls[-1][2].memory.peak > 0
    assert report["measured"]["step_time_s"] == statistics.median(done.seconds for _, _, done in calls[1:3])


def test_compiled_validate_meters_through_training(tmp_path, monkeypatch):
    """Its setup, compile and graph check stood in for (an eager model): what is left is its metering."""
    from gaswap.app import validate_compiled
    from gaswap.compiled import partition
    from gaswap.plan import policy as policies
    from gaswap.plan.policy import Policy

    torch.manual_seed(0)
    model, x, y = zoo.mlp(sizes=(12, 32, 5)), torch.randn(8, 12), torch.randint(0, 5, (8,))
    monkeypatch.setattr(validate_compiled, "setup", lambda exp, device: (torch.device("cpu"), model, (x,), y, None))
    monkeypatch.setattr(policies, "check_matches", lambda *args, **kwargs: None)
    monkeypatch.setattr(partition, "compile", lambda m, policy: m)
    steps, rounds = _counting(monkeypatch, "train_step"), _counting(monkeypatch, "metered_round")
    policy = Policy("f", (), {}, {"peak_bytes": 1000, "step_time_s": 1.0, "resident_bytes": 100})
    exp = config.load_experiment(_mlp_experiment(tmp_path))
    r = validate_compiled.validate_compiled(policy, tmp_path / "p.yaml", exp, 2, "cpu")
    assert len(rounds) == 2 and len(steps) == training.WARM_UP_STEPS + 2 * (2 + validate_compiled.TIMED)
    assert r["measured"]["peak_bytes"] == max(peak for _, _, (peak, _, _) in rounds) > 0
    assert r["measured"]["step_min_s"] == min(cpu for *_, (_, _, timed) in rounds for _, cpu in timed)


def test_compare_steps_and_meters_its_methods_through_training(monkeypatch):
    from gaswap.app import compare
    from gaswap.compiled import methods

    torch.manual_seed(0)
    model, x, y = zoo.mlp(sizes=(12, 32, 5)), torch.randn(8, 12), torch.randint(0, 5, (8,))
    ms = []
    for knob in ("a", "b"):
        m, optimizer = training.fresh_copy(model, "sgd")
        ms.append(methods.Method("eager", knob, m, m, optimizer))
    steps, rounds = _counting(monkeypatch, "train_step"), _counting(monkeypatch, "metered_round")
    peaks = _counting(monkeypatch, "metered_peak")
    rows = methods.measure(ms, (x,), y, "cross_entropy", torch.device("cpu"), 2, 1, lambda line: None)
    # each round: a step metered (its resident set), an untimed step, the timed one; the first round before them
    # a step under the allocator's meter (the profiler, on a CPU), once a method
    assert len(steps) == 2 * training.WARM_UP_STEPS + 2 * 2 * 3 + 2 and len(rounds) == 4
    assert [args[0] for args, _, _ in steps[:4]] == [ms[0].run] * 2 + [ms[1].run] * 2  # each warmed up
    allocator = [out for args, _, out in peaks if args[2:] != (False,)]
    resident = [out for args, _, out in peaks if args[2:] == (False,)]
    assert len(allocator) == 2 and len(resident) == 4
    assert all(peak is None and rss is not None for peak, rss in resident)
    assert rows[0]["peak_min"] == rows[0]["peak_max"] == allocator[0][0] > 0
    assert rows[1]["rss_peak_bytes"] is not None
    ms[0].compile_s = 0.0  # warmed up again, then one metered step
    assert compare._peak_reached(ms[0], (x,), y, SimpleNamespace(loss="cross_entropy"), torch.device("cpu"),
                                 lambda line: None) == peaks[-1][2][0] > 0


def test_a_cuda_run_is_capped_at_an_absolute_budget_only():
    """validate caps a CUDA run at the policy's budget as a device of that size would (cuDNN's workspaces then
    take what the budget leaves): not on a CPU, nor for a fraction of keep-all's peak."""
    from gaswap.app.validate import budget_cap
    from gaswap.base.config import parse_size

    policy = SimpleNamespace(provenance={"budget_bytes": 4_500_000_000})
    absolute, fraction = SimpleNamespace(budget=parse_size("4.5GB")), SimpleNamespace(budget=parse_size("0.5x"))
    assert budget_cap(absolute, policy, torch.device("cuda")) == 4_500_000_000
    assert budget_cap(absolute, policy, torch.device("cpu")) is None
    assert budget_cap(fraction, policy, torch.device("cuda")) is None


def test_a_step_is_timed_by_the_cpu_clock_on_a_cpu_and_by_the_wall_clock_on_a_gpu():
    timed = [(0.5, 0.2), (0.7, 0.3)]  # (wall s, CPU s), as train_step gives them
    assert training.device_seconds(timed, "cpu") == [0.2, 0.3]
    assert training.device_seconds(timed, torch.device("cuda", 0)) == [0.5, 0.7]


def test_a_frozen_heap_leaves_what_lived_before_to_no_collection_and_still_collects_what_the_block_makes():
    import gc
    import weakref

    class Node:
        pass

    before = Node()
    with training.frozen_heap():
        assert gc.get_freeze_count() > 0
        made = Node()
        made.cycle = made  # garbage only a collection frees
        gone = weakref.ref(made)
        del made
        gc.collect()
        assert gone() is None
    assert gc.get_freeze_count() == 0 and before is not None
