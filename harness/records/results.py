"""Run directories that are either complete or absent: nothing half-written ever looks finished.

A run is built in ``<dir>.partial/`` (each file written to a temporary name, then renamed) and the
directory is renamed to ``<dir>`` only when every file is in place. A killed run leaves at most a
``.partial`` directory, which the next attempt at the same cell discards.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

RUN_FILES = ("config.yaml", "predictions.jsonl", "scores.json", "perf.json")


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def is_complete(run_dir: Path) -> bool:
    return all((run_dir / name).is_file() for name in RUN_FILES)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class RunWriter:
    """Collects a run's files in ``<final>.partial`` and publishes them all at once."""

    def __init__(self, final: Path):
        self.final = final
        self.partial = final.with_name(final.name + ".partial")
        shutil.rmtree(self.partial, ignore_errors=True)
        self.partial.mkdir(parents=True)

    def write_json(self, name: str, data: Any) -> None:
        atomic_write_text(self.partial / name, json.dumps(data, indent=2, sort_keys=False) + "\n")

    def write_jsonl(self, name: str, rows: Iterable[dict]) -> None:
        atomic_write_text(self.partial / name, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    def write_text(self, name: str, text: str) -> None:
        atomic_write_text(self.partial / name, text)

    def commit(self) -> Path:
        missing = [name for name in RUN_FILES if not (self.partial / name).is_file()]
        if missing:
            raise RuntimeError(f"run {self.final} is missing {', '.join(missing)}; not publishing it")
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.partial, self.final)
        return self.final

    def abandon(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)
