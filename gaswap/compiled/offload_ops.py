"""Which activation offloading this torch has for compiled graphs: the one place the compiled path asks.

torch 2.13 offloads a saved value with asynchronous ops (`torch.ops.ao.offload` / `reload` / `wait_tensor`,
registered by `torch._functorch._activation_offloading.offload_ops`), which inductor runs on a side stream:
the compiled path's swaps on CUDA use them. torch 2.11 (the GPU machine's) lacks them: its offloading on a side
stream is built of `torch.ops.streams` fork / join / record_stream ops whose streams and events live in dynamo's
registry of objects a traced program created, which gaswap's partitioner, called inside AOT autograd, does not
trace through; untried on a GPU, so it is refused rather than guessed at. On a CPU both versions copy
synchronously (`prims.device_put`), which needs none of this.
"""
from __future__ import annotations

import importlib

import torch

from gaswap.base.errors import Refusal

ASYNC_OPS = ("offload", "reload", "wait_tensor")


class CompiledSwapRefused(Refusal, ValueError):
    """A compiled step on CUDA swaps a tensor, and this torch has no asynchronous activation offloading."""


def has_async_offload() -> bool:
    """Whether this torch has `torch.ops.ao.offload`, `reload` and `wait_tensor` (torch 2.13 has them)."""
    try:
        importlib.import_module("torch._functorch._activation_offloading.offload_ops")
    except ImportError:
        return False
    return all(hasattr(torch.ops.ao, op) for op in ASYNC_OPS)


def offload_path(cuda: bool) -> str:
    """How a compiled step's swaps run here: "async" (torch.ops.ao on a side stream), "sync" (the CPU's
    device_put), or "refused" (CUDA without the async ops)."""
    if not cuda:
        return "sync"
    return "async" if has_async_offload() else "refused"


def require_offload(cuda: bool, name: str) -> None:
    """Refuse, in one line, a compiled step on CUDA that swaps `name` where this torch cannot offload it."""
    if offload_path(cuda) == "refused":
        raise CompiledSwapRefused(
            f"the policy swaps {name} in a compiled step on CUDA, which needs torch's asynchronous activation "
            f"offloading (torch.ops.ao.offload/reload, torch >= 2.13); this is torch {torch.__version__}: upgrade "
            f"torch, run the policy eagerly (gaswap.apply), or search the compiled step with `actions: [keep, "
            f"recompute]`")
