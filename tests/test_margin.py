"""The margin a search keeps under its budget for what the device holds beyond the graph's tensors
(gaswap.run.workspace.margin, docs/gpu_memory.md "The margin a search keeps"): its figures, the budget
arithmetic, and the margin recorded in the results and policy files."""
import dataclasses
import json

import pytest
import yaml

from gaswap.app import cli, workflow
from gaswap.base import config
from gaswap.plan import policy as policies
from gaswap.plan.costs import Costs
from gaswap.plan.memory import allocator
from gaswap.run import workspace

MiB = 2**20
EXPERIMENT = """
model: {factory: gaswap.zoo:tiny_cnn, kwargs: {num_classes: 10, width: 16}}
inputs: [{shape: [batch, 3, 32, 32]}]
target: {shape: [batch], dtype: int64, high: 10}
loss: cross_entropy
batch_size: 128
costs: {source: estimate, profile: v100-pcie-16gb}
ga: {population: 16, generations: 4}
"""


def test_cublas_workspace_follows_torchs_rules():
    assert workspace.cublas_workspace((9, 0)) == 32 * MiB  # Hopper: 4096 KiB x 8
    assert workspace.cublas_workspace((8, 0)) == workspace.cublas_workspace((7, 0)) == 8 * MiB + 128 * 1024
    assert workspace.cublas_workspace((8, 0), ":4096:8") == 32 * MiB
    assert workspace.cublas_workspace((9, 0), ":128:8:64:16:32:32") == 3072 * 1024  # torch's own test of the rule
    assert workspace.cublas_workspace((9, 0), "-1") == 32 * MiB  # unparsable: the default, as torch warns


def test_a_profile_margin_is_cublas_workspace_on_its_architecture_and_says_what_it_leaves_out(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    v100, h100, cpu = (workspace.profile_margin(p) for p in ("v100-pcie-16gb", "h100-sxm-80gb", "cpu"))
    assert (v100.margin_bytes, h100.margin_bytes, cpu.margin_bytes) == (8 * MiB + 128 * 1024, 32 * MiB, 0)
    assert "sm_70" in v100.source and "torch's default" in v100.source and "transients" in v100.note
    assert v100.transient_bytes == 0 and v100.transient_op is None
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    set_here = workspace.profile_margin("v100-pcie-16gb")
    assert set_here.workspace_bytes == 32 * MiB and "CUBLAS_WORKSPACE_CONFIG=:4096:8" in set_here.source


def test_a_measured_margin_is_the_workspace_plus_the_largest_op_transient(monkeypatch):
    monkeypatch.setattr(workspace, "workspace_bytes", lambda dev: 32 * MiB)
    monkeypatch.setattr(workspace, "measure_transients", lambda graph, dev: workspace.Transients(
        {"conv": 3 * MiB, "mm": 5 * MiB, "sdpa": MiB}, {"conv": 0.25}))
    measured = Costs({}, 1e9, 1e9, "a GPU", "measured")
    m = workspace.margin(measured, "cuda", graph=None)
    assert (m.workspace_bytes, m.transient_bytes, m.transient_op, m.margin_bytes) == (32 * MiB, 5 * MiB, "mm",
                                                                                      37 * MiB)
    assert m.source == "measured on cuda" and m.transients == {"conv": 3 * MiB, "mm": 5 * MiB, "sdpa": MiB}
    assert m.capped_seconds == {"conv": 0.25}
    assert "transients" not in m.as_dict()  # the record a policy file keeps stays small
    cpu = workspace.margin(measured, "cpu", graph=None)
    assert cpu.margin_bytes == 0 and "step meter" in cpu.note
    synthetic = workspace.margin(Costs({}, 1e9, 1e9, "test", "test"), "cuda", graph=None)  # a test's own costs
    assert synthetic.margin_bytes == 0 and synthetic.source == "costs test"
    assert workspace.margin(Costs({}, 1e9, 1e9, "v100", "estimated:v100-pcie-16gb"), "auto", None) == \
        workspace.profile_margin("v100-pcie-16gb")


def test_what_a_margin_may_add_to_reservations_is_a_segment_of_its_own():
    assert workspace.Margin(32 * MiB, 0, None, "t").reserved_bytes() == 32 * MiB  # >= 10 MiB: its size, 2 MiB rounded
    assert workspace.Margin(8 * MiB + 128 * 1024, 0, None, "t").reserved_bytes() == 20 * MiB  # 1-10 MiB: 20 MiB
    assert workspace.Margin(32 * MiB, 300_000, "op", "t").reserved_bytes() == 34 * MiB  # a small block: 2 MiB
    assert workspace.Margin(32 * MiB, 0, None, "t").reserved_bytes(expandable_segments=True) == 40 * MiB  # 20 MiB pages
    assert workspace.Margin(0, 0, None, "t").reserved_bytes() == 0


def _experiment(tmp_path, budget, memory: str = ""):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT + f"budget: {budget}\n" + memory)
    return config.load_experiment(path)


