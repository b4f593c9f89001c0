"""No top-level package of this project has the import name of another installed distribution.

The project installs its packages at the top level (pyproject.toml's ``include``), and the repository root comes
first on ``sys.path`` in tests and services. A dependency shipping a package of the same name is then shadowed:
its importers get ours. That happened once: transformers 5.25 began installing Hugging Face's ``kernels``, then
imported ``CUDAProperties`` from this project's old ``kernels`` package on every model import (it is
``kvkernels`` now)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _our_packages() -> list[str]:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(pattern.rstrip("*") for pattern in include)


def test_every_installed_distribution_that_ships_one_of_our_package_names_is_this_project():
    owners = importlib.metadata.packages_distributions()
    shadowed = {name: sorted(set(owners[name]) - {"kvserve"}) for name in _our_packages() if name in owners}
    assert {name: others for name, others in shadowed.items() if others} == {}
    assert set(shadowed) == set(_our_packages()), "kvserve is installed (pip install -e .) with every package"
