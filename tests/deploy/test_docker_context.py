"""The image holds what ``pyproject.toml`` installs and no secret: the build context that ``.dockerignore``
makes, computed with Docker's matching rules (``docker_context``), without Docker."""

from __future__ import annotations

from pathlib import Path

import pytest
from docker_context import context_problems, installed_modules, is_excluded, parse_dockerignore

ROOT = Path(__file__).resolve().parents[2]

# The allow-list that shipped until cluster_state/ and transfer/ were added: every container died at import.
ALLOW_LIST_OF_NINE = """*
!pyproject.toml
!README.md
!engine/
!kvstore/
!kvkernels/
!kvserve/
!protos/
!prefill_service/
!decode_service/
!router/
!rpc/
**/__pycache__
**/*.pyc
"""


def test_the_build_context_holds_every_installed_package_and_no_secret():
    problems = context_problems(ROOT, (ROOT / ".dockerignore").read_text())
    assert not problems, "\n".join(problems)


def test_every_top_level_package_is_found_where_pyproject_looks():
    """The check covers what pip installs: each top-level package directory with an __init__.py is one."""
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert set(installed_modules(ROOT)) == on_disk


def test_the_check_names_each_package_an_allow_list_leaves_out():
    problems = context_problems(ROOT, ALLOW_LIST_OF_NINE)
    left_out = sorted(p.split("'")[1] for p in problems if p.startswith("package "))
    assert left_out == ["cluster_state", "security", "transfer"], problems  # and security/, newer still


@pytest.mark.parametrize("line", ["tests", "cluster-token", "**/*.key", ".venv"])
def test_the_check_names_a_secret_or_the_venv_that_would_get_in(line):
    broken = "\n".join(x for x in (ROOT / ".dockerignore").read_text().splitlines() if x.strip() != line)
    problems = context_problems(ROOT, broken)
    assert problems and all("would be in the build context" in p for p in problems), problems


def test_a_package_that_the_deny_list_names_is_named():
    broken = (ROOT / ".dockerignore").read_text() + "transfer\n"
    problems = context_problems(ROOT, broken)
    assert len(problems) == 1 and problems[0].startswith("package 'transfer' "), problems


# Docker's documented examples (docs.docker.com, "Build context", .dockerignore) and moby's matcher rules.
@pytest.mark.parametrize(
    ("dockerignore", "path", "excluded"),
    [
        ("*/temp*", "somedir/temporary.txt", True),
        ("*/temp*", "somedir/temp", True),
        ("*/temp*", "temp.txt", False),
        ("*/*/temp*", "somedir/subdir/temporary.txt", True),
        ("temp?", "tempa", True),
        ("temp?", "tempab", False),
        ("**/*.go", "a/b/c.go", True),
        ("**/*.go", "c.go", True),
        ("*.md\n!README*.md\nREADME-secret.md", "README-secret.md", True),
        ("*.md\n!README*.md\nREADME-secret.md", "README.md", False),
        ("*.md\n!README*.md\nREADME-secret.md", "CHANGES.md", True),
        ("*.md\nREADME-secret.md\n!README*.md", "README-secret.md", False),
        ("tests", "tests/unit/test_x.py", True),  # a pattern matches any parent of the path
        ("tests", "tests.py", False),
        ("*\n!engine/", "engine/sub/x.py", False),  # cleaned: "engine/" is "engine"
        ("*\n!engine/", "rpc/x.py", True),
        ("/build\n", "build/lib/x", True),  # a leading slash is dropped
        ("./a//b/", "a/b/c", True),
        ("# *\n", "anything", False),  # a comment
        ("[a-c]at", "bat", True),
        ("[^a-c]at", "bat", False),
        ("\\*x", "*x", True),
        ("\\*x", "ax", False),
        ("a/**", "a/b/c", True),
        ("a/**/z", "a/z", True),
        ("a/**/z", "a/b/c/z", True),
    ],
)
def test_patterns_match_as_docker_matches_them(dockerignore, path, excluded):
    assert is_excluded(parse_dockerignore(dockerignore), path) is excluded
