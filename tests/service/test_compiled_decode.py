"""``compile_decode``: one sequence's decode steps run their layers in one C call (``NativeDecode``), or through
``torch.compile`` where that is off, and their LM head compiled (``engine.models.compiled_decode``'s
``CompiledDecode``). Here, not in tests/engine/, because inductor starts the C++ compiler.

Both sum in other orders than the eager step (fused loops, their own reductions), so their greedy tokens are
compared with transformers', as every engine path's are; and once compiled at start, growing sequences never
compile again (a recompile would stall a request for seconds)."""

from __future__ import annotations

import pytest
import torch
from engine_testing import BLOCK_SIZE, greedy
from torch._dynamo.utils import counters
from torch._inductor import cpu_vec_isa

from engine import LLMEngine
from engine.models.compiled_decode import GreedyHead, cache_per_instruction_set, head_logits


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """One engine for the module: compiling takes 10-40 s."""
    return LLMEngine(model="default", device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=256,
                     max_num_seqs=8, compile_decode=True)  # fmt: skip


def _run_alone(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request(prompt, greedy())
    tokens = []
    while engine.has_unfinished_requests():
        tokens = next((o.token_ids for o in engine.step() if o.finished), tokens)
    return tokens


@pytest.fixture(scope="module")
def inductor_engine() -> LLMEngine:
    """An engine whose decode layers run inductor's graph, as where the C kernels are off (``KVSERVE_CPU_KERNELS=0``,
    as here) or refuse the model (``native_decode.refusal``: a bfloat16 model)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_CPU_KERNELS", "0")
        engine = LLMEngine(model="default", device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=256,
                           max_num_seqs=8, compile_decode=True)  # fmt: skip
    assert engine.runner.model.compiled.native is None
    return engine


def _decode_counted(engine: LLMEngine, prompts: list[list[int]], want: list[list[int]]) -> dict[str, int]:
    """Each prompt alone, its greedy tokens checked against transformers'; the calls of each compiled part."""
    compiled = engine.runner.model.compiled
    frames = counters["stats"]["unique_graphs"]
    calls = dict.fromkeys(("native", "layer", "logits", "greedy"), 0)
    real = {name: getattr(compiled, name) for name in calls}

    def counted(name):
        def call(*args):
            calls[name] += 1
            return real[name](*args)

        return None if real[name] is None else call

    for name in calls:
        setattr(compiled, name, counted(name))
    try:
        for prompt, tokens in zip(prompts, want, strict=True):
            assert _run_alone(engine, prompt) == tokens, f"prompt of {len(prompt)} tokens"
    finally:
        for name, function in real.items():
            setattr(compiled, name, function)
    assert counters["stats"]["unique_graphs"] == frames, "a decode step compiled again after the start"
    return calls


def test_one_sequence_decodes_in_one_c_call_and_gives_transformers_tokens(engine, engine_prompts, hf_greedy):
    compiled = engine.runner.model.compiled
    assert compiled is not None and compiled.compile_s > 0 and compiled.native is not None
    calls = _decode_counted(engine, engine_prompts, hf_greedy)
    decode_steps = sum(len(w) - 1 for w in hf_greedy)  # (each first token comes from the prefill)
    assert calls["native"] == decode_steps and calls["layer"] == 0  # every decode step ran in the C step
    assert calls["greedy"] == decode_steps  # each decode step's token through the bfloat16 head
    assert calls["logits"] == len(hf_greedy)  # the prefills' first tokens through the compiled float32 head


def test_one_sequence_decodes_through_inductor_where_the_c_step_is_off(inductor_engine, engine_prompts, hf_greedy):
    calls = _decode_counted(inductor_engine, engine_prompts[:3], hf_greedy[:3])
    decode_steps = sum(len(w) - 1 for w in hf_greedy[:3])
    assert calls["layer"] == decode_steps * inductor_engine.model_config.num_layers and calls["native"] == 0
    assert calls["greedy"] == decode_steps


def test_the_bfloat16_head_takes_the_float32_argmax_where_bfloat16_rounding_reverses_two_rows(engine):
    """``GreedyHead``: rows a and b of a copy of the bundled head nearly tie for a hidden state that only they
    answer strongly. Rounded to bfloat16, b's logit is the larger; in float32 a's is. The head must pick a, as
    the float32 logits do; without its margins it would pick b (and it still must pick the same token as the
    float32 head on real hidden states)."""
    compiled = engine.runner.model.compiled
    weight = compiled.greedy.weight.clone()
    a, b, ulp = 100, 200, 2.0**-7  # (bfloat16's spacing just above 1)
    weight[a, :2] = torch.tensor([1 + 0.49 * ulp, 1 + 0.49 * ulp])  # rounds to (1, 1): 2 against 2 + 0.98 ulp
    weight[b, :2] = torch.tensor([1 + 0.51 * ulp, 1 - 0.05 * ulp])  # rounds to (1 + ulp, 1): 2 + ulp, 2 + 0.46 ulp
    hidden = torch.zeros(1, weight.shape[1])
    hidden[0, :2] = 100.0
    head = GreedyHead(weight)
    with torch.inference_mode():
        exact = weight @ hidden[0]
        assert int(exact.argmax()) == a
        assert int((head.shadow.float() @ hidden[0]).argmax()) == b  # (what bfloat16 alone would pick)
        assert int(head(hidden)) == a
        torch.manual_seed(0)
        for _ in range(20):  # the real head, on hidden states of the bundled model's scale
            hidden = torch.randn(1, weight.shape[1]) * 2
            assert int(compiled.greedy(hidden)) == int(head_logits(engine.runner.model, hidden).argmax())


def test_a_row_that_asks_log_probabilities_reads_the_float32_logits(engine, engine_prompts, hf_greedy, monkeypatch):
    def refuse(*args):
        raise AssertionError("the bfloat16 head decided a token whose log-probabilities were asked")

    monkeypatch.setattr(engine.runner.model.compiled, "greedy", refuse)
    engine.add_request(engine_prompts[0], greedy(logprobs=1))
    tokens = []
    while engine.has_unfinished_requests():
        tokens = next((o.token_ids for o in engine.step() if o.finished), tokens)
    assert tokens == hf_greedy[0]


def test_decode_steps_run_the_compiled_code_past_dynamos_guards(engine, engine_prompts):
    """``GuardsOnce``: once each layer's kinds of call are known (the start's warm-up steps and the test above),
    a decode step evaluates no guards; the tokens are checked against transformers above."""
    engine.add_request(engine_prompts[0], greedy())
    for _ in range(3):  # the prefill, then decode steps
        engine.step()
    with torch.profiler.profile() as profile:
        engine.step()
    names = [event.name for event in profile.events()]
    assert any(name.startswith("## Call CompiledFxGraph") for name in names)  # (the step did run compiled)
    assert "TorchDynamo Cache Lookup" not in names
    while engine.has_unfinished_requests():
        engine.step()


def test_a_batch_of_several_decodes_eagerly_with_the_same_tokens(engine, engine_prompts, hf_greedy, monkeypatch):
    def refuse(*args):
        raise AssertionError("a batch of 4 ran compiled")

    monkeypatch.setattr(engine.runner.model.compiled, "native", refuse)
    monkeypatch.setattr(engine.runner.model.compiled, "logits", refuse)
    monkeypatch.setattr(engine.runner.model.compiled, "greedy", refuse)
    ids = [engine.add_request(p, greedy()) for p in engine_prompts[:4]]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert [done[i] for i in ids] == hf_greedy[:4]


def test_each_instruction_set_compiles_into_a_directory_of_its_own(tmp_path, monkeypatch):
    """``cache_per_instruction_set``: inductor's cache keys leave the instruction set out. A process with
    ``ATEN_CPU_CAPABILITY=avx2`` that shared the cache of AVX-512 processes loaded their compiled decode step
    and gave token 0 at every step (and a small graph compiled in the other order corrupted the heap)."""
    if not cpu_vec_isa.valid_vec_isa_list():
        pytest.skip("inductor vectorizes for no instruction set on this CPU")
    directories = []
    for capability in ("default", None):  # no vector instructions, then this CPU's best
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        if capability is None:
            monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        directory = cache_per_instruction_set()
        assert directory.is_dir() and directory.parent == tmp_path
        assert cache_per_instruction_set() == directory  # a second engine in the process: not nested again
        directories.append(directory.name)
    assert directories[0] != directories[1], directories
