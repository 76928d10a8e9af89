"""console.text (untrusted text) and console.state (JobView, the pure fold): no Redis needed."""

from __future__ import annotations

import itertools
import random
import re

from rich.text import Text

from elastic_agent.coordination.wire.event_records import Event, EventType, decode_event, encode_event
from elastic_agent.coordination.wire.log_records import LogBatch, decode_log_batch, encode_log_batch
from elastic_agent.coordination.wire.text import sanitize, strip_sgr
from elastic_console.job.logbuffer import LogLine
from elastic_console.job.model import RESOURCE_HISTORY
from elastic_console.job.packed_buffer import PackedLogBuffer
from elastic_console.job.state import ConnectionChange, JobView

# -- text ----------------------------------------------------------------------------------

ESC = "\x1b"


def test_osc_csi_bel_cr_del_c1_are_shown_escaped():
    assert sanitize(f"{ESC}]0;title\x07") == "\\x1b]0;title\\x07"
    assert sanitize(f"{ESC}[2Jcleared") == "\\x1b[2Jcleared"
    assert sanitize(f"{ESC}[10;20H") == "\\x1b[10;20H"  # cursor move: not SGR
    assert sanitize("ring\x07") == "ring\\x07"
    assert sanitize("50%\r100%") == "50%\\r100%"
    assert sanitize("del\x7f") == "del\\x7f"
    assert sanitize("nul\x00 bs\x08 vt\x0b ff\x0c lf\n") == "nul\\x00 bs\\x08 vt\\x0b ff\\x0c lf\\x0a"
    assert sanitize("c1 csi\x9b2J nel\x85") == "c1 csi\\x9b2J nel\\x85"
    # Unicode line separators would split a line in str.splitlines (Rich's ANSI decoder);
    # bidi overrides would reorder what the user reads.
    assert sanitize("a\u2028b\u2029c") == "a\\u2028b\\u2029c"
    assert sanitize("evil\u202etxt.exe\u2066x\u2069") == "evil\\u202etxt.exe\\u2066x\\u2069"
    # An OSC 8 hyperlink is not SGR either.
    assert sanitize(f"{ESC}]8;;http://evil{ESC}\\click{ESC}]8;;{ESC}\\") == (
        "\\x1b]8;;http://evil\\x1b\\click\\x1b]8;;\\x1b\\")


def test_sgr_and_tab_survive():
    for keep in (f"{ESC}[31mred{ESC}[0m", f"{ESC}[1;4;38;5;196mX{ESC}[m", f"{ESC}[38:2::1:2:3mrgb",
                 "col1\tcol2", "plain text", "unicode ✓ ünï", ""):
        assert sanitize(keep) == keep
    mixed = f"{ESC}[32mok{ESC}[0m\t{ESC}]0;t\x07{ESC}[2J"
    assert sanitize(mixed) == f"{ESC}[32mok{ESC}[0m\t\\x1b]0;t\\x07\\x1b[2J"


def test_sanitized_text_holds_no_control_character_but_tab_and_sgr():
    hostile = "".join(chr(c) for c in range(0, 0xA0)) + f"{ESC}[31m{ESC}[0m" + "\u2028\u202e"
    out = sanitize(hostile)
    rest = re.sub(r"\x1b\[[0-9;:]*m", "", out)
    assert not [c for c in rest if (ord(c) < 0x20 and c != "\t") or 0x7F <= ord(c) <= 0x9F
                or c in "\u2028\u202e"]
    assert sanitize(out) == out  # idempotent: escaped text is plain text


def test_random_text_is_escaped_everywhere_but_sgr_and_coloured_lines_pass_untouched():
    rnd = random.Random(3)
    pieces = ["a", " ", ESC, "[", "3", "1", ";", ":", "m", "]", "\x07", "\r", "\t", "\u202e",
              "\x9b", "0", "[bold]"]
    for _ in range(20_000):
        s = "".join(rnd.choice(pieces) for _ in range(rnd.randrange(0, 16)))
        out = sanitize(s)
        rest = re.sub(r"\x1b\[[0-9;:]*m", "", out)
        assert not [c for c in rest if (ord(c) < 0x20 and c != "\t") or 0x7F <= ord(c) <= 0x9F
                    or c == "\u202e"], repr(s)
        assert sanitize(out) == out
        # what is neither SGR nor unsafe is kept, in order
        assert strip_sgr(out).replace("\\x1b", "").replace("\\x07", "").replace(
            "\\r", "").replace("\\u202e", "").replace("\\x9b", "") == re.sub(
            r"[\x1b\x07\r\u202e\x9b]", "", re.sub(r"\x1b\[[0-9;:]*m", "", s))
    coloured = f"epoch 1 {ESC}[32mloss=0.51{ESC}[0m\tlr 1e-3"
    assert sanitize(coloured) is coloured  # the fast path: a training log's common line


