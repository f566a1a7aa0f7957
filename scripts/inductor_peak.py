"""The memory a compiled graph's generated code allocates: a walk over inductor's CPU wrapper (`def call`),
its allocations (`empty_strided_cpu`, library calls' outputs by their size asserts), buffer reuses and
`del`s, from a `TORCH_LOGS=output_code` log. Prints the peak (the graph's inputs included: saved tensors,
parameters, the incoming gradient) and the buffers alive at it, with the line that made each.

    TORCH_LOGS=output_code python my_run.py 2> code.log
    python scripts/inductor_peak.py code.log [--graph -1]   # -1: the last graph compiled (a backward)

It reads Python source text, so it is a diagnostic: a buffer whose size it cannot read counts 0 bytes.
"""
from __future__ import annotations

import argparse
import re

BYTES = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2, "torch.float64": 8, "torch.int64": 8,
         "torch.int32": 4, "torch.int8": 1, "torch.uint8": 1, "torch.bool": 1}
SIZE_STRIDE = r"(\(.*?\)), (\(.*?\))"  # (size), (stride)


def extent(size: str, stride: str) -> int:
    """Elements a strided tensor spans."""
    sizes, strides = eval(size), eval(stride)  # tuples of ints printed by inductor
    return 1 + sum((n - 1) * s for n, s in zip(sizes, strides)) if sizes else 1


def walk(lines: list[str], start: int) -> tuple[int, dict, int]:
    """(peak bytes, {buffer: (bytes, line)} alive at it, inputs' bytes) of the `call` starting at `start`."""
    end = next(k for k in range(start, len(lines)) if lines[k].strip().startswith("return ("))
    inputs = {}
    for line in lines[end:]:
        m = re.match(r"\s*(\w+) = rand_strided\(" + SIZE_STRIDE + r", device='\w+', dtype=(torch\.\w+)\)", line)
        if m:
            inputs[m.group(1)] = extent(m.group(2), m.group(3)) * BYTES[m.group(4)]
        if line.startswith("def benchmark_compiled_module"):
            break
    names = re.findall(r"\w+", lines[start + 1].split("=")[0])
    alive = {n: (inputs[n], "input") for n in names if n in inputs}
    mem = base = sum(b for b, _ in alive.values())
    peak, at_peak = mem, dict(alive)
    for k in range(start + 2, end):
        line = lines[k].strip()
        if m := re.match(r"(\w+) = empty_strided_cpu\(" + SIZE_STRIDE + r", (torch\.\w+)\)", line):
            alive[m.group(1)] = (extent(m.group(2), m.group(3)) * BYTES[m.group(4)], k + 1)
            mem += alive[m.group(1)][0]
        elif m := re.match(r"(\w+) = (\w+); del (\w+)\s+# reuse", line):
            alive[m.group(1)] = alive.pop(m.group(2), (0, k + 1))
        elif (m := re.match(r"assert_size_stride\((\w+), " + SIZE_STRIDE, line)) and m.group(1) not in alive:
            alive[m.group(1)] = (extent(m.group(2), m.group(3)) * 4, k + 1)  # a library call's output (float32)
            mem += alive[m.group(1)][0]
        elif (m := re.match(r"del (\w+)$", line)) and m.group(1) in alive:
            mem -= alive.pop(m.group(1))[0]
        if mem > peak:
            peak, at_peak = mem, dict(alive)
    return peak, at_peak, base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--graph", type=int, default=-1, help="which compiled graph of the log (default: the last)")
    args = parser.parse_args()
    with open(args.log) as f:
        lines = [re.sub(r"^.*\[__output_code\] ?", "", line.rstrip("\n")) for line in f]
    calls = [k for k, line in enumerate(lines) if line.strip().startswith("def call(self, args)")]
    if not calls:
        raise SystemExit(f"{args.log}: no generated `def call` (run with TORCH_LOGS=output_code)")
    peak, alive, base = walk(lines, calls[args.graph])
    print(f"peak {peak / 1e6:.2f} MB, of which inputs {base / 1e6:.2f} MB; alive at the peak (over 0.1 MB):")
    for name, (nbytes, made) in sorted(alive.items(), key=lambda item: -item[1][0]):
        if nbytes > 1e5:
            print(f"  {nbytes / 1e6:8.2f} MB  {name:24} {'input' if made == 'input' else f'line {made}'}")


if __name__ == "__main__":
    main()
