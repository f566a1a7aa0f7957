"""Inductor's generated programs for a compiled step without compiling their kernels: a program peak in seconds.

A compile under inductor traces the model (dynamo), partitions its joint graph, lowers each graph to inductor's
IR, schedules and fuses it, writes its program (the wrapper that allocates and frees each buffer, with the
kernels' source) and then compiles the kernels (on a CPU, g++: most of a compile's 3 to 220 s here). The
buffers the program allocates, and so its peak (`programs.step_peak`), are settled once the wrapper is written.
`programs_of` stops there: it writes the wrapper of the forward and, at once, of the backward (AOTAutograd
compiles the backward lazily otherwise), hands back their text, and loads nothing. No kernel is compiled and
nothing runs; inductor's caches are neither read nor written (a cached artifact has no wrapper to read), and
dynamo keeps no compiled entry for the model.

This is inductor itself answering what its scheduler does with a policy (buffer reuse, inlining a recomputed
value into each kernel that reads it, layout copies for library calls), the job the search's hand-written
rules (`step_model.inlined`) only guess at.
"""
from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.graph import GraphLowering

from gaswap.base.errors import GaswapError
from gaswap.compiled import methods, partition
from gaswap.compiled.programs import Program, ProgramError, step_peak
from gaswap.plan.policy import Policy


class _Written(GaswapError):
    """Raised once the backward's program is written: nothing more to do."""


class _Unloaded:
    """Stands for the forward's compiled module, which is never loaded (the backward's write stops the compile)."""

    def call(self, args):
        raise _Written()


def programs_of(compiled: Callable, *example_args) -> list[Program]:
    """The programs (forward, backward) inductor writes for `compiled` (a torch.compile of a step or model with
    an inductor backend: `partition.compile(model, policy)`, `methods.torch_compiled(model, budget)`) on
    `example_args`, without compiling or running them."""
    written: list[Program] = []

    def write(graph: GraphLowering):
        wrapper = graph.codegen_with_cpp_wrapper()[0] if graph.cpp_wrapper else graph.codegen()[0]
        written.append(Program(wrapper.value))
        if len(written) == 2:
            raise _Written()
        return _Unloaded()

    with mock.patch.object(GraphLowering, "compile_to_module", write), \
            functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False), \
            inductor_config.patch(fx_graph_cache=False):
        try:
            compiled(*example_args)
        except Exception as e:  # noqa: BLE001 - dynamo wraps the stop (and any failure) in its own errors
            if len(written) == 1 and isinstance(e, _Written):
                raise ProgramError("torch.compile made an inference graph (no backward): call it with inputs that "
                                   "need a backward pass (parameters requiring grad, grad mode on)") from None
            if len(written) < 2:
                raise ProgramError(f"inductor wrote {len(written)} of a step's two programs: "
                                   f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
    if len(written) != 2:
        raise ProgramError(f"inductor wrote {len(written)} programs for one step, not a forward and a backward")
    return written


def policy_peak(model, policy: Policy, inputs, output_bytes: int, loss: str) -> int:
    """The step peak above resident (`programs.step_peak`) of `model` compiled under `policy`."""
    return step_peak(programs_of(partition.compile(model, policy), *inputs), output_bytes, loss)


def torch_peak(model, budget: float, inputs, output_bytes: int, loss: str) -> int:
    """The step peak above resident of `model` under torch.compile with its partitioner at
    `activation_memory_budget = budget`."""
    return step_peak(programs_of(methods.torch_compiled(model, budget), *inputs), output_bytes, loss)

