"""Execution: turns a scheduled batch into device inputs, runs the model (or a captured graph) and samples.

Per step the host writes the batch's inputs with NumPy into a pinned buffer and sends them in one copy
(``engine.input_batch``), runs the model, samples on the device and reads the tokens back in one copy.
A decode-only batch is padded to a bucket size and runs over fixed input addresses: on CUDA by replaying
that bucket's captured graph (``engine.cuda_graph``), elsewhere eagerly, so the CPU suite runs the same
path. Prefill and mixed steps and decode batches past the largest bucket run eagerly on a tightly packed
batch; ``enforce_eager`` runs every step that way. On the CPU, ``compile_decode`` runs a one-sequence decode
step's layers compiled (``engine.models.compiled_decode.CompiledDecode``), padded or not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import kvkernels
from engine.bundled import cache_dir
from engine.config import EngineConfig
from engine.cuda_graph import DecodeGraphs, decode_buckets, decode_forward
from engine.input_batch import PaddedDecodeInputs, StagingBuffer, stage_step
from engine.logprobs import TokenLogprob, prompt_logprobs
from engine.memory import default_kv_bytes
from engine.model_config import ModelConfig
from engine.models.linear import pack_for_onednn
from engine.models.loader import load_model
from engine.models.tensor_parallel import Shard
from engine.sampler import Sampler, SamplerOutput, argmax_decides
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.step_diagnosis import DeviceClock
from engine.tensor_parallel_model import ShardedDecode, ShardedModel
from engine.tensor_parallel_ranks import Ranks, kv_spec
from kvkernels import cpu_decode
from kvstore import KVCache
from kvstore.private_dir import private_dir
from kvstore.ring import RingSpec
from kvstore.shared_pool import create_shared_pool
from kvstore.split_pool import SplitPool

log = logging.getLogger(__name__)

_INITIAL_STAGING_BYTES = 1 << 20  # grows on demand


@dataclass
class ExecutedStep:
    """What a step computed: ``tokens[i]``, the tokens sampled for batch index i (``execute``);
    ``logprobs[i]``, theirs (None where the request asked for none); ``prompt_logprobs[i]``, those of the
    prompt tokens whose positions this step computed, for the requests that asked (``engine.logprobs``)."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob] | None]
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)


