"""What kind of operator an ATen target is, in one place (torch's `OpTypes` in torch/_functorch/partitioners.py
plays this part for its partitioner). No torch here: targets are strings such as "aten.addmm.default".

The third kind, random and state-mutating ops (never recomputed: recomputing them would change values), is
told apart at capture, where torch's tags and schemas say so, and travels as `Op.recomputable` = False.
"""
from __future__ import annotations

# Ops torch's min-cut partitioner never recomputes (matmuls, convolutions, attention): parts of the op's name.
COMPUTE_INTENSIVE = ("mm", "conv", "scaled_dot_product", "_flash_attention", "_efficient_attention")
# Ops inductor runs as library calls on CPU and CUDA (matmul, convolution, attention families); the rest
# it generates and fuses. Prefixes of the target names.
LIBRARY_CALLS = ("aten.convolution.", "aten.convolution_backward.", "aten.mm.", "aten.addmm.", "aten.bmm.",
                 "aten.baddbmm.", "aten._scaled_dot_product", "aten._flash_attention", "aten._efficient_attention",
                 "aten.randint.", "aten._cudnn_", "aten.mkldnn_", "aten._convolution")
# Generated ops whose result inductor always writes to a buffer (reductions, scatters, concatenations,
# pooling, copies). Prefixes of the target names.
REALIZED = ("aten.sum.", "aten.mean.", "aten.amax.", "aten.amin.", "aten.var_mean.", "aten.var.", "aten.std.",
            "aten.max.", "aten.min.", "aten.argmax.", "aten.argmin.", "aten.prod.", "aten.cumsum.", "aten.logsumexp.",
            "aten.cat.", "aten.scatter", "aten.index_put",
            "aten._unsafe_masked_index_put_accumulate.", "aten.embedding_dense_backward.", "aten.avg_pool",
            "aten.max_pool", "aten.copy_.", "aten.copy.", "aten.clone.")
# Transcendental math: makes a value read more than once worth writing on a CPU. Prefixes of the target names.
HEAVY = ("aten.exp.", "aten.log", "aten.sigmoid.", "aten.tanh.", "aten.pow.", "aten.erf.")


def is_compute_intensive(target: str) -> bool:
    """Whether torch's min-cut partitioner never recomputes an op of this target (matmul, convolution, attention)."""
    name = target.split(".")[1] if target.count(".") >= 2 else target
    return any(part in name for part in COMPUTE_INTENSIVE)


def is_library_call(target: str) -> bool:
    """Whether inductor runs an op of this target as a library call (not generated and fused)."""
    return target.startswith(LIBRARY_CALLS)


def is_realized(target: str) -> bool:
    """Whether inductor always writes a generated op's result to a buffer (never inlines it)."""
    return target.startswith(REALIZED)


def is_heavy(target: str) -> bool:
    """Whether an op is transcendental math (exp, log, sigmoid, tanh, pow, erf)."""
    return target.startswith(HEAVY)

