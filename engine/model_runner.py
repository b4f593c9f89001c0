"""Execution: turns a scheduled batch into flat tensors, runs the model and samples."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.loader import load_model
from engine.sampler import Sampler
from engine.scheduler import ScheduledBatch
from kvstore import KVCache, KVCacheSpec, token_slots
from kvstore.transfer import KVMirror, create_shared_pool


class ModelRunner:
    """Owns the model weights and the KV pool on one device."""

    def __init__(self, model_path: Path, model_config: ModelConfig, config: EngineConfig) -> None:
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.model_config = model_config
        self.block_size = config.block_size
        self.model = load_model(model_path, model_config, self.dtype, self.device)
        self.kv_spec = KVCacheSpec(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        num_blocks = config.num_blocks
        if num_blocks is None:
            budget = config.default_kv_bytes(self.device)
            num_blocks = self.kv_spec.num_blocks_for_bytes(budget)
            if num_blocks < 1:
                raise ValueError(
                    f"a KV budget of {budget} bytes holds no block; one block needs {self.kv_spec.bytes_per_block()}"
                )
        self.kv_pool_path = None
        if config.shared_kv_name and self.device.type == "cpu":
            self.kv_cache, self.kv_pool_path = create_shared_pool(self.kv_spec, num_blocks, config.shared_kv_name)
        else:
            self.kv_cache = KVCache(self.kv_spec, num_blocks, self.device)
        self.sampler = Sampler(model_config.vocab_size, self.device, config.seed)

    def close(self) -> None:
        """Remove the shared-memory file of the pool, if there is one (mappings stay valid until dropped)."""
        if self.kv_pool_path is not None:
            self.kv_pool_path.unlink(missing_ok=True)
            self.kv_pool_path = None

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Run one step; return the sampled token for each sequence that reached its end, else None."""
        input_ids, positions, slots, sample_rows = self._flatten(batch)
        meta = self._metadata(batch, slots)
        hidden = self.model(
            torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
            self.kv_cache.layers, meta,
        )  # fmt: skip
        sampled = [i for i, row in enumerate(sample_rows) if row is not None]
        if not sampled:
            return [None] * len(batch.seqs)
        logits = self.model.compute_logits(hidden[[sample_rows[i] for i in sampled]])
        tokens = self.sampler(logits, [batch.seqs[i] for i in sampled]).tolist()
        out: list[int | None] = [None] * len(batch.seqs)
        for i, token in zip(sampled, tokens, strict=True):
            out[i] = token
        return out

    def _flatten(self, batch: ScheduledBatch):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int | None] = []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(token_slots(seq.block_table, start, end, bs))
            sample_rows.append(len(input_ids) - 1 if end == seq.num_tokens else None)
        return input_ids, positions, slots, sample_rows

    def _metadata(self, batch: ScheduledBatch, slots: list[int]) -> AttentionMetadata:
        seq_lens = [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        cu = [0]
        for n in batch.num_new_tokens:
            cu.append(cu[-1] + n)
        to = dict(device=self.device, dtype=torch.int32)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device, dtype=torch.int64),
            block_tables=torch.tensor(tables, **to),
            seq_lens=torch.tensor(seq_lens, **to),
            cu_seqlens_q=torch.tensor(cu, **to),
            num_decodes=batch.num_decodes,
            mirrors=self._mirrors(batch),
        )

    def _mirrors(self, batch: ScheduledBatch) -> list[KVMirror]:
        """One mirror per destination pool in the batch, mapping each token to its destination slot (or -1).

        Positions below a sequence's ``num_dest_cached_tokens`` map to -1: the destination already holds them,
        in blocks other sequences there may be reading.
        """
        by_pool: dict[int, tuple[list, list[int]]] = {}
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.kv_destination is not None:
                layers, dst_blocks = seq.kv_destination
                _, slots = by_pool.setdefault(id(layers), (layers, [-1] * batch.num_tokens))
                first, end = seq.num_computed_tokens, seq.num_computed_tokens + n
                start = max(first, seq.num_dest_cached_tokens)
                if end > start:
                    slots[offset + start - first : offset + n] = token_slots(dst_blocks, start, end, self.block_size)
            offset += n
        return [
            KVMirror(layers, torch.tensor(slots, device=self.device, dtype=torch.int64))
            for layers, slots in by_pool.values()
        ]
