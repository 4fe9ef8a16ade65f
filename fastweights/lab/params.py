"""Checking what the page (or anyone) sends: every field typed, finite and in range.

Each endpoint declares its fields as a dict ``name -> Field``; :func:`parse` turns
a JSON object into clean Python values or raises :class:`LabInputError`, whose
message names the field, what was expected and what was received. The server
answers such an error with 400 and the message; the page shows it in the panel.
The ranges bound the work one request can ask for (the largest request of each
endpoint is timed in ``tests/lab/test_lab.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence


class LabInputError(ValueError):
    """A request the lab cannot compute: a missing, unknown, non-finite or out-of-range field."""


@dataclass(frozen=True)
class Field:
    """One request field: ``kind`` is ``"int"``, ``"float"``, ``"choice"``, ``"bool"``, ``"vectors"`` or
    ``"bits"`` (a string of 0s and 1s, at most ``most`` long)."""

    kind: str
    default: Any
    lo: Optional[float] = None
    hi: Optional[float] = None
    choices: Sequence[str] = ()
    #: for ``"choice"``: earlier spellings still accepted, each mapped to its current choice
    aliases: Optional[Dict[str, str]] = None
    #: for ``"vectors"``: the length of each vector and the most vectors allowed; for ``"bits"``: the most bits
    width: int = 0
    most: int = 0


def _number(name: str, value: Any, field: Field) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # a HugeNumber too: its repr says so
        raise LabInputError(f"`{name}` must be a number in [{field.lo:g}, {field.hi:g}], got {value!r}")
    if not math.isfinite(value):
        raise LabInputError(f"`{name}` must be a finite number in [{field.lo:g}, {field.hi:g}], got {value!r}")
    if not field.lo <= value <= field.hi:
        raise LabInputError(f"`{name}` must be in [{field.lo:g}, {field.hi:g}], got {value!r}")
    return value


def _one(name: str, value: Any, field: Field) -> Any:
    if field.kind == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise LabInputError(f"`{name}` must be an integer in [{field.lo:g}, {field.hi:g}], got {value!r}")
        return int(_number(name, value, field))
    if field.kind == "float":
        return float(_number(name, value, field))
    if field.kind == "bool":
        if not isinstance(value, bool):
            raise LabInputError(f"`{name}` must be true or false, got {value!r}")
        return value
    if field.kind == "choice":
        if field.aliases and isinstance(value, str):
            value = field.aliases.get(value, value)
        if value not in field.choices:
            raise LabInputError(f"`{name}` must be one of {', '.join(field.choices)}; got {value!r}")
        return value
    if field.kind == "vectors":
        if not isinstance(value, list) or not 1 <= len(value) <= field.most:
            raise LabInputError(f"`{name}` must be a list of 1 to {field.most} vectors of {field.width} numbers, "
                                f"got {value!r:.80}")
        out = []
        for i, vec in enumerate(value):
            if not isinstance(vec, list) or len(vec) != field.width:
                raise LabInputError(f"`{name}[{i}]` must be a list of {field.width} numbers, got {vec!r:.80}")
            out.append([_number(f"{name}[{i}]", x, field) for x in vec])
        return out
    if field.kind == "bits":
        if not isinstance(value, str):
            raise LabInputError(f"`{name}` must be a string of 0s and 1s, got {value!r:.80}")
        bits = "".join(value.split())  # spaces and line breaks are only for reading
        if not 1 <= len(bits) <= field.most or set(bits) - {"0", "1"}:
            raise LabInputError(f"`{name}` must be 1 to {field.most} characters 0 or 1, got {value!r:.80}")
        return bits
    raise AssertionError(field.kind)


def parse(body: Any, fields: Dict[str, Field], endpoint: str) -> Dict[str, Any]:
    """Clean ``body`` (a JSON object) against ``fields``; missing fields take their defaults."""
    if not isinstance(body, dict):
        raise LabInputError(f"{endpoint}: the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise LabInputError(f"{endpoint}: unknown field(s) {', '.join(map(repr, unknown))}; "
                            f"expected some of {', '.join(fields)}")
    try:
        return {name: _one(name, body[name], f) if name in body else f.default for name, f in fields.items()}
    except LabInputError as e:
        raise LabInputError(f"{endpoint}: {e}") from None


def defaults(fields: Dict[str, Field]) -> Dict[str, Any]:
    return {name: f.default for name, f in fields.items()}


def describe(fields: Dict[str, Field]) -> Dict[str, Dict[str, Any]]:
    """The fields as the page needs them to build its controls (ranges, choices, defaults)."""
    return {name: {"kind": f.kind, "default": f.default, "lo": f.lo, "hi": f.hi, "choices": list(f.choices)}
            for name, f in fields.items()}
