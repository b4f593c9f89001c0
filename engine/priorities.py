"""Request priorities (lower first, an int32, as vLLM spells them): the check every door makes, and the order
``engine.scheduler`` keeps its waiting and running sequences in."""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence

PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # an int32, as vLLM's and the API's
MAX_OVERTAKEN = 64  # later arrivals of a higher priority that may queue ahead of a waiting sequence


def check_priority(priority: int) -> None:
    """``ValueError`` naming ``priority`` unless it is an int32."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
            PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]):  # fmt: skip
        raise ValueError(f"priority must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], got {priority!r}")


def insert_by_priority(queue: deque[Sequence] | list[Sequence], seq: Sequence, first: bool = False,
                       bounded: bool = False) -> None:  # fmt: skip
    """Put ``seq`` into ``queue`` (in priority order, arrival order within one) last of its priority, or
    ``first``; with one priority, at the end or the front. ``bounded`` (a new arrival in the waiting queue):
    never ahead of a sequence already passed by ``MAX_OVERTAKEN``, and each one it goes ahead of counts it."""
    if not first and (not queue or queue[-1].priority <= seq.priority):
        queue.append(seq)
        return
    after = (lambda s: s.priority >= seq.priority) if first else (lambda s: s.priority > seq.priority)
    at = next((i for i, s in enumerate(queue) if after(s)), len(queue))
    if bounded:
        capped = [i for i in range(at, len(queue)) if queue[i].num_overtaken >= MAX_OVERTAKEN]
        if capped:  # it waited long enough: behind it, then by priority among those after it
            at = next((i for i in range(capped[-1] + 1, len(queue)) if after(queue[i])), len(queue))
        for i in range(at, len(queue)):
            queue[i].num_overtaken += 1
    queue.insert(at, seq)
