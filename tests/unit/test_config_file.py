"""One configuration file for every process (``engine.config_file``): YAML or TOML, its top level the engine's
options and a section per process; a flag beats its variable, which beats the process's section, which beats
the top level, which beats the default; every bad file is one line naming the file and the key, and
``kvserve up`` refuses one before it starts anything (``kvserve.launcher.plan``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode_service.settings import DecodeSettings
from engine import load_config
from engine.config_file import ConfigFile
from kvserve.launcher.plan import plan_cluster
from kvserve.settings import parse_up
from prefill_service.settings import PrefillSettings
from router.settings import RouterSettings
from rpc.settings import parse_settings, settings_from_argv
from rpc.worker_options import WORKER_SET_FIELDS

YAML = """\
model: default
max-model-len: 512        # a dash reads as an underscore
num_blocks: 64
speculative_config: {method: ngram, num_speculative_tokens: 2}
up:
  decode: 2
  served_model_name: [smol, smol-instruct]
decode:
  max_num_seqs: 8
  max_waiting: 5
prefill:
  max_wait_ms: 3.5
router:
  route_load_weight: 2.5
"""
TOML = """\
model = "default"
max-model-len = 512
num_blocks = 64

[speculative_config]
method = "ngram"
num_speculative_tokens = 2

[up]
decode = 2
served_model_name = ["smol", "smol-instruct"]

[decode]
max_num_seqs = 8
max_waiting = 5

[prefill]
max_wait_ms = 3.5

