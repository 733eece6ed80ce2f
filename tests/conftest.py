from pathlib import Path

import pytest

from patch_support import ORIGINAL
from vramgate.matrix.suite_files import declare_project_suites
from vramgate.profiles import overlay

pytest_plugins = ["pytester"]

# The repository's matrix suites (suites/*/suite.toml), registered once for every test that reads a matrix.
declare_project_suites(Path(__file__).resolve().parents[1])

# Writing a report imports matplotlib (and numpy) inside in-process pytester runs. pytester drops the modules an
# inner run imported when it ends, and numpy refuses to load twice in one process: import them once, up front,
# so that which test writes the first report does not matter.
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot
except ImportError:
    pass


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for the installed target package (version 0.32.0) that profiles' diffs apply to."""
    site = tmp_path / "site"
    (site / "fakepkg" / "sub").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("")
    (site / "fakepkg" / "sched.py").write_text(ORIGINAL)
    (site / "fakepkg" / "sub" / "__init__.py").write_text("VALUE = 7\n")
    monkeypatch.setattr(overlay, "installed_target", lambda profile: ("vllm", "0.32.0", site / "fakepkg"))
    return site / "fakepkg"
