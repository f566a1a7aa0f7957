"""Repeated structure: identical blocks (transformer layers, residual stages) and one policy shared by them.
No torch here.

A block is the ops of one numbered module: the layer path up to its first numeric part (`blocks.3.attn.qkv`
is in block `blocks.3`, `layer2.1.conv1` in `layer2.1`), forward and backward ops alike. Blocks whose ops
match one by one (target, cost signature with shapes, phase, layer path inside the block, recomputability)
and whose candidate activations match one by one (allowed actions included) form a class: position p of
one block stands for position p of every other. Blocks of fewer than MIN_BLOCK_OPS ops (forward and
backward) are not structure worth a shared policy and form no class.

`share(c, classes, rng)` copies the genes (order keys and actions) of one block, drawn at random, to every
block of its class: a chromosome of the full format whose blocks all follow one block policy. The search
applies it to a fraction of its children (`space.share_blocks`), so the population mixes tied individuals
(searched in the space of one policy per block class, as short as the chromosome divided by the repeats)
with untied ones that vary per block where that pays.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from gaswap.plan.encoding import Chromosome, Encoding

MIN_BLOCK_OPS = 4  # a repeated block is more than one op and its backward (AlexNet's lone ReLUs
# `features.9` and `features.11` look alike; tying them made alexnet_5gb_reserved converge at +33.8 %, not +5.1 %)


@dataclass(frozen=True)
class BlockClass:
    """Identical blocks: per block, its op indices and its candidate indices, both by position."""

    names: tuple[str, ...]
    ops: tuple[tuple[int, ...], ...]
    candidates: tuple[tuple[int, ...], ...]


def block_of(layer: str) -> str | None:
    """The block a layer path belongs to: the path up to its first numeric part; None outside any."""
    parts = layer.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def repeated_blocks(encoding: Encoding) -> list[BlockClass]:
    """The classes of at least two identical blocks in `encoding`'s graph, in captured order."""
    graph = encoding.graph
    ops: dict[str, list[int]] = {}
    for i, op in enumerate(graph.ops):
        name = block_of(op.layer)
        if name is not None:
            ops.setdefault(name, []).append(i)
    position = {i: (name, p) for name, members in ops.items() for p, i in enumerate(members)}
    producer = {t: i for i, op in enumerate(graph.ops) for t in op.outputs}
    candidates: dict[str, list[tuple[tuple[int, int], int]]] = {}
    for k, t in enumerate(encoding.candidates):
        i = producer.get(t)
        if i in position:
            name, p = position[i]
            candidates.setdefault(name, []).append(((p, graph.ops[i].outputs.index(t)), k))
    classes: dict[tuple, list[str]] = {}
    for name, members in ops.items():
        prefix = len(name)
        signature = tuple((graph.ops[i].target, graph.ops[i].signature, graph.ops[i].phase,
                           graph.ops[i].layer[prefix:], graph.ops[i].recomputable) for i in members)
        slots = sorted(candidates.get(name, []))
        signature += tuple((slot, encoding.allowed[k]) for slot, k in slots)
        classes.setdefault(signature, []).append(name)
    result = []
    for names in classes.values():
        if len(names) > 1 and len(ops[names[0]]) >= MIN_BLOCK_OPS:
            result.append(BlockClass(tuple(names), tuple(tuple(ops[n]) for n in names),
                                     tuple(tuple(k for _, k in sorted(candidates.get(n, []))) for n in names)))
    return result


def share(c: Chromosome, classes: list[BlockClass], rng: random.Random, *, order: bool = True) -> Chromosome:
    """`c` with, in each class, one block's genes (drawn at random) copied to every block of the class: its
    actions, and its order keys when `order` (a space that keeps the captured order keeps its keys)."""
    if not classes:
        return c
    keys, actions = list(c.keys), list(c.actions)
    for cls in classes:
        source = rng.randrange(len(cls.ops))
        for ops, cands in zip(cls.ops, cls.candidates):
            if order:
                for i, j in zip(ops, cls.ops[source]):
                    keys[i] = c.keys[j]
            for k, j in zip(cands, cls.candidates[source]):
                actions[k] = c.actions[j]
    return Chromosome(tuple(keys), tuple(actions))


def tied(c: Chromosome, classes: list[BlockClass], *, order: bool = True) -> bool:
    """Whether every block of each class has the same genes in `c` (actions, and keys when `order`)."""
    return all(len({tuple(c.keys[i] for i in ops if order) + tuple(c.actions[k] for k in cands)
                    for ops, cands in zip(cls.ops, cls.candidates)}) == 1 for cls in classes)
