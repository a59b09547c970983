"""The SVG charts carry exactly the points they are given, escape names, and label close ticks apart."""

from __future__ import annotations

import re

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
