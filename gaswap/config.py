"""Experiment and search-space files: a frozen dataclass schema, strict loading and memory-size units.

Every loader error is a `ConfigError` whose message is one line naming the file and the key path, e.g.
"experiments/x.yaml: ga.population: must be a positive integer, got 0". No torch here, and the model
factory is only checked for its "module:callable" form, never imported.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, NoReturn

import yaml

from gaswap import units
from gaswap.graph import COUNTABLE

LOSSES = ("cross_entropy", "mse", "sum", "external")  # external: computed outside the step
NO_TARGET = ("sum", "external")  # losses that take no target
OPTIMIZERS = ("sgd", "sgd_momentum", "adam")
DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")
INT_DTYPES = ("int64", "int32")  # dtypes whose random values need an exclusive upper bound `high`
COST_SOURCES = ("estimate", "measure")
DEVICES = ("auto", "cpu", "cuda")
ACTIONS = ("keep", "swap", "recompute")
AUTOCAST = ("bfloat16", "float16")
CROSSOVERS = ("uniform", "two_point")
BATCH = "batch"  # the shape entry replaced by the batch size
MAX_FRACTION = 10  # the largest budget accepted as a fraction of the keep-all peak ("10x")
SEARCH_SPACES_DIR = Path(__file__).resolve().parents[1] / "search_spaces"
DEFAULT_SEARCH_SPACE = "hybrid"
_UNITS = {"B": 1, "KB": 10**3, "KiB": 2**10, "MB": 10**6, "MiB": 2**20,
          "GB": 10**9, "GiB": 2**30, "TB": 10**12, "TiB": 2**40}
_SIZE = re.compile(rf"(-?\d+(?:\.\d+)?)\s*({'|'.join(_UNITS)}|x)?")


class ConfigError(ValueError):
    """An invalid configuration; str() is one line naming the file and the key."""


# ------------------------------------------------------------------------------------------ schema


@dataclass(frozen=True)
class ModelSpec:
    """The model to train, built by another module as `factory(**kwargs)`."""

    factory: str  # "module:callable", e.g. "gaswap.zoo:alexnet"
    kwargs: dict = field(default_factory=dict)  # keyword arguments of the factory


@dataclass(frozen=True)
class TensorSpec:
    """A random tensor fed to the model or the loss."""

    shape: tuple  # positive ints and "batch" (replaced by the batch size)
    dtype: str = "float32"  # one of DTYPES
    high: int | None = None  # exclusive upper bound of the values; integer dtypes only (and required there)


@dataclass(frozen=True)
class Budget:
    """A memory budget: an absolute size in bytes or a fraction of the keep-all peak (exactly one set)."""

    bytes: int | None = None  # absolute budget in bytes
    fraction: float | None = None  # budget as a multiple of the keep-all peak, in (0, MAX_FRACTION]

    def __post_init__(self):
        if (self.bytes is None) == (self.fraction is None):
            raise ValueError("a Budget needs exactly one of bytes and fraction")

    def resolve(self, keep_all_peak: int) -> int:
        """The budget in bytes, given the peak memory of keeping every activation."""
        return self.bytes if self.bytes is not None else int(self.fraction * keep_all_peak)

    def __str__(self) -> str:
        return format_size(self.bytes) if self.bytes is not None else f"{self.fraction:g}x"


@dataclass(frozen=True)
class CostSpec:
    """Where operator and transfer costs come from."""

    source: str = "measure"  # "measure" on a device or "estimate" from a hardware profile
    profile: str | None = None  # hardware profile name; required for (and only for) source "estimate"
    device: str = "auto"  # where to measure: auto | cpu | cuda
    threads: int | None = None  # CPU intra-op threads (torch.set_num_threads) to measure and validate with


@dataclass(frozen=True)
class GASettings:
    """Genetic-algorithm settings."""

    population: int = 64  # individuals per generation
    generations: int = 60  # maximum number of generations
    workers: int = 1  # processes evaluating individuals
    cx_prob: float = 0.9  # probability that a pair of parents is crossed over
    mut_prob: float = 0.5  # probability that a child is mutated
    patience: int | None = None  # stop when the best feasible time hasn't improved for this many generations


@dataclass(frozen=True)
class SearchSpace:
    """What the GA may change, and how its genes mutate and cross over."""

    name: str  # the file stem
    description: str = ""  # one line for humans
    order: bool = True  # evolve the operator order
    actions: tuple[str, ...] = ACTIONS  # actions genes may take; always includes "keep"
    key_sigma: float = 0.1  # std of the gaussian mutation of order keys
    key_indpb: float = 0.05  # per-key mutation probability
    action_indpb: float = 0.05  # per-gene action mutation probability
    crossover: str = "uniform"  # uniform | two_point (applied to both key and action genes)
    cx_indpb: float = 0.5  # per-gene swap probability for uniform crossover


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """One experiment file, validated."""

    name: str  # names the results (default: the file stem)
    path: str  # the file it was loaded from
    model: ModelSpec  # the model to train
    inputs: tuple[TensorSpec, ...]  # positional inputs of model.forward
    target: TensorSpec | None = None  # the loss target; required unless loss is "sum" or "external"
    loss: str = "sum"  # one of LOSSES; "external": the step ends at the model's output (gaswap.apply's module form)
    batch_size: int  # replaces "batch" in shapes
    optimizer: str = "sgd"  # one of OPTIMIZERS
    budget: Budget  # the memory budget
    counts: tuple[str, ...] = COUNTABLE  # persistent memory counted toward the budget
    costs: CostSpec = CostSpec()  # where costs come from
    search_space: SearchSpace  # loaded from the file's `search_space` name or path (default: hybrid)
    ga: GASettings = GASettings()  # genetic-algorithm settings
    seed: int = 0  # seeds the GA and the random inputs
    autocast: str | None = None  # run forward and loss under autocast: "bfloat16" | "float16" (None: off)


# ------------------------------------------------------------------------------------------ public API


def parse_size(text: str | int) -> Budget:
    """Parse "4GB", "3.5GiB", "4096MiB", 123456 (bytes) or "0.5x" (of the keep-all peak); units are case-sensitive."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"invalid size {text!r}: expected e.g. 4GB, 3.5GiB, 4096MiB, 123456 (bytes) or 0.5x")
    number, unit = Decimal(match[1]), match[2] or "B"
    if number <= 0:
        raise ConfigError(f"invalid size {text!r}: must be positive")
    if unit == "x":
        if number > MAX_FRACTION:
            raise ConfigError(f"invalid size {text!r}: a fraction of the keep-all peak must be at most {MAX_FRACTION}x")
        return Budget(fraction=float(number))
    size = number * _UNITS[unit]
    if size != size.to_integral_value():
        raise ConfigError(f"invalid size {text!r}: not a whole number of bytes")
    return Budget(bytes=int(size))


