"""Which implementation serves which vLLM version: one small table per concern.

Where the gate reads vLLM's internals (KV specs, the scheduler's construction,
the engine's figures), the supported versions' differences live in one adapter
per concern, chosen here by the running version. A version no entry covers is
an error naming the concern and the versions that are supported, never a silent
fallback to another version's code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

T = TypeVar("T")


class UnsupportedVersion(RuntimeError):
    """A version that no adapter of a concern covers."""


def pick(table: Mapping[str, T], version: str, concern: str) -> T:
    """The entry of *table* (version specifier -> adapter) whose specifier covers *version*.

    Pre-releases and local versions (``0.32.0+cpu``) count as their release. :class:`UnsupportedVersion`
    names *concern* and the supported specifiers when none covers it, or more than one does.
    """
    try:
        release = Version(Version(version).base_version)
    except InvalidVersion:
        raise UnsupportedVersion(f"{concern}: {version!r} is not a version") from None
    matches = []
    for spec, adapter in table.items():
        try:
            if release in SpecifierSet(spec):
                matches.append((spec, adapter))
        except InvalidSpecifier:
            raise UnsupportedVersion(f"{concern}: {spec!r} is not a version specifier") from None
    if len(matches) != 1:
        supported = "; ".join(table)
        why = "no adapter covers" if not matches else "more than one adapter covers"
        raise UnsupportedVersion(f"{concern}: {why} vLLM {version} (supported: {supported})")
    return matches[0][1]
