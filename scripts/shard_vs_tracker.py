"""gaswap's per-rank FSDP2 memory and time (gaswap.plan.sharding) against torch, on this machine:

1. FSDPMemTracker under the fake process group at W = 8, 64, 256, 1024, by category, rank 0, Adam. The step is
   captured as eager autograd runs it (`capture_for_sharding`, eager). The tracker is run twice: with its module
   hooks keeping no gradients (`hold_grads=False`: the run as it is untracked; what gaswap predicts) and as torch
   ships it (its ModTracker's multi-grad hooks hold each module input's gradient until all have come).
2. The same with real tensors (W = 8): the tracker's categories with fake tensors against real ones.
3. gloo, 2 and 4 processes (block_mlp(1024, 4), batch 64, Adam): predicted peak per rank against the CPU
   allocator's counts on every metered step, the fake process group with real tensors per rank, and step time:
   single-device op costs (gaswap.run.measure, one thread), FSDP's copies at a measured copy bandwidth, its host
   overhead per op calibrated on the fake process group at W = 8 (one process, no communication), and
   collectives from a latency + bytes / bandwidth fit of gloo's all-gather and reduce-scatter measured in the
   run (CPU seconds), all serial (`step_time(overlap=False)`: every collective FSDP2 issues on gloo is
   synchronous, `async_op=False`, and blocks the rank's thread); against the CPU seconds of forward+backward.

    PYTHONPATH=. python scripts/shard_vs_tracker.py [--models mlp,gpt,llama] [--worlds 8,64,256,1024] [--no-gloo]
    PYTHONPATH=. python scripts/shard_vs_tracker.py --models "" (gloo only)
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from gaswap import zoo
from gaswap.plan.graph import Graph
from gaswap.plan.sharding import (
    CATEGORIES,
    Link,
    ShardSpec,
    memory_report,
    rank_op_times,
    shard_step,
    step_time,
)
from gaswap.shard import models
from gaswap.shard.capture import capture_for_sharding
from gaswap.shard.tracker import measure_fake_pg_peak, measure_fsdp_tracker

WORLD_SIZES = (8, 64, 256, 1024)


def llama_fused(**config):
    """The tiny Llama with F.silu as users write it (the SwiGLU's silu one op, its backward `silu_backward`)."""
    model = models.llama(**config)
    for layer in model.layers:
        layer.feed_forward.fused_silu = True
    return model


def cases():
    gpt_block = type(zoo.gpt().blocks[0])
    return {
        "mlp": (lambda: models.block_mlp(4096, 8), models.MLPBlock, lambda: (torch.randn(64, 4096),)),
        "gpt": (lambda: zoo.gpt(1000, 4, 256, 4, 64), gpt_block, lambda: (torch.randint(0, 1000, (4, 64)),)),
        "llama": (llama_fused, models.DecoderLayer, lambda: (torch.randint(0, 256, (2, 32)),)),
        # Llama-3-8B's widths (dim 4096, ffn 14336, vocab 128256, GQA 32/8) at 4 layers, sequence 2,048
        "llama8b_4l": (lambda: llama_fused(preset="8b", layers=4, seq=2048), models.DecoderLayer,
                       lambda: (torch.randint(0, 128256, (1, 2048)),)),
    }


def mb(n: int) -> str:
    return f"{n / 2**20:10.3f}"


def rel(ours: int, theirs: int) -> str:
    return f"{(ours - theirs) / theirs:+8.2%}" if theirs else ("   exact" if ours == theirs else "     inf")


def capture_case(make_model, unit_class, make_inputs):
    with torch.device("meta"):
        model = make_model()
    inputs = tuple(x.to("meta") for x in make_inputs())
    return model, capture_for_sharding(model, inputs, None, "sum", optimizer="adam", unit_classes=(unit_class,))


def compare(name, make_model, unit_class, make_inputs, worlds) -> None:
    started = time.process_time()
    model, (captured, units, params) = capture_case(make_model, unit_class, make_inputs)
    print(f"\n## {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {len(units)} units, "
          f"capture {time.process_time() - started:.1f} CPU s")
    worst = 0.0
    for W in worlds:
        t0 = time.process_time()
        rank = shard_step(captured.graph, params, ShardSpec(W, tuple(units), optimizer_scalar_bytes=4))
        report = memory_report(rank, tracker=True)
        plan_s = time.process_time() - t0
        t0 = time.process_time()
        untracked = measure_fsdp_tracker(make_model, make_inputs, units, W, hold_grads=False)
        track_s = time.process_time() - t0
        stock = measure_fsdp_tracker(make_model, make_inputs, units, W)
        print(f"\nW={W}  peak gaswap {mb(report.peak)} MiB  tracker {mb(untracked['total'])} MiB "
              f"({rel(report.peak, untracked['total']).strip()}), as shipped {mb(stock['total'])} MiB "
              f"({rel(report.peak, stock['total']).strip()}); at {report.peak_op}; rank graph + report "
              f"{plan_s:.2f} CPU s, tracker {track_s:.1f} CPU s")
        print(f"  {'category':24s} {'gaswap MiB':>10s} {'tracker MiB':>11s}    error {'as shipped':>10s}    error")
        for cat in CATEGORIES:
            ours, theirs, shipped = report.at_peak.get(cat, 0), untracked.get(cat, 0), stock.get(cat, 0)
            if ours or theirs or shipped:
                print(f"  {cat:24s} {mb(ours)} {mb(theirs)}  {rel(ours, theirs)} {mb(shipped)}  {rel(ours, shipped)}")
                if theirs:
                    worst = max(worst, abs(ours - theirs) / theirs)
    print(f"\n{name}: largest error of a category against the untracked tracker: {worst:.2%}")


def fake_vs_real(name, make_model, unit_class, make_inputs, W: int = 8) -> None:
    """FSDPMemTracker's categories with fake tensors against real ones (hooks keeping no gradients)."""
    _, (_, units, _) = capture_case(make_model, unit_class, make_inputs)
    fake = measure_fsdp_tracker(make_model, make_inputs, units, W, hold_grads=False)
    real = measure_fsdp_tracker(make_model, make_inputs, units, W, hold_grads=False, fake=False)
    diffs = {c: real.get(c, 0) - fake.get(c, 0) for c in (*CATEGORIES, "total") if real.get(c, 0) != fake.get(c, 0)}
    print(f"{name} W={W}: fake tensors {mb(fake['total'])} MiB, real {mb(real['total'])} MiB; "
          + (", ".join(f"{c} real - fake {d:+d} B" for c, d in diffs.items()) if diffs else "every category equal"))


def copy_bandwidth() -> float:
    """Bytes/s of a 16 MiB float32 copy, read and written (CPU seconds, median of 21), one thread."""
    x = torch.randn(1 << 22)
    y = torch.empty_like(x)
    ts = []
    for _ in range(21):
        t0 = time.process_time()
        y.copy_(x)
        ts.append(time.process_time() - t0)
    return 2 * x.nbytes / statistics.median(ts)


def host_overhead(captured, units, params, op_time, copy_bw, W: int = 8, steps: int = 12) -> float:
    """FSDP2's host seconds per FSDP op (its Python around copies and collectives), from one process on the fake
    process group (no communication) at W ranks: the forward+backward CPU seconds (median) less the predicted
    ops and copies, over the number of FSDP ops."""
    from gaswap.run.training import make_optimizer, split_step
    from gaswap.shard.tracker import apply_fsdp, fake_process_group

    with fake_process_group(W) as mesh:
        net = apply_fsdp(models.block_mlp(1024, 4), units, mesh)
        opt = make_optimizer("adam", net)
        inputs = models.mlp_inputs()
        ts = [split_step(net, opt, inputs).forward_backward_s for _ in range(steps)]
    rank = shard_step(captured.graph, params, ShardSpec(W, tuple(units), optimizer_scalar_bytes=4))
    base, _ = step_time(rank, rank_op_times(rank, op_time, Link(0.0, float("inf")), copy_bandwidth=copy_bw),
                        overlap=False)
    n = sum(op.target.startswith("fsdp.") and op.target not in ("fsdp.free", "fsdp.end") for op in rank.graph.ops)
    return max(0.0, (statistics.median(ts[2:]) - base) / n)


def ms(xs) -> str:
    return f"{statistics.median(xs) * 1e3:7.1f} ms [{min(xs) * 1e3:.1f}, {max(xs) * 1e3:.1f}]"


def gloo(steps: int) -> None:
    from gaswap.run.measure import measure, use_cpu
    from gaswap.shard.gloo import COLLECTIVE_SIZES, gloo_peak, run_gloo

    use_cpu(1)
    with torch.device("meta"):
        model = models.block_mlp(1024, 4)
    captured, units, params = capture_for_sharding(model, (torch.empty(64, 1024, device="meta"),), None, "sum",
                                                   unit_classes=(models.MLPBlock,))
    g = captured.graph
    timed = Graph(tuple(op for op in g.ops if op.target != "autograd.release"), g.tensors, g.resident, g.counted,
                  g.loss)
    with tempfile.TemporaryDirectory() as cache:  # timed now, under this load
        costs = measure(timed, "cpu", cache_dir=cache, threads=1)
    copy_bw = copy_bandwidth()
    overhead = host_overhead(captured, units, params, costs.op_time, copy_bw)
    print("\n## gloo: block_mlp(1024, 4), batch 64, Adam; forward+backward peak above the step's start, per rank")
    print(f"single-device ops {sum(costs.op_time.values()) * 1e3:.1f} ms (sum of {len(timed.ops)}, one thread); "
          f"copies {copy_bw / 1e9:.1f} GB/s; FSDP host overhead {overhead * 1e6:.0f} us per FSDP op (fake PG, W=8)")
    for W in (2, 4):
        results = run_gloo("gaswap.shard.models:block_mlp", "gaswap.shard.models:mlp_inputs", units, W,
                           steps=steps, metered=3, collectives=COLLECTIVE_SIZES)
        points = {kind: [(n, statistics.median(statistics.median(r["collective_s"][f"{kind}:{n}"]["cpu"])
                                               for r in results)) for n in COLLECTIVE_SIZES]
                  for kind in ("all_gather", "reduce_scatter")}
        link = Link.fit(W, points["all_gather"], points["reduce_scatter"])
        print(f"\nW={W} link fit (CPU s, median over ranks of the median of 5): all-gather latency "
              f"{link.latency * 1e6:.0f} us/step, {link.bandwidth / 1e9:.2f} GB/s; reduce-scatter latency "
              f"{link.reduce_scatter_latency * 1e6:.0f} us/step, {link.reduce_scatter_bandwidth / 1e9:.2f} GB/s")
        for kind, pts in points.items():
            fit = getattr(link, kind)
            print("  " + kind + ": " + ", ".join(f"{n >> 10} KiB {t * 1e3:.2f} ms (fit {fit(n, W) * 1e3:.2f})"
                                                 for n, t in pts))
        for r in results:
            rank = shard_step(g, params, ShardSpec(W, tuple(units), rank=r["rank"], optimizer_scalar_bytes=4))
            report = memory_report(rank)
            start = rank.graph.resident_bytes()
            predicted = gloo_peak(report, rank) - start
            fake = measure_fake_pg_peak(lambda: models.block_mlp(1024, 4), models.mlp_inputs, units, W,
                                        rank=r["rank"])
            exact = all(p == predicted for p in r["peaks_above_start"])
            print(f"  rank {r['rank']}: peak predicted {predicted} B (rank model {report.peak - start}), gloo "
                  f"measured {r['peaks_above_start']} ({'all equal' if exact else 'DIFFER'}); fake PG real tensors "
                  f"{fake['peak_above_start']}; resident predicted {start}, gloo {r['resident_at_start']}, fake PG "
                  f"{fake['resident_at_start']}")
            plain = rank_op_times(rank, costs.op_time, link, copy_bandwidth=copy_bw)
            with_host = rank_op_times(rank, costs.op_time, link, copy_bandwidth=copy_bw, host_overhead=overhead)
            t_plain, _ = step_time(rank, plain, overlap=False)
            t_host, busy = step_time(rank, with_host, overlap=False)
            measured = statistics.median(r["fwd_bwd_cpu_s"])
            print(f"    time: predicted {t_host * 1e3:.1f} ms ({(t_host - measured) / measured:+.1%}; compute "
                  f"{busy['compute'] * 1e3:.1f}, all-gather {busy['all_gather'] * 1e3:.1f}, reduce-scatter "
                  f"{busy['reduce_scatter'] * 1e3:.1f}; without FSDP's host overhead {t_plain * 1e3:.1f} ms), "
                  f"measured forward+backward {ms(r['fwd_bwd_cpu_s'])} CPU, whole step with Adam "
                  f"{ms(r['step_cpu_s'])} CPU, {ms(r['step_wall_s'])} wall")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt,llama", help="comma-separated (also: llama8b_4l); empty: gloo only")
    ap.add_argument("--worlds", default=",".join(map(str, WORLD_SIZES)))
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--gloo-steps", type=int, default=12)
    args = ap.parse_args()
    all_cases = cases()
    worlds = [int(w) for w in args.worlds.split(",")]
    names = [n for n in args.models.split(",") if n]
    for name in names:
        compare(name, *all_cases[name], worlds)
    if names:
        print("\n## FSDPMemTracker with fake tensors against real tensors (untracked hooks)")
    for name in names:
        fake_vs_real(name, *all_cases[name])
    if not args.no_gloo:
        gloo(args.gloo_steps)


if __name__ == "__main__":
    main()
