"""Figures of results folders (gaswap.app.report), drawn from a real tiny search and rendered headless; and
what the CLI around them prints (next steps, progress, units)."""
import configparser
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
from matplotlib.figure import Figure

matplotlib.use("Agg")

from gaswap.app import report
from gaswap.app.cli import main  # noqa: E402
from gaswap.base.config import format_size  # noqa: E402
from gaswap.plan import costfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MB = 10**6  # the tiny CNN's memory axes are in MB (decimal, the default display convention)


@pytest.fixture(scope="module")
def search_run(tmp_path_factory):
    """(results folder, cost cache, what the search printed) of a real search of the tiny CNN (seconds)."""
    tmp = tmp_path_factory.mktemp("report")
    cache = tmp / "cache"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["search", str(ROOT / "experiments/tiny_cnn_cpu.yaml"), "--results", str(tmp / "results"),
                     "--cache", str(cache)]) == 0
    return tmp / "results/tiny_cnn_cpu", cache, printed.getvalue()


@pytest.fixture(scope="module")
def searched(search_run):
    return search_run[:2]


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
    code = "import sys, gaswap.app.report; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_pareto_shows_the_front_baselines_keep_all_chosen_and_budget(folder, summary):
    fig = report.pareto(folder, close_up=False)
    (ax,) = fig.axes
    artists = labelled(ax)
    front = pd.read_csv(folder / "front.csv")
    distinct = report.load(folder).distinct_front()
    drawn = starting(artists, "GA front, hybrid")
    assert len(drawn.get_offsets()) == len(distinct) <= len(front)
    assert f"({len(front)} polic" in drawn.get_label()
    assert (f"{len(distinct)} distinct" in drawn.get_label()) == (len(distinct) < len(front))
    assert {"recompute-all", "swap-all", "keep-all (plain PyTorch)", "over budget"} <= artists.keys()
    keep = artists["keep-all (plain PyTorch)"].get_offsets()[0]
    assert tuple(keep) == pytest.approx((summary["keep_all"]["peak_bytes"] / MB, 0.0))
    chosen = starting(artists, "chosen, hybrid").get_offsets()[0]
    assert chosen[0] == pytest.approx(summary["best"]["peak_bytes"] / MB)
    assert chosen[1] == pytest.approx(100 * summary["best"]["overhead"], abs=1e-9)
    budget = starting(artists, f"budget {format_size(summary['budget_bytes'])}")
    assert budget.get_xdata()[0] == pytest.approx(summary["budget_bytes"] / MB)
    lo, hi = ax.get_xlim()  # every front point well inside the axes, not against an edge
    margin = 0.05 * (hi - lo)
    assert all(lo + margin < x < hi - margin for x in drawn.get_offsets()[:, 0])
    assert ax.get_xlabel() == "peak device memory (MB)"
    assert ax.get_ylabel() == "step-time overhead vs keep-all (%)"
    assert "tiny_cnn_cpu" in ax.get_title() and format_size(summary["budget_bytes"]) in ax.get_title()
    assert ax.get_legend() is not None


def test_pareto_overlays_folders_and_takes_baselines_from_bench_csv_at_its_budget(folder, summary, tmp_path):
    other = tmp_path / "tiny_again"
    shutil.copytree(folder, other)
    budget, keep_time = summary["budget_bytes"], summary["keep_all"]["step_time_s"]
    rows = [("keep_all", budget, 13e6, keep_time), ("dtr", budget, 9e6, 1.1 * keep_time),
            ("dtr", 2 * budget, 1e7, 1.05 * keep_time),  # another budget of the bench: not drawn
            ("swap_all", budget, 8e6, 1.5 * keep_time), ("ga:hybrid", budget, 8.5e6, keep_time)]
    pd.DataFrame([{"budget": "b", "budget_bytes": b, "method": m, "feasible": True, "peak_bytes": p,
                   "step_time_s": t, "overhead": t / keep_time - 1} for m, b, p, t in rows]).to_csv(
        other / "bench.csv", index=False)
    fig = Figure()
    ax = fig.subplots()
    assert report.pareto([other, folder], ax=ax) is fig
    artists = labelled(ax)
    assert list(starting(artists, "dtr").get_offsets()[:, 0]) == pytest.approx([9e6 / MB])
    assert "recompute-all" not in artists  # bench.csv replaces the seeds
    assert [label for label in artists if "keep-all" in label] == ["keep-all (plain PyTorch)"]  # once
    assert not any(label.startswith("GA, ") for label in artists)  # bench's GA rows: the fronts stand for it
    assert ax.get_legend().get_title().get_text().startswith(f"baselines: bench.csv at {format_size(budget)}")
    assert {"GA front, tiny_again", "GA front, tiny_cnn_cpu"} == {label.split(" (")[0] for label in artists
                                                                 if label.startswith("GA front")}


