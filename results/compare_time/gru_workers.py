"""The GRU's phases drift (issue 34): do idle compile workers, alive through a compare's calibration and gone before
its head to head, change the measuring process's CPU time a step? Eager and torch.compile at 1.0 and 0.5 timed as
a compare times them (`methods.measure`, 4 rotated rounds), with a `pool.CompilePool` of two workers started and
idle (each compiled torch's two partitions), then with the pool closed; three times. Run from the repository root:
    python results/compare_time/gru_workers.py > results/compare_time/gru_workers.txt
"""
import sys, time
from gaswap.base import config
from gaswap.compiled import methods as cm, pool
from gaswap.compiled.methods import Method, ROUND_S
from gaswap.run import training
exp = config.load_experiment("experiments/compare_gru_cpu.yaml")
device, model, inputs, target, graph = cm.setup(exp)
cm.allow_recompiles(8)
made = []
m, opt = training.fresh_copy(model, exp.optimizer)
made.append(Method("eager", "-", m, m, opt))
for b in (1.0, 0.5):
    m, opt = training.fresh_copy(model, exp.optimizer)
    made.append(Method("torch.compile", f"{b:g}", m, cm.torch_compiled(m, b), opt))
for m in made:
    cm.warm_up(m, inputs, target, exp.loss, device, lambda s: None)
def timed(tag):
    rows = cm.measure(made, inputs, target, exp.loss, device, 4, 3, lambda s: None, metered=1, round_s=ROUND_S)
    print(tag, "  ".join(f"{m.name[:5]} {m.knob}: {r['step_s']*1e3:6.2f}" for m, r in zip(made, rows)), flush=True)
for rep in range(3):
    p = pool.CompilePool(exp.path, 2, lambda s: None, local=(model, inputs))
    p.submit([pool.Job("torch.compile 1", budget=1.0), pool.Job("torch.compile 0.5", budget=0.5)])
    p.compile([])
    timed(f"rep {rep} workers alive ")
    p.close()
    timed(f"rep {rep} workers closed")
