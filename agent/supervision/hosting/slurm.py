"""What SLURM tells an agent started by ``srun``, read from its environment.

Under ``srun`` (``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` set) an agent needs no ``--job-id`` and
no ``--nnodes``: every task of the step derives the same job id and node count from the
variables slurmstepd gives it, and the step's first node can host the job's Redis. Flags
given explicitly win (config.py applies these only as defaults).

Everything here is a pure function of an environment mapping, except :func:`node_address`
(asks ``scontrol``). The variables are hostile input like any other: a bad value raises
:class:`SlurmEnvError` with one line naming the variable and what to do; the CLI exits 2.

Job id: ``slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>``, always with the step. A batch script may
run several steps one after the other (or side by side), and each is its own training run:
sharing one id, the second would find the first's ended job. The form is SLURM's own
``sacct`` name (``1234.0``), so a job is found from either side; a requeued job runs its
steps again from 0 under the same SLURM job id, so it comes back under the same id.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

#: Hosts a node list may expand to: a job has at most 4,096 nodes; this bounds what a hostile
#: ``n[0-999999999]`` can cost.
MAX_HOSTS = 65536
#: Environment variable naming the port of the Redis the first node hosts (default: derived
#: from the job and step ids, the same on every node without any exchange).
REDIS_PORT_ENV = "ELASTIC_SLURM_REDIS_PORT"
#: Below Linux's default ephemeral range (32768-60999): a port an outgoing connection of this
#: host holds for the moment cannot be listened on (a CI run met it at 38768).
_PORT_BASE, _PORT_SPAN = 20000, 12768

_INT_RE = re.compile(r"[0-9]{1,18}")
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,255}")
_ADDR_RE = re.compile(r"[A-Za-z0-9._:-]{1,255}")


class SlurmEnvError(ValueError):
    """A SLURM variable that cannot be used. The message is one line."""


@dataclass(frozen=True)
class SlurmStep:
    job_id: int
    step_id: int
    nnodes: int
    ntasks: int | None
    node_name: str | None  # SLURMD_NODENAME: this task's node, as SLURM names it
    nodes: tuple[str, ...]  # the step's nodes, SLURM_STEP_NODELIST expanded, in order
    restart_count: int  # SLURM_RESTART_COUNT: times the job was requeued

    @property
    def elastic_job_id(self) -> str:
        return f"slurm-{self.job_id}.{self.step_id}"

    @property
    def first_node(self) -> str | None:
        return self.nodes[0] if self.nodes else None

    @property
    def is_first_node(self) -> bool:
        """This task runs on the step's first node (the one that hosts the Redis)."""
        return self.node_name is not None and self.node_name == self.first_node


