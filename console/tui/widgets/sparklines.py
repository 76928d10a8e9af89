"""CPU and RSS of the selected rank over the last two minutes (one sample a second).

``Sparkline.data`` is reassigned (a new list) whenever the samples changed: Textual does not
see an in-place mutation of the list it holds.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from elastic_console.job.model import RankState

from .common import fmt_bytes

__all__ = ["ResourcePanel"]

_LABEL = Style(dim=True)


class ResourcePanel(Vertical):
    """Two labelled sparklines for one rank (or a hint when no rank is selected)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._key: tuple[object, ...] | None = None
        # Held, not queried: the app's refresh timer may still fire while the screen is
        # being torn down, when the children are already gone (query_one would raise).
        self._cpu_label = Static("", markup=False, id="cpu-label", classes="spark-label")
        self._cpu_spark = Sparkline([], id="cpu-spark")
        self._rss_label = Static("", markup=False, id="rss-label", classes="spark-label")
        self._rss_spark = Sparkline([], id="rss-spark")

    def compose(self) -> ComposeResult:
        yield self._cpu_label
        yield self._cpu_spark
        yield self._rss_label
        yield self._rss_spark

    def show(self, rank: RankState | None) -> None:
        """Show ``rank``'s samples; cheap when nothing changed since the last call."""
        if rank is None:
            key: tuple[object, ...] = (None,)
        else:
            key = (rank.rank, len(rank.cpu_history), rank.sample_ts, rank.cpu, rank.rss)
        if key == self._key:
            return
        self._key = key
        cpu_label = Text(no_wrap=True, overflow="ellipsis", end="")
        rss_label = Text(no_wrap=True, overflow="ellipsis", end="")
        if rank is None:
            cpu_label.append("CPU  no rank selected", _LABEL)
            rss_label.append("RSS", _LABEL)
            cpu, rss = [], []
        else:
            cpu_label.append(f"CPU  rank {rank.rank}  ", _LABEL)
            cpu_label.append("-" if rank.cpu is None else f"{rank.cpu:.1f}%")
            rss_label.append("RSS  ", _LABEL)
            rss_label.append(fmt_bytes(rank.rss))
            cpu = [float(x) for x in rank.cpu_history]
            rss = [float(x) for x in rank.rss_history]
        self._cpu_label.update(cpu_label, layout=False)
        self._rss_label.update(rss_label, layout=False)
        # Reassigned, never mutated (see the module docstring).
        self._cpu_spark.data = cpu
        self._rss_spark.data = rss
