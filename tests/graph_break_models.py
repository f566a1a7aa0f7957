"""Models torch.compile compiles only in pieces or with dynamic shapes, for tests/test_compiled_graph_breaks.py."""
import torch
from torch import nn


class LstmNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        out, _ = self.lstm(x.reshape(x.shape[0], 2, 4).repeat(1, 1, 2))
        return self.head(out[:, -1])


class Gate(nn.Module):
    def forward(self, x):
        if x.mean().item() > 0:  # a Python value read from the data
            return x * 2
        return x


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.gate, self.b = nn.Linear(8, 8), Gate(), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.gate(self.a(x)))


class Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


class DataShaped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        return h[h > 0].sum().expand(x.shape[0], 4)  # h[h > 0]: a shape the data decides