def _int(env: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip()
    if not _INT_RE.fullmatch(value) or int(value) < minimum:
        raise SlurmEnvError(f"${name}={raw[:64]!r} is not a whole number >= {minimum}: this "
                            "does not look like srun's environment; unset it or give the "
                            "agent's flags (--job-id, --nnodes) explicitly")
    return int(value)


def expand_hostlist(spec: str, limit: int = MAX_HOSTS) -> list[str]:
    """SLURM's compact host list (``n[1-3,5],gpu07``, ``r[1-2]-n[01-02]``) as names, in
    order; zero padding is kept from each range's lower bound. Raises SlurmEnvError."""
    hosts: list[str] = []
    for item in _split_top(spec):
        expanded = [""]
        for prefix, ranges in _groups(item):
            choices = [prefix] if ranges is None else [prefix + n for n in _ranges(ranges, spec)]
            if len(expanded) * len(choices) + len(hosts) > limit:
                raise SlurmEnvError(f"host list {spec[:64]!r} names more than {limit} hosts")
            expanded = [e + c for e in expanded for c in choices]
        for host in expanded:
            if not _NAME_RE.fullmatch(host):
                raise SlurmEnvError(f"host list {spec[:64]!r}: {host[:64]!r} is not a host name")
        hosts.extend(expanded)
    if not hosts:
        raise SlurmEnvError(f"host list {spec[:64]!r} names no host")
    return hosts


def _split_top(spec: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmEnvError(f"host list {spec[:64]!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"host list {spec[:64]!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth:
        raise SlurmEnvError(f"host list {spec[:64]!r}: '[' without ']'")
    items.append(spec[start:])
    return [i.strip() for i in items if i.strip()]


def _groups(item: str) -> list[tuple[str, str | None]]:
    """``r[1-2]-n[01-02]`` -> [("r", "1-2"), ("-n", "01-02")] (a trailing text: (text, None))."""
    out: list[tuple[str, str | None]] = []
    pos = 0
    for m in re.finditer(r"\[([^\]]*)\]", item):
        out.append((item[pos:m.start()], m.group(1)))
        pos = m.end()
    if pos < len(item):
        out.append((item[pos:], None))
    return out


def _ranges(text: str, spec: str) -> list[str]:
    out: list[str] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not _INT_RE.fullmatch(lo) or (sep and not _INT_RE.fullmatch(hi)):
            raise SlurmEnvError(f"host list {spec[:64]!r}: {part[:32]!r} is not N or N-M")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise SlurmEnvError(f"host list {spec[:64]!r}: range {part[:32]!r} runs backwards")
        if last - first >= MAX_HOSTS or len(out) + last - first >= MAX_HOSTS:
            raise SlurmEnvError(f"host list {spec[:64]!r} names more than {MAX_HOSTS} hosts")
        out.extend(str(n).zfill(len(lo)) for n in range(first, last + 1))
    return out


def gpus_per_node(env: Mapping[str, str]) -> int | None:
    """The GPUs SLURM gave this node: ``SLURM_GPUS_ON_NODE`` (what slurmd bound), else
    ``SLURM_GPUS_PER_NODE`` (``--gpus-per-node``: ``2``, ``a100:2`` or ``a100:2,v100:1``)."""
    on_node = _int(env, "SLURM_GPUS_ON_NODE")
    if on_node is not None:
        return on_node or None
    raw = env.get("SLURM_GPUS_PER_NODE", "").strip()
    if not raw:
        return None
    total = 0
    for item in raw.split(","):
        count = item.rpartition(":")[2].strip()
        if not _INT_RE.fullmatch(count):
            raise SlurmEnvError(f"$SLURM_GPUS_PER_NODE={raw[:64]!r} is not [TYPE:]N[,...]: "
                                "give --nproc-per-node explicitly")
        total += int(count)
    return total or None


def read_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The srun step this process is a task of, or None outside one (a batch script's own
    shell or an ``salloc`` shell are not steps: an agent there is started by hand)."""
    job = _int(env, "SLURM_JOB_ID", 1)
    step = _int(env, "SLURM_STEP_ID")
    if job is None or step is None:
        return None
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", 1) or _int(env, "SLURM_NNODES", 1)
    if nnodes is None:
        raise SlurmEnvError("SLURM_JOB_ID and SLURM_STEP_ID are set but not SLURM_NNODES: "
                            "give --nnodes explicitly")
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS", 1) or _int(env, "SLURM_NTASKS", 1)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    nodes = tuple(expand_hostlist(nodelist)) if nodelist.strip() else ()
    if nodes and len(nodes) != nnodes:
        raise SlurmEnvError(f"$SLURM_STEP_NODELIST names {len(nodes)} nodes but the step has "
                            f"{nnodes}: give --nnodes and --redis explicitly")
    name = env.get("SLURMD_NODENAME")
    if name is not None and not _NAME_RE.fullmatch(name):
        raise SlurmEnvError(f"$SLURMD_NODENAME={name[:64]!r} is not a node name")
    return SlurmStep(job_id=job, step_id=step, nnodes=nnodes, ntasks=ntasks, node_name=name,
                     nodes=nodes, restart_count=_int(env, "SLURM_RESTART_COUNT") or 0)


def check_one_task_per_node(step: SlurmStep) -> None:
    """An agent runs a node's workers: two agents on one node would each count as a node."""
    if step.ntasks is not None and step.ntasks != step.nnodes:
        raise SlurmEnvError(f"the step runs {step.ntasks} tasks on {step.nnodes} nodes: run one "
                            "elastic-agent per node (srun --ntasks-per-node=1) and set the "
                            "workers per node with --nproc-per-node")


def redis_port(step: SlurmStep, env: Mapping[str, str]) -> int:
    """The embedded Redis's port: ``$ELASTIC_SLURM_REDIS_PORT``, else one derived from the
    job and step ids (20000-32767, below the ephemeral ports), so every node knows it
    without asking anyone."""
    given = _int(env, REDIS_PORT_ENV, 1)
    if given is not None:
        if given > 65535:
            raise SlurmEnvError(f"${REDIS_PORT_ENV}={given} is not a port (1..65535)")
        return given
    return _PORT_BASE + (step.job_id * 16 + step.step_id) % _PORT_SPAN


def node_address(node: str, timeout: float = 10.0) -> str:
    """The address SLURM reaches ``node`` at (``NodeAddr`` in ``scontrol show node``): by
    definition reachable from the other nodes, where the node's name may resolve to a
    loopback alias (Debian's 127.0.1.1). The name itself if scontrol cannot say."""
    try:
        out = subprocess.run(["scontrol", "show", "node", node, "-o"], capture_output=True,
                             text=True, timeout=timeout, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return node
    for field in out.split():
        key, _, value = field.partition("=")
        if key == "NodeAddr" and _ADDR_RE.fullmatch(value):
            return value
    return node
