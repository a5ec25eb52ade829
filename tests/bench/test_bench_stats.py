"""Statistics: known values, tails withheld below min_samples_for_tails, present at/above."""

from __future__ import annotations

import math

import pytest

from jaxlab.bench.stats import percentile, summarize


def test_known_values_small_sample_withholds_tails():
    s = summarize([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (s.n, s.mean, s.median, s.min, s.max) == (5, 3.0, 3.0, 1.0, 5.0)
    assert s.std == pytest.approx(math.sqrt(2.5))  # sample std, n - 1
    assert s.mad == 1.0  # |x - 3| = 2,2,1,0,1 -> median 1
    assert s.p90 is None and s.p99 is None
    assert s.tails_withheld is True
    assert s.tails_reason == "n=5 < min_samples_for_tails=20"


def test_tails_withheld_at_19_present_at_20():
    s19 = summarize([float(i) for i in range(1, 20)])
    assert s19.tails_withheld and s19.p90 is None and s19.p99 is None
    s20 = summarize([float(i) for i in range(1, 21)])
    assert not s20.tails_withheld and s20.tails_reason is None
    # linear interpolation: position (n - 1) * q
    assert s20.p90 == pytest.approx(1 + 19 * 0.9)
    assert s20.p99 == pytest.approx(1 + 19 * 0.99)


def test_percentiles_match_numpy_linear_on_1_to_100():
    s = summarize([float(i) for i in range(100, 0, -1)])
    assert s.median == 50.5
    assert s.p90 == pytest.approx(90.1)
    assert s.p99 == pytest.approx(99.01)
    np = pytest.importorskip("numpy")
    xs = list(range(1, 101))
    assert s.p90 == pytest.approx(float(np.percentile(xs, 90)))
    assert s.p99 == pytest.approx(float(np.percentile(xs, 99)))


def test_threshold_is_configurable():
    s = summarize([1.0, 2.0, 3.0], min_samples_for_tails=3)
    assert not s.tails_withheld and s.p99 == pytest.approx(2.98)
    with pytest.raises(ValueError):
        summarize([1.0], min_samples_for_tails=0)


def test_single_sample_and_empty_and_forced_withholding():
    one = summarize([2.0])
    assert one.median == 2.0 and one.std is None and one.mad == 0.0
    empty = summarize([])
    assert empty.n == 0 and empty.median is None and empty.tails_reason == "no samples"
    failed = summarize([1.0, 2.0], withheld_reason="measurement failed")
    assert failed.n == 2 and failed.median is None and failed.tails_withheld
    with pytest.raises(ValueError, match="no median"):
        _ = empty.median_value


def test_even_median_and_percentile_edges():
    assert summarize([1.0, 2.0, 3.0, 4.0]).median == 2.5
    assert percentile([1.0, 2.0], 0.0) == 1.0 and percentile([1.0, 2.0], 1.0) == 2.0
    with pytest.raises(ValueError):
        percentile([], 0.5)
    with pytest.raises(ValueError):
        summarize([1.0, float("nan")])
