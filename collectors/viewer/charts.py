"""Line charts as inline SVG, drawn on the server: no plotting library in the page, no network.

Hand-written because a chart here is a few polylines with axes and hover titles; a JavaScript
plotting bundle would be most of the viewer's size, and matplotlib's SVG takes ~100 ms a chart.
Each point carries a `<title>` (series, x, y) and `data-x` / `data-y`, so a person reads values
by hovering and a test reads them from the DOM.

Any finite values draw, up to the float limits: ranges are computed in halves (`hi/2 - lo/2`
never overflows), a range of zero width (one value, or two values too close for the float
grid) is widened around its value, and non-finite points are left out and counted in the
caption. A chart that still cannot be drawn is replaced by a note saying so, logged, and
never takes the page (the other charts, the other runs) with it.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 420, 190
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 10, 34
MAX_TICKS = 12
log = logging.getLogger(__name__)
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]  # (x, y), x ascending


def _ticks(lo: float, hi: float, n: int = 4, integers: bool = False) -> list[float]:
    """Round tick values from `lo` to `hi` (finite); overflow-free near the float limits."""
    raw = hi / n - lo / n
    if not 0 < raw < math.inf:
        return [lo]
    step = 10.0 ** math.floor(math.log10(raw))
    step *= next((m for m in (1, 2, 5, 10) if step * m >= raw), 10)
    if integers:  # versions and steps: no tick between two of them
        step = max(1.0, math.ceil(step))
    if not 0 < step < math.inf:  # a range at the bottom of the subnormals: 10**k rounds to 0
        return [lo, hi]
    first = math.ceil(lo / step) * step
    count = min(int(hi / step - first / step + 1e-9) + 1, MAX_TICKS)
    return [first + i * step for i in range(max(count, 1))]


def _widened(lo: float, hi: float, pad: float = 0.0) -> tuple[float, float]:
    """A range of zero width (after the halving the scale divides by) opened around its value: by `pad`
    when that opens it, else by half its size, else by 1."""
    if hi / 2 - lo / 2 > 0:
        return lo, hi
    for by in (pad, abs(lo) * 0.5, 1.0):
        wide = max(lo - by, -sys.float_info.max), min(hi + by, sys.float_info.max)
        if wide[1] / 2 - wide[0] / 2 > 0:
            return wide
    raise ValueError(f"cannot scale an axis from {lo!r} to {hi!r}")


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
    """An SVG chart of `series` (empty series are left out); a note instead when nothing has a point, and
    when the chart cannot be drawn (logged: the page around it still renders)."""
    head = f'<figure class="chart" data-title="{escape(title)}"><figcaption>{escape(title)}</figcaption>'
    try:
        return _draw(title, head, series, x_label)
    except Exception as exc:  # noqa: BLE001 - one chart's values must not fail the page
        log.exception("could not draw the chart %r", title)
        return head + f'<p class="empty">this chart could not be drawn ({escape(type(exc).__name__)}: ' \
                      f'{escape(str(exc))})</p></figure>'


def _finite(s: Series) -> Series:
    return Series(s.name, [(x, y) for x, y in s.points if math.isfinite(x) and math.isfinite(y)])


def _draw(title: str, head: str, given: Sequence[Series], x_label: str) -> str:
    kept = [_finite(s) for s in given]
    dropped = sum(len(s.points) for s in given) - sum(len(s.points) for s in kept)
    note = f'<p class="note">{dropped} non-finite point{"s" * (dropped != 1)} not drawn</p>' if dropped else ""
    series = [s for s in kept if s.points]
    if not series:
        return head + note + '<p class="empty">no data yet</p></figure>'
    xs = [p[0] for s in series for p in s.points]
    ys = [p[1] for s in series for p in s.points]
    x0, x1 = _widened(min(xs), max(xs), pad=1.0)
    y0, y1 = _widened(min(ys), max(ys))
    x_half, y_half = x1 / 2 - x0 / 2, y1 / 2 - y0 / 2  # half the spans: finite for any finite ends
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x / 2 - x0 / 2) / x_half * pw

    def sy(y: float) -> float:
        return TOP + ph - (y / 2 - y0 / 2) / y_half * ph

    out = [head, note, f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img">']
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
