"""The job header (two lines of facts) and the banner: red while Redis is unreachable, calm
when a job's embedded Redis stops with it."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.color import Color
from textual.widgets import Static

from elastic_console.job.formatting import fmt_age
from elastic_console.job.state import JobView

from .common import JOB_STATE_STYLES, safe_text

__all__ = ["ALERT", "ENDED_OK", "ENDED_OTHERWISE", "Banner", "JobHeader"]

#: Banner tones: something is wrong; the job ended well; the job ended otherwise.
ALERT, ENDED_OK, ENDED_OTHERWISE = "alert", "ended-ok", "ended-otherwise"
# Theme variables (the stylesheet's $error is the alert's) and the glyph of each tone.
_TONE_VARIABLE = {ENDED_OK: "success", ENDED_OTHERWISE: "primary"}
_TONE_GLYPH = {ALERT: " ⚠ ", ENDED_OK: " ✓ ", ENDED_OTHERWISE: " ● "}

_LABEL = Style(dim=True)
_VALUE = Style(bold=True)
_CONNECTED = Style(color="green")
_DISCONNECTED = Style(color="red", bold=True)
_READ_ONLY = Style(color="yellow")


def _q(value: object) -> str:
    return "?" if value is None else str(value)


class JobHeader(Static):
    """``job-42  RUNNING  round 3  nodes 2 (1..4)  world 16  restarts 1/3`` and, below, the
    Redis endpoint (password redacted), connected or not, and whether commands are allowed.

    Rebuilt only when the facts it shows changed (:meth:`show` compares the plain text).
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", markup=False, id=id)
        self._shown: str | None = None

    def show(self, view: JobView, endpoint: str, *, loaded: bool, read_only: str) -> None:
        """Render the header from ``view``. ``loaded``: the history was read (before that the
        connection state is not known yet). ``read_only``: why commands are off, or ``""``."""
        t = Text(no_wrap=True, overflow="ellipsis", end="")
        t.append(" job ", _LABEL)
        t.append_text(safe_text(view.job_id, _VALUE))
        t.append("  ")
        state = view.state
        t.append(f" {state.upper()} ", JOB_STATE_STYLES.get(state, _VALUE))
        t.append("   round ", _LABEL)
        t.append(_q(view.round), _VALUE)
        active = view.active_node_count()
        t.append("   nodes ", _LABEL)
        t.append(str(active), _VALUE)
        t.append(f" ({_q(view.min_nodes)}..{_q(view.max_nodes)})", _LABEL)
        t.append("   world ", _LABEL)
        t.append(_q(view.world_size), _VALUE)
        t.append("   restarts ", _LABEL)
        t.append(f"{view.restarts_used}/{_q(view.max_restarts)}", _VALUE)
        if view.expires_in_ms is not None and (view.is_final or view.state == "lost"):
            t.append(f"   expires in {fmt_age(view.expires_in_ms / 1000)}", _LABEL)
        if view.lines_dropped:
            t.append(f"   {view.lines_dropped} log lines dropped", Style(color="yellow"))
        if view.skipped:
            # Records nobody could read: a broken or hostile writer is never silent.
            t.append(f"   {view.skipped} unreadable record{'' if view.skipped == 1 else 's'} "
                     "skipped", Style(color="yellow"))
        t.append("\n")
        self._progress(t, view)
        t.append(" redis ", _LABEL)
        t.append_text(safe_text(endpoint))
        if not loaded:
            t.append("  ○ connecting…", _LABEL)
        elif view.connected:
            t.append("  ● connected", _CONNECTED)
        elif view.redis_gone:
            t.append("  ○ stopped with the job", _LABEL)
        else:
            t.append("  ● disconnected", _DISCONNECTED)
        if read_only:
            t.append("   read-only", _READ_ONLY)
        if t.plain != self._shown:  # styles follow from the plain text: compare that
            self._shown = t.plain
            self.update(t, layout=False)  # fixed height: a relayout would cost every widget


    @staticmethod
    def _progress(t: Text, view: JobView) -> None:
        """``step 120/500 24%  ETA 2m30s (slowest rank 3)  m metrics``, once any rank has a
        step: the progress of the slowest rank that knows the run's total (of the one rank
        that does, often rank 0: the header says which), and its ETA at its step rate."""
        metrics = view.metrics
        if not metrics.any_step:
            return
        summary = metrics.summary()
        p = summary.progress
        if p is not None:
            t.append(" step ", _LABEL)
            t.append(f"{p.step}/{p.total}", _VALUE)
            t.append(f" {min(100, 100 * p.step // max(1, p.total))}%", _LABEL)
            if p.eta_s is not None and p.step < p.total:
                t.append("  ETA ", _LABEL)
                t.append(fmt_age(p.eta_s), _VALUE)
            t.append(f" ({p.basis} {p.rank})", _LABEL)
        elif summary.low is not None:
            t.append(" step ", _LABEL)
            t.append(str(summary.low), _VALUE)
            if summary.slowest is not None:
                t.append(f" (slowest rank {summary.slowest})", _LABEL)
        t.append("  m", _VALUE)
        t.append(" metrics  ", _LABEL)


class Banner(Static):
    """A bar across the screen: red while Redis is unreachable (``ALERT``), green or blue once
    the job ended and its embedded Redis stops with it; hidden otherwise."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", markup=False, id=id)
        self._shown: tuple[str | None, str] | None = None
        self.display = False

    def show(self, message: str | None, tone: str = ALERT) -> None:
        """Show ``message`` (one sentence) in ``tone``, or hide the bar with ``None``."""
        if (message, tone) == self._shown:
            return
        self._shown = (message, tone)
        if message is None:
            self.display = False
            return
        variable = _TONE_VARIABLE.get(tone)
        # Inline, because the app's stylesheet (#banner: $error) outranks any widget default.
        self.styles.background = (
            Color.parse(self.app.get_css_variables().get(variable, "green" if tone == ENDED_OK
                                                          else "blue"))
            if variable else None)
        t = Text(no_wrap=True, overflow="ellipsis", end="")
        t.append(_TONE_GLYPH.get(tone, " ⚠ "))
        t.append_text(safe_text(message))
        self.update(t, layout=False)
        self.display = True
