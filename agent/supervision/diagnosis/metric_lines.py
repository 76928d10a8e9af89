"""Training metrics read from what a worker prints, with no change to the training script.

One line (or one frame of a line redrawn with ``\\r``) is read as:

- the exact format, for scripts that want it: one JSON object on a line under the reserved
  key ``elastic_metrics``, ``{"elastic_metrics": {"step": 12, "total": 500, "loss": 0.25}}``
  (docs/METRICS.md); nothing else on such a line is guessed;
- a progress bar: tqdm's ``16/40 [00:04<00:06, 3.77it/s, loss=0.5]`` (Lightning's
  ``Epoch 1:  10%|█  | 1/10 [..., train_loss=5.000]``) and Rich's
  ``Epoch 1/2 ━━━━ 10/20 0:00:01 • 0:00:02 9.87it/s v_num: 9 train_loss: 5.000``: the step
  and total, the rate, and the postfix's named numbers;
- a dict or JSON object (Hugging Face ``Trainer``'s ``{'loss': '4.709', 'epoch': '0.125'}``,
  whose values are quoted strings, or ``{"step": 3, "loss": 1.2}``);
- a line that starts with its step: ``step 34 loss 0.2460``, ``step: 10  loss: 5.2  tps: 1234``,
  ``iter 5/100 lr=0.001``;
- ``key=value`` and ``key: value`` pairs anywhere in a line, but only on a line that names a
  training quantity (a step, an epoch, a loss, a learning rate, a gradient norm, an accuracy):
  ``MASTER_PORT=29500`` or ``pid: 1234`` alone is not a metric.

Everything here is pure and bounded: a name is at most :data:`MAX_NAME` characters of
``[A-Za-z0-9_./-]``, a number token at most :data:`MAX_NUMBER` characters, a line at most
:data:`MAX_LINE` characters is looked at (a longer one is cut first). Values are floats and
may be NaN or infinite (the caller decides what that means).

Speed: the agent feeds every chunk a worker writes through :func:`might_have_metrics`, a few
C-speed searches over the raw bytes, before any line is split or decoded: output with nothing
metric-like (``rank 0 line 0000123 the quick brown fox``) costs those searches only. A line
that gets to :func:`parse_line` (one with a ``:``, like a timestamp) is turned away by plain
substring tests before any regex runs when it has no bar rate and names no training quantity:
about 2 us, against 16 us for the full parse.
"""

from __future__ import annotations

import json
import math
import re
from typing import NamedTuple

#: The reserved key of the exact format.
EXACT_KEY = "elastic_metrics"
MAX_NAME = 48
MAX_NUMBER = 32
MAX_LINE = 4096
#: Named numbers kept from one line (a dict of 500 keys keeps its first 64).
MAX_VALUES_PER_LINE = 64

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|NaN|NAN|inf|Inf|INF|infinity|Infinity)"
_NAME = r"[A-Za-z_][A-Za-z0-9_./-]{0,47}"

#: A line that starts with its step and holds no ``=``, ``:`` or ``/`` (``step 34 loss 0.25``,
#: ``Iteration 7``, ``global step 5``): every other format has one of those three bytes, which
#: :func:`might_have_metrics` finds with memchr. The pattern starts with a literal (``te``), so
#: the regex engine scans for it in C instead of trying every position (~2 GB/s, where an
#: alternation of classes ran at 10 MB/s; a case-blind one as slowly). So ``STEP 34 LOSS 0.25``,
#: all in capitals with none of the three bytes, is not read.
_STEP_WORD = re.compile(rb"te(?:p|r|ration)[\s#]*\d")

_PAIR = re.compile(
    rf"(?<![\w.])['\"]?(?P<k>{_NAME})['\"]?\s*(?:=|:)\s*['\"]?(?P<v>{_NUM})['\"]?(?![\w.:/])")
