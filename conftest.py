"""Session wiring only: make the gate plugin available when run from the source tree.

An installed vramgate registers its plugin through the ``pytest11`` entry
point. On a machine that runs the gate from a checkout (``PYTHONPATH=src``)
without installing it, this registers the same plugin.
"""

from importlib.metadata import entry_points

if not any(ep.name == "vramgate" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["vramgate.pytest_plugin.plugin"]
