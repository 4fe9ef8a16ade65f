"""Checked dataclass configs: loadable from JSON, overridable from the command line.

A config class derives from :class:`Config` and is a ``@dataclass`` whose
``__post_init__`` validates its fields. This module adds what every config needs:

- ``from_dict`` refuses unknown keys (naming them, with the nearest known key),
  so a typo in a config file is an error rather than a silently ignored setting;
- ``from_json`` / ``to_json`` read and write a file (plain JSON, never code);
- :func:`add_config_arguments` / :func:`overrides_from_args` turn each field into
  a ``--field-name`` command-line flag whose value overrides the file.
- :func:`flag` declares one field's flag in its metadata (a name, argparse options, a
  parser, a default taken from another field); :func:`add_declared_arguments` /
  :func:`config_from_declared` turn the declared fields (nested configs included) into
  flags and back into a config: the studies' command lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import tempfile
import typing
from typing import Any, Dict, Tuple, Type, TypeVar

C = TypeVar("C", bound="Config")

__all__ = ["Config", "add_config_arguments", "overrides_from_args", "flag", "NESTED_FLAGS", "add_declared_arguments",
           "declared_overrides", "config_from_declared", "atomic_write_text", "check_int", "check_ints", "is_int"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (a Python or numpy int; ``True``/``False`` are not)."""
    return not isinstance(value, bool) and isinstance(value, (int, np_integer()))


