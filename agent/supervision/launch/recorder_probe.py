"""The worker's half of the collective traces (issue 22): a thread that answers the agent.

Loaded by path from the worker bootstrap (:func:`.zygote.arm_recorder`), before any user
code, in workers only: stdlib only, and torch is never imported here. It is looked up in
``sys.modules`` when the agent asks, so a script that does not use torch.distributed costs
one idle thread and nothing else.

Why a thread: a rank blocked inside a collective waits in C++ (``work.wait()``) with the GIL
released, so a Python signal handler would not run until the collective returns, but another
thread does (checked here with gloo). The thread connects to the agent's per-rank Unix socket
(``ELASTIC_RECORDER``, in the agent's private runtime directory) and serves one request a
line:

* ``trace``: torch's flight recorder (``_dump_fr_trace``, enabled by ``TORCH_FR_BUFFER_SIZE``)
  reduced to the newest :data:`PER_GROUP` entries of each process group, with the members of
  each group, as JSON of at most :data:`MAX_REPLY_BYTES`;
* ``sample``: what the sampler saw since the last ``sample`` (below), a few numbers.

Between requests the thread samples, every :data:`SAMPLE_S`, whether this rank is inside a
collective (a group whose newest enqueued collective has not completed: the recorder's own
``pg_status``, no entries copied). A rank that computes longer than the others spends less of
its time waiting inside collectives: the agent compares the fractions (supervision/diagnosis/recorder.py).
gloo records no start or end times (``time_discovered_*`` stay None on the CPU build), which is
why the time is sampled rather than read from the entries.

Every reply is a 4-byte big-endian length and that many bytes of JSON. The thread never raises
into the worker: any failure ends it quietly, and the agent sees the socket close.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import sys
import threading
import time
from typing import Any

#: Entries kept per process group (the newest): enough to see where each rank is and the
#: last few collectives before it.
PER_GROUP = 8
MAX_GROUPS = 64
MAX_REPLY_BYTES = 64 * 1024
SAMPLE_S = 0.1
_MAX_DIMS = 8
_MAX_TENSORS = 8


def _c10d() -> Any:
    torch = sys.modules.get("torch")
    return getattr(getattr(torch, "_C", None), "_distributed_c10d", None)


def _dump(collectives: bool) -> dict[str, Any] | None:
    """torch's flight recorder dump (pickled by torch, in this process: trusted here), or
    None when torch.distributed is not in use."""
    c10d = _c10d()
    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    import pickle

    value = pickle.loads(dump(collectives, False, False))
    return value if isinstance(value, dict) else None


def _groups() -> dict[str, list[int]]:
    """group name -> its global ranks, from torch.distributed's own registry (the recorder's
    ``pg_config`` is empty for gloo groups)."""
    dist = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(dist, "_world", None)
    out: dict[str, list[int]] = {}
    try:
        names = dict(getattr(world, "pg_names", {}))
        ranks = dict(getattr(world, "pg_group_ranks", {}))
        for pg, name in names.items():
            members = ranks.get(pg)
            if members is not None and len(out) < MAX_GROUPS:
                out[str(name)] = sorted(int(r) for r in members)
    except Exception:
        return out
    return out


def _sizes(value: Any) -> list[list[int]]:
    out = []
    for shape in list(value or ())[:_MAX_TENSORS]:
        out.append([int(d) for d in list(shape)[:_MAX_DIMS]])
    return out


def trace() -> dict[str, Any]:
    """This rank's recorder, reduced (see the module docstring)."""
    try:
        dump = _dump(True)
    except Exception as exc:
        return {"error": f"the flight recorder could not be read ({type(exc).__name__})"}
    if dump is None:
        return {"error": "torch.distributed is not in use in this worker"}
    entries: dict[str, list[dict[str, Any]]] = {}
    for e in dump.get("entries") or ():
        if e.get("is_p2p"):
            continue  # send/recv have their own sequence (p2p_seq_id): not analysed here
        pg = e.get("process_group") or ("?", "")
        name = str(pg[0])
        if name not in entries and len(entries) >= MAX_GROUPS:
            continue
        keep = entries.setdefault(name, [])
        keep.append({
            "pg": name, "desc": str(pg[1])[:64] if len(pg) > 1 else "",
            "seq": int(e.get("collective_seq_id") or 0),
            "op": str(e.get("profiling_name") or "")[:64],
            "in": _sizes(e.get("input_sizes")), "out": _sizes(e.get("output_sizes")),
            "done": bool(e.get("retired")) or e.get("state") == "completed",
            "t_ns": int(e.get("time_created_ns") or 0),
        })
        if len(keep) > PER_GROUP:
            del keep[0]
    reply: dict[str, Any] = {
        "groups": _groups(),
        "entries": [e for group in entries.values() for e in group],
    }
    if not reply["entries"] and os.environ.get("TORCH_FR_BUFFER_SIZE", "0") in ("", "0") \
            and not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        reply["error"] = "the flight recorder is off (--flight-recorder 0)"
    return reply


