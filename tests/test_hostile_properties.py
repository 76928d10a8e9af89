"""Property-based: random and adversarial records fed to every decoder, to the console's fold,
to the terminal policy, and through a real redis-server to a live agent and the CLI."""

from __future__ import annotations

import contextlib
import json
import re
import string

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from elastic_agent.coordination.wire import text as text_module
from elastic_agent.coordination.wire.command_records import (
    Command,
    CommandType,
    decode_command,
    encode_command,
)
from elastic_agent.coordination.wire.event_records import Event, EventType, decode_event, encode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import (
    LogBatch,
    LogEntryDecoder,
    decode_log_batch,
    decode_log_entries,
    decode_log_entry,
    encode_log_batch,
    encode_node_log_entry,
)
from elastic_agent.coordination.wire.protocol import ProtocolError
from elastic_agent.coordination.wire.round_records import NodeDescription, RoundInfo
from elastic_agent.coordination.wire.text import sanitize, terminal_line
from elastic_console.job.state import JobView
from tests.agents import SCRIPTS, Agent, wait_until
from tests.reach import Reach
from tests.test_agent import FAST, agent_args, of_type, worker_pids
from tests.test_hostile_records import _console

FIELD_NAMES = ["v", "type", "node", "seq", "data", "id", "issuer", "target", "args", "rank",
               "lrank", "attempt", "s", "lines"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20)
hostile_text = st.sampled_from([
    "[" * 3000 + "]" * 3000, "[" * 100_000, '{"a":' * 200 + "1" + "}" * 200, "\x1b]0;PWNED\x07",
    "\x1b[2J\x1b[H", "1" * 5000, "-1", "true", "NaN", "", "\x00\xff", "\u202e", "2", "99999999"])
values = (st.text(max_size=40) | st.binary(max_size=40) | hostile_text
          | json_values.map(lambda v: json.dumps(v)))
records = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=5), values, max_size=10)
# Some records that are nearly right: the known type and version with one hostile field.
near_events = st.fixed_dictionaries({
    "v": st.just("1"), "type": st.sampled_from(sorted(EventType.ALL)), "node": st.text(max_size=10),
    "seq": st.sampled_from(["1", "x", "-3"]), "data": json_values.map(lambda v: json.dumps(v))
    | hostile_text | st.dictionaries(st.sampled_from(["rank", "round", "ranks", "nodes", "host",
                                                         "root_cause", "exit_code", "pids"]),
                                       json_values | hostile_text, max_size=6)
    .map(lambda d: json.dumps(d))})
near_commands = st.fixed_dictionaries({
    "v": st.sampled_from(["1", "2", ""]), "id": st.text(max_size=12),
    "type": st.sampled_from([*sorted(CommandType.ALL), "explode"]),
    "args": st.dictionaries(st.sampled_from(["rank", "signal"]), json_values | hostile_text,
                            max_size=2).map(lambda d: json.dumps(d)) | hostile_text})
any_record = records | near_events | near_commands

# Valid records as the agents and consoles write them, then mutated: a property over records
# that are refused at their first field checks little beyond that field (see tests/reach.py).
_node_ids = st.from_regex(r"[a-z][a-z0-9-]{0,11}", fullmatch=True)
_ranks = st.integers(0, 64)
_line_texts = st.text(alphabet=st.characters(codec="utf-8", blacklist_characters="\n"),
                      max_size=20)
_event_data = st.fixed_dictionaries({}, optional={
    "rank": _ranks, "ranks": st.lists(_ranks, max_size=4),
    "local_ranks": st.lists(st.integers(0, 7), max_size=4),
    "pids": st.lists(st.integers(1, 1 << 22), max_size=4), "round": st.integers(0, 9),
    "world_size": st.integers(0, 64), "host": _node_ids, "exit_code": st.integers(-9, 3),
    "nodes": st.lists(st.fixed_dictionaries({
        "node": _node_ids, "host": _node_ids, "group_rank": st.integers(0, 3),
        "nproc": st.integers(1, 8)}), max_size=3),
    "signal": st.sampled_from([None, "SIGKILL", "SIGTERM"]), "stopping": st.booleans(),
    "restart_count": st.integers(0, 5), "max_restarts": st.integers(0, 5),
    "reason": st.sampled_from(["failure", "command", "membership"]),
    "count": st.integers(0, 1000), "restored": st.booleans()})
