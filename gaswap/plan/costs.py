"""What operators and copies cost: the `Costs` the simulator reads, hardware profiles, roofline estimates
and the on-disk cache of measured figures. No torch here (the search core imports this module).

Signatures are JSON strings `{"target": "aten.mm.default", "args": [...], "kwargs": {...}}` in which a
tensor is `{"shape": [...], "dtype": "float32"}` (optionally with "stride"); see `measure.py`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gaswap.base.files import write_atomic
from gaswap.plan.graph import Graph, Op

# Bump when the way figures are measured changes: older caches are then ignored (they live in other files).
COST_MODEL_VERSION = 5  # 3: in-place timings of the generated-code runtime; 4: less the clock's own cost per reading;
# 5: off the CPU, *_for_cpu ops timed as the runtime runs them, integer inputs drawn within their range
PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"
DIRECTIONS = ("d2h", "h2d")


@dataclass(frozen=True)
class Costs:
    """Seconds of compute per op (by op name) and the host<->device link, for one graph on one device.

    `source` is "measured" or "estimated:<profile>". From `measure()`, `measured` counts the distinct
    signatures that call tried to time (0 when everything came from the cache) and `estimated` names the
    ops that could not run standalone and got a roofline figure instead. `copies_overlap` is False where
    host copies run on the compute thread (a CPU "device": the runtime's host store copies synchronously).
    """

    op_time: dict[str, float]
    d2h_bandwidth: float
    h2d_bandwidth: float
    device: str
    source: str
    copy_latency: float = 0.0
    measured: int = 0
    estimated: tuple[str, ...] = ()
    copies_overlap: bool = True

    def copy_time(self, nbytes: int, direction: str) -> float:
        """Seconds to copy `nbytes` device->host ("d2h") or host->device ("h2d")."""
        if direction not in DIRECTIONS:
            raise ValueError(f"copy direction {direction!r} is not one of {DIRECTIONS}")
        bandwidth = self.d2h_bandwidth if direction == "d2h" else self.h2d_bandwidth
        return self.copy_latency + nbytes / bandwidth


# --------------------------------------------------------------------------- hardware profiles


@dataclass(frozen=True)
class HardwareProfile:
    """Datasheet figures for one device. Rates in FLOP/s and bytes/s, sizes in bytes, times in seconds.

    `peak_flops` maps a dtype name to its peak ("float32" is required and serves dtypes not listed);
    `efficiency` is the achievable fraction of peak FLOP/s and memory bandwidth. The link bandwidths are
    already effective (pinned memory), so `efficiency` does not apply to them.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    d2h_bandwidth: float
    h2d_bandwidth: float
    memory_bytes: int
    launch_overhead: float
    efficiency: float
    copy_latency: float = 0.0
    copies_overlap: bool = True  # False for a CPU: its host copies hold up compute
    links: dict = field(default_factory=dict)  # interconnect name -> {"latency_s": s, "bandwidth_Bps": bytes/s}
    gpus_per_node: int | None = None  # devices a node's fast link joins (sharded runs beyond go over the slowest)
    host_memory_bandwidth: float | None = None  # bytes/s of the host's memory one device's process can use

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype name, falling back to float32."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"])


def profile_names() -> list[str]:
    """Names of the shipped profiles (gaswap/profiles/<name>.yaml)."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name: str) -> HardwareProfile:
    """Load a shipped profile by name; an unknown name raises ValueError listing the known ones."""
    if name not in profile_names():
        raise ValueError(f"unknown hardware profile {name!r}; known profiles: {', '.join(profile_names())}")
    path = PROFILE_DIR / f"{name}.yaml"
    data = yaml.safe_load(path.read_text())
    try:
        return HardwareProfile(
            name=name,
            peak_flops={str(k): float(v) for k, v in data["peak_flops"].items()},
            memory_bandwidth=float(data["memory_bandwidth"]),
            d2h_bandwidth=float(data["d2h_bandwidth"]),
            h2d_bandwidth=float(data["h2d_bandwidth"]),
            memory_bytes=int(data["memory_bytes"]),
            launch_overhead=float(data["launch_overhead"]),
            efficiency=float(data["efficiency"]),
            copy_latency=float(data.get("copy_latency", 0.0)),
            copies_overlap=bool(data.get("copies_overlap", True)),
            links={str(k): {"latency_s": float(v["latency_s"]), "bandwidth_Bps": float(v["bandwidth_Bps"])}
                   for k, v in (data.get("links") or {}).items()},
            gpus_per_node=int(data["gpus_per_node"]) if data.get("gpus_per_node") is not None else None,
            host_memory_bandwidth=float(data["host_memory_bandwidth"]) if data.get("host_memory_bandwidth")
            else None,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"hardware profile {path} is malformed: {e!r}") from e


# --------------------------------------------------------------------------- roofline estimate


def signature_dtype(signature: str) -> str:
    """The dtype an op computes in: its first floating tensor's dtype, else its first tensor's, else float32."""
    try:
        spec = json.loads(signature)
    except ValueError:
        return "float32"
    dtypes = [str(t["dtype"]) for t in _tensor_specs(spec)] if isinstance(spec, dict) else []
    floating = [d for d in dtypes if "float" in d]
    return (floating or dtypes or ["float32"])[0].removeprefix("torch.")


def _tensor_specs(value):
    """Yield the tensor dicts (those with "shape" and "dtype") nested anywhere in a decoded signature."""
    if isinstance(value, dict):
        if "shape" in value and "dtype" in value:
            yield value
        else:
            for v in value.values():
                yield from _tensor_specs(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tensor_specs(v)


def roofline(op: Op, graph: Graph, profile: HardwareProfile) -> float:
    """max(compute time, memory time) + launch overhead, at the profile's achievable fraction of peak."""
    nbytes = sum(graph.tensors[t].size for t in set(op.inputs) | set(op.outputs))
    compute = op.flops / (profile.peak(signature_dtype(op.signature)) * profile.efficiency)
    memory = nbytes / (profile.memory_bandwidth * profile.efficiency)
    return max(compute, memory) + profile.launch_overhead


