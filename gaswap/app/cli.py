"""gaswap fits neural-network training into a memory budget. It captures one training step of your model,
then searches the operator order and, per activation, whether to keep it on the device, swap it to host
memory or recompute it, predicting each policy's step time and peak memory with a simulator. The result is a
Pareto front of policy files you can plot, check with real training steps, and apply in your training loop.

typical use:
  gaswap search experiments/alexnet_4gb.yaml     # writes results/alexnet_4gb/ (policy.yaml, front, figures...)
  gaswap plot results/alexnet_4gb                # Pareto front, convergence, memory timeline, action map
  gaswap validate results/alexnet_4gb/policy.yaml --steps 10   # measured against predicted
  then, in Python: gaswap.apply(model, policy, inputs) or gaswap.apply_step(model, policy, inputs, target)

`python -m gaswap` works the same as `gaswap`. Sizes are shown in decimal units (GB = 10^9 bytes) unless
--units binary (or $GASWAP_UNITS=binary) asks for GiB = 2^30 bytes."""
# One thin function per verb below; the work is done in gaswap.app.workflow, bench, validate and report.
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import os
import shlex
import signal
import sys
import warnings
from pathlib import Path

from tqdm import tqdm

from gaswap.app.gpu_check import STEPS as GPU_CHECK_STEPS
from gaswap.base import config, errors, units
from gaswap.base.config import format_size
from gaswap.base.signals import from_code, named_interrupts


def _workers(text: str):
    """An argparse type: a count of worker processes, or "auto" (None: one per CPU)."""
    return None if text == "auto" else _at_least(0, int)(text)


