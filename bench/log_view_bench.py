"""LogView against Textual's built-in ``Log`` under a 50k lines/s feed, side by side in one run.

Each variant runs headless (``App.run_test``, 160x50) in a child process of its own, so that
its peak RSS (``ru_maxrss``) is its own:

* ``logview``:  our LogView over a LogBuffer(capacity 200_000), all ranks interleaved;
* ``log``:      Textual's ``Log`` (``write_lines``, ``max_lines=200_000``), same lines;
* ``filters``:  LogView again, pressing keys the app binds to change ``rank_filter`` (``r``)
  and ``stderr_only`` (``e``) while the feed runs (``Log`` cannot filter: no counterpart);
* ``unique``:   LogView over the console's ``u`` rows (console/job/dedupe.py: a line many ranks
  printed, once), taken in from the fed ring at each tick as the app does;
* ``tuned``:    LogView with the lines as plain tuples instead of the ``LogLine`` NamedTuple
  and ``gc.freeze()`` after startup. A NamedTuple instance stays tracked by the cyclic GC for
  life (CPython untracks only exact tuples of atomic values), so 200k of them make every full
  collection ~40 ms longer; freezing moves Textual's own startup objects out of the way too.

The feeder is an app timer every 50 ms that pushes the lines due at ``--rate`` lines/s (1024
ranks, realistic training output, ~20% with SGR colours, ~10% stderr): it catches up after a
late tick (capped at 10 ticks' worth), so "absorbed" shows what the app really took in. For
the LogView variants the tick appends to the buffer and calls ``on_new_lines()`` (as the app
will); for ``Log`` it calls ``write_lines()`` with the same texts.

What "key latency" measures: the key event is posted to the app exactly like Pilot does
(through the driver), at t0. The bench subclasses record when the bound action ran, and the
end of the first ``render_lines`` call of the widget after that (the compositor rendering the
widget's new content for the next frame). Latency = that end - t0: queueing behind the feeder,
the action, Textual's refresh scheduling and the widget's own rendering. Keys are pressed one
at a time, 60-180 ms apart (random, seeded), from ~0.5 s into the feed. ``Log``'s bindings
animate scrolling: the first animation frame counts as its repaint.

    python bench/log_view_bench.py [--duration 5] [--rate 50000] [--capacity 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from rich.segment import Segment
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.geometry import Region
from textual.strip import Strip
from textual.widgets import Log

from elastic_console.job.dedupe import UniqueLogs
from elastic_console.job.logbuffer import LogBuffer, LogLine
from elastic_console.tui.widgets.log_view import LogView

SIZE = (160, 50)
RANKS = 1024
TICK = 0.05
FOLLOW_KEYS = ["up", "pageup", "end"]
FILTER_KEYS = ["r", "e", "up", "end", "r", "e"]


def make_pool(n: int = 8192, seed: int = 1) -> list[tuple[str, str]]:
    """(stream, text) pairs that look like the output of a training job."""
    rnd = random.Random(seed)
    pool: list[tuple[str, str]] = []
    for i in range(n):
        r = rnd.random()
        if r < 0.10:
            stream = "err"
            text = rnd.choice([
                "\x1b[33mUserWarning\x1b[0m: torch.utils.checkpoint: the use_reentrant parameter "
                "should be passed explicitly",
                "Traceback (most recent call last):",
                f'  File "/workspace/train.py", line {rnd.randrange(40, 900)}, in train_step',
                "    loss.backward()",
                f"RuntimeError: CUDA out of memory. Tried to allocate {rnd.randrange(2, 900)} MiB",
                f"[W ProcessGroupNCCL.cpp:{rnd.randrange(100, 4000)}] Warning: watchdog heartbeat",
            ])
        elif r < 0.30:
            stream = "out"
            text = (f"epoch {i % 7} step {i:>6}/200000 \x1b[32mloss={rnd.random() * 3:.4f}\x1b[0m "
                    f"lr={rnd.random() * 1e-3:.2e} \x1b[36mgrad_norm={rnd.random() * 5:.3f}\x1b[0m "
                    f"tok/s={rnd.randrange(20_000, 60_000)}")
        else:
            stream = "out"
            text = rnd.choice([
                f"INFO {time.strftime('%Y-%m-%d')} 12:00:{i % 60:02d},123 trainer: step {i} "
                f"samples={i * 32} elapsed={i * 0.21:.1f}s mem={rnd.randrange(9000, 40000)}MiB",
                f"[data] shard {i % 512:04d}/0512 prefetch queue={rnd.randrange(0, 64)} "
                f"io_wait={rnd.random():.3f}s",
                f"checkpoint: wrote /ckpt/run-42/step_{i:08d}/rank_xxx.pt ({rnd.randrange(1, 900)} MiB)",
                f"{{'loss': {rnd.random():.4f}, 'accuracy': {rnd.random():.4f}, "
                f"'epoch': {i % 7}, 'step': {i}}}",
                "x" * rnd.randrange(0, 240),  # some long lines
            ])
        pool.append((stream, text))
    return pool


class Probe:
    """Key latency bookkeeping shared by the bench widgets."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.key = ""
        self.acted = False
        self.done = asyncio.Event()
        self.samples: dict[str, list[float]] = {}

    def start(self, key: str) -> None:
        self.t0, self.key, self.acted = time.perf_counter(), key, False
        self.done.clear()

    def action(self) -> None:
        if self.t0 is not None:
            self.acted = True

    def rendered(self) -> None:
        if self.t0 is not None and self.acted:
            self.samples.setdefault(self.key, []).append((time.perf_counter() - self.t0) * 1000)
            self.t0 = None
            self.done.set()


