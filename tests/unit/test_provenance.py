"""The code version names what runs, not the whole tree (``harness.records.provenance.code_version``)."""
from __future__ import annotations

import pytest

import subprocess
from pathlib import Path

from harness.records.provenance import code_version


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def committed_tree(root: Path, files: dict[str, str]) -> None:
    """A git repository at ``root`` holding ``files`` (path: text), committed."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "a")


def test_documents_and_results_leave_the_code_version_as_it_was(tmp_path):
    committed_tree(tmp_path, {"harness/engine.py": "x = 1\n", "README.md": "one\n", "results/summary.md": "1.0\n"})
    first = code_version(tmp_path)
    assert first and len(first) == 12

    (tmp_path / "README.md").write_text("two\n")
    (tmp_path / "results" / "summary.md").write_text("2.0\n")
    assert code_version(tmp_path) == first  # uncommitted documents: not dirty either
    git(tmp_path, "commit", "-qam", "docs")
    assert code_version(tmp_path) == first

    (tmp_path / "harness" / "engine.py").write_text("x = 2\n")
    assert code_version(tmp_path) == first + "+dirty"
    git(tmp_path, "commit", "-qam", "code")
    assert code_version(tmp_path) not in (first, first + "+dirty")


def test_outside_a_checkout_there_is_no_code_version(tmp_path):
    assert code_version(tmp_path) is None


def test_a_result_records_the_code_its_process_loaded(monkeypatch):
    """A cell that finishes after a commit or an edit under it names the code it ran."""
    from harness.records import provenance as module

    monkeypatch.setattr(module, "code_version", lambda *args: "changed-after-loading")
    monkeypatch.setattr(module, "git_commit", lambda: "changed-after-loading")
    recorded = module.provenance()
    assert recorded["code_version"] == module.LOADED["code_version"] != "changed-after-loading"
    assert recorded["git_commit"] == module.LOADED["git_commit"] != "changed-after-loading"


def test_a_committed_studys_folder_takes_cells_only_from_committed_code(tmp_path):
    """Writing into a study's folder (or below it) at a +dirty code version is refused before any
    engine starts; a clean version, or another folder, is free (issue 51: no cell from code no
    commit holds)."""
    from harness.analysis.studies import ROOT, refuse_uncommitted

    for folder in ("results/cpu_accuracy", "results/ruler/without_vt", "results/throughput/layer_groups"):
        with pytest.raises(ValueError, match="has uncommitted changes .code version 0123abcd4567\\+dirty."):
            refuse_uncommitted(ROOT / folder, "0123abcd4567+dirty")
        refuse_uncommitted(ROOT / folder, "0123abcd4567")
    for elsewhere in (ROOT / "results" / "runs", tmp_path, ROOT / "results" / "cpu_accuracy_scratch"):
        refuse_uncommitted(elsewhere, "0123abcd4567+dirty")


def test_the_commit_is_dirty_only_for_uncommitted_code(tmp_path):
    """Issue 65, item 5: a replay written while its own result files were uncommitted recorded
    ``<commit>+dirty`` though every code path was committed. Results, notes and tests leave the
    commit clean; a code path makes it dirty."""
    from harness.records.provenance import git_commit

    committed_tree(tmp_path, {"harness/engine.py": "x = 1\n", "results/summary.md": "1.0\n"})
    clean = git_commit(tmp_path)
    assert clean and len(clean) == 40
    (tmp_path / "results" / "summary.md").write_text("2.0\n")
    assert git_commit(tmp_path) == clean
    (tmp_path / "harness" / "engine.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == clean + "+dirty"
