"""The verify cost curve: measured, cached, extrapolated, lowered by what the engine sees."""

import json

import pytest

from specdecode import budget
from specdecode.budget import CostCurve
from tiny import tiny_native


def test_curve_extrapolates_and_reports_ratios():
    curve = CostCurve((1.0, 1.5, 2.0))
    assert curve.cost(1) == 1.0 and curve.cost(3) == 2.0 and curve.cost(5) == pytest.approx(3.0)
    assert curve.ratios() == [1.0, 1.5, 2.0]
    assert curve.to_dict()["ratio_to_one_token"] == [1.0, 1.5, 2.0]


def test_observed_times_only_lower_the_curve_and_keep_it_monotone():
    curve = CostCurve((3.0, 3.1, 3.5, 4.0))  # measured in a slow spell
    assert curve.observe(2, 5.0) is curve  # slower than measured: a busy moment, not the machine
    faster = curve.observe(3, 2.8)  # 0.8x measured: the sizes above follow, the ones below are capped
    assert faster.seconds == pytest.approx((2.8, 2.8, 2.8, 3.2))
    assert faster.observe(1, 2.0).seconds == pytest.approx((2.0, 2.0, 2.0, 2.0 / 2.8 * 3.2))
    assert curve.observe(30, 0.1) is curve  # beyond the measured sizes: extrapolated, not observed


def test_measure_is_monotone_and_cached(tmp_path, monkeypatch):
    model = tiny_native("qwen2", seed=0)
    calls = []
    real = budget.measure
    monkeypatch.setattr(budget, "measure", lambda target: calls.append(1) or real(target, max_tokens=4, prefix=8,
                                                                                     repeats=2))
    first = budget.load_or_measure(model, "tiny", cache=tmp_path)
    assert len(first.seconds) == 4 and list(first.seconds) == sorted(first.seconds) and first.seconds[0] > 0
    again = budget.load_or_measure(model, "tiny", cache=tmp_path)
    assert again == first and len(calls) == 1  # read back, not measured twice
    budget.load_or_measure(model, "another model", cache=tmp_path)
    assert len(calls) == 2  # another key: measured for itself
    path = budget.curve_path("tiny", tmp_path)
    path.write_text("{damaged")
    assert len(budget.load_or_measure(model, "tiny", cache=tmp_path).seconds) == 4  # measured again, no crash
    measured = len(calls)
    for seconds in ([0.0, 0.1], [float("nan"), 0.1], [0.2, 0.1], []):  # zero, NaN, cheaper for more rows, empty
        path.write_text(json.dumps({"seconds": seconds, "batch_sizes": []}))
        curve = budget.load_or_measure(model, "tiny", cache=tmp_path)
        assert budget.valid(curve.seconds, curve.tail) and len(calls) == measured + 1, seconds
        measured += 1


def test_batch_sizes_beyond_the_measured_run_interpolate_between_measured_points():
    curve = CostCurve((1.0, 1.1, 1.2), tail=((8, 2.0), (16, 5.0)))
    assert curve.cost(3) == 1.2 and curve.cost(8) == 2.0
    assert curve.cost(12) == pytest.approx(3.5)  # halfway between 8 and 16
    assert curve.cost(24) == pytest.approx(8.0)  # past the last point: its slope
    assert curve.observe(2, 0.55).tail == ((8, 1.0), (16, 2.5))  # half as dear: so are the batches
    assert curve.to_dict()["batch_sizes"] == [[8, 2.0], [16, 5.0]]
