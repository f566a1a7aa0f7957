"""Step time predicted from inductor's programs against the search's model (`gaswap.compiled.step_model`), both
fitted on the same calibration runs, on policies neither was fitted on: an experiment, its answer in
docs/compiled.md ("Pricing the programs' calls"). The program model is this file's, not gaswap's.

    PYTHONPATH=. python scripts/program_time_check.py experiments/compare_separable_cpu.yaml [...] --tag run1

Per experiment, in one process: the seven calibration policies (`step_model.calibration_policies`),
torch.compile at activation_memory_budget 1.0 / 0.5 / 0.2 and the gaswap picks stored in
`results/compiled_model/measured/<experiment>.csv` are compiled and timed together in rotated rounds
(`methods.measure`: CPU seconds per step, median). Then each calibration policy's calls are timed
(`timed_calls`, a few steps each). Both models are fitted on the calibration policies alone: the
search's on their step times (`step_model.fit`), the program model on their step times and calls
(`ProgramTimes.fit`). torch's partitions and the gaswap picks are then predicted from their programs (the
program model) and from their actions (the search's model: torch's read back) and compared with their measured
time. Writes `results/compiled_model/program_time_<tag>.csv`, one row per policy, and prints a summary.
"""
from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import re
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compiled_model_errors import _chromosome, _setup, calibration_and_torch

from gaswap.base.files import csv_text, write_atomic
from gaswap.compiled import methods as compiled_methods
from gaswap.compiled import step_model
from gaswap.compiled.programs import Program, ProgramError

CALL_STEPS = 5  # steps whose calls are timed, per calibration policy
COLUMNS = ("experiment", "label", "kind", "step_s", "step_min", "step_max", "program_s", "program_error",
           "model_s", "model_error", "unseen_calls", "outside_s")


# --- the program model ----------------------------------------------------------------------------------
#
# A compiled step's time read from the programs inductor generates: each call they make, priced by what the
# same call cost in programs timed before.
#
# A compiled step runs two programs (`gaswap.compiled.programs`): each calls generated kernels (on a CPU,
# `cpp_fused_*`: C++ that inductor wrote and g++ compiled) and library calls (`extern_kernels.mm`,
# `torch.ops.aten.topk.default`, ...) in order. A policy changes which calls run: a recomputed value is computed
# again inside a kernel (a kernel of other source) or by the same library call again. So `calls(program)` lists
# the calls with a key that is equal where the work is: a generated kernel's C++ source (its sizes are in it:
# shapes are static), a library call's op and the shapes of its tensor arguments.
#
# `timed_calls` times each call of compiled steps already running (the calibration policies'), wrapping the
# callables of their loaded programs; `ProgramTimes.fit` turns those times and the steps' measured CPU seconds
# into a model: a call timed before costs what it cost; a call never timed costs what its bytes cost by a rate
# fitted on the calls of its kind (generated, library) that were; the rest of a step (the eager loss, the
# optimizer, the programs' own Python, autograd) is the median of what the timed steps spent outside their calls.
# A dry compile (`gaswap.compiled.dry_compile`) writes a policy's programs in seconds without compiling their
# kernels, so a policy is priced without compiling it.
#
# CPU only: the calls are timed in the calling thread's CPU seconds (a CUDA kernel's time would need events).

_KERNEL_SOURCE = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\[[^\]]*\], r'''(.*?)'''\)", re.MULTILINE | re.DOTALL)
_SHAPED = re.compile(r"(\w+) = (?:empty_strided\w*|rand_strided)\((\([^()]*\)), ")
_ASSERTED = re.compile(r"assert_size_stride\((\w+), (\([^()]*\)), ")
_ALIASED = re.compile(r"(\w+) = (?:reinterpret_tensor\((\w+), (\([^()]*\))|(\w+)(?:;|$))")
_LIBRARY = ("extern_kernels.", "torch.ops.")


@dataclass(frozen=True)
class Call:
    """One call a program makes: `key` equal where the work is equal; `generated`: a kernel inductor wrote
    (else a library call); `nbytes`: the bytes of its tensor arguments."""
    key: str
    generated: bool
    nbytes: int


def calls(program: Program) -> list[Call]:
    """The kernel and library calls of `program`'s `call`, in order."""
    sources = kernel_keys(program.code)
    shapes, sizes = _layout(program)
    out = []
    for line in program._parts[1]:
        name = line.split("(", 1)[0]
        if name in sources:
            out.append(Call(sources[name], True, sum(_bytes_of(a, sizes, shapes) for a in _arguments(line))))
        elif any(library in line for library in _LIBRARY):
            call = _library_call(line)
            if call is not None:
                op, args = call
                out.append(Call(library_key(op, [_shape_of(a, shapes) for a in args]), False,
                                sum(_bytes_of(a, sizes, shapes) for a in args)))
    return out


