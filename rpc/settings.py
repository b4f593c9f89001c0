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
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

S = TypeVar("S", bound=BaseSettings)


class Settings(BaseSettings):
    """Base of the option groups above the engine: fields read from ``KVSERVE_<NAME>``, unknown ones refused.
    The same configuration as ``engine.config.ModelSettings`` (the engine's base, which cannot import this
    module), so that models composed of both read one environment."""

    model_config = SettingsConfigDict(env_prefix="KVSERVE_", extra="forbid", protected_namespaces=())


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
                    exclude: Iterable[str] = ()) -> argparse.ArgumentParser:  # fmt: skip
    """An argparse parser of every field of ``model_cls`` but ``exclude`` (fields the process sets itself)."""
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
    return parser


def parse_settings(model_cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None,
                   description: str | None = None, exclude: Iterable[str] = ()) -> S:  # fmt: skip
    """``model_cls`` from the command line ``argv`` (default ``sys.argv[1:]``), the environment and the
    defaults; a refused value ends the process as argparse does (status 2, one line naming the flag)."""
    parser = settings_parser(model_cls, prog, description, exclude)
    given = vars(parser.parse_args(argv))
    try:
        return validate_settings(model_cls, given)
    except ValueError as err:
        parser.error(str(err))


def settings_from_argv(model_cls: type[S], argv: Sequence[str]) -> S:
    """``model_cls`` from the flags of ``argv`` it has (others are left for other models: a launcher reads
    its children's command lines so); ``ValueError`` names a refused flag."""
    given = vars(settings_parser(model_cls).parse_known_args(list(argv))[0])
    return validate_settings(model_cls, given)


def validate_settings(model_cls: type[S], given: dict[str, Any]) -> S:
    """``model_cls`` of the flag values ``given``, the environment and the defaults; ``ValueError`` (one
    line, naming each refused flag) instead of pydantic's errors."""
    try:
        return model_cls(**given)
    except (ValidationError, SettingsError) as err:
        raise ValueError(describe_error(model_cls, err, given)) from None


def describe_error(model_cls: type[BaseSettings], err: ValidationError | SettingsError, given: dict[str, Any]) -> str:
    """One line per refused field, naming its flag and, when the value came from there, its variable (not
    the variable's value: it may be a secret)."""
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
        else:
            lines.append(f"argument {_spelling(model_cls, name)} (from ${env_name(model_cls, name)}): {error['msg']}")
    return "; ".join(lines)


def settings_argv(settings: BaseSettings, names: Iterable[str]) -> list[str]:
    """The fields ``names`` that ``settings`` was given (by flag, variable or code) as command-line words
    that ``parse_settings`` of a model with those fields reads back to the same values."""
    argv: list[str] = []
    for name in names:
        if name not in settings.model_fields_set or (value := getattr(settings, name)) is None:
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
