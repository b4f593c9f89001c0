"""One configuration file for every kvserve process and for the offline engine: ``kvserve up --config FILE``,
``python -m decode_service|prefill_service|router --config FILE`` and ``LLM(**load_config(FILE))``.

YAML (``.yaml``, ``.yml``) or TOML (``.toml``), told by the extension. The keys are the options' names as
``--help`` lists them, with ``_`` (``max-model-len`` reads as ``max_model_len``)::

    model: default            # the top level: the engine's options, for every process that has them
    max_model_len: 2048
    num_blocks: 512
    up:                       # a section per process: its own options, over the top level's
      decode: 2
      served_model_name: [smol]
    decode:
      max_num_seqs: 64
      max_waiting: 128
    prefill:
      max_wait_ms: 5
    router:
      route_load_weight: 2.0

* The top level holds the engine's options (``EngineConfig``: what ``LLM(...)`` takes). A worker takes them
  all but ``shared_kv_name`` (it names its own pool), the router those it has (``model``,
  ``skip_tokenizer_init``, ``max_model_len``). ``kvserve up`` passes the file on to every process it starts,
  and refuses what it sets on their command lines itself (``kvserve.launcher.plan``).
* ``up``, ``router``, ``decode`` and ``prefill`` (``SECTIONS``) hold one process's options, any of its flags;
  a key there wins over the top level's for that process only. A key its process does not know is refused,
  as is a top-level key that is not an engine option, with the nearest name when one is close.
  The process options sit in sections rather than at the top level because each process checks every key it
  is given, and a worker or the engine cannot know the router's or the launcher's options (each package sees
  only those below it: ``tests/unit/test_layers.py``), so could not tell them from a misspelt one.
* Precedence, in every process: a flag, then its ``KVSERVE_*`` variable, then the process's section, then the
  top level, then the default. ``load_config`` leaves out what the environment sets, so that holds in
  ``LLM(...)`` too, where a keyword argument given beside the file's is the flag.

Values are validated by the process's own settings model, with the rest of its options; a refused one is one
line naming the file and the key (``decode.max_waiting``). So is a missing file, one that does not parse, a
key given twice and a section that is not a table.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsError

from engine.config import EngineConfig

SECTIONS = {"up": "kvserve up", "router": "the router", "decode": "a decode worker", "prefill": "a prefill worker"}


@dataclass(frozen=True)
class ConfigFile:
    """A configuration file, read and its keys checked: the top level (engine options) and the sections, keys
    spelled with ``_``. A section's keys are checked against its process's options when one reads it."""

    path: Path
    top_level: dict[str, Any]
    sections: dict[str, dict[str, Any]]

    @classmethod
    def read(cls, path: str | Path) -> ConfigFile:
        """``ValueError`` naming the file for one that is missing, does not parse, or has a key out of place."""
        path = Path(path)
        top_level, sections = {}, {}
        for key, value in _named(_parse(path), path, "").items():
            if key in SECTIONS:
                if not isinstance(value, dict):
                    raise ValueError(f"{path}: {key} must be a table of {SECTIONS[key]}'s options, not {value!r}")
                sections[key] = _named(value, path, f"{key}.")
            elif key in EngineConfig.model_fields:
                top_level[key] = value
            else:
                raise ValueError(f"{path}: {key}: unknown key{_nearest(key, [*EngineConfig.model_fields, *SECTIONS])};"
                                 f" the top level takes the engine's options, a process's own go in its section "
                                 f"({', '.join(SECTIONS)})")  # fmt: skip
        return cls(path, top_level, sections)

    def options(self, section: str | None, fields: Collection[str]) -> dict[str, Any]:
        """What a reader of ``section`` whose options are ``fields`` takes: the top level's keys among them, and
        over those every key of its section, each of which must be one of ``fields`` (``ValueError``)."""
        own = self.sections.get(section, {}) if section else {}
        for key in own:
            if key not in fields:
                raise ValueError(f"{self.path}: {section}.{key}: {SECTIONS[section]} has no such option"
                                 f"{_nearest(key, fields)}")  # fmt: skip
        return {key: value for key, value in self.top_level.items() if key in fields} | own

    def key(self, section: str | None, name: str) -> str:
        """Where option ``name`` of ``section``'s reader is in the file: ``decode.max_waiting`` or ``num_blocks``."""
        return f"{section}.{name}" if section and name in self.sections.get(section, {}) else name

    def describe(self, section: str | None, name: str, message: str) -> str:
        """One line for a value of the file that the reader's model refused."""
        own = self.sections.get(section, {}) if section else {}
        value = own[name] if name in own else self.top_level[name]
        return f"{self.path}: {self.key(section, name)}: invalid value {value!r}: {message}"


