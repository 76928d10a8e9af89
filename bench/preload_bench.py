"""Workers that import torch: elastic-agent against torchrun, side by side in one run
(issues 14 and 23).

Each launcher runs ``bench/preload_worker.py`` (import torch, ``init_process_group("gloo")``,
5 training steps) with ``--standalone --nproc-per-node 4 --max-restarts 1``; in the first
attempt local rank 3 crashes once every rank is past init. Launchers: ``torchrun``;
``elastic-agent --preload off`` (every worker a new interpreter, the default before issue 23);
``elastic-agent`` on default flags (``--preload auto``: the script starts by importing torch,
so a zygote imports it once and the workers are forked); ``elastic-agent --preload torch``.
Figures, medians of ``--repeat`` runs:

  a) launch -> all 4 workers past init_process_group (launcher start to the latest worker's
     timestamp after init in attempt 0);
  b) worker crash -> all 4 past init again (rank 3's timestamp before its exit to the latest
     timestamp after init in attempt 1);
  c) peak PSS of the node: the sum of ``Pss`` (/proc/PID/smaps_rollup, shared pages divided
     among their sharers, so copy-on-write pages of forked workers are counted once) over the
     launcher's whole process tree, sampled every 50 ms.

Timestamps come from the workers (a file), not from launcher output. Each elastic-agent's
restart (b) is also broken down into its phases, as bench/launch_bench.py does: the agent
runs with ``--event-log-handler console`` and the ``restart`` field of its second
``workers_started`` event marks each phase; the last one runs from every worker started to
the last one past ``init_process_group``. Goals: b <= 0.5x on default flags and <= 0.05x with
``--preload torch``, a <= 0.5x with ``--preload torch``, c no more than torchrun in every
mode. Linux only.

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
from typing import Any

import psutil

from launch_bench import PHASES, phase_split, pss, restart_record

HERE = Path(__file__).resolve().parent
WORKER = HERE / "preload_worker.py"
NPROC = 4
BIN = Path(sys.executable).parent
MIB = 1024 * 1024
AGENT = [str(BIN / "elastic-agent"), "--event-log-handler", "console"]
LAUNCHERS = {
    "torchrun": [str(BIN / "torchrun")],
    "elastic-agent --preload off": [*AGENT, "--preload", "off"],
    "elastic-agent": AGENT,
    "elastic-agent --preload torch": [*AGENT, "--preload", "torch"],
}
#: (figure, launcher) -> the largest ratio to torchrun that meets the goal.
GOALS = {("a", "elastic-agent --preload torch"): 0.5,
         ("b", "elastic-agent"): 0.5, ("b", "elastic-agent --preload torch"): 0.05,
         **{("c", name): 1.0 for name in LAUNCHERS if name != "torchrun"}}
_STRIP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "ELASTIC_JOB_ID")



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


def one_run(name: str, workdir: Path, timeout: float) -> dict[str, Any] | str:
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
        return "the zygote fell back to exec (see its warning)"  # not a warm figure
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
    res: dict[str, Any] = {"a": max(init[0]) - t0, "b": max(init[1]) - crash,
                           "c": sampler.peak / MIB}
    if name != "torchrun":
        record = restart_record(run_dir / "launcher.out")
        if record is None:
            return "no restart record among the agent's events"
        res["phases"] = phase_split(record, crash, max(init[1]))
    return res


def _cell(value: float | None, base: float | None, unit: str) -> str:
    if value is None:
        return f"{'n/a':>9} {'':>6}"
    ratio = f"{value / base:>5.2f}x" if base else f"{'':>6}"
    return f"{value:>8.{0 if unit == 'MiB' else 3}f}{unit[0]} {ratio}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180)
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory(prefix="preload-bench-") as tmp:
        for i in range(args.repeat):
            for name in LAUNCHERS:  # interleaved: load changes hit every launcher alike
                res = one_run(name, Path(tmp), args.timeout)
                if isinstance(res, str):
                    print(f"run {i + 1} {name}: FAILED ({res})", file=sys.stderr)
                    continue
                results[name].append(res)
                split = " = " + " + ".join(f"{p * 1000:.0f}" for p in res["phases"]) + " ms" \
                    if "phases" in res else ""
                print(f"run {i + 1} {name}: a {res['a']:.2f} s  b {res['b']:.2f} s{split}  "
                      f"c {res['c']:.0f} MiB", file=sys.stderr, flush=True)
    figures = (("a", "launch -> all 4 past init_process_group", "s"),
               ("b", "crash -> all 4 past init again", "s"),
               ("c", "peak PSS of the node", "MiB"))
    agents = [n for n in LAUNCHERS if n != "torchrun"]
    short = {n: n.removeprefix("elastic-agent").strip() or "default flags" for n in agents}
    print(f"\nmedians of {args.repeat} runs, {NPROC} workers, {os.cpu_count()} CPUs; "
          "elastic-agent columns: value and ratio to torchrun")
    print(f"{'figure':44} {'torchrun':>9} " + " ".join(f"{short[n]:>16}" for n in agents))
    goals: list[str] = []

    def med(name: str, key: str, index: int | None = None) -> float | None:
        values = [r[key] if index is None else r[key][index] for r in results[name]
                  if key in r]
        return statistics.median(values) if values else None

    for key, label, unit in figures:
        t = med("torchrun", key)
        cells = [_cell(med(n, key), t, unit) for n in agents]
        print(f"{key}) {label:41} {_cell(t, None, unit)[:9]} " + " ".join(cells))
        for n in agents:
            goal, v = GOALS.get((key, n)), med(n, key)
            if goal is None:
                continue
            met = v is not None and t is not None and v / t <= goal
            goals.append(f"{key}) {short[n]}: <= {goal:g}x torchrun "
                         f"{'met' if met else 'NOT met'}")
        if key == "b":
            for index, (what, _) in enumerate(PHASES):
                cells = [_cell(med(n, "phases", index), t, unit) for n in agents]
                print(f"   phase: {what[:36]:36} {'':>9} " + " ".join(cells))
    print("\n".join(["", *goals]))
    return 0 if all(results.values()) else 1  # 1: a launcher measured nothing


if __name__ == "__main__":
    sys.exit(main())
