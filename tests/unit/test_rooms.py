"""Rooms by job, checked on the code's own imports: every ``import`` of every module of ``harness/``,
``policies/``, ``hydra_plugins/``, ``run.py`` and ``experiments/`` (inside functions too, read with
``ast``, nothing imported) must follow ``ROOMS``, the table of what each room may import, listed low
to high so no arrow runs from a lower room into a higher one; no two modules import each other
through any chain; and the rooms the table keeps away from ``harness.engine`` really import no vLLM
(a vLLM upgrade touches harness/engine/ only). A deliberately bad import fails each check.

``from harness.x import y`` counts as an import of the module ``harness.x.y`` when that is a module
(of ``harness.x`` otherwise); importing ``a.b.c`` from outside ``a.b`` also counts as importing the
packages ``a.b`` and ``a`` it runs first. Not seen: imports built from strings
(``importlib.import_module``, ``runpy``) and Hydra's ``_target_`` names in ``conf/``."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

SOURCES = ("harness", "policies", "hydra_plugins", "experiments", "run.py")
ENTRY_POINTS = ("run", "hydra_plugins", "experiments")  # run.py, the Hydra plugins, experiments/*.py
NAMESPACES = {"harness"}  # harness/__init__.py: in no room, imports nothing

# Room -> the rooms it may import besides itself, listed low to high: a room names only rooms listed
# before it, so no arrow runs upward. Each set is what the room's modules import today; the entry
# points (run.py, hydra_plugins/, experiments/) sit on top and may import every room. A new arrow
# is a design decision: add it here, and never one to a room listed after the importer.
ROOMS: dict[str, set[str]] = {
    "policies": set(),
    "harness.eviction": {"policies"},
    "harness.tasks": set(),
    "harness.records": set(),
    "harness.scoring": {"harness.tasks", "harness.records"},
    "harness.config": {"policies", "harness.eviction", "harness.tasks"},
    # harness.tasks: `vllm serve` fills a KVzip request's reconstruction ids with the prompt builder's
    # own rule (harness/engine/frontend.py -> harness.tasks.prompts.ids_reconstruction), one derivation.
    "harness.engine": {"policies", "harness.eviction", "harness.tasks", "harness.records", "harness.config"},
    "harness.analysis": {"policies", "harness.eviction", "harness.tasks", "harness.records", "harness.config"},
    "harness.bench": {"policies", "harness.tasks", "harness.records", "harness.config", "harness.engine",
                      "harness.analysis"},
    "harness.run": {"harness.eviction", "harness.tasks", "harness.records", "harness.scoring", "harness.config",
                    "harness.engine", "harness.analysis"},
    "harness.serving": {"policies", "harness.tasks", "harness.records", "harness.config", "harness.engine", "harness.analysis"},
    "entry points": {"policies", "harness.eviction", "harness.tasks", "harness.records", "harness.scoring",
                     "harness.config", "harness.engine", "harness.analysis", "harness.bench", "harness.run",
                     "harness.serving"},
}

# The contracts the table exists for, checked on every chain of imports, not only direct ones.
NEVER_REACHES = {
    "policies": ("harness",),
    "harness.eviction": ("harness.engine",),
    "harness.config": ("harness.engine",),
    "harness.analysis": ("harness.engine", "harness.run", "harness.bench"),
}

Edges = dict[str, dict[str, tuple[Path, int]]]  # module -> imported module -> (file, line) of the import


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the checked sources under ``root`` by dotted name (``experiments/x.py``:
    ``experiments.x``, ``run.py``: ``run``)."""
    files = []
    for source in SOURCES:
        path = root / source
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []
    modules = {}
    for path in files:
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(root: Path) -> Edges:
    modules = module_files(root)

    def known(name: str | None) -> str | None:
        """The longest dotted prefix of ``name`` that is one of our modules."""
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: Edges = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package, one level up per extra dot
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for name in names:
                target = known(name)
                if target is None and module.startswith("experiments."):
                    target = known(f"experiments.{name}")  # the scripts import each other by bare name
                if target is None:
                    continue  # not ours: the standard library, torch, vllm, ...
                # Importing a.b.c runs a/__init__ and a/b/__init__ first, unless the importer is inside them.
                parts = target.split(".")
                for depth in range(1, len(parts) + 1):
                    reached = ".".join(parts[:depth])
                    if reached != module and reached in modules and not module.startswith(reached + "."):
                        edges.setdefault(reached, (path, node.lineno))
    return graph


