"""Does a longer round change a step's median (compare.ROUND_S)? The GRU's eager step and torch.compile (budget 1): rounds
of 3 and of 28 timed steps, alternating, each after a metered and an untimed step, CPU seconds. Run from the repository
root: PYTHONPATH=. python results/compare_time/rounds_bias.py > results/compare_time/rounds_bias.txt"""
import statistics
from functools import partial
from gaswap.app import compare
from gaswap.base import config
from gaswap.compiled import methods as cm
from gaswap.run import training
exp = compare.search_settings(config.load_experiment("experiments/compare_gru_cpu.yaml"))
device, model, inputs, target, graph = cm.setup(exp)
out = {}
for name, run in (("eager", None), ("torch 1", 1.0)):
    m, opt = training.fresh_copy(model, exp.optimizer)
    meth = cm.Method(name, "-", m, m if run is None else cm.torch_compiled(m, run), opt)
    cm.warm_up(meth, inputs, target, exp.loss, device, lambda s: None)
    step = partial(meth.step, inputs, target, exp.loss, device)
    short, long_ = [], []
    for r in range(8):
        for count, into in ((3, short), (28, long_)) if r % 2 == 0 else ((28, long_), (3, short)):
            _, _, timed = training.metered_round(step, device, count)
            into += [cpu for _, cpu in timed]
    print(f"{name}: rounds of 3: median {statistics.median(short)*1e3:.2f} ms ({len(short)} steps, "
          f"{min(short)*1e3:.2f}-{max(short)*1e3:.2f}); rounds of 28: median {statistics.median(long_)*1e3:.2f} ms "
          f"({len(long_)} steps, {min(long_)*1e3:.2f}-{max(long_)*1e3:.2f})", flush=True)
