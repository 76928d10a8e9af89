"""Stacks of ranks (issue 13), the pure half: faulthandler text parsed, identical stacks
grouped with the odd ones first, rank ranges, the wire record of a reply, the stack signal.
Hostile text (anything a worker or anyone who can write the job's keys can produce) never
raises and stays bounded."""

from __future__ import annotations

import faulthandler
import signal
import sys
import tempfile
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_agent.coordination.wire import command_records, protocol, trace_records
from elastic_agent.coordination.wire.stack_dumps import (
    MAX_FRAMES,
    MAX_THREADS,
    Frame,
    RankStack,
    ThreadStack,
    format_ranks,
    group_line,
    group_record,
    group_stacks,
    parse_faulthandler,
    render_faulthandler,
    summarize,
)
from elastic_agent.coordination.wire.stack_replies import rank_stack
from elastic_agent.supervision.diagnosis.stacks import parse_stack_signal
from tests.reach import Reach


def real_dump() -> str:
    """faulthandler's own text for this process: this thread inside ``outer -> inner``, and
    one more thread parked in ``parked``."""
    ready, release = threading.Event(), threading.Event()

    def parked() -> None:
        ready.set()
        release.wait(30)

    t = threading.Thread(target=parked, daemon=True)
    t.start()
    ready.wait(30)

    def inner() -> str:
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return f.read()

    def outer() -> str:
        return inner()

    try:
        return outer()
    finally:
        release.set()
        t.join(30)


def test_parses_faulthandlers_own_text() -> None:
    threads = parse_faulthandler(real_dump())
    assert len(threads) >= 2
    current = [t for t in threads if t.current]
    assert len(current) == 1
    names = [f.function for f in current[0].frames]
    assert names[:2] == ["inner", "outer"], names
    assert current[0].frames[0].file == __file__ and current[0].frames[0].line > 0
    assert current[0].thread_id.startswith("0x")
    others = [t for t in threads if not t.current]
    assert any(f.function == "parked" for t in others for f in t.frames)


def test_render_is_parses_inverse_on_real_text() -> None:
    threads = parse_faulthandler(real_dump())
    assert parse_faulthandler(render_faulthandler(threads)) == threads


def test_garbage_and_truncation_are_tolerated() -> None:
    text = ("noise\nThread 0x1 (most recent call first):\n"
            '  File "a.py", line 3 in f\n'
            '  File "b.py", line ??? in g\n'
            "  ...\n\n"
            "Current thread 0x2 (most recent call first):\n"
            '  File "c.py", line 9 in h\n'
            '  File "d.py", li')  # cut mid-line, as a full pipe or a dead rank would leave it
    t1, t2 = parse_faulthandler(text)
    assert t1 == ThreadStack("0x1", False, (Frame("a.py", 3, "f"), Frame("b.py", 0, "g")))
    assert t2 == ThreadStack("0x2", True, (Frame("c.py", 9, "h"),))
    assert parse_faulthandler("") == ()
    assert parse_faulthandler("\x1b]0;x\x07\n" * 10) == ()


def test_counts_are_bounded() -> None:
    many_threads = "".join(f"Thread 0x{i:x} (most recent call first):\n" for i in range(5000))
    assert len(parse_faulthandler(many_threads)) == MAX_THREADS
    deep = "Stack (most recent call first):\n" + '  File "x", line 1 in f\n' * 5000
    (t,) = parse_faulthandler(deep)
    assert len(t.frames) == MAX_FRAMES
    long = 'Stack (most recent call first):\n  File "' + "a" * 10**6 + '", line 1 in f\n'
    (t,) = parse_faulthandler(long)
    assert all(len(f.file) <= 1024 for f in t.frames)


def test_any_text_parses_without_raising() -> None:
    reach = Reach("any_text_parses")

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(hostile_dumps)
    def prop(text: str) -> None:
        reach.example()
        threads = parse_faulthandler(text)
        reach.hit("a thread", threads)
        reach.hit("a frame", any(t.frames for t in threads))
        assert len(threads) <= MAX_THREADS
        for t in threads:
            assert len(t.frames) <= MAX_FRAMES

    prop()
    reach.check(**{"a thread": 0.35, "a frame": 0.3})


_names = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126,
                                        blacklist_characters='"'), min_size=1, max_size=40)
_frames = st.builds(Frame, _names, st.integers(0, 10**6), _names.filter(lambda s: s.strip() == s))
_threads = st.builds(ThreadStack, st.from_regex(r"0x[0-9a-f]{1,16}", fullmatch=True),
                     st.booleans(), st.tuples(_frames, _frames) | st.tuples(_frames))


# Hostile text that is mostly faulthandler's: a rendered dump, then cut, spliced with noise
# or pieces of its own syntax (what a dying rank, a full pipe or a forger leaves); and noise.
_noise = st.text(max_size=20) | st.sampled_from([
    "\n", "\x00", "\x1b]0;x\x07", "\ufffd", " line ???", '  File "', " in ", "Thread 0x",
    "Current thread 0x1 (most recent call first):\n", "  ...\n", '  File "a.py", line 9 in f\n'])


