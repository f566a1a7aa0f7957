"""Checkpoints, stopping on signals, resuming, and refusing another experiment's results folder.

Interruptions are simulated deterministically (a `stop` callable, a signal sent to this very process from
the `on_generation` callback, an exception raised there); one test sends SIGINT to a real
`python -m gaswap search` process group. Unit-level tests use a synthetic graph with unit costs.
"""
import csv
import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gaswap.app import workflow
from gaswap.app.cli import main
from gaswap.base import config, signals
from gaswap.base.config import GASettings, load_search_space
from gaswap.plan import checkpoint as checkpoints
from gaswap.plan.checkpoint import CheckpointError
from gaswap.plan.graph import residual_graph
from gaswap.plan.problem import Problem
from gaswap.plan.search import search
from helpers import unit_costs

ROOT = Path(__file__).resolve().parents[1]
GA = GASettings(population=24, generations=15)
SPACE = load_search_space("hybrid")
BUDGET = 1500


@pytest.fixture(scope="module")
def problem():
    g = residual_graph(40, size=100)
    return g, unit_costs(g, bandwidth=200.0)


def run(problem, ckpt=None, *, ga=GA, budget=BUDGET, seed=3, **kw):
    g, costs = problem
    return search(Problem(g, costs, budget, SPACE), ga, seed, checkpoint=ckpt, **kw)


def outcome(r):
    """Everything a search reaches, wall-clock seconds aside."""
    return ([(e.chromosome, e.step_time, e.peak_bytes, e.valid) for e in r.front], r.fastest,
            [dataclasses.replace(h, seconds=0) for h in r.history],
            r.evaluations, r.smallest_peak, r.seeds, r.complete, r.generations_done)


def stop_after(n):
    """A `stop` and an `on_generation` that stop the search once n generations are done."""
    done = []
    return (lambda: len(done) >= n), (lambda record, nearest: done.append(record))


@pytest.fixture(scope="module")
def uninterrupted(problem):
    return {workers: outcome(run(problem, ga=GASettings(**(GA.__dict__ | {"workers": workers}))))
            for workers in (1, 2)}


# --- resuming reaches exactly what an uninterrupted search reaches ------------------------------------

@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("stops", [[0], [5], [1, 7, 14]])
def test_stopped_and_resumed_search_equals_an_uninterrupted_one(problem, uninterrupted, tmp_path, workers, stops):
    ga = GASettings(**(GA.__dict__ | {"workers": workers}))
    ckpt = tmp_path / checkpoints.NAME
    for k, n in enumerate(stops):
        stop, on_generation = stop_after(n - (stops[k - 1] if k else 0))
        r = run(problem, ckpt, ga=ga, resume=k > 0, stop=stop, on_generation=on_generation)
        assert (r.complete, r.generations_done) == (False, n) and ckpt.is_file()
    resumed = run(problem, ckpt, ga=ga, resume=True)
    assert outcome(resumed) == uninterrupted[workers]
    assert resumed.complete and resumed.generations_done == GA.generations


def test_a_search_killed_inside_a_generation_resumes_from_the_last_finished_one(problem, uninterrupted, tmp_path):
    ckpt = tmp_path / checkpoints.NAME

    def crash(record, nearest):
        if record.generation == 6:
            raise KeyboardInterrupt  # as if killed right after generation 6 was checkpointed

    with pytest.raises(KeyboardInterrupt):
        run(problem, ckpt, on_generation=crash)
    assert json.loads(ckpt.read_text())["state"]["generation"] == 6
    assert outcome(run(problem, ckpt, resume=True)) == uninterrupted[1]
    assert not [p for p in tmp_path.iterdir() if p.name != checkpoints.NAME]  # no temporary files left


def test_resume_with_more_generations_equals_a_longer_uninterrupted_run(problem, tmp_path):
    ckpt = tmp_path / checkpoints.NAME
    run(problem, ckpt)  # complete, 15 generations; search() leaves the checkpoint (the workflow removes it)
    longer = GASettings(**(GA.__dict__ | {"generations": 20}))
    assert outcome(run(problem, ckpt, ga=longer, resume=True)) == outcome(run(problem, ga=longer))
    shorter = GASettings(**(GA.__dict__ | {"generations": 10}))
    with pytest.raises(CheckpointError, match="generation 20, past ga.generations 10"):
        run(problem, ckpt, ga=shorter, resume=True)


