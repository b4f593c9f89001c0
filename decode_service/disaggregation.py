"""Where a decode worker has a queued prompt prefilled: by a prefill worker, or here (``DisaggPolicy``).

A hand-off has a fixed cost: a lease in Redis, a ``Prefill`` call, the copy or the stream of the KV, a
checksum on each side. Computing a few tokens here is cheaper than that, and so is computing a prompt whose
blocks are nearly all in this worker's cache already: a 2,000-token prompt of which 1,990 are cached is ten
tokens of work. And when every prefill worker already has a queue, a prompt sent there waits behind it while
this worker could start on it now.

The decode worker decides, not the router: only it knows exactly what it holds (its prefix cache's hit and what
a memory tier loads, counted at admission, after the router's hint was stale or wrong), and it is the one
whose steps a local prefill delays. The decision is taken each time the prompt is admitted (again after a
failed hand-off), recorded on the request's span (``disagg_decision``) and counted
(``kvserve_disagg_decisions_total{decision}``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cluster_state.workers import WorkerInfo


class Decision(enum.StrEnum):
    REMOTE = "remote"  # a prefill worker computes it
    SHORT = "local_short"  # fewer uncached tokens than ``min_uncached_tokens``
    BUSY = "local_busy"  # every prefill worker's queue is over ``max_prefill_queue`` and this worker has room
    NO_WORKER = "local_no_worker"  # no live prefill worker with our layout is left to try
    SCORE = "local_score"  # it only scores its prompt (max_tokens 0): nothing to hand over for decoding


@dataclass(frozen=True)
class DisaggPolicy:
    """``min_uncached_tokens``: a prompt with fewer tokens than this outside our cache is computed here (0:
    every prompt is handed off). ``max_prefill_queue``: a prompt is computed here when the least-loaded prefill
    worker has more requests than this queued or running, and no prompt is being computed here already (0: no
    bound). The constructor's defaults hand every prompt off; the decode worker's flags have measured ones
    (``DisaggSettings``)."""

    min_uncached_tokens: int = 0
    max_prefill_queue: int = 0

    def decide(self, uncached_tokens: int, target: WorkerInfo | None, ours_at_target: int,
               prefilling_here: int) -> Decision:  # fmt: skip
        """Where a prompt with ``uncached_tokens`` outside our cache goes. ``target``: the least-loaded prefill
        worker it would go to (None: none is left); ``ours_at_target``: our prefill calls in flight there;
        ``prefilling_here``: prompts this worker is computing now.

        ``target``'s queue is its last heartbeat's count of requests queued or running, or ours in flight there
        when that is more (a heartbeat is up to a third of the registry's TTL old)."""
        if target is None:
            return Decision.NO_WORKER
        if uncached_tokens < self.min_uncached_tokens:
            return Decision.SHORT
        queue = max(target.num_running + target.num_waiting, ours_at_target)
        if self.max_prefill_queue and queue > self.max_prefill_queue and not prefilling_here:
            return Decision.BUSY
        return Decision.REMOTE