@st.composite
def _mutated_dump(draw: st.DrawFn) -> str:
    text = render_faulthandler(draw(st.lists(_threads, min_size=1, max_size=4)))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(text)))
        how = draw(st.sampled_from(["cut", "insert", "replace"]))
        if how == "cut":
            text = text[:i]
        else:
            j = i if how == "insert" else draw(st.integers(i, min(len(text), i + 40)))
            text = text[:i] + draw(_noise) + text[j:]
    return text


hostile_dumps = _mutated_dump() | st.text(max_size=3000)

_REPLY_FIELDS = [b"v", b"request", b"rank", b"text", b"pid", b"node", b"host", b"error",
                 b"truncated"]
_replies = st.builds(trace_records.StackReply, st.from_regex(r"[a-z0-9][a-z0-9:.-]{0,20}",
                                                        fullmatch=True),
                     _names, _names, st.integers(0, 40_000), st.integers(1, 1 << 22),
                     _mutated_dump(), st.just("") | st.just("") | _names)


@st.composite
def _mutated_reply(draw: st.DrawFn) -> dict[bytes, bytes]:
    """A valid reply's fields, then up to two replaced by hostile bytes, dropped or added."""
    fields = {k.encode(): v.encode() for k, v in
              trace_records.encode_stack_reply(draw(_replies)).items()}
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(_REPLY_FIELDS) | st.binary(max_size=6))
        if draw(st.booleans()):
            fields.pop(key, None)
        else:
            fields[key] = draw(st.binary(max_size=50) | st.sampled_from(
                [b"-1", b"True", b"9" * 40, b"1", b"0", b"", b"\xff\xfe", b"a b"]))
    return fields


hostile_replies = _mutated_reply() | st.dictionaries(
    st.binary(max_size=10) | st.sampled_from(_REPLY_FIELDS), st.binary(max_size=50))


@settings(max_examples=200, deadline=None)
@given(st.lists(_threads, max_size=5))
def test_render_parse_round_trip(threads: list[ThreadStack]) -> None:
    assert parse_faulthandler(render_faulthandler(threads)) == tuple(threads)


def stack(rank: int, *functions: str, host: str = "h", tid: str = "0x1",
          error: str = "") -> RankStack:
    if error:
        return RankStack(rank, "n", host, 100 + rank, (), error)
    frames = tuple(Frame("t.py", i + 1, f) for i, f in enumerate(functions))
    return RankStack(rank, "n", host, 100 + rank, (ThreadStack(tid, True, frames),))


def test_groups_identical_stacks_odd_ones_first() -> None:
    waiting = ("all_reduce", "wrapper", "train_step", "main", "<module>")
    stacks = [stack(r, *waiting, tid=f"0x{r}", host=f"h{r // 4}") for r in range(64) if r != 5]
    stacks.append(stack(5, "stall", "train_step", "main", "<module>", host="h1"))
    stacks.append(stack(5, "duplicate reply", host="h1"))  # a retried XADD: counted once
    groups = group_stacks(stacks)
    assert [g.ranks for g in groups] == [(5,), tuple(r for r in range(64) if r != 5)]
    assert groups[0].hosts == ("h1",)
    assert groups[1].hosts == tuple(sorted(f"h{i}" for i in range(16)))
    # the decorator frame says nothing of where a rank is: the summary skips it
    assert group_line(groups[1]) == "63 ranks [0-4,6-63]: all_reduce \u2190 train_step \u2190 main"
    assert group_line(groups[0]) == "1 rank [5]: stall \u2190 train_step \u2190 main"


def test_group_ties_lowest_rank_first_and_errors_group_by_text() -> None:
    stacks = [stack(7, "a"), stack(2, "b"), stack(4, error="no answer within 2 s"),
              stack(1, error="no answer within 2 s"), stack(3, error="worker not running")]
    groups = group_stacks(stacks)
    assert [g.ranks for g in groups] == [(2,), (3,), (7,), (1, 4)]
    assert groups[3].summary == "no answer within 2 s" and groups[3].threads == ()


def test_thread_order_and_ids_do_not_split_a_group() -> None:
    a = ThreadStack("0xa", False, (Frame("x.py", 1, "loader"),))
    b = ThreadStack("0xb", True, (Frame("x.py", 2, "main"), Frame("x.py", 3, "<module>")))
    b2 = ThreadStack("0xc", False, b.frames)
    one = RankStack(0, "n", "h", 1, (a, b))
    two = RankStack(1, "n", "h", 2, (b2, ThreadStack("0xd", True, a.frames)))
    (group,) = group_stacks([one, two])
    assert group.ranks == (0, 1)
    # the summary names the program's main thread (outermost frame <module>)
    assert group.summary == "main \u2190 <module>"
    assert group_record(group)["frames"] == [["x.py", 2, "main"], ["x.py", 3, "<module>"]]


def test_summary_without_frames() -> None:
    assert summarize(()) == "no Python frames"
    assert summarize((ThreadStack("0x1", True, ()),)) == "no Python frame"


