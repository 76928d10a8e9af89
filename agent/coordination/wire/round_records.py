"""The records of a job's rendezvous rounds: what a node says when it joins, who is in a
completed round, and how a round that cost a restart ended.

:class:`NodeDescription` and :class:`RoundInfo` are JSON values of the ``rdzv:*`` keys
(coordination/rendezvous/drivers.py writes them); a round end is an entry of
``JobKeys.restart_history`` (supervision/diagnosis/restart_patterns.py). Their decoders raise
:class:`~.protocol.ProtocolError` (a round end: return ``None``) for anything malformed.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .protocol import (
    MAX_NAME_CHARS,
    MAX_RANK,
    MAX_RECORD_LIST,
    ProtocolError,
    _int_in,
    _name,
    decode_json,
    record_list,
)

#: The longest node description or round record a reader decodes.
MAX_RDZV_RECORD_BYTES = 4 * 1024 * 1024
#: The most nodes a round record may name (the design's largest job has 4,096): a round of
#: more is refused whole, as a record list longer than a reader takes.
MAX_ROUND_NODES = MAX_RECORD_LIST
#: The most workers a round's nodes may add up to: every global rank of the round must be a
#: rank the protocol can name (``protocol.MAX_RANK``). Readers expand far fewer ranks than
#: this (see ``stack_replies.MAX_REQUEST_RANKS``); nothing builds a table per rank of a round.
MAX_ROUND_RANKS = MAX_RANK

#: A round end record (JobKeys.restart_history) is at most this long; longer ones are skipped.
MAX_ROUND_END_BYTES = 16 * 1024
#: At most this many nodes are named in one round end.
MAX_ROUND_END_NODES = 64


def decode_round_end(raw: str | bytes) -> dict[str, Any] | None:
    """One entry of ``JobKeys.restart_history``: ``{"round", "ms", "reason", "nodes",
    "progressed", "by", "step"}`` with their types checked (``by``, the claimer's node id:
    ``""`` when missing; ``step``, the highest step the round reached: None when missing or
    not a step); ``None`` for anything malformed (skipped)."""
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
    by = d.get("by", "")
    if not isinstance(by, str) or len(by) > MAX_NAME_CHARS:
        return None
    nodes = [n for n in record_list(d.get("nodes"), MAX_ROUND_END_NODES)
             if isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS]
    step = d.get("step")  # the highest step the round reached; absent in older records
    if not (type(step) is int and 0 <= step < 1 << 53):
        step = None
    return {"round": rnd, "ms": ms, "reason": reason, "nodes": nodes, "progressed": progressed,
            "by": by, "step": step}


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

    @cached_property
    def _bases(self) -> list[int]:
        # Global rank of each node's local rank 0, in group-rank order: O(nodes), never a
        # table per rank (a forged nproc of 2**24 must not cost 2**24 entries).
        out, base = [], 0
        for n in self.nodes:
            out.append(base)
            base += int(n.get("nproc", 0))
        return out

    def placement(self, rank: int) -> tuple[str, str]:
        """``(node, host)`` running global ``rank`` in this round, ``("", "")`` for a rank
        outside it. O(log nodes), whatever the round's size."""
        i = bisect_right(self._bases, rank) - 1
        if i < 0 or rank >= self._bases[i] + int(self.nodes[i].get("nproc", 0)):
            return "", ""
        n = self.nodes[i]
        return str(n.get("node", "")), str(n.get("host", ""))

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
        """Raises :class:`ProtocolError` for anything but a well-formed round: at most
        ``MAX_ROUND_NODES`` nodes, exactly ``world_size`` of them in group-rank order, their
        workers adding up to at most ``MAX_ROUND_RANKS``."""
        d = decode_json(raw, "round record", MAX_RDZV_RECORD_BYTES)
        if not isinstance(d, dict) or not isinstance(d.get("nodes"), list) or not d["nodes"]:
            raise ProtocolError("round record has no list of nodes")
        world = _int_in(d, "world_size", 1, MAX_ROUND_NODES)
        if len(d["nodes"]) != world:
            raise ProtocolError(f"round record names {len(d['nodes'])} nodes for a world of "
                                f"{world}")
        nodes, total = [], 0
        for i, n in enumerate(d["nodes"]):
            if not isinstance(n, dict):
                raise ProtocolError("round record has a node that is not an object")
            node = {**n, "node": _name(n, "node"), "host": _name(n, "host", ""),
                    "addr": _name(n, "addr"), "port": _int_in(n, "port", 0, 65535),
                    "nproc": _int_in(n, "nproc", 0, MAX_ROUND_RANKS, default=0),
                    "group_rank": _int_in(n, "group_rank", 0, MAX_ROUND_NODES)}
            if node["group_rank"] != i:
                raise ProtocolError(f"round record has group rank {node['group_rank']} in "
                                    f"place {i}")
            total += node["nproc"]
            if total > MAX_ROUND_RANKS:
                raise ProtocolError(f"round record's nodes run more than {MAX_ROUND_RANKS} "
                                    "workers")
            nodes.append(node)
        return RoundInfo(_int_in(d, "round", 0, 1 << 53), world, nodes,
                         _int_in(d, "completed_ms", 0, 1 << 53, default=0))
