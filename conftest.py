"""Session wiring only: the suites' fixtures, and the gate plugin when run from the source tree.

The suites' fixtures and marks are a plugin of their own
(:mod:`vramgate.testing.fixtures`); pytest takes ``pytest_plugins`` from this,
the root ``conftest.py``, only. An installed vramgate registers the gate plugin
through the ``pytest11`` entry point. On a machine that runs the gate from a
checkout (``PYTHONPATH=src``) without installing it, this registers the same
plugin.
"""

from importlib.metadata import entry_points

pytest_plugins = ["vramgate.testing.fixtures"]
if not any(ep.name == "vramgate" for ep in entry_points(group="pytest11")):
    pytest_plugins.insert(0, "vramgate.pytest_plugin.plugin")
