"""Every rank's Python stacks (key ``d``, or the palette): identical stacks grouped, the
smallest (odd) groups first, each expandable to its threads' frames with file:line.

Read-only: asking sends a ``stacks`` command that changes nothing in the job (no confirm).
The request runs in a ``@work`` worker (:func:`..stack_view.fetch_stacks`) that posts
:class:`~..messages.StacksProgress` and :class:`~..messages.StacksFetched`, so the UI never
waits on it: "waiting for N ranks…" while the agents answer, then the groups.

``StacksScreen(endpoint, job, request_id=ID)`` shows a capture that already exists (a stall's,
the evidence taken before a stop) by its id, without asking the job again.

Below the status line, the collectives (issue 22): every rank's flight recorder, asked at
the same time in its own worker (:func:`..collective_view.fetch_collectives`), summarised in
a few lines: the suspects (the ranks the others wait for), then each process group's
positions. Python stacks that are all alike still show there which rank is elsewhere.

All text came from workers: labels are ``Text`` built by :func:`~.common.safe_text`.
"""

from __future__ import annotations

from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Static, Tree
from textual.widgets.tree import TreeNode

from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.stack_dumps import StackGroup, ThreadStack, group_line
from elastic_console.job.collective_view import CollectivesResult, fetch_collectives, result_lines
from elastic_console.job.stack_view import DEFAULT_TIMEOUT, StacksResult, fetch_stacks

from ..messages import StacksFetched, StacksProgress
from .common import safe_text

__all__ = ["StacksScreen"]

_DIM = Style(dim=True)
_ODD = Style(color="yellow", bold=True)
_ERROR = Style(color="red")
#: Lines of the collectives summary shown (the CLI prints them all).
COLLECTIVE_LINES = 8


class CollectivesFetched(Message):
    """The collectives worker's answer (or why there is none)."""

    def __init__(self, result: CollectivesResult | None, error: str = "") -> None:
        super().__init__()
        self.result = result
        self.error = error