def room_of(module: str) -> str | None:
    if module.split(".")[0] in ENTRY_POINTS:
        return "entry points"
    return next((room for room in sorted(ROOMS, key=len, reverse=True)
                 if module == room or module.startswith(room + ".")), None)


def where(root: Path, origin: tuple[Path, int]) -> str:
    path, line = origin
    return f"{path.relative_to(root)}:{line}"


def room_violations(graph: Edges, root: Path) -> list[str]:
    """Every import from a room into one it may not import, as ``file:line: a (room) imports b (room)``."""
    problems = []
    for module, edges in sorted(graph.items()):
        if module in NAMESPACES:
            problems += [f"{where(root, origin)}: the namespace {module} imports {target}" for target, origin in edges.items()]
            continue
        room = room_of(module)
        for target, origin in sorted(edges.items()):
            if target in NAMESPACES:
                continue
            other = room_of(target)
            if other != room and other not in ROOMS.get(room, set()):
                problems.append(f"{where(root, origin)}: {module} ({room}) imports {target} ({other}), "
                                f"which {room} may not import")
    return problems


def cycles(graph: Edges, root: Path) -> list[str]:
    """One circle per strongly connected group of modules (Tarjan), as ``a -> b (file:line) -> a (file:line)``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, {}):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for module in sorted(graph):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)

    circles = []
    for group in groups:
        start, members = group[0], set(group)
        came_from: dict[str, str] = {}
        todo, last = [start], None
        while last is None:  # breadth first inside the group: the shortest way back to the start
            module = todo.pop(0)
            for target in sorted(t for t in graph[module] if t in members):
                if target == start:
                    last = module
                    break
                if target not in came_from:
                    came_from[target] = module
                    todo.append(target)
        path = [last]
        while path[-1] != start:
            path.append(came_from[path[-1]])
        path = path[::-1] + [start]
        circles.append(" -> ".join([start] + [f"{b} ({where(root, graph[a][b])})" for a, b in zip(path, path[1:])]))
    return circles


def reached_from(graph: Edges, room: str, forbidden: tuple[str, ...]) -> list[str]:
    """Chains from a module of ``room`` to a module under one of ``forbidden``, one per reached module."""
    chains = []
    for start in sorted(m for m in graph if room_of(m) == room):
        via = {start: [start]}
        todo = [start]
        while todo:
            module = todo.pop(0)
            for target in sorted(graph.get(module, {})):
                if target not in via:
                    via[target] = via[module] + [target]
                    todo.append(target)
        chains += [" -> ".join(chain) for target, chain in via.items()
                   if any(target == f or target.startswith(f + ".") for f in forbidden)]
    return chains


@pytest.fixture(scope="module")
def graph() -> Edges:
    return import_graph(ROOT)


def test_the_table_runs_low_to_high():
    order = list(ROOMS)
    upward = {room: sorted(allowed - set(order[: order.index(room)])) for room, allowed in ROOMS.items()}
    assert not any(upward.values()), f"rooms that may import a room listed above them: {upward}"


def test_every_module_lives_in_a_room(graph):
    assert len(graph) > 50, sorted(graph)
    homeless = sorted(m for m in graph if m not in NAMESPACES and room_of(m) is None)
    assert not homeless, f"modules in no room of ROOMS: {homeless}"


def test_no_import_runs_from_a_room_into_one_it_may_not_import(graph):
    problems = room_violations(graph, ROOT)
    assert not problems, "imports against the rooms table (ROOMS):\n" + "\n".join(problems)


def test_no_two_modules_import_each_other(graph):
    circles = cycles(graph, ROOT)
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("room, forbidden", NEVER_REACHES.items(), ids=list(NEVER_REACHES))
def test_a_room_never_reaches_what_it_must_not_know(graph, room, forbidden):
    chains = reached_from(graph, room, forbidden)
    assert not chains, f"{room} reaches {', '.join(forbidden)}:\n" + "\n".join(chains)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checks_fail_on_a_bad_import(tmp_path):
    """A tree with an analysis module importing the engine inside a function (absolute and
    relative), policies importing the harness, and two records modules importing each other."""
    write(tmp_path, {
        "harness/__init__.py": "",
        "harness/engine/__init__.py": "from harness.engine.llm import Engine\n",
        "harness/engine/llm.py": "import vllm\n\nclass Engine: ...\n",
        "harness/analysis/__init__.py": "",
        "harness/analysis/plots.py": "import numpy\n\n\ndef plot():\n    from harness.engine import llm\n",
        "harness/analysis/table.py": "from ..engine.llm import Engine\n",
        "harness/analysis/ok.py": "from harness.records import a\n",
        "harness/records/__init__.py": "",
        "harness/records/a.py": "import harness.records.b\n",
        "harness/records/b.py": "from harness.records import a\n",
        "policies/__init__.py": "from harness.records.a import X\n",
        "run.py": "from harness.engine import Engine\nfrom harness.analysis import plots\n",
    })
    bad = import_graph(tmp_path)
    assert room_violations(bad, tmp_path) == [
        "harness/analysis/plots.py:5: harness.analysis.plots (harness.analysis) imports harness.engine (harness.engine), "
        "which harness.analysis may not import",
        "harness/analysis/plots.py:5: harness.analysis.plots (harness.analysis) imports harness.engine.llm "
        "(harness.engine), which harness.analysis may not import",
        "harness/analysis/table.py:1: harness.analysis.table (harness.analysis) imports harness.engine (harness.engine), "
        "which harness.analysis may not import",
        "harness/analysis/table.py:1: harness.analysis.table (harness.analysis) imports harness.engine.llm "
        "(harness.engine), which harness.analysis may not import",
        "policies/__init__.py:1: policies (policies) imports harness.records (harness.records), which policies may not import",
        "policies/__init__.py:1: policies (policies) imports harness.records.a (harness.records), which policies may not import",
    ]
    assert cycles(bad, tmp_path) == [
        "harness.records.a -> harness.records.b (harness/records/a.py:1) -> harness.records.a (harness/records/b.py:1)"]
    assert reached_from(bad, "harness.analysis", NEVER_REACHES["harness.analysis"]) == [
        "harness.analysis.plots -> harness.engine", "harness.analysis.plots -> harness.engine.llm",
        "harness.analysis.table -> harness.engine", "harness.analysis.table -> harness.engine.llm",
    ]
    # Through another room: records may not reach the engine, and analysis then reaches it through records.
    write(tmp_path, {"harness/records/b.py": "from harness.engine import llm\n"})
    assert "harness.analysis.ok -> harness.records.a -> harness.records.b -> harness.engine" in \
        reached_from(import_graph(tmp_path), "harness.analysis", ("harness.engine",))


def rooms_without_the_engine() -> list[str]:
    """The rooms the table keeps away from harness.engine, on every chain of allowed imports."""
    def closure(room: str) -> set[str]:
        reach = set(ROOMS[room])
        for other in ROOMS[room]:
            reach |= closure(other)
        return reach
    return [room for room in ROOMS if room not in ("harness.engine", "entry points")
            and "harness.engine" not in closure(room)]


def test_the_rooms_kept_from_the_engine_include_the_eviction_core_and_the_analysis():
    assert {"policies", "harness.eviction", "harness.config", "harness.analysis"} <= set(rooms_without_the_engine())


def vllm_and_engine_modules_after_importing(modules: list[str]) -> str:
    """What importing ``modules`` in a fresh interpreter loads of vLLM and of harness.engine:
    ``[] []`` when nothing."""
    imports = "; ".join(f"import {name}" for name in modules)
    probe = (f"import sys; {imports}; "
             "print(sorted({m.split('.')[0] for m in sys.modules if m == 'vllm' or m.startswith('vllm.')}), "
             "sorted(m for m in sys.modules if m.startswith('harness.engine')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_vllm_free_room_imports_no_vllm_and_no_engine_glue():
    """Every module of every room the table keeps from harness.engine, imported together in one
    interpreter (one start, not one per room); when something comes in, each room alone names it."""
    modules = {room: sorted(m for m in module_files(ROOT) if room_of(m) == room) for room in rooms_without_the_engine()}
    if vllm_and_engine_modules_after_importing([m for names in modules.values() for m in names]) == "[] []":
        return
    pulled = {room: vllm_and_engine_modules_after_importing(names) for room, names in modules.items()}
    assert not {room: found for room, found in pulled.items() if found != "[] []"}, "a vLLM-free room pulled in vLLM"


def test_every_module_that_imports_vllm_lives_in_the_engine_package():
    importers = sorted(
        str(path.relative_to(ROOT)) for folder in ("harness", "policies", "hydra_plugins")
        for path in (ROOT / folder).rglob("*.py")
        if any(line.lstrip().startswith(("import vllm", "from vllm")) for line in path.read_text().splitlines())
    )
    assert importers and all(path.startswith("harness/engine/") for path in importers), importers
