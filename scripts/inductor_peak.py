"""The memory of a compiled graph's generated code (`gaswap.compiled.programs`), read from a
`TORCH_LOGS=output_code` log: prints the graph's peak (inputs other than `primals_*` included: saved
tensors, the incoming gradient) and the buffers alive at it.

    TORCH_LOGS=output_code python my_run.py 2> code.log
    PYTHONPATH=. python scripts/inductor_peak.py code.log [--graph -1]   # -1: the last graph (a backward)

A graph alone: a backward's saved inputs are counted one by one (views of one buffer each at its own
extent); `compiled_program.step_peak` maps them to the forward's buffers.
"""
from __future__ import annotations

import argparse
import re

from gaswap.compiled.programs import Program


def programs(log_lines: list[str]) -> list[Program]:
    """Each generated program in a log: from its `def call` to the next one."""
    lines = [re.sub(r"^.*\[__output_code\] ?", "", line) for line in log_lines]
    starts = [k for k, line in enumerate(lines) if line.strip().startswith("def call(self, args)")]
    return [Program("\n".join(lines[a:b])) for a, b in zip(starts, [*starts[1:], len(lines)])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--graph", type=int, default=-1, help="which compiled graph of the log (default: the last)")
    args = parser.parse_args()
    with open(args.log) as f:
        found = programs(f.read().splitlines())
    if not found:
        raise SystemExit(f"{args.log}: no generated `def call` (run with TORCH_LOGS=output_code)")
    walk = found[args.graph].walk()
    print(f"peak {walk.peak / 1e6:.2f} MB (parameters and other primals_* inputs not counted); alive at the peak "
          "(over 0.1 MB):")
    for name, nbytes in sorted(walk.at_peak.items(), key=lambda item: -item[1]):
        if nbytes > 1e5:
            print(f"  {nbytes / 1e6:8.2f} MB  {name}")


if __name__ == "__main__":
    main()
