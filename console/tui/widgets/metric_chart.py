"""MetricChart: one metric's curves, drawn by plotext (through textual-plotext's widget).

What a chart shows (:class:`ChartOptions`): rank 0's curve, the median across ranks with the
min and max as a band of two dim lines, and the chosen ranks' curves, overlaid; x is the step
or the server time. Each curve is drawn a run at a time: a run is consecutive points of one
attempt (a resumed run's steps go back: never a line drawn back across a restart) that are
all redone or all not; redone points (steps an earlier attempt already reached) are drawn in
:data:`REDONE` colour. Restarts are vertical lines (:data:`RESTART`): by step, where an
attempt's points begin; by time, at each restart event's server time.

Cost: plotext draws in Python, 50-200 ms a chart of five curves of a thousand points here. So
a chart is built only when its data, options or size changed (:meth:`MetricChart.show`
compares a key; the screen asks at most once a second), never on a mere repaint; in a thread
(:func:`build_chart`, a fresh plot each time), the chart showing its last drawing meanwhile,
so the keys do not wait for it; and from at most two points a column of the chart (the
lowest and highest of the points it covers: :func:`_thin`), whatever the curve holds.

Untrusted text: the metric's name is drawn by the screen as ``Text`` (never markup), not by
plotext; plotext draws numbers and the labels written here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from rich.text import Text
from textual.app import RenderResult
from textual_plotext import PlotextPlot
from textual_plotext.plot import Plot

from elastic_console.job.formatting import fmt_clock
from elastic_console.job.metrics import CurvePoint, JobMetrics

__all__ = [
    "AGGREGATE_COLOR",
    "BAND",
    "CHOSEN_COLORS",
    "RANK0",
    "REDONE",
    "RESTART",
    "ChartOptions",
    "MetricChart",
    "chart_series",
]

RGB = tuple[int, int, int]
RANK0: RGB = (46, 204, 113)
AGGREGATE_COLOR: RGB = (52, 152, 219)
BAND: RGB = (127, 140, 141)
CHOSEN_COLORS: tuple[RGB, ...] = ((155, 89, 182), (241, 196, 15), (26, 188, 156),
                                  (255, 121, 198))
REDONE: RGB = (230, 126, 34)
RESTART: RGB = (231, 76, 60)
#: Vertical restart lines drawn at most (the newest).
MAX_RESTART_LINES = 32
_TICKS = 5


@dataclass(frozen=True)
class ChartOptions:
    """What a chart draws. ``chosen``: ranks overlaid (their colours by position)."""

    by_time: bool = False
    rank0: bool = True
    aggregate: bool = True
    chosen: tuple[int, ...] = ()
    utc: bool = False


@dataclass(frozen=True)
class Series:
    """One curve as drawn: its label, colour, points, and whether it is a band's edge."""

    label: str
    color: RGB
    points: list[CurvePoint]
    band: bool = False


def chart_series(metrics: JobMetrics, metric: str, opts: ChartOptions) -> list[Series]:
    """The curves of ``metric`` that ``opts`` asks for and that have points, band first
    (drawn underneath)."""
    out: list[Series] = []
    if opts.aggregate:
        for source in ("min", "max"):
            pts = metrics.curve(metric, source)
            if pts:
                out.append(Series(source, BAND, pts, band=True))
        pts = metrics.curve(metric, "median")
        if pts:
            out.append(Series("median", AGGREGATE_COLOR, pts))
    for i, rank in enumerate(opts.chosen):
        pts = metrics.curve(metric, f"rank{rank}")
        if pts:
            out.append(Series(f"rank {rank}", CHOSEN_COLORS[i % len(CHOSEN_COLORS)], pts))
    if opts.rank0:
        pts = metrics.curve(metric, "rank0")
        if pts:
            out.append(Series("rank 0", RANK0, pts))
    return out


def _runs(points: list[CurvePoint]) -> Iterable[tuple[bool, list[CurvePoint]]]:
    """Consecutive points of one attempt, all redone or all not; non-finite values left out
    (plotext cannot place them)."""
    run: list[CurvePoint] = []
    key: tuple[int, bool] | None = None
    for p in points:
        if not math.isfinite(p.value):
            continue
        k = (p.attempt, p.redone)
        if key is not None and k != key:
            yield key[1], run
            # A redone run continues into the fresh one: join them where they meet.
            run = [run[-1]] if k[0] == key[0] else []
        key = k
        run.append(p)
    if run and key is not None:
        yield key[1], run


