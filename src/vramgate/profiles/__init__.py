"""Optimization profiles: ``patches/<name>/manifest.toml`` and its ordered diffs against vLLM.

Import this layer's public names from here (``from vramgate.profiles import ...``), not from its modules,
which may split or move.
"""

from vramgate.profiles.manifest import (
    CheckpointFormat,
    PatchError,
    Profile,
    ProfileClaim,
    ProfileError,
    Requirements,
    build_overlay,
    check,
    find_profile,
    installed_target,
    load_profile,
    load_profiles,
    parse_diff,
    patches_dir,
    profiles_for_suite,
    unmet_here,
    unmet_requirement,
)

__all__ = [
    "CheckpointFormat",
    "PatchError",
    "Profile",
    "ProfileClaim",
    "ProfileError",
    "Requirements",
    "build_overlay",
    "check",
    "find_profile",
    "installed_target",
    "load_profile",
    "load_profiles",
    "parse_diff",
    "patches_dir",
    "profiles_for_suite",
    "unmet_here",
    "unmet_requirement",
]
