"""The declared matrix: loading and its errors, selection for a machine, the suites' cases, budgets, the command."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vramgate.matrix import (
    MATRIX_FILE,
    Machine,
    MatrixError,
    collection_problem,
    default_matrix,
    default_matrix_text,
    gpu_count_problem,
    load_matrix,
    missing_trace,
    parse_matrix,
    project_matrix,
)
from vramgate.testing.engines import SMALL_RUN_BLOCK_SIZE, SMALL_RUN_BLOCK_SIZE_AMX
from vramgate.testing.matrix import matrix_params
from vramgate.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]

GOOD = """
[models.big]
config = "llama-3.1-8b"
checkpoint = "/models/llama"

[models.tiny-llama]

[workloads.team]
trace = "sharegpt-team"

[workloads.chat]
builtin = "sharegpt"
requests = 32
params = { }

[[entries]]
suites = ["capacity", "latency"]
model = "big"
tier = "gpu"
gpu = "H100"
tp = 4
block_size = 32
kv_cache_dtype = ["auto", "fp8"]
workload = "team"
[entries.budgets]
weights_bytes = "<= 74 GiB"
capacity_tokens = ">= 400_000"
ttft = "<= 250 ms"

[[entries]]
suites = "kv_cache"
model = "tiny-llama"
"""


def parse(text: str) -> object:
    return parse_matrix(text, "vramgate.toml", ROOT)


def test_a_good_file_loads() -> None:
    m = parse_matrix(GOOD, "vramgate.toml", ROOT)
    assert list(m.models) == ["big", "tiny-llama"]
    assert m.models["big"].config == "llama-3.1-8b" and m.models["tiny-llama"].config == "tiny-llama"
    big = m.entries[0]
    assert big.suites == ("capacity", "latency") and big.tp == 4 and big.block_size == (32,)
    assert big.workload is not None and big.workload.trace == "sharegpt-team"
    assert [(b.metric, b.op, b.value, b.unit) for b in big.budgets] == [
        ("weights_bytes", "<=", 74 * 2**30, "B"), ("capacity_tokens", ">=", 400_000, None), ("ttft", "<=", 0.25, "s"),
    ]
    assert m.entries[1].suites == ("kv_cache",) and m.entries[1].block_size == (16,)
    assert m.workloads["chat"].requests == 32 and [e.index for e in m.for_suite("latency")] == [0]


@pytest.mark.parametrize(("edit", "message"), [
    (("block_size = 32", "blok_size = 32"),
     "vramgate.toml: entries[0].blok_size: unknown field; did you mean block_size?"),
    (('suites = "kv_cache"', 'suites = "kv_cahce"'),
     "vramgate.toml: entries[1].suites: unknown suite 'kv_cahce'; did you mean kv_cache?"),
    (("tp = 4", 'tp = "4"'), "vramgate.toml: entries[0].tp: must be int, got str '4'"),
    (("tp = 4", "tp = true"), "vramgate.toml: entries[0].tp: must be int, got bool True"),
    (('model = "big"', 'model = "bigg"'), "vramgate.toml: entries[0].model: no [models.bigg] in this file; did you "
                                          "mean big?"),
    (('workload = "team"', 'workload = "tem"'), "vramgate.toml: entries[0].workload: no [workloads.tem]"),
    (('config = "llama-3.1-8b"', 'config = "llama-3.1-8"'),
     "vramgate.toml: models.big.config: no folder 'llama-3.1-8' under fixtures/models; did you mean llama-3.1-8b?"),
    (('"<= 74 GiB"', '"<= 74 GB/s"'), "vramgate.toml: entries[0].budgets.weights_bytes: unknown unit 'GB/s'"),
    (('"<= 74 GiB"', '"74 GiB"'), "vramgate.toml: entries[0].budgets.weights_bytes: '74 GiB' is not a budget"),
    (('tier = "gpu"', 'tier = "tpu"'), "vramgate.toml: entries[0].tier: unknown tier 'tpu'; accepted: cpu, gpu"),
    (('suites = "kv_cache"', 'suites = "kv_cache"\ntp = 2'),
     "vramgate.toml: entries[1].tp: the kv_cache suite does not use it"),
    (("block_size = 32", "block_size = [16, 32]"),
     "vramgate.toml: entries[0].block_size: the latency suite runs one block size per entry"),
    (("weights_bytes =", "weight_bytes ="), "vramgate.toml: entries[0].budgets.weight_bytes: no suite of this entry "
                                            "records a metric of that name; did you mean weights_bytes?"),
    (('builtin = "sharegpt"', 'builtin = "sharegtp"'),
     "vramgate.toml: workloads.chat.builtin: unknown generator 'sharegtp'; did you mean sharegpt?"),
    (("[workloads.team]", "[workload.team]"), "vramgate.toml: workload: unknown field; did you mean workloads?"),
    (("tp = 4", "tp = 4\ntp = 5"), "vramgate.toml: not valid TOML"),
])
def test_errors_name_the_file_and_the_field(edit: tuple[str, str], message: str) -> None:
    with pytest.raises(MatrixError) as info:
        parse(GOOD.replace(*edit, 1))
    assert message in str(info.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match=r"nope\.toml: cannot read the matrix"):
        load_matrix(tmp_path / "nope.toml")


def test_selection_by_tier_gpu_class_and_gpu_count(tmp_path: Path) -> None:
    big = parse_matrix(GOOD, "vramgate.toml", ROOT).entries[0]
    h100x2 = Machine("gpu", "gpu-nvidia-h100-80gb-hbm3-x2", 2)
    assert collection_problem(big, "cpu", lambda: h100x2) == "entry for the gpu tier; this machine's engine tier is cpu"
    assert collection_problem(big, "gpu", lambda: h100x2) is None
    h200 = Machine("gpu", "gpu-nvidia-h200-x8", 8)
    assert collection_problem(big, "gpu", lambda: h200) == ("entry for GPU class H100; this machine's hardware key is "
                                                  "gpu-nvidia-h200-x8")
    assert gpu_count_problem(big, h100x2) == "TP 4 needs 4 GPUs; this machine has 2"
    assert gpu_count_problem(big, Machine("gpu", "h100", 4)) is None
    assert "trace 'sharegpt-team' is not imported yet" in (missing_trace(big, tmp_path) or "")
    (tmp_path / "fixtures" / "workloads").mkdir(parents=True)
    (tmp_path / "fixtures" / "workloads" / "sharegpt-team.json").write_text("{}")
    assert missing_trace(big, tmp_path) is None


def test_the_repository_runs_on_the_built_in_default_which_gives_todays_cases() -> None:
    """The default matrix ships once, as package data, and the repository runs on it (no vramgate.toml of its
    own); what the suites collected before the matrix, on both tiers, in the same order."""
    from vramgate.matrix import default_matrix_path

    assert not (ROOT / MATRIX_FILE).exists()
    path = default_matrix_path()  # the installed package's (tox installs a wheel) or the source's
    assert path is not None and path.name == "default.toml"
    assert path.read_bytes() == (ROOT / "src" / "vramgate" / "matrix" / "default.toml").read_bytes()
    shipped, default = load_matrix(path, ROOT), default_matrix()  # its model configs are the repository's
    assert shipped.entries == default.entries and shipped.models == default.models and len(default.entries) == 20
    assert project_matrix(ROOT).entries == default.entries
    assert project_matrix(ROOT / "no-such-project").entries == default.entries
    models = ["deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "llama-3.1-8b"]
    kv = matrix_params(default, "kv_cache", ["model", "block_size", "kv_cache_dtype"],
                       "{model}-bs{block_size}-{kv_cache_dtype}", "t", "cpu", ROOT, cpu_box)
    assert [p.id for p in kv] == [f"{m}-bs{b}-{d}" for m, b, d in itertools.product(models, [16, 64, 128],
                                                                                     ["auto", "fp8"])]
    more = {"cpu": {"tiny-llama": (64, 128)}, "gpu": {"tiny-llama": (32, 128), "tiny-deepseek-v2": (64,)}}
    for tier, shared in SMALL_RUN_BLOCK_SIZE.items():
        box = cpu_box if tier == "cpu" else (lambda: Machine("gpu", "nvidia-h100-80gb-hbm3-80gb-x1", 1))
        cap = matrix_params(default, "capacity", ["model", "block_size"], "{model}-bs{block_size}", "t", tier, ROOT,
                            box)
        expected = [(f"{m}-bs{b}", b != s) for m, s in shared.items() for b in (s, *more[tier].get(m, ()))]
        assert [(p.id, any(mk.name == "gate_nightly" for mk in p.marks)) for p in cap] == expected
        lat = matrix_params(default, "latency", ["model", "block_size"], "{model}", "t", tier, ROOT, box)
        assert [(p.id, p.values[1]) for p in lat] == list(shared.items())
    # A CPU with AMX runs MLA with AMX_MLA (multiples of 32): its entries, the same ids where the block size is not
    # in them (Note [CPU MLA backends]).
    cap = matrix_params(default, "capacity", ["model", "block_size"], "{model}-bs{block_size}", "t", "cpu", ROOT,
                        amx_box)
    assert [p.id for p in cap] == ["tiny-llama-bs32", "tiny-llama-bs64", "tiny-llama-bs128", "tiny-deepseek-v2-bs32"]
    lat = matrix_params(default, "latency", ["model", "block_size"], "{model}", "t", "cpu", ROOT, amx_box)
    assert [(p.id, p.values[1]) for p in lat] == list(SMALL_RUN_BLOCK_SIZE_AMX.items())


def cpu_box() -> Machine:
    return Machine("cpu", "cpu-x86_64-avx512-bf16-amd-epyc", 0, "avx512-bf16")


def amx_box() -> Machine:
    return Machine("cpu", "cpu-x86_64-amx-intel-xeon-processor", 0, "amx")


GATED = """
import os
import pytest

