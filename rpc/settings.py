"""Command lines generated from settings models: one function builds every process's flags and reads them.

A process's options are one pydantic-settings model (built on ``rpc.settings.Settings``, or on
``engine.config.ModelSettings`` for the engine's, with the groups composed into it: ``rpc.options``,
``router.settings``, ...). From it, and from nothing written by hand:

* each field ``name`` is a flag ``--name`` with ``_`` as ``-``; ``bool`` takes ``true|false`` (a bare flag
  means true), a ``Literal`` shows its choices, ``list[str]`` takes one or more values and repeats,
  ``X | None`` means "unset";
* each field is also the environment variable ``KVSERVE_NAME`` (the model's ``env_prefix``): a flag wins
  over it, it wins over the field's default;
* ``--help`` shows every flag's description, default and variable, in one group per model it comes from
  (the group's title and description are its docstring's first line, split at the first ``:``);
* a value the model refuses, from a flag or a variable, is one line naming both, then exit status 2 as any
  argparse error (no traceback);
* a process reads ``--config FILE`` too (``parse_settings(..., section=...)``): a YAML or TOML file whose top
  level and whose section for this process give options (``engine.config_file``); a variable wins over it,
  and a flag over both; a value the model refuses from there is one line naming the file and the key;
* ``settings_argv`` turns the fields a model was given back into flags, so a launcher passes options on to
  its children by walking the child's model.

Values go to pydantic as the strings typed: validation happens once, in the model, whichever way a value came.
"""

from __future__ import annotations

import argparse
import json
import re
import typing
from collections.abc import Iterable, Sequence
from types import NoneType, UnionType
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import PrivateAttr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

if TYPE_CHECKING:
    from engine.config_file import ConfigFile

S = TypeVar("S", bound=BaseSettings)


class Settings(BaseSettings):
    """Base of the option groups above the engine: fields read from ``KVSERVE_<NAME>``, unknown ones refused.
    The same configuration as ``engine.config.ModelSettings`` (the engine's base, which cannot import this
    module), so that models composed of both read one environment."""

    model_config = SettingsConfigDict(env_prefix="KVSERVE_", extra="forbid", protected_namespaces=())

    # The ``--config`` file these settings were read with, and the fields whose value is its top level's (no
    # flag, variable or section of this process's set them): ``settings_argv`` leaves those to the file.
    _config_file: ConfigFile | None = PrivateAttr(None)
    _from_top_level: frozenset[str] = PrivateAttr(frozenset())

    @property
    def config_file(self) -> ConfigFile | None:
        return self._config_file


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _spelling(model_cls: type[BaseSettings], name: str) -> str:
    """How the command line names field ``name``: its flag, or itself when it is a positional argument."""
    return name if model_cls.model_fields[name].is_required() else flag_name(name)


def env_name(model_cls: type[BaseSettings], name: str) -> str:
    return f"{model_cls.model_config.get('env_prefix', '')}{name}".upper()


def _base_type(annotation: Any) -> Any:
    """``X`` of ``X | None`` (an optional value); anything else as it is."""
    if typing.get_origin(annotation) in (typing.Union, UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not NoneType]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _argument(model_cls: type[BaseSettings], name: str) -> tuple[list[str], dict[str, Any]]:
    """``add_argument``'s words and keywords for field ``name``: every value stays a string for pydantic."""
    info = model_cls.model_fields[name]
    kind = _base_type(info.annotation)
    if info.is_required():  # a positional argument, for which its variable may stand in
        about = f"{info.description} (env {env_name(model_cls, name)})"
        return [name], {"nargs": "?", "default": argparse.SUPPRESS, "help": about.replace("%", "%%")}
    default = info.get_default(call_default_factory=True)
    shown = "none" if default is None else str(default).lower() if isinstance(default, bool) else default
    about = f"{info.description} " if info.description else ""
    help_text = f"{about}(default: {shown}; env {env_name(model_cls, name)})"
    options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
    if kind is bool:
        options |= {"nargs": "?", "const": "true", "metavar": "true|false"}
    elif typing.get_origin(kind) is typing.Literal:
        options["metavar"] = "{" + ",".join(map(str, typing.get_args(kind))) + "}"
    elif typing.get_origin(kind) is list:
        options |= {"action": "extend", "nargs": "+", "help": options["help"][:-1] + ", a JSON list)"}
    elif kind in (int, float):
        options["metavar"] = "N" if kind is int else "X"
    elif typing.get_origin(kind) is dict:
        options["metavar"] = "JSON"
    return [flag_name(name)], options


