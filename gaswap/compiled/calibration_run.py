"""Calibrate the compiled step's model (`step_model.calibrate`) on the machine at hand: compile and train the
model under each calibration policy, timing each step (CPU seconds on a CPU, wall seconds of a synchronized GPU
step) and metering its peak, as the methods
`gaswap compare` compares are (`methods.measure`: rotated rounds, each after a metered and an untimed step).

`gaswap compare` calibrates before it searches; compiled `validate --recalibrate` calibrates again where a
policy planned on one device is run on another (`gaswap.app.validate_compiled`).
"""
from __future__ import annotations

from gaswap.compiled import partition, pool, step_model
from gaswap.compiled.methods import ROUND_S, Method, measure
from gaswap.plan.costs import Costs
from gaswap.plan.graph import Graph
from gaswap.run import training


def calibrate(exp, graph: Graph, costs: Costs, model, inputs, target, device, progress, programs=None,
              beside=(), partitions: dict | None = None) -> tuple[step_model.Calibration, list[tuple[float, int]]]:
    """The calibration of `graph`'s compiled step (`step_model.calibrate`) timed here: each calibration policy
    compiled (through `programs`, a `pool.Programs`, when given: in its workers first) and trained; and
    the (CPU seconds, peak) of the policies `beside`, timed in the same rotated rounds but not fitted on (a
    prediction set beside a measurement taken under the same load). `partitions` ({label: (per-tensor actions,
    Method)}: torch's partitions and their torch.compile methods, compiled already) are timed in the same rounds
    and fitted on, in place of calibration policies (`step_model.calibrate`)."""
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    ready = partitions or {}
    timed_beside = []

    def cpu_times(labelled: dict) -> list:
        own = {label: a for label, a in labelled.items() if label not in ready}
        given = [label for label in labelled if label in ready]
        progress(f"  calibrating the compiled model: {len(own)} policies compiled and timed"
                 + (f" beside torch.compile's {len(given)} partitions" if given else "")
                 + (f", {len(beside)} beside them" if beside else ""))
        made = [partition.make_policy(graph, a, provenance=provenance) for a in own.values()]
        measured = cpu_times_of([*made, *beside], model, inputs, target, exp, device, progress, programs,
                                methods=[ready[label][1] for label in given])
        timed_beside.extend(measured[len(made):len(made) + len(beside)])
        by_label = dict(zip([*own, *given], [*measured[:len(made)], *measured[len(made) + len(beside):]]))
        return [by_label[label] for label in labelled]

    calibration = step_model.calibrate(graph, costs, cpu_times, exp.loss, {label: a for label, (a, _) in ready.items()})
    return calibration, timed_beside


def compile_jobs(exp, graph: Graph, costs: Costs, partitions: dict) -> list[pool.Job]:
    """The compiles (`pool.Job`) of the calibration policies `calibrate` will compile beside `partitions`
    ({label: per-tensor actions}: torch's): submitted to a `pool.CompilePool` before `calibrate` asks for them,
    they compile while the workers would otherwise wait (the pool compiles each once)."""
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    problem, chosen = step_model.calibration_set(graph, costs, exp.loss, partitions)
    own = [problem.actions_of(c) for label, c in chosen.items() if label not in partitions]
    return [pool.Job(f"calibration policy {k + 1}", partition.make_policy(graph, a, provenance=provenance))
            for k, a in enumerate(own)]


def cpu_times_of(policies, model, inputs, target, exp, device, progress, programs=None, rounds: int = 4,
                 steps: int = 3, methods=()) -> list[tuple[float, int]]:
    """(median seconds per training step by the device's clock, metered peak above the bytes resident before the
    step) of
    `model` compiled under each of `policies`, then of each of `methods` (compiled already), timed in the same
    rounds. With `programs` (`pool.Programs`), compiled in worker processes first where the pool has them. Each
    policy is compiled (telling which save the same activations takes a trace each, 2 to 24 s a compare here, and
    found none among the calibration policies of the 18 compares in `results/compare_time/`)."""
    made = []
    for k, policy in enumerate(policies):
        m, opt = training.fresh_copy(model, exp.optimizer)
        made.append((Method("calibration", str(k + 1), m, partition.compile(m, policy), opt), policy))
    if programs:
        programs.compile(made, "calibration policy")
    timed = [*(m for m, _ in made), *methods]
    rows = measure(timed, inputs, target, exp.loss, device, rounds, steps, progress, metered=1, round_s=ROUND_S)
    return [(row["step_s"], row["peak_bytes"]) for row in rows]
