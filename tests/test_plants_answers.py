"""The output check catches what the memory and latency checks cannot: two planted regressions whose cost is no worse
(or better) than the unpatched engine's, but whose answers are wrong. End to end on the CPU engine.

- ``plant-kv-window`` (tests/data/profiles): vLLM's KV cache manager frees the blocks of a running request that
  lie more than 256 tokens behind it, as sliding-window attention does, for full-attention layers. Fewer blocks
  in use, fewer preemptions under KV pressure; attention still reads those positions, whose blocks the pool has
  handed to other requests.
- ``plant-attention-scale``: Llama's softmax scale 4x too small. The same kernels, blocks and steps; flattened
  attention.

Both say ``[outputs] expect = "identical"``: their outputs must be the unpatched engine's. A project with the real
``block_manager`` suite runs ``test_engine_pressure`` unpatched and with each plant in one session (three engine
runs: the unpatched one is shared by the baseline test and the plants' claims). The unpatched test passes; each
plant's test fails on its outputs (the message names them and the first divergence) while its memory and latency
rows (preemptions, recomputed tokens, KV capacity, request throughput) pass and its claims hold.
Needs vLLM (the cpu-full env runs it); many minutes on 2 cores.

The diffs themselves are checked against the pinned release's source without vLLM (the unit env fetches it).
"""

from __future__ import annotations

import json
import os
import shutil
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Collection
from pathlib import Path

import pytest

from vramgate import VLLM_VERSION
from vramgate.profiles import Profile, load_profile
from vramgate.profiles.overlay import patched_files

ROOT = Path(__file__).resolve().parents[1]
PLANTS = ("plant-kv-window", "plant-attention-scale")
TEST = "suites/block_manager/test_block_manager.py::test_engine_pressure"
#: The rows test_engine_pressure records: what the plants must not fail.
COST_ROWS = ("preemptions", "recomputed_tokens", "capacity_tokens", "request_throughput")


def _vllm_source() -> Path | None:
    """The pinned release's Python source (the CUDA wheel's, unpacked by scripts/vllm_sources.py), if here."""
    given = os.environ.get("VRAMGATE_REHEARSAL_VLLM")
    path = Path(given) if given else ROOT / ".tox" / "vllm-sources" / VLLM_VERSION / "vllm"
    return path if (path / "v1" / "core" / "single_type_kv_cache_manager.py").is_file() else None


SOURCE = _vllm_source()


def _applies_cleanly(name: str) -> Profile:
    """The plant *name*, after checking that its diffs apply to the pinned release at their places (no offset) and
    the patched files compile."""
    assert SOURCE is not None
    profile = load_profile(ROOT / "tests" / "data" / "profiles" / name)
    notes: list[str] = []
    files = patched_files(profile, SOURCE, VLLM_VERSION, notes)
    assert notes == [], notes  # every hunk at its place
    for rel, text in files.items():
        compile(text, rel, "exec")
    return profile


@pytest.mark.skipif(SOURCE is None, reason=f"no vLLM {VLLM_VERSION} source: tox -e unit fetches it "
                                           "(scripts/vllm_sources.py)")
@pytest.mark.parametrize("name", PLANTS)
def test_the_plants_apply_to_the_pinned_release_and_expect_identical_outputs(name: str) -> None:
    profile = _applies_cleanly(name)
    assert "block_manager" in profile.suites
    manifest = tomllib.loads((profile.path / "manifest.toml").read_text(encoding="utf-8"))
    assert manifest["outputs"] == {"expect": "identical"}


def _project(pytester: pytest.Pytester, suite: str = "block_manager",
             plants: Collection[str] = PLANTS) -> pytest.Pytester:
    """A project of *suite*, the fixtures and *plants* as its only profiles."""
    shutil.copytree(ROOT / "suites" / suite, pytester.path / "suites" / suite)
    shutil.copytree(ROOT / "fixtures", pytester.path / "fixtures")
    shutil.copy(ROOT / "conftest.py", pytester.path / "conftest.py")
    for name in plants:
        shutil.copytree(ROOT / "tests" / "data" / "profiles" / name, pytester.path / "patches" / name)
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}.items():
        os.environ.setdefault(key, value)
    return pytester


