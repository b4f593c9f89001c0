"""Request priorities (lower first, an int32, as vLLM spells them): the check every door makes, the order
``engine.scheduler`` keeps its waiting and running sequences in, and (``Urgency``) the small prompt chunks of
lower priorities under the ``priority`` policy."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from engine.sequence import Sequence

PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # an int32, as vLLM's and the API's
MAX_OVERTAKEN = 64  # later arrivals of a higher priority that may queue ahead of a waiting sequence
URGENT_FOR_S = 60.0  # how long an arrival of the best priority keeps lower priorities' prompt chunks small


def check_priority(priority: int) -> None:
    """``ValueError`` naming ``priority`` unless it is an int32."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
            PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]):  # fmt: skip
        raise ValueError(f"priority must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], got {priority!r}")


class Queued(Protocol):
    """What waits in a priority-ordered queue: a ``Sequence``, or a prefill worker's job."""

    priority: int
    num_overtaken: int


def insert_by_priority(queue: deque[Queued] | list[Queued], seq: Queued, first: bool = False,
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


def in_prompt(seq: Sequence) -> bool:
    """Whether ``seq`` has more than its last token to compute (a prompt, or a preempted sequence's recompute)."""
    return seq.num_tokens - seq.num_computed_tokens > 1


def best_prompt(running: list[Sequence], waiting: deque[Sequence]) -> int | None:
    """The best priority of a prompt being prefilled or first in the waiting queue (None: no such prompt): a
    step under the ``priority`` policy runs no prompt chunk of a lower priority than this, nor (one step in two
    at most) its decodes, unless this prompt gets no chunk (``engine.scheduler``)."""
    prompts = [seq.priority for seq in running if in_prompt(seq)] + ([waiting[0].priority] if waiting else [])
    return min(prompts, default=None)


class Urgency:
    """What a step under the ``priority`` policy holds back for a better priority.

    A request that arrives waits for the step under way, and a step that prefills long prompts of a lower
    priority takes as long as those prompts (on a CPU, 128 prompt tokens beside 8 decodes: about four decode
    steps). So:

    - a step that prefills a prompt (``best_prompt``) runs no prompt chunk of a lower priority, nor its
      decodes (which sit out one step in two at most), and admits no waiting prompt of a lower priority,
      unless that prompt gets no chunk after all (``hold``, ``release``, ``admits``);
    - for ``URGENT_FOR_S`` after a request of the best priority arrived, the prompts of every lower priority
      take at most ``chunk_tokens`` of a step together (``chunk``): an urgent request waits for at most one
      such step, and its own prompt takes the step's whole budget. Without urgent arrivals nothing is capped.
    """

    def __init__(self, enabled: bool, chunk_tokens: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.chunk_tokens = chunk_tokens if enabled else 0  # 0: off
        self._clock = clock
        self._best: int | None = None  # the best priority that arrived within URGENT_FOR_S
        self._at = 0.0  # when it last arrived
        self._left: int | None = None  # what lower priorities' prompts may still take of this step (None: any)
        self.ahead: int | None = None  # this step's best prompt's priority
        self.hold_decodes = False  # this step holds lower priorities' decodes back too
        self._held: list[Sequence] = []
        self._held_decodes = False  # the last step held decodes back

    def arrived(self, priority: int) -> None:
        now = self._clock()
        if self._best is None or priority <= self._best or now - self._at > URGENT_FOR_S:
            self._best, self._at = priority, now

    def begin_step(self, running: list[Sequence], waiting: deque[Sequence]) -> None:
        urgent = self.chunk_tokens and self._best is not None and self._clock() - self._at <= URGENT_FOR_S
        self._left = self.chunk_tokens if urgent else None
        self.ahead = best_prompt(running, waiting) if self.enabled else None
        self.hold_decodes = (self.ahead is not None and not self._held_decodes
                             and any(seq.priority > self.ahead for seq in running))  # fmt: skip
        self._held, self._held_decodes = [], False

    def hold(self, seq: Sequence) -> bool:
        """Whether ``seq`` sits out this step (so far: see ``release``)."""
        if self.ahead is None or seq.priority <= self.ahead or not (self.hold_decodes or in_prompt(seq)):
            return False
        self._held.append(seq)
        return True

    def admits(self, seq: Sequence, picked: list[tuple[Sequence, int]]) -> bool:
        """Whether the waiting ``seq`` may start this step beside the ``picked`` (sequence, tokens): not below a
        better prompt that got a chunk (a prompt admitted beside it would lengthen its step as a running one
        would)."""
        return self.ahead is None or seq.priority <= self.ahead or not self._ahead_runs(s for s, _ in picked)

    def _ahead_runs(self, scheduled: Iterable[Sequence]) -> bool:
        return any(seq.priority <= self.ahead and in_prompt(seq) for seq in scheduled)

    def release(self, scheduled: list[Sequence]) -> list[Sequence]:
        """The sequences held that run after all, once the step's others are ``scheduled``: all of them when
        the better prompt got no chunk (nothing to wait for), else none."""
        if not self._held:
            return []
        if self._ahead_runs(scheduled):
            self._held_decodes = any(not in_prompt(seq) for seq in self._held)
            return []
        return self._held

    def chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """The tokens of ``seq`` from ``start`` that this step computes, with ``budget`` left; a lower priority's
        prompt tokens count against what lower priorities may take of the step."""
        if self._left is None or seq.priority <= self._best or not in_prompt(seq):
            return seq.num_tokens_to_compute(start, budget)
        n = seq.num_tokens_to_compute(start, min(budget, self._left))
        self._left -= n
        return n
