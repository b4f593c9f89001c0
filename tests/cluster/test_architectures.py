"""Qwen3, Gemma 3, Phi-3 (Phi-4-mini's layout) and Qwen3-MoE: greedy tokens equal transformers' ``generate``
token for token in float32 on the CPU, batched and unbatched, with prefix caching and through a 1P1D cluster;
a checkpoint's missing and extra tensors are named; each family's chat template renders as transformers'.

Each model is a tiny random checkpoint made by transformers' own config and model classes, with the family's
real head layout (grouped KV heads, a head_dim apart from hidden / heads) and its switches: Gemma 3 with a
window of 8 over local layers interleaved with global ones (prompts run past it), Phi-3 with Phi-4-mini's
partial rotary (0.75), LongRoPE and tied embeddings, Qwen3-MoE with 8 experts, 2 per token, renormalised.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.bundled import SUPPORTED_ARCHITECTURES, resolve_model
from engine.model_config import ModelConfig
from engine.models.loader import load_model

VOCAB, BLOCK, NEW_TOKENS = 512, 4, 12
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=256, initializer_range=0.1,
             pad_token_id=None, bos_token_id=None, eos_token_id=None)  # fmt: skip
FAMILIES = {
    "qwen3": dict(model_type="qwen3"),
    "gemma3": dict(model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3": dict(model_type="phi3", hidden_size=96, partial_rotary_factor=0.75, tie_word_embeddings=True,  # head 24
                 original_max_position_embeddings=64,  # past every test sequence: the short factors
                 rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(9)],
                               "long_factor": [2.0 + i for i in range(9)]}),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[2]),
}  # fmt: skip
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}  # fmt: skip


def _write(path, family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**SHAPE, **FAMILIES[family]}),
                                             dtype=torch.float32)  # fmt: skip
    with torch.no_grad():  # transformers starts norms at 1 (Gemma's at 0) and biases at 0: hide no code path
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint directory, transformers' model of it)."""
    path, model = _write(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, model


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_generate(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_config_reads_each_familys_switches(family):
    name, path, _ = family
    config = ModelConfig.from_dir(path)
    assert config.architecture == ARCHITECTURES[name] and config.head_dim == 24
    assert config.qk_norm == (name != "phi3")
    if name == "gemma3":
        assert config.sliding_window == 8 and config.sliding_window_layers == config.local_rope_layers == (0, 1, 3)
        assert (config.local_rope_theta, config.rope_scaling["factor"], config.embed_scale) == (1e4, 2.0, 8.0)
        assert (config.norm_weight_offset, config.attention_scale) == (1.0, 32**-0.5)
        assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
    if name == "phi3":
        assert (config.rotary_dim, config.rope_scaling["original_max_position_embeddings"]) == (18, 64)
    if name == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok, config.moe_layers) == (8, 2, (0, 1, 3))


def test_greedy_equals_transformers_batched_unbatched_and_from_the_prefix_cache(family):
    """Prompts of 5, 23 and 41 tokens (past Gemma's window of 8, over many 4-token blocks), all at once and
    one at a time; then a prompt sharing 32 tokens with the longest one, whose blocks come from the cache."""
    _, path, model = family
    prompts = [_prompt(5, 1), _prompt(23, 2), _prompt(41, 3)]
    expected = [hf_generate(model, p) for p in prompts]
    llm = LLM(str(path), skip_tokenizer_init=True, block_size=BLOCK, num_blocks=128)
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == expected
    for prompt, answer in zip(prompts, expected, strict=True):
        assert llm.generate([prompt], GREEDY)[0].token_ids == answer
    sharing = prompts[2][:32] + _prompt(7, 4)
    [out] = llm.generate([sharing], GREEDY)
    assert out.num_cached_tokens == 32
    assert out.token_ids == hf_generate(model, sharing)


# Phi-3's split (fused q/k/v and gate/up cut part by part: tests/unit/test_tensor_parallel_split.py) on demand:
# pytest -m soak tests/cluster/test_architectures.py -k tensor_parallel
@pytest.mark.parametrize("family", ["qwen3", "gemma3", pytest.param("phi3", marks=pytest.mark.soak), "qwen3_moe"],
                         indirect=True)  # fmt: skip
def test_two_tensor_parallel_ranks_give_one_devices_greedy_tokens(family):
    """Each family split over two ranks (gloo): one KV head and half the query heads, MLP width (every expert's,
    for Qwen3-MoE) and vocabulary each; the tokens and logprobs of one device (``tensor_parallel_testing``)."""
    from tensor_parallel_testing import assert_same_greedy

    _, path, _ = family
    prompts = [_prompt(5, 1), _prompt(23, 2), _prompt(41, 3)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    common = dict(skip_tokenizer_init=True, block_size=BLOCK, num_blocks=128, max_num_batched_tokens=32)
    single = LLM(str(path), **common).generate(prompts, params)
    split = LLM(str(path), tensor_parallel_size=2, **common)
    try:
        assert split.engine.runner.kv_spec.num_kv_heads == 1
        assert not assert_same_greedy(single, split.generate(prompts, params))
    finally:
        split.engine.close()


def test_phi3_longrope_switches_to_its_long_factors_where_transformers_does(tmp_path):
    """transformers turns positions from original_max_position_embeddings on with the long factors; a sequence
    that crosses it mid-answer (prompt 20, original 32) gets its tokens. (Past that length transformers also
    recomputes the whole sequence once, with long factors: this is where the engine, which keeps the keys it
    has, differs from it; see README, "Models".)"""
    overrides = dict(FAMILIES["phi3"], original_max_position_embeddings=32)
    path = tmp_path / "phi3-long"
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**SHAPE, **overrides}), dtype=torch.float32)
    model.save_pretrained(path)
    llm = LLM(str(path), skip_tokenizer_init=True, block_size=BLOCK, num_blocks=64)
    prompt = _prompt(20, 5)
    expected = hf_generate(model.eval(), prompt, 12)  # positions 20..31: transformers' cache holds, short factors
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids == (
        expected
    )
    cos_sin = llm.engine.runner.model.ropes["global"].cos_sin
    hf_cos, _ = model.model.rotary_emb(cos_sin, torch.tensor([[40]]))  # a forward through 40: the long factors
    assert torch.allclose(cos_sin[40, :9], hf_cos[0, 0, :9], atol=1e-6)


