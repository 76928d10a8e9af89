"""Launcher figures, torchrun against elastic-agent, side by side in one run.

Both launchers run as separate processes with identical flags (``--standalone``,
``--nproc-per-node 4``, ``--log-dir`` in a temp dir; elastic-agent also gets a unique
``--job-id`` and ``ELASTIC_JOB_ID``):

  a) 4 hello-world workers (examples/hello.py) from launch to exit: wall time; peak of the sum of
     RSS over the launcher's whole process tree (a psutil thread samples it every 5 ms); and
     ``ru_maxrss`` from ``os.wait4`` on the launcher (the kernel reports the larger of the
     launcher's own peak and that of any child it reaped).
  b) a worker crash to all 4 workers running again (examples/crash_timing.py, --max-restarts 1):
     latest worker start time on attempt 1 minus the crash time, from timestamps the workers
     append to a file (``CRASH_TIMING_FILE``), not from launcher output. Then the same with
     workers that ``import torch`` first (bench/crash_timing_torch.py, the start timestamp
     taken once torch is imported), and for both the peak PSS of the node (the sum of
     ``Pss`` in /proc/PID/smaps_rollup over the launcher's tree, sampled every 50 ms).
     elastic-agent's restart is broken down into its phases: it runs with
     ``--event-log-handler console`` and the ``restart`` field of its second
     ``workers_started`` event gives, in ms since the agent saw the failure, when the
     survivors' stacks were captured, the workers stopped, the failure reported, the
     rendezvous done, the keeper ready and every worker started (docs/PROTOCOL.md); before
     them the detection (the worker's crash time to the agent's ``detected_at``), after them
     the workers' own start until they run the script. Each phase's median is printed next
     to torchrun's whole restart.
  c) 4 workers x ``--lines`` lines (examples/print_lines.py) with ``--tee 3``, launcher output to
     /dev/null: wall time; and the same without ``--tee`` for reference. Every ``--tee`` run is
     checked: each rank's stdout.log holds all its lines (both launchers), and for
     elastic-agent the job's log streams in Redis hold them too (entries decoded with the
     protocol's ``decode_log_entries``, a retried batch counted once). A line missing anywhere
     fails the figure and the bench (exit 1). So that Redis can be read after the agent
     exits, elastic-agent runs here on a redis-server the bench starts on loopback (emptied
     before each run) instead of ``--standalone``'s embedded one, which stops with the agent;
     starting that server is outside the timed span.
  d) the launcher's CPU seconds (user+sys) while 4 workers print a steady ``--rate`` lines/s in
     total for ``--duration`` s, with ``--tee 3``: the whole process tree of the launcher
     except the workers -- the launcher itself and its helpers: elastic-agent's embedded
     redis-server and keeper, torchrun's own children (its c10d store is a thread of its own).
     The tree's total is exact: ``/proc/<pid>/stat`` of the exited launcher before it is reaped
     (``waitid(WNOWAIT)``), utime+stime plus cutime+cstime (every descendant reaped inside the
     tree; a process left behind is reported). The workers' part (processes running the
     script) is sampled every 20 ms and subtracted; a worker's last <= 20 ms escape the
     sample, which counts against the launcher.

Every figure is the median of ``--repeat`` runs. Each run has a timeout; a launcher that hangs
is killed with its whole process group and every process seen in its tree, and processes left
behind after a launcher exits are reported and killed. Linux only (/proc).

    python bench/launch_bench.py [--repeat 5] [--only a,b,c,d] [--lines 100000]
                                 [--launchers torchrun,elastic-agent]

Exit status 1 when a figure could not be measured for a launcher (a failed or hung run, or
lines lost in (c)).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import psutil

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import STDOUT, LogBatch, decode_log_entries
from elastic_agent.supervision.hosting.standalone import RedisServer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TORCH_CRASH = ROOT / "bench" / "crash_timing_torch.py"
NPROC = 4
LAUNCHERS = ("torchrun", "elastic-agent")
CLK_TCK = os.sysconf("SC_CLK_TCK")
MIB = 1024 * 1024
# Environment a launcher must not inherit from a surrounding job.
_STRIP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "ELASTIC_JOB_ID")


def find_launcher(name: str) -> str | None:
    """The launcher next to sys.executable, else the one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


# --------------------------------------------------------------------------- process tree


