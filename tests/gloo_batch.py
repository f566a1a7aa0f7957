"""The suite's gloo runs (`gaswap.shard.gloo.run_gloo`), several in one launch of `world_size` processes.

A launch costs far more than the tiny models' steps: each rank is a fresh process that imports torch, and its
first run pays once for importing what FSDP2 needs (DTensor, dynamo, sympy: measured on 2 cores, about 25 s
of a launch before the first step's end against 2 to 10 s for each further run). So the test modules `add`
their runs when they are imported (at collection, before any test runs), and the first `result` asked for at
a world size launches every run added at that size, in the order added; later ones read theirs.

`run_gloo_batch(world_size, [kwargs, ...])` returns, per entry, what `run_gloo(world_size=world_size, **kwargs)`
returns. The last entry is run by `run_gloo` itself (its folder, its spawn's arguments, its reading of the
ranks' files), with its spawn made to run the entries before it first: each rank calls gaswap's own
`_rank_main` once per entry, in order, with the arguments `run_gloo` would give it (its defaults read from its
signature), each run with a process group of its own (a fresh store) that it makes and destroys as on a launch
of its own, and seeding torch itself (`torch.manual_seed(0)`). A rank's peak is metered above what is
allocated when its step starts, so an earlier run in the same process changes no figure (checked: the block
MLP's exact per-rank peaks are the same run first or after two ViT runs, at 2 and 4 ranks)."""
import inspect
import json
import tempfile
import unittest.mock
from pathlib import Path

import pytest
import torch

from gaswap.shard.gloo import _rank_main, run_gloo


def _rank_args(world_size: int, kwargs: dict) -> dict:
    """`_rank_main`'s keyword arguments (all but rank, world_size, store_path, out_dir) for `run_gloo(**kwargs)`."""
    bound = inspect.signature(run_gloo).bind(world_size=world_size, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return {"model": a["model"], "model_kwargs": a["model_kwargs"] or {}, "inputs": a["inputs"],
            "units": list(a["units"]), "optimizer": a["optimizer"], "steps": a["steps"], "metered": a["metered"],
            "knobs": a["knobs"] or {}, "collectives": list(a["collectives"]), "repeats": a["repeats"],
            "plan": a["plan"], "record": a["record"], "loss": a["loss"]}


_RANK_MAIN_OWN = {"rank", "world_size", "store_path", "out_dir"}
if set(inspect.signature(_rank_main).parameters) - _RANK_MAIN_OWN != set(_rank_args(1, {"model": "", "inputs": "",
                                                                                         "units": []})):
    raise ImportError("gloo_batch: gaswap.shard.gloo._rank_main's arguments changed; update _rank_args")


def _rank_batch(rank: int, world_size: int, tmp: str, runs: list, last: tuple) -> None:
    """The runs before the last, in folders of `tmp`, then the last as run_gloo's spawn gave it (`last`)."""
    for i, args in enumerate(runs):
        out = Path(tmp, str(i))
        _rank_main(rank, world_size, str(out / "store"), str(out), **args)
    _rank_main(rank, *last)


def run_gloo_batch(world_size: int, runs: list[dict]) -> list[list[dict]]:
    *before, last = runs
    before = [_rank_args(world_size, kwargs) for kwargs in before]
    spawn = torch.multiprocessing.spawn

    def spawn_all(fn, args, nprocs, join):  # run_gloo's spawn of its one run
        if fn is not _rank_main or nprocs != world_size or not join:
            raise AssertionError(f"run_gloo spawned {fn} {nprocs} times (join={join}): update run_gloo_batch")
        return spawn(_rank_batch, args=(world_size, tmp, before, args), nprocs=nprocs, join=join)

    with tempfile.TemporaryDirectory() as tmp:
        for i in range(len(before)):
            Path(tmp, str(i)).mkdir()
        with unittest.mock.patch.object(torch.multiprocessing, "spawn", spawn_all):
            last = run_gloo(world_size=world_size, **last)
        results = []
        for i, args in enumerate(before):  # as run_gloo reads its run's files
            out = [json.loads(Path(tmp, str(i), f"rank{r}.json").read_text()) for r in range(world_size)]
            if args["record"]:
                for r, one in enumerate(out):
                    one["recorded"] = torch.load(Path(tmp, str(i), f"rank{r}.pt"), weights_only=True)
            results.append(out)
        return [*results, last]


_pending: dict = {}  # world_size -> {key: a function returning run_gloo's keyword arguments (but world_size)}
_results: dict = {}  # (world_size, key) -> its result
_failed: dict = {}  # world_size -> the exception its launch raised


def add(world_size: int, key: str, make_kwargs) -> None:
    """A run for the launch at `world_size`: `make_kwargs()`, called when that launch starts, gives its `run_gloo`
    keyword arguments; one that calls `pytest.skip` (a package missing) is left out (its test skips on its own)."""
    if (world_size, key) in _results or key in _pending.get(world_size, {}):
        raise ValueError(f"gloo run {key!r} at {world_size} processes added twice")
    _pending.setdefault(world_size, {})[key] = make_kwargs


def result(world_size: int, key: str) -> list[dict]:
    """What `run_gloo(world_size=world_size, **make_kwargs())` returns for the run added as `key`: launches every
    run still pending at `world_size` if that one is."""
    if world_size in _failed:
        raise RuntimeError(f"the gloo launch of {world_size} processes failed (see the first test that ran it)")
    if key in _pending.get(world_size, {}):
        try:
            runs = {}
            for k, make in _pending.pop(world_size).items():
                try:
                    runs[k] = make()
                except pytest.skip.Exception:
                    continue
            done = run_gloo_batch(world_size, list(runs.values()))
        except BaseException as e:
            _failed[world_size] = e
            raise
        _results.update({(world_size, k): r for k, r in zip(runs, done)})
    return _results[(world_size, key)]
