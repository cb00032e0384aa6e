"""A Ctrl-C that cannot be lost.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives; if that is inside
a weakref finalizer or ``__del__`` (vLLM runs several while it loads a model or tears an engine
down), Python prints "Exception ignored" and carries on, and the interrupted cell would finish and
publish. The handler here also records the signal, and a cell calls ``check()`` before publishing.
"""
from __future__ import annotations

import signal

_received = False


def _handler(signum, frame) -> None:
    global _received
    _received = True
    raise KeyboardInterrupt


def install() -> None:
    """Record SIGINT from now on (unless it is ignored, as in some background jobs: left alone)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _handler)


def check() -> None:
    """Raise KeyboardInterrupt if SIGINT arrived, even if its first raise was swallowed."""
    if _received:
        raise KeyboardInterrupt("interrupted (the signal arrived where Python could not raise it)")
