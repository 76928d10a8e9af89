"""Restart patterns: a restart storm, a suspect node, rounds that end without progress.

Pure logic, no I/O (``pattern_watch.py`` reads and writes Redis). After each round that cost
a restart (a worker failed, the job stalled, a node was lost), the agent that claimed the
restart appends a :class:`RoundEnd` to the job's capped history and :func:`analyse` looks at
that history:

* **restart storm**: at least ``storm_restarts`` round ends within ``storm_minutes``
  (NVIDIA's resiliency extension alerts on 5 in 30 minutes: the defaults);
* **suspect node**: a node present in every one of the last ``suspect_rounds`` round ends
  (its worker was the round's root cause, or it was lost);
* **no progress**: the last ``no_progress_rounds`` round ends all came before any progress
  (stall.py's progress: output or CPU, later than one stall interval after the round began).

A value of 0 switches a pattern off. ``DO_NOT_REQUEUE`` is the agent's exit status when the
job failed with a pattern in its history, and the status of a node left out of the job.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Exit status meaning "do not requeue this job (or this node's task)": a scheduler's wrapper
#: that requeues failed jobs should not requeue this one; the same failure would come back.
#: NVIDIA's resiliency extension uses the same number for the same meaning.
DO_NOT_REQUEUE = 93
#: Round ends kept in Redis (LTRIM): the longest window a pattern may look at.
HISTORY_CAP = 64
STORM_POLICIES = ("observe", "stop")


@dataclass(frozen=True)
class PatternSettings:
    """The flags (see :func:`add_arguments`)."""

    storm_restarts: int = 5
    storm_minutes: float = 30.0
    suspect_rounds: int = 3
    no_progress_rounds: int = 3
    exclude_suspects: bool = False
    on_storm: str = "observe"


@dataclass(frozen=True)
class RoundEnd:
    """One round that ended with a restart (or the job's failure)."""

    round: int
    ms: int  # Redis server time of the end
    reason: str  # failure | stalled | lost
    nodes: tuple[str, ...] = ()  # the nodes in the failure: the root cause's, the lost ones
    progressed: bool | None = None  # None: unknown (stall detection off)

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "ms": self.ms, "reason": self.reason,
                           "nodes": list(self.nodes), "progressed": self.progressed},
                          separators=(",", ":"))

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> RoundEnd:
        """From ``round_records.decode_round_end``'s checked dict."""
        return cls(d["round"], d["ms"], d["reason"], tuple(d["nodes"]), d["progressed"])


@dataclass(frozen=True)
class Storm:
    restarts: int
    minutes: float
    rounds: tuple[int, ...]


@dataclass(frozen=True)
class Patterns:
    """What :func:`analyse` found; empty when nothing stands out."""

    storm: Storm | None = None
    suspects: tuple[str, ...] = ()
    suspect_rounds: tuple[int, ...] = ()
    no_progress_rounds: tuple[int, ...] = ()
    excluded: tuple[str, ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.storm or self.suspects or self.no_progress_rounds)

    def summary(self) -> str:
        """One line for people (the agent's terminal, the reason of ``do_not_requeue``)."""
        parts = []
        if self.storm:
            parts.append(f"restart storm: {self.storm.restarts} restarts within "
                         f"{self.storm.minutes:g} min")
        if self.suspects:
            parts.append(f"suspect node{'s' if len(self.suspects) > 1 else ''} "
                         f"{', '.join(self.suspects)} (in every failure of the last "
                         f"{len(self.suspect_rounds)} rounds)")
        if self.no_progress_rounds:
            parts.append(f"the last {len(self.no_progress_rounds)} rounds ended without "
                         "progress")
        return "; ".join(parts)


def progressed(newest: str | None, round_: int, started_ms: int, grace_ms: int) -> bool:
    """Whether round ``round_`` (begun at server ms ``started_ms``) made progress, from the
    job's ``progress:newest`` value ``"<round> <ms>"`` (stall.py): progress of this round
    later than ``grace_ms`` after its start (the start itself counts as progress there)."""
    parts = (newest or "").split(" ")
    if len(parts) != 2 or not all(p.isdigit() and len(p) < 19 for p in parts):
        return False
    return int(parts[0]) == round_ and int(parts[1]) > started_ms + grace_ms


