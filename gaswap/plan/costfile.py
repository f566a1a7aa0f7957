"""`costs.json` in a results folder: the very cost figures a search used, so that figures drawn later
(`gaswap plot`) re-simulate with them instead of measuring again (timings move from run to run).

The file is plain data: per op name its seconds, the host<->device link, the device and the cost source,
and the fingerprint of the graph they belong to. No torch here.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from gaswap.base.errors import Refusal
from gaswap.base.files import UnreadableFile, read_text
from gaswap.plan.costs import Costs

NAME = "costs.json"
FORMAT = 1
MAX_BYTES = 64 * 2**20  # a 4,500-op graph's costs.json is a few hundred KB; larger ones are refused unread


class CostFileError(Refusal, ValueError):
    """A costs.json that cannot be used: damaged, edited, or made for another graph (refused, exit 4: the
    results folder it is in does not add up)."""


def dumps(costs: Costs, fingerprint: str) -> str:
    """The text of costs.json for `costs` of the graph with `fingerprint`."""
    return json.dumps({
        "format": FORMAT,
        "graph_fingerprint": fingerprint,
        "device": costs.device,
        "source": costs.source,
        "d2h_bandwidth": costs.d2h_bandwidth,
        "h2d_bandwidth": costs.h2d_bandwidth,
        "copy_latency": costs.copy_latency,
        "copies_overlap": costs.copies_overlap,
        "measured": costs.measured,
        "estimated": list(costs.estimated),
        "op_time": costs.op_time,
    }, indent=1) + "\n"


def load(folder: str | Path, fingerprint: str, op_names) -> Costs | None:
    """The costs recorded in `folder/costs.json` for the graph with `fingerprint` and these ops; None when the
    folder has no such file (written before costs were recorded). Raises CostFileError when it is unusable."""
    path = Path(folder) / NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(read_text(path, MAX_BYTES))
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        op_time = {str(k): _seconds(v) for k, v in data["op_time"].items()}
        costs = Costs(op_time=op_time, d2h_bandwidth=_positive(data["d2h_bandwidth"]),
                      h2d_bandwidth=_positive(data["h2d_bandwidth"]), device=str(data["device"]),
                      source=str(data["source"]), copy_latency=_seconds(data["copy_latency"]),
                      measured=int(data["measured"]), estimated=tuple(str(n) for n in data["estimated"]),
                      copies_overlap=bool(data["copies_overlap"]))
        recorded = data["graph_fingerprint"]
    except UnreadableFile as err:
        raise CostFileError(f"unusable: {err}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CostFileError(f"{path}: unusable ({err})") from None
    if recorded != fingerprint or set(op_time) != set(op_names):
        raise CostFileError(f"{path}: recorded for graph {recorded}, but the experiment now captures graph "
                            f"{fingerprint} (another model, shapes or torch version)")
    return costs


def _seconds(value) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{value} is not a time in seconds")
    return value


def _positive(value) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{value} is not a positive bandwidth")
    return value
