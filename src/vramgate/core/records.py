"""Records read from JSON: a dataclass's fields, checked strictly, with errors that name the field and the file.

Specs the gate writes for its children and the results they write back are dataclasses stored as JSON
objects. :func:`record_fields` is the one check of such an object against its dataclass: it must be an
object, have every field without a default, and (unless the record tolerates them) no field the dataclass
does not know.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def record_fields(
    cls: type[Any], data: object, where: str, error: Callable[[str], Exception], *, ignore_unknown: bool = False
) -> dict[str, Any]:
    """The fields of dataclass *cls* found in the JSON value *data*, checked; raises ``error(message)`` when
    *data* is not an object, lacks a field without a default, or (unless *ignore_unknown*, which drops
    them) has a field *cls* does not know.

    Messages start with *where* (the file or part of it the data came from; nothing when empty) and name
    the fields: ``spec.json: unknown field(s) blok_size; accepted: ...``, ``rank0.json: missing field(s)
    compute_s``.
    """
    prefix = f"{where}: " if where else ""
    if not isinstance(data, dict):
        raise error(f"{prefix}must be a JSON object, got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = sorted(set(data) - names)
    if unknown and not ignore_unknown:
        raise error(f"{prefix}unknown field(s) {', '.join(unknown)}; accepted: {', '.join(sorted(names))}")
    required = {f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise error(f"{prefix}missing field(s) {', '.join(missing)}")
    return {name: value for name, value in data.items() if name in names}


def read_json(path: Path, error: Callable[[str], Exception], where: str | None = None) -> Any:
    """The JSON data of the file *path*; ``error(message)`` raised with a message that names the file (or
    *where*) and says what is wrong: it cannot be read, or it is not valid JSON (with line and column)."""
    name = where or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{name}: cannot be read: {exc}") from None
    return parse_json(text, error, name)


def parse_json(text: str, error: Callable[[str], Exception], where: str) -> Any:
    """The JSON data of *text*; ``error(message)`` raised naming *where* and the line and column when it is not
    valid JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