def analyse(history: Sequence[RoundEnd], now_ms: int, s: PatternSettings) -> Patterns:
    """The patterns in ``history`` (newest first, as Redis's list holds it). O(len(history)):
    bounded by ``HISTORY_CAP``, never by the job's size."""
    storm = None
    if s.storm_restarts > 0:
        since = now_ms - int(s.storm_minutes * 60_000)
        recent = [e for e in history if e.ms >= since]
        if len(recent) >= s.storm_restarts:
            storm = Storm(len(recent), s.storm_minutes, tuple(e.round for e in recent))
    suspects: tuple[str, ...] = ()
    suspect_rounds: tuple[int, ...] = ()
    k = s.suspect_rounds
    if k > 0 and len(history) >= k:
        last = history[:k]
        common = set(last[0].nodes)
        for e in last[1:]:
            common &= set(e.nodes)
        if common:
            suspects, suspect_rounds = tuple(sorted(common)), tuple(e.round for e in last)
    stuck: tuple[int, ...] = ()
    n = s.no_progress_rounds
    if n > 0 and len(history) >= n and all(e.progressed is False for e in history[:n]):
        stuck = tuple(e.round for e in history[:n])
    return Patterns(storm, suspects, suspect_rounds, stuck)


def may_exclude(group_world_size: int, min_nodes: int, already: int) -> bool:
    """Whether the job can leave one more node out: the round had more nodes than the
    minimum, counting those excluded already in this decision."""
    return group_world_size - already - 1 >= min_nodes


# -- flags ---------------------------------------------------------------------------------

def add_arguments(add: Any) -> None:
    """The agent's flags for restart patterns (``add`` is the parser's ``add_argument``)."""
    add("--restart-storm", dest="restart_storm", default="5/30", metavar="N/MIN",
        help="a `restart_storm` event (and a console banner) when N restarts come within MIN "
        "minutes (default 5/30; 0 switches it off)")
    add("--on-restart-storm", dest="on_restart_storm", default="observe",
        choices=STORM_POLICIES,
        help="observe (the event only, the default) or stop: the job fails at once, every "
        f"agent exiting {DO_NOT_REQUEUE} (do not requeue)")
    add("--suspect-rounds", dest="suspect_rounds", default="3", metavar="K",
        help="a `suspect_node` event when one node was in every failure of K consecutive "
        "restarts: its worker failed first, or it was lost (default 3; 0: off)")
    add("--no-progress-rounds", dest="no_progress_rounds", default="3", metavar="K",
        help="a `no_progress` event when K consecutive rounds ended before making progress "
        "(output or CPU, as --stall-timeout counts it; needs stall detection; default 3; 0: off)")
    add("--exclude-suspect-nodes", dest="exclude_suspect_nodes", action="store_true",
        help="a suspect node leaves the job (exit status "
        f"{DO_NOT_REQUEUE}) while the others re-form without it, when the job has nodes to "
        "spare (more than the minimum of --nnodes)")


def settings_from(ns: argparse.Namespace) -> PatternSettings:
    """The settings from parsed flags; ``ValueError`` with one clear sentence otherwise."""
    text = str(ns.restart_storm).strip()
    if text == "0":
        storm_n, storm_min = 0, 30.0
    else:
        n, sep, m = text.partition("/")
        try:
            storm_n, storm_min = int(n), float(m)
        except ValueError:
            storm_n, storm_min = -1, 0.0
        if not sep or not 1 <= storm_n <= HISTORY_CAP or not 0 < storm_min <= 100_000:
            raise ValueError(f"--restart-storm {text!r}: give N/MIN, N restarts (1 to "
                             f"{HISTORY_CAP}) within MIN minutes, e.g. 5/30; or 0 (off)")
    counts = {}
    for flag, value in (("--suspect-rounds", ns.suspect_rounds),
                        ("--no-progress-rounds", ns.no_progress_rounds)):
        try:
            counts[flag] = int(value)
        except (TypeError, ValueError):
            counts[flag] = -1
        if not 0 <= counts[flag] <= HISTORY_CAP:
            raise ValueError(f"{flag} {value!r}: give a number of rounds from 0 (off) to "
                             f"{HISTORY_CAP}")
    return PatternSettings(storm_n, storm_min, counts["--suspect-rounds"],
                           counts["--no-progress-rounds"], bool(ns.exclude_suspect_nodes),
                           ns.on_restart_storm)
