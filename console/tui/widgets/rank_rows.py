"""The rank table's rows as data: the columns and which fit a width, the sort keys, the cell
texts of a rank or a node, and a row's Segments. No Textual (Rich only).

A row is a tuple of plain strings (:func:`row_values`, :func:`node_values`), compared with
what was drawn and turned into a handful of Segments only when drawn (:func:`row_segments`);
the order comes from the JobView's facts (:data:`SORT_KEYS`, :data:`STATE_ORDER`), never from
cell text. :func:`fit_columns` drops columns in :data:`DROP_ORDER` (by node:
:data:`NODE_DROP_ORDER`) until a row fits. The widget that holds the order, the cursor and the
scrolling is :class:`~.rank_table.RankTable`.

Training columns (:data:`TRAINING_COLUMNS`: STEP, STEPS/S) follow the others once any rank
printed a step (:data:`STEP_COLUMNS`, by node :data:`NODE_STEP_COLUMNS`); their cells come from
the rank's latest state in ``JobView.metrics`` (:func:`step_values`), and a row's value after
its cells (:data:`SLOWEST`) makes its STEP stand out. An exited rank's QUIET stops at its exit.

Untrusted text: every cell is sanitized in :func:`row_segments` (never markup); a cell that
still has SGR colours is drawn by the widget's ``render_ansi``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style

from elastic_agent.coordination.wire.text import sanitize
from elastic_console.job.metrics import RankLatest
from elastic_console.job.model import RankState

from .common import RANK_STATE_STYLES, fmt_age, fmt_bytes

__all__ = [
    "ALL_COLUMNS",
    "COLUMNS",
    "COLUMN_KEYS",
    "DROP_ORDER",
    "METRIC_SORT_KEYS",
    "NODE_COLUMNS",
    "NODE_DROP_ORDER",
    "NODE_STEP_COLUMNS",
    "PAD",
    "ROW_WIDTH",
    "SLOWEST",
    "SORT_KEYS",
    "STATE_ORDER",
    "STEP_COLUMNS",
    "TRAINING_COLUMNS",
    "fit_columns",
    "fmt_rate",
    "fmt_step",
    "header_segments",
    "node_key",
    "node_step_values",
    "node_values",
    "row_segments",
    "row_values",
    "row_width",
    "step_values",
    "worst_first",
]

#: (key, header, width, right-aligned)
COLUMNS: tuple[tuple[str, str, int, bool], ...] = (
    ("rank", "RANK", 4, True),
    ("host", "HOST", 10, False),
    ("local", "LOCAL", 5, True),
    ("pid", "PID", 7, True),
    ("state", "STATE", 10, False),
    ("restarts", "RESTARTS", 8, True),
    ("exit", "EXIT", 7, True),
    ("cpu", "CPU%", 4, True),
    ("rss", "RSS", 9, True),
    ("line", "QUIET", 6, True),  # seconds since the rank's last log line
)
#: The training columns, after the others once any rank has a step (``JobMetrics.any_step``):
#: its latest step (the slowest rank's stands out) and steps a second.
TRAINING_COLUMNS: tuple[tuple[str, str, int, bool], ...] = (
    ("step", "STEP", 7, True),
    ("rate", "STEPS/S", 7, True),
)
STEP_COLUMNS = COLUMNS + TRAINING_COLUMNS
#: The columns' keys, left to right (the training ones last).
COLUMN_KEYS = tuple(c[0] for c in STEP_COLUMNS)
#: The node view's columns (see the module docstring), same shape as :data:`COLUMNS`.
NODE_COLUMNS: tuple[tuple[str, str, int, bool], ...] = (
    ("host", "HOST", 10, False),
    ("ranks", "RANKS", 11, True),
    ("state", "STATE", 10, False),  # its worst rank's
    ("states", "STATES", 20, False),  # how many of its ranks in each state, worst first
    ("restarts", "RESTARTS", 8, True),  # the most of any of its ranks
    ("exit", "EXIT", 7, True),  # its worst rank's last exit
    ("cpu", "CPU%", 4, True),  # mean over its ranks with a sample
    ("rss", "RSS", 9, True),  # all its ranks together
    ("line", "QUIET", 6, True),  # its quietest rank's
)
NODE_DROP_ORDER = ("restarts", "rss", "cpu", "exit", "ranks")
#: By node with steps: the node's slowest rank's step and its lowest rate.
NODE_STEP_COLUMNS = NODE_COLUMNS + TRAINING_COLUMNS
#: Cells of padding on each side of a column's text.
PAD = 1
#: The columns given up, first to last, when the row is wider than the table (see the module
#: docstring): the ones that are not in this list are always shown.
DROP_ORDER = ("local", "pid", "rss", "cpu", "host")
ALL_COLUMNS = tuple(range(len(COLUMNS)))


def row_width(columns: tuple[int, ...], spec: tuple[tuple[str, str, int, bool], ...] = COLUMNS
              ) -> int:
    """Cells of a row made of ``columns`` (indices into ``spec``, :data:`COLUMNS` or
    :data:`NODE_COLUMNS`)."""
    return sum(spec[i][2] + 2 * PAD for i in columns)


def fit_columns(width: int, spec: tuple[tuple[str, str, int, bool], ...] = COLUMNS,
                drop: tuple[str, ...] = DROP_ORDER) -> tuple[int, ...]:
    """The columns shown in ``width`` cells (indices into ``spec``, in display order): every
    column, less the first ones of ``drop`` as long as the row is too wide."""
    keys = [c[0] for c in spec]
    shown = list(range(len(spec)))
    for key in drop:
        if row_width(tuple(shown), spec) <= width:
            break
        shown.remove(keys.index(key))
    return tuple(shown)


ROW_WIDTH = row_width(ALL_COLUMNS)
#: The value after a row's cells that marks the slowest rank (its STEP stands out).
SLOWEST = "slowest"
STATE_ORDER = {"failed": 0, "stalled": 1, "slow": 2, "restarting": 2, "waiting": 3,
                "stopped": 4, "running": 5, "exited": 6}
_EXIT_BAD = Style(color="red")
_SLOWEST = Style(color="yellow", bold=True, reverse=True)
_DIM = Style(dim=True)
_NO_STYLE = Style()


def _exit_sort(r: RankState) -> tuple[int, str]:
    e = r.last_exit
    if e is None:
        return (0, "")
    if isinstance(e, int):
        return (1 if e == 0 else 2, f"{abs(e):08d}")
    return (3, str(e))


#: Sort keys from the JobView's facts (never from cell text); ties broken by rank.
SORT_KEYS: dict[str, Callable[[RankState], Any]] = {
    "rank": lambda r: r.rank,
    "host": lambda r: (r.host, r.local_rank if r.local_rank is not None else -1, r.rank),
    "local": lambda r: (r.local_rank if r.local_rank is not None else -1, r.rank),
    "pid": lambda r: (r.pid or 0, r.rank),
    "state": lambda r: (STATE_ORDER.get(r.state, 9), r.rank),
    "restarts": lambda r: (r.restarts, r.rank),
    "exit": lambda r: (_exit_sort(r), r.rank),
    "cpu": lambda r: (r.cpu if r.cpu is not None else -1.0, r.rank),
    "rss": lambda r: (r.rss if r.rss is not None else -1, r.rank),
    "line": lambda r: (r.last_line_ms, r.rank),
}


#: Sort keys of the training columns, from a rank's latest state (None: it has none yet).
METRIC_SORT_KEYS: dict[str, Callable[[RankLatest | None, int], Any]] = {
    "step": lambda m, rank: (m.step if m is not None and m.step is not None else -1, rank),
    "rate": lambda m, rank: (m.rate if m is not None and m.rate is not None else -1.0, rank),
}


def fmt_step(step: int | None) -> str:
    """A step in at most 7 cells: ``1234567``, then ``12.3M``, ``4.5G``."""
    if step is None:
        return "-"
    if step < 10_000_000:
        return str(step)
    for unit, size in (("G", 1e9), ("M", 1e6)):
        if step >= size:
            return f"{step / size:.1f}{unit}" if step < 100 * size else f"{step / size:.0f}{unit}"
    return str(step)  # pragma: no cover - the loop always returns


def fmt_rate(rate: float | None) -> str:
    """Steps a second in at most 7 cells."""
    if rate is None:
        return "-"
    if rate < 10:
        return f"{rate:.2f}"
    if rate < 1000:
        return f"{rate:.1f}"
    return f"{rate:.0f}" if rate < 10_000_000 else "many"


def step_values(latest: RankLatest | None, slowest: bool) -> tuple[str, str, str]:
    """The training cells of a rank (STEP, STEPS/S) and the mark of the slowest rank."""
    if latest is None:
        return ("-", "-", "")
    return (fmt_step(latest.step), fmt_rate(latest.rate), SLOWEST if slowest else "")


def node_step_values(latests: list[RankLatest], slowest: bool) -> tuple[str, str, str]:
    """A node's training cells: its slowest rank's step, its lowest rate."""
    steps = [m.step for m in latests if m.step is not None]
    rates = [m.rate for m in latests if m.rate is not None]
    return (fmt_step(min(steps)) if steps else "-", fmt_rate(min(rates)) if rates else "-",
            SLOWEST if slowest else "")


def row_values(r: RankState, now_ms: int) -> tuple[str, ...]:
    """The plain text of each cell of rank ``r`` (what is compared and drawn)."""
    # An exited rank's QUIET stops at its exit: it is not silent, it is done.
    end = r.ended_ms or now_ms
    since = fmt_age(max(0, end - r.last_line_ms) / 1000) if r.last_line_ms and end else "-"
    return (
        str(r.rank),
        r.host or "-",
        "-" if r.local_rank is None else str(r.local_rank),
        "-" if r.pid is None else str(r.pid),
        r.state,
        str(r.restarts),
        "-" if r.last_exit is None else str(r.last_exit),
        "-" if r.cpu is None else f"{r.cpu:.0f}",
        fmt_bytes(r.rss),
        since,
    )


def worst_first(r: RankState) -> tuple[int, int]:
    """The order of a node's ranks, worst first: by state, then by rank."""
    return (STATE_ORDER.get(r.state, 9), r.rank)