@pytest.mark.gate_matrix("capacity", id="{model}-bs{block_size}")
def test_run(gate, model, block_size, matrix_case):
    gate.record("capacity_tokens", int(os.environ.get("CAP", "500000")), unit="tokens", better="higher")
    gate.record("weights_bytes", int(os.environ.get("PEAK", str(2**30))), unit="B")
"""

MATRIX = """
[models.tiny-llama]
[[entries]]
suites = ["capacity"]
model = "tiny-llama"
block_size = [16, 32]
[entries.budgets]
capacity_tokens = ">= 400000"
weights_bytes = "<= 74 GiB"
"""


def gated(pytester: pytest.Pytester, matrix: str = MATRIX) -> pytest.Pytester:
    shutil.copytree(ROOT / "fixtures" / "models" / "tiny-llama", pytester.path / "fixtures" / "models" / "tiny-llama")
    pytester.makefile(".toml", vramgate=matrix)
    (pytester.path / "suites" / "capacity").mkdir(parents=True)  # the suite the matrix names, declared
    shutil.copy(ROOT / "suites" / "capacity" / "suite.toml", pytester.path / "suites" / "capacity")
    pytester.makepyfile(test_cap=GATED)
    return pytester


# In subprocesses: an inner run in this process would load the engine's numerical libraries a second time.
def test_matrix_budgets_gate_the_recorded_metrics(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    gated(pytester)
    args = ("-p", "vramgate.testing.fixtures", "--gate-hardware", "test-hw", "--gate-update", "-rA")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert "test_run[tiny-llama-bs16]" in out and "test_run[tiny-llama-bs32]" in out
    assert "weights: dummy (the matrix names no checkpoint for tiny-llama)" in out
    assert "budget capacity_tokens >= 400000 (vramgate.toml: entries[0])" in out
    monkeypatch.setenv("CAP", "300000")
    monkeypatch.setenv("PEAK", str(80 * 2**30))
    result = pytester.runpytest_subprocess(*args[:-1])
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "capacity_tokens: 300,000 tokens is below its floor 400,000 tokens" in out
    assert "weights_bytes: 80.00 GiB is above its ceiling 74.00 GiB" in out


def test_a_budget_in_another_unit_fails_naming_the_entry(pytester: pytest.Pytester) -> None:
    gated(pytester, MATRIX.replace('">= 400000"', '">= 4 GiB"'))
    result = pytester.runpytest_subprocess("-p", "vramgate.testing.fixtures", "--gate-hardware", "test-hw",
                                           "--gate-update")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*vramgate.toml: entries[[]0[]].budgets.capacity_tokens: '>= 4 GiB' is in B, but "
                                 "the test records capacity_tokens in tokens*"])


def test_a_bad_matrix_stops_collection(pytester: pytest.Pytester) -> None:
    gated(pytester, MATRIX.replace("block_size", "blocksize"))
    result = pytester.runpytest_subprocess("-p", "vramgate.testing.fixtures", "--gate-hardware", "test-hw")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "vramgate.toml: entries[0].blocksize: unknown field; did you mean block_size?" in result.stderr.str()


def test_adding_a_model_adds_its_cases_to_the_kv_capacity_and_latency_suites(tmp_path: Path) -> None:
    """A third tiny config in the matrix file: new cases in three suites, no suite code edited."""
    project = tmp_path / "project"
    for part in ("conftest.py", "pyproject.toml", "suites/kv_cache", "suites/capacity", "suites/latency",
                 "suites/serving_capacity/suite.toml", "suites/serving/suite.toml", "fixtures/models"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        (project / part).parent.mkdir(parents=True, exist_ok=True)
        copy(ROOT / part, project / part)
    shutil.copytree(ROOT / "fixtures" / "models" / "tiny-llama", project / "fixtures" / "models" / "tiny-llama-b")
    added = ('\n[models.tiny-llama-b]\n[[entries]]\nsuites = ["kv_cache", "capacity", "latency"]\n'
             'model = "tiny-llama-b"\nblock_size = 32\n')
    (project / MATRIX_FILE).write_text(default_matrix_text() + added, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "suites", "--collect-only", "-q", "-p", "no:cacheprovider",
         "--rootdir", str(project)], cwd=project, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    ids = out.stdout.splitlines()
    assert "suites/kv_cache/test_kv_pages.py::test_kv_page_and_capacity[tiny-llama-b-bs32-auto]" in ids
    assert "suites/kv_cache/test_kv_pages.py::test_bytes_per_token_do_not_depend_on_block_size[tiny-llama-b]" in ids
    assert "suites/capacity/test_capacity.py::test_engine_kv_capacity[tiny-llama-b-bs32]" in ids
    assert "suites/latency/test_latency.py::test_engine_latency[tiny-llama-b]" in ids
    assert "suites/kv_cache/test_kv_pages.py::test_kv_page_and_capacity[llama-3.1-8b-bs16-auto]" in ids


def test_the_command_checks_and_lists(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["matrix", "--check", "--root", str(ROOT), "--file", "examples/team-matrix.toml"]) == 0
    assert "examples/team-matrix.toml: 2 models, 2 workloads, 5 entries: valid" in capsys.readouterr().out
    team = (ROOT / "examples" / "team-matrix.toml").read_text(encoding="utf-8")
    bad = tmp_path / "bad.toml"
    bad.write_text(team.replace("kv_cache_dtype = \"fp8\"", "kv_cache_dtyp = \"fp8\""), encoding="utf-8")
    assert main(["matrix", "--check", "--root", str(ROOT), "--file", str(bad)]) == 1
    assert (f"{bad}: entries[3].kv_cache_dtyp: unknown field; did you mean kv_cache_dtype?"
            in capsys.readouterr().err)
    assert main(["matrix", "--root", str(ROOT), "--file", "examples/team-matrix.toml"]) == 0
    out = capsys.readouterr().out
    assert "entries[0] llama-3.1-8b, suites kv_cache" in out and "runs here" in out
    assert "entries[3] deepseek-v3, suites capacity,latency, tier gpu, gpu h200, tp 8" in out


def test_the_suites_record_the_metrics_budgets_may_name() -> None:
    """What each matrix suite declares it records (its suite.toml, Note [suite files]) is what its tests record
    (a budget on another name could never fail); the registered rules are those declarations."""
    import re

    from vramgate.matrix import project_suites, suite_rules

    declared = {name: s.matrix for name, s in project_suites(ROOT).items() if s.matrix is not None}
    assert set(declared) == {"kv_cache", "capacity", "latency", "serving_capacity", "serving"}
    for suite, rule in declared.items():
        code = "".join(p.read_text() for p in (ROOT / "suites" / suite).glob("test_*.py"))
        recorded = set(re.findall(r'gate\.record(?:_samples|_paired)?\(\s*"([a-z0-9_]+)"', code))
        assert recorded == set(rule.metrics), suite
        assert suite_rules()[suite] == rule
    assert not (ROOT / "src" / "vramgate" / "testing" / "matrix_suites.py").read_text().count("metrics=(")


def test_a_suite_declares_itself_in_its_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A project's suites/<name>/suite.toml makes the suite one its matrix may name, for pytest and the CLI alike
    (Note [suite files]); a bad declaration names the file and field, and headline says what an upgrade report
    shows side by side."""
    from vramgate.matrix import project_suites, suite_rules
    from vramgate.matrix import suites as registry
    from vramgate.tools.cli import main
    from vramgate.tools.upgrade import headline_suites

    (tmp_path / "suites" / "queues").mkdir(parents=True)
    (tmp_path / "suites" / "notes").mkdir()
    (tmp_path / "suites" / "notes" / "suite.toml").write_text("headline = true\n")
    decl = tmp_path / "suites" / "queues" / "suite.toml"
    decl.write_text('[matrix]\nmetrics = ["queue_depth"]\nkv_only = true\n')
    (tmp_path / "vramgate.toml").write_text('[models.tiny-llama]\n[[entries]]\nsuites = ["queues"]\n'
                                            'model = "tiny-llama"\n[entries.budgets]\nqueue_depth = "<= 8"\n')
    try:
        assert main(["matrix", "--check", "--root", str(tmp_path)]) == 2  # not a project: no fixtures/models
        assert "queues" not in suite_rules()
        shutil.copytree(ROOT / "fixtures" / "models" / "tiny-llama", tmp_path / "fixtures" / "models" / "tiny-llama")
        assert main(["matrix", "--check", "--root", str(tmp_path)]) == 0
        assert "vramgate.toml: 1 models, 0 workloads, 1 entries: valid" in capsys.readouterr().out
        assert suite_rules()["queues"].kv_only and "notes" not in suite_rules()
        assert headline_suites(tmp_path) == ("notes",)
        decl.write_text('[matrix]\nmetric = ["queue_depth"]\n')
        with pytest.raises(MatrixError, match=r"^suites/queues/suite.toml: matrix.metric: unknown field; did you "
                                              "mean metrics"):
            project_suites(tmp_path)
    finally:
        registry._SUITES.pop("queues", None)
    assert headline_suites(ROOT) == ("block_manager", "capacity", "serving_capacity")


