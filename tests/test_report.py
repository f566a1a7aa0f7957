"""Figures of results folders (gaswap.report), drawn from a real tiny search and rendered headless."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
from matplotlib.figure import Figure

matplotlib.use("Agg")

from gaswap import report  # noqa: E402
from gaswap.cli import main  # noqa: E402
from gaswap.config import format_size  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20  # the tiny CNN's memory axes are in MiB


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """(results folder, cost cache) of a real search of the tiny CNN (a few seconds)."""
    tmp = tmp_path_factory.mktemp("report")
    cache = tmp / "cache"
    assert main(["search", str(ROOT / "experiments/tiny_cnn_cpu.yaml"), "--results", str(tmp / "results"),
                 "--cache", str(cache)]) == 0
    return tmp / "results/tiny_cnn_cpu", cache


@pytest.fixture(scope="module")
def folder(searched):
    return searched[0]


@pytest.fixture(scope="module")
def summary(folder):
    return json.loads((folder / "summary.json").read_text())


def labelled(ax) -> dict:
    """The axes' legend entries: label -> artist."""
    handles, labels = ax.get_legend_handles_labels()
    return dict(zip(labels, handles))


def starting(artists: dict, prefix: str):
    (match,) = [a for label, a in artists.items() if label.startswith(prefix)]
    return match


def test_report_imports_no_torch():
    code = "import sys, gaswap.report; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_pareto_shows_the_front_baselines_keep_all_chosen_and_budget(folder, summary):
    fig = report.pareto(folder)
    (ax,) = fig.axes
    artists = labelled(ax)
    front = pd.read_csv(folder / "front.csv")
    assert len(starting(artists, "GA front, hybrid").get_offsets()) == len(front)
    assert {"recompute-all", "swap-all", "keep-all (plain PyTorch)", "over budget"} <= artists.keys()
    keep = artists["keep-all (plain PyTorch)"].get_offsets()[0]
    assert tuple(keep) == pytest.approx((summary["keep_all"]["peak_bytes"] / MIB, 0.0))
    chosen = starting(artists, "chosen, hybrid").get_offsets()[0]
    assert chosen[0] == pytest.approx(summary["best"]["peak_bytes"] / MIB)
    assert chosen[1] == pytest.approx(100 * summary["best"]["overhead"], abs=1e-9)
    budget = starting(artists, f"budget {format_size(summary['budget_bytes'])}")
    assert budget.get_xdata()[0] == pytest.approx(summary["budget_bytes"] / MIB)
    assert ax.get_xlabel() == "peak device memory (MiB)"
    assert ax.get_ylabel() == "step-time overhead vs keep-all (%)"
    assert "tiny_cnn_cpu" in ax.get_title() and format_size(summary["budget_bytes"]) in ax.get_title()
    assert ax.get_legend() is not None


def test_pareto_overlays_folders_and_takes_baselines_from_bench_csv(folder, tmp_path):
    other = tmp_path / "tiny_again"
    shutil.copytree(folder, other)
    pd.DataFrame({"method": ["checkmate-like", "checkmate-like", "swapadvisor-like"], "budget": [1, 2, 1],
                  "peak_bytes": [9e6, 1e7, 8e6], "step_time_s": [0.3, 0.28, 0.4], "overhead": [0.1, 0.05, 0.5],
                  "feasible": [True, False, True]}).to_csv(other / "bench.csv", index=False)
    fig = Figure()
    ax = fig.subplots()
    assert report.pareto([other, folder], ax=ax) is fig
    artists = labelled(ax)
    assert len(starting(artists, "checkmate-like").get_offsets()) == 2
    assert "swapadvisor-like" in artists and "swap-all" not in artists  # bench.csv replaces the seeds
    assert {"GA front, tiny_again", "GA front, tiny_cnn_cpu"} == {label.split(" (")[0] for label in artists
                                                                 if label.startswith("GA front")}


