"""The order of the tests on a pytest-xdist worker under ``--gate-durations`` (Note [longest first] in
:mod:`vramgate.store.durations`)."""

from __future__ import annotations

import pytest


class WorkerOrder:
    """``--gate-durations`` on a pytest-xdist worker: the order that deals each worker an about equally long run
    of tests (Note [longest first] in vramgate.store.durations)."""

    def __init__(self, durations: dict[str, float]) -> None:
        self.durations = durations

    @pytest.hookimpl(trylast=True)  # after -m and -k deselected: worksteal splits what is left
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Order *items* for this run's number of workers, the ``gate_reference`` tests first, the tests of one
        ``gate_together`` group in one run."""
        from vramgate.store.durations import worker_order

        workers = int(getattr(config, "workerinput", {}).get("workercount") or 1)
        first = [i for i, item in enumerate(items) if item.get_closest_marker("gate_reference") is not None]
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            mark = item.get_closest_marker("gate_together")
            if mark is not None and mark.args:
                groups.setdefault(str(mark.args[0]), []).append(i)
        ranked = worker_order([item.nodeid for item in items], self.durations, workers, first,
                              together=list(groups.values()))
        items[:] = [items[i] for i in ranked]
