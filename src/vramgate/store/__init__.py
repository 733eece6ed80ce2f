"""Storage: baseline files (readable JSON), atomic locked file writes (:mod:`vramgate.store.files`), the
baselines a change moves, and the history of every stored value (:mod:`vramgate.store.history`)."""

from vramgate.store.history import (
    HistoryError,
    SeriesKey,
    baseline_history,
    history_json,
    merge_history,
    report_points,
    select,
)

__all__ = [
    "HistoryError",
    "SeriesKey",
    "baseline_history",
    "history_json",
    "merge_history",
    "report_points",
    "select",
]