class Sampler:
    """Counts samples and those taken inside a collective, between two ``take()``."""

    def __init__(self) -> None:
        self.samples = 0
        self.busy = 0
        self.since = time.monotonic()

    def sample(self) -> None:
        c10d = _c10d()
        if c10d is None or not self._initialized():
            return
        try:
            dump = _dump(False)
        except Exception:
            return
        status = (dump or {}).get("pg_status") or {}
        inside = any(isinstance(s, dict) and (s.get("last_enqueued_collective") or -1)
                     > (s.get("last_completed_collective") or -1) for s in status.values())
        self.samples += 1
        self.busy += inside

    @staticmethod
    def _initialized() -> bool:
        dist = sys.modules.get("torch.distributed")
        try:
            return bool(dist is not None and dist.is_initialized())
        except Exception:
            return False

    def take(self) -> dict[str, Any]:
        now = time.monotonic()
        out = {"samples": self.samples, "busy": self.busy, "window_s": round(now - self.since, 3)}
        self.samples = self.busy = 0
        self.since = now
        return out


def _send(sock: socket.socket, value: dict[str, Any]) -> None:
    data = json.dumps(value, separators=(",", ":")).encode()
    while len(data) > MAX_REPLY_BYTES and value.get("entries"):
        value["entries"] = value["entries"][len(value["entries"]) // 4 + 1:]  # oldest first
        value["cut"] = True
        data = json.dumps(value, separators=(",", ":")).encode()
    if len(data) > MAX_REPLY_BYTES:
        data = json.dumps({"error": "the trace is too large"}).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def serve(sock: socket.socket, sample_s: float = SAMPLE_S) -> None:
    """Answer the agent until it closes the socket (the thread's body)."""
    sampler = Sampler()
    buf = b""
    # Jittered (0.5 to 1.5 intervals): a fixed period could alias with a training loop's own
    # period and see the same phase of every step.
    jitter = random.Random()
    next_sample = time.monotonic() + sample_s
    while True:
        sock.settimeout(max(0.001, next_sample - time.monotonic()))
        try:
            data = sock.recv(256)
        except TimeoutError:
            data = None
        if data == b"":
            return  # the agent is gone, or this attempt's link was closed
        if data is None:
            sampler.sample()
            next_sample = time.monotonic() + sample_s * (0.5 + jitter.random())
            continue
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line == b"trace":
                _send(sock, trace())
            elif line == b"sample":
                _send(sock, sampler.take())
            else:
                _send(sock, {"error": "unknown request"})
        buf = buf[-256:]


def arm(path: str) -> None:
    """Connect to the agent's socket at ``path`` and start the thread; without the socket the
    worker runs without it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(1.0)
        sock.connect(path)
    except OSError:
        sock.close()
        return

    def run() -> None:
        try:
            serve(sock)
        except Exception:
            pass
        finally:
            sock.close()

    threading.Thread(target=run, name="elastic-collectives", daemon=True).start()
