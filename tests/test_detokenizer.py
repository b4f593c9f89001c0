"""Incremental detokenization never emits half a character and always adds up to the full text."""

from __future__ import annotations

from engine.tokenizer import IncrementalDetokenizer


def test_multibyte_characters_are_never_split(tokenizer):
    text = "Café 東京 naïve 🎉🚀 Ωmega — “quotes” 😀 done"
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)
    # some emoji span several byte-level tokens: at least one step must have held its text back
    assert any(d == "" for d in deltas)
