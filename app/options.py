"""`option(...)`: an option declared once, as a dataclass field with what the CLI, the docs and
validation need; `Options`: the validation and `from_dict` shared by EngineConfig
(app/config.py) and ServerConfig (app/server_config.py)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound="Options")


def option(
    default: Any,
    help: str,
    *,
    doc_default: str | None = None,
    choices: tuple[str, ...] | None = None,
    flags: tuple[str, ...] = (),
    minimum: float | None = None,
    exclusive_minimum: float | None = None,
    maximum: float | None = None,
    parse: Callable[[Any], Any] | None = None,
    app_arg: bool = True,
) -> Any:
    """A field with what the CLI, the docs and validation need. flags: extra names besides
    --field-name; doc_default: the default as people read it, when the value alone does not
    say it; minimum / exclusive_minimum / maximum: bounds of a number (None passes); parse:
    turns a CLI string or a config file's value into the field's type; app_arg: False for an
    option `ppserve serve` reads itself (Ray, the HTTP proxy), which build_app does not take."""
    # named as in JSON Schema: values.schema.json states the same (tests/unit/test_options.py)
    bounds = {"minimum": minimum, "exclusiveMinimum": exclusive_minimum, "maximum": maximum}
    return dataclasses.field(
        default=default,
        metadata={
            "help": help,
            "doc_default": doc_default,
            "choices": choices,
            "flags": flags,
            "bounds": {k: v for k, v in bounds.items() if v is not None},
            "parse": parse,
            "app_arg": app_arg,
        },
    )


class Options:
    """Base of a frozen dataclass of option() fields: each is checked at construction."""

    def __post_init__(self) -> None:
        """The one validation of every option: its type, choices and bounds (from option())."""
        for f in option_fields(type(self)):
            check_option(type(self), f, getattr(self, f.name))

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any]) -> T:
        """From CLI/Serve args: accepts dashes or underscores and any flag name of an option
        (pp, pipeline_parallel_size...), rejects unknown keys."""
        names = option_names(cls)
        fields = {f.name: f for f in option_fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = names.get(key.lstrip("-").replace("-", "_"))
            if name is None:
                kind = cls.__name__.removesuffix("Config").lower()  # engine, server
                raise ValueError(f"unknown {kind} option {key!r}")
            parse = fields[name].metadata["parse"]
            kwargs[name] = parse(value) if parse and value is not None else value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload,no-any-return]


def option_fields(cls: type[Options]) -> tuple[dataclasses.Field[Any], ...]:
    """The option() fields of a dataclass deriving from Options."""
    return dataclasses.fields(cls)  # type: ignore[arg-type]


def option_names(cls: type[Options]) -> dict[str, str]:
    """Every accepted key (field names and flag names, underscored) -> its field name."""
    names = {}
    for f in option_fields(cls):
        names[f.name] = f.name
        for flag in f.metadata["flags"]:
            names[flag.lstrip("-").replace("-", "_")] = f.name
    return names


def check_option(cls: type[Options], f: dataclasses.Field[Any], value: Any) -> None:
    """Raise a ValueError naming the option when `value` is not of its type, choices or bounds."""
    hint = option_hints(cls)[f.name]
    if value is None:
        if type(None) in typing.get_args(hint):
            return
        raise ValueError(f"{f.name} may not be None")
    typ = option_type(cls, f)
    # bool is an int to Python, not to a user; an int is a fine float
    if typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, typ)
    if not ok:
        raise ValueError(f"{f.name} must be a {typ.__name__}, got {value!r}")
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")
    bounds = f.metadata["bounds"]
    if "minimum" in bounds and value < bounds["minimum"]:
        raise ValueError(f"{f.name} must be >= {bounds['minimum']}, got {value!r}")
    if "exclusiveMinimum" in bounds and value <= bounds["exclusiveMinimum"]:
        raise ValueError(f"{f.name} must be > {bounds['exclusiveMinimum']}, got {value!r}")
    if "maximum" in bounds and value > bounds["maximum"]:
        raise ValueError(f"{f.name} must be <= {bounds['maximum']}, got {value!r}")


_HINTS: dict[type, dict[str, Any]] = {}


def option_hints(cls: type[Options]) -> dict[str, Any]:
    """The class's field types, resolved once (its annotations are strings)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def option_type(cls: type[Options], f: dataclasses.Field[Any]) -> type:
    """The field's value type, Optional unwrapped (int | None -> int, dict[str, Any] -> dict)."""
    hint = option_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        args = []  # a generic (dict[str, Any]), not an Optional
    inner = args[0] if args else hint
    typ: type = typing.get_origin(inner) or inner
    return typ
