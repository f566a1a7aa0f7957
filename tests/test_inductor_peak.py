"""scripts/inductor_peak.py: the memory walk over an inductor wrapper, on a hand-written one."""
import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("inductor_peak", Path(__file__).parents[1] / "scripts" / "inductor_peak.py")
inductor_peak = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(inductor_peak)

WRAPPER = """\
V1124 log prefix [__output_code]     def call(self, args):
V1124 log prefix [__output_code]         saved, tangents = args
        buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
        kernel_0(saved, buf0)
        del tangents
        buf1 = torch.ops.aten.convolution_backward.default(buf0, saved)
        buf2 = buf1[0]
        assert_size_stride(buf2, (2, 8), (8, 1), 'torch.ops.aten.convolution_backward.default')
        del buf1
        buf3 = buf0; del buf0  # reuse
        kernel_1(buf3, buf2)
        del buf2
        del saved
        buf4 = empty_strided_cpu((16, ), (1, ), torch.bool)
        return (buf3, buf4, )
def get_args():
    saved = rand_strided((2, 8), (8, 1), device='cpu', dtype=torch.float32)
    tangents = rand_strided((4, 4), (1, 4), device='cpu', dtype=torch.float32)
def benchmark_compiled_module(args, times=10, repeat=10):
"""


def test_the_walk_counts_inputs_allocations_library_outputs_reuses_and_frees():
    lines = [line.split("[__output_code] ")[-1] for line in WRAPPER.splitlines()]
    peak, alive, inputs = inductor_peak.walk(lines, 0)
    assert inputs == 64 + 64  # saved 2x8 floats, tangents 4x4 floats (strides (1, 4): the same extent)
    assert peak == 64 + 64 + 128  # buf0 made while both inputs are alive; buf2 (64) comes after tangents goes
    assert alive == {"saved": (64, "input"), "tangents": (64, "input"), "buf0": (128, 3)}


def test_the_walk_of_a_strided_view_counts_the_extent_it_spans():
    assert inductor_peak.extent("(2, 3)", "(1, 2)") == 6 and inductor_peak.extent("(2, 3)", "(3, 1)") == 6
    assert inductor_peak.extent("(4, 1, 2)", "(8, 8, 1)") == 26 and inductor_peak.extent("()", "()") == 1
