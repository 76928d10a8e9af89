"""Real frameworks' metrics, end to end: Hugging Face ``Trainer``, Lightning with its default
(Rich) progress bar, and a plain DDP loop that crashes once and resumes, each trained for real
(CPU, gloo) under ``elastic-agent`` on two nodes (two agents on this host), then read back with
the installed ``elastic-console metrics JOB --json``.

The truth is each framework's own record, never our parser: the Trainer's ``log_history``, what
Lightning logged at each batch end (both written by the examples' ``--history-out``), and the
``step N loss X`` lines the DDP loop printed, per rank and attempt, in the agents' log files.
The curve must carry the values as the framework printed them (the Trainer keeps 4 significant
digits, Lightning's Rich bar 3 decimals) at the steps it took them.

One two-node run per framework, 2 workers a node: rank 0's node runs what a one-node job runs
(its agent is group rank 0 and hosts global rank 0's curves in both cases, with a second local
rank beside it), and the other node adds what a one-node job lacks: the points of another
node's ranks, and the median across nodes. A one-node run would only repeat its first half.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from elastic_agent.coordination.wire.event_records import EventType
from tests.agents import EXAMPLES, Agent
from tests.conftest import require
from tests.test_agent import agent_args, of_type

CONSOLE = Path(sys.executable).with_name("elastic-console")
#: heartbeat_timeout is generous: two agents each starting two framework workers on a loaded
#: 2-core host may miss a short one.
FAST = "--rdzv-conf=last_call_timeout=1,heartbeat_timeout=30,keep_alive_interval=0.5,join_timeout=120"
NODES = 2
NPROC = 2


def train(redis_url: str, job: str, tmp: Path, *script: str, flags: tuple[str, ...] = ()
          ) -> list[Path]:
    """Run ``script`` on NODES agents of NPROC workers; each agent's log directory."""
    logs = [tmp / f"logs{i}" for i in range(NODES)]
    agents = [Agent(agent_args(redis_url, job, "--nnodes", str(NODES), "--nproc-per-node",
                               str(NPROC), FAST, "--log-dir", str(logs[i]), *flags, *script),
                    tmp, f"a{i}") for i in range(NODES)]
    codes = [a.wait(300) for a in agents]
    assert codes == [0] * NODES, "\n".join(a.output[-3000:] for a in agents)
    return logs


