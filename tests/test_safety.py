"""The safety battery (issue 12): hostile or broken inputs, each ending in its documented exit code and one
`error:` line naming the file, key or flag; no traceback, no code run from a handed file, no data lost.

Exit codes (README, "Exit codes"): 2 bad input, 3 no policy under the budget, 4 refused, 5 cannot read or write.
In-process `gaswap.app.cli.main` calls on a tiny MLP with estimated costs: the battery runs in seconds.
"""
import errno
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from gaswap.app import results, workflow
from gaswap.app.cli import main
from gaswap.base import files
from gaswap.base.config import load_experiment
from gaswap.plan import costs as cost_cache
from gaswap.plan import policy as policies
from gaswap.plan.checkpoint import NAME as CHECKPOINT
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.simulator import Simulator

BASE = """\
model: {factory: gaswap.zoo:mlp, kwargs: {sizes: [8, 16, 16, 4]}}
inputs: [{shape: [batch, 8]}]
target: {shape: [batch], dtype: int64, high: 4}
loss: cross_entropy
batch_size: 4
budget: 2x
costs: {source: estimate, profile: v100-pcie-16gb}
ga: {population: 8, generations: 2}
"""
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def patched(text: str, **keys) -> str:
    """BASE with top-level keys replaced or added (values are YAML text)."""
    lines = {line.split(":")[0]: line for line in text.splitlines()}
    lines.update({k: f"{k}: {v}" for k, v in keys.items()})
    return "\n".join(lines.values()) + "\n"


def expect(capsys, code: int, message: str, *argv) -> str:
    """Run the CLI; assert the exit code, exactly one error line holding `message`, and no traceback."""
    assert main([str(a) for a in argv]) == code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err
    assert len(errors) == 1 and message in errors[0], err
    return errors[0]


def search(capsys, tmp_path, text: str, code: int, message: str, *extra, name="exp.yaml") -> str:
    path = tmp_path / name
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return expect(capsys, code, message, "search", path, "--results", tmp_path / "results",
                  "--cache", tmp_path / "cache", *extra)


# ------------------------------------------------------------------------------------ experiment files

@pytest.mark.parametrize("text, message", [
    ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b]\n",
     "alias *a is not allowed"),
    ("budget: 4GB\nbudget: 2GB\n", "key 'budget' is given twice"),
    (BASE + "budjet: 1GB\n", "unknown key 'budjet' (did you mean 'budget'?)"),
    ("[1, 2]\n", "top level must be a mapping"),
    ("model: {factory: m:f\n", "invalid YAML"),
    (patched(BASE, batch_size=2**40), "batch_size: must be at most 2147483647"),
    (patched(BASE, inputs="[{shape: [batch, 1099511627776]}]"), "inputs[0].shape[1]: must be at most"),
    (patched(BASE, inputs="[{shape: [batch, 2000000000, 2000000000]}]"), "inputs[0].shape: more than"),
    (patched(BASE, seed=2**64), "seed: must be at most 4294967295"),
    (patched(BASE, seed=-1), "seed: must be a non-negative integer"),
    (patched(BASE, ga="{population: 8, generations: 2, workers: 1000}"), "ga.workers: must be at most 256"),
    (patched(BASE, costs="{source: measure, device: cpu, threads: 1000}"), "costs.threads: must be at most 256"),
    (patched(BASE, target="{shape: [batch], dtype: int64, high: 1180591620717411303424}"), "target.high: must be at most"),
    (patched(BASE, name="'.x.old'"), "name: must be a name of letters"),
    (patched(BASE, name="-x"), "name: must be a name of letters"),
    (patched(BASE, name="'..'"), "name: must be a name of letters"),
    (patched(BASE, budget="-4GB"), "budget: invalid size '-4GB'"),
    (patched(BASE, budget="nanx"), "budget: invalid size"),
])
def test_a_bad_experiment_file_is_one_line_and_exit_2(capsys, tmp_path, text, message):
    search(capsys, tmp_path, text, 2, message)
    assert not (tmp_path / "results").exists()


