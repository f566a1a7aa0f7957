"""Experiment and search-space files: a frozen dataclass schema, strict loading and memory-size units.

Each key of a file is declared once, as a dataclass field whose metadata holds its check and its one-line
description (`key`); the loader reads keys, checks and required keys from the fields, and
`reference()` writes the table of every key (docs/experiment_keys.md) from them.

Every loader error is a `ConfigError` whose message is one line naming the file and the key path, e.g.
"experiments/x.yaml: ga.population: must be a positive integer, got 0". No torch here, and the model
factory is only checked for its "module:callable" form, never imported.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, NoReturn

from gaswap.base import units
from gaswap.base.errors import BadInput
from gaswap.base.files import UnreadableFile, load_yaml
from gaswap.base.training_options import (AUTOCAST, COUNTABLE, DEFAULT_LOSS, DEFAULT_OPTIMIZER, LOSSES, NO_TARGET,
                                          OPTIMIZERS)

DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INT_DTYPES = ("int64", "int32")  # dtypes whose random values need an exclusive upper bound `high`
COST_SOURCES = ("estimate", "measure")
EXECUTORS = ("processes", "dask")  # where a search's evaluations run (gaswap.plan.parallel.executor)
DEVICES = ("auto", "cpu", "cuda")
ACTIONS = ("keep", "swap", "recompute")
CROSSOVERS = ("uniform", "two_point")
MEMORY_TARGETS = ("live", "reserved")  # what a budget bounds: live tensor bytes, or the allocator's reservations
BATCH = "batch"  # the shape entry replaced by the batch size
MAX_FRACTION = 10  # the largest budget accepted as a fraction of the keep-all peak ("10x")
MAX_SIZE = 2**60  # the largest budget in bytes (1 EiB): far beyond any machine, small enough to stay exact
SEARCH_SPACES_DIR = Path(__file__).resolve().parents[2] / "search_spaces"
DEFAULT_SEARCH_SPACE = "hybrid"
MAX_FILE_BYTES = 2**20  # an experiment or search-space file is a few hundred bytes; larger ones are refused unread
# Search defaults, measured on GPT stacks and AlexNet: README "How a search starts, stops and scales". PATIENCE
# outlasts every plateau that recorded searches crossed before gaining 0.5 points of overhead or more (the
# longest: 44 generations, AlexNet; 28 on a 48-layer GPT, where patience 20 stopped one seed in five 2.6 points short)
PATIENCE, TOLERANCE, SHARE_BLOCKS = 50, 0.001, 0.5
MAX_WORKERS = 256  # ga.workers and costs.threads: more is a typo, not a machine
MAX_ELEMENTS = 2**48  # elements of one input tensor, batch included
MAX_INT32, MAX_SEED = 2**31 - 1, 2**32 - 1
MAX_WORLD_SIZE = 2**20  # ranks of one sharded run
STRATEGIES = ("fsdp", "zero2", "zero1", "ddp")
_UNITS = {"B": 1, "KB": 10**3, "KiB": 2**10, "MB": 10**6, "MiB": 2**20,
          "GB": 10**9, "GiB": 2**30, "TB": 10**12, "TiB": 2**40}
_SIZE = re.compile(rf"(-?\d+(?:\.\d+)?)\s*({'|'.join(_UNITS)}|x)?")


class ConfigError(BadInput, ValueError):
    """An invalid configuration; str() is one line naming the file and the key."""


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


def _read_yaml(path: Path) -> dict:
    """The top-level mapping of a YAML file (bounded size, safe types only, no aliases, no key given twice)."""
    try:
        raw = load_yaml(path, MAX_FILE_BYTES)
    except UnreadableFile as err:
        raise ConfigError(str(err)) from None
    if not isinstance(raw, dict):
        got = "nothing (an empty file)" if raw is None else f"a {type(raw).__name__}"  # no content echoed
        raise ConfigError(f"{path}: top level must be a mapping, got {got}")
    return raw


def key(check: Check, doc: str, default: Any = MISSING, *, factory: Any = MISSING, record: type | None = None,
        shown: str | None = None):
    """A dataclass field read from a file: `check` validates and converts its value, `doc` says what it is (one
    line, for the key reference), `default` or `factory` give its default (`shown`: the default the loader fills
    in, for a key without one here); `record` is the dataclass of a nested mapping (or of a list's items)."""
    return field(default=default, default_factory=factory,
                 metadata={"check": check, "doc": doc, "record": record, "shown": shown})


def _keys(cls: type) -> dict[str, Any]:
    """The fields of `cls` read from a file (those declared with `key`), by name."""
    return {f.name: f for f in fields(cls) if f.metadata.get("check") is not None}


def _build(where: _Where, raw: Any, cls: type, overrides: dict[str, Check] | None = None, **extra):
    """Strictly read mapping `raw` into dataclass `cls`: only its keys (unknown ones are refused before any value is
    checked), each checked by its field's check (or `overrides`), every key without a default present; omitted
    keys keep the dataclass defaults; `extra` fields are passed through."""
    if not isinstance(raw, dict):
        where.fail(f"must be a mapping, got {_show(raw)}")
    keys = _keys(cls)
    for name in raw:
        if name not in keys:
            where.fail(f"unknown key {str(name)!r}{_suggest(name, keys)}")
    for name, f in keys.items():
        if f.default is MISSING and f.default_factory is MISSING and name not in raw:
            where.fail(f"missing required key {name!r}")
    checks = {name: f.metadata["check"] for name, f in keys.items()} | (overrides or {})
    return cls(**extra, **{name: checks[name](where[name], value) for name, value in raw.items()})


def _record(cls: type) -> Check:
    """Check a nested mapping read into dataclass `cls`."""
    return lambda where, raw: _build(where, raw, cls)


def _integer(minimum: int, what: str, maximum: int = MAX_INT32) -> Check:
    def check(where, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            where.fail(f"must be {what}, got {_show(value)}")
        if value > maximum:
            where.fail(f"must be at most {maximum}, got {_show(value)}")
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


def _boolean_or_group(where, value):
    if isinstance(value, bool) or (isinstance(value, int) and value >= 2):
        return value
    where.fail(f"must be true, false or an integer of at least 2 (the ranks to reshard to), got {_show(value)}")


def _boolean_or_search(where, value):
    if isinstance(value, bool) or value == "search":
        return value
    where.fail(f"must be true, false or search, got {_show(value)}")


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
    if value != BATCH and value > MAX_INT32:
        where.fail(f"must be at most {MAX_INT32}, got {_show(value)}")
    return value


def _size(where, value):
    try:
        return parse_size(value)
    except ConfigError as err:
        where.fail(str(err))


def _tensor(where, raw):
    spec = _build(where, raw, TensorSpec)
    if spec.dtype in INT_DTYPES and spec.high is None:
        where["high"].fail(f"required for integer dtype {spec.dtype} (the exclusive upper bound of the values)")
    if spec.dtype not in INT_DTYPES and spec.high is not None:
        where["high"].fail(f"only applies to integer dtypes ({', '.join(INT_DTYPES)}), not {spec.dtype}")
    return spec


def _distributed(where, raw):
    spec = _build(where, raw, DistributedSpec)
    if spec.strategy != "fsdp" and spec.units:
        where["units"].fail(f"only used by strategy 'fsdp', not {spec.strategy!r}")
    if spec.strategy == "fsdp" and not spec.units:
        where["units"].fail("name the modules to shard, e.g. [DecoderLayer] (class names or path patterns)")
    if spec.mesh is not None and (len(spec.mesh) != 2 or spec.mesh[0] * spec.mesh[1] != spec.world_size
                                  or spec.mesh[1] < 2):
        where["mesh"].fail(f"must be [replicate, shard] with replicate x shard = world_size {spec.world_size} and "
                           f"shard at least 2, got {list(spec.mesh)}")
    shard = spec.mesh[1] if spec.mesh else spec.world_size
    k = spec.reshard_after_forward
    if not isinstance(k, bool) and (k >= shard or shard % k):
        where["reshard_after_forward"].fail(f"an integer must divide the shard size {shard} and be below it, "
                                            f"got {k}")
    return spec


def _costs(where, raw):
    costs = _build(where, raw, CostSpec)
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
        if not text.endswith((".yaml", ".yml")):  # another file is not read, nor a line of it shown
            raise ConfigError(f"search space file {text!r}: must be a .yaml or .yml file (or a search space name: "
                              f"{', '.join(sorted(p.stem for p in root.glob('*.yaml')))})")
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
    space = _build(where, _read_yaml(path), SearchSpace, name=path.stem)
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


# ------------------------------------------------------------------------------------------ schema

_POSITIVE = _integer(1, "a positive integer")
_WORKERS = _integer(1, "a positive integer", MAX_WORKERS)
_PROBABILITY = _number(0, 1, "a probability in [0, 1]")
_NAME = _pattern(r"\w[\w.-]{0,99}", "a name of letters, digits, '_', '.' and '-' (at most 100, not "
                                    "starting with '.' or '-')")
_FACTORY = _pattern(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", "'module:callable', e.g. 'gaswap.zoo:alexnet'")


@dataclass(frozen=True)
class ModelSpec:
    """The model to train, built by another module as `factory(**kwargs)`."""

    factory: str = key(_FACTORY, "`module:callable` returning the model, e.g. `gaswap.zoo:alexnet` (see the trust "
                                 "model: a class deriving from nn.Module or a function of your own)")
    kwargs: dict = key(_kwargs, "keyword arguments of the factory", factory=dict)


@dataclass(frozen=True)
class TensorSpec:
    """A random tensor fed to the model or the loss."""

    shape: tuple = key(_list(_dim), f"list of positive ints and `{BATCH}` (replaced by the batch size)")
    dtype: str = key(_choice(DTYPES), f"one of {', '.join(DTYPES)}", "float32")
    high: int | None = key(_optional(_integer(1, "a positive integer", 2**63 - 1)),
                           "exclusive upper bound of the random values; integer dtypes only, and required there",
                           None)


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

    source: str = key(_choice(COST_SOURCES), "`measure` on a device, or `estimate` from a hardware profile",
                      "measure")
    profile: str | None = key(_optional(_string), "hardware profile (`gaswap/profiles/`); required for, and only "
                                                  "for, source `estimate`", None)
    device: str = key(_choice(DEVICES), "where to measure: `auto` (cuda if present), `cpu` or `cuda`", "auto")
    threads: int | None = key(_optional(_WORKERS), f"CPU intra-op threads to measure and validate with (1 to "
                                                   f"{MAX_WORKERS}); only when measuring on the CPU", None)


@dataclass(frozen=True)
class MemorySpec:
    """GPU memory as PyTorch's CUDA caching allocator holds it (its model: gaswap.plan.memory.allocator)."""

    target: str = key(_choice(MEMORY_TARGETS), "what the budget bounds: `live` tensor bytes (the simulator's peak) "
                      "or `reserved`, the segments the caching allocator would reserve (each evaluation about 10x "
                      "slower)", "live")
    expandable_segments: bool = key(_boolean, "model the allocator run with "
                                    "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`", False)


@dataclass(frozen=True)
class Prefetch:
    """How many FSDP units ahead each rank all-gathers parameters (FSDP2: `set_modules_to_forward_prefetch`,
    `set_modules_to_backward_prefetch`)."""

    forward: int = key(_integer(0, "a non-negative integer", 8), "units prefetched in the forward (FSDP2's "
                       "default 0: none)", 0)
    backward: int = key(_integer(1, "an integer of at least 1", 8), "units prefetched in the backward (FSDP2's "
                        "default 1; torch 2.13's FSDP2 cannot prefetch none)", 1)


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's `MixedPrecisionPolicy`: the dtype parameters are all-gathered and computed in, and the dtype
    gradients are reduced in (none: the parameters' own)."""

    param_dtype: str | None = key(_optional(_choice(FLOAT_DTYPES)), f"one of {', '.join(FLOAT_DTYPES)}", None)
    reduce_dtype: str | None = key(_optional(_choice(FLOAT_DTYPES)), f"one of {', '.join(FLOAT_DTYPES)}", None)


@dataclass(frozen=True)
class DistributedSpec:
    """How the training step is sharded over ranks: FSDP2 (`fully_shard`, ZeRO-3) or a named preset."""

    world_size: int = key(_integer(2, "an integer of at least 2", MAX_WORLD_SIZE), f"ranks (2 to {MAX_WORLD_SIZE})")
    strategy: str = key(_choice(STRATEGIES), "`fsdp` (fully_shard, ZeRO-3), `zero2` (parameters whole on every "
                        "rank, gradients and optimizer state sharded), `zero1` (optimizer state sharded) or `ddp`",
                        "fsdp")
    units: tuple[str, ...] = key(_list(_string, unique=True), "modules `fully_shard` is applied to: class names "
                                 "(`DecoderLayer`) or path patterns (`layers.*`); the root is always a unit", ())
    reshard_after_forward: bool | int = key(_boolean_or_group, "free each unit's unsharded parameters after its "
                                            "forward and all-gather them again for its backward (FSDP2's default "
                                            "for non-root units); an integer k (2 <= k < world_size, dividing it): "
                                            "keep a 1/k slice after the forward and all-gather within k ranks",
                                            True)
    mesh: tuple[int, ...] | None = key(_optional(_list(_integer(1, "a positive integer"), nonempty=True)),
                                       "HSDP: a 2-D mesh [replicate, shard] (product world_size): parameters "
                                       "sharded over `shard` ranks, gradients all-reduced across `replicate`", None)
    prefetch: Prefetch = key(_record(Prefetch), "units prefetched ahead", factory=Prefetch, record=Prefetch)
    mixed_precision: MixedPrecision = key(_record(MixedPrecision), "parameter and reduce dtypes",
                                          factory=MixedPrecision, record=MixedPrecision)
    offload: bool | str = key(_boolean_or_search, "FSDP2's `CPUOffloadPolicy`: sharded parameters, gradients "
                              "and optimizer state live on the host; `search`: the search chooses how many units "
                              "to offload (priced with the profile's `host_memory_bandwidth`)", False)
    link: str | None = key(_optional(_string), "the interconnect of the hardware profile's `links` the "
                           "collectives run over (none: the profile's first)", None)


@dataclass(frozen=True)
class GASettings:
    """Genetic-algorithm settings."""

    population: int = key(_POSITIVE, "individuals per generation", 64)
    generations: int = key(_POSITIVE, "upper limit on generations: a search stops earlier when it converges "
                           "(`patience`)", 500)
    workers: int = key(_WORKERS, f"processes evaluating individuals (1 to {MAX_WORKERS})", 1)
    cx_prob: float = key(_PROBABILITY, "probability that a pair of parents is crossed over", 0.9)
    mut_prob: float = key(_PROBABILITY, "probability that a child is mutated", 0.5)
    patience: int | None = key(_optional(_POSITIVE), "converged: stop when a policy fits and for this many "
                               "generations neither the best feasible time nor the front's hypervolume improved by "
                               "more than `tolerance` (none: run exactly `generations`)", PATIENCE)
    tolerance: float = key(_number(0, 1, "a relative improvement in [0, 1]"),
                           "relative improvement that counts for `patience` (0.001 = 0.1 %)", TOLERANCE)
    max_evaluations: int | None = key(_optional(_POSITIVE), "stop once this many policies were evaluated", None)
    max_seconds: float | None = key(_optional(_number(0, math.inf, "a non-negative number of seconds")),
                                    "stop once the search ran this long (resumed runs included)", None)
    milp_seed_ops: int = key(_integer(0, "a non-negative integer"), "on graphs of at most this many ops, the "
                             "keep/recompute MILP's policy (solved briefly) joins the seeds where it fits (0: never)",
                             300)
    executor: str = key(_choice(EXECUTORS), "where evaluations run: `processes` (`workers` on this machine) or "
                        "`dask` (a Dask distributed cluster; needs `pip install 'dask[distributed]'`)", "processes")
    address: str | None = key(_optional(_string), "with `executor: dask`, the scheduler's address "
                              "(tcp://host:8786); none: a local cluster of `workers` processes", None)


@dataclass(frozen=True)
class SearchSpace:
    """What the GA may change, and how its genes mutate and cross over."""

    name: str  # the file stem
    description: str = key(_string, "one line for humans", "")
    order: bool = key(_boolean, "evolve the operator order", True)
    actions: tuple[str, ...] = key(_list(_choice(ACTIONS), nonempty=True, unique=True),
                                   "actions genes may take; must include `keep`", ACTIONS)
    key_sigma: float = key(_number(0, math.inf, "a non-negative number"),
                           "standard deviation of the gaussian mutation of order keys", 0.1)
    key_indpb: float = key(_PROBABILITY, "per-key mutation probability", 0.05)
    action_indpb: float = key(_PROBABILITY, "per-gene action mutation probability", 0.05)
    crossover: str = key(_choice(CROSSOVERS), "`uniform` or `two_point` (applied to both key and action genes)",
                         "uniform")
    cx_indpb: float = key(_PROBABILITY, "per-gene swap probability of the uniform crossover", 0.5)
    share_blocks: float = key(_PROBABILITY, "probability that a new individual takes one block's genes for every "
                              "identical block (transformer layers, residual stages: `gaswap.plan.blocks`)", SHARE_BLOCKS)


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """One experiment file, validated."""

    name: str = key(_NAME, "names the results folder", shown="the file's stem")
    path: str  # the file it was loaded from
    given: frozenset[str] = frozenset()  # the top-level keys the file names itself (the others took their defaults)
    model: ModelSpec = key(_record(ModelSpec), "the model to train", record=ModelSpec)
    inputs: tuple[TensorSpec, ...] = key(_list(_tensor, nonempty=True), "positional inputs of model.forward: a "
                                                                        "list of tensors", record=TensorSpec)
    target: TensorSpec | None = key(_optional(_tensor), "the loss target (a tensor); required unless the loss is "
                                                        f"{' or '.join(NO_TARGET)}", None, record=TensorSpec)
    loss: str = key(_choice(LOSSES), f"one of {', '.join(LOSSES)}; `external`: the step ends at the model's output "
                                     "(gaswap.apply's module form)", DEFAULT_LOSS)
    batch_size: int = key(_POSITIVE, f"replaces `{BATCH}` in shapes (at most {MAX_INT32})")
    optimizer: str = key(_choice(OPTIMIZERS), f"one of {', '.join(OPTIMIZERS)} (its state counts toward the "
                                              "budget)", DEFAULT_OPTIMIZER)
    budget: Budget = key(_size, f"memory budget: `4GB`, `3.5GiB`, `4096MiB`, bytes (at most 2^60, 1 EiB), or `0.5x` "
                                f"of the keep-all peak (at most {MAX_FRACTION}x)")
    counts: tuple[str, ...] = key(_list(_choice(COUNTABLE), unique=True), f"persistent memory counted toward the "
                                                                          f"budget: any of {', '.join(COUNTABLE)}",
                                  COUNTABLE)
    costs: CostSpec = key(_costs, "where costs come from", factory=CostSpec, record=CostSpec)
    search_space: SearchSpace = key(_string, "a search space name (`search_spaces/`) or a path to one, relative "
                                             "to the experiment file", shown=f"`{DEFAULT_SEARCH_SPACE}`")
    ga: GASettings = key(_record(GASettings), "genetic-algorithm settings", factory=GASettings, record=GASettings)
    seed: int = key(_integer(0, "a non-negative integer", MAX_SEED), f"seeds the GA and the random inputs (0 to "
                                                                     f"{MAX_SEED})", 0)
    autocast: str | None = key(_optional(_choice(AUTOCAST)), f"run forward and loss under autocast: "
                                                             f"{' or '.join(AUTOCAST)} (none: off)", None)
    distributed: DistributedSpec | None = key(_optional(_distributed), "shard the step over ranks (FSDP2); the "
                                              "budget is then per rank (none: one device)", None,
                                              record=DistributedSpec)
    memory: MemorySpec | None = key(_optional(_record(MemorySpec)), "GPU memory as the caching allocator holds it: "
                                    "results then give its allocated and reserved peaks beside the live one (none: "
                                    "live bytes only)", None, record=MemorySpec)


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
    if size > MAX_SIZE:
        raise ConfigError(f"invalid size {text!r}: at most {MAX_SIZE} bytes (1 EiB)")
    return Budget(bytes=int(size))


def _name_from(path: Path, where: _Where) -> str:
    """The experiment's name taken from its file name; refused, saying how to set `name:`, when the file name
    is no such name (a space, an emoji...)."""
    try:
        return _NAME(where["name"], path.stem)
    except ConfigError:
        fixed = re.sub(r"[^\w.-]+", "_", path.stem).strip("._-")[:100] or "experiment"
        where.fail(f"the file name {path.name!r} gives no experiment name (it names the results folder: letters, "
                   f"digits, '_', '.' and '-' only); add a `name:` key, e.g. `name: {fixed}`, or rename the file")


def format_size(size: int) -> str:
    """A byte count in the display convention of `gaswap.base.units`: "4.00 GB" (decimal, default) or "3.73 GiB"."""
    return units.format_size(size)


def load_search_space(name_or_path: str | Path, *, root: str | Path | None = None) -> SearchSpace:
    """Load a search space by name (a file in `root`, default SEARCH_SPACES_DIR) or by path to a yaml."""
    return _load_space_file(_find_space(str(name_or_path), Path(root or SEARCH_SPACES_DIR), base=None))


def load_experiment(path: str | Path) -> Experiment:
    """Load and validate an experiment file; a relative search-space path is relative to this file."""
    path = Path(path)
    where = _Where(str(path))
    raw = _read_yaml(path)
    given = frozenset(raw)
    if "name" not in raw:  # the defaults `shown` in the schema
        raw["name"] = _name_from(path, where)
    raw.setdefault("search_space", DEFAULT_SEARCH_SPACE)
    experiment = _build(where, raw, Experiment, {"search_space": _space_check(path.parent)}, path=str(path),
                        given=given)
    if experiment.loss in NO_TARGET and experiment.target is not None:
        where["target"].fail(f"not used by loss {experiment.loss!r}; remove it or choose another loss")
    if experiment.loss not in NO_TARGET and experiment.target is None:
        where["target"].fail(f"required for loss {experiment.loss!r}")
    tensors = [("inputs", i, spec) for i, spec in enumerate(experiment.inputs)] + [("target", None, experiment.target)]
    for key, i, spec in tensors:
        elements = math.prod(experiment.batch_size if d == BATCH else d for d in spec.shape) if spec else 0
        if elements > MAX_ELEMENTS:
            place = where[key] if i is None else where[key][i]
            place["shape"].fail(f"more than {MAX_ELEMENTS} elements with batch size {experiment.batch_size}")
    return experiment




# ------------------------------------------------------------------------------------------ key reference


def reference() -> str:
    """Markdown tables of every key of an experiment file and of a search-space file, from the schema (the
    committed docs/experiment_keys.md is this text: `python -m gaswap.base.config > docs/experiment_keys.md`)."""
    lines = ["# Experiment and search-space file keys", "",
             "Generated from the schema in `gaswap/base/config.py` by `python -m gaswap.base.config`; do not edit by hand.",
             "Unknown keys, wrong types and impossible values are refused with one line naming the file and key.", ""]
    for title, cls in (("Experiment files (`experiments/*.yaml`)", Experiment),
                       ("Search-space files (`search_spaces/*.yaml`)", SearchSpace)):
        lines += [f"## {title}", "", "| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{name}` | {default} | {doc} |" for name, default, doc in _rows(cls)]
        lines.append("")
    return "\n".join(lines)


def _rows(cls: type, prefix: str = ""):
    """(key path, default, description) of each key of `cls`, nested records after their parent."""
    for name, f in _keys(cls).items():
        record = f.metadata["record"]
        many = record is not None and f.type.startswith("tuple")
        path = f"{prefix}{name}{'[]' if many else ''}"
        yield path, _default(f), f.metadata["doc"]
        if record is not None:
            yield from _rows(record, path + ".")


def _default(f) -> str:
    if f.metadata["shown"]:
        return f.metadata["shown"]
    if f.default is MISSING and f.default_factory is MISSING:
        return "required"
    value = f.default if f.default is not MISSING else f.default_factory()
    if value is None or value in ("", {}):
        return "none" if value is None else f"`{value!r}`"
    if hasattr(value, "__dataclass_fields__"):
        return "see below"
    if isinstance(value, tuple):
        return f"`[{', '.join(value)}]`"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


if __name__ == "__main__":
    print(reference())