PROBE: Probe | None = None


def _acted() -> None:
    if PROBE is not None:
        PROBE.action()


class BenchLogView(LogView):
    def render_lines(self, crop: Region) -> list[Strip]:
        lines = super().render_lines(crop)
        if PROBE is not None:
            PROBE.rendered()
        return lines

    def action_line_up(self) -> None:
        _acted()
        super().action_line_up()

    def action_page_up(self) -> None:
        _acted()
        super().action_page_up()

    def action_follow(self) -> None:
        _acted()
        super().action_follow()


class BenchLog(Log):
    def render_lines(self, crop: Region) -> list[Strip]:
        lines = super().render_lines(crop)
        if PROBE is not None:
            PROBE.rendered()
        return lines

    def action_scroll_up(self) -> None:
        _acted()
        super().action_scroll_up()

    def action_page_up(self) -> None:
        _acted()
        super().action_page_up()

    def action_scroll_end(self) -> None:
        _acted()
        super().action_scroll_end()


class BenchApp(App[None]):
    CSS = "BenchLogView, BenchLog { height: 1fr; }"
    BINDINGS = [Binding("r", "cycle_rank", "rank filter"), Binding("e", "toggle_stderr", "stderr")]

    def __init__(self, variant: str, rate: int, capacity: int) -> None:
        super().__init__()
        self.variant = variant
        self.make_line: Any = (lambda *f: f) if variant == "tuned" else LogLine
        self.rate = rate
        self.capacity = capacity
        self.buffer = LogBuffer(capacity)
        self.unique = UniqueLogs(self.buffer) if variant == "unique" else None
        self.pool = make_pool()
        self.pushed = 0
        self.ticks = 0
        self.tick_ms: list[float] = []
        self.started = 0.0
        self.rank_cycle = [None, 17, None, 1000]

    def compose(self) -> ComposeResult:
        if self.variant == "log":
            yield BenchLog(max_lines=self.capacity)
        else:
            yield BenchLogView(self.unique.buffer if self.unique else self.buffer)

    def start_feed(self) -> None:
        self.started = time.perf_counter()
        self.set_interval(TICK, self.tick)

    def batch(self, n: int) -> list[LogLine]:
        pool, npool, base, ms = self.pool, len(self.pool), self.pushed, int(time.time() * 1000)
        make = self.make_line
        out = []
        for i in range(base, base + n):
            stream, text = pool[i % npool]
            out.append(make(ms, (i * 7) % RANKS, stream, text))
        return out

    def tick(self) -> None:
        due = int((time.perf_counter() - self.started) * self.rate) - self.pushed
        due = min(due, int(self.rate * TICK * 10))
        if due <= 0:
            return
        lines = self.batch(due)
        t = time.perf_counter()
        if self.variant == "log":
            self.query_one(BenchLog).write_lines([ln.text for ln in lines])
        else:
            views = self.query(BenchLogView)
            if not views:
                return  # the app is shutting down (a late tick under load)
            self.buffer.extend(lines)
            if self.unique is not None:
                self.unique.sync()
            views.first().on_new_lines()
        self.tick_ms.append((time.perf_counter() - t) * 1000)
        self.pushed += due
        self.ticks += 1

    def action_cycle_rank(self) -> None:
        _acted()
        view = self.query_one(BenchLogView)
        self.rank_cycle.append(self.rank_cycle.pop(0))
        view.rank_filter = self.rank_cycle[0]

    def action_toggle_stderr(self) -> None:
        _acted()
        view = self.query_one(BenchLogView)
        view.stderr_only = not view.stderr_only


