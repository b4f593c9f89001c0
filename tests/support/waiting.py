"""The one way tests wait for something to happen: poll a condition until it holds or time runs out."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition",
               interval_s: float = 0.05) -> float:  # fmt: skip
    """Poll ``condition`` every ``interval_s`` until it is true; return the seconds that took. Fails the test
    (``AssertionError`` naming ``what``) once ``timeout_s`` has passed."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} within {timeout_s:.0f} s"
        time.sleep(interval_s)
    return time.monotonic() - start