def test_a_project_declares_its_own_suite_to_the_matrix() -> None:
    """A suite the repository does not have is unknown to the matrix until declared (vramgate.testing.matrix_suite),
    then an entry may name it and budget its metrics; the lower layer holds no list of suites."""
    from vramgate.matrix import suite_rules
    from vramgate.matrix import suites as registry
    from vramgate.testing import matrix_suite

    text = '[models.tiny-llama]\n[[entries]]\nsuites = ["team_suite"]\nmodel = "tiny-llama"\n' \
           '[entries.budgets]\nqueue_depth = "<= 8"\n'
    with pytest.raises(MatrixError, match="unknown suite 'team_suite'"):
        parse_matrix(text, "vramgate.toml", ROOT)
    # the built-in default's way: an entry of a suite the project lacks is left out, the others keep their index
    both = text + '[[entries]]\nsuites = ["capacity"]\nmodel = "tiny-llama"\n'
    assert [(e.index, e.suites) for e in parse_matrix(both, "default", ROOT, undeclared=True).entries] == [
        (1, ("capacity",))]
    try:
        matrix_suite("team_suite", metrics=("queue_depth",))
        (entry,) = parse_matrix(text, "vramgate.toml", ROOT).entries
        assert entry.budgets[0].metric == "queue_depth"
        with pytest.raises(MatrixError, match="no suite of this entry records a metric of that name"):
            parse_matrix(text.replace("queue_depth", "queue_length"), "vramgate.toml", ROOT)
    finally:
        registry._SUITES.pop("team_suite", None)
    assert "team_suite" not in suite_rules()
    import ast

    tree = ast.parse((ROOT / "src" / "vramgate" / "matrix" / "loader.py").read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, ast.Module | ast.FunctionDef |
                  ast.ClassDef) and n.body and isinstance(n.body[0], ast.Expr)}
    constants = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docstrings}
    assert not constants & {"kv_cache", "capacity", "latency", "serving_capacity"}  # "serving" is also a table


