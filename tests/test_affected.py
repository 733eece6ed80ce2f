"""``--gate-affected REF``: each kind of input, the fallbacks to every test, the references kept with their
profiles, and the report's "left out" line (Note [each test's inputs])."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from vramgate.store.changes import reach

ROOT = Path(__file__).resolve().parents[1]

SUITE_A = "def test_a(gate):\n    gate.record('x', 1, unit='B')\n"
SUITE_B = "from helpers import SIZE\n\ndef test_b():\n    assert SIZE and 'm1'\n"
PAIRED = """
import pytest

@pytest.mark.parametrize("profile", [pytest.param(None, id="baseline", marks=pytest.mark.gate_reference),
                                     "p1", "p2"])
def test_paired(profile):
    pass
"""
CONFTEST = """
import sys
from pathlib import Path

from vramgate.pytest_plugin.affected import TestInput

sys.path.insert(0, str(Path(__file__).parent / "suites" / "b"))


def pytest_vramgate_test_inputs(item):
    profile = getattr(item, "callspec", None) and item.callspec.params.get("profile")
    if not profile:
        return []
    # p2's manifest: only its first line counts (a finer check than the file)
    def unchanged(changes):
        old = changes.at_base(f"patches/{profile}/manifest.toml") or ""
        new = (changes.root / f"patches/{profile}/manifest.toml").read_text()
        return old.splitlines()[:1] == new.splitlines()[:1]
    return [TestInput(f"profile {profile}", (f"patches/{profile}/",), unchanged if profile == "p2" else None)]
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project in git: two suites (one with a helper and a fixture it names), a paired test, docs."""
    root = pytester.path
    files = {
        "conftest.py": CONFTEST,
        "suites/a/test_a.py": SUITE_A,
        "suites/b/test_b.py": SUITE_B,
        "suites/b/helpers.py": "SIZE = 1\n",
        "suites/p/test_paired.py": PAIRED,
        "fixtures/models/m1/config.json": "{}\n",
        "fixtures/models/m2/config.json": "{}\n",
        "patches/p1/manifest.toml": "name = 'p1'\n",
        "patches/p2/manifest.toml": "name = 'p2'\nnote = 1\n",
        "docs/guide.md": "# guide\n",
        "tox.ini": "[tox]\n",
        "pytest.ini": "[pytest]\naddopts = -p no:cacheprovider\ngate_missing = skip\n",
        ".gitignore": "runpytest-*\nstdout\nstderr\nrep/\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git(root, "init", "-q", "-b", "main")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return pytester


def ran(result: pytest.RunResult) -> set[str]:
    return {line.split("::")[1].split(" ")[0] for line in result.outlines if " PASSED" in line and "::" in line}


def change(root: Path, name: str, text: str = "# changed\n") -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((path.read_text() if path.exists() else "") + text)


@pytest.mark.parametrize(("path", "kind"), [
    ("src/vramgate/engine/load.py", "every"), ("tox.ini", "every"), ("pyproject.toml", "every"),
    ("requirements.txt", "every"), (".github/workflows/cpu.yml", "every"), ("conftest.py", "every"),
    ("patches/README.md", "every"), ("fixtures/models.json", "every"), ("baselines/README", "every"),
    ("Makefile", "every"),
    ("docs/running.md", "none"), ("README.md", "none"), ("CHANGELOG.md", "none"), ("tests/test_x.py", "none"),
    ("suites/durations.json", "none"), ("calibration/x.md", "none"), ("examples/team-matrix.toml", "none"),
    ("suites/kv_cache/test_kv.py", "some"), ("patches/kv-fp8/manifest.toml", "some"),
    ("fixtures/models/tiny-llama/config.json", "some"), ("baselines/cpu/kv_cache.json", "some"),
    ("vramgate.toml", "some"), ("src/vramgate/matrix/default.toml", "some"), ("suites/capacity/suite.toml", "some"),
])
def test_each_file_reaches_every_test_none_or_those_that_declare_it(path: str, kind: str) -> None:
    assert reach(path).kind == kind


def test_a_baselines_folder_elsewhere_is_read_as_baselines() -> None:
    assert reach("gate/baselines/cpu/x.json", "gate/baselines").kind == "some"
    assert reach("gate/baselines/cpu/notes.txt", "gate/baselines").kind == "every"


def test_docs_only_runs_nothing_says_so_and_passes(repo: pytest.Pytester) -> None:
    change(repo.path, "docs/guide.md")
    result = repo.runpytest("suites", "--gate-affected", "main", "--gate-report", "rep", "-v")
    assert result.ret == 0
    assert ran(result) == set()
    result.stdout.fnmatch_lines(["*left out: 5 test(s) whose inputs this change does not touch (base *); ran 0*"])
    data = json.loads((repo.path / "rep" / "report.json").read_text())
    assert data["affected"]["kept"] == 0 and len(data["affected"]["left_out"]) == 5
    report = (repo.path / "rep" / "report.md").read_text()
    assert "Left out: 5 test(s) whose inputs this change does not touch" in report


def test_a_module_runs_its_own_tests_and_a_helper_its_folders(repo: pytest.Pytester) -> None:
    change(repo.path, "suites/a/test_a.py")
    assert ran(repo.runpytest("suites", "--gate-affected", "main", "-v")) == {"test_a"}
    git(repo.path, "checkout", "-q", "suites")
    change(repo.path, "suites/b/helpers.py")
    assert ran(repo.runpytest("suites", "--gate-affected", "main", "-v")) == {"test_b"}


def test_a_fixture_runs_the_tests_that_name_it(repo: pytest.Pytester) -> None:
    change(repo.path, "fixtures/models/m1/config.json", " ")
    assert ran(repo.runpytest("suites", "--gate-affected", "main", "-v")) == {"test_b"}
    git(repo.path, "checkout", "-q", "fixtures")
    change(repo.path, "fixtures/models/m2/config.json", " ")
    assert ran(repo.runpytest("suites", "--gate-affected", "main", "-v")) == set()


def test_a_profile_runs_its_cases_and_their_reference(repo: pytest.Pytester) -> None:
    change(repo.path, "patches/p1/0001-new.diff", "--- a\n")  # an untracked file counts
    result = repo.runpytest("suites", "--gate-affected", "main", "--gate-plan", "-v")
    assert ran(result) == {"test_paired[baseline]", "test_paired[p1]"}
    result.stdout.fnmatch_lines(["*kept suites/p/test_paired.py::test_paired?baseline?: the reference a kept "
                                 "profile's case is paired with*",
                                 "*kept *test_paired?p1?: profile p1: patches/p1/0001-new.diff changed*",
                                 "*left out *test_paired?p2?: no input of it changed*"])


def test_a_finer_check_leaves_out_what_it_finds_unchanged(repo: pytest.Pytester) -> None:
    change(repo.path, "patches/p2/manifest.toml", "other = 2\n")  # its first line is the same
    assert ran(repo.runpytest("suites", "--gate-affected", "main", "-v")) == set()
    (repo.path / "patches/p2/manifest.toml").write_text("name = 'p2-renamed'\n")
    assert ran(repo.runpytest("suites", "--gate-affected", "main", "-v")) == {"test_paired[baseline]",
                                                                             "test_paired[p2]"}


@pytest.mark.parametrize("name", ["tox.ini", "conftest.py", "Makefile"])
def test_a_file_every_test_reads_or_no_rule_knows_runs_everything(repo: pytest.Pytester, name: str) -> None:
    change(repo.path, name)
    result = repo.runpytest("suites", "--gate-affected", "main", "-v")
    assert len(ran(result)) == 5
    result.stdout.fnmatch_lines([f"*ran every test: {name} changed*"])


def test_committed_changes_count_from_the_merge_base(repo: pytest.Pytester) -> None:
    root = repo.path
    git(root, "checkout", "-q", "-b", "topic")
    change(root, "suites/a/test_a.py")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "topic")
    git(root, "checkout", "-q", "main")
    change(root, "suites/b/test_b.py")  # main moves on after the topic forked
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "main moves")
    git(root, "checkout", "-q", "topic")
    assert ran(repo.runpytest("suites", "--gate-affected", "main", "-v")) == {"test_a"}


def test_a_ref_that_names_no_commit_stops_the_run(repo: pytest.Pytester) -> None:
    result = repo.runpytest("suites", "--gate-affected", "no-such-branch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gate-affected 'no-such-branch': not a commit of *fetch it first*"])


def test_outside_a_repository_it_says_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest("--gate-affected", "main")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*is not in a git repository*"])


def commit(root: Path, message: str = "base") -> None:
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)


def test_a_baseline_file_runs_the_tests_whose_records_moved(pytester: pytest.Pytester,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(**{"suites/a/test_a": "import os\n\ndef test_one(gate):\n    gate.record('x', 1, unit='B')\n\n"
                           "def test_two(gate):\n    gate.record('y', int(os.environ.get('Y', '2')), unit='B')\n"})
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider --gate-hardware test-hw\n")
    git(pytester.path, "init", "-q", "-b", "main")
    pytester.runpytest("suites", "--gate-update").assert_outcomes(passed=2)
    commit(pytester.path)
    monkeypatch.setenv("Y", "3")
    pytester.runpytest("suites", "--gate-update", "-k", "two").assert_outcomes(passed=1)
    monkeypatch.delenv("Y")
    result = pytester.runpytest("suites", "--gate-affected", "main", "--gate-plan", "-v")
    result.stdout.fnmatch_lines(["*left out *test_one: no input of it changed*",
                                 "*kept *test_two: its baselines: its records in baselines/*/a.json changed*"])
    (next(pytester.path.glob("baselines/*/a.json"))).write_text("{not json")
    result = pytester.runpytest("suites", "--gate-affected", "main", "--gate-plan", "-v")
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # an unusable baseline stops the run, as without the option


TWO_ENTRIES = """
[models.tiny-llama]
[[entries]]
suites = ["capacity"]
model = "tiny-llama"
block_size = [16]
[[entries]]
suites = ["capacity"]
model = "tiny-llama"
block_size = [32]
[entries.budgets]
weights_bytes = "<= 74 GiB"
"""
MATRIX_TEST = """
import pytest