def test_a_checkpoint_written_before_searches_kept_their_fastest_resumes_from_its_archive(problem, uninterrupted,
                                                                                      tmp_path):
    ckpt = tmp_path / checkpoints.NAME
    stop, on_generation = stop_after(5)
    run(problem, ckpt, stop=stop, on_generation=on_generation)
    body = json.loads(ckpt.read_text())
    del body["state"]["fastest"]
    checkpoints.save(ckpt, body["state"], body["fingerprint"], body["about"])
    resumed = run(problem, ckpt, resume=True)
    front, _, *rest = outcome(resumed)
    assert (front, rest) == (uninterrupted[1][0], list(uninterrupted[1][2:]))  # the same search
    assert resumed.fastest[0] == resumed.front[0] and all(e.feasible(BUDGET) for e in resumed.fastest)


# --- signals ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_search_after_the_current_generation(problem, uninterrupted, tmp_path, signum, code):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    messages = []
    ckpt = tmp_path / checkpoints.NAME

    def on_generation(record, nearest):
        if record.generation == 4:
            os.kill(os.getpid(), signum)

    with signals.stop_on_signals(messages.append) as stop:
        r = run(problem, ckpt, stop=stop, on_generation=on_generation)
    assert (r.complete, r.generations_done, stop.signum, stop.exit_code) == (False, 4, signum, code)
    assert "stopping after the current generation" in messages[0]
    assert {s: signal.getsignal(s) for s in before} == before  # the previous handlers are back
    assert outcome(run(problem, ckpt, resume=True)) == uninterrupted[1]


def test_a_second_signal_stops_at_once():
    with pytest.raises(signals.Aborted) as info:
        with signals.stop_on_signals(lambda message: None) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs between bytecodes: well before this ends
    assert isinstance(info.value, KeyboardInterrupt) and info.value.signum == signal.SIGTERM


def _children():
    """(pid, state) of this process's child processes, zombies included."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            out.append((int(stat.parent.name), fields[0]))
    return out


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.parametrize("fail", [False, True])
def test_workers_ignore_sigint_and_leave_no_zombies(problem, tmp_path, fail):
    seen = {}

    def on_generation(record, nearest):
        for p in multiprocessing.active_children():
            status = dict(line.split(":\t", 1) for line in Path(f"/proc/{p.pid}/status").read_text().splitlines()
                          if ":\t" in line)
            seen[p.pid] = int(status["SigIgn"], 16)
        if fail and record.generation == 3:
            raise KeyboardInterrupt

    ga = GASettings(**(GA.__dict__ | {"workers": 2, "generations": 4}))
    try:
        run(problem, tmp_path / "c.json", ga=ga, on_generation=on_generation)
    except KeyboardInterrupt:
        assert fail
    assert len(seen) == 2 and all(mask & (1 << (signal.SIGINT - 1)) for mask in seen.values())
    assert not [pid for pid, state in _children() if pid in seen]  # reaped: no zombie, none running


# --- unusable checkpoints ---------------------------------------------------------------------------------

@pytest.fixture()
def checkpointed(problem, tmp_path):
    ckpt = tmp_path / checkpoints.NAME
    stop, on_generation = stop_after(3)
    run(problem, ckpt, stop=stop, on_generation=on_generation)
    return ckpt


@pytest.mark.parametrize("damage, message", [
    (lambda t: t[: len(t) // 2], "not a readable checkpoint \\(truncated or corrupted\\?\\)"),
    (lambda t: "", "not a readable checkpoint"),
    (lambda t: t.replace('"generation":3', '"generation":4'), "corrupted checkpoint"),
    (lambda t: t.replace('"version":2', '"version":9'), "checkpoint version 9"),
    (lambda t: t.replace('"version":2', '"version":1'), "checkpoint version 1, this gaswap reads version 2 \\(it was "
                                                        "written by a search that ranked over-budget policies as 1e9"),
    (lambda t: "[1, 2]", "not a gaswap checkpoint"),
    (lambda t: "\x00\xff garbage", "not a readable checkpoint"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(problem, checkpointed, damage, message):
    checkpointed.write_text(damage(checkpointed.read_text()))
    with pytest.raises(CheckpointError, match=f"{checkpointed.name}: {message}"):
        run(problem, checkpointed, resume=True)


def test_a_checkpoint_of_another_configuration_is_refused_saying_what_differs(problem, checkpointed):
    g, costs = problem
    with pytest.raises(CheckpointError, match="another configuration; what differs: the budget"):
        run(problem, checkpointed, budget=BUDGET + 1, resume=True)
    with pytest.raises(CheckpointError, match="what differs: the seed"):
        run(problem, checkpointed, seed=4, resume=True)
    with pytest.raises(CheckpointError, match="what differs: the GA settings"):
        run(problem, checkpointed, ga=GASettings(**(GA.__dict__ | {"mut_prob": 0.3})), resume=True)
    with pytest.raises(CheckpointError, match="what differs: the op and copy costs"):
        search(Problem(g, unit_costs(g, op_time=2.0, bandwidth=200.0), BUDGET, SPACE), GA, 3, checkpoint=checkpointed,
               resume=True)
    other = residual_graph(45, size=100)
    with pytest.raises(CheckpointError, match="what differs: the captured graph .*; the op and copy costs"):
        search(Problem(other, unit_costs(other, bandwidth=200.0), BUDGET, SPACE), GA, 3, checkpoint=checkpointed,
               resume=True)
    with pytest.raises(CheckpointError, match="what differs: the search space"):
        search(Problem(g, costs, BUDGET, load_search_space("swap_only")), GA, 3, checkpoint=checkpointed, resume=True)
    # the number of workers and of generations may change
    assert run(problem, checkpointed, ga=GASettings(**(GA.__dict__ | {"workers": 2})), resume=True).complete


def test_resume_without_a_checkpoint_says_so(problem, tmp_path):
    with pytest.raises(CheckpointError, match="c.json: no checkpoint to resume from"):
        run(problem, tmp_path / "c.json", resume=True)


# --- the workflow: results folder, incomplete marks, another experiment's folder ----------------------------

EXPERIMENT = """model: {factory: gaswap.zoo:mlp, kwargs: {sizes: [8, 16, 4]}}
inputs: [{shape: [batch, 8]}]
target: {shape: [batch], dtype: int64, high: 4}
loss: cross_entropy
batch_size: 4
budget: 1500
costs: {source: estimate, profile: v100-pcie-16gb}
ga: {population: 24, generations: 15}
seed: 3
"""


def experiment(tmp_path, name="exp", text=EXPERIMENT):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return config.load_experiment(path)


def prepared(problem, exp):
    """The experiment's description with the synthetic graph and costs (no capture: fast)."""
    g, costs = problem
    return workflow.Prepared(exp, g, costs, 0.0, 0.0, "test")