async def run_variant(variant: str, duration: float, rate: int, capacity: int) -> dict[str, Any]:
    global PROBE
    app = BenchApp(variant, rate, capacity)
    keys = FILTER_KEYS if variant == "filters" else FOLLOW_KEYS
    rnd = random.Random(5)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        if variant == "tuned":
            gc.freeze()
        gc_pauses: list[float] = []
        gc_start = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if info["generation"] != 2:
                return
            if phase == "start":
                gc_start[0] = time.perf_counter()
            else:
                gc_pauses.append((time.perf_counter() - gc_start[0]) * 1000)

        gc.callbacks.append(on_gc)
        PROBE = probe = Probe()
        app.start_feed()
        await asyncio.sleep(0.5)
        timeouts = 0
        k = 0
        while time.perf_counter() - app.started < duration:
            key = keys[k % len(keys)]
            k += 1
            probe.start(key)
            # What Pilot.press does, without its wait-for-idle (the feed never lets it idle).
            app.post_message(events.Key(key, key if len(key) == 1 else None))
            try:
                await asyncio.wait_for(probe.done.wait(), 2.0)
            except asyncio.TimeoutError:
                timeouts += 1
                probe.t0 = None
            await asyncio.sleep(rnd.uniform(0.06, 0.18))
        elapsed = time.perf_counter() - app.started
        PROBE = None
        gc.callbacks.remove(on_gc)
    return {
        "variant": variant,
        "samples": probe.samples,
        "timeouts": timeouts,
        "absorbed": app.pushed / elapsed,
        "ticks": app.ticks,
        "tick_ms_median": statistics.median(app.tick_ms) if app.tick_ms else 0.0,
        "tick_ms_p95": pct(app.tick_ms, 95),
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gc2_count": len(gc_pauses),
        "gc2_max_ms": max(gc_pauses, default=0.0),
    }


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def child(args: argparse.Namespace) -> None:
    # Warm up Rich/Textual imports and caches so the first key is not an import.
    Strip([Segment("x")], 1)
    result = asyncio.run(run_variant(args.variant, args.duration, args.rate, args.capacity))
    print(json.dumps(result))


def run_child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--duration",
           str(args.duration), "--rate", str(args.rate), "--capacity", str(args.capacity)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"{variant}: the child failed (exit status {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(res: dict[str, Any], keys: list[str]) -> tuple[float, float, float, int]:
    vals = [v for k in keys for v in res["samples"].get(k, [])]
    if not vals:
        return float("nan"), float("nan"), float("nan"), 0
    return statistics.median(vals), pct(vals, 95), max(vals), len(vals)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rate", type=int, default=50_000)
    parser.add_argument("--capacity", type=int, default=200_000)
    parser.add_argument("--variant", default="logview")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0

    import textual

    print(f"log view bench: {SIZE[0]}x{SIZE[1]} headless, {args.rate} lines/s over {RANKS} ranks "
          f"for {args.duration:g} s, capacity {args.capacity}, textual {textual.__version__}, "
          f"Python {sys.version.split()[0]}")
    results = {v: run_child(v, args) for v in ("logview", "log", "filters", "tuned", "unique")}
    rows = [
        ("LogView", "up/pageup/end", results["logview"], FOLLOW_KEYS),
        ("Log (built-in)", "up/pageup/end", results["log"], FOLLOW_KEYS),
        ("LogView", "rank filter", results["filters"], ["r"]),
        ("LogView", "stderr only", results["filters"], ["e"]),
        ("LogView filtered", "up/end", results["filters"], ["up", "end"]),
        ("LogView tuned", "up/pageup/end", results["tuned"], FOLLOW_KEYS),
        ("LogView unique (u)", "up/pageup/end", results["unique"], FOLLOW_KEYS),
    ]
    header = ("widget", "keys", "n", "median ms", "p95 ms", "max ms", "absorbed/s",
              "tick med ms", "tick p95 ms", "full GCs", "GC max ms", "peak RSS MiB")
    table = [header]
    for name, keys_label, res, keys in rows:
        med, p95, mx, n = summary(res, keys)
        table.append((name, keys_label, str(n), f"{med:.1f}", f"{p95:.1f}", f"{mx:.1f}",
                      f"{res['absorbed']:,.0f}", f"{res['tick_ms_median']:.1f}",
                      f"{res['tick_ms_p95']:.1f}", str(res["gc2_count"]), f"{res['gc2_max_ms']:.0f}",
                      f"{res['maxrss_mib']:.0f}"))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    lv, lg = summary(results["logview"], FOLLOW_KEYS), summary(results["log"], FOLLOW_KEYS)
    print(f"\nfollow-mode key latency, Log / LogView: median {lg[0] / lv[0]:.2f}x, "
          f"p95 {lg[1] / lv[1]:.2f}x; peak RSS {results['log']['maxrss_mib']:.0f} vs "
          f"{results['logview']['maxrss_mib']:.0f} MiB")
    for v, res in results.items():
        if res["timeouts"]:
            print(f"{v}: {res['timeouts']} key(s) not repainted within 2 s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
