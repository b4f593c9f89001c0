"""A request's state as it moves through the engine: waiting -> running -> finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output) and how many of them already have KV in the pool.

    Invariant: ``num_computed_tokens <= num_tokens``; a running sequence holds
    blocks for at least its first ``num_computed_tokens`` tokens. Admission
    starts ``num_computed_tokens`` at the longer of the cached prefix it found
    and ``num_dest_readable_tokens`` (a multiple of the block size, less than
    ``num_tokens``); the engine fills those blocks before the step runs.
    Preemption resets it to 0 and keeps the tokens, so the sequence is
    recomputed (from whatever is still cached or readable) from its prompt and
    the output it already has.
    """

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    sampling_seed: int = 0  # the int64 seed of its random stream (engine.sampler: drawn when it brought none)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # its blocks' ids, int32 (``BlockManager.block_table_array``: a view the scheduler replaces as it grows)
    block_table: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_emitted_chars: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission
    # Prefill for another worker: positions from ``num_dest_cached_tokens`` on (that worker already holds the
    # rest) must end up in ``kv_destination`` = (that worker's pool layers, its whole block table for this
    # sequence); ``hold_blocks`` keeps our own blocks after finishing until the caller releases them. With
    # ``read_dest_prefix`` the table's first ``num_dest_cached_tokens // block_size`` entries are real blocks
    # holding that prefix's KV, which admission copies into our own blocks instead of computing it
    # (``engine.kv_destination``); ``num_dest_read_tokens`` counts them at the first admission. From
    # ``dest_deadline`` (``time.monotonic()``) on, the destination is neither read nor written.
    kv_destination: tuple[list, list[int]] | None = None
    num_dest_cached_tokens: int = 0
    read_dest_prefix: bool = False
    num_dest_read_tokens: int = 0
    dest_deadline: float | None = None
    hold_blocks: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_dest_readable_tokens(self) -> int:
        """Leading tokens admission may count as computed because the destination's KV of them can be read."""
        return self.num_dest_cached_tokens if self.read_dest_prefix else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy, O(length): not for per-step use."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
