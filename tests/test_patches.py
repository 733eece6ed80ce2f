"""Optimization profiles without vLLM: manifests, diffs, the overlay, refusals that change nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from patch_support import tree_digest
from vramgate.profiles import (
    PatchError,
    ProfileClaim,
    ProfileError,
    build_overlay,
    load_profile,
    parse_diff,
    patched_files,
)
from vramgate.tools.cli import main as cli_main

GOOD_DIFF = """--- a/fakepkg/sched.py
+++ b/fakepkg/sched.py
@@ -1,3 +1,3 @@
 def policy():
-    return 'last'
+    return 'fewest'
""" + " \n"  # a blank context line: git anchors a hunk with less context after it than before to the file's end
MANIFEST = """name = "{name}"
description = "test profile"
suites = ["block_manager"]

[target]
distribution = "vllm"
package = "fakepkg"
version = "{version}"

[patches]
series = {series}

[[claims]]
metric = "preemptions"
compare = "ratio"
op = "<="
bound = 0.5
"""


def make_profile(root: Path, name: str, diffs: dict[str, str], version: str = "==0.32.0") -> Path:
    d = root / "patches" / name
    d.mkdir(parents=True)
    for fname, text in diffs.items():
        (d / fname).write_text(text)
    series = "[" + ", ".join(f'"{n}"' for n in diffs) + "]"
    (d / "manifest.toml").write_text(MANIFEST.format(name=name, version=version, series=series))
    return d


def test_overlay_links_untouched_files_and_copies_patched_ones(installed: Path, tmp_path: Path) -> None:
    before = tree_digest(installed)
    profile = load_profile(make_profile(tmp_path, "good", {"0001.patch": GOOD_DIFF}))
    overlay = build_overlay(profile, tmp_path / "overlays")
    assert (overlay / "fakepkg" / "sub" / "__init__.py").is_symlink()
    assert not (overlay / "fakepkg" / "sched.py").is_symlink()
    assert "'fewest'" in (overlay / "fakepkg" / "sched.py").read_text()
    code = "import fakepkg.sched as s, fakepkg.sub as b; print(s.policy(), b.VALUE)"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(overlay)}, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["fewest", "7"]
    assert tree_digest(installed) == before
    assert build_overlay(profile, tmp_path / "overlays") == overlay  # built once per content


@pytest.mark.parametrize(
    ("diff", "message"),
    [
        (GOOD_DIFF.replace(" def policy():", " def policy(x):"),
         "bad/0001.patch: fakepkg/sched.py: hunk 1 '@@ -1,3 +1,3 @@' does not apply at line 1: "
         "expected 'def policy(x):', found 'def policy():' (git apply: patch failed: fakepkg/sched.py:1)"),
        (GOOD_DIFF.replace("a/fakepkg/sched.py", "a/../evil.py").replace("b/fakepkg/sched.py", "b/../evil.py"),
         "bad/0001.patch: '../evil.py' is outside the target package 'fakepkg'; refused"),
        (GOOD_DIFF.replace("fakepkg/sched.py", "otherpkg/sched.py"),
         "'otherpkg/sched.py' is outside the target package 'fakepkg'; refused"),
        (GOOD_DIFF.replace("@@ -1,3 +1,3 @@", "@@ -1,4 +1,4 @@"), "is truncated"),
        ("just some text\n", "bad/0001.patch: no file changes found"),
    ],
    ids=["context", "escape", "other-package", "truncated", "not-a-diff"],
)
def test_bad_diffs_are_refused_and_change_nothing(installed: Path, tmp_path: Path, diff: str, message: str) -> None:
    before = tree_digest(installed)
    profile = load_profile(make_profile(tmp_path, "bad", {"0001.patch": diff}))
    with pytest.raises(PatchError) as info:
        build_overlay(profile, tmp_path / "overlays")
    assert message in str(info.value)
    assert tree_digest(installed) == before
    assert not (tmp_path / "overlays").exists() or list((tmp_path / "overlays").iterdir()) == []


def test_half_applying_series_is_all_or_nothing(installed: Path, tmp_path: Path) -> None:
    second = GOOD_DIFF.replace("return 'last'", "return 'nothing like this'")
    profile = load_profile(make_profile(tmp_path, "half", {"0001.patch": GOOD_DIFF, "0002.patch": second}))
    with pytest.raises(PatchError, match=r"half/0002\.patch: fakepkg/sched\.py: hunk 1"):
        build_overlay(profile, tmp_path / "overlays")
    assert not (tmp_path / "overlays").exists() or list((tmp_path / "overlays").iterdir()) == []


def test_wrong_version_is_refused(installed: Path, tmp_path: Path) -> None:
    profile = load_profile(make_profile(tmp_path, "old", {"0001.patch": GOOD_DIFF}, version="==0.31.0"))
    with pytest.raises(PatchError, match=r"old: installed vllm 0.32.0 is outside the profile's target '==0.31.0'"):
        build_overlay(profile, tmp_path / "overlays")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('name = "p"', 'name = "q"'), "field 'name' is 'q' but the folder is 'p'"),
        (lambda t: t.replace('version = "==0.32.0"', 'version = "zero"'), "version 'zero' is not a version specifier"),
        (lambda t: t.replace('op = "<="', 'op = "=<"'), "claims[0]: op '=<' is not one of <=, >=, <, >"),
        (lambda t: t + "\nflavour = 1\n", "unknown field(s) flavour"),
        (lambda t: t.replace('["0001.patch"]', '["0009.patch"]'), "series[0] '0009.patch' does not exist"),
        (lambda t: t.replace("[target]", "[target\n"), "not valid TOML"),
        (lambda t: t + '\n[engine_args]\nload_format = "dummy"\n',
         "[engine_args]: field 'load_format' chooses how the engine loads its weights; a profile that sets it would "
         "switch off the checks that judge it"),
        (lambda t: t + '\n[engine_args]\nmodel = "other"\n', "[engine_args]: field 'model' chooses the model"),
    ],
    ids=["name", "version", "op", "unknown", "series", "toml", "load_format", "model"],
)
def test_bad_manifests_name_the_file_and_field(tmp_path: Path, edit, message: str) -> None:
    d = make_profile(tmp_path, "p", {"0001.patch": GOOD_DIFF})
    (d / "manifest.toml").write_text(edit((d / "manifest.toml").read_text()))
    with pytest.raises(ProfileError) as info:
        load_profile(d)
    assert str(d / "manifest.toml") in str(info.value) and message in str(info.value)


def test_parse_diff_counts_hunks() -> None:
    (fp,) = parse_diff(GOOD_DIFF, "x")
    assert fp.path == "fakepkg/sched.py" and len(fp.hunks) == 1 and not fp.new_file


def test_cli_check_fails_when_one_profile_does_not_apply(installed: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fixtures" / "models").mkdir(parents=True)
    make_profile(tmp_path, "good", {"0001.patch": GOOD_DIFF})
    make_profile(tmp_path, "stale", {"0001.patch": GOOD_DIFF.replace("'last'", "'first'")})
    assert cli_main(["patches", "check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "good" in out and "applies" in out
    assert "stale" in out and "DOES NOT APPLY: stale/0001.patch: fakepkg/sched.py: hunk 1" in out
    assert cli_main(["patches", "show", "good", "--root", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "fakepkg/sched.py (1 hunk(s))" in shown and "claim: preemptions patched/unpatched <= 0.5" in shown


def test_claims() -> None:
    claim = ProfileClaim(metric="preemptions", compare="ratio", op="<=", bound=0.5)
    assert claim.holds(40, 100) == (True, 0.4)
    assert claim.holds(60, 100) == (False, 0.6)
    assert ProfileClaim("x", "difference", ">=", 10).holds(25, 10) == (True, 15)


def test_gate_records_a_profiles_claim_verdicts_and_refuses_unmeasured_metrics() -> None:
    from vramgate.pytest_plugin.fixture import Gate

    profile = load_profile(Path(__file__).resolve().parents[1] / "patches" / "kv-fp8")
    gate = Gate("t::x", "block_manager")
    held = gate.profile_claims(profile, "engine-pressure", {"capacity_tokens": 2000.0}, {"capacity_tokens": 1000.0})
    short = gate.profile_claims(profile, "engine-pressure", {"capacity_tokens": 1500.0}, {"capacity_tokens": 1000.0})
    assert [c.held for c in held + short] == [True, False]
    assert "2000 patched vs 1000 unpatched" in held[0].evidence and "bound >= 1.9" in held[0].evidence
    assert gate.profile_claims(profile, "another-workload", {}, {}) == []
    with pytest.raises(ValueError, match="unknown metric 'capacity_tokens'"):
        gate.profile_claims(profile, "engine-pressure", {"preemptions": 1.0}, {"preemptions": 1.0})


#: A hunk below the top of the file (git anchors a hunk at line 1 to the start, as the diff says).
OTHER_DIFF = "\n".join(["--- a/fakepkg/sched.py", "+++ b/fakepkg/sched.py", "@@ -3,4 +3,4 @@", " ", " ",
                        " def other():", "-    return 1", "+    return 2", ""])


def test_a_diff_whose_lines_moved_applies_at_its_offset(installed: Path, tmp_path: Path) -> None:
    """A fork of the release with lines added above the hunk: git applies it at an offset, and says so."""
    sched = installed / "sched.py"
    sched.write_text(sched.read_text().replace("def policy():", "# a fork's own\n# three lines\n# here\ndef policy():"))
    before = tree_digest(installed)
    profile = load_profile(make_profile(tmp_path, "moved", {"0001.patch": OTHER_DIFF}))
    notes: list[str] = []
    contents = patched_files(profile, installed, "0.32.0", notes)
    assert contents["fakepkg/sched.py"].endswith("def other():\n    return 2\n")
    assert notes == ["moved/0001.patch: hunk 1 applied at line 6 (offset 3 lines)"]
    overlay = build_overlay(profile, tmp_path / "overlays")
    assert "return 2" in (overlay / "fakepkg" / "sched.py").read_text()
    assert tree_digest(installed) == before


def test_a_diff_whose_context_changed_is_refused_with_gits_reason(installed: Path, tmp_path: Path) -> None:
    sched = installed / "sched.py"
    sched.write_text("# moved down\n" + sched.read_text().replace("return 'last'", "return 'latest'"))
    before = tree_digest(installed)
    profile = load_profile(make_profile(tmp_path, "changed", {"0001.patch": GOOD_DIFF}))
    with pytest.raises(PatchError) as info:
        build_overlay(profile, tmp_path / "overlays")
    message = str(info.value)
    assert message.startswith("changed/0001.patch: fakepkg/sched.py: hunk 1 '@@ -1,3 +1,3 @@' does not apply")
    assert "(git apply: patch failed: fakepkg/sched.py:1)" in message
    assert tree_digest(installed) == before
    assert not (tmp_path / "overlays").exists() or list((tmp_path / "overlays").iterdir()) == []


def _suites_taking_profiles() -> dict[str, list[str]]:
    """The suite names ``gate_profiles("NAME", ...)`` marks in suites/ take, with the tests that carry them; a test that
    takes every profile (``gate_profiles()``, Note [profile verdict]) takes them for its own suite (its folder)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    taken: dict[str, list[str]] = {}
    for path in sorted((root / "suites").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("gate_profiles"):
                    if deco.args and isinstance(deco.args[0], ast.Constant):
                        name = str(deco.args[0].value)
                    elif not deco.args:
                        name = path.parent.name
                    else:
                        continue
                    taken.setdefault(name, []).append(f"{path.relative_to(root)}::{node.name}")
    return taken


def test_every_suite_a_profile_names_runs_it_and_every_cuda_profile_names_one() -> None:
    """A profile whose suites no test takes is never measured: every suite name a profile lists parametrizes at least
    one test (``gate_profiles("NAME")``), and every profile that requires CUDA (which no CPU-only check covers)
    names at least one such suite."""
    from vramgate.profiles import load_profiles

    root = Path(__file__).resolve().parents[1]
    taken = _suites_taking_profiles()
    assert {"latency", "serving", "attention", "block_manager", "quantization"} <= set(taken), taken
    profiles = load_profiles(root)
    assert len(profiles) >= 9
    for profile in profiles:
        unknown = [s for s in profile.suites if s not in taken]
        assert not unknown, f"profile {profile.name}: no test takes profiles of suite(s) {unknown}"
        if profile.requires.device == "cuda":
            assert profile.suites, f"profile {profile.name} requires CUDA but names no suite: no engine measures it"
