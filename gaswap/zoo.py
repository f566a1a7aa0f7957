"""A small built-in model zoo (torch.nn only) and `resolve` for "module:callable" model paths.

CNNs (alexnet, vgg16, resnet18/50, tiny_cnn, unet, a depthwise-separable separable_cnn), an mlp, an unrolled
gru, a shifted-window attention net (window_attention), a top-k mixture of experts (mixture), a net of
normalisation variants (norm_mix), transformers (gpt, bert, a vision transformer vit) and, for sharded runs, a Llama-3-shaped decoder (llama) and an MLP of square blocks (block_mlp). Factories from
installed packages are named by path, e.g. "torchvision.models:resnet50"; `huggingface` builds a
transformers model from its class name and config.
"""
from __future__ import annotations

import importlib
import inspect
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from gaswap.base.locate import import_module


def alexnet(num_classes: int = 1000) -> nn.Module:
    """AlexNet with torchvision's layout (features / avgpool / classifier)."""
    return _Classifier(
        nn.Sequential(
            nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        ),
        nn.AdaptiveAvgPool2d((6, 6)),
        nn.Sequential(
            nn.Dropout(0.5), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
            nn.Dropout(0.5), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        ),
    )


def vgg16(num_classes: int = 1000) -> nn.Module:
    """VGG-16 (configuration D, no batch norm) with torchvision's layout."""
    layers: list[nn.Module] = []
    channels = 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
            channels = v
    return _Classifier(
        nn.Sequential(*layers),
        nn.AdaptiveAvgPool2d((7, 7)),
        nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(4096, num_classes),
        ),
    )


class _Classifier(nn.Module):
    """features -> avgpool -> flatten -> classifier (the AlexNet / VGG skeleton)."""

    def __init__(self, features: nn.Module, avgpool: nn.Module, classifier: nn.Module):
        super().__init__()
        self.features, self.avgpool, self.classifier = features, avgpool, classifier

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))


class _BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.downsample is None else self.downsample(x)
        return self.relu(out + skip)


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        skip = x if self.downsample is None else self.downsample(x)
        return self.relu(out + skip)


class _ResNet(nn.Module):
    """torchvision's ResNet layout: conv1/bn1/relu/maxpool, layer1..layer4, avgpool, fc."""

    def __init__(self, block, depths: tuple[int, ...], num_classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, (width, depth) in enumerate(zip((64, 128, 256, 512), depths)):
            blocks = []
            for j in range(depth):
                blocks.append(block(cin, width, 2 if i > 0 and j == 0 else 1))
                cin = width * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> nn.Module:
    return _ResNet(_BasicBlock, (2, 2, 2, 2), num_classes)


def resnet50(num_classes: int = 1000) -> nn.Module:
    return _ResNet(_Bottleneck, (3, 4, 6, 3), num_classes)


def mlp(sizes: tuple[int, ...] = (32, 64, 64, 10), dropout: float = 0.0) -> nn.Module:
    """Linear layers of the given widths with ReLU (and optional dropout) between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class _TinyCNN(nn.Module):
    def __init__(self, num_classes: int, width: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(0.1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.stem(x)
        x = self.relu(self.block(x) + x)
        return self.fc(self.dropout(torch.flatten(self.pool(x), 1)))


def tiny_cnn(num_classes: int = 10, width: int = 8) -> nn.Module:
    """conv-BN-ReLU stem, one residual conv-BN block, pooling, dropout and a linear head."""
    return _TinyCNN(num_classes, width)


class _Attention(nn.Module):
    """Multi-head self-attention written out (scores, softmax, dropout), as eager GPT-2 and BERT compute it.

    Masked scores get the dtype's most negative value rather than -inf, so that a row with every key
    masked (a sequence of padding only) gives a uniform softmax instead of NaN, in fp16 and bf16 as well.
    The causal mask is built from the sequence length in `forward`, not kept in a buffer, so that a model
    built on the meta device and materialized with `to_empty` needs no re-initialization.
    """

    def __init__(self, width: int, heads: int, dropout: float, causal: bool):
        super().__init__()
        if width % heads:
            raise ValueError(f"attention width {width} is not divisible by {heads} heads")
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(width, 3 * width)
        self.drop = nn.Dropout(dropout)
        self.proj = nn.Linear(width, width)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x, padding=None):
        """x [B, T, width]; padding [B, T], nonzero or True where there is a token (None: no padding)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        masked = torch.finfo(att.dtype).min
        if self.causal:
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), masked)
        if padding is not None:
            att = att.masked_fill(~padding.bool()[:, None, None, :], masked)
        att = self.drop(att.softmax(-1))
        return self.resid_drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, c)))


