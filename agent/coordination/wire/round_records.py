"""The records of a job's rendezvous rounds: what a node says when it joins, who is in a
completed round, and how a round that cost a restart ended.

:class:`NodeDescription` and :class:`RoundInfo` are JSON values of the ``rdzv:*`` keys
(coordination/rendezvous/drivers.py writes them); a round end is an entry of
``JobKeys.restart_history`` (supervision/diagnosis/restart_patterns.py). Their decoders raise
:class:`~.protocol.ProtocolError` (a round end: return ``None``) for anything malformed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .protocol import MAX_NAME_CHARS, MAX_RANK, ProtocolError, _int_in, _name, decode_json, record_list

#: The longest node description or round record a reader decodes.
MAX_RDZV_RECORD_BYTES = 4 * 1024 * 1024

#: A round end record (JobKeys.restart_history) is at most this long; longer ones are skipped.
MAX_ROUND_END_BYTES = 16 * 1024
#: At most this many nodes are named in one round end.
MAX_ROUND_END_NODES = 64


def decode_round_end(raw: str | bytes) -> dict[str, Any] | None:
    """One entry of ``JobKeys.restart_history``: ``{"round", "ms", "reason", "nodes",
    "progressed"}`` with their types checked; ``None`` for anything malformed (skipped)."""
    try:
        d = decode_json(raw, "a round end record", MAX_ROUND_END_BYTES)
    except ProtocolError:
        return None
    if not isinstance(d, dict):
        return None
    rnd, ms, reason, progressed = d.get("round"), d.get("ms"), d.get("reason"), d.get("progressed")
    if (type(rnd) is not int or not 0 <= rnd < 1 << 40 or type(ms) is not int or ms < 0
            or not isinstance(reason, str) or len(reason) > 32
            or progressed not in (True, False, None)):
        return None
    nodes = [n for n in record_list(d.get("nodes"), MAX_ROUND_END_NODES)
             if isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS]
    return {"round": rnd, "ms": ms, "reason": reason, "nodes": nodes, "progressed": progressed}


@dataclass(frozen=True)
class NodeDescription:
    """What a node says of itself when it joins a rendezvous."""

    node: str
    host: str
    addr: str
    port: int
    pid: int
    nproc: int = 0  # workers this node runs (0: not an elastic-agent, e.g. torchrun)
    node_rank: int | None = None  # the group rank a static node asks for

    def encode(self) -> str:
        d: dict[str, Any] = {"node": self.node, "host": self.host, "addr": self.addr,
                             "port": self.port, "pid": self.pid, "nproc": self.nproc}
        if self.node_rank is not None:
            d["node_rank"] = self.node_rank
        return json.dumps(d, separators=(",", ":"))

    @staticmethod
    def decode(raw: str | bytes) -> NodeDescription:
        """Raises :class:`ProtocolError` for anything but a well-formed description."""
        d = decode_json(raw, "node description", MAX_RDZV_RECORD_BYTES)
        if not isinstance(d, dict):
            raise ProtocolError("node description is not an object")
        return NodeDescription(_name(d, "node"), _name(d, "host"), _name(d, "addr"),
                               _int_in(d, "port", 0, 65535), _int_in(d, "pid", 0, 1 << 31),
                               _int_in(d, "nproc", 0, MAX_RANK, default=0),
                               _int_in(d, "node_rank", 0, MAX_RANK) if "node_rank" in d else None)


@dataclass(frozen=True)
class RoundInfo:
    """A completed rendezvous round: who is in it and with which group rank."""

    round: int
    world_size: int
    nodes: list[dict[str, Any]]  # [{node, host, addr, port, pid, nproc, group_rank}], by rank
    completed_ms: int

    def base_rank(self, group_rank: int) -> int:
        """Global rank of local rank 0 on the node with ``group_rank`` (nodes may differ in
        how many workers they run)."""
        return sum(int(n.get("nproc", 0)) for n in self.nodes[:group_rank])

    @property
    def total_workers(self) -> int:
        return sum(int(n.get("nproc", 0)) for n in self.nodes)

    def rank_of(self, node: str) -> int | None:
        for n in self.nodes:
            if n["node"] == node:
                return int(n["group_rank"])
        return None

    def master(self) -> tuple[str, int]:
        """Address and port published by group rank 0 for the workers' process group."""
        first = self.nodes[0]
        return first["addr"], int(first["port"])

    @staticmethod
    def decode(raw: str | bytes) -> RoundInfo:
        """Raises :class:`ProtocolError` for anything but a well-formed round."""
        d = decode_json(raw, "round record", MAX_RDZV_RECORD_BYTES)
        if not isinstance(d, dict) or not isinstance(d.get("nodes"), list) or not d["nodes"]:
            raise ProtocolError("round record has no list of nodes")
        nodes = []
        for n in d["nodes"]:
            if not isinstance(n, dict):
                raise ProtocolError("round record has a node that is not an object")
            nodes.append({**n, "node": _name(n, "node"), "host": _name(n, "host", ""),
                          "addr": _name(n, "addr"), "port": _int_in(n, "port", 0, 65535),
                          "nproc": _int_in(n, "nproc", 0, MAX_RANK, default=0),
                          "group_rank": _int_in(n, "group_rank", 0, MAX_RANK)})
        return RoundInfo(_int_in(d, "round", 0, 1 << 53), _int_in(d, "world_size", 1, MAX_RANK),
                         nodes, _int_in(d, "completed_ms", 0, 1 << 53, default=0))
