"""Metrics read from real frameworks' output, replayed chunk by chunk as the agent reads it.

The fixtures (tests/fixtures/frameworks/, made by scripts/record_framework_output.py) are real
runs of Hugging Face ``Trainer``, Lightning (tqdm and Rich bars) and a plain DDP loop: every
chunk the worker wrote, with its stream and time. Each run's truth is the framework's own
record of its steps and losses (``*.history.json``: the Trainer's ``log_history``, what
Lightning logged at each batch end), not our parser: the points read from the output must
carry the values the framework printed (rounded as printed) at the steps it took them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from elastic_agent.supervision.diagnosis.metric_lines import (
    MAX_NAME,
    might_have_metrics,
    parse_line,
)
from elastic_agent.supervision.diagnosis.metrics import MAX_NAMES, MAX_POINTS, MetricsTracker

FIXTURES = Path(__file__).parent / "fixtures" / "frameworks"


def replay(name: str) -> tuple[dict[str, object], dict[int, dict[str, float]]]:
    """(the rank's latest state, {step: values}) after feeding the fixture as recorded."""
    now = [0.0]
    tracker = MetricsTracker(clock=lambda: now[0])
    points: dict[int, dict[str, float]] = {}
    for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines():
        chunk = json.loads(line)
        now[0] = chunk["t"]
        tracker.feed(0, chunk["s"], chunk["d"].encode("latin-1"))
    now[0] += 10  # anything still waiting for a bar's redraw is settled
    state, pts = tracker.take()[0]
    for p in pts:
        points.setdefault(p.step, {}).update(p.values)
    return state, points


def close(printed: float, exact: float, fmt: str = ".4g") -> bool:
    """``printed`` is ``exact`` as a framework prints it (``fmt``: the Trainer keeps 4
    significant digits, Lightning's tqdm bar 3, its Rich bar 3 decimals)."""
    return math.isclose(printed, float(format(exact, fmt)), rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("name", ["hf_trainer", "hf_trainer_tty"])
def test_the_trainers_dicts_land_at_their_steps(name: str) -> None:
    """The Trainer's dicts carry no step: it comes from the bar the Trainer redraws right
    after each one (on the other pipe, read in either order)."""
    state, points = replay(name)
    truth = [h for h in json.loads((FIXTURES / f"{name}.history.json").read_text()) if "loss" in h]
    assert truth
    for h in truth:
        assert h["step"] in points, (h, sorted(points))
        assert close(points[h["step"]]["loss"], h["loss"]), (h, points[h["step"]])
        assert close(points[h["step"]]["grad_norm"], h["grad_norm"])
    assert sorted(points) == [h["step"] for h in truth]  # nothing else became a point
    assert state["step"] == 20 and state["total"] == 20
    assert "reducer.cpp" not in state["m"]  # a warning that mentions "iteration" is no metric


@pytest.mark.parametrize("name", ["lightning_tqdm", "lightning_rich_tty"])
def test_lightnings_bar_gives_every_step_and_its_loss(name: str) -> None:
    """Lightning's bar counts within an epoch (``Epoch 1: 3/10``): the global step is
    ``epoch * total + n``; a frame shows the previous loss until the step's own is logged,
    and the bar's reset at an epoch's end is no step back."""
    state, points = replay(name)
    truth = json.loads((FIXTURES / f"{name}.history.json").read_text())
    assert len(truth) == 20
    fmt = ".3g" if name == "lightning_tqdm" else ".3f"  # tqdm prints 5.490, Rich 5.486
    for step, loss in truth:
        assert close(points[step]["train_loss"], loss, fmt), (step, loss, points.get(step))
    assert set(points) == {step for step, _ in truth}
    assert state["step"] == 20
    if name == "lightning_rich_tty":
        assert state["total"] == 20  # Rich says "Epoch 0/1": two epochs of 10


def test_a_plain_loops_step_lines() -> None:
    state, points = replay("ddp_train")
    printed = {}
    for line in (FIXTURES / "ddp_train.jsonl").read_text().splitlines():
        for text in json.loads(line)["d"].splitlines():
            words = text.split()
            if len(words) == 4 and words[0] == "step" and words[2] == "loss":
                printed[int(words[1])] = float(words[3])
    assert len(printed) == 12
    assert {s: v["loss"] for s, v in points.items()} == printed
    assert state["m"] == {"loss": printed[11]}  # "done: 12 steps, final loss ..." is no metric


@pytest.mark.parametrize(("line", "step", "values"), [
    ("step: 10  loss: 5.2  memory: 12.3GiB(15%)  tps: 1234  mfu: 12.3%", 10,
     {"loss": 5.2, "tps": 1234.0, "mfu": 12.3}),  # torchtitan: units are not numbers
    ("loss=0.5 lr=1e-4", None, {"loss": 0.5, "lr": 1e-4}),
    ("iter 5/100 lr=0.001 loss: nan", 5, {"lr": 0.001, "loss": math.nan}),
    ('{"step": 3, "loss": 1.25}', 3, {"loss": 1.25}),
    ('{"elastic_metrics": {"step": 12, "total": 500, "loss": 0.25, "acc": 0.5}}', 12,
     {"loss": 0.25, "acc": 0.5}),
])
def test_common_line_formats(line: str, step: int | None, values: dict[str, float]) -> None:
    m = parse_line(line)
    assert m is not None and m.step == step
    assert m.values.keys() == values.keys()
    for k, v in values.items():
        assert (math.isnan(v) and math.isnan(m.values[k])) or m.values[k] == v


@pytest.mark.parametrize("line", [
    "MASTER_PORT=29500", "pid: 1234", "rank 0 line 0000123 the quick brown fox",
    "done: 12 steps, final loss 0.3803", "2026-11-28 12:00:01 INFO epoch 3 done",
    "{'port': 29500, 'host': 'x'}",
])
def test_lines_that_are_not_metrics(line: str) -> None:
    assert parse_line(line) is None


def test_the_cheap_test_passes_plain_output_and_catches_metrics() -> None:
    assert not might_have_metrics(b"rank 0 line 0000123 the quick brown fox jumps\n" * 100)
    assert might_have_metrics(b"x\n" * 100 + b"step 3 loss 0.5\n")
    assert might_have_metrics(b"\r 16/40 [00:04<00:06, 3.77it/s]")


@pytest.mark.parametrize("line", [b"step 34 loss 0.2460", b"Step 3 loss 1.5", b"iter 5 loss 2",
                                  b"Iteration 7 loss 0.1", b"global step 5 loss 1",
                                  b"step #9 loss 3"])
def test_the_cheap_test_finds_step_first_lines_without_punctuation(line: bytes) -> None:
    """The one format with no ``=``, ``:`` or ``/`` (the bytes found by memchr) is found by
    its step word: a chunk with such a line anywhere in plain text is parsed, and the line
    gives its step."""
    assert might_have_metrics(b"rank 0 the quick brown fox\n" * 50 + line + b"\n")
    m = parse_line(line.decode())
    assert m is not None and m.step is not None and m.values


def test_the_exact_format_is_not_guessed_at() -> None:
    """A line under the reserved key is the script's word: names that fail the rules are
    dropped, not mangled, and nothing else on it is parsed."""
    m = parse_line('{"elastic_metrics": {"step": 2, "bad name": 1, "ok": true, "x": 3}}')
    assert m is not None and m.exact and m.step == 2 and m.values == {"x": 3.0}


def test_a_worker_cannot_grow_the_trackers_memory() -> None:
    """A billion distinct names, numbers of any size, a line without end: bounded."""
    tracker = MetricsTracker()
    for i in range(5000):
        tracker.feed(0, "out", f"step {i} loss{i} {10 ** 300} name_{i}=1e999\n".encode())
    tracker.feed(0, "out", b"step 1 loss=" + b"9" * 10_000_000)  # a number 10 MB long, no end
    r = tracker.ranks[0]
    assert len(r.values) == MAX_NAMES and r.dropped == 5000 - MAX_NAMES
    assert len(r.points) <= MAX_POINTS
    assert all(len(name) <= MAX_NAME for name in r.values)
    assert sum(len(t) for t in tracker._tails.values()) <= 8192
    assert r.nan is not None  # 1e999 is inf: the first non-finite value is kept


def test_a_non_finite_value_is_reported_once_with_its_rank_and_step() -> None:
    tracker = MetricsTracker()
    tracker.feed(3, "out", b"step 7 loss 0.5\nstep 8 loss nan\nstep 9 loss inf\n")
    assert tracker.new_nans == [(3, 8, "loss")]
    assert tracker.ranks[3].nan == (8, "loss")
