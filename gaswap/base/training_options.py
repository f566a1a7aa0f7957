"""The options of a training step, for every module that names them: losses, optimizers, autocast dtypes, the
persistent memory a budget may count, and the defaults an experiment file, `capture` and the runtime share.
No torch here, no gaswap imports.
"""
from __future__ import annotations

LOSSES = ("cross_entropy", "mse", "sum", "external")  # external: computed outside the step (gaswap.apply)
NO_TARGET = ("sum", "external")  # losses that take no target
# optimizer -> the state it keeps, in multiples of the parameters' bytes (momentum: one buffer; Adam: two)
OPTIMIZER_STATE = {"sgd": 0, "sgd_momentum": 1, "adam": 2}
OPTIMIZERS = tuple(OPTIMIZER_STATE)
# optimizer -> memory traffic of one step on the host (torch's foreach CPU kernels), in bytes per parameter byte:
# what a sharded plan's CPU offload pays at the profile's host_memory_bandwidth. Measured with
# scripts/host_optimizer.py (torch 2.13, one thread, CPU time against a copy of the same bytes; medians of 7)
HOST_STEP_TRAFFIC = {"sgd": 2.2, "sgd_momentum": 5.2, "adam": 14.8}
AUTOCAST = ("bfloat16", "float16")  # mixed-precision dtypes of the forward pass and the loss
DEFAULT_LOSS = "sum"  # needs no target
DEFAULT_OPTIMIZER = "sgd"  # keeps no state
# Persistent categories a budget may count. Activations, inputs and buffers always count.
COUNTABLE = ("parameters", "gradients", "optimizer_state")