def _timeless(value):
    """`value` without the wall-clock figures (keys ending in "seconds"), nor a policy's checksum, which
    covers them."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if not k.endswith("seconds") and k != "checksum"}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def folder(out: Path) -> dict:
    """A results folder's contents, with wall-clock figures left out."""
    files = {}
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.name != checkpoints.NAME:
            text = path.read_text()
            if path.suffix == ".csv":
                text = list(csv.DictReader(text.splitlines()))
            elif path.suffix == ".json":
                text = json.loads(text)
            elif path.suffix == ".yaml":
                text = yaml.safe_load(text)
            files[str(path.relative_to(out))] = _timeless(text)
    return files


def test_workflow_writes_incomplete_results_then_resumes_to_the_same_folder(problem, tmp_path):
    exp = experiment(tmp_path)
    whole = tmp_path / "whole"
    workflow.run_search(prepared(problem, exp), whole)
    assert not (whole / checkpoints.NAME).exists()  # a complete search removes its checkpoint

    out = tmp_path / "results" / "exp"
    stop, on_generation = stop_after(6)
    r, _ = workflow.run_search(prepared(problem, exp), out, stop=stop, on_generation=on_generation)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["complete"], summary["generations_done"], summary["generations"]) == (False, 6, 15)
    assert (out / checkpoints.NAME).is_file() and (out / "policy.yaml").is_file() and r.best is not None
    assert json.loads((out / checkpoints.NAME).read_text())["about"] == {"experiment": "exp",
                                                                         "experiment_file": exp.path}
    r, _ = workflow.run_search(prepared(problem, exp), out, resume=True)
    assert r.complete and not (out / checkpoints.NAME).exists()
    assert folder(out) == folder(whole)
    assert sorted(p.name for p in out.parent.iterdir()) == ["exp"]  # no temporary folders left


def test_an_infeasible_search_leaves_no_checkpoint_nor_empty_partial_results(problem, tmp_path):
    exp = experiment(tmp_path, text=EXPERIMENT.replace("budget: 1500", "budget: 10"))
    out = tmp_path / "results" / "exp"
    stop, on_generation = stop_after(2)
    r, _ = workflow.run_search(prepared(problem, exp), out, stop=stop, on_generation=on_generation)
    assert r.best is None and json.loads((out / "summary.json").read_text())["best"] is None
    with pytest.raises(workflow.Infeasible, match="no policy found under the budget"):
        workflow.run_search(prepared(problem, exp), out, resume=True)
    assert not out.exists()


