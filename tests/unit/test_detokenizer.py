"""Incremental detokenization never emits half a character, always adds up to the full text, and reads recent text
without building the whole."""

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


def test_detokenizer_reads_recent_text_without_the_whole(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add([t]) for t in tokenizer.encode("The quick brown fox jumps over the lazy dog")]
    text = "".join(deltas)
    assert detok.num_chars == len(text)
    assert detok.tail(7) == text[-7:] and detok.tail(10_000) == text
    assert detok.slice(4, 15) == text[4:15] and detok.slice(30, 20) == ""
    detok.truncate(9)
    assert detok.text == text[:9] and detok.num_chars == 9