def _groups(model_cls: type[BaseSettings]) -> list[tuple[type[BaseSettings], list[str]]]:
    """The fields in the order of the classes that declare them first (bases first), with those classes."""
    seen: set[str] = set()
    groups = []
    for cls in reversed(model_cls.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseSettings)) or cls is BaseSettings:
            continue
        own = [name for name in cls.model_fields if name not in seen and name in model_cls.model_fields]
        seen.update(own)
        if own:
            groups.append((cls, own))
    return groups


def settings_parser(model_cls: type[BaseSettings], prog: str | None = None, description: str | None = None,
                    exclude: Iterable[str] = (), section: str | None = None) -> argparse.ArgumentParser:  # fmt: skip
    """An argparse parser of every field of ``model_cls`` but ``exclude`` (fields the process sets itself), and
    of ``--config``, the file whose top level and ``section`` it reads, when a section is named."""
    positional = "".join(f"{name.upper()} " for name, info in model_cls.model_fields.items() if info.is_required())
    parser = argparse.ArgumentParser(prog=prog, usage=f"%(prog)s {positional}[options] (--help lists them)",
                                     description=description, argument_default=argparse.SUPPRESS, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    skipped = set(exclude)
    for cls, names in _groups(model_cls):
        title, _, about = (cls.__doc__ or cls.__name__).strip().splitlines()[0].partition(":")
        group = parser.add_argument_group(title.strip(), about.strip() or None)
        for name in names:
            if name not in skipped:
                words, options = _argument(model_cls, name)
                group.add_argument(*words, **options)
    if section is not None:
        about = (f"options from a YAML or TOML file: its top level (the engine's) and its '{section}' section "
                 "(over the top level); a flag or a KVSERVE_* variable wins over the file")  # fmt: skip
        parser.add_argument_group("configuration file", about).add_argument(
            "--config", metavar="FILE", default=argparse.SUPPRESS, help="the file (.yaml, .yml or .toml)"
        )
    return parser


def parse_settings(model_cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None,
                   description: str | None = None, exclude: Iterable[str] = (),
                   section: str | None = None) -> S:  # fmt: skip
    """``model_cls`` from the command line ``argv`` (default ``sys.argv[1:]``), the environment, the file of
    ``--config`` (offered when ``section`` names this process's section) and the defaults; a refused value
    ends the process as argparse does (status 2, one line naming the flag, or the file and the key)."""
    parser = settings_parser(model_cls, prog, description, exclude, section)
    given = vars(parser.parse_args(argv))
    try:
        return validate_settings(model_cls, given, section, exclude)
    except ValueError as err:
        parser.error(str(err))


def settings_from_argv(model_cls: type[S], argv: Sequence[str], section: str | None = None,
                       exclude: Iterable[str] = ()) -> S:  # fmt: skip
    """``model_cls`` from the flags of ``argv`` it has (others are left for other models: a launcher reads
    its children's command lines so), with its ``--config`` file when ``section`` is named; ``ValueError``
    names a refused flag or key."""
    given = vars(settings_parser(model_cls, section=section).parse_known_args(list(argv))[0])
    return validate_settings(model_cls, given, section, exclude)


def validate_settings(model_cls: type[S], given: dict[str, Any], section: str | None = None,
                      exclude: Iterable[str] = ()) -> S:  # fmt: skip
    """``model_cls`` of the flag values ``given``, the environment, the file of ``given["config"]`` (its top
    level and ``section``; not ``exclude``, which the process sets itself) and the defaults; ``ValueError``
    (one line, naming each refused flag or key) instead of pydantic's errors."""
    given = dict(given)
    path = given.pop("config", None)
    config, from_file = None, {}
    try:
        if path is not None:
            from engine.config_file import ConfigFile, options_from_file  # (loads torch: only with a file)

            config = ConfigFile.read(path)
            from_file = options_from_file(config, section, model_cls, given, exclude)
        settings = model_cls(**from_file, **given)
    except (ValidationError, SettingsError) as err:
        raise ValueError(describe_error(model_cls, err, given, config, section, from_file)) from None
    if config is not None:
        settings._config_file = config
        settings._from_top_level = frozenset(name for name in from_file if config.key(section, name) == name)
    return settings


def describe_error(model_cls: type[BaseSettings], err: ValidationError | SettingsError, given: dict[str, Any],
                   config: ConfigFile | None = None, section: str | None = None,
                   from_file: Iterable[str] = ()) -> str:  # fmt: skip
    """One line per refused field, naming its flag, or the file and key ``from_file`` it came from, or its
    variable (not the variable's value: it may be a secret)."""
    if isinstance(err, SettingsError):  # a variable of a structured field that is not JSON
        match = re.search(r'field "(\w+)"', str(err))
        name = match.group(1) if match else "?"
        return f"argument {flag_name(name)} (from ${env_name(model_cls, name)}): not a JSON list"
    lines = []
    for error in err.errors():
        error["msg"] = error["msg"].removeprefix("Value error, ")  # a validator's own words, as it wrote them
        name = str(error["loc"][0]) if error["loc"] else ""
        if name not in model_cls.model_fields:
            lines.append(error["msg"])
        elif error["type"] == "missing":
            lines.append(f"argument {_spelling(model_cls, name)} (or ${env_name(model_cls, name)}) is required")
        elif name in given:
            lines.append(f"argument {_spelling(model_cls, name)}: invalid value {given[name]!r}: {error['msg']}")
        elif config is not None and name in from_file:
            lines.append(config.describe(section, name, error["msg"]))
        else:
            lines.append(f"argument {_spelling(model_cls, name)} (from ${env_name(model_cls, name)}): {error['msg']}")
    return "; ".join(lines)


def settings_argv(settings: BaseSettings, names: Iterable[str]) -> list[str]:
    """The fields ``names`` that ``settings`` was given (by flag, variable, code or its own section of its
    ``--config`` file) as command-line words that ``parse_settings`` of a model with those fields reads back to
    the same values. What the file's top level gave is left out: a child given the file (``config_argv``)
    reads it there, where its own section may override it, as no flag could be."""
    from_top_level = settings._from_top_level if isinstance(settings, Settings) else frozenset()
    given = settings.model_fields_set - from_top_level
    return argv_of({name: getattr(settings, name) for name in names if name in given})


def config_argv(settings: BaseSettings) -> list[str]:
    """``--config FILE`` (absolute) for a child of a process that read ``settings`` with one; else nothing."""
    config = settings.config_file if isinstance(settings, Settings) else None
    return ["--config", str(config.path.absolute())] if config is not None else []


def argv_of(values: dict[str, Any]) -> list[str]:
    """Options as command-line words that ``parse_settings`` reads back to the same values (``None``: unset)."""
    argv: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, bool):
                word = str(item).lower()
            else:
                word = json.dumps(item) if isinstance(item, dict) else str(item)
            argv += [flag_name(name), word]
    return argv


def fields_of(model_cls: type[BaseSettings], exclude: Iterable[str] = ()) -> list[str]:
    """``model_cls``'s field names but ``exclude``, in declaration order: what a launcher forwards."""
    skipped = set(exclude)
    return [name for name in model_cls.model_fields if name not in skipped]
