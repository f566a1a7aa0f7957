"""docs/models.md's table is scripts/model_families.py's, and what it reports holds together."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "model_families"
FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "bert_masked", "vit", "resnet", "convnext")


def _rows() -> list[dict]:
    return json.loads((RESULTS / "families.json").read_text())["rows"]


def test_the_docs_table_is_the_scripts():
    table = (RESULTS / "table.md").read_text()
    assert table in (ROOT / "docs" / "models.md").read_text()


def test_every_family_was_searched_validated_and_run_bit_for_bit_under_its_policy():
    rows = {r["family"]: r for r in _rows()}
    assert set(FAMILIES) <= set(rows)
    for name in FAMILIES:
        r = rows[name]
        assert (r["search_exit"], r["validate_exit"]) == (0, 0), name
        # measured = predicted + Adam's float32 `step` counter per parameter tensor, which the model of the
        # optimizer state (2x the parameters' bytes) leaves out: 84 to 168 bytes here
        assert 0 <= r["measured_peak_bytes"] - r["predicted_peak_bytes"] < 1e-4 * r["predicted_peak_bytes"], name
        assert r["predicted_peak_bytes"] < r["keep_all_peak_bytes"], name
        assert r["equals_captured_step"], name
        policy = (RESULTS / name / "policy.yaml").read_text()
        assert ("specialized:" in policy) == bool(r["specialized"]), name


def test_bert_with_its_mask_is_specialized_on_the_padded_example():
    (bert,) = [r for r in _rows() if r["family"] == "bert_masked"]
    assert [(op, value) for op, _, value in bert["specialized"]] == [("aten._local_scalar_dense.default", False)]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_experiment_file_is_what_the_script_writes(name, tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import model_families
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    written = model_families.experiment_file(name, tmp_path)
    assert written.read_text() == (RESULTS / "experiments" / f"{name}.yaml").read_text()
