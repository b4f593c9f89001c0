"""Every process's flags, ``KVSERVE_*`` variables and ``--help`` come from its settings model (``rpc.settings``):
a flag beats its variable, which beats the default; a wrong value is one line naming the flag (and the
variable it came from) with exit status 2; ``kvserve up`` passes its options on by walking the models."""

from __future__ import annotations

import types
import typing
from pathlib import Path

import pytest

from decode_service.settings import DecodeSettings
from engine import EngineConfig
from engine.config import ModelSettings
from kvserve.healthcheck import HealthcheckSettings
from kvserve.settings import UP_SET_FIELDS, UpSettings
from prefill_service.settings import PrefillSettings
from router.settings import RouterSettings
from rpc.options import REDIS_URL_ENV
from rpc.settings import Settings, fields_of, parse_settings, settings_argv, settings_from_argv, settings_parser
from rpc.worker_options import WORKER_SET_FIELDS

PROCESSES = [(DecodeSettings, WORKER_SET_FIELDS), (PrefillSettings, WORKER_SET_FIELDS), (RouterSettings, ()),
             (UpSettings, UP_SET_FIELDS), (HealthcheckSettings, ())]  # fmt: skip


def _fail(model_cls, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(model_cls, argv, "prog")
    assert exit_info.value.code == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prog: error:")]
    return line


@pytest.mark.parametrize(("model_cls", "exclude"), PROCESSES)
def test_help_lists_every_field_with_its_default_and_variable(model_cls, exclude):
    text = " ".join(settings_parser(model_cls, "prog", exclude=exclude).format_help().split())
    for name, info in model_cls.model_fields.items():
        flag, env = "--" + name.replace("_", "-"), f"KVSERVE_{name.upper()}"
        if name in exclude:
            assert flag + " " not in text
        elif info.is_required():
            assert f"{name} {info.description} (env {env})" in text
        else:
            assert flag in text and f"; env {env}" in text
    if model_cls is DecodeSettings:
        assert "(default: 16; env KVSERVE_BLOCK_SIZE)" in text and "--device {auto,cpu,cuda}" in text
        assert "--enable-prefix-caching [true|false]" in text and "(default: true; env" in text


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    assert parse_settings(DecodeSettings, []).max_waiting == 64
    monkeypatch.setenv("KVSERVE_MAX_WAITING", "7")
    monkeypatch.setenv("KVSERVE_BLOCK_SIZE", "32")
    settings = parse_settings(DecodeSettings, ["--max-waiting", "9"])
    assert (settings.max_waiting, settings.block_size, settings.engine_config().block_size) == (9, 32, 32)
    monkeypatch.setenv("KVSERVE_INSECURE_INTERNAL", "true")
    assert parse_settings(RouterSettings, []).insecure_internal is True
    assert parse_settings(RouterSettings, ["--insecure-internal", "false"]).insecure_internal is False


def test_booleans_take_true_or_false_and_a_bare_flag_means_true():
    assert parse_settings(DecodeSettings, ["--no-shm"]).no_shm is True
    assert parse_settings(DecodeSettings, ["--enforce-eager", "FALSE", "--no-shm", "true"]).enforce_eager is False
    assert parse_settings(RouterSettings, ["--decode-address", "a:1", "--decode-address", "b:2"]).decode_address == [
        "a:1",
        "b:2",
    ]
    names = ["--served-model-name", "a", "b", "--served-model-name", "c"]  # vLLM's spelling, and repeated
    assert parse_settings(RouterSettings, names).served_model_name == ["a", "b", "c"]


def test_the_registry_url_comes_from_its_variable_where_its_password_belongs(monkeypatch):
    assert REDIS_URL_ENV == "KVSERVE_REDIS_URL"
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:secret@127.0.0.1:1/0")
    for model_cls in (DecodeSettings, PrefillSettings, RouterSettings, UpSettings):
        assert parse_settings(model_cls, []).redis_url == "redis://:secret@127.0.0.1:1/0"


def test_a_wrong_flag_value_is_one_line_naming_the_flag(capsys):
    line = _fail(DecodeSettings, ["--block-size", "0"], capsys)
    assert "argument --block-size: invalid value '0'" in line and "greater than or equal to 1" in line
    assert "--device: invalid value 'tpu'" in _fail(PrefillSettings, ["--device", "tpu"], capsys)
    assert "--migrate-streams: invalid value 'maybe'" in _fail(RouterSettings, ["--migrate-streams", "maybe"], capsys)
    assert "--prefill: invalid value 'two'" in _fail(UpSettings, ["--prefill", "two"], capsys)


def test_a_wrong_variable_is_one_line_naming_the_flag_and_the_variable_but_not_its_value(monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_KV_CACHE_DTYPE", "fp4-secret")
    line = _fail(DecodeSettings, [], capsys)
    assert "argument --kv-cache-dtype (from $KVSERVE_KV_CACHE_DTYPE)" in line and "fp4-secret" not in line
    monkeypatch.delenv("KVSERVE_KV_CACHE_DTYPE")
    monkeypatch.setenv("KVSERVE_DECODE_ADDRESS", "a:1")  # a list's variable is JSON
    assert "argument --decode-address (from $KVSERVE_DECODE_ADDRESS)" in _fail(RouterSettings, [], capsys)
    assert "argument address (or $KVSERVE_ADDRESS) is required" in _fail(HealthcheckSettings, [], capsys)


def _other_value(model_cls, name: str) -> object:
    """A valid value of field ``name`` other than its default."""
    info = model_cls.model_fields[name]
    kind = info.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None
        [kind] = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if kind is bool:
        return not info.default
    if typing.get_origin(kind) is typing.Literal:
        return typing.get_args(kind)[-1]
    if kind in (int, float):
        return kind(info.default or 0) + 1
    return f"some-{name}"


def test_kvserve_up_passes_every_engine_option_on_to_its_workers(monkeypatch):
    monkeypatch.delenv("KVSERVE_COMPILE_DECODE", raising=False)  # (tests/conftest.py sets it for test clusters)
    names = fields_of(EngineConfig, UP_SET_FIELDS)
    assert set(names) | set(UP_SET_FIELDS) == set(EngineConfig.model_fields)
    given = {name: _other_value(EngineConfig, name) for name in names}
    given["streaming_window"] = 64  # (at least a block and more than the sinks: EngineConfig checks them together)
    given["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3}  # (JSON on a worker's command line)  # fmt: skip
    up = UpSettings(**given)
    for worker_cls in (DecodeSettings, PrefillSettings):
        engine = parse_settings(worker_cls, up.engine_argv()).engine_config()
        assert {name: getattr(engine, name) for name in names} == given
    assert UpSettings().engine_argv() == []  # only what was given: a worker's own defaults stay its own


def test_with_tenants_the_workers_schedule_by_priority_unless_told_otherwise(tmp_path):
    keys = str(tmp_path / "keys.toml")
    workers = parse_settings(DecodeSettings, UpSettings(api_keys_file=keys).engine_argv()).engine_config()
    assert workers.scheduling_policy == "priority"  # (router.fair_queue ranks requests past a share by priority)
    told = UpSettings(api_keys_file=keys, scheduling_policy="fcfs").engine_argv()
    assert parse_settings(DecodeSettings, told).engine_config().scheduling_policy == "fcfs"


def test_kvserve_up_passes_the_model_and_stream_options_to_the_router_and_tls_files_to_it_only(tmp_path):
    up = UpSettings(model="m", skip_tokenizer_init=True, migrate_streams=False, tls_cert="c.pem", tls_key="k.pem",
                    cluster_token_file=str(tmp_path / "token"), insecure_internal=True)  # fmt: skip
    router = parse_settings(RouterSettings, [*settings_argv(settings_from_argv(ModelSettings, up.engine_argv()),
                                                            fields_of(ModelSettings)), *up.router_argv()])  # fmt: skip
    assert (router.model, router.skip_tokenizer_init, router.migrate_streams) == ("m", True, False)
    argv = up.security_argv()
    assert argv[argv.index("--tls-cert") + 1] == str(Path("c.pem").absolute())
    assert "--insecure-internal" in argv and "--cluster-token-file" not in argv  # the token goes by environment


def test_every_process_model_reads_one_environment():
    assert Settings.model_config == ModelSettings.model_config
    for model_cls, _ in PROCESSES:
        assert model_cls.model_config["env_prefix"] == "KVSERVE_" and model_cls.model_config["extra"] == "forbid"


def test_the_prefix_caching_flag_parses_true_or_false_and_round_trips():
    off = parse_settings(DecodeSettings, ["--enable-prefix-caching", "false"])
    assert off.engine_config().enable_prefix_caching is False
    again = parse_settings(DecodeSettings, settings_argv(off, fields_of(EngineConfig)))
    assert again.enable_prefix_caching is False and again.engine_config().enable_prefix_caching is False
    assert parse_settings(DecodeSettings, ["--enable-prefix-caching", "TRUE"]).enable_prefix_caching is True
    assert parse_settings(DecodeSettings, []).engine_config().enable_prefix_caching is True
    with pytest.raises(SystemExit):
        parse_settings(DecodeSettings, ["--enable-prefix-caching", "maybe"])
