"""The record schema: good records validate, bad ones are rejected naming the field."""

from __future__ import annotations

import json

import pytest

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import (
    RECORDS_FILENAME,
    Environment,
    RecordError,
    RecordWriter,
    load_records,
    validate_record,
)
from jaxlab.bench.timing import Samples
from jaxlab.config import JaxlabConfig

ENV = Environment(
    git={"commit": "abc", "dirty": False},
    versions={"jax": "0.10.2", "python": "3.11"},
    devices={"platform": "cpu", "kind": "cpu", "count": 1},
    cpu={"model": "test cpu", "cores": 2},
)


def make_ctx(tmp_path, suite="unit"):
    ctx = BenchContext(
        config=JaxlabConfig(),
        quick=True,
        run_id="run-1",
        run_dir=tmp_path,
        env=ENV,
        writer=RecordWriter(tmp_path / RECORDS_FILENAME),
        config_hash="cafe",
    )
    ctx.suite = suite
    return ctx


def good(tmp_path) -> dict:
    rec = make_ctx(tmp_path).record("t", "s", [1.0, 2.0, 3.0], case={"n": 4}, derived={"x": 1})
    return rec.model_dump(mode="json")


def test_factory_fills_every_environment_field(tmp_path):
    rec = make_ctx(tmp_path).record(
        "matmul_time", "s", [0.2, 0.1, 0.3], case={"n": 4}, derived={"gflops": float("inf")}
    )
    assert rec.schema_version == 1 and rec.suite == "unit" and rec.status == "ok"
    assert rec.run_id == "run-1" and rec.config_hash == "cafe"
    assert rec.git.commit == "abc" and rec.cpu.cores == 2 and rec.devices.platform == "cpu"
    assert rec.versions["jax"] == "0.10.2"
    assert rec.timestamp.endswith("+00:00")
    assert rec.samples == [0.2, 0.1, 0.3], "raw samples in measurement order"
    assert rec.stats.median == 0.2 and rec.stats.tails_withheld
    assert rec.derived == {"gflops": None}, "non-finite derived values become null"


def test_good_record_validates_and_roundtrips(tmp_path):
    data = good(tmp_path)
    rec = validate_record(data)
    assert validate_record(json.loads(rec.to_json_line())) == rec


@pytest.mark.parametrize(
    "field", ["schema_version", "suite", "metric", "samples", "stats", "run_id", "git", "devices"]
)
def test_missing_field_is_rejected_by_name(tmp_path, field):
    data = good(tmp_path)
    del data[field]
    with pytest.raises(RecordError, match=rf"{field}: Field required"):
        validate_record(data)


def test_wrong_schema_version_is_rejected_clearly(tmp_path):
    data = good(tmp_path) | {"schema_version": 2}
    with pytest.raises(RecordError, match=r"schema_version: this jaxlab reads schema_version 1"):
        validate_record(data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"status": "failed"}, "status is 'failed' but error is empty"),
        ({"status": "maybe"}, "status"),
        ({"error": "boom"}, "status is 'ok' but error is set"),
        ({"samples": []}, "samples is empty"),
        ({"samples": [1.0, 2.0]}, r"stats.n \(3\) does not match len\(samples\) \(2\)"),
        ({"timestamp": "yesterday"}, "ISO 8601"),
        ({"timestamp": "2025-01-01T00:00:00+02:00"}, "UTC"),
        ({"surprise": 1}, "surprise: Extra inputs are not permitted"),
        ({"better": "sideways"}, "better"),
    ],
)
def test_inconsistent_records_are_rejected(tmp_path, change, message):
    with pytest.raises(RecordError, match=message):
        validate_record(good(tmp_path) | change)


def test_failure_record_keeps_error_and_partial_samples(tmp_path):
    ctx = make_ctx(tmp_path)
    rec = ctx.record("t", "s", Samples.failed("RuntimeError: oom", times_s=[0.5]), case={"n": 1})
    assert rec.status == "failed" and rec.error == "RuntimeError: oom"
    assert rec.samples == [0.5] and rec.stats.median is None and rec.derived == {}
    validate_record(rec.model_dump(mode="json"))


def test_writer_appends_and_loader_names_the_bad_line(tmp_path):
    ctx = make_ctx(tmp_path)
    w = RecordWriter(tmp_path / "r" / RECORDS_FILENAME)
    w.write(ctx.record("a", "s", [1.0], case={}))
    w.write(ctx.record("b", "s", [2.0], case={}))
    w2 = RecordWriter(tmp_path / "r" / RECORDS_FILENAME)  # a second writer never truncates
    w2.write(ctx.record("c", "s", [3.0], case={}))
    assert [r.metric for r in load_records(tmp_path / "r")] == ["a", "b", "c"]
    assert len(load_records(tmp_path / "r" / RECORDS_FILENAME)) == 3

    path = tmp_path / "r" / RECORDS_FILENAME
    lines = path.read_text().splitlines()
    bad = json.loads(lines[1])
    del bad["unit"]
    path.write_text("\n".join([lines[0], json.dumps(bad), "{not json"]) + "\n")
    with pytest.raises(RecordError, match=r"records.jsonl:2: invalid record: unit: Field required"):
        load_records(path)
    path.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(RecordError, match=r"records.jsonl:2: not JSON"):
        load_records(path)
    with pytest.raises(RecordError, match="no such records file"):
        load_records(tmp_path / "missing")
