"""compare(): ratio of medians B/A, noise when the spread intervals overlap, unmatched listed."""

from __future__ import annotations

import pytest

from jaxlab.bench.compare import compare, interval, verdict
from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import RECORDS_FILENAME, Environment, RecordWriter
from jaxlab.config import JaxlabConfig


def make_ctx(tmp_path, run_id: str, cpu: str = "cpu A", simd: str | None = None) -> BenchContext:
    ctx = BenchContext(
        config=JaxlabConfig(),
        quick=False,
        run_id=run_id,
        run_dir=tmp_path,
        env=Environment(
            versions={"jax": "1"},
            devices={"platform": "cpu", "kind": "cpu", "count": 1},
            cpu={"model": cpu, "cores": 2, "simd": simd},
        ),
        writer=RecordWriter(tmp_path / RECORDS_FILENAME),
    )
    ctx.suite = "s"
    return ctx


def test_interval_is_median_plus_minus_two_mads(tmp_path):
    ctx = make_ctx(tmp_path, "a")
    r = ctx.record("t", "s", [1.0, 2.0, 3.0, 4.0, 10.0], case={})
    assert (r.stats.median, r.stats.mad) == (3.0, 1.0)
    assert interval(r) == (1.0, 5.0)


def test_ratio_and_verdicts(tmp_path):
    a, b = make_ctx(tmp_path, "run-a"), make_ctx(tmp_path, "run-b")
    base = [1.00, 1.01, 0.99, 1.02, 0.98]
    records_a = [
        a.record("t", "s", base, case={"case": "same"}),
        a.record("t", "s", base, case={"case": "faster"}),
        a.record("t", "s", base, case={"case": "slower"}),
        a.record("t", "s", [1.0, 2.0, 0.5, 1.5, 1.0], case={"case": "wide"}),
        a.record("t", "s", [1.0, 1.0], case={"case": "few"}),
        a.record("t", "s", base, case={"case": "broken"}),
        a.record("t", "s", base, case={"case": "only-a"}),
        a.record("tput", "MB/s", [10.0, 10.1, 9.9], case={"case": "higher"}, better="higher"),
    ]
    records_b = [
        b.record("t", "s", [x * 1.005 for x in base], case={"case": "same"}),
        b.record("t", "s", [x * 0.5 for x in base], case={"case": "faster"}),
        b.record("t", "s", [x * 2 for x in base], case={"case": "slower"}),
        b.record("t", "s", [1.3, 1.2, 1.4, 1.3, 1.1], case={"case": "wide"}),
        b.record("t", "s", [3.0, 3.0], case={"case": "few"}),
        b.record("t", "s", [], case={"case": "broken"}, error="RuntimeError: oom"),
        b.record("t", "s", base, case={"case": "only-b"}),
        b.record("tput", "MB/s", [20.0, 20.1, 19.9], case={"case": "higher"}, better="higher"),
    ]
    c = compare(records_a, records_b)
    rows = {r.case["case"]: r for r in c.rows}
    assert rows["same"].verdict == "noise"
    assert rows["same"].ratio == pytest.approx(1.005)
    assert rows["faster"].verdict == "faster" and rows["faster"].ratio == pytest.approx(0.5)
    assert rows["slower"].verdict == "slower" and rows["slower"].ratio == pytest.approx(2.0)
    assert rows["wide"].verdict == "noise", "a 30% shift inside a wide spread is noise"
    assert rows["few"].verdict == "noise" and "fewer than 3 samples" in rows["few"].reason
    assert rows["broken"].verdict == "failed" and rows["broken"].ratio is None
    assert "B failed: RuntimeError: oom" in rows["broken"].reason
    assert rows["higher"].verdict == "faster", "higher throughput is an improvement"
    assert rows["higher"].ratio == pytest.approx(2.0)
    assert [x["case"]["case"] for x in c.only_a] == ["only-a"]
    assert [x["case"]["case"] for x in c.only_b] == ["only-b"]
    assert c.counts() == {"faster": 2, "slower": 1, "noise": 3, "failed": 1}
    assert c.warnings == []
    doc = c.to_dict()
    assert doc["run_a"] == ["run-a"] and doc["run_b"] == ["run-b"] and len(doc["rows"]) == 7


def test_case_identity_is_order_insensitive_and_metric_sensitive(tmp_path):
    a, b = make_ctx(tmp_path, "a"), make_ctx(tmp_path, "b")
    ra = a.record("t", "s", [1.0, 1.0, 1.0], case={"x": 1, "y": 2})
    rb = b.record("t", "s", [1.0, 1.0, 1.0], case={"y": 2, "x": 1})
    rc = b.record("u", "s", [1.0, 1.0, 1.0], case={"x": 1, "y": 2})
    c = compare([ra], [rb, rc])
    assert len(c.rows) == 1 and c.rows[0].verdict == "noise" and c.rows[0].ratio == 1.0
    assert [x["metric"] for x in c.only_b] == ["u"]


def test_different_machines_and_duplicates_are_warned(tmp_path):
    a, b = make_ctx(tmp_path, "a", cpu="cpu A"), make_ctx(tmp_path, "b", cpu="cpu B")
    ra = a.record("t", "s", [1.0, 1.0, 1.0], case={})
    rb = b.record("t", "s", [1.0, 1.0, 1.0], case={})
    c = compare([ra, ra], [rb])
    assert any("different CPUs" in w and "not a valid comparison" in w for w in c.warnings)
    assert any("more than one record" in w for w in c.warnings)


def test_one_cpu_model_with_different_vector_units_is_two_machines(tmp_path):
    """Cloud VMs can report one ``model name`` ("AMD EPYC") for an AVX-512 and an AVX2 CPU;
    a record without the field (written before it existed) warns about nothing it lacks."""
    avx512 = make_ctx(tmp_path, "a", cpu="AMD EPYC", simd="avx512f")
    avx2 = make_ctx(tmp_path, "b", cpu="AMD EPYC", simd="avx2")
    older = make_ctx(tmp_path, "c", cpu="AMD EPYC", simd=None)
    ra, rb, rc = (ctx.record("t", "s", [1.0, 1.0, 1.0], case={}) for ctx in (avx512, avx2, older))
    warned = compare([ra], [rb]).warnings
    assert any("AMD EPYC (avx512f)" in w and "AMD EPYC (avx2)" in w for w in warned)
    assert not any("different CPUs" in w for w in compare([ra], [rc]).warnings)


def test_verdict_on_disjoint_identical_spreads(tmp_path):
    a, b = make_ctx(tmp_path, "a"), make_ctx(tmp_path, "b")
    ra = a.record("t", "s", [1.0, 1.0, 1.0], case={})
    rb = b.record("t", "s", [1.1, 1.1, 1.1], case={})
    ratio, v, _ = verdict(ra, rb)
    assert v == "slower" and ratio == pytest.approx(1.1)
