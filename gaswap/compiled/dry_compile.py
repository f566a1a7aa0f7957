"""Inductor's generated programs for a compiled step without compiling their kernels: a program peak in seconds.

A compile under inductor traces the model (dynamo), partitions its joint graph, lowers each graph to inductor's
IR, schedules and fuses it, writes its program (the wrapper that allocates and frees each buffer, with the
kernels' source) and then loads it, which compiles the kernels (on a CPU, g++). The buffers the program
allocates, and so its peak (`programs.step_peak`), are settled once the wrapper is written. `programs_of` stops
there: inductor writes the wrapper of the forward and, at once, of the backward (AOTAutograd compiles the
backward lazily otherwise), and nothing is loaded: no kernel is compiled and nothing runs. The compile stops
once both are written, before dynamo keeps it for the model, so the model compiles afresh later.

What inductor wrote stays in its caches as a compile writes it (the FX graph cache, where enabled, as it is by
default): a real compile of the same policy afterwards reads both graphs from there and only compiles their
kernels, so the work of a dry compile is not lost on a policy then compiled (tiny CNN: a real compile 6.9 CPU s
cold, 1.4 after a dry one, the same loss and gradients). A graph already in the cache is loaded from it as a
compile would (its kernels, compiled before, are found compiled).

This is inductor itself answering what its scheduler does with a policy (buffer reuse, inlining a recomputed
value into each kernel that reads it, layout copies for library calls), the job the search's hand-written
rules (`step_model.inlined`) only guess at.
"""
from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch
from torch._functorch import config as functorch_config
from torch._inductor.codecache import PyCodeCache
from torch._inductor.graph import GraphLowering

from gaswap.base.errors import GaswapError
from gaswap.compiled import library_calls, methods, partition
from gaswap.compiled.programs import Program, ProgramError, Recorder, step_peak
from gaswap.plan.policy import Policy


class _Written(GaswapError):
    """Raised once the backend has compiled (written) both graphs: nothing more to do."""


class _Unloaded:
    """Stands for a compiled module never loaded (the compile stops before anything runs)."""

    def call(self, args):
        raise _Written()


def programs_of(model, backend: Callable, *example_args) -> list[Program]:
    """The programs (forward, backward) `backend` (an inductor backend: `partition.backend(policy)`,
    `methods.torch_backend(budget)`) writes for `model` on `example_args`, compiled as
    `torch.compile(model, backend=backend, fullgraph=True, dynamic=False)` is, without compiling their kernels
    or running them."""
    stopped = []

    def stop_after(gm, example_inputs):
        backend(gm, example_inputs)
        stopped.append(True)
        raise _Written()

    compiled = torch.compile(model, backend=stop_after, fullgraph=True, dynamic=False)
    with Recorder() as recorder, mock.patch.object(GraphLowering, "compile_to_module", _write_unloaded), \
            functorch_config.patch(force_non_lazy_backward_lowering=True), partition.retraced():
        try:
            compiled(*example_args)
        except Exception as e:  # dynamo wraps the stop (and any failure) in its own errors
            if not stopped:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ProgramError(f"inductor wrote {len(recorder.programs)} of a step's two programs: {first}") from e
    if len(recorder.programs) == 1:
        raise ProgramError("torch.compile made an inference graph (no backward): call it with inputs that need a "
                           "backward pass (parameters requiring grad, grad mode on)")
    if len(recorder.programs) != 2:
        raise ProgramError(f"inductor wrote {len(recorder.programs)} programs for one step, not a forward and a "
                           "backward")
    return recorder.programs


def policy_peak(model, policy: Policy, inputs, output_bytes: int, loss: str) -> int:
    """The step peak above resident (`programs.step_peak`, its library calls' scratch measured:
    `library_calls.scratch`) of `model` compiled under `policy`."""
    return policy_peak_and_partition(model, policy, inputs, output_bytes, loss)[0]


def policy_peak_and_partition(model, policy: Policy, inputs, output_bytes: int, loss: str) -> tuple[int, tuple | None]:
    """`policy_peak`, and the key of the partition written (`PolicyPartitioner.key`: what the forward saves and
    offloads; None where inductor found the graphs in its caches and did not partition)."""
    backend = partition.backend(policy)
    peak = step_peak(programs_of(model, backend, *inputs), output_bytes, loss, library_calls.scratch)
    return peak, backend.partitioner.key()


def torch_peak(model, budget: float, inputs, output_bytes: int, loss: str) -> int:
    """The step peak above resident (as `policy_peak`) of `model` under torch.compile with its partitioner at
    `activation_memory_budget = budget`."""
    return step_peak(programs_of(model, methods.torch_backend(budget), *inputs), output_bytes, loss,
                     library_calls.scratch)


def _write_unloaded(graph: GraphLowering) -> _Unloaded:
    """`GraphLowering.compile_to_module` up to the load: the program written (and handed to a `Recorder`), its
    file stored where inductor's caches find it, nothing loaded."""
    wrapper = graph.codegen_with_cpp_wrapper()[0] if graph.cpp_wrapper else graph.codegen()[0]
    if GraphLowering.save_output_code is not None:
        GraphLowering.save_output_code(wrapper.value)
    graph.cache_key, graph.cache_path = PyCodeCache.write(wrapper.value)
    graph.cache_linemap = [(line, node.stack_trace) for line, node in wrapper.line_map]
    return _Unloaded()
