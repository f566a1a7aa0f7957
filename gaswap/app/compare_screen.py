"""Compare's finalists checked against inductor's own programs before any is compiled.

The search's model of a compiled step (`step_model`) guesses what inductor fuses and reuses, and errs up to
30 % on a policy's peak on models it was not tuned for; a finalist it says fits can measure over its budget,
and its compile (up to a minute of CPU) is wasted. `ProgramPeaks` asks inductor: it writes the forward and backward
programs of a policy without compiling their kernels (`gaswap.compiled.dry_compile`, 1.8 to 30 CPU s a policy here) and
reads their peak (`programs.step_peak`, equal to the compiled programs' peak), plus the offset the meter reads
beyond the programs on torch's partitions (what runs outside them: the optimizer's view of gradients, the
loss). `screen` keeps a budget's fastest candidates (by the model) whose programs fit it.

A candidate whose programs hold over the budget is written again under those of inductor's other settings
(`VARIANTS`) that reach that far (each has been seen to lower a policy's peak about that much: its graphs lowered
in demand-first order, `gaswap.compiled.order`, 4.9 % on window; no freed buffer handed on, 4.3 %; a value read
by two or more kernels written once rather than recomputed in each, 15.3 % on separable,
results/compare_time/realize_reads.txt), with workers all at once in them, and kept where one of them fits; the
settings are recorded for the policy (`ProgramPeaks.inductor`; `provenance.inductor` of the policy compiled,
which `partition.backend` applies).

Where a budget's choice is torch's own partition read back and no policy of the search's fitted, `kept_near` looks
next to it: the values that partition recomputes kept instead, one at a time, each judged by its
programs. The model cannot tell which of torch's recomputations cost memory in inductor's programs (on normmix,
keeping the `addmm` torch's 0.2 partition recomputes lowered its programs' peak from 15.31 to 14.16 MB):
results/compiled_model/next_to_torch.txt. Below torch's least peak, where none of the search's candidates fit,
`descended` starts from torch's partition there and changes one action at a time, the model's lowest first, each
step judged by the programs: next to torch's partitions, on which it is calibrated, the model's peaks err little.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import NamedTuple

from gaswap.base.config import format_size
from gaswap.compiled import dry_compile
from gaswap.compiled.pool import actions_key
from gaswap.compiled.programs import ProgramError
from gaswap.plan.encoding import Action, Chromosome
from gaswap.plan.policy import PolicyError
from gaswap.plan.problem import Evaluated

# (inductor settings, reach): a candidate whose programs hold at most `reach` over a budget is written again so
VARIANTS = (({"order": "demand_first"}, 0.05), ({"buffer_reuse": False}, 0.05),
            ({"order": "demand_first", "buffer_reuse": False}, 0.05), ({"realize_reads": 1}, 0.20))


class ProgramPeaks:
    """The peak above resident a finalist's compiled step will meter: its programs' peak (inductor's, no kernel
    compiled) plus `offset`; one dry compile per distinct policy. `policy_of(chromosome, inductor=None)`: its
    compiled policy (with `inductor`: under those settings, `partition.inductor_settings`).
    The partition each dry compile wrote goes into `partitions` ({`pool.actions_key`: key}, for a
    `pool.Programs` to tell which finalists generate the same programs without tracing them again)."""

    def __init__(self, model, inputs, output_bytes: int, loss: str, policy_of, offset: int, progress=print,
                 partitions: dict | None = None, workers=None):
        self.model, self.inputs, self.output_bytes, self.loss = model, inputs, output_bytes, loss
        self.policy_of, self.offset, self.progress = policy_of, offset, progress
        self.partitions = {} if partitions is None else partitions
        self.workers = workers  # a `pool.CompilePool` whose workers write programs `ahead` of `peak`
        self._ahead: dict[tuple, object] = {}  # actions -> future of (peak, partition key) or None (`ahead`)
        self.known: dict[tuple, int | None] = {}  # actions -> programs' peak (None: inductor's program unreadable)
        self.unreached: set[str] = set()  # budgets (labels) no candidate fitted by its programs, even searched lower
        self.lowered: dict[str, int] = {}  # label -> the budget searched lower where its candidates' programs did fit
        # actions -> the `VARIANTS` entry its programs fit a budget under (the lowest budget's, where several:
        # its peak is under the others too): the policy is compiled so, at every budget
        self.inductor: dict[tuple, dict] = {}
        self._varied: dict[tuple, dict] = {}  # actions -> {index in `VARIANTS`: peak or None} written so far

    @property
    def at_once(self) -> int:
        """How many policies' programs are written at once: one per worker, one without workers."""
        return max(1, self.workers.workers if self.workers is not None else 1)

    def ahead(self, chromosomes: list) -> None:
        """Start writing the programs of `chromosomes` in the workers (with `workers`), several at once, for
        `peak` to read later; those known or started already are left as they are."""
        new = list({c.actions: c for c in chromosomes if c.actions not in self.known and c.actions not in self._ahead}
                   .values())
        if self.workers is not None and new:
            futures = self.workers.program_peaks([self.policy_of(c) for c in new], self.output_bytes)
            self._ahead |= {c.actions: future for c, future in zip(new, futures)}

    def in_batches(self, items: list, chromosome_of, deadline: float, clock=time.monotonic):
        """[(item, `peak` of `chromosome_of(item)`)] of `items`, a batch at a time: as many as the workers write at
        once, started together (`ahead`); the first batch always, a later one only while `clock()` has not passed
        `deadline`."""
        for i in range(0, len(items), self.at_once):
            if i and clock() > deadline:
                return
            batch = items[i:i + self.at_once]
            self.ahead([chromosome_of(item) for item in batch])
            yield [(item, self.peak(chromosome_of(item))) for item in batch]

    def _written_ahead(self, chromosome) -> tuple | None:
        """What a worker answered for `chromosome` (`ahead`), None where it was not asked or failed."""
        return _answer(self._ahead.pop(chromosome.actions, None))

    def peak(self, chromosome) -> int | None:
        """Bytes above resident (None where inductor could not write or gaswap could not read its programs)."""
        if chromosome.actions not in self.known:
            policy = self.policy_of(chromosome)
            written = self._written_ahead(chromosome)  # by a worker, else here
            if written is None:
                try:
                    written = dry_compile.policy_peak_and_partition(
                        self.model, policy, self.inputs, self.output_bytes, self.loss)
                except (ProgramError, PolicyError) as e:
                    self.progress(f"  a finalist's programs not read ({e}): kept on the model's word")
                    written = (None, None)
            self.known[chromosome.actions], key = written
            if key is not None:
                self.partitions[actions_key(policy)] = key
        peak = self.known[chromosome.actions]
        return None if peak is None else peak + self.offset

    def varied_peak(self, chromosome, room: int, peak: int) -> int | None:
        """The meter's peak above resident under the first of `VARIANTS` that reach how far `peak` (the meter's,
        under inductor's defaults) is over `room` (bytes above resident) and whose programs fit `room`, the
        variant recorded in `inductor`; None where none does. Each variant written once; with `workers`, all
        those not written yet at once, in the workers."""
        reaching = [k for k, (_, reach) in enumerate(VARIANTS) if peak <= room * (1 + reach)]
        tried = self._varied.setdefault(chromosome.actions, {})
        rest = [k for k in reaching if k not in tried]
        if self.workers is not None and rest:
            for k, future in zip(rest, self.workers.program_peaks(
                    [self.policy_of(chromosome, VARIANTS[k][0]) for k in rest], self.output_bytes)):
                written = _answer(future)
                tried[k] = self._written_here(chromosome, VARIANTS[k][0]) if written is None else written[0]
        for k in reaching:
            if k not in tried:
                tried[k] = self._written_here(chromosome, VARIANTS[k][0])
            if tried[k] is not None and tried[k] + self.offset <= room:
                self.inductor[chromosome.actions] = VARIANTS[k][0]
                return tried[k] + self.offset
        return None

    def _written_here(self, chromosome, variant: dict) -> int | None:
        """The programs' peak of `chromosome` under `variant`, written in this process (None: unreadable)."""
        try:
            return dry_compile.policy_peak_and_partition(
                self.model, self.policy_of(chromosome, variant), self.inputs, self.output_bytes, self.loss)[0]
        except (ProgramError, PolicyError):
            return None

    def summary(self) -> str:
        """One line: how many policies' programs were written, and the offset."""
        return (f"  inductor wrote the programs of {len(self.known)} finalist candidates (no kernels compiled); the "
                f"meter reads {'-' if self.offset < 0 else '+'}{format_size(abs(self.offset))} beyond their peak")

    def screen(self, label: str, budget: int, resident: int, evaluated: list[Evaluated], n: int, skip=None
               ) -> tuple[list[Evaluated], float]:
        """Up to `n` of `evaluated` (fastest first), in order, whose programs fit `budget` (bytes, resident
        included; the first `n` checked all over it end the check; one over it tried under the `VARIANTS` that
        reach that far), each with its programs' peak as its `peak_bytes`, and those `skip(evaluated)` says need no
        check (compiled already, or not to be), as they are; and, where none fits, the smallest ratio of a
        candidate's programs' peak to the model's (the least the budget must be lowered by for another search to
        find policies that would fit were the model to err as little; 1.0 where one fits)."""
        kept, ratios, checked, passed, other = [], [], 0, 0, 0
        for e in evaluated:
            if len(kept) == n or (not kept and len(ratios) == n):  # n over the budget, none under: search lower
                break
            if skip is not None and skip(e):
                kept.append(e)
                passed += 1
                continue
            checked += 1
            peak = self.peak(e.chromosome)
            if peak is None:
                kept.append(e)
            elif resident + peak <= budget:
                kept.append(replace(e, peak_bytes=resident + peak))
            elif (varied := self.varied_peak(e.chromosome, budget - resident, peak)) is not None:
                kept.append(replace(e, peak_bytes=resident + varied))
                other += 1
            else:
                ratios.append(peak / max(e.peak_bytes - resident, 1))
        excess = "" if kept or not ratios else f" ({min(ratios):.2f}x to {max(ratios):.2f}x the model's peak)"
        settled = f"; {passed} passed on unchecked (compiled already, or not to be)" if passed else ""
        varied = f" ({other} under other inductor settings)" if other else ""
        self.progress(f"  at {label}: {len(kept) - passed} of {checked} candidates checked fit by inductor's "
                      f"programs{varied}{excess}{settled}")
        return kept, (1.0 if kept or not ratios else min(ratios))


