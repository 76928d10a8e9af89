"""The examples and the launch bench, run for real under torchrun (gloo on the CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
TRAIN = str(ROOT / "examples" / "train.py")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHELASTIC_") and k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _train(tmp: Path, *flags: str, max_restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts",
           str(max_restarts), "--log-dir", str(tmp / "logs"), TRAIN, "--steps", "6",
           "--checkpoint-every", "2", "--checkpoint-dir", str(tmp / "ckpt"),
           "--dump-params", str(tmp / "params"), *flags]
    return subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=150)


def _dumps(tmp: Path) -> list[dict]:
    return [json.loads((tmp / f"params.rank{r}").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("crash")
    proc = _train(tmp, "--crash-rank", "1", "--crash-step", "3", max_restarts=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return tmp, out


def test_train_crashes_once_restarts_and_resumes(crashed_run: tuple[Path, str]) -> None:
    tmp, out = crashed_run
    assert "injected crash: rank 1 at step 3" in out
    assert out.count("resumed from step 2") == 2, out[-4000:]
    dumps = _dumps(tmp)
    assert dumps[0]["sha256"] == dumps[1]["sha256"]
    assert dumps[0]["sum"] == dumps[1]["sum"]
    assert all(d["resumed"] and d["resumed_from"] == 2 and d["attempt"] == 1 for d in dumps)
    # @record wrote the crashing rank's error file, with the traceback, on attempt 0.
    errors = [json.loads(p.read_text()) for p in (tmp / "logs").rglob("attempt_0/1/error.json")]
    assert errors, "no error.json for rank 1 on attempt 0"
    message = errors[0]["message"]
    assert "InjectedCrash" in message["message"]
    assert "Traceback" in message["extraInfo"]["py_callstack"]


def test_resumed_run_matches_uninterrupted_run(crashed_run: tuple[Path, str],
                                               tmp_path: Path) -> None:
    proc = _train(tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "resumed from step" not in proc.stdout
    clean = _dumps(tmp_path)
    resumed = _dumps(crashed_run[0])
    assert not clean[0]["resumed"]
    assert clean[0]["sha256"] == clean[1]["sha256"] == resumed[0]["sha256"]


def test_launch_bench_harness_with_torchrun() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "launch_bench.py"), "--launchers", "torchrun",
           "--only", "a,b", "--repeat", "1", "--timeout", "60"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("figure"))
    assert re.split(r"\s{2,}", lines[header].strip()) == [
        "figure", "torchrun", "elastic-agent", "ratio", "goal", "met"]
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines[header + 2:]
            if ln.startswith(("a) ", "b) "))]
    # a) wall, peak RSS of the tree, ru_maxrss; b) the restart, peak PSS of the node.
    assert {r[0][0] for r in rows} == {"a", "b"} and len(rows) == 5
    for label, torchrun, agent, ratio, _goal, _met in rows:
        value, unit = torchrun.split()
        assert float(value) > 0 and unit in ("s", "MiB"), label
        assert agent == "not run" and ratio == "n/a"


def test_crash_timing_parser(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import launch_bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    stamps = tmp_path / "t.txt"
    stamps.write_text("start 0 0 10.0\nstart 0 1 10.1\ncrash 11.0\n"
                      + "".join(f"start 1 {r} {11.1 + r / 10}\n" for r in range(4)))
    assert launch_bench.parse_crash_timing(stamps) == pytest.approx(0.4)
    stamps.write_text("crash 11.0\nstart 1 0 11.2\n")
    with pytest.raises(ValueError):
        launch_bench.parse_crash_timing(stamps)
