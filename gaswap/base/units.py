"""Memory sizes for display: one convention everywhere (CLI, bench tables, figures, scripts).

"decimal" (the default: KB, MB, GB = 10^3, 10^6, 10^9 bytes, as GPU datasheets and budgets like `4GB`
are written) or "binary" (KiB, MiB, GiB = 2^10, 2^20, 2^30 bytes, as `nvidia-smi` and PyTorch's memory
summary print). Chosen by `use()` (the CLI's `--units`), else $GASWAP_UNITS, else decimal. Files store
bytes; only what is shown to a reader is converted. No torch here.
"""
from __future__ import annotations

import os

ENV = "GASWAP_UNITS"
CONVENTIONS = {
    "decimal": (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)),
    "binary": (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)),
}
DEFAULT = "decimal"
_chosen: str | None = None


def use(convention: str | None) -> None:
    """Display sizes in `convention` ("decimal" or "binary") from now on; None goes back to $GASWAP_UNITS."""
    global _chosen
    if convention is not None and convention not in CONVENTIONS:
        raise ValueError(f"unknown units {convention!r}: choose one of {', '.join(CONVENTIONS)}")
    _chosen = convention


def convention() -> str:
    """The convention in use: `use()`'s, else $GASWAP_UNITS, else "decimal"."""
    chosen = _chosen or os.environ.get(ENV) or DEFAULT
    if chosen not in CONVENTIONS:
        raise ValueError(f"${ENV}={chosen!r}: choose one of {', '.join(CONVENTIONS)}")
    return chosen


def scale(size: float, convention_: str | None = None) -> tuple[int, str]:
    """(bytes per unit, unit name) to show `size` bytes in: the largest unit not above it (B below 1 KB)."""
    for name, factor in CONVENTIONS[convention_ or convention()]:
        if size >= factor:
            return factor, name
    return 1, "B"


def format_size(size: float, convention_: str | None = None) -> str:
    """A byte count in the display convention: "4.00 GB" (decimal) or "3.73 GiB" (binary); "12 B"."""
    factor, name = scale(size, convention_)
    return f"{size} B" if factor == 1 else f"{size / factor:.2f} {name}"
