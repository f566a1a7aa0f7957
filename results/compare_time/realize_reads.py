"""Inductor's `realize_reads_threshold` (a pointwise value read by more consumers than this is written to memory,
else recomputed inside each reader; default 4) and the peak of the programs of the smallest candidate at 0.8 x
torch's lowest peak, where `below_floor.py` found every candidate over the budget (separable, gpt2_hf, the GRU): the
candidate searched as there, its programs written (no kernels compiled) at the default and at thresholds 1 to 3;
then separable's candidate compiled at the default and at 1 and timed in the same rotated rounds
(`methods.measure`, five rounds of five steps, CPU s). Run from the repository root:
    PYTHONPATH=. python results/compare_time/realize_reads.py > results/compare_time/realize_reads.txt
"""
import torch
from below_floor import searched_at_0_8x  # this folder's: the script's own, first on the path

from gaswap.compiled import dry_compile, partition
from gaswap.compiled import methods as compiled_methods
from gaswap.compiled.programs import step_peak
from gaswap.run import training

RUNS = (("separable", "separable_3fa5542"), ("gpt2_hf", "gpt2_hf_6996492"), ("gru", "gru_137499e"))
THRESHOLDS = (None, 1, 2, 3)


def smallest(name: str, run: str):
    """(experiment, model, inputs, target, graph, device, the smallest candidate's policy, its model peak, 0.8x
    budget), searched as `below_floor.py` does."""
    s = searched_at_0_8x(name, run)
    e = min(s.found.values(), key=lambda e: e.peak_bytes)
    policy = partition.make_policy(s.graph, s.unbounded.actions_of(s.problem.canonical(e.chromosome)),
                                   provenance={"optimizer": s.exp.optimizer, "counts": sorted(s.exp.counts)})
    return s.exp, s.model, s.inputs, s.target, s.graph, s.device, policy, e.peak_bytes - s.resident, 0.8 * s.lowest


for name, run in RUNS:
    exp, model, inputs, target, graph, device, policy, model_peak, budget = smallest(name, run)
    print(f"{name} ({run}): 0.8x = {budget / 1e6:.2f} MB; the smallest candidate's model peak "
          f"{model_peak / 1e6:.2f} MB", flush=True)
    for threshold in THRESHOLDS:
        patch = {} if threshold is None else {"realize_reads_threshold": threshold}
        peak = step_peak(dry_compile.programs_of(model, partition.backend(policy, **patch), *inputs),
                         graph.tensors[graph.loss].size, exp.loss)
        print(f"  realize_reads_threshold {threshold or 'default (4)'}: programs {peak / 1e6:.2f} MB "
              f"({'fits' if peak <= budget else 'over'})", flush=True)
    if name == "separable":
        timed = []
        for label, patch in (("default", {}), ("1", {"realize_reads_threshold": 1})):
            m, opt = training.fresh_copy(model, exp.optimizer)
            run_ = torch.compile(m, backend=partition.backend(policy, **patch), fullgraph=True, dynamic=False)
            timed.append(compiled_methods.Method("gaswap", label, m, run_, opt))
        for r in compiled_methods.measure(timed, inputs, target, exp.loss, device, 5, 5, lambda line: None):
            print(f"  compiled, realize_reads_threshold {r['knob']}: {r['step_s'] * 1e3:.2f} ms a step "
                  f"({r['step_min'] * 1e3:.2f}-{r['step_max'] * 1e3:.2f}), metered peak {r['peak_bytes'] / 1e6:.2f} MB",
                  flush=True)
