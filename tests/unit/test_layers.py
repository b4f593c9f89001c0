"""The packages' layering (README, "Where things are"; ``../shared/ARCHITECTURE.md``): each package imports only
packages on a lower level, read from the source's import statements, lazy imports inside functions and type-only
imports included; and no two packages import each other, however far round."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEVELS = {
    "protos": 0,
    "kvkernels": 0,
    "security": 0,
    "kvstore": 1,
    "engine": 2,
    "transfer": 3,
    "cluster_state": 4,
    "rpc": 5,
    "prefill_service": 6,
    "decode_service": 6,
    "router": 6,
    "kvserve": 7,
}


def _imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & LEVELS.keys()


def _package_imports() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files that import it."""
    graph: dict[str, dict[str, list[str]]] = {package: {} for package in LEVELS}
    for package in LEVELS:
        for path in sorted((ROOT / package).rglob("*.py")):
            for imported in _imported_packages(path) - {package}:
                graph[package].setdefault(imported, []).append(str(path.relative_to(ROOT)))
    return graph


def _cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Every package cycle, each as the packages round it, found by depth-first search."""
    found, path = [], []

    def visit(package: str) -> None:
        if package in path:
            cycle = path[path.index(package) :]
            if min(cycle) == cycle[0] and [*cycle, package] not in found:  # each once, from its smallest name
                found.append([*cycle, package])
            return
        path.append(package)
        for imported in sorted(graph[package]):
            visit(imported)
        path.pop()

    for package in sorted(graph):
        visit(package)
    return found


def test_the_levels_are_the_readmes():
    """The README's table ("Where things are") is the one this test enforces: a level changed in one place only
    fails here."""
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", (ROOT / "README.md").read_text(), re.MULTILINE)
    documented = {name: int(level) for level, names in rows for name in re.findall(r"`(\w+)/`", names)}
    assert documented == LEVELS


def test_no_package_imports_one_above_it():
    upward = [f"{file} imports {imported}" for package, imports in _package_imports().items()
              for imported, files in imports.items() if LEVELS[imported] > LEVELS[package]
              for file in files]  # fmt: skip
    assert upward == []


def test_no_package_cycles():
    assert _cycles(_package_imports()) == []


def test_the_cycle_finder_finds_a_cycle_through_three_packages():
    graph = {"a": {"b": ["a/x.py"]}, "b": {"c": ["b/y.py"]}, "c": {"a": ["c/z.py"]}, "d": {"a": ["d/w.py"]}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_security_is_a_leaf_that_imports_only_the_protos():
    assert set(_package_imports()["security"]) <= {"protos"}


def test_the_engine_core_names_no_destination_lease_or_transport():
    """Where KV goes outside the engine's pool is the KV connector's business (``engine/kv_connector.py``)."""
    words = re.compile(r"\b(destination|dest|lease|transport|shm|cuda_ipc|grpc|nixl)", re.IGNORECASE)
    named = [
        f"{path.name}: {match}"
        for path in sorted((ROOT / "engine").rglob("*.py"))
        if path.name != "kv_connector.py"
        for match in words.findall(path.read_text())
    ]
    assert named == []