def node_key(r: RankState) -> str:
    """The node a rank's row is grouped under: its agent's id (its host before it has one)."""
    return r.node or r.host or "?"


def _span(ranks: list[int]) -> str:
    """``ranks`` (sorted) as ``first-last`` when they are consecutive, else a count."""
    if len(ranks) == 1:
        return str(ranks[0])
    if ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return f"{len(ranks)} ranks"


def node_values(states: list[RankState], now_ms: int) -> tuple[str, ...]:
    """The plain text of each cell of the node whose ranks are ``states`` (sorted by rank, at
    least one), for :data:`NODE_COLUMNS`."""
    worst = min(states, key=worst_first)
    counts: dict[str, int] = {}
    for r in sorted(states, key=worst_first):
        counts[r.state] = counts.get(r.state, 0) + 1
    cpus = [r.cpu for r in states if r.cpu is not None]
    rss = [r.rss for r in states if r.rss is not None]
    lines = [r.last_line_ms for r in states]
    # Its quietest rank's, each counted up to its exit (QUIET stops there).
    quiet = ("-" if not all(lines) or not now_ms
             else fmt_age(max(max(0, (r.ended_ms or now_ms) - r.last_line_ms)
                              for r in states) / 1000))
    return (
        worst.host or "-",
        _span([r.rank for r in states]),
        worst.state,
        ", ".join(f"{n} {state}" for state, n in counts.items()),
        str(max(r.restarts for r in states)),
        "-" if worst.last_exit is None else str(worst.last_exit),
        f"{sum(cpus) / len(cpus):.0f}" if cpus else "-",
        fmt_bytes(sum(rss)) if rss else "-",
        quiet,
    )


