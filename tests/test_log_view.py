"""LogView and LogBuffer: real Textual apps driven by Pilot (no mocks), plus an SVG snapshot."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from textual import events
from textual.app import App, ComposeResult
from textual.pilot import Pilot
from textual.strip import Strip

from elastic_agent.coordination.wire.text import sanitize, strip_sgr
from elastic_console.job.logbuffer import LogBuffer, LogLine
from elastic_console.job.packed_buffer import PackedLogBuffer
from elastic_console.tui.widgets import LogView, log_lines
from elastic_console.tui.widgets import log_view as log_view_module
from elastic_console.tui.widgets.log_lines import text_cells
from tests.waiting import wait_until_async

T0 = 1_700_000_000_000  # 2023-11-14 22:13:20.000 UTC
SIZE = (80, 12)  # the view gets 78 text columns (vertical scrollbar) and 11 rows (horizontal)


# -- helpers ------------------------------------------------------------------------------------


class LogApp(App[None]):
    def __init__(self, buffer: LogBuffer, **view_kwargs: Any) -> None:
        super().__init__()
        self.buffer = buffer
        self.view_kwargs = view_kwargs
        self.follow_events: list[bool] = []

    def compose(self) -> ComposeResult:
        yield LogView(self.buffer, utc=True, **self.view_kwargs)

    def on_log_view_follow_changed(self, message: LogView.FollowChanged) -> None:
        self.follow_events.append(message.follow)


def run(app: LogApp, body: Callable[[Pilot[None], LogView], Awaitable[None]],
        size: tuple[int, int] = SIZE) -> None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await body(pilot, app.query_one(LogView))

    asyncio.run(main())


def lines(n: int, start: int = 0, ranks: int = 4) -> list[LogLine]:
    return [LogLine(T0 + i, i % ranks, "err" if i % 3 == 0 else "out", f"line {i}")
            for i in range(start, start + n)]


def screen_text(view: LogView) -> list[str]:
    return [view.render_line(y).text.rstrip() for y in range(view.scrollable_content_region.height)]


async def scanned(view: LogView) -> None:
    """Until a sliced rescan is over (it runs between other events)."""
    await wait_until_async(lambda: not view.scanning, 10, "the rescan to finish")


def top_seq(view: LogView) -> int | None:
    loc = view.line_at_row(round(view.scroll_y))
    return None if loc is None else loc[0]


# -- LogBuffer ----------------------------------------------------------------------------------


RINGS = pytest.mark.parametrize("ring", [LogBuffer, PackedLogBuffer])


@RINGS
def test_buffer_capacity_counter_and_front_drop(ring: type[LogBuffer]) -> None:
    buf = ring(5)
    assert len(buf) == 0 and buf.total_appended == 0 and buf.first_seq == 0 and not buf
    for line in lines(3):
        buf.append(line)
    assert [ln.text for ln in buf] == ["line 0", "line 1", "line 2"]
    assert buf.extend(lines(4, start=3)) == 4
    assert len(buf) == 5 and buf.capacity == 5
    assert buf.total_appended == 7 and buf.first_seq == 2 and buf.dropped == 2
    assert [ln.text for ln in buf] == [f"line {i}" for i in range(2, 7)]
    assert buf[0].text == "line 2" and buf[-1].text == "line 6" and buf[4] == buf.get(6)
    with pytest.raises(IndexError):
        buf.get(1)  # fell off the front
    with pytest.raises(IndexError):
        buf.get(7)  # not appended yet
    with pytest.raises(IndexError):
        buf[5]
    assert [ln.text for ln in buf[1:3]] == ["line 3", "line 4"]
    assert [ln.text for ln in buf.lines_between(0, 4)] == ["line 2", "line 3"]
    buf.extend(lines(12, start=7))  # more than the capacity in one call
    assert buf.total_appended == 19 and [ln.text for ln in buf] == [f"line {i}" for i in range(14, 19)]
    buf.clear()
    assert len(buf) == 0 and buf.total_appended == 19 and buf.first_seq == 19
    buf.extend(lines(2, start=19))
    assert [ln.text for ln in buf] == ["line 19", "line 20"] and buf.first_seq == 19


@RINGS
def test_buffer_matches_a_reference_model(ring: type[LogBuffer]) -> None:
    rnd = random.Random(7)
    for cap in (1, 2, 7, 64, 200):
        buf = ring(cap)
        ref: list[LogLine] = []  # everything ever appended
        for _ in range(300):
            k = rnd.choice([0, 1, 2, 3, cap - 1, cap, cap + 1, 2 * cap + 3])
            new = lines(max(0, k), start=len(ref))
            if rnd.random() < 0.2 and new:
                buf.append(new[0])
                new = new[:1]
            else:
                buf.extend(iter(new) if rnd.random() < 0.3 else new)
            ref.extend(new)
            kept = ref[max(0, len(ref) - cap):]
            assert buf.total_appended == len(ref) and len(buf) == len(kept)
            assert buf.first_seq == len(ref) - len(kept)
            assert list(buf) == kept
            if kept:  # O(1) random access, absolute and relative
                i = rnd.randrange(len(kept))
                assert buf[i] == kept[i] and buf.get(buf.first_seq + i) == kept[i]
                assert buf[-1] == kept[-1]
                a, b = sorted(rnd.randrange(len(ref) + 1) for _ in range(2))
                assert buf.lines_between(a, b) == ref[max(a, buf.first_seq):b]

def test_buffer_storage_never_grows_past_the_capacity() -> None:
    big = LogBuffer(1000)
    for i in range(50):
        big.extend(lines(97, start=i * 97))
    assert len(big._buf) == 1000


@RINGS
def test_buffer_rejects_nonpositive_capacity(ring: type[LogBuffer]) -> None:
    with pytest.raises(ValueError):
        ring(0)


# -- hostile text -------------------------------------------------------------------------------


def test_hostile_text_is_shown_literally_and_sgr_as_colour() -> None:
    buf = LogBuffer(100)
    buf.extend([
        LogLine(T0, 1, "out", "[bold]x[/bold] [link=http://evil]click[/link] [red]r"),
        LogLine(T0 + 1, 1, "out", "title \x1b]0;pwned\x07 clear \x1b[2J bell \x07 cr \r end"),
        LogLine(T0 + 2, 1, "out", "osc8 \x1b]8;;http://evil\x1b\\here\x1b]8;;\x1b\\ done"),
        LogLine(T0 + 3, 1, "out", "ok \x1b[31mred\x1b[0m and \x1b[1;32mgreen\x1b[0m"),
        LogLine(T0 + 4, 1, "err", "boom\u202e evil \u2028 next"),
    ])

    async def body(pilot: Pilot[None], view: LogView) -> None:
        rows = screen_text(view)
        assert "[bold]x[/bold] [link=http://evil]click[/link] [red]r" in rows[0]
        assert r"title \x1b]0;pwned\x07 clear \x1b[2J bell \x07 cr \r end" in rows[1]
        assert r"osc8 \x1b]8;;http://evil\x1b\here\x1b]8;;\x1b\ done" in rows[2]
        assert "ok red and green" in rows[3]
        assert r"boom\u202e evil \u2028 next" in rows[4]
        for y in range(5):
            for seg in view.render_line(y):
                assert not any(c in seg.text for c in "\x1b\x07\r\n\u202e\u2028"), seg
                assert seg.style is None or not seg.style.link, seg  # no hyperlink made
        segs = list(view.render_line(3))
        red = [s for s in segs if s.text == "red"]
        green = [s for s in segs if s.text == "green"]
        assert red and red[0].style.color.number == 1
        assert green and green[0].style.color.number == 2 and green[0].style.bold
        # stderr text has its own (reddish) base colour, consistent for the `e` filter
        err_text = [s for s in view.render_line(4) if "boom" in s.text]
        assert err_text and err_text[0].style.color.triplet.hex == "#ff8787"

    run(LogApp(buf), body)


# -- follow mode --------------------------------------------------------------------------------


def test_follow_mode_scroll_up_pauses_and_end_resumes() -> None:
    buf = LogBuffer(10_000)
    buf.extend(lines(100))

    async def body(pilot: Pilot[None], view: LogView) -> None:
        app = pilot.app
        assert view.follow and view.scroll_y == view.max_scroll_y > 0
        assert screen_text(view)[-1].endswith("line 99")
        # new lines keep the view at the end
        buf.extend(lines(5, start=100))
        view.on_new_lines()
        await pilot.pause()
        assert view.scroll_y == view.max_scroll_y and screen_text(view)[-1].endswith("line 104")
        assert app.follow_events == []

        await pilot.press("up")
        await pilot.pause()
        assert not view.follow and app.follow_events == [False]
        top, y = top_seq(view), view.scroll_y
        assert y == view.max_scroll_y - 1
        buf.extend(lines(50, start=105))
        view.on_new_lines()
        await pilot.pause()
        assert view.scroll_y == y and top_seq(view) == top  # the view did not move

        await pilot.press("end")
        await pilot.pause()
        assert view.follow and app.follow_events == [False, True]
        assert view.scroll_y == view.max_scroll_y and screen_text(view)[-1].endswith("line 154")

        # page up / home / programmatic scroll away from the end all pause following
        for action in ("pageup", "home", None):
            if action is None:
                view.scroll_to(y=3, animate=False)
            else:
                await pilot.press(action)
            await pilot.pause()
            assert not view.follow, action
            await pilot.press("f")
            await pilot.pause()
            assert view.follow and view.scroll_y == view.max_scroll_y, action
        assert app.follow_events == [False, True] * 4

        # scrolling back down to the newest line resumes following
        await pilot.press("up", "up")
        assert not view.follow
        await pilot.press("j", "down")
        await pilot.pause()
        assert view.follow and app.follow_events[-2:] == [False, True]

    run(LogApp(buf), body)


def test_paused_view_keeps_its_lines_while_the_ring_drops_old_ones() -> None:
    buf = LogBuffer(100)
    buf.extend(lines(100))

    async def body(pilot: Pilot[None], view: LogView) -> None:
        view.follow = False
        view.scroll_to(y=50, animate=False)
        await pilot.pause()
        assert top_seq(view) == 50
        buf.extend(lines(20, start=100))  # seqs 0..19 fall off the front
        view.on_new_lines()
        await pilot.pause()
        assert top_seq(view) == 50 and view.scroll_y == 30
        assert screen_text(view)[0].endswith("line 50")
        buf.extend(lines(200, start=120))  # everything the user looked at is gone
        view.on_new_lines()
        await pilot.pause()
        assert view.scroll_y == 0 and top_seq(view) == 220 and not view.follow

    run(LogApp(buf), body)


def test_mouse_wheel_up_pauses_following() -> None:
    buf = LogBuffer(1000)
    buf.extend(lines(100))

    async def body(pilot: Pilot[None], view: LogView) -> None:
        assert view.follow
        view.post_message(events.MouseScrollUp(view, 5, 5, 0, -1, 0, False, False, False))
        await pilot.pause()
        assert not view.follow and pilot.app.follow_events == [False]
        assert view.scroll_y < view.max_scroll_y

    run(LogApp(buf), body)


def test_lines_before_mount_source_swap_and_a_growing_rank_column() -> None:
    buf = LogBuffer(1000)
    app = LogApp(buf, show_timestamps=False)

    async def body(pilot: Pilot[None], view: LogView) -> None:
        shown = [row for row in screen_text(view) if row]
        assert len(shown) == 11 and shown[-1] == "[  2] line 10"
        buf.append(LogLine(T0, 1000, "out", "wide rank"))  # the rank column grows
        view.on_new_lines()
        await pilot.pause()
        assert screen_text(view)[-2:] == ["[   2] line 10", "[1000] wide rank"]
        other = LogBuffer(10)
        other.extend(lines(3))
        view.source = other
        await pilot.pause()
        assert view.visible_seqs() == [0, 1, 2]
        assert [row for row in screen_text(view) if row] == ["[  0] line 0", "[  1] line 1", "[  2] line 2"]

    buf.extend(lines(11))  # appended before the view is even mounted
    run(app, body)


# -- filters ------------------------------------------------------------------------------------


class RecordingLogView(LogView):
    """Records which buffer ranges get scanned, to check the incremental path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scans: list[tuple[int, int]] = []

    def _append(self, a: int, b: int) -> bool:
        self.scans.append((a, b))
        return super()._append(a, b)