def test_an_oversize_experiment_file_is_refused_unread(capsys, tmp_path):
    search(capsys, tmp_path, BASE + "#" * 2**21 + "\n", 2, "more than the 1048576 bytes")


def test_a_binary_experiment_file(capsys, tmp_path):
    search(capsys, tmp_path, b"\xff\xfe\x00model", 2, "not a UTF-8 text file")


def test_a_folder_given_as_experiment(capsys, tmp_path):
    (tmp_path / "d.yaml").mkdir()
    expect(capsys, 2, "is a folder, not a file", "search", tmp_path / "d.yaml", "--results", tmp_path / "r")


def test_a_missing_experiment(capsys, tmp_path):
    expect(capsys, 2, "no such file", "search", tmp_path / "none.yaml", "--results", tmp_path / "r")


@pytest.mark.parametrize("factory, kwargs, message", [
    ("os:system", "{command: 'touch {marker}'}", "'os' is Python's standard library"),
    ("subprocess:run", "{args: [touch, '{marker}']}", "'subprocess' is Python's standard library"),
    ("builtins:exec", "{source: 'open(\"{marker}\", \"w\")'}", "'builtins' is Python's standard library"),
    ("torch:load", "{f: '{marker}'}", "is a function of 'torch.serialization', not a model factory"),
    ("gaswap.base.files:write_atomic", "{path: '{marker}', text: x}", "is a function of 'gaswap.base.files'"),
    ("hostile_models:NotAModule", "{}", "class NotAModule is not a torch.nn.Module"),
    ("hostile_models:env_var", "{}", "returned a _Environ, not a torch.nn.Module"),
    ("hostile_models:number", "{}", "returned a int, not a torch.nn.Module"),
])
def test_a_factory_that_is_no_model_factory_never_runs(capsys, tmp_path, factory, kwargs, message):
    marker = tmp_path / "ran"
    text = patched(BASE, model=f"{{factory: '{factory}', kwargs: {kwargs.replace('{marker}', str(marker))}}}")
    search(capsys, tmp_path, text, 2, message)
    assert not marker.exists()


@pytest.mark.parametrize("model, message", [
    ("{factory: hostile_models:raises}", "model: hostile_models:raises(**kwargs) failed: ValueError: no such layer"),
    ("{factory: hostile_models:exits}", "failed: SystemExit: 3"),
    ("{factory: gaswap.zoo:gpt, kwargs: {width: 30, heads: 4}}", "model: gaswap.zoo:gpt(**kwargs) failed"),
    ("{factory: gaswap.zoo:mlp, kwargs: {widths: 3}}", "model.kwargs: gaswap.zoo:mlp refused them"),
    ("{factory: hostile_models:detached}", "is the model's output detached"),
    ("{factory: hostile_models:Returns, kwargs: {what: none}}", "the model returned NoneType, not a tensor"),
    ("{factory: hostile_models:Returns, kwargs: {what: number}}", "the model returned float, not a tensor"),
    ("{factory: hostile_models:Returns, kwargs: {what: argmax}}", "in the loss function, Expected floating point"),
])
def test_a_model_that_cannot_be_trained(capsys, tmp_path, model, message):
    search(capsys, tmp_path, patched(BASE, model=model), 2, message)


def test_a_factory_raising_keyboard_interrupt_is_no_ctrl_c(capsys, tmp_path):
    search(capsys, tmp_path, patched(BASE, model="{factory: hostile_models:interrupts}"), 2,
           "model: hostile_models:interrupts(**kwargs) failed: it raised KeyboardInterrupt itself (no Ctrl-C came)")
    assert "interrupted (SIGINT)" not in capsys.readouterr().err


@NO_CUDA
def test_costs_on_cuda_without_cuda(capsys, tmp_path):
    search(capsys, tmp_path, patched(BASE, costs="{source: measure, device: cuda}"), 2,
           "costs.device: cuda, but this machine has no CUDA device")


# ------------------------------------------------------------------------------------ command-line values

