"""``CompiledDecode``: one sequence's decode step on the CPU through ``torch.compile`` (see its docstring)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.models import linear
from engine.models.attention import AttentionMetadata
from engine.models.guards_once import GuardsOnce
from engine.models.native_decode import NativeDecode, refusal
from kvstore import LayerKV

if TYPE_CHECKING:
    from engine.models.model import CausalLM, DecoderLayer

log = logging.getLogger(__name__)


def head_logits(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's float32 logits of ``hidden (rows, hidden)``, capped where the model caps them."""
    logits = model.lm_head(hidden).float()  # (rows, vocab)
    cap = model.config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _approx_logits(hidden: torch.Tensor, shadow: torch.Tensor) -> torch.Tensor:
    """One row's logits ``(vocab,)`` from a bfloat16 copy of the LM head, summed in float32."""
    return (hidden * shadow.float()).sum(-1)


class GreedyHead:
    """The argmax of one row's float32 logits, reading the LM head in bfloat16 first: half its bytes.

    The LM head is a fifth of the bundled model's bytes, and one user's decode step reads every byte once, so
    its time is the bytes over the memory bandwidth. Here the step reads a bfloat16 copy (``shadow``), whose
    logits ``a`` are within ``m_i = margin * |hidden| * |w_i|`` of the float32 ones: bfloat16 rounds each weight
    by at most 2**-9 of it, and either side's float32 sum of ``hidden_size`` products errs by at most
    ``hidden_size * 2**-24`` of the sum of the products' sizes (Cauchy-Schwarz bounds that sum by the norms);
    ``margin`` is twice the total. The token the float32 logits pick has ``a_t + m_t >= max_j (a_j - m_j)``, so
    it is among those rows, and their float32 logits (a few rows; 1-9 here) decide it. The token is the same as
    the argmax of the float32 logits, up to how the last bit of two float32 sums in other orders compare (as
    between any two kernels). A row of NaN leaves no candidate, and the caller takes the float32 logits."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.shadow = self.weight.to(torch.bfloat16)
        margin = 2 * (2**-9 + 2 * self.weight.shape[1] * 2**-24)
        self.margins = self.weight.norm(dim=1) * margin  # (vocab,)
        self.approx = GuardsOnce(_approx_logits, _compile(_approx_logits, dynamic=False), _approx_kind)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden (1, hidden)`` float32 -> the greedy token ``(1,)`` int64; None if no row is a candidate."""
        approx = self.approx(hidden, self.shadow)
        bound = self.margins * hidden.norm()
        candidates = torch.nonzero(approx + bound >= (approx - bound).max()).flatten()
        if candidates.numel() == 0:
            return None
        return candidates[(self.weight[candidates] @ hidden[0]).argmax()].reshape(1)


def _approx_kind(hidden: torch.Tensor, shadow: torch.Tensor) -> tuple:
    return shadow, hidden.shape, torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _layer_step(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor,
                kv: LayerKV, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return layer(x, residual, cos_sin, kv, meta)


def _compile(function: Callable, dynamic: bool) -> Callable:
    """``torch.compile(function)``, traced with float attributes (a norm's eps, attention's scale) as constants:
    by default dynamo makes each a tensor input, built from the float before every call (19 against 35 us of
    Python a layer call, 0.5 ms a step)."""
    compiled = torch.compile(function, fullgraph=True, dynamic=dynamic)

    def call(*args):
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args)

    return call


def cache_per_instruction_set() -> Path:
    """Point inductor's on-disk cache at a directory of this process's CPU instruction set, inside the one it
    would use, and return it. Inductor's cache keys leave the instruction set out: a process that compiled for
    AVX2 (``ATEN_CPU_CAPABILITY=avx2``, or another host sharing the directory) loaded what an AVX-512 process
    had compiled for the same graphs, and its decode steps gave token 0 every time, or corrupted its heap."""
    from torch._inductor import cpu_vec_isa  # (here: importing inductor costs a process start seconds)
    from torch._inductor.runtime import cache_dir_utils

    isa = "isa-" + (re.sub(r"\W+", "-", str(cpu_vec_isa.pick_vec_isa())) or "none")
    directory = Path(cache_dir_utils.cache_dir())
    if directory.name != isa:
        directory = directory / isa
        directory.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    return directory


def _layer_kind(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor,
                kv: LayerKV, meta: AttentionMetadata) -> tuple:  # fmt: skip
    """What the compiled layer step's guards tell apart between the calls ``CompiledDecode`` makes: x, cos_sin
    and the metadata are new contiguous float32/int tensors of fixed shapes but the block table's width."""
    return (layer, kv.k_cache, kv.v_cache, residual is None, meta.block_tables.shape[1] == 1,
            torch.is_grad_enabled(), torch.is_inference_mode_enabled())  # fmt: skip


def _logits_kind(model: CausalLM, hidden: torch.Tensor) -> tuple:
    return model, hidden.shape, torch.is_grad_enabled(), torch.is_inference_mode_enabled()


