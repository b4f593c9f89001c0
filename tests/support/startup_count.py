"""How many clusters and worker processes a test run starts (a pytest plugin; tests/conftest.py loads it).

A cluster start is a ``kvserve.launcher.cluster.start_cluster`` call, a ``kvserve.testing.multihost`` cluster or
a ``kvserve up`` process a test runs; a worker process is each ``python -m decode_service|prefill_service|router``
this process starts (``kvserve up``'s own children are not seen from here). The summary line at the end of the
run is what the issue's "cluster start-ups per make test" counts; under pytest-xdist the workers' counts are
summed."""

from __future__ import annotations

import subprocess
from collections import Counter

import pytest

STARTS: Counter[str] = Counter()
_WORKER_MODULES = ("decode_service", "prefill_service", "router")


def _classify(argv) -> str | None:
    words = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else str(argv).split()
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1] in _WORKER_MODULES:
            return f"worker:{words[i + 1]}"
    names = [w.rsplit("/", 1)[-1] for w in words]
    if "up" in names and ("kvserve" in names or "kvserve.cli" in names):
        return "cluster:kvserve up"
    return None


def pytest_configure(config: pytest.Config) -> None:
    import kvserve.launcher.cluster
    import kvserve.testing.multihost

    original_popen_init = subprocess.Popen.__init__

    def counting_popen_init(self, args, *rest, **kwargs):
        if (kind := _classify(args)) is not None:
            STARTS[kind] += 1
        return original_popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = counting_popen_init
    for module, name, kind in ((kvserve.launcher.cluster, "start_cluster", "cluster:start_cluster"),
                               (kvserve.testing.multihost, "multihost_cluster", "cluster:multihost")):  # fmt: skip
        original = getattr(module, name)

        def counted(*args, _original=original, _kind=kind, **kwargs):
            STARTS[_kind] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counted)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist each worker process counts its own starts and hands them to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["startups"] = dict(STARTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    STARTS.update(getattr(node, "workeroutput", {}).get("startups", {}))


def pytest_terminal_summary(terminalreporter) -> None:
    clusters = {k.split(":", 1)[1]: n for k, n in STARTS.items() if k.startswith("cluster:")}
    workers = {k.split(":", 1)[1]: n for k, n in STARTS.items() if k.startswith("worker:")}
    terminalreporter.write_line(f"start-ups: {sum(clusters.values())} clusters {dict(sorted(clusters.items()))}; "
                                f"{sum(workers.values())} worker processes {dict(sorted(workers.items()))}")