class RecordingApp(LogApp):
    def compose(self) -> ComposeResult:
        yield RecordingLogView(self.buffer, utc=True, **self.view_kwargs)


def expected(buf: LogBuffer, rank: int | None, err: bool, pattern: re.Pattern[str] | None) -> list[int]:
    out = []
    for seq in range(buf.first_seq, buf.total_appended):
        ln = buf.get(seq)
        if rank is not None and ln.rank != rank:
            continue
        if err and ln.stream != "err":
            continue
        if pattern is not None and not pattern.search(strip_sgr(sanitize(ln.text))):
            continue
        out.append(seq)
    return out


def test_filters_show_exactly_the_right_lines() -> None:
    buf = LogBuffer(1000)
    buf.extend([
        LogLine(T0, 0, "out", "step 1 loss=\x1b[1m0.50\x1b[0m"),
        LogLine(T0 + 1, 1, "err", "warning: \x1b[33mslow\x1b[0m"),
        LogLine(T0 + 2, 1, "out", "step 1 loss=0.51"),
        LogLine(T0 + 3, 0, "err", "Traceback (most recent call last):"),
        LogLine(T0 + 4, 2, "out", "esc \x07 bell"),
    ])

    async def body(pilot: Pilot[None], view: LogView) -> None:
        assert view.visible_seqs() == [0, 1, 2, 3, 4]
        view.rank_filter = 1
        assert view.visible_seqs() == [1, 2]
        view.stderr_only = True
        assert view.visible_seqs() == [1]
        view.set_filters(rank=None, stderr_only=False, pattern=re.compile(r"loss=0\.5"))
        assert view.visible_seqs() == [0, 2]  # matched against the text without SGR codes
        view.pattern = re.compile(r"\[1m")  # the SGR bytes themselves are not text
        assert view.visible_seqs() == []
        view.pattern = re.compile(r"\\x07")  # what the user reads for a BEL
        assert view.visible_seqs() == [4]
        view.set_filters(rank=0, pattern=None, stderr_only=True)
        assert view.visible_seqs() == [3]
        await pilot.pause()
        assert screen_text(view)[0].endswith("Traceback (most recent call last):")

    run(LogApp(buf), body)