def kernel_keys(code: str) -> dict[str, str]:
    """{kernel name: its key} of the generated kernels a program's source defines (the key: a hash of the
    kernel's C++ source, the same in any program that runs the same kernel)."""
    return {name: "kernel " + hashlib.sha256(source.encode()).hexdigest()[:16]
            for name, source in _KERNEL_SOURCE.findall(code)}


def library_key(op: str, shapes: list) -> str:
    """The key of a library call: its op and the shapes of its positional tensor arguments (None: not a
    tensor)."""
    return f"{op} {[s for s in shapes if s is not None]}"


def _layout(program: Program) -> tuple[dict[str, tuple], dict[str, int]]:
    """({name: shape}, {name: bytes}) of the program's inputs and buffers, through its reuses and aliases (`buf2 =
    buf1; del buf1  # reuse`, `buf4 = reinterpret_tensor(buf3, (2048, 1), ...)`), in the order it runs."""
    sizes = dict(program._parts[2])
    shapes = {}
    for name, size in _SHAPED.findall(program.code):
        shapes.setdefault(name, _literal(size))
    for line in program._parts[1]:
        if m := _ASSERTED.match(line):
            shapes.setdefault(m.group(1), _literal(m.group(2)))
        elif m := _ALIASED.match(line):
            name, base, shape = m.group(1), m.group(2) or m.group(4), m.group(3)
            shapes[name] = _literal(shape) if shape else shapes.get(base)
            if name not in sizes and base in sizes:
                sizes[name] = sizes[base] if not shape else _scaled(sizes[base], shapes.get(base), shapes[name])
    return shapes, sizes


def _literal(size: str) -> tuple:
    try:
        return tuple(ast.literal_eval(size))
    except (ValueError, SyntaxError):
        raise ProgramError(f"a size that is not a number: {size} (a dynamic shape)") from None


def _elements(shape) -> int:
    n = 1
    for d in shape or ():
        n *= d
    return n


def _scaled(nbytes: int, base_shape, shape) -> int:
    """The bytes of a view of `shape` on a buffer of `nbytes` and `base_shape`."""
    whole = _elements(base_shape)
    return nbytes * _elements(shape) // whole if whole else 0


def _arguments(line: str) -> list:
    """The positional arguments of the call on `line`: a name, a `reinterpret_tensor` as (base, shape), or None
    (a constant or anything else)."""
    try:
        node = ast.parse(line.split("#")[0].strip()).body[0].value
    except (SyntaxError, IndexError, AttributeError):
        return []
    return [_argument(a) for a in node.args] if isinstance(node, ast.Call) else []


