"""Policies inside torch.compile (gaswap.compiled.partition): the joint graph, refusals, and exact training (CPU).

Compiling with inductor takes tens of seconds on a 2-core machine: those tests are marked slow. Capture and
the refusals stop at the partitioner, before inductor generates code (seconds).
"""
import copy
import random

import pytest
import torch
import torch.nn.functional as F

from gaswap import zoo
from gaswap.compiled import offload_ops, partition
from gaswap.plan import graph as graphs
from gaswap.plan.policy import PolicyError


def _cnn():
    torch.manual_seed(0)
    return zoo.tiny_cnn(num_classes=10, width=8), torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))


def _mlp():
    torch.manual_seed(0)
    return zoo.mlp(sizes=(12, 32, 32, 5), dropout=0.2), torch.randn(8, 12), torch.randint(0, 5, (8,))


def _saved(model, graph, x, actions) -> set[str]:
    """What the forward saves when `model` is compiled under a policy of `actions` on its joint graph `graph`."""
    return set(partition.saved_by(copy.deepcopy(model), partition.make_policy(graph, actions), x))


def _recomputable(graph):
    ops = {op.name: op for op in graph.ops}
    return [t for t in graph.candidates() if ops[graph.tensors[t].producer].recomputable]


def test_capture_is_the_joint_graph_torch_partitions():
    model, x, _ = _cnn()
    g = partition.capture(model, x)
    assert g.fingerprint() == partition.capture(copy.deepcopy(model), x.clone()).fingerprint()  # stable names
    kinds = {t.kind for t in g.tensors.values()}
    assert {"param", "buffer", "input", "grad_output", "activation", "grad"} <= kinds
    cands = g.candidates()
    assert "relu" in cands and not any(g.tensors[t].kind == "input" for t in cands)  # the caller holds inputs
    ops = {op.name: op for op in g.ops}
    # inductor's dropout draws from a seed made once per step: the seed op never runs twice, the mask may
    assert not ops["inductor_seeds_default"].recomputable
    assert all(ops[n].phase == "fwd" and not ops[n].recomputable for n in ops if n.startswith("copy_"))  # BN stats
    # torch's own partition, as actions: it keeps the convolutions (compute intensive) at budget 1.0
    graph, actions = partition.torch_partition(model, x, budget=1.0)
    assert graph.fingerprint() == g.fingerprint() and actions["convolution"] == "keep"
    assert set(actions) == set(cands)
    # from one trace, each budget partitions a copy of the joint graph: as a trace of its own would
    _, each = partition.torch_partitions(model, x, budgets=(1.0, 0.5, 0.05))
    assert each == {b: partition.torch_partition(model, x, budget=b)[1] for b in (1.0, 0.5, 0.05)}
    assert each[1.0] != each[0.05]


def test_a_kept_mask_is_saved_instead_of_the_activation_it_reads():
    """ReLU's backward mask `le = relu_1 <= 0` reads only a forward activation that the backward reads through it
    alone: it is a forward op and a candidate (a quarter of relu_1's bytes), and relu_1 is a decidable candidate
    (the backward does not read it). Keeping the mask saves it and not relu_1; recomputing it and keeping relu_1
    saves relu_1 (the backward computes the mask from it); recomputing both saves neither."""
    model, x, _ = _cnn()
    g = partition.capture(model, x)
    ops = {op.name: op for op in g.ops}
    assert ops["le"].phase == "fwd" and ops["le"].target == "aten.le.Scalar"
    assert "le" in g.candidates() and "relu_1" in g.candidates() and "relu_1" in g.decidable
    # relu's mask `le_1` stays in the backward: the backward reads relu anyway (the next convolution's gradient)
    assert ops["le_1"].phase == "bwd" and "relu" in g.candidates() and "relu" not in g.decidable
    assert g.tensors["le"].size * 4 == g.tensors["relu_1"].size  # bool against float32
    order = [op.name for op in g.ops]
    assert order.index("le") == order.index("relu_1") + 1  # the mask runs right after what it reads

    keep = _saved(model, g, x, {})
    assert "le" in keep and "relu_1" not in keep
    from_relu = _saved(model, g, x, {"le": "recompute"})
    assert "relu_1" in from_relu and "le" not in from_relu
    assert keep ^ from_relu == {"le", "relu_1"}  # the policy alone decides: nothing else changes
    assert not {"le", "relu_1"} & _saved(model, g, x, {"le": "recompute", "relu_1": "recompute"})


