"""Model factories that misbehave, for the safety battery (tests/test_safety.py)."""
import os

from torch import nn


class NotAModule:
    def __init__(self, **kwargs):
        raise AssertionError("a factory class that is no nn.Module must be refused before it is called")


class Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        return self.linear(x).detach()


def detached():
    return Detached()


def number():
    return 42


def raises():
    raise ValueError("no such layer size")


def exits():
    raise SystemExit(3)


def interrupts():
    raise KeyboardInterrupt


def sleeps():
    """A factory that takes its time (a real Ctrl-C comes meanwhile): says so in ./sleeping, then sleeps."""
    import time

    open("sleeping", "w").close()
    time.sleep(60)


def touch(path: str):
    """A factory with a side effect: runs only when the user trusts the experiment."""
    open(path, "w").close()
    return nn.Linear(8, 4)


def env_var():
    return os.environ


class Returns(nn.Module):
    """forward returns `what` (None, a number, an integer tensor): nothing to differentiate."""

    def __init__(self, what):
        super().__init__()
        self.linear, self.what = nn.Linear(8, 4), what

    def forward(self, x):
        out = self.linear(x)
        return {"none": None, "number": 3.0, "argmax": out.argmax(-1)}[self.what]