#: The titles of the zygote, its keepers and its parked workers (launch/zygote.py).
_TITLED = (b"elastic-agent zygote", b"elastic-agent keeper", b"elastic-agent parked")

def tree_pids(root: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of ``root`` and its descendants, from /proc/<pid>/task/<tid>/children."""
    out = [(root, 0)]
    i = 0
    while i < len(out):
        pid = out[i][0]
        i += 1
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out.extend((int(x), pid) for x in f.read().split())
            except (OSError, ValueError):
                continue
    return out


def pss(pid: int) -> int:
    """Bytes of ``Pss`` in /proc/PID/smaps_rollup (0 when gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


class TreeSampler(threading.Thread):
    """Samples the launcher's process tree: peak summed RSS, processes seen, helper CPU.

    A child with its parent's command line is a fork that has not exec'd yet (Python's
    subprocess uses vfork: the child runs in the parent's memory until exec); its RSS is its
    parent's pages again, so it is not counted a second time. Except elastic-agent's
    zygote's forks (issue 23: its keepers and, by default, its workers), which never exec
    and are processes of their own: a worker forked by a keeper the zygote forked is a
    worker, whatever its command line (the zygote's).
    """

    def __init__(self, root: int, interval: float, worker_marker: str) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.interval = interval
        self.worker_marker = worker_marker.encode()
        self.stop_event = threading.Event()
        self.peak_rss = 0
        self.peak_pss = 0
        self.pss = False  # also sum Pss (smaps_rollup: costlier to read than RSS)
        self.samples = 0
        self.seen: dict[int, psutil.Process] = {}
        self.helper_cpu: dict[int, float] = {}
        self.worker_cpu: dict[int, float] = {}

    def _proc(self, pid: int) -> psutil.Process | None:
        proc = self.seen.get(pid)
        if proc is None:
            try:
                proc = psutil.Process(pid)
            except (psutil.Error, OSError):
                return None
            self.seen[pid] = proc
        return proc

    def sample(self) -> None:
        total = pss_total = 0
        cmdlines: dict[int, bytes | None] = {}
        zygotes: set[int] = set()
        forked_keepers: set[int] = set()
        forked_workers: set[int] = set()
        for pid, parent in tree_pids(self.root):
            cmdline = cmdlines[pid] = _cmdline(pid)
            proc = self._proc(pid)
            if proc is None or not cmdline:
                continue  # gone, or a zombie (empty command line)
            if self.pss:
                pss_total += pss(pid)  # a fork shares its parent's pages: Pss splits them
            # The zygote and its forks show what they are (launch/zygote.py titles them);
            # a released worker shows its own command line (the worker marker).
            zygote = (b"zygote.py" in cmdline and b"--worker" not in cmdline) or (
                cmdline.startswith(_TITLED))
            if zygote and parent == self.root:
                zygotes.add(pid)
            elif zygote and parent in zygotes:
                forked_keepers.add(pid)
            elif zygote and (parent in forked_keepers or parent in forked_workers):
                forked_workers.add(pid)  # a worker, or a fork of one (its CPU is the job's)
            elif parent and cmdline == cmdlines.get(parent):
                continue  # forked, not exec'd yet: its parent's pages
            try:
                total += proc.memory_info().rss
                if pid == self.root:
                    continue
                t = proc.cpu_times()
                if self.worker_marker in cmdline or pid in forked_workers:
                    self.worker_cpu[pid] = t.user + t.system
                    self.helper_cpu.pop(pid, None)
                elif pid not in self.worker_cpu:
                    self.helper_cpu[pid] = t.user + t.system
            except (psutil.Error, OSError):
                continue
        self.samples += 1
        self.peak_rss = max(self.peak_rss, total)
        self.peak_pss = max(self.peak_pss, pss_total)

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        self.join()

    def alive_leftovers(self) -> list[psutil.Process]:
        out = []
        for pid, proc in self.seen.items():
            if pid == self.root:
                continue
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
        return out


# --------------------------------------------------------------------------- one launcher run


@dataclass
class Run:
    ok: bool
    error: str = ""
    wall: float = 0.0
    peak_rss: int = 0
    peak_pss: int = 0
    maxrss: int = 0
    own_cpu: float = 0.0
    tree_cpu: float = 0.0  # exact: the launcher and every descendant it (transitively) reaped
    worker_cpu: float = 0.0  # sampled
    helper_cpu: float = 0.0  # sampled, for the breakdown only
    leftovers: int = 0
    samples: int = 0
    extra: dict = field(default_factory=dict)


def _cpu_of_zombie(pid: int) -> tuple[float, float] | None:
    """(own utime+stime, cutime+cstime of the children it reaped) of an exited, not yet reaped
    process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return ((int(fields[11]) + int(fields[12])) / CLK_TCK,
            (int(fields[13]) + int(fields[14])) / CLK_TCK)


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    return lines[-1][:300] if lines else ""


def _kill(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


class Bench:
    def __init__(self, workdir: Path, timeout: float) -> None:
        self.workdir = workdir
        self.timeout = timeout
        self.counter = 0

    def run(self, name: str, exe: str, launcher_args: list[str], script: str,
            script_args: list[str], *, sample_interval: float, quiet: bool = False,
            env_extra: dict[str, str] | None = None, redis_url: str | None = None,
            agent_args: list[str] | None = None, pss: bool = False) -> Run:
        """Launch once; wait for exit (or time out and kill); collect the figures.
        ``redis_url``: elastic-agent uses that Redis instead of ``--standalone``'s own;
        ``agent_args``: flags for elastic-agent only; ``pss``: also sample the tree's PSS."""
        self.counter += 1
        run_dir = self.workdir / f"{self.counter:03d}-{name}"
        run_dir.mkdir(parents=True)
        where = ["--redis", redis_url] if redis_url and name == "elastic-agent" else [
            "--standalone"]
        cmd = [exe, *where, "--nproc-per-node", str(NPROC), *launcher_args,
               "--log-dir", str(run_dir / "logs")]
        env = {k: v for k, v in os.environ.items()
               if k not in _STRIP_ENV and not k.startswith("TORCHELASTIC_")}
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        if name == "elastic-agent":
            job_id = f"bench-{uuid.uuid4().hex[:12]}"
            cmd += ["--job-id", job_id, *(agent_args or [])]
            env["ELASTIC_JOB_ID"] = job_id
        else:
            job_id = ""
        env.update(env_extra or {})
        cmd += [str(EXAMPLES / script), *script_args]

        stderr_path = run_dir / "launcher.stderr"
        if quiet:
            out = err = subprocess.DEVNULL
        else:
            out = open(run_dir / "launcher.stdout", "wb")  # noqa: SIM115 - closed below
            err = open(stderr_path, "wb")  # noqa: SIM115
        result: dict = {}

        started = time.perf_counter()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env=env, cwd=run_dir, start_new_session=True)
        except OSError as exc:
            return Run(ok=False, error=f"{type(exc).__name__}: {exc}")
        finally:
            if not quiet:
                out.close()
                err.close()

        def waiter() -> None:
            # Wait without reaping, read the zombie's own CPU, then reap with wait4.
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            result["wall"] = time.perf_counter() - started
            result["cpu"] = _cpu_of_zombie(proc.pid)
            _, status, usage = os.wait4(proc.pid, 0)
            result["status"] = status
            result["usage"] = usage

        sampler = TreeSampler(proc.pid, sample_interval, str(EXAMPLES / script))
        sampler.pss = pss
        sampler.start()
        wait_thread = threading.Thread(target=waiter, daemon=True)
        wait_thread.start()
        wait_thread.join(self.timeout)
        timed_out = wait_thread.is_alive()
        if timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _kill(sampler.alive_leftovers())
            wait_thread.join(10)
        sampler.stop()
        status = result.get("status")
        proc.returncode = os.waitstatus_to_exitcode(status) if status is not None else -9

        # No orphans: whatever the launcher left behind is reported, then killed.
        leftovers: list[psutil.Process] = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            leftovers = sampler.alive_leftovers()
            if not leftovers:
                break
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _kill(leftovers)

        run = Run(ok=not timed_out and proc.returncode == 0, leftovers=len(leftovers),
                  samples=sampler.samples, peak_rss=sampler.peak_rss,
                  peak_pss=sampler.peak_pss,
                  helper_cpu=sum(sampler.helper_cpu.values()),
                  worker_cpu=sum(sampler.worker_cpu.values()))
        if timed_out:
            run.error = f"timed out after {self.timeout:g} s, killed"
        elif proc.returncode != 0:
            line = "(launcher output went to /dev/null)" if quiet else _last_line(stderr_path)
            run.error = f"exit code {proc.returncode}" + (f": {line}" if line else "")
        if "wall" in result:
            run.wall = result["wall"]
            own, reaped = result["cpu"] or (0.0, 0.0)
            run.own_cpu, run.tree_cpu = own, own + reaped
        if "usage" in result:
            run.maxrss = result["usage"].ru_maxrss * 1024  # KiB on Linux
        run.extra["run_dir"] = run_dir
        run.extra["job_id"] = job_id
        return run


# --------------------------------------------------------------------------- figures


@dataclass
class Figure:
    key: str
    label: str
    unit: str
    goal: float | None = None
    values: dict[str, list[float]] = field(default_factory=dict)
    #: A phase of elastic-agent's figure ``part_of``: its ratio is to torchrun's whole figure.
    part_of: Figure | None = None
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, launcher: str, value: float) -> None:
        self.values.setdefault(launcher, []).append(value)

    def median(self, launcher: str) -> float | None:
        if launcher in self.failed or not self.values.get(launcher):
            return None
        return statistics.median(self.values[launcher])


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check(figs: list[Figure], name: str, run: Run, what: str) -> bool:
    if run.leftovers:
        note(f"  ! {name} {what}: {run.leftovers} process(es) left running after the launcher "
             "exited (killed)")
    if run.ok:
        return True
    note(f"  ! {name} {what} failed: {run.error}")
    for fig in figs:
        fig.failed.setdefault(name, run.error)
    return False