def test_a_budget_is_planned_less_the_margin_and_a_fraction_is_of_keep_alls_peak_on_the_device(tmp_path):
    """On an H100 a GPT at 0.5x planned as a fraction of the graph's keep-all peak, the margin not kept, peaked 3.8 %
    over its budget (results/gpu_check/): cuBLAS's workspace and a 64 MiB transient came on top."""
    margin = workspace.Margin(8 * MiB, 2 * MiB, "op", "t")
    assert workflow.planning_budget(_experiment(tmp_path, "100MiB"), 50 * MiB, margin) == (100 * MiB, 90 * MiB)
    reserved = _experiment(tmp_path, "100MiB", "memory: {target: reserved}\n")
    assert workflow.planning_budget(reserved, 50 * MiB, margin) == (100 * MiB, 100 * MiB - 20 * MiB - 20 * MiB)
    budget, planned = workflow.planning_budget(_experiment(tmp_path, "0.5x"), 90 * MiB, margin)
    assert (budget, planned) == (50 * MiB, 40 * MiB)  # half of 90 MiB + 10 MiB, less the 10 MiB
    assert workflow.planning_budget(_experiment(tmp_path, "0.5x"), 90 * MiB, workspace.Margin(0, 0, None, "cpu")) == \
        (45 * MiB, 45 * MiB)  # no margin (a CPU): half the graph's peak, as it always was
    with pytest.raises(workflow.Infeasible, match=r"exp.yaml: the budget 10.49 MB leaves nothing once 10.49 MB is "
                                                  r"kept for what the device holds beyond the graph's tensors \(t\)"):
        workflow.planning_budget(_experiment(tmp_path, "10MiB"), 50 * MiB, margin)


