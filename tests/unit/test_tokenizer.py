"""``engine.tokenizer.Tokenizer`` hands AutoTokenizer a generic config read from config.json (to skip importing
the architecture's modeling stack): it must pick the tokenizer class and tokens a plain AutoTokenizer picks, for
the bundled model and for the model types and declared tokenizer classes of the other supported families."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from engine.tokenizer import Tokenizer

TEXT = "Hello <|im_start|>user\nCafé 東京 naïve 🎉 x=1; y = [2, 3]\n\tdone<|im_end|>"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize(("model_type", "tokenizer_class"), [
    (None, None),  # the bundled model as it is
    ("qwen2", "Qwen2Tokenizer"),
    ("mistral", "LlamaTokenizerFast"),  # declared Llama over a ByteLevel tokenizer.json: transformers' special case
    ("llama", "GPT2Tokenizer"),
    ("qwen2", None),  # no class declared: the model type's own
])  # fmt: skip
def test_the_same_tokenizer_as_a_plain_auto_tokenizer(model_dir, tmp_path, model_type, tokenizer_class):
    path = tmp_path / "model"
    shutil.copytree(model_dir, path, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    if model_type is not None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        tokenizer_config.pop("tokenizer_class", None)
        if tokenizer_class is not None:
            tokenizer_config["tokenizer_class"] = tokenizer_class
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    ours, plain = Tokenizer(path).hf, AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(plain)
    assert ours.encode(TEXT) == plain.encode(TEXT)
    assert ours.decode(plain.encode(TEXT)) == plain.decode(plain.encode(TEXT))
    assert (ours.bos_token_id, ours.eos_token_id) == (plain.bos_token_id, plain.eos_token_id)
    if plain.chat_template:
        assert ours.apply_chat_template(MESSAGES, tokenize=False) == plain.apply_chat_template(MESSAGES, tokenize=False)