def test_another_experiments_folder_is_refused_without_force(problem, tmp_path):
    mine, other = experiment(tmp_path), experiment(tmp_path, "other")
    out = tmp_path / "results" / "exp"
    workflow.run_search(prepared(problem, other), out)
    before = (out / "summary.json").read_text()
    with pytest.raises(workflow.Refused, match=r"holds the results of experiment 'other' \(.*other.yaml\), "
                                               r"not of 'exp' \(.*exp.yaml\); use --force"):
        workflow.run_search(prepared(problem, mine), out)
    assert (out / "summary.json").read_text() == before
    (out / "bench.csv").write_text("other's bench\n")
    workflow.run_search(prepared(problem, mine), out, force=True)
    assert json.loads((out / "summary.json").read_text())["experiment"] == "exp"
    assert not (out / "bench.csv").exists()  # another experiment's bench goes with its results
    (out / "bench.csv").write_text("my bench\n")
    (out / "validation.json").write_text("{}\n")
    workflow.run_search(prepared(problem, mine), out)  # the same experiment again: replaced, as always...
    assert (out / "bench.csv").read_text() == "my bench\n"  # ...but its bench table stays
    assert not (out / "validation.json").exists()  # it validated a policy that is gone
    # same name, another file
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(workflow.Refused, match="not of 'exp'"):
        workflow.check_results_folder(experiment(elsewhere), out)
    # a folder only a checkpoint made, or one that is not gaswap's
    partial = tmp_path / "results" / "partial"
    checkpoints.save(partial / checkpoints.NAME, {}, {}, {"experiment": "other", "experiment_file": "x.yaml"})
    with pytest.raises(workflow.Refused, match="experiment 'other' \\(x.yaml\\)"):
        workflow.check_results_folder(mine, partial)
    (tmp_path / "results" / "mine").mkdir()
    (tmp_path / "results" / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(workflow.Refused, match="no readable gaswap summary.json"):
        workflow.check_results_folder(mine, tmp_path / "results" / "mine")


def test_cli_refusals_exit_4_before_capturing_anything(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT)
    args = ["search", str(path), "--results", str(tmp_path / "results")]
    assert main(args + ["--resume"]) == 4
    assert "no checkpoint to resume from" in capsys.readouterr().err
    (tmp_path / "results" / "exp").mkdir(parents=True)
    (tmp_path / "results" / "exp" / "summary.json").write_text(json.dumps(
        {"experiment": "alexnet_4gb", "experiment_file": "experiments/alexnet_4gb.yaml"}))
    assert main(args) == 4
    err = capsys.readouterr().err
    assert "'alexnet_4gb' (experiments/alexnet_4gb.yaml)" in err and f"not of 'exp' ({path})" in err
    assert "--force" in err
    path.write_text(EXPERIMENT.replace("seed: 3", "name: ..\nseed: 3"))
    assert main(args) == 2 and "not starting with '.'" in capsys.readouterr().err


# --- a real process, a real Ctrl-C ---------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_on_a_real_search_then_resume(tmp_path):
    """SIGINT to the process group of `python -m gaswap search` with two workers, as a terminal's Ctrl-C."""
    path = tmp_path / "mlp.yaml"
    path.write_text(EXPERIMENT.replace("budget: 1500", "budget: 0.97x")
                    .replace("ga: {population: 24, generations: 15}", "ga: {population: 16, generations: 120, "
                             "workers: 2}"))
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "gaswap", "search", str(path), "--results", str(results)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ckpt = results / "mlp" / checkpoints.NAME
    deadline = time.monotonic() + 60
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not ckpt.exists():
        proc.kill()
        proc.communicate()
        pytest.skip("the search did not start within 60 s")
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    with pytest.raises(ProcessLookupError):  # the workers are gone too
        os.killpg(proc.pid, 0)
    summary = json.loads((results / "mlp" / "summary.json").read_text())
    assert summary["complete"] is False and summary["generations_done"] < 120
    assert f"resume with: python -m gaswap search {path} --resume --results {results}" in out
    assert "Traceback" not in err

    assert main(["search", str(path), "--results", str(results), "--resume"]) == 0
    assert not ckpt.exists()
    assert main(["search", str(path), "--results", str(tmp_path / "whole")]) == 0
    assert folder(results / "mlp") == folder(tmp_path / "whole" / "mlp")
