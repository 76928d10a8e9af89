"""Python stacks of a job's ranks: faulthandler text -> threads and frames -> identical stacks
grouped, the odd ones first.

Pure (no I/O, no Redis, no Textual): the agent parses what its workers dumped, the console
groups and shows what the agents published (:mod:`.stack_replies` moves them). The text comes
from workers, so :func:`parse_faulthandler` takes anything and keeps only what has the shape of
faulthandler's output, with every count and length bounded.

faulthandler (``faulthandler.register(signum, file, all_threads=True)``) writes, for each
thread, newest thread first::

    Thread 0x00007f3a... (most recent call first):
      File "/path/train.py", line 12 in train_step
      File "/path/train.py", line 40 in <module>

    Current thread 0x00007f3b... (most recent call first):
      File "/path/train.py", line 7 in loader

at most 100 frames per thread (``  ...`` after), at most 100 threads, and only printable
ASCII (anything else in a name is written as ``\\xNN``); ``Stack (most recent call first):``
heads the dump of a single thread.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

#: Bounds on what one rank's dump may hold once parsed (faulthandler writes at most 100 of
#: each; a hostile text could claim millions).
MAX_THREADS = 256
MAX_FRAMES = 256
MAX_FILE_CHARS = 1024
MAX_FUNCTION_CHARS = 512
_MAX_LINE = MAX_FILE_CHARS + MAX_FUNCTION_CHARS + 64

_THREAD_RE = re.compile(r"(Current thread|Thread) (0x[0-9a-fA-F]{1,32}) \(most recent call first\):")
_STACK_RE = re.compile(r"Stack \(most recent call first\):")
_FRAME_RE = re.compile(r"  File \"(.*)\", line (\d{1,9}|\?\?\?) in (.*)")

#: How many function names a group's summary shows, innermost first.
SUMMARY_DEPTH = 3
#: Decorator and dispatch frames a summary skips: they say nothing of where the rank is
#: (torch's c10d logging wrapper sits between every collective and its caller).
_PLUMBING = frozenset({"wrapper", "inner", "_wrapper", "wrapped", "decorate_context",
                       "_call_impl", "_wrapped_call_impl"})
ARROW = " \u2190 "


@dataclass(frozen=True)
class Frame:
    file: str
    line: int  # 0 when faulthandler did not know it ("line ???")
    function: str

    def where(self) -> str:
        """``file:line``, as editors and the rest of the console show a position."""
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class ThreadStack:
    """One thread's Python frames, innermost first (faulthandler's "most recent call first")."""

    thread_id: str
    current: bool
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class RankStack:
    """What one rank answered. ``error`` is set (and ``threads`` empty) when it gave no stacks:
    "no answer within 2 s", "not a Python worker (--no-python)", "worker not running"."""

    rank: int
    node: str
    host: str
    pid: int
    threads: tuple[ThreadStack, ...]
    error: str = ""


@dataclass(frozen=True)
class StackGroup:
    """Ranks whose stacks are identical (same frames by file, line and function in every
    thread; thread ids ignored), or that failed to answer with the same error."""

    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    threads: tuple[ThreadStack, ...]
    summary: str
    error: str = ""


def parse_faulthandler(text: str) -> tuple[ThreadStack, ...]:
    """The threads of a faulthandler dump, in the dump's order. Lines of any other shape are
    skipped (a truncated or garbled dump yields what could be read, possibly nothing)."""
    threads: list[ThreadStack] = []
    tid: str | None = None
    current = False
    frames: list[Frame] = []

    def close() -> None:
        if tid is not None and len(threads) < MAX_THREADS:
            threads.append(ThreadStack(tid, current, tuple(frames)))

    for raw in text.split("\n"):
        line = raw[:_MAX_LINE].rstrip("\r")
        if line.startswith("  File "):
            if tid is None:  # frames before any header: one thread of unknown id
                tid, current, frames = "", False, []
            m = _FRAME_RE.fullmatch(line)
            if m is not None and len(frames) < MAX_FRAMES:
                number = m.group(2)
                frames.append(Frame(m.group(1)[:MAX_FILE_CHARS],
                                    int(number) if number.isdigit() else 0,
                                    m.group(3)[:MAX_FUNCTION_CHARS]))
            continue
        m = _THREAD_RE.fullmatch(line)
        if m is not None or _STACK_RE.fullmatch(line):
            close()
            if len(threads) >= MAX_THREADS:
                tid = None
                break
            tid = m.group(2) if m is not None else ""
            current = m is None or m.group(1) == "Current thread"
            frames = []
    else:
        close()
    return tuple(threads)


def render_faulthandler(threads: Iterable[ThreadStack]) -> str:
    """The text faulthandler would have written for ``threads`` (parse's inverse for text it
    wrote itself): how an agent republishes stacks it filtered."""
    parts = []
    for t in threads:
        kind = "Current thread" if t.current else "Thread"
        head = f"{kind} {t.thread_id}" if t.thread_id else "Stack"
        lines = [f"{head} (most recent call first):"]
        lines += [f'  File "{f.file}", line {f.line} in {f.function}' for f in t.frames]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def main_thread(threads: tuple[ThreadStack, ...]) -> ThreadStack | None:
    """The thread a summary names: the one whose outermost frame is a ``<module>`` (the
    program's main thread), else the one that took the signal, else the first."""
    for t in threads:
        if t.frames and t.frames[-1].function == "<module>":
            return t
    for t in threads:
        if t.current:
            return t
    return threads[0] if threads else None


def summarize(threads: tuple[ThreadStack, ...]) -> str:
    """``"all_reduce ← train_step ← main"``: the main thread's innermost function names."""
    t = main_thread(threads)
    if t is None:
        return "no Python frames"
    if not t.frames:
        return "no Python frame"
    names = [f.function for f in t.frames if f.function not in _PLUMBING] or [
        f.function for f in t.frames]
    return ARROW.join(names[:SUMMARY_DEPTH])


def _key(stack: RankStack) -> tuple:
    if stack.error:
        return ("error", stack.error)
    # The order of threads is the interpreter's (newest first), which ranks need not share.
    return ("stacks", tuple(sorted(tuple((f.file, f.line, f.function) for f in t.frames)
                                   for t in stack.threads)))


def group_stacks(stacks: Iterable[RankStack]) -> list[StackGroup]:
    """Identical stacks grouped; the smallest groups first (the odd ranks of a hang), ties by
    lowest rank. A rank listed twice (a duplicated reply) counts once, its first answer."""
    seen: set[int] = set()
    groups: dict[tuple, list[RankStack]] = {}
    for s in stacks:
        if s.rank in seen:
            continue
        seen.add(s.rank)
        groups.setdefault(_key(s), []).append(s)
    out = []
    for members in groups.values():
        members.sort(key=lambda s: s.rank)
        first = members[0]
        summary = first.error if first.error else summarize(first.threads)
        out.append(StackGroup(ranks=tuple(s.rank for s in members),
                              hosts=tuple(sorted({s.host for s in members})),
                              threads=first.threads, summary=summary, error=first.error))
    out.sort(key=lambda g: (len(g.ranks), g.ranks[0]))
    return out


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 4, 6, 7]`` -> ``"0-4,6-7"`` (sorted, duplicates once)."""
    parts = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            parts.append(_run(run))
        run = [r]
    if run:
        parts.append(_run(run))
    return ",".join(parts)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def group_line(group: StackGroup) -> str:
    """``"62 ranks [0-4,6-63]: all_reduce ← train_step ← main"``."""
    n = len(group.ranks)
    return f"{n} rank{'' if n == 1 else 's'} [{format_ranks(group.ranks)}]: {group.summary}"


def group_record(group: StackGroup, frames: int = 20) -> dict:
    """A group as events carry it (``stalled``, ``workers_stopped``, ``group_failed``):
    ranks, hosts, summary, and the main thread's innermost ``frames`` as
    ``[file, line, function]``."""
    t = main_thread(group.threads)
    return {"ranks": list(group.ranks), "hosts": list(group.hosts), "summary": group.summary,
            "frames": [[f.file, f.line, f.function] for f in (t.frames[:frames] if t else ())]}
