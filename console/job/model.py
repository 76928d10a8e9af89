"""What a job's fold is made of: the states a job, a rank and a node can be in; the entries
a :class:`~elastic_console.job.state.JobView` keeps per node (:class:`NodeInfo`), per rank
(:class:`RankState`: a row of the console's rank table and of ``status``) and per thing that
happened (:class:`TimelineEntry`); and the bounds that keep a view small whatever the records
say (see :mod:`elastic_console.job.state`).

Plain data, no I/O (its one rule: a rank keeps its newest ``RESOURCE_HISTORY`` resource
samples): the parts of the fold (state, event_fold, log_fold), the CLI and the screens that
draw a view share these names, and none of them needs another to know what "stalled" is.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["EXITED", "FAILED", "FINAL_STATES", "JOINED", "LEFT", "LOST", "MAX_DETAIL_CHARS",
           "MAX_NOTE_CHARS", "MAX_VIEW_NODES", "MAX_VIEW_RANKS", "RESOURCE_HISTORY", "RESTARTING",
           "RUNNING", "SLOW", "STALLED", "STOPPED", "SUCCEEDED", "WAITING", "WAITS", "NodeInfo",
           "RankState", "TimelineEntry"]

#: Job states.
WAITING, RUNNING, RESTARTING = "waiting", "running", "restarting"
#: Shown instead of the folded state while no agent of an unfinished job is heartbeating.
LOST = "lost"
FAILED, SUCCEEDED, STOPPED = "failed", "succeeded", "stopped"
FINAL_STATES = frozenset({FAILED, SUCCEEDED, STOPPED})

#: Rank states (plus RUNNING, RESTARTING, FAILED, STOPPED above).
EXITED = "exited"
#: A stall (``stalled`` event): the odd ranks, and the ranks waiting for them.
STALLED, WAITS = "stalled", "waiting"
#: A straggler (``straggler`` event, issue 22): running, persistently slower than the others.
SLOW = "slow"

#: Node states.
JOINED, LOST, LEFT = "joined", "lost", "left"

RESOURCE_HISTORY = 120  # samples kept per rank for sparklines (two minutes at 1 Hz)

#: The most ranks (entries and log rings) and nodes a view keeps: the design's largest job,
#: 32,768 ranks on 4,096 nodes (twice as many node ids: agents restart with new ones). A rank
#: entry costs ~1.7 KiB before its lines. Records that name more are ignored and counted, so
#: no forged event can make a console or a CLI command hold more (issue 24: three 1 MB events
#: of 140k ranks each drove ``status`` to 899 MB).
MAX_VIEW_RANKS = 32_768
MAX_VIEW_NODES = 8_192
#: Timeline entries keep at most this much text and detail (a traceback: its head and tail):
#: the timeline holds ``TIMELINE_LIMIT`` entries, each from an event of up to 1 MiB.
MAX_NOTE_CHARS = 1_024
MAX_DETAIL_CHARS = 16_384


@dataclass(slots=True)
class NodeInfo:
    """One agent (node) of the job. ``group_rank`` is None when it is in no completed round."""

    host: str
    status: str = JOINED  # joined | lost | left
    group_rank: int | None = None
    nproc: int = 0


@dataclass(slots=True)
class RankState:
    """One global rank: where it runs, how it is, what it costs."""

    rank: int
    host: str = ""
    node: str = ""
    local_rank: int | None = None
    pid: int | None = None
    state: str = RUNNING  # running | restarting | failed | exited | stopped
    restarts: int = 0  # times this rank was started, minus 1
    last_exit: int | str | None = None  # exit code, or the signal's name ("SIGKILL")
    cpu: float | None = None  # percent of one core, the worker's whole process tree
    rss: int | None = None  # bytes
    threads: int | None = None
    last_line_ms: int = 0  # server ms of its last log line
    #: Server ms of its exit (exited, failed, stopped): its QUIET stops counting there. 0 while
    #: it runs.
    ended_ms: int = 0
    # Plain doubles, RESOURCE_HISTORY at most (_push): as deques of Python numbers the samples
    # of 32,768 ranks took 382 MiB, as arrays 64 (issue 21: the console in 1 GiB).
    cpu_history: array[float] = field(default_factory=lambda: array("d"))
    rss_history: array[float] = field(default_factory=lambda: array("d"))
    starts: int = 0
    sample_ts: float | None = None  # the last sample's own timestamp: a repeat is not new


class TimelineEntry(NamedTuple):
    """One thing that happened to the job, in server time. ``detail``: e.g. a traceback."""

    server_ms: int
    kind: str  # rendezvous | node | failure | group_failed | restart | restarted | ack | job | logs
    text: str
    detail: str = ""
    ref: str = ""  # a ``stalled`` entry: the id of its stacks capture (enter shows it)


def _push(history: array[float], value: float) -> None:
    """Append to a rank's samples, keeping the newest RESOURCE_HISTORY."""
    try:
        history.append(value)
    except OverflowError:  # an int too big for a double (hostile): as big as one gets
        history.append(float("inf"))
    if len(history) > RESOURCE_HISTORY:
        del history[0]