def _at_least(minimum: float, kind=int):
    """An argparse type: a number of `kind` that is at least `minimum`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not (value >= minimum and value < float("inf")):
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (and finite), got {text}")
        return value
    return parse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gaswap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _units_option(parser, None)
    common = argparse.ArgumentParser(add_help=False)
    _units_option(common, argparse.SUPPRESS)  # also after the verb, without overriding one given before it
    verbs = parser.add_subparsers(dest="verb", required=True)
    add_parser = functools.partial(verbs.add_parser, parents=[common])
    p = add_parser("search", help="search keep/swap/recompute policies for an experiment")
    p.add_argument("experiment", help="experiment YAML file, e.g. experiments/alexnet_4gb.yaml")
    p.add_argument("--results", default="results", help="folder of result folders (default: results)")
    p.add_argument("--cache", default=None, help="cost cache folder (default: $GASWAP_CACHE or ~/.cache/gaswap)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted search from results/<experiment>/.checkpoint.json")
    p.add_argument("--force", action="store_true", help="replace a results folder made by another experiment")
    p.set_defaults(run=search)
    p = add_parser("speed", help="benchmark the simulator: evaluations per second")
    p.add_argument("experiments", nargs="*", help="experiment files whose graphs to time (default: alexnet_4gb)")
    p.add_argument("--synthetic-ops", type=_at_least(2), default=2000, help="size of the synthetic graph also timed")
    p.add_argument("--seconds", type=_at_least(0.01, float), default=3.0, help="time spent per graph")
    p.set_defaults(run=speed)
    p = add_parser("validate", help="run real training steps under a policy: measured vs predicted")
    p.add_argument("policy", help="policy file, e.g. results/tiny_cnn_cpu/policy.yaml")
    p.add_argument("--steps", type=_at_least(3), default=5, help="training steps (at least 3; default 5)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (cuda if present), cpu or cuda")
    p.add_argument("--experiment", default=None,
                   help="the experiment file to build the model from (default: the one the policy names; its "
                        "factory must then be one of gaswap's own models unless --trust-factory)")
    p.add_argument("--trust-factory", action="store_true",
                   help="build the model from the factory the policy's experiment names, even outside gaswap.zoo")
    p.add_argument("--arena", action="store_true",
                   help="run the step's activations from one buffer allocated beforehand at planned offsets")
    p.add_argument("--recalibrate", action="store_true",
                   help="compiled policies: time the op costs and the calibration policies again here first and "
                        "predict the step time from them too (for a policy planned on another device; minutes)")
    p.set_defaults(run=validate)
    p = add_parser("plot", help="write the Pareto, convergence, memory-timeline and action-map PNGs")
    p.add_argument("results", help="a results folder, e.g. results/alexnet_4gb")
    p.add_argument("--cache", default=None, help="cost cache folder of the search (measured costs)")
    p.add_argument("--trust-factory", action="store_true",
                   help="build the model from the factory the results name, even outside gaswap.zoo")
    p.set_defaults(run=plot)
    p = add_parser("bench", help="baselines, GA per search space and MILP at several budgets")
    p.add_argument("experiment", help="experiment YAML file, e.g. experiments/gpt_bench.yaml")
    p.add_argument("--budgets", default="0.9,0.75,0.5,0.33,0.25",
                   help="comma-separated fractions of keep-all peak or sizes (default 0.9,0.75,0.5,0.33,0.25)")
    p.add_argument("--results", default="results", help="folder of result folders (default: results)")
    p.add_argument("--cache", default=None, help="cost cache folder (default: $GASWAP_CACHE or ~/.cache/gaswap)")
    p.add_argument("--time-limit", type=_at_least(0.1, float), default=60.0,
                   help="MILP time limit per budget, seconds (default 60)")
    p.set_defaults(run=bench)
    p = add_parser("compare", help="eager, torch.compile memory budgets and gaswap compiled policies, head to head")
    p.add_argument("experiment", help="experiment YAML file, e.g. experiments/compare_densenet_cpu.yaml")
    p.add_argument("--rounds", type=_at_least(1, int), default=5, help="rounds of all methods in rotated order (default 5)")
    p.add_argument("--steps", type=_at_least(1, int), default=3, help="timed steps per method and round (default 3)")
    p.add_argument("--below", default="0.8", help="also search gaswap policies at these fractions of the lowest "
                                                  "peak torch's partitions measure (default 0.8)")
    p.add_argument("--finalists", type=_at_least(0, int), default=1,
                   help="gaswap policies per budget, fastest in prediction, whose programs fit, compiled and timed "
                        "first beside torch's partitions that fit, the fastest compared (default 1; 0: the fastest "
                        "in prediction, unchecked and untimed)")
    p.add_argument("--results", default="results", help="folder of result folders (default: results)")
    p.add_argument("--cache", default=None, help="cost cache folder (default: $GASWAP_CACHE or ~/.cache/gaswap)")
    p.add_argument("--workers", type=_workers, default=None,
                   help="processes that compile the policies before they are timed (default auto: one per CPU, at "
                        "most 4, where the model trains on the CPU, none on a GPU; 0: the measuring process compiles)")
    p.set_defaults(run=compare)
    p = add_parser("shard-compare", help="a sharded run's checkpointing head to head: no AC, full AC, torchtitan's "
                                         "SAC and per-layer AC, gaswap; per rank at W = 8, 64, 256")
    p.add_argument("experiment", help="experiment YAML file with `distributed:`, e.g. experiments/llama3_8b_fsdp8.yaml")
    p.add_argument("--results", default="results", help="folder of result folders (default: results)")
    p.add_argument("--world-sizes", default=None, help="comma-separated world sizes (default: 8,64,256)")
    p.add_argument("--gloo", action="store_true",
                   help="also apply each method's plan and run it under gloo at the experiment's world size (small "
                        "models only)")
    p.add_argument("--gloo-world-sizes", default=None,
                   help="comma-separated world sizes to run under gloo, e.g. 2,4 (implies --gloo)")
    p.add_argument("--no-reserved", action="store_true", help="skip the allocator model's reserved peak")
    p.add_argument("--force", action="store_true", help="replace a results folder made by another experiment")
    p.set_defaults(run=shard_compare)
    p = add_parser("memory", help="GPU memory of policies: live, allocator allocated/reserved, arena plan")
    p.add_argument("experiments", nargs="+", help="experiment files, e.g. experiments/alexnet_4gb.yaml")
    p.add_argument("--results", default="results", help="folder of result folders with shipped policies")
    p.set_defaults(run=memory)
    p = add_parser("check-gpu", help="on a CUDA machine: CUDA tests, search + validate two experiments, "
                                           "allocator model vs measured memory, one JSON report")
    p.add_argument("--out", default="gpu_check.json", help="the JSON report (default: gpu_check.json)")
    p.add_argument("--steps", type=_at_least(3, int), default=GPU_CHECK_STEPS,
                   help=f"validation steps per experiment (default {GPU_CHECK_STEPS}: a warm-up, then "
                        f"{GPU_CHECK_STEPS - 1} timed)")
    p.set_defaults(run=check_gpu)
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse printed the usage and one error line (or the help)
        return stop.code if isinstance(stop.code, int) else errors.BAD_INPUT
    return run(args)


def run(args) -> int:
    """Run a verb; every failure a user can meet is one `error:` line and its exit code, never a traceback
    (README, "Exit codes and trust"): a GaswapError's `exit_code` (gaswap.base.errors), 5 a file or folder
    that cannot be read or written, 128 + the signal when stopped; 1 any other error (a bug: GASWAP_DEBUG=1
    shows the traceback)."""
    try:
        units.use(args.units)
        units.convention()  # a bad $GASWAP_UNITS is refused before any work
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return errors.BAD_INPUT
    format_before = warnings.formatwarning
    warnings.formatwarning = _warning_line
    logged = _LogLines()
    logging.getLogger("gaswap").addHandler(logged)
    try:
        with named_interrupts():
            return args.run(args)
    except KeyboardInterrupt as err:  # Ctrl-C outside a search, or a second signal during one
        if from_code(err):
            return _error("the code gaswap ran raised KeyboardInterrupt itself, no Ctrl-C came (the model's "
                          "forward or loss?)", errors.BAD_INPUT)
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"\ninterrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        return _error(f"{where}cannot read or write ({err.strerror or err})", errors.UNWRITABLE)
    except MemoryError:
        return _error("out of host memory", errors.UNWRITABLE)
    except Exception as err:
        inner = getattr(err, "inner_exception", None)  # torch.compile wraps what its backend (gaswap's) raised
        if isinstance(inner, errors.GaswapError) and inner.exit_code != errors.INTERNAL:
            err = inner
        if isinstance(err, errors.GaswapError) and err.exit_code != errors.INTERNAL:  # one a user can act on
            return _error(err, err.exit_code)
        if os.environ.get("GASWAP_DEBUG"):  # a bug: say so in one line
            raise
        return _error(f"internal error, please report it: {type(err).__name__}: {err} "
                      f"(GASWAP_DEBUG=1 shows the traceback)", errors.INTERNAL)
    finally:
        warnings.formatwarning = format_before
        logging.getLogger("gaswap").removeHandler(logged)


class _LogLines(logging.Handler):
    """gaswap's log records (warnings and above) as one `warning:` or `error:` line each, as warnings are."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        kind = "warning" if record.levelno < logging.ERROR else "error"
        print(_warning_line(record.getMessage(), None, "", 0).replace("warning:", f"{kind}:", 1), end="",
              file=sys.stderr)


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as gaswap prints it: one `warning:` line, without Python's file, line and category; on a line
    of its own when a progress bar is drawn."""
    below_bar = "\n" if tqdm._instances else ""
    return f"{below_bar}warning: {_one_line(message)}\n"


def _error(err, code: int) -> int:
    print(f"error: {_one_line(err)}", file=sys.stderr)
    return code


def _one_line(err) -> str:
    return " ".join(str(err).split("\n"))


def _bar(**kwargs) -> tqdm:
    """A progress bar on stderr. One that goes when done (`leave=False`) stays, ended by a newline, where stderr is
    no terminal (a log file): what gaswap prints next (an error) then starts a line of its own there."""
    if not sys.stderr.isatty():
        kwargs["leave"] = True
    return tqdm(**kwargs)


def _units_option(parser, default) -> None:
    parser.add_argument("--units", choices=tuple(units.CONVENTIONS), default=default,
                        help=f"how sizes are shown: decimal (GB = 10^9 bytes) or binary (GiB = 2^30 bytes); "
                             f"default: ${units.ENV}, else decimal")


def _prog() -> str:
    """How this command was started, for the commands it suggests: `python -m gaswap` or `gaswap`."""
    return "python -m gaswap" if Path(sys.argv[0]).name == "__main__.py" else "gaswap"


def search(args) -> int:
    """Capture, cost, search and write `results/<experiment>/`; print a short table."""
    exp = config.load_experiment(args.experiment)  # a bad file is refused before torch is imported
    if exp.distributed is not None:
        # imported when this verb runs: one rank of a sharded run is planned there
        from gaswap.app import shard_plan

        return shard_plan.command(args, exp)
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app import results, workflow

    out = workflow.results_folder(args.results, exp)
    with results.locked(out):  # one search per results folder, from the first check to the last file
        note = results.recover(out)
        if note:
            print(f"note: {note}")
        workflow.check_results_folder(exp, out, resume=args.resume, force=args.force)
        return _search(args, exp, out)


def _search(args, exp, out) -> int:
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app import workflow
    from gaswap.base.signals import stop_on_signals
    from gaswap.plan.checkpoint import NAME as CHECKPOINT
    from gaswap.plan.search import CHECKPOINT_SECONDS

    if not args.resume and (out / CHECKPOINT).is_file():
        print(f"note: {out / CHECKPOINT} holds an interrupted search; this new search replaces it "
              f"(--resume would continue it)")
    figures = sorted(p.name for p in out.glob("*.png")) if out.is_dir() else []  # a new search outdates them
    if figures:
        print(f"{out}/ holds figures ({', '.join(figures)}): drawing them again into the new results")
    print(f"gaswap search {exp.name}: {exp.model.factory}, batch {exp.batch_size}, budget {exp.budget}, "
          f"search space {exp.search_space.name}")
    with _bar(desc="capture + cost measurement", unit="op", leave=False) as bar:
        prepared = workflow.prepare(exp, cache_dir=args.cache, progress=_progress(bar))
    g = prepared.graph
    print(f"graph: {len(g.ops)} ops, {len(g.tensors)} tensors, {len(g.candidates())} candidate activations "
          f"(captured in {prepared.capture_seconds:.1f} s); costs {prepared.costs.source} on {prepared.costs.device} "
          f"({prepared.costs_seconds:.1f} s)")
    try:
        with _bar(total=exp.ga.generations, desc="search", unit="gen") as gens, \
                stop_on_signals(lambda message: gens.write(message, file=sys.stderr)) as stop:

            def on_generation(record, nearest):
                rule, progress = nearest  # the stopping rule nearest to ending the search
                gens.n = record.generation
                gens.set_postfix(best=_ms(record.best_time_s), front=record.front_size, stop=f"{rule} {progress:.0%}")

            result, summary = workflow.run_search(prepared, out, on_generation=on_generation, resume=args.resume,
                                                  force=args.force, stop=stop,
                                                  finish=_redraw(args.cache) if figures else None)
    except KeyboardInterrupt as err:
        if (out / CHECKPOINT).is_file():
            print(f"\nstopped at once; {out / CHECKPOINT} holds the search as of its last checkpoint (written at "
                  f"most {CHECKPOINT_SECONDS:g} s of search earlier)\n"
                  f"resume with: {resume_command(args)}", file=sys.stderr)
        raise err
    print(table(result, summary))
    if not result.complete:
        print(f"interrupted ({signal.Signals(stop.signum).name}) after generation {result.generations_done} of "
              f"{exp.ga.generations}: wrote the results so far to {out}/ (summary.json: \"complete\": false) "
              f"and the checkpoint {out / CHECKPOINT}\nresume with: {resume_command(args)}")
        return stop.exit_code
    drawn = sorted(p.name for p in out.glob("*.png"))
    print(f"wrote {out}/ (policy.yaml, front.csv, history.csv, summary.json, costs.json, policies/"
          + "".join(f", {name}" for name in drawn) + ")")
    print(next_steps(out, exp, plotted=bool(drawn)))
    return 0


def _redraw(cache):
    """What draws the figures into a new results folder before it replaces the old one (`results.write`): a
    folder killed at any moment then holds the old figures or the new ones, all of them. A failure to draw is a
    warning: the results are written without figures."""
    def finish(folder: Path) -> None:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the new folder's name is a temporary one
                _plot_folder(folder, cache, trust_factory=True)  # the experiment this command was given
        except Exception as err:  # noqa: BLE001 - the search's results matter more than its figures
            print(f"warning: the figures could not be drawn again ({_one_line(err)}); run `{_prog()} plot` on the "
                  f"folder", file=sys.stderr)
            for half in folder.glob("*.png"):  # all of them or none
                half.unlink()
    return finish


def next_steps(out: Path, exp, *, plotted: bool = False) -> str:
    """What to do with a results folder just written: plot, validate, apply in a training loop."""
    prog = _prog()
    policy = shlex.quote(str(out / "policy.yaml"))
    lines = ["next:"]
    if not plotted:
        lines.append(f"  {prog} plot {shlex.quote(str(out))}    # Pareto front, convergence, memory timeline, "
                     f"action map (PNGs in the folder)")
    lines.append(f"  {prog} validate {policy} --steps 10    # real training steps: measured against predicted "
                 f"peak and step time")
    path = str(out / "policy.yaml")
    if exp.loss == "external":
        lines += ["  in your training loop (the model's forward and backward under the policy, your loss as is):",
                  f"    model = gaswap.apply(model, {path!r}, example_inputs)"]
    else:
        lines += ["  in your training loop (forward, loss and backward under the policy):",
                  f"    step = gaswap.apply_step(model, {path!r}, inputs, target); loss = step(x, y)"]
    return "\n".join(lines)


def resume_command(args) -> str:
    """The command line that resumes this search."""
    words = [*_prog().split(), "search", args.experiment, "--resume"]
    if args.results != "results":
        words += ["--results", args.results]
    if args.cache is not None:
        words += ["--cache", args.cache]
    return " ".join(shlex.quote(str(w)) for w in words)


def table(result, summary) -> str:
    """Keep-all, the seed policies and the best policy under the budget, side by side."""
    keep = summary["keep_all"]
    rows = [("policy", "peak", "step time", "overhead", "keep/swap/recompute")]

    def row(name, e):
        if not e.valid:
            return (name, "invalid", "", "", "")
        counts = e.counts()
        over = e.step_time / keep["step_time_s"] - 1
        fits = "" if e.peak_bytes <= summary.get("planning_budget_bytes", summary["budget_bytes"]) else " (over budget)"
        return (name, format_size(e.peak_bytes) + fits, _ms(e.step_time), f"{over:+.1%}",
                f"{counts['keep']}/{counts['swap']}/{counts['recompute']}")

    for name, e in result.seeds.items():
        rows.append(row(name.replace("_", "-"), e))
    if result.best is None:  # a search stopped before it found one
        rows.append(("best (GA)", "none under the budget yet", "", "", ""))
    else:
        rows.append(row("best (GA)", result.best))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    budget = format_size(summary["budget_bytes"])
    if summary["budget"] != budget:
        budget += f" ({summary['budget']})"
    lines.append(f"budget {budget}; costs {summary['cost_source']}; "
                 f"search {result.seconds:.1f} s, {result.evaluations} evaluations, {len(result.front)} policies "
                 f"on the front")
    margin = summary.get("device_margin") or {}
    if margin.get("kept_bytes"):  # what came off the budget: docs/gpu_memory.md, "The margin a search keeps"
        lines.append(f"planned for {format_size(summary['planning_budget_bytes'])}: {format_size(margin['kept_bytes'])} "
                     f"kept for what the device holds beyond the graph's tensors ({margin['source']}"
                     + (f"; {margin['note']})" if margin.get("note") else ")"))
    return "\n".join(lines)


def speed(args) -> int:
    """Print simulator evaluations per second on experiment graphs and a synthetic graph."""
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app.speed import simulator_speed

    for line in simulator_speed(args.experiments or ["experiments/alexnet_4gb.yaml"], args.synthetic_ops,
                                args.seconds):
        print(line)
    return 0


def memory(args) -> int:
    """Print the GPU-memory table of `gaswap.app.gpu_memory_report` for the experiments (estimated costs only)."""
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app import gpu_memory_report, workflow

    table = []
    for path in args.experiments:
        exp = config.load_experiment(path)
        if exp.costs.source != "estimate":
            print(f"error: {path}: costs.source must be 'estimate' here (no device is used)", file=sys.stderr)
            return errors.BAD_INPUT
        table += gpu_memory_report.rows(workflow.prepare(exp), args.results)
    print(gpu_memory_report.markdown(table))
    return 0


def check_gpu(args) -> int:
    """Run the GPU check (gaswap.app.gpu_check) and write its report; 0 also when there is no GPU (it says so)."""
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app import gpu_check

    report = gpu_check.run(args.out, steps=args.steps)
    if report.get("skipped"):
        print(f"skipped: {report['skipped']}; wrote {args.out}")
        return 0
    for name, figures in report.get("experiments", {}).items():
        print(f"{name}: {figures.get('goals', figures.get('error'))}")
        validation = figures.get("validation") or {}
        if validation.get("host_bound"):
            print(f"  its step ({_ms(validation['measured']['step_time_s'])}) was bound by the host, which took "
                  f"{_ms(validation['measured']['issue_time_s'])} to issue it (docs/running_policies.md)")
    print(f"{len(report['errors'])} error(s); wrote {args.out} in {report['seconds']} s")
    return 0 if not report["errors"] else 1


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < float("inf") else "-"


def _progress(bar):
    def update(done, total):
        bar.total = total
        bar.n = done
        bar.refresh()

    return update


def validate(args) -> int:
    """Train a few real steps under a policy; print and write predicted vs measured peak and step time."""
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app.validate import validate as run_validation
    from gaswap.plan import planned
    from gaswap.plan import policy as policies

    with _bar(total=args.steps, desc="validate", unit="step", leave=False) as bar:
        r = run_validation(args.policy, args.steps, args.device, experiment=args.experiment,
                           trust_factory=args.trust_factory, progress=_progress(bar), arena=args.arena,
                           recalibrate=args.recalibrate, say=lambda line: bar.write(line, file=sys.stderr))
    p, m = r["predicted"], r["measured"]
    print(f"{r['experiment']} on {r['device']} ({r['steps']} steps; costs {r['cost_source']})")
    elsewhere = planned.mismatch(policies.load(args.policy).provenance, r["device"])
    for warning in [elsewhere] if elsewhere else r.get("warnings", []):  # compiled: a policy naming no device
        print(f"warning: {warning}", file=sys.stderr)
    if elsewhere and r.get("compiled") and "recalibrated" not in r:
        print("  (--recalibrate times this policy's calibration here first and predicts its step time from it)",
              file=sys.stderr)
    print(f"  peak       predicted {format_size(p['peak_bytes'])}, measured {format_size(m['peak_bytes'])} "
          f"({r['peak_ratio'] - 1:+.1%}); budget "
          f"{'none recorded' if r['budget_bytes'] is None else format_size(r['budget_bytes'])}")
    if "graph_peak_ratio" in r:
        print(f"             (the peak predicted holds each op's transients measured on the device; the graph's "
              f"tensors alone: {format_size(p['graph_peak_bytes'])}, {r['graph_peak_ratio'] - 1:+.1%})")
    if "search_peak_ratio" in r:
        beyond = p.get("beyond_programs_bytes")
        print(f"             (the peak predicted is the generated program's"
              + (f", and {format_size(beyond)} the meter read beyond torch's programs" if beyond else "")
              + f"; the search's model predicted {format_size(p['search_peak_bytes'])}: "
              f"{r['search_peak_ratio'] - 1:+.1%})")
    print(f"  step time  predicted {_ms(p['step_time_s'])}, measured {_ms(m['step_time_s'])} ({r['time_ratio'] - 1:+.1%})"
          + (" (planned for another device)" if elsewhere else ""))
    if r.get("host_bound"):
        print(f"             the host took {_ms(m['issue_time_s'])} of it to issue the step: bound by Python's "
              f"dispatch of its ops, which the prediction (the ops' time on the device) leaves out, and which "
              f"follows the host's speed of the moment")
    if "recalibrated" in r:
        c = r["recalibrated"]
        print(f"             recalibrated here: predicted {_ms(c['step_time_s'])}, measured beside the "
              f"calibration {_ms(c['measured_beside_s'])} ({c['time_ratio'] - 1:+.1%}); timing the costs and "
              f"{len(c['calibration']['points'])} calibration policies took {c['cpu_s']:.0f} CPU s, "
              f"{c['wall_s']:.0f} s wall; the model fits them within {c['worst_fit']:.1%}")
        if not r["targets"]["recalibrated_time_within_15pc"]:
            from gaswap.app.validate_compiled import TIME_TOLERANCE  # loaded by the validation just run: no cost

            print(f"             not within {TIME_TOLERANCE:.0%}: the model fits its own points no closer than "
                  f"{c['worst_fit']:.1%}, timed at a load of {r['load_per_cpu']:.2f} per CPU (timings on a loaded "
                  f"CPU vary from run to run)")
    if "arena" in r:
        a = r["arena"]
        copied = len(a["ops_out_composite"]) + len(a["ops_copied"])
        print(f"  arena      {format_size(a['bytes'])} (bound {format_size(a['lower_bound_bytes'])}), counted in the "
              f"peak; {a['ops_out']} ops wrote into it, {copied} kinds of op copied their results in (largest "
              f"{format_size(a['largest_transient_bytes'])})")
    print(f"wrote {r.get('written') or Path(args.policy).with_name('validation.json')}")
    return 0


def plot(args) -> int:
    """Write the figures of a results folder beside it."""
    _plot_folder(Path(args.results), args.cache, args.trust_factory)
    return 0


def _plot_folder(folder: Path, cache, trust_factory: bool = False) -> list[Path]:
    """Draw a results folder's four figures, printing their paths, and loudly when costs had to be got again."""
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app.report import plot_results
    from gaswap.app.results import check_plottable

    check_plottable(folder, trust_factory=trust_factory)
    bars = []

    def measuring(done, total):  # a bar only when costs are measured again (no costs.json)
        if not bars:
            bars.append(_bar(desc="plot: measuring costs again", unit="op", leave=False))
        _progress(bars[0])(done, total)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            paths = plot_results(folder, cache_dir=cache, progress=measuring, trust_factory=trust_factory)
        finally:
            for bar in bars:
                bar.close()
    for warning in caught:
        print(f"warning: {_one_line(warning.message)}", file=sys.stderr)
    for path in paths:
        print(path)
    return paths


