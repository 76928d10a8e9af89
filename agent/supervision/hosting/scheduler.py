"""The scheduler's signals and requeues, for an agent started by srun (``cfg.slurm``).

What each signal means under SLURM (README.md, "Run under SLURM"):

* SIGTERM: ``scancel``, the time limit, preemption, a requeue, or ``--signal=TERM@T``. The
  agent stops its workers cleanly (their stacks captured first, SIGTERM, SIGKILL to the whole
  tree after ``--shutdown-timeout``) and the job ends as ``stopped`` by the scheduler: one
  ``job_stopped`` event with ``issuer`` "the scheduler", ``scheduler`` "slurm" and the
  signal. The agent exits 143 (128 + 15); the other nodes' agents, seeing the job closed,
  exit 143 too.
* SIGUSR1: ``sbatch --signal=USR1@T`` (what PyTorch Lightning users already pass): the time
  limit is T seconds away. The same clean stop, now, while there is time for it (at the
  limit SLURM sends SIGTERM and SIGKILL ``KillWait`` seconds later, 30 by default); the
  agent exits 138 (128 + 10).

SLURM signals every process of a step (proctrack/cgroup, proctrack/linuxproc), so workers
can die of the same SIGTERM an instant before their agent's handler runs: a worker killed by
such a signal is not called a failure until the agent has waited a moment for its own.

A job requeued by SLURM (``scontrol requeue``, a node failure with ``--requeue``) runs its
batch script again under the same SLURM job id, so the agents come back under the same
elastic job id with ``SLURM_RESTART_COUNT`` one higher. The first of them to start reopens
the job (:data:`REOPEN`): its end is forgotten, everything else (events, logs, the
job-wide restart counter) stays, so the history is kept and the restart count continues.
With the Redis the first node hosts (no ``--redis``), nothing survives the requeue.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

from elastic_agent.coordination.wire.keyspace import JobKeys

#: Signals that are the scheduler stopping the job, when the agent runs under srun.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_MEANING = {
    signal.SIGTERM: "scancel, the time limit, preemption or a requeue",
    signal.SIGUSR1: "--signal: the time limit is near",
}
#: How long a worker's death by one of these signals waits for the agent's own signal
#: before it counts as a failure: SLURM signals a step's processes one after the other.
_SIGNALLED_TOO = frozenset(int(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGKILL,
                                              signal.SIGINT, signal.SIGHUP))
SIGNAL_GRACE_S = 0.5

# Reopens a requeued job once per SLURM restart count: its end is forgotten and a fresh
# rendezvous round opens (the previous round's members are gone for good: nobody waits for
# them to come back). KEYS: meta, rdzv state, members, waiting, ranks, left, lost.
# ARGV: SLURM_RESTART_COUNT. Returns 1 for the one agent that reopened it, else 0.
REOPEN = """
local seen = tonumber(redis.call('HGET', KEYS[1], 'slurm_restart_count') or '0') or 0
if tonumber(ARGV[1]) <= seen then return 0 end
redis.call('HSET', KEYS[1], 'slurm_restart_count', ARGV[1])
redis.call('HDEL', KEYS[1], 'final_state')
local round = tonumber(redis.call('HGET', KEYS[2], 'round') or '')
if round then
  redis.call('HSET', KEYS[2], 'round', round + 1, 'status', 'open', 'closed', 0,
             'deadline', 0, 'back', 0)
  redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
end
return 1
"""


async def reopen(client: Any, keys: JobKeys, restart_count: int) -> bool:
    """Run :data:`REOPEN` (one call, O(1) but for the previous round's membership, deleted
    once per requeue); True for the one agent of the job that reopened it."""
    reopened = await client.eval(REOPEN, 7, keys.meta, keys.rdzv_state, keys.rdzv_members,
                                 keys.rdzv_waiting, keys.rdzv_ranks, keys.rdzv_left,
                                 keys.rdzv_lost, restart_count)
    return bool(reopened == 1)


def is_scheduler_stop(under_slurm: bool, sig: int) -> bool:
    return under_slurm and sig in STOP_SIGNALS


def stopped_fields(sig: int) -> dict[str, Any]:
    """The ``job_stopped`` event's fields for a stop by the scheduler."""
    s = signal.Signals(sig)
    return {"issuer": "the scheduler", "scheduler": "slurm", "signal": s.name,
            "meaning": _MEANING.get(s, "")}


def killed_by_a_signal(failures: Any) -> bool:
    """Whether a failed worker died of a signal SLURM sends a whole step (or of 128+N)."""
    names = {signal.Signals(n).name for n in _SIGNALLED_TOO}
    for e in failures:
        code = getattr(e, "exit_code", None)
        if getattr(e, "signal", None) in names or (
                type(code) is int and (code - 128 in _SIGNALLED_TOO or -code in _SIGNALLED_TOO)):
            return True
    return False


async def own_signal_soon(signalled: asyncio.Future[int],
                          timeout: float = SIGNAL_GRACE_S) -> bool:
    """Wait up to ``timeout`` for the agent's own signal; whether it came."""
    if not signalled.done():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(signalled), timeout)
    return signalled.done()
