"""Chaos at scale: many agents on one machine, one Redis, a console attached, and faults.

What runs
  One redis-server (no RDB, no AOF); ``--agents`` elastic-agents on this machine, each with
  ``--nproc-per-node --workers`` small workers (a line every ``--tick`` seconds until the end
  file exists, then a last line naming their rank, world size and pid, and exit 0),
  ``--nnodes AGENTS-1:AGENTS`` so the job re-forms without the agent it loses, and
  ``--max-restarts 1000``. The console is attached headless: the Textual app itself
  (``ConsoleApp``) under ``App.run_test()``, following the job through its own JobClient,
  driven by Pilot keys. The bench also follows the event stream with a JobClient of its own,
  from before the first agent starts: the empty Redis loses every event written before it,
  and the counts below need all of them.

What is injected (a schedule drawn from ``--seed``, one episode at a time, each started once
the job is stable: every live agent's workers running in one completed round, every worker
alive, the console showing that round and those pids)
  * worker kills: SIGKILL to 1..``--max-kills`` (3) random workers of the round (often on different agents),
    spread over up to ``--stagger`` seconds;
  * one agent SIGKILL (its keeper takes its workers along);
  * one Redis restart, empty: SIGKILL, then a new server on the same port after
    ``--redis-down`` seconds (1-3 by default);
  * restart commands: from the console (keys ``r`` then ``y`` in its confirm dialog) or from
    ``elastic-console restart JOB --yes``.
  Episodes are spread over ``--duration`` seconds; an episode that takes longer pushes the
  next one back (the schedule, not the clock, is what the seed fixes).

How failures map to restarts (what the agents must count, and what is compared)
  A restart is spent per *round* whose worker group failed, claimed once job-wide
  (``restart_claim:<round>``): all kills of one episode land in the same round, so one
  episode is exactly one restart however many workers it hit on however many agents; its
  ``group_failed`` names one of the killed ranks as root cause, and one ``restarting`` event
  with reason ``failure`` follows. A lost agent, a restart command and an empty Redis spend
  none: a lost agent makes one new round (one ``restarting``, reason ``membership``, claimed
  once per round), a restart command one new round (every agent acks it and says
  ``restarting``, reason ``command``), an empty Redis no new round and no new worker. So:
  restart counter = kill episodes; rounds gained = kill episodes + agent kills + commands.

What is verified after the end file (printed as a table; exit status 1 on any mismatch)
  * the job succeeded; each surviving worker's last line is its final line, in Redis (its
    node's log stream), in its log file (``<log-dir>/<job>_<random>/attempt_<round>/<local rank>/stdout.log``)
    and in the console; and its final attempt's whole output is in Redis and in the console
    as in the file, in order and once (if Redis was emptied during that attempt, the lines
    it held are gone from it: then only lines left out are allowed, and counted);
  * the counts above: the restart counter in Redis, ``restarts_used`` of ``status --json`` and
    of ``job_succeeded``, ``group_failed`` rounds, ``restarting`` events by reason, lost nodes,
    rounds; each surviving rank's restart count in the console (rounds since the start);
  * the Redis restart changed no round and no worker, and the agents put the job back;
  * no agent stuck: the survivors exit 0 within ``--exit-timeout`` s of the end file;
  * no orphan: no process ever seen in an agent's tree (sampled every 0.5 s) and no process
    running the run's worker script is alive at the end;
  * the console's final state equals ``elastic-console status JOB --json``, field by field,
    except what the empty Redis took with it, which is compared by rule: a rank's
    ``restarts`` in the console exceeds the status's by the restarts the console had seen
    when Redis went (status counts from the restored announcement); nodes gone before it
    (lost, or only in earlier rounds) are known to the console only; the root cause is the
    status's only if a failure came after it.

    python bench/chaos.py [--agents 16] [--workers 8] [--duration 150] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.event_records import Event, EventType
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, JobKeys
from elastic_agent.coordination.wire.log_records import STDOUT, decode_log_entries
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_console.commands.read import status_object
from elastic_console.job.client import JobClient
from elastic_console.job.log_fold import BatchDeduper
from elastic_console.job.state import ConnectionChange, JobView
from elastic_console.tui.app import ConsoleApp

AGENT = [sys.executable, "-m", "elastic_agent.supervision.cli"]
CONSOLE = [sys.executable, "-m", "elastic_console.cli"]
#: Agents started on one machine share it with everything else: generous rendezvous times.
#: The last call outlasts the slowest agent's way back into a re-forming round (the
#: survivors' stacks, 2 s at most, then its workers' stop, up to ``--shutdown-timeout``
#: (5 s): with ``--nnodes AGENTS-1:AGENTS`` a round that completed without it would leave it
#: waiting, and one episode would cost two rounds. (The rendezvous waits past the last call
#: for a member that still beats too, one heartbeat timeout more: docs/PROTOCOL.md.)
DEFAULT_RDZV = "last_call_timeout=8,heartbeat_timeout=6,keep_alive_interval=1,join_timeout=300"
EPISODE_S = 12.0  # one episode per this many seconds of --duration, by default

WORKER = '''\
"""A chaos worker: a line every TICK s until the END file exists, then its last line."""
import os
import sys
import time

end, tick = sys.argv[1], float(sys.argv[2])
rank, world, pid = os.environ["RANK"], os.environ["WORLD_SIZE"], os.getpid()
print(f"start rank={rank} world={world} pid={pid}", flush=True)
i, next_tick = 0, 0.0
while not os.path.exists(end):
    if time.monotonic() >= next_tick:
        print(f"tick {i} rank={rank}", flush=True)
        i, next_tick = i + 1, time.monotonic() + tick
    time.sleep(0.1)
print(f"final rank={rank} world={world} pid={pid}", flush=True)
'''


def final_line(rank: int, world: int, pid: int) -> str:
    """What a surviving worker prints last (the WORKER script's last line)."""
    return f"final rank={rank} world={world} pid={pid}"


# -- configuration and results ----------------------------------------------------------------


@dataclass
class Config:
    agents: int = 16
    workers: int = 8
    duration: float = 150.0
    seed: int = 1
    episodes: int | None = None  # default: duration / EPISODE_S, at least 4
    rdzv_conf: str = DEFAULT_RDZV
    tick: float = 0.5
    settle_timeout: float = 180.0  # an episode's recovery, and the start
    exit_timeout: float = 120.0  # the agents' exit after the end file
    shutdown_timeout: float = 5.0
    max_kills: int = 3  # workers killed per episode: 1 to this many
    stagger: float = 0.5  # an episode's kills are spread over up to this many seconds
    redis_down: tuple[float, float] = (1.0, 3.0)  # the empty Redis is away this long (range)
    keep: bool = False  # keep the run's directory (agent outputs, log files)
    verbose: bool = True


@dataclass
class Episode:
    kind: str  # kill_workers | kill_agent | restart_redis | command
    at_s: float = 0.0  # when it was injected, seconds after the chaos began
    detail: str = ""
    round_before: int = -1
    round_after: int = -1
    recovery_s: float | None = None  # injected -> stable again (None: never)
    console_lag_s: float | None = None  # stable -> the console shows it (None: never)
    killed: dict[int, int] = field(default_factory=dict)  # rank -> pid (kill_workers)
    node: str = ""  # kill_agent: the agent's node id
    command_id: str = ""
    via: str = ""  # command: console | cli
    accepted: int = 0  # command: agents that accepted it (as the sender saw it)
    expected_acks: int = 0
    pids_before: dict[int, int] = field(default_factory=dict)
    pids_after: dict[int, int] = field(default_factory=dict)


@dataclass
class Check:
    name: str
    expected: Any
    observed: Any
    ok: bool
    note: str = ""


@dataclass
class ChaosResult:
    config: Config
    job: str
    episodes: list[Episode]
    checks: list[Check]
    wall_s: float
    workdir: Path | None = None
    #: The console's final state and ``status --json`` as compared, and what the console
    #: knew when Redis was emptied (the rules of ``compare``).
    console_json: dict[str, Any] = field(default_factory=dict)
    status_json: dict[str, Any] = field(default_factory=dict)
    lost: BeforeRedis | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def of(self, kind: str) -> list[Episode]:
        return [e for e in self.episodes if e.kind == kind]

    def table(self) -> str:
        c = self.config
        lines = [f"chaos: {c.agents} agents x {c.workers} workers, seed {c.seed}, "
                 f"job {self.job}, {self.wall_s:.0f} s wall", "", "injected:"]
        for e in self.episodes:
            rec = "never stable" if e.recovery_s is None else f"stable after {e.recovery_s:.1f} s"
            lines.append(f"  t={e.at_s:6.1f}s  {e.kind:<13} {e.detail}  (round {e.round_before}"
                         f" -> {e.round_after}, {rec})")
        lines.append("")
        w = max(len(x.name) for x in self.checks)
        we = max(len(_fmt(x.expected)) for x in self.checks)
        lines.append(f"  {'check':<{w}}  {'expected':<{we}}  observed")
        for x in self.checks:
            mark = "ok " if x.ok else "MISMATCH "
            note = f"  ({x.note})" if x.note else ""
            lines.append(f"  {x.name:<{w}}  {_fmt(x.expected):<{we}}  {_fmt(x.observed)}  "
                         f"{mark}{note}".rstrip())
        for kind in ("kill_workers", "kill_agent", "restart_redis", "command"):
            times = [e.recovery_s for e in self.of(kind) if e.recovery_s is not None]
            if times:
                lines.append(f"  recovery after {kind}: median {statistics.median(times):.1f} s, "
                             f"max {max(times):.1f} s (n={len(times)})")
        lags = [e.console_lag_s for e in self.episodes if e.console_lag_s is not None]
        if lags:
            lines.append(f"  console caught up after each episode: max {max(lags):.2f} s later")
        lines.append("")
        lines.append("RESULT: " + ("every check passed" if self.ok else "MISMATCH: " + ", ".join(
            x.name for x in self.checks if not x.ok)))
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    """A value for the table: long lists and dicts summarised (the check compares them whole)."""
    if isinstance(value, (set, frozenset)):
        value = sorted(value)
    if isinstance(value, dict) and len(value) > 4:
        counts: dict[str, int] = {}
        for v in value.values():
            counts[str(v)] = counts.get(str(v), 0) + 1
        return f"{len(value)}: " + ", ".join(f"{n} x {v}" for v, n in sorted(counts.items()))
    if isinstance(value, list) and len(value) > 3:
        return f"{len(value)} items"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 48 else text[:45] + "..."


def plan(cfg: Config, rng: random.Random) -> list[str]:
    """The episodes in order: one agent kill, one Redis restart, and kills and commands (at
    least one of each) in between, shuffled by ``rng``."""
    n = max(4, cfg.episodes or round(cfg.duration / EPISODE_S))
    rest = ["kill_workers", "command"] + [
        "kill_workers" if rng.random() < 0.65 else "command" for _ in range(n - 4)]
    rng.shuffle(rest)
    for kind in ("kill_agent", "restart_redis"):
        rest.insert(rng.randint(0, len(rest)), kind)
    return rest


# -- the run's pieces -------------------------------------------------------------------------


class Agents:
    """The elastic-agent processes; each one's output goes to a file."""

    def __init__(self, cfg: Config, url: str, job: str, workdir: Path, script: Path,
                 end_file: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.out_paths: list[Path] = []
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONUNBUFFERED"] = "1"
        args = [*AGENT, "--redis", url, "--job-id", job, "--local-addr", "127.0.0.1",
                "--nnodes", f"{max(1, cfg.agents - 1)}:{cfg.agents}",
                "--nproc-per-node", str(cfg.workers), "--max-restarts", "1000",
                "--rdzv-conf", cfg.rdzv_conf, "--shutdown-timeout", str(cfg.shutdown_timeout),
                "--log-dir", str(workdir / "logs"), str(script), str(end_file), str(cfg.tick)]
        for i in range(cfg.agents):
            out = workdir / f"agent-{i}.out"
            with open(out, "wb") as f:
                self.procs.append(subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT,
                                                   env=env, start_new_session=True))
            self.out_paths.append(out)
        self.pids = [p.pid for p in self.procs]
        self.killed: set[int] = set()  # indexes

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def output(self, i: int) -> str:
        return self.out_paths[i].read_text(errors="replace")

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


class Tracker:
    """Every process seen in an agent's tree (pid, start time), sampled until the end."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.seen: dict[int, float] = {}

    def scan(self) -> None:
        children: dict[int, list[int]] = {}
        times: dict[int, float] = {}
        for p in psutil.process_iter(["pid", "ppid", "create_time"]):
            children.setdefault(p.info["ppid"], []).append(p.info["pid"])
            times[p.info["pid"]] = p.info["create_time"]
        todo = [r for r in self.roots if r in times]
        while todo:
            pid = todo.pop()
            if pid not in self.seen and pid in times:
                self.seen[pid] = times[pid]
            todo.extend(c for c in children.get(pid, ()) if c not in self.seen)

    def alive(self, marker: str) -> list[str]:
        """Processes of the run still alive: seen in a tree, or running ``marker`` (the run's
        worker script) whether seen or not. Zombies are dead (their parent reaps them)."""
        out = []
        for pid, created in self.seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {' '.join(p.cmdline())[:80]}")
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if (marker in cmd and p.info["status"] != psutil.STATUS_ZOMBIE
                    and p.info["pid"] not in self.seen and p.info["pid"] != os.getpid()):
                out.append(f"{p.info['pid']} {cmd[:80]}")
        return out

    def kill(self, marker: str) -> None:
        for entry in self.alive(marker):
            with contextlib.suppress(psutil.Error, ValueError):
                psutil.Process(int(entry.split()[0])).kill()


@dataclass
class RoundState:
    """The job's current round as the event stream tells it."""

    round: int
    world: int
    members: list[str]
    started: dict[str, Event]  # member node -> its latest workers_started of this round

    def pids(self) -> dict[int, int]:
        out = {}
        for ev in self.started.values():
            out.update(zip(ev.data.get("ranks") or [], ev.data.get("pids") or []))
        return out

    def complete(self) -> bool:
        return (set(self.started) == set(self.members)
                and sorted(self.pids()) == list(range(self.world)))


class Observer:
    """The bench's own reader of the job's events (deduplicated by node and sequence)."""

    def __init__(self, url: str, job: str) -> None:
        self.client = JobClient(url, job)
        self.events: list[Event] = []
        self._seen: set[tuple[str, int]] = set()
        self.outages = 0

    async def run(self) -> None:
        async for rec in self.client.follow(logs=False):
            if isinstance(rec, Event):
                if rec.seq and (rec.node, rec.seq) in self._seen:
                    continue
                self._seen.add((rec.node, rec.seq))
                self.events.append(rec)
            elif isinstance(rec, ConnectionChange) and not rec.connected:
                self.outages += 1

    def of(self, kind: str, since: int = 0) -> list[Event]:
        return [e for e in self.events[since:] if e.type == kind]

    def nodes_by_pid(self) -> dict[int, str]:
        return {e.data.get("pid"): e.node for e in self.of(EventType.NODE_JOINED)}

    def current(self) -> RoundState | None:
        rcs = self.of(EventType.RENDEZVOUS_COMPLETE)
        if not rcs:
            return None
        rc = max(rcs, key=lambda e: e.data.get("round", -1))
        rnd = rc.data.get("round")
        started = {e.node: e for e in self.of(EventType.WORKERS_STARTED)
                   if e.data.get("round") == rnd}
        return RoundState(rnd, rc.data.get("world_size", 0),
                          [n["node"] for n in rc.data.get("nodes") or []], started)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def until(predicate: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    """The predicate's first truthy value, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value or None
        await asyncio.sleep(step)  # the conditions are in other processes: look again


async def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, [*CONSOLE, *args], capture_output=True,
                                   text=True, timeout=timeout)


# -- the console's state as `status --json` shows it ------------------------------------------


def view_json(view: JobView, job: str, redis_display: str) -> dict[str, Any]:
    """The console's view in the shape of ``elastic-console status JOB --json``."""
    out = status_object(view, job, redis_display)
    return json.loads(json.dumps(out, default=str))  # the same types a JSON reader gets


@dataclass
class BeforeRedis:
    """What the console knew when Redis was emptied (the rules for what Redis lost)."""

    restarts: dict[int, int]  # rank -> restarts
    members: set[str]  # the round's nodes: the restored announcement names them again
    root_cause: Any
    failures_after: int = 0  # kill episodes after the Redis restart


def compare(console: dict[str, Any], status: dict[str, Any], lost: BeforeRedis | None) -> list[str]:
    """Differences between the console's state and ``status --json``, after the rules for
    what an empty Redis took (see the module docstring). Empty: equal."""
    diffs = []
    c, s = dict(console), dict(status)
    # The TTL Redis had left on the job's records when `status` ran: a clock reading at that
    # moment, not job state the console folds from events (its header reads the TTL itself).
    s.pop("expires_in_s", None)
    if lost is not None:
        # Ranks: status counts starts from the restored announcement on.
        s_ranks = []
        for r in s.get("ranks") or []:
            r = dict(r)
            if isinstance(r.get("restarts"), int):
                r["restarts"] += lost.restarts.get(r.get("rank"), 0)
            s_ranks.append(r)
        s["ranks"] = s_ranks
        # Nodes: those not in the round Redis lost are the console's alone.
        c_nodes = dict(c.get("nodes") or {})
        for node in list(c_nodes):
            if node not in (s.get("nodes") or {}) and node not in lost.members:
                del c_nodes[node]
        c["nodes"] = c_nodes
        if lost.failures_after == 0:
            if s.get("root_cause") is not None:
                diffs.append(f"root_cause: status has one without a failure after the Redis "
                             f"restart: {s['root_cause']}")
            if c.get("root_cause") != lost.root_cause:
                diffs.append("root_cause: the console's changed without a failure after the "
                             "Redis restart")
            c.pop("root_cause", None)
            s.pop("root_cause", None)
    for key in sorted(set(c) | set(s)):
        if key not in c:
            diffs.append(f"{key}: only in status --json ({_fmt(s[key])})")
        elif key not in s:
            diffs.append(f"{key}: only in the console ({_fmt(c[key])})")
        elif key == "ranks":
            cr = {r["rank"]: r for r in c[key]}
            sr = {r["rank"]: r for r in s[key]}
            for rank in sorted(set(cr) | set(sr)):
                a, b = cr.get(rank), sr.get(rank)
                if a != b:
                    fields = sorted(k for k in set(a or {}) | set(b or {})
                                    if (a or {}).get(k) != (b or {}).get(k))
                    diffs.append(f"rank {rank}: " + ", ".join(
                        f"{f} console={(a or {}).get(f)} status={(b or {}).get(f)}"
                        for f in fields))
        elif key == "nodes":
            for node in sorted(set(c[key]) | set(s[key])):
                if c[key].get(node) != s[key].get(node):
                    diffs.append(f"node {node}: console={c[key].get(node)} "
                                 f"status={s[key].get(node)}")
        elif c[key] != s[key]:
            diffs.append(f"{key}: console={_fmt(c[key])} status={_fmt(s[key])}")
    return diffs


# -- the run ----------------------------------------------------------------------------------


class Chaos:
    """One run: Redis, agents, the console and the observer, the episodes, then the checks
    (``checks``; ``episodes`` says what was injected). ``run`` cleans up whatever happens."""

    def __init__(self, cfg: Config, workdir: Path) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.workdir = workdir
        self.job = f"chaos-{cfg.seed}-{uuid.uuid4().hex[:6]}"
        self.keys = JobKeys(self.job)
        self.script = workdir / "chaos_worker.py"
        self.end_file = workdir / "END"
        self.server = RedisServer()
        self.url = self.server.url
        self.episodes: list[Episode] = []
        self.checks: list[Check] = []
        self.t0 = time.monotonic()
        self.lost: BeforeRedis | None = None
        self.baseline = 0  # the observer's event index once the job first ran complete
        self.base_round = -1
        self.base_restarts: dict[int, int] = {}
        self.stable_failures: list[str] = []
        self._redis_mark = ""  # the last event id read before Redis was emptied
        self._recover_from = 0.0
        self.console_json: dict[str, Any] = {}
        self.status_json: dict[str, Any] = {}

    def say(self, message: str) -> None:
        if self.cfg.verbose:
            print(f"[chaos {time.monotonic() - self.t0:6.1f}s] {message}", file=sys.stderr,
                  flush=True)

    def check(self, name: str, expected: Any, observed: Any, note: str = "",
              ok: bool | None = None) -> None:
        self.checks.append(Check(name, expected, observed,
                                 expected == observed if ok is None else ok, note))

    # -- stability -------------------------------------------------------------------------
    def live_nodes(self) -> set[str]:
        by_pid = self.obs.nodes_by_pid()
        return {by_pid[self.agents.pids[i]] for i in self.agents.alive()
                if self.agents.pids[i] in by_pid and i not in self.agents.killed}

    def stable(self, min_round: int, restored_after: str | None = None) -> RoundState | None:
        """The current round if the job runs complete in it (see the module docstring)."""
        rs = self.obs.current()
        live = self.live_nodes()
        if (rs is None or rs.round < min_round or set(rs.members) != live
                or len(live) != len(self.agents.alive())
                or rs.world != len(live) * self.cfg.workers or not rs.complete()):
            return None
        if restored_after is not None and not all(
                e.data.get("restored") is True and _id(e.id) > _id(restored_after)
                for e in rs.started.values()):
            return None
        return rs if all(_alive(p) for p in rs.pids().values()) else None

    def console_shows(self, rs: RoundState) -> bool:
        v = self.app.view
        return (v.round == rs.round and v.world_size == rs.world and all(
            r in v.ranks and v.ranks[r].pid == p and v.ranks[r].state == "running"
            for r, p in rs.pids().items()))

    async def settle(self, ep: Episode, min_round: int, since: float,
                     restored_after: str | None = None) -> RoundState | None:
        rs = await until(lambda: self.stable(min_round, restored_after), self.cfg.settle_timeout)
        if rs is None:
            self.stable_failures.append(ep.kind)
            self.say(f"NOT stable within {self.cfg.settle_timeout:g} s after {ep.kind}")
            return None
        ep.recovery_s = time.monotonic() - since
        ep.round_after = rs.round
        ep.pids_after = rs.pids()
        shown = time.monotonic()
        if await until(lambda: self.console_shows(rs), 30):
            ep.console_lag_s = time.monotonic() - shown
        return rs

    # -- episodes --------------------------------------------------------------------------
    async def kill_workers(self, ep: Episode, rs: RoundState) -> int:
        pids = rs.pids()
        ranks = self.rng.sample(sorted(pids),
                                self.rng.randint(1, max(1, min(self.cfg.max_kills, len(pids)))))
        # Staggered: a later kill may land while the agents already stop the round's workers
        # for the first; every target is a worker of this round, so it is still one restart
        # (a worker gone by then is not killed, and not counted).
        delays = sorted(self.rng.uniform(0, self.cfg.stagger) for _ in ranks[1:])
        start = time.monotonic()
        for r, delay in zip(ranks, [0.0, *delays]):
            await asyncio.sleep(max(0.0, start + delay - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[r], signal.SIGKILL)
                ep.killed[r] = pids[r]
        ep.detail = "SIGKILL ranks " + ", ".join(
            f"{r} (pid {pids[r]}, +{d:.2f} s)" for r, d in zip(ranks, [0.0, *delays])
            if r in ep.killed)
        return rs.round + 1

    async def kill_agent(self, ep: Episode, rs: RoundState) -> int:
        i = self.rng.choice(sorted(set(self.agents.alive()) - self.agents.killed))
        ep.node = self.obs.nodes_by_pid().get(self.agents.pids[i], "?")
        self.tracker.scan()  # its tree as it was: every process of it must die
        self.agents.killed.add(i)
        os.kill(self.agents.pids[i], signal.SIGKILL)
        ep.detail = f"SIGKILL agent {i} (pid {self.agents.pids[i]}, node {ep.node})"
        return rs.round + 1

    async def restart_redis(self, ep: Episode, rs: RoundState) -> int:
        # Quiet first: an event written but not yet read when Redis goes is lost to readers.
        n, quiet_by = len(self.obs.events), time.monotonic() + 10
        await asyncio.sleep(1.0)
        while len(self.obs.events) != n and time.monotonic() < quiet_by:
            n = len(self.obs.events)
            await asyncio.sleep(0.5)  # no event in half a second: the job is quiet
        v = self.app.view
        self.lost = BeforeRedis({r: s.restarts for r, s in v.ranks.items()}, set(rs.members),
                                v.root_cause)
        last_id = self.obs.events[-1].id
        down = round(self.rng.uniform(*self.cfg.redis_down), 1)
        self.server.kill()
        await asyncio.sleep(down)  # the outage itself
        await asyncio.to_thread(self.server.start)
        self._recover_from = time.monotonic()  # recovery counts from Redis being back
        ep.detail = f"SIGKILL redis-server, restarted empty on port {self.server.port} " \
                    f"after {down} s"
        self._redis_mark = last_id
        return rs.round

    async def command(self, ep: Episode, rs: RoundState) -> int:
        ep.via = self.rng.choice(["console", "cli"])
        ep.expected_acks = len(rs.members)
        if ep.via == "console":
            ep.command_id, ep.accepted = await self._command_from_console()
        else:
            proc = await run_cli("restart", self.job, "--yes", "--redis", self.url,
                                 "--timeout", "60")
            out = proc.stdout
            words = out.split()
            ep.command_id = next((w for w in words if w.startswith("c-")), "")
            ep.accepted = out.count("  accepted by ")
            if proc.returncode != 0:
                self.say(f"elastic-console restart exited {proc.returncode}: {proc.stderr}")
        ep.detail = f"restart command {ep.command_id} from the {ep.via}, accepted by " \
                    f"{ep.accepted}/{ep.expected_acks}"
        return rs.round + 1

    async def _command_from_console(self) -> tuple[str, int]:
        from elastic_console.tui.widgets.dialogs import CommandDialog

        app, pilot = self.app, self.pilot
        if not await until(lambda: app.check_action("restart", ()) is True, 30):
            self.say(f"the console will not restart: {app.block_reason('restart')}")
            return "", 0
        await pilot.press("r")
        dialog = await until(lambda: app.screen if isinstance(app.screen, CommandDialog)
                             else None, 10, 0.02)
        if dialog is None:
            return "", 0
        await pilot.press("y")
        await until(lambda: dialog.phase == "done", app.ack_timeout + 20)
        text = dialog.progress_text
        await pilot.press("escape")
        await until(lambda: not isinstance(app.screen, CommandDialog), 10, 0.02)
        return dialog.command_id, text.count("✓ accepted by ")

    # -- the whole run ---------------------------------------------------------------------
    async def run(self) -> None:
        cfg = self.cfg
        self.script.write_text(WORKER)
        await asyncio.to_thread(self.server.start)
        self.obs = Observer(self.url, self.job)
        obs_task = asyncio.create_task(self.obs.run(), name="observer")
        await until(lambda: self.keys.events in self.obs.client.last_ids, 10, 0.01)
        self.say(f"redis on {self.url}; starting {cfg.agents} agents x {cfg.workers} workers, "
                 f"job {self.job}")
        self.agents = Agents(cfg, self.url, self.job, self.workdir, self.script, self.end_file)
        self.tracker = Tracker(self.agents.pids)
        track_task = asyncio.create_task(self._track(), name="tracker")
        self.app = ConsoleApp(self.job, endpoint=parse_endpoint(self.url), cursor_blink=False)
        try:
            async with self.app.run_test(size=(200, 60)) as pilot:
                self.pilot = pilot
                await self._chaos()
                await self._finish()
                await self._compare_console()
        finally:
            track_task.cancel()
            obs_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await obs_task
            with contextlib.suppress(asyncio.CancelledError):
                await track_task
            await self.obs.client.close()
            self.agents.kill_all()
            self.tracker.kill(str(self.script))
            self.server.cleanup()

    async def _track(self) -> None:
        while True:
            await asyncio.to_thread(self.tracker.scan)
            await asyncio.sleep(0.5)  # sampling period of the process trees

    async def _chaos(self) -> None:
        cfg = self.cfg
        start = time.monotonic()
        rs = await until(lambda: self.stable(0), cfg.settle_timeout)
        if rs is None:
            self.stable_failures.append("start")
            self.say("the job never ran complete")
            return
        self.say(f"running: round {rs.round}, world {rs.world}, after "
                 f"{time.monotonic() - start:.1f} s")
        if not await until(lambda: self.app.loaded and self.console_shows(rs), 60):
            self.stable_failures.append("console at start")
        self.baseline = len(self.obs.events)
        self.base_round = rs.round
        self.base_restarts = {r: s.restarts for r, s in self.app.view.ranks.items()}
        kinds = plan(cfg, self.rng)
        self.say("schedule: " + ", ".join(kinds))
        slot = cfg.duration / len(kinds)
        self.t0 = time.monotonic()
        for n, kind in enumerate(kinds):
            ep = Episode(kind, at_s=time.monotonic() - self.t0, round_before=rs.round,
                         pids_before=rs.pids())
            self.episodes.append(ep)
            injected = self._recover_from = time.monotonic()
            want = await getattr(self, kind)(ep, rs)
            self.say(f"{kind}: {ep.detail}")
            if kind == "kill_workers" and self.lost is not None:
                self.lost.failures_after += 1
            nxt = await self.settle(ep, want, max(injected, self._recover_from),
                                    self._redis_mark if kind == "restart_redis" else None)
            if nxt is None:
                return
            self.say(f"  stable in round {nxt.round} after {ep.recovery_s:.1f} s"
                     + ("" if ep.console_lag_s is not None else "; the console did NOT catch up"))
            rs = nxt
            pause = self.t0 + (n + 1) * slot - time.monotonic()
            await asyncio.sleep(max(0.5, pause) + self.rng.uniform(0, 0.5))

    async def _finish(self) -> None:
        """End file, exits, and every check but the console's comparison."""
        cfg = self.cfg
        final = self.obs.current()
        self.say("creating the end file; waiting for the agents")
        self.end_file.touch()
        ended = time.monotonic()
        survivors = [i for i in range(cfg.agents) if i not in self.agents.killed]
        exit_s: dict[int, float] = {}

        def exited() -> bool:
            for i in survivors:
                if i not in exit_s and self.agents.procs[i].poll() is not None:
                    exit_s[i] = time.monotonic() - ended
            return len(exit_s) == len(survivors)

        await until(exited, cfg.exit_timeout)
        codes = {i: self.agents.procs[i].poll() for i in range(cfg.agents)}
        stuck = [i for i in survivors if codes[i] is None]
        await asyncio.sleep(1.0)  # the keepers' last kills and reaps
        await asyncio.to_thread(self.tracker.scan)
        orphans = self.tracker.alive(str(self.script))
        self.say(f"agents exited: {sorted(codes.items())}")
        await until(lambda: self.app.view.is_final, 30)

        # -- the job and the injections
        eps = self.episodes
        kills = [e for e in eps if e.kind == "kill_workers"]
        agents_killed = [e for e in eps if e.kind == "kill_agent"]
        commands = [e for e in eps if e.kind == "command"]
        redis_eps = [e for e in eps if e.kind == "restart_redis"]
        since = self.baseline
        self.check("episodes stable (job and console)", "all",
                   "all" if not self.stable_failures else "not after: " + ", ".join(
                       self.stable_failures))
        self.check("console caught up after each episode", len(eps),
                   sum(e.console_lag_s is not None for e in eps))
        succeeded = self.obs.of(EventType.JOB_SUCCEEDED)
        self.check("job succeeded (event)", 1, len(succeeded))
        self.check("console state", "succeeded", self.app.view.state)

        # -- restarts
        r = make_client(self.url)
        try:
            counter = r.get(self.keys.restarts)
            in_index = r.zscore(JOBS_INDEX, self.job) is not None
        finally:
            r.close()
        f = len(kills)
        self.check("kill episodes -> restart counter (Redis)", f,
                   int(counter) if counter is not None else None,
                   f"{sum(len(e.killed) for e in kills)} workers killed in {f} episodes")
        status_proc = await run_cli("status", self.job, "--json", "--redis", self.url)
        try:
            status = json.loads(status_proc.stdout)
        except ValueError:
            status = {}
        self.status = status
        self.check("  restarts_used (status --json)", f, status.get("restarts_used"))
        self.check("  restarts_used (job_succeeded)", f,
                   succeeded[-1].data.get("restarts_used") if succeeded else None)
        self.check("  restarts_used (console)", f, self.app.view.restarts_used)
        failed_rounds = {e.data.get("round") for e in self.obs.of(EventType.GROUP_FAILED, since)}
        self.check("  group_failed rounds", sorted(e.round_before for e in kills),
                   sorted(failed_rounds))
        causes = 0
        for e in kills:
            gf = [g for g in self.obs.of(EventType.GROUP_FAILED, since)
                  if g.data.get("round") == e.round_before]
            cause = (gf[0].data.get("root_cause") or {}) if gf else {}
            causes += cause.get("rank") in e.killed and cause.get("pid") == e.killed.get(
                cause.get("rank"))
        self.check("  root cause is a killed rank", f, causes)
        reasons: dict[str, list[Event]] = {}
        for ev in self.obs.of(EventType.RESTARTING, since):
            reasons.setdefault(ev.data.get("reason"), []).append(ev)
        self.check("  restarting(failure) events", f, len(reasons.get("failure", [])))
        self.check("agent kills -> restarting(membership)", len(agents_killed),
                   len(reasons.get("membership", [])))
        lost_nodes = {e.data.get("lost_node") for e in self.obs.of(EventType.NODE_LOST, since)}
        self.check("  nodes lost", sorted(e.node for e in agents_killed), sorted(lost_nodes))
        self.check("  final world size", (cfg.agents - len(agents_killed)) * cfg.workers,
                   final.world if final else None)
        cmd_ids = {ev.data.get("command_id") for ev in reasons.get("command", [])}
        self.check("restart commands -> restarting(command) ids",
                   sorted(e.command_id for e in commands), sorted(cmd_ids))
        self.check("  acks accepted (as the sender saw them)",
                   sum(e.expected_acks for e in commands), sum(e.accepted for e in commands),
                   ", ".join(f"{e.via} {e.accepted}/{e.expected_acks}" for e in commands))
        others = {k: len(v) for k, v in reasons.items() if k not in ("failure", "membership",
                                                                       "command")}
        self.check("  restarting events with another reason", {}, others)
        gained = (final.round if final else -1) - self.base_round
        self.check("rounds gained (kills + agent kills + commands)",
                   f + len(agents_killed) + len(commands), gained)
        view = self.app.view
        per_rank_ok = sum(1 for rank in range(final.world if final else 0)
                          if rank in view.ranks and rank in self.base_restarts
                          and view.ranks[rank].restarts - self.base_restarts[rank] == gained)
        self.check("  ranks whose console restarts grew by that", final.world if final else 0,
                   per_rank_ok)

        # -- the empty Redis
        for e in redis_eps:
            self.check("Redis restart: round unchanged", e.round_before, e.round_after)
            self.check("  workers restarted by it", 0, sum(
                1 for rank, pid in e.pids_before.items() if e.pids_after.get(rank) != pid))
            self.check("  job back in the index", True, in_index)
            self.check("  bench reader outages seen", 1, self.obs.outages)

        # -- last lines
        await self._last_lines(final)

        # -- processes
        codes_expected = {i: (-9 if i in self.agents.killed else 0) for i in range(cfg.agents)}
        self.check("agent exit codes (killed: -9)", codes_expected, codes,
                   ok=codes == codes_expected)
        slowest = max(exit_s.values()) if exit_s else None
        self.check(f"agents stuck (none may exceed {cfg.exit_timeout:g} s)", [], stuck,
                   "" if slowest is None else f"slowest exit {slowest:.1f} s after the end file")
        tracebacks = [i for i in range(cfg.agents) if "Traceback" in self.agents.output(i)]
        self.check("agent outputs with a traceback", [], tracebacks)
        self.check("orphan processes", [], orphans,
                   f"{len(self.tracker.seen)} processes seen in the agents' trees")

    async def _last_lines(self, final: RoundState | None) -> None:
        """Each surviving worker's last line, and its final attempt's whole output, in Redis,
        in its log file and in the console."""
        if final is None:
            self.check("last lines", "a final round", None)
            return
        expected: dict[int, str] = {}
        start_of: dict[int, str] = {}
        attempts: dict[int, int] = {}
        node_of: dict[int, str] = {}
        for node, ev in final.started.items():
            for rank, pid in zip(ev.data.get("ranks") or [], ev.data.get("pids") or []):
                expected[rank] = final_line(rank, final.world, pid)
                start_of[rank] = f"start rank={rank} world={final.world} pid={pid}"
                attempts[rank] = ev.data.get("attempt")
                node_of[rank] = node
        in_redis = await asyncio.to_thread(self._attempt_lines_in_redis, node_of, attempts)
        in_files: dict[int, list[str]] = {}
        # Each agent has its own run directory (<job>_<random>) and local-rank directories:
        # a rank's file is the one of its attempt that starts with its own start line.
        for path in (self.workdir / "logs").glob(f"{self.job}_*/attempt_*/*/stdout.log"):
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()
                for rank, start in start_of.items():
                    if start in lines[:5] and path.parent.parent.name == f"attempt_{attempts[rank]}":
                        in_files[rank] = lines
        in_console: dict[int, list[str]] = {}
        for rank in expected:
            out = [t for _, _, s, t in self.app.view.logs_for(rank) if s == STDOUT]
            first = max((i for i, t in enumerate(out) if t == start_of[rank]), default=0)
            in_console[rank] = out[first:]
        n = len(expected)
        sources = (("Redis", in_redis), ("the log files", in_files), ("the console", in_console))
        for where, got in sources:
            bad = [r for r in sorted(expected) if (got.get(r) or [""])[-1] != expected[r]]
            note = "" if not bad else f"rank {bad[0]}: {(got.get(bad[0]) or [''])[-1]!r}"
            self.check(f"last line in {where}", n, n - len(bad), note)
        # The file has every line. Redis and the console have them all too, in order and once,
        # unless Redis was emptied during this attempt: it then took the lines it held.
        lossy = any(e.round_before == final.round for e in self.of_kind("restart_redis"))
        total = sum(len(v) for v in in_files.values())
        for where, got in sources[::2]:
            good = missing = 0
            for rank in expected:
                have, full = got.get(rank) or [], in_files.get(rank) or []
                if have == full or (lossy and _subsequence(have, full)):
                    good += 1
                    missing += len(full) - len(have)
            note = f"{total} lines in the files" + (
                f"; {missing} lost with the empty Redis during this attempt" if lossy else "")
            self.check(f"final attempt's lines in {where} (= files)", n, good, note)

    def of_kind(self, kind: str) -> list[Episode]:
        return [e for e in self.episodes if e.kind == kind]

    def _attempt_lines_in_redis(self, node_of: dict[int, str],
                                attempts: dict[int, int]) -> dict[int, list[str]]:
        """rank -> its stdout lines of ``attempts[rank]`` in its node's stream, in order; a
        batch written twice (a retried XADD) is read once, as the console reads it."""
        out: dict[int, list[str]] = {r: [] for r in node_of}
        dedupe = BatchDeduper()
        r = make_client(self.url)
        try:
            for node in sorted(set(node_of.values())):
                key, low = self.keys.logs(node), "-"
                while True:
                    page = r.xrange(key, min=low, count=5000)
                    for entry_id, fields in page:
                        for b in decode_log_entries(entry_id, fields) or ():
                            if (b.stream == STDOUT and node_of.get(b.rank) == node
                                    and b.attempt == attempts[b.rank] and not dedupe.seen(b)):
                                out[b.rank].extend(b.lines)
                    if len(page) < 5000:
                        break
                    last = page[-1][0]
                    low = "(" + (last.decode() if isinstance(last, bytes) else last)
        finally:
            r.close()
        return out

    async def _compare_console(self) -> None:
        """The console's final state against ``status --json`` (equal, or by the rules of
        the Redis restart); retried for a while: the console polls meta and liveness."""
        diffs: list[str] = ["not compared"]
        deadline = time.monotonic() + 20
        display = parse_endpoint(self.url).display
        while time.monotonic() < deadline:
            proc = await run_cli("status", self.job, "--json", "--redis", self.url)
            try:
                status = json.loads(proc.stdout)
            except ValueError:
                diffs = [f"status --json failed: {proc.stderr.strip()}"]
                break
            self.console_json = view_json(self.app.view, self.job, display)
            self.status_json = status
            diffs = compare(self.console_json, status, self.lost)
            if not diffs:
                break
            await asyncio.sleep(1.0)  # the console polls meta and liveness every few seconds
        if diffs:
            self.say("console != status --json:\n  " + "\n  ".join(diffs[:20]))
        self.check("console final state == status --json", [], diffs[:5],
                   f"{len(diffs)} differences" if diffs else
                   "equal" + (" (rules for the empty Redis applied)" if self.lost else ""))


def _subsequence(part: list[str], whole: list[str]) -> bool:
    """``part`` is ``whole`` with some lines left out (none added, none repeated, same order)."""
    it = iter(whole)
    return all(any(line == w for w in it) for line in part)


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def run(cfg: Config) -> ChaosResult:
    """One chaos run; never raises for what it observed (see ``ChaosResult.ok``)."""
    workdir = Path(tempfile.mkdtemp(prefix="elastic-chaos-"))
    started = time.monotonic()
    chaos = Chaos(cfg, workdir)
    try:
        asyncio.run(chaos.run())
    finally:
        if not cfg.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return ChaosResult(cfg, chaos.job, chaos.episodes, chaos.checks,
                       time.monotonic() - started, workdir if cfg.keep else None,
                       chaos.console_json, chaos.status_json, chaos.lost)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--workers", type=int, default=8, help="workers per agent")
    p.add_argument("--duration", type=float, default=150.0,
                   help="seconds the episodes are spread over")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--episodes", type=int, default=None,
                   help=f"number of episodes (default: duration / {EPISODE_S:g}, at least 4)")
    p.add_argument("--rdzv-conf", default=DEFAULT_RDZV)
    p.add_argument("--settle-timeout", type=float, default=180.0)
    p.add_argument("--exit-timeout", type=float, default=120.0)
    p.add_argument("--max-kills", type=int, default=3, help="workers killed per episode, at most")
    p.add_argument("--stagger", type=float, default=0.5,
                   help="an episode's worker kills are spread over up to this many seconds")
    p.add_argument("--redis-down", default="1:3", metavar="MIN:MAX",
                   help="seconds the empty Redis stays away (drawn in this range)")
    p.add_argument("--keep", action="store_true", help="keep the run's directory")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a = p.parse_args(argv)
    if a.agents < 2 or a.workers < 1:
        p.error("need at least 2 agents (one is killed) and 1 worker each")
    cfg = Config(agents=a.agents, workers=a.workers, duration=a.duration, seed=a.seed,
                 episodes=a.episodes, rdzv_conf=a.rdzv_conf, settle_timeout=a.settle_timeout,
                 exit_timeout=a.exit_timeout, keep=a.keep, verbose=not a.quiet,
                 stagger=a.stagger, max_kills=a.max_kills,
                 redis_down=tuple(float(x) for x in a.redis_down.split(":", 1)))  # type: ignore[arg-type]
    result = run(cfg)
    print(result.table())
    if result.workdir is not None:
        print(f"run directory kept: {result.workdir}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
