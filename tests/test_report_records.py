"""Report records: report.json read into its dataclasses and written back byte for byte, and every renderer's
output of a rich run held unchanged (the golden files under ``tests/data/report_golden``, made by
``tests/report_samples.py``)."""

from __future__ import annotations

import pytest

from report_samples import GOLDEN, outputs

OUTPUTS = outputs()


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_every_renderer_output_is_unchanged(name: str) -> None:
    assert OUTPUTS[name] == (GOLDEN / name).read_text(encoding="utf-8")


def test_the_golden_files_are_all_checked() -> None:
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(OUTPUTS)
