"""Nothing a file says is believed unchecked (issue 31): checkpoints, policies and results folders checked by
meaning, files written atomically (real SIGKILLs at the write points), inputs of the step form checked before
torch sees them, and one clear line for each mistake. Each case ends clear (its exit code or exception and a
line saying what does not add up) or correctly accepted.

A tiny MLP with estimated costs (tests/test_safety.py's BASE) keeps the battery in seconds; the checkpoint cases
run on a synthetic graph with unit costs, the SIGKILL cases in child processes (scripts/sigkill_writes.py).
"""
import base64
import csv
import errno
import hashlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import unit_costs
from test_safety import BASE, expect, forged, patched, validate

import gaswap
from gaswap import zoo
from gaswap.app import cli, report, results, workflow
from gaswap.app.cli import main
from gaswap.base import config, files
from gaswap.base.config import GASettings, load_search_space
from gaswap.plan import checkpoint as checkpoints
from gaswap.plan import policy as policies
from gaswap.plan.checkpoint import CheckpointError
from gaswap.plan.costs import Costs
from gaswap.plan.graph import residual_graph
from gaswap.plan.problem import Problem
from gaswap.plan.search import search

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sigkill_writes


def cli_search(tmp_path, text=BASE, *extra, name="exp.yaml") -> list[str]:
    (tmp_path / name).write_text(text)
    return ["search", str(tmp_path / name), "--results", str(tmp_path / "results"), *map(str, extra)]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A results folder of the tiny MLP (live peaks), and one searched with `memory: {target: reserved}`."""
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "exp.yaml").write_text(BASE)
    (tmp / "reserved.yaml").write_text(BASE + "memory: {target: reserved}\n")
    for name in ("exp", "reserved"):
        assert main(["search", str(tmp / f"{name}.yaml"), "--results", str(tmp / "results")]) == 0
    return tmp / "results"


def policy_body(folder: Path, name="policy.yaml") -> dict:
    return yaml.safe_load((folder / name).read_text())


# ------------------------------------------------------------------------------------ checkpoints by meaning

GA = GASettings(population=12, generations=6)
SPACE = load_search_space("hybrid")
BUDGET = 1500


@pytest.fixture(scope="module")
def problem():
    g = residual_graph(24, size=100)
    return g, unit_costs(g, bandwidth=200.0)


def run(problem, ckpt, **kw):
    g, costs = problem
    return search(Problem(g, costs, BUDGET, SPACE), GA, 3, checkpoint=ckpt, **kw)


@pytest.fixture()
def checkpointed(problem, tmp_path):
    """A checkpoint of a search stopped after 2 generations."""
    ckpt = tmp_path / checkpoints.NAME
    done = []
    run(problem, ckpt, stop=lambda: len(done) >= 2, on_generation=lambda record, nearest: done.append(record))
    return ckpt


def tamper(path: Path, edit) -> None:
    """Edit a checkpoint's state with `edit(state)` and recompute its checksum, as anyone can."""
    body = json.loads(path.read_text())
    edit(body["state"])
    body["sha256"] = hashlib.sha256(json.dumps(body["state"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    path.write_text(json.dumps(body))


def _rows(state):
    """Every stored point of a state: population, archive, fastest, seeds."""
    return [*state["population"], *state["archive"], *state["fastest"], *state["seeds"].values()]


def _all_actions(value):
    def edit(state):
        for row in _rows(state):
            row[1] = value * len(row[1])
    return edit


def _fake_fitness(state):
    for row in _rows(state):
        row[2], row[3] = 1e-9, 1


def _nan_key(state):
    row = state["population"][0]
    keys = list(struct.unpack(f"<{len(base64.b64decode(row[0])) // 8}d", base64.b64decode(row[0])))
    keys[0] = float("nan")
    row[0] = base64.b64encode(struct.pack(f"<{len(keys)}d", *keys)).decode()


def _flip_valid(state):
    state["population"][0][4] = not state["population"][0][4]


def _over_budget(state):
    state["archive"][0][3] = BUDGET + 1


def _faster_archive(state):
    state["archive"][0][2] = state["archive"][0][2] / 2


def _drop_seed(state):
    state["seeds"].pop(max(state["seeds"]))


def _cut_population(state):
    del state["population"][len(state["population"]) // 2:]


def _cut_history(state):
    del state["history"][-1]


@pytest.mark.parametrize("edit, message", [
    (_all_actions("9"), "point 0: action gene 0 is 9, but this search space allows 0 (keep)"),
    (_fake_fitness, "says step time 1e-09 s and peak 1 bytes, but the simulator gives"),
    (_nan_key, "population point 0: an order key is not a finite number"),
    (_flip_valid, "population point 0 says"),
    (_over_budget, "archive point 0: over the budget"),
    (_faster_archive, "archive point 0 says step time"),
    (_drop_seed, "the checkpoint's seed policies are not this search's"),
    (_cut_population, "the checkpoint holds 6 individuals and 2 generation records, a search at generation 2 holds 12"),
    (_cut_history, "1 generation records, a search at generation 2 holds 12 and 2"),
], ids=["action genes 9", "faked fitness", "nan key", "valid flipped", "archive over budget", "archive faster",
        "seed dropped", "population cut", "history cut"])
def test_an_edited_checkpoint_with_its_checksum_recomputed_is_refused(problem, checkpointed, edit, message):
    tamper(checkpointed, edit)
    with pytest.raises(CheckpointError, match="the checkpoint was edited") as err:
        run(problem, checkpointed, resume=True)
    assert message in str(err.value) and checkpointed.name in str(err.value)


def test_an_untouched_checkpoint_still_resumes(problem, checkpointed):
    """The checks accept what a search wrote (the resume tests of test_resume.py compare whole outcomes)."""
    assert run(problem, checkpointed, resume=True).complete


def test_search_resume_of_a_checkpoint_with_out_of_range_genes_is_exit_4(capsys, tmp_path):
    """The issue's case: every action gene 9, checksum recomputed; `search --resume` used to finish "complete"."""
    argv = cli_search(tmp_path, patched(BASE, ga="{population: 8, generations: 4}"))
    exp = config.load_experiment(argv[1])
    out = tmp_path / "results" / "exp"
    done = []
    workflow.run_search(workflow.prepare(exp), out, stop=lambda: bool(done),
                        on_generation=lambda record, nearest: done.append(record))
    tamper(out / checkpoints.NAME, _all_actions("9"))
    expect(capsys, 4, "action gene 0 is 9", *argv, "--resume")
    assert json.loads((out / "summary.json").read_text())["complete"] is False  # nothing written over it


# ------------------------------------------------------------------------------------ policies by meaning

def _predicted(**changes):
    return lambda body: body | {"predicted": body["predicted"] | changes}


@pytest.mark.parametrize("folder, change, message", [
    ("exp", _predicted(peak_bytes=1e30), "predicted: live peak 1e+30 bytes, but replaying its program gives"),
    ("exp", _predicted(peak_bytes=1e308), "predicted: live peak 1e+308 bytes"),
    ("exp", _predicted(peak_bytes=1), "predicted: live peak 1 bytes"),
    ("exp", lambda b: b | {"predicted": b["predicted"] | {"peak_bytes": b["predicted"]["peak_bytes"] + 1}},
     "predicted: live peak"),
    ("exp", lambda b: b | {"predicted": b["predicted"] | {"keep": b["predicted"]["keep"] + 1}},
     "predicted: keep"),
    ("exp", _predicted(overhead=-2.0), "predicted: overhead -2.0 is no step-time overhead"),
    ("exp", _predicted(reserved_bytes=10**9), "allocator peaks without the experiment's `memory` key"),
    ("reserved", _predicted(reserved_bytes=10**12), "predicted: reserved peak 1000000000000 bytes, but replaying"),
    ("reserved", _predicted(allocated_bytes=1), "predicted: allocated peak 1 bytes, but replaying"),
    ("reserved", lambda b: b | {"predicted": b["predicted"] | {"live_bytes": b["predicted"]["live_bytes"] - 1}},
     "predicted: live peak"),
    ("reserved", lambda b: b | {"predicted": b["predicted"] | {"peak_bytes": b["predicted"]["allocated_bytes"]}},
     "is neither its live nor its reserved peak"),
], ids=["peak 1e30", "peak 1e308", "peak 1 byte", "peak one byte more", "counts", "overhead below -100 %",
        "reserved without memory key", "reserved 1 TB", "allocated 1 byte", "live one byte less",
        "peak is the allocated one"])
def test_a_policy_whose_figures_do_not_add_up_is_refused(searched, capsys, tmp_path, folder, change, message):
    body = change(policy_body(searched / folder))
    line = validate(capsys, forged(tmp_path, body), 4, message)
    assert len(line) < 600  # no 300-digit number


@pytest.mark.parametrize("folder", ["exp", "reserved"])
def test_the_searched_policies_add_up(searched, folder):
    exp = config.load_experiment(searched.parent / f"{folder}.yaml")
    graph = workflow.capture_step(exp).graph
    for path in [searched / folder / "policy.yaml", *sorted((searched / folder / "policies").glob("*.yaml"))]:
        policies.load(path, graph)  # raises if anything is off


# ------------------------------------------------------------------------------------ results folders

@pytest.fixture()
def copied(searched, tmp_path):
    """A copy of the MLP's results folder, with its experiment file beside the results root."""
    shutil.copy(searched.parent / "exp.yaml", tmp_path / "exp.yaml")
    shutil.copytree(searched / "exp", tmp_path / "results" / "exp")
    return tmp_path / "results" / "exp"


def _edit_csv(folder: Path, edit) -> None:
    rows = list(csv.DictReader(io.StringIO((folder / "front.csv").read_text())))
    columns = list(rows[0])
    rows = edit(rows)
    (folder / "front.csv").write_text(files.csv_text(rows, columns))


def _halve_peak(rows):
    rows[0]["peak_bytes"] = str(int(rows[0]["peak_bytes"]) // 2)
    return rows


def _faster(rows):
    rows[-1]["step_time_s"] = "1e-09"
    return rows


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "front.csv").write_text((f / "front.csv").read_text().splitlines()[0] + "\n"),
     "front.csv lists 0 policies"),
    (lambda f: _edit_csv(f, lambda rows: rows + rows[:1]), "front.csv lists"),
    (lambda f: _edit_csv(f, _halve_peak), "row 1 (policies/p000.yaml): peak_bytes"),
    (lambda f: _edit_csv(f, _faster), "step_time_s 1e-09, but the policy predicts"),
    (lambda f: (f / "policies" / "p000.yaml").unlink(), "policies/ holds"),
    (lambda f: (f / "summary.json").write_text(json.dumps(json.loads((f / "summary.json").read_text()) | {
        "best": json.loads((f / "summary.json").read_text())["best"] | {"peak_bytes": 1}})),
     "summary.json: best says 1 bytes"),
    (lambda f: (f / "front.csv").write_bytes(b"\xff\xfe\x00"), "front.csv: not readable"),
], ids=["front.csv cut", "row duplicated", "peak edited", "time edited", "policy file gone", "best edited",
        "front.csv binary"])
def test_a_results_folder_that_does_not_add_up_is_not_drawn(copied, damage, message):
    damage(copied)
    with pytest.raises(results.Refused, match="cut or edited|not readable") as err:
        results.check_front(copied)
    assert message in str(err.value)


def test_plot_of_a_cut_front_is_exit_4_and_draws_nothing(copied, capsys):
    """The issue's case: `plot` of a folder whose front.csv was cut drew no GA point, the legend said "1 policy"."""
    text = (copied / "front.csv").read_text().splitlines()
    (copied / "front.csv").write_text("\n".join(text[:1]) + "\n")
    expect(capsys, 4, "front.csv lists 0 policies", "plot", copied)
    assert not list(copied.glob("*.png"))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d | {"op_time": dict.fromkeys(d["op_time"], -1.0)}, "costs.json: unusable (-1.0 is not a time"),
    (lambda d: d | {"graph_fingerprint": "0" * 16}, "costs.json: recorded for graph 0000000000000000"),
    (lambda d: [d], "costs.json: unusable"),
], ids=["negative op times", "another graph", "not an object"])
def test_an_edited_costs_json_is_refused_exit_4(copied, capsys, edit, message):
    path = copied / "costs.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    expect(capsys, 4, message, "plot", copied)


