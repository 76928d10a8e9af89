"""What the rendezvous says, without Redis: its settings, what a node gets from it (a round's
result, progress while waiting, the membership), its errors, and the decoding of the scripts'
replies into these.

Pure data and pure functions, testable without a server. The shapes decoded here are the ones
the scripts (rendezvous_scripts.py) return; a reply another writer broke becomes one clear
:class:`RendezvousError`, never a crash of the caller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..wire import protocol, round_records
from ..wire.round_records import RoundInfo


class RendezvousError(Exception):
    """Base of the rendezvous errors (torch_compat maps them to torch's classes)."""


class RendezvousClosedError(RendezvousError):
    """The job's rendezvous was closed: no new round can start."""


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete within ``join_timeout``."""


class RendezvousConnectionError(RendezvousError):
    """Redis could not be reached."""


class RendezvousOutOfMemoryError(RendezvousConnectionError):
    """Redis refused a write for lack of memory (``maxmemory``): an outage that ends when
    memory is freed; ``pressure.OOM`` has reported it already."""


@dataclass(frozen=True)
class RendezvousSettings:
    """Tunables, with their ``--rdzv-conf`` names. Times in seconds."""

    min_nodes: int = 1
    max_nodes: int = 1
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    heartbeat_timeout: float = 10.0
    keep_alive_interval: float = 2.0

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError(f"min nodes must be at least 1, not {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"max nodes ({self.max_nodes}) must be at least min nodes ({self.min_nodes})"
            )
        for name in ("join_timeout", "last_call_timeout", "heartbeat_timeout",
                     "keep_alive_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        if self.keep_alive_interval >= self.heartbeat_timeout:
            raise ValueError(
                f"keep_alive_interval ({self.keep_alive_interval} s) must be shorter than "
                f"heartbeat_timeout ({self.heartbeat_timeout} s)"
            )

    @property
    def held_gap(self) -> float:
        """A node whose own beats were this far apart was held up (an outage, a stalled
        process): it calls nobody lost until the others had a heartbeat timeout to beat again.
        Half the heartbeat timeout, but never within the beats' normal spacing (up to 2.25
        keep-alive intervals: see ``RendezvousSteps._beat_due``), and at most the timeout."""
        return min(self.heartbeat_timeout,
                   max(self.heartbeat_timeout / 2, 2.5 * self.keep_alive_interval))


@dataclass(frozen=True)
class RendezvousResult:
    """What a completed round means for this node: O(1) in the job's size. The whole round
    (every node) is :meth:`RedisRendezvous.round_info`, for the one node that announces it."""

    round: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    #: Workers in the round (the nodes' nproc added up); 0 when the nodes did not say.
    total_workers: int = 0
    #: Global rank of this node's local rank 0.
    base_rank: int = 0
    completed_ms: int = 0


@dataclass(frozen=True)
class RendezvousProgress:
    """A snapshot while waiting, for progress displays."""

    round: int
    status: str  # "open", "waiting" (round complete without us) or "complete"
    joined: list[str]  # the members so far while they are few (_NAMES), else empty
    min_nodes: int
    max_nodes: int
    last_call_left: float | None  # seconds left in the last call, if it is running
    join_left: float  # seconds left before join_timeout
    joined_count: int = 0
    #: Members of the previous round not back yet (a count: naming them walks the round).
    missing_count: int = 0


@dataclass(frozen=True)
class Membership:
    """The job's rendezvous, read atomically at one server time.

    A node's loop reads a summary (:meth:`RedisRendezvous.lost_since_last_check`): counts,
    and the lists hold at most ``NAMES`` nodes each (``members`` and ``live`` empty).
    :meth:`RedisRendezvous.membership` reads every list in full."""

    round: int
    status: str
    closed: bool
    members: list[str]  # current round (open: joined so far; complete: by group rank)
    live: list[str]
    lost: list[str]  # members of the completed round whose heartbeats stopped
    left: list[str]  # members of the completed round that left on their own
    waiting: list[str]
    now_ms: int
    member_count: int = -1  # -1: len(members)
    left_count: int = -1
    waiting_count: int = -1
    live_count: int = -1
    is_member: bool | None = None  # the reading node's place in the round (summary only)

    def __post_init__(self) -> None:
        for name, of in (("member_count", "members"), ("left_count", "left"),
                         ("waiting_count", "waiting"), ("live_count", "live")):
            if getattr(self, name) < 0:
                object.__setattr__(self, name, len(getattr(self, of)))

    @property
    def whole(self) -> bool:
        return self.status == "complete" and not self.lost and not self.left_count


#: How many nodes a summary names per list (the rest are counted).
NAMES = 16


def decode_list(value: Any) -> list[str]:
    # A script's array reply: bytes each (JSON's, from older scripts: str); anything else is
    # empty (cjson encodes an empty Lua table as {}).
    return [_text(x) for x in value] if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def decode_result(head: Any, assign: Any) -> RendezvousResult:
    """A completed round's head and this node's assignment (``round group_rank base``)."""
    try:
        d = protocol.decode_json(head, "round head", round_records.MAX_RDZV_RECORD_BYTES)
        rnd, rank, base = (int(x) for x in assign.split())
        return RendezvousResult(
            round=rnd, group_rank=rank, group_world_size=int(d["world_size"]),
            master_addr=str(d["master_addr"]), master_port=int(d["master_port"]),
            total_workers=int(d.get("total_workers") or 0), base_rank=base,
            completed_ms=int(d.get("completed_ms") or 0))
    except (protocol.ProtocolError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousError(f"the rendezvous record is unreadable ({exc}): another writer "
                              "broke the job's keys; start it under a new --job-id") from None


def decode_summary(raw: Any) -> tuple[Membership, list[str]]:
    """The summary script's array (see _SUMMARY_FN) and its newly lost nodes. A state another
    writer broke (a round that is no number) truncates the array: one clear error."""
    try:
        (rnd, status, closed, n, member, live, lost, newly, left, n_left, waiting, n_waiting,
         now) = raw
        m = Membership(
            round=int(rnd), status=_text(status), closed=bool(closed), members=[], live=[],
            lost=decode_list(lost), left=decode_list(left), waiting=decode_list(waiting),
            now_ms=int(now), member_count=int(n), left_count=int(n_left),
            waiting_count=int(n_waiting), live_count=int(live), is_member=bool(member))
    except (ValueError, TypeError) as exc:
        raise RendezvousError(f"the rendezvous record is unreadable ({exc}): another writer "
                              "broke the job's keys; start it under a new --job-id") from None
    return m, decode_list(newly)


def decode_round(raw: Any) -> RoundInfo:
    try:
        return RoundInfo.decode(raw)
    except protocol.ProtocolError as exc:
        raise RendezvousError(f"the rendezvous record is unreadable ({exc}): another writer "
                              "broke the job's keys; start it under a new --job-id") from None


def decode_membership(raw: Any) -> Membership:
    """The membership script's JSON: every list in full (see _MEMBERSHIP)."""
    d = json.loads(raw)
    return Membership(
        round=int(d["round"]), status=str(d["status"]), closed=bool(d["closed"]),
        members=decode_list(d["members"]), live=decode_list(d["live"]),
        lost=decode_list(d["lost"]), left=decode_list(d["left"]),
        waiting=decode_list(d["waiting"]), now_ms=int(d["now"]))


def opens_a_round(entries: list[Any]) -> bool:
    """Whether notify-stream ``entries`` (as XREAD returns them) include a round being
    opened. Only a member of the completed round opens the next one, so to a member that
    read the stream from its own round on, this says "re-form" without asking Redis again:
    4,096 nodes woken together then send a join each rather than a summary and a join."""
    for entry in entries:
        fields = entry[1] if len(entry) > 1 else None
        if isinstance(fields, dict) and fields.get(b"e", fields.get("e")) in (b"open", "open"):
            return True
    return False