# wall seconds of dry compiles a compare spends next to one of torch's partitions (`kept_near`'s deadline; those under
# way finish): values the partition recomputes, tried kept one at a time, those the model predicts save the most
# first, as many as the workers write at once, until this is spent; then together. On normmix's torch 0.2, 5 of the
# 12 the model ranked first fit, and together ran 7.1 % faster in 7.1 % less memory; on the GRU's, gpt's and
# gpt2_hf's torch 0.5 the 8 ranked first gained 1.7 % or less (results/compiled_model/next_to_torch.txt). A dry
# compile took 2 to 8 CPU s there. In the batch of twelve at 3909fd4, 20 s found seven values on normmix's 0.2
# (-7.3 % at 7.1 % less memory); at 10 s (7578080) one (-2.4 %).
KEPT_NEAR_S = 20.0


class Nearby(NamedTuple):
    """What `kept_near` found: the policy (None where no value fitted kept), how many values it tried kept alone,
    how many of them fitted, and how many of those the policy keeps."""
    policy: Evaluated | None
    tried: int
    fitted: int
    kept: int


def kept_near(problem, start: Chromosome, budget: int, resident: int, peaks: ProgramPeaks, deadline: float,
              clock=time.monotonic) -> Nearby:
    """A policy next to `start` (torch's partition read back) that recomputes less and whose programs fit `budget`
    (bytes, resident included): values `start` recomputes, those whose keeping `problem` (a calibrated
    `CompiledProblem`) predicts saves the most time first, each kept alone and checked by its programs (as many at
    once as `peaks`' workers write) until `clock()` passes `deadline` (one batch at least); then those that fit
    kept together, or, where together they do not fit, added one by one (the most promising first) while the
    programs still fit and time is left. The policy is Evaluated with its programs' peak (the meter's, resident
    included) and `problem`'s time."""

    def kept(indices) -> Chromosome:
        actions = list(start.actions)
        for k in indices:
            actions[k] = int(Action.KEEP)
        return problem.canonical(Chromosome(start.keys, tuple(actions)))

    def under(peak: int | None) -> bool:
        return peak is not None and resident + peak <= budget

    def fits(chromosome) -> bool:
        return under(peaks.peak(chromosome))

    base = problem.simulate(start).step_time
    recomputed = [k for k, a in enumerate(start.actions)
                  if a == Action.RECOMPUTE and Action.KEEP in problem.encoding.allowed[k]]
    gains = sorted(((base - problem.simulate(kept([k])).step_time, k) for k in recomputed), reverse=True)
    ranked = [k for gain, k in gains if gain > 0]
    alone, tried = [], 0
    for batch in peaks.in_batches(ranked, lambda k: kept([k]), deadline, clock):
        alone += [k for k, peak in batch if under(peak)]
        tried += len(batch)
    if not alone:
        return Nearby(None, tried, 0, 0)
    chosen = alone
    if len(alone) > 1 and not fits(kept(alone)):
        chosen = alone[:1]
        for k in alone[1:]:
            if clock() > deadline:
                break
            if fits(kept([*chosen, k])):
                chosen.append(k)
    c = kept(chosen)
    return Nearby(Evaluated(c, problem.simulate(c).step_time, resident + peaks.peak(c)), tried, len(alone), len(chosen))


