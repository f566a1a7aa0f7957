"""gaswap.compiled.programs: the memory walk over inductor's generated programs, on hand-written ones, and on
a real compile against the allocator's meter."""
import copy

import pytest
import torch
import torch.nn.functional as F

from gaswap import zoo
from gaswap.compiled.programs import Program, ProgramError, Recorder, step_peak
from gaswap.run.peak_meter import PeakMeter

BACKWARD = """\
    def call(self, args):
        primals_1, saved, tangents_1 = args
        args.clear()
        buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
        cpp_fused_0(saved, tangents_1, buf0)
        del tangents_1
        buf1 = torch.ops.aten.convolution_backward.default(buf0, saved, primals_1, [0], [True, True, False])
        del buf0
        buf2 = buf1[0]
        assert_size_stride(buf2, (4, 8), (8, 1), 'torch.ops.aten.convolution_backward.default')
        # buffer buf2 (op: torch.ops.aten.convolution_backward.default) is assumed to be not aligned
        buf3 = buf1[1]
        assert_size_stride(buf3, (2, 2), (2, 1), 'torch.ops.aten.convolution_backward.default')
        del buf1
        buf4 = buf2; del buf2  # reuse
        buf5 = reinterpret_tensor(buf3, (4, ), (1, ), 0)
        del saved
        del primals_1
        return (buf4, buf3, )


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((2, 2), (2, 1), device='cpu', dtype=torch.float32)
    saved = rand_strided((4, 8), (8, 1), device='cpu', dtype=torch.float16)
    tangents_1 = rand_strided((4, 8), (1, 4), device='cpu', dtype=torch.float32)
"""


def test_the_walk_counts_inputs_buffers_and_a_library_calls_outputs_at_the_call():
    walk = Program(BACKWARD).walk()
    # saved (32 halves, 64 B) and tangents_1 (32 floats; strides (1, 4) span as many) alive from the start;
    # primals_1 is resident (a parameter) and not counted
    start = 64 + 128
    # buf0 (128) while both inputs are alive; the convolution's outputs (buf2 128, buf3 16: in the dtype of
    # its first tensor argument, buf0) at the call, while buf0 and saved are alive
    assert walk.peak == max(start + 128, start - 128 + 128 + 128 + 16) == 336
    assert walk.at_peak == {"saved": 64, "buf0": 128, "buf2": 128, "buf3": 16}
    assert walk.end == 128 + 16  # returned: buf4 (buf2 reused) and buf3; the view buf5 allocates nothing


def test_a_library_calls_outputs_take_the_dtype_of_its_first_tensor_argument():
    half = BACKWARD.replace("default(buf0, saved,", "default(saved, buf0,")
    walk = Program(half).walk()
    assert walk.at_peak == {"saved": 64, "tangents_1": 128, "buf0": 128}  # the outputs in halves: 64 + 8
    assert walk.end == 64 + 8


def test_layouts_name_inputs_buffers_outputs_and_what_a_reuse_hands_on():
    layouts = Program(BACKWARD).layouts
    assert layouts["saved"] == ((4, 8), (8, 1), "float16")  # the harness's input
    assert layouts["buf0"] == ((4, 8), (8, 1), "float32")  # allocated
    assert layouts["buf3"] == ((2, 2), (2, 1), "float32")  # a library call's output, in buf0's dtype
    assert layouts["buf4"] == layouts["buf2"]  # handed on as it is
    assert layouts["buf5"] == ((4,), (1,), "float32")  # a view of buf3, named
    assert Program(BACKWARD).device == "cpu"


def test_a_dynamic_shape_or_a_missing_program_is_refused():
    with pytest.raises(ProgramError, match="dynamic shape"):
        Program(BACKWARD.replace("empty_strided_cpu((4, 8)", "empty_strided_cpu((s0, 8)")).walk()
    with pytest.raises(ProgramError, match="def call"):
        Program("print('no program')").walk()


FORWARD = """\
    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        buf0 = empty_strided_cpu((10, 10), (10, 1), torch.float32)
        buf1 = empty_strided_cpu((10, 10), (10, 1), torch.float32)
        buf2 = empty_strided_cpu((10, 5), (5, 1), torch.float32)
        del buf1
        return (buf2, buf0, )


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((10, 10), (10, 1), device='cpu', dtype=torch.float32)
    primals_2 = rand_strided((10, 10), (10, 1), device='cpu', dtype=torch.float32)
"""


def test_the_step_peak_is_the_forward_the_eager_loss_or_the_backward():
    forward, backward = Program(FORWARD), Program(BACKWARD)
    assert forward.walk() == (1000, 600, {"buf0": 400, "buf1": 400, "buf2": 200}, {"buf0": 400, "buf2": 200})
    assert not forward.is_backward
    assert backward.is_backward
    # the forward leaves 600 B; the eager loss holds the output (200, counted in them), its gradient (200)
    # and cross entropy's log_softmax (200)
    assert step_peak([forward, backward], 200, "sum") == 1000
    assert step_peak([backward, forward], 400, "cross_entropy") == 600 + 2 * 400
    with pytest.raises(ProgramError, match="graph break"):
        step_peak([forward, forward, backward], 200, "sum")


