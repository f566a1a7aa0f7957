"""`gaswap compare`'s compare.md: the table of the methods measured and the verdicts read from it.

A verdict is about the policy gaswap picked for the budget a torch.compile point's measured peak became
(the `budget` column of the rows: torch's rows name the gaswap budget made of their peak, gaswap's rows the
budget they were picked for), judged by one meter: at or below torch's peak, and at least as fast. It labels
the budget and the measured peak apart, says when the pick is one of torch's own partitions read back, what
another budget's pick does where it is clearly faster at a lower peak, why a pick reads above torch by the resident
set, how far one program's timings moved where a pick is a torch partition, and when eager ran faster than
every compiled method.
"""
from __future__ import annotations

from gaswap.base.config import format_size
from gaswap.base.units import scale

RESIDENT_NOTE = ("the resident set counts what malloc keeps besides the allocator's bytes and moves by about "
                 "an activation between runs, so a pick at or below torch by the allocator can read above it here")


def budget_labels(sizes: list[int]) -> list[str]:
    """A label per byte count (`format_size`), distinct for distinct counts: counts the usual two decimals
    show alike get as many more as tell them apart (two budgets 1.6 kB apart: "17.139 MB", "17.141 MB")."""
    out = [format_size(s) for s in sizes]
    groups = {label: sorted({s for s, other in zip(sizes, out) if other == label}) for label in out}
    fix = {}
    for group in (g for g in groups.values() if len(g) > 1):
        digits = next((d for d in range(3, 10) if len({_with_digits(s, d) for s in group}) == len(group)), None)
        fix |= {s: f"{s} B" if digits is None else _with_digits(s, digits) for s in group}
    return [fix.get(s, label) for s, label in zip(sizes, out)]


def _with_digits(size: int, digits: int) -> str:
    factor, name = scale(size)
    return f"{size} B" if factor == 1 else f"{size / factor:.{digits}f} {name}"