def test_the_readme_quotes_the_team_matrix_that_is_checked() -> None:
    """The README links examples/team-matrix.toml, which the unit env checks, and its excerpt is whole lines of
    that file, verbatim."""
    readme = (ROOT / "README.md").read_text()
    link = "[`examples/team-matrix.toml`](examples/team-matrix.toml)"
    assert link in readme
    excerpt = readme.split(link, 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    assert excerpt.count("\n") >= 10
    assert "\n" + excerpt in "\n" + (ROOT / "examples" / "team-matrix.toml").read_text()


@pytest.mark.parametrize(("key", "gpu", "matches"), [
    ("nvidia-l4-24gb-x1", "L4", True), ("nvidia-l40s-48gb-x1", "l4", False), ("nvidia-l40s-48gb-x1", "L40S", True),
    ("nvidia-h100-80gb-hbm3-80gb-x8", "H100", True), ("nvidia-h100-80gb-hbm3-80gb-x8", "h1", False),
    ("nvidia-a100-sxm4-40gb-x1", "A100-SXM4", True), ("nvidia-a100-sxm4-40gb-x1", "a100 sxm4", True),
    ("nvidia-gh200-480gb-x1", "h200", False),
])
def test_a_gpu_class_matches_whole_words_of_the_key(key: str, gpu: str, matches: bool) -> None:
    """An entry for GPU class L4 is not an L40S's (a substring of the key matched it)."""
    from vramgate.machine.hardware import matches_gpu_class

    assert matches_gpu_class(key, gpu) is matches
    entry = parse_matrix(f'[models.tiny-llama]\n[[entries]]\nsuites = ["capacity"]\nmodel = "tiny-llama"\n'
                         f'tier = "gpu"\ngpu = "{gpu}"\n', "vramgate.toml", ROOT).entries[0]
    assert (collection_problem(entry, "gpu", lambda: Machine("gpu", key, 1)) is None) is matches


def test_the_matrix_selects_by_the_sessions_hardware_key(pytester: pytest.Pytester) -> None:
    """--gate-hardware names the machine for the matrix's selection too: an entry for GPU class H100 is collected
    under an H100 key and not under an L40S one."""
    matrix = MATRIX.replace('suites = ["capacity"]', 'suites = ["capacity"]\ntier = "gpu"\ngpu = "H100"')
    gated(pytester, matrix)
    args = ["-p", "vramgate.testing.fixtures", "--collect-only", "-q", "-p", "no:cacheprovider"]
    env = {"VRAMGATE_COMPUTE_TIER": "cuda"}  # the engine tier is the GPU's, whatever vLLM this interpreter has
    for key, found in (("nvidia-h100-80gb-hbm3-80gb-x1", 2), ("nvidia-l40s-48gb-x1", 0)):
        with pytest.MonkeyPatch.context() as mp:
            for name, value in env.items():
                mp.setenv(name, value)
            result = pytester.runpytest_subprocess(*args, "--gate-hardware", key)
        assert result.stdout.str().count("test_run[tiny-llama") == found, result.stdout.str()


def test_selection_by_cpu_isa_class() -> None:
    text = """[models.tiny-deepseek-v2]
[[entries]]
suites = ["capacity"]
model = "tiny-deepseek-v2"
tier = "cpu"
cpu_isa = "amx"
block_size = 32

[[entries]]
suites = ["capacity"]
model = "tiny-deepseek-v2"
tier = "cpu"
cpu_isa = "not amx"
block_size = 16
"""
    amx, below = parse_matrix(text, "vramgate.toml", ROOT).entries
    assert "cpu_isa amx" in amx.describe()
    sapphire = Machine("cpu", "cpu-x86_64-amx-intel-xeon", 0, "amx")
    epyc = Machine("cpu", "cpu-x86_64-avx512-bf16-amd-epyc", 0, "avx512-bf16")
    arm = Machine("cpu", "cpu-aarch64-neoverse", 0, "aarch64")
    assert collection_problem(amx, "cpu", lambda: sapphire) is None
    assert collection_problem(below, "cpu", lambda: sapphire) == (
        "entry for CPUs of ISA class not amx; this machine's class is amx")
    assert collection_problem(amx, "cpu", lambda: epyc) == (
        "entry for CPUs of ISA class amx; this machine's class is avx512-bf16")
    assert collection_problem(below, "cpu", lambda: epyc) is None
    assert collection_problem(below, "cpu", lambda: arm) is None  # another architecture is below every x86 class
    with pytest.raises(MatrixError, match=r"entries\[0\]\.cpu_isa: unknown ISA class 'amx2'"):
        parse_matrix(text.replace('"amx"', '"amx2"', 1), "vramgate.toml", ROOT)
    with pytest.raises(MatrixError, match=r"entries\[0\]\.cpu_isa: an ISA class \('amx'\) needs tier"):
        parse_matrix(text.replace('tier = "cpu"\ncpu_isa = "amx"', 'cpu_isa = "amx"', 1), "vramgate.toml", ROOT)
