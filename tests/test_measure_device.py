"""Op timing on an accelerator, exercised on the CPU with stand-ins: errors of the device stop the
measurement and are never cached; copy latency is timed one copy at a time."""
import pytest
import torch

from gaswap.plan.costs import CostCache
from gaswap.run import measure


def _cache(tmp_path):
    return CostCache("test device", torch.__version__, tmp_path)


def test_an_op_error_is_cached_but_a_device_error_stops_and_is_not(tmp_path, monkeypatch):
    cache = _cache(tmp_path)

    def bad_arguments(signature, dev, warmup, repeats):
        raise ValueError("expected a 4-d input")

    monkeypatch.setattr(measure, "time_signature", bad_arguments)
    measure._measure_signature("op-a", torch.device("cpu"), cache, 1, 1)
    assert "op-a" in cache.failed  # an op that cannot run standalone: remembered, roofline instead

    def device_assert(signature, dev, warmup, repeats):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(measure, "time_signature", device_assert)
    with pytest.raises(measure.DeviceError, match="op-b"):
        measure._measure_signature("op-b", torch.device("cpu"), cache, 1, 1)
    assert "op-b" not in cache.failed and "op-b" not in cache.op_time


def test_an_asynchronous_failure_surfacing_at_the_sync_is_charged_to_its_op(tmp_path, monkeypatch):
    cache = _cache(tmp_path)
    monkeypatch.setattr(measure, "time_signature", lambda *a: 1e-3)  # the launch looked fine...

    def failing_sync(dev):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(measure, "sync", failing_sync)  # ...the error shows at the synchronization
    with pytest.raises(measure.DeviceError):
        measure._measure_signature("op-c", torch.device("cpu"), cache, 1, 1)
    assert "op-c" not in cache.op_time  # its time is not kept


def test_copy_latency_times_each_copy_alone(monkeypatch):
    calls = []
    real = measure._timed
    monkeypatch.setattr(measure, "_timed", lambda fn, n, dev: calls.append(n) or real(fn, n, dev))
    latency = measure._copy_latency(torch.device("cpu"), warmup=2, repeats=5)
    assert calls == [1] * 7 and latency > 0