def test_strip_sgr_and_commutes_with_sanitize():
    s = f"{ESC}[1mbold{ESC}[0m and {ESC}]0;x\x07"
    assert strip_sgr(s) == f"bold and {ESC}]0;x\x07"
    assert strip_sgr(sanitize(s)) == sanitize(strip_sgr(s)) == "bold and \\x1b]0;x\\x07"
    assert strip_sgr("no escapes") == "no escapes"


def test_rich_from_ansi_keeps_colours_and_shows_the_rest_as_text():
    text = Text.from_ansi(sanitize(f"{ESC}[31mred{ESC}[0m {ESC}]0;pwned\x07 [bold]x[/bold]\rY"))
    assert "\x1b" not in text.plain and "\r" not in text.plain
    assert text.plain == "red \\x1b]0;pwned\\x07 [bold]x[/bold]\\rY"  # markup stays text
    assert [(s.start, s.end, s.style.color.number) for s in text.spans] == [(0, 3, 1)]  # red


def test_sanitize_keeps_plain_lines_and_colours_of_a_busy_log():
    # How fast is a speed goal (bench/); here, what a typical line becomes.
    for i in range(1000):
        plain = f"tick {i} rank 3 loss=0.{i}"
        assert sanitize(plain) == plain
        coloured = sanitize(f"{ESC}[32mINFO{ESC}[0m step {i}\r")
        assert Text.from_ansi(coloured).plain == f"INFO step {i}\\r"


# -- the fold ------------------------------------------------------------------------------

_ms = itertools.count(1_700_000_000_000, 7)


def ev(event_type: str, node: str = "a-1-x", **data) -> Event:
    """An event as the agent writes it and the client decodes it."""
    out = decode_event(f"{next(_ms)}-0", encode_event(event_type, node, data))
    assert out is not None
    return out


def batch(rank: int, lines: list[str], seq: int, node: str = "a-1-x", stream: str = "out",
          attempt: int = 0) -> LogBatch:
    b = LogBatch(node=node, rank=rank, local_rank=rank % 2, attempt=attempt, stream=stream,
                 seq=seq, lines=lines)
    out = decode_log_batch(f"{next(_ms)}-0", encode_log_batch(b))
    assert out is not None
    return out


TRACEBACK = 'Traceback (most recent call last):\n  File "train.py", line 3\nValueError: boom'
ERROR_FILE = {"message": {"message": "ValueError: boom",
                          "extraInfo": {"py_callstack": TRACEBACK, "timestamp": "1"}}}


def two_nodes_running(v: JobView) -> None:
    v.apply_event(ev(EventType.NODE_JOINED, "a-1-x", host="a", nproc=2))
    v.apply_event(ev(EventType.NODE_JOINED, "b-2-y", host="b", nproc=2))
    v.apply_event(ev(EventType.RENDEZVOUS_COMPLETE, "a-1-x", round=0, world_size=4,
                     nodes=[{"node": "a-1-x", "host": "a", "group_rank": 0, "nproc": 2},
                            {"node": "b-2-y", "host": "b", "group_rank": 1, "nproc": 2}]))
    v.apply_event(ev(EventType.WORKERS_STARTED, "a-1-x", ranks=[0, 1], local_ranks=[0, 1],
                     pids=[100, 101], restart_count=0, attempt=0, round=0, host="a"))
    v.apply_event(ev(EventType.WORKERS_STARTED, "b-2-y", ranks=[2, 3], local_ranks=[0, 1],
                     pids=[200, 201], restart_count=0, attempt=0, round=0, host="b"))