def format_size(size: int) -> str:
    """A byte count in the display convention of `gaswap.units`: "4.00 GB" (decimal, default) or "3.73 GiB"."""
    return units.format_size(size)


def load_search_space(name_or_path: str | Path, *, root: str | Path | None = None) -> SearchSpace:
    """Load a search space by name (a file in `root`, default SEARCH_SPACES_DIR) or by path to a yaml."""
    return _load_space_file(_find_space(str(name_or_path), Path(root or SEARCH_SPACES_DIR), base=None))


def load_experiment(path: str | Path) -> Experiment:
    """Load and validate an experiment file; a relative search-space path is relative to this file."""
    path = Path(path)
    where = _Where(str(path))
    raw = _read_yaml(path)
    raw.setdefault("name", path.stem)
    raw.setdefault("search_space", DEFAULT_SEARCH_SPACE)
    checks = _EXPERIMENT_CHECKS | {"search_space": _space_check(path.parent)}
    experiment = _build(where, raw, Experiment, checks, ("model", "inputs", "batch_size", "budget"), path=str(path))
    if experiment.loss in NO_TARGET and experiment.target is not None:
        where["target"].fail(f"not used by loss {experiment.loss!r}; remove it or choose another loss")
    if experiment.loss not in NO_TARGET and experiment.target is None:
        where["target"].fail(f"required for loss {experiment.loss!r}")
    return experiment


# ------------------------------------------------------------------------------------------ strict loading


