"""Typed dataclasses from YAML-like mappings: the one loader behind config sections and estimator options.

A field declared with :func:`option` carries its help text and the range or choices every value is
checked against; :func:`build` turns a mapping into the dataclass, naming an unknown key (with the
closest valid one), a value of the wrong type, or one out of range, in one line. Standard library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import types
import typing
from dataclasses import field
from typing import Any

#: The largest random seed: numpy's generators take none above it.
LARGEST_SEED = 2**32 - 1


class ConfigError(ValueError):
    """A bad key or value in a config file, an override or an estimator's options."""


def first_few(items: typing.Sequence, describe: typing.Callable[[Any], str] = str, shown: int = 3) -> str:
    """The first ``shown`` of ``items`` described, with ", ..." where there are more: a one-line error's list."""
    return ", ".join(map(describe, items[:shown])) + (", ..." if len(items) > shown else "")


def utf8_text(path: Any, data: bytes, *, error: type[ValueError] = ValueError, encoding: str = "utf-8") -> str:
    """``data``, the bytes of the file at ``path``, as text; bytes that are not UTF-8 are one ``error`` naming the
    file, the line and the byte (``encoding="utf-8-sig"``: a byte-order mark first is skipped)."""
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte {data[err.start]:#04x}); save the file as UTF-8") from None


def option(default: Any = None, help: str = "", *, factory: Any = None, ge: float | None = None,
           gt: float | None = None, le: float | None = None, lt: float | None = None,
           choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with its help text and the range or choices every value is checked against."""
    metadata = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


#: The bounds an ``option`` may declare: how each reads and how each is checked.
_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


def bounds_text(metadata: Any) -> str:
    """What a field allows, as ``nemo-jq train --help`` prints it (``>= 1``, ``one of a, b``, ``>= 1, or auto`` for a
    number that may also be one of its words)."""
    words = metadata.get("choices") or ()
    numbers = " and ".join(f"{symbol} {metadata[key]}" for key, (symbol, _) in _BOUNDS.items() if metadata.get(key) is not None)
    if numbers and words:
        return f"{numbers}, or {', '.join(words)}"
    return "one of " + ", ".join(words) if words else numbers


def build(cls: type, raw: Any, prefix: str, root: type | None = None) -> Any:
    """``cls`` from the mapping ``raw``; nested dataclass fields are built from nested mappings.

    ``prefix`` is the dotted path keys are named by in errors (``"objective.options."``); ``root``, the whole config's
    class (``cls`` itself where ``prefix`` is empty): a key unknown in its section but known in another is said so.
    """
    root = root or (cls if not prefix else None)
    if raw is None and prefix:  # ``train:`` with nothing under it
        raise ConfigError(f"{prefix.rstrip('.')} is empty (a `{prefix.rstrip('.').split('.')[-1]}:` line with nothing "
                          "under it): give its keys under it, or remove the line")
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping; got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            close = _sections_holding(root, key) or [f"{prefix}{match}" for match in difflib.get_close_matches(str(key), fields, n=1)]
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else f"; valid keys: {sorted(fields)}"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = build(hint, value, f"{prefix}{name}.", root)
        else:
            values[name] = check_range(check_type(value, hint, f"{prefix}{name}"), fields[name].metadata, f"{prefix}{name}")
    required = [name for name, f in fields.items() if name not in values and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    if required:  # a field without a default (a plugin's options): its key must be given
        raise ConfigError(f"{prefix}{required[0]} is required (it has no default): set {prefix}{required[0]}=...")
    return cls(**values)


def check_defaults(cls: type, prefix: str) -> None:
    """Each default of the dataclass ``cls`` checked as a value given for it would be (a plugin's options: a default
    out of its own range, or of another type, trained as it was)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if default is dataclasses.MISSING:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            check_defaults(hints[f.name], f"{prefix}{f.name}.")
        else:
            check_range(check_type(default, hints[f.name], f"{prefix}{f.name}"), f.metadata, f"{prefix}{f.name}")


def _sections_holding(root: type | None, key: Any) -> list[str]:
    """``section.key`` for each section of ``root`` (the whole config's class; None: not known) that has ``key``."""
    if root is None:
        return []
    return [f"{name}.{key}" for name, section in typing.get_type_hints(root).items()
            if dataclasses.is_dataclass(section) and key in {field.name for field in dataclasses.fields(section)}]


def check_range(value: Any, metadata: Any, key: str) -> Any:
    """The value, if it lies in the field's range or choices; else an error naming the key and what is allowed."""
    if value is None or isinstance(value, bool):
        return value
    choices = metadata.get("choices")
    if choices and isinstance(value, str) and value not in choices:  # a number is held to the field's range
        raise ConfigError(f"{key} must be {bounds_text(metadata)}; got {value!r}")
    if isinstance(value, (int, float)) and not all(
        check(value, metadata[key]) for key, (_, check) in _BOUNDS.items() if metadata.get(key) is not None
    ):
        raise ConfigError(f"{key} must be {bounds_text(metadata)}; got {value!r}")
    return value


#: The largest whole number a config key takes (torch's sizes and seeds are 64-bit).
INT64_MAX = 2**63 - 1


def check_type(value: Any, hint: Any, key: str) -> Any:
    """The value as the annotation ``hint`` wants it (an int where a float is wanted becomes a float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for alternative in inner[1:]:  # the first names the error when none fits
            try:
                return check_type(value, alternative, key)
            except ConfigError:
                pass
        return check_type(value, inner[0], key)
    if origin is typing.Literal:  # a plugin's option of a few values
        if any(value == allowed and type(value) is type(allowed) for allowed in args):
            return value
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, args))}; got {value!r}")
    expected = origin or hint
    number = as_float(value) if expected is float else None
    if number is not None:
        if not math.isfinite(number):  # .inf passes every range check, then breaks what runs on it
            raise ConfigError(f"{key} must be a finite number; got {value!r}")
        return number
    if expected is list and isinstance(value, list) and args:  # each item, so no later check meets a stray type
        return [check_type(item, args[0], f"{key}[{index}]") for index, item in enumerate(value)]
    if expected is int and isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        # past every range check's upper end only where it has one: torch's sizes and seeds take 64-bit integers
        raise ConfigError(f"{key} must be a whole number within ±{INT64_MAX} (64 bits); got {value}")
    if expected is Any or (isinstance(value, expected) and not (expected is int and isinstance(value, bool))):
        return value
    raise ConfigError(f"{key} must be {getattr(expected, '__name__', expected)}; got {value!r}{_quoting_hint(expected, value, key)}")


def as_float(value: Any) -> float | None:
    """The number ``value`` reads as (an int, or a string: YAML 1.1 reads 1e-6, with no dot, as one); None if none."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int past the largest float
        return math.inf
    except ValueError:
        return None


def _quoting_hint(expected: Any, value: Any, key: str) -> str:
    """How to get the string YAML read as something else: a bool (yes/no/on/off), a mapping ({question}) or a list."""
    if expected is not str:
        return ""
    if isinstance(value, bool):
        return " (YAML reads yes/no/on/off as true/false: quote the word)"
    if isinstance(value, (dict, list)):
        shape, kind = ("{...}", "a mapping") if isinstance(value, dict) else ("[...]", "a list")
        return f" (YAML reads {shape} as {kind}: quote the value, e.g. {key}='\"{shape}\"')"
    return ""


def describe_fields(cls: type, instance: Any, prefix: str, only: list[str] | None = None) -> list[str]:
    """One line per leaf field (``prefix.key = default   range; help``), nested dataclasses walked;
    ``only``: just these fields."""
    import yaml

    lines = []
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            lines += describe_fields(type(value), value, f"{prefix}{f.name}.")
            continue
        shown = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        text = f"  {prefix}{f.name} = {shown}"
        extras = "; ".join(part for part in (bounds_text(f.metadata), f.metadata.get("help", "")) if part)
        lines.append(f"{text:<44} {extras}" if extras else text)
    return lines
