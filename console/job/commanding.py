"""Commands: what a console sends a job (``stop``, ``restart``, ``signal``, stack requests) and
the agents' answers. The command half of :class:`~.client.JobClient` (a mixin, as
:class:`~.follow.Following` is its follow half): JobClient sets every attribute below and gives
``_explain``, ``_errors`` and ``_newest_events``.

A command is one XADD to the job's command stream (capped, ``COMMANDS_MAXLEN``); its acks are
read from the event stream from the command's own server time onward, so a console that sent
it never reads the job's whole history to collect them.
"""

from __future__ import annotations

import asyncio
import getpass
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from elastic_agent.coordination.transport.cluster import execute_on_node_of
from elastic_agent.coordination.transport.connection import (
    RedisUnavailableError,
    raise_if_cancelled,
)
from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.command_records import Command, CommandType, encode_command
from elastic_agent.coordination.wire.event_records import Event, EventType, decode_event
from elastic_agent.coordination.wire.keyspace import COMMANDS_MAXLEN, JobKeys
from elastic_agent.coordination.wire.text import sanitize

from .follow import _CONNECTION_ERRORS, BLOCK_MS, READ_COUNT, _entry_fields, _s
from .state import JobView

__all__ = ["ACTIVE_NODES_EVENTS", "Ack", "Commanding", "id_key", "issuer"]

ACTIVE_NODES_EVENTS = 5_000  # events folded to find the nodes expected to ack


@dataclass(frozen=True)
class Ack:
    """One agent's answer to a command. Strings are sanitized (they came from the job)."""

    node: str
    host: str
    status: str  # accepted | rejected | done
    reason: str
    server_ms: int


