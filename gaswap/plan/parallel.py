"""Parallel maps for the search: `map(func, items) -> list`, in order, as DEAP's `toolbox.map`. No torch here.

`executor(ga)` picks the map an experiment's `ga` settings ask for: one process, `ProcessMap` (`workers` > 1),
or `DaskMap` (`executor: dask`, on the cluster at `address`, or a local one of `workers` processes).

`ProcessMap(n)` runs `func` in n worker processes of this machine. Each worker is sent a function once (with
what it holds: a `Problem`'s graph and costs) and then only batches of items: one batch per worker per call,
so a generation costs one message each way per worker. Workers ignore SIGINT and SIGTERM sent to the process
group (the parent decides when a search stops, and ends its workers itself); `close()` lets them finish,
`terminate()` ends them, and either way they are reaped.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal


def serial_map(func, items) -> list:
    """The map of a search in this process."""
    return [func(x) for x in items]


def executor(ga):
    """The map `ga` asks for, as a context manager: DaskMap, ProcessMap, or the serial map."""
    if ga.executor == "dask":
        return DaskMap(ga.address, ga.workers)
    return ProcessMap(ga.workers) if ga.workers > 1 else _Serial()


class _Serial:
    """`serial_map` as a context manager, like the others."""

    def __call__(self, func, items) -> list:
        return serial_map(func, items)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class ProcessMap:
    """`map(func, items)` over `workers` processes, results in the order of `items`."""

    def __init__(self, workers: int):
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        self._shutdown = ctx.RawValue("b", 0)  # set: the workers may now end on SIGTERM
        self._workers = []
        for _ in range(workers):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(child, self._shutdown), daemon=True)
            process.start()
            child.close()
            self._workers.append((process, parent))
        self._keys: dict = {}  # function -> the key the workers know it by

    def __call__(self, func, items) -> list:
        items = list(items)
        key = self._keys.get(func)
        if key is None:
            key = self._keys[func] = len(self._keys)
            for _, conn in self._workers:
                conn.send(("define", key, func))
        n = len(self._workers)
        bounds = [len(items) * w // n for w in range(n + 1)]
        busy = []
        for (_, conn), lo, hi in zip(self._workers, bounds, bounds[1:]):
            if hi > lo:
                conn.send(("map", key, items[lo:hi]))
                busy.append(conn)
        out, error = [], None
        for conn in busy:
            ok, value = conn.recv()
            if ok:
                out += value
            else:
                error = error or value
        if error is not None:
            raise error
        return out

    def close(self) -> None:
        """Let the workers leave, and reap them."""
        for process, conn in self._workers:
            try:
                conn.send(None)
            except OSError:
                pass
        self._join()

    def terminate(self) -> None:
        """End the workers now (SIGTERM, which they obey from now on), and reap them."""
        self._shutdown.value = 1
        for process, _ in self._workers:
            if process.is_alive():
                process.terminate()
        self._join()

    def _join(self) -> None:
        for process, conn in self._workers:
            process.join()
            conn.close()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.terminate()


def _serve(conn, shutdown) -> None:
    """A worker: define functions, map batches, until told to leave (None) or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum, frame):
        if shutdown.value:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    functions = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        verb, key, value = message
        if verb == "define":
            functions[key] = value
            continue
        try:
            reply = (True, [functions[key](x) for x in value])
        except Exception as err:  # sent to the parent, which raises it
            reply = (False, err)
        conn.send(reply)


class DaskMap:
    """`map(func, items)` on a Dask distributed cluster: the scheduler at `address` ("tcp://host:8786"), or,
    without one, a local cluster of `workers` single-threaded processes started here (and stopped on close).
    Each function is sent to every worker once (scattered, broadcast); then each call sends one batch of items
    per worker. Needs the optional `dask[distributed]` (pip install 'gaswap[dask]')."""

    def __init__(self, address: str | None = None, workers: int = 1):
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise RuntimeError("ga.executor dask needs dask's distributed scheduler: pip install 'dask[distributed]'") from None
        self._cluster = None
        if address:
            self.client = Client(address)
        else:
            with _environment_kept():  # dask sets its workers' variables in this process's environment
                self._cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                             dashboard_address=None)
            self.client = Client(self._cluster)
        self._remote: dict = {}  # function -> its future on every worker

    def __call__(self, func, items) -> list:
        items = list(items)
        remote = self._remote.get(func)
        if remote is None:
            remote = self._remote[func] = self.client.scatter(func, broadcast=True)
        n = max(1, len(self.client.scheduler_info()["workers"]))
        bounds = [len(items) * w // n for w in range(n + 1)]
        batches = [items[lo:hi] for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        futures = self.client.map(_apply, [remote] * len(batches), batches, pure=False)
        return [x for batch in self.client.gather(futures) for x in batch]

    def close(self) -> None:
        self.client.close()
        if self._cluster is not None:
            with _environment_kept():
                self._cluster.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def _environment_kept():
    """This process's environment as it was before the block. Dask's local cluster writes its workers' variables
    (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, MALLOC_TRIM_THRESHOLD_, PYTHONHASHSEED, ...) into the environment of the
    process that starts it: every process started there afterwards (inductor's compile workers, a compare's) ran
    with one thread, and its compiles missed the caches the measuring process, on two, looked in."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        os.environ.update({name: value for name, value in before.items() if os.environ.get(name) != value})


def _apply(func, batch: list) -> list:
    return [func(x) for x in batch]
