"""Does torch's partitioner reach below its least peak at budgets under 0.2? (issue 34, item 2: the 0.8x point.) For
the seven compare experiments without a 0.8x point at 3909fd4 or 1eabfb1, the peak of inductor's programs
(`dry_compile.torch_peak`, no kernels compiled) under `activation_memory_budget` 1, 0.5, 0.2, 0.1, 0.05 and 0, beside
0.8x the least peak torch.compile measured in the stored run. Run from the repository root:
    PYTHONPATH=. python results/compiled_model/torch_floor.py > results/compiled_model/torch_floor.txt
"""
import csv
import os

from gaswap.base import config
from gaswap.base.config import format_size
from gaswap.compiled import dry_compile
from gaswap.compiled import methods as cm

RUNS = (("vit", "vit_3909fd4"), ("unet", "unet_3909fd4"), ("llama", "llama_3909fd4"),
        ("mixture", "mixture_3909fd4"), ("normmix", "normmix_1eabfb1"), ("gpt2_hf", "gpt2_hf_1eabfb1"),
        ("gru", "gru_1eabfb1"))
BUDGETS = (1.0, 0.5, 0.2, 0.1, 0.05, 0.0)


def main() -> None:
    print(os.popen("uptime").read().strip())
    print("experiment | 0.8x the least measured | programs' peak at activation_memory_budget "
          + " / ".join(f"{b:g}" for b in BUDGETS))
    for name, run in RUNS:
        exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
        device, model, inputs, target, graph = cm.setup(exp)
        least = min(int(r["peak_bytes"]) for r in csv.DictReader(open(f"results/compare_time/{run}/compare.csv"))
                    if r["method"] == "torch.compile")
        peaks = [dry_compile.torch_peak(model, b, inputs, graph.tensors[graph.loss].size, exp.loss) for b in BUDGETS]
        print(f"{name} ({run}) | {format_size(int(0.8 * least))} | " + " / ".join(format_size(p) for p in peaks),
              flush=True)


if __name__ == "__main__":
    main()
