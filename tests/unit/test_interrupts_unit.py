"""The recorded SIGINT (harness.records.interrupts), without an engine."""
from __future__ import annotations

import os
import signal

import pytest

from harness.records import interrupts


# The finalizer's swallowed KeyboardInterrupt is the point of the test: pytest would report it as a warning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigint_swallowed_by_a_finalizer_is_still_raised_before_publishing(monkeypatch):
    import weakref

    monkeypatch.setattr(interrupts, "_received", False)
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, interrupts._handler)

        class Resource:
            pass

        resource = Resource()
        weakref.finalize(resource, os.kill, os.getpid(), signal.SIGINT)
        del resource  # the finalizer runs here; Python prints "Exception ignored" and goes on
        with pytest.raises(KeyboardInterrupt, match="could not raise it"):
            interrupts.check()
    finally:
        signal.signal(signal.SIGINT, previous)
