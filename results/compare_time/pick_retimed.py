"""A compare's pick and torch.compile 1 timed again side by side (issue 34: the U-Net's finalist round read its pick 11 %
faster than torch 1's partition, the head to head 0.0 %): as a finalist round times them (3 rotated rounds, the
first metered), as the head to head does (5 rounds, every one metered, eager among them), and the same without eager,
three times over in one process. CPU time per step, median (range) and steps timed. Run from the repository root:
    PYTHONPATH=. python results/compare_time/pick_retimed.py unet unet_a5f6da6 > results/compare_time/pick_retimed.txt
"""
import os
import sys

from gaswap.base import config
from gaswap.compiled import methods as cm, partition
from gaswap.compiled.methods import Method
from gaswap.plan import policy as policies
from gaswap.run import training
name = sys.argv[1]; run = sys.argv[2]
exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
device, model, inputs, target, graph = cm.setup(exp)
pol = policies.load(f"results/compare_time/{run}/p00.yaml")
e, eo = training.fresh_copy(model, exp.optimizer)
t, to = training.fresh_copy(model, exp.optimizer)
g, go = training.fresh_copy(model, exp.optimizer)
eager = Method("eager", "-", e, e, eo)
torch1 = Method("torch.compile", "1", t, cm.torch_compiled(t, 1.0), to)
pick = Method("gaswap", "pick", g, partition.compile(g, pol), go)
print(os.popen('uptime').read().strip())


def log(_):
    pass


def show(tag, ms, rows):
    print(tag, " ".join(f"{m.name[:6]} {r['step_s']*1e3:.2f} ({r['step_min']*1e3:.2f}-{r['step_max']*1e3:.2f}) n{r['steps_timed']}" for m, r in zip(ms, rows)), flush=True)
for k in range(3):
    ms = [torch1, pick]
    show("finalist-like", ms, cm.measure(ms, inputs, target, exp.loss, device, 3, 2, log, metered=1, round_s=cm.ROUND_S))
    ms = [eager, torch1, pick]
    show("h2h-like     ", ms, cm.measure(ms, inputs, target, exp.loss, device, 5, 3, log, round_s=cm.ROUND_S))
    ms = [torch1, pick]
    show("h2h no eager ", ms, cm.measure(ms, inputs, target, exp.loss, device, 5, 3, log, round_s=cm.ROUND_S))
print(os.popen('uptime').read().strip())
