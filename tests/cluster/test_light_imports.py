"""What a process loads for what it does, read in a fresh interpreter (this one has torch loaded already): a
client program, the CLI's start and a container's health check load no torch; ``import kvserve`` loads nothing
and sets nothing; and the CLI switches gRPC's fork handlers off before grpc loads (``kvserve.launcher``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Records GRPC_ENABLE_FORK_SUPPORT as it is when grpc is first imported: what gRPC reads then.
_WATCH_GRPC = """
import os, sys
class _Watch:
    at_grpc = None
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" and _Watch.at_grpc is None:
            _Watch.at_grpc = os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "unset")
sys.meta_path.insert(0, _Watch())
"""


def _loaded_after(code: str) -> dict:
    report = "import json\nprint(json.dumps({'modules': sorted(sys.modules), 'at_grpc': _Watch.at_grpc, " \
             "'env': os.environ.get('GRPC_ENABLE_FORK_SUPPORT')}))"  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", f"{_WATCH_GRPC}\n{code}\n{report}"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("code", ["import kvserve", "from kvserve import Client, AsyncClient", "import kvserve.cli",
                                  "import kvserve.healthcheck", "import rpc.options"])  # fmt: skip
def test_no_torch_where_nothing_computes(code):
    assert "torch" not in _loaded_after(code)["modules"]


def test_import_kvserve_loads_nothing_and_sets_nothing():
    loaded = _loaded_after("import kvserve")
    assert loaded["env"] is None
    assert not {"grpc", "kvserve.client"} & set(loaded["modules"])


@pytest.mark.parametrize("code", ["import kvserve.cli\nimport grpc", "import kvserve.launcher.cluster"])
def test_the_launcher_switches_fork_handlers_off_before_grpc_loads(code):
    assert _loaded_after(code)["at_grpc"] == "false"
