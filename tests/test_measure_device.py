"""Op timing on an accelerator, exercised on the CPU with stand-ins: errors of the device stop the
measurement and are never cached; copy latency is timed one copy at a time."""
import json

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


def _gpt_graph():
    from tiny_models import MODELS

    from gaswap.run.capture import capture, make_inputs

    make, specs, target_spec = MODELS["gpt"]
    torch.manual_seed(0)
    inputs, target = make_inputs(specs, target_spec, 4, device="cpu", generator=torch.Generator().manual_seed(1))
    return capture(make(), inputs, target, "cross_entropy").graph


def _integer_arguments(signature: str) -> list[int]:
    args = json.loads(signature)["args"]
    return [i for i, a in enumerate(args) if isinstance(a, dict) and a.get("dtype") in ("int64", "int32")]


def test_every_integer_input_of_a_gpt_step_is_drawn_within_its_real_range():
    """The GPT's embedding (forward and backward) and its loss read indices: each is drawn uniformly below the
    bound its op gives (vocabulary, classes), not all zeros (an embedding backward would then hit one row)."""
    graph = _gpt_graph()
    with_indices = {op.signature for op in graph.ops if _integer_arguments(op.signature)}
    names = {json.loads(sig)["target"] for sig in with_indices}
    assert {"aten.embedding.default", "aten.embedding_dense_backward.default", "aten.nll_loss_forward.default",
            "aten.nll_loss_backward.default"} <= names
    for signature in with_indices:
        _, args, _ = measure.op_call(signature, torch.device("cpu"))
        spec = json.loads(signature)
        bounds = measure.index_bounds(spec["target"], spec["args"])
        assert set(bounds) == set(_integer_arguments(signature)), signature
        for position, high in bounds.items():
            drawn = args[position]
            assert 0 <= int(drawn.min()) and int(drawn.max()) < high
            assert drawn.numel() < 8 or len(drawn.unique()) > 1  # spread over the range
        assert measure.time_signature(signature, "cpu", warmup=1, repeats=1) > 0


def test_index_bounds_follow_each_ops_arguments():
    t = lambda *shape: {"shape": list(shape), "dtype": "float32"}
    i = {"shape": [6], "dtype": "int64"}
    assert measure.index_bounds("aten.embedding.default", [t(50, 8), i]) == {1: 50}
    assert measure.index_bounds("aten.embedding_dense_backward.default", [t(6, 8), i, 50, -1, False]) == {1: 50}
    assert measure.index_bounds("aten.nll_loss_forward.default", [t(6, 10), i, None, 1, -100]) == {1: 10}
    assert measure.index_bounds("aten.nll_loss_forward.default", [t(10), {"shape": [], "dtype": "int64"}, None, 1,
                                                                  -100]) == {1: 10}
    assert measure.index_bounds("aten.gather.default", [t(4, 7), 1, i]) == {2: 7}
    assert measure.index_bounds("aten.index.Tensor", [t(4, 7), [i, None]]) == {1: [4, 7]}
    assert measure.index_bounds("aten.mm.default", [t(2, 2), t(2, 2)]) == {}
    index_args = measure.op_call('{"target": "aten.index.Tensor", "args": [{"shape": [4, 7], "dtype": "float32"}, '
                                 '[{"shape": [100], "dtype": "int64"}, {"shape": [100], "dtype": "int64"}]], '
                                 '"kwargs": {}}', torch.device("cpu"))[1]
    assert int(index_args[1][0].max()) < 4 and int(index_args[1][1].max()) < 7


def test_probabilities_are_drawn_in_the_unit_interval():
    """multinomial on normal draws refuses negative probabilities (on CUDA: a device-side assert)."""
    signature = '{"target": "aten.multinomial.default", "args": [{"shape": [4, 10], "dtype": "float32"}, 3], ' \
                '"kwargs": {}}'
    _, args, _ = measure.op_call(signature, torch.device("cpu"))
    assert 0 <= float(args[0].min()) and float(args[0].max()) < 1
    assert measure.time_signature(signature, "cpu", warmup=1, repeats=1) > 0


def test_off_the_cpu_a_cpu_kernel_is_timed_as_the_runtime_runs_it():
    """SDPA's `_for_cpu` kernel does not exist on CUDA: op timing there times the runtime's replacement."""
    from gaswap.run import capture

    forward = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    for target, replacement in ((forward, capture.sdpa_forward),
                                (forward.replace(".default", "_backward.default"), capture.sdpa_backward)):
        assert measure._resolve_target(target, torch.device("meta")) is replacement
        assert measure._resolve_target(target, torch.device("cpu")) is eval("torch.ops." + target)
    with pytest.raises(ValueError, match="no replacement on meta"):
        measure._resolve_target("aten._other_for_cpu.default", torch.device("meta"))
    q = {"shape": [2, 4, 8, 16], "dtype": "float32"}
    signature = json.dumps({"target": forward, "args": [q, q, q, 0.0, True], "kwargs": {}})
    fn, args, kwargs = measure.op_call(signature, torch.device("cpu"))
    out, _ = fn(*args, **kwargs)  # the CPU kernel
    ours, _ = capture.sdpa_forward(*args, **kwargs)  # what the runtime runs off the CPU
    torch.testing.assert_close(ours, out, rtol=1e-4, atol=1e-5)


def test_an_experiment_without_threads_runs_on_torchs_default_not_on_the_last_experiments(monkeypatch):
    """A compare's pool test failed after a recalibration test in the same process: the second experiment (no
    `costs.threads`) kept the first's one thread, and inductor's cache keys, which count threads, differed from
    its worker's."""
    monkeypatch.setattr(measure, "STARTING_THREADS", 3)
    before = torch.get_num_threads()
    try:
        measure.use_cpu(1)
        assert torch.get_num_threads() == 1
        measure.use_cpu(None)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
