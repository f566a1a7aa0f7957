"""Two models gaswap's compare has never seen: a ConvNeXt-style net and a MobileNetV3-style net with squeeze-excite."""
import torch
from torch import nn


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-2 * torch.ones(dim))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.down(nn.functional.gelu(self.up(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def convnext(classes=10, dims=(32, 64), depths=(2, 2)):
    layers = [nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0])]
    for i, (dim, depth) in enumerate(zip(dims, depths)):
        if i:
            layers += [LayerNorm2d(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, 2, stride=2)]
        layers += [ConvNeXtBlock(dim) for _ in range(depth)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], classes))


class SqueezeExcite(nn.Module):
    def __init__(self, dim, reduced):
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(dim, reduced, 1), nn.Conv2d(reduced, dim, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * nn.functional.hardsigmoid(self.expand(torch.relu(self.reduce(s))))


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, expand, stride):
        super().__init__()
        hidden = cin * expand
        self.body = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(),
            SqueezeExcite(hidden, max(8, hidden // 4)),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.body(x)
        return x + y if self.residual else y


def mobilenet_se(classes=10, width=16):
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.Hardswish(),
        InvertedResidual(width, width, 4, 1), InvertedResidual(width, 2 * width, 4, 2),
        InvertedResidual(2 * width, 2 * width, 4, 1), InvertedResidual(2 * width, 3 * width, 4, 2),
        nn.Conv2d(3 * width, 8 * width, 1), nn.Hardswish(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Dropout(0.2), nn.Linear(8 * width, classes))
