"""Every script under experiments/ imports the harness of the checkout it sits in. The venv's editable
install maps ``harness`` and ``policies`` to the checkout that ran ./setup.sh, so a script run from a
worktree (as committed results are made: ``git worktree add --detach``) that imports them before
putting its own checkout first on ``sys.path`` runs the main checkout's code, and so do the engine
processes it starts there; its provenance then names the wrong commit."""
from __future__ import annotations

import ast

import pytest

from tests.support import ROOT

SCRIPTS = sorted((ROOT / "experiments").glob("*.py"))


def first_line(tree: ast.Module, match) -> int | None:
    return next((node.lineno for node in tree.body if match(node)), None)


def imports_the_harness(node: ast.stmt) -> bool:
    names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
             [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
    return any(name.split(".")[0] in ("harness", "policies", "hydra_plugins") for name in names)


def puts_its_checkout_first(node: ast.stmt) -> bool:
    return "sys.path.insert(0, str(ROOT))" in ast.unparse(node)  # (alone, or under `if ... not in sys.path`)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_puts_its_checkout_first_before_importing_the_harness(script):
    tree = ast.parse(script.read_text())
    imported = first_line(tree, imports_the_harness)
    if imported is None:
        return  # imports inside functions, or none at all (kvpress_runner runs in kvpress's venv)
    inserted = first_line(tree, puts_its_checkout_first)
    assert inserted is not None and inserted < imported, (
        f"{script.name}:{imported} imports the harness before putting its own checkout first on sys.path")