class StacksTree(Tree[object]):
    """The groups; → expands, ← collapses (or goes to the parent), enter toggles."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("right,l", "expand", "Expand", show=False),
        Binding("left,h", "collapse", "Collapse", show=False),
        Binding("j", "cursor_down", "Down", show=False),
        Binding("k", "cursor_up", "Up", show=False),
    ]

    def action_expand(self) -> None:
        node = self.cursor_node
        if node is not None and node.allow_expand:
            node.expand()

    def action_collapse(self) -> None:
        node = self.cursor_node
        if node is None:
            return
        if node.is_expanded and node.allow_expand:
            node.collapse()
        elif node.parent is not None and node.parent is not self.root:
            self.move_cursor(node.parent)
            node.parent.collapse()


class StacksScreen(ModalScreen[None]):
    """See the module docstring."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "Close", id="stacks.close"),
        Binding("r", "refresh", "Ask again", id="stacks.refresh"),
    ]

    def __init__(self, endpoint: Endpoint | None, job_id: str, *, request_id: str | None = None,
                 rank: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        # Opaque, unlike the other dialogs: a translucent screen re-blends the whole screen
        # beneath on each of its 10 Hz refreshes (0.7 s a frame with 256 ranks here, which
        # held the stacks back by seconds).
        super().__init__(classes="stacks-screen")
        self.endpoint = endpoint
        self.job_id = job_id
        self.request_id = request_id
        self.rank = rank
        self.timeout = timeout
        self.result: StacksResult | None = None
        self.error = ""
        self.status_text = ""
        self.collectives: CollectivesResult | None = None
        self.collective_lines: list[str] = []

    def compose(self) -> ComposeResult:
        what = f"capture {self.request_id}" if self.request_id else "every rank"
        with Vertical(id="stacks", classes="dialog stacks-dialog"):
            yield Static(safe_text(f"Python stacks of job {self.job_id} ({what})", "bold"),
                         markup=False, classes="dialog-title")
            yield Static("", markup=False, id="stacks-status")
            yield Static("", markup=False, id="stacks-collectives")
            tree = StacksTree(Text("groups"), id="stacks-tree")
            tree.show_root = False
            tree.guide_depth = 2
            yield tree
            yield Static(Text("enter/→ frames · ← back · r asks again · esc closes", style=_DIM,
                              end=""), markup=False, classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#stacks-tree", StacksTree).focus()
        self._fetch_now()

    # -- fetching ------------------------------------------------------------------------------
    def _fetch_now(self) -> None:
        if self.endpoint is None:
            self._status("this console is not connected to Redis", _ERROR)
            return
        self.result, self.error = None, ""
        self._status("reading the capture…" if self.request_id else "asking every agent…")
        self._fetch()
        self.collectives, self.collective_lines = None, []
        self._fetch_collectives()

    @work(exclusive=True, group="collectives", exit_on_error=False)
    async def _fetch_collectives(self) -> None:
        assert self.endpoint is not None
        try:
            result = await fetch_collectives(self.endpoint, self.job_id, rank=self.rank,
                                             request_id=self.request_id, timeout=self.timeout)
        except Exception as exc:  # shown, never fatal
            self.post_message(CollectivesFetched(None, f"{type(exc).__name__}: {exc}"))
            return
        self.post_message(CollectivesFetched(result))

    def on_collectives_fetched(self, message: CollectivesFetched) -> None:
        view = self.query_one("#stacks-collectives", Static)
        r = message.result
        if r is None or not r.analysis["answered"]:
            why = message.error or "no rank has a flight recorder trace"
            self.collective_lines = [f"collectives: {why}"]
            view.update(safe_text(self.collective_lines[0], _DIM))
            return
        self.collectives = r
        lines = result_lines(r, self.job_id)[1:]
        self.collective_lines = lines
        text = Text(end="")
        for i, line in enumerate(lines[:COLLECTIVE_LINES]):
            style = _ODD if i == 0 and r.analysis["suspects"] else ""
            if i:
                text.append("\n")
            text.append_text(safe_text(line, style))
        if len(lines) > COLLECTIVE_LINES:
            text.append("\n")
            text.append_text(safe_text(f"… {len(lines) - COLLECTIVE_LINES} more lines: "
                                       f"elastic-console collectives {self.job_id}", _DIM))
        view.update(text)

    @work(exclusive=True, group="stacks", exit_on_error=False)
    async def _fetch(self) -> None:
        assert self.endpoint is not None

        def progress(answered: int, expected: int) -> None:
            self.post_message(StacksProgress(answered, expected))

        try:
            result = await fetch_stacks(self.endpoint, self.job_id, rank=self.rank,
                                        request_id=self.request_id, timeout=self.timeout,
                                        on_reply=progress)
        except Exception as exc:  # a Redis problem is shown, never fatal
            self.post_message(StacksFetched(None, f"{type(exc).__name__}: {exc}"))
            return
        self.post_message(StacksFetched(result))

    def on_stacks_progress(self, message: StacksProgress) -> None:
        if self.result is None and message.expected:
            left = message.expected - message.answered
            self._status(f"waiting for {left} rank{'' if left == 1 else 's'}… "
                         f"({message.answered} of {message.expected} answered)")

    def on_stacks_fetched(self, message: StacksFetched) -> None:
        if message.result is None:
            self.error = message.error
            self._status(f"cannot get the stacks: {message.error}", _ERROR)
            return
        self.result = r = message.result
        n = len(r.stacks)
        self._status(f"{n} rank{'' if n == 1 else 's'} on {len(r.hosts)} host"
                     f"{'' if len(r.hosts) == 1 else 's'}, {len(r.groups)} group"
                     f"{'' if len(r.groups) == 1 else 's'}, smallest first "
                     f"({r.seconds:.1f} s, request {r.request})")
        self._fill(r.groups)

    def _status(self, text: str, style: Style | str = "") -> None:
        self.status_text = text
        self.query_one("#stacks-status", Static).update(safe_text(text, style))

    def _fill(self, groups: list[StackGroup]) -> None:
        tree = self.query_one("#stacks-tree", StacksTree)
        tree.clear()
        for i, g in enumerate(groups):
            odd = i == 0 and len(groups) > 1
            style = _ERROR if g.error else (_ODD if odd else "")
            label = safe_text(group_line(g), style)
            label.append_text(safe_text(f"   on {', '.join(g.hosts) or '?'}", _DIM))
            node = tree.root.add(label, data=g, expand=False, allow_expand=bool(g.threads))
            for t in g.threads:
                self._add_thread(node, t)
        if groups:
            tree.move_cursor(tree.root.children[0])

    @staticmethod
    def _add_thread(node: TreeNode[object], thread: ThreadStack) -> None:
        kind = "current thread" if thread.current else "thread"
        tid = thread.thread_id
        head = node.add(safe_text(f"{kind} {tid}" if tid else kind, _DIM), expand=True,
                        allow_expand=bool(thread.frames))
        for f in thread.frames:
            label = safe_text(f.function, "bold")
            label.append_text(safe_text(f"  {f.where()}", _DIM))
            head.add_leaf(label)

    # -- for tests and screen readers -----------------------------------------------------------
    @property
    def group_lines(self) -> list[str]:
        return [group_line(g) for g in self.result.groups] if self.result else []

    # -- actions -------------------------------------------------------------------------------
    def action_close(self) -> None:
        self.dismiss(None)

    def action_refresh(self) -> None:
        self._fetch_now()