def _rewrite(src, dst, change) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(("name", "dropped", "named"), [
    ("qwen3_moe", "model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"),
    ("qwen3_moe", "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight"),
    ("phi3", "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"),
    ("gemma3", "model.layers.2.post_feedforward_layernorm.weight", "model.layers.2.post_feedforward_layernorm.weight"),
])  # fmt: skip
def test_a_missing_tensor_is_named(tmp_path, name, dropped, named):
    src, _ = _write(tmp_path / "src", name)
    _rewrite(src, tmp_path / "broken", lambda tensors: tensors.pop(dropped))
    config = ModelConfig.from_dir(tmp_path / "broken")
    with pytest.raises(ValueError, match=f"lacks {named}"):
        load_model(tmp_path / "broken", config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(("name", "extra", "shape"), [
    ("qwen3_moe", "model.layers.0.mlp.experts.8.down_proj.weight", (64, 32)),  # an expert past the 8
    ("qwen3", "model.layers.0.self_attn.rotary_proj.weight", (4, 4)),
    ("phi3", "model.layers.0.mlp.gate_up_proj.weight", (96, 96)),  # there, but half the size it should be
])  # fmt: skip
def test_an_extra_or_misshapen_tensor_is_named(tmp_path, name, extra, shape):
    src, _ = _write(tmp_path / "src", name)
    _rewrite(src, tmp_path / "broken", lambda tensors: tensors.__setitem__(extra, torch.zeros(shape)))
    config = ModelConfig.from_dir(tmp_path / "broken")
    with pytest.raises(ValueError, match=f"checkpoint tensor '{extra}' has"):
        load_model(tmp_path / "broken", config, torch.float32, torch.device("cpu"))


def test_an_unsupported_architecture_is_refused_with_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM") as err:
        resolve_model(str(tmp_path))
    for architecture in ARCHITECTURES.values():
        assert architecture in str(err.value) and architecture in SUPPORTED_ARCHITECTURES


# -- chat templates: the families' published templates (tokenizer_config.json's chat_template), written out in
# tests/support/chat_templates (no download) ---------------------------------------------------------------------------
TEMPLATES = Path(__file__).parents[1] / "support" / "chat_templates"

# template file (Qwen3-MoE's is Qwen3's), model type, special tokens (bos, eos first), whether encoding adds bos
CHAT_FAMILIES = {
    "qwen3": ("qwen3.jinja", "qwen3", [None, "<|im_end|>", "<|im_start|>", "<|endoftext|>"], False),
    "gemma3": ("gemma3.jinja", "gemma3_text", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], True),
    "phi3-mini": ("phi3-mini.jinja", "phi3", ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
                                               "<|end|>"], True),
    "phi4-mini": ("phi4-mini.jinja", "phi3", [None, "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
                                               "<|end|>"], False),
}  # fmt: skip
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Café, 東京? "},
        {"role": "assistant", "content": "Tokyo."}, {"role": "user", "content": "And Paris?"}]  # fmt: skip


