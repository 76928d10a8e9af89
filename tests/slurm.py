"""A real two-node SLURM cluster on this host, for the tests: munged, slurmctld and two
``slurmd -N n1`` / ``-N n2`` (NodeAddr 127.0.0.1, a port each), all private to one temporary
directory (its own munge socket and key, its own state), started as this process's children
and stopped with them. Needs Debian's slurm-wlm and munge (scripts/ensure-tools.sh installs
them) and root (slurmd launches steps as the submitting user through setuid slurmstepd).

Every port is free when picked and the first job id is random, so two test sessions on one
machine (two engineers) run two clusters side by side without sharing a job id, which the
agent turns into a Redis port (agent/supervision/hosting/slurm.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from elastic_agent.coordination.ports import port_is_free

from .waiting import wait_until

NODES = ("n1", "n2")
#: Seconds between scancel's SIGTERM and its SIGKILL (slurm.conf KillWait): the agent's clean
#: stop must fit in it, as on a real cluster (default 30 there).
KILL_WAIT_S = 10

_DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol", "scancel")


class SlurmUnavailableError(RuntimeError):
    pass


def missing_programs() -> list[str]:
    return [p for p in _DAEMONS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``start()`` returns once ``sinfo`` shows both nodes idle; ``env`` is what a client
    command (srun, sbatch, squeue) needs to talk to this cluster and no other."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="elastic-slurm-"))
        os.chmod(self.dir, 0o755)  # munged refuses a socket in a group/world-writable place
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if var != "SLURM_CONF":
                del self.env[var]  # the test session itself may run under SLURM

    def start(self, timeout: float = 30.0) -> SlurmCluster:
        missing = missing_programs()
        if missing:
            raise SlurmUnavailableError(
                f"SLURM is not installed here (missing {', '.join(missing)}): run "
                "scripts/ensure-tools.sh .venv slurm as root (apt-get install slurm-wlm munge)")
        if os.geteuid() != 0:
            raise SlurmUnavailableError("the SLURM test cluster needs root (slurmd runs steps "
                                        "as the submitting user)")
        try:
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            for node in NODES:
                self._spawn(f"slurmd-{node}", [_exe("slurmd"), "-D", "-N", node,
                                                "-f", str(self.conf)])
            wait_until(self._nodes_idle, timeout, "both SLURM nodes idle in sinfo")
        except BaseException as exc:
            logs = self.logs()
            self.stop()
            if isinstance(exc, AssertionError):
                raise SlurmUnavailableError(f"the SLURM test cluster did not come up: {exc}\n"
                                            f"{logs}") from None
            raise
        return self

    def _start_munge(self) -> None:
        (self.dir / "munge").mkdir(mode=0o700)
        key = self.dir / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        os.write(fd, os.urandom(1024))
        os.close(fd)
        subprocess.run(
            [_exe("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={self.dir / 'munge' / 'munged.pid'}",
             f"--log-file={self.dir / 'munge' / 'munged.log'}",
             f"--seed-file={self.dir / 'munge' / 'munged.seed'}"],
            check=True, capture_output=True, timeout=10)
        # munged daemonizes (no foreground flag keeps its socket checks): its pid file says
        # which process to stop.

    def _write_conf(self) -> None:
        ports = _listen_ports(1 + len(NODES))
        d = self.dir
        lines = [
            f"ClusterName=ec{random.randrange(10**6)}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd-%n.log",
            # linuxproc signals every descendant of a step, as proctrack/cgroup does on real
            # clusters: the workers get scancel's SIGTERM at the same moment as their agent.
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin", "MpiDefault=none", "ReturnToService=2",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "SlurmdParameters=config_overrides",
            f"KillWait={KILL_WAIT_S}", "MinJobAge=300", "SlurmctldTimeout=30",
            "SlurmdTimeout=30", "InactiveLimit=0", "JobRequeue=1",
            f"FirstJobId={random.randrange(1000, 10**6)}",
        ]
        for node, port in zip(NODES, ports[1:], strict=True):
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname=localhost "
                         f"Port={port} CPUs=4 RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=YES")
        (d / "state").mkdir()
        for node in NODES:
            (d / f"spool-{node}").mkdir()
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=self.env,
                                           start_new_session=True))
        log.close()

    def run(self, *argv: str, timeout: float = 30.0, check: bool = True,
            **kwargs: object) -> subprocess.CompletedProcess[str]:
        """A client command (srun, sbatch, squeue, ...) against this cluster."""
        env = {**self.env, **kwargs.pop("env", {})}  # type: ignore[dict-item]
        return subprocess.run(list(argv), env=env, capture_output=True, text=True,
                              timeout=timeout, check=check, **kwargs)  # type: ignore[arg-type]

    def _nodes_idle(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=5, check=False).stdout
        except subprocess.TimeoutExpired:
            return False
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in NODES)

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", job_id, "-o", check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return ""

    def logs(self) -> str:
        parts = []
        for path in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            text = path.read_text(errors="replace").strip().splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def _cancel_all_jobs(self) -> None:
        """A failed test may leave a job running: its slurmstepd (a daemon of its own) would
        outlive slurmd. Cancel every job and wait for their steps to end (bounded)."""
        if not self.procs or any(p.poll() is not None for p in self.procs):
            return
        try:
            jobs = self.run("squeue", "-h", "-o", "%i", timeout=5, check=False).stdout.split()
            if not jobs:
                return
            self.run("scancel", *jobs, timeout=5, check=False)
            wait_until(lambda: not self.run("squeue", "-h", "-o", "%i", "-t", "R,CG",
                                            timeout=5, check=False).stdout.split(),
                       KILL_WAIT_S + 5, "the cancelled jobs' end")
        except (subprocess.SubprocessError, AssertionError):
            pass  # the daemons are stopped next whatever happened

    def stop(self) -> None:
        self._cancel_all_jobs()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        # slurmctld takes 3-10 s to save a state nobody will read: 1 s, then SIGKILL.
        deadline = time.monotonic() + 1
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        pid_file = self.dir / "munge" / "munged.pid"
        if pid_file.exists():
            with contextlib.suppress(ValueError, ProcessLookupError, AssertionError):
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                # It writes its seed file as it exits: wait, or it lands in a removed dir.
                wait_until(lambda: _gone(pid), 5, "munged's exit")
        self.procs = []

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent (init) has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _listen_ports(n: int) -> list[int]:
    """``n`` free ports below Linux's ephemeral range (32768-60999): a port picked from that
    range (bind to 0) can be taken, before the daemon binds it, as the local port of any
    outgoing connection on this host (a CI run met slurmctld's so, with another test running
    beside it). Below 20000 too: the agents derive their Redis's port from 20000 up."""
    picked: list[int] = []
    while len(picked) < n:
        port = random.randrange(10000, 20000)
        if port not in picked and port_is_free(port):
            picked.append(port)
    return picked
