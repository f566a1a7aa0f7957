"""Would pairing rounds steady a compare's verdicts? A compare's pick against torch.compile 1: their ratio as compare
reports it (the ratio of the two methods' medians over all timed steps) and as the median of per-round ratios, each
over repeated measurements of 3 (a finalist round) and 5 (the head to head) rotated rounds of about 0.25 s a method.
CPU seconds. Run from the repository root:
    PYTHONPATH=. python results/compare_time/paired_rounds.py unet unet_a5f6da6 20 > results/compare_time/paired_rounds.txt
"""
import os
import statistics
import sys

from gaswap.base import config
from gaswap.compiled import methods as cm, partition
from gaswap.compiled.methods import Method
from gaswap.plan import policy as policies
from gaswap.run import training
name, run, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
device, model, inputs, target, graph = cm.setup(exp)
pol = policies.load(f"results/compare_time/{run}/p00.yaml")
t, to = training.fresh_copy(model, exp.optimizer)
g, go = training.fresh_copy(model, exp.optimizer)
ms = [Method("torch.compile", "1", t, cm.torch_compiled(t, 1.0), to), Method("gaswap", "pick", g, partition.compile(g, pol), go)]
for m in ms:
    cm.warm_up(m, inputs, target, exp.loss, device, lambda s: None)
step = lambda m: m.step(inputs, target, exp.loss, device)[1]
n = max(2, int(0.25 / statistics.median([step(ms[0]) for _ in range(5)])))
def one_call(rounds):
    per = [[], []]
    for r in range(rounds):
        for i in ([0, 1] if r % 2 == 0 else [1, 0]):
            step(ms[i]); per[i].append([step(ms[i]) for _ in range(n)])
    flat = [statistics.median([x for rr in p for x in rr]) for p in per]
    pairs = [statistics.median(b) / statistics.median(a) for a, b in zip(*per)]
    return flat[1] / flat[0] - 1, statistics.median(pairs) - 1, flat[0]
print(os.popen('uptime').read().strip())
for rounds in (3, 5):
    res = [one_call(rounds) for _ in range(calls)]
    a = [x[0] for x in res]; b = [x[1] for x in res]; lvl = [x[2] * 1e3 for x in res]
    print(f"{name} {rounds} rounds x {n} steps, {calls} calls; torch 1 level {min(lvl):.2f}-{max(lvl):.2f} ms")
    print(f"  ratio of medians : median {statistics.median(a):+.1%} stdev {statistics.stdev(a):.1%} range {min(a):+.1%}..{max(a):+.1%}")
    print(f"  median of ratios : median {statistics.median(b):+.1%} stdev {statistics.stdev(b):.1%} range {min(b):+.1%}..{max(b):+.1%}", flush=True)
print(os.popen('uptime').read().strip())