def _cell_style(key: str, value: str) -> Style:
    if key == "state":
        return RANK_STATE_STYLES.get(value, _NO_STYLE)
    if key == "exit" and value not in ("-", "0"):
        return _EXIT_BAD
    if value == "-":
        return _DIM
    return _NO_STYLE


def _fit(text: str, width: int, right: bool) -> str:
    """``text`` in exactly ``width`` cells: cut with an ellipsis, padded on the left when
    ``right``."""
    cells = cell_len(text)
    if cells > width:
        return set_cell_size(text, width - 1) + "…"
    pad = " " * (width - cells)
    return pad + text if right else text + pad


def row_segments(values: tuple[str, ...], base: Style, render_ansi: Callable[..., list[Segment]],
                 columns: tuple[int, ...] = ALL_COLUMNS,
                 spec: tuple[tuple[str, str, int, bool], ...] = COLUMNS) -> list[Segment]:
    """One row of ``columns`` of ``spec`` (``row_width(columns, spec)`` cells): padding in
    ``base``, each text in ``base`` plus its column's colour. ``render_ansi(text, style,
    width)`` draws a cell whose (sanitized) text still carries SGR colours."""
    pad = Segment(" " * PAD, base)
    out: list[Segment] = []
    for i in columns:
        key, _, width, right = spec[i]
        value = values[i]
        text = sanitize(value)
        style = base + _cell_style(key, value)
        if key == "step" and len(values) > len(spec) and values[len(spec)] == SLOWEST:
            style += _SLOWEST
        out.append(pad)
        if "\x1b" in text:  # only SGR is left after sanitize
            out.extend(render_ansi(text, style, width, right))
        else:
            out.append(Segment(_fit(text, width, right), style))
        out.append(pad)
    return out


def header_segments(style: Style, sorted_by: str, reverse: bool,
                    columns: tuple[int, ...] = ALL_COLUMNS,
                    spec: tuple[tuple[str, str, int, bool], ...] = COLUMNS) -> list[Segment]:
    """The header row of ``columns``: each label aligned like its column, the sort column
    marked in its right padding cell (a wider label would be cut)."""
    pad = " " * PAD
    mark = pad[:-1] + ("▼" if reverse else "▲")
    return [Segment(pad + _fit(label, width, right) + (mark if key == sorted_by else pad), style)
            for key, label, width, right in (spec[i] for i in columns)]