def test_failure_restart_and_success_follow_the_rules():
    v = JobView("j")
    assert v.state == "waiting"
    two_nodes_running(v)
    assert v.state == "running" and v.round == 0 and v.world_size == 4
    assert {n: (i.host, i.status, i.group_rank) for n, i in v.nodes.items()} == {
        "a-1-x": ("a", "joined", 0), "b-2-y": ("b", "joined", 1)}
    r2 = v.ranks[2]
    assert (r2.host, r2.node, r2.local_rank, r2.pid, r2.state, r2.restarts) == (
        "b", "b-2-y", 0, 200, "running", 0)

    v.apply_event(ev(EventType.WORKER_EXITED, "b-2-y", rank=3, local_rank=1, pid=201,
                     exit_code=1, signal=None, message="ValueError: boom",
                     error_file=ERROR_FILE, stopping=False, host="b"))
    assert v.ranks[3].state == "failed" and v.ranks[3].last_exit == 1
    for node, ranks in (("b-2-y", [2, 3]), ("a-1-x", [0, 1])):
        for r in ranks:
            if r != 3:  # the others are stopped by their agents
                v.apply_event(ev(EventType.WORKER_EXITED, node, rank=r, pid=v.ranks[r].pid,
                                 exit_code=-15, signal="SIGTERM", stopping=True))
        v.apply_event(ev(EventType.WORKERS_STOPPED, node, ranks=ranks, reason="failure"))
    assert [v.ranks[r].state for r in range(4)] == ["stopped", "stopped", "stopped", "failed"]
    assert v.ranks[0].last_exit == "SIGTERM"
    cause = {"rank": 3, "host": "b", "message": "ValueError: boom", "exit_code": 1,
             "traceback": TRACEBACK}
    v.apply_event(ev(EventType.GROUP_FAILED, "b-2-y", root_cause=cause, failures=[cause]))
    assert v.root_cause == cause
    v.apply_event(ev(EventType.RESTARTING, "b-2-y", reason="failure", restarts_used=1,
                     max_restarts=3))
    assert v.state == "restarting" and v.restarts_used == 1 and v.max_restarts == 3
    assert all(r.state == "restarting" for r in v.ranks.values())

    v.apply_event(ev(EventType.RENDEZVOUS_COMPLETE, "a-1-x", round=1, world_size=4,
                     nodes=[{"node": "a-1-x", "host": "a", "group_rank": 0},
                            {"node": "b-2-y", "host": "b", "group_rank": 1}]))
    for node, ranks, pids in (("a-1-x", [0, 1], [110, 111]), ("b-2-y", [2, 3], [210, 211])):
        v.apply_event(ev(EventType.WORKERS_STARTED, node, ranks=ranks, local_ranks=[0, 1],
                         pids=pids, restart_count=1, attempt=1, round=1))
    assert v.state == "running" and v.round == 1
    assert [(r.state, r.restarts, r.pid) for r in v.ranks.values()] == [
        ("running", 1, 110), ("running", 1, 111), ("running", 1, 210), ("running", 1, 211)]
    assert v.ranks[3].last_exit == 1  # the last exit stays visible after the restart
    for r in range(4):
        v.apply_event(ev(EventType.WORKER_EXITED, "a-1-x" if r < 2 else "b-2-y", rank=r,
                         pid=v.ranks[r].pid, exit_code=0, signal=None, stopping=False))
    assert {r.state for r in v.ranks.values()} == {"exited"}
    v.apply_event(ev(EventType.JOB_SUCCEEDED, "a-1-x", restarts_used=1))
    assert v.state == "succeeded" and v.is_final

    kinds = [t.kind for t in v.timeline]
    assert kinds == ["node", "node", "rendezvous", "failure", "group_failed", "restart",
                     "rendezvous", "job"]
    failure = v.timeline[3]
    assert "rank 3 failed on b: ValueError: boom" in failure.text
    assert failure.detail == TRACEBACK
    assert v.timeline[4].detail == TRACEBACK and "rank 3 on b" in v.timeline[4].text
    assert "restarting (failure): 1/3" in v.timeline[5].text
    assert v.timeline[0].server_ms < v.timeline[-1].server_ms


