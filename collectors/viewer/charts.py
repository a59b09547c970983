"""Line charts as inline SVG, drawn on the server: no plotting library in the page, no network.

Hand-written because a chart here is a few polylines with axes and hover titles; a JavaScript
plotting bundle would be most of the viewer's size, and matplotlib's SVG takes ~100 ms a chart.
Each point carries a `<title>` (series, x, y) and `data-x` / `data-y`, so a person reads values
by hovering and a test reads them from the DOM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 420, 190
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 10, 34
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]  # (x, y), x ascending


def _ticks(lo: float, hi: float, n: int = 4, integers: bool = False) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if step * m >= raw)
    if integers:  # versions and steps: no tick between two of them
        step = max(1.0, math.ceil(step))
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(t: float, ticks: list[float]) -> str:
    """A tick's label with as many decimals as the spacing needs (weights near 1 differ in the 6th place)."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 0
    if step and 1e-9 < step < 1 and abs(t) < 1e4:
        label = f"{t:.{-math.floor(math.log10(step))}f}"
        if len(label) <= 8:
            return label
        return f"{t:.1e}" if t else "0"
    return _fmt(t)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


def line_chart(title: str, series: Sequence[Series], *, x_label: str) -> str:
    """An SVG chart of `series` (empty series are left out); a note instead when nothing has a point."""
    series = [s for s in series if s.points]
    head = f'<figure class="chart" data-title="{escape(title)}"><figcaption>{escape(title)}</figcaption>'
    if not series:
        return head + '<p class="empty">no data yet</p></figure>'
    xs = [p[0] for s in series for p in s.points]
    ys = [p[1] for s in series for p in s.points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if y0 == y1:
        y0, y1 = y0 - (abs(y0) or 1) * 0.5, y1 + (abs(y1) or 1) * 0.5
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return TOP + ph - (y - y0) / (y1 - y0) * ph

    out = [head, f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img">']
    y_ticks = _ticks(y0, y1)
    for t in y_ticks:
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
                   f'<text class="tick" x="{LEFT - 4}" y="{sy(t) + 3:.1f}" text-anchor="end">{_label(t, y_ticks)}</text>')
    for t in _ticks(x0, x1, 6, integers=all(float(x).is_integer() for x in xs)):
        out.append(f'<text class="tick" x="{sx(t):.1f}" y="{HEIGHT - BOTTOM + 13}" text-anchor="middle">'
                   f'{_fmt(t)}</text>')
    out.append(f'<text class="axis" x="{LEFT + pw / 2:.0f}" y="{HEIGHT - 4}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s.points)
        out.append(f'<g class="series" data-name="{escape(s.name)}"><polyline fill="none" stroke="{color}" '
                   f'stroke-width="1.6" points="{path}"/>')
        for x, y in s.points:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.4" fill="{color}" data-x="{x:g}" '
                       f'data-y="{y!r}"><title>{escape(s.name)} at {x_label} {x:g}: {_fmt(y)}</title></circle>')
        out.append("</g>")
    out.append("</svg>")
    if len(series) > 1 or series[0].name != title:
        out.append('<div class="legend">' + "".join(
            f'<span><i style="background:{COLORS[i % len(COLORS)]}"></i>{escape(s.name)}</span>'
            for i, s in enumerate(series)) + "</div>")
    return "".join(out) + "</figure>"