def _answer(future) -> tuple | None:
    """A worker's (programs' peak, partition key) from `future`; None where there is none or the worker failed
    (this process then writes the programs itself)."""
    try:
        return None if future is None else future.result()
    except Exception:  # noqa: BLE001 - a broken pool
        return None


def offset(metered: list[int], program_peaks: list[int | None]) -> int:
    """The median of what the meter read beyond the programs' peak, over the runs whose programs were read (0
    where none was)."""
    gaps = [m - p for m, p in zip(metered, program_peaks) if p is not None]
    return int(statistics.median(gaps)) if gaps else 0


# wall seconds of dry compiles a compare spends below torch's partitions (`descended`'s deadline; those under way
# finish) at a budget under torch's least peak where none of the search's candidates fitted by their programs.
# Offline (results/compiled_model/below_torch.txt), from the partition of torch's least peak: the ViT reached 0.8x
# its peak in 2 steps, the U-Net in 5, llama in 3 (12 to 73 CPU s of dry compiles, cold caches); mixture, normmix,
# gpt2_hf and the GRU stopped 4 to 19 % over it. In compares the U-Net's took 40 s (7c8aff0) and, in a second run,
# stopped at 10.38 MB against 10.18 when its pace would not reach the budget in 40 s: so 60 s.
BELOW_TORCH_S = 60.0
FLIP_BATCHES = 2  # batches of flips (as many as the workers write at once) a step checks before it stops