@dataclass(frozen=True)
class _Where:
    """A position in a config file (file name plus key path) that raises errors located there."""

    file: str
    path: str = ""

    def __getitem__(self, key: str | int) -> _Where:
        if isinstance(key, int):
            return _Where(self.file, f"{self.path}[{key}]")
        return _Where(self.file, f"{self.path}.{key}" if self.path else str(key))

    def fail(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.file}: {self.path}: {message}" if self.path else f"{self.file}: {message}")


Check = Callable[[_Where, Any], Any]  # validates and converts the value found at a position


def _show(value: Any) -> str:
    """A short repr of an offending value."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _suggest(word: Any, options) -> str:
    """ " (did you mean 'x'?)" when `word` is close to one of `options`, else ""."""
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _StrictLoader(yaml.SafeLoader):
    """yaml's SafeLoader, refusing a key given twice in one mapping (safe_load keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> dict:
    """The top-level mapping of a YAML file (safe types only; a key given twice is an error)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or str(err).replace("\n", " ")
        raise ConfigError(f"{path}: {line}invalid YAML: {problem}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {_show(raw)}")
    return raw


def _build(where: _Where, raw: Any, cls: type, checks: dict[str, Check], required=(), **extra):
    """Strictly read mapping `raw` into dataclass `cls`: keys only from `checks` (each checked), all `required`
    keys present; omitted keys keep the dataclass defaults; `extra` fields are passed through."""
    if not isinstance(raw, dict):
        where.fail(f"must be a mapping, got {_show(raw)}")
    for key in raw:
        if key not in checks:
            where.fail(f"unknown key {str(key)!r}{_suggest(key, checks)}")
    for key in required:
        if key not in raw:
            where.fail(f"missing required key {key!r}")
    return cls(**extra, **{key: checks[key](where[key], value) for key, value in raw.items()})


def _record(cls: type, checks: dict[str, Check], required=()) -> Check:
    """Check a nested mapping read into dataclass `cls`."""
    return lambda where, raw: _build(where, raw, cls, checks, required)


def _integer(minimum: int, what: str) -> Check:
    def check(where, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            where.fail(f"must be {what}, got {_show(value)}")
        return value
    return check


def _number(low: float, high: float, what: str) -> Check:
    def check(where, value):
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (is_number and math.isfinite(value) and low <= value <= high):
            where.fail(f"must be {what}, got {_show(value)}")
        return float(value)
    return check


def _choice(options: tuple[str, ...]) -> Check:
    def check(where, value):
        if not isinstance(value, str) or value not in options:
            where.fail(f"must be one of {', '.join(options)}, got {_show(value)}{_suggest(value, options)}")
        return value
    return check


def _pattern(regex: str, what: str) -> Check:
    def check(where, value):
        if not isinstance(value, str) or not re.fullmatch(regex, value):
            where.fail(f"must be {what}, got {_show(value)}")
        return value
    return check


def _list(item: Check, *, nonempty: bool = False, unique: bool = False) -> Check:
    """Check a list item by item; returns a tuple."""
    def check(where, value):
        if not isinstance(value, list) or (nonempty and not value):
            where.fail(f"must be a {'non-empty ' if nonempty else ''}list, got {_show(value)}")
        items = tuple(item(where[i], v) for i, v in enumerate(value))
        for i, v in enumerate(items if unique else ()):
            if v in items[:i]:
                where[i].fail(f"duplicate entry {_show(v)}")
        return items
    return check


def _optional(check: Check) -> Check:
    return lambda where, value: None if value is None else check(where, value)


def _boolean(where, value):
    if not isinstance(value, bool):
        where.fail(f"must be true or false, got {_show(value)}")
    return value


def _string(where, value):
    if not isinstance(value, str) or not value:
        where.fail(f"must be a non-empty string, got {_show(value)}")
    return value


def _kwargs(where, value):
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        where.fail(f"must be a mapping of argument names to values, got {_show(value)}")
    return value


def _dim(where, value):
    if value != BATCH and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        where.fail(f"must be a positive integer or {BATCH!r}, got {_show(value)}")
    return value


def _size(where, value):
    try:
        return parse_size(value)
    except ConfigError as err:
        where.fail(str(err))


def _tensor(where, raw):
    spec = _build(where, raw, TensorSpec, _TENSOR_CHECKS, ("shape",))
    if spec.dtype in INT_DTYPES and spec.high is None:
        where["high"].fail(f"required for integer dtype {spec.dtype} (the exclusive upper bound of the values)")
    if spec.dtype not in INT_DTYPES and spec.high is not None:
        where["high"].fail(f"only applies to integer dtypes ({', '.join(INT_DTYPES)}), not {spec.dtype}")
    return spec


def _costs(where, raw):
    costs = _build(where, raw, CostSpec, _COST_CHECKS)
    if costs.source == "estimate" and costs.profile is None:
        where["profile"].fail("required when source is 'estimate'")
    if costs.source != "estimate" and costs.profile is not None:
        where["profile"].fail(f"only used when source is 'estimate', not {costs.source!r}")
    if costs.threads is not None and (costs.source, costs.device) != ("measure", "cpu"):
        where["threads"].fail("only used when measuring on the CPU (source 'measure', device 'cpu')")
    return costs


def _find_space(text: str, root: Path, base: Path | None) -> Path:
    """The file of a search space: a path (relative to `base` if given) or a name in `root`."""
    if text.endswith((".yaml", ".yml")) or "/" in text or "\\" in text:
        path = base / text if base is not None else Path(text)
        if not path.is_file():
            raise ConfigError(f"search space file {str(path)!r} not found")
        return path
    path = root / f"{text}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in root.glob("*.yaml"))
        raise ConfigError(f"unknown search space {text!r}{_suggest(text, known)} (known: {', '.join(known) or 'none'})")
    return path


def _load_space_file(path: Path) -> SearchSpace:
    where = _Where(str(path))
    space = _build(where, _read_yaml(path), SearchSpace, _SPACE_CHECKS, name=path.stem)
    if "keep" not in space.actions:
        where["actions"].fail(f"must include 'keep', got {_show(list(space.actions))}")
    if not space.order and space.actions == ("keep",):
        where.fail("nothing to search: order is false and the only action is keep")
    return space


def _space_check(base: Path) -> Check:
    """Check an experiment's `search_space` entry and load it (relative paths from `base`)."""
    def check(where, value):
        _string(where, value)
        try:
            path = _find_space(value, SEARCH_SPACES_DIR, base)
        except ConfigError as err:
            where.fail(str(err))
        return _load_space_file(path)
    return check