def test_a_backward_value_computed_from_forward_values_alone_may_be_saved_in_their_place():
    """BatchNorm's backward reads `convolution - mean` (sub_6), computed from forward values alone: it runs in the
    forward as a candidate, and the convolution's output becomes a decidable one. Keep-all saves sub_6; keeping
    the convolution's output and recomputing sub_6 saves the output, as torch's own partition at 1.0 does."""
    model, x, _ = _cnn()
    g = partition.capture(model, x)
    ops = {op.name: op for op in g.ops}
    assert ops["sub_6"].phase == "fwd" and set(ops["sub_6"].inputs) == {"convolution", "getitem_1"}
    assert {"sub_6", "convolution"} <= set(g.candidates()) and "convolution" in g.decidable

    keep_all, from_convolution = _saved(model, g, x, {}), _saved(model, g, x, {"sub_6": "recompute"})
    assert "sub_6" in keep_all and "convolution" not in keep_all
    assert "convolution" in from_convolution and "sub_6" not in from_convolution
    _, actions = partition.torch_partition(model, x, budget=1.0)
    assert actions["convolution"] == "keep" and actions["sub_6"] == "recompute"


def test_a_kept_library_output_is_saved_only_when_the_backward_recomputes_from_it():
    """A matmul's output (`addmm`, read by the forward's ReLU alone) is a candidate, as torch's min-cut may save
    it to recompute what follows it. Kept, it is saved only if something computed from it is recomputed."""
    model, x, _ = _mlp()
    g = partition.capture(model, x)
    assert {"addmm", "addmm_1"} <= g.decidable and {"addmm", "addmm_1"} <= set(g.candidates())

    assert "addmm" not in _saved(model, g, x, {})  # keep-all: the backward reads the mask le_1 alone
    assert "relu" in _saved(model, g, x, {"le_1": "recompute"})  # the mask from the kept relu
    from_addmm = _saved(model, g, x, {"le_1": "recompute", "relu": "recompute"})
    assert "addmm" in from_addmm and not {"le_1", "relu"} & from_addmm
    assert not {"addmm", "le_1", "relu"} & _saved(model, g, x, dict.fromkeys(("le_1", "relu", "addmm"), "recompute"))


@pytest.mark.parametrize("make", [_cnn, _mlp])
def test_torchs_own_partitions_read_back_save_what_torch_saves(make):
    """What torch's min-cut saves at each activation memory budget, read back as a gaswap policy, is what the
    policy's partition saves: torch's choice is in gaswap's search space as torch runs it. (Where a dropout
    mask is recomputed, gaswap's backward draws it again from the saved seeds, an 8-byte tensor; torch's from
    a random state it keeps otherwise.)"""
    model, x, _ = make()
    for budget in (1.0, 0.5, 0.2):
        torch_run = partition._record(partition._Recorder("sgd_momentum", graphs.COUNTABLE, budget), model, (x,))
        graph = torch_run.joint.graph
        seeds = {t for op in graph.ops if not op.recomputable for t in op.outputs}
        actions = partition.policy_of_partition(torch_run.joint, torch_run.saved)
        assert _saved(model, graph, x, actions) - seeds == set(torch_run.saved), budget


def test_refusals_before_any_code_is_generated():
    model, x, _ = _cnn()
    g = partition.capture(model, x)
    policy = partition.make_policy(g, {})
    with pytest.raises(PolicyError, match="not on torch.compile's joint graph"):
        partition.backend(policy.__class__(**{**policy.__dict__, "provenance": {}}))
    with pytest.raises(PolicyError, match="not candidates"):
        partition.make_policy(g, {"primals_1": "recompute"})
    # another batch size is another joint graph: the partitioner refuses it, naming both fingerprints
    step = partition.compile(copy.deepcopy(model), policy)
    with pytest.raises(Exception, match=f"made for graph {g.fingerprint()}"):
        step(torch.randn(8, 3, 16, 16))


