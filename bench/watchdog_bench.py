"""Worker watchdog, torchrun against elastic-agent: how late an overrunning worker dies.

Both launchers run ``--standalone --nproc-per-node 1`` with ``TORCHELASTIC_ENABLE_FILE_TIMER=1``
and the same worker: torch's own ``FileTimerClient`` and ``expires(after=1)`` around a 60 s
sleep. The worker writes its pid and its timer's deadline (its ``time.time()`` + 1) to a file;
this script opens a pidfd on that pid and notes ``time.time()`` when it becomes readable (the
worker has died). Printed per launcher: the median and the worst of (death - deadline) over
``--repeat`` runs, how the worker ended, and the launcher's exit status (torch's server
also kills its own process with the worker's signal: torchrun exits 137; elastic-agent reports
a failed job, 1). One host, one clock. Linux only (pidfd).

    python bench/watchdog_bench.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

WORKER = """\
import os, time
from pathlib import Path
from torch.distributed.elastic import timer

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
out = Path(os.environ["WD_BENCH_OUT"])
with timer.expires(after=1, scope="bench"):
    deadline = time.time() + 1  # expires() computed its own a moment earlier: a lower bound
    out.with_suffix(".tmp").write_text(f"{os.getpid()} {deadline}")
    os.rename(out.with_suffix(".tmp"), out)
    time.sleep(60)
"""


def launcher_cmd(name: str, script: Path, logs: Path) -> list[str]:
    if name == "torchrun":
        exe = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
        return [exe, "--standalone", "--nproc-per-node", "1", "--log-dir", str(logs), str(script)]
    return [sys.executable, "-m", "elastic_agent.supervision.cli", "--standalone",
            "--nproc-per-node", "1", "--job-id", f"wd-{uuid.uuid4().hex[:8]}",
            "--log-dir", str(logs), str(script)]


def one_run(name: str, tmp: Path) -> tuple[float, str, int]:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    out = tmp / f"{name}-{uuid.uuid4().hex[:6]}.pid"
    env = {**os.environ, "TORCHELASTIC_ENABLE_FILE_TIMER": "1", "WD_BENCH_OUT": str(out)}
    env.pop("TORCHELASTIC_TIMER_FILE", None)
    proc = subprocess.Popen(launcher_cmd(name, script, tmp / "logs"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline_wait = time.monotonic() + 120
        while not out.exists():  # the worker's own file: nothing to be notified by
            if time.monotonic() > deadline_wait or proc.poll() is not None:
                raise RuntimeError(f"{name}: the worker never started")
            time.sleep(0.01)
        pid_s, deadline_s = out.read_text().split()
        fd = os.pidfd_open(int(pid_s))
        try:
            select.select([fd], [], [], 70)
            died = time.time()
        finally:
            os.close(fd)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return died - float(deadline_s), "killed", code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--launchers", default="torchrun,elastic-agent")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for name in args.launchers.split(","):
            lates, codes = [], []
            for _ in range(args.repeat):
                late, _, code = one_run(name, Path(d))
                lates.append(late)
                codes.append(code)
            print(f"{name:14} death after deadline: median {statistics.median(lates) * 1000:6.1f} ms, "
                  f"worst {max(lates) * 1000:6.1f} ms; launcher exit {sorted(set(codes))} "
                  f"({args.repeat} runs)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