def rounds(launchers: dict[str, str], repeat: int,
           figs: list[Figure]) -> Iterator[tuple[int, str, str]]:
    """(i, name, exe), launchers taking turns in every round so background load hits all
    alike; a launcher that failed a figure is not run again for it."""
    for i in range(repeat):
        for name, exe in launchers.items():
            if not any(name in fig.failed for fig in figs):
                yield i, name, exe


def bench_a(bench: Bench, launchers: dict[str, str], repeat: int) -> list[Figure]:
    wall = Figure("a", "a) 4 hello workers, launch to exit: wall", "s", 0.25)
    peak = Figure("a", "a) peak RSS, sum over process tree (5 ms samples)", "MiB", 0.3)
    maxrss = Figure("a", "a) ru_maxrss of launcher (wait4)", "MiB", None)
    figs = [wall, peak, maxrss]
    for i, name, exe in rounds(launchers, repeat, figs):
        run = bench.run(name, exe, [], "hello.py", [], sample_interval=0.005)
        if not _check(figs, name, run, "a"):
            continue
        wall.add(name, run.wall)
        peak.add(name, run.peak_rss / MIB)
        maxrss.add(name, run.maxrss / MIB)
        note(f"  a {name} {i + 1}/{repeat}: {run.wall:.2f} s, tree peak "
             f"{run.peak_rss / MIB:.0f} MiB ({run.samples} samples), "
             f"ru_maxrss {run.maxrss / MIB:.0f} MiB")
    return figs


