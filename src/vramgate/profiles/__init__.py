"""Optimization profiles: ``patches/<name>/manifest.toml`` and its ordered diffs against vLLM.

- :mod:`vramgate.profiles.manifest`: the manifest (:class:`Profile`, its claims, requirements and checkpoint),
  finding profiles, and whether this machine meets a profile's hardware needs.
- :mod:`vramgate.profiles.diff`: unified diffs: parsing, checking their paths, ``git apply``.
- :mod:`vramgate.profiles.overlay`: the installed target, the patched files, the overlay (Note [overlay]).
- :mod:`vramgate.profiles.applicability`: what a profile's diffs do on another vLLM release, with a three-way
  rebased proposal (Note [profiles on another release]).

Import this layer's public names from here (``from vramgate.profiles import ...``), not from its modules,
which may split or move.
"""

from vramgate.profiles.applicability import (
    STATUSES,
    Applicability,
    FileMerge,
    Proposal,
    check_applicability,
    unified_diff,
    write_proposal,
)
from vramgate.profiles.diff import (
    FilePatch,
    Hunk,
    HunkFailure,
    HunkOffset,
    PatchError,
    check_path,
    git_apply,
    mismatch,
    parse_diff,
)
from vramgate.profiles.manifest import (
    CheckpointFormat,
    Profile,
    ProfileClaim,
    ProfileError,
    Requirements,
    find_profile,
    load_profile,
    load_profiles,
    patches_dir,
    profiles_for_suite,
    requirement_problem,
    unmet_requirement,
)
from vramgate.profiles.overlay import build_overlay, check, installed_target, patched_files, target_covers

__all__ = [
    "STATUSES",
    "Applicability",
    "CheckpointFormat",
    "FileMerge",
    "FilePatch",
    "Hunk",
    "HunkFailure",
    "HunkOffset",
    "PatchError",
    "Profile",
    "ProfileClaim",
    "ProfileError",
    "Proposal",
    "Requirements",
    "build_overlay",
    "check",
    "check_applicability",
    "check_path",
    "find_profile",
    "git_apply",
    "installed_target",
    "load_profile",
    "load_profiles",
    "mismatch",
    "parse_diff",
    "patched_files",
    "patches_dir",
    "profiles_for_suite",
    "requirement_problem",
    "target_covers",
    "unified_diff",
    "unmet_requirement",
    "write_proposal",
]
