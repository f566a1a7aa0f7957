"""The vocabulary every module speaks: per-tensor actions and the instructions of a step's program.

The lowest floor of the package (no imports from gaswap, no torch). An `Action` is what a policy decides
for one candidate activation; a program is a sequence of `Instruction`s, in issue order, that the simulator
emits and a runtime replays (compare torch.utils.checkpoint's `CheckpointPolicy` and Checkmate's
`OperatorEvaluation` / `DeallocateRegister`). `gaswap.plan.walker` is the one reading of a program: what each
verb needs and changes, checked, with hooks for each consumer.
"""
from __future__ import annotations

from enum import Enum, IntEnum
from typing import NamedTuple

from gaswap.base.errors import GaswapError


class Action(IntEnum):
    """What happens to a candidate activation between its forward and backward uses."""

    KEEP = 0
    SWAP = 1
    RECOMPUTE = 2

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action named `text` ("keep", "swap", "recompute"; any case); ValueError otherwise."""
        try:
            return cls[text.upper()]
        except (KeyError, AttributeError):
            raise ValueError(f"unknown action {text!r}: one of {', '.join(a.name.lower() for a in cls)}") from None

    @property
    def label(self) -> str:
        """The name used in files and tables: "keep", "swap" or "recompute"."""
        return self.name.lower()


class Verb(str, Enum):
    """One kind of program instruction. A `str` enum: `Verb.RUN == "run"`, so files stay plain text."""

    RUN = "run"  # run the op, in the policy's order
    RECOMPUTE = "recompute"  # re-run a forward op; outputs already present are dropped
    SWAP_OUT = "swap_out"  # start copying the tensor to the host (its device copy stays)
    RETIRE = "retire"  # the tensor's device copy goes once its copy to the host has landed
    SWAP_IN = "swap_in"  # allocate the tensor on the device and start copying it back
    FREE = "free"  # drop the tensor's device copy (a retired one, or any other)

    def __str__(self) -> str:
        return self.value


OP_VERBS = frozenset({Verb.RUN, Verb.RECOMPUTE})  # instructions that name an op; the others name a tensor


class Instruction(NamedTuple):
    """One step of a program: `verb` applied to the op or tensor called `name`."""

    verb: Verb
    name: str

    def __str__(self) -> str:
        return f"{self.verb.value} {self.name}"


class ProgramSyntaxError(GaswapError, ValueError):
    """A program line that is not `verb name` with a known verb."""


def parse_instruction(line) -> Instruction:
    """`"swap_in t12"` (or a `(verb, name)` pair) as an Instruction; ProgramSyntaxError for anything else."""
    if isinstance(line, str):
        parts = line.split(" ", 1)
    elif isinstance(line, (tuple, list)):
        parts = list(line)
    else:
        raise ProgramSyntaxError(f"program step {line!r} is not a 'verb name' line")
    if len(parts) != 2 or not all(isinstance(p, str) for p in parts) or not parts[1]:
        raise ProgramSyntaxError(f"program step {line!r} is not a 'verb name' line")
    try:
        verb = Verb(parts[0])
    except ValueError:
        known = ", ".join(v.value for v in Verb)
        raise ProgramSyntaxError(f"program step {line!r}: unknown verb {parts[0]!r} (known: {known})") from None
    return Instruction(verb, parts[1])


def parse_program(lines) -> tuple[Instruction, ...]:
    """Every line of a stored program as an Instruction (see `parse_instruction`)."""
    return tuple(parse_instruction(line) for line in lines)
