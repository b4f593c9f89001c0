"""What ``docker build`` would send as its build context, computed from ``.dockerignore`` by Docker's rules.

Docker (moby's ``patternmatcher``, used by the classic builder and BuildKit alike) reads ``.dockerignore`` as:

* one pattern a line; ``#`` starts a comment line; surrounding blanks are dropped; a leading ``!`` makes the
  pattern an exception (re-includes what it matches); each pattern is cleaned as a path (``./a//b/`` is
  ``a/b``) and a leading ``/`` is dropped;
* ``*`` is any run of characters but ``/``, ``?`` one such character, ``**`` any number of directories
  (zero included), ``[...]`` a character class, ``\\`` escapes the next character;
* a pattern excludes a path when it matches the path or any of its parent directories;
* the patterns are read in order and the last one that matches decides: excluded, or re-included by ``!``.

Everything here works on path strings, so a test can ask about a path that does not exist in this checkout
(a secret that a user's ``kvserve certs`` would write, a venv that is not there yet).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Rule:
    pattern: str
    exception: bool  # a ``!`` line: re-includes what it matches
    regex: re.Pattern


def parse_dockerignore(text: str) -> list[Rule]:
    rules = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        pattern = line.strip()
        if not pattern:
            continue
        exception = pattern.startswith("!")
        if exception:
            pattern = pattern[1:].strip()
        if pattern:
            pattern = posixpath.normpath(pattern)
            if len(pattern) > 1 and pattern.startswith("/"):
                pattern = pattern[1:]
        rules.append(Rule(pattern, exception, re.compile(_pattern_regex(pattern))))
    return rules


def _pattern_regex(pattern: str) -> str:
    out, i = "^", 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):  # "**/" is "**"
                i += 1
            out += ".*" if i == len(pattern) else "(.*/)?"
            continue
        if ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ValueError(f".dockerignore pattern {pattern!r}: '[' without ']'")
            body = pattern[i + 1 : end]
            out += "[^" + body[1:] + "]" if body.startswith("^") else "[" + body + "]"
            i = end
        else:
            out += re.escape(ch)
        i += 1
    return out + "$"


def is_excluded(rules: list[Rule], path: str) -> bool:
    """Whether ``path`` (relative, ``/``-separated) stays out of the build context."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]  # the parents, then the path itself
    excluded = False
    for rule in rules:
        if any(rule.regex.match(candidate) for candidate in candidates):
            excluded = not rule.exception
    return excluded


def context_problems(root: Path, dockerignore: str) -> list[str]:
    """What is wrong with the build context that ``dockerignore`` makes of ``root``; empty when nothing is.

    Every module of every package that ``pyproject.toml`` installs (setuptools' own package finder, with the
    project's ``include``), and the files ``pip install .`` reads, must be in it. Secrets (the cluster token,
    what ``kvserve certs`` writes, keys), the venv, ``.git``, tests and caches must not be; they are asked about
    by path, so the answer does not depend on what this checkout happens to hold.
    """
    rules = parse_dockerignore(dockerignore)
    problems = []
    for package, modules in sorted(installed_modules(root).items()):
        missing = [module for module in modules if is_excluded(rules, module)]
        if missing:
            problems.append(f"package {package!r} (pyproject.toml installs it) is not in the build context: "
                            f"{len(missing)} of its {len(modules)} files are left out, e.g. {missing[0]}")
    problems += [f"{path} is needed by `pip install .` in the image but is not in the build context"
                 for path in NEEDED if is_excluded(rules, path)]
    problems += [f"{path} ({why}) would be in the build context" for path, why in KEPT_OUT.items()
                 if not is_excluded(rules, path)]
    return problems


NEEDED = ("pyproject.toml", "README.md")
KEPT_OUT = {
    "cluster-token": "the cluster token, docker-compose.yml's env_file",
    "certs/ca/ca.key": "the cluster CA's key from `kvserve certs --out certs`",
    "certs/ca/cluster-secret": "the cluster secret from `kvserve certs`",
    "certs/decode-0/key.pem": "a member's TLS key from `kvserve certs`",
    "certs/decode-0/token": "a member's credential from `kvserve certs`",
    "server.key": "a TLS key",
    ".env": "an environment file",
    ".venv/bin/python": "the virtual environment",
    ".git/config": "the repository",
    "tests/conftest.py": "the tests",
    "engine/__pycache__/config.cpython-311.pyc": "a bytecode cache",
    ".pytest_cache/v/cache/lastfailed": "a tool's cache",
    ".whl/torch-2.13.0-cp312-none-any.whl": "scripts/gpu_wheels.sh's wheels",
}


def installed_modules(root: Path) -> dict[str, list[str]]:
    """Top-level package -> the ``.py`` files of it and its subpackages, as ``pyproject.toml`` finds them."""
    import tomllib

    from setuptools import find_packages

    find = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(root), include=find.get("include", ("*",)), exclude=find.get("exclude", ()))
    modules: dict[str, list[str]] = {}
    for package in packages:
        directory = root / package.replace(".", "/")
        files = sorted(p.relative_to(root).as_posix() for p in directory.glob("*.py"))
        modules.setdefault(package.split(".")[0], []).extend(files)
    return modules
