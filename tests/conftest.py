from pathlib import Path

import pytest

import vramgate.testing.matrix_suites  # noqa: F401 - the repository's matrix suites, registered once for every test
from patch_support import ORIGINAL
from vramgate.profiles import overlay

pytest_plugins = ["pytester"]

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
