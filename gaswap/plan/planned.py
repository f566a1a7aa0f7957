"""Whether a policy runs where it was planned: its predicted step time holds only on the device (and, for
a CPU, with the thread count) its costs came from. No torch here.
"""
from __future__ import annotations

import re

_THREADS = re.compile(r"^(?P<cpu>cpu: .*) \((?P<n>\d+) threads?\)$")


def mismatch(provenance: dict, here: str) -> str | None:
    """One line saying how the device `here` (as `gaswap.run.measure.device_name` names it, e.g. "cpu: AMD EPYC
    (2 threads)" or "NVIDIA H100 80GB HBM3") differs from the one the policy's costs came from; None when
    they are the same or the policy does not say."""
    planned, source = provenance.get("device"), str(provenance.get("cost_source") or "")
    if not planned or planned == here:
        return None
    if source.startswith("estimated"):
        return (f"the policy was planned for {planned} (costs estimated from its hardware profile) and runs on "
                f"{here}: its predicted step time is {planned}'s, not this device's")
    ours, theirs = _THREADS.match(here), _THREADS.match(str(planned))
    if ours and theirs and ours["cpu"] == theirs["cpu"]:
        return (f"the policy's costs were measured with {theirs['n']} CPU thread(s) and this run uses {ours['n']}: "
                f"step times differ from the prediction (torch.set_num_threads({theirs['n']}), or search with "
                f"costs.threads: {ours['n']})")
    return (f"the policy's costs were measured on {planned} and this run is on {here}: its predicted step "
            f"time does not apply here")