class _Block(nn.Module):
    """A transformer layer: pre-norm (GPT-2: x + f(ln(x))) or post-norm (BERT: ln(x + f(x)))."""

    def __init__(self, width: int, heads: int, dropout: float, causal: bool, pre_norm: bool):
        super().__init__()
        self.pre_norm = pre_norm
        self.ln1 = nn.LayerNorm(width)
        self.attn = _Attention(width, heads, dropout, causal)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x, padding=None):
        if self.pre_norm:
            x = x + self.attn(self.ln1(x), padding)
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x, padding))
        return self.ln2(x + self.mlp(x))


class _TiedHead(nn.Module):
    """Logits against the token embedding matrix, passed in at call time.

    Weight tying with one Parameter (the embedding's) rather than two names for it: nothing can untie
    it, whereas `head.weight = tok.weight` comes apart under `to_empty` after a meta-device build.
    """

    def __init__(self, vocab: int, bias: bool):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab)) if bias else None

    def forward(self, x, weight):
        return F.linear(x, weight, self.bias)


class _Embeddings(nn.Module):
    """Token plus learned position embeddings, [B, T] ids -> [B, T, width]."""

    def __init__(self, vocab: int, width: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)

    def forward(self, ids):
        if ids.shape[1] > self.pos.num_embeddings:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds the model's seq {self.pos.num_embeddings}")
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class _GPT(nn.Module):
    def __init__(self, vocab: int, layers: int, width: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.embed = _Embeddings(vocab, width, seq)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(GPTBlock(width, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = _TiedHead(vocab, bias=False)

    def forward(self, ids):
        x = self.blocks(self.drop(self.embed(ids)))
        return self.head(self.ln(x), self.embed.tok.weight)


def gpt(vocab: int = 1000, layers: int = 2, width: int = 64, heads: int = 4, seq: int = 32,
        dropout: float = 0.0) -> nn.Module:
    """GPT-2's decoder-only transformer (pre-norm, causal, LM head tied to the token embedding):
    forward(ids [B, T]) -> logits [B, T, vocab], T <= seq. GPT-2 small is gpt(50257, 12, 768, 12, 1024)."""
    return _GPT(vocab, layers, width, heads, seq, dropout)


class _BERT(nn.Module):
    def __init__(self, vocab: int, layers: int, width: int, heads: int, seq: int, num_labels: int | None,
                 dropout: float):
        super().__init__()
        self.embed = _Embeddings(vocab, width, seq)
        self.ln = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(width, heads, dropout, causal=False, pre_norm=False) for _ in range(layers))
        self.mlm = num_labels is None
        if self.mlm:
            self.transform = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
            self.head = _TiedHead(vocab, bias=True)
        else:
            self.head = nn.Linear(width, num_labels)

    def forward(self, ids, attention_mask=None):
        x = self.drop(self.ln(self.embed(ids)))
        for block in self.blocks:
            x = block(x, attention_mask)
        if self.mlm:
            return self.head(self.transform(x), self.embed.tok.weight)
        return self.head(x)


def bert(vocab: int = 1000, layers: int = 2, width: int = 64, heads: int = 4, seq: int = 32,
         num_labels: int | None = None, dropout: float = 0.1) -> nn.Module:
    """A BERT encoder (post-norm, bidirectional, padding mask in attention):
    forward(ids [B, T], attention_mask [B, T] or None) -> masked-LM logits [B, T, vocab] (decoder tied to
    the token embedding), or per-token logits [B, T, num_labels] when num_labels is given. Nonzero or
    True in attention_mask marks tokens, 0 or False padding. BERT-base is bert(30522, 12, 768, 12, 512);
    no token-type embeddings and no pooler (1,536 parameters fewer than Hugging Face's BertForMaskedLM)."""
    return _BERT(vocab, layers, width, heads, seq, num_labels, dropout)


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    """Two conv3x3-BatchNorm-ReLU, the unit of every U-Net level."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class _UNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, width: int, depth: int):
        super().__init__()
        channels = [width * 2**i for i in range(depth + 1)]
        self.levels = depth
        self.down = nn.ModuleList(_double_conv(a, b) for a, b in zip([in_channels, *channels], channels))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(nn.ConvTranspose2d(2 * c, c, 2, stride=2) for c in channels[:-1])
        self.merge = nn.ModuleList(_double_conv(2 * c, c) for c in channels[:-1])
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, x):
        if x.shape[-2] % 2**self.levels or x.shape[-1] % 2**self.levels:
            raise ValueError(f"U-Net of depth {self.levels}: height and width must be multiples of "
                             f"{2**self.levels}, got {tuple(x.shape[-2:])}")
        skips = []
        for down in self.down[:-1]:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.down[-1](x)
        for up, merge, skip in zip(reversed(self.up), reversed(self.merge), reversed(skips)):
            x = merge(torch.cat([skip, up(x)], 1))
        return self.head(x)


def unet(in_channels: int = 3, num_classes: int = 2, width: int = 64, depth: int = 4) -> nn.Module:
    """U-Net (Ronneberger et al., with padding and BatchNorm): `depth` poolings, channels doubling from
    `width`, up-convolutions (ConvTranspose2d 2x2) and skip connections by concatenation:
    forward(x [B, in_channels, H, W]) -> per-pixel logits [B, num_classes, H, W]; H, W multiples of 2**depth."""
    return _UNet(in_channels, num_classes, width, depth)


# --- small models for the compiled head to head (gaswap compare): concatenation-heavy, unrolled recurrent ---

class _DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, 4 * growth, 1, bias=False),
                                  nn.BatchNorm2d(4 * growth), nn.ReLU(), nn.Conv2d(4 * growth, growth, 3, padding=1,
                                                                                  bias=False))

    def forward(self, x):
        return torch.cat([x, self.body(x)], 1)


def densenet(num_classes: int = 10, growth: int = 12, layers: int = 6, blocks: int = 2) -> nn.Module:
    """A small DenseNet-BC: `blocks` dense blocks of `layers` BN-ReLU-conv1x1-BN-ReLU-conv3x3 layers, each
    concatenating its `growth` new channels to its input; 1x1 conv + average-pool transitions halve the map."""
    width = 2 * growth
    parts: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1, bias=False)]
    for b in range(blocks):
        for _ in range(layers):
            parts.append(_DenseLayer(width, growth))
            width += growth
        if b < blocks - 1:
            parts += [nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, width // 2, 1, bias=False), nn.AvgPool2d(2)]
            width //= 2
    parts += [nn.BatchNorm2d(width), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)]
    return nn.Sequential(*parts)


class _UnrolledGRU(nn.Module):
    def __init__(self, vocab: int, width: int, steps: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.cell = nn.GRUCell(width, width)
        self.head = nn.Linear(width, vocab)
        self.steps = steps

    def forward(self, ids):  # [B, T] -> logits [B, T, vocab]; the cell unrolled over the T steps
        x = self.embed(ids)
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        outputs = []
        for t in range(self.steps):
            h = self.cell(x[:, t], h)
            outputs.append(h)
        return self.head(torch.stack(outputs, 1))


def gru(vocab: int = 256, width: int = 128, steps: int = 24) -> nn.Module:
    """A GRU language model with its cell unrolled over `steps` time steps (many small ops): forward(ids
    [B, steps]) -> logits [B, steps, vocab]."""
    return _UnrolledGRU(vocab, width, steps)



# --- models that differ in kind, for the compiled model's errors on unseen models (scripts/compiled_model_errors.py):
# depthwise and grouped convolutions, windowed attention with a shift mask, a top-k mixture, normalisation mixes ---

class _SeparableBlock(nn.Module):
    def __init__(self, width: int, groups: int):
        super().__init__()
        self.depthwise = nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.grouped = nn.Conv2d(width, 2 * width, 3, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pointwise = nn.Conv2d(2 * width, width, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)

    def forward(self, x):
        y = F.relu6(self.bn1(self.depthwise(x)))
        y = F.hardswish(self.bn2(self.grouped(y)))
        return F.relu(x + self.bn3(self.pointwise(y)))


def separable_cnn(num_classes: int = 10, width: int = 32, blocks: int = 3, groups: int = 4) -> nn.Module:
    """A depthwise-separable CNN: a conv-BN-ReLU stem, `blocks` residual blocks of depthwise 3x3 (ReLU6),
    grouped 3x3 (`groups` groups, hardswish) and pointwise 1x1 convolutions, a strided depthwise downsample
    after the first, pooling and a linear head."""
    parts: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    for b in range(blocks):
        parts.append(_SeparableBlock(width, groups))
        if b == 0:
            parts += [nn.Conv2d(width, width, 3, stride=2, padding=1, groups=width, bias=False), nn.BatchNorm2d(width)]
    parts += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)]
    return nn.Sequential(*parts)


class _WindowBlock(nn.Module):
    """Attention inside `window` x `window` windows of a [B, H, W, C] map, the windows shifted by half a window
    (`shift`) with the mask that keeps the wrapped-around tokens apart, then an MLP; both pre-norm."""

    def __init__(self, width: int, heads: int, window: int, shift: bool):
        super().__init__()
        self.heads, self.window, self.shift = heads, window, window // 2 if shift else 0
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.bias = nn.Parameter(torch.zeros(heads, window * window, window * window))
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def _windows(self, x):  # [B, H, W, C] -> [B * windows, window * window, C]
        b, h, w, c = x.shape
        s = self.window
        return x.view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)

    def _mask(self, h: int, w: int, device):  # [windows, s*s, s*s]: True where two tokens came from apart
        def bands(n: int):  # 0, 1, 2: the rows (columns) before the last window, in it before the shift, after
            at = torch.arange(n, device=device)
            return (at >= n - self.window).long() + (at >= n - self.shift).long()
        region = (bands(h)[:, None] * 3 + bands(w)[None, :]) if self.shift else torch.zeros(h, w, device=device)
        ids = self._windows(region[None, :, :, None].float()).squeeze(-1)
        return ids[:, :, None] != ids[:, None, :]

    def forward(self, x):
        b, h, w, c = x.shape
        y = torch.roll(self.ln1(x), (-self.shift, -self.shift), (1, 2)) if self.shift else self.ln1(x)
        q, k, v = self.qkv(self._windows(y)).view(-1, self.window ** 2, 3, self.heads, c // self.heads
                                                   ).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads) + self.bias
        mask = self._mask(h, w, x.device).repeat(b, 1, 1)[:, None]
        att = att.masked_fill(mask, torch.finfo(att.dtype).min).softmax(-1)
        y = self.proj((att @ v).transpose(1, 2).reshape(-1, self.window ** 2, c))
        s = self.window
        y = y.view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        x = x + (torch.roll(y, (self.shift, self.shift), (1, 2)) if self.shift else y)
        return x + self.mlp(self.ln2(x))


class _WindowNet(nn.Module):
    def __init__(self, image: int, patch: int, width: int, heads: int, window: int, layers: int, classes: int):
        super().__init__()
        self.embed = nn.Conv2d(3, width, patch, stride=patch)
        self.blocks = nn.ModuleList(_WindowBlock(width, heads, window, k % 2 == 1) for k in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, images):
        x = self.embed(images).permute(0, 2, 3, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean((1, 2)))


def window_attention(image: int = 32, patch: int = 2, width: int = 48, heads: int = 3, window: int = 4,
                     layers: int = 2, classes: int = 10) -> nn.Module:
    """A shifted-window attention net (Swin-like): patches embedded by a strided convolution, `layers` blocks
    alternating plain and shifted `window` x `window` windows (a learned bias per head and a mask on the
    shifted ones), mean pooling and a linear head: images [B, 3, image, image] -> logits [B, classes]."""
    return _WindowNet(image, patch, width, heads, window, layers, classes)


class _TopKMixture(nn.Module):
    """A gated mixture of `experts` MLPs, each token sent to its `k` best (softmax gates over the chosen,
    renormalised); computed densely (every expert on every token, weighted by a gate that is 0 where the
    token was not sent), so that the graph is static."""

    def __init__(self, width: int, experts: int, k: int):
        super().__init__()
        self.k = k
        self.router = nn.Linear(width, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, width, 2 * width) / math.sqrt(width))
        self.down = nn.Parameter(torch.randn(experts, 2 * width, width) / math.sqrt(2 * width))

    def forward(self, x):  # [N, width]
        top, chosen = self.router(x).topk(self.k, -1)
        gates = torch.zeros(x.shape[0], self.up.shape[0], device=x.device, dtype=x.dtype)
        gates = gates.scatter(1, chosen, top.softmax(-1))  # [N, experts]
        hidden = F.silu(torch.einsum("nd,edh->enh", x, self.up))
        return torch.einsum("enh,ehd,ne->nd", hidden, self.down, gates)


class _MixtureNet(nn.Module):
    def __init__(self, vocab: int, width: int, experts: int, k: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.mixtures = nn.ModuleList(_TopKMixture(width, experts, k) for _ in range(layers))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        b, t, c = x.shape
        x = x.view(b * t, c)
        for norm, mixture in zip(self.norms, self.mixtures):
            x = x + self.drop(mixture(norm(x)))
        return self.head(x).view(b, t, -1)


def mixture(vocab: int = 256, width: int = 64, experts: int = 4, k: int = 2, layers: int = 2) -> nn.Module:
    """A token model of `layers` top-`k` gated mixtures of `experts` MLPs (pre-norm, residual, dropout): ids
    [B, T] -> logits [B, T, vocab]."""
    return _MixtureNet(vocab, width, experts, k, layers)


class _NormMix(nn.Module):
    def __init__(self, width: int, groups: int, classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(groups, width)
        self.conv3 = nn.Conv2d(width, width, 3, padding=1)
        self.inorm = nn.InstanceNorm2d(width, affine=True)
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.rms = RMSNorm(2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        x = F.silu(self.gn(self.conv2(x)))
        x = x + F.gelu(self.inorm(self.conv3(x)))
        t = x.flatten(2).transpose(1, 2)  # [B, tokens, width]
        t = t + self.fc2(F.gelu(self.rms(self.fc1(self.ln(t)))))
        return self.head(t.mean(1))


def norm_mix(width: int = 32, groups: int = 4, classes: int = 10) -> nn.Module:
    """A net of normalisation variants: conv-BatchNorm-ReLU, strided conv-GroupNorm-SiLU, a residual
    conv-InstanceNorm-GELU, then tokens through LayerNorm, an MLP with RMSNorm inside, mean pooling and a head."""
    return _NormMix(width, groups, classes)

# --- sharded-run models: an MLP of square blocks and a Llama-3-shaped decoder (RoPE, SwiGLU, RMSNorm, grouped
# key/value heads), each with the module class its FSDP units are made of (`UNIT_CLASS`) ---


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
    """A Llama-3-shaped decoder: LLAMA_TINY's sizes unless given (`llama(**LLAMA3_8B)` is Llama-3-8B's shape;
    `preset="8b"` starts from it instead). Its FSDP units are the `DecoderLayer`s."""
    preset = config.pop("preset", "tiny")
    if preset not in ("tiny", "8b"):
        raise ValueError(f"llama: preset {preset!r} is not 'tiny' or '8b'")
    return Llama(**((LLAMA3_8B if preset == "8b" else LLAMA_TINY) | config))


def block_mlp(width: int = 1024, depth: int = 4, classes: int = 10) -> BlockMLP:
    """`depth` square `MLPBlock`s (the FSDP units) and a Linear head: [B, width] -> [B, classes]."""
    return BlockMLP(width, depth, classes)


def mlp_inputs(batch: int = 64, width: int = 1024) -> tuple:
    """Inputs of `block_mlp` (seeded: the same on every rank)."""
    return (torch.randn(batch, width, generator=torch.Generator().manual_seed(1)),)


def llama_inputs(batch: int = 2, seq: int = 32, vocab: int = 256) -> tuple:
    """Token ids for `llama` (seeded: the same on every rank)."""
    return (torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)),)


def huggingface(architecture: str, **config) -> nn.Module:
    """A Hugging Face transformers model with fresh weights: `architecture` names its class (e.g.
    "GPT2LMHeadModel", "BertForMaskedLM"), the other arguments its config (e.g. n_layer=2; add
    attn_implementation="eager" for attention written out rather than fused). Needs `transformers`;
    the model returns a ModelOutput, whose logits `capture` reads."""
    model_class = getattr(importlib.import_module("transformers"), str(architecture), None)
    if not (inspect.isclass(model_class) and issubclass(model_class, nn.Module) and hasattr(model_class, "config_class")):
        raise ValueError(f"huggingface: {architecture!r} is not a transformers model class")
    return model_class(model_class.config_class(**config))


# Packages whose functions load or run things (pickles, hub code, shell commands) rather than build a model:
# a factory may not be one of them, whatever it is called. Python's standard library is refused as a whole.
NOT_FACTORIES = ("torch", "numpy", "yaml", "pickle", "dill", "cloudpickle", "joblib", "pandas", "scipy")
# The zoo's factories: the only functions of gaswap a factory may name, and the only factories a policy file
# may have validate and plot build without the user naming the experiment (see `shipped`).
MODELS = ("alexnet", "vgg16", "resnet18", "resnet50", "mlp", "tiny_cnn", "gpt", "bert", "unet", "densenet", "gru",
          "llama", "block_mlp", "huggingface", "vit", "separable_cnn", "window_attention", "mixture", "norm_mix")


def resolve(path: str, base=None):
    """Import "package.module:callable" (e.g. "gaswap.zoo:alexnet") and return the model factory it names; a
    module not on the Python path is also looked for in the folder `base` (the experiment file's).

    A factory is a class deriving from `torch.nn.Module`, or a Python function (it must return a Module;
    `check_model` checks what it returned). Python's standard library and builtins are refused before anything
    is imported, and so are functions living in NOT_FACTORIES (torch's Module classes are fine): neither
    `os:system`, `subprocess:run`, `builtins:exec` nor `torch:load` ever runs. Any other function is code the
    experiment file's author chose: an experiment file is trusted as a script is (see the README's trust model).
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"model path {path!r} must look like 'package.module:callable'")
    if _standard(module_name):
        raise ValueError(f"model path {path!r}: {module_name!r} is Python's standard library, not a model factory")
    try:
        module = import_module(module_name, base)
    except ImportError as e:
        raise ValueError(f"model path {path!r}: cannot import module {module_name!r} ({e})") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model path {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if inspect.isclass(obj):
        if not issubclass(obj, nn.Module):
            raise ValueError(f"model path {path!r}: class {obj.__qualname__} is not a torch.nn.Module")
        return obj
    home = getattr(obj, "__module__", None) or ""
    ours = home.split(".")[0] == "gaswap"
    if (not inspect.isfunction(obj) or _standard(home) or home.split(".")[0] in NOT_FACTORIES
            or (ours and (home, obj.__name__) not in [(__name__, m) for m in MODELS])):
        what = f"a function of {home!r}" if inspect.isfunction(obj) else f"a {type(obj).__name__}"
        raise ValueError(f"model path {path!r}: {attr!r} is {what}, not a model factory (a class deriving from "
                         f"torch.nn.Module, or a function of your own returning one)")
    return obj


def shipped(path: str) -> bool:
    """Whether `path` names one of the zoo's own factories ("gaswap.zoo:gpt"): code that ships with gaswap."""
    return path in {f"{__name__}:{m}" for m in MODELS}


def check_model(path: str, model) -> nn.Module:
    """`model` if the factory at `path` returned a torch.nn.Module, else ValueError saying what it returned."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model path {path!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _standard(module_name: str) -> bool:
    """Whether `module_name` belongs to Python's standard library (builtins included)."""
    top = module_name.split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names


# --- FSDP unit classes of the transformers above (`distributed.units` names a module class), and a ViT ---


class GPTBlock(_Block):
    """A block of `gpt`: pre-norm, causal (`_Block`'s GPT-2 layer under a public name, for `distributed.units`)."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__(width, heads, dropout, causal=True, pre_norm=True)


class ViTBlock(nn.Module):
    """A ViT encoder block (pre-norm): x + proj(SDPA(qkv(ln1 x))), then x + fc2(gelu(fc1(ln2 x)))."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        if width % heads:
            raise ValueError(f"vit: width {width} is not divisible by {heads} heads")
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.fc2 = nn.Linear(mlp_ratio * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """A vision transformer: images [B, channels, image, image] -> logits [B, classes]. Patches of `patch` x
    `patch` pixels embedded by a strided convolution, a learned class token and position embeddings, `layers`
    ViTBlocks, a final LayerNorm and a linear head on the class token."""

    def __init__(self, image: int = 32, patch: int = 8, channels: int = 3, width: int = 64, layers: int = 2,
                 heads: int = 4, mlp_ratio: int = 4, classes: int = 10):
        super().__init__()
        if image % patch:
            raise ValueError(f"vit: image size {image} is not a multiple of the patch size {patch}")
        self.patch_embed = nn.Conv2d(channels, width, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(width, heads, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def vit(image: int = 32, patch: int = 8, channels: int = 3, width: int = 64, layers: int = 2, heads: int = 4,
        mlp_ratio: int = 4, classes: int = 10) -> ViT:
    """A ViT (ViT-B/16 is vit(224, 16, 3, 768, 12, 12, 4, 1000)); its FSDP units are the `ViTBlock`s."""
    return ViT(image, patch, channels, width, layers, heads, mlp_ratio, classes)


def vit_inputs(batch: int = 2, image: int = 32, channels: int = 3) -> tuple:
    """Images for `vit` (seeded: the same on every rank)."""
    return (torch.randn(batch, channels, image, image, generator=torch.Generator().manual_seed(1)),)