def test_signal_exit_is_a_failure_and_a_stale_exit_changes_nothing():
    v = JobView("j")
    two_nodes_running(v)
    v.apply_event(ev(EventType.WORKER_EXITED, "a-1-x", rank=0, pid=100, exit_code=-9,
                     signal="SIGKILL", message="Signal 9 (SIGKILL)", stopping=False))
    assert v.ranks[0].state == "failed" and v.ranks[0].last_exit == "SIGKILL"
    v.apply_event(ev(EventType.WORKERS_STOPPED, "a-1-x", ranks=[0, 1], reason="failure"))
    assert v.ranks[0].state == "failed" and v.ranks[1].state == "stopped"
    # An exit of an older pid of rank 2 (stale) does not touch the running rank.
    v.apply_event(ev(EventType.WORKER_EXITED, "b-2-y", rank=2, pid=99, exit_code=3,
                     signal=None, stopping=False))
    assert v.ranks[2].state == "running" and v.ranks[2].last_exit is None


def test_membership_lost_left_joined_and_shrinking_world():
    v = JobView("j")
    two_nodes_running(v)
    v.apply_event(ev(EventType.NODE_JOINED, "c-3-z", host="c"))
    assert set(v.active_nodes()) == {"a-1-x", "b-2-y"}  # c is in no completed round
    v.apply_event(ev(EventType.NODE_LOST, "a-1-x", lost_node="b-2-y", host="b",
                     last_heartbeat_ms=1))
    assert v.nodes["b-2-y"].status == "lost"
    assert v.active_nodes() == {"a-1-x": "a"}
    v.apply_event(ev(EventType.NODE_LEFT, "c-3-z", host="c", reason="signal SIGTERM"))
    assert v.nodes["c-3-z"].status == "left"
    v.apply_event(ev(EventType.RESTARTING, "a-1-x", reason="membership", restarts_used=0,
                     max_restarts=3))
    v.apply_event(ev(EventType.RENDEZVOUS_COMPLETE, "a-1-x", round=1, world_size=2,
                     nodes=[{"node": "a-1-x", "host": "a", "group_rank": 0}]))
    assert v.world_size == 2 and sorted(v.ranks) == [0, 1]  # ranks 2 and 3 no longer exist
    assert v.nodes["b-2-y"].group_rank is None and v.nodes["a-1-x"].group_rank == 0
    texts = [t.text for t in v.timeline]
    assert any("node b lost" in t for t in texts)
    assert any("node c left: signal SIGTERM" in t for t in texts)
    assert any("restarting (membership)" in t for t in texts)


def test_before_any_round_active_nodes_are_the_joined_ones():
    v = JobView("j")
    v.apply_event(ev(EventType.NODE_JOINED, "a-1-x", host="a"))
    v.apply_event(ev(EventType.NODE_JOINED, "b-2-y", host="b"))
    v.apply_event(ev(EventType.NODE_LEFT, "b-2-y", host="b", reason="x"))
    assert v.state == "waiting" and v.active_nodes() == {"a-1-x": "a"}


def test_command_acks_and_stop():
    v = JobView("j")
    two_nodes_running(v)
    v.apply_event(ev(EventType.COMMAND_ACK, "a-1-x", command_id="c-1", status="accepted",
                     reason="stop from me@x", host="a"))
    dup = ev(EventType.COMMAND_ACK, "a-1-x", command_id="c-1", status="accepted",
             reason="stop from me@x", host="a")
    v.apply_event(dup)
    v.apply_event(ev(EventType.COMMAND_ACK, "b-2-y", command_id="c-1", status="rejected",
                     reason="busy", host="b"))
    assert v.acks_for("c-1") == [("a-1-x", "accepted", "stop from me@x"),
                                 ("b-2-y", "rejected", "busy")]
    assert v.acks_for("c-unknown") == []
    v.apply_event(ev(EventType.JOB_STOPPED, "a-1-x", command_id="c-1", issuer="me@x"))
    assert v.state == "stopped"
    acks = [t for t in v.timeline if t.kind == "ack"]
    assert [t.text for t in acks] == ["command c-1 accepted by a: stop from me@x",
                                      "command c-1 rejected by b: busy"]
    assert "job stopped by me@x (command c-1)" in v.timeline[-1].text