def test_pareto_refuses_folders_of_different_graphs(folder, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    body = json.loads((other / "summary.json").read_text())
    body["graph"]["fingerprint"] = "0" * 16
    (other / "summary.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match="different graphs"):
        report.pareto([folder, other])


def test_convergence_plots_best_time_and_hypervolume_per_generation(folder, summary):
    fig = report.convergence(folder)
    time_ax, volume_ax = fig.axes
    history = pd.read_csv(folder / "history.csv")
    line = labelled(time_ax)["GA, hybrid"]
    assert list(line.get_xdata()) == list(history["generation"])
    best_ms = history["best_time_s"].replace(float("inf"), float("nan")) * 1e3  # inf: nothing fits yet
    assert list(line.get_ydata()) == pytest.approx(list(best_ms), nan_ok=True)
    keep = starting(labelled(time_ax), "keep-all")
    assert keep.get_ydata()[0] == pytest.approx(summary["keep_all"]["step_time_s"] * 1e3)
    volume = 100 * history["hypervolume"] / history["hypervolume"].max()
    assert list(volume_ax.lines[0].get_ydata()) == pytest.approx(list(volume))
    assert "(ms)" in time_ax.get_ylabel() and "(% of its final value)" in volume_ax.get_ylabel()
    assert volume_ax.get_xlabel() == "generation"
    assert "tiny_cnn_cpu" in fig.get_suptitle() and format_size(summary["budget_bytes"]) in fig.get_suptitle()


def test_memory_levels_peak_at_the_simulated_peak(searched):
    replayed = report.replay(searched[0], cache_dir=searched[1])
    for run in (replayed.chosen, replayed.keep_all):
        levels = report._levels(run)
        assert levels.sum(axis=1).max() == run.peak_bytes
        assert levels.index[-1] == pytest.approx(run.step_time * 1e3)


def test_memory_timeline_stacks_categories_with_budget_and_streams(searched, summary):
    folder, cache = searched
    fig = report.memory_timeline(folder, cache_dir=cache)
    keep_ax, policy_ax, streams_ax = fig.axes
    artists = labelled(keep_ax)
    assert {"parameters", "activations", "backward pass starts"} <= artists.keys()
    budget = starting(artists, "budget")
    assert budget.get_ydata()[0] == pytest.approx(summary["budget_bytes"] / MIB)
    assert keep_ax.get_title().startswith(f"keep-all: peak {summary['keep_all']['peak_bytes'] / MIB:.2f} MiB")
    assert policy_ax.get_title().startswith(f"policy.yaml: peak {summary['best']['peak_bytes'] / MIB:.2f} MiB")
    assert keep_ax.get_ylabel() == "device memory (MiB)" and streams_ax.get_xlabel() == "simulated time (ms)"
    streams = labelled(streams_ax)
    if summary["best"]["swap"]:
        assert {"swap out (d2h copy)", "swap in (h2d copy)"} <= streams.keys()
    if summary["best"]["recompute"]:
        assert "recompute" in streams


def test_action_map_stacks_bytes_per_layer_and_action(searched, summary):
    folder, cache = searched
    fig = report.action_map(folder, cache_dir=cache)
    (ax,) = fig.axes
    bars = {c.get_label().split(":")[0]: c for c in ax.containers}
    assert list(bars) == ["keep", "swap", "recompute"]
    for action, container in bars.items():
        assert container.get_label().startswith(f"{action}: {summary['best'][action]} tensors")
    layers = [t.get_text() for t in ax.get_yticklabels()]
    assert layers[0] == "input" and len(layers) == len(bars["keep"])
    replayed = report.replay(folder, cache_dir=cache)
    total = sum(replayed.graph.tensors[t].size for t in replayed.policy.actions)
    assert sum(b.get_width() for c in ax.containers for b in c) == pytest.approx(total / MIB)
    assert ax.get_xlabel() == "saved tensors' size (MiB)"


@pytest.mark.slow
def test_plot_results_writes_four_pngs_beside_the_results(searched):
    folder, cache = searched
    paths = report.plot_results(folder, cache_dir=cache)
    assert [p.name for p in paths] == ["pareto.png", "convergence.png", "memory_timeline.png", "action_map.png"]
    for path in paths:
        assert path.parent == folder and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_notebook_runs_headless(searched, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    folder, cache = searched
    monkeypatch.setenv("GASWAP_RESULTS", str(folder))
    monkeypatch.setenv("GASWAP_CACHE", str(cache))
    notebook = nbformat.read(ROOT / "experiments/pareto.ipynb", as_version=4)
    resources = {"metadata": {"path": str(ROOT / "experiments")}}
    nbclient.NotebookClient(notebook, timeout=120, resources=resources).execute()
    figures = [c for c in notebook.cells if c.cell_type == "code" and c.source.startswith("report.")]
    assert len(figures) == 4
    for cell in figures:
        assert any("image/png" in out.get("data", {}) for out in cell.outputs), cell.source
