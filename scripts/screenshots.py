"""`make screenshots`: SVG screenshots of the console attached to a real run.

A real redis-server, a real elastic-agent running examples/train.py with 4 workers and an
injected crash on the first attempt (at step 28; every rank resumes from the step-20
checkpoint, so steps 20-27 are trained again), and the real ConsoleApp driven by Textual's Pilot:

    screenshots/overview.svg    the job after its restart: header, ranks, live logs, timeline
    screenshots/overview-80x24.svg   the same in an 80x24 terminal (the layout gives way)
    screenshots/filtered.svg    the log view filtered with `/` to lines matching "loss"
    screenshots/failure.svg     the root cause of the crash, opened from the timeline
    screenshots/confirm.svg     the confirm dialog of `r` (Cancel focused)
    screenshots/help.svg        `?`
    screenshots/metrics.svg     `m`: the loss read from the workers' output, across the restart
                                (the restart's marker, the redone steps in orange)
    screenshots/metrics-80x24.svg    the same in an 80x24 terminal

a run of a tiny Hugging Face Trainer (examples/hf_trainer.py, 2 workers), its output as the
Trainer prints it:

    screenshots/metrics-hf.svg  `m`: the Trainer's loss and gradient norm

and a second real run, examples/hang.py with 8 gloo ranks on two agents, rank 3 stalled
before its all_reduce:

    screenshots/stacks.svg      `d`: every rank's stacks grouped, the odd group opened
    screenshots/home.svg        `esc`: the home screen listing both jobs

`scripts/screenshots.py metrics` makes the metrics views only (metrics*.svg).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_console.tui.app import ConsoleApp

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "screenshots"
SIZE = (150, 44)
#: The Trainer's steps in metrics-hf.svg (a loss every 3): it runs on past the screenshot.
HF_STEPS = 900


async def until(pilot, cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"screenshots: timed out waiting for {what}")
        await pilot.pause(0.1)


async def shoot(url: str, job: str, only_metrics: bool = False) -> None:
    app = ConsoleApp(job, endpoint=parse_endpoint(url), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        if only_metrics:
            await shoot_metrics(app, pilot)
            return
        view = app.view
        await until(pilot, lambda: view.restarts_used >= 1 and view.state == "running"
                    and view.lines_total > 200, 180, "the restart and fresh output")
        await pilot.pause(1.0)
        app.save_screenshot("overview.svg", str(OUT))
        await pilot.resize_terminal(80, 24)
        await pilot.pause(1.0)
        app.save_screenshot("overview-80x24.svg", str(OUT))
        await pilot.resize_terminal(*SIZE)
        await pilot.pause(0.5)

        await pilot.press("slash", *"loss", "enter")
        await pilot.pause(0.5)
        app.save_screenshot("filtered.svg", str(OUT))
        await pilot.press("escape")
        await pilot.pause(0.3)

        timeline = app.query_one("Timeline")
        timeline.focus()
        failure = next(i for i in range(timeline.option_count)
                       if "worker group failed" in str(timeline.get_option_at_index(i).prompt))
        timeline.highlighted = failure
        await pilot.press("enter")
        await pilot.pause(0.5)
        app.save_screenshot("failure.svg", str(OUT))
        await pilot.press("escape")
        await pilot.pause(0.3)

        await pilot.press("r")
        await pilot.pause(0.5)
        app.save_screenshot("confirm.svg", str(OUT))
        await pilot.press("escape")
        await pilot.pause(0.3)

        await pilot.press("question_mark")
        await pilot.pause(0.5)
        app.save_screenshot("help.svg", str(OUT))
        await pilot.press("escape")
        await pilot.pause(0.3)
        await shoot_metrics(app, pilot)


async def shoot_metrics(app: ConsoleApp, pilot) -> None:  # type: ignore[no-untyped-def]
    """`m` once the resumed attempt has printed past the step of the crash."""
    from elastic_console.tui.widgets.metrics_screen import MetricsScreen

    metrics = app.view.metrics
    await until(pilot, lambda: len(metrics.curve("loss", "rank0")) > 60
                and len({p.attempt for p in metrics.curve("loss", "rank0")}) > 1, 180,
                "the loss of both attempts")
    await pilot.press("m")
    await until(pilot, lambda: isinstance(app.screen, MetricsScreen), 10, "the metrics view")
    await pilot.pause(1.5)
    app.save_screenshot("metrics.svg", str(OUT))
    await pilot.resize_terminal(80, 24)
    await pilot.pause(1.5)
    app.save_screenshot("metrics-80x24.svg", str(OUT))
    await pilot.resize_terminal(*SIZE)
    await pilot.press("escape")


async def shoot_hf(url: str, job: str) -> None:
    """`m` on the Trainer's run after 60 losses, before its end (its last line, the run's
    summary, would add a chart of one point: train_loss)."""
    from elastic_console.tui.widgets.metrics_screen import MetricsScreen

    app = ConsoleApp(job, endpoint=parse_endpoint(url), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        metrics = app.view.metrics
        await until(pilot, lambda: len(metrics.curve("loss", "rank0")) >= 60, 300,
                    "the Trainer's losses")
        await pilot.press("m")
        await until(pilot, lambda: isinstance(app.screen, MetricsScreen), 10, "the metrics view")
        await pilot.pause(1.5)
        app.save_screenshot("metrics-hf.svg", str(OUT))


def hf_agent(url: str, job: str, tmp: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "elastic_agent.supervision.cli", "--redis", url, "--job-id", job,
         "--nproc-per-node", "2", "--log-dir", tmp, str(ROOT / "examples" / "hf_trainer.py"),
         "--steps", str(HF_STEPS), "--logging-steps", "3", "--output-dir",
         os.path.join(tmp, "hf")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})


async def shoot_hang(url: str, job: str) -> None:
    from elastic_console.tui.home import JobsScreen
    from elastic_console.tui.widgets.stacks import StacksScreen

    app = ConsoleApp(job, endpoint=parse_endpoint(url), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        view = app.view
        await until(pilot, lambda: len(view.ranks) == 8 and view.lines_total >= 8, 180,
                    "8 ranks in the hung collective")
        await pilot.pause(1.0)
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen), 10, "the stacks")
        screen = app.screen
        await until(pilot, lambda: screen.result is not None or screen.error, 60,
                    "every rank's stacks")
        await pilot.press("enter")  # the odd group's frames
        await pilot.pause(0.5)
        app.save_screenshot("stacks.svg", str(OUT))
        await pilot.press("escape")
        await pilot.pause(0.3)
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, JobsScreen), 10, "the job list")
        await pilot.pause(2.5)
        app.save_screenshot("home.svg", str(OUT))


def hung_agents(url: str, job: str, tmp: str) -> list[subprocess.Popen]:
    env = {**os.environ, "HANG_RANK": "3", "HANG_SECONDS": "600"}
    return [subprocess.Popen(
        [sys.executable, "-m", "elastic_agent.supervision.cli", "--redis", url, "--job-id", job,
         "--nnodes", "2", "--nproc-per-node", "4", "--log-dir", tmp,
         str(ROOT / "examples" / "hang.py")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
        for _ in range(2)]


def main() -> int:
    only_metrics = sys.argv[1:] == ["metrics"]
    OUT.mkdir(exist_ok=True)
    job = f"demo-{int(time.time()) % 100000}"
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        agent = subprocess.Popen(
            [sys.executable, "-m", "elastic_agent.supervision.cli", "--redis", server.url,
             "--job-id", job, "--nproc-per-node", "4", "--max-restarts", "3",
             "--log-dir", tmp, str(ROOT / "examples" / "train.py"), "--steps", "400",
             "--crash-rank", "2", "--crash-step", "28", "--checkpoint-every", "10",
             "--sleep", "0.3", "--checkpoint-dir", os.path.join(tmp, "ckpt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            asyncio.run(shoot(server.url, job, only_metrics))
        finally:
            agent.terminate()
            agent.wait(60)
        hf = hf_agent(server.url, f"hf-{job}", tmp)
        try:
            asyncio.run(shoot_hf(server.url, f"hf-{job}"))
        finally:
            hf.terminate()
            hf.wait(60)
        if only_metrics:
            for name in ("metrics", "metrics-80x24", "metrics-hf"):
                print(OUT / f"{name}.svg")
            return 0
        hung = hung_agents(server.url, f"hang-{job}", tmp)
        try:
            asyncio.run(shoot_hang(server.url, f"hang-{job}"))
        finally:
            for a in hung:
                a.terminate()
            for a in hung:
                a.wait(60)
    for name in ("overview", "overview-80x24", "filtered", "failure", "confirm", "help", "metrics",
                 "metrics-80x24", "metrics-hf", "stacks", "home"):
        print(OUT / f"{name}.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
