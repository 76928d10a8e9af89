"""Each rank's training metrics, read from its output as it is written: no code change.

:class:`MetricsTracker` (one a node) is fed every raw chunk a worker writes, stdout and stderr,
before the log pipeline cuts it into lines (so every frame of a progress bar is seen, not only
the frames the pipeline ships). Per rank it keeps the latest step, the run's total when a bar
or a line gives one, the step rate, the latest value of each metric, the points printed since
the last :meth:`MetricsTracker.take`, and the first non-finite value of the attempt. The
parsing of a line is :mod:`.metric_lines`'.

Steps
    A line that names its step (``step 34 loss 0.25``, a bar's ``16/40``) is that step. A bar
    that counts within an epoch (Lightning's ``Epoch 1: 3/10``) is ``epoch * total + n``. A line
    without a step (Hugging Face ``Trainer``'s dicts) takes the step of the rank's bar: the
    Trainer writes its dict with ``tqdm.write``, which erases the bar (a blank frame), writes the
    line on stdout, then redraws the bar with the exact step on stderr. The two pipes are read
    apart, so either may come first: a dict that follows an erase whose redraw has not come yet
    waits for it (at most :data:`PENDING_S`); one that comes after the redraw takes the redraw's
    step. A rank that never showed a step counts its metric lines.

Bounds (a worker is untrusted): at most :data:`MAX_NAMES` metric names a rank (more are
counted in ``dropped``, never kept), :data:`MAX_POINTS` points a rank between two takes (then
every other point is dropped, evenly), :data:`TAIL` bytes of an unterminated line a stream.

Cost: a few C-speed searches (:func:`.metric_lines.might_have_metrics`) per chunk with nothing
metric-like in it (~90 us for 64 KiB of plain text here, ~700 MB/s); lines are split and
decoded only in a chunk that may hold a metric. What is read is published by
:mod:`.metrics_publish`; :attr:`MetricsTracker.on_nan` hears of a first non-finite value at
once.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .metric_lines import LineMetrics, might_have_metrics, parse_line

MAX_NAMES = 32
MAX_POINTS = 256
TAIL = 4096
#: How long a step-less metric line waits for the bar redraw that gives its step.
PENDING_S = 1.0
#: The step rate is measured over at least this many seconds.
RATE_WINDOW_S = 1.0

_ESC = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][A-Za-z0-9]")
_FRAME_SPLIT = re.compile(r"\r\n|\n|\r")


@dataclass
class Point:
    """The metrics one step printed (values of a repeated step merge, later ones win)."""

    step: int
    at: float  # monotonic time of the print
    values: dict[str, float]


@dataclass
class RankMetrics:
    """What one rank's output has said so far in this attempt."""

    rank: int
    step: int | None = None
    total: int | None = None
    rate: float | None = None  # steps a second
    values: dict[str, float] = field(default_factory=dict)
    dropped: int = 0  # metric names refused (over MAX_NAMES)
    nan: tuple[int, str] | None = None  # the first non-finite value: (step, metric)
    points: list[Point] = field(default_factory=list)
    lines: int = 0  # metric lines seen: the step of a rank that never shows one
    #: The highest step a line or a bar named in this attempt (never a count of lines): what
    #: the restart patterns' "no progress" compares across rounds (metrics_publish.py).
    high: int | None = None
    # bar state, for step-less lines (see the module docstring)
    bar_step: int | None = None
    bar_total: int | None = None
    erased_at: float | None = None  # a blank bar frame (tqdm.write's erase), not redrawn yet
    redraw_step: int | None = None  # the bar's first frame after the latest erase
    pending: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    _rate_anchor: tuple[int, float] | None = None
    _bar_rate: float | None = None

    def snapshot(self) -> dict[str, object]:
        """The latest state, as the agent publishes it (no points)."""
        out: dict[str, object] = {}
        if self.step is not None:
            out["step"] = self.step
        if self.total is not None:
            out["total"] = self.total
        rate = self.rate if self.rate is not None else self._bar_rate
        if rate is not None and math.isfinite(rate):
            out["rate"] = round(rate, 4)
        if self.values:
            out["m"] = dict(self.values)
        if self.dropped:
            out["mdrop"] = self.dropped
        return out


