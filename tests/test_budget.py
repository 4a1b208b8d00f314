"""The verify cost curve: measured, cached, extrapolated, then priced by what the engine sees in use."""

import json

import pytest
from tiny import tiny_native

from specdecode.planner import budget
from specdecode.planner.budget import CostCurve, InUseCurve


def test_curve_extrapolates_and_reports_ratios():
    curve = CostCurve((1.0, 1.5, 2.0))
    assert curve.cost(1) == 1.0 and curve.cost(3) == 2.0 and curve.cost(5) == pytest.approx(3.0)
    assert curve.ratios() == [1.0, 1.5, 2.0]
    assert curve.to_dict()["ratio_to_one_token"] == [1.0, 1.5, 2.0]


def test_in_use_medians_replace_the_measured_sizes_and_scale_the_rest():
    measured = CostCurve((3.0, 3.1, 3.5, 4.0), tail=((8, 6.0),))  # measured in a quiet moment
    in_use = InUseCurve(measured, window=5, min_times=3)
    assert in_use.observe(2, 5.0) is measured and in_use.observe(2, 4.0) is measured  # too few times yet
    curve = in_use.observe(2, 4.5)
    assert curve.seconds[1] == 4.5  # the median of 5.0, 4.0, 4.5
    scale = 4.5 / 3.1  # the other sizes follow the machine's speed now
    assert in_use._curve(explore=False).seconds == pytest.approx((3.0 * scale, 4.5, 3.5 * scale, 4.0 * scale))
    assert curve.seconds[2] == pytest.approx(4.5 + (4.5 - 3.0 * scale))  # the size after the timed one: tried
    assert curve.tail[0][0] == 8 and curve.tail[0][1] == pytest.approx(6.0 * scale)
    for seconds in (1.0, 9.0, 9.0):  # one lucky forward moves no median
        curve = in_use.observe(4, seconds)
    assert curve.seconds[3] == 9.0  # two sizes known now: the others scale by the median of their ratios
    assert curve.seconds[2] == pytest.approx(3.5 * (4.5 / 3.1 + 9.0 / 4.0) / 2)
    assert in_use.observe(30, 0.1) is curve and in_use.observe(1, float("nan")) is curve  # not kept


def test_a_priced_size_is_priced_again_every_few_times_not_after_every_forward():
    in_use = InUseCurve(CostCurve((1.0, 2.0)), window=8, min_times=1, refresh=3)
    assert in_use.observe(1, 4.0).seconds[0] == 4.0  # first priced at once
    assert in_use.observe(1, 6.0).seconds[0] == 4.0 and in_use.observe(1, 6.0).seconds[0] == 4.0
    assert in_use.observe(1, 6.0).seconds[0] == 6.0  # the third time since: the median of 4, 6, 6, 6
    assert in_use.observe(2, 7.0).seconds[1] == 7.0  # another size's first price is not held back


def test_in_use_curve_never_prices_more_rows_below_fewer():
    in_use = InUseCurve(CostCurve((1.0, 1.2, 1.4, 1.6)), window=4, min_times=1)
    in_use.observe(2, 2.0)
    curve = in_use.observe(3, 1.5)  # a noisy median below its smaller neighbour
    assert list(curve.seconds) == sorted(curve.seconds) and curve.seconds[2] == 2.0
    window = InUseCurve(CostCurve((1.0, 2.0)), window=3, min_times=1)
    for seconds in (5.0, 5.0, 5.0, 1.0, 1.0):  # the window forgets: the machine got faster
        curve = window.observe(1, seconds)
    assert curve.seconds[0] == 1.0


def test_sizes_never_timed_follow_their_nearest_timed_neighbours():
    in_use = InUseCurve(CostCurve((1.0, 1.1, 1.2, 2.0, 2.2)), min_times=1)
    in_use.observe(2, 1.1)  # as measured
    curve = in_use.observe(4, 4.0)  # twice the measured time
    # one row (never timed: every step drafted) follows two rows, not the dearer end of the curve
    assert curve.seconds[0] == pytest.approx(1.0) and curve.seconds[4] == pytest.approx(4.4)
    assert curve.seconds[2] == pytest.approx(1.2 * 1.5)  # halfway between the ratios of 2 and 4 rows


