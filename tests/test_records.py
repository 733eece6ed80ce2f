"""Versioned records (Note [versioned records] in vramgate.core.records): every earlier version loads through its
migrations, a newer one is refused naming the file and both versions, and each record kind has one format."""

from __future__ import annotations

import pytest

from vramgate.core.records import RecordFormat


def _rename(old: str, new: str):  # type: ignore[no-untyped-def]
    def update(record: dict) -> dict:  # type: ignore[type-arg]
        record = dict(record)
        record[new] = record.pop(old)
        return record

    return update


#: A toy kind at version 3: version 1 called its figures "values", version 2 "figures", version 3 "metrics".
TOY = RecordFormat("toy record", current=3, migrations={1: _rename("values", "figures"), 2: _rename("figures",
                                                                                                  "metrics")})


@pytest.mark.parametrize(("record", "version"), [({"schema": 1, "values": [1]}, 1), ({"schema": 2, "figures": [1]}, 2),
                                                 ({"schema": 3, "metrics": [1]}, 3)])
def test_every_earlier_version_loads_as_the_current_one(record: dict, version: int) -> None:  # type: ignore[type-arg]
    assert TOY.load(record, "toy.json", ValueError) == {"schema": 3, "metrics": [1]}
    assert record["schema"] == version  # the caller's data is left as it was


@pytest.mark.parametrize(("record", "message"), [
    ({"schema": 4, "metrics": []}, r"toy\.json: toy record of schema 4, newer than this vramgate reads \(schema 3\): "
                                   "upgrade vramgate"),
    ({"metrics": []}, r"toy\.json: not a vramgate toy record: schema is None \(versions 1 to 3 are known\)"),
    ({"schema": "3"}, r"toy\.json: not a vramgate toy record: schema is '3'"),
    ({"schema": True}, r"toy\.json: not a vramgate toy record: schema is True"),
    ([1], r"toy\.json: not a vramgate toy record: the top level must be a JSON object"),
])
def test_a_record_of_an_unknown_version_is_refused_naming_the_file(record: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TOY.load(record, "toy.json", ValueError)


def test_a_format_without_every_migration_cannot_be_declared() -> None:
    with pytest.raises(ValueError, match="toy record: no migration from schema 2"):
        RecordFormat("toy record", current=3, migrations={1: _rename("values", "figures")})


def test_each_record_kind_has_its_one_format() -> None:
    """Baselines, report.json and engine results: one format each, in the layer that owns (reads) the kind; the
    writers write its current version."""
    from vramgate.engine.runner import EngineResult
    from vramgate.engine.spec import ENGINE_RESULT_FORMAT
    from vramgate.store.baselines import BASELINE_FORMAT, SCHEMA_VERSION
    from vramgate.store.report_files import REPORT_FORMAT

    assert (BASELINE_FORMAT.name, REPORT_FORMAT.name, ENGINE_RESULT_FORMAT.name) == (
        "baseline file", "report.json", "engine result")
    assert SCHEMA_VERSION == BASELINE_FORMAT.current
    from vramgate.engine import KVFigures, LatencyFigures, MemoryFigures, SchedulerFigures

    result = EngineResult(spec={}, versions={}, device="cpu",
                          kv=KVFigures(block_size=16, num_gpu_blocks=9, usable_blocks=8, capacity_tokens=128,
                                       num_layers=2, page_bytes=8192, bytes_per_token=1024),
                          memory=MemoryFigures(peak_rss_bytes=1, weights_bytes=2, parameter_bytes=2, kv_tensor_bytes=3),
                          scheduler=SchedulerFigures(steps=4, peak_blocks_in_use=5, preemptions=0, recomputed_tokens=0),
                          latency=LatencyFigures(ttft_s=[0.1], tpot_s=[0.01], e2e_s=[0.2], output_lens=[8]),
                          timing={})
    data = result.to_json()
    assert data["kv"]["page_bytes"] == 8192 and data["latency"]["ttft_s"] == [0.1]
    assert data["schema"] == ENGINE_RESULT_FORMAT.current
    assert EngineResult.from_json(data) == result
