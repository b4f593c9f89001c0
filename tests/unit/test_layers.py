"""The packages' layering (``../shared/ARCHITECTURE.md``, Top-level layout): services -> rpc, transfer,
cluster_state -> engine -> kvstore -> kernels, with ``kvserve`` (what users touch) on top. No module imports
a package above its own, read from the source's import statements (lazy imports inside functions count)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEVELS = {
    "protos": 0,
    "kernels": 0,
    "kvstore": 1,
    "engine": 2,
    "rpc": 3,
    "transfer": 3,
    "cluster_state": 3,
    "prefill_service": 4,
    "decode_service": 4,
    "router": 4,
    "kvserve": 5,
}


def _imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & LEVELS.keys()


def test_no_package_imports_one_above_it():
    upward = []
    for package, level in LEVELS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for imported in _imported_packages(path):
                if LEVELS[imported] > level:
                    upward.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert upward == []


def test_the_engine_core_names_no_destination_lease_or_transport():
    """Where KV goes outside the engine's pool is the KV connector's business (``engine/kv_connector.py``)."""
    words = re.compile(r"\b(destination|dest|lease|transport|shm|cuda_ipc|grpc|nixl)", re.IGNORECASE)
    named = [
        f"{path.name}: {match}"
        for path in sorted((ROOT / "engine").glob("*.py"))
        if path.name != "kv_connector.py"
        for match in words.findall(path.read_text())
    ]
    assert named == []
