"""The suite's own rules (tests/conftest.py): a unit test that starts a process fails, naming where it belongs,
and every test carries the marker of its directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_starting_a_process_in_a_unit_test_fails_and_says_where_the_test_belongs():
    with pytest.raises(AssertionError, match=r"test_suite_layout.py::\S+ is a unit test and started a process: "
                                             r"it belongs in tests/service/"):  # fmt: skip
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match="is a unit test and started a process"):
        os.fork()


def test_a_test_carries_the_marker_of_its_directory(request):
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("cluster") is None