def test_a_method_looks_the_same_in_every_figure(folder, tmp_path):
    """swap-all from the seeds and from bench.csv, in two figures: one colour and one marker."""
    other = tmp_path / "benched"
    shutil.copytree(folder, other)
    body = json.loads((other / "summary.json").read_text())
    seeds = body["seeds"]
    pd.DataFrame([{"budget": "b", "budget_bytes": body["budget_bytes"], "method": m, "feasible": True,
                   "peak_bytes": e["peak_bytes"], "step_time_s": e["step_time_s"], "overhead": e["overhead"]}
                  for m, e in seeds.items()]).to_csv(other / "bench.csv", index=False)
    styles = []
    for f in (folder, other):
        swap = labelled(report.pareto(f, close_up=False).axes[0])["swap-all"]
        styles.append((tuple(swap.get_facecolor()[0]), swap.get_paths()[0].vertices.tobytes()))
    assert styles[0] == styles[1]
    assert len({s.color if isinstance(s.color, str) else tuple(s.color) for s in report.METHOD_STYLES.values()}) \
        == len(report.METHOD_STYLES)


def test_distinct_drops_policies_within_resolution_and_keeps_the_fastest():
    front = pd.DataFrame({"peak_bytes": [1000, 1001, 2000, 2000.5, 3000],
                          "step_time_s": [0.302, 0.301, 0.2, 0.2, 0.1]})
    kept = report.distinct(front, peak_bytes=5, step_time_s=0.005)
    assert list(kept.index) == [1, 2, 4]  # 1 is faster than 0; 2 and 3 are one point
    assert len(report.distinct(front, peak_bytes=0, step_time_s=0)) == 5  # no resolution: all distinct
    assert list(report.distinct(front, peak_bytes=1, step_time_s=0).index) == [0, 1, 2, 4]


def test_pareto_closes_up_on_a_narrow_front(folder, summary):
    fig = report.pareto(folder)
    if len(fig.axes) == 1:
        pytest.skip("this search's front is wide: no close-up")
    overview, zoom = fig.axes
    assert zoom.get_title().startswith("close-up")
    lo, hi = zoom.get_xlim()
    assert lo < summary["best"]["peak_bytes"] / MB < summary["budget_bytes"] / MB < hi
    assert (hi - lo) < (overview.get_xlim()[1] - overview.get_xlim()[0]) / 2


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
    assert budget.get_ydata()[0] == pytest.approx(summary["budget_bytes"] / MB)
    assert keep_ax.get_title().startswith(f"keep-all: peak {format_size(summary['keep_all']['peak_bytes'])}, "
                                          f"step {summary['keep_all']['step_time_s'] * 1e3:.1f} ms")
    assert policy_ax.get_title() == (f"policy.yaml: peak {format_size(summary['best']['peak_bytes'])}, step "
                                     f"{summary['best']['step_time_s'] * 1e3:.1f} ms "
                                     f"({100 * summary['best']['overhead']:+.1f} % vs keep-all)")
    assert "WARNING" not in fig.get_suptitle()
    assert keep_ax.get_ylabel() == "device memory (MB)" and streams_ax.get_xlabel() == "simulated time (ms)"
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
    div, unit = report.units.scale(total)
    assert sum(b.get_width() for c in ax.containers for b in c) == pytest.approx(total / div)
    assert ax.get_xlabel() == f"saved tensors' size ({unit})"


@pytest.mark.slow
def test_plot_results_writes_four_pngs_beside_the_results(searched):
    folder, cache = searched
    paths = report.plot_results(folder, cache_dir=cache)
    assert [p.name for p in paths] == ["pareto.png", "convergence.png", "memory_timeline.png", "action_map.png"]
    for path in paths:
        assert path.parent == folder and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


RUN_NOTEBOOK = """
import sys, nbclient, nbformat
notebook = nbformat.read(sys.argv[1], as_version=4)
nbclient.NotebookClient(notebook, timeout=300, resources={"metadata": {"path": sys.argv[2]}}).execute()
nbformat.write(notebook, sys.argv[3])
"""