def test_job_failed_is_final_and_sticky():
    v = JobView("j")
    two_nodes_running(v)
    cause = {"rank": 1, "host": "a", "message": "exit code 3", "exit_code": 3}
    v.apply_event(ev(EventType.JOB_FAILED, "a-1-x", root_cause=cause, restarts_used=3,
                     max_restarts=3))
    assert (v.state, v.root_cause, v.restarts_used) == ("failed", cause, 3)
    v.apply_event(ev(EventType.WORKERS_STARTED, "b-2-y", ranks=[2], pids=[5], restart_count=3))
    v.apply_event(ev(EventType.RESTARTING, "b-2-y", reason="failure", restarts_used=3))
    assert v.state == "failed"
    assert "job failed after 3 restarts: rank 1 on a: exit code 3" in next(
        t.text for t in v.timeline if t.kind == "job")


def test_meta_resources_and_connection():
    v = JobView("j")
    v.apply_meta({b"min_nodes": b"1", b"max_nodes": b"4", "max_restarts": "3",
                  "created_ms": "1700000000000", "restarts_used": "2"})
    assert (v.min_nodes, v.max_nodes, v.max_restarts, v.created_ms, v.restarts_used) == (
        1, 4, 3, 1_700_000_000_000, 2)
    two_nodes_running(v)
    for i in range(RESOURCE_HISTORY + 30):
        v.apply_resources({0: {"cpu": float(i), "rss": 1000 + i, "threads": 4, "ts": i},
                           "1": {"cpu": 1.0, "rss": 5, "threads": 2, "ts": 0}})
    r0, r1 = v.ranks[0], v.ranks[1]
    assert (r0.cpu, r0.rss, r0.threads) == (float(RESOURCE_HISTORY + 29), 1000 + RESOURCE_HISTORY + 29, 4)
    assert len(r0.cpu_history) == RESOURCE_HISTORY and len(r0.rss_history) == RESOURCE_HISTORY
    assert len(r1.cpu_history) == 1, "the same sample (same ts) is not history twice"
    v.apply_resources({99: {"cpu": 1, "ts": 1}})  # a rank beyond the world: left-over sample
    assert 99 not in v.ranks
    before = v.version
    v.set_connection(True, "redis://x:***@h:6379")
    assert v.connected and v.endpoint == "redis://x:***@h:6379" and v.version == before + 1
    v.set_connection(True, "redis://x:***@h:6379")
    assert v.version == before + 1  # no change, no redraw
    v.apply(ConnectionChange(False, "cannot reach Redis\x1b[2J"))
    assert not v.connected and v.connection_error == "cannot reach Redis\\x1b[2J"
    v.apply_meta({"final_state": "succeeded"})  # events trimmed away: meta still knows
    assert v.state == "succeeded"


def test_malformed_and_unknown_records_are_ignored():
    v = JobView("j")
    two_nodes_running(v)
    before = {r: (s.state, s.pid) for r, s in v.ranks.items()}
    bad: list[object] = [
        Event("some_future_type", "a-1-x", {"x": 1}, "1-0"),
        Event(EventType.WORKERS_STARTED, "a-1-x", ["not", "a", "dict"], "2-0"),  # type: ignore[arg-type]
        Event(EventType.WORKER_EXITED, "a-1-x", {"exit_code": 3}, "3-0"),
        Event(EventType.WORKERS_STARTED, "a-1-x", {"ranks": "abc", "pids": 7}, "4-0"),
        Event(EventType.RENDEZVOUS_COMPLETE, "a-1-x", {"nodes": [1, None, {"node": 5}],
                                                       "world_size": "many"}, "5-0"),
        Event(EventType.NODE_LOST, "a-1-x", {"lost_node": None}, "6-0"),
        Event(EventType.COMMAND_ACK, "a-1-x", {"command_id": ["x"]}, "7-0"),
        Event(EventType.RESTARTING, "a-1-x", {"restarts_used": {"x": 1}}, ""),
        Event(EventType.GROUP_FAILED, "a-1-x", {"root_cause": "text"}, "bad-id"),
        Event(EventType.LOGS_DROPPED, "a-1-x", {"count": "lots"}, "8-0"),
        "not an event", None, 42,
    ]
    for rec in bad:
        v.apply_event(rec)  # type: ignore[arg-type]
        v.apply(rec)
    v.apply_logs(LogBatch("n", "zero", 0, 0, "out", 1, ["x"]))  # type: ignore[arg-type]
    v.apply_logs(LogBatch("n", 0, 0, 0, "out", 1, "not a list"))  # type: ignore[arg-type]
    v.apply_logs("junk")  # type: ignore[arg-type]
    v.apply_resources({"x": {"cpu": 1}, 1: "nope", 2: {"cpu": "hot", "rss": None}})
    v.apply_resources(None)  # type: ignore[arg-type]
    v.apply_meta({"min_nodes": "few", "max_nodes": None})
    v.apply_meta(None)  # type: ignore[arg-type]
    assert decode_event("1-0", {"v": "1", "type": "node_joined", "data": "{oops"}) is None
    assert v.ignored > 10
    assert v.state in ("running", "restarting")
    assert {r: v.ranks[r].pid for r in before} == {r: p for r, (_, p) in before.items()}
    assert v.min_nodes is None and v.world_size == 4