def parse_crash_timing(path: Path) -> float:
    return crash_times(path)[1] - crash_times(path)[0]


def crash_times(path: Path) -> tuple[float, float]:
    """(the crash's time, the latest restarted worker's start time), from the workers' file."""
    crash = None
    restarted: dict[int, float] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["crash"]:
            crash = float(parts[1])
        elif parts[:1] == ["start"] and int(parts[1]) == 1:
            restarted[int(parts[2])] = float(parts[3])
    if crash is None or len(restarted) != NPROC:
        raise ValueError(f"incomplete timestamps in {path}: crash={crash}, "
                         f"{len(restarted)}/{NPROC} workers restarted")
    return crash, max(restarted.values())


#: The phases of elastic-agent's restart as the breakdown shows them: (label, the mark that
#: ends it, in the ``restart`` field of ``workers_started``; see events.RestartClock).
PHASES = (("detected (crash -> the agent knows)", None),
          ("survivors' stacks captured", "evidence"),
          ("workers stopped", "stopped"),
          ("failure reported, restart counted", "reported"),
          ("rendezvous done", "rendezvous"),
          ("keeper ready", "keeper"),
          ("every worker started (pids)", "started"),
          ("workers' own start until the script runs", ""))


def restart_record(stderr: Path) -> dict | None:
    """The ``restart`` field of the first ``workers_started`` event that has one, from the
    agent's ``--event-log-handler console`` lines on its stderr."""
    try:
        lines = stderr.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if '"elastic_agent.workers_started"' not in line:
            continue
        try:
            restart = json.loads(line)["metadata"].get("restart")
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if isinstance(restart, dict):
            return restart
    return None


