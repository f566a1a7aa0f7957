"""How long an optimizer step takes on the host, as memory traffic: for each of gaswap's optimizers (torch's
defaults, foreach on the CPU), the CPU time of one step over N float32 parameters divided by the CPU time of
copying N float32 values (8 bytes of traffic per element: read and write), times 8, per parameter byte. The
sharded step time prices an optimizer step on offloaded parameters (FSDP2's CPUOffloadPolicy) with these figures
and the host memory bandwidth of the hardware profile (`training_options.HOST_STEP_TRAFFIC`).

    python scripts/host_optimizer.py [--elements 16777216] [--repeats 7]

One thread, CPU time; the methods rotate within each repeat; prints the median and range of each ratio.
"""
import argparse
import os
import statistics
import time

import torch

from gaswap.run.training import OPTIMIZERS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, tensors = args.elements, 16
    opts = {}
    for name, make in OPTIMIZERS.items():
        params = [torch.nn.Parameter(torch.randn(n // tensors)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        opts[name] = make(params)
        opts[name].step()  # the state exists from here on
    src, dst = torch.randn(n), torch.empty(n)
    ratios = {name: [] for name in opts}
    for r in range(args.repeats):
        order = list(opts)[r % len(opts):] + list(opts)[:r % len(opts)]
        for name in order:
            t = time.process_time()
            dst.copy_(src)
            copy = time.process_time() - t
            t = time.process_time()
            opts[name].step()
            ratios[name].append((time.process_time() - t) / copy * 8 / 4)  # traffic bytes per parameter byte
    print(f"torch {torch.__version__}, {n} float32 parameters, 1 thread, load {os.getloadavg()[0]:.1f}")
    for name, values in ratios.items():
        print(f"{name:14s} {statistics.median(values):6.1f} bytes of traffic per parameter byte "
              f"(range {min(values):.1f} - {max(values):.1f})")


if __name__ == "__main__":
    main()