def test_a_size_priced_too_dear_by_a_busy_measurement_gets_tried_and_timed():
    # Measured while the machine was busy: 3 rows and more priced far above what they cost in use.
    in_use = InUseCurve(CostCurve((1.0, 1.05, 1.8, 2.4, 2.8)), min_times=2)
    for seconds in (1.05, 1.05):  # a drafter that always drafts one token: only 2 rows are ever timed
        curve = in_use.observe(2, seconds)
    # the next size is priced at what the last row added, the ones after it as measured
    assert curve.cost(3) == pytest.approx(1.10) and curve.cost(4) == pytest.approx(2.4)
    for seconds in (1.12, 1.12):  # tried: it costs about that
        curve = in_use.observe(3, seconds)
    assert curve.cost(3) == pytest.approx(1.12) and curve.cost(4) == pytest.approx(1.19)  # and the next one's turn
    assert in_use._curve(explore=False).cost(4) == pytest.approx(2.4 * 1.12 / 1.8)  # no guess is written back
    for seconds in (2.9, 2.9):  # a size that is as dear as measured stays so, and the guess past it follows
        curve = in_use.observe(4, seconds)
    assert curve.cost(4) == pytest.approx(2.9) and curve.cost(5) == pytest.approx(2.8 * 2.9 / 2.4)


def test_a_size_priced_during_a_stall_and_never_verified_again_is_forgotten_and_tried_again():
    in_use = InUseCurve(CostCurve((1.0, 1.05, 1.1, 1.2)), min_times=2, refresh=1, stale=10)
    for m in (2, 3, 4):  # a stall: every size at 2.5x
        for _ in range(2):
            in_use.observe(m, 2.5 * in_use.measured.cost(m))
    curve = in_use.observe(2, 1.05)
    for _ in range(4):  # quiet again, and only 2 rows verified: 3 rows stay at the stall's price for a while
        curve = in_use.observe(2, 1.05)
    assert curve.cost(3) == pytest.approx(2.75)
    for _ in range(10):
        curve = in_use.observe(2, 1.05)
    assert sorted(in_use.medians) == [2]  # the sizes not timed since the stall are forgotten
    assert curve.cost(3) == pytest.approx(1.1) and curve.cost(4) == pytest.approx(1.2)  # as measured, and tried


def test_two_rows_priced_out_by_a_busy_measurement_get_tried_after_one_row_is_timed():
    # Measured under load: two rows at 2.4x one, so no draft pays and only one-row forwards are ever timed.
    in_use = InUseCurve(CostCurve((1.0, 2.4, 3.0, 3.5)), min_times=2)
    for seconds in (0.8, 0.8):
        curve = in_use.observe(1, seconds)
    assert curve.cost(2) == pytest.approx(0.8 * budget.SECOND_ROW_PRIOR) and curve.cost(3) == pytest.approx(2.4)
    assert in_use._curve(explore=False).cost(2) == pytest.approx(2.4 * 0.8)  # the trial price is a guess, not a timing
    for seconds in (0.88, 0.88):  # tried and timed: the climb goes on from there
        curve = in_use.observe(2, seconds)
    assert curve.cost(2) == pytest.approx(0.88) and curve.cost(3) == pytest.approx(0.96)
    quiet = InUseCurve(CostCurve((1.0, 1.1, 1.3)), min_times=1)
    assert quiet.observe(1, 1.0).cost(2) == pytest.approx(1.1)  # a cheaper measured price stands


def test_measure_is_monotone_and_cached(tmp_path, monkeypatch):
    model = tiny_native("qwen2", seed=0)
    calls = []
    real = budget.measure
    monkeypatch.setattr(budget, "measure", lambda target: calls.append(1) or real(target, max_tokens=4, prefix=8,
                                                                                     repeats=2))
    assert budget.load_cached("tiny", cache=tmp_path) is None  # never measured: nothing to read, nothing measured
    first = budget.load_or_measure(model, "tiny", cache=tmp_path)
    assert budget.load_cached("tiny", cache=tmp_path) == first
    assert len(first.seconds) == 4 and list(first.seconds) == sorted(first.seconds) and first.seconds[0] > 0
    again = budget.load_or_measure(model, "tiny", cache=tmp_path)
    assert again == first and len(calls) == 1  # read back, not measured twice
    budget.load_or_measure(model, "another model", cache=tmp_path)
    assert len(calls) == 2  # another key: measured for itself
    path = budget.curve_path("tiny", tmp_path)
    path.write_text("{damaged")
    assert budget.load_cached("tiny", cache=tmp_path) is None
    assert len(budget.load_or_measure(model, "tiny", cache=tmp_path).seconds) == 4  # measured again, no crash
    measured = len(calls)
    for seconds in ([0.0, 0.1], [float("nan"), 0.1], [0.2, 0.1], []):  # zero, NaN, cheaper for more rows, empty
        path.write_text(json.dumps({"seconds": seconds, "batch_sizes": []}))
        curve = budget.load_or_measure(model, "tiny", cache=tmp_path)
        assert budget.valid(curve.seconds, curve.tail) and len(calls) == measured + 1, seconds
        measured += 1