def phase_split(restart: dict, crash: float, running: float) -> list[float]:
    """Seconds spent in each of PHASES, from one run's record and timestamps."""
    marks = restart.get("phases_ms") or {}
    out = [float(restart["detected_at"]) - crash]
    last = 0.0
    for _, mark in PHASES[1:-1]:
        at = marks.get(mark, last * 1000) / 1000
        out.append(at - last)
        last = at
    out.append(running - crash - out[0] - last)
    return out


def bench_b(bench: Bench, launchers: dict[str, str], repeat: int) -> list[Figure]:
    figs = []
    for key, label, script, crash_after in (
            ("b", "b) worker crash -> all 4 running again", "crash_timing.py", "1.0"),
            ("b2", "b2) the same, workers that import torch", str(TORCH_CRASH), "3.0")):
        fig = Figure(key, label, "s", 0.5)
        pss = Figure(key, f"{key}) peak PSS of the node (50 ms samples)", "MiB", 1.0)
        phases = [Figure(key, f"   {key}) phase: {what}", "s", part_of=fig)
                  for what, _ in PHASES]
        for i, name, exe in rounds(launchers, repeat, [fig]):
            stamps = bench.workdir / f"crash-{uuid.uuid4().hex[:8]}.txt"
            run = bench.run(name, exe, ["--max-restarts", "1"], script,
                            ["--crash-after", crash_after], sample_interval=0.05,
                            env_extra={"CRASH_TIMING_FILE": str(stamps)},
                            agent_args=["--event-log-handler", "console"], pss=True)
            if not _check([fig, pss], name, run, key):
                continue
            try:
                crash, running = crash_times(stamps)
            except (OSError, ValueError) as exc:
                _check([fig, pss], name, Run(ok=False, error=str(exc)), key)
                continue
            fig.add(name, running - crash)
            pss.add(name, run.peak_pss / MIB)
            split = ""
            if name == "elastic-agent":
                record = restart_record(run.extra["run_dir"] / "launcher.stderr")
                if record is None:
                    note(f"  ! {key} {name}: no restart record on the agent's stderr")
                else:
                    for phase, took in zip(phases, phase_split(record, crash, running),
                                           strict=True):
                        phase.add(name, took)
                    split = " = " + " + ".join(
                        f"{p.values[name][-1] * 1000:.0f}" for p in phases) + " ms"
            note(f"  {key} {name} {i + 1}/{repeat}: {running - crash:.3f} s{split}, peak PSS "
                 f"{run.peak_pss / MIB:.0f} MiB (launcher wall {run.wall:.2f} s)")
        figs += [fig, *phases, pss]
    return figs


def _line_counts(lines: list[bytes] | list[str], rank: int) -> int:
    """Lines of print_lines.py's rank ``rank`` among ``lines``."""
    head = f"rank {rank} line "
    return sum(1 for line in lines
               if (line.decode(errors="replace") if isinstance(line, bytes) else line)
               .startswith(head))


def lines_in_files(run_dir: Path) -> dict[int, int]:
    """Local rank -> lines of that rank in its stdout.log (one group on one node: local
    rank = rank)."""
    counts: dict[int, int] = {}
    for path in (run_dir / "logs").rglob("stdout.log"):
        rank = int(path.parent.name)
        if rank in counts:
            raise ValueError(f"two stdout.log files for local rank {rank}: {path}")
        counts[rank] = _line_counts(path.read_bytes().splitlines(), rank)
    return counts