def curve(redis_url: str, job: str, *flags: str) -> dict[str, Any]:
    """``elastic-console metrics JOB --json`` (the installed command), parsed."""
    p = subprocess.run([str(CONSOLE), "metrics", job, "--redis", redis_url, "--json", *flags],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def printed_as(value: float, fmt: str) -> float:
    return float(format(value, fmt))


def test_hf_trainer(redis_url, r, job_id, tmp_path):
    """The Trainer prints its dicts on rank 0 without a step (its bar on the other stream
    gives it); every logged loss is on rank 0's curve at the Trainer's own step."""
    require("transformers")  # the test extra: missing, it fails here, not in a worker
    history = tmp_path / "history.json"
    train(redis_url, job_id, tmp_path, str(EXAMPLES / "hf_trainer.py"), "--steps", "8",
          "--logging-steps", "2", "--history-out", str(history))
    truth = [h for h in json.loads(history.read_text()) if "loss" in h]
    assert [h["step"] for h in truth] == [2, 4, 6, 8]
    got = curve(redis_url, job_id)
    assert got["metric"] == "loss" and got["rank"] == 0
    assert [(p["step"], p["value"], p["attempt"], p["redone"]) for p in got["points"]] == [
        (h["step"], printed_as(h["loss"], ".4g"), 0, False) for h in truth]
    grad = curve(redis_url, job_id, "--metric", "grad_norm")
    assert [(p["step"], p["value"]) for p in grad["points"]] == [
        (h["step"], printed_as(h["grad_norm"], ".4g")) for h in truth]


#: A Rich frame as a terminal shows it, colours removed: ``Epoch 1/1 ━━╺━━ 4/5 0:00:00 •
#: 0:00:01 113.90it/s train_loss: 6.840 lr: 0.010``.
RICH_FRAME = re.compile(r"Epoch (\d+)/\d+\s+\S+\s+(\d+)/(\d+)\s.*?train_loss: (\S+)")
SGR_OR_CURSOR = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def rich_frames(raw: str) -> dict[int, float]:
    """{global step: train_loss} of every frame Lightning's Rich bar drew: the bar counts
    within an epoch, so the step is ``epoch * total + n``; the last frame of a step wins."""
    out = {}
    for frame in re.split(r"[\r\n]", SGR_OR_CURSOR.sub("", raw)):
        m = RICH_FRAME.search(frame)
        if m:
            out[int(m[1]) * int(m[3]) + int(m[2])] = float(m[4])
    return out


def test_lightning_rich_bar(redis_url, r, job_id, tmp_path):
    """Lightning's default bar (Rich) on the workers' terminals (``--worker-tty on``): every
    frame it drew with a loss is a point of rank 0's curve at its global step, with the loss
    it showed, which is the loss Lightning logged at that step rounded to 3 decimals."""
    require("lightning")
    history = tmp_path / "history.json"
    logs = train(redis_url, job_id, tmp_path, str(EXAMPLES / "lightning_train.py"),
                 "--epochs", "2", "--batches", "5", "--step-sleep", "0.05",
                 "--history-out", str(history), flags=("--worker-tty", "on"))
    truth = {step: loss for step, loss in json.loads(history.read_text())}
    assert sorted(truth) == list(range(1, 11))
    # Rank 0's terminal: the one stdout that holds bar frames (Lightning draws on rank 0 only).
    drawn = [f for d in logs for f in d.glob("*/attempt_*/*/stdout.log")
             if rich_frames(f.read_text(errors="replace"))]
    assert len(drawn) == 1, drawn
    frames = rich_frames(drawn[0].read_text(errors="replace"))
    # Rich may leave a fast step undrawn (frames come from its refresh, not from each batch);
    # both epochs are drawn, so the epoch's offset in the step is checked.
    assert len(frames) >= 4 and min(frames) <= 5 < max(frames), frames
    for step, shown in frames.items():
        assert shown == printed_as(truth[step], ".3f"), (step, shown, truth[step])
    got = curve(redis_url, job_id)
    assert got["metric"] == "train_loss" and got["rank"] == 0
    assert {p["step"]: p["value"] for p in got["points"]} == frames
    assert [p["step"] for p in got["points"]] == sorted(frames)
    assert {(p["attempt"], p["redone"]) for p in got["points"]} == {(0, False)}


STEP_LINE = re.compile(r"step (\d+) loss (\S+)")


def ddp_printed(logs: list[Path], rounds: list[int]) -> dict[int, dict[int, dict[int, float]]]:
    """{rank: {attempt: {step: loss}}} as each rank printed them, from the log files
    (LOG_DIR/<JOB>_<random>/attempt_N/LOCAL_RANK/stdout.log: the first line names the rank;
    N counts the agent's restarts, the curve's attempt is the rendezvous round: ``rounds[N]``)."""
    out: dict[int, dict[int, dict[int, float]]] = {}
    for d in logs:
        for f in d.glob("*/attempt_*/*/stdout.log"):
            text = f.read_text()
            rank = int(re.match(r"rank (\d+)/", text)[1])
            attempt = rounds[int(f.parent.parent.name.removeprefix("attempt_"))]
            out.setdefault(rank, {})[attempt] = {
                int(m[1]): float(m[2]) for m in STEP_LINE.finditer(text)}
    return out


def expected_curve(by_attempt: dict[int, dict[int, float]]) -> list[tuple[int, float, int, bool]]:
    """(step, value, attempt, redone): an attempt's step that an earlier one reached is
    redone (trained again after the resume from the checkpoint)."""
    out, reached = [], -1
    for attempt in sorted(by_attempt):
        steps = by_attempt[attempt]
        out += [(s, v, attempt, s <= reached) for s, v in sorted(steps.items())]
        reached = max(reached, *steps)
    return out


def test_ddp_crash_and_resume(redis_url, r, job_id, tmp_path):
    """Rank 3 (the second node's) crashes at step 5 of the first attempt; every rank resumes
    from the step-4 checkpoint. Rank 0's and rank 3's curves carry every loss each printed, in
    the attempt (the rendezvous round) it was printed in, step 4 of the second attempt marked
    redone; the aggregate is the min, median and max of the four ranks' losses at each step."""
    require("torch")
    logs = train(redis_url, job_id, tmp_path, str(EXAMPLES / "train.py"), "--steps", "8",
                 "--crash-rank", "3", "--crash-step", "5",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), flags=("--max-restarts", "1"))
    rounds = sorted({e.data["round"] for e in of_type(r, job_id, EventType.WORKERS_STARTED)})
    assert len(rounds) == 2
    printed = ddp_printed(logs, rounds)
    assert sorted(printed) == [0, 1, 2, 3]
    assert all(sorted(printed[k]) == rounds for k in printed), printed
    assert max(printed[3][rounds[0]]) == 4 and min(printed[3][rounds[1]]) == 4  # resumed
    for rank in (0, 3):
        got = curve(redis_url, job_id, *(["--rank", str(rank)] if rank else []))
        assert got["metric"] == "loss" and got["rank"] == rank
        want = expected_curve(printed[rank])
        assert [(p["step"], p["value"], p["attempt"], p["redone"]) for p in got["points"]] == want
        assert [s for s, _, a, redone in want if redone] == [4]
    agg = curve(redis_url, job_id, "--aggregate")
    assert agg["rank"] is None
    want = []
    for attempt in rounds:
        steps = sorted({s for k in printed for s in printed[k][attempt]})
        for s in steps:
            values = [printed[k][attempt][s] for k in printed]
            want.append((s, attempt, min(values), statistics.median(values), max(values)))
    got = [(p["step"], p["attempt"], p["min"], p["value"], p["max"]) for p in agg["points"]]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):
        assert g[2] == w[2] and g[4] == w[4] and math.isclose(g[3], w[3]), (g, w)
    assert [p["redone"] for p in agg["points"]] == [
        a == rounds[1] and s <= 4 for s, a, *_ in want]