_POSITIVE = _integer(1, "a positive integer")
_PROBABILITY = _number(0, 1, "a probability in [0, 1]")
_TENSOR_CHECKS = {
    "shape": _list(_dim),
    "dtype": _choice(DTYPES),
    "high": _optional(_POSITIVE),
}
_COST_CHECKS = {
    "source": _choice(COST_SOURCES),
    "profile": _optional(_string),
    "device": _choice(DEVICES),
    "threads": _optional(_POSITIVE),
}
_GA_CHECKS = {
    "population": _POSITIVE,
    "generations": _POSITIVE,
    "workers": _POSITIVE,
    "cx_prob": _PROBABILITY,
    "mut_prob": _PROBABILITY,
    "patience": _optional(_POSITIVE),
}
_SPACE_CHECKS = {
    "description": _string,
    "order": _boolean,
    "actions": _list(_choice(ACTIONS), nonempty=True, unique=True),
    "key_sigma": _number(0, math.inf, "a non-negative number"),
    "key_indpb": _PROBABILITY,
    "action_indpb": _PROBABILITY,
    "crossover": _choice(CROSSOVERS),
    "cx_indpb": _PROBABILITY,
}
_EXPERIMENT_CHECKS = {
    "name": _pattern(r"[\w.-]+", "a name of letters, digits, '_', '.' and '-'"),
    "model": _record(ModelSpec, {
        "factory": _pattern(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", "'module:callable', e.g. 'gaswap.zoo:alexnet'"),
        "kwargs": _kwargs,
    }, ("factory",)),
    "inputs": _list(_tensor, nonempty=True),
    "target": _optional(_tensor),
    "loss": _choice(LOSSES),
    "batch_size": _POSITIVE,
    "optimizer": _choice(OPTIMIZERS),
    "budget": _size,
    "counts": _list(_choice(COUNTABLE), unique=True),
    "costs": _costs,
    "ga": _record(GASettings, _GA_CHECKS),
    "seed": _integer(0, "a non-negative integer"),
    "autocast": _optional(_choice(AUTOCAST)),
}