def lines_in_redis(url: str, job_id: str) -> dict[int, int]:
    """Rank -> stdout lines of that rank in the job's log streams, decoded as a reader does:
    a batch written twice (a retried XADD) counts once; an entry that does not decode is an
    error."""
    client = make_client(url)
    try:
        keys = JobKeys(job_id)
        counts: dict[int, int] = {}
        seen: set[tuple] = set()
        for stream in client.smembers(keys.log_streams):
            after = "-"
            while entries := client.xrange(stream, min=after, count=2000):
                batches: list[LogBatch] = []
                for entry_id, fields in entries:
                    decoded = decode_log_entries(entry_id, fields)
                    if decoded is None:
                        raise ValueError(f"undecodable entry {entry_id!r} in {stream!r}")
                    batches += decoded
                for batch in batches:
                    key = (batch.node, batch.rank, batch.attempt, batch.stream, batch.seq)
                    if key in seen or batch.stream != STDOUT:
                        continue
                    seen.add(key)
                    # A live batch's last lines (its live block) are redrawn by the next
                    # batch's first ones.
                    lines = (batch.lines[:len(batch.lines) - int(batch.live)] if batch.live
                             else batch.lines)
                    counts[batch.rank] = counts.get(batch.rank, 0) + _line_counts(
                        lines, batch.rank)
                last = entries[-1][0]
                after = "(" + (last.decode() if isinstance(last, bytes) else last)
        return counts
    finally:
        client.close()


def missing_lines(where: str, counts: dict[int, int], lines: int) -> str:
    """'' when every rank's ``lines`` lines are there, else what is missing."""
    want = {rank: lines for rank in range(NPROC)}
    if counts == want:
        return ""
    got = sum(counts.values())
    return (f"{where} hold {got} of {NPROC * lines} lines "
            f"(per rank: {dict(sorted(counts.items()))})")


def bench_c(bench: Bench, launchers: dict[str, str], repeat: int, lines: int) -> list[Figure]:
    tee = Figure("c", f"c) 4 x {lines} lines, --tee 3, all checked in files (+ Redis): wall",
                 "s", 0.5)
    plain = Figure("c", f"c) 4 x {lines} lines, no --tee (reference): wall", "s", None)
    server = RedisServer().start()
    try:
        client = make_client(server.url)
        for fig, flags in ((tee, ["--tee", "3"]), (plain, [])):
            for i, name, exe in rounds(launchers, repeat, [fig]):
                client.flushall()  # every run starts on an empty server, as --standalone's
                run = bench.run(name, exe, flags, "print_lines.py", ["--lines", str(lines)],
                                sample_interval=0.05, quiet=True, redis_url=server.url)
                if not _check([fig], name, run, "c"):
                    continue
                checked = ""
                if flags:
                    try:
                        lost = missing_lines("the stdout.log files",
                                             lines_in_files(run.extra["run_dir"]), lines)
                        if not lost and name == "elastic-agent":
                            lost = missing_lines("the job's log streams in Redis", lines_in_redis(
                                server.url, run.extra["job_id"]), lines)
                    except (OSError, ValueError) as exc:
                        lost = f"cannot count the lines: {exc}"
                    if lost:
                        _check([fig], name, Run(ok=False, error=f"LINES LOST: {lost}"), "c")
                        continue
                    checked = ", all lines in files" + (
                        " and Redis" if name == "elastic-agent" else "")
                fig.add(name, run.wall)
                note(f"  c {name} {'tee' if flags else 'no tee'} {i + 1}/{repeat}: "
                     f"{run.wall:.2f} s{checked}")
        client.close()
    finally:
        server.cleanup()
    return [tee, plain]


def bench_d(bench: Bench, launchers: dict[str, str], repeat: int, rate: int,
            duration: float) -> list[Figure]:
    cpu = Figure("d", f"d) launcher CPU incl. helpers (tree minus workers), {rate // 1000}k "
                 f"lines/s x {duration:g} s, --tee 3", "s", None)
    own = Figure("d", "d) of which the launcher process itself", "s", None)
    per_worker = int(rate * duration / NPROC)
    for i, name, exe in rounds(launchers, repeat, [cpu, own]):
        run = bench.run(name, exe, ["--tee", "3"], "print_lines.py",
                        ["--lines", str(per_worker), "--rate", str(rate)],
                        sample_interval=0.02, quiet=True)
        if run.ok and run.leftovers:
            run = Run(ok=False, error=f"{run.leftovers} process(es) outlived the launcher: "
                      "their CPU is not in its tree's total")
        if not _check([cpu, own], name, run, "d"):
            continue
        cpu.add(name, run.tree_cpu - run.worker_cpu)
        own.add(name, run.own_cpu)
        note(f"  d {name} {i + 1}/{repeat}: tree {run.tree_cpu:.2f} s - workers "
             f"{run.worker_cpu:.2f} s = {run.tree_cpu - run.worker_cpu:.2f} s (launcher "
             f"{run.own_cpu:.2f} s, helpers sampled {run.helper_cpu:.2f} s), wall "
             f"{run.wall:.2f} s")
    return [cpu, own]


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.0f} {unit}" if unit == "MiB" else f"{value:.3f} {unit}"