# Every type, the ones that make ranks and rounds more often.
_event_types = st.sampled_from(sorted(EventType.ALL)) | st.sampled_from(
    [EventType.WORKERS_STARTED, EventType.WORKER_EXITED, EventType.RENDEZVOUS_COMPLETE])
valid_events = st.builds(encode_event, _event_types, _node_ids, _event_data, st.integers(0, 20))
_batches = st.builds(LogBatch, _node_ids, st.integers(0, 40_000), st.integers(0, 7),
                     st.integers(0, 3), st.sampled_from(["out", "err"]), st.integers(1, 1000),
                     st.lists(_line_texts, min_size=1, max_size=3), st.just(""), st.booleans())
valid_batches = _batches.map(encode_log_batch)
valid_node_entries = st.tuples(_node_ids, st.lists(_batches, min_size=1, max_size=4)).map(
    lambda nb: encode_node_log_entry(nb[0], [b._replace(node=nb[0]) for b in nb[1]]))


@st.composite
def _valid_command(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(sorted(CommandType.ALL)) | st.just(CommandType.SIGNAL))
    args: dict = {}
    if kind == CommandType.SIGNAL:
        args = {"rank": draw(_ranks)}
        if draw(st.booleans()):
            args["signal"] = draw(st.sampled_from(sorted(CommandType.SIGNALS)))
    elif kind == CommandType.STACKS and draw(st.booleans()):
        args = {"rank": draw(_ranks)}
    if draw(st.integers(0, 2)) == 0:  # one argument hostile, the record otherwise valid
        args[draw(st.sampled_from(["rank", "signal"]))] = draw(json_values | hostile_text)
    return encode_command(Command(draw(st.from_regex(r"[a-z][a-z0-9-]{0,15}", fullmatch=True)),
                                  kind, draw(_node_ids) + "@h", args=args))


valid_commands = _valid_command()


@st.composite
def _mutated(draw: st.DrawFn, valid: st.SearchStrategy[dict]) -> dict:
    """A valid record with up to two fields replaced by hostile values, dropped or added."""
    fields = dict(draw(valid))
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(sorted(fields) or FIELD_NAMES) | st.sampled_from(FIELD_NAMES))
        if draw(st.integers(0, 2)) == 0:
            fields.pop(key, None)
        else:
            fields[key] = draw(values)
    return fields


TOTAL_RECORDS = (_mutated(valid_events) | _mutated(valid_batches) | _mutated(valid_commands)
                 | any_record)
# About half the rates measured (pytest -s prints them): hypothesis's examples are not
# independent draws, and a run must not fail for a dry spell.
TOTAL_FLOORS = {"an event": 0.08, "a log batch": 0.05, "a command": 0.06,
                "a signal command": 0.03, "a refused signal command": 0.03}
FOLD_EVENTS = _mutated(valid_events) | near_events
FOLD_FLOORS = {"a decoded event": 0.4, "an event the fold took": 0.35, "a rank": 0.08}

# -- decoders ------------------------------------------------------------------------------------


def _bytes_fields(fields: dict) -> dict:
    return {(k.encode() if isinstance(k, str) else k): (v.encode() if isinstance(v, str) else v)
            for k, v in fields.items()}


