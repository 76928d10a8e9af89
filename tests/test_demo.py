"""`make demo` without a terminal: the example job on an embedded Redis runs through its
injected crash and restart to success and prints its summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_without_a_terminal_runs_to_success(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "worker group failed (InjectedCrash" in out
    assert "train.py succeeded" in out and "recovered from: rank 2" in out
    assert "elastic-console attach demo-" in out
