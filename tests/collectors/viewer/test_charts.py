"""The SVG charts carry exactly the points they are given, escape names, and label close ticks apart."""

from __future__ import annotations

import math
import re

import pytest

from collectors.viewer.charts import Series, _label, _ticks, line_chart


def test_points_are_in_the_svg_exactly_and_names_are_escaped() -> None:
    svg = line_chart("reward <by> version", [Series("a&b", [(0, 0.25), (1, 0.5), (3, -1.0)]), Series("empty", [])],
                     x_label="policy version")
    points = [(float(x), float(y)) for x, y in re.findall(r'data-x="([^"]+)" data-y="([^"]+)"', svg)]
    assert points == [(0, 0.25), (1, 0.5), (3, -1.0)]
    assert "a&amp;b" in svg and "reward &lt;by&gt; version" in svg and "<by>" not in svg
    assert 'data-name="empty"' not in svg  # a series without points is left out


def test_nothing_to_draw_says_so() -> None:
    assert "no data yet" in line_chart("loss", [Series("loss", [])], x_label="learner step")


def test_tick_labels_tell_close_values_apart() -> None:
    ticks = _ticks(0.999996, 1.000003)
    labels = [_label(t, ticks) for t in ticks]
    assert len(set(labels)) == len(labels) and "1.000000" in labels
    assert [_label(t, _ticks(0, 2.4e-7)) for t in _ticks(0, 2.4e-7)] == ["0", "1.0e-07", "2.0e-07"]
    assert _ticks(0, 7, 6, integers=True) == [0, 2, 4, 6]  # versions: no tick between two of them


EXTREMES = [
    [(0, 1.7e308), (1, -1.7e308)],  # a finite range whose width overflows
    [(0, 1.7e308), (1, 1.7e308)],  # flat at the limit: widening it overflows
    [(0, 0.0), (1, 5e-324)],  # two values the float grid cannot split in half
    [(0, 1e-320), (1, 1.5e-320), (2, 1e-323)],  # subnormals: ticks of 10**-324 round to 0
    [(0, float("nan")), (1, 1.0), (2, float("inf")), (3, -float("inf"))],  # non-finite points
    [(2**63 - 1, 1.0), (2**63 - 1, 2.0)],  # one version at the int64 limit
    [(-1.7e308, 0.5), (1.7e308, 0.25)],  # x at both limits
]


def test_extreme_values_draw_a_chart() -> None:
    """Each used to raise (OverflowError, ZeroDivisionError, StopIteration, ValueError) and fail the page."""
    for points in EXTREMES:
        svg = line_chart("reward", [Series("reward", points)], x_label="policy version")
        assert "<svg" in svg and "could not be drawn" not in svg, points
        coords = re.findall(r'cx="([^"]+)" cy="([^"]+)"', svg)
        assert coords and all(math.isfinite(float(c)) for xy in coords for c in xy), (points, coords)
    nan = line_chart("reward", [Series("reward", EXTREMES[4])], x_label="v")
    assert "3 non-finite points not drawn" in nan and len(re.findall("<circle", nan)) == 1
    only_nan = line_chart("reward", [Series("reward", [(0, float("nan"))])], x_label="v")
    assert "no data yet" in only_nan and "1 non-finite point not drawn" in only_nan


def test_a_chart_that_fails_is_a_note_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever raises inside one chart stays in that chart (logged)."""
    svg = line_chart("odd", [Series("odd", [(0, "not a number")])], x_label="v")  # type: ignore[list-item]
    assert "this chart could not be drawn" in svg and 'data-title="odd"' in svg
    assert "could not draw the chart 'odd'" in caplog.text