def _cases(junit: Path) -> dict[str, ET.Element]:
    return {case.get("name", ""): case for case in ET.parse(junit).getroot().iter("testcase")}


def _failure_text(case: ET.Element) -> str:
    failure = case.find("failure")
    return "" if failure is None else f"{failure.get('message', '')}\n{failure.text or ''}"


def test_the_plants_fail_on_their_outputs_and_pass_on_their_cost(vllm_env: Path, pytester: pytest.Pytester) -> None:
    project = _project(pytester)
    ids = [f"{TEST}[baseline]"] + [f"{TEST}[{name}]" for name in PLANTS]
    result = project.runpytest_subprocess("-p", "no:cacheprovider", *ids, "--gate-missing", "record",
                                          "--gate-report", "out", "--junitxml", "junit.xml", timeout=3600)
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    if outcomes.get("passed") == 1 + len(PLANTS) and "not judged" in out:
        pytest.fail("test_engine_pressure judged no outputs (its engine runs a model on dummy weights), so "
                    f"nothing could catch the plants:\n{out[-3000:]}")
    result.assert_outcomes(passed=1, failed=len(PLANTS))
    cases = _cases(project.path / "junit.xml")
    assert _failure_text(cases["test_engine_pressure[baseline]"]) == "", out  # the unpatched answers pass
    report = json.loads((project.path / "out" / "report.json").read_text())
    tests = {t["nodeid"]: t for t in report["tests"]}
    unpatched = {m["name"]: m["now"]["value"] for m in tests[f"{TEST}[baseline]"]["metrics"]}
    for name in PLANTS:
        text = _failure_text(cases[f"test_engine_pressure[{name}]"])
        assert "outputs" in text.lower() and "first divergence" in text.lower(), (name, text or out)
        rows = {m["name"]: m for m in tests[f"{TEST}[{name}]"]["metrics"]}
        for metric in COST_ROWS:
            assert metric in rows, (name, metric, sorted(rows))
            assert not rows[metric]["failed"], (name, rows[metric])
        # No baseline is stored here (the rows are new): hold them to the unpatched run of the same session.
        assert rows["capacity_tokens"]["now"]["value"] == unpatched["capacity_tokens"], name
        for metric in ("preemptions", "recomputed_tokens"):
            assert rows[metric]["now"]["value"] <= unpatched[metric], (name, metric, rows[metric], unpatched)
        claims = [c for c in report["claims"] if c["test"] == f"{TEST}[{name}]"]
        answers = [c for c in claims if "outputs" in c["statement"]]
        assert len(answers) == 1 and not answers[0]["held"], (name, claims)  # the answers' row: not held
        cost = [c for c in claims if c not in answers]
        assert cost and all(c["held"] for c in cost), (name, claims)  # the cost it claims holds


# -- the numerics plants: each fails on the recall model it touches, and only there ----------------------------------

#: Plant -> the recall models (suites/answers' ``arch`` parameter) whose answers it must change; the others' must
#: pass. ``plant-logit-scale`` changes no token anywhere: its failures are its logprobs.
NUMERICS_PLANTS = {
    "plant-mla-scale": {"deepseek-v2"},
    "plant-gqa-pairing": {"llama-gqa"},
    "plant-logit-scale": {"llama", "llama-gqa", "deepseek-v2"},
}
ANSWERS_TEST = "suites/answers/test_profile_answers.py::test_profile_answers"
ARCHS = ("deepseek-v2", "llama", "llama-gqa")


@pytest.mark.skipif(SOURCE is None, reason=f"no vLLM {VLLM_VERSION} source: tox -e unit fetches it "
                                           "(scripts/vllm_sources.py)")
@pytest.mark.parametrize("name", sorted(NUMERICS_PLANTS))
def test_the_numerics_plants_apply_to_the_pinned_release_and_name_no_suite(name: str) -> None:
    """The plants apply at their places and are judged on their answers with no suite named (``suites = []``)."""
    profile = _applies_cleanly(name)
    assert profile.suites == () and profile.outputs.expect == "identical"


