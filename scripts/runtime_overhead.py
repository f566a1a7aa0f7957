"""What the runtime itself costs: a keep-all policy replayed by gaswap's runtime vs the captured graph run
plainly (and eager PyTorch, for reference), on a GRU language model whose cell is unrolled over 24 steps
(`gaswap.zoo:gru`, small widths: many small ops), CPU, one thread.

    PYTHONPATH=. python scripts/runtime_overhead.py [--steps 24] [--width 32] [--rounds 15] [--block 20] [--arena]

Each round runs `--block` training steps of each method back to back, the order rotated from round to
round, and takes the process CPU time of each block. Printed: CPU ms per step (median and range over the
rounds) and the per-round ratio to the plain graph (median and range). Then the step time the costs
`profile_step` measures in place predict (they include the runtime's own per-op overhead) against the
measured one. With `--arena`, the same keep-all policy run from a preallocated arena (gaswap.run.arena_runtime,
gradients in it too) is timed as well.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gaswap import zoo
from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.simulator import Simulator
from gaswap.run.capture import capture
from gaswap.run.measure import profile_step, use_cpu
from gaswap.run.runtime import StepRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="time steps the GRU cell is unrolled over")
    parser.add_argument("--width", type=int, default=32, help="hidden width and vocabulary size")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=20, help="training steps per method per round")
    parser.add_argument("--arena", action="store_true", help="also time the policy run from a preallocated arena")
    a = parser.parse_args()
    use_cpu(threads=1)
    torch.manual_seed(0)
    model = zoo.gru(vocab=a.width, width=a.width, steps=a.steps)
    x, y = (torch.randint(0, a.width, (a.batch, a.steps)) for _ in range(2))
    cap = capture(model, (x,), y, "cross_entropy")
    enc = Encoding(cap.graph)
    keep = enc.uniform(Action.KEEP)
    unit = Costs(dict.fromkeys((op.name for op in cap.graph.ops), 1.0), 1.0, 1.0, "any", "any")
    program = Simulator(cap.graph, unit).run(enc.decode(keep.keys), keep.actions, trace=True).program
    runner = StepRunner(cap, program)
    args = lambda: cap.arguments(model, [x], y)  # noqa: E731

    def plain():
        with torch.no_grad():
            cap.gm(*args())

    def policy():
        runner(args())

    def eager():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).reshape(-1, a.width), y.reshape(-1)).backward()

    methods = {"plain graph": plain, "keep-all policy": policy, "eager PyTorch": eager}
    if a.arena:
        from gaswap.run.arena_runtime import ArenaRunner

        from_arena = ArenaRunner(cap, program, results_in_arena=True)
        methods["keep-all, arena"] = lambda: from_arena(args())
    print(f"GRU cell unrolled over {a.steps} steps, width {a.width}, batch {a.batch}: {len(cap.graph.ops)} ops, "
          f"{sum(1 for n in cap.gm.graph.nodes if n.op == 'call_function')} calls with views; "
          f"1 thread; {a.rounds} rounds x {a.block} steps per method, order rotated")
    for fn in methods.values():  # warm up
        for _ in range(3):
            fn()
    cpu = {name: [] for name in methods}
    names = list(methods)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.process_time()
            for _ in range(a.block):
                methods[name]()
            cpu[name].append((time.process_time() - start) / a.block)
    print(f"{'method':<16} {'CPU ms/step (median, range)':>30} {'vs plain graph (median, range)':>34}")
    for name in names:
        ratios = [t / p for t, p in zip(cpu[name], cpu["plain graph"])]
        print(f"{name:<16} {_figure([t * 1e3 for t in cpu[name]], '{:.3f}'):>30} {_figure(ratios, '{:.3f}'):>34}")

    profile = profile_step(cap, args, "cpu")
    predicted, measured = sum(profile.op_time.values()), statistics.median(cpu["keep-all policy"])
    print(f"costs timed in place (profile_step, each op with the views and frees around it): keep-all step "
          f"predicted {predicted * 1e3:.3f} ms, measured {measured * 1e3:.3f} ms CPU (median above): "
          f"measured / predicted {measured / predicted:.3f}")


def _figure(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


if __name__ == "__main__":
    main()
