"""Regenerate the Python stubs for protos/kvserve/v1/*.proto (``python -m protos.generate [OUT_DIR]``).

protoc writes imports relative to the proto root (``from kvserve.v1 import ...``), which would
collide with the ``kvserve`` Python package; they are rewritten to ``protos.kvserve.v1``.
"""

from __future__ import annotations

import re
import sys
from importlib.resources import files
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTOS = sorted(p.relative_to(ROOT) for p in (ROOT / "kvserve").rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(files("grpc_tools") / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [str(p) for p in PROTOS]  # fmt: skip
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for path in sorted(p for p in out_dir.rglob("*_pb2*.py*") if p.suffix in (".py", ".pyi")):  # not __pycache__
        text = re.sub(r"^from kvserve\.v1 import", "from protos.kvserve.v1 import", path.read_text(), flags=re.M)
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
