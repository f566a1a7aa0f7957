"""gaswap.compiled.program_time: a compiled step's time from the calls of its programs, on hand-written programs,
and the calls of a real compile timed as they run."""
from functools import partial

import pytest
import torch

from gaswap.compiled.program_time import ProgramTimes, calls, kernel_keys, timed_calls
from gaswap.compiled.programs import Program

KERNEL_A = "extern \"C\" void kernel(const float* in_ptr0, float* out_ptr0) { /* relu of 32 */ }"
KERNEL_B = "extern \"C\" void kernel(const float* in_ptr0, float* out_ptr0) { /* tanh of 32 */ }"
FORWARD = f"""\
cpp_fused_relu_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
{KERNEL_A}
''')


cpp_fused_tanh_1 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
{KERNEL_B}
''')


async_compile.wait(globals())


class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
        cpp_fused_relu_0(primals_1, buf0)
        buf1 = empty_strided_cpu((4, 2), (2, 1), torch.float32)
        # Topologically Sorted Source Nodes: [linear], Original ATen: [aten.mm]
        extern_kernels.mm(buf0, reinterpret_tensor(primals_2, (8, 2), (1, 8), 0), out=buf1)
        buf2 = buf1; del buf1  # reuse
        buf3 = torch.ops.aten.topk.default(buf2, 1, -1, True, True)
        cpp_fused_relu_0(primals_1, buf0)
        cpp_fused_tanh_1(buf0, buf2)
        return (buf2, buf0, )


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((4, 8), (8, 1), device='cpu', dtype=torch.float32)
    primals_2 = rand_strided((2, 8), (8, 1), device='cpu', dtype=torch.float32)
"""


def test_calls_are_read_in_order_with_keys_equal_where_the_work_is():
    found = calls(Program(FORWARD))
    keys = kernel_keys(FORWARD)
    assert [c.key for c in found] == [keys["cpp_fused_relu_0"], "extern_kernels.mm [(4, 8), (8, 2)]",
                                      "torch.ops.aten.topk.default [(4, 2)]",  # buf2: buf1 reused, its shape
                                      keys["cpp_fused_relu_0"], keys["cpp_fused_tanh_1"]]
    assert [c.generated for c in found] == [True, False, False, True, True]
    assert keys["cpp_fused_relu_0"] != keys["cpp_fused_tanh_1"]  # other source, other work
    # bytes of the tensor arguments: relu reads 32 floats and writes 32; the matmul's view of primals_2 is 16 floats
    assert [c.nbytes for c in found] == [256, 128 + 64, 32, 256, 128 + 32]


def test_a_kernel_of_the_same_source_has_the_same_key_in_another_program():
    other = FORWARD.replace("cpp_fused_relu_0", "cpp_fused_relu_7")
    assert kernel_keys(other)["cpp_fused_relu_7"] == kernel_keys(FORWARD)["cpp_fused_relu_0"]


def test_the_fit_prices_timed_calls_at_their_time_and_others_by_their_bytes():
    program = Program(FORWARD)
    relu, mm, topk, _, tanh = [c.key for c in calls(program)]
    # a step measured 10 ms, its calls timed: relu twice (1 ms each), the matmul 2, topk 1, tanh 3
    timed = {relu: (2e-3, 2), mm: (2e-3, 1), topk: (1e-3, 1), tanh: (3e-3, 1)}
    model = ProgramTimes.fit([("keep-all", [program], 10e-3, timed)])
    assert model.outside == pytest.approx(10e-3 - 8e-3)
    assert model.step_time([program]) == pytest.approx(10e-3)
    # a program where tanh's kernel is of another source: never timed, priced by the generated kernels' rate
    changed = Program(FORWARD.replace("tanh of 32", "tanh of 32, recomputed"))
    per_call, per_byte = model.rates[True]
    assert model.unseen([changed]) == pytest.approx(1 / 5)
    assert model.step_time([changed]) == pytest.approx(10e-3 - 3e-3 + per_call + per_byte * (128 + 32))


def test_the_rate_of_calls_never_timed_is_fitted_on_those_timed():
    program = Program(FORWARD)
    relu, mm, topk, _, tanh = [c.key for c in calls(program)]
    # generated kernels: relu 256 bytes 1 ms, tanh 160 bytes 0.625 ms: 1/256 ms a byte, nothing a call
    model = ProgramTimes.fit([("p", [program], 9e-3, {relu: (2e-3, 2), mm: (2e-3, 1), topk: (1e-3, 1),
                                                       tanh: (0.625e-3, 1)})])
    per_call, per_byte = model.rates[True]
    assert per_call == pytest.approx(0.0, abs=1e-12)
    assert per_byte == pytest.approx(1e-3 / 256)


@pytest.mark.slow
def test_a_real_compiles_calls_are_all_timed_under_the_keys_its_programs_give():
    from gaswap.compiled.programs import Recorder

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    x = torch.randn(8, 16)

    def step():
        compiled(x).sum().backward()

    with Recorder() as recorder:
        step()
    timed = timed_calls(recorder.programs, lambda: [step() for _ in range(3)])
    read = [c.key for p in recorder.programs for c in calls(p)]
    assert set(timed) == set(read)
    assert all(n == 3 * read.count(key) for key, (_, n) in timed.items())
    assert all(s >= 0 for s, _ in timed.values())
    # the wrappers are gone: the programs run their own callables again
    again = timed_calls(recorder.programs, partial(step))
    assert set(again) == set(read)
