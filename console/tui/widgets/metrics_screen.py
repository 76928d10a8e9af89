"""The metrics view (key ``m``): the job's training curves, one chart per metric.

Drawn from the app's :class:`~elastic_console.job.state.JobView` (its ``metrics``, fed by the
reader: the metrics stream, the resource samples, the history hash), so it costs no read of its
own but the one that fills in a chosen rank's past (:meth:`JobMetrics.backfill`).

Keys: ``n``/``p`` the next or previous metric (the first chart's; loss-like ones come first),
``t`` by step or by time, ``0`` rank 0's curve, ``a`` the median with the min-max band, ``c``
a rank's curve (a number: shown, or hidden if it was; at most four), ``x`` no chosen ranks,
``esc``/``q``/``m`` back. As many charts as the height holds (one at 24 rows, two at 40, three
at 60), each the next metric. Redrawn at most once a second, and only when the metrics or the
choices changed (plotext draws in Python).

Metric names come from the workers' output: restricted to ``[A-Za-z0-9_./-]`` by the wire's
decoder, and drawn as ``Text`` all the same (never markup).
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.style import Style
from rich.text import Text
from textual import events, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from elastic_console.job.metrics import MAX_CHOSEN, JobMetrics

from .common import safe_text
from .footer import KeyFooter
from .metric_chart import REDONE, RESTART, ChartOptions, MetricChart
from .prompt import LinePrompt

__all__ = ["MetricsScreen", "RankPrompt"]

#: Charts at most, and the rows one needs (with its title line) before another is added.
MAX_CHARTS = 4
ROWS_PER_CHART = 16
REFRESH_S = 1.0
_DIM = Style(dim=True)
_BOLD = Style(bold=True)
_KEY = Style(bold=True, color="cyan")


def _rgb(color: tuple[int, int, int]) -> Style:
    return Style(color=f"rgb({color[0]},{color[1]},{color[2]})", bold=True)


class RankPrompt(LinePrompt):
    """Ask for a rank whose curves to show or hide."""

    DEFAULT_CSS = "RankPrompt > #rank-prompt { width: 50; }"
    BOX_ID = "rank-prompt"
    INPUT_ID = "rank-input"
    TITLE = "A rank's curves"
    PLACEHOLDER = "rank"
    HINT = "enter: show (or hide) its curves · esc: cancel"
    MAX_LENGTH = 8
    RESTRICT = r"[0-9]*"


class MetricsScreen(ModalScreen[None]):
    """See the module docstring. Modal (the job screen's keys do not reach through it) and
    opaque (a translucent screen re-blends everything beneath on each refresh)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,m", "close", "Back", id="metrics.close"),
        Binding("question_mark", "app.help", "Help", show=False, id="metrics.help"),
        Binding("n", "metric(1)", "Next metric", id="metrics.next"),
        Binding("p", "metric(-1)", "Previous", id="metrics.previous"),
        Binding("t", "toggle_time", "Step/time", id="metrics.time"),
        Binding("0", "toggle_rank0", "Rank 0", id="metrics.rank0"),
        Binding("a", "toggle_aggregate", "Median", id="metrics.aggregate"),
        Binding("c", "choose", "Rank…", id="metrics.choose"),
        Binding("x", "clear", "No ranks", show=False, id="metrics.clear"),
    ]

    DEFAULT_CSS = """
    MetricsScreen { layout: vertical; background: $surface; }
    MetricsScreen #metrics-head { height: 1; background: $panel; }
    MetricsScreen #metrics-empty { height: auto; padding: 1 2; }
    MetricsScreen .chart-title { height: 1; }
    MetricsScreen .chart-box { height: 1fr; }
    MetricsScreen #metrics-note { height: 1; color: $text-muted; }
    """

    def __init__(self, *, utc: bool = False, cursor_blink: bool = True) -> None:
        super().__init__()
        self.utc = utc
        self.cursor_blink = cursor_blink
        self.first = 0  # the first chart's metric, an index into curve_metrics()
        self.by_time = False
        self.rank0 = True
        self.aggregate = True
        self._drawn: object = None
        self._charts = 1

    @property
    def metrics(self) -> JobMetrics:
        return self.app.view.metrics  # type: ignore[attr-defined, no-any-return]

    def compose(self) -> ComposeResult:
        yield Static("", markup=False, id="metrics-head")
        yield Static("", markup=False, id="metrics-empty")
        for i in range(MAX_CHARTS):
            with Vertical(classes="chart-box", id=f"chart-box-{i}"):
                yield Static("", markup=False, classes="chart-title", id=f"chart-title-{i}")
                yield MetricChart(id=f"chart-{i}")
        yield Static("", markup=False, id="metrics-note")
        yield KeyFooter()

    def on_mount(self) -> None:
        self._fit(self.app.size.height)
        self.set_interval(REFRESH_S, self.draw)
        self.draw()

    def on_resize(self, event: events.Resize) -> None:
        self._fit(event.size.height)
        self.draw()

    def _fit(self, height: int) -> None:
        self._charts = max(1, min(MAX_CHARTS, (height - 3) // ROWS_PER_CHART))

    # -- drawing ----------------------------------------------------------------------------------
    def options(self) -> ChartOptions:
        return ChartOptions(self.by_time, self.rank0, self.aggregate,
                            tuple(self.metrics.chosen), self.utc)

    def shown_metrics(self) -> list[str]:
        """The metrics the charts show now, top to bottom."""
        names = self.metrics.curve_metrics()
        if not names:
            return []
        self.first %= len(names)
        return [names[(self.first + i) % len(names)]
                for i in range(min(self._charts, len(names)))]

    def draw(self) -> None:
        """Bring the charts up to date (only what changed is drawn again)."""
        metrics = self.metrics
        app: Any = self.app
        metrics.settle(app.now_ms())  # steps no point came for lately: on the aggregate now
        shown = self.shown_metrics()
        opts = self.options()
        key = (metrics.version, tuple(shown), opts, self._charts)
        if key == self._drawn:
            return
        self._drawn = key
        self._head(shown)
        empty = self.query_one("#metrics-empty", Static)
        empty.display = not shown
        if not shown:
            empty.update(Text(
                "No training metrics yet. The agents read the step, the loss and other numbers "
                "from what the workers print: progress bars (tqdm, Rich), Hugging Face's dicts, "
                "'step 12 loss 0.25', key=value pairs, or one JSON line "
                '{"elastic_metrics": {...}} (docs/CONSOLE.md).', end=""))
        for i in range(MAX_CHARTS):
            box = self.query_one(f"#chart-box-{i}", Vertical)
            box.display = i < len(shown)
            if i < len(shown):
                chart = self.query_one(f"#chart-{i}", MetricChart)
                chart.show(metrics, shown[i], opts, metrics.version)
                self.query_one(f"#chart-title-{i}", Static).update(self._title(chart))
        self._note()

    def _head(self, shown: list[str]) -> None:
        names = self.metrics.curve_metrics()
        t = Text(no_wrap=True, overflow="ellipsis", end="")
        t.append(" Metrics ", _BOLD)
        if names:
            t.append(f" {self.first % len(names) + 1}/{len(names)} ", _DIM)
            for i, name in enumerate(names):
                if i:
                    t.append(" ")
                t.append_text(safe_text(name, _BOLD if name in shown else _DIM))
        t.append("   by ", _DIM)
        t.append("time" if self.by_time else "step", _BOLD)
        self.query_one("#metrics-head", Static).update(t)

    def _title(self, chart: MetricChart) -> Text:
        t = Text(no_wrap=True, overflow="ellipsis", end="")
        t.append(" ")
        t.append_text(safe_text(chart.metric, _BOLD))
        if not chart.has_points:
            t.append("  (no points yet for the curves chosen)", _DIM)
            return t
        for label, color in chart.labels:
            t.append("  ━ ", _rgb(color))
            t.append(label)
        if chart.redone:
            t.append("  ━ ", _rgb(REDONE))
            t.append("redone")
        if chart.restarted:
            t.append("  │ ", _rgb(RESTART))
            t.append("restart")
        return t

    def _note(self) -> None:
        m = self.metrics
        parts = []
        if m.chosen:
            parts.append("ranks " + ", ".join(map(str, m.chosen)) + " (c: another, x: none)")
        if m.names_dropped:
            parts.append(f"{m.names_dropped:,} metric names beyond {len(m.names)} left out")
        if m.late:
            parts.append(f"{m.late:,} late points left out")
        if m.history_bad:
            parts.append(f"{m.history_bad} unreadable history series")
        note = self.query_one("#metrics-note", Static)
        note.display = bool(parts)
        note.update(safe_text("  " + " · ".join(parts)))

    # -- keys ---------------------------------------------------------------------------------
    def action_close(self) -> None:
        self.dismiss(None)

    def action_metric(self, delta: int) -> None:
        names = self.metrics.curve_metrics()
        if names:
            self.first = (self.first + delta) % len(names)
        self.draw()

    def action_toggle_time(self) -> None:
        self.by_time = not self.by_time
        self.draw()

    def action_toggle_rank0(self) -> None:
        self.rank0 = not self.rank0
        self.draw()

    def action_toggle_aggregate(self) -> None:
        self.aggregate = not self.aggregate
        self.draw()

    def action_clear(self) -> None:
        for rank in list(self.metrics.chosen):
            self.metrics.unchoose(rank)
        self.draw()

    def action_choose(self) -> None:
        app: Any = self.app
        selected = getattr(app, "selected_rank", None)
        text = str(selected) if selected else ""
        self.app.push_screen(RankPrompt(text, cursor_blink=self.cursor_blink), self._chosen)

    def _chosen(self, text: str | None) -> None:
        if not text:
            return
        rank = int(text)
        world = self.app.view.world_size  # type: ignore[attr-defined]
        if world is not None and rank >= world:
            self.app.notify(f"rank {rank} is not in the job (world size {world})",
                            severity="warning", markup=False)
            return
        m = self.metrics
        if rank == 0:
            self.rank0 = True
        elif rank in m.chosen:
            m.unchoose(rank)
        else:
            if len(m.chosen) >= MAX_CHOSEN:
                self.app.notify(f"at most {MAX_CHOSEN} ranks: rank {m.chosen[0]} makes room",
                                markup=False)
            m.choose(rank)
            self._backfill(rank)
        scope = getattr(self.app, "_metrics_scope", None)
        if scope is not None:
            scope()  # a big job's reader decodes the chosen ranks' nodes' entries too
        self.draw()

    @work(group="metrics-backfill", exit_on_error=False)
    async def _backfill(self, rank: int) -> None:
        """The chosen rank's points the stream still keeps, before it was chosen."""
        client = getattr(self.app, "client", None)
        if client is None:
            return
        try:
            entries = await client.metrics_recent(follow=False)
        except Exception:  # a Redis problem: the reader reports it; the curve starts now
            return
        self.metrics.backfill(rank, entries)
        self.draw()