def test_logs_dedupe_scrollback_bounds_and_versions():
    v = JobView("j", scrollback=100, all_scrollback=250)
    two_nodes_running(v)
    b = batch(0, ["first", "second"], seq=1)
    v0 = v.version
    v.apply_logs(b)
    assert v.version == v0 + 1
    v.apply_logs(b)  # the same entry written twice by a retried XADD
    v.apply_logs(batch(0, ["first", "second"], seq=1))  # same key, other stream id
    assert [LogLine._make(line).text for line in v.logs_for(0)] == ["first", "second"]
    assert v.version == v0 + 1 and v.lines_total == 2
    # Other stream / attempt / node with the same seq are different batches.
    v.apply_logs(batch(0, ["err line"], seq=1, stream="err"))
    v.apply_logs(batch(0, ["next attempt"], seq=1, attempt=1))
    assert len(v.logs_for(0)) == 4
    # Bounded memory: 3 ranks x 2000 batches x 5 lines.
    seq = itertools.count(2)
    for i in range(2000):
        for rank in (0, 1, 2):
            v.apply_logs(batch(rank, [f"r{rank} l{i}.{k}" for k in range(5)], seq=next(seq)))
    assert all(len(v.logs_for(r)) == 100 for r in (0, 1, 2))
    assert len(v.all_logs) == 250 and v.lines_total == 4 + 3 * 2000 * 5
    assert LogLine._make(v.logs_for(2)[-1]).text == "r2 l1999.4"
    assert [(rank, text) for _, rank, _, text in v.tail(3)] == [
        (2, "r2 l1999.2"), (2, "r2 l1999.3"), (2, "r2 l1999.4")]
    assert [text for *_, text in v.tail(2, rank=1)] == ["r1 l1999.3", "r1 l1999.4"]
    assert v.tail(1, rank=0, stream="err") == []  # pushed out of rank 0's scrollback
    assert v.ranks[2].last_line_ms == LogLine._make(v.logs_for(2)[-1]).server_ms > 0


def test_log_text_is_sanitized_on_the_way_in_and_lines_can_precede_workers_started():
    v = JobView("j")
    v.apply_logs(batch(5, [f"{ESC}]0;pwned\x07 {ESC}[31mred{ESC}[0m"], seq=1, node="h-9-q"))
    line = LogLine._make(v.logs_for(5)[0])
    assert line.text == f"\\x1b]0;pwned\\x07 {ESC}[31mred{ESC}[0m" and line.stream == "out"
    assert v.ranks[5].node == "h-9-q" and v.ranks[5].host == "h"
    v.apply_event(ev(EventType.WORKERS_STARTED, "h-9-q", ranks=[5], local_ranks=[1], pids=[9],
                     restart_count=0, host="h\x1b[2J"))
    assert v.ranks[5].restarts == 0 and v.ranks[5].host == "h\\x1b[2J"


def seq_ev(event_type: str, node: str, seq: int, **data) -> Event:
    out = decode_event(f"{next(_ms)}-0", encode_event(event_type, node, data, seq))
    assert out is not None and out.seq == seq
    return out