def print_table(figs: list[Figure], names: list[str]) -> None:
    agent = "elastic-agent"
    headers = ["figure", "torchrun", agent, "ratio", "goal", "met"]
    rows = []
    for fig in figs:
        t = fig.median("torchrun") if fig.part_of is None else fig.part_of.median("torchrun")
        a = fig.median(agent)
        ratio = a / t if a is not None and t else None
        goal = f"<= {fig.goal:g}x" if fig.goal is not None else "-"
        met = "-" if fig.goal is None or ratio is None else ("yes" if ratio <= fig.goal else "NO")
        rows.append([fig.label, "" if fig.part_of is not None else
                     _fmt(t, fig.unit) if "torchrun" in names else "not run",
                     _fmt(a, fig.unit) if agent in names else "not run",
                     f"{ratio:.2f}x" if ratio is not None else "n/a", goal, met])
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                     for i, (h, w) in enumerate(zip(headers, widths, strict=True)))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    reported: set[tuple[str, str, str]] = set()
    for fig in figs:
        for name, err in fig.failed.items():
            key = (name, fig.key, err)
            if key not in reported:
                reported.add(key)
                print(f"n/a for {name} in {fig.key}): {err}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--only", default="a,b,c,d",
                        help="comma-separated figures: a,b,c,d (b includes b2, with torch)")
    parser.add_argument("--lines", type=int, default=100_000, help="lines per worker in (c)")
    parser.add_argument("--rate", type=int, default=20_000, help="job-wide lines/s in (d)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of output in (d)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help="comma-separated: torchrun,elastic-agent")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds before one launcher run is killed")
    args = parser.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if not only <= set("abcd"):
        parser.error(f"--only takes a,b,c,d, not {args.only}")
    names = [x.strip() for x in args.launchers.split(",") if x.strip()]
    if not set(names) <= set(LAUNCHERS) or not names:
        parser.error(f"--launchers takes {','.join(LAUNCHERS)}")

    launchers: dict[str, str] = {}
    missing: dict[str, str] = {}
    for name in names:
        exe = find_launcher(name)
        if exe is None:
            missing[name] = f"{name}: not found next to {sys.executable} or on PATH"
            print(f"error: {missing[name]}")
        else:
            launchers[name] = exe

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    print(f"launch bench: {os.cpu_count()} cores, torch {torch_version}, Python "
          f"{sys.version.split()[0]}, {NPROC} workers, median of {args.repeat}")
    for name, exe in launchers.items():
        print(f"  {name}: {exe}")

    figs: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="launch-bench-") as tmp:
        bench = Bench(Path(tmp), args.timeout)
        if "a" in only:
            figs += bench_a(bench, launchers, args.repeat)
        if "b" in only:
            figs += bench_b(bench, launchers, args.repeat)
        if "c" in only:
            figs += bench_c(bench, launchers, args.repeat, args.lines)
        if "d" in only:
            figs += bench_d(bench, launchers, args.repeat, args.rate, args.duration)
    for fig in figs:
        for name, why in missing.items():
            fig.failed[name] = why
    print()
    print_table(figs, names)
    print("\npeak RSS: the largest sum of RSS over the launcher and all its descendants, "
          "sampled every 5 ms\n  by a psutil thread (pages shared by several processes count "
          "in each; a fork not yet exec'd\n  is not counted again). ru_maxrss: os.wait4 on the "
          "launcher (the larger of its own peak and\n  any reaped child's). Launcher's own CPU: "
          "utime+stime in /proc/<pid>/stat of the exited launcher before\n  it is reaped, "
          "children excluded (wait4's rusage would include the reaped workers).\n  Launcher CPU "
          "incl. helpers: the tree's exact total (the same stat, plus cutime+cstime) minus\n"
          "  the workers' CPU sampled every 20 ms.\n"
          "phases of (b): elastic-agent's restart, split by the marks its workers_started event "
          "carries;\n  each phase's ratio is to torchrun's whole restart (the budget). Medians "
          "per phase: they need\n  not add up to the median of the whole.")
    ok = all(fig.median(name) is not None for fig in figs for name in names
             if fig.part_of is None or name == "elastic-agent")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
