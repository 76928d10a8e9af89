"""torch's flight recorder and the straggler sampler (issue 22): what they cost, how fast a
slow rank is named, and that a balanced job never is.

a) Cost: ``bench/fr_step_worker.py`` (2 gloo ranks; each step 8 matmuls and an all_reduce of
   64k floats) under ``elastic-agent --standalone`` with the recorder off
   (``--flight-recorder 0 --straggler-interval 0``) and on default flags (recorder of 256
   entries, the trace thread sampling every 0.1 s, the straggler check every 15 s), runs
   alternated, ``--repeat`` each; torchrun (no recorder) beside them. The figure is the mean
   step time of rank 0's timed steps, median over the runs, and the recorder's cost as a
   share of it (goal < 1%). On a shared machine run-to-run noise is larger than the cost, so
   the same is also measured in one process (``bench/fr_micro_worker.py``, one gloo rank):
   an all_reduce with the recorder off and on (5,000 after 5,000 that fill the buffer), one
   sample of the trace thread (taken every 0.1 s) and one trace at 256 and 2,000 entries; the
   sampler's share of a core is its cost per 0.1 s.
b) Time to name a straggler: examples/straggler.py on 4 ranks, rank 3 computing 1.6x longer
   per step, default flags (``--straggler-interval 15``): seconds from the
   ``workers_started`` event to the ``straggler`` event (both from the agent's
   ``--event-log-handler console`` lines; goal <= 60 s).
c) A balanced job (``SLOW_RANK=-1``) for ``--balanced-seconds`` (default 300) on default
   flags: the ``straggler`` events it got (goal: none).

    python bench/flight_recorder_bench.py [--repeat 5] [--balanced-seconds 300] [--skip-b --skip-c]

The machine is shared (2 cores): compare the columns of one run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
WORKER = HERE / "fr_step_worker.py"
STRAGGLER = ROOT / "examples" / "straggler.py"
AGENT = [str(BIN / "elastic-agent"), "--standalone", "--event-log-handler", "console"]
OFF = ["--flight-recorder", "0", "--straggler-interval", "0"]


def run(argv: list[str], env: dict[str, str], timeout: float,
        stderr: Path | None = None) -> subprocess.CompletedProcess:
    with open(stderr or os.devnull, "w") as err:
        return subprocess.run(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                              stderr=err, timeout=timeout, check=False)


def step_ms(launcher: list[str], steps: int, tmp: Path) -> float:
    out = tmp / f"r{time.monotonic_ns()}"
    p = run([*launcher, "--nproc-per-node", "2", str(WORKER)],
            {"RESULT_FILE": str(out), "STEPS": str(steps)}, 600)
    if p.returncode != 0 or not out.exists():
        raise SystemExit(f"{launcher} failed ({p.returncode})")
    return float(out.read_text())


def micro(entries: int, port: int) -> dict:
    p = subprocess.run([sys.executable, str(HERE / "fr_micro_worker.py"), str(port)],
                       env={**os.environ, "TORCH_FR_BUFFER_SIZE": str(entries)},
                       capture_output=True, text=True, timeout=300, check=False)
    if p.returncode != 0:
        raise SystemExit(f"fr_micro_worker failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def events(stderr: Path, name: str) -> list[dict]:
    out = []
    for line in stderr.read_text(errors="replace").splitlines():
        if f'"elastic_agent.{name}"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def time_to_name(tmp: Path, seconds: float) -> tuple[float | None, list]:
    err = tmp / "straggler.err"
    run([*AGENT, "--nproc-per-node", "4", str(STRAGGLER)],
        {"SLOW_RANK": "3", "SECONDS": str(seconds)}, seconds * 3 + 120, err)
    started = events(err, "workers_started")
    named = events(err, "straggler")
    if not started or not named:
        return None, named
    return (named[0]["timestamp"] - started[0]["timestamp"]) / 1000, named[0]["metadata"]["ranks"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--balanced-seconds", type=float, default=300)
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--skip-c", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        runs: dict[str, list[float]] = {"torchrun (no recorder)": [], "recorder off": [],
                                        "recorder on (default)": []}
        for _ in range(a.repeat):
            runs["recorder off"].append(step_ms([*AGENT, *OFF], a.steps, tmp))
            runs["recorder on (default)"].append(step_ms(AGENT, a.steps, tmp))
            runs["torchrun (no recorder)"].append(
                step_ms([str(BIN / "torchrun"), "--standalone"], a.steps, tmp))
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"a) step time, median of {a.repeat} runs x {a.steps} steps (2 gloo ranks):")
        for k, v in runs.items():
            print(f"   {k:<24} {med[k]:8.3f} ms   runs: {', '.join(f'{x:.2f}' for x in v)}")
        cost = (med["recorder on (default)"] - med["recorder off"]) / med["recorder off"]
        print(f"   recorder cost: {cost * 100:+.2f}% of the step time (goal < 1%); "
              f"recorder on / torchrun {med['recorder on (default)'] / med['torchrun (no recorder)']:.3f}x")
        figures: dict[int, list[dict]] = {0: [], 256: [], 2000: []}
        for i in range(a.repeat):
            for entries in figures:
                figures[entries].append(micro(entries, 29540 + i * 3 + len(figures[entries])))
        m = {e: {k: statistics.median(f[k] for f in fs) for k in fs[0]}
             for e, fs in figures.items()}
        print(f"   in one process (median of {a.repeat}): all_reduce of 1,024 floats "
              f"{m[0]['collective_us']:.1f} us with the recorder off, "
              f"{m[256]['collective_us']:.1f} us at 256 entries, "
              f"{m[2000]['collective_us']:.1f} us at 2,000")
        sample = m[256]["sample_us"]
        print(f"   sampler: {sample:.1f} us a sample, every {m[256]['sample_interval_s']:g} s: "
              f"{sample / (m[256]['sample_interval_s'] * 1e6) * 100:.4f}% of one core; "
              f"a trace on request: {m[256]['trace_ms']:.1f} ms at 256 entries, "
              f"{m[2000]['trace_ms']:.1f} ms at 2,000")
        if not a.skip_b:
            took, ranks = time_to_name(tmp, 90)
            print(f"b) straggler (rank 3 at 1.6x, 4 ranks, --straggler-interval 15): named "
                  f"after {'never' if took is None else f'{took:.1f} s'} (goal <= 60 s): {ranks}")
        if not a.skip_c:
            err = tmp / "balanced.err"
            run([*AGENT, "--nproc-per-node", "4", str(STRAGGLER)],
                {"SLOW_RANK": "-1", "SECONDS": str(a.balanced_seconds)},
                a.balanced_seconds * 3 + 120, err)
            got = events(err, "straggler")
            checks = len(events(err, "workers_started"))
            print(f"c) balanced job, {a.balanced_seconds:g} s on 4 ranks: {len(got)} straggler "
                  f"events (goal 0){'' if checks else ' (the job did not start!)'}")


if __name__ == "__main__":
    main()
