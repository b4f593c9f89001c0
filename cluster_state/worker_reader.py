"""How a reader of the registry turns worker hashes into ``WorkerInfo``: what it drops, and what it assumes.

Anyone who can write to Redis can write a worker hash, so a reader trusts only what the cluster token signed
(cluster_state/workers.py):

* a hash whose signed fields do not verify, that is malformed, or that is filed under another worker's id is
  dropped: nothing in it can be trusted, not even that the worker exists;
* a hash whose signed fields verify but whose load does not (``verified_load`` is None: rewritten without
  the token, or not a number) keeps its worker. Dropping it would let whoever writes Redis take workers out
  of routing; believing it would let them steer it. The reader assumes instead the last load it verified
  for that worker in its current life (same start time), else none (zeros): an idle worker that reported
  no blocks. The router also counts its own calls in flight to each worker (``router.server``), so an
  assumed idle worker gets no more than its share of a burst. The next heartbeat rewrites the whole load
  with a valid signature.

Each rejection is logged once per worker id, and each unverified load once per worker life.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cluster_state.workers import LOAD_FIELDS, WorkerInfo, verified_load

if TYPE_CHECKING:
    from security.auth import Security

logger = logging.getLogger(__name__)


class WorkerReader:
    """Reads worker hashes for one registry client, remembering each live worker's last verified load.

    Invariant: ``_last_load`` holds, per worker id the last ``read`` found alive, the start time and load of
    the last hash of that worker whose load verified.
    """

    def __init__(self, security: Security) -> None:
        self._security = security
        self._last_load: dict[str, tuple[str, dict[str, int]]] = {}
        self._rejected: set[str] = set()  # ids whose unverified hash was already logged
        self._unverified_load: set[tuple[str, str]] = set()  # (id, start time) whose bad load was logged

    def read(self, hashes: Mapping[str, Mapping[str, str]]) -> list[WorkerInfo]:
        """The workers of ``hashes`` (worker id -> its hash; empty for a worker that is gone) that verify, in
        the order given."""
        self._last_load = {worker_id: last for worker_id, last in self._last_load.items() if hashes.get(worker_id)}
        self._unverified_load = {life for life in self._unverified_load if hashes.get(life[0])}
        return [info for worker_id, fields in hashes.items()
                if fields and (info := self._read_one(worker_id, fields)) is not None]  # fmt: skip

    def _read_one(self, worker_id: str, fields: Mapping[str, str]) -> WorkerInfo | None:
        load = verified_load(fields, self._security)
        try:
            info = WorkerInfo.from_redis(fields, self._security, load or self._assumed_load(worker_id, fields))
            if info.worker_id != worker_id:
                raise ValueError(f"it names worker {info.worker_id!r}")
        except (KeyError, ValueError) as exc:
            if worker_id not in self._rejected:
                self._rejected.add(worker_id)
                logger.warning("ignoring worker entry %r: %s", worker_id, exc)
            return None
        life = (worker_id, fields["started_at"])
        if load is not None:
            self._last_load[worker_id] = (life[1], load)
        elif life not in self._unverified_load:
            self._unverified_load.add(life)
            logger.warning("the load of worker %r does not verify (written without the cluster token?); assuming "
                           "its last verified load", worker_id)  # fmt: skip
        return info

    def _assumed_load(self, worker_id: str, fields: Mapping[str, str]) -> dict[str, int]:
        started_at, load = self._last_load.get(worker_id, ("", {}))
        if started_at and started_at == fields.get("started_at"):
            return load
        return dict.fromkeys(LOAD_FIELDS, 0)
