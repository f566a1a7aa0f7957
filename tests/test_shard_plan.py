"""`gaswap search` of an experiment with `distributed:` (gaswap.app.shard_plan), through the CLI: the tiny Llama
searched end to end, and one-line refusals (exit 2, nothing written)."""
import csv
import json
from pathlib import Path

import pytest
import yaml

from gaswap.app.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "llama_tiny_fsdp_gloo.yaml"


@pytest.mark.slow
def test_tiny_llama_searched_end_to_end(tmp_path, capsys):
    assert main(["search", str(TINY), "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 over 2 ranks" in out and "keep-all" in out and "full AC" in out and "reserved" in out
    folder = tmp_path / "llama_tiny_fsdp_gloo"
    assert sorted(p.name for p in folder.iterdir()) == ["front.csv", "plan.yaml", "summary.json", "torchtitan.toml"]
    import tomllib
    assert "parallelism" in tomllib.loads((folder / "torchtitan.toml").read_text())
    summary = json.loads((folder / "summary.json").read_text())
    plans = summary["plans"]
    assert plans["full AC"]["peak_bytes"] < plans["keep-all"]["peak_bytes"]
    assert not plans["keep-all"]["fits"] and plans["best"]["fits"]
    assert plans["best"]["reserved_bytes"] >= plans["best"]["allocated_bytes"] >= plans["best"]["live_bytes"]
    assert sum(plans["keep-all"]["at_peak"].values()) == plans["keep-all"]["peak_bytes"]
    front = list(csv.DictReader((folder / "front.csv").open()))
    assert front and all(int(r["peak_bytes"]) <= summary["budget_bytes"] for r in front)
    best = yaml.safe_load((folder / "plan.yaml").read_text())
    assert best["predicted"]["peak_bytes"] == plans["best"]["peak_bytes"] and best["world_size"] == 2
    from gaswap.shard.apply import checkpoint_policy  # the torch side reads the file the search wrote

    policies = checkpoint_policy(folder / "plan.yaml")
    assert set(policies) == {"layers.0", "layers.1"} and best["units"] == ["layers.0", "layers.1", ""]
    (folder / "shard_compare.md").write_text("a table\n")  # another verb's file: a new search keeps it
    (folder / "stray.txt").write_text("x\n")
    assert main(["search", str(TINY), "--results", str(tmp_path)]) == 0
    assert (folder / "shard_compare.md").read_text() == "a table\n" and not (folder / "stray.txt").exists()


def _variant(tmp_path, **changes) -> Path:
    exp = yaml.safe_load(TINY.read_text())
    exp["distributed"] |= changes
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"units": ["Decoder"]}, "distributed.units: 'Decoder' matches no module of gaswap.zoo:llama"),
    ({"strategy": "zero2", "units": []}, "'zero2' is not modelled yet; only 'fsdp'"),
    ({"world_size": 4, "mesh": [2, 4]}, "distributed.mesh: must be [replicate, shard] with replicate x shard"),
])
def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, changes, message):
    path = _variant(tmp_path, **changes)
    assert main(["search", str(path), "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "results" / "variant").exists()
