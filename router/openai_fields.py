"""Which fields of OpenAI's request bodies kvserve serves, and what it does with the others, in one table.

A field of a ``/v1/completions`` or ``/v1/chat/completions`` body is one of:

* served: declared on the request models of ``router.openai_protocol`` (OpenAI's, and the vLLM extras kvserve
  implements: ``top_k``, ``ignore_eos``, ...);
* ``UNSERVED``: OpenAI's fields kvserve does not implement, each with the values that ask for nothing (null,
  its default: ``suffix: ""``, ``functions: []``). Such a value is accepted; any other is
  refused with 400 naming the field, never silently dropped. Implementing a field removes its entry here
  and declares it on the request models;
* ``IGNORED``: OpenAI's fields that change no answer kvserve gives (who the user is, what to store, which
  billing tier), accepted whatever their value;
* anything else (another server's extras, a typo): ignored, and logged once per name.

The README's table ("The OpenAI-compatible HTTP API") lists every field of both endpoints.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

# field -> the values (besides null) that ask for nothing, the first being the one to suggest
UNSERVED: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": ("medium",),
    "web_search_options": (),
}
IGNORED = frozenset({"user", "safety_identifier", "metadata", "store", "service_tier", "prompt_cache_key"})

MAX_LOGGED_NAMES = 256  # unknown names logged once each; a client inventing names cannot grow this set past it
_logged_names: set[str] = set()


class FieldError(ValueError):
    """A request field kvserve refuses: ``param`` names it as OpenAI's error object does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_extra_fields(fields: dict[str, Any]) -> None:
    """Refuse (``FieldError``) the first of ``fields`` (those no request model declares) that asks for what
    kvserve does not implement; log unknown names once."""
    for name, value in fields.items():
        if name in UNSERVED:
            offs = UNSERVED[name]
            if value is not None and not any(_same(value, off) for off in offs):
                hint = f"leave it out or send {json.dumps(offs[0])}" if offs else "leave it out"
                raise FieldError(name, f"{name}={_shown(value)} is not implemented by this server; {hint}")
        elif name not in IGNORED:
            _log_unknown(name)


def _same(value: Any, off: Any) -> bool:
    """``value == off`` where JSON would say so: ``true`` is not ``1``, ``0`` is ``0.0``."""
    return value == off and isinstance(value, bool) == isinstance(off, bool)


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _log_unknown(name: str) -> None:
    name = name[:64]
    if name in _logged_names or len(_logged_names) >= MAX_LOGGED_NAMES:
        return
    _logged_names.add(name)
    log.warning("ignoring request field %r: it is not in OpenAI's API and kvserve does not know it "
                "(logged once)", name)  # fmt: skip