class MetricsTracker:
    """The metrics of one node's ranks (see the module docstring). Not thread-safe: it is fed
    from the agent's event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.ranks: dict[int, RankMetrics] = {}
        self._tails: dict[tuple[int, str], bytes] = {}
        self._attempt = -1
        #: Non-finite values seen since the last take: (rank, step, metric), first per rank.
        self.new_nans: list[tuple[int, int, str]] = []
        #: Called at once with ``(rank, step, metric, value)`` for each of those (a policy
        #: such as --on-nan stop must not wait for the next take).
        self.on_nan: Callable[[int, int, str, float], object] | None = None

    @property
    def attempt(self) -> int:
        """The attempt (rendezvous round) the ranks' state belongs to; -1 before the first."""
        return self._attempt

    def start_attempt(self, attempt: int) -> None:
        """A new attempt: its ranks start over (their steps may go back to a checkpoint's)."""
        self._attempt = attempt
        self.ranks.clear()
        self._tails.clear()
        self.new_nans.clear()

    # -- the hot path ---------------------------------------------------------------------

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        """A chunk of ``rank``'s ``stream`` as the worker wrote it."""
        key = (rank, stream)
        tail = self._tails.get(key)
        buf = tail + data if tail else data
        if not might_have_metrics(buf):
            # Nothing here, but the unterminated last line may go on in the next chunk:
            # keep its head (bounded) to search it again with what follows.
            cut = max(buf.rfind(b"\n"), buf.rfind(b"\r"))
            rest = buf[cut + 1:]
            if rest:
                self._tails[key] = rest[:TAIL]
            elif tail:
                del self._tails[key]
            return
        pieces = _FRAME_SPLIT.split(buf.decode("utf-8", "replace"))
        rest = pieces.pop()  # unterminated: a frame still being drawn, or a line's start
        if rest:
            self._tails[key] = rest[:TAIL].encode()
        elif tail:
            del self._tails[key]
        now = self._clock()
        for piece in pieces:
            self._piece(rank, piece, now)
        if rest:
            # A bar frame is whole once written (tqdm ends it with nothing): read it now;
            # it is read again, harmlessly, with what follows.
            self._piece(rank, rest, now)

    def _piece(self, rank: int, piece: str, now: float) -> None:
        if "\x1b" in piece:
            piece = _ESC.sub("", piece)
        if not piece:
            return
        r = self.ranks.get(rank)
        if r is None:
            r = self.ranks[rank] = RankMetrics(rank)
        if piece.isspace():  # a blank frame: tqdm.write erased the bar to print a line
            r.erased_at = now
            r.redraw_step = None
            return
        m = parse_line(piece)
        if m is None:
            return
        self._take_line(r, m, now)

    def _take_line(self, r: RankMetrics, m: LineMetrics, now: float) -> None:
        if m.bar:
            if m.other:
                return  # a validation or test bar counts its own batches, not steps
            if m.total and m.epoch is None and r.bar_total and m.total != r.bar_total:
                return  # another bar (an evaluation's) beside the training one
            step = m.step if m.step is not None else 0
            if m.epoch is not None and m.total:
                step += m.epoch * m.total
            if r.bar_step is not None and step < r.bar_step:
                return  # a bar reset for the next epoch, before its label changes
            if m.total and m.epoch is None:
                r.bar_total = m.total
            if m.total and m.epoch is not None and m.epochs:
                r.total = m.total * m.epochs
            elif m.total and m.epoch is None:
                r.total = m.total
            if m.rate is not None and math.isfinite(m.rate):
                r._bar_rate = m.rate
            r.bar_step = step
            if r.high is None or step > r.high:
                r.high = step
            if r.erased_at is not None and r.redraw_step is None:
                r.redraw_step = step
                self._resolve_pending(r, step)
            self._point(r, step, now, m.values)
            return
        if m.total is not None:
            r.total = m.total
        r.lines += 1
        if m.step is not None:
            if r.high is None or m.step > r.high:
                r.high = m.step
            self._point(r, m.step, now, m.values)
            return
        if not m.values:
            return
        if r.erased_at is not None and r.redraw_step is None and now - r.erased_at < PENDING_S:
            r.pending.append((now, m.values))  # the redraw that gives its step is coming
            return
        if r.redraw_step is not None:
            step = r.redraw_step
        elif r.bar_step is not None:
            step = r.bar_step
        elif r.step is not None:
            step = r.step
        else:
            step = r.lines
        self._point(r, step, now, m.values)

    def _resolve_pending(self, r: RankMetrics, step: int) -> None:
        for at, values in r.pending:
            self._point(r, step, at, values)
        r.pending.clear()

    def _point(self, r: RankMetrics, step: int, now: float, values: dict[str, float]) -> None:
        self._rate(r, step, now)
        if r.step is None or step >= r.step:
            r.step = step
        if not values:
            return
        kept: dict[str, float] = {}
        for name, value in values.items():
            if name not in r.values and len(r.values) >= MAX_NAMES:
                r.dropped += 1
                continue
            r.values[name] = value
            kept[name] = value
            if r.nan is None and not math.isfinite(value):
                r.nan = (step, name)
                self.new_nans.append((r.rank, step, name))
                if self.on_nan is not None:
                    self.on_nan(r.rank, step, name, value)
        if not kept:
            return
        pts = r.points
        if pts and pts[-1].step == step:
            pts[-1].values.update(kept)
            pts[-1].at = now
            return
        pts.append(Point(step, now, kept))
        if len(pts) > MAX_POINTS:
            del pts[1::2]  # halve evenly, keeping the first and the newest

    def _rate(self, r: RankMetrics, step: int, now: float) -> None:
        anchor = r._rate_anchor
        if anchor is None or step < anchor[0]:
            r._rate_anchor = (step, now)
            return
        elapsed = now - anchor[1]
        if elapsed >= RATE_WINDOW_S and step > anchor[0]:
            rate = (step - anchor[0]) / elapsed
            # A smoothed rate: half the last window, half the one before.
            r.rate = rate if r.rate is None else 0.5 * (r.rate + rate)
            r._rate_anchor = (step, now)

    # -- publishing -----------------------------------------------------------------------

    def flush_pending(self) -> None:
        """Step-less lines whose bar redraw never came take the last known step."""
        now = self._clock()
        for r in self.ranks.values():
            if r.pending and (r.erased_at is None or now - r.erased_at >= PENDING_S):
                step = r.bar_step if r.bar_step is not None else (r.step or r.lines)
                self._resolve_pending(r, step)
                r.erased_at = None

    def take(self) -> dict[int, tuple[dict[str, object], list[Point]]]:
        """Each rank's latest state and the points printed since the last take."""
        self.flush_pending()
        self.new_nans = []
        out: dict[int, tuple[dict[str, object], list[Point]]] = {}
        for rank, r in self.ranks.items():
            out[rank] = (r.snapshot(), r.points)
            r.points = []
        return out