def test_decoders_are_total():
    reach = Reach("decoders_are_total")

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(TOTAL_RECORDS)
    # Found by these strategies (and by the security review, issue 24): a TypeError, not a
    # refusal, that restarted the agent's command reader.
    @example({"v": "1", "id": "a", "type": "signal", "issuer": "a@h", "target": "job",
              "args": '{"rank":0,"signal":[]}'})
    def prop(fields):
        reach.example()
        for f in (fields, _bytes_fields(fields)):
            ev = decode_event("1-0", f)
            assert ev is None or (isinstance(ev, Event) and isinstance(ev.data, dict))
            batch = decode_log_batch("1-0", f)
            assert batch is None or (isinstance(batch, LogBatch) and type(batch.rank) is int
                                     and batch.rank >= 0)
            cmd = decode_command("1-0", f)
            assert isinstance(cmd, (str, Command))
            if isinstance(cmd, Command) and cmd.type == CommandType.SIGNAL:
                assert type(cmd.args["rank"]) is int and cmd.args["rank"] >= 0
                assert cmd.args.get("signal", "SIGTERM") in CommandType.SIGNALS
        reach.hit("an event", ev)
        reach.hit("a log batch", batch)
        reach.hit("a command", isinstance(cmd, Command))
        reach.hit("a signal command", isinstance(cmd, Command) and cmd.type == CommandType.SIGNAL)
        reach.hit("a refused signal command", isinstance(cmd, str) and fields.get("type") == "signal")
        for raw in (fields.get("data"), fields.get("args")):
            if isinstance(raw, (str, bytes)):
                for decode in (RoundInfo.decode, NodeDescription.decode):
                    with contextlib.suppress(ProtocolError):
                        decode(raw)

    prop()
    reach.check(**TOTAL_FLOORS)


near_logs = st.fixed_dictionaries({
    "v": st.sampled_from(["1", "1", "9", ""]), "node": st.text(max_size=10) | hostile_text,
    "rank": st.sampled_from(["0", "7", "-1", "1" * 25, " 3", "x", "1_0"]),
    "lrank": st.sampled_from(["0", "-1", "-2", "99999999999999999999"]),
    "attempt": st.sampled_from(["0", "2", "-1"]), "s": st.sampled_from(["out", "err", "OUT"]),
    "seq": st.sampled_from(["1", "0", "-5", "x"]),
    "lines": st.lists(st.text(max_size=20) | hostile_text, min_size=1, max_size=3)
    .map("\n".join)}, optional={"live": st.sampled_from(["1", "0", "yes"])})


POSITIONAL_RECORDS = _mutated(valid_batches) | _mutated(valid_batches) | near_logs | records
POSITIONAL_FLOORS = {"a batch": 0.2, "a batch in the agent's order": 0.12}
LOG_RECORDS = _mutated(valid_batches) | _mutated(valid_node_entries) | near_logs | records
MANY_FLOORS = {"a batch": 0.4, "a batch and a refusal": 0.3}

_CANONICAL = {"v": "1", "node": "n", "rank": "3", "lrank": "1", "attempt": "0", "s": "out",
              "seq": "4", "lines": "a\nb"}


def test_the_positional_log_decoder_agrees_with_the_mapping_one():
    """decode_log_entry reads the agent's field order by position and anything else through
    decode_log_batch: both give the same batch (or both refuse) for any fields."""
    reach = Reach("positional_log_decoder")

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(POSITIONAL_RECORDS, st.booleans())
    @example({**_CANONICAL, "lrank": "9" * 20}, False)
    @example({**_CANONICAL, "seq": "9" * 20}, False)
    @example({**_CANONICAL, "live": "1"}, False)
    @example({**_CANONICAL, "live": "2"}, False)
    @example({**_CANONICAL, "v": "2"}, False)
    def prop(fields, shuffle):
        reach.example()
        f = _bytes_fields(fields)
        items = list(f.items())
        if shuffle:
            items.reverse()
        flat = [x for item in items for x in item]
        got = decode_log_entry("5-0", flat)
        assert got == decode_log_batch("5-0", dict(items))
        reach.hit("a batch", got)
        reach.hit("a batch in the agent's order", got and not shuffle)
        assert decode_log_entry("5-0", flat[:-1]) in (None, decode_log_batch("5-0",
                                                                             dict(items[:-1])))

    prop()
    reach.check(**POSITIONAL_FLOORS)


def test_the_positional_log_decoder_reads_what_the_agent_writes():
    for live in (False, True):
        sent = LogBatch("n-1", 3, 1, 2, "err", 9, ["a", "\x1b[2Jb"], "7-1", live)
        flat = [x for k, v in encode_log_batch(sent).items() for x in (k.encode(), v.encode())]
        assert decode_log_entry("7-1", flat) == sent


def _fold_state(view: JobView) -> tuple:
    """What the console shows of a job, but the counters of records it ignored."""
    return (view.state, view.round, view.world_size, view.restarts_used, view.root_cause,
            sorted((r, repr(rs)) for r, rs in view.ranks.items()),
            sorted((n, repr(info)) for n, info in view.nodes.items()))