def test_a_compiled_policy_called_with_another_batch_size_or_dtype_names_them_not_a_layers_width():
    model, x, _ = _mlp()
    graph = partition.capture(model, x)
    named = partition.make_policy(graph, {}, provenance={"inputs": [{"shape": ["batch", 12], "dtype": "float32"}],
                                                         "batch_size": 8})
    for policy, call, said in [
            (named, torch.randn(4, 12), "input 0: policy [8, 12] float32 (batch size 8), here [4, 12] float32"),
            (named, x.double(), "input 0: policy [8, 12] float32 (batch size 8), here [8, 12] float64"),
            (partition.make_policy(graph, {}), torch.randn(4, 12),
             ("The inputs here: [4, 12] float32; the policy does not name the inputs it was made for"))]:
        m = copy.deepcopy(model).to(call.dtype)
        with pytest.raises(partition.OtherGraph) as refused:  # as it is, not wrapped in BackendCompilerFailed
            partition.compile(m, policy)(call)
        assert said in str(refused.value), str(refused.value)
        assert ("width" in str(refused.value)) == (policy is not named)  # a guess only where the policy says nothing
        assert "TORCHDYNAMO_VERBOSE" not in str(refused.value) and isinstance(refused.value, PolicyError)


def test_a_compiled_policy_of_another_torch_release_is_refused_saying_so_and_nothing_of_inputs():
    model, x, _ = _mlp()
    graph = partition.capture(model, x)
    policy = partition.make_policy(graph, {}, provenance={"torch_version": "1.13.0+cu117"})
    with pytest.raises(partition.OtherGraph) as refused:
        partition.compile(copy.deepcopy(model), policy)(x)
    said = str(refused.value)
    assert said.startswith("policy: made with torch 1.13.0+cu117, this is torch") and "inputs" not in said, said