[router]
route_load_weight = 2.5
"""


def _file(tmp_path, text: str, name: str = "kvserve.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _decode(argv: list[str]) -> DecodeSettings:
    return parse_settings(DecodeSettings, argv, "prog", exclude=WORKER_SET_FIELDS, section="decode")


def _error(model_cls, argv: list[str], section: str, capsys) -> str:
    """The one line a process prints for a refused ``argv`` (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(model_cls, argv, "prog", section=section)
    assert exit_info.value.code == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prog: error:")]
    return line


@pytest.mark.parametrize(("name", "text"), [("kvserve.yaml", YAML), ("kvserve.yml", YAML), ("kvserve.toml", TOML)])
def test_yaml_and_toml_give_each_process_the_top_level_and_its_own_section(tmp_path, name, text):
    path = _file(tmp_path, text, name)
    decode = _decode(["--config", path])
    assert (decode.model, decode.max_model_len, decode.num_blocks, decode.max_num_seqs, decode.max_waiting) == (
        "default", 512, 64, 8, 5)  # fmt: skip
    assert decode.engine_config().speculative_config == {"method": "ngram", "num_speculative_tokens": 2,
                                                         "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # fmt: skip
    prefill = parse_settings(PrefillSettings, ["--config", path], section="prefill")
    assert (prefill.num_blocks, prefill.max_num_seqs, prefill.max_wait_ms) == (64, 256, 3.5)  # no decode section
    router = parse_settings(RouterSettings, ["--config", path], section="router")
    assert (router.model, router.max_model_len, router.route_load_weight) == ("default", 512, 2.5)
    up = parse_up(["--config", path])
    assert (up.decode, up.served_model_name, up.num_blocks) == (2, ["smol", "smol-instruct"], 64)


def test_a_flag_beats_its_variable_which_beats_the_section_which_beats_the_top_level_which_beats_the_default(
    tmp_path, monkeypatch
):
    top_only = _file(tmp_path, "max_num_seqs: 10\n", "top.yaml")
    both = _file(tmp_path, "max_num_seqs: 10\ndecode: {max_num_seqs: 20}\n", "both.yaml")
    assert _decode([]).max_num_seqs == 256
    assert _decode(["--config", _file(tmp_path, "{}\n", "empty.yaml")]).max_num_seqs == 256
    assert _decode(["--config", top_only]).max_num_seqs == 10
    assert _decode(["--config", both]).max_num_seqs == 20
    monkeypatch.setenv("KVSERVE_MAX_NUM_SEQS", "30")
    assert _decode(["--config", both]).max_num_seqs == 30
    assert _decode(["--config", both, "--max-num-seqs", "40"]).max_num_seqs == 40
    assert _decode(["--max-num-seqs", "40", "--config", both]).max_num_seqs == 40  # wherever --config stands


def test_a_section_refuses_an_option_its_process_does_not_have_and_names_the_nearest(tmp_path, capsys):
    path = _file(tmp_path, "router:\n  max_waitng: 3\n")
    line = _error(RouterSettings, ["--config", path], "router", capsys)
    assert f"{path}: router.max_waitng: the router has no such option" in line
    line = _error(DecodeSettings, ["--config", _file(tmp_path, "decode: {max_waitng: 3}\n")], "decode", capsys)
    assert "decode.max_waitng: a decode worker has no such option (did you mean max_waiting?)" in line
    # another process's section is that process's business: the decode worker reads it no further
    assert _decode(["--config", _file(tmp_path, "router: {max_waitng: 3}\n")]).max_waiting == 64


@pytest.mark.parametrize(("text", "expected"), [
    ("max_num_seq: 3\n", "max_num_seq: unknown key (did you mean max_num_seqs?); the top level takes the engine's "
                         "options, a process's own go in its section (up, router, decode, prefill)"),
    ("port: 9000\n", "port: unknown key"),  # a process's option, whose place is its section
    ("decode: 2\n", "decode must be a table of a decode worker's options, not 2"),
    ("num_blocks: 1\nnum-blocks: 2\n", "num_blocks is given twice"),
    ("num_blocks: 1\nnum_blocks: 2\n", "not valid YAML: 'num_blocks' is given twice (line 2, column 1)"),
    ("num_blocks: [1\n", "not valid YAML: expected ',' or ']', but got '<stream end>'"),
    ("- num_blocks\n", "the file must be a table of options, not list"),
    ("1: 2\n", "1: a key is an option's name"),
])  # fmt: skip
def test_a_bad_file_is_one_line_naming_the_file_and_the_key(tmp_path, capsys, text, expected):
    path = _file(tmp_path, text)
    line = _error(DecodeSettings, ["--config", path], "decode", capsys)
    assert line.startswith(f"prog: error: {path}: ") and expected in line
    with pytest.raises(ValueError, match="^" + path):
        load_config(path)


def test_a_missing_file_a_bad_toml_file_and_an_unknown_format_are_refused(tmp_path, capsys):
    missing = str(tmp_path / "none.toml")
    assert f"{missing}: cannot read the configuration file: No such file or directory" in _error(
        DecodeSettings, ["--config", missing], "decode", capsys)  # fmt: skip
    bad = _file(tmp_path, "num_blocks = \n", "bad.toml")
    assert f"{bad}: not valid TOML: " in _error(DecodeSettings, ["--config", bad], "decode", capsys)
    json_file = _file(tmp_path, "{}", "kvserve.json")
    assert "a configuration file is YAML (.yaml, .yml) or TOML (.toml)" in _error(
        RouterSettings, ["--config", json_file], "router", capsys)  # fmt: skip


def test_a_value_the_model_refuses_names_the_file_and_the_key_it_came_from(tmp_path, capsys, monkeypatch):
    path = _file(tmp_path, "num_blocks: [1, 2]\ndecode:\n  max_waiting: -1\n")
    line = _error(DecodeSettings, ["--config", path], "decode", capsys)
    assert f"{path}: num_blocks: invalid value [1, 2]: Input should be a valid integer" in line
    assert f"{path}: decode.max_waiting: invalid value -1: Input should be greater than or equal to 0" in line
    # a flag or a variable that wins over a bad key of the file leaves it unread
    monkeypatch.setenv("KVSERVE_NUM_BLOCKS", "8")
    settings = _decode(["--config", path, "--max-waiting", "3"])
    assert (settings.num_blocks, settings.max_waiting) == (8, 3)
    wrong_kind = _file(tmp_path, "prefill: {max_wait_ms: soon}\n", "kind.yaml")
    assert "prefill.max_wait_ms: invalid value 'soon': Input should be a valid number" in _error(
        PrefillSettings, ["--config", wrong_kind], "prefill", capsys)  # fmt: skip


def test_load_config_gives_the_engine_options_validated_and_leaves_what_the_environment_sets(tmp_path, monkeypatch):
    path = _file(tmp_path, YAML)
    assert load_config(path) == {
        "model": "default", "max_model_len": 512, "num_blocks": 64,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                               "prompt_lookup_max": 4}}  # fmt: skip
    assert load_config(_file(tmp_path, TOML, "kvserve.toml")) == load_config(path)
    monkeypatch.setenv("KVSERVE_NUM_BLOCKS", "8")
    assert "num_blocks" not in load_config(path)  # so LLM(**load_config(path)) takes 8 from the environment
    with pytest.raises(ValueError, match=r"kvserve.yaml: block_size: invalid value 0: Input should be greater"):
        load_config(_file(tmp_path, "block_size: 0\n"))


def test_kvserve_up_passes_the_file_on_and_each_child_reads_its_section(tmp_path):
    path = _file(tmp_path, YAML)
    up = parse_up(["--config", path, "--prefill", "1", "--port", "40000", "--max-num-seqs", "40"])
    decode, _, prefill, router = plan_cluster(up).children
    for child in (decode, prefill, router):
        assert child.argv[child.argv.index("--config") + 1] == str(tmp_path / "kvserve.yaml")
    assert "--num-blocks" not in decode.argv  # the top level's: the child reads it from the file
    worker = settings_from_argv(DecodeSettings, decode.argv[3:], "decode", WORKER_SET_FIELDS)
    # a flag given to kvserve up wins over the decode section, as in the worker itself
    assert (worker.num_blocks, worker.max_model_len, worker.max_num_seqs, worker.max_waiting) == (64, 512, 40, 5)
    assert worker.port == 40010  # the launcher's port, not the file's
    assert settings_from_argv(PrefillSettings, prefill.argv[3:], "prefill", WORKER_SET_FIELDS).max_wait_ms == 3.5
    routing = settings_from_argv(RouterSettings, router.argv[3:], "router")
    assert (routing.route_load_weight, routing.max_model_len) == (2.5, 512)
    assert routing.served_model_name == ["smol", "smol-instruct"]  # up's section: passed on as its flags


@pytest.mark.parametrize(("text", "expected"), [
    ("decode: {max_waiting: -1}\n", "decode-0: {path}: decode.max_waiting: invalid value -1"),
    ("router: {route_load_weight: heavy}\n", "router: {path}: router.route_load_weight: invalid value 'heavy'"),
    ("prefill: {port: 7000}\n", "{path}: prefill.port: kvserve up sets each process's port itself"),
    ("router: {drain_timeout: 1}\n", "{path}: router.drain_timeout: kvserve up sets each process's drain_timeout"),
    ("gpu_memory_utilization: 0.5\n", "{path}: gpu_memory_utilization: kvserve up sets each process's"),
    ("prefill: {max_wait_msec: 1}\nup: {prefill: 0}\n", "{path}: prefill.max_wait_msec: a prefill worker has no such "
                                                         "option (did you mean max_wait_ms?)"),  # none started
])  # fmt: skip
def test_kvserve_up_refuses_a_bad_section_before_anything_starts(tmp_path, text, expected):
    path = _file(tmp_path, text)
    with pytest.raises(ValueError) as err:
        plan_cluster(parse_up(["--config", path]))
    assert expected.format(path=path) in str(err.value)


def test_kvserve_up_refuses_an_unknown_key_of_its_own_section(tmp_path, capsys):
    path = _file(tmp_path, "up: {prefil: 2}\n")
    with pytest.raises(SystemExit):
        parse_up(["--config", path])
    assert f"kvserve up: error: {path}: up.prefil: kvserve up has no such option (did you mean prefill?)" in (
        capsys.readouterr().err)  # fmt: skip


def test_a_section_overrides_the_top_level_for_its_process_only():
    config = ConfigFile(Path("f.yaml"), {"num_blocks": 1}, {"decode": {"num_blocks": 2}})
    assert config.key("decode", "num_blocks") == "decode.num_blocks" and config.key("prefill", "num_blocks") == (
        "num_blocks")  # fmt: skip
    assert config.options("prefill", ["num_blocks"]) == {"num_blocks": 1}
    assert config.options("decode", ["num_blocks"]) == {"num_blocks": 2}


def test_the_readmes_example_file_configures_a_cluster(tmp_path):
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = text[text.index("# kvserve.yaml") :].split("```")[0]
    decode, _, prefill, router = plan_cluster(parse_up(["--config", _file(tmp_path, example)])).children
    worker = settings_from_argv(DecodeSettings, decode.argv[3:], "decode", WORKER_SET_FIELDS)
    assert (worker.num_blocks, worker.max_num_seqs, worker.max_waiting) == (512, 64, 128)
    assert settings_from_argv(PrefillSettings, prefill.argv[3:], "prefill", WORKER_SET_FIELDS).max_num_seqs == 256
    assert settings_from_argv(RouterSettings, router.argv[3:], "router").served_model_name == ["smol"]