def np_integer():
    """numpy's integer base class when numpy is importable, else ``int`` (numpy is optional here)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch
        return int
    return np.integer


def _int_rule(minimum: int) -> str:
    return "a positive int" if minimum == 1 else "an int >= 0" if minimum == 0 else f"an int >= {minimum}"


def check_int(where: str, name: str, value: Any, *, minimum: int = 1, none_ok: bool = False,
              what: "str | None" = None, error: type = ValueError) -> None:
    """The one integer check: ``value`` must be an int (not a bool) >= ``minimum`` (or ``None``
    when ``none_ok``); otherwise ``error("<where>: `<name>` must be <what>, got <value>")``.

    ``what`` defaults to "a positive int" (minimum 1), "an int >= 0" (minimum 0) or
    "an int >= <minimum>"; ``where`` (e.g. ``"TrainConfig"``) may be empty.
    """
    if value is None and none_ok:
        return
    if not is_int(value) or value < minimum:
        rule = what or _int_rule(minimum) + (" or None" if none_ok else "")
        raise error(f"{where + ': ' if where else ''}`{name}` must be {rule}, got {value!r}")


def check_ints(where: str, name: str, values: Any, *, minimum: int = 1, what: "str | None" = None) -> None:
    """:func:`check_int` for every item of a non-empty sequence (``ValueError`` naming the sequence)."""
    if not values or not all(is_int(v) and v >= minimum for v in values):
        rule = what or ("positive ints" if minimum == 1 else f"ints >= {minimum}")
        raise ValueError(f"{where + ': ' if where else ''}`{name}` must hold {rule}, got {values!r}")


class Config:
    """Mixin for ``@dataclass`` configs (see the module docstring)."""

    @classmethod
    def field_names(cls) -> list:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: Type[C], data: Dict[str, Any], *, source: str = "config") -> C:
        """Build from a mapping; unknown keys raise ``ValueError`` naming them."""
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}: {source} must be a JSON object (a dict), got {type(data).__name__}")
        known = cls.field_names()
        unknown = [k for k in data if k not in known]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(
                f"{cls.__name__}: unknown config key(s) in {source}: {', '.join(hints)}; "
                f"known keys are {', '.join(known)}"
            )
        return cls(**data)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, path: "str | os.PathLike | None" = None) -> str:
        """The config as JSON text; also written (atomically) to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            atomic_write_text(path, text)
        return text

    @classmethod
    def from_json(cls: Type[C], path_or_text: "str | os.PathLike") -> C:
        """Load from a JSON file path, or from JSON text starting with ``{``."""
        text = str(path_or_text)
        source = "JSON text"
        if not text.lstrip().startswith("{"):
            source = f"file {text}"
            try:
                with open(text, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise ValueError(f"{cls.__name__}: cannot read config {source}: {e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cls.__name__}: {source} is not valid JSON: {e}") from None
        return cls.from_dict(data, source=source)

    def replace(self: C, **changes: Any) -> C:
        """A copy with some fields changed, validated again (unknown names refused)."""
        return type(self).from_dict({**self.to_dict(), **changes}, source="replace()")


def atomic_write_text(path: "str | os.PathLike", text: str) -> None:
    """Write a text file atomically: a temp file in the same folder (created if needed),
    flushed to disk, then ``os.replace``; a failed write leaves no temp file behind."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# -- command line --------------------------------------------------------------------------


def _parse_value(raw: str, annotation: Any, name: str) -> Any:
    """Turn one command-line string into a field value, by the field's annotation."""
    text = str(annotation)
    if raw.lower() in ("none", "null") and ("Optional" in text or "None" in text):
        return None
    if "bool" in text and "int" not in text:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{name}: expected true or false, got {raw!r}")
    if raw.strip().startswith(("[", "{")):  # a JSON list, e.g. --mixer '["deltanet", "softmax"]'
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--{name}: not valid JSON: {e}") from None
    for kind in (int, float):
        if kind.__name__ in text and "str" not in text:
            try:
                return kind(raw)
            except ValueError:
                if kind is int and "float" in text:
                    continue
                raise ValueError(f"--{name}: expected {kind.__name__}, got {raw!r}") from None
    if "List" in text or "list" in text:
        return [s.strip() for s in raw.split(",")] if "," in raw else raw
    return raw


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: Type[Config], title: str, defaults: "Dict[str, Any] | None" = None
) -> None:
    """Add a ``--field-name VALUE`` flag for each field of ``cls`` (absent unless given).

    The help shows each field's default; ``defaults`` names the ones a command sets
    itself (a value, or a text such as ``"from the data"``), so the help tells the truth.
    """
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else "required"
        default = defaults.get(f.name, default)
        hint = hints[f.name]
        kind = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
        about = f.metadata.get("help", "")
        text = f"{about + ' ' if about else ''}({kind}; default: {default})"
        flag = {"nargs": "?", "const": "true"} if hint is bool else {}  # a bare --fsdp means true
        group.add_argument(
            "--" + f.name.replace("_", "-"), dest=f"{cls.__name__}.{f.name}", default=argparse.SUPPRESS,
            metavar=f.name.upper(), help=text.replace("%", "%%"), **flag,
        )


def overrides_from_args(args: argparse.Namespace, cls: Type[Config]) -> Dict[str, Any]:
    """The fields of ``cls`` given on the command line, parsed to their types."""
    hints = typing.get_type_hints(cls)
    out = {}
    for key, raw in vars(args).items():
        owner, _, name = key.partition(".")
        if owner == cls.__name__:
            out[name] = _parse_value(raw, hints[name], name.replace("_", "-"))
    return out


# -- declared flags: a field names its own flag -----------------------------------------------


def flag(name: "str | None" = None, *, help: str, parse: Any = None, default_from: "str | None" = None,
         **argparse_options: Any) -> Dict[str, Any]:
    """Field metadata declaring a field's command-line flag, for :func:`add_declared_arguments`.

    Use as ``field(default=..., metadata=flag("--widths", type=int, nargs="+", parse=tuple, help=...))``.

    Args:
        name: the flag (default ``--field-name``).
        help: the help text, shown as written.
        parse: turns argparse's value into the field's value (e.g. ``tuple``); it may raise
            ``ValueError`` with a message naming the flag.
        default_from: a field whose value this one takes when its flag is not given (or parses
            to ``None``), e.g. a value width that follows the key width.
        argparse_options: passed to ``add_argument`` (``type``, ``nargs``, ``choices``,
            ``action``, ``metavar``); the flag is absent from the namespace unless given.
    """
    return {"flag": {"name": name, "help": help, "parse": parse, "default_from": default_from,
                     "options": argparse_options}}


