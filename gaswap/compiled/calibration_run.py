"""Calibrate the compiled step's model (`step_model.calibrate`) on the machine at hand: compile and train the
model under each calibration policy, timing each step (CPU seconds on a CPU, wall seconds of a synchronized GPU
step) and metering its peak, as the methods
`gaswap compare` compares are (`methods.measure`: rotated rounds, each after a metered and an untimed step).

`gaswap compare` calibrates before it searches; compiled `validate --recalibrate` calibrates again where a
policy planned on one device is run on another (`gaswap.app.validate_compiled`).
"""
from __future__ import annotations

from gaswap.compiled import partition, step_model
from gaswap.compiled.methods import Method, measure
from gaswap.plan.costs import Costs
from gaswap.plan.graph import Graph
from gaswap.run import training


def calibrate(exp, graph: Graph, costs: Costs, model, inputs, target, device, progress, programs=None,
              beside=()) -> tuple[step_model.Calibration, list[tuple[float, int]]]:
    """The calibration of `graph`'s compiled step (`step_model.calibrate`) timed here: each calibration policy
    compiled (through `programs`, a `pool.Programs`, when given: one compile per partition) and trained; and
    the (CPU seconds, peak) of the policies `beside`, timed in the same rotated rounds but not fitted on (a
    prediction set beside a measurement taken under the same load)."""
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    timed_beside = []

    def cpu_times(actions):
        progress(f"  calibrating the compiled model: {len(actions)} policies compiled and timed"
                 + (f", {len(beside)} beside them" if beside else ""))
        made = [partition.make_policy(graph, a, provenance=provenance) for a in actions]
        measured = cpu_times_of([*made, *beside], model, inputs, target, exp, device, progress, programs)
        timed_beside.extend(measured[len(made):])
        return measured[:len(made)]

    return step_model.calibrate(graph, costs, cpu_times, exp.loss), timed_beside


def cpu_times_of(policies, model, inputs, target, exp, device, progress, programs=None, rounds: int = 4,
                 steps: int = 3) -> list[tuple[float, int]]:
    """(median seconds per training step by the device's clock, metered peak above the bytes resident before the
    step) of
    `model` compiled under each of `policies`. With `programs` (`pool.Programs`), policies of one partition are
    compiled and timed once, in worker processes first where the pool has them."""
    made = []
    for k, policy in enumerate(policies):
        m, opt = training.fresh_copy(model, exp.optimizer)
        made.append((Method("calibration", str(k + 1), m, partition.compile(m, policy), opt), policy))
    same = programs.same(made, "calibration policy") if programs else [None] * len(made)
    fresh = [(m, policy) for (m, policy), first in zip(made, same) if first is None]
    if programs:
        programs.compile(fresh, "calibration policy")
    rows = measure([m for m, _ in fresh], inputs, target, exp.loss, device, rounds, steps, progress, metered=1)
    measured = {id(m): (row["step_s"], row["peak_bytes"]) for (m, _), row in zip(fresh, rows)}
    return [measured[id(first or m)] for (m, _), first in zip(made, same)]