_SPACED_PAIR = re.compile(
    rf"(?<![\w.])(?P<k>{_NAME})\s*(?:[=:]\s*|\s+)['\"]?(?P<v>{_NUM})['\"]?(?![\w.:/])")
_STEP_FIRST = re.compile(
    r"^\W{0,3}(?:global[_ ]step|step|iteration|iter)\b\s*[:=#]?\s*(?P<n>\d{1,12})"
    r"(?:\s*(?:/|of)\s*(?P<total>\d{1,12}))?", re.IGNORECASE)
_BAR = re.compile(
    r"(?:Epoch\s+(?P<epoch>\d{1,9})\s*:.*?)?(?P<n>\d{1,12})/(?P<total>\d{1,12}|\?)\s*"
    r"\[(?P<elapsed>[\d:]{1,12})<(?P<left>[\d:?]{1,12}),\s*(?P<rate>[\d.]{1,12}|\?)\s*"
    r"(?P<unit>it/s|s/it)(?P<post>[^\]]{0,2000})\]")
_RICH_BAR = re.compile(
    r"(?:Epoch\s+(?P<epoch>\d{1,9})(?:/(?P<epochs>\d{1,9}))?\s+)?[━╸╺─╾╼ ]{2,}\s*"
    r"(?P<n>\d{1,12})/(?P<total>\d{1,12})\s+[\d:]{1,12}\s*•\s*[-\d:]{1,12}\s+"
    r"(?P<rate>[\d.]{1,12})(?P<unit>it/s|s/it)(?P<post>.{0,2000})")
#: A line with a number named one of these is a training line: its other named numbers are
#: metrics too (``train_loss=0.5 port=29500``), where ``port=29500`` alone is not.
_ANCHOR = re.compile(
    r"(?:^|[_./-])(?:loss|lr|learning_rate|grad_norm|step|global_step|iter|iteration|"
    r"epoch|acc|accuracy|ppl|perplexity|tps|mfu|throughput|tokens_per_sec)(?:$|[_./-])",
    re.IGNORECASE)
#: Substrings one of which every anchored line holds (lower case): a cheap test first.
_ANCHOR_WORDS = ("loss", "lr", "learning_rate", "grad_norm", "step", "iter", "epoch", "acc",
                 "ppl", "perplexity", "tps", "mfu", "throughput", "tokens_per_sec")
#: A bar with such a label counts something else than training steps.
_OTHER_BAR = re.compile(r"valid|sanity|test|predict|eval", re.IGNORECASE)
_STEP_NAMES = frozenset({"step", "global_step", "iteration", "iter", "it", "train/global_step"})
_TOTAL_NAMES = frozenset({"total", "max_steps", "total_steps"})


class LineMetrics(NamedTuple):
    """What one line or frame said. ``step``: None when the line names no step (a Trainer
    dict); ``epoch`` set with a per-epoch bar (Lightning counts steps from 0 each epoch)."""

    step: int | None = None
    total: int | None = None
    epoch: int | None = None
    epochs: int | None = None
    rate: float | None = None  # steps a second
    values: dict[str, float] = {}
    bar: bool = False
    exact: bool = False
    other: bool = False  # a bar of validation, testing, prediction: not the training steps


def might_have_metrics(data: bytes) -> bool:
    """Whether ``data`` (raw worker output) may hold a metric line: a cheap test before any
    split or decode. False only when no line of it could be parsed (but a step-first line in
    capitals, see ``_STEP_WORD``): every other format has ``=``, ``:`` or ``/`` (three
    memchr), and a step-first line its step word before a number. ~0.15 ms for 256 KiB of
    plain text here (bench/launch_bench.py c prints such text)."""
    return (b":" in data or b"=" in data or b"/" in data
            or _STEP_WORD.search(data) is not None)