@pytest.mark.slow
def test_the_program_peak_of_a_compiled_training_step_is_what_the_allocator_meters():
    # dynamo's recompile limit (8 for one function, then a failure under fullgraph) counts the compiles of
    # tiny_cnn's forward by the modules before: `pytest -m slow` failed here
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x, y = zoo.tiny_cnn(num_classes=10, width=8), torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    compiled = torch.compile(copy.deepcopy(model), backend="inductor", fullgraph=True, dynamic=False)

    def step():
        F.cross_entropy(compiled(x), y).backward()
        compiled.zero_grad(set_to_none=True)

    with Recorder() as recorder:
        step()  # the compile
    with PeakMeter("cpu") as meter:
        step()
    predicted = step_peak(recorder.programs, 16 * 10 * 4, "cross_entropy")
    assert len(recorder.programs) == 2 and abs(meter.peak / predicted - 1) <= 0.05, (meter.peak, predicted)
    with Recorder() as again:  # a second compile of the same graphs loads them from inductor's cache
        torch._dynamo.reset()
        step()
    assert step_peak(again.programs, 16 * 10 * 4, "cross_entropy") == predicted


SLICING_FORWARD = """\
    def call(self, args):
        primals_1, = args
        args.clear()
        buf2 = empty_strided_cpu((10, 30), (30, 1), torch.float32)
        buf0 = reinterpret_tensor(buf2, (10, 30), (30, 1), 0); del buf2  # reuse
        buf1 = empty_strided_cpu((10, 10), (10, 1), torch.float32)
        return (buf1, reinterpret_tensor(buf0, (10, 10), (30, 1), 0), reinterpret_tensor(buf0, (10, 10), (30, 1), 10), primals_1, )


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((10, 10), (10, 1), device='cpu', dtype=torch.float32)
"""
SLICING_BACKWARD = """\
    def call(self, args):
        primals_1, slice_1, slice_2, tangents_1 = args
        args.clear()
        del slice_1
        buf0 = empty_strided_cpu((10, 10), (10, 1), torch.float32)
        del slice_2
        buf1 = empty_strided_cpu((10, 10), (10, 1), torch.float32)
        return (buf1, )


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((10, 10), (10, 1), device='cpu', dtype=torch.float32)
    slice_1 = rand_strided((10, 10), (30, 1), device='cpu', dtype=torch.float32)
    slice_2 = rand_strided((10, 10), (30, 1), device='cpu', dtype=torch.float32)
    tangents_1 = rand_strided((10, 10), (10, 1), device='cpu', dtype=torch.float32)
"""


def test_saved_views_of_one_buffer_are_held_once_until_the_last_is_deleted():
    forward, backward = Program(SLICING_FORWARD), Program(SLICING_BACKWARD)
    # the forward saves two slices of buf0 (1200 B: buf2's, reused) and a parameter (resident), and returns its
    # output buf1
    assert forward.saved_storage(3) == [("buf0", 1200), ("buf0", 1200), ("primals_1", 0)]
    storage = dict(zip(["slice_1", "slice_2", "primals_1"], forward.saved_storage(3)))
    # the forward's buf0 once (1200) and the gradient (400) at the start; it stays until slice_2 goes, so the
    # backward's buf0 is made beside it; the end: the gradient (never deleted here), buf0 and buf1. Counted
    # view by view, each slice would span 1120 B (10 rows of 10, 30 apart)
    walk = backward.walk(storage)
    assert walk[:3] == (1200 + 400 + 400, 3 * 400, {"saved buf0": 1200, "tangents_1": 400, "buf0": 400})
    assert backward.walk().peak == 1120 + 1120 + 400  # what the views alone would say
    assert step_peak([forward, backward], 400, "sum") == max(1600, 1600 + 2 * 400, 2000)
    with pytest.raises(ProgramError, match="forward returns 4"):
        forward.saved_storage(5)


def test_a_saved_value_the_forwards_walk_does_not_hold_is_counted_by_its_own_size():
    forward = Program(SLICING_FORWARD.replace("primals_1, )", "buf7, )"))  # buf7: made by no line it reads
    saved = forward.saved_storage(3)
    assert saved == [("buf0", 1200), ("buf0", 1200), ("buf7", None)]
    backward = Program(SLICING_BACKWARD.replace("primals_1, slice_1, slice_2,", "slice_1, slice_2, extra,")
                       + "    extra = rand_strided((10, 10), (10, 1), device='cpu', dtype=torch.float32)\n")
    walk = backward.walk(dict(zip(["slice_1", "slice_2", "extra"], saved)))
    assert walk.peak == 1200 + 400 + 400 + 400  # buf0 (the backward's) made beside all three inputs
    assert walk.at_peak == {"saved buf0": 1200, "extra": 400, "tangents_1": 400, "buf0": 400}
