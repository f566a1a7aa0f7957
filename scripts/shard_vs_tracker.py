"""gaswap's per-rank FSDP2 memory (gaswap.plan.sharding) against torch's FSDPMemTracker under the fake process
group at W = 8, 64, 256, 1024, by category; then real gloo runs of 2 and 4 processes: predicted against measured
peak per rank, and gloo's collective costs on this machine (a latency + bytes / bandwidth fit).

    PYTHONPATH=. python scripts/shard_vs_tracker.py [--models mlp,gpt,llama,llama8b] [--no-gloo] [--seq8b 2048]
"""
from __future__ import annotations

import argparse
import time

import torch

from gaswap import zoo
from gaswap.plan.sharding import CATEGORIES, Link, ShardSpec, memory_report, shard_step
from gaswap.shard import models
from gaswap.shard.capture import capture_for_sharding
from gaswap.shard.tracker import measure_fsdp_tracker

WORLD_SIZES = (8, 64, 256, 1024)


def llama_fused(**config):
    """The tiny Llama with F.silu as users write it (the SwiGLU's silu one op, its backward `silu_backward`)."""
    model = models.llama(**config)
    for layer in model.layers:
        layer.feed_forward.fused_silu = True
    return model


def cases(seq8b: int):
    gpt_block = type(zoo.gpt().blocks[0])
    return {
        "mlp": (lambda: models.block_mlp(4096, 8), models.MLPBlock, lambda: (torch.randn(64, 4096),)),
        "gpt": (lambda: zoo.gpt(1000, 4, 256, 4, 64), gpt_block, lambda: (torch.randint(0, 1000, (4, 64)),)),
        "llama": (llama_fused, models.DecoderLayer, lambda: (torch.randint(0, 256, (2, 32)),)),
        "llama8b": (lambda: models.llama(**(models.LLAMA3_8B | {"seq": seq8b})), models.DecoderLayer,
                    lambda: (torch.randint(0, 128256, (1, seq8b)),)),
    }


def mb(n: int) -> str:
    return f"{n / 2**20:10.3f}"


def compare(name, make_model, unit_class, make_inputs) -> None:
    started = time.process_time()
    with torch.device("meta"):
        model = make_model()
    inputs = tuple(x.to("meta") for x in make_inputs())
    captured, units, params = capture_for_sharding(model, inputs, None, "sum", optimizer="adam",
                                                   unit_classes=(unit_class,))
    print(f"\n## {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {len(units)} units, "
          f"capture {time.process_time() - started:.1f} CPU s")
    for W in WORLD_SIZES:
        t0 = time.process_time()
        rank = shard_step(captured.graph, params, ShardSpec(W, tuple(units), optimizer_scalar_bytes=4))
        report = memory_report(rank, tracker=True)
        plan_s = time.process_time() - t0
        t0 = time.process_time()
        tracker = measure_fsdp_tracker(make_model, make_inputs, units, W)
        track_s = time.process_time() - t0
        print(f"\nW={W}  peak gaswap {mb(report.peak)} MiB  tracker {mb(tracker['total'])} MiB  "
              f"({(report.peak - tracker['total']) / tracker['total']:+.2%}); at {report.peak_op}; "
              f"rank graph + report {plan_s:.2f} CPU s, tracker {track_s:.1f} CPU s")
        print(f"  {'category':24s} {'gaswap MiB':>10s} {'tracker MiB':>11s}  rel. error")
        for cat in CATEGORIES:
            ours, theirs = report.at_peak.get(cat, 0), tracker.get(cat, 0)
            if ours or theirs:
                err = (ours - theirs) / theirs if theirs else float("inf")
                print(f"  {cat:24s} {mb(ours)} {mb(theirs)}   {err:+8.2%}")


def gloo() -> None:
    from gaswap.shard.gloo import run_gloo

    with torch.device("meta"):
        model = models.block_mlp(1024, 4)
    captured, units, params = capture_for_sharding(model, (torch.empty(64, 1024, device="meta"),), None, "sum",
                                                   unit_classes=(models.MLPBlock,))
    sizes = (1 << 16, 1 << 22)
    print("\n## gloo: block_mlp(1024, 4), batch 64, Adam; forward+backward peak above the step's start, per rank")
    for W in (2, 4):
        results = run_gloo("gaswap.shard.models:block_mlp", "gaswap.shard.models:mlp_inputs", units, W,
                           collectives=sizes)
        for r in results:
            rank = shard_step(captured.graph, params, ShardSpec(W, tuple(units), rank=r["rank"],
                                                                optimizer_scalar_bytes=4))
            start = rank.graph.resident_bytes()
            predicted = memory_report(rank).peak - start
            print(f"W={W} rank {r['rank']}: predicted {predicted} B, measured {r['peaks_above_start']} B "
                  f"(lowest {'equal' if r['peak_above_start'] == predicted else 'differs'}); resident predicted "
                  f"{start} measured {r['resident_at_start']}; CPU {r['cpu_step_s'] * 1e3:.1f} ms/step")
        for kind in ("all_gather", "reduce_scatter"):
            (a, ta), (b, tb) = [(n, max(r["collective_s"][f"{kind}:{n}"] for r in results)) for n in sizes]
            bw = (W - 1) / W * (b - a) / max(tb - ta, 1e-12)
            lat = max(0.0, (ta - (W - 1) / W * a / bw) / (W - 1))
            link = Link(lat, bw)
            print(f"  gloo {kind} W={W}: {ta * 1e6:.0f} us for {a} B, {tb * 1e3:.2f} ms for {b} B -> latency "
                  f"{lat * 1e6:.1f} us/step, bandwidth {bw / 1e9:.2f} GB/s (fit: {link.all_gather(b, W) * 1e3:.2f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt,llama,llama8b")
    ap.add_argument("--seq8b", type=int, default=2048)
    ap.add_argument("--no-gloo", action="store_true")
    args = ap.parse_args()
    all_cases = cases(args.seq8b)
    for name in args.models.split(","):
        compare(name, *all_cases[name])
    if not args.no_gloo:
        gloo()


if __name__ == "__main__":
    main()