class MetricChart(PlotextPlot):
    """One metric's chart (see the module docstring)."""

    DEFAULT_CSS = """
    MetricChart { width: 1fr; height: 1fr; min-height: 6; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.metric = ""
        self._series: list[Series] = []
        self._opts = ChartOptions()
        self._restarts: list[int] = []  # server ms of each restart
        self._key: object = None  # what the data was drawn from
        self.redone = False
        self.restarted = False
        self._built: tuple[object, Text] | None = None  # (key and size, the text)
        self._building: object = None  # the cache key of the build under way

    def show(self, metrics: JobMetrics, metric: str, opts: ChartOptions, version: int) -> None:
        """Draw ``metric`` from ``metrics`` as ``opts`` says (only if anything changed)."""
        key = (metric, opts, version)
        if key == self._key:
            return
        self._key = key
        self.metric = metric
        self._opts = opts
        self._series = chart_series(metrics, metric, opts)
        self._restarts = [m.ms for m in metrics.markers]
        #: Some point drawn is redone; some restart is drawn (the legend says what they are).
        self.redone = any(p.redone for s in self._series for p in s.points)
        self.restarted = bool(self._restarts) or any(
            s.points[0].attempt != s.points[-1].attempt for s in self._series)
        self.refresh()

    @property
    def labels(self) -> list[tuple[str, RGB]]:
        """The curves drawn now (the legend): label and colour."""
        seen: dict[str, RGB] = {}
        for s in self._series:
            seen.setdefault("min-max" if s.band else s.label, s.color)
        return list(seen.items())

    @property
    def has_points(self) -> bool:
        return bool(self._series)

    @property
    def ready(self) -> bool:
        """Whether what is shown is drawn from the current data at the current size."""
        return self._built is not None and self._built[0] == self._cache_key()

    def _cache_key(self) -> object:
        return (self._key, self.size.width, self.size.height, self.app.theme)

    def render(self) -> RenderResult:
        cache = self._cache_key()
        if self._built is not None and self._built[0] == cache:
            return self._built[1]
        if self._building != cache:
            # Drawn in a thread: plotext takes tens of milliseconds a chart, which the
            # event loop would otherwise spend away from the keys.
            self._building = cache
            job = partial(build_chart, self._series, self._opts, list(self._restarts),
                          self.size.width, self.size.height,
                          self._get_plotext_theme_name(self.app.theme))
            self.run_worker(partial(self._build_in_thread, cache, job), thread=True,
                            group=f"chart-{id(self)}", exit_on_error=False)
        return self._built[1] if self._built is not None else Text("drawing…", style="dim")

    def _build_in_thread(self, cache: object, job: Any) -> None:
        try:
            text = job()
        except Exception as exc:  # a chart that cannot be drawn says so; the app goes on
            text = Text(f"this chart cannot be drawn: {type(exc).__name__}", style="red")
        with contextlib.suppress(RuntimeError):  # the app closed meanwhile
            self.app.call_from_thread(self._drawn, cache, text)

    def _drawn(self, cache: object, text: Text) -> None:
        if self._building == cache:
            self._building = None
        self._built = (cache, text)
        if cache == self._cache_key():
            self.refresh()


def _thin(run: list[CurvePoint], bins: int) -> list[CurvePoint]:
    """At most two points a bin (its lowest and highest, in order) when ``run`` has more
    points than the chart can tell apart: a spike stays, the cost follows the width."""
    if len(run) <= 2 * bins:
        return run
    out: list[CurvePoint] = []
    size = len(run) / bins
    for b in range(bins):
        part = run[int(b * size):int((b + 1) * size)]
        if not part:
            continue
        lo = min(part, key=lambda p: p.value)
        hi = max(part, key=lambda p: p.value)
        out += [lo, hi] if part.index(lo) <= part.index(hi) else [hi, lo]
        if lo is hi:
            out.pop()
    return out


def build_chart(series: list[Series], opts: ChartOptions, restarts: list[int], width: int,
                height: int, theme: str) -> Text:
    """One chart as text (a fresh plot each time: it runs in a thread)."""
    plt = Plot()
    plt.theme(theme)
    plt.plotsize(width, height)
    plt._set_size(width, height)  # as textual-plotext's own render (its issue #5)
    if not series:
        return Text("no points of this metric yet", style="dim", end="")
    by_time = opts.by_time
    t0 = min(p.ms for s in series for p in s.points)

    def x_of(p: CurvePoint) -> float:
        return (p.ms - t0) / 1000 if by_time else p.step

    xs_all: list[float] = []
    bins = max(8, width)
    for s in series:
        for redone, run in _runs(s.points):
            run = _thin(run, bins)
            xs = [x_of(p) for p in run]
            ys = [p.value for p in run]
            xs_all += xs
            color = REDONE if redone and not s.band else s.color
            if len(run) == 1:
                plt.scatter(xs, ys, color=color, marker="braille")
            else:
                plt.plot(xs, ys, color=color, marker="braille")
    if not xs_all:
        return Text("no finite value of this metric yet", style="dim", end="")
    lo, hi = min(xs_all), max(xs_all)
    for x in _restart_xs(series, opts, restarts, t0, lo, hi):
        plt.vertical_line(x, color=RESTART)
    if hi > lo:
        ticks = [lo + (hi - lo) * i / (_TICKS - 1) for i in range(_TICKS)]
        if by_time:
            plt.xticks(ticks, [fmt_clock(int(t0 + t * 1000), opts.utc) for t in ticks])
        else:  # steps are whole numbers
            ticks = sorted({round(t) for t in ticks})
            plt.xticks(ticks, [str(t) for t in ticks])
    plt.xlabel("time" if by_time else "step")
    return Text.from_ansi(plt.build(), no_wrap=True, end="")


def _restart_xs(series: list[Series], opts: ChartOptions, restarts: list[int], t0: int,
                lo: float, hi: float) -> list[float]:
    """Where restarts are drawn: by step, where an attempt's points begin (on the first curve
    that shows attempts); by time, at the restart events' times."""
    xs: list[float] = []
    if opts.by_time:
        xs = [(ms - t0) / 1000 for ms in restarts]
    else:
        main = next((s for s in reversed(series) if not s.band), None)
        if main is not None:
            prev = None
            for p in main.points:
                if prev is not None and p.attempt != prev:
                    xs.append(float(p.step))
                prev = p.attempt
    return [x for x in xs if lo <= x <= hi][-MAX_RESTART_LINES:]
