"""Ask a job for its ranks' Python stacks and collect the agents' replies (issue 13).

:func:`request_stacks` appends a ``stacks`` command; every agent captures its live workers
(faulthandler, see supervision/diagnosis/stacks.py) and publishes one entry per rank on
``JobKeys.stacks`` with the command's id as ``request``, then acks the command ``done``.
:func:`read_stack_replies` reads them back (also for captures an agent made on its own, such
as the evidence taken before a stop, by their capture id). Both the console and the agents use
these; every entry goes through ``trace_records.decode_stack_reply`` (bounded, guarded).

The ranks expected are those of the job's current round (``rdzv:round``). Reading stops when
every one answered, when every agent of the round acked the command (a rank that an agent
did not answer for will not come), or at the timeout; a rank without a reply is returned with
an error, never left out.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .command_records import Command, CommandType, encode_command
from .event_records import EventType, decode_event
from .keyspace import COMMANDS_MAXLEN, JobKeys
from .protocol import MAX_RECORD_LIST, ProtocolError, is_request_id
from .round_records import RoundInfo
from .stack_dumps import RankStack, parse_faulthandler
from .trace_records import StackReply, decode_stack_reply

T = TypeVar("T")

#: Entries per XREAD; a reply is one rank, up to 256 KiB of text: a read holds at most
#: ~32 MiB (32,768 ranks: 256 reads).
READ_COUNT = 128
#: The longest single block (the client's socket timeout must be longer).
BLOCK_MS = 1000
#: The most ranks one request waits for and keeps (the design's largest job, as every
#: reader's bound on ranks): a round of more is refused before anything is sent (ask one
#: rank), so a forged round record never makes a reader hold a table per rank.
MAX_REQUEST_RANKS = MAX_RECORD_LIST


def rank_stack(reply: StackReply) -> RankStack:
    """A decoded reply as the grouping takes it (its text parsed)."""
    if reply.error or not reply.text:
        return RankStack(reply.rank, reply.node, reply.host, reply.pid, (),
                         reply.error or "no Python stacks in the reply")
    threads = parse_faulthandler(reply.text)
    if not threads:
        return RankStack(reply.rank, reply.node, reply.host, reply.pid, (),
                         "the reply holds no readable stack")
    return RankStack(reply.rank, reply.node, reply.host, reply.pid, threads)


async def read_round(client: Any, job_id: str) -> RoundInfo | None:
    """The job's last completed rendezvous round, None when there is none; raises
    :class:`ProtocolError` for an unreadable one (``round_records.RoundInfo.decode`` bounds
    its nodes and their workers)."""
    raw = await client.get(JobKeys(job_id).rdzv_round_info)
    if not raw:
        return None
    return RoundInfo.decode(raw)


async def current_round(client: Any, job_id: str) -> RoundInfo | None:
    """:func:`read_round`, with None for an unreadable round too."""
    try:
        return await read_round(client, job_id)
    except ProtocolError:
        return None


def check_request_size(info: RoundInfo | None, rank: int | None) -> None:
    """Raise :class:`ProtocolError` (one sentence for people) for a request of every rank
    of a round of more than ``MAX_REQUEST_RANKS`` ranks: no reader waits for, or keeps, more
    (a forged round record can claim 2**24)."""
    if rank is None and info is not None and info.total_workers > MAX_REQUEST_RANKS:
        raise ProtocolError(f"the job's round record claims {info.total_workers} ranks, more "
                            f"than the {MAX_REQUEST_RANKS} one request collects: ask one rank "
                            "(--rank N)")


def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


async def read_stack_replies(client: Any, job_id: str, request_id: str,
                             expected_ranks: Iterable[int] | None, timeout: float, *,
                             since: str = "0-0", events_since: str | None = None,
                             info: RoundInfo | None = None,
                             expected_nodes: Iterable[str] | None = None,
                             on_reply: Callable[[int, int], None] | None = None,
                             ) -> list[RankStack]:
    """The replies to ``request_id`` on the job's stacks stream after ``since``, one per rank,
    by rank, until every rank of ``expected_ranks`` (None: the current round's) answered, every
    node of ``expected_nodes`` acked the command (acks read after ``events_since``), or
    ``timeout`` seconds passed. A rank without a reply gets an error.
    ``on_reply(answered, expected)`` follows the progress. ``client`` must block longer than
    ``BLOCK_MS`` (a reader client)."""
    def decode(entry_id: Any, fields: Any) -> tuple[str, int, RankStack] | None:
        reply = decode_stack_reply(entry_id, fields)
        return None if reply is None else (reply.request, reply.rank, rank_stack(reply))

    def missing(rank: int, node: str, host: str, why: str) -> RankStack:
        return RankStack(rank, node, host, 0, (), why)

    return await read_replies(
        client, job_id, request_id, JobKeys(job_id).stacks, decode, missing, expected_ranks,
        timeout, since=since, events_since=events_since, info=info,
        expected_nodes=expected_nodes, on_reply=on_reply)


async def read_replies(client: Any, job_id: str, request_id: str, stream: str,
                       decode: Callable[[Any, Any], tuple[str, int, T] | None],
                       missing: Callable[[int, str, str, str], T],
                       expected_ranks: Iterable[int] | None, timeout: float, *,
                       since: str = "0-0", events_since: str | None = None,
                       info: RoundInfo | None = None,
                       expected_nodes: Iterable[str] | None = None,
                       on_reply: Callable[[int, int], None] | None = None) -> list[T]:
    """:func:`read_stack_replies` for any per-rank reply stream: ``decode(entry_id, fields)``
    gives ``(request, rank, value)`` or None (the guarded decoder of ``trace_records``);
    ``missing(rank, node, host, why)`` the value of a rank that did not answer."""
    if not is_request_id(request_id):
        raise ValueError(f"{request_id!r} is not a request id")
    keys = JobKeys(job_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, timeout)
    if info is None:
        info = await current_round(client, job_id)
    if expected_ranks is None:
        check_request_size(info, None)
        wanted = set(range(info.total_workers)) if info is not None else set()
    else:
        wanted = set(expected_ranks)
    nodes = set(expected_nodes) if expected_nodes is not None else set()
    got: dict[int, T] = {}
    acked: set[str] = set()
    streams = {stream: since}
    if nodes:  # each stream has its own ids: the events are read from their own present
        streams[keys.events] = events_since or since

    def take(key: str, entries: list[Any]) -> None:
        for entry_id, fields in entries:
            streams[key] = _s(entry_id)
            if key == keys.events:
                ev = decode_event(entry_id, fields)
                if (ev is not None and ev.type == EventType.COMMAND_ACK
                        and ev.data.get("command_id") == request_id and ev.node in nodes):
                    acked.add(ev.node)
                continue
            decoded = decode(entry_id, fields)
            if decoded is None or decoded[0] != request_id or decoded[1] in got:
                continue
            if wanted and decoded[1] not in wanted:
                continue
            got[decoded[1]] = decoded[2]
            if on_reply is not None:
                on_reply(len(got), len(wanted))

    while not (wanted and wanted <= got.keys()) and not (nodes and nodes <= acked):
        left = deadline - loop.time()
        if left <= 0:
            break
        reply = await client.xread(streams, count=READ_COUNT,
                                   block=max(1, min(BLOCK_MS, int(left * 1000))))
        for key, entries in reply or ():
            take(_s(key), entries)
    if nodes and nodes <= acked:
        # Every node acked, after publishing its replies: those not read yet are in the
        # stream's tail, which may be many reads long (the acks, one per node, come in
        # faster than the replies, one per rank). Read it to its end, within the deadline.
        while not (wanted and wanted <= got.keys()) and loop.time() < deadline:
            reply = await client.xread({stream: streams[stream]}, count=READ_COUNT)
            entries = [e for _, batch in reply or () for e in batch]
            if not entries:
                break
            take(stream, entries)
    for rank in sorted(wanted - got.keys()):
        node, host = info.placement(rank) if info is not None else ("", "")
        why = ("its agent answered without it" if node and node in acked
               else f"no answer within {timeout:g} s")
        got[rank] = missing(rank, node, host, why)
    return [got[r] for r in sorted(got)]


async def send_request(client: Any, job_id: str, issuer: str, command_type: str,
                       rank: int | None = None,
                       ) -> tuple[str, RoundInfo | None, str, str, list[str] | None]:
    """Append a per-rank request command (``stacks``, ``collectives``): ``(request id, the
    round, the stream's and the events' newest ids before it, the round's nodes)``. Raises
    :class:`ProtocolError`, sending nothing, for every rank of a round too large to collect
    (:func:`check_request_size`)."""
    keys = JobKeys(job_id)
    info = await current_round(client, job_id)
    check_request_size(info, rank)  # before anything is written
    stream = keys.stacks if command_type == CommandType.STACKS else keys.collectives
    newest = await client.xrevrange(stream, count=1)
    since = _s(newest[0][0]) if newest else "0-0"
    newest_event = await client.xrevrange(keys.events, count=1)
    since_event = _s(newest_event[0][0]) if newest_event else "0-0"
    request_id = f"c-{uuid.uuid4().hex[:12]}"
    args = {} if rank is None else {"rank": rank}
    await client.xadd(keys.commands, encode_command(Command(
        request_id, command_type, issuer, args=args)),
        maxlen=COMMANDS_MAXLEN, approximate=True)
    nodes = [str(n["node"]) for n in info.nodes] if info is not None else None
    return request_id, info, since, since_event, nodes


async def request_stacks(client: Any, job_id: str, issuer: str, rank: int | None = None,
                         timeout: float = 10.0,
                         on_reply: Callable[[int, int], None] | None = None,
                         ) -> tuple[str, list[RankStack]]:
    """Send a ``stacks`` command (for one ``rank``, or every rank) and collect the replies:
    ``(request_id, stacks by rank)``. Raises redis errors and OSError for the caller to word,
    :class:`ProtocolError` for every rank of a round too large to collect."""
    request_id, info, since, since_event, nodes = await send_request(
        client, job_id, issuer, CommandType.STACKS, rank)
    stacks = await read_stack_replies(
        client, job_id, request_id, None if rank is None else [rank], timeout, since=since,
        events_since=since_event, info=info, expected_nodes=nodes, on_reply=on_reply)
    return request_id, stacks
