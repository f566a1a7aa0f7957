"""gaswap.compiled.library_calls: the scratch of a generated program's library calls, replayed alone, on
hand-written programs and on a real compile against the allocator's meter."""
import pytest
import torch
import torch.nn.functional as F

from gaswap.compiled import library_calls
from gaswap.compiled.programs import SCRATCH, Program, step_peak
from gaswap.run.peak_meter import PeakMeter

# a depthwise 7x7 convolution's backward laid out channels-last, as inductor writes it (its weight gradient
# goes through a copy of its input laid out plainly and more), then calls gaswap does not replay
BACKWARD = """\
    def call(self, args):
        primals_1, convolution, tangents_1 = args
        args.clear()
        buf0 = empty_strided_cpu((8, 4, 4, 16), (256, 64, 16, 1), torch.float32)
        cpp_fused_0(tangents_1, buf0)
        del tangents_1
        # Topologically Sorted Source Nodes: [convolution_backward], Original ATen: [aten.convolution_backward]
        buf1 = torch.ops.aten.convolution_backward.default(reinterpret_tensor(buf0, (8, 16, 4, 4), (256, 1, 64, 16), 0), convolution, primals_1, [16], (1, 1), (3, 3), (1, 1), False, (0, 0), 16, [True, True, True])
        del buf0
        buf2 = buf1[0]
        assert_size_stride(buf2, (8, 16, 4, 4), (256, 1, 64, 16), 'torch.ops.aten.convolution_backward.default')
        buf3 = buf1[1]
        assert_size_stride(buf3, (16, 1, 7, 7), (49, 1, 7, 1), 'torch.ops.aten.convolution_backward.default')
        buf4 = buf1[2]
        assert_size_stride(buf4, (16, ), (1, ), 'torch.ops.aten.convolution_backward.default')
        del buf1
        buf5 = torch.ops.gaswap.offload.default(buf2)
        buf6 = extern_kernels.mm(convolution, inf)
        del convolution
        return (buf2, buf3, buf4, )


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((16, 1, 7, 7), (49, 49, 7, 1), device='cpu', dtype=torch.float32)
    convolution = rand_strided((8, 16, 4, 4), (256, 1, 64, 16), device='cpu', dtype=torch.float32)
    tangents_1 = rand_strided((8, 16, 4, 4), (256, 1, 64, 16), device='cpu', dtype=torch.float32)
"""
CALL = 5  # the index of the convolution's backward in the program's body


def _metered_backward() -> tuple[int, int]:
    """(the allocator's peak, the bytes returned) of the same convolution backward called directly."""
    grad = torch.randn(8, 4, 4, 16).permute(0, 3, 1, 2)
    x = torch.randn(8, 16, 4, 4).to(memory_format=torch.channels_last)
    weight = torch.randn(16, 1, 7, 7)
    with PeakMeter("cpu") as meter:
        grads = torch.ops.aten.convolution_backward.default(grad, x, weight, [16], (1, 1), (3, 3), (1, 1), False,
                                                            (0, 0), 16, [True, True, True])
        returned = sum(g.untyped_storage().nbytes() for g in grads)
        del grads
    return meter.peak, returned


def test_a_library_calls_scratch_is_what_the_allocator_meters_for_the_call_alone():
    library_calls._KNOWN.clear()
    scratch = library_calls.scratch(Program(BACKWARD))
    peak, returned = _metered_backward()
    assert peak > returned  # the call holds more than it returns: the case at hand
    # the replay's call and the direct one allocate alike: the only call replayed, and its scratch
    assert scratch == {CALL: peak - returned}


def test_calls_of_other_namespaces_or_unreadable_arguments_are_left_out():
    body = Program(BACKWARD).body
    layouts = Program(BACKWARD).layouts
    assert library_calls._call(body[2], layouts) is None  # a generated kernel
    assert library_calls._call(body[4], layouts) is None  # a comment naming aten ops
    assert library_calls._call(body[-3], layouts) is None  # torch.ops.gaswap
    assert library_calls._call(body[-2], layouts) is None  # an argument that is not a literal: `inf`
    for odd in ("buf9 = extern_kernels.mm(reinterpret_tensor(convolution, (8, 16)), buf0)",  # too few arguments
                "buf9 = extern_kernels.mm(reinterpret_tensor(convolution, (s0, 16), (16, 1), 0), buf0)",  # a symbol
                "buf9 = extern_kernels.mm(convolution, buf0, alpha=1 +)"):  # not Python
        assert library_calls._call(odd, layouts) is None, odd
    signature, (function, args, kwargs) = library_calls._call(body[CALL], layouts)
    assert function is torch.ops.aten.convolution_backward.default
    assert args[0] == ("tensor", ((8, 16, 4, 4), (256, 1, 64, 16), "float32"), 0)  # the view, in buf0's dtype
    assert args[3] == ("list", (("value", 16),)) and kwargs == ()