@pytest.mark.parametrize("target", ["live", "reserved"])
def test_a_search_plans_for_the_budget_less_the_margin_and_records_it(tmp_path, target, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    memory = f"memory: {{target: {target}}}\n"
    prepared = workflow.prepare(_experiment(tmp_path, "0.5x", memory))
    keep_all = workflow.planning_problem(prepared).keep_all().peak_bytes
    budget = keep_all  # keep-all itself fits the budget, not the budget less the margin
    exp = _experiment(tmp_path, budget, memory)
    prepared = dataclasses.replace(prepared, experiment=exp)  # the same graph and costs, an absolute budget
    out = tmp_path / "results" / "exp"
    result, summary = workflow.run_search(prepared, out)
    kept = 8 * MiB + 128 * 1024 if target == "live" else 20 * MiB  # V100: cuBLAS's default, in a 20 MiB segment
    assert summary["budget_bytes"] == budget and summary["planning_budget_bytes"] == budget - kept
    assert summary["device_margin"]["kept_bytes"] == kept
    assert json.loads((out / "summary.json").read_text())["device_margin"] == summary["device_margin"]
    assert summary["keep_all"]["peak_bytes"] > budget - kept  # the margin decides what fits
    assert result.best is not None and result.best.peak_bytes <= budget - kept
    said = cli.table(result, summary).splitlines()[-1]
    assert said.startswith(f"planned for {config.format_size(budget - kept)}: {config.format_size(kept)} kept for "
                           f"what the device holds beyond the graph's tensors (profile v100-pcie-16gb: cuBLAS "
                           f"workspace on sm_70, torch's default; op transients")
    assert all(e.peak_bytes <= budget - kept for e in result.front if e.feasible(budget - kept))
    policy = policies.load(out / "policy.yaml", prepared.graph)
    assert policies.kept_margin(policy) == kept
    assert policy.provenance["planning_budget_bytes"] == budget - kept
    assert policy.provenance["device_margin"]["source"].startswith("profile v100-pcie-16gb")
    if target == "reserved":  # the predicted peaks stay the graph's: the policy check replays them as they are
        assert allocator.replay(prepared.graph, policy, **workflow.allocator_options(exp)).reserved == \
            policy.predicted["reserved_bytes"]


def test_a_policy_with_a_malformed_margin_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    prepared = workflow.prepare(_experiment(tmp_path, "0.7x"))
    out = tmp_path / "results" / "exp"
    workflow.run_search(prepared, out)
    body = yaml.safe_load((out / "policy.yaml").read_text())
    assert policies.kept_margin(policies.load(out / "policy.yaml")) == 8 * MiB + 128 * 1024  # a fraction keeps it too
    assert body["provenance"]["device_margin"]["workspace_bytes"] == 8 * MiB + 128 * 1024
    body["provenance"]["device_margin"]["kept_bytes"] = -1
    body["checksum"] = policies._checksum(body)
    (out / "bad.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
    with pytest.raises(policies.PolicyError, match=r"bad.yaml: provenance: device_margin: must be a mapping whose "
                                                   r"workspace_bytes, transient_bytes, margin_bytes, kept_bytes"):
        policies.load(out / "bad.yaml")


def test_a_budget_the_margin_takes_whole_is_refused_in_one_line_with_exit_3(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT + "budget: 8MiB\n")
    assert cli.main(["search", str(path), "--results", str(tmp_path / "results")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: {path}: the budget 8.39 MB leaves nothing once 8.52 MB is kept for what the device "
                       f"holds beyond the graph's tensors (profile v100-pcie-16gb: cuBLAS workspace on sm_70, torch's "
                       f"default); raise the budget")


@pytest.mark.parametrize("target", ["live", "reserved"])
def test_policies_searched_with_measured_transients_predict_the_peak_the_device_meters(tmp_path, target, monkeypatch):
    """On an H100 the allocator model with each op's transients gave GPT's metered peak to 208 bytes in five runs,
    the graph's tensors alone up to 9.6 % under it (results/gpu_check/): a policy carries that figure."""
    memory = f"memory: {{target: {target}}}\n"
    prepared = workflow.prepare(_experiment(tmp_path, "0.7x", memory))
    transients = {op.name: 300_000 for op in prepared.graph.ops}  # as if measured on a device: every op's
    margin = workspace.Margin(MiB, 300_000, prepared.graph.ops[0].name, "measured on cuda:0", "", transients)
    monkeypatch.setattr(workflow, "device_margin", lambda prepared: margin)
    out = tmp_path / "results" / "exp"
    workflow.run_search(prepared, out)
    policy = policies.load(out / "policy.yaml", prepared.graph)
    exp = prepared.experiment
    device = policy.predicted["device_peak_bytes"]
    if target == "live":  # the step's requested bytes: the workspace, made before the step, left out
        assert device == allocator.replay(prepared.graph, policy, transients=transients,
                                          optimizer=exp.optimizer).requested
        assert policy.predicted["peak_bytes"] < device <= policy.predicted["peak_bytes"] + 300_000
    else:  # the reservations, the workspace's segment in
        assert device == allocator.replay(prepared.graph, policy, workspace=MiB, transients=transients,
                                          **workflow.allocator_options(exp)).reserved
        assert device >= policy.predicted["reserved_bytes"]  # in the slack of its segments, or more
    assert "transients" not in policy.provenance["device_margin"]
    monkeypatch.setattr(workflow, "device_margin", lambda prepared: dataclasses.replace(margin, transients={}))
    workflow.run_search(prepared, out, force=True)
    assert "device_peak_bytes" not in policies.load(out / "policy.yaml", prepared.graph).predicted  # none measured


def test_validate_compares_a_cuda_peak_with_the_prediction_that_holds_the_transients():
    import torch

    from gaswap.app import validate

    predicted = {"peak_bytes": 1000, "step_time_s": 1.0, "device_peak_bytes": 1100}
    assert validate._on_device(predicted, torch.device("cuda", 0)) == {"peak_bytes": 1100, "graph_peak_bytes": 1000}
    assert validate._on_device(predicted, torch.device("cpu")) == {}  # the CPU's meter sees no transient
    assert validate._on_device({"peak_bytes": 1000}, torch.device("cuda", 0)) == {}  # none measured: the graph's


def test_validate_says_when_the_host_took_the_gpu_step_to_issue_it():
    """On an H100 gpt_bench's policies ran 6-84 % over their prediction, the host issuing each step for as long as
    it ran (results/gpu_check/, runs 8-14): `validate` reports the host's time and whether it bound the step."""
    import torch

    from gaswap.app import validate

    assert validate._host_figures([0.0098, 0.0099, 0.0120], 0.0101, torch.device("cuda", 0)) == (0.0099, True)
    assert validate._host_figures([0.0049, 0.0050, 0.0052], 0.0080, torch.device("cuda", 0)) == (0.0050, False)
    assert validate._host_figures([0.01], 0.01, torch.device("cpu")) is None  # a CPU runs the ops itself


def test_a_search_for_an_absolute_budget_prices_ops_at_their_capped_times(tmp_path, monkeypatch):
    """`validate` caps a run at an absolute budget, where cuDNN's convolutions take their least workspace and
    slower plans (`workspace.capped_costs`); a fraction of keep-all's peak runs uncapped, at the times alone."""
    prepared = workflow.prepare(_experiment(tmp_path, "0.7x"))
    op = prepared.graph.ops[0].name
    slow = prepared.costs.op_time[op] + 0.5
    margin = workspace.Margin(0, 0, None, "measured on cuda:0", "", {}, {op: slow})
    monkeypatch.setattr(workflow, "device_margin", lambda prepared: margin)
    keep_all = workflow.keep_all(prepared)
    _, fraction = workflow.run_search(prepared, tmp_path / "fraction")
    assert fraction["keep_all"]["step_time_s"] == pytest.approx(keep_all.step_time)
    capped = dataclasses.replace(prepared, experiment=_experiment(tmp_path, keep_all.peak_bytes))
    _, absolute = workflow.run_search(capped, tmp_path / "absolute")
    assert absolute["keep_all"]["step_time_s"] == pytest.approx(keep_all.step_time + 0.5)
    assert absolute["device_margin"]["ops_timed_capped"] == 1