def to_markdown(rows: list[dict], name: str, device: str, tuning: list[dict] = (), clock: str = "CPU time") -> str:
    """The table, the verdicts per torch.compile point by peak allocated (and on a CPU by the resident set),
    what was found below torch's lowest peak, whether eager beat every compiled method; then the finalists
    timed before, if any. Predictions: the compiled model (`gaswap.compiled.step_model`), then the joint
    graph's ops one by one; and the peak of the programs inductor generated (`gaswap.compiled.programs`).
    `clock`: what the step times are (`runtime.CLOCK_NAMES`: CPU time on a CPU, wall time on a GPU)."""
    lines = [f"# gaswap compare: {name} ({device})", "",
             ("| method | budget | recomputed | predicted peak (ops one by one) | generated program's peak "
             "| measured peak allocated | resident | predicted time (ops one by one) "
             f"| {clock} per step (median, range) | vs torch 1.0 |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    reference = next(r["step_s"] for r in rows if r["method"] == "torch.compile" and r["knob"] == "1")
    for r in rows:
        peak = _pair(r.get("predicted_peak_bytes"), r.get("opwise_peak_bytes"), format_size)
        step = _pair(r.get("predicted_step_s"), r.get("opwise_step_s"), _ms)
        rss = "-" if r.get("rss_peak_bytes") is None else format_size(r["rss_peak_bytes"])
        recomputed = "-" if r["recomputed"] is None else r["recomputed"]
        program = "-" if r.get("program_peak_bytes") is None else format_size(r["program_peak_bytes"])
        lines.append(f"| {r['method']}{_origin(r)} | {r['knob']} | {recomputed} | "
                     f"{peak} | {program} | {format_size(r['peak_bytes'])} | {rss} | {step} | "
                     f"{_ms(r['step_s'])} ({r['step_min'] * 1e3:.2f}-{r['step_max'] * 1e3:.2f}) | "
                     f"{r['step_s'] / reference - 1:+.1%} |")
    lines += ["", ("By peak allocated (torch's allocator), gaswap's pick for the budget each torch.compile "
              "point's measured peak became:"), *goal_lines(rows), *below_lines(rows)]
    if all(r.get("rss_peak_bytes") is not None for r in rows):
        lines += ["", f"By peak resident set (the process's high-water mark; {RESIDENT_NOTE}):",
                  *goal_lines(rows, "rss_peak_bytes")]
    lines += noise_lines(rows) + eager_lines(rows)
    if tuning:
        lines += ["", ("Finalists: the gaswap policies fastest in prediction at each budget, and torch's partitions "
                  "whose measured peak fits it, timed in rounds of their own before the table above; round 2: "
                  "those of a second search, by the model refit on round 1's times, beside round 1's choice. "
                  "The fastest whose measured peak is at or under the budget, of the last round there, is "
                  "compared."), "",
                  ("| finalist | round | recomputed | predicted peak | generated program's peak "
                  f"| measured peak allocated | predicted time | {clock} per step (median, range) |"),
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {r['knob']}{_origin(r)} | {r.get('round', 1)} | {r['recomputed']} | "
                  f"{format_size(r['predicted_peak_bytes'])} | "
                  f"{'-' if r.get('program_peak_bytes') is None else format_size(r['program_peak_bytes'])} | "
                  f"{format_size(r['peak_bytes'])} | {_ms(r['predicted_step_s'])} | {_ms(r['step_s'])} "
                  f"({r['step_min'] * 1e3:.2f}-{r['step_max'] * 1e3:.2f}) |" for r in tuning]
    return "\n".join(lines) + "\n"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _origin(row: dict) -> str:
    """" (torch 0.5's partition)" for a gaswap row that is one of torch's partitions, else ""."""
    origin = row.get("origin") or "search"
    return "" if origin == "search" else f" ({origin}'s partition)"


def _pair(value, opwise, fmt) -> str:
    if value is None:
        return "-"
    return fmt(value) + ("" if opwise is None else f" ({fmt(opwise)})")


def goal_lines(rows: list[dict], peak: str = "peak_bytes") -> list[str]:
    """Per torch.compile point: gaswap's pick for the budget its peak became (`budget`), measured by `peak` (a
    column), against it: met (at or below its peak and at least as fast), not met (saying so where the pick is
    slower within the spread of both timings at less memory, and how much less), a tie (the pick is this very
    partition read back), or why it is not comparable; and another budget's pick at or below that peak where it
    is faster beyond the spread of both timings (or where the pick is not comparable)."""
    ours = {r["knob"]: r for r in rows if r["method"] == "gaswap"}
    return [_goal_line(t, ours, peak) for t in rows if t["method"] == "torch.compile"]


def _goal_line(t: dict, ours: dict, peak: str) -> str:
    head = f"- torch.compile {t['knob']} (peak {format_size(t[peak])}, {_ms(t['step_s'])}): "
    label = t.get("budget")
    pick = ours.get(label)
    others = sorted((r for r in ours.values() if r is not pick and r[peak] <= t[peak]), key=lambda r: r["step_s"])
    if pick is None:
        return head + f"gaswap picked no policy for budget {label} (none measured at or under it)" + _faster(
            others[:1], t)
    said = (f"gaswap's pick for budget {label}: peak {format_size(pick[peak])}, {_ms(pick['step_s'])} "
            f"({pick['step_s'] / t['step_s'] - 1:+.1%})")
    if pick[peak] > t[peak]:
        why = (f"by the allocator {format_size(pick['peak_bytes'])} against {format_size(t['peak_bytes'])}; the "
               f"resident set also counts what malloc keeps, and moves by about an activation between runs"
               if peak == "rss_peak_bytes" else "it measured above that peak in the head to head")
        return head + said + f": above torch's peak by this meter ({why})" + _faster(others[:1], t)
    origin = pick.get("origin") or "search"
    if origin == f"torch {t['knob']}":
        verdict = "a tie: the pick is this very partition read back, faster or slower by noise alone"
    else:
        verdict = "met" if pick["step_s"] <= t["step_s"] else "not met"
        if verdict == "not met" and pick["step_min"] <= t["step_max"] and pick[peak] < t[peak]:
            verdict += (f" (slower within the spread of both timings, at {1 - pick[peak] / t[peak]:.1%} less "
                        f"memory)")
        if origin != "search":
            verdict += f" (the pick is {origin}'s partition read back, not a policy of gaswap's own search)"
    clearly = [r for r in others[:1] if r["step_max"] < pick["step_min"]]  # beyond the spread of the timings
    return head + said + f": {verdict}" + _faster(clearly, t)


def _faster(rows: list[dict], t: dict) -> str:
    """"; budget X's pick is faster at or below this peak: ..." for the first of `rows` (none: "")."""
    return "".join(f"; budget {r['knob']}'s pick runs at or below this peak in {_ms(r['step_s'])} "
                   f"({r['step_s'] / t['step_s'] - 1:+.1%})" for r in rows)


def below_lines(rows: list[dict]) -> list[str]:
    """The picks for budgets below torch's lowest peak (no torch.compile point's: `--below`), against the
    torch.compile point with the lowest measured peak."""
    torch_rows = [r for r in rows if r["method"] == "torch.compile"]
    if not torch_rows:
        return []
    theirs = {r.get("budget") for r in torch_rows}
    lowest = min(torch_rows, key=lambda r: (r["peak_bytes"], r["step_s"]))
    return [f"- below torch's lowest peak: gaswap's pick for budget {r['knob']}: peak {format_size(r['peak_bytes'])}, "
            f"{_ms(r['step_s'])} ({r['step_s'] / lowest['step_s'] - 1:+.1%} against torch.compile {lowest['knob']}, "
            f"{_ms(lowest['step_s'])} at {format_size(lowest['peak_bytes'])})"
            for r in rows if r["method"] == "gaswap" and r["knob"] not in theirs]


def noise_lines(rows: list[dict]) -> list[str]:
    """A line per torch.compile partition that also ran as gaswap's pick (read back: the same partition, its
    programs alike) where their medians differ: how far apart one program measured in this head to head, the
    size of a difference that is noise here. None where no pick is a torch partition."""
    out = []
    for t in (r for r in rows if r["method"] == "torch.compile"):
        same = [r for r in rows if r["method"] == "gaswap" and r.get("origin") == f"torch {t['knob']}"]
        times = [t["step_s"], *(r["step_s"] for r in same)]
        if same and max(times) > min(times):
            out.append(f"- torch.compile {t['knob']}'s partition ran as torch.compile and as gaswap's pick for "
                       + ", ".join(r["knob"] for r in same) + f": {_ms(min(times))} to {_ms(max(times))} a step "
                       f"({max(times) / min(times) - 1:.1%} apart) in the same rounds. Time differences of that "
                       f"size are within this run's noise.")
    return ["", *out] if out else []


def eager_lines(rows: list[dict]) -> list[str]:
    """A paragraph when eager ran faster than every compiled method, else none."""
    eager = [r for r in rows if r["method"] == "eager"]
    compiled = [r for r in rows if r["method"] != "eager"]
    if not eager or not compiled:
        return []
    e, fastest = eager[0], min(compiled, key=lambda r: r["step_s"])
    if e["step_s"] >= fastest["step_s"]:
        return []
    return ["", (f"Eager ran faster than every compiled method: {_ms(e['step_s'])} a step at a peak of "
            f"{format_size(e['peak_bytes'])}, against the fastest compiled, {fastest['method']} {fastest['knob']}, "
            f"{_ms(fastest['step_s'])} at {format_size(fastest['peak_bytes'])} "
            f"({e['step_s'] / fastest['step_s'] - 1:+.1%}). Where eager's peak fits the memory at hand, train this "
            f"model eagerly; compiling pays here only for the memory it saves.")]