class ModelRunner:
    """Owns the model weights and the KV pool on one device. ``scores`` false (a draft model) computes no
    log-probabilities, whatever the requests ask."""

    def __init__(self, model_path: Path, model_config: ModelConfig, config: EngineConfig,
                 eos_token_ids: frozenset[int] = frozenset(), scores: bool = True) -> None:  # fmt: skip
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.model_config = model_config
        self.block_size = config.block_size
        # tensor parallel: this process is rank 0, the others start now and load their parts beside it
        self.ranks, shard, local = None, None, model_config
        if config.tensor_parallel_size > 1:
            shard = Shard.of(model_config, 0, config.tensor_parallel_size)  # (refuses a size the model cannot take)
            _check_tensor_parallel(config, self.device)
            self.ranks = Ranks(model_path, model_config, config, self.dtype, self.device)
            local = shard.config()
        # what each rank holds, advertised by a worker ("2,1"); '' on one device
        self.kv_heads = "" if self.ranks is None else ",".join(
            str(spec.num_kv_heads) for spec in [kv_spec(local, config, self.dtype), *self.ranks.specs])
        try:
            self.model = load_model(model_path, model_config, self.dtype, self.device, shard,
                                    self.ranks.group if self.ranks is not None else None)  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.kv_spec = kv_spec(local, config, self.dtype)  # (a rank's: its KV heads)
        self.kv_pool_spec = kv_spec(model_config, config, self.dtype)  # all heads, whatever the split
        num_blocks = config.num_blocks
        if num_blocks is None:
            budget = default_kv_bytes(config, self.device)
            num_blocks = self.kv_spec.num_blocks_for_bytes(budget)
            if num_blocks < 1:
                raise ValueError(
                    f"a KV budget of {budget} bytes holds no block; one block needs {self.kv_spec.bytes_per_block()}"
                )
        self.kv_pool_path = None
        self.kv_part_paths: list[Path] = []  # the pool files of ranks 1.., kept while others may map them
        if config.shared_kv_name and self.device.type == "cpu":
            self.kv_cache, self.kv_pool_path = create_shared_pool(self.kv_spec, num_blocks, config.shared_kv_name)
        else:
            self.kv_cache = KVCache(self.kv_spec, num_blocks, self.device)
        # The whole pool as this process reaches it (``kvstore.split_pool``): every rank's part is a pool file
        # mapped here too on the CPU, opened here through CUDA IPC on a GPU, so a worker's hand-off moves all heads
        self.kv_part_handles: list[bytes] = []  # on CUDA, the exported pools of ranks 1..
        self.kv_pool = SplitPool([self.kv_cache])
        if self.ranks is not None:
            self.kv_pool = self._allocate_ranks(config, num_blocks)
        if self.device.type == "cpu":
            packed = pack_for_onednn(self.model)
            if packed:
                log.info("linear weights packed for oneDNN: %.0f MiB more host memory", packed / 2**20)
            if self.kv_cache.layers[0].k_cache.dtype == torch.float32 and not kvkernels.use_triton(self.device):
                kernel = "a C kernel (kvkernels.cpu_decode)" if prepare_cpu_decode() else "the PyTorch reference"
                log.info("decode attention on the CPU: %s", kernel)
        if config.compile_decode and self.device.type == "cpu" and self.ranks is None:  # (a GPU's CUDA graphs)
            self.model.compile_decode(self.kv_cache.layers)
        if self.ranks is not None:
            self.model = ShardedModel(self.model, shard, self.ranks)
        self.sampler = Sampler(model_config.vocab_size, self.device, config.seed, eos_token_ids)
        self.scores = scores
        # times the device's parts of each step: the forward with its logits, the sampler (``engine.step_diagnosis``)
        self.clock = DeviceClock(self.device, enabled=config.step_diagnosis)
        # The longest sequence the engine admits: the model's context or the config's cap, and within the pool,
        # since a sequence must fit in it on its own or preemption could never make room for it (a model that
        # slides in every layer holds a ring of blocks whatever the length: see ``model_ring``).
        self.model_ring = None
        if model_config.sliding_window is not None:
            self.model_ring = RingSpec(0, model_config.sliding_window, config.block_size,
                                       recycles=model_config.slides_every_layer)  # fmt: skip
        pool_tokens = num_blocks * config.block_size
        if self.model_ring is not None and self.model_ring.max_blocks <= num_blocks:
            pool_tokens = model_config.max_context
        self.max_model_len = min(config.max_model_len or model_config.max_context, pool_tokens)
        self.staging = StagingBuffer(_INITIAL_STAGING_BYTES, self.device)
        self._tokens_host = self._pinned_tokens(config.max_num_seqs)  # sampled ids come back here
        self.decode_inputs: PaddedDecodeInputs | None = None
        self.graphs: DecodeGraphs | ShardedDecode | None = None  # (either replays a staged bucket)
        if not config.enforce_eager:
            buckets = decode_buckets(config.max_num_seqs, config.max_num_batched_tokens)
            max_blocks_per_seq = -(-self.max_model_len // config.block_size)
            self.decode_inputs = PaddedDecodeInputs(buckets, max_blocks_per_seq, self.device)
            with torch.inference_mode():
                if self.ranks is not None:  # every rank's graphs (eager steps on the CPU), in step
                    self.graphs = ShardedDecode(self.model, self.kv_cache.layers, self.decode_inputs, self.device,
                                                config.tensor_parallel_timeout_s)  # fmt: skip
                elif self.device.type == "cuda":
                    self.graphs = DecodeGraphs(self.model, self.kv_cache.layers, self.decode_inputs, self.device)

    def _allocate_ranks(self, config: EngineConfig, num_blocks: int) -> SplitPool:
        """Every rank's part of the pool: on the CPU in pool files this process maps too, kept while the pool is
        shared (our part is a file: prefill workers map them all), removed at once otherwise; on CUDA in each
        rank's GPU, exported to this process through CUDA IPC (``kv_part_handles``: prefill workers open them)."""
        parts, paths = self.ranks.allocate(num_blocks, config.shared_kv_name or "engine")
        self.kv_part_handles = self.ranks.part_handles
        if self.kv_pool_path is None:  # nobody else maps them: the mappings hold the memory from now on
            for path in paths:
                path.unlink(missing_ok=True)
        else:
            self.kv_part_paths = paths
        return SplitPool([self.kv_cache, *parts])

    def close(self) -> None:
        """Remove the shared-memory files of the pool, if there are (mappings stay valid until dropped)."""
        for path in [getattr(self, "kv_pool_path", None), *getattr(self, "kv_part_paths", [])]:
            if path is not None:
                path.unlink(missing_ok=True)
        self.kv_pool_path, self.kv_part_paths = None, []
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ExecutedStep:
        """Run one step; sample for each sequence that reached its end (none for the others): one token, or
        for a speculating sequence the target's token at its last token and at each proposal
        (``engine.speculative`` verifies them)."""
        seqs = batch.seqs
        self.clock.take()  # (what a failed step timed before it failed)
        scoring = [i for i, s in enumerate(seqs) if s.wants_prompt_logprobs] if self.scores else []
        decoded = self._decode_padded(seqs) if batch.num_decodes == len(seqs) and not scoring else None
        prompt: dict[int, list[TokenLogprob]] = {}
        if decoded is not None:
            logits, sampled, token = decoded
            if token is not None:  # one greedy row, its token already (``CausalLM.greedy_token``)
                return ExecutedStep([[token]], [None])
            counts = None
        else:
            step = stage_step(self.staging, seqs, batch.num_new_tokens, batch.num_decodes, self.block_size)
            sampled = step.sampled
            with self.clock:
                hidden = self.model(step.input_ids, step.positions, self.kv_cache.layers, step.meta)
                if scoring:
                    prompt = self._score_prompts(hidden, seqs, batch.num_new_tokens, scoring)
                logits = self.model.compute_logits(hidden[step.logit_rows]) if sampled else None
            counts = step.logit_counts if len(step.logit_counts) < step.logit_rows.shape[0] else None
        out = ExecutedStep([[] for _ in seqs], [None] * len(seqs), prompt)
        if not sampled:
            return out
        counts = counts or [1] * len(sampled)
        # a verify step: row j of a speculating sequence samples the token after its first j proposals
        rows = [(seqs[i], j) for i, n in zip(sampled, counts, strict=True) for j in range(n)]
        verifying = len(rows) > len(sampled)
        tokens, logprobs = self._sample(
            logits, [seq for seq, _ in rows], [seq.num_tokens + j for seq, j in rows] if verifying else None,
            [seq.spec_token_ids[:j] for seq, j in rows] if verifying else None)  # fmt: skip
        start = 0
        for i, n in zip(sampled, counts, strict=True):
            out.tokens[i] = tokens[start : start + n]
            if logprobs is not None and seqs[i].params.logprobs is not None:
                out.logprobs[i] = logprobs[start : start + n]
            start += n
        return out

    def _score_prompts(self, hidden: torch.Tensor, seqs: list[Sequence], num_new_tokens: list[int],
                       scoring: list[int]) -> dict[int, list[TokenLogprob]]:  # fmt: skip
        """The prompt log-probabilities this step's positions give (``hidden``, a packed step's hidden states):
        position p of a sequence scores its prompt token p + 1, from its first unscored one on."""
        firsts = np.cumsum([0, *num_new_tokens])
        scored = {}
        for i in scoring:
            seq = seqs[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens[i]
            positions = range(max(start, len(seq.prompt_logprobs) - 1), min(end, seq.num_prompt_tokens - 1))
            rows = torch.arange(positions.start, positions.stop, device=hidden.device) + int(firsts[i] - start)
            targets = seq.token_ids[positions.start + 1 : positions.stop + 1]
            scored[i] = prompt_logprobs(self.model.compute_logits, hidden[rows], targets, seq.params.prompt_logprobs)
        return scored

    def _decode_padded(self, seqs: list[Sequence]) -> tuple[torch.Tensor | None, list[int], int | None] | None:
        """(logits of the sampling rows, their batch indices, None) of a decode-only batch padded to its bucket, or
        for one argmax row ``(None, [0], its token)`` (``CausalLM.greedy_token``); None: the batch runs eagerly."""
        inputs = self.decode_inputs
        if inputs is None or any(s.ring is not None for s in seqs):  # windows run eagerly (``stage_step``)
            return None
        bucket = inputs.bucket_for(len(seqs))
        if bucket is None:
            return None
        if not inputs.stage(bucket, seqs, self.block_size):
            return None
        # A one-token prefill chunk that does not end its prompt is a "decode" that samples nothing.
        sampled = [i for i, s in enumerate(seqs) if s.num_computed_tokens + 1 == s.num_tokens]
        with self.clock:
            if self.graphs is not None:
                logits = self.graphs.replay(bucket)
            elif sampled == [0] and len(seqs) == 1 and argmax_decides(seqs[0]):
                input_ids, positions, meta = inputs.device_inputs(bucket)
                hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
                token = self.model.greedy_token(hidden)
                if token is not None:
                    return None, sampled, int(token)
                logits = self.model.compute_logits(hidden)
            else:
                logits = decode_forward(self.model, self.kv_cache.layers, inputs, bucket)
        if len(sampled) == len(seqs):
            return logits[: len(seqs)], sampled, None
        return logits[torch.tensor(sampled, dtype=torch.int64, device=self.device)], sampled, None

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int] | None = None,
                seen_after: list[list[int]] | None = None) -> tuple[list[int], list[TokenLogprob] | None]:  # fmt: skip
        """Sample on the device (``Sampler``), then read the tokens back in one copy (into pinned memory on
        CUDA), and their log-probabilities where a row asked."""
        with self.clock:
            drawn: SamplerOutput = self.sampler(logits, seqs, positions, seen_after)
        if self._tokens_host.shape[0] < len(seqs):  # a batch wider than max_num_seqs: grow (never expected)
            self._tokens_host = self._pinned_tokens(2 * len(seqs))
        host = self._tokens_host[: len(seqs)]
        host.copy_(drawn.tokens, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        tokens = host.tolist()
        if drawn.logprobs is None or not self.scores:
            return tokens, None
        return tokens, drawn.logprobs.to_host(tokens, [s.params.logprobs or 0 for s in seqs])

    def _pinned_tokens(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int64, pin_memory=self.device.type == "cuda")


def _check_tensor_parallel(config: EngineConfig, device: torch.device) -> None:
    """Refuse, naming the option, more ranks than GPUs."""
    size = config.tensor_parallel_size
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; this machine has {torch.cuda.device_count()}")


def prepare_cpu_decode() -> bool:
    """Build (or load) the CPU's C decode attention now, in this user's cache directory (``kvkernels.cpu_decode``:
    it is code this process runs, so the directory must be this user's alone); whether it runs."""
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        directory = private_dir(cache_dir() / "kernels")
    except (OSError, RuntimeError) as error:
        log.warning("CPU decode attention runs the PyTorch reference: %s", error)
        return False
    return cpu_decode.prepare(directory)