def test_keywords_name_dtypes_and_the_same_call_is_replayed_once(monkeypatch):
    line = "buf1 = extern_kernels.convolution(x, w, None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), " \
           "transposed=False, output_padding=(0, 0), groups=1)"
    program = BACKWARD.replace("        del buf1\n", f"        del buf1\n        {line.replace('buf1', 'buf9')}\n")
    program = program.replace("x, w,", "convolution, primals_1,")
    calls = []
    measure = library_calls._measure
    monkeypatch.setattr(library_calls, "_measure", lambda c, d: calls.append(len(c)) or measure(c, d))
    library_calls._KNOWN.clear()
    first = library_calls.scratch(Program(BACKWARD))
    second = library_calls.scratch(Program(program))
    assert calls == [1, 1]  # the backward once, then only the new convolution
    assert second[CALL] == first[CALL]
    cast = library_calls._call("buf2 = torch.ops.aten.cumsum.default(buf0, dim=-1, dtype=torch.int64)",
                               Program(BACKWARD).layouts)
    assert cast[1][2] == (("dim", ("value", -1)), ("dtype", ("torch", "int64")))


def test_a_call_that_fails_on_random_values_has_no_scratch():
    failing = BACKWARD.replace("[16], (1, 1), (3, 3)", "[16], (1, 1), (30, 30)")  # padding past the input
    library_calls._KNOWN.clear()
    assert library_calls.scratch(Program(failing)) == {}


def test_the_walk_counts_a_calls_scratch_beside_its_outputs():
    program = Program(BACKWARD)
    plain = program.walk()
    inputs, outputs = 2 * 8 * 16 * 16 * 4, 8 * 16 * 16 * 4 + 16 * 49 * 4 + 16 * 4  # convolution, tangents_1
    assert plain.peak == inputs + 8 * 16 * 16 * 4 + outputs - 8 * 16 * 16 * 4  # buf0 frees tangents_1's room
    walk = program.walk(scratch={CALL: 10 ** 6})
    assert walk.peak == plain.peak + 10 ** 6  # at the call: buf0, the inputs, the outputs and the scratch
    assert walk.at_peak[SCRATCH] == 10 ** 6 and sum(walk.at_peak.values()) == walk.peak
    # at the generated kernel (line 2) the inputs and buf0 are held, 3200 B under the peak at the call
    assert program.walk(scratch={2: 3000}).peak == plain.peak
    assert program.walk(scratch={2: 4000}).peak == 3 * 8 * 16 * 16 * 4 + 4000


@pytest.mark.slow
def test_a_compiled_step_that_recomputes_a_convolution_meters_its_programs_peak_with_scratch():
    """A depthwise convolution recomputed in the backward (torch's partitioner at budget 0) lays the backward
    out channels-last, where its convolution's backward holds scratch at the step's peak."""
    from gaswap.compiled import dry_compile, methods

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 4, stride=4), torch.nn.Conv2d(32, 32, 7, padding=3, groups=32),
                                torch.nn.GELU(), torch.nn.Flatten(), torch.nn.Linear(32 * 16, 10))
    x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))
    dry = dry_compile.programs_of(model, methods.torch_backend(0.0), x)
    compiled = methods.torch_compiled(model, 0.0)

    def step():
        F.cross_entropy(compiled(x), y).backward()
        model.zero_grad(set_to_none=True)

    step()
    step()
    with PeakMeter("cpu") as meter:
        step()
    plain = step_peak(dry, 32 * 10 * 4, "cross_entropy")
    counted = step_peak(dry, 32 * 10 * 4, "cross_entropy", library_calls.scratch)
    assert plain < 0.9 * meter.peak  # the programs alone miss the scratch
    assert abs(counted / meter.peak - 1) <= 0.01, (counted, meter.peak)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_calls_scratch_is_the_caching_allocators_peak_beyond_its_outputs():
    program = Program(BACKWARD.replace("device='cpu'", "device='cuda:0'"))
    library_calls._KNOWN.clear()
    scratch = library_calls.scratch(program)
    grad = torch.randn(8, 4, 4, 16, device="cuda").permute(0, 3, 1, 2)
    x = torch.randn(8, 16, 4, 4, device="cuda").to(memory_format=torch.channels_last)
    weight = torch.randn(16, 1, 7, 7, device="cuda")
    call = (grad, x, weight, [16], (1, 1), (3, 3), (1, 1), False, (0, 0), 16, [True, True, True])
    torch.ops.aten.convolution_backward.default(*call)  # cuDNN's handle and plans, made once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    grads = torch.ops.aten.convolution_backward.default(*call)
    torch.cuda.synchronize()
    held = torch.cuda.max_memory_allocated() - start - sum(g.untyped_storage().nbytes() for g in grads)
    assert scratch.get(CALL, 0) == held
