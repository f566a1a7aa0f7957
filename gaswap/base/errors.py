"""gaswap's exceptions, one hierarchy: every class carries the exit code `gaswap` ends with when it stops a verb
(README, "Exit codes and trust"). A class derives from the intermediate class of its code; `gaswap.app.cli`
reads `exit_code`, so a new class needs no entry anywhere else. No torch here.

Codes no class carries: 0 done, 5 a file or folder that cannot be read or written (an OSError, or host memory
running out), 128 + the signal for Ctrl-C or SIGTERM (a KeyboardInterrupt, not an error).
"""
from __future__ import annotations

INTERNAL, BAD_INPUT, NO_FIT, REFUSED, UNWRITABLE = 1, 2, 3, 4, 5


class GaswapError(Exception):
    """The root: an error a user is not expected to meet, reported as an internal error (a bug)."""

    exit_code: int = INTERNAL


class BadInput(GaswapError):
    """A bad experiment file, command-line value or model, or a folder that holds no results."""

    exit_code = BAD_INPUT


class NoFit(GaswapError):
    """No policy fits the budget."""

    exit_code = NO_FIT


class Refusal(GaswapError):
    """Refused: another experiment's or another running search's results folder, no or an unusable checkpoint,
    a policy file that is unreadable, edited or made for another model, or a factory named only by a file."""

    exit_code = REFUSED
