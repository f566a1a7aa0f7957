"""A small built-in model zoo (torch.nn only) and `resolve` for "module:callable" model paths."""
from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn


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
    def __init__(self, width: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        att = F.dropout(att, self.dropout, self.training)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = _Attention(width, heads, seq, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    def __init__(self, vocab: int, layers: int, width: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(_Block(width, heads, seq, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embedding / LM head

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(pos))
        return self.head(self.ln(self.blocks(x)))


def gpt(vocab: int = 1000, layers: int = 2, width: int = 64, heads: int = 4, seq: int = 32,
        dropout: float = 0.0) -> nn.Module:
    """A decoder-only transformer: forward(ids [B, T]) -> logits [B, T, vocab], T <= seq."""
    return _GPT(vocab, layers, width, heads, seq, dropout)


def resolve(path: str):
    """Import "package.module:callable" (e.g. "gaswap.zoo:alexnet") and return the callable."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"model path {path!r} must look like 'package.module:callable'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model path {path!r}: cannot import module {module_name!r} ({e})") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model path {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model path {path!r}: {attr!r} is not callable")
    return obj
