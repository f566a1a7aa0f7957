"""Dropout masks in a captured step drawn as eager PyTorch draws them, whatever the layout of the input.

Eager CPU dropout is `noise = empty_like(x).bernoulli_(1 - p); x * noise.div_(1 - p)`: the noise has
x's strides, and bernoulli may fill it in memory order (it does on this project's AMD CPUs, where MKL's
generator is not used). Functionalization traces it as `bernoulli.p(empty([]).expand(shape))`, whose
noise is contiguous: for a non-contiguous x (a residual dropout after attention's transposed output) the
mask then differs from eager's. `eager_masks` rewrites those draws into `gaswap::bernoulli_strided`, one op that
draws into a tensor laid out as eager's noise, so loss and gradients equal eager's bit for bit.
"""
from __future__ import annotations

import torch
from torch import fx

torch.library.define(
    "gaswap::bernoulli_strided",
    "(SymInt[] size, SymInt[] stride, float p, *, ScalarType dtype, Device device) -> Tensor",
    tags=(torch.Tag.nondeterministic_seeded,),
)


@torch.library.impl("gaswap::bernoulli_strided", "CompositeExplicitAutograd")
def _bernoulli_strided(size, stride, p, *, dtype, device):
    return torch.empty_strided(size, stride, dtype=dtype, device=device).bernoulli_(p)


@torch.library.register_fake("gaswap::bernoulli_strided")
def _bernoulli_strided_fake(size, stride, p, *, dtype, device):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


BERNOULLI_STRIDED = torch.ops.gaswap.bernoulli_strided.default


def eager_masks(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, or a copy of it where each traced dropout draw whose eager noise would not be contiguous (see
    the module docstring) is one `gaswap::bernoulli_strided` node of the same name (policies name ops)."""
    strides = {node: stride for node in gm.graph.nodes if (stride := _eager_noise_stride(node)) is not None}
    if not strides:
        return gm
    dropped = {node.args[0] for node in strides if set(node.args[0].users) <= strides.keys()}  # the expands
    dropped |= {e.args[0] for e in dropped if set(e.args[0].users) <= dropped}  # and their empty([])
    g, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node in dropped:
            continue
        if node not in strides:
            env[node] = g.node_copy(node, env.__getitem__)
            continue
        noise = node.meta["val"]
        with noise.fake_mode:
            val = torch.empty_strided(noise.shape, strides[node], dtype=noise.dtype, device=noise.device)
        env[node] = g.create_node("call_function", BERNOULLI_STRIDED,
                                  (list(noise.shape), list(strides[node]), node.args[1]),
                                  {"dtype": noise.dtype, "device": noise.device}, name=node.name)
        env[node].meta = {k: v for k, v in node.meta.items() if k != "tensor_meta"} | {"val": val}
    return fx.GraphModule(gm, g)


def _eager_noise_stride(node: fx.Node) -> tuple[int, ...] | None:
    """The strides of eager's noise for a traced `bernoulli.p(empty([]).expand(shape), q)` followed by
    `div(., q)` and `mul(x, .)` (the first of the muls: the backward pass multiplies the gradient by the
    same mask later): those of `empty_like(x)`; None for another node or a contiguous noise."""
    if node.target is not torch.ops.aten.bernoulli.p:
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.target is torch.ops.aten.expand.default
            and getattr(expand.args[0], "target", None) is torch.ops.aten.empty.memory_format):
        return None
    divs = [u for u in node.users if u.target is torch.ops.aten.div.Scalar]
    muls = [u for d in divs for u in d.users if u.target is torch.ops.aten.mul.Tensor]
    if len(divs) != 1 or not muls:
        return None
    (div,), mul = divs, muls[0]  # users are in the order they were traced
    x = next(a for a in mul.args if a is not div)
    like = x.meta.get("val") if isinstance(x, fx.Node) else None
    noise = node.meta["val"]
    if not isinstance(like, torch.Tensor) or like.shape != noise.shape:
        return None
    stride = torch.empty_like(torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")).stride()
    return None if stride == noise.stride() else tuple(stride)

