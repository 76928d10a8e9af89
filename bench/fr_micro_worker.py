"""One gloo rank for bench/flight_recorder_bench.py's in-process figures: the time of an
all_reduce (with whatever TORCH_FR_BUFFER_SIZE it was given), of one sample of the trace
thread's sampler, and of one trace (the dump the agent asks for), printed as JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

PROBE = Path(__file__).resolve().parent.parent / "agent" / "supervision" / "launch" / "recorder_probe.py"


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[1] if len(sys.argv) > 1 else "29540")
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(1024)
    n = 5000
    for _ in range(n):  # warm up, and fill the recorder's buffer
        dist.all_reduce(t)
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    collective_us = (time.perf_counter() - t0) / n * 1e6
    spec = importlib.util.spec_from_file_location("recorder_probe", PROBE)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    sampler = probe.Sampler()
    t0 = time.perf_counter()
    for _ in range(2000):
        sampler.sample()
    sample_us = (time.perf_counter() - t0) / 2000 * 1e6
    t0 = time.perf_counter()
    for _ in range(10):
        probe.trace()
    trace_ms = (time.perf_counter() - t0) / 10 * 1e3
    print(json.dumps({"collective_us": collective_us, "sample_us": sample_us,
                      "trace_ms": trace_ms, "sample_interval_s": probe.SAMPLE_S}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
