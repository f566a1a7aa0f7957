"""The search's maps: in order, the same results as one process, errors raised in the parent (no torch)."""
import dataclasses
import os

import pytest

from gaswap.base.config import GASettings, load_search_space
from gaswap.plan.graph import residual_graph
from gaswap.plan.parallel import ProcessMap, serial_map
from gaswap.plan.problem import Problem
from gaswap.plan.search import search
from helpers import unit_costs

GA = GASettings(population=24, generations=6)


@pytest.fixture(scope="module")
def problem():
    g = residual_graph(40, size=100)
    return Problem(g, unit_costs(g, bandwidth=200.0), 1500, load_search_space("hybrid"))


def _fails(x):
    if x == 3:
        raise ValueError("item 3")
    return -x


def test_a_process_map_gives_the_serial_results_in_order(problem):
    import random

    rng = random.Random(1)
    chromosomes = [problem.encoding.random(rng) for _ in range(13)]  # not a multiple of the workers
    with ProcessMap(3) as pmap:
        assert pmap(problem.evaluate, chromosomes) == serial_map(problem.evaluate, chromosomes)
        assert pmap(problem.evaluate, chromosomes[:2]) == serial_map(problem.evaluate, chromosomes[:2])
        assert pmap(_fails, [0, 1, 2]) == [0, -1, -2]
        with pytest.raises(ValueError, match="item 3"):
            pmap(_fails, range(5))
        assert pmap(_fails, [4]) == [-4]  # the workers survive an error


def _outcome(r):
    return ([(e.chromosome, e.step_time, e.peak_bytes) for e in r.front],
            [dataclasses.replace(h, seconds=0) for h in r.history], r.evaluations, r.seeds)


@pytest.mark.slow
def test_a_local_dask_cluster_finds_the_front_of_the_in_process_search(problem):
    pytest.importorskip("distributed")
    environment = dict(os.environ)
    on_dask = search(problem, dataclasses.replace(GA, executor="dask", workers=2), seed=3)
    assert _outcome(on_dask) == _outcome(search(problem, GA, seed=3))
    # dask's local cluster wrote OMP_NUM_THREADS=1 and others into this process's environment: the compile pool's
    # workers started after it ran on one thread, and missed the caches of a measuring process on two
    assert dict(os.environ) == environment
