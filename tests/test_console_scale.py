"""The rank table of a big job (issue 21): by node (``n``), and going to a rank or a host
(``:`` or a digit), with Pilot against a job of thousands of ranks written into a real Redis."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.pilot import Pilot
from textual.widgets import Input

from elastic_agent.coordination.wire.event_records import EventType
from elastic_console.job.model import RESOURCE_HISTORY
from elastic_console.job.state import DEFAULT_SCROLLBACK, JobView
from elastic_console.tui import feed
from elastic_console.tui.widgets import rank_rows
from elastic_console.tui.widgets.goto import GotoScreen
from elastic_console.tui.widgets.help import HelpScreen, help_text
from tests.test_console_app import (
    T0,
    App,
    big_view,
    console,
    ev,
    loaded,
    logs,
    on_screen,
    run,
    screen_text,
)
from tests.waiting import wait_until_async

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import console_bench

NODES, NPROC = 512, 8
RANKS = NODES * NPROC
BAD_RANK = 3001  # on gpu0375, local rank 1
STOPPED_NODE = 100  # every rank of gpu0100 stopped


def write_big_job(r, job_id: str) -> console_bench.Feeder:
    """512 nodes x 8 ranks as their agents write them (the console bench's feeder: the
    protocol's encoders), a little of their output, then rank 3001 failed and node 100's
    ranks stopped."""
    feeder = console_bench.Feeder(r, job_id, RANKS, 20_000, seed=5, nproc=NPROC)
    feeder.setup()
    feeder.prefill(0.1)
    pipe = r.pipeline(transaction=False)
    node = feeder.nodes[BAD_RANK // NPROC]
    feeder.event(pipe, node.node, EventType.WORKER_EXITED, rank=BAD_RANK, local_rank=1,
                 pid=feeder.pids(node)[1], exit_code=1, signal=None, message="RuntimeError: boom",
                 error_file=None, stopping=False, attempt=1, round=1, host=node.host,
                 timestamp=0.0, error_file_path="")
    stopped = feeder.nodes[STOPPED_NODE]
    feeder.event(pipe, stopped.node, EventType.WORKERS_STOPPED, ranks=stopped.ranks,
                 reason="command", attempt=1)
    pipe.execute()
    return feeder


def test_by_node_and_goto_on_a_job_of_4096_ranks(redis_url, r, job_id):
    feeder = write_big_job(r, job_id)
    bad_node = feeder.nodes[BAD_RANK // NPROC]
    app = console(redis_url, job_id, cursor_blink=False)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, RANKS, timeout=40)
        table = app.rank_table
        await wait_until_async(lambda: app.view.ranks[BAD_RANK].state == "failed"
                               and app.view.ranks[STOPPED_NODE * NPROC].state == "stopped", 20,
                               "the failure and the stop folded in")
        # The cursor stays on the rank it was on while ranks arrive: which one was drawn first
        # depends on the order the feed's records were folded in. To the top: rank 0.
        await pilot.press("g")
        assert table.row_count == RANKS and table.selected_rank == 0
        # n: one row per node, the failed one first, then the stopped one, then by first rank
        await pilot.press("n")
        assert table.by_node and table.row_count == NODES
        order = table.order()
        assert order[:3] == [bad_node.node, feeder.nodes[STOPPED_NODE].node, feeder.nodes[0].node]
        # The cursor stayed on rank 0's node; its row says what its ranks are.
        assert table.selected_key == feeder.nodes[0].node and app.selected_rank == 0
        await pilot.press("g")  # to the top row: the failed node; it stands for its worst rank
        assert table.selected_rank == BAD_RANK == app.selected_rank
        table.sync(app.view, app.now_ms(), full=False)
        cells = dict(zip([c[0] for c in rank_rows.NODE_COLUMNS],
                         table.shown_row(bad_node.node)))
        assert cells["host"] == bad_node.host and cells["ranks"] == "3000-3007"
        assert cells["state"] == "failed" and cells["states"] == "1 failed, 7 running"
        assert cells["exit"] == "1"
        stopped = table.shown_row(feeder.nodes[STOPPED_NODE].node)
        assert stopped[2] == "stopped" and stopped[3] == "8 stopped"
        await wait_until_async(lambda: "Nodes · worst state first (n: by rank)" in screen_text(app)
                               and "1 failed, 7 running" in screen_text(app), 5,
                               "the node view on screen")
        # enter on a node: its ranks, the cursor on its worst one
        await pilot.press("enter")
        assert not table.by_node and table.row_count == RANKS
        assert table.selected_rank == BAD_RANK and table.order()[table.cursor_row] == BAD_RANK
        # a digit typed in the table opens the prompt with it; enter goes to that rank
        await pilot.press("4")
        await on_screen(app, GotoScreen)
        assert app.screen.query_one(Input).value == "4"
        await pilot.press("0", "9", "5", "enter")
        await on_screen(app, GotoScreen, shown=False)
        assert table.selected_rank == 4095 and app.selected_rank == 4095
        assert table.scroll_y > 0  # scrolled to it
        # ':' and a host (the start of one, any case) go to its first rank in the table's order
        await pilot.press("colon", *"GPU020", "enter")
        await on_screen(app, GotoScreen, shown=False)
        assert table.selected_rank == 1600 and app.view.ranks[1600].host == "gpu0200"
        # by node, a host (here: a part of its name) goes to its node; a rank number turns
        # the view back to ranks
        await pilot.press("n", "colon", *"pu0511", "enter")
        await on_screen(app, GotoScreen, shown=False)
        assert table.by_node and table.selected_key == feeder.nodes[511].node
        await pilot.press("colon", *"42", "enter")
        await on_screen(app, GotoScreen, shown=False)
        assert not table.by_node and table.selected_rank == 42
        await wait_until_async(lambda: "Ranks · sorted by rank" in screen_text(app), 5,
                               "the rank view's title")
        # nothing matches: one warning, the cursor stays; esc cancels without moving
        await pilot.press("colon", *"no-such-host", "enter")
        await on_screen(app, GotoScreen, shown=False)
        assert table.selected_rank == 42
        assert any("no rank, host or node matches 'no-such-host'" in m for m, _ in app.notes)
        await pilot.press("colon", "7", "escape")
        await on_screen(app, GotoScreen, shown=False)
        assert table.selected_rank == 42
        # the help lists both keys
        await pilot.press("question_mark")
        await on_screen(app, HelpScreen)
        text = help_text(app.screen.rows).plain
        assert "by node: one row per node" in text and "go to a rank" in text

    run(app, body, timeout=120)


def test_attach_reads_a_bounded_history_from_many_node_streams(redis_url, r, job_id,
                                                              monkeypatch):
    # 400 nodes of 1 rank, 40 entries of 1 line each in every node's stream: 16,000 lines.
    # With room for 4,000 lines in all, each stream gives its newest 16 (16 per rank), not
    # everything it has (a floor of 1,000 per stream read all 2.5M lines of 4,096 nodes).
    monkeypatch.setattr(feed, "HISTORY_LINES_TOTAL", 4_000)
    feeder = console_bench.Feeder(r, job_id, 400, 8_000, seed=2, nproc=1)
    feeder.setup()
    assert feeder.prefill(2.0) == 16_000
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, 400)
        assert app.view.lines_total == 400 * feed.HISTORY_LINES_MIN_PER_RANK
        assert all(len(app.view.buffer_for(rank)) == 16 for rank in range(400))

    run(app, body)


def test_resource_samples_of_many_ranks_are_read_less_often(redis_url, r, job_id, monkeypatch):
    # Reading and folding 32,768 samples is ~0.25 s of CPU: every 4th poll at that size. Here
    # 8 ranks at 2 per read: every 4th poll; the meta is read every META_EVERY-th (5th).
    monkeypatch.setattr(feed, "POLL_S", 0.02)
    monkeypatch.setattr(feed, "RESOURCE_RANKS_PER_POLL", 2)
    assert feed.resource_polls_every(8) == 4 and feed.META_EVERY == 5
    console_bench.Feeder(r, job_id, 8, 100, seed=1, nproc=4).setup()
    app = console(redis_url, job_id)
    calls = {"resources": 0, "liveness": 0}

    def counting(name: str) -> Callable[..., Any]:
        original = getattr(app.client, name)

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return await original(*args, **kwargs)
        return wrapper

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, 8)
        await wait_until_async(lambda: calls["liveness"] >= 6, 20, "30 polls")
        # 30 polls: 8 reads of the samples (every 4th), not 30; liveness every 5th: 6.
        assert calls["resources"] <= 2 * calls["liveness"], calls
        assert calls["resources"] >= calls["liveness"] - 1, calls

    assert app.client is not None
    for name in calls:
        monkeypatch.setattr(app.client, name, counting(name))
    run(app, body)


def test_the_ranks_rings_share_a_bound_on_lines(monkeypatch):
    # 32,768 ranks of 2,000 lines would be 65M lines (several GiB): the rings share a total.
    monkeypatch.setattr(feed, "RANK_LINES_TOTAL", 150 * 64)
    view = big_view(64)
    app = App("big", view=view, clock=lambda: T0 + 5000)

    async def body(pilot: Pilot[int], app: App) -> None:
        assert app.scrollback == DEFAULT_SCROLLBACK and view.scrollback == 150
        logs(view, T0 + 100, "a-1-x", 5, 1, [f"line {i}" for i in range(400)])
        assert len(view.buffer_for(5)) == 150
        assert view.buffer_for(5)[-1][3] == "line 399"
        # Never below the floor, never above --scrollback.
        monkeypatch.setattr(feed, "RANK_LINES_TOTAL", 64)
        app._fit_scrollback()
        assert view.scrollback == feed.SCROLLBACK_FLOOR
        monkeypatch.setattr(feed, "RANK_LINES_TOTAL", 10**9)
        app._fit_scrollback()
        assert view.scrollback == DEFAULT_SCROLLBACK

    run(app, body)


def test_the_active_nodes_are_counted_again_only_after_an_event():
    # The header and the command keys ask 10 times a second; at 4,096 nodes a dict of them
    # each time was ~4% of the console's time while lines arrive.
    view = JobView("big", scrollback=10)
    nodes = [{"node": f"n{i}-1-x", "host": f"h{i}", "group_rank": i, "nproc": 1}
             for i in range(64)]
    for n in nodes:
        ev(view, T0, EventType.NODE_JOINED, n["node"], host=n["host"])
    ev(view, T0 + 1, EventType.RENDEZVOUS_COMPLETE, "n0-1-x", round=0, world_size=64,
       nodes=nodes)
    built = [0]
    active_nodes = view.active_nodes

    def counting() -> dict[str, str]:
        built[0] += 1
        return active_nodes()

    view.active_nodes = counting  # type: ignore[method-assign]
    for k in range(50):  # refreshes while lines arrive
        logs(view, T0 + 10 + k, "n3-1-x", 3, k + 1, [f"line {k}"])
        assert view.active_node_count() == 64
    assert built[0] == 1
    ev(view, T0 + 100, EventType.NODE_LEFT, "n5-1-x", host="h5")
    assert view.active_node_count() == 63 and view.active_node_count() == 63
    assert built[0] == 2


def test_rank_order_is_not_sorted_again_while_the_ranks_stay(monkeypatch):
    # Once a second the table's order is recomputed; by rank (the default) only the ranks
    # themselves change it: sorting 32,768 of them by a key was 15-30 ms of a tick.
    view = big_view(256)
    app = App("big", view=view, clock=lambda: T0 + 5000)

    async def body(pilot: Pilot[int], app: App) -> None:
        table = app.rank_table
        keyed = [0]
        original = rank_rows.SORT_KEYS["rank"]

        def counting(r: Any) -> Any:
            keyed[0] += 1
            return original(r)

        monkeypatch.setitem(rank_rows.SORT_KEYS, "rank", counting)
        for _ in range(5):
            table.sync(view, T0 + 5000, full=True)
        assert keyed[0] == 0 and table.order() == list(range(256))
        ev(view, T0 + 10, EventType.RENDEZVOUS_COMPLETE, "a-1-x", round=1, world_size=200,
           nodes=[{"node": "a-1-x", "host": "a", "group_rank": 0, "nproc": 200}])
        table.sync(view, T0 + 5000, full=True)  # fewer ranks: the order follows
        assert table.order() == list(range(200))
        await pilot.press("o")  # another column: sorted by its key
        assert table.sort_column != "rank" and table.row_count == 200

    run(app, body)


def test_resource_samples_of_a_rank_cost_little_and_survive_hostile_numbers():
    # 32,768 ranks x 120 samples as deques of Python numbers were 382 MiB of the console's
    # 1 GiB; as arrays of doubles ~2 KiB a rank.
    view = JobView("big", scrollback=10)
    ranks = 1000
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(RESOURCE_HISTORY + 10):
        view.apply_resources({r: {"cpu": 90.5 + i, "rss": 3_000_000_000 + i, "threads": 24,
                                  "ts": 1_700_000_000.0 + i} for r in range(ranks)})
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown / ranks < 3 * 1024, grown / ranks
    rs = view.ranks[7]
    assert len(rs.cpu_history) == RESOURCE_HISTORY and rs.cpu_history[-1] == 90.5 + 129
    assert rs.rss_history[0] == 3_000_000_010
    view.apply_resources({7: {"cpu": 1.0, "rss": 10**400, "ts": 1_800_000_000.0}})
    assert rs.rss == 10**400 and rs.rss_history[-1] == float("inf")
    assert len(rs.rss_history) == RESOURCE_HISTORY


def nodes_view_app() -> App:
    """24 nodes x 8 ranks, offline: one rank failed, one node restarting, samples."""
    view = JobView("big-42", scrollback=10)
    view.set_connection(True, "redis://redis.internal:6379/0")
    view.apply_meta({"min_nodes": "24", "max_nodes": "24", "max_restarts": "3",
                     "created_ms": str(T0)})
    nodes = [(f"n{g:02d}-{g}-x", f"gpu{g:02d}") for g in range(24)]
    ev(view, T0 + 10, EventType.RENDEZVOUS_COMPLETE, nodes[0][0], round=0, world_size=192,
       nodes=[{"node": n, "host": h, "group_rank": g, "nproc": 8}
              for g, (n, h) in enumerate(nodes)])
    for g, (node, host) in enumerate(nodes):
        ev(view, T0 + 20, EventType.WORKERS_STARTED, node, round=0, attempt=0, restart_count=0,
           ranks=list(range(8 * g, 8 * g + 8)), local_ranks=list(range(8)),
           pids=list(range(1000 + 8 * g, 1008 + 8 * g)), host=host)
    ev(view, T0 + 30, EventType.WORKER_EXITED, nodes[9][0], rank=77, local_rank=5, pid=1077,
       exit_code=-9, signal="SIGKILL", message="signal SIGKILL", stopping=False,
       host=nodes[9][1])
    ev(view, T0 + 40, EventType.WORKERS_STOPPED, nodes[17][0], ranks=list(range(136, 144)),
       reason="command")
    view.apply_resources({r: {"cpu": 90.0 + r % 10, "rss": (3000 + r) << 20, "threads": 9,
                              "ts": 1_700_000_002.0} for r in range(192)})
    return App("big-42", view=view, utc=True, clock=lambda: T0 + 6000, cursor_blink=False)


def test_snapshot_by_node(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(nodes_view_app(), terminal_size=(120, 34), press=["n"])


def test_snapshot_goto_prompt(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(nodes_view_app(), terminal_size=(120, 34), press=["1", "2"])