def _tokenizer_dir(path, family: str):
    """A byte-level tokenizer (no merges) with the family's special tokens and chat template, as
    ``PreTrainedTokenizerFast`` (the class transformers builds from a tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    template_file, model_type, specials, adds_bos = CHAT_FAMILIES[family]
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([token for token in specials if token])
    bos, eos = specials[:2]
    if adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "chat_template": (TEMPLATES / template_file).read_text(),
    }))  # fmt: skip
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    return path


@pytest.mark.parametrize("family", list(CHAT_FAMILIES))
def test_chat_template_renders_and_encodes_as_transformers_does(tmp_path, family):
    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer

    path = _tokenizer_dir(tmp_path / family, family)
    ours, plain = Tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    for messages in (CHAT, CHAT[1:2]):
        text = ours.apply_chat_template(messages)
        assert text == plain.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        expected = plain.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert ours.encode_chat(messages) == expected  # the template's own <bos>, not a second one
    if family == "gemma3":  # no system turn: its text opens the first user turn
        assert ours.apply_chat_template(CHAT) == (
            "<bos><start_of_turn>user\nBe brief.\n\nCafé, 東京?<end_of_turn>\n"
            "<start_of_turn>model\nTokyo.<end_of_turn>\n"
            "<start_of_turn>user\nAnd Paris?<end_of_turn>\n<start_of_turn>model\n"
        )
        assert ours.encode_chat(CHAT)[:2] == [ours.hf.bos_token_id, ours.hf.convert_tokens_to_ids("<start_of_turn>")]
        assert ours.encode("hi")[0] == ours.hf.bos_token_id  # (plain text still gets it)


# The MoE in make test; Qwen3, Gemma 3 and Phi-3 on demand (~7 s each of make test's time; each family's greedy
# tokens are checked in one process above): pytest -m soak tests/cluster/test_architectures.py -k cluster
@pytest.mark.parametrize("family", [pytest.param("qwen3", marks=pytest.mark.soak),
                                    pytest.param("gemma3", marks=pytest.mark.soak),
                                    pytest.param("phi3", marks=pytest.mark.soak), "qwen3_moe"],
                         indirect=True)  # fmt: skip
def test_greedy_through_a_1p1d_cluster(family, tmp_path):
    """The prefill worker computes the prompt (past Gemma's window) and writes its KV into the decode worker's
    blocks; the decode worker goes on: transformers' tokens."""
    from cluster_utils import discard

    from kvserve.client import Client
    from kvserve.launcher.cluster import free_base_port, start_cluster
    from kvserve.settings import parse_up

    _, path, model = family
    prompt = _prompt(41, 6)
    argv = ["--model", str(path), "--skip-tokenizer-init", "true", "--block-size", str(BLOCK), "--num-blocks", "64"]
    c = start_cluster(parse_up([*argv, "--port", str(free_base_port()), "--http-port", "0", "--log-dir", str(tmp_path),
                                "--threads", "1"]))  # fmt: skip
    try:
        with Client(c.endpoint, timeout_s=60) as client:
            result = client.generate(prompt, temperature=0, max_tokens=8, ignore_eos=True)
    finally:
        discard(c)
    assert (result.prefill_worker, result.transfer_backend) == ("prefill-0", "shm")
    assert result.token_ids == hf_generate(model, prompt, 8)
