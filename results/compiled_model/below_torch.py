"""How far below torch's least peak a policy reaches from torch's own partition, one action at a time (issue 34,
item 2: the 0.8x point). `compare_screen.descended` as compare runs it with two workers (a step checks up to
`FLIP_BATCHES` batches of two flips; written here one after the other), without a deadline: from the partition of
torch's least measured peak in a stored run, read back, the flips the compiled model (the run's calibration,
`p00.yaml`) predicts lower the peak, lowest first, each checked by inductor's programs (`dry_compile`, no kernels
compiled), until they fit 0.8x that peak. The meter's offset beyond the programs is the run's (its torch rows).
Run from the repository root (the costs are the stored runs'; the figures committed were made with a fresh
TORCHINDUCTOR_CACHE_DIR, and at 7c8aff0, before the pace stop, which a run without a deadline never meets):
    PYTHONPATH=. python results/compiled_model/below_torch.py > results/compiled_model/below_torch.txt
"""
import csv
import os
import sys
import time

from gaswap.app import compare_screen
import stored_run
from gaswap.base import config
from gaswap.base.config import format_size
from gaswap.compiled import partition, step_model
from gaswap.compiled import methods as cm
from gaswap.run.measure import measure

class _TwoWorkers:
    """Stands for two compile workers: a batch is two policies, each written in this process (`ProgramPeaks.peak`
    writes those a worker did not)."""
    workers = 2

    def program_peaks(self, policies, output_bytes):
        return [None] * len(policies)


RUNS = (("vit", "vit_3909fd4"), ("unet", "unet_3909fd4"), ("llama", "llama_3909fd4"),
        ("mixture", "mixture_3909fd4"), ("normmix", "normmix_1eabfb1"), ("gpt2_hf", "gpt2_hf_1eabfb1"),
        ("gru", "gru_1eabfb1"))


def main(name: str, run: str) -> None:
    folder = f"results/compare_time/{run}"
    exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
    device, model, inputs, target, graph = cm.setup(exp)
    costs = measure(graph, device, f"{folder}/costs", threads=exp.costs.threads)
    space = config.load_search_space(partition.space_for(device))
    calibration = stored_run.calibration_of(f"{folder}/p00.yaml")
    problem = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss, calibration=calibration)
    resident = problem.fused.resident_bytes()
    torch_rows = [r for r in csv.DictReader(open(f"{folder}/compare.csv")) if r["method"] == "torch.compile"]
    least = min(torch_rows, key=lambda r: int(r["peak_bytes"]))
    beyond = compare_screen.offset([int(r["peak_bytes"]) for r in torch_rows],
                                   [int(r["program_peak_bytes"]) if r["program_peak_bytes"] else None
                                    for r in torch_rows])
    knob = float(least["knob"])
    actions = partition.torch_partitions(model, *inputs, budgets=(knob,), optimizer=exp.optimizer,
                                         counted=exp.counts)[1][knob]
    start = problem.canonical(problem.encoding.read_back(actions))
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    peaks = compare_screen.ProgramPeaks(
        model, inputs, graph.tensors[graph.loss].size, exp.loss,
        lambda ch, inductor=None: partition.make_policy(graph, problem.actions_of(ch), provenance=provenance),
        beyond, progress=lambda line: None, workers=_TwoWorkers())
    target = int(0.8 * int(least["peak_bytes"]))
    cpu = time.process_time()
    found = compare_screen.descended(problem, start, resident + target, resident, peaks, float("inf"))
    cpu = time.process_time() - cpu
    base = problem.simulate(start).step_time
    said = ("does not fit" if found.policy is None else
            f"fits, {found.policy.step_time * 1e3:.2f} ms predicted ({found.policy.step_time / base - 1:+.1%})")
    print(f"{name} ({run}): from torch {knob:g}'s partition ({format_size(int(least['peak_bytes']))} measured, "
          f"{base * 1e3:.2f} ms predicted) to 0.8x = {format_size(target)}: {found.steps} actions changed, "
          f"{found.checked} flips checked, {len(peaks.known)} dry compiles in {cpu:.0f} CPU s; reached "
          f"{format_size(found.reached)}, {said}", flush=True)


if __name__ == "__main__":
    print(os.popen("uptime").read().strip())
    for name, run in RUNS:
        if len(sys.argv) == 1 or name in sys.argv[1:]:
            main(name, run)
