"""Stopping a long run cleanly on SIGINT or SIGTERM: the first signal asks to stop after the current unit of
work (a search generation), a second stops at once. No torch here.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager


class Stop:
    """Whether a stop was asked for: `stop()` is True once SIGINT or SIGTERM arrived; `signum` says which."""

    def __init__(self):
        self.signum: int | None = None

    def __call__(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + (self.signum or 0)


class Aborted(KeyboardInterrupt):
    """A second SIGINT or SIGTERM: stop now, without finishing the generation."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_on_signals(notify=None, signals=(signal.SIGINT, signal.SIGTERM)):
    """Within the block, the first SIGINT or SIGTERM sets the yielded `Stop` (and calls `notify(message)`);
    a second raises `Aborted`. The previous handlers come back afterwards. Off the main thread, where Python
    cannot handle signals, the Stop never fires."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    notify = notify or (lambda message: print(message, file=sys.stderr))
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:  # a forked worker that has not yet set its own handlers
            return
        if stop.signum is not None:
            raise Aborted(signum)
        stop.signum = signum
        notify(f"{signal.Signals(signum).name}: stopping after the current generation (again to stop at once)")

    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        for s, handler_before in previous.items():
            signal.signal(s, handler_before if handler_before is not None else signal.SIG_DFL)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) as `named_interrupts` raises it: a KeyboardInterrupt that says which signal came."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_NAMING = [False]  # whether `named_interrupts` is in force


@contextmanager
def named_interrupts():
    """Within the block, Ctrl-C raises `Interrupted` (its `signum` set) instead of a bare KeyboardInterrupt,
    so that `from_code` can tell a KeyboardInterrupt some code raised (a model factory) from a real Ctrl-C.
    Only on the main thread; forked processes keep Python's own behaviour."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            raise KeyboardInterrupt
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGINT, handler)
    _NAMING[0] = True
    try:
        yield
    finally:
        _NAMING[0] = False
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def from_code(err: KeyboardInterrupt) -> bool:
    """Whether `err` was raised by code, not by a signal (known only within `named_interrupts`)."""
    return _NAMING[0] and getattr(err, "signum", None) is None