def test_an_oversize_results_table_is_refused_unread(copied, capsys):
    with open(copied / "history.csv", "ab") as f:
        f.truncate(results.TABLE_BYTES + 1)  # sparse: nothing written, nothing read
    expect(capsys, 2, f"history.csv: more than the {results.TABLE_BYTES} bytes", "plot", copied)


def test_plot_of_a_folder_left_between_its_renames_recovers_it(copied, capsys):
    old = copied.with_name(".exp.old")
    copied.rename(old)  # killed after moving the old folder aside, before the new one came
    assert main(["plot", str(copied)]) == 0
    assert sorted(p.name for p in copied.glob("*.png")) == sorted(sigkill_writes.FIGURES)
    assert not old.exists()


def test_plot_of_a_folder_a_search_is_replacing_says_so(copied, capsys):
    import fcntl

    copied.rename(copied.with_name(".exp.new"))
    with open(copied.with_name(".exp.lock"), "w") as lock:
        lock.write("4545\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        expect(capsys, 4, "is being written by another gaswap process (pid 4545", "plot", copied)


# ------------------------------------------------------------------------------------ atomic writes

def _png(data: bytes) -> bool:
    return data.startswith(sigkill_writes.PNG_START) and data.endswith(sigkill_writes.PNG_END)


def test_a_figure_that_fails_midway_leaves_the_old_one(copied, monkeypatch):
    from matplotlib.figure import Figure

    (copied / "pareto.png").write_bytes(b"old figure")

    def half(self, f, **kwargs):
        f.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", half)
    with pytest.raises(OSError, match="No space left on device") as err:
        report.plot_results(copied)
    assert err.value.filename == str(copied / "pareto.png")  # the path is named
    assert (copied / "pareto.png").read_bytes() == b"old figure"
    assert not list(copied.glob(".*.tmp"))


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "bench.md"
    path.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as err:
        files.write_atomic(path, "new")
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(path))
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["bench.md"]


def test_a_full_disk_on_bench_names_the_file_and_leaves_no_lock(capsys, tmp_path, monkeypatch):
    from gaswap.app import bench

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(bench, "write_atomic", full)
    (tmp_path / "exp.yaml").write_text(BASE)
    line = expect(capsys, 5, "No space left on device", "bench", tmp_path / "exp.yaml", "--budgets", "0.5",
                  "--results", tmp_path / "results", "--time-limit", "1")
    assert "bench.csv: cannot read or write" in line
    assert not list((tmp_path / "results").glob(".*.lock"))


def test_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    import builtins

    real_open = builtins.open

    class Full(io.StringIO):
        def flush(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def fileno(self):
            return self._file.fileno()

    def opening(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if str(path).endswith(".lock"):
            full = Full()
            full._file = f
            full.close = f.close
            return full
        return f

    monkeypatch.setattr(builtins, "open", opening)
    with pytest.raises(OSError) as err, results.locked(tmp_path / "exp"):
        pass
    assert err.value.filename == str((tmp_path / ".exp.lock").absolute())
    assert not (tmp_path / ".exp.lock").exists()


def test_the_harness_sees_a_broken_figure(copied):
    """What the SIGKILL harness checks could fail: a 0-byte PNG (what an in-place savefig left) is caught."""
    report.plot_results(copied)
    assert sigkill_writes.check(copied) == []
    (copied / "convergence.png").write_bytes(b"")
    (copied / "action_map.png").unlink()
    assert sigkill_writes.check(copied) == ["convergence.png: missing", "action_map.png: missing"]
    (copied / "convergence.png").write_bytes(b"\x89PNG\r\n\x1a\nhalf")
    assert sigkill_writes.check(copied)[0] == "convergence.png: broken (12 bytes)"


SIGKILL_POINTS = [
    ("search", "match:fsync"),  # the first write of the new search: its checkpoint
    ("search", "match:.pareto.png."),  # while drawing the figures into the new folder
    ("search", "match:rename"),  # the new folder complete, moved to .exp.new: before the old goes
    ("search", "match:.exp.new -> "),  # between the renames
    ("plot", "match:.memory_timeline.png."),  # plot, in the middle of its figures
]


@pytest.fixture(scope="module")
def sigkilled(tmp_path_factory, request):
    """{(verb, point): (what is wrong with the folder the child left, its seconds)} for the points of the tests
    selected in this session; the children run two at a time (each a process of its own; the test process only
    waits), on copies of one reference folder."""
    from concurrent.futures import ThreadPoolExecutor

    work = tmp_path_factory.getbasetemp() / "sigkill"
    reference = work / "reference" / "exp"
    work.mkdir()  # made once, as the children will find it: paths relative to `work`
    (work / "exp.yaml").write_text(BASE)
    here = os.getcwd()
    os.chdir(work)
    try:
        assert main(["search", "exp.yaml", "--results", "reference"]) == 0
        assert main(["plot", "reference/exp"]) == 0
    finally:
        os.chdir(here)
    name = "test_real_sigkills_at_write_points_leave_a_whole_folder"
    points = [(item.callspec.params["verb"], item.callspec.params["point"]) for item in request.session.items
              if getattr(item, "originalname", None) == name]

    def killed(verb_point):
        started = time.perf_counter()
        return sigkill_writes.kill_at(work, reference, *verb_point), time.perf_counter() - started

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(points, pool.map(killed, points)))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("verb, point", SIGKILL_POINTS)
def test_real_sigkills_at_write_points_leave_a_whole_folder(sigkilled, verb, point):
    """A child `search` or `plot` SIGKILLs itself just before a write; the folder it leaves holds, once the next
    run recovers it, results that add up and all four figures, whole (scripts/sigkill_writes.py runs them all)."""
    problems, seconds = sigkilled[verb, point]
    assert problems == []
    assert seconds < 120


# ------------------------------------------------------------------------------------ inputs of the step form

@pytest.fixture(scope="module")
def step(searched):
    return gaswap.apply_step(zoo.mlp(sizes=[8, 16, 16, 4]), searched / "exp" / "policy.yaml", torch.randn(4, 8),
                             torch.randint(0, 4, (4,)))


X, Y = torch.randn(4, 8), torch.randint(0, 4, (4,))


@pytest.mark.parametrize("args, message", [
    ((X, Y.float()), ("the target has shape (4,) and dtype torch.float32, but the policy was searched for shape "
                      "(4,) and dtype torch.int64")),
    ((X.double(), Y), "input 0 has shape (4, 8) and dtype torch.float64"),
    ((X[:2], Y[:2]), "input 0 has shape (2, 8)"),
    ((torch.randn(4, 9), Y), "input 0 has shape (4, 9)"),
    ((X[None], Y), "input 0 has shape (1, 4, 8)"),
    ((X, Y[:, None]), "the target has shape (4, 1)"),
    ((X.long(), Y), "dtype torch.int64, but the policy was searched for shape (4, 8) and dtype torch.float32"),
    ((X.tolist(), Y), "input 0 is list, not a tensor"),
    ((X,), "the policy was searched for 2 tensors (the inputs, then the target), got 1"),
    ((X, X, Y), "the policy was searched for 2 tensors (the inputs, then the target), got 3"),
    ((X.clone().requires_grad_(), Y), "input 0 requires grad"),
    ((X.to("meta"), Y), "input 0 is on meta, but the model's parameters are on cpu"),
], ids=["float target", "double input", "another batch", "another width", "another rank", "target rank",
        "integer input", "a list", "no target", "one too many", "requires grad", "another device"])
def test_the_step_form_refuses_what_the_module_form_refuses(step, args, message):
    with pytest.raises(policies.PolicyError) as err:
        step(*args)
    assert message in str(err.value)


def test_the_step_form_still_runs_a_right_batch(step):
    model = step.model
    model.zero_grad()
    loss = step(X, Y)
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------------------------ experiment files

@pytest.mark.parametrize("text, message", [
    (patched(BASE, target="{shape: [batch], dtype: int64, high: 19}"),
     "target.high: 19, but the model's output has 4 classes"),
    (patched(BASE, budget="1e35"), "budget: invalid size"),
    (patched(BASE, budget=str(10**35)), "at most 1152921504606846976 bytes (1 EiB)"),
    (patched(BASE, budget="2000000TiB"), "at most 1152921504606846976 bytes"),
    (patched(BASE, search_space="../../../../../../../etc/passwd"), "must be a .yaml or .yml file"),
    (patched(BASE, search_space="../../../../../../../etc/hostname"), "must be a .yaml or .yml file"),
], ids=["target high 19 of 4 classes", "1e35 budget", "10^35-byte budget", "2 EiB budget", "/etc/passwd",
        "/etc/hostname"])
def test_an_experiment_refused_at_search_time(capsys, tmp_path, text, message):
    line = expect(capsys, 2, message, *cli_search(tmp_path, text))
    assert "root:" not in line and not (tmp_path / "results" / "exp").exists()


def test_validate_with_a_target_beyond_the_classes_is_exit_2(searched, capsys, tmp_path):
    """The issue's case: `validate` of such a policy ended in "internal error ... IndexError"."""
    (tmp_path / "wide.yaml").write_text(patched(BASE, target="{shape: [batch], dtype: int64, high: 19}"))
    validate(capsys, searched / "exp" / "policy.yaml", 2, "target.high: 19, but the model's output has 4 classes",
             "--experiment", tmp_path / "wide.yaml")


def test_a_budget_of_exactly_the_bound_is_accepted():
    assert config.parse_size(str(2**60)).bytes == 2**60  # the bound itself is a budget


def test_a_search_space_file_that_is_no_mapping_is_not_echoed(capsys, tmp_path):
    (tmp_path / "secret.yaml").write_text("root:x:0:0:root:/root:/bin/bash\n")
    line = expect(capsys, 2, "top level must be a mapping, got a str",
                  *cli_search(tmp_path, patched(BASE, search_space="secret.yaml")))
    assert "root:x" not in line


@pytest.mark.parametrize("name", ["my exp.yaml", "exp🚀.yaml", "ëxp (2).yaml"])
def test_a_name_taken_from_a_file_name_says_how_to_set_it(capsys, tmp_path, name):
    line = expect(capsys, 2, "add a `name:` key, e.g. `name: ", *cli_search(tmp_path, BASE, name=name))
    fixed = line.split("`name: ")[1].split("`")[0]
    assert main(cli_search(tmp_path, patched(BASE, name=fixed), name=name)) == 0  # the suggestion works


def test_a_unicode_letter_in_a_file_name_is_a_name(tmp_path):
    (tmp_path / "ëxp.yaml").write_text(BASE)
    assert config.load_experiment(tmp_path / "ëxp.yaml").name == "ëxp"


def test_summary_says_when_no_op_could_be_timed(searched):
    exp = config.load_experiment(searched.parent / "exp.yaml")
    prepared = workflow.prepare(exp)
    ops = [op.name for op in prepared.graph.ops]
    failed = Costs(prepared.costs.op_time, 1e9, 1e9, "cpu", "measured", estimated=tuple(ops))
    summary = workflow.describe(workflow.Prepared(exp, prepared.graph, failed, 0.0, 0.0, torch.__version__))
    assert summary["cost_source"].startswith("estimated (no op could be timed")
    some = Costs(prepared.costs.op_time, 1e9, 1e9, "cpu", "measured", estimated=tuple(ops[:1]))
    summary = workflow.describe(workflow.Prepared(exp, prepared.graph, some, 0.0, 0.0, torch.__version__))
    assert summary["cost_source"] == "measured"


# ------------------------------------------------------------------------------------ messages

def test_a_warning_is_one_gaswap_line():
    line = cli._warning_line(UserWarning("cost cache /x is unusable:\nmoved aside"), UserWarning, "costs.py", 12)
    assert line == "warning: cost cache /x is unusable: moved aside\n"


def test_main_formats_warnings_as_gaswap_lines_and_restores_python_s(monkeypatch):
    import warnings

    seen = []
    monkeypatch.setattr(cli, "speed", lambda args: seen.append(warnings.formatwarning("odd", UserWarning, "f.py", 1)))
    before = warnings.formatwarning
    main(["speed"])
    assert seen == ["warning: odd\n"] and warnings.formatwarning is before


def test_a_logged_warning_is_one_gaswap_line(monkeypatch, capsys):
    """What the op timer logs (an op that cannot run standalone, with its exception's lines) is one line."""
    import logging

    monkeypatch.setattr(cli, "speed", lambda args: logging.getLogger("gaswap.run.measure").warning(
        "cannot run %s standalone (%s); using a roofline estimate", "aten.mm", "RuntimeError: a\nb"))
    main(["speed"])
    assert capsys.readouterr().err == ("warning: cannot run aten.mm standalone (RuntimeError: a b); using a "
                                       "roofline estimate\n")
    assert not logging.getLogger("gaswap").handlers  # let go after the verb


def test_an_error_after_a_progress_bar_starts_its_own_line(capsys, tmp_path):
    assert main(cli_search(tmp_path, patched(BASE, model="{factory: hostile_models:raises}"))) == 2
    err = capsys.readouterr().err
    assert "capture + cost measurement" in err  # a bar was drawn
    assert next(line for line in err.split("\n") if "error:" in line).startswith("error: ")


def test_a_real_ctrl_c_is_still_an_interrupt(tmp_path):
    """Only a KeyboardInterrupt raised by code is bad input: SIGINT to a real process is 130."""
    (tmp_path / "exp.yaml").write_text(patched(BASE, model="{factory: hostile_models:sleeps}"))
    child = subprocess.Popen([sys.executable, "-m", "gaswap", "search", "exp.yaml", "--results", "r"], cwd=tmp_path,
                             env=dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}"), stderr=subprocess.PIPE,
                             text=True)
    deadline = time.time() + 60
    while not (tmp_path / "sleeping").exists() and time.time() < deadline:
        time.sleep(0.1)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130 and "interrupted (SIGINT)" in err and "error:" not in err