@pytest.mark.gate_matrix("capacity", id="{model}-bs{block_size}")
def test_run(model, block_size, matrix_case):
    pass
"""


# In subprocesses: an inner run in this process would load the engine's numerical libraries a second time.
def test_a_matrix_entry_runs_its_own_cases_only(pytester: pytest.Pytester) -> None:
    root = pytester.path
    shutil.copytree(ROOT / "fixtures" / "models" / "tiny-llama", root / "fixtures" / "models" / "tiny-llama")
    (root / "vramgate.toml").write_text(TWO_ENTRIES)
    (root / ".gitignore").write_text("runpytest-*\nstdout\nstderr\n")  # pytester's own files
    pytester.makepyfile(**{"suites/capacity/test_cap": MATRIX_TEST})
    shutil.copy(ROOT / "suites" / "capacity" / "suite.toml", root / "suites" / "capacity")  # the suite, declared
    git(root, "init", "-q", "-b", "main")
    commit(root)
    args = ("-p", "vramgate.testing.fixtures", "-p", "no:cacheprovider", "--gate-hardware", "test-hw", "suites",
            "--gate-affected", "main", "--gate-plan", "-v")
    (root / "vramgate.toml").write_text(TWO_ENTRIES.replace("74 GiB", "70 GiB"))
    result = pytester.runpytest_subprocess(*args)
    result.stdout.fnmatch_lines(["*left out *test_run?tiny-llama-bs16?: no input of it changed*",
                                 "*kept *test_run?tiny-llama-bs32?: its matrix entry (vramgate.toml: entries?1?): "
                                 "vramgate.toml changed*"])
    result.assert_outcomes(passed=1)
    # the same entries in another order: nothing a case takes changed
    first, second = TWO_ENTRIES.split("[[entries]]")[1:]
    (root / "vramgate.toml").write_text("[models.tiny-llama]\n[[entries]]" + second + "[[entries]]" + first)
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*left out: 2 test(s) whose inputs this change does not touch*"])


@pytest.mark.parametrize("only_docs", [False, True])
def test_under_xdist_the_report_says_what_was_left_out(repo: pytest.Pytester, only_docs: bool) -> None:
    change(repo.path, "docs/guide.md" if only_docs else "suites/a/test_a.py")
    result = repo.runpytest_subprocess("suites", "-n", "2", "--gate-affected", "main", "--gate-report", "rep")
    assert result.ret == 0
    data = json.loads((repo.path / "rep" / "report.json").read_text())
    assert data["affected"]["kept"] == (0 if only_docs else 1)
    assert len(data["affected"]["left_out"]) == (5 if only_docs else 4)
    result.stdout.fnmatch_lines([f"*left out: {5 if only_docs else 4} test(s) whose inputs this change does not "
                                 "touch*"])


def test_the_changes_command_tells_a_workflow_which_jobs_a_change_needs(repo: pytest.Pytester, tmp_path: Path) -> None:
    from vramgate.tools.cli import main

    out = tmp_path / "github-output"
    change(repo.path, "docs/guide.md")
    assert main(["changes", "main", "--root", str(repo.path), "--github-output", str(out)]) == 0
    assert out.read_text() == "tests=false\ngate=false\n"
    change(repo.path, "tests/test_new.py")
    out.unlink()
    assert main(["changes", "main", "--root", str(repo.path), "--github-output", str(out)]) == 0
    assert out.read_text() == "tests=true\ngate=false\n"
    change(repo.path, "patches/p1/manifest.toml")
    out.unlink()
    assert main(["changes", "main", "--root", str(repo.path), "--github-output", str(out)]) == 0
    assert out.read_text() == "tests=true\ngate=true\n"
    assert main(["changes", "nowhere", "--root", str(repo.path)]) == 1


def test_the_workflows_run_what_a_pull_request_touches_and_everything_on_main() -> None:
    yaml = pytest.importorskip("yaml")
    cpu = yaml.safe_load((ROOT / ".github" / "workflows" / "cpu.yml").read_text())
    steps = {s.get("name"): s for s in cpu["jobs"]["gate"]["steps"]}
    assert steps["What the change touches"]["if"] == "github.event_name == 'pull_request'"
    assert steps["Harness tests"]["if"] == "steps.changes.outputs.tests != 'false'"
    assert steps["CPU gate"]["if"] == "steps.changes.outputs.gate != 'false'"
    # the base is set on pull requests only: pushes to main and the schedule run every test
    assert "--gate-affected \"$BASE_SHA\"" in steps["CPU gate"]["run"]
    assert steps["CPU gate"]["env"]["BASE_SHA"] == "${{ github.event.pull_request.base.sha }}"
    assert "nothing to run" in steps["Say what a docs-only change left out"]["run"]
    gpu = (ROOT / ".github" / "workflows" / "gpu-gate.yml").read_text()
    assert "--gate-affected \"$BASE_SHA\"" in gpu and "BASE_SHA: ${{ github.event.pull_request.base.sha }}" in gpu


def test_a_change_to_the_built_in_default_keeps_its_changed_entries_cases() -> None:
    """Where the project runs on the built-in default from vramgate's source (the repository), a case's matrix
    input is the default's file, compared entry by entry like a vramgate.toml."""
    from types import SimpleNamespace

    from vramgate.matrix import default_matrix, default_matrix_text
    from vramgate.testing import matrix as testing_matrix

    matrix = default_matrix()
    entry = matrix.entries[4]  # capacity and latency on tiny-llama, cpu, block size 32
    config = SimpleNamespace(stash={testing_matrix._STASH: matrix}, rootpath=ROOT)
    item = SimpleNamespace(config=config, get_closest_marker=lambda name: SimpleNamespace(args=(entry,)))
    (found,) = testing_matrix.entry_inputs(item)  # type: ignore[arg-type]
    assert found.paths == ("src/vramgate/matrix/default.toml",)
    assert found.label == "its matrix entry (src/vramgate/matrix/default.toml: entries[4])"
    text = default_matrix_text()
    assert found.unchanged is not None
    assert found.unchanged(SimpleNamespace(at_base=lambda rel: text))  # type: ignore[arg-type]
    moved = text.replace('model = "tiny-llama"\ntier = "cpu"\nblock_size = 32\n', 'model = "tiny-llama"\n'
                         'tier = "cpu"\nblock_size = 64\n', 1)
    assert moved != text and not found.unchanged(SimpleNamespace(at_base=lambda rel: moved))  # type: ignore[arg-type]


def test_the_time_line_counts_an_unlisted_test_as_the_durations_files_floor() -> None:
    """The share of the set's time ``--gate-affected`` kept counts a test the durations file does not list as the
    workers' dealing does (half a second: the file leaves out shorter tests), not as a typical listed test: forty
    unlisted quick tests beside two long ones are 20 s, not forty times the long ones' median."""
    from vramgate.pytest_plugin.affected import Decision, Selection

    decisions = [Decision("t::long_a", True, "its profile changed"), Decision("t::long_b", False, "unchanged")]
    decisions += [Decision(f"t::quick_{i}", False, "unchanged") for i in range(40)]
    line = Selection("main", "abc", None, decisions).time_line({"t::long_a": 60.0, "t::long_b": 100.0})
    assert line == "the kept tests took 60 s of the 180 s the whole set took when measured (33%)"
