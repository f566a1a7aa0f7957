"""Models for the sharded path: an MLP of square blocks and a Llama-shaped decoder (RoPE, SwiGLU, RMSNorm, grouped
key/value heads), each with the module class FSDP units are made of (`UNIT_CLASS`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    """relu(Linear(width, width)(x))."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


class BlockMLP(nn.Module):
    """`depth` MLPBlocks and a Linear head: [B, width] -> [B, classes]."""

    def __init__(self, width: int = 1024, depth: int = 4, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq: int, theta: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq, head_dim // 2] of rotary position embeddings."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x [B, T, H, D] rotated pairwise (first half, second half) by the tables [T, D/2]."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, self.kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). `fused_silu` False writes silu as x * sigmoid(x): gaswap's capture
    decomposes F.silu's backward (sigmoid, ones, sub, mul...) where eager runs one kernel, so the captured step
    holds more temporaries than eager's at that op; written out, both run the same ops."""

    def __init__(self, dim: int, hidden: int, fused_silu: bool = False):
        super().__init__()
        self.fused_silu = fused_silu
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        h = self.w1(x)
        return self.w2((F.silu(h) if self.fused_silu else h * torch.sigmoid(h)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, eps: float):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim, eps)
        self.feed_forward = FeedForward(dim, ffn)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """A Llama-3-shaped decoder: ids [B, T] -> logits [B, T, vocab]. The RoPE tables are non-persistent buffers."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 ffn: int = 160, seq: int = 32, eps: float = 1e-5, theta: float = 500000.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, kv_heads, ffn, eps) for _ in range(layers))
        self.norm = RMSNorm(dim, eps)
        self.output = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(dim // heads, seq, theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


LLAMA_TINY = dict(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=160, seq=32)
LLAMA3_8B = dict(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, seq=8192)
UNIT_CLASS = {BlockMLP: MLPBlock, Llama: DecoderLayer}


def llama(**config) -> Llama:
    return Llama(**(LLAMA_TINY | config))


def block_mlp(width: int = 1024, depth: int = 4, classes: int = 10) -> BlockMLP:
    return BlockMLP(width, depth, classes)


def mlp_inputs(batch: int = 64, width: int = 1024) -> tuple:
    """Inputs of `block_mlp` (seeded: the same on every rank)."""
    return (torch.randn(batch, width, generator=torch.Generator().manual_seed(1)),)


def llama_inputs(batch: int = 2, seq: int = 32, vocab: int = 256) -> tuple:
    """Token ids for `llama` (seeded: the same on every rank)."""
    return (torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)),)
