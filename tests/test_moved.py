"""The former module names: each imports the module it names now, the same object, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Iterator

import pytest

from vramgate import _moved

#: Former names and the modules they name now.
CASES = [
    ("vramgate.plugin", "vramgate.pytest_plugin.plugin"),
    ("vramgate.gate", "vramgate.pytest_plugin.fixture"),
    ("vramgate.quantpack", "vramgate.models.checkpoints"),
    ("vramgate.patches", "vramgate.profiles"),
    ("vramgate.simulate", "vramgate.sim"),
]


@pytest.fixture(autouse=True)
def forget_former_names() -> Iterator[None]:
    """Each test imports the former names afresh (an import that found them in sys.modules would not warn)."""

    def forget() -> None:
        for name in [n for n in sys.modules if _moved.new_name(n) is not None]:
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent == "vramgate" and hasattr(sys.modules[parent], child):
                delattr(sys.modules[parent], child)

    forget()
    yield
    forget()


@pytest.mark.parametrize(("old", "new"), CASES)
def test_a_former_name_is_the_same_module_and_warns(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"^{old} moved to {new}$"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new
    assert sys.modules[old] is module


def test_import_statement_of_the_plugin() -> None:
    """The plain statement, as old code writes it."""
    with pytest.warns(DeprecationWarning, match=r"^vramgate\.plugin moved to vramgate\.pytest_plugin\.plugin$"):
        import vramgate.plugin as old
    import vramgate.pytest_plugin.plugin as new

    assert old is new


def test_a_submodule_of_a_moved_package_is_the_same_module() -> None:
    import vramgate.machine.probes.cpu as new

    with pytest.warns(DeprecationWarning) as record:
        import vramgate.probes.cpu as old
    assert old is new
    assert [str(w.message) for w in record] == ["vramgate.probes moved to vramgate.machine.probes",
                                                "vramgate.probes.cpu moved to vramgate.machine.probes.cpu"]
    with pytest.warns(DeprecationWarning, match=r"^vramgate\.probes\.isa moved to vramgate\.machine\.isa$"):
        import vramgate.probes.isa as isa
    assert isa is importlib.import_module("vramgate.machine.isa")
    copies = [m for m in sys.modules.values() if getattr(m, "__file__", None) == new.__file__]
    assert copies and all(m is new for m in copies)  # no second copy of the file under the former name


def test_the_former_names_export_their_public_names() -> None:
    """The packages that stand for former modules export those modules' public names."""
    from vramgate.models import ModelConfigError, ModelShape, available_models, load_model, models_dir
    from vramgate.models.config import load_model as load_model_now

    assert load_model is load_model_now
    assert {ModelShape.__name__, ModelConfigError.__name__} == {"ModelShape", "ModelConfigError"}
    assert callable(available_models) and callable(models_dir)
    with pytest.warns(DeprecationWarning):
        from vramgate.patches import ProfileClaim, build_overlay
    with pytest.warns(DeprecationWarning):
        from vramgate.simulate import simulate
    from vramgate.profiles import ProfileClaim as claim_now
    from vramgate.profiles.overlay import build_overlay as build_now
    from vramgate.sim.simulator import simulate as simulate_now

    assert (ProfileClaim, build_overlay, simulate) == (claim_now, build_now, simulate_now)


def test_an_unknown_name_still_raises() -> None:
    """A name that is neither a module nor a moved one, or a moved package's submodule that does not exist."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ModuleNotFoundError, match=r"^No module named 'vramgate\.plugins'$"):
            importlib.import_module("vramgate.plugins")
    assert record == []
    with pytest.warns(DeprecationWarning, match=r"^vramgate\.probes moved to vramgate\.machine\.probes$"):
        importlib.import_module("vramgate.probes")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ModuleNotFoundError, match=r"^No module named 'vramgate\.probes\.gpu'$"):
            importlib.import_module("vramgate.probes.gpu")
    assert record == []
    assert "vramgate.probes.gpu" not in sys.modules


@pytest.mark.parametrize(
    ("module", "name"), [(m, n) for m, names in sorted(_moved.FORWARDED.items()) for n in sorted(names)]
)
def test_a_name_a_former_module_had_resolves_where_it_lives_now(module: str, name: str) -> None:
    where, _, attr = _moved.FORWARDED[module][name].partition(":")
    with pytest.warns(DeprecationWarning, match=rf"^{module}\.{name} moved to {where}\.{attr}$"):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(where), attr)


def test_an_unknown_attribute_still_raises() -> None:
    import vramgate.engine

    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        vramgate.engine.no_such_name  # noqa: B018


def test_python_dash_m_with_a_former_name_runs_the_module_and_says_where_it_went() -> None:
    import subprocess

    from vramgate.runtime.process import pythonpath

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath({})}
    out = subprocess.run([sys.executable, "-m", "vramgate.kernel_calibrate", "--help"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m vramgate.tools.calibration.kernel_latency" in out.stdout
    assert ("vramgate.kernel_calibrate moved to vramgate.tools.calibration.kernel_latency: "
            "run python -m vramgate.tools.calibration.kernel_latency") in out.stderr