@pytest.mark.slow
def test_notebook_runs_headless(searched, tmp_path):
    """In a child process: a kernel client's threads and sockets must not live on in the test process, whose
    later tests fork search workers."""
    for module in ("nbformat", "nbclient", "ipykernel"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[notebook]')")
    folder, cache = searched
    executed = tmp_path / "executed.ipynb"
    env = os.environ | {"GASWAP_RESULTS": str(folder), "GASWAP_CACHE": str(cache)}
    subprocess.run([sys.executable, "-c", RUN_NOTEBOOK, str(ROOT / "experiments/pareto.ipynb"),
                    str(ROOT / "experiments"), str(executed)], check=True, env=env, cwd=ROOT)
    cells = json.loads(executed.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    source = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in code]
    figures = [c for c, text in zip(code, source) if text.startswith("report.")]
    assert len(figures) == 4
    for cell, text in zip(figures, [t for t in source if t.startswith("report.")]):
        assert any("image/png" in out.get("data", {}) for out in cell["outputs"]), text
    (words,) = [c for c, text in zip(code, source) if "report.describe" in text]
    markdown = words["outputs"][0]["data"]["text/markdown"]
    assert report.describe([folder]) in ("".join(markdown) if isinstance(markdown, list) else markdown)


# ------------------------------------------------------------------ the costs a figure re-simulates with


def test_figures_use_the_costs_the_search_used_not_a_new_measurement(searched, summary, tmp_path):
    """costs.json holds the search's figures: an empty cost cache is never consulted (nothing is measured)."""
    folder, _ = searched
    assert (folder / costfile.NAME).is_file()
    empty = tmp_path / "empty_cache"
    replayed = report.replay(folder, cache_dir=empty)
    assert not empty.exists()  # nothing measured, nothing cached
    assert replayed.costs_note is None
    assert replayed.keep_all.step_time == summary["keep_all"]["step_time_s"]
    assert replayed.chosen.step_time == summary["best"]["step_time_s"]


def test_figures_say_loudly_when_they_measured_again(searched, tmp_path):
    """A folder without costs.json whose keep-all differs from what its costs give now: the timeline warns,
    and its percentages compare the policy with the keep-all drawn beside it, never the search's."""
    folder, cache = searched
    old = tmp_path / "old_results" / "tiny_cnn_cpu"
    shutil.copytree(folder, old)
    (old / costfile.NAME).unlink()
    body = json.loads((old / "summary.json").read_text())
    body["keep_all"]["step_time_s"] *= 0.5  # as if the search had measured another keep-all
    (old / "summary.json").write_text(json.dumps(body))
    with pytest.warns(UserWarning, match="measured again for this figure"):
        fig = report.memory_timeline(old, cache_dir=cache)
    keep_ax, policy_ax, _ = fig.axes
    assert "WARNING: costs measured again" in fig.get_suptitle()
    with pytest.warns(UserWarning):
        replayed = report.replay(old, cache_dir=cache)
    over = 100 * (replayed.chosen.step_time / replayed.keep_all.step_time - 1)
    assert policy_ax.get_title().endswith(f"({round(over, 1) + 0.0:+.1f} % vs keep-all)")


def test_a_damaged_or_foreign_costs_file_is_refused(folder, tmp_path):
    body = json.loads((folder / costfile.NAME).read_text())
    graph = body["graph_fingerprint"]
    assert costfile.load(folder, graph, body["op_time"]).op_time == body["op_time"]
    with pytest.raises(costfile.CostFileError, match="recorded for graph"):
        costfile.load(folder, "0" * 16, body["op_time"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / costfile.NAME).write_text(json.dumps(body | {"d2h_bandwidth": -1}))
    with pytest.raises(costfile.CostFileError, match="unusable"):
        costfile.load(bad, graph, body["op_time"])
    assert costfile.load(tmp_path, graph, body["op_time"]) is None  # no file: costs are got again


# ----------------------------------------------------------------------------------- the command line


def test_search_prints_the_next_commands_with_the_paths_it_wrote(search_run):
    folder, _, printed = search_run
    assert f"wrote {folder}/" in printed
    assert f"gaswap plot {folder}" in printed
    assert f"gaswap validate {folder / 'policy.yaml'} --steps" in printed
    assert f"gaswap.apply_step(model, '{folder / 'policy.yaml'}', inputs, target)" in printed


def test_a_search_redraws_the_figures_the_folder_had(searched, tmp_path, capsys):
    """Replacing results whose figures were committed leaves no deleted or stale figure behind."""
    folder, cache = searched
    root = tmp_path / "results"
    shutil.copytree(folder, root / folder.name)
    stale = root / folder.name / "pareto.png"
    stale.write_bytes(b"not a figure")
    assert main(["search", str(ROOT / "experiments/tiny_cnn_cpu.yaml"), "--results", str(root),
                 "--cache", str(cache)]) == 0
    for name in ("pareto", "convergence", "memory_timeline", "action_map"):
        assert (root / folder.name / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "drawing them again" in out and "gaswap plot" not in out  # already drawn: not a next step


def test_help_says_what_the_tool_does(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "memory budget" in text and "gaswap search" in text and "--units" in text
    assert "thin function" not in text


def test_gaswap_console_script_and_notebook_extra_are_declared():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    scripts = dict(line.split(" = ") for line in cfg["options.entry_points"]["console_scripts"].split("\n") if line)
    assert scripts == {"gaswap": "gaswap.app.cli:main"}
    notebook = cfg["options.extras_require"]["notebook"]
    assert all(name in notebook for name in ("nbclient", "ipykernel", "nbformat"))


def test_units_option_switches_every_size_shown(folder, capsys, monkeypatch):
    from gaswap.base import units

    monkeypatch.setattr(units, "_chosen", None)  # restored after the test
    assert format_size(4 * 10**9) == "4.00 GB"
    units.use("binary")
    assert format_size(4 * 10**9) == "3.73 GiB"
    assert report.load(folder).unit()[1] == "MiB"
    assert report.pareto(folder, close_up=False).axes[0].get_xlabel() == "peak device memory (MiB)"
    units.use(None)
    monkeypatch.setenv(units.ENV, "binary")
    assert format_size(2**20) == "1.00 MiB"
    monkeypatch.setenv(units.ENV, "metric")
    assert main(["plot", str(folder)]) == 2
    assert "GASWAP_UNITS='metric'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- notebook


def test_notebook_prose_holds_no_figures_and_describe_says_the_results(folder, summary):
    cells = json.loads((ROOT / "experiments/pareto.ipynb").read_text())["cells"]
    text_of = {"markdown": [], "code": []}
    for c in cells:
        text_of[c["cell_type"]].append("".join(c["source"]) if isinstance(c["source"], list) else c["source"])
    prose = " ".join(text_of["markdown"])
    assert not re.search(r"\d\s*(%|ms|[KMGT]i?B)\b", prose), "numbers belong in report.describe, not the prose"
    assert any("report.describe(FOLDERS)" in source for source in text_of["code"])
    text = report.describe(folder)
    best = summary["best"]
    assert format_size(best["peak_bytes"]) in text and f"{100 * best['overhead']:+.1f} %" in text
    assert f"The GA front holds {summary['front_size']} polic" in text


def test_bench_shows_progress_and_the_pareto_draws_only_its_rows_at_the_experiments_budget(searched, summary,
                                                                                           tmp_path, capsys):
    folder, cache = searched
    root = tmp_path / "results"
    shutil.copytree(folder, root / folder.name)
    assert main(["bench", str(ROOT / "experiments/tiny_cnn_cpu.yaml"), "--budgets", "0.9,0.7", "--results",
                 str(root), "--cache", str(cache), "--time-limit", "10"]) == 0
    captured = capsys.readouterr()
    assert "bench: 100%" in captured.err and "26/26" in captured.err  # 13 rows per budget
    assert f"wrote {root / folder.name}/ (bench.csv, bench.md)" in captured.out
    bench = pd.read_csv(root / folder.name / "bench.csv")
    assert set(bench["budget"].astype(str)) == {"0.9", "0.7"}
    artists = labelled(report.pareto(root / folder.name, close_up=False).axes[0])
    at_budget = bench[(bench["budget_bytes"] == summary["budget_bytes"]) & (bench["method"] == "swap_all")]
    assert len(at_budget) == 1  # 0.7x is the search's budget
    assert list(artists["swap-all"].get_offsets()[:, 0]) == pytest.approx(list(at_budget["peak_bytes"] / MB))