class Descended(NamedTuple):
    """What `descended` found: the policy (None where none fitted), the flips taken, how many were checked by their
    programs, and the programs' peak reached (the meter's, above resident; None where the start's is unreadable)."""
    policy: Evaluated | None
    steps: int
    checked: int
    reached: int | None


def descended(problem, start: Chromosome, budget: int, resident: int, peaks: ProgramPeaks, deadline: float,
              clock=time.monotonic) -> Descended:
    """A policy whose programs fit `budget` (bytes, resident included), reached from `start` (torch's partition of
    least peak, read back, where the model's peaks are calibrated) one action at a time: at each step the single
    keep / recompute flips `problem` (a calibrated `CompiledProblem`) predicts lower the peak, the lowest predicted
    first (the faster among equals; a candidate whose flip was checked before and lowered nothing after the
    others), are checked by their programs as many at once as `peaks`' workers write, and the first batch (of at
    most `FLIP_BATCHES`) with one that lowers the programs' peak gives the step its lowest; until the programs fit,
    no flip checked lowers them, `clock()` passes `deadline`, or the steps so far, at their pace, would not reach
    the budget before it. The policy is Evaluated with its programs' peak (the meter's, resident included) and
    `problem`'s time."""
    current, began = problem.canonical(start), clock()
    reached = first = peaks.peak(current)
    steps = checked = 0
    failed = set()  # candidates whose flip was checked and did not lower the programs' peak
    while reached is not None and resident + reached > budget and clock() <= deadline:
        flips = _lower_flips(problem, current)
        flips = [f for f in flips if f[0] not in failed] + [f for f in flips if f[0] in failed]
        lowest = None
        for batch in peaks.in_batches(flips[:FLIP_BATCHES * peaks.at_once], lambda flip: flip[1], deadline, clock):
            checked += len(batch)
            lower = []
            for (k, c), peak in batch:
                if peak is not None and peak < reached:
                    lower.append((peak, k, c))  # candidates differ: chromosomes are never compared
                else:
                    failed.add(k)
            if lower:
                reached, _, lowest = min(lower)
                break
        if lowest is None:
            break
        current, steps = lowest, steps + 1
        now = clock()
        if (resident + reached - budget) * (now - began) > (first - reached) * (deadline - now):
            break  # at this pace the deadline comes first
    if reached is None or resident + reached > budget:
        return Descended(None, steps, checked, reached)
    return Descended(Evaluated(current, problem.simulate(current).step_time, resident + reached), steps, checked,
                     reached)


def _lower_flips(problem, c: Chromosome) -> list[tuple[int, Chromosome]]:
    """(candidate, `c` with that candidate's action flipped between keep and recompute), where `problem` predicts a
    lower peak: the lowest predicted first, the faster among equals."""
    now = problem.simulate(c).peak_bytes
    flips = {}
    for k, a in enumerate(c.actions):
        other = Action.KEEP if a == Action.RECOMPUTE else Action.RECOMPUTE
        if a not in (Action.KEEP, Action.RECOMPUTE) or other not in problem.encoding.allowed[k]:
            continue
        flipped = problem.canonical(Chromosome(c.keys, (*c.actions[:k], int(other), *c.actions[k + 1:])))
        r = problem.simulate(flipped)
        if r.peak_bytes < now and flipped.actions != c.actions:
            flips.setdefault(flipped.actions, (r.peak_bytes, r.step_time, k, flipped))
    return [(k, flipped) for *_, k, flipped in sorted(flips.values(), key=lambda f: f[:3])]