def _argument(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "reinterpret_tensor" and len(node.args) >= 2:
        try:
            return (node.args[0].id, tuple(ast.literal_eval(node.args[1])))
        except (AttributeError, ValueError):
            return None
    return None


def _library_call(line: str) -> tuple[str, list] | None:
    """(op, positional arguments) of a library call line (`extern_kernels.mm(...)`, `buf7 = torch.ops.aten.x(...)`)."""
    try:
        node = ast.parse(line.split("  #")[0].strip()).body[0]
    except (SyntaxError, IndexError):
        return None
    value = node.value if isinstance(node, (ast.Expr, ast.Assign)) else None
    if not isinstance(value, ast.Call):
        return None
    op = ast.unparse(value.func)
    if not op.startswith(_LIBRARY):
        return None
    return op, [_argument(a) for a in value.args]


def _shape_of(argument, shapes: dict):
    if isinstance(argument, tuple):
        return argument[1]
    if isinstance(argument, str):
        return shapes.get(argument)
    return None


def _bytes_of(argument, sizes: dict, shapes: dict) -> int:
    if isinstance(argument, tuple):
        base, shape = argument
        return _scaled(sizes.get(base, 0), shapes.get(base), shape)
    return sizes.get(argument, 0) if isinstance(argument, str) else 0


@dataclass
class ProgramTimes:
    """CPU seconds of calls timed on compiled steps, and what a step spends outside its calls."""
    per_call: dict[str, float]  # key -> seconds per call
    rates: dict[bool, tuple[float, float]]  # generated? -> (seconds a call, seconds a byte) for calls not timed
    outside: float  # seconds a step spends outside its calls
    spread: float = 0.0  # the largest relative miss of `step_time` on the steps fitted on
    samples: list = field(default_factory=list)  # (label, measured seconds, priced) of the steps fitted on

    @classmethod
    def fit(cls, steps: list[tuple[str, list[Program], float, dict[str, tuple[float, int]]]]) -> ProgramTimes:
        """The model of `steps`: (label, programs, measured CPU seconds a step, {call key: (seconds, calls)} timed
        over the steps `timed_calls` ran)."""
        totals = defaultdict(lambda: [0.0, 0])
        for _, _, _, timed in steps:
            for key, (seconds, count) in timed.items():
                totals[key][0] += seconds
                totals[key][1] += count
        per_call = {key: s / n for key, (s, n) in totals.items() if n}
        bytes_of = {}
        for _, programs, _, _ in steps:
            for program in programs:
                for c in calls(program):
                    bytes_of[c.key] = (c.generated, c.nbytes)
        rates = {kind: _rate([(bytes_of[k][1], s) for k, s in per_call.items() if k in bytes_of and bytes_of[k][0] == kind])
                 for kind in (True, False)}
        model = cls(per_call, rates, 0.0)
        outside = [measured - model.calls_time(programs) for _, programs, measured, _ in steps]
        model.outside = statistics.median(outside)
        model.samples = [(label, measured, model.step_time(programs)) for label, programs, measured, _ in steps]
        model.spread = max(abs(p / m - 1) for _, m, p in model.samples)
        return model

    def calls_time(self, programs: list[Program]) -> float:
        """Seconds of the calls `programs` make: each timed before at its time, the others by their bytes."""
        total = 0.0
        for program in programs:
            for c in calls(program):
                if c.key in self.per_call:
                    total += self.per_call[c.key]
                else:
                    per_call, per_byte = self.rates[c.generated]
                    total += per_call + per_byte * c.nbytes
        return total

    def step_time(self, programs: list[Program]) -> float:
        """CPU seconds of a training step that runs `programs`."""
        return self.outside + self.calls_time(programs)

    def unseen(self, programs: list[Program]) -> float:
        """The share of the calls of `programs`, by count, never timed."""
        all_calls = [c for p in programs for c in calls(p)]
        return sum(c.key not in self.per_call for c in all_calls) / max(len(all_calls), 1)


def _rate(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(seconds a call, seconds a byte) fitted by least squares on (bytes, seconds) `points`, neither negative."""
    if not points:
        return 0.0, 0.0
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    var = sum((b - mean_b) ** 2 for b, _ in points)
    slope = max(sum((b - mean_b) * (s - mean_s) for b, s in points) / var, 0.0) if var else 0.0
    return max(mean_s - slope * mean_b, 0.0), slope


# --- timing the calls of running programs (torch) -------------------------------------------------------------

class _Timed:
    """Stands for a callable namespace (`extern_kernels`, `torch.ops`): each call through it timed under the
    key of its op and its tensors' shapes."""

    def __init__(self, inner, name: str, sink: dict):
        self._inner, self._name, self._sink = inner, name, sink

    def __getattr__(self, attr):
        return _Timed(getattr(self._inner, attr), f"{self._name}.{attr}", self._sink)

    def __call__(self, *args, **kwargs):
        import torch

        start = time.thread_time()
        out = self._inner(*args, **kwargs)
        spent = time.thread_time() - start
        key = library_key(self._name, [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args])
        entry = self._sink[key]
        entry[0] += spent
        entry[1] += 1
        return out


class _TorchWithTimedOps:
    """A program's `torch` global whose `torch.ops` calls are timed."""

    def __init__(self, sink: dict):
        import torch

        self._torch, self.ops = torch, _Timed(torch.ops, "torch.ops", sink)

    def __getattr__(self, attr):
        return getattr(self._torch, attr)


def timed_calls(programs: list[Program], run_steps) -> dict[str, tuple[float, int]]:
    """{call key: (CPU seconds, calls)} of the calls of the loaded `programs` (recorded at their compile) over
    `run_steps()` (steps of the compiled model that runs them), each call wrapped in a timer meanwhile."""
    from torch._inductor.codecache import PyCodeCache

    code = {p.code for p in programs}
    modules = [m for m in {id(m): m for m in PyCodeCache.modules}.values() if _source(m) in code]
    if len(modules) < len(code):
        raise ProgramError(f"{len(code) - len(modules)} of the step's programs are not loaded")
    sink = defaultdict(lambda: [0.0, 0])
    saved = []
    for module in modules:
        keys = kernel_keys(_source(module))
        for name, key in keys.items():
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _kernel_timer(getattr(module, name), key, sink))
        for name, wrapped in (("extern_kernels", lambda v: _Timed(v, "extern_kernels", sink)),
                              ("torch", lambda v: _TorchWithTimedOps(sink))):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapped(getattr(module, name)))
    try:
        run_steps()
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
    return {key: (s, n) for key, (s, n) in sink.items()}


