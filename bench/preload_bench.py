"""--preload torch against torchrun, side by side in one run (issue 14).

Each launcher runs ``bench/preload_worker.py`` (import torch, ``init_process_group("gloo")``,
5 training steps) with ``--standalone --nproc-per-node 4 --max-restarts 1``; in the first
attempt local rank 3 crashes once every rank is past init. Launchers: ``torchrun``,
``elastic-agent`` and ``elastic-agent --preload torch``. Figures, medians of ``--repeat`` runs:

  a) launch -> all 4 workers past init_process_group (launcher start to the latest worker's
     timestamp after init in attempt 0);
  b) worker crash -> all 4 past init again (rank 3's timestamp before its exit to the latest
     timestamp after init in attempt 1);
  c) peak PSS of the node: the sum of ``Pss`` (/proc/PID/smaps_rollup, shared pages divided
     among their sharers, so copy-on-write pages of forked workers are counted once) over the
     launcher's whole process tree, sampled every 50 ms.

Timestamps come from the workers (a file), not from launcher output. Goals: b <= 0.1x and
a <= 0.5x torchrun, c no more than torchrun. Linux only.

    python bench/preload_bench.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
WORKER = HERE / "preload_worker.py"
NPROC = 4
BIN = Path(sys.executable).parent
MIB = 1024 * 1024
LAUNCHERS = {
    "torchrun": [str(BIN / "torchrun")],
    "elastic-agent": [str(BIN / "elastic-agent")],
    "elastic-agent --preload torch": [str(BIN / "elastic-agent"), "--preload", "torch"],
}
_STRIP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "ELASTIC_JOB_ID")


def pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class PssSampler(threading.Thread):
    """Peak of the summed PSS over the launcher's process tree."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.peak = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(0.05):
            try:
                procs = [psutil.Process(self.root),
                         *psutil.Process(self.root).children(recursive=True)]
            except psutil.Error:
                continue
            self.peak = max(self.peak, sum(pss(p.pid) for p in procs))


def one_run(name: str, workdir: Path, timeout: float) -> dict[str, float] | str:
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    notes = run_dir / "notes"
    env = {k: v for k, v in os.environ.items()
           if k not in _STRIP_ENV and not k.startswith("TORCHELASTIC_")}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: no hostname round trip
    env.update(PRELOAD_BENCH_FILE=str(notes), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    cmd = [*LAUNCHERS[name], "--standalone", "--nproc-per-node", str(NPROC),
           "--max-restarts", "1", "--log-dir", str(run_dir / "logs")]
    if name.startswith("elastic-agent"):
        job = f"bench-{uuid.uuid4().hex[:10]}"
        cmd += ["--job-id", job]
        env["ELASTIC_JOB_ID"] = job
    cmd.append(str(WORKER))
    with open(run_dir / "launcher.out", "wb") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                cwd=run_dir, start_new_session=True)
    sampler = PssSampler(proc.pid)
    sampler.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"timed out after {timeout} s"
    finally:
        sampler.stop_event.set()
        sampler.join()
    if code != 0:
        return f"exit status {code}: see {run_dir / 'launcher.out'}"
    if b"elastic-agent zygote:" in (run_dir / "launcher.out").read_bytes():
        return "the zygote fell back to exec (see its warning)"  # not a --preload figure
    init: dict[int, list[float]] = {0: [], 1: []}
    crash = None
    for line in notes.read_text().splitlines():
        what, attempt, _, t = line.split()
        if what == "init":
            init[int(attempt)].append(float(t))
        else:
            crash = float(t)
    if len(init[0]) != NPROC or len(init[1]) != NPROC or crash is None:
        return f"incomplete notes in {notes}"
    return {"a": max(init[0]) - t0, "b": max(init[1]) - crash, "c": sampler.peak / MIB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory(prefix="preload-bench-") as tmp:
        for i in range(args.repeat):
            for name in LAUNCHERS:  # interleaved: load changes hit every launcher alike
                res = one_run(name, Path(tmp), args.timeout)
                if isinstance(res, str):
                    print(f"run {i + 1} {name}: FAILED ({res})", file=sys.stderr)
                    continue
                results[name].append(res)
                print(f"run {i + 1} {name}: a {res['a']:.2f} s  b {res['b']:.2f} s  "
                      f"c {res['c']:.0f} MiB", file=sys.stderr, flush=True)
    figures = (("a", "launch -> all 4 past init_process_group", "s", 0.5),
               ("b", "crash -> all 4 past init again", "s", 0.1),
               ("c", "peak PSS of the node", "MiB", 1.0))
    base = results["torchrun"]
    print(f"\nmedians of {args.repeat} runs, {NPROC} workers, {os.cpu_count()} CPUs")
    print(f"{'figure':44} {'torchrun':>10} {'agent':>10} {'ratio':>6} {'preload':>10} "
          f"{'ratio':>6} {'goal':>6}")
    ok = True
    for key, label, unit, goal in figures:
        med = {n: statistics.median(r[key] for r in rs) if rs else None
               for n, rs in results.items()}
        t = med["torchrun"]
        cells = []
        for n in ("elastic-agent", "elastic-agent --preload torch"):
            v = med[n]
            cells.append(f"{v:>8.2f}{unit[0]:1} {v / t:>5.2f}x" if v is not None and t
                         else f"{'n/a':>10} {'':>6}")
        p, ok_here = med["elastic-agent --preload torch"], None
        if p is not None and t:
            ok_here = p / t <= goal
            ok = ok and ok_here
        print(f"{key}) {label:41} {t if t is not None else float('nan'):>8.2f}{unit[0]:1} "
              f"{cells[0]} {cells[1]} <={goal:.1f}x {'met' if ok_here else 'NOT met'}")
    return 0 if base else 1


if __name__ == "__main__":
    sys.exit(main())
