"""A profile applied to the installed target: the patched files and the overlay folder built from them.

Note [overlay]: a profile is applied all-or-nothing into an overlay folder,
never into the installed package: every hunk of every diff is applied in
memory first; only when all apply is a symlink farm of the installed package
built in a temporary folder (symlinks to the installed files, patched copies
of the touched ones) and renamed into place. The engine subprocess (and the
simulator's) gets the overlay first on ``PYTHONPATH``. A diff that touches a
path outside the target package, a target version outside the profile's
specifier, or a hunk whose context does not match is refused with the file,
the hunk and the reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vramgate.profiles.diff import HunkFailure, HunkOffset, PatchError, check_path, git_apply, parse_diff
from vramgate.profiles.manifest import SAME_SOURCE, Profile


def installed_target(profile: Profile) -> tuple[str, str, Path]:
    """(distribution, version, package folder) of the installed target; :class:`PatchError` if absent."""
    for dist in SAME_SOURCE[profile.distribution]:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        spec = importlib.util.find_spec(profile.package)
        if spec is None or not spec.submodule_search_locations:
            raise PatchError(f"{profile.name}: distribution {dist} is installed but package {profile.package!r} "
                             "cannot be found")
        return dist, version, Path(next(iter(spec.submodule_search_locations))).resolve()
    names = " or ".join(SAME_SOURCE[profile.distribution])
    raise PatchError(f"{profile.name}: the target {profile.distribution} ({names}) is not installed")


def target_covers(profile: Profile, version: str) -> bool:
    """Whether *version* of the target is inside the profile's version specifier; :class:`PatchError` when
    *version* is not a version."""
    try:
        return Version(version) in SpecifierSet(profile.version)
    except InvalidVersion:
        raise PatchError(f"{profile.name}: {version!r} is not a version of {profile.distribution}") from None


def patched_files(profile: Profile, package_dir: Path, version: str, notes: list[str] | None = None, *,
                  any_version: bool = False, offsets: list[HunkOffset] | None = None) -> dict[str, str]:
    """Every file the profile's series touches, with its patched text; nothing in the package is written.

    Note [diffs as git applies them]: each diff is first checked here (parseable, paths inside the target
    package, files present or new), then applied by ``git apply`` to copies of the touched files in a
    temporary folder: a hunk whose context moved (a fork of the release with lines added above it) applies
    at its offset, which goes into *notes* (and *offsets*); a hunk whose context changed is refused (no fuzz).
    The installed package is only read. *version* outside the profile's specifier is refused unless
    *any_version* (what the profile would do on another release: :mod:`vramgate.profiles.applicability`).
    """
    if not any_version and not target_covers(profile, version):
        raise PatchError(f"{profile.name}: installed {profile.distribution} {version} is outside the profile's "
                         f"target {profile.version!r}")
    base = package_dir.parent
    touched: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="vramgate-apply-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        for diff in profile.series:
            where = f"{profile.name}/{diff.name}"
            fps = parse_diff(diff.read_text(encoding="utf-8"), where)
            for fp in fps:
                rel = str(check_path(fp.path, profile.package, where))
                if rel in touched:
                    continue
                if fp.new_file:
                    if (base / rel).exists():
                        message = f"{where}: {rel} is created by the diff but already exists"
                        raise PatchError(message, (HunkFailure(where, rel, 0, "", message),))
                elif not (base / rel).is_file():
                    message = f"{where}: {rel} does not exist in the installed package"
                    raise PatchError(message, (HunkFailure(where, rel, 0, "", message),))
                else:
                    (work / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(base / rel, work / rel)
                touched.add(rel)
            moved = git_apply(diff, work, fps, where, notes)
            if offsets is not None:
                offsets.extend(moved)
        return {rel: (work / rel).read_text(encoding="utf-8") for rel in sorted(touched)}


def build_overlay(profile: Profile, dest: Path, target: tuple[str, Path] | None = None) -> Path:
    """Build the profile's overlay under *dest* (Note [overlay]); return the folder to put on PYTHONPATH.

    *target* is (version, package folder) of another install of the target (another engine environment's
    vLLM); None: the one this process imports. Overlays of other installs are named by their version.
    """
    if target is None:
        _, version, package_dir = installed_target(profile)
        final = dest / f"{profile.name}-{profile.digest}"
    else:
        version, package_dir = target
        final = dest / f"{profile.name}-{profile.digest}-{version}"
    contents = patched_files(profile, package_dir, version)
    if final.is_dir():
        return final
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{profile.name}-", dir=dest))
    try:
        base = package_dir.parent
        for dirpath, dirnames, filenames in os.walk(package_dir):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel_dir = Path(dirpath).relative_to(base)
            (tmp / rel_dir).mkdir(parents=True, exist_ok=True)
            for name in filenames:
                if (rel_dir / name).as_posix() not in contents:
                    os.symlink(Path(dirpath) / name, tmp / rel_dir / name)
        for rel_name, text in contents.items():
            (tmp / rel_name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel_name).write_text(text, encoding="utf-8")
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another run built the same overlay (same profile digest) meanwhile; it is complete, use it.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def check(profile: Profile, notes: list[str] | None = None) -> str | None:
    """Why *profile* does not apply to the installed target, or None when it does (hunks applied at an offset
    go into *notes*)."""
    try:
        _, version, package_dir = installed_target(profile)
        patched_files(profile, package_dir, version, notes)
    except PatchError as exc:
        return str(exc)
    return None