def test_duplicate_events_are_folded_once():
    v = JobView("j")
    two_nodes_running(v)
    started = seq_ev(EventType.WORKERS_STARTED, "a-1-x", 7, ranks=[0, 1], local_ranks=[0, 1],
                     pids=[300, 301], restart_count=0)
    v.apply_event(started)
    version = v.version
    # The same entry written twice by a retried XADD: same (node, seq), its own stream id.
    v.apply_event(seq_ev(started.type, started.node, 7, **started.data))
    assert v.ranks[0].restarts == 1 and v.version == version
    # Same content, other seq: two real events. Order does not matter.
    v.apply_event(seq_ev(EventType.LOGS_DROPPED, "a-1-x", 9, count=10))
    v.apply_event(seq_ev(EventType.LOGS_DROPPED, "a-1-x", 8, count=10))
    v.apply_event(seq_ev(EventType.LOGS_DROPPED, "b-2-y", 9, count=1))  # other node, same seq
    assert v.lines_dropped == 21
    # Without seq (older writers): identical content from the same node is a repeat...
    v.apply_event(ev(EventType.WORKERS_STARTED, "b-2-y", ranks=[2], pids=[400]))
    v.apply_event(ev(EventType.WORKERS_STARTED, "b-2-y", ranks=[2], pids=[400]))
    assert v.ranks[2].restarts == 1
    # ...except logs_dropped markers, which repeat legitimately.
    for _ in range(2):
        v.apply_event(ev(EventType.LOGS_DROPPED, "a-1-x", count=10))
    assert v.lines_dropped == 41


def test_membership_restart_detail_is_in_the_timeline():
    v = JobView("j")
    v.apply_event(ev(EventType.RESTARTING, "a-1-x", reason="membership", restarts_used=0,
                     max_restarts=3, detail="membership changed (lost: b-2-y)"))
    assert v.timeline[-1].text == ("restarting (membership): 0/3 restarts used: "
                                   "membership changed (lost: b-2-y)")


def test_apply_logs_folds_1024_ranks():
    # How fast is a speed goal (bench/); here, that every line lands where it belongs.
    v = JobView("j", scrollback=1000)
    lines = [f"step {k} loss 0.{k}" for k in range(25)]
    batches = [batch(r, lines, seq=s) for s in range(1, 5) for r in range(1024)]
    for b in batches:
        v.apply_logs(b)
    assert v.lines_total == 1024 * 4 * 25
    assert all(len(v.logs_for(r)) == 4 * 25 for r in (0, 511, 1023))


def test_logs_live_in_ring_buffers_of_plain_tuples():
    v = JobView("j", scrollback=3, all_scrollback=5)
    assert v.scrollback == 3 and v.all_scrollback == 5
    assert JobView("k", scrollback=10, all_scrollback=4).all_scrollback == 10  # >= one rank
    ring = v.buffer_for(7)  # before rank 7 printed: a view can point at it already
    assert isinstance(ring, PackedLogBuffer) and len(ring) == 0 and v.buffer_for(7) is ring
    v.apply_logs(batch(7, ["a", "b", "c", "d"], seq=1))
    v.apply_logs(batch(1, ["x", "y"], seq=1))
    assert [t for *_, t in ring] == ["b", "c", "d"] and ring.total_appended == 4
    assert [t for *_, t in v.all_logs] == ["b", "c", "d", "x", "y"] and v.lines_total == 6
    line = v.all_logs[-1]
    assert type(line) is tuple and LogLine._make(line).rank == 1  # plain tuple, LogLine fields
    assert v.all_logs[-1] is v.logs_for(1)[-1]  # the same object in both rings
    assert len(v.logs_for(99)) == 0 and 99 not in v.logs  # asking does not create


def test_timeline_total_counts_past_the_limit():
    v = JobView("j", timeline_limit=3)
    for i in range(5):
        v.apply_event(ev(EventType.NODE_JOINED, f"n{i}-1-x", host=f"h{i}"))
    assert len(v.timeline) == 3 and v.timeline_total == 5
    v.add_note(123, "command", "restart command c-1 sent")
    assert v.timeline[-1][:3] == (123, "command", "restart command c-1 sent")
    v.add_note(124, "command", "evil \x1b]0;x\x07", "tb \x1b[2J")
    assert v.timeline[-1].text == "evil \\x1b]0;x\\x07" and v.timeline[-1].detail == "tb \\x1b[2J"
    assert v.timeline_total == 7