@pytest.mark.parametrize("wrap", [False, True])
def test_incremental_filtering_matches_a_full_rescan_across_ring_drops(wrap: bool) -> None:
    rnd = random.Random(11 + wrap)
    buf = LogBuffer(300)
    words = ["loss", "step", "\x1b[31mERROR\x1b[0m", "grad", "x" * 90, "\tnan", "é漢"]

    def make(n: int, start: int) -> list[LogLine]:
        return [LogLine(T0 + i, rnd.randrange(6), rnd.choice(["out", "err"]),
                        " ".join(rnd.choice(words) for _ in range(rnd.randrange(1, 5))))
                for i in range(start, start + n)]

    buf.extend(make(100, 0))
    combos: list[tuple[int | None, bool, re.Pattern[str] | None]] = [
        (3, False, None), (None, True, None), (None, False, re.compile("ERROR")),
        (2, True, re.compile("loss|grad")), (None, False, None),
    ]

    async def body(pilot: Pilot[None], view: LogView) -> None:
        assert isinstance(view, RecordingLogView)
        for rank, err, pattern in combos:
            view.set_filters(rank=rank, stderr_only=err, pattern=pattern)
            assert view.visible_seqs() == expected(buf, rank, err, pattern)
            for _ in range(12):
                before = buf.total_appended
                buf.extend(make(rnd.randrange(1, 90), before))
                view.scans.clear()
                view.on_new_lines()
                # only the new lines were scanned (incremental), never the whole buffer
                assert view.scans == [(max(before, buf.first_seq), buf.total_appended)]
                want = expected(buf, rank, err, pattern)
                assert view.visible_seqs() == want
                if wrap:
                    tw = view.scrollable_content_region.width - 19
                    rows = sum(max(1, -(-text_cells(buf.get(s).text) // tw)) for s in want)
                    assert view.row_count == rows == view.virtual_size.height
                else:
                    assert view.row_count == len(want) == view.virtual_size.height
            assert buf.first_seq > 0  # the ring did drop lines on the way
            await pilot.pause()
            if view.row_count >= view.scrollable_content_region.height:
                # following: the bottom row of the screen belongs to the newest matching line
                assert view.follow and view.scroll_y == view.max_scroll_y
                bottom = round(view.scroll_y) + view.scrollable_content_region.height - 1
                loc = view.line_at_row(bottom)
                assert loc is not None and loc[0] == view.visible_seqs()[-1]
                last = buf.get(loc[0])
                stamp = f"22:13:{20 + (last.server_ms - T0) // 1000:02d}.{last.server_ms % 1000:03d}"
                assert any(row.startswith(stamp) for row in screen_text(view)[-8:])

    run(RecordingApp(buf, wrap=wrap), body)


@pytest.mark.parametrize("wrap", [False, True])
def test_a_rescan_of_a_big_buffer_goes_backwards_in_slices(wrap: bool) -> None:
    """A filter change over a big buffer indexes the newest lines first (what a following view
    shows), hands the event loop back, and adds the older matches above in later slices; the
    end result is the full rescan, and lines arriving meanwhile are not lost."""
    rnd = random.Random(5)
    buf = LogBuffer(60_000)
    words = ["loss", "step", "\x1b[31mERROR\x1b[0m", "grad", "y" * 120]

    def make(n: int, start: int) -> list[LogLine]:
        return [LogLine(T0 + i, rnd.randrange(8), rnd.choice(["out", "err"]),
                        " ".join(rnd.choice(words) for _ in range(rnd.randrange(1, 4))))
                for i in range(start, start + n)]

    buf.extend(make(50_000, 0))
    pattern = re.compile("loss|ERROR")

    async def body(pilot: Pilot[None], view: LogView) -> None:
        view.pattern = pattern
        want = expected(buf, None, False, pattern)
        assert view.scanning  # not all in one go
        got = view.visible_seqs()
        assert 0 < len(got) < len(want) and got == want[-len(got):]  # the newest, in order
        await pilot.pause()
        assert view.follow and view.scroll_y == view.max_scroll_y
        bottom = round(view.scroll_y) + view.scrollable_content_region.height - 1
        assert view.line_at_row(bottom)[0] == want[-1]
        buf.extend(make(500, buf.total_appended))  # lines arrive while the scan goes on
        view.on_new_lines()
        await scanned(view)
        want = expected(buf, None, False, pattern)
        assert view.visible_seqs() == want
        if wrap:
            tw = view.scrollable_content_region.width - 19
            rows = sum(max(1, -(-text_cells(buf.get(s).text) // tw)) for s in want)
            assert view.row_count == rows == view.virtual_size.height
        else:
            assert view.row_count == len(want) == view.virtual_size.height
        assert view.scroll_y == view.max_scroll_y  # still following

    run(LogApp(buf, wrap=wrap), body)


def test_a_paused_view_keeps_its_top_line_through_a_sliced_rescan() -> None:
    buf = LogBuffer(60_000)
    buf.extend(lines(50_000))

    async def body(pilot: Pilot[None], view: LogView) -> None:
        view.follow = False
        view.scroll_to(y=19_998, animate=False)  # far above what the first slice covers
        await pilot.pause()
        top = top_seq(view)
        assert top is not None and top < 40_000
        view.stderr_only = True  # every third line, the top one (seq % 3 == 0) among them
        assert top % 3 == 0 and view.scanning
        await scanned(view)
        await pilot.pause()
        assert top_seq(view) == top and not view.follow
        assert view.visible_seqs() == list(range(0, 50_000, 3))

    run(LogApp(buf), body)


def test_later_slices_of_a_rescan_wait_for_yield_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """The app's keys-first hook: while ``yield_to`` holds, no further slice runs."""
    # Slices end by time: on a fast, idle machine the rest of the scan could fit in one slice
    # after the gate opens, and yield_to would not be asked again. One chunk a slice.
    monkeypatch.setattr(log_view_module, "SCAN_SLICE_S", 0.0)
    buf = LogBuffer(60_000)
    buf.extend(lines(50_000))
    gate = asyncio.Event()
    waits = 0

    async def hold() -> None:
        nonlocal waits
        waits += 1
        await gate.wait()

    async def body(pilot: Pilot[None], view: LogView) -> None:
        view.yield_to = hold
        view.stderr_only = True
        assert view.scanning
        await wait_until_async(lambda: waits == 1, 10, "the rescan to reach yield_to")
        first = len(view.visible_seqs())
        await asyncio.sleep(0.2)  # dozens of slices' worth of time, held
        assert view.scanning and len(view.visible_seqs()) == first and waits == 1
        gate.set()
        await scanned(view)
        assert view.visible_seqs() == list(range(0, 50_000, 3)) and waits > 1

    run(LogApp(buf), body)


class FrameCountingLogView(LogView):
    """Counts the frames that drew its rows (its top row, Textual caching the rest)."""

    frames = 0

    def render_line(self, y: int) -> Strip:
        if y == 0:
            FrameCountingLogView.frames += 1
        return super().render_line(y)


class FrameCountingApp(LogApp):
    def compose(self) -> ComposeResult:
        yield FrameCountingLogView(self.buffer, utc=True, **self.view_kwargs)


def test_a_view_is_redrawn_only_when_the_rows_on_screen_change() -> None:
    """A following view whose rescan adds older matches above, or whose new lines are all
    filtered out, shows the same rows: no frame. New matching lines: a frame, with them."""
    buf = LogBuffer(60_000)
    buf.extend(lines(50_000))

    async def body(pilot: Pilot[None], view: LogView) -> None:
        before = FrameCountingLogView.frames
        view.pattern = re.compile(r"line \d*[0369]$")  # a regex: many slices of ~3 ms
        assert view.scanning
        await scanned(view)
        await pilot.pause()
        # one frame for the first slice (the screen changed), none for the older matches
        assert FrameCountingLogView.frames - before <= 2, FrameCountingLogView.frames - before
        assert view.scroll_y == view.max_scroll_y
        assert view.visible_seqs() == expected(buf, None, False, view.pattern)
        drawn = FrameCountingLogView.frames
        buf.extend([LogLine(T0, 1, "out", "line 50001"), LogLine(T0, 2, "out", "line 50002")])
        view.on_new_lines()
        await pilot.pause()
        assert FrameCountingLogView.frames == drawn  # filtered out: nothing moved
        buf.extend([LogLine(T0, 3, "err", "line 50003")])
        view.on_new_lines()
        await pilot.pause()
        assert FrameCountingLogView.frames > drawn
        assert screen_text(view)[-1].endswith("line 50003")  # (draws it again, by hand)

    run(FrameCountingApp(buf), body)


def test_focus_tints_the_view_without_rendering_its_lines_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache holds each line without the widget's base style (focus changes it): a
    focus change repaints the rows with the new tint from the cached segments."""
    buf = LogBuffer(100)
    buf.extend(lines(50))
    built: list[str] = []
    original = log_lines.build_text

    def counting(raw: str) -> Any:
        built.append(raw)
        return original(raw)

    monkeypatch.setattr(log_view_module, "build_text", counting)

    async def body(pilot: Pilot[None], view: LogView) -> None:
        view.blur()
        await pilot.pause()
        blurred = view.render_line(0)
        built.clear()
        view.focus()
        await pilot.pause()
        focused = view.render_line(0)
        assert built == []  # no line rendered again
        assert focused.text == blurred.text
        assert [seg.style.bgcolor for seg in focused] != [seg.style.bgcolor for seg in blurred]

    run(LogApp(buf), body)


# -- wrap, timestamps ---------------------------------------------------------------------------


def test_wrap_changes_virtual_height_and_width() -> None:
    buf = LogBuffer(100)
    buf.extend([LogLine(T0 + i, 7, "out", "a" * n) for i, n in enumerate((10, 59, 60, 200))])

    async def body(pilot: Pilot[None], view: LogView) -> None:
        width = view.scrollable_content_region.width
        assert width == 78
        prefix = 13 + 6  # "HH:MM:SS.mmm " + "[  7] "
        assert view.virtual_size == (prefix + 200, 4)
        view.wrap = True
        await pilot.pause()
        # 59 text columns: heights 1, 1, 2, 4
        assert view.virtual_size.height == view.row_count == 8 and view.line_count == 4
        view.scroll_to(y=0, animate=False)
        await pilot.pause()
        rows = screen_text(view)
        assert rows[2] == "22:13:20.002 [  7] " + "a" * 59
        assert rows[3] == " " * prefix + "a"  # continuation rows are indented under the text
        assert rows[4].startswith("22:13:20.003 [  7] a")
        view.show_timestamps = False  # 72 text columns: heights 1, 1, 1, 3
        await pilot.pause()
        assert view.virtual_size.height == 6
        await pilot.resize_terminal(40, 12)  # 38 - 6 = 32 columns: 1, 2, 2, 7
        assert view.virtual_size.height == 12
        view.wrap = False
        await pilot.pause()
        assert view.virtual_size == (6 + 200, 4)

    run(LogApp(buf), body)


def test_timestamps_and_rank_tags_toggle() -> None:
    buf = LogBuffer(100)
    buf.extend([LogLine(T0 + 123, 5, "out", "hello"), LogLine(T0 + 3_723_004, 1234, "out", "wide")])

    async def body(pilot: Pilot[None], view: LogView) -> None:
        view.scroll_to(y=0, animate=False)
        await pilot.pause()
        rows = screen_text(view)
        # the rank column grew to fit rank 1234
        assert rows[:2] == ["22:13:20.123 [   5] hello", "23:15:23.004 [1234] wide"]
        view.show_timestamps = False
        await pilot.pause()
        assert screen_text(view)[:2] == ["[   5] hello", "[1234] wide"]
        view.show_rank_tags = False
        await pilot.pause()
        assert screen_text(view)[:2] == ["hello", "wide"]
        view.show_timestamps = True
        await pilot.pause()
        assert re.fullmatch(r"\d\d:\d\d:\d\d\.123 hello", screen_text(view)[0])

    run(LogApp(buf), body)


def test_horizontal_scroll_when_not_wrapping() -> None:
    buf = LogBuffer(100)
    buf.append(LogLine(T0, 0, "out", "".join(f"{i:<10}" for i in range(30))))

    async def body(pilot: Pilot[None], view: LogView) -> None:
        assert view.virtual_size.width == 19 + 300
        await pilot.press("right", "right")
        await pilot.pause()
        assert view.scroll_x == 16
        assert screen_text(view)[0].startswith("0] 0         1")  # 16 cells of the prefix gone
        await pilot.press("left", "left", "left")
        assert view.scroll_x == 0

    run(LogApp(buf), body)


# -- snapshot -----------------------------------------------------------------------------------


class SnapshotApp(App[None]):
    CSS = "LogView { height: 1fr; }"

    def compose(self) -> ComposeResult:
        buf = LogBuffer(100)
        buf.extend([
            LogLine(T0 + 5, 0, "out", "epoch 1 step 10 \x1b[32mloss=0.693\x1b[0m lr=1e-3"),
            LogLine(T0 + 7, 1, "out", "epoch 1 step 10 \x1b[32mloss=0.701\x1b[0m lr=1e-3"),
            LogLine(T0 + 9, 2, "err", "\x1b[33mUserWarning\x1b[0m: [bold]not markup[/bold]"),
            LogLine(T0 + 12, 3, "out", "title \x1b]0;pwned\x07 stays visible"),
            LogLine(T0 + 250, 12, "out", "\x1b[1;34mcheckpoint\x1b[0m saved to /ckpt/step_10.pt"),
            LogLine(T0 + 480, 2, "err", "Traceback (most recent call last):"),
        ])
        yield LogView(buf, utc=True)


def test_snapshot(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(SnapshotApp(), terminal_size=(72, 10))


# -- measuring agrees with rendering --------------------------------------------------------------


HARD_LINES = [
    "", "plain ascii", "tab\there\tand\tthere", "\x1b[31mred\x1b[0m\tafter tab", "漢字とかな wide",
    "e\u0301 combining", "emoji 🚀 rocket", "bell \x07 esc \x1b]0;t\x07 csi \x1b[2J", "bidi \u202e x",
    "c1 \x85 \x9b", "nul \x00", "cr \r lf", "x" * 5000, "\x1b[1m" * 2000 + "y" * 3000, "漢" * 3000,
    "\x1b[3\x1b[1mm nested", "\x1b\x1b[31mdouble esc",
]


@pytest.mark.parametrize("raw", HARD_LINES, ids=[f"line{i}" for i in range(len(HARD_LINES))])
def test_measured_width_matches_rendered_width(raw: str) -> None:
    from elastic_console.tui.widgets.log_lines import build_text, cells_of, visible_text

    assert text_cells(raw) == build_text(raw).cell_len
    assert cells_of([raw, "ok"]) == [build_text(raw).cell_len, 2]
    # what a pattern is matched against is the text shown, without colours
    assert visible_text(raw) == strip_sgr(sanitize(raw))
