"""Records read from JSON: a dataclass's fields, checked strictly, with errors that name the field and the file.

Specs the gate writes for its children and the results they write back are dataclasses stored as JSON
objects. :func:`record_fields` is the one check of such an object against its dataclass: it must be an
object, have every field without a default, and (unless the record tolerates them) no field the dataclass
does not know.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class RecordFormat:
    """One kind of record the gate keeps in files (baselines, report.json, an engine's result), with its version.

    Note [versioned records] (asv's ``api_version`` with its ``update_to_N``): every such record carries its
    version in ``schema``. Its format's owner declares the current version and, for every earlier one, the
    migration that turns a record of version N into N + 1; :meth:`load` applies them in order, so a file of any
    earlier version reads as the current one (a reviewed baseline is never orphaned by a bump), and a record of
    a newer version than this vramgate knows is refused, naming the file and both versions.
    """

    name: str
    """What a person calls it in a message (``baseline file``, ``report.json``)."""
    current: int
    migrations: Mapping[int, Callable[[dict[str, Any]], dict[str, Any]]] = field(default_factory=dict)
    """``{N: update}`` for every version N before :attr:`current`: *update* takes a record of version N and
    returns it as version N + 1 (its ``schema`` set by :meth:`load`)."""
    first: int = 1
    """The oldest version there ever was."""

    def __post_init__(self) -> None:
        missing = [n for n in range(self.first, self.current) if n not in self.migrations]
        if missing:
            raise ValueError(f"{self.name}: no migration from schema {', '.join(map(str, missing))}")

    def load(self, data: object, where: str, error: Callable[[str], Exception]) -> dict[str, Any]:
        """*data* (a JSON object of this kind) as the current version, migrated from its own; ``error(message)``
        naming *where* when it is not an object, has no version this vramgate knows, or is of a newer one."""
        if not isinstance(data, dict):
            raise error(f"{where}: not a vramgate {self.name}: the top level must be a JSON object")
        version = data.get("schema")
        if not isinstance(version, int) or isinstance(version, bool) or version < self.first:
            raise error(f"{where}: not a vramgate {self.name}: schema is {version!r} (versions {self.first} to "
                        f"{self.current} are known)")
        if version > self.current:
            raise error(f"{where}: {self.name} of schema {version}, newer than this vramgate reads (schema "
                        f"{self.current}): upgrade vramgate to read it")
        record = dict(data)
        for n in range(version, self.current):
            record = dict(self.migrations[n](record))
            record["schema"] = n + 1
        return record