@pytest.mark.parametrize("argv, message", [
    (["validate", "p.yaml", "--steps", "2"], "argument --steps: must be at least 3"),
    (["validate", "p.yaml", "--steps", "x"], "argument --steps: expected an integer"),
    (["validate", "p.yaml", "--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
    (["speed", "--synthetic-ops", "-5"], "argument --synthetic-ops: must be at least 2"),
    (["speed", "--seconds", "nan"], "argument --seconds: must be at least"),
    (["speed", "--seconds", "inf"], "argument --seconds: must be at least"),
    (["bench", "e.yaml", "--time-limit", "-1"], "argument --time-limit: must be at least"),
    (["fly"], "invalid choice: 'fly'"),
])
def test_a_bad_flag_is_one_line_and_exit_2(capsys, argv, message):
    expect(capsys, 2, message, *argv)


@NO_CUDA
def test_validate_on_cuda_without_cuda(capsys, tmp_path):
    expect(capsys, 2, "--device cuda: this machine has no CUDA device", "validate", tmp_path / "p.yaml",
           "--device", "cuda")


def test_a_bad_bench_budget(capsys, tmp_path):
    (tmp_path / "exp.yaml").write_text(BASE)
    expect(capsys, 2, "invalid size 'lots'", "bench", tmp_path / "exp.yaml", "--budgets", "0.5,lots",
           "--results", tmp_path / "r")


# ------------------------------------------------------------------------------------ plot

def test_plot_a_missing_folder(capsys, tmp_path):
    expect(capsys, 2, "no such folder", "plot", tmp_path / "none")


def test_plot_an_empty_folder(capsys, tmp_path):
    expect(capsys, 2, "not a gaswap results folder (no summary.json, front.csv, history.csv)", "plot", tmp_path)


def test_plot_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    expect(capsys, 2, "not a folder", "plot", tmp_path / "f")


@pytest.mark.parametrize("summary, message", [
    ("{not json", "summary.json: not valid JSON"),
    ("[1, 2]", "summary.json: must hold a JSON object"),
    ('{"experiment": "x"}', "summary.json: experiment_file: missing or not a str"),
    (b"\xff\xfe", "summary.json: not a UTF-8 text file"),
])
def test_plot_a_broken_summary(capsys, tmp_path, summary, message):
    for name in ("front.csv", "history.csv"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "summary.json").write_bytes(summary if isinstance(summary, bytes) else summary.encode())
    expect(capsys, 2, message, "plot", tmp_path)


# ------------------------------------------------------------------------------------ a searched policy

@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A results folder of the tiny MLP and a policy of it that swaps, recomputes and keeps."""
    tmp = tmp_path_factory.mktemp("safety")
    (tmp / "exp.yaml").write_text(BASE)
    assert main(["search", str(tmp / "exp.yaml"), "--results", str(tmp / "results")]) == 0
    exp = load_experiment(tmp / "exp.yaml")
    prepared = workflow.prepare(exp)
    graph, encoding = prepared.graph, Encoding(prepared.graph)
    activations = [t for t in encoding.candidates if graph.tensors[t].kind == "activation"]
    chosen = {activations[0]: Action.SWAP, activations[1]: Action.RECOMPUTE}
    actions = [chosen.get(t, Action.KEEP) for t in encoding.candidates]
    order = encoding.decode(encoding.uniform(Action.KEEP).keys)
    run = Simulator(graph, prepared.costs).run(order, actions, trace=True)
    assert run.valid and {i.verb for i in run.program} >= {"swap_out", "swap_in", "recompute", "free"}
    made = policies.from_result(graph, encoding.candidates, order, actions,
                                {"peak_bytes": run.peak_bytes, "step_time_s": run.step_time},
                                workflow.describe(prepared) | {"budget_bytes": run.peak_bytes}, run.program)
    policies.save(made, tmp / "mixed.yaml")
    return tmp, yaml.safe_load((tmp / "mixed.yaml").read_text())


def forged(tmp_path, body: dict, name="policy.yaml") -> Path:
    """`body` written as a policy with a valid checksum, as anyone can make one."""
    body = dict(body)
    body["checksum"] = policies._checksum(body)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def validate(capsys, path, code, message, *extra):
    return expect(capsys, code, message, "validate", path, "--steps", "3", "--device", "cpu", *extra)


def test_the_searched_policy_validates(searched, capsys):
    tmp, body = searched
    assert main(["validate", str(tmp / "mixed.yaml"), "--steps", "3", "--device", "cpu"]) == 0
    assert (tmp / "validation.json").is_file()


def program_edit(program: list[str]) -> dict[str, list[str]]:
    """Edits of a program with swaps, recomputes and frees, each breaking it another way."""
    first = {verb: next(k for k, line in enumerate(program) if line.startswith(verb + " "))
             for verb in ("swap_in", "free", "run")}
    runs = [k for k, line in enumerate(program) if line.startswith("run ")]
    reordered = list(program)
    reordered[runs[0]], reordered[runs[1]] = reordered[runs[1]], reordered[runs[0]]
    return {
        "missing swap_in": (program[:first["swap_in"]] + program[first["swap_in"] + 1:],
                            "which the program has not kept, swapped in or recomputed"),
        "unknown verb": (["jump " + program[0].split(" ", 1)[1]] + program[1:], "unknown verb 'jump'"),
        "duplicated free": (program[:first["free"] + 1] + [program[first["free"]]] + program[first["free"] + 1:],
                            "is not where this instruction needs it"),
        "reordered runs": (reordered, "program line"),
        "removed frees": ([line for line in program if not line.startswith("free ")], "never frees"),
        "run twice": (program + [program[first["run"]]], "a second time"),
        "not a line": (program[:-1] + [["run", "x"]], "program: must be a list of 'verb name' lines"),
        "unknown op": (program + ["recompute nowhere"], "this graph has no op 'nowhere'"),
    }


@pytest.mark.parametrize("edit", ["missing swap_in", "unknown verb", "duplicated free", "reordered runs",
                                  "removed frees", "run twice", "not a line", "unknown op"])
def test_an_edited_program_is_refused(searched, capsys, tmp_path, edit):
    _, body = searched
    program, message = program_edit(body["program"])[edit]
    validate(capsys, forged(tmp_path, body | {"program": program}), 4, message)


def actions_edit(body: dict, change: str) -> tuple[dict, str]:
    actions = dict(body["actions"])
    swapped = next(t for t, a in actions.items() if a == "swap")
    recomputed = next(t for t, a in actions.items() if a == "recompute")
    kept = next(t for t, a in actions.items() if a == "keep")
    if change == "swap to keep":
        return actions | {swapped: "keep"}, f"actions: {swapped} is 'keep', but the program swaps it out"
    if change == "keep to swap":
        return actions | {kept: "swap"}, f"actions: {kept} is 'swap', but the program never swaps it out"
    if change == "keep to recompute":
        return actions | {kept: "recompute"}, f"{kept} is 'recompute', but the program never recomputes it"
    if change == "recompute to keep":
        return actions | {recomputed: "keep"}, f"actions: {recomputed} is 'keep', but the program frees it"
    if change == "unknown tensor":
        return actions | {"t_nowhere": "keep"}, "actions: 't_nowhere' is not an activation of this graph"
    if change == "removed tensor":
        return {t: a for t, a in actions.items() if t != kept}, f"actions: no action for {kept!r}"
    return actions | {kept: "delete"}, "actions: must map tensor names to keep, swap, recompute"


@pytest.mark.parametrize("change", ["swap to keep", "keep to swap", "keep to recompute", "recompute to keep",
                                    "unknown tensor", "removed tensor", "unknown action"])
def test_edited_actions_are_refused(searched, capsys, tmp_path, change):
    _, body = searched
    actions, message = actions_edit(body, change)
    validate(capsys, forged(tmp_path, body | {"actions": actions}), 4, message)


@pytest.mark.parametrize("change, message", [
    ({"order": "not a list"}, "order: must be a list of op names"),
    ({"fingerprint": 12}, "fingerprint: must be a string"),
    ({"predicted": {"peak_bytes": -1, "step_time_s": 1}}, "predicted: must be a mapping whose peak_bytes"),
    ({"predicted": {"peak_bytes": 1}}, "predicted: needs peak_bytes and step_time_s"),
    ({"provenance": [1]}, "provenance: must be a mapping"),
    ({"gaswap_policy": 99}, "policy version 99"),
    ({"extra": 1}, "unknown key 'extra'"),
    ({"order": None}, "order: must be a list of op names"),
])
def test_a_policy_with_wrong_types_is_refused(searched, capsys, tmp_path, change, message):
    _, body = searched
    validate(capsys, forged(tmp_path, body | change), 4, message)


def test_a_policy_with_an_order_edited_is_refused(searched, capsys, tmp_path):
    _, body = searched
    order = list(body["order"])
    order[0], order[1] = order[1], order[0]
    validate(capsys, forged(tmp_path, body | {"order": order}), 4, "order: ")


def test_a_policy_missing_fields_is_refused(searched, capsys, tmp_path):
    _, body = searched
    short = {k: v for k, v in body.items() if k not in ("program", "predicted")}
    validate(capsys, forged(tmp_path, short), 4, "missing predicted, program")


def test_a_policy_from_another_torch_is_refused(searched, capsys, tmp_path):
    _, body = searched
    provenance = body["provenance"] | {"torch_version": "1.13.1"}
    validate(capsys, forged(tmp_path, body | {"provenance": provenance}), 4,
             f"made with torch 1.13.1, this is torch {torch.__version__}")


def test_a_policy_for_another_batch_says_what_differs(searched, capsys, tmp_path):
    tmp, body = searched
    (tmp_path / "exp.yaml").write_text(patched(BASE, batch_size=8))
    provenance = body["provenance"] | {"experiment_file": str(tmp_path / "exp.yaml")}
    validate(capsys, forged(tmp_path, body | {"provenance": provenance}), 4, "batch_size: policy 4, here 8")


def test_a_policy_for_another_class_count_says_what_differs(searched, capsys, tmp_path):
    tmp, _ = searched
    (tmp_path / "exp.yaml").write_text(patched(BASE, model="{factory: gaswap.zoo:mlp, kwargs: {sizes: [8, 16, 16, 6]}}",
                                               target="{shape: [batch], dtype: int64, high: 6}"))
    validate(capsys, tmp / "mixed.yaml", 4, "model: policy {'factory': 'gaswap.zoo:mlp', 'kwargs': {'sizes': [8, 16, "
             "16, 4]}}, here {'factory': 'gaswap.zoo:mlp', 'kwargs': {'sizes': [8, 16, 16, 6]}}",
             "--experiment", tmp_path / "exp.yaml")


def test_apply_step_with_another_batch_says_which_input_differs(searched):
    import gaswap
    from gaswap import zoo

    tmp, _ = searched
    with pytest.raises(policies.PolicyError, match=r"input 0: policy \[4, 8\] float32 \(batch size 4\), here "
                                                   r"\[2, 8\] float32"):
        gaswap.apply_step(zoo.mlp(sizes=[8, 16, 16, 4]), tmp / "mixed.yaml", torch.randn(2, 8), torch.randint(0, 4, (2,)))


def test_a_policy_edited_without_its_checksum(searched, capsys, tmp_path):
    tmp, _ = searched
    text = (tmp / "mixed.yaml").read_text().replace(": swap\n", ": keep\n", 1)
    assert text != (tmp / "mixed.yaml").read_text()
    (tmp_path / "p.yaml").write_text(text)
    validate(capsys, tmp_path / "p.yaml", 4, "checksum mismatch")


@pytest.mark.parametrize("content, message", [
    (None, "is a folder, not a file"),
    (b"\xff\xfe\x00", "not a UTF-8 text file"),
    (b"a: &x [1, 1]\nb: [*x, *x]\n", "alias *x is not allowed"),
    (b"- just a list\n", "not a gaswap policy file"),
    (b"gaswap_policy: 1\nfingerprint: [\n", "invalid YAML"),
])
def test_an_unreadable_policy_file(capsys, tmp_path, content, message):
    path = tmp_path / "p.yaml"
    path.mkdir() if content is None else path.write_bytes(content)
    validate(capsys, path, 4, message)


def test_a_missing_policy_file(capsys, tmp_path):
    validate(capsys, tmp_path / "none.yaml", 4, "no such file")


def test_an_oversize_policy_is_refused_unread(capsys, tmp_path):
    with open(tmp_path / "big.yaml", "wb") as f:
        f.truncate(policies.MAX_BYTES + 1)  # sparse: nothing written, nothing read
    validate(capsys, tmp_path / "big.yaml", 4, f"more than the {policies.MAX_BYTES} bytes")


def test_apply_refuses_an_edited_policy(searched, tmp_path):
    import gaswap
    from gaswap import zoo

    _, body = searched
    program, _ = program_edit(body["program"])["removed frees"]
    path = forged(tmp_path, body | {"program": program})
    model = zoo.mlp(sizes=[8, 16, 16, 4])
    with pytest.raises(policies.PolicyError, match="never frees"):
        gaswap.apply_step(model, path, torch.randn(4, 8), torch.randint(0, 4, (4,)))


# ------------------------------------------------------------------------------------ code named by a policy

@pytest.mark.parametrize("factory, kwargs", [
    ("os:system", "{command: 'touch {marker}'}"),
    ("subprocess:run", "{args: [touch, '{marker}']}"),
    ("builtins:exec", "{source: 'open(\"{marker}\", \"w\")'}"),
    ("hostile_models:touch", "{path: '{marker}'}"),
])
def test_a_policy_cannot_make_validate_run_code(searched, capsys, tmp_path, factory, kwargs):
    _, body = searched
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile.yaml"
    hostile.write_text(patched(BASE, model=f"{{factory: '{factory}', kwargs: {kwargs.replace('{marker}', str(marker))}}}"))
    provenance = body["provenance"] | {"experiment_file": str(hostile)}
    path = forged(tmp_path, body | {"provenance": provenance})  # the checksum authenticates nothing
    validate(capsys, path, 4, f"builds the model with {factory}, code named only by this policy file")
    assert not marker.exists()
    if factory != "hostile_models:touch":  # trusted by the user, stdlib callables are still refused
        validate(capsys, path, 2, "is Python's standard library", "--trust-factory")
        assert not marker.exists()


def test_plot_does_not_run_a_factory_named_by_results(searched, capsys, tmp_path):
    tmp, _ = searched
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile.yaml"
    hostile.write_text(patched(BASE, model=f"{{factory: hostile_models:touch, kwargs: {{path: '{marker}'}}}}"))
    folder = tmp_path / "results" / "exp"
    folder.mkdir(parents=True)
    for name in ("front.csv", "history.csv"):
        (folder / name).write_text((tmp / "results/exp" / name).read_text())
    summary = json.loads((tmp / "results/exp/summary.json").read_text()) | {"experiment_file": str(hostile)}
    (folder / "summary.json").write_text(json.dumps(summary))
    expect(capsys, 4, "builds the model with hostile_models:touch, code named only by these results", "plot", folder)
    assert not marker.exists()
    from gaswap.app import report  # the notebook's way in: the same refusal, before anything is imported or built
    from gaswap.app.results import Refused

    for draw in (report.plot_results, report.memory_timeline, report.action_map):
        with pytest.raises(Refused, match="hostile_models:touch, code named only by these results"):
            draw(folder)
    assert not marker.exists()


# ------------------------------------------------------------------------------------ results folders

def test_results_root_that_is_a_file(capsys, tmp_path):
    (tmp_path / "results").write_text("x")
    search(capsys, tmp_path, BASE, 5, "cannot read or write")


def test_a_file_where_the_results_folder_goes(capsys, tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "exp").write_text("mine")
    search(capsys, tmp_path, BASE, 4, "exists and is not a folder")
    assert (tmp_path / "results" / "exp").read_text() == "mine"


def test_a_full_disk_keeps_the_previous_results(capsys, tmp_path, monkeypatch):
    (tmp_path / "exp.yaml").write_text(BASE)
    args = ["search", str(tmp_path / "exp.yaml"), "--results", str(tmp_path / "results")]
    assert main(args) == 0
    before = (tmp_path / "results/exp/summary.json").read_text()

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(policies, "write_atomic", full)
    capsys.readouterr()
    expect(capsys, 5, "No space left on device", *args)
    assert (tmp_path / "results/exp/summary.json").read_text() == before  # no data lost
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["exp"]  # nothing left behind


def test_a_read_only_results_folder(capsys, tmp_path, monkeypatch):
    import tempfile

    def read_only(**kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), kwargs["dir"])

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)  # as for a non-root user in a folder without write access
    search(capsys, tmp_path, BASE, 5, f"{tmp_path / 'results'}: cannot read or write (Permission denied)")


def test_a_second_search_into_a_locked_folder_is_refused(capsys, tmp_path):
    import fcntl

    (tmp_path / "results").mkdir()
    with open(tmp_path / "results" / ".exp.lock", "w") as lock:
        lock.write("4242\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as another process running a search
        search(capsys, tmp_path, BASE, 4, "is being written by another gaswap process (pid 4242")
    assert not (tmp_path / "results" / "exp").exists()


def test_bench_into_a_folder_a_search_is_writing_is_refused_at_once(capsys, tmp_path):
    import fcntl

    (tmp_path / "results").mkdir()
    (tmp_path / "exp.yaml").write_text(BASE)
    with open(tmp_path / "results" / ".exp.lock", "w") as lock:
        lock.write("4343\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        expect(capsys, 4, "is being written by another gaswap process (pid 4343", "bench", tmp_path / "exp.yaml",
               "--results", tmp_path / "results", "--budgets", "0.5")


def test_a_kill_between_the_two_renames_rolls_back_with_the_checkpoint(capsys, tmp_path):
    (tmp_path / "exp.yaml").write_text(BASE)
    args = ["search", str(tmp_path / "exp.yaml"), "--results", str(tmp_path / "results")]
    assert main(args) == 0
    out = tmp_path / "results" / "exp"
    (out / CHECKPOINT).write_text("{}")  # stands for an interrupted search's checkpoint
    out.rename(tmp_path / "results" / ".exp.old")  # killed after moving the old folder aside
    assert results.recover(out) == f"restored {out}/ from .exp.old, left by an interrupted replacement"
    assert (out / CHECKPOINT).is_file() and (out / "policy.yaml").is_file()


def test_a_kill_after_the_new_folder_was_complete_rolls_forward(capsys, tmp_path):
    (tmp_path / "exp.yaml").write_text(BASE)
    args = ["search", str(tmp_path / "exp.yaml"), "--results", str(tmp_path / "results")]
    assert main(args) == 0
    out = tmp_path / "results" / "exp"
    new = tmp_path / "results" / ".exp.new"
    out.rename(new)
    (new / "marker").write_text("new")
    (tmp_path / "results" / ".exp.old").mkdir()
    (tmp_path / "results" / ".exp.tmp-x").mkdir()  # a half-written one
    capsys.readouterr()
    assert main(args) == 0
    assert "completed an interrupted replacement" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["exp"]


def test_a_kill_during_the_first_checkpoint_write_does_not_block_the_next_run(tmp_path):
    out = tmp_path / "results" / "exp"
    out.mkdir(parents=True)
    (out / ".checkpoint.json.abc123.tmp").write_text('{"format": "gaswap-ch')
    (tmp_path / "exp.yaml").write_text(BASE)
    assert main(["search", str(tmp_path / "exp.yaml"), "--results", str(tmp_path / "results")]) == 0
    assert not list(out.glob("*.tmp"))


def test_results_honour_the_umask(tmp_path):
    (tmp_path / "exp.yaml").write_text(BASE)
    old = os.umask(0o027)
    try:
        assert main(["search", str(tmp_path / "exp.yaml"), "--results", str(tmp_path / "results")]) == 0
    finally:
        os.umask(old)
    out = tmp_path / "results" / "exp"
    assert out.stat().st_mode & 0o777 == 0o750
    assert (out / "policy.yaml").stat().st_mode & 0o777 == 0o640
    assert (out / "summary.json").stat().st_mode & 0o777 == 0o640


# ------------------------------------------------------------------------------------ cost caches

@pytest.mark.parametrize("op_time, link, message", [
    (float("nan"), None, "is nan, not a number in"),
    (float("inf"), None, "is inf, not a number in"),
    (0.0, None, "is 0.0, not a number in"),
    (-1e-3, None, "is -0.001, not a number in"),
    (1e9, None, "is 1000000000.0, not a number in"),
    ("fast", None, "is 'fast', not a number in"),
    (1e-4, {"d2h": 0, "h2d": 1e9, "latency": 0}, "link.d2h is 0, not a number in"),
    (1e-4, {"d2h": 1e9, "h2d": 1e30, "latency": 0}, "link.h2d is 1e+30"),
    (1e-4, {"d2h": 1e9, "h2d": 1e9, "latency": -1}, "link.latency is -1"),
])
def test_an_implausible_cost_cache_is_set_aside_naming_the_file(tmp_path, op_time, link, message):
    cache = cost_cache.CostCache("cpu", "x", tmp_path)
    cache.op_time, cache.link = {"sig": 1e-4}, {"d2h": 1e9, "h2d": 1e9, "latency": 0.0}
    cache.save()
    body = json.loads(cache.path.read_text())
    body["op_time"]["sig"] = op_time
    body["link"] = link or body["link"]
    cache.path.write_text(json.dumps(body))
    with pytest.warns(UserWarning, match=f"cost cache {cache.path} is unusable") as caught:
        again = cost_cache.CostCache("cpu", "x", tmp_path)
    assert message in str(caught[0].message)
    assert again.op_time == {} and again.link is None  # measured afresh, never used
    assert cache.path.with_name(cache.path.name + ".bad").is_file()


def test_a_warm_read_only_cache_is_used_and_a_cold_unwritable_one_warns(tmp_path, monkeypatch):
    exp = load_experiment(Path(__file__).resolve().parents[1] / "experiments/tiny_cnn_cpu.yaml")
    first = workflow.prepare(exp, cache_dir=tmp_path / "cache")

    def read_only(path, text):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(cost_cache, "write_atomic", read_only)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warm cache writes nothing, so nothing to warn about
        second = workflow.prepare(exp, cache_dir=tmp_path / "cache")
    assert second.costs.measured == 0 and second.costs.op_time == first.costs.op_time
    with pytest.warns(UserWarning, match="cannot write it"):
        third = workflow.prepare(exp, cache_dir=tmp_path / "cold")
    assert third.costs.measured > 0


def test_a_cache_folder_that_is_a_file_warns_and_the_search_goes_on(capsys, tmp_path):
    (tmp_path / "cache").write_text("x")
    (tmp_path / "exp.yaml").write_text(patched(BASE, costs="{source: measure, device: cpu}"))
    with pytest.warns(UserWarning, match=f"cost cache {tmp_path / 'cache'}/.*: cannot write it"):
        assert main(["search", str(tmp_path / "exp.yaml"), "--results", str(tmp_path / "r"),
                     "--cache", str(tmp_path / "cache")]) == 0


def test_summary_lists_the_ops_estimated_instead_of_measured(tmp_path):
    (tmp_path / "exp.yaml").write_text(patched(BASE, costs="{source: measure, device: cpu, threads: 1}"))
    assert main(["search", str(tmp_path / "exp.yaml"), "--results", str(tmp_path / "r"),
                 "--cache", str(tmp_path / "cache")]) == 0
    summary = json.loads((tmp_path / "r/exp/summary.json").read_text())
    assert summary["estimated_ops"] == []  # every op of the MLP ran in place


def test_the_files_module_refuses_aliases_even_in_nested_documents(tmp_path):
    (tmp_path / "x.yaml").write_text("a: {b: &c 1}\nd: *c\n")
    with pytest.raises(files.UnreadableFile, match="line 2: invalid YAML: alias \\*c is not allowed"):
        files.load_yaml(tmp_path / "x.yaml", 1000)
