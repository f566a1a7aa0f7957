"""Checkpoint files are data: a forged or oversized one is refused in one line before the search reads it."""
import hashlib
import json

import pytest

from gaswap.plan import checkpoint as checkpoints
from gaswap.plan.checkpoint import CheckpointError

STATE = {"generation": 3, "evaluations": 100, "seconds": 1.5, "smallest_peak": 4096, "rng": [3, [1, 2], None],
         "population": [], "archive": [], "seeds": {}, "history": []}


def forged(tmp_path, **changes):
    """A checkpoint whose checksum matches its (changed) state, as someone who edits it on purpose makes it."""
    path = tmp_path / checkpoints.NAME
    checkpoints.save(path, STATE | changes, {"seed": 0})
    return path


def test_a_well_formed_checkpoint_reads_back_equal(tmp_path):
    assert checkpoints.read(forged(tmp_path))["state"] == STATE


@pytest.mark.parametrize("key, value", [("generation", -5), ("evaluations", -1), ("seconds", float("inf")),
                                        ("smallest_peak", float("nan")), ("generation", "3"), ("generation", True)])
def test_a_forged_count_is_refused_naming_it(tmp_path, key, value):
    path = forged(tmp_path, **{key: value})
    with pytest.raises(CheckpointError, match=f"{path.name}: malformed checkpoint \\({key} must be a number >= 0\\)"):
        checkpoints.read(path)


def test_an_oversized_checkpoint_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = forged(tmp_path)
    monkeypatch.setattr(checkpoints, "MAX_BYTES", path.stat().st_size - 1)
    with pytest.raises(CheckpointError, match="cannot read the checkpoint: .*more than the"):
        checkpoints.read(path)


def test_a_folder_in_place_of_a_checkpoint_is_refused(tmp_path):
    (tmp_path / checkpoints.NAME).mkdir()
    with pytest.raises(CheckpointError, match="is a folder"):
        checkpoints.read(tmp_path / checkpoints.NAME)


def test_the_checksum_still_covers_the_state(tmp_path):
    path = forged(tmp_path)
    body = json.loads(path.read_text())
    assert body["sha256"] == hashlib.sha256(json.dumps(body["state"], sort_keys=True,
                                                       separators=(",", ":")).encode()).hexdigest()