def test_the_console_fold_never_raises_and_a_repeat_changes_nothing():
    """Any events fold without raising; read again (a reconnect, a retried XADD), the same
    entries change nothing the console shows."""
    reach = Reach("console_fold")

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(st.lists(FOLD_EVENTS, min_size=1, max_size=12))
    def prop(entries):
        reach.example()
        view = JobView("j", scrollback=10)
        events = [ev for i, fields in enumerate(entries)
                  if (ev := decode_event(f"{i + 1}-0", fields)) is not None]
        took = 0
        for ev in events:
            ignored = view.ignored
            view.apply_event(ev)
            took += view.ignored == ignored
        reach.hit("an event the fold took", took)
        once = _fold_state(view)
        view.apply_events(events)
        assert _fold_state(view) == once
        reach.hit("a decoded event", events)
        reach.hit("a rank", view.ranks)

    prop()
    reach.check(**FOLD_FLOORS)


_VISIBLE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f-\x9f]*")


sgr_pieces = st.sampled_from(["\x1b[31m", "\x1b[0m", "\x1b[1;38;2;1;2;3m", "\x1b[", "m", "\x1b]8;;x\x07",
                              "\x1b[2J", "\x07", "\r", "\n", "\u2028", "\u202e", "text", " "])


@settings(max_examples=500, deadline=None)
@given(st.text() | hostile_text | st.text(alphabet=string.printable + "\x1b\x07\x9b\r\u2028")
       | st.lists(sgr_pieces, max_size=8).map("".join))
@example("\x1b[31mred")  # a colour left open must be closed at the end of the line
@example("\x1b[3\x1b[1mm")  # a broken sequence must not join into a live one
def test_the_terminal_policy_lets_no_control_through(text):
    piped = terminal_line(text, colour=False)
    assert _VISIBLE.fullmatch(piped), repr(piped)
    on_tty = terminal_line(text, colour=True)
    without_sgr = re.sub(r"\x1b\[[0-9;:]*m", "", on_tty)
    assert _VISIBLE.fullmatch(without_sgr), repr(on_tty)
    if "\x1b" in on_tty:
        assert on_tty.endswith("\x1b[0m")


_UNSAFE_CHARS = "".join(map(chr, [*range(0x00, 0x09), *range(0x0A, 0x20), *range(0x7F, 0xA0),
                                   0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]))


@settings(max_examples=500, deadline=None)
@given(st.text() | st.text(alphabet=string.printable + _UNSAFE_CHARS + "\u00ad\u200b\ufeffé")
       | st.lists(sgr_pieces, max_size=8).map("".join))
def test_sanitize_fast_paths_change_nothing(text):
    """The printable shortcut returns a line only when escaping would not change it."""
    safe = sanitize(text)
    assert safe == text_module._TOKEN_RE.sub(text_module._replace, text)
    assert not any(ch in _UNSAFE_CHARS.replace("\x1b", "") for ch in safe)


# -- live: a real agent, the CLI -----------------------------------------------------------------

