"""A decode engine's stand-in for the remote prefill, and running an engine until its requests finish."""

from __future__ import annotations

from engine import LLMEngine
from engine.kv_connector import FinishedLoad, KVConnector


class RemoteLoads(KVConnector):
    """A decode engine's stand-in for the remote prefill: a request whose ``kv_params`` is "remote" loads every
    token after its cached prefix from outside; ``tables`` shows its blocks, ``finish`` ends the load."""

    def __init__(self) -> None:
        self.tables: dict[str, tuple[list[int], int]] = {}  # seq id -> (block table, num_cached_tokens)
        self._done: list[FinishedLoad] = []

    def num_external_tokens(self, seq, num_cached_tokens):
        return (seq.num_tokens - num_cached_tokens, True) if seq.kv_params == "remote" else (0, False)

    def after_allocate(self, seq, num_external_tokens):
        if num_external_tokens:
            self.tables[seq.seq_id] = (seq.block_table.tolist(), seq.num_computed_tokens)

    def finish(self, seq_id: str, first_token: int | None) -> None:
        self._done.append(FinishedLoad(seq_id, first_token))

    def finished_loads(self):
        done, self._done = self._done, []
        return done


def drain(engine: LLMEngine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    return final
