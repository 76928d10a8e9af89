"""The wire contract between agents and consoles: its version and the guards every record passes.

Both sides import the contract, so none of its modules imports Textual, torch or anything
else of the agent. docs/PROTOCOL.md documents the same contract for other clients. It is
kept in these modules of ``coordination``:

* :mod:`.keyspace`: every Redis key of a job, job ids, and the streams' retention;
* :mod:`.event_records`, :mod:`.command_records`: the job's event and command streams;
* :mod:`.log_records`: the workers' output on the log streams;
* :mod:`.round_records`: rendezvous rounds (a node's description, a round, a round's end);
* :mod:`.trace_records`: what ranks answer a read-only request (stacks, collective traces);
* this module: the protocol version, the bounds and checks those records share.

Names here with a leading underscore are private to those modules, not to this one.

Records
    Stream entries are flat maps of strings. Every entry carries ``v`` (the protocol
    version). A reader ignores record types it does not know and survives malformed entries:
    ``decode_*`` return ``None`` for them instead of raising.

Hostile input
    Anyone who can write a job's keys can write anything into them, so every decoder of the
    contract is total: it takes any mapping of any bytes and returns a record or ``None`` (a
    command: the reason it was refused), never raising. JSON goes through :func:`decode_json`
    alone, which bounds its size and nesting (``json.loads`` of deep nesting raises
    RecursionError, which is not a ValueError), and every field is checked for its type
    (``type(x) is int``: a bool is not a rank) and range before a record is built.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

PROTOCOL_VERSION = 1
#: Record versions a reader of this module understands; a record of any other is skipped.
SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION})

#: Bounds on what a reader decodes: far above anything an agent writes, far below what
#: would stall a reader. These hold for every record; a family's own bounds (an event's data,
#: a log entry, a command's args, a rendezvous record, a stack, a trace) sit with its records.
MAX_JSON_DEPTH = 32
#: Short text fields (node ids, hosts, command ids, issuers).
MAX_NAME_CHARS = 256
#: The largest rank a record may name (far above any job; keeps arithmetic on ranks sane).
MAX_RANK = 1 << 24
#: The most items a reader takes from one list of a record (a node's ranks and pids, a
#: round's nodes, a stall's odd ranks): the design's largest job (32,768 ranks on 4,096 nodes)
#: fits in one; the rest of a longer list is ignored (see :func:`record_list`).
MAX_RECORD_LIST = 32_768


class ProtocolError(ValueError):
    """A record that breaks the wire contract; the message says how (for acks and logs)."""


def decode_json(raw: str | bytes | None, what: str, limit: int) -> Any:
    """The one place JSON from Redis is parsed: at most ``limit`` bytes, at most
    ``MAX_JSON_DEPTH`` levels deep; anything else raises :class:`ProtocolError` naming ``what``.
    """
    if raw is None:
        raise ProtocolError(f"{what} is missing")
    if len(raw) > limit:
        raise ProtocolError(f"{what} is {len(raw)} bytes (at most {limit})")
    try:
        value = _loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"{what} is not valid JSON ({type(exc).__name__})") from None
    # Each level opens with a bracket: text with few brackets cannot nest deep, and the walk
    # (most of the cost of a small record: 4,096 resource samples a second) is not needed.
    if not isinstance(value, (dict, list)):
        return value
    opens = (raw.count("{") + raw.count("[") if isinstance(raw, str)
             else raw.count(b"{") + raw.count(b"["))
    if opens <= MAX_JSON_DEPTH:
        return value
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise ProtocolError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    # Iterative: a recursive walk would itself hit the recursion limit on hostile input.
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def decode_counter(raw: str | bytes | None, key: str) -> int:
    """A counter key's value (missing: 0); :class:`ProtocolError` for anything else, since a
    counter read wrong would spend a budget twice or never."""
    text = _str(raw) if raw is not None else "0"
    if not text.isdigit() or len(text) > 18:
        raise ProtocolError(f"{key} holds {text[:40]!r}, not a count: repair or delete that key")
    return int(text)


def is_rank(value: Any) -> bool:
    """A rank as records carry it: a real int (``True`` is not rank 1), 0 <= rank < MAX_RANK."""
    return type(value) is int and 0 <= value < MAX_RANK


def record_list(value: Any, limit: int = MAX_RECORD_LIST) -> list[Any]:
    """A list field of a decoded record: its first ``limit`` items, ``[]`` for anything but a
    list. How a reader takes every list from a record: a 1 MiB event holds ~140k ranks, and
    an item a reader keeps costs it far more than the item's bytes."""
    return value[:limit] if type(value) is list else []


def rank_list(value: Any, limit: int = MAX_RECORD_LIST, world: int | None = None) -> list[int]:
    """The ranks among the first ``limit`` items of a list field (:func:`is_rank`, and below
    ``world`` when it is known); other items are dropped."""
    top = MAX_RANK if world is None else min(world, MAX_RANK)
    return [r for r in record_list(value, limit) if type(r) is int and 0 <= r < top]


def record_version(fields: Mapping[str, str]) -> int | None:
    """The record's ``v`` if this reader supports it, else None."""
    raw = fields.get("v", "")
    if not raw.isdigit() or len(raw) > 6:
        return None
    v = int(raw)
    return v if v in SUPPORTED_VERSIONS else None


#: A request id: a command id, or a capture id an agent chose (``stop-3``, ``stall-...``).
_REQUEST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def is_request_id(value: Any) -> bool:
    """A request id as stack replies carry it (a command id or an agent's capture id)."""
    return isinstance(value, str) and _REQUEST_RE.fullmatch(value) is not None


def stream_id_ms(entry_id: str) -> int:
    """The millisecond (Redis server time) part of a stream id; 0 if there is none."""
    try:
        return int(entry_id.split("-", 1)[0])
    except (ValueError, AttributeError):
        return 0


def _name(d: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = d.get(key, default)
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise ProtocolError(f"field {key!r} is not a string of at most {MAX_NAME_CHARS} characters")
    return value


def _int_in(d: Mapping[str, Any], key: str, low: int, high: int, default: int | None = None) -> int:
    value = d.get(key, default)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"field {key!r} is not an integer in [{low}, {high}]")
    return value


def _str(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _strs(fields: Mapping[Any, Any]) -> dict[str, str]:
    return {_str(k): _str(v) for k, v in fields.items()}


def _small_int(raw: str | bytes) -> int:
    """int() of a decimal field of at most 18 digits (int() of a huge string is quadratic)."""
    if len(raw) > 19:
        raise ValueError("number too long")
    return int(raw)


_SCAN_JSON = json.JSONDecoder().scan_once


def _loads(raw: Any) -> Any:
    """``json.loads(raw)`` at a quarter of its cost for the small records Redis holds: its C
    scanner called directly (``json.loads`` of bytes spent 3 of its ~4 us detecting the
    encoding and in its wrappers; a console reads ~50k node log entries a second at 32,768
    ranks, ``status`` 32,768 resource samples). Anything the scanner does not take whole
    (whitespace around it, another encoding, no JSON at all) goes to ``json.loads``, so what
    is accepted or refused, and how, is the same."""
    try:
        text = raw.decode() if type(raw) is bytes else raw
        value, end = _SCAN_JSON(text, 0)
        if end == len(text):
            return value
    except (StopIteration, ValueError, TypeError, RecursionError):
        pass
    return json.loads(raw)
