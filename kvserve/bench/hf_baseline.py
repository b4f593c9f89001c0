"""The peer the offline bench compares with: transformers' batched ``generate`` on the same model directory.

Two baselines:

* ``hf``: ``generate`` as it comes, with the dynamic KV cache;
* ``hf-static``: ``generate(..., cache_implementation="static")``. With a static cache transformers
  compiles the decode step with ``torch.compile`` (mode ``reduce-overhead``, so it is also replayed as a
  CUDA graph) by itself, on CUDA: its documented fastest way to run ``generate``. ``compiled=False``
  sets ``disable_compile`` (the CPU tests; transformers does not compile on the CPU anyway).

Both decode greedily and produce exactly ``max_tokens`` new tokens per prompt (EOS is unset). Prompts go
in one left-padded batch. A static cache is allocated, and compiled for, one (batch, length) shape, so
the first ``run`` of a shape is repeated untimed first: compiling and capturing are not counted, as the
engine's start-up is not.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

BASELINES = ("hf", "hf-static", "none")
_PAD = 0


class TransformersBaseline:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, *, static: bool,
                 compiled: bool = True) -> None:  # fmt: skip
        from transformers import AutoModelForCausalLM

        self.name = "hf-static" if static else "hf"
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.model.generation_config.eos_token_id = None  # the same work as the engine's ignore_eos
        self.options: dict = dict(do_sample=False, pad_token_id=_PAD)
        if static:
            self.options.update(cache_implementation="static", disable_compile=not compiled)
        self._warm_shapes: set[tuple[int, int, int]] = set()

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        """(seconds, new token ids per prompt) of one ``generate`` over all ``prompts``."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[_PAD] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        shape = (len(prompts), width, max_tokens)
        with torch.inference_mode():
            if shape not in self._warm_shapes:
                warm_tokens = max_tokens if "cache_implementation" in self.options else min(4, max_tokens)
                self.model.generate(ids, attention_mask=mask, max_new_tokens=warm_tokens, **self.options)
                self._warm_shapes.add(shape)
            _sync(self.device)
            start = time.perf_counter()
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, **self.options)
            _sync(self.device)
            elapsed = time.perf_counter() - start
        return elapsed, out[:, width:].tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
