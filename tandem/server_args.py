"""ServerArgs <-> argparse: every ServerArgs field becomes a flag with SGLang's dashed spelling.

Flags are generated from `dataclasses.fields(ServerArgs)`, so a new field is on the command line
without touching this file. Types come from the annotations: bool -> store_true (or --no-x when
the default is True), Optional[X] -> X with default None, list[X] -> nargs="*", dict -> JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import Any, Optional

from engine import config as config_module
from engine.config import ServerArgs
from tandem.sglang_flags import add_sglang_flags, check_sglang_flags

# Choices shown in --help; ServerArgs.__post_init__ stays the one place that validates.
_CHOICES = {
    "schedule_policy": "SCHEDULE_POLICIES",
    "grammar_backend": "GRAMMAR_BACKENDS",
    "sampling_defaults": "SAMPLING_DEFAULTS",
    "attention_backend": "ATTENTION_BACKENDS",
    "dtype": "DTYPES",
    "load_format": "LOAD_FORMATS",
    "logprob_distribution": "LOGPROB_DISTRIBUTIONS",
    "log_level": "LOG_LEVELS",
    "chat_metadata_format": "CHAT_METADATA_FORMATS",
    "tool_call_parser": "TOOL_CALL_PARSERS",
    "reasoning_parser": "REASONING_PARSERS",
}
_SCALARS = (int, float, str)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_server_args(parser: argparse.ArgumentParser, require_model_path: bool = True) -> None:
    """Add one flag per ServerArgs field (skipping flags the parser already has)."""
    group = parser.add_argument_group("server args", "engine settings (ServerArgs fields)")
    hints = typing.get_type_hints(ServerArgs)
    for field in dataclasses.fields(ServerArgs):
        flag = flag_name(field.name)
        if flag in parser._option_string_actions:  # a subcommand defined its own meaning
            continue
        kwargs = _argparse_kwargs(field, hints[field.name])
        if field.name == "model_path":
            kwargs.update(required=require_model_path, default=None)
        group.add_argument(flag, dest=field.name, **kwargs)
    add_sglang_flags(parser)


def server_args_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """The ServerArgs fields found on ns, as kwargs for Engine(...) / ServerArgs(...).

    model_path is left out when it was not given, so a caller can supply a default. SGLang's
    launch flags given are checked (tandem.sglang_flags) and left out.
    """
    check_sglang_flags(ns)
    out = {}
    for field in dataclasses.fields(ServerArgs):
        if not hasattr(ns, field.name):
            continue
        value = getattr(ns, field.name)
        if field.name == "model_path" and value is None:
            continue
        out[field.name] = value
    return out


def _argparse_kwargs(field: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    default = _default_of(field)
    base, _ = _unwrap_optional(annotation)
    help_text = f"{field.metadata.get('help') or 'ServerArgs.' + field.name} (default: {default!r})"
    if base is bool:
        if default is True or default is None:  # None: "decide for me"; --x / --no-x override it
            return dict(action=argparse.BooleanOptionalAction, default=default, help=help_text)
        return dict(action="store_true", default=bool(default), help=help_text)
    kwargs: dict[str, Any] = dict(default=default, help=help_text)
    origin = typing.get_origin(base)
    if origin in (list, tuple):
        args = typing.get_args(base)
        kwargs.update(nargs="*", type=args[0] if args and args[0] in _SCALARS else str)
    elif base in _SCALARS:
        kwargs["type"] = base
    else:  # dicts and other structured values travel as JSON
        kwargs["type"] = json.loads
        kwargs["metavar"] = "JSON"
    choices = _choices_for(field.name)
    if choices is not None:
        kwargs["choices"] = list(choices)
    else:
        kwargs.setdefault("metavar", field.name.upper())
    return kwargs


def _choices_for(name: str) -> Optional[tuple]:
    const = _CHOICES.get(name)
    return getattr(config_module, const, None) if const else None


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return None


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """Optional[X] / X | None -> (X, True); anything else -> (annotation, False)."""
    args = typing.get_args(annotation)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return annotation, False


def server_args_to_argv(kwargs: dict[str, Any]) -> list[str]:
    """The flags that give ServerArgs(**kwargs) on a command line (defaults left out): how a tool
    starts `tandem serve` with the engine settings it was given."""
    hints = typing.get_type_hints(ServerArgs)
    argv: list[str] = []
    for field in dataclasses.fields(ServerArgs):
        if field.name not in kwargs or kwargs[field.name] == _default_of(field):
            continue
        value, flag = kwargs[field.name], flag_name(field.name)
        base, _ = _unwrap_optional(hints[field.name])
        if value is None:
            continue
        if base is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        elif typing.get_origin(base) in (list, tuple):
            argv += [flag, *map(str, value)]
        elif base in _SCALARS:
            argv += [flag, str(value)]
        else:
            argv += [flag, json.dumps(value)]
    return argv
