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
    check_applicability,
    write_proposal,
)
from vramgate.profiles.diff import (
    PatchError,
    parse_diff,
)
from vramgate.profiles.manifest import (
    CheckpointFormat,
    Profile,
    ProfileClaim,
    ProfileError,
    default_expectation,
    find_profile,
    load_profile,
    load_profiles,
    patches_dir,
    profiles_for_suite,
    requirement_problem,
)
from vramgate.profiles.overlay import build_overlay, check, installed_target, patched_files, target_covers

__all__ = [
    "STATUSES",
    "Applicability",
    "CheckpointFormat",
    "PatchError",
    "Profile",
    "ProfileClaim",
    "ProfileError",
    "build_overlay",
    "check",
    "check_applicability",
    "default_expectation",
    "find_profile",
    "installed_target",
    "load_profile",
    "load_profiles",
    "parse_diff",
    "patched_files",
    "patches_dir",
    "profiles_for_suite",
    "requirement_problem",
    "target_covers",
    "write_proposal",
]
