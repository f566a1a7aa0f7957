"""Running from another folder (gaswap.base.locate) and on another device (gaswap.plan.planned)."""
import shutil
from pathlib import Path

import pytest

from gaswap.app.cli import main
from gaswap.base import locate
from gaswap.base.config import load_experiment
from gaswap.plan import planned

ROOT = Path(__file__).resolve().parents[1]

MODEL = '''
import torch.nn as nn


def mlp(width: int = 8):
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
'''
EXPERIMENT = '''
model: {factory: "mymodels.nets:mlp", kwargs: {width: 8}}
inputs: [{shape: [batch, 4]}]
target: {shape: [batch], dtype: int64, high: 2}
batch_size: 4
loss: cross_entropy
budget: 1.0x
costs: {source: estimate, profile: v100-pcie-16gb}
ga: {population: 8, generations: 2}
'''


@pytest.fixture
def project(tmp_path):
    """A user's folder: experiments/my_mlp.yaml naming a factory in experiments/mymodels/nets.py."""
    (tmp_path / "experiments/mymodels").mkdir(parents=True)
    (tmp_path / "experiments/mymodels/__init__.py").write_text("")
    (tmp_path / "experiments/mymodels/nets.py").write_text(MODEL)
    (tmp_path / "experiments/my_mlp.yaml").write_text(EXPERIMENT)
    return tmp_path


def test_a_factory_beside_the_experiment_file_imports_from_any_folder(project, tmp_path_factory, monkeypatch):
    from gaswap.app.workflow import build_model

    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # restored after the test
    model = build_model(load_experiment(project / "experiments/my_mlp.yaml"))
    assert model[0].out_features == 8


def test_a_factory_not_found_says_where_it_looked_and_how_to_fix_it(tmp_path):
    with pytest.raises(ImportError, match=r"nowhere_module.*experiment's folder .*PYTHONPATH"):
        locate.import_module("nowhere_module.nets", tmp_path)
    with pytest.raises(ModuleNotFoundError):  # without a folder to look in: the plain error
        locate.import_module("nowhere_module.nets")


def test_experiment_file_is_found_from_the_policy_when_run_elsewhere(tmp_path, monkeypatch):
    (tmp_path / "work/experiments").mkdir(parents=True)
    (tmp_path / "work/experiments/x.yaml").write_text("")
    policy = tmp_path / "work/results/x/policies/p000.yaml"
    recorded = {"experiment_file": "experiments/x.yaml"}
    monkeypatch.chdir(tmp_path)
    assert locate.experiment_file(recorded, policy, "p") == tmp_path / "work/experiments/x.yaml"
    # results written outside the folder the search ran in: the error says what to do
    far = tmp_path / "far/results/x/policy.yaml"
    with pytest.raises(FileNotFoundError, match=r"^p: names the experiment file 'experiments/x.yaml' \(as given.*run from "
                                          r"the folder the search ran in"):
        locate.experiment_file(recorded, far, "p")


def test_validate_works_from_another_folder_and_warns_of_another_device(project, tmp_path_factory, monkeypatch,
                                                                         capsys):
    """A search of a user's own model in its folder; validate from elsewhere on the CPU, which is not the V100
    the policy was planned for: it runs, and says the predicted time is not this device's."""
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    monkeypatch.chdir(project)
    assert main(["search", "experiments/my_mlp.yaml"]) == 0
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    capsys.readouterr()
    assert main(["validate", str(project / "results/my_mlp/policy.yaml"), "--steps", "3", "--device", "cpu",
                 "--trust-factory"]) == 0  # the factory is named only by the policy: the user vouches for it
    captured = capsys.readouterr()
    assert "measured" in captured.out and "(planned for another device)" in captured.out
    assert "warning: the policy was planned for v100-pcie-16gb" in captured.err
    assert "validate: 100%" in captured.err  # the progress bar went through every step
    # the same warning where users train: gaswap.apply_step in their own loop
    import gaswap
    from gaswap.app import workflow

    exp = load_experiment(project / "experiments/my_mlp.yaml")
    model = workflow.build_model(exp, device="cpu")
    inputs, target = workflow.make_inputs(exp, "cpu")
    with pytest.warns(UserWarning, match="planned for v100-pcie-16gb"):
        gaswap.apply_step(model, project / "results/my_mlp/policy.yaml", inputs, target)
    shutil.move(project / "experiments/my_mlp.yaml", project / "gone.yaml")
    assert main(["validate", str(project / "results/my_mlp/policy.yaml"), "--steps", "3", "--trust-factory"]) == 2
    assert "policy.yaml: provenance.experiment_file: names the experiment file" in capsys.readouterr().err


def test_mismatch_names_the_device_or_thread_count():
    cpu1 = {"device": "cpu: AMD EPYC (1 thread)", "cost_source": "measured"}
    assert planned.mismatch(cpu1, "cpu: AMD EPYC (1 thread)") is None
    assert "measured with 1 CPU thread(s) and this run uses 4" in planned.mismatch(cpu1, "cpu: AMD EPYC (4 threads)")
    assert "measured on cpu: AMD EPYC (1 thread)" in planned.mismatch(cpu1, "NVIDIA H100 80GB HBM3")
    v100 = {"device": "v100-pcie-16gb", "cost_source": "estimated:v100-pcie-16gb"}
    assert "planned for v100-pcie-16gb" in planned.mismatch(v100, "cpu: AMD EPYC (2 threads)")
    assert planned.mismatch({}, "cpu") is None
