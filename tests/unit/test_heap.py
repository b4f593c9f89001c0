"""``engine.heap.freeze_startup_heap``: what start-up made is frozen out of garbage collection (a full
collection then walks only what came after), and what start-up left as garbage is collected first, not frozen."""

from __future__ import annotations

import gc

from engine.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


class _Kept:
    pass


def test_start_ups_objects_are_frozen_and_its_garbage_is_not():
    try:
        kept = [_Kept() for _ in range(10_000)]
        garbage = _Node()
        del garbage
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(kept)
        assert not any(obj is kept[0] for obj in gc.get_objects())  # frozen: the collector no longer sees it
        gc.unfreeze()  # (back where the collector sees everything)
        assert any(obj is kept[0] for obj in gc.get_objects())
        assert not any(type(obj) is _Node for obj in gc.get_objects())  # collected before the freeze
    finally:
        gc.unfreeze()
