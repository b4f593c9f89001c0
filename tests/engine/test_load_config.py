"""``LLM(**load_config(FILE))``: the offline engine runs with the configuration file's engine options, the very
file the cluster's processes read (``engine.config_file``)."""

from __future__ import annotations

from engine import LLM, SamplingParams, load_config


def test_llm_builds_its_engine_from_the_file(model_dir, tmp_path):
    path = tmp_path / "kvserve.toml"
    path.write_text(f'model = "{model_dir}"\nblock-size = 8\nnum_blocks = 48\nmax_model_len = 256\n'
                    "enable_prefix_caching = false\n\n[decode]\nmax_waiting = 3\n")  # fmt: skip
    llm = LLM(**load_config(path))
    engine = llm.engine
    assert (engine.config.block_size, engine.block_manager.num_blocks, engine.max_model_len) == (8, 48, 256)
    assert engine.config.enable_prefix_caching is False
    [out] = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
