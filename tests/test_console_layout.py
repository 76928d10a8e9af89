"""Issue 15, "every size works": the console's layout at 80×24, 120×40 and 200×60.

The rank table's columns give way in a stated order (RANK, STATE, RESTARTS, EXIT and QUIET
last); its box takes the rows it needs up to a cap and the log view gets the rest; the
timeline shrinks on a short terminal; the help wraps its descriptions in their own column.
Pilot tests assert each, SVG snapshots show them (the fixed view of test_console_app), and one
real terminal (tmux, 80×24) shows the whole against a real agent and Redis.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from textual.geometry import Region
from textual.pilot import Pilot
from textual.widgets import Static

from elastic_console.job.state import JobView
from elastic_console.tui.widgets import rank_rows
from elastic_console.tui.widgets.help import HelpScreen
from elastic_console.tui.widgets.rank_rows import fit_columns
from tests.agents import SCRIPTS, Agent, wait_until
from tests.test_console_app import (
    T0,
    App,
    big_view,
    run,
    screen_text,
    snapshot_app,
)
from tests.test_console_tmux import CONSOLE, Tmux, require_tmux
from tests.waiting import wait_until_async

ESSENTIAL = ("rank", "state", "restarts", "exit", "line")


def heights(app: App) -> dict[str, int]:
    """Outer heights of the job screen's areas, and the log view's lines."""
    return {"top": app.main_screen.query_one("#top").outer_size.height,
            "timeline": app.timeline.outer_size.height,
            "log": app.log_view.scrollable_content_region.height}


# -- the rank table's columns ------------------------------------------------------------------


def test_columns_give_way_in_the_stated_order():
    every = tuple(key for key, *_ in rank_rows.COLUMNS)
    assert fit_columns(rank_rows.ROW_WIDTH) == tuple(range(len(every)))
    shown = [tuple(every[i] for i in fit_columns(w)) for w in (89, 76, 70, 60, 50, 10)]
    assert shown[0] == ("rank", "host", "pid", "state", "restarts", "exit", "cpu", "rss", "line")
    assert shown[1] == ("rank", "host", "state", "restarts", "exit", "cpu", "rss", "line")
    assert shown[2] == ("rank", "host", "state", "restarts", "exit", "cpu", "line")
    assert shown[3] == ("rank", "host", "state", "restarts", "exit", "line")
    assert shown[4] == shown[5] == ESSENTIAL  # never fewer: the table scrolls sideways then
    for w in range(120):  # the row fits whenever it can; the display order is kept
        cols = fit_columns(w)
        assert list(cols) == sorted(cols)
        assert rank_rows.row_width(cols) <= w or tuple(every[i] for i in cols) == ESSENTIAL


def test_at_80_columns_the_essential_columns_show_and_sorting_follows_them():
    """At 80 columns RANK, STATE, RESTARTS, EXIT and QUIET are on screen (LOCAL and PID give
    way) with no sideways scrolling; rows, the cursor, `o` and header clicks work with the
    shown columns; a sort by a column a resize hid is kept, and `o` goes on from it to the next
    shown one."""
    app = snapshot_app()

    async def body(pilot: Pilot[int], app: App) -> None:
        table = app.rank_table
        await pilot.press("o", "o")  # rank -> host -> local (all shown at 120 columns)
        assert table.sort_column == "local"
        await pilot.resize_terminal(80, 24)
        await wait_until_async(lambda: "local" not in table.columns, 5, "the columns fitted")
        assert table.columns == ("rank", "host", "state", "restarts", "exit", "cpu", "rss",
                                 "line")
        assert table.virtual_size.width <= table.scrollable_content_region.width
        assert not table.show_horizontal_scrollbar
        header = table.render_line(0).text
        for label in ("RANK", "STATE", "RESTARTS", "EXIT", "QUIET", "HOST", "CPU%", "RSS"):
            assert label in header, label
        assert "LOCAL" not in header and "PID" not in header
        row = table.render_line(4).text.split()  # rank 3: restarted once, exit 1
        assert row[:6] == ["3", "gpu-b[red]", "running", "1", "1", "92"], row
        text = screen_text(app)
        assert "QUIET" in text and " 1.0 GiB      1s" in text
        assert table.sort_column == "local" and table.order() == [0, 2, 1, 3]
        assert "sorted by local" in text  # the title says why the rows are in this order
        await pilot.press("o")  # from LOCAL (hidden) to the next shown column
        assert table.sort_column == "state"
        seen = set()
        for _ in range(len(table.columns)):
            await pilot.press("o")
            seen.add(table.sort_column)
        assert seen == set(table.columns)  # `o` never picks a hidden column
        # a click on the header of the shown QUIET column (the last one) sorts by it
        region = table.content_region
        quiet_x = rank_rows.row_width(tuple(
            i for i, c in enumerate(rank_rows.COLUMNS) if c[0] in table.columns[:-1])) + 2
        await pilot.click(table, offset=(region.x - table.region.x + quiet_x,
                                         region.y - table.region.y))
        assert table.sort_column == "line"
        await pilot.press("j", "j")
        assert app.selected_rank == table.order()[2]
        await pilot.resize_terminal(120, 34)  # wide again: every column back
        await wait_until_async(lambda: len(table.columns) == len(rank_rows.COLUMNS), 5,
                               "the columns back")

    run(app, body)


# -- heights ------------------------------------------------------------------------------------


def grow(view: JobView, ranks: int) -> None:
    """``view`` (big_view's single node) with ``ranks`` ranks from now on."""
    more = big_view(ranks)
    view.ranks.update({r: s for r, s in more.ranks.items() if r not in view.ranks})


def test_the_rank_table_takes_the_rows_it_needs_up_to_a_cap():
    """Two ranks: a box of header + 2 rows, the log view gets the rest (12 lines at 80×24);
    ranks arriving grow it, up to 35% of the terminal (then it scrolls); it is restyled only
    when the wanted height changes."""
    view = big_view(2)
    app = App("big", view=view, clock=lambda: T0 + 5000)

    async def body(pilot: Pilot[int], app: App) -> None:
        table = app.rank_table
        await pilot.resize_terminal(80, 24)
        await wait_until_async(lambda: heights(app)["top"] == 5, 5, "two rows and the header")
        assert table.scrollable_content_region.height == 3 and not table.show_vertical_scrollbar
        assert heights(app)["log"] == 12
        fits: list[int] = []
        original = app._fit_layout
        app._fit_layout = lambda *a: (fits.append(1), original(*a))[1]  # type: ignore[method-assign]
        for _ in range(5):  # refreshes with nothing new: the layout is left alone
            table.sync(view, T0 + 5000, full=True)
            await pilot.pause()
        assert fits == []
        grow(view, 3)
        table.sync(view, T0 + 5000, full=True)
        await wait_until_async(lambda: heights(app)["top"] == 6, 5, "a third row")
        assert heights(app)["log"] == 11 and len(fits) == 1
        grow(view, 1024)
        table.sync(view, T0 + 5000, full=True)
        await wait_until_async(lambda: heights(app)["top"] == 8, 5, "the cap: 35% of 24 rows")
        assert table.show_vertical_scrollbar and heights(app)["log"] == 9
        await pilot.resize_terminal(200, 60)
        await wait_until_async(lambda: heights(app)["top"] == 21, 5, "the cap: 35% of 60 rows")
        view.ranks.clear()  # another job with no ranks yet: the box shrinks to its header
        table.sync(view, T0 + 5000, full=True)
        await wait_until_async(lambda: heights(app)["top"] == 6, 5, "the wide minimum")

    run(app, body)


def test_the_timeline_shrinks_on_a_short_terminal():
    """At 24 rows the timeline keeps two entries (no bottom border) and the log view shows 10
    lines of the four-rank job (7 before issue 15); at 40 rows it is 22% of the height."""
    app = snapshot_app()

    async def body(pilot: Pilot[int], app: App) -> None:
        await pilot.resize_terminal(80, 24)
        await wait_until_async(lambda: heights(app)["timeline"] == 3, 5, "the short timeline")
        assert app.timeline.scrollable_content_region.height == 2
        assert heights(app) == {"top": 7, "timeline": 3, "log": 10}
        text = screen_text(app).splitlines()
        assert "round 1 complete" in "\n".join(text)  # the newest entry is the one shown
        assert sum("epoch 2 step" in line for line in text) == 10
        await pilot.resize_terminal(120, 40)
        await wait_until_async(lambda: heights(app)["timeline"] == 8, 5, "the tall timeline")
        assert heights(app)["log"] == 21

    run(app, body)


# -- help -------------------------------------------------------------------------------------------


def test_the_help_at_80_columns_wraps_descriptions_in_their_column():
    """Every line of the help at 80 columns: the key column holds a section title, keys or
    nothing; a description that wraps goes on in its own column, never under the keys."""
    app = snapshot_app()

    async def body(pilot: Pilot[int], app: App) -> None:
        await pilot.resize_terminal(80, 24)
        await pilot.press("question_mark")
        await wait_until_async(lambda: isinstance(app.screen, HelpScreen), 5, "the help")
        screen = app.screen
        assert isinstance(screen, HelpScreen)
        help_body = screen.query_one("#help-body", Static)
        await wait_until_async(lambda: help_body.size.height > 0, 5, "the help laid out")
        width = help_body.size.width
        assert width < 75  # the dialog fits the terminal
        lines = [s.text for s in help_body.render_lines(Region(0, 0, width,
                                                               help_body.size.height))]
        keys_col = 2 + max(len(r.keys) for r in screen.rows)
        left = {line[:keys_col].strip() for line in lines}
        allowed = {r.keys for r in screen.rows} | {r.section for r in screen.rows} | {""}
        assert left <= allowed, left - allowed
        continued = [line for line in lines if not line[:keys_col].strip() and line.strip()]
        assert continued, "at 80 columns some descriptions wrap (the test would see nothing)"
        assert all(line.rstrip() and line[keys_col:keys_col + 2] == "  " for line in continued)
        text = "\n".join(lines)
        assert "shows" in text and "the acks)" in text
        assert max(len(line.rstrip()) for line in lines) <= width
        hint = screen_text(app)
        assert "esc closes" in hint  # the hint is on screen at 24 rows too

    run(app, body)


# -- snapshots ------------------------------------------------------------------------------------


def test_snapshot_80x24(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snapshot_app(), terminal_size=(80, 24))


def test_snapshot_120x40(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snapshot_app(), terminal_size=(120, 40))


def test_snapshot_200x60(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snapshot_app(), terminal_size=(200, 60))


def test_snapshot_help_80x24(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snapshot_app(), terminal_size=(80, 24), press=["question_mark"])


def test_snapshot_many_ranks_80x24(snap_compare: Callable[..., bool]) -> None:
    app = App("big", view=big_view(1024), clock=lambda: T0 + 5000)
    assert snap_compare(app, terminal_size=(80, 24))


# -- a real terminal -----------------------------------------------------------------------------


def test_attach_at_80x24_in_tmux(redis_url, job_id, tmp_path):
    """The installed console in an 80×24 tmux pane against a real two-rank job: the rank
    table's essential headers, the job keys in the footer and a dozen log lines."""
    require_tmux()
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--nproc-per-node", "2",
                   "--local-addr", "127.0.0.1", str(SCRIPTS / "sleeper.py")], tmp_path, "a")
    tmux = Tmux([str(CONSOLE), "attach", job_id, "--redis", redis_url], width=80, height=24)

    def counts(screen: list[str]) -> tuple[int, int]:
        """(rank rows in the table, log lines in the log view) on ``screen``."""
        ranks = sum(bool(re.match(r"│ +[01]  ", line)) for line in screen)
        ticks = sum(bool(re.match(r"\d\d:\d\d:\d\d\.\d+ \[ +[01]\] tick ", line))
                    for line in screen)
        return ranks, ticks

    with tmux.ending_with(agent):
        wait_until(lambda: "running" in tmux.screen(), 30, "the console showing the running job")
        # The table takes its rows at its next refresh (0.25 s), live lines come at once.
        # 24 rows: header 2, ranks 5 (2 rows), timeline 3, log title 1, footer 1: 12 lines.
        wait_until(lambda: counts(tmux.screen().splitlines()) == (2, 12), 20,
                   "both ranks and 12 live log lines")
        screen = tmux.screen().splitlines()
        assert len(screen) == 24 and max(len(line) for line in screen) <= 80
        header = next(line for line in screen if "RANK" in line)
        for label in ("RANK", "STATE", "RESTARTS", "EXIT", "QUIET"):
            assert label in header, label
        footer = screen[-1]
        for key in ("q Detach", "? Help", "r Restart", "s Stop", "K SIGTERM"):
            assert key in footer, key
        tmux.keys("q")
        wait_until(lambda: not tmux.alive(), 15, "the console to detach")