def parse_line(text: str) -> LineMetrics | None:
    """The metrics one line (or bar frame) holds, or None."""
    if len(text) > MAX_LINE:
        text = text[:MAX_LINE]
    stripped = text.strip()
    if not stripped:
        return None
    if EXACT_KEY in stripped and stripped.startswith("{"):
        return _exact(stripped)
    if "it/s" in stripped or "s/it" in stripped:  # every bar shows its rate, "?it/s" at first
        bar = _bar(stripped)
        if bar is not None:
            return bar
    m = _STEP_FIRST.match(stripped)
    if m is not None and not stripped.startswith("{"):
        values = _pairs(stripped[m.end():], spaced=True)
        step = int(m["n"])
        total = int(m["total"]) if m["total"] else None
        return LineMetrics(step=step, total=total, values=values)
    low = stripped.lower()
    if not any(word in low for word in _ANCHOR_WORDS):
        return None  # no pair can be anchored: the regexes below would find nothing to keep
    values = _pairs(stripped)
    return _with_step(values) if _anchored(values) else None


def _anchored(values: dict[str, float]) -> bool:
    return any(_ANCHOR.search(name) is not None for name in values)


def _with_step(values: dict[str, float]) -> LineMetrics:
    step = total = None
    for name in list(values):
        low = name.lower()
        if low in _STEP_NAMES and _is_count(values[name]):
            step = int(values.pop(name))
        elif low in _TOTAL_NAMES and _is_count(values[name]):
            total = int(values.pop(name))
    return LineMetrics(step=step, total=total, values=values)


def _is_count(v: float) -> bool:
    return math.isfinite(v) and v >= 0 and v == int(v) and v < 1e15


def _number(token: str) -> float | None:
    if len(token) > MAX_NUMBER:
        return None
    try:
        return float(token)
    except ValueError:
        return None


def _pairs(text: str, spaced: bool = False) -> dict[str, float]:
    out: dict[str, float] = {}
    pattern = _SPACED_PAIR if spaced else _PAIR
    for m in pattern.finditer(text):
        value = _number(m["v"])
        if value is None:
            continue
        out.setdefault(m["k"], value)
        if len(out) >= MAX_VALUES_PER_LINE:
            break
    return out


def _bar(text: str) -> LineMetrics | None:
    for pattern, rich in ((_BAR, False), (_RICH_BAR, True)):
        m = pattern.search(text)
        if m is None:
            continue
        n = int(m["n"])
        total = int(m["total"]) if m["total"] not in (None, "?") else None
        rate = _number(m["rate"]) if m["rate"] not in (None, "?") else None
        if rate is not None and m["unit"] == "s/it":
            rate = 1.0 / rate if rate > 0 else None
        post = m["post"] or ""
        values = _pairs(post) if rich is False else _pairs(post, spaced=True)
        values.pop("v_num", None)  # Lightning's logger version, not a metric
        epoch = int(m["epoch"]) if m["epoch"] is not None else None
        # Rich's "Epoch 1/2" counts epochs from 0 to max_epochs - 1 (Lightning's description).
        epochs = int(m["epochs"]) + 1 if rich and m["epochs"] is not None else None
        label = text[:m.start()]
        other = m["epoch"] is None and _OTHER_BAR.search(label) is not None
        return LineMetrics(step=n, total=total, epoch=epoch, epochs=epochs, rate=rate,
                           values=values, bar=True, other=other)
    return None


def _exact(text: str) -> LineMetrics | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    body = obj.get(EXACT_KEY) if isinstance(obj, dict) else None
    if not isinstance(body, dict):
        return None
    values: dict[str, float] = {}
    step = total = None
    for key, raw in list(body.items())[:MAX_VALUES_PER_LINE + 2]:
        if not isinstance(key, str) or type(raw) not in (int, float):
            continue
        if key == "step" and type(raw) is int and raw >= 0:
            step = raw
        elif key == "total" and type(raw) is int and raw >= 0:
            total = raw
        elif re.fullmatch(_NAME, key):
            values[key] = float(raw)
    return LineMetrics(step=step, total=total, values=values, exact=True)