class CompiledDecode:
    """The decoder layers of a one-sequence decode step on the CPU: in one C call (``NativeDecode``) where it takes
    the model, else through ``torch.compile`` (inductor); and one row's LM head through inductor.

    One user's decode step multiplies one row by every weight: 538 MB read for 0.27 GFLOP on the bundled model.
    Run eagerly, each layer is about a hundred small ATen calls (norms, rotary, the KV store, attention's
    gather, the split products), each with its dispatch and its OpenMP fork and join: about 17 ms of a 50 ms
    step on two cores. Compiled, a layer is a few fused C++ loops (``engine.models.linear`` for the products,
    ``attention.compiled_decode_attention`` for attention), and the step halves. ``NativeDecode`` runs the 30
    layers in one call, at the memory's speed: 17.0-17.3 against 21.5-22.1 ms a step in this host's slower
    bandwidth mode, 12.8-13.3 against 17.9-18.7 in its faster one (one engine, the two alternating; the same
    tokens). Inductor's
    graph serves what it refuses (another dtype, ``KVSERVE_CPU_KERNELS=0``). One row's logits (any step that
    samples one row, a prefill's last too) go through a compiled LM head of their own.

    All layers share one graph (their parameters are its inputs), compiled once with dynamic lengths, so a
    sequence growing token by token never recompiles. Dynamo's guards run once per layer and kind of call,
    not on each of a step's 31 calls (``GuardsOnce``: 25.1 against 23.0 ms a step, one run alternating). A
    greedy decode step's token reads the LM head in bfloat16 (``GreedyHead``: 20.7 against 23.0 ms a step,
    alternating in one engine), and float32 only for the rows that could win.
    Only one-sequence decode steps of float KV without windows run it: larger batches spend their time in the
    products, where inductor's code did worse than the split ``bmm`` (batch 4: 78 against 62-72 ms; batch 16:
    170 against 100 ms), and the eager step now has oneDNN's packed products (``linear.pack_for_onednn``) and
    the C decode attention (``kvkernels.cpu_decode``). Construction compiles
    and runs two steps over block 0 of an unused pool (one and two blocks long: inductor specializes a size
    of 1), so no request waits for the compiler (where ``NativeDecode`` runs the layers, only the heads
    compile); inductor keeps what it compiled on disk, and a process started later loads it."""

    def __init__(self, model: CausalLM, kv_layers: list[LayerKV]) -> None:
        config = model.config
        if config.moe_layers or config.sliding_window is not None:
            raise ValueError("compile_decode: models with experts or sliding windows decode eagerly")
        linear.compile_threads = torch.get_num_threads()
        cache_per_instruction_set()
        # dynamo's guards run once per kind of call (``GuardsOnce``): per layer, with or without a residual
        # (the first layer's is None), a table of one block or more (inductor specializes a size of 1)
        self.layer = GuardsOnce(_layer_step, _compile(_layer_step, dynamic=True), _layer_kind)
        # one row's logits: inductor's reduction reads the LM head (a fifth of the bundled model's bytes) at about
        # 25 GB/s here, the eager split ``bmm`` at about 17
        self.logits = GuardsOnce(head_logits, _compile(head_logits, dynamic=False), _logits_kind)
        # a greedy row's token reads the head in bfloat16 (``GreedyHead``); a capped head's ties stay float32's
        head = model.lm_head.weight
        plain = config.final_logit_softcapping is None and head.dtype == torch.float32
        self.greedy = GreedyHead(head) if plain else None
        # every layer in one C call where it takes the model; inductor's graph (``self.layer``) where not
        reason = refusal(model, kv_layers)
        self.native = NativeDecode(model, kv_layers) if reason is None else None
        if reason is not None:
            log.info("one sequence's decode layers run inductor's graph, not the C step: %s", reason)
        began = time.perf_counter()
        block_size = kv_layers[0].k_cache.shape[1]
        model.compiled = self
        with torch.inference_mode():  # as every step's: dynamo guards on a tensor's being an inference tensor
            for num_blocks in (1, 2):
                length = num_blocks * block_size
                meta = AttentionMetadata(
                    slot_mapping=torch.tensor([length - 1]) % block_size,  # block 0
                    block_tables=torch.zeros(1, num_blocks, dtype=torch.int32),
                    seq_lens=torch.tensor([length], dtype=torch.int32),
                    cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                    num_decodes=1,
                    max_q_len=1,
                )
                hidden = model(torch.zeros(1, dtype=torch.int64), torch.tensor([length - 1]), kv_layers, meta)
                model.compute_logits(hidden[-1:])
                model.greedy_token(hidden[-1:])
        self.compile_s = time.perf_counter() - began
        log.info("compiled the one-sequence decode step in %.1f s", self.compile_s)

    @staticmethod
    def applies(meta: AttentionMetadata, kv: LayerKV) -> bool:
        """Whether this step runs compiled (or in ``NativeDecode``): one sequence's decode of float KV on the CPU."""
        return (meta.num_seqs == 1 and meta.num_decodes == 1 and meta.ring is None and kv.k_scale is None
                and meta.slot_mapping.device.type == "cpu" and int(meta.seq_lens[0]) >= 1)  # fmt: skip

    @staticmethod
    def meta_for(meta: AttentionMetadata, kv: LayerKV) -> AttentionMetadata | None:
        """``meta`` with its block table cut to the sequence's blocks, when this step runs compiled; else None."""
        if not CompiledDecode.applies(meta, kv):
            return None
        length, block_size = int(meta.seq_lens[0]), kv.k_cache.shape[1]
        # new tensors, as each step's inputs are: dynamo guards on strides (even of a dimension of size 1), and on
        # a tensor's being an inference tensor (the staged inputs are views of a buffer made outside inference mode)
        return dataclasses.replace(meta, block_tables=meta.block_tables[:, : -(-length // block_size)].clone(
            memory_format=torch.contiguous_format), slot_mapping=meta.slot_mapping.clone(),
            seq_lens=meta.seq_lens.clone())  # fmt: skip


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with a new tensor's strides (``contiguous()`` keeps any stride of a dimension of size 1)."""
    if t is None:
        return t
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    return t if t.stride() == tuple(reversed(strides)) else t.clone(memory_format=torch.contiguous_format)
