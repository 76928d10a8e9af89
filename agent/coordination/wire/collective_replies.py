"""Ask a job for its ranks' flight recorder traces and collect the agents' replies (issue 22).

The same round trip as stacks (coordination/wire/stack_replies.py): a ``collectives`` command,
one entry per rank on ``JobKeys.collectives`` under the command's id, each decoded by
``trace_records.decode_collective_reply`` (bounded, guarded); a rank without a reply is returned
with an error, never left out. :func:`.collectives.analyse` reads the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .collectives import RankTrace
from .command_records import CommandType
from .keyspace import JobKeys
from .round_records import RoundInfo
from .stack_replies import read_replies, send_request
from .trace_records import CollectiveTrace, decode_collective_reply


def _decode(entry_id: Any, fields: Any) -> tuple[str, int, RankTrace] | None:
    reply = decode_collective_reply(entry_id, fields)
    if reply is None:
        return None
    return reply.request, reply.rank, RankTrace(reply.rank, reply.node, reply.host, reply.trace)


def _missing(rank: int, node: str, host: str, why: str) -> RankTrace:
    return RankTrace(rank, node, host, CollectiveTrace(error=why))


async def read_collective_replies(client: Any, job_id: str, request_id: str,
                                  expected_ranks: Iterable[int] | None, timeout: float, *,
                                  since: str = "0-0", events_since: str | None = None,
                                  info: RoundInfo | None = None,
                                  expected_nodes: Iterable[str] | None = None,
                                  on_reply: Callable[[int, int], None] | None = None,
                                  ) -> list[RankTrace]:
    """The traces published under ``request_id``, one per rank, by rank (see
    ``stack_replies.read_replies`` for when reading stops)."""
    return await read_replies(
        client, job_id, request_id, JobKeys(job_id).collectives, _decode, _missing,
        expected_ranks, timeout, since=since, events_since=events_since, info=info,
        expected_nodes=expected_nodes, on_reply=on_reply)


async def request_collectives(client: Any, job_id: str, issuer: str, rank: int | None = None,
                              timeout: float = 10.0,
                              on_reply: Callable[[int, int], None] | None = None,
                              ) -> tuple[str, list[RankTrace]]:
    """Send a ``collectives`` command and collect the replies: ``(request_id, traces by
    rank)``. Raises redis errors and OSError for the caller to word, ``ProtocolError`` for
    every rank of a round too large to collect (``stack_replies.check_request_size``)."""
    request_id, info, since, since_event, nodes = await send_request(
        client, job_id, issuer, CommandType.COLLECTIVES, rank)
    traces = await read_collective_replies(
        client, job_id, request_id, None if rank is None else [rank], timeout, since=since,
        events_since=since_event, info=info, expected_nodes=nodes, on_reply=on_reply)
    return request_id, traces