def _train(fn, model, x, y, steps=3):
    """Losses, gradients and the state dict (parameters, BatchNorm statistics) after `steps` SGD steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)  # the same dropout masks
    losses, grads = [], []
    for _ in range(steps):
        loss = F.cross_entropy(fn(x), y)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return losses, grads, [t.clone() for t in model.state_dict().values()]


def _policies(model, x, graph, names):
    recomputable = _recomputable(graph)
    rng = random.Random(0)
    every = {
        "recompute": lambda: {t: "recompute" for t in recomputable},
        "mixed": lambda: {t: rng.choice(["keep", "recompute"]) for t in recomputable},
        "mixed, first dropout mask recomputed": lambda: {t: rng.choice(["keep", "recompute"]) for t in recomputable}
        | {"gt": "recompute"},
        "torch": lambda: partition.torch_partition(model, x, budget=1.0)[1],  # torch's own partition, read back
    }
    return {name: every[name]() for name in names}


def _run_all(make, names):
    """Plain torch.compile and gaswap.compiled.partition under each named policy, trained from the same start."""
    model, x, y = make()
    graph = partition.capture(model, x)
    reference = _train(torch.compile(m := copy.deepcopy(model), fullgraph=True, dynamic=False), m, x, y)
    out = {}
    for name, actions in _policies(model, x, graph, names).items():
        m = copy.deepcopy(model)
        backend = partition.backend(partition.make_policy(graph, actions))
        out[name] = (_train(torch.compile(m, backend=backend, fullgraph=True, dynamic=False), m, x, y),
                     partition.saved_by(copy.deepcopy(model), partition.make_policy(graph, actions), x), actions)
    return graph, reference, out


def _tensors(result) -> list:
    losses, grads, state = result
    return [*losses, *(g for step in grads for g in step), *state]


def _equal(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(_tensors(a), _tensors(b), strict=True))


@pytest.mark.slow
def test_mlp_with_dropout_trains_bitwise_as_plain_torch_compile():
    graph, reference, out = _run_all(_mlp, ["mixed, first dropout mask recomputed"])
    result, saved, actions = out["mixed, first dropout mask recomputed"]
    assert _equal(result, reference)
    assert "keep" in actions.values() and "recompute" in actions.values()
    assert not {t for t, a in actions.items() if a == "recompute"} & set(saved)  # recomputed, so not saved
    # a recomputed dropout mask is drawn again in the backward from the seeds the forward saved
    assert actions["gt"] == "recompute" and "inductor_seeds_default" in saved


@pytest.mark.slow
def test_swapped_tensors_are_offloaded_and_train_bitwise_as_plain_torch_compile():
    """A swapped tensor is saved and handed to torch's activation offloading (on a CPU, a host copy after its last
    forward reader and back before its first backward reader): the step computes the same values."""
    model, x, y = _mlp()
    graph = partition.capture(model, x)
    saved = _saved(model, graph, x, {})
    swapped = sorted(set(saved) & set(_recomputable(graph)))  # masks and activations
    assert len(swapped) >= 4
    reference = _train(torch.compile(m := copy.deepcopy(model), fullgraph=True, dynamic=False), m, x, y)
    backend = partition.backend(partition.make_policy(graph, {t: "swap" for t in swapped}))
    m = copy.deepcopy(model)
    result = _train(torch.compile(m, backend=backend, fullgraph=True, dynamic=False), m, x, y)
    assert _equal(result, reference)
    partitioned = partition.partitioned_by(copy.deepcopy(model), backend.partitioner.policy, x)
    assert partitioned.offloaded == swapped
    assert partitioned.saved == sorted(saved)  # offloaded, they are still what the forward saves


class _Transposed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(12, 16))

    def forward(self, x):
        return torch.sin((x @ self.w).t())  # sin's backward reads cos of a transposed matmul: not contiguous


def test_what_torch_cannot_offload_is_marked_at_capture_and_no_policy_swaps_it():
    from gaswap.base import config
    from gaswap.plan.encoding import Action, Encoding

    model, x = _Transposed(), torch.randn(8, 12)
    graph = partition.capture(model, x)
    assert "cos" in graph.candidates() and "cos" in graph.unswappable  # a transposed matmul's cos
    swap_space = config.load_search_space(partition.SWAP_SPACE)
    encoding = Encoding(graph, [Action.parse(a) for a in swap_space.actions])
    allowed = dict(zip(encoding.candidates, encoding.allowed))
    assert Action.SWAP not in allowed["cos"] and Action.RECOMPUTE in allowed["cos"]
    with pytest.raises(PolicyError, match="the policy swaps cos, which torch's activation offloading refuses"):
        partition.make_policy(graph, {"cos": "swap"})
    cnn, image, _ = _cnn()
    pooled = partition.capture(cnn, image)
    indices = [t for t in pooled.candidates() if t.startswith("getitem")]  # max-pool's indices: getitems
    assert indices and set(indices) <= pooled.unswappable
    assert pooled.fingerprint() == partition.capture(copy.deepcopy(cnn), image.clone()).fingerprint()


def test_compiled_policies_swap_only_where_the_host_memory_is_apart(monkeypatch):
    assert partition.space_for("cpu") == partition.SPACE
    monkeypatch.setattr(offload_ops, "offload_path", lambda cuda: "async")
    assert partition.space_for("cuda") == partition.SWAP_SPACE and partition.space_for("cpu") == partition.SPACE
    monkeypatch.setattr(offload_ops, "offload_path", lambda cuda: "refused")  # torch 2.11 on CUDA
    assert partition.space_for("cuda") == partition.SPACE


def test_the_compiled_model_prices_a_swap_by_the_devices_link_and_it_lowers_the_peak():
    from gaswap.base import config
    from gaswap.compiled.step_model import CompiledProblem
    from gaswap.plan.encoding import Action
    from helpers import unit_costs

    model, x, _ = _mlp()
    graph = partition.capture(model, x)
    space = config.load_search_space(partition.SWAP_SPACE)
    fast, slow = (CompiledProblem(graph, unit_costs(graph, 1e-3, bandwidth), None, space, loss="sum")
                  for bandwidth in (1e12, 1e3))
    keep, swap = fast.encoding.uniform(Action.KEEP), fast.encoding.uniform(Action.SWAP)
    assert any(Action.SWAP in a for a in fast.encoding.allowed)
    assert fast.simulate(swap).peak_bytes < fast.simulate(keep).peak_bytes
    assert fast.simulate(swap).step_time == pytest.approx(fast.simulate(keep).step_time, rel=1e-6)  # overlapped
    assert slow.simulate(swap).step_time > slow.simulate(keep).step_time  # a slow link stalls the step
    assert set(fast.actions_of(swap).values()) == {"keep", "swap"}  # masks torch cannot offload stay kept


@pytest.mark.slow
def test_every_swap_the_search_may_choose_is_one_torch_offloads():
    from gaswap.base import config
    from gaswap.plan.encoding import Action, Encoding

    model, x, y = _cnn()
    graph = partition.capture(model, x)
    encoding = Encoding(graph, [Action.parse(a) for a in config.load_search_space(partition.SWAP_SPACE).actions])
    swapped = {t: "swap" for t, allowed in zip(encoding.candidates, encoding.allowed) if Action.SWAP in allowed}
    assert len(swapped) >= 4
    reference = _train(torch.compile(m := copy.deepcopy(model), fullgraph=True, dynamic=False), m, x, y)
    m = copy.deepcopy(model)
    result = _train(partition.compile(m, partition.make_policy(graph, swapped)), m, x, y)
    _close(result, reference)


@pytest.mark.slow
def test_swapping_what_torch_cannot_offload_is_refused():
    """A policy written by hand (not by `make_policy`, which refuses it) is refused by the partitioner too."""
    from gaswap.plan.policy import Policy

    model, x = _Transposed(), torch.randn(8, 12)
    graph = partition.capture(model, x)
    policy = partition.make_policy(graph, {})
    step = partition.compile(model, Policy(policy.fingerprint, policy.order, policy.actions | {"cos": "swap"},
                                           policy.predicted, policy.provenance))
    with pytest.raises(Exception, match="the policy swaps cos, which torch's activation offloading refuses"):
        step(x)


def _close(result, reference) -> None:
    """Equal to float32 rounding: losses to 1e-5, gradients and state to 1e-4 of their largest value."""
    losses, grads, state = result
    torch.testing.assert_close(losses, reference[0], rtol=1e-5, atol=0)
    for step, ref_step in zip(grads, reference[1]):
        for g, r in zip(step, ref_step):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * float(r.abs().max()))
    for s, r in zip(state, reference[2]):  # parameters, BatchNorm running statistics and counters
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-4 * float(r.abs().max().clamp(min=1e-30)))


def _recomputed_reductions_bitwise() -> bool:
    """Whether inductor's CPU code recomputes BatchNorm's statistics with the forward's bits. torch 2.11 lowers
    var_mean to a Welford reduction, and where the backward recomputes it, splits each channel's reduction across
    the OpenMP threads (two partial states of 512 elements combined, where the forward's kernel reduced 1024 in
    one thread): the mean and variance round otherwise, and so do the gradients after them (measured on 2 threads:
    31 of the 3 steps' gradients and state tensors differ, by at most 9e-8). With one thread it is bitwise; torch
    2.13 reduces with sums there, and is."""
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 13) or torch.get_num_threads() == 1


@pytest.mark.slow
def test_cnn_with_batchnorm_trains_as_plain_torch_compile():
    """Recompute-all is bitwise equal to plain torch.compile where inductor recomputes a reduction as the forward
    computed it (`_recomputed_reductions_bitwise`; elsewhere to float32 rounding, and bitwise again on one thread).
    A policy that saves other tensors changes which ops inductor fuses into one kernel, and a reduction
    (BatchNorm's var_mean, the average pool, the backward's sums) fused with another producer accumulates in
    another order: such runs agree to float32 rounding (relative 1e-4 after 3 steps; measured 2e-6 to 2e-5), not
    bit for bit."""
    _, reference, out = _run_all(_cnn, ["recompute", "mixed"])
    if _recomputed_reductions_bitwise():
        assert _equal(out["recompute"][0], reference)
    else:
        _close(out["recompute"][0], reference)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        torch._dynamo.reset()  # compiled again (inductor's code is made for a number of threads), then forgotten
        try:
            with torch._inductor.config.patch({"cpp.threads": 1}):
                _, one_thread, rerun = _run_all(_cnn, ["recompute"])
        finally:
            torch.set_num_threads(threads)
            torch._dynamo.reset()
        assert _equal(rerun["recompute"][0], one_thread)
    _close(out["mixed"][0], reference)
    recomputed = {t for t, a in out["mixed"][2].items() if a == "recompute"}
    assert out["mixed"][1] and not recomputed & set(out["mixed"][1])


@pytest.mark.slow
def test_cnn_under_torchs_own_partition_read_back_trains_bitwise_as_plain_torch_compile():
    """torch's partition at budget 1.0 saves ReLU's mask instead of the activation; read back as a gaswap policy
    it saves the same tensors, so inductor compiles the same step: bitwise equal, BatchNorm and all."""
    graph, reference, out = _run_all(_cnn, ["torch"])
    result, saved, actions = out["torch"]
    assert actions["le"] == "keep" and "le" in saved and "relu_1" not in saved
    assert _equal(result, reference)


def test_a_policy_recomputing_what_may_not_run_twice_is_refused():
    from gaswap.plan.graph import Graph, Op, Tensor

    t = {"x": Tensor("x", 4, "input"), "r": Tensor("r", 4, "activation", "rand"),
         "y": Tensor("y", 4, "activation", "mul"), "g": Tensor("g", 4, "activation", "mul_bwd")}
    g = Graph((Op("rand", "aten.rand_like.default", ("x",), ("r",), recomputable=False),
               Op("mul", "aten.mul.Tensor", ("x", "r"), ("y",)),
               Op("mul_bwd", "aten.mul.Tensor", ("y", "r"), ("g",), phase="bwd")), t, loss="y")
    assert "r" in g.candidates()
    with pytest.raises(PolicyError, match="recomputes r, whose op may not run twice"):
        partition.make_policy(g, {"r": "recompute"})
    assert partition.make_policy(g, {"r": "keep"}).actions == {"r": "keep"}


NEEDS_ASYNC_OFFLOAD = pytest.mark.skipif(not offload_ops.has_async_offload(), reason=(
    f"torch {torch.__version__} has no torch.ops.ao offloading: compiled swaps on CUDA are refused "
    f"(tests/test_offload_ops.py)"))


@NEEDS_ASYNC_OFFLOAD
def test_cuda_offloading_uses_torchs_async_copies_and_prefetched_reloads_on_fake_cuda_tensors():
    """The CUDA branch of `partition.offload`, on a CPU: graphs whose values are fake CUDA tensors (as inductor's
    partitioner sees them) get torch's asynchronous offload (`ao.offload`, waited on) after the saved value's
    last forward reader, and its reload (`ao.reload`, waited on) before its first backward reader."""
    from torch.utils._ordered_set import OrderedSet

    from test_offload_ops import fake_cuda_graphs  # the same fake forward and backward as the refusal tests

    mode, fw, bw = fake_cuda_graphs()
    with mode:  # as inside torch.compile
        partition.offload(fw, bw, {"relu"}, 1, OrderedSet())
    calls = lambda g: [n.target for n in g.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert calls(fw)[-2:] == [torch.ops.ao.offload.default, torch.ops.ao.wait_tensor.default]
    assert [n.name for n in fw.graph.output_node().args[0]] == ["sum_1", partition.OFFLOADED_PREFIX + "relu"]
    assert calls(bw)[:2] == [torch.ops.ao.reload.default, torch.ops.ao.wait_tensor.default]  # before `relu > 0`


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@NEEDS_ASYNC_OFFLOAD
def test_on_cuda_swapped_activations_leave_the_gpu_and_gradients_stay_the_same():
    """On CUDA the offloaded activations are copied to pinned host buffers on a side stream and freed on the GPU:
    between the forward and the backward the allocator holds less than keep-all's by what they take, and the
    gradients are the same."""
    torch.manual_seed(0)
    model = zoo.mlp(sizes=(1024, 4096, 4096, 4096, 10), dropout=0.0).cuda()
    x, y = torch.randn(512, 1024, device="cuda"), torch.randint(0, 10, (512,), device="cuda")
    graph = partition.capture(model, x)
    saved = _saved(model, graph, x, {})
    swapped = {t: "swap" for t in set(saved) & set(_recomputable(graph))}
    held, grads = {}, {}
    for name, actions in (("keep", {}), ("swap", swapped)):
        m = copy.deepcopy(model)
        step = partition.compile(m, partition.make_policy(graph, actions))
        F.cross_entropy(step(x), y).backward()  # compile, warm up
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = step(x)
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
        F.cross_entropy(out, y).backward()
        grads[name] = [p.grad.clone() for p in m.parameters()]
    offloaded = sum(graph.tensors[t].size for t in swapped)
    assert offloaded > 0 and held["swap"] <= held["keep"] - 0.9 * offloaded
    assert all(torch.equal(a, b) for a, b in zip(grads["keep"], grads["swap"], strict=True))