def estimate(graph: Graph, profile: HardwareProfile) -> Costs:
    """Costs of every op of `graph` from the roofline model of `profile` (no device needed)."""
    return Costs(
        op_time={op.name: roofline(op, graph, profile) for op in graph.ops},
        d2h_bandwidth=profile.d2h_bandwidth,
        h2d_bandwidth=profile.h2d_bandwidth,
        device=profile.name,
        source=f"estimated:{profile.name}",
        copy_latency=profile.copy_latency,
        copies_overlap=profile.copies_overlap,
    )


# --------------------------------------------------------------------------- measured-cost cache


def default_cache_dir() -> Path:
    """$GASWAP_CACHE, else ~/.cache/gaswap."""
    return Path(os.environ.get("GASWAP_CACHE") or Path.home() / ".cache" / "gaswap")


class CostCache:
    """Measured figures for one (device, torch version, cost-model version, timing method), in one JSON file
    under `root`. `timing` says how: "standalone" (each op timed alone) or "in place" (ops timed as a whole step
    runs), and with which clock (e.g. "standalone, CPU time").

    `op_time` maps signature -> seconds; `load` maps signature -> the load per CPU while it was timed (the
    conditions: `gaswap.run.measure` times wall-clock figures taken on a busy machine again); `failed` maps
    signature -> why it could not run standalone (not retried); `link` is None or {"d2h": bytes/s, "h2d":
    bytes/s, "latency": s}. The key picks the file name
    and is stored inside; an unreadable file, or one whose stored key differs, is moved aside to
    `<file>.bad` with a warning naming both files, and the cache starts empty (so figures are re-measured).
    `save()` writes atomically (temp file + os.replace); concurrent writers: the last one wins.
    """

    def __init__(self, device: str, torch_version: str, root: str | os.PathLike | None = None,
                 timing: str = "standalone"):
        self.key = {"device": device, "torch": torch_version, "cost_model": COST_MODEL_VERSION, "timing": timing}
        self.path = Path(root or default_cache_dir()) / _file_name(self.key)
        self.op_time: dict[str, float] = {}
        self.load: dict[str, float] = {}
        self.failed: dict[str, str] = {}
        self.link: dict[str, float] | None = None
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            if data.get("key") != self.key:
                raise ValueError(f"it holds figures for {data.get('key')}, not {self.key}")
            self.op_time = {str(k): _seconds(v, f"op_time[{str(k)[:60]}...]") for k, v in data["op_time"].items()}
            self.load = {str(k): _within(v, 0.0, MAX_LOAD, f"load[{str(k)[:60]}...]")
                         for k, v in data.get("load", {}).items()}
            self.failed = {str(k): str(v) for k, v in data["failed"].items()}
            link = data["link"]
            self.link = None if link is None else {k: _link(k, link[k]) for k in ("d2h", "h2d", "latency")}
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            self.op_time, self.load, self.failed, self.link = {}, {}, {}, None
            aside = self.path.with_name(self.path.name + ".bad")
            try:
                os.replace(self.path, aside)
            except OSError:  # a read-only cache folder: leave the file, ignore its figures, measure afresh
                warnings.warn(f"cost cache {self.path} is unusable ({e}); ignoring it (cannot move it aside)")
                return
            warnings.warn(f"cost cache {self.path} is unusable ({e}); moved it to {aside} and starting afresh")

    def save(self) -> None:
        """Write the cache atomically; a cache folder that cannot be written (read-only, full) is warned about
        and left as it is: the figures of this run are still used."""
        body = {"key": self.key, "op_time": self.op_time, "load": self.load, "failed": self.failed, "link": self.link}
        try:
            write_atomic(self.path, json.dumps(body, indent=1, sort_keys=True))
        except OSError as err:
            warnings.warn(f"cost cache {self.path}: cannot write it ({err.strerror or err}); the figures just "
                          f"measured are used but not kept")


# Plausible figures: an op between a picosecond and an hour, a link between 1 KB/s and 100 TB/s, a copy latency
# under a second. Anything else in a cache is damage or a hand edit, and would make predictions absurd.
OP_SECONDS = (1e-12, 3600.0)
LINK_BYTES_PER_S = (1e3, 1e14)
MAX_LATENCY = 1.0
MAX_LOAD = 1e6  # load per CPU


def _seconds(value, what: str) -> float:
    return _within(value, *OP_SECONDS, what)


def _link(key: str, value) -> float:
    if key == "latency":
        return _within(value, 0.0, MAX_LATENCY, "link.latency")
    return _within(value, *LINK_BYTES_PER_S, f"link.{key}")


def _within(value, low: float, high: float, what: str) -> float:
    """`value` as a float if it is a finite number in [low, high], else ValueError naming `what`."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{what} is {value!r}, not a number in [{low:g}, {high:g}]")
    return float(value)


def _file_name(key: dict) -> str:
    """A readable, unique file name for a cache key."""
    readable = re.sub(r"[^a-z0-9.+]+", "-", f"{key['device']} torch {key['torch']}".lower()).strip("-")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return f"{readable[:80]}-v{key['cost_model']}-{digest}.json"