def test_the_numerics_plants_fail_exactly_on_the_recall_models_they_touch(vllm_env: Path,
                                                                          pytester: pytest.Pytester) -> None:
    """Through the real answers suite: an MLA-only change fails on recall-deepseek-v2 alone, a GQA-only change on
    recall-llama-gqa alone (the plain Llama passes both), and a change that moves logprobs by about a unit without
    changing a token fails ``identical`` on every model, the message naming the difference."""
    _project(pytester, "answers", NUMERICS_PLANTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "suites/answers", "--gate-missing", "record",
                                           "--gate-report", "out", "--junitxml", "junit.xml", timeout=3600)
    out = result.stdout.str()
    cases = _cases(pytester.path / "junit.xml")
    for name, touched in NUMERICS_PLANTS.items():
        for arch in ARCHS:
            case = cases[f"test_profile_answers[{name}-{arch}]"]
            text = _failure_text(case)
            if arch in touched:
                assert "outputs of" in text and 'expect = "identical"' in text, (name, arch, text or out[-3000:])
            else:
                assert text == "" and case.find("skipped") is None, (name, arch, text or out[-3000:])
    for arch in ARCHS:
        text = _failure_text(cases[f"test_profile_answers[plant-logit-scale-{arch}]"])
        assert "requests identical: 61 of 61" in text and "beyond it at request" in text, (arch, text)


# -- the profile verdict: every profile judged on every check, whatever its suites ------------------------------------

#: The plants of the profile verdict (Note [profile verdict] in vramgate.core.verdicts).
VERDICT_PLANTS = ("plant-numerics-latency", "plant-cuda-only", "plant-kv-oversize")


@pytest.mark.skipif(SOURCE is None, reason=f"no vLLM {VLLM_VERSION} source: tox -e unit fetches it "
                                           "(scripts/vllm_sources.py)")
@pytest.mark.parametrize("name", VERDICT_PLANTS)
def test_the_verdict_plants_apply_to_the_pinned_release(name: str) -> None:
    _applies_cleanly(name)


def test_every_profile_is_judged_on_every_check_whatever_its_suites(vllm_env: Path, pytester: pytest.Pytester) -> None:
    """The pre-merge set of the answers, capacity, latency and applies checks with three plants as the only profiles,
    each failing exactly its check: a numerics change whose manifest names only ``latency`` fails on its answers; a
    change that makes vLLM's CPU worker size its KV cache past the memory, naming no suite, fails on capacity (its
    answers, judged in the same runs, are the unpatched engine's); a change to a CUDA-only backend passes nothing
    silently on CPU (its answers and capacity read "not judged here", its row is not safe). About 20 minutes on 2
    cores (serial: three plants' answers, capacity and paired latency)."""
    project = _project(pytester, "answers", VERDICT_PLANTS)
    for suite in ("latency", "pressure", "block_manager", "profile_capacity"):
        shutil.copytree(ROOT / "suites" / suite, project.path / "suites" / suite)
    result = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "suites/answers", "suites/latency/test_paired_latency.py",
        "suites/profile_capacity/test_profile_capacity.py",
        "suites/block_manager/test_profiles_apply.py::test_profile_applies", "-m", "not gate_nightly",
        "--gate-missing", "record", "--gate-report", "out", timeout=3600)
    out = result.stdout.str()
    report = json.loads((project.path / "out" / "report.json").read_text())
    states = {(j["profile"], j["check"]): j["state"] for j in report["judgements"]}
    reasons = {(j["profile"], j["check"]): j["reason"] for j in report["judgements"]}
    numerics, cuda, oversize = VERDICT_PLANTS
    expected = {
        numerics: {"applies": "passed", "answers": "failed", "capacity": "passed", "latency": "passed"},
        oversize: {"applies": "passed", "answers": "passed", "capacity": "failed", "latency": "passed"},
        cuda: {"applies": "passed", "answers": "not judged", "capacity": "not judged", "latency": "passed"},
    }
    found = {name: {check: states.get((name, check)) for check in checks} for name, checks in expected.items()}
    assert found == expected, out[-4000:]
    for check in ("answers", "capacity"):
        assert reasons[(cuda, check)].startswith("not judged here: none of the profile's"), reasons
    md = (project.path / "out" / "report.md").read_text()
    assert f"| `{numerics}` | ❌ regression |" in md and f"| `{oversize}` | ❌ regression |" in md, md[:3000]
    assert f"| `{cuda}` | ⚠️ partly judged |" in md, md[:3000]