class Commanding:
    """See the module docstring."""

    keys: JobKeys
    endpoint: Endpoint
    _client: aioredis.Redis
    _reader: aioredis.Redis
    #: command id -> the stream id of its entry (the server time it was sent at)
    _sent: dict[str, str]

    def _explain(self, exc: BaseException) -> RedisUnavailableError:
        raise NotImplementedError

    def _errors(self) -> Iterator[None]:
        raise NotImplementedError

    async def _newest_events(self, n: int, *, count: bool = True
                             ) -> tuple[list[Event], str | None]:
        raise NotImplementedError

    async def send_command(self, type: str, args: dict[str, Any] | None = None,
                           target: str = "job") -> str:
        """Append a command for every agent of the job; return its id (``c-<8 hex>``).

        ``type`` is one of ``CommandType.ALL`` (``ValueError`` otherwise). The issuer is
        ``user@host``. A user that may not write the stream gets a RedisUnavailableError
        saying so.
        """
        if type not in CommandType.ALL:
            raise ValueError(f"unknown command type {type!r}: use one of "
                             f"{', '.join(sorted(CommandType.ALL))}")
        cid = f"c-{uuid.uuid4().hex[:8]}"
        cmd = Command(cid, type, issuer(), target=str(target), args=dict(args or {}))
        try:
            entry = await self._client.xadd(self.keys.commands, encode_command(cmd),
                                            maxlen=COMMANDS_MAXLEN, approximate=True)
        except NoPermissionError as exc:
            raise RedisUnavailableError(
                f"the Redis user on {self.endpoint.display} may not write the command stream "
                f"of job {self.keys.job_id} ({sanitize(str(exc))}): ask for write access to "
                "it, or watch the job read-only") from None
        except (redis.RedisError, OSError) as exc:
            raise self._explain(exc) from None
        self._sent[cid] = _s(entry)
        return cid

    async def active_nodes(self) -> dict[str, str]:
        """node id -> host of the agents expected to answer a command now: the nodes of the
        last ``rendezvous_complete`` minus those lost or left since (``JobView.active_nodes``
        over the last few thousand events)."""
        with self._errors():
            events, _ = await self._newest_events(ACTIVE_NODES_EVENTS, count=False)
        view = JobView(self.keys.job_id, scrollback=1)
        view.apply_events(events)
        return view.active_nodes()

    async def wait_acks(self, command_id: str, expected_nodes: int | None = None,
                        timeout: float = 10.0,
                        on_ack: Callable[[Ack], None] | None = None) -> list[Ack]:
        """Collect the ``command_ack`` events of ``command_id`` (one per node), in arrival
        order, until ``expected_nodes`` distinct nodes answered or ``timeout`` seconds passed.

        Reads the event stream from the command's own server time onward (from the start for
        a command this client did not send). ``expected_nodes`` defaults to
        ``len(active_nodes())``. ``on_ack`` is called with each ack as it arrives.
        """
        k = self.keys
        if expected_nodes is None:
            expected_nodes = len(await self.active_nodes())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        sent = self._sent.get(command_id)
        start = f"{id_key(sent)[0]}-0" if sent else "0-0"
        acks: dict[str, Ack] = {}

        def take(entries: list[Any]) -> str | None:
            last = None
            for entry_id, fields in entries:
                last = _s(entry_id)
                ev = decode_event(last, _entry_fields(fields))
                if ev is None or ev.type != EventType.COMMAND_ACK:
                    continue
                d = ev.data
                node = sanitize(ev.node)
                if d.get("command_id") != command_id or node in acks:
                    continue  # another command's ack, or a duplicated entry
                ack = Ack(node, sanitize(str(d.get("host") or node)), sanitize(str(d.get("status"))),
                          sanitize(str(d.get("reason", ""))), ev.server_ms)
                acks[node] = ack
                if on_ack is not None:
                    on_ack(ack)
            return last

        with self._errors():
            # Catch up with XRANGE (inclusive start), then block for what comes next.
            last = None
            while True:
                entries = await self._client.xrange(k.events, min=start, max="+", count=READ_COUNT)
                if not entries:
                    break
                last = take(entries) or last
                if len(entries) < READ_COUNT:
                    break
                start = "(" + last  # exclusive: continue after the last entry read
            last = last or ("0-0" if not sent else f"{max(0, id_key(sent)[0] - 1)}-0")
            while len(acks) < expected_nodes:
                raise_if_cancelled()
                left = deadline - loop.time()
                if left <= 0:
                    break
                reply = await self._reader.xread({k.events: last}, count=READ_COUNT,
                                                 block=max(1, min(BLOCK_MS, int(left * 1000))))
                for _, entries in reply or ():
                    last = take(entries) or last
        return list(acks.values())

    async def can_write(self) -> tuple[bool, str]:
        """Whether this Redis user may XADD to the job's command stream.

        Asks ``ACL DRYRUN <user> XADD <commands> * v 1`` (Redis 7) for the user ``ACL WHOAMI``
        names. When ACL is unsupported (Redis 6.2) or not permitted to this user, answers
        ``(True, "")``: a refusal at send time then surfaces as a clear error.
        """
        key = self.keys.commands
        try:
            # On a cluster: the node that owns the key (ACLs are per node).
            user = _s(await execute_on_node_of(self._client, key, "ACL", "WHOAMI"))
            reply = await execute_on_node_of(self._client, key, "ACL", "DRYRUN", user, "XADD",
                                             key, "*", "v", "1")
        except redis.ResponseError:
            return True, ""
        except _CONNECTION_ERRORS as exc:
            raise self._explain(exc) from None
        if _s(reply) == "OK":
            return True, ""
        return False, (f"the Redis user '{sanitize(user)}' may not write the command stream "
                       f"of job {self.keys.job_id} on {self.endpoint.display} "
                       f"({sanitize(_s(reply))})")


def issuer() -> str:
    """Who sends a command or a stack request: ``user@host`` of this console."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no passwd entry and no $USER (some containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def id_key(entry_id: str) -> tuple[int, int]:
    """A stream id as a sortable pair (ms, sequence)."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0
