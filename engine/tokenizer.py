"""The model's tokenizer, with its chat template and incremental detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: Path) -> bool:
    """Whether the model directory ``path`` holds tokenizer files (a random model made by ``kvserve model random`` may
    not)."""
    return any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


class Tokenizer:
    def __init__(self, path: Path) -> None:
        if not has_tokenizer(path):
            raise ValueError(
                f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); add them, or run with "
                "skip_tokenizer_init=True and send token ids"
            )
        # When tokenizer_config.json declares its class (and no remote code), AutoTokenizer reads the model's config
        # only for its model type, name and declared class. Handing it the generic config made from config.json
        # then skips importing the architecture's config module, which pulls in transformers' modeling stack
        # (~1.5 s of a CPU in every worker and router start); tests/unit/test_tokenizer.py checks the same class
        # comes out. Without a declared class the config's own type chooses it: then the plain way.
        config = None
        tokenizer_config = _json(path / "tokenizer_config.json")
        if tokenizer_config.get("tokenizer_class") and "auto_map" not in tokenizer_config:
            config = PreTrainedConfig.from_dict(_json(path / "config.json"))
        self.hf = AutoTokenizer.from_pretrained(str(path), config=config)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens=False`` for text a chat template rendered: it holds the special tokens it needs
        (Gemma's ``<bos>``), which encoding would otherwise add a second time, as transformers'
        ``apply_chat_template`` does not."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of chat messages rendered with the chat template and a generation prompt."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        """Render chat messages (``{"role", "content"}``, and the template's ``tools``: ``rpc.chat``) into the
        prompt text the model was tuned on."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        return self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)  # fmt: skip


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never end inside a multi-byte character.

    Decoding token by token would split characters whose bytes span tokens;
    instead we decode a short window and hold text back while it ends in the
    replacement character U+FFFD. The text so far is kept as its deltas, so
    adding a token costs O(its window), not O(the text): ``text`` joins them
    when read, and ``tail``/``slice`` read recent text without a join.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])  # a little context so the first word gets its leading space
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._chunks: list[str] = []
        self.num_chars = 0  # len(self.text)

    @property
    def text(self) -> str:
        """All the text so far (O(length) when new text arrived since the last read)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def tail(self, num_chars: int) -> str:
        """The last ``num_chars`` characters of ``text`` (all of it when shorter), joining only the deltas
        that hold them."""
        parts, have = [], 0
        for chunk in reversed(self._chunks):
            if have >= num_chars:
                break
            parts.append(chunk)
            have += len(chunk)
        return "".join(reversed(parts))[max(0, have - num_chars) :]

    def slice(self, start: int, end: int) -> str:
        """``text[start:end]`` for ``0 <= start``, at the cost of reading from ``start`` to the end."""
        if start >= min(end, self.num_chars):
            return ""
        return self.tail(self.num_chars - start)[: end - start]

    def truncate(self, num_chars: int) -> None:
        """Keep only the first ``num_chars`` characters of the text (a stop string was found there)."""
        text = self.text[:num_chars]
        self._chunks, self.num_chars = [text], len(text)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty; always empty without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._chunks.append(delta)
        self.num_chars += len(delta)
        return delta