def _kernel_timer(kernel, key: str, sink: dict):
    def timed(*args):
        start = time.thread_time()
        out = kernel(*args)
        entry = sink[key]
        entry[0] += time.thread_time() - start
        entry[1] += 1
        return out
    return timed


def _source(module) -> str:
    source = getattr(module, "_gaswap_source", None)
    if source is None:
        with open(module.__file__) as f:
            source = f.read()
        module._gaswap_source = source
    return source


def check(path: str, out: Path, rounds: int, steps: int) -> list[dict]:
    exp, device, model, inputs, target, graph, costs, space = _setup(path, out)
    problem = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss)
    entries, gaswap_method = calibration_and_torch(exp, model, inputs, graph, problem)
    with open(out / "measured" / f"{exp.name}.csv") as f:
        for r in csv.DictReader(f):
            if r["kind"] == "gaswap":
                gaswap_method(r["label"], "gaswap", problem.canonical(_chromosome(problem, r["actions"])))
    compiled_methods.allow_recompiles(len(entries) + 5)
    rows = compiled_methods.measure([e[3] for e in entries], inputs, target, exp.loss, device, rounds, steps,
                                    lambda line: print(line, flush=True), metered=1)
    calibration = [(e, row) for e, row in zip(entries, rows) if e[1] == "calibration"]
    timed = []
    for (label, _, _, m), row in calibration:
        run = partial(m.step, inputs, target, exp.loss, device)
        calls = timed_calls(m.programs, lambda run=run: [run() for _ in range(CALL_STEPS)])
        timed.append((label, m.programs, row["step_s"], {k: (s / CALL_STEPS, n // CALL_STEPS)
                                                          for k, (s, n) in calls.items()}))
    programs_model = ProgramTimes.fit(timed)
    fitted = step_model.fit(step_model.samples(problem, [(e[0], e[2], row["step_s"]) for e, row in calibration]))
    priced = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss, calibration=fitted)
    print(f"{exp.name}: program model fit within {programs_model.spread:.1%} of its points, outside the calls "
          f"{programs_model.outside * 1e3:.2f} ms; the search's model within {fitted.worst_error():.1%}", flush=True)
    out_rows = []
    for (label, kind, c, m), row in zip(entries, rows):
        program_s = programs_model.step_time(m.programs)
        model_s = priced.simulate(c).step_time
        out_rows.append({"experiment": exp.name, "label": label, "kind": kind, "step_s": row["step_s"],
                         "step_min": row["step_min"], "step_max": row["step_max"], "program_s": program_s,
                         "program_error": program_s / row["step_s"] - 1, "model_s": model_s,
                         "model_error": model_s / row["step_s"] - 1,
                         "unseen_calls": programs_model.unseen(m.programs), "outside_s": programs_model.outside})
        print(f"  {label:24s} measured {row['step_s'] * 1e3:8.2f} ms  programs {program_s * 1e3:8.2f} "
              f"({out_rows[-1]['program_error']:+.1%}, {out_rows[-1]['unseen_calls']:.0%} calls unseen)  "
              f"model {model_s * 1e3:8.2f} ({out_rows[-1]['model_error']:+.1%})", flush=True)
    return out_rows


def summary(rows: list[dict]) -> str:
    lines = ["| experiment | held out | programs: largest error | within 10 % | search's model: largest | within 10 % |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["experiment"] for r in rows):
        held = [r for r in rows if r["experiment"] == name and r["kind"] != "calibration"]
        p = [r["program_error"] for r in held]
        s = [r["model_error"] for r in held]
        lines.append(f"| {name} | {len(held)} | {max(p, key=abs):+.1%} | {sum(abs(e) <= 0.10 for e in p)} | "
                     f"{max(s, key=abs):+.1%} | {sum(abs(e) <= 0.10 for e in s)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="+")
    parser.add_argument("--out", default=str(ROOT / "results" / "compiled_model"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tag", default="current")
    args = parser.parse_args()
    out = Path(args.out)
    start = time.process_time()
    rows = [row for path in args.experiments for row in check(path, out, args.rounds, args.steps)]
    write_atomic(out / f"program_time_{args.tag}.csv", csv_text(rows, COLUMNS))
    print(summary(rows))
    print(f"{time.process_time() - start:.0f} CPU s in this process; median held-out |error|: programs "
          f"{statistics.median(abs(r['program_error']) for r in rows if r['kind'] != 'calibration'):.1%}, model "
          f"{statistics.median(abs(r['model_error']) for r in rows if r['kind'] != 'calibration'):.1%}")


if __name__ == "__main__":
    main()
