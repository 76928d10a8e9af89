"""The suite declares what it needs: a test whose module (torch) or program (taskset,
setpriv, pgrep) is missing fails, saying what to install, instead of vanishing as a skip;
only ``ELASTIC_TESTS_ALLOW_MISSING=1``, set by hand where the tool cannot be had, skips it."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ALLOW_MISSING, require, require_program
from tests.test_launcher_parity import cases


def outcome(call: Callable[[], object]) -> tuple[str, str]:
    """How ``call`` ended a test: ("failed"|"skipped", its message), caught here (a skip
    must not end this test as a skip)."""
    try:
        call()
    except pytest.fail.Exception as exc:
        return "failed", str(exc)
    except pytest.skip.Exception as exc:
        return "skipped", str(exc)
    return "returned", ""


def test_a_missing_module_fails_the_test_unless_allowed(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # what an absent torch looks like
    monkeypatch.delenv(ALLOW_MISSING, raising=False)
    how, message = outcome(lambda: require("torch"))
    assert how == "failed" and re.match(r"the Python module torch .*is missing: ", message)
    monkeypatch.setenv(ALLOW_MISSING, "1")
    how, message = outcome(lambda: require("torch"))
    assert how == "skipped" and ALLOW_MISSING in message
    assert require("json").dumps([]) == "[]"


def test_a_missing_program_fails_the_test_unless_allowed(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to find
    monkeypatch.delenv(ALLOW_MISSING, raising=False)
    how, message = outcome(lambda: require_program("taskset"))
    assert how == "failed" and re.match(r"the program taskset is missing: .*ensure-tools\.sh",
                                        message)
    monkeypatch.setenv(ALLOW_MISSING, "1")
    assert outcome(lambda: require_program("taskset"))[0] == "skipped"
    (tmp_path / "taskset").write_text("#!/bin/sh\n")
    (tmp_path / "taskset").chmod(0o755)
    assert require_program("taskset") == str(tmp_path / "taskset")


def test_the_taskset_cases_exist_without_taskset(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path):
    """They are parity cases like the others: their test fails where taskset is missing."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert {"nproc_auto", "nproc_cpu"} <= set(cases(tmp_path))