def test_log_batch_decodes_alike_from_bytes_and_str_replies():
    """The console reads raw bytes replies (a fast path): same batch as the str decoding, and
    malformed entries are dropped, not raised."""
    b = LogBatch(node="nöde-1", rank=37, local_rank=5, attempt=2, stream="err", seq=9,
                 lines=["a \x1b[31mred\x1b[0m line", "", "ünïcode"])
    fields = encode_log_batch(b)
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    from_str = decode_log_batch("1700000000123-0", fields)
    assert from_str is not None and from_str.lines == b.lines and from_str.rank == 37
    assert decode_log_batch(b"1700000000123-0", raw) == from_str
    assert decode_log_batch("1-0", {**raw, b"lines": b"\xffok"}).lines == ["\ufffdok"]
    for broken in ({**raw, b"rank": b"x"}, {**raw, b"s": b"tty"},
                   {k: v for k, v in raw.items() if k != b"node"}, {**raw, b"seq": b""}):
        assert decode_log_batch("1-0", broken) is None


def _mixed_records(rnd: random.Random) -> list[object]:
    """Records as a reader meets them: events, every rank's lines (ranks 4 and 5 are outside
    the world of 4), repeats of retried batches, lines redrawn in place, hostile text."""
    out: list[object] = []
    seqs: dict[tuple[int, str], int] = {}
    for i in range(1500):
        roll = rnd.random()
        if roll < 0.02:
            out.append(ev(EventType.WORKER_EXITED, "a-1-x", rank=rnd.randrange(4), pid=1,
                          exit_code=1, signal=None, message="boom", stopping=False))
            continue
        if roll < 0.06 and out and isinstance(out[-1], LogBatch):
            out.append(out[-1])  # a retried XADD's second copy
            continue
        rank, stream = rnd.randrange(6), rnd.choice(["out", "err"])
        seq = seqs[(rank, stream)] = seqs.get((rank, stream), 0) + 1
        texts = [rnd.choice(["step", f"loss {i}", f"{ESC}[32mok{ESC}[0m", f"{ESC}]0;t\x07x",
                             "bar 10%\r", ""]) for _ in range(rnd.choice([1, 1, 1, 2, 5]))]
        b = batch(rank, texts, seq, node="a-1-x" if rank < 2 else "b-2-y", stream=stream)
        if rnd.random() < 0.4 and out and isinstance(out[-1], LogBatch):
            b = b._replace(id=out[-1].id)  # batches of one node entry share its id
        out.append(b._replace(live=rnd.random() < 0.15))
    return out


def test_apply_many_folds_exactly_what_apply_folds():
    """The reader's fast fold (inline, one extend of the interleaved ring per run of batches)
    leaves the view exactly as record-by-record apply does, in slices of any size."""
    for seed in range(6):
        rnd = random.Random(seed)
        one, many = JobView("j", scrollback=40, all_scrollback=300), JobView(
            "j", scrollback=40, all_scrollback=300)
        two_nodes_running(one)
        two_nodes_running(many)
        records = _mixed_records(rnd)
        newest = 0
        for rec in records:
            one.apply(rec)
        i = 0
        while i < len(records):
            n = rnd.choice([1, 3, 50, 400])
            newest = max(newest, many.apply_many(records[i:i + n]))
            i += n
        assert newest == max(r.server_ms for r in records)
        assert list(many.all_logs) == list(one.all_logs)
        assert many.lines_total == one.lines_total
        assert sorted(many.logs) == sorted(one.logs)
        for rank in one.logs:
            assert list(many.logs[rank]) == list(one.logs[rank]), rank
        assert {r: (s.state, s.last_line_ms) for r, s in many.ranks.items()} == {
            r: (s.state, s.last_line_ms) for r, s in one.ranks.items()}
        assert many.ignored == one.ignored
        assert any("\\x1b]0;t" in line[3] for line in many.all_logs)  # escaped, not raw


def test_apply_many_counts_a_change_and_drops_repeats():
    v = JobView("j")
    two_nodes_running(v)
    first = batch(1, ["hello"], 1)
    v.apply(first)
    before = v.version
    assert v.apply_many([first, first]) == 0  # repeats only: nothing new, no change
    assert v.version == before and v.lines_total == 1
    nxt = batch(1, ["again"], 2)
    assert v.apply_many([nxt, nxt]) == nxt.server_ms
    assert v.version > before and [line[3] for line in v.logs[1]] == ["hello", "again"]