def test_the_curve_priced_in_use_is_written_back_for_the_next_process(tmp_path, monkeypatch):
    model = tiny_native("qwen2", seed=0)
    monkeypatch.setattr(budget, "measure", lambda target: CostCurve((1.0, 1.1, 1.2, 1.3)))
    first = budget.load_or_measure(model, "tiny", cache=tmp_path)
    path = budget.curve_path("tiny", tmp_path)
    assert first.source == path
    in_use = InUseCurve(first, min_times=2)
    in_use.observe(2, 2.2)
    assert budget.load_or_measure(model, "tiny", cache=tmp_path) == first  # nothing priced yet
    in_use.observe(2, 2.2)  # two rows priced: twice the measured time, and the sizes around them with it
    again = budget.load_or_measure(model, "tiny", cache=tmp_path)
    assert again.seconds == pytest.approx((2.0, 2.2, 2.4, 2.6)) and again.source == path
    assert json.loads(path.read_text())["model"] == "tiny"  # the file still says what it is for
    blocked = tmp_path / "a file"
    blocked.write_text("")
    budget.save(blocked / "curve.json", again)  # a cache that cannot be written: no error, nothing lost


def test_the_next_process_gets_the_level_seen_in_use_and_the_measured_shape(tmp_path, monkeypatch):
    model = tiny_native("qwen2", seed=0)
    monkeypatch.setattr(budget, "measure", lambda target: CostCurve((1.0, 1.1, 1.2, 1.3), tail=((8, 2.0),)))
    first = budget.load_or_measure(model, "tiny", cache=tmp_path)
    in_use = InUseCurve(first, min_times=1)
    in_use.observe(1, 1.3)  # one row timed at one moment (or beside short prompts), three rows at another
    in_use.observe(3, 1.8)
    assert in_use.curve.cost(3) / in_use.curve.cost(1) == pytest.approx(1.8 / 1.3)  # this process believes them
    again = budget.load_or_measure(model, "tiny", cache=tmp_path)
    level = (1.3 + 1.5) / 2  # the median of the two sizes' in-use/measured ratios
    assert again.seconds == pytest.approx((level, 1.1 * level, 1.2 * level, 1.3 * level))
    assert again.tail[0][1] == pytest.approx(2.0 * level)
    for _ in range(5):  # processes in turn: the shape never drifts from the measurement
        in_use = InUseCurve(budget.load_or_measure(model, "tiny", cache=tmp_path), min_times=1)
        in_use.observe(1, 1.3)
        in_use.observe(3, 1.8)
    assert budget.load_or_measure(model, "tiny", cache=tmp_path).ratios() == pytest.approx([1.0, 1.1, 1.2, 1.3])


def test_batch_sizes_beyond_the_measured_run_interpolate_between_measured_points():
    curve = CostCurve((1.0, 1.1, 1.2), tail=((8, 2.0), (16, 5.0)))
    assert curve.cost(3) == 1.2 and curve.cost(8) == 2.0
    assert curve.cost(12) == pytest.approx(3.5)  # halfway between 8 and 16
    assert curve.cost(24) == pytest.approx(8.0)  # past the last point: its slope
    in_use = InUseCurve(curve, min_times=1)
    tail = in_use.observe(2, 0.55).tail  # half as dear: so are the batches
    assert [m for m, _ in tail] == [8, 16] and [s for _, s in tail] == pytest.approx([1.0, 2.5])
    assert curve.to_dict()["batch_sizes"] == [[8, 2.0], [16, 5.0]]