NESTED_FLAGS = {"nested_flags": True}
"""Field metadata: the field is a dataclass whose declared flags are the parent's flags too."""


def _declared(cls: type, prefix: str = ""):
    """``(field, dest, nested class or None)`` for every field of ``cls`` with declared flags."""
    for f in dataclasses.fields(cls):
        dest = f"{prefix or cls.__name__}.{f.name}"
        if f.metadata.get("nested_flags"):  # the nested class is its default's
            yield f, dest, type(f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
        elif "flag" in f.metadata:
            yield f, dest, None


def add_declared_arguments(parser: argparse.ArgumentParser, cls: type, order: Tuple[str, ...] = ()) -> None:
    """Add to ``parser`` the flag of each field of the dataclass ``cls`` declared with :func:`flag`
    (and those of its fields marked :data:`NESTED_FLAGS`); a flag is absent from the parsed
    namespace unless given, so the config's own default (or a preset's) stands.

    Flags follow the fields' order, except that the fields named in ``order`` (``"train.d_key"``
    for a nested one) come first, in that order: a command keeps its established help.
    """
    flags = list(_flags(cls))
    rank = {name: i for i, name in enumerate(order)}
    for _path, f, dest in sorted(flags, key=lambda item: rank.get(item[0], len(rank))):
        spec = f.metadata["flag"]
        name = spec["name"] or "--" + f.name.replace("_", "-")
        options = dict(spec["options"])
        if "choices" not in options and options.get("action") is None:
            options.setdefault("metavar", name.lstrip("-").replace("-", "_").upper())
        parser.add_argument(name, dest=dest, default=argparse.SUPPRESS, help=spec["help"], **options)


def _flags(cls: type, prefix: str = "", path: str = ""):
    """``(dotted field path, field, dest)`` of every declared flag of ``cls``, nested ones included."""
    for f, dest, nested in _declared(cls, prefix):
        if nested is not None:
            yield from _flags(nested, dest, f"{path}{f.name}.")
        else:
            yield f"{path}{f.name}", f, dest


def declared_overrides(args: argparse.Namespace, cls: type, _prefix: str = "") -> Dict[str, Any]:
    """The fields of ``cls`` whose declared flags were given, parsed; a nested config's as a dict."""
    values, out = vars(args), {}
    for f, dest, nested in _declared(cls, _prefix):
        if nested is not None:
            sub = declared_overrides(args, nested, dest)
            if sub:
                out[f.name] = sub
        elif dest in values:
            parse = f.metadata["flag"]["parse"]
            out[f.name] = parse(values[dest]) if parse else values[dest]
    return out


def config_from_declared(args: argparse.Namespace, cls: type, make: Any = None, **fixed: Any) -> Any:
    """``make(**fixed, **overrides)`` (``make`` defaults to ``cls``, e.g. ``cls.full`` for a preset)
    with the declared flags given in ``args``: a nested config starts from the one ``make()``
    builds, and a ``default_from`` field not given takes its source's value."""
    make = make or cls
    overrides = {**fixed, **declared_overrides(args, cls)}
    base = None
    for f, _, nested in _declared(cls):
        if nested is not None and f.name in overrides:
            base = base or make()
            inner = getattr(base, f.name)
            kept = {g.name: getattr(inner, g.name) for g in dataclasses.fields(inner)}
            overrides[f.name] = type(inner)(**{**kept, **overrides[f.name]})
        source = f.metadata.get("flag", {}).get("default_from")
        if source and overrides.get(f.name) is None:
            overrides[f.name] = overrides[source] if source in overrides else getattr(base or make(), source)
    return make(**overrides)