# No shrinking: each example runs a real agent, and shrinking one would take minutes.
@settings(max_examples=3, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(garbage=st.lists(any_record, min_size=10, max_size=30))
@example(garbage=[  # found in CI: a well-formed event of another "node" among the garbage
    {"v": "1", "type": "workers_started", "node": "x", "seq": "1", "data": '{"a": [1]}'},
    {"v": "1", "type": "restart", "id": "\x02", "args": '{"rank": "\\u202e"}'}, {}, {"v": ""}])
def test_a_live_agent_and_the_cli_survive_garbage_and_a_valid_stop_still_stops(
        garbage, redis_url, r, tmp_path_factory):
    job = f"prop-{tmp_path_factory.mktemp('x').name}"
    tmp = tmp_path_factory.mktemp("agent")
    keys = JobKeys(job)
    agent = Agent(agent_args(redis_url, job, "--nproc-per-node", "2", FAST,
                             str(SCRIPTS / "sleeper.py")), tmp, "a")
    try:
        wait_until(lambda: len(worker_pids(r, job)) == 2, 30, "workers")
        node = of_type(r, job, EventType.WORKERS_STARTED)[0].node

        def agents_pids() -> list:
            # Only the agent's own records: the garbage may hold well-formed events too.
            return [p for e in of_type(r, job, EventType.WORKERS_STARTED) if e.node == node
                    for p in e.data["pids"]]

        first = agents_pids()
        for fields in garbage:
            clean = {str(k) or "_": v for k, v in fields.items()} or {"_": "x"}
            for key in (keys.events, keys.logs(node)):
                r.xadd(key, clean)
            # A well-formed command that hypothesis happens to build (a restart) is obeyed,
            # rightly: only what the agents must refuse goes to the command stream.
            if isinstance(decode_command("0-1", clean), str):
                r.xadd(keys.commands, clean)
        for args in (["ls"], ["status", job], ["events", job], ["logs", job],
                     ["status", job, "--json"]):
            p = _console(*args, "--redis", redis_url)
            assert p.returncode == 0 and "Traceback" not in p.stderr, (args, p.stderr[-2000:])
            assert "\x1b" not in p.stdout and "\x07" not in p.stdout
        assert agents_pids() == first  # no garbage restarted or signalled a worker
        r.xadd(keys.commands, encode_command(Command("stop-ok", CommandType.STOP, "tester")))
        assert agent.wait(30) == 143, agent.output[-3000:]
        assert "Traceback" not in agent.output
    finally:
        if agent.proc.poll() is None:
            agent.kill()
            agent.wait(10)


def _text(value: str | bytes) -> str:
    """As the decoders read a field: bytes that are not UTF-8 become U+FFFD, never an error."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _flat(fields: dict) -> list:
    return [x for item in _bytes_fields(fields).items() for x in item]


def test_the_many_entries_decoder_agrees_with_decode_log_entry():
    """LogEntryDecoder (the console's reader: headers remembered by their raw bytes) gives
    exactly what decode_log_entries gives, entry by entry, refusals counted, on its first read of
    a header and on every later one (the same entries read again hit its memory)."""
    reach = Reach("many_entries_decoder")

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(st.lists(st.tuples(LOG_RECORDS, st.booleans()), min_size=1, max_size=8))
    @example([({**_CANONICAL, "seq": "9" * 20}, False), (_CANONICAL, False)])
    @example([(_CANONICAL, False), ({**_CANONICAL, "lines": "x" * 10}, False),
              ({**_CANONICAL, "seq": "-1"}, False), ({**_CANONICAL, "live": "2"}, False)])
    def prop(entries):
        reach.example()
        raw = []
        for i, (fields, reverse) in enumerate(entries):
            flat = _flat(fields)
            if reverse:  # another field order: not the agent's, never remembered
                flat = [x for pair in reversed(list(zip(flat[::2], flat[1::2]))) for x in pair]
            raw.append([f"{i + 5}-{i}".encode(), flat])
        expected = [decode_log_entries(eid, dict(zip(flat[::2], flat[1::2])))
                    for eid, flat in raw]
        decoder = LogEntryDecoder()
        for _ in range(2):
            batches, refused = decoder.decode(raw)
            assert batches == [b for bs in expected if bs is not None for b in bs]
            assert refused == expected.count(None)
        reach.hit("a batch", batches)
        reach.hit("a batch and a refusal", batches and refused)

    prop()
    reach.check(**MANY_FLOORS)


def test_the_many_entries_decoder_tells_headers_apart_by_every_byte():
    """A remembered header is used only for entries whose header is the same, names included:
    the same values under swapped names are not the remembered worker."""
    decoder = LogEntryDecoder()
    sent = LogBatch("n-1", 3, 1, 2, "err", 9, ["a"], "7-1")
    flat = _flat(encode_log_batch(sent))
    assert decoder.decode([[b"7-1", flat]]) == ([sent], 0)
    swapped = list(flat)
    swapped[4], swapped[6] = swapped[6], swapped[4]  # "rank" <-> "lrank" names
    (other,), refused = decoder.decode([[b"7-2", swapped]])
    assert (other.rank, other.local_rank, refused) == (1, 3, 0)
    again = list(flat)
    again[13] = b"10"
    assert decoder.decode([[b"7-3", again]]) == ([sent._replace(seq=10, id="7-3")], 0)


_NEEDS_ESCAPE = re.compile(f"(?!{text_module._SGR}){text_module._UNSAFE}")


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("a[m0;:\t\x1b\x07\r\u202e\x9b\u2028 ")),
               max_size=30) | st.text(max_size=30))
@example("a\x1b[3\x1b[1mm")
@example("\x1b[32mok\x1b[0m\tx")
def test_the_only_safe_pattern_is_no_unsafe_character_outside_an_sgr(s):
    """sanitize's fast check for coloured lines (a line of safe runs and SGR sequences) says
    exactly what its definition says: no unsafe character that does not start an SGR."""
    assert (text_module._ONLY_SAFE_RE.fullmatch(s) is not None) == (
        _NEEDS_ESCAPE.search(s) is None)


part_values = st.one_of(st.integers(-3, 5), st.sampled_from(["out", "err", "x", True, None, 1.0]),
                        st.integers(1 << 62, 1 << 64))
hostile_parts = st.lists(st.lists(part_values, min_size=6, max_size=8), max_size=4).map(json.dumps)
good_parts = st.lists(st.tuples(st.integers(0, 9), st.integers(-1, 3), st.integers(0, 2),
                                st.sampled_from(["out", "err"]), st.integers(0, 9),
                                st.integers(1, 3), st.sampled_from([0, 1])),
                      min_size=1, max_size=4).map(lambda ps: json.dumps([list(p) for p in ps]))
node_entries = st.fixed_dictionaries({
    "v": st.sampled_from(["1", "1", "2"]), "node": st.text(max_size=8),
    "parts": good_parts | hostile_parts | hostile_text,
    "lines": st.lists(st.text(max_size=6) | hostile_text, min_size=1, max_size=8).map("\n".join)})


NODE_ENTRIES = _mutated(valid_node_entries) | node_entries
NODE_FLOORS = {"read whole": 0.15, "several batches": 0.08}


def test_a_node_log_entry_is_read_whole_or_refused():
    """A node's entry (several workers' batches) decodes into batches whose lines are exactly
    the entry's lines, in order, each part valid, or is refused whole; LogEntryDecoder (the
    console's reader) says the same, in any field order."""
    reach = Reach("node_log_entry")

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(NODE_ENTRIES, st.booleans())
    @example({"v": "1", "node": "n", "parts": '[[1,0,0,"out",1,2,0]]', "lines": "a\nb"}, False)
    @example({"v": "1", "node": "n", "parts": '[[1,0,0,"out",1,1,0]]', "lines": "a\nb"}, False)
    def prop(fields, shuffle):
        reach.example()
        got = decode_log_entries("5-0", fields)
        reach.hit("read whole", got)
        reach.hit("several batches", got and len(got) > 1)
        if got is not None:  # (a mutated field may be bytes: compared as the decoder reads it)
            lines = _text(fields["lines"]).split("\n")
            assert [line for b in got for line in b.lines] == lines
            assert all(b.node == _text(fields["node"]) and b.id == "5-0" and b.lines for b in got)
            assert all(type(b.rank) is int and b.stream in ("out", "err") and b.seq >= 0
                       and type(b.live) is int and 0 <= b.live <= len(b.lines) for b in got)
        items = list(_bytes_fields(fields).items())
        if shuffle:
            items.reverse()
        flat = [x for item in items for x in item]
        assert decode_log_entries("5-0", dict(items)) == got
        batches, refused = LogEntryDecoder().decode([[b"5-0", flat]])
        assert (batches, refused) == ((got, 0) if got is not None else ([], 1))

    prop()
    reach.check(**NODE_FLOORS)


def test_a_node_log_entry_round_trips_every_batch():
    sent = [LogBatch("n-1", 3, 1, 2, "err", 9, ["a", "\x1b[2Jb"], "7-1", True),
            LogBatch("n-1", 0, 0, 2, "out", 4, [""], "7-1"),
            LogBatch("n-1", 3, 1, 2, "out", 1, ["x", "y", "z"], "7-1")]
    fields = encode_node_log_entry("n-1", sent)
    assert decode_log_entries("7-1", fields) == sent
    flat = [x for k, v in fields.items() for x in (k.encode(), v.encode())]
    assert LogEntryDecoder().decode([[b"7-1", flat]]) == (sent, 0)

