"""``GuardsOnce``: a ``torch.compile``d function whose guards run once per kind of call, not on every call."""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch

log = logging.getLogger(__name__)


class GuardsOnce:
    """Calls ``compiled`` (``torch.compile(function)``), evaluating dynamo's guards only the first time a kind
    of call (``kind(*args)``) comes.

    Before every call of a compiled function dynamo checks its guards: the size, strides, dtype and device of
    every tensor it reads, a decoder layer's parameters included, to pick the cached graph built for such
    inputs. For one decoder layer of the bundled model that is about 80 us a call (the cache lookup and the
    compiled region's entry), and a one-sequence decode step calls 31 compiled functions: 2-3 ms of a 25 ms
    step on two cores. Here the first call of each kind runs the guards of each cache entry; the entry they
    pass is remembered, and later calls of the same kind run its code (what dynamo runs after the same guards
    pass) directly. vLLM calls its compiled code the same way, past dynamo's dispatch.

    This is only right if ``kind`` tells apart every pair of calls the guards tell apart. The caller's
    ``kind`` names what differs between its calls: the objects whose tensors are read (a layer, its KV
    views, whose sizes and storage offsets the guards check), which arguments are None, the sizes that
    specialize (a dimension of 1), and grad mode; everything else (dtypes, devices, strides, aliasing) is
    the same on every call by the caller's construction. A kind holds those objects themselves (modules and
    tensors hash by identity), so none is freed and its id reused while its kind is remembered. A call no
    cache entry accepts goes through dynamo (which compiles) and its kind is looked up again next time; where
    this torch does not expose its cache entries, every call goes through dynamo.
    """

    def __init__(self, function: Callable, compiled: Callable, kind: Callable[..., tuple[Hashable, ...]]) -> None:
        self.function = function
        self.compiled = compiled
        self.kind = kind
        self.parameters = list(inspect.signature(function).parameters)
        self.direct: dict[tuple[Hashable, ...], Callable] | None = {}  # None: this torch's entries are hidden

    def __call__(self, *args: Any) -> Any:
        if self.direct is None:
            return self.compiled(*args)
        kind = self.kind(*args)
        code = self.direct.get(kind)
        if code is None:
            code = self._entry_for(args)
            if code is None:
                return self.compiled(*args)
            self.direct[kind] = code
        return code(*args)

    def _entry_for(self, args: tuple[Any, ...]) -> Callable | None:
        """The code of the cache entry whose guards accept ``args``, as a function; None if none does."""
        try:
            entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(self.function.__code__)
            frame_locals = dict(zip(self.parameters, args, strict=True))
            for entry in entries:
                if entry.guard_manager.check(frame_locals):
                    return types.FunctionType(entry.code, self.function.__globals__)
        except (AttributeError, TypeError) as error:  # another torch's internals
            log.warning("compiled calls evaluate their guards every time: %s", error)
            self.direct = None
        return None
