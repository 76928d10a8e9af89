"""No Redis given under SLURM: the step's first node hosts the job's, the others find it.

The first node of ``SLURM_STEP_NODELIST`` starts the ``--standalone`` redis-server, bound to
the address SLURM itself reaches that node at (``NodeAddr``), on a port every node derives
from the job and step ids (slurm.py): nothing has to be exchanged before Redis exists. The
other nodes retry until it answers (bounded), then run as with ``--redis``.

That host is then a single point of failure, as torchrun's c10d store host is: if it dies,
the job's coordination dies with it, and nothing is kept for a requeue. Elastic jobs should
use a real Redis (or Sentinel) through ``--redis`` / ``$ELASTIC_REDIS_URL`` (README.md).
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from collections.abc import Mapping

import redis

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.keyspace import console_client_name

from .slurm import SlurmStep, node_address, redis_port
from .standalone import RedisServer

#: Seconds the other nodes wait for the first node's Redis to answer: srun starts the tasks
#: of a step within a second or two of each other; a node that waits longer is told why.
FIND_TIMEOUT_S = 60.0
#: Seconds the hosting agent keeps its Redis up after its job ended, while the other agents
#: still hold connections (they publish their last records after the exit barrier).
PEERS_LEAVE_TIMEOUT_S = 15.0
_LIST_BELOW = 64
_SCHEDULER_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                      signal.SIGUSR2}


def endpoint(step: SlurmStep, env: Mapping[str, str]) -> tuple[str, int]:
    """(address, port) of the job's Redis on the step's first node."""
    first = step.first_node
    if first is None:
        raise RuntimeError("SLURM_STEP_NODELIST is not set, so the node hosting the job's "
                           "Redis is unknown: give --redis")
    return node_address(first), redis_port(step, env)


def host(step: SlurmStep, addr: str, port: int) -> RedisServer:
    """Start the embedded Redis on this, the first, node. Raises RuntimeError (with what to
    do) when it cannot: another process on the port, no redis-server installed."""
    try:
        bind = addr if ":" in addr else socket.gethostbyname(addr)  # (an IPv6 NodeAddr)
    except OSError as exc:
        raise RuntimeError(f"cannot resolve {addr!r}, the address SLURM gives node "
                           f"{step.first_node} ({exc}): give --redis") from None
    server = RedisServer(port=port, host=bind)
    # SLURM signals every process of the step (scancel's SIGTERM, --signal's SIGUSR1), this
    # server too: it would be gone while the agents record how the job ended. Blocked in the
    # forking thread, the signals stay blocked in redis-server (the mask survives exec, and
    # Redis installs handlers without unblocking): it ends by the SIGKILL of its agent's
    # end (PR_SET_PDEATHSIG, see standalone.py) or by SLURM's after KillWait.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SCHEDULER_SIGNALS)
    try:
        return server.start()
    except RuntimeError as exc:
        server.cleanup()
        raise RuntimeError(f"the job's Redis could not start on {step.first_node} port {port} "
                           f"({exc}); set $ELASTIC_SLURM_REDIS_PORT to a free port, or give "
                           "--redis") from None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def wait_for(url: str, first_node: str, timeout: float = FIND_TIMEOUT_S) -> None:
    """Block until the first node's Redis answers; RuntimeError after ``timeout``."""
    client = make_client(url, retries=0)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if client.ping():
                    return
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job's Redis on {first_node} ({url}) did not answer "
                                   f"within {timeout:g} s: see that node's output, or give "
                                   "--redis")
            time.sleep(0.1)  # it is being started by another node: nothing to wait on
    finally:
        client.close()


def announce(step: SlurmStep, job_id: str, url: str) -> None:
    print(f"[elastic-agent] no Redis given: this node ({step.first_node}) hosts the job's on "
          f"{url}; it is a single point of failure for the job (give --redis for a real one)."
          f"\n[elastic-agent] watch this job with:\n"
          f"    elastic-console attach {job_id} --redis {url}", file=sys.stderr, flush=True)


def wait_for_peers_to_leave(server: RedisServer, job_id: str,
                            timeout: float = PEERS_LEAVE_TIMEOUT_S) -> None:
    """After the hosting agent's job ended: until no other agent holds a connection (they
    write their last records after ours), ``timeout`` at most. Consoles do not count: the
    standalone linger (cli.py) is theirs."""
    client = make_client(server.url, retries=0)
    console = console_client_name(job_id)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            # INFO's count costs O(1) however many agents are still connected; the list
            # (O(connections)) only once few are left, to leave consoles out.
            connected = int(client.info("clients").get("connected_clients", 0))
            if connected <= 1 or (connected <= _LIST_BELOW and sum(
                    1 for c in client.client_list() if c.get("name") != console) <= 1):
                return  # this client alone, or with consoles
            time.sleep(0.1)  # nothing notifies a disconnect
    except (redis.RedisError, OSError):
        pass
    finally:
        client.close()