@pytest.mark.parametrize(("ranks", "text"), [
    ([], ""), ([3], "3"), ([0, 1, 2, 3, 4, 6, 7], "0-4,6-7"), ([9, 1, 2, 2, 5], "1-2,5,9"),
    ([*range(5), *range(6, 64)], "0-4,6-63")])
def test_format_ranks(ranks: list[int], text: str) -> None:
    assert format_ranks(ranks) == text


@given(st.sets(st.integers(0, 300)))
def test_format_ranks_is_exact(ranks: set[int]) -> None:
    back: set[int] = set()
    for part in filter(None, format_ranks(ranks).split(",")):
        lo, _, hi = part.partition("-")
        back.update(range(int(lo), int(hi or lo) + 1))
    assert back == ranks


# -- the wire record -----------------------------------------------------------------------

def test_stack_reply_round_trip_and_cap() -> None:
    reply = trace_records.StackReply("c-1a", "node-1", "host", 5, 1234, real_dump())
    back = trace_records.decode_stack_reply("1-0", trace_records.encode_stack_reply(reply))
    assert back is not None and (back.rank, back.pid, back.text) == (5, 1234, reply.text)
    assert not back.truncated and rank_stack(back).threads == parse_faulthandler(reply.text)
    big = trace_records.StackReply("c-1a", "n", "h", 0, 1, "x" * (trace_records.MAX_STACK_TEXT_BYTES * 2))
    fields = trace_records.encode_stack_reply(big)
    assert len(fields["text"]) == trace_records.MAX_STACK_TEXT_BYTES and fields["truncated"] == "1"
    as_bytes = {k.encode(): v.encode() for k, v in fields.items()}
    assert trace_records.decode_stack_reply(b"1-0", as_bytes).truncated
    err = trace_records.decode_stack_reply("1-0", trace_records.encode_stack_reply(
        trace_records.StackReply("stop-3", "n", "h", 2, 0, "", error="worker not running")))
    assert rank_stack(err).error == "worker not running"


@pytest.mark.parametrize("change", [
    {"rank": "True"}, {"rank": "-1"}, {"rank": "9" * 40}, {"v": "9"}, {"request": "a b"},
    {"request": "{x}"}, {"pid": "-5"}, {"text": "x" * (trace_records.MAX_STACK_TEXT_BYTES + 10)},
    {"node": "n" * 1000}])
def test_malformed_replies_are_skipped(change: dict[str, str]) -> None:
    fields = trace_records.encode_stack_reply(trace_records.StackReply("c-1", "n", "h", 1, 2, "t"))
    assert trace_records.decode_stack_reply("1-0", {**fields, **change}) is None


def test_any_entry_decodes_without_raising() -> None:
    reach = Reach("any_reply_decodes")

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(hostile_replies)
    def prop(fields: dict[bytes, bytes]) -> None:
        reach.example()
        reply = trace_records.decode_stack_reply(b"1-0", fields)
        reach.hit("decoded", reply is not None)
        if reply is not None:
            parsed = rank_stack(reply)
            reach.hit("decoded with a thread", parsed.threads)
            assert protocol.is_rank(reply.rank) and parsed is not None

    prop()
    reach.check(**{"decoded": 0.35, "decoded with a thread": 0.2})


def test_stacks_command_is_read_only_and_checked() -> None:
    def cmd(cid: str, args: str) -> command_records.Command | str:
        return command_records.decode_command("1-0", {"v": "1", "id": cid, "type": "stacks",
                                               "issuer": "u@h", "args": args})
    ok = cmd("c-12ab", "{}")
    assert isinstance(ok, command_records.Command) and ok.type == command_records.CommandType.STACKS
    assert isinstance(cmd("c-12ab", '{"rank": 3}'), command_records.Command)
    assert isinstance(cmd("c-12ab", '{"rank": true}'), str)
    assert isinstance(cmd("c-12ab", '{"rank": -2}'), str)
    assert isinstance(cmd("bad id{}", "{}"), str)  # replies could not name it


# -- the signal ----------------------------------------------------------------------------

def test_stack_signal_is_a_free_real_time_signal() -> None:
    assert parse_stack_signal("SIGRTMIN+4") == signal.SIGRTMIN + 4
    assert parse_stack_signal("rtmax-2") == signal.SIGRTMAX - 2
    assert parse_stack_signal(str(int(signal.SIGRTMIN) + 1)) == signal.SIGRTMIN + 1
    assert parse_stack_signal("off") is None
    for bad in ("SIGTERM", "15", "SIGUSR1", "10", "12", "SIGRTMIN+40", "9", "x", "-3"):
        with pytest.raises(ValueError):
            parse_stack_signal(bad)


def test_reserved_signals_are_never_the_default() -> None:
    from elastic_agent.supervision.diagnosis.stacks import RESERVED
    from elastic_agent.supervision.launch.probes import DEFAULT_SIGNAL
    assert DEFAULT_SIGNAL not in RESERVED and sys.platform.startswith("linux")