def options_from_file(config: ConfigFile, section: str | None, model_cls: type[BaseSettings],
                      given: Iterable[str] = (), exclude: Iterable[str] = ()) -> dict[str, Any]:  # fmt: skip
    """The options ``config`` gives a ``model_cls`` reader of ``section`` (but ``exclude``, which it does not
    take), less those ``given`` (its flags) or its environment sets: they win over the file."""
    skipped = set(exclude)
    found = config.options(section, [name for name in model_cls.model_fields if name not in skipped])
    overridden = set(given) | set(EnvSettingsSource(model_cls)())
    return {name: value for name, value in found.items() if name not in overridden}


def load_config(path: str | Path) -> dict[str, Any]:
    """The engine's options in the configuration file ``path`` (its top level), validated, as ``LLM``'s keyword
    arguments: ``LLM(**load_config("kvserve.yaml"))``. An option its ``KVSERVE_*`` variable sets is left out,
    so the environment wins over the file as in every process. ``ValueError`` naming the file and the key."""
    config = ConfigFile.read(path)
    try:
        options = options_from_file(config, None, EngineConfig)
        engine = EngineConfig(**options)
    except SettingsError as err:  # a variable of a structured option that is not JSON
        raise ValueError(str(err)) from None
    except ValidationError as err:
        lines = [config.describe(None, str(e["loc"][0]), e["msg"]) if e["loc"] and e["loc"][0] in options
                 else e["msg"] for e in err.errors()]  # fmt: skip
        raise ValueError("; ".join(lines)) from None
    return {name: getattr(engine, name) for name in options}


def _parse(path: Path) -> object:
    kind = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: a configuration file is YAML (.yaml, .yml) or TOML (.toml)")
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"{path}: cannot read the configuration file: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: a configuration file is UTF-8 text") from None
    if kind == "TOML":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path}: not valid TOML: {err}") from None
    import yaml  # (only for a YAML file)

    try:
        return yaml.load(text, _unique_key_loader(yaml))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ValueError(f"{path}: not valid YAML: {err.problem}{where}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None


def _unique_key_loader(yaml: Any) -> type:
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last silently)."""

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):
                    continue  # (the safe loader refuses it itself)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice",
                                                            key_node.start_mark)  # fmt: skip
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def _named(table: object, path: Path, prefix: str) -> dict[str, Any]:
    """``table``'s keys with ``-`` read as ``_``; ``ValueError`` for a table that is not one, a key that is
    not a name, or one given twice in two spellings."""
    if table is None:  # an empty YAML file
        return {}
    if not isinstance(table, dict):
        raise ValueError(f"{path}: {prefix.rstrip('.') or 'the file'} must be a table of options, "
                         f"not {type(table).__name__}")  # fmt: skip
    named: dict[str, Any] = {}
    for key, value in table.items():
        if not isinstance(key, str):
            raise ValueError(f"{path}: {prefix}{key!r}: a key is an option's name")
        name = key.replace("-", "_")
        if name in named:
            raise ValueError(f"{path}: {prefix}{name} is given twice")
        named[name] = value
    return named


def _nearest(name: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.8)  # a misspelling, not another option
    return f" (did you mean {close[0]}?)" if close else ""