def bench(args) -> int:
    """Compare baselines, the GA in each search space and the MILP at several budgets."""
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app import bench as benchmark
    from gaswap.app import results
    from gaswap.plan.solvers.baselines import BASELINES

    exp = config.load_experiment(args.experiment)
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    methods = [*BASELINES, *(f"ga:{space}" for space in benchmark.SPACES), "milp"]  # the rows of a budget, in order
    with results.locked(results.folder_of(args.results, exp.name)), \
            _bar(desc="capture + cost measurement", unit="op", leave=False) as measuring, \
            _bar(total=len(budgets) * len(methods), desc="bench", unit="row") as bar:  # locked: refused at once while a search writes there

        def show(row):
            bar.update()
            if bar.n < bar.total:  # what runs now, and what the last row found
                found = _ms(row["step_time_s"] or float("inf")) + ("" if row["feasible"] else " (over budget)")
                bar.set_postfix_str(f"now {budgets[bar.n // len(methods)]} {methods[bar.n % len(methods)]}; "
                                    f"{row['method']}: {found}")

        rows = benchmark.run(args.experiment, budgets, results_root=args.results, cache_dir=args.cache,
                             time_limit=args.time_limit, progress=show, measure_progress=_progress(measuring))
    print(benchmark.to_markdown(rows, exp.name))
    print(f"wrote {Path(args.results) / exp.name}/ (bench.csv, bench.md)")
    return 0


def compare(args) -> int:
    """Eager, torch.compile at activation memory budgets and gaswap compiled policies, measured in one process."""
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app import compare as head_to_head

    return head_to_head.command(args)


def shard_compare(args) -> int:
    """A sharded run's checkpointing methods head to head, per rank, predicted (and measured under gloo)."""
    exp = config.load_experiment(args.experiment)  # a bad file is refused before torch is imported
    # imported when this verb runs: the others, and --help, load neither torch nor these modules
    from gaswap.app import shard_compare as head_to_head

    return head_to_head.command(args, exp)
